"""GPU: ``pipegoose::geglu_forward`` / ``geglu_backward`` and the autograd op ``pipegoose::geglu`` (ours, GELU for
SiLU on the SwiGLU kernel's launch: ``pipegoose/kernels/csrc/swiglu.cu``, binding
``pipegoose/kernels/bindings/swiglu.cpp``) against float64 on the CPU, from the same (already rounded) inputs:

    out = gelu(g) * u,  grad_gate = dy * u * gelu'(g),  grad_up = dy * gelu(g),

gelu and its derivative being PyTorch's float64 ``F.gelu(g, approximate=...)`` and its autograd derivative, for
``approximate`` "tanh" (Gemma's ``gelu_pytorch_tanh``) and "none" (erf), with the per-dtype tolerances of
``tests/tolerances.py``: sizes around the vector width and large ones, non-contiguous inputs, misaligned views (the
scalar path, bit for bit the vector path's results), large gates (where the tanh form cancels and where g**2 leaves
fp32's range), infinite and NaN inputs, empty tensors, the argument checks (``approximate`` another string),
``torch.library.opcheck`` and a double backward. Outputs are poisoned first (``poison``) and every element is checked
finite. The launch, layouts and 64-bit offsets are the SwiGLU ops' (tests/kernels/test_swiglu_cuda.py runs them past
2**31 elements); only the activation differs.

``pipegoose::gelu_and_mul_forward(x [..., 2d], approximate)`` / ``gelu_and_mul_backward`` and the autograd op
``pipegoose::gelu_and_mul`` (gate and up as the halves of x's last dimension: Gemma 4's MoE experts' gate), at the end:
against float64, bit for bit geglu's results of the two halves (the same math per value), the activation's kernel
launched (the profiler's kernel names), rows at other strides, the autograd op, errors, opcheck, a double backward.

``pipegoose::gelu_forward(x, approximate)`` / ``gelu_backward`` and the autograd op ``pipegoose::gelu`` (GELU alone,
the MLPs without a gate), last: against float64, bit for bit geglu's activation, layouts, large values, errors,
opcheck, a double backward.

Run on the GPU machine: ``python -m pytest -m cuda tests/kernels/test_geglu_cuda.py -q``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import check_elementwise as check
from kernel_helpers import packed_launches, packed_widths, poison, seed_of
from tolerances import tol

pytestmark = pytest.mark.cuda

DEV = "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
APPROX = ["tanh", "none"]
# one element (0-d, 1-d); around the vector width (8 16-bit or 4 fp32 values); odd; one block's vectors and one past
# them; a Gemma-2B MLP's activation (intermediate size 16384) over 256 tokens
SHAPES = [(), (1,), (7,), (8,), (9,), (3, 5, 1001), (4096,), (4097,), (1_000_003,), (256, 16384)]


@pytest.fixture(scope="module")
def ops():
    from pipegoose.kernels import load

    return load("pipegoose/swiglu")


def make(shape, dtype, seed, scale=3.0):
    """gate (N(0, scale^2): both tails of GELU), up and grad_output, on the GPU in ``dtype``."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    g = (torch.randn(shape, generator=gen, device=DEV) * scale).to(dtype)
    u = torch.randn(shape, generator=gen, device=DEV).to(dtype)
    dy = torch.randn(shape, generator=gen, device=DEV).to(dtype)
    return g, u, dy


def ref64(g, u, dy, approximate):
    """float64 on the CPU: (out, grad_gate, grad_up)."""
    g64 = g.detach().cpu().double().requires_grad_()
    a = F.gelu(g64, approximate=approximate)
    (da,) = torch.autograd.grad(a.sum(), g64)
    a = a.detach()
    u64, d64 = u.detach().cpu().double(), dy.detach().cpu().double()
    return a * u64, d64 * u64 * da, d64 * a


def run_ops(ops, g, u, dy, approximate):
    poison((g.shape, g.dtype))
    y = ops.geglu_forward(g, u, approximate)
    poison((g.shape, g.dtype), (g.shape, g.dtype))
    dg, du = ops.geglu_backward(dy, g, u, approximate)
    return y, dg, du


def check_ops(ops, g, u, dy, dtype, approximate, what=""):
    got = run_ops(ops, g, u, dy, approximate)
    for name, a, b in zip(("out", "grad_gate", "grad_up"), got, ref64(g, u, dy, approximate)):
        check(f"{what}{approximate} {name}", a, b, dtype, g.shape)
    return got


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_ops_match_float64(ops, dtype, shape, approximate):
    g, u, dy = make(shape, dtype, seed_of(shape, dtype, approximate))
    before = [t.clone() for t in (g, u, dy)]
    check_ops(ops, g, u, dy, dtype, approximate)
    assert all(torch.equal(a, b) for a, b in zip((g, u, dy), before)), "an input changed"


