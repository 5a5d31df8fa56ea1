"""Multi-tensor optimizer ops: Adam/AdamW step and the L2 norm + scale of gradient clipping.

Ops (dispatch names) and implementations:

* ``adam`` (one call per bucket of tensors sharing device, dtypes and step):
  ``pipegoose`` - ours, ``pipegoose/kernels/csrc/multi_tensor_adam.cu`` (op ``pipegoose::adam_step``): fp32 math,
  one rounding of each stored value; grads, params and both moments in one dtype (fp32, fp16, bf16); contiguous;
  64-bit offsets; any number of tensors (384 per launch).
  ``apex`` - Apex ``amp_C.multi_tensor_adam`` copy in ColossalAI 0.5.0
  ``extensions/csrc/kernel/cuda/multi_tensor_adam_kernel.cu`` (+ ``multi_tensor_apply.cuh``), Apache-2.0 (Apex
  BSD-3 notice): fp32 math; grads one dtype, params/exp_avg/exp_avg_sq one dtype (fp32/fp16/bf16, the fp16-bf16
  cross pairs excepted); contiguous; 32-bit sizes.
  ``deepspeed`` - DeepSpeed 0.19.8 ``csrc/adam/multi_tensor_adam.cu`` (adapted from Apex), Apache-2.0: fp32 math;
  grads, params and both moments in one dtype; 64-bit indexing.
  ``torch_fused`` - PyTorch's own fused kernels, ``torch._fused_adamw_`` / ``torch._fused_adam_``
  (``aten/src/ATen/native/cuda/FusedAdamWKernel.cu`` / ``FusedAdamKernel.cu`` of the installed torch; what
  ``torch.optim.AdamW(fused=True)`` runs): fp32 math; grads, params and both moments in one dtype (fp32, fp16, bf16,
  fp64); contiguous; bias correction always on (``bias_correction=False`` is declined). CUDA tensors only, as every
  implementation here but ``torch`` (torch has a CPU fused kernel too; on the CPU FusedAdam runs the reference, which
  equals torch.optim.AdamW's default path).
  ``torch`` - ``torch.optim.adam.adam`` (the functional math of torch.optim.Adam/AdamW; own ``torch._foreach``
  math when ``bias_correction=False``, which torch does not offer).
* ``clip_grad_norm`` (one call per device and dtype): ``pipegoose`` - ours,
  ``pipegoose/kernels/csrc/clip_grad_norm.cu`` (ops ``pipegoose::multi_tensor_norm`` and
  ``pipegoose::multi_tensor_mul_``): fp32, fp16 and bf16; norm_type 1, 2 or inf; contiguous plain tensors whose
  memory does not overlap (as for ``apex``); 64-bit offsets; no host sync (the coefficient stays on the device, and
  the scaling pass returns at once when it is 1). First in the built-in order: a clipping step on an H100 (session
  56, ``benchmarks.optimizers``, geometric mean over 103M, 308M and 976M parameters) ran at 90% of copy in bf16 and
  94% in fp32, against ``torch._foreach_norm``'s 69% and 85% and the Apex copies' 82% (fp32). ``apex`` -
  ``multi_tensor_l2norm`` + ``multi_tensor_scale`` copies in ColossalAI 0.5.0
  ``extensions/csrc/kernel/cuda/multi_tensor_{l2norm,scale}_kernel.cu``, Apache-2.0:
  fp32 and fp16 only (the copies dispatch no bf16), norm_type 2, contiguous, 32-bit sizes, memory not overlapping
  (two blocks would scale a shared element at once). ``torch`` -
  ``torch._foreach_norm`` / ``torch._foreach_mul_``.

Every kernel takes dense (strided) tensors only: a list holding a sparse tensor (any layout but ``torch.strided``, e.g.
the gradient of ``nn.Embedding(sparse=True)``) is declined with that reason, and takes the ``torch`` path, a fallback
(counted, and a FusionFallbackError in strict mode, as for any input no kernel takes).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from .. import dispatch
from ..dispatch import Implementation, Problem
from ._common import FLOAT_DTYPES, INT32_MAX, dtype_name

OP_ADAM, OP_CLIP = "adam", "clip_grad_norm"
CHUNK_SIZE = 2048 * 32  # elements per block-chunk, as Apex's optimizers use
SRC_APEX_ADAM = ("apex/multi_tensor_adam: Apex csrc/multi_tensor_adam.cu via ColossalAI 0.5.0 "
                 "extensions/csrc/kernel/cuda/multi_tensor_adam_kernel.cu, Apache-2.0")
SRC_DS_ADAM = "deepspeed/multi_tensor_adam: DeepSpeed 0.19.8 csrc/adam/multi_tensor_adam.cu, Apache-2.0"
SRC_OURS_ADAM = "pipegoose/multi_tensor_adam: pipegoose pipegoose/kernels/csrc/multi_tensor_adam.cu, MIT"
SRC_TORCH_ADAM = (f"torch._fused_adamw_ / torch._fused_adam_: PyTorch {torch.__version__} "
                  "aten/src/ATen/native/cuda/FusedAdamWKernel.cu / FusedAdamKernel.cu, BSD-3-Clause")
SRC_OURS_CLIP = ("pipegoose/clip_grad_norm: pipegoose pipegoose/kernels/csrc/clip_grad_norm.cu (multi_tensor_norm, "
                 "multi_tensor_mul_), MIT")
SRC_APEX_CLIP = ("apex/multi_tensor_l2norm + apex/multi_tensor_scale: Apex csrc/multi_tensor_{l2norm,scale}_kernel.cu "
                 "via ColossalAI 0.5.0 extensions/csrc/kernel/cuda/, Apache-2.0")

# (grad dtype, param dtype) pairs of the copy's DISPATCH_FLOAT_AND_HALF_FOR_G_P
_APEX_GP = {(torch.float32, torch.float32), (torch.float32, torch.float16), (torch.float16, torch.float32),
            (torch.float16, torch.float16), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
            (torch.bfloat16, torch.bfloat16)}


def _tensors_facts(lists: Sequence[Sequence[torch.Tensor]]) -> dict:
    """Metadata of the lists; ``layout`` is the first layout other than strided (a sparse gradient), else None: such
    a tensor has no strides or data pointer to ask about (``is_contiguous`` raises for sparse CSR)."""
    flat = [t for lst in lists for t in lst]
    layout = next((t.layout for t in flat if t.layout != torch.strided), None)
    return dict(n=len(lists[0]) if lists else 0,
                layout=layout,
                contiguous=layout is None and all(t.is_contiguous() for t in flat),
                same_device=len({t.device for t in flat}) <= 1,
                max_numel=max((t.numel() for t in flat), default=0),
                dtypes=tuple(lst[0].dtype if lst else None for lst in lists),
                uniform=all(len({t.dtype for t in lst}) <= 1 for lst in lists))


def adam_problem(grads, params, exp_avgs, exp_avg_sqs, bias_correction: bool = True) -> Problem:
    """The ``adam`` problem of one bucket. ``cols`` and the fact ``numel`` are the bucket's parameter count (the size
    the benchmarks time an optimizer at, and the tuning rules' ``max_cols`` bound; a bucket of empty parameters is the
    dispatcher's ``empty`` case: no fallback, in strict mode too, as for ``clip_grad_norm``)."""
    facts = _tensors_facts([grads, params, exp_avgs, exp_avg_sqs])
    facts["bias_correction"] = bool(bias_correction)
    facts["numel"] = numel = sum(p.numel() for p in params)
    return Problem(OP_ADAM, params[0].dtype, params[0].device, numel, False, facts)


