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

Op ``swiglu.packed`` (:func:`pipegoose.nn.fusion.functional.silu_and_mul`, vLLM's name): the same activation of gate
and up as the two halves of one tensor's last dimension, ``silu(x[..., :d]) * x[..., d:]``, as Phi-3's and GLM's MLPs
compute it after their ``gate_up_proj`` (``fuse`` puts :class:`~pipegoose.nn.fusion.modules.FusedGateUpSwiGLUMLP`, on
this op, in their place). The kernel reads the halves where they lie (rows at any stride) and returns the
gradient of ``x`` as one tensor; eager PyTorch runs ``chunk``, ``silu`` and the product, and its backward
concatenates the two halves' gradients (one more read and write of ``x``'s size). Same numerics as ``swiglu``. It
saves ``x`` for the backward (eager PyTorch saves ``gate``'s ``silu`` besides: one tensor of the intermediate size per
layer). Implementations: ``pipegoose`` and ``torch``; ``PIPEGOOSE_IMPL_SWIGLU_PACKED``, then ``PIPEGOOSE_IMPL_SWIGLU``
(the family), choose one.

Op ``geglu`` (:func:`pipegoose.nn.fusion.functional.geglu`): GeGLU's gated activation ``gelu(gate) * up``, GELU with
the tanh approximation (``approximate="tanh"``, ``F.gelu``'s name: transformers' ``gelu_pytorch_tanh``, ``gelu_new``,
``gelu_fast``) or exact (``"none"``: the erf form, transformers' ``gelu``): Gemma's MLP,
``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (``fuse`` puts :class:`~pipegoose.nn.fusion.modules.FusedGeGLUMLP`
in its place). The same kernel library (``pipegoose::geglu``, pipegoose/swiglu), the same contract and numerics as
``swiglu`` (GELU and the product in fp32, one rounding; eager PyTorch in 16-bit rounds ``gelu(gate)`` first), the same
small-problem rule. Implementations: ``pipegoose`` and ``torch`` (``F.gelu(gate, approximate=approximate) * up``);
``PIPEGOOSE_IMPL_GEGLU`` chooses one (an op of its own, not of the ``swiglu`` family).

Op ``geglu.packed`` (:func:`pipegoose.nn.fusion.functional.gelu_and_mul`; vLLM's ``gelu_and_mul`` and
``gelu_tanh_and_mul``): ``geglu`` of gate and up as the two halves of one tensor's last dimension, as ``swiglu.packed``
is ``swiglu``'s: the gate of Gemma 4's MoE experts (``fuse`` sets it as their ``_apply_gate``). The same kernel
library, layouts and numerics. Implementations: ``pipegoose`` and ``torch`` (``F.gelu(gate,
approximate=approximate) * up`` of ``x.chunk(2, -1)``); ``PIPEGOOSE_IMPL_GEGLU_PACKED``, then ``PIPEGOOSE_IMPL_GEGLU``
(the family), choose one.

Op ``gelu`` (:func:`pipegoose.nn.fusion.functional.gelu`): GELU alone, ``F.gelu(x, approximate=approximate)``, the
activation of the MLPs without a gate (``fc2(gelu(fc1(x)))``; ``fuse`` puts :class:`~pipegoose.nn.fusion.modules.
FusedGELU` in place of transformers' GELU activation modules: ``gelu_new``, GPT-2's, runs eight elementwise ops
forward). The same kernel library (``pipegoose::gelu``), geglu's activation per value (fp32 math, one rounding, as
``F.gelu``'s), swiglu's launch with one input. Implementations: ``pipegoose`` and ``torch`` (``F.gelu``, one native
kernel each way); ``PIPEGOOSE_IMPL_GELU`` chooses one; the small-problem rule as geglu's.

Op ``squared_relu`` (:func:`pipegoose.nn.fusion.functional.squared_relu`): Primer's squared ReLU ``relu(x)^2`` alone,
transformers' ``relu2`` (``ReLUSquaredActivation``: the MLPs without a gate of Nemotron, Nemotron-H, Persimmon,
Arcee, Jais2, NanoChat; ``fuse`` puts :class:`~pipegoose.nn.fusion.modules.FusedSquaredReLU` in its place). Eager
PyTorch runs ``relu`` then ``square``, two kernels forward and three backward; the kernel (``pipegoose::squared_relu``,
the same library and launch as ``gelu``) runs one each way, with the same values bit for bit (each a product of two
values of the dtype, rounded once; the one exception: the gradient of fp16 inputs past 32752, where eager's ``2 * x``
overflows first) and the same saved tensor's size (``x``; eager saves ``relu(x)``).
Implementations: ``pipegoose`` and ``torch`` (``torch.square(F.relu(x))``); ``PIPEGOOSE_IMPL_SQUARED_RELU`` chooses
one; the small-problem rule as geglu's.
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


