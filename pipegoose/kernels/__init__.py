"""Build, cache and load fused CUDA kernels declared in ``kernels.yaml``.

Importing this package does not import torch; the builder is loaded on first use so that the manifest
(``pipegoose.kernels.manifest``) serves ``tools/port.py`` on machines without torch.
"""

from __future__ import annotations

from typing import Any

from .manifest import Kernel, Manifest, ManifestError, ManifestNotFoundError, Source, load_manifest

# Names served lazily from ``builder`` (importing it imports torch).
_BUILDER_NAMES = ("KernelBuilder", "KernelOps", "BuildResult", "load", "KernelError", "KernelBuildError",
                  "KernelBuildBusyError", "KernelUnavailableError")

__all__ = ["Kernel", "Manifest", "ManifestError", "ManifestNotFoundError", "Source", "load_manifest", *_BUILDER_NAMES]


def __getattr__(name: str) -> Any:  # lazy: builder pulls in torch
    if name not in _BUILDER_NAMES:  # submodules and everything else take the normal path (no recursion)
        raise AttributeError(f"module 'pipegoose.kernels' has no attribute {name!r}")
    from . import builder

    return getattr(builder, name)
