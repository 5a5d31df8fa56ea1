"""fuse() and the gated-MLP probe on GeGLU MLPs (``down_proj(gelu(gate_proj(x)) * up_proj(x))``: transformers'
``GemmaMLP``, ``Gemma2MLP``, ``Gemma3MLP``), with transformers' own classes (tiny random configs, CPU): the probe
tells the activation (GELU with the tanh approximation: ``gelu_pytorch_tanh``, ``gelu_new``, ``gelu_fast``; exact
GELU: ``gelu``) and refuses others (QuickGELU, ReLU, GELU in one ``gate_up_proj``); fuse() puts ``FusedGeGLUMLP``
(op ``geglu``, kind ``geglu``) in their place, with the model's loss and gradients unchanged, and unfuse() restores
the MLPs. SwiGLU and GeGLU are not mixed up either way.
"""

from __future__ import annotations

import torch
import pytest
from torch import nn

from pipegoose.nn.fusion import dispatch, fuse, unfuse
from pipegoose.nn.fusion.fuse import DEFAULT_OPS, OPS, is_fused
from pipegoose.nn.fusion.modules import FusedGeGLUMLP, FusedSwiGLUMLP
from pipegoose.nn.fusion.transformers.matching import probe_swiglu_mlp

from . import models

tr = pytest.importorskip("transformers")

HIDDEN, INTER = 32, 64
# transformers' activation name -> what the probe finds
GELUS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu"}


def _gemma(hidden_act="gelu_pytorch_tanh", layers=2, seed=0):
    """A tiny GemmaForCausalLM whose MLPs' act_fn is ``ACT2FN[hidden_act]`` (set on the modules: GemmaConfig turns a
    hidden_act of "gelu", its legacy value, into gelu_pytorch_tanh)."""
    from transformers.activations import ACT2FN

    torch.manual_seed(seed)
    model = tr.GemmaForCausalLM(tr.GemmaConfig(vocab_size=97, hidden_size=HIDDEN, num_hidden_layers=layers,
                                               num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                                               intermediate_size=INTER, attn_implementation="eager"))
    for mlp in _mlps(model):
        mlp.act_fn = ACT2FN[hidden_act]
    return model


def _gemma3(layers=2, seed=0):
    torch.manual_seed(seed)
    return tr.Gemma3ForCausalLM(tr.Gemma3TextConfig(vocab_size=97, hidden_size=HIDDEN, num_hidden_layers=layers,
                                                    num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                                                    intermediate_size=INTER, attn_implementation="eager"))


def _mlps(model):
    return [layer.mlp for layer in model.model.layers]


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 97, (2, 9), generator=g)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)


def _loss_and_grads(model):
    model.zero_grad(set_to_none=True)
    loss = model(**_batch()).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# ------------------------------------------------------------------------------------------------------- the probe