def clip_problem(grads: Sequence[torch.Tensor], norm_type: float) -> Problem:
    """The ``clip_grad_norm`` problem of one (device, dtype) group; ``cols`` and the fact ``numel`` are its element
    count (a group of empty gradients is the dispatcher's ``empty`` case: no fallback, in strict mode too)."""
    facts = _tensors_facts([grads])
    facts["numel"] = numel = sum(g.numel() for g in grads)
    facts["norm_type"] = float(norm_type)
    # tensor subclasses (DTensor: no storage of their own) cannot go to the kernels, which read the memory directly;
    # nor sparse gradients (no data pointer to compare: the overlap check is for dense plain tensors only)
    facts["plain"] = all(type(g) is torch.Tensor for g in grads)
    facts["overlap"] = _overlap(grads) if facts["plain"] and facts["layout"] is None else None
    return Problem(OP_CLIP, grads[0].dtype, grads[0].device, numel, False, facts)


def _overlap(tensors: Sequence[torch.Tensor]) -> tuple[int, int] | None:
    """The indices of two non-empty tensors whose memory overlaps (a parameter listed twice, views of one buffer that
    share elements), or None. In one launch of a multi-tensor kernel two blocks would scale the shared elements at
    once. (About 100 us for 300 tensors on a slow host; once per clip_grad_norm_ call and group.)"""
    spans = sorted((t.data_ptr(), t.nbytes, i) for i, t in enumerate(tensors))
    end, last = 0, -1
    for begin, nbytes, i in spans:
        if not nbytes:
            continue
        if begin < end:
            return min(i, last), max(i, last)
        if begin + nbytes > end:
            end, last = begin + nbytes, i
    return None


