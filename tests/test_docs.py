"""The documentation's checkable claims against the code: README.md, docs/architecture.md, docs/porting-proposal.md
and the dispatcher's module docstring (a review found each of these out of date: the environment-variable table of
docs/architecture.md, its tuning ops and layer table, the small-problem rule's ops, the kernels of our own, the CUDA
13 default architectures, which entry point has no fake implementation, the kernel ids of the porting proposal)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
ARCH = REPO / "docs" / "architecture.md"
PROPOSAL = REPO / "docs" / "porting-proposal.md"

_BACKTICKED = re.compile(r"`{1,2}([^`]+?)`{1,2}")
_VAR = re.compile(r"PIPEGOOSE_[A-Z0-9_]*[A-Z0-9]")


def _section(text: str, heading: str) -> str:
    """The text of a markdown section, from its heading to the next heading of any level."""
    start = text.index(heading + "\n")
    rest = text[start + len(heading) + 1:]
    m = re.search(r"^#{1,6} ", rest, flags=re.M)
    return rest[:m.start()] if m else rest


def _table_rows(section: str) -> list[list[str]]:
    """The cells of each body row of the first markdown table of ``section``."""
    rows, seen_table = [], False
    for line in section.splitlines():
        if line.startswith("|"):
            seen_table = True
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if set("".join(cells)) <= set("-: "):
                continue
            rows.append(cells)
        elif seen_table:
            break
    return rows[1:]   # (the header)


def _sentence(text: str, at: int) -> str:
    """The sentence around position ``at``: from the end of the one before (a period followed by white space) to its
    own end (the same, or the end of the text)."""
    ends = [m.end() for m in re.finditer(r"\.\s", text[:at])]
    m = re.compile(r"\.(\s|$)").search(text, at)
    return text[ends[-1] if ends else 0:m.start() if m else len(text)]


def _fusion_ops() -> dict[str, dict]:
    """The dispatcher's built-in ops and their implementations (ops tests register and forget are left out)."""
    from pipegoose.nn.fusion import dispatch

    dispatch._ensure_builtin_ops()
    out = {}
    for op in sorted(dispatch._impls):
        impls = dispatch.implementations(op)
        if all(getattr(im.supports, "__module__", "").startswith("pipegoose.") for im in impls.values()):
            out[op] = impls
    return out


# ----------------------------------------------------------------------------------------- environment variables


@pytest.mark.parametrize("doc", [README, ARCH], ids=lambda p: p.name)
def test_every_known_variable_has_a_row_in_the_environment_table(doc):
    """Every name of ``pipegoose._env.KNOWN`` is in the first column of the document's "Environment variables" table
    (``PIPEGOOSE_IMPL_*`` names through the ``PIPEGOOSE_IMPL_<OP>`` row), and the table names no variable pipegoose
    does not read. docs/architecture.md lacked PIPEGOOSE_ALLOW_MODIFIED_VENDOR, PIPEGOOSE_MANIFEST,
    PIPEGOOSE_PORT_CACHE and the seven PIPEGOOSE_NORM_* research switches (a review)."""
    from pipegoose import _env

    rows = _table_rows(_section(doc.read_text(encoding="utf-8"), "## Environment variables"))
    first = " ".join(r[0] for r in rows)
    named = set(_VAR.findall(first))
    assert "PIPEGOOSE_IMPL_<OP>" in first, f"{doc.name}: no PIPEGOOSE_IMPL_<OP> row"
    missing = sorted(n for n in _env.KNOWN if n not in named and not n.startswith("PIPEGOOSE_IMPL_"))
    assert missing == [], f"{doc.name}'s environment table lacks {missing}"
    unknown = sorted(n for n in named if n not in _env.KNOWN and not n.startswith("PIPEGOOSE_IMPL"))
    assert unknown == [], f"{doc.name}'s environment table names variables pipegoose does not read: {unknown}"


