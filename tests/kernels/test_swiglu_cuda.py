"""GPU: ``pipegoose::swiglu_forward`` / ``swiglu_backward`` and the autograd op ``pipegoose::swiglu`` (ours,
``pipegoose/kernels/csrc/swiglu.cu``, binding ``pipegoose/kernels/bindings/swiglu.cpp``) against the float64 formulas
computed on the CPU from the same (already rounded) inputs:

    out = g * s * u,  grad_gate = dy * u * s * (1 + g * (1 - s)),  grad_up = dy * g * s,  s = sigmoid(g),

with the per-dtype tolerances of ``tests/tolerances.py``: one element to 2**31 and more (64-bit offsets), sizes around
the vector width, non-contiguous inputs, misaligned views (the scalar path), large, infinite and NaN gates (as
PyTorch's silu), empty tensors, the argument checks, ``torch.library.opcheck`` and a double backward. The ops allocate
their outputs: the caching allocator is left holding NaN blocks of the outputs' sizes first (``poison``), and every
element is checked finite, so an element a kernel does not write shows up.

The same for gate and up packed in one tensor, ``pipegoose::silu_and_mul_forward(x [..., 2d]) -> [..., d]``,
``silu_and_mul_backward(grad_output, x) -> grad_x [..., 2d]`` and the autograd op ``pipegoose::silu_and_mul``: d from
1 to 28673 (the 16-byte vectors where d allows them, one value a thread otherwise: which kernel ran is read from a
profile), 1-d to 4-d x, rows of a wider tensor (aligned or not), copied layouts, rows at stride 0, many rows, 2**32
and more vectors or values (the kernel's 64-bit indices), grad_output of other layouts and dtypes, empty x, the
argument checks, opcheck, a double backward, 2**31 and more elements; every result also bit for bit that of the
two-tensor ops on the halves.

Run on the GPU machine: ``python -m pytest -m cuda tests/kernels/test_swiglu_cuda.py -q`` (builds the kernel on first
use; ``python -m pipegoose.kernels build pipegoose/swiglu`` first saves time).
"""

from __future__ import annotations



import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import packed_launches, packed_widths, poison, require_free_gpu_memory, seed_of
from tolerances import TOLERANCES, tol

pytestmark = pytest.mark.cuda

DEV = "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# one element (0-d and 1-d); around the vector width (4 fp32 or 8 16-bit values: 7, 8, 9); odd; one block's vectors
# (256 threads x 2 vectors x 8 16-bit values = 4096, 2048 fp32 values) and one past it; sizes that are no multiple of
# either width; an MLP's activations (TinyLlama's intermediate size 5632: 4096 tokens; 8 x 2048 tokens of 5632 / 8)
SHAPES = [(), (1,), (7,), (8,), (9,), (3, 5, 1001), (2048,), (4096,), (4097,), (2048 * 3 + 5,), (1_000_003,),
          (4096, 5632), (8, 2048, 704)]
AUTOGRAD_SHAPES = [(), (9,), (3, 5, 1001), (4097,), (4096, 5632)]


@pytest.fixture(scope="module")
def ops():
    from pipegoose.kernels import load

    return load("pipegoose/swiglu")


