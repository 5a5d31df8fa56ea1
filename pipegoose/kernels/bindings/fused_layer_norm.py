"""Fake (meta) impls of ``pipegoose::fused_layer_norm_affine_*`` (Apex's mixed fused LayerNorm, ColossalAI 0.5.0 copy
``extensions/csrc/kernel/cuda/layer_norm_kernel.cu``): output in gamma's dtype with the input's shape, mean and
invvar float32 ``[rows]``; gradients in the input's / parameters' dtypes. Imported by the builder after loading."""

from __future__ import annotations

import math
from typing import Sequence

import torch


_HALF = (torch.float16, torch.bfloat16)
_TAKEN = (torch.float32, *_HALF)


def _rows(input: torch.Tensor, normalized_shape: Sequence[int]) -> int:
    return math.prod(input.shape[: input.dim() - len(normalized_shape)])


def _check(op: str, input: torch.Tensor, normalized_shape: Sequence[int], gamma: torch.Tensor,
           beta: torch.Tensor) -> None:
    """The metadata checks of the binding (fused_layer_norm.cpp check_common), so that a traced call the op refuses
    fails when traced, not at run time: shapes, dtypes, the hidden size limit."""
    shape = tuple(normalized_shape)
    trailing = tuple(input.shape[input.dim() - len(shape):]) if input.dim() >= len(shape) else None
    torch._check(len(shape) >= 1 and trailing == shape,
                 lambda: f"{op}: input's trailing dims must equal normalized_shape {list(shape)}, got input shape "
                         f"{list(input.shape)}")
    for name, t in (("gamma", gamma), ("beta", beta)):
        torch._check(tuple(t.shape) == shape,
                     lambda: f"{op}: {name} must have shape {list(shape)}, got {list(t.shape)}")
    torch._check(input.dtype in _TAKEN, lambda: f"{op}: input must be float32, float16 or bfloat16, got {input.dtype}")
    torch._check(beta.dtype == gamma.dtype,
                 lambda: f"{op}: beta must have gamma's dtype {gamma.dtype}, got {beta.dtype}")
    torch._check(gamma.dtype in _TAKEN if input.dtype == torch.float32 else gamma.dtype == input.dtype,
                 lambda: f"{op}: gamma/beta dtype {gamma.dtype} is not an output dtype for a {input.dtype} input")
    torch._check(1 <= math.prod(shape) <= 65536, lambda: f"{op}: normalized size must be in [1, 65536], got "
                                                         f"{math.prod(shape)}")


@torch.library.register_fake("pipegoose::fused_layer_norm_affine_forward")
def _forward_fake(input, normalized_shape, gamma, beta, eps):
    _check("fused_layer_norm_affine_forward", input, normalized_shape, gamma, beta)
    n1 = _rows(input, normalized_shape)
    return (input.new_empty(input.shape, dtype=gamma.dtype),
            input.new_empty((n1,), dtype=torch.float32),
            input.new_empty((n1,), dtype=torch.float32))


@torch.library.register_fake("pipegoose::fused_layer_norm_affine_backward")
def _backward_fake(dout, mean, invvar, input, normalized_shape, gamma, beta, eps):
    _check("fused_layer_norm_affine_backward", input, normalized_shape, gamma, beta)
    torch._check(dout.shape == input.shape and dout.dtype == gamma.dtype,
                 lambda: f"fused_layer_norm_affine_backward: dout must have the input's shape and gamma's dtype, got "
                         f"{list(dout.shape)} {dout.dtype}")
    return input.new_empty(input.shape), gamma.new_empty(gamma.shape), beta.new_empty(beta.shape)
