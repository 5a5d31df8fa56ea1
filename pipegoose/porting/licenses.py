"""Recognise the license a license file carries, to check it against the source's declared SPDX id.

The check is deliberately simple (distinctive phrases of each license text); it exists to stop a port whose
license file is missing, is something else than declared, or is a license outside ``ALLOWED_LICENSES``.
"""

from __future__ import annotations

import re

__all__ = ["detect_licenses", "DISALLOWED_MARKERS"]

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
