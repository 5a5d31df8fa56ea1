"""Fake (meta) impls of ``pipegoose::swiglu_forward``, ``pipegoose::swiglu_backward``, ``pipegoose::swiglu``,
``pipegoose::silu_and_mul_forward``, ``pipegoose::silu_and_mul_backward``, ``pipegoose::silu_and_mul`` and
``pipegoose::geglu_forward``, ``pipegoose::geglu_backward``, ``pipegoose::geglu``,
``pipegoose::gelu_and_mul_forward``, ``pipegoose::gelu_and_mul_backward``, ``pipegoose::gelu_and_mul`` and
``pipegoose::gelu_forward``, ``pipegoose::gelu_backward``, ``pipegoose::gelu`` and ``pipegoose::squared_relu_forward``,
``pipegoose::squared_relu_backward``, ``pipegoose::squared_relu`` (pipegoose's SwiGLU, GeGLU, GELU and squared ReLU
activations, ``pipegoose/kernels/csrc/swiglu.cu``).

Shapes and dtypes, as the CUDA kernels return them: ``gate`` and ``up`` of one shape and dtype; forward -> ``out``
(contiguous, gate's shape and dtype); backward -> ``grad_gate`` and ``grad_up`` (the same). ``silu_and_mul``: ``x``
``[..., 2d]`` -> ``out`` ``[..., d]``; backward(``grad_output`` ``[..., d]``, ``x``) -> ``grad_x`` ``[..., 2d]``
(contiguous, x's dtype). ``geglu``: as ``swiglu``, with ``approximate`` ``"tanh"`` or ``"none"`` (another string:
the check fails naming ``approximate``, as the kernels' RuntimeError does); ``gelu_and_mul``: as ``silu_and_mul``,
with ``approximate``. ``gelu``: ``x`` -> ``out`` (contiguous, x's shape and dtype); backward(``grad_output`` of x's
shape, ``x``) -> ``grad_x`` (the same), with ``approximate`` (default ``"none"``, as ``F.gelu``). ``squared_relu``: as
``gelu`` without ``approximate``. Imported by the builder after the library is loaded."""

from __future__ import annotations

import torch


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _kernel_dtype(t: torch.Tensor, name: str) -> None:
    torch._check(t.dtype in _KERNEL_DTYPES, lambda: f"{name}: expected float32, float16 or bfloat16, got {t.dtype}")


def _grad_output(grad_output: torch.Tensor, like: torch.Tensor, name: str) -> None:
    torch._check(grad_output.dtype.is_floating_point,
                 lambda: f"grad_output: expected a floating point tensor, got {grad_output.dtype}")
    torch._check(grad_output.device == like.device,
                 lambda: f"grad_output: on {grad_output.device}, expected {name}'s device {like.device}")


def _pair(gate: torch.Tensor, up: torch.Tensor) -> None:
    _kernel_dtype(gate, "gate")
    torch._check(gate.device == up.device, lambda: f"up: on {up.device}, expected gate's device {gate.device}")
    torch._check(gate.shape == up.shape,
                 lambda: f"up: expected gate's shape {tuple(gate.shape)}, got {tuple(up.shape)}")
    torch._check(gate.dtype == up.dtype, lambda: f"up: expected gate's dtype {gate.dtype}, got {up.dtype}")


@torch.library.register_fake("pipegoose::swiglu_forward")
def _forward_fake(gate, up):
    _pair(gate, up)
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


@torch.library.register_fake("pipegoose::swiglu_backward")
def _backward_fake(grad_output, gate, up):
    _pair(gate, up)
    _grad_output(grad_output, gate, "gate")
    torch._check(grad_output.shape == gate.shape,
                 lambda: f"grad_output: expected gate's shape {tuple(gate.shape)}, got {tuple(grad_output.shape)}")
    return (torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
            torch.empty(gate.shape, dtype=gate.dtype, device=gate.device))


@torch.library.register_fake("pipegoose::swiglu")
def _fake(gate, up):
    _pair(gate, up)
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


