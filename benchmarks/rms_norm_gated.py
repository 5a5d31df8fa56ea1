"""The gated RMSNorm of linear-attention and state-space layers: Qwen3-Next's and Qwen3.5's ``RMSNormGated`` (the
norm, then ``silu`` of the gate; the default) or, with ``--gate-first``, Mamba2's ``MambaRMSNormGated`` (the gate,
then the norm over groups of ``--group`` values: Bamba's, Nemotron-H's, Granite-4's): forward, and forward +
backward, time and effective bandwidth, in one run beside the copy bandwidth.

    python -m benchmarks.rms_norm_gated [--shapes 16384x128 ...] [--dtypes bf16,fp32] [--reps 30] [--impls a,b]
                                        [--gate-first] [--group N] [--out DIR] [--device cpu]

Shapes ``RxD``: rows (tokens, times value heads for Qwen3-Next) and the normalised size (a value head's, 128, in
Qwen3-Next and Qwen3.5; Mamba2's intermediate size, 8192 in Bamba-9B and Nemotron-H-8B). x, gate and the output
gradient [R, D] of one dtype, the weight [D] of it too (``--weight-fp32``: fp32, as in mixed precision).

Implementations, each of ``y = norm(x, gate)`` (op ``rms_norm_gated``, strict: each runs as named, or is an error):

* ``pipegoose``: :func:`pipegoose.nn.fusion.functional.rms_norm_gated` with ``impl="pipegoose"``: the one kernel each
  way (pipegoose/kernels/csrc/rms_norm_gated.cu);
* ``ops``: the same with ``impl="ops"``: op ``rms_norm`` then op ``swiglu`` (the norm before the gate over whole rows
  only: left out with ``--gate-first`` unless named);
* ``transformers``: ``Qwen3_5RMSNormGated``'s forward (Qwen3-Next's where Qwen3.5 is missing), or
  ``Mamba2RMSNormGated``'s with ``--gate-first``, eager: what the model runs;
* ``compile``: ``torch.compile`` of that forward.

Each implementation's output and gradients (x, gate, weight) are first compared with ``transformers``' (the dtype's
tolerance of ``tests/tolerances.py``, scaled by 2; the weight's gradient, a sum over the rows, by 4, its atol relative
to its largest value); one that
differs is reported FAILED and not timed. Time: the median of the repetitions (CUDA events, the L2 cache flushed before
each: ``benchmarks.timing``); the backward is timed with the forward (``fwd+bwd``). Effective bandwidth: the fewest
bytes each pass must move (forward: x and gate read, y written, the weight read; backward: the output gradient, x,
gate and the weight read, the gradients of x and gate written, the weight's written once) over the median time, and
its share of the device copy bandwidth measured in the same run. Writes ``rms_norm_gated.json`` and ``.md``
(``rms_norm_gated_gate_first.*`` with ``--gate-first``; GPU, versions, date) into ``--out``. ``--device cpu`` is a
dry run of the plumbing (small shapes, no flush; ``pipegoose`` and ``ops`` error there: the kernels need a GPU).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.common import (environment, parse_dtypes_reps_impls, parse_sizes, raise_compile_limits, timing_cells,
                               today, tolerances, versions_line)
from benchmarks.timing import Timer

# Qwen3.5 / Qwen3-Next value heads of 128: 8 x 2048 tokens times 32 heads, and 16 heads; a wider norm of 512
SHAPES = ["524288x128", "262144x128", "65536x512"]
# Mamba2-style layers, 8 x 2048 tokens: Bamba-9B's / Granite-4's one group of 8192, Nemotron-H-8B's eight of 1024
# (--group 1024), a smaller model's 4096
GATE_FIRST_SHAPES = ["16384x8192", "16384x4096"]
DRY_SHAPES = ["64x16"]
IMPLS = ("pipegoose", "ops", "transformers", "compile")
PASSES = ("fwd", "fwd+bwd")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
EPS = 1e-6


def parse_shape(text: str) -> tuple[int, int]:
    """``RxD`` -> (R, D), both positive."""
    return parse_sizes(text, "RxD", "rows x normalised size")


def _module_class(gate_first: bool = False):
    """transformers' gated norm: Qwen3.5's, else Qwen3-Next's; with the gate first Mamba2's, else Bamba's."""
    import importlib

    names = ((("mamba2", "Mamba2RMSNormGated"), ("bamba", "BambaRMSNormGated")) if gate_first else
             (("qwen3_5", "Qwen3_5RMSNormGated"), ("qwen3_next", "Qwen3NextRMSNormGated")))
    for name, cls in names:
        try:
            return getattr(importlib.import_module(f"transformers.models.{name}.modeling_{name}"), cls)
        except (ImportError, AttributeError):
            continue
    raise SystemExit(f"benchmarks.rms_norm_gated: this transformers has none of {[c for _, c in names]}")


