"""CPU: GeGLU's gated activation ``gelu(gate) * up`` (op ``geglu``, ``approximate`` ``"tanh"`` or ``"none"``): the
functional's reference path against ``F.gelu(gate, approximate=...) * up`` (bit for bit) and float64, its argument
checks, ``impl=`` and ``PIPEGOOSE_IMPL_GEGLU``, the counters and the choice cache (whose signature holds
``approximate``), the dispatcher's reasons for the kernel (on hand-made CUDA problems; no GPU needed), and
``FusedGeGLUMLP``. The tests marked ``cuda`` run the kernel (``pipegoose::geglu``, kernel pipegoose/swiglu) on a GPU.
"""

from __future__ import annotations

import copy
import re
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from kernel_loading import load_or_skip
from tolerances import tol
# (the SwiGLU tests' inputs, autograd helper and written-out Llama-style MLP serve GeGLU alike)
from test_fusion_swiglu import CUDA, DTYPES, _fwd_bwd, _inputs, _MLP as _SwiGLUMLP

from pipegoose.nn.fusion import FusedGeGLUMLP, FusedSwiGLUMLP, dispatch
from pipegoose.nn.fusion import functional as PF
from pipegoose.nn.fusion.ops import swiglu as S
from pipegoose.nn.fusion.ops._common import NO_STORAGE
from pipegoose.nn.fusion.ops.swiglu import FORWARD_AD_GEGLU

APPROX = ["tanh", "none"]


def _ref64(gate, up, dy, approximate):
    """float64: F.gelu(g, approximate) * u and its gradients, by autograd in float64 (one rounding at the end)."""
    return _fwd_bwd(lambda g, u: F.gelu(g, approximate=approximate) * u, gate.double(), up.double(), dy.double())


# ------------------------------------------------------------------------------------------- the reference path
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("shape", [(3, 7, 33), (1,), (), (2, 1031), (5, 0)])
def test_reference_path_is_torch_bit_for_bit(dtype, shape, approximate):
    """On the CPU the functional runs F.gelu(gate, approximate=approximate) * up: output and both gradients equal
    PyTorch's exactly, counted as the torch path (a fallback: the kernel needs CUDA; an empty input is no fallback)."""
    gate, up = _inputs(shape, dtype, seed=len(shape))
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(9)).to(dtype)
    y, dg, du = _fwd_bwd(lambda a, b: PF.geglu(a, b, approximate), gate, up, dy)
    want, want_dg, want_du = _fwd_bwd(lambda a, b: F.gelu(a, approximate=approximate) * b, gate, up, dy)
    assert y.dtype == dtype and y.shape == torch.Size(shape) and dg.dtype == du.dtype == dtype
    assert torch.equal(y, want) and torch.equal(dg, want_dg) and torch.equal(du, want_du)
    assert dispatch.stats()["geglu"] == {"torch": 1} and "swiglu" not in dispatch.stats()
    assert dispatch.last_choice("geglu").source == ("empty" if gate.numel() == 0 else "fallback")


def test_the_default_is_the_tanh_approximation():
    gate, up = _inputs((4, 9), torch.float32, seed=1)
    assert torch.equal(PF.geglu(gate, up), F.gelu(gate, approximate="tanh") * up)
    # the two forms differ (by up to ~5e-4 of gelu): a swapped approximation would show
    assert not torch.equal(PF.geglu(gate, up, "none"), PF.geglu(gate, up, "tanh"))


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_path_against_float64(dtype, approximate):
    """The path against float64 (its gradients by float64 autograd) within the tolerance table: eager 16-bit rounds
    gelu(gate) and then the product (two roundings: scale 2)."""
    gate, up = _inputs((4, 9, 257), dtype, seed=3)
    dy = torch.randn(gate.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    y, dg, du = _fwd_bwd(lambda a, b: PF.geglu(a, b, approximate), gate, up, dy)
    scale = 1 if dtype == torch.float32 else 2
    for name, got, want in zip(("out", "grad_gate", "grad_up"), (y, dg, du), _ref64(gate, up, dy, approximate)):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got.double(), want, **tol(dtype, scale), msg=lambda m: f"{name}: {m}")


def test_broadcasting_and_mixed_dtypes_follow_pytorch():
    """What the kernel does not take (shapes that broadcast, dtypes that differ) is F.gelu(gate) * up exactly."""
    for gshape, ushape, gdt, udt in (((4, 1, 6), (1, 5, 6), torch.float32, torch.float32),
                                     ((3, 6), (3, 6), torch.float32, torch.bfloat16)):
        gate, up = _inputs(gshape, gdt, seed=5, up_shape=ushape, up_dtype=udt)
        dy = torch.randn(torch.broadcast_shapes(gshape, ushape), generator=torch.Generator().manual_seed(6))
        got = _fwd_bwd(lambda a, b: PF.geglu(a, b, "none"), gate, up, dy)
        want = _fwd_bwd(lambda a, b: F.gelu(a) * b, gate, up, dy)
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want))


