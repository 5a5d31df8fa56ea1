"""Tiny transformers models (hidden 32, 2 layers) of the six architectures fuse() knows (``ARCHS``; and MPT's, whose
ALiBi attention has tests of its own: ``config("mpt")``), and their inputs."""

from __future__ import annotations

import importlib

import pytest
import torch

VOCAB = 97
ARCHS = ("bert", "gpt2", "gpt_neox", "llama", "opt", "bloom")
# Architectures whose attention goes through transformers' AttentionInterface (Bloom's does not).
INTERFACE_ARCHS = ("bert", "gpt2", "gpt_neox", "llama", "opt")


def config(arch: str, attn: str = "eager", hidden: int = 32, layers: int = 2, heads: int = 4, dropout: float = 0.0,
           **extra):
    import transformers as tr

    common = dict(vocab_size=VOCAB, attn_implementation=attn)
    if arch == "bert":
        cfg = tr.BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                            intermediate_size=2 * hidden, max_position_embeddings=512, hidden_dropout_prob=dropout,
                            attention_probs_dropout_prob=dropout, **common)
    elif arch == "gpt2":
        cfg = tr.GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=512, resid_pdrop=dropout,
                            bos_token_id=0, eos_token_id=0,
                            embd_pdrop=dropout, attn_pdrop=dropout, **common)
    elif arch == "gpt_neox":
        cfg = tr.GPTNeoXConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                               intermediate_size=2 * hidden, max_position_embeddings=512, attention_dropout=dropout,
                               hidden_dropout=dropout, **common)
    elif arch == "llama":
        cfg = tr.LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                             num_key_value_heads=max(1, heads // 2), intermediate_size=2 * hidden,
                             max_position_embeddings=512, attention_dropout=dropout, **common)
    elif arch == "opt":
        cfg = tr.OPTConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                           ffn_dim=2 * hidden, word_embed_proj_dim=hidden, max_position_embeddings=512,
                           dropout=dropout, attention_dropout=dropout, **common)
    elif arch == "bloom":
        cfg = tr.BloomConfig(hidden_size=hidden, n_layer=layers, n_head=heads, attention_dropout=dropout,
                             hidden_dropout=dropout, **common)
    elif arch == "mpt":   # (ALiBi over 64 positions; eager attention only, as Bloom)
        cfg = tr.MptConfig(d_model=hidden, n_layers=layers, n_heads=heads, expansion_ratio=2, max_seq_len=64,
                           **common)
        # (transformers 5.25's strict config types attn_pdrop as an int: a float is set past its check)
        object.__setattr__(cfg.attn_config, "attn_pdrop", dropout)
    else:
        raise ValueError(arch)
    for k, v in extra.items():
        setattr(cfg, k, v)
    return cfg


def rope_config(model_type: str, hidden: int = 32, heads: int = 4, max_positions: int = 64, **extra):
    """A tiny config (2 layers) of one of the RoPE models fuse() routes since session 63's review: ``esm`` (rotary
    position embeddings), ``modernbert``, or a decoder such as ``olmo2`` or ``phi`` (``extra``: e.g.
    ``partial_rotary_factor``); a pytest skip where this transformers lacks the model."""
    import pytest
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    common = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=heads,
                  max_position_embeddings=max_positions, **extra)
    if model_type == "esm":
        return CONFIG_MAPPING["esm"](vocab_size=33, pad_token_id=1, mask_token_id=32,
                                     position_embedding_type="rotary", **common)
    if model_type == "modernbert":
        return CONFIG_MAPPING["modernbert"](vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                            cls_token_id=1, sep_token_id=2, **common)
    return CONFIG_MAPPING[model_type](vocab_size=VOCAB, num_key_value_heads=max(1, heads // 2), pad_token_id=0,
                                      bos_token_id=1, eos_token_id=2, **common)


def build(arch: str, attn: str = "eager", seed: int = 0, cfg=None, **kw):
    """A base model (AutoModel) of ``arch``, in eval mode, from a fixed seed."""
    from transformers import AutoModel

    torch.manual_seed(seed)
    cfg = cfg if cfg is not None else config(arch, attn, **kw)
    return AutoModel.from_config(cfg, attn_implementation=attn).eval()


def inputs(batch: int = 3, seq: int = 11, seed: int = 1, left_pad=(0, 4, 2)):
    """Random token ids and a 2-D mask with left padding (row i has ``left_pad[i]`` padded positions), which gives
    fully masked rows in causal attention."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for i, p in enumerate(left_pad[:batch]):
        mask[i, :p] = 0
    return ids, mask


class Wrapper(torch.nn.Module):
    """A module holding a language model as ``base_model`` and calling it (the shape of PEFT's ``PeftModel``)."""

    def __init__(self, lm):
        super().__init__()
        self.base_model = lm

    def forward(self, **kw):
        return self.base_model(**kw)


class LlamaStyleRMSNorm(torch.nn.Module):
    """transformers' LlamaRMSNorm, written out (no transformers import): ``weight``, ``variance_epsilon``, fp32
    statistics, rounded to the input's dtype before the weight (two roundings)."""

    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.variance_epsilon = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


def transformers_attr(module: str, kind: str, name: str):
    """transformers.models.<module>.<kind>_<module>.<name> (kind: ``modeling`` or ``configuration``), or a pytest skip
    where this transformers lacks it."""
    try:
        mod = importlib.import_module(f"transformers.models.{module}.{kind}_{module}")
    except ImportError:
        pytest.skip(f"this transformers has no {module}")
    if not hasattr(mod, name):
        pytest.skip(f"this transformers has no {name}")
    return getattr(mod, name)


def gated_norm(module: str, cls: str, width: int, wdtype=None, seed: int = 0, **kw):
    """transformers' gated RMSNorm ``cls`` of ``transformers.models.<module>`` (a pytest skip where this transformers
    lacks it), of ``width`` values (``kw``: its other constructor arguments), in ``wdtype`` (default fp32), with a
    weight of its own (uniform 0.5 to 1.5 from ``seed``: a dropped weight shows)."""
    norm = transformers_attr(module, "modeling", cls)(width, **kw).to(wdtype or torch.float32)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(width, generator=torch.Generator().manual_seed(seed)) + 0.5)
    return norm
