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


# Double backward through a fused Function (tests/fusion/test_fusion_cuda.py): with create_graph=True the gradients
# are PyTorch's reference formulas evaluated op by op in the input dtype (each op rounds, and a row's terms cancel),
# and a Hessian-vector product goes back through that chain once more. Against float64 on the same inputs the PyTorch
# reference path itself was measured (CPU, 200 seeds, every case of DOUBLE_BACKWARD) at up to 1.5x the one-rounding
# bound for the first derivatives and 3.4x for the Hessian-vector products (fp16 LayerNorm with fp16 parameters);
# these scales leave a margin of 2.3x or more. A dropped or wrong term is off by O(1).
DOUBLE_BACKWARD_GRAD_SCALE = 4
DOUBLE_BACKWARD_HVP_SCALE = 8

# Training runs compared per step, fused vs unfused (tests/fuse/test_fuse_cuda.py, test_training_losses_match): the
# relative difference of each step's loss, not a comparison with float64. 30 AdamW steps of a small causal LM under
# bf16 autocast (8 bits of mantissa): the two runs round differently from step 1 and the differences compound
# through the updates. A fused op that is wrong moves the losses by far more (or stops the run from training, which
# the test checks separately).
TRAIN_LOSS_RTOL = 0.03

# fp32 results checked against the same fp32 values obtained another way, not against float64: tighter than one
# rounding, because nothing is rounded to a lower precision in between (tests/kernels/test_cross_entropy_cuda.py).
# The same row code compiled into two kernels (lse of cross_entropy_forward and of cross_entropy_forward_reduced):
# equal but for a possibly different instruction schedule (an FMA contracted or not): a unit or two in the last place.
FP32_SAME_CODE = dict(atol=0.0, rtol=2.0 ** -22)
# A reduction of fp32 terms accumulated in float64 and rounded once (cross_entropy_forward_reduced's sum or mean of
# the rows' losses), against the same fp32 terms summed in float64 on the host: the final rounding (and the mean's
# division) only, a few fp32 units in the last place (1e-6 is about 8 of them); the atol covers sums near 0.
FP32_FLOAT64_SUM = dict(atol=1e-6, rtol=1e-6)

# The fused linear cross-entropy's weight gradient, accumulated over ``chunks`` GEMMs in its dtype (one rounding per
# chunk, where the unfused path rounds once): the table's tolerance times this scale, relative to the gradient's
# largest value (tests/kernels/test_linear_cross_entropy_cuda.py, tests/kernels/test_fuzz_cuda.py).


def weight_scale(chunks: int) -> float:
    """The tolerance scale of the weight's gradient accumulated over ``chunks`` GEMMs in its dtype: one rounding
    (about 1/8 of the table's rtol, 8 units in the last place) per chunk, beside the unfused path's one, and 2 for
    the rest."""
    return 2 + chunks / 8
