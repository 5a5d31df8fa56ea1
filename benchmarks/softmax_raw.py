"""Raw bandwidth of our softmax ops per shape, for A/B comparisons of kernel versions (issue #8).

    python -m benchmarks.softmax_raw [--label NAME] [--defines=-DX,-DY] [--sizes 128,256] [--fwd-only] > OUT.jsonl

Times ``softmax_forward`` / ``softmax_backward`` of ``pipegoose/softmax`` (``benchmarks.timing.Timer``: CUDA events,
L2 flushed, median of 30) on the sweep's inputs (``benchmarks.ops.make_case``: ``[b, np, sq = sk, sk]``, the
padding mask of ``softmax.masked``, the causal flag of ``softmax.causal`` on the ``[b * np, sq, sk]`` view) and
prints one JSON line per (op, dtype, sk, pass) with milliseconds and GB/s over the sweep's minimum bytes
(``benchmarks/README.md``: plain forward 2Ns, backward 3Ns; padded forward 2Ns + mask bytes; causal forward Ts + Ns,
backward 2Ts + Ns, T the elements of the lower triangles), after one line with the device copy bandwidth.
``--defines`` builds a variant with extra nvcc defines (``benchmarks.build_cost.builder_with_defines``, own build
key); two builds of one op cannot share a process, so compare versions with one process each, joining the lines on
(op, dtype, sk, pass). Correctness is the GPU tests' job (``tests/kernels/test_softmax_cuda.py``); this script only
checks that the forward wrote a row sum of 1 (0 for none here) on the first rows.
"""

from __future__ import annotations

import argparse
import json

OPS = ("softmax", "softmax.masked", "softmax.causal")
SIZES = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
MAX_KEYS = 32768  # the sweep's shapes hold sk * sk elements at least (sq = sk): 1G elements here


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.softmax_raw", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", default="current", help="a name for this build in the output lines")
    ap.add_argument("--defines", default="", help="comma-separated -D flags for a variant build")
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {', '.join(OPS)}")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="key lengths sk, comma-separated")
    ap.add_argument("--dtypes", default="bf16,fp16,fp32", help="comma-separated, of bf16, fp16, fp32")
    ap.add_argument("--fwd-only", action="store_true")
    args = ap.parse_args()

    def items(opt: str, value: str) -> list[str]:
        got = [v.strip() for v in value.split(",") if v.strip()]
        dup = sorted({v for v in got if got.count(v) > 1})
        if dup:
            raise SystemExit(f"softmax_raw: {opt}: {value!r}: {', '.join(dup)} given twice")
        return got

    ops = items("--ops", args.ops)
    bad = [o for o in ops if o not in OPS]
    if not ops or bad:
        raise SystemExit(f"softmax_raw: --ops: {args.ops!r}: {'unknown ' + ', '.join(bad) if bad else 'empty'}; "
                         f"expected a comma-separated list of {', '.join(OPS)}")
    try:
        sizes = [int(v) for v in items("--sizes", args.sizes)]
    except ValueError:
        raise SystemExit(f"softmax_raw: --sizes: {args.sizes!r}: expected key lengths from 1 to {MAX_KEYS}") from None
    if not sizes or min(sizes) < 1 or max(sizes) > MAX_KEYS:
        raise SystemExit(f"softmax_raw: --sizes: {args.sizes!r}: expected key lengths from 1 to {MAX_KEYS}")
    names = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    short = {**{k: k for k in names}, **{v: k for k, v in names.items()}}  # bfloat16 -> bf16, ...
    given = items("--dtypes", args.dtypes)
    bad = [d for d in given if d not in short]
    if not given or bad:
        raise SystemExit(f"softmax_raw: --dtypes: {args.dtypes!r}: {'unknown ' + ', '.join(bad) if bad else 'empty'}; "
                         "expected a comma-separated list of bf16, fp16, fp32 (or bfloat16, float16, float32)")
    dtypes = [short[d] for d in given]
    if len(set(dtypes)) != len(dtypes):
        raise SystemExit(f"softmax_raw: --dtypes: {args.dtypes!r}: a dtype is given twice")
    defs = items("--defines", args.defines)
    from .build_cost import check_defines

    try:
        check_defines(["pipegoose/softmax"], defs)
    except ValueError as e:
        raise SystemExit(f"softmax_raw: --defines: {e}") from None
    import torch

    from .ops import SCALE, make_case
    from .timing import Timer

    if not torch.cuda.is_available():
        raise SystemExit("softmax_raw: needs a CUDA GPU")
    if defs:
        from .build_cost import builder_with_defines

        sm = builder_with_defines("pipegoose/softmax", defs, None).load()
    else:
        from pipegoose.kernels import load

        sm = load("pipegoose/softmax")
    timer = Timer("cuda", warmup=5, reps=30, max_s=float("inf"))
    print(json.dumps({"label": args.label, "copy_gbps": round(timer.copy_gbps(), 1)}), flush=True)
    for d in dtypes:
        dt = getattr(torch, names[d])
        for op in ops:
            for sk in sizes:
                case = make_case(op, dt, sk, "cuda", seed=sk)
                x = case.inputs["x"].detach()
                b, h, sq, _ = x.shape
                s, n = x.element_size(), x.numel()
                mask, causal, scale = None, op == "softmax.causal", 1.0 if op == "softmax" else SCALE
                if op == "softmax.masked":
                    mask = case.inputs["mask"]
                if causal:
                    x = x.view(b * h, sq, sk)
                    tri = b * h * sq * (sq + 1) // 2
                    fwd_b, bwd_b = tri * s + n * s, 2 * tri * s + n * s
                else:
                    fwd_b, bwd_b = 2 * n * s + (mask.numel() if mask is not None else 0), 3 * n * s
                dy = case.dy.view(x.shape)
                y = sm.softmax_forward(x, mask, scale, causal)
                sums = y[..., :8, :].float().sum(-1)
                if not torch.allclose(sums, torch.ones_like(sums), atol=1e-2):
                    raise SystemExit(f"softmax_raw: {op} {d} sk={sk}: forward row sums off 1 "
                                     f"(max |sum - 1| {float((sums - 1).abs().max()):.3g})")
                runs = [("fwd", fwd_b, lambda: sm.softmax_forward(x, mask, scale, causal))]
                if not args.fwd_only:
                    runs.append(("bwd", bwd_b, lambda: sm.softmax_backward(dy, y, scale, causal)))
                for name, nbytes, fn in runs:
                    t = timer.time(lambda _: fn())["median_ms"]
                    print(json.dumps({"label": args.label, "op": op, "dtype": d, "sk": sk, "shape": list(x.shape),
                                      "pass": name, "ms": round(t, 5), "gbps": round(nbytes / t / 1e6, 1)}),
                          flush=True)
                del x, y, dy, mask, case
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
