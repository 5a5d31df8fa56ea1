"""End-to-end: one training step (forward, backward, AdamW) of Llama-, GPT-NeoX-, Qwen3-, Phi-3-, Gemma-,
Qwen3-MoE-, Gemma 4 MoE- and OLMo-like models, bf16, seq 2048 (BERT's 512).

Models (random init from a config, no weights downloaded):

* ``llama``: TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 heads, 4 KV heads, MLP 5632, vocab 32000),
  ~1.1B params, batch 4.
* ``neox``: pythia-410m's shape (hidden 1024, 24 layers, 16 heads, MLP 4096, rotary_pct 0.25, vocab 50304),
  ~405M params, batch 8.
* ``qwen3``: Qwen3-0.6B's shape (hidden 1024, 28 layers, 16 heads of 128, 8 KV heads, MLP 3072, vocab 151936,
  tied embeddings), ~596M params, batch 4: RMSNorms over the hidden size and, per head, over q and k (``q_norm``,
  ``k_norm``: 128 columns, 16 and 8 rows per token). Not in ``benchmarks.run``'s default ``--e2e-models``. ``fuse``
  replaces its norms only: its attention is not among the model types verified with the pipegoose attention
  function, so ``fuse_eager`` is eager attention with fused norms (Llama's also moves attention).
* ``phi3``: Phi-3-mini's layer shape (hidden 3072, 32 heads, MLP 8192 with gate and up in one ``gate_up_proj``, q, k
  and v in one ``qkv_proj``, vocab 32064) with 8 of its 32 layers, ~1.1B params, batch 4: the MLP's activation runs
  ``silu_and_mul`` (op ``swiglu.packed``) once fused. Not in ``benchmarks.run``'s default ``--e2e-models``.
* ``gemma``: Gemma-2B's layer shape (hidden 2048, 8 heads of 256, 1 KV head, MLP 16384 of GELU's tanh approximation,
  ``gelu_pytorch_tanh``, vocab 256000, tied embeddings, RMSNorms ``x * (1 + weight)``) with 6 of its 18 layers,
  ~1.18B params (the tied embedding 524M of them), batch 4: once fused, its MLPs run ``geglu`` (``FusedGeGLUMLP``)
  and its norms Gemma's RMSNorm. The logits, ``[8192, 256000]``, are 4.2 GB in bf16 and the loss's fp32 copies 8.4
  GB each: the sdpa step's peak was estimated at ~41 GiB (weights, gradients and AdamW states 8.8 GiB, the 1.1 MB
  per token that the layers save for the backward, measured on the CPU: 8.4 GiB, three fp32 logits-sized tensors
  at the loss's backward: 23.4 GiB), under 60 GiB of an 80 GB card. Not in ``benchmarks.run``'s default
  ``--e2e-models``.
* ``qwen3_moe``: Qwen3-30B-A3B's layer shape (hidden 2048, 32 heads of 128, 4 KV heads, 128 experts of 768 with 8
  routed per token, vocab 151936) with 4 of its 48 layers, ~3.1B params (2.4B in the experts), batch 4; the experts run
  transformers' default ``grouped_mm`` implementation, whose gate (``act_fn(gate) * up`` of the routed tokens'
  ``gate_up_proj`` output, ``[65536, 1536]`` a layer) runs op ``swiglu.packed`` once fused (``FusedExpertsGate``).
  Liger-Kernel's patch (``apply_liger_kernel_to_qwen3_moe``) replaces the experts with its own (``LigerExperts``).
  Not in ``benchmarks.run``'s default ``--e2e-models``.
* ``gemma4_moe``: a Gemma 4 text model with its MoE block (``Gemma4ForCausalLM``, ``enable_moe_block``), of this
  project's choosing, not a released model's shape: ``qwen3_moe``'s experts (128 of 768, 8 routed per token) and
  hidden size 2048 in 4 layers (3 sliding-window, the last full), 8 heads of 256, 4 KV heads, a dense GeGLU MLP of 2048
  beside the experts in each layer, Gemma's vocabulary of 262144 (tied), no per-layer inputs; ~3.07B params (2.4B in
  the experts), batch 4. Its experts' gate is GeGLU's (``gelu_pytorch_tanh``): op ``geglu.packed`` once fused. Not in
  ``benchmarks.run``'s default ``--e2e-models``; no Liger variant.
* ``olmo``: OLMo-1B's shape (``OlmoForCausalLM``: hidden 2048, 16 layers, 16 heads, SwiGLU MLP 8192, vocab 50304,
  tied embeddings), ~1.18B params, batch 4. Its norms are ``OlmoLayerNorm``: LayerNorm without weight or bias, in fp32
  with the result cast back (``MixedFusedLayerNorm(elementwise_affine=False, output_in_input_dtype=True)`` once
  fused, since session 70). Not in ``benchmarks.run``'s default ``--e2e-models``; no Liger variant (Liger-Kernel
  patches OLMo 2, not OLMo).
* ``cohere``: Command-R's layer (``CohereForCausalLM``: attention and MLP in parallel after one ``CohereLayerNorm``,
  a LayerNorm with a weight and no bias, in fp32 with the result cast back; logits scaled by 0.0625) at this
  project's size: hidden 2048, 12 layers, 16 heads, 4 KV heads, SwiGLU MLP 5632, Command-R's vocabulary of 256000
  (tied), ~1.07B params, batch 4. Once fused its norms run ``MixedFusedLayerNorm`` (since session 70) and its MLPs
  ``swiglu`` and, since session 71, its RoPE (interleaved: pairs of neighbours) op ``rope`` with
  ``interleaved=True``. Not in ``benchmarks.run``'s default ``--e2e-models``; no Liger variant.
* ``glm4``: GLM-4's layer (``Glm4ForCausalLM``: 16 heads of 128, 2 KV heads, half of each head rotated by its
  interleaved RoPE, the MLP's gate and up in one ``gate_up_proj``, norms after attention and MLP too) at this
  project's size: hidden 2048, 16 layers, MLP 5632, GLM-4's vocabulary of 151552 (untied), ~1.32B params, batch 4.
  Once fused: RMSNorms, ``swiglu.packed``, and op ``rope`` (interleaved, partial rotary) since session 71. Not in
  ``benchmarks.run``'s default ``--e2e-models``; no Liger variant.
* ``gpt2``: GPT-2 large's width (hidden 1280, 20 heads, MLP 5120 of ``gelu_new``, learned positions, vocab 50257,
  tied) in 24 of its 36 layers, positions up to 2048, ~530M params, batch 4. Once fused: LayerNorms and, since
  session 72, its activation (``NewGELUActivation``: eight elementwise ops each way) op ``gelu``. Not in
  ``benchmarks.run``'s default ``--e2e-models``; no Liger variant (Liger-Kernel has no GPT-2 patch).
* ``phi``: Phi-1.5's shape (``PhiForCausalLM``: hidden 2048, 24 layers, 32 heads, half of each head rotated, MLP 8192
  of ``gelu_new``, attention and MLP in parallel after one LayerNorm, vocab 51200), ~1.4B params, batch 4. Once fused:
  LayerNorms, RoPE and, since session 72, op ``gelu``. Not in ``benchmarks.run``'s default ``--e2e-models``; no
  Liger variant.
* ``modernbert_decoder``: ModernBERT-large's shape as a decoder (``ModernBertDecoderForCausalLM``: hidden 1024, 28
  layers, 16 heads, MLP 2624 of exact GELU with gate and up in one ``Wi``, every third layer global attention and the
  others a 128-token window, LayerNorms without bias, vocab 50368, tied), ~396M params, batch 8. Once fused (session
  72): its MLPs ``FusedModernBertMLP`` (op ``geglu.packed``), LayerNorms, RoPE. Not in ``benchmarks.run``'s default
  ``--e2e-models``; no Liger variant.
* ``arcee``: Arcee AFM's layer (``ArceeForCausalLM``: Llama's with an MLP without a gate,
  ``down_proj(relu2(up_proj(x)))`` of squared ReLU) at this project's size: hidden 2048, 16 layers, 16 heads, 4 KV
  heads, MLP 8192, AFM's vocabulary of 128004 (untied), ~1.23B params, batch 4. Once fused (session 73): RMSNorms,
  RoPE and its activation (``ReLUSquaredActivation``: relu then square, two kernels forward, three backward) op
  ``squared_relu``. Not in ``benchmarks.run``'s default ``--e2e-models``; no Liger variant.
* ``nemotron``: Nemotron's layer (``NemotronForCausalLM``: squared ReLU MLP without a gate, half of each head rotated,
  ``NemotronLayerNorm1P``: LayerNorm of ``weight + 1``) at this project's size: hidden 2048, 12 layers, 16 heads, 8
  KV heads, MLP 8192, Nemotron's vocabulary of 256000 (untied), ~1.60B params, batch 4. Once fused (session 73): op
  ``squared_relu``, RoPE, the loss and its LayerNorm1Ps (``MixedFusedLayerNorm(apply_layernorm_1p=True)``). Not in
  ``benchmarks.run``'s default ``--e2e-models``; no Liger variant.
* ``bloom``: BLOOM-560M's shape (``BloomForCausalLM``: hidden 1024, 24 layers, 16 heads, ALiBi, MLP 4096 of
  ``BloomGelu``, vocab 250880, tied), ~559M params, batch 2 (its eager attention saves 6 bytes a score, ~0.75 GiB a
  layer at batch 2). transformers has no SDPA path for Bloom: every variant loads it with eager attention (the
  ``sdpa`` row is that baseline, its ``attn_implementation`` says so). Once fused (session 74): its attention
  ``FusedBloomAttention`` (ALiBi and the mask as one bias on our attention function), LayerNorms, ``gelu``, the loss.
  Not in ``benchmarks.run``'s default ``--e2e-models``; no Liger variant.
* ``bloom_1b7``: BLOOM-1B7's shape (``bloom``'s with hidden 2048: 16 heads of 128), ~1.72B params, batch 2.
* ``mpt``: MPT-7B's layer (``MptForCausalLM``: ALiBi over ``max_seq_len`` 2048 positions, MLP of 4 x hidden with
  ``torch.nn.GELU``, LayerNorms without bias, no biases, vocab 50432, tied) at this project's size: hidden 2048, 24
  layers, 16 heads of 128, ~1.31B params, batch 2. transformers has no SDPA path for MPT: every variant loads it with
  eager attention (the ``sdpa`` row is that baseline). Once fused: its attention ``FusedMptAttention`` (ALiBi,
  query-relative, and the mask as one bias on our attention function), LayerNorms, ``gelu``, the loss. Not in
  ``benchmarks.run``'s default ``--e2e-models``; no Liger variant.
* ``opt``: OPT-1.3B's shape (``OPTForCausalLM``: hidden 2048, 24 layers, 32 heads, ReLU MLPs of 8192 without a gate,
  learned positions, vocab 50272, tied, dropout 0.1 as OPT's config), ~1.32B params, batch 4. What ``fuse`` replaces
  in it: its LayerNorms and the loss. Not in ``benchmarks.run``'s default ``--e2e-models``; no Liger variant.
* ``bert_mlm``: BERT-large's shape as a masked LM (``BertForMaskedLM``: hidden 1024, 24 layers, 16 heads, GELU MLPs of
  4096, vocab 30522, tied, dropout 0.1), ~335M params, batch 32 x **512** positions (BERT's ``max_position_embeddings``:
  the model's own ``seq`` in this table, in place of 2048), labels on 15% of the positions (fixed draws; -100
  elsewhere), as masked-LM pretraining predicts. Its loss is computed in the forward by a ``CrossEntropyLoss`` of its
  own (not ``self.loss_function``). Not in ``benchmarks.run``'s default ``--e2e-models``; no Liger variant.

Variants: ``eager`` / ``sdpa`` (transformers' attention implementations), ``fuse_sdpa`` / ``fuse_eager``
(``pipegoose.nn.fusion.fuse(model)`` on that model), ``fuse_sdpa_adam`` (``fuse_sdpa`` with
``pipegoose.nn.fusion.FusedAdam(lr, weight_decay=0.01)``, AdamW's defaults, in place of
``torch.optim.AdamW(fused=True)`` that every other variant steps with), ``fuse_sdpa_lce`` (``fuse_sdpa`` with
``linear_cross_entropy`` added to the ops: the LM head and loss in one, no [B, S, V] logits), ``fuse_sdpa_gated``
(``fuse_sdpa`` with ``rms_norm_gated`` added: the gated RMSNorms of Qwen3-Next's linear attention; not among the
variants run by default), ``fuse_sdpa_model_rope``
(``fuse_sdpa`` with ``PIPEGOOSE_IMPL_ROPE=torch``: the model's own RoPE code, the A/B of our RoPE kernel; it replaces
session 54's ``fuse_sdpa_rope``, the kernel's partial path when that was opt-in),
``compile_sdpa`` (``torch.compile(model)``, compile time in the warm-up, reported separately), ``liger``
(``apply_liger_kernel_to_llama`` / ``_qwen3`` / ``_phi3`` / ``_gemma(model=...)`` with their defaults: rope,
rms_norm, swiglu (Gemma: geglu), fused linear cross-entropy) and ``liger_rmsnorm`` (only its RMSNorm, Gemma's
``LigerRMSNormForGemma`` for Gemma: the like-for-like comparison with ours). Liger
patches transformers globally, so every variant runs in its own subprocess (fresh memory, and nothing leaks into the next),
under a time limit.

Measured: tokens/s = batch * seq * steps / wall time of ``steps`` steps after ``warmup`` steps (CUDA synchronised),
peak memory = ``torch.cuda.max_memory_allocated`` over the timed steps. Correctness gate: the loss of every step is
recorded; a non-finite loss is ``FAILED``, and the first and last losses are compared with the ``sdpa`` variant of
the same model (same seed, same data): a relative difference above 2% is ``FAILED`` too. Where the model has no ``ok``
``sdpa`` row (not among ``--e2e-variants``, or oom, timeout, error), nothing is compared: the other variants' ``ok``
rows say so in their note (``loss not compared: no ok sdpa run (sdpa oom)``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from typing import Callable

__all__ = ["MODELS", "VARIANTS", "DEFAULT_VARIANTS", "run_e2e", "apply_liger"]

MODELS = {
    "llama": dict(arch="llama", batch=4, config=dict(hidden_size=2048, intermediate_size=5632,
                                                      num_hidden_layers=22, num_attention_heads=32,
                                                      num_key_value_heads=4, vocab_size=32000,
                                                      max_position_embeddings=2048, rms_norm_eps=1e-5)),
    "neox": dict(arch="gpt_neox", batch=8, config=dict(hidden_size=1024, intermediate_size=4096,
                                                        num_hidden_layers=24, num_attention_heads=16,
                                                        vocab_size=50304, rotary_pct=0.25,
                                                        max_position_embeddings=2048, use_parallel_residual=True)),
    "qwen3": dict(arch="qwen3", batch=4, config=dict(hidden_size=1024, intermediate_size=3072,
                                                      num_hidden_layers=28, num_attention_heads=16,
                                                      num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                                      max_position_embeddings=2048, rms_norm_eps=1e-6,
                                                      tie_word_embeddings=True)),
    "phi3": dict(arch="phi3", batch=4, config=dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=8,
                                                    num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
                                                    max_position_embeddings=4096, rms_norm_eps=1e-5,
                                                    pad_token_id=32000, bos_token_id=1, eos_token_id=32000)),
    # (hidden_act is what GemmaMLP reads in transformers 5; hidden_activation, Gemma's own name for it, what 4.x read)
    "gemma": dict(arch="gemma", batch=4, config=dict(hidden_size=2048, intermediate_size=16384, num_hidden_layers=6,
                                                      num_attention_heads=8, num_key_value_heads=1, head_dim=256,
                                                      vocab_size=256000, hidden_act="gelu_pytorch_tanh",
                                                      hidden_activation="gelu_pytorch_tanh",
                                                      max_position_embeddings=8192, rms_norm_eps=1e-6,
                                                      tie_word_embeddings=True, pad_token_id=0, bos_token_id=2,
                                                      eos_token_id=1)),
    "qwen3_moe": dict(arch="qwen3_moe", batch=4, config=dict(hidden_size=2048, intermediate_size=6144,
                                                              moe_intermediate_size=768, num_experts=128,
                                                              num_experts_per_tok=8, num_hidden_layers=4,
                                                              num_attention_heads=32, num_key_value_heads=4,
                                                              head_dim=128, vocab_size=151936, norm_topk_prob=True,
                                                              max_position_embeddings=4096, rms_norm_eps=1e-6,
                                                              tie_word_embeddings=False)),
    "gemma4_moe": dict(arch="gemma4_text", batch=4, config=dict(hidden_size=2048, intermediate_size=2048,
                                                                 enable_moe_block=True, moe_intermediate_size=768,
                                                                 num_experts=128, top_k_experts=8,
                                                                 num_hidden_layers=4, num_attention_heads=8,
                                                                 num_key_value_heads=4, head_dim=256,
                                                                 vocab_size=262144, hidden_size_per_layer_input=0,
                                                                 hidden_activation="gelu_pytorch_tanh",
                                                                 max_position_embeddings=4096, rms_norm_eps=1e-6,
                                                                 tie_word_embeddings=True)),
    "olmo": dict(arch="olmo", batch=4, config=dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                                    num_attention_heads=16, num_key_value_heads=16, vocab_size=50304,
                                                    max_position_embeddings=2048, tie_word_embeddings=True,
                                                    pad_token_id=1, eos_token_id=50279)),
    "cohere": dict(arch="cohere", batch=4, config=dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=12,
                                                        num_attention_heads=16, num_key_value_heads=4,
                                                        vocab_size=256000, logit_scale=0.0625, layer_norm_eps=1e-5,
                                                        max_position_embeddings=4096, tie_word_embeddings=True)),
    "glm4": dict(arch="glm4", batch=4, config=dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                                                    num_attention_heads=16, num_key_value_heads=2, head_dim=128,
                                                    vocab_size=151552, max_position_embeddings=4096,
                                                    rms_norm_eps=1e-5, tie_word_embeddings=False,
                                                    pad_token_id=151329, eos_token_id=151329)),
    # (session 72: the MLPs without a gate, whose gelu_new fuse runs as op gelu)
    "gpt2": dict(arch="gpt2", batch=4, config=dict(n_embd=1280, n_layer=24, n_head=20, n_positions=2048,
                                                    vocab_size=50257, activation_function="gelu_new")),
    # (half of each head rotated: PhiConfig's default, in its rope_parameters since transformers 5)
    "phi": dict(arch="phi", batch=4, config=dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                                                  num_attention_heads=32, vocab_size=51200,
                                                  max_position_embeddings=2048, hidden_act="gelu_new")),
    # (session 72: ModernBERT's Wi/Wo MLP, FusedModernBertMLP on geglu.packed)
    "modernbert_decoder": dict(arch="modernbert-decoder", batch=8,
                               config=dict(hidden_size=1024, intermediate_size=2624, num_hidden_layers=28,
                                           num_attention_heads=16, vocab_size=50368, max_position_embeddings=8192,
                                           pad_token_id=50283, bos_token_id=50281, eos_token_id=50282)),
    # (session 73: the MLPs of squared ReLU, relu2, whose ReLUSquaredActivation fuse runs as op squared_relu)
    "arcee": dict(arch="arcee", batch=4, config=dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                                      num_attention_heads=16, num_key_value_heads=4, vocab_size=128004,
                                                      max_position_embeddings=4096, rms_norm_eps=1e-5,
                                                      hidden_act="relu2", tie_word_embeddings=False,
                                                      pad_token_id=0, bos_token_id=128000, eos_token_id=128001)),
    "nemotron": dict(arch="nemotron", batch=4, config=dict(hidden_size=2048, intermediate_size=8192,
                                                            num_hidden_layers=12, num_attention_heads=16,
                                                            num_key_value_heads=8, vocab_size=256000,
                                                            max_position_embeddings=4096, hidden_act="relu2",
                                                            tie_word_embeddings=False, pad_token_id=0,
                                                            bos_token_id=2, eos_token_id=3)),
    # (session 74: ALiBi attention, FusedBloomAttention; eager only in transformers: "attn" forces it for every variant)
    "bloom": dict(arch="bloom", batch=2, attn="eager", config=dict(hidden_size=1024, n_layer=24, n_head=16,
                                                                    vocab_size=250880, bos_token_id=1, eos_token_id=2,
                                                                    pad_token_id=3)),
    "bloom_1b7": dict(arch="bloom", batch=2, attn="eager", config=dict(hidden_size=2048, n_layer=24, n_head=16,
                                                                        vocab_size=250880, bos_token_id=1,
                                                                        eos_token_id=2, pad_token_id=3)),
    # (ALiBi attention, FusedMptAttention; eager only in transformers, as Bloom's)
    "mpt": dict(arch="mpt", batch=2, attn="eager", config=dict(d_model=2048, n_heads=16, n_layers=24, expansion_ratio=4,
                                                                max_seq_len=2048, vocab_size=50432)),
    # (a masked LM: AutoModelForMaskedLM, labels on 15% of the positions; BERT's 512 positions, the model's own seq)
    "bert_mlm": dict(arch="bert", head="masked_lm", batch=32, seq=512,
                     config=dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                 intermediate_size=4096, vocab_size=30522, max_position_embeddings=512)),
    # (DistilBERT-base as a masked LM: its loss module of its own, mlm_loss_fct, routed to op cross_entropy)
    "distilbert_mlm": dict(arch="distilbert", head="masked_lm", batch=32, seq=512,
                           config=dict(hidden_size=768, num_hidden_layers=6, num_attention_heads=12, hidden_dim=3072,
                                       vocab_size=30522, max_position_embeddings=512)),
    # (session 78: GPT-J-6B's heads of 256, 64 values of each rotated by its one-tensor interleaved RoPE, attention
    # and MLP in parallel off one LayerNorm, gelu_new MLPs; 16 layers at hidden 2048)
    "gptj": dict(arch="gptj", batch=4, config=dict(n_embd=2048, n_layer=16, n_head=8, rotary_dim=64, vocab_size=50400,
                                                    n_positions=2048, activation_function="gelu_new",
                                                    bos_token_id=50256, eos_token_id=50256)),
    # (session 78: Qwen3-Next's layers, three of linear attention (the gated delta rule; transformers' PyTorch path
    # where flash-linear-attention is not installed) to one of full attention, each linear one with a gated RMSNorm
    # (variant fuse_sdpa_gated fuses it: opt-in kind rms_norm_gated); 32 experts of 512, 4 routed; 8 layers)
    "qwen3_next": dict(arch="qwen3_next", batch=2, config=dict(
        hidden_size=2048, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        intermediate_size=5120, vocab_size=151936, max_position_embeddings=4096)),
    # (session 79: Granite-4.0-H-Micro's layers, Mamba2 mixers (transformers' PyTorch path where mamba-ssm is not
    # installed) with the gated norm the gate first (variant fuse_sdpa_gated fuses it: opt-in kind rms_norm_gated),
    # three to one attention layer, SwiGLU shared MLPs, no experts; 8 layers at hidden 2048)
    "granite4": dict(arch="granitemoehybrid", batch=2, config=dict(
        hidden_size=2048, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=8,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        mamba_n_heads=64, mamba_d_head=64, mamba_n_groups=1,
        mamba_d_state=128, mamba_expand=2, mamba_chunk_size=256, mamba_d_conv=4, num_local_experts=0,
        shared_intermediate_size=8192, intermediate_size=8192, vocab_size=100352, max_position_embeddings=4096,
        position_embedding_type="rope", tie_word_embeddings=True, pad_token_id=100256, bos_token_id=100257,
        eos_token_id=100257)),
    # (OPT-1.3B's shape: LayerNorms, ReLU MLPs without a gate (left to PyTorch: one kernel already), learned positions)
    "opt": dict(arch="opt", batch=4, config=dict(hidden_size=2048, ffn_dim=8192, num_hidden_layers=24,
                                                  num_attention_heads=32, vocab_size=50272,
                                                  max_position_embeddings=2048, word_embed_proj_dim=2048,
                                                  pad_token_id=1, bos_token_id=2, eos_token_id=2)),
}
CONFIGS = {"llama": "LlamaConfig", "gpt_neox": "GPTNeoXConfig", "qwen3": "Qwen3Config", "phi3": "Phi3Config",
           "gemma": "GemmaConfig", "qwen3_moe": "Qwen3MoeConfig", "gemma4_text": "Gemma4TextConfig",
           "olmo": "OlmoConfig", "cohere": "CohereConfig", "glm4": "Glm4Config", "gpt2": "GPT2Config",
           "phi": "PhiConfig", "modernbert-decoder": "ModernBertDecoderConfig", "arcee": "ArceeConfig",
           "nemotron": "NemotronConfig", "bloom": "BloomConfig", "mpt": "MptConfig",
           "opt": "OPTConfig", "bert": "BertConfig", "distilbert": "DistilBertConfig",
           "gptj": "GPTJConfig", "qwen3_next": "Qwen3NextConfig", "granitemoehybrid": "GraniteMoeHybridConfig"}
VARIANTS = ("sdpa", "eager", "fuse_sdpa", "fuse_eager", "fuse_sdpa_adam", "fuse_sdpa_lce", "fuse_sdpa_gated",
            "fuse_sdpa_model_rope", "compile_sdpa", "liger_rmsnorm", "liger")
# what --e2e runs without --e2e-variants: all but fuse_sdpa_gated (the same as fuse_sdpa on a model without gated norms)
DEFAULT_VARIANTS = tuple(v for v in VARIANTS if v != "fuse_sdpa_gated")
# What a row's "status" can be: ok, FAILED (a non-finite loss, or one off the sdpa run's), oom, timeout, error (the
# subprocess failed), unavailable (Liger-Kernel not installed), skipped (time budget, or no CUDA).
STATUSES = ("ok", "FAILED", "oom", "timeout", "error", "unavailable", "skipped")
LIGER_ONLY = {"liger": ("llama", "qwen3", "phi3", "gemma", "qwen3_moe"),
              "liger_rmsnorm": ("llama", "qwen3", "phi3", "gemma", "qwen3_moe")}
# the keyword of Liger's apply_liger_kernel_to_<arch> that patches the MLP (Gemma's MLP is a GeGLU: geglu=)
LIGER_MLP_ARG = {"gemma": "geglu"}
MARK = "E2E_RESULT "
LOSS_RTOL = 0.02
MASKED_FRACTION = 0.15   # a masked LM's positions with a label (the others -100), as BERT's pretraining


def auto_class(spec: dict):
    """The transformers auto class that builds a MODELS entry: ``AutoModelForMaskedLM`` for ``head="masked_lm"``,
    else ``AutoModelForCausalLM``."""
    import transformers

    return transformers.AutoModelForMaskedLM if spec.get("head") == "masked_lm" else transformers.AutoModelForCausalLM


def labels_for(spec: dict, ids, generator):
    """The labels of a step on ``ids``: ``ids`` itself for a causal LM (transformers shifts them), or for a masked LM
    ``ids`` on a ``MASKED_FRACTION`` of the positions drawn with ``generator`` and -100 (ignored) elsewhere."""
    if spec.get("head") != "masked_lm":
        return ids
    import torch

    keep = torch.rand(ids.shape, device=ids.device, generator=generator) < MASKED_FRACTION
    return ids.masked_fill(~keep, -100)


def _worker(model_name: str, variant: str, batch: int, seq: int, warmup: int, steps: int) -> dict:
    import torch
    import transformers

    spec = MODELS[model_name]
    res: dict = {"model": model_name, "variant": variant, "batch": batch, "seq": seq}
    if variant.startswith("liger") and importlib.util.find_spec("liger_kernel") is None:
        return {**res, "status": "unavailable", "detail": "liger_kernel is not importable"}
    cfg = getattr(transformers, CONFIGS[spec["arch"]])(**spec["config"])
    # (a model whose only attention in transformers is eager, Bloom's, MPT's: every variant loads it so)
    attn = spec.get("attn") or ("eager" if variant in ("eager", "fuse_eager") else "sdpa")
    res["attn_implementation"] = attn
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = auto_class(spec).from_config(cfg, attn_implementation=attn)
    model.to(torch.bfloat16).train()
    res["params"] = sum(p.numel() for p in model.parameters())
    if variant.startswith("fuse"):
        from pipegoose.nn.fusion.fuse import DEFAULT_OPS, fuse

        if variant == "fuse_sdpa_model_rope":   # (this subprocess only) before fuse, which asks the dispatcher
            os.environ["PIPEGOOSE_IMPL_ROPE"] = "torch"
        # fuse_sdpa_lce / _gated: the default ops and an opt-in kind (the LM head with the loss in one; the gated
        # RMSNorms of linear attention)
        extra = {"fuse_sdpa_lce": ("linear_cross_entropy",), "fuse_sdpa_gated": ("rms_norm_gated",)}.get(variant)
        report = fuse(model, ops=DEFAULT_OPS + extra if extra else None)
        res["fuse_report"] = str(report)[:600]
    elif variant.startswith("liger"):
        import liger_kernel.transformers as liger

        apply_liger(liger, spec["arch"], variant, model)
    step_model = torch.compile(model) if variant == "compile_sdpa" else model
    res["setup_s"] = round(time.perf_counter() - t0, 2)
    if variant == "fuse_sdpa_adam":
        from pipegoose.nn.fusion import FusedAdam

        opt = FusedAdam(model.parameters(), lr=1e-4, weight_decay=0.01)   # torch.optim.AdamW's default decay
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda", generator=gen)
    labels = labels_for(spec, ids, gen)
    losses: list[float] = []

    def step() -> None:
        loss = step_model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))

    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    res["warmup_s"] = round(time.perf_counter() - t0, 2)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    res.update(status="ok", steps=steps, step_ms=1e3 * dt / steps, tokens_per_s=batch * seq * steps / dt,
               peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30, losses=[round(x, 5) for x in losses])
    if not all(map(lambda x: x == x and abs(x) != float("inf"), losses)):
        res.update(status="FAILED", detail=f"non-finite loss: {losses}")
    return res


def apply_liger(liger, arch: str, variant: str, model) -> None:
    """Liger-Kernel's ``apply_liger_kernel_to_<arch>`` (of the module ``liger``, ``liger_kernel.transformers``) on
    ``model``: with its defaults for ``liger``; for ``liger_rmsnorm`` its RMSNorm alone (rope, the losses and the MLP
    off: the MLP's switch is ``swiglu=``, Gemma's ``geglu=``, :data:`LIGER_MLP_ARG`). Raises ValueError naming the
    variant for any other; Liger's TypeError where its function lacks a switch."""
    apply = getattr(liger, f"apply_liger_kernel_to_{arch}")
    if variant == "liger":
        apply(model=model)
    elif variant == "liger_rmsnorm":
        mlp = {LIGER_MLP_ARG.get(arch, "swiglu"): False}
        apply(rope=False, cross_entropy=False, fused_linear_cross_entropy=False, rms_norm=True, model=model, **mlp)
    else:
        raise ValueError(f"variant: expected liger or liger_rmsnorm, got {variant!r}")