def functions(gate_first: bool = False, group: int | None = None) -> dict[str, Callable]:
    """name -> ``fn(x, gate, weight)``; ``group``: the values normalised together (None: the row)."""
    from pipegoose.nn.fusion import dispatch
    from pipegoose.nn.fusion.functional import rms_norm_gated

    cls = _module_class(gate_first)

    def theirs(x, gate, weight):   # (the module's own forward, with this weight)
        m = cls.__new__(cls)
        torch.nn.Module.__init__(m)
        m.weight, m.variance_epsilon, m.activation = weight, EPS, "silu"
        m.group_size = group or x.shape[-1]
        return cls.forward(m, x, gate)

    def named(impl):
        def ours(x, gate, weight):
            with dispatch.strict():
                return rms_norm_gated(x, gate, weight, EPS, group_size=group, norm_before_gate=not gate_first,
                                      impl=impl)
        return ours

    raise_compile_limits()
    return {"pipegoose": named("pipegoose"), "ops": named("ops"), "transformers": theirs,
            "compile": torch.compile(theirs, dynamic=False)}


def inputs(shape: tuple[int, int], dtype: torch.dtype, device: str, weight_fp32: bool = False) -> dict:
    r, d = shape
    g = torch.Generator(device=device).manual_seed(r + d)
    x = (torch.randn(r, d, device=device, generator=g) + 0.3).to(dtype)
    gate = (torch.randn(r, d, device=device, generator=g) * 2).to(dtype)
    w = (torch.rand(d, device=device, generator=g) + 0.5).to(torch.float32 if weight_fp32 else dtype)
    dy = torch.randn(r, d, device=device, generator=g).to(dtype)
    return dict(x=x.requires_grad_(), gate=gate.requires_grad_(), weight=w.requires_grad_(), dy=dy)


def min_bytes(shape: tuple[int, int], dtype: torch.dtype, wdtype: torch.dtype, passes: str,
              odtype: torch.dtype | None = None) -> int:
    """The fewest bytes a pass moves: forward x and gate read, y (of ``odtype``, default x's) written, the weight
    read; the backward the output gradient, x and gate read, their gradients written, the weight read and its
    gradient written."""
    r, d = shape
    e, we, oe = (torch.empty((), dtype=t).element_size() for t in (dtype, wdtype, odtype or dtype))
    fwd = r * d * (2 * e + oe) + d * we
    bwd = r * d * (4 * e + oe) + 2 * d * we
    return fwd if passes == "fwd" else fwd + bwd


def run_pass(fn: Callable, inp: dict, passes: str) -> tuple:
    y = fn(inp["x"], inp["gate"], inp["weight"])
    if passes == "fwd":
        return (y,)
    return (y, *torch.autograd.grad(y, (inp["x"], inp["gate"], inp["weight"]), inp["dy"]))