def _clip_lists_ok(p: Problem) -> tuple[bool, str]:
    """:func:`_lists_ok`, then plain tensors whose memory does not overlap."""
    ok, why = _lists_ok(p)
    if not ok:
        return ok, why
    if not p["plain"]:
        return False, "a gradient is a tensor subclass (DTensor, ...): the kernels take plain tensors"
    if p["overlap"] is not None:
        i, j = p["overlap"]
        return False, (f"gradients {i} and {j} of the group overlap in memory (a parameter listed twice?): two blocks "
                       "would scale the shared elements at once")
    return True, ""


def _lists_ok(p: Problem) -> tuple[bool, str]:
    if p.device.type != "cuda":
        return False, f"needs CUDA tensors, got device {p.device}"
    if p["n"] == 0:
        return False, "no tensors"
    if p.get("layout") is not None:
        return False, (f"a tensor has layout {p['layout']} (a sparse gradient): the kernels take dense (strided) "
                       "tensors")
    if not p["same_device"]:
        return False, "tensors on several devices"
    if not p["uniform"]:
        return False, "a tensor list mixes dtypes (the kernels take one dtype per list)"
    if not p["contiguous"]:
        return False, "a tensor is not contiguous"
    return True, ""


def _apex_adam_supports(p: Problem) -> tuple[bool, str]:
    ok, why = _lists_ok(p)
    if not ok:
        return ok, why
    g, par, m, v = p["dtypes"]
    if (g, par) not in _APEX_GP:
        return False, f"grad {dtype_name(g)} with param {dtype_name(par)} not dispatched by the copy"
    if m != par or v != par:
        return False, f"exp_avg/exp_avg_sq dtype {dtype_name(m)}/{dtype_name(v)} != param dtype {dtype_name(par)}"
    if p["max_numel"] > INT32_MAX:
        return False, f"a tensor of {p['max_numel']} elements: the copy keeps 32-bit sizes"
    return True, ""


def _one_dtype(p: Problem, allowed: tuple, why_one: str) -> tuple[bool, str]:
    """:func:`_lists_ok`, then one dtype for grads, params and both moments, among ``allowed``."""
    ok, why = _lists_ok(p)
    if not ok:
        return ok, why
    dts = set(p["dtypes"])
    if len(dts) != 1:
        return False, f"grads, params and moments must share one dtype ({why_one})"
    (d,) = dts
    if d not in allowed:
        return False, f"dtype {dtype_name(d)} not supported ({', '.join(dtype_name(a) for a in allowed)})"
    return True, ""


