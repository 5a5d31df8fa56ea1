"""MPT's attention (``MptAttention``: ALiBi) on pipegoose's attention function: :class:`FusedMptAttention`.

transformers' ``MptAttention`` does not call the ``AttentionInterface`` (MPT loads with eager attention only) and
takes its softmax inline, per layer::

    qkv = Wqkv(x), clamped to [-clip_qkv, clip_qkv] where clip_qkv is set;  Q, K, V = qkv.chunk(3, dim=-1)
    scores = (Q K^T) * softmax_scale                          # [b, h, sq, sk], the model's dtype
    scores = scores + position_bias[:, :, -sk:]               # position_bias fp32: the sum is fp32
    probs = softmax(scores.masked_fill(attention_mask, finfo(dtype).min), dim=-1, dtype=float32).to(dtype)
    output = out_proj(dropout(probs, attn_dropout_p) @ V)

``position_bias`` is MPT's ALiBi tensor, ``[heads, 1, max_seq_len]`` in fp32, built once per forward pass by
``MptModel`` (``build_mpt_alibi_tensor``: per head a slope times each key's position counted from the last one,
``slope * (j - (max_seq_len - 1))``, the same for every query: eager relies on the softmax's invariance to a shift
of a row); ``attention_mask`` is a bool mask, True = masked (``MptModel`` converts transformers' causal mask with
``.to(torch.bool)``). Each layer writes the scores, their fp32 sum with the bias, its masked copy, fp32
probabilities and their 16-bit copy ([b, h, sq, sk] each), and saves the last two for the backward.

:class:`FusedMptAttention` takes the same parameters (the module's ``Wqkv`` and ``out_proj``, shared) and computes
the same attention with ALiBi and the mask folded into one additive bias (:func:`mpt_bias`: ``[1 or b, h, sq, sk]``
in the query's dtype, built once per forward pass and shared by every layer; per layer under
``torch.inference_mode`` and ``torch.compile``, where tensors are not cached), handed to
:func:`pipegoose.nn.fusion.transformers.attention.bias_attention_forward` as a float mask, as Bloom's
(:class:`~pipegoose.nn.fusion.transformers.bloom.FusedBloomAttention`): on CUDA
``torch.nn.functional.scaled_dot_product_attention`` with that bias (no scores materialised), or, where the GPU's
tuning table or ``PIPEGOOSE_IMPL_ATTENTION=pipegoose`` asks for it and when attention weights are asked for, the
fused masked softmax. Off CUDA, where no kernel of ours runs, SDPA too (PyTorch's own op, counted as op
``attention``, impl ``sdpa``); the softmax path (its reference) with ``PIPEGOOSE_SMALL_NUMEL=0``,
``PIPEGOOSE_IMPL_ATTENTION=pipegoose`` or when attention weights are asked for.

The bias is query-relative: before it is cast to the query's 16-bit dtype (SDPA's float mask must be in the query's
dtype), each query row's bias has the bias of the key aligned with that query subtracted (key ``sk - sq + i`` for
query ``i``), in fp32. The softmax of a row does not change, and the values that matter, those of the keys near the
query, are near 0, where bf16 and fp16 are fine-grained: MPT's own values reach ``-slope * (max_seq_len - 1)``
(at 2048 positions -1447 for the steepest head of 16, slope 2^-0.5; -1023 of 8 heads), where bf16's values are 4 to
8 apart. On the CPU, 4 of 16 heads' bias alone at 2048 positions, causal: the softmax of the raw values cast to bf16
was up to 0.49 off float64's, of the query-relative bias 2.3e-4 (fp16: 5e-5).

The attention weights: ``MptBlock`` does not pass ``output_attentions`` to its attention (transformers' module
returns its weights always, and the model keeps them only under ``output_attentions=True``). ``fuse`` therefore puts
a forward pre-hook and an always-called forward hook on the module that holds each fused attention where its forward
takes ``output_attentions`` (the ``MptBlock``: :func:`watch_output_attentions`), which pass each call's request to
the fused attention for that call, per thread, so that ``model(..., output_attentions=True)`` returns the weights as
the unfused model does; ``unfuse`` removes them. Such a request does not change how the output is computed: the
weights are computed besides it, by the softmax path without gradient (detached; in training with attention dropout,
with draws of their own). Gradient checkpointing replays the block's forward in the backward without its hooks,
and the replay must compute what the forward computed (saved tensors that differ raise torch's CheckpointError:
session 75's review found two forwards of different requests before one backward failing so), which it does since
the output's path does not depend on the request. A :class:`FusedMptAttention` called directly with
``output_attentions=True`` takes the softmax path itself and returns the weights with their gradient.

Where the result differs from transformers' eager MPT:

* a query row whose keys are all masked (a padded position under left padding) gives zeros and zero gradients, as on
  every path of pipegoose attention; eager MPT gives it uniform weights over every key (``masked_fill`` sets each of
  its scores to the dtype's minimum). Its output is the padding's;
* on the SDPA path the scores are not rounded to the model's 16-bit dtype before the bias is added (SDPA keeps them
  in fp32; eager rounds ``Q K^T * softmax_scale`` to the dtype, then adds the fp32 bias), and the bias is rounded to
  the dtype (query-relative: MPT's slopes are powers of 2, or their square roots, and its values near the query
  exact or nearly so); on the softmax path the sum of scores and bias is rounded to the dtype (eager keeps it in
  fp32), at the scale of the scores near the query, where eager rounds its scores too. 16-bit outputs differ at
  rounding level (on the CPU with CUDA pretended, bf16 and fp16 at 301 and 2048 positions: 0.93-1.06x eager's mean
  distance from float64, outputs and gradients, either path);
* attention dropout (``attn_config.attn_pdrop``, 0 in released MPT configs) is drawn by SDPA on the SDPA path (same
  ``p``, other random numbers than eager's ``F.dropout``);
* the attention weights returned are ``None`` on the SDPA path, unless asked for (``output_attentions=True`` to the
  model through ``fuse``'s hook, or to the module itself).

Source: this project (MIT); the formula is transformers' ``MptAttention`` (models/mpt/modeling_mpt.py, transformers
5.17, whose cache argument is named ``past_key_values``, on the GPU machine, session 75, and 5.25 on the CPU, the
versions it was checked with), which :func:`probe_mpt_attention` checks numerically on each module before ``fuse``
replaces it.
"""

