"""Fused linear cross-entropy: a language model's output projection and its loss, chunk by chunk over the rows, so
that the [N, V] logits of the whole batch and their gradient never exist at once (op ``fused_linear_cross_entropy``).

Semantics: ``F.cross_entropy(F.linear(hidden, weight, bias).float(), target, ignore_index=..., reduction=...)``, what
transformers' causal-LM loss computes from ``lm_head``'s output: the logits in the weight's dtype, the loss in fp32.
The fused path computes, per chunk of rows, the chunk's logits (one GEMM, in the weight's dtype, as ``lm_head``),
their loss and log-sum-exp with the cross-entropy kernel (fp32 math), the logits' gradient at once (the kernel's
backward, scaled by 1 / count for the mean, known before the backward runs), and from it the chunk's gradients of the
hidden states (one GEMM) and of the weight (one GEMM accumulated over the chunks) and bias. The backward only scales
them by the loss's upstream gradient. Peak memory: one chunk's logits ([chunk_rows, V], over which the kernel writes
their gradient: ``cross_entropy_backward_``) and the gradients of hidden and weight, where the unfused path keeps the
[N, V] logits, their fp32 copy and the fp32 gradient; the backward scales the gradients in place and hands them to
autograd without keeping them (no second copy of the weight's [V, H] gradient), so a second backward through a
retained graph raises RuntimeError (Liger-Kernel 0.8.5 scales its saved gradients in place too where the upstream
gradient is not 1, and a second backward there scales them again: read in its fused_linear_cross_entropy.py). The
gradients are kept on ``ctx``, not saved with ``save_for_backward``: saved-tensor hooks (``save_on_cpu`` offloading,
checkpointing's packing) do not see them, and they stay on the device from the forward to the backward.

Precision against the unfused path: the same logits; the logits' gradient rounded once to their dtype, as there, but
before the loss's upstream gradient is known (the unfused path multiplies first), so a loss scaler's factor (AMP's
GradScaler) does not reach it: in fp16 the mean's gradient is therefore computed at the sum's scale and divided by the
count in the backward (p / count underflows fp16, p alone does not); bf16 and fp32 have the range for 1 / count. The
weight's gradient is accumulated over the chunks in the weight's dtype (a GEMM with beta = 1: one rounding per chunk,
where the unfused path rounds once), the bias's in fp32.

Implementations (op ``fused_linear_cross_entropy``): ``pipegoose`` (cuBLAS through ``torch.mm`` for the GEMMs and
pipegoose/kernels/csrc/cross_entropy.cu for the loss, this project, MIT) and ``torch`` (the unfused expression).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from .. import dispatch
from ..dispatch import Implementation, Problem
from . import cross_entropy as _ce
from ._common import (INT32_MAX, all_have_storage, autocast_state, call_without_autocast, check_float_tensor,
                      dtype_name, has_tangent, int_value, kernel_input_ok, needs_grad)

OP = "fused_linear_cross_entropy"
SRC_PIPEGOOSE = ("pipegoose/cross_entropy: pipegoose/kernels/csrc/cross_entropy.cu (pipegoose, MIT), per chunk of "
                 "rows, between cuBLAS GEMMs (torch.mm)")
REDUCTIONS = ("mean", "sum")
FORWARD_AD_FLCE = ("a dual tensor (torch.autograd.forward_ad): the fused path has no forward derivative (jvp); "
                   "PyTorch's ops have")


def check_args(hidden: Any, weight: Any, target: Any, bias: Any, ignore_index: Any, reduction: Any,
               chunk_rows: Any) -> int:
    """Check the arguments (errors name the argument); returns ``ignore_index`` as an int.

    Raises:
        TypeError: ``hidden`` or ``weight`` (or ``bias``, when given) not a floating point tensor of
            fp32/fp16/bf16/fp64; ``target`` not a tensor; ``ignore_index`` or ``chunk_rows`` not an integer.
        ValueError: ``reduction`` not ``mean`` or ``sum``; ``weight`` not 2-D [V, H] with H = ``hidden``'s last dim;
            ``bias`` not [V]; ``target``'s element count not ``hidden``'s rows; a tensor on another device than
            ``hidden``; ``chunk_rows`` below 1.
    """
    for name, t in (("hidden", hidden), ("weight", weight)) + ((("bias", bias),) if bias is not None else ()):
        check_float_tensor(t, name)
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target: expected a torch.Tensor of class indices, got {type(target).__name__}")
    ignore_index = int_value(ignore_index, "ignore_index")
    if chunk_rows is not None and int_value(chunk_rows, "chunk_rows") < 1:
        raise ValueError(f"chunk_rows: expected a positive number of rows, got {chunk_rows}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {', '.join(REDUCTIONS)}, got {reduction!r} (per-row losses: "
                         f"cross_entropy on the logits)")
    if hidden.dim() < 1:
        raise ValueError("hidden: expected [..., H] hidden states, got a 0-dim tensor")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight: expected [V, {hidden.shape[-1]}] (the output projection of hidden states of size "
                         f"{hidden.shape[-1]}), got shape {list(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias: expected [{weight.shape[0]}] (one per class), got shape {list(bias.shape)}")
    rows = hidden.numel() // hidden.shape[-1] if hidden.shape[-1] else math.prod(hidden.shape[:-1])
    if target.numel() != rows:
        raise ValueError(f"target: expected {rows} class indices (one per row of hidden, shape "
                         f"{list(hidden.shape[:-1])}), got shape {list(target.shape)}")
    for name, t in (("weight", weight), ("target", target)) + ((("bias", bias),) if bias is not None else ()):
        if t.device != hidden.device:
            raise ValueError(f"{name}: on {t.device}, expected hidden's device {hidden.device}")
    return ignore_index


def problem(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None) -> Problem:
    """The dispatcher's description of one call (metadata only); ``cols`` is the number of classes V."""
    rows = target.numel()
    return Problem(OP, hidden.dtype, hidden.device, cols=weight.shape[0] if weight.dim() == 2 else None,
                   needs_grad=needs_grad(hidden, weight, bias),
                   extra=dict(rows=rows, hidden_size=hidden.shape[-1] if hidden.dim() else None,
                              weight_dtype=weight.dtype, bias_dtype=None if bias is None else bias.dtype,
                              target_dtype=target.dtype, numel=rows * (weight.shape[0] if weight.dim() == 2 else 0),
                              storage=all_have_storage(hidden, weight, target, bias),
                              forward_ad=has_tangent(hidden, weight, bias)))


