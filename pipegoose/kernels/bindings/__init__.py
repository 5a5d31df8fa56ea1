"""C++ bindings (``<kernel>.cpp``: ``TORCH_LIBRARY_FRAGMENT(pipegoose, m)`` schemas + CUDA impls) and their fake
impls (``<kernel>.py``). The ``.py`` modules are imported by the builder after the library is loaded, never here."""
