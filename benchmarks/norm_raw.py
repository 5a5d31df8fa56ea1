"""Raw bandwidth of our LayerNorm / RMSNorm ops per shape, for A/B comparisons of kernel versions (issue #8).

    python -m benchmarks.norm_raw [--label NAME] [--defines=-DX,-DY] > OUT.jsonl

Times ``layer_norm_forward`` / ``layer_norm_backward`` and ``rms_norm_forward`` / ``rms_norm_backward`` of
``pipegoose/layer_norm`` and ``pipegoose/rms_norm`` (``benchmarks.timing.Timer``: CUDA events, L2 flushed, spin,
median of 30) at the training shapes of ``SHAPES`` (512-65536 columns) in bf16, fp32 and bf16 input with fp32
parameters (that pair at 4096 and 16384 columns, or at every ``--shapes`` shape), and prints one JSON line per (op,
dtype, parameter dtype, rows, H, pass): milliseconds and GB/s (bytes: forward x + y, backward x + dy + dx), after one
line with the device copy bandwidth. ``--defines`` builds a variant with extra nvcc
defines (``benchmarks.build_cost.builder_with_defines``, own build key). To compare two versions of the kernels,
run it in each checkout (one process each: two builds of one op cannot share a process) on the same GPU and join
the lines on their keys; ``benchmarks/results/nvidia_h200_2026-11-29/norm_ab_session4.log`` was made that way.
Correctness is the GPU tests' job (``tests/kernels/test_norms_cuda.py``), not this script's.

``--fwd-plans="CFG;CFG;..."`` (with ``=``: a list that starts with ``-`` is otherwise taken for an option) compares
forward launch plans within one build: it builds with
``-DPIPEGOOSE_NORM_FWD_EXPERIMENT`` and times each forward once per CFG, set through ``PIPEGOOSE_NORM_FWD_EXP``
(``grid,nv,pf,preg[,minb]``: grid 0 persistent / 1 full, 1, 2, 4 or 8 chunks per thread, prefetch (2 or 4
chunks), parameters in registers where they fit, and launch bounds asking for ``minb`` blocks of 1024 threads per SM
(2: at most 32 registers; nv 2 or 4 without prefetch); ``-`` is the shipped plan; see ``fwd_exp`` in
``norm_kernels.cuh``; bf16 and fp32 input only, fp16 runs the shipped plan; session 5's log used the earlier ``grid,nv,pf,pcache`` form). Each
line then carries ``plan`` and ``maxdiff``, the largest absolute difference of its outputs (y, mean, rstd) from the
first plan's: a plan that computes something else shows there. A plan the row cannot take (a block over its
kernel's launch bounds, rows on the generic or scalar path) runs the shipped plan under its label. ``benchmarks/results/nvidia_h200_2026-11-30/norm_fwd_plans_session5.log`` was
made that way.

``--fwd-only`` / ``--bwd-only`` time one pass; ``--shapes 16384x5120,...`` replaces the sweep's shapes; ``--max-h H``
keeps the shapes up to H columns; ``--ops layer_norm`` (or ``rms_norm``) builds and times one op only (a variant
build of the other is not made).

``--bwd-wide`` builds with ``-DPIPEGOOSE_NORM_BWD_EXPERIMENT`` and times each backward twice: on its shipped plan and
(``"plan": "wide"``, with ``maxrel``, the largest difference from the shipped plan's gradients relative to their
largest magnitude) on the two-kernel path of the widest rows. ``--bwd-cluster`` does the same with the cluster kernel
(``"plan": "cluster"``) wherever a cluster of at most eight blocks holds the row, on sm_90 and newer (other rows and
GPUs run the shipped plan under that label).

The forward of fp32 rows of 32772-65536 columns, three ways: a build with ``--defines=-DPIPEGOOSE_NORM_FWD_EXPERIMENT``
reads ``PIPEGOOSE_NORM_FWD_WIDE`` = ``split8`` (eight chunks per thread in registers, eight in shared memory, a block
per row: the shipped plan but for LayerNorm rows over 57344 columns), ``pipe8`` (the same on a block per SM that loads
its next row while it writes one: the shipped plan of those rows), ``split4`` (four and twelve) or ``wide`` (the
two-read kernel); one process per value, e.g.
``PIPEGOOSE_NORM_FWD_WIDE=wide python -m benchmarks.norm_raw --label wide
--defines=-DPIPEGOOSE_NORM_FWD_EXPERIMENT --fwd-only --dtypes fp32 --shapes 16384x65536`` (session 22's
``session22.log`` was made that way).
"""

