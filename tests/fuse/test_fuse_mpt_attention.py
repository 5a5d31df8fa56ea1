"""MPT's attention (``MptAttention``: ALiBi) on pipegoose's attention function: ``FusedMptAttention``, the bias
``mpt_bias`` (query-relative), the probe ``probe_mpt_attention``, the hooks that carry a block's
``output_attentions`` and ``fuse(model)`` replacing the modules; against a float64 reference and the unfused model
on the CPU (both paths: the softmax path, and the SDPA path with CUDA pretended or off CUDA), and, marked ``cuda``,
on a GPU."""

from __future__ import annotations

import copy
import gc
import pickle

import pytest
import torch
import torch.nn.functional as F

from pipegoose.nn.fusion import FusedMptAttention
from pipegoose.nn.fusion.fuse import fuse, unfuse
from pipegoose.nn.fusion.transformers import mpt
from tolerances import tol

from . import alibi_checks, models

MptAttention = models.transformers_attr("mpt", "modeling", "MptAttention")
build_mpt_alibi_tensor = models.transformers_attr("mpt", "modeling", "build_mpt_alibi_tensor")


def _config(hidden=64, heads=4, positions=64, clip_qkv=None, **kw):
    cfg = models.config("mpt", hidden=hidden, heads=heads, **kw)
    cfg.max_seq_len = positions
    if clip_qkv is not None:
        cfg.attn_config.clip_qkv = float(clip_qkv)
    return cfg


def _attention(hidden=64, heads=4, seed=0, dtype=torch.float32, device="cpu", **kw):
    torch.manual_seed(seed)
    return MptAttention(_config(hidden, heads, **kw), layer_idx=0).to(device, dtype)


def _lm(dtype=torch.float32, device="cpu", **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(models.config("mpt", **kw)).to(device, dtype)


def _masked(batch, seq, left_pad, device="cpu"):
    """MPT's mask, bool [b, 1, s, s], True = masked: causal, and left padding ``left_pad[i]`` in row i (its first
    queries have no key)."""
    j = torch.arange(seq, device=device)
    pad = torch.zeros(batch, seq, dtype=torch.bool, device=device)
    for i, p in enumerate(left_pad):
        pad[i, :p] = True
    return (j[None, :] > j[:, None])[None, None] | pad[:, None, None, :]


def _reference(att, hidden, position_bias, masked):
    """float64 MPT attention (output, probabilities); rows without a key give zeros (as every path of ours)."""
    b, s, _ = hidden.shape
    h, d = att.n_heads, att.head_dim
    qkv = F.linear(hidden.double(), att.Wqkv.weight.double())
    if att.clip_qkv:
        qkv = qkv.clamp(-att.clip_qkv, att.clip_qkv)
    q, k, v = (t.unflatten(-1, (h, d)).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    scores = att.softmax_scale * q @ k.transpose(-1, -2) + position_bias.double()[:, :, -s:]
    probs = torch.softmax(scores.masked_fill(masked, float("-inf")), -1).nan_to_num(0.0)
    ctx = (probs @ v).transpose(1, 2).reshape(b, s, h * d)
    return F.linear(ctx, att.out_proj.weight.double()), probs


# ------------------------------------------------------------------------------------------------ the module
@alibi_checks.float64_cases
def test_matches_float64_forward_and_backward(monkeypatch, path, dtype, left_pad):
    """Outputs and gradients (hidden states, both projections) against float64, on either path, MPT's ALiBi over
    more positions than keys (its last keys taken); rows without a key (left padding) give zeros; the attention
    weights only on the softmax path."""
    att = _attention(dtype=dtype)
    fused = FusedMptAttention.from_module(att)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 9, 64, generator=g).to(dtype).requires_grad_()
    position_bias, masked = build_mpt_alibi_tensor(4, 64), _masked(3, 9, left_pad)
    out = alibi_checks.check_float64_forward_backward(
        monkeypatch, path, dtype, att, lambda x: fused(x, position_bias, attention_mask=masked),
        lambda a, x: _reference(a, x, position_bias, masked), (hidden,), ("Wqkv.weight", "out_proj.weight"), g)
    if left_pad[2]:
        # row 2's first 6 queries have no key: the attention gives zeros, and out_proj (no bias) zeros too
        assert torch.equal(out[2, :6], torch.zeros_like(out[2, :6]))


def test_fp32_equals_mpt_eager_on_the_cpu():
    """On the CPU in fp32, padding on the right (no row without a key): the module's values and attention weights are
    MptAttention's own within fp32 rounding (the bias is query-relative, a shift of each row), in training and eval
    mode, on the softmax path and (the output) on the CPU's SDPA path."""
    att = _attention()
    fused = FusedMptAttention.from_module(att)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 7, 64, generator=g)
    position_bias = build_mpt_alibi_tensor(4, 64)
    masked = _masked(2, 7, (0, 0))
    masked[1, :, :, -2:] = True
    masked[1, :, -2:, -2:] = torch.eye(2, dtype=torch.bool).logical_not()   # (the padded queries keep themselves)
    for mode in (True, False):
        att.train(mode)
        fused.train(mode)
        want = att(hidden, position_bias, attention_mask=masked)
        got = fused(hidden, position_bias, attention_mask=masked, output_attentions=True)
        torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got[1], want[1], atol=1e-7, rtol=1e-6)
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv("PIPEGOOSE_SMALL_NUMEL")
            out, weights = fused(hidden, position_bias, attention_mask=masked)
        assert weights is None
        torch.testing.assert_close(out, want[0], atol=1e-6, rtol=1e-5)


