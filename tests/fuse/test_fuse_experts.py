"""fuse() and the gate of transformers' mixture-of-experts layers (kind ``swiglu``, replacement ``FusedExpertsGate``):
transformers 5 holds a MoE layer's experts in one module (``MixtralExperts``, ``Qwen3MoeExperts``, ``OlmoeExperts``,
``Qwen2MoeExperts``, ...) whose class is decorated with ``use_experts_implementation``; its ``grouped_mm`` and
``batched_mm`` implementations call the module's ``_apply_gate`` (``act_fn(gate) * up`` of the packed projection's
halves). fuse() probes each such module and sets a ``FusedExpertsGate`` (op ``swiglu.packed``) as the instance's
``_apply_gate``; unfuse() deletes it. Tiny configs (``AutoConfig.for_model``), CPU, fp32, training mode:

* the models' loss and every parameter's gradient are the unfused model's bit for bit, ``dispatch.stats()`` counts
  the gate's calls (one per layer and forward), unfuse() leaves the class's gate again;
* ``eager`` (transformers' loop, which does not call ``_apply_gate``), a module whose config names no implementation,
  and ``sonicmoe`` report the model's code; ``batched_mm`` runs the gate; a class whose own loop calls
  ``_apply_gate`` (Step3p7's) runs it in ``eager`` too;
* refusals with the reason: GPT-OSS (no act_fn; given SiLU, its clamp), GELU, ReLU, a hooked act_fn, subclasses with a
  gate of their own (clamped, scaled, interleaved), an ``_apply_gate`` set on the instance, ``has_gate=False``;
* ``ops`` without swiglu, ``dry_run``, an act_fn replaced or hooked after fuse (the class's gate runs), copies
  (deepcopy, torch.save), a part fused first, a gate replaced by the user before unfuse;
* on CUDA (marker ``cuda``): the kernel runs (strict mode) in bf16 and fp32, with the unfused model's results within
  the stated tolerances.
"""

from __future__ import annotations

import copy
import gc
import io
import math
import re
import weakref

import pytest
import torch
from torch import nn

from pipegoose.nn.fusion import dispatch, fuse, unfuse
from pipegoose.nn.fusion.fuse import is_fused
from pipegoose.nn.fusion.transformers import experts as experts_mod
from pipegoose.nn.fusion.transformers.experts import FusedExpertsGate
from tolerances import TOLERANCES, tol

from . import models

tr = pytest.importorskip("transformers")
moe = pytest.importorskip("transformers.integrations.moe")
mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
from transformers.activations import ACT2FN  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402

HIDDEN, LAYERS, VOCAB = 32, 2, 97
# model type -> (its experts class, the config's MoE sizes: 4 experts of 2 per token)
MOE = {
    "mixtral": ("MixtralExperts", dict(intermediate_size=64, num_local_experts=4)),
    "qwen3_moe": ("Qwen3MoeExperts", dict(intermediate_size=64, moe_intermediate_size=48, num_experts=4, head_dim=8)),
    "olmoe": ("OlmoeExperts", dict(intermediate_size=48, num_experts=4)),
    "qwen2_moe": ("Qwen2MoeExperts", dict(intermediate_size=64, moe_intermediate_size=48, num_experts=4,
                                          shared_expert_intermediate_size=40)),
}
MODEL_CODE = "the model's code"


@pytest.fixture(autouse=True)
def _deterministic(request):
    """The CPU tests compare bit for bit: torch.use_deterministic_algorithms(True) for each (then as it was). Without
    it the backward of batched_mm's gate_up_proj[expert_ids] (index_put_ with accumulate, rows of repeated experts)
    sums in a varying order on the CPU: two unfused runs differed in the last place (2e-10 in gate_up_proj's
    gradient). Not for the cuda tests, which compare within tolerances (and where cuBLAS would need a workspace
    setting)."""
    if request.node.get_closest_marker("cuda"):
        yield
        return
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


_from = models.transformers_attr


def _config(model_type: str = "mixtral", **extra):
    """A tiny config (hidden 32, 2 layers, 4 experts, 2 per token) of a MoE model type; a skip where this transformers
    lacks the type."""
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    kw = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=VOCAB, max_position_embeddings=64, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, **MOE[model_type][1])
    kw.update(extra)
    return tr.AutoConfig.for_model(model_type, **kw)


def _model(model_type: str = "mixtral", seed: int = 0, cfg=None, **from_config_kw):
    """A tiny AutoModelForCausalLM of ``model_type`` in training mode, from a fixed seed (a fresh config each call:
    from_config's experts_implementation keyword writes to the config)."""
    torch.manual_seed(seed)
    cfg = cfg if cfg is not None else _config(model_type)
    return tr.AutoModelForCausalLM.from_config(cfg, **from_config_kw).train()


def _experts(model) -> list[nn.Module]:
    """The model's experts modules, in layer order (each a candidate of the experts interface)."""
    found = [m for m in model.modules() if experts_mod.candidate(m)]
    assert found, "no experts module"
    return found


def _paths(model) -> list[str]:
    return [p for p, m in model.named_modules() if experts_mod.candidate(m)]


def _rows(report, model) -> list:
    paths = set(_paths(model))
    return [r for r in report.rows if r.path in paths]


def _ids(seed: int = 3):
    return torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))


def _step(model, seed: int = 3):
    """Forward and backward of the causal-LM loss on fixed tokens: (loss, {name: gradient})."""
    ids = _ids(seed).to(next(model.parameters()).device)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_equal(got, want):
    """Loss and every gradient bit for bit."""
    assert torch.equal(got[0], want[0]), (got[0].item(), want[0].item())
    assert got[1].keys() == want[1].keys()
    for n, g in want[1].items():
        assert torch.equal(got[1][n], g), (n, (got[1][n] - g).abs().max().item())


def _gate_calls() -> int:
    return sum(dispatch.stats().get("swiglu.packed", {}).values())


def _counted_step(model):
    """_step with the counters zeroed first: (its result, the calls of op swiglu.packed)."""
    dispatch.reset_stats()
    out = _step(model)
    return out, _gate_calls()


