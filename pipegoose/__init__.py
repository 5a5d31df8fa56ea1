"""pipegoose: fused CUDA training kernels for Hugging Face transformers models.

Layers (a lower layer does not import a higher one; docs/architecture.md names the two exceptions):
``kernels.yaml`` -> ``tools/port.py`` (``pipegoose.porting``) -> ``vendor/`` -> ``pipegoose.kernels``
(manifest, builder, cache, bindings, our CUDA) -> ``pipegoose.nn.fusion`` (functional, modules, dispatch, fuse).
"""

__version__ = "0.1.0.dev0"