def swiglu_problem(gate: torch.Tensor, up: torch.Tensor, op: str = OP, **extra: Any) -> Problem:
    """The dispatcher's description of one call (metadata only); ``op`` ``geglu`` (:func:`geglu_problem`) with its
    ``approximate`` in ``extra``."""
    return Problem(op, gate.dtype, gate.device, cols=gate.shape[-1] if gate.dim() else 1,
                   needs_grad=needs_grad(gate, up),
                   extra=dict(shape=tuple(gate.shape), up_shape=tuple(up.shape), up_dtype=up.dtype,
                              numel=max(gate.numel(), up.numel()), storage=all_have_storage(gate, up),
                              forward_ad=has_tangent(gate, up), **extra))


def _explain(gate, up):
    check_args(gate, up)
    return swiglu_problem(gate, up)


def _supports(forward_ad: str):
    """The kernel's ``supports`` of ``swiglu`` and ``geglu`` (one contract; ``forward_ad``: the reason for a dual
    tensor, naming the op's kernel)."""
    def supports(p: Problem) -> tuple[bool, str]:
        ok, why = kernel_input_ok(p, forward_ad, "gate")
        if not ok:
            return ok, why
        if p["up_dtype"] != p.dtype:
            return False, (f"up is {dtype_name(p['up_dtype'])} and gate {dtype_name(p.dtype)}: the kernel takes one "
                           "dtype")
        if p["up_shape"] != p["shape"]:
            return False, (f"up's shape {list(p['up_shape'])} differs from gate's {list(p['shape'])}: the kernel does "
                           "not broadcast")
        if p["numel"] == 0:
            return False, "an empty input"
        return True, ""
    return supports


_pipegoose_supports = _supports(FORWARD_AD_SWIGLU)
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


def _signature(gate: Any, up: Any, *extra: Any) -> tuple | None:
    if torch.compiler.is_compiling():
        return None
    try:
        if any_in_transform(gate, up) or in_dual_level():
            return None
        sig = (type(gate), gate.dtype, gate.device, gate.shape, gate.requires_grad, type(up), up.dtype, up.device,
               up.shape, up.requires_grad, torch.is_grad_enabled(), *extra)
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
    return _run(OP, gate, up, impl)


def silu_gate_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gate of transformers' gated RMSNorms (Qwen3-Next's, Qwen3.5's ``RMSNormGated``): ``(up *
    F.silu(gate.float())).to(up.dtype)``, in fp32 and rounded once, as the kernel computes ``swiglu`` (eager
    ``F.silu(gate) * up`` in 16-bit rounds twice)."""
    return (up * F.silu(gate.float())).to(up.dtype)


def run_silu_gate(gate: torch.Tensor, up: torch.Tensor, impl: str | None) -> torch.Tensor:
    """Op ``swiglu`` of ``gate`` and ``up`` (one shape and dtype) with :func:`silu_gate_reference` as its PyTorch
    path: the kernel where the dispatcher chooses it (its one rounding of the fp32 product), else the gated
    RMSNorm's own formula (:func:`pipegoose.nn.fusion.functional.rms_norm_gated`)."""
    return _run(OP, gate, up, impl, reference=silu_gate_reference)


