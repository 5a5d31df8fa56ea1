"""fuse(model) and the rotary position embedding (kind ``rope``): the dispatching function under a modeling module's
``apply_rotary_pos_emb``, the hooks of fused attention modules, the probe, the undo (CPU: the reference path runs,
and each call the op takes is counted by ``dispatch.stats()``)."""

from __future__ import annotations

import copy

import pytest
import torch

from pipegoose.nn.fusion import dispatch
from pipegoose.nn.fusion.fuse import fuse, fused, is_fused, unfuse
from pipegoose.nn.fusion.ops import rope as rope_ops
from pipegoose.nn.fusion.transformers import rope as rope_mod

from . import models

transformers = pytest.importorskip("transformers")
ml = pytest.importorskip("transformers.models.llama.modeling_llama")
ORIGINAL = ml.apply_rotary_pos_emb


@pytest.fixture(autouse=True)
def _restore_global():
    """Every test leaves modeling_llama's function as it found it (a failed test must not leak a patch)."""
    yield
    ml.apply_rotary_pos_emb = ORIGINAL
    if isinstance(ORIGINAL, torch.nn.Module) and rope_mod.is_dispatching(ORIGINAL.__dict__.get("forward")):
        del ORIGINAL.__dict__["forward"]
    rope_mod._active.stack = []


def _installed():
    """The dispatching function at modeling_llama's apply_rotary_pos_emb (transformers 5: the forward of the kernels
    wrapper module, which stays the global; older versions: the global itself), or None."""
    return rope_mod.dispatching_of(ml.apply_rotary_pos_emb)


def _restored() -> bool:
    """modeling_llama's function as it was: the same object, with nothing of ours on it."""
    return ml.apply_rotary_pos_emb is ORIGINAL and rope_mod.dispatching_of(ORIGINAL) is None


def _rope_rows(report):
    return [r for r in report.rows if r.kind == "rope"]


def _attention_modules(model):
    return {p: m for p, m in model.named_modules() if type(m).__name__ == "LlamaAttention"}


def _step(model, ids, mask, seed=7):
    """Forward and backward of a fixed random projection of the hidden states (non-padding positions); returns the
    hidden states and the parameters' gradients."""
    model.zero_grad(set_to_none=True)
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    w = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(seed), dtype=hidden.dtype)
    keep = mask.bool()
    (hidden * w)[keep].sum().backward()
    return hidden.detach()[keep], {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rope_calls():
    return sum(dispatch.stats().get("rope", {}).values())


def test_llama_rope_is_fused_per_module_and_unfused_exactly():
    """Every LlamaAttention gets a rope row and the two hooks; modeling_llama's function becomes the dispatching one
    (wrapping the original); the model computes exactly what it did (float64: the op's reference path is transformers'
    formula), forward and backward, and each attention's call went through the op; unfuse takes the hooks away and
    puts the very same function object back."""
    model = models.build("llama", "eager").double()
    ids, mask = models.inputs(left_pad=(0, 0, 0))   # (transformers' eager float64 attention gives padded rows NaN)
    ref_h, ref_g = _step(model, ids, mask)
    attn = _attention_modules(model)
    assert len(attn) == 2

    report = fuse(model, ops=["rope"])
    rows = _rope_rows(report)
    assert sorted(r.path for r in rows) == sorted(attn)
    assert all((r.original, r.replacement, r.fused, r.eligible) == ("LlamaAttention", "rope hooks", True, True)
               for r in rows), rows
    assert all("modeling_llama.apply_rotary_pos_emb, the rotate-half RoPE (probed)" in r.reason for r in rows), rows
    assert report.eligible == report.covered == 2
    d = _installed()
    assert d is not None
    if isinstance(ORIGINAL, torch.nn.Module):   # the wrapper module stays the global (it pickles by name)
        assert ml.apply_rotary_pos_emb is ORIGINAL and ORIGINAL.__dict__["forward"] is d
    else:
        assert d.__wrapped__ is ORIGINAL
    assert all(rope_mod.hooked(m) for m in attn.values())
    assert _attention_modules(model) == attn          # nothing replaced

    dispatch.reset_stats()
    h, g = _step(model, ids, mask)
    assert _rope_calls() == 2                         # one per attention module and forward
    torch.testing.assert_close(h, ref_h, rtol=0, atol=0)
    assert g.keys() == ref_g.keys()
    for n in ref_g:
        torch.testing.assert_close(g[n], ref_g[n], rtol=1e-12, atol=1e-12, msg=lambda m: f"grad of {n}: {m}")
    assert not rope_mod._active.stack

    assert unfuse(model) is True and not is_fused(model)
    assert _restored()
    assert not any(rope_mod.hooked(m) for m in attn.values())
    dispatch.reset_stats()
    _step(model, ids, mask)
    assert _rope_calls() == 0


def test_other_models_keep_the_original_function():
    """While one Llama is fused, another Llama in the process (same modeling module) runs the original function:
    the dispatching function passes its calls through (no call of the op)."""
    fused_model = models.build("llama", "eager")
    other = models.build("llama", "eager", seed=1)
    ids, mask = models.inputs()
    ref = other(input_ids=ids, attention_mask=mask).last_hidden_state
    fuse(fused_model, ops=["rope"])
    dispatch.reset_stats()
    out = other(input_ids=ids, attention_mask=mask).last_hidden_state
    assert _rope_calls() == 0
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    fused_model(input_ids=ids, attention_mask=mask)
    assert _rope_calls() == 2
    # a direct call of the function outside any fused forward: the original
    dispatch.reset_stats()
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8)
    cos, sin = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    got = ml.apply_rotary_pos_emb(q, k, cos, sin)
    want = ORIGINAL(q, k, cos, sin)
    assert _rope_calls() == 0 and all(torch.equal(a, b) for a, b in zip(got, want))
    unfuse(fused_model)


