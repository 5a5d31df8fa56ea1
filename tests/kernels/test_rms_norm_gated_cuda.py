"""GPU: ``pipegoose::rms_norm_gated_forward`` / ``rms_norm_gated_backward`` and the autograd op
``pipegoose::rms_norm_gated`` (ours, ``pipegoose/kernels/csrc/rms_norm_gated.cu``, binding
``pipegoose/kernels/bindings/rms_norm_gated.cpp``) against the float64 formulas (``rms_norm_gated_kernel_math`` of
``pipegoose.nn.fusion.ops.rms_norm_gated`` on the CPU in float64, from the same rounded inputs), forward and the
gradients of input, gate and weight, with the per-dtype tolerances of ``tests/tolerances.py``:

both orders (the norm before the gate, Qwen3-Next's; the gate first, Mamba2's); fp32, fp16 and bf16 with a weight of
the input's dtype or fp32 and the output in the input's dtype or fp32; no weight; groups of 1 to 16384 values (one to
many a row; the kernel's plans: a thread per group, sub-warp, warp, several warps, 512 and 1024 threads without the
register cache); widths that are no multiple of the vector width (the scalar path), non-contiguous and misaligned
inputs, rows of zeros, empty inputs, a frozen weight, the argument checks, ``torch.library.opcheck``, a double
backward, and the functional's dispatch (``impl="pipegoose"`` counted). The caching allocator is left holding NaN
blocks of the outputs' sizes first (``poison``), and every element is checked finite, so an element a kernel does not
write shows up.

Run on the GPU machine: ``python -m pytest -m cuda tests/kernels/test_rms_norm_gated_cuda.py -q`` (builds the kernel
on first use; ``python -m pipegoose.kernels build pipegoose/rms_norm_gated`` first saves time).
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import at_offset, poison, seed_of
from tolerances import tol

from pipegoose.nn.fusion.ops.rms_norm_gated import rms_norm_gated_kernel_math

pytestmark = pytest.mark.cuda

DEV = "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (shape, group): Qwen3-Next's value heads (128, one group); odd widths (scalar path); Nemotron-H's 8 groups of 1024;
# Mamba2's one group of 4096 (256 threads, the register cache) and 8192 / 16384 (512 / 1024 threads, no cache); tiny
# groups (a thread holds whole groups); one row; many rows; segments of 128 threads (2048)
CASES = [((3, 5, 128), 128), ((257, 1000), 1000), ((7, 13), 13), ((9, 39), 13), ((33, 8192), 1024),
         ((17, 4096), 4096), ((5, 8192), 8192), ((3, 16384), 16384), ((11, 64), 4), ((1, 24), 1), ((4099, 128), 64),
         ((2, 6144), 6144), ((9, 2048), 2048),
         # more rows than the backward's blocks take in one pass (its row loop: partial sums kept across passes)
         ((20000, 128), 128), ((70000, 16), 16)]


@pytest.fixture(scope="module")
def ops():
    from pipegoose.kernels import load

    return load("pipegoose/rms_norm_gated")


def make(shape, dtype, wdtype, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(shape, generator=gen, device=DEV) + 0.3).to(dtype)
    g = (torch.randn(shape, generator=gen, device=DEV) * 2).to(dtype)
    w = None if wdtype is None else (torch.rand(shape[-1], generator=gen, device=DEV) + 0.5).to(wdtype)
    dy = torch.randn(shape, generator=gen, device=DEV)
    return x, g, w, dy


def reference(x, g, w, dy, eps, group, first):
    """Output and (grad x, grad gate, grad weight) in float64 on the CPU, from the rounded inputs."""
    x64, g64 = (t.detach().cpu().double().requires_grad_() for t in (x, g))
    w64 = None if w is None else w.detach().cpu().double().requires_grad_()
    y = rms_norm_gated_kernel_math(x64, g64, w64, eps, group, first, torch.float64)
    wrt = (x64, g64) if w64 is None else (x64, g64, w64)
    grads = torch.autograd.grad(y, wrt, dy.detach().cpu().double())
    return y.detach(), grads


def close(name, got, want, dtype, scale=2.0):
    assert got.device.type == "cuda" and got.is_contiguous(), name
    bad = int((~torch.isfinite(got)).sum())
    assert bad == 0, f"{name}: {bad} element(s) not finite (not written?)"
    torch.testing.assert_close(got.cpu().double(), want, **tol(dtype, scale), msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("first", [True, False], ids=["norm_first", "gate_first"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("shape, group", CASES, ids=[f"{'x'.join(map(str, s))}/{g}" for s, g in CASES])
def test_forward_and_backward_against_float64(ops, shape, group, dtype, first):
    """Forward and backward ops against float64; the output in the input's dtype (and in fp32 for 16-bit input with an
    fp32 weight, the gate first: Mamba2's promotion); rstd float32 [rows, groups]; every element written."""
    eps = 1e-6
    for wdtype, out in ((dtype, dtype), (torch.float32, torch.float32 if not first else dtype), (None, dtype)):
        x, g, w, dy = make(shape, dtype, wdtype, seed_of(shape, group, dtype, first, wdtype))
        rows, groups = x.numel() // shape[-1], shape[-1] // group
        poison((shape, torch.float32), (shape, torch.float32), ((rows, groups), torch.float32))
        y, rstd = ops.rms_norm_gated_forward(x, g, w, eps, group, first, out)
        assert y.dtype == out and y.shape == x.shape and rstd.shape == (rows, groups) and rstd.dtype == torch.float32
        want, (gx, gg, *gw) = reference(x, g, w, dy.to(out), eps, group, first)
        close("output", y, want, out if out == dtype else dtype)
        # (and the weight gradient's partial sums: a row of D a block, up to some thousands of blocks)
        poison((shape, torch.float32), (shape, torch.float32), ((4096, shape[-1]), torch.float32))
        dx, dg, dw = ops.rms_norm_gated_backward(dy.to(out), x, g, w, rstd, group, first, True)
        assert dx.dtype == dg.dtype == dtype
        close("grad input", dx, gx, dtype, 4)
        close("grad gate", dg, gg, dtype, 4)
        if w is None:
            assert dw.numel() == 0
        else:
            assert dw.dtype == w.dtype and dw.shape == w.shape
            # (a sum over the rows: the dtype's rtol, and an atol of twice that relative to the largest value, for
            # the sums that cancel to near 0)
            big = float(gw[0].abs().max())
            bad = int((~torch.isfinite(dw)).sum())
            assert bad == 0, f"grad weight: {bad} element(s) not finite (not written?)"
            rtol = tol(wdtype)["rtol"]
            torch.testing.assert_close(dw.cpu().double(), gw[0], rtol=rtol, atol=2 * rtol * max(big, 1e-3),
                                       msg=lambda m: f"grad weight: {m}")


