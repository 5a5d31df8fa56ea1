"""Minimum bytes moved by each benchmarked op: the numerator of the effective bandwidth.

Effective bandwidth = ``bytes(op, pass, shape, dtype) / median time``. The byte count is the *minimum* an ideal
kernel must read and write from device memory; it is the same for every implementation of an op, whatever that
implementation really moves (an eager chain of kernels moves more, and so shows a lower effective bandwidth).

``s`` is the element size of the data dtype (2 for fp16/bf16, 4 for fp32), ``N`` = number of elements of the
input, ``R`` = rows, ``H`` = hidden size (last dim), ``T`` = elements of the lower triangle (incl. the diagonal)
of the causal score matrices = ``B * sq*(sq+1)/2`` for ``B`` = batch*heads, ``M`` = elements of the boolean mask
(1 byte each, at its stored broadcast shape ``[b, 1, sq, sk]``), ``P`` = parameters; for RoPE ``Q = b*seq*hq*d`` and
``K = b*seq*hk*d`` = elements of q and k, ``C = b*seq*d`` = elements of each of cos and sin (``[b, seq, d]``). For
swiglu, swiglu.packed and geglu ``N = rows*inter`` = elements of the output (of gate, of up): swiglu.packed's input
``x`` is ``[rows, 2*inter]`` (gate and up as its halves), ``2*N`` elements; for gelu and squared_relu ``N = rows*inter``
= elements of ``x`` (and of ``y``).

=====================  ======  ===========================================================================
op                     pass    bytes counted
=====================  ======  ===========================================================================
softmax                fwd     read x, write y:                         ``2*N*s``
softmax                bwd     read dy, y, write dx:                    ``3*N*s``
softmax.masked         fwd     read x, read mask (bool), write y:       ``2*N*s + M``
softmax.masked         bwd     read dy, y, write dx (no mask needed):   ``3*N*s``
softmax.causal         fwd     read lower triangle of x, write all y:   ``T*s + N*s``
softmax.causal         bwd     read lower triangles of dy and y, write all dx: ``2*T*s + N*s``
layer_norm             fwd     read x, w, b; write y, mean, rstd (fp32): ``2*N*s + 2*H*s + 2*R*4``
layer_norm             bwd     read dy, x, w, mean, rstd; write dx, dw, db: ``3*N*s + 3*H*s + 2*R*4``
rms_norm               fwd     read x, w; write y, rstd (fp32):         ``2*N*s + H*s + R*4``
rms_norm               bwd     read dy, x, w, rstd; write dx, dw:       ``3*N*s + 2*H*s + R*4``
swiglu                 fwd     read gate, up; write y:                  ``3*N*s``
swiglu                 bwd     read dy, gate, up; write dgate, dup:     ``5*N*s``
swiglu.packed          fwd     read x (gate and up), write y:           ``3*N*s``
swiglu.packed          bwd     read dy, x; write dx (dgate and dup):    ``5*N*s``
geglu                  fwd     read gate, up; write y:                  ``3*N*s``
geglu                  bwd     read dy, gate, up; write dgate, dup:     ``5*N*s``
geglu.packed           fwd/bwd as swiglu.packed
gelu                   fwd     read x; write y:                         ``2*N*s``
gelu                   bwd     read dy, x; write dx:                    ``3*N*s``
squared_relu           fwd/bwd as gelu
cross_entropy          fwd     read logits, target (int64); write lse (fp32): ``N*s + R*8 + R*4``
cross_entropy          bwd     read logits, target, lse; write dlogits: ``2*N*s + R*8 + R*4``
rope                   fwd     read q, k, cos, sin; write q_embed, k_embed: ``2*(Q+K)*s + 2*C*s``
rope                   bwd     read dq_embed, dk_embed, cos, sin; write dq, dk: ``2*(Q+K)*s + 2*C*s``
any op                 fwd+bwd the sum of fwd and bwd (each pass must touch its own tensors)
adamw                  step    read g, p, m, v; write p, m, v:          ``7*P*s``
clip_grad_norm         step    read g (norm), read g + write g (scale): ``3*P*s``
clip_grad_norm         unclip- read g (norm); the gradients are within max_norm, nothing to scale: ``P*s``
                       ped
copy (reference)       --      read src, write dst:                     ``2*N*s``
=====================  ======  ===========================================================================

The fp32 ``mean``/``rstd`` statistics are counted for LayerNorm/RMSNorm because a training forward must keep
them (or recompute them) for the backward; an impl that recomputes them instead is not charged extra. For the
causal softmax the masked upper triangle of the input need not be read (every impl is charged the same), but the
zeros of the output's upper triangle must be written. swiglu.packed is charged the bytes of swiglu: ``x`` holds
gate and up, and its gradient ``dx`` dgate and dup, written once as one tensor (eager PyTorch's backward
concatenates the halves' gradients, one more read and write of ``x``'s size, which its effective bandwidth shows).
geglu is charged the bytes of swiglu too: only the activation differs (its tanh costs arithmetic, not bytes; an impl
that saves ``gelu(gate)`` for the backward, as eager PyTorch does, moves more).
"""

from __future__ import annotations

from typing import Mapping

__all__ = ["PASSES", "STEP_PASSES", "DTYPE_SIZES", "op_bytes", "dtype_size"]

PASSES = ("fwd", "bwd", "fwd+bwd")
# the optimizer ops' passes: one step; for clip_grad_norm also a step whose gradients are already within max_norm
STEP_PASSES = ("step", "unclipped")
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
_STAT = 4  # fp32 mean / rstd per row