# --------------------------------------------------------------------------------------------------- helpers
def make(shape, dtype, seed, scale=2.0):
    """gate (N(0, scale^2): both tails of sigmoid), up and grad_output, on the GPU in ``dtype``."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    g = (torch.randn(shape, generator=gen, device=DEV) * scale).to(dtype)
    u = torch.randn(shape, generator=gen, device=DEV).to(dtype)
    dy = torch.randn(shape, generator=gen, device=DEV).to(dtype)
    return g, u, dy


def ref64(g, u, dy=None, device="cpu"):
    """float64 on the CPU (or ``device``): out, or (out, grad_gate, grad_up) with ``dy``."""
    g64, u64 = g.detach().to(device, torch.float64), u.detach().to(device, torch.float64)
    s = torch.sigmoid(g64)
    y = g64 * s * u64
    if dy is None:
        return y
    d = dy.detach().to(device, torch.float64)
    return y, d * u64 * s * (1 + g64 * (1 - s)), d * g64 * s


def check(name, got, want, dtype, shape=None):
    """Shape, dtype, device, layout; every element finite (a NaN: not written); assert_close with TOLERANCES[dtype]."""
    shape = want.shape if shape is None else torch.Size(shape)
    assert got.shape == shape, f"{name}: shape {tuple(got.shape)} != {tuple(shape)}"
    assert got.dtype == dtype and got.device.type == torch.device(DEV).type, f"{name}: {got.dtype} on {got.device}"
    assert got.is_contiguous(), f"{name}: not contiguous (strides {got.stride()})"
    bad = int((~torch.isfinite(got)).sum())
    assert bad == 0, f"{name}: {bad} element(s) not finite (not written, or a value the reference does not have)"
    torch.testing.assert_close(got.to(want.device, torch.float64), want, **TOLERANCES[dtype],
                               msg=lambda m: f"{name}: {m}")


def run_ops(ops, g, u, dy):
    """Forward and backward through the ops, outputs poisoned first."""
    poison((g.shape, g.dtype))
    y = ops.swiglu_forward(g, u)
    poison((g.shape, g.dtype), (g.shape, g.dtype))
    dg, du = ops.swiglu_backward(dy, g, u)
    return y, dg, du


def check_ops(ops, g, u, dy, dtype, what=""):
    y, dg, du = run_ops(ops, g, u, dy)
    ry, rdg, rdu = ref64(g, u, dy)
    check(f"{what}out", y, ry, dtype, g.shape)
    check(f"{what}grad_gate", dg, rdg, dtype, g.shape)
    check(f"{what}grad_up", du, rdu, dtype, g.shape)
    return y, dg, du


# --------------------------------------------------------------------------------------------- the formulas
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_ops_match_float64(ops, dtype, shape):
    g, u, dy = make(shape, dtype, seed_of(shape, dtype))
    before = [t.clone() for t in (g, u, dy)]
    check_ops(ops, g, u, dy, dtype)
    assert all(torch.equal(a, b) for a, b in zip((g, u, dy), before)), "an input changed"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", AUTOGRAD_SHAPES, ids=str)
@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)], ids=["both", "gate", "up"])
def test_autograd_op_matches_float64(ops, dtype, shape, needs):
    """torch.ops.pipegoose.swiglu with .backward(): the forward kernel, and the backward kernel's gradients for the
    inputs that require them (None for the other), the very results of the ops."""
    g, u, dy = make(shape, dtype, seed_of("autograd", shape, dtype))
    gg, uu = g.clone().requires_grad_(needs[0]), u.clone().requires_grad_(needs[1])
    poison((g.shape, dtype))
    y = torch.ops.pipegoose.swiglu(gg, uu)
    assert y.requires_grad and y.grad_fn is not None
    poison((g.shape, dtype), (g.shape, dtype))
    y.backward(dy)
    ry, rdg, rdu = ref64(g, u, dy)
    check("out", y.detach(), ry, dtype, shape)
    for name, t, need, want in (("grad_gate", gg, needs[0], rdg), ("grad_up", uu, needs[1], rdu)):
        if need:
            check(name, t.grad, want, dtype, shape)
        else:
            assert t.grad is None, f"{name}: a gradient for an input that does not require one"
    assert torch.equal(y.detach(), ops.swiglu_forward(g, u))
    dg, du = ops.swiglu_backward(dy, g, u)
    assert not needs[0] or torch.equal(gg.grad, dg)
    assert not needs[1] or torch.equal(uu.grad, du)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_autograd_op_with_a_broadcast_output_gradient(ops, dtype):
    """y.sum().backward(): the output gradient is an expanded scalar (stride 0), made contiguous by the backward."""
    g, u, _ = make((37, 129), dtype, seed_of("sum", dtype))
    gg, uu = g.clone().requires_grad_(), u.clone().requires_grad_()
    torch.ops.pipegoose.swiglu(gg, uu).sum().backward()
    _, rdg, rdu = ref64(g, u, torch.ones_like(g))
    check("grad_gate", gg.grad, rdg, dtype)
    check("grad_up", uu.grad, rdu, dtype)


def test_autograd_op_without_grad_and_in_inference_mode(ops):
    g, u, _ = make((5, 301), torch.bfloat16, seed_of("inference"))
    want = ops.swiglu_forward(g, u)
    with torch.inference_mode():
        y = torch.ops.pipegoose.swiglu(g, u)
    assert y.grad_fn is None and torch.equal(y, want)
    gg = g.clone().requires_grad_()
    with torch.no_grad():
        y = torch.ops.pipegoose.swiglu(gg, u)
    assert not y.requires_grad and torch.equal(y, want)


def test_grad_output_of_another_dtype_is_converted_first(ops):
    """One dtype for every tensor: a grad_output of another floating dtype is converted to gate's first (the result
    is that of the converted grad_output, bit for bit)."""
    g, u, dy = make((3, 1001), torch.bfloat16, seed_of("dy dtype"))
    dy32 = torch.randn(3, 1001, device=DEV, generator=torch.Generator(device=DEV).manual_seed(1))
    got = ops.swiglu_backward(dy32, g, u)
    want = ops.swiglu_backward(dy32.to(torch.bfloat16), g, u)
    assert all(a.dtype == torch.bfloat16 and torch.equal(a, b) for a, b in zip(got, want))
    g32, u32, _ = make((3, 1001), torch.float32, seed_of("dy dtype 32"))
    got = ops.swiglu_backward(dy.half(), g32, u32)
    want = ops.swiglu_backward(dy.half().float(), g32, u32)
    assert all(a.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(got, want))


# ------------------------------------------------------------------------------------------ memory layouts
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_inputs(ops, dtype):
    """Transposed, strided and narrowed views (copied to contiguous ones by the ops; outputs contiguous, of gate's
    shape), an expanded up (stride 0) and a gate and up of different layouts; the ops and the autograd op."""
    base_g, base_u, base_dy = make((64, 2 * 1001), dtype, seed_of("strided", dtype))
    views = {"transposed": lambda t: t.t(),                 # [2002, 64]
             "strided last dim": lambda t: t[:, ::2],       # [64, 1001], stride 2
             "narrowed rows": lambda t: t[:, 3:1000]}       # contiguous rows, row stride 2002
    for name, view in views.items():
        g, u, dy = view(base_g), view(base_u), view(base_dy)
        assert not g.is_contiguous() and not u.is_contiguous() and not dy.is_contiguous()
        y, dg, du = check_ops(ops, g, u, dy, dtype, what=f"{name}: ")
        gc, uc, dyc = g.contiguous(), u.contiguous(), dy.contiguous()
        assert torch.equal(y, ops.swiglu_forward(gc, uc)), name
        assert all(torch.equal(a, b) for a, b in zip((dg, du), ops.swiglu_backward(dyc, gc, uc))), name
        gg, uu = g.detach().requires_grad_(), u.detach().requires_grad_()   # (views of leaves: new leaves)
        yy = torch.ops.pipegoose.swiglu(gg, uu)
        yy.backward(dy)
        assert torch.equal(yy.detach(), y) and torch.equal(gg.grad, dg) and torch.equal(uu.grad, du), name
    # up broadcast by expand (one row for every row: stride 0), gate contiguous
    g = base_g[:, :1001].contiguous()
    u = base_u[0, :1001].expand(64, 1001)
    dy = base_dy[:, :1001]
    check_ops(ops, g, u, dy, dtype, what="expanded up: ")
    # gate transposed, up contiguous, of one shape
    g = base_g[:, :64].t()
    u = base_u[:64, :64].contiguous()
    check_ops(ops, g, u, base_dy[:64, :64], dtype, what="mixed layouts: ")
    # a 4-d channels_last gate: output in gate's shape, contiguous
    g4 = base_g.reshape(2, 4, 8, 2002)[:, :, :, :8].contiguous(memory_format=torch.channels_last)
    u4 = base_u.reshape(2, 4, 8, 2002)[:, :, :, :8].contiguous()
    assert not g4.is_contiguous()
    check("channels_last out", ops.swiglu_forward(g4, u4), ref64(g4, u4), dtype, g4.shape)


def _at_offset(t: torch.Tensor, k: int) -> torch.Tensor:
    """The same values, a view at element offset ``k`` of a larger buffer (not 16-byte aligned for odd ``k``)."""
    buf = torch.empty(t.numel() + k, dtype=t.dtype, device=DEV)
    buf[k:] = t.reshape(-1)
    v = buf[k:].view(t.shape)
    assert v.data_ptr() % 16 != 0, (k, t.dtype)
    return v


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7,), (9,), (3 * 4096 + 5,), (33, 4097), ((1 << 20) + 3,)], ids=str)
def test_misaligned_views_take_the_scalar_path(ops, dtype, shape):
    """Views at odd element offsets (pointers not 16-byte aligned: the scalar kernel, over every block): gate alone,
    up alone, grad_output alone, all of them. The same math as the vector path: results bit for bit equal."""
    g, u, dy = make(shape, dtype, seed_of("misaligned", shape, dtype))
    aligned = run_ops(ops, g, u, dy)
    for which in ("gate", "up", "grad_output", "all"):
        k = 1 if which != "all" else 3
        gm = _at_offset(g, k) if which in ("gate", "all") else g
        um = _at_offset(u, k) if which in ("up", "all") else u
        dym = _at_offset(dy, k) if which in ("grad_output", "all") else dy
        assert any(t.data_ptr() % 16 for t in (gm, um, dym))
        got = check_ops(ops, gm, um, dym, dtype, what=f"{which} misaligned: ")
        for name, a, b in zip(("out", "grad_gate", "grad_up"), got, aligned):
            assert torch.equal(a, b), f"{which} misaligned: {name} differs from the vector path's"


# ----------------------------------------------------------------------------------- large and special values
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_gates(ops, dtype):
    """Gates of +-20, +-88, +-89 (where exp(-g) leaves fp32's range), +-100 and +-1e4 among ordinary ones: finite
    results as the float64 formulas give them (sigmoid 0 or 1 there), in every dtype; up and grad_output bounded so
    that no true result overflows fp16."""
    n = 3 * 4096 + 7
    g, u, dy = make((n,), dtype, seed_of("large", dtype))
    u, dy = u.clamp(-4, 4), dy.clamp(-4, 4)
    specials = torch.tensor([20.0, -20.0, 88.0, -88.0, 89.0, -89.0, 100.0, -100.0, 1e4, -1e4], device=DEV)
    g[::3] = specials.repeat(n // (3 * len(specials)) + 1)[:len(range(0, n, 3))].to(dtype)
    y, dg, du = check_ops(ops, g, u, dy, dtype)
    # the limits, exactly: sigmoid(1e4) = 1 (out = g * u, grad_gate = dy * u), sigmoid(-1e4) = 0 (all zero)
    big, small = g == 1e4, g == -1e4
    assert big.any() and small.any()
    gb, ub, dyb = g[big].float(), u[big].float(), dy[big].float()
    torch.testing.assert_close(y[big].float(), (gb * ub).to(dtype).float(), rtol=0, atol=0)
    torch.testing.assert_close(dg[big].float(), (dyb * ub).to(dtype).float(), rtol=0, atol=0)
    assert (y[small] == 0).all() and (dg[small] == 0).all() and (du[small] == 0).all()


SPECIAL_GATES = [float("-inf"), float("inf"), float("nan"), 0.0, -0.0, 1.0, -1.0, 3.0, -3.0, 100.0, -100.0, 1e4, -1e4]
SPECIAL_UPS = [1.0, -2.5, 0.0, float("inf"), float("-inf"), float("nan")]
SPECIAL_DYS = [1.5, -0.75, 0.0]


def _special_grid(dtype):
    """Every combination of the special gates, ups and output gradients, as three tensors of one shape."""
    g, u, d = torch.meshgrid(torch.tensor(SPECIAL_GATES), torch.tensor(SPECIAL_UPS), torch.tensor(SPECIAL_DYS),
                             indexing="ij")
    return [t.reshape(-1).to(DEV, dtype) for t in (g, u, d)]


def _torch_fp32(g, u, dy):
    """PyTorch's silu(g) * u and its gradients, in fp32 on the GPU."""
    gg = g.float().detach().requires_grad_()
    uu = u.float().detach().requires_grad_()
    y = F.silu(gg) * uu
    y.backward(dy.float())
    return y.detach(), gg.grad, uu.grad


def _same_as_torch(name, got, want):
    """The same NaN positions as PyTorch's fp32 result ``want``; the same infinities; the rest close (the tolerance
    of ``got``'s dtype: a 16-bit result is PyTorch's fp32 one rounded)."""
    nan_got, nan_want = torch.isnan(got), torch.isnan(want)
    where = (nan_got != nan_want).nonzero().reshape(-1).tolist()
    assert not where, (f"{name}: NaN where PyTorch has none, or the other way round, at {where[:10]}: got "
                       f"{got.reshape(-1)[where[:10]].tolist()}, PyTorch {want.reshape(-1)[where[:10]].tolist()}")
    torch.testing.assert_close(got.float(), want, equal_nan=True, **TOLERANCES[got.dtype],
                               msg=lambda m: f"{name}: {m}")


def test_inf_and_nan_as_torch_silu(ops):
    """fp32: infinite and NaN gates, ups and large gates give what PyTorch's silu(gate) * up gives (and its
    gradients): the same NaN positions, the same infinities, the rest close. Through the ops and the autograd op."""
    g, u, dy = _special_grid(torch.float32)
    want = _torch_fp32(g, u, dy)
    got = (ops.swiglu_forward(g, u), *ops.swiglu_backward(dy, g, u))
    for name, a, b in zip(("out", "grad_gate", "grad_up"), got, want):
        _same_as_torch(name, a, b)
    gg, uu = g.clone().requires_grad_(), u.clone().requires_grad_()
    y = torch.ops.pipegoose.swiglu(gg, uu)
    y.backward(dy)
    for name, a, b in zip(("autograd out", "autograd grad_gate", "autograd grad_up"), (y.detach(), gg.grad, uu.grad),
                          want):
        _same_as_torch(name, a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gates_near_the_largest_float_as_torch_silu(ops, dtype):
    """Finite gates near -3.4e38 (fp32's and bf16's range): sigmoid is 0 there, silu(gate) -0, and PyTorch's gradient
    of up, dy * silu(gate), is 0. grad_up must not be NaN for finite inputs (dy * gate overflows to -inf first where
    it is computed as (dy * gate) * sigmoid(gate))."""
    g = torch.tensor([-3e38, -1e38, -2e38, 3e38, -1e30], device=DEV).to(dtype)
    u = torch.tensor([1.0, -0.5, 2.0, 1.0, 1.0], device=DEV).to(dtype)
    dy = torch.tensor([2.5, 4.0, -2.0, 0.5, 3.0], device=DEV).to(dtype)
    want = _torch_fp32(g, u, dy)
    got = (ops.swiglu_forward(g, u), *ops.swiglu_backward(dy, g, u))
    for name, a, b in zip(("out", "grad_gate", "grad_up"), got, want):
        _same_as_torch(f"{dtype} {name}", a, b)


# -------------------------------------------------------------------------------------------------- empty
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(0,), (0, 5), (3, 0, 7)], ids=str)
def test_empty_tensors(ops, dtype, shape):
    g = torch.empty(shape, device=DEV, dtype=dtype)
    y = ops.swiglu_forward(g, g.clone())
    assert y.shape == shape and y.dtype == dtype and y.device == g.device
    dg, du = ops.swiglu_backward(g, g, g.clone())
    assert dg.shape == du.shape == shape and dg.dtype == du.dtype == dtype
    gg, uu = g.clone().requires_grad_(), g.clone().requires_grad_()
    y = torch.ops.pipegoose.swiglu(gg, uu)
    y.backward(torch.empty_like(y))
    assert y.shape == gg.grad.shape == uu.grad.shape == shape
    torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------- argument checks