from __future__ import annotations

import functools
import inspect
import math
import threading
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import attention as _attention
from .matching import _stand_in as _shallow_stand_in
from .matching import probe_isolated, qkv_layout_problem, run_attention_probe

# The attributes FusedMptAttention reads from the module it replaces (MPT's names), and the children it shares.
_ATTRIBUTES = ("hidden_size", "n_heads", "head_dim", "softmax_scale", "attn_dropout_p", "clip_qkv", "max_seq_length")
_CHILDREN = ("Wqkv", "out_proj")
# The attributes fuse carries over from the replaced module as it does a module's other attributes (unfuse hands
# changes made while fused back): all but the sizes, which the fused module holds as its own.
CARRIED = ("softmax_scale", "attn_dropout_p", "clip_qkv", "layer_idx", "max_seq_length")
# The names MptAttention.forward has given its cache argument (transformers 5.25: cache; 5.17: past_key_values;
# earlier past_key_value), and MptBlock's own (layer_past).
_CACHE_ARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def candidate(module: nn.Module) -> bool:
    """A module whose class name ends in ``MptAttention`` (transformers' and its copies), not a
    :class:`FusedMptAttention`: ``fuse`` reports each, fused where :func:`probe_mpt_attention` finds MPT's layout and
    formula, skipped with the probe's reason where not."""
    return not isinstance(module, FusedMptAttention) and type(module).__name__.endswith("MptAttention")


