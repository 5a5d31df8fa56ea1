"""Softmax cross-entropy over class logits: our kernel (per-row loss and log-sum-exp forward, the logits' gradient
backward) with a Python autograd Function, the PyTorch reference, dispatch.

Semantics: ``F.cross_entropy(logits.float(), target, ignore_index=..., reduction=...)`` for 2-D logits ``[N, V]`` and
1-D class indices ``[N]``: what transformers' causal-LM and masked-LM losses compute (they upcast the logits to fp32
first). The loss is fp32 (fp64 for fp64 logits, on the reference path); the logits' gradient is in the logits' dtype.
The kernel computes in fp32 from the stored logits without the fp32 copy: it reads the logits once forward and once
backward and writes their gradient once, where the upcast path writes and reads an fp32 copy, its log-softmax and
their gradients (about 8 passes over 4-byte values instead of 3 over 2-byte ones in bf16).

Implementations (op ``cross_entropy``): ``pipegoose`` (pipegoose/kernels/csrc/cross_entropy.cu, this project, MIT) and
``torch``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .. import dispatch
from ..dispatch import Implementation, Problem
from ._common import (INT32_MAX, all_have_storage, check_float_tensor, kernel_input_ok, call_without_autocast,
                      dtype_name, grads_through, has_tangent, int_value, needs_grad)

OP = "cross_entropy"
SRC_PIPEGOOSE = "pipegoose/cross_entropy: pipegoose/kernels/csrc/cross_entropy.cu (pipegoose, MIT)"
REDUCTIONS = ("mean", "sum", "none")
FORWARD_AD_CE = ("a dual tensor (torch.autograd.forward_ad): the cross-entropy kernel has no forward derivative (jvp); "
                 "PyTorch's op has")


def check_args(logits: Any, target: Any, ignore_index: Any, reduction: Any) -> int:
    """Check the arguments (errors name the argument); returns ``ignore_index`` as an int.

    Raises:
        TypeError: ``logits`` not a floating point tensor of fp32/fp16/bf16/fp64; ``target`` not a tensor;
            ``ignore_index`` not an integer (a Python or numpy one; not a bool).
        ValueError: ``reduction`` not ``mean``, ``sum`` or ``none``; ``target`` on another device than ``logits``.
    """
    check_float_tensor(logits, "logits")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target: expected a torch.Tensor of class indices, got {type(target).__name__}")
    ignore_index = int_value(ignore_index, "ignore_index")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    if target.device != logits.device:
        raise ValueError(f"target: on {target.device}, expected the logits' device {logits.device}")
    return ignore_index


def cross_entropy_problem(logits: torch.Tensor, target: torch.Tensor) -> Problem:
    """The dispatcher's description of one call (metadata only)."""
    return Problem(OP, logits.dtype, logits.device, cols=logits.shape[-1] if logits.dim() else None,
                   needs_grad=needs_grad(logits),
                   extra=dict(shape=tuple(logits.shape), target_shape=tuple(target.shape), target_dtype=target.dtype,
                              numel=logits.numel(), storage=all_have_storage(logits, target),
                              forward_ad=has_tangent(logits),
                              last_dim_contiguous=logits.dim() == 0 or logits.shape[-1] <= 1 or logits.stride(-1) == 1))


def _explain(logits, target, ignore_index=-100, reduction="mean"):
    check_args(logits, target, ignore_index, reduction)
    return cross_entropy_problem(logits, target)


def _pipegoose_supports(p: Problem) -> tuple[bool, str]:
    ok, why = kernel_input_ok(p, FORWARD_AD_CE, "logits")
    if not ok:
        return ok, why
    shape = p["shape"]
    if len(shape) != 2:
        return False, f"logits of shape {list(shape)}: the kernel takes [N, V] (class scores in the last dim)"
    if p["target_dtype"] != torch.int64 or p["target_shape"] != shape[:1]:
        return False, (f"target {dtype_name(p['target_dtype'])} of shape {list(p['target_shape'])}: the kernel takes "
                       f"int64 class indices of shape [{shape[0]}] (not probabilities)")
    if not p["last_dim_contiguous"]:
        return False, "logits' last dim is not contiguous"
    if p["numel"] == 0:
        return False, "an empty input"
    if shape[0] > INT32_MAX:
        return False, f"{shape[0]} rows: more than one launch covers (2^31 - 1)"
    return True, ""


dispatch.register(Implementation(OP, "pipegoose", "ours", _pipegoose_supports, ("pipegoose/cross_entropy",),
                                 SRC_PIPEGOOSE))
dispatch.register(Implementation(OP, "torch", "reference", lambda p: (True, ""), (),
                                 "PyTorch: F.cross_entropy on the logits upcast to fp32"))
dispatch.register_problem(OP, _explain)