def test_the_default_is_the_tanh_approximation_and_differs_from_erf(ops):
    """The schema's default approximate is "tanh" (Gemma's); "tanh" and "none" give different results (the two
    curves differ by up to about 5e-4 near |g| = 2, far above fp32's rounding)."""
    g, u, dy = make((4097,), torch.float32, seed_of("default"))
    assert torch.equal(torch.ops.pipegoose.geglu_forward(g, u), ops.geglu_forward(g, u, "tanh"))
    assert torch.equal(torch.ops.pipegoose.geglu(g, u), ops.geglu_forward(g, u, "tanh"))
    assert all(torch.equal(a, b) for a, b in zip(torch.ops.pipegoose.geglu_backward(dy, g, u),
                                                 ops.geglu_backward(dy, g, u, "tanh")))
    diff = (ops.geglu_forward(g, torch.ones_like(u), "tanh") - ops.geglu_forward(g, torch.ones_like(u), "none"))
    assert diff.abs().max() > 1e-4


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)], ids=["both", "gate", "up"])
def test_autograd_op_matches_float64(ops, dtype, needs, approximate):
    """torch.ops.pipegoose.geglu with .backward(): the forward kernel's result and the backward kernel's gradients
    for the inputs that require them (None for the other), bit for bit those of the ops."""
    shape = (3, 5, 1001)
    g, u, dy = make(shape, dtype, seed_of("autograd", dtype, approximate))
    gg, uu = g.clone().requires_grad_(needs[0]), u.clone().requires_grad_(needs[1])
    poison((g.shape, dtype))
    y = torch.ops.pipegoose.geglu(gg, uu, approximate)
    assert y.requires_grad and y.grad_fn is not None
    poison((g.shape, dtype), (g.shape, dtype))
    y.backward(dy)
    ry, rdg, rdu = ref64(g, u, dy, approximate)
    check("out", y.detach(), ry, dtype, shape)
    dg, du = ops.geglu_backward(dy, g, u, approximate)
    for name, t, need, want, kernel in (("grad_gate", gg, needs[0], rdg, dg), ("grad_up", uu, needs[1], rdu, du)):
        if need:
            check(name, t.grad, want, dtype, shape)
            assert torch.equal(t.grad, kernel), f"{name}: not the backward kernel's result"
        else:
            assert t.grad is None, f"{name}: a gradient for an input that does not require one"
    assert torch.equal(y.detach(), ops.geglu_forward(g, u, approximate))


def test_autograd_op_without_grad_in_inference_mode_and_with_a_broadcast_gradient(ops):
    g, u, _ = make((37, 129), torch.bfloat16, seed_of("inference"))
    want = ops.geglu_forward(g, u, "tanh")
    with torch.inference_mode():
        y = torch.ops.pipegoose.geglu(g, u, "tanh")
    assert y.grad_fn is None and torch.equal(y, want)
    gg, uu = g.clone().requires_grad_(), u.clone().requires_grad_()
    torch.ops.pipegoose.geglu(gg, uu, "tanh").sum().backward()   # grad_output: an expanded scalar (stride 0)
    _, rdg, rdu = ref64(g, u, torch.ones_like(g), "tanh")
    check("grad_gate", gg.grad, rdg, torch.bfloat16, g.shape)
    check("grad_up", uu.grad, rdu, torch.bfloat16, g.shape)


# ------------------------------------------------------------------------------------------ memory layouts
def _at_offset(t: torch.Tensor, k: int) -> torch.Tensor:
    """The same values, a view at element offset ``k`` of a larger buffer (not 16-byte aligned for odd ``k``)."""
    buf = torch.empty(t.numel() + k, dtype=t.dtype, device=DEV)
    buf[k:] = t.reshape(-1)
    return buf[k:].view(t.shape)


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_and_misaligned_inputs(ops, dtype, approximate):
    """Transposed and strided views (copied by the ops) and views at odd element offsets (the scalar kernel): right
    against float64, and bit for bit the results of contiguous, aligned inputs."""
    base_g, base_u, base_dy = make((64, 2 * 1001), dtype, seed_of("layouts", dtype, approximate))
    for name, view in (("transposed", lambda t: t.t()), ("strided", lambda t: t[:, ::2])):
        g, u, dy = view(base_g), view(base_u), view(base_dy)
        got = check_ops(ops, g, u, dy, dtype, approximate, what=f"{name}: ")
        want = run_ops(ops, g.contiguous(), u.contiguous(), dy.contiguous(), approximate)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), name
    g, u, dy = (t.reshape(-1)[:3 * 4096 + 5].contiguous() for t in (base_g, base_u, base_dy))
    aligned = run_ops(ops, g, u, dy, approximate)
    gm, um, dym = _at_offset(g, 1), _at_offset(u, 3), _at_offset(dy, 1)
    assert gm.data_ptr() % 16 and um.data_ptr() % 16
    got = check_ops(ops, gm, um, dym, dtype, approximate, what="misaligned: ")
    for name, a, b in zip(("out", "grad_gate", "grad_up"), got, aligned):
        assert torch.equal(a, b), f"misaligned: {name} differs from the vector path's"


