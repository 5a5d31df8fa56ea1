"""Fake (meta) impls of ``pipegoose::fused_layer_norm_affine_*`` (Apex's mixed fused LayerNorm, ColossalAI 0.5.0 copy
``extensions/csrc/kernel/cuda/layer_norm_kernel.cu``): output in gamma's dtype with the input's shape, mean and
invvar float32 ``[rows]``; gradients in the input's / parameters' dtypes. Imported by the builder after loading."""

from __future__ import annotations

import math
from typing import Sequence

import torch


def _rows(input: torch.Tensor, normalized_shape: Sequence[int]) -> int:
    return math.prod(input.shape[: input.dim() - len(normalized_shape)])


@torch.library.register_fake("pipegoose::fused_layer_norm_affine_forward")
def _forward_fake(input, normalized_shape, gamma, beta, eps):
    n1 = _rows(input, normalized_shape)
    return (input.new_empty(input.shape, dtype=gamma.dtype),
            input.new_empty((n1,), dtype=torch.float32),
            input.new_empty((n1,), dtype=torch.float32))


@torch.library.register_fake("pipegoose::fused_layer_norm_affine_backward")
def _backward_fake(dout, mean, invvar, input, normalized_shape, gamma, beta, eps):
    return input.new_empty(input.shape), gamma.new_empty(gamma.shape), beta.new_empty(beta.shape)