@pytest.mark.parametrize("act", list(GELUS))
def test_the_probe_takes_gemmas_mlp_with_each_gelu(act):
    """GemmaMLP with gelu_pytorch_tanh (Gemma's), gelu_new and gelu_fast (the tanh form within fp32 rounding) and gelu
    (exact): a GeGLU MLP, with its approximation; FusedGeGLUMLP.from_module computes the MLP's output."""
    mlp = _mlps(_gemma(act, layers=1))[0]
    probe = probe_swiglu_mlp(mlp)
    assert probe.ok and probe.candidate and not probe.packed, probe
    assert probe.activation == GELUS[act] and probe.approximate == ("none" if act == "gelu" else "tanh")
    assert probe.reason == f"probe output equals down_proj({GELUS[act]}(gate_proj(x)) * up_proj(x))"
    fused = FusedGeGLUMLP.from_module(mlp)
    assert fused.approximate == probe.approximate
    x = torch.randn(2, 5, HIDDEN) * 3
    want = mlp(x)
    if act in ("gelu_pytorch_tanh", "gelu"):   # (the same F.gelu on the CPU: bit for bit)
        assert torch.equal(fused(x), want)
    torch.testing.assert_close(fused(x), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("module,cls,cfg", [("gemma2", "Gemma2MLP", "Gemma2Config"),
                                            ("gemma3", "Gemma3MLP", "Gemma3TextConfig")])
def test_the_probe_takes_gemma2s_and_gemma3s_mlps(module, cls, cfg):
    mod = pytest.importorskip(f"transformers.models.{module}.modeling_{module}")
    mlp = getattr(mod, cls)(getattr(tr, cfg)(hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=4,
                                             num_key_value_heads=1, head_dim=8))
    probe = probe_swiglu_mlp(mlp)
    assert probe.ok and probe.activation == "gelu_tanh", probe
    x = torch.randn(2, 5, HIDDEN)
    assert torch.equal(FusedGeGLUMLP.from_module(mlp)(x), mlp(x))


@pytest.mark.parametrize("act,name", [("quick_gelu", "QuickGELUActivation"), ("relu", "ReLU"),
                                      ("gelu_10", "ClippedGELUActivation")])
def test_the_probe_refuses_a_gated_mlp_of_another_activation(act, name):
    """QuickGELU, ReLU and a GELU clipped at 10 are neither SiLU nor GELU: refused with the reason, by the probe, by
    both fused modules and by fuse() (a skipped, not eligible row; the MLP is kept)."""
    model = _gemma(act, layers=1)
    mlp = _mlps(model)[0]
    probe = probe_swiglu_mlp(mlp)
    assert probe.candidate and not probe.ok, probe
    assert f"act_fn ({name}) is not SiLU or GELU (exact or tanh)" in probe.reason, probe
    for cls in (FusedGeGLUMLP, FusedSwiGLUMLP):
        with pytest.raises(ValueError, match=r"does not pass the (GeGLU|SwiGLU) probe: act_fn .* is not SiLU or GELU"):
            cls.from_module(mlp)
    report = fuse(model)
    (row,) = [r for r in report.rows if r.path == "model.layers.0.mlp"]
    assert not row.fused and not row.eligible and row.replacement is None and row.reason == probe.reason
    assert _mlps(model)[0] is mlp
    assert unfuse(model)


def test_swiglu_and_geglu_are_not_mixed_up():
    """A Llama MLP (SiLU) is SwiGLU, kind swiglu, FusedSwiGLUMLP; a Gemma MLP GeGLU, kind geglu, FusedGeGLUMLP; each
    fused module refuses the other's MLP, naming the right one."""
    llama = models.build("llama", "eager")
    gemma = _gemma()
    llama_mlp, gemma_mlp = llama.layers[0].mlp, _mlps(gemma)[0]
    assert probe_swiglu_mlp(llama_mlp).activation == "silu" and probe_swiglu_mlp(llama_mlp).approximate is None
    with pytest.raises(ValueError, match=r"^mlp: LlamaMLP does not pass the GeGLU probe: act_fn \(\w+\) computes SiLU, "
                                         r"not GELU: a SwiGLU MLP, which FusedSwiGLUMLP.from_module takes"):
        FusedGeGLUMLP.from_module(llama_mlp)
    with pytest.raises(ValueError, match=r"^mlp: GemmaMLP does not pass the SwiGLU probe: act_fn \(GELUTanh\) is not "
                                         r"SiLU but GELU \(approximate='tanh'\): a GeGLU MLP, which FusedGeGLUMLP"):
        FusedSwiGLUMLP.from_module(gemma_mlp)
    for model, kind, cls, other in ((llama, "swiglu", FusedSwiGLUMLP, "geglu"),
                                    (gemma, "geglu", FusedGeGLUMLP, "swiglu")):
        report = fuse(model)
        rows = [r for r in report.rows if r.kind in ("swiglu", "geglu")]
        assert len(rows) == 2 and {r.kind for r in rows} == {kind}, rows
        assert all(r.fused and r.replacement == cls.__name__ for r in rows), rows
        assert all(type(m) is cls for m in model.modules() if isinstance(m, (FusedSwiGLUMLP, FusedGeGLUMLP)))
        assert unfuse(model)


def test_a_geglu_mlp_with_gate_and_up_in_one_projection_is_refused_with_the_reason():
    """Phi3MLP (gate_up_proj) with GELU: no fused module takes a GeGLU MLP of a packed projection; a skipped geglu row
    saying so (geglu, as GELU MoE experts are: ops=["geglu"] lists it), the MLP kept."""
    torch.manual_seed(0)
    model = tr.Phi3ForCausalLM(tr.Phi3Config(vocab_size=97, hidden_size=HIDDEN, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2, intermediate_size=INTER,
                                             hidden_act="gelu_pytorch_tanh", pad_token_id=None,
                                             attn_implementation="eager"))
    mlp = model.model.layers[0].mlp
    probe = probe_swiglu_mlp(mlp)
    assert probe.packed and not probe.ok and probe.activation == "gelu_tanh", probe
    assert ("activation_fn (GELUTanh) is not SiLU but GELU (approximate='tanh'): a GeGLU MLP with gate and up in one "
            "gate_up_proj, for which there is no fused module (FusedGateUpSwiGLUMLP computes SiLU)") in probe.reason
    report = fuse(model)
    (row,) = [r for r in report.rows if r.path == "model.layers.0.mlp"]
    assert (row.kind, row.fused, row.eligible, row.reason) == ("geglu", False, False, probe.reason)
    assert model.model.layers[0].mlp is mlp
    assert unfuse(model)
    assert [r.path for r in fuse(model, ops=["geglu"], dry_run=True).rows] == ["model.layers.0.mlp"]
    assert "model.layers.0.mlp" not in [r.path for r in fuse(model, ops=["swiglu"], dry_run=True).rows]


# ------------------------------------------------------------------------------------------------------- fuse()
@pytest.mark.parametrize("build", [_gemma, _gemma3], ids=["gemma", "gemma3"])
def test_fuse_gemma_keeps_loss_gradients_and_state_dict_in_fp32(build):
    """fuse() of a tiny Gemma / Gemma 3 (text) causal LM: every MLP becomes a FusedGeGLUMLP (kind geglu, op geglu,
    approximate 'tanh') over the same modules; loss and every gradient equal the unfused model's (fp32, tight: the CPU
    runs the reference path, F.gelu(gate, approximate='tanh') * up, one geglu call per layer); state_dict keys and
    tensors unchanged; unfuse() puts the same MLP objects back."""
    model = build()
    mlps = _mlps(model)
    keys = list(model.state_dict())
    loss0, grads0 = _loss_and_grads(model)
    report = fuse(model)
    rows = [r for r in report.rows if r.kind == "geglu"]
    assert [r.path for r in rows] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    for r, mlp in zip(rows, mlps):
        assert r.fused and r.eligible and r.replacement == "FusedGeGLUMLP" and r.original == type(mlp).__name__
        assert "op geglu, approximate='tanh'" in r.reason and (r.forward, r.backward) == ("torch (fallback)",) * 2
    fused = _mlps(model)
    assert all(type(f) is FusedGeGLUMLP and f.approximate == "tanh" for f in fused)
    assert all(f.gate_proj is m.gate_proj and f.down_proj is m.down_proj for f, m in zip(fused, mlps))
    assert list(model.state_dict()) == keys
    dispatch.reset_stats()
    loss1, grads1 = _loss_and_grads(model)
    assert dispatch.stats()["geglu"] == {"torch": 2}
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-7)
    assert grads1.keys() == grads0.keys()
    for n in grads0:
        torch.testing.assert_close(grads1[n], grads0[n], rtol=1e-5, atol=1e-7, msg=lambda m: f"{n}: {m}")
    assert unfuse(model) and not is_fused(model)
    assert _mlps(model) == mlps and list(model.state_dict()) == keys


