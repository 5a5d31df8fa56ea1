"""transformers integration of the fusion layer: the ``pipegoose`` attention function (``attention``) and the
model knowledge used by ``fuse(model)`` (``matching``). The only place in ``pipegoose.nn.fusion`` that imports
transformers."""

from .attention import (ATTENTION_NAME, ATTENTION_SDPA_NAME, MaskPlan, additive_to_boolean_mask,
                        pipegoose_attention_forward, plan_mask, register)
from .bloom import FusedBloomAttention, alibi_bias, probe_bloom_attention
from .mpt import FusedMptAttention, mpt_bias, probe_mpt_attention
from .matching import (ATTENTION_MODEL_TYPES, ATTENTION_SKIP_REASONS, probe_layer_norm_module, probe_rms_norm,
                       probe_weightless_norm)

__all__ = ["ATTENTION_NAME", "ATTENTION_SDPA_NAME", "ATTENTION_MODEL_TYPES", "ATTENTION_SKIP_REASONS",
           "FusedBloomAttention", "FusedMptAttention", "MaskPlan", "additive_to_boolean_mask", "alibi_bias",
           "mpt_bias", "pipegoose_attention_forward", "plan_mask", "probe_bloom_attention", "probe_mpt_attention",
           "probe_layer_norm_module", "probe_rms_norm", "probe_weightless_norm", "register"]
