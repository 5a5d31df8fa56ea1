"""Bloom's attention (``BloomAttention``: ALiBi) on pipegoose's attention function: ``FusedBloomAttention``, the bias
``alibi_bias``, the probe ``probe_bloom_attention`` and ``fuse(model)`` replacing the modules; against a float64
reference and the unfused model on the CPU (both paths: the softmax path, and the SDPA path with CUDA pretended), and,
marked ``cuda``, on a GPU."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from pipegoose.nn.fusion import FusedBloomAttention
from pipegoose.nn.fusion.fuse import fuse, unfuse
from pipegoose.nn.fusion.transformers import bloom
from tolerances import tol

from . import alibi_checks, models

BloomAttention = models.transformers_attr("bloom", "modeling", "BloomAttention")
build_alibi_tensor = models.transformers_attr("bloom", "modeling", "build_alibi_tensor")


def _attention(hidden=64, heads=4, seed=0, dtype=torch.float32, device="cpu"):
    torch.manual_seed(seed)
    return BloomAttention(models.config("bloom", hidden=hidden, heads=heads), layer_idx=0).to(device, dtype)


def _lm(dtype=torch.float32, device="cpu", **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(models.config("bloom", **kw)).to(device, dtype)


def _masks(batch, seq, left_pad, dtype, device="cpu"):
    """(2-D padding mask, Bloom's alibi [b * h, 1, s] for 4 heads, transformers' additive causal mask [b, 1, s, s],
    masked [b, 1, s, s] bool): left padding ``left_pad[i]`` in row i (its first queries have no key)."""
    mask2d = torch.ones(batch, seq, dtype=torch.long, device=device)
    for i, p in enumerate(left_pad):
        mask2d[i, :p] = 0
    alibi = build_alibi_tensor(mask2d, 4, dtype)
    j = torch.arange(seq, device=device)
    masked = (j[None, :] > j[:, None])[None, None] | (mask2d[:, None, None, :] == 0)
    additive = torch.zeros(masked.shape, dtype=dtype, device=device).masked_fill(masked, torch.finfo(dtype).min)
    return mask2d, alibi, additive, masked


def _reference(att, hidden, residual, alibi, masked):
    """float64 Bloom attention; rows without a key give zeros (as every path of ours)."""
    b, s, _ = hidden.shape
    h, d = att.num_heads, att.head_dim
    qkv = F.linear(hidden.double(), att.query_key_value.weight.double(), att.query_key_value.bias.double())
    q, k, v = (t.transpose(1, 2) for t in qkv.view(b, s, h, 3, d).unbind(3))
    scores = att.inv_norm_factor * q @ k.transpose(-1, -2) + alibi.double().view(b, h, 1, -1)
    probs = torch.softmax(scores.masked_fill(masked, float("-inf")), -1).nan_to_num(0.0)
    ctx = (probs @ v).transpose(1, 2).reshape(b, s, h * d)
    return F.linear(ctx, att.dense.weight.double(), att.dense.bias.double()) + residual.double(), probs


# ------------------------------------------------------------------------------------------------ the module
@alibi_checks.float64_cases
def test_matches_float64_forward_and_backward(monkeypatch, path, dtype, left_pad):
    """Outputs and gradients (hidden states, residual, both projections) against float64, on either path; rows
    without a key (left padding) give zeros and no gradient; the attention weights only on the softmax path."""
    att = _attention(dtype=dtype)
    fused = FusedBloomAttention.from_module(att)
    g = torch.Generator().manual_seed(3)
    hidden, residual = (torch.randn(3, 9, 64, generator=g).to(dtype).requires_grad_() for _ in range(2))
    _, alibi, additive, masked = _masks(3, 9, left_pad, dtype)
    out = alibi_checks.check_float64_forward_backward(
        monkeypatch, path, dtype, att, lambda x, r: fused(x, r, alibi, additive),
        lambda a, x, r: _reference(a, x, r, alibi, masked), (hidden, residual),
        ("query_key_value.weight", "dense.weight"), g)
    if left_pad[2]:
        # row 2's first 6 queries have no key: the attention gives zeros, so their output is dense's bias + residual
        want_rows = (att.dense.bias.double() + residual[2, :6].double())
        torch.testing.assert_close(out[2, :6].double(), want_rows, **tol(dtype, 2))


def test_off_cuda_sdpa_runs_unless_the_variables_ask_for_the_softmax_path(monkeypatch):
    """Off CUDA no kernel of ours runs, and the softmax's reference path made a CPU forward 2.3x slower than eager
    Bloom's: SDPA runs there (counted as attention/sdpa; the report says so), with float64's values; rows without a
    key give zeros. PIPEGOOSE_SMALL_NUMEL=0 or PIPEGOOSE_IMPL_ATTENTION=pipegoose: the softmax path; so does a call
    that asks for the attention weights."""
    att = _attention()
    fused = FusedBloomAttention.from_module(att)
    g = torch.Generator().manual_seed(8)
    hidden, residual = torch.randn(3, 9, 64, generator=g), torch.randn(3, 9, 64, generator=g)
    _, alibi, additive, masked = _masks(3, 9, (0, 3, 6), torch.float32)
    alibi_checks.check_off_cuda_paths(
        monkeypatch, lambda w: fused(hidden, residual, alibi, additive, output_attentions=w),
        _reference(att, hidden, residual, alibi, masked)[0], _lm())


def test_fp32_equals_bloom_eager_on_the_cpu_softmax_path():
    """On the CPU (reference path) in fp32, padding on the right (no row without a key): the module's values and
    attention weights are BloomAttention's own within fp32 rounding (its baddbmm rounds ALiBi and the scaled scores
    in one operation, ours in two), in training and eval mode."""
    att = _attention()
    fused = FusedBloomAttention.from_module(att)
    g = torch.Generator().manual_seed(5)
    hidden, residual = torch.randn(2, 7, 64, generator=g), torch.randn(2, 7, 64, generator=g)
    mask2d = torch.ones(2, 7, dtype=torch.long)
    mask2d[1, -2:] = 0
    alibi = build_alibi_tensor(mask2d, 4, torch.float32)
    j = torch.arange(7)
    masked = (j[None, :] > j[:, None])[None, None] | (mask2d[:, None, None, :] == 0)
    additive = torch.zeros(masked.shape).masked_fill(masked, torch.finfo(torch.float32).min)
    for mode in (True, False):
        att.train(mode)
        fused.train(mode)
        want = att(hidden, residual, alibi, additive, output_attentions=True)
        got = fused(hidden, residual, alibi, additive, output_attentions=True)
        torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got[1], want[1], atol=1e-7, rtol=1e-6)


def test_the_constructor_refuses_sizes_that_do_not_fit():
    att = _attention()
    kw = {k: getattr(att, k) for k in bloom._CHILDREN + bloom._ATTRIBUTES}
    with pytest.raises(ValueError, match=r"num_heads: 5 heads of head_dim 16 do not make hidden_size 64"):
        FusedBloomAttention(**{**kw, "num_heads": 5})
    with pytest.raises(ValueError, match=r"query_key_value: expected 64 -> 192 features, got 64 -> 64"):
        FusedBloomAttention(**{**kw, "query_key_value": torch.nn.Linear(64, 64)})
    with pytest.raises(ValueError, match=r"query_key_value: expected 64 -> 192 features, got 32 -> 192"):
        FusedBloomAttention(**{**kw, "query_key_value": torch.nn.Linear(32, 192)})
    with pytest.raises(ValueError, match=r"dense: expected 64 input features, got 32"):
        FusedBloomAttention(**{**kw, "dense": torch.nn.Linear(32, 64)})
    with pytest.raises(TypeError, match=r"query_key_value: expected a torch.nn.Linear, got Identity"):
        FusedBloomAttention(**{**kw, "query_key_value": torch.nn.Identity()})
    with pytest.raises(ValueError, match=r"hidden_dropout: expected a probability in \[0, 1\], got 2.0"):
        FusedBloomAttention(**{**kw, "hidden_dropout": 2.0})
    with pytest.raises(TypeError, match=r"attention: expected a BloomAttention, got Linear"):
        FusedBloomAttention.from_module(torch.nn.Linear(2, 2))
    fused = FusedBloomAttention.from_module(att)
    assert fused.query_key_value is att.query_key_value and fused.dense is att.dense
    assert "num_heads=4, head_dim=16" in repr(fused)


def test_bad_alibi_and_masks_name_the_argument():
    fused = FusedBloomAttention.from_module(_attention())
    x = torch.randn(2, 5, 64)
    _, alibi, additive, _ = _masks(2, 5, (0, 0), torch.float32)
    with pytest.raises(ValueError, match=r"alibi: expected shape \[8 \(batch \* heads\), 1, 5 \(keys\)\], "
                                         r"got \(4, 1, 5\)"):
        fused(x, x, alibi[:4], additive)
    with pytest.raises(ValueError, match=r"alibi: expected shape .*, got \(8, 1, 1\)"):
        fused(x, x, alibi[..., :1], None)
    with pytest.raises(ValueError, match=r"attention_mask: expected shape"):
        fused(x, x, alibi, additive[..., :3])
    with pytest.raises(TypeError, match=r"attention_mask: expected a bool or floating-point mask, got dtype "
                                        r"torch.int64"):
        fused(x, x, alibi, additive.long())
    with pytest.raises(TypeError, match=r"alibi: expected a floating-point tensor"):
        fused(x, x, alibi.long(), additive)


# ------------------------------------------------------------------------------------------------ the bias
def test_alibi_bias_is_built_once_and_per_sequence_only_where_sequences_differ():
    _, alibi, additive, _ = _masks(3, 6, (0, 0, 0), torch.float32)
    bias = bloom.alibi_bias(alibi, additive, batch=3, heads=4, query_len=6, key_len=6)
    assert bias.shape == (1, 4, 6, 6)   # Bloom without padding: the same for every sequence
    torch.testing.assert_close(bias.expand(3, 4, 6, 6), alibi.view(3, 4, 1, 6) + additive)
    assert bloom.alibi_bias(alibi, additive, batch=3, heads=4, query_len=6, key_len=6) is bias   # (cached)
    additive[0, 0, 5, 0] = torch.finfo(torch.float32).min                # in place: a new bias, per sequence now
    again = bloom.alibi_bias(alibi, additive, batch=3, heads=4, query_len=6, key_len=6)
    assert again is not bias and again.shape == (3, 4, 6, 6)
    torch.testing.assert_close(again, alibi.view(3, 4, 1, 6) + additive)
    _, alibi_p, additive_p, _ = _masks(3, 6, (0, 2, 0), torch.float32)
    assert bloom.alibi_bias(alibi_p, additive_p, batch=3, heads=4, query_len=6, key_len=6).shape == (3, 4, 6, 6)
    assert bloom.alibi_bias(alibi_p, None, batch=3, heads=4, query_len=6, key_len=6).shape == (3, 4, 1, 6)
    attend = additive_p == 0                                               # bool, True = attend
    from_bool = bloom.alibi_bias(alibi_p, attend, batch=3, heads=4, query_len=6, key_len=6, beta=0.5)
    want = (0.5 * alibi_p.view(3, 4, 1, 6)).masked_fill(~attend, torch.finfo(torch.float32).min)
    torch.testing.assert_close(from_bool, want)
    with torch.inference_mode():   # (not cacheable there: computed per call, the same values)
        a = bloom.alibi_bias(alibi, additive, batch=3, heads=4, query_len=6, key_len=6)
        assert a.shape == (3, 4, 6, 6) and bloom.alibi_bias(alibi, additive, batch=3, heads=4, query_len=6,
                                                            key_len=6) is not a


def test_alibi_slopes_are_blooms():
    """The slopes, fp32, are transformers' own bit for bit (powers of two and not), and a bad count is refused."""
    get = models.transformers_attr("bloom", "modeling", "_get_alibi_slopes")
    for heads in (1, 2, 3, 5, 8, 12, 16, 24, 32, 40, 112):
        assert torch.equal(bloom.alibi_slopes(heads), get(heads, "cpu")), heads
    with pytest.raises(ValueError, match="heads: expected at least 1, got 0"):
        bloom.alibi_slopes(0)


