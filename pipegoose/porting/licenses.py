"""Recognise the license a license file carries, to check it against the source's declared SPDX id.

The check is deliberately simple (distinctive phrases of each license text); it exists to stop a port whose
license file is missing, is something else than declared, or is a license outside ``ALLOWED_LICENSES``.
"""

from __future__ import annotations

import re

__all__ = ["detect_licenses", "primary_license", "file_license_problem", "DISALLOWED_FAMILIES"]

_WS = re.compile(r"\s+")

# (SPDX id, phrases that must all occur, case-insensitive, whitespace-normalised)
_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Apache-2.0", ("apache license", "version 2.0")),
    ("MIT", ("permission is hereby granted, free of charge",)),
    ("BSD-3-Clause", ("redistribution and use in source and binary forms", "neither the name")),
    ("BSD-2-Clause", ("redistribution and use in source and binary forms",)),
)

# Licenses that must never enter vendor/, one row per family: its name (GPL: the GNU family, LGPL and AGPL included),
# the names its license texts go by and its short ids (regexes; None: none), matched in lower-case text with whitespace
# collapsed. Both checks read this table: a license file (detect_licenses) is refused when a text name occurs anywhere
# in it; a source file's header (file_license_problem) when a text name or a short id occurs in a sentence that grants
# or restricts a license. Short ids are not looked for anywhere in a license file: permissive texts mention them (the
# LLVM exception to Apache-2.0 speaks of "software that is licensed under the GPLv2").
DISALLOWED_FAMILIES: tuple[tuple[str, str, str | None], ...] = (
    ("GPL", r"\bgnu (?:affero |lesser |library )?general public licen[cs]e", r"\b[al]?gpl(?:v?\d|-\d|\b)"),
    ("non-commercial", r"\bnon[- ]?commercial|\bby-nc\b", None),
    ("MPL", r"\bmozilla public licen[cs]e", r"\bmpl-?\d"),
)
_IN_LICENSE_FILES = tuple((fam, re.compile(names)) for fam, names, _ in DISALLOWED_FAMILIES)
_IN_HEADERS = tuple((fam, re.compile(names + (f"|{ids}" if ids else ""))) for fam, names, ids in DISALLOWED_FAMILIES)


def _norm(text: str) -> str:
    return _WS.sub(" ", text).lower()


def detect_licenses(text: str) -> tuple[set[str], set[str]]:
    """Return (allowed SPDX ids recognised, disallowed license families recognised) in ``text``, the contents of one or
    more license files. A family of ``DISALLOWED_FAMILIES`` is recognised by a text name anywhere in it (in a combined
    file too, where a bundled project's license follows the project's own). Raises nothing."""
    t = _norm(text)
    found = {spdx for spdx, phrases in _MARKERS if all(p in t for p in phrases)}
    bad = {fam for fam, pat in _IN_LICENSE_FILES if pat.search(t)}
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


_SPDX = re.compile(r"SPDX-License-Identifier:[ \t]*([^\n]*)")
_HEADER = 16384  # characters of a source file read for its license header
# what starts a comment line: its marker is not part of the text (a notice wraps across "//" or " * " lines)
_COMMENT_MARK = re.compile(r"^[ \t]*(?:/\*+|\*+/?|//+|#+|<!--|-->|;+|--|!)?[ \t]?")
_SPDX_TOKEN = re.compile(r"\(|\)|[A-Za-z0-9.+\-:]+")
_SPDX_OPS = {"AND", "OR", "WITH"}
# the cues of a sentence that grants or restricts a license (a mention of the GPL in a note on compatibility is not a
# grant)
_GRANT = re.compile(r"licensed under|license[ds]? to you|distributed under|released under|under the terms of|subject to the terms|"
                    r"is free software|redistribute it|licen[cs]e:|use only|only for|only be used")
_ALLOWED_NAMES = re.compile(r"\bmit\b|\bapache\b|\bbsd\b")


def _comment_free(text: str) -> str:
    """``text`` without the comment markers that start its lines, whitespace collapsed, lower case."""
    return _norm("\n".join(_COMMENT_MARK.sub("", line, count=1) for line in text.splitlines()))


def _spdx_ids(expr: str) -> tuple[list[str], bool] | None:
    """The license ids of an SPDX expression (what follows ``SPDX-License-Identifier:`` up to the first word that is no
    id, operator or parenthesis, so ``MIT see LICENSE`` is ``MIT``; exceptions after ``WITH`` dropped) and whether it
    is a choice (``A OR B``); None when there is none."""
    ids, either, prev_id, skip = [], False, False, False
    for tok in _SPDX_TOKEN.findall(expr):
        up = tok.upper()
        if up in _SPDX_OPS:
            either = either or up == "OR"
            skip, prev_id = up == "WITH", False
        elif tok in "()":
            if tok == "(" and prev_id:
                break                      # "Apache-2.0 (see LICENSE)": the comment after the id
            continue
        elif prev_id:
            break                          # an id right after an id: the expression ended
        else:
            if not skip:
                ids.append(tok)
            skip, prev_id = False, True
    return (ids, either) if ids else None


def file_license_problem(text: str, allowed: tuple[str, ...]) -> str | None:
    """Why a vendored source file may not be taken, from its own header (None when nothing says so). A best-effort
    check of the first 16 KB: an ``SPDX-License-Identifier`` decides when there is one (its ids must be allowed; for
    ``A OR B`` one of them); without one, a sentence that grants or restricts a license and names a family of
    ``DISALLOWED_FAMILIES`` (copyleft, Mozilla or non-commercial; comment markers and line breaks removed, so a
    wrapped notice is found) stops it, unless the same sentence offers an allowed license as the alternative.
    ``text`` is the file's contents, ``allowed`` the allowed SPDX ids. Raises nothing."""
    head = text[:_HEADER]
    exprs = [e for e in (_spdx_ids(m) for m in _SPDX.findall(head)) if e is not None]
    if exprs:
        for ids, either in exprs:
            ok = any(i in allowed for i in ids) if either else all(i in allowed for i in ids)
            if not ok:
                return f"its SPDX-License-Identifier names {' or '.join(ids) if either else ', '.join(ids)} " \
                       f"(allowed: {', '.join(allowed)})"
        return None
    for sentence in re.split(r"(?<=[.;])\s+", _comment_free(head)):
        if not _GRANT.search(sentence):
            continue
        for fam, pat in _IN_HEADERS:
            if pat.search(sentence) and not (" or " in sentence and _ALLOWED_NAMES.search(sentence)):
                return f"its header grants or restricts it under a {fam} license: \"{sentence[:160]}\""
    return None
