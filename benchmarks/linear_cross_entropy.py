"""Fused linear cross-entropy: a language model's head and loss, forward + backward, time and peak memory.

    python -m benchmarks.linear_cross_entropy [--shapes 8192x2048x32000 ...] [--reps 20] [--impls a,b] [--out DIR]

Implementations, each of ``loss(hidden [N, H], weight [V, H], target [N])`` then the gradients of hidden and weight:

* ``pipegoose``: :func:`pipegoose.nn.fusion.fused_linear_cross_entropy` (strict: the fused path or an error), its
  default chunking; ``pipegoose@R`` the same at R rows per chunk (``--chunk-rows R ...``: the default is the largest
  power of two of rows whose logits hold at most 2**27 values, at least 2048; each chunk reads and writes the weight's
  whole gradient once);
* ``pipegoose-ce``: the unfused head, ``F.linear``, then our cross-entropy kernel on the whole logits;
* ``transformers``: ``F.cross_entropy(F.linear(hidden, weight).float(), target)``, what transformers' causal-LM loss
  runs after ``lm_head``;
* ``compile``: ``torch.compile`` of that expression;
* ``liger``: Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss``, where ``liger_kernel`` is importable.

The head is bound by its three GEMMs (``6 N H V`` flops forward + backward), so the measure is time (median of the
repetitions, CUDA events, the L2 cache flushed before each: ``benchmarks.timing``), the achieved TFLOP/s of those
flops, and the peak memory allocated beyond the inputs during one step (``torch.cuda.max_memory_allocated``). Each
implementation's loss and gradients are first compared with ``transformers``' (the loss within the bf16 tolerance of
``tests/tolerances.py``, the gradients relative to their largest element); one that differs is reported FAILED and
not timed. Writes ``linear_cross_entropy.json`` and ``.md`` (GPU, versions, date) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from benchmarks.common import environment, parse_sizes, raise_compile_limits, today, tolerances
from benchmarks.timing import Timer

# Llama-1.1B (TinyLlama), Llama-3-8B's head, Qwen2-0.5B's head, 8192 tokens each; Llama-1.1B at 16384 tokens
SHAPES = ["8192x2048x32000", "8192x4096x128256", "8192x896x151936", "16384x2048x32000"]
IMPLS = ("pipegoose", "pipegoose-ce", "transformers", "compile", "liger")


def parse_shape(text: str) -> tuple[int, int, int]:
    """``NxHxV`` -> (N, H, V), all positive."""
    return parse_sizes(text, "NxHxV", "tokens x hidden x vocabulary")


def losses(chunk_rows: list[int] = ()) -> dict[str, Callable | None]:
    """name -> ``fn(hidden, weight, target)`` returning the scalar loss (None where it cannot run here); one
    ``pipegoose@R`` per value R of ``chunk_rows`` (our fused loss with R rows per chunk, beside the default's)."""
    from pipegoose.nn.fusion import cross_entropy, dispatch, fused_linear_cross_entropy

    def ours(h, w, t, rows=None):
        with dispatch.strict():
            return fused_linear_cross_entropy(h, w, t, impl="pipegoose", chunk_rows=rows)

    def ours_ce(h, w, t):
        with dispatch.strict():
            return cross_entropy(F.linear(h, w), t, impl="pipegoose")

    def upcast(h, w, t):
        return F.cross_entropy(F.linear(h, w).float(), t)

    raise_compile_limits()   # (one compiled function for every shape of the run)
    fns: dict[str, Callable | None] = {"pipegoose": ours, "pipegoose-ce": ours_ce, "transformers": upcast,
                                       "compile": torch.compile(upcast, dynamic=False), "liger": None}
    for r in chunk_rows:
        fns[f"pipegoose@{r}"] = lambda h, w, t, r=r: ours(h, w, t, r)
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()

        def liger_fn(h, w, t):
            out = liger(w, h, t)
            return out[0] if isinstance(out, tuple) else out
        fns["liger"] = liger_fn
    except ImportError:
        pass
    return fns


def step(fn: Callable, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> tuple:
    """One forward + backward: (loss, grad hidden, grad weight)."""
    loss = fn(hidden, weight, target)
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    return loss.detach(), gh, gw


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (inf where got has a NaN that want has not)."""
    g, w = got.float(), want.float()
    if torch.isnan(g).any() and not torch.isnan(w).any():
        return float("inf")
    return ((g - w).abs().max() / w.abs().max().clamp_min(1e-30)).item()


def run_shape(shape: tuple[int, int, int], fns: dict, timer: Timer, dtype: torch.dtype,
              impls: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """One row per implementation (those of ``impls``, default all); ``transformers`` is the correctness check of
    every row, run whether or not it is timed."""
    n, h, v = shape
    g = torch.Generator(device="cuda").manual_seed(n + h + v)
    hidden = torch.randn(n, h, device="cuda", generator=g).to(dtype).requires_grad_(True)
    weight = (torch.randn(v, h, device="cuda", generator=g) * h ** -0.5).to(dtype).requires_grad_(True)
    target = torch.randint(0, v, (n,), device="cuda", generator=g)
    target[::7] = -100
    want = step(fns["transformers"], hidden, weight, target)
    tol = tolerances()[dtype]
    rows = []
    for name in IMPLS + tuple(k for k in fns if k not in IMPLS):
        if impls is not None and name not in impls:
            continue
        row: dict[str, Any] = dict(impl=name, tokens=n, hidden=h, vocab=v, dtype=str(dtype).removeprefix("torch."))
        fn = fns.get(name)
        if fn is None:
            rows.append(dict(row, status="unavailable", why="liger_kernel not importable"))
            continue
        try:
            got = step(fn, hidden, weight, target)
            errs = dict(loss=abs(got[0].item() - want[0].item()) / max(abs(want[0].item()), 1e-30),
                        grad_hidden=rel_error(got[1], want[1]), grad_weight=rel_error(got[2], want[2]))
            del got
            # the loss within the dtype's rtol; the gradients within 4 of it, relative to their largest element (the
            # weight's gradient of a chunked head is accumulated in bf16 over the chunks)
            ok = errs["loss"] <= tol["rtol"] and max(errs["grad_hidden"], errs["grad_weight"]) <= 4 * tol["rtol"]
            row.update(errors=errs)
            if not ok:
                rows.append(dict(row, status="FAILED", why=f"differs from transformers' expression: {errs}"))
                continue
            t = timer.time(lambda _: step(fn, hidden, weight, target))
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = step(fn, hidden, weight, target)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            del out
            tflops = 6 * n * h * v / (t["median_ms"] * 1e-3) / 1e12
            rows.append(dict(row, status="ok", **t, tflops=tflops, peak_mib=peak / 2**20))
        except torch.cuda.OutOfMemoryError as e:
            torch.cuda.empty_cache()
            rows.append(dict(row, status="oom", why=str(e).splitlines()[0][:200]))
        except Exception as e:  # noqa: BLE001 (one implementation's crash is a row, not the end of the run)
            rows.append(dict(row, status="error", why=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"))
    return rows


def markdown(env: dict, rows: list[dict]) -> str:
    lines = [f"# Fused linear cross-entropy, forward + backward ({env.get('gpu')}, {env.get('date')})", "",
             f"torch {env.get('torch')}, CUDA {env.get('cuda_runtime')}, triton {env.get('triton')}, Liger-Kernel "
             f"{env.get('liger_kernel')}, pipegoose {env.get('pipegoose_git')}. Time: median ms of the step (L2 "
             f"flushed); TFLOP/s of its 6 N H V GEMM flops; peak: memory allocated beyond the inputs.", "",
             "| N x H x V | impl | ms | TFLOP/s | peak MiB | status |", "|---|---|---|---|---|---|"]
    for r in rows:
        shape = f"{r['tokens']}x{r['hidden']}x{r['vocab']}"
        if r["status"] == "ok":
            lines.append(f"| {shape} | {r['impl']} | {r['median_ms']:.3f} | {r['tflops']:.0f} | {r['peak_mib']:.0f} "
                         f"| ok |")
        else:
            lines.append(f"| {shape} | {r['impl']} | | | | {r['status']}: {r.get('why', '')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.linear_cross_entropy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=parse_shape, nargs="+", default=[parse_shape(s) for s in SHAPES],
                    help="NxHxV: tokens x hidden size x vocabulary (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--chunk-rows", type=int, nargs="*", default=[],
                    help="also time our fused loss at these rows per chunk (rows pipegoose@R), beside the default")
    ap.add_argument("--impls", default="", help=f"comma separated, of {', '.join(IMPLS)} and pipegoose@R for each "
                                                 "--chunk-rows R (default: all)")
    ap.add_argument("--out", type=Path, default=None, help="folder for linear_cross_entropy.json / .md")
    args = ap.parse_args(argv)
    if any(r < 1 for r in args.chunk_rows):
        ap.error(f"--chunk-rows: expected positive numbers of rows, got {args.chunk_rows}")
    if args.reps < 1:
        ap.error(f"--reps: expected a positive number of repetitions, got {args.reps}")
    known = IMPLS + tuple(f"pipegoose@{r}" for r in args.chunk_rows)
    impls = tuple(x.strip() for x in args.impls.split(",") if x.strip()) or None
    if args.impls and impls is None:
        ap.error(f"--impls: expected some of {', '.join(known)}, got {args.impls!r}")
    unknown = [x for x in impls or () if x not in known]
    if unknown:
        ap.error(f"--impls: unknown {', '.join(unknown)}; expected some of {', '.join(known)} (pipegoose@R needs "
                 f"--chunk-rows R)")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.linear_cross_entropy: needs a CUDA GPU")
    env = environment("cuda")
    fns = losses(args.chunk_rows)
    timer = Timer("cuda", warmup=3, reps=args.reps, max_s=10.0)
    rows = []
    for shape in args.shapes:
        rows += run_shape(shape, fns, timer, torch.bfloat16, impls)
        torch.cuda.empty_cache()
    md = markdown(env, rows)
    print(md)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "linear_cross_entropy.json").write_text(json.dumps(dict(environment=env, date=today(),
                                                                            rows=rows), indent=1))
        (args.out / "linear_cross_entropy.md").write_text(md)


if __name__ == "__main__":
    main()
