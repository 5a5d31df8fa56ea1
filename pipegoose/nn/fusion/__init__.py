"""pipegoose.nn.fusion: fused ops (functional, modules, optimizer) over pipegoose.kernels, with one dispatcher.

Import-light: importing this package imports torch and registers the implementations of every op; no kernel is
built or loaded until the first CUDA call that wants it, and transformers is imported only by
``pipegoose.nn.fusion.transformers``.
"""

from . import dispatch
from .dispatch import FusionFallbackError
from .fuse import FusionReport, fuse, fused, fusion_report, is_fused, unfuse
from .functional import (apply_rotary_pos_emb, cross_entropy, fused_linear_cross_entropy, geglu, gelu, gelu_and_mul,
                         layer_norm, mixed_fused_layer_norm, rms_norm, rms_norm_gated, scaled_masked_softmax,
                         scaled_softmax, scaled_upper_triang_masked_softmax, silu_and_mul, softmax, squared_relu, swiglu)
from .modules import (AttnMaskType, FusedGateUpSwiGLUMLP, FusedGeGLUMLP, FusedGELU, FusedGraniteMLP, FusedLayerNorm,
                      FusedLfm2MLP, FusedLinearCrossEntropyLoss, FusedModernBertMLP, FusedRMSNorm, FusedRMSNormGated,
                      FusedScaleMaskSoftmax, FusedSquaredReLU, FusedSwiGLUMLP, FusedT5DenseGatedActDense,
                      MixedFusedLayerNorm)
from .optim import FusedAdam, clip_grad_norm_
from .transformers.bloom import FusedBloomAttention
from .transformers.mpt import FusedMptAttention

__all__ = [
    "dispatch",
    "FusionFallbackError",
    "softmax",
    "scaled_softmax",
    "scaled_masked_softmax",
    "scaled_upper_triang_masked_softmax",
    "layer_norm",
    "mixed_fused_layer_norm",
    "rms_norm",
    "rms_norm_gated",
    "swiglu",
    "silu_and_mul",
    "geglu",
    "gelu_and_mul",
    "gelu",
    "squared_relu",
    "cross_entropy",
    "fused_linear_cross_entropy",
    "apply_rotary_pos_emb",
    "AttnMaskType",
    "FusedScaleMaskSoftmax",
    "FusedLayerNorm",
    "MixedFusedLayerNorm",
    "FusedRMSNorm",
    "FusedRMSNormGated",
    "FusedGELU",
    "FusedSquaredReLU",
    "FusedModernBertMLP",
    "FusedGraniteMLP",
    "FusedLfm2MLP",
    "FusedSwiGLUMLP",
    "FusedGateUpSwiGLUMLP",
    "FusedGeGLUMLP",
    "FusedT5DenseGatedActDense",
    "FusedLinearCrossEntropyLoss",
    "FusedBloomAttention",
    "FusedMptAttention",
    "FusedAdam",
    "clip_grad_norm_",
    "fuse",
    "fusion_report",
    "is_fused",
    "unfuse",
    "fused",
    "FusionReport",
]
