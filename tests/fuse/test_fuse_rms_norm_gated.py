"""The gated RMSNorms of Qwen3-Next's and Qwen3.5's linear attention (``RMSNormGated``: the norm, then ``silu`` of the
gate) and of Mamba2's mixers (``MambaRMSNormGated``: the gate first, over groups; Bamba, Nemotron-H, Granite-4):
:func:`pipegoose.nn.fusion.functional.rms_norm_gated` (op ``rms_norm_gated``; on a GPU by default its implementation
``ops``, op ``rms_norm`` then op ``swiglu``, for the norm first; the one-kernel implementation is tested in
tests/kernels/test_rms_norm_gated_cuda.py), :class:`~pipegoose.nn.fusion.modules.FusedRMSNormGated`, the probe that
tells these formulas from the other gated norms of transformers (Kimi Linear's sigmoid, fp32 weight products), and
``fuse``'s opt-in kind ``rms_norm_gated``. CPU: bit for bit transformers' modules on PyTorch's path; GPU (marker
``cuda``): the kernels against float64, fused models."""

from __future__ import annotations

import copy
import importlib
import pickle

import pytest
import torch
from torch import nn

from pipegoose.nn.fusion import FusedRMSNormGated, dispatch, rms_norm_gated
from pipegoose.nn.fusion.fuse import DEFAULT_OPS, OPS, OPT_IN, fuse, is_fused, unfuse
from pipegoose.nn.fusion.transformers.matching import gated_rms_norm_candidate, probe_rms_norm_gated

from .models import gated_norm

transformers = pytest.importorskip("transformers")

# (modeling module, class, constructor keywords): Qwen3-Next's formula, fused
QWEN_STYLE = [("qwen3_next", "Qwen3NextRMSNormGated", {}), ("qwen3_5", "Qwen3_5RMSNormGated", {}),
              ("qwen3_5_moe", "Qwen3_5MoeRMSNormGated", {}), ("olmo_hybrid", "OlmoHybridRMSNormGated", {})]
# the gate before the norm over groups (Mamba2's and its copies): fused too (since session 79); other gated norms, a
# sigmoid gate in fp32 (Kimi Linear's), silu in fp32 with an fp32 weight product (Lara's): refused
GATE_FIRST = [("mamba2", "Mamba2RMSNormGated", {"group_size": 8}), ("bamba", "BambaRMSNormGated", {"group_size": 8}),
              ("nemotron_h", "NemotronHRMSNormGated", {"group_size": 2}),
              ("granitemoehybrid", "GraniteMoeHybridRMSNormGated", {"group_size": 4})]
OTHERS = [("kimi_linear", "KimiLinearRMSNormGated", {}), ("lara_mini", "LaraMiniRMSNormGated", {})]
FORMS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
         (torch.bfloat16, torch.float32)]


def _norm(modeling, cls, kw, width=16, wdtype=torch.float32, seed=0):
    return gated_norm(modeling, cls, width, wdtype, seed, **kw)


def _inputs(dtype, width=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(3, 5, width, generator=g) + 0.3).to(dtype).requires_grad_()
    gate = (torch.randn(3, 5, width, generator=g) * 2).to(dtype).requires_grad_()
    return x, gate