def _output(module, *inputs):
    """An experts module's output for ``inputs`` (hidden states, top-k indices and weights), without grad."""
    with torch.no_grad():
        return module(*inputs)


def _route(seed=4, tokens=6, experts=4, top_k=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    idx = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    return x, idx, torch.rand(tokens, top_k, generator=g)


# ------------------------------------------------------------------------------------------------ fused and exact
@pytest.mark.parametrize("model_type", list(MOE))
def test_moe_experts_gate_is_fused_exact_and_unfused(model_type):
    """Each layer's experts module gets a swiglu row (its class, FusedExpertsGate, fused, eligible) and the gate as
    its instance's _apply_gate (holding the module and the act_fn probed); loss and every gradient equal the unfused
    model's bit for bit (CPU fp32: the op's reference is transformers' formula); the op ran once per layer; unfuse()
    deletes the gate and the model runs the class's gate again (no call of the op), with the same results."""
    model = _model(model_type)
    experts = _experts(model)
    assert len(experts) == LAYERS and all(type(e).__name__ == MOE[model_type][0] for e in experts)
    assert model.config._experts_implementation == "grouped_mm"
    ref, calls = _counted_step(model)
    assert calls == 0

    report = fuse(model)
    rows = _rows(report, model)
    assert [r.path for r in rows] == _paths(model)
    for r in rows:
        assert (r.kind, r.original, r.replacement, r.fused, r.eligible) == (
            "swiglu", MOE[model_type][0], "FusedExpertsGate", True, True), r
        assert r.forward != MODEL_CODE and "experts implementation 'grouped_mm'" in r.reason, r
        assert "op swiglu.packed" in r.reason, r
    for e in experts:
        gate = e.__dict__["_apply_gate"]
        assert isinstance(gate, FusedExpertsGate) and gate.module is e and gate.probed_act is e.act_fn
        assert experts_mod.hooked(e)
    assert is_fused(model)

    got, calls = _counted_step(model)
    assert calls == LAYERS, dispatch.stats()
    _assert_equal(got, ref)

    assert unfuse(model) is True and not is_fused(model)
    assert all("_apply_gate" not in e.__dict__ and not experts_mod.hooked(e) for e in experts)
    again, calls = _counted_step(model)
    assert calls == 0
    _assert_equal(again, ref)


def test_eager_experts_implementation_is_reported_as_the_models_code():
    """experts_implementation='eager' (transformers' loop computes act_fn(gate) * up inline): the rows are fused (the
    gate is set) but say the model's code, naming 'eager'; the op is not called and the results are the unfused
    model's. Switched to grouped_mm afterwards, the gate set by fuse() runs, with the results of an unfused grouped_mm
    copy (grouped_mm and eager's loop differ in the last place)."""
    model = _model(experts_implementation="eager")
    assert model.config._experts_implementation == "eager"
    ref, _ = _counted_step(model)
    twin = copy.deepcopy(model)
    twin.set_experts_implementation("grouped_mm")
    ref_grouped = _step(twin)
    report = fuse(model, ops=["swiglu"])
    rows = _rows(report, model)
    assert len(rows) == LAYERS
    for r in rows:
        assert r.fused and r.replacement == "FusedExpertsGate" and (r.forward, r.backward) == (MODEL_CODE, MODEL_CODE)
        assert "experts implementation is 'eager'" in r.reason and "model.set_experts_implementation" in r.reason, r
    got, calls = _counted_step(model)
    assert calls == 0
    _assert_equal(got, ref)
    model.set_experts_implementation("grouped_mm")
    got, calls = _counted_step(model)
    assert calls == LAYERS
    _assert_equal(got, ref_grouped)
    assert unfuse(model) and all("_apply_gate" not in e.__dict__ for e in _experts(model))


def test_batched_mm_runs_the_gate():
    """experts_implementation='batched_mm' also calls _apply_gate: the op runs once per layer, results bit for bit
    (under the module's deterministic algorithms: see _deterministic)."""
    model = _model(experts_implementation="batched_mm")
    assert model.config._experts_implementation == "batched_mm"
    try:
        ref, _ = _counted_step(model)
    except (NotImplementedError, RuntimeError) as exc:   # pragma: no cover - a torch without bmm of these shapes
        pytest.skip(f"batched_mm does not run on this CPU: {exc}")
    report = fuse(model, ops=["swiglu"])
    assert all(r.fused and "experts implementation 'batched_mm'" in r.reason for r in _rows(report, model))
    got, calls = _counted_step(model)
    assert calls == LAYERS
    _assert_equal(got, ref)
    assert unfuse(model)


def test_a_module_whose_config_names_no_implementation_is_reported_as_the_models_code():
    """A review of this session: an experts module built outside a model (its config's _experts_implementation None)
    runs the class's loop (transformers' dispatch falls back to it), which never calls _apply_gate; the row said op
    swiglu.packed ran. Now it says the model's code and why; its output is unchanged, the op never called."""
    cfg = _config()
    assert cfg._experts_implementation is None
    torch.manual_seed(0)
    e = mixtral.MixtralExperts(cfg)
    nn.init.normal_(e.gate_up_proj, std=0.2)
    nn.init.normal_(e.down_proj, std=0.2)
    holder = nn.Sequential(e)
    x = _route()
    ref = _output(e, *x)
    (row,) = fuse(holder, ops=["swiglu"]).rows
    assert row.fused and (row.forward, row.backward) == (MODEL_CODE, MODEL_CODE), row
    assert "experts implementation names none" in row.reason, row.reason
    dispatch.reset_stats()
    assert torch.equal(_output(e, *x), ref) and _gate_calls() == 0
    assert unfuse(holder)


def test_sonicmoe_is_reported_as_the_models_code():
    """sonicmoe's kernel computes the activation from config.hidden_act and never calls _apply_gate: the row says the
    model's code, naming it (not run here: the kernel needs a GPU and the sonic-moe package)."""
    model = _model()
    model.config._experts_implementation_internal = "sonicmoe"   # (set_experts_implementation checks the kernel)
    assert all(experts_mod.implementation(e) == "sonicmoe" for e in _experts(model))
    rows = _rows(fuse(model, ops=["swiglu"]), model)
    assert rows and all(r.fused and r.forward == MODEL_CODE and "'sonicmoe'" in r.reason for r in rows), rows
    assert unfuse(model)


def test_a_class_whose_own_loop_calls_the_gate_runs_it_in_eager():
    """Step3p7's experts loop calls self._apply_gate (a layer whose clamp is off: limit 0): in 'eager', and with no
    implementation named, the fused gate runs (the op is counted) and the row says so; outputs bit for bit."""
    cfg_cls = _from("step3p7", "configuration", "Step3p7TextConfig")
    cls = _from("step3p7", "modeling", "Step3p7Experts")
    for impl in ("eager", None):
        cfg = cfg_cls(hidden_size=HIDDEN, moe_intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                      num_hidden_layers=2, swiglu_limits=[0, 7.0])
        cfg._experts_implementation = impl
        torch.manual_seed(0)
        e = cls(cfg, 0)
        assert e.limit is None
        nn.init.normal_(e.gate_up_proj, std=0.2)
        nn.init.normal_(e.down_proj, std=0.2)
        x = _route()
        ref = _output(e, *x)
        holder = nn.Sequential(e)
        (row,) = fuse(holder, ops=["swiglu"]).rows
        assert row.fused and row.forward != MODEL_CODE and "which calls _apply_gate" in row.reason, row
        dispatch.reset_stats()
        assert torch.equal(_output(e, *x), ref)
        assert _gate_calls() == len(x[1].unique())   # one call per expert hit
        assert unfuse(holder)


# ------------------------------------------------------------------------------------------------ GELU experts
def _gemma4_config(**extra):
    """A tiny Gemma 4 text config with its MoE block (4 experts of 48, 2 per token; GELU's tanh approximation, the
    config's default hidden_activation); a skip where this transformers lacks Gemma 4."""
    if "gemma4_text" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no gemma4_text")
    kw = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              vocab_size=VOCAB, max_position_embeddings=64, intermediate_size=64, enable_moe_block=True, num_experts=4,
              top_k_experts=2, moe_intermediate_size=48, vocab_size_per_layer_input=VOCAB,
              hidden_size_per_layer_input=8, layer_types=["sliding_attention", "full_attention"], pad_token_id=0,
              bos_token_id=1, eos_token_id=2)
    kw.update(extra)
    return tr.AutoConfig.for_model("gemma4_text", **kw)


