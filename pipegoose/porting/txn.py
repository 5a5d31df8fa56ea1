"""All-or-nothing changes to vendor/, LICENSES/, kernels.lock and kernels.yaml.

A :class:`Transaction` stages every new folder and file under ``vendor/.port-txn/<id>/`` (same file system
as the targets), then swaps them into place with renames. A journal written before the first rename lets an
interrupted swap (Ctrl-C, a crash, ``kill -9``) be rolled back: in-process at once, and otherwise by the next
run of the tool (:func:`recover`), which runs under the same repository lock. The commit point is the
journal's ``committed`` flag; after it, leftover backups are only garbage.

A single file (kernels.lock, kernels.yaml) is never absent: its backup is a hard link (else a copy, made whole under
a temporary name) taken while it stays in place, and the staged file is renamed over it (``os.replace``), as a
rollback renames the backup over it (a review: a ``kill -9`` between moving kernels.yaml aside and putting the new
one in place left none, and ``doctor`` said to reinstall). A folder is moved aside, then replaced. While a
transaction folder is there, :func:`pipegoose.kernels.manifest.pending_port_change` says so (the kernel builder
refuses vendored kernels then).

The repository lock is a :class:`filelock.FileLock` on ``vendor/.port.lock``.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

from filelock import FileLock, Timeout

from ..kernels.manifest import PORT_LOCK_NAME, PORT_TXN_DIRNAME
from .errors import PortError

__all__ = ["Transaction", "repo_lock", "recover", "TXN_DIRNAME"]

TXN_DIRNAME = PORT_TXN_DIRNAME
LOCK_NAME = PORT_LOCK_NAME


def repo_lock(root: Path, timeout: float = 60.0) -> FileLock:
    """The lock taken while vendor/, LICENSES/ or kernels.lock change. Raises PortError after ``timeout``."""
    vendor = Path(root) / "vendor"
    vendor.mkdir(parents=True, exist_ok=True)

    class _Lock(FileLock):
        def acquire(self, *a, **kw):  # noqa: D401 - clearer error than filelock's
            try:
                return super().acquire(*a, **kw)
            except Timeout:
                raise PortError(f"another tools/port.py holds {vendor / LOCK_NAME} (waited {timeout:.0f}s)") from None

    return _Lock(str(vendor / LOCK_NAME), timeout=timeout)


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_replace(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all: a kill mid-write leaves the previous content (or no file), never a
    truncated one (the journal: a fresh-clone walkthrough killed an update while its journal was being rewritten,
    and every later run failed on the empty file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    _fsync_write(tmp, data)
    os.replace(tmp, path)
    try:  # the rename itself, durable
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _journal_committed(journal: Path) -> bool:
    try:
        return bool(json.loads(journal.read_text()).get("committed"))
    except (OSError, ValueError, AttributeError):
        return False


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def recover(root: Path) -> list[str]:
    """Roll back (or finish) transactions left by an interrupted run. Call under :func:`repo_lock`.

    Returns a line per transaction found, for the user.
    """
    base = Path(root) / "vendor" / TXN_DIRNAME
    notes = []
    if not base.is_dir():
        return notes
    for d in sorted(base.iterdir()):
        journal = d / "journal.json"
        if journal.is_file():
            try:
                text = journal.read_text()
            except OSError as e:  # not "cut short": a journal we cannot read must not be judged (nor its backups lost)
                raise PortError(f"cannot read {journal} to finish or roll back an interrupted change: {e}") from None
            try:
                j = json.loads(text)
                if not isinstance(j, dict) or not isinstance(j.get("entries"), list):
                    raise ValueError("not a journal")
            except ValueError:
                # cut short by a kill while it was written (before _fsync_replace): it is written in full before
                # the first rename and again after the last, so the files were either all swapped or none was
                swapped = any(d.glob("backup-*")) or not any(d.glob("stage-*"))
                notes.append(f"removed transaction {d.name}, whose journal a kill had cut short: its change was "
                             f"{'applied in full' if swapped else 'not applied'}; check with python tools/port.py "
                             f"verify")
                _remove(d)
                continue
            if j.get("committed"):
                notes.append(f"finished clean-up of committed transaction {d.name}")
            else:
                _rollback(Path(root), j["entries"])
                notes.append(f"rolled back interrupted transaction {d.name}: vendor/, LICENSES/ and kernels.lock restored")
        _remove(d)
    if base.is_dir() and not any(base.iterdir()):
        base.rmdir()
    return notes


def _rollback(root: Path, entries: list[dict]) -> None:
    for e in reversed(entries):
        target = root / e["target"]
        backup = Path(e["backup"]) if e.get("backup") else None
        staged = Path(e["staged"]) if e.get("staged") else None
        placed_new = staged is not None and not staged.exists()  # the staged copy was renamed onto target
        if backup is not None and (backup.exists() or backup.is_symlink()):  # the original, aside: put it back
            if target.is_dir() and not target.is_symlink():   # (a file or link is replaced in one rename: never absent)
                _remove(target)
            os.replace(backup, target)
        elif not e.get("had_original") and placed_new:  # nothing was there before
            _remove(target)


def _keep_copy(target: Path, backup: Path) -> None:
    """``backup`` made a copy of the file ``target``, which stays in place: a hard link, else (another file system, no
    links there) a copy written under a temporary name and renamed, so that a backup that exists is whole."""
    try:
        os.link(target, backup, follow_symlinks=False)
        return
    except OSError:
        pass
    tmp = backup.with_name(f".{backup.name}.tmp")
    shutil.copy2(target, tmp, follow_symlinks=False)
    os.replace(tmp, backup)


class Transaction:
    """Stage changes, then :meth:`commit` them all or none. Use as a context manager: leaving the block
    without commit (exception, Ctrl-C) discards the staged data and touches nothing."""

    def __init__(self, root: Path):
        self.root = Path(root)
        # made at the first staged change: a run that changes nothing writes nothing (a read-only checkout synced
        # with nothing to do failed on this folder, a fresh-clone review)
        self.dir = self.root / "vendor" / TXN_DIRNAME / uuid.uuid4().hex[:12]
        self._ops: list[tuple[Path, Path | None]] = []  # (target, staged path or None = delete)
        self._n = 0
        self._live = False
        self.committed = False  # True once the commit point (the journal's committed flag) is on disk

    def _stage_path(self, name: str) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._n += 1
        return self.dir / f"stage-{self._n}-{name}"

    def stage_dir(self, target: Path) -> Path:
        """An empty folder to fill; on commit it replaces ``target`` (repository-relative or absolute)."""
        p = self._stage_path(Path(target).name)
        p.mkdir()
        self._ops.append((self._abs(target), p))
        return p

    def stage_file(self, target: Path, data: bytes) -> None:
        p = self._stage_path(Path(target).name)
        _fsync_write(p, data)
        self._ops.append((self._abs(target), p))

    def stage_delete(self, target: Path) -> None:
        self._ops.append((self._abs(target), None))

    def _abs(self, target: Path) -> Path:
        """``target`` absolute; PortError where it resolves outside the repository (a symbolic link on the way: a
        review found a raw ValueError, exit 1, which port.py documents as drift, for vendor/<source> linked
        elsewhere)."""
        t = Path(target)
        t = t if t.is_absolute() else self.root / t
        if not t.resolve().is_relative_to(self.root.resolve()):
            links = [q for q in (t, *t.parents) if q.is_relative_to(self.root) and q != self.root and q.is_symlink()]
            shown = links[-1].relative_to(self.root).as_posix() if links else str(t)
            via = (f"{shown} is a symbolic link to {os.readlink(links[-1])}" if links
                   else f"{t} resolves to {t.resolve()}")
            raise PortError(f"{via}, outside the repository {self.root}: tools/port.py writes vendor/, LICENSES/ and "
                            f"kernels.lock only inside it (all-or-nothing by renames there); replace the link with a "
                            f"folder (move what it points to in its place) and run the command again")
        return t

    def commit(self) -> None:
        if not self._ops:   # nothing staged: nothing to swap, nothing written
            self.committed = True
            return
        self.dir.mkdir(parents=True, exist_ok=True)   # (deletions alone stage no file)
        root = self.root.resolve()
        entries = []
        for i, (target, staged) in enumerate(self._ops):
            had = target.exists() or target.is_symlink()
            entries.append({"target": str(target.resolve().relative_to(root)), "staged": str(staged) if staged else None,
                            "backup": str(self.dir / f"backup-{i}") if had else None, "had_original": had})
        journal = self.dir / "journal.json"
        _fsync_replace(journal, json.dumps({"committed": False, "entries": entries}).encode())
        self._live = True  # from here until the swap or its rollback completes, the folder is recover()'s to finish
        try:
            for e, (target, staged) in zip(entries, self._ops):
                if e["backup"]:
                    if staged is not None and staged.is_file() and not target.is_dir():
                        _keep_copy(target, Path(e["backup"]))   # (replaced below in one rename: never absent)
                    else:
                        os.replace(target, e["backup"])
                if staged is not None:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(staged, target)
            _fsync_replace(journal, json.dumps({"committed": True, "entries": entries}).encode())
        except BaseException:
            if not _journal_committed(journal):  # an interrupt after the commit point rolls nothing back
                _rollback(self.root, entries)
            else:
                self.committed = True
            self._live = False
            raise
        self.committed = True
        self._live = False
        self._cleanup()

    def _cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        parent = self.dir.parent
        try:
            parent.rmdir()
        except OSError:
            pass

    def __enter__(self) -> "Transaction":
        return self

    def __exit__(self, *exc) -> None:
        # a swap or rollback cut short (a second Ctrl-C during the rollback, an OSError) keeps the journal and the
        # backups for recover() in the next run
        if self.dir.exists() and not self._live:
            self._cleanup()
