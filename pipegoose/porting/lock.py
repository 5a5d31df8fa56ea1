"""``kernels.lock``: the resolved pin of every vendored source and the sha256 of every file taken from it.

Format (YAML, keys sorted, written only by ``tools/port.py``)::

    version: 1
    sources:
      colossalai:
        kind: pypi
        pin: {name: colossalai, sha256: <archive sha256>, version: 0.5.0}
        license: Apache-2.0
        license_files: {LICENSE: <sha256>}
    kernels:
      megatron/scaled_masked_softmax:
        source: colossalai
        files: {extensions/csrc/...: <sha256>, ...}

Local sources (``pipegoose``) are recorded the same way; their files are hashed in place.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..kernels.manifest import _SOURCE_ID, safe_load_unique

from .errors import PortError

_SHA256 = re.compile(r"[0-9a-f]{64}")
_KINDS = ("pypi", "git", "local")   # (kernels.yaml's fetch kinds)

__all__ = ["Lock", "LockedSource", "LockedKernel", "LOCK_HEADER"]

LOCK_VERSION = 1
LOCK_HEADER = (
    "# kernels.lock: written by tools/port.py from kernels.yaml; do not edit by hand.\n"
    "# The resolved pin of every vendored source and the sha256 of every vendored file and license file.\n"
    "# Check with: python tools/port.py verify    Restore vendor/ with: python tools/port.py sync\n"
)


@dataclass
class LockedSource:
    kind: str
    pin: dict[str, str]
    license: str
    license_files: dict[str, str]


@dataclass
class LockedKernel:
    source: str
    files: dict[str, str]


@dataclass
class Lock:
    path: Path
    sources: dict[str, LockedSource] = field(default_factory=dict)
    kernels: dict[str, LockedKernel] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> "Lock":
        """Read a lock file; a missing file is an empty lock. Raises PortError on a malformed one."""
        path = Path(path)
        if not path.exists():
            return cls(path)
        try:
            data = safe_load_unique(path.read_text(encoding="utf-8"), path.name) or {}
        except yaml.YAMLError as e:
            raise PortError(f"{path.name}: not valid YAML: {e}") from None
        except UnicodeDecodeError as e:  # (a raw traceback, exit 1, which port.py documents as drift)
            raise PortError(f"{path.name}: not UTF-8 text ({e.reason} at byte {e.start}); restore it from git or "
                            "re-run `port.py add`") from None
        except OSError as e:
            raise PortError(f"{path.name}: cannot read it: {e.strerror or e}") from None
        if isinstance(data, dict) and "version" not in data:
            raise PortError(f"{path.name}: no 'version' key: not a whole kernels.lock (cut short?); restore it from git "
                            "or re-run `port.py add`")
        if not isinstance(data, dict) or data.get("version") != LOCK_VERSION:
            raise PortError(f"{path.name}: version: expected {LOCK_VERSION}, got {data.get('version') if isinstance(data, dict) else data!r}")
        unknown = sorted(str(k) for k in data if k not in ("version", "sources", "kernels"))
        if unknown:
            raise PortError(f"{path.name}: unknown key(s) {', '.join(unknown)}: expected version, sources and kernels; "
                            "restore it from git")
        lock = cls(path)
        try:
            for sid, s in (data.get("sources") or {}).items():
                lock.sources[sid] = LockedSource(s["kind"], {k: str(v) for k, v in s["pin"].items()}, s["license"],
                                                 dict(s.get("license_files") or {}))
            for kid, k in (data.get("kernels") or {}).items():
                lock.kernels[kid] = LockedKernel(k["source"], dict(k["files"]))
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise PortError(f"{path.name}: malformed entry ({e!r}); restore it from git or re-run `port.py add`") from None
        for sid in lock.sources:  # (a source id names folders: vendor/<id>, LICENSES/<id>)
            if not (isinstance(sid, str) and _SOURCE_ID.fullmatch(sid)):
                raise PortError(f"{path.name}: sources: {sid!r}: expected a source id as kernels.yaml's (lowercase "
                                "letters, digits, '_', '.', '-'); restore it from git or re-run `port.py add`")
        for sid, s in lock.sources.items():
            if s.kind not in _KINDS:
                raise PortError(f"{path.name}: sources.{sid}.kind: expected one of {', '.join(_KINDS)}, got {s.kind!r}; "
                                "restore it from git")
        for kid, k in lock.kernels.items():
            if k.source not in lock.sources:
                raise PortError(f"{path.name}: kernels.{kid}.source: {k.source!r} has no entry under sources")
        # every recorded path inside its folder (vendor/<source>/, LICENSES/<source>/) and every hash a sha256: a
        # hand-edited key such as /etc/passwd or ../../x made verify hash files outside the repository
        entries = [(f"kernels.{kid}.files", f, h) for kid, k in lock.kernels.items() for f, h in k.files.items()]
        entries += [(f"sources.{sid}.license_files", f, h) for sid, s in lock.sources.items()
                    for f, h in s.license_files.items()]
        for where, f, h in entries:
            parts = str(f).split("/")
            if not isinstance(f, str) or "\\" in f or any(part in ("", ".", "..") for part in parts):
                raise PortError(f"{path.name}: {where}: {f!r}: expected a relative path inside the source's folder "
                                "(no leading /, no empty, . or .. parts); restore it from git or re-run `port.py add`")
            if not (isinstance(h, str) and _SHA256.fullmatch(h)):
                raise PortError(f"{path.name}: {where}[{f!r}]: expected a sha256 (64 lowercase hex digits), got "
                                f"{h!r}; restore it from git or re-run `port.py add`")
        # one file of a source, one hash: kernels sharing a header record it alike (a bad merge of two branches that
        # each re-recorded it gave two; verify and sync checked one of them, the builder the other, and refused)
        if problem := lock.conflict():
            raise PortError(f"{path.name}: {problem}; restore kernels.lock from git (then re-record a changed file with "
                            "`python tools/port.py add` of the kernels that list it)")
        return lock

    def conflict(self) -> str:
        """The first file of a source that two kernel entries record with different sha256, said in words, or ""."""
        seen: dict[tuple[str, str], tuple[str, str]] = {}
        for kid, k in sorted(self.kernels.items()):
            for f, h in k.files.items():
                first, fh = seen.setdefault((k.source, f), (kid, h))
                if fh != h:
                    every = sorted(x for x, v in self.kernels.items() if v.source == k.source and f in v.files)
                    return (f"{k.source}'s {f} is recorded with different sha256 by kernels {', '.join(every)} "
                            f"({first}: {fh[:12]}…, {kid}: {h[:12]}…; a merge?)")
        return ""

    def copy(self) -> "Lock":
        return copy.deepcopy(self)

    def to_data(self) -> dict[str, Any]:
        return {
            "version": LOCK_VERSION,
            "sources": {sid: {"kind": s.kind, "pin": dict(sorted(s.pin.items())), "license": s.license,
                              "license_files": dict(sorted(s.license_files.items()))}
                        for sid, s in sorted(self.sources.items())},
            "kernels": {kid: {"source": k.source, "files": dict(sorted(k.files.items()))}
                        for kid, k in sorted(self.kernels.items())},
        }

    def dumps(self) -> str:
        """Deterministic text: same content, same bytes. Raises PortError for a lock that :meth:`load` would refuse
        (a file of one source recorded with two hashes)."""
        if problem := self.conflict():
            raise PortError(f"not writing {self.path.name}: {problem}")
        return LOCK_HEADER + yaml.safe_dump(self.to_data(), sort_keys=True, default_flow_style=False, width=200)

    def kernels_of(self, source_id: str) -> list[str]:
        return sorted(k for k, v in self.kernels.items() if v.source == source_id)

    def files_of_source(self, source_id: str, exclude: str | None = None) -> dict[str, str]:
        """path -> sha256 of every file that locked kernels of ``source_id`` use (optionally minus one kernel)."""
        out: dict[str, str] = {}
        for kid in self.kernels_of(source_id):
            if kid != exclude:
                out.update(self.kernels[kid].files)
        return out
