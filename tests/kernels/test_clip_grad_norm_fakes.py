"""CPU: the fake (meta) impls of ``pipegoose::multi_tensor_norm`` / ``multi_tensor_mul_``
(``pipegoose/kernels/bindings/clip_grad_norm.py``) give the kernels' shapes and dtypes and refuse what the binding
refuses, under FakeTensorMode with fake CUDA tensors (no GPU needed). Marked ``slow``: the kernel compiles once
(about 35 s for one architecture; cached afterwards). The kernels' values are tested on a GPU in
``test_clip_grad_norm_cuda.py``."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_loading import load_or_skip

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ops():
    load_or_skip("pipegoose/clip_grad_norm")
    return torch.ops.pipegoose


def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fakes_give_the_kernels_shapes(ops, dtype):
    with _fake_mode():
        ts = [torch.empty(5, device="cuda", dtype=dtype), torch.empty(0, device="cuda", dtype=dtype),
              torch.empty(3, 7, device="cuda", dtype=dtype)]
        for norm_type in (1.0, 2.0, math.inf):
            n = ops.multi_tensor_norm(ts, norm_type)
            assert n.shape == () and n.dtype == torch.float32 and n.device.type == "cuda"
        assert ops.multi_tensor_mul_(ts, torch.empty((), device="cuda")) is None
        assert ops.multi_tensor_mul_(ts, torch.empty(1, device="cuda")) is None


def test_fakes_refuse_what_the_binding_refuses(ops):
    with _fake_mode():
        ts = [torch.empty(5, device="cuda"), torch.empty(7, device="cuda")]
        for bad, match in (
                (lambda: ops.multi_tensor_norm([], 2.0), "tensors must hold at least one tensor"),
                (lambda: ops.multi_tensor_norm(ts, 3.0), "norm_type must be 1, 2 or inf, got 3.0"),
                (lambda: ops.multi_tensor_norm(ts, -math.inf), "norm_type must be 1, 2 or inf"),
                (lambda: ops.multi_tensor_norm([ts[0], ts[1].half()], 2.0), r"tensors\[1\] is torch.float16"),
                (lambda: ops.multi_tensor_norm([t.double() for t in ts], 2.0), "must be float32, float16 or bf"),
                (lambda: ops.multi_tensor_norm([ts[0], torch.empty(4, 2, device="cuda").t()], 2.0),
                 r"tensors\[1\] must be contiguous"),
                (lambda: ops.multi_tensor_mul_([], torch.empty((), device="cuda")), "at least one tensor"),
                (lambda: ops.multi_tensor_mul_(ts, torch.empty(2, device="cuda")),
                 "coef must be a float32 tensor of one element, got torch.float32 with 2 elements"),
                (lambda: ops.multi_tensor_mul_(ts, torch.empty((), device="cuda", dtype=torch.float64)),
                 "coef must be a float32 tensor of one element"),
                (lambda: ops.multi_tensor_mul_(ts, torch.empty(())), r"coef is on cpu but tensors\[0\] is on cuda")):
            with pytest.raises(RuntimeError, match=match):
                bad()
