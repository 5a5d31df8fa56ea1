"""benchmarks.softmax_raw and benchmarks.run --sizes: argument checks (each bad value exits with a one-line message
naming the option, before any kernel is built or a GPU is needed)."""

import sys

import _bench_path  # noqa: F401
import pytest

from benchmarks import run as bench_run
from benchmarks import softmax_raw


@pytest.mark.parametrize("argv,expect", [
    (["--ops", "softmax,bad"], "--ops: 'softmax,bad': expected a comma-separated list of softmax"),
    (["--ops", ""], "--ops: '': expected"),
    (["--sizes", "128,x"], "--sizes: '128,x': expected positive integers"),
    (["--sizes", "0"], "--sizes: '0': expected positive integers"),
    (["--dtypes", "bf16,int8"], "--dtypes: 'bf16,int8': expected a comma-separated list of bf16, fp16, fp32"),
])
def test_softmax_raw_bad_arguments(monkeypatch, argv, expect):
    monkeypatch.setattr(sys, "argv", ["softmax_raw", *argv])
    with pytest.raises(SystemExit) as e:
        softmax_raw.main()
    msg = str(e.value)
    assert expect in msg, msg
    assert "\n" not in msg


def test_run_sizes_filter(capsys):
    a = bench_run.parse_args(["--only", "softmax", "--sizes", "128,256"])
    assert a.size_filter == [128, 256]
    assert bench_run.parse_args(["--only", "softmax"]).size_filter is None
    for bad, expect in ((["--sizes", "100"], "--sizes: [100] not among the full sizes"),
                        (["--sizes", "1x"], "--sizes: expected comma-separated integers"),
                        (["--only", "layer_norm", "--sizes", "128"], "--sizes: [128] not among")):
        with pytest.raises(SystemExit):
            bench_run.parse_args(["--only", "softmax", *bad] if bad[0] != "--only" else bad)
        assert expect in capsys.readouterr().err


def test_importing_run_leaves_strict_mode_alone():
    """benchmarks.run turns strict mode on in main(), not at import: an import at collection time switched every
    later test in the process to strict mode (CPU CI, session 10)."""
    import os
    import subprocess

    code = "import os, sys; sys.path[:0] = ['.']; import benchmarks.run; print(os.environ.get('PIPEGOOSE_STRICT'))"
    env = {k: v for k, v in os.environ.items() if k != "PIPEGOOSE_STRICT"}
    out = subprocess.run([sys.executable, "-c", code], cwd=bench_run.REPO_ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "None"