def _geglu_calls() -> int:
    return sum(dispatch.stats().get("geglu.packed", {}).values())


@pytest.mark.parametrize("activation", ["gelu_pytorch_tanh", "gelu"])
def test_gemma4_gelu_experts_are_fused_exact_and_unfused(activation):
    """Gemma 4's experts (GELU: its default gelu_pytorch_tanh, and exact GELU) get a geglu row (FusedExpertsGate,
    op geglu.packed with the activation's approximate); loss and every gradient equal the unfused model's bit for
    bit (ops=["geglu"]: the dense GeGLU MLPs and these gates, whose CPU reference is transformers' formula); the op
    ran once per layer; unfuse() restores the class's gate."""
    model = _model(cfg=_gemma4_config(hidden_activation=activation))
    experts = _experts(model)
    assert [type(e).__name__ for e in experts] == ["Gemma4TextExperts"] * LAYERS
    dispatch.reset_stats()
    ref = _step(model)
    assert _geglu_calls() == 0
    report = fuse(model, ops=["geglu"])
    approximate = "tanh" if activation == "gelu_pytorch_tanh" else "none"
    for r in _rows(report, model):
        assert (r.kind, r.replacement, r.fused, r.eligible) == ("geglu", "FusedExpertsGate", True, True), r
        assert f"gelu(gate, approximate={approximate!r}) * up" in r.reason and "op geglu.packed" in r.reason, r
    for e in experts:
        gate = e.__dict__["_apply_gate"]
        assert isinstance(gate, FusedExpertsGate) and gate.approximate == approximate and gate.op == "geglu.packed"
        assert repr(gate) == f"FusedExpertsGate(op='geglu.packed', approximate={approximate!r}, impl=None)"
    dispatch.reset_stats()
    got = _step(model)
    assert _geglu_calls() == LAYERS and _gate_calls() == 0, dispatch.stats()
    _assert_equal(got, ref)
    clone = copy.deepcopy(model)   # (a copy's gate: GELU's too)
    assert all(e.__dict__["_apply_gate"].approximate == approximate for e in _experts(clone))
    assert unfuse(model)
    assert all("_apply_gate" not in e.__dict__ for e in experts)
    dispatch.reset_stats()
    _assert_equal(_step(model), ref)
    assert _geglu_calls() == 0


@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "gelu", "gelu_new"])
def test_a_mixtral_given_gelu_experts_gets_a_geglu_gate_and_swiglu_in_ops_leaves_it(act):
    """The kind follows the activation, not the model: Mixtral's layer 0 given a GELU act_fn gets a geglu row (op
    geglu.packed) next to layer 1's swiglu one, with the results unchanged; ops=["swiglu"] leaves the GELU experts
    (counted under not_requested geglu) and ops=["geglu"] the SiLU ones. gelu_new (transformers' own formula of the
    tanh approximation, not F.gelu's) agrees within fp32's tolerance, the others bit for bit."""
    model = _model()
    first, second = _experts(model)
    first.act_fn = ACT2FN[act]
    ref = _step(model)
    report = fuse(model)
    row0, row1 = _rows(report, model)
    assert (row0.kind, row0.fused, row1.kind, row1.fused) == ("geglu", True, "swiglu", True), (row0, row1)
    dispatch.reset_stats()
    got = _step(model)
    if act == "gelu_new":
        torch.testing.assert_close(got[0], ref[0], **tol(torch.float32))
        for n, g in ref[1].items():
            torch.testing.assert_close(got[1][n], g, **tol(torch.float32), msg=lambda m: f"grad of {n}: {m}")
    else:
        _assert_equal(got, ref)
    assert (_geglu_calls(), _gate_calls()) == (1, 1), dispatch.stats()
    assert unfuse(model)
    for ops, kept, left in ((["swiglu"], second, "geglu"), (["geglu"], first, "swiglu")):
        report = fuse(model, ops=ops)
        rows = _rows(report, model)
        assert [r.path for r in rows] == [_paths(model)[0 if kept is first else 1]], rows
        assert report.not_requested.get(left) == 1, report.not_requested
        assert experts_mod.hooked(kept) and not experts_mod.hooked(first if kept is second else second)
        assert unfuse(model)


