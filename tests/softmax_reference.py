"""The reference softmax of the GPU tests (tests/fusion/test_fusion_cuda.py, tests/kernels/test_fuzz_cuda.py)."""

from __future__ import annotations

import torch


def softmax_ref(x: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool) -> torch.Tensor:
    """``softmax(scale * x)`` over the last dim in ``x``'s dtype (pass float64), keys masked where ``mask`` is True and,
    with ``causal``, key j for query i where j > i + sk - sq (bottom-right aligned); rows with no visible key give
    zeros, as the fused kernels do (PyTorch's softmax gives NaN there)."""
    s = x * scale
    if causal:
        sq, sk = x.shape[-2], x.shape[-1]
        cm = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(sk - sq + 1)
        mask = cm if mask is None else mask | cm
    if mask is None:
        return torch.softmax(s, -1)
    y = torch.softmax(s.masked_fill(mask, float("-inf")), -1)
    return torch.where(mask.all(-1, keepdim=True), torch.zeros_like(y), y)
