"""The end-to-end correctness gate (benchmarks/e2e.py's _check_losses) and how the reports show it, on fake rows."""

import _bench_path  # noqa: F401
import pytest

from benchmarks.e2e import _check_losses
from benchmarks.report import summary_lines, write_markdown


def row(variant, status="ok", losses=(10.0, 9.0), model="llama"):
    r = {"model": model, "variant": variant, "status": status, "batch": 4, "seq": 2048}
    if status == "ok":
        r.update(tokens_per_s=1000.0, step_ms=1.0, losses=list(losses) if losses is not None else None)
    return r


def test_losses_off_sdpas_fail_and_close_ones_pass():
    rows = [row("sdpa"), row("fuse_sdpa", losses=(10.05, 9.1)), row("eager", losses=(10.0, 9.5))]
    _check_losses(rows)
    assert [r["status"] for r in rows] == ["ok", "ok", "FAILED"]
    assert not rows[1].get("detail") and rows[2]["detail"] == "last loss 9.5000 vs sdpa 9.0000"


@pytest.mark.parametrize("sdpa, why", [(None, "no ok sdpa run (sdpa not run)"),
                                       ("oom", "no ok sdpa run (sdpa oom)"),
                                       ("timeout", "no ok sdpa run (sdpa timeout)"),
                                       ("error", "no ok sdpa run (sdpa error)")])
def test_rows_without_an_ok_sdpa_run_say_their_loss_was_not_compared(tmp_path, sdpa, why):
    """A review: with --e2e-variants fuse_sdpa (no sdpa row), or an sdpa row that ran out of memory, timed out or
    crashed, the other variants stayed ok without a comparison and without a word."""
    rows = ([row("sdpa", sdpa)] if sdpa else []) + [row("fuse_sdpa", losses=(50.0, 1.0)), row("eager", "oom"),
                                                    row("sdpa", model="neox"), row("fuse_sdpa", model="neox")]
    _check_losses(rows)
    fuse, eager, neox_sdpa, neox_fuse = rows[-4:]
    assert fuse["status"] == "ok" and fuse["detail"] == f"loss not compared: {why}"
    assert eager["status"] == "oom" and not eager.get("detail")       # not measured: nothing to compare
    assert not neox_sdpa.get("detail") and not neox_fuse.get("detail")  # the other model's gate ran
    # the reports show it: results.md's note column and the summary line
    md = write_markdown(tmp_path / "results.md", {"gpu": "G", "date": "2026-12-01"}, {}, None, [], rows).read_text()
    assert "| llama | fuse_sdpa |" in md and f"loss not compared: {why} |" in md
    line = next(x for x in summary_lines([], None, rows) if "llama" in x and "fuse_sdpa" in x)
    assert "1000 tok/s" in line and f"[loss not compared: {why}]" in line


def test_an_ok_row_without_losses_says_so_and_keeps_its_detail():
    rows = [row("sdpa"), row("fuse_sdpa", losses=None)]
    rows[1]["detail"] = "run 2026-12-01: timeout"
    _check_losses(rows)
    assert rows[1]["status"] == "ok"
    assert rows[1]["detail"] == "run 2026-12-01: timeout; loss not compared: no losses recorded for this run"