def _bias_softmax_error(bias, exact, masked):
    """The largest difference between the softmax of ``bias`` alone and that of the float64 ``exact`` one, over the
    rows that have a key."""
    def sm(x):
        return torch.softmax(x.double().masked_fill(masked, float("-inf")), -1).nan_to_num(0.0)

    return float((sm(bias) - sm(exact)).abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("padded", [False, True], ids=["causal", "left_padded"])
def test_a_16_bit_alibi_is_rebuilt_exactly_and_made_query_relative(dtype, padded):
    """8 heads at 1024 positions (ALiBi's values to 511, 2 apart in bf16): the bias from Bloom's 16-bit alibi is
    the query-relative bias of its fp32 values, rounded once, so its softmax is within 1e-3 of float64's where the
    bf16 alibi's own is 0.1 or more off; the rebuilt values round to the given alibi bit for bit; without a mask
    (no padding) the same; with a cache (the last 5 queries of the keys) its rows are the full bias's last ones;
    under torch.inference_mode, uncached, the sum of the given alibi and the mask."""
    b, s, h = 2, 1024, 8
    mask2d = torch.ones(b, s, dtype=torch.long)
    if padded:
        mask2d[1, :150] = 0
    alibi = build_alibi_tensor(mask2d, h, dtype)
    j = torch.arange(s)
    masked = (j[None, :] > j[:, None])[None, None] | (mask2d[:, None, None, :] == 0)
    additive = torch.zeros(masked.shape, dtype=dtype).masked_fill(masked, torch.finfo(dtype).min)
    a32 = build_alibi_tensor(mask2d, h, torch.float32).double().view(b, h, 1, s)
    exact = (a32 - a32.transpose(-1, -2)).masked_fill(masked, 0.0)   # (the float64 query-relative bias)
    bias = bloom.alibi_bias(alibi, additive, batch=b, heads=h, query_len=s, key_len=s)
    assert bias.dtype == dtype and bias.shape == ((b if padded else 1), h, s, s)
    assert _bias_softmax_error(bias, exact, masked) < 1e-3
    if dtype == torch.bfloat16:   # (what eager adds; fp16 holds these values exactly at this size: 0.25 apart)
        assert _bias_softmax_error(alibi.view(b, h, 1, s) + additive, exact, masked) > 0.1
    fitted = additive if padded else additive[:1]
    rebuilt = bloom.exact_alibi(alibi.view(b, h, 1, s), fitted.expand(b, 1, s, s))
    assert rebuilt.dtype == torch.float32 and torch.equal(rebuilt.to(dtype), alibi.view(b, h, 1, s))
    torch.testing.assert_close(rebuilt.double(), a32, atol=0, rtol=0)
    if not padded:
        no_mask = bloom.alibi_bias(alibi, None, batch=b, heads=h, query_len=s, key_len=s)
        assert no_mask.shape == (1, h, s, s)
        assert torch.equal(no_mask.masked_fill(masked, 0), bias.masked_fill(masked, 0))
    q = 5
    last = bloom.alibi_bias(alibi, additive[:, :, -q:], batch=b, heads=h, query_len=q, key_len=s)
    assert torch.equal(last, bias.expand(b, h, s, s)[:, :, -q:][:last.shape[0]])
    with torch.inference_mode():   # (not cached there: the given alibi, no check's sync in every layer)
        got = bloom.alibi_bias(alibi, additive[:, :, -q:], batch=b, heads=h, query_len=q, key_len=s)
    assert torch.equal(got, alibi.view(b, h, 1, s) + additive[:, :, -q:])


def test_an_alibi_that_is_not_blooms_rounding_keeps_the_sum_formula():
    """An alibi that the rebuilt values do not round to (another formula, or a mask whose last row is not the
    padding), and any fp32 alibi, give ``beta * alibi + mask`` as before, bit for bit."""
    _, alibi, additive, _ = _masks(2, 40, (0, 7), torch.bfloat16)
    other = (alibi.float() * 1.5).bfloat16()
    got = bloom.alibi_bias(other, additive, batch=2, heads=4, query_len=40, key_len=40)
    assert torch.equal(got, other.view(2, 4, 1, 40) + additive)
    shifted = additive.clone()
    shifted[1, :, -1, 7] = torch.finfo(torch.bfloat16).min   # (the last row masks one more key: other positions)
    got = bloom.alibi_bias(alibi, shifted, batch=2, heads=4, query_len=40, key_len=40)
    assert torch.equal(got, alibi.view(2, 4, 1, 40) + shifted)
    _, alibi32, additive32, _ = _masks(2, 40, (0, 7), torch.float32)
    got = bloom.alibi_bias(alibi32, additive32, batch=2, heads=4, query_len=40, key_len=40, beta=0.5)
    assert torch.equal(got, 0.5 * alibi32.view(2, 4, 1, 40) + additive32)


def test_nothing_derived_from_the_mask_outlives_the_forward_pass(monkeypatch):
    """The one-entry caches (the bias; the SDPA path's copy of it; the mask's plan) drop their entry when the tensor
    it was derived from is freed: after the forward pass nothing of the [b, h, sq, sk] size stays held (a review:
    after unfuse and del model, 256-512 MiB of it stayed cached)."""
    alibi_checks.check_nothing_outlives_the_forward_pass(monkeypatch, _lm, bloom._bias_cache)


def test_the_caches_keep_one_entry_and_no_finalizer_of_a_replaced_one():
    """A second review: the finalizers that drop a cache entry held the entry, so an entry holding a view of its
    tensor (the bias of a call without mask is a view of alibi) kept it alive for ever, and each miss on a mask that
    stays alive (changed in place) left a finalizer holding the superseded plan."""
    import gc

    from pipegoose.nn.fusion.transformers import attention as A

    for _ in range(20):
        bloom.alibi_bias(torch.randn(8, 1, 16), None, batch=2, heads=4, query_len=1, key_len=16)
    gc.collect()
    assert sum(isinstance(o, torch.Tensor) and o.shape == (8, 1, 16) for o in gc.get_objects()) <= 1
    m = torch.zeros(2, 1, 16, 16)
    m[..., 0] = -1.0   # (a bias, not 0 / min: a "bias" plan)
    for _ in range(20):
        m.add_(0.0)    # (in place: a new version, a miss)
        A.plan_mask(m, query_len=16, key_len=16, causal=True)
    gc.collect()
    assert sum(isinstance(o, A.MaskPlan) for o in gc.get_objects()) == 1
    assert len(A._plan_cache["finalizers"]) == 1
    del m
    gc.collect()
    assert "entry" not in A._plan_cache


def test_on_the_meta_device_and_under_fake_tensors():
    """A fused model runs on the meta device and under FakeTensorMode, as the eager one (the check for a bias that
    is the same per sequence compares values: skipped there)."""
    alibi_checks.check_meta_and_fake_tensors(_lm())


# ------------------------------------------------------------------------------------------------ the probe
class _DoubledAlibiBloomAttention(BloomAttention):
    """A BloomAttention that adds twice the ALiBi bias: another formula, which the probe must refuse."""

    def forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
                output_attentions=False, **kwargs):
        return super().forward(hidden_states, residual, 2 * alibi, attention_mask, layer_past, use_cache,
                               output_attentions)