def _run(op: str, gate: torch.Tensor, up: torch.Tensor, impl: str | None, *extra: Any,
         reference: Any = None) -> torch.Tensor:
    """:func:`run` of op ``swiglu`` or ``geglu`` (``extra``: the op's further arguments, ``approximate``);
    ``reference``: another PyTorch path than the op's (:func:`run_silu_gate`)."""
    check, problem, op_reference, ours = _GATED[op]
    reference = reference or op_reference
    if dispatch.compile_passthrough(op, impl):  # torch.compile fuses the two ops itself, after eager mode's checks
        check(gate, up, *extra)
        return reference(gate, up, *extra)
    if getattr(gate, "is_nested", False) or getattr(up, "is_nested", False):
        check(gate, up, *extra)
        dispatch.record(nested_fallback(op, impl))
        return reference(gate, up, *extra)
    sig = _signature(gate, up, *extra)
    key = None if sig is None else dispatch.choice_key(op, impl, sig)
    choice = None if key is None else dispatch.cached_choice(key)
    if choice is None:
        check(gate, up, *extra)
        choice = dispatch.choose(op, problem(gate, up, *extra), impl)
        if key is not None:
            dispatch.remember_choice(key, choice)
    dispatch.record(choice)
    if choice.impl == "pipegoose":
        return call_without_autocast(gate.device, ours, gate, up, *extra)
    return reference(gate, up, *extra)


# --------------------------------------------------------------------------------------------------------------------
# swiglu.packed: gate and up as the halves of x's last dimension (silu_and_mul)
# --------------------------------------------------------------------------------------------------------------------
PACKED_OP = "swiglu.packed"


def check_packed_args(x: Any) -> None:
    """Check ``x`` of :func:`pipegoose.nn.fusion.functional.silu_and_mul` (errors name the argument).

    Raises:
        TypeError: ``x`` not a floating point tensor, or of a dtype no path here takes (float8).
        ValueError: ``x`` of no dimension, or with an odd last dimension.
    """
    check_float_tensor(x, "x")
    if x.is_nested:   # (no .shape; a regular last dimension has a size, checked as a dense one's)
        try:
            last = x.size(-1)
        except RuntimeError:   # a ragged last dimension: the reference's chunk says what is wrong
            return
        if isinstance(last, int) and last % 2:
            raise ValueError(f"x: expected an even last dimension (gate and up are its two halves), got a nested "
                             f"tensor whose last dimension is {last}")
        return
    if x.dim() == 0:
        raise ValueError("x: expected at least one dimension (gate and up are the two halves of the last), got a "
                         "0-dim tensor")
    if x.shape[-1] % 2:
        raise ValueError(f"x: expected an even last dimension (gate and up are its two halves), got shape "
                         f"{list(x.shape)}")


def packed_problem(x: torch.Tensor, op: str = PACKED_OP, **extra: Any) -> Problem:
    """The dispatcher's description of one call of ``swiglu.packed`` (metadata only); ``cols`` is ``d``, half of
    the last dimension (the size of gate and of the output). ``op`` ``geglu.packed`` (:func:`geglu_packed_problem`)
    with its ``approximate`` in ``extra``."""
    return Problem(op, x.dtype, x.device, cols=x.shape[-1] // 2, needs_grad=needs_grad(x),
                   extra=dict(shape=tuple(x.shape), numel=x.numel(), storage=all_have_storage(x),
                              forward_ad=has_tangent(x), **extra))


def _explain_packed(x):
    check_packed_args(x)
    return packed_problem(x)


def _packed_supports(forward_ad: str, what: str = "x"):
    """The kernel's ``supports`` of the one-input ops, ``swiglu.packed``, ``geglu.packed``, ``gelu``, ``squared_relu``
    (``forward_ad``: the reason for a dual tensor, naming the op's kernel; ``what``: the input's name in the
    reasons)."""
    def supports(p: Problem) -> tuple[bool, str]:
        ok, why = kernel_input_ok(p, forward_ad, what)
        if not ok:
            return ok, why
        if p["numel"] == 0:
            return False, "an empty input"
        return True, ""
    return supports


_pipegoose_packed_supports = _packed_supports(FORWARD_AD_SWIGLU)
dispatch.register(Implementation(PACKED_OP, "pipegoose", "ours", _pipegoose_packed_supports, ("pipegoose/swiglu",),
                                 SRC_PIPEGOOSE))
dispatch.register(Implementation(PACKED_OP, "torch", "reference", lambda p: (True, ""), (),
                                 "PyTorch: gate, up = x.chunk(2, -1); F.silu(gate) * up", small_first=True))
