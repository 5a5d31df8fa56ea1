"""Fake (meta) impls of pipegoose's gradient clipping ops (``pipegoose/kernels/csrc/clip_grad_norm.cu``), with the
binding's metadata checks, so that a trace under ``torch.compile`` refuses what the kernel would:

* ``pipegoose::multi_tensor_norm(tensors, norm_type)``: a float32 scalar (shape ``()``) on the tensors' device;
* ``pipegoose::multi_tensor_mul_(tensors, coef)``: updates its list in place and returns nothing.

Imported by the builder after loading."""

from __future__ import annotations

import math

import torch

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(op: str, tensors) -> torch.Tensor:
    if len(tensors) == 0:
        raise RuntimeError(f"{op}: tensors must hold at least one tensor, got an empty list")
    first = tensors[0]
    if first.dtype not in _DTYPES:
        raise RuntimeError(f"{op}: tensors must be float32, float16 or bfloat16, got {first.dtype} for tensors[0]")
    for i, t in enumerate(tensors):
        if t.device != first.device:
            raise RuntimeError(f"{op}: tensors[{i}] is on {t.device} but tensors[0] is on {first.device}; expected one "
                               "CUDA device")
        if t.dtype != first.dtype:
            raise RuntimeError(f"{op}: tensors[{i}] is {t.dtype} but tensors[0] is {first.dtype}; the kernel takes "
                               "one dtype for every tensor")
        if not t.is_contiguous():
            raise RuntimeError(f"{op}: tensors[{i}] must be contiguous, got strides {list(t.stride())} for sizes "
                               f"{list(t.shape)}")
    return first


@torch.library.register_fake("pipegoose::multi_tensor_norm")
def _norm_fake(tensors, norm_type):
    first = _check("pipegoose::multi_tensor_norm", tensors)
    if norm_type not in (1.0, 2.0, math.inf):
        raise RuntimeError(f"pipegoose::multi_tensor_norm: norm_type must be 1, 2 or inf, got {norm_type}")
    return first.new_empty((), dtype=torch.float32)


@torch.library.register_fake("pipegoose::multi_tensor_mul_")
def _mul_fake(tensors, coef) -> None:
    first = _check("pipegoose::multi_tensor_mul_", tensors)
    if coef.numel() != 1 or coef.dtype != torch.float32:
        raise RuntimeError(f"pipegoose::multi_tensor_mul_: coef must be a float32 tensor of one element, got "
                           f"{coef.dtype} with {coef.numel()} elements")
    if coef.device != first.device:
        raise RuntimeError(f"pipegoose::multi_tensor_mul_: coef is on {coef.device} but tensors[0] is on "
                           f"{first.device}; expected the tensors' device")
    return None
