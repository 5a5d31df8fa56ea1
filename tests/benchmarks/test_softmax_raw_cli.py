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