dispatch.register_problem(PACKED_OP, _explain_packed)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """The PyTorch path: ``gate, up = x.chunk(2, dim=-1); F.silu(gate) * up`` (what Phi-3's MLP runs)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _run_pipegoose_packed(x: torch.Tensor) -> torch.Tensor:
    """pipegoose/swiglu through ``torch.ops.pipegoose.silu_and_mul(x)``: the forward kernel with its autograd
    formula in C++ (pipegoose/kernels/bindings/swiglu.cpp); a backward with ``create_graph=True`` differentiates the
    PyTorch formula of the kernel's numerics instead."""
    ops, why = dispatch.kernel("pipegoose/swiglu")
    if ops is None:
        raise RuntimeError(why)
    return ops.silu_and_mul.default(x)


def _packed_signature(x: Any, *extra: Any) -> tuple | None:
    if torch.compiler.is_compiling():
        return None
    try:
        if any_in_transform(x) or in_dual_level():
            return None
        sig = (type(x), x.dtype, x.device, x.shape, x.requires_grad, torch.is_grad_enabled(), *extra)
        hash(sig)
    except (AttributeError, TypeError):
        return None
    return sig


def run_packed(x: torch.Tensor, impl: str | None) -> torch.Tensor:
    """:func:`pipegoose.nn.fusion.functional.silu_and_mul` behind the checks; runs the implementation the dispatcher
    chooses (``impl``: a forced one or None).

    Raises:
        TypeError, ValueError: as :func:`check_packed_args`; ``impl`` naming no implementation of ``swiglu.packed``.
        FusionFallbackError: in strict mode, where the kernel cannot take the input.
    """
    return _run_packed(PACKED_OP, x, impl)


def _run_packed(op: str, x: torch.Tensor, impl: str | None, *extra: Any) -> torch.Tensor:
    """:func:`run_packed` of the one-input ops, ``swiglu.packed``, ``geglu.packed``, ``gelu`` and ``squared_relu``
    (``extra``: the op's further arguments, ``approximate``)."""
    check, problem, reference, ours = _PACKED[op]
    if dispatch.compile_passthrough(op, impl):  # torch.compile fuses the ops itself, after eager's checks
        check(x, *extra)
        return reference(x, *extra)
    if getattr(x, "is_nested", False):
        check(x, *extra)
        dispatch.record(nested_fallback(op, impl))
        return reference(x, *extra)
    sig = _packed_signature(x, *extra)
    key = None if sig is None else dispatch.choice_key(op, impl, sig)
    choice = None if key is None else dispatch.cached_choice(key)
    if choice is None:
        check(x, *extra)
        choice = dispatch.choose(op, problem(x, *extra), impl)
        if key is not None:
            dispatch.remember_choice(key, choice)
    dispatch.record(choice)
    if choice.impl == "pipegoose":
        return call_without_autocast(x.device, ours, x, *extra)
    return reference(x, *extra)


# --------------------------------------------------------------------------------------------------------------------
# geglu: gelu(gate) * up (Gemma's MLP), exact or with the tanh approximation
# --------------------------------------------------------------------------------------------------------------------
GEGLU_OP = "geglu"
APPROXIMATIONS = ("none", "tanh")
FORWARD_AD_GEGLU = ("a dual tensor (torch.autograd.forward_ad): the GeGLU kernel has no forward derivative (jvp); "
                    "PyTorch's ops have")


def check_approximate(approximate: Any) -> str:
    """``approximate`` of GeGLU as ``F.gelu`` takes it: ``"none"`` (exact, erf) or ``"tanh"``. Returns it.

    Raises:
        TypeError: not a str. ValueError: another str (both name ``approximate``).
    """
    if not isinstance(approximate, str):
        raise TypeError(f"approximate: expected 'none' or 'tanh' (str), got {type(approximate).__name__}")
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate: expected 'none' (exact GELU, erf) or 'tanh' (GELU's tanh approximation), "
                         f"got {approximate!r}")
    return approximate


def check_geglu_args(gate: Any, up: Any, approximate: Any) -> None:
    """Check the arguments of :func:`pipegoose.nn.fusion.functional.geglu` (errors name the argument).

    Raises:
        TypeError, ValueError: as :func:`check_args`, then as :func:`check_approximate`.
    """
    check_args(gate, up)
    check_approximate(approximate)


