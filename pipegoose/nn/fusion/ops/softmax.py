"""Scaled (masked, causal) softmax over the last dim: autograd Functions, the PyTorch reference, dispatch.

Ops (dispatch / tuning names): ``softmax`` (no mask), ``softmax.masked`` (boolean mask, True = masked),
``softmax.causal`` (key ``j`` masked for query ``i`` when ``j > i + (sk - sq)``).

Implementations:

* ``pipegoose`` - pipegoose/kernels/csrc/softmax.cu (this project, MIT): fp32/fp16/bf16, any key length,
  broadcast masks, fully masked rows give zeros.
* ``megatron`` - Megatron-LM ``scaled_masked_softmax`` / ``scaled_upper_triang_masked_softmax`` (Megatron-LM
  commit 040eac9414ccbd1301ae16369c3044c5632b7e14), copies in ColossalAI 0.5.0
  ``extensions/csrc/kernel/cuda/scaled_masked_softmax_kernel.cu`` and
  ``extensions/csrc/kernel/cuda/scaled_upper_triang_masked_softmax_kernel.cu``, Apache-2.0 (Megatron-LM
  BSD-3 notice). Every assumption of those kernels is checked before a call (see ``_megatron_common``); where
  one does not hold, another implementation runs. The copies give a fully masked row uniform ``1/sk``; the
  Function zeroes those rows in the output (and hence in the gradient).
  Known semantic difference kept: masked scores are set to ``-10000`` (not ``-inf``), so a row whose *unmasked*
  scaled scores are all below about ``-9900`` gives weight to masked keys (never the case for attention scores).
* ``torch`` - reference: fp32 math (fp64 for fp64 input), ``-inf`` masking, fully masked rows -> zeros.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import torch
import torch.nn.functional as F

from .. import dispatch
from ..dispatch import Implementation, Problem
from ._common import (FLOAT_DTYPES, GRID_YZ_MAX, HALF_DTYPES, INT32_MAX, NO_STORAGE, autocast_state,
                      call_without_autocast, check_input_dtype, dtype_name, has_storage, has_tangent, in_transform,
                      int_value, manifest_limit, megatron_batches_per_block, needs_grad, nested_fallback, next_pow2,
                      param_signature, python_finite, representable, torch_result_dtype)

OP_PLAIN, OP_MASKED, OP_CAUSAL = "softmax", "softmax.masked", "softmax.causal"

SRC_PIPEGOOSE = "pipegoose/softmax: pipegoose/kernels/csrc/softmax.cu (pipegoose, MIT)"
SRC_MEGATRON_MASKED = ("megatron/scaled_masked_softmax: Megatron-LM 040eac94 via ColossalAI 0.5.0 "
                       "extensions/csrc/kernel/cuda/scaled_masked_softmax_kernel.cu, Apache-2.0")
SRC_MEGATRON_CAUSAL = ("megatron/scaled_upper_triang_masked_softmax: Megatron-LM 040eac94 via ColossalAI 0.5.0 "
                       "extensions/csrc/kernel/cuda/scaled_upper_triang_masked_softmax_kernel.cu, Apache-2.0")
MEGATRON_KEY_LEN_MAX = 2048  # TORCH_INTERNAL_ASSERT(key_seq_len <= 2048) in both copies


# ---------------------------------------------------------------------------------------------------------------
# Problems

def softmax_problem(op: str, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0,
                    exact: bool = False, last_dim: bool = True) -> Problem:
    storage = has_storage(x) and (mask is None or has_storage(mask))
    aligned = storage and ((not x.is_contiguous()) or x.data_ptr() % 16 == 0)
    return Problem(op, x.dtype, x.device, cols=int(x.shape[-1]) if x.dim() else None,
                   needs_grad=needs_grad(x),
                   extra=dict(shape=tuple(x.shape), mask_shape=None if mask is None else tuple(mask.shape),
                              mask_dtype=None if mask is None else mask.dtype, scale=float(scale), exact=exact,
                              last_dim=last_dim, aligned=aligned, numel=x.numel(), storage=storage))


def _explain_builder(op: str):
    """The problem builder of ``op`` for dispatch.explain: the functional arguments of ``scaled_masked_softmax(x, mask,
    scale)``; for the plain and causal ops also those of ``scaled_softmax(x, scale)`` and
    ``scaled_upper_triang_masked_softmax(x, scale)`` (a float after x is the scale); for the plain op an int after x
    (or ``dim=``) is ``softmax(x, dim)``'s dim, which describes that call (the F.softmax drop-in: fused only where
    exact, over the last dim)."""
    def entry(x: torch.Tensor, *args: Any, **kwargs: Any) -> Problem:
        if op == OP_PLAIN and ("dim" in kwargs or (args and isinstance(args[0], numbers.Integral)
                                                   and not isinstance(args[0], bool))):
            return plain(x, *args, **kwargs)
        if op != OP_MASKED and args and not (args[0] is None or isinstance(args[0], torch.Tensor)):
            if op == OP_PLAIN and (isinstance(args[0], bool) or not isinstance(args[0], numbers.Real)):
                # (a review: "scale: expected a number" for a bad dim of softmax(x, dim))
                raise TypeError(f"explain({op!r}, x, ...): the argument after x is softmax(x, dim)'s dim (an int) or "
                                f"scaled_softmax(x, scale)'s scale (a float), got {args[0]!r} "
                                f"({type(args[0]).__name__})")
            if not (op == OP_PLAIN and isinstance(args[0], int)):
                if "scale" in kwargs or len(args) > 1:
                    raise TypeError(f"explain({op!r}, x, scale): scale given twice or extra arguments {args[1:]}")
                return build(x, None, args[0], **kwargs)
        return build(x, *args, **kwargs)

    def build(x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0) -> Problem:
        # the checks of the functional entry points, so that explain() refuses what the op would refuse
        check_input(x)
        scale = check_scale(scale)
        if mask is not None:
            if not isinstance(mask, torch.Tensor):  # before the shape: explain(op, x, -1) passes a dim as mask
                raise TypeError(f"mask: expected a bool torch.Tensor (True = masked) or None, got "
                                f"{type(mask).__name__} (explain() takes the op's functional arguments: x, mask, "
                                f"scale; softmax(x, dim)'s dim is not one of them)")
            if x.dim() != 4:
                raise ValueError(f"x: expected [b, np, sq, sk] with a mask, got shape {list(x.shape)}")
            mask = check_mask(mask, x)
        elif op == OP_CAUSAL and x.dim() != 3:
            raise ValueError(f"x: expected [attn_batches, sq, sk], got shape {list(x.shape)}")
        return cast_as_run(softmax_problem(op, x, mask, scale), x)

    def plain(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> Problem:
        # softmax(x, dim, dtype=dtype) (the F.softmax drop-in): exact, and fused only over the last dim (run_plain)
        check_input(x, "input")
        dim = int_value(dim, "dim")   # (as run_plain checks it)
        nd = max(x.dim(), 1)
        if not -nd <= dim < nd:
            raise IndexError(f"dim: expected in [{-nd}, {nd - 1}], got {dim}")
        last = x.dim() == 0 or dim % nd == nd - 1
        p = softmax_problem(OP_PLAIN, x, None, 1.0, exact=True, last_dim=last)
        if dtype is not None and dtype != x.dtype:  # x cast first, as softmax(x, dim, dtype=dtype) does
            if not isinstance(dtype, torch.dtype) or dtype not in (*FLOAT_DTYPES, torch.float64):
                raise TypeError(f"dtype: expected torch.float32, float16, bfloat16, float64 or None, got {dtype}")
            p = dataclasses.replace(p, dtype=dtype, extra=dict(p.extra, aligned=p.get("storage", True)))
            x = torch.empty(0, dtype=dtype, device=x.device)   # for the autocast rule below: dtype and device only
        return cast_as_run(p, x)

    def cast_as_run(p: Problem, x: torch.Tensor) -> Problem:
        out = softmax_out_dtype(x)
        if out == x.dtype:
            return p
        # the problem run() chooses on: x cast first, as autocast does (a new contiguous, aligned tensor)
        return dataclasses.replace(p, dtype=out, extra=dict(p.extra, aligned=p.get("storage", True)))
    return entry


# ---------------------------------------------------------------------------------------------------------------
# supports()

def _pipegoose_supports(p: Problem) -> tuple[bool, str]:
    if p.device.type != "cuda":
        return False, f"needs a CUDA tensor, got device {p.device}"
    if not p.get("storage", True):
        return False, NO_STORAGE
    if p.dtype not in FLOAT_DTYPES:
        return False, f"dtype {dtype_name(p.dtype)} not supported (float32, float16, bfloat16)"
    if p["exact"] and p.dtype != torch.float32:
        return False, ("softmax() promises allclose with F.softmax; a fused fp16/bf16 result may differ by one "
                       "ulp there (use scaled_softmax for the fused half-precision path)")
    if not p["last_dim"]:
        return False, "softmax over a dim other than the last"
    shape = p["shape"]
    if len(shape) < 1 or p.cols == 0:
        return False, f"empty rows (shape {list(shape)})"
    kmax = manifest_limit("pipegoose/softmax", "key_len_max", 2**30)
    if p.cols > kmax:
        return False, f"key length {p.cols} > {kmax}"
    if p.op == OP_CAUSAL and len(shape) < 2:
        return False, "causal softmax needs [..., sq, sk]"
    ms = p["mask_shape"]
    if ms is not None:
        if len(shape) != 4 or len(ms) != 4:
            return False, f"masked softmax needs a 4-D input and mask, got {list(shape)} and {list(ms)}"
        for i, (m, s) in enumerate(zip(ms, shape)):
            if m not in (1, s) or (i == 3 and m != s):
                return False, f"mask shape {list(ms)} does not broadcast as [b or 1, np or 1, sq or 1, sk] " \
                              f"against {list(shape)}"
    return True, ""


def _megatron_common(p: Problem, rows_per_launch: int, sq: int, sk: int) -> tuple[bool, str]:
    if p.device.type != "cuda":
        return False, f"needs a CUDA tensor, got device {p.device}"
    if not p.get("storage", True):
        return False, NO_STORAGE
    if p.dtype not in HALF_DTYPES:
        return False, f"dtype {dtype_name(p.dtype)} not supported (the copies dispatch float16 and bfloat16 only)"
    if p["exact"]:
        return False, "softmax() promises allclose with F.softmax; a fused fp16/bf16 result may differ by one ulp"
    kmax = min(MEGATRON_KEY_LEN_MAX, manifest_limit("megatron/scaled_masked_softmax", "key_len_max",
                                                     MEGATRON_KEY_LEN_MAX))
    if not 1 <= sk <= kmax:
        return False, f"key length {sk} outside [1, {kmax}] (the copies assert sk <= 2048)"
    if next_pow2(sk) >= 128 and sk % 4 != 0:
        return False, (f"key length {sk} not a multiple of 4: the copies move 4 elements per access for "
                       f"sk > 64 and would read/write past the row end")
    if p["numel"] > INT32_MAX:
        return False, f"{p['numel']} elements: the copies index with 32-bit int"
    if not p["aligned"]:
        return False, "input data pointer not 16-byte aligned (the copies use vector loads)"
    if not representable(p["scale"], p.dtype):
        return False, (f"scale {p['scale']!r} is not exactly representable in {dtype_name(p.dtype)}: the copies "
                       f"round the forward scale to the input dtype")
    bpb = megatron_batches_per_block(sk)
    if rows_per_launch % bpb != 0:
        return False, f"{'sq' if p.op != OP_CAUSAL else 'attn_batches'}={rows_per_launch} not a multiple of " \
                      f"batches_per_block={bpb}"
    return True, ""


def _megatron_masked_supports(p: Problem) -> tuple[bool, str]:
    shape = p["shape"]
    if len(shape) != 4:
        return False, f"needs a 4-D input [b, np, sq, sk], got {list(shape)}"
    b, np_, sq, sk = shape
    if sq < 2:
        return False, f"sq={sq}: the copy asserts query length > 1"
    if b > GRID_YZ_MAX or np_ > GRID_YZ_MAX:
        return False, f"b={b} or np={np_} > {GRID_YZ_MAX} (grid y/z limit)"
    ms = p["mask_shape"]
    if ms is not None:
        if len(ms) != 4 or ms[0] not in (1, b) or ms[1] != 1 or ms[2] not in (1, sq) or ms[3] != sk:
            return False, f"mask shape {list(ms)} is not [b or 1, 1, sq or 1, sk]"
    ok, why = _megatron_common(p, sq, sq, sk)
    return ok, why


def _megatron_causal_supports(p: Problem) -> tuple[bool, str]:
    shape = p["shape"]
    if len(shape) != 3:
        return False, f"needs [attn_batches, sq, sk], got {list(shape)}"
    ab, sq, sk = shape
    if sq != sk:
        return False, f"sq={sq} != sk={sk} (the copy is square-causal only)"
    if ab // max(1, megatron_batches_per_block(sk)) > GRID_YZ_MAX:
        return False, f"attn_batches={ab} too large for the grid (y <= {GRID_YZ_MAX} blocks)"
    return _megatron_common(p, ab, sq, sk)


def _torch_supports(p: Problem) -> tuple[bool, str]:
    return True, ""


for _op in (OP_PLAIN, OP_MASKED, OP_CAUSAL):
    dispatch.register(Implementation(_op, "pipegoose", "ours", _pipegoose_supports, ("pipegoose/softmax",),
                                     SRC_PIPEGOOSE))
    dispatch.register(Implementation(_op, "torch", "reference", _torch_supports, (), "PyTorch reference"))
    dispatch.register_problem(_op, _explain_builder(_op))
dispatch.register(Implementation(OP_PLAIN, "megatron", "ported", _megatron_masked_supports,
                                 ("megatron/scaled_masked_softmax",), SRC_MEGATRON_MASKED))
dispatch.register(Implementation(OP_MASKED, "megatron", "ported", _megatron_masked_supports,
                                 ("megatron/scaled_masked_softmax",), SRC_MEGATRON_MASKED))
dispatch.register(Implementation(OP_CAUSAL, "megatron", "ported", _megatron_causal_supports,
                                 ("megatron/scaled_upper_triang_masked_softmax",), SRC_MEGATRON_CAUSAL))


# ---------------------------------------------------------------------------------------------------------------
# Reference

def causal_mask(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    """Bool [sq, sk], True where key ``j > i + (sk - sq)`` (masked)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu_(sk - sq + 1)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def softmax_reference_forward(x: torch.Tensor, mask: torch.Tensor | None, scale: float,
                              causal: bool) -> torch.Tensor:
    """y = softmax(scale * x, masked) over the last dim in fp32 (fp64 for fp64 x); fully masked rows -> 0.

    Plain differentiable ops: the forward of :class:`ReferenceSoftmaxFunction`, and the whole reference path inside
    ``torch.func`` transforms, where a Function with a custom ``jvp`` gave wrong values under nested forward mode
    (``jvp`` of ``jvp``, ``jacfwd`` of ``jacfwd``; torch 2.14) while plain ops are exact to every order. Fully masked
    rows keep their (finite) scores through the softmax and are zeroed after it, so every derivative of those rows
    is zero, not NaN."""
    ct = _compute_dtype(x.dtype)
    s = x.to(ct) * scale
    masked = mask
    if causal:
        cm = causal_mask(x.shape[-2], x.shape[-1], x.device)
        masked = cm if masked is None else (masked | cm)
    if masked is None:
        return torch.softmax(s, dim=-1).to(x.dtype)
    empty = masked.all(dim=-1, keepdim=True)
    y = torch.softmax(s.masked_fill(masked & ~empty, float("-inf")), dim=-1)
    return y.masked_fill(empty, 0.0).to(x.dtype)