def _number_problem(name: str, value, low: float | None = None, high: float | None = None) -> str | None:
    """Why ``value`` (attribute ``name``) is not a finite number in [low, high] (None: it is), naming it."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or (low is not None and value < low) or (high is not None and value > high)):
        where = "" if low is None else f" in [{low}, {'inf' if high is None else high}]"
        return f"{name}: expected a finite number{where}, got {value!r}"
    return None


def _attribute_problem(clip_qkv, softmax_scale, attn_dropout_p) -> str | None:
    """Why MPT's ``clip_qkv`` (None, or a bound >= 0: 0 clamps nothing, as eager's ``if self.clip_qkv``),
    ``softmax_scale`` (a finite number) or ``attn_dropout_p`` (a probability) does not fit (None: they do)."""
    return ((None if clip_qkv is None else _number_problem("clip_qkv", clip_qkv, 0))
            or _number_problem("softmax_scale", softmax_scale)
            or _number_problem("attn_dropout_p", attn_dropout_p, 0, 1))


def _layout_problem(module: nn.Module) -> str | None:
    """Why ``module`` does not have MPT's layout (None: it has): children ``Wqkv`` (``torch.nn.Linear``, hidden -> 3 x
    hidden) and ``out_proj`` (``torch.nn.Linear``, hidden -> any) and no other, no parameter of its own, MPT's
    attributes (``n_heads`` x ``head_dim`` = ``hidden_size``; ``clip_qkv``, ``softmax_scale`` and ``attn_dropout_p``
    of their kinds)."""
    problem = qkv_layout_problem(module, "MPT", dict.fromkeys(_CHILDREN, nn.Linear), _ATTRIBUTES + ("layer_idx",),
                                 "n_heads")
    if problem is not None:
        return problem
    others = [k for k, v in module._modules.items() if k not in _CHILDREN and v is not None]
    if others:
        return f"it holds other submodules ({', '.join(others)}) than Wqkv and out_proj: not MPT's layout"
    return _attribute_problem(module.clip_qkv, module.softmax_scale, module.attn_dropout_p)


@dataclass(frozen=True)
class MptAttentionProbe:
    """Result of :func:`probe_mpt_attention`: ``ok``, or not with the ``reason``."""

    ok: bool
    reason: str


_PROBE_HEADS, _PROBE_HEAD_DIM, _PROBE_BATCH, _PROBE_SEQ, _PROBE_POSITIONS = 2, 4, 2, 5, 7
_PROBE_CLIP = 0.5   # (the probe's clip_qkv where the module has one: low enough that the probe's values are clamped)


def _reference(stand_in: nn.Module, hidden: torch.Tensor, position_bias: torch.Tensor,
               masked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MPT's attention formula in float64 (output, probabilities) for the probe's stand-in."""
    b, s, _ = hidden.shape
    h, d = _PROBE_HEADS, _PROBE_HEAD_DIM
    qkv = F.linear(hidden.double(), stand_in.Wqkv.weight.double(),
                   None if stand_in.Wqkv.bias is None else stand_in.Wqkv.bias.double())
    if stand_in.clip_qkv:
        qkv = qkv.clamp(-stand_in.clip_qkv, stand_in.clip_qkv)
    q, k, v = (t.unflatten(-1, (h, d)).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    scores = stand_in.softmax_scale * q @ k.transpose(-1, -2) + position_bias.double()[:, :, -s:]
    probs = torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1)
    context = (probs @ v).transpose(1, 2).reshape(b, s, h * d)
    out = stand_in.out_proj
    return F.linear(context, out.weight.double(), None if out.bias is None else out.bias.double()), probs


def _probe_inputs(g: torch.Generator):
    """(hidden, position_bias, masked) of the probe, fp32: a general per-head, per-key bias of more positions than
    keys (not MPT's slopes: any bias must pass through, its last keys taken), a causal bool mask (True = masked) with
    the last key of the second sequence padded (no query row without a key: those differ by design, see the module
    docstring)."""
    b, s, h = _PROBE_BATCH, _PROBE_SEQ, _PROBE_HEADS
    hidden = torch.randn(b, s, h * _PROBE_HEAD_DIM, generator=g)
    position_bias = 2 * torch.randn(h, 1, _PROBE_POSITIONS, generator=g)
    masked = torch.ones(s, s, dtype=torch.bool).triu(1).expand(b, 1, s, s).clone()
    masked[1, :, :, -1] = True
    masked[1, :, -1, 0] = False
    return hidden, position_bias, masked


