"""Fetch a source at a pin and read its files: registry sdists (through pip's configured index), git
repositories (gitpython) and local folders.

A fetched source is a :class:`SourceTree`: a read-only view of the files of the source at one pin
(``files()`` lists regular files as relative POSIX paths, ``read(path)`` returns the bytes). Nothing is
extracted to disk outside the download cache: archives are opened, checked member by member (no absolute
names, no ``..`` that climbs out, no link that points outside the archive) and read directly.

Download cache (``$PIPEGOOSE_PORT_CACHE``, else ``$XDG_CACHE_HOME/pipegoose/port``, else ``~/.cache/pipegoose/port``)::

    pypi/<name>/<sdist file>     archives, re-hashed on every use
    git/<key>/                   bare clones, one per URL

so a second ``sync`` needs no network. Writes into the cache are atomic (temporary file + rename) and
serialised with a file lock; temporary folders that a killed run left (``pypi/<name>/.dl-*``,
``git/.<key>-*``) are removed by the next run, under the same lock.
"""

from __future__ import annotations

import base64
import functools
import html.parser
import json
import netrc
import os
import shutil
import ssl
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Callable, Mapping

from filelock import FileLock, Timeout
from packaging.utils import InvalidSdistFilename, canonicalize_name, parse_sdist_filename
from packaging.version import InvalidVersion, Version

from ..kernels.manifest import Source
from .errors import FetchError, IntegrityError, SourceFileMissing
from .util import default_cache_dir, safe_member_path, sha256_bytes, sha256_file

__all__ = [
    "SourceTree",
    "DirTree",
    "ArchiveTree",
    "GitTree",
    "Fetcher",
    "pip_index_config",
    "IndexConfig",
    "SdistLink",
]

_ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar", ".zip")


def _remove_stale_temp(folder: Path, pattern: str) -> None:
    """Remove the temporary folders matching ``pattern`` in ``folder`` (what a download or clone killed midway
    left). Call only while holding the cache lock under which such folders are made.

    The lock is what makes this safe: every such folder is created and used only while its lock is held, and
    the OS drops a held lock when its process dies (``kill -9`` included), so while we hold it no live run is
    writing into one. An owner-pid or age check would be weaker: pids are reused, a shared cache may be used
    from other machines or containers, and a slow download can be old and still running. A cache shared by several
    hosts therefore needs a filesystem whose locks hold across them, as the kernel build cache does.
    """
    for p in folder.glob(pattern):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)  # best effort: a leftover must not fail the run


# --------------------------------------------------------------------------------------------------------
# Source trees
# --------------------------------------------------------------------------------------------------------
class SourceTree:
    """Read-only files of a source at one pin. ``pin`` is the resolved pin (what kernels.lock records)."""

    pin: dict[str, str]
    label: str
    # why the bytes were checked against neither a pin nor the package index (an sdist read from the download cache
    # with --offline for a version kernels.yaml does not pin), else ""
    unverified: str = ""

    def files(self) -> set[str]:
        raise NotImplementedError

    def read(self, path: str) -> bytes:
        raise NotImplementedError

    def has(self, path: str) -> bool:
        return path in self.files()

    def _missing(self, path: str) -> SourceFileMissing:
        return SourceFileMissing(f"{path}: not found in {self.label}")


class DirTree(SourceTree):
    """A folder on disk (the ``local`` sources: files are read in place, never copied)."""

    def __init__(self, root: Path, pin: Mapping[str, str], label: str | None = None):
        self.root = Path(root)
        self.pin = dict(pin)
        self.label = label or f"local folder {self.root}"
        self._files: set[str] | None = None

    def files(self) -> set[str]:
        if self._files is None:
            out = set()
            for dirpath, dirnames, filenames in os.walk(self.root):
                dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in ("vendor", "__pycache__")]
                for f in filenames:
                    p = Path(dirpath, f)
                    if p.is_file() and not p.is_symlink():
                        out.add(p.relative_to(self.root).as_posix())
            self._files = out
        return self._files

    def has(self, path: str) -> bool:
        p = self.root / path
        return p.is_file() and not p.is_symlink()

    def read(self, path: str) -> bytes:
        if safe_member_path(path) != path or not self.has(path):
            raise self._missing(path)
        return (self.root / path).read_bytes()


