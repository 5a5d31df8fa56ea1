"""Quick bandwidth check of pipegoose's fused softmax (``pipegoose/softmax``) against torch's native softmax.

    python -m benchmarks.quick_softmax [--reps 50] [--dtype bf16]

Prints GB/s = minimum bytes / median time (CUDA events, median of ``reps`` after warm-up, randn inputs, every
tensor larger than the L2 cache). Minimum bytes (s = bytes per element, N = elements, T = elements of the causal
lower triangles incl. the diagonal, M = mask bytes), as in benchmarks/README.md:
plain fwd 2Ns, bwd 3Ns; padded fwd 2Ns + M, bwd 3Ns; causal fwd Ts + Ns, bwd 2Ts + Ns. The torch column times
``torch.softmax`` (forward) and ``torch._softmax_backward_data`` (backward) on the same tensors (no mask: it does
less work) and is charged the same bytes; ``2N`` is our forward's bandwidth counted as 2Ns / 3Ns, the "effective"
figure upstream benchmarks quote. The full suite is ``python -m benchmarks.run``; this script is the short one.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.timing import Timer


def bench(fn, reps: int, warmup: int = 5) -> float:
    """Median milliseconds of ``fn()`` (benchmarks.timing: CUDA events, L2 flushed before each repetition)."""
    return Timer("cuda", warmup=warmup, reps=reps, max_s=float("inf")).time(lambda _: fn())["median_ms"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("quick_softmax: needs a CUDA GPU")
    from pipegoose.kernels import load

    ops = load("pipegoose/softmax")
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    s = torch.empty((), dtype=dt).element_size()
    scale = 0.125
    cases = [("causal", (512, 2048, 2048)), ("padded", (16, 32, 2048, 2048)), ("plain", (16384, 4096))]
    cases += [("plain", (2**28 // sk, sk)) for sk in (128, 1024, 8192, 32768)]
    print(f"{torch.cuda.get_device_name()}  {args.dtype}  GB/s = min bytes / median of {args.reps} (higher is better)")
    print(f"{'case':<8}{'shape':>22}{'pass':>5}{'ms':>9}{'pipegoose':>11}{'torch':>9}{'ratio':>7}{'2N':>8}")
    g = torch.Generator(device="cuda").manual_seed(0)
    for kind, shape in cases:
        x = torch.randn(shape, generator=g, device="cuda", dtype=dt)
        dy = torch.randn(shape, generator=g, device="cuda", dtype=dt)
        n, sk = x.numel(), shape[-1]
        mask, causal = None, kind == "causal"
        if kind == "padded":  # per batch row, a random key length in [sk/2, sk]
            lens = torch.randint(sk // 2, sk + 1, (shape[0],), generator=g, device="cuda")
            mask = (torch.arange(sk, device="cuda")[None, :] >= lens[:, None])[:, None, None, :].expand(
                shape[0], 1, shape[2], sk).contiguous()
        if causal:
            sq = shape[-2]
            tri = n // (sq * sk) * sq * (sq + 1) // 2
            fwd_b, bwd_b = tri * s + n * s, 2 * tri * s + n * s
        else:
            fwd_b, bwd_b = 2 * n * s + (mask.numel() if mask is not None else 0), 3 * n * s
        y = ops.softmax_forward(x, mask, scale, causal)
        yt = torch.softmax(x, -1)
        runs = [
            ("fwd", fwd_b, 2 * n * s, lambda: ops.softmax_forward(x, mask, scale, causal),
             lambda: torch.softmax(x, -1)),
            ("bwd", bwd_b, 3 * n * s, lambda: ops.softmax_backward(dy, y, scale, causal),
             lambda: torch._softmax_backward_data(dy, yt, -1, dt)),
        ]
        for name, nbytes, eff, ours, ref in runs:
            t_ours, t_ref = bench(ours, args.reps), bench(ref, args.reps)
            print(f"{kind:<8}{str(list(shape)):>22}{name:>5}{t_ours:>9.3f}{nbytes / t_ours / 1e6:>11.0f}"
                  f"{nbytes / t_ref / 1e6:>9.0f}{t_ref / t_ours:>7.2f}{eff / t_ours / 1e6:>8.0f}")
        del x, dy, y, yt, mask
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
