"""fuse() and the SwiGLU probe on gated MLPs that are not plain SwiGLU, with transformers' own classes (tiny configs):

* clamped SwiGLU (``swiglu_limit``: DeepseekV4, Glm5Next, Step3p7, BailingHybrid): the probe ran inputs whose gate
  stayed below ~5, so a clamp at 7 or 10 never showed, and fuse() put an unclamped FusedSwiGLUMLP in their place
  (silently wrong results for activations past the limit). Now they are skipped with the reason, or, where the clamp
  is off (a zero limit), fused with results equal to the module's, large activations included;
* gate and up in one ``gate_up_proj`` (Phi-3, GLM): no row at all, so the report said nothing of the MLP; then a
  skipped row; now fused (``FusedGateUpSwiGLUMLP``, op ``swiglu.packed``) after the same probe, and refused with the
  reason where it is not plain SwiGLU (Zamba2's GELU MLP, MiniMax-M3's clamped one, other submodules, ...).
"""

from __future__ import annotations


import pytest
import torch
from torch import nn

from pipegoose.nn.fusion import fuse, unfuse
from pipegoose.nn.fusion.fuse import is_fused
from pipegoose.nn.fusion.modules import FusedGateUpSwiGLUMLP, FusedSwiGLUMLP
from pipegoose.nn.fusion.transformers.matching import probe_swiglu_mlp

from . import models

HIDDEN, INTER = 32, 64


_from = models.transformers_attr


def _cls(module: str, name: str):
    return _from(module, "modeling", name)


def _config(module: str, cls: str, **kw):
    return _from(module, "configuration", cls)(**kw)


def _deepseek_v4(limit=10.0):
    cfg = _config("deepseek_v4", "DeepseekV4Config", hidden_size=HIDDEN, intermediate_size=INTER,
                  num_hidden_layers=2, swiglu_limit=limit)
    return _cls("deepseek_v4", "DeepseekV4MLP")(cfg)


def _glm5_next_text(limit=10.0):
    cfg = _config("glm5_next", "Glm5NextTextConfig", hidden_size=HIDDEN, intermediate_size=INTER,
                  num_hidden_layers=2, swiglu_limit=limit)
    return _cls("glm5_next", "Glm5NextTextMLP")(cfg)


def _glm5_next_vision(limit=10.0):
    cfg = _config("glm5_next", "Glm5NextVisionConfig", hidden_size=HIDDEN, intermediate_size=INTER, depth=2,
                  swiglu_limit=limit)
    return _cls("glm5_next", "Glm5NextVisionMLP")(cfg)


def _step3p7(limits=(0, 7.0), layer=1):
    cfg = _config("step3p7", "Step3p7TextConfig", hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
                  share_expert_dim=48, swiglu_limits_shared=list(limits))
    return _cls("step3p7", "Step3p7MLP")(cfg, layer, is_shared_expert=True)


def _bailing_hybrid(limits=(0, 7.0), layer=1):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    _cls("bailing_hybrid", "BailingHybridMLP")
    cfg = CONFIG_MAPPING["bailing_hybrid"](hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
                                           swiglu_limits_shared=list(limits))
    return _cls("bailing_hybrid", "BailingHybridMLP")(cfg, layer_idx=layer)


CLAMPED = {
    "deepseek_v4": (_deepseek_v4, "limit=10.0"),   # DeepseekV4MLP keeps config.swiglu_limit as self.limit
    "glm5_next_text": (_glm5_next_text, "swiglu_limit=10.0"),
    "glm5_next_vision": (_glm5_next_vision, "swiglu_limit=10.0"),
    "step3p7": (_step3p7, "limit=7.0"),
    "bailing_hybrid": (_bailing_hybrid, "limit=7.0"),
}


def _large_input(seed=0, rows=4):
    """Activations well past any clamp: gate and up of tens (the weights are nn.Linear's, ~1/sqrt(32))."""
    return torch.randn(rows, 5, HIDDEN, generator=torch.Generator().manual_seed(seed)) * 40.0


