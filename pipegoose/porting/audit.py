"""Compare vendored kernels with a newer upstream (``audit``) and move a source to a new pin (``update``).

Per kernel and vendored file: unchanged / changed (+lines/-lines, optional unified diff) / moved (a file of the
same name elsewhere in the new upstream) / removed / added (a path of kernels.yaml found at the new pin only: the
manifest was edited to follow a move). Per source: license files unchanged / changed / removed.
Per entry symbol of the manifest: present before and after (a C/C++ function definition or declaration
named so, found by regular expression). New upstream files in the folders of the vendored ones are listed.

Exit codes (``tools/port.py audit``): 0 in sync, 1 drift (a file changed/moved/removed/added, a license changed or
an entry symbol vanished or is not found), 2 error (fetch failure, unknown id). New files beside the vendored ones are
reported but are not drift by themselves.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Iterable

import yaml
from packaging.version import InvalidVersion, Version

from ..kernels.manifest import ManifestError, Source
from .errors import PortError
from .fetch import SourceTree
from .includes import symbol_defined
from .lock import LockedSource
from .porter import Porter
from .util import short_pin

__all__ = ["FileAudit", "SymbolAudit", "KernelAudit", "SourceAudit", "AuditReport", "audit", "update",
           "symbol_defined", "edit_source_pin"]


@dataclass
class FileAudit:
    path: str
    status: str  # unchanged | changed | moved | removed | added (listed in kernels.yaml, at the new pin only)
    added: int = 0
    deleted: int = 0
    moved_to: list[str] = field(default_factory=list)
    diff: str = ""


@dataclass
class SymbolAudit:
    symbol: str
    op: str
    before: bool
    after: bool


@dataclass
class KernelAudit:
    kernel: str
    files: list[FileAudit]
    symbols: list[SymbolAudit]
    new_files: list[str]

    @property
    def drift(self) -> bool:
        # a symbol missing at the target counts even if it was missing before (a misspelt entry: audit said "in sync;
        # entry symbols present 9/10" and exited 0, a walkthrough's finding)
        return any(f.status != "unchanged" for f in self.files) or any(not s.after for s in self.symbols)


@dataclass
class SourceAudit:
    source: str
    kind: str
    from_pin: dict[str, str]
    to_pin: dict[str, str]
    licenses: list[FileAudit] = field(default_factory=list)
    kernels: list[KernelAudit] = field(default_factory=list)
    error: str | None = None
    # why the compared sdist's bytes were checked against neither a pin nor the package index (``--offline``, a version
    # kernels.yaml does not pin: the download cache's file as it is), else ""
    unverified: str = ""

    @property
    def license_changed(self) -> bool:
        return any(f.status != "unchanged" for f in self.licenses)

    @property
    def drift(self) -> bool:
        return self.license_changed or any(k.drift for k in self.kernels)


@dataclass
class AuditReport:
    sources: list[SourceAudit]
    updated: bool = True  # update(): False when the source was already at the pin asked for (nothing changed)

    @property
    def exit_code(self) -> int:
        if any(s.error for s in self.sources):
            return 2
        return 1 if any(s.drift for s in self.sources) else 0

    def to_data(self, with_diff: bool = False) -> dict:
        def fa(f: FileAudit) -> dict:
            d = {"path": f.path, "status": f.status, "added": f.added, "deleted": f.deleted, "moved_to": f.moved_to}
            if with_diff:
                d["diff"] = f.diff
            return d

        return {
            "exit_code": self.exit_code,
            "sources": [{
                "source": s.source, "kind": s.kind, "from": s.from_pin, "to": s.to_pin, "error": s.error,
                "unverified": s.unverified or None,
                "drift": s.drift if not s.error else None, "license_changed": s.license_changed,
                "licenses": [fa(f) for f in s.licenses],
                "kernels": [{"kernel": k.kernel, "drift": k.drift, "files": [fa(f) for f in k.files],
                             "symbols": [dataclasses.asdict(x) for x in k.symbols], "new_files": k.new_files}
                            for k in s.kernels],
            } for s in self.sources],
        }

    def to_json(self, with_diff: bool = False) -> str:
        return json.dumps(self.to_data(with_diff), indent=2, sort_keys=True)


def _line_diff(path: str, a: bytes, b: bytes, want_diff: bool) -> tuple[int, int, str]:
    al = a.decode("utf-8", "replace").splitlines(keepends=True)
    bl = b.decode("utf-8", "replace").splitlines(keepends=True)
    plus = minus = 0
    lines = list(difflib.unified_diff(al, bl, f"a/{path}", f"b/{path}", n=3))
    for ln in lines:
        if ln.startswith("+") and not ln.startswith("+++"):
            plus += 1
        elif ln.startswith("-") and not ln.startswith("---"):
            minus += 1
    return plus, minus, "".join(lines) if want_diff else ""


def _compare(path: str, old: SourceTree, new: SourceTree, want_diff: bool) -> FileAudit:
    a = old.read(path)
    if new.has(path):
        b = new.read(path)
        if a == b:
            return FileAudit(path, "unchanged")
        plus, minus, d = _line_diff(path, a, b, want_diff)
        return FileAudit(path, "changed", plus, minus, diff=d)
    base = PurePosixPath(path).name
    cands = sorted(p for p in new.files() if PurePosixPath(p).name == base)
    if cands:
        # the most similar candidate first
        cands.sort(key=lambda p: -difflib.SequenceMatcher(None, a, new.read(p)).quick_ratio())
        plus, minus, d = _line_diff(path, a, new.read(cands[0]), want_diff)
        return FileAudit(path, "moved", plus, minus, moved_to=cands, diff=d)
    return FileAudit(path, "removed", 0, a.decode("utf-8", "replace").count("\n"))


def _new_pin(source: Source, to: str | None, latest: bool, porter: Porter) -> dict[str, str]:
    if to is None:
        return porter.fetcher.latest(source)  # --latest, and the default
    if source.kind != "pypi":
        return {"url": source.pin["url"], "commit": to}
    try:
        version = Version(to)
    except InvalidVersion:
        raise PortError(f"--to: {to!r} is not a valid version of {source.pin['name']} (PEP 440, e.g. "
                        f"{source.pin['version']})") from None
    # A version equal to the pin however it is written (v0.5.0, 0.5.0.0, 0.5) is the pin, spelled as pinned, and with
    # its sha256: the cached file is checked against it (without it, an altered cached file became the new pin)
    current = source.pin["version"]
    return dict(source.pin) if version == Version(current) else {"name": source.pin["name"], "version": str(version)}


def _resolve_name(m, name: str, command: str):
    """``(source id, None)`` for a source id, ``(kernel's source id, kernel id)`` for a kernel id or alias. Raises
    PortError naming the closest source ids (a misspelt source is one of them, not a kernel) or kernels."""
    if name in m.sources:
        return name, None
    try:
        k = m.resolve(name)
    except KeyError as e:
        close = difflib.get_close_matches(name, list(m.sources), n=3, cutoff=0.5)
        kernel_hint = e.args[0].split("; ", 1)[1] if "; " in e.args[0] else ""
        hint = f"did you mean the source {', '.join(close)}? " if close else f"{kernel_hint}; " if kernel_hint else ""
        raise PortError(f"unknown source or kernel {name!r} in {m.path.name}; {hint}{command} takes a source id "
                        f"({', '.join(m.sources)}) or a kernel id") from None
    return k.source, k.id


def _targets(porter: Porter, names: Iterable[str] | None) -> dict[str, list[str]]:
    from .lock import Lock

    lock = Lock.load(porter.lock_path)
    m = porter.manifest
    if names:
        ids = []
        for n in names:
            sid, kid = _resolve_name(m, n, "audit")
            ids.append(kid or sid)
        kernels: list[str] = []
        for i in ids:
            if i in m.sources:  # a source id: its locked kernels (or all of its kernels)
                kernels += lock.kernels_of(i) or [k.id for k in m.kernels.values() if k.source == i]
            else:
                kernels.append(i)
    else:
        kernels = sorted(lock.kernels) or list(m.kernels)
    out: dict[str, list[str]] = {}
    for kid in kernels:
        k = m.kernels.get(kid)
        if k is None or m.sources[k.source].is_local:
            continue  # ours: nothing upstream to audit
        out.setdefault(k.source, [])
        if kid not in out[k.source]:
            out[k.source].append(kid)
    if names and not out:  # named, but only our own kernels: say so rather than print an empty audit
        ported = ", ".join(s for s in m.sources if not m.sources[s].is_local)
        raise PortError(f"{', '.join(names)}: our own kernels (a local source) have no upstream to audit; name ported "
                        f"kernels or their sources ({ported})")
    return out


def audit(porter: Porter, names: Iterable[str] | None = None, to: str | None = None, latest: bool = False,
          with_diff: bool = False) -> AuditReport:
    """Audit vendored kernels (default: every locked kernel of a fetched source) against ``to`` (a version for
    pypi sources, a commit or ref for git sources) or the newest upstream (``latest``, also the default).

    Fetch failures are reported per source (``error``; exit code 2), not raised. Raises PortError for an
    unknown id, or when ``to`` is given for kernels of more than one source (a version or commit belongs to
    one source: without ``names``, name the source when more than one is vendored).
    """
    targets = _targets(porter, names)
    if to is not None and len(targets) > 1:
        if names:
            raise PortError(f"--to needs the kernels of exactly one source; the kernels named come from "
                            f"{', '.join(sorted(targets))}")
        raise PortError(f"--to needs exactly one source, and without a name audit covers every vendored one "
                        f"({', '.join(sorted(targets))}): name it, e.g. `audit {min(targets)} --to {to}`")
    report = AuditReport([])
    for sid, kids in sorted(targets.items()):
        src = porter.manifest.sources[sid]
        sa = SourceAudit(sid, src.kind, dict(src.pin), {})
        report.sources.append(sa)
        try:
            old = porter.fetcher.tree(src)
            sa.to_pin = _new_pin(src, to, latest, porter)
            new = porter.fetcher.tree(src, sa.to_pin)
            sa.to_pin = dict(new.pin)
            sa.unverified = new.unverified
        except PortError as e:
            sa.error = str(e)
            continue
        for lf in src.license_files:
            if not old.has(lf):
                sa.licenses.append(FileAudit(lf, "removed"))  # missing at the pin already: flagged as a change
            else:
                sa.licenses.append(_compare(lf, old, new, with_diff))
        for kid in kids:
            k = porter.manifest.kernels[kid]
            # a path of kernels.yaml that the old pin lacks and the new one has: the manifest was edited to follow a
            # move upstream before `update` (its files are taken from the new pin); absent from both, it is gone
            files = [_compare(f, old, new, with_diff) if old.has(f)
                     else FileAudit(f, "added", new.read(f).decode("utf-8", "replace").count("\n")) if new.has(f)
                     else FileAudit(f, "removed") for f in k.files]
            old_text = "\n".join(old.read(f).decode("utf-8", "replace") for f in k.files if old.has(f))
            new_paths = []
            for fa in files:
                if fa.status in ("unchanged", "changed", "added"):
                    new_paths.append(fa.path)
                elif fa.status == "moved":
                    new_paths.append(fa.moved_to[0])
            new_text = "\n".join(new.read(p).decode("utf-8", "replace") for p in new_paths)
            syms = [SymbolAudit(e.symbol, e.op, symbol_defined(e.symbol, old_text), symbol_defined(e.symbol, new_text))
                    for e in k.entries]
            dirs = {str(PurePosixPath(f).parent) for f in k.files}
            beside = sorted(p for p in new.files() - old.files() if str(PurePosixPath(p).parent) in dirs)
            sa.kernels.append(KernelAudit(kid, files, syms, beside))
    return report


# ----------------------------------------------------------------------------------------------------------
# update
# ----------------------------------------------------------------------------------------------------------
def edit_source_pin(text: str, sid: str, old_pin: dict[str, str], new_pin: dict[str, str], filename: str = "kernels.yaml") -> str:
    """Rewrite the pin of source ``sid`` in the manifest's text, keeping every comment and the layout.

    Raises PortError when the source block or an old value cannot be found (edit by hand then)."""
    lines = text.splitlines(keepends=True)
    try:
        i = next(n for n, l in enumerate(lines) if re.match(r"^sources:\s*(#.*)?$", l))
    except StopIteration:
        raise PortError(f"{filename}: no top-level 'sources:' block") from None
    start = indent = None
    for n in range(i + 1, len(lines)):
        l = lines[n]
        if re.match(r"^\S", l) and not l.startswith("#"):
            break
        mt = re.match(r"^(\s+)" + re.escape(sid) + r":\s*(#.*)?$", l)
        if mt:
            start, indent = n, len(mt.group(1))
            break
    if start is None:
        raise PortError(f"{filename}: sources.{sid}: block not found")
    end = len(lines)
    for n in range(start + 1, len(lines)):
        l = lines[n]
        if l.strip() and not l.lstrip().startswith("#") and len(l) - len(l.lstrip()) <= indent:
            end = n
            break
    block = "".join(lines[start:end])
    for key in sorted(new_pin):
        if old_pin.get(key) == new_pin[key]:
            continue
        pat = re.compile(r"(\b" + re.escape(key) + r":\s*)([\"']?)" + re.escape(str(old_pin[key])) + r"(?![\w.])")
        value = new_pin[key]

        def repl(m: re.Match, value: str = value) -> str:
            quote = m.group(2)
            if not quote and not isinstance(yaml.safe_load(value), str):  # 1.10 would read as a float
                return f"{m.group(1)}'{value}'"
            return m.group(1) + quote + value

        block, n = pat.subn(repl, block, count=1)
        if n != 1:
            raise PortError(f"{filename}: sources.{sid}.fetch: cannot find {key}: {old_pin[key]} to replace; edit by hand")
    return "".join(lines[:start]) + block + "".join(lines[end:])


def _refuse_downgrade(sid: str, src: Source, version: str, asked: str) -> None:
    """Raise PortError when ``version`` is older (PEP 440) than the pin of pypi source ``src``. Git sources,
    pinned by commit, have no order; a version that does not parse is left to the audit to report."""
    if src.kind != "pypi":
        return
    try:
        older = Version(version) < Version(src.pin["version"])
    except InvalidVersion:
        return
    if older:
        raise PortError(f"{sid}: refusing to downgrade {src.pin['name']} from the pinned {src.pin['version']} to "
                        f"{version} ({asked}); pass --allow-downgrade to do it anyway")


def update(porter: Porter, name: str, to: str | None = None, latest: bool = False, force: bool = False,
           allow_downgrade: bool = False, trust_cache: bool = False) -> AuditReport:
    """Move a source (named by source id or by one of its kernels) to a new pin: audit it, then re-vendor
    every locked kernel of the source (and the named kernel) at the new pin, rewrite the pin in kernels.yaml
    and the lock, all in one transaction. The source's folders are written whole at the new pin, as ``add`` writes
    them: local edits to its vendored files are replaced and files kernels.lock does not record there are removed
    (``tools/port.py update`` names both; :meth:`Porter.unrecorded` lists the latter beforehand).

    Raises PortError (nothing changed) when: the audit fails; a vendored file was removed or moved upstream
    (edit the kernel's ``files`` first); an entry symbol vanished or a license file changed (unless
    ``force``); the new version of a pypi source is older than its pin (unless ``allow_downgrade``; checked
    before any download for ``to``); the new files or license fail the checks of ``add``; the new sdist could be
    checked against neither a pin nor the package index (``--offline`` with a version kernels.yaml does not pin: the
    download cache's file) and not ``trust_cache`` (then its sha256 is pinned as it is, and the report's
    ``unverified`` says so).
    """
    m = porter.manifest
    sid, named = _resolve_name(m, name, "update")
    src = m.sources[sid]
    if src.is_local:
        raise PortError(f"{sid} is a local source (our own kernels): nothing to update")
    if to is None and not latest:
        raise PortError("update needs --to VERSION_OR_COMMIT or --latest")
    if to is not None and not allow_downgrade:
        _refuse_downgrade(sid, src, to, "--to")
    with porter.locked() as lock:
        porter._check_pin(lock, sid)
        kids = lock.kernels_of(sid) + ([named] if named and named not in lock.kernels else [])
        if not kids:
            raise PortError(f"no kernel of {sid} is vendored; name one: `python tools/port.py update <kernel id> --to ...`")
        report = audit(porter, kids, to=to, latest=latest)
        sa = report.sources[0]
        if sa.error:
            raise PortError(f"{sid}: audit failed: {sa.error}")
        if sa.unverified and not trust_cache:   # (a review: an altered cached sdist was pinned as it was)
            raise PortError(f"{sid}: refusing to pin {short_pin(sa.to_pin)} unverified: {sa.unverified}; run without "
                            f"--offline (the cached file is checked against the index's sha256, and downloaded again "
                            f"where it differs), or pass --trust-cache to pin the cached file's sha256 as it is")
        if latest and not allow_downgrade:  # the newest release may be older than a pre-release or yanked pin
            _refuse_downgrade(sid, src, sa.to_pin.get("version", ""), "--latest: the newest release on the index")
        if all(kid in lock.kernels for kid in kids) and sa.to_pin == dict(lock.sources[sid].pin):
            report.updated = False  # already at that pin: nothing to re-vendor or rewrite
            return report
        gone = [f"{k.kernel}: {f.path} " + (f"moved to {', '.join(f.moved_to)}" if f.moved_to else "removed")
                for k in sa.kernels for f in k.files if f.status in ("moved", "removed")]
        if gone:
            raise PortError(f"{sid} {short_pin(sa.to_pin)}: vendored files are gone upstream; update the kernels' files in "
                            "kernels.yaml first:\n  " + "\n  ".join(gone))
        reasons = [f"{k.kernel}: entry symbol {s.symbol} ({s.op}) not found any more" for k in sa.kernels
                   for s in k.symbols if s.before and not s.after]
        reasons += [f"license file {f.path} {f.status}" for f in sa.licenses if f.status != "unchanged"]
        if reasons and not force:
            raise PortError(f"{sid}: refusing to update to {short_pin(sa.to_pin)} (use --force after reviewing):\n  " + "\n  ".join(reasons))
        new_tree = porter.fetcher.tree(src, sa.to_pin)
        new_pin = dict(new_tree.pin)
        text = m.path.read_text()
        new_text = edit_source_pin(text, sid, dict(src.pin), new_pin, m.path.name)
        new_src = dataclasses.replace(src, pin=new_pin)
        parsed = yaml.safe_load(new_text)["sources"][sid]["fetch"][src.kind]
        if {k: str(v) for k, v in parsed.items()} != new_pin:
            raise PortError(f"{m.path.name}: rewriting sources.{sid}.fetch gave {parsed}, expected {new_pin}; edit by hand")
        new = lock.copy()
        lic = porter.check_license(new_src, new_tree)
        new.sources[sid] = LockedSource(src.kind, new_pin, src.license, lic)
        for kid in kids:
            new.kernels[kid] = porter.lock_kernel(m.kernels[kid], new_tree, check_symbols=not force)
        porter._commit(lock, new, {sid: new_tree},
                       extra=lambda tx: tx.stage_file(m.path, new_text.encode()))
    try:
        porter.reload_manifest()
    except ManifestError as e:  # cannot happen after the parse check above; say so loudly if it does
        raise PortError(f"kernels.yaml was updated but no longer loads: {e}") from e
    return report