def test_the_function_goes_back_with_the_last_fused_model():
    """Two fused Llamas share the dispatching function: unfusing the first keeps it (the second still uses it),
    unfusing the second puts the original back."""
    a, b = models.build("llama", "eager"), models.build("llama", "eager", seed=1)
    fuse(a, ops=["rope"])
    fn = _installed()
    fuse(b, ops=["rope"])
    assert _installed() is fn is not None              # installed once
    unfuse(a)
    assert _installed() is fn
    ids, mask = models.inputs()
    dispatch.reset_stats()
    b(input_ids=ids, attention_mask=mask)
    assert _rope_calls() == 2
    unfuse(b)
    assert _restored()


def test_a_function_replaced_while_fused_is_left_alone():
    """A library that patches modeling_llama.apply_rotary_pos_emb after fuse() (Liger-Kernel does) keeps its patch
    at unfuse: the hooks go, the global is not touched."""
    model = models.build("llama", "eager")
    fuse(model, ops=["rope"])

    def theirs(q, k, cos, sin, unsqueeze_dim=1):
        return ORIGINAL(q, k, cos, sin, unsqueeze_dim)

    ml.apply_rotary_pos_emb = theirs
    assert unfuse(model) is True
    assert ml.apply_rotary_pos_emb is theirs and rope_mod.dispatching_of(ORIGINAL) is None
    assert not any(rope_mod.hooked(m) for m in _attention_modules(model).values())


def test_a_function_that_is_not_the_rotate_half_rope_is_skipped():
    """The probe refuses a function that computes another rotation (the transposed one: sin of the other sign, in
    both the rotate-half and the interleaved form), fails on float64 CPU inputs (a GPU-only patch) or rotates one
    tensor a call (Gemma 4's form) by another formula: rows skipped, not eligible, with the reason; no hooks, no
    global change. (The interleaved rotation itself, Cohere's and GLM's, is fused since session 71:
    test_fuse_rope_interleaved.py; one tensor a call, GPT-J's and Gemma 4's, since session 78:
    test_fuse_rope_one_tensor.py.)"""
    def transposed(q, k, cos, sin, unsqueeze_dim=1):
        c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * c - rope_ops.rotate_half(q) * s, k * c - rope_ops.rotate_half(k) * s

    def transposed_pairs(q, k, cos, sin, unsqueeze_dim=1):
        c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * c - rope_ops.rotate_half(q, True) * s, k * c - rope_ops.rotate_half(k, True) * s

    def gpu_only(q, k, cos, sin, unsqueeze_dim=1):
        raise RuntimeError("expected a CUDA tensor")

    def one_tensor(x, cos, sin, unsqueeze_dim=1):   # (Gemma 4's form: one tensor a call)
        return x * cos.unsqueeze(unsqueeze_dim) + x * sin.unsqueeze(unsqueeze_dim)

    for fn, why in ((transposed, "does not compute the rotate-half RoPE"),
                    (transposed_pairs, "nor its interleaved form"),
                    (gpu_only, "failed on float64 CPU inputs: RuntimeError: expected a CUDA"),
                    (one_tensor, "apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim) rotates one tensor a call, and "
                                 "computes none of the rotations")):
        ml.apply_rotary_pos_emb = fn
        model = models.build("llama", "eager")
        report = fuse(model, ops=["rope"])
        rows = _rope_rows(report)
        assert len(rows) == 2 and all(not r.fused and not r.eligible and why in r.reason for r in rows), rows
        assert ml.apply_rotary_pos_emb is fn and not is_fused(model)
        assert not any(rope_mod.hooked(m) for m in _attention_modules(model).values())


def test_dry_run_changes_nothing():
    model = models.build("llama", "eager")
    report = fuse(model, dry_run=True)
    assert len([r for r in _rope_rows(report) if r.fused]) == 2
    assert _restored()
    assert not any(rope_mod.hooked(m) for m in _attention_modules(model).values())


def test_a_forward_that_raises_leaves_no_count_behind():
    """The hook that ends a fused forward is always called: after a forward that raised, calls outside fused modules
    go to the original again."""
    model = models.build("llama", "eager")
    fuse(model, ops=["rope"])
    attn = next(iter(_attention_modules(model).values()))
    with pytest.raises(Exception):
        attn(torch.randn(1, 3, model.config.hidden_size), position_embeddings=None)   # (cos, sin = None: TypeError)
    assert not rope_mod._active.stack
    unfuse(model)