def _skipped_row(mlp, fused_cls=FusedGateUpSwiGLUMLP, kind="swiglu"):
    """fuse() of a holder of ``mlp`` (ops ``kind``: geglu for a GELU MLP) on activations past any clamp: the single
    row, which must be a skipped, not eligible row of that kind, shown in the report; the holder keeps ``mlp`` and
    computes what it computed (in eval mode: no dropout draws); ``fused_cls.from_module`` refuses it. Returns the row
    and the report's text."""
    holder = nn.Sequential(mlp).eval()
    x = _large_input()
    with torch.no_grad():
        ref = holder(x)
        report = fuse(holder, ops=[kind])
        out = holder(x)
    (row,) = report.rows
    assert (row.kind, row.original, row.replacement, row.fused, row.eligible) == (
        kind, type(mlp).__name__, None, False, False), row
    assert holder[0] is mlp and not is_fused(holder) and torch.equal(out, ref)
    with pytest.raises(ValueError, match=r"does not pass the SwiGLU probe: "):
        fused_cls.from_module(mlp)
    return row, str(report)


@pytest.mark.parametrize("name", list(CLAMPED))
def test_clamped_swiglu_mlps_of_transformers_are_skipped_with_the_reason(name):
    """A review: DeepseekV4MLP (swiglu_limit 10) passed the probe, whose gate stayed below ~5, and fused, gave 2.7 off
    on activations past the limit. Each clamped MLP is now refused (the probe and FusedSwiGLUMLP.from_module), fuse()
    gives it a skipped row with the reason (not eligible, as every MLP the probe refuses) and leaves it in place: the
    holder computes what it computed."""
    make, limit = CLAMPED[name]
    torch.manual_seed(0)
    mlp = make()
    probe = probe_swiglu_mlp(mlp)
    assert probe.candidate and not probe.ok, probe
    assert f"clamps gate and up at {limit}: not plain SwiGLU" in probe.reason, probe.reason
    with pytest.raises(ValueError, match="not plain SwiGLU"):
        FusedSwiGLUMLP.from_module(mlp)
    row, text = _skipped_row(mlp, FusedSwiGLUMLP)
    assert "not plain SwiGLU" in row.reason and limit in row.reason, row.reason
    assert row.reason in text


@pytest.mark.parametrize("name", ["step3p7", "bailing_hybrid"])
def test_an_mlp_whose_clamp_is_off_is_fused_and_exact_on_large_activations(name):
    """Step3p7MLP / BailingHybridMLP with a zero per-layer limit (their "no clamp") are plain SwiGLU: fused, with the
    module's results on activations of tens, and put back by unfuse()."""
    make, _ = CLAMPED[name]
    torch.manual_seed(0)
    mlp = make(limits=(0, 7.0), layer=0)
    assert mlp.limit is None
    assert probe_swiglu_mlp(mlp).ok
    holder = nn.Sequential(mlp)
    x = _large_input(seed=1)
    with torch.no_grad():
        ref = holder(x)
        report = fuse(holder, ops=["swiglu"])
        out = holder(x)
    (row,) = report.rows
    assert row.fused and type(holder[0]) is FusedSwiGLUMLP, row
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-5)
    assert unfuse(holder) and holder[0] is mlp


