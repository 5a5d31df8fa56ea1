"""Build, cache and load fused CUDA kernels declared in ``kernels.yaml``.

Importing this package does not import torch; the builder is loaded on first use so that the manifest
(``pipegoose.kernels.manifest``) serves ``tools/port.py`` on machines without torch.
"""

from __future__ import annotations

from typing import Any

from .manifest import Kernel, Manifest, ManifestError, Source, load_manifest

__all__ = ["Kernel", "Manifest", "ManifestError", "Source", "load_manifest"]


def __getattr__(name: str) -> Any:  # lazy: builder pulls in torch
    from . import builder

    try:
        return getattr(builder, name)
    except AttributeError:
        raise AttributeError(f"module 'pipegoose.kernels' has no attribute {name!r}") from None