@pytest.mark.parametrize("build", [_gemma, _gemma3], ids=["gemma", "gemma3"])
def test_fuse_gemma_in_bf16(build):
    """The same in bf16 (loose: a bf16 model's loss and gradients, fused against unfused)."""
    model = build().to(torch.bfloat16)
    loss0, grads0 = _loss_and_grads(model)
    fuse(model)
    assert all(type(m) is FusedGeGLUMLP for m in _mlps(model))
    loss1, grads1 = _loss_and_grads(model)
    torch.testing.assert_close(loss1.float(), loss0.float(), rtol=2e-2, atol=2e-2)
    for n in grads0:
        torch.testing.assert_close(grads1[n].float(), grads0[n].float(), rtol=5e-2, atol=5e-3,
                                   msg=lambda m: f"{n}: {m}")
    assert unfuse(model)


def test_an_exact_gelu_gemma_is_fused_with_approximate_none():
    model = _gemma("gelu")
    loss0, _ = _loss_and_grads(model)
    report = fuse(model)
    assert all("approximate='none'" in r.reason for r in report.fused_rows("geglu"))
    assert all(m.approximate == "none" for m in _mlps(model))
    loss1, _ = _loss_and_grads(model)
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-7)
    assert unfuse(model)


def test_ops_choose_geglu_apart_from_swiglu():
    """geglu is a kind of its own, in the default: ops=["swiglu"] leaves Gemma's MLPs (counted as not requested),
    ops=["geglu"] fuses them and leaves a Llama's SwiGLU MLPs; a dry run changes nothing."""
    assert "geglu" in OPS and "geglu" in DEFAULT_OPS
    gemma = _gemma()
    mlps = _mlps(gemma)
    report = fuse(gemma, ops=["swiglu"])
    assert not [r for r in report.rows if r.kind in ("swiglu", "geglu")]
    assert report.not_requested["geglu"] == 2 and "swiglu" not in report.not_requested
    assert _mlps(gemma) == mlps and not is_fused(gemma)
    note = " ".join(str(report).split())
    assert "2 geglu" in note and "all of layer_norm, rms_norm, swiglu, geglu, gelu, squared_relu, rope" in note, note
    report = fuse(gemma, ops=["geglu"], dry_run=True)
    assert len(report.fused_rows("geglu")) == 2 and _mlps(gemma) == mlps and not is_fused(gemma)
    report = fuse(gemma, ops="GeGLU")   # (any case, as the other kinds)
    assert len(report.fused_rows("geglu")) == 2 and all(type(m) is FusedGeGLUMLP for m in _mlps(gemma))
    assert unfuse(gemma) and _mlps(gemma) == mlps
    llama = models.build("llama", "eager")
    report = fuse(llama, ops=["geglu"])
    assert report.not_requested["swiglu"] == 2 and "geglu" not in report.not_requested
    assert not report.rows and not is_fused(llama)
    assert all(type(layer.mlp).__name__ == "LlamaMLP" for layer in llama.layers)


