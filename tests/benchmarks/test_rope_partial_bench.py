"""CPU: the partial-rotary benchmark's parsing, byte count, report, refusals, and a dry run of its plumbing with the
kernel's ops replaced by a CPU stand-in (its numbers need a GPU: ``python -m benchmarks.rope_partial``)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from benchmarks import rope_partial as B


def test_parse_shape():
    assert B.parse_shape("8x2048x16x64x16") == (8, 2048, 16, 64, 16)
    assert B.parse_shape("8x2048x16x64x64") == (8, 2048, 16, 64, 64)   # whole heads
    for bad in ("8x2048x16x64", "8x2048x16x64x15", "8x2048x16x64x66", "0x1x1x4x2", "axbxcxdxe"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected"):
            B.parse_shape(bad)


def test_min_bytes_counts_every_value_of_q_and_k_and_the_tables():
    # bf16: q and k (2 x 8 x 16 x 2048 x 64 values) read and written, cos and sin (2048 x 16) read
    one = (2 * 2 * 8 * 16 * 2048 * 64 + 2 * 2048 * 16) * 2
    assert B.min_bytes((8, 2048, 16, 64, 16), torch.bfloat16, "fwd") == one
    assert B.min_bytes((8, 2048, 16, 64, 16), torch.bfloat16, "fwd+bwd") == 2 * one


def test_markdown_names_the_gpu_the_copy_and_every_row():
    env = dict(gpu="NVIDIA H200", date="2026-12-05", torch="2.11", cuda_runtime="13.0", triton="3.6",
               transformers="5.17", pipegoose_git="abc")
    rows = [dict(impl="pipegoose", batch=8, seq=2048, heads=16, head_dim=64, rotary=16, dtype="bfloat16", passes="fwd",
                 status="ok",
                 median_ms=0.05, gbps=3400.0, pct_copy=80.2),
            dict(impl="compile", batch=8, seq=2048, heads=16, head_dim=64, rotary=16, dtype="bfloat16",
                 passes="fwd+bwd", status="FAILED", why="differs")]
    md = B.markdown(env, rows, 4240.0)
    assert "NVIDIA H200" in md and "2026-12-05" in md and "Device copy: 4240 GB/s" in md
    assert md.startswith("# Partial rotary (GPT-NeoX's RoPE), bfloat16 (NVIDIA H200, 2026-12-05)")
    assert "| 8x2048x16x64x16 | bfloat16 | fwd | pipegoose | 0.0500 | 3400 | 80.2 | ok |" in md
    assert "| 8x2048x16x64x16 | bfloat16 | fwd+bwd | compile | | | | FAILED: differs |" in md


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_refuses_without_a_gpu():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        B.main(["--shapes", "2x16x4x16x4"])


@pytest.mark.parametrize("argv, message", [
    (["--reps", "0"], "--reps: expected a positive number of repetitions, got 0"),
    (["--impls", ",,"], "--impls: expected some of pipegoose, "),
    (["--impls", "pipegoose,liger"], "--impls: unknown liger"),
    (["--device", "cpu", "--raw"], "--raw / --defines: the op needs a CUDA GPU"),
    (["--device", "cpu", "--defines=-DPIPEGOOSE_ROPE_COPY_BYTES=32"], "--raw / --defines: the op needs a CUDA GPU"),
    (["--defines=-DPIPEGOOSE_ROPE_COPY_BYTE=32"],
     "--defines: '-DPIPEGOOSE_ROPE_COPY_BYTE=32': PIPEGOOSE_ROPE_COPY_BYTE occurs in none of the files of "
     "pipegoose/rope"),
    (["--defines", "PIPEGOOSE_ROPE_COPY_BYTES=32"], "expected -DNAME or -DNAME=VALUE"),
    (["--dtypes", "bf16,fp8"], "--dtypes: expected some of bf16, fp16, fp32, got 'bf16,fp8'"),
    (["--dtypes", ","], "--dtypes: expected some of bf16, fp16, fp32"),
    (["--dtypes", "fp32,FP32"], "--dtypes: 'fp32,FP32' names a dtype twice"),
])
def test_argument_errors(capsys, argv, message):
    with pytest.raises(SystemExit):
        B.main(argv)
    assert message in capsys.readouterr().err


def test_dry_run_on_the_cpu_with_the_kernel_stand_in(monkeypatch, tmp_path):
    """--device cpu, the kernel's ops a CPU stand-in: every row ok (checked against GPT-NeoX's function first), the
    kernel's partial path run (its forward and backward ops called), the results written."""
    from rope_stand_in import kernel_on_cpu

    from pipegoose.nn.fusion import dispatch

    with kernel_on_cpu(monkeypatch, dispatch) as calls:
        B.main(["--device", "cpu", "--reps", "1", "--impls", "pipegoose,transformers", "--dtypes", "fp32,BF16",
                "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "rope_partial.json").read_text())["rows"]
    assert [(r["dtype"], r["impl"], r["passes"], r["status"]) for r in rows] == [
        (dt, impl, p, "ok") for dt in ("float32", "bfloat16") for impl in ("pipegoose", "transformers")
        for p in ("fwd", "fwd+bwd")]
    names = {c[0] for c in calls}
    assert names == {"rope_forward", "rope_backward"}
    md = (tmp_path / "rope_partial.md").read_text()
    assert md.startswith("# Partial rotary (GPT-NeoX's RoPE), float32, bfloat16 (")
    assert "| 2x16x4x16x4 | float32 | fwd | pipegoose |" in md and "| 2x16x4x16x4 | bfloat16 | fwd | pipegoose |" in md


@pytest.mark.parametrize("style, title", [("cohere", "# Interleaved RoPE (Cohere's), bfloat16 ("),
                                          ("glm", "# Interleaved partial rotary (GLM-4's RoPE), bfloat16 ("),
                                          ("gptj", "# GPT-J's RoPE section (one tensor a call")])
def test_interleaved_styles_dry_run(monkeypatch, tmp_path, style, title):
    """--style cohere / glm / gptj on the CPU with the kernel's stand-in: every row ok against the model's own
    function (Cohere's, GLM-4's, GPT-J's section: its function on the rotated part of k and of q, then cat), the op
    called with interleaved=True (GLM's on the tables its function builds; GPT-J's on q alone beside an empty k), the
    results in rope_<style>.json / .md."""
    from rope_stand_in import kernel_on_cpu

    from pipegoose.nn.fusion import dispatch

    pytest.importorskip(f"transformers.models.{'glm4' if style == 'glm' else style}")
    with kernel_on_cpu(monkeypatch, dispatch) as calls:
        B.main(["--device", "cpu", "--style", style, "--reps", "1", "--impls", "pipegoose,transformers",
                "--out", str(tmp_path)])
    rows = json.loads((tmp_path / f"rope_{style}.json").read_text())["rows"]
    assert rows and all(r["status"] == "ok" and r["style"] == style for r in rows), rows
    assert {c[0] for c in calls} == {"rope_forward", "rope_backward"}
    assert all(c[-1] == "interleaved" for c in calls)
    assert (style == "gptj") == all(c[2].numel() == 0 for c in calls)
    assert (tmp_path / f"rope_{style}.md").read_text().startswith(title)


def test_compile_is_not_capped_at_dynamos_recompile_limit(monkeypatch):
    """Session 60: one compiled function timed over 15 shapes and dtypes passed dynamo's recompile limit (8), after
    which it ran eagerly under the name of torch.compile (fp16 and fp32 rows at 9-19% of copy on the H200)."""
    import torch._dynamo as dynamo

    pytest.importorskip("transformers.models.gpt_neox.modeling_gpt_neox")
    knobs = [k for k in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                         "accumulated_recompile_limit") if hasattr(dynamo.config, k)]
    for k in knobs:   # (each put back after the test: raise_compile_limits sets them for the process)
        monkeypatch.setattr(dynamo.config, k, 8)
    B.functions()
    assert dynamo.config.recompile_limit >= 1024 and all(getattr(dynamo.config, k) >= 1024 for k in knobs)