def test_a_hooked_gelu_act_fn_is_refused_under_geglu():
    """A GELU act_fn with a hook: the experts row is refused under kind geglu (with the hooks' reason), where
    ops=["geglu"] reports it and ops=["swiglu"] leaves it out (a review: it was reported as swiglu)."""
    model = _model(cfg=_gemma4_config())
    for e in _experts(model):
        e.act_fn.register_forward_hook(lambda *args: None)
    for ops, want in ((None, 2), (["geglu"], 2), (["swiglu"], 0)):
        rows = _rows(fuse(model, ops=ops, dry_run=True), model)
        assert len(rows) == want, (ops, rows)
        for r in rows:
            assert (r.kind, r.fused) == ("geglu", False) and "act_fn has forward or backward hooks" in r.reason, r


@pytest.mark.parametrize("how", ["GELUTanh.act", "nn.GELU.approximate"])
def test_an_act_fn_changed_in_place_after_fuse_runs_the_class_gate(how):
    """An attribute of the probed act_fn changed after fuse (GELUTanh's act, nn.GELU's approximate: the erf form
    for the tanh one): the gate runs the class's own (the new activation), not the kernel of the probed one; a copy
    of the model made after the change does the same; set back, the fused gate runs again (a review: the change was
    ignored, 2.5e-3 off)."""
    model = _model(cfg=_gemma4_config())
    if how == "nn.GELU.approximate":
        for e in _experts(model):
            e.act_fn = nn.GELU(approximate="tanh")
    fuse(model, ops=["geglu"])
    e = _experts(model)[0]
    x = torch.randn(5, 2 * 48, generator=torch.Generator().manual_seed(3)) * 3
    before = e._apply_gate(x)
    if how == "GELUTanh.act":
        old, e.act_fn.act = e.act_fn.act, torch.nn.functional.gelu
    else:
        old, e.act_fn.approximate = e.act_fn.approximate, "none"
    want = type(e)._apply_gate(e, x)
    assert not torch.allclose(want, before, rtol=0, atol=1e-4)   # (the two GELUs differ)
    dispatch.reset_stats()
    assert torch.equal(e._apply_gate(x), want) and _geglu_calls() == 0
    clone = copy.deepcopy(model)
    ce = _experts(clone)[0]
    assert torch.equal(ce._apply_gate(x), want) and _geglu_calls() == 0
    if how == "GELUTanh.act":
        e.act_fn.act = old
    else:
        e.act_fn.approximate = old
    assert torch.equal(e._apply_gate(x), before) and _geglu_calls() == 1
    assert unfuse(model)


# ------------------------------------------------------------------------------------------------ refusals
class _Clamped(mixtral.MixtralExperts):
    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate.clamp(max=20.0)) * up.clamp(-20.0, 20.0)


class _Doubled(mixtral.MixtralExperts):
    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return 2 * self.act_fn(gate) * up


class _Interleaved(mixtral.MixtralExperts):
    def _apply_gate(self, gate_up):
        return self.act_fn(gate_up[..., ::2]) * gate_up[..., 1::2]


class _Restated(mixtral.MixtralExperts):
    """transformers' gate, written out again in a subclass: the same function, fused."""

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up


def _hooked_silu(e):
    e.act_fn.register_forward_hook(lambda *args: None)


