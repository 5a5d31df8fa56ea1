"""CPU: the gated RMSNorm benchmark's parsing, byte count, report and a dry run of its plumbing (its numbers need a
GPU: ``python -m benchmarks.rms_norm_gated``)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from benchmarks import rms_norm_gated as B

pytest.importorskip("transformers")


def test_parse_shape():
    assert B.parse_shape("524288x128") == (524288, 128)
    for bad in ("128", "0x128", "ax128", "1x2x3"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected"):
            B.parse_shape(bad)


def test_min_bytes():
    # bf16 x, gate, y (3 x R x D x 2 bytes) and the weight; the backward dy, x, gate read, dx, dgate written (5), the
    # weight read and its gradient written
    r, d = 1024, 128
    assert B.min_bytes((r, d), torch.bfloat16, torch.bfloat16, "fwd") == 3 * r * d * 2 + d * 2
    assert B.min_bytes((r, d), torch.bfloat16, torch.float32, "fwd+bwd") == (3 + 5) * r * d * 2 + 3 * d * 4


def test_dry_run_checks_every_row_against_the_module(tmp_path):
    """On the CPU the transformers row runs and is timed; the pipegoose row is an error row (strict: the kernels need
    a GPU), named; a wrong implementation is FAILED, not timed; the results land in rms_norm_gated.json / .md."""
    B.main(["--device", "cpu", "--impls", "pipegoose,transformers", "--reps", "1", "--dtypes", "bf16,fp32",
            "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "rms_norm_gated.json").read_text())["rows"]
    theirs = [r for r in rows if r["impl"] == "transformers"]
    ours = [r for r in rows if r["impl"] == "pipegoose"]
    assert len(theirs) == 4 and all(r["status"] == "ok" and r["median_ms"] > 0 for r in theirs), theirs
    assert ours and all(r["status"] == "error" and "needs a CUDA tensor" in r["why"] for r in ours), ours
    md = (tmp_path / "rms_norm_gated.md").read_text()
    assert md.startswith("# Gated RMSNorm (Qwen3-Next's / Qwen3.5's RMSNormGated, the norm first), bfloat16, float32")
    fns = B.functions()
    fns["pipegoose"] = lambda x, gate, w: fns["transformers"](x, gate, w) * 1.01   # (a wrong result)
    timer = B.Timer("cpu", warmup=1, reps=1)
    bad = B.run_shape((64, 16), fns, timer, torch.float32, "cpu", 0.0, ("pipegoose",))
    assert all(r["status"] == "FAILED" and "['y'" in r["why"] for r in bad), bad


def test_gate_first_dry_run_times_mamba2s_module(tmp_path):
    """--gate-first --group 8: Mamba2's module is the check and is timed; ours errors on the CPU (the kernel needs a
    GPU) and ops refuses the gate first; the results land in rms_norm_gated_gate_first.json / .md, rows naming the
    group; a group that divides no shape is a usage error; an fp32 output (Mamba2's promotion) counts 4 bytes."""
    B.main(["--device", "cpu", "--gate-first", "--group", "8", "--impls", "pipegoose,ops,transformers", "--reps", "1",
            "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "rms_norm_gated_gate_first.json").read_text())["rows"]
    by = {}
    for r in rows:
        by.setdefault(r["impl"], []).append(r)
    assert all(r["status"] == "ok" and r["group"] == 8 and r["gate_first"] for r in by["transformers"]), rows
    assert all(r["status"] == "error" and "needs a CUDA tensor" in r["why"] for r in by["pipegoose"]), rows
    assert all(r["status"] == "error" and "two ops" in r["why"] for r in by["ops"]), rows
    assert "Mamba2's MambaRMSNormGated" in (tmp_path / "rms_norm_gated_gate_first.md").read_text()
    with pytest.raises(SystemExit):
        B.main(["--device", "cpu", "--gate-first", "--group", "5", "--shapes", "4x16"])
    r, d = 1024, 128
    assert B.min_bytes((r, d), torch.bfloat16, torch.float32, "fwd", torch.float32) == r * d * (2 * 2 + 4) + d * 4
