"""Vendor kernels from their pinned sources: ``add``, ``sync``, ``verify``, ``remove`` and the per-kernel state.

Layout produced (``docs/architecture.md``)::

    vendor/<source id>/<path inside the source>     the kernel files (fetched sources only)
    LICENSES/<source id>/<license file>             the source's license files
    kernels.lock                                    resolved pins + sha256 of every file above

Local sources (``fetch: {local: ...}``, i.e. pipegoose's own kernels) are never copied: their files and
license are hashed in place so that ``verify`` and the states work for them too.

Every change runs under a repository lock and as one :class:`~pipegoose.porting.txn.Transaction`: a failed or
interrupted ``add``/``sync``/``remove``/``update`` leaves vendor/, LICENSES/ and kernels.lock as they were.
"""

from __future__ import annotations

import contextlib
import errno
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from ..kernels.manifest import ALLOWED_LICENSES, Kernel, Manifest, Source, default_manifest_path, load_manifest
from .errors import IntegrityError, LicenseError, ManifestFactError, PortError, SourceFileMissing
from .fetch import Fetcher, SourceTree
from .includes import missing_headers, symbol_defined
from .licenses import detect_licenses, file_license_problem, primary_license
from .lock import Lock, LockedKernel, LockedSource
from .txn import TXN_DIRNAME, Transaction, recover, repo_lock
from .util import sha256_bytes, sha256_file

__all__ = ["Porter", "Problem", "KernelState", "STATES"]

STATES = ("declared", "vendored", "verified", "modified", "missing", "stale")
_IGNORED_TOP = {"README.md", ".port.lock", TXN_DIRNAME, ".gitkeep"}
_ABSENT_SHOWN = 3   # absent or modified files a kernel's state names before "and N more"
# verify's fix for a missing file of this project's own kernels, which sync cannot restore (it fetches nothing for them)
_LOCAL_MISSING = ("this project's own file: restore it from git (`git checkout -- <path>`); if it was removed on "
                  "purpose, change the kernel's files in kernels.yaml and run `python tools/port.py add` of the kernel")


@dataclass(frozen=True)
class Problem:
    """One finding of ``verify``: kind is differs | missing | extra | stale."""

    kind: str
    path: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind:8} {self.path}" + (f"  ({self.detail})" if self.detail else "")


@dataclass(frozen=True)
class KernelState:
    id: str
    source: str
    project: str
    license: str
    pin: str
    state: str
    detail: str = ""
    modified: str = ""   # the present files that differ from kernels.lock (the first few, as detail names them)


def _short_pin(pin) -> str:
    if "version" in pin:
        return f"{pin['name']}=={pin['version']}"
    if "commit" in pin:
        return f"{pin['url']}@{pin['commit'][:12]}"
    return f"local:{pin.get('path', '?')}"


def _shown_digits(a: str, b: str) -> int:
    """How many leading hex digits of two different hashes to show so that they differ (12 at least)."""
    n = 12
    while n < max(len(a), len(b)) and a[:n] == b[:n]:
        n += 8
    return n