def dtype_size(dtype: str) -> int:
    """Bytes per element of a dtype named like ``"bfloat16"``; raises ValueError naming the dtype otherwise."""
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPE_SIZES)}, got {dtype!r}") from None


def _need(shape: Mapping[str, int], *keys: str) -> list[int]:
    missing = [k for k in keys if k not in shape]
    if missing:
        raise ValueError(f"shape: missing key(s) {missing} (got {dict(shape)})")
    vals = [int(shape[k]) for k in keys]
    if any(v < 1 for v in vals):
        raise ValueError(f"shape: every size must be >= 1, got {dict(shape)}")
    return vals


def _one_pass(op: str, pas: str, shape: Mapping[str, int], s: int) -> int:
    if op in ("softmax", "softmax.masked", "softmax.causal"):
        b, h, sq, sk = _need(shape, "b", "np", "sq", "sk")
        n = b * h * sq * sk
        if op == "softmax":
            return 2 * n * s if pas == "fwd" else 3 * n * s
        if op == "softmax.masked":
            m = b * sq * sk  # bool mask [b, 1, sq, sk]
            return 2 * n * s + m if pas == "fwd" else 3 * n * s
        if sq != sk:
            raise ValueError(f"shape: softmax.causal needs sq == sk, got sq={sq}, sk={sk}")
        t = b * h * sq * (sq + 1) // 2
        return t * s + n * s if pas == "fwd" else 2 * t * s + n * s
    if op in ("layer_norm", "rms_norm"):
        r, hid = _need(shape, "rows", "hidden")
        n = r * hid
        if op == "layer_norm":
            return (2 * n * s + 2 * hid * s + 2 * r * _STAT) if pas == "fwd" else (3 * n * s + 3 * hid * s + 2 * r * _STAT)
        return (2 * n * s + hid * s + r * _STAT) if pas == "fwd" else (3 * n * s + 2 * hid * s + r * _STAT)
    if op in ("swiglu", "swiglu.packed", "geglu", "geglu.packed"):   # (packed: x [rows, 2*inter] is gate and up)
        r, inter = _need(shape, "rows", "inter")
        return (3 if pas == "fwd" else 5) * r * inter * s
    if op in ("gelu", "squared_relu"):   # x read, y written; the backward reads dy and x, writes dx
        r, inter = _need(shape, "rows", "inter")
        return (2 if pas == "fwd" else 3) * r * inter * s
    if op == "cross_entropy":
        r, vocab = _need(shape, "rows", "vocab")
        return (1 if pas == "fwd" else 2) * r * vocab * s + r * 8 + r * _STAT
    if op == "rope":   # the rotation is linear: the backward needs cos and sin, not q or k
        b, seq, hq, hk, d = _need(shape, "b", "seq", "hq", "hk", "d")
        return 2 * b * seq * (hq + hk) * d * s + 2 * b * seq * d * s
    if op == "adamw":
        (p,) = _need(shape, "params")
        return 7 * p * s
    if op == "clip_grad_norm":
        (p,) = _need(shape, "params")
        return (3 if pas == "step" else 1) * p * s
    if op == "copy":
        (n,) = _need(shape, "numel")
        return 2 * n * s
    raise ValueError(f"op: unknown op {op!r}; expected softmax, softmax.masked, softmax.causal, layer_norm, "
                     "rms_norm, swiglu, swiglu.packed, geglu, geglu.packed, gelu, squared_relu, cross_entropy, rope, "
                     "adamw, clip_grad_norm or copy")


def op_bytes(op: str, pas: str, shape: Mapping[str, int], dtype: str) -> int:
    """Minimum bytes read + written by ``op`` in pass ``pas`` (``fwd``, ``bwd``, ``fwd+bwd``; ``step`` for the
    optimizer ops and ``copy``; ``unclipped`` for clip_grad_norm) on ``shape`` (a mapping: ``b, np, sq, sk`` for the
    softmaxes, ``rows, hidden`` for the norms, ``rows, inter`` for swiglu, swiglu.packed (whose ``x`` is ``[rows,
    2*inter]``) and geglu, ``rows, vocab`` for cross_entropy, ``b, seq, hq, hk, d`` for rope, ``params`` for
    adamw/clip_grad_norm, ``numel`` for copy) in ``dtype`` (name, e.g. ``"bfloat16"``).

    Returns an int (bytes). Raises ValueError naming the argument on an unknown op, pass, dtype or a bad shape.
    The counts are tabulated in this module's docstring.
    """
    s = dtype_size(dtype)
    if op == "clip_grad_norm":
        if pas not in STEP_PASSES:
            raise ValueError(f"pas: clip_grad_norm has the passes {', '.join(map(repr, STEP_PASSES))}, got {pas!r}")
        return _one_pass(op, pas, shape, s)
    if op in ("adamw", "copy"):
        if pas != "step":
            raise ValueError(f"pas: {op} has the single pass 'step', got {pas!r}")
        return _one_pass(op, pas, shape, s)
    if pas == "fwd+bwd":
        return _one_pass(op, "fwd", shape, s) + _one_pass(op, "bwd", shape, s)
    if pas not in ("fwd", "bwd"):
        raise ValueError(f"pas: expected one of {', '.join(PASSES)}, got {pas!r}")
    return _one_pass(op, pas, shape, s)
