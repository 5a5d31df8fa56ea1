"""Fake (meta) impl of ``pipegoose::multi_tensor_scale``: it only updates its mutable list arguments in place and
returns nothing, so the fake does nothing (shapes are unchanged); this makes ``torch.compile`` trace the op and
``torch.library.opcheck`` pass. Imported by the builder after loading.
Kernel: Apex's multi-tensor scale (csrc/multi_tensor_scale_kernel.cu), ColossalAI 0.5.0 copy
``extensions/csrc/kernel/cuda/multi_tensor_scale_kernel.cu`` (Apache-2.0; kernels.yaml ``apex/multi_tensor_scale``)."""

from __future__ import annotations

import torch


@torch.library.register_fake("pipegoose::multi_tensor_scale")
def _fake(chunk_size, noop_flag, src, dst, scale) -> None:
    return None
