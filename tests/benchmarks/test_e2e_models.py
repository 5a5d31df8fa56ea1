"""The end-to-end model table (benchmarks/e2e.py's MODELS): each config builds, and a tiny copy of it trains a step on
the CPU; Gemma's entry is Gemma-2B's layer shape, Qwen3-MoE's Qwen3-30B-A3B's; Liger's patch is called with the switches
its function has (CPU)."""

import math
import subprocess
import time

import _bench_path  # noqa: F401
import pytest
import torch
import torch.nn.functional as F

from benchmarks import e2e

transformers = pytest.importorskip("transformers")

# the sizes of a tiny copy of a model (the model's own layout: heads, KV heads, gate_up_proj, rotary_pct, ties)
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=128, max_position_embeddings=64)


def _config(name: str, **over):
    spec = e2e.MODELS[name]
    return getattr(transformers, e2e.CONFIGS[spec["arch"]])(**{**spec["config"], **over})


def _tiny(name: str):
    cfg = dict(e2e.MODELS[name]["config"])
    heads, kv = cfg.get("num_attention_heads", 4), cfg.get("num_key_value_heads", cfg.get("num_attention_heads", 4))
    over = {**TINY, "num_attention_heads": 4, "num_key_value_heads": max(1, 4 * kv // heads)}
    if "head_dim" in cfg:
        over["head_dim"] = 16
    if "num_experts" in cfg:   # (a MoE's experts: 4 of 32, 2 routed per token; Gemma 4 names the count top_k_experts)
        over.update(num_experts=4, moe_intermediate_size=32,
                    **{"top_k_experts" if "top_k_experts" in cfg else "num_experts_per_tok": 2})
    if "linear_num_value_heads" in cfg:   # (Qwen3-Next's linear attention: small heads, and one layer of each kind)
        over.update(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                    shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"])
    if "mamba_n_heads" in cfg:   # (Granite-4-H's Mamba2 mixers: heads of 16 filling 2 x 64, one layer of each kind)
        over.update(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8, shared_intermediate_size=32,
                    layer_types=["linear_attention", "full_attention"])
    if "rotary_dim" in cfg:   # (GPT-J's rotated values of each head: a quarter, as its 64 of 256)
        over["rotary_dim"] = 4
    if "ffn_dim" in cfg:   # (OPT's names for the MLP's and the embedding's widths)
        over.update(ffn_dim=TINY["intermediate_size"], word_embed_proj_dim=TINY["hidden_size"])
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):   # (ids inside the tiny vocab)
        if k in cfg:
            over[k] = min(cfg[k], 127)
    return _config(name, **over)


def _fused_step(name: str):
    """A tiny copy of ``name`` (its benchmark's attention, auto class and labels), one unfused and one fused forward
    on the same batch and dropout draws: (model, fuse's report, the unfused loss, the fused loss)."""
    from pipegoose.nn.fusion import fuse

    spec = e2e.MODELS[name]
    torch.manual_seed(0)
    model = e2e.auto_class(spec).from_config(_tiny(name), attn_implementation=spec.get("attn", "sdpa")).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
    labels = e2e.labels_for(spec, ids, g)
    torch.manual_seed(2)   # (dropout, OPT's and BERT's: the same draws for both steps)
    want = model(input_ids=ids, labels=labels).loss
    report = fuse(model)
    torch.manual_seed(2)
    return model, report, want, model(input_ids=ids, labels=labels).loss


def _attr(cfg, k):
    """``cfg.k``; from ``to_dict()`` where the config refuses a global read of a per-layer attribute (Gemma 4's
    head_dim)."""
    try:
        return getattr(cfg, k)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError
        return cfg.to_dict()[k]


@pytest.mark.parametrize("name", list(e2e.MODELS))
def test_every_model_builds_its_config_and_a_tiny_copy_trains_a_step_on_the_cpu(name):
    spec = e2e.MODELS[name]
    assert spec["arch"] in e2e.CONFIGS and spec["batch"] >= 1
    cfg = _config(name)
    assert type(cfg).__name__ == e2e.CONFIGS[spec["arch"]] and cfg.model_type == spec["arch"]
    for k, v in spec["config"].items():
        if k == "rotary_pct" and not hasattr(cfg, k):   # (transformers 5 keeps it in rope_parameters)
            assert cfg.rope_parameters["partial_rotary_factor"] == v
        else:
            assert _attr(cfg, k) == v, k
    tiny = _tiny(name)
    assert tiny.num_hidden_layers <= 2 and tiny.hidden_size <= 64, (tiny.num_hidden_layers, tiny.hidden_size)
    torch.manual_seed(0)
    # (the attention the benchmark loads: SDPA, or eager for a model that has no other, Bloom's, MPT's)
    model = e2e.auto_class(spec).from_config(tiny, attn_implementation=spec.get("attn", "sdpa")).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, tiny.vocab_size, (2, 16), generator=g)
    loss = model(input_ids=ids, labels=e2e.labels_for(spec, ids, g)).loss
    loss.backward()
    got = loss.item()
    assert math.isfinite(got) and abs(got - math.log(tiny.vocab_size)) < 1.0   # (random init: ~ln V)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_gemma_is_gemma_2bs_layer_shape_with_6_of_its_18_layers():
    """hidden 2048, MLP 16384 of GELU's tanh approximation, 8 heads of 256, 1 KV head, vocab 256000 (tied), eps 1e-6,
    batch 4 x seq 2048: ~1.18B parameters (524M of them the embedding), counted on the meta device."""
    spec = e2e.MODELS["gemma"]
    assert spec["arch"] == "gemma" and spec["batch"] == 4 and e2e.CONFIGS["gemma"] == "GemmaConfig"
    cfg = _config("gemma")
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (2048, 16384, 6)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (8, 1, 256)
    assert cfg.vocab_size == 256000 and cfg.rms_norm_eps == 1e-6 and cfg.tie_word_embeddings
    assert cfg.hidden_act == "gelu_pytorch_tanh"
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    h, i, v, q, kv = 2048, 16384, 256000, 8 * 256, 1 * 256
    layer = 2 * h * q + 2 * h * kv + 3 * h * i + 2 * h   # q, o; k, v; gate, up, down; two norms
    want = v * h + 6 * layer + h                         # the tied embedding, the layers, the final norm
    got = sum(p.numel() for p in model.parameters())
    assert got == want and 1.15e9 < got < 1.2e9
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_gemmas_mlp_runs_gelu_tanh_of_gate_times_up_and_its_norm_1_plus_weight():
    """What ``fuse`` is to replace in the Gemma step: the MLP's activation is ``gelu_pytorch_tanh`` (op geglu's
    ``F.gelu(gate, approximate="tanh") * up``) and the norms scale by ``1 + weight``."""
    tiny = _tiny("gemma")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny)
    mlp = model.model.layers[0].mlp
    x = torch.randn(3, tiny.hidden_size)
    want = mlp.down_proj(F.gelu(mlp.gate_proj(x), approximate="tanh") * mlp.up_proj(x))
    torch.testing.assert_close(mlp(x), want, atol=0, rtol=0)
    norm = model.model.layers[0].input_layernorm
    with torch.no_grad():
        norm.weight.normal_()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * (1 + norm.weight)
    torch.testing.assert_close(norm(x), y)