def test_the_hy_v4_mlp_whose_config_limits_only_the_experts_is_fused():
    """HYV4Config sets swiglu_limit (10.0) for its experts; HYV4MLP (the shared expert) does not clamp: fused, exact."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = _cls("hy_v4", "HYV4MLP")
    cfg = CONFIG_MAPPING["hy_v4"](hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2)
    assert getattr(cfg, "swiglu_limit", None) is not None
    torch.manual_seed(0)
    holder = nn.Sequential(cls(cfg))
    x = _large_input(seed=2)
    with torch.no_grad():
        ref = holder(x)
        report = fuse(holder, ops=["swiglu"])
        out = holder(x)
    assert report.rows[0].fused, report.rows
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-5)


class _HardClamp(nn.Module):
    """A SwiGLU MLP clamping gate and up at a constant in its forward, with no attribute naming the limit: only the
    probe's values can find it."""

    def __init__(self, limit, after_act=False):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 12), nn.Linear(8, 12), nn.Linear(12, 8)
        self.act_fn = nn.SiLU()
        self.c, self.after_act = limit, after_act

    def forward(self, x):
        if self.after_act:     # Step3p7's order: the activation, then the clamp
            return self.down_proj(self.act_fn(self.gate_proj(x)).clamp(max=self.c)
                                  * self.up_proj(x).clamp(-self.c, self.c))
        return self.down_proj(self.act_fn(self.gate_proj(x).clamp(max=self.c)) * self.up_proj(x).clamp(-self.c, self.c))


class _GateUpHardClamp(nn.Module):
    """_HardClamp with gate and up in one gate_up_proj."""

    def __init__(self, limit, after_act=False):
        super().__init__()
        self.gate_up_proj, self.down_proj = nn.Linear(8, 24), nn.Linear(12, 8)
        self.activation_fn = nn.SiLU()
        self.c, self.after_act = limit, after_act

    def _bound(self):
        return self.c

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        c = self._bound()
        if self.after_act:
            return self.down_proj(self.activation_fn(gate).clamp(max=c) * up.clamp(-c, c))
        return self.down_proj(self.activation_fn(gate.clamp(max=c)) * up.clamp(-c, c))


class _ClampedSiLU(nn.Module):
    def __init__(self, limit):
        super().__init__()
        self.c = limit

    def forward(self, x):
        return nn.functional.silu(x.clamp(-self.c, self.c))