def test_off_cuda_sdpa_runs_unless_the_variables_ask_for_the_softmax_path(monkeypatch):
    """As Bloom's: off CUDA SDPA runs (counted as attention/sdpa; the report says so), with float64's values; rows
    without a key give zeros. PIPEGOOSE_SMALL_NUMEL=0 or PIPEGOOSE_IMPL_ATTENTION=pipegoose: the softmax path; so
    does a call that asks for the attention weights."""
    att = _attention()
    fused = FusedMptAttention.from_module(att)
    hidden = torch.randn(3, 9, 64, generator=torch.Generator().manual_seed(8))
    position_bias, masked = build_mpt_alibi_tensor(4, 64), _masked(3, 9, (0, 3, 6))
    alibi_checks.check_off_cuda_paths(
        monkeypatch, lambda w: fused(hidden, position_bias, attention_mask=masked, output_attentions=w),
        _reference(att, hidden, position_bias, masked)[0], _lm())


def test_clip_qkv_clamps_the_projection_as_eager_does():
    """clip_qkv (MPT-30B's configs set it): Wqkv's output clamped before the split; eager's values, and float64's."""
    att = _attention(clip_qkv=0.3)
    assert att.clip_qkv == 0.3 and mpt.probe_mpt_attention(att).ok
    fused = FusedMptAttention.from_module(att)
    assert fused.clip_qkv == 0.3 and "clip_qkv=0.3" in repr(fused)
    hidden = 3 * torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(2))
    assert (att.Wqkv(hidden).abs() > 0.3).float().mean() > 0.5   # (most values clamped)
    position_bias, masked = build_mpt_alibi_tensor(4, 64), _masked(2, 6, (0, 0))
    want = att(hidden, position_bias, attention_mask=masked)
    got = fused(hidden, position_bias, attention_mask=masked, output_attentions=True)
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[0].double(), _reference(att, hidden, position_bias, masked)[0], **tol(torch.float32))
    fused.clip_qkv = None   # (read per call)
    assert not torch.allclose(fused(hidden, position_bias, attention_mask=masked)[0], want[0], atol=1e-3)


def test_the_cache_argument_under_each_transformers_name():
    """transformers 5.25 names MptAttention's cache argument ``cache``, 5.17 ``past_key_values``, older versions
    ``past_key_value`` (MptBlock's own: ``layer_past``): each is taken, the cache updated at the module's layer."""
    from transformers import DynamicCache

    fused = FusedMptAttention.from_module(_attention())
    g = torch.Generator().manual_seed(4)
    prompt, step = torch.randn(2, 5, 64, generator=g), torch.randn(2, 1, 64, generator=g)
    position_bias = build_mpt_alibi_tensor(4, 64)
    outs = []
    for name in ("cache", "past_key_values", "past_key_value", "layer_past", None):
        cache = DynamicCache()
        kw = {name: cache} if name else {}
        fused(prompt, position_bias, attention_mask=_masked(2, 5, (0, 0)), **kw)
        assert cache.get_seq_length() == (5 if name else 0)
        outs.append(fused(step, position_bias, attention_mask=torch.zeros(2, 1, 1, 6 if name else 1,
                                                                         dtype=torch.bool), **kw)[0])
    assert all(torch.equal(o, outs[0]) for o in outs[1:4]) and not torch.allclose(outs[0], outs[4])
    full = torch.cat([prompt, step], 1)
    want = fused(full, position_bias, attention_mask=_masked(2, 6, (0, 0)))[0][:, -1:]
    torch.testing.assert_close(outs[0], want, atol=1e-6, rtol=1e-5)


_REFUSED = [   # (error, message, arguments changed)
    (ValueError, r"n_heads: 5 heads of head_dim 16 do not make hidden_size 64", dict(n_heads=5)),
    (ValueError, r"Wqkv: expected 64 -> 192 features, got 64 -> 64", dict(Wqkv=torch.nn.Linear(64, 64))),
    (ValueError, r"out_proj: expected 64 input features, got 32", dict(out_proj=torch.nn.Linear(32, 64))),
    (TypeError, r"Wqkv: expected a torch.nn.Linear, got Identity", dict(Wqkv=torch.nn.Identity())),
    (ValueError, r"attn_dropout_p: expected a finite number in \[0, 1\], got 2.0", dict(attn_dropout_p=2.0)),
    (ValueError, r"clip_qkv: expected a finite number in \[0, inf\], got -1.0", dict(clip_qkv=-1.0)),
    (ValueError, r"softmax_scale: expected a finite number, got nan", dict(softmax_scale=float("nan"))),
]


