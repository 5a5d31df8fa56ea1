"""The transitive ``#include`` closure of a kernel's files inside its source, to check that kernels.yaml
lists every header a kernel needs (a missing one only shows up as a compile error on the GPU machine), and whether
the files declare an entry symbol (:func:`symbol_defined`, for ``add`` and ``audit``)."""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import Iterable

from .fetch import SourceTree
from .util import safe_member_path

__all__ = ["include_closure", "missing_headers", "symbol_defined"]

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"]+)[>"]', re.M)
_BLOCK_COMMENT = re.compile(r"/\*.*?\*/", re.S)


def _includes(text: str) -> list[tuple[str, str]]:
    text = _BLOCK_COMMENT.sub("", text)
    return [(m.group(1), m.group(2).strip()) for m in _INCLUDE.finditer(text)]


def _resolve(tree: SourceTree, including: str, kind: str, name: str, include_dirs: Iterable[str]) -> str | None:
    candidates = []
    if kind == '"':
        candidates.append(str(PurePosixPath(including).parent / name))
    candidates += [str(PurePosixPath(d) / name) for d in include_dirs]
    for c in candidates:
        rel = safe_member_path(c)
        if rel is not None and tree.has(rel):
            return rel
    return None


def include_closure(tree: SourceTree, files: Iterable[str], include_dirs: Iterable[str]) -> dict[str, str]:
    """Every source file reached from ``files`` through ``#include`` (quoted: the including file's folder, then
    ``include_dirs``; angled: ``include_dirs``), mapped to the file that first included it. Headers not found
    in the source (system, CUDA, torch) are ignored."""
    include_dirs = list(include_dirs)
    seen: dict[str, str] = {f: "" for f in files}
    todo = [f for f in files if tree.has(f)]
    while todo:
        f = todo.pop()
        text = tree.read(f).decode("utf-8", "replace")
        for kind, name in _includes(text):
            r = _resolve(tree, f, kind, name, include_dirs)
            if r is not None and r not in seen:
                seen[r] = f
                todo.append(r)
    return seen


def missing_headers(tree: SourceTree, files: Iterable[str], include_dirs: Iterable[str]) -> dict[str, str]:
    """Headers in the closure that are not in ``files``: {header: file that includes it}."""
    files = list(files)
    closure = include_closure(tree, files, include_dirs)
    return {h: by for h, by in sorted(closure.items()) if h not in files}


def symbol_defined(symbol: str, text: str) -> bool:
    """True if ``text`` (C/C++/CUDA) declares or defines a function ``symbol``: a return type (possibly
    templated or qualified) then the name then ``(`` at the start of a statement. Calls do not count."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    pat = re.compile(r"(?:^|[;{}])\s*(?:template\s*<[^;{}]*>\s*)?"
                     r"(?!return\b)(?:[A-Za-z_][\w:]*(?:\s*<[^;{}()]*>)?[\s*&]+)+"
                     + re.escape(symbol) + r"\s*\(", re.M)
    return bool(pat.search(text))
