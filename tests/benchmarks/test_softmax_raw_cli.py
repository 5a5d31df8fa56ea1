"""benchmarks.softmax_raw and benchmarks.run --sizes: argument checks (each bad value exits with a one-line message
naming the option, before any kernel is built or a GPU is needed)."""

import sys

import _bench_path  # noqa: F401
import pytest

from benchmarks import run as bench_run
from benchmarks import softmax_raw


@pytest.mark.parametrize("argv,expect", [
    (["--ops", "softmax,bad"], "--ops: 'softmax,bad': unknown bad; expected a comma-separated list of softmax"),
    (["--ops", ""], "--ops: '': empty; expected"),
    (["--ops", "softmax, softmax"], "--ops: 'softmax, softmax': softmax given twice"),
    (["--sizes", "128,x"], "--sizes: '128,x': expected key lengths from 1 to 32768"),
    (["--sizes", "0"], "--sizes: '0': expected key lengths from 1 to 32768"),
    (["--sizes", "65536"], "--sizes: '65536': expected key lengths from 1 to 32768"),
    (["--sizes", "128,128"], "--sizes: '128,128': 128 given twice"),
    (["--dtypes", "bf16,int8"], "--dtypes: 'bf16,int8': unknown int8; expected a comma-separated list of bf16"),
    (["--dtypes", "bf16,bfloat16"], "--dtypes: 'bf16,bfloat16': a dtype is given twice"),
    (["--defines", "X"], "--defines: 'X': expected -DNAME or -DNAME=VALUE"),
    (["--defines=-D"], "--defines: '-D': expected -DNAME or -DNAME=VALUE"),
    # a misspelt switch would build the default kernel under a new key: rejected before any build
    (["--defines=-DPIPEGOOSE_SOFTMAX_FWD_NMM=2"],
     "--defines: '-DPIPEGOOSE_SOFTMAX_FWD_NMM=2': PIPEGOOSE_SOFTMAX_FWD_NMM occurs in none of the files of "
     "pipegoose/softmax"),
])
def test_softmax_raw_bad_arguments(monkeypatch, argv, expect):
    """Each bad value exits with one line naming the option and the bad item, before a GPU is needed; spaces around
    items are ignored (" softmax.masked, bf16" is fine, as in benchmarks.run)."""
    monkeypatch.setattr(sys, "argv", ["softmax_raw", *argv])
    with pytest.raises(SystemExit) as e:
        softmax_raw.main()
    msg = str(e.value)
    assert expect in msg, msg
    assert "\n" not in msg


