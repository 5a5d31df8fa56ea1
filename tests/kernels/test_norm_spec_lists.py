"""The norm backward's specialised widths, written in ``norm_kernels.cuh`` (``Sizes<...>`` lists), in the GPU tests
(``kernel_helpers.NORM_SPEC_*``) and in the sanitizer run (``tools/sanitize_kernels.py``): the same lists (CPU only;
the GPU test ``test_backward_specialisations_are_taken_where_listed`` checks which kernel each width runs). The
sanitizer's other case lists: the norms' parameter cases, silu_and_mul's launch paths."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from kernel_helpers import (NORM_PCACHE16_LN, NORM_PCACHE16_RMS, NORM_PCACHE32_LN, NORM_PCACHE32_RMS, NORM_SPEC_EXTRA,
                            NORM_SPEC_HIDDEN)

ROOT = Path(__file__).resolve().parents[2]
HEADER = ROOT / "pipegoose" / "kernels" / "csrc" / "norm_kernels.cuh"


def strip_comments(text: str) -> str:
    """``text`` without C++ comments (``//`` to the line's end, ``/* ... */``)."""
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)


def header_lists(text: str) -> dict[str, tuple[int, ...]]:
    """``using NAME = Sizes<...>;`` of ``text`` (comments left out): the non-empty definition of each name (the empty
    ones are the branches of -DPIPEGOOSE_NORM_NO_SPEC* and of experiments that are off in the shipped build). Raises
    AssertionError if a name has two non-empty definitions."""
    found: dict[str, tuple[int, ...]] = {}
    for name, body in re.findall(r"using\s+(\w+)\s*=\s*Sizes<([^>]*)>\s*;", strip_comments(text)):
        if not body.strip():
            continue
        assert name not in found, f"{name}: two non-empty definitions in {HEADER.name}"
        found[name] = tuple(int(v) for v in body.split(","))
    return found


@pytest.fixture(scope="module")
def lists():
    return header_lists(HEADER.read_text())


def test_header_lists_parse():
    text = "using A = Sizes<>;\nusing A =\n    Sizes<1, 2,\n 3>;\nusing B = Sizes<4>;"
    assert header_lists(text) == {"A": (1, 2, 3), "B": (4,)}
    with pytest.raises(AssertionError, match="two non-empty"):
        header_lists("using A = Sizes<1>; using A = Sizes<2>;")
    # comments: a list written in one, or one inside a list, is not read (review)
    assert header_lists("// using A = Sizes<9>;\nusing A = Sizes<1, // one\n 2>; /* using A = Sizes<3>; */") == \
        {"A": (1, 2)}


def test_tests_use_the_header_lists(lists):
    assert lists["BwdSpecHidden"] == NORM_SPEC_HIDDEN
    assert lists["BwdSpec16Ln"] == NORM_SPEC_EXTRA[16]["layer_norm"]
    assert lists["BwdSpec16Rms"] == NORM_SPEC_EXTRA[16]["rms_norm"]
    assert lists["BwdSpec32Ln"] == NORM_SPEC_EXTRA[32]["layer_norm"]
    assert lists["BwdSpec32Rms"] == NORM_SPEC_EXTRA[32]["rms_norm"]
    assert lists["BwdPcache16Ln"] == NORM_PCACHE16_LN
    assert lists["BwdPcache16Rms"] == NORM_PCACHE16_RMS
    assert lists["BwdPcache32Ln"] == NORM_PCACHE32_LN
    assert lists["BwdPcache32Rms"] == NORM_PCACHE32_RMS


def test_pcache_reads_its_list():
    # the shipped branch of bwd_async_pcache takes its widths from the BwdPcache lists (a review: going back to
    # literal widths there left every test of the lists passing)
    text = strip_comments(HEADER.read_text())
    body = text[text.index("constexpr bool bwd_async_pcache("):]
    shipped = body[body.index("#else"):body.index("#endif")]
    assert "has_size(BwdPcache16Ln{}, hc)" in shipped and "has_size(BwdPcache16Rms{}, hc)" in shipped, shipped
    assert "(rms ? has_size(BwdPcache32Rms{}, hc) : has_size(BwdPcache32Ln{}, hc))" in shipped, shipped


def test_pcache_widths_are_specialised(lists):
    # bwd_async_pcache's list names kernels specialised to the width: a width in no specialisation list is dead
    spec16_ln = set(lists["BwdSpecHidden"]) | set(lists["BwdSpec16Ln"])
    assert set(lists["BwdPcache16Ln"]) <= spec16_ln
    assert set(lists["BwdPcache16Rms"]) <= set(lists["BwdSpecHidden"]) | set(lists["BwdSpec16Rms"])
    assert set(lists["BwdPcache32Ln"]) <= set(lists["BwdSpecHidden"]) | set(lists["BwdSpec32Ln"])
    assert set(lists["BwdPcache32Rms"]) <= set(lists["BwdSpecHidden"]) | set(lists["BwdSpec32Rms"])