def softmax_reference_backward(dy: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    """dx = scale * y * (dy - sum(dy * y)) in fp32 (fp64); rows of zeros in y give zeros."""
    ct = _compute_dtype(y.dtype)
    yf, dyf = y.to(ct), dy.to(ct)
    dx = yf * (dyf - (dyf * yf).sum(dim=-1, keepdim=True))
    return (dx * scale).to(y.dtype)


class ReferenceSoftmaxFunction(torch.autograd.Function):
    """The reference path with its own backward (zero gradient for fully masked rows, fp32 math; saves only y).
    Inside ``torch.func`` transforms the ops run :func:`softmax_reference_forward` directly; ``setup_context`` and
    ``generate_vmap_rule`` keep the Function usable there all the same.

    Forward mode (``jvp``, for ``torch.autograd.forward_ad``): the softmax Jacobian ``scale * (diag(y) - y y^T)`` is
    symmetric, so the tangent of y is the backward's formula applied to the tangent of x (zero on fully masked rows
    and masked keys, where y is zero)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, mask, scale, causal):
        return softmax_reference_forward(x, mask, scale, causal)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)
        ctx.save_for_forward(output)
        ctx.scale = inputs[2]

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return softmax_reference_backward(dy, y, ctx.scale), None, None, None

    @staticmethod
    def jvp(ctx, dx, *_):
        (y,) = ctx.saved_tensors
        return softmax_reference_backward(dx, y, ctx.scale)


# ---------------------------------------------------------------------------------------------------------------
# Fused Functions

def _ops(name: str) -> Any:
    ops, why = dispatch.kernel(name)
    if ops is None:
        raise RuntimeError(why)
    return ops


class PipegooseSoftmaxFunction(torch.autograd.Function):
    """pipegoose/softmax: ``softmax_forward(input, mask, scale, causal)`` / ``softmax_backward``.

    Double backward: a backward run with grad mode on (``create_graph=True``) computes ``dx`` with
    :func:`softmax_reference_backward` (plain differentiable ops on ``dy`` and the saved output, which leads back to
    this Function) instead of the backward kernel, which is not differentiable; second derivatives are then exact.
    A backward without ``create_graph`` runs the kernel. The same holds for the Megatron Functions below."""

    @staticmethod
    def forward(ctx, x, mask, scale, causal):
        ops = _ops("pipegoose/softmax")
        y = ops.softmax_forward(x.contiguous(), mask, float(scale), bool(causal))
        ctx.save_for_backward(y)
        ctx.save_for_forward(y)
        ctx.scale = scale
        ctx.causal = bool(causal)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a dx that is differentiable again
            return softmax_reference_backward(dy, y, ctx.scale), None, None, None
        # causal: the kernel skips the masked tail, where y (and so dx) is zero
        dx = _ops("pipegoose/softmax").softmax_backward(dy.contiguous(), y, float(ctx.scale), ctx.causal)
        return dx, None, None, None

    @staticmethod
    def jvp(ctx, dx, *_):
        # the Jacobian is symmetric (ReferenceSoftmaxFunction): the backward kernel maps the tangent of x to y's
        (y,) = ctx.saved_tensors
        return _ops("pipegoose/softmax").softmax_backward(dx.contiguous(), y, float(ctx.scale), ctx.causal)


class MegatronScaledMaskedSoftmaxFunction(torch.autograd.Function):
    """megatron/scaled_masked_softmax; mask bool [b or 1, 1, sq or 1, sk] or None (no masking)."""

    @staticmethod
    def forward(ctx, x, mask, scale):
        b, _, sq, sk = x.shape
        ops = _ops("megatron/scaled_masked_softmax")
        if mask is None:
            m = torch.zeros(1, 1, sq, sk, dtype=torch.bool, device=x.device)
        else:
            m = mask.expand(mask.shape[0], 1, sq, sk).contiguous()
        y = ops.scaled_masked_softmax_forward(x.contiguous(), m, float(scale))
        if mask is not None:
            # the copy gives a fully masked row 1/sk; we give zeros (and so zero gradient, as dx = s*y*(...))
            y.masked_fill_(m.all(dim=-1, keepdim=True), 0.0)
        ctx.save_for_backward(y)
        ctx.save_for_forward(y)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True (see PipegooseSoftmaxFunction)
            return softmax_reference_backward(dy, y, ctx.scale), None, None
        ops = _ops("megatron/scaled_masked_softmax")
        dx = ops.scaled_masked_softmax_backward(dy.contiguous(), y, float(ctx.scale))
        return dx, None, None

    @staticmethod
    def jvp(ctx, dx, *_):
        # symmetric Jacobian (ReferenceSoftmaxFunction): the backward kernel gives the tangent
        (y,) = ctx.saved_tensors
        return _ops("megatron/scaled_masked_softmax").scaled_masked_softmax_backward(dx.contiguous(), y,
                                                                                      float(ctx.scale))


class MegatronScaledUpperTriangMaskedSoftmaxFunction(torch.autograd.Function):
    """megatron/scaled_upper_triang_masked_softmax: x [attn_batches, sq, sq], causal including the diagonal."""

    @staticmethod
    def forward(ctx, x, scale):
        ops = _ops("megatron/scaled_upper_triang_masked_softmax")
        y = ops.scaled_upper_triang_masked_softmax_forward(x.contiguous(), float(scale))
        ctx.save_for_backward(y)
        ctx.save_for_forward(y)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True (see PipegooseSoftmaxFunction)
            return softmax_reference_backward(dy, y, ctx.scale), None
        ops = _ops("megatron/scaled_upper_triang_masked_softmax")
        return ops.scaled_upper_triang_masked_softmax_backward(dy.contiguous(), y, float(ctx.scale)), None

    @staticmethod
    def jvp(ctx, dx, *_):
        # symmetric Jacobian (ReferenceSoftmaxFunction): the backward kernel gives the tangent
        (y,) = ctx.saved_tensors
        ops = _ops("megatron/scaled_upper_triang_masked_softmax")
        return ops.scaled_upper_triang_masked_softmax_backward(dx.contiguous(), y, float(ctx.scale))


# ---------------------------------------------------------------------------------------------------------------
# Entry points used by functional.py

def softmax_out_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype F.softmax returns for ``x`` under the current autocast state (fp32 under CUDA autocast)."""
    dev = x.device
    return torch_result_dtype("softmax", dev, (x.dtype,),
                              lambda d: F.softmax(torch.zeros(1, 2, dtype=d, device=dev), dim=-1), x.dtype)


def fold_scale(x: torch.Tensor, scale: Any) -> tuple[torch.Tensor, float]:
    """``(x, check_scale(scale))``; or, for a 0-d tensor ``scale`` that carries a derivative (it requires grad while
    grad mode is on: a learnable temperature; a dual tensor of ``torch.autograd.forward_ad``; a tensor of a
    ``torch.func`` transform: ``vmap``, ``jvp``, ``grad``), ``(x * scale, 1.0)``: softmax(scale * x) with the
    derivative reaching ``scale`` through the product, rounded once in ``x``'s dtype as ``F.softmax(x * scale)``
    rounds it. The value of a transform's tensor is not read (it has none to read: a batch under vmap).

    (Reviews: session 60, the scale was taken as a float and its gradient silently lost; session 61, so was its
    forward-mode derivative, and vmap over it failed with "a 0-d tensor without a value".)

    Raises:
        TypeError, ValueError: as :func:`check_scale`.
    """
    if isinstance(scale, torch.Tensor) and ((scale.requires_grad and torch.is_grad_enabled()) or in_transform(scale)
                                            or has_tangent(scale)):
        if in_transform(scale):
            check_scale_type(scale)
        else:
            check_scale(scale)   # (its value too: finite)
        return x * scale, 1.0
    return x, check_scale(scale)


def check_scale_type(scale: Any) -> None:
    """Raise TypeError unless ``scale`` is a Python int or float, a numpy integer or floating scalar, or a 0-d real
    tensor (what the norms take for ``eps``; not a bool). Its value is not read (:func:`check_scale` reads it)."""
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return   # (first: the getattr below broke a compiled graph, as python_finite says)
    kind = getattr(getattr(scale, "dtype", None), "kind", None)  # numpy scalars: "i", "u" or "f"
    ok = ((isinstance(scale, (int, float)) and not isinstance(scale, bool))
          or (kind in ("i", "u", "f") and getattr(scale, "ndim", 1) == 0)
          or (isinstance(scale, torch.Tensor) and scale.dim() == 0 and not scale.is_complex()
              and scale.dtype != torch.bool))
    if not ok:
        raise TypeError(f"scale: expected a number, got {scale!r} ({type(scale).__name__})")


def check_scale(scale: Any) -> float:
    """``scale`` as a float (:func:`check_scale_type`'s kinds). Raises TypeError for anything else, ValueError for a
    non-finite value."""
    check_scale_type(scale)
    if isinstance(scale, (int, float)):
        if not python_finite(scale):
            raise ValueError(f"scale: expected a finite number, got {scale}")
        return scale if torch.compiler.is_compiling() else float(scale)
    if isinstance(scale, torch.Tensor):
        try:
            scale = scale.detach().item()
        except RuntimeError:  # a meta or fake tensor holds no value
            raise TypeError(f"scale: expected a number, got a 0-d tensor without a value "
                            f"(device {scale.device})") from None
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite number, got {scale}")
    return scale


def nested_with_mask(causal: bool) -> TypeError:
    """The error for a nested ``x`` given a mask (or the causal one): the scaled softmaxes take nested tensors without
    a mask only (``F.softmax(x * scale, -1)``)."""
    return TypeError(f"x: a nested tensor is taken without a mask only (scaled_softmax, or scaled_masked_softmax with "
                     f"mask None); {'a causal' if causal else 'a'} mask was given")


def check_input(x: Any, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating point tensor, got {dtype_name(x.dtype)}")
    check_input_dtype(x, name)


def check_mask(mask: Any, x: torch.Tensor) -> torch.Tensor:
    """Validate a mask for a 4-D ``x`` [b, np, sq, sk]: bool (or uint8, nonzero = masked), broadcastable as
    [b or 1, np or 1, sq or 1, sk], same device. Returns it as bool."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask: expected a bool torch.Tensor (True = masked) or None, got {type(mask).__name__}")
    if mask.dtype == torch.uint8:
        mask = mask != 0
    elif mask.dtype != torch.bool:
        hint = ("convert additive float masks at the model boundary" if mask.is_floating_point()
                else "pass mask != 0 for an integer mask whose nonzero entries are masked")
        raise TypeError(f"mask: expected dtype bool (True = masked) or uint8, got {dtype_name(mask.dtype)}; {hint}")
    if mask.device != x.device:
        raise ValueError(f"mask: on {mask.device}, expected the input's device {x.device}")
    if mask.dim() != 4:
        raise ValueError(f"mask: expected 4 dims [b or 1, np or 1, sq or 1, sk] (sk={x.shape[3]}), got "
                         f"{mask.dim()}-D shape {list(mask.shape)}: add the missing leading dims (mask[None] ...), "
                         f"PyTorch's right-aligned broadcasting is not applied")
    if any(m not in (1, s) for m, s in zip(mask.shape, x.shape)) or mask.shape[3] != x.shape[3]:
        raise ValueError(f"mask: expected shape [b or 1, np or 1, sq or 1, sk] = broadcastable to "
                         f"{list(x.shape)} with sk={x.shape[3]}, got {list(mask.shape)}")
    return mask


def _signature(x: torch.Tensor, mask: torch.Tensor | None, *rest: Any) -> tuple | None:
    """The call's metadata for the choice cache (dispatch.choice_key), or None when it cannot be cached."""
    if torch.compiler.is_compiling():
        return None
    try:
        if mask is not None and in_transform(mask):  # a mask under vmap: the kernels decline it (x: data_ptr raises)
            return None
        sig = (type(x), x.dtype, x.device, x.shape, x.stride(), x.data_ptr() % 16 == 0, x.requires_grad,
               param_signature(mask), torch.is_grad_enabled(), autocast_state(x.device)) + rest
        hash(sig)
    except (AttributeError, TypeError, RuntimeError):  # RuntimeError: data_ptr of a tensor without storage
        return None
    return sig


def _choose(op: str, x: torch.Tensor, mask: torch.Tensor | None, scale: float, impl: str | None, exact: bool,
            last_dim: bool, sig_rest: tuple) -> tuple[dispatch.Choice, torch.Tensor]:
    """(choice, x in the compute dtype: cast as autocast would, fp32 for softmax under CUDA autocast)."""
    sig = _signature(x, mask, op, scale, exact, last_dim)
    key = None if sig is None else dispatch.choice_key(op, impl, sig + sig_rest)
    hit = None if key is None else dispatch.cached_choice(key)
    if hit is None:
        out = softmax_out_dtype(x)
        xin = x if out == x.dtype else x.to(out)
        hit = (dispatch.choose(op, softmax_problem(op, xin, mask, scale, exact=exact, last_dim=last_dim), impl), out)
        if key is not None:
            dispatch.remember_choice(key, hit)
    else:
        xin = x if hit[1] == x.dtype else x.to(hit[1])
    dispatch.record(hit[0])
    return hit[0], xin


def run(op: str, x: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool,
        impl: str | None, exact: bool = False) -> torch.Tensor:
    """Choose and run an implementation of a scaled (masked/causal) softmax over the last dim of ``x``. A nested
    ``x`` runs PyTorch's ops (``F.softmax(x * scale, -1)``) where there is no mask and no causal mask, and is refused
    otherwise (TypeError naming ``x``)."""
    if getattr(x, "is_nested", False):   # (it crashed in the dispatcher: "NestedTensorImpl doesn't support sizes")
        if mask is not None or causal:
            raise nested_with_mask(causal)
        if not torch.compiler.is_compiling():   # (the counters' lock broke the compiled graph: a review)
            dispatch.record(nested_fallback(op, impl))
        return F.softmax(x if scale == 1.0 else x * scale, -1)
    if dispatch.compile_passthrough(op, impl):  # torch.compile fuses the reference itself
        kind, autocast_on, _ = autocast_state(x.device)
        if not autocast_on:
            return ReferenceSoftmaxFunction.apply(x, mask, scale, causal)
        # the output dtype F.softmax has under autocast, without the measured rule (softmax_out_dtype), whose cache and
        # lock break the graph: fp32 for 16-bit input under CUDA autocast (softmax is on its fp32 list), else x's
        out = torch.float32 if kind == "cuda" and x.dtype in HALF_DTYPES else x.dtype
        return call_without_autocast(x.device, ReferenceSoftmaxFunction.apply, x.to(out), mask, scale, causal)
    choice, x = _choose(op, x, mask, scale, impl, exact, True, (causal,))
    return call_without_autocast(x.device, _run_choice, choice.impl, x, mask, scale, causal)


def _run_choice(impl: str, x: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool) -> torch.Tensor:
    if impl == "pipegoose":
        return PipegooseSoftmaxFunction.apply(x, mask, scale, causal)
    if impl == "megatron":
        if causal:
            return MegatronScaledUpperTriangMaskedSoftmaxFunction.apply(x, scale)
        return MegatronScaledMaskedSoftmaxFunction.apply(x, mask, scale)
    if not has_storage(x):  # inside a torch.func transform (see softmax_reference_forward)
        return softmax_reference_forward(x, mask, scale, causal)
    return ReferenceSoftmaxFunction.apply(x, mask, scale, causal)


def run_plain(x: torch.Tensor, dim: int, dtype: torch.dtype | None, impl: str | None) -> torch.Tensor:
    """``F.softmax(x, dim, dtype=dtype)``, fused where the fused result is allclose to it (fp32, last dim)."""
    if dtype is not None:
        x = x.to(dtype)
    nd = max(x.dim(), 1)
    dim = int_value(dim, "dim")  # int, numpy integers, 0-d integer tensors; not a bool (told apart by type: a review)
    if not -nd <= dim < nd:
        raise IndexError(f"dim: expected in [{-nd}, {nd - 1}], got {dim}")
    if dispatch.compile_passthrough(OP_PLAIN, impl):
        return F.softmax(x, dim)  # torch.compile fuses it itself
    if x.is_nested:
        dispatch.record(nested_fallback(OP_PLAIN, impl))
        return F.softmax(x, dim)
    last = x.dim() == 0 or dim % nd == nd - 1
    choice, x = _choose(OP_PLAIN, x, None, 1.0, impl, True, last, ())
    if choice.impl == "pipegoose":
        y = call_without_autocast(x.device, PipegooseSoftmaxFunction.apply, x, None, 1.0, False)
        # F.softmax gives NaN for a row of all -inf; keep that (a fused kernel may give zeros there)
        return y.masked_fill(y.detach().sum(dim=-1, keepdim=True) == 0, float("nan"))
    return call_without_autocast(x.device, F.softmax, x, dim)