def geglu_problem(gate: torch.Tensor, up: torch.Tensor, approximate: str) -> Problem:
    """The dispatcher's description of one call of ``geglu`` (metadata only; ``approximate`` in ``extra``)."""
    return swiglu_problem(gate, up, GEGLU_OP, approximate=approximate)


def _explain_geglu(gate, up, approximate="tanh"):
    check_geglu_args(gate, up, approximate)
    return geglu_problem(gate, up, approximate)


dispatch.register(Implementation(GEGLU_OP, "pipegoose", "ours", _supports(FORWARD_AD_GEGLU), ("pipegoose/swiglu",),
                                 SRC_PIPEGOOSE))
dispatch.register(Implementation(GEGLU_OP, "torch", "reference", lambda p: (True, ""), (),
                                 "PyTorch: F.gelu(gate, approximate=approximate) * up", small_first=True))
dispatch.register_problem(GEGLU_OP, _explain_geglu)


def geglu_reference(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """The PyTorch path: ``F.gelu(gate, approximate=approximate) * up`` (broadcasting; the promoted dtype)."""
    return F.gelu(gate, approximate=approximate) * up


def _run_pipegoose_geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str) -> torch.Tensor:
    """pipegoose/swiglu through ``torch.ops.pipegoose.geglu(gate, up, approximate)``: the forward kernel with its
    autograd formula in C++ (pipegoose/kernels/bindings/swiglu.cpp), as :func:`_run_pipegoose`."""
    ops, why = dispatch.kernel("pipegoose/swiglu")
    if ops is None:
        raise RuntimeError(why)
    return ops.geglu.default(gate, up, approximate)


def run_geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str, impl: str | None) -> torch.Tensor:
    """:func:`pipegoose.nn.fusion.functional.geglu` behind the checks; runs the implementation the dispatcher
    chooses (``impl``: a forced one or None). The choice cache's signature holds ``approximate``.

    Raises:
        TypeError, ValueError: as :func:`check_geglu_args`; ``impl`` naming no implementation of ``geglu``.
        FusionFallbackError: in strict mode, where the kernel cannot take the input.
    """
    return _run(GEGLU_OP, gate, up, impl, approximate)


# op -> (check, problem, reference, our path) of the two-input gated ops (:func:`_run`)
_GATED = {OP: (check_args, swiglu_problem, swiglu_reference, _run_pipegoose),
          GEGLU_OP: (check_geglu_args, geglu_problem, geglu_reference, _run_pipegoose_geglu)}


# --------------------------------------------------------------------------------------------------------------------
# geglu.packed: geglu of the halves of x's last dimension (gelu_and_mul: Gemma 4's MoE experts)
# --------------------------------------------------------------------------------------------------------------------
GEGLU_PACKED_OP = "geglu.packed"


def check_geglu_packed_args(x: Any, approximate: Any) -> None:
    """Check the arguments of :func:`pipegoose.nn.fusion.functional.gelu_and_mul` (errors name the argument).

    Raises:
        TypeError, ValueError: as :func:`check_packed_args`, then as :func:`check_approximate`.
    """
    check_packed_args(x)
    check_approximate(approximate)


def geglu_packed_problem(x: torch.Tensor, approximate: str) -> Problem:
    """The dispatcher's description of one call of ``geglu.packed`` (metadata only; ``approximate`` in
    ``extra``)."""
    return packed_problem(x, GEGLU_PACKED_OP, approximate=approximate)


def _explain_geglu_packed(x, approximate="tanh"):
    check_geglu_packed_args(x, approximate)
    return geglu_packed_problem(x, approximate)


dispatch.register(Implementation(GEGLU_PACKED_OP, "pipegoose", "ours", _packed_supports(FORWARD_AD_GEGLU),
                                 ("pipegoose/swiglu",), SRC_PIPEGOOSE))
dispatch.register(Implementation(GEGLU_PACKED_OP, "torch", "reference", lambda p: (True, ""), (),
                                 "PyTorch: gate, up = x.chunk(2, -1); F.gelu(gate, approximate=approximate) * up",
                                 small_first=True))
dispatch.register_problem(GEGLU_PACKED_OP, _explain_geglu_packed)


