"""SwiGLU's gated activation ``silu(gate) * up`` (the MLP of Llama, Mistral, Qwen2/Qwen3 and their copies:
``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` with ``act_fn`` SiLU): our kernel with its C++ autograd, the
PyTorch reference, dispatch.

Numerics: the kernel computes each output (and, in the backward, each gradient) in fp32 from the stored inputs and
rounds it once to the inputs' dtype. Eager PyTorch in fp16 / bf16 rounds ``silu(gate)`` to the dtype first and then
the product (two roundings), so the two differ by about one unit in the last place of the dtype, the kernel being the
closer to exact; in fp32 they agree to about 1e-6 relative. The kernel saves ``gate`` and ``up`` for the backward
(eager PyTorch saves ``gate``, ``silu(gate)`` and ``up``: one tensor of the MLP's intermediate size per layer less).

Implementations (op ``swiglu``): ``pipegoose`` (pipegoose/kernels/csrc/swiglu.cu, this project, MIT) and ``torch``
(``F.silu(gate) * up``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .. import dispatch
from ..dispatch import Implementation, Problem
from ._common import (all_have_storage, kernel_input_ok, any_in_transform, call_without_autocast,
                      check_float_tensor, dtype_name, has_tangent, in_dual_level, needs_grad, nested_fallback)

OP = "swiglu"
FORWARD_AD_SWIGLU = ("a dual tensor (torch.autograd.forward_ad): the SwiGLU kernel has no forward derivative (jvp); "
                     "PyTorch's ops have")
SRC_PIPEGOOSE = "pipegoose/swiglu: pipegoose/kernels/csrc/swiglu.cu (pipegoose, MIT)"


def check_args(gate: Any, up: Any) -> None:
    """Check the arguments (errors name the argument).

    Raises:
        TypeError: ``gate`` or ``up`` not a floating point tensor, or of a dtype no path here takes (float8).
        ValueError: ``up`` on another device than ``gate``, or of a shape that does not broadcast with it.
    """
    for name, t in (("gate", gate), ("up", up)):
        check_float_tensor(t, name)
    if up.device != gate.device:
        raise ValueError(f"up: on {up.device}, expected gate's device {gate.device}")
    if gate.is_nested or up.is_nested:   # (a strided nested tensor has no .shape; PyTorch's ops check it)
        return
    try:
        torch.broadcast_shapes(gate.shape, up.shape)
    except RuntimeError:
        raise ValueError(f"up: shape {list(up.shape)} does not broadcast with gate's {list(gate.shape)}") from None


def swiglu_problem(gate: torch.Tensor, up: torch.Tensor) -> Problem:
    """The dispatcher's description of one call (metadata only)."""
    return Problem(OP, gate.dtype, gate.device, cols=gate.shape[-1] if gate.dim() else 1,
                   needs_grad=needs_grad(gate, up),
                   extra=dict(shape=tuple(gate.shape), up_shape=tuple(up.shape), up_dtype=up.dtype,
                              numel=max(gate.numel(), up.numel()), storage=all_have_storage(gate, up),
                              forward_ad=has_tangent(gate, up)))


def _explain(gate, up):
    check_args(gate, up)
    return swiglu_problem(gate, up)


def _pipegoose_supports(p: Problem) -> tuple[bool, str]:
    ok, why = kernel_input_ok(p, FORWARD_AD_SWIGLU, "gate")
    if not ok:
        return ok, why
    if p["up_dtype"] != p.dtype:
        return False, f"up is {dtype_name(p['up_dtype'])} and gate {dtype_name(p.dtype)}: the kernel takes one dtype"
    if p["up_shape"] != p["shape"]:
        return False, (f"up's shape {list(p['up_shape'])} differs from gate's {list(p['shape'])}: the kernel does not "
                       "broadcast")
    if p["numel"] == 0:
        return False, "an empty input"
    return True, ""


dispatch.register(Implementation(OP, "pipegoose", "ours", _pipegoose_supports, ("pipegoose/swiglu",),
                                 SRC_PIPEGOOSE))
dispatch.register(Implementation(OP, "torch", "reference", lambda p: (True, ""), (),
                                 "PyTorch: F.silu(gate) * up", small_first=True))
dispatch.register_problem(OP, _explain)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The PyTorch path: ``F.silu(gate) * up`` (broadcasting; the promoted dtype)."""
    return F.silu(gate) * up


def _run_pipegoose(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """pipegoose/swiglu through ``torch.ops.pipegoose.swiglu(gate, up)``: the forward kernel with its autograd formula
    in C++ (pipegoose/kernels/bindings/swiglu.cpp). A backward with ``create_graph=True`` differentiates the PyTorch
    formula of the kernel's numerics (``silu`` and the product in fp32, one rounding) on the saved inputs instead."""
    ops, why = dispatch.kernel("pipegoose/swiglu")
    if ops is None:
        raise RuntimeError(why)
    return ops.swiglu.default(gate, up)


def _signature(gate: Any, up: Any) -> tuple | None:
    if torch.compiler.is_compiling():
        return None
    try:
        if any_in_transform(gate, up) or in_dual_level():
            return None
        sig = (type(gate), gate.dtype, gate.device, gate.shape, gate.requires_grad, type(up), up.dtype, up.device,
               up.shape, up.requires_grad, torch.is_grad_enabled())
        hash(sig)
    except (AttributeError, TypeError):
        return None
    return sig


def run(gate: torch.Tensor, up: torch.Tensor, impl: str | None) -> torch.Tensor:
    """:func:`pipegoose.nn.fusion.functional.swiglu` behind the checks; runs the implementation the dispatcher
    chooses (``impl``: a forced one or None).

    Raises:
        TypeError, ValueError: as :func:`check_args`; ``impl`` naming no implementation of ``swiglu``.
        FusionFallbackError: in strict mode, where the kernel cannot take the input.
    """
    if dispatch.compile_passthrough(OP, impl):  # torch.compile fuses the two ops itself, after eager mode's checks
        check_args(gate, up)
        return swiglu_reference(gate, up)
    if getattr(gate, "is_nested", False) or getattr(up, "is_nested", False):
        check_args(gate, up)
        dispatch.record(nested_fallback(OP, impl))
        return swiglu_reference(gate, up)
    sig = _signature(gate, up)
    key = None if sig is None else dispatch.choice_key(OP, impl, sig)
    choice = None if key is None else dispatch.cached_choice(key)
    if choice is None:
        check_args(gate, up)
        choice = dispatch.choose(OP, swiglu_problem(gate, up), impl)
        if key is not None:
            dispatch.remember_choice(key, choice)
    dispatch.record(choice)
    if choice.impl == "pipegoose":
        return call_without_autocast(gate.device, _run_pipegoose, gate, up)
    return swiglu_reference(gate, up)
