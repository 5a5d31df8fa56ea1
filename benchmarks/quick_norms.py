"""Quick LayerNorm / RMSNorm bandwidth check: pipegoose's kernels vs F.layer_norm / F.rms_norm (bf16, 16384 rows).

    python -m benchmarks.quick_norms [--rows 16384] [--hidden 1024 4096 8192 16384] [--reps 50]

Prints achieved bandwidth in TB/s = minimum bytes moved / median time (CUDA events, median of ``reps`` after a
warm-up, the L2 cache flushed before each repetition, random inputs). Minimum bytes: forward reads x and the
parameters and writes y and the fp32 statistics; fwd+bwd adds reading dy, x and the statistics and writing dx and
the parameter gradients. The full suite lives in ``benchmarks/run.py``; this script is the short one.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.timing import Timer

def bench(fn, reps: int, warmup: int = 10) -> float:
    """Median milliseconds of ``fn()`` (benchmarks.timing: CUDA events, L2 flushed before each repetition)."""
    return Timer("cuda", warmup=warmup, reps=reps, max_s=float("inf")).time(lambda _: fn())["median_ms"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--hidden", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("quick_norms: needs a CUDA GPU")
    from pipegoose.kernels import load

    ln, rms = load("pipegoose/layer_norm"), load("pipegoose/rms_norm")
    dt, eps, n = torch.bfloat16, 1e-5, args.rows
    print(f"{torch.cuda.get_device_name()}  bf16  rows={n}  TB/s (higher is better)")
    print(f"{'op':<11}{'H':>7}{'pass':>9}{'pipegoose':>11}{'torch':>9}{'ratio':>8}")
    for h in args.hidden:
        x = torch.randn(n, h, device="cuda", dtype=dt)
        dy = torch.randn(n, h, device="cuda", dtype=dt)
        w = torch.randn(h, device="cuda", dtype=dt)
        b = torch.randn(h, device="cuda", dtype=dt)
        xg = x.clone().requires_grad_()
        wg, bg = w.clone().requires_grad_(), b.clone().requires_grad_()
        act = n * h * x.element_size()
        par = h * w.element_size()
        for op in ("layer_norm", "rms_norm"):
            nparam = 2 if op == "layer_norm" else 1
            nstat = 2 if op == "layer_norm" else 1
            fwd_bytes = 2 * act + nparam * par + nstat * 4 * n
            bwd_bytes = 3 * act + nparam * par + nstat * 4 * n + nparam * par
            if op == "layer_norm":
                ours_f = lambda: ln.layer_norm_forward(x, w, b, eps, None)  # noqa: E731

                def ours_fb():
                    y, mean, rstd = ln.layer_norm_forward(x, w, b, eps, None)
                    ln.layer_norm_backward(dy, x, w, b, mean, rstd)

                ref_f = lambda: F.layer_norm(x, (h,), w, b, eps)  # noqa: E731

                def ref_fb():
                    F.layer_norm(xg, (h,), wg, bg, eps).backward(dy)
            else:
                ours_f = lambda: rms.rms_norm_forward(x, w, eps, None)  # noqa: E731

                def ours_fb():
                    y, rstd = rms.rms_norm_forward(x, w, eps, None)
                    rms.rms_norm_backward(dy, x, w, rstd)

                ref_f = lambda: F.rms_norm(x, (h,), w, eps)  # noqa: E731

                def ref_fb():
                    F.rms_norm(xg, (h,), wg, eps).backward(dy)
            for name, nbytes, ours, ref in (("fwd", fwd_bytes, ours_f, ref_f),
                                            ("fwd+bwd", fwd_bytes + bwd_bytes, ours_fb, ref_fb)):
                with torch.no_grad() if name == "fwd" else torch.enable_grad():
                    t_ours, t_ref = bench(ours, args.reps), bench(ref, args.reps)
                tb_ours, tb_ref = nbytes / t_ours / 1e9, nbytes / t_ref / 1e9
                print(f"{op:<11}{h:>7}{name:>9}{tb_ours:>11.2f}{tb_ref:>9.2f}{tb_ours / tb_ref:>8.2f}")
            xg.grad = wg.grad = bg.grad = None


if __name__ == "__main__":
    main()
