"""benchmarks/quick_norms.py's byte counts and PyTorch side, on the CPU (the script itself needs a GPU)."""

import _bench_path  # noqa: F401
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.quick_norms import pass_bytes, torch_fns


def test_byte_counts_are_the_suites():
    """A review: the LayerNorm backward was charged 3N + 4H + 8R (b read, which the backward does not need), where
    benchmarks/byte_counts.py (the suite and its README) says 3N + 3H + 8R."""
    r, h, s = 16384, 4096, 2
    n = r * h
    ln_fwd = 2 * n * s + 2 * h * s + 8 * r
    ln_bwd = 3 * n * s + 3 * h * s + 8 * r
    assert pass_bytes("layer_norm", r, h, "bfloat16") == {"fwd": ln_fwd, "fwd+bwd": ln_fwd + ln_bwd}
    rms_fwd = 2 * n * s + h * s + 4 * r
    rms_bwd = 3 * n * s + 2 * h * s + 4 * r
    assert pass_bytes("rms_norm", r, h, "bfloat16") == {"fwd": rms_fwd, "fwd+bwd": rms_fwd + rms_bwd}


class _Ops(TorchDispatchMode):
    """Records the aten ops run under it (the autograd engine's too: an accumulation into .grad is an add_)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_torch_fwd_bwd_returns_the_gradients_and_accumulates_nothing(op):
    """A review: the timed PyTorch fwd+bwd called .backward(dy) on leaves whose .grad was reset only after the timed
    repetitions, so every call after the first also ran an in-place grad += ... per leaf (more work than our side)."""
    torch.manual_seed(0)
    x, dy = torch.randn(8, 32), torch.randn(8, 32)
    w, b = torch.randn(32), torch.randn(32)
    ref_f, ref_fb = torch_fns(op, x, w, b, dy, 1e-5)
    calls = []
    for _ in range(3):
        with _Ops() as rec:
            grads = ref_fb()
        calls.append(rec.ops)
    # every call does the same work as the first (the timed calls follow a warm-up): no grad += ... after it
    assert calls[1] == calls[0] and calls[2] == calls[0], [o for o in calls[1] if o not in calls[0] or "add_" in o]
    assert len(grads) == (3 if op == "layer_norm" else 2)
    # the gradients are those of autograd on fresh leaves
    leaves = [t.clone().requires_grad_() for t in ((x, w, b) if op == "layer_norm" else (x, w))]
    y = (torch.nn.functional.layer_norm(leaves[0], (32,), leaves[1], leaves[2], 1e-5) if op == "layer_norm"
         else torch.nn.functional.rms_norm(leaves[0], (32,), leaves[1], 1e-5))
    for got, want in zip(grads, torch.autograd.grad(y, leaves, dy)):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(ref_f(), y.detach())


def test_torch_fns_names_a_bad_op():
    with pytest.raises(ValueError, match="op: expected 'layer_norm' or 'rms_norm', got 'softmax'"):
        torch_fns("softmax", torch.zeros(2, 4), torch.ones(4), None, torch.zeros(2, 4), 1e-5)
