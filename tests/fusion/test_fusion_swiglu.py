"""CPU: SwiGLU's gated activation ``silu(gate) * up`` (op ``swiglu``): the functional's reference path against
``F.silu(gate) * up`` (bit for bit) and float64, its argument checks, the dispatcher's reasons for the kernel
(``_pipegoose_supports`` on hand-made CUDA problems; no GPU needed), strict mode, ``FusedSwiGLUMLP``,
``FusedGateUpSwiGLUMLP`` (gate and up in one ``gate_up_proj``, op ``swiglu.packed``) and the SwiGLU probe of ``fuse``.
The same for ``silu_and_mul`` (op ``swiglu.packed``: gate and up the two halves of x's last dimension), with its
``PIPEGOOSE_IMPL_SWIGLU_PACKED`` / ``PIPEGOOSE_IMPL_SWIGLU`` variables, nested tensors and the choice cache.

The tests marked ``slow`` load the kernel library (a first run compiles it: minutes; they skip, with the reason,
where nvcc is missing) and run the ops' fake impls and the C++ autograd formula on meta tensors.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from kernel_loading import calls_of, load_or_skip
from tolerances import tol

from pipegoose.nn.fusion import FusedGateUpSwiGLUMLP, FusedSwiGLUMLP, dispatch
from pipegoose.nn.fusion import functional as PF
from pipegoose.nn.fusion.ops import swiglu as S
from pipegoose.nn.fusion.ops._common import NO_STORAGE
from pipegoose.nn.fusion.ops.swiglu import FORWARD_AD_SWIGLU
from pipegoose.nn.fusion.transformers.matching import probe_swiglu_mlp

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CUDA = torch.device("cuda", 0)   # a device object: no GPU needed to describe a problem on it


def _inputs(shape, dtype, seed=0, up_shape=None, up_dtype=None):
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(shape, generator=g) * 3).to(dtype)
    up = torch.randn(shape if up_shape is None else up_shape, generator=g).to(up_dtype or dtype)
    return gate, up


def _fwd_bwd(fn, gate, up, dy):
    gate = gate.detach().clone().requires_grad_(True)
    up = up.detach().clone().requires_grad_(True)
    y = fn(gate, up)
    y.backward(dy.to(y.dtype))
    return y.detach(), gate.grad, up.grad


def _ref64(gate, up, dy):
    """float64: silu(g) * u and its gradients dg = dy * u * s * (1 + g * (1 - s)), du = dy * g * s (reduced over
    broadcast dimensions, as autograd does)."""
    g, u, d = gate.double(), up.double(), dy.double()
    s = torch.sigmoid(g)
    y = g * s * u
    dg = d * u * s * (1 + g * (1 - s))
    du = d * g * s
    return y, dg.sum_to_size(gate.shape), du.sum_to_size(up.shape)


# ------------------------------------------------------------------------------------------- the reference path
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("shape", [(3, 7, 33), (1,), (), (2, 1031), (5, 0)])
def test_reference_path_is_torch_bit_for_bit(dtype, shape):
    """On the CPU the functional runs F.silu(gate) * up: output and both gradients equal PyTorch's exactly (the
    kernel's one-rounding numerics are for CUDA only), counted as the torch path."""
    gate, up = _inputs(shape, dtype, seed=len(shape))
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(9)).to(dtype)
    y, dg, du = _fwd_bwd(PF.swiglu, gate, up, dy)
    want, want_dg, want_du = _fwd_bwd(lambda a, b: F.silu(a) * b, gate, up, dy)
    assert y.dtype == dtype and y.shape == torch.Size(shape)
    assert dg.dtype == du.dtype == dtype
    assert torch.equal(y, want) and torch.equal(dg, want_dg) and torch.equal(du, want_du)
    assert dispatch.stats()["swiglu"] == {"torch": 1}
    expect = "empty" if gate.numel() == 0 else "fallback"
    assert dispatch.last_choice("swiglu").source == expect


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_path_against_float64(dtype):
    """The path against the float64 formula (and its gradient formulas) within the tolerance table: eager 16-bit
    rounds silu(gate) and then the product (two roundings: scale 2)."""
    gate, up = _inputs((4, 9, 257), dtype, seed=3)
    dy = torch.randn(gate.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    y, dg, du = _fwd_bwd(PF.swiglu, gate, up, dy)
    y64, dg64, du64 = _ref64(gate, up, dy)
    scale = 1 if dtype == torch.float32 else 2
    for name, got, want in (("out", y, y64), ("grad_gate", dg, dg64), ("grad_up", du, du64)):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got.double(), want, **tol(dtype, scale), msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("gshape,ushape,gdt,udt,rounded", [
    ((4, 1, 6), (1, 5, 6), torch.float32, torch.float32, torch.float32),     # broadcasting both ways
    ((3, 6), (6,), torch.bfloat16, torch.bfloat16, torch.bfloat16),          # up broadcast over rows
    ((3, 6), (3, 6), torch.float32, torch.bfloat16, torch.float32),          # mixed dtypes: the promoted dtype
    ((3, 6), (3, 6), torch.float16, torch.float64, torch.float16)])          # (silu rounded to fp16 first)
def test_broadcasting_and_mixed_dtypes_follow_pytorch(gshape, ushape, gdt, udt, rounded):
    """What the kernel does not take (shapes that broadcast, dtypes that differ) is F.silu(gate) * up exactly: shape,
    dtype and gradients (summed over broadcast dimensions) as PyTorch gives them."""
    gate, up = _inputs(gshape, gdt, seed=5, up_shape=ushape, up_dtype=udt)
    out_shape = torch.broadcast_shapes(gshape, ushape)
    dy = torch.randn(out_shape, generator=torch.Generator().manual_seed(6))
    y, dg, du = _fwd_bwd(PF.swiglu, gate, up, dy)
    want, want_dg, want_du = _fwd_bwd(lambda a, b: F.silu(a) * b, gate, up, dy)
    assert y.shape == out_shape and y.dtype == torch.promote_types(gdt, udt) == want.dtype
    assert dg.shape == gate.shape and du.shape == up.shape and dg.dtype == gdt and du.dtype == udt
    assert torch.equal(y, want) and torch.equal(dg, want_dg) and torch.equal(du, want_du)
    y64, _, du64 = _ref64(gate, up, dy.to(y.dtype))
    torch.testing.assert_close(y.double(), y64, **tol(rounded, 2))
    du_rounded = udt if udt in (torch.float16, torch.bfloat16) else rounded   # du is rounded to up's dtype
    torch.testing.assert_close(du.double(), du64, **tol(du_rounded, 8))


def test_explain_on_cpu_names_why_the_kernel_does_not_run():
    gate, up = _inputs((3, 5), torch.bfloat16)
    c = dispatch.explain("swiglu", gate, up)
    assert (c.impl, c.source, c.fallback) == ("torch", "fallback", True)
    assert "needs a CUDA tensor" in c.reasons["pipegoose"] and c.reasons["torch"] == ""
    assert "needs a CUDA tensor" in str(c)
    # explain counts nothing
    assert dispatch.stats().get("swiglu", {}) == {}
    # an empty input: the reference returns the empty result, no fallback
    c = dispatch.explain("swiglu", gate[:0], up[:0])
    assert (c.impl, c.source, c.fallback) == ("torch", "empty", False)


def test_strict_mode_raises_on_the_cpu_fallback():
    """Off CUDA the kernel cannot run, so the PyTorch path is a fallback, which strict mode refuses; an empty input
    and an explicit impl='torch' are no fallback."""
    gate, up = _inputs((3, 5), torch.float32)
    with dispatch.strict():
        with pytest.raises(dispatch.FusionFallbackError, match=r"swiglu: strict mode.*needs a CUDA tensor"):
            PF.swiglu(gate, up)
        assert PF.swiglu(gate[:0], up[:0]).shape == (0, 5)
        assert torch.equal(PF.swiglu(gate, up, impl="torch"), F.silu(gate) * up)
        assert dispatch.last_choice("swiglu").source == "argument"
        mlp = FusedSwiGLUMLP(nn.Linear(5, 7), nn.Linear(5, 7), nn.Linear(7, 5))
        with pytest.raises(dispatch.FusionFallbackError):
            mlp(gate)
        mlp_torch = FusedSwiGLUMLP(nn.Linear(5, 7), nn.Linear(5, 7), nn.Linear(7, 5), impl="torch")
        assert mlp_torch(gate).shape == (3, 5)
    # out of strict mode the same call runs (and was counted once more)
    assert torch.equal(PF.swiglu(gate, up), F.silu(gate) * up)


def test_impl_argument():
    gate, up = _inputs((3, 5), torch.float32)
    with pytest.warns(UserWarning, match=r"impl='pipegoose' cannot run this input: needs a CUDA tensor"):
        y = PF.swiglu(gate, up, impl="pipegoose")
    assert torch.equal(y, F.silu(gate) * up)
    assert dispatch.last_choice("swiglu").impl == "torch"
    with pytest.raises(ValueError, match=r"impl: swiglu has no implementation 'fused'"):
        PF.swiglu(gate, up, impl="fused")
    with pytest.raises(TypeError, match="impl"):
        PF.swiglu(gate, up, impl=1)
    assert torch.equal(PF.swiglu(gate, up, impl=" Torch "), F.silu(gate) * up)   # any case, as PIPEGOOSE_IMPL_*


# --------------------------------------------------------------------------------------------- argument errors
def test_argument_errors_name_the_argument():
    gate, up = _inputs((3, 5), torch.float32)
    cases = [
        ((1.0, up), TypeError, r"^gate: expected a floating point torch.Tensor, got float"),
        ((gate, [1.0]), TypeError, r"^up: expected a floating point torch.Tensor, got list"),
        ((gate.int(), up), TypeError, r"^gate: expected a floating point torch.Tensor, got int32"),
        ((gate, up.long()), TypeError, r"^up: expected a floating point torch.Tensor, got int64"),
        ((gate, up.bool()), TypeError, r"^up: "),
        ((gate.to(torch.complex64), up), TypeError, r"^gate: "),
        ((gate, up[:2]), ValueError, r"^up: shape \[2, 5\] does not broadcast with gate's \[3, 5\]"),
        ((gate, torch.randn(4)), ValueError, r"^up: shape \[4\] does not broadcast"),
    ]
    if hasattr(torch, "float8_e4m3fn"):
        cases += [((gate.to(torch.float8_e4m3fn), up), TypeError, r"^gate: expected dtype .*got float8_e4m3fn"),
                  ((gate, up.to(torch.float8_e4m3fn)), TypeError, r"^up: expected dtype .*got float8_e4m3fn")]
    for args, err, match in cases:
        with pytest.raises(err, match=match):
            PF.swiglu(*args)
        with pytest.raises(err, match=match):   # explain refuses what the op refuses, with its message
            dispatch.explain("swiglu", *args)
    # a refused call is not counted
    assert dispatch.stats().get("swiglu", {}) == {}


def test_argument_errors_after_a_cached_choice():
    """The choice cache holds a valid call's choice; a call with other metadata is checked again (a wrong shape
    after a right one must still raise)."""
    gate, up = _inputs((3, 5), torch.float32)
    PF.swiglu(gate, up)
    PF.swiglu(gate, up)
    with pytest.raises(ValueError, match="^up: "):
        PF.swiglu(gate, up[:, :2])
    with pytest.raises(TypeError, match="^up: "):
        PF.swiglu(gate, up.int())


def test_device_mismatch_names_up():
    """(A CUDA tensor needs a GPU; the meta device stands in for the second device. tests/kernels/test_swiglu_cuda.py
    checks the kernel's own device check.)"""
    gate, up = _inputs((3, 5), torch.float32)
    with pytest.raises(ValueError, match=r"^up: on meta, expected gate's device cpu"):
        PF.swiglu(gate, up.to("meta"))
    with pytest.raises(ValueError, match=r"^up: on cpu, expected gate's device meta"):
        dispatch.explain("swiglu", gate.to("meta"), up)


# ------------------------------------------------------------------------------ the kernel's supports() on CUDA
def _cuda_problem(gate, up):
    """The problem of (gate, up) as if they were on a GPU (metadata only: the CPU tensors describe it)."""
    return replace(S.swiglu_problem(gate, up), device=CUDA)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_takes_one_shape_and_one_dtype_on_cuda(dtype):
    supports = dispatch.implementations("swiglu")["pipegoose"].supports
    gate, up = _inputs((2, 3, 11), dtype)
    assert supports(_cuda_problem(gate, up)) == (True, "")
    assert supports(_cuda_problem(gate[0, 0, 0], up[0, 0, 0])) == (True, "")   # 0-d: one element
    assert supports(_cuda_problem(gate.transpose(0, 2), up.transpose(0, 2))) == (True, "")   # copied to contiguous
    assert supports(S.swiglu_problem(gate, up)) == (False, "needs a CUDA tensor, got device cpu")


@pytest.mark.parametrize("what,build,reason", [
    ("dtypes differ", lambda g, u: (g, u.half()), r"up is float16 and gate float32: the kernel takes one dtype"),
    ("gate float64", lambda g, u: (g.double(), u.double()), r"dtype float64 not supported \(float32, float16, "
                                                            r"bfloat16\)"),
    ("shapes differ (broadcast)", lambda g, u: (g, u[:1]), r"up's shape \[1, 5\] differs from gate's \[3, 5\]: "
                                                          r"the kernel does not broadcast"),
    ("same numel, other shape", lambda g, u: (g, u.reshape(5, 3)), r"differs from gate's \[3, 5\]"),
    ("empty", lambda g, u: (g[:0], u[:0]), r"^an empty input$"),
], ids=["dtypes_differ", "float64", "broadcast", "other_shape", "empty"])
def test_kernel_declines_on_cuda_with_the_reason(what, build, reason):
    supports = dispatch.implementations("swiglu")["pipegoose"].supports
    ok, why = supports(_cuda_problem(*build(*_inputs((3, 5), torch.float32))))
    assert not ok, what
    assert re.search(reason, why), (what, why)


def test_kernel_declines_tensors_without_storage_and_dual_tensors():
    supports = dispatch.implementations("swiglu")["pipegoose"].supports
    p = _cuda_problem(*_inputs((3, 5), torch.float32))
    assert supports(replace(p, extra={**p.extra, "storage": False})) == (False, NO_STORAGE)
    assert supports(replace(p, extra={**p.extra, "forward_ad": True})) == (False, FORWARD_AD_SWIGLU)


def test_problem_describes_the_call():
    gate, up = _inputs((2, 3, 11), torch.bfloat16)
    p = S.swiglu_problem(gate, up.requires_grad_())
    assert (p.op, p.dtype, p.device, p.cols, p.needs_grad) == ("swiglu", torch.bfloat16, torch.device("cpu"), 11, True)
    assert p["shape"] == p["up_shape"] == (2, 3, 11) and p["numel"] == 66 and p["up_dtype"] == torch.bfloat16
    assert p["storage"] is True and p["forward_ad"] is False
    assert not S.swiglu_problem(gate, up.detach()).needs_grad
    p0 = S.swiglu_problem(gate[0, 0, 0], up[0, 0, 0])
    assert p0.cols == 1 and p0["numel"] == 1 and p0["shape"] == ()


def test_choice_on_cuda_of_empty_and_small_inputs_loads_no_kernel(monkeypatch):
    """On a GPU an empty input runs the reference (source "empty", no fallback: strict mode passes) and an input under
    PIPEGOOSE_SMALL_NUMEL the native ops (source "small", the kernel named as one that takes it), both on metadata
    alone: no kernel is loaded (or built) for them."""
    def no_kernel(name):
        raise AssertionError(f"loaded {name}")

    monkeypatch.setattr(dispatch, "kernel", no_kernel)
    monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "1000")
    gate, up = _inputs((4, 0), torch.bfloat16)
    with dispatch.strict():
        c = dispatch.select("swiglu", _cuda_problem(gate, up))
    assert (c.impl, c.source, c.fallback) == ("torch", "empty", False)
    gate, up = _inputs((3, 5), torch.bfloat16)
    with dispatch.strict():
        c = dispatch.select("swiglu", _cuda_problem(gate, up))
    assert (c.impl, c.source, c.fallback) == ("torch", "small", False)
    assert "fused paths that take it: pipegoose" in c.reason
    # a small input the kernel does not take (broadcast) is a real fallback, also when small
    with dispatch.strict(), pytest.raises(dispatch.FusionFallbackError, match="does not broadcast"):
        dispatch.select("swiglu", _cuda_problem(gate, up[:1]))