def test_gpt_neox_partial_rotary_runs_the_original(monkeypatch):
    """GPT-NeoX's function handles partial rotary itself (partial_rotary_factor < 1, Pythia's default: cos narrower
    than the head). On the CPU the kernel's partial path cannot run: the modules are fused (hooked: whether the kernel
    takes a call is asked per call), the report says that their calls run the model's own code here and why, and they
    do, exactly (PyTorch's reference path never runs), each call recorded as the op's fallback (counted as torch;
    strict mode refuses it, as it refuses whole-head calls on the CPU); with a factor of 1 they run the op."""
    def no_reference(*args, **kwargs):
        raise AssertionError("PyTorch's reference path ran for a partial-rotary call")

    for pct in (0.25, 1.0):
        cfg = models.config("gpt_neox", "eager")
        cfg.rope_parameters = {**cfg.rope_parameters, "partial_rotary_factor": pct}
        model = models.build("gpt_neox", "eager", cfg=cfg).double()
        ids, mask = models.inputs(left_pad=(0, 0, 0))
        ref_h, ref_g = _step(model, ids, mask)
        report = fuse(model, ops=["rope"])
        rows = _rope_rows(report)
        assert len(rows) == 2 and all(r.fused and r.eligible for r in rows), rows
        if pct < 1:
            rotary = int(model.config.hidden_size // model.config.num_attention_heads * pct)
            for r in rows:
                assert (r.forward, r.backward) == ("the model's code (fallback)",) * 2, r
                assert f"GPT-NeoX's partial rotary, {rotary} of each head's values (probed)" in r.reason, r.reason
                assert r.reason.endswith("here now the model's own code: pipegoose: needs a CUDA tensor, got device "
                                         "cpu"), r.reason
            assert "no: the model's code (fallback)" in str(report)
            monkeypatch.setattr(rope_ops, "rope_reference", no_reference)
        dispatch.reset_stats()
        h, g = _step(model, ids, mask)
        assert dispatch.stats()["rope"] == {"torch": 2}
        torch.testing.assert_close(h, ref_h, rtol=1e-12, atol=1e-12)
        for n in ref_g:
            torch.testing.assert_close(g[n], ref_g[n], rtol=1e-10, atol=1e-12)
        with dispatch.strict(), pytest.raises(dispatch.FusionFallbackError, match="rope: strict mode"):
            _step(model, ids, mask)
        monkeypatch.undo()
        unfuse(model)


def test_gpt_neox_partial_rotary_fused_on_the_cpu_runs_the_kernel_once_it_can(monkeypatch):
    """A review: fuse(model) on the CPU (from_pretrained loads there; the Trainer moves the model afterwards) used to
    leave GPT-NeoX's partial rotary unfused for good, because fuse asked the dispatcher once, at the CPU. Now the same
    fused model runs the kernel's path as soon as the dispatcher takes its calls (here the kernel's CPU stand-in, its
    supports() asked as on a GPU), and the model's own code again when it no longer does."""
    from rope_stand_in import kernel_on_cpu

    model = models.build("gpt_neox", "eager")   # partial_rotary_factor 0.25
    ids, mask = models.inputs(left_pad=(0, 0, 0))
    ref_h, _ = _step(model, ids, mask)
    rows = _rope_rows(fuse(model, ops=["rope"]))
    assert rows and all(r.fused and r.forward == "the model's code (fallback)" for r in rows), rows
    layers = model.config.num_hidden_layers
    with kernel_on_cpu(monkeypatch, dispatch) as calls:
        dispatch.clear_choice_cache()
        dispatch.reset_stats()
        h, _ = _step(model, ids, mask)
        assert dispatch.stats()["rope"] == {"pipegoose": layers}
        names = [c[0] for c in calls]
        assert names.count("rope_forward") == names.count("rope_backward") == layers
    torch.testing.assert_close(h, ref_h, rtol=1e-5, atol=1e-5)
    dispatch.clear_choice_cache()
    dispatch.reset_stats()
    h, _ = _step(model, ids, mask)
    assert dispatch.stats()["rope"] == {"torch": layers}   # the model's own code, recorded as the op's fallback
    torch.testing.assert_close(h, ref_h, rtol=0, atol=0)
    unfuse(model)


def test_gpt_neox_partial_rotary_on_the_kernel_path(monkeypatch):
    """Where the kernel's partial path runs (on a GPU; here the kernel's ops replaced by a CPU stand-in, its supports()
    asked as on a GPU), GPT-NeoX's attention modules are fused: the report names the partial rotary and the
    implementation; each layer's call runs the kernel's forward op once and its backward op once, on whole heads (the
    tables narrower: the kernel passes the rest through); the model computes what it computed (fp32: the stand-in rounds once where eager rounds each op);
    unfuse puts the function back. PIPEGOOSE_IMPL_ROPE=torch keeps their calls to the model's code (the report says
    so), also when set after fuse."""
    from rope_stand_in import kernel_on_cpu

    neox = pytest.importorskip("transformers.models.gpt_neox.modeling_gpt_neox")
    model = models.build("gpt_neox", "eager")   # partial_rotary_factor 0.25, Pythia's default
    assert model.config.rope_parameters["partial_rotary_factor"] == 0.25
    ids, mask = models.inputs(left_pad=(0, 0, 0))
    ref_h, ref_g = _step(model, ids, mask)
    original = neox.apply_rotary_pos_emb
    with kernel_on_cpu(monkeypatch, dispatch) as calls:
        monkeypatch.setenv("PIPEGOOSE_IMPL_ROPE", "torch")
        rows = _rope_rows(fuse(model, ops=["rope"], dry_run=True))
        assert rows and all(r.fused and r.forward == "the model's code" for r in rows), rows   # asked: no fallback
        monkeypatch.delenv("PIPEGOOSE_IMPL_ROPE")
        rows = _rope_rows(fuse(model, ops=["rope"]))
        rotary = model.layers[0].attention.rotary_ndims if hasattr(model, "layers") else None
        assert len(rows) == model.config.num_hidden_layers and all(r.fused for r in rows), rows
        assert all(r.forward == "pipegoose" and "GPT-NeoX's partial rotary" in r.reason for r in rows), rows
        dispatch.reset_stats()
        h, g = _step(model, ids, mask)
        assert dispatch.stats()["rope"] == {"pipegoose": model.config.num_hidden_layers}
        names = [c[0] for c in calls]
        assert names.count("rope_forward") == names.count("rope_backward") == model.config.num_hidden_layers
        head = model.config.hidden_size // model.config.num_attention_heads
        assert rotary is None or rotary < head
        assert all(c[1].shape[-1] == c[2].shape[-1] == head for c in calls)
        monkeypatch.setenv("PIPEGOOSE_IMPL_ROPE", "torch")
        dispatch.reset_stats()
        before = len(calls)
        h_torch, _ = _step(model, ids, mask)
        assert dispatch.stats()["rope"] == {"torch": model.config.num_hidden_layers} and len(calls) == before
        monkeypatch.delenv("PIPEGOOSE_IMPL_ROPE")
        unfuse(model)
    torch.testing.assert_close(h_torch, ref_h, rtol=0, atol=0)
    assert neox.apply_rotary_pos_emb is original
    torch.testing.assert_close(h, ref_h, rtol=1e-5, atol=1e-5)
    for n in ref_g:
        torch.testing.assert_close(g[n], ref_g[n], rtol=1e-4, atol=1e-5)


def test_partial_rotary_per_layer_type_is_told_apart():
    """A config whose rope_parameters hold a factor per layer type (Laguna, MiMo-V2-Flash, ...): each layer's own
    factor is read (a review: it was not, the partial layers were taken for whole-head ones, and their partial calls,
    not routed for, fell to the reference, which strict mode refused): the partial layer runs the kernel's partial path,
    the whole-head one its plain path, and strict mode runs the model."""
    from rope_stand_in import kernel_on_cpu

    tr = pytest.importorskip("transformers")
    if not hasattr(tr, "LagunaConfig"):
        pytest.skip("transformers without Laguna")
    cfg = tr.LagunaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=2,
                          num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                          mlp_layer_types=["dense", "dense"], layer_types=["full_attention", "sliding_attention"])
    assert cfg.rope_parameters["full_attention"]["partial_rotary_factor"] < 1
    torch.manual_seed(0)
    model = tr.AutoModel.from_config(cfg, attn_implementation="eager").eval()
    ids = torch.randint(1, 64, (2, 7))
    with torch.no_grad():
        ref = model(input_ids=ids).last_hidden_state
    monkeypatch = pytest.MonkeyPatch()
    try:
        with kernel_on_cpu(monkeypatch, dispatch):
            rows = {r.path: r for r in _rope_rows(fuse(model, ops=["rope"]))}
            part = rows["layers.0.self_attn"]
            assert part.fused and "GPT-NeoX's partial rotary, 8 of each head's values" in part.reason, part
            assert rows["layers.1.self_attn"].fused, rows   # the sliding layer rotates whole heads
            dispatch.reset_stats()
            with dispatch.strict(), torch.no_grad():
                out = model(input_ids=ids).last_hidden_state
            # (on the stand-in, which rounds once where eager rounds each op)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            assert dispatch.stats()["rope"] == {"pipegoose": 2}
            unfuse(model)
    finally:
        monkeypatch.undo()