def _explain(hidden, weight, target, bias=None, ignore_index=-100, reduction="mean", chunk_rows=None):
    check_args(hidden, weight, target, bias, ignore_index, reduction, chunk_rows)
    hidden, weight, bias = _compute_dtype(hidden, weight, bias)
    return problem(hidden, weight, target, bias)


def _pipegoose_supports(p: Problem) -> tuple[bool, str]:
    ok, why = kernel_input_ok(p, FORWARD_AD_FLCE, "hidden")
    if not ok:
        return ok, why
    for name in ("weight", "bias"):
        dt = p[f"{name}_dtype"]
        if dt is not None and dt != p.dtype:
            return False, (f"{name} {dtype_name(dt)} with hidden {dtype_name(p.dtype)}: the fused path takes one "
                           f"dtype (F.linear's rule)")
    if p["target_dtype"] != torch.int64:
        return False, f"target {dtype_name(p['target_dtype'])}: the kernel takes int64 class indices"
    if p["numel"] == 0 or p["hidden_size"] == 0:
        return False, "an empty input" if p["numel"] == 0 else "hidden size 0 (logits of the bias alone)"
    if p.cols > INT32_MAX:
        return False, f"{p.cols} classes: more than the kernel's launch covers"
    return True, ""


dispatch.register(Implementation(OP, "pipegoose", "ours", _pipegoose_supports, ("pipegoose/cross_entropy",),
                                 SRC_PIPEGOOSE))
dispatch.register(Implementation(OP, "torch", "reference", lambda p: (True, ""), (),
                                 "PyTorch: F.cross_entropy(F.linear(hidden, weight, bias).float(), target)"))
dispatch.register_problem(OP, _explain)


def reference(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
              ignore_index: int, reduction: str) -> torch.Tensor:
    """The unfused path: ``F.cross_entropy(F.linear(hidden, weight, bias).float(), target)`` (fp64 logits as they
    are), the logits flattened to [N, V] and ``target`` to [N]."""
    # (F.linear of hidden as given, the expression's own rounding for any layout; then [N, V], also for H or V 0)
    logits = F.linear(hidden, weight, bias).reshape(math.prod(hidden.shape[:-1]), weight.shape[0])
    x = logits if logits.dtype == torch.float64 else logits.float()
    return F.cross_entropy(x, target.reshape(-1), ignore_index=ignore_index, reduction=reduction)