@pytest.mark.parametrize("op", ["swiglu", "geglu"])
def test_choice_on_cuda_picks_the_kernel_where_it_loads(monkeypatch, op):
    """Above the small size, on CUDA, with the kernel loadable (a stand-in here), the kernel is the built-in choice;
    where it cannot load, the reference runs with the load error as the reason (a fallback). (geglu: the same kernel
    library, pipegoose/swiglu.)"""
    monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "0")
    gate, up = _inputs((3, 5), torch.float16)
    extra = {"approximate": "tanh"} if op == "geglu" else {}
    problem = replace(S.swiglu_problem(gate, up, op, **extra), device=CUDA)
    monkeypatch.setattr(dispatch, "kernel", lambda name: (object(), "") if name == "pipegoose/swiglu"
                        else (None, f"{name}: unexpected"))
    c = dispatch.choose(op, problem)
    assert (c.impl, c.source, c.fallback) == ("pipegoose", "builtin", False)
    monkeypatch.setattr(dispatch, "kernel", lambda name: (None, f"{name} unavailable: nvcc missing"))
    c = dispatch.choose(op, problem)
    assert (c.impl, c.fallback) == ("torch", True) and "pipegoose/swiglu unavailable: nvcc missing" in c.reason


# -------------------------------------------------------------------------------------------------- other inputs
def test_vmap_and_forward_ad_run_the_reference():
    gate, up = _inputs((4, 6), torch.float32, seed=2)
    assert torch.equal(torch.func.vmap(PF.swiglu)(gate, up), F.silu(gate) * up)
    tangent = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    _, jvp = torch.func.jvp(lambda g: PF.swiglu(g, up), (gate,), (tangent,))
    _, want = torch.func.jvp(lambda g: F.silu(g) * up, (gate,), (tangent,))
    assert torch.equal(jvp, want)


@pytest.mark.parametrize("layout", ["jagged", "strided"])
def test_nested_tensors_run_the_reference(layout):
    """A nested tensor goes to PyTorch's ops (a fallback, counted), which take both layouts: F.silu(gate) * up."""
    g = torch.Generator().manual_seed(8)
    parts_g = [torch.randn(2, 4, generator=g), torch.randn(3, 4, generator=g)]
    parts_u = [torch.randn(2, 4, generator=g), torch.randn(3, 4, generator=g)]
    if layout == "jagged":   # (one offsets tensor: the same ragged dimension)
        offsets = torch.tensor([0, 2, 5])
        gate = torch.nested.nested_tensor_from_jagged(torch.cat(parts_g), offsets)
        up = torch.nested.nested_tensor_from_jagged(torch.cat(parts_u), offsets)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # ("the PyTorch API of nested tensors is in prototype stage")
            gate, up = torch.nested.nested_tensor(parts_g), torch.nested.nested_tensor(parts_u)
    want = F.silu(gate) * up   # PyTorch takes it
    y = PF.swiglu(gate, up)
    assert y.is_nested
    for got, w in zip(y.unbind(), want.unbind()):
        assert torch.equal(got, w)
    c = dispatch.last_choice("swiglu")
    assert c.fallback and "nested tensor" in c.reason


