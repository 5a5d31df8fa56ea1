"""Small helpers shared by the porting modules: hashing and path checks."""

from __future__ import annotations

import hashlib
from pathlib import Path, PurePosixPath

from .. import _env

__all__ = ["sha256_bytes", "sha256_file", "safe_member_path", "default_cache_dir", "short_pin"]


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def safe_member_path(name: str) -> str | None:
    """Normalise an archive member name to a relative POSIX path, or None if it escapes the archive root.

    Absolute names, drive letters, ``..`` components that climb above the root and empty names are refused.
    """
    name = name.replace("\\", "/")
    if not name or name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        return None
    parts: list[str] = []
    for p in PurePosixPath(name).parts:
        if p in ("", "."):
            continue
        if p == "..":
            if not parts:
                return None
            parts.pop()
            continue
        parts.append(p)
    return "/".join(parts) if parts else None


def default_cache_dir() -> Path:
    """The download cache: ``$PIPEGOOSE_PORT_CACHE``, else ``$XDG_CACHE_HOME/pipegoose/port``, else
    ``~/.cache/pipegoose/port`` (:func:`pipegoose._env.user_cache_dir`, as for the kernel cache)."""
    return _env.user_cache_dir("PIPEGOOSE_PORT_CACHE", "port")


def short_pin(pin: dict) -> str:
    """A resolved pin as a person reads it: ``name version`` (PyPI), the commit's first 12 hex digits (git), else the
    dict as it is."""
    if "version" in pin:
        return f"{pin.get('name', '')} {pin['version']}".strip()
    if "commit" in pin:
        return str(pin["commit"])[:12]
    return str(pin)
