"""Fake (meta) impls of ``pipegoose::layer_norm_forward``, ``pipegoose::layer_norm_backward`` and
``pipegoose::layer_norm`` (pipegoose's own LayerNorm, ``pipegoose/kernels/csrc/layer_norm.cu`` + ``norm_kernels.cuh``).

Shapes and dtypes, as the CUDA kernels return them: input ``[..., H]``, rows = numel / H;
forward -> output (the input's shape, ``out_dtype`` or the input's dtype), mean and rstd (float32 ``[rows]``);
backward -> grad_input (the input's shape and dtype), grad_weight / grad_bias (the parameter's shape and dtype,
or an empty ``[0]`` tensor of the input's dtype when the parameter is None or its ``weight_grad`` / ``bias_grad``
flag is False); ``layer_norm`` (the forward with its autograd formula) -> the forward's output. Imported by the builder after the library is loaded.
"""

from __future__ import annotations

import torch


def _rows(input: torch.Tensor) -> int:
    torch._check(input.dim() >= 1, lambda: "input: expected at least one dimension [..., H]")
    h = input.shape[-1]
    torch._check(h >= 1, lambda: f"input: expected a last dimension H >= 1, got shape {tuple(input.shape)}")
    return input.numel() // h


def _param_grad(p: torch.Tensor | None, input: torch.Tensor) -> torch.Tensor:
    return input.new_empty((0,)) if p is None else p.new_empty(p.shape)


@torch.library.register_fake("pipegoose::layer_norm_forward")
def _forward_fake(input, weight, bias, eps, out_dtype):
    rows = _rows(input)
    return (input.new_empty(input.shape, dtype=out_dtype if out_dtype is not None else input.dtype),
            input.new_empty((rows,), dtype=torch.float32),
            input.new_empty((rows,), dtype=torch.float32))


@torch.library.register_fake("pipegoose::layer_norm_backward")
def _backward_fake(grad_output, input, weight, bias, mean, rstd, weight_grad=True, bias_grad=True):
    _rows(input)
    return (input.new_empty(input.shape), _param_grad(weight if weight_grad else None, input),
            _param_grad(bias if bias_grad else None, input))


@torch.library.register_fake("pipegoose::layer_norm")
def _fake(input, weight, bias, eps, out_dtype):
    _rows(input)
    return input.new_empty(input.shape, dtype=out_dtype if out_dtype is not None else input.dtype)