# --------------------------------------------------------------------------------------------- argument errors
def test_argument_errors_name_the_argument():
    gate, up = _inputs((3, 5), torch.float32)
    cases = [
        ((1.0, up, "tanh"), TypeError, r"^gate: expected a floating point torch.Tensor, got float"),
        ((gate, up.long(), "tanh"), TypeError, r"^up: expected a floating point torch.Tensor, got int64"),
        ((gate, up[:2], "tanh"), ValueError, r"^up: shape \[2, 5\] does not broadcast with gate's \[3, 5\]"),
        ((gate, up, "exact"), ValueError, r"^approximate: expected 'none' \(exact GELU, erf\) or 'tanh' .*got "
                                          r"'exact'"),
        ((gate, up, "Tanh"), ValueError, r"^approximate: .*got 'Tanh'"),   # (F.gelu takes no other spelling)
        ((gate, up, None), TypeError, r"^approximate: expected 'none' or 'tanh' \(str\), got NoneType"),
        ((gate, up, True), TypeError, r"^approximate: .*got bool"),
    ]
    for args, err, match in cases:
        with pytest.raises(err, match=match):
            PF.geglu(*args)
        with pytest.raises(err, match=match):   # explain refuses what the op refuses, with its message
            dispatch.explain("geglu", *args)
    assert dispatch.stats().get("geglu", {}) == {}   # a refused call is not counted


def test_argument_errors_after_a_cached_choice():
    """The choice cache holds a valid call's choice; a call with another approximate (or shape) is checked again."""
    gate, up = _inputs((3, 5), torch.float32)
    PF.geglu(gate, up, "tanh")
    PF.geglu(gate, up, "tanh")
    with pytest.raises(ValueError, match="^approximate: "):
        PF.geglu(gate, up, "exact")
    with pytest.raises(ValueError, match="^up: "):
        PF.geglu(gate, up[:, :2], "tanh")
    assert dispatch.stats()["geglu"] == {"torch": 2}


def test_the_choice_cache_keys_on_approximate():
    """The signature holds approximate: calls alternating the two forms on the same tensors each compute their own
    (a cached choice never carries one call's approximate to another)."""
    gate, up = _inputs((3, 5), torch.float32, seed=2)
    assert S._signature(gate, up, "tanh") != S._signature(gate, up, "none")
    for approximate in ("tanh", "none", "tanh", "none"):
        assert torch.equal(PF.geglu(gate, up, approximate), F.gelu(gate, approximate=approximate) * up)
    assert dispatch.stats()["geglu"] == {"torch": 4}


# ------------------------------------------------------------------------------- impl=, the variable, strict mode
def test_the_op_and_its_implementations_are_registered():
    impls = dispatch.implementations("geglu")
    assert list(impls) == ["pipegoose", "torch"]
    assert impls["pipegoose"].kernels == ("pipegoose/swiglu",) and impls["torch"].small_first
    assert dispatch._env_names("geglu") == ("PIPEGOOSE_IMPL_GEGLU",)   # an op of its own, no family variable


def test_impl_argument():
    gate, up = _inputs((3, 5), torch.float32)
    with pytest.warns(UserWarning, match=r"impl='pipegoose' cannot run this input: needs a CUDA tensor"):
        y = PF.geglu(gate, up, impl="pipegoose")
    assert torch.equal(y, F.gelu(gate, approximate="tanh") * up)
    assert dispatch.last_choice("geglu").impl == "torch"
    with pytest.raises(ValueError, match=r"impl: geglu has no implementation 'fused'"):
        PF.geglu(gate, up, impl="fused")
    with pytest.raises(TypeError, match="impl"):
        PF.geglu(gate, up, impl=1)
    assert torch.equal(PF.geglu(gate, up, "none", impl=" Torch "), F.gelu(gate) * up)   # any case
    assert dispatch.last_choice("geglu").source == "argument"


