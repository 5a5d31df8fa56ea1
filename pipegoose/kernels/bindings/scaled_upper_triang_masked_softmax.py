"""Fake (meta) impls of ``pipegoose::scaled_upper_triang_masked_softmax_*`` (Megatron-LM's fused causal softmax,
ColossalAI 0.5.0 copy ``extensions/csrc/kernel/cuda/scaled_upper_triang_masked_softmax_kernel.cu``): shapes and
dtypes only, for ``torch.compile`` and ``torch.library.opcheck``. Imported by the builder after loading."""

from __future__ import annotations

import torch


@torch.library.register_fake("pipegoose::scaled_upper_triang_masked_softmax_forward")
def _forward_fake(input: torch.Tensor, scale: float) -> torch.Tensor:
    torch._check(input.dim() == 3, lambda: f"input must be 3-D [attn_batches, sq, sk], got {tuple(input.shape)}")
    return input.new_empty(input.shape)


@torch.library.register_fake("pipegoose::scaled_upper_triang_masked_softmax_backward")
def _backward_fake(output_grads: torch.Tensor, softmax_results: torch.Tensor, scale: float) -> torch.Tensor:
    torch._check(output_grads.shape == softmax_results.shape,
                 lambda: "softmax_results must have the shape of output_grads")
    return output_grads.new_empty(output_grads.shape)