def _stand_in(module: nn.Module, g: torch.Generator) -> nn.Module:
    """A small CPU stand-in of ``module`` that runs its class's code (``matching._stand_in``: its attributes,
    ``softmax_scale`` kept, ``clip_qkv`` :data:`_PROBE_CLIP` where it has one), 2 heads of 4, random
    ``torch.nn.Linear`` projections (with a bias where the module's have one), no dropout; the module itself is not
    touched."""
    stand_in = _shallow_stand_in(module)
    width = _PROBE_HEADS * _PROBE_HEAD_DIM
    stand_in.__dict__.update(n_heads=_PROBE_HEADS, head_dim=_PROBE_HEAD_DIM, hidden_size=width, attn_dropout_p=0.0,
                             clip_qkv=_PROBE_CLIP if module.clip_qkv else None)
    qkv = nn.Linear(width, 3 * width, bias=module.Wqkv.bias is not None)
    out = nn.Linear(width, width, bias=module.out_proj.bias is not None)
    with torch.no_grad():
        for p in (*qkv.parameters(), *out.parameters()):
            p.copy_(torch.randn(p.shape, generator=g) / 2)
    stand_in._modules.update(Wqkv=qkv, out_proj=out)
    return stand_in


def _forward_problem(module: nn.Module) -> str | None:
    """Why the forward of ``module``'s class does not take MPT's arguments (None: it does): ``hidden_states``,
    ``position_bias`` first, ``attention_mask`` and a cache argument (:data:`_CACHE_ARGS`) by name."""
    try:
        params = list(inspect.signature(type(module).forward).parameters)[1:]
    except (TypeError, ValueError):
        params = []
    if params[:2] != ["hidden_states", "position_bias"] or "attention_mask" not in params or not any(
            c in params for c in _CACHE_ARGS):
        return (f"its forward's arguments ({', '.join(params)}) are not MPT's (hidden_states, position_bias, a cache "
                f"argument ({' or '.join(_CACHE_ARGS)}), attention_mask)")
    return None


@probe_isolated
def probe_mpt_attention(module: nn.Module) -> MptAttentionProbe:
    """Whether ``module`` (a :func:`candidate`) computes MPT's ALiBi attention, the formula of
    :class:`FusedMptAttention`: its class's forward, run on a small stand-in (:func:`_stand_in`) on the CPU in fp32
    with a general per-head, per-key bias of more positions than keys for ``position_bias`` and a causal bool mask
    with padding (True = masked), in training and eval mode, must return ``(output, attention probabilities)`` equal
    to the float64 formula (``softmax(softmax_scale * Q K^T + position_bias[..., -sk:], masked) V`` of Q, K, V the
    thirds of ``Wqkv(x)``, clamped to ``clip_qkv`` where set, then ``out_proj``) within 1e-4.
    Refused before that: a class whose forward takes other arguments than MPT's (:func:`_forward_problem`), a module
    without MPT's layout or attributes (:func:`_layout_problem`: a wrapped projection, extra submodules, say).
    Never raises."""
    name = type(module).__name__
    if not candidate(module):
        return MptAttentionProbe(False, f"{name} is not an MptAttention (by its class name)")
    problem = _layout_problem(module) or _forward_problem(module)
    if problem is not None:
        return MptAttentionProbe(False, problem)
    def setup():
        g = torch.Generator().manual_seed(0)
        stand_in = _stand_in(module, g)
        hidden, position_bias, masked = _probe_inputs(g)

        def call(mode):
            stand_in.training = mode
            return type(module).forward(stand_in, hidden, position_bias=position_bias, attention_mask=masked)

        return (*_reference(stand_in, hidden, position_bias, masked), [lambda: call(True), lambda: call(False)])

    problem = run_attention_probe(setup, "MPT", "softmax(softmax_scale * Q K^T + position_bias, masked) V of Wqkv's "
                                                "thirds, clamped to clip_qkv, then out_proj")
    if problem is not None:
        return MptAttentionProbe(False, problem)
    return MptAttentionProbe(True, "MPT's ALiBi attention (probed)")


