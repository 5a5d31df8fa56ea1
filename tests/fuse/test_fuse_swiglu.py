"""fuse() and the SwiGLU probe on gated MLPs that are not plain SwiGLU, with transformers' own classes (tiny configs):

* clamped SwiGLU (``swiglu_limit``: DeepseekV4, Glm5Next, Step3p7, BailingHybrid): the probe ran inputs whose gate
  stayed below ~5, so a clamp at 7 or 10 never showed, and fuse() put an unclamped FusedSwiGLUMLP in their place
  (silently wrong results for activations past the limit). Now they are skipped with the reason, or, where the clamp
  is off (a zero limit), fused with results equal to the module's, large activations included;
* gate and up in one ``gate_up_proj`` (Phi-3, GLM): no row at all, so the report said nothing of the MLP.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from pipegoose.nn.fusion import fuse, unfuse
from pipegoose.nn.fusion.fuse import is_fused
from pipegoose.nn.fusion.modules import FusedSwiGLUMLP
from pipegoose.nn.fusion.transformers.matching import probe_swiglu_mlp

from . import models

HIDDEN, INTER = 32, 64


def _from(module: str, kind: str, name: str):
    """transformers.models.<module>.<kind>_<module>.<name>, or a pytest skip where this transformers lacks it."""
    try:
        mod = importlib.import_module(f"transformers.models.{module}.{kind}_{module}")
    except ImportError:
        pytest.skip(f"this transformers has no {module}")
    if not hasattr(mod, name):
        pytest.skip(f"this transformers has no {name}")
    return getattr(mod, name)


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

    holder = nn.Sequential(mlp)
    x = _large_input()
    with torch.no_grad():
        ref = holder(x)
        report = fuse(holder, ops=["swiglu"])
        out = holder(x)
    (row,) = report.rows
    assert (row.kind, row.original, row.replacement, row.fused, row.eligible) == (
        "swiglu", type(mlp).__name__, None, False, False), row
    assert "not plain SwiGLU" in row.reason and limit in row.reason, row.reason
    assert row.reason in str(report)
    assert holder[0] is mlp and not is_fused(holder)
    assert torch.equal(out, ref)


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
    """The probe's gate and up reach tens of either sign: a clamp at 6..40 that no attribute names changes its output."""
    probe = probe_swiglu_mlp(_HardClamp(limit, after_act))
    assert probe.candidate and not probe.ok and "differs from down_proj(silu(gate_proj(x)) * up_proj(x))" in \
        probe.reason, probe
    probe = probe_swiglu_mlp(_UpOnlyClamp())
    assert not probe.ok and "differs" in probe.reason, probe


@pytest.mark.parametrize("limit", [8.0, 30.0])
def test_an_act_fn_that_clamps_past_six_is_not_silu(limit):
    """The act_fn check ran inputs in [-6, 6] only: a SiLU of a clamped input passed it."""
    mlp = _HardClamp(1e9)
    mlp.act_fn = _ClampedSiLU(limit)
    probe = probe_swiglu_mlp(mlp)
    assert not probe.ok and "act_fn (_ClampedSiLU) is not SiLU" in probe.reason, probe


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


def test_an_mlp_clamping_at_its_config_limit_is_refused_up_front():
    """A limit no plausible activation reaches (1e6): the probe's output cannot show it; the config's swiglu_limit,
    which the forward reads, does."""
    probe = probe_swiglu_mlp(_ConfigLimited(1e6))
    assert not probe.ok and "clamps gate and up at config.swiglu_limit=1000000.0: not plain SwiGLU" in probe.reason, \
        probe


# ------------------------------------------------------------------------------------ gate and up in one projection
@pytest.mark.parametrize("model_type", ["phi3", "glm"])
def test_a_gate_up_proj_mlp_gets_a_skipped_row_with_the_reason(model_type):
    """A review: Phi3MLP / GlmMLP (one gate_up_proj, then SiLU on one half times the other) had no row at all, so a dry
    run of the model said 100% with no word of its MLPs. Each now has a skipped swiglu row with the reason; like every
    MLP the probe refuses it is not eligible (the share counts only layouts fuse() takes), and nothing changes."""
    from transformers import AutoModelForCausalLM

    cfg = models.rope_config(model_type)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    mlps = {p: m for p, m in model.named_modules() if type(m).__name__.endswith("MLP")}
    assert len(mlps) == 2 and all(hasattr(m, "gate_up_proj") for m in mlps.values()), mlps
    for m in mlps.values():
        probe = probe_swiglu_mlp(m)
        assert probe.candidate and not probe.ok and "gate and up in one gate_up_proj: not fused" in probe.reason
    with pytest.raises(TypeError, match="without gate_proj, up_proj"):
        FusedSwiGLUMLP.from_module(next(iter(mlps.values())))

    for kw in ({}, {"ops": ["swiglu"]}):
        report = fuse(model, dry_run=True, **kw)
        rows = [r for r in report.rows if r.kind == "swiglu"]
        assert sorted(r.path for r in rows) == sorted(mlps), report.rows
        for r in rows:
            assert (r.original, r.replacement, r.fused, r.eligible) == (type(mlps[r.path]).__name__, None, False,
                                                                         False), r
            assert "gate and up in one gate_up_proj: not fused" in r.reason, r.reason
        assert "gate_up_proj" in str(report)
        assert "swiglu" not in report.not_requested
    # left out of ops: not counted as not requested (fuse() would not take it either)
    report = fuse(model, dry_run=True, ops=["rms_norm"])
    assert "swiglu" not in report.not_requested and not [r for r in report.rows if r.kind == "swiglu"]
    assert not is_fused(model) and all(dict(model.named_modules())[p] is m for p, m in mlps.items())
