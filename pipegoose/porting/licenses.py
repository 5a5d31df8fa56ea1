"""Recognise the license a license file carries, to check it against the source's declared SPDX id.

The check is deliberately simple (distinctive phrases of each license text); it exists to stop a port whose
license file is missing, is something else than declared, or is a license outside ``ALLOWED_LICENSES``.
"""

from __future__ import annotations

import re

__all__ = ["detect_licenses", "primary_license", "file_license_problem", "DISALLOWED_MARKERS"]

_WS = re.compile(r"\s+")

# (SPDX id, phrases that must all occur, case-insensitive, whitespace-normalised)
_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Apache-2.0", ("apache license", "version 2.0")),
    ("MIT", ("permission is hereby granted, free of charge",)),
    ("BSD-3-Clause", ("redistribution and use in source and binary forms", "neither the name")),
    ("BSD-2-Clause", ("redistribution and use in source and binary forms",)),
)

# Licenses that must never enter vendor/ (copyleft or non-commercial), recognised by phrase.
DISALLOWED_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("AGPL", ("gnu affero general public license",)),
    ("LGPL", ("gnu lesser general public license",)),
    ("GPL", ("gnu general public license",)),
    ("CC-BY-NC", ("noncommercial",)),
)


def _norm(text: str) -> str:
    return _WS.sub(" ", text).lower()


def detect_licenses(text: str) -> tuple[set[str], set[str]]:
    """Return (allowed SPDX ids recognised, disallowed license families recognised) in a license text."""
    t = _norm(text)
    found = {spdx for spdx, phrases in _MARKERS if all(p in t for p in phrases)}
    bad = set()
    for fam, phrases in DISALLOWED_MARKERS:
        if all(p in t for p in phrases):
            if fam == "GPL" and ("gnu lesser general public license" in t or "gnu affero" in t):
                continue
            bad.add(fam)
    return found, bad


# Where each license's text begins (its first distinctive phrase), for primary_license.
_STARTS: tuple[tuple[str, str], ...] = (
    ("Apache-2.0", "apache license"),
    ("MIT", "permission is hereby granted, free of charge"),
    ("BSD", "redistribution and use in source and binary forms"),
)
_BSD3_CLAUSE = "neither the name"
_BSD_BLOCK = 2000  # characters after a BSD text's first phrase that hold its clauses


def primary_license(text: str) -> str | None:
    """The SPDX id of the license whose text comes first in a license file (the project's own: a combined file such
    as ColossalAI's LICENSE lists the licenses of bundled projects after it), or None when none is recognised. A BSD
    text is BSD-3-Clause when its "neither the name" clause follows within its block, else BSD-2-Clause."""
    t = _norm(text)
    hits = [(t.find(phrase), spdx) for spdx, phrase in _STARTS if phrase in t]
    if not hits:
        return None
    pos, spdx = min(hits)
    if spdx == "BSD":
        return "BSD-3-Clause" if _BSD3_CLAUSE in t[pos:pos + _BSD_BLOCK] else "BSD-2-Clause"
    return spdx


_SPDX = re.compile(r"SPDX-License-Identifier:\s*([A-Za-z0-9.+\-() ]+)")
_HEADER = 16384  # characters of a source file read for its license header


def file_license_problem(text: str, allowed: tuple[str, ...]) -> str | None:
    """Why a vendored source file may not be taken, from its own header (None when nothing says so): an
    ``SPDX-License-Identifier`` naming no allowed license (``A OR B`` passes when one of them is allowed), or the
    text of a copyleft / non-commercial license (a file of another license bundled in a permissive project)."""
    head = text[:_HEADER]
    for expr in _SPDX.findall(head):
        # an exception (``WITH LLVM-exception``) adds permissions: the license before it is what counts
        bare = re.sub(r"\s+WITH\s+[A-Za-z0-9.+\-]+", "", expr.strip())
        ids = [i for i in re.split(r"\s+(?:OR|AND)\s+|[()\s]+", bare) if i]
        either = " OR " in expr and " AND " not in expr
        ok = any(i in allowed for i in ids) if either else all(i in allowed for i in ids)
        if not ok:
            return f"its SPDX-License-Identifier is {expr.strip()} (allowed: {', '.join(allowed)})"
    _, bad = detect_licenses(head)
    if bad:
        return f"its header carries {', '.join(sorted(bad))} text"
    return None
