"""Fake (meta) impls of ``pipegoose::rope_forward``, ``pipegoose::rope_backward`` and ``pipegoose::rope``
(pipegoose's rotary position embedding, ``pipegoose/kernels/csrc/rope.cu``).

Shapes and dtypes, as the CUDA kernels return them: ``q`` ``[B, Hq, S, D]``, ``k`` ``[B, Hk, S, D]``, ``cos`` and
``sin`` ``[B or 1, S, D]``, one dtype; each output has its input's shape and dtype (``cos``'s dtype in the backward)
and the strides ``torch.empty_like`` gives it (the input's where it is dense, else dense strides in the input's
order of dimensions). Imported by the builder after the library is
loaded."""

from __future__ import annotations

import torch


def _check(qn, q, kn, k, cos, sin) -> None:
    torch._check(cos.dim() == 3, lambda: f"cos: expected 3 dimensions [batch or 1, seq, head_dim], got {cos.dim()}")
    torch._check(sin.shape == cos.shape, lambda: f"sin: expected cos's shape {tuple(cos.shape)}, got {tuple(sin.shape)}")
    torch._check(q.dim() == 4, lambda: f"{qn}: expected 4 dimensions [batch, heads, seq, head_dim], got {q.dim()}")
    torch._check(k.dim() == 4, lambda: f"{kn}: expected 4 dimensions [batch, heads, seq, head_dim], got {k.dim()}")
    torch._check(k.shape[0] == q.shape[0] and k.shape[2] == q.shape[2] and k.shape[3] == q.shape[3],
                 lambda: f"{kn}: shape {tuple(k.shape)} does not match {qn}'s {tuple(q.shape)} in batch, seq, head_dim")
    torch._check(q.shape[3] % 2 == 0, lambda: f"{qn}: head_dim must be even, got {q.shape[3]}")
    torch._check(cos.shape[1] == q.shape[2] and cos.shape[2] == q.shape[3]
                 and (cos.shape[0] == 1 or cos.shape[0] == q.shape[0]),
                 lambda: f"cos: shape {tuple(cos.shape)} is not [{q.shape[0]} or 1, {q.shape[2]}, {q.shape[3]}]")
    torch._check(sin.dtype == cos.dtype, lambda: f"sin: dtype {sin.dtype}, expected cos's {cos.dtype}")


def _same_dtype(q, k, cos) -> None:
    torch._check(q.dtype == cos.dtype and k.dtype == cos.dtype,
                 lambda: f"q is {q.dtype}, k {k.dtype} and cos {cos.dtype}; expected one dtype")


def _like(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t.dim() and t.stride(-1) != 1 and t.shape[-1] > 1:
        t = t.contiguous()
    return torch.empty_like(t, dtype=dtype)


@torch.library.register_fake("pipegoose::rope_forward")
def _forward_fake(q, k, cos, sin):
    _check("q", q, "k", k, cos, sin)
    _same_dtype(q, k, cos)
    return _like(q, q.dtype), _like(k, k.dtype)


@torch.library.register_fake("pipegoose::rope_backward")
def _backward_fake(grad_q_embed, grad_k_embed, cos, sin):
    _check("grad_q_embed", grad_q_embed, "grad_k_embed", grad_k_embed, cos, sin)
    return _like(grad_q_embed, cos.dtype), _like(grad_k_embed, cos.dtype)


@torch.library.register_fake("pipegoose::rope")
def _fake(q, k, cos, sin):
    _check("q", q, "k", k, cos, sin)
    _same_dtype(q, k, cos)
    return _like(q, q.dtype), _like(k, k.dtype)
