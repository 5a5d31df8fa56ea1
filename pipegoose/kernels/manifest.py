"""The kernel manifest, ``kernels.yaml``: where every kernel's bytes come from, and how to build it.

The manifest is the single record that drives porting (``tools/port.py``), building
(:class:`pipegoose.kernels.KernelBuilder`) and dispatch. It is validated on load; every error names the
file, the entry and the field, e.g. ``kernels.yaml: kernels.megatron/scaled_masked_softmax.files: expected a
non-empty list of paths``.

Layout (see ``docs/architecture.md`` for the full reference)::

    schema: 1
    sources:
      <source id>:
        project: ColossalAI
        homepage: https://...
        license: Apache-2.0            # SPDX id, one of ALLOWED_LICENSES
        license_files: [LICENSE]       # paths inside the source
        fetch:                         # exactly one of pypi / git / local
          pypi: {name: colossalai, version: 0.5.0, sha256: <64 hex>}
          git: {url: https://..., commit: <40 hex>}
          local: {path: .}             # a folder of this repository
    kernels:
      <project>/<kernel>:
        source: <source id>
        aliases: [fused_layernorm]
        origin: {project: Apex, path: csrc/layer_norm_cuda_kernel.cu, note: ...}
        files: [paths inside the source]   # .cu/.cpp are compiled, the rest are headers
        include_dirs: [paths inside the source]
        binding: pipegoose/kernels/bindings/<name>.cpp   # written here, repository-relative
        fake: pipegoose.kernels.bindings.<name>          # Python module registering fake impls
        entries:
          - {symbol: fwd_cuda, op: scaled_masked_softmax_forward, role: forward}
        dtypes: [float16, bfloat16]
        limits: {key_len_max: 2048}
        backward: true
        flags: {cxx: [-O3], nvcc: [-O3, --use_fast_math]}
"""

from __future__ import annotations

import difflib
import io
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

__all__ = [
    "ALLOWED_LICENSES",
    "ManifestError",
    "ManifestNotFoundError",
    "UnknownNameError",
    "Source",
    "Kernel",
    "Entry",
    "Manifest",
    "load_manifest",
    "repo_root",
    "default_manifest_path",
    "pending_port_change",
    "PORT_TXN_DIRNAME",
    "PORT_LOCK_NAME",
]