REFUSALS = {
    "relu": (lambda e: setattr(e, "act_fn", nn.ReLU()), r"act_fn \(ReLU\) is not SiLU or GELU"),
    "hooked_act": (_hooked_silu, r"act_fn has forward or backward hooks"),
    "clamped": (lambda e: setattr(e, "__class__", _Clamped), r"_Clamped\._apply_gate differs .*: a gate of its own"),
    "doubled": (lambda e: setattr(e, "__class__", _Doubled), r"_Doubled\._apply_gate differs .*: a gate of its own"),
    "interleaved": (lambda e: setattr(e, "__class__", _Interleaved),
                    r"_Interleaved\._apply_gate differs .*: a gate of its own"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_experts_that_are_not_plain_swiglu_are_refused_with_the_reason(case):
    """Layer 0's experts changed (a GELU or ReLU act_fn, a hooked SiLU, a subclass with a gate of its own: clamped,
    scaled by 2, interleaved halves): its row is refused with the reason, not eligible, the module untouched (no
    _apply_gate on the instance) and the model's results unchanged; layer 1's experts are fused as usual."""
    model = _model()
    change, reason = REFUSALS[case]
    first, second = _experts(model)
    change(first)
    ref = _step(model)
    report = fuse(model, ops=["swiglu"])
    row0, row1 = _rows(report, model)
    assert (row0.fused, row0.replacement, row0.eligible) == (False, None, False), row0
    assert row0.original == type(first).__name__
    assert re.search(reason, row0.reason), row0.reason
    assert row1.fused and row1.replacement == "FusedExpertsGate", row1
    assert "_apply_gate" not in first.__dict__ and experts_mod.hooked(second)
    got, calls = _counted_step(model)
    assert calls == 1                    # layer 1's gate only
    _assert_equal(got, ref)
    assert unfuse(model)


def test_a_subclass_restating_transformers_gate_is_fused():
    """The probe checks what the class's gate computes, not where it comes from: a subclass that writes
    act_fn(gate) * up out again is fused (against _Doubled, which differs by a factor of 2 and is refused)."""
    model = _model()
    for e in _experts(model):
        e.__class__ = _Restated
    ref = _step(model)
    rows = _rows(fuse(model, ops=["swiglu"]), model)
    assert all(r.fused and r.original == "_Restated" for r in rows), rows
    got, calls = _counted_step(model)
    assert calls == LAYERS
    _assert_equal(got, ref)
    assert unfuse(model)


def test_an_apply_gate_set_on_the_instance_is_refused_and_kept():
    """A user's _apply_gate on the instance (a patch): refused with the reason (eligible: the class's gate would
    pass), left in place and still what runs; fuse sets nothing there."""
    model = _model()
    first, _ = _experts(model)
    calls = []

    def mine(gate_up):
        calls.append(1)
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    first._apply_gate = mine
    ref = _step(model)
    row0, row1 = _rows(fuse(model, ops=["swiglu"]), model)
    assert not row0.fused and row0.eligible and "an _apply_gate set on the instance" in row0.reason, row0
    assert row1.fused
    assert first.__dict__["_apply_gate"] is mine
    calls.clear()
    _assert_equal(_step(model), ref)
    assert calls == [1]
    assert unfuse(model) and first.__dict__["_apply_gate"] is mine


def test_a_forward_set_on_the_instance_is_refused_unless_it_is_accelerates_hook():
    """A forward set on the instance (a patch, another library's wrapper) may not call _apply_gate: refused with the
    reason, eligible, and not counted as not requested when swiglu is left out; accelerate's hook (add_hook_to_module:
    _hf_hook and _old_forward, the class's forward) calls it as before: fused, the gate runs, the model's results."""
    model = _model()
    first, second = _experts(model)
    first.forward = first.forward   # (a bound method set on the instance: the same computation, not vouched for)
    assert fuse(model, ops=["rms_norm"]).not_requested.get("swiglu") == LAYERS - 1
    assert unfuse(model)
    row0, row1 = _rows(fuse(model, ops=["swiglu"]), model)
    assert not row0.fused and row0.eligible and "a forward set on the instance" in row0.reason, row0
    assert row1.fused and not experts_mod.hooked(first) and experts_mod.hooked(second)
    assert unfuse(model)
    del first.forward
    accelerate_hooks = pytest.importorskip("accelerate.hooks")
    ref = _step(model)
    accelerate_hooks.add_hook_to_module(first, accelerate_hooks.ModelHook())
    assert "forward" in first.__dict__ and "_hf_hook" in first.__dict__
    rows = _rows(fuse(model, ops=["swiglu"]), model)
    assert all(r.fused for r in rows) and experts_mod.hooked(first), rows
    got, calls = _counted_step(model)
    assert calls == LAYERS
    _assert_equal(got, ref)
    assert unfuse(model)


def test_a_subclass_with_a_forward_of_its_own_is_reported_as_the_models_code():
    """A subclass overriding forward (no experts implementation dispatched) that computes the product inline: under
    grouped_mm the row says the model's code (before, op swiglu.packed, which never ran: a review), and no call runs
    the op; one whose own forward calls _apply_gate reports the op, which runs."""
    model = _model()
    first, _ = _experts(model)
    base = type(first)

    class Inline(base):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden_states)
            for t in range(hidden_states.shape[0]):
                for k in range(top_k_index.shape[1]):
                    e = int(top_k_index[t, k])
                    gate, up = nn.functional.linear(hidden_states[t], self.gate_up_proj[e]).chunk(2, dim=-1)
                    h = nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e])
                    out[t] = out[t] + h * top_k_weights[t, k]
            return out

    class Gated(Inline):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden_states)
            for t in range(hidden_states.shape[0]):
                for k in range(top_k_index.shape[1]):
                    e = int(top_k_index[t, k])
                    h = self._apply_gate(nn.functional.linear(hidden_states[t:t + 1], self.gate_up_proj[e]))
                    out[t] = out[t] + nn.functional.linear(h[0], self.down_proj[e]) * top_k_weights[t, k]
            return out

    assert model.config._experts_implementation == "grouped_mm"
    for cls, runs in ((Inline, False), (Gated, True)):
        first.__class__ = cls
        ref = _step(model)
        row0, _ = _rows(fuse(model, ops=["swiglu"]), model)
        assert row0.fused and experts_mod.hooked(first), row0
        if runs:
            assert row0.forward != "the model's code" and "op swiglu.packed" in row0.reason, row0
        else:
            assert (row0.forward, row0.backward) == ("the model's code",) * 2, row0
        got, calls = _counted_step(model)
        # (layer 1: one call; Gated's layer one per routed token, Inline's none)
        assert calls > LAYERS - 1 if runs else calls == LAYERS - 1, (cls.__name__, calls)
        _assert_equal(got, ref)
        assert unfuse(model)
    first.__class__ = base


def test_gpt_oss_experts_are_refused():
    """GPT-OSS's experts have a gate of their own (interleaved halves, sigmoid(alpha * gate), (up + 1), a clamp) and
    no act_fn: refused ("no act_fn"); given a SiLU act_fn, still refused, for the clamp (limit 7.0)."""
    if "gpt_oss" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no gpt_oss")
    torch.manual_seed(0)
    model = tr.AutoModelForCausalLM.from_config(tr.AutoConfig.for_model(
        "gpt_oss", hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, layer_types=["full_attention"] * LAYERS)).train()
    experts = _experts(model)
    assert all(type(e).__name__ == "GptOssExperts" for e in experts)
    ref = _step(model)
    rows = _rows(fuse(model, ops=["swiglu"]), model)
    assert len(rows) == LAYERS
    assert all(not r.fused and not r.eligible and r.reason == "GptOssExperts has no act_fn: not transformers' "
               "default gate" for r in rows), rows
    assert not any("_apply_gate" in e.__dict__ for e in experts) and not is_fused(model)
    _assert_equal(_step(model), ref)
    experts[0].act_fn = nn.SiLU()
    found = experts_mod.probe(experts[0])
    assert not found.ok and found.reason == "clamps gate and up at limit=7.0: not plain SwiGLU", found


def test_experts_without_a_gate_are_refused():
    """has_gate=False (Nemotron-H's experts: act_fn of up_proj's output alone): refused with the reason."""
    cfg = _from("nemotron_h", "configuration", "NemotronHConfig")(hidden_size=HIDDEN, moe_intermediate_size=64,
                                                                  n_routed_experts=4, num_experts_per_tok=2)
    e = _from("nemotron_h", "modeling", "NemotronHExperts")(cfg)
    assert e.has_gate is False and experts_mod.candidate(e)
    (row,) = fuse(nn.Sequential(e), ops=["swiglu"]).rows
    assert (row.fused, row.eligible, row.original) == (False, False, "NemotronHExperts"), row
    assert row.reason.startswith("NemotronHExperts has no gate (has_gate False"), row.reason
    assert "_apply_gate" not in e.__dict__


