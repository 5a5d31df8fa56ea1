"""Bloom's attention (``BloomAttention``: ALiBi) on pipegoose's attention function: :class:`FusedBloomAttention`.

transformers' ``BloomAttention`` does not call the ``AttentionInterface`` (Bloom loads with eager attention only) and
takes its softmax inline, per layer::

    scores = alibi.baddbmm(Q, K^T, beta=beta, alpha=inv_norm_factor)    # [b * h, sq, sk], the model's dtype
    probs = softmax(scores + attention_mask, dim=-1, dtype=float32).to(dtype)
    context = dropout(probs) @ V

so each layer writes the scores, the masked scores, fp32 probabilities and their 16-bit copy, and saves the last two
for the backward ([b, h, sq, sk] each: 6 bytes per score saved in bf16).

:class:`FusedBloomAttention` takes the same parameters (the module's ``query_key_value``, ``dense`` and
``attention_dropout``, shared) and computes the same attention with ALiBi and the mask folded into one additive bias,
``beta * alibi + attention_mask`` (:func:`alibi_bias`: ``[1 or b, h, sq, sk]``, built once per forward pass and
shared by every layer; per layer under ``torch.inference_mode`` and ``torch.compile``, where tensors are not cached),
handed to :func:`pipegoose.nn.fusion.transformers.attention.pipegoose_attention_forward` as a
float mask: on CUDA ``torch.nn.functional.scaled_dot_product_attention`` with that bias (no scores materialised), or,
where the GPU's tuning table or ``PIPEGOOSE_IMPL_ATTENTION=pipegoose`` asks for it and when attention weights are
asked for (``output_attentions=True``), the fused masked softmax. Off CUDA, where no kernel of ours runs, SDPA too
(the softmax's reference path made a CPU forward 2.3x slower than eager Bloom's; PyTorch's own op, counted as op
``attention``, impl ``sdpa``: no fallback, so strict mode lets it run); the softmax path (its reference) with
``PIPEGOOSE_SMALL_NUMEL=0``, ``PIPEGOOSE_IMPL_ATTENTION=pipegoose`` or ``output_attentions=True``.

Where the result differs from transformers' eager Bloom:

* ALiBi in 16 bits: transformers builds Bloom's ``alibi`` in fp32 and casts it to the model's dtype, where its
  largest values (~1400 at 2048 positions, slope 2^-0.5) are 8 apart in bf16 (1 in fp16), so the keys nearest a
  query get biases up to 4 off, steps that erase the slope there; eager Bloom adds that to its scores. The fused
  module rebuilds the fp32 values (:func:`exact_alibi`: Bloom's slopes times the positions it counts, checked to
  round to the ``alibi`` given bit for bit, else that ``alibi`` is used as is) and uses the query-relative bias
  (each row's own key's value subtracted: the same softmax, values near 0 near the query), rounded once (session
  77: on 16 heads at 2048 positions the softmax of the bias alone went from 0.56 to 2.2e-4 off float64's). Its
  16-bit outputs are therefore nearer the exact attention than eager Bloom's, not equal to them;
* the scores are not rounded to the model's 16-bit dtype before the softmax on the SDPA path (SDPA keeps them in
  fp32): 16-bit outputs and gradients differ at rounding level, on average no farther from a float64 reference
  than eager's (GPU test at 2048 positions, 16 heads of 128, session 75). Over training steps the difference can
  grow where the weights themselves are bf16: on BLOOM-1B7's shape, 11 AdamW steps on one repeated batch (session
  75, H100, ``benchmarks/bloom_drift.py``; before the exact ALiBi of session 77), both bf16 runs' losses fell faster
  than fp32's, the fused one's most (largest gap to fp32's 0.79 and 0.86 over two seeds, eager's 0.57 and 0.72; the
  other fused ops alone, attention kept, and the fused masked softmax, whose scores are bf16 as eager's, 0.57 as
  eager). With fp32 weights under bf16 autocast (mixed precision) the fused and eager losses stayed as near fp32's
  as each other (largest gaps 0.14 and 0.15, each nearer at about half the steps). Pass ``attention="keep"`` to
  ``fuse`` for eager Bloom's pure-bf16 trajectory;
* a query row whose keys are all masked (a padded position under left padding) gives zeros and zero gradients, as on
  every path of pipegoose attention; eager Bloom gives it weights over its masked keys. Its output is the padding's;
  but with transformers' causal shift the last padded position predicts the first real token, so a loss whose label
  there is not -100 differs slightly from eager's (both values of that position are arbitrary: it sees no token);
* attention dropout (``config.attention_dropout``, 0 in released Bloom configs) is drawn by SDPA (same ``p``, other
  random numbers than eager's ``nn.Dropout``);
* the attention weights returned are ``None`` on the SDPA path (transformers' Bloom returns them always, and its
  model keeps them only under ``output_attentions=True``, where ours returns them too).

Source: this project (MIT); the formula is transformers' ``BloomAttention`` (models/bloom/modeling_bloom.py,
transformers 5.17 to 5.25, the versions it was checked with), which :func:`probe_bloom_attention` checks numerically
on each module before ``fuse`` replaces it.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import attention as _attention
from .matching import probe_isolated, qkv_layout_problem, run_attention_probe

# The attributes FusedBloomAttention reads from the module it replaces (Bloom's names), and the children it shares.
_ATTRIBUTES = ("num_heads", "head_dim", "hidden_size", "inv_norm_factor", "beta", "hidden_dropout")
_CHILDREN = ("query_key_value", "dense", "attention_dropout")
# The attributes fuse carries over from the replaced module as it does a module's other attributes (unfuse hands
# changes made while fused back): all but the sizes, which the fused module holds as its own.
CARRIED = ("inv_norm_factor", "beta", "hidden_dropout", "layer_idx")
# The arguments of BloomAttention.forward that FusedBloomAttention.forward takes, by name (BloomBlock passes them so).
_FORWARD_ARGS = ("hidden_states", "residual", "alibi", "attention_mask", "layer_past", "use_cache",
                 "output_attentions")


def candidate(module: nn.Module) -> bool:
    """A module whose class name ends in ``BloomAttention`` (transformers' and its copies), not a
    :class:`FusedBloomAttention`: ``fuse`` reports each, fused where :func:`probe_bloom_attention` finds Bloom's
    layout and formula, skipped with the probe's reason where not."""
    return not isinstance(module, FusedBloomAttention) and type(module).__name__.endswith("BloomAttention")


def _layout_problem(module: nn.Module) -> str | None:
    """Why ``module`` does not have Bloom's layout (None: it has): children ``query_key_value`` and ``dense``
    (``torch.nn.Linear``, hidden -> 3 x hidden and hidden -> any) and ``attention_dropout`` (``torch.nn.Dropout``),
    no parameter of its own, Bloom's attributes (``num_heads`` x ``head_dim`` = ``hidden_size``)."""
    return qkv_layout_problem(module, "Bloom", {"query_key_value": nn.Linear, "dense": nn.Linear,
                                                "attention_dropout": nn.Dropout}, _ATTRIBUTES + ("layer_idx",),
                              "num_heads")


@dataclass(frozen=True)
class BloomAttentionProbe:
    """Result of :func:`probe_bloom_attention`: ``ok``, or not with the ``reason``."""

    ok: bool
    reason: str


_PROBE_HEADS, _PROBE_HEAD_DIM, _PROBE_BATCH, _PROBE_SEQ = 2, 4, 2, 5


def _reference(stand_in: nn.Module, hidden: torch.Tensor, residual: torch.Tensor, alibi: torch.Tensor,
               mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bloom's attention formula in float64 (output, probabilities) for the probe's stand-in."""
    b, s, _ = hidden.shape
    h, d = _PROBE_HEADS, _PROBE_HEAD_DIM
    w, bias = stand_in.query_key_value.weight.double(), stand_in.query_key_value.bias.double()
    qkv = F.linear(hidden.double(), w, bias).view(b, s, h, 3, d)
    q, k, v = (qkv[..., i, :].transpose(1, 2) for i in range(3))
    scores = (stand_in.inv_norm_factor * q @ k.transpose(-1, -2) + stand_in.beta * alibi.double().view(b, h, 1, s)
              + mask.double())
    probs = torch.softmax(scores, dim=-1)
    context = (probs @ v).transpose(1, 2).reshape(b, s, h * d)
    out = F.linear(context, stand_in.dense.weight.double(), stand_in.dense.bias.double()) + residual.double()
    return out, probs


def _probe_inputs(g: torch.Generator):
    """(hidden, residual, alibi, additive mask) of the probe, fp32: a general per-head bias (not Bloom's slopes: any
    bias must pass through), a causal mask with the last key of the second sequence padded (no query row without a
    key: those differ by design, see the module docstring)."""
    b, s, h = _PROBE_BATCH, _PROBE_SEQ, _PROBE_HEADS
    hidden = torch.randn(b, s, h * _PROBE_HEAD_DIM, generator=g)
    residual = torch.randn(b, s, h * _PROBE_HEAD_DIM, generator=g)
    alibi = 2 * torch.randn(b * h, 1, s, generator=g)
    masked = torch.ones(s, s, dtype=torch.bool).triu(1).expand(b, 1, s, s).clone()
    masked[1, :, :, -1] = True
    masked[1, :, -1, 0] = False   # (the last query of the second sequence keeps its first key: no row all masked)
    mask = torch.zeros(b, 1, s, s).masked_fill(masked, torch.finfo(torch.float32).min)
    return hidden, residual, alibi, mask


def _stand_in(module: nn.Module, g: torch.Generator) -> nn.Module:
    """A small CPU copy of ``module`` that runs its class's code: its attributes (``inv_norm_factor``, ``beta``
    kept), 2 heads of 4, random ``torch.nn.Linear`` projections, no dropout; the module itself is not touched."""
    stand_in = copy.copy(module)
    stand_in.__dict__ = dict(module.__dict__)
    for slot in ("_parameters", "_buffers", "_modules"):
        stand_in.__dict__[slot] = dict(module.__dict__[slot])
    width = _PROBE_HEADS * _PROBE_HEAD_DIM
    stand_in.__dict__.update(num_heads=_PROBE_HEADS, head_dim=_PROBE_HEAD_DIM, hidden_size=width, split_size=width,
                             hidden_dropout=0.0, pretraining_tp=1)
    qkv, dense = nn.Linear(width, 3 * width), nn.Linear(width, width)
    with torch.no_grad():
        for p in (*qkv.parameters(), *dense.parameters()):
            p.copy_(torch.randn(p.shape, generator=g) / 2)
    stand_in._modules.update(query_key_value=qkv, dense=dense, attention_dropout=nn.Dropout(0.0))
    return stand_in


@probe_isolated
def probe_bloom_attention(module: nn.Module) -> BloomAttentionProbe:
    """Whether ``module`` (a :func:`candidate`) computes Bloom's ALiBi attention, the formula of
    :class:`FusedBloomAttention`: its class's forward, run on a small stand-in (:func:`_stand_in`) on the CPU in fp32
    with a general per-head bias for ``alibi`` and a causal mask with padding, in training and eval mode with
    ``output_attentions=True`` and in training mode without, must return ``(output, attention probabilities)`` (the
    output alone is compared where they are not asked for) equal to the float64 formula
    (``softmax(inv_norm_factor * Q K^T + beta * alibi + mask) V``, then ``dense``, plus the residual) within 1e-4.
    Refused before that: a class whose forward takes other arguments than Bloom's, a module with ``pretraining_tp >
    1`` and ``slow_but_exact`` (its dense projection runs in slices), a module without Bloom's layout
    (:func:`_layout_problem`: a wrapped projection, say).
    Never raises."""
    name = type(module).__name__
    if not candidate(module):
        return BloomAttentionProbe(False, f"{name} is not a BloomAttention (by its class name)")
    problem = _layout_problem(module)
    if problem is not None:
        return BloomAttentionProbe(False, problem)
    if getattr(module, "pretraining_tp", 1) > 1 and getattr(module, "slow_but_exact", False):
        return BloomAttentionProbe(False, "pretraining_tp > 1 with slow_but_exact: its dense projection runs in "
                                          "slices, which FusedBloomAttention does not")
    try:
        params = list(inspect.signature(type(module).forward).parameters)[1:]
    except (TypeError, ValueError):
        params = []
    if params[:len(_FORWARD_ARGS)] != list(_FORWARD_ARGS):
        return BloomAttentionProbe(False, f"its forward's arguments ({', '.join(params)}) are not Bloom's "
                                          f"({', '.join(_FORWARD_ARGS)})")
    if not (isinstance(module.hidden_dropout, (int, float)) and 0 <= module.hidden_dropout <= 1):
        return BloomAttentionProbe(False, f"hidden_dropout {module.hidden_dropout!r}: a probability expected")
    def setup():
        g = torch.Generator().manual_seed(0)
        stand_in = _stand_in(module, g)
        hidden, residual, alibi, mask = _probe_inputs(g)
        want_out, want_probs = _reference(stand_in, hidden, residual, alibi, mask)

        def call(mode, weights):
            stand_in.training = mode
            got = type(module).forward(stand_in, hidden, residual, alibi, mask, layer_past=None, use_cache=False,
                                       output_attentions=weights)
            if not weights:   # (Bloom returns them whatever output_attentions says; the output is what counts)
                got = (got[0], want_probs) if isinstance(got, tuple) and len(got) == 2 else got
            return got

        return want_out, want_probs, [functools.partial(call, *c) for c in ((True, True), (False, True), (True, False))]

    problem = run_attention_probe(setup, "Bloom", "softmax(inv_norm_factor * Q K^T + beta * alibi + mask) V, dense, "
                                                  "plus the residual")
    if problem is not None:
        return BloomAttentionProbe(False, problem)
    return BloomAttentionProbe(True, "Bloom's ALiBi attention (probed)")


# --------------------------------------------------------------------------------------------------------------------
# The bias
# --------------------------------------------------------------------------------------------------------------------
_bias_cache: dict = {}   # one entry: every layer of a forward pass gets the same alibi and mask tensors


def alibi_bias(alibi: torch.Tensor, attention_mask: torch.Tensor | None, *, batch: int, heads: int,
               query_len: int, key_len: int, beta: float = 1.0) -> torch.Tensor:
    """``beta * alibi + attention_mask`` as one additive attention bias.

    Args:
        alibi: ``[batch * heads, 1, key_len]`` (Bloom's ``build_alibi_tensor``: per head, a slope times each key's
            position), floating point.
        attention_mask: an additive float mask (0, or the dtype's minimum for masked keys) or a bool one (True =
            attend), ``[batch or 1, 1 or heads, query_len or 1, >= key_len]`` (extra trailing keys are cut off), or
            None.
        batch, heads, query_len, key_len: the attention's sizes.
        beta: the factor of ``alibi`` (Bloom's ``beta``, 1.0).
    Returns:
        ``[batch or 1, heads, query_len or 1, key_len]`` in the dtype ``alibi + attention_mask`` promotes to (a bool
        mask: ``alibi``'s, masked keys at its minimum). A 16-bit ``alibi`` that :func:`exact_alibi` rebuilds gives
        instead the query-relative bias of the rebuilt fp32 values (``beta * (alibi[j] - alibi[sk - query_len + i])
        + mask`` for query i and key j, computed in fp32, clamped from below to the dtype's minimum and rounded
        once; the same softmax per row), ``[batch or 1, heads, query_len, key_len]`` in ``alibi``'s dtype; not where
        the bias is not cached (``torch.inference_mode``, ``torch.compile``), nor without values to read (meta, fake
        tensors). The batch dimension is 1 where
        the bias is the same for every sequence (Bloom without padding: its alibi and causal mask repeat per
        sequence), found with one comparison on the device (not on the meta device or for fake tensors). Built once
        per pair of tensors (identity and version counters; the entry goes when either tensor is freed; not cached where
        :func:`pipegoose.nn.fusion.transformers.attention._cacheable` says so, under ``torch.inference_mode`` and
        ``torch.compile``, where the batch dimension stays).
    Raises:
        ValueError: ``alibi`` or ``attention_mask`` of a shape that does not fit the sizes.
        TypeError: ``alibi`` not floating point; ``attention_mask`` neither bool nor floating point.
    """
    if not alibi.is_floating_point():
        raise TypeError(f"alibi: expected a floating-point tensor, got dtype {alibi.dtype}")
    if alibi.dim() != 3 or alibi.shape[0] != batch * heads or alibi.shape[1] != 1 or alibi.shape[2] != key_len:
        raise ValueError(f"alibi: expected shape [{batch * heads} (batch * heads), 1, {key_len} (keys)], got "
                         f"{tuple(alibi.shape)}")
    mask = None
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool and not attention_mask.is_floating_point():
            raise TypeError(f"attention_mask: expected a bool or floating-point mask, got dtype {attention_mask.dtype}")
        mask = _attention._fit_mask(attention_mask, query_len, key_len, batch, heads)
    cacheable = _attention._cacheable(alibi) and (attention_mask is None or _attention._cacheable(attention_mask))
    if not cacheable:   # (nor rebuilt exactly: the check's sync would run in every layer)
        return _combine(alibi, mask, batch, heads, beta, query_len, dedupe=False, exact_ok=False)
    key = (id(alibi), alibi._version, None if attention_mask is None else id(attention_mask),
           None if attention_mask is None else attention_mask._version, batch, heads, query_len, key_len, beta)
    hit = _bias_cache.get("entry")
    if (hit is not None and hit[0] == key and hit[1]() is alibi
            and (attention_mask is None or hit[2]() is attention_mask)):
        return hit[3]
    bias = _combine(alibi, mask, batch, heads, beta, query_len, dedupe=not _attention._no_values(alibi))
    entry = (key, weakref.ref(alibi), None if attention_mask is None else weakref.ref(attention_mask), bias)
    _attention.put_entry(_bias_cache, entry, alibi, *(() if attention_mask is None else (attention_mask,)))
    return bias


def _combine(alibi, mask, batch, heads, beta, query_len, dedupe, exact_ok=True):
    """:func:`alibi_bias`'s sum of ``beta * alibi`` and the fitted ``mask`` (uncached); ``dedupe``: batch 1 where
    every sequence has the same bias. With ``exact_ok``, a 16-bit ``alibi`` that :func:`exact_alibi` rebuilds gives
    the query-relative bias of the rebuilt fp32 values, rounded once to ``alibi``'s dtype (``[b or 1, h, query_len,
    sk]``; computed a head at a time, so that the fp32 temporaries are one head's)."""
    a = alibi.view(batch, heads, 1, alibi.shape[-1])
    exact = None
    if (exact_ok and alibi.dtype in (torch.float16, torch.bfloat16) and not _attention._no_values(alibi)
            and not torch.compiler.is_compiling()):
        exact = exact_alibi(a, mask)
    if exact is not None:
        a = exact
    if beta != 1.0:
        a = a * beta
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros((), dtype=alibi.dtype, device=mask.device).masked_fill(~mask, torch.finfo(alibi.dtype).min)
    same = _attention.same_per_sequence
    if dedupe and batch > 1 and same(a) and (mask is None or same(mask)):
        a = a[:1]
        mask = None if mask is None else mask[:1]
    if exact is None:
        return a if mask is None else a + mask
    b, sk = a.shape[0], a.shape[-1]
    if mask is not None:
        b = max(b, mask.shape[0])
    out = torch.empty(b, heads, query_len, sk, dtype=alibi.dtype, device=alibi.device)
    low = torch.finfo(alibi.dtype).min
    for i in range(heads):
        rel = _attention.query_relative(a[:, i:i + 1], query_len)   # (fp32)
        if mask is not None:
            rel = rel + (mask if mask.shape[1] == 1 else mask[:, i:i + 1])
        out[:, i:i + 1] = rel.clamp_min_(low)   # (masked keys at the dtype's minimum, not past it: no -inf)
    return out


def alibi_slopes(heads: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """ALiBi's slopes for ``heads`` heads (Press et al., 2022), fp32 ``[heads]``, computed as Bloom computes them
    (transformers' ``_get_alibi_slopes``: powers of ``2 ** (-8 / n)`` for the largest power of two ``n <= heads``,
    then the odd powers of ``2 ** (-4 / n)`` for the rest), with the same fp32 operations on ``device``.

    Raises: ValueError for ``heads`` below 1."""
    if heads < 1:
        raise ValueError(f"heads: expected at least 1, got {heads}")
    n = 2 ** math.floor(math.log2(heads))
    base = torch.full((), 2 ** (-(2 ** -(math.log2(n) - 3))), device=device, dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + n, device=device, dtype=torch.int32))
    if n != heads:
        extra = torch.full((), 2 ** (-(2 ** -(math.log2(2 * n) - 3))), device=device, dtype=torch.float32)
        odd = torch.arange(1, 1 + 2 * min(n, heads - n), 2, device=device, dtype=torch.int32)
        slopes = torch.cat([slopes, torch.pow(extra, odd)])
    return slopes


def exact_alibi(alibi: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
    """The fp32 values that Bloom's ALiBi ``alibi`` (``[b, h, 1, sk]``, 16-bit: transformers builds it in fp32, then
    casts it to the model's dtype) was rounded from: :func:`alibi_slopes` times each key's position, the positions
    counted over the keys that the last query attends to in the fitted ``mask`` (``[b or 1, 1 or h, sq or 1, sk]``,
    bool True = attend or additive 0 = attend; the causal mask's last row is the padding mask, whose running count is
    Bloom's position) or ``0 .. sk - 1`` without a mask. Returns ``[b, h, 1, sk]`` fp32 where those values rounded to
    ``alibi``'s dtype are ``alibi`` bit for bit (one comparison on the device), else None (another formula, another
    mask: the caller keeps ``alibi``).

    Why: at 2048 positions ALiBi's largest values reach ~1400 (slope 2^-0.5), where bf16's values are 8 apart and
    fp16's 1; rounded so, the keys nearest a query get biases up to 4 (bf16) off, steps that erase the slope there.
    The query-relative bias of the exact values (:func:`_combine`) is near 0 near each query, where bf16 is fine."""
    b, h, _, sk = alibi.shape
    if mask is None:
        pos = torch.arange(sk, device=alibi.device)[None, :]
    else:
        last = mask[:, 0, -1, :]
        keep = (last if last.dtype == torch.bool else last == 0).long()
        pos = (keep.cumsum(-1) - 1) * keep
    exact = alibi_slopes(h, alibi.device)[None, :, None] * pos[:, None, :]   # (fp32 * int64: fp32, as Bloom's)
    exact = exact.expand(b, h, sk)
    if not torch.equal(exact.to(alibi.dtype), alibi.view(b, h, sk)):
        return None
    return exact.reshape(b, h, 1, sk)


# --------------------------------------------------------------------------------------------------------------------
# The module
# --------------------------------------------------------------------------------------------------------------------
class FusedBloomAttention(nn.Module):
    """Bloom's attention (``BloomAttention``, ALiBi) on pipegoose's attention function (see the module docstring).

    Holds the replaced module's ``query_key_value`` (``nn.Linear(hidden, 3 * hidden)``, Bloom's interleaved
    ``[heads, 3, head_dim]`` layout), ``dense`` and ``attention_dropout`` (the same modules: ``state_dict`` keys and
    parameters unchanged) and its ``num_heads``, ``head_dim``, ``hidden_size``, ``inv_norm_factor``, ``beta``,
    ``hidden_dropout`` and ``layer_idx``.

    ``forward(hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
    output_attentions=False)``, as ``BloomAttention``'s (``BloomBlock`` calls it so):

    * hidden_states, residual: ``[b, sq, hidden]``, fp32, fp16 or bf16 (CUDA autocast as in the model);
    * alibi: ``[b * heads, 1, sk]``; attention_mask: ``[b, 1, sq, sk]`` additive (transformers' eager mask), bool
      (True = attend) or None (see :func:`alibi_bias`);
    * layer_past: a transformers ``Cache`` (``update(key, value, layer_idx)``), or None;
    * returns ``(output [b, sq, hidden], attention weights [b, heads, sq, sk] or None)``: ``dense(attention)``
      with ``hidden_dropout`` (in training) plus ``residual``; the weights where the softmax path ran (always under
      ``output_attentions=True``), None on the SDPA path.

    Raises: the constructor, ``TypeError`` for projections that are not ``torch.nn.Linear`` or a dropout that is not
    ``torch.nn.Dropout``, ``ValueError`` naming the argument for sizes that do not fit or a ``hidden_dropout``
    outside [0, 1]; ``forward``, ``ValueError`` / ``TypeError`` for an ``alibi`` or ``attention_mask`` that does not
    fit (:func:`alibi_bias`), what ``pipegoose_attention_forward`` raises (``PIPEGOOSE_IMPL_ATTENTION`` values).
    """

    def __init__(self, *, query_key_value: nn.Linear, dense: nn.Linear, attention_dropout: nn.Dropout,
                 num_heads: int, head_dim: int, hidden_size: int, inv_norm_factor: float, beta: float = 1.0,
                 hidden_dropout: float = 0.0, layer_idx: int | None = None):
        super().__init__()
        for name, value, kind in (("query_key_value", query_key_value, nn.Linear), ("dense", dense, nn.Linear),
                                  ("attention_dropout", attention_dropout, nn.Dropout)):
            if not isinstance(value, kind):
                raise TypeError(f"{name}: expected a torch.nn.{kind.__name__}, got {type(value).__name__}")
        if num_heads * head_dim != hidden_size:
            raise ValueError(f"num_heads: {num_heads} heads of head_dim {head_dim} do not make hidden_size "
                             f"{hidden_size}")
        if query_key_value.in_features != hidden_size or query_key_value.out_features != 3 * hidden_size:
            raise ValueError(f"query_key_value: expected {hidden_size} -> {3 * hidden_size} features, got "
                             f"{query_key_value.in_features} -> {query_key_value.out_features}")
        if dense.in_features != hidden_size:
            raise ValueError(f"dense: expected {hidden_size} input features, got {dense.in_features}")
        if not (isinstance(hidden_dropout, (int, float)) and 0 <= hidden_dropout <= 1):
            raise ValueError(f"hidden_dropout: expected a probability in [0, 1], got {hidden_dropout!r}")
        self.query_key_value = query_key_value
        self.dense = dense
        self.attention_dropout = attention_dropout
        self.num_heads, self.head_dim, self.hidden_size = num_heads, head_dim, hidden_size
        self.inv_norm_factor, self.beta, self.hidden_dropout = inv_norm_factor, beta, hidden_dropout
        self.layer_idx = layer_idx

    @classmethod
    def from_module(cls, attention: nn.Module, verify: bool = True) -> FusedBloomAttention:
        """A :class:`FusedBloomAttention` sharing ``attention``'s (a ``BloomAttention``) children and attributes.

        Raises:
            TypeError: ``attention`` is not a ``BloomAttention`` (:func:`candidate`: by its class name).
            ValueError: ``verify`` and :func:`probe_bloom_attention` refuses the module (the reason).
        """
        if not candidate(attention):
            raise TypeError(f"attention: expected a BloomAttention, got {type(attention).__name__}")
        if verify:
            probe = probe_bloom_attention(attention)
            if not probe.ok:
                raise ValueError(f"attention: {type(attention).__name__}: {probe.reason}")
        return cls(**{k: getattr(attention, k) for k in _CHILDREN + _ATTRIBUTES + ("layer_idx",)})

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, beta={self.beta}"

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor, alibi: torch.Tensor,
                attention_mask: torch.Tensor | None, layer_past=None, use_cache: bool = False,
                output_attentions: bool = False, **kwargs):
        b, sq, _ = hidden_states.shape
        h, d = self.num_heads, self.head_dim
        qkv = self.query_key_value(hidden_states).view(b, sq, h, 3, d)
        query, key, value = (qkv[..., i, :].transpose(1, 2) for i in range(3))   # [b, h, s, d] views, as Bloom's
        if layer_past is not None:
            key, value = layer_past.update(key, value, self.layer_idx)
        sk = key.shape[2]
        bias = alibi_bias(alibi, attention_mask, batch=b, heads=h, query_len=sq, key_len=sk, beta=self.beta)
        out, weights = _attention.bias_attention_forward(
            self, query, key, value, bias, scaling=self.inv_norm_factor, dropout=self.attention_dropout.p,
            output_attentions=output_attentions)
        output = self.dense(out.reshape(b, sq, h * d))
        return F.dropout(output, p=self.hidden_dropout, training=self.training) + residual, weights


__all__ = ["FusedBloomAttention", "BloomAttentionProbe", "alibi_bias", "alibi_slopes", "candidate", "exact_alibi",
           "probe_bloom_attention"]