def test_impl_variable(monkeypatch):
    """PIPEGOOSE_IMPL_GEGLU chooses for geglu (an implementation it lacks is a ValueError naming the variable); the
    SwiGLU family's variable does not reach it."""
    gate, up = _inputs((3, 5), torch.float32)
    monkeypatch.setenv("PIPEGOOSE_IMPL_SWIGLU", "pipegoose")
    PF.geglu(gate, up)
    assert dispatch.last_choice("geglu").source == "fallback"
    monkeypatch.setenv("PIPEGOOSE_IMPL_GEGLU", "torch")
    assert torch.equal(PF.geglu(gate, up), F.gelu(gate, approximate="tanh") * up)
    assert (dispatch.last_choice("geglu").impl, dispatch.last_choice("geglu").source) == ("torch", "env")
    monkeypatch.setenv("PIPEGOOSE_IMPL_GEGLU", "pipegoose")
    with pytest.warns(UserWarning, match=r"PIPEGOOSE_IMPL_GEGLU='pipegoose' cannot run this input: needs a CUDA"):
        PF.geglu(gate, up)
    monkeypatch.setenv("PIPEGOOSE_IMPL_GEGLU", "apex")
    with pytest.raises(ValueError, match=r"PIPEGOOSE_IMPL_GEGLU.*geglu has no implementation 'apex'"):
        PF.geglu(gate, up)
    assert "PIPEGOOSE_IMPL_GEGLU" not in dispatch.warn_unknown_env()   # a known variable: no warning
    assert dispatch.stats()["geglu"] == {"torch": 3}


def test_strict_mode_raises_on_the_cpu_fallback():
    gate, up = _inputs((3, 5), torch.float32)
    with dispatch.strict():
        with pytest.raises(dispatch.FusionFallbackError, match=r"geglu: strict mode.*needs a CUDA tensor"):
            PF.geglu(gate, up)
        assert PF.geglu(gate[:0], up[:0]).shape == (0, 5)
        assert torch.equal(PF.geglu(gate, up, impl="torch"), F.gelu(gate, approximate="tanh") * up)
        with pytest.raises(dispatch.FusionFallbackError):
            FusedGeGLUMLP(nn.Linear(5, 7), nn.Linear(5, 7), nn.Linear(7, 5))(gate)
        assert FusedGeGLUMLP(nn.Linear(5, 7), nn.Linear(5, 7), nn.Linear(7, 5), impl="torch")(gate).shape == (3, 5)


def test_explain_on_cpu_names_why_the_kernel_does_not_run():
    gate, up = _inputs((3, 5), torch.bfloat16)
    c = dispatch.explain("geglu", gate, up, "none")
    assert (c.impl, c.source, c.fallback) == ("torch", "fallback", True)
    assert "needs a CUDA tensor" in c.reasons["pipegoose"]
    assert dispatch.stats().get("geglu", {}) == {}
    c = dispatch.explain("geglu", gate[:0], up[:0])
    assert (c.impl, c.source, c.fallback) == ("torch", "empty", False)


# ------------------------------------------------------------------------------ the kernel's supports() on CUDA
def _cuda_problem(gate, up, approximate="tanh"):
    return replace(S.geglu_problem(gate, up, approximate), device=CUDA)


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_takes_one_shape_and_one_dtype_on_cuda(dtype, approximate):
    supports = dispatch.implementations("geglu")["pipegoose"].supports
    gate, up = _inputs((2, 3, 11), dtype)
    assert supports(_cuda_problem(gate, up, approximate)) == (True, "")
    assert supports(_cuda_problem(gate[0, 0, 0], up[0, 0, 0])) == (True, "")
    assert supports(S.geglu_problem(gate, up, approximate)) == (False, "needs a CUDA tensor, got device cpu")


@pytest.mark.parametrize("build,reason", [
    (lambda g, u: (g, u.half()), r"up is float16 and gate float32: the kernel takes one dtype"),
    (lambda g, u: (g.double(), u.double()), r"dtype float64 not supported"),
    (lambda g, u: (g, u[:1]), r"up's shape \[1, 5\] differs from gate's \[3, 5\]: the kernel does not broadcast"),
    (lambda g, u: (g[:0], u[:0]), r"^an empty input$"),
], ids=["dtypes_differ", "float64", "broadcast", "empty"])
def test_kernel_declines_on_cuda_with_the_reason(build, reason):
    supports = dispatch.implementations("geglu")["pipegoose"].supports
    ok, why = supports(_cuda_problem(*build(*_inputs((3, 5), torch.float32))))
    assert not ok and re.search(reason, why), why


def test_kernel_declines_tensors_without_storage_and_dual_tensors():
    supports = dispatch.implementations("geglu")["pipegoose"].supports
    p = _cuda_problem(*_inputs((3, 5), torch.float32))
    assert supports(replace(p, extra={**p.extra, "storage": False})) == (False, NO_STORAGE)
    assert supports(replace(p, extra={**p.extra, "forward_ad": True})) == (False, FORWARD_AD_GEGLU)
    assert "GeGLU kernel" in FORWARD_AD_GEGLU


def test_problem_describes_the_call():
    gate, up = _inputs((2, 3, 11), torch.bfloat16)
    p = S.geglu_problem(gate, up.requires_grad_(), "none")
    assert (p.op, p.dtype, p.cols, p.needs_grad) == ("geglu", torch.bfloat16, 11, True)
    assert p["shape"] == p["up_shape"] == (2, 3, 11) and p["numel"] == 66 and p["approximate"] == "none"
    assert dispatch.problem_of("geglu", gate, up).get("approximate") == "tanh"   # (the functional's default)


