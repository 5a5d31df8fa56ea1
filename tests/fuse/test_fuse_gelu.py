"""GELU alone (op ``gelu``, :func:`pipegoose.nn.fusion.functional.gelu`, :class:`FusedGELU`) and ``fuse(model)``
replacing the GELU activation modules of the MLPs without a gate (GPT-2's ``NewGELUActivation``, Bloom's
``BloomGelu``, BERT's ``GELUActivation``), on the CPU: the reference path, argument errors, dispatch, the probe, the
report, unfuse, and the activations of fused gated MLPs left alone. The kernel itself: tests/kernels/test_geglu_cuda.py
(``-k gelu_``); on a GPU, tests/fuse/test_fuse_cuda.py."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipegoose.nn.fusion import FusedGELU, dispatch
from pipegoose.nn.fusion import functional as PF
from pipegoose.nn.fusion.fuse import fuse, fusion_report, unfuse
from pipegoose.nn.fusion.modules import FusedGeGLUMLP
from pipegoose.nn.fusion.transformers import matching

from . import models

transformers = pytest.importorskip("transformers")
from transformers import activations as A  # noqa: E402

APPROX = ["none", "tanh"]


@pytest.fixture(autouse=True)
def _fresh_stats():
    dispatch.reset_stats()
    yield


def _x(shape=(3, 5, 7), dtype=torch.float32, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(shape, generator=g)).to(dtype).requires_grad_(requires_grad)


# ------------------------------------------------------------------------------------------------- functional
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("approximate", APPROX)
def test_reference_path_is_f_gelu_bit_for_bit(dtype, approximate):
    x = _x(dtype=dtype, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    dy = _x(dtype=dtype, seed=1)
    y = PF.gelu(x, approximate)
    want = F.gelu(xr, approximate=approximate)
    assert torch.equal(y, want) and y.dtype == dtype
    y.backward(dy)
    want.backward(dy)
    assert torch.equal(x.grad, xr.grad)
    assert dispatch.stats()["gelu"] == {"torch": 1}
    c = dispatch.last_choice("gelu")
    assert (c.impl, c.fallback) == ("torch", True) and "needs a CUDA tensor" in c.reasons["pipegoose"]


def test_the_default_is_exact_gelu_as_f_gelus():
    x = _x()
    assert torch.equal(PF.gelu(x), F.gelu(x)) and not torch.equal(PF.gelu(x), F.gelu(x, approximate="tanh"))


def test_argument_errors_name_the_argument():
    x = _x()
    with pytest.raises(TypeError, match=r"^input: "):
        PF.gelu([1.0, 2.0])
    with pytest.raises(TypeError, match=r"^input: "):
        PF.gelu(torch.arange(4))
    with pytest.raises(ValueError, match=r"approximate: expected 'none' \(exact GELU, erf\) or 'tanh'.*'erf'"):
        PF.gelu(x, "erf")
    with pytest.raises(TypeError, match=r"approximate: expected 'none' or 'tanh' \(str\), got bool"):
        PF.gelu(x, True)
    with pytest.raises(ValueError, match=r"impl: gelu has no implementation 'fused'"):
        PF.gelu(x, impl="fused")
    PF.gelu(x)   # a cached choice: the checks still run for another approximate
    with pytest.raises(ValueError, match="approximate"):
        PF.gelu(x, "Tanh")


def test_registration_variable_and_strict_mode(monkeypatch):
    impls = dispatch.implementations("gelu")
    assert list(impls) == ["pipegoose", "torch"]
    assert impls["pipegoose"].kernels == ("pipegoose/swiglu",) and impls["torch"].small_first
    assert dispatch._env_names("gelu") == ("PIPEGOOSE_IMPL_GELU",)
    x = _x()
    monkeypatch.setenv("PIPEGOOSE_IMPL_GELU", "torch")
    assert torch.equal(PF.gelu(x, "tanh"), F.gelu(x, approximate="tanh"))
    assert (dispatch.last_choice("gelu").impl, dispatch.last_choice("gelu").source) == ("torch", "env")
    monkeypatch.delenv("PIPEGOOSE_IMPL_GELU")
    with dispatch.strict():
        with pytest.raises(dispatch.FusionFallbackError, match=r"gelu: strict mode.*needs a CUDA tensor"):
            PF.gelu(x)
        assert PF.gelu(x[:0]).shape == (0, 5, 7)   # (empty: not a fallback)
        assert torch.equal(PF.gelu(x, impl="torch"), F.gelu(x))


def test_the_kernel_takes_cuda_fp32_fp16_bf16_and_declines_the_rest():
    from dataclasses import replace

    from pipegoose.nn.fusion.ops import swiglu as S

    ours = dispatch.implementations("gelu")["pipegoose"]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        p = replace(S.gelu_problem(_x(dtype=dtype), "tanh"), device=torch.device("cuda"))
        assert ours.supports(p) == (True, "")
    p = replace(S.gelu_problem(_x(dtype=torch.float64), "none"), device=torch.device("cuda"))
    assert not ours.supports(p)[0] and "float64" in ours.supports(p)[1]
    p = replace(S.gelu_problem(_x()[:0], "none"), device=torch.device("cuda"))
    assert ours.supports(p) == (False, "an empty input")
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(_x(), _x(seed=2))
        p = replace(S.gelu_problem(dual, "none"), device=torch.device("cuda"))
        assert not ours.supports(p)[0] and "forward derivative" in ours.supports(p)[1]


# ------------------------------------------------------------------------------------------------- the probe
@pytest.mark.parametrize("make, approximate", [
    (A.NewGELUActivation, "tanh"), (A.FastGELUActivation, "tanh"), (A.AccurateGELUActivation, "tanh"),
    (A.GELUActivation, "none"), (lambda: nn.GELU(), "none"), (lambda: nn.GELU(approximate="tanh"), "tanh"),
    (lambda: A.ACT2FN["gelu_pytorch_tanh"], "tanh"), (lambda: A.ACT2FN["gelu_python"], "none"),
], ids=["gelu_new", "gelu_fast", "gelu_accurate", "gelu", "nn.GELU", "nn.GELU-tanh", "gelu_pytorch_tanh",
        "gelu_python"])
def test_the_probe_finds_each_gelu_and_its_approximation(make, approximate):
    act = make()
    probe = matching.probe_gelu(act)
    assert probe.candidate and probe.ok and probe.approximate == approximate, probe
    fused = FusedGELU.from_module(act)
    assert fused.approximate == approximate
    x = _x(dtype=torch.float64)
    torch.testing.assert_close(fused(x), act(x), rtol=1e-6, atol=1e-7)


def test_the_probe_refuses_other_functions_and_hooked_modules():
    probe = matching.probe_gelu(A.QuickGELUActivation())
    assert probe.candidate and not probe.ok and "not GELU" in probe.reason
    assert not matching.probe_gelu(nn.SiLU()).candidate   # (no "gelu" in its name: not looked at)

    class ClippedGELU(nn.Module):   # a GELU clamped far out (transformers' gelu_10 is a ClippedGELUActivation)
        def forward(self, x):
            return F.gelu(x).clamp(max=10.0)

    probe = matching.probe_gelu(ClippedGELU())
    assert probe.candidate and not probe.ok, probe
    assert not matching.probe_gelu(A.ACT2FN["gelu_10"]).ok

    class GELUWithScale(nn.Module):
        def forward(self, x, scale=1.0):
            return F.gelu(x) * scale

    assert "more than the input" in matching.probe_gelu(GELUWithScale()).reason
    hooked = A.NewGELUActivation()
    hooked.register_forward_hook(lambda *a: None)
    assert matching.probe_gelu(hooked).ok   # (fuse hands the hooks to the replacement)


def test_the_probe_leaves_the_random_state_and_training_flags_as_they_were():
    act = A.NewGELUActivation().eval()
    state = torch.random.get_rng_state()
    matching.probe_gelu(act)
    assert torch.equal(torch.random.get_rng_state(), state) and not act.training


# ------------------------------------------------------------------------------------------------- FusedGELU
def test_fused_gelu_constructor_from_module_and_repr():
    assert repr(FusedGELU()) == "FusedGELU(approximate='none')"
    assert repr(FusedGELU("tanh", impl="torch")) == "FusedGELU(approximate='tanh', impl='torch')"
    with pytest.raises(ValueError, match="approximate"):
        FusedGELU("sigmoid")
    with pytest.raises(TypeError, match="approximate"):
        FusedGELU(None)
    with pytest.raises(ValueError, match=r"impl: gelu has no implementation 'apex'"):
        FusedGELU(impl="apex")
    with pytest.raises(TypeError, match=r"act: expected a torch.nn.Module, got builtin_function_or_method"):
        FusedGELU.from_module(F.gelu)
    with pytest.raises(ValueError, match=r"approximate: 'none', but NewGELUActivation computes GELU with "
                                         r"approximate='tanh'"):
        FusedGELU.from_module(A.NewGELUActivation(), approximate="none")
    assert FusedGELU.from_module(nn.GELU("tanh"), verify=False).approximate == "tanh"
    assert FusedGELU.from_module(A.NewGELUActivation(), approximate="tanh", verify=False).approximate == "tanh"
    with pytest.raises(TypeError, match=r"approximate: required with verify=False \(NewGELUActivation has no"):
        FusedGELU.from_module(A.NewGELUActivation(), verify=False)
    assert not FusedGELU.from_module(A.NewGELUActivation().eval()).training
    m = pickle.loads(pickle.dumps(FusedGELU("tanh")))
    assert m.approximate == "tanh" and torch.equal(m(_x()), F.gelu(_x(), approximate="tanh"))


@pytest.mark.parametrize("approximate", APPROX)
def test_fused_gelu_forward_and_backward_are_f_gelus(approximate):
    x = _x(dtype=torch.bfloat16, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y = FusedGELU(approximate)(x)
    want = F.gelu(xr, approximate=approximate)
    assert torch.equal(y, want)
    y.sum().backward()
    want.sum().backward()
    assert torch.equal(x.grad, xr.grad)


# ------------------------------------------------------------------------------------------------- fuse(model)
def _mlp_act(model, i=0):
    return model.h[i].mlp.act


@pytest.mark.parametrize("arch, where, original", [
    ("gpt2", lambda m: m.h[0].mlp, "act"),
    ("bloom", lambda m: m.h[0].mlp, "gelu_impl"),
    ("bert", lambda m: m.encoder.layer[0].intermediate, "intermediate_act_fn"),
])
def test_fuse_replaces_the_gelu_of_mlps_without_a_gate_and_unfuse_puts_it_back(arch, where, original):
    model = models.build(arch, "eager")
    ids, mask = models.inputs()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
    old = getattr(where(model), original)
    keys = list(model.state_dict())
    assert [r.kind for r in fuse(model, dry_run=True).rows].count("gelu") == 2   # (in the default ops)
    report = fuse(model, ops=["gelu"])   # (alone: the others' own tests compare them)
    rows = [r for r in report.rows if r.kind == "gelu"]
    assert len(rows) == 2 and all(r.fused and r.replacement == "FusedGELU" for r in rows), report
    assert rows[0].path.endswith(original) and "op gelu" in rows[0].reason, rows[0]
    new = getattr(where(model), original)
    assert isinstance(new, FusedGELU) and new.approximate == ("none" if arch == "bert" else "tanh")
    assert list(model.state_dict()) == keys
    dispatch.reset_stats()
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert dispatch.stats()["gelu"] == {"torch": 2}
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert unfuse(model)
    assert getattr(where(model), original) is old


def test_dry_run_ops_and_the_count_of_gelu_left_out():
    model = models.build("gpt2", "eager")
    act = _mlp_act(model)
    dry = fuse(model, dry_run=True)
    assert [r.path for r in dry.rows if r.kind == "gelu"] == ["h.0.mlp.act", "h.1.mlp.act"]
    assert _mlp_act(model) is act and fusion_report(model) is None
    report = fuse(model, ops=["layer_norm"], dry_run=True)
    assert report.not_requested.get("gelu") == 2 and not any(r.kind == "gelu" for r in report.rows)
    report = fuse(model, ops=["gelu"])
    assert [r.kind for r in report.rows] == ["gelu", "gelu"] and isinstance(_mlp_act(model), FusedGELU)
    with pytest.raises(RuntimeError, match="already fused"):
        fuse(model)
    unfuse(model)
    assert _mlp_act(model) is act


def test_a_hooked_gelu_keeps_its_hooks_and_a_quick_gelu_is_skipped_with_the_reason():
    model = models.build("gpt2", "eager")
    seen = []
    handle = model.h[0].mlp.act.register_forward_hook(lambda m, i, o: seen.append(type(m).__name__))
    model.h[1].mlp.act = A.QuickGELUActivation()
    report = fuse(model, ops=["gelu"])
    rows = {r.path: r for r in report.rows}
    assert rows["h.0.mlp.act"].fused
    assert not rows["h.1.mlp.act"].fused and "not GELU" in rows["h.1.mlp.act"].reason
    assert not rows["h.1.mlp.act"].eligible
    with torch.no_grad():
        model(input_ids=models.inputs()[0])
    assert seen == ["FusedGELU"]
    handle.remove()   # (the handle still removes it: the dictionaries are shared)
    with torch.no_grad():
        model(input_ids=models.inputs()[0])
    assert seen == ["FusedGELU"]
    unfuse(model)
    assert not model.h[0].mlp.act._forward_hooks


def test_functional_takes_f_gelus_argument_names():
    x = _x()
    assert torch.equal(PF.gelu(input=x, approximate="tanh"), F.gelu(input=x, approximate="tanh"))


def _gemma():
    cfg = transformers.GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh")
    torch.manual_seed(0)
    return transformers.GemmaModel(cfg).eval()


@pytest.mark.parametrize("dry_run", [False, True])
def test_the_activation_of_a_fused_gated_mlp_is_left_alone(dry_run):
    """A GeGLU MLP fused by the same call keeps its act_fn without calling it: fuse() must not replace that (the
    fused MLP would take a replaced act_fn for one assigned since, and run it instead of its kernel)."""
    model = _gemma()
    acts = [layer.mlp.act_fn for layer in model.layers]
    report = fuse(model, dry_run=dry_run)
    assert not any(r.kind == "gelu" for r in report.rows), report
    assert report.not_requested.get("gelu") is None
    if not dry_run:
        assert all(isinstance(layer.mlp, FusedGeGLUMLP) for layer in model.layers)
        assert [layer.mlp.act_fn for layer in model.layers] == acts
        assert all(layer.mlp._changed_activation() is None for layer in model.layers)


def test_gelu_alone_fuses_a_gated_mlps_activation_when_the_mlp_is_left_out():
    """ops=["gelu"]: the GeGLU MLPs are not fused, so their act_fn (called by their forward) is, and the model
    computes the same."""
    model = _gemma()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).last_hidden_state
    report = fuse(model, ops=["gelu"])
    assert [r.path for r in report.rows] == ["layers.0.mlp.act_fn", "layers.1.mlp.act_fn"], report
    assert report.not_requested.get("geglu") == 2
    with torch.no_grad():
        got = model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    unfuse(model)
    assert not isinstance(model.layers[0].mlp.act_fn, FusedGELU)


def test_a_model_whose_gelu_is_shared_by_its_mlps_is_replaced_once():
    model = models.build("gpt2", "eager")
    shared = A.NewGELUActivation()
    for block in model.h:
        block.mlp.act = shared
    report = fuse(model, ops=["gelu"])
    assert [r.path for r in report.rows] == ["h.0.mlp.act"]
    assert _mlp_act(model, 0) is _mlp_act(model, 1) and isinstance(_mlp_act(model, 0), FusedGELU)
    unfuse(model)
    assert _mlp_act(model, 0) is shared and _mlp_act(model, 1) is shared


def _mixtral_gelu():
    cfg = transformers.MixtralConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=64, vocab_size=100, num_local_experts=4,
                                     num_experts_per_tok=2, hidden_act="gelu")
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg).eval()


def test_a_shared_activation_is_not_swapped_into_fused_experts_or_mlps():
    """An activation module that a fused gated module keeps (not calls) and another module shares: the fused
    module's stays its own (swapped in, it would be taken for an activation assigned since, and its kernel would no
    longer run); the other user's is fused."""
    model = _mixtral_gelu()
    experts = model.model.layers[0].mlp.experts
    act = experts.act_fn
    model.extra_act = act   # (a plain user of the same object, after the experts in named_modules' order)
    report = fuse(model)
    assert experts.act_fn is act, report
    assert isinstance(model.extra_act, FusedGELU) and [r.path for r in report.rows if r.kind == "gelu"] == [
        "extra_act"]
    unfuse(model)
    assert model.extra_act is act and experts.act_fn is act
    gemma = _gemma()
    shared = gemma.layers[0].mlp.act_fn
    gemma.layers[1].mlp.act_fn = shared
    gemma.head_act = shared
    fuse(gemma)
    assert all(isinstance(layer.mlp, FusedGeGLUMLP) and layer.mlp.act_fn is shared for layer in gemma.layers)
    assert all(layer.mlp._changed_activation() is None for layer in gemma.layers)
    assert isinstance(gemma.head_act, FusedGELU)
    unfuse(gemma)
    assert gemma.head_act is shared