MIN_CHUNK_ROWS = 2048
CHUNK_ELEMENTS = 1 << 27


def default_chunk_rows(rows: int, vocab: int, hidden_size: int) -> int:
    """Rows per chunk: the largest power of two whose logits hold at most :data:`CHUNK_ELEMENTS` values (2**27: a
    chunk's logits, and then their gradient in the same buffer, take 256 MiB in 16-bit), but at least
    :data:`MIN_CHUNK_ROWS` and at most ``rows``. Each chunk reads and writes the weight's whole gradient once (its
    GEMM accumulates into it), 4 V H bytes in 16-bit against the chunk's 6 C H V flops, so fewer, larger chunks are
    faster (``hidden_size`` does not change that ratio). On the H200 (``python -m benchmarks.linear_cross_entropy``,
    session 51), bf16, 8192 rows: Llama-1.1B's head (H 2048, V 32000) took 5.43 / 5.03 / 4.74 / 4.74 ms at 1024 /
    2048 / 4096 / 8192 rows per chunk, Llama-3-8B's (4096, 128256) 42.6 / 41.1 / - / 40.2 ms, Qwen2-0.5B's (896,
    151936) 12.5 / 12.2 / - / 12.7 ms; the Llama-1.1B training step ran as fast with 2048 as with 4096 rows (72.5k
    tokens/s) and slower with 8192 (71.9k, 0.5 GiB more)."""
    del hidden_size
    fit = max(1, CHUNK_ELEMENTS // max(1, vocab))
    return min(max(rows, 1), max(MIN_CHUNK_ROWS, 1 << (fit.bit_length() - 1)))


class PipegooseLinearCrossEntropyFunction(torch.autograd.Function):
    """The fused path (see the module): forward computes the loss and the gradients, backward scales the gradients by
    the loss's upstream gradient. hidden [N, H], weight [V, H], bias [V] or None, one dtype; target int64 [N]. Not
    twice differentiable: a backward with ``create_graph=True`` raises RuntimeError."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ignore_index, mean, chunk_rows, grad_mode):
        ops = _ce._ops()
        n = hidden.shape[0]
        # (needs_input_grad says True under no_grad / inference_mode too: the caller's grad mode decides)
        need_h, need_w, need_b = (flag and grad_mode for flag in ctx.needs_input_grad[:3])
        need_b = need_b and bias is not None
        count = (target != ignore_index).sum()
        # the logits' gradient per row: 1 / count for the mean (0 / 0 rows are ignored ones: never read), 1 for the sum.
        # fp16 computes the mean's at the sum's scale and divides in the backward, together with the upstream
        # gradient: p / count underflows fp16 (3e-5 / 1024 is below its smallest subnormal) before a loss scaler's
        # factor could lift it, where the unfused path scales first and rounds after
        one = torch.ones((), device=hidden.device, dtype=torch.float32)
        fold = mean and hidden.dtype == torch.float16
        scale = one / count if mean and not fold else one
        # (every row ignored: the gradients are zeros, as on the path that scales in the forward)
        ctx.post = torch.where(count > 0, one / count, 0.0) if fold else None
        total = torch.zeros((), device=hidden.device, dtype=torch.float64)
        grad_h = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_h else None
        # (the first chunk's GEMM writes grad_w, the others accumulate into it: no zero fill, one read fewer)
        grad_w = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_w else None
        grad_b = torch.zeros(weight.shape[0], device=hidden.device, dtype=torch.float32) if need_b else None
        for lo in range(0, n, chunk_rows):
            hi = min(n, lo + chunk_rows)
            h, t = hidden[lo:hi], target[lo:hi]
            logits = F.linear(h, weight, bias)
            rows, lse = ops.cross_entropy_forward(logits, t, ignore_index)
            total += rows.sum(dtype=torch.float64)
            if need_h or need_w or need_b:
                # the logits' gradient written over the logits: one [C, V] buffer per chunk, not two
                ops.cross_entropy_backward_(scale.expand(hi - lo), logits, t, lse, ignore_index)
                g, logits = logits, None
                if need_h:
                    torch.mm(g, weight, out=grad_h[lo:hi])
                if need_w:
                    if lo == 0:
                        torch.mm(g.t(), h, out=grad_w)
                    else:
                        grad_w.addmm_(g.t(), h)
                if need_b:
                    grad_b += g.sum(0, dtype=torch.float32)
                del g
            # (freed before the next chunk's are allocated: at most one chunk's logits, or their gradient, at once)
            logits = None
        loss = (total / count if mean else total).float()
        # (on ctx, not save_for_backward: the backward scales them in place and lets them go)
        ctx.grads = (grad_h, grad_w, grad_b)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if torch.is_grad_enabled():
            # create_graph=True: the gradients were computed in the forward, from tensors not saved, so they have no
            # graph to differentiate; said here rather than returning gradients that silently have none
            raise RuntimeError("fused_linear_cross_entropy: the fused path is not twice differentiable (a backward "
                               "with create_graph=True); for second derivatives (a gradient penalty, a Hessian-vector "
                               "product) call it with impl='torch'")
        if ctx.grads is None:
            raise RuntimeError("fused_linear_cross_entropy: a second backward through the same graph on the fused "
                               "path (after a backward with retain_graph=True, or a second call of backward): its "
                               "first backward scaled the gradients it computed in the forward in place and handed "
                               "them over, so none are left. Compute the loss again, or take the unfused path: "
                               "impl='torch', or PIPEGOOSE_IMPL_FUSED_LINEAR_CROSS_ENTROPY=torch (also for a model "
                               "fused with ops=[..., 'linear_cross_entropy'])")
        grad_h, grad_w, grad_b = ctx.grads
        ctx.grads = None
        g = grad_loss.float() if ctx.post is None else grad_loss.float() * ctx.post
        # in place (a 0-dim fp32 factor keeps each gradient's dtype, with the bits of the out-of-place product), and
        # no reference kept: autograd takes each tensor as the parameter's .grad, without the copy that an
        # out-of-place product, or a reference kept for a second backward, would cost (the weight's gradient is
        # [V, H]: 1 GiB for Llama-3-8B's head in bf16)
        for t in (grad_h, grad_w, grad_b):
            if t is not None:
                t.mul_(g)
        return (grad_h, grad_w, None if grad_b is None else grad_b.to(ctx.bias_dtype), None, None, None, None, None)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """The tensors as ``F.linear`` would multiply them: cast to autocast's dtype where autocast is on for their device
    (it casts F.linear's inputs), else as they are."""
    _, enabled, dt = autocast_state(hidden.device)
    if not enabled or hidden.dtype == torch.float64:
        return hidden, weight, bias
    cast = (lambda t: t if t is None or t.dtype == dt else t.to(dt))
    return cast(hidden), cast(weight), cast(bias)


def _run_pipegoose(hidden, weight, target, bias, ignore_index, reduction, chunk_rows):
    h = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1)
    rows = default_chunk_rows(h.shape[0], weight.shape[0], h.shape[1]) if chunk_rows is None else chunk_rows
    return PipegooseLinearCrossEntropyFunction.apply(h, weight, bias, t, ignore_index, reduction == "mean", rows,
                                                     torch.is_grad_enabled())


def run(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
        ignore_index: int, reduction: str, chunk_rows: int | None, impl: str | None) -> torch.Tensor:
    """:func:`pipegoose.nn.fusion.functional.fused_linear_cross_entropy` behind the checks.

    Raises:
        TypeError, ValueError: as :func:`check_args`; ``impl`` naming no implementation of the op.
        FusionFallbackError: in strict mode, where the fused path cannot take the input.
    """
    ignore_index = check_args(hidden, weight, target, bias, ignore_index, reduction, chunk_rows)   # (compiled too)
    hidden, weight, bias = _compute_dtype(hidden, weight, bias)   # (compiled too: a fp64 weight under autocast failed)
    if dispatch.compile_passthrough(OP, impl):
        return call_without_autocast(hidden.device, reference, hidden, weight, target, bias, ignore_index, reduction)
    choice = dispatch.select(OP, problem(hidden, weight, target, bias), impl)
    if choice.impl == "pipegoose":
        return call_without_autocast(hidden.device, _run_pipegoose, hidden, weight, target, bias, ignore_index,
                                     reduction, chunk_rows)
    return call_without_autocast(hidden.device, reference, hidden, weight, target, bias, ignore_index, reduction)