def run_shape(shape: tuple[int, int], fns: dict, timer: Timer, dtype: torch.dtype, device: str, copy_gbps: float,
              impls: tuple[str, ...] | None = None, weight_fp32: bool = False) -> list[dict[str, Any]]:
    """One row per implementation and pass; ``transformers`` is the correctness check of every row."""
    inp = inputs(shape, dtype, device, weight_fp32)
    wdtype = inp["weight"].dtype
    want = run_pass(fns["transformers"], inp, "fwd+bwd")
    odtype = want[0].dtype
    tol = tolerances()[dtype]
    rows = []
    for name in IMPLS:
        if impls is not None and name not in impls:
            continue
        base: dict[str, Any] = dict(impl=name, rows=shape[0], width=shape[1], dtype=str(dtype).removeprefix("torch."),
                                    weight_dtype=str(wdtype).removeprefix("torch."))
        try:
            got = run_pass(fns[name], inp, "fwd+bwd")
            # (the weight's gradient, a sum over all the rows: its atol relative to its largest value, since the
            # sums that cancel to near 0 carry the rounding of the large terms; a fixed atol failed every
            # implementation, torch.compile's too, on the GPU, session 79)
            bad = [n for n, a, w, s in zip(("y", "grad_x", "grad_gate", "grad_weight"), got, want, (2, 2, 2, 4))
                   if a.shape != w.shape or a.dtype != w.dtype
                   or not torch.allclose(a.float(), w.float(), rtol=s * tol["rtol"],
                                         atol=s * (tol["atol"] if n != "grad_weight" else
                                                   tol["rtol"] * float(w.float().abs().max())))]
            del got
            if bad:
                rows += [dict(base, passes=p, status="FAILED", why=f"differs from the model's module: {bad}")
                         for p in PASSES]
                continue
            for p in PASSES:
                t = timer.time(lambda _, p=p: run_pass(fns[name], inp, p))
                gbps = min_bytes(shape, dtype, wdtype, p, odtype) / (t["median_ms"] * 1e-3) / 1e9
                rows.append(dict(base, passes=p, status="ok", **t, gbps=gbps,
                                 pct_copy=100 * gbps / copy_gbps if copy_gbps else None))
        except Exception as e:  # noqa: BLE001 (one implementation's failure is a row, not the end of the run)
            rows += [dict(base, passes=p, status="error", why=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
                     for p in PASSES]
    return rows


def markdown(env: dict, rows: list[dict], copy_gbps: float, gate_first: bool = False) -> str:
    dtypes = ", ".join(dict.fromkeys(r["dtype"] for r in rows)) or "no rows"
    what = ("Mamba2's MambaRMSNormGated, the gate first" if gate_first else
            "Qwen3-Next's / Qwen3.5's RMSNormGated, the norm first")
    lines = [f"# Gated RMSNorm ({what}), {dtypes} ({env.get('gpu')}, {env.get('date')})",
             "", versions_line(env, copy_gbps), "",
             "| R x D / group | dtype | weight | pass | impl | ms | GB/s | % of copy | status |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['rows']}x{r['width']} / {r.get('group') or r['width']} | {r['dtype']} | {r['weight_dtype']} | "
        head += f"{r['passes']} "
        lines.append(head + timing_cells(r))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.rms_norm_gated", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=parse_shape, nargs="+", default=None,
                    help=f"RxD (default {' '.join(SHAPES)}; on the CPU {' '.join(DRY_SHAPES)})")
    ap.add_argument("--dtypes", default="bf16", help="comma separated, of bf16, fp16, fp32 (default: bf16)")
    ap.add_argument("--weight-fp32", action="store_true", help="an fp32 weight (mixed precision)")
    ap.add_argument("--gate-first", action="store_true", help="Mamba2's order: the gate, then the norm")
    ap.add_argument("--group", type=int, default=None, help="values normalised together (default: the row)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--impls", default="", help=f"comma separated, of {', '.join(IMPLS)} (default: all)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run of the plumbing")
    ap.add_argument("--out", type=Path, default=None, help="folder for rms_norm_gated[_gate_first].json / .md")
    args = ap.parse_args(argv)
    dtypes, impls = parse_dtypes_reps_impls(ap, args, DTYPES, IMPLS)
    if impls is None and args.gate_first:   # (ops takes the norm first only: every row of it would be an error)
        impls = tuple(i for i in IMPLS if i != "ops")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks.rms_norm_gated: needs a CUDA GPU (--device cpu: a dry run)")
    default = GATE_FIRST_SHAPES if args.gate_first else SHAPES
    shapes = args.shapes or [parse_shape(s) for s in (default if args.device == "cuda" else DRY_SHAPES)]
    if args.group is not None and any(args.group < 1 or d % args.group for _, d in shapes):
        ap.error(f"--group: expected a divisor of every shape's D, got {args.group}")
    env = environment(args.device)
    timer = Timer(args.device, warmup=3, reps=args.reps, max_s=10.0)
    copy_gbps = timer.copy_gbps() if args.device == "cuda" else 0.0
    fns = functions(args.gate_first, args.group)
    rows = []
    for dtype in dtypes:
        for shape in shapes:
            new = run_shape(shape, fns, timer, dtype, args.device, copy_gbps, impls, args.weight_fp32)
            rows += [dict(r, group=args.group or shape[1], gate_first=args.gate_first) for r in new]
            if args.device == "cuda":
                torch.cuda.empty_cache()
    md = markdown(env, rows, copy_gbps, args.gate_first)
    print(md)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = "rms_norm_gated_gate_first" if args.gate_first else "rms_norm_gated"
        (args.out / f"{stem}.json").write_text(json.dumps(dict(environment=env, date=today(), copy_gbps=copy_gbps,
                                                               rows=rows), indent=1))
        (args.out / f"{stem}.md").write_text(md)


if __name__ == "__main__":
    main()