@pytest.mark.parametrize("error,message,change", _REFUSED, ids=[str(sorted(c)) for *_, c in _REFUSED])
def test_the_constructor_refuses_what_does_not_fit(error, message, change):
    att = _attention()
    with pytest.raises(error, match=message):
        FusedMptAttention(**{**{k: getattr(att, k) for k in mpt._CHILDREN + mpt._ATTRIBUTES}, **change})


def test_from_module_shares_the_modules_and_attributes():
    with pytest.raises(TypeError, match=r"attention: expected an MptAttention, got Linear"):
        FusedMptAttention.from_module(torch.nn.Linear(2, 2))
    att = _attention()
    fused = FusedMptAttention.from_module(att)
    assert fused.Wqkv is att.Wqkv and fused.out_proj is att.out_proj
    assert (fused.softmax_scale, fused.layer_idx, fused.max_seq_length) == (att.softmax_scale, 0, 64)
    assert "n_heads=4, head_dim=16" in repr(fused)


def test_bad_position_bias_and_masks_name_the_argument():
    fused = FusedMptAttention.from_module(_attention())
    x = torch.randn(2, 5, 64)
    position_bias, masked = build_mpt_alibi_tensor(4, 64), _masked(2, 5, (0, 0))
    with pytest.raises(ValueError, match=r"hidden_states: 5 positions \(with the cache's\) exceed the 3 of "
                                         r"position_bias, .*max_seq_len"):
        fused(x, position_bias[..., :3], attention_mask=masked)   # (fewer positions than keys: eager fails too)
    with pytest.raises(ValueError, match=r"position_bias: expected shape \[4 \(heads\) or 1, 1, >= 5 \(keys\) "
                                         r"or 1\], got \(4, 1, 3\)"):
        mpt.mpt_bias(position_bias[..., :3], masked, batch=2, heads=4, query_len=5, key_len=5, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"position_bias: expected shape .*, got \(2, 1, 64\)"):
        fused(x, position_bias[:2], attention_mask=masked)
    with pytest.raises(ValueError, match=r"position_bias: expected shape .*, got \(4, 5, 64\)"):
        fused(x, position_bias.expand(4, 5, 64), attention_mask=masked)
    with pytest.raises(TypeError, match=r"position_bias: expected a floating-point tensor"):
        fused(x, position_bias.long(), attention_mask=masked)


