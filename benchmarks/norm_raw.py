"""Raw bandwidth of our LayerNorm / RMSNorm ops per shape, for A/B comparisons of kernel versions (issue #8).

    python -m benchmarks.norm_raw [--label NAME] [--defines -DX,-DY] > OUT.jsonl

Times ``layer_norm_forward`` / ``layer_norm_backward`` and ``rms_norm_forward`` / ``rms_norm_backward`` of
``pipegoose/layer_norm`` and ``pipegoose/rms_norm`` (``benchmarks.timing.Timer``: CUDA events, L2 flushed, spin,
median of 30) at the sweep's training shapes in bf16, fp32 and bf16 input with fp32 parameters, and prints one JSON
line per (op, dtype, parameter dtype, rows, H, pass): milliseconds and GB/s (bytes: forward x + y, backward
x + dy + dx), after one line with the device copy bandwidth. ``--defines`` builds a variant with extra nvcc
defines (``benchmarks.build_cost.builder_with_defines``, own build key). To compare two versions of the kernels,
run it in each checkout (one process each: two builds of one op cannot share a process) on the same GPU and join
the lines on their keys; ``benchmarks/results/nvidia_h200_2026-11-29/norm_ab_session4.log`` was made that way.
Correctness is the GPU tests' job (``tests/kernels/test_norms_cuda.py``), not this script's.
"""

from __future__ import annotations

import argparse
import json

SHAPES = [(131072, 512), (65536, 1024), (32768, 2048), (16384, 4096), (16384, 8192), (16384, 16384),
          (16384, 32768), (8192, 65536)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", default="current", help="a name for this build in the output lines")
    ap.add_argument("--defines", default="", help="comma-separated -D flags for a variant build")
    ap.add_argument("--fwd-only", action="store_true")
    args = ap.parse_args()
    import torch

    from .timing import Timer

    if not torch.cuda.is_available():
        raise SystemExit("norm_raw: needs a CUDA GPU")
    defs = [d for d in args.defines.split(",") if d]
    if defs:
        from .build_cost import builder_with_defines

        ln, rms = (builder_with_defines(k, defs, None).load() for k in ("pipegoose/layer_norm", "pipegoose/rms_norm"))
    else:
        from pipegoose.kernels import load

        ln, rms = load("pipegoose/layer_norm"), load("pipegoose/rms_norm")
    timer = Timer("cuda", warmup=5, reps=30, max_s=float("inf"))
    src = torch.empty(2**28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timer.time(lambda _: dst.copy_(src))["median_ms"]
    print(json.dumps({"label": args.label, "copy_gbps": round(2 * src.numel() / ms / 1e6, 1)}), flush=True)
    del src, dst
    for dt, pdt in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.bfloat16, torch.float32)):
        for n, h in SHAPES:
            if pdt != dt and h not in (4096, 16384):
                continue
            x = torch.randn(n, h, device="cuda", dtype=dt)
            dy = torch.randn_like(x)
            w = torch.randn(h, device="cuda", dtype=pdt)
            b = torch.randn(h, device="cuda", dtype=pdt)
            act = n * h * x.element_size()
            for op in ("layer_norm", "rms_norm"):
                if op == "layer_norm":
                    fwd = lambda: ln.layer_norm_forward(x, w, b, 1e-5, None)  # noqa: E731
                    _, mean, rstd = fwd()
                    bwd = lambda: ln.layer_norm_backward(dy, x, w, b, mean, rstd)  # noqa: E731
                else:
                    fwd = lambda: rms.rms_norm_forward(x, w, 1e-5, None)  # noqa: E731
                    _, rstd = fwd()
                    bwd = lambda: rms.rms_norm_backward(dy, x, w, rstd)  # noqa: E731
                passes = (("fwd", fwd, 2 * act), ("bwd", bwd, 3 * act))
                for name, fn, nbytes in passes[:1] if args.fwd_only else passes:
                    t = timer.time(lambda _: fn())["median_ms"]
                    print(json.dumps({"label": args.label, "op": op, "dtype": str(dt)[6:], "pdtype": str(pdt)[6:],
                                      "rows": n, "H": h, "pass": name, "ms": round(t, 5),
                                      "gbps": round(nbytes / t / 1e6, 1)}), flush=True)
            del x, dy


if __name__ == "__main__":
    main()