# --------------------------------------------------------------------------------------------------------------------
# The bias
# --------------------------------------------------------------------------------------------------------------------
_bias_cache: dict = {}   # one entry: every layer of a forward pass gets the same position_bias and mask tensors


def mpt_bias(position_bias: torch.Tensor | None, attention_mask: torch.Tensor | None, *, batch: int, heads: int,
             query_len: int, key_len: int, dtype: torch.dtype) -> torch.Tensor | None:
    """MPT's ``position_bias`` (its last ``key_len`` keys) and ``attention_mask`` as one additive attention bias,
    query-relative (see the module docstring).

    Args:
        position_bias: ``[heads or 1, 1, P]`` with ``P >= key_len`` or ``P == 1`` (MPT's
            ``build_mpt_alibi_tensor``: ``[heads, 1, max_seq_len]``, per head a slope times each position, fp32),
            floating point; its last ``key_len`` positions are the keys' (a size 1 is broadcast, as eager does). Or
            None (no bias: the mask alone).
        attention_mask: bool, True = masked (as ``MptModel`` passes it), ``[batch or 1, 1 or heads, query_len or 1,
            >= key_len]`` or ``[query_len or 1, >= key_len]`` (extra trailing keys are cut off), or None.
        batch, heads, query_len, key_len: the attention's sizes (``query_len <= key_len``: the last ``query_len``
            keys are the queries').
        dtype: the query's dtype, the bias's.
    Returns:
        ``[batch or 1, heads, query_len, key_len]`` in ``dtype``: for query ``i`` and key ``j``,
        ``position_bias[h, 0, P - key_len + j] - position_bias[h, 0, P - query_len + i]`` computed in fp32 (float64
        for a float64 bias) and cast, masked keys at ``dtype``'s minimum (a softmax of each row equal to eager's). The
        batch dimension is 1 where the mask is the same for every sequence or None, found with one comparison on the
        device (not on the meta device or for fake tensors). None where both arguments are None. Built once per pair
        of tensors (identity and version counters, sizes and dtype; the entry goes when either tensor is freed; not
        cached where :func:`pipegoose.nn.fusion.transformers.attention._cacheable` says so, under
        ``torch.inference_mode`` and ``torch.compile``, where the batch dimension stays).
    Raises:
        ValueError: ``position_bias`` of another shape: fewer positions than keys (eager MPT fails there too), a
            bias per query (``[heads, P, P]``, which eager broadcasts where it can; ``MptModel`` passes none),
            ``attention_mask`` of a shape that does not fit (``_fit_mask``), ``query_len`` above ``key_len``.
        TypeError: ``position_bias`` not floating point; ``attention_mask`` not bool (eager's ``masked_fill`` takes
            bool masks only).
    """
    if position_bias is not None:
        if not position_bias.is_floating_point():
            raise TypeError(f"position_bias: expected a floating-point tensor, got dtype {position_bias.dtype}")
        if (position_bias.dim() != 3 or position_bias.shape[0] not in (1, heads) or position_bias.shape[1] != 1
                or 1 != position_bias.shape[2] < key_len):
            raise ValueError(f"position_bias: expected shape [{heads} (heads) or 1, 1, >= {key_len} (keys) or 1], "
                             f"got {tuple(position_bias.shape)}")
    if query_len > key_len:
        raise ValueError(f"query_len: {query_len} queries, more than the {key_len} keys")
    masked = None
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool:
            raise TypeError(f"attention_mask: expected a bool mask (True = masked, as MptModel passes it), got dtype "
                            f"{attention_mask.dtype}")
        # (a 2-D [sq or 1, sk] mask broadcast over batch and heads, as eager's masked_fill does)
        masked = _attention._fit_mask(attention_mask[None, None] if attention_mask.dim() == 2 else attention_mask,
                                      query_len, key_len, batch, heads)
    elif position_bias is None:
        return None
    tensors = tuple(t for t in (position_bias, attention_mask) if t is not None)
    if not all(_attention._cacheable(t) for t in tensors):
        return _build(position_bias, masked, batch, heads, query_len, key_len, dtype, dedupe=False)
    key = (*((id(t), t._version) if t is not None else None for t in (position_bias, attention_mask)),
           batch, heads, query_len, key_len, dtype)
    hit = _bias_cache.get("entry")
    if hit is not None and hit[0] == key and all(r() is t for r, t in zip(hit[1], tensors)):
        return hit[2]
    bias = _build(position_bias, masked, batch, heads, query_len, key_len, dtype,
                  dedupe=not any(_attention._no_values(t) for t in tensors))
    _attention.put_entry(_bias_cache, (key, tuple(weakref.ref(t) for t in tensors), bias), *tensors)
    return bias