class _UpOnlyClamp(nn.Module):
    """Up clamped from below only: a negative up of tens shows it."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 12), nn.Linear(8, 12), nn.Linear(12, 8)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * torch.maximum(self.up_proj(x), torch.tensor(-30.0)))


@pytest.mark.parametrize("limit", [6.0, 10.0, 20.0, 40.0])
@pytest.mark.parametrize("after_act", [False, True], ids=["clamp_then_silu", "silu_then_clamp"])
def test_the_probe_reaches_activations_past_any_plausible_clamp(limit, after_act):
    """The probe's gate and up reach tens of either sign: a clamp at 6..40 that no attribute names changes its output,
    gate and up in one gate_up_proj too."""
    probe = probe_swiglu_mlp(_HardClamp(limit, after_act))
    assert probe.candidate and not probe.ok and "differs from down_proj(silu(gate_proj(x)) * up_proj(x))" in \
        probe.reason, probe
    probe = probe_swiglu_mlp(_GateUpHardClamp(limit, after_act))
    assert probe.candidate and probe.packed and not probe.ok and "differs from down_proj(silu(gate) * up) with gate, up" \
        " = gate_up_proj(x).chunk(2, -1)" in probe.reason, probe
    probe = probe_swiglu_mlp(_UpOnlyClamp())
    assert not probe.ok and "differs" in probe.reason, probe


@pytest.mark.parametrize("limit", [8.0, 30.0])
def test_an_act_fn_that_clamps_past_six_is_not_silu(limit):
    """The act_fn check ran inputs in [-6, 6] only: a SiLU of a clamped input passed it (Phi-3's activation_fn is
    checked so too)."""
    mlp = _HardClamp(1e9)
    mlp.act_fn = _ClampedSiLU(limit)
    probe = probe_swiglu_mlp(mlp)
    assert not probe.ok and "act_fn (_ClampedSiLU) is not SiLU" in probe.reason, probe
    mlp = _GateUpHardClamp(1e9)
    mlp.activation_fn = _ClampedSiLU(limit)
    probe = probe_swiglu_mlp(mlp)
    assert not probe.ok and "activation_fn (_ClampedSiLU) is not SiLU" in probe.reason, probe


class _ConfigLimited(nn.Module):
    """Reads its limit from its config (no attribute of its own)."""

    def __init__(self, limit):
        super().__init__()
        import types

        self.config = types.SimpleNamespace(swiglu_limit=limit)
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 12), nn.Linear(8, 12), nn.Linear(12, 8)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        lim = self.config.swiglu_limit
        return self.down_proj(self.act_fn(self.gate_proj(x).clamp(max=lim)) * self.up_proj(x).clamp(-lim, lim))


class _GateUpConfigLimited(_GateUpHardClamp):
    """_ConfigLimited with gate and up in one gate_up_proj (its forward's source names the clamp)."""

    def __init__(self, limit):
        super().__init__(None)
        import types

        self.config = types.SimpleNamespace(swiglu_limit=limit)

    def _bound(self):
        return self.config.swiglu_limit


@pytest.mark.parametrize("make", [_ConfigLimited, _GateUpConfigLimited])
def test_an_mlp_clamping_at_its_config_limit_is_refused_up_front(make):
    """A limit no plausible activation reaches (1e6): the probe's output cannot show it; the config's swiglu_limit,
    which the forward reads, does."""
    probe = probe_swiglu_mlp(make(1e6))
    assert not probe.ok and "clamps gate and up at config.swiglu_limit=1000000.0: not plain SwiGLU" in probe.reason, \
        probe


# ------------------------------------------------------------------------------------ gate and up in one projection
GATE_UP_TYPES = ["phi3", "glm", "glm4"]   # Phi3MLP (Phi-3, Phi-4-mini), GlmMLP, Glm4MLP


def _gate_up_lm(model_type: str, dtype=torch.float32, **extra):
    """A tiny causal LM of ``model_type`` (transformers' own classes, 2 layers; a skip where this transformers lacks
    it) and its MLPs by path."""
    from transformers import AutoModelForCausalLM

    cfg = models.rope_config(model_type, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval().to(dtype)
    mlps = {p: m for p, m in model.named_modules() if type(m).__name__.endswith("MLP")}
    assert len(mlps) == 2 and all(hasattr(m, "gate_up_proj") for m in mlps.values()), mlps
    return model, mlps


def _lm_step(model, seed=3):
    """Forward and backward of the causal-LM loss on random ids: (logits, loss, gradients by name)."""
    ids = torch.randint(3, models.VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("model_type", GATE_UP_TYPES)
def test_a_gate_up_proj_mlp_is_fused_exactly_and_unfused(model_type, dtype):
    """Phi3MLP / GlmMLP / Glm4MLP (one gate_up_proj, then SiLU of the first half times the second) had a skipped row;
    now fuse() puts a FusedGateUpSwiGLUMLP in their place: the same children (activation_fn too, held, not called),
    paths, Parameters and state_dict keys; a row of kind swiglu, fused and eligible, whose columns are op
    swiglu.packed's choice; on the CPU the reference path (silu_and_mul through the dispatcher, one call a layer) gives
    the unfused model's logits, loss and gradients bit for bit; unfuse() puts the very same modules back."""
    from pipegoose.nn.fusion import dispatch

    model, mlps = _gate_up_lm(model_type, dtype)
    before = dict(model.named_modules())
    params = [(n, id(p)) for n, p in model.named_parameters()]
    sd = model.state_dict()
    ref = _lm_step(model)

    report = fuse(model, ops=["swiglu"])
    rows = [r for r in report.rows if r.kind == "swiglu"]
    assert sorted(r.path for r in rows) == sorted(mlps) and report.fused_rows("swiglu") == rows, report.rows
    for r in rows:
        assert (r.original, r.replacement, r.fused, r.eligible) == (type(mlps[r.path]).__name__,
                                                                     "FusedGateUpSwiGLUMLP", True, True), r
        assert "same projections; op swiglu.packed" in r.reason and "gate_up_proj(x).chunk(2, -1)" in r.reason, r
        # the CPU: op swiglu.packed's kernel cannot run there (the report says what runs)
        assert (r.forward, r.backward) == ("torch (fallback)", "torch (fallback)"), r
    assert report.covered == report.eligible == 2 and "swiglu" not in report.not_requested
    after = dict(model.named_modules())
    assert list(after) == list(before)
    for p, mlp in mlps.items():
        fused = after[p]
        assert type(fused) is FusedGateUpSwiGLUMLP and fused is not mlp and not fused.training
        assert [(n, id(c)) for n, c in fused.named_children()] == [(n, id(c)) for n, c in mlp.named_children()]
        assert fused.activation_fn is mlp.activation_fn
    assert [(n, id(p)) for n, p in model.named_parameters()] == params
    new_sd = model.state_dict()
    assert list(new_sd) == list(sd) and all(new_sd[k] is sd[k] or torch.equal(new_sd[k], sd[k]) for k in sd)

    dispatch.reset_stats()
    out = _lm_step(model)
    stats = dispatch.stats()
    assert stats["swiglu.packed"] == {"torch": 2} and "swiglu" not in stats, stats
    assert out[0].dtype == dtype
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert out[2].keys() == ref[2].keys() and any(".mlp.gate_up_proj." in n for n in ref[2])
    assert all(torch.equal(out[2][n], ref[2][n]) for n in ref[2])

    assert unfuse(model) and not is_fused(model)
    after = dict(model.named_modules())
    assert list(after) == list(before) and all(after[p] is m for p, m in before.items())
    again = _lm_step(model)
    assert torch.equal(again[0], ref[0]) and all(torch.equal(again[2][n], ref[2][n]) for n in ref[2])


def test_a_copy_of_a_model_with_fused_gate_up_mlps_cannot_be_unfused_and_says_why():
    import copy

    model, mlps = _gate_up_lm("phi3")
    fuse(model, ops=["swiglu"])
    twin = copy.deepcopy(model)
    assert "_pipegoose_original" not in twin.model.layers[0].mlp.__dict__
    with pytest.raises(RuntimeError, match=r"holds fused modules \(model\.layers\.0\.mlp and 1 more\).*copy of a "
                                           r"fused model"):
        unfuse(twin)
    assert type(twin.model.layers[0].mlp) is FusedGateUpSwiGLUMLP     # nothing changed
    assert unfuse(model) and model.model.layers[0].mlp is mlps["model.layers.0.mlp"]


def test_a_phi3_model_fused_whole_counts_its_mlps():
    """fuse(model) with every default kind: the MLPs are fused and counted in the share (they were "not counted"),
    next to the norms and RoPE; a dry run says the same and changes nothing; ops without swiglu counts them as not
    requested."""
    model, mlps = _gate_up_lm("phi3")
    dry = fuse(model, dry_run=True)
    assert not is_fused(model) and all(dict(model.named_modules())[p] is m for p, m in mlps.items())
    report = fuse(model)
    try:
        for rep in (dry, report):
            rows = rep.fused_rows("swiglu")
            assert sorted(r.path for r in rows) == sorted(mlps) and all(r.eligible for r in rows), rep.rows
            assert rep.covered == rep.eligible and rep.fused_rows("rms_norm"), rep.rows
            assert "swiglu left to the model's own code" not in str(rep).splitlines()[0], str(rep)
        assert all(type(dict(model.named_modules())[p]) is FusedGateUpSwiGLUMLP for p in mlps)
    finally:
        assert unfuse(model)
    assert all(dict(model.named_modules())[p] is m for p, m in mlps.items())
    report = fuse(model, dry_run=True, ops=["rms_norm"])
    assert report.not_requested.get("swiglu") == 2 and not report.fused_rows("swiglu")


def test_the_gate_up_rows_show_op_swiglu_packed_and_its_impl_variables(monkeypatch):
    """The report's columns of a gate_up_proj MLP are op swiglu.packed's choice, which PIPEGOOSE_IMPL_SWIGLU_PACKED
    (or the family's PIPEGOOSE_IMPL_SWIGLU) forces; a Llama MLP's are op swiglu's, which the packed op's variable does
    not touch. A FusedGateUpSwiGLUMLP(impl=...) fused before shows its own request."""
    from pipegoose.nn.fusion import FusedGateUpSwiGLUMLP as Exported
    from pipegoose.nn.fusion import dispatch

    assert Exported is FusedGateUpSwiGLUMLP
    phi3, _ = _gate_up_lm("phi3")
    llama = models.build("llama", "eager")

    def columns(model):
        return {(r.forward, r.backward) for r in fuse(model, dry_run=True, ops=["swiglu"]).rows}

    assert columns(phi3) == columns(llama) == {("torch (fallback)", "torch (fallback)")}
    monkeypatch.setenv("PIPEGOOSE_IMPL_SWIGLU_PACKED", "torch")
    assert columns(phi3) == {("torch", "torch")} and columns(llama) == {("torch (fallback)", "torch (fallback)")}
    monkeypatch.setenv("PIPEGOOSE_IMPL_SWIGLU_PACKED", "auto")    # the op's own auto overrides the family's
    monkeypatch.setenv("PIPEGOOSE_IMPL_SWIGLU", "torch")
    assert columns(phi3) == {("torch (fallback)", "torch (fallback)")} and columns(llama) == {("torch", "torch")}
    monkeypatch.delenv("PIPEGOOSE_IMPL_SWIGLU_PACKED")
    assert columns(phi3) == columns(llama) == {("torch", "torch")}
    monkeypatch.setenv("PIPEGOOSE_IMPL_SWIGLU_PACKED", "triton")   # (fuse() checks the variables up front)
    with pytest.raises(ValueError, match="PIPEGOOSE_IMPL_SWIGLU_PACKED"):
        fuse(phi3, ops=["swiglu"])
    assert not is_fused(phi3)
    monkeypatch.delenv("PIPEGOOSE_IMPL_SWIGLU_PACKED")
    monkeypatch.delenv("PIPEGOOSE_IMPL_SWIGLU")

    mlp = phi3.model.layers[0].mlp
    holder = nn.Sequential(FusedGateUpSwiGLUMLP.from_module(mlp, impl="torch"))
    (row,) = fuse(holder, ops=["swiglu"]).rows
    assert (row.kind, row.replacement, row.fused, row.forward) == ("swiglu", "FusedGateUpSwiGLUMLP", True, "torch")
    assert "already fused before this call" in row.reason, row


@pytest.mark.parametrize("impl", ["torch", "Torch", " pipegoose ", "auto", None])
def test_impl_forcing_takes_the_names_of_op_swiglu_packed(impl):
    mlp = _gate_up_lm("phi3")[1]["model.layers.0.mlp"]
    fused = FusedGateUpSwiGLUMLP.from_module(mlp, impl=impl)
    assert fused.impl == impl and (f"impl={impl!r}" in repr(fused)) == (impl is not None)
    x = torch.randn(2, 5, 32)
    if impl is not None and impl.strip() == "pipegoose":   # on the CPU: skipped with the reason, the reference runs
        with pytest.warns(UserWarning, match="pipegoose"):
            y = fused(x)
    else:
        y = fused(x)
    assert torch.equal(y, mlp(x))


def test_impl_forcing_refuses_a_name_the_op_does_not_have():
    mlp = _gate_up_lm("phi3")[1]["model.layers.0.mlp"]
    with pytest.raises(ValueError, match=r"^impl: swiglu.packed has no implementation 'triton'"):
        FusedGateUpSwiGLUMLP.from_module(mlp, impl="triton")
    with pytest.raises(ValueError, match=r"^impl: swiglu.packed has no implementation 'megatron'"):
        FusedGateUpSwiGLUMLP(mlp.gate_up_proj, mlp.down_proj, impl="megatron")
    with pytest.raises(TypeError, match="impl"):
        FusedGateUpSwiGLUMLP(mlp.gate_up_proj, mlp.down_proj, impl=3)


def test_a_phi3_mlp_of_another_activation_is_skipped_with_the_reason():
    """Phi3MLP with hidden_act="gelu" (transformers' own class): not SwiGLU, with the reason, in a row of kind geglu
    (GELU: where ops=["geglu"] lists it)."""
    model, mlps = _gate_up_lm("phi3", hidden_act="gelu")
    row, _ = _skipped_row(mlps["model.layers.0.mlp"], kind="geglu")
    assert "activation_fn (GELUActivation) is not SiLU" in row.reason, row.reason


def test_zamba2s_gate_up_mlp_is_skipped_with_the_reason():
    """Zamba2MLP (gate_up_proj and down_proj around GELU, with per-layer adapters and a layer_idx argument)."""
    cls = _cls("zamba2", "Zamba2MLP")
    cfg = _config("zamba2", "Zamba2Config", hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=4)
    assert cfg.hidden_act == "gelu"
    mlp = cls(cfg, num_fwd_mem_blocks=2, block_id=0)
    probe = probe_swiglu_mlp(mlp)
    assert probe.candidate and probe.packed and not probe.ok, probe
    assert "besides the projections and activation_fn or act_fn (gate_up_proj_adapter_list)" in probe.reason, probe
    holder = nn.Sequential(mlp)
    (row,) = fuse(holder, dry_run=True, ops=["geglu"]).rows   # (GELU: kind geglu)
    assert not row.fused and not row.eligible and row.reason == probe.reason
    # (its activation, GELUActivation, alone: test_a_phi3_mlp_of_another_activation_is_skipped_with_the_reason)


def test_minimax_m3s_clamped_gate_up_mlp_is_skipped_with_the_reason():
    """MiniMax-M3's dense MLP: gate_up_proj, gate and up clamped at swiglu_limit (7), a scaled sigmoid and (up + 1)."""
    cls = _cls("minimax_m3_vl", "MiniMaxM3VLDenseMLP")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg = CONFIG_MAPPING["minimax_m3_vl_text"](hidden_size=HIDDEN, dense_intermediate_size=INTER)
    row, text = _skipped_row(cls(cfg))
    assert "clamps gate and up at swiglu_limit=" in row.reason and "not plain SwiGLU" in row.reason, row.reason
    assert row.reason in text


def test_an_extra_submodule_on_a_phi3_mlp_is_skipped_with_the_reason():
    model, mlps = _gate_up_lm("phi3")
    odd = mlps["model.layers.0.mlp"]
    odd.dropout = nn.Dropout(0.1)
    report = fuse(model, ops=["swiglu"])
    rows = {r.path: r for r in report.rows if r.kind == "swiglu"}
    assert not rows["model.layers.0.mlp"].fused and not rows["model.layers.0.mlp"].eligible
    assert "besides the projections and activation_fn or act_fn (dropout)" in rows["model.layers.0.mlp"].reason
    assert rows["model.layers.1.mlp"].fused and model.model.layers[0].mlp is odd
    assert type(model.model.layers[1].mlp) is FusedGateUpSwiGLUMLP
    assert unfuse(model) and model.model.layers[1].mlp is mlps["model.layers.1.mlp"]


class _FunctionActMLP(nn.Module):
    """A SwiGLU MLP whose activation is a function attribute (``self.act_fn = F.silu``), not a submodule."""

    def __init__(self, packed: bool, hidden: int = 16, inter: int = 24):
        super().__init__()
        self.packed = packed
        if packed:
            self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
            self.activation_fn = torch.nn.functional.silu
        else:
            self.gate_proj = nn.Linear(hidden, inter, bias=False)
            self.up_proj = nn.Linear(hidden, inter, bias=False)
            self.act_fn = torch.nn.functional.silu
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        if self.packed:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(up * self.activation_fn(gate))
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("packed", [False, True], ids=["gate_proj", "gate_up_proj"])
@pytest.mark.parametrize("replacement", ["module", "function"])
def test_a_function_activation_replaced_while_fused_is_run_and_carried_back(packed, replacement):
    """An MLP holding its activation as a function attribute is fused; an activation assigned over it while fused (a
    module, or another function) is run as the MLP's forward would run it, and unfuse() hands it back to the MLP, so
    fused and unfused agree before and after (before, the fused module ran SiLU regardless and unfuse then switched
    to the new activation; a review)."""
    torch.manual_seed(0)
    model = nn.Sequential(_FunctionActMLP(packed))
    x = torch.randn(3, 16)
    want = model(x)
    report = fuse(model, ops=["swiglu"])
    assert [r.fused for r in report.rows] == [True]
    torch.testing.assert_close(model(x), want)
    name = "activation_fn" if packed else "act_fn"
    new_act = nn.GELU() if replacement == "module" else torch.nn.functional.gelu
    setattr(model[0], name, new_act)
    fused_out = model(x)
    assert not torch.allclose(fused_out, want), "the replaced activation did not run"
    unfuse(model)
    assert getattr(model[0], name) is new_act
    torch.testing.assert_close(model(x), fused_out, rtol=0, atol=0)


def test_a_gate_up_proj_of_odd_width_while_fused_names_gate_up_proj():
    """A gate_up_proj that returns an odd width while fused (replaced by the user) is a ValueError naming
    gate_up_proj and the input's shape, not silu_and_mul's "x" (a walkthrough)."""
    model = nn.Sequential(_FunctionActMLP(packed=True))
    fuse(model, ops=["swiglu"])
    model[0].gate_up_proj = nn.Linear(16, 49, bias=False)
    with pytest.raises(ValueError, match=r"^gate_up_proj: returned shape \[2, 5, 49\], expected an even last "
                                         r"dimension .* input of shape \[2, 5, 16\]"):
        model(torch.randn(2, 5, 16))


def test_llama4s_mlps_with_activation_fn_are_fused_and_unfused():
    """Llama 4's ``Llama4TextMLP`` (its shared expert, and its dense layers') names its activation ``activation_fn``
    (session 71's survey: it was refused for "submodules besides the projections and act_fn"): fused as a SwiGLU MLP
    that keeps that activation, the logits exactly the unfused model's (CPU: PyTorch's path); an ``activation_fn``
    replaced while fused is run, as the MLP's forward would; unfuse puts the MLPs back."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "llama4_text" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no llama4_text")
    import transformers

    cfg = CONFIG_MAPPING["llama4_text"](hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        vocab_size=97, num_local_experts=2, interleave_moe_layer_step=2,
                                        pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    mlps = {p: m for p, m in model.named_modules() if type(m).__name__ == "Llama4TextMLP"}
    assert len(mlps) == 2 and all("activation_fn" in m._modules or "activation_fn" in m.__dict__
                                  for m in mlps.values()), mlps   # (a dense layer's MLP and a shared expert)
    assert probe_swiglu_mlp(next(iter(mlps.values()))).ok
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    ref = model(input_ids=ids).logits
    rows = {r.path: r for r in fuse(model, ops=["swiglu"]).rows if r.kind == "swiglu"}
    assert set(rows) == set(mlps) and all(r.fused and r.replacement == "FusedSwiGLUMLP" for r in rows.values()), rows
    fused = dict(model.named_modules())
    assert all(type(fused[p]) is FusedSwiGLUMLP and fused[p]._act_name == "activation_fn" for p in mlps)
    torch.testing.assert_close(model(input_ids=ids).logits, ref, rtol=0, atol=0)
    path = next(iter(mlps))
    gelu = nn.GELU()
    fused[path].activation_fn = gelu
    x = torch.randn(3, 32)
    want = fused[path].down_proj(gelu(fused[path].gate_proj(x)) * fused[path].up_proj(x))
    torch.testing.assert_close(fused[path](x), want, rtol=0, atol=0)
    assert unfuse(model)
    back = dict(model.named_modules())
    assert all(back[p] is m for p, m in mlps.items())
