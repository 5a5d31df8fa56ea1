"""The float64 Adam/AdamW reference of the optimizer tests (CPU and GPU)."""

from __future__ import annotations

import torch


def adam64(p, grads, lr, betas, eps, wd, adam_w_mode, dtype):
    """float64 Adam/AdamW over the successive ``grads`` from zero moments. As the kernels do, a step reads p, m, v as
    stored, updates p with the new m and v before they are rounded, and stores all three rounded to ``dtype`` (in
    fp16 a small v rounds to zero: an update from the rounded v would be lr * m / eps)."""
    p = p.double()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    b1, b2 = betas
    for k, g in enumerate(grads, start=1):
        g = g.double()
        if adam_w_mode:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = (p - lr * (m / (1 - b1 ** k)) / ((v / (1 - b2 ** k)).sqrt() + eps)).to(dtype).double()
        m, v = m.to(dtype).double(), v.to(dtype).double()
    return p
