"""The benchmark timer: arguments (CPU), and on a GPU that the spin before each timed call keeps host time out of
the measurement."""

import time

import _bench_path  # noqa: F401
import pytest
import torch

from benchmarks.timing import Timer


def test_timer_arguments():
    with pytest.raises(ValueError, match="busy_ms"):
        Timer("cpu", busy_ms=-1)
    with pytest.raises(ValueError, match="device"):
        Timer("tpu")
    res = Timer("cpu", warmup=0, reps=3, busy_ms=0).time(lambda _: time.sleep(0.001))
    assert res["reps"] == 3 and res["median_ms"] >= 1.0


@pytest.mark.cuda
def test_spin_keeps_host_time_out_of_the_measurement():
    """A call that spends 2 ms on the host before a ~10 us kernel: without the spin its event timing includes the
    host time (the GPU waits for the kernel to be enqueued); with a 5 ms spin it is the kernel's time only."""
    x = torch.zeros(1 << 20, device="cuda")

    def host_then_kernel(_):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.002:
            pass
        x.add_(1)

    without = Timer("cuda", warmup=2, reps=10, busy_ms=0).time(host_then_kernel)["median_ms"]
    with_spin = Timer("cuda", warmup=2, reps=10, busy_ms=5).time(host_then_kernel)["median_ms"]
    assert without >= 1.5, without
    assert with_spin < 0.5, with_spin


def test_copy_gbps_counts_read_and_written_bytes(monkeypatch):
    t = Timer("cpu", warmup=0, reps=3)
    monkeypatch.setattr(t, "time", lambda fn, setup=None: (fn(None), {"median_ms": 2.0})[1])
    assert t.copy_gbps(2**20) == 2 * 2**20 / 2.0 / 1e6  # bytes read + written over the median milliseconds