def _ds_adam_supports(p: Problem) -> tuple[bool, str]:
    return _one_dtype(p, FLOAT_DTYPES + (torch.float64,), "the copy dispatches on one type")


def _pipegoose_adam_supports(p: Problem) -> tuple[bool, str]:
    return _one_dtype(p, FLOAT_DTYPES, "the kernel takes one for the four lists")


def _torch_fused_adam_supports(p: Problem) -> tuple[bool, str]:
    ok, why = _one_dtype(p, FLOAT_DTYPES + (torch.float64,), "the kernel reads every list as the param's")
    if ok and not p.get("bias_correction", True):
        return False, "bias_correction=False: torch's fused kernels always correct the moments' bias"
    if ok and not hasattr(torch, "_fused_adamw_"):
        return False, f"torch {torch.__version__} has no torch._fused_adamw_"
    return ok, why


def _apex_clip_supports(p: Problem) -> tuple[bool, str]:
    ok, why = _clip_lists_ok(p)
    if not ok:
        return ok, why
    if p["norm_type"] != 2.0:
        return False, f"norm_type {p['norm_type']}: the kernel computes the L2 norm only"
    if p.dtype not in (torch.float32, torch.float16):
        return False, f"dtype {dtype_name(p.dtype)}: the copies dispatch float32 and float16 only"
    if p["max_numel"] > INT32_MAX:
        return False, f"a tensor of {p['max_numel']} elements: the copies keep 32-bit sizes"
    return True, ""


def _pipegoose_clip_supports(p: Problem) -> tuple[bool, str]:
    ok, why = _clip_lists_ok(p)
    if not ok:
        return ok, why
    if p["norm_type"] not in (1.0, 2.0, math.inf):
        return False, f"norm_type {p['norm_type']}: the kernel computes the 1, 2 and inf norms"
    if p.dtype not in FLOAT_DTYPES:
        return False, f"dtype {dtype_name(p.dtype)} not supported (float32, float16, bfloat16)"
    return True, ""


dispatch.register(Implementation(OP_ADAM, "pipegoose", "ours", _pipegoose_adam_supports,
                                 ("pipegoose/multi_tensor_adam",), SRC_OURS_ADAM))
dispatch.register(Implementation(OP_ADAM, "apex", "ported", _apex_adam_supports, ("apex/multi_tensor_adam",),
                                 SRC_APEX_ADAM))
dispatch.register(Implementation(OP_ADAM, "deepspeed", "ported", _ds_adam_supports,
                                 ("deepspeed/multi_tensor_adam",), SRC_DS_ADAM))
dispatch.register(Implementation(OP_ADAM, "torch_fused", "native", _torch_fused_adam_supports, (), SRC_TORCH_ADAM))
dispatch.register(Implementation(OP_ADAM, "torch", "reference", lambda p: (True, ""), (), "torch.optim.adam.adam"))
dispatch.register(Implementation(OP_CLIP, "pipegoose", "ours", _pipegoose_clip_supports, ("pipegoose/clip_grad_norm",),
                                 SRC_OURS_CLIP))
dispatch.register(Implementation(OP_CLIP, "apex", "ported", _apex_clip_supports,
                                 ("apex/multi_tensor_l2norm", "apex/multi_tensor_scale"), SRC_APEX_CLIP))
dispatch.register(Implementation(OP_CLIP, "torch", "reference", lambda p: (True, ""), (), "torch._foreach_norm"))