def _half_shape(x: torch.Tensor) -> tuple:
    _kernel_dtype(x, "x")
    torch._check(x.dim() >= 1, lambda: "x: expected at least one dimension (gate and up are the halves of the last)")
    torch._check(x.shape[-1] % 2 == 0, lambda: f"x: expected an even last dimension, got {x.shape[-1]}")
    return (*x.shape[:-1], x.shape[-1] // 2)


@torch.library.register_fake("pipegoose::silu_and_mul_forward")
def _packed_forward_fake(x):
    return torch.empty(_half_shape(x), dtype=x.dtype, device=x.device)


@torch.library.register_fake("pipegoose::silu_and_mul_backward")
def _packed_backward_fake(grad_output, x):
    half = _half_shape(x)
    _grad_output(grad_output, x, "x")
    torch._check(tuple(grad_output.shape) == half,
                 lambda: f"grad_output: expected shape {half} (x's with the last dimension halved), got "
                 f"{tuple(grad_output.shape)}")
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.register_fake("pipegoose::silu_and_mul")
def _packed_fake(x):
    return torch.empty(_half_shape(x), dtype=x.dtype, device=x.device)


def _approximate(approximate: str) -> None:
    torch._check(approximate in ("tanh", "none"),
                 lambda: f"approximate: expected 'tanh' or 'none', got {approximate!r}")


@torch.library.register_fake("pipegoose::geglu_forward")
def _geglu_forward_fake(gate, up, approximate="tanh"):
    _pair(gate, up)
    _approximate(approximate)
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


@torch.library.register_fake("pipegoose::geglu_backward")
def _geglu_backward_fake(grad_output, gate, up, approximate="tanh"):
    _backward_fake(grad_output, gate, up)
    _approximate(approximate)
    return (torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
            torch.empty(gate.shape, dtype=gate.dtype, device=gate.device))


@torch.library.register_fake("pipegoose::geglu")
def _geglu_fake(gate, up, approximate="tanh"):
    return _geglu_forward_fake(gate, up, approximate)


@torch.library.register_fake("pipegoose::gelu_and_mul_forward")
def _gelu_packed_forward_fake(x, approximate="tanh"):
    _approximate(approximate)
    return _packed_forward_fake(x)


@torch.library.register_fake("pipegoose::gelu_and_mul_backward")
def _gelu_packed_backward_fake(grad_output, x, approximate="tanh"):
    _approximate(approximate)
    return _packed_backward_fake(grad_output, x)


@torch.library.register_fake("pipegoose::gelu_and_mul")
def _gelu_packed_fake(x, approximate="tanh"):
    return _gelu_packed_forward_fake(x, approximate)


def _unary_forward_fake(x):
    """gelu_forward's and squared_relu_forward's output: x's shape and dtype, contiguous."""
    _kernel_dtype(x, "x")
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _unary_backward_fake(grad_output, x):
    """gelu_backward's and squared_relu_backward's grad_x: x's shape and dtype, contiguous."""
    _kernel_dtype(x, "x")
    _grad_output(grad_output, x, "x")
    torch._check(grad_output.shape == x.shape,
                 lambda: f"grad_output: expected x's shape {tuple(x.shape)}, got {tuple(grad_output.shape)}")
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.register_fake("pipegoose::gelu_forward")
def _gelu_forward_fake(x, approximate="none"):
    _approximate(approximate)
    return _unary_forward_fake(x)


@torch.library.register_fake("pipegoose::gelu_backward")
def _gelu_backward_fake(grad_output, x, approximate="none"):
    _approximate(approximate)
    return _unary_backward_fake(grad_output, x)


@torch.library.register_fake("pipegoose::gelu")
def _gelu_fake(x, approximate="none"):
    return _gelu_forward_fake(x, approximate)


torch.library.register_fake("pipegoose::squared_relu_forward")(_unary_forward_fake)
torch.library.register_fake("pipegoose::squared_relu_backward")(_unary_backward_fake)
torch.library.register_fake("pipegoose::squared_relu")(_unary_forward_fake)
