"""GPU: ``pipegoose::squared_relu_forward(x)`` / ``squared_relu_backward(grad_output, x)`` and the autograd op
``pipegoose::squared_relu`` (ours: squared ReLU alone, transformers' ``relu2``, on the SwiGLU kernel library's launch
with one input: ``pipegoose/kernels/csrc/swiglu.cu``, binding ``pipegoose/kernels/bindings/swiglu.cpp``)

    out = relu(x)^2,  grad_x = grad_output * 2 relu(x)  (0 where x <= 0)

against float64 on the CPU from the same (already rounded) inputs, with the per-dtype tolerances of
``tests/tolerances.py``, and bit for bit against eager PyTorch's ``torch.square(F.relu(x))`` and its backward (what
transformers' ``ReLUSquaredActivation`` runs: each value one product of two values of the dtype, rounded once),
also at the edges (NaN, infinities, overflow past the dtype's range, an infinite grad_output where x <= 0): sizes
around the vector width and large ones, non-contiguous inputs (copied), misaligned views (the scalar path, bit for bit
the vector path's), empty tensors, the argument checks, ``torch.library.opcheck`` and a double backward. Outputs are
poisoned first (``poison``) and every element is checked finite where the reference is.

Run on the GPU machine: ``python -m pytest -m cuda tests/kernels/test_squared_relu_cuda.py -q``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import at_offset as _at_offset
from kernel_helpers import check_elementwise as check
from kernel_helpers import poison, seed_of
from tolerances import tol

pytestmark = pytest.mark.cuda

DEV = "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# one element (0-d, 1-d); around the vector width (8 16-bit or 4 fp32 values); odd; one block's vectors and one past
# them; a Nemotron-4-15B MLP's activation (intermediate size 24576) over 128 tokens
SHAPES = [(), (1,), (7,), (8,), (9,), (3, 5, 1001), (4096,), (4097,), (1_000_003,), (128, 24576)]


@pytest.fixture(scope="module")
def ops():
    from pipegoose.kernels import load

    return load("pipegoose/swiglu")


def make(shape, dtype, seed, scale=3.0):
    """x (N(0, scale^2): both sides of the bend) and grad_output, on the GPU in ``dtype``."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(shape, generator=gen, device=DEV) * scale).to(dtype)
    dy = torch.randn(shape, generator=gen, device=DEV).to(dtype)
    return x, dy


def ref64(x, dy):
    """float64 on the CPU: (out, grad_x)."""
    x64 = x.detach().cpu().double().requires_grad_()
    y = torch.square(F.relu(x64))
    (dx,) = torch.autograd.grad(y, x64, dy.detach().cpu().double())
    return y.detach(), dx


def eager(x, dy):
    """Eager PyTorch on the GPU, in the dtype (transformers' ReLUSquaredActivation): (out, grad_x)."""
    xx = x.detach().clone().requires_grad_()
    y = torch.square(F.relu(xx))
    (dx,) = torch.autograd.grad(y, xx, dy)
    return y.detach(), dx


def same_bits(name, got, want):
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{name}: {m}")


