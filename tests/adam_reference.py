"""The float64 Adam/AdamW step of the optimizer tests (CPU and GPU), and the states they start from."""

from __future__ import annotations

import torch


def adam_state(shapes, dtype, device="cpu", seed=0):
    """Random parameters, gradients and moments of ``dtype``: exp_avg ~ 0.1 * N(0, 1), exp_avg_sq = 0.01 * |N(0, 1)|
    + 1e-4. A step from them is well conditioned: from zero moments the first update is lr * g / (|g| + eps), about
    lr * sign(g), and an L2-mode gradient g + wd * p that cancels to near zero takes either sign in fp32 and float64
    (the update differs by 2 * lr). With v this small against m the update is large enough that at step 1 with beta2
    0.999 a wrong step count (bias correction) fails the comparison in bf16 too."""
    g = torch.Generator().manual_seed(seed)

    def make(scale=1.0, positive=False):
        ts = [torch.randn(s, generator=g, dtype=torch.float64) * scale for s in shapes]
        return [(t.abs() + 1e-4 if positive else t).to(dtype).to(device) for t in ts]

    return make(), make(), make(0.1), make(0.01, positive=True)   # p, grad, exp_avg, exp_avg_sq


def adam_step64(p, g, m, v, step, lr, betas, eps, wd, adam_w_mode):
    """One Adam (L2) or AdamW (decoupled) step in float64 from the stored ``p``, ``m``, ``v``; ``step`` counts this
    step (bias correction ``1 - beta ** step``; None: no bias correction). Returns the new (p, m, v), unrounded."""
    p, g, m, v = (t.double().cpu() for t in (p, g, m, v))
    b1, b2 = betas
    if adam_w_mode:
        p = p * (1 - lr * wd)
    else:
        g = g + wd * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    c1, c2 = (1.0, 1.0) if step is None else (1 - b1 ** step, 1 - b2 ** step)
    p = p - lr * (m / c1) / ((v / c2).sqrt() + eps)
    return p, m, v