def test_qwen3_moe_is_qwen3_30b_a3bs_layer_shape_with_4_of_its_48_layers_and_fuse_hooks_its_experts_gate():
    """hidden 2048, 32 heads of 128, 4 KV heads, 128 experts of 768 (8 routed per token), vocab 151936 (untied),
    every layer sparse: ~3.1B parameters (2.4B in the experts), counted on the meta device; the experts run the
    grouped_mm implementation, and fuse() sets its gate (``FusedExpertsGate``) on a tiny copy's experts, with the
    unfused step's loss."""
    from pipegoose.nn.fusion import fuse

    spec = e2e.MODELS["qwen3_moe"]
    assert spec["arch"] == "qwen3_moe" and spec["batch"] == 4 and e2e.CONFIGS["qwen3_moe"] == "Qwen3MoeConfig"
    cfg = _config("qwen3_moe")
    assert (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok) == (2048, 768, 128, 8)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers) == (32, 4, 128, 4)
    assert cfg.vocab_size == 151936 and not cfg.tie_word_embeddings and not cfg.mlp_only_layers
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    h, e, i, v = 2048, 128, 768, 151936
    layer = 2 * h * 32 * 128 + 2 * h * 4 * 128 + e * 3 * h * i + h * e + 2 * h + 2 * 128   # attn, experts, router,
    want = 2 * v * h + 4 * layer + h                                                      # norms, q/k norms
    got = sum(p.numel() for p in model.parameters())
    assert got == want and 3.0e9 < got < 3.2e9
    assert model.config._experts_implementation == "grouped_mm"
    tiny = _tiny("qwen3_moe")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny).train()
    ids = torch.randint(0, tiny.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    want_loss = model(input_ids=ids, labels=ids).loss
    report = fuse(model)
    rows = [r for r in report.rows if r.path.endswith("mlp.experts")]
    assert len(rows) == 2 and all(r.fused and r.replacement == "FusedExpertsGate" for r in rows)
    assert torch.equal(model(input_ids=ids, labels=ids).loss, want_loss)


def test_mpt_is_mpt_7bs_layer_at_hidden_2048_and_fuse_replaces_its_attention():
    """hidden 2048, 24 layers, 16 heads of 128, MLP 4 x hidden, ALiBi over 2048 positions, no biases, vocab 50432
    (tied): ~1.31B parameters, counted on the meta device; eager attention (transformers has no other for MPT); fuse()
    replaces a tiny copy's attention by FusedMptAttention, with the unfused step's loss."""
    from pipegoose.nn.fusion import FusedMptAttention

    spec = e2e.MODELS["mpt"]
    assert spec["arch"] == "mpt" and spec["batch"] == 2 and spec["attn"] == "eager"
    assert e2e.CONFIGS["mpt"] == "MptConfig"
    cfg = _config("mpt")
    assert (cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.expansion_ratio, cfg.max_seq_len) == (2048, 16, 24, 4, 2048)
    assert cfg.vocab_size == 50432 and cfg.tie_word_embeddings and cfg.no_bias
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    h = 2048
    want = 50432 * h + 24 * (12 * h * h + 2 * h) + h   # tied embedding, Wqkv + out_proj + MLP, LayerNorm weights
    got = sum(p.numel() for p in model.parameters())
    assert got == want and 1.3e9 < got < 1.32e9
    model, report, want_loss, got_loss = _fused_step("mpt")
    rows = [r for r in report.rows if r.kind == "attention"]
    assert len(rows) == 2 and all(r.fused and r.replacement == "FusedMptAttention" for r in rows)
    assert isinstance(model.transformer.blocks[0].attn, FusedMptAttention)
    torch.testing.assert_close(got_loss, want_loss, atol=1e-5, rtol=1e-5)


def test_opt_is_opt_1_3bs_shape_and_fuse_replaces_its_layer_norms_and_loss():
    """hidden 2048, 24 layers, 32 heads, MLP 8192, learned positions to 2048 (+2 offset), vocab 50272 (tied): ~1.32B
    parameters, counted on the meta device; fuse() replaces a tiny copy's 2 x layers + 1 LayerNorms and its loss, and
    leaves SDPA, with the unfused step's loss."""
    from pipegoose.nn.fusion import MixedFusedLayerNorm

    spec = e2e.MODELS["opt"]
    assert spec["arch"] == "opt" and spec["batch"] == 4 and "attn" not in spec
    cfg = _config("opt")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.ffn_dim) == (2048, 24, 32, 8192)
    assert cfg.vocab_size == 50272 and cfg.tie_word_embeddings and cfg.do_layer_norm_before
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    h, f = 2048, 8192
    # tied embedding, learned positions (2048 + OPT's offset of 2), per layer q/k/v/out with biases, two LayerNorms,
    # fc1/fc2 with biases; the final LayerNorm
    want = 50272 * h + 2050 * h + 24 * (4 * (h * h + h) + 2 * 2 * h + h * f + f + f * h + h) + 2 * h
    got = sum(p.numel() for p in model.parameters())
    assert got == want and 1.3e9 < got < 1.33e9
    model, report, want_loss, got_loss = _fused_step("opt")
    norms = [r for r in report.rows if r.kind == "layer_norm"]
    assert len(norms) == 2 * model.config.num_hidden_layers + 1 and all(r.fused for r in norms)
    assert isinstance(model.model.decoder.final_layer_norm, MixedFusedLayerNorm)
    assert [r.fused for r in report.rows if r.kind == "cross_entropy"] == [True]
    assert not any(r.fused for r in report.rows if r.kind == "attention")   # (SDPA kept)
    torch.testing.assert_close(got_loss, want_loss, atol=1e-5, rtol=1e-5)


