"""Fake (meta) impl of ``pipegoose::adam_step`` (pipegoose's multi-tensor Adam / AdamW step,
``pipegoose/kernels/csrc/multi_tensor_adam.cu``): it only updates its mutable list arguments in place and returns
nothing, so the fake does nothing (shapes are unchanged); ``torch.compile`` can trace the op and
``torch.library.opcheck`` passes. Imported by the builder after loading."""

from __future__ import annotations

import torch


@torch.library.register_fake("pipegoose::adam_step")
def _fake(grads, params, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, step, adam_w_mode, bias_correction,
          weight_decay) -> None:
    return None
