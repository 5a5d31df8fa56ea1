"""The pipegoose attention function and mask conversion, against a float64 reference (CPU: reference paths)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipegoose.nn.fusion.transformers.attention import (additive_to_boolean_mask, pipegoose_attention_forward,
                                                        plan_mask)
from pipegoose.nn.fusion.transformers.matching import probe_rms_norm
from tolerances import tol

from .models import LlamaStyleRMSNorm


class _Mod(nn.Module):
    def __init__(self, causal):
        super().__init__()
        self.is_causal = causal


def _reference(q, k, v, masked, scale, head_mask=None):
    """float64: softmax(scale q k^T) with masked keys excluded; fully masked rows give zeros."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    if masked is not None:
        s = s.masked_fill(masked, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    if head_mask is not None:
        p = p * head_mask.double()
    return (p @ v).transpose(1, 2), p


def _float_mask(masked, dtype):
    return torch.zeros(masked.shape, dtype=dtype).masked_fill(masked, torch.finfo(dtype).min)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("sq,sk,hq,hkv", [(7, 7, 4, 2), (1, 9, 2, 2), (33, 33, 3, 1), (5, 12, 4, 4)])
@pytest.mark.parametrize("kind", ["none", "causal", "padding", "bool"])
def test_attention_matches_float64(dtype, sq, sk, hq, hkv, kind):
    g = torch.Generator().manual_seed(sq * 100 + sk)
    b, d = 3, 8
    q = torch.randn(b, hq, sq, d, generator=g).to(dtype).requires_grad_()
    k = torch.randn(b, hkv, sk, d, generator=g).to(dtype).requires_grad_()
    v = torch.randn(b, hkv, sk, d, generator=g).to(dtype).requires_grad_()
    scale = 0.37
    causal = kind == "causal"
    masked = None
    mask_arg = None
    if kind in ("padding", "bool"):
        masked = torch.zeros(b, 1, sq, sk, dtype=torch.bool)
        masked[1, :, :, :3] = True
        masked[2] = True                              # a fully masked batch row
        mask_arg = ~masked if kind == "bool" else _float_mask(masked, dtype)
    elif causal and sq > 1:
        masked = torch.ones(sq, sk, dtype=torch.bool).triu(1).view(1, 1, sq, sk)
    out, probs = pipegoose_attention_forward(_Mod(causal), q, k, v, mask_arg, scaling=scale)
    ref_out, ref_p = _reference(q, k, v, masked, scale)
    assert out.dtype == dtype and out.shape == (b, sq, hq, d) and out.is_contiguous()
    torch.testing.assert_close(out.double(), ref_out, **tol(dtype, 4))
    torch.testing.assert_close(probs.double(), ref_p, **tol(dtype, 4))
    go = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), go.to(dtype))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_grads = torch.autograd.grad(_reference(qd, kd, vd, masked, scale)[0], (qd, kd, vd), go)
    for name, a, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(a.double(), r, **tol(dtype, 8), msg=lambda m: f"grad {name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("sq,sk,hq,hkv", [(7, 7, 4, 2), (1, 9, 2, 2), (5, 12, 4, 4)])
@pytest.mark.parametrize("kind", ["none", "causal", "padding", "bool"])
def test_small_problems_run_sdpa(monkeypatch, dtype, sq, sk, hq, hkv, kind):
    """Below PIPEGOOSE_SMALL_NUMEL score elements the function runs F.scaled_dot_product_attention (counted as
    attention/sdpa, no weights returned); outputs and gradients still match the float64 reference, fully masked
    rows included (zeros, for bool and additive masks alike, as on the softmax path). PIPEGOOSE_SMALL_NUMEL=0 turns
    it off."""
    from pipegoose.nn.fusion import dispatch
    from pipegoose.nn.fusion.ops import _common

    monkeypatch.setattr(_common, "on_kernel_device", lambda t: t.dtype != torch.float64)   # CUDA only: pretend, to test it here
    monkeypatch.delenv("PIPEGOOSE_SMALL_NUMEL")
    g = torch.Generator().manual_seed(sq * 10 + sk)
    b, d = 3, 8
    q = torch.randn(b, hq, sq, d, generator=g).to(dtype).requires_grad_()
    k = torch.randn(b, hkv, sk, d, generator=g).to(dtype).requires_grad_()
    v = torch.randn(b, hkv, sk, d, generator=g).to(dtype).requires_grad_()
    causal, masked, mask_arg = kind == "causal", None, None
    if kind in ("padding", "bool"):
        masked = torch.zeros(b, 1, sq, sk + 2, dtype=torch.bool)   # two extra keys: cut off, as for static caches
        masked[1, :, :, :3] = True
        masked[2] = True
        mask_arg = ~masked if kind == "bool" else _float_mask(masked, dtype)
        masked = masked[..., :sk]
    elif causal and sq > 1:
        masked = torch.ones(sq, sk, dtype=torch.bool).triu(1).view(1, 1, sq, sk)
    dispatch.reset_stats()
    out, probs = pipegoose_attention_forward(_Mod(causal), q, k, v, mask_arg, scaling=0.37)
    assert probs is None and dispatch.stats() == {"attention": {"sdpa": 1}}
    ref_out = _reference(q, k, v, masked, 0.37)[0]
    assert out.dtype == dtype and out.shape == (b, sq, hq, d) and out.is_contiguous()
    torch.testing.assert_close(out.double(), ref_out, **tol(dtype, 4))
    go = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), go)
    assert all(torch.isfinite(t).all() for t in grads)
    monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "0")
    dispatch.reset_stats()
    _, probs = pipegoose_attention_forward(_Mod(causal), q, k, v, mask_arg, scaling=0.37)
    assert probs is not None and "attention" not in dispatch.stats()


