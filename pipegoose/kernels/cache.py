"""The kernel build cache: where builds live, their key, and the lock that makes one build per key.

Layout of ``<cache>`` (:func:`default_cache_dir`)::

    <key>/                   a published build: <name>.so, build.json, build.log (complete, or absent)
    <key>.tmp-<pid>-<rand>/  a build in progress; renamed to <key>/ in one step when it succeeded (a build killed
                             with SIGKILL or a crash leaves it behind: see :func:`clean_stale_tmp`)
    locks/<key>.lock         the lock (filelock, an OS-level flock: released when its process dies)
    locks/<key>.owner.json   who holds / last held the lock: pid, hostname, boot id, process start time
    failed/<key>/build.log   the log of the last failed build of that key

A key is ``<kernel short name>-<24 hex>``, the sha256 of every input of a build (:func:`build_key`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import shutil
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping

import filelock

from .. import _env

__all__ = [
    "KEY_SCHEMA",
    "default_cache_dir",
    "build_key",
    "file_digest",
    "process_identity",
    "owner_alive",
    "BuildLock",
    "LockTimeout",
    "entry_dir",
    "is_complete",
    "new_tmp_dir",
    "publish",
    "pid_alive",
    "tmp_owner",
    "clean_stale_tmp",
    "abandoned_tmp",
    "clean_abandoned",
]

KEY_SCHEMA = 1  # bump when the meaning of a build changes without any input changing
BUILD_INFO = "build.json"


def default_cache_dir() -> Path:
    """``$PIPEGOOSE_CACHE_DIR``, else ``$XDG_CACHE_HOME/pipegoose/kernels``, else ``~/.cache/pipegoose/kernels``
    (:func:`pipegoose._env.user_cache_dir`), made absolute: the build worker runs in another folder."""
    return _env.user_cache_dir("PIPEGOOSE_CACHE_DIR", "kernels").absolute()


def file_digest(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build_key(name: str, inputs: Mapping[str, Any]) -> str:
    """``<name>-<24 hex>``: sha256 of the canonical JSON of ``inputs`` (file digests, flags, versions, archs...).

    Any change of any value changes the key; ``name`` only makes cache folders readable.
    """
    blob = json.dumps({"schema": KEY_SCHEMA, **inputs}, sort_keys=True, separators=(",", ":"), default=str)
    return f"{_safe_name(name)}-{hashlib.sha256(blob.encode()).hexdigest()[:24]}"


def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "_-" else "_" for c in name)


def complete_entries(cache_dir: Path, name: str) -> list[tuple[Path, dict]]:
    """The published entries whose key starts with ``name`` (as :func:`build_key` writes it) and their build info;
    other kernels whose names share that prefix can be among them (compare ``info["inputs"]["kernel"]``)."""
    found = []
    for entry in sorted(Path(cache_dir).glob(f"{_safe_name(name)}-*")):
        info = is_complete(entry)
        if info is not None:
            found.append((entry, info))
    return found


# --------------------------------------------------------------------------------------------------- identity


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat), '' if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


def process_identity(pid: int | None = None) -> dict[str, Any]:
    """What identifies a process across pid reuse: pid, hostname, boot id and start time."""
    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "hostname": socket.gethostname(), "boot_id": _boot_id(), "start_time": _start_time(pid),
            "argv": " ".join(sys.argv)[:200], "since": time.time()}


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (one of another user counts; so does a zombie)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def owner_alive(owner: Mapping[str, Any]) -> bool | None:
    """True/False when the owner's liveness can be told from here (same host and boot), None otherwise."""
    if owner.get("hostname") != socket.gethostname() or owner.get("boot_id") != _boot_id():
        return None
    pid = int(owner.get("pid", -1))
    if not pid_alive(pid):
        return False
    start = _start_time(pid)
    return not (start and owner.get("start_time") and start != owner["start_time"])


# --------------------------------------------------------------------------------------------------- lock


class LockTimeout(TimeoutError):
    """The build lock stayed held by a live process for longer than the timeout."""


class LockWaitStopped(Exception):
    """The wait for a busy build lock was stopped (``stop()`` said so: Ctrl-C of ``build``)."""


def env_lock_timeout() -> float:
    """``$PIPEGOOSE_BUILD_LOCK_TIMEOUT`` seconds (unset or empty: 3600; 0: do not wait). Raises ValueError, naming
    the variable, for a value that is not a number >= 0."""
    v = os.environ.get("PIPEGOOSE_BUILD_LOCK_TIMEOUT")
    if not v:
        return 3600.0
    try:
        t = float(v)
    except ValueError:
        t = math.nan
    if not t >= 0:  # (nan, negative)
        raise ValueError(f"PIPEGOOSE_BUILD_LOCK_TIMEOUT: expected a number of seconds >= 0, got {v!r}")
    return t


