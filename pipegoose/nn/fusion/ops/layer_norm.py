"""LayerNorm over the trailing ``normalized_shape``: the fused paths (our op with its C++ autograd, the Apex copy's
autograd Function), the PyTorch reference, dispatch.

Semantics (every implementation): statistics (mean, 1/std) in fp32, biased variance, ``y = (x - mean) * rstd *
weight + bias``; input and parameter dtypes are independent; the output dtype is what ``torch.nn.LayerNorm``
returns under the same dtypes and autocast state: the input's dtype (also for fp16/bf16 input with fp32
parameters), fp32 under CUDA autocast (layer_norm is on autocast's fp32 list there; CPU autocast leaves it alone).
PyTorch rejects fp32 input with fp16/bf16 parameters; here that gives fp32 output (parameters upcast exactly).

Implementations (op ``layer_norm``):

* ``pipegoose`` - pipegoose/kernels/csrc/layer_norm.cu (this project, MIT): any mix of fp32/fp16/bf16 input and
  parameters, output dtype chosen by the caller.
* ``apex`` - Apex's mixed fused LayerNorm (``fused_layer_norm_cuda`` / Megatron's
  ``fused_mix_prec_layer_norm_cuda``), copy in ColossalAI 0.5.0 ``extensions/csrc/kernel/cuda/layer_norm_kernel.cu``,
  Apache-2.0 (Apex BSD-3 notice). It writes its output in gamma's dtype and accepts fp16 input only with fp16
  gamma (bf16 with bf16): fp16 input with fp32 weight (apex#1379) is routed to another implementation instead
  of rounding the weight. Missing weight/bias are passed as exact ones/zeros.
* ``torch`` - ``F.layer_norm`` (parameters upcast exactly where PyTorch needs matching dtypes).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from .. import dispatch
from ..dispatch import Implementation, Problem
from ._common import (FLOAT_DTYPES, HALF_DTYPES, INT32_MAX, all_have_storage, any_in_transform, autocast_state,
                      kernel_input_ok, call_without_autocast, check_float_tensor, check_input_dtype, dtype_name,
                      eps_value, grads_through, has_tangent, hidden_range, in_dual_level, integer_or_none, needs_grad,
                      nested_fallback, param_signature, shape_signature, torch_result_dtype)

OP = "layer_norm"
SRC_PIPEGOOSE = "pipegoose/layer_norm: pipegoose/kernels/csrc/layer_norm.cu (pipegoose, MIT)"
SRC_APEX = ("apex/fused_layer_norm: Apex csrc/layer_norm_cuda_kernel.cu via ColossalAI 0.5.0 "
            "extensions/csrc/kernel/cuda/layer_norm_kernel.cu, Apache-2.0")
# why a kernel declines an input without rows or with a zero-size normalized_shape (empty batch, hidden size 0)
EMPTY_INPUT = "empty input, shape {}: no kernel runs, the reference path returns the empty result"


def _not_a_shape(normalized_shape: Any) -> TypeError:
    # (built where it is raised: under torch.compile the repr of a numpy value in it breaks the graph)
    return TypeError(f"normalized_shape: expected an int or a sequence of ints, got {normalized_shape!r}")


def normalize_shape(normalized_shape: Any) -> tuple[int, ...]:
    """``normalized_shape`` as a tuple of ints: an integer (numpy's too) or a sequence of them, each >= 0. A zero
    size is what F.layer_norm / F.rms_norm take (an empty result); it runs the reference path (the kernels'
    ``supports`` decline an empty input).

    Integers and sequences are told apart by type (:func:`~._common.integer_or_none`), with no TypeError raised and
    caught for a tuple or a list: under torch.compile, torch 2.11's dynamo made that TypeError an internal error and
    the fused norm modules (a tuple shape) did not compile (a review)."""
    # not a tensor: a 0-d tensor is no size here (nor F.layer_norm's); a 1-d one is a sequence of sizes
    size = None if isinstance(normalized_shape, torch.Tensor) else integer_or_none(normalized_shape)
    if size is not None:
        if size < 0:
            raise ValueError(f"normalized_shape: expected a size >= 0, got {size}")
        return (size,)
    if isinstance(normalized_shape, (tuple, list)):   # torch.Size too: the common case, iterated as it is
        items = normalized_shape
    elif isinstance(normalized_shape, (bool, str, bytes)) or not hasattr(normalized_shape, "__iter__"):
        raise _not_a_shape(normalized_shape)
    else:
        try:   # another iterable (a numpy array, a generator): iterating a 0-d array raises
            items = tuple(normalized_shape)
        except TypeError:
            raise _not_a_shape(normalized_shape) from None
    # integers only: 8.5 is an error, not 8, and so is True, not 1
    shape = tuple(integer_or_none(d) for d in items)
    if any(d is None for d in shape):
        raise _not_a_shape(normalized_shape)
    if not shape:
        raise ValueError("normalized_shape: expected at least one dimension, got ()")
    if any(d < 0 for d in shape):
        raise ValueError(f"normalized_shape: expected sizes >= 0, got {list(shape)}")
    return shape


def check_args(x: Any, shape: tuple[int, ...], weight: Any, bias: Any, eps: Any, shapes: bool = True) -> float:
    """Check the arguments (errors name the argument); returns ``eps`` as a float. ``shapes=False`` (under
    ``torch.compile``: ``F.layer_norm`` checks them itself there) leaves out the checks of the shapes against
    ``normalized_shape``, which guarded on a data-dependent value where a size came from numpy (dynamo makes it a
    tensor) and failed the compile."""
    check_float_tensor(x)
    if shapes and (x.dim() < len(shape) or tuple(x.shape[x.dim() - len(shape):]) != shape):
        raise ValueError(f"x: expected shape [*, {', '.join(map(str, shape))}] (normalized_shape={list(shape)}), "
                         f"got {list(x.shape)}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if not isinstance(p, torch.Tensor) or not p.is_floating_point():
            raise TypeError(f"{name}: expected a floating point torch.Tensor or None, got "
                            f"{dtype_name(p.dtype) if isinstance(p, torch.Tensor) else type(p).__name__}")
        check_input_dtype(p, name)
        if shapes and tuple(p.shape) != shape:
            raise ValueError(f"{name}: expected shape {list(shape)} (normalized_shape), got {list(p.shape)}")
        if p.device != x.device:
            raise ValueError(f"{name}: on {p.device}, expected the input's device {x.device}")
    return eps_value(eps)


def out_dtype(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.dtype:
    """What F.layer_norm returns for these dtypes under the current autocast state (input dtype when PyTorch
    rejects the mix)."""
    dev = x.device
    wd = None if weight is None else weight.dtype
    bd = None if bias is None else bias.dtype

    def probe(xd, wd_, bd_):
        w = None if wd_ is None else torch.ones(2, dtype=wd_, device=dev)
        b = None if bd_ is None else torch.zeros(2, dtype=bd_, device=dev)
        return F.layer_norm(torch.zeros(1, 2, dtype=xd, device=dev), (2,), w, b)

    return torch_result_dtype("layer_norm", dev, (x.dtype, wd, bd), probe, x.dtype)


def traced_out_dtype(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.dtype:
    """:func:`out_dtype` where torch.compile traces (the measured rule's cache, lock and caught probe error would break
    the graph): fp32 under CUDA autocast (layer_norm is on its fp32 list: every tensor cast to fp32) unless a tensor is
    fp64 (PyTorch then rejects the mix), else ``x.dtype`` (CPU autocast leaves layer_norm alone)."""
    kind, autocast_on, _ = autocast_state(x.device)
    if autocast_on and kind == "cuda" and all(t is None or t.dtype != torch.float64 for t in (x, weight, bias)):
        return torch.float32
    return x.dtype


def layer_norm_problem(x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor | None,
                       bias: torch.Tensor | None, out: torch.dtype) -> Problem:
    h = math.prod(shape)
    return Problem(OP, x.dtype, x.device, cols=h, needs_grad=needs_grad(x, weight, bias),
                   extra=dict(shape=tuple(x.shape), normalized_shape=shape, hidden=h,
                              rows=x.numel() // h if h else 0, numel=x.numel(),
                              storage=all_have_storage(x, weight, bias), forward_ad=has_tangent(x, weight, bias),
                              weight_dtype=None if weight is None else weight.dtype,
                              bias_dtype=None if bias is None else bias.dtype, out_dtype=out))


def _explain(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    shape = normalize_shape(normalized_shape)
    check_args(x, shape, weight, bias, eps)
    out = out_dtype(x, weight, bias)
    # the problem run() chooses on: x cast to the output dtype first, as autocast does (without copying x here)
    return dataclasses.replace(layer_norm_problem(x, shape, weight, bias, out), dtype=out)


def _common(p: Problem, kernel: str) -> tuple[bool, str]:
    ok, why = kernel_input_ok(p)
    if not ok:
        return ok, why
    if p["rows"] == 0 or p["hidden"] == 0:
        return False, EMPTY_INPUT.format(list(p["shape"]))
    h = p["hidden"]
    hmin, hmax = hidden_range(kernel)
    if not hmin <= h <= hmax:
        return False, f"hidden size {h} outside [{hmin}, {hmax}]"
    return True, ""


def _pipegoose_supports(p: Problem) -> tuple[bool, str]:
    ok, why = _common(p, "pipegoose/layer_norm")
    if not ok:
        return ok, why
    for name in ("weight_dtype", "bias_dtype", "out_dtype"):
        d = p[name]
        if d is not None and d not in FLOAT_DTYPES:
            return False, f"{name.replace('_dtype', '')} dtype {dtype_name(d)} not supported"
    return True, ""


def _apex_supports(p: Problem) -> tuple[bool, str]:
    ok, why = _common(p, "apex/fused_layer_norm")
    if not ok:
        return ok, why
    out = p["out_dtype"]
    if out not in FLOAT_DTYPES:
        return False, f"output dtype {dtype_name(out)} not supported"
    if p.dtype != out and not (p.dtype == torch.float32 and out in HALF_DTYPES):
        return False, (f"input {dtype_name(p.dtype)} with output {dtype_name(out)}: the copy writes its output in "
                       f"the input's dtype for fp16/bf16 input")
    for name in ("weight_dtype", "bias_dtype"):
        d = p[name]
        if d is not None and d != out:
            return False, (f"{name.replace('_dtype', '')} dtype {dtype_name(d)} != output dtype {dtype_name(out)}: "
                           f"the copy needs gamma/beta in the output dtype (apex#1379)")
    if p["rows"] * p["hidden"] > INT32_MAX:
        return False, f"{p['rows'] * p['hidden']} elements: the copy indexes with 32-bit int"
    return True, ""


def _torch_supports(p: Problem) -> tuple[bool, str]:
    return True, ""


dispatch.register(Implementation(OP, "pipegoose", "ours", _pipegoose_supports, ("pipegoose/layer_norm",),
                                 SRC_PIPEGOOSE))
dispatch.register(Implementation(OP, "apex", "ported", _apex_supports, ("apex/fused_layer_norm",), SRC_APEX))
dispatch.register(Implementation(OP, "torch", "reference", _torch_supports, (), "PyTorch F.layer_norm",
                                 small_first=True))
dispatch.register_problem(OP, _explain)


# ---------------------------------------------------------------------------------------------------------------
# Reference

def _param_for(p: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """Upcast a parameter (exactly) so that F.layer_norm accepts the pair; never rounds it down."""
    if p is None or p.dtype == x.dtype:
        return p
    if x.dtype in HALF_DTYPES:
        return p.float() if p.dtype != torch.float64 else p  # fp64: layer_norm_reference computes in fp64
    return p.to(x.dtype)


def layer_norm_reference(x: torch.Tensor, shape: Sequence[int], weight: torch.Tensor | None,
                         bias: torch.Tensor | None, eps: float, out: torch.dtype) -> torch.Tensor:
    """F.layer_norm with the output dtype ``out`` (input cast first, as autocast does) and mixed parameters."""
    if out != x.dtype:
        x = x.to(out)
    w, b = _param_for(weight, x), _param_for(bias, x)
    if x.dtype in HALF_DTYPES and any(p is not None and p.dtype == torch.float64 for p in (w, b)):
        # a fp64 parameter of a 16-bit input: computed in fp64 and rounded once (rounding the parameter to the
        # input's dtype could overflow it, or round twice)
        w64 = None if w is None else w.double()
        b64 = None if b is None else b.double()
        return F.layer_norm(x.double(), tuple(shape), w64, b64, eps).to(x.dtype)
    if x.dtype in HALF_DTYPES and any(p is not None and p.dtype == torch.float32 for p in (w, b)):
        # fp32 parameters of a 16-bit input: computed in fp32 and rounded once, on every device (torch's CPU kernel
        # takes the mixed dtypes and does the same in the forward, but its backward's parameter gradients are less
        # exact: a bias gradient of 32 bf16 rows 0.5 off, this path's exact; its CUDA kernel refuses the mixed dtypes:
        # "expected scalar type BFloat16 but found Float")
        return F.layer_norm(x.float(), tuple(shape), None if w is None else w.float(),
                            None if b is None else b.float(), eps).to(x.dtype)
    return F.layer_norm(x, tuple(shape), w, b, eps)


# ---------------------------------------------------------------------------------------------------------------
# Fused Functions

def _ops(name: str) -> Any:
    ops, why = dispatch.kernel(name)
    if ops is None:
        raise RuntimeError(why)
    return ops


def _run_pipegoose(x, weight, bias, shape, eps, out):
    """pipegoose/layer_norm through ``torch.ops.pipegoose.layer_norm(input [..., H], weight [H]?, bias [H]?, eps,
    out_dtype)``: the forward kernel with its autograd formula in C++ (pipegoose/kernels/bindings/layer_norm.cpp): no
    Python runs in the backward, and a call costs the host less than through a Python autograd.Function (H200: a
    forward + backward 56-62 us more than ``nn.LayerNorm`` instead of 85-127 at 4096-16384 x 768; session21.log).

    Double backward: a backward run with grad mode on (``create_graph=True``) computes the gradients through the
    PyTorch formula (:func:`layer_norm_reference`'s) on the saved inputs instead of the backward kernel, which is not
    differentiable; second derivatives are then PyTorch's. A backward without ``create_graph`` runs the kernel."""
    op = _ops("pipegoose/layer_norm").layer_norm.default
    if len(shape) == 1:  # the op takes [..., H] and 1-D parameters as they are (host time: no views)
        return op(x, weight, bias, float(eps), out)
    h = math.prod(shape)
    y = op(x.reshape(-1, h), None if weight is None else weight.reshape(h), None if bias is None else bias.reshape(h),
           float(eps), out)
    return y.view(x.shape)


class ApexLayerNormFunction(torch.autograd.Function):
    """apex/fused_layer_norm: fused_layer_norm_affine_forward/backward (gamma, beta in the output dtype).

    Double backward: a backward run with grad mode on (``create_graph=True``) computes the gradients through
    :func:`layer_norm_reference` on the saved inputs instead of the backward kernel."""

    @staticmethod
    def forward(ctx, x, weight, bias, shape, eps, out):
        shape = list(shape)
        x2 = x.contiguous()
        g = torch.ones(shape, dtype=out, device=x.device) if weight is None else weight.contiguous()
        b = torch.zeros(shape, dtype=out, device=x.device) if bias is None else bias.contiguous()
        y, mean, invvar = _ops("apex/fused_layer_norm").fused_layer_norm_affine_forward(x2, shape, g, b, float(eps))
        ctx.save_for_backward(x, weight, bias, g, b, mean, invvar)  # x, weight, bias: for a double backward
        ctx.meta = (shape, float(eps), out)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, g, b, mean, invvar = ctx.saved_tensors
        shape, eps, out = ctx.meta
        if torch.is_grad_enabled():  # create_graph=True: gradients that are differentiable again
            return (*grads_through(lambda x_, w_, b_: layer_norm_reference(x_, shape, w_, b_, eps, out),
                                   (x, weight, bias), ctx.needs_input_grad[:3], dy), None, None, None)
        gi, gg, gb = _ops("apex/fused_layer_norm").fused_layer_norm_affine_backward(
            dy.to(g.dtype).contiguous(), mean, invvar, x.contiguous(), shape, g.contiguous(), b.contiguous(), eps)
        return gi, None if weight is None else gg, None if bias is None else gb, None, None, None


def _signature(x: Any, normalized_shape: Any, weight: Any, bias: Any, eps: Any) -> tuple | None:
    """The call's metadata for the choice cache (dispatch.choice_key), or None when it cannot be cached (not
    tensors, unhashable arguments, torch.compile tracing)."""
    if torch.compiler.is_compiling() or isinstance(eps, torch.Tensor):  # a 0-d tensor eps: checked on every call
        return None
    try:
        # inside torch.func (any argument), or where tensors may carry forward-mode tangents: the metadata of plain
        # tensors, but the kernels decline them
        if any_in_transform(x, weight, bias) or in_dual_level():
            return None
        ns = normalized_shape
        sig = (type(x), x.dtype, x.device, x.shape, x.requires_grad, shape_signature(ns), param_signature(weight),
               param_signature(bias), type(eps), eps, torch.is_grad_enabled(), autocast_state(x.device))
        hash(sig)
    except (AttributeError, TypeError):
        return None
    return sig


def run(x: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None, bias: torch.Tensor | None,
        eps: float, impl: str | None) -> torch.Tensor:
    """:func:`pipegoose.nn.fusion.functional.layer_norm` behind the checks: ``x`` [*, *normalized_shape] -> the
    same shape, in :func:`out_dtype`; runs the implementation the dispatcher chooses (``impl``: a forced one or None).

    Raises:
        TypeError, ValueError: as :func:`check_args`; ``impl`` naming no implementation of ``layer_norm``.
        FusionFallbackError: in strict mode, where no fused implementation can take the input.
    """
    if dispatch.compile_passthrough(OP, impl):  # torch.compile fuses the op itself, after the checks of eager mode
        # (traced once per graph; without them a negative eps gave NaN, a review)
        shape = normalize_shape(normalized_shape)
        eps_f = check_args(x, shape, weight, bias, eps, shapes=False)
        if (weight is None or weight.dtype == x.dtype) and (bias is None or bias.dtype == x.dtype):
            return F.layer_norm(x, shape, weight, bias, eps_f)   # (autocast, if on, casts as in eager mode)
        # parameters of another dtype than x's: eager mode's reference path (F.layer_norm alone refused most of those
        # mixes, "mixed dtype", a review)
        return call_without_autocast(x.device, layer_norm_reference, x, shape, weight, bias, eps_f,
                                     traced_out_dtype(x, weight, bias))
    if getattr(x, "is_nested", False):
        shape, eps = normalize_shape(normalized_shape), eps_value(eps)  # the checks of a dense call
        dispatch.record(nested_fallback(OP, impl))
        return F.layer_norm(x, shape, weight, bias, eps)
    sig = _signature(x, normalized_shape, weight, bias, eps)
    key = None if sig is None else dispatch.choice_key(OP, impl, sig)
    hit = None if key is None else dispatch.cached_choice(key)
    if hit is None:
        shape = normalize_shape(normalized_shape)
        eps_f = check_args(x, shape, weight, bias, eps)
        out = out_dtype(x, weight, bias)
        xin = x if out == x.dtype else x.to(out)  # what autocast does (fp32 policy); the kernels then see out == in
        # eps as a float: every implementation takes that (F.layer_norm refuses a 0-d tensor eps)
        hit = (dispatch.choose(OP, layer_norm_problem(xin, shape, weight, bias, out), impl), shape, out, eps_f)
        if key is not None:
            dispatch.remember_choice(key, hit)
    else:
        xin = x if hit[2] == x.dtype else x.to(hit[2])
    choice, shape, out, eps = hit
    dispatch.record(choice)
    return call_without_autocast(x.device, _RUNNERS[choice.impl], xin, weight, bias, shape, eps, out)


def _run_apex(x, weight, bias, shape, eps, out):
    return ApexLayerNormFunction.apply(x, weight, bias, shape, eps, out)


def _run_torch(x, weight, bias, shape, eps, out):
    return layer_norm_reference(x, shape, weight, bias, eps, out)


_RUNNERS = {"pipegoose": _run_pipegoose, "apex": _run_apex, "torch": _run_torch}