def test_bert_mlm_is_bert_larges_shape_as_a_masked_lm_at_512_positions(monkeypatch):
    """hidden 1024, 24 layers, 16 heads, MLP 4096, 512 positions, vocab 30522 (tied): ~335M parameters, counted on the
    meta device; BertForMaskedLM; batch 32 x 512 (the model's own seq, which run_e2e passes to the worker); labels
    on ~15% of the positions, -100 elsewhere, the others' ids unchanged."""
    spec = e2e.MODELS["bert_mlm"]
    assert spec["arch"] == "bert" and spec["head"] == "masked_lm" and (spec["batch"], spec["seq"]) == (32, 512)
    cfg = _config("bert_mlm")
    with torch.device("meta"):
        model = e2e.auto_class(spec).from_config(cfg, attn_implementation="sdpa")
    assert type(model).__name__ == "BertForMaskedLM"
    h, f, v = 1024, 4096, 30522
    layer = 4 * (h * h + h) + 2 * 2 * h + h * f + f + f * h + h   # q/k/v/out, two LayerNorms, the MLP (with biases)
    # embeddings (words, 512 positions, 2 token types, LayerNorm), layers, the MLM head's transform (dense, LayerNorm)
    # and its decoder's bias (the decoder's weight is the tied embedding); BertForMaskedLM has no pooler
    want = v * h + 512 * h + 2 * h + 2 * h + 24 * layer + (h * h + h) + 2 * h + v
    got = sum(p.numel() for p in model.parameters())
    assert got == want and 3.3e8 < got < 3.4e8
    ids = torch.randint(0, v, (32, 512))
    labels = e2e.labels_for(spec, ids, torch.Generator().manual_seed(0))
    kept = labels != -100
    assert torch.equal(labels[kept], ids[kept]) and abs(kept.float().mean().item() - e2e.MASKED_FRACTION) < 0.01
    assert e2e.labels_for(e2e.MODELS["llama"], ids, None) is ids   # (a causal LM: its ids, shifted by transformers)
    # fuse() on a tiny copy: its LayerNorms, GELU and the loss it computes inline, with the unfused step's loss
    _, report, want_loss, got_loss = _fused_step("bert_mlm")
    rows = [r for r in report.rows if r.kind == "cross_entropy"]
    assert len(rows) == 1 and rows[0].fused and rows[0].original == "CrossEntropyLoss (inline)", rows
    torch.testing.assert_close(got_loss, want_loss, atol=1e-5, rtol=1e-5)
    seen = []

    class Done:
        returncode, stdout, stderr = 0, "", "stop"

    def fake_run(cmd, **kw):
        seen.append(cmd)
        return Done()

    monkeypatch.setattr(subprocess, "run", fake_run)   # (the workers' commands, not run)
    rows = e2e.run_e2e(["bert_mlm", "opt"], ["sdpa"], deadline=time.perf_counter() + 1e3, log=lambda s: None)
    assert [r["seq"] for r in rows] == [512, 2048]
    assert [c[c.index("--seq") + 1] for c in seen] == ["512", "2048"]


