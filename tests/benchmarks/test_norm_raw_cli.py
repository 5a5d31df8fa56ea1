"""benchmarks.norm_raw: argument checks (each bad combination exits with a one-line message naming the option,
before any kernel is built or a GPU is needed) and --table (CPU only)."""

import json
import sys

import _bench_path  # noqa: F401
import pytest

from benchmarks import norm_raw


def run(monkeypatch, *argv):
    monkeypatch.setattr(sys, "argv", ["norm_raw", *argv])
    with pytest.raises(SystemExit) as e:
        norm_raw.main()
    return str(e.value)


@pytest.mark.parametrize("argv,expect", [
    (["--fwd-only", "--bwd-only"], "--fwd-only and --bwd-only exclude each other"),
    (["--fwd-plans=-;1,4,0,0", "--bwd-only"], "--fwd-plans and --bwd-only exclude each other"),
    (["--fwd-plans=-;1,4,0,0", "--bwd-wide"], "--fwd-plans and --bwd-wide exclude each other"),
    (["--bwd-wide", "--fwd-only"], "--bwd-wide and --fwd-only exclude each other"),
    (["--fwd-plans=-;1,4,0,0", "--bwd-cluster"], "--fwd-plans and --bwd-cluster exclude each other"),
    (["--bwd-cluster", "--fwd-only"], "--bwd-cluster and --fwd-only exclude each other"),
    (["--table", "x.jsonl", "--bwd-cluster"], "--table only prints a table; it takes no other option (got --bwd-cluster)"),
    (["--fwd-plans=-;1,4,0"], "--fwd-plans: '1,4,0': expected - or grid,nv,pf,preg"),
    (["--fwd-plans=1,3,0,0"], "--fwd-plans: '1,3,0,0': expected - or grid,nv,pf,preg"),
    (["--fwd-plans=1,8,1,0"], "--fwd-plans: '1,8,1,0': expected - or grid,nv,pf,preg"),
    (["--fwd-plans=1,4,0,x"], "--fwd-plans: '1,4,0,x': expected - or grid,nv,pf,preg"),
    (["--fwd-plans=1,4,0,0 "], "--fwd-plans: '1,4,0,0 ': expected - or grid,nv,pf,preg"),  # sscanf stops there
    (["--fwd-plans=1 ,4,0,0"], "--fwd-plans: '1 ,4,0,0': expected - or grid,nv,pf,preg"),
    (["--fwd-plans=1,\u0664,0,0"], "expected - or grid,nv,pf,preg"),  # a non-ASCII digit int() would take
    (["--fwd-plans=1,8,0,1,2"], "--fwd-plans: '1,8,0,1,2': expected - or grid,nv,pf,preg[,minb]"),  # nv 2 or 4
    (["--fwd-plans=1,4,1,0,2"], "--fwd-plans: '1,4,1,0,2': expected - or grid,nv,pf,preg[,minb]"),  # no prefetch
    (["--fwd-plans=1,4,0,0,3"], "--fwd-plans: '1,4,0,0,3': expected - or grid,nv,pf,preg[,minb]"),
    (["--fwd-plans=1,4,0,0,2,1"], "--fwd-plans: '1,4,0,0,2,1': expected - or grid,nv,pf,preg[,minb]"),
    (["--max-h", "-1"], "--max-h: expected 0 (all) or a positive hidden size"),
    (["--max-h", "100"], "--max-h 100: no shape left (the smallest H is 512)"),
    (["--shapes", "4x8x2"], "--shapes: '4x8x2': expected ROWSxH"),
    (["--shapes", "0x8"], "--shapes: '0x8': expected ROWSxH"),
    (["--shapes", "4x8,4x8"], "a shape is given twice"),
    (["--shapes", ""], "--shapes: '': expected ROWSxH"),  # ran the default sweep (session 32's walkthrough)
    (["--shapes", ","], "--shapes: ',': expected ROWSxH"),
    (["--dtypes", "bf16,bf16"], "a dtype (pair) is given twice"),
    (["--dtypes", "int8"], "--dtypes: 'int8': expected INPUT or INPUT/PARAMETER"),
    (["--dtypes", "bf16/fp32", "--max-h", "2048"], "a pair of different dtypes is timed at H in (4096, 16384)"),
    (["--table", ""], "--table: expected a JSONL file"),
    (["--defines=X"], "--defines: 'X': expected -DNAME or -DNAME=VALUE"),
    (["--defines=-DPIPEGOOSE_NORM_BWD_SYNCC"],
     "PIPEGOOSE_NORM_BWD_SYNCC occurs in none of the files of pipegoose/layer_norm, pipegoose/rms_norm"),
    (["--ops", "layernorm"], "--ops: 'layernorm': expected layer_norm, rms_norm or layer_norm,rms_norm"),
    (["--ops", "rms_norm,rms_norm"], "--ops: 'rms_norm,rms_norm': expected layer_norm, rms_norm"),
    (["--ops", ""], "--ops: '': expected layer_norm"),
    (["--table", "x.jsonl", "--ops=rms_norm"], "--table only prints a table; it takes no other option (got --ops)"),
    (["--table", "x.jsonl", "--bwd-only"], "--table only prints a table; it takes no other option (got --bwd-only)"),
])
def test_bad_arguments_exit_with_the_option_named(monkeypatch, argv, expect):
    msg = run(monkeypatch, *argv)
    assert expect in msg, msg
    assert "\n" not in msg