def test_the_experts_activation_is_fused_where_the_experts_are_not():
    """ops=["gelu"]: the experts keep their own gate (transformers' act_fn(gate) * up), whose act_fn runs op gelu."""
    model = _mixtral_gelu()
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    report = fuse(model, ops=["gelu"])
    assert [r.path for r in report.rows] == ["model.layers.0.mlp.experts.act_fn"], report
    with torch.no_grad():
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    unfuse(model)


def test_a_gated_mlp_whose_activation_an_earlier_fuse_replaced_is_skipped_and_unfuse_restores_everything():
    model = _gemma()
    act0 = model.layers[0].mlp.act_fn
    fuse(model, ops=["gelu"])
    assert isinstance(model.layers[0].mlp.act_fn, FusedGELU)
    report = fuse(model.layers[0], ops=["geglu"])
    row = next(r for r in report.rows if r.kind == "geglu")
    assert not row.fused and "FusedGELU of an earlier fuse()" in row.reason, row
    unfuse(model)
    assert model.layers[0].mlp.act_fn is act0 and not isinstance(model.layers[1].mlp.act_fn, FusedGELU)


def test_not_requested_counts_a_gated_mlps_activation_once_and_a_fused_copy_refuses_unfuse():
    report = fuse(_gemma(), ops=["layer_norm"], dry_run=True)
    assert report.not_requested.get("geglu") == 2 and "gelu" not in report.not_requested, report.not_requested
    import copy

    model = models.build("gpt2", "eager")
    fuse(model, ops=["gelu"])
    with pytest.raises(RuntimeError, match=r"holds fused modules \(h.0.mlp.act and 1 more\) but fuse\(\) has no "
                                           r"record"):
        unfuse(copy.deepcopy(model))
    unfuse(model)


