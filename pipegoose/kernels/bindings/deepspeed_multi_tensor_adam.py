"""Fake (meta) impl of ``pipegoose::deepspeed_multi_tensor_adam``: it only updates its mutable list arguments in place
and returns nothing, so the fake does nothing (shapes are unchanged); this makes ``torch.compile`` trace the op and
``torch.library.opcheck`` pass. Imported by the builder after loading.
Kernel: DeepSpeed 0.19.8 ``csrc/adam/multi_tensor_adam.cu`` (Apache-2.0, adapted from Apex's; kernels.yaml
``deepspeed/multi_tensor_adam``)."""

from __future__ import annotations

import torch


@torch.library.register_fake("pipegoose::deepspeed_multi_tensor_adam")
def _fake(chunk_size, noop_flag, grads, params, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, step, adam_w_mode,
          bias_correction, weight_decay) -> None:
    return None