@pytest.mark.parametrize("doc", [README, ARCH], ids=lambda p: p.name)
def test_the_impl_variable_row_names_every_implementation(doc):
    """The ``PIPEGOOSE_IMPL_<OP>`` row lists every implementation name an op has (docs/architecture.md left out
    ``torch_fused``, which ``PIPEGOOSE_IMPL_ADAM`` takes; a review), and ``auto``."""
    rows = _table_rows(_section(doc.read_text(encoding="utf-8"), "## Environment variables"))
    row = next(" ".join(r) for r in rows if "PIPEGOOSE_IMPL_<OP>" in r[0])
    listed = set(_BACKTICKED.findall(row))
    names = {name for impls in _fusion_ops().values() for name in impls} | {"auto"}
    assert sorted(names - listed) == [], f"{doc.name}'s PIPEGOOSE_IMPL_<OP> row"


# ------------------------------------------------------------------------------------------------ dispatcher


def test_the_tuning_ops_list_is_what_the_table_parser_accepts():
    """docs/architecture.md's tuning "Ops:" list is the ops ``TuningTable.parse`` accepts, each accepted (it left out
    ``fused_linear_cross_entropy``; a review)."""
    from pipegoose.nn.fusion import dispatch

    text = _section(ARCH.read_text(encoding="utf-8"), "## Tuning tables (benchmarks -> dispatch)")
    i = text.index("\nOps: ")
    sentence = re.sub(r"\([^)]*\)", "", _sentence(text, i))   # ("(`max_cols` bounds the head dim)")
    listed = set(_BACKTICKED.findall(sentence))
    accepted = set(_fusion_ops()) | set(dispatch._TABLE_ONLY_OPS)
    assert listed == accepted
    for op in sorted(listed):
        impl = "pipegoose"
        dispatch.TuningTable.parse({"device": "X", "rules": [{"op": op, "dtype": "bfloat16", "impl": impl}]})


def _small_first_ops() -> set[str]:
    return {op for op, impls in _fusion_ops().items() if any(im.small_first for im in impls.values())}


def _small_first_mentions() -> list[tuple[str, str]]:
    """(where, the sentence) of each place that lists the small-problem rule's ops."""
    from pipegoose.nn.fusion import dispatch

    out = []
    arch = ARCH.read_text(encoding="utf-8")
    i = arch.index("\nSmall problems: ")
    out.append(("docs/architecture.md, Small problems", _sentence(arch, arch.index("small_first", i))))
    rows = _table_rows(_section(README.read_text(encoding="utf-8"), "## Environment variables"))
    row = next(r[1] for r in rows if r[0] == "`PIPEGOOSE_SMALL_NUMEL`")
    out.append(("README.md, PIPEGOOSE_SMALL_NUMEL", _sentence(row, row.index("small_first"))))
    doc = dispatch.__doc__
    i = doc.index("\n5. before 3 and 4, small problems")
    out.append(("the dispatch module docstring, choice step 5", _sentence(doc, doc.index("small_first", i))))
    return out


def test_the_small_problem_rule_names_the_ops_it_applies_to():
    """README.md, docs/architecture.md and the dispatcher's docstring said the small-problem rule applies only where
    the reference is one native op (F.layer_norm, F.rms_norm); swiglu's reference is registered ``small_first`` too
    (a review). Each names, in the sentence that mentions ``small_first``, exactly the ops that have one."""
    want = _small_first_ops()
    assert {"layer_norm", "rms_norm", "swiglu"} <= want
    for where, sentence in _small_first_mentions():
        named = {t for t in _BACKTICKED.findall(sentence) if t in _fusion_ops()}
        assert named == want, f"{where}: names {sorted(named)}, the small_first ops are {sorted(want)}: {sentence!r}"


def test_the_dispatch_docstring_lists_every_op():
    """The dispatcher's docstring opens with its ops: every registered one."""
    from pipegoose.nn.fusion import dispatch

    first = dispatch.__doc__[:dispatch.__doc__.index(") has several")]
    named = set(_BACKTICKED.findall(first))
    assert sorted(set(_fusion_ops()) - named) == []
