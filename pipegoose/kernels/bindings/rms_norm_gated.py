"""Fake (meta) impls of ``pipegoose::rms_norm_gated_forward``, ``pipegoose::rms_norm_gated_backward`` and
``pipegoose::rms_norm_gated`` (pipegoose's own gated RMSNorm, ``pipegoose/kernels/csrc/rms_norm_gated.cu``).

Shapes and dtypes, as the CUDA kernels return them: input and gate ``[..., D]``, rows = numel / D, groups =
D / group_size; forward -> output (the input's shape, ``out_dtype`` or the input's dtype) and rstd (float32
``[rows, groups]``); backward -> grad_input and grad_gate (the input's shape and dtype) and grad_weight (the weight's
shape and dtype, or an empty ``[0]`` tensor of the input's dtype when weight is None or ``weight_grad`` is False);
``rms_norm_gated`` (the forward with its autograd formula) -> the forward's output. Imported by the builder after the
library is loaded.
"""

from __future__ import annotations

import torch


def _rows_groups(input: torch.Tensor, group_size: int) -> tuple[int, int]:
    torch._check(input.dim() >= 1, lambda: "input: expected at least one dimension [..., D]")
    d = input.shape[-1]
    torch._check(d >= 1, lambda: f"input: expected a last dimension D >= 1, got shape {tuple(input.shape)}")
    torch._check(group_size >= 1 and d % group_size == 0,
                 lambda: f"group_size: expected a divisor of the last dimension {d}, got {group_size}")
    return input.numel() // d, d // group_size


@torch.library.register_fake("pipegoose::rms_norm_gated_forward")
def _forward_fake(input, gate, weight, eps, group_size, norm_before_gate, out_dtype):
    rows, groups = _rows_groups(input, group_size)
    return (input.new_empty(input.shape, dtype=out_dtype if out_dtype is not None else input.dtype),
            input.new_empty((rows, groups), dtype=torch.float32))


@torch.library.register_fake("pipegoose::rms_norm_gated_backward")
def _backward_fake(grad_output, input, gate, weight, rstd, group_size, norm_before_gate, weight_grad=True):
    _rows_groups(input, group_size)
    grad_weight = input.new_empty((0,)) if weight is None or not weight_grad else weight.new_empty(weight.shape)
    return input.new_empty(input.shape), input.new_empty(input.shape), grad_weight


@torch.library.register_fake("pipegoose::rms_norm_gated")
def _fake(input, gate, weight, eps, group_size, norm_before_gate, out_dtype):
    _rows_groups(input, group_size)
    return input.new_empty(input.shape, dtype=out_dtype if out_dtype is not None else input.dtype)