def run_ops(ops, x, dy, what=""):
    """Both kernels on poisoned outputs, checked against float64 and bit for bit against eager PyTorch."""
    poison((x.shape, x.dtype))
    y = ops.squared_relu_forward(x)
    poison((x.shape, x.dtype))
    dx = ops.squared_relu_backward(dy, x)
    for name, got, want64, want in zip(("out", "grad_x"), (y, dx), ref64(x, dy), eager(x, dy)):
        check(f"{what}{name}", got, want64, x.dtype, x.shape)
        same_bits(f"{what}{name} (eager)", got, want)
    return y, dx


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_squared_relu_ops_match_float64_and_eager_bit_for_bit(ops, dtype, shape):
    x, dy = make(shape, dtype, seed_of("squared_relu", shape, dtype))
    before = [t.clone() for t in (x, dy)]
    y, _ = run_ops(ops, x, dy)
    assert all(torch.equal(a, b) for a, b in zip((x, dy), before)), "an input changed"
    if x.numel() > 100:
        assert (y == 0).any() and (y > 0).any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_squared_relu_non_contiguous_and_misaligned_inputs(ops, dtype):
    """Transposed and strided views (copied) and views at odd element offsets (the scalar kernel): right, and bit for
    bit the contiguous, aligned results."""
    base, base_dy = make((64, 2 * 1001), dtype, seed_of("squared_relu-layouts", dtype))
    for name, view in (("transposed", lambda t: t.t()), ("strided", lambda t: t[:, ::2])):
        got = run_ops(ops, view(base), view(base_dy), what=f"{name}: ")
        want = (ops.squared_relu_forward(view(base).contiguous()),
                ops.squared_relu_backward(view(base_dy).contiguous(), view(base).contiguous()))
        assert all(torch.equal(a, b) for a, b in zip(got, want)), name
    x, dy = (t.reshape(-1)[:3 * 4096 + 5].contiguous() for t in (base, base_dy))
    aligned = run_ops(ops, x, dy)
    xm, dym = _at_offset(x, 1), _at_offset(dy, 3)
    assert xm.data_ptr() % 16 and dym.data_ptr() % 16
    got = run_ops(ops, xm, dym, what="misaligned: ")
    assert all(torch.equal(a, b) for a, b in zip(got, aligned)), "misaligned: differs from the vector path's"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_squared_relu_edges_as_eager(ops, dtype):
    """NaN, infinities, -0, overflow of x^2 past the dtype's range, large negative values, an infinite or NaN
    grad_output where x <= 0 (0, threshold_backward's) and where x > 0: eager PyTorch's values bit for bit, on the
    vector path and the scalar one. (In fp16 not past 32752, where eager's 2 * x overflows to inf before the product
    with grad_output and the kernel's, in fp32, does not: the forward is inf there already.)"""
    big = 30000.0 if dtype == torch.float16 else torch.finfo(dtype).max
    vals = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1.0, -1.0, 2.5, 300.0, -300.0, big, -big, 1e-3]
    grads = [1.0, float("inf"), float("-inf"), float("nan"), 0.5]
    x = torch.tensor([v for v in vals for _ in grads], device=DEV, dtype=dtype)
    dy = torch.tensor(grads * len(vals), device=DEV, dtype=dtype)
    x, dy = x.repeat(40), dy.repeat(40)   # (past one vector per thread: the vector path)
    for what, (xv, dyv) in (("", (x, dy)), ("misaligned: ", (_at_offset(x, 1), _at_offset(dy, 1)))):
        poison((x.shape, dtype))
        y = ops.squared_relu_forward(xv)
        poison((x.shape, dtype))
        dx = ops.squared_relu_backward(dyv, xv)
        want_y, want_dx = eager(xv, dyv)
        same_bits(f"{what}out", y, want_y)
        same_bits(f"{what}grad_x", dx, want_dx)
    nonpos = (x <= 0) & ~x.isnan()
    assert (dx[nonpos] == 0).all() and y[x.isnan()].isnan().all() and dx[x.isnan()].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_squared_relu_autograd_op(ops, dtype):
    """torch.ops.pipegoose.squared_relu: the forward kernel's result, the backward kernel's gradient (a broadcast
    scalar gradient too); no graph in inference mode."""
    x, dy = make((3, 5, 1001), dtype, seed_of("squared_relu-autograd", dtype))
    xx = x.clone().requires_grad_()
    poison((x.shape, dtype))
    y = torch.ops.pipegoose.squared_relu(xx)
    poison((x.shape, dtype))
    y.backward(dy)
    ry, rdx = ref64(x, dy)
    check("out", y.detach(), ry, dtype, x.shape)
    check("grad_x", xx.grad, rdx, dtype, x.shape)
    assert torch.equal(y.detach(), ops.squared_relu_forward(x))
    assert torch.equal(xx.grad, ops.squared_relu_backward(dy, x))
    xs = x.clone().requires_grad_()
    torch.ops.pipegoose.squared_relu(xs).sum().backward()   # grad_output: an expanded scalar (stride 0)
    assert torch.equal(xs.grad, ops.squared_relu_backward(torch.ones_like(x), x))
    with torch.inference_mode():
        yi = torch.ops.pipegoose.squared_relu(x)
    assert yi.grad_fn is None and torch.equal(yi, y.detach())