@pytest.mark.parametrize("dtype, wdtype", FORMS, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("modeling, cls, kw", QWEN_STYLE, ids=[c for _, c, _ in QWEN_STYLE])
def test_the_functional_is_transformers_gated_norm_bit_for_bit(modeling, cls, kw, dtype, wdtype):
    """On PyTorch's path (the CPU) the functional computes what transformers' module does, bit for bit: the output and
    the gradients of x, gate and weight, in fp32, bf16, fp16 and bf16 with an fp32 weight; the ops are recorded."""
    norm = _norm(modeling, cls, kw, wdtype=wdtype)
    x, gate = _inputs(dtype)
    want = norm(x, gate)
    dispatch.reset_stats()
    got = rms_norm_gated(x, gate, norm.weight, norm.variance_epsilon)
    assert got.dtype == want.dtype == dtype and torch.equal(got, want)
    assert dispatch.stats()["rms_norm_gated"] == {"torch": 1}
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    for a, b in zip(torch.autograd.grad(got, (x, gate, norm.weight), dy),
                    torch.autograd.grad(want, (x, gate, norm.weight), dy)):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_the_functional_refuses_bad_input():
    """Errors name the argument: a gate of another shape, dtype or device, not a tensor; x of no dimension."""
    x, gate = _inputs(torch.float32)
    w = torch.ones(16)
    with pytest.raises(ValueError, match="gate: expected x's shape"):
        rms_norm_gated(x, gate[..., :8], w)
    with pytest.raises(TypeError, match="gate: expected a floating point"):
        rms_norm_gated(x, gate.int(), w)
    with pytest.raises(TypeError, match="gate: expected a tensor"):
        rms_norm_gated(x, None, w)
    with pytest.raises(TypeError, match="x: expected a tensor of at least one dimension"):
        rms_norm_gated(torch.tensor(1.0), torch.tensor(1.0), w)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_gated(x, gate, torch.ones(8))


ALL = QWEN_STYLE + GATE_FIRST + OTHERS


@pytest.mark.parametrize("modeling, cls, kw", ALL, ids=[c for _, c, _ in ALL])
def test_the_probe_tells_the_gated_norms_apart(modeling, cls, kw):
    """Qwen3-Next's formula is found (with the module's epsilon, the norm first, whole rows); Mamba2's and its copies'
    gate before a grouped norm too (the gate first, the module's group size); Kimi Linear's sigmoid and Lara's fp32
    weight product are refused with the reason. All are candidates."""
    norm = _norm(modeling, cls, kw)
    assert gated_rms_norm_candidate(norm)
    found = probe_rms_norm_gated(norm)
    if (modeling, cls, kw) in QWEN_STYLE:
        assert found.ok and found.eps == norm.variance_epsilon and found.norm_before_gate, found
        assert found.group_size is None
    elif (modeling, cls, kw) in GATE_FIRST:
        assert found.ok and found.eps == norm.variance_epsilon and not found.norm_before_gate, found
        assert found.group_size == kw["group_size"] and "Mamba2's" in found.reason
    else:
        assert not found.ok and found.candidate, found
        assert "computes another gated norm than Qwen3-Next's" in found.reason, found


def test_the_probe_refuses_near_misses():
    """A (1 + weight) gated norm, one without an epsilon attribute, one that fails on the CPU, and modules that are no
    gated norm (a plain RMSNorm, two parameters) are refused or not candidates."""
    base = _norm("qwen3_5", "Qwen3_5RMSNormGated", {})

    class OnePlus(type(base)):
        def forward(self, hidden_states, gate):
            dt = hidden_states.dtype
            h = hidden_states.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            h = (1 + self.weight) * h.to(dt)
            return (h * nn.functional.silu(gate.float())).to(dt)

    class NoEps(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(16))

        def forward(self, hidden_states, gate):
            return hidden_states

    class GpuOnly(type(base)):
        def forward(self, hidden_states, gate):
            raise RuntimeError("expected a CUDA tensor")

    one_plus = OnePlus(16)
    assert not probe_rms_norm_gated(one_plus).ok
    assert "no eps attribute" in probe_rms_norm_gated(NoEps()).reason
    assert "probe forward failed: RuntimeError: expected a CUDA tensor" in probe_rms_norm_gated(GpuOnly(16)).reason
    llama = importlib.import_module("transformers.models.llama.modeling_llama").LlamaRMSNorm(16)
    assert not gated_rms_norm_candidate(llama) and not probe_rms_norm_gated(llama).candidate
    assert not gated_rms_norm_candidate(nn.Linear(4, 4))


class _Block(nn.Module):
    """A model holding one gated norm, called with its gate."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, x, gate):
        return self.norm(x, gate)


def _qwen_like(forward_norm):
    """A Qwen3.5-style gated norm whose normalisation is ``forward_norm(h, eps)`` (h fp32)."""
    base = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5").Qwen3_5RMSNormGated

    class Norm(base):
        def forward(self, hidden_states, gate):
            dt = hidden_states.dtype
            h = forward_norm(hidden_states.float(), self.variance_epsilon)
            return ((self.weight * h.to(dt)) * nn.functional.silu(gate.float())).to(dt)

    return Norm


def test_the_probe_checks_the_epsilon_near_it():
    """A review: inputs of mean square ~1 barely see eps, so a gated norm that clamps instead of adding it, or whose
    forward uses another value than its attribute, passed the probe (and was fused: outputs off by up to 1.2 on small
    inputs, NaN on zero rows). The probe now also runs inputs whose mean square is near eps and refuses them; the
    module's own form passes; a gate with a default (its model may leave it out) is refused too."""
    pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

    def clamped(h, eps):
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True).clamp_min(eps))

    def other_eps(h, eps):
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-9)

    def right(h, eps):
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)

    for fn, eps in ((clamped, 1e-8), (other_eps, 0.0)):   # (at a mean square of ~1 these agree bit for bit)
        norm = _qwen_like(fn)(16, eps=eps)
        found = probe_rms_norm_gated(norm)
        assert not found.ok and "near eps" in found.reason, (fn.__name__, eps, found)
    assert not probe_rms_norm_gated(_qwen_like(other_eps)(16, eps=1e-6)).ok   # (refused on the first inputs already)
    assert probe_rms_norm_gated(_qwen_like(right)(16, eps=1e-6)).ok
    assert probe_rms_norm_gated(_qwen_like(right)(16, eps=0.0)).ok

    class Optional(_qwen_like(right)):
        def forward(self, hidden_states, gate=None):
            return super().forward(hidden_states, gate)

    found = probe_rms_norm_gated(Optional(16))
    assert not found.ok and "gate=None" in found.reason, found


