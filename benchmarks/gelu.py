"""GELU alone (op ``gelu``: the activation of the MLPs without a gate): forward, and forward + backward, time and
effective bandwidth, in one run beside the copy bandwidth.

    python -m benchmarks.gelu [--shapes 8192x3072 ...] [--act gelu_new|bloom|gelu] [--dtypes bf16,fp16,fp32]
                              [--reps 30] [--impls a,b] [--out DIR]

Shapes ``RxC``: tokens x the MLP's intermediate size (defaults: GPT-2's 4 x 2048 tokens at 3072, GPT-2 large's at
5120, Phi-1.5's and Phi-2's at 8192 and 10240, GPT-J's at 16384). ``--act`` picks whose activation the
``transformers`` rows run and which GELU every row computes: ``gelu_new`` (default: transformers'
``NewGELUActivation``, GPT-2's, GPT-J's, Phi's, CodeGen's; the tanh approximation), ``bloom`` (Bloom's
``BloomGelu``, its own autograd Function; tanh) or ``gelu`` (``GELUActivation``: ``F.gelu``, exact).

Implementations, each of ``y = gelu(x)``:

* ``pipegoose``: :func:`pipegoose.nn.fusion.functional.gelu` with ``impl="pipegoose"`` (strict: the kernel or an
  error), what ``FusedGELU`` runs once ``fuse`` put it in place of the activation;
* ``torch``: ``F.gelu(x, approximate=...)``, PyTorch's one kernel each way;
* ``transformers``: the model's activation module, eager (what the model runs unfused);
* ``compile``: ``torch.compile`` of that module's forward.

Each implementation's result and gradient are first compared with float64's (the dtype's tolerance of
``tests/tolerances.py``, scaled by 2); one that differs is reported FAILED and not timed. Time: the median of the
repetitions (CUDA events, the L2 cache flushed before each: ``benchmarks.timing``); the backward is timed with the
forward (``fwd+bwd``). Effective bandwidth: the fewest bytes each pass must move (forward: x read, y written;
backward: the output's gradient and x read, x's gradient written) over the median time, and its share of the
device copy bandwidth measured in the same run. The memory a forward keeps for its backward (``saved MiB``: what
autograd holds between the two, beyond the input itself) is given for each. Writes ``gelu.json`` and ``.md`` (GPU,
versions, date; ``gelu_bloom.*``, ``gelu_exact.*`` for the other ``--act``) into ``--out``. ``--device cpu`` is a
dry run of the plumbing (small shapes, no flush, no copy bandwidth: its GB/s and % columns mean nothing there;
``pipegoose`` errors there: the kernel needs a GPU).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from benchmarks.common import (environment, parse_dtypes_reps_impls, parse_sizes, raise_compile_limits, today,
                               tolerances)
from benchmarks.timing import Timer

SHAPES = ["8192x3072", "8192x5120", "8192x8192", "8192x10240", "8192x16384"]
DRY_SHAPES = ["64x96"]
IMPLS = ("pipegoose", "torch", "transformers", "compile")
PASSES = ("fwd", "fwd+bwd")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ACTS = {"gelu_new": "tanh", "bloom": "tanh", "gelu": "none"}


def parse_shape(text: str) -> tuple[int, int]:
    """``RxC`` -> (R, C), both positive."""
    return parse_sizes(text, "RxC", "tokens x intermediate size")


def activation(act: str) -> torch.nn.Module:
    """The transformers module of ``--act``."""
    if act == "bloom":
        from transformers.models.bloom.modeling_bloom import BloomGelu

        return BloomGelu()
    from transformers.activations import ACT2FN

    return ACT2FN[act]


def functions(act: str) -> dict[str, Callable]:
    from pipegoose.nn.fusion import dispatch
    from pipegoose.nn.fusion.functional import gelu

    approximate = ACTS[act]
    theirs = activation(act).train()

    def ours(x):
        with dispatch.strict():
            return gelu(x, approximate, impl="pipegoose")

    raise_compile_limits()
    return {"pipegoose": ours, "torch": lambda x: F.gelu(x, approximate=approximate), "transformers": theirs,
            "compile": torch.compile(theirs, dynamic=False)}


def min_bytes(shape: tuple[int, int], dtype: torch.dtype, passes: str) -> int:
    n = shape[0] * shape[1] * torch.empty((), dtype=dtype).element_size()
    return 2 * n if passes == "fwd" else 5 * n


def run_pass(fn: Callable, x: torch.Tensor, dy: torch.Tensor, passes: str) -> tuple:
    y = fn(x)
    if passes == "fwd":
        return (y,)
    (dx,) = torch.autograd.grad(y, x, dy)
    return y, dx


def saved_mib(fn: Callable, x: torch.Tensor) -> float:
    """MiB that autograd saves for the backward of ``fn(x)`` beyond ``x`` itself (saved tensors' storages, each
    counted once)."""
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x)
    del y
    return sum(seen.values()) / 2**20


def run_shape(shape, fns, timer, dtype, device, copy_gbps, approximate, impls=None) -> list[dict[str, Any]]:
    g = torch.Generator(device=device).manual_seed(shape[0] + shape[1])
    x = (3 * torch.randn(shape, device=device, generator=g)).to(dtype).requires_grad_()
    dy = torch.randn(shape, device=device, generator=g).to(dtype)
    x64 = x.detach().cpu().double().requires_grad_()
    y64 = F.gelu(x64, approximate=approximate)
    (dx64,) = torch.autograd.grad(y64, x64, dy.cpu().double())
    tol = tolerances()[dtype]
    rows = []
    for name in IMPLS:
        if impls is not None and name not in impls:
            continue
        base: dict[str, Any] = dict(impl=name, rows=shape[0], cols=shape[1], dtype=str(dtype).removeprefix("torch."))
        try:
            got = run_pass(fns[name], x, dy, "fwd+bwd")
            bad = [n for n, a, w in zip(("y", "grad_x"), got, (y64, dx64))
                   if a.shape != w.shape or not torch.allclose(a.double().cpu(), w, rtol=2 * tol["rtol"],
                                                               atol=2 * tol["atol"])]
            del got
            if bad:
                rows += [dict(base, passes=p, status="FAILED", why=f"differs from float64: {bad}") for p in PASSES]
                continue
            saved = saved_mib(fns[name], x)
            for p in PASSES:
                t = timer.time(lambda _, p=p: run_pass(fns[name], x, dy, p))
                gbps = min_bytes(shape, dtype, p) / (t["median_ms"] * 1e-3) / 1e9
                rows.append(dict(base, passes=p, status="ok", **t, gbps=gbps, saved_mib=saved,
                                 pct_copy=100 * gbps / copy_gbps if copy_gbps else None))
        except Exception as e:  # noqa: BLE001 (one implementation's failure is a row, not the end of the run)
            rows += [dict(base, passes=p, status="error", why=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
                     for p in PASSES]
    return rows


def markdown(env: dict, rows: list[dict], copy_gbps: float, act: str) -> str:
    dtypes = ", ".join(dict.fromkeys(r["dtype"] for r in rows)) or "no rows"
    lines = [f"# GELU alone ({act}: approximate={ACTS[act]!r}), {dtypes} ({env.get('gpu')}, {env.get('date')})", "",
             f"torch {env.get('torch')}, CUDA {env.get('cuda_runtime')}, triton {env.get('triton')}, transformers "
             f"{env.get('transformers')}, pipegoose {env.get('pipegoose_git')}. Device copy: {copy_gbps:.0f} GB/s. "
             "Time: median ms (L2 flushed); GB/s of the fewest bytes the pass moves; % of that copy; saved: MiB "
             "autograd keeps for the backward beyond the input.", "",
             "| tokens x cols | dtype | pass | impl | ms | GB/s | % of copy | saved MiB | status |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['rows']}x{r['cols']} | {r['dtype']} | {r['passes']} | {r['impl']} "
        if r["status"] == "ok":
            pct = f"{r['pct_copy']:.1f}" if r.get("pct_copy") is not None else ""
            lines.append(f"{head}| {r['median_ms']:.4f} | {r['gbps']:.0f} | {pct} | {r['saved_mib']:.1f} | ok |")
        else:
            lines.append(f"{head}| | | | | {r['status']}: {r.get('why', '')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gelu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=parse_shape, nargs="+", default=None,
                    help=f"RxC (default: {' '.join(SHAPES)}; on the CPU {' '.join(DRY_SHAPES)})")
    ap.add_argument("--act", choices=tuple(ACTS), default="gelu_new", help="whose activation (default gelu_new)")
    ap.add_argument("--dtypes", default="bf16", help="comma separated, of bf16, fp16, fp32 (default: bf16)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--impls", default="", help=f"comma separated, of {', '.join(IMPLS)} (default: all)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run of the plumbing")
    ap.add_argument("--out", type=Path, default=None, help="folder for gelu.json / .md")
    args = ap.parse_args(argv)
    dtypes, impls = parse_dtypes_reps_impls(ap, args, DTYPES, IMPLS)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks.gelu: needs a CUDA GPU (--device cpu: a dry run)")
    shapes = args.shapes or [parse_shape(s) for s in (SHAPES if args.device == "cuda" else DRY_SHAPES)]
    env = environment(args.device)
    timer = Timer(args.device, warmup=3, reps=args.reps, max_s=10.0)
    copy_gbps = timer.copy_gbps() if args.device == "cuda" else 0.0
    fns = functions(args.act)
    rows = []
    for dtype in dtypes:
        for shape in shapes:
            rows += run_shape(shape, fns, timer, dtype, args.device, copy_gbps, ACTS[args.act], impls)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    md = markdown(env, rows, copy_gbps, args.act)
    print(md)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = {"gelu_new": "gelu", "bloom": "gelu_bloom", "gelu": "gelu_exact"}[args.act]
        (args.out / f"{stem}.json").write_text(json.dumps(dict(environment=env, date=today(), copy_gbps=copy_gbps,
                                                               act=args.act, rows=rows), indent=1))
        (args.out / f"{stem}.md").write_text(md)


if __name__ == "__main__":
    main()
