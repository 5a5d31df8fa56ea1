"""benchmarks/bloom_drift.py on the CPU at a tiny size: every run trains, the JSON holds what was printed, bad
arguments are refused before any run (a review: ``--steps 0`` and an ``--out`` in a missing folder failed after)."""

import json

import _bench_path  # noqa: F401
import pytest

from benchmarks import bloom_drift

TINY = ["--hidden", "32", "--heads", "2", "--layers", "1", "--seq", "16", "--batch", "2", "--vocab", "64",
        "--steps", "3", "--lr", "1e-2"]


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "autocast"])
def test_every_run_trains_and_the_json_holds_the_losses(tmp_path, capsys, autocast):
    out = tmp_path / "losses.json"
    assert bloom_drift.main(TINY + ["--out", str(out)] + (["--autocast"] if autocast else [])) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert list(data["losses"]) == list(bloom_drift.RUNS) and data["args"]["autocast"] is autocast
    for name, losses in data["losses"].items():
        assert len(losses) == 3 and losses[-1] < losses[0], (name, losses)
        assert name in printed
    ref = data["losses"]["eager_fp32"]
    for name in ("eager_bf16", "fused_bf16"):   # (bf16 rounding, not another model)
        assert max(abs(x - r) for x, r in zip(data["losses"][name], ref)) < 0.05 * ref[0]


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps: expected at least 1"),
    (["--runs", "eager_bf16"], "eager_fp32 is the reference"),
    (["--runs", "eager_fp32,fast"], "--runs: unknown ['fast']"),
    (["--out", "/nonexistent-folder/x.json"], "--out: the folder of"),
])
def test_bad_arguments_are_refused_before_any_run(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        bloom_drift.main(args)
    assert e.value.code == 2 and message in capsys.readouterr().err