# ------------------------------------------------------------------------------------------------ FusedSwiGLUMLP
class _MLP(nn.Module):
    """transformers' LlamaMLP, written out."""

    def __init__(self, hidden=8, inter=12, bias=False, act=None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act_fn = act if act is not None else nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _GateUpMLP(nn.Module):
    """transformers' Phi3MLP, written out (its activation as Phi-3 names it, or under another name)."""

    def __init__(self, hidden=8, inter=12, bias=False, act=None, act_name="activation_fn"):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act_name = act_name
        setattr(self, act_name, act if act is not None else nn.SiLU())

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * getattr(self, self.act_name)(gate))


# the two layouts: (the MLP written out, its fused module, the op it runs, its projections' parameters without bias)
LAYOUTS = {"gate_proj_up_proj": (_MLP, FusedSwiGLUMLP, "swiglu", 3),
           "gate_up_proj": (_GateUpMLP, FusedGateUpSwiGLUMLP, "swiglu.packed", 2)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_mlp_from_module_is_a_drop_in(layout, bias, dtype):
    """The same children (the activation too, held, not called), Parameters, state_dict keys and training flag; on
    the CPU the reference path (through the dispatcher, op swiglu or swiglu.packed) gives the MLP's output and
    gradients bit for bit."""
    make, cls, op, n_weights = LAYOUTS[layout]
    torch.manual_seed(0)
    mlp = make(bias=bias).to(dtype).eval()
    fused = cls.from_module(mlp)
    assert [(n, id(m)) for n, m in fused.named_children()] == [(n, id(m)) for n, m in mlp.named_children()]
    assert list(fused.state_dict()) == list(mlp.state_dict())
    assert [id(p) for p in fused.parameters()] == [id(p) for p in mlp.parameters()]
    assert not fused.training and fused.impl is None
    x = torch.randn(2, 3, 8, dtype=dtype, requires_grad=True)
    dy = torch.randn(2, 3, 8, dtype=dtype)
    want = mlp(x)
    want_dx, *want_grads = torch.autograd.grad(want, [x, *mlp.parameters()], dy)
    dispatch.reset_stats()
    got = fused(x)
    dx, *grads = torch.autograd.grad(got, [x, *fused.parameters()], dy)
    assert torch.equal(got, want) and torch.equal(dx, want_dx)
    assert len(grads) == len(want_grads) == n_weights * (2 if bias else 1)
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))
    assert dispatch.stats() == {op: {"torch": 1}}   # (the fused module's call; the original calls its activation)


def test_fused_mlp_keeps_the_training_flag_and_the_children_theirs():
    mlp = _MLP().train()
    mlp.down_proj.eval()
    fused = FusedSwiGLUMLP.from_module(mlp)
    assert fused.training and not fused.down_proj.training and fused.gate_proj.training
    mlp.eval()
    assert not FusedSwiGLUMLP.from_module(mlp).training


def test_fused_mlp_constructor_checks():
    lin = nn.Linear(4, 4)
    with pytest.raises(TypeError, match=r"^up_proj: expected a torch.nn.Module, got function"):
        FusedSwiGLUMLP(lin, F.relu, lin)
    with pytest.raises(ValueError, match=r"impl: swiglu has no implementation 'triton'"):
        FusedSwiGLUMLP(lin, lin, lin, impl="triton")
    with pytest.raises(TypeError, match="impl"):
        FusedSwiGLUMLP(lin, lin, lin, impl=3)
    m = FusedSwiGLUMLP(nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 4), impl="torch")
    assert "impl='torch'" in repr(m) and [n for n, _ in m.named_children()] == ["gate_proj", "up_proj", "down_proj"]
    x = torch.randn(3, 4)
    assert torch.equal(m(x), m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x)))


def test_from_module_refuses_what_is_not_a_swiglu_mlp():
    with pytest.raises(TypeError, match=r"^mlp: expected a module with submodules gate_proj, up_proj and down_proj, "
                                        r"got Linear without gate_proj, up_proj, down_proj"):
        FusedSwiGLUMLP.from_module(nn.Linear(4, 4))
    partial = _MLP()
    del partial.up_proj
    with pytest.raises(TypeError, match=r"without up_proj$"):
        FusedSwiGLUMLP.from_module(partial)
    with pytest.raises(TypeError, match="^mlp: "):
        FusedSwiGLUMLP.from_module("mlp")
    gelu = _MLP(act=nn.GELU(approximate="tanh"))
    with pytest.raises(ValueError, match=r"^mlp: _MLP does not pass the SwiGLU probe: act_fn \(GELU\) is not SiLU"):
        FusedSwiGLUMLP.from_module(gelu)
    # verify=False takes it as it is (the caller's word): the fused module then computes SwiGLU, not GELU
    fused = FusedSwiGLUMLP.from_module(gelu, verify=False)
    x = torch.randn(2, 8)
    assert torch.equal(fused(x), gelu.down_proj(F.silu(gelu.gate_proj(x)) * gelu.up_proj(x)))


def test_fused_gate_up_mlp_constructor_checks():
    lin = nn.Linear(4, 4)
    with pytest.raises(TypeError, match=r"^down_proj: expected a torch.nn.Module, got function"):
        FusedGateUpSwiGLUMLP(lin, F.relu)
    with pytest.raises(ValueError, match=r"impl: swiglu.packed has no implementation 'triton'"):
        FusedGateUpSwiGLUMLP(lin, lin, impl="triton")
    with pytest.raises(TypeError, match="impl"):
        FusedGateUpSwiGLUMLP(lin, lin, impl=3)
    m = FusedGateUpSwiGLUMLP(nn.Linear(4, 12), nn.Linear(6, 4), impl="torch")
    assert "impl='torch'" in repr(m) and [n for n, _ in m.named_children()] == ["gate_up_proj", "down_proj"]
    x = torch.randn(3, 4)
    gate, up = m.gate_up_proj(x).chunk(2, dim=-1)
    assert torch.equal(m(x), m.down_proj(F.silu(gate) * up))
    with pytest.raises(ValueError, match=r"^gate_up_proj: returned shape \[3, 11\], expected an even last dimension"):
        FusedGateUpSwiGLUMLP(nn.Linear(4, 11), nn.Linear(6, 4))(x)


def test_gate_up_from_module_refuses_what_is_not_a_gate_up_swiglu_mlp():
    with pytest.raises(TypeError, match=r"^mlp: expected a module with submodules gate_up_proj and down_proj, got "
                                        r"_MLP without gate_up_proj$"):
        FusedGateUpSwiGLUMLP.from_module(_MLP())
    with pytest.raises(TypeError, match=r"^mlp: expected a module with submodules gate_proj, up_proj and down_proj, "
                                        r"got _GateUpMLP without gate_proj, up_proj$"):
        FusedSwiGLUMLP.from_module(_GateUpMLP())
    gelu = _GateUpMLP(act=nn.GELU())
    with pytest.raises(ValueError, match=r"^mlp: _GateUpMLP does not pass the SwiGLU probe: activation_fn \(GELU\) "
                                         r"is not SiLU"):
        FusedGateUpSwiGLUMLP.from_module(gelu)
    # verify=False takes it as it is (the caller's word): the fused module then computes SwiGLU, not GELU
    fused = FusedGateUpSwiGLUMLP.from_module(gelu, verify=False)
    x = torch.randn(2, 8)
    gate, up = gelu.gate_up_proj(x).chunk(2, dim=-1)
    assert torch.equal(fused(x), gelu.down_proj(F.silu(gate) * up))


@pytest.mark.parametrize("act_name", ["activation_fn", "act_fn"])
def test_an_activation_replaced_or_hooked_while_fused_is_run_as_the_mlp_would(act_name):
    """As FusedSwiGLUMLP with act_fn: the activation the probe vouched for (Phi-3's activation_fn, or act_fn) is held,
    not called; one replaced, or given a forward hook, while fused is run by the formula of the original MLP (no
    kernel); a module under the other name, which the MLP does not call, is not."""
    mlp = _GateUpMLP(act_name=act_name)
    fused = FusedGateUpSwiGLUMLP.from_module(mlp)
    assert fused._act_name == act_name and getattr(fused, act_name) is getattr(mlp, act_name)
    x = torch.randn(3, 8)
    gate, up = fused.gate_up_proj(x).chunk(2, dim=-1)
    probed = getattr(fused, act_name)
    setattr(fused, act_name, nn.GELU())
    dispatch.reset_stats()
    assert torch.equal(fused(x), fused.down_proj(up * F.gelu(gate)))
    assert "swiglu.packed" not in dispatch.stats()
    setattr(fused, act_name, probed)
    seen = []
    handle = probed.register_forward_hook(lambda *a: seen.append(1))
    fused(x)
    assert seen == [1] and "swiglu.packed" not in dispatch.stats()
    handle.remove()
    setattr(fused, "act_fn" if act_name == "activation_fn" else "activation_fn", nn.GELU())
    assert torch.equal(fused(x), fused.down_proj(F.silu(gate) * up))
    assert dispatch.stats()["swiglu.packed"] == {"torch": 1}