def test_epsilon_set_while_fused_goes_back_at_unfuse():
    """A review: FusedRMSNormGated kept variance_epsilon as a plain attribute, which unfuse did not carry back (the
    model's module then computed with the old one), and an ``eps`` set on it was written back but never used. Now
    ``eps`` is the one value, ``variance_epsilon`` its checked alias; what is set while fused goes back; a bad value
    is refused naming the attribute; the fused module computes with it."""
    norm = _norm("qwen3_5", "Qwen3_5RMSNormGated", {})

    block = _Block(norm)
    x, gate = _inputs(torch.float32)
    for name in ("variance_epsilon", "eps"):
        fuse(block, ops=["rms_norm_gated"])
        fused = block.norm
        assert isinstance(fused, FusedRMSNormGated)
        setattr(fused, name, 0.5)
        assert fused.eps == fused.variance_epsilon == 0.5
        y = block(x, gate)
        unfuse(block)
        assert block.norm is norm and norm.variance_epsilon == 0.5
        assert torch.equal(norm(x, gate), y)
        norm.variance_epsilon = 1e-6
    with pytest.raises(ValueError, match="variance_epsilon"):
        FusedRMSNormGated(16).variance_epsilon = -1.0
    with pytest.raises(AttributeError):
        FusedRMSNormGated(16).activation = "sigmoid"


def test_a_bad_epsilon_is_an_error_naming_the_module():
    """As for an RMSNorm: a gated norm whose epsilon the ops refuse makes fuse raise, naming its path."""
    norm = _norm("qwen3_5", "Qwen3_5RMSNormGated", {})
    norm.variance_epsilon = -1.0
    holder = nn.ModuleDict({"norm": norm})
    with pytest.raises(ValueError, match=r"norm \(Qwen3_5RMSNormGated\)"):
        fuse(holder, ops=["rms_norm_gated"])
    assert holder["norm"] is norm and not is_fused(holder)