def test_ops_limits_the_defines_check_to_its_kernels(monkeypatch):
    """--ops layer_norm checks --defines against pipegoose/layer_norm's files only (and builds only that kernel)."""
    msg = run(monkeypatch, "--ops=layer_norm", "--defines=-DPIPEGOOSE_NORM_RMS_ONLY_MACRO")
    assert msg.endswith("occurs in none of the files of pipegoose/layer_norm"), msg
    msg = run(monkeypatch, "--defines=-DPIPEGOOSE_NORM_RMS_ONLY_MACRO")
    assert msg.endswith("pipegoose/layer_norm, pipegoose/rms_norm"), msg


def test_table_of_fwd_plan_lines_and_bad_copy_bandwidth(monkeypatch, tmp_path):
    lines = [{"label": "x", "copy_gbps": 4000.0}]
    for plan, gbps, diff in (("-", 3600.0, 0.0), ("1,8,0,0", 3200.0, 0.5)):
        lines.append({"label": "x", "plan": plan, "op": "rms_norm", "dtype": "bfloat16", "pdtype": "bfloat16",
                      "rows": 16384, "H": 4096, "pass": "fwd", "ms": 0.1, "gbps": gbps, "maxdiff": diff})
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(json.dumps(d) for d in lines) + "\n")
    out = norm_raw.table(str(good))
    row = [r for r in out.splitlines() if r.startswith("rms_norm")][0]
    assert row.endswith("|  90.0 |  80.0!"), out  # 3600 / 4000; the second plan's maxdiff is flagged
    for bad in ("NaN", "true", "1e400"):
        p = tmp_path / f"bad_{bad}.jsonl"
        p.write_text(good.read_text().replace("4000.0", bad, 1))
        with pytest.raises(SystemExit, match="copy_gbps: expected a finite number"):
            norm_raw.table(str(p))


@pytest.mark.parametrize("plans", ["-;1,2,0,1,2;1,4,0,0,2", "1,4,0,0,1", "1,4,0,0"])
def test_fwd_plans_with_minb_pass_their_check(monkeypatch, plans):
    """The optional fifth field (minb 1 or 2, as the kernels' fwd_exp takes it) passes; the script then stops at the
    GPU check (made to fail here)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    msg = run(monkeypatch, f"--fwd-plans={plans}", "--shapes", "4x4096")
    assert msg == "norm_raw: needs a CUDA GPU", msg


def test_mixed_dtypes_at_the_given_shapes_pass_their_check(monkeypatch):
    """A pair of different dtypes is timed at every shape that --shapes names (without --shapes: MIXED_H only, a
    usage error above); the script then stops at the GPU check (made to fail here)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    msg = run(monkeypatch, "--dtypes", "bf16/fp32", "--shapes", "64x2048,64x128")
    assert msg == "norm_raw: needs a CUDA GPU", msg


def test_known_defines_pass_their_check(monkeypatch):
    """Switches that the kernels' files name (spaces around items ignored) pass; the script then stops at the GPU
    check (made to fail here, so that it never benchmarks, on a GPU machine either)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    msg = run(monkeypatch, "--defines=-DPIPEGOOSE_NORM_BWD_SYNC, -DPIPEGOOSE_NORM_BWD_STAGES=3")
    assert msg == "norm_raw: needs a CUDA GPU", msg


@pytest.mark.parametrize("opt", ["--fwd-plans", "--shapes", "--dtypes"])
def test_an_option_given_as_double_dash_is_a_usage_error(monkeypatch, capsys, opt):
    """argparse hands "--opt=--" over as a list; that is a usage error naming the option, not a traceback."""
    msg = run(monkeypatch, f"{opt}=--")
    assert msg == "2"  # argparse's usage exit
    assert f"{opt}: expected a value" in capsys.readouterr().err
