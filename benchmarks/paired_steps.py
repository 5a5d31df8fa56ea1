"""Fused against unfused, in paired training steps, at training batch sizes: does ``fuse(model)`` make a model slower?

Models (transformers' default configs, random weights, no download), bf16, dropout off:

* ``bert-base`` (hidden 768, 12 layers) at batch 32 x 128 and 16 x 512, right-padded batches;
* ``gpt2-small`` (hidden 768, 12 layers) at batch 8 x 1024, no padding;

each loaded with ``eager`` and with ``sdpa`` attention. For each case an unfused model and a fused ``copy.deepcopy``
of it run single forward + backward steps (loss: mean of the squared last hidden state) in turn, ``--steps`` each,
the order alternating; a step's time is the host wall time between two CUDA synchronisations. Reported: the median
step time of each and the speed-up, unfused median / fused median (> 1: fusing helps), with what ran
(``dispatch.stats()``). ``--aa``: both copies unfused (an A/A control: the spread of the method).

Used in the twentieth session (``benchmarks/results/nvidia_h200_2026-11-30/session20.log``, calls 4 and 5, as
``.gpu/ab_real.py``): at ``PIPEGOOSE_SMALL_NUMEL`` 2**20 every fused case was slower (x0.77-0.97). ``--device cpu
--tiny`` is a smoke run (tiny configs; the CPU runs the reference paths: its times mean nothing).

    python -m benchmarks.paired_steps [--steps 60] [--cases bert-base:eager:32x128,...] [--aa] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

CASES = ("bert-base:eager:32x128", "bert-base:sdpa:32x128", "bert-base:eager:16x512", "bert-base:sdpa:16x512",
         "gpt2-small:eager:8x1024", "gpt2-small:sdpa:8x1024")


def _parse_case(text: str) -> tuple[str, str, int, int]:
    try:
        model, attn, batch = text.split(":")
        b, s = (int(v) for v in batch.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--cases: {text!r}: expected MODEL:ATTENTION:BxS, e.g. bert-base:sdpa:32x128") from None
    if model not in ("bert-base", "gpt2-small") or attn not in ("eager", "sdpa") or b < 1 or s < 2:
        raise SystemExit(f"--cases: {text!r}: MODEL is bert-base or gpt2-small, ATTENTION eager or sdpa, B >= 1, "
                         f"S >= 2")
    return model, attn, b, s


def _build(model: str, attn: str, tiny: bool):
    from transformers import BertConfig, BertModel, GPT2Config, GPT2Model

    if model == "bert-base":
        small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128) if tiny else {}
        return BertModel(BertConfig(attn_implementation=attn, **small))
    small = dict(n_embd=64, n_layer=2, n_head=2) if tiny else {}
    return GPT2Model(GPT2Config(attn_implementation=attn, **small))


def _batch(b: int, s: int, vocab: int, pad: bool, device):
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    if pad:   # right padding of varied lengths, at most half the sequence
        for i in range(b):
            n = (i * 7) % (s // 2)
            if n:
                mask[i, s - n:] = 0
    return ids.to(device), mask.to(device)


def _step_ms(model, ids, mask, device) -> float:
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model.zero_grad(set_to_none=True)
    sync()
    t = time.perf_counter()
    out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    out.float().pow(2).mean().backward()
    sync()
    return (time.perf_counter() - t) * 1e3


def run_case(case: str, steps: int, device, tiny: bool, aa: bool) -> dict:
    """One case: ``{"case", "unfused_ms", "fused_ms", "speedup", "ran", "attention"}`` (medians over ``steps``)."""
    import torch

    from pipegoose.nn.fusion import dispatch, fuse

    name, attn, b, s = _parse_case(case)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    unfused = _build(name, attn, tiny).to(device, dtype).train()
    for m in unfused.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    fused = copy.deepcopy(unfused)
    report = None if aa else fuse(fused)
    ids, mask = _batch(b, s, unfused.config.vocab_size, name == "bert-base", device)
    for _ in range(min(5, steps)):
        _step_ms(unfused, ids, mask, device)
        _step_ms(fused, ids, mask, device)
    dispatch.reset_stats()
    tu, tf = [], []
    for i in range(steps):
        pair = ((tu, unfused), (tf, fused)) if i % 2 else ((tf, fused), (tu, unfused))
        for times, model in pair:
            times.append(_step_ms(model, ids, mask, device))
    mu, mf = statistics.median(tu), statistics.median(tf)
    return {"case": case, "batch": [b, s], "steps": steps, "aa": aa, "unfused_ms": round(mu, 3),
            "fused_ms": round(mf, 3), "speedup": round(mu / mf, 4), "ran": dispatch.stats(),
            "attention": None if report is None else report.attention}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.paired_steps", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60, help="steps of each model per case (default 60)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated MODEL:ATTENTION:BxS (default: all: "
                                                           f"{','.join(CASES)})")
    p.add_argument("--aa", action="store_true", help="A/A control: neither copy fused")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run (with --tiny)")
    p.add_argument("--tiny", action="store_true", help="tiny configs (a smoke run; the default configs otherwise)")
    p.add_argument("--out", type=Path, default=None, help="also write the results (and the environment) as JSON")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps: expected an integer >= 1, got {args.steps}")
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    for c in cases:
        _parse_case(c)
    import torch

    from benchmarks.common import environment

    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA GPU (use --device cpu --tiny for a smoke run)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    device = torch.device(args.device)
    env = environment(args.device)
    print(f"{env.get('gpu')}; torch {env['torch']}; transformers {env.get('transformers')}; "
          f"PIPEGOOSE_SMALL_NUMEL={os.environ.get('PIPEGOOSE_SMALL_NUMEL', 'default')}; {env['date']}", flush=True)
    results = []
    for case in cases:
        r = run_case(case, args.steps, device, args.tiny, args.aa)
        results.append(r)
        print(f"{case}: unfused {r['unfused_ms']:.2f} ms, {'copy' if args.aa else 'fused'} {r['fused_ms']:.2f} ms, "
              f"x{r['speedup']:.3f}; ran {r['ran']}", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"environment": env, "command": " ".join(["python -m benchmarks.paired_steps",
                                                                                 *(argv or sys.argv[1:])]),
                                        "small_numel": os.environ.get("PIPEGOOSE_SMALL_NUMEL"),
                                        "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
