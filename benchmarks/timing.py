"""Timing: CUDA events around each repetition, the L2 cache flushed before each one, median of the repetitions.

Method (the same as ``triton.testing.do_bench`` in spirit): ``warmup`` untimed calls, then for each repetition
(1) the untimed ``setup`` (e.g. the forward whose graph a backward needs), (2) a write of a buffer larger than the
L2 cache (256 MiB, H200 L2 = 50 MiB) so that no input is served from L2, (3) a spin kernel of ``busy_ms``
(``torch.cuda._sleep``, calibrated once per process) that keeps the GPU busy while the host enqueues the timed call,
(4) event, timed call, event. Without (3), a call whose host side (Python autograd, several launches) takes longer to
enqueue than the flush takes to run had host time in its measurement (the first H200 sweep: our LayerNorm backward
at 16384x4096 measured 0.38 ms there, 0.18 ms as a raw op); host time is measured on its own by
``benchmarks/overhead.py``. Reported: median, 20th and 80th percentiles (ms). On the CPU (``--device cpu``, dry
runs) ``time.perf_counter`` replaces the events and there is no flush or spin.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

__all__ = ["Timer", "summarize"]

FLUSH_BYTES = 256 * 2**20


def summarize(times_ms: list[float]) -> dict[str, Any]:
    """Median and 20th/80th percentiles of ``times_ms`` (milliseconds); raises ValueError on an empty list."""
    if not times_ms:
        raise ValueError("times_ms: expected at least one timing")
    xs = sorted(times_ms)

    def q(f: float) -> float:
        return xs[min(len(xs) - 1, max(0, round(f * (len(xs) - 1))))]

    return {"median_ms": statistics.median(xs), "p20_ms": q(0.2), "p80_ms": q(0.8), "reps": len(xs)}


class Timer:
    """Times callables on ``device`` ("cuda" or "cpu").

    ``warmup``/``reps``: counts; ``max_s``: a repetition loop stops early (keeping at least 3 repetitions) once
    this many seconds have passed, so one slow case cannot eat the whole budget; ``busy_ms``: the GPU spin before
    each timed call (0 = none; CUDA only).
    """

    _cycles_per_ms: float | None = None  # of torch.cuda._sleep, measured once per process

    def __init__(self, device: str = "cuda", warmup: int = 5, reps: int = 40, max_s: float = 2.0,
                 busy_ms: float = 1.0):
        if device not in ("cuda", "cpu"):
            raise ValueError(f"device: expected 'cuda' or 'cpu', got {device!r}")
        if warmup < 0 or reps < 1:
            raise ValueError(f"warmup/reps: expected warmup >= 0 and reps >= 1, got {warmup}, {reps}")
        if not busy_ms >= 0:
            raise ValueError(f"busy_ms: expected a number >= 0, got {busy_ms!r}")
        self.device, self.warmup, self.reps, self.max_s = device, warmup, reps, max_s
        self._flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda") if device == "cuda" else None
        self._busy_cycles = 0
        if device == "cuda" and busy_ms > 0:
            self._busy_cycles = int(busy_ms * self._sleep_cycles_per_ms())

    @classmethod
    def _sleep_cycles_per_ms(cls) -> float:
        """Cycles of ``torch.cuda._sleep`` per millisecond on the current GPU (median of 5 timed 2M-cycle spins)."""
        if cls._cycles_per_ms is None:
            n, ms = 2_000_000, []
            torch.cuda._sleep(n)  # warm-up
            for _ in range(5):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                torch.cuda._sleep(n)
                b.record()
                b.synchronize()
                ms.append(a.elapsed_time(b))
            cls._cycles_per_ms = n / max(statistics.median(ms), 1e-6)
        return cls._cycles_per_ms

    def copy_gbps(self, nbytes: int = 2**28) -> float:
        """Device copy bandwidth in GB/s: ``nbytes`` read plus ``nbytes`` written over the median time of a copy of a
        uint8 tensor (the reference of the raw A/B scripts, ``benchmarks.norm_raw`` and ``benchmarks.softmax_raw``)."""
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        ms = self.time(lambda _: dst.copy_(src))["median_ms"]
        return 2 * nbytes / ms / 1e6

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def time(self, fn: Callable[[Any], Any], setup: Callable[[], Any] | None = None) -> dict[str, Any]:
        """Time ``fn(setup())`` (``fn(None)`` without setup). Returns :func:`summarize`'s dict."""
        for _ in range(self.warmup):
            state = setup() if setup else None
            fn(state)
            del state
        self.sync()
        times: list[float] = []
        t_end = time.perf_counter() + self.max_s
        if self.device == "cuda":
            pending = []
            for i in range(self.reps):
                state = setup() if setup else None
                self._flush.zero_()
                if self._busy_cycles:
                    torch.cuda._sleep(self._busy_cycles)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn(state)
                b.record()
                pending.append((a, b))
                del state
                if i >= 2 and time.perf_counter() > t_end:
                    break
            torch.cuda.synchronize()
            times = [a.elapsed_time(b) for a, b in pending]
        else:
            for i in range(self.reps):
                state = setup() if setup else None
                t0 = time.perf_counter()
                fn(state)
                times.append((time.perf_counter() - t0) * 1e3)
                del state
                if i >= 2 and time.perf_counter() > t_end:
                    break
        return summarize(times)