def test_a_geglu_mlp_fused_before_is_held():
    """A Gemma layer fused on its own, then the model: the layer's MLP is a held geglu row (the earlier call's), and
    unfuse() of the model reverts both."""
    model = _gemma()
    mlps = _mlps(model)
    fuse(model.model.layers[0])
    report = fuse(model)
    rows = {r.path: r for r in report.rows if r.kind == "geglu"}
    assert rows["model.layers.0.mlp"].fused and "fused by an earlier fuse()" in rows["model.layers.0.mlp"].reason
    assert rows["model.layers.0.mlp"].forward == "torch (fallback)"
    assert rows["model.layers.1.mlp"].fused and rows["model.layers.1.mlp"].replacement == "FusedGeGLUMLP"
    assert unfuse(model) and _mlps(model) == mlps


def test_an_mlp_with_an_extra_child_is_skipped_with_the_reason():
    model = _gemma()
    odd = _mlps(model)[0]
    odd.dropout = nn.Dropout(0.1)
    report = fuse(model, ops=["geglu"])
    rows = {r.path: r for r in report.rows if r.kind in ("geglu", "swiglu")}
    assert not rows["model.layers.0.mlp"].fused
    assert "besides the projections and act_fn or activation_fn (dropout)" in rows["model.layers.0.mlp"].reason
    assert rows["model.layers.1.mlp"].fused and rows["model.layers.1.mlp"].kind == "geglu"
    assert _mlps(model)[0] is odd and unfuse(model)