def test_distilbert_mlm_is_distilbert_bases_shape_and_routes_its_loss_module():
    """hidden 768, 6 layers, 12 heads, MLP 3072, 512 positions, vocab 30522 (tied): ~66.9M parameters, counted on the
    meta device; DistilBertForMaskedLM, batch 32 x 512; fuse() on a tiny copy routes its mlm_loss_fct (a loss module of
    its own), with the unfused step's loss."""
    spec = e2e.MODELS["distilbert_mlm"]
    assert spec["arch"] == "distilbert" and spec["head"] == "masked_lm" and (spec["batch"], spec["seq"]) == (32, 512)
    with torch.device("meta"):
        model = e2e.auto_class(spec).from_config(_config("distilbert_mlm"), attn_implementation="sdpa")
    assert type(model).__name__ == "DistilBertForMaskedLM"
    h, f, v = 768, 3072, 30522
    layer = 4 * (h * h + h) + 2 * 2 * h + h * f + f + f * h + h   # q/k/v/out, two LayerNorms, the MLP (with biases)
    # embeddings (words, 512 positions, LayerNorm), layers, the head's transform (dense, LayerNorm), decoder bias
    want = v * h + 512 * h + 2 * h + 6 * layer + (h * h + h) + 2 * h + v
    got = sum(p.numel() for p in model.parameters())
    assert got == want and 6.6e7 < got < 6.8e7
    _, report, want_loss, got_loss = _fused_step("distilbert_mlm")
    rows = [r for r in report.rows if r.kind == "cross_entropy"]
    assert len(rows) == 1 and rows[0].fused and rows[0].original == "CrossEntropyLoss (mlm_loss_fct)", rows
    torch.testing.assert_close(got_loss, want_loss, atol=1e-5, rtol=1e-5)