def _write_staged(path: Path, data: bytes) -> None:
    """Write one staged file (a separate function so tests can interrupt a port mid-copy)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def pin_changed_by_hand(sid: str, locked: dict, declared: dict) -> str:
    """The advice for a kernels.yaml pin that is not kernels.lock's: ``update`` moves both, and cannot start from
    either edited by hand (sync and the builder sent users to update, which then refused). Either file may be the one
    edited: both are named (a review: a sha256 edited in kernels.lock was answered with "revert kernels.yaml", which
    was clean)."""
    fields = ", ".join(f"{k}: {locked.get(k)!r} -> {declared.get(k)!r}" for k in sorted(set(locked) | set(declared))
                       if locked.get(k) != declared.get(k))
    return (f"kernels.yaml pins {sid} otherwise than kernels.lock records ({fields}): one of the two was edited by "
            "hand (or by a merge): restore it from git (git checkout kernels.yaml, or git checkout kernels.lock; git "
            f"diff kernels.yaml kernels.lock shows which changed), then move both with `python tools/port.py update "
            f"{sid} --to ...`")


def record_differs(locked, declared) -> str:
    """How kernels.lock's record ``locked`` of a source differs from its kernels.yaml entry ``declared`` beyond the
    pin (kind, license, license files), or "". One rule for port.py (verify, list, sync) and the builder."""
    if locked.kind != declared.kind:
        return f"kernels.lock fetches it by {locked.kind}, kernels.yaml by {declared.kind}"
    if locked.license != declared.license:
        return f"kernels.yaml license {declared.license} != kernels.lock license {locked.license}"
    if set(locked.license_files) != set(declared.license_files):
        return (f"kernels.yaml license files {', '.join(sorted(declared.license_files)) or 'none'} != kernels.lock's "
                f"{', '.join(sorted(locked.license_files)) or 'none'}")
    return ""


def _record_changes(old, new, kid: str) -> list[str]:
    """The paths whose record kernel ``kid`` has otherwise in lock ``new`` than in lock ``old`` (its files, added,
    dropped or re-hashed, then its source's license files), plus ``"license"``, ``"pin"`` or ``"source"`` where those
    changed."""
    ok, nk = old.kernels[kid], new.kernels[kid]
    files = sorted(f for f in set(ok.files) | set(nk.files) if ok.files.get(f) != nk.files.get(f))
    os_, ns = old.sources.get(ok.source), new.sources.get(nk.source)
    if ok.source != nk.source or os_ is None or ns is None:
        return files + ["source"]
    lic = sorted(f for f in set(os_.license_files) | set(ns.license_files)
                 if os_.license_files.get(f) != ns.license_files.get(f))
    return files + lic + (["license"] if os_.license != ns.license else []) + \
        (["pin"] if dict(os_.pin) != dict(ns.pin) or os_.kind != ns.kind else [])


def kernel_disagrees(declared, locked) -> str:
    """How kernels.lock's entry ``locked`` of a kernel disagrees with its kernels.yaml entry ``declared`` (None: not
    there) in its source or its files, or "". Either file may be the one that changed: the words name both (a review:
    ``list`` said "kernels.yaml changed" of an edited kernels.lock). One rule for port.py (list, verify) and the
    builder."""
    if declared is None:
        return "in kernels.lock but not in kernels.yaml"
    if declared.source != locked.source:
        return f"kernels.yaml takes it from {declared.source}, kernels.lock from {locked.source}"
    if set(declared.files) != set(locked.files):
        plus, minus = sorted(set(declared.files) - set(locked.files)), sorted(set(locked.files) - set(declared.files))
        return ("kernels.yaml's files differ from kernels.lock's: "
                + ", ".join([f"+{f}" for f in plus] + [f"-{f}" for f in minus]))
    return ""


class Porter:
    """The porting operations over one repository root (the folder of ``kernels.yaml``).

    Args:
        manifest: path of kernels.yaml (default: the repository's). vendor/, LICENSES/ and kernels.lock are
            next to it, so tests point this at a temporary copy.
        cache_dir: download cache (default :func:`pipegoose.porting.util.default_cache_dir`: ``$PIPEGOOSE_PORT_CACHE``,
            else ``$XDG_CACHE_HOME/pipegoose/port``, else ``~/.cache/pipegoose/port``).
        offline: use only the download cache.
        log: callable receiving progress lines (default: discard).
    """

    def __init__(self, manifest: str | Path | Manifest | None = None, cache_dir: str | Path | None = None,
                 offline: bool = False, fetcher: Fetcher | None = None, log: Callable[[str], None] | None = None,
                 lock_timeout: float = 60.0):
        self.log = log or (lambda _msg: None)
        self.lock_timeout = lock_timeout
        if not isinstance(manifest, Manifest):
            # an interrupted change (update edits kernels.yaml too) is finished or rolled back before kernels.yaml is
            # read: a kill at the wrong moment could leave it moved aside, and no later run could load it to recover
            path = Path(manifest).expanduser().absolute() if manifest is not None else default_manifest_path()
            if (path.parent / "vendor" / TXN_DIRNAME).is_dir():
                try:
                    with repo_lock(path.parent, lock_timeout):
                        for note in recover(path.parent):
                            self.log(note)
                except OSError as e:   # read-only: the command says what it can do without (verify, sync)
                    if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                        raise
            manifest = load_manifest(path)
        self.manifest = manifest
        self.root = self.manifest.root
        self.lock_path = self.root / "kernels.lock"
        self.fetcher = fetcher or Fetcher(self.root, Path(cache_dir) if cache_dir else None, offline)
        # whether a change of this Porter passed its commit point (tools/port.py tells a Ctrl-C before it from one
        # after it)
        self.committed = False

    # ------------------------------------------------------------------------------------------------------
    # helpers
    # ------------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self) -> Iterator[Lock]:
        """Hold the repository lock, finish/roll back any interrupted transaction, yield the current lock."""
        with repo_lock(self.root, self.lock_timeout):
            for note in recover(self.root):
                self.log(note)
            yield Lock.load(self.lock_path)

    def reload_manifest(self) -> None:
        self.manifest = load_manifest(self.manifest.path)

    def vendor_dir(self, sid: str) -> Path:
        return self.manifest.vendor_dir(sid) if sid in self.manifest.sources else self.root / "vendor" / sid

    def license_dir(self, sid: str) -> Path:
        s = self.manifest.sources.get(sid)
        if s is not None and s.is_local:
            return self.manifest.vendor_dir(sid)
        return self.root / "LICENSES" / sid

    def _resolve_ids(self, names: Iterable[str], lock: Lock | None = None) -> list[str]:
        out: list[str] = []
        for n in names:
            if lock is not None and n in lock.kernels and n not in self.manifest.kernels:
                kid = n  # a lock entry whose kernel left kernels.yaml: still removable
            else:
                try:
                    kid = self.manifest.resolve(n).id
                except KeyError as e:
                    if isinstance(n, str) and n in self.manifest.sources:  # a source id, not a kernel's
                        kernels = [k for k, v in self.manifest.kernels.items() if v.source == n]
                        raise PortError(f"{n!r} is a source, not a kernel; its kernels: {', '.join(kernels) or 'none'}"
                                        ) from None
                    raise PortError(e.args[0]) from None
            if kid not in out:
                out.append(kid)
        return out

    @staticmethod
    def check_license(src: Source, tree: SourceTree) -> dict[str, str]:
        """Check the source's license files at its pin; return {license file: sha256}.

        Raises:
            LicenseError: a license file is missing, the text of a disallowed license (copyleft, Mozilla or
                non-commercial: licenses.DISALLOWED_FAMILIES) is found, or the declared license's text is not
                recognised in the files.
        """
        if src.license not in ALLOWED_LICENSES:  # the manifest loader refuses these already
            raise LicenseError(f"{src.id}: license {src.license!r} is not allowed; allowed: {', '.join(ALLOWED_LICENSES)}")
        missing = [lf for lf in src.license_files if not tree.has(lf)]
        if missing:
            raise LicenseError(f"{src.id}: license file(s) {', '.join(missing)} not found in {tree.label}; "
                               "a source is only vendored with its license (fix sources."
                               f"{src.id}.license_files in kernels.yaml)")
        out, text = {}, []
        for lf in src.license_files:
            data = tree.read(lf)
            out[lf] = sha256_bytes(data)
            text.append(data.decode("utf-8", "replace"))
        found, bad = detect_licenses("\n".join(text))
        if bad:
            raise LicenseError(f"{src.id}: {', '.join(src.license_files)} in {tree.label} carries "
                               f"{', '.join(sorted(bad))} text, which is not allowed (allowed: {', '.join(ALLOWED_LICENSES)})")
        if src.license not in found:
            raise LicenseError(f"{src.id}: kernels.yaml declares {src.license} but {', '.join(src.license_files)} in "
                               f"{tree.label} does not carry its text (recognised: {', '.join(sorted(found)) or 'none'})")
        primary = primary_license(text[0])
        if primary is not None and primary != src.license:
            raise LicenseError(f"{src.id}: kernels.yaml declares {src.license} but the first license text of "
                               f"{src.license_files[0]} in {tree.label} is {primary} (the project's own license comes "
                               f"first; {src.license} text further down is a bundled project's)")
        return out

    def lock_kernel(self, k: Kernel, tree: SourceTree, check_symbols: bool = True) -> LockedKernel:
        """Hash a kernel's files at the tree's pin, after checking they exist, that every header they include from
        the source is listed and that they (or the binding) declare each entry symbol (unless not
        ``check_symbols``: ``update --force`` takes a version where one vanished). Raises SourceFileMissing,
        LicenseError or ManifestFactError."""
        missing = [f for f in k.files if not tree.has(f)]
        if missing:
            raise SourceFileMissing(f"{k.id}: {len(missing)} file(s) of kernels.{k.id}.files not found in {tree.label}: "
                                    + ", ".join(missing))
        headers = missing_headers(tree, k.files, k.include_dirs)
        if headers:
            listing = ", ".join(f"{h} (included by {by})" for h, by in headers.items())
            raise ManifestFactError(f"{self.manifest.path.name}: kernels.{k.id}.files: expected every header the "
                                    f"kernel includes from its source; missing: {listing}")
        files, texts = {}, []
        for f in k.files:
            data = tree.read(f)
            texts.append(data.decode("utf-8", "replace"))
            why = file_license_problem(texts[-1], ALLOWED_LICENSES)
            if why is not None:  # a file of another license inside a permissive source
                raise LicenseError(f"{k.id}: {f} in {tree.label}: {why}; it is not vendored")
            files[f] = sha256_bytes(data)
        # each entry symbol is declared in the kernel's files, where audit looks for it too; an entry of role
        # autograd (our C++ autograd functions) in the binding. A misspelt symbol was locked without a word, and audit
        # only counted it (a fresh-clone walkthrough).
        text, binding = "\n".join(texts), self.manifest.binding_path(k)
        bound = binding.read_text(encoding="utf-8", errors="replace") if binding.is_file() else ""
        absent = [f"{e.symbol} ({e.op})" for e in k.entries
                  if check_symbols and not symbol_defined(e.symbol, bound if e.role == "autograd" else text)]
        if absent:
            raise ManifestFactError(f"{self.manifest.path.name}: kernels.{k.id}.entries: expected each entry symbol "
                                    f"declared in the kernel's files (role autograd: in its binding); not found in "
                                    f"{tree.label}: " + ", ".join(absent))
        return LockedKernel(k.source, files)

    @staticmethod
    def _files_match(folder: Path, files: dict[str, str]) -> bool:
        """Whether every file of ``files`` ({path under ``folder``: sha256}) is there with that sha256."""
        return all((folder / f).is_file() and sha256_file(folder / f) == h for f, h in files.items())

    def _source_verifies(self, lock: Lock, sid: str) -> bool:
        if not (self._files_match(self.vendor_dir(sid), lock.files_of_source(sid))
                and self._files_match(self.license_dir(sid), lock.sources[sid].license_files)):
            return False
        # a file the lock does not record (verify's "extra") also sends an upstream source back to be vendored
        # afresh (our own files live in the repository, among others: not checked so)
        return not self._unrecorded(lock, sid)

    def _unrecorded(self, lock: Lock, sid: str) -> list[Path]:
        """The files (and links) under vendor/<sid>/ and LICENSES/<sid>/ that ``lock`` does not record for upstream
        source ``sid`` (verify's "extra"), sorted; [] for this project's own source (its files live among others)
        and for a source the lock does not have. Writing the source's folders (add, sync, update) removes them."""
        if self._is_local(sid) or sid not in lock.sources:
            return []
        out: list[Path] = []
        for folder, known in ((self.vendor_dir(sid), lock.files_of_source(sid)),
                              (self.license_dir(sid), lock.sources[sid].license_files)):
            if folder.is_dir():
                out += [p for p in sorted(folder.rglob("*"))
                        if (p.is_file() or p.is_symlink()) and p.relative_to(folder).as_posix() not in known]
        return out

    def unlocked_kernels(self) -> list[str]:
        """The kernels of kernels.yaml that kernels.lock does not record, in kernels.yaml's order: neither vendored nor
        verified (sync vendors only what kernels.lock records, verify checks only that; ``add`` or ``sync --all``
        records them). ``tools/port.py`` sync and verify name them (a review: both passed without a word where the
        builder called such a ported kernel unavailable)."""
        lock = Lock.load(self.lock_path)
        return [kid for kid in self.manifest.kernels if kid not in lock.kernels]

    def unrecorded(self) -> dict[str, list[str]]:
        """{source id: the files under its vendor/ and LICENSES/ folders that kernels.lock does not record, as
        repository paths} for each upstream source of kernels.lock that has any. ``add`` and ``update`` remove them
        when they write the source's folders, and ``tools/port.py`` names them (a review: ``add`` deleted a user's
        own vendor/<source>/my_patches/ without a word)."""
        lock = Lock.load(self.lock_path)
        return {sid: [self._show(p) for p in extra] for sid in sorted(lock.sources)
                if (extra := self._unrecorded(lock, sid))}

    def _stage_source(self, tx: Transaction, lock: Lock, sid: str, tree: SourceTree | None) -> None:
        """Stage vendor/<sid> and LICENSES/<sid> as exactly the files ``lock`` records for the source, read from
        ``tree`` and checked against the lock's hashes. No kernels left: stage their deletion."""
        src = self.manifest.sources.get(sid)
        if src is not None and src.is_local:
            return
        vdir, ldir = self.root / "vendor" / sid, self.root / "LICENSES" / sid
        if not lock.kernels_of(sid):
            for d in (vdir, ldir):
                if d.exists():
                    tx.stage_delete(d)
            return
        assert tree is not None
        files = lock.files_of_source(sid)
        stage = tx.stage_dir(vdir)
        for f, h in sorted(files.items()):
            data = tree.read(f)
            if sha256_bytes(data) != h:
                # (the archive itself was checked against the pin: the lock's record is what is wrong, not the
                # download cache, which the message blamed; a review)
                raise IntegrityError(f"{sid}: {f} from {tree.label} has sha256 {sha256_bytes(data)}, kernels.lock "
                                     f"records {h}: kernels.lock's record does not match the pinned source (edited "
                                     f"by hand, or a merge?); restore kernels.lock from git (git checkout "
                                     f"kernels.lock), or re-record the file "
                                     f"with `python tools/port.py add` of its kernels "
                                     f"({', '.join(k for k in lock.kernels_of(sid) if f in lock.kernels[k].files)})")
            _write_staged(stage / f, data)
        lstage = tx.stage_dir(ldir)
        for f, h in sorted(lock.sources[sid].license_files.items()):
            data = tree.read(f)
            if sha256_bytes(data) != h:
                raise IntegrityError(f"{sid}: license file {f} from {tree.label} has sha256 {sha256_bytes(data)}, "
                                     f"kernels.lock records {h}")
            _write_staged(lstage / f, data)

    def _check_pin(self, lock: Lock, sid: str) -> None:
        """Raise PortError where kernels.lock's pin of ``sid`` is not kernels.yaml's (:func:`pin_changed_by_hand`)."""
        s = lock.sources.get(sid)
        m = self.manifest.sources.get(sid)
        if s is not None and m is not None and dict(s.pin) != dict(m.pin):
            raise PortError(pin_changed_by_hand(sid, dict(s.pin), dict(m.pin)))

    def _kernel_disagrees(self, kid: str, lk) -> str:
        """:func:`kernel_disagrees` of kernel ``kid``'s kernels.yaml entry and its kernels.lock entry ``lk``."""
        return kernel_disagrees(self.manifest.kernels.get(kid), lk)

    def _source_disagrees(self, lock: Lock, sid: str) -> str:
        """How kernels.lock's record of source ``sid`` disagrees with kernels.yaml (absent, pin, kind, license), or
        ""."""
        s, m = lock.sources[sid], self.manifest.sources.get(sid)
        if m is None:
            return "in kernels.lock but not in kernels.yaml"
        if dict(m.pin) != dict(s.pin):
            a, b = _short_pin(s.pin), _short_pin(m.pin)
            if a == b:   # (the pins differ in fields the short form leaves out, the sha256: those, hashes shortened)
                def shown(x, y):
                    if isinstance(x, str) and isinstance(y, str) and len(x) >= 40 and len(y) >= 40:
                        n = _shown_digits(x, y)
                        return f"{x[:n]}…", f"{y[:n]}…"
                    return repr(x), repr(y)

                fields = sorted(k for k in set(s.pin) | set(m.pin) if s.pin.get(k) != m.pin.get(k))
                pairs = [(k, *shown(s.pin.get(k), m.pin.get(k))) for k in fields]
                a = f"{a} ({', '.join(f'{k} {x}' for k, x, _ in pairs)})"
                b = f"{b} ({', '.join(f'{k} {y}' for k, _, y in pairs)})"
            return f"kernels.lock pin {a} != kernels.yaml pin {b}"
        if why := self._record_differs(lock, sid):
            return (f"{why}: `python tools/port.py add` of its kernels checks the source against kernels.yaml (its "
                    "license files against the declared license) and records it")
        return ""

    def _record_differs(self, lock: Lock, sid: str) -> str:
        """How kernels.lock's record of source ``sid`` differs from kernels.yaml beyond the pin (kind, license,
        license files), or "" (also for a source kernels.yaml no longer has)."""
        s, m = lock.sources.get(sid), self.manifest.sources.get(sid)
        return record_differs(s, m) if s is not None and m is not None else ""

    def _commit(self, old: Lock, new: Lock, trees: dict[str, SourceTree | None], extra=None) -> None:
        with Transaction(self.root) as tx:
            for sid, tree in sorted(trees.items(), key=lambda kv: kv[0]):
                self._stage_source(tx, new, sid, tree)
            if extra is not None:
                extra(tx)
            if new.to_data() != old.to_data() or not self.lock_path.exists():
                tx.stage_file(self.lock_path, new.dumps().encode())
            try:
                tx.commit()
            finally:
                self.committed = self.committed or tx.committed

    def _drop_unused_sources(self, new: Lock) -> list[str]:
        """Drop from ``new`` the sources that none of its kernels comes from any more (a kernel moved to another
        source by kernels.yaml and added again, or a kernel entry deleted from kernels.lock by hand), as ``remove``
        does with a source's last kernel; returns their ids, logged."""
        dropped = sorted(sid for sid in new.sources if not new.kernels_of(sid))
        for sid in dropped:
            del new.sources[sid]
            self.log(f"dropping source {sid} from kernels.lock: no vendored kernel comes from it any more")
        return dropped

    def _stage_dropped(self, tx: Transaction, sids: list[str]) -> None:
        """Delete the vendor/ and LICENSES/ folders of dropped sources (not this project's own files)."""
        for sid in sids:
            src = self.manifest.sources.get(sid)
            if src is not None and src.is_local:
                continue
            for d in (self.vendor_dir(sid), self.license_dir(sid)):
                if d.exists():
                    tx.stage_delete(d)

    def _stage_departed(self, tx: Transaction, old: Lock, new: Lock, kids: Iterable[str], sids: Iterable[str],
                        dropped: list[str]) -> None:
        """Stage vendor/<sid> without the files that kernels ``kids`` used under ``old`` and no kernel of ``sid``
        uses under ``new`` (kernels removed, or moved to another source), for each source ``sid`` that keeps
        kernels; the other files stay as they are. A kernel's files count under its source in ``old`` and under
        its kernels.yaml source (where a source edited in kernels.lock by hand left them: ``remove`` of such a
        kernel left them behind, for verify to call extra)."""
        kids = list(kids)

        def came_from(k: str, sid: str) -> bool:
            declared = self.manifest.kernels.get(k)
            return old.kernels[k].source == sid or (declared is not None and declared.source == sid)

        for sid in sids:
            src = self.manifest.sources.get(sid)
            if sid in dropped or (src is not None and src.is_local):
                continue
            vdir = self.root / "vendor" / sid
            keep = new.files_of_source(sid)
            drop = {f for k in kids if k in old.kernels and came_from(k, sid)
                    for f in old.kernels[k].files} - set(keep)
            if not drop or not vdir.exists():
                continue
            stage_dir = tx.stage_dir(vdir)
            for p in sorted(vdir.rglob("*")):
                rel = p.relative_to(vdir).as_posix()
                if p.is_file() and rel not in drop:
                    _write_staged(stage_dir / rel, p.read_bytes())

    # ------------------------------------------------------------------------------------------------------
    # operations
    # ------------------------------------------------------------------------------------------------------
    def add(self, names: Iterable[str]) -> list[str]:
        """Vendor kernels (ids or aliases) at their manifest pin and record them in kernels.lock.

        A ported kernel already vendored at that pin, with the same files, whose files and license verify, is left
        as it is (nothing fetched), and so is the rest of its source's folders; our own kernels (a local source) are
        hashed again, which records an edit (a kernel of ours whose record already matches its files is left as it
        is). A ported kernel added is written with its source's folders whole, as kernels.lock records them: the
        other locked kernels' files are restored from the pin (local edits replaced) and files kernels.lock does not
        record there are removed (:meth:`unrecorded`; ``tools/port.py`` names both).
        Returns the kernel ids added, re-recorded or re-vendored (:meth:`add_outcome` tells which). Raises PortError
        (or a subclass) and changes nothing on any failure: unknown id (message lists close matches), fetch/network
        failure, archive sha256 mismatch, a file or license file missing in the source, a license not allowed, a
        header missing from ``files``.
        """
        names = list(names)
        o = self.add_outcome(names)
        done = set(o["added"]) | set(o["re-recorded"]) | set(o["re-vendored"])
        return [kid for kid in self._resolve_ids(names) if kid in done]   # (in the order named)

    def add_outcome(self, names: Iterable[str]) -> dict:
        """:meth:`add`, telling what it did to each kernel named (a review: `add` of our own kernel whose record
        matched its files, or of a ported kernel already in kernels.lock whose file was edited, said "added").

        Returns ``{"added": [ids new to kernels.lock], "re-recorded": {id: [paths whose record changed]} (our own
        kernels whose files changed since kernels.lock recorded them; license files too, and "license", "pin" or
        "source" where those changed), "re-vendored": [ported ids
        already in kernels.lock, written again from the pin], "in_place": [ids left as they are]}``; raises as
        :meth:`add` does."""
        out: dict = {"added": [], "re-recorded": {}, "re-vendored": [], "in_place": []}
        with self.locked() as lock:
            named = self._resolve_ids(names)
            in_place = [kid for kid in named if self._vendored_and_verified(lock, kid)]
            ids = [kid for kid in named if kid not in in_place]
            if ids:
                new, trees = self._plan_add(lock, ids)
                for kid in ids:
                    sid = new.kernels[kid].source
                    if kid not in lock.kernels:
                        out["added"].append(kid)
                    elif not self.manifest.sources[sid].is_local:
                        out["re-vendored"].append(kid)
                    else:
                        changed = _record_changes(lock, new, kid)
                        if changed:
                            out["re-recorded"][kid] = changed
                        else:
                            in_place.append(kid)
                ids = [kid for kid in ids if kid not in in_place]
            if ids:
                dropped = self._drop_unused_sources(new)
                # kernels that kernels.yaml moved to another source leave their old source's folder (which keeps
                # its other kernels' files)
                moved = [kid for kid in ids if kid in lock.kernels and lock.kernels[kid].source != new.kernels[kid].source]
                left = sorted({lock.kernels[kid].source for kid in moved} - set(trees))

                def stage(tx: Transaction) -> None:
                    self._stage_dropped(tx, dropped)
                    self._stage_departed(tx, lock, new, moved, left, dropped)

                self._commit(lock, new, trees, extra=stage)
        out["in_place"] = [kid for kid in named if kid in in_place]
        for kid in out["in_place"]:
            src = self.manifest.sources[self.manifest.kernels[kid].source]
            self.log(f"{kid} is this project's own ({src.describe_pin()}) and kernels.lock records its files as they "
                     "are: nothing changed" if src.is_local else
                     f"{kid} is already vendored at {src.describe_pin()} and verifies: nothing fetched")
        for kid in ids:
            pin = self.manifest.sources[self.manifest.kernels[kid].source].describe_pin()
            if kid in out["re-recorded"]:
                self.log(f"re-recorded {kid} ({pin}): {', '.join(out['re-recorded'][kid])}")
            else:
                self.log(f"{'re-vendored' if kid in out['re-vendored'] else 'added'} {kid} ({pin})")
        return out

    def _vendored_and_verified(self, lock: Lock, kid: str) -> bool:
        """Whether ported kernel ``kid`` is in kernels.lock at the manifest's pin with the manifest's files, and its
        files and its source's license files verify. The rest of the source's folders is not looked at: other
        kernels' files and files kernels.lock does not record are not this kernel's, and ``add`` of it in place
        leaves them as they are (it rewrote the source's folders for them: a user's own vendor/<source>/my_patches/
        went, and add said "added" of a kernel that was there; a review)."""
        k = self.manifest.kernels[kid]
        src = self.manifest.sources[k.source]
        lk, ls = lock.kernels.get(kid), lock.sources.get(src.id)
        if src.is_local or lk is None or ls is None or lk.source != k.source or ls.kind != src.kind:
            return False
        if dict(ls.pin) != dict(src.pin) or set(k.files) != set(lk.files):
            return False
        if ls.license != src.license or set(ls.license_files) != set(src.license_files):  # a license file declared
            return False
        return (self._files_match(self.vendor_dir(src.id), lk.files)
                and self._files_match(self.license_dir(src.id), ls.license_files))

    @staticmethod
    def _getting(src, offline: bool = False) -> str:
        """The progress line of reading a source's files (it said "fetching" also for our own files and for an
        sdist or repository already in the download cache)."""
        if src.is_local:
            return f"reading {src.describe_pin()}"
        return f"getting {src.describe_pin()} (from the download cache{'' if offline else ', else the network'})"

    def _plan_add(self, lock: Lock, ids: list[str]) -> tuple[Lock, dict[str, SourceTree | None]]:
        new = lock.copy()
        trees: dict[str, SourceTree | None] = {}
        for kid in ids:
            k = self.manifest.kernels[kid]
            src = self.manifest.sources[k.source]
            self._check_pin(lock, src.id)
            if src.id not in trees:
                self.log(self._getting(src, self.fetcher.offline))
                trees[src.id] = self.fetcher.tree(src)
            tree = trees[src.id]
            lic = self.check_license(src, tree)
            new.sources[src.id] = LockedSource(src.kind, dict(tree.pin), src.license, lic)
            new.kernels[kid] = self.lock_kernel(k, tree)
            # a file other locked kernels of the source list too (a shared header of our own, changed and
            # re-recorded through one of them): one hash for all, or the lock is refused (a review: `add` of one
            # kernel after verify's advice left a lock no command would read)
            for other, lk in sorted(new.kernels.items()):
                if other != kid and lk.source == src.id:
                    moved = sorted(f for f, h in new.kernels[kid].files.items() if lk.files.get(f, h) != h)
                    for f in moved:
                        lk.files[f] = new.kernels[kid].files[f]
                    if moved:
                        self.log(f"re-recorded {', '.join(moved)} for {other} too (it lists the same file)")
        return new, trees

    def sync(self, all_kernels: bool = False) -> dict[str, list[str]]:
        """Make the upstream sources' folders in vendor/ and LICENSES/ exactly what kernels.lock records (fetching
        only sources that do not verify already); with ``all_kernels``, first add every kernel of the manifest missing
        from the lock.

        Returns {"added": [...], "vendored": [source ids fetched into an absent vendor/ folder (a fresh clone)],
        "restored": [source ids re-vendored over files that differed from the lock], "ok": [source ids already in place],
        "differs": [this project's sources whose files differ from the lock: sync has nothing to fetch for them],
        "stray": [paths]}: "stray" lists what lies at the top of vendor/ or LICENSES/ but belongs to no locked source
        (a file, or a folder of no source in the lock); sync leaves those in place (they are not its files), and
        ``verify`` reports them.
        Raises PortError when the lock is empty (and not ``all_kernels``), when a lock entry no longer matches
        kernels.yaml (pin or file list changed: use ``add``/``update``), or on any fetch/integrity failure.
        """
        with contextlib.ExitStack() as stack:
            lock, read_only = self._locked_or_read_only(stack, "checking")
            if not lock.kernels and not all_kernels:
                raise PortError(f"{self.lock_path.name} has no kernels yet: run `python tools/port.py sync --all` "
                                "or `python tools/port.py add <id>`")
            new_ids = [k for k in self.manifest.kernels if k not in lock.kernels] if all_kernels else []
            for kid, lk in lock.kernels.items():
                k = self.manifest.kernels.get(kid)
                if k is None:
                    raise PortError(f"kernels.lock: {kid} is not in kernels.yaml any more: "
                                    f"`python tools/port.py remove {kid}`")
                if set(k.files) != set(lk.files):
                    raise PortError(f"kernels.lock: {kid}: kernels.yaml's file list changed since it was vendored: "
                                    f"run `python tools/port.py add {kid}`")
                if k.source != lk.source:
                    raise PortError(f"kernels.lock: {kid}: recorded from source {lk.source}, but kernels.yaml takes it "
                                    f"from {k.source}: run `python tools/port.py add {kid}` (or restore kernels.lock "
                                    "from git)")
            for sid in lock.sources:
                if lock.kernels_of(sid):  # (a source no locked kernel comes from is dropped below, pin or not)
                    self._check_pin(lock, sid)
                    # (a license or license file declared since: sync said "already in place", a review)
                    if why := self._record_differs(lock, sid):
                        raise PortError(f"kernels.lock: sources.{sid}: {why}: run `python tools/port.py add "
                                        f"{' '.join(lock.kernels_of(sid))}` to check and record it")
            new, trees = self._plan_add(lock, new_ids)
            dropped = self._drop_unused_sources(new)
            result = {"added": new_ids, "vendored": [], "restored": [], "ok": [], "differs": [], "dropped": dropped}
            for sid in sorted(new.sources):
                src = self.manifest.sources[sid]
                if sid in trees:
                    continue
                if self._source_verifies(new, sid):
                    result["ok"].append(sid)
                    continue
                if src.is_local:
                    # Our own files live in git, which is their record; sync has nothing to fetch for them. A
                    # difference is reported (and fails `verify`) but does not stop vendoring the upstream sources.
                    self.log(f"note: {sid}: local files differ from kernels.lock (see `python tools/port.py verify`): "
                             f"restore missing or changed files from git, or re-record intended changes with "
                             f"`python tools/port.py add <id>`")
                    result["differs"].append(sid)
                    continue
                present = any(p.is_file() for d in (self.vendor_dir(sid), self.license_dir(sid)) for p in d.rglob("*"))
                self.log(self._getting(src, self.fetcher.offline))
                trees[sid] = self.fetcher.tree(src, new.sources[sid].pin)
                result["restored" if present else "vendored"].append(sid)
            if read_only and (trees or dropped or new.to_data() != lock.to_data()):
                work = ([f"vendor {', '.join(sorted(trees))}"] if trees else []) + \
                       ([f"drop {', '.join(dropped)}"] if dropped else []) + \
                       (["rewrite kernels.lock"] if new.to_data() != lock.to_data() else [])
                raise PortError(f"sync has to {' and '.join(work)} here, which cannot be written ({read_only})")
            self._commit(lock, new, trees, extra=lambda tx: self._stage_dropped(tx, dropped))
            result["stray"] = self._stray_top_entries(new)
        return result

    def _top_entries(self):
        """(top, entry) for each entry at the top of vendor/ and LICENSES/ (sorted), but the tool's own."""
        for top in ("vendor", "LICENSES"):
            d = self.root / top
            if d.is_dir():
                for entry in sorted(d.iterdir()):
                    if entry.name not in _IGNORED_TOP and not entry.name.startswith("."):
                        yield top, entry

    def _stray_top_entries(self, lock: Lock) -> list[str]:
        """Entries at the top of vendor/ and LICENSES/ that belong to no upstream source of ``lock``."""
        # what verify reports: files (an empty folder holds none, and verify passes with it)
        return [self._show(entry) for _, entry in self._top_entries()
                if entry.is_file() or ((entry.name not in lock.sources or self._is_local(entry.name))
                                       and any(p.is_file() or p.is_symlink() for p in entry.rglob("*")))]

    def remove(self, names: Iterable[str]) -> list[str]:
        """Drop kernels from vendor/ and kernels.lock. Files another still-locked kernel of the same source uses
        stay; the source's vendor/ and LICENSES/ folders go with its last kernel. Raises PortError (unknown or
        not vendored id)."""
        with self.locked() as lock:
            ids = self._resolve_ids(names, lock)
            not_locked = [k for k in ids if k not in lock.kernels]
            if not_locked:
                raise PortError(f"not vendored (no kernels.lock entry): {', '.join(not_locked)}")
            new = lock.copy()
            sids = sorted({lock.kernels[k].source for k in ids}
                          | {self.manifest.kernels[k].source for k in ids if k in self.manifest.kernels})
            for kid in ids:
                del new.kernels[kid]
            dropped = self._drop_unused_sources(new)  # (with its last kernel)

            def stage(tx: Transaction) -> None:
                self._stage_dropped(tx, dropped)
                self._stage_departed(tx, lock, new, ids, sids, dropped)

            self._commit(lock, new, {}, extra=stage)
        for kid in ids:
            self.log(f"removed {kid}")
        return ids

    def verify(self) -> list[Problem]:
        """Recompute every hash recorded in kernels.lock. Returns the problems (empty = all good): files that
        differ, are missing or are extra (in vendor/<source>/ or LICENSES/<source>/ but not in the lock), and
        stale lock entries (kernel gone from kernels.yaml, pin or file list changed)."""
        with contextlib.ExitStack() as stack:
            lock, _ = self._locked_or_read_only(stack, "verifying")
            return self._verify(lock)

    def _locked_or_read_only(self, stack: contextlib.ExitStack, doing: str) -> tuple[Lock, str]:
        """:meth:`locked` entered on ``stack``, and "" ; or, where no lock file can be made (a read-only checkout,
        vendor/ not writable), kernels.lock read without the lock and why (a note logged). Reading needs no lock,
        unless an interrupted change waits to be finished, which needs writing: PortError then. (A fresh-clone
        review: verify and sync of a read-only checkout ended in a traceback, exit 1, which port.py documents as
        drift.)"""
        try:
            return stack.enter_context(self.locked()), ""
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            why = f"{e.filename}: {e.strerror}"
        pending = self.root / "vendor" / TXN_DIRNAME
        if pending.is_dir() and any(pending.iterdir()):
            raise PortError(f"{self._show(pending)}: an interrupted change waits to be finished or rolled back, which "
                            f"needs write access ({why})")
        self.log(f"note: {why}: {doing} without the repository lock")
        return Lock.load(self.lock_path), why

    def _verify(self, lock: Lock) -> list[Problem]:
        probs: list[Problem] = []
        for kid, lk in sorted(lock.kernels.items()):
            if why := self._kernel_disagrees(kid, lk):
                probs.append(Problem("stale", kid, why))
        used = {lk.source for lk in lock.kernels.values()}
        for sid, s in sorted(lock.sources.items()):
            if sid not in used:
                probs.append(Problem("stale", f"sources.{sid}", "no kernel of kernels.lock comes from it: `python "
                                     "tools/port.py sync` drops it and its folders (or restore kernels.lock from git)"))
            if why := self._source_disagrees(lock, sid):
                probs.append(Problem("stale", f"sources.{sid}", why))
            base, lic = self.vendor_dir(sid), self.license_dir(sid)
            checks = [(base, f, h) for f, h in lock.files_of_source(sid).items()]
            checks += [(lic, f, h) for f, h in s.license_files.items()]
            for folder, f, h in sorted(checks, key=lambda t: (str(t[0]), t[1])):
                p = folder / f
                shown = self._show(p)
                if not p.is_file():  # (sync cannot restore this project's own files: a walkthrough followed it)
                    probs.append(Problem("missing", shown, _LOCAL_MISSING if self._is_local(sid)
                                         else "run `python tools/port.py sync`"))
                elif (got := sha256_file(p)) != h:
                    fix = ("; this project's own file: re-record it with `python tools/port.py add` of its kernel"
                           if self._is_local(sid) else
                           "; `python tools/port.py sync` restores it, unless kernels.lock's record is what was edited "
                           "(sync says so then): git checkout kernels.lock")
                    n = _shown_digits(got, h)
                    probs.append(Problem("differs", shown, f"sha256 {got[:n]}…, kernels.lock {h[:n]}…{fix}"))
        # extra files: anything under vendor/ and LICENSES/ that no lock entry explains
        expected = {"vendor": lambda sid: lock.files_of_source(sid),
                    "LICENSES": lambda sid: lock.sources[sid].license_files}
        for top, entry in self._top_entries():
            sid = entry.name
            known = set(expected[top](sid)) if sid in lock.sources and not self._is_local(sid) else set()
            if entry.is_file():
                probs.append(Problem("extra", self._show(entry), "not recorded in kernels.lock"))
                continue
            for p in sorted(entry.rglob("*")):
                if (p.is_file() or p.is_symlink()) and p.relative_to(entry).as_posix() not in known:
                    probs.append(Problem("extra", self._show(p), "not recorded in kernels.lock"))
        return probs

    def _is_local(self, sid: str) -> bool:
        s = self.manifest.sources.get(sid)
        return bool(s and s.is_local)

    def _first_few(self, paths: list[Path]) -> str:
        """The first ``_ABSENT_SHOWN`` of ``paths`` as :meth:`_show` writes them, and how many more ("" for none)."""
        more = len(paths) - _ABSENT_SHOWN
        return ", ".join(self._show(p) for p in paths[:_ABSENT_SHOWN]) + (f", and {more} more" if more > 0 else "")

    def _show(self, p: Path) -> str:
        """``p`` as a repository path. A link is named by its own path, not its target's: only its folder is
        resolved (a review: vendor/deepspeed/link -> ../../README.md was shown as "README.md", a link to a recorded
        file as that file, and a dangling link as an absolute path)."""
        try:
            return (p.parent.resolve() / p.name).relative_to(self.root.resolve()).as_posix()
        except ValueError:
            return str(p)

    def states(self, check_hashes: bool = True) -> list[KernelState]:
        """The state of every kernel of the manifest (and of lock entries that left it):

        declared (not in kernels.lock), vendored (locked and present; hashes not checked: ``check_hashes`` False),
        verified (hashes match, and the source's folders hold no file kernels.lock does not record: verify passes for
        it), modified (a file or license file differs, or the source's folders hold files kernels.lock does not
        record; the latter is looked at with ``check_hashes`` False too), missing (locked but files absent: run sync,
        or for this project's own files restore them from git), stale (kernels.yaml and kernels.lock disagree:
        source, pin, file list, license; the detail says which).
        """
        lock = Lock.load(self.lock_path)
        out = []
        unrecorded: dict[str, list[Path]] = {}   # per source, looked up once
        for kid in list(self.manifest.kernels) + [k for k in sorted(lock.kernels) if k not in self.manifest.kernels]:
            k = self.manifest.kernels.get(kid)
            sid = k.source if k else lock.kernels[kid].source
            src = self.manifest.sources.get(sid)
            lk = lock.kernels.get(kid)
            project = src.project if src else sid
            lic = src.license if src else lock.sources[sid].license
            pin = _short_pin(src.pin if src else lock.sources[sid].pin)
            if lk is None:
                out.append(KernelState(kid, sid, project, lic, pin, "declared"))
                continue
            if why := self._kernel_disagrees(kid, lk) or self._source_disagrees(lock, lk.source):
                out.append(KernelState(kid, sid, project, lic, pin, "stale", f"kernels.yaml and kernels.lock disagree: "
                                       f"{why}"))
                continue
            ls = lock.sources[sid]
            base, licd = self.vendor_dir(sid), self.license_dir(sid)
            paths = [(base / f, h) for f, h in lk.files.items()] + [(licd / f, h) for f, h in ls.license_files.items()]
            absent = [p for p, _ in paths if not p.is_file()]
            if absent:
                local = self._is_local(sid)
                fix = "restore from git (own files)" if local else "run sync"
                # the present files that differ too (a walkthrough: a changed file went unsaid beside a missing one)
                bad = [p for p, h in paths if check_hashes and p.is_file() and sha256_file(p) != h]
                also = f", {len(bad)} modified ({self._first_few(bad)})" if bad else ""
                # and which are absent (a walkthrough: `list` said only how many), the first few: in a fresh clone,
                # where none is there, every path of every kernel made `list` three screens long (a review)
                if len(absent) == len(paths) and not local:   # (our own files are named: git restores them)
                    what = (f"none of its {len(paths)} files is there" if len(paths) > 1 else "its file is not there")
                    what += " (not vendored yet)"
                else:
                    what = f"{len(absent)} file(s) absent ({self._first_few(absent)})"
                out.append(KernelState(kid, sid, project, lic, pin, "missing", f"{what}{also}: {fix}",
                                       self._first_few(bad)))
                continue
            bad = [p for p, h in paths if sha256_file(p) != h] if check_hashes else []
            if bad:
                out.append(KernelState(kid, sid, project, lic, pin, "modified", self._first_few(bad),
                                       self._first_few(bad)))
                continue
            # files kernels.lock does not record in the source's folders fail verify ("extra"): not verified either
            # (a review: `list` said verified where verify failed). Looked at without hashes too: it hashes nothing
            # (a review: `list --quick` said vendored of them, where the README says modified)
            if sid not in unrecorded:
                unrecorded[sid] = self._unrecorded(lock, sid)
            if unrecorded[sid]:
                files = "its files verify, but " if check_hashes else ""
                out.append(KernelState(kid, sid, project, lic, pin, "modified", (
                    f"{files}its source's folders hold {len(unrecorded[sid])} file(s) not recorded in "
                    f"kernels.lock ({self._first_few(unrecorded[sid])}): verify fails; sync removes them")))
                continue
            out.append(KernelState(kid, sid, project, lic, pin, "verified" if check_hashes else "vendored"))
        return out