def test_large_scores_run_sdpa_unless_the_tuning_table_or_the_variable_asks_for_ours(monkeypatch):
    """Scores of PIPEGOOSE_SMALL_NUMEL elements or more took the softmax path (materialised scores) in models loaded
    with eager attention and fused, which made BERT-base at 16 x 512 12% slower than unfused on the H200 (session 20).
    Now they run SDPA too, unless the GPU's tuning table names pipegoose attention for the key length or
    PIPEGOOSE_IMPL_ATTENTION=pipegoose; PIPEGOOSE_SMALL_NUMEL=0 keeps the softmax path at every size."""
    from pipegoose.nn.fusion import dispatch
    from pipegoose.nn.fusion.ops import _common
    from pipegoose.nn.fusion.transformers import attention as A

    monkeypatch.setattr(_common, "on_kernel_device", lambda t: t.dtype != torch.float64)
    monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "16")      # the scores below have 2 * 2 * 4 * 4 = 64 elements
    monkeypatch.delenv("PIPEGOOSE_IMPL_ATTENTION", raising=False)
    q = k = v = torch.randn(2, 2, 4, 8)

    def run():
        dispatch.reset_stats()
        probs = pipegoose_attention_forward(_Mod(True), q, k, v, None, scaling=0.3)[1]
        return probs is None, dispatch.stats().get("attention", {})

    assert run() == (True, {"sdpa": 1})
    assert dispatch.last_choice("attention").source == "builtin"
    monkeypatch.setenv("PIPEGOOSE_IMPL_ATTENTION", "pipegoose")
    assert run() == (False, {})
    monkeypatch.delenv("PIPEGOOSE_IMPL_ATTENTION")
    monkeypatch.setattr(A, "tuned_attention_impl", lambda device, dtype, key_len: "pipegoose")
    assert run() == (False, {})
    monkeypatch.setattr(A, "tuned_attention_impl", lambda device, dtype, key_len: None)
    monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "0")
    assert run() == (False, {})


