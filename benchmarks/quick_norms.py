"""Quick LayerNorm / RMSNorm bandwidth check: pipegoose's kernels vs F.layer_norm / F.rms_norm (bf16, 16384 rows).

    python -m benchmarks.quick_norms [--rows 16384] [--hidden 1024 4096 8192 16384] [--reps 50]

Prints achieved bandwidth in TB/s = minimum bytes moved / median time (CUDA events, median of ``reps`` after a
warm-up, the L2 cache flushed before each repetition, random inputs). Minimum bytes: the suite's counts
(``benchmarks/byte_counts.py``): forward reads x and the parameters and writes y and the fp32 statistics; fwd+bwd
adds reading dy, x, the weight and the statistics and writing dx and the parameter gradients. Both sides of fwd+bwd
compute dx and the parameter gradients and nothing more: torch's by ``torch.autograd.grad``, as the suite does (a
``.backward()`` also added each gradient into the leaves' ``.grad``, an extra kernel per call). The full suite lives
in ``benchmarks/run.py``; this script is the short one.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.byte_counts import op_bytes
from benchmarks.timing import Timer


def pass_bytes(op: str, rows: int, hidden: int, dtype: str) -> dict[str, int]:
    """Minimum bytes of ``op`` (``layer_norm`` or ``rms_norm``) for the passes timed here, ``fwd`` and ``fwd+bwd``,
    on ``rows`` x ``hidden`` inputs of ``dtype`` (a name, e.g. ``"bfloat16"``): benchmarks.byte_counts's counts."""
    return {p: op_bytes(op, p, {"rows": rows, "hidden": hidden}, dtype) for p in ("fwd", "fwd+bwd")}


def torch_fns(op: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dy: torch.Tensor, eps: float):
    """PyTorch's forward and forward + backward of ``op`` (``layer_norm`` or ``rms_norm``; ``b`` unused by the latter)
    on copies of ``x`` and the parameters that require grad. The backward is ``torch.autograd.grad``: it returns dx
    and the parameter gradients, as our backward op does, and accumulates nothing into ``.grad`` (``.backward()``
    added an in-place ``grad += ...`` per leaf to every call after the first)."""
    h = x.shape[-1]
    if op == "layer_norm":
        fwd = lambda t, wt, bt: F.layer_norm(t, (h,), wt, bt, eps)  # noqa: E731
    elif op == "rms_norm":
        fwd = lambda t, wt, bt: F.rms_norm(t, (h,), wt, eps)  # noqa: E731
    else:
        raise ValueError(f"op: expected 'layer_norm' or 'rms_norm', got {op!r}")
    xg, wg = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    bg = b.detach().clone().requires_grad_() if op == "layer_norm" else None
    leaves = (xg, wg, bg) if op == "layer_norm" else (xg, wg)

    def ref_f():
        return fwd(x, w, b)

    def ref_fb():
        return torch.autograd.grad(fwd(xg, wg, bg), leaves, dy)

    return ref_f, ref_fb


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
        for op in ("layer_norm", "rms_norm"):
            nbytes = pass_bytes(op, n, h, "bfloat16")
            ref_f, ref_fb = torch_fns(op, x, w, b, dy, eps)
            if op == "layer_norm":
                ours_f = lambda: ln.layer_norm_forward(x, w, b, eps, None)  # noqa: E731

                def ours_fb():
                    y, mean, rstd = ln.layer_norm_forward(x, w, b, eps, None)
                    ln.layer_norm_backward(dy, x, w, b, mean, rstd)
            else:
                ours_f = lambda: rms.rms_norm_forward(x, w, eps, None)  # noqa: E731

                def ours_fb():
                    y, rstd = rms.rms_norm_forward(x, w, eps, None)
                    rms.rms_norm_backward(dy, x, w, rstd)
            for name, ours, ref in (("fwd", ours_f, ref_f), ("fwd+bwd", ours_fb, ref_fb)):
                with torch.no_grad() if name == "fwd" else torch.enable_grad():
                    t_ours, t_ref = bench(ours, args.reps), bench(ref, args.reps)
                tb_ours, tb_ref = nbytes[name] / t_ours / 1e9, nbytes[name] / t_ref / 1e9
                print(f"{op:<11}{h:>7}{name:>9}{tb_ours:>11.2f}{tb_ref:>9.2f}{tb_ours / tb_ref:>8.2f}")


if __name__ == "__main__":
    main()
