"""Fake (meta) impls of ``pipegoose::softmax_forward`` / ``pipegoose::softmax_backward`` (pipegoose's own fused
softmax, ``pipegoose/kernels/csrc/softmax.cu`` + ``softmax.cuh`` + ``softmax_{fp32,fp16,bf16}.cu``).

Both ops return a new contiguous tensor with the shape and dtype of ``input`` (forward) / ``output`` (backward),
as the CUDA kernels do, whatever the strides of the arguments. Imported by the builder after the library is loaded
(``torch.library.register_fake`` needs the op to exist).
"""

from __future__ import annotations

import torch


@torch.library.register_fake("pipegoose::softmax_forward")
def _softmax_forward_fake(input, mask, scale, causal):
    torch._check(input.dim() >= 1, lambda: "pipegoose::softmax_forward: input must have at least 1 dimension")
    torch._check(not causal or input.dim() >= 2,
                 lambda: "pipegoose::softmax_forward: causal=True needs input [..., sq, sk]")
    return torch.empty_like(input, memory_format=torch.contiguous_format)


@torch.library.register_fake("pipegoose::softmax_backward")
def _softmax_backward_fake(grad_output, output, scale, causal=False):
    torch._check(grad_output.shape == output.shape,
                 lambda: f"pipegoose::softmax_backward: grad_output must have output's shape {tuple(output.shape)}")
    return torch.empty_like(output, memory_format=torch.contiguous_format)
