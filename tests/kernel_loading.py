"""Loading a kernel of the manifest in a test that needs its library (fake impls, C++ autograd on meta tensors):
skipped, with the builder's reason, where it cannot be built here (no nvcc, a CUDA major that does not match)."""

from __future__ import annotations

import pytest

from pipegoose.kernels.builder import KernelBuilder, KernelUnavailableError


def load_or_skip(kernel: str):
    """``KernelBuilder(kernel).load()``, or ``pytest.skip`` naming the failed preflight checks."""
    b = KernelBuilder(kernel)
    try:
        failed = [c for c in b.preflight() if not c.ok]
    except KernelUnavailableError as e:
        pytest.skip(str(e))
    if failed:
        pytest.skip("; ".join(f"{c.name}: {c.detail}" for c in failed))
    return b.load()