class _OtherWithoutWeightsBloomAttention(BloomAttention):
    """Bloom's formula where the attention weights are asked for, another one (ALiBi left out) where not."""

    def forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
                output_attentions=False, **kwargs):
        return super().forward(hidden_states, residual, alibi if output_attentions else 0 * alibi, attention_mask,
                               layer_past, use_cache, output_attentions)


class _OtherArgumentsBloomAttention(BloomAttention):
    def forward(self, hidden_states, alibi, attention_mask, residual=None, **kwargs):
        return super().forward(hidden_states, residual, alibi, attention_mask)


def test_the_probe_accepts_bloom_and_refuses_other_formulas():
    att = _attention()
    assert bloom.probe_bloom_attention(att).ok and bloom.candidate(att)
    cfg = models.config("bloom", hidden=64, heads=4)
    doubled = bloom.probe_bloom_attention(_DoubledAlibiBloomAttention(cfg, 0))
    assert "does not compute Bloom's ALiBi attention" in doubled.reason
    assert "are not Bloom's" in bloom.probe_bloom_attention(_OtherArgumentsBloomAttention(cfg, 0)).reason
    other = bloom.probe_bloom_attention(_OtherWithoutWeightsBloomAttention(cfg, 0))
    assert "does not compute Bloom's ALiBi attention" in other.reason
    alibi_checks.check_a_wrapped_projection_is_refused(bloom.probe_bloom_attention, bloom.candidate, _attention(),
                                                       "query_key_value")
    tp = _attention()
    tp.pretraining_tp, tp.slow_but_exact = 2, True
    assert "pretraining_tp > 1 with slow_but_exact" in bloom.probe_bloom_attention(tp).reason
    assert not bloom.candidate(FusedBloomAttention.from_module(att)) and not bloom.candidate(torch.nn.Linear(2, 2))
    alibi_checks.check_probe_apart(bloom.probe_bloom_attention, att, _attention(device="meta"))