def _not_compared(r: dict, why: str) -> None:
    r["detail"] = "; ".join(x for x in (r.get("detail"), f"loss not compared: {why}") if x)


def _check_losses(results: list[dict]) -> None:
    """The gate against ``sdpa``: an ``ok`` row whose first or last loss is off its model's ``ok`` sdpa row's by more
    than ``LOSS_RTOL`` becomes ``FAILED``; an ``ok`` row that could not be compared (no ok sdpa row: not run, or oom,
    timeout, error; no losses) stays ``ok`` with a note saying why (it stayed ok without a word: a review)."""
    sdpa = {r["model"]: r for r in results if r["variant"] == "sdpa"}
    for r in results:
        b = sdpa.get(r["model"])
        if r["status"] != "ok" or r is b:
            continue
        if b is None or b["status"] != "ok":
            _not_compared(r, "no ok sdpa run" + (f" (sdpa {b['status']})" if b else " (sdpa not run)"))
            continue
        if not r.get("losses") or not b.get("losses"):
            _not_compared(r, "no losses recorded" + ("" if r.get("losses") else " for this run")
                          + ("" if b.get("losses") else " for the sdpa run"))
            continue
        for which, i in (("first", 0), ("last", -1)):
            ref, got = b["losses"][i], r["losses"][i]
            if abs(got - ref) > LOSS_RTOL * abs(ref):
                r["status"] = "FAILED"
                r["detail"] = (r.get("detail", "") + f" {which} loss {got:.4f} vs sdpa {ref:.4f}").strip()


