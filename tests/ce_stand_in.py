"""A float64 stand-in on the CPU for the cross-entropy kernel's ops (``torch.ops.pipegoose.cross_entropy_*``), for
the CPU tests of the Python code around them (the autograd Functions of ``pipegoose.nn.fusion.ops.cross_entropy`` and
``linear_cross_entropy``): ``monkeypatch.setattr(cross_entropy, "_ops", lambda: stand_in_ops(calls))``."""

from __future__ import annotations

from types import SimpleNamespace

import torch


def stand_in_ops(calls: list) -> SimpleNamespace:
    """``cross_entropy_forward``, ``cross_entropy_forward_reduced``, ``cross_entropy_backward`` and
    ``cross_entropy_backward_`` (the gradient written over the logits) as the kernel defines them (float64 math,
    results in the kernel's dtypes: fp32 loss and lse, 0 for ignored rows, NaN for targets out of range; the
    gradient in the logits' dtype), on the CPU; each call appended to ``calls``."""
    def forward(logits, target, ignore_index):
        calls.append(("forward", ignore_index))
        x = logits.double()
        lse = torch.logsumexp(x, 1)
        ignored = target == ignore_index
        valid = (target >= 0) & (target < x.shape[1]) & ~ignored
        picked = x.gather(1, target.clamp(0, x.shape[1] - 1)[:, None])[:, 0]
        loss = torch.where(valid, lse - picked, torch.nan).masked_fill(ignored, 0)
        return loss.float(), lse.masked_fill(ignored, 0).float()

    def forward_reduced(logits, target, ignore_index, mean):
        calls.append(("forward_reduced", ignore_index))
        rows, lse = forward(logits, target, ignore_index)
        calls.pop()
        count = (target != ignore_index).sum()
        total = rows.double().sum()
        return (total / count if mean else total).float(), lse, count

    def backward(grad_loss, logits, target, lse, ignore_index):
        calls.append(("backward", ignore_index))
        assert grad_loss.shape == target.shape, "grad_loss: one value per row (expanded from a reduced loss's)"
        x = logits.double()
        ignored = target == ignore_index
        valid = (target >= 0) & (target < x.shape[1]) & ~ignored
        p = torch.exp(x - lse.double()[:, None])
        p[valid, target[valid]] -= 1
        g = (p * grad_loss.double()[:, None]).masked_fill(ignored[:, None], 0)
        g[~valid & ~ignored] = torch.nan
        return g.to(logits.dtype)

    def backward_(grad_loss, logits, target, lse, ignore_index):
        assert logits.is_contiguous(), "logits: the in-place backward takes contiguous logits"
        logits.copy_(backward(grad_loss, logits, target, lse, ignore_index))
        calls[-1] = ("backward_", ignore_index)

    return SimpleNamespace(cross_entropy_forward=forward, cross_entropy_forward_reduced=forward_reduced,
                           cross_entropy_backward=backward, cross_entropy_backward_=backward_)
