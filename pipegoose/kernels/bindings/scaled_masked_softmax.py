"""Fake (meta) impls of ``pipegoose::scaled_masked_softmax_*`` (Megatron-LM's fused scaled masked softmax, ColossalAI
0.5.0 copy ``extensions/csrc/kernel/cuda/scaled_masked_softmax_kernel.cu``): shapes and dtypes only, so that
``torch.compile`` traces the ops and ``torch.library.opcheck`` passes. Imported by the builder after loading."""

from __future__ import annotations

import torch


@torch.library.register_fake("pipegoose::scaled_masked_softmax_forward")
def _forward_fake(input: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    torch._check(input.dim() == 4, lambda: f"input must be 4-D [b, np, sq, sk], got {tuple(input.shape)}")
    return input.new_empty(input.shape)


@torch.library.register_fake("pipegoose::scaled_masked_softmax_backward")
def _backward_fake(output_grads: torch.Tensor, softmax_results: torch.Tensor, scale: float) -> torch.Tensor:
    torch._check(output_grads.shape == softmax_results.shape,
                 lambda: "softmax_results must have the shape of output_grads")
    return output_grads.new_empty(output_grads.shape)
