"""pipegoose._table.print_table, the tables of `python -m pipegoose.kernels doctor` and `tools/port.py list / audit`:
every line within the width, words kept whole where they fit."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from pipegoose._table import print_table

LONG_ID = "megatron/scaled_upper_triang_masked_softmax"   # 43 characters
LONG_PATH = "extensions/csrc/kernel/cuda/scaled_upper_triang_masked_softmax_kernel.cu"   # 73


def render(width: int, header, rows, **kw) -> list[str]:
    buf = io.StringIO()
    print_table(Console(file=buf, width=width, force_terminal=False, color_system=None), "title", header, rows, **kw)
    return buf.getvalue().splitlines()


@pytest.mark.parametrize("width", [40, 60, 80, 120])
def test_list_lines_fit_the_width(width):
    # (a review: the list layout printed its first line unwrapped, 126 characters for port.py audit's files of
    # ColossalAI at every width up to 120)
    out = render(width, ("kernel", "file", "status"), [(LONG_ID, LONG_PATH, "changed"), ("up/a", "a.cu", "moved")],
                 whole=(0, 2), head=(0, 1, 2))
    assert max(len(line) for line in out) <= width, "\n".join(out)
    words = {w for line in out for w in line.replace("│", " ").split()}
    assert "changed" in words and "up/a" in words, "\n".join(out)
    assert (LONG_ID in words) == (width >= len(LONG_ID)), "\n".join(out)   # (folded only where it cannot fit)


def test_table_keeps_words_whole():
    # the folding columns are sized to their longest word (rich folded "csrc/kernels/gamma.cu" mid-word at 60)
    rows = [("up/alpha", "1 changed, 1 unchanged", "1/1", "csrc/kernels/gamma.cu"),
            ("up/beta", "1 moved, 2 unchanged", "1/1", "csrc/kernels/gamma.cu, csrc/kernels/delta.cu")]
    out = render(60, ("kernel", "files", "entry symbols", "new upstream files beside"), rows, whole=(0,), head=(0, 1))
    assert out[1].startswith("┏"), "\n".join(out)   # a table
    assert max(len(line) for line in out) <= 60, "\n".join(out)
    words = {w.strip(",") for line in out for w in line.replace("│", " ").split()}
    assert {"csrc/kernels/gamma.cu", "csrc/kernels/delta.cu", "unchanged"} <= words, "\n".join(out)


def test_words_past_the_cap_do_not_force_the_list():
    # words longer than _WORD_MAX (a kernel alias, a cache path) fold in the table rather than turn it into a list (a
    # review: doctor's kernel table became a list at 104-130 columns)
    rows = [("pipegoose/layer_norm", "ok", "scaled_upper_triang_masked_softmax, causal",
             f"built: /root/.cache/pipegoose/kernels/{'x' * 40}/lib.so")]
    out = render(95, ("kernel", "state", "aliases", "detail"), rows, whole=(0, 1), head=(0, 1))
    assert out[1].startswith("┏") and max(len(line) for line in out) <= 95, "\n".join(out)