class BuildLock:
    """Mutual exclusion of the builders of one key, across threads, processes and ranks on one node.

    ``filelock.FileLock`` (an OS ``flock``) does the exclusion; the kernel releases it when its holder dies, so a
    build killed with ``kill -9`` never blocks the next one: the next builder takes the lock over, notes that the
    previous owner (recorded in ``<key>.owner.json``) did not finish, and removes its half-written temp folder
    (:func:`clean_stale_tmp`).
    Where the file system has no ``flock`` (some network file systems), a ``filelock.SoftFileLock`` is used and a
    lock whose owner process is gone (same host and boot, pid gone or reused) is broken.

    Waiting is bounded: ``timeout`` seconds (default ``$PIPEGOOSE_BUILD_LOCK_TIMEOUT`` or 3600), after which
    :class:`LockTimeout` names the owner. ``on_wait(owner)`` is called once when the lock is found busy. ``stop()``,
    asked about once a second while waiting, ends the wait with :class:`LockWaitStopped` when it says True (a
    review: Ctrl-C of ``build`` waited for the other build to finish, up to the timeout).
    """

    def __init__(self, cache_dir: Path, key: str, *, timeout: float | None = None,
                 on_wait: Callable[[dict], None] | None = None, soft: bool = False,
                 stop: Callable[[], bool] | None = None):
        self.dir = Path(cache_dir) / "locks"
        self.key = key
        self.path = self.dir / f"{key}.lock"
        self.owner_path = self.dir / f"{key}.owner.json"
        self.timeout = float(timeout if timeout is not None else env_lock_timeout())
        self.on_wait = on_wait
        self.stop = stop
        self.soft = soft
        self.previous_owner: dict | None = None  # set when a dead owner's unfinished build was taken over
        self._lock: filelock.BaseFileLock | None = None

    def read_owner(self) -> dict | None:
        try:
            return json.loads(self.owner_path.read_text())
        except (OSError, ValueError):
            return None

    def _make(self) -> filelock.BaseFileLock:
        if self.soft:
            return filelock.SoftFileLock(str(self.path) + ".soft")
        return filelock.FileLock(str(self.path))

    def acquire(self) -> "BuildLock":
        self.dir.mkdir(parents=True, exist_ok=True)
        lock = self._make()
        deadline = time.monotonic() + self.timeout
        told = False
        while True:
            try:
                lock.acquire(timeout=min(1.0, max(0.0, deadline - time.monotonic())), poll_interval=0.05)
                break
            except filelock.Timeout:
                owner = self.read_owner() or {}
                if self.soft and owner and owner_alive(owner) is False:
                    # A soft lock outlives its process: break it when the owner is provably gone.
                    Path(lock.lock_file).unlink(missing_ok=True)
                    continue
                if not told and self.on_wait is not None:
                    self.on_wait(owner)
                    told = True
                if self.stop is not None and self.stop():
                    raise LockWaitStopped(f"stopped while waiting for the build lock {self.path}") from None
                if time.monotonic() >= deadline:
                    who = (f"pid {owner.get('pid')} on {owner.get('hostname')} ({owner.get('argv', '')})"
                           if owner else "an unknown process")
                    raise LockTimeout(
                        f"the build lock {self.path} is still held by {who} after {self.timeout:.0f} s; if that "
                        f"process is hung, stop it (or delete {self.path} when no build runs), or raise "
                        "PIPEGOOSE_BUILD_LOCK_TIMEOUT") from None
            except OSError as e:
                if not self.soft and e.errno in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP):
                    self.soft = True  # the file system cannot flock
                    lock = self._make()
                    continue
                raise
        self._lock = lock
        prev = self.read_owner()
        if prev and not prev.get("released") and prev.get("pid") != os.getpid():
            self.previous_owner = prev  # its holder died while holding it: a build was interrupted
        tmp = self.owner_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(process_identity()))
        os.replace(tmp, self.owner_path)
        return self

    def release(self) -> None:
        """Marks the owner record released and releases the lock. Raises nothing when the lock's files are gone (the
        cache folder removed during a build) or the record cannot be written (disk full): the lock is released all
        the same, and the error that ended the build, if any, is the one that propagates (a review: a second
        FileNotFoundError from here was chained to the build's own). An unmarked record reads, to the next holder,
        as a build that did not finish: a log line, nothing more."""
        if self._lock is None:
            return
        tmp = self.owner_path.with_suffix(f".{os.getpid()}.tmp")
        try:
            owner = self.read_owner() or {}
            owner["released"] = True
            tmp.write_text(json.dumps(owner))
            os.replace(tmp, self.owner_path)
        except OSError:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
        finally:
            try:
                self._lock.release()
            except FileNotFoundError:   # (a soft lock's marker removed with the folder: nothing is held any more)
                pass
            self._lock = None

    def __enter__(self) -> "BuildLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# --------------------------------------------------------------------------------------------------- entries


def entry_dir(cache_dir: Path, key: str) -> Path:
    return Path(cache_dir) / key