def test_small_problem_path_refuses_bad_masks(monkeypatch):
    from pipegoose.nn.fusion.ops import _common

    monkeypatch.setattr(_common, "on_kernel_device", lambda t: t.dtype != torch.float64)
    monkeypatch.delenv("PIPEGOOSE_SMALL_NUMEL")
    q = k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="attention_mask"):
        pipegoose_attention_forward(_Mod(False), q, k, v, torch.ones(1, 1, 4, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="attention_mask"):
        pipegoose_attention_forward(_Mod(False), q, k, v, torch.ones(1, 1, 4, 4, dtype=torch.int64))
    # a mask for another batch or head count: a ValueError naming it (SDPA raised a bare RuntimeError)
    for shape in ((3, 1, 4, 4), (1, 3, 4, 4)):
        with pytest.raises(ValueError, match=r"attention_mask: expected shape \[1, 2 or 1, 4 or 1, >= 4\]"):
            pipegoose_attention_forward(_Mod(False), q, k, v, torch.ones(*shape, dtype=torch.bool))


def test_small_problem_rule_is_cuda_only_so_strict_sees_cpu_fallbacks(monkeypatch):
    """On the CPU our softmax cannot run: small scores take the reference softmax (a fallback) rather than SDPA, so
    strict mode raises, and the weights are returned."""
    from pipegoose.nn.fusion import dispatch

    monkeypatch.delenv("PIPEGOOSE_SMALL_NUMEL")
    q = k = v = torch.randn(1, 2, 4, 8)
    _, probs = pipegoose_attention_forward(_Mod(False), q, k, v, None)
    assert probs is not None
    with dispatch.strict(), pytest.raises(dispatch.FusionFallbackError):
        pipegoose_attention_forward(_Mod(False), q, k, v, None)


def test_attention_table_slug_is_the_dispatchers():
    from pipegoose.nn.fusion import dispatch
    from pipegoose.nn.fusion.transformers import attention

    for name in ("NVIDIA H200", "cpu (x86_64)", "-GPU-"):
        assert attention.device_slug(name) == dispatch.device_slug(name)


def test_head_mask_and_bias():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 4, generator=g) for _ in range(3))
    head_mask = torch.tensor([1.0, 0.0]).view(1, 2, 1, 1)
    out, _ = pipegoose_attention_forward(_Mod(False), q, k, v, None, scaling=0.5, head_mask=head_mask)
    torch.testing.assert_close(out.double(), _reference(q, k, v, None, 0.5, head_mask)[0], **tol(torch.float32))
    bias = torch.randn(2, 1, 5, 5, generator=g)       # a real additive bias (not 0/min): added to the scores
    out, _ = pipegoose_attention_forward(_Mod(False), q, k, v, bias, scaling=0.5)
    s = (q.double() @ k.double().transpose(-1, -2)) * 0.5 + bias.double()
    torch.testing.assert_close(out.double(), (torch.softmax(s, -1) @ v.double()).transpose(1, 2),
                               **tol(torch.float32))