@pytest.mark.parametrize("first", [True, False], ids=["norm_first", "gate_first"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_layouts_the_autograd_op_and_a_frozen_weight(ops, dtype, first):
    """Non-contiguous (transposed) and misaligned (odd element offset: the scalar path) inputs give the contiguous
    inputs' results; the autograd op's gradients equal the backward op's; a frozen weight gets no gradient and the
    input's gradients are unchanged."""
    shape, group = (64, 256), 128
    x, g, w, dy = make(shape, dtype, dtype, seed_of("layouts", dtype, first))
    y, rstd = ops.rms_norm_gated_forward(x, g, w, 1e-5, group, first, None)
    want = ops.rms_norm_gated_backward(dy.to(dtype), x, g, w, rstd, group, first, True)
    xt, gt = x.t().contiguous().t(), g.t().contiguous().t()
    assert not xt.is_contiguous()
    for xa, ga in ((xt, gt), (at_offset(x, 1), at_offset(g, 3))):
        ya, ra = ops.rms_norm_gated_forward(xa, ga, w, 1e-5, group, first, None)
        torch.testing.assert_close(ya, y, **tol(dtype, 0.5))
        torch.testing.assert_close(ra, rstd, **tol(torch.float32))
        got = ops.rms_norm_gated_backward(dy.to(dtype), xa, ga, w, ra, group, first, True)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **tol(dtype, 2))
    xr, gr, wr = (t.clone().requires_grad_() for t in (x, g, w))
    yr = ops.rms_norm_gated(xr, gr, wr, 1e-5, group, first, None)
    torch.testing.assert_close(yr, y, rtol=0, atol=0)
    for a, b in zip(torch.autograd.grad(yr, (xr, gr, wr), dy.to(dtype)), want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    xr, gr = (t.clone().requires_grad_() for t in (x, g))
    yr = ops.rms_norm_gated(xr, gr, w, 1e-5, group, first, None)   # (w does not require grad)
    for a, b in zip(torch.autograd.grad(yr, (xr, gr), dy.to(dtype)), want[:2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("first", [True, False], ids=["norm_first", "gate_first"])
def test_rows_of_zeros_and_empty_inputs(ops, first):
    """A row of zeros (x = 0, or the gate's silu = 0 for the gate first) gives zeros and finite gradients, as the
    formula does (rstd = 1 / sqrt(eps)); no rows give empty outputs and a zero weight gradient."""
    x, g, w, dy = make((4, 128), torch.bfloat16, torch.bfloat16, 7)
    x[1] = 0
    y, rstd = ops.rms_norm_gated_forward(x, g, w, 1e-6, 128, first, None)
    assert bool((y[1] == 0).all()) and bool(torch.isfinite(y).all())
    grads = ops.rms_norm_gated_backward(dy.bfloat16(), x, g, w, rstd, 128, first, True)
    assert all(bool(torch.isfinite(t).all()) for t in grads)
    e = torch.empty(0, 5, 128, device=DEV, dtype=torch.bfloat16)
    y, rstd = ops.rms_norm_gated_forward(e, e, w, 1e-6, 64, first, None)
    assert y.shape == e.shape and rstd.shape == (0, 2)
    dx, dg, dw = ops.rms_norm_gated_backward(e, e, e, w, rstd, 64, first, True)
    assert dx.shape == dg.shape == e.shape and dw.shape == w.shape and bool((dw == 0).all())


def test_argument_errors_name_the_argument(ops):
    x, g, w, _ = make((4, 128), torch.float16, torch.float16, 1)
    cases = [((x, g, w, 1e-6, 48, True, None), "group_size"), ((x, g, w, 1e-6, 32768, True, None), "group_size"),
             ((x, g.float(), w, 1e-6, 128, True, None), "gate"), ((x, g[:, :64], w, 1e-6, 128, True, None), "gate"),
             ((x, g, w[:64], 1e-6, 128, True, None), "weight"), ((x, g, w.bfloat16(), 1e-6, 128, True, None), "weight"),
             ((x, g, w, -1.0, 128, True, None), "eps"), ((x, g, w, 1e-6, 128, True, torch.bfloat16), "out_dtype"),
             ((x.cpu(), g.cpu(), None, 1e-6, 128, True, None), "")]
    for args, name in cases:
        with pytest.raises((RuntimeError, NotImplementedError), match=name):
            ops.rms_norm_gated_forward(*args)
    y, rstd = ops.rms_norm_gated_forward(x, g, w, 1e-6, 128, True, None)
    with pytest.raises(RuntimeError, match="rstd"):
        ops.rms_norm_gated_backward(x, x, g, w, rstd[:2], 128, True, True)
    with pytest.raises(RuntimeError, match="grad_output"):
        ops.rms_norm_gated_backward(x[:2], x, g, w, rstd, 128, True, True)


def test_opcheck_and_double_backward(ops):
    """torch.library.opcheck of the three ops (schemas, fake impls, autograd registration), and a backward with
    create_graph=True: gradients of the kernel's formula, differentiable again (a Hessian-vector product)."""
    x, g, w, dy = make((6, 64), torch.float32, torch.float32, 3)
    for first in (True, False):
        torch.library.opcheck(torch.ops.pipegoose.rms_norm_gated_forward.default, (x, g, w, 1e-6, 32, first, None))
        y, rstd = ops.rms_norm_gated_forward(x, g, w, 1e-6, 32, first, None)
        torch.library.opcheck(torch.ops.pipegoose.rms_norm_gated_backward.default,
                              (dy, x, g, w, rstd, 32, first, True))
        xr, gr, wr = (t.clone().requires_grad_() for t in (x, g, w))
        torch.library.opcheck(torch.ops.pipegoose.rms_norm_gated.default, (xr, gr, wr, 1e-6, 32, first, None))
        y = ops.rms_norm_gated(xr, gr, wr, 1e-6, 32, first, None)
        gx, = torch.autograd.grad(y, xr, dy, create_graph=True)
        hvp = torch.autograd.grad(gx, (xr, gr, wr), torch.ones_like(gx))
        x64, g64, w64 = (t.detach().double().requires_grad_() for t in (x, g, w))
        y64 = rms_norm_gated_kernel_math(x64, g64, w64, 1e-6, 32, first, torch.float64)
        gx64, = torch.autograd.grad(y64, x64, dy.double(), create_graph=True)
        want = torch.autograd.grad(gx64, (x64, g64, w64), torch.ones_like(gx64))
        torch.testing.assert_close(gx.double(), gx64.detach(), **tol(torch.float32, 4))
        for a, b in zip(hvp, want):
            torch.testing.assert_close(a.double(), b, **tol(torch.float32, 8))


@pytest.mark.parametrize("first", [True, False], ids=["norm_first", "gate_first"])
def test_the_functional_runs_the_kernel_when_requested(first, no_tuning_table):
    """rms_norm_gated(..., impl="pipegoose") runs the kernel (counted) and gives the kernel op's result; without a
    request the kernel is not chosen (opt-in): the norm before the gate over whole rows runs implementation ops (ops
    rms_norm and swiglu on their kernels), the gate first the reference."""
    from pipegoose.nn.fusion import dispatch, rms_norm_gated
    from pipegoose.nn.fusion.ops.rms_norm_gated import rms_norm_gated_reference

    x, g, w, _ = make((2, 300, 128), torch.bfloat16, torch.bfloat16, 11)
    group = None if first else 64
    dispatch.reset_stats()
    y = rms_norm_gated(x, g, w, 1e-6, group_size=group, norm_before_gate=first, impl="pipegoose")
    assert dispatch.stats()["rms_norm_gated"] == {"pipegoose": 1}, dispatch.stats()
    want = rms_norm_gated_reference(x.double(), g.double(), w.double(), 1e-6, group or 128, first)
    torch.testing.assert_close(y.double(), want, **tol(torch.bfloat16, 2))
    dispatch.reset_stats()
    rms_norm_gated(x, g, w, 1e-6, group_size=group, norm_before_gate=first)
    stats = dispatch.stats()
    assert stats["rms_norm_gated"] == ({"ops": 1} if first else {"torch": 1}), stats
    if first:
        assert stats["rms_norm"] == {"pipegoose": 1} and stats["swiglu"] == {"pipegoose": 1}, stats