def test_an_fp32_weight_runs_both_ops():
    """A review: with an fp32 weight and bf16 x (mixed precision) the gate ran PyTorch's formula outside the
    dispatcher (not counted, no strict-mode check). Now op swiglu runs it in fp32 (counted), and the result is still
    transformers' module bit for bit on the CPU (implementation ``ops`` of op rms_norm_gated, called as it runs on a
    GPU; the CPU's choice is the reference)."""
    from pipegoose.nn.fusion.ops import rms_norm_gated as op

    norm = _norm("qwen3_5", "Qwen3_5RMSNormGated", {}, wdtype=torch.float32)
    x, gate = _inputs(torch.bfloat16)
    dispatch.reset_stats()
    got = op._two_ops(x, gate, norm.weight, norm.variance_epsilon, None)
    assert dispatch.stats() == {"rms_norm": {"torch": 1}, "swiglu": {"torch": 1}}, dispatch.stats()
    assert got.dtype == torch.bfloat16 and torch.equal(got, norm(x, gate))


def test_fused_module_from_module():
    """from_module shares the weight Parameter and the epsilon; state_dict keys are the module's; the forward is the
    module's bit for bit; pickle and deepcopy keep it; a Mamba2 norm is refused (verify), a plain RMSNorm is not a
    gated one (TypeError); a missing gate and bad constructor arguments raise, naming the argument."""
    norm = _norm("qwen3_5", "Qwen3_5RMSNormGated", {}, wdtype=torch.bfloat16)
    norm.variance_epsilon = 1e-5
    fused = FusedRMSNormGated.from_module(norm)
    assert fused.weight is norm.weight and fused.variance_epsilon == fused.eps == 1e-5
    assert fused.state_dict().keys() == norm.state_dict().keys()
    x, gate = _inputs(torch.bfloat16)
    assert torch.equal(fused(x, gate), norm(x, gate))
    for again in (pickle.loads(pickle.dumps(fused)), copy.deepcopy(fused)):
        assert torch.equal(again(x, gate), norm(x, gate))
    with pytest.raises(ValueError, match="computes another gated norm"):
        FusedRMSNormGated.from_module(_norm("kimi_linear", "KimiLinearRMSNormGated", {}))
    llama = importlib.import_module("transformers.models.llama.modeling_llama").LlamaRMSNorm(16)
    with pytest.raises(TypeError, match="module: expected a gated RMSNorm"):
        FusedRMSNormGated.from_module(llama)
    with pytest.raises(TypeError, match="gate: FusedRMSNormGated with the norm first needs the gate"):
        fused(x)
    with pytest.raises(TypeError, match="hidden_size"):
        FusedRMSNormGated(16.0)
    with pytest.raises(ValueError, match="hidden_size"):
        FusedRMSNormGated(0)
    with pytest.raises(ValueError, match="eps"):
        FusedRMSNormGated(16, eps=-1.0)
    with pytest.raises(ValueError, match="impl"):
        FusedRMSNormGated(16, impl="nope")