class ArchiveTree(SourceTree):
    """An sdist archive (tar.* or zip). The single top-level folder of an sdist is stripped.

    Raises:
        FetchError: the archive cannot be opened, or a member's name escapes the archive root, or a link
            points outside it, or a member is a device/fifo.
    """

    def __init__(self, archive: Path, pin: Mapping[str, str], label: str | None = None, unverified: str = ""):
        self.archive = Path(archive)
        self.pin = dict(pin)
        self.label = label or f"archive {self.archive.name}"
        # why the archive's bytes were checked against neither a pinned sha256 nor the package index's ("": they were)
        self.unverified = unverified
        self._members: dict[str, bytes] = {}
        self._load()

    def _load(self) -> None:
        name = self.archive.name
        raw: dict[str, bytes] = {}
        links: dict[str, str] = {}
        try:
            if name.endswith(".zip"):
                with zipfile.ZipFile(self.archive) as zf:
                    for info in zf.infolist():
                        rel = safe_member_path(info.filename)
                        if rel is None:
                            raise FetchError(f"{name}: unsafe member name {info.filename!r} (absolute or escapes the archive)")
                        if info.is_dir():
                            continue
                        mode = (info.external_attr >> 16) & 0o170000
                        if mode == 0o120000:  # symlink stored in a zip
                            links[rel] = zf.read(info).decode("utf-8", "replace")
                            continue
                        raw[rel] = zf.read(info)
            else:
                with tarfile.open(self.archive, "r:*") as tf:
                    for m in tf:
                        rel = safe_member_path(m.name)
                        if rel is None:
                            raise FetchError(f"{name}: unsafe member name {m.name!r} (absolute or escapes the archive)")
                        if m.isdir():
                            continue
                        if m.issym():
                            links[rel] = m.linkname
                        elif m.islnk():
                            tgt = safe_member_path(m.linkname)
                            if tgt is None:
                                raise FetchError(f"{name}: hard link {m.name!r} points outside the archive ({m.linkname!r})")
                            links[rel] = "/" + tgt  # archive-absolute marker
                        elif m.isreg():
                            f = tf.extractfile(m)
                            raw[rel] = f.read() if f is not None else b""
                        else:
                            raise FetchError(f"{name}: member {m.name!r} is not a regular file, folder or link")
        except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as e:
            # the whole path: the file to delete is the download cache's (a review: the name alone said not where)
            raise FetchError(f"{self.archive}: cannot read archive: {e}") from e
        # Resolve links inside the archive; refuse any that leave it.
        for rel, target in links.items():
            if target.startswith("/"):
                resolved = target[1:]
            else:
                resolved = safe_member_path(str(PurePosixPath(rel).parent / target))
            if resolved is None:
                raise FetchError(f"{name}: link {rel!r} points outside the archive ({target!r})")
            for _ in range(16):
                if resolved in raw or resolved not in links:
                    break
                t2 = links[resolved]
                resolved = t2[1:] if t2.startswith("/") else safe_member_path(str(PurePosixPath(resolved).parent / t2))
                if resolved is None:
                    raise FetchError(f"{name}: link {rel!r} points outside the archive")
            if resolved in raw:
                raw[rel] = raw[resolved]
        tops = {p.split("/", 1)[0] for p in raw}
        if len(tops) == 1 and all("/" in p for p in raw):  # sdists wrap everything in <name>-<version>/
            top = tops.pop() + "/"
            raw = {p[len(top):]: b for p, b in raw.items()}
        self._members = raw

    def files(self) -> set[str]:
        return set(self._members)

    def has(self, path: str) -> bool:
        return path in self._members

    def read(self, path: str) -> bytes:
        try:
            return self._members[path]
        except KeyError:
            raise self._missing(path) from None


class GitTree(SourceTree):
    """The tree of one commit of a git repository, read from the object store (no filters, no smudging)."""

    def __init__(self, repo, commit: str, pin: Mapping[str, str], label: str):
        self.pin = dict(pin)
        self.label = label
        self._blobs: dict[str, object] = {}
        c = repo.commit(commit)
        for item in c.tree.traverse():
            if item.type != "blob":
                continue  # trees and submodules
            rel = safe_member_path(item.path)
            if rel is None:
                raise FetchError(f"{label}: unsafe path {item.path!r}")
            if item.mode == 0o120000:  # symlinks: follow inside the tree only
                target = item.data_stream.read().decode("utf-8", "replace")
                resolved = safe_member_path(str(PurePosixPath(rel).parent / target))
                if resolved is None:
                    raise FetchError(f"{label}: link {rel!r} points outside the repository ({target!r})")
                self._blobs[rel] = ("link", resolved)
                continue
            self._blobs[rel] = item

    def files(self) -> set[str]:
        return {p for p in self._blobs if self._resolve(p) is not None}

    def _resolve(self, path: str):
        b = self._blobs.get(path)
        for _ in range(16):
            if isinstance(b, tuple):
                b = self._blobs.get(b[1])
            else:
                return b
        return None

    def has(self, path: str) -> bool:
        return self._resolve(path) is not None

    def read(self, path: str) -> bytes:
        b = self._resolve(path)
        if b is None:
            raise self._missing(path)
        return b.data_stream.read()