# ------------------------------------------------------------------------------------------------ the probe
class _Swapped(_MLP):
    def forward(self, x):   # silu of the up projection: a gated MLP with the roles exchanged
        return self.down_proj(self.gate_proj(x) * self.act_fn(self.up_proj(x)))


class _Scaled(_MLP):
    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * 0.5)


class _NoActFn(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 12), nn.Linear(8, 12), nn.Linear(12, 8)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _NoActFnGateUp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj, self.down_proj = nn.Linear(8, 24), nn.Linear(12, 8)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class _UpFirst(_GateUpMLP):
    """Phi-4-multimodal's audio MLP order: up the first half, gate the second."""

    def forward(self, x):
        up, gate = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.activation_fn(gate))


class _TwoActivations(_GateUpMLP):
    def __init__(self):
        super().__init__()
        self.act_fn = nn.SiLU()


@pytest.mark.parametrize("make,ok,reason", [
    (lambda: _MLP(), True, "probe output equals down_proj(silu(gate_proj(x)) * up_proj(x))"),
    (lambda: _MLP(bias=True), True, "probe output equals"),
    (lambda: _MLP(act=nn.SiLU(inplace=True)), True, "probe output equals"),
    (lambda: _NoActFn(), True, "probe output equals"),
    (lambda: _MLP(act=nn.GELU()), True, "probe output equals down_proj(gelu(gate_proj(x)) * up_proj(x))"),   # GeGLU
    (lambda: _MLP(act=nn.ReLU()), False, "act_fn (ReLU) is not SiLU or GELU"),
    (lambda: _Swapped(), False, "output (training mode) differs from down_proj(silu(gate_proj(x)) * up_proj(x))"),
    (lambda: _Scaled(), False, "output (training mode) differs"),
    (lambda: _GateUpMLP(), True,
     "probe output equals down_proj(silu(gate) * up) with gate, up = gate_up_proj(x).chunk(2, -1)"),
    (lambda: _GateUpMLP(bias=True, act_name="act_fn"), True, "probe output equals"),
    (lambda: _GateUpMLP(act=nn.SiLU(inplace=True)), True, "probe output equals"),
    (lambda: _NoActFnGateUp(), True, "probe output equals"),
    (lambda: _GateUpMLP(act=nn.GELU()), False, "activation_fn (GELU) is not SiLU"),
    (lambda: _GateUpMLP(act=nn.ReLU(), act_name="act_fn"), False, "act_fn (ReLU) is not SiLU"),
    (lambda: _UpFirst(), False, "output (training mode) differs from down_proj(silu(gate) * up) with gate, up"),
    (lambda: _TwoActivations(), False, "has two activations (activation_fn, act_fn): not the plain SwiGLU MLP"),
], ids=["llama", "bias", "inplace_silu", "functional_silu", "gelu", "relu", "swapped", "scaled", "phi3",
        "phi3_bias_act_fn", "phi3_inplace_silu", "phi3_functional_silu", "phi3_gelu", "phi3_relu_act_fn", "up_first",
        "two_activations"])
def test_probe(make, ok, reason):
    mlp = make()
    probe = probe_swiglu_mlp(mlp)
    assert probe.candidate and probe.ok is ok and reason in probe.reason, probe
    assert probe.packed is hasattr(mlp, "gate_up_proj")


class _WithDropout:
    """A dropout submodule after the MLP (a mixin over either layout)."""

    def __init__(self):
        super().__init__()
        self.dropout = nn.Dropout(0.1)

    def forward(self, x):
        return self.dropout(super().forward(x))


class _FunctionalDropout:
    def forward(self, x):
        return F.dropout(super().forward(x), 0.1, self.training)


class _WithScale:
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return super().forward(x) * self.scale


class _TakesMore:
    def forward(self, x, residual):
        return super().forward(x) + residual


class _Raises:
    def forward(self, x):
        raise RuntimeError("boom")


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("mixin,reason", [
    (_WithDropout, "has submodules besides the projections and {acts} (dropout): not the plain SwiGLU MLP"),
    (_FunctionalDropout, "output (training mode) differs from"),
    (_WithScale, "has parameters or buffers of its own"),
    (_TakesMore, "forward takes more than the input (residual): {fused} takes the input alone"),
    (_Raises, "probe forward (training mode) failed: RuntimeError: boom"),
], ids=["dropout", "functional_dropout", "own_parameter", "more_arguments", "raises"])
def test_probe_refuses_more_than_the_plain_mlp(layout, mixin, reason):
    """Either layout: what the fused module would not run (a submodule, a parameter, an argument, a dropout in
    training mode, a forward that fails) is refused with the reason, and from_module refuses it too."""
    make, cls, _, _ = LAYOUTS[layout]
    mlp = type(f"{mixin.__name__}{make.__name__}", (mixin, make), {})()
    probe = probe_swiglu_mlp(mlp)
    acts = "activation_fn or act_fn" if cls is FusedGateUpSwiGLUMLP else "act_fn or activation_fn"
    assert probe.candidate and not probe.ok and reason.format(acts=acts, fused=cls.__name__) in probe.reason, probe
    with pytest.raises(ValueError, match="does not pass the SwiGLU probe"):
        cls.from_module(mlp)


def test_probe_does_not_run_or_touch_the_module():
    """The probe runs the class's forward on CPU stand-ins: the module's own projections (which may be large, on a
    GPU, or on the meta device) are not called, its hooks do not fire, and nothing of it changes."""
    with torch.device("meta"):
        mlp = _MLP(hidden=4096, inter=11008)
    calls = []
    mlp.register_forward_hook(lambda *a: calls.append("mlp"))
    mlp.gate_proj.register_forward_hook(lambda *a: calls.append("gate_proj"))
    children = dict(mlp.named_children())
    assert probe_swiglu_mlp(mlp).ok
    assert calls == [] and dict(mlp.named_children()) == children and mlp.gate_proj.weight.is_meta


def test_probe_of_modules_without_the_projections():
    for m in (nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)), nn.LayerNorm(4)):
        probe = probe_swiglu_mlp(m)
        assert not probe.ok and not probe.candidate


@pytest.mark.parametrize("module,cls,ok", [
    ("llama", "LlamaMLP", True), ("mistral", "MistralMLP", True), ("qwen2", "Qwen2MLP", True),
    ("qwen3", "Qwen3MLP", True), ("phi3", "Phi3MLP", True), ("glm", "GlmMLP", True), ("glm4", "Glm4MLP", True)])
def test_probe_of_transformers_mlps(module, cls, ok):
    """Llama's MLP and its copies pass; Phi-3's and GLM's, gate and up in one gate_up_proj, pass as that layout
    (FusedGateUpSwiGLUMLP; they were refused for the layout alone). (Gemma's GELU MLP passes as GeGLU:
    tests/fuse/test_fuse_geglu.py.)"""
    mod = pytest.importorskip(f"transformers.models.{module}.modeling_{module}")
    import transformers

    cfg_cls = getattr(transformers, cls.replace("MLP", "Config"))
    cfg = cfg_cls(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)
    mlp = getattr(mod, cls)(cfg)
    probe = probe_swiglu_mlp(mlp)
    assert probe.candidate and probe.ok is ok and probe.packed is hasattr(mlp, "gate_up_proj"), probe
    fused_cls = FusedGateUpSwiGLUMLP if probe.packed else FusedSwiGLUMLP
    if ok:
        fused = fused_cls.from_module(mlp)
        x = torch.randn(2, 5, 32)
        assert torch.equal(fused(x), mlp(x))
    else:
        assert "is not SiLU" in probe.reason
        with pytest.raises(ValueError, match="is not SiLU"):
            fused_cls.from_module(mlp)


# ------------------------------------------------------------------------------------------------ on a GPU
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_functional_on_cuda_runs_the_kernel(no_tuning_table, dtype):
    """On CUDA (tuning table and small-problem rule set aside) the functional runs pipegoose::swiglu: no fallback
    (strict mode passes), the ops' results bit for bit, the float64 formulas within the tolerance table; what the
    kernel does not take (broadcasting) is a fallback strict mode refuses."""
    gate, up = (t.cuda() for t in _inputs((4, 1001), dtype, seed=11))
    dy = torch.randn(4, 1001, generator=torch.Generator().manual_seed(12)).to(dtype).cuda()
    with dispatch.strict():
        y, dg, du = _fwd_bwd(PF.swiglu, gate, up, dy)
    c = dispatch.last_choice("swiglu")
    assert (c.impl, c.fallback) == ("pipegoose", False), c
    assert torch.equal(y, torch.ops.pipegoose.swiglu_forward(gate, up))
    want_dg, want_du = torch.ops.pipegoose.swiglu_backward(dy, gate, up)
    assert torch.equal(dg, want_dg) and torch.equal(du, want_du)
    for name, got, want in zip(("out", "grad_gate", "grad_up"), (y, dg, du), _ref64(gate.cpu(), up.cpu(), dy.cpu())):
        torch.testing.assert_close(got.double().cpu(), want, **tol(dtype), msg=lambda m: f"{name}: {m}")
    with dispatch.strict(), pytest.raises(dispatch.FusionFallbackError, match="does not broadcast"):
        PF.swiglu(gate, up[:1])
    assert torch.equal(PF.swiglu(gate, up[:1]), F.silu(gate) * up[:1])