def _qwen35(layers=2):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "qwen3_5_text" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no qwen3_5_text")
    cfg = CONFIG_MAPPING["qwen3_5_text"](
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=97, layer_types=["linear_attention", "full_attention"][:layers],
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():   # (a weight of its own, not ones: a dropped weight would show)
        for m in model.modules():
            if type(m).__name__.endswith("RMSNormGated"):
                m.weight.uniform_(0.5, 1.5)
    return model


def _granite4(layers=2):
    """A tiny Granite-4-H (GraniteMoeHybrid): a Mamba2 mixer with its gate-first gated norm over 2 groups of 64, then
    an attention layer."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "granitemoehybrid" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no granitemoehybrid")
    cfg = CONFIG_MAPPING["granitemoehybrid"](
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=97, layer_types=["linear_attention", "full_attention"][:layers], mamba_n_heads=8, mamba_d_head=16,
        mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=8, num_local_experts=0, shared_intermediate_size=128,
        position_embedding_type="rope", pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith("RMSNormGated"):
                m.weight.uniform_(0.5, 1.5)
    return model


def _gated(model):
    return {p: m for p, m in model.named_modules() if type(m).__name__.endswith("RMSNormGated")}


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_fuse_leaves_the_gated_norm_unless_asked():
    """rms_norm_gated is opt-in: fuse() with the default ops leaves Qwen3.5's gated norm as it is and counts it as not
    asked for, naming the opt-in kinds; the kind is in OPS, not in DEFAULT_OPS."""
    assert "rms_norm_gated" in OPS and "rms_norm_gated" in OPT_IN and "rms_norm_gated" not in DEFAULT_OPS
    model = _qwen35()
    report = fuse(model)
    try:
        assert not any(r.kind == "rms_norm_gated" for r in report.rows)
        assert all(type(m).__name__ == "Qwen3_5RMSNormGated" for m in _gated(model).values())
        assert report.not_requested.get("rms_norm_gated") == 1
        assert "rms_norm_gated and linear_cross_entropy only where named" in str(report)
    finally:
        unfuse(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fuse_replaces_the_gated_norm_and_computes_what_it_did(dtype):
    """With rms_norm_gated in ops: the row says what runs, the module is a FusedRMSNormGated sharing the weight, the
    logits and every gradient equal the unfused model's bit for bit on the CPU (the ops' PyTorch paths), the ops ran;
    a dry run changes nothing; unfuse puts the model's own module back (the same object, the same state_dict)."""
    model = _qwen35().to(dtype)
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    ref, ref_g = _step(model, ids)
    before = _gated(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    dry = fuse(model, ops=list(DEFAULT_OPS) + ["rms_norm_gated"], dry_run=True)
    assert [r.fused for r in dry.rows if r.kind == "rms_norm_gated"] == [True] and _gated(model) == before
    report = fuse(model, ops=list(DEFAULT_OPS) + ["rms_norm_gated"])
    rows = [r for r in report.rows if r.kind == "rms_norm_gated"]
    assert len(rows) == 1 and rows[0].fused and rows[0].replacement == "FusedRMSNormGated", rows
    assert "the norm, then silu of the gate" in rows[0].reason and "op rms_norm_gated" in rows[0].reason
    (path, old), = before.items()
    new = model.get_submodule(path)
    assert isinstance(new, FusedRMSNormGated) and new.weight is old.weight
    dispatch.reset_stats()
    got, got_g = _step(model, ids)
    stats = dispatch.stats()
    assert stats["swiglu"] == {"torch": 2} and stats["rms_norm_gated"] == {"torch": 1}, stats   # (two MLPs, a norm)
    assert torch.equal(got, ref) and got_g.keys() == ref_g.keys()
    assert all(torch.equal(got_g[n], ref_g[n]) for n in ref_g)
    assert is_fused(model) and unfuse(model) is True
    assert model.get_submodule(path) is old
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_granite4_is_the_model_bit_for_bit(dtype):
    """A tiny Granite-4-H fused with the default ops and rms_norm_gated: its Mamba2 mixer's gated norm (the gate first,
    2 groups of 64) becomes FusedRMSNormGated of that form; on the CPU the logits and every gradient are the unfused
    model's bit for bit; unfuse restores the module."""
    model = _granite4().to(dtype)
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    ref, ref_g = _step(model, ids)
    (path, old), = _gated(model).items()
    report = fuse(model, ops=list(DEFAULT_OPS) + ["rms_norm_gated"])
    row, = [r for r in report.rows if r.kind == "rms_norm_gated"]
    assert row.fused and "over groups of 64" in row.reason, row
    new = model.get_submodule(path)
    assert isinstance(new, FusedRMSNormGated) and new.group_size == 64 and not new.norm_before_gate
    got, got_g = _step(model, ids)
    assert torch.equal(got, ref) and got_g.keys() == ref_g.keys()
    assert all(torch.equal(got_g[n], ref_g[n]) for n in ref_g)
    assert unfuse(model) and model.get_submodule(path) is old


def test_the_probe_finds_a_mamba2_norm_that_ignores_its_groups():
    """transformers' Mamba2 norms before their group fix (5.17's Mamba2RMSNormGated among them, seen on a GPU machine in
    session 79) normalise the whole row whatever their group_size says: the probe finds that form (the gate first, no
    groups), and the fused module computes it, bit for bit."""
    base = _norm("mamba2", "Mamba2RMSNormGated", {"group_size": 8})

    class WholeRow(type(base)):
        def forward(self, hidden_states, gate=None):
            dt = hidden_states.dtype
            h = hidden_states.to(torch.float32)
            if gate is not None:
                h = h * nn.functional.silu(gate.to(torch.float32))
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return self.weight * h.to(dt)

    norm = WholeRow(16, group_size=8)
    found = probe_rms_norm_gated(norm)
    assert found.ok and not found.norm_before_gate and found.group_size is None, found
    fused = FusedRMSNormGated.from_module(norm)
    x, gate = _inputs(torch.bfloat16)
    assert torch.equal(fused(x, gate), norm(x, gate)) and torch.equal(fused(x), norm(x))


def test_fuse_skips_another_gated_norm_with_the_reason():
    """A model holding Kimi Linear's gated norm (a sigmoid gate) with rms_norm_gated in ops: the row is skipped, not
    eligible, with the probe's reason; the module stays."""
    norm = _norm("kimi_linear", "KimiLinearRMSNormGated", {})

    block = _Block(norm)
    report = fuse(block, ops=["rms_norm_gated"])
    rows = [r for r in report.rows if r.kind == "rms_norm_gated"]
    assert len(rows) == 1 and not rows[0].fused and not rows[0].eligible
    assert "computes another gated norm than Qwen3-Next's" in rows[0].reason
    assert block.norm is norm and not is_fused(block)


@pytest.mark.parametrize("dtype, wdtype", FORMS, ids=lambda d: str(d)[6:])
def test_fuse_takes_mamba2s_gated_norm(dtype, wdtype):
    """Mamba2's gated norm (the gate first, groups of 8) with rms_norm_gated in ops: fused (the same weight, the
    probe's group and order), the row says so; forward and gradients bit for bit the module's on the CPU, with the
    gate and without it (Mamba2's gate=None: the grouped norm alone); unfuse restores it."""
    norm = _norm("mamba2", "Mamba2RMSNormGated", {"group_size": 8}, wdtype=wdtype)
    block = _Block(norm)
    x, gate = _inputs(dtype)
    want = norm(x, gate)
    want_alone = norm(x)
    report = fuse(block, ops=["rms_norm_gated"])
    rows = [r for r in report.rows if r.kind == "rms_norm_gated"]
    assert len(rows) == 1 and rows[0].fused and "Mamba2's" in rows[0].reason and "gate first" in rows[0].reason
    new = block.norm
    assert isinstance(new, FusedRMSNormGated) and new.weight is norm.weight
    assert new.group_size == 8 and not new.norm_before_gate
    got = block(x, gate)
    assert got.dtype == want.dtype and torch.equal(got, want)
    for a, b in zip(torch.autograd.grad(got.sum(), (x, gate, norm.weight)),
                    torch.autograd.grad(want.sum(), (x, gate, norm.weight))):
        assert torch.equal(a, b)
    alone = new(x)
    assert alone.dtype == want_alone.dtype and torch.equal(alone, want_alone)
    assert unfuse(block) and block.norm is norm


# --------------------------------------------------------------------------------------------------- on the GPU


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, wdtype", FORMS, ids=lambda d: str(d)[6:])
def test_the_kernels_compute_the_gated_norm(dtype, wdtype, no_tuning_table):
    """On the GPU the functional runs op rms_norm on its kernel and, where the weight has x's dtype, op swiglu on its
    kernel (counted), rows of 128 (Qwen3.5's value heads) and of an odd 1000; the output and the gradients of x, gate
    and weight against the float64 formula within the dtype's tolerance (scaled for the norm's rounding to x's dtype
    before the weight); the outputs poisoned first, every element written."""
    from kernel_helpers import poison
    from tolerances import tol

    for width in (128, 1000):
        g = torch.Generator(device="cuda").manual_seed(width)
        x = (torch.randn(4, 257, width, device="cuda", generator=g) + 0.3).to(dtype).requires_grad_()
        gate = (torch.randn(4, 257, width, device="cuda", generator=g) * 2).to(dtype).requires_grad_()
        w = (torch.rand(width, device="cuda", generator=g) + 0.5).to(wdtype).requires_grad_()
        dy = torch.randn(x.shape, device="cuda", generator=g).to(dtype)
        poison((x.shape, torch.float32), (x.shape, torch.float32), (x.shape, torch.float32))
        dispatch.reset_stats()
        y = rms_norm_gated(x, gate, w, 1e-6)
        grads = torch.autograd.grad(y, (x, gate, w), dy)
        stats = dispatch.stats()
        assert stats["rms_norm_gated"] == {"ops": 1} and stats["rms_norm"] == {"pipegoose": 1}, stats
        # (op swiglu in fp32 too, with an fp32 weight: on its kernel, counted)
        assert stats.get("swiglu") == {"pipegoose": 1}, stats
        x64, g64, w64 = (t.detach().double().requires_grad_() for t in (x, gate, w))
        h = w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
        want = h * torch.nn.functional.silu(g64)
        want_g = torch.autograd.grad(want, (x64, g64, w64), dy.double())
        assert y.dtype == dtype and bool(torch.isfinite(y).all())
        torch.testing.assert_close(y.double(), want.detach(), **tol(dtype, 2))
        for name, a, b in zip(("x", "gate", "weight"), grads, want_g):
            assert bool(torch.isfinite(a).all()), name
            if name != "weight":
                torch.testing.assert_close(a.double(), b, **tol(dtype, 2), msg=lambda m: f"{name} ({width}): {m}")
                continue
            # (the weight's gradient sums over 1028 rows: the dtype's rtol, an atol relative to its largest value)
            rtol = 2 * tol(wdtype)["rtol"]
            torch.testing.assert_close(a.double(), b, rtol=rtol, atol=rtol * float(b.abs().max()),
                                       msg=lambda m: f"{name} ({width}): {m}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_qwen35_runs_the_gated_norm_on_the_kernels(dtype, no_tuning_table):
    """A tiny Qwen3.5 on the GPU fused with rms_norm_gated: its gated norm runs both kernels, and the logits and
    gradients agree with the unfused model's (fp32 to its rounding; bf16 within the kernels' one rounding against
    eager's)."""
    from tolerances import tol

    model = _qwen35().to("cuda", dtype)
    ids = torch.randint(3, 97, (2, 64), generator=torch.Generator().manual_seed(1)).to("cuda")
    ref, ref_g = _step(model, ids)
    fuse(model, ops=["rms_norm_gated"])
    dispatch.reset_stats()
    got, got_g = _step(model, ids)
    assert dispatch.stats()["swiglu"] == {"pipegoose": 1}, dispatch.stats()
    scale = 1 if dtype == torch.float32 else 4
    torch.testing.assert_close(got, ref, **tol(dtype, scale))
    for n in ref_g:
        torch.testing.assert_close(got_g[n], ref_g[n], **tol(dtype, 8 * scale), msg=lambda m: f"{n}: {m}")
    unfuse(model)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_granite4_runs_the_one_kernel_when_requested(dtype, no_tuning_table, monkeypatch):
    """A tiny Granite-4-H on the GPU fused with rms_norm_gated and PIPEGOOSE_IMPL_RMS_NORM_GATED=pipegoose, strict: its
    gate-first gated norm runs the one kernel (counted), and the logits and gradients agree with the unfused model's
    (fp32 to its rounding; bf16 within the kernel's one rounding against eager's)."""
    from tolerances import tol

    model = _granite4().to("cuda", dtype)
    ids = torch.randint(3, 97, (2, 64), generator=torch.Generator().manual_seed(1)).to("cuda")
    ref, ref_g = _step(model, ids)
    fuse(model, ops=["rms_norm_gated"])
    monkeypatch.setenv("PIPEGOOSE_IMPL_RMS_NORM_GATED", "pipegoose")
    dispatch.reset_stats()
    with dispatch.strict():
        got, got_g = _step(model, ids)
    assert dispatch.stats()["rms_norm_gated"] == {"pipegoose": 1}, dispatch.stats()
    scale = 1 if dtype == torch.float32 else 4
    torch.testing.assert_close(got, ref, **tol(dtype, scale))
    for n in ref_g:
        torch.testing.assert_close(got_g[n], ref_g[n], **tol(dtype, 8 * scale), msg=lambda m: f"{n}: {m}")
    unfuse(model)


# --------------------------------------------------------------------------------------- a breaker's findings (s79)


def test_from_module_takes_the_form_from_the_probe_or_the_caller():
    """from_module(verify=False) of Mamba2's norm gave Qwen3-Next's order and whole rows (off by 1.7): now the order is
    required without the probe; with it, a form given that differs from the probe's is an error, not dropped."""
    norm = _norm("mamba2", "Mamba2RMSNormGated", {"group_size": 8})
    with pytest.raises(ValueError, match="norm_before_gate: required with verify=False"):
        FusedRMSNormGated.from_module(norm, verify=False)
    fused = FusedRMSNormGated.from_module(norm, verify=False, group_size=8, norm_before_gate=False)
    x, gate = _inputs(torch.float32)
    assert torch.equal(fused(x, gate), norm(x, gate))
    with pytest.raises(ValueError, match="group_size, norm_before_gate"):
        FusedRMSNormGated.from_module(norm, group_size=4)
    with pytest.raises(ValueError, match="group_size, norm_before_gate"):
        FusedRMSNormGated.from_module(norm, norm_before_gate=True)
    assert FusedRMSNormGated.from_module(norm, group_size=8, norm_before_gate=False).group_size == 8


def test_a_gated_norm_taking_more_arguments_is_refused():
    """A gated norm whose forward takes more after the gate was reported fused, and the model then failed on its first
    forward (the fused module takes (hidden_states, gate)): now refused with the reason, the module left."""
    base = type(_norm("qwen3_5", "Qwen3_5RMSNormGated", {}))

    class Scaled(base):
        def forward(self, hidden_states, gate, scale=1.0):
            return super().forward(hidden_states, gate) * scale

    norm = Scaled(16)
    found = probe_rms_norm_gated(norm)
    assert not found.ok and found.candidate and "forward takes more than (hidden_states, gate) (scale)" in found.reason
    block = _Block(norm)
    rows = [r for r in fuse(block, ops=["rms_norm_gated"]).rows if r.kind == "rms_norm_gated"]
    assert len(rows) == 1 and not rows[0].fused and block.norm is norm


def test_the_probe_checks_mamba2s_mixed_dtypes_and_numpy_group_sizes():
    """A bf16 Mamba2 mixer passes its norm an fp32 x with a bf16 gate: a norm computing that case otherwise (here: x
    cast to the gate's dtype first) is refused; a numpy group_size is read as the int it is."""
    import numpy as np

    base = type(_norm("mamba2", "Mamba2RMSNormGated", {"group_size": 8}))

    class CastsX(base):
        def forward(self, hidden_states, gate=None):
            if gate is not None:
                hidden_states = hidden_states.to(gate.dtype)
            return super().forward(hidden_states, gate)

    found = probe_rms_norm_gated(CastsX(16, group_size=8))
    assert not found.ok and "float32 x with a bfloat16 gate" in found.reason, found
    found = probe_rms_norm_gated(base(16, group_size=np.int64(8)))
    assert found.ok and found.group_size == 8, found


def test_a_parametrized_gated_norm_gets_a_row():
    """A gated norm whose weight torch.nn.utils.parametrize computes had no row at all (or one under rms_norm): now a
    skipped rms_norm_gated row says why, and the module stays."""
    from torch.nn.utils import parametrize

    class Double(nn.Module):
        def forward(self, w):
            return 2 * w

    norm = _norm("mamba2", "Mamba2RMSNormGated", {"group_size": 8})
    parametrize.register_parametrization(norm, "weight", Double())
    block = _Block(norm)
    report = fuse(block, ops=["rms_norm", "rms_norm_gated"])
    rows = [r for r in report.rows if r.path == "norm"]
    assert len(rows) == 1 and rows[0].kind == "rms_norm_gated" and not rows[0].fused, rows
    assert "parametriz" in rows[0].reason and block.norm is norm


def test_a_wrong_width_names_hidden_states():
    fused = FusedRMSNormGated(8)
    with pytest.raises(ValueError, match=r"hidden_states: expected a tensor \[\.\.\., 8\]"):
        fused(torch.randn(2, 4), torch.randn(2, 4))