# ------------------------------------------------------------------------------------- review fixes (session 66)
class _FnMLP(nn.Module):
    """A gated MLP whose activation is a plain function attribute (``self.act_fn = F.gelu``), no submodule."""

    def __init__(self, act):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=False)
        self.act_fn = act

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_an_activation_that_differs_in_training_mode_is_refused_in_either_mode(training):
    """An act_fn with a dropout inside (GELU, then Dropout): checked in one mode only, it passed in eval mode (where
    from_pretrained leaves a model), and the fused module, which does not call it, then dropped its dropout in
    training. It is checked in both modes now, and its modes (and its submodules') are left as they were."""
    model = _gemma()
    mlp = _mlps(model)[0]
    mlp.act_fn = nn.Sequential(nn.GELU(approximate="tanh"), nn.Dropout(0.5))
    model.train(training)
    probe = probe_swiglu_mlp(mlp)
    assert not probe.ok and "act_fn" in probe.reason and "not SiLU or GELU" in probe.reason
    assert all(m.training == training for m in mlp.act_fn.modules())
    report = fuse(model)
    assert not isinstance(_mlps(model)[0], FusedGeGLUMLP) and isinstance(_mlps(model)[1], FusedGeGLUMLP)
    assert any(not r.fused and "act_fn" in r.reason for r in report.rows if r.kind in ("geglu", "swiglu"))
    unfuse(model)


@pytest.mark.parametrize("act, kind", [(torch.nn.functional.gelu, "gelu"),
                                       (lambda t: torch.nn.functional.gelu(t, approximate="tanh"), "gelu_tanh"),
                                       (torch.nn.functional.silu, "silu")], ids=["F.gelu", "tanh lambda", "F.silu"])
def test_an_activation_held_as_a_function_attribute_is_classified(act, kind):
    """``self.act_fn = F.gelu`` (no submodule): a GeGLU MLP, fused as one with the function's approximation (it was
    taken for SiLU and refused as a SwiGLU MLP that differs from the formula); F.silu stays SwiGLU."""
    torch.manual_seed(0)
    mlp = _FnMLP(act)
    probe = probe_swiglu_mlp(mlp)
    assert probe.ok and probe.activation == kind, probe.reason
    cls = FusedSwiGLUMLP if kind == "silu" else FusedGeGLUMLP
    fused = cls.from_module(mlp)
    x = torch.randn(2, 3, HIDDEN)
    torch.testing.assert_close(fused(x), mlp(x), rtol=1e-5, atol=1e-6)
    root = nn.Sequential(_FnMLP(act))
    report = fuse(root)
    assert [(r.kind, r.fused) for r in report.rows] == [("swiglu" if kind == "silu" else "geglu", True)]
    unfuse(root)


def test_a_function_attribute_of_another_activation_is_refused_with_its_reason():
    probe = probe_swiglu_mlp(_FnMLP(torch.relu))
    assert not probe.ok and "act_fn (builtin_function_or_method) is not SiLU or GELU" in probe.reason


@pytest.mark.parametrize("approximate, error", [(1, TypeError), ("bad", ValueError), ("", ValueError)])
def test_from_module_checks_approximate_before_comparing_it(approximate, error):
    """A bad approximate is the constructor's TypeError / ValueError, with verify on too (it was a ValueError saying
    that the MLP's GELU differs)."""
    with pytest.raises(error, match=r"approximate: expected 'none'"):
        FusedGeGLUMLP.from_module(_mlps(_gemma())[0], approximate=approximate)


