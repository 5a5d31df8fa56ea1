"""RMSNorm over the trailing ``normalized_shape``: the fused path (our op with its C++ autograd), the PyTorch
references, dispatch.

Two conventions, both with ``rstd = rsqrt(mean(x^2) + eps)`` computed in fp32 (fp64 for fp64 input):

* ``cast_before_weight=False`` (default; ``torch.nn.functional.rms_norm``): ``y = x * rstd * weight`` in fp32,
  rounded once to the output dtype = the input's dtype (fp32 under CUDA autocast if PyTorch's autocast lists
  rms_norm there: measured, not assumed). Matches F.rms_norm, including mixed input/weight dtypes.
* ``cast_before_weight=True`` (transformers' ``LlamaRMSNorm`` and its copies): ``y = weight *
  (x * rstd).to(input_dtype)``; output dtype = ``torch.result_type`` of that product (bf16 input with fp32
  weight gives fp32). The reference path is bit-for-bit Llama's. The fused path applies the weight inside the
  kernel (one pass over the data instead of a kernel plus an elementwise product and its backward): it computes
  ``x * rstd * weight`` in fp32 and rounds once to that output dtype, where Llama rounds ``x * rstd`` to the input
  dtype first; the two differ by at most about one unit in the last place of the input dtype, the fused result
  being the closer to exact. Autocast does not change it (Llama's module has no autocast-listed op).

Implementations (op ``rms_norm``): ``pipegoose`` (pipegoose/kernels/csrc/rms_norm.cu, this project, MIT) and
``torch``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F

from .. import dispatch
from ..dispatch import Implementation, Problem
from ._common import (FLOAT_DTYPES, kernel_input_ok, all_have_storage, any_in_transform, autocast_state,
                      call_without_autocast, check_float_tensor, check_input_dtype, dtype_name, eps_value, has_tangent,
                      in_dual_level, hidden_range, needs_grad, nested_fallback, param_signature, shape_signature,
                      torch_result_dtype)
from .layer_norm import EMPTY_INPUT, normalize_shape

OP = "rms_norm"
SRC_PIPEGOOSE = "pipegoose/rms_norm: pipegoose/kernels/csrc/rms_norm.cu (pipegoose, MIT)"


def check_args(x: Any, shape: tuple[int, ...], weight: Any, eps: Any, shapes: bool = True) -> float | None:
    """Check the arguments (errors name the argument); returns ``eps`` as a float, or None for the default.
    ``shapes=False``: not the shapes against ``shape`` (as :func:`pipegoose.nn.fusion.ops.layer_norm.check_args`).

    Raises:
        TypeError: ``x`` or ``weight`` not a floating point tensor (or of an unsupported dtype), ``eps`` not a
            number.
        ValueError: ``x``'s trailing dims not ``shape``, ``weight`` not of ``shape`` or on another device, ``eps``
            negative or not finite.
    """
    check_float_tensor(x)
    if shapes and (x.dim() < len(shape) or tuple(x.shape[x.dim() - len(shape):]) != shape):
        raise ValueError(f"x: expected shape [*, {', '.join(map(str, shape))}] (normalized_shape={list(shape)}), "
                         f"got {list(x.shape)}")
    if weight is not None:
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            raise TypeError(f"weight: expected a floating point torch.Tensor or None, got "
                            f"{dtype_name(weight.dtype) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
        check_input_dtype(weight, "weight")
        if shapes and tuple(weight.shape) != shape:
            raise ValueError(f"weight: expected shape {list(shape)} (normalized_shape), got {list(weight.shape)}")
        if weight.device != x.device:
            raise ValueError(f"weight: on {weight.device}, expected the input's device {x.device}")
    return eps_value(eps, allow_none=True)


def out_dtype(x: torch.Tensor, weight: torch.Tensor | None, cast_before_weight: bool) -> torch.dtype:
    """The output dtype: with ``cast_before_weight`` (LlamaRMSNorm) the promotion of the weight's and the input's
    dtypes; else what F.rms_norm returns for these dtypes under the current autocast state (the input's dtype when
    PyTorch rejects the mix)."""
    if cast_before_weight:
        return x.dtype if weight is None else torch.promote_types(weight.dtype, x.dtype)
    dev = x.device
    wd = None if weight is None else weight.dtype

    def probe(xd, wd_):
        w = None if wd_ is None else torch.ones(2, dtype=wd_, device=dev)
        return F.rms_norm(torch.zeros(1, 2, dtype=xd, device=dev), (2,), w, 1e-6)

    import warnings

    with warnings.catch_warnings():  # "Mismatch dtype between input and weight" from the probe itself
        warnings.simplefilter("ignore")
        return torch_result_dtype("rms_norm", dev, (x.dtype, wd), probe, x.dtype)


def rms_norm_problem(x, shape, weight, out, cast_before_weight) -> Problem:
    """The dispatcher's description of one call: ``x`` [*, *shape], ``weight`` of ``shape`` or None, ``out`` the
    output dtype (:func:`out_dtype`)."""
    h = math.prod(shape)
    return Problem(OP, x.dtype, x.device, cols=h, needs_grad=needs_grad(x, weight),
                   extra=dict(shape=tuple(x.shape), normalized_shape=shape, hidden=h,
                              rows=x.numel() // h if h else 0, numel=x.numel(), storage=all_have_storage(x, weight),
                              forward_ad=has_tangent(x, weight),
                              weight_dtype=None if weight is None else weight.dtype, out_dtype=out,
                              cast_before_weight=cast_before_weight))


def _explain(x, normalized_shape, weight=None, eps=None, cast_before_weight=False):
    shape = normalize_shape(normalized_shape)
    check_args(x, shape, weight, eps)
    out = out_dtype(x, weight, cast_before_weight)
    p = rms_norm_problem(x, shape, weight, out, cast_before_weight)
    # the problem run() chooses on: x cast to the output dtype first unless Llama's rounding (without copying x here)
    return p if cast_before_weight else dataclasses.replace(p, dtype=out)


def _pipegoose_supports(p: Problem) -> tuple[bool, str]:
    ok, why = kernel_input_ok(p)
    if not ok:
        return ok, why
    for name in ("weight_dtype", "out_dtype"):
        d = p[name]
        if d is not None and d not in FLOAT_DTYPES:
            return False, f"{name.replace('_dtype', '')} dtype {dtype_name(d)} not supported"
    if p["rows"] == 0 or p["hidden"] == 0:
        return False, EMPTY_INPUT.format(list(p["shape"]))
    h = p["hidden"]
    hmin, hmax = hidden_range("pipegoose/rms_norm")
    if not hmin <= h <= hmax:
        return False, f"hidden size {h} outside [{hmin}, {hmax}]"
    return True, ""


dispatch.register(Implementation(OP, "pipegoose", "ours", _pipegoose_supports, ("pipegoose/rms_norm",),
                                 SRC_PIPEGOOSE))


def _torch_is_native(p: Problem) -> bool:
    """Whether the ``torch`` path runs the single ``F.rms_norm`` kernel that the benchmarks time (see
    :func:`rms_norm_reference`), not the multi-kernel eager formula."""
    return (not p["cast_before_weight"] and p["out_dtype"] == p.dtype
            and p["weight_dtype"] in (None, p.dtype))


dispatch.register(Implementation(OP, "torch", "reference", lambda p: (True, ""), (),
                                 "PyTorch: F.rms_norm, or the eager formula for Llama's rounding and mixed dtypes",
                                 tuned_for=_torch_is_native, small_first=True))
dispatch.register_problem(OP, _explain)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm_reference(x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor | None, eps: float,
                       out: torch.dtype, cast_before_weight: bool) -> torch.Tensor:
    """The PyTorch path: ``x`` [*, *shape] normalised over ``shape`` (fp32 statistics; fp64 for fp64 input), of
    ``x``'s shape in dtype ``out``; ``cast_before_weight`` as the module docstring says. Arguments are not checked
    (:func:`check_args` does)."""
    # the condition of _torch_is_native, on the tensors
    if not cast_before_weight and out == x.dtype and (weight is None or weight.dtype == x.dtype):
        # torch's own op computes exactly this (fp32 statistics, one rounding) in one kernel on CUDA
        return F.rms_norm(x, shape, weight, eps)
    dims = tuple(range(x.dim() - len(shape), x.dim()))
    ct = _compute_dtype(x.dtype)
    xf = x.to(ct)
    xn = xf * torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + eps)
    if cast_before_weight:
        xn = xn.to(x.dtype)
        return xn if weight is None else weight * xn
    if weight is not None:
        xn = xn * weight.to(ct)
    return xn.to(out)


def _ops() -> Any:
    ops, why = dispatch.kernel("pipegoose/rms_norm")
    if ops is None:
        raise RuntimeError(why)
    return ops


def _run_pipegoose(x, weight, shape, eps, out):
    """pipegoose/rms_norm through ``torch.ops.pipegoose.rms_norm(input [..., H], weight [H]?, eps, out_dtype)``:
    the forward kernel with its autograd formula in C++ (pipegoose/kernels/bindings/rms_norm.cpp): no Python runs in
    the backward (host time: see :func:`pipegoose.nn.fusion.ops.layer_norm._run_pipegoose`).

    Double backward: a backward run with grad mode on (``create_graph=True``) computes the gradients through the
    PyTorch formula (``x * rstd * weight`` in fp32, rounded once to ``out``: the kernel's numerics, as
    :func:`rms_norm_reference` with ``cast_before_weight=False``) on the saved inputs instead of the backward kernel,
    which is not differentiable; second derivatives are then PyTorch's. A backward without ``create_graph`` runs the
    kernel."""
    op = _ops().rms_norm.default
    if len(shape) == 1:  # the op takes [..., H] and a 1-D weight as they are (host time: no views)
        return op(x, weight, float(eps), out)
    h = math.prod(shape)
    y = op(x.reshape(-1, h), None if weight is None else weight.reshape(h), float(eps), out)
    return y.view(x.shape)


def _signature(x: Any, normalized_shape: Any, weight: Any, eps: Any, cast_before_weight: bool) -> tuple | None:
    """The call's metadata for the choice cache (dispatch.choice_key), or None when it cannot be cached."""
    if torch.compiler.is_compiling() or isinstance(eps, torch.Tensor):  # a 0-d tensor eps: checked on every call
        return None
    try:
        # inside torch.func (any argument), or where tensors may carry forward-mode tangents: the metadata of plain
        # tensors, but the kernels decline them
        if any_in_transform(x, weight) or in_dual_level():
            return None
        ns = normalized_shape
        sig = (type(x), x.dtype, x.device, x.shape, x.requires_grad, shape_signature(ns), param_signature(weight),
               type(eps), eps, cast_before_weight, torch.is_grad_enabled(), autocast_state(x.device))
        hash(sig)
    except (AttributeError, TypeError):
        return None
    return sig