# ------------------------------------------------------------------------------------------------ fuse
def test_fuse_replaces_bloom_attention_and_unfuse_puts_it_back():
    alibi_checks.check_fuse_and_unfuse(_lm(), ["transformer.h.0.self_attention", "transformer.h.1.self_attention"],
                                       "BloomAttention", "FusedBloomAttention")


def test_left_padding_gives_zeros_where_eager_gives_weights_and_the_rest_is_eager():
    """Left padding: the queries of padded positions have no key; ours gives their attention zeros (eager: weights
    over masked keys). The positions that are not padding get eager's values."""
    alibi_checks.check_left_padding(_lm())   # (left padding 0 / 4 / 2)


@pytest.mark.parametrize("path", ["softmax", "cpu_sdpa"])
def test_generation_with_the_cache_gives_eager_tokens(monkeypatch, path):
    alibi_checks.check_generation(monkeypatch, path, _lm())


def test_output_attentions_returns_eager_weights():
    lm = _lm()
    ref = copy.deepcopy(lm)
    fuse(lm)
    ids = models.inputs(left_pad=(0, 0, 0))[0]
    got = lm(input_ids=ids, output_attentions=True).attentions
    want = ref(input_ids=ids, output_attentions=True).attentions
    assert len(got) == len(want) == 2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_kinds_keep_dry_run_and_refusals_in_the_report():
    def refuse(att):
        att.pretraining_tp, att.slow_but_exact = 2, True

    alibi_checks.check_left_out_kept_dry_run_and_refused(_lm(), "BloomAttention", refuse, "pretraining_tp")