def test_head_mask_of_one_value_per_head():
    """A 1-D head_mask [h] scales heads, not key columns: with h == sk the product as it stood broadcast over the
    keys and silently masked key column 1 instead of head 1; a mask that fits neither way is a ValueError naming it
    (a [layers, h] mask, which transformers 5's BERT passes through unsliced, gave a bare broadcasting error)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 4, 8, generator=g) for _ in range(3))   # h == sk == 4
    head_mask = torch.tensor([1.0, 0.0, 1.0, 1.0])
    out, probs = pipegoose_attention_forward(_Mod(False), q, k, v, None, scaling=0.5, head_mask=head_mask)
    ref = _reference(q, k, v, None, 0.5, head_mask.view(1, 4, 1, 1))[0]
    torch.testing.assert_close(out.double(), ref, **tol(torch.float32))
    assert probs[:, 1].abs().max() == 0 and probs[:, 0].sum(-1).sub(1).abs().max() < 1e-5
    with pytest.raises(ValueError, match=r"head_mask: expected \[4\] \(one value per head\)"):
        pipegoose_attention_forward(_Mod(False), q, k, v, None, scaling=0.5, head_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="head_mask: a 1-D mask needs one value per head"):
        pipegoose_attention_forward(_Mod(False), q, k, v, None, scaling=0.5, head_mask=torch.ones(3))


def test_plan_mask_classification():
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1).view(1, 1, 6, 6).expand(2, 1, 6, 6)
    assert plan_mask(None, query_len=6, key_len=6, causal=True).kind == "causal"
    assert plan_mask(None, query_len=1, key_len=6, causal=True).kind == "none"
    assert plan_mask(None, query_len=6, key_len=6, causal=False).kind == "none"
    assert plan_mask(_float_mask(causal, torch.float32), query_len=6, key_len=6, causal=True).kind == "causal"
    assert plan_mask(~causal, query_len=6, key_len=6, causal=True).kind == "causal"
    assert plan_mask(torch.ones(2, 1, 6, 6, dtype=torch.bool), query_len=6, key_len=6, causal=False).kind == "none"
    padded = causal.clone()
    padded[1, :, :, 0] = True
    p = plan_mask(_float_mask(padded, torch.bfloat16), query_len=6, key_len=6, causal=True)
    assert p.kind == "masked" and torch.equal(p.mask, padded)
    # a longer mask (static cache) is cut to the key length
    long = torch.zeros(2, 1, 6, 9)
    assert plan_mask(long, query_len=6, key_len=6, causal=False).kind == "none"
    with pytest.raises(ValueError, match="attention_mask"):
        plan_mask(torch.zeros(2, 6, 6), query_len=6, key_len=6, causal=False)
    with pytest.raises(ValueError, match="attention_mask"):
        plan_mask(torch.zeros(2, 1, 6, 4), query_len=6, key_len=6, causal=False)
    with pytest.raises(TypeError, match="attention_mask"):
        plan_mask(torch.zeros(2, 1, 6, 6, dtype=torch.int32), query_len=6, key_len=6, causal=False)


def test_additive_to_boolean_mask():
    m = torch.tensor([[0.0, torch.finfo(torch.float32).min, float("-inf"), 0.0]])
    assert additive_to_boolean_mask(m).tolist() == [[False, True, True, False]]
    assert additive_to_boolean_mask(torch.tensor([[0.0, -1.5]])) is None     # a real bias
    with pytest.raises(TypeError, match="attention_mask"):
        additive_to_boolean_mask(torch.tensor([[0, 1]]))


_LlamaStyle = LlamaStyleRMSNorm


class _GatedStyle(_LlamaStyle):
    """Bamba / Mamba2 style: the model calls norm(x, gate); with gate=None it is a Llama-style RMSNorm."""

    def forward(self, x, gate=None):
        if gate is not None:
            x = x * nn.functional.silu(gate)
        return super().forward(x)


class _GemmaStyle(_LlamaStyle):
    def forward(self, x):
        return super().forward(x) / self.weight * (1 + self.weight)


class _NoBiasLayerNorm(_LlamaStyle):
    def forward(self, x):
        return self.weight * nn.functional.layer_norm(x, x.shape[-1:], eps=self.variance_epsilon)


def test_rms_norm_probe():
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    p = probe_rms_norm(_LlamaStyle(16))
    assert p.ok and not p.output_in_weight_dtype
    p = probe_rms_norm(T5LayerNorm(16, eps=1e-5))
    assert p.ok and p.eps == 1e-5 and p.output_in_weight_dtype
    assert probe_rms_norm(nn.RMSNorm(16)).ok
    # any size: a model's hidden size or a head's (Qwen3's q_norm over head_dim)
    assert probe_rms_norm(_LlamaStyle(8)).ok and probe_rms_norm(_LlamaStyle(2)).ok
    # but not a weight that broadcasts over other widths, nor a forward that takes more than the input (a gated
    # norm): FusedRMSNorm could not run what the model passes them
    p = probe_rms_norm(_LlamaStyle(1))
    assert not p.ok and "broadcasts" in p.reason, p
    p = probe_rms_norm(_GatedStyle(8))
    assert not p.ok and "gate" in p.reason, p
    for bad, why in ((_GemmaStyle(16), "differs"), (_NoBiasLayerNorm(16), "differs"),
                     (nn.Linear(16, 16, bias=False), "2-D")):
        p = probe_rms_norm(bad)
        assert not p.ok and why in p.reason, p
    # the probe does not run the module itself: its hooks do not fire and its weight is untouched
    m = _LlamaStyle(16)
    calls = []
    m.register_forward_hook(lambda *a: calls.append(1))
    w = m.weight.detach().clone()
    assert probe_rms_norm(m).ok and not calls and torch.equal(m.weight, w)


def test_unknown_kwargs_raise():
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(NotImplementedError, match="softcap"):
        pipegoose_attention_forward(_Mod(True), q, q, q, None, softcap=30.0)
    with pytest.raises(ValueError, match="heads"):
        pipegoose_attention_forward(_Mod(True), q, torch.randn(1, 3, 3, 4), torch.randn(1, 3, 3, 4), None)


def test_small_problem_path_keeps_weights_when_transformers_collects_them(monkeypatch):
    """output_attentions=True on a fused model: the small-problem SDPA path would return no weights (an empty
    tuple), so it steps aside while transformers collects them."""
    from pipegoose.nn.fusion import dispatch, fuse
    from pipegoose.nn.fusion.ops import _common

    from . import models as M

    monkeypatch.setattr(_common, "on_kernel_device", lambda t: t.dtype != torch.float64)
    monkeypatch.delenv("PIPEGOOSE_SMALL_NUMEL")
    m = M.build("gpt2")
    ids, mask = M.inputs()
    ref = m(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    fuse(m)
    dispatch.reset_stats()
    out = m(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert len(out) == len(ref) > 0 and "attention" not in dispatch.stats()
    m(input_ids=ids, attention_mask=mask)
    assert dispatch.stats()["attention"]["sdpa"] > 0


@pytest.mark.parametrize("style", ["t5", "llama"])
@pytest.mark.parametrize("xdt,wdt", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                     (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)])
def test_fused_rms_norm_keeps_the_module_output_dtype(style, xdt, wdt):
    """A T5LayerNorm with a half weight returns the weight's dtype whatever the input's (fused, it returned fp32
    for fp32 input: Llama's rule); Llama-style norms return promote(weight, input). Values within the dtype."""
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    from pipegoose.nn.fusion import fuse

    norm = T5LayerNorm(32, eps=1e-6) if style == "t5" else _LlamaStyle(32)
    m = nn.Sequential(nn.Linear(32, 32), norm).to(xdt)
    m[1].to(wdt)
    x = torch.randn(4, 32, dtype=xdt)
    ref = m(x)
    report = fuse(m)
    assert any(r.kind == "rms_norm" and r.fused for r in report.rows)
    out = m(x)
    assert out.dtype == ref.dtype, (style, xdt, wdt, out.dtype, ref.dtype)
    lowest = wdt if torch.finfo(wdt).bits < torch.finfo(xdt).bits or wdt == torch.bfloat16 else xdt
    torch.testing.assert_close(out.float(), ref.float(), **tol(lowest, 4))


@pytest.mark.parametrize("hkv", [4, 2])
def test_transformers_sdpa_wrapper_zeroes_rows_without_keys(hkv):
    """'pipegoose_sdpa' calls transformers' sdpa function through _transformers_sdpa, which opens a bool mask's rows
    that have no key and zeroes their output (CUDA's SDPA gave NaN gradients there; tests/fuse/test_fuse_cuda.py):
    here on the CPU, the result is unchanged elsewhere (against transformers' function called directly, and the
    float64 reference), GQA included, and a mask with extra trailing keys (static caches) is cut first."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from pipegoose.nn.fusion.transformers.attention import _transformers_sdpa

    g = torch.Generator().manual_seed(3)
    b, hq, s, d = 3, 4, 9, 8
    mod = _Mod(True)
    mod.num_key_value_groups = hq // hkv
    q = torch.randn(b, hq, s, d, generator=g, requires_grad=True)
    k = torch.randn(b, hkv, s, d, generator=g, requires_grad=True)
    v = torch.randn(b, hkv, s, d, generator=g, requires_grad=True)
    j = torch.arange(s + 2)
    pad = torch.tensor([0, 4, s + 2])
    attend = (j[None, :s + 2] <= torch.arange(s)[:, None])[None] & (j[None, None, :] >= pad[:, None, None])
    mask = attend[:, None]                                    # [b, 1, s, s + 2]; batch row 2: no key at all
    out, w = _transformers_sdpa(mod, q, k, v, mask, scaling=0.3)
    assert w is None and out.shape == (b, s, hq, d)
    assert out[2].abs().max().item() == 0 and out[1, :4].abs().max().item() == 0
    direct, _ = sdpa_attention_forward(mod, q, k, v, mask[..., :s], scaling=0.3)
    torch.testing.assert_close(out, direct)   # the CPU's SDPA gives zeros there itself
    ref_out = _reference(q, k, v, ~mask[..., :s], 0.3)[0]
    torch.testing.assert_close(out.double(), ref_out, **tol(torch.float32, 4))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(t).all() for t in grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bfloat16, "-inf"], ids=str)
def test_sdpa_paths_agree_with_the_softmax_path_on_additive_masks(monkeypatch, dtype, mask_dtype):
    """An additive mask (the mask dtype's minimum, or -inf, for masked keys; an fp32 mask on 16-bit queries
    included) with rows that have no key: the small-problem SDPA path and transformers' sdpa function behind
    'pipegoose_sdpa' give what the softmax path gives (zeros there, the float64 reference elsewhere) and finite
    gradients, so that a fused model's padded rows do not depend on the batch size or on torch.compile. Before, the
    SDPA paths gave such rows uniform weights, and an fp32 minimum cast to a 16-bit dtype became -inf."""
    from pipegoose.nn.fusion import dispatch
    from pipegoose.nn.fusion.ops import _common
    from pipegoose.nn.fusion.transformers.attention import _transformers_sdpa

    g = torch.Generator().manual_seed(7)
    b, h, s, d = 3, 2, 6, 8
    q, k, v = (torch.randn(b, h, s, d, generator=g).to(dtype).requires_grad_() for _ in range(3))
    j = torch.arange(s)
    masked = ~((j[None, :] <= j[:, None])[None] & (j[None, None, :] >= torch.tensor([0, 2, s])[:, None, None]))
    masked = masked[:, None]                                      # [b, 1, s, s]: causal, left padding 0 / 2 / all
    if mask_dtype == "-inf":
        mask = torch.zeros(masked.shape).masked_fill(masked, float("-inf"))
    else:
        mask = torch.zeros(masked.shape, dtype=mask_dtype).masked_fill(masked, torch.finfo(mask_dtype).min)
    ref = _reference(q, k, v, masked, 0.3)[0]
    monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "0")
    soft, _ = pipegoose_attention_forward(_Mod(True), q, k, v, mask, scaling=0.3)   # the softmax path
    monkeypatch.setattr(_common, "on_kernel_device", lambda t: True)                 # CUDA only: pretend
    monkeypatch.delenv("PIPEGOOSE_SMALL_NUMEL")
    dispatch.reset_stats()
    small, _ = pipegoose_attention_forward(_Mod(True), q, k, v, mask, scaling=0.3)
    assert dispatch.stats() == {"attention": {"sdpa": 1}}
    mod = _Mod(True)
    mod.num_key_value_groups = 1
    via_tf, _ = _transformers_sdpa(mod, q, k, v, mask, scaling=0.3)
    for name, out in (("softmax path", soft), ("small-problem SDPA", small), ("transformers sdpa", via_tf)):
        assert out[2].abs().max().item() == 0 and out[1, :2].abs().max().item() == 0, name
        torch.testing.assert_close(out.double(), ref, **tol(dtype, 4), msg=lambda m: f"{name}: {m}")
        grads = torch.autograd.grad(out.float().sum(), (q, k, v))
        assert all(torch.isfinite(t).all() for t in grads), name


def test_pipegoose_sdpa_applies_head_mask():
    """'pipegoose_sdpa' hands calls to transformers' sdpa function where the tuning table prefers SDPA (always on
    the CPU); that function ignores head_mask, so a call with one runs ours: the masked head's output is zero, as
    from pipegoose_attention_forward (it was the unmasked head's output)."""
    from pipegoose.nn.fusion.transformers.attention import pipegoose_sdpa_attention_forward

    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g) for _ in range(3))
    mod = _Mod(False)
    mod.num_key_value_groups = 1
    head_mask = torch.tensor([1.0, 0.0, 1.0, 0.5])
    out, _ = pipegoose_sdpa_attention_forward(mod, q, k, v, None, scaling=0.3, head_mask=head_mask)
    ref = _reference(q, k, v, None, 0.3, head_mask=head_mask.view(1, 4, 1, 1))[0]
    assert out[:, :, 1].abs().max().item() == 0
    torch.testing.assert_close(out.double(), ref, **tol(torch.float32, 4))


