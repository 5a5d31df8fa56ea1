"""Fake (meta) impls of ``pipegoose::swiglu_forward``, ``pipegoose::swiglu_backward`` and ``pipegoose::swiglu``
(pipegoose's SwiGLU activation, ``pipegoose/kernels/csrc/swiglu.cu``).

Shapes and dtypes, as the CUDA kernels return them: ``gate`` and ``up`` of one shape and dtype; forward -> ``out``
(contiguous, gate's shape and dtype); backward -> ``grad_gate`` and ``grad_up`` (the same). Imported by the builder
after the library is loaded."""

from __future__ import annotations

import torch


def _pair(gate: torch.Tensor, up: torch.Tensor) -> None:
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
    torch._check(grad_output.shape == gate.shape,
                 lambda: f"grad_output: expected gate's shape {tuple(gate.shape)}, got {tuple(grad_output.shape)}")
    return (torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
            torch.empty(gate.shape, dtype=gate.dtype, device=gate.device))


@torch.library.register_fake("pipegoose::swiglu")
def _fake(gate, up):
    _pair(gate, up)
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