def test_unfuse_hands_back_attributes_changed_while_fused_and_a_wrapped_module_is_a_skipped_row():
    lm = _lm()
    att = alibi_checks.check_attributes_handed_back(lm, "transformer.h.0.self_attention",
                                                    dict(hidden_dropout=0.25, beta=0.5, split_size=7))
    att.query_key_value = torch.nn.Sequential(att.query_key_value)
    report = fuse(lm)
    row = next(r for r in report.rows if r.path == "transformer.h.0.self_attention")
    assert not row.fused and not row.eligible and "not Bloom's layout" in row.reason
    assert "AttentionInterface" in report.attention["reason"] and "where fuse finds" in report.attention["reason"]
    unfuse(lm)
    alibi_checks.check_the_bare_module_is_a_skipped_row(lm.transformer.h[1].self_attention, "FusedBloomAttention")


def test_a_second_fuse_holds_the_fused_attention():
    alibi_checks.check_a_second_fuse_holds(_lm(), "transformer", "BloomAttention")


# ------------------------------------------------------------------------------------------------ on a GPU
#: (batch, positions, hidden, heads, left padding of the second sequence): 16 heads of 64 at odd positions, and
#: BLOOM-1B7's heads (16 of 128) at 2048 positions, where ALiBi's terms reach ~1400 and eager Bloom's bf16 scores
#: are 8 apart
CUDA_SHAPES = {"odd": (2, 301, 1024, 16, 37), "1b7_2048": (2, 2048, 2048, 16, 300)}