def test_partial_calls_from_a_module_fused_for_whole_heads_are_chosen_per_call(monkeypatch):
    """A GPT-NeoX fused with full rotary whose tables are then made narrow (its rotary embedding replaced): its partial
    calls are chosen per call as any fused module's (GPT-NeoX's function computes partial rotary, probed): on the CPU
    the model's own code, exactly, recorded as the op's fallback; where the kernel takes them (its CPU stand-in), the
    kernel. (Before session 58 only modules that fuse had found partial were routed; a copy of such a model lost that.)"""
    from rope_stand_in import kernel_on_cpu

    cfg = models.config("gpt_neox", "eager")
    cfg.rope_parameters = {**cfg.rope_parameters, "partial_rotary_factor": 1.0}
    model = models.build("gpt_neox", "eager", cfg=cfg).double()
    ids, mask = models.inputs(left_pad=(0, 0, 0))
    assert all(r.fused for r in _rope_rows(fuse(model, ops=["rope"])))
    narrow = models.config("gpt_neox", "eager")
    narrow.rope_parameters = {**narrow.rope_parameters, "partial_rotary_factor": 0.5}
    model.rotary_emb = type(model.rotary_emb)(narrow)
    layers = model.config.num_hidden_layers
    dispatch.reset_stats()
    h, g = _step(model, ids, mask)
    assert dispatch.stats()["rope"] == {"torch": layers}
    with kernel_on_cpu(monkeypatch, dispatch) as calls:
        dispatch.clear_choice_cache()
        _step(copy.deepcopy(model).float(), ids, mask)   # a copy too (its hooks came with it), fp32 for the kernel
        names = [c[0] for c in calls]
        assert names.count("rope_forward") == names.count("rope_backward") == layers
    dispatch.clear_choice_cache()
    unfuse(model)
    ref_h, ref_g = _step(model, ids, mask)
    torch.testing.assert_close(h, ref_h, rtol=0, atol=0)


def test_a_copy_of_a_fused_model_is_told_apart():
    """deepcopy copies the hooks (the copy keeps running the op while the function is installed); unfuse of the copy
    says it has no record, and unfuse of the original still works."""
    model = models.build("llama", "eager")
    fuse(model, ops=["rope"])
    twin = copy.deepcopy(model)
    assert all(rope_mod.hooked(m) for m in _attention_modules(twin).values())
    with pytest.raises(RuntimeError, match="holds fused modules"):
        unfuse(twin)
    assert unfuse(model) is True and _restored()


def test_parts_fused_first_are_reported_and_reverted_with_the_model():
    """fuse(layer) then fuse(model): the layer's attention is reported as fused by the earlier call (not hooked
    twice); unfuse(model) reverts both."""
    model = models.build("llama", "eager")
    layer = model.layers[0]
    fuse(layer, ops=["rope"])
    report = fuse(model, ops=["rope"])
    rows = {r.path: r for r in _rope_rows(report)}
    assert rows["layers.0.self_attn"].fused and "earlier fuse() of layers.0" in rows["layers.0.self_attn"].reason
    assert len(model.layers[0].self_attn._forward_pre_hooks) == 1
    assert unfuse(model) is True
    assert not is_fused(layer) and _restored()
    assert not any(rope_mod.hooked(m) for m in _attention_modules(model).values())


def test_fused_context_manager():
    model = models.build("llama", "eager")
    with fused(model, ops=["rope"]):
        assert _installed() is not None
    assert _restored() and not is_fused(model)


# --- review of session 48: dtypes the model's function casts back, calls the kernel would not take, pickling, Ctrl-C,
# --- per-layer configs (each reproduced on the code before its fix)
def _calls_and_output(model, *args, **kwargs):
    dispatch.reset_stats()
    out = model(*args, **kwargs)
    return _rope_calls(), out