def cross_entropy_reference(logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                            reduction: str) -> torch.Tensor:
    """The PyTorch path: ``F.cross_entropy`` on the logits upcast to fp32 (fp64 logits as they are)."""
    x = logits if logits.dtype == torch.float64 else logits.float()
    return F.cross_entropy(x, target, ignore_index=ignore_index, reduction=reduction)


def _ops() -> Any:
    ops, why = dispatch.kernel("pipegoose/cross_entropy")
    if ops is None:
        raise RuntimeError(why)
    return ops


class PipegooseCrossEntropyFunction(torch.autograd.Function):
    """pipegoose/cross_entropy: per-row losses (fp32 [N]) of logits [N, V] and int64 targets [N]; the backward runs
    the backward kernel on the saved logits and log-sum-exps. Double backward: a backward run with grad mode on
    (``create_graph=True``) computes the logits' gradient with PyTorch's formula on the saved logits
    (:func:`._common.grads_through`), differentiable again; without it the kernel runs."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index):
        loss, lse = _ops().cross_entropy_forward(logits, target, ignore_index)
        ctx.save_for_backward(logits, target, lse)
        ctx.ignore_index = ignore_index
        ctx.mark_non_differentiable(lse)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target, lse = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        if torch.is_grad_enabled():  # create_graph=True: a gradient that is differentiable again
            (grad,) = grads_through(lambda x: cross_entropy_reference(x, target, ctx.ignore_index, "none"),
                                    (logits,), (True,), grad_loss)
            return grad, None, None
        return _ops().cross_entropy_backward(grad_loss, logits, target, lse, ctx.ignore_index), None, None


class PipegooseCrossEntropyReducedFunction(torch.autograd.Function):
    """pipegoose/cross_entropy, reduced in the forward's launch: the mean over the rows not ignored (``mean``) or the
    sum of the rows' losses, an fp32 scalar of logits [N, V] and int64 targets [N]. The backward runs the backward
    kernel with the scalar's gradient (divided by the count for the mean) expanded to every row, at stride 0. Double
    backward as :class:`PipegooseCrossEntropyFunction`'s."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, mean):
        out, lse, count = _ops().cross_entropy_forward_reduced(logits, target, ignore_index, mean)
        ctx.save_for_backward(logits, target, lse, count)
        ctx.ignore_index = ignore_index
        ctx.mean = mean
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, target, lse, count = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        if torch.is_grad_enabled():  # create_graph=True (see PipegooseCrossEntropyFunction)
            reduction = "mean" if ctx.mean else "sum"
            (grad,) = grads_through(lambda x: cross_entropy_reference(x, target, ctx.ignore_index, reduction),
                                    (logits,), (True,), grad_out)
            return grad, None, None, None
        g = grad_out.float()
        if ctx.mean:
            g = g / count   # every row ignored: count 0, but then every row's gradient is 0 (the kernel's)
        grad = _ops().cross_entropy_backward(g.expand(logits.shape[0]), logits, target, lse, ctx.ignore_index)
        return grad, None, None, None


# The loss's mean and sum in the forward's launch (cross_entropy_forward_reduced) instead of PyTorch's reductions
# (four more launches) over the per-row losses: on the H200, forward + backward geomean 84 -> 89% of copy in bf16,
# 93 -> 96 in fp32 (session 51, benchmarks/results/.../SUMMARY.md). tests/kernels/test_cross_entropy_cuda.py runs
# both routes whatever this says.
REDUCE_IN_KERNEL = True


def _run_pipegoose(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    if reduction != "none" and REDUCE_IN_KERNEL:
        return PipegooseCrossEntropyReducedFunction.apply(logits, target, ignore_index, reduction == "mean")
    rows = PipegooseCrossEntropyFunction.apply(logits, target, ignore_index)
    if reduction == "none":
        return rows
    total = rows.sum()
    if reduction == "sum":
        return total
    return total / (target != ignore_index).sum()   # no synchronisation; 0 / 0 = nan, as F.cross_entropy's mean


def run(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
        impl: str | None) -> torch.Tensor:
    """:func:`pipegoose.nn.fusion.functional.cross_entropy` behind the checks.

    Raises:
        TypeError, ValueError: as :func:`check_args`; ``impl`` naming no implementation of ``cross_entropy``.
        FusionFallbackError: in strict mode, where the kernel cannot take the input.
    """
    ignore_index = check_args(logits, target, ignore_index, reduction)   # (under torch.compile too: a review)
    if dispatch.compile_passthrough(OP, impl):
        return cross_entropy_reference(logits, target, ignore_index, reduction)
    choice = dispatch.select(OP, cross_entropy_problem(logits, target), impl)
    if choice.impl == "pipegoose":
        return call_without_autocast(logits.device, _run_pipegoose, logits, target, ignore_index, reduction)
    return call_without_autocast(logits.device, cross_entropy_reference, logits, target, ignore_index, reduction)