@pytest.mark.parametrize("form", ["one_head", "one_position", "mask_2d"])
def test_position_bias_and_mask_broadcast_as_eager(form):
    """What eager MPT broadcasts, ours too (a review: refused before): a bias of one head ([1, 1, P]), of one position
    ([h, 1, 1]), a 2-D bool mask ([sq, sk]); outputs against eager's in fp32."""
    att = _attention()
    fused = FusedMptAttention.from_module(copy.deepcopy(att))
    x = torch.randn(2, 5, 64)
    position_bias, masked = build_mpt_alibi_tensor(4, 64), _masked(2, 5, (0, 0))
    if form == "one_head":
        position_bias = position_bias[1:2]
    elif form == "one_position":
        position_bias = position_bias[..., -2:-1] + 0.5
    else:
        masked = masked[0, 0]
    with torch.no_grad():
        torch.testing.assert_close(fused(x, position_bias, attention_mask=masked)[0],
                                   att(x, position_bias, attention_mask=masked)[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"attention_mask: expected shape"):
        fused(x, position_bias, attention_mask=masked[..., :3])
    with pytest.raises(TypeError, match=r"attention_mask: expected a bool mask \(True = masked, as MptModel passes "
                                        r"it\), got dtype torch.float32"):
        fused(x, position_bias, attention_mask=masked.float())
    with pytest.raises(ValueError, match=r"query_len: 5 queries, more than the 3 keys"):
        mpt.mpt_bias(position_bias, None, batch=2, heads=4, query_len=5, key_len=3, dtype=torch.float32)


# ------------------------------------------------------------------------------------------------ the bias
def test_mpt_bias_is_query_relative_built_once_and_per_sequence_only_where_sequences_differ():
    position_bias = build_mpt_alibi_tensor(4, 16)
    masked = _masked(3, 6, (0, 0, 0))
    bias = mpt.mpt_bias(position_bias, masked, batch=3, heads=4, query_len=6, key_len=6, dtype=torch.float32)
    assert bias.shape == (1, 4, 6, 6)   # the same mask for every sequence
    keys = position_bias[:, 0, -6:]
    want = (keys[:, None, :] - keys[:, :, None]).masked_fill(masked[0], torch.finfo(torch.float32).min)
    torch.testing.assert_close(bias[0], want)
    assert torch.equal(bias[0].diagonal(dim1=-2, dim2=-1), torch.zeros(4, 6))   # (each query's own key: 0)
    assert mpt.mpt_bias(position_bias, masked, batch=3, heads=4, query_len=6, key_len=6,
                        dtype=torch.float32) is bias   # (cached)
    masked[0, 0, 5, 0] = True   # in place: a new bias, per sequence now
    again = mpt.mpt_bias(position_bias, masked, batch=3, heads=4, query_len=6, key_len=6, dtype=torch.float32)
    assert again is not bias and again.shape == (3, 4, 6, 6) and again[0, :, 5, 0].eq(again.min()).all()
    # generation: 2 new queries over 6 keys, the last ones aligned with them; no mask: batch 1
    step = mpt.mpt_bias(position_bias, None, batch=3, heads=4, query_len=2, key_len=6, dtype=torch.bfloat16)
    assert step.shape == (1, 4, 2, 6) and step.dtype == torch.bfloat16
    torch.testing.assert_close(step[0].float(), keys[:, None, :] - keys[:, 4:, None])
    assert mpt.mpt_bias(None, None, batch=3, heads=4, query_len=2, key_len=6, dtype=torch.float32) is None
    only_mask = mpt.mpt_bias(None, _masked(3, 6, (0, 2, 0)), batch=3, heads=4, query_len=6, key_len=6,
                             dtype=torch.float16)
    assert only_mask.shape == (3, 4, 6, 6) and set(only_mask.unique().tolist()) == {0.0, -65504.0}
    with torch.inference_mode():   # (not cacheable there: computed per call, the same values)
        a = mpt.mpt_bias(position_bias, masked, batch=3, heads=4, query_len=6, key_len=6, dtype=torch.float32)
        assert a.shape == (3, 4, 6, 6)
        assert mpt.mpt_bias(position_bias, masked, batch=3, heads=4, query_len=6, key_len=6,
                            dtype=torch.float32) is not a
    torch.testing.assert_close(a, again)


def test_the_query_relative_bias_keeps_16_bit_softmax_near_float64_at_2048_positions():
    """MPT's raw ALiBi values at 2048 positions reach about -1450 (16 heads: the steepest slope 2^-0.5), where bf16's
    values are 4 to 8 apart: cast as they are, the probabilities of the keys near a query (those that matter) are off
    by up to 0.49 (measured); query-relative, the values near each query are near 0: off by 2.3e-4 in bf16. A bias
    that is not re-centred fails the bound here."""
    P = 2048
    position_bias = build_mpt_alibi_tensor(16, P)[[0, 3, 7, 15]]   # (4 of the 16 heads: the steepest, the flattest)
    j = torch.arange(P)
    causal = j[None, :] > j[:, None]
    want = torch.softmax(position_bias.double().expand(4, P, P).masked_fill(causal, float("-inf")), -1)
    for dtype, bound in ((torch.bfloat16, 2e-3), (torch.float16, 2e-4)):
        bias = mpt.mpt_bias(position_bias, causal[None, None], batch=1, heads=4, query_len=P, key_len=P, dtype=dtype)
        got = torch.softmax(bias[0].double(), -1)
        err = (got - want).abs().max().item()
        assert err < bound, (dtype, err)
    # the raw values in bf16: far off (why the bias is re-centred)
    raw = torch.softmax(position_bias.to(torch.bfloat16).double().expand(4, P, P).masked_fill(causal, float("-inf")),
                        -1)
    assert (raw - want).abs().max().item() > 0.1


def test_nothing_derived_from_the_mask_outlives_the_forward_pass(monkeypatch):
    """The one-entry caches (the bias; the SDPA path's copy of it; the mask's plan) drop their entry when the tensors
    it was derived from are freed: after the forward pass nothing of the [b, h, sq, sk] size stays held."""
    alibi_checks.check_nothing_outlives_the_forward_pass(monkeypatch, _lm, mpt._bias_cache)


def test_the_bias_cache_keeps_one_entry_and_no_finalizer_of_a_replaced_one():
    """As Bloom's: an entry goes with its tensors, and a replaced entry leaves no finalizer holding it."""
    for _ in range(20):
        mpt.mpt_bias(torch.randn(4, 1, 16), None, batch=2, heads=4, query_len=1, key_len=16, dtype=torch.float32)
    gc.collect()
    assert sum(isinstance(o, torch.Tensor) and o.shape == (4, 1, 16) for o in gc.get_objects()) == 0
    assert "entry" not in mpt._bias_cache   # (each position bias freed: its entry with it)
    pb, m = torch.randn(4, 1, 8), torch.zeros(2, 1, 8, 8, dtype=torch.bool)
    for i in range(5):
        m[0, 0, i, 0] = True
        mpt.mpt_bias(pb, m, batch=2, heads=4, query_len=8, key_len=8, dtype=torch.float32)
    assert len(mpt._bias_cache["finalizers"]) == 2   # (one per tensor of the entry)
    del m
    gc.collect()
    assert "entry" not in mpt._bias_cache


def test_on_the_meta_device_and_under_fake_tensors():
    """A fused model runs on the meta device and under FakeTensorMode, as the eager one (the check for a mask that is
    the same per sequence compares values: skipped there)."""
    alibi_checks.check_meta_and_fake_tensors(_lm())


# ------------------------------------------------------------------------------------------------ the probe
class _DoubledBiasMptAttention(MptAttention):
    """An MptAttention that adds twice the position bias: another formula, which the probe must refuse."""

    def forward(self, hidden_states, position_bias, cache=None, attention_mask=None, **kwargs):
        return super().forward(hidden_states, 2 * position_bias, cache, attention_mask, **kwargs)


class _FirstKeysMptAttention(MptAttention):
    """The bias of the first keys rather than the last: the same where positions and keys are as many."""

    def forward(self, hidden_states, position_bias, cache=None, attention_mask=None, **kwargs):
        return super().forward(hidden_states, position_bias[..., :hidden_states.shape[1]], cache, attention_mask)


class _InterleavedMptAttention(MptAttention):
    """Wqkv read in Bloom's interleaved [heads, 3, head_dim] layout: another split of the same projection."""

    def forward(self, hidden_states, position_bias, cache=None, attention_mask=None, **kwargs):
        b, s, _ = hidden_states.shape
        qkv = self.Wqkv(hidden_states).view(b, s, self.n_heads, 3, self.head_dim)
        q, k, v = (qkv[..., i, :].transpose(1, 2) for i in range(3))
        scores = q @ k.transpose(-1, -2) * self.softmax_scale + position_bias[:, :, -s:]
        probs = torch.softmax(scores.masked_fill(attention_mask, torch.finfo(q.dtype).min), -1)
        return self.out_proj((probs @ v).transpose(1, 2).reshape(b, s, -1)), probs


class _NoClipMptAttention(MptAttention):
    """clip_qkv ignored: the probe checks it on modules that have one."""

    def forward(self, hidden_states, position_bias, cache=None, attention_mask=None, **kwargs):
        clip, self.clip_qkv = self.clip_qkv, None
        try:
            return super().forward(hidden_states, position_bias, cache, attention_mask)
        finally:
            self.clip_qkv = clip


class _ThreeOutputsMptAttention(MptAttention):
    """transformers 4.x's return: (output, weights, past_key_value), which MptBlock there unpacks."""

    def forward(self, hidden_states, position_bias, past_key_value=None, attention_mask=None):
        out, weights = super().forward(hidden_states, position_bias, None, attention_mask)
        return out, weights, None


class _OtherArgumentsMptAttention(MptAttention):
    def forward(self, hidden_states, attention_mask=None, position_bias=None, cache=None, **kwargs):
        return super().forward(hidden_states, position_bias, cache, attention_mask)


def test_the_probe_accepts_mpt_and_refuses_other_formulas():
    att = _attention()
    assert mpt.probe_mpt_attention(att).ok and mpt.candidate(att)
    cfg = _config()
    for cls, words in ((_DoubledBiasMptAttention, "does not compute MPT's ALiBi attention"),
                       (_FirstKeysMptAttention, "does not compute MPT's ALiBi attention"),
                       (_InterleavedMptAttention, "does not compute MPT's ALiBi attention"),
                       (_ThreeOutputsMptAttention, "does not return (output, attention probabilities)"),
                       (_OtherArgumentsMptAttention, "are not MPT's")):
        reason = mpt.probe_mpt_attention(cls(cfg, 0)).reason
        assert words in reason, (cls.__name__, reason)
    assert mpt.probe_mpt_attention(_NoClipMptAttention(cfg, 0)).ok   # (no clip_qkv: nothing to check)
    clipped = _NoClipMptAttention(_config(clip_qkv=6.0), 0)
    assert "does not compute MPT's ALiBi attention" in mpt.probe_mpt_attention(clipped).reason
    alibi_checks.check_a_wrapped_projection_is_refused(mpt.probe_mpt_attention, mpt.candidate, _attention(), "Wqkv")
    extra = _attention()
    extra.q_ln = torch.nn.LayerNorm(64)   # (MosaicML's own code has qk_ln norms)
    assert "other submodules (q_ln)" in mpt.probe_mpt_attention(extra).reason
    odd = _attention()
    odd.clip_qkv = -2.0
    assert "clip_qkv: expected a finite number in [0, inf], got -2.0" in mpt.probe_mpt_attention(odd).reason
    del odd.layer_idx
    assert "lacks MPT's attribute(s) layer_idx" in mpt.probe_mpt_attention(odd).reason
    assert not mpt.candidate(FusedMptAttention.from_module(att)) and not mpt.candidate(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"attention: _DoubledBiasMptAttention: does not compute"):
        FusedMptAttention.from_module(_DoubledBiasMptAttention(cfg, 0))
    alibi_checks.check_probe_apart(mpt.probe_mpt_attention, att, _attention(device="meta"))


# ------------------------------------------------------------------------------------------------ fuse
def test_fuse_replaces_mpt_attention_and_the_whole_model_trains_as_the_unfused_one():
    """Every kind fuse finds in an MPT model: its attention (FusedMptAttention), its LayerNorms without bias
    (norm_1, norm_2, norm_f), its MLPs' torch.nn.GELU, the loss; the state_dict unchanged; losses and gradients
    (padding on the right: no row without a key) those of the unfused model, over a few AdamW steps too; unfuse puts
    every module back."""
    def more(lm, ref, report, ids, mask):
        kinds = [r.kind for r in report.rows if r.fused]
        assert (kinds.count("attention"), kinds.count("layer_norm"), kinds.count("gelu")) == (2, 5, 2), kinds
        assert "cross_entropy" in kinds and report.coverage == 1.0
        assert all("output_attentions=True (detached) through hooks" in r.reason
                   for r in report.rows if r.kind == "attention")
        losses = {}
        for name, m in (("fused", lm), ("eager", ref)):
            opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
            losses[name] = []
            for _ in range(4):
                opt.zero_grad()
                loss = m(input_ids=ids, attention_mask=mask, labels=ids).loss
                loss.backward()
                opt.step()
                losses[name].append(loss.item())
        assert losses["fused"] == pytest.approx(losses["eager"], rel=1e-4)
        assert losses["fused"][-1] < losses["fused"][0]

    lm = _lm()
    alibi_checks.check_fuse_and_unfuse(lm, ["transformer.blocks.0.attn", "transformer.blocks.1.attn"], "MptAttention",
                                       "FusedMptAttention", more)
    assert type(lm.transformer.blocks[0].norm_1) is torch.nn.LayerNorm and lm.transformer.blocks[0].norm_1.bias is None


def test_left_padding_gives_zeros_where_eager_gives_weights_and_the_rest_is_eager():
    """Left padding: the queries of padded positions have no key; ours gives their attention zeros (eager: uniform
    weights over every key). The positions that are not padding get eager's values."""
    got, want, mask = alibi_checks.check_left_padding(_lm())   # (left padding 0 / 4 / 2)
    assert not torch.allclose(got[~mask.bool()], want[~mask.bool()], atol=1e-3)


@pytest.mark.parametrize("path", ["softmax", "cpu_sdpa"])
def test_output_attentions_returns_eager_weights(monkeypatch, path):
    """MptBlock does not pass output_attentions to its attention: fuse's hook on the block tells the fused attention,
    so that the model's output_attentions=True returns the weights (the softmax path), eager's where rows have keys,
    on the CPU's SDPA path too; the next call without it gets None there again. The block called with
    output_attentions by position is seen too; unfuse removes the hooks."""
    if path == "cpu_sdpa":
        monkeypatch.delenv("PIPEGOOSE_SMALL_NUMEL")
    lm = _lm()
    ref = copy.deepcopy(lm)
    fuse(lm)
    ids, mask = models.inputs()   # left padding 0 / 4 / 2
    got = lm(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    want = ref(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert len(got) == len(want) == 2
    keep = mask.bool()[:, None, :, None]   # the queries that have keys
    for a, b in zip(got, want):
        torch.testing.assert_close(a * keep, b * keep, atol=1e-6, rtol=1e-5)
    again = lm(input_ids=ids, attention_mask=mask, output_attentions=False).attentions
    assert again is None
    blocks = lm.transformer.blocks
    assert not mpt._weights_asked(blocks[0].attn) and not mpt._weights_asked(blocks[1].attn)
    if path == "cpu_sdpa":
        # (the block's own output: the weights, None on the SDPA path unless asked)
        x = torch.randn(3, 11, 32)
        alibi = build_mpt_alibi_tensor(4, 64)
        m = _masked(3, 11, (0, 0, 0))
        assert blocks[0](x, alibi, m)[1] is None
        assert blocks[0](x, alibi, m, None, False, True)[1] is not None   # (by position)
        got = blocks[0](x, alibi, m, output_attentions=True)[1]
        assert got is not None and not got.requires_grad   # (besides the output, detached)
        assert not mpt._weights_asked(blocks[0].attn)        # (for that call only)
        assert blocks[0](x, alibi, m, output_attentions=False)[1] is None
    assert mpt.watched(blocks[0]) and unfuse(lm)
    assert not mpt.watched(blocks[0]) and not blocks[0]._forward_hooks and not blocks[0]._forward_pre_hooks


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("weights", [(False,), (True,), (True, False), (False, True)],
                         ids=["plain", "output_attentions", "asked_then_not", "not_then_asked"])
def test_gradient_checkpointing_trains_as_eager(monkeypatch, weights, reentrant):
    """transformers checkpoints the block's forward, whose replay in the backward runs without the block's hooks: on
    the CPU's default path (SDPA) the replay computes what the forward did whatever the calls asked for (the output's
    path does not depend on the request), also with two forward passes of different requests before one backward (a
    review's case: a request held until the block's next call made the replay's saved tensors differ, torch's
    CheckpointError); the losses and gradients eager's."""
    monkeypatch.delenv("PIPEGOOSE_SMALL_NUMEL")
    lm = _lm().train()
    ref = copy.deepcopy(lm)
    fuse(lm)
    for m in (lm, ref):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=reentrant))
    ids = models.inputs(left_pad=(0, 0, 0))[0]
    batches = [ids, ids.flip(1)][:len(weights)]
    outs = [lm(input_ids=x, labels=x, output_attentions=w) for x, w in zip(batches, weights)]
    wants = [ref(input_ids=x, labels=x, output_attentions=w) for x, w in zip(batches, weights)]
    sum(o.loss for o in outs).backward()
    sum(o.loss for o in wants).backward()
    for out, want, w in zip(outs, wants, weights):
        torch.testing.assert_close(out.loss, want.loss, atol=1e-6, rtol=1e-6)
        assert (out.attentions is not None) == w
    for (name, p), q in zip(lm.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_output_attentions_of_concurrent_calls_in_threads(monkeypatch):
    """The block's request is per thread: calls with output_attentions=True in one thread get their weights while
    another thread calls the same model without (a review found 119 of 300 calls given None)."""
    import threading

    monkeypatch.delenv("PIPEGOOSE_SMALL_NUMEL")
    lm = _lm().eval()
    fuse(lm)
    ids = models.inputs(left_pad=(0, 0, 0))[0]
    missing, errors = [], []

    def asking():
        try:
            with torch.no_grad():
                for _ in range(60):
                    att = lm(input_ids=ids, output_attentions=True).attentions
                    missing.extend(a for a in att if a is None)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def plain():
        with torch.no_grad():
            for _ in range(60):
                assert lm(input_ids=ids).attentions is None

    threads = [threading.Thread(target=asking), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not missing


def test_a_copied_or_pickled_fused_model_keeps_its_weights_hooks():
    """The hook is a module-level function acting on the module it is called for: a pickled fused model loads (a
    closure would not pickle), and a copy returns its own weights."""
    lm = _lm()
    fuse(lm)
    ids = models.inputs(left_pad=(0, 0, 0))[0]
    want = lm(input_ids=ids, output_attentions=True).attentions
    for other in (copy.deepcopy(lm), pickle.loads(pickle.dumps(lm))):
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv("PIPEGOOSE_SMALL_NUMEL")   # (the SDPA path: weights only where asked)
            got = other(input_ids=ids, output_attentions=True).attentions
        assert all(torch.allclose(a, b) for a, b in zip(got, want))
    unfuse(lm)


@pytest.mark.parametrize("path", ["softmax", "cpu_sdpa"])
def test_generation_with_the_cache_gives_eager_tokens(monkeypatch, path):
    alibi_checks.check_generation(monkeypatch, path, _lm())


def test_attention_dropout_in_training_only():
    """attn_dropout_p (the config's attn_pdrop): dropped in training (other draws than eager's, the same p), not in
    eval, where the fused model's values are eager's."""
    lm = _lm(dropout=0.5)
    ref = copy.deepcopy(lm)
    fuse(lm)
    assert lm.transformer.blocks[0].attn.attn_dropout_p == 0.5
    ids = models.inputs(left_pad=(0, 0, 0))[0]
    lm.eval()
    ref.eval()
    torch.testing.assert_close(lm(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    lm.train()
    torch.manual_seed(0)
    a = lm(input_ids=ids).logits
    torch.manual_seed(1)
    assert not torch.allclose(a, lm(input_ids=ids).logits)


def test_kinds_keep_dry_run_and_refusals_in_the_report():
    """As Bloom's (the hooks for output_attentions neither under attention='keep' nor in a dry run); MPT's torch.nn.GELU
    and loss are counted as not requested too."""
    lm = _lm()
    assert fuse(lm, ops=["layer_norm"], dry_run=True).not_requested == {"attention": 2, "gelu": 2, "cross_entropy": 1}
    for kw in (dict(attention="keep"), dict(dry_run=True)):
        fuse(lm, **kw)
        assert type(lm.transformer.blocks[0].attn).__name__ == "MptAttention"
        assert not mpt.watched(lm.transformer.blocks[0]), kw
        unfuse(lm)

    def refuse(att):
        att.q_ln = torch.nn.LayerNorm(32)   # (MosaicML's own code has qk_ln norms)

    alibi_checks.check_left_out_kept_dry_run_and_refused(lm, "MptAttention", refuse, "other submodules (q_ln)")


def test_unfuse_hands_back_attributes_changed_while_fused_and_the_bare_module_is_a_skipped_row():
    lm = _lm()
    alibi_checks.check_attributes_handed_back(lm, "transformer.blocks.0.attn",
                                              dict(attn_dropout_p=0.25, softmax_scale=0.5, tag=7))
    alibi_checks.check_the_bare_module_is_a_skipped_row(lm.transformer.blocks[1].attn, "FusedMptAttention")
    block = fuse(lm.transformer.blocks[1])   # (the block itself: the hooks go on the model fused)
    assert [r.fused for r in block.rows if r.kind == "attention"] == [True] and mpt.watched(lm.transformer.blocks[1])
    unfuse(lm.transformer.blocks[1])
    assert not mpt.watched(lm.transformer.blocks[1])


def test_a_holder_without_output_attentions_gets_no_hooks():
    """An MptAttention held by a module whose forward takes no output_attentions: fused, no hooks, the row says the
    weights come only where the softmax path runs."""
    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = _attention()

        def forward(self, x, position_bias):
            return self.attn(x, position_bias)[0]

    holder = Holder()
    report = fuse(holder)
    (row,) = [r for r in report.rows if r.kind == "attention"]
    assert row.fused and "Holder's forward takes no output_attentions" in row.reason and not mpt.watched(holder)
    assert holder(torch.randn(1, 4, 64), build_mpt_alibi_tensor(4, 64)).shape == (1, 4, 64)
    unfuse(holder)


def test_a_second_fuse_holds_the_fused_attention():
    lm = _lm()
    alibi_checks.check_a_second_fuse_holds(lm, "transformer", "MptAttention")
    assert not mpt.watched(lm.transformer.blocks[0])


# ------------------------------------------------------------------------------------------------ on a GPU
#: (batch, positions, hidden, heads, left padding of the second sequence): 16 heads of 64 at odd positions, and
#: the e2e model's heads (16 of 128, MPT-7B's head size) at 2048 positions, where MPT's raw ALiBi values reach -1450
CUDA_SHAPES = {"odd": (2, 301, 1024, 16, 37), "2048": (2, 2048, 2048, 16, 300)}


@alibi_checks.cuda_float64_cases(CUDA_SHAPES)
def test_on_cuda_matches_float64(monkeypatch, path, dtype, shape):
    """Left padding (rows without a key), causal: our fused masked softmax (strict) or SDPA with the query-relative
    bias; outputs and gradients against float64, zeros where a query has no key, and on average within 25% of eager
    MPT's distance from float64 in the same dtype (eager rounds its scores to the dtype and adds the fp32 bias
    exactly; ours rounds the query-relative bias, and on the softmax path the biased scores, to the dtype: on the CPU
    with CUDA pretended, bf16 and fp16 at 301 and 2048 positions, ours was 0.93-1.06x eager's distance, both paths,
    outputs and gradients)."""
    b, s, hidden_size, heads, pad = CUDA_SHAPES[shape]
    att = _attention(hidden=hidden_size, heads=heads, dtype=dtype, device="cuda", positions=s)
    fused = FusedMptAttention.from_module(copy.deepcopy(att))
    g = torch.Generator(device="cuda").manual_seed(11)
    hidden = torch.randn(b, s, hidden_size, generator=g, device="cuda").to(dtype).requires_grad_()
    position_bias = build_mpt_alibi_tensor(heads, s, device="cuda")
    masked = _masked(b, s, (0, pad), device="cuda")
    run = alibi_checks.run_on_cuda(
        monkeypatch, path, dtype, lambda x: fused(x, position_bias, attention_mask=masked)[0], hidden, pad, g)
    assert torch.equal(run[0][1, :pad], torch.zeros_like(run[0][1, :pad]))   # (out_proj has no bias)
    # eager MPT in the same 16-bit dtype: its rows without a key (uniform weights over every key) left out
    alibi_checks.check_against_float64_and_eager(
        dtype, pad, 1.25, hidden, run, lambda x: _reference(copy.deepcopy(att).double(), x, position_bias, masked)[0],
        lambda x: att(x, position_bias, attention_mask=masked)[0])


@pytest.mark.cuda
@pytest.mark.usefixtures("no_tuning_table")
def test_on_cuda_a_fused_bf16_model_trains_as_the_eager_one(monkeypatch):
    """An MPT LM in bf16 on the GPU, fused with the default rules (SDPA for the attention): the losses of a few AdamW
    steps within the training tolerance of the unfused model's, the attention on SDPA; output_attentions=True returns
    the weights (the fused softmax)."""
    monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "1")
    lm = _lm(dtype=torch.bfloat16, device="cuda", hidden=256, heads=4, max_seq_len=128).train()
    ids = alibi_checks.check_trains_as_eager(lm)
    with torch.no_grad():
        attentions = lm(input_ids=ids[:1], output_attentions=True).attentions
    assert len(attentions) == 2 and all(a is not None and a.shape == (1, 4, 128, 128) for a in attentions)
