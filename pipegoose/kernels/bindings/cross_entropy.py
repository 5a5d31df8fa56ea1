"""Fake (meta) impls of ``pipegoose::cross_entropy_forward``, ``cross_entropy_forward_reduced``,
``cross_entropy_backward`` and ``cross_entropy_backward_`` (pipegoose's softmax cross-entropy,
``pipegoose/kernels/csrc/cross_entropy.cu``).

Shapes and dtypes, as the CUDA kernels return them: ``logits`` [N, V], ``target`` int64 [N]; forward -> loss and lse,
float32 [N]; forward_reduced -> out (float32 []), lse (float32 [N]), count (int64 []); backward -> grad_logits
(contiguous [N, V], the logits' dtype); backward_ -> nothing (the gradient is written over ``logits``, which must be
contiguous). Imported by the builder after the library is loaded."""

from __future__ import annotations

import torch


def _check(logits: torch.Tensor, target: torch.Tensor) -> None:
    torch._check(logits.dim() == 2, lambda: f"logits: expected 2-D [N, V], got shape {tuple(logits.shape)}")
    torch._check(target.dim() == 1 and target.shape[0] == logits.shape[0],
                 lambda: f"target: expected 1-D with {logits.shape[0]} elements, got shape {tuple(target.shape)}")


@torch.library.register_fake("pipegoose::cross_entropy_forward")
def _forward_fake(logits, target, ignore_index):
    _check(logits, target)
    n = logits.shape[0]
    return (torch.empty((n,), dtype=torch.float32, device=logits.device),
            torch.empty((n,), dtype=torch.float32, device=logits.device))


@torch.library.register_fake("pipegoose::cross_entropy_forward_reduced")
def _forward_reduced_fake(logits, target, ignore_index, mean):
    _check(logits, target)
    return (torch.empty((), dtype=torch.float32, device=logits.device),
            torch.empty((logits.shape[0],), dtype=torch.float32, device=logits.device),
            torch.empty((), dtype=torch.int64, device=logits.device))


@torch.library.register_fake("pipegoose::cross_entropy_backward")
def _backward_fake(grad_loss, logits, target, lse, ignore_index):
    _check(logits, target)
    _check_rows(logits, grad_loss, lse)
    return torch.empty(tuple(logits.shape), dtype=logits.dtype, device=logits.device)


@torch.library.register_fake("pipegoose::cross_entropy_backward_")
def _backward_inplace_fake(grad_loss, logits, target, lse, ignore_index):
    _check(logits, target)
    _check_rows(logits, grad_loss, lse)
    torch._check(logits.is_contiguous(), lambda: f"logits must be contiguous (the gradient is written over it), "
                                                 f"got strides {logits.stride()}")


def _check_rows(logits, grad_loss, lse):
    """grad_loss and lse: one value per row, as the CUDA op checks (lse fp32)."""
    n = logits.shape[0]
    for name, t in (("grad_loss", grad_loss), ("lse", lse)):
        torch._check(t.dim() == 1 and t.shape[0] == n,
                     lambda: f"{name} must be 1-D with {n} elements, got shape {tuple(t.shape)}")
    torch._check(lse.dtype == torch.float32, lambda: f"lse must be float32, got {lse.dtype}")