def test_choice_on_cuda_of_empty_and_small_inputs_loads_no_kernel(monkeypatch):
    """As swiglu's: an empty input runs the reference (source empty), one under PIPEGOOSE_SMALL_NUMEL the native ops
    (source small), on metadata alone; a small input the kernel does not take is a real fallback."""
    def no_kernel(name):
        raise AssertionError(f"loaded {name}")

    monkeypatch.setattr(dispatch, "kernel", no_kernel)
    monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "1000")
    with dispatch.strict():
        c = dispatch.select("geglu", _cuda_problem(*_inputs((4, 0), torch.bfloat16)))
        assert (c.impl, c.source, c.fallback) == ("torch", "empty", False)
        gate, up = _inputs((3, 5), torch.bfloat16)
        c = dispatch.select("geglu", _cuda_problem(gate, up, "none"))
        assert (c.impl, c.source, c.fallback) == ("torch", "small", False)
        assert "fused paths that take it: pipegoose" in c.reason
        with pytest.raises(dispatch.FusionFallbackError, match="does not broadcast"):
            dispatch.select("geglu", _cuda_problem(gate, up[:1]))


# (the choice where the kernel loads, and where it does not: test_fusion_swiglu.py, parametrized over geglu)


def test_vmap_and_forward_ad_run_the_reference():
    gate, up = _inputs((4, 6), torch.float32, seed=2)
    assert torch.equal(torch.func.vmap(lambda g, u: PF.geglu(g, u, "none"))(gate, up), F.gelu(gate) * up)
    tangent = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    _, jvp = torch.func.jvp(lambda g: PF.geglu(g, up), (gate,), (tangent,))
    _, want = torch.func.jvp(lambda g: F.gelu(g, approximate="tanh") * up, (gate,), (tangent,))
    assert torch.equal(jvp, want)


# ------------------------------------------------------------------------------------------------ FusedGeGLUMLP
def _MLP(hidden=8, inter=12, act=None, bias=False):
    """transformers' GemmaMLP, written out: the Llama-style MLP with GELU (tanh) as act_fn, or ``act``."""
    return _SwiGLUMLP(hidden, inter, bias, nn.GELU(approximate="tanh") if act is None else act)


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_mlp_from_module_is_a_drop_in(approximate, bias, dtype):
    """from_module takes the approximation from the probe; the same children (state_dict keys), the same output and
    gradients as the MLP on the CPU (the reference path: bit for bit), one geglu call per forward."""
    torch.manual_seed(0)
    mlp = _MLP(act=nn.GELU(approximate=approximate), bias=bias).to(dtype)
    fused = FusedGeGLUMLP.from_module(mlp)
    assert fused.approximate == approximate and fused.impl is None
    assert list(fused.state_dict()) == list(mlp.state_dict())
    assert all(getattr(fused, n) is getattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))
    x = torch.randn(2, 5, 8, dtype=dtype, requires_grad=True)
    y = fused(x)
    gx, *gp = torch.autograd.grad(y.sum(), [x, *mlp.parameters()])
    want = mlp(x)
    wx, *wp = torch.autograd.grad(want.sum(), [x, *mlp.parameters()])
    assert torch.equal(y, want) and torch.equal(gx, wx) and all(torch.equal(a, b) for a, b in zip(gp, wp))
    assert dispatch.stats()["geglu"] == {"torch": 1}
    assert f"approximate={approximate!r}" in repr(fused)


def test_extra_repr_and_constructor_checks():
    lin = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 4)
    assert FusedGeGLUMLP(*lin).extra_repr() == "approximate='tanh'"
    assert FusedGeGLUMLP(*lin, approximate="none", impl="torch").extra_repr() == "approximate='none', impl='torch'"
    with pytest.raises(ValueError, match=r"^approximate: .*got 'erf'"):
        FusedGeGLUMLP(*lin, approximate="erf")
    with pytest.raises(TypeError, match=r"^approximate: "):
        FusedGeGLUMLP(*lin, approximate=None)
    with pytest.raises(ValueError, match=r"^impl: geglu has no implementation 'apex'"):
        FusedGeGLUMLP(*lin, impl="apex")
    with pytest.raises(TypeError, match=r"^up_proj: expected a torch.nn.Module, got str"):
        FusedGeGLUMLP(lin[0], "up", lin[2])