# ------------------------------------------------------------------------------------------------ ops, dry run
def test_swiglu_left_out_of_ops_leaves_the_experts_and_counts_them():
    """ops=["rms_norm"]: no experts row, no gate set, and each experts module the probe accepts counted in
    not_requested["swiglu"] (Mixtral has no other gated MLP)."""
    model = _model()
    report = fuse(model, ops=["rms_norm"])
    assert not _rows(report, model)
    assert report.not_requested.get("swiglu") == LAYERS, report.not_requested
    assert not any("_apply_gate" in e.__dict__ for e in _experts(model))
    _, calls = _counted_step(model)
    assert calls == 0
    assert unfuse(model)


def test_dry_run_sets_no_gate():
    """dry_run=True: the rows say what fuse() would do (fused, FusedExpertsGate) and nothing is set or recorded."""
    model = _model()
    report = fuse(model, dry_run=True)
    rows = _rows(report, model)
    assert report.dry_run and len(rows) == LAYERS and all(r.fused and r.replacement == "FusedExpertsGate"
                                                          for r in rows), rows
    assert not any("_apply_gate" in e.__dict__ for e in _experts(model)) and not is_fused(model)
    _, calls = _counted_step(model)
    assert calls == 0


# ------------------------------------------------------------------------------------------------ after fuse
def test_an_act_fn_replaced_after_fuse_runs_the_class_gate():
    """act_fn replaced by ReLU after fuse(): the fused gate no longer vouches for it and runs the class's gate
    (act_fn(gate) * up): results bit for bit those of an unfused copy with the same ReLU (and not the SiLU model's),
    the op not called."""
    model = _model()
    silu = _step(model)
    relu_model = copy.deepcopy(model)
    fuse(model, ops=["swiglu"])
    for m in (model, relu_model):
        for e in _experts(m):
            e.act_fn = nn.ReLU()
    ref = _step(relu_model)
    assert not torch.equal(ref[0], silu[0])
    got, calls = _counted_step(model)
    assert calls == 0
    _assert_equal(got, ref)
    assert unfuse(model)


def test_a_hook_on_act_fn_added_after_fuse_fires():
    """A forward hook added to the probed SiLU after fuse(): the fused gate runs the class's gate, so the hook fires
    once per layer and forward; results bit for bit, the op not called; the hook removed, the op runs again."""
    model = _model()
    ref = _step(model)
    fuse(model, ops=["swiglu"])
    fired = []
    handles = [e.act_fn.register_forward_hook(lambda *args: fired.append(1)) for e in _experts(model)]
    got, calls = _counted_step(model)
    assert calls == 0 and len(fired) == LAYERS
    _assert_equal(got, ref)
    for h in handles:
        h.remove()
    got, calls = _counted_step(model)
    assert calls == LAYERS
    _assert_equal(got, ref)
    assert unfuse(model)


