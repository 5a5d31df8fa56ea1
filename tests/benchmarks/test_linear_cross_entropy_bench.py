"""CPU: the fused linear cross-entropy benchmark's parsing, report and refusal without a GPU (its numbers need one:
``python -m benchmarks.linear_cross_entropy``)."""

from __future__ import annotations

import argparse

import pytest
import torch

from benchmarks import linear_cross_entropy as B


def test_parse_shape():
    assert B.parse_shape("8192x2048x32000") == (8192, 2048, 32000)
    assert B.parse_shape("1X2x3") == (1, 2, 3)
    for bad in ("8192x2048", "axbxc", "0x1x1", "1x-2x3"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected"):
            B.parse_shape(bad)


def test_markdown_names_the_gpu_and_every_row():
    env = dict(gpu="NVIDIA H200", date="2026-12-04", torch="2.11", cuda_runtime="13.0", triton="3.5",
               liger_kernel=None, pipegoose_git="abc")
    rows = [dict(impl="pipegoose", tokens=8, hidden=4, vocab=16, status="ok", median_ms=1.5, tflops=600.0,
                 peak_mib=12.0),
            dict(impl="liger", tokens=8, hidden=4, vocab=16, status="unavailable", why="liger_kernel not importable")]
    md = B.markdown(env, rows)
    assert "NVIDIA H200" in md and "2026-12-04" in md
    assert "| 8x4x16 | pipegoose | 1.500 | 600 | 12 | ok |" in md
    assert "| 8x4x16 | liger | | | | unavailable: liger_kernel not importable |" in md


def test_rel_error():
    w = torch.tensor([1.0, -4.0])
    assert B.rel_error(w, w) == 0
    assert B.rel_error(torch.tensor([1.0, -3.0]), w) == pytest.approx(0.25)
    assert B.rel_error(torch.tensor([float("nan"), -4.0]), w) == float("inf")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_refuses_without_a_gpu():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        B.main(["--shapes", "8x4x16"])


def test_chunk_rows_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        B.main(["--chunk-rows", "512", "0"])
    assert "--chunk-rows: expected positive numbers of rows" in capsys.readouterr().err


def test_impls_must_be_known(capsys):
    with pytest.raises(SystemExit):
        B.main(["--chunk-rows", "512", "--impls", "pipegoose,pipegoose@512,liger,pipegoose@1024"])
    assert "--impls: unknown pipegoose@1024" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--reps", "0"], "--reps: expected a positive number of repetitions, got 0"),
    (["--impls", ",,"], "--impls: expected some of pipegoose, "),
    (["--impls", "pipegoose@512"], "(pipegoose@R needs --chunk-rows R)"),
])
def test_argument_errors(capsys, argv, message):
    with pytest.raises(SystemExit):
        B.main(argv)
    assert message in capsys.readouterr().err