def test_a_backward_hook_on_gemmas_act_fn_is_refused_or_run():
    """The same for FusedGeGLUMLP: refused with a backward hook on act_fn; one added after fuse fires."""
    calls = []
    model = _gemma()
    mlp = _mlps(model)[0]
    mlp.act_fn.register_full_backward_hook(lambda *a: calls.append(1))
    assert not probe_swiglu_mlp(mlp).ok
    fused = FusedGeGLUMLP.from_module(_mlps(_gemma())[1])
    fused.act_fn.register_full_backward_hook(lambda *a: calls.append(1))
    x = torch.randn(2, 3, HIDDEN, requires_grad=True)
    fused(x).sum().backward()
    assert calls == [1]


@pytest.mark.parametrize("where", ["default_bf16", "cpu_autocast", "meta_device"])
def test_the_probes_compute_as_outside_the_callers_dtype_autocast_and_device(where):
    """A review: under ``torch.set_default_dtype(torch.bfloat16)`` (Lightning's bf16-true init) or CPU autocast the
    gated-MLP probe's stand-in computed in bf16 and refused Gemma's MLPs ("act_fn is not SiLU or GELU", or "output
    differs"), reported as kind swiglu; inside ``torch.device("meta")`` the RMSNorm probe raised. The probes now run
    in fp32 on the CPU outside autocast (matching.probe_isolated): every module is fused as outside, and the fused
    model computes the unfused one's logits."""
    import contextlib

    model = _gemma()
    ids = _batch()["input_ids"]
    with torch.no_grad():
        want = model(input_ids=ids).logits
    old = torch.get_default_dtype()
    ctx = {"cpu_autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
           "meta_device": lambda: torch.device("meta")}.get(where, contextlib.nullcontext)
    try:
        if where == "default_bf16":
            torch.set_default_dtype(torch.bfloat16)
        with ctx():
            report = fuse(model)
    finally:
        torch.set_default_dtype(old)
    rows = {r.path: r for r in report.rows}
    for i in range(2):
        row = rows[f"model.layers.{i}.mlp"]
        assert (row.kind, row.fused) == ("geglu", True), row
        assert rows[f"model.layers.{i}.input_layernorm"].fused
    assert isinstance(model.model.layers[0].mlp, FusedGeGLUMLP)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, want)
    assert unfuse(model)


def test_fuse_inside_init_empty_weights_says_so_and_changes_nothing(monkeypatch):
    """A review: inside accelerate's ``init_empty_weights`` (it patches ``nn.Module.register_parameter`` so that each
    parameter registered is replaced by a meta copy) fuse raised "FusedRMSNorm built from GemmaRMSNorm does not reuse
    its parameters (['weight'] -> ['weight'])". Now, with a norm kind in ops, it says why before changing anything;
    a dry run still reports, and the kinds without parameters of their own fuse there. The patch is made here as
    accelerate makes it (the test does not need accelerate)."""
    model = _gemma()
    before = {n: type(m) for n, m in model.named_modules()}
    register = nn.Module.register_parameter

    def to_meta(self, name, param):
        register(self, name, param)
        if param is not None:
            self._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    monkeypatch.setattr(nn.Module, "register_parameter", to_meta)
    with pytest.raises(RuntimeError, match=r"init_empty_weights.*fused norms \(layer_norm, rms_norm\).*"
                                           r"call fuse\(model\) outside it, or leave them out of ops"):
        fuse(model)
    assert {n: type(m) for n, m in model.named_modules()} == before and not is_fused(model)
    assert any(r.kind == "geglu" for r in fuse(model, dry_run=True).rows)
    # the kinds without parameters of their own fuse there as outside (a review: all were refused)
    ids = _batch()["input_ids"]
    with torch.no_grad():
        want = model(input_ids=ids).logits
    report = fuse(model, ops=["geglu", "rope", "cross_entropy"])
    assert isinstance(model.model.layers[0].mlp, FusedGeGLUMLP) and report.rows
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, want)
    assert unfuse(model)
    monkeypatch.undo()
    assert fuse(model).rows and isinstance(model.model.layers[0].mlp, FusedGeGLUMLP)
    assert unfuse(model)