def _pickled(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_of_a_fused_model_holds_its_own_gate(how):
    """A copy (deepcopy, torch.save / torch.load) of a fused model: each copied gate holds the copy's module and act_fn
    (not the original's), runs the op, and gives the original's results; fuse(copy) reports the rows as fused before
    (a copy), unfuse(copy) raises (fused parts, no record) and changes nothing; unfuse of the original leaves the
    copy's gates."""
    model = _model()
    ref = _step(model)
    fuse(model, ops=["swiglu"])
    twin = copy.deepcopy(model) if how == "deepcopy" else _pickled(model)
    for e, orig in zip(_experts(twin), _experts(model)):
        gate = e.__dict__["_apply_gate"]
        assert isinstance(gate, FusedExpertsGate) and gate is not orig.__dict__["_apply_gate"]
        assert gate.module is e and gate.probed_act is e.act_fn
    got, calls = _counted_step(twin)
    assert calls == LAYERS
    _assert_equal(got, ref)
    rows = _rows(fuse(twin, ops=["swiglu"]), twin)
    assert len(rows) == LAYERS and all(r.fused and "already fused before this call (a copy of a fused model)"
                                       in r.reason for r in rows), rows
    with pytest.raises(RuntimeError, match=r"holds fused modules \(model\.layers\.0\.mlp\.experts and 1 more\) but "
                                           r"fuse\(\) has no record of it"):
        unfuse(twin)
    assert all(experts_mod.hooked(e) for e in _experts(twin))
    assert unfuse(model) is True
    assert all("_apply_gate" not in e.__dict__ for e in _experts(model))
    assert all(experts_mod.hooked(e) for e in _experts(twin))


def test_a_layer_fused_first_is_held_by_the_model_and_reverted_with_it():
    """fuse(model.model.layers[0]) then fuse(model): layer 0's experts row is the earlier call's (fused, its gate
    kept: not set twice), layer 1's is new; unfuse(model) deletes both gates and the layer's record."""
    model = _model()
    ref = _step(model)
    first, second = _experts(model)
    fuse(model.model.layers[0], ops=["swiglu"])
    gate = first.__dict__["_apply_gate"]
    row0, row1 = _rows(fuse(model, ops=["swiglu"]), model)
    assert row0.fused and "fused by an earlier fuse() of model.layers.0 (MixtralDecoderLayer)" in row0.reason, row0
    assert row1.fused and "op swiglu.packed" in row1.reason, row1
    assert first.__dict__["_apply_gate"] is gate and experts_mod.hooked(second)
    got, calls = _counted_step(model)
    assert calls == LAYERS
    _assert_equal(got, ref)
    assert unfuse(model) is True
    assert "_apply_gate" not in first.__dict__ and "_apply_gate" not in second.__dict__
    assert not is_fused(model.model.layers[0]) and not is_fused(model)


def test_an_experts_module_fused_on_its_own_gets_its_gate_and_is_held_by_the_model():
    """fuse(experts) itself (the root of the call: fuse() replaces modules in their parents, but the gate is set on
    the instance, so the root takes it too): one row with path "", the gate set, the model's results; then fuse(model)
    holds that row, and unfuse(model) reverts both calls."""
    model = _model()
    ref = _step(model)
    first, second = _experts(model)
    report = fuse(first, ops=["swiglu"])
    assert [(r.path, r.kind, r.fused, r.replacement) for r in report.rows] == [("", "swiglu", True, "FusedExpertsGate")]
    assert experts_mod.hooked(first) and not experts_mod.hooked(second) and is_fused(first)
    row0, row1 = _rows(fuse(model, ops=["swiglu"]), model)
    assert row0.fused and "fused by an earlier fuse() of model.layers.0.mlp.experts" in row0.reason, row0
    assert row1.fused and "op swiglu.packed" in row1.reason, row1
    got, calls = _counted_step(model)
    assert calls == LAYERS
    _assert_equal(got, ref)
    assert unfuse(model) is True
    assert not experts_mod.hooked(first) and not experts_mod.hooked(second) and not is_fused(first)


def test_a_gate_replaced_by_the_user_after_fuse_is_left_and_named():
    """The user sets their own _apply_gate on layer 1's experts after fuse(): unfuse() restores the rest (layer 0's
    gate deleted) and raises naming _apply_gate; theirs stays."""
    model = _model()
    fuse(model, ops=["swiglu"])
    first, second = _experts(model)

    def mine(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return gate * up

    second._apply_gate = mine
    with pytest.raises(RuntimeError, match=r"MixtralExperts\._apply_gate \(at 'model\.layers\.1\.mlp\.experts'\) "
                                           r"was replaced after fuse\(\)"):
        unfuse(model)
    assert second.__dict__["_apply_gate"] is mine and "_apply_gate" not in first.__dict__
    assert not is_fused(model)


def test_a_gate_deleted_by_the_user_after_fuse_is_already_unfused():
    """The user deletes layer 0's fused gate after fuse() (the class's gate runs again): unfuse() has nothing to
    restore there and succeeds (a walkthrough: it raised that the gate "was replaced")."""
    model = _model()
    fuse(model, ops=["swiglu"])
    first, second = _experts(model)
    del first._apply_gate
    assert unfuse(model) is True
    assert "_apply_gate" not in first.__dict__ and "_apply_gate" not in second.__dict__ and not is_fused(model)


def test_a_deleted_fused_model_frees_its_experts_without_the_cycle_collector():
    """A review: the gate held its module strongly (module.__dict__["_apply_gate"].module is the module), a reference
    cycle, so ``del model`` freed every experts module (in a MoE model most of the weights, and their gradients) only
    when Python's cycle collector next ran: ``del model; torch.cuda.empty_cache()`` gave back none of it. As an unfused
    model's, the experts are freed at once now (the gate holds a weak reference; copies still hold their own module:
    test_a_copy_of_a_fused_model_holds_its_own_gate)."""
    model = _model()
    fuse(model, ops=["swiglu"])
    _step(model)
    refs = [weakref.ref(e) for e in _experts(model)] + [weakref.ref(e.gate_up_proj) for e in _experts(model)]
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    gate = _experts(model)[0].__dict__["_apply_gate"]
    try:
        del model
        alive = [r() for r in refs if r() is not None]
        assert not alive, f"{len(alive)} of the experts modules and weights kept alive by a reference cycle"
    finally:
        if was:
            gc.enable()
    # (a gate kept by hand past its module: a clear error, not AttributeError on None, a walkthrough)
    with pytest.raises(RuntimeError, match="its experts module no longer exists"):
        gate(torch.zeros(2, 2 * 8))


@pytest.mark.parametrize("change", ["class", "class_gate"])
def test_a_gate_of_its_own_given_after_fuse_runs(change):
    """A review: the class's gate changed after fuse() (the module's class set to a subclass with a gate of its own,
    or the class's _apply_gate replaced), which the probe never saw: the fused gate still ran silu(gate) * up and the
    new gate was ignored (a silently different loss). Now the fused gate runs the class's gate where it is no longer
    the one probed; results bit for bit those of an unfused model changed alike, the op not called."""
    model = _model()
    twin = copy.deepcopy(model)
    fuse(model, ops=["swiglu"])
    if change == "class":
        for m in (model, twin):
            for e in _experts(m):
                e.__class__ = _Doubled
        ref = _step(twin)
        got, calls = _counted_step(model)
    else:
        cls = type(_experts(model)[0])
        saved = cls.__dict__["_apply_gate"]
        cls._apply_gate = _Doubled._apply_gate
        try:
            ref = _step(twin)
            got, calls = _counted_step(model)
        finally:
            cls._apply_gate = saved
    assert calls == 0
    _assert_equal(got, ref)
    assert unfuse(model)


# ------------------------------------------------------------------------------------------------ on a GPU
def _cuda_mixtral():
    """A Mixtral of hidden 64 (inter 128, 2 layers) in fp32 on the CPU, each token routed to all 4 experts: no
    rounding can change a routing choice, so runs in other dtypes compare (a near tie picked differently would move
    the loss far more than any gate's rounding)."""
    return _model(cfg=_config(hidden_size=64, intermediate_size=128, num_experts_per_tok=4))


def _parity(fus, unf, ref, dtype):
    """The fused run's loss and each gradient (L2 norm of the error) within twice the unfused run's error from the
    fp32 reference, plus the dtype's tolerance (tests/tolerances.py), as tests/fuse/test_fuse_cuda.py checks."""
    t = TOLERANCES[dtype]
    e_f, e_u = (fus[0].double() - ref[0].double()).abs().item(), (unf[0].double() - ref[0].double()).abs().item()
    assert e_f <= 2 * e_u + t["atol"] + t["rtol"] * ref[0].abs().item(), (e_f, e_u)
    for n, g in ref[1].items():
        g = g.double()
        gs = g.norm().item()
        e_f, e_u = (fus[1][n].double() - g).norm().item(), (unf[1][n].double() - g).norm().item()
        assert e_f <= 2 * e_u + t["atol"] * gs + t["rtol"] * gs, (n, e_f, e_u)


def _bf16_on_cuda(model, kind: str, act64) -> tuple:
    """The bf16 CUDA check of a fp32 CPU MoE model whose experts run grouped_mm (training mode): an fp32 copy with
    eager experts is the reference; the model in bf16 is run unfused, then fused with ops=[kind]: the rows say
    pipegoose, each layer's gate runs the kernel of op <kind>.packed (strict mode), and loss and gradients are within
    twice the unfused run's error from the reference plus bf16's tolerance. The gate itself, on rows of N(0, 16) gates
    and ups: within a bf16 unit (2**-8 relative) of float64's ``act64(gate) * up`` (the kernel computes in fp32 and
    rounds once) and no farther than transformers' bf16 gate (which rounds twice). Returns (fused, unfused) runs;
    the model is unfused again."""
    dev = torch.device("cuda")
    op = f"{kind}.packed"
    ref_model = copy.deepcopy(model).to(dev)
    ref_model.set_experts_implementation("eager")
    ref = _step(ref_model)
    model = model.to(dev, torch.bfloat16)
    assert model.config._experts_implementation == "grouped_mm"
    unf = _step(model)
    rows = _rows(fuse(model, ops=[kind]), model)
    assert len(rows) == LAYERS and all(r.fused and r.forward == "pipegoose" for r in rows), rows
    dispatch.reset_stats()
    try:
        with dispatch.strict():
            fus = _step(model)
        ran = dispatch.stats()
        assert ran.get(op) == {"pipegoose": LAYERS}, ran
        _parity(fus, unf, ref, torch.bfloat16)

        e = _experts(model)[0]
        g = torch.Generator(device="cpu").manual_seed(7)
        x = (torch.randn(512, e.gate_up_proj.shape[1], generator=g) * 4.0).to(dev, torch.bfloat16)
        g64, u64 = x.double().chunk(2, dim=-1)
        want = act64(g64) * u64
        with torch.no_grad(), dispatch.strict():
            got = e._apply_gate(x)
            eager = type(e)._apply_gate(e, x)
        err, err_eager = (got.double() - want).abs(), (eager.double() - want).abs()
        assert bool((err <= (2.0 ** -8 + 2.0 ** -20) * want.abs() + 1e-30).all()), err.max().item()
        assert err.max().item() <= err_eager.max().item(), (err.max().item(), err_eager.max().item())
        return fus, unf
    finally:
        unfuse(model)


@pytest.mark.cuda
def test_mixtral_bf16_on_cuda_runs_the_kernel(no_tuning_table):
    """bf16 on CUDA (grouped_mm, training mode): the rows say pipegoose, each layer's gate runs pipegoose::silu_and_mul
    (strict mode: no fallback); the fused loss and gradients are within twice the unfused run's error from an fp32
    (eager experts) reference plus bf16's tolerance (atol = rtol = 1.6e-2), and within 2e-2 (relative) of the unfused
    loss. The gate itself: the kernel computes in fp32 and rounds once (error within a bf16 unit, 2**-8 relative, of
    the float64 value), transformers' bf16 gate rounds twice (SiLU, then the product): no larger than its error."""
    fus, unf = _bf16_on_cuda(_cuda_mixtral(), "swiglu", lambda g64: g64 * torch.sigmoid(g64))
    torch.testing.assert_close(fus[0].float(), unf[0].float(), rtol=2e-2, atol=0.0)


@pytest.mark.cuda
def test_mixtral_fp32_on_cuda_runs_the_kernel(no_tuning_table):
    """fp32 on CUDA (batched_mm: torch documents grouped_mm's CUDA kernel for bf16), training mode: the kernel runs
    (strict mode), and loss and gradients equal the unfused model's within fp32's tolerance widened 4 times (atol
    4e-5, rtol 4e-4: the kernel's SiLU and PyTorch's round differently in the last place)."""
    dev = torch.device("cuda")
    model = _model(cfg=_config(hidden_size=64, intermediate_size=128, num_experts_per_tok=4),
                   experts_implementation="batched_mm").to(dev)
    unf = _step(model)
    fuse(model, ops=["swiglu"])
    dispatch.reset_stats()
    try:
        with dispatch.strict():
            fus = _step(model)
        assert dispatch.stats().get("swiglu.packed") == {"pipegoose": LAYERS}, dispatch.stats()
        torch.testing.assert_close(fus[0], unf[0], **tol(torch.float32, 4))
        assert fus[1].keys() == unf[1].keys()
        for n, g in unf[1].items():
            torch.testing.assert_close(fus[1][n], g, **tol(torch.float32, 4), msg=lambda m: f"grad of {n}: {m}")
    finally:
        unfuse(model)


@pytest.mark.cuda
@pytest.mark.parametrize("activation", ["gelu_pytorch_tanh", "gelu"])
def test_gemma4_bf16_on_cuda_runs_the_gelu_kernel(no_tuning_table, activation):
    """Gemma 4's GELU experts in bf16 on CUDA (grouped_mm, training mode, each token routed to all 4 experts): the
    rows say pipegoose, each layer's gate runs pipegoose::gelu_and_mul (strict mode); loss and gradients within
    twice the unfused run's error from an fp32 (eager experts) reference plus bf16's tolerance; the gate itself
    within a bf16 unit of float64's value (one rounding) and no farther than transformers' bf16 gate. The float64
    value without cancellation: g * sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3)) and 0.5 g erfc(-g / sqrt(2)) (F.gelu's
    0.5 g (1 + tanh) and 0.5 g (1 + erf) round to 0 in float64 for gates below about -6 and -8, where the kernel's
    fp32 value is right: the test failed there on the H100, session 69)."""
    model = _model(cfg=_gemma4_config(hidden_size=64, moe_intermediate_size=128, top_k_experts=4,
                                      hidden_activation=activation))
    if activation == "gelu_pytorch_tanh":
        def act64(g64):
            return g64 * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (g64 + 0.044715 * g64 ** 3))
    else:
        def act64(g64):
            return 0.5 * g64 * torch.special.erfc(-g64 / math.sqrt(2))
    _bf16_on_cuda(model, "geglu", act64)