# --------------------------------------------------------------------------------------------------------
# pip's index configuration and the simple repository API
# --------------------------------------------------------------------------------------------------------
@dataclass
class IndexConfig:
    """Where pip looks for distributions here: index URLs (first = index-url), find-links, CA bundle."""

    index_urls: list[str]
    find_links: list[str] = field(default_factory=list)
    cert: str | None = None
    timeout: float = 60.0


@functools.lru_cache(maxsize=None)
def _pip_default_index() -> str:
    """pip's own default index, not ours (no index host is written in this project), asked of pip in a subprocess:
    importing pip here turns setuptools' distutils shim off for this process (``_distutils_hack`` stands aside for pip
    on Python < 3.12), so that a later ``import setuptools``, by ``torch.utils.cpp_extension`` when a kernel builds in
    the same process, failed with an AssertionError (found by a test order: porting's network tests, then a
    builder test). Raises FetchError where pip cannot say."""
    code = "from pip._internal.models.index import PyPI; print(PyPI.simple_url)"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError) as e:
        raise FetchError(f"cannot read pip's default index: {e}") from e
    return out.stdout.strip()


def pip_index_config() -> IndexConfig:
    """Read pip's configuration (``pip config list``: config files and PIP_* environment variables).

    Keys of the ``global`` and ``download`` sections and of the environment are honoured; later scopes
    override earlier ones as pip does. Raises FetchError if pip cannot be run.
    """
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise FetchError(f"cannot read pip's configuration (pip config list): {e}") from e
    vals: dict[str, str] = {}
    for line in out.splitlines():
        if "=" not in line:
            continue
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if section not in ("global", "download", ":env:"):
            continue
        vals[name] = value.strip().strip("'\"")
    # Environment variables not surfaced by every pip version.
    for env, name in (("PIP_INDEX_URL", "index-url"), ("PIP_EXTRA_INDEX_URL", "extra-index-url"),
                      ("PIP_FIND_LINKS", "find-links"), ("PIP_CERT", "cert"), ("PIP_DEFAULT_TIMEOUT", "timeout")):
        if os.environ.get(env):
            vals[name] = os.environ[env]
    index = vals.get("index-url") or _pip_default_index()
    extra = vals.get("extra-index-url", "").split()
    no_index = vals.get("no-index", "").lower() in ("1", "true", "yes")
    urls = ([] if no_index else [index]) + extra
    try:
        timeout = float(vals.get("timeout") or vals.get("default-timeout") or 60)
    except ValueError:
        timeout = 60.0
    return IndexConfig(urls, vals.get("find-links", "").split(), vals.get("cert"), timeout)


@dataclass(frozen=True)
class SdistLink:
    filename: str
    url: str
    version: Version
    sha256: str | None
    yanked: bool = False