def test_bad_arguments_name_the_argument(ops):
    g, u, dy = make((4, 6), torch.float32, seed_of("bad"))
    fwd, bwd = ops.swiglu_forward, ops.swiglu_backward
    cases = [
        (lambda: fwd(g.cpu(), u), r"swiglu_forward: gate must be a CUDA tensor, got device cpu"),
        (lambda: fwd(g, u.cpu()), r"swiglu_forward: up is on cpu but gate is on cuda:\d+"),
        (lambda: fwd(g, u.half()), r"swiglu_forward: up is Half but gate is Float; expected one dtype"),
        (lambda: fwd(g.double(), u.double()), r"swiglu_forward: gate must be float32, float16 or bfloat16, got Double"),
        (lambda: fwd(g.int(), u.int()), r"gate must be float32, float16 or bfloat16, got Int"),
        (lambda: fwd(g, u[:, :5]), r"swiglu_forward: up has shape \[4, 5\] but gate has \[4, 6\]; expected equal "
                                   r"shapes \(no broadcasting\)"),
        (lambda: fwd(g, u[:1]), r"up has shape \[1, 6\] but gate has \[4, 6\]"),            # broadcastable: refused
        (lambda: fwd(g, u.reshape(6, 4)), r"up has shape \[6, 4\] but gate has \[4, 6\]"),  # same numel: refused
        (lambda: bwd(dy[:, :5], g, u), r"swiglu_backward: grad_output has shape \[4, 5\] but gate has \[4, 6\]"),
        (lambda: bwd(dy.reshape(24), g, u), r"grad_output has shape \[24\] but gate has \[4, 6\]"),
        (lambda: bwd(dy.cpu(), g, u), r"swiglu_backward: grad_output is on cpu but gate is on cuda:\d+"),
        (lambda: bwd(dy.int(), g, u), r"swiglu_backward: grad_output must be a floating point tensor, got Int"),
        (lambda: bwd(dy, g, u.bfloat16()), r"swiglu_backward: up is BFloat16 but gate is Float"),
        (lambda: bwd(dy, g.cpu(), u), r"swiglu_backward: gate must be a CUDA tensor, got device cpu"),
        (lambda: bwd(dy, g, u[:, :5]), r"swiglu_backward: up has shape \[4, 5\]"),
        (lambda: torch.ops.pipegoose.swiglu(g, u.half()), r"swiglu_forward: up is Half but gate is Float"),
        (lambda: torch.ops.pipegoose.swiglu(g.clone().requires_grad_(), u[:2]), r"up has shape \[2, 6\]"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()
    # no CUDA tensor at all: no kernel of ours runs (the op has none for the CPU); PyTorch says so, naming the op
    with pytest.raises(NotImplementedError, match=r"pipegoose::swiglu_forward.*CPU"):
        fwd(g.cpu(), u.cpu())


@pytest.mark.skipif("torch.cuda.device_count() < 2", reason="needs two GPUs")
def test_second_gpu(ops):
    """Inputs on cuda:1 while cuda:0 is current: the launch on their device (results right); devices that differ
    are an error naming up."""
    g, u, dy = (t.to("cuda:1") for t in make((5, 4097), torch.bfloat16, seed_of("gpu1")))
    with torch.cuda.device(0):
        y, dg, du = ops.swiglu_forward(g, u), *ops.swiglu_backward(dy, g, u)
    assert y.device == dg.device == du.device == torch.device("cuda", 1)
    ry, rdg, rdu = ref64(g, u, dy)
    for name, a, b in (("out", y, ry), ("grad_gate", dg, rdg), ("grad_up", du, rdu)):
        torch.testing.assert_close(a.double().cpu(), b, **TOLERANCES[torch.bfloat16], msg=lambda m: f"{name}: {m}")
    with pytest.raises(RuntimeError, match=r"up is on cuda:0 but gate is on cuda:1"):
        ops.swiglu_forward(g, u.to("cuda:0"))


# ------------------------------------------------------------------------------------ opcheck, double backward
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck(ops, dtype):
    g, u, dy = make((2, 3, 17), dtype, seed_of("opcheck", dtype))
    torch.library.opcheck(torch.ops.pipegoose.swiglu_forward.default, (g, u))
    torch.library.opcheck(torch.ops.pipegoose.swiglu_forward.default, (g.transpose(0, 2), u.transpose(0, 2)))
    torch.library.opcheck(torch.ops.pipegoose.swiglu_backward.default, (dy, g, u))
    # the op with its autograd formula (a C++ Function), with inputs that need gradients
    gg, uu = g.clone().requires_grad_(), u.clone().requires_grad_()
    torch.library.opcheck(torch.ops.pipegoose.swiglu.default, (gg, uu))
    torch.library.opcheck(torch.ops.pipegoose.swiglu.default, (gg, u))
    torch.library.opcheck(torch.ops.pipegoose.swiglu.default, (g, uu))
    torch.library.opcheck(torch.ops.pipegoose.swiglu.default, (g, u))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_double_backward(ops, dtype):
    """backward with create_graph=True: first derivatives as the float64 formula's, and differentiable again: the
    second derivatives (of <grad_gate, v1> + <grad_up, v2>) equal those of the float64 reference by autograd."""
    g, u, dy = make((64, 129), dtype, seed_of("double", dtype))
    gen = torch.Generator(device=DEV).manual_seed(5)
    v1 = torch.randn(64, 129, device=DEV, generator=gen).to(dtype)
    v2 = torch.randn(64, 129, device=DEV, generator=gen).to(dtype)
    gg, uu = g.clone().requires_grad_(), u.clone().requires_grad_()
    y = torch.ops.pipegoose.swiglu(gg, uu)
    dg, du = torch.autograd.grad(y, (gg, uu), dy, create_graph=True)
    assert dg.requires_grad and du.requires_grad
    ddg, ddu = torch.autograd.grad((dg.float() * v1.float()).sum() + (du.float() * v2.float()).sum(), (gg, uu))

    g64, u64 = g.cpu().double().requires_grad_(), u.cpu().double().requires_grad_()
    y64 = F.silu(g64) * u64
    dg64, du64 = torch.autograd.grad(y64, (g64, u64), dy.cpu().double(), create_graph=True)
    ddg64, ddu64 = torch.autograd.grad((dg64 * v1.cpu().double()).sum() + (du64 * v2.cpu().double()).sum(),
                                       (g64, u64))
    _, rdg, rdu = ref64(g, u, dy)
    torch.testing.assert_close(dg64.detach(), rdg)   # (the reference's two forms agree)
    check("grad_gate", dg.detach(), dg64.detach(), dtype)
    check("grad_up", du.detach(), du64.detach(), dtype)
    for name, a, b in (("grad_gate of grad", ddg, ddg64), ("grad_up of grad", ddu, ddu64)):
        assert a.dtype == dtype and torch.isfinite(a).all(), name
        torch.testing.assert_close(a.double().cpu(), b, **tol(dtype, 2), msg=lambda m: f"{name}: {m}")


# ----------------------------------------------------------------------------------------- 64-bit offsets
def test_more_than_2_31_elements(ops):
    """bf16 tensors of 2**31 + 27 elements (4.3 GB each): the elements past 2**31, the vector path's last whole
    vectors and its tail, and the scalar path (views at offset 1) over the same range, against float64 on slices at
    the start, around 2**31 and at the end, and finite everywhere (written)."""
    require_free_gpu_memory(30)
    n = 2**31 + 27
    dtype = torch.bfloat16
    gen = torch.Generator(device=DEV).manual_seed(21)
    g_buf = torch.randn(n + 1, generator=gen, device=DEV, dtype=dtype) * 2
    u_buf = torch.randn(n + 1, generator=gen, device=DEV, dtype=dtype)
    dy = torch.randn(n, generator=gen, device=DEV, dtype=dtype)
    pieces = [slice(0, 5000), slice(2**31 - 3000, 2**31 + 3000), slice(n - 5000, n)]

    for what, g, u in (("aligned", g_buf[:n], u_buf[:n]), ("misaligned", g_buf[1:], u_buf[1:])):
        assert g.numel() == n and (g.data_ptr() % 16 != 0) == (what == "misaligned")
        poison(((n,), dtype))
        y = ops.swiglu_forward(g, u)
        assert y.shape == (n,) and bool(torch.isfinite(y).all()), f"{what}: out not written everywhere"
        for s in pieces:
            check(f"{what} out[{s.start}:{s.stop}]", y[s], ref64(g[s], u[s]), dtype)
        del y
        poison(((n,), dtype), ((n,), dtype))
        dg, du = ops.swiglu_backward(dy, g, u)
        assert bool(torch.isfinite(dg).all()) and bool(torch.isfinite(du).all()), f"{what}: grads not written"
        for s in pieces:
            _, rdg, rdu = ref64(g[s], u[s], dy[s])
            check(f"{what} grad_gate[{s.start}:{s.stop}]", dg[s], rdg, dtype)
            check(f"{what} grad_up[{s.start}:{s.stop}]", du[s], rdu, dtype)
        del dg, du


# ===================================================================================== silu_and_mul: x packed
# pipegoose::silu_and_mul_forward(x [..., 2d]) -> out [..., d] = silu(x[..., :d]) * x[..., d:];
# silu_and_mul_backward(grad_output [..., d], x) -> grad_x [..., 2d] (grad_gate in each row's first half, grad_up in
# its second); the autograd op pipegoose::silu_and_mul.
def make_packed(shape, dtype, seed, scale=2.0):
    """x of ``shape`` [..., 2d] (``make``'s gate in each row's first d values, its up in the last d) and grad_output
    [..., d], on the GPU in ``dtype``."""
    *lead, two_d = shape
    g, u, dy = make((*lead, two_d // 2), dtype, seed, scale)
    return torch.cat((g, u), -1), dy


def ref64_packed(x, dy=None, device="cpu"):
    """float64 (on the CPU, or ``device``) of x's halves: out, or (out, grad_x) with ``dy``."""
    d = x.shape[-1] // 2
    got = ref64(x[..., :d], x[..., d:], dy, device)
    if dy is None:
        return got
    y, dg, du = got
    return y, torch.cat((dg, du), -1)


def half_shape(x):
    return (*x.shape[:-1], x.shape[-1] // 2)


def run_packed(ops, x, dy):
    """Forward and backward through the ops, outputs poisoned first."""
    poison((half_shape(x), x.dtype))
    y = ops.silu_and_mul_forward(x)
    poison((x.shape, x.dtype))
    dx = ops.silu_and_mul_backward(dy, x)
    return y, dx


def check_packed(ops, x, dy, dtype, what=""):
    y, dx = run_packed(ops, x, dy)
    ry, rdx = ref64_packed(x, dy)
    check(f"{what}out", y, ry, dtype, half_shape(x))
    check(f"{what}grad_x", dx, rdx, dtype, x.shape)
    return y, dx


def vector_width(dtype):
    """Values in one of the kernels' 16-byte vectors: 4 fp32, 8 16-bit."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def all_finite(t: torch.Tensor) -> bool:
    """Every element of ``t`` finite, checked 2**28 elements at a time (no bool tensor of t's size)."""
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + 2**28]).all()) for i in range(0, flat.numel(), 2**28))


# d = 1 (one value a half), odd d (7, 9, 1001, 28673: the scalar kernel), d a multiple of 4 but not of 8 (12: fp32's
# vectors, 16-bit's scalar kernel), multiples of 8 (8, 64, 704, 1000, 28672: vectors in every dtype); a 1-d x (one
# row); 3-d and 4-d x; a Llama-2-70B MLP's rows (d = 28672: a row over 14 blocks of 256 threads in 16-bit), 4101 rows of
# TinyLlama's intermediate size / 8 (two rows a block, the last block partial)
PACKED_SHAPES = [(2,), (5, 2), (3, 14), (4, 18), (7, 24), (33, 16), (17, 2000), (2, 3, 2002), (2, 3, 4, 128),
                 (16,), (2 * 1001,), (3, 2 * 28672), (2, 2 * 28673), (4101, 2 * 704)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", PACKED_SHAPES, ids=str)
def test_packed_ops_match_float64(ops, dtype, shape):
    """silu_and_mul_forward / _backward against float64, every element written; the inputs left as they were; the
    same values, bit for bit, as swiglu_forward / swiglu_backward of the two halves (the same math per value)."""
    x, dy = make_packed(shape, dtype, seed_of("packed", shape, dtype))
    before = [t.clone() for t in (x, dy)]
    y, dx = check_packed(ops, x, dy, dtype)
    assert all(torch.equal(a, b) for a, b in zip((x, dy), before)), "an input changed"
    d = shape[-1] // 2
    g, u = x[..., :d].contiguous(), x[..., d:].contiguous()
    assert torch.equal(y, ops.swiglu_forward(g, u)), "out differs from swiglu_forward of the halves"
    dg, du = ops.swiglu_backward(dy, g, u)
    assert torch.equal(dx[..., :d], dg) and torch.equal(dx[..., d:], du), \
        "grad_x differs from swiglu_backward of the halves"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [1, 2, 4, 7, 8, 12, 16, 1000, 1001], ids=str)
def test_packed_vector_kernel_where_d_allows(ops, dtype, d):
    """A contiguous x takes the kernel of 16-byte vectors where d is a multiple of their values (4 fp32, 8 16-bit), and
    the scalar kernel (one value a thread) otherwise, forward and backward; both within float64's tolerance."""
    x, dy = make_packed((9, 2 * d), dtype, seed_of("packed width", d, dtype))
    got = {}

    def run():
        got["y"], got["dx"] = run_packed(ops, x, dy)

    want = vector_width(dtype) if d % vector_width(dtype) == 0 else 1
    assert packed_widths(run) == [want, want]
    ry, rdx = ref64_packed(x, dy)
    check("out", got["y"], ry, dtype)
    check("grad_x", got["dx"], rdx, dtype)


def _in_wider_rows(x, offset, extra):
    """x's values [..., 2d] in the rows of a wider buffer, from column ``offset``, ``extra`` columns after them."""
    wide = torch.full((*x.shape[:-1], offset + x.shape[-1] + extra), float("nan"), dtype=x.dtype, device=DEV)
    wide[..., offset:offset + x.shape[-1]] = x
    return wide[..., offset:offset + x.shape[-1]]


# name -> (a view of x [R, 2d], or of its values in another shape; whether the kernel reads it in place (else the op
# copies it to a contiguous tensor first); whether its pointer and row stride allow 16-byte vectors where d does)
PACKED_LAYOUTS = {
    "rows of a wider tensor from column 3": (lambda x: _in_wider_rows(x, 3, 5), True, False),   # misaligned
    "rows of a wider tensor from column 8": (lambda x: _in_wider_rows(x, 8, 8), True, True),    # aligned, strided
    "rows of 2d + 1 values": (lambda x: _in_wider_rows(x, 0, 1), True, False),   # aligned first row, odd stride
    "torch.cat of the halves": (lambda x: torch.cat(x.chunk(2, -1), -1), True, True),
    "one row expanded (row stride 0)": (lambda x: x[:1].expand(x.shape), True, True),
    "3-d slice of wider rows (leading dims flatten)":
        (lambda x: _in_wider_rows(x.reshape(3, -1, x.shape[-1]), 8, 8), True, True),
    "3-d narrowed in a leading dim (no single row stride)":
        (lambda x: _in_wider_rows(x.reshape(3, -1, x.shape[-1]), 8, 8)[:, 1:], False, True),
    "transposed (last dim not contiguous)": (lambda x: x.t().contiguous().t(), False, True),
    "strided last dim": (lambda x: x.repeat_interleave(2, -1)[..., ::2], False, True),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [1000, 1001], ids=str)
@pytest.mark.parametrize("layout", list(PACKED_LAYOUTS))
def test_packed_layouts(ops, dtype, d, layout):
    """x in other layouts: read in place at its row stride (vectors where d, the pointer and the stride allow; the
    scalar kernel otherwise) or copied to a contiguous tensor first (then vectors where d allows). Outputs contiguous,
    against float64, and bit for bit the results of x.contiguous(); the autograd op gives the same."""
    make_view, in_place, aligned = PACKED_LAYOUTS[layout]
    base, _ = make_packed((36, 2 * d), dtype, seed_of("packed layout", d, dtype))
    x = make_view(base)
    assert not x.is_contiguous() or layout == "torch.cat of the halves", layout
    _, dy = make_packed(x.shape, dtype, seed_of("packed layout dy", d, dtype))
    got = {}

    def run():
        got["y"], got["dx"] = run_packed(ops, x, dy)

    v = vector_width(dtype)
    want = v if d % v == 0 and (aligned or not in_place) else 1
    assert packed_widths(run) == [want, want], layout
    ry, rdx = ref64_packed(x, dy)
    check("out", got["y"], ry, dtype, half_shape(x))
    check("grad_x", got["dx"], rdx, dtype, x.shape)
    xc = x.contiguous()
    assert torch.equal(got["y"], ops.silu_and_mul_forward(xc)), f"{layout}: out differs from x.contiguous()'s"
    assert torch.equal(got["dx"], ops.silu_and_mul_backward(dy, xc)), f"{layout}: grad_x differs"
    xx = x.detach().requires_grad_()   # (a view's detach: a leaf of the same layout)
    yy = torch.ops.pipegoose.silu_and_mul(xx)
    yy.backward(dy)
    assert torch.equal(yy.detach(), got["y"]) and torch.equal(xx.grad, got["dx"]), f"{layout}: autograd op differs"


# name -> a view of grad_output [R, d] (or of its values in another dtype), and whether it allows 16-byte vectors
PACKED_GRAD_LAYOUTS = {
    "at element offset 1": (lambda t: _at_offset(t, 1), False),   # misaligned: the backward's scalar kernel
    "rows of d + 8 values": (lambda t: _in_wider_rows(t, 0, 8), True),
    "rows of d + 1 values": (lambda t: _in_wider_rows(t, 0, 1), False),
    "transposed": (lambda t: t.t().contiguous().t(), True),   # copied
    "one row expanded (row stride 0)": (lambda t: t[:1].expand(t.shape), True),
    "float32 (16-bit x), float16 (fp32 x)": (lambda t: t.to(torch.float16 if t.dtype == torch.float32 else
                                                              torch.float32), True),   # converted: a new tensor
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(PACKED_GRAD_LAYOUTS))
def test_packed_grad_output_layouts_and_dtypes(ops, dtype, layout):
    """grad_output read in place at its row stride (stride 0 too), copied or converted to x's dtype first: grad_x
    (x's dtype, contiguous) bit for bit that of grad_output converted to x's dtype and made contiguous, against
    float64; the kernel of 16-byte vectors where grad_output's pointer and stride allow them too."""
    x, dy0 = make_packed((36, 2 * 1000), dtype, seed_of("packed grad layout", dtype))
    make_view, aligned = PACKED_GRAD_LAYOUTS[layout]
    dy = make_view(dy0)
    got = {}

    def run():
        poison((x.shape, dtype))
        got["dx"] = ops.silu_and_mul_backward(dy, x)

    assert packed_widths(run) == [vector_width(dtype) if aligned else 1], layout
    dyc = dy.to(dtype).contiguous()
    assert torch.equal(got["dx"], ops.silu_and_mul_backward(dyc, x)), layout
    _, rdx = ref64_packed(x, dyc)
    check("grad_x", got["dx"], rdx, dtype, x.shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2,), (3, 14), (2, 3, 2002), (4101, 2 * 704), (3, 2 * 28672)], ids=str)
