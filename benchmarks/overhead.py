"""Host overhead per call: the fused ops' Python path against the PyTorch call they replace, at small shapes.

A small model (MiniLM: 6 layers, hidden 384, a few dozen tokens) is bound by the time the host takes to enqueue
work, not by the GPU: a fused op that saves two kernel launches but costs more Python than it saves makes the
model slower. This measures, for each op, the wall time per call of a loop of ``--calls`` calls (forward, and
forward + backward), synchronised once at the end, at the shapes such a model has, for PyTorch (eager, as
transformers writes it, and the single native op) and for ``pipegoose.nn.fusion.functional`` with each
implementation that can take the input (``impl=`` forced, so that the tuning table does not hide one).

Run: ``python -m benchmarks.overhead [--device cuda|cpu] [--calls N]``; prints a table (microseconds per call,
the median of 7 loops) and writes nothing. Not a bandwidth benchmark: see ``benchmarks.run`` for that.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from pipegoose.nn.fusion import dispatch
from pipegoose.nn.fusion import functional as PF
from pipegoose.nn.fusion.modules import AttnMaskType, FusedLayerNorm, FusedScaleMaskSoftmax


def _per_call_us(fn: Callable[[], object], calls: int, sync: Callable[[], None]) -> float:
    for _ in range(20):
        fn()
    sync()
    loops = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        loops.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(loops)


def cases(device: str, dtype: torch.dtype):
    """(op, label, fn(backward: bool)) for each implementation at MiniLM-like shapes (batch 16, 16 tokens)."""
    g = torch.Generator(device=device).manual_seed(0)

    def t(*shape, grad=True):
        return torch.randn(*shape, device=device, generator=g).to(dtype).requires_grad_(grad)

    x = t(16 * 16, 384)
    w, b = t(384), t(384)
    s = t(16, 12, 16, 16)
    mask = torch.rand(16, 1, 1, 16, device=device, generator=g) < 0.2
    add = torch.zeros(16, 1, 1, 16, device=device, dtype=dtype).masked_fill(mask, torch.finfo(dtype).min)

    def run(f, backward):
        def go():
            y = f()
            if backward:
                y.sum().backward()
        return go

    ln = torch.nn.LayerNorm(384, device=device, dtype=dtype)
    fln = FusedLayerNorm.from_layer_norm(ln, impl="pipegoose")
    out = [("layer_norm", "F.layer_norm", lambda bw: run(lambda: F.layer_norm(x, (384,), w, b), bw))]
    out += [("layer_norm", "nn.LayerNorm", lambda bw: run(lambda: ln(x), bw))]
    out += [("layer_norm", "FusedLayerNorm impl=pipegoose", lambda bw: run(lambda: fln(x), bw))]
    out += [("layer_norm", f"pipegoose impl={i}",
             (lambda i: lambda bw: run(lambda: PF.layer_norm(x, (384,), w, b, impl=i), bw))(i))
            for i in dispatch.implementations("layer_norm")]
    out += [("rms_norm", "F.rms_norm", lambda bw: run(lambda: F.rms_norm(x, (384,), w, 1e-6), bw))]
    out += [("rms_norm", f"pipegoose impl={i}",
             (lambda i: lambda bw: run(lambda: PF.rms_norm(x, (384,), w, 1e-6, impl=i), bw))(i))
            for i in dispatch.implementations("rms_norm")]
    out += [("softmax.masked", "eager (scale, add mask, softmax)",
             lambda bw: run(lambda: torch.softmax(s * 0.125 + add, dim=-1, dtype=torch.float32).to(dtype), bw))]
    out += [("softmax.masked", f"pipegoose impl={i}",
             (lambda i: lambda bw: run(lambda: PF.scaled_masked_softmax(s, mask, 0.125, impl=i), bw))(i))
            for i in dispatch.implementations("softmax.masked")]
    if dtype in (torch.float16, torch.bfloat16):  # the module fuses 16-bit scores only (Megatron's flags)
        fsm = FusedScaleMaskSoftmax(dtype == torch.float16, dtype == torch.bfloat16, AttnMaskType.padding, True, None,
                                    True, 0.125)
        out += [("softmax.masked", "FusedScaleMaskSoftmax", lambda bw: run(lambda: fsm(s, mask), bw))]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"))
    ap.add_argument("--calls", type=int, default=500)
    a = ap.parse_args(argv)
    if a.calls < 1:
        ap.error("--calls: expected a positive integer")
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device cuda: torch {torch.__version__} sees no CUDA device; use --device cpu")
    dtype = getattr(torch, a.dtype)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"host overhead per call, {name}, torch {torch.__version__}, {a.dtype}, median of 7 loops of {a.calls}")
    print(f"{'op':16s} {'implementation':36s} {'fwd us':>9s} {'fwd+bwd us':>11s}  ran")
    for op, label, make in cases(a.device, dtype):
        row = []
        for bw in (False, True):
            dispatch.reset_stats()
            try:
                row.append(f"{_per_call_us(make(bw), a.calls, sync):9.1f}")
            except Exception as e:  # noqa: BLE001 - an implementation that cannot take the input is listed
                row.append(f"{type(e).__name__:>9s}")
        ours = "pipegoose" in label or "Fused" in label
        ran = ",".join(sorted(dispatch.stats().get(op, {}))) if ours else "torch"
        print(f"{op:16s} {label:36s} {row[0]} {row[1]:>11s}  {ran}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