def test_sdpa_mask_is_computed_once_per_mask_tensor(monkeypatch):
    """The SDPA paths derive the opened mask and the rows to keep once per mask tensor (transformers passes one to
    every layer), again after the mask is changed in place, and per query dtype."""
    from pipegoose.nn.fusion.ops import _common
    from pipegoose.nn.fusion.transformers import attention as A

    monkeypatch.setattr(_common, "on_kernel_device", lambda t: True)   # the small-problem path, CUDA only: pretend
    monkeypatch.delenv("PIPEGOOSE_SMALL_NUMEL")
    calls = []
    real = A._sdpa_mask
    monkeypatch.setattr(A, "_sdpa_mask", lambda m, dt: calls.append(dt) or real(m, dt))
    q = k = v = torch.randn(2, 2, 4, 8)
    mask = torch.ones(2, 1, 4, 4, dtype=torch.bool).tril()
    mask[1] = False
    outs = [A.pipegoose_attention_forward(_Mod(True), q, k, v, mask)[0] for _ in range(3)]
    assert len(calls) == 1 and all(torch.equal(o, outs[0]) for o in outs) and outs[0][1].abs().max() == 0
    mask[1, :, 3, 0] = True                                          # in place: a row of batch 1 gets a key
    out = A.pipegoose_attention_forward(_Mod(True), q, k, v, mask)[0]
    assert len(calls) == 2 and out[1, 3].abs().max() > 0 and out[1, :3].abs().max() == 0
    A.pipegoose_attention_forward(_Mod(True), q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    assert len(calls) == 3


@pytest.mark.parametrize("path", ["softmax", "small_problem", "pipegoose_sdpa"])
def test_masks_under_inference_mode_and_masks_that_require_grad(monkeypatch, path):
    """The mask caches (plan_mask's, the SDPA paths') read the mask's version counter: a fused model failed under
    torch.inference_mode() ("Inference tensors do not track version counter"); and a learned additive mask reused
    for a second forward and backward failed ("backward through the graph a second time") or got no gradient after
    a no_grad call. Now such masks are not cached: results as outside inference mode, gradients as the float64
    reference's, every time."""
    from pipegoose.nn.fusion.ops import _common
    from pipegoose.nn.fusion.transformers.attention import pipegoose_sdpa_attention_forward

    if path == "small_problem":
        monkeypatch.setattr(_common, "on_kernel_device", lambda t: True)   # CUDA only: pretend
        monkeypatch.delenv("PIPEGOOSE_SMALL_NUMEL")
    mod = _Mod(True)
    mod.num_key_value_groups = 1
    fn = pipegoose_sdpa_attention_forward if path == "pipegoose_sdpa" else pipegoose_attention_forward
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, 4, 8, generator=g) for _ in range(3))
    bool_mask = torch.ones(2, 1, 4, 4, dtype=torch.bool).tril()
    bool_mask[1, :, :2, :2] = False                                 # left padding: rows 0-1 of batch 1 have no key
    expected = fn(mod, q, k, v, bool_mask, scaling=0.3)[0]
    with torch.inference_mode():
        m = bool_mask.clone()
        for _ in range(2):
            torch.testing.assert_close(fn(mod, q, k, v, m, scaling=0.3)[0], expected)
    bias = (torch.randn(2, 1, 4, 4, generator=g) * 0.5).requires_grad_()
    q64, k64, v64, b64 = (t.detach().double().requires_grad_() for t in (q, k, v, bias))
    ref = torch.softmax((q64 @ k64.transpose(-1, -2)) * 0.3 + b64, -1) @ v64
    ref_grad = torch.autograd.grad(ref.sum(), b64)[0]
    with torch.no_grad():
        fn(mod, q, k, v, bias, scaling=0.3)
    for _ in range(2):
        out = fn(mod, q, k, v, bias, scaling=0.3)[0]
        (grad,) = torch.autograd.grad(out.sum(), bias)
        torch.testing.assert_close(grad.double(), ref_grad, **tol(torch.float32, 4))