def test_packed_autograd_op_matches_float64(ops, dtype, shape):
    """torch.ops.pipegoose.silu_and_mul with .backward(): the forward kernel and the backward kernel's gradient (of x,
    one tensor), the very results of the ops; its graph node is the C++ Function."""
    x, dy = make_packed(shape, dtype, seed_of("packed autograd", shape, dtype))
    xx = x.clone().requires_grad_()
    poison((dy.shape, dtype))
    y = torch.ops.pipegoose.silu_and_mul(xx)
    assert y.requires_grad and "SiluAndMul" in type(y.grad_fn).__name__ + str(y.grad_fn.name())
    poison((x.shape, dtype))
    y.backward(dy)
    ry, rdx = ref64_packed(x, dy)
    check("out", y.detach(), ry, dtype, dy.shape)
    check("grad_x", xx.grad, rdx, dtype, x.shape)
    assert torch.equal(y.detach(), ops.silu_and_mul_forward(x))
    assert torch.equal(xx.grad, ops.silu_and_mul_backward(dy, x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [1, 129], ids=str)
def test_packed_autograd_op_with_a_broadcast_output_gradient(ops, dtype, d):
    """y.sum().backward(): the output gradient is an expanded scalar (stride 0 in every dim: read in place at row
    stride 0 for d = 1, copied otherwise)."""
    x, _ = make_packed((37, 2 * d), dtype, seed_of("packed sum", d, dtype))
    xx = x.clone().requires_grad_()
    torch.ops.pipegoose.silu_and_mul(xx).sum().backward()
    _, rdx = ref64_packed(x, torch.ones(37, d, device=DEV, dtype=dtype))
    check("grad_x", xx.grad, rdx, dtype)


def test_packed_autograd_op_without_grad_and_in_inference_mode(ops):
    x, _ = make_packed((5, 602), torch.bfloat16, seed_of("packed inference"))
    want = ops.silu_and_mul_forward(x)
    with torch.inference_mode():
        y = torch.ops.pipegoose.silu_and_mul(x)
    assert y.grad_fn is None and torch.equal(y, want)
    xx = x.clone().requires_grad_()
    with torch.no_grad():
        y = torch.ops.pipegoose.silu_and_mul(xx)
    assert not y.requires_grad and torch.equal(y, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", ["vector", 1, 129], ids=str)
def test_packed_many_rows(ops, dtype, d):
    """786435 rows of one vector, of one value (the scalar kernel) and of 129 values (the scalar kernel, rows across
    blocks of 256 threads): thousands of blocks, the last one partial, 32-bit indices. Every element written, against
    float64 (on the GPU, in slices of rows), forward and backward."""
    require_free_gpu_memory(8)
    v = vector_width(dtype)
    d = v if d == "vector" else d
    width = v if d % v == 0 else 1
    rows = 3 * 2**18 + 3
    x, dy = make_packed((rows, 2 * d), dtype, seed_of("packed rows", d, dtype))
    got = {}

    def run():
        got["y"], got["dx"] = run_packed(ops, x, dy)

    assert packed_launches(run) == [(width, False), (width, False)]
    y, dx = got["y"], got["dx"]
    for name, t in (("out", y), ("grad_x", dx)):
        assert t.is_contiguous() and bool(torch.isfinite(t).all()), f"{name}: not written everywhere ({rows} rows)"
    chunk = 1 << 21
    for start in range(0, rows, chunk):
        s = slice(start, start + chunk)
        ry, rdx = ref64_packed(x[s], dy[s], device=DEV)
        check(f"out[{start}:]", y[s], ry, dtype)
        check(f"grad_x[{start}:]", dx[s], rdx, dtype)


@pytest.mark.parametrize("case", ["one row of 2**31 + 3 values", "2**32 + 4101 values in rows of 1025",
                                  "2**32 - 4191235 values in rows of 1023"])
def test_packed_vector_indices_near_and_past_2_32(ops, case):
    """The kernel's 64-bit indices (its ``wide`` instantiation), taken where a row has more than 2**31 vectors or the
    threads 2**32 or more, and its 32-bit ones just below that (the multiply-and-shift division of indices past 2**31):
    bf16, the scalar kernel (odd d: a thread a value): one row of 2**31 + 3 values (x 8.6 GB; wide), 2**22 + 5 rows
    of 1025 values (4,299,166,725 values, x 17.2 GB; wide) and 2**22 + 3 rows of 1023 values (4,290,776,061 values,
    the last block's threads still below 2**32; 32-bit). Forward and backward: finite everywhere (every element
    written over poisoned memory), against float64 at the start, around output element 2**31 (and 2**32) and at the
    end."""
    dtype = torch.bfloat16
    if case.startswith("one row"):
        require_free_gpu_memory(26)
        rows, d, wide = 1, 2**31 + 3, True
        pieces = [(0, slice(0, 4096)), (0, slice(2**31 - 2048, min(2**31 + 2048, d))), (0, slice(d - 4096, d))]
    else:
        require_free_gpu_memory(44)
        rows, d, wide = (2**22 + 5, 1025, True) if "1025" in case else (2**22 + 3, 1023, False)
        marks = (2**31 // d, 2**32 // d)   # the rows holding output elements 2**31 and 2**32
        pieces = [(r, slice(0, d)) for r in sorted({0, *(m + k for m in marks for k in (-1, 0, 1)), rows - 1})
                  if r < rows]
    # (the kernel's rule, the scalar kernel's threads a value each: 32-bit where the last block's stay below 2**32)
    assert (-(-rows * d // 256) * 256 > 2**32 - 1 or d > 2**31) == wide
    gen = torch.Generator(device=DEV).manual_seed(31)
    x = torch.randn(rows, 2 * d, generator=gen, device=DEV, dtype=dtype) * 2
    got = {}

    def forward():
        poison(((rows, d), dtype))
        got["y"] = ops.silu_and_mul_forward(x)

    assert packed_launches(forward) == [(1, wide)]
    y = got.pop("y")
    assert y.shape == (rows, d) and all_finite(y), f"{case}: out not written everywhere"
    for r, cols in pieces:
        xs = torch.cat((x[r, cols], x[r, d + cols.start:d + cols.stop]))[None]
        check(f"{case}: out[{r}, {cols.start}:{cols.stop}]", y[r, cols][None], ref64_packed(xs), dtype)
    del y
    dy = torch.randn(rows, d, generator=gen, device=DEV, dtype=dtype)
    poison(((rows, 2 * d), dtype))
    dx = ops.silu_and_mul_backward(dy, x)
    assert dx.shape == (rows, 2 * d) and all_finite(dx), f"{case}: grad_x not written everywhere"
    for r, cols in pieces:
        xs = torch.cat((x[r, cols], x[r, d + cols.start:d + cols.stop]))[None]
        _, want = ref64_packed(xs, dy[r, cols][None])
        got_dx = torch.cat((dx[r, cols], dx[r, d + cols.start:d + cols.stop]))[None]
        check(f"{case}: grad_x[{r}, {cols.start}:{cols.stop}]", got_dx, want, dtype)
    del dx


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(0,), (0, 8), (3, 0), (0, 0), (2, 0, 6), (2, 3, 0)], ids=str)
def test_packed_empty_tensors(ops, dtype, shape):
    x = torch.empty(shape, device=DEV, dtype=dtype)
    half = half_shape(x)
    y = ops.silu_and_mul_forward(x)
    assert y.shape == half and y.dtype == dtype and y.device == x.device
    dx = ops.silu_and_mul_backward(torch.empty(half, device=DEV, dtype=dtype), x)
    assert dx.shape == shape and dx.dtype == dtype and dx.device == x.device
    xx = x.clone().requires_grad_()
    y = torch.ops.pipegoose.silu_and_mul(xx)
    y.backward(torch.empty_like(y))
    assert y.shape == half and xx.grad.shape == shape
    torch.cuda.synchronize()


def test_packed_inf_and_nan_as_torch_silu(ops):
    """fp32: the special gates, ups and output gradients (every combination) give what PyTorch's silu(gate) * up gives
    (and its gradients), in one row (the scalar kernel) and in rows of 8 (the vector kernel)."""
    g, u, dy = _special_grid(torch.float32)
    want = _torch_fp32(g, u, dy)
    n = g.numel()
    y, dx = ops.silu_and_mul_forward(torch.cat((g, u))), ops.silu_and_mul_backward(dy, torch.cat((g, u)))
    for name, a, b in zip(("out", "grad_gate", "grad_up"), (y, dx[:n], dx[n:]), want):
        _same_as_torch(f"one row: {name}", a, b)
    pad = -n % 8   # (ordinary values to a whole number of rows of 8)
    g8, u8, dy8 = (torch.cat((t, torch.ones(pad, device=DEV))).reshape(-1, 8) for t in (g, u, dy))
    x8 = torch.cat((g8, u8), -1)
    y, dx = ops.silu_and_mul_forward(x8), ops.silu_and_mul_backward(dy8, x8)
    for name, a, b in zip(("out", "grad_gate", "grad_up"), (y, dx[:, :8], dx[:, 8:]), want):
        _same_as_torch(f"rows of 8: {name}", a.reshape(-1)[:n], b)


def test_packed_bad_arguments_name_the_argument(ops):
    x, dy = make_packed((4, 6), torch.float32, seed_of("packed bad"))
    fwd, bwd, op = ops.silu_and_mul_forward, ops.silu_and_mul_backward, torch.ops.pipegoose.silu_and_mul
    cases = [
        (lambda: fwd(x[:, :5]), r"silu_and_mul_forward: x's last dimension must be even \(gate and up are its two "
                                r"halves\), got 5"),
        (lambda: fwd(x[0, 0]), r"silu_and_mul_forward: x must have at least one dimension"),
        (lambda: fwd(x.int()), r"silu_and_mul_forward: x must be float32, float16 or bfloat16, got Int"),
        (lambda: fwd(x.double()), r"silu_and_mul_forward: x must be float32, float16 or bfloat16, got Double"),
        (lambda: bwd(dy[:, :2], x), r"silu_and_mul_backward: grad_output has shape \[4, 2\] but x has \[4, 6\]; "
                                    r"expected x's shape with the last dimension halved, \[4, 3\]"),
        (lambda: bwd(x, x), r"grad_output has shape \[4, 6\] but x has \[4, 6\]"),        # x's shape: refused
        (lambda: bwd(dy.reshape(12), x), r"grad_output has shape \[12\] but x has \[4, 6\]"),   # same numel
        (lambda: bwd(dy[:1], x), r"grad_output has shape \[1, 3\] but x has \[4, 6\]"),   # broadcastable: refused
        (lambda: bwd(dy.cpu(), x), r"silu_and_mul_backward: grad_output is on cpu but x is on cuda:\d+"),
        (lambda: bwd(dy.int(), x), r"silu_and_mul_backward: grad_output must be a floating point tensor, got Int"),
        (lambda: bwd(dy, x.cpu()), r"silu_and_mul_backward: x must be a CUDA tensor, got device cpu"),
        (lambda: bwd(dy[:, :2], x[:, :5]), r"silu_and_mul_backward: x's last dimension must be even"),
        (lambda: bwd(dy[0, 0], x[0, 0]), r"silu_and_mul_backward: x must have at least one dimension"),
        (lambda: bwd(dy, x.half().int()), r"silu_and_mul_backward: x must be float32, float16 or bfloat16, got Int"),
        (lambda: op(x[:, :5]), r"silu_and_mul_forward: x's last dimension must be even"),
        (lambda: op(x.clone().requires_grad_()[:, :5]), r"x's last dimension must be even"),
        (lambda: op(x[0, 0].clone().requires_grad_()), r"x must have at least one dimension"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()
    # no CUDA tensor at all: no kernel of ours runs (the ops have none for the CPU); PyTorch says so, naming the op
    with pytest.raises(NotImplementedError, match=r"pipegoose::silu_and_mul_forward.*CPU"):
        fwd(x.cpu())
    with pytest.raises(NotImplementedError, match=r"pipegoose::silu_and_mul_backward.*CPU"):
        bwd(dy.cpu(), x.cpu())


@pytest.mark.skipif("torch.cuda.device_count() < 2", reason="needs two GPUs")
def test_packed_second_gpu(ops):
    """x on cuda:1 while cuda:0 is current: the launch on its device (results right); a grad_output on another device
    is an error naming it."""
    x, dy = (t.to("cuda:1") for t in make_packed((5, 2 * 4096), torch.bfloat16, seed_of("packed gpu1")))
    with torch.cuda.device(0):
        y, dx = ops.silu_and_mul_forward(x), ops.silu_and_mul_backward(dy, x)
    assert y.device == dx.device == torch.device("cuda", 1)
    ry, rdx = ref64_packed(x, dy)
    check("out", y, ry, torch.bfloat16)
    check("grad_x", dx, rdx, torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"grad_output is on cuda:0 but x is on cuda:1"):
        ops.silu_and_mul_backward(dy.to("cuda:0"), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_packed_opcheck(ops, dtype):
    x, dy = make_packed((2, 3, 34), dtype, seed_of("packed opcheck", dtype))
    fwd, bwd = torch.ops.pipegoose.silu_and_mul_forward.default, torch.ops.pipegoose.silu_and_mul_backward.default
    torch.library.opcheck(fwd, (x,))
    torch.library.opcheck(fwd, (x[..., 1:33],))          # rows of a wider tensor, misaligned: read in place
    torch.library.opcheck(fwd, (x.transpose(0, 1),))     # leading dims that do not flatten: copied
    torch.library.opcheck(bwd, (dy, x))
    torch.library.opcheck(bwd, (dy.transpose(0, 1), x.transpose(0, 1)))
    torch.library.opcheck(bwd, (dy.float(), x))          # grad_output of another dtype
    # the op with its autograd formula (a C++ Function), with an input that needs a gradient and without
    torch.library.opcheck(torch.ops.pipegoose.silu_and_mul.default, (x.clone().requires_grad_(),))
    torch.library.opcheck(torch.ops.pipegoose.silu_and_mul.default, (x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_packed_double_backward(ops, dtype):
    """backward with create_graph=True: the first derivative as the float64 formula's, and differentiable again: the
    second derivative (of <grad_x, v>) equals that of the float64 reference by autograd."""
    x, dy = make_packed((64, 2 * 129), dtype, seed_of("packed double", dtype))
    v = torch.randn(x.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(5)).to(dtype)
    xx = x.clone().requires_grad_()
    y = torch.ops.pipegoose.silu_and_mul(xx)
    (dx,) = torch.autograd.grad(y, (xx,), dy, create_graph=True)
    assert dx.requires_grad
    (ddx,) = torch.autograd.grad((dx.float() * v.float()).sum(), (xx,))

    x64 = x.cpu().double().requires_grad_()
    g64, u64 = x64.chunk(2, -1)
    (dx64,) = torch.autograd.grad(F.silu(g64) * u64, (x64,), dy.cpu().double(), create_graph=True)
    (ddx64,) = torch.autograd.grad((dx64 * v.cpu().double()).sum(), (x64,))
    _, rdx = ref64_packed(x, dy)
    torch.testing.assert_close(dx64.detach(), rdx)   # (the reference's two forms agree)
    check("grad_x", dx.detach(), dx64.detach(), dtype)
    assert ddx.dtype == dtype and torch.isfinite(ddx).all(), "grad_x of grad"
    torch.testing.assert_close(ddx.double().cpu(), ddx64, **tol(dtype, 2), msg=lambda m: f"grad_x of grad: {m}")


def test_packed_more_than_2_31_elements(ops):
    """bf16 x of 2**21 + 5 rows of 2 x 1024 values (2**32 + 10240 elements, 8.6 GB), out of 2**31 + 5120: offsets past
    2**31 in x, out, grad_output and grad_x; the vector kernel (x aligned) and the scalar one (x at element offset 1:
    a thread a value), against float64 on rows at the start, around element
    2**31 of x and of out, and at the end, and finite everywhere (written)."""
    require_free_gpu_memory(40)
    d, rows = 1024, 2**21 + 5
    n = rows * 2 * d
    dtype = torch.bfloat16
    gen = torch.Generator(device=DEV).manual_seed(22)
    x_buf = torch.randn(n + 1, generator=gen, device=DEV, dtype=dtype) * 2
    dy = torch.randn(rows, d, generator=gen, device=DEV, dtype=dtype)
    x_cross, y_cross = 2**31 // (2 * d), 2**31 // d   # the rows where x's and out's offsets pass 2**31
    pieces = [slice(0, 3), slice(x_cross - 2, x_cross + 2), slice(y_cross - 2, y_cross + 2), slice(rows - 3, rows)]

    for what, x, width in (("aligned", x_buf[:n].view(rows, 2 * d), 8), ("misaligned", x_buf[1:].view(rows, 2 * d),
                                                                          1)):
        assert (x.data_ptr() % 16 != 0) == (what == "misaligned")
        got = {}

        def forward():
            poison(((rows, d), dtype))
            got["y"] = ops.silu_and_mul_forward(x)

        assert packed_widths(forward) == [width], what
        y = got.pop("y")
        assert y.shape == (rows, d) and bool(torch.isfinite(y).all()), f"{what}: out not written everywhere"
        for s in pieces:
            check(f"{what} out[{s.start}:{s.stop}]", y[s], ref64_packed(x[s]), dtype)
        del y
        poison(((rows, 2 * d), dtype))
        dx = ops.silu_and_mul_backward(dy, x)
        assert dx.shape == (rows, 2 * d) and bool(torch.isfinite(dx).all()), f"{what}: grad_x not written everywhere"
        for s in pieces:
            check(f"{what} grad_x[{s.start}:{s.stop}]", dx[s], ref64_packed(x[s], dy[s])[1], dtype)
        del dx