@pytest.mark.cuda
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_mlp_on_cuda_matches_the_mlp(no_tuning_table, dtype, layout):
    """FusedSwiGLUMLP runs pipegoose::swiglu, FusedGateUpSwiGLUMLP pipegoose::silu_and_mul on the halves of
    gate_up_proj's output (op swiglu.packed); no fallback (strict mode)."""
    make, cls, op, _ = LAYOUTS[layout]
    torch.manual_seed(1)
    mlp = make(hidden=64, inter=176).to("cuda", dtype)
    fused = cls.from_module(mlp)
    x = torch.randn(3, 7, 64, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(3, 7, 64, device="cuda", dtype=dtype)
    want = mlp(x)
    want_grads = torch.autograd.grad(want, [x, *mlp.parameters()], dy)
    with dispatch.strict():
        got = fused(x)
        grads = torch.autograd.grad(got, [x, *fused.parameters()], dy)
    assert dispatch.last_choice(op).impl == "pipegoose"
    # eager rounds silu(gate) before the product in 16-bit, the kernel once: a unit in the last place apart, summed
    # over the 176 columns of down_proj
    torch.testing.assert_close(got, want, **tol(dtype, 4))
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, **tol(dtype, 8))


# ----------------------------------------------------------------------- fake impls and C++ autograd (meta; slow)
def _load_library():
    return load_or_skip("pipegoose/swiglu")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_fake_impls_on_meta_tensors(dtype):
    _load_library()
    ops = torch.ops.pipegoose
    g = torch.empty(3, 5, 7, device="meta", dtype=dtype)
    u = torch.empty(3, 5, 7, device="meta", dtype=dtype)
    for y in (ops.swiglu_forward(g, u), ops.swiglu(g, u)):
        assert y.device.type == "meta" and y.shape == (3, 5, 7) and y.dtype == dtype and y.is_contiguous()
    dg, du = ops.swiglu_backward(g, g, u)
    assert dg.shape == du.shape == (3, 5, 7) and dg.dtype == du.dtype == dtype
    # non-contiguous inputs: contiguous outputs of gate's shape, as the kernel returns them
    gt, ut = g.transpose(0, 2), u.transpose(0, 2)
    y = ops.swiglu_forward(gt, ut)
    assert y.shape == (7, 5, 3) and y.is_contiguous()
    assert ops.swiglu_forward(g[:0], u[:0]).shape == (0, 5, 7)


@pytest.mark.slow
def test_fake_impls_refuse_what_the_kernels_refuse():
    _load_library()
    ops = torch.ops.pipegoose
    g = torch.empty(4, 6, device="meta")
    with pytest.raises(RuntimeError, match=r"up: expected gate's shape \(4, 6\), got \(4, 5\)"):
        ops.swiglu_forward(g, torch.empty(4, 5, device="meta"))
    with pytest.raises(RuntimeError, match=r"up: expected gate's dtype torch.float32, got torch.bfloat16"):
        ops.swiglu_forward(g, torch.empty(4, 6, device="meta", dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"grad_output: expected gate's shape \(4, 6\), got \(6, 4\)"):
        ops.swiglu_backward(torch.empty(6, 4, device="meta"), g, g)
    with pytest.raises(RuntimeError, match=r"up: expected gate's shape"):
        ops.swiglu(g, torch.empty(4, 1, device="meta"))


@pytest.mark.slow
@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)], ids=["both", "gate", "up"])
def test_autograd_gives_gradients_for_the_inputs_that_need_them(needs):
    """The C++ autograd formula: one call of the backward op, gradients (of the inputs' shape and dtype) for the inputs
    that require them and None for the others."""
    _load_library()
    g = torch.empty(8, 64, device="meta", dtype=torch.bfloat16, requires_grad=needs[0])
    u = torch.empty(8, 64, device="meta", dtype=torch.bfloat16, requires_grad=needs[1])
    y = torch.ops.pipegoose.swiglu(g, u)
    assert y.requires_grad and "SwiGLU" in type(y.grad_fn).__name__ + str(y.grad_fn.name())
    with calls_of({"pipegoose::swiglu_backward"}) as log:
        y.backward(torch.empty_like(y))
    assert log.calls == ["pipegoose::swiglu_backward"]
    for t, need in zip((g, u), needs):
        assert (t.grad is not None) == need
        if need:
            assert t.grad.shape == t.shape and t.grad.dtype == t.dtype and t.grad.device.type == "meta"


@pytest.mark.slow
def test_autograd_without_grad_and_in_inference_mode():
    _load_library()
    g = torch.empty(8, 64, device="meta", requires_grad=True)
    u = torch.empty(8, 64, device="meta")
    with torch.no_grad():
        assert not torch.ops.pipegoose.swiglu(g, u).requires_grad
    with torch.inference_mode():
        y = torch.ops.pipegoose.swiglu(g, u)
    assert y.grad_fn is None and y.shape == (8, 64)
    assert not torch.ops.pipegoose.swiglu(g.detach(), u).requires_grad


@pytest.mark.slow
def test_create_graph_differentiates_the_reference_instead_of_the_backward_op():
    """backward with create_graph=True: gradients that are differentiable again (a graph of PyTorch ops on the saved
    inputs), without the backward op (which has no derivative)."""
    _load_library()
    g = torch.empty(8, 64, device="meta", requires_grad=True)
    u = torch.empty(8, 64, device="meta", requires_grad=True)
    y = torch.ops.pipegoose.swiglu(g, u)
    with calls_of({"pipegoose::swiglu_backward"}) as log:
        dg, du = torch.autograd.grad(y, (g, u), torch.empty_like(y), create_graph=True)
    assert log.calls == []
    assert dg.requires_grad and du.requires_grad and dg.shape == du.shape == (8, 64)
    (ddg,) = torch.autograd.grad(dg.sum() + du.sum(), (g,))
    assert ddg.shape == (8, 64)


