"""Fake (meta) impls of ``pipegoose::scaled_upper_triang_masked_softmax_*`` (Megatron-LM's fused causal softmax,
ColossalAI 0.5.0 copy ``extensions/csrc/kernel/cuda/scaled_upper_triang_masked_softmax_kernel.cu``): shapes and
dtypes, with the binding's metadata checks, for ``torch.compile`` and ``torch.library.opcheck``. Imported by the
builder after loading."""

from __future__ import annotations

import torch


def _check_half(t: torch.Tensor, name: str) -> None:
    # the binding's check_half_or_bf16: the copies dispatch float16 and bfloat16 only
    torch._check(t.dtype in (torch.float16, torch.bfloat16),
                 lambda: f"{name} must be float16 or bfloat16, got {t.dtype}")


@torch.library.register_fake("pipegoose::scaled_upper_triang_masked_softmax_forward")
def _forward_fake(input: torch.Tensor, scale: float) -> torch.Tensor:
    torch._check(input.dim() == 3, lambda: f"input must be 3-D [attn_batches, sq, sk], got {tuple(input.shape)}")
    _check_half(input, "input")
    torch._check(input.shape[1] == input.shape[2] and 1 <= input.shape[2] <= 2048,
                 lambda: f"input must be square in its last two dims with sk in [1, 2048], got {tuple(input.shape)}")
    return input.new_empty(input.shape)


@torch.library.register_fake("pipegoose::scaled_upper_triang_masked_softmax_backward")
def _backward_fake(output_grads: torch.Tensor, softmax_results: torch.Tensor, scale: float) -> torch.Tensor:
    torch._check(output_grads.shape == softmax_results.shape and output_grads.dtype == softmax_results.dtype,
                 lambda: "softmax_results must have the shape and dtype of output_grads")
    _check_half(output_grads, "output_grads")
    return output_grads.new_empty(output_grads.shape)
