"""CPU tests: a kernel build's worker process (and the ninja and compilers it starts) does not outlive the build.

A walkthrough killed ``python -m pipegoose.kernels build`` (SIGTERM, SIGKILL) and found its worker and compilers
still running about 50 s later, re-parented. Here stand-in workers (a Python process that starts a ``sleep``, as the
worker starts ninja) are stopped: on an error while the builder waits, by ``stop_workers``, and by the worker itself
once its parent is killed."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pipegoose.kernels import builder

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads process states from /proc")

# a stand-in worker: starts a grandchild (as the worker starts ninja), prints its pid, waits
WORKER = ("import subprocess, time; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True); "
          "time.sleep(60)")


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def gone_within(pids: list[int], seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


class Capture:
    """A log that records the stand-in's first line (the grandchild's pid) and can raise there."""

    def __init__(self, fail: bool) -> None:
        self.fail, self.pid = fail, None
        self.ready = threading.Event()

    def write(self, line: bytes) -> None:
        if self.pid is None:
            self.pid = int(line)
            self.ready.set()
            if self.fail:
                raise RuntimeError("the builder stopped waiting")


def test_an_error_while_waiting_stops_the_workers_group(tmp_path, capsys):
    log = Capture(fail=True)
    with pytest.raises(RuntimeError, match="the builder stopped waiting"):
        builder._run_worker([sys.executable, "-c", WORKER], env=dict(os.environ), cwd=tmp_path, log=log, echo=True)
    assert log.pid is not None and gone_within([log.pid], 10), f"the worker's child {log.pid} still runs"


def test_stop_workers_stops_running_workers_and_refuses_new_ones(tmp_path, capsys):
    log, out = Capture(fail=False), {}

    def build() -> None:
        out["rc"] = builder._run_worker([sys.executable, "-c", WORKER], env=dict(os.environ), cwd=tmp_path, log=log,
                                        echo=True)

    t = threading.Thread(target=build)
    t.start()
    try:
        assert log.ready.wait(30), "the stand-in worker did not start"
        builder.stop_workers()
        t.join(30)
        assert not t.is_alive() and out["rc"] != 0, out
        assert gone_within([log.pid], 10), f"the worker's child {log.pid} still runs"
        with pytest.raises(RuntimeError, match=r"build stopped: stop_workers\(\) was called"):
            builder._run_worker([sys.executable, "-c", "pass"], env=dict(os.environ), cwd=tmp_path, log=log,
                                echo=False)
    finally:
        builder._stop_requested.clear()  # the flag is per process: later tests build again


def test_a_worker_whose_parent_is_killed_stops_its_group(tmp_path):
    child = ("from pipegoose.kernels.builder import _exit_with_parent; import subprocess, time; "
             "_exit_with_parent(0.1); p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True); time.sleep(60)")
    parent = ("import subprocess, sys, time; "
              f"c = subprocess.Popen([sys.executable, '-c', {child!r}], start_new_session=True, "
              "stdout=subprocess.PIPE, text=True); "
              "print(c.pid, c.stdout.readline().strip(), flush=True); time.sleep(60)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, "-c", parent], env=env, stdout=subprocess.PIPE, text=True)
    try:
        worker, grandchild = (int(v) for v in p.stdout.readline().split())
        assert alive(worker) and alive(grandchild)
        p.kill()  # SIGKILL: no handler of the parent runs
        p.wait()
        assert gone_within([worker, grandchild], 10), "the worker or its child outlived the killed parent"
    finally:
        if p.poll() is None:
            p.kill()