def test_from_module_refuses_what_is_not_a_geglu_mlp():
    """A SwiGLU MLP (SiLU), one of another activation, an approximate that contradicts the probe: refused with the
    reason; FusedSwiGLUMLP refuses a GeGLU MLP, naming FusedGeGLUMLP. verify=False takes the caller's word."""
    with pytest.raises(ValueError, match=r"^mlp: _MLP does not pass the GeGLU probe: act_fn \(SiLU\) computes SiLU, "
                                         r"not GELU: a SwiGLU MLP, which FusedSwiGLUMLP.from_module takes"):
        FusedGeGLUMLP.from_module(_MLP(act=nn.SiLU()))
    with pytest.raises(ValueError, match=r"does not pass the GeGLU probe: act_fn \(ReLU\) is not SiLU or GELU"):
        FusedGeGLUMLP.from_module(_MLP(act=nn.ReLU()))
    gelu = _MLP(act=nn.GELU())
    with pytest.raises(ValueError, match=r"^mlp: _MLP does not pass the SwiGLU probe: act_fn \(GELU\) is not SiLU but "
                                         r"GELU \(approximate='none'\): a GeGLU MLP, which FusedGeGLUMLP"):
        FusedSwiGLUMLP.from_module(gelu)
    with pytest.raises(ValueError, match=r"^approximate: 'tanh', but the MLP's act_fn computes GELU with "
                                         r"approximate='none'"):
        FusedGeGLUMLP.from_module(gelu, approximate="tanh")
    assert FusedGeGLUMLP.from_module(gelu, approximate="none").approximate == "none"
    with pytest.raises(TypeError, match=r"^mlp: expected a module with submodules gate_proj, up_proj and down_proj"):
        FusedGeGLUMLP.from_module(nn.Linear(4, 4))
    # verify=False: the caller's word (approximate, else tanh), no probe
    x = torch.randn(2, 8)
    silu = _MLP(act=nn.SiLU())
    fused = FusedGeGLUMLP.from_module(silu, verify=False)
    assert fused.approximate == "tanh"
    assert torch.equal(fused(x), silu.down_proj(F.gelu(silu.gate_proj(x), approximate="tanh") * silu.up_proj(x)))
    assert FusedGeGLUMLP.from_module(silu, verify=False, approximate="none").approximate == "none"


def test_an_activation_replaced_or_hooked_while_fused_is_run_as_the_mlp_would():
    mlp = _MLP()
    fused = FusedGeGLUMLP.from_module(mlp)
    x = torch.randn(3, 8)
    fused(x)
    assert dispatch.stats()["geglu"] == {"torch": 1}
    calls = []
    handle = fused.act_fn.register_forward_hook(lambda *a: calls.append(1))
    assert torch.equal(fused(x), mlp(x)) and calls == [1, 1]   # (the fused module's call, then the MLP's own)
    handle.remove()
    fused.act_fn = nn.ReLU()
    assert torch.equal(fused(x), fused.down_proj(F.relu(fused.gate_proj(x)) * fused.up_proj(x)))
    assert dispatch.stats()["geglu"] == {"torch": 1}   # (neither ran the op)


@pytest.mark.parametrize("how", ["GELUTanh.act", "nn.GELU.approximate"])
def test_an_activation_changed_in_place_while_fused_is_run_as_the_mlp_would(how):
    """An attribute of the probed activation changed while fused (transformers' GELUTanh.act, nn.GELU's
    approximate: the erf form for the tanh one) is another activation: the fused module runs it as the MLP would (a
    review: the change was ignored, 3.5e-4 off), in a copy made after the change too; set back, the op runs again."""
    from transformers.activations import ACT2FN

    mlp = _MLP()
    mlp.act_fn = ACT2FN["gelu_pytorch_tanh"] if how == "GELUTanh.act" else nn.GELU(approximate="tanh")
    fused = FusedGeGLUMLP.from_module(mlp)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2)) * 3
    before = fused(x)
    name = "act" if how == "GELUTanh.act" else "approximate"
    old = getattr(fused.act_fn, name)
    setattr(fused.act_fn, name, F.gelu if how == "GELUTanh.act" else "none")
    dispatch.reset_stats()
    want = fused.down_proj(F.gelu(fused.gate_proj(x)) * fused.up_proj(x))
    assert not torch.allclose(want, before, rtol=0, atol=1e-6)
    assert torch.equal(fused(x), want) and torch.equal(copy.deepcopy(fused)(x), want)
    assert dispatch.stats().get("geglu", {}) == {}
    setattr(fused.act_fn, name, old)
    assert torch.equal(fused(x), before) and dispatch.stats()["geglu"] == {"torch": 1}


def test_fused_mlp_keeps_the_training_flag():
    mlp = _MLP().eval()
    assert not FusedGeGLUMLP.from_module(mlp).training
    assert FusedGeGLUMLP.from_module(mlp.train()).training