# ----------------------------------------------------------------------------------- large and special values
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_gates(ops, dtype, approximate):
    """Gates of +-3 to +-10 (where torch's 0.5 g (1 + tanh) cancels: ours keeps the tiny values' relative accuracy,
    well inside the tolerance either way), +-100, +-1e4 and, in fp32 and bf16, +-1e13, +-1e20 (g**2 past fp32's
    range: the derivative must stay finite) and +-3e38, among ordinary ones: finite results as float64 gives them;
    up and grad_output within [-1, 1], so that no true result overflows."""
    n = 3 * 4096 + 7
    g, u, dy = make((n,), dtype, seed_of("large", dtype, approximate))
    u, dy = u.clamp(-1, 1), dy.clamp(-1, 1)
    values = [3.0, -3.0, 5.0, -5.0, 8.0, -8.0, 10.0, -10.0, 100.0, -100.0, 1e4, -1e4]
    if dtype != torch.float16:
        values += [1e13, -1e13, 1e20, -1e20, 3e38, -3e38]
    specials = torch.tensor(values, device=DEV)
    g[::3] = specials.repeat(n // (3 * len(values)) + 1)[:len(range(0, n, 3))].to(dtype)
    y, dg, du = check_ops(ops, g, u, dy, dtype, approximate)
    # the limits, exactly: gelu(g) = g and gelu'(g) = 1 for large g; 0 (out, grad_up, grad_gate) for large -g
    big, small = g >= 1e4, g <= -1e4
    assert big.any() and small.any()
    gb, ub, dyb = g[big].float(), u[big].float(), dy[big].float()
    torch.testing.assert_close(y[big].float(), (gb * ub).to(dtype).float(), rtol=0, atol=0)
    torch.testing.assert_close(dg[big].float(), (dyb * ub).to(dtype).float(), rtol=0, atol=0)
    assert (y[small] == 0).all() and (dg[small] == 0).all() and (du[small] == 0).all()


@pytest.mark.parametrize("approximate", APPROX)
def test_inf_and_nan(ops, approximate):
    """fp32: a NaN gate, up or grad_output gives NaN wherever it enters (out: gate or up; grad_up: gate or
    grad_output; grad_gate: any); +inf gates give out = up * inf (gelu(inf) = inf) as PyTorch's F.gelu(g) * u does,
    -inf gates NaN as PyTorch's (-inf * 0); finite inputs finite results. Through the ops and the autograd op alike."""
    gates = [float("-inf"), float("inf"), float("nan"), 0.0, -0.0, 1.0, -1.0, 3.0, -3.0, 100.0, -100.0]
    ups = [1.0, -2.5, 0.0, float("nan")]
    dys = [1.5, -0.75, float("nan")]
    g, u, d = (t.reshape(-1).to(DEV) for t in torch.meshgrid(torch.tensor(gates), torch.tensor(ups),
                                                              torch.tensor(dys), indexing="ij"))
    y, dg, du = ops.geglu_forward(g, u, approximate), *ops.geglu_backward(d, g, u, approximate)
    gn, un, dn = torch.isnan(g), torch.isnan(u), torch.isnan(d)
    assert torch.equal(torch.isnan(y) & ~torch.isinf(g), (gn | un) & ~torch.isinf(g))
    assert torch.isnan(du[gn | dn]).all() and torch.isnan(dg[gn | un | dn]).all()
    finite = torch.isfinite(g) & torch.isfinite(u) & torch.isfinite(d)
    assert torch.isfinite(y[finite]).all() and torch.isfinite(dg[finite]).all() and torch.isfinite(du[finite]).all()
    torch_y = F.gelu(g, approximate=approximate) * u
    pos_inf = torch.isposinf(g) & ~un
    assert torch.equal(y[pos_inf].nan_to_num(), torch_y[pos_inf].nan_to_num())
    assert torch.isnan(y[torch.isneginf(g)]).all() and torch.isnan(torch_y[torch.isneginf(g)]).all()
    gg, uu = g.clone().requires_grad_(), u.clone().requires_grad_()
    yy = torch.ops.pipegoose.geglu(gg, uu, approximate)
    yy.backward(d)
    for name, a, b in (("out", yy.detach(), y), ("grad_gate", gg.grad, dg), ("grad_up", uu.grad, du)):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan()), name


# -------------------------------------------------------------------------------------------- edges, errors
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(0,), (0, 5), (3, 0, 7)], ids=str)
def test_empty_tensors(ops, dtype, shape):
    g = torch.empty(shape, device=DEV, dtype=dtype)
    y = ops.geglu_forward(g, g.clone(), "tanh")
    assert y.shape == shape and y.dtype == dtype
    dg, du = ops.geglu_backward(g, g, g.clone(), "none")
    assert dg.shape == du.shape == shape and dg.dtype == du.dtype == dtype
    gg, uu = g.clone().requires_grad_(), g.clone().requires_grad_()
    y = torch.ops.pipegoose.geglu(gg, uu, "tanh")
    y.backward(torch.empty_like(y))
    assert y.shape == gg.grad.shape == uu.grad.shape == shape


