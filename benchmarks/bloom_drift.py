"""Bloom's bf16 training losses, eager against fused, next to an fp32 reference: which one drifts.

    python -m benchmarks.bloom_drift                       # CPU by default (a few minutes on two cores)
    python -m benchmarks.bloom_drift --device cuda --hidden 2048 --layers 24 --seq 2048 --vocab 250880 --batch 1 \
        --lr 1e-4 [--autocast] [--seed 1] [--runs eager_fp32,fused_bf16,...] [--out losses.json]

Why: on the H100 (session 74) the fused BLOOM-1B7-shaped step (``benchmarks.e2e``, model ``bloom_1b7``) trained its
repeated batch faster than eager Bloom in bf16 (last loss 0.837 against 1.002, the e2e gate's 2% exceeded), while the
BLOOM-560M-shaped one stayed within 1.3%. Eager Bloom rounds ``alpha * Q K^T + alibi`` to bf16 before its softmax,
where ALiBi's terms reach ``slope * position`` (bf16's spacing is 8 at 1024-2047); the fused attention adds the same
bf16 ALiBi to fp32 scores (SDPA). This runs the same AdamW steps on one batch from one initialisation in the ways of
``RUNS``, and prints each run's losses and its largest distance from the reference's.

What it measured (session 75, H100, the command above; ``benchmarks/results/nvidia_h100_80gb_hbm3_2026-12-07``): in
pure bf16 both bf16 runs fell faster than fp32, the fused one most (largest gap 0.79 / 0.86 over two seeds, eager's
0.57 / 0.72; ``fused_softmax_bf16`` and ``fused_keep_attention_bf16`` tracked eager); with ``--autocast`` the fused
and eager runs stayed as near fp32 as each other (0.14 / 0.15).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os

import torch

#: the runs, each from the same initialisation: eager Bloom in fp32 (the reference) and in bf16, ``fuse(model)`` in
#: bf16 with its default attention (SDPA with the ALiBi bias) and with the fused masked softmax
#: (``PIPEGOOSE_IMPL_ATTENTION=pipegoose``: bf16 scores, as eager's), and with eager's attention kept
#: (``fuse(model, attention="keep")``: the other fused ops alone)
RUNS = ("eager_fp32", "eager_bf16", "fused_bf16", "fused_softmax_bf16", "fused_keep_attention_bf16")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--steps", type=int, default=11)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0, help="the initialisation's seed (the batch's: seed + 1)")
    ap.add_argument("--runs", default=",".join(RUNS),
                    help=f"comma-separated, run in this order (default all): {', '.join(RUNS)}")
    ap.add_argument("--autocast", action="store_true",
                    help="the 16-bit runs (named *_bf16) keep fp32 weights and run under bf16 autocast (mixed "
                         "precision)")
    ap.add_argument("--out", help="also write the losses here as JSON")
    a = ap.parse_args(argv)
    runs_asked = [r.strip() for r in a.runs.split(",") if r.strip()]
    unknown = sorted(set(runs_asked) - set(RUNS))
    if unknown:
        ap.error(f"--runs: unknown {unknown}; expected some of {list(RUNS)}")
    if "eager_fp32" not in runs_asked:
        ap.error("--runs: eager_fp32 is the reference and must be one of the runs")
    if a.steps < 1:
        ap.error(f"--steps: expected at least 1, got {a.steps}")
    if a.out and not os.path.isdir(os.path.dirname(os.path.abspath(a.out))):
        ap.error(f"--out: the folder of {a.out} does not exist (checked before the runs, not after)")

    import transformers

    from pipegoose.nn.fusion import fuse

    torch.manual_seed(a.seed)
    cfg = transformers.BloomConfig(hidden_size=a.hidden, n_layer=a.layers, n_head=a.heads, vocab_size=a.vocab)
    with torch.device(a.device):   # initialised where it runs (fast on a GPU), kept on the CPU between runs
        base = transformers.AutoModelForCausalLM.from_config(cfg).train()
    base = base.cpu()
    batch_gen = torch.Generator().manual_seed(a.seed + 1)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=batch_gen).to(a.device)

    def run(name: str) -> list[float] | str:
        half = name != "eager_fp32"
        model = copy.deepcopy(base).to(a.device, torch.bfloat16 if half and not a.autocast else torch.float32)
        amp = torch.autocast(torch.device(a.device).type, torch.bfloat16, enabled=half and a.autocast)
        if name.startswith("fused"):
            fuse(model, attention="keep" if name == "fused_keep_attention_bf16" else "auto")
        env = {"fused_softmax_bf16": "pipegoose"}.get(name)
        before = os.environ.get("PIPEGOOSE_IMPL_ATTENTION")
        if env:
            os.environ["PIPEGOOSE_IMPL_ATTENTION"] = env
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
        losses: list[float] = []
        try:
            for _ in range(a.steps):
                with amp:
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(float(loss.detach()))
        except torch.OutOfMemoryError:
            return f"out of memory after {len(losses)} steps"
        finally:
            if env:
                if before is None:
                    os.environ.pop("PIPEGOOSE_IMPL_ATTENTION")
                else:
                    os.environ["PIPEGOOSE_IMPL_ATTENTION"] = before
            del model, opt
            gc.collect()
            if a.device.startswith("cuda"):
                torch.cuda.empty_cache()
        return losses

    runs = {name: run(name) for name in runs_asked}
    ref = runs["eager_fp32"]
    for name, losses in runs.items():
        if isinstance(losses, str) or isinstance(ref, str):
            print(f"{name:26s} {losses if isinstance(losses, str) else ' '.join(f'{x:.4f}' for x in losses)}")
            continue
        gap = max(abs(x - r) for x, r in zip(losses, ref))
        print(f"{name:26s} " + " ".join(f"{x:.4f}" for x in losses) + f"   max |loss - fp32's| {gap:.4f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "torch": torch.__version__, "transformers": transformers.__version__,
                       "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
                       "date": datetime.date.today().isoformat(), "losses": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