# ------------------------------------------------------------------------------------------------ on a GPU
@pytest.mark.cuda
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_functional_on_cuda_runs_the_kernel(no_tuning_table, dtype, approximate):
    """On CUDA (tuning table and small-problem rule set aside) the functional runs pipegoose::geglu: no fallback
    (strict mode passes), the raw ops' results bit for bit, the float64 formulas within the tolerance table, counted
    as pipegoose; what the kernel does not take (broadcasting) is a fallback strict mode refuses."""
    gate, up = (t.cuda() for t in _inputs((4, 1001), dtype, seed=11))
    dy = torch.randn(4, 1001, generator=torch.Generator().manual_seed(12)).to(dtype).cuda()
    with dispatch.strict():
        y, dg, du = _fwd_bwd(lambda a, b: PF.geglu(a, b, approximate), gate, up, dy)
    c = dispatch.last_choice("geglu")
    assert (c.impl, c.fallback) == ("pipegoose", False), c
    assert dispatch.stats()["geglu"] == {"pipegoose": 1}
    assert torch.equal(y, torch.ops.pipegoose.geglu_forward(gate, up, approximate))
    want_dg, want_du = torch.ops.pipegoose.geglu_backward(dy, gate, up, approximate)
    assert torch.equal(dg, want_dg) and torch.equal(du, want_du)
    ref = _ref64(gate.cpu(), up.cpu(), dy.cpu(), approximate)
    for name, got, want in zip(("out", "grad_gate", "grad_up"), (y, dg, du), ref):
        torch.testing.assert_close(got.double().cpu(), want, **tol(dtype), msg=lambda m: f"{name}: {m}")
    with dispatch.strict(), pytest.raises(dispatch.FusionFallbackError, match="does not broadcast"):
        PF.geglu(gate, up[:1], approximate)
    with pytest.raises(RuntimeError, match="approximate"):   # the raw op's own check
        torch.ops.pipegoose.geglu_forward(gate, up, "erf")


@pytest.mark.cuda
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_mlp_on_cuda_matches_the_mlp(no_tuning_table, dtype, approximate):
    """FusedGeGLUMLP runs pipegoose::geglu with the MLP's approximation; no fallback (strict mode); output and
    gradients as the MLP's within the dtype's rounding (eager rounds gelu(gate) before the product in 16-bit)."""
    torch.manual_seed(1)
    mlp = _MLP(hidden=64, inter=176, act=nn.GELU(approximate=approximate)).to("cuda", dtype)
    fused = FusedGeGLUMLP.from_module(mlp)
    x = torch.randn(3, 7, 64, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(3, 7, 64, device="cuda", dtype=dtype)
    want = mlp(x)
    want_grads = torch.autograd.grad(want, [x, *mlp.parameters()], dy)
    with dispatch.strict():
        got = fused(x)
        grads = torch.autograd.grad(got, [x, *fused.parameters()], dy)
    assert dispatch.last_choice("geglu").impl == "pipegoose" and dispatch.stats()["geglu"] == {"pipegoose": 1}
    torch.testing.assert_close(got, want, **tol(dtype, 4))
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, **tol(dtype, 8))


# ===================================================================== gelu_and_mul: op geglu.packed (x packed)
GPACKED = "geglu.packed"