def test_no_warnings_on_the_plain_cpu_call():
    gate, up = _inputs((3, 5), torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PF.swiglu(gate, up)
        FusedSwiGLUMLP.from_module(_MLP())(torch.randn(2, 8))


# ============================================================================ silu_and_mul (op swiglu.packed)
PACKED = "swiglu.packed"


def _packed(shape, dtype, seed=0):
    """x of ``shape`` [..., 2d]: _inputs' gate (N(0, 9)) in each row's first d values, its up in the last d."""
    *lead, two_d = shape
    gate, up = _inputs((*lead, two_d // 2), dtype, seed)
    return torch.cat((gate, up), -1)


def _chunked(x):
    """What Phi-3's MLP runs: gate, up = x.chunk(2, dim=-1); F.silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _fwd_bwd_x(fn, x, dy):
    x = x.detach().clone().requires_grad_(True)
    y = fn(x)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad


def _dy_of(x, seed=9):
    return torch.randn((*x.shape[:-1], x.shape[-1] // 2), generator=torch.Generator().manual_seed(seed)).to(x.dtype)


@pytest.fixture
def packed_env(monkeypatch):
    """The variables the op reads, unset (the user's own set aside)."""
    for var in ("PIPEGOOSE_IMPL_SWIGLU_PACKED", "PIPEGOOSE_IMPL_SWIGLU", "PIPEGOOSE_STRICT", "PIPEGOOSE_SMALL_NUMEL"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("shape", [(3, 7, 34), (2,), (2, 1030), (2, 3, 4, 6), (5, 0), (0, 6)])
def test_silu_and_mul_reference_path_is_chunk_silu_mul_bit_for_bit(dtype, shape):
    """On the CPU silu_and_mul runs x.chunk(2, -1), F.silu and the product: output and gradient equal PyTorch's
    exactly, of x's dtype and shapes [..., d] and [..., 2d], counted as the torch path (a fallback; an empty x is
    none)."""
    x = _packed(shape, dtype, seed=len(shape))
    dy = _dy_of(x)
    y, dx = _fwd_bwd_x(PF.silu_and_mul, x, dy)
    want, want_dx = _fwd_bwd_x(_chunked, x, dy)
    assert y.dtype == dx.dtype == dtype
    assert y.shape == (*shape[:-1], shape[-1] // 2) and dx.shape == shape
    assert torch.equal(y, want) and torch.equal(dx, want_dx)
    assert dispatch.stats()[PACKED] == {"torch": 1}
    assert dispatch.last_choice(PACKED).source == ("empty" if x.numel() == 0 else "fallback")
    assert dispatch.stats().get("swiglu", {}) == {}   # (its own op, not swiglu's)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_reference_path_against_float64(dtype):
    """The path against the float64 formulas of the halves (grad_x: grad_gate in each row's first half, grad_up in
    its second), within the tolerance table (16-bit eager rounds silu(gate) and then the product: scale 2)."""
    x = _packed((4, 9, 2 * 257), dtype, seed=3)
    dy = _dy_of(x, seed=4)
    y, dx = _fwd_bwd_x(PF.silu_and_mul, x, dy)
    y64, dg64, du64 = _ref64(x[..., :257], x[..., 257:], dy)
    scale = 1 if dtype == torch.float32 else 2
    for name, got, want in (("out", y, y64), ("grad_x", dx, torch.cat((dg64, du64), -1))):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got.double(), want, **tol(dtype, scale), msg=lambda m: f"{name}: {m}")


def test_silu_and_mul_argument_errors_name_x():
    x = _packed((3, 6), torch.float32)
    cases = [
        (1.0, TypeError, r"^x: expected a floating point torch.Tensor, got float$"),
        ([1.0, 2.0], TypeError, r"^x: expected a floating point torch.Tensor, got list$"),
        (x.int(), TypeError, r"^x: expected a floating point torch.Tensor, got int32$"),
        (x.bool(), TypeError, r"^x: expected a floating point torch.Tensor, got bool$"),
        (x.to(torch.complex64), TypeError, r"^x: "),
        (x[0, 0], ValueError, r"^x: expected at least one dimension \(gate and up are the two halves of the last\), "
                              r"got a 0-dim tensor$"),
        (x[:, :5], ValueError, r"^x: expected an even last dimension \(gate and up are its two halves\), got shape "
                               r"\[3, 5\]$"),
        (torch.randn(7), ValueError, r"^x: expected an even last dimension .*got shape \[7\]$"),
        (torch.randn(2, 3, 1), ValueError, r"^x: expected an even last dimension .*got shape \[2, 3, 1\]$"),
    ]
    if hasattr(torch, "float8_e4m3fn"):
        cases.append((x.to(torch.float8_e4m3fn), TypeError, r"^x: expected dtype .*got float8_e4m3fn"))
    for arg, err, match in cases:
        with pytest.raises(err, match=match):
            PF.silu_and_mul(arg)
        with pytest.raises(err, match=match):   # explain refuses what the op refuses, with its message
            dispatch.explain(PACKED, arg)
        with pytest.raises(err, match=match):   # so does a call that asks for an implementation
            PF.silu_and_mul(arg, impl="torch")
    # a refused call is not counted
    assert dispatch.stats().get(PACKED, {}) == {}


def test_silu_and_mul_argument_errors_after_a_cached_choice():
    """A valid call's choice is cached; a call with other metadata is checked again (an odd last dimension or an int
    x after an even float one must still raise)."""
    x = _packed((3, 6), torch.float32)
    PF.silu_and_mul(x)
    PF.silu_and_mul(x)
    with pytest.raises(ValueError, match="^x: expected an even last dimension"):
        PF.silu_and_mul(x[:, :5])
    with pytest.raises(TypeError, match="^x: "):
        PF.silu_and_mul(x.int())
    assert dispatch.stats()[PACKED] == {"torch": 2}


def test_silu_and_mul_impl_argument(packed_env):
    x = _packed((3, 6), torch.float32)
    with pytest.warns(UserWarning, match=r"swiglu.packed: impl='pipegoose' cannot run this input: needs a CUDA "
                                         r"tensor, got device cpu"):
        y = PF.silu_and_mul(x, impl="pipegoose")
    assert torch.equal(y, _chunked(x))
    assert dispatch.last_choice(PACKED).impl == "torch"
    with pytest.raises(ValueError, match=r"^impl: swiglu.packed has no implementation 'fused'; expected one of "
                                         r"pipegoose, torch or 'auto' \(any case\)$"):
        PF.silu_and_mul(x, impl="fused")
    with pytest.raises(ValueError, match=r"^impl: swiglu.packed has no implementation 'megatron'"):
        PF.silu_and_mul(x, impl="megatron")   # (swiglu's implementations are named, not every op's)
    with pytest.raises(TypeError, match="^impl: expected an implementation name"):
        PF.silu_and_mul(x, impl=1)
    with pytest.raises(ValueError, match="^impl: an empty name"):
        PF.silu_and_mul(x, impl="")
    assert torch.equal(PF.silu_and_mul(x, impl=" Torch "), _chunked(x))   # any case, as PIPEGOOSE_IMPL_*
    c = dispatch.last_choice(PACKED)
    assert (c.impl, c.source, c.fallback) == ("torch", "argument", False)
    assert torch.equal(PF.silu_and_mul(x, impl="AUTO"), _chunked(x))
    assert dispatch.last_choice(PACKED).source == "fallback"
    with pytest.raises(TypeError, match="takes 1 positional argument"):   # impl is keyword-only
        PF.silu_and_mul(x, "torch")


def test_silu_and_mul_impl_variables_own_and_family(packed_env):
    """PIPEGOOSE_IMPL_SWIGLU_PACKED, else the family's PIPEGOOSE_IMPL_SWIGLU (which covers swiglu too), choose the
    implementation (source "env", the variable named); auto in the op's own variable overrides the family's; a
    name the op does not have is a ValueError naming the variable that holds it, at the call and from check_env."""
    x = _packed((3, 6), torch.float32)
    want = _chunked(x)

    def run():
        y = PF.silu_and_mul(x)
        assert torch.equal(y, want)
        return dispatch.last_choice(PACKED)

    def refused(var, value):
        with pytest.raises(ValueError, match=rf"^{var}='{value}': swiglu.packed has no implementation '{value}'; "
                                             r"expected one of pipegoose, torch or 'auto'$"):
            PF.silu_and_mul(x)
        with pytest.raises(ValueError, match=rf"^{var}="):
            dispatch.check_env()

    packed_env.setenv("PIPEGOOSE_IMPL_SWIGLU_PACKED", "Torch")
    c = run()
    assert (c.impl, c.source, c.fallback, c.reason) == ("torch", "env", False,
                                                        "requested by PIPEGOOSE_IMPL_SWIGLU_PACKED")
    packed_env.delenv("PIPEGOOSE_IMPL_SWIGLU_PACKED")
    packed_env.setenv("PIPEGOOSE_IMPL_SWIGLU", "torch")
    c = run()
    assert (c.impl, c.source, c.reason) == ("torch", "env", "requested by PIPEGOOSE_IMPL_SWIGLU")
    assert PF.swiglu(*x.chunk(2, -1)) is not None and dispatch.last_choice("swiglu").source == "env"   # both ops
    # the op's own variable first
    packed_env.setenv("PIPEGOOSE_IMPL_SWIGLU", "pipegoose")
    packed_env.setenv("PIPEGOOSE_IMPL_SWIGLU_PACKED", "torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # (the family's pipegoose, which cannot run here, is not asked)
        c = run()
    assert (c.source, c.reason) == ("env", "requested by PIPEGOOSE_IMPL_SWIGLU_PACKED")
    # the family's request of an implementation that cannot run the input: said, then the choice without it
    packed_env.delenv("PIPEGOOSE_IMPL_SWIGLU_PACKED")
    with pytest.warns(UserWarning, match=r"swiglu.packed: PIPEGOOSE_IMPL_SWIGLU='pipegoose' cannot run this input: "
                                         r"needs a CUDA tensor"):
        c = run()
    assert (c.impl, c.source, c.fallback) == ("torch", "fallback", True)
    # a name no SwiGLU op has
    packed_env.setenv("PIPEGOOSE_IMPL_SWIGLU", "apex")
    refused("PIPEGOOSE_IMPL_SWIGLU", "apex")
    # auto in the op's own variable: no request (the family's bad value is not read for this op; swiglu still is)
    packed_env.setenv("PIPEGOOSE_IMPL_SWIGLU_PACKED", "auto")
    assert run().source == "fallback"
    with pytest.raises(ValueError, match=r"^PIPEGOOSE_IMPL_SWIGLU='apex': swiglu has no implementation 'apex'"):
        PF.swiglu(*x.chunk(2, -1))
    packed_env.delenv("PIPEGOOSE_IMPL_SWIGLU")
    packed_env.setenv("PIPEGOOSE_IMPL_SWIGLU_PACKED", "deepspeed")
    refused("PIPEGOOSE_IMPL_SWIGLU_PACKED", "deepspeed")
    assert dispatch.stats()[PACKED] == {"torch": 5}   # (the refused calls are not counted)


def test_silu_and_mul_impl_variable_is_known(packed_env):
    """PIPEGOOSE_IMPL_SWIGLU_PACKED names an op: no "no fused op of that name" warning."""
    packed_env.setenv("PIPEGOOSE_IMPL_SWIGLU_PACKED", "torch")
    packed_env.setattr(dispatch, "_env_checked", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unknown = dispatch.warn_unknown_env()
    assert "PIPEGOOSE_IMPL_SWIGLU_PACKED" not in unknown
    assert not [w for w in caught if "PIPEGOOSE_IMPL_SWIGLU_PACKED" in str(w.message)]


def test_silu_and_mul_strict_mode_raises_on_the_cpu_fallback(packed_env):
    """Off CUDA the kernel cannot run, so the PyTorch path is a fallback, which strict mode refuses (the context and
    PIPEGOOSE_STRICT); an empty x and an explicit impl='torch' are no fallback."""
    x = _packed((3, 6), torch.float32)
    with dispatch.strict():
        with pytest.raises(dispatch.FusionFallbackError, match=r"^swiglu.packed: strict mode: would fall back to "
                                                               r"torch: .*needs a CUDA tensor, got device cpu"):
            PF.silu_and_mul(x)
        assert PF.silu_and_mul(x[:0]).shape == (0, 3)
        assert dispatch.last_choice(PACKED).source == "empty"
        assert torch.equal(PF.silu_and_mul(x, impl="torch"), _chunked(x))
        assert dispatch.last_choice(PACKED).source == "argument"
    packed_env.setenv("PIPEGOOSE_STRICT", "1")
    with pytest.raises(dispatch.FusionFallbackError, match="^swiglu.packed: strict mode"):
        PF.silu_and_mul(x)
    packed_env.setenv("PIPEGOOSE_STRICT", "0")
    assert torch.equal(PF.silu_and_mul(x), _chunked(x))   # out of strict mode the same call runs
    assert dispatch.stats()[PACKED] == {"torch": 3}


@pytest.mark.parametrize("layout", ["jagged", "strided"])
def test_silu_and_mul_nested_tensors_run_the_reference(layout):
    """A nested tensor goes to PyTorch's ops (a fallback, counted; strict mode refuses it), as eager PyTorch's chunk,
    silu and product would run it: its result where PyTorch takes the layout (jagged), its error where it does not."""
    g = torch.Generator().manual_seed(8)
    parts = [torch.randn(2, 8, generator=g), torch.randn(3, 8, generator=g)]
    if layout == "jagged":
        x = torch.nested.nested_tensor_from_jagged(torch.cat(parts), torch.tensor([0, 2, 5]))
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # ("the PyTorch API of nested tensors is in prototype stage")
            x = torch.nested.nested_tensor(parts)
    try:
        want = _chunked(x)
    except RuntimeError as e:   # (torch 2.14: "NestedTensor must be contiguous to get buffer." for the strided layout)
        with pytest.raises(type(e), match=re.escape(str(e))):
            PF.silu_and_mul(x)
    else:
        y = PF.silu_and_mul(x)
        assert y.is_nested
        for got, w, part in zip(y.unbind(), want.unbind(), parts):
            assert torch.equal(got, w) and torch.equal(got, F.silu(part[:, :4]) * part[:, 4:])
    c = dispatch.last_choice(PACKED)
    assert c.fallback and "nested tensor" in c.reason
    with dispatch.strict(), pytest.raises(dispatch.FusionFallbackError, match="nested tensor"):
        PF.silu_and_mul(x)
    with pytest.raises(ValueError, match="^impl: swiglu.packed has no implementation 'apex'"):
        PF.silu_and_mul(x, impl="apex")


@pytest.mark.parametrize("layout", ["jagged", "strided"])
def test_silu_and_mul_nested_tensor_with_an_odd_last_dimension_is_refused_naming_x(layout):
    """A nested tensor's regular last dimension is checked as a dense one's: odd, a ValueError naming x (before, the
    jagged layout reached PyTorch's product and its size mismatch, a review)."""
    parts = [torch.randn(2, 5), torch.randn(3, 5)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        x = (torch.nested.nested_tensor_from_jagged(torch.cat(parts), torch.tensor([0, 2, 5])) if layout == "jagged"
             else torch.nested.nested_tensor(parts))
    with pytest.raises(ValueError, match=r"^x: expected an even last dimension .* last dimension is 5"):
        PF.silu_and_mul(x)


def test_silu_and_mul_vmap_and_forward_ad_run_the_reference():
    x = _packed((4, 6, 10), torch.float32, seed=2)
    assert torch.equal(torch.func.vmap(PF.silu_and_mul)(x), _chunked(x))
    tangent = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    _, jvp = torch.func.jvp(PF.silu_and_mul, (x,), (tangent,))
    _, want = torch.func.jvp(_chunked, (x,), (tangent,))
    assert torch.equal(jvp, want)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(x, tangent)
        _, t = torch.autograd.forward_ad.unpack_dual(PF.silu_and_mul(dual))
    assert torch.equal(t, want)


@pytest.fixture
def chooses(monkeypatch):
    """Counts the calls of dispatch.choose (the slow path of a call; a cached choice skips it)."""
    calls = []
    real = dispatch.choose

    def counting(op, problem, impl=None, check_all=False):
        calls.append(op)
        return real(op, problem, impl, check_all)

    monkeypatch.setattr(dispatch, "choose", counting)
    return calls


@pytest.mark.parametrize("change", ["shape", "dtype", "requires_grad", "grad_mode", "impl", "own_variable",
                                    "family_variable", "small_numel"])
def test_silu_and_mul_choice_cache(chooses, packed_env, change):
    """A repeated call chooses once and is counted every time; a call whose choice could differ (x's shape, dtype or
    requires_grad, grad mode, the impl argument, the op's variables, its family's, PIPEGOOSE_SMALL_NUMEL) chooses
    again."""
    x = _packed((3, 6), torch.float32).requires_grad_()
    for _ in range(3):
        PF.silu_and_mul(x)
    assert chooses == [PACKED] and dispatch.stats()[PACKED] == {"torch": 3}
    impl = None
    if change == "shape":
        x = _packed((4, 6), torch.float32)
    elif change == "dtype":
        x = x.detach().double()
    elif change == "requires_grad":
        x = x.detach()
    elif change == "impl":
        impl = "torch"
    elif change == "own_variable":
        packed_env.setenv("PIPEGOOSE_IMPL_SWIGLU_PACKED", "torch")
    elif change == "family_variable":
        packed_env.setenv("PIPEGOOSE_IMPL_SWIGLU", "torch")
    elif change == "small_numel":
        packed_env.setenv("PIPEGOOSE_SMALL_NUMEL", "0")
    with torch.set_grad_enabled(change != "grad_mode"):
        PF.silu_and_mul(x, impl=impl)
    assert chooses == [PACKED, PACKED], change
    assert dispatch.stats()[PACKED] == {"torch": 4}
    if change in ("impl", "own_variable", "family_variable"):
        assert dispatch.last_choice(PACKED).source == ("argument" if change == "impl" else "env")


def _packed_cuda_problem(x):
    """The problem of x as if it were on a GPU (metadata only: the CPU tensor describes it)."""
    return replace(S.packed_problem(x), device=CUDA)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_kernel_takes_every_layout_on_cuda(dtype):
    supports = dispatch.implementations(PACKED)["pipegoose"].supports
    x = _packed((2, 3, 22), dtype)
    for what, t in (("contiguous", x), ("1-d", x[0, 0]), ("rows of a wider tensor", x[..., 1:21]),
                    ("transposed (copied)", x.transpose(0, 1)), ("expanded", x[:1].expand(5, 3, 22))):
        assert supports(_packed_cuda_problem(t)) == (True, ""), what
    assert supports(S.packed_problem(x)) == (False, "needs a CUDA tensor, got device cpu")


@pytest.mark.parametrize("what,build,reason", [
    ("float64", lambda x: x.double(), r"^x dtype float64 not supported \(float32, float16, bfloat16\)$"),
    ("empty rows", lambda x: x[:0], r"^an empty input$"),
    ("empty halves", lambda x: x[:, :0], r"^an empty input$"),
], ids=["float64", "empty_rows", "empty_halves"])
def test_silu_and_mul_kernel_declines_on_cuda_with_the_reason(what, build, reason):
    supports = dispatch.implementations(PACKED)["pipegoose"].supports
    ok, why = supports(_packed_cuda_problem(build(_packed((3, 6), torch.float32))))
    assert not ok, what
    assert re.search(reason, why), (what, why)


def test_silu_and_mul_kernel_declines_tensors_without_storage_and_dual_tensors():
    supports = dispatch.implementations(PACKED)["pipegoose"].supports
    p = _packed_cuda_problem(_packed((3, 6), torch.float32))
    assert supports(replace(p, extra={**p.extra, "storage": False})) == (False, NO_STORAGE)
    assert supports(replace(p, extra={**p.extra, "forward_ad": True})) == (False, FORWARD_AD_SWIGLU)


def test_silu_and_mul_problem_describes_the_call():
    """cols is d (half of x's last dimension, the width of gate, up and the output); numel counts x's elements."""
    x = _packed((2, 3, 22), torch.bfloat16)
    p = S.packed_problem(x.requires_grad_())
    assert (p.op, p.dtype, p.device, p.cols, p.needs_grad) == (PACKED, torch.bfloat16, torch.device("cpu"), 11, True)
    assert p["shape"] == (2, 3, 22) and p["numel"] == 132
    assert p["storage"] is True and p["forward_ad"] is False
    assert not S.packed_problem(x.detach()).needs_grad
    p1 = S.packed_problem(x.detach()[0, 0])
    assert p1.cols == 11 and p1["numel"] == 22 and p1["shape"] == (22,)
    assert dispatch.problem_of(PACKED, x) == p


def test_silu_and_mul_choice_on_cuda_of_empty_and_small_inputs_loads_no_kernel(monkeypatch):
    """On a GPU an empty x runs the reference (source "empty", no fallback) and an x of fewer than
    PIPEGOOSE_SMALL_NUMEL elements (x's, not the output's half) the native ops (source "small", the kernel named as
    one that takes it), on metadata alone: no kernel is loaded (or built) for them. From that size on (with the kernel
    loadable: a stand-in here) the kernel is the built-in choice; where it cannot load, the reference runs with the
    load error as the reason (a fallback)."""
    def no_kernel(name):
        raise AssertionError(f"loaded {name}")

    monkeypatch.setattr(dispatch, "kernel", no_kernel)
    monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "1000")
    with dispatch.strict():
        c = dispatch.select(PACKED, _packed_cuda_problem(_packed((4, 0), torch.bfloat16)))
        assert (c.impl, c.source, c.fallback) == ("torch", "empty", False)
        c = dispatch.select(PACKED, _packed_cuda_problem(_packed((10, 98), torch.bfloat16)))   # 980 elements
        assert (c.impl, c.source, c.fallback) == ("torch", "small", False)
        assert "fused paths that take it: pipegoose" in c.reason
        # a small x the kernel does not take (float64) is a real fallback, also when small
        with pytest.raises(dispatch.FusionFallbackError, match="float64 not supported"):
            dispatch.select(PACKED, _packed_cuda_problem(_packed((10, 98), torch.float64)))
    # 1000 elements (an output of 500): not small
    monkeypatch.setattr(dispatch, "kernel", lambda name: (object(), "") if name == "pipegoose/swiglu"
                        else (None, f"{name}: unexpected"))
    c = dispatch.choose(PACKED, _packed_cuda_problem(_packed((10, 100), torch.bfloat16)))
    assert (c.impl, c.source, c.fallback) == ("pipegoose", "builtin", False)
    monkeypatch.setattr(dispatch, "kernel", lambda name: (None, f"{name} unavailable: nvcc missing"))
    c = dispatch.choose(PACKED, _packed_cuda_problem(_packed((10, 100), torch.bfloat16)))
    assert (c.impl, c.fallback) == ("torch", True) and "pipegoose/swiglu unavailable: nvcc missing" in c.reason


def test_silu_and_mul_no_warnings_on_the_plain_cpu_call():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PF.silu_and_mul(_packed((3, 6), torch.float32))


# ------------------------------------------------------------------------------------------------ on a GPU
@pytest.fixture
def no_impl_env(monkeypatch):
    for var in ("PIPEGOOSE_IMPL_SWIGLU_PACKED", "PIPEGOOSE_IMPL_SWIGLU", "PIPEGOOSE_STRICT"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_on_cuda_runs_the_kernel(no_tuning_table, no_impl_env, dtype):
    """On CUDA (tuning table and small-problem rule set aside) silu_and_mul runs pipegoose::silu_and_mul: no fallback
    (strict mode passes), counted once as pipegoose, the ops' results bit for bit, the float64 formulas within the
    tolerance table; a float64 x is a fallback strict mode refuses; impl='torch' is eager PyTorch's result."""
    x = _packed((4, 2 * 1001), dtype, seed=13).cuda()
    dy = _dy_of(x, seed=14).cuda()
    with dispatch.strict():
        y, dx = _fwd_bwd_x(PF.silu_and_mul, x, dy)
    c = dispatch.last_choice(PACKED)
    assert (c.impl, c.fallback) == ("pipegoose", False), c
    assert dispatch.stats()[PACKED] == {"pipegoose": 1}
    assert torch.equal(y, torch.ops.pipegoose.silu_and_mul_forward(x))
    assert torch.equal(dx, torch.ops.pipegoose.silu_and_mul_backward(dy, x))
    y64, dg64, du64 = _ref64(x[:, :1001].cpu(), x[:, 1001:].cpu(), dy.cpu())
    for name, got, want in (("out", y, y64), ("grad_x", dx, torch.cat((dg64, du64), -1))):
        torch.testing.assert_close(got.double().cpu(), want, **tol(dtype), msg=lambda m: f"{name}: {m}")
    with dispatch.strict(), pytest.raises(dispatch.FusionFallbackError, match="x dtype float64 not supported"):
        PF.silu_and_mul(x.double())
    y_t, dx_t = _fwd_bwd_x(lambda t: PF.silu_and_mul(t, impl="torch"), x, dy)
    want, want_dx = _fwd_bwd_x(_chunked, x, dy)
    assert torch.equal(y_t, want) and torch.equal(dx_t, want_dx)
    assert dispatch.stats()[PACKED] == {"pipegoose": 1, "torch": 1}


@pytest.mark.cuda
def test_silu_and_mul_on_cuda_below_and_above_the_small_size(no_tuning_table, no_impl_env, monkeypatch):
    """PIPEGOOSE_SMALL_NUMEL on CUDA counts x's elements: below it the native ops run (counted as torch, source
    "small", no fallback: strict mode passes), from it on the kernel (counted as pipegoose); the same at the default
    size, 2**24, without the variable."""
    monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "1000")
    cases = [((1, 998), "torch", "small"), ((1, 1000), "pipegoose", "builtin"), ((10, 100), "pipegoose", "builtin")]
    with dispatch.strict():
        for shape, impl, source in cases:
            dispatch.reset_stats()
            x = _packed(shape, torch.bfloat16).cuda()
            y = PF.silu_and_mul(x)
            assert y.shape == (*shape[:-1], shape[-1] // 2) and (impl != "torch" or torch.equal(y, _chunked(x)))
            assert dispatch.stats()[PACKED] == {impl: 1}, shape
            assert dispatch.last_choice(PACKED).source == source, shape
    monkeypatch.delenv("PIPEGOOSE_SMALL_NUMEL")
    dispatch.reset_stats()
    cols = 2048
    rows = dispatch.SMALL_NUMEL_DEFAULT // cols
    with dispatch.strict():
        PF.silu_and_mul(torch.randn(rows - 1, cols, device="cuda", dtype=torch.bfloat16))
        assert dispatch.last_choice(PACKED).source == "small"
        PF.silu_and_mul(torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16))
        assert dispatch.last_choice(PACKED).impl == "pipegoose"
    assert dispatch.stats()[PACKED] == {"torch": 1, "pipegoose": 1}


# ----------------------------------------------------------------------- fake impls and C++ autograd (meta; slow)
@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_fake_impls_on_meta_tensors(dtype):
    _load_library()
    ops = torch.ops.pipegoose
    for shape in ((3, 5, 14), (8,), (2, 3, 4, 6), (0, 6), (4, 0)):
        x = torch.empty(shape, device="meta", dtype=dtype)
        half = (*shape[:-1], shape[-1] // 2)
        for y in (ops.silu_and_mul_forward(x), ops.silu_and_mul(x)):
            assert y.device.type == "meta" and y.shape == half and y.dtype == dtype and y.is_contiguous(), shape
        dx = ops.silu_and_mul_backward(torch.empty(half, device="meta", dtype=dtype), x)
        assert dx.shape == shape and dx.dtype == dtype and dx.is_contiguous(), shape
    # non-contiguous x: contiguous outputs of x's shape with the last dimension halved, as the kernels return them
    xt = torch.empty(14, 5, 3, device="meta", dtype=dtype).transpose(0, 2)
    assert ops.silu_and_mul_forward(xt).shape == (3, 5, 7) and ops.silu_and_mul_forward(xt).is_contiguous()
    dx = ops.silu_and_mul_backward(torch.empty(3, 5, 7, device="meta", dtype=torch.float32), xt)
    assert dx.shape == (3, 5, 14) and dx.dtype == dtype and dx.is_contiguous()   # (grad_output's dtype: x's)


@pytest.mark.slow
def test_silu_and_mul_fake_impls_refuse_what_the_kernels_refuse():
    _load_library()
    ops = torch.ops.pipegoose
    x = torch.empty(4, 6, device="meta")

    def meta(*shape):
        return torch.empty(shape, device="meta")

    cases = [(lambda: ops.silu_and_mul_forward(meta(4, 5)), r"x: expected an even last dimension, got 5"),
             (lambda: ops.silu_and_mul_forward(meta()), r"x: expected at least one dimension"),
             (lambda: ops.silu_and_mul_backward(x, x),
              r"grad_output: expected shape \(4, 3\) \(x's with the last dimension halved\), got \(4, 6\)"),
             (lambda: ops.silu_and_mul_backward(meta(12), x), r"grad_output: expected shape \(4, 3\) .*got \(12,\)"),
             (lambda: ops.silu_and_mul_backward(meta(4, 3), meta(4, 7)), r"x: expected an even last dimension, got 7"),
             (lambda: ops.silu_and_mul(meta(4, 3).requires_grad_()), r"x: expected an even last dimension, got 3"),
             # the kernels' dtype and device checks (a review: the fakes returned a tensor for these)
             (lambda: ops.silu_and_mul_forward(meta(4, 6).double()), r"x: expected float32, float16 or bfloat16"),
             (lambda: ops.silu_and_mul_forward(meta(4, 6).int()), r"x: expected float32, float16 or bfloat16"),
             (lambda: ops.silu_and_mul_backward(meta(4, 3).int(), x), r"grad_output: expected a floating point"),
             (lambda: ops.silu_and_mul_backward(torch.empty(4, 3), x), r"grad_output: on cpu, expected x's device"),
             (lambda: ops.swiglu_forward(meta(4, 6).double(), meta(4, 6).double()),
              r"gate: expected float32, float16 or bfloat16"),
             (lambda: ops.swiglu_backward(meta(4, 6).int(), meta(4, 6), meta(4, 6)),
              r"grad_output: expected a floating point")]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()


@pytest.mark.slow
def test_silu_and_mul_autograd_calls_the_backward_op_once():
    """The C++ autograd formula: one call of the backward op, a gradient of x's shape and dtype."""
    _load_library()
    x = torch.empty(8, 128, device="meta", dtype=torch.bfloat16, requires_grad=True)
    y = torch.ops.pipegoose.silu_and_mul(x)
    assert y.shape == (8, 64) and y.requires_grad
    assert "SiluAndMul" in type(y.grad_fn).__name__ + str(y.grad_fn.name())
    with calls_of({"pipegoose::silu_and_mul_backward", "pipegoose::swiglu_backward"}) as log:
        y.backward(torch.empty_like(y))
    assert log.calls == ["pipegoose::silu_and_mul_backward"]
    assert x.grad.shape == x.shape and x.grad.dtype == x.dtype and x.grad.device.type == "meta"


@pytest.mark.slow
def test_silu_and_mul_autograd_without_grad_and_in_inference_mode():
    _load_library()
    x = torch.empty(8, 128, device="meta", requires_grad=True)
    with torch.no_grad():
        assert not torch.ops.pipegoose.silu_and_mul(x).requires_grad
    with torch.inference_mode():
        y = torch.ops.pipegoose.silu_and_mul(x)
    assert y.grad_fn is None and y.shape == (8, 64)
    assert not torch.ops.pipegoose.silu_and_mul(x.detach()).requires_grad


@pytest.mark.slow
def test_silu_and_mul_create_graph_differentiates_the_reference_instead_of_the_backward_op():
    """backward with create_graph=True: a gradient that is differentiable again (a graph of PyTorch ops on the saved
    x), without the backward op (which has no derivative)."""
    _load_library()
    x = torch.empty(8, 128, device="meta", requires_grad=True)
    y = torch.ops.pipegoose.silu_and_mul(x)
    with calls_of({"pipegoose::silu_and_mul_backward"}) as log:
        (dx,) = torch.autograd.grad(y, (x,), torch.empty_like(y), create_graph=True)
    assert log.calls == []
    assert dx.requires_grad and dx.shape == (8, 128)
    (ddx,) = torch.autograd.grad(dx.sum(), (x,))
    assert ddx.shape == (8, 128)