def _build(position_bias, masked, batch, heads, query_len, key_len, dtype, dedupe):
    """:func:`mpt_bias`'s bias (uncached) of the fitted bool mask ``masked`` (True = masked, or None); ``dedupe``:
    batch 1 where every sequence has the same mask."""
    device = (position_bias if position_bias is not None else masked).device
    if position_bias is None:
        bias = torch.zeros(1, heads, query_len, key_len, dtype=dtype, device=device)
    else:
        keys = position_bias[:, 0, max(0, position_bias.shape[2] - key_len):]   # [h or 1, sk or 1]: the keys'
        keys = keys.expand(heads, key_len)
        keys = keys.to(torch.promote_types(keys.dtype, torch.float32))
        bias = _attention.query_relative(keys[:, None, :], query_len).to(dtype).unsqueeze(0)
    if masked is None:
        return bias
    if dedupe and batch > 1 and _attention.same_per_sequence(masked):
        masked = masked[:1]
    return torch.where(masked, torch.finfo(dtype).min, bias)


# --------------------------------------------------------------------------------------------------------------------
# output_attentions: the hook on the module that holds the attention
# --------------------------------------------------------------------------------------------------------------------
_ARG_POSITIONS: dict = {}   # class -> position of output_attentions among its forward's arguments (None: none)


def _position_of_output_attentions(cls: type) -> int | None:
    """Where ``output_attentions`` stands among the positional arguments of ``cls.forward`` (after ``self``), or
    None where it cannot be passed by position."""
    if cls not in _ARG_POSITIONS:
        pos = None
        try:
            params = list(inspect.signature(cls.forward).parameters.values())[1:]
        except (TypeError, ValueError):
            params = []
        for i, p in enumerate(params):
            if p.name == "output_attentions" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                pos = i
        _ARG_POSITIONS[cls] = pos
    return _ARG_POSITIONS[cls]


def takes_output_attentions(parent: nn.Module) -> bool:
    """Whether the forward of ``parent``'s class has an ``output_attentions`` argument (``MptBlock``'s has)."""
    try:
        return "output_attentions" in inspect.signature(type(parent).forward).parameters
    except (TypeError, ValueError):
        return False


_requests = threading.local()   # .asked: ids of the fused attentions whose holder's call under way asked for weights