def _packed(shape, dtype, seed=0):
    """x [..., 2d]: _inputs' gate in each row's first d values, its up in the last d."""
    *lead, two_d = shape
    gate, up = _inputs((*lead, two_d // 2), dtype, seed)
    return torch.cat((gate, up), -1)


def _gelu_and_mul_torch(x, approximate):
    gate, up = x.chunk(2, -1)
    return F.gelu(gate, approximate=approximate) * up


@pytest.fixture
def gpacked_env(monkeypatch):
    """The variables the op reads, unset."""
    for var in ("PIPEGOOSE_IMPL_GEGLU_PACKED", "PIPEGOOSE_IMPL_GEGLU", "PIPEGOOSE_IMPL_SWIGLU_PACKED",
                "PIPEGOOSE_IMPL_SWIGLU", "PIPEGOOSE_STRICT", "PIPEGOOSE_SMALL_NUMEL"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def _grad_of_x(fn, x, dy):
    xx = x.detach().clone().requires_grad_()
    y = fn(xx)
    y.backward(dy)
    return y.detach(), xx.grad


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("shape", [(3, 7, 34), (2,), (2, 1032), (5, 0), (0, 4)])
def test_gelu_and_mul_reference_path_is_torch_bit_for_bit(dtype, shape, approximate, gpacked_env):
    """On the CPU gelu_and_mul runs chunk, F.gelu and the product: output and x's gradient equal PyTorch's exactly,
    counted under geglu.packed (not geglu, not swiglu.packed) as a fallback (an empty input: no fallback)."""
    x = _packed(shape, dtype, seed=len(shape))
    dy = torch.randn((*shape[:-1], shape[-1] // 2), generator=torch.Generator().manual_seed(9)).to(dtype)
    y, dx = _grad_of_x(lambda t: PF.gelu_and_mul(t, approximate), x, dy)
    want_y, want_dx = _grad_of_x(lambda t: _gelu_and_mul_torch(t, approximate), x, dy)
    assert y.dtype == dx.dtype == dtype and y.shape == dy.shape and dx.shape == x.shape
    assert torch.equal(y, want_y) and torch.equal(dx, want_dx)
    assert dispatch.stats() == {GPACKED: {"torch": 1}}
    assert dispatch.last_choice(GPACKED).source == ("empty" if x.numel() == 0 else "fallback")


def test_gelu_and_mul_default_and_the_two_forms():
    x = _packed((4, 18), torch.float32, seed=1)
    assert torch.equal(PF.gelu_and_mul(x), _gelu_and_mul_torch(x, "tanh"))
    assert not torch.equal(PF.gelu_and_mul(x, "none"), PF.gelu_and_mul(x, "tanh"))
    assert torch.equal(PF.gelu_and_mul(x, "none"), PF.geglu(*x.chunk(2, -1), "none"))


def test_gelu_and_mul_argument_errors_name_the_argument(gpacked_env):
    x = _packed((3, 6), torch.float32)
    cases = [
        ((1.0, "tanh"), TypeError, r"^x: expected a floating point torch.Tensor, got float"),
        ((x.long(), "tanh"), TypeError, r"^x: expected a floating point torch.Tensor, got int64"),
        ((x[:, :5], "tanh"), ValueError, r"^x: expected an even last dimension \(gate and up are its two halves\), "
                                         r"got shape \[3, 5\]"),
        ((x[0, 0], "none"), ValueError, r"^x: expected at least one dimension"),
        ((x, "exact"), ValueError, r"^approximate: expected 'none' \(exact GELU, erf\) or 'tanh' .*got 'exact'"),
        ((x, None), TypeError, r"^approximate: expected 'none' or 'tanh' \(str\), got NoneType"),
    ]
    for args, err, match in cases:
        with pytest.raises(err, match=match):
            PF.gelu_and_mul(*args)
        with pytest.raises(err, match=match):
            dispatch.explain(GPACKED, *args)
    assert dispatch.stats().get(GPACKED, {}) == {}
    PF.gelu_and_mul(x, "tanh")
    PF.gelu_and_mul(x, "tanh")   # (a cached choice)
    with pytest.raises(ValueError, match="^approximate: "):
        PF.gelu_and_mul(x, "erf")
    assert S._packed_signature(x, "tanh") != S._packed_signature(x, "none")
    for approximate in ("none", "tanh", "none"):
        assert torch.equal(PF.gelu_and_mul(x, approximate), _gelu_and_mul_torch(x, approximate))
    assert dispatch.stats()[GPACKED] == {"torch": 5}


def test_gelu_and_mul_registration_variables_and_strict_mode(gpacked_env):
    """Its implementations, pipegoose (kernel pipegoose/swiglu) and torch (small_first); PIPEGOOSE_IMPL_GEGLU_PACKED,
    then the geglu family's PIPEGOOSE_IMPL_GEGLU (the SwiGLU variables do not reach it); strict mode refuses the CPU
    fallback."""
    impls = dispatch.implementations(GPACKED)
    assert list(impls) == ["pipegoose", "torch"]
    assert impls["pipegoose"].kernels == ("pipegoose/swiglu",) and impls["torch"].small_first
    assert dispatch._env_names(GPACKED) == ("PIPEGOOSE_IMPL_GEGLU_PACKED", "PIPEGOOSE_IMPL_GEGLU")
    x = _packed((3, 6), torch.float32)
    gpacked_env.setenv("PIPEGOOSE_IMPL_SWIGLU_PACKED", "torch")
    PF.gelu_and_mul(x)
    assert dispatch.last_choice(GPACKED).source == "fallback"
    gpacked_env.setenv("PIPEGOOSE_IMPL_GEGLU", "torch")
    PF.gelu_and_mul(x)
    assert dispatch.last_choice(GPACKED).source == "env"
    gpacked_env.setenv("PIPEGOOSE_IMPL_GEGLU_PACKED", "pipegoose")
    with pytest.warns(UserWarning, match=r"PIPEGOOSE_IMPL_GEGLU_PACKED='pipegoose' cannot run this input"):
        PF.gelu_and_mul(x)
    gpacked_env.setenv("PIPEGOOSE_IMPL_GEGLU_PACKED", "apex")
    with pytest.raises(ValueError, match=r"PIPEGOOSE_IMPL_GEGLU_PACKED.*geglu.packed has no implementation 'apex'"):
        PF.gelu_and_mul(x)
    gpacked_env.delenv("PIPEGOOSE_IMPL_GEGLU_PACKED")
    gpacked_env.delenv("PIPEGOOSE_IMPL_GEGLU")
    with dispatch.strict():
        with pytest.raises(dispatch.FusionFallbackError, match=r"geglu.packed: strict mode.*needs a CUDA tensor"):
            PF.gelu_and_mul(x)
        assert torch.equal(PF.gelu_and_mul(x, impl="torch"), _gelu_and_mul_torch(x, "tanh"))


@pytest.mark.parametrize("approximate", APPROX)
def test_gelu_and_mul_kernel_supports_on_cuda(approximate):
    """The kernel's supports() of a CUDA problem: fp32/fp16/bf16 taken, approximate in the problem; empty, fp64 and
    dual tensors declined with the reason."""
    supports = dispatch.implementations(GPACKED)["pipegoose"].supports
    for dtype in DTYPES:
        p = replace(S.geglu_packed_problem(_packed((2, 3, 22), dtype), approximate), device=CUDA)
        assert p["approximate"] == approximate and p.cols == 11
        assert supports(p) == (True, "")
    p = replace(S.geglu_packed_problem(_packed((0, 22), torch.float32), approximate), device=CUDA)
    assert supports(p) == (False, "an empty input")
    p = replace(S.geglu_packed_problem(_packed((2, 22), torch.float64), approximate), device=CUDA)
    assert not supports(p)[0]
    p = replace(p, dtype=torch.float32, extra={**p.extra, "forward_ad": True})
    assert supports(p) == (False, FORWARD_AD_GEGLU)


@pytest.mark.slow
def test_gelu_and_mul_fake_impls_on_meta_tensors():
    load_or_skip("pipegoose/swiglu")
    ops = torch.ops.pipegoose
    x = torch.empty(3, 5, 14, device="meta", dtype=torch.bfloat16)
    for y in (ops.gelu_and_mul_forward(x, "none"), ops.gelu_and_mul(x), ops.gelu_and_mul(x, "tanh")):
        assert y.device.type == "meta" and y.shape == (3, 5, 7) and y.dtype == torch.bfloat16
    dx = ops.gelu_and_mul_backward(torch.empty(3, 5, 7, device="meta"), x, "tanh")
    assert dx.shape == x.shape and dx.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match=r"approximate: expected 'tanh' or 'none', got 'erf'"):
        ops.gelu_and_mul_forward(x, "erf")
    with pytest.raises(RuntimeError, match=r"x: expected an even last dimension, got 5"):
        ops.gelu_and_mul_forward(torch.empty(4, 5, device="meta"), "tanh")
    with pytest.raises(RuntimeError, match=r"grad_output: expected shape \(3, 5, 7\)"):
        ops.gelu_and_mul_backward(torch.empty(3, 5, 14, device="meta"), x, "none")


@pytest.mark.cuda
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_and_mul_on_cuda_runs_the_kernel(no_tuning_table, dtype, approximate, monkeypatch):
    """On CUDA (tuning table and small-problem rule set aside) gelu_and_mul runs pipegoose::gelu_and_mul (strict
    mode), the raw ops' results bit for bit, float64's within the tolerance table. (The implementation variables
    unset here, not through gpacked_env, which unsets PIPEGOOSE_SMALL_NUMEL too: no_tuning_table's 0 was lost, and
    the small-problem rule ran torch on the GPU, session 69.)"""
    for var in ("PIPEGOOSE_IMPL_GEGLU_PACKED", "PIPEGOOSE_IMPL_GEGLU", "PIPEGOOSE_STRICT"):
        monkeypatch.delenv(var, raising=False)
    x = _packed((4, 2 * 1001), dtype, seed=11).cuda()
    dy = torch.randn(4, 1001, generator=torch.Generator().manual_seed(12)).to(dtype).cuda()
    with dispatch.strict():
        y, dx = _grad_of_x(lambda t: PF.gelu_and_mul(t, approximate), x, dy)
    c = dispatch.last_choice(GPACKED)
    assert (c.impl, c.fallback) == ("pipegoose", False), c
    assert torch.equal(y, torch.ops.pipegoose.gelu_and_mul_forward(x, approximate))
    assert torch.equal(dx, torch.ops.pipegoose.gelu_and_mul_backward(dy, x, approximate))
    y64, dx64 = _grad_of_x(lambda t: _gelu_and_mul_torch(t, approximate), x.cpu().double(), dy.cpu().double())
    torch.testing.assert_close(y.double().cpu(), y64, **tol(dtype))
    torch.testing.assert_close(dx.double().cpu(), dx64, **tol(dtype))