from __future__ import annotations

import argparse
import json
import math
import re

# Input / parameter dtype pairs that differ are timed at these hidden sizes only (at every shape of --shapes).
MIXED_H = (4096, 16384)
SHAPES = [(131072, 512), (65536, 1024), (32768, 2048), (16384, 4096), (16384, 8192), (16384, 16384),
          (16384, 32768), (8192, 65536)]


def table(path: str) -> str:
    """The --fwd-plans lines of ``path`` as a table: % of the copy bandwidth per plan (``!`` marks a maxdiff above
    0.1, far beyond the rounding of any dtype at the benchmark's values, or NaN). One run per file (the last copy
    bandwidth line is used)."""
    rows: dict[tuple, dict[str, tuple[float, float]]] = {}
    plans: list[str] = []
    copy = None
    try:
        with open(path, encoding="utf-8-sig") as f:
            for n, line in enumerate(f, 1):
                if not line.strip() or line.lstrip().startswith("#"):
                    continue
                try:
                    d = json.loads(line)
                except ValueError:
                    raise SystemExit(f"norm_raw: {path}:{n}: not a JSON line of norm_raw") from None
                if not isinstance(d, dict):
                    continue
                if "copy_gbps" in d:
                    v = d["copy_gbps"]
                    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                        raise SystemExit(f"norm_raw: {path}:{n}: copy_gbps: expected a finite number, got {v!r}")
                    copy = float(v)
                    continue
                if "plan" not in d or "maxdiff" not in d:
                    continue  # not a --fwd-plans line
                plans += [d["plan"]] if d["plan"] not in plans else []
                key = (d["op"], d["dtype"], d["pdtype"], d["rows"], d["H"])
                rows.setdefault(key, {})[d["plan"]] = (float(d["gbps"]), float(d["maxdiff"]))
    except (OSError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
        raise SystemExit(f"norm_raw: {path}: {type(e).__name__}: {e}") from None
    if not copy or copy <= 0:
        raise SystemExit(f"norm_raw: {path}: no copy_gbps line with a positive bandwidth")
    if not rows:
        raise SystemExit(f"norm_raw: {path}: no --fwd-plans lines")
    out = [f"forward, % of the device copy ({copy:.0f} GB/s) per plan (grid,nv,pf,preg[,minb]; - = shipped)",
           "op dtype param_dtype rows H | " + " | ".join(plans)]
    for key, v in rows.items():
        cells = [f"{v[p][0] / copy * 100:5.1f}{'' if v[p][1] <= 0.1 else '!'}" if p in v else "-" for p in plans]
        out.append(" ".join(map(str, key)) + " | " + " | ".join(cells))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.norm_raw", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", default="current", help="a name for this build in the output lines")
    ap.add_argument("--defines", default="", help="comma-separated -D flags for a variant build")
    ap.add_argument("--fwd-only", action="store_true")
    ap.add_argument("--bwd-only", action="store_true")
    ap.add_argument("--max-h", type=int, default=0, help="only the shapes with H up to this (0: all)")
    ap.add_argument("--shapes", default=None, help="ROWSxH,... instead of the sweep's shapes")
    ap.add_argument("--fwd-plans", default="", help='forward plans to compare, e.g. --fwd-plans="-;1,4,0,0;1,8,0,0"')
    ap.add_argument("--bwd-wide", action="store_true",
                    help="build with -DPIPEGOOSE_NORM_BWD_EXPERIMENT and time each backward also on the two-kernel "
                         "wide-row path (plan 'wide')")
    ap.add_argument("--bwd-cluster", action="store_true",
                    help="build with -DPIPEGOOSE_NORM_BWD_EXPERIMENT and time each backward also on the cluster "
                         "kernel (plan 'cluster'), where its clusters hold the row (sm_90 and newer)")
    ap.add_argument("--dtypes", default="bf16,fp32,bf16/fp32",
                    help="input dtypes, or INPUT/PARAMETER pairs (bf16, fp16, fp32), comma separated; a pair of "
                         "different dtypes is timed at H 4096 and 16384 of the default shapes, or at every --shapes "
                         "shape")
    ap.add_argument("--ops", default="layer_norm,rms_norm",
                    help="the ops to build and time, comma separated: layer_norm, rms_norm or both")
    ap.add_argument("--table", metavar="JSONL", help="print the --fwd-plans lines of JSONL as a table, then exit")
    args = ap.parse_args()
    for name in ("fwd_plans", "shapes", "dtypes", "defines", "label", "ops"):
        if not isinstance(getattr(args, name), str) and not (name == "shapes" and args.shapes is None):
            # (argparse hands "--opt=--" over as a list)
            ap.error(f"--{name.replace('_', '-')}: expected a value, got {getattr(args, name)!r}")
    if args.table is not None:
        others = [f for f in ("fwd_only", "bwd_only", "max_h", "shapes", "fwd_plans", "bwd_wide", "bwd_cluster",
                              "defines")
                  if getattr(args, f) != ap.get_default(f)]
        others += [f for f in ("dtypes", "label", "ops") if getattr(args, f) != ap.get_default(f)]
        if not args.table:
            raise SystemExit("norm_raw: --table: expected a JSONL file of norm_raw --fwd-plans lines, got ''")
        if others:
            raise SystemExit(f"norm_raw: --table only prints a table; it takes no other option (got --"
                             f"{', --'.join(o.replace('_', '-') for o in others)})")
        print(table(args.table))
        return
    plans_given = bool(args.fwd_plans.strip(";"))
    for a, b, why in (("fwd_only", "bwd_only", "exclude each other"),
                      ("fwd_plans", "bwd_only", "exclude each other (--fwd-plans times forwards only)"),
                      ("fwd_plans", "bwd_wide", "exclude each other (--fwd-plans times forwards only)"),
                      ("bwd_wide", "fwd_only", "exclude each other (--bwd-wide times backwards)"),
                      ("fwd_plans", "bwd_cluster", "exclude each other (--fwd-plans times forwards only)"),
                      ("bwd_cluster", "fwd_only", "exclude each other (--bwd-cluster times backwards)")):
        if (plans_given if a == "fwd_plans" else getattr(args, a)) and getattr(args, b):
            raise SystemExit(f"norm_raw: --{a.replace('_', '-')} and --{b.replace('_', '-')} {why}")
    for plan in (p for p in args.fwd_plans.split(";") if p and p != "-"):
        # The kernels' fwd_exp reads exactly this form (sscanf "%d,%d,%d,%d", then an optional ",%d", and nothing
        # after it) and runs the shipped plan for anything else, which would be timed under the mistyped label: refuse
        # it here.
        if re.fullmatch(r"(\s*[+-]?[0-9]+,){3,4}\s*[+-]?[0-9]+", plan, flags=re.ASCII):
            grid, nv, pf, preg, *rest = (int(v) for v in plan.split(","))
            minb = rest[0] if rest else 1
        else:
            grid = nv = pf = preg = minb = -1
        if grid not in (0, 1) or nv not in (0, 1, 2, 4, 8) or pf not in (0, 1) or preg not in (0, 1) or \
                (pf and nv not in (2, 4)) or minb not in (1, 2) or (minb == 2 and (pf or nv not in (2, 4))):
            raise SystemExit(f"norm_raw: --fwd-plans: {plan!r}: expected - or grid,nv,pf,preg[,minb] with grid 0 or "
                             "1, nv 0, 1, 2, 4 or 8, pf 0 or 1 (1 only with nv 2 or 4), preg 0 or 1, minb 1 or 2 (2 "
                             "only with nv 2 or 4 and pf 0: launch bounds of two 1024-thread blocks per SM)")
    if args.max_h < 0:
        raise SystemExit(f"norm_raw: --max-h: expected 0 (all) or a positive hidden size, got {args.max_h}")
    shapes = SHAPES
    if args.shapes is not None and not args.shapes.strip(", "):
        raise SystemExit(f"norm_raw: --shapes: {args.shapes!r}: expected ROWSxH,... with positive integers")
    if args.shapes:
        try:
            shapes = [tuple(int(v) for v in item.lower().split("x")) for item in args.shapes.split(",")]
        except ValueError:
            shapes = [()]
        if any(len(sh) != 2 or min(sh) < 1 for sh in shapes):
            raise SystemExit(f"norm_raw: --shapes: {args.shapes!r}: expected ROWSxH,... with positive integers")
        if len(set(shapes)) != len(shapes):
            raise SystemExit(f"norm_raw: --shapes: {args.shapes!r}: a shape is given twice")
    kept = [(n, h) for n, h in shapes if not args.max_h or h <= args.max_h]
    if not kept:
        raise SystemExit(f"norm_raw: --max-h {args.max_h}: no shape left (the smallest H is {min(h for _, h in shapes)})")
    shapes = kept
    dtype_specs = args.dtypes.split(",")
    for d in dtype_specs:
        parts = d.split("/")
        if len(parts) > 2 or any(p not in ("bf16", "fp16", "fp32") for p in parts):
            raise SystemExit(f"norm_raw: --dtypes: {d!r}: expected INPUT or INPUT/PARAMETER of bf16, fp16, fp32")
        if len(parts) == 2 and parts[0] != parts[1] and not args.shapes and not any(h in MIXED_H for _, h in shapes):
            raise SystemExit(f"norm_raw: --dtypes: {d!r}: a pair of different dtypes is timed at H in {MIXED_H} "
                             "only (unless --shapes names the shapes), and the shapes left (--max-h) have none")
    if len({tuple((d.split("/") * 2)[:2]) for d in dtype_specs}) != len(dtype_specs):
        raise SystemExit(f"norm_raw: --dtypes: {args.dtypes!r}: a dtype (pair) is given twice")
    ops = args.ops.split(",")
    if not ops or any(o not in ("layer_norm", "rms_norm") for o in ops) or len(set(ops)) != len(ops):
        raise SystemExit(f"norm_raw: --ops: {args.ops!r}: expected layer_norm, rms_norm or layer_norm,rms_norm")
    from .build_cost import check_defines

    try:
        check_defines([f"pipegoose/{o}" for o in ops],
                      [d.strip() for d in args.defines.split(",") if d.strip()])
    except ValueError as e:
        raise SystemExit(f"norm_raw: --defines: {e}") from None
    import os
    import torch

    from .timing import Timer

    if not torch.cuda.is_available():
        raise SystemExit("norm_raw: needs a CUDA GPU")
    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    pairs = [tuple(names[n] for n in (d.split("/") * 2)[:2]) for d in dtype_specs]
    plans = [p for p in args.fwd_plans.split(";") if p]
    defs = [d.strip() for d in args.defines.split(",") if d.strip()]
    defs += ["-DPIPEGOOSE_NORM_FWD_EXPERIMENT"] if plans else []
    defs += ["-DPIPEGOOSE_NORM_BWD_EXPERIMENT"] if args.bwd_wide or args.bwd_cluster else []
    if defs:
        from .build_cost import builder_with_defines

        ln, rms = (builder_with_defines(f"pipegoose/{o}", defs, None).load() if o in ops else None
                   for o in ("layer_norm", "rms_norm"))
    else:
        from pipegoose.kernels import load

        ln, rms = (load(f"pipegoose/{o}") if o in ops else None for o in ("layer_norm", "rms_norm"))
    timer = Timer("cuda", warmup=5, reps=30, max_s=float("inf"))
    print(json.dumps({"label": args.label, "copy_gbps": round(timer.copy_gbps(), 1)}), flush=True)
    def set_plan(plan: str) -> None:
        if plan == "-":
            os.environ.pop("PIPEGOOSE_NORM_FWD_EXP", None)
        else:
            os.environ["PIPEGOOSE_NORM_FWD_EXP"] = plan

    for dt, pdt in pairs:
        for n, h in shapes:
            if pdt != dt and h not in MIXED_H and not args.shapes:
                continue
            x = torch.randn(n, h, device="cuda", dtype=dt)
            dy = torch.randn_like(x)
            w = torch.randn(h, device="cuda", dtype=pdt)
            b = torch.randn(h, device="cuda", dtype=pdt)
            act = n * h * x.element_size()
            for op in ops:
                if op == "layer_norm":
                    fwd = lambda: ln.layer_norm_forward(x, w, b, 1e-5, None)  # noqa: E731
                    _, mean, rstd = fwd()
                    bwd = lambda: ln.layer_norm_backward(dy, x, w, b, mean, rstd)  # noqa: E731
                else:
                    fwd = lambda: rms.rms_norm_forward(x, w, 1e-5, None)  # noqa: E731
                    _, rstd = fwd()
                    bwd = lambda: rms.rms_norm_backward(dy, x, w, rstd)  # noqa: E731
                if plans:
                    ref = None
                    for plan in plans:
                        set_plan(plan)
                        out = [t.float() for t in fwd() if t is not None and t.numel()]
                        ref = out if ref is None else ref
                        diff = max((a - r).abs().max().item() for a, r in zip(out, ref))
                        t = timer.time(lambda _: fwd())["median_ms"]
                        print(json.dumps({"label": args.label, "plan": plan, "op": op, "dtype": str(dt)[6:],
                                          "pdtype": str(pdt)[6:], "rows": n, "H": h, "pass": "fwd",
                                          "ms": round(t, 5), "gbps": round(2 * act / t / 1e6, 1),
                                          "maxdiff": diff}), flush=True)
                    set_plan("-")
                    continue
                passes = [("fwd", fwd, 2 * act, "-"), ("bwd", bwd, 3 * act, "-")]
                passes = passes[:1] if args.fwd_only else passes[1:] if args.bwd_only else passes
                if not args.fwd_only:
                    passes += [("bwd", bwd, 3 * act, p) for p, on in (("wide", args.bwd_wide),
                                                                       ("cluster", args.bwd_cluster)) if on]
                for name, fn, nbytes, plan in passes:
                    os.environ.pop("PIPEGOOSE_NORM_BWD_EXP", None)
                    if plan != "-":
                        os.environ["PIPEGOOSE_NORM_BWD_EXP"] = plan
                        ref = [t.float() for t in bwd() if t.numel()]
                    t = timer.time(lambda _: fn())["median_ms"]
                    line = {"label": args.label, "op": op, "dtype": str(dt)[6:], "pdtype": str(pdt)[6:], "rows": n,
                            "H": h, "pass": name, "ms": round(t, 5), "gbps": round(nbytes / t / 1e6, 1)}
                    if plan != "-":
                        os.environ.pop("PIPEGOOSE_NORM_BWD_EXP", None)
                        base = [t.float() for t in bwd() if t.numel()]
                        rel = [((a - r).abs().max() / r.abs().max().clamp_min(1e-30)).item() for a, r in zip(ref, base)]
                        line.update(plan=plan, maxrel=max(rel))
                    print(json.dumps(line), flush=True)
            del x, dy


if __name__ == "__main__":
    main()