def _ask_weights(parent: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of a module holding fused MPT attention: where its call's ``output_attentions`` (keyword or
    positional) is true, each :class:`FusedMptAttention` among its children is marked, in this thread, as asked for
    its weights, until :func:`_forget_weights` (the call's end). A module-level function: a fused model pickles, and a
    copy's hooks act on the copy's modules."""
    asked = kwargs.get("output_attentions")
    if asked is None:
        pos = _position_of_output_attentions(type(parent))
        if pos is not None and len(args) > pos:
            asked = args[pos]
    if asked:
        ids = _requests.__dict__.setdefault("asked", set())
        ids.update(id(c) for c in parent._modules.values() if isinstance(c, FusedMptAttention))


def _forget_weights(parent: nn.Module, args: tuple, output) -> None:
    """Forward hook (``always_call``: also where the call raised) of a module holding fused MPT attention: the marks
    of :func:`_ask_weights` taken off."""
    ids = _requests.__dict__.get("asked")
    if ids:
        ids.difference_update(id(c) for c in parent._modules.values() if isinstance(c, FusedMptAttention))


def _weights_asked(attention: nn.Module) -> bool:
    """Whether the call under way, in this thread, of the module holding ``attention`` asked for weights."""
    ids = _requests.__dict__.get("asked")
    return bool(ids) and id(attention) in ids


def watch_output_attentions(parent: nn.Module) -> tuple | None:
    """Put on ``parent`` (the module that holds a :class:`FusedMptAttention`: ``MptBlock``) the hooks that pass each
    call's ``output_attentions`` to the fused attention (:func:`_ask_weights`, :func:`_forget_weights`); returns their
    handles (``fuse`` removes them at ``unfuse``), or None where ``parent``'s forward takes no ``output_attentions``
    (:func:`takes_output_attentions`) or carries the hooks already."""
    if not takes_output_attentions(parent) or watched(parent):
        return None
    return (parent.register_forward_pre_hook(_ask_weights, with_kwargs=True),
            parent.register_forward_hook(_forget_weights, always_call=True))


def watched(parent: nn.Module) -> bool:
    """Whether ``parent`` carries :func:`watch_output_attentions`'s hook."""
    return any(h is _ask_weights for h in parent._forward_pre_hooks.values())


# --------------------------------------------------------------------------------------------------------------------
# The module
# --------------------------------------------------------------------------------------------------------------------
class FusedMptAttention(nn.Module):
    """MPT's attention (``MptAttention``, ALiBi) on pipegoose's attention function (see the module docstring).

    Holds the replaced module's ``Wqkv`` (``nn.Linear(hidden, 3 * hidden)``: query, key and value one after the
    other on the last dimension) and ``out_proj`` (the same modules: ``state_dict`` keys and parameters unchanged),
    and its ``hidden_size``, ``n_heads``, ``head_dim``, ``softmax_scale``, ``attn_dropout_p``, ``clip_qkv``,
    ``layer_idx`` and ``max_seq_length``.

    ``forward(hidden_states, position_bias, cache=None, attention_mask=None, *, output_attentions=None)``, as
    ``MptAttention``'s (``MptBlock`` calls it so; the cache also as ``past_key_values``, ``past_key_value`` or
    ``layer_past``, the names of other transformers versions):

    * hidden_states: ``[b, sq, hidden]``, fp32, fp16 or bf16 (CUDA autocast as in the model);
    * position_bias: ``[heads, 1, >= sk]`` (MPT's ALiBi tensor) or None; attention_mask: bool ``[b or 1, 1, sq,
      >= sk]``, True = masked, or None (see :func:`mpt_bias`);
    * cache: a transformers ``Cache`` (``update(key, value, layer_idx)``), or None;
    * returns ``(output [b, sq, hidden], attention weights [b, heads, sq, sk] or None)``: ``out_proj(attention)``;
      the weights where the softmax path ran (always under ``output_attentions=True``, with their gradient), or where
      the call of the module holding it asked for them through ``fuse``'s hooks (detached, see the module
      docstring), None on the SDPA path otherwise.

    Raises: the constructor, ``TypeError`` for projections that are not ``torch.nn.Linear``, ``ValueError`` naming the
    argument for sizes that do not fit, a ``clip_qkv`` below 0, a ``softmax_scale`` that is not a finite number or an
    ``attn_dropout_p`` outside [0, 1]; ``forward``, ``ValueError`` / ``TypeError`` for a ``position_bias`` or
    ``attention_mask`` that does not fit (:func:`mpt_bias`), what ``pipegoose_attention_forward`` raises
    (``PIPEGOOSE_IMPL_ATTENTION`` values).
    """

    def __init__(self, *, Wqkv: nn.Linear, out_proj: nn.Linear, hidden_size: int, n_heads: int, head_dim: int,
                 softmax_scale: float, attn_dropout_p: float = 0.0, clip_qkv: float | None = None,
                 layer_idx: int | None = None, max_seq_length: int | None = None):
        super().__init__()
        for name, value in (("Wqkv", Wqkv), ("out_proj", out_proj)):
            if not isinstance(value, nn.Linear):
                raise TypeError(f"{name}: expected a torch.nn.Linear, got {type(value).__name__}")
        if n_heads * head_dim != hidden_size:
            raise ValueError(f"n_heads: {n_heads} heads of head_dim {head_dim} do not make hidden_size {hidden_size}")
        if Wqkv.in_features != hidden_size or Wqkv.out_features != 3 * hidden_size:
            raise ValueError(f"Wqkv: expected {hidden_size} -> {3 * hidden_size} features, got {Wqkv.in_features} "
                             f"-> {Wqkv.out_features}")
        if out_proj.in_features != hidden_size:
            raise ValueError(f"out_proj: expected {hidden_size} input features, got {out_proj.in_features}")
        problem = _attribute_problem(clip_qkv, softmax_scale, attn_dropout_p)
        if problem is not None:
            raise ValueError(problem)
        self.Wqkv = Wqkv
        self.out_proj = out_proj
        self.hidden_size, self.n_heads, self.head_dim = hidden_size, n_heads, head_dim
        self.softmax_scale, self.attn_dropout_p, self.clip_qkv = softmax_scale, attn_dropout_p, clip_qkv
        self.layer_idx, self.max_seq_length = layer_idx, max_seq_length

    @classmethod
    def from_module(cls, attention: nn.Module, verify: bool = True) -> FusedMptAttention:
        """A :class:`FusedMptAttention` sharing ``attention``'s (an ``MptAttention``) children and attributes.

        Raises:
            TypeError: ``attention`` is not an ``MptAttention`` (:func:`candidate`: by its class name).
            ValueError: ``verify`` and :func:`probe_mpt_attention` refuses the module (the reason); what the
                constructor raises.
        """
        if not candidate(attention):
            raise TypeError(f"attention: expected an MptAttention, got {type(attention).__name__}")
        if verify:
            probe = probe_mpt_attention(attention)
            if not probe.ok:
                raise ValueError(f"attention: {type(attention).__name__}: {probe.reason}")
        return cls(**{k: getattr(attention, k) for k in _CHILDREN + _ATTRIBUTES + ("layer_idx",)})

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, head_dim={self.head_dim}, clip_qkv={self.clip_qkv}"

    def forward(self, hidden_states: torch.Tensor, position_bias: torch.Tensor | None, cache=None,
                attention_mask: torch.Tensor | None = None, *, past_key_values=None, past_key_value=None,
                layer_past=None, output_attentions: bool | None = None, **kwargs):
        for other in (past_key_values, past_key_value, layer_past):
            cache = other if cache is None else cache
        b, sq, _ = hidden_states.shape
        h, d = self.n_heads, self.head_dim
        qkv = self.Wqkv(hidden_states)
        if self.clip_qkv:
            qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        query, key, value = (t.unflatten(-1, (h, d)).transpose(1, 2) for t in qkv.chunk(3, dim=-1))  # [b, h, s, d]
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        sk = key.shape[2]
        if isinstance(position_bias, torch.Tensor) and position_bias.dim() == 3 and 1 != position_bias.shape[2] < sk:
            raise ValueError(f"hidden_states: {sk} positions (with the cache's) exceed the {position_bias.shape[2]} of "
                             f"position_bias, MPT's ALiBi over config.max_seq_len (max_seq_length "
                             f"{self.max_seq_length}): shorten the input or raise max_seq_len")
        bias = mpt_bias(position_bias, attention_mask, batch=b, heads=h, query_len=sq, key_len=sk, dtype=query.dtype)
        run = functools.partial(_attention.bias_attention_forward, self, query, key, value, bias,
                                scaling=self.softmax_scale, dropout=self.attn_dropout_p)
        out, weights = run(output_attentions=bool(output_attentions))
        if weights is None and _weights_asked(self):
            with torch.no_grad():   # (the holder's request: weights besides the output, which takes its own path)
                weights = run(output_attentions=True)[1]
        return self.out_proj(out.reshape(b, sq, h * d)), weights


__all__ = ["FusedMptAttention", "MptAttentionProbe", "candidate", "mpt_bias", "probe_mpt_attention",
           "takes_output_attentions", "watch_output_attentions"]