def test_sanitizer_reaches_every_specialised_width(lists):
    spec = importlib.util.spec_from_file_location("sanitize_kernels", ROOT / "tools" / "sanitize_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    extra = {h for name in ("BwdSpec16Ln", "BwdSpec16Rms", "BwdSpec32Ln", "BwdSpec32Rms") for h in lists[name]}
    assert extra | set(lists["BwdSpecHidden"]) <= set(mod.NORM_HIDDEN)
    # the specialised kernels walk several rows per row group only with enough rows
    assert extra <= set(mod.NORM_MANY_ROWS)
    assert set(mod.NORM_MANY_ROWS) <= set(mod.NORM_HIDDEN)


def _sanitizer_module():
    spec = importlib.util.spec_from_file_location("sanitize_kernels", ROOT / "tools" / "sanitize_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sanitizer_runs_the_norms_backward_with_frozen_parameters():
    """A review: the parameter cases (w, b), (None, None), (None, b) never reached the backward with a weight but no
    weight gradient wanted (weight_grad / bias_grad false: a frozen parameter), nor LayerNorm with one of its two
    parameter gradients wanted, nor a weight alone."""
    mod = _sanitizer_module()
    ln = set(mod.LN_PARAM_CASES)   # (weight given, bias given, weight_grad, bias_grad)
    assert {(True, True, True, True), (False, False, True, True), (False, True, True, True)} <= ln   # as before
    assert {(True, True, False, False), (True, True, False, True), (True, True, True, False)} <= ln  # frozen
    assert {(True, False, True, True), (True, False, False, True), (False, True, True, False)} <= ln  # one alone
    assert len(ln) == len(mod.LN_PARAM_CASES)
    assert set(mod.RMS_PARAM_CASES) == {(True, True), (False, True), (True, False)}


def test_sanitizer_runs_silu_and_mul_on_every_launch_path():
    """SILU_AND_MUL_CASES (rows, d, column offset, extra columns; 16-byte vectors of 4 fp32 or 8 16-bit values) reach
    each path of silu_and_mul's launch in every dtype: the vector kernel (d a multiple of 8, x aligned, contiguous or in
    rows of a multiple of 8 values) and the scalar one for odd d, for a misaligned x (an odd column) and for an odd row
    stride of an aligned x; one row and several; a row longer than one block of threads (256, a thread a vector or value);
    and rows over many blocks whose last block is partial, in the scalar kernel."""
    cases = _sanitizer_module().SILU_AND_MUL_CASES

    def vectors(rows, d, offset, extra, v):   # (dispatch_silu_and_mul's rule)
        return d % v == 0 and offset % v == 0 and (rows <= 1 or (2 * d + offset + extra) % v == 0)

    for v in (4, 8):
        paths = {vectors(*case, v) for case in cases}
        assert paths == {True, False}, v
        assert any(vectors(*c, v) and (c[2], c[3]) != (0, 0) for c in cases), "no strided x on the vector kernel"
    assert any(offset % 2 and d % 8 == 0 for _, d, offset, _ in cases), "no misaligned x of a d the vectors take"
    assert any(offset == 0 and d % 8 == 0 and (2 * d + extra) % 2 and rows > 1 for rows, d, offset, extra in cases), \
        "no aligned x of an odd row stride"
    assert any(d % 2 for _, d, _, _ in cases) and any(rows == 1 for rows, _, _, _ in cases)
    assert any(d // 8 > 256 for _, d, _, _ in cases), "no row over several blocks of 256 threads"

    assert any(rows * d > 1000 * 256 and rows * d % 256 and d % 4 for rows, d, _, _ in cases), \
        "no case of the scalar kernel over many blocks with a partial last one"


def test_sanitizer_checks_its_arguments_before_the_gpu():
    """The tool runs under compute-sanitizer on a GPU; its arguments are checked first (on a CPU too)."""
    import subprocess
    import sys

    tool = str(ROOT / "tools" / "sanitize_kernels.py")
    for argv, code, said in ((["norms", "5"], 1, "norms: expected hidden sizes among"),
                             (["norms", "x"], 1, "norms: expected hidden sizes (integers), got 'x'"),
                             (["adam", "long"], 1, "expected 'norms' [HIDDEN ...], 'softmax' [long]"),
                             (["--help"], 0, "LN_PARAM_CASES")):
        p = subprocess.run([sys.executable, tool, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert p.returncode == code and said in p.stdout + p.stderr, (argv, p.returncode, p.stderr[-500:])
