"""Loading a kernel of the manifest in a test that needs its library (fake impls, C++ autograd on meta tensors):
skipped, with the builder's reason, where it cannot be built here (no nvcc, a CUDA major that does not match); and a
log of the ops such a test calls."""

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


def calls_of(ops_to_log):
    """A ``TorchDispatchMode`` that records, in order, the names of the calls of ``ops_to_log`` (e.g.
    ``{"pipegoose::rope_backward"}``) in its ``calls`` list: ``with calls_of({...}) as log: ...; log.calls``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.name() in ops_to_log:
                self.calls.append(func.name())
            return func(*args, **(kwargs or {}))

    return Log()