def test_softmax_raw_accepts_spaces_and_long_dtype_names(monkeypatch):
    """The arguments pass their checks: the script stops at the GPU check (made to fail here, so that it never
    benchmarks, on a GPU machine either)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["softmax_raw", "--ops", " softmax, softmax.masked", "--dtypes", "bfloat16, fp32",
                                      "--sizes", " 128 ,256",
                                      "--defines=-DPIPEGOOSE_SOFTMAX_FWD_NM=2, -DPIPEGOOSE_SOFTMAX_BWD_MID_NV=4"])
    with pytest.raises(SystemExit) as e:
        softmax_raw.main()
    assert str(e.value) == "softmax_raw: needs a CUDA GPU"


def test_run_sizes_filter(capsys):
    a = bench_run.parse_args(["--only", "softmax", "--sizes", "128, 256,128"])
    assert a.size_filter == [128, 256] and a.no_tuning  # duplicates dropped; a partial sweep writes no tuning table
    assert bench_run.parse_args(["--only", "softmax"]).size_filter is None
    for argv, expect in (
            (["--only", "softmax", "--sizes", "100"], "--sizes: [100] not among the full sizes of softmax"),
            (["--only", "softmax", "--sizes", "1x"], "--sizes: expected comma-separated integers"),
            (["--only", "softmax", "--sizes", ","], "--sizes: expected comma-separated integers"),
            (["--only", "layer_norm", "--sizes", "100"], "--sizes: [100] not among the full sizes of layer_norm"),
            (["--only", "softmax,layer_norm", "--sizes", "64,512"], "--sizes: [64] not among the full sizes of softmax"),
            (["--only", "softmax,adamw", "--sizes", "512"], "every op run must be a sized op"),
            (["--sizes", "512"], "every op run must be a sized op"),
            (["--only", "softmax", "--sizes", "512", "--no-ops"], "--only, --sizes: not with --no-ops"),
            (["--only", "softmax", "--sizes", "512", "--tuning-dir", "t"], "does not write a tuning table")):
        with pytest.raises(SystemExit):
            bench_run.parse_args(argv)
        err = capsys.readouterr().err
        assert expect in err, (argv, err)


def test_run_refuses_empty_op_lists_and_bad_specialise_defines(capsys):
    """An --only of commas ran every op, and a --specialise-define of an unknown kernel or switch was dropped only after
    the sweep had run (session 32's walkthrough): both are usage errors now."""
    a = bench_run.parse_args(["--specialise", "--specialise-define", "pipegoose/layer_norm:-DPIPEGOOSE_NORM_HIDDEN=1024"])
    assert a.defines == {"pipegoose/layer_norm": ["-DPIPEGOOSE_NORM_HIDDEN=1024"]}
    for argv, expect in (
            (["--only", ","], "--only: expected op names"),
            (["--specialise-define", "pipegoose/layer_norm:-DPIPEGOOSE_NORM_HIDDEN=1024"], "only with --specialise"),
            (["--specialise", "--specialise-define", "layer_norm:-DPIPEGOOSE_NORM_HIDDEN=1024"],
             "expected a kernel among pipegoose/softmax, pipegoose/layer_norm"),
            (["--specialise", "--specialise-define", "pipegoose/layer_norm:-DPIPEGOOSE_NO_SUCH_SWITCH"],
             "PIPEGOOSE_NO_SUCH_SWITCH occurs in none of the files")):
        with pytest.raises(SystemExit):
            bench_run.parse_args(argv)
        err = capsys.readouterr().err
        assert expect in err, (argv, err)


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


@pytest.mark.parametrize("argv,expect", [
    (["--impls", "nonexistent"], "--impls: unknown ['nonexistent']"),
    (["--dtypes", ","], "--dtypes: expected some of bf16, fp16, fp32"),
    (["--budget-s", "-5"], "--budget-s: expected a number of seconds > 0"),
    (["--jobs", "0"], "--jobs: expected an integer >= 1"),
    (["--e2e", "--e2e-models", "qwen"], "--e2e-models: unknown ['qwen']; expected some of llama, neox, qwen3, phi3, "
                                        "gemma, qwen3_moe"),
    (["--e2e", "--e2e-models", ","], "--e2e-models: unknown []"),
    (["--e2e", "--e2e-variants", "sdpa,fused_eager"], "--e2e-variants: unknown ['fused_eager']"),
    (["--e2e", "--e2e-batch", "qwen=4"], "--e2e-batch: expected MODEL=N with MODEL one of llama, neox, qwen3, phi3, "
                                         "gemma, qwen3_moe"),
    (["--e2e", "--e2e-batch", "qwen3=0"], "got 'qwen3=0'"),
    (["--e2e-models", "neox", "--e2e-batch", "neox=2"], "--e2e-models, --e2e-batch: only with --e2e"),
    (["--e2e-budget-s", "60"], "--e2e-budget-s: only with --e2e"),
    (["--e2e", "--e2e-budget-s", "nan"], "--e2e-budget-s: expected a number of seconds > 0, got nan"),
    (["--e2e", "--e2e-budget-s", "-5"], "--e2e-budget-s: expected a number of seconds > 0, got -5.0"),
    (["--e2e", "--e2e-budget-s", "0"], "--e2e-budget-s: expected a number of seconds > 0, got 0.0"),
    (["--budget-s", "nan"], "--budget-s: expected a number of seconds > 0, got nan"),
    # the op benchmarks' options with --no-ops, which skips them (a review: ignored without a word)
    (["--no-ops", "--e2e", "--only", "softmax"], "--only: not with --no-ops"),
    (["--no-ops", "--e2e", "--dtypes", "bf16", "--budget-s", "60"], "--dtypes, --budget-s: not with --no-ops"),
    (["--no-ops", "--build-cost", "--impls", "pipegoose"], "--impls: not with --no-ops"),
    (["--no-ops", "--e2e", "--no-compile"], "--no-compile: not with --no-ops"),
    # an impl that none of the ops run has (a review: a run of 0 measurements, exit 0)
    (["--only", "softmax", "--impls", "torch_fused"], "--impls: ['torch_fused'] implement none of the ops run "
                                                      "(softmax); expected some of eager, native, compile, liger, "
                                                      "torch, megatron, pipegoose"),
    (["--only", "adamw,layer_norm", "--impls", "pipegoose,torch_loop,megatron"], "--impls: ['torch_loop', 'megatron']"),
])
def test_run_refuses_arguments_that_run_nothing(capsys, argv, expect):
    """A walkthrough: each of these ran nothing (or a run of skipped rows), exited 0 and replaced the day's results."""
    with pytest.raises(SystemExit):
        bench_run.parse_args(argv)
    assert expect in capsys.readouterr().err


def test_run_refuses_to_replace_an_earlier_run_of_the_day(tmp_path, monkeypatch, capsys):
    """A second run of the day into the same --out replaced the first one's results.json (its reports and plots of
    other ops stayed, no longer matching): refused, saying how to keep both; --overwrite replaces it."""
    monkeypatch.setenv("PIPEGOOSE_STRICT", "")
    # a GPU run that measures nothing (--no-ops), on a stand-in environment: a CPU machine has no GPU to run on
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_run, "environment", lambda device: {"gpu": "Fake GPU X-1", "device": device,
                                                                  "date": "2026-12-01T00:00:00+00:00", "torch": "x"})
    argv = ["--no-ops", "--out", str(tmp_path), "--no-tuning"]
    assert bench_run.main(argv) == 0
    results = next(tmp_path.glob("fake_gpu_x_1_*/results.json"))
    first = results.read_bytes()
    assert bench_run.main(argv) == 2
    assert "exists (an earlier run of today)" in capsys.readouterr().err and results.read_bytes() == first
    assert bench_run.main(argv + ["--overwrite"]) == 0
    dry = ["--device", "cpu", "--dry-run", "--only", "clip_grad_norm", "--dtypes", "fp32", "--out", str(tmp_path),
           "--no-tuning"]
    assert bench_run.main(dry) == 0 and bench_run.main(dry) == 0   # a dry run checks the pipeline: not refused


def test_norm_spec_checks_its_arguments_and_the_gpu_before_building(monkeypatch, capsys):
    """A walkthrough: --hidden abc was a traceback, and without a GPU the script compiled for minutes before finding
    nothing to time."""
    import torch

    from benchmarks import norm_spec

    with pytest.raises(SystemExit):
        norm_spec.main(["--hidden", "abc"])
    assert "--hidden: expected comma-separated positive integers, got 'abc'" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(norm_spec, "_spawn", lambda *a, **k: pytest.fail("built without a GPU"))
    assert norm_spec.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
