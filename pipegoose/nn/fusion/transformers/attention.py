"""The ``pipegoose`` attention function for transformers' ``AttentionInterface``.

transformers (>= 4.48) routes the attention of most models through a table of functions keyed by
``config._attn_implementation``. We register two entries of our own (new names only; nothing of transformers is
patched):

``"pipegoose"``
    ``softmax(scale * Q K^T, mask) V`` with the softmax taken by ``pipegoose.nn.fusion.functional``
    (``scaled_upper_triang_masked_softmax`` when the mask is absent or exactly causal, ``scaled_masked_softmax``
    otherwise), which dispatches to the fused kernels (Megatron-LM's ``scaled_masked_softmax`` /
    ``scaled_upper_triang_masked_softmax`` via ColossalAI 0.5.0, or pipegoose's ``softmax``) or to the reference path.
    Where the scale is applied: on CUDA the softmax applies it in fp32 (the kernels' semantics; 16-bit results differ
    from transformers' eager ones at the last bit); off CUDA (no kernel can run) ``Q K^T * scale`` is rounded to the
    scores' dtype first, as transformers' eager functions do, and the softmax gets scale 1: the eager model's 16-bit
    outputs bit for bit.
``"pipegoose_sdpa"``
    The same, except that for each call the GPU's tuning table (``pipegoose/nn/fusion/tuning/<slug>.json``, op
    ``"attention"``) decides between ours and transformers' ``sdpa`` function. Selected by ``fuse(attention="auto")``
    on a model that runs SDPA when the table says ours is faster for some shapes.

Selecting an entry is per instance: ``fuse`` points the model's modules at a copy of their config whose
``_attn_implementation`` names our entry (see ``pipegoose.nn.fusion.fuse``).

Masks. For both entries a mask function is registered in ``AttentionMaskInterface`` (transformers >= 4.53) that
builds SDPA's boolean masks (True = attend, ``None`` when no masking is needed). Older transformers versions, and
callers passing a ready 4-D mask, hand us transformers' additive float masks (0 or the dtype's minimum). Both are
converted here to the Megatron convention: boolean, True = masked. A float mask holding other values (a real bias)
is added to the scaled scores before an unmasked softmax. Fully masked rows give zeros on every path of ours, the
SDPA ones included (transformers' eager path gives uniform weights there).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import dispatch
from ..ops import _common

ATTENTION_NAME = "pipegoose"
ATTENTION_SDPA_NAME = "pipegoose_sdpa"
OUR_NAMES = (ATTENTION_NAME, ATTENTION_SDPA_NAME)

# kwargs that change the math of attention in ways our function does not implement; when one is set we refuse
# instead of silently ignoring it.
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks")


# --------------------------------------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MaskPlan:
    """How to apply one attention mask.

    kind: ``"none"`` (no key masked), ``"causal"`` (key j masked for query i when j > i, top-left aligned as SDPA's
    ``is_causal``), ``"masked"`` (``mask`` is bool, True = masked, broadcastable to ``[b, h, sq, sk]``) or ``"bias"``
    (the mask is a float tensor added to the scaled scores; ``mask`` says which of its keys are masked: at or below
    half its dtype's minimum). The plan holds nothing of the mask tensor itself, so that a cached plan does not keep
    it alive (:func:`_mask_cached`).
    """

    kind: str
    mask: torch.Tensor | None = None   # "masked"; for "bias", its keys at or below half the dtype's minimum


def additive_to_boolean_mask(mask: torch.Tensor) -> torch.Tensor | None:
    """Convert transformers' additive float mask to a boolean mask, True = masked.

    Args:
        mask: float tensor, any shape (typically ``[b, 1, sq, sk]`` or ``[b, 1, 1, sk]``) holding 0 for keys that
            take part and a large negative value (the dtype's minimum, or ``-inf``) for masked keys.
    Returns:
        A bool tensor of the same shape, or ``None`` when the mask holds other values too (a real bias such as
        ALiBi), which cannot be expressed as a boolean mask.
    Raises:
        TypeError: ``mask`` is not a floating-point tensor.
    """
    if not mask.is_floating_point():
        raise TypeError(f"attention_mask: expected a floating-point additive mask, got dtype {mask.dtype}")
    # Anything at or below half the dtype's minimum is "masked": eager masks use finfo.min, and two masks added
    # together may overflow to -inf. exp() of such a value is exactly 0 in every dtype.
    masked = mask <= torch.finfo(mask.dtype).min / 2
    if not bool(((mask == 0) | masked).all()):
        return None
    return masked


def _causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    """bool [1, 1, sq, sk], True = masked, top-left aligned (key j masked for query i when j > i), like SDPA."""
    q = torch.arange(sq, device=device).view(sq, 1)
    k = torch.arange(sk, device=device).view(1, sk)
    return (k > q).view(1, 1, sq, sk)


def _fit_mask(m: torch.Tensor, query_len: int, key_len: int, batch: int | None = None,
              heads: int | None = None) -> torch.Tensor:
    """``m`` checked against ``[b or 1, h or 1, query_len or 1, >= key_len]`` (b and h only when given) and cut to
    ``key_len`` keys.

    Raises:
        ValueError: the mask's rank or dimensions do not fit.
    """
    if m.dim() != 4:
        raise ValueError(f"attention_mask: expected a 4-D mask [b, 1, sq, sk], got shape {tuple(m.shape)}")
    bad_b = batch is not None and m.shape[0] not in (1, batch)
    bad_h = heads is not None and m.shape[1] not in (1, heads)
    if m.shape[-1] < key_len or m.shape[-2] not in (1, query_len) or bad_b or bad_h:
        dims = [(name if n is None else str(n)) + (" or 1" if n != 1 else "")
                for name, n in (("b", batch), ("h", heads), ("sq", query_len))]
        raise ValueError(f"attention_mask: expected shape [{', '.join(dims)}, >= {key_len}], got {tuple(m.shape)}")
    return m[..., :key_len] if m.shape[-1] > key_len else m


# One-entry cache: the same mask tensor is passed to every layer of one forward pass, and classifying it costs a
# device synchronisation. The entry is keyed by the tensor's identity and version counter (_cacheable says when not).
_plan_cache: dict = {}


def _cacheable(mask: torch.Tensor) -> bool:
    """Whether results derived from ``mask`` may be cached by its identity and version counter (:func:`plan_mask`,
    :func:`_sdpa_mask_for`). Not: while ``torch.compile`` traces; in inference mode or for an inference tensor (no
    version counter: reading it raised, so a fused model failed under ``torch.inference_mode()``, and an inference
    tensor cannot be saved for a later backward); for a mask that requires grad (the entry would hold its graph for
    the next call's backward); during CUDA graph capture (a replay must recompute what it derives from the mask). A
    write that bypasses the version counter (``mask.data[...] = ...``) is not seen: make a new mask instead."""
    if torch.compiler.is_compiling() or torch.is_inference_mode_enabled() or mask.is_inference() or mask.requires_grad:
        return False
    return not (mask.is_cuda and torch.cuda.is_current_stream_capturing())


def _mask_cached(store: dict, attention_mask: torch.Tensor, extra: tuple, compute):
    """``compute()``, from the one-entry cache ``store`` when its entry is for this mask tensor (identity, version
    counter and ``extra``), and stored there; without the cache where :func:`_cacheable` says so. The entry goes when
    the mask tensor is freed (:func:`put_entry`), so that what was derived from it is not held past the forward pass
    (a review, session 74: Bloom's [b, h, sq, sk] bias and its SDPA copy stayed cached after the model was gone)."""
    if not _cacheable(attention_mask):
        return compute()
    key = (id(attention_mask), attention_mask._version, *extra)
    hit = store.get("entry")
    if hit is not None and hit[0] == key and hit[1]() is attention_mask:
        return hit[2]
    result = compute()
    put_entry(store, (key, weakref.ref(attention_mask), result), attention_mask)
    return result


def put_entry(store: dict, entry: tuple, *tensors: torch.Tensor) -> None:
    """Make ``entry`` the one entry of the cache ``store``, removed again when any of ``tensors`` is freed. The
    finalizers hold a token, not the entry (an entry holding a view of its tensor kept it alive for ever), and those
    of the entry replaced are detached (each miss on a tensor that stays alive left one, with the superseded result:
    a second review, session 74)."""
    for f in store.pop("finalizers", ()):
        f.detach()
    token = object()

    def drop():
        if store.get("token") is token:
            store.pop("entry", None)
            store.pop("finalizers", None)

    store["entry"], store["token"] = entry, token
    store["finalizers"] = [weakref.finalize(t, drop) for t in tensors]


def plan_mask(attention_mask: torch.Tensor | None, *, query_len: int, key_len: int, causal: bool) -> MaskPlan:
    """Classify the mask transformers passes to an attention function.

    Args:
        attention_mask: ``None``; a bool mask (SDPA convention, True = attend); or an additive float mask (0 or the
            dtype's minimum, or a general bias). Shape broadcastable to ``[b, h, sq, sk']`` with ``sk' >= sk``
            (extra trailing keys, as older transformers pass for static caches, are cut off).
        query_len, key_len: sq and sk of this call.
        causal: whether the module is causal (only used when ``attention_mask`` is None, as in SDPA: a missing mask
            with ``sq > 1`` means causal).
    Returns:
        A :class:`MaskPlan`. An explicit mask that masks nothing gives ``"none"``; one equal to the causal mask gives
        ``"causal"`` (so that the causal kernel is used).
    Raises:
        ValueError: the mask's rank or last dimensions do not fit ``[.., sq, sk]``.
        TypeError: the mask is neither bool nor floating point.
    """
    if attention_mask is None:
        return MaskPlan("causal" if (causal and query_len > 1) else "none")

    m = _fit_mask(attention_mask, query_len, key_len)
    return _mask_cached(_plan_cache, attention_mask, (query_len, key_len, causal),
                        lambda: _classify(m, query_len, key_len))


def _no_values(t: torch.Tensor) -> bool:
    """A tensor whose values cannot be read: on the meta device, or a fake tensor (``FakeTensorMode``)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return t.is_meta or isinstance(t, FakeTensor)


def _classify(m: torch.Tensor, query_len: int, key_len: int) -> MaskPlan:
    """:func:`plan_mask` of the fitted mask ``m`` (uncached). A mask without values to read (:func:`_no_values`) is
    planned from its dtype alone (bool: ``"masked"``; float: ``"bias"``), which computes the same attention: a fused
    model ran on the meta device and under ``FakeTensorMode`` only where its attention was kept (a review, session
    74)."""
    if m.dtype == torch.bool:
        plan = MaskPlan("masked", mask=~m)
    elif m.is_floating_point():
        masked = None if _no_values(m) else additive_to_boolean_mask(m)
        # (a bias: its masked keys, at or below half the dtype's minimum, found once here, not per layer)
        plan = (MaskPlan("bias", mask=m <= torch.finfo(m.dtype).min / 2) if masked is None
                else MaskPlan("masked", mask=masked))
    else:
        raise TypeError(f"attention_mask: expected a bool or floating-point mask, got dtype {m.dtype}")
    if _no_values(m):
        return plan

    if plan.kind == "masked":
        masked = plan.mask
        if not bool(masked.any()):
            plan = MaskPlan("none")
        elif query_len > 1 and masked.shape[-2] == query_len:
            causal_ref = _causal_mask(query_len, key_len, masked.device)
            if bool((masked == causal_ref).all()):
                plan = MaskPlan("causal")
    return plan


# --------------------------------------------------------------------------------------------------------------------
# Tuning table (op "attention")
# --------------------------------------------------------------------------------------------------------------------
device_slug = dispatch.device_slug


def attention_rules(device: torch.device) -> tuple[dispatch.TuningRule, ...]:
    """The ``"attention"`` rules of the tuning table of the GPU ``device`` is on (empty off CUDA or without table):
    the dispatcher's table (:func:`dispatch.tuning_table`: read once, validated, a malformed one ignored with a
    warning; ``dispatch.clear_tuning_cache`` reloads it)."""
    table = dispatch.tuning_table(device)
    return () if table is None else tuple(r for r in table.rules if r.op == "attention")


def tuned_attention_impl(device: torch.device, dtype: torch.dtype, key_len: int) -> str | None:
    """The first matching rule's ``impl`` for this device, dtype and key length, or None without a matching rule."""
    for rule in attention_rules(device):
        if rule.dtype == dtype and (rule.max_cols is None or key_len <= rule.max_cols):
            return rule.impl
    return None


def table_prefers_pipegoose(device: torch.device, dtype: torch.dtype | None) -> bool:
    """True when some ``"attention"`` rule for this GPU (and dtype, when given) names ``pipegoose``."""
    return any(r.impl == "pipegoose" and (dtype is None or r.dtype == dtype) for r in attention_rules(device))


# --------------------------------------------------------------------------------------------------------------------
# The attention function
# --------------------------------------------------------------------------------------------------------------------
def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[b, hkv, s, d] -> [b, hkv * n_rep, s, d], each kv head repeated n_rep times in place (GQA / MQA)."""
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def _softmax(scores: torch.Tensor, plan: MaskPlan, scale: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The probabilities of ``scores`` [b, h, sq, sk] under ``plan``; ``bias``: the fitted float mask of a
    ``"bias"`` plan, added to the scaled scores."""
    from pipegoose.nn.fusion import functional as PF

    b, h, sq, sk = scores.shape
    if plan.kind == "causal":
        if sq == sk:
            probs = PF.scaled_upper_triang_masked_softmax(scores.reshape(b * h, sq, sk), scale)
            return probs.view(b, h, sq, sk)
        return PF.scaled_masked_softmax(scores, _causal_mask(sq, sk, scores.device), scale)
    if plan.kind == "masked":
        return PF.scaled_masked_softmax(scores, plan.mask, scale)
    if plan.kind == "bias":
        biased = scores * scale + bias.to(scores.dtype)
        return PF.scaled_masked_softmax(biased, plan.mask, 1.0)
    return PF.scaled_masked_softmax(scores, None, scale)


def runs_sdpa(device: torch.device, dtype: torch.dtype, key_len: int) -> bool:
    """Whether :func:`pipegoose_attention_forward` runs SDPA for scores of at least ``PIPEGOOSE_SMALL_NUMEL``
    elements (without ``head_mask``, attention weights not asked for) on ``device`` in ``dtype`` at this key length
    (see :func:`_sdpa_choice`)."""
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16, torch.float32)
            and dispatch.small_numel() != 0 and not _ours_asked_for(device, dtype, key_len))


def _ours_asked_for(device: torch.device, dtype: torch.dtype, key_len: int) -> bool:
    """Whether scores of at least ``PIPEGOOSE_SMALL_NUMEL`` elements take the softmax path rather than SDPA:
    ``PIPEGOOSE_IMPL_ATTENTION=pipegoose``, or the GPU's tuning table names ``pipegoose`` for this key length."""
    return (dispatch._env_request("attention")[0] == "pipegoose"
            or tuned_attention_impl(device, dtype, key_len) == "pipegoose")


def _sdpa_choice(query: torch.Tensor, sq: int, sk: int) -> dispatch.Choice | None:
    """The choice of SDPA over the softmax path for the scores ``[b, hq, sq, sk]``, or None for the softmax path.
    Only on a device and in a dtype where our fused softmax could run (elsewhere the softmax's reference path is a
    fallback, which strict mode must see), and with ``PIPEGOOSE_SMALL_NUMEL`` not 0 (0: the softmax path at every
    size). Scores of fewer elements than it: SDPA (a host-bound size). Larger ones: SDPA too, unless the GPU's tuning
    table names ``pipegoose`` for op ``attention`` at this key length, or ``PIPEGOOSE_IMPL_ATTENTION=pipegoose``:
    SDPA fuses the softmax itself, and the materialised scores of the softmax path cost more (H200, bf16, paired
    steps of models loaded with eager attention and fused, session 20: BERT-base at 16 x 512 x0.878 and GPT-2 small
    at 8 x 1024 x0.979 against unfused, on the softmax path; the same unfused models took 16-35% less time per step
    loaded with SDPA than with eager attention, calls 4 and 5; with this rule, session 21, calls 1 and 4: x1.058-1.069
    and x1.265-1.449)."""
    limit = dispatch.small_numel()
    if not limit or not _common.on_kernel_device(query):
        return None
    if query.shape[0] * query.shape[1] * sq * sk < limit:
        return _SMALL_CHOICE
    return None if _ours_asked_for(query.device, query.dtype, sk) else _UNTUNED_CHOICE


_COLLECTOR: list = []   # [transformers' output-recorder context variable or None], filled at the first call


def _active_collector():
    """transformers' output-recorder context variable (transformers >= 5), imported once (an import statement on
    every attention call costs ~0.5 us of host time); None where that API is absent. A plain list, not
    functools.lru_cache, which torch.compile warns about when it traces the call."""
    if not _COLLECTOR:
        try:
            from transformers.utils.output_capturing import _active_collector as collector
        except ImportError:
            collector = None
        _COLLECTOR.append(collector)
    return _COLLECTOR[0]


def _weights_requested() -> bool:
    """Whether transformers is collecting attention weights in this forward (``output_attentions=True``; its output
    recorder, transformers >= 5; transformers 4.x passes ``output_attentions`` to the attention function, which the
    caller checks); SDPA returns none, so such calls keep the softmax path. False where that API is absent."""
    collector = _active_collector()
    if collector is None:
        return False
    collected = collector.get()
    return bool(collected) and any("attentions" in k for k in collected)


_SMALL_CHOICE = dispatch.Choice(
    "attention", "sdpa", "small", False, {},
    "scores below PIPEGOOSE_SMALL_NUMEL elements: a host-bound size, where SDPA (one native op, native backward) "
    "costs the host less than a separate softmax")
_UNTUNED_CHOICE = dispatch.Choice(
    "attention", "sdpa", "builtin", False, {},
    "no tuning rule names pipegoose attention for this GPU, dtype and key length: SDPA, which fuses the softmax "
    "itself (PIPEGOOSE_IMPL_ATTENTION=pipegoose or PIPEGOOSE_SMALL_NUMEL=0: the softmax path)")


def _sdpa_mask(mask: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(the mask to hand to SDPA, keep [..., sq, 1]: whether the row has a key to attend) for ``mask``, a bool mask
    (True = attend) or an additive float mask (keys at or below half its dtype's minimum are masked, as on the softmax
    path: :func:`additive_to_boolean_mask`; other values are a bias), with queries of ``dtype``. Rows without a key
    are opened to every key (finite weights), and the caller multiplies SDPA's output by ``keep``, so that they give
    zeros and zero gradients, as on the softmax path; a float mask is clamped to ``dtype``'s range before the cast (an
    fp32 minimum became -inf in bf16 and fp16). No host synchronisation.

    Why: on CUDA, ``F.scaled_dot_product_attention`` with a bool mask in fp16/bf16 gives rows with no key to attend
    (left-padded causal batches) nonzero outputs by default, as with cuDNN attention forced (H200, torch 2.11; a small
    bf16 case: 1.66 and 1.53, where the efficient and math backends give 0), and in the fused GPT-2 demo NaN
    gradients; the CPU gives zeros. An additive mask's such rows gave uniform weights there, where the softmax path
    gives zeros: the same model's padded rows differed with the batch size, or under ``torch.compile``."""
    if mask.dtype == torch.bool:
        keep = mask.any(dim=-1, keepdim=True)
        return mask | ~keep, keep
    if not mask.is_floating_point():
        raise TypeError(f"attention_mask: expected a bool or floating-point mask, got dtype {mask.dtype}")
    keep = (~(mask <= torch.finfo(mask.dtype).min / 2)).any(dim=-1, keepdim=True)   # NaN is no masked key: it shows
    lo = torch.finfo(dtype).min
    return mask.masked_fill(~keep, 0).clamp(min=max(lo, torch.finfo(mask.dtype).min)).to(dtype), keep


# One-entry cache of _sdpa_mask: transformers hands the same mask tensor to every layer of a forward pass, and the
# small-problem path exists because such steps are bound by the host (three small ops per layer saved).
_sdpa_mask_cache: dict = {}


def _sdpa_mask_for(attention_mask: torch.Tensor, fitted: torch.Tensor, dtype: torch.dtype):
    """:func:`_sdpa_mask` of ``fitted`` (``attention_mask`` checked and cut by :func:`_fit_mask`), computed once per
    mask tensor: keyed by its identity and version counter, the fitted shape and ``dtype`` (not cached where
    :func:`_cacheable` says so)."""
    return _mask_cached(_sdpa_mask_cache, attention_mask, (tuple(fitted.shape), dtype),
                        lambda: _sdpa_mask(fitted, dtype))


def _small_sdpa(module, query, key, value, attention_mask, scaling, dropout, is_causal):
    """The small-problem path of :func:`pipegoose_attention_forward`: ``F.scaled_dot_product_attention`` on the
    same inputs (a bool mask: True = attend; a float mask: added; None: causal when ``is_causal`` and ``sq > 1``,
    top-left aligned). Rows without a key to attend (every key masked: False in a bool mask, at or below half the
    dtype's minimum in an additive one) give zeros and zero gradients, as on the softmax path (:func:`_sdpa_mask`)."""
    hq, hkv = query.shape[1], key.shape[1]
    sq, sk = query.shape[2], key.shape[2]
    mask = attention_mask
    keep = None
    if mask is not None:
        mask, keep = _sdpa_mask_for(mask, _fit_mask(mask, sq, sk, query.shape[0], hq), query.dtype)
    out = F.scaled_dot_product_attention(
        query, _repeat_kv(key, hq // hkv), _repeat_kv(value, hq // hkv), attn_mask=mask,
        dropout_p=dropout if module.training else 0.0, scale=scaling,
        is_causal=mask is None and bool(is_causal) and sq > 1)
    if keep is not None:
        out = out * keep
    return out.transpose(1, 2).contiguous(), None


def _transformers_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' ``sdpa`` attention function, with rows without a key to attend giving zeros and zero gradients
    (:func:`_sdpa_mask`) as on our paths; a mask with more keys than ``key`` (static caches) is cut first."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    keep = None
    if attention_mask is not None and attention_mask.dim() == 4:
        attention_mask, keep = _sdpa_mask_for(attention_mask, attention_mask[..., :key.shape[2]], query.dtype)
    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                          dropout=dropout, **kwargs)
    if keep is not None:  # out [b, sq, h, d]; keep [b or 1, h or 1, sq, 1]
        out = out * keep.transpose(1, 2)
    return out, weights


def pipegoose_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                attention_mask: torch.Tensor | None, scaling: float | None = None,
                                dropout: float = 0.0, **kwargs):
    """Attention with the fused softmax, in transformers' attention-function signature.

    Args:
        module: the calling attention module (``is_causal`` and ``training`` are read from it).
        query: ``[b, hq, sq, d]``; key, value: ``[b, hkv, sk, d]`` with ``hq % hkv == 0`` (GQA keys and values are
            repeated). fp32, fp16 or bf16 (the softmax's dtype rules apply; off GPU the reference path runs).
        attention_mask: see :func:`plan_mask`.
        scaling: softmax scale applied to ``Q K^T`` (default ``d ** -0.5``); OPT passes 1.0 (it scales Q itself).
            In fp32 inside the softmax on CUDA; off CUDA in the scores' dtype before it, as transformers' eager
            functions do (see the module docstring).
        dropout: attention-probability dropout, applied as ``torch.nn.functional.dropout`` when ``module.training``,
            to the probabilities in ``value``'s dtype (the kernels' 16-bit output; under CPU autocast eager BERT,
            Llama and GPT-NeoX drop fp32 probabilities: outputs differ at bf16 rounding there, see the README).
        kwargs: ``is_causal`` (overrides ``module.is_causal``), ``head_mask`` ([h], one value per head, or
            broadcastable to the probabilities [b, h, sq, sk], multiplied in as in transformers' eager path before
            version 5, whose eager path ignores it); others are ignored, except ``softcap``, ``s_aux``, ``sinks``
            which raise.
    Returns:
        ``(attn_output [b, sq, hq, d] contiguous, attn_weights [b, hq, sq, sk])``, in the dtype of ``value``.

    SDPA: on CUDA (fp16/bf16/fp32) without ``head_mask``, when transformers is not collecting attention weights
    (``output_attentions=True``), the function runs ``torch.nn.functional.scaled_dot_product_attention`` instead of
    the softmax path (same masks and causality; fully masked rows give zeros as here, for bool and additive masks
    alike; ``attn_weights`` is then None, as with SDPA; counted as op ``"attention"``, impl ``"sdpa"`` in
    ``dispatch.stats()``) for scores of fewer than ``PIPEGOOSE_SMALL_NUMEL`` elements (default 2**24: a size bound
    by the host, where the separate softmax with its Python autograd costs more host time than it saves), and for
    larger ones unless the GPU's tuning table names ``pipegoose`` for op ``attention`` at the key length or
    ``PIPEGOOSE_IMPL_ATTENTION=pipegoose`` (SDPA fuses the softmax itself; see :func:`_sdpa_choice`).
    ``PIPEGOOSE_SMALL_NUMEL=0``: the softmax path at every size.
    Under ``torch.compile`` (``dispatch.compile_passthrough("attention")``: no ``PIPEGOOSE_IMPL_ATTENTION``, not
    strict) the same SDPA call runs at every size, so the compiled model has no graph break here.
    Raises:
        NotImplementedError: an unsupported kwarg is set (``softcap``, ``s_aux``, ``sinks``).
        ValueError: head counts that do not divide, a mask (``attention_mask``, ``head_mask``) of the wrong
            shape, or ``PIPEGOOSE_IMPL_ATTENTION`` other than ``auto`` / ``pipegoose``
            (:func:`pipegoose.nn.fusion.dispatch.check_attention_env`).
    """
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"pipegoose attention: '{name}' is not supported; keep attention='sdpa' "
                                      f"or 'eager' for {type(module).__name__}")
    hq, hkv = query.shape[1], key.shape[1]
    if hq % hkv != 0:
        raise ValueError(f"key: {hkv} key/value heads do not divide {hq} query heads")
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5

    sq, sk = query.shape[2], key.shape[2]
    if not torch.compiler.is_compiling():
        dispatch.check_attention_env()  # under torch.compile: compile_passthrough's check, at trace time
    if (dispatch.compile_passthrough("attention") and kwargs.get("head_mask") is None
            and not kwargs.get("output_attentions") and not _weights_requested()):
        return _small_sdpa(module, query, key, value, attention_mask, scaling, dropout, is_causal)  # torch.compile
    sdpa = _sdpa_choice(query, sq, sk) if kwargs.get("head_mask") is None else None
    if sdpa is not None and not kwargs.get("output_attentions") and not _weights_requested():
        dispatch.record(sdpa)
        return _small_sdpa(module, query, key, value, attention_mask, scaling, dropout, is_causal)
    key = _repeat_kv(key, hq // hkv)
    value = _repeat_kv(value, hq // hkv)
    plan = plan_mask(attention_mask, query_len=sq, key_len=sk, causal=bool(is_causal))

    scores = torch.matmul(query, key.transpose(-1, -2))
    scale = float(scaling)
    if not _common.on_kernel_device(scores):
        # no kernel can run (CPU): the scores are scaled in their own dtype first, as transformers' eager functions
        # do (matmul(q, k^T) * scaling), so that 16-bit results are the eager model's bit for bit; the softmax ops,
        # kernels and reference alike, apply the scale in fp32 (a review of session 61: a bf16 Llama of head dim
        # 128, whose scale is no power of 2, gave logits 0.006 off eager's on CPU)
        scores, scale = scores * scale, 1.0
    bias = _fit_mask(attention_mask, sq, sk) if plan.kind == "bias" else None
    probs = _softmax(scores, plan, scale, bias).to(value.dtype)
    if dropout:
        probs = F.dropout(probs, p=dropout, training=module.training)
    head_mask = kwargs.get("head_mask")
    if head_mask is not None:
        probs = probs * _head_mask_for(head_mask, probs)
    out = torch.matmul(probs, value).transpose(1, 2).contiguous()
    return out, probs


# --------------------------------------------------------------------------------------------------------------------
# Attention with a bias of the model's own (ALiBi: Bloom's and MPT's modules, replaced by ours)
# --------------------------------------------------------------------------------------------------------------------
def query_relative(keys: torch.Tensor, query_len: int) -> torch.Tensor:
    """An ALiBi-style bias made query-relative: ``keys`` ``[..., 1, sk]`` (each key's bias, one row) -> ``[...,
    query_len, sk]``, each query row less the bias of the key aligned with its query (key ``sk - query_len + i`` for
    query i: a cache's keys come first). The softmax of each row is unchanged, and the values near each query are
    near 0, where a 16-bit dtype is fine-grained (Bloom's and MPT's fused attention; computed in ``keys``' dtype)."""
    return keys - keys[..., keys.shape[-1] - query_len:].transpose(-1, -2)


def same_per_sequence(t: torch.Tensor) -> bool:
    """Whether ``t`` ([b, ...]) holds the same values for every index of its first dimension (one sync), so that a
    bias built from it may keep batch 1."""
    return t.shape[0] == 1 or t.stride(0) == 0 or torch.equal(t, t[:1].expand_as(t))


def _off_cuda_sdpa(device: torch.device, dtype: torch.dtype, key_len: int) -> bool:
    """Whether, off CUDA, :func:`bias_attention_forward` runs SDPA rather than the softmax's reference path: unless
    ``PIPEGOOSE_SMALL_NUMEL=0`` or ``PIPEGOOSE_IMPL_ATTENTION=pipegoose``."""
    return dispatch.small_numel() != 0 and not _ours_asked_for(device, dtype, key_len)


def bias_runs_sdpa(device: torch.device, dtype: torch.dtype, key_len: int) -> bool:
    """Whether :func:`bias_attention_forward` runs SDPA for scores of at least ``PIPEGOOSE_SMALL_NUMEL`` elements on
    ``device`` in ``dtype`` at this key length, attention weights not asked for (the report's column): on CUDA as
    :func:`runs_sdpa` says, off CUDA (and in dtypes no kernel of ours takes) unless the variables ask for the softmax
    path."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return _off_cuda_sdpa(device, dtype, key_len)
    return runs_sdpa(device, dtype, key_len)


_OFF_CUDA_SDPA = dispatch.Choice(
    "attention", "sdpa", "builtin", False, {},
    "off CUDA no kernel of ours runs: SDPA with the model's bias (ALiBi), faster there than the softmax's reference "
    "path (PIPEGOOSE_SMALL_NUMEL=0 or PIPEGOOSE_IMPL_ATTENTION=pipegoose: the softmax path)")


def bias_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           bias: torch.Tensor | None, *, scaling: float, dropout: float = 0.0,
                           output_attentions: bool = False):
    """The attention of a module that replaces a model's own ALiBi attention (``FusedBloomAttention``,
    ``FusedMptAttention``): ``softmax(scaling * Q K^T + bias) V`` by :func:`pipegoose_attention_forward` with
    ``bias`` as its float mask (not causal: the bias masks), and off CUDA, where no kernel of ours runs, SDPA with the
    bias (counted as op ``attention``, impl ``sdpa``, a builtin choice: strict mode lets it run; the softmax's
    reference path made a CPU forward of Bloom 2.3x slower than eager's) unless ``PIPEGOOSE_SMALL_NUMEL=0``,
    ``PIPEGOOSE_IMPL_ATTENTION=pipegoose`` or ``output_attentions`` ask for the softmax path.

    Args:
        module: the calling module (``training`` read: ``dropout`` applies in training only).
        query, key, value: ``[b, h, sq or sk, d]``, one dtype (fp32, fp16, bf16; any off CUDA).
        bias: ``[1 or b, h, sq, sk]`` float in the query's dtype (keys at or below half its minimum are masked), or
            None.
        scaling: the factor of ``Q K^T``; dropout: the probabilities' dropout in training.
        output_attentions: the weights asked for: the softmax path, which returns them.
    Returns:
        ``(output [b, sq, h, d] contiguous, weights [b, h, sq, sk] or None)``: None on the SDPA paths.
    Raises:
        What :func:`pipegoose_attention_forward` raises (a ``PIPEGOOSE_IMPL_ATTENTION`` value it refuses).
    """
    sk = key.shape[2]
    if not output_attentions and not _common.on_kernel_device(query) and _off_cuda_sdpa(query.device, query.dtype, sk):
        if not torch.compiler.is_compiling():
            dispatch.record(_OFF_CUDA_SDPA)   # (off CUDA: SDPA, not the softmax's reference path)
        return _small_sdpa(module, query, key, value, bias, scaling, dropout, False)
    return pipegoose_attention_forward(module, query, key, value, bias, scaling=scaling, dropout=dropout,
                                       is_causal=False, output_attentions=output_attentions)


def _head_mask_for(head_mask: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``head_mask`` as a factor of ``probs`` [b, h, sq, sk]: a 1-D mask is one value per head ([h] -> [1, h, 1, 1];
    multiplied as it stood, it scaled key columns instead, silently where h == sk); any other must broadcast to
    ``probs``. ValueError naming ``head_mask`` otherwise (e.g. a [layers, h] mask, which transformers 5 models pass
    through to the attention function unsliced and their eager path ignores)."""
    if not isinstance(head_mask, torch.Tensor):
        raise TypeError(f"head_mask: expected a torch.Tensor or None, got {type(head_mask).__name__}")
    h = probs.shape[1]
    if head_mask.dim() == 1:
        if head_mask.numel() != h:
            raise ValueError(f"head_mask: a 1-D mask needs one value per head ({h}), got {head_mask.numel()}")
        return head_mask.view(1, h, 1, 1)
    try:
        torch.broadcast_shapes(head_mask.shape, probs.shape)
    except RuntimeError:
        raise ValueError(f"head_mask: expected [{h}] (one value per head) or a tensor broadcastable to the attention "
                         f"probabilities {list(probs.shape)}, got {list(head_mask.shape)}") from None
    return head_mask


def pipegoose_sdpa_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                     **kwargs):
    """:func:`pipegoose_attention_forward` where the tuning table says ours is faster,
    ``PIPEGOOSE_IMPL_ATTENTION=pipegoose`` asks for it, or a ``head_mask`` is given (transformers' ``sdpa`` function
    ignores it), transformers' ``sdpa`` function otherwise (per call: device, dtype and key length). Same arguments
    and results; ``PIPEGOOSE_IMPL_ATTENTION`` is checked as there."""
    dispatch.check_attention_env()
    if kwargs.get("head_mask") is not None or _ours_asked_for(query.device, query.dtype, key.shape[2]):
        return pipegoose_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                           dropout=dropout, **kwargs)
    return _transformers_sdpa(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


# --------------------------------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------------------------------
def _pipegoose_mask(*args, **kwargs):
    """Mask function for our entries: SDPA's boolean masks (True = attend; None when nothing needs masking)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](*args, **kwargs)


_registered = False


def register() -> None:
    """Register ``"pipegoose"`` and ``"pipegoose_sdpa"`` with transformers (idempotent). Adds names only: nothing
    of transformers is replaced, and no model uses them until its config selects them."""
    global _registered
    if _registered:
        return
    try:
        from transformers import AttentionInterface
    except ImportError:  # transformers < 4.50: the table is a plain dict
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME] = pipegoose_attention_forward
        ALL_ATTENTION_FUNCTIONS[ATTENTION_SDPA_NAME] = pipegoose_sdpa_attention_forward
    else:
        AttentionInterface.register(ATTENTION_NAME, pipegoose_attention_forward)
        AttentionInterface.register(ATTENTION_SDPA_NAME, pipegoose_sdpa_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # transformers < 4.53: models build eager-style float masks for unknown names
        pass
    else:
        AttentionMaskInterface.register(ATTENTION_NAME, _pipegoose_mask)
        AttentionMaskInterface.register(ATTENTION_SDPA_NAME, _pipegoose_mask)
    _registered = True


class AttentionName(str):
    """The name of our attention function as ``fuse`` stores it on a model's config: a ``str`` (transformers looks
    it up as one) which, unpickled (``torch.load`` of a model saved with ``torch.save``, ``copy.deepcopy``), calls
    :func:`register` first, so that a fused model loaded in a new process runs without any import of pipegoose (the
    plain name raised transformers' KeyError there: "`pipegoose` is not a valid attention implementation")."""

    __slots__ = ()

    def __reduce__(self):
        return (_registered_name, (str(self),))


def _registered_name(name: str) -> AttentionName:
    register()
    return AttentionName(name)


__all__ = ["ATTENTION_NAME", "ATTENTION_SDPA_NAME", "AttentionName", "MaskPlan", "additive_to_boolean_mask", "plan_mask",
           "pipegoose_attention_forward", "pipegoose_sdpa_attention_forward", "register", "tuned_attention_impl",
           "table_prefers_pipegoose", "device_slug"]