@alibi_checks.cuda_float64_cases(CUDA_SHAPES)
def test_on_cuda_matches_float64(monkeypatch, path, dtype, shape):
    """Left padding (rows without a key), causal: our fused masked softmax (strict) or SDPA with the bias; outputs and
    gradients against float64 (with ALiBi's fp32 values, which transformers rounds to the dtype: the fused module
    rebuilds them), zeros where a query has no key, and no farther from float64 on average than eager Bloom in the
    same dtype (whose scores are rounded to the dtype before its fp32 softmax, with the rounded ALiBi)."""
    b, s, hidden_size, heads, pad = CUDA_SHAPES[shape]
    att = _attention(hidden=hidden_size, heads=heads, dtype=dtype, device="cuda")
    fused = FusedBloomAttention.from_module(copy.deepcopy(att))
    g = torch.Generator(device="cuda").manual_seed(11)
    hidden = torch.randn(b, s, hidden_size, generator=g, device="cuda").to(dtype).requires_grad_()
    residual = torch.randn(b, s, hidden_size, generator=g, device="cuda").to(dtype)
    mask2d = torch.ones(b, s, dtype=torch.long, device="cuda")
    mask2d[1, :pad] = 0
    alibi = build_alibi_tensor(mask2d, heads, dtype)
    alibi32 = build_alibi_tensor(mask2d, heads, torch.float32)   # (the values before transformers' cast)
    j = torch.arange(s, device="cuda")
    masked = (j[None, :] > j[:, None])[None, None] | (mask2d[:, None, None, :] == 0)
    additive = torch.zeros(masked.shape, dtype=dtype, device="cuda").masked_fill(masked, torch.finfo(dtype).min)
    run = alibi_checks.run_on_cuda(
        monkeypatch, path, dtype, lambda x: fused(x, residual, alibi, additive)[0], hidden, pad, g)
    torch.testing.assert_close(run[0][1, :pad].double(), att.dense.bias.double() + residual[1, :pad].double(),
                               **tol(dtype, 2))
    # eager Bloom in the same 16-bit dtype: its rows without a key (uniform weights over masked keys) left out
    alibi_checks.check_against_float64_and_eager(
        dtype, pad, 1.1, hidden, run,
        lambda x: _reference(copy.deepcopy(att).double(), x, residual, alibi32, masked)[0],
        lambda x: att(x, residual, alibi, additive)[0])


@pytest.mark.cuda
@pytest.mark.usefixtures("no_tuning_table")
def test_on_cuda_a_fused_bf16_model_trains_as_the_eager_one(monkeypatch):
    """A Bloom LM in bf16 on the GPU, fused with the default rules (SDPA for the attention): the losses of a few
    AdamW steps within the training tolerance of the unfused model's, the attention on SDPA."""
    monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "1")
    alibi_checks.check_trains_as_eager(_lm(dtype=torch.bfloat16, device="cuda", hidden=256, heads=4).train())
