"""Fake (meta) impls of ``pipegoose::scaled_masked_softmax_*`` (Megatron-LM's fused scaled masked softmax, ColossalAI
0.5.0 copy ``extensions/csrc/kernel/cuda/scaled_masked_softmax_kernel.cu``): shapes and dtypes, with the binding's
metadata checks, so that ``torch.compile`` traces the ops and ``torch.library.opcheck`` passes. Imported by the
builder after loading."""

from __future__ import annotations

import torch


def _check_half(t: torch.Tensor, name: str) -> None:
    # the binding's check_half_or_bf16: the copies dispatch float16 and bfloat16 only
    torch._check(t.dtype in (torch.float16, torch.bfloat16),
                 lambda: f"{name} must be float16 or bfloat16, got {t.dtype}")


@torch.library.register_fake("pipegoose::scaled_masked_softmax_forward")
def _forward_fake(input: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    torch._check(input.dim() == 4, lambda: f"input must be 4-D [b, np, sq, sk], got {tuple(input.shape)}")
    _check_half(input, "input")
    b, _, sq, sk = input.shape
    torch._check(1 <= sk <= 2048, lambda: f"input: sk must be in [1, 2048], got {sk}")
    torch._check(mask.dtype in (torch.bool, torch.uint8), lambda: f"mask must be bool or uint8, got {mask.dtype}")
    torch._check(mask.dim() == 4 and mask.shape[0] in (1, b) and tuple(mask.shape[1:]) == (1, sq, sk),
                 lambda: f"mask must have shape [b or 1, 1, sq, sk] = [{b} or 1, 1, {sq}, {sk}], got "
                         f"{tuple(mask.shape)}")
    return input.new_empty(input.shape)


@torch.library.register_fake("pipegoose::scaled_masked_softmax_backward")
def _backward_fake(output_grads: torch.Tensor, softmax_results: torch.Tensor, scale: float) -> torch.Tensor:
    torch._check(output_grads.shape == softmax_results.shape and output_grads.dtype == softmax_results.dtype,
                 lambda: "softmax_results must have the shape and dtype of output_grads")
    _check_half(output_grads, "output_grads")
    return output_grads.new_empty(output_grads.shape)