def test_a_gelu_fused_by_an_earlier_call_is_held():
    model = models.build("gpt2", "eager")
    act = _mlp_act(model)
    fuse(model.h[0], ops=["gelu"])
    report = fuse(model, ops=["gelu", "layer_norm"])
    row = next(r for r in report.rows if r.path == "h.0.mlp.act")
    assert row.fused and row.kind == "gelu" and row.replacement == "FusedGELU" and "earlier fuse()" in row.reason
    assert "@1024 wide" in row.forward, row
    assert isinstance(_mlp_act(model, 1), FusedGELU)
    unfuse(model)
    assert _mlp_act(model) is act and not isinstance(_mlp_act(model, 1), FusedGELU)


def test_from_module_takes_a_gelu_of_any_name_and_checks_approximate_first():
    class Act(nn.Module):   # (fuse() looks only at classes named for GELU; from_module at the module given)
        def forward(self, x):
            return F.gelu(x)

    assert FusedGELU.from_module(Act()).approximate == "none"
    assert not matching.probe_gelu(Act()).candidate and "class name" in matching.probe_gelu(Act()).reason
    assert matching.probe_gelu(Act(), by_name=False).ok
    with pytest.raises(ValueError, match=r"approximate: expected 'none' \(exact GELU, erf\) or 'tanh'"):
        FusedGELU.from_module(A.NewGELUActivation(), approximate="erf")
    with pytest.raises(ValueError, match=r"act: Sequential does not pass the GELU probe: Sequential is not a leaf"):
        FusedGELU.from_module(nn.Sequential(nn.GELU()))


def test_the_gelu_of_experts_left_out_of_ops_is_not_counted_again():
    report = fuse(_mixtral_gelu(), ops=["rms_norm"], dry_run=True)
    assert report.not_requested.get("geglu") == 1 and "gelu" not in report.not_requested, report.not_requested