@pytest.mark.usefixtures("no_tuning_table")
def test_squared_relu_through_the_functional_and_the_module():
    """functional.squared_relu and FusedSquaredReLU on CUDA run the kernel (dispatch.stats), in strict mode, with
    transformers' ReLUSquaredActivation's values and gradient bit for bit (the small-problem rule set aside)."""
    from pipegoose.nn.fusion import FusedSquaredReLU, dispatch
    from pipegoose.nn.fusion import functional as PF

    x, dy = make((4, 257, 1024), torch.bfloat16, seed_of("squared_relu-functional"))
    dispatch.reset_stats()
    with dispatch.strict():
        for f in (PF.squared_relu, FusedSquaredReLU()):
            xx = x.clone().requires_grad_()
            y = f(xx)
            y.backward(dy)
            want_y, want_dx = eager(x, dy)
            same_bits("out", y.detach(), want_y)
            same_bits("grad_x", xx.grad, want_dx)
    assert dispatch.stats()["squared_relu"] == {"pipegoose": 2}


def test_squared_relu_empty_tensors_and_bad_arguments(ops):
    for shape in [(0,), (3, 0, 7)]:
        e = torch.empty(shape, device=DEV, dtype=torch.bfloat16)
        assert ops.squared_relu_forward(e).shape == shape and ops.squared_relu_backward(e, e).shape == shape
    x, dy = make((4, 6), torch.float32, seed_of("squared_relu-bad"))
    fwd, bwd = ops.squared_relu_forward, ops.squared_relu_backward
    cases = [
        # (a CPU tensor alone dispatches to no kernel: torch's own error names the op and the backend)
        (lambda: fwd(x.cpu()), r"Could not run 'pipegoose::squared_relu_forward' with arguments from the 'CPU'"),
        (lambda: fwd(x.double()), r"squared_relu_forward: x must be float32, float16 or bfloat16"),
        (lambda: bwd(dy[:, :5], x), r"squared_relu_backward: grad_output has shape \[4, 5\] but x has \[4, 6\]"),
        (lambda: bwd(dy.int(), x), r"squared_relu_backward: grad_output must be a floating point tensor"),
        (lambda: bwd(dy.cpu(), x), r"squared_relu_backward: grad_output is on cpu but x is on cuda"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_squared_relu_opcheck_and_double_backward(ops, dtype):
    x, dy = make((2, 3, 17), dtype, seed_of("squared_relu-opcheck", dtype))
    torch.library.opcheck(torch.ops.pipegoose.squared_relu_forward.default, (x,))
    torch.library.opcheck(torch.ops.pipegoose.squared_relu_forward.default, (x.transpose(0, 2),))
    torch.library.opcheck(torch.ops.pipegoose.squared_relu_backward.default, (dy, x))
    torch.library.opcheck(torch.ops.pipegoose.squared_relu.default, (x.clone().requires_grad_(),))
    torch.library.opcheck(torch.ops.pipegoose.squared_relu.default, (x,))
    # create_graph=True: the gradient is differentiable again; second derivatives as float64's (2 dy where x > 0)
    x, dy = make((64, 129), dtype, seed_of("squared_relu-double", dtype))
    v = torch.randn(64, 129, device=DEV, generator=torch.Generator(device=DEV).manual_seed(5)).to(dtype)
    xx = x.clone().requires_grad_()
    (dx,) = torch.autograd.grad(torch.ops.pipegoose.squared_relu(xx), xx, dy, create_graph=True)
    assert dx.requires_grad
    (ddx,) = torch.autograd.grad((dx.float() * v.float()).sum(), xx)
    x64 = x.cpu().double().requires_grad_()
    (dx64,) = torch.autograd.grad(torch.square(F.relu(x64)), x64, dy.cpu().double(), create_graph=True)
    (ddx64,) = torch.autograd.grad((dx64 * v.cpu().double()).sum(), x64)
    check("grad_x", dx.detach(), dx64.detach(), dtype, x.shape)
    assert ddx.dtype == dtype and torch.isfinite(ddx).all()
    torch.testing.assert_close(ddx.double().cpu(), ddx64, **tol(dtype, 2))