ALLOWED_LICENSES = ("Apache-2.0", "BSD-3-Clause", "MIT", "BSD-2-Clause")
# autograd: an op whose autograd formula (its backward) is registered with it, in C++
ENTRY_ROLES = ("forward", "backward", "autograd", "optimizer", "reduction", "utility")
DTYPES = ("float32", "float16", "bfloat16", "float64")
# How many names an unknown kernel name's error suggests (Manifest.suggest).
SUGGESTIONS = 6
_KERNEL_ID = re.compile(r"^[a-z0-9][a-z0-9_.-]*/[a-z0-9][a-z0-9_.-]*$")
_SOURCE_ID = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")
_OP_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
_HEX40 = re.compile(r"^[0-9a-f]{40}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class ManifestError(ValueError):
    """The manifest is malformed: the message names the file, the entry and the field."""


class ManifestNotFoundError(ManifestError):
    """There is no manifest file at the path (an installed wheel has none); the dispatcher takes it as its kernels
    being unavailable, where a malformed manifest stays an error."""


class UnknownNameError(KeyError):
    """A ``KeyError`` for an unknown kernel or op name whose message prints as written (``str()`` of a plain KeyError
    is the repr of its message, quotes and escapes included)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping. PyYAML keeps the last one silently, so a
    kernel entry written twice in ``kernels.yaml`` vanished, and ``port.py add`` then locked the other entry's files
    under its id (a fresh-clone walkthrough, session 38)."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # "<<: *anchor" may be followed by keys that override it
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.get(key)
        except TypeError:  # an unhashable key: the constructor below reports it
            continue
        if first is not None:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark,
                f"found the key {key!r} twice (first on line {first + 1}); each key may appear once",
                key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def safe_load_unique(text: str, name: str | None = None) -> Any:
    """``yaml.safe_load(text)``, except that a mapping with a key given twice raises ``yaml.YAMLError`` naming the
    key and both lines (used for ``kernels.yaml`` and ``kernels.lock``); ``name``: the file, for the messages."""
    stream = io.StringIO(text)
    stream.name = name or "<string>"  # (PyYAML's marks name a file-like stream by its .name)
    return yaml.load(stream, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def repo_root() -> Path:
    """The folder above the ``pipegoose`` package: the repository root, which holds ``kernels.yaml`` (pipegoose is
    installed from a clone, ``pip install -e .``; a wheel has no manifest and no ``vendor/``)."""
    return Path(__file__).resolve().parents[2]


def default_manifest_path() -> Path:
    return repo_root() / "kernels.yaml"


# tools/port.py's transactions (vendor/<this>/<id>/, pipegoose.porting.txn) and its repository lock (vendor/<this>):
# here, below both the porting toolkit and the builder, which reads them (pending_port_change)
PORT_TXN_DIRNAME = ".port-txn"
PORT_LOCK_NAME = ".port.lock"


def pending_port_change(root: str | os.PathLike) -> tuple[str, str]:
    """``(what, fix)`` for a change of ``tools/port.py`` that is running or was interrupted in the repository at
    ``root`` (its transaction folder, ``vendor/.port-txn/``, holds one: vendor/, LICENSES/, kernels.lock and
    kernels.yaml may be half-swapped); ``("", "")`` when there is none. Whether it runs is told by the repository lock,
    taken without waiting (a lock that cannot be opened, a read-only checkout: taken as interrupted). The builder
    refuses vendored kernels while there is one, and ``doctor`` fails (a review: a killed sync's vendor/ without its
    LICENSES/ passed doctor)."""
    from filelock import FileLock, Timeout

    base = Path(root) / "vendor" / PORT_TXN_DIRNAME
    try:
        if not base.is_dir() or not any(base.iterdir()):
            return "", ""
    except OSError:
        return "", ""
    try:
        with FileLock(str(base.parent / PORT_LOCK_NAME), timeout=0):
            running = False
    except Timeout:
        running = True
    except OSError:
        running = False
    where = f"vendor/{PORT_TXN_DIRNAME}/"
    if running:
        return (f"a tools/port.py run is changing vendor/, LICENSES/ and kernels.lock now ({where} holds its "
                "transaction)", "build once it has finished")
    return (f"an interrupted tools/port.py change waits in {where} (vendor/, LICENSES/, kernels.lock and kernels.yaml "
            "may be half-swapped)", "run `python tools/port.py verify` (or sync) to roll it back")


@dataclass(frozen=True)
class Source:
    """An upstream (or local) source of kernel files."""

    id: str
    project: str
    homepage: str
    license: str
    license_files: tuple[str, ...]
    kind: str  # "pypi" | "git" | "local"
    # pypi: name, version, sha256; git: url, commit; local: path
    pin: Mapping[str, str]

    @property
    def is_local(self) -> bool:
        return self.kind == "local"

    def describe_pin(self) -> str:
        if self.kind == "pypi":
            return f"{self.pin['name']}=={self.pin['version']} (sdist sha256 {self.pin['sha256'][:12]}…)"
        if self.kind == "git":
            return f"{self.pin['url']}@{self.pin['commit']}"
        return f"local:{self.pin['path']}"


@dataclass(frozen=True)
class Entry:
    """One entry symbol of a kernel: the C++ host function and the torch.library op that exposes it."""

    symbol: str
    op: str
    role: str


@dataclass(frozen=True)
class Kernel:
    id: str
    source: str
    files: tuple[str, ...]
    binding: str
    entries: tuple[Entry, ...]
    dtypes: tuple[str, ...]
    backward: bool
    aliases: tuple[str, ...] = ()
    origin: Mapping[str, str] = field(default_factory=dict)
    include_dirs: tuple[str, ...] = ()
    fake: str | None = None
    limits: Mapping[str, Any] = field(default_factory=dict)
    flags: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    description: str = ""

    @property
    def project(self) -> str:
        return self.id.split("/", 1)[0]

    @property
    def short_name(self) -> str:
        return self.id.split("/", 1)[1]

    @property
    def compiled_files(self) -> tuple[str, ...]:
        return tuple(f for f in self.files if f.endswith((".cu", ".cpp", ".cc")))

    @property
    def ops(self) -> tuple[str, ...]:
        return tuple(e.op for e in self.entries)


@dataclass
class Manifest:
    path: Path
    sources: dict[str, Source]
    kernels: dict[str, Kernel]

    @property
    def root(self) -> Path:
        return self.path.parent

    def resolve(self, name: str) -> Kernel:
        """Return the kernel with id or alias ``name``; an unknown name raises :class:`UnknownNameError` (a KeyError)
        listing up to :data:`SUGGESTIONS` names (:meth:`suggest`), or the known kernels where none is alike; an empty
        or blank name raises it saying so."""
        if name in self.kernels:
            return self.kernels[name]
        for k in self.kernels.values():
            if name in k.aliases:
                return k
        if isinstance(name, str) and not name.strip():  # (it got "did you mean" the first five ids: a review)
            raise UnknownNameError(f"no kernel name given ({name!r}): name a kernel id or alias of {self.path.name}, "
                                   f"e.g. {next(iter(self.kernels), 'pipegoose/rms_norm')}")
        close = self.suggest(name)
        hint = f"; did you mean: {', '.join(close)}" if close else f"; known kernels: {', '.join(self.kernels)}"
        raise UnknownNameError(f"unknown kernel {name!r} in {self.path.name}{hint}")

    def suggest(self, name: str, n: int | None = None) -> list[str]:
        """Ids and aliases like ``name``, at most ``n`` (default :data:`SUGGESTIONS`), each once: first those
        containing it, or its last path part (case, ``_`` and ``-`` ignored: "adam" -> "fused_adam", ...,
        "apex/multi_tensor_adam"; "foo/adam" likewise), shortest first; then difflib's close matches (cutoff 0.6),
        closest first. Both are taken: a close match found first left the substring matches out ("adam" got only
        "adam_step": a review)."""
        names = list(self.kernels) + [a for k in self.kernels.values() for a in k.aliases]

        def key(s: str) -> str:
            return re.sub(r"[_\-\s]", "", s).lower()

        keys = {key(p) for p in (name, name.strip().rstrip("/").rsplit("/", 1)[-1]) if key(p)}
        contain = sorted((c for c in names if any(k in key(c) for k in keys)), key=len)  # stable: manifest order
        # difflib's default cutoff (0.6): at 0.4, "nothere" got "did you mean: rms_norm" (a walkthrough)
        close = difflib.get_close_matches(name, names, n=len(names))
        return list(dict.fromkeys(contain + close))[:SUGGESTIONS if n is None else n]

    def source_of(self, kernel: Kernel | str) -> Source:
        k = self.resolve(kernel) if isinstance(kernel, str) else kernel
        return self.sources[k.source]

    def vendor_dir(self, source: Source | str) -> Path:
        """Where a source's files live: ``vendor/<id>`` for fetched sources, the repo folder for local ones."""
        s = self.sources[source] if isinstance(source, str) else source
        if s.is_local:
            return (self.root / s.pin["path"]).resolve()
        return self.root / "vendor" / s.id

    def kernel_paths(self, kernel: Kernel | str) -> list[Path]:
        """Absolute paths of a kernel's files (vendored or local)."""
        k = self.resolve(kernel) if isinstance(kernel, str) else kernel
        base = self.vendor_dir(k.source)
        return [base / f for f in k.files]

    def binding_path(self, kernel: Kernel | str) -> Path:
        k = self.resolve(kernel) if isinstance(kernel, str) else kernel
        return self.root / k.binding


class _Ctx:
    def __init__(self, path: Path):
        self.file = _shown(path)

    def err(self, where: str, msg: str) -> ManifestError:
        return ManifestError(f"{self.file}: {where}: {msg}")


def _shown(path: Path) -> str:
    """A manifest's path as its errors name it: relative to the working folder when inside it (``kernels.yaml``), else
    as given (``/dev/null``, not its name ``null``); links are not followed (the name the user gave is the one shown)."""
    try:
        absolute, cwd = Path(os.path.abspath(path)), Path(os.path.abspath(os.getcwd()))
    except OSError:  # the working folder is gone
        return str(path)
    if cwd != Path(cwd.anchor) and absolute.is_relative_to(cwd):
        return str(absolute.relative_to(cwd))
    return str(path)


def _req(ctx: _Ctx, d: Mapping, key: str, where: str, kind: type | tuple = str) -> Any:
    if not isinstance(d, Mapping):
        raise ctx.err(where, f"expected a mapping, got {type(d).__name__}")
    if key not in d or d[key] is None:
        raise ctx.err(f"{where}.{key}", "required field is missing")
    v = d[key]
    if not isinstance(v, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(t.__name__ for t in kind)
        raise ctx.err(f"{where}.{key}", f"expected {names}, got {type(v).__name__} ({v!r})")
    return v


def _str_list(ctx: _Ctx, d: Mapping, key: str, where: str, required: bool = True) -> tuple[str, ...]:
    if key not in d or d[key] is None:
        if required:
            raise ctx.err(f"{where}.{key}", "required field is missing")
        return ()
    v = d[key]
    if not isinstance(v, list) or (required and not v) or not all(isinstance(x, str) and x for x in v):
        raise ctx.err(f"{where}.{key}", f"expected a non-empty list of strings, got {v!r}")
    return tuple(v)


def _rel_path(ctx: _Ctx, p: str, where: str) -> str:
    if p.startswith("/") or ".." in Path(p).parts:
        raise ctx.err(where, f"expected a relative path inside the source, got {p!r}")
    return p


def _parse_source(ctx: _Ctx, sid: str, d: Any) -> Source:
    where = f"sources.{sid}"
    if not _SOURCE_ID.match(sid):
        raise ctx.err(where, "source ids are lower-case letters, digits, '.', '_' and '-'")
    if not isinstance(d, Mapping):
        raise ctx.err(where, f"expected a mapping, got {type(d).__name__}")
    unknown = set(d) - {"project", "homepage", "license", "license_files", "fetch", "description"}
    if unknown:
        raise ctx.err(where, f"unknown field(s) {sorted(unknown)}")
    project = _req(ctx, d, "project", where)
    homepage = _req(ctx, d, "homepage", where)
    lic = _req(ctx, d, "license", where)
    if lic not in ALLOWED_LICENSES:
        raise ctx.err(f"{where}.license", f"license {lic!r} is not allowed; allowed: {', '.join(ALLOWED_LICENSES)}")
    lfiles = tuple(_rel_path(ctx, p, f"{where}.license_files") for p in _str_list(ctx, d, "license_files", where))
    fetch = _req(ctx, d, "fetch", where, Mapping)
    kinds = [k for k in ("pypi", "git", "local") if k in fetch]
    if len(kinds) != 1 or len(fetch) != 1:
        raise ctx.err(f"{where}.fetch", f"expected exactly one of pypi, git, local; got {sorted(fetch)}")
    kind = kinds[0]
    spec = _req(ctx, fetch, kind, f"{where}.fetch", Mapping)
    w = f"{where}.fetch.{kind}"
    if kind == "pypi":
        version = _req(ctx, spec, "version", w, (str, int, float))
        if isinstance(version, float) or isinstance(version, bool):
            # YAML reads 0.10 as the number 0.1: the version the user meant is lost before we see it
            raise ctx.err(f"{w}.version", f"expected a version string, got the number {version!r}: quote it "
                                          f"(version: '0.10'), as YAML reads an unquoted 0.10 as 0.1")
        pin = {"name": _req(ctx, spec, "name", w), "version": str(version), "sha256": _req(ctx, spec, "sha256", w)}
        from packaging.version import InvalidVersion, Version

        try:  # (a walkthrough's "0.19.8; rm -rf /" passed here and failed later, as a mismatch with kernels.lock)
            Version(pin["version"])
        except InvalidVersion:
            raise ctx.err(f"{w}.version",
                          f"expected a PEP 440 version (e.g. '0.19.8'), got {pin['version']!r}") from None
        if not _HEX64.match(pin["sha256"]):
            raise ctx.err(f"{w}.sha256", f"expected 64 lower-case hex digits, got {pin['sha256']!r}")
    elif kind == "git":
        pin = {"url": _req(ctx, spec, "url", w), "commit": _req(ctx, spec, "commit", w)}
        if not _HEX40.match(pin["commit"]):
            raise ctx.err(f"{w}.commit", f"expected a full 40-hex commit sha, got {pin['commit']!r}")
    else:
        pin = {"path": _rel_path(ctx, _req(ctx, spec, "path", w), f"{w}.path")}
    return Source(sid, project, homepage, lic, lfiles, kind, pin)


def _parse_kernel(ctx: _Ctx, kid: str, d: Any, sources: Mapping[str, Source]) -> Kernel:
    where = f"kernels.{kid}"
    if not _KERNEL_ID.match(kid):
        raise ctx.err(where, "kernel ids have the form <project>/<kernel> (lower case)")
    if not isinstance(d, Mapping):
        raise ctx.err(where, f"expected a mapping, got {type(d).__name__}")
    allowed = {"source", "aliases", "origin", "files", "include_dirs", "binding", "fake", "entries", "dtypes",
               "limits", "backward", "flags", "description"}
    unknown = set(d) - allowed
    if unknown:
        raise ctx.err(where, f"unknown field(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    source = _req(ctx, d, "source", where)
    if source not in sources:
        raise ctx.err(f"{where}.source", f"unknown source {source!r}; declared: {', '.join(sources)}")
    files = tuple(_rel_path(ctx, p, f"{where}.files") for p in _str_list(ctx, d, "files", where))
    if not any(f.endswith((".cu", ".cpp", ".cc")) for f in files):
        raise ctx.err(f"{where}.files", "expected at least one compiled file (.cu, .cpp or .cc)")
    if len(set(files)) != len(files):
        raise ctx.err(f"{where}.files", "duplicate paths")
    include_dirs = tuple(_rel_path(ctx, p, f"{where}.include_dirs")
                         for p in _str_list(ctx, d, "include_dirs", where, required=False))
    binding = _rel_path(ctx, _req(ctx, d, "binding", where), f"{where}.binding")
    fake = d.get("fake")
    if fake is not None and not isinstance(fake, str):
        raise ctx.err(f"{where}.fake", f"expected a Python module name, got {fake!r}")
    raw_entries = _req(ctx, d, "entries", where, list)
    if not raw_entries:
        raise ctx.err(f"{where}.entries", "expected at least one entry")
    entries = []
    for i, e in enumerate(raw_entries):
        w = f"{where}.entries[{i}]"
        sym, op, role = _req(ctx, e, "symbol", w), _req(ctx, e, "op", w), _req(ctx, e, "role", w)
        if not _OP_NAME.match(op):
            raise ctx.err(f"{w}.op", f"op names are lower-case identifiers, got {op!r}")
        if role not in ENTRY_ROLES:
            raise ctx.err(f"{w}.role", f"expected one of {', '.join(ENTRY_ROLES)}, got {role!r}")
        entries.append(Entry(sym, op, role))
    dtypes = _str_list(ctx, d, "dtypes", where)
    bad = [t for t in dtypes if t not in DTYPES]
    if bad:
        raise ctx.err(f"{where}.dtypes", f"unknown dtype(s) {bad}; expected some of {', '.join(DTYPES)}")
    backward = _req(ctx, d, "backward", where, bool)
    if backward and not any(e.role == "backward" for e in entries):
        raise ctx.err(f"{where}.backward", "backward: true but no entry has role 'backward'")
    limits = d.get("limits") or {}
    if not isinstance(limits, Mapping):
        raise ctx.err(f"{where}.limits", f"expected a mapping, got {limits!r}")
    # sizes (<x>_min, <x>_max, <x>_rank) are whole numbers, a minimum at most its maximum (a walkthrough: -5 passed)
    for name, value in limits.items():
        kind = str(name).rpartition("_")[2]
        least = 0 if kind == "min" else 1
        if kind in ("min", "max", "rank") and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise ctx.err(f"{where}.limits.{name}", f"expected a whole number >= {least}, got {value!r}")
    for name, value in limits.items():  # (every value checked above first: a bad maximum is named by its own row)
        high = limits.get(str(name)[:-4] + "_max") if str(name).endswith("_min") else None
        if high is not None and value > high:
            raise ctx.err(f"{where}.limits.{name}", f"expected at most {str(name)[:-4]}_max ({high}), got {value}")
    flags_raw = d.get("flags") or {}
    if not isinstance(flags_raw, Mapping) or set(flags_raw) - {"cxx", "nvcc"}:
        raise ctx.err(f"{where}.flags", f"expected a mapping with keys cxx and/or nvcc, got {flags_raw!r}")
    flags = {k: _str_list(ctx, flags_raw, k, f"{where}.flags", required=False) for k in ("cxx", "nvcc")}
    origin = d.get("origin") or {}
    if not isinstance(origin, Mapping):
        raise ctx.err(f"{where}.origin", f"expected a mapping, got {origin!r}")
    aliases = _str_list(ctx, d, "aliases", where, required=False)
    return Kernel(kid, source, files, binding, tuple(entries), dtypes, backward, aliases,
                  {str(k): str(v) for k, v in origin.items()}, include_dirs, fake, dict(limits), flags,
                  str(d.get("description", "")))


def load_manifest(path: str | Path | None = None) -> Manifest:
    """Load and validate ``kernels.yaml`` (default: the one at the repository root).

    Raises:
        ManifestError: on any malformed field (message: ``<file>: <entry>.<field>: <what was expected>``),
            on duplicate aliases or op names, or when the file is missing or is not YAML.
    """
    # absolute: the manifest's folder is the root of vendor/ and LICENSES/, and a relative one was joined onto itself
    # where a step runs from the root (a walkthrough: `--root sub/repo` vendored into sub/repo/sub/repo/vendor)
    p = Path(path).expanduser().absolute() if path is not None else default_manifest_path()
    ctx = _Ctx(Path(path).expanduser() if path is not None else p)   # (errors name the path as given: not /a/b/../c)
    try:
        data = safe_load_unique(p.read_text(), ctx.file)
    except FileNotFoundError:
        hint = ""
        what, fix = pending_port_change(p.parent)
        if what:   # (a review: an update killed mid-swap said to reinstall)
            hint = f"; {what}: {fix}"
        elif path is None:  # (a walkthrough's wheel install said only "manifest not found")
            hint = (": pipegoose builds its kernels from a clone of its repository (kernels.yaml, kernels.lock and the "
                    "vendor/ that tools/port.py fills live there): install it with `pip install -e .` from the clone, "
                    "or pass the manifest's path (--manifest, manifest=)")
        raise ManifestNotFoundError(f"{ctx.file}: manifest not found{hint}") from None
    except (IsADirectoryError, NotADirectoryError, PermissionError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)   # (str(e) repeats the absolute path)
        raise ManifestError(f"{ctx.file}: cannot read the manifest: {type(e).__name__}: {why}") from None
    except yaml.YAMLError as e:
        raise ManifestError(f"{ctx.file}: not valid YAML: {e}") from None
    if not isinstance(data, Mapping):
        what = "the file is empty" if data is None else f"got {type(data).__name__}"
        raise ctx.err("<top>", f"expected a mapping with 'schema', 'sources' and 'kernels', {what}")
    if "schema" not in data:  # (a kernels.lock given as the manifest read "schema: expected 1, got None")
        raise ctx.err("schema", "required field is missing: not a kernels.yaml (one has schema: 1, sources and "
                      f"kernels; this file has {', '.join(map(str, list(data)[:5])) or 'no keys'})")
    if data.get("schema") != 1:
        raise ctx.err("schema", f"expected 1, got {data.get('schema')!r}")
    raw_sources = _req(ctx, data, "sources", "<top>", Mapping)
    sources = {sid: _parse_source(ctx, str(sid), d) for sid, d in raw_sources.items()}
    raw_kernels = _req(ctx, data, "kernels", "<top>", Mapping)
    kernels = {kid: _parse_kernel(ctx, str(kid), d, sources) for kid, d in raw_kernels.items()}
    seen_names: dict[str, str] = {}
    seen_ops: dict[str, str] = {}
    for k in kernels.values():
        for a in (k.id, *k.aliases):
            if a in seen_names and seen_names[a] != k.id:
                raise ctx.err(f"kernels.{k.id}.aliases", f"name {a!r} is already used by {seen_names[a]}")
            seen_names[a] = k.id
        for op in k.ops:
            if op in seen_ops:
                raise ctx.err(f"kernels.{k.id}.entries", f"op {op!r} is already declared by {seen_ops[op]}")
            seen_ops[op] = k.id
    return Manifest(p, sources, kernels)
