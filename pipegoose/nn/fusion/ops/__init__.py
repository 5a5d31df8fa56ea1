"""Op families: one module per family holding its autograd Functions, its PyTorch reference and the
registration of its implementations with :mod:`pipegoose.nn.fusion.dispatch`. Importing this package
registers them all; nothing here loads a kernel (that happens on first CUDA use)."""

from . import (cross_entropy, layer_norm, linear_cross_entropy, multi_tensor, rms_norm, rms_norm_gated,  # noqa: F401
               softmax, swiglu)  # (registration)

__all__ = ["cross_entropy", "layer_norm", "linear_cross_entropy", "multi_tensor", "rms_norm", "rms_norm_gated", "softmax",
           "swiglu"]