def test_bad_arguments_name_the_argument(ops):
    g, u, dy = make((4, 6), torch.float32, seed_of("bad"))
    fwd, bwd = ops.geglu_forward, ops.geglu_backward
    cases = [
        (lambda: fwd(g, u, "tan"), r'geglu_forward: approximate must be "tanh" or "none", got "tan"'),
        (lambda: fwd(g, u, "Tanh"), r'approximate must be "tanh" or "none", got "Tanh"'),
        (lambda: fwd(g, u, ""), r'approximate must be "tanh" or "none", got ""'),
        (lambda: bwd(dy, g, u, "erf"), r'geglu_backward: approximate must be "tanh" or "none", got "erf"'),
        (lambda: torch.ops.pipegoose.geglu(g.clone().requires_grad_(), u, "erf"),
         r'geglu_forward: approximate must be "tanh" or "none"'),
        (lambda: fwd(g.cpu(), u, "tanh"), r"geglu_forward: gate must be a CUDA tensor, got device cpu"),
        (lambda: fwd(g, u.half(), "tanh"), r"geglu_forward: up is Half but gate is Float; expected one dtype"),
        (lambda: fwd(g.double(), u.double(), "none"), r"geglu_forward: gate must be float32, float16 or bfloat16"),
        (lambda: fwd(g, u[:, :5], "tanh"), r"geglu_forward: up has shape \[4, 5\] but gate has \[4, 6\]"),
        (lambda: bwd(dy[:, :5], g, u, "tanh"), r"geglu_backward: grad_output has shape \[4, 5\] but gate has"),
        (lambda: bwd(dy.int(), g, u, "tanh"), r"geglu_backward: grad_output must be a floating point tensor"),
        (lambda: bwd(dy, g, u.bfloat16(), "none"), r"geglu_backward: up is BFloat16 but gate is Float"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck(ops, dtype, approximate):
    g, u, dy = make((2, 3, 17), dtype, seed_of("opcheck", dtype, approximate))
    torch.library.opcheck(torch.ops.pipegoose.geglu_forward.default, (g, u, approximate))
    torch.library.opcheck(torch.ops.pipegoose.geglu_forward.default, (g.transpose(0, 2), u.transpose(0, 2),
                                                                      approximate))
    torch.library.opcheck(torch.ops.pipegoose.geglu_backward.default, (dy, g, u, approximate))
    gg, uu = g.clone().requires_grad_(), u.clone().requires_grad_()
    for args in ((gg, uu), (gg, u), (g, uu), (g, u)):
        torch.library.opcheck(torch.ops.pipegoose.geglu.default, (*args, approximate))


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_double_backward(ops, dtype, approximate):
    """backward with create_graph=True: first derivatives as float64's, and differentiable again: the second
    derivatives (of <grad_gate, v1> + <grad_up, v2>) equal those of float64 by autograd."""
    g, u, dy = make((64, 129), dtype, seed_of("double", dtype, approximate))
    gen = torch.Generator(device=DEV).manual_seed(5)
    v1 = torch.randn(64, 129, device=DEV, generator=gen).to(dtype)
    v2 = torch.randn(64, 129, device=DEV, generator=gen).to(dtype)
    gg, uu = g.clone().requires_grad_(), u.clone().requires_grad_()
    y = torch.ops.pipegoose.geglu(gg, uu, approximate)
    dg, du = torch.autograd.grad(y, (gg, uu), dy, create_graph=True)
    assert dg.requires_grad and du.requires_grad
    ddg, ddu = torch.autograd.grad((dg.float() * v1.float()).sum() + (du.float() * v2.float()).sum(), (gg, uu))

    g64, u64 = g.cpu().double().requires_grad_(), u.cpu().double().requires_grad_()
    y64 = F.gelu(g64, approximate=approximate) * u64
    dg64, du64 = torch.autograd.grad(y64, (g64, u64), dy.cpu().double(), create_graph=True)
    ddg64, ddu64 = torch.autograd.grad((dg64 * v1.cpu().double()).sum() + (du64 * v2.cpu().double()).sum(),
                                       (g64, u64))
    check("grad_gate", dg.detach(), dg64.detach(), dtype, g.shape)
    check("grad_up", du.detach(), du64.detach(), dtype, g.shape)
    for name, a, b in (("grad_gate of grad", ddg, ddg64), ("grad_up of grad", ddu, ddu64)):
        assert a.dtype == dtype and torch.isfinite(a).all(), name
        torch.testing.assert_close(a.double().cpu(), b, **tol(dtype, 2), msg=lambda m: f"{name}: {m}")


# ===================================================================================== gelu_and_mul: x packed
# pipegoose::gelu_and_mul_forward(x [..., 2d], approximate) -> out [..., d] = gelu(x[..., :d]) * x[..., d:];
# gelu_and_mul_backward(grad_output [..., d], x, approximate) -> grad_x [..., 2d]; the autograd op
# pipegoose::gelu_and_mul. The launch is silu_and_mul's (tests/kernels/test_swiglu_cuda.py: layouts, many rows,
# 64-bit indices); the activation is geglu's.
KERNEL_ACT = {"tanh": "GeluTanh", "none": "GeluErf"}
# d = 1, odd d (the scalar kernel), d a multiple of 4 but not 8 (fp32's vectors only), multiples of 8; a MoE
# expert's intermediate size (704) over 4101 routed rows; 3-d x
PACKED_SHAPES = [(2,), (5, 2), (3, 14), (7, 24), (17, 2000), (2, 3, 2002), (4101, 2 * 704), (3, 2 * 2113)]


def make_packed(shape, dtype, seed):
    """x [..., 2d] (make's gate in each row's first d values, its up in the last d) and grad_output [..., d]."""
    *lead, two_d = shape
    g, u, dy = make((*lead, two_d // 2), dtype, seed)
    return torch.cat((g, u), -1), dy


def ref64_packed(x, dy, approximate):
    """float64 on the CPU of x's halves: (out, grad_x)."""
    d = x.shape[-1] // 2
    y, dg, du = ref64(x[..., :d], x[..., d:], dy, approximate)
    return y, torch.cat((dg, du), -1)


def run_packed(ops, x, dy, approximate):
    poison((dy.shape, x.dtype))
    y = ops.gelu_and_mul_forward(x, approximate)
    poison((x.shape, x.dtype))
    dx = ops.gelu_and_mul_backward(dy, x, approximate)
    return y, dx


def vector_width(dtype):
    return 16 // torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", PACKED_SHAPES, ids=str)
def test_packed_ops_match_float64(ops, dtype, shape, approximate):
    """gelu_and_mul_forward / _backward against float64, every element written, the inputs left as they were; the
    kernel of approximate's activation, of 16-byte vectors where d allows; bit for bit geglu_forward / _backward of
    the two halves."""
    x, dy = make_packed(shape, dtype, seed_of("gelu_and_mul", shape, dtype, approximate))
    before = (x.clone(), dy.clone())
    got = {}

    def run():
        got["y"], got["dx"] = run_packed(ops, x, dy, approximate)

    d = shape[-1] // 2
    v = vector_width(dtype)
    width = v if d % v == 0 else 1
    assert packed_launches(run, KERNEL_ACT[approximate]) == [(width, False), (width, False)]
    ry, rdx = ref64_packed(x, dy, approximate)
    check(f"{approximate} out", got["y"], ry, dtype, dy.shape)
    check(f"{approximate} grad_x", got["dx"], rdx, dtype, x.shape)
    assert torch.equal(x, before[0]) and torch.equal(dy, before[1]), "an input changed"
    g, u = (t.contiguous() for t in x.chunk(2, -1))
    assert torch.equal(got["y"], ops.geglu_forward(g, u, approximate)), "out differs from geglu's"
    dg, du = ops.geglu_backward(dy, g, u, approximate)
    assert torch.equal(got["dx"], torch.cat((dg, du), -1)), "grad_x differs from geglu's"


def _in_wider_rows(x, offset, extra):
    wide = torch.full((*x.shape[:-1], offset + x.shape[-1] + extra), float("nan"), dtype=x.dtype, device=DEV)
    wide[..., offset:offset + x.shape[-1]] = x
    return wide[..., offset:offset + x.shape[-1]]


# name -> (a view of x [R, 2d]; whether the kernel reads 16-byte vectors of it)
PACKED_LAYOUTS = {
    "rows of a wider tensor from column 3": (lambda x: _in_wider_rows(x, 3, 5), False),   # misaligned: scalar
    "rows of a wider tensor from column 8": (lambda x: _in_wider_rows(x, 8, 8), True),    # aligned, strided
    "transposed (last dim not contiguous)": (lambda x: x.t().contiguous().t(), True),     # copied
}


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(PACKED_LAYOUTS))
def test_packed_layouts(ops, dtype, layout, approximate):
    """x in other layouts: against float64 and bit for bit the results of x.contiguous(); the autograd op gives the
    same."""
    make_view, aligned = PACKED_LAYOUTS[layout]
    base, dy = make_packed((36, 2 * 1000), dtype, seed_of("gelu_and_mul layout", dtype, approximate))
    x = make_view(base)
    assert not x.is_contiguous()
    got = {}

    def run():
        got["y"], got["dx"] = run_packed(ops, x, dy, approximate)

    want = vector_width(dtype) if aligned else 1
    assert packed_widths(run, KERNEL_ACT[approximate]) == [want, want], layout
    ry, rdx = ref64_packed(x, dy, approximate)
    check("out", got["y"], ry, dtype, dy.shape)
    check("grad_x", got["dx"], rdx, dtype, x.shape)
    xc = x.contiguous()
    assert torch.equal(got["y"], ops.gelu_and_mul_forward(xc, approximate)), layout
    assert torch.equal(got["dx"], ops.gelu_and_mul_backward(dy, xc, approximate)), layout
    xx = x.detach().requires_grad_()
    yy = torch.ops.pipegoose.gelu_and_mul(xx, approximate)
    yy.backward(dy)
    assert torch.equal(yy.detach(), got["y"]) and torch.equal(xx.grad, got["dx"]), f"{layout}: autograd op differs"


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_packed_autograd_op(ops, dtype, approximate):
    """torch.ops.pipegoose.gelu_and_mul with .backward(): the ops' very results, its graph node the C++ Function;
    the schema's default approximate is "tanh"; no graph under inference mode; a broadcast output gradient."""
    x, dy = make_packed((4101, 2 * 704), dtype, seed_of("gelu_and_mul autograd", dtype, approximate))
    xx = x.clone().requires_grad_()
    y = torch.ops.pipegoose.gelu_and_mul(xx, approximate)
    assert y.requires_grad and "GeluAndMul" in type(y.grad_fn).__name__ + str(y.grad_fn.name())
    y.backward(dy)
    assert torch.equal(y.detach(), ops.gelu_and_mul_forward(x, approximate))
    assert torch.equal(xx.grad, ops.gelu_and_mul_backward(dy, x, approximate))
    ry, rdx = ref64_packed(x, dy, approximate)
    check("out", y.detach(), ry, dtype, dy.shape)
    check("grad_x", xx.grad, rdx, dtype, x.shape)
    if approximate == "tanh":
        assert torch.equal(torch.ops.pipegoose.gelu_and_mul(x), y.detach())
        assert torch.equal(torch.ops.pipegoose.gelu_and_mul_forward(x), y.detach())
        assert torch.equal(torch.ops.pipegoose.gelu_and_mul_backward(dy, x), xx.grad)
    with torch.inference_mode():
        yi = torch.ops.pipegoose.gelu_and_mul(x, approximate)
    assert yi.grad_fn is None and torch.equal(yi, y.detach())
    xs = x[:37].clone().requires_grad_()
    torch.ops.pipegoose.gelu_and_mul(xs, approximate).sum().backward()   # grad_output: an expanded scalar
    _, rdx = ref64_packed(x[:37], torch.ones_like(dy[:37]), approximate)
    check("grad_x of sum()", xs.grad, rdx, dtype, xs.shape)


@pytest.mark.parametrize("approximate", APPROX)
def test_packed_special_values_as_geglu(ops, approximate):
    """Large, infinite and NaN gates, ups and output gradients (fp32 and bf16): bit for bit (NaN where NaN) geglu's
    results of the two halves, which test_large_gates and test_inf_and_nan check against float64 and PyTorch."""
    gates = [float("-inf"), float("inf"), float("nan"), 0.0, -0.0, 1.0, -3.0, 5.0, -10.0, 100.0, -1e4, 1e20, -3e38]
    ups = [1.0, -2.5, 0.0, float("nan")]
    dys = [1.5, -0.75, float("nan")]
    g, u, d = (t.reshape(-1, 8).to(DEV) for t in torch.meshgrid(torch.tensor(gates), torch.tensor(ups),
                                                                 torch.tensor(dys[:2] * 4), indexing="ij"))
    d = d.clone()
    d[::3, ::5] = float("nan")
    for dtype in (torch.float32, torch.bfloat16):
        gt, ut, dt = g.to(dtype), u.to(dtype), d.to(dtype)
        x = torch.cat((gt, ut), -1)
        y, dx = ops.gelu_and_mul_forward(x, approximate), ops.gelu_and_mul_backward(dt, x, approximate)
        wy = ops.geglu_forward(gt, ut, approximate)
        wdg, wdu = ops.geglu_backward(dt, gt, ut, approximate)
        for name, a, b in (("out", y, wy), ("grad_x", dx, torch.cat((wdg, wdu), -1))):
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), (dtype, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(0,), (0, 8), (3, 0), (2, 0, 6)], ids=str)
def test_packed_empty_tensors(ops, dtype, shape):
    x = torch.empty(shape, device=DEV, dtype=dtype)
    half = (*shape[:-1], shape[-1] // 2)
    y = ops.gelu_and_mul_forward(x, "none")
    assert y.shape == half and y.dtype == dtype
    dx = ops.gelu_and_mul_backward(torch.empty(half, device=DEV, dtype=dtype), x, "tanh")
    assert dx.shape == shape and dx.dtype == dtype
    xx = x.clone().requires_grad_()
    y = torch.ops.pipegoose.gelu_and_mul(xx, "tanh")
    y.backward(torch.empty_like(y))
    assert y.shape == half and xx.grad.shape == shape


def test_packed_bad_arguments_name_the_argument(ops):
    x, dy = make_packed((4, 6), torch.float32, seed_of("gelu_and_mul bad"))
    fwd, bwd, op = ops.gelu_and_mul_forward, ops.gelu_and_mul_backward, torch.ops.pipegoose.gelu_and_mul
    cases = [
        (lambda: fwd(x, "tan"), r'gelu_and_mul_forward: approximate must be "tanh" or "none", got "tan"'),
        (lambda: bwd(dy, x, "erf"), r'gelu_and_mul_backward: approximate must be "tanh" or "none", got "erf"'),
        (lambda: op(x.clone().requires_grad_(), "Tanh"), r'gelu_and_mul_forward: approximate must be "tanh"'),
        (lambda: fwd(x[:, :5], "tanh"), r"gelu_and_mul_forward: x's last dimension must be even \(gate and up are "
                                        r"its two halves\), got 5"),
        (lambda: fwd(x[0, 0], "none"), r"gelu_and_mul_forward: x must have at least one dimension"),
        (lambda: fwd(x.double(), "none"), r"gelu_and_mul_forward: x must be float32, float16 or bfloat16, got Double"),
        (lambda: bwd(dy[:, :2], x, "tanh"), r"gelu_and_mul_backward: grad_output has shape \[4, 2\] but x has "
                                            r"\[4, 6\]; expected x's shape with the last dimension halved, \[4, 3\]"),
        (lambda: bwd(dy.cpu(), x, "tanh"), r"gelu_and_mul_backward: grad_output is on cpu but x is on cuda"),
        (lambda: bwd(dy.int(), x, "none"), r"gelu_and_mul_backward: grad_output must be a floating point tensor"),
        (lambda: bwd(dy, x.cpu(), "none"), r"gelu_and_mul_backward: x must be a CUDA tensor, got device cpu"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_packed_opcheck(ops, dtype, approximate):
    x, dy = make_packed((2, 3, 34), dtype, seed_of("gelu_and_mul opcheck", dtype, approximate))
    fwd, bwd = torch.ops.pipegoose.gelu_and_mul_forward.default, torch.ops.pipegoose.gelu_and_mul_backward.default
    torch.library.opcheck(fwd, (x, approximate))
    torch.library.opcheck(fwd, (x[..., 1:33], approximate))        # rows of a wider tensor, misaligned
    torch.library.opcheck(fwd, (x.transpose(0, 1), approximate))   # leading dims that do not flatten: copied
    torch.library.opcheck(bwd, (dy, x, approximate))
    torch.library.opcheck(bwd, (dy.float(), x, approximate))       # grad_output of another dtype
    torch.library.opcheck(torch.ops.pipegoose.gelu_and_mul.default, (x.clone().requires_grad_(), approximate))
    torch.library.opcheck(torch.ops.pipegoose.gelu_and_mul.default, (x, approximate))


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_packed_double_backward(ops, dtype, approximate):
    """backward with create_graph=True: grad_x as float64's, and differentiable again: the second derivative (of
    <grad_x, v>) equals float64's by autograd."""
    x, dy = make_packed((64, 2 * 129), dtype, seed_of("gelu_and_mul double", dtype, approximate))
    v = torch.randn(x.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(9)).to(dtype)
    xx = x.clone().requires_grad_()
    (dx,) = torch.autograd.grad(torch.ops.pipegoose.gelu_and_mul(xx, approximate), xx, dy, create_graph=True)
    assert dx.requires_grad
    (ddx,) = torch.autograd.grad((dx.float() * v.float()).sum(), xx)
    x64 = x.cpu().double().requires_grad_()
    g64, u64 = x64.chunk(2, -1)
    (dx64,) = torch.autograd.grad(F.gelu(g64, approximate=approximate) * u64, x64, dy.cpu().double(),
                                  create_graph=True)
    (ddx64,) = torch.autograd.grad((dx64 * v.cpu().double()).sum(), x64)
    check("grad_x", dx.detach(), dx64.detach(), dtype, x.shape)
    assert ddx.dtype == dtype and torch.isfinite(ddx).all()
    torch.testing.assert_close(ddx.double().cpu(), ddx64, **tol(dtype, 2), msg=lambda m: f"grad of grad_x: {m}")


# ============================================================================================ gelu: GELU alone
# pipegoose::gelu_forward(x, approximate) -> gelu(x); gelu_backward(grad_output, x, approximate) -> grad_output *
# gelu'(x); the autograd op pipegoose::gelu (default approximate "none", as F.gelu). The launch is swiglu's with one
# input (tests/kernels/test_swiglu_cuda.py: sizes, layouts); the activation is geglu's.
def ref64_gelu(x, dy, approximate):
    """float64 on the CPU: (out, grad_x)."""
    x64 = x.detach().cpu().double().requires_grad_()
    y = F.gelu(x64, approximate=approximate)
    (dx,) = torch.autograd.grad(y, x64, dy.detach().cpu().double())
    return y.detach(), dx


def check_gelu_ops(ops, x, dy, dtype, approximate, what=""):
    poison((x.shape, dtype))
    y = ops.gelu_forward(x, approximate)
    poison((x.shape, dtype))
    dx = ops.gelu_backward(dy, x, approximate)
    for name, a, b in zip(("out", "grad_x"), (y, dx), ref64_gelu(x, dy, approximate)):
        check(f"{what}gelu {approximate} {name}", a, b, dtype, x.shape)
    return y, dx


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gelu_ops_match_float64(ops, dtype, shape, approximate):
    x, _, dy = make(shape, dtype, seed_of("gelu", shape, dtype, approximate))
    before = [t.clone() for t in (x, dy)]
    check_gelu_ops(ops, x, dy, dtype, approximate)
    assert all(torch.equal(a, b) for a, b in zip((x, dy), before)), "an input changed"


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_is_geglus_activation_and_agrees_with_f_gelu(ops, dtype, approximate):
    """gelu(x) bit for bit geglu(x, 1) (one activation code, one rounding); against F.gelu (PyTorch's kernel, fp32
    math, one rounding) within the dtype's tolerance, forward and backward."""
    x, _, dy = make((5, 4099), dtype, seed_of("gelu-geglu", dtype, approximate))
    y = ops.gelu_forward(x, approximate)
    assert torch.equal(y, ops.geglu_forward(x, torch.ones_like(x), approximate))
    xx = x.clone().requires_grad_()
    want = F.gelu(xx, approximate=approximate)
    want.backward(dy)
    torch.testing.assert_close(y, want.detach(), **tol(dtype, 2))
    torch.testing.assert_close(ops.gelu_backward(dy, x, approximate), xx.grad, **tol(dtype, 2))


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_non_contiguous_misaligned_and_large_inputs(ops, dtype, approximate):
    """Transposed and strided views (copied) and a view at an odd element offset (the scalar kernel): right against
    float64 and bit for bit the contiguous, aligned results; inputs of +-3 to +-1e4 (and, but in fp16, past fp32's
    square range): finite, the limits gelu(x) = x and 0 exactly."""
    base, _, base_dy = make((64, 2 * 1001), dtype, seed_of("gelu-layouts", dtype, approximate))
    for name, view in (("transposed", lambda t: t.t()), ("strided", lambda t: t[:, ::2])):
        got = check_gelu_ops(ops, view(base), view(base_dy), dtype, approximate, what=f"{name}: ")
        want = (ops.gelu_forward(view(base).contiguous(), approximate),
                ops.gelu_backward(view(base_dy).contiguous(), view(base).contiguous(), approximate))
        assert all(torch.equal(a, b) for a, b in zip(got, want)), name
    x, dy = (t.reshape(-1)[:3 * 4096 + 5].contiguous() for t in (base, base_dy))
    values = [3.0, -3.0, 8.0, -8.0, 10.0, -10.0, 100.0, -100.0, 1e4, -1e4]
    if dtype != torch.float16:
        values += [1e20, -1e20, 3e38, -3e38]
    x[::3] = torch.tensor(values, device=DEV).repeat(len(range(0, x.numel(), 3)) // len(values) + 1)[
        :len(range(0, x.numel(), 3))].to(dtype)
    dy = dy.clamp(-1, 1)
    aligned = check_gelu_ops(ops, x, dy, dtype, approximate)
    xm, dym = _at_offset(x, 1), _at_offset(dy, 3)
    assert xm.data_ptr() % 16 and dym.data_ptr() % 16
    got = check_gelu_ops(ops, xm, dym, dtype, approximate, what="misaligned: ")
    assert all(torch.equal(a, b) for a, b in zip(got, aligned)), "misaligned: differs from the vector path's"
    y, dx = aligned
    big, small = x >= 1e4, x <= -1e4
    assert torch.equal(y[big], x[big]) and torch.equal(dx[big], dy[big])
    assert (y[small] == 0).all() and (dx[small] == 0).all()


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_autograd_op(ops, dtype, approximate):
    """torch.ops.pipegoose.gelu: the forward kernel's result, the backward kernel's gradient (a broadcast scalar
    gradient too); no graph in inference mode; the schema's default is "none" (F.gelu's)."""
    x, _, dy = make((3, 5, 1001), dtype, seed_of("gelu-autograd", dtype, approximate))
    xx = x.clone().requires_grad_()
    poison((x.shape, dtype))
    y = torch.ops.pipegoose.gelu(xx, approximate)
    poison((x.shape, dtype))
    y.backward(dy)
    ry, rdx = ref64_gelu(x, dy, approximate)
    check("out", y.detach(), ry, dtype, x.shape)
    check("grad_x", xx.grad, rdx, dtype, x.shape)
    assert torch.equal(y.detach(), ops.gelu_forward(x, approximate))
    assert torch.equal(xx.grad, ops.gelu_backward(dy, x, approximate))
    xs = x.clone().requires_grad_()
    torch.ops.pipegoose.gelu(xs, approximate).sum().backward()   # grad_output: an expanded scalar (stride 0)
    assert torch.equal(xs.grad, ops.gelu_backward(torch.ones_like(x), x, approximate))
    with torch.inference_mode():
        yi = torch.ops.pipegoose.gelu(x, approximate)
    assert yi.grad_fn is None and torch.equal(yi, y.detach())
    if approximate == "none":
        assert torch.equal(torch.ops.pipegoose.gelu(x), y.detach())
        assert torch.equal(torch.ops.pipegoose.gelu_forward(x), y.detach())


def test_gelu_empty_tensors_and_bad_arguments(ops):
    for shape in [(0,), (3, 0, 7)]:
        e = torch.empty(shape, device=DEV, dtype=torch.bfloat16)
        assert ops.gelu_forward(e, "tanh").shape == shape and ops.gelu_backward(e, e, "none").shape == shape
    x, _, dy = make((4, 6), torch.float32, seed_of("gelu-bad"))
    fwd, bwd = ops.gelu_forward, ops.gelu_backward
    cases = [
        (lambda: fwd(x, "tan"), r'gelu_forward: approximate must be "tanh" or "none", got "tan"'),
        (lambda: bwd(dy, x, "erf"), r'gelu_backward: approximate must be "tanh" or "none", got "erf"'),
        (lambda: torch.ops.pipegoose.gelu(x.clone().requires_grad_(), "erf"), r"gelu_forward: approximate must be"),
        # (a CPU tensor alone dispatches to no kernel: torch's own error names the op and the backend)
        (lambda: fwd(x.cpu(), "tanh"), r"Could not run 'pipegoose::gelu_forward' with arguments from the 'CPU'"),
        (lambda: fwd(x.double(), "none"), r"gelu_forward: x must be float32, float16 or bfloat16"),
        (lambda: bwd(dy[:, :5], x, "tanh"), r"gelu_backward: grad_output has shape \[4, 5\] but x has \[4, 6\]"),
        (lambda: bwd(dy.int(), x, "tanh"), r"gelu_backward: grad_output must be a floating point tensor"),
        (lambda: bwd(dy.cpu(), x, "tanh"), r"gelu_backward: grad_output is on cpu but x is on cuda"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gelu_opcheck_and_double_backward(ops, dtype, approximate):
    x, _, dy = make((2, 3, 17), dtype, seed_of("gelu-opcheck", dtype, approximate))
    torch.library.opcheck(torch.ops.pipegoose.gelu_forward.default, (x, approximate))
    torch.library.opcheck(torch.ops.pipegoose.gelu_forward.default, (x.transpose(0, 2), approximate))
    torch.library.opcheck(torch.ops.pipegoose.gelu_backward.default, (dy, x, approximate))
    torch.library.opcheck(torch.ops.pipegoose.gelu.default, (x.clone().requires_grad_(), approximate))
    torch.library.opcheck(torch.ops.pipegoose.gelu.default, (x, approximate))
    # create_graph=True: the gradient is differentiable again; second derivatives as float64's
    x, _, dy = make((64, 129), dtype, seed_of("gelu-double", dtype, approximate))
    v = torch.randn(64, 129, device=DEV, generator=torch.Generator(device=DEV).manual_seed(5)).to(dtype)
    xx = x.clone().requires_grad_()
    (dx,) = torch.autograd.grad(torch.ops.pipegoose.gelu(xx, approximate), xx, dy, create_graph=True)
    assert dx.requires_grad
    (ddx,) = torch.autograd.grad((dx.float() * v.float()).sum(), xx)
    x64 = x.cpu().double().requires_grad_()
    (dx64,) = torch.autograd.grad(F.gelu(x64, approximate=approximate), x64, dy.cpu().double(), create_graph=True)
    (ddx64,) = torch.autograd.grad((dx64 * v.cpu().double()).sum(), x64)
    check("grad_x", dx.detach(), dx64.detach(), dtype, x.shape)
    assert ddx.dtype == dtype and torch.isfinite(ddx).all()
    torch.testing.assert_close(ddx.double().cpu(), ddx64, **tol(dtype, 2))
