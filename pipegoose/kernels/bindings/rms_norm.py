"""Fake (meta) impls of ``pipegoose::rms_norm_forward``, ``pipegoose::rms_norm_backward`` and
``pipegoose::rms_norm`` (pipegoose's own RMSNorm, ``pipegoose/kernels/csrc/rms_norm.cu`` + ``norm_kernels.cuh``).

Shapes and dtypes, as the CUDA kernels return them: input ``[..., H]``, rows = numel / H;
forward -> output (the input's shape, ``out_dtype`` or the input's dtype) and rstd (float32 ``[rows]``);
backward -> grad_input (the input's shape and dtype) and grad_weight (the weight's shape and dtype, or an empty
``[0]`` tensor of the input's dtype when weight is None or ``weight_grad`` is False); ``rms_norm`` (the forward with
its autograd formula) -> the forward's output. Imported by the builder after the library is loaded.
"""

from __future__ import annotations

import torch


def _rows(input: torch.Tensor) -> int:
    torch._check(input.dim() >= 1, lambda: "input: expected at least one dimension [..., H]")
    h = input.shape[-1]
    torch._check(h >= 1, lambda: f"input: expected a last dimension H >= 1, got shape {tuple(input.shape)}")
    return input.numel() // h


@torch.library.register_fake("pipegoose::rms_norm_forward")
def _forward_fake(input, weight, eps, out_dtype):
    rows = _rows(input)
    return (input.new_empty(input.shape, dtype=out_dtype if out_dtype is not None else input.dtype),
            input.new_empty((rows,), dtype=torch.float32))


@torch.library.register_fake("pipegoose::rms_norm_backward")
def _backward_fake(grad_output, input, weight, rstd, weight_grad=True):
    _rows(input)
    grad_weight = input.new_empty((0,)) if weight is None or not weight_grad else weight.new_empty(weight.shape)
    return input.new_empty(input.shape), grad_weight


@torch.library.register_fake("pipegoose::rms_norm")
def _fake(input, weight, eps, out_dtype):
    _rows(input)
    return input.new_empty(input.shape, dtype=out_dtype if out_dtype is not None else input.dtype)