def run_e2e(models: list[str], variants: list[str], deadline: float, quick: bool = False,
            batch: dict[str, int] | None = None, seq: int = 2048, timeout_s: float = 150.0,
            compile_timeout_s: float = 240.0, log: Callable[[str], None] = print) -> list[dict]:
    """Run each (model, variant) in its own subprocess under a time limit; returns one dict per config
    (status ok / FAILED / oom / timeout / unavailable / error / skipped)."""
    warmup, steps = (2, 4) if quick else (3, 8)
    order = [v for v in VARIANTS if v in variants]   # liger last: it patches transformers globally
    results = []
    for model in models:
        for v in order:
            if model not in LIGER_ONLY.get(v, (model,)):
                continue
            b = (batch or {}).get(model, MODELS[model]["batch"])
            s_len = MODELS[model].get("seq", seq)   # (a model of fewer positions: BERT's 512)
            row = {"model": model, "variant": v, "batch": b, "seq": s_len}
            left = deadline - time.perf_counter()
            limit = min(compile_timeout_s if v.startswith("compile") else timeout_s, left)
            if limit < 20:
                results.append({**row, "status": "skipped", "detail": "time budget"})
                continue
            cmd = [sys.executable, "-m", "benchmarks.e2e", "--worker", "--model", model, "--variant", v,
                   "--batch", str(b), "--seq", str(s_len), "--warmup", str(warmup), "--steps", str(steps)]
            t0 = time.perf_counter()
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit,
                                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
                out = [ln for ln in p.stdout.splitlines() if ln.startswith(MARK)]
                if out:
                    r = json.loads(out[-1][len(MARK):])
                else:
                    err = p.stderr.strip().splitlines()
                    tail = " | ".join(err[-3:])[:400]
                    status = "oom" if "OutOfMemoryError" in p.stderr or "out of memory" in p.stderr else "error"
                    r = {**row, "status": status, "detail": f"exit {p.returncode}: {tail}"}
            except subprocess.TimeoutExpired:
                r = {**row, "status": "timeout", "detail": f"over {limit:.0f} s"}
            r["wall_s"] = round(time.perf_counter() - t0, 1)
            results.append(r)
            tps = f"{r['tokens_per_s']:.0f} tok/s, peak {r['peak_mem_gib']:.1f} GiB" if r.get("tokens_per_s") else ""
            log(f"  e2e {model:6s} {v:13s} {r['status']:8s} {tps} {str(r.get('detail', ''))[:160]}")
    _check_losses(results)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e",
                                 description="one e2e config (used by benchmarks.run --e2e)")
    ap.add_argument("--worker", action="store_true", required=True)
    ap.add_argument("--model", choices=list(MODELS), required=True)
    ap.add_argument("--variant", choices=list(VARIANTS), required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args(argv)
    try:
        res = _worker(a.model, a.variant, a.batch, a.seq, a.warmup, a.steps)
    except Exception as e:  # noqa: BLE001 - reported to the parent as a result line
        import torch

        oom = isinstance(e, torch.cuda.OutOfMemoryError)
        res = {"model": a.model, "variant": a.variant, "batch": a.batch, "seq": a.seq,
               "status": "oom" if oom else "error", "detail": f"{type(e).__name__}: {str(e)[:400]}"}
    print(MARK + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
