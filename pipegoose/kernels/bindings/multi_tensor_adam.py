"""Fake (meta) impl of ``pipegoose::multi_tensor_adam``: it only updates its mutable list arguments in place and returns
nothing, so the fake does nothing (shapes are unchanged); this makes ``torch.compile`` trace the op and
``torch.library.opcheck`` pass. Imported by the builder after loading.
Kernel: Apex's multi-tensor Adam (csrc/multi_tensor_adam.cu), ColossalAI 0.5.0 copy
``extensions/csrc/kernel/cuda/multi_tensor_adam_kernel.cu`` (Apache-2.0; kernels.yaml ``apex/multi_tensor_adam``)."""

from __future__ import annotations

import torch


@torch.library.register_fake("pipegoose::multi_tensor_adam")
def _fake(chunk_size, noop_flag, grads, params, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, step, adam_w_mode,
          bias_correction, weight_decay, div_scale) -> None:
    return None
