"""Fake (meta) impl of ``pipegoose::multi_tensor_l2norm`` (Apex's multi-tensor L2 norm, ColossalAI 0.5.0 copy
``extensions/csrc/kernel/cuda/multi_tensor_l2norm_kernel.cu``): a float32 ``[1]`` global norm and float32 per-tensor
norms ``[len(tensors)]`` (``[0]`` when ``per_tensor`` is False), on noop_flag's device. Imported by the builder."""

from __future__ import annotations

import torch


@torch.library.register_fake("pipegoose::multi_tensor_l2norm")
def _fake(chunk_size, noop_flag, tensors, per_tensor):
    n = len(tensors) if per_tensor else 0
    return (noop_flag.new_empty((1,), dtype=torch.float32), noop_flag.new_empty((n,), dtype=torch.float32))
