"""Fake (meta) impls of ``pipegoose::rope_forward``, ``pipegoose::rope_backward`` and ``pipegoose::rope``
(pipegoose's rotary position embedding, ``pipegoose/kernels/csrc/rope.cu``).

Shapes and dtypes, as the CUDA kernels return them: ``q`` ``[B, Hq, S, D]``, ``k`` ``[B, Hk, S, D]``, ``cos`` and
``sin`` ``[B or 1, S, R]`` (R the rotated values a head: D, or an even 2 <= R < D, partial rotary), one dtype or
16-bit q and k with fp32 tables (autocast); each output has its input's shape, the promoted dtype (fp32 for fp32
tables; the backward: ``dtype``, default cos's) and the strides ``torch.empty_like`` gives it (the input's where it is
dense, else dense strides in the input's order of dimensions); ``interleaved`` (the rotation of neighbouring pairs)
changes no shape, dtype or stride. Imported by the builder after the library is loaded."""

from __future__ import annotations

import torch


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _check(qn, q, kn, k, cos, sin) -> None:
    torch._check(cos.dtype in _FLOATS, lambda: f"cos: dtype {cos.dtype}, expected float32, float16 or bfloat16")
    for name, t in ((qn, q), (kn, k), ("sin", sin)):
        torch._check(t.device == cos.device, lambda: f"{name}: on {t.device}, expected cos's device {cos.device}")
    torch._check(q.dtype.is_floating_point and k.dtype.is_floating_point,
                 lambda: f"{qn} and {kn}: expected floating point tensors, got {q.dtype} and {k.dtype}")
    torch._check(cos.dim() == 3, lambda: f"cos: expected 3 dimensions [batch or 1, seq, rotated dims], got {cos.dim()}")
    torch._check(sin.shape == cos.shape,
                 lambda: f"sin: expected cos's shape {tuple(cos.shape)}, got {tuple(sin.shape)}")
    torch._check(q.dim() == 4, lambda: f"{qn}: expected 4 dimensions [batch, heads, seq, head_dim], got {q.dim()}")
    torch._check(k.dim() == 4, lambda: f"{kn}: expected 4 dimensions [batch, heads, seq, head_dim], got {k.dim()}")
    torch._check(k.shape[0] == q.shape[0] and k.shape[2] == q.shape[2] and k.shape[3] == q.shape[3],
                 lambda: f"{kn}: shape {tuple(k.shape)} does not match {qn}'s {tuple(q.shape)} in batch, seq, head_dim")
    d, r = q.shape[3], cos.shape[2]
    torch._check(cos.shape[1] == q.shape[2] and (r == d or 2 <= r < d)
                 and (cos.shape[0] == 1 or cos.shape[0] == q.shape[0]),
                 lambda: f"cos: shape {tuple(cos.shape)} is not [{q.shape[0]} or 1, {q.shape[2]}, R], R {d} or 2 to "
                         f"{d - 1} (partial rotary)")
    torch._check(r % 2 == 0, lambda: f"{qn}: head_dim must be even, got {d}" if r == d else
                 f"cos: its last size (the rotated values a head) must be even, got {r}")
    torch._check(sin.dtype == cos.dtype, lambda: f"sin: dtype {sin.dtype}, expected cos's {cos.dtype}")


_HALF = (torch.float16, torch.bfloat16)


def _forward_dtype(q, k, cos) -> torch.dtype:
    """The results' dtype: q's, or fp32 for 16-bit q and k with fp32 tables (autocast; PyTorch's promotion)."""
    torch._check(k.dtype == q.dtype, lambda: f"k is {k.dtype} but q is {q.dtype}; expected one dtype")
    torch._check(cos.dtype == q.dtype or (cos.dtype == torch.float32 and q.dtype in _HALF),
                 lambda: f"q is {q.dtype} and cos {cos.dtype}; expected one dtype, or 16-bit q with float32 cos")
    return torch.float32 if cos.dtype == torch.float32 else q.dtype


def _backward_dtype(cos, dtype) -> torch.dtype:
    out = cos.dtype if dtype is None else dtype
    torch._check(out == cos.dtype or (cos.dtype == torch.float32 and out in _HALF),
                 lambda: f"dtype {out} with cos of {cos.dtype}; expected cos's dtype, or 16-bit with float32 cos")
    return out


def _like(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t.dim() and t.stride(-1) != 1 and t.shape[-1] > 1:
        t = t.contiguous()
    return torch.empty_like(t, dtype=dtype)


@torch.library.register_fake("pipegoose::rope_forward")
def _forward_fake(q, k, cos, sin, interleaved=False):
    _check("q", q, "k", k, cos, sin)
    out = _forward_dtype(q, k, cos)
    return _like(q, out), _like(k, out)


@torch.library.register_fake("pipegoose::rope_backward")
def _backward_fake(grad_q_embed, grad_k_embed, cos, sin, dtype=None, interleaved=False):
    _check("grad_q_embed", grad_q_embed, "grad_k_embed", grad_k_embed, cos, sin)
    out = _backward_dtype(cos, dtype)
    return _like(grad_q_embed, out), _like(grad_k_embed, out)


@torch.library.register_fake("pipegoose::rope")
def _fake(q, k, cos, sin, interleaved=False):
    _check("q", q, "k", k, cos, sin)
    out = _forward_dtype(q, k, cos)
    return _like(q, out), _like(k, out)