def is_complete(entry: Path) -> dict | None:
    """The build info of a published entry, or None when it is absent or incomplete: no build info, no library, or
    (entries published with them) a library whose size or sha256 is not the one recorded at publishing (a truncated
    or damaged file, which dlopen could crash on with a bus error; the builder then builds the key again)."""
    try:
        info = json.loads((entry / BUILD_INFO).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or not isinstance(info.get("library"), str) or not info["library"]:
        return None
    lib = entry / info["library"]
    try:
        if not lib.is_file():
            return None
        if "library_bytes" in info and lib.stat().st_size != info["library_bytes"]:
            return None
        if "library_sha256" in info and file_digest(lib) != info["library_sha256"]:
            return None
    except OSError:
        return None
    return info


def new_tmp_dir(cache_dir: Path, key: str) -> Path:
    d = Path(cache_dir) / f"{key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    d.mkdir(parents=True)
    return d


def publish(tmp: Path, cache_dir: Path, key: str, info: Mapping[str, Any], *, replace: bool = False) -> Path:
    """Write ``build.json`` into ``tmp`` and rename ``tmp`` to ``<cache>/<key>`` in one step.

    The caller holds the key's :class:`BuildLock`; an existing complete entry wins (``tmp`` is removed), unless
    ``replace`` (a forced rebuild): then the old entry is moved aside and removed only once ``tmp`` took its place, so
    that a rebuild that is killed or fails keeps the build there was.
    """
    (tmp / BUILD_INFO).write_text(json.dumps(dict(info), indent=1, sort_keys=True, default=str))
    final = entry_dir(cache_dir, key)
    if not replace and is_complete(final):
        shutil.rmtree(tmp, ignore_errors=True)
        return final
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        # a stray file or link at the key's name holds no build to keep: removed (moved aside, it was left behind
        # under a temp-folder name that `clean`, which removes folders only, never removed; a review)
        final.unlink()
    if final.exists():  # replaced, or an incomplete or damaged leftover
        # aside under a temp-folder name of this process, which `clean` removes should this process die now
        old = final.with_name(f"{key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
        try:
            os.rename(tmp, final)
        except BaseException:
            os.rename(old, final)  # the build there was stays
            raise
        shutil.rmtree(old, ignore_errors=True)
        return final
    os.rename(tmp, final)
    return final


# The exact name new_tmp_dir gives: <key>.tmp-<pid>-<8 hex>, <key> as build_key makes it.
_TMP_NAME = re.compile(r"(?P<key>[\w-]+-[0-9a-f]{24})\.tmp-(?P<pid>[0-9]+)-[0-9a-f]{8}")


def tmp_owner(path: str | os.PathLike) -> tuple[str, int] | None:
    """``(key, pid)`` of a temp folder named by :func:`new_tmp_dir`; None for any other name (a published
    ``<key>/``, ``locks/``, ``failed/``, anything else)."""
    m = _TMP_NAME.fullmatch(Path(path).name)
    return (m["key"], int(m["pid"])) if m else None


def _dead_tmp(cache_dir: Path, key: str | None = None) -> list[Path]:
    found = []
    for d in sorted(Path(cache_dir).glob(f"{key}.tmp-*" if key else "*.tmp-*")):
        owner = tmp_owner(d)
        if (owner and (key is None or owner[0] == key) and d.is_dir() and not d.is_symlink()
                and owner[1] != os.getpid() and not pid_alive(owner[1])):
            found.append(d)
    return found


def _rmtree(dirs: list[Path]) -> list[Path]:
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    return [d for d in dirs if not d.exists()]


def clean_stale_tmp(cache_dir: Path, key: str) -> list[Path]:
    """Remove the temp folders of ``key`` left by builds that were killed (SIGKILL, crash) before publishing.

    Removed: folders of ``<cache>`` named exactly ``<key>.tmp-<pid>-<8 hex>`` (as :func:`new_tmp_dir` names them)
    whose ``<pid>`` is not a live process on this host. Kept: those of a live pid (this process's own included;
    a reused pid keeps its folder until that process ends), the published ``<key>/``, every other name.
    Call it with the key's :class:`BuildLock` held, so that no live build of the key on another host (shared
    cache) can own one: :meth:`~pipegoose.kernels.builder.KernelBuilder.build` does, before each compile.
    Returns the folders removed.
    """
    return _rmtree(_dead_tmp(cache_dir, key))


def abandoned_tmp(cache_dir: Path) -> list[Path]:
    """The temp folders of every key that :func:`clean_stale_tmp` would remove now (owner pid gone); removes
    nothing. A folder whose key is never built again stays until :func:`clean_abandoned` removes it."""
    return _dead_tmp(cache_dir)


def clean_abandoned(cache_dir: Path) -> tuple[list[Path], list[str]]:
    """:func:`clean_stale_tmp` for every key that has :func:`abandoned_tmp` folders, each under the key's
    :class:`BuildLock` taken without waiting; a key whose lock is held (a build of it runs, maybe on another host)
    is left alone. Returns (the folders removed, the keys skipped because their lock was busy).
    ``python -m pipegoose.kernels clean`` runs it.
    """
    removed: list[Path] = []
    busy: list[str] = []
    for key in dict.fromkeys(tmp_owner(d)[0] for d in abandoned_tmp(cache_dir)):
        lock = BuildLock(cache_dir, key, timeout=0)
        try:
            lock.acquire()
        except LockTimeout:
            busy.append(key)
            continue
        try:
            removed += clean_stale_tmp(cache_dir, key)
        finally:
            lock.release()
    return removed, busy
