"""fuse(model) and the rotary position embedding (kind ``rope``): the dispatching function under a modeling module's
``apply_rotary_pos_emb``, the hooks of fused attention modules, the probe, the undo (CPU: the reference path runs,
and each call the op takes is counted by ``dispatch.stats()``)."""

from __future__ import annotations

import copy

import pytest
import torch

from pipegoose.nn.fusion import dispatch
from pipegoose.nn.fusion.fuse import fuse, fused, is_fused, unfuse
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
    rope_mod._active.depth = 0


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
    assert ml.apply_rotary_pos_emb is not ORIGINAL and rope_mod.is_dispatching(ml.apply_rotary_pos_emb)
    assert ml.apply_rotary_pos_emb.__wrapped__ is ORIGINAL
    assert all(rope_mod.hooked(m) for m in attn.values())
    assert _attention_modules(model) == attn          # nothing replaced

    dispatch.reset_stats()
    h, g = _step(model, ids, mask)
    assert _rope_calls() == 2                         # one per attention module and forward
    torch.testing.assert_close(h, ref_h, rtol=0, atol=0)
    assert g.keys() == ref_g.keys()
    for n in ref_g:
        torch.testing.assert_close(g[n], ref_g[n], rtol=1e-12, atol=1e-12, msg=lambda m: f"grad of {n}: {m}")
    assert rope_mod._active.depth == 0

    assert unfuse(model) is True and not is_fused(model)
    assert ml.apply_rotary_pos_emb is ORIGINAL
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
    fn = ml.apply_rotary_pos_emb
    fuse(b, ops=["rope"])
    assert ml.apply_rotary_pos_emb is fn               # installed once
    unfuse(a)
    assert ml.apply_rotary_pos_emb is fn
    ids, mask = models.inputs()
    dispatch.reset_stats()
    b(input_ids=ids, attention_mask=mask)
    assert _rope_calls() == 2
    unfuse(b)
    assert ml.apply_rotary_pos_emb is ORIGINAL


def test_a_function_replaced_while_fused_is_left_alone():
    """A library that patches modeling_llama.apply_rotary_pos_emb after fuse() (Liger-Kernel does) keeps its patch
    at unfuse: the hooks go, the global is not touched."""
    model = models.build("llama", "eager")
    fuse(model, ops=["rope"])

    def theirs(q, k, cos, sin, unsqueeze_dim=1):
        return ORIGINAL(q, k, cos, sin, unsqueeze_dim)

    ml.apply_rotary_pos_emb = theirs
    assert unfuse(model) is True
    assert ml.apply_rotary_pos_emb is theirs
    assert not any(rope_mod.hooked(m) for m in _attention_modules(model).values())


def test_a_function_that_is_not_the_rotate_half_rope_is_skipped():
    """The probe refuses a function that computes another rotation (the interleaved form of GPT-J) or fails on
    float64 CPU inputs (a GPU-only patch): rows skipped, not eligible, with the reason; no hooks, no global change."""
    def interleaved(q, k, cos, sin, unsqueeze_dim=1):
        def rot(x):
            x1, x2 = x[..., ::2], x[..., 1::2]
            return torch.stack((-x2, x1), dim=-1).flatten(-2)
        c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * c + rot(q) * s, k * c + rot(k) * s

    def gpu_only(q, k, cos, sin, unsqueeze_dim=1):
        raise RuntimeError("expected a CUDA tensor")

    for fn, why in ((interleaved, "does not compute the rotate-half RoPE"), (gpu_only, "failed on float64 CPU inputs: "
                                                                                       "RuntimeError: expected a CUDA")):
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
    assert ml.apply_rotary_pos_emb is ORIGINAL
    assert not any(rope_mod.hooked(m) for m in _attention_modules(model).values())


def test_a_forward_that_raises_leaves_no_count_behind():
    """The hook that ends a fused forward is always called: after a forward that raised, calls outside fused modules
    go to the original again."""
    model = models.build("llama", "eager")
    fuse(model, ops=["rope"])
    attn = next(iter(_attention_modules(model).values()))
    with pytest.raises(Exception):
        attn(torch.randn(1, 3, model.config.hidden_size), position_embeddings=None)   # (cos, sin = None: TypeError)
    assert rope_mod._active.depth == 0
    unfuse(model)


def test_gpt_neox_partial_rotary_runs_the_original():
    """GPT-NeoX's function handles partial rotary itself (partial_rotary_factor < 1: cos narrower than the head): those
    calls go to the original function, exactly; with a factor of 1 they run the op."""
    for pct, calls in ((0.25, 0), (1.0, 2)):
        cfg = models.config("gpt_neox", "eager")
        cfg.rope_parameters = {**cfg.rope_parameters, "partial_rotary_factor": pct}
        model = models.build("gpt_neox", "eager", cfg=cfg).double()
        ids, mask = models.inputs(left_pad=(0, 0, 0))
        ref_h, ref_g = _step(model, ids, mask)
        report = fuse(model, ops=["rope"])
        assert len([r for r in _rope_rows(report) if r.fused]) == 2, report.rows
        dispatch.reset_stats()
        h, g = _step(model, ids, mask)
        assert _rope_calls() == calls
        torch.testing.assert_close(h, ref_h, rtol=1e-12, atol=1e-12)
        for n in ref_g:
            torch.testing.assert_close(g[n], ref_g[n], rtol=1e-10, atol=1e-12)
        unfuse(model)


def test_a_copy_of_a_fused_model_is_told_apart():
    """deepcopy copies the hooks (the copy keeps running the op while the function is installed); unfuse of the copy
    says it has no record, and unfuse of the original still works."""
    model = models.build("llama", "eager")
    fuse(model, ops=["rope"])
    twin = copy.deepcopy(model)
    assert all(rope_mod.hooked(m) for m in _attention_modules(twin).values())
    with pytest.raises(RuntimeError, match="holds fused modules"):
        unfuse(twin)
    assert unfuse(model) is True and ml.apply_rotary_pos_emb is ORIGINAL


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
    assert not is_fused(layer) and ml.apply_rotary_pos_emb is ORIGINAL
    assert not any(rope_mod.hooked(m) for m in _attention_modules(model).values())


def test_fused_context_manager():
    model = models.build("llama", "eager")
    with fused(model, ops=["rope"]):
        assert rope_mod.is_dispatching(ml.apply_rotary_pos_emb)
    assert ml.apply_rotary_pos_emb is ORIGINAL and not is_fused(model)
