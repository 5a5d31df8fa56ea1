"""The norms' C++ autograd formula asks the backward op for the parameter gradients autograd needs, and only those
(``weight_grad`` / ``bias_grad``: a frozen parameter's gradient is not computed), for every combination of given and
trainable parameters. Run on meta tensors (the ops' fake impls): no GPU needed; the kernel library must load.

Marked ``slow``: it compiles pipegoose/layer_norm and pipegoose/rms_norm once if the cache lacks them. Skips, with the
reason, where nvcc is missing.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernel_loading import load_or_skip

pytestmark = pytest.mark.slow


def _load(kid: str) -> None:
    load_or_skip(kid)


class _BackwardFlags(TorchDispatchMode):
    """Records the (weight_grad, bias_grad) flags each pipegoose norm backward op is called with (defaults filled)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.name()
        if name in ("pipegoose::layer_norm_backward", "pipegoose::rms_norm_backward"):
            schema = func._schema.arguments
            given = {a.name: v for a, v in zip(schema, args)} | kwargs
            self.calls.append((name, tuple(given.get(a.name, a.default_value) for a in schema
                                           if a.name.endswith("_grad"))))
        return func(*args, **kwargs)


@pytest.mark.parametrize("w_state,b_state", list(itertools.product(["none", "frozen", "trained"], repeat=2)))
def test_layer_norm_backward_is_asked_for_the_needed_gradients_only(w_state, b_state):
    _load("pipegoose/layer_norm")

    def param(state):
        return None if state == "none" else torch.randn(64, device="meta", requires_grad=state == "trained")

    x = torch.randn(8, 64, device="meta", requires_grad=True)
    w, b = param(w_state), param(b_state)
    y = torch.ops.pipegoose.layer_norm(x, w, b, 1e-5, None)
    with _BackwardFlags() as log:
        y.backward(torch.ones_like(y))
    assert log.calls == [("pipegoose::layer_norm_backward", (w_state == "trained", b_state == "trained"))]
    assert x.grad is not None and x.grad.shape == x.shape
    for p, state in ((w, w_state), (b, b_state)):
        if p is not None:
            assert (p.grad is not None) == (state == "trained")


@pytest.mark.parametrize("w_state", ["none", "frozen", "trained"])
def test_rms_norm_backward_is_asked_for_the_needed_gradients_only(w_state):
    _load("pipegoose/rms_norm")
    x = torch.randn(8, 64, device="meta", requires_grad=True)
    w = None if w_state == "none" else torch.randn(64, device="meta", requires_grad=w_state == "trained")
    y = torch.ops.pipegoose.rms_norm(x, w, 1e-6, None)
    with _BackwardFlags() as log:
        y.backward(torch.ones_like(y))
    assert log.calls == [("pipegoose::rms_norm_backward", (w_state == "trained",))]
    if w is not None:
        assert (w.grad is not None) == (w_state == "trained")