def test_gemma_is_liger_patched_and_not_a_default_model():
    from benchmarks.run import parse_args

    assert "gemma" in e2e.LIGER_ONLY["liger"] and "gemma" in e2e.LIGER_ONLY["liger_rmsnorm"]
    assert parse_args(["--e2e"]).e2e_models == "llama,neox"   # (not in the default run: opt in, as phi3)
    a = parse_args(["--e2e", "--e2e-models", "gemma", "--e2e-batch", "gemma=2"])
    assert a.batch == {"gemma": 2}


class _FakeLiger:
    """``liger_kernel.transformers`` with the signatures of Liger-Kernel 0.8.5's ``apply_liger_kernel_to_llama`` and
    ``apply_liger_kernel_to_gemma`` (Gemma's MLP switch is ``geglu``: a ``swiglu=`` is a TypeError, as there)."""

    def __init__(self):
        self.calls = []

    def apply_liger_kernel_to_llama(self, rope=True, cross_entropy=False, fused_linear_cross_entropy=True,
                                    rms_norm=True, swiglu=True, model=None):
        self.calls.append(("llama", dict(rope=rope, cross_entropy=cross_entropy, flce=fused_linear_cross_entropy,
                                         rms_norm=rms_norm, mlp=swiglu, model=model)))

    def apply_liger_kernel_to_gemma(self, rope=True, cross_entropy=False, fused_linear_cross_entropy=True,
                                    rms_norm=True, geglu=True, model=None):
        self.calls.append(("gemma", dict(rope=rope, cross_entropy=cross_entropy, flce=fused_linear_cross_entropy,
                                         rms_norm=rms_norm, mlp=geglu, model=model)))


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_liger_variants_call_its_apply_with_its_defaults_or_its_rmsnorm_alone(arch):
    liger, model = _FakeLiger(), object()
    e2e.apply_liger(liger, arch, "liger", model)
    e2e.apply_liger(liger, arch, "liger_rmsnorm", model)
    defaults = dict(rope=True, cross_entropy=False, flce=True, rms_norm=True, mlp=True, model=model)
    alone = dict(rope=False, cross_entropy=False, flce=False, rms_norm=True, mlp=False, model=model)
    assert liger.calls == [(arch, defaults), (arch, alone)]
    with pytest.raises(ValueError, match="variant: expected liger or liger_rmsnorm, got 'sdpa'"):
        e2e.apply_liger(liger, arch, "sdpa", model)