def _tensor_lists(**lists: Any) -> None:
    """explain()'s checks of the optimizer ops' arguments: lists (or tuples) of tensors, not empty, of one length.
    (FusedAdam and clip_grad_norm_ build their lists themselves and call the problem builders directly.)"""
    n = None
    for name, lst in lists.items():
        if isinstance(lst, torch.Tensor) or not isinstance(lst, (list, tuple)):
            raise TypeError(f"{name}: expected a list of tensors (one per parameter), got {type(lst).__name__}")
        if not lst:
            raise TypeError(f"{name}: expected a non-empty list of tensors")
        bad = next((i for i, t in enumerate(lst) if not isinstance(t, torch.Tensor)), None)
        if bad is not None:
            hint = " (a parameter without a gradient: leave it out)" if lst[bad] is None else ""
            raise TypeError(f"{name}[{bad}] is {type(lst[bad]).__name__}: expected a list of tensors{hint}")
        if n is not None and len(lst) != n:
            raise ValueError(f"{name}: {len(lst)} tensors, but grads has {n}; expected one per parameter")
        n = len(lst) if n is None else n


def _explain_adam(grads, params, exp_avgs, exp_avg_sqs, bias_correction: bool = True) -> Problem:
    _tensor_lists(grads=grads, params=params, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs)
    return adam_problem(grads, params, exp_avgs, exp_avg_sqs, bias_correction)


def number(name: str, v) -> float:
    """``float(v)`` for a number, a numeric string such as ``"inf"`` (as torch takes) or a one-element tensor; else a
    TypeError naming the argument."""
    try:
        return float(v)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{name}: expected a number, got {v!r}") from None


def check_norm_type(norm_type: Any) -> float:
    """``norm_type`` of clip_grad_norm_ as a float. Raises TypeError (not a number) or ValueError (nan), naming it."""
    v = number("norm_type", norm_type)
    if math.isnan(v):
        raise ValueError("norm_type: expected a number (inf for the max norm), got nan")
    return v


def _explain_clip(grads, norm_type: float = 2.0) -> Problem:
    _tensor_lists(grads=grads)
    return clip_problem(grads, check_norm_type(norm_type))   # clip_grad_norm_'s checks, with its messages


# explain("adam", grads, params, exp_avgs, exp_avg_sqs[, bias_correction]) and explain("clip_grad_norm", grads
# [, norm_type]): one bucket / one (device, dtype) group, as FusedAdam.step and clip_grad_norm_ ask
dispatch.register_problem(OP_ADAM, _explain_adam)
dispatch.register_problem(OP_CLIP, _explain_clip)


_noop_flags: dict[torch.device, torch.Tensor] = {}


def noop_flag(device: torch.device) -> torch.Tensor:
    """A zeroed int32 [1] flag on ``device`` (the kernels set it on inf/nan; we do not skip on it)."""
    f = _noop_flags.get(device)
    if f is None:
        f = _noop_flags[device] = torch.zeros(1, dtype=torch.int32, device=device)
    else:
        f.zero_()
    return f


def _ops(name: str) -> Any:
    ops, why = dispatch.kernel(name)
    if ops is None:
        raise RuntimeError(why)
    return ops


def adam_step_fused(impl: str, grads, params, exp_avgs, exp_avg_sqs, *, lr: float, beta1: float, beta2: float,
                    eps: float, step: int, adam_w_mode: bool, bias_correction: bool, weight_decay: float) -> None:
    """One Adam/AdamW step over a bucket with the ``pipegoose``, ``apex``, ``deepspeed`` or ``torch_fused`` kernel
    (``step``, the bucket's shared step count, already counted)."""
    dev = params[0].device
    mode = 1 if adam_w_mode else 0
    if impl == "pipegoose":
        _ops("pipegoose/multi_tensor_adam").adam_step(
            list(grads), list(params), list(exp_avgs), list(exp_avg_sqs), float(lr), float(beta1), float(beta2),
            float(eps), int(step), bool(adam_w_mode), bool(bias_correction), float(weight_decay))
    elif impl == "torch_fused":
        if not bias_correction:
            raise ValueError("bias_correction: torch_fused always corrects the bias (its supports() declines False)")
        # the kernel reads each tensor's step from a float32 tensor on the device; the bucket shares one count, so
        # one tensor serves every entry (no host sync: a fill kernel)
        steps = [torch.full((), float(step), dtype=torch.float32, device=dev)] * len(params)
        fn = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
        fn(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), [], steps, lr=float(lr), beta1=float(beta1),
           beta2=float(beta2), weight_decay=float(weight_decay), eps=float(eps), amsgrad=False, maximize=False,
           grad_scale=None, found_inf=None)
    elif impl == "apex":
        _ops("apex/multi_tensor_adam").multi_tensor_adam(
            CHUNK_SIZE, noop_flag(dev), list(grads), list(params), list(exp_avgs), list(exp_avg_sqs), float(lr),
            float(beta1), float(beta2), float(eps), int(step), mode, int(bias_correction), float(weight_decay), -1.0)
    elif impl == "deepspeed":
        _ops("deepspeed/multi_tensor_adam").deepspeed_multi_tensor_adam(
            CHUNK_SIZE, noop_flag(dev), list(grads), list(params), list(exp_avgs), list(exp_avg_sqs), float(lr),
            float(beta1), float(beta2), float(eps), int(step), mode, int(bias_correction), float(weight_decay))
    else:
        raise ValueError(f"impl: expected 'pipegoose', 'apex', 'deepspeed' or 'torch_fused', got {impl!r}")