def test_sdpa_paths_do_not_hide_nan_in_an_additive_mask(monkeypatch):
    """A NaN in an additive mask is no masked key: the row's output is NaN, as from the softmax path and eager (the
    small-problem SDPA path took a row of NaN for a row without keys and gave zeros)."""
    from pipegoose.nn.fusion.ops import _common

    monkeypatch.setattr(_common, "on_kernel_device", lambda t: True)   # CUDA only: pretend
    monkeypatch.delenv("PIPEGOOSE_SMALL_NUMEL")
    q = k = v = torch.randn(1, 1, 3, 8)
    mask = torch.zeros(1, 1, 3, 3)
    mask[0, 0, 1] = float("nan")
    out = pipegoose_attention_forward(_Mod(False), q, k, v, mask, scaling=0.3)[0]
    assert torch.isnan(out[0, 1]).all() and torch.isfinite(out[0, [0, 2]]).all()


def test_a_bad_impl_attention_variable_is_an_error(monkeypatch):
    """PIPEGOOSE_IMPL_ATTENTION=bogus ran a fused model without a word (any value was taken as a request); now the
    attention function raises the ValueError that names it, as under torch.compile."""
    import torch._dynamo as dynamo

    from pipegoose.nn.fusion.fuse import fuse, unfuse

    from . import models

    model = models.build("gpt2", "eager")
    ids, mask = models.inputs()
    fuse(model)
    monkeypatch.setenv("PIPEGOOSE_IMPL_ATTENTION", "bogus")
    with pytest.raises(ValueError, match="PIPEGOOSE_IMPL_ATTENTION='bogus'"):
        model(input_ids=ids, attention_mask=mask)
    dynamo.reset()
    with pytest.raises(ValueError, match="PIPEGOOSE_IMPL_ATTENTION='bogus'"):
        torch.compile(model, backend="eager")(input_ids=ids, attention_mask=mask)
    dynamo.reset()
    monkeypatch.setenv("PIPEGOOSE_IMPL_ATTENTION", "pipegoose")
    model(input_ids=ids, attention_mask=mask)
    unfuse(model)