def _olmo(name: str, dtype=torch.bfloat16):
    """A tiny OLMo (``name``: Olmo or Olmo2) in ``dtype`` (its rotary tables stay fp32), or a skip."""
    cls = getattr(transformers, f"{name}Config", None)
    if cls is None:
        pytest.skip(f"this transformers has no {name}")
    cfg = cls(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=97,
              pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(cfg, attn_implementation="eager").to(dtype).eval()


@pytest.mark.parametrize("name", ["Olmo", "Olmo2"])
def test_a_function_that_casts_back_keeps_its_dtype(name, monkeypatch):
    """OLMo's apply_rotary_pos_emb casts its results to q's dtype, and its rotary tables stay fp32 in a bf16 model, so
    every call of a bf16 OLMo is bf16 q with fp32 tables. A review: the probe found that it does not promote (as
    Llama's does, and the op), and those calls ran OLMo's code uncounted: the report said fused, strict mode let them
    through, the op never ran. Now the probe finds that the function computes them in fp32 and casts back: each call
    runs the kernel where the dispatcher chooses it, its fp32 results cast to bf16 (the kernel rounds once where OLMo
    rounds each op: within the op's rounding), else OLMo's own code, recorded as the op's fallback (counted; strict mode
    refuses it on the CPU, as it refuses Llama's); the report says so."""
    from rope_stand_in import kernel_on_cpu

    model = _olmo(name)
    layers = model.config.num_hidden_layers
    ids = torch.randint(2, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    ref = model(input_ids=ids).last_hidden_state
    rows = _rope_rows(fuse(model, ops=["rope"]))
    assert len(rows) == layers and all(r.fused for r in rows), rows
    assert all(r.forward == "the model's code (fallback)" and "cast to q's dtype" in r.reason for r in rows), rows
    calls, out = _calls_and_output(model, input_ids=ids)
    assert calls == layers and dispatch.stats()["rope"] == {"torch": layers}
    assert out.last_hidden_state.dtype == torch.bfloat16
    torch.testing.assert_close(out.last_hidden_state, ref, rtol=0, atol=0)   # OLMo's own code
    with dispatch.strict(), pytest.raises(dispatch.FusionFallbackError, match="rope: strict mode"):
        model(input_ids=ids)
    # where the kernel takes them (its CPU stand-in): bf16 q and k, fp32 tables in; bf16 out, as OLMo's
    unfused = _olmo(name, torch.float32)
    with torch.no_grad():
        exact = unfused(input_ids=ids).last_hidden_state
    with kernel_on_cpu(monkeypatch, dispatch) as kernel_calls:
        dispatch.clear_choice_cache()
        dispatch.reset_stats()
        model.train()
        out = model(input_ids=ids).last_hidden_state
        assert dispatch.stats()["rope"] == {"pipegoose": layers}
        out.float().square().sum().backward()
        fwd = [c for c in kernel_calls if c[0] == "rope_forward"]
        assert len(fwd) == layers and all(c[1].dtype == torch.bfloat16 for c in fwd)
        assert sum(c[0] == "rope_backward" for c in kernel_calls) == layers
    dispatch.clear_choice_cache()
    assert out.dtype == torch.bfloat16
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters() if p.requires_grad)
    # (bf16 against the fp32 model: as close as OLMo's own bf16 code is)
    err, err_own = (out.float() - exact).abs().max(), (ref.float() - exact).abs().max()
    assert err <= 2 * err_own + 1e-2, (err, err_own)
    # Llama's function promotes (fp32 results), as the kernel: its mixed calls are the op's, as they are
    assert rope_mod.probe(ORIGINAL).promotes
    unfuse(model)


def test_calls_whose_dtypes_the_function_computes_otherwise_are_the_ops_fallback(monkeypatch):
    """A fused module's call of the kernel's shapes whose dtypes the model's function computes otherwise than the op
    (here, 16-bit q with fp32 tables under autocast, results of a third dtype) runs the model's own code, recorded as
    the op's fallback with the reason (it ran uncounted, a review), also where the dispatcher would choose the kernel
    (its CPU stand-in); strict mode refuses it."""
    from rope_stand_in import kernel_on_cpu

    def odd(q, k, cos, sin, unsqueeze_dim=1):
        q_embed, k_embed = ORIGINAL(q, k, cos, sin, unsqueeze_dim)
        mixed = q.dtype != cos.dtype
        return (q_embed.half(), k_embed.half()) if mixed else (q_embed, k_embed)

    ml.apply_rotary_pos_emb = odd
    model = models.build("llama", "eager")
    ids, mask = models.inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    assert all(r.fused for r in _rope_rows(fuse(model, ops=["rope"])))
    with kernel_on_cpu(monkeypatch, dispatch) as calls:
        dispatch.clear_choice_cache()
        dispatch.reset_stats()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        assert dispatch.stats()["rope"] == {"torch": 2} and not calls
        assert "computes bfloat16 q and k with float32 cos and sin otherwise than the op" in str(
            dispatch.last_choice("rope"))
        with dispatch.strict(), pytest.raises(dispatch.FusionFallbackError, match="otherwise than the op"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(input_ids=ids, attention_mask=mask, use_cache=False)
    dispatch.clear_choice_cache()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert rope_mod.probe(odd).kind(torch.bfloat16, torch.float32) is None
    unfuse(model)


# a module of this test file whose forward calls this file's apply_rotary_pos_emb: q of the last positions only, k, cos
# and sin of every position (MuseGlimmerAssistant's window over its context), the tables cut by the function itself
def apply_rotary_pos_emb(q, k, cos, sin):
    def rot(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    cq, sq = cos[:, -q.shape[2]:].unsqueeze(1), sin[:, -q.shape[2]:].unsqueeze(1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cq + rot(q) * sq, k * c + rot(k) * s


class _WindowAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8, dtype=torch.float64)

    def forward(self, q, k, cos, sin):
        q, k = apply_rotary_pos_emb(self.proj(q), k, cos, sin)
        return q.sum() + k.sum()


def test_calls_the_kernel_would_not_take_run_the_models_code():
    """A call whose q covers fewer positions than k and the tables passed the old check (ranks and head size) and ran
    the op's reference formula, which is not this function's: it raised. Only calls of the shapes the kernel takes
    reach the op; this one runs the model's own function, exactly."""
    import sys

    here = sys.modules[__name__]
    mod = _WindowAttention()
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 3, 8, dtype=torch.float64, generator=g)
    k = torch.randn(1, 1, 8, 8, dtype=torch.float64, generator=g)
    cos, sin = torch.randn(1, 8, 8, dtype=torch.float64), torch.randn(1, 8, 8, dtype=torch.float64)
    ref = mod(q, k, cos, sin)
    original = here.apply_rotary_pos_emb
    holder = torch.nn.ModuleDict({"attn": mod})   # (fuse considers a model's submodules)
    try:
        report = fuse(holder, ops=["rope"])
        assert [r.fused for r in _rope_rows(report)] == [True]
        assert rope_mod.is_dispatching(here.apply_rotary_pos_emb)
        calls, out = _calls_and_output(mod, q, k, cos, sin)
        assert calls == 0 and torch.equal(out, ref)
        # the same module with q over every position: the op's shapes, and its call
        q8 = torch.randn(1, 2, 8, 8, dtype=torch.float64, generator=g)
        ref8 = original(mod.proj(q8), k, cos, sin)
        calls, out = _calls_and_output(mod, q8, k, cos, sin)
        assert calls == 1 and torch.allclose(out, ref8[0].sum() + ref8[1].sum(), rtol=1e-12, atol=1e-12)
    finally:
        unfuse(holder)
    assert here.apply_rotary_pos_emb is original


def _masked_lm(model_type: str, dtype=torch.float32):
    """A tiny ESM (rotary position embedding) or ModernBERT masked LM in ``dtype``, or a skip."""
    cfg = models.rope_config(model_type)
    torch.manual_seed(0)
    return transformers.AutoModelForMaskedLM.from_config(cfg, attn_implementation="eager").to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type", ["esm", "modernbert"])
def test_functions_that_compute_in_fp32_and_calls_with_unsqueeze_dim_are_fused(model_type, dtype, monkeypatch):
    """ESM's and ModernBERT's apply_rotary_pos_emb compute rotate-half on q.float() and cast back, and their attention
    calls it with unsqueeze_dim=1 as a keyword. A review: the probe fed float64 inputs, which q.float() rounds, and
    skipped both as "does not compute the rotate-half RoPE"; and every call with a keyword ran the model's code. Now
    the probe finds the formula to fp32's rounding (their float64 calls run their own code, as the op's fallback),
    the keyword is taken: each attention's call is the op's (fp32: its PyTorch path, bit for bit; bf16: the kernel
    where the dispatcher chooses it, else the model's own code), and the model computes what it did."""
    from rope_stand_in import kernel_on_cpu

    model = _masked_lm(model_type, dtype)
    layers = model.config.num_hidden_layers
    ids = torch.randint(4, 30, (2, 8), generator=torch.Generator().manual_seed(0))
    ref = model(input_ids=ids).logits
    rows = _rope_rows(fuse(model, ops=["rope"]))
    assert len(rows) == layers and all(r.fused and r.eligible for r in rows), rows
    assert all("the rotate-half RoPE (probed)" in r.reason for r in rows), rows
    calls, out = _calls_and_output(model, input_ids=ids)
    assert dispatch.stats()["rope"] == {"torch": layers}
    torch.testing.assert_close(out.logits, ref, rtol=0, atol=0)
    with kernel_on_cpu(monkeypatch, dispatch) as kernel_calls:
        dispatch.clear_choice_cache()
        dispatch.reset_stats()
        out = model(input_ids=ids).logits
        assert dispatch.stats()["rope"] == {"pipegoose": layers} and len(kernel_calls) == layers
    dispatch.clear_choice_cache()
    # (the stand-in rounds once from float64, the model's code from fp32: as close as fp32 or bf16 rounding allows)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    unfuse(model)
    model.double()
    ref = model(input_ids=ids).logits
    fuse(model, ops=["rope"])
    calls, out = _calls_and_output(model, input_ids=ids)   # float64: the model's own code, as the op's fallback
    assert dispatch.stats()["rope"] == {"torch": layers}
    torch.testing.assert_close(out.logits, ref, rtol=0, atol=0)
    unfuse(model)


_BSHD_MODEL = """
import torch


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):   # (transformers' older signature)
    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class Attention(torch.nn.Module):
    def __init__(self, how):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8, dtype=torch.float64)
        self.how = how

    def forward(self, q, k, cos, sin):
        q = self.proj(q)
        if self.how == "keywords":
            q, k = apply_rotary_pos_emb(q, k, cos, sin, position_ids=torch.arange(q.shape[1]), unsqueeze_dim=2)
        elif self.how == "positional":
            q, k = apply_rotary_pos_emb(q, k, cos, sin, None, 2)
        else:
            q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2, other=1)
        return q.sum() + k.sum()
"""


def test_calls_with_the_keywords_the_function_takes_reach_the_op():
    """A call that passes unsqueeze_dim (here 2: q and k [B, S, H, D]) and position_ids (unused, as in transformers'
    older functions), by keyword or by position, is the op's, with that unsqueeze_dim; a keyword the function does not
    take runs its own code (which raises, as unfused)."""
    import types

    mod = types.ModuleType("bshd_model")
    exec(compile(_BSHD_MODEL, "bshd_model", "exec"), mod.__dict__)
    original = mod.apply_rotary_pos_emb
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 6, 2, 8, dtype=torch.float64, generator=g)
    k = torch.randn(1, 6, 1, 8, dtype=torch.float64, generator=g)
    cos, sin = torch.randn(1, 6, 8, dtype=torch.float64), torch.randn(1, 6, 8, dtype=torch.float64)
    for how in ("keywords", "positional", "unknown"):
        attn = mod.Attention(how)
        holder = torch.nn.ModuleDict({"attn": attn})
        try:
            assert [r.fused for r in _rope_rows(fuse(holder, ops=["rope"]))] == [True]
            if how == "unknown":
                dispatch.reset_stats()
                with pytest.raises(TypeError, match="other"):
                    attn(q, k, cos, sin)
                assert _rope_calls() == 0
                continue
            want = original(attn.proj(q), k, cos, sin, unsqueeze_dim=2)
            calls, out = _calls_and_output(attn, q, k, cos, sin)
            assert calls == 1 and torch.equal(out, want[0].sum() + want[1].sum()), how
            assert dispatch.last_choice("rope") is not None
        finally:
            unfuse(holder)
        assert mod.apply_rotary_pos_emb is original
    found = rope_mod.probe(original)
    assert found.ok and found.unsqueeze and found.position_ids


def _causal_lm(model_type: str, **extra):
    """A tiny causal LM of ``model_type`` (fp32, eager attention), or a skip."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    cfg = CONFIG_MAPPING[model_type](vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


@pytest.mark.parametrize("model_type", ["phi", "stablelm"])
def test_modules_that_rotate_part_of_each_head_themselves_are_fused(model_type, monkeypatch):
    """Phi's and StableLM's attention rotate part of each head (partial_rotary_factor < 1) by slicing q and k
    themselves and calling apply_rotary_pos_emb(q_rot, k_rot, cos, sin) with tables of that width: the plain
    whole-width form. A review: fuse decided from the config's factor alone and skipped them ("its calls rotate part of
    each head ... its function does not compute GPT-NeoX's partial rotary"). Their function raises for tables narrower
    than the q it gets (probed), so the calls that run are whole-width ones: fused, the report says so, each call is
    the op's (on the kernel's CPU stand-in: q and k of the rotated width), the model computes what it did."""
    from rope_stand_in import kernel_on_cpu

    model = _causal_lm(model_type, partial_rotary_factor=0.5)
    layers = model.config.num_hidden_layers
    attn = next(m for m in model.modules() if hasattr(m, "rotary_ndims"))
    rotary = attn.rotary_ndims
    assert 0 < rotary < attn.head_dim
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(0))

    def step(m):
        m.zero_grad(set_to_none=True)
        logits = m(input_ids=ids).logits
        logits.square().mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    ref, ref_g = step(model)
    rows = _rope_rows(fuse(model, ops=["rope"]))
    assert len(rows) == layers and all(r.fused and r.eligible for r in rows), rows
    assert all(f"its plain calls, on the {rotary} values of each head that it rotates" in r.reason for r in rows), rows
    dispatch.reset_stats()
    out, g = step(model)
    assert dispatch.stats()["rope"] == {"torch": layers}   # (the op's PyTorch path: the CPU)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert g.keys() == ref_g.keys() and all(torch.equal(g[n], ref_g[n]) for n in g)
    with kernel_on_cpu(monkeypatch, dispatch) as calls:
        dispatch.clear_choice_cache()
        dispatch.reset_stats()
        out, _ = step(model)
        assert dispatch.stats()["rope"] == {"pipegoose": layers}
        fwd = [c for c in calls if c[0] == "rope_forward"]
        assert len(fwd) == layers and all(c[1].shape[-1] == rotary for c in fwd)
    dispatch.clear_choice_cache()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    unfuse(model)


def test_partial_rotary_that_the_function_computes_otherwise_is_skipped():
    """A function that takes tables narrower than a head and computes something else than GPT-NeoX's partial rotary
    with them (here it rotates the last values of each head): a partial-rotary module's calls would not be the op's,
    so it is skipped, with that reason."""
    neox = pytest.importorskip("transformers.models.gpt_neox.modeling_gpt_neox")
    original = neox.apply_rotary_pos_emb

    def rotates_the_last(q, k, cos, sin, unsqueeze_dim=1):
        keep = q.shape[-1] - cos.shape[-1]
        qe, ke = original(q[..., keep:], k[..., keep:], cos, sin, unsqueeze_dim)
        return torch.cat((q[..., :keep], qe), -1), torch.cat((k[..., :keep], ke), -1)

    model = models.build("gpt_neox", "eager")   # partial_rotary_factor 0.25
    try:
        neox.apply_rotary_pos_emb = rotates_the_last
        found = rope_mod.probe(rotates_the_last)
        assert found.ok and not found.partial and not found.narrow_raises
        rows = _rope_rows(fuse(model, ops=["rope"]))
        assert rows and all(not r.fused and not r.eligible for r in rows), rows
        assert all("does not compute GPT-NeoX's partial rotary" in r.reason for r in rows), rows
        assert not is_fused(model)
    finally:
        neox.apply_rotary_pos_emb = original


@pytest.mark.parametrize("model_type", ["gpt_neox", "phi3", "phi"])
def test_partial_rotary_modules_left_out_of_ops_are_counted(model_type):
    """The report's "not in ops" count of rope modules: a review found GPT-NeoX's and Phi-3's partial-rotary modules
    left out of it (the check did not have the probe's finding), though ops=["rope"] fuses them. Now it counts
    exactly the modules that ops=["rope"] would fuse."""
    if model_type == "gpt_neox":
        model = models.build("gpt_neox", "eager")   # partial_rotary_factor 0.25
    else:
        model = _causal_lm(model_type, partial_rotary_factor=0.5)
    fused_rows = [r for r in _rope_rows(fuse(model, ops=["rope"], dry_run=True)) if r.fused]
    assert len(fused_rows) == model.config.num_hidden_layers
    report = fuse(model, ops=["layer_norm"], dry_run=True)
    assert report.not_requested.get("rope") == len(fused_rows), report.not_requested


def test_models_pickle_while_a_model_is_fused():
    """transformers 5 keeps apply_rotary_pos_emb as a kernels wrapper module, which unpickling rebuilds from the
    global's type: a plain function put in its place broke torch.save / torch.load of every Llama while one was fused.
    The global object stays; fused and unfused models round-trip, and the fused copy still runs the op."""
    import io

    fused_model, other = models.build("llama", "eager"), models.build("llama", "eager", seed=1)
    fuse(fused_model, ops=["rope"])
    ids, mask = models.inputs()
    for m in (other, fused_model):
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        copy_ = torch.load(buf, weights_only=False)
        torch.testing.assert_close(copy_(input_ids=ids, attention_mask=mask).last_hidden_state,
                                   m(input_ids=ids, attention_mask=mask).last_hidden_state, rtol=0, atol=0)
    calls, _ = _calls_and_output(copy_, input_ids=ids, attention_mask=mask)
    assert calls == 2 and all(rope_mod.hooked(a) for a in _attention_modules(copy_).values())
    unfuse(fused_model)
    assert _restored()


def test_keyboard_interrupt_in_a_fused_forward_leaves_nothing_behind():
    """A KeyboardInterrupt inside a fused attention forward skips the always-called forward hook (it runs on Exception
    only): a counter stayed up, and from then on every model in the thread ran the op. The dispatching function now
    also finds the fused forward among its callers: an unfused model runs its own code after the interrupt."""
    fused_model, other = models.build("llama", "eager"), models.build("llama", "eager", seed=1)
    fuse(fused_model, ops=["rope"])
    ids, mask = models.inputs()

    def interrupt(module, args, output):
        raise KeyboardInterrupt

    h = fused_model.layers[0].self_attn.v_proj.register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        fused_model(input_ids=ids, attention_mask=mask)
    h.remove()
    assert rope_mod._active.stack   # (the entry the hook did not take away)
    calls, _ = _calls_and_output(other, input_ids=ids, attention_mask=mask)
    assert calls == 0
    calls, _ = _calls_and_output(fused_model, input_ids=ids, attention_mask=mask)
    assert calls == 2
    unfuse(fused_model)


def test_an_unfused_attention_run_inside_a_fused_forward_runs_its_own_code():
    """An unfused model's attention module run from a hook inside a fused attention's forward (a few frames below it)
    calls the function itself: the dispatching function takes only calls whose direct caller is the fused forward
    (as the inline loss's class does; session 77: before, any fused forward among 12 callers counted), so the unfused
    module's call runs the model's own code and the fused model's two calls the op."""
    fused_model, other = models.build("llama", "eager"), models.build("llama", "eager", seed=1)
    ids, mask = models.inputs(left_pad=(0, 0, 0))
    fuse(fused_model, ops=["rope"])
    other_attn = other.layers[0].self_attn
    seen = []

    def run_other(module, args, output):
        hidden = torch.randn(1, 5, other.config.hidden_size)
        pos = other.rotary_emb(hidden, torch.arange(5)[None])
        seen.append(other_attn(hidden, pos, None)[0])

    h = fused_model.layers[0].self_attn.v_proj.register_forward_hook(run_other)
    try:
        calls, _ = _calls_and_output(fused_model, input_ids=ids, attention_mask=mask)
    finally:
        h.remove()
    assert len(seen) == 1 and calls == 2
    assert unfuse(fused_model)


def test_per_layer_configs_do_not_stop_fuse():
    """A config whose attributes differ per layer raises a RuntimeError subclass for them (not AttributeError): the
    report's probe inputs read them, and fuse(model) raised on a model it fused before. Now the row's implementation
    columns say '?' where the config cannot tell, and the model is fused."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "embedding_gemma2_text" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no EmbeddingGemma2")
    cfg = CONFIG_MAPPING["embedding_gemma2_text"](hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                  num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                                  vocab_size=97, pad_token_id=0)
    model = transformers.AutoModel.from_config(cfg).eval()
    report = fuse(model)
    assert is_fused(model) and any(r.kind == "rms_norm" and r.fused for r in report.rows)
    unfuse(model)


@pytest.mark.parametrize("kwargs", [dict(partial_rotary_factor=1.0), dict(rotary_pct=1.0, partial_rotary_factor=0.25),
                                    dict()], ids=["top_level_factor_1", "rotary_pct_1", "default"])
def test_gpt_neox_report_agrees_with_what_runs(kwargs):
    """transformers 5's GPT-NeoX reads rope_parameters, where a top-level partial_rotary_factor can be stale: the
    report read that one first and said fused for modules that rotate a quarter of each head (and skipped for ones
    that rotate all of it). It now reads the module's rotary_ndims against its head size: a row names partial rotary
    exactly where the module rotates part of each head, and its implementation is the model's code (on the CPU)
    exactly where the op does not run."""
    cfg = transformers.GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, **kwargs)
    model = transformers.GPTNeoXModel(cfg).double().eval()
    full = model.layers[0].attention.rotary_ndims == model.layers[0].attention.head_size
    report = fuse(model, ops=["rope"])
    rows = _rope_rows(report)
    assert len(rows) == 2 and all(r.fused for r in rows), rows
    assert all(("GPT-NeoX's partial rotary" in r.reason) == (not full) for r in rows), rows
    assert all((r.forward == "the model's code (fallback)") == (not full) for r in rows), rows
    calls, _ = _calls_and_output(model, input_ids=torch.randint(0, 64, (1, 8)))
    assert calls == 2   # (partial: the model's own code, recorded as the op's fallback)
    unfuse(model)