@torch.no_grad()
def adam_step_reference(grads, params, exp_avgs, exp_avg_sqs, steps: list[torch.Tensor], *,
                        lr: float | torch.Tensor, beta1: float | torch.Tensor, beta2: float | torch.Tensor,
                        eps: float, adam_w_mode: bool, bias_correction: bool, weight_decay: float) -> None:
    """torch.optim.Adam(W)'s functional math; increments the ``steps`` tensors itself, as torch does. ``lr``, and
    ``beta1`` with ``beta2``, 0-d tensors only with ``bias_correction`` (torch's functional takes them, and computes
    with them as tensors)."""
    grads = [g if g.dtype == p.dtype else g.to(p.dtype) for g, p in zip(grads, params)]
    if bias_correction:
        from torch.optim.adam import adam

        adam(list(params), grads, list(exp_avgs), list(exp_avg_sqs), [], list(steps), foreach=None,
             capturable=False, differentiable=False, fused=None, grad_scale=None, found_inf=None,
             has_complex=False, decoupled_weight_decay=adam_w_mode, amsgrad=False, beta1=beta1, beta2=beta2,
             lr=lr, weight_decay=weight_decay, eps=eps, maximize=False)
        return
    for s in steps:
        s += 1
    params, exp_avgs, exp_avg_sqs = list(params), list(exp_avgs), list(exp_avg_sqs)
    if weight_decay != 0:
        if adam_w_mode:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, -lr)


def l2norm_fused(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm (fp32 scalar tensor on the grads' device) with apex/multi_tensor_l2norm."""
    total, _ = _ops("apex/multi_tensor_l2norm").multi_tensor_l2norm(CHUNK_SIZE, noop_flag(grads[0].device),
                                                                     list(grads), False)
    return total.reshape(())


def scale_fused(grads: Sequence[torch.Tensor], scale: float) -> None:
    """grads *= scale in place with apex/multi_tensor_scale (src and dst the same lists, as Apex does)."""
    _ops("apex/multi_tensor_scale").multi_tensor_scale(CHUNK_SIZE, noop_flag(grads[0].device), list(grads),
                                                       list(grads), float(scale))


def norm_ours(grads: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The total ``norm_type`` norm (1, 2 or inf) of a (device, dtype) group as a float32 scalar tensor on its device,
    with ``pipegoose::multi_tensor_norm`` (asynchronous: no host sync)."""
    return _ops("pipegoose/clip_grad_norm").multi_tensor_norm(list(grads), float(norm_type))


def mul_ours(grads: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
    """grads *= coef in place with ``pipegoose::multi_tensor_mul_`` (``coef``: a float32 one-element tensor on the
    grads' device; the kernel reads it there and does nothing when it is 1)."""
    _ops("pipegoose/clip_grad_norm").multi_tensor_mul_(list(grads), coef)