def test_review_fixes_output_attentions_kwarg_and_pipegoose_sdpa_env(monkeypatch):
    """transformers 4.x passes output_attentions=True to the attention function (5.x has its output recorder): the
    SDPA paths returned no weights for it. And pipegoose_sdpa took any PIPEGOOSE_IMPL_ATTENTION value silently."""
    from pipegoose.nn.fusion.ops import _common
    from pipegoose.nn.fusion.transformers import attention as A

    monkeypatch.setattr(_common, "on_kernel_device", lambda t: t.dtype != torch.float64)
    monkeypatch.delenv("PIPEGOOSE_SMALL_NUMEL")
    q = k = v = torch.randn(1, 2, 4, 8)
    assert pipegoose_attention_forward(_Mod(True), q, k, v, None)[1] is None               # small: SDPA
    assert pipegoose_attention_forward(_Mod(True), q, k, v, None, output_attentions=True)[1] is not None
    monkeypatch.setenv("PIPEGOOSE_IMPL_ATTENTION", "bogus")
    with pytest.raises(ValueError, match="PIPEGOOSE_IMPL_ATTENTION='bogus'"):
        A.pipegoose_sdpa_attention_forward(_Mod(True), q, k, v, None)


def test_pipegoose_sdpa_honours_impl_attention_pipegoose(monkeypatch):
    """Second review: PIPEGOOSE_IMPL_ATTENTION=pipegoose was only validated by pipegoose_sdpa, which kept running
    transformers' SDPA; now it takes our function there too (which then runs its softmax path for large scores)."""
    from pipegoose.nn.fusion.transformers import attention as A

    called = []
    monkeypatch.setattr(A, "pipegoose_attention_forward", lambda *a, **k: called.append(1) or ("ours", None))
    monkeypatch.setattr(A, "_transformers_sdpa", lambda *a, **k: ("sdpa", None))
    q = k = v = torch.randn(1, 2, 4, 8)
    monkeypatch.delenv("PIPEGOOSE_IMPL_ATTENTION", raising=False)
    assert A.pipegoose_sdpa_attention_forward(_Mod(True), q, k, v, None)[0] == "sdpa"
    monkeypatch.setenv("PIPEGOOSE_IMPL_ATTENTION", "pipegoose")
    assert A.pipegoose_sdpa_attention_forward(_Mod(True), q, k, v, None)[0] == "ours" and called


