"""The gated RMSNorm of linear-attention and state-space layers (op ``rms_norm_gated``): the references, the kernel
path, dispatch.

Two orders, each over groups of ``group_size`` consecutive values of the last dimension D (one group: the whole row),
``rstd = rsqrt(mean over the group of v^2 + eps)`` in fp32, ``silu`` in fp32:

* ``norm_before_gate=True`` (transformers' ``Qwen3NextRMSNormGated``, ``Qwen3_5RMSNormGated`` and their copies):
  ``(weight * (x * rstd(x)).to(x.dtype) * silu(gate.float())).to(x.dtype)``; output in x's dtype.
* ``norm_before_gate=False`` (Mamba2's ``MambaRMSNormGated``, Bamba's, Nemotron-H's, Zamba2's, Granite-4's
  ``GraniteMoeHybridRMSNormGated``): ``z = x.float() * silu(gate.float())``, ``weight * (z * rstd(z)).to(x.dtype)``;
  output in the promotion of the weight's and x's dtypes.

The PyTorch references (:func:`rms_norm_gated_reference`) are those formulas, bit for bit transformers' modules.

Implementations:

* ``pipegoose``: pipegoose/rms_norm_gated (pipegoose/kernels/csrc/rms_norm_gated.cu, this project, MIT), both orders,
  one kernel forward and one backward, in fp32 and rounded once (the modules round the normalised value to x's dtype
  before the weight: about one unit in the last place apart, the kernel the closer to exact). Opt-in (runs where
  ``impl="pipegoose"``, ``PIPEGOOSE_IMPL_RMS_NORM_GATED=pipegoose`` or a tuning rule names it) until a GPU run has
  timed it against the others.
* ``ops``: the norm before the gate over whole rows as two ops of this package: op ``rms_norm`` (LlamaRMSNorm's
  numerics, ``cast_before_weight=True``), then op ``swiglu`` of the gate and that result (:func:`
  pipegoose.nn.fusion.ops.swiglu.run_silu_gate`), each chosen by its own dispatcher (on PyTorch's paths, bit for bit
  the module).
* ``torch``: the reference.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .. import dispatch
from ..dispatch import Implementation, Problem
from . import rms_norm as _rms_norm, swiglu as _swiglu
from ._common import (FLOAT_DTYPES, all_have_storage, call_without_autocast, check_float_tensor, dtype_name,
                      eps_value, has_tangent, int_value, kernel_input_ok, manifest_limit, needs_grad,
                      nested_fallback)

OP = "rms_norm_gated"
KERNEL = "pipegoose/rms_norm_gated"
SRC_PIPEGOOSE = "pipegoose/rms_norm_gated: pipegoose/kernels/csrc/rms_norm_gated.cu (pipegoose, MIT)"
EMPTY_INPUT = "an empty input {}: nothing to normalise"


def check_args(x: Any, gate: Any, weight: Any, eps: Any, group_size: Any, norm_before_gate: Any) -> tuple[float, int]:
    """Check the arguments (errors name the argument); returns ``(eps, group_size)`` (``group_size`` None: D).

    Raises:
        TypeError: ``x``, ``gate`` or ``weight`` not a floating point tensor of a dtype taken here, ``eps`` not a
            number, ``group_size`` not an int, ``norm_before_gate`` not a bool.
        ValueError: ``x`` of no dimension; ``gate`` of another shape or device than x's; ``weight`` not [D] or on
            another device; ``group_size`` not a divisor of D from 1 to D; ``eps`` negative or not finite.
    """
    check_float_tensor(x)
    if x.dim() < 1:
        raise ValueError("x: expected a tensor [*, D] of at least one dimension, got a 0-d tensor")
    check_float_tensor(gate, "gate")
    if gate.shape != x.shape or gate.device != x.device:
        raise ValueError(f"gate: expected x's shape {list(x.shape)} on {x.device}, got {list(gate.shape)} on "
                         f"{gate.device}")
    d = x.shape[-1]
    if weight is not None:
        check_float_tensor(weight, "weight")
        if tuple(weight.shape) != (d,):
            raise ValueError(f"weight: expected shape [{d}] (x's last dimension), got {list(weight.shape)}")
        if weight.device != x.device:
            raise ValueError(f"weight: on {weight.device}, expected x's device {x.device}")
    if not isinstance(norm_before_gate, bool):
        raise TypeError(f"norm_before_gate: expected a bool, got {type(norm_before_gate).__name__}")
    group = d if group_size is None else int_value(group_size, "group_size")
    if group_size is not None and not (1 <= group <= d and d % group == 0):
        raise ValueError(f"group_size: expected a divisor of x's last dimension {d} (from 1 to {d}), got {group}")
    return eps_value(eps), group


def out_dtype(x: torch.Tensor, weight: torch.Tensor | None, norm_before_gate: bool) -> torch.dtype:
    """The output dtype, the modules': x's with the norm before the gate (the result is cast to it); the promotion of
    the weight's and x's dtypes with the gate first (the weight times the normalised value cast to x's dtype)."""
    if norm_before_gate or weight is None:
        return x.dtype
    return torch.promote_types(weight.dtype, x.dtype)


def rms_norm_gated_problem(x, weight, group, norm_before_gate, out, gate=None) -> Problem:
    """The dispatcher's description of one call: ``x`` (and the gate) [*, D], ``weight`` [D] or None, groups of
    ``group`` values, ``out`` the output dtype (:func:`out_dtype`), ``gate`` (for its dtype; None: x's)."""
    d = x.shape[-1]
    g = x if gate is None else gate
    return Problem(OP, x.dtype, x.device, cols=group, needs_grad=needs_grad(x, g, weight),
                   extra=dict(shape=tuple(x.shape), hidden=d, group=group, rows=x.numel() // d if d else 0,
                              numel=x.numel(), storage=all_have_storage(x, g, weight),
                              forward_ad=has_tangent(x, g, weight),
                              weight_dtype=None if weight is None else weight.dtype, out_dtype=out,
                              gate_dtype=x.dtype if gate is None else gate.dtype, norm_before_gate=norm_before_gate))


def _explain(x, gate, weight=None, eps=1e-6, group_size=None, norm_before_gate=True):
    _, group = check_args(x, gate, weight, eps, group_size, norm_before_gate)
    return rms_norm_gated_problem(x, weight, group, norm_before_gate, out_dtype(x, weight, norm_before_gate), gate)


_GATE_DTYPE = "gate dtype {} neither x's ({}) nor a 16-bit one with fp32 x (cast without rounding)"


def _widened(p: Problem, name: str) -> bool:
    """Whether the tensor ``name`` (``gate``, ``weight``) has x's dtype after the kernel path's cast of it: its own,
    or a 16-bit one with fp32 x (a cast without rounding: Mamba2's fp32 scan output with a bf16 model's gate)."""
    d = p[f"{name}_dtype"]
    return d is None or d == p.dtype or (p.dtype == torch.float32 and d in FLOAT_DTYPES)


def _pipegoose_supports(p: Problem) -> tuple[bool, str]:
    ok, why = kernel_input_ok(p)
    if not ok:
        return ok, why
    if not _widened(p, "gate"):
        return False, _GATE_DTYPE.format(dtype_name(p["gate_dtype"]), dtype_name(p.dtype))
    wd = p["weight_dtype"]
    if not (wd == torch.float32 or _widened(p, "weight")):
        return False, f"weight dtype {dtype_name(wd)} neither x's ({dtype_name(p.dtype)}) nor float32"
    if p["out_dtype"] not in (p.dtype, torch.float32) or p["out_dtype"] not in FLOAT_DTYPES:
        return False, f"output dtype {dtype_name(p['out_dtype'])} not supported"
    if p["numel"] == 0:
        return False, EMPTY_INPUT.format(list(p["shape"]))
    gmin, gmax = manifest_limit(KERNEL, "group_min", 1), manifest_limit(KERNEL, "group_max", 16384)
    if not gmin <= p["group"] <= gmax:
        return False, f"group size {p['group']} outside [{gmin}, {gmax}]"
    return True, ""


def _ops_supports(p: Problem) -> tuple[bool, str]:
    if not p["norm_before_gate"]:
        return False, "the gate before the norm has no form of two ops here (the kernel: impl='pipegoose')"
    if p["group"] != p["hidden"]:
        return False, f"groups of {p['group']} of {p['hidden']} values: op rms_norm normalises whole rows"
    ok, why = kernel_input_ok(p)
    if not ok:
        return ok, why
    if p["numel"] == 0:
        return False, EMPTY_INPUT.format(list(p["shape"]))
    wd = p["weight_dtype"]
    if wd is not None and wd not in FLOAT_DTYPES:
        return False, f"weight dtype {dtype_name(wd)} not supported"
    if not _widened(p, "gate"):
        return False, _GATE_DTYPE.format(dtype_name(p["gate_dtype"]), dtype_name(p.dtype))
    return True, ""


# (opt-in: see the module docstring; the choice of the two ops or the kernel is the GPU's to make)
dispatch.register(Implementation(OP, "pipegoose", "ours", _pipegoose_supports, (KERNEL,), SRC_PIPEGOOSE, opt_in=True))
dispatch.register(Implementation(OP, "ops", "ours", _ops_supports, ("pipegoose/rms_norm", "pipegoose/swiglu"),
                                 "ops rms_norm then swiglu (pipegoose/kernels/csrc/rms_norm.cu, swiglu.cu; pipegoose, "
                                 "MIT), each by its own dispatcher"))
dispatch.register(Implementation(OP, "torch", "reference", lambda p: (True, ""), (),
                                 "PyTorch: transformers' formulas (Qwen3-Next's RMSNormGated, Mamba2's "
                                 "MambaRMSNormGated)"))
dispatch.register_problem(OP, _explain)


def rms_norm_gated_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None, eps: float,
                             group: int, norm_before_gate: bool) -> torch.Tensor:
    """The PyTorch path, transformers' formulas (module docstring): ``x`` and ``gate`` [*, D] -> [*, D] in
    :func:`out_dtype`; fp32 statistics (fp64 for fp64 x). Arguments are not checked (:func:`check_args` does)."""
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    d = x.shape[-1]
    v = x.to(ct)
    if not norm_before_gate:
        v = v * F.silu(gate.to(ct))
    if group != d:
        v = v.unflatten(-1, (d // group, group))
    v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    if group != d:
        v = v.flatten(-2)
    h = v.to(x.dtype)
    if weight is not None:
        h = weight * h
    if not norm_before_gate:
        return h
    return (h * F.silu(gate.to(ct))).to(x.dtype)


def rms_norm_gated_kernel_math(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None, eps: float,
                               group: int, norm_before_gate: bool, out: torch.dtype) -> torch.Tensor:
    """The kernel's numerics as PyTorch ops (the C++ ``reference`` of the binding, for a double backward; the tests'
    model of the kernel): every step in fp32 (fp64 for fp64 x), rounded once to ``out``."""
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    d = x.shape[-1]
    s = F.silu(gate.to(ct))
    v = x.to(ct) if norm_before_gate else x.to(ct) * s
    vg = v.unflatten(-1, (d // group, group))
    n = (vg * torch.rsqrt(vg.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    if weight is not None:
        n = n * weight.to(ct)
    if norm_before_gate:
        n = n * s
    return n.to(out)


def _two_ops(x, gate, weight, eps, impl):
    """Implementation ``ops``: op rms_norm with Llama's rounding, then op swiglu (in fp32 where an fp32 weight makes
    the norm's product fp32, then cast to x's dtype, as the module casts). ``impl``: the ops' own request (``torch``
    where this op's reference was asked for, else None: their dispatchers choose)."""
    h = _rms_norm.run(x, x.shape[-1], weight, eps, True, impl)
    if h.dtype != gate.dtype:
        return _swiglu.run_silu_gate(gate.to(h.dtype), h, impl).to(x.dtype)
    return _swiglu.run_silu_gate(gate, h, impl)


def _ops() -> Any:
    ops, why = dispatch.kernel(KERNEL)
    if ops is None:
        raise RuntimeError(why)
    return ops


def _run_pipegoose(x, gate, weight, eps, group, norm_before_gate, out):
    """pipegoose/rms_norm_gated through ``torch.ops.pipegoose.rms_norm_gated(input, gate, weight?, eps, group_size,
    norm_before_gate, out_dtype)``: the forward kernel with its autograd formula in C++ (bindings/rms_norm_gated.cpp;
    a backward with ``create_graph=True`` differentiates :func:`rms_norm_gated_kernel_math` instead of running the
    backward kernel). With fp32 x a 16-bit gate or weight is cast to fp32 first (exactly; autograd rounds their
    gradients back to their dtypes, as the modules' casts do)."""
    if gate.dtype != x.dtype:
        gate = gate.to(x.dtype)
    if weight is not None and weight.dtype not in (x.dtype, torch.float32):
        weight = weight.to(torch.float32)
    return _ops().rms_norm_gated.default(x, gate, weight, float(eps), int(group), norm_before_gate, out)


def run(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None, eps: Any, group_size: Any,
        norm_before_gate: bool, impl: str | None) -> torch.Tensor:
    """:func:`pipegoose.nn.fusion.functional.rms_norm_gated` behind the checks: runs the implementation the
    dispatcher chooses (``impl``: a forced one or None).

    Raises:
        TypeError, ValueError: as :func:`check_args`; ``impl`` naming no implementation of ``rms_norm_gated``.
        FusionFallbackError: in strict mode, where no fused path takes the input.
    """
    eps, group = check_args(x, gate, weight, eps, group_size, norm_before_gate)
    out = out_dtype(x, weight, norm_before_gate)
    if getattr(x, "is_nested", False):
        dispatch.record(nested_fallback(OP, impl))
        return rms_norm_gated_reference(x, gate, weight, eps, group, norm_before_gate)
    if dispatch.compile_passthrough(OP, impl):  # torch.compile fuses the formula itself
        return rms_norm_gated_reference(x, gate, weight, eps, group, norm_before_gate)
    choice = dispatch.select(OP, rms_norm_gated_problem(x, weight, group, norm_before_gate, out, gate), impl)
    if choice.impl == "pipegoose":
        return call_without_autocast(x.device, _run_pipegoose, x, gate, weight, eps, group, norm_before_gate, out)
    if choice.impl == "ops":
        return _two_ops(x, gate, weight, eps, None)
    return call_without_autocast(x.device, rms_norm_gated_reference, x, gate, weight, eps, group, norm_before_gate)