class _AnchorParser(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            a = dict(attrs)
            if a.get("href"):
                self.links.append((a["href"], a))


def redact(url: str) -> str:
    """``url`` with its credentials (``https://user:token@host/...``) replaced by ``***``, for messages."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    return urllib.parse.urlunsplit(parts._replace(netloc=f"***@{host}" + (f":{parts.port}" if parts.port else "")))


class SimpleIndex:
    """The PEP 503/691 simple API of pip's configured indexes and find-links folders.

    Credentials as pip takes them: in an index URL (``https://user:token@host/simple``; sent as HTTP Basic auth to
    that host, for its pages and downloads alike) or, for a host without them, in ``~/.netrc``. They never appear in
    a message."""

    def __init__(self, config: IndexConfig | None = None):
        self.config = config or pip_index_config()
        ctx = ssl.create_default_context(cafile=self.config.cert) if self.config.cert else ssl.create_default_context()
        self._ctx = ctx
        self._auth: dict[str, tuple[str, str]] = {}   # host[:port] -> (user, password), from the index URLs
        for u in self.config.index_urls:
            parts = urllib.parse.urlsplit(u)
            if parts.username is not None:
                self._auth[self._host(parts)] = (urllib.parse.unquote(parts.username),
                                                 urllib.parse.unquote(parts.password or ""))

    @staticmethod
    def _host(parts: urllib.parse.SplitResult) -> str:
        return (parts.hostname or "") + (f":{parts.port}" if parts.port else "")

    def _request(self, url: str, headers: dict[str, str]) -> urllib.request.Request:
        """A request for ``url`` without credentials in it, with the Basic auth of its host (index URL or netrc)."""
        parts = urllib.parse.urlsplit(url)
        host = self._host(parts)
        auth = self._auth.get(host)
        if parts.username is not None:
            auth = (urllib.parse.unquote(parts.username), urllib.parse.unquote(parts.password or ""))
        url = urllib.parse.urlunsplit(parts._replace(netloc=host))
        if auth is None and parts.hostname:
            try:
                found = netrc.netrc().authenticators(parts.hostname)
            except (OSError, netrc.NetrcParseError):
                found = None
            if found:
                auth = (found[0] or "", found[2] or "")
        req = urllib.request.Request(url, headers=headers)
        if auth is not None:
            token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
            req.add_unredirected_header("Authorization", f"Basic {token}")
        return req

    def _get(self, url: str) -> tuple[bytes, str]:
        req = self._request(url, {"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1",
                                  "User-Agent": "pipegoose-port"})
        with urllib.request.urlopen(req, timeout=self.config.timeout, context=self._ctx) as r:
            return r.read(), r.headers.get("Content-Type", "")

    def _links_from_dir(self, folder: Path) -> list[tuple[str, str, str | None, bool]]:
        if (folder / "index.html").is_file():
            return self._parse_html((folder / "index.html").read_bytes(), folder.as_uri() + "/")
        return [(p.name, p.as_uri(), None, False) for p in sorted(folder.iterdir()) if p.is_file()]

    @staticmethod
    def _parse_html(body: bytes, base: str) -> list[tuple[str, str, str | None, bool]]:
        p = _AnchorParser()
        p.feed(body.decode("utf-8", "replace"))
        out = []
        for href, attrs in p.links:
            url = urllib.parse.urljoin(base, href)
            u, _, frag = url.partition("#")
            sha = frag.split("=", 1)[1] if frag.startswith("sha256=") else None
            fname = urllib.parse.unquote(u.rsplit("/", 1)[-1])
            out.append((fname, u, sha, "data-yanked" in attrs))
        return out

    def _links_from_index(self, index: str, name: str) -> list[tuple[str, str, str | None, bool]]:
        url = index.rstrip("/") + "/" + canonicalize_name(name) + "/"
        if url.startswith("file:"):
            folder = Path(urllib.request.url2pathname(urllib.parse.urlparse(url).path))
            return self._links_from_dir(folder) if folder.is_dir() else []
        body, ctype = self._get(url)
        parts = urllib.parse.urlsplit(url)
        url = urllib.parse.urlunsplit(parts._replace(netloc=self._host(parts)))  # links without the credentials
        if "json" in ctype:
            data = json.loads(body)
            return [(f["filename"], urllib.parse.urljoin(url, f["url"]), (f.get("hashes") or {}).get("sha256"),
                     bool(f.get("yanked"))) for f in data.get("files", [])]
        return self._parse_html(body, url)

    def sdists(self, name: str, unreachable: list[str] | None = None) -> list[SdistLink]:
        """Every sdist of ``name`` on the configured indexes and find-links folders.

        ``unreachable``, when given, gets a line (``<index>: <why>``) for each index that could not be read while
        others could (a review: without network, pypi.org's connection error went unsaid where the file:// indexes
        answered, and the message said the version was not on it).
        Raises FetchError when no index could be read at all (network failure).
        """
        want = canonicalize_name(name)
        found: list[SdistLink] = []
        errors: list[str] = []
        sources: list[tuple[str, Callable[[], list]]] = []
        for idx in self.config.index_urls:
            sources.append((idx, lambda idx=idx: self._links_from_index(idx, name)))
        for fl in self.config.find_links:
            folder = Path(urllib.request.url2pathname(urllib.parse.urlparse(fl).path)) if fl.startswith("file:") else Path(fl)
            if folder.is_dir():
                sources.append((fl, lambda folder=folder: self._links_from_dir(folder)))
        ok = 0
        for where, get in sources:
            try:
                links = get()
                ok += 1
            except (urllib.error.URLError, OSError, ValueError) as e:
                errors.append(f"{redact(where)}: {e}")
                continue
            for fname, url, sha, yanked in links:
                if not fname.endswith(_ARCHIVE_SUFFIXES):
                    continue
                try:
                    pname, ver = parse_sdist_filename(fname)
                except (InvalidSdistFilename, InvalidVersion):
                    continue
                if pname == want:
                    found.append(SdistLink(fname, url, ver, sha, yanked))
        if not ok and errors:
            raise FetchError(f"cannot reach any package index for {name}: " + "; ".join(errors))
        if unreachable is not None:
            unreachable += errors
        return found

    def download(self, link: SdistLink, dest: Path) -> None:
        if link.url.startswith("file:"):
            shutil.copyfile(urllib.request.url2pathname(urllib.parse.urlparse(link.url).path), dest)
            return
        try:
            req = self._request(link.url, {"User-Agent": "pipegoose-port"})
            with urllib.request.urlopen(req, timeout=self.config.timeout, context=self._ctx) as r, open(dest, "wb") as f:
                shutil.copyfileobj(r, f)
        except (urllib.error.URLError, OSError) as e:
            raise FetchError(f"download of {redact(link.url)} failed: {e}") from e


# --------------------------------------------------------------------------------------------------------
# The fetcher
# --------------------------------------------------------------------------------------------------------
class Fetcher:
    """Fetch sources at a pin into the download cache and open them as :class:`SourceTree` objects.

    ``root`` is the repository root (local sources are relative to it). ``offline=True`` refuses any
    network access (only the cache is used).
    """

    def __init__(self, root: Path, cache_dir: Path | None = None, offline: bool = False,
                 index: SimpleIndex | None = None):
        self.root = Path(root)
        self.cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.offline = offline
        self._index = index
        self._trees: dict[tuple, SourceTree] = {}

    # -- public -------------------------------------------------------------------------------------------
    def tree(self, source: Source, pin: Mapping[str, str] | None = None) -> SourceTree:
        """The source's files at ``pin`` (default: the manifest's pin).

        For pypi, a pin without ``sha256`` (a new version being audited) is resolved: the archive's hash is
        taken from the index when it publishes one (and checked), else computed from the download.
        For git, ``commit`` may be any ref (branch, tag, short sha) when auditing; it is resolved to a full sha.

        Raises:
            FetchError: network/index/remote failure, or the version/commit does not exist.
            IntegrityError: the archive's sha256 differs from the pin.
        """
        pin = dict(pin or source.pin)
        key = (source.kind, tuple(sorted(pin.items())))
        if key not in self._trees:
            if source.kind == "pypi":
                t = self._pypi_tree(source, pin)
            elif source.kind == "git":
                t = self._git_tree(source, pin)
            else:
                t = DirTree((self.root / pin["path"]).resolve(), pin, f"local source {source.id} ({pin['path']})")
            self._trees[key] = t
            self._trees[(source.kind, tuple(sorted(t.pin.items())))] = t
        return self._trees[key]

    def latest(self, source: Source) -> dict[str, str]:
        """The newest pin upstream: the newest final release with an sdist on pip's index (pypi), or the
        head of the default branch (git). Raises FetchError, also offline (this asks the index or the remote)."""
        if self.offline and source.kind in ("pypi", "git"):
            where = "package index" if source.kind == "pypi" else "git remote"
            what = "VERSION" if source.kind == "pypi" else "COMMIT"
            # the versions whose sdist is in the download cache (a walkthrough: the hint led to a second error when
            # several sources are vendored, and said nothing of what --to could be)
            cached = sorted(self._cached_versions(source.pin["name"]), key=Version) if source.kind == "pypi" else []
            there = f"; in the cache: {', '.join(cached)}" if cached else ""
            raise FetchError(f"{source.id}: the newest upstream is on the {where}, and --offline was given: pass --to "
                             f"{what} (its {'sdist' if source.kind == 'pypi' else 'clone'} in the download cache"
                             f"{there}) instead of --latest (the default of audit), e.g. `python tools/port.py audit "
                             f"{source.id} --offline --to {cached[-1] if cached else what}`")
        if source.kind == "pypi":
            name = source.pin["name"]
            unreachable: list[str] = []
            links = [l for l in self._index_sdists(name, unreachable) if not l.yanked and not l.version.is_prerelease]
            if not links:
                raise FetchError(f"{source.id}: no release of {name} with an sdist on the configured indexes"
                                 + self._unreachable_hint(name, unreachable))
            best = max(links, key=lambda l: l.version)
            return {"name": source.pin["name"], "version": str(best.version)}
        if source.kind == "git":
            import git  # noqa: PLC0415

            try:
                out = git.cmd.Git().ls_remote(source.pin["url"], "HEAD")
            except git.GitCommandError as e:
                raise FetchError(f"{source.id}: git ls-remote {source.pin['url']} failed: {e.stderr.strip() or e}") from e
            if not out.strip():
                raise FetchError(f"{source.id}: {source.pin['url']} has no HEAD")
            return {"url": source.pin["url"], "commit": out.split()[0]}
        return dict(source.pin)

    @property
    def index(self) -> SimpleIndex:
        if self._index is None:
            self._index = SimpleIndex()
        return self._index

    def _make_cache_dir(self, d: Path) -> None:
        """Create a folder of the download cache; FetchError naming the cache when it cannot (a raw traceback
        before, e.g. for PIPEGOOSE_PORT_CACHE=/dev/null)."""
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise FetchError(f"download cache {self.cache}: cannot create {d}: {e.strerror or e} (set "
                             "PIPEGOOSE_PORT_CACHE or --cache to a writable folder)") from None

    # -- pypi ---------------------------------------------------------------------------------------------
    def _pypi_dir(self, name: str) -> Path:
        return self.cache / "pypi" / canonicalize_name(name)

    def _cached_sdists(self, name: str) -> list[tuple[Path, Version]]:
        """The sdists of ``name`` in the download cache, with their versions."""
        d = self._pypi_dir(name)
        out = []
        for p in sorted(d.iterdir()) if d.is_dir() else []:
            if not p.name.endswith(_ARCHIVE_SUFFIXES) or p.name.startswith("."):
                continue
            try:
                pname, ver = parse_sdist_filename(p.name)
            except (InvalidSdistFilename, InvalidVersion):
                continue
            if pname == canonicalize_name(name):
                out.append((p, ver))
        return out

    def _cached_versions(self, name: str) -> list[str]:
        """The versions of ``name`` whose sdist is in the download cache."""
        return [str(v) for _, v in self._cached_sdists(name)]

    def _cached_sdist(self, name: str, version: str, sha256: str | None) -> Path | None:
        for p, ver in self._cached_sdists(name):
            if ver == Version(version) and (sha256 is None or sha256_file(p) == sha256):
                return p
        return None

    def _pypi_tree(self, source: Source, pin: dict[str, str]) -> SourceTree:
        """The sdist at ``pin``. A pinned sha256 is checked, whatever serves the file. A version kernels.yaml does not
        pin (``update --to``, ``audit --to``/``--latest``) is checked against the sha256 the package index publishes
        for it: a cached file that differs (altered, cut short) is downloaded again, and where the index publishes
        none the file is downloaded afresh (a review: whatever sdist the cache held was pinned as it was). With
        ``--offline`` the cached file is taken as it is, and the tree says so (``unverified``)."""
        name, version, want = pin["name"], pin["version"], pin.get("sha256")
        label = f"{name} {version} sdist"
        d = self._pypi_dir(name)
        if d.is_dir():
            try:  # without waiting: a run holding the lock may be using its .dl-* folder (the next run sweeps)
                with FileLock(str(d / ".lock"), timeout=0):
                    _remove_stale_temp(d, ".dl-*")
            except (Timeout, OSError):  # held, or a lock we cannot open (read-only or another user's cache): the
                pass                    # sweep is best effort, reading the cached sdist needs no lock
        whose = "kernels.yaml pins"
        fresh = False
        if want is None and not self.offline:
            link = self._index_link(name, version)
            if link.sha256:
                want, whose = link.sha256, f"the package index publishes ({redact(link.url)})"
            else:   # nothing to check a cached file against: the index's bytes, downloaded now
                fresh = True
        path = None if fresh else self._cached_sdist(name, version, want)
        unverified = ""
        if path is None:
            if self.offline:
                bad = self._cached_sdist(name, version, None)  # there, but not the pinned bytes
                if bad is not None:
                    # either may be wrong: the file (cut short, altered) or the pin (a sha256 edited by hand or
                    # by a merge; a review: the message blamed the file alone)
                    raise FetchError(f"{label}: the download cache holds {bad} with sha256 {sha256_file(bad)}, the "
                                     f"pin (kernels.yaml, kernels.lock) says sha256 {want}: either the pin is wrong "
                                     f"(edited by hand or by a merge: restore kernels.yaml and kernels.lock from git) "
                                     f"or the file is (a partial or altered download: remove it and run without "
                                     f"--offline, or put the pinned file there)")
                # the same command without --offline on a machine with network fetches this very version (sync only
                # fetches the pinned one, which is not always the one asked for here: update --to, audit --to)
                raise FetchError(f"{label}: not in the download cache {self._pypi_dir(name)} and --offline was given "
                                 f"(run the same command without --offline on a machine with network, then copy the "
                                 f"pypi/{canonicalize_name(name)}/ folder of its port cache there)")
            path = self._download_sdist(name, version, want, whose, fresh)
        elif want is None:   # offline, a version no file pins: the cached bytes as they are
            unverified = (f"{path} is the download cache's sdist of {name} {version}, which kernels.yaml does not pin, "
                          f"and --offline was given: its sha256 {sha256_file(path)} is not checked against the "
                          f"package index")
        got = sha256_file(path)
        if want and got != want:
            raise IntegrityError(f"{label}: sha256 of {path} is {got}, {whose} {want}")
        try:
            return ArchiveTree(path, {"name": name, "version": version, "sha256": got}, label, unverified)
        except FetchError as e:
            if not unverified:   # (checked against a pin or the index: the file is what they say)
                raise
            # a file cut short whose sha256 nothing pins (offline only: online it is checked against the index)
            raise FetchError(f"{e}; a partial or damaged download: delete it and run without --offline (the file is "
                             f"downloaded again, checked against the package index's sha256)") from None

    def _index_sdists(self, name: str, unreachable: list[str]) -> list[SdistLink]:
        """:meth:`SimpleIndex.sdists`, the indexes not reached added to ``unreachable``; where none could be read, the
        FetchError says what to do without network."""
        try:
            return self.index.sdists(name, unreachable)
        except FetchError as e:
            raise FetchError(f"{e}{self._unreachable_hint(name, [])}") from None

    def _unreachable_hint(self, name: str, unreachable: list[str]) -> str:
        """What to do without network: the indexes not reached and why (where others were), a copied cache and
        --offline."""
        not_reached = f"; not reached: {'; '.join(unreachable)}" if unreachable else ""
        return (f"{not_reached}; without network, copy the pypi/{canonicalize_name(name)}/ folder of the port cache of "
                f"a machine that ran the same command with network into {self._pypi_dir(name)} and pass --offline")

    def _version_links(self, name: str, version: str) -> list[SdistLink]:
        """The sdists of ``name`` ``version`` on the configured indexes (FetchError: none can be read, or none has it;
        the message names the indexes not reached)."""
        unreachable: list[str] = []
        links = [l for l in self._index_sdists(name, unreachable) if l.version == Version(version)]
        if not links:
            indexes = ", ".join(redact(u) for u in self.index.config.index_urls) or "no index"
            raise FetchError(f"no sdist of {name} {version} on {indexes}"
                             + (self._unreachable_hint(name, unreachable) if unreachable else ""))
        return links

    def _index_link(self, name: str, version: str) -> SdistLink:
        """The sdist of ``name`` ``version`` that a download takes from the configured indexes (FetchError: none
        can be read, or none has it)."""
        try:
            return self._version_links(name, version)[0]
        except FetchError as e:
            cached = self._cached_sdist(name, version, None)
            if cached is None:
                raise
            raise FetchError(f"{e}; the download cache holds {cached}, which cannot be checked against an index "
                             f"without it: pass --offline to read it as it is") from None

    def _download_sdist(self, name: str, version: str, want: str | None, whose: str = "kernels.yaml pins",
                        fresh: bool = False) -> Path:
        """Download into the cache (atomically) from the simple API of pip's configured indexes and find-links
        (``pip config``, ``PIP_INDEX_URL``, ...), and check the sha256 (``want``: what ``whose`` says) before the
        archive is kept or opened. ``fresh``: download even where the cache holds a file of that version (replaced).

        Not ``pip download``: for an sdist it builds the package's metadata, which runs the upstream ``setup.py``
        (code of a package whose hash was not checked yet) on this machine."""
        d = self._pypi_dir(name)
        self._make_cache_dir(d)
        with FileLock(str(d / ".lock"), timeout=600):
            _remove_stale_temp(d, ".dl-*")
            cached = None if fresh else self._cached_sdist(name, version, want)
            if cached is not None:
                return cached
            with tempfile.TemporaryDirectory(dir=d, prefix=".dl-") as tmp:
                tmpd = Path(tmp)
                errors = []
                got = self._simple_download(name, version, want, tmpd, errors)
                if got is None:
                    raise FetchError(f"{name}=={version}: download failed:\n  " + "\n  ".join(errors))
                sha = sha256_file(got)
                if want and sha != want:
                    raise IntegrityError(f"{name}=={version}: downloaded {got.name} has sha256 {sha}, {whose} {want}")
                final = d / got.name
                os.replace(got, final)   # (over a cached file of that name that differs: altered, cut short)
                return final

    def _simple_download(self, name: str, version: str, want: str | None, dest: Path, errors: list[str]) -> Path | None:
        try:
            links = self._version_links(name, version)
        except FetchError as e:
            errors.append(f"simple index: {e}")
            return None
        if want:
            matching = [l for l in links if l.sha256 in (None, want)]
            links = matching or links
        link = links[0]
        out = dest / link.filename
        try:
            self.index.download(link, out)
        except (FetchError, OSError) as e:
            errors.append(f"simple index: {e}")
            return None
        if link.sha256 and sha256_file(out) != link.sha256:
            errors.append(f"simple index: {link.filename} does not match the index's sha256 {link.sha256}")
            return None
        return out

    # -- git ----------------------------------------------------------------------------------------------
    def _git_tree(self, source: Source, pin: dict[str, str]) -> SourceTree:
        import git  # noqa: PLC0415

        url, ref = pin["url"], pin["commit"]
        key = sha256_bytes(url.encode())[:16]
        d = self.cache / "git" / key
        self._make_cache_dir(d.parent)
        with FileLock(str(d.parent / f".{key}.lock"), timeout=600):
            _remove_stale_temp(d.parent, f".{key}-*")
            try:
                if not (d / "HEAD").exists():
                    if self.offline:
                        raise FetchError(f"{url}: not in the download cache and --offline was given")
                    tmp = Path(tempfile.mkdtemp(dir=d.parent, prefix=f".{key}-"))
                    try:
                        git.Repo.clone_from(url, tmp, bare=True, no_checkout=True)
                        os.replace(tmp, d)
                    finally:
                        shutil.rmtree(tmp, ignore_errors=True)
                repo = git.Repo(d)
                sha = self._git_resolve(repo, ref)
                if sha is None and not self.offline:
                    repo.git.fetch(url, "+refs/heads/*:refs/heads/*", "+refs/tags/*:refs/tags/*", "--prune")
                    sha = self._git_resolve(repo, ref)
                    if sha is None and len(ref) == 40:
                        try:
                            repo.git.fetch(url, ref)
                        except git.GitCommandError:
                            pass
                        sha = self._git_resolve(repo, ref)
            except git.GitCommandError as e:
                raise FetchError(f"{url}: git failed: {(e.stderr or str(e)).strip()}") from e
            except (git.InvalidGitRepositoryError, git.NoSuchPathError) as e:
                raise FetchError(f"{url}: not a git repository: {e}") from e
            if sha is None:
                raise FetchError(f"{url}: commit {ref} not found (after fetching)")
            if len(ref) == 40 and sha != ref:
                raise IntegrityError(f"{url}: {ref} resolved to {sha}")
            return GitTree(repo, sha, {"url": url, "commit": sha}, f"{url}@{sha[:12]}")

    @staticmethod
    def _git_resolve(repo, ref: str) -> str | None:
        import gitdb  # noqa: PLC0415
        import git  # noqa: PLC0415

        try:
            c = repo.commit(ref)
            c.tree  # a full sha resolves lazily: reading the commit is what finds out that it is not in the repository
            return c.hexsha
        except (git.BadName, ValueError, gitdb.exc.BadName, gitdb.exc.BadObject):
            return None