def test_attention_rules_come_from_the_dispatchers_validated_table(tmp_path, monkeypatch, caplog):
    """The attention function read the tuning table on its own (its own cache, which dispatch.clear_tuning_cache did
    not clear, and no validation: a rule whose max_cols is not a number raised in every attention call). It now takes
    the dispatcher's table: validated once, a malformed one ignored with a warning, valid rules used."""
    import json
    import logging

    from pipegoose.nn.fusion import dispatch
    from pipegoose.nn.fusion.transformers import attention as A

    monkeypatch.setattr(dispatch, "TUNING_DIR", str(tmp_path))
    monkeypatch.setattr(dispatch, "_device_name", lambda device: "Fake GPU Z-9")
    path = tmp_path / "fake_gpu_z_9.json"
    rule = {"op": "attention", "dtype": "bfloat16", "max_cols": "a lot", "impl": "pipegoose"}
    path.write_text(json.dumps({"device": "Fake GPU Z-9", "rules": [rule]}))
    dispatch.clear_tuning_cache()
    dev = torch.device("cuda")
    with caplog.at_level(logging.WARNING, logger="pipegoose.nn.fusion.dispatch"):
        assert A.tuned_attention_impl(dev, torch.bfloat16, 128) is None
    assert "max_cols" in caplog.text
    path.write_text(json.dumps({"device": "Fake GPU Z-9", "rules": [{**rule, "max_cols": 256}]}))
    dispatch.clear_tuning_cache()
    assert A.tuned_attention_impl(dev, torch.bfloat16, 128) == "pipegoose"
    assert A.tuned_attention_impl(dev, torch.bfloat16, 512) is None
    assert A.tuned_attention_impl(dev, torch.float16, 128) is None
    assert A.table_prefers_pipegoose(dev, torch.bfloat16) and not A.table_prefers_pipegoose(dev, torch.float16)
    dispatch.clear_tuning_cache()
