"""Per-dtype tolerances for comparing a kernel (or reference path) with a float64 reference: the ONE table.

Used as ``torch.testing.assert_close(actual, expected, **TOLERANCES[dtype])`` where ``dtype`` is the dtype the
result was computed in (the lower precision of input and output). The values bound one rounding of the result
to the dtype plus fp32 accumulation error over rows of up to ~16k elements; a kernel that drops a term, misreads
a mask or mixes rows is off by orders of magnitude more.
"""

from __future__ import annotations

import torch

TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def tol(dtype: torch.dtype, scale: float = 1.0) -> dict:
    """The tolerances for ``dtype``, widened by ``scale`` (for results that went through several roundings)."""
    t = TOLERANCES[dtype]
    return dict(atol=t["atol"] * scale, rtol=t["rtol"] * scale)