def gelu_and_mul_reference(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """The PyTorch path: ``gate, up = x.chunk(2, dim=-1); F.gelu(gate, approximate=approximate) * up`` (what
    Gemma 4's experts run)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate=approximate) * up


def _run_pipegoose_geglu_packed(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """pipegoose/swiglu through ``torch.ops.pipegoose.gelu_and_mul(x, approximate)``, as
    :func:`_run_pipegoose_packed`."""
    ops, why = dispatch.kernel("pipegoose/swiglu")
    if ops is None:
        raise RuntimeError(why)
    return ops.gelu_and_mul.default(x, approximate)


def run_geglu_packed(x: torch.Tensor, approximate: str, impl: str | None) -> torch.Tensor:
    """:func:`pipegoose.nn.fusion.functional.gelu_and_mul` behind the checks; runs the implementation the
    dispatcher chooses (``impl``: a forced one or None). The choice cache's signature holds ``approximate``.

    Raises:
        TypeError, ValueError: as :func:`check_geglu_packed_args`; ``impl`` naming no implementation of
            ``geglu.packed``.
        FusionFallbackError: in strict mode, where the kernel cannot take the input.
    """
    return _run_packed(GEGLU_PACKED_OP, x, impl, approximate)


# op -> (check, problem, reference, our path) of the one-input ops (:func:`_run_packed`; gelu, squared_relu below)
_PACKED = {PACKED_OP: (check_packed_args, packed_problem, silu_and_mul_reference, _run_pipegoose_packed),
           GEGLU_PACKED_OP: (check_geglu_packed_args, geglu_packed_problem, gelu_and_mul_reference,
                             _run_pipegoose_geglu_packed)}


# --------------------------------------------------------------------------------------------------------------------
# gelu: GELU alone (the MLPs without a gate), exact or with the tanh approximation
# --------------------------------------------------------------------------------------------------------------------
GELU_OP = "gelu"
FORWARD_AD_GELU = ("a dual tensor (torch.autograd.forward_ad): the GELU kernel has no forward derivative (jvp); "
                   "PyTorch's F.gelu has")


def check_gelu_args(x: Any, approximate: Any) -> None:
    """Check the arguments of :func:`pipegoose.nn.fusion.functional.gelu` (errors name the argument).

    Raises:
        TypeError: ``x`` (the functional's ``input``, the name the errors give) not a floating point tensor, or of a
            dtype no path here takes (float8); ``approximate`` not a str. ValueError: ``approximate`` neither
            ``"none"`` nor ``"tanh"``.
    """
    check_float_tensor(x, "input")
    check_approximate(approximate)


def _elementwise_problem(op: str, x: torch.Tensor, **extra: Any) -> Problem:
    """The dispatcher's description of one call of a one-input elementwise op (``gelu``, ``squared_relu``; metadata
    only; ``extra``: the op's further arguments)."""
    return Problem(op, x.dtype, x.device, cols=x.shape[-1] if x.dim() else 1, needs_grad=needs_grad(x),
                   extra=dict(shape=tuple(x.shape), numel=x.numel(), storage=all_have_storage(x),
                              forward_ad=has_tangent(x), **extra))


def gelu_problem(x: torch.Tensor, approximate: str) -> Problem:
    """The dispatcher's description of one call of ``gelu`` (metadata only; ``approximate`` in ``extra``)."""
    return _elementwise_problem(GELU_OP, x, approximate=approximate)


def _explain_gelu(x, approximate="none"):
    check_gelu_args(x, approximate)
    return gelu_problem(x, approximate)


dispatch.register(Implementation(GELU_OP, "pipegoose", "ours", _packed_supports(FORWARD_AD_GELU, "input"),
                                 ("pipegoose/swiglu",), SRC_PIPEGOOSE))
dispatch.register(Implementation(GELU_OP, "torch", "reference", lambda p: (True, ""), (),
                                 "PyTorch: F.gelu(x, approximate=approximate)", small_first=True))
dispatch.register_problem(GELU_OP, _explain_gelu)


def gelu_reference(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """The PyTorch path: ``F.gelu(x, approximate=approximate)`` (one kernel of PyTorch's, fp32 math in 16-bit)."""
    return F.gelu(x, approximate=approximate)


def _run_pipegoose_gelu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """pipegoose/swiglu through ``torch.ops.pipegoose.gelu(x, approximate)``: the forward kernel with its autograd
    formula in C++ (pipegoose/kernels/bindings/swiglu.cpp), as :func:`_run_pipegoose`."""
    ops, why = dispatch.kernel("pipegoose/swiglu")
    if ops is None:
        raise RuntimeError(why)
    return ops.gelu.default(x, approximate)


def run_gelu(x: torch.Tensor, approximate: str, impl: str | None) -> torch.Tensor:
    """:func:`pipegoose.nn.fusion.functional.gelu` behind the checks; runs the implementation the dispatcher chooses
    (``impl``: a forced one or None). The choice cache's signature holds ``approximate``.

    Raises:
        TypeError, ValueError: as :func:`check_gelu_args`; ``impl`` naming no implementation of ``gelu``.
        FusionFallbackError: in strict mode, where the kernel cannot take the input.
    """
    return _run_packed(GELU_OP, x, impl, approximate)


_PACKED[GELU_OP] = (check_gelu_args, gelu_problem, gelu_reference, _run_pipegoose_gelu)


# --------------------------------------------------------------------------------------------------------------------
# squared_relu: relu(x)^2 alone (transformers' relu2: Nemotron's, Persimmon's, Arcee's MLPs without a gate)
# --------------------------------------------------------------------------------------------------------------------
SQUARED_RELU_OP = "squared_relu"
FORWARD_AD_SQUARED_RELU = ("a dual tensor (torch.autograd.forward_ad): the squared ReLU kernel has no forward "
                           "derivative (jvp); PyTorch's ops have")


def check_squared_relu_args(x: Any) -> None:
    """Check ``x`` of :func:`pipegoose.nn.fusion.functional.squared_relu` (errors name the argument).

    Raises:
        TypeError: ``x`` (the functional's ``input``, the name the errors give) not a floating point tensor, or of a
            dtype no path here takes (float8).
    """
    check_float_tensor(x, "input")


def squared_relu_problem(x: torch.Tensor) -> Problem:
    """The dispatcher's description of one call of ``squared_relu`` (metadata only)."""
    return _elementwise_problem(SQUARED_RELU_OP, x)


def _explain_squared_relu(x):
    check_squared_relu_args(x)
    return squared_relu_problem(x)


dispatch.register(Implementation(SQUARED_RELU_OP, "pipegoose", "ours",
                                 _packed_supports(FORWARD_AD_SQUARED_RELU, "input"), ("pipegoose/swiglu",),
                                 SRC_PIPEGOOSE))
dispatch.register(Implementation(SQUARED_RELU_OP, "torch", "reference", lambda p: (True, ""), (),
                                 "PyTorch: torch.square(F.relu(x)) (transformers' ReLUSquaredActivation)",
                                 small_first=True))
dispatch.register_problem(SQUARED_RELU_OP, _explain_squared_relu)


def squared_relu_reference(x: torch.Tensor) -> torch.Tensor:
    """The PyTorch path: ``torch.square(F.relu(x))``, what transformers' ``ReLUSquaredActivation`` runs (two kernels
    forward, saving ``relu(x)``; the kernel's values bit for bit)."""
    return torch.square(F.relu(x))


def _run_pipegoose_squared_relu(x: torch.Tensor) -> torch.Tensor:
    """pipegoose/swiglu through ``torch.ops.pipegoose.squared_relu(x)``: the forward kernel with its autograd formula
    in C++ (pipegoose/kernels/bindings/swiglu.cpp), as :func:`_run_pipegoose`."""
    ops, why = dispatch.kernel("pipegoose/swiglu")
    if ops is None:
        raise RuntimeError(why)
    return ops.squared_relu.default(x)


def run_squared_relu(x: torch.Tensor, impl: str | None) -> torch.Tensor:
    """:func:`pipegoose.nn.fusion.functional.squared_relu` behind the checks; runs the implementation the dispatcher
    chooses (``impl``: a forced one or None).

    Raises:
        TypeError: as :func:`check_squared_relu_args`. ValueError: ``impl`` naming no implementation of
            ``squared_relu``.
        FusionFallbackError: in strict mode, where the kernel cannot take the input.
    """
    return _run_packed(SQUARED_RELU_OP, x, impl)


_PACKED[SQUARED_RELU_OP] = (check_squared_relu_args, squared_relu_problem, squared_relu_reference,
                            _run_pipegoose_squared_relu)