def _default_eps(eps: float | None, x: torch.Tensor) -> float:
    """F.rms_norm's default for ``eps=None``: the machine epsilon of the compute dtype (fp32 for half inputs)."""
    return torch.finfo(_compute_dtype(x.dtype)).eps if eps is None else eps


def _pytorch_ops(x, shape, weight, eps, cast_before_weight: bool, without_autocast: bool) -> torch.Tensor:
    """The call as PyTorch ops (nested tensors; torch.compile tracing): F.rms_norm, or Llama's rounding (its eager
    formula) for ``cast_before_weight``, in the dtype F.rms_norm would give."""
    if not cast_before_weight:
        return F.rms_norm(x, shape, weight, eps)
    out = out_dtype(x, weight, True)
    if without_autocast:
        return call_without_autocast(x.device, rms_norm_reference, x, shape, weight, _default_eps(eps, x), out, True)
    return rms_norm_reference(x, shape, weight, _default_eps(eps, x), out, True)


def run(x: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None, eps: float | None,
        cast_before_weight: bool, impl: str | None) -> torch.Tensor:
    """:func:`pipegoose.nn.fusion.functional.rms_norm` behind the checks: ``x`` [*, *normalized_shape] -> the same
    shape, in :func:`out_dtype`; runs the implementation the dispatcher chooses (``impl``: a forced one or None).

    Raises:
        TypeError, ValueError: as :func:`check_args`; ``cast_before_weight`` not a bool; ``impl`` naming no
            implementation of ``rms_norm``.
        FusionFallbackError: in strict mode, where the fused path cannot take the input.
    """
    # before the choice cache, whose key holds the value alone: 1 and numpy's True equal True and hash alike, so a
    # cached call with True let them through where a first call refused them
    if not isinstance(cast_before_weight, bool):
        raise TypeError(f"cast_before_weight: expected a bool, got {type(cast_before_weight).__name__}")
    if getattr(x, "is_nested", False):  # PyTorch's ops (which may refuse it, as F.rms_norm does a strided one)
        shape, eps = normalize_shape(normalized_shape), eps_value(eps, allow_none=True)  # the checks of a dense call
        dispatch.record(nested_fallback(OP, impl))
        return _pytorch_ops(x, shape, weight, eps, cast_before_weight, without_autocast=False)
    if dispatch.compile_passthrough(OP, impl):  # torch.compile fuses the op itself, after the checks of eager mode
        shape = normalize_shape(normalized_shape)
        return _pytorch_ops(x, shape, weight, check_args(x, shape, weight, eps, shapes=False), cast_before_weight,
                            without_autocast=True)
    sig = _signature(x, normalized_shape, weight, eps, cast_before_weight)
    key = None if sig is None else dispatch.choice_key(OP, impl, sig)
    hit = None if key is None else dispatch.cached_choice(key)
    if hit is None:
        shape = normalize_shape(normalized_shape)
        eps = _default_eps(check_args(x, shape, weight, eps), x)
        out = out_dtype(x, weight, cast_before_weight)
        xin = x if cast_before_weight or out == x.dtype else x.to(out)
        choice = dispatch.choose(OP, rms_norm_problem(xin, shape, weight, out, cast_before_weight), impl)
        hit = (choice, shape, float(eps), out)
        if key is not None:
            dispatch.remember_choice(key, hit)
    else:
        out = hit[3]
        xin = x if cast_before_weight or out == x.dtype else x.to(out)
    choice, shape, eps, out = hit
    dispatch.record(choice)
    if choice.impl == "pipegoose":
        # cast_before_weight too: the weight is applied in the kernel, in fp32, rounded once to ``out``
        return call_without_autocast(x.device, _run_pipegoose, xin, weight, shape, eps, out)
    return call_without_autocast(x.device, rms_norm_reference, xin, shape, weight, eps, out, cast_before_weight)
