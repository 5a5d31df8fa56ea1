"""KernelBuilder: build (or take from the cache) and load a kernel declared in ``kernels.yaml``.

One generic builder serves every kernel; there is no per-kernel Python build code. For a kernel it reads the
manifest's ``files``, ``include_dirs``, ``flags``, ``binding``, ``fake`` and ``entries``; compiles the compiled
files plus the binding with ninja through ``torch.utils.cpp_extension`` into a plain shared library (no Python
module: bindings register ``torch.ops.pipegoose.*`` with ``TORCH_LIBRARY_FRAGMENT``/``TORCH_LIBRARY_IMPL``);
loads it with ``torch.ops.load_library``; imports the ``fake`` module (fake impls for ``torch.compile``); and checks
that every entry's op exists. See docs/architecture.md, "Kernel loading contract".

Builds run in a child process (``python -m pipegoose.kernels _worker``) whose whole output goes to a log, in a
temp folder of the cache that is renamed into place only after the child has loaded the library and found every
op (see :mod:`pipegoose.kernels.cache`). ``TORCH_CUDA_ARCH_LIST`` and ``CUDA_HOME`` are set for that child only; the
arch list also goes to nvcc as ``-gencode`` flags written here (:func:`pipegoose.kernels.toolchain.gencode_flags`), in
place of torch's, whose table lacks some architectures nvcc builds (8.8, 10.0f with torch 2.14).

Example::

    ops = KernelBuilder.from_name("fused_layernorm").load()     # alias -> apex/fused_layer_norm
    y, mean, invvar = ops.fused_layer_norm_affine_forward(x, [h], w, b, 1e-5)   # CUDA tensors (KernelOps)

    class FusedLayerNormBuilder(KernelBuilder):
        def absolute_name(self):
            return "apex/fused_layer_norm"
    FusedLayerNormBuilder().load()
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .. import _env
from . import cache as _cache
from . import toolchain
from .manifest import Kernel, Manifest, load_manifest, pending_port_change

__all__ = [
    "KernelError",
    "KernelBuildError",
    "KernelUnavailableError",
    "KernelBuildBusyError",
    "KernelOps",
    "KernelBuilder",
    "BuildResult",
    "load",
]

_PKG_PARENT = Path(__file__).resolve().parents[2]  # the folder that holds the ``pipegoose`` package


class KernelError(RuntimeError):
    """Base of the errors raised by the kernel builder."""


class KernelBuildError(KernelError):
    """Compiling or linking failed, the built library did not load, or the build cache folder disappeared or could
    not be written during the build (an OSError: the message names the path and the errno text; the OSError is its
    ``__cause__``); ``log_path`` holds the full log (None when there is none)."""

    def __init__(self, message: str, log_path: Path | None = None):
        super().__init__(message)
        self.log_path = log_path


class KernelBuildBusyError(KernelBuildError):
    """Another process held the kernel's build lock for longer than the wait allowed
    (``$PIPEGOOSE_BUILD_LOCK_TIMEOUT`` seconds, default 3600; 0: no wait), or the wait was stopped. Nothing failed to
    compile; the build was not attempted. ``log_path`` is None."""


class KernelUnavailableError(KernelError):
    """The kernel cannot be built or used here (toolchain, GPU architecture, missing files); the message says
    what to do."""


# Preflight checks that only compiling needs (not in a build's key): a cached build loads whatever they say.
_COMPILE_ONLY_CHECKS = ("cache dir", "MAX_JOBS", "ninja")
# The errnos of a write the cache folder refuses (full disk, quota, read-only file system, permissions).
_CACHE_WRITE_ERRNOS = frozenset((errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM))
# Environment variables nvcc reads itself (flags added to every call, the host compiler), and CC, which
# torch.utils.cpp_extension passes to nvcc as its host compiler (-ccbin): part of a CUDA build's key.
_NVCC_ENV = ("NVCC_APPEND_FLAGS", "NVCC_PREPEND_FLAGS", "NVCC_CCBIN", "CC")


@dataclass
class BuildResult:
    kernel: Kernel
    key: str
    entry: Path  # the published cache folder
    info: dict
    built: bool  # True when this call compiled it (False: it came from the cache)
    seconds: float = 0.0

    @property
    def library_path(self) -> Path:
        return self.entry / self.info["library"]


class KernelOps:
    """The loaded ops of one kernel: attribute ``<op>`` is ``torch.ops.pipegoose.<op>`` for each manifest entry.

    The raw ops take CUDA tensors only (meta tensors work through the fake implementations; CPU tensors get torch's
    "Could not run 'pipegoose::...' with arguments from the 'CPU' backend"); the functional API
    (:mod:`pipegoose.nn.fusion.functional`) is the one with a CPU reference path.

    Also ``.kernel`` (the manifest :class:`~pipegoose.kernels.manifest.Kernel`), ``.library_path``,
    ``.build_key`` and ``.built`` (True when this process compiled it rather than taking it from the cache).
    """

    def __init__(self, kernel: Kernel, library_path: Path, build_key: str, ops: dict[str, Any], built: bool):
        self.kernel = kernel
        self.library_path = library_path
        self.build_key = build_key
        self.built = built
        self._ops = dict(ops)

    def __getattr__(self, name: str) -> Any:
        ops = self.__dict__.get("_ops", {})
        if name in ops:
            return ops[name]
        raise AttributeError(f"kernel {self.__dict__.get('kernel').id if 'kernel' in self.__dict__ else '?'} has "
                             f"no op {name!r}; its ops: {', '.join(ops)}")

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(self._ops))

    @property
    def ops(self) -> tuple[str, ...]:
        return tuple(self._ops)

    def __repr__(self) -> str:
        # (a review: the README's snippet, run on CPU tensors, met torch's "Could not run ... 'CPU' backend")
        return (f"KernelOps({self.kernel.id}, ops=[{', '.join(self._ops)}], library={self.library_path}; "
                f"CUDA tensors only, pipegoose.nn.fusion.functional has the CPU reference path)")


_LOADED: dict[tuple[str, str], KernelOps] = {}
_LOAD_LOCK = threading.RLock()


_HEADER_SUFFIXES = frozenset((".h", ".hh", ".hpp", ".hxx", ".cuh", ".inc", ".inl", ".ipp", ".tcc"))


def quiet() -> bool:
    """``PIPEGOOSE_QUIET`` as a switch (1/true/yes/on; only "1" was taken before, "true" printed on without a word).
    Any other value keeps the progress lines, with a warning (once per value) naming it; ``doctor`` fails on it."""
    raw = os.environ.get("PIPEGOOSE_QUIET", "")
    value = _env.flag(raw)
    if value is None:
        with _QUIET_LOCK:  # (threads building at once warned twice: the check and the add were apart)
            first = raw not in _QUIET_WARNED
            _QUIET_WARNED.add(raw)
        if first:
            warnings.warn(f"PIPEGOOSE_QUIET={raw!r}: expected 1/true/yes/on or 0/false/no/off (or unset); the builder's "
                          "progress lines stay on", UserWarning, stacklevel=3)
        return False
    return value


_QUIET_WARNED: set[str] = set()
_QUIET_LOCK = threading.Lock()


def _log(msg: str) -> None:
    if not quiet():
        print(f"[pipegoose.kernels] {msg}", file=sys.stderr, flush=True)


class KernelBuilder:
    """Builds, caches and loads one kernel of the manifest.

    Args:
        name: a kernel id (``apex/fused_layer_norm``) or alias (``fused_layernorm``); subclasses may instead
            override :meth:`absolute_name`.
        manifest: a :class:`Manifest`, or the path of a ``kernels.yaml`` (default: the repository's). Sources and
            bindings are found relative to the manifest's folder.
        cache_dir: the build cache (default :func:`pipegoose.kernels.cache.default_cache_dir`).
        verbose: echo the compiler output while building (it always goes to the build log).

    Raises:
        TypeError: ``name`` not a str (at once).
        ValueError: ``cache_dir`` blank (at once).
        ManifestError: ``manifest`` names no readable, valid manifest file (at once).
        KeyError: unknown name (the message lists close matches): from :meth:`from_name` at once, else from
            :meth:`build` / :meth:`load`.
        KernelUnavailableError: (from :meth:`build` / :meth:`load`) toolchain preflight failed, vendored files or
            the binding are missing, vendored files are not what kernels.lock records or their source's license file
            (``LICENSES/<source>/``) is missing or changed, a change of tools/port.py is running or was interrupted
            (``vendor/.port-txn/``: vendored kernels only), the running GPU's architecture is not covered; the message
            says what to run.
        KernelBuildError: (from :meth:`build` / :meth:`load`) compiling, linking or loading failed (the message
            shows the first errors and the log path), or the build cache folder disappeared or could not be written
            during the build (removed, disk full, permission denied: the message names the path and the errno text).
            No OSError of building or publishing escapes otherwise.
    """

    def __init__(self, name: str | None = None, *, manifest: Manifest | str | os.PathLike | None = None,
                 cache_dir: str | os.PathLike | None = None, verbose: bool = False):
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name: expected a kernel id or alias (str), got {type(name).__name__} {name!r}")
        self._name = name
        if isinstance(manifest, Manifest):
            self.manifest = manifest
        else:
            self.manifest = load_manifest(manifest)
        # absolute: the build worker runs in the build's temp folder, where a relative path would name another place
        if cache_dir is not None and not str(os.fspath(cache_dir)).strip():
            # (a blank one was the current folder, or a folder named by the spaces; the CLI and PIPEGOOSE_CACHE_DIR
            # refuse or ignore blank values: a review)
            raise ValueError(f"cache_dir: expected a folder path (or None: the default cache), got {cache_dir!r}")
        self.cache_dir = (Path(cache_dir).expanduser().absolute() if cache_dir is not None
                          else _cache.default_cache_dir())
        self.verbose = verbose

    @classmethod
    def from_name(cls, name: str, **kwargs: Any) -> "KernelBuilder":
        """The builder of the kernel ``name`` (an id or alias of the manifest), checked now: an unknown name raises
        KeyError listing the names like it (those containing it, then close matches: :meth:`Manifest.suggest`), an
        empty one KeyError saying so, here rather than at :meth:`load`. ``kwargs``: as for the constructor."""
        builder = cls(name, **kwargs)
        builder.kernel  # noqa: B018 - resolves the name (KeyError on an unknown one)
        return builder

    def absolute_name(self) -> str:
        """The manifest id of the kernel (subclasses override this instead of passing a name)."""
        if self._name is None:
            raise TypeError("KernelBuilder needs a kernel name: KernelBuilder.from_name('<id or alias>'), or a "
                            "subclass overriding absolute_name()")
        return self._name

    # ----------------------------------------------------------------------------------------- inputs

    @property
    def kernel(self) -> Kernel:
        return self.manifest.resolve(self.absolute_name())

    @property
    def needs_cuda(self) -> bool:
        k = self.kernel
        return any(f.endswith((".cu", ".cuh")) for f in k.compiled_files) or k.binding.endswith(".cu")

    @property
    def extension_name(self) -> str:
        return "pipegoose_" + re.sub(r"[^0-9a-zA-Z_]", "_", self.kernel.id)

    def source_paths(self) -> list[Path]:
        """Absolute paths of the compiled files, then the binding."""
        k = self.kernel
        base = self.manifest.vendor_dir(k.source)
        return [base / f for f in k.compiled_files] + [self.manifest.binding_path(k)]

    def include_paths(self) -> list[Path]:
        k = self.kernel
        base = self.manifest.vendor_dir(k.source)
        return [base / d for d in k.include_dirs] + [self.manifest.binding_path(k).parent]

    def missing_files(self) -> list[Path]:
        """Kernel files and binding that do not exist (vendored files come from ``tools/port.py sync``)."""
        k = self.kernel
        paths = self.manifest.kernel_paths(k) + [self.manifest.binding_path(k)]
        return [p for p in paths if not p.is_file()]

    def _rel(self, p: Path) -> str:
        return str(p.relative_to(self.manifest.root)) if p.is_relative_to(self.manifest.root) else str(p)

    def _check_files(self) -> None:
        k = self.kernel
        src = self.manifest.sources[k.source]
        if not src.is_local:
            # a tools/port.py change running or interrupted (kill -9): vendor/, LICENSES/ and kernels.lock may be
            # half-swapped (a review: doctor passed a killed sync's vendor/ without its LICENSES/)
            what, fix = pending_port_change(self.manifest.root)
            if what:
                raise KernelUnavailableError(f"kernel {k.id}: {what}: {fix}")
        missing = self.missing_files()
        if not missing:
            return
        rel = [self._rel(p) for p in missing]
        vendored = [p for p in self.manifest.kernel_paths(k) if p != self.manifest.binding_path(k)]
        # sync restores what kernels.lock records and adds no kernel: one the lock does not record is vendored by add
        # alone (it was sent to sync too, which did nothing for it; a review)
        fetch = (f"python tools/port.py add {k.id}" if self._unlocked() else
                 f"python tools/port.py sync (or: python tools/port.py add {k.id})")
        if not src.is_local and not self.manifest.vendor_dir(k.source).exists() and set(vendored) <= set(missing):
            # nothing of the source vendored yet (a fresh clone): no file list, which says no more than this
            where = self._rel(self.manifest.vendor_dir(k.source))
            raise KernelUnavailableError(f"kernel {k.id}: not vendored yet (no {where}/): {fetch}")
        if src.is_local or all(p == self.manifest.binding_path(k) for p in missing):
            hint = "these files are part of this project: check out the complete repository"
        else:
            hint = f"vendor them first: {fetch}"
        raise KernelUnavailableError(f"kernel {k.id}: missing {len(missing)} file(s): {', '.join(rel[:6])}"
                                     f"{' ...' if len(rel) > 6 else ''}; {hint}")

    def _unlocked(self) -> bool:
        """Whether ``kernels.lock`` can be read and has no record of this kernel (``tools/port.py sync`` does not vendor
        it then: ``add`` does)."""
        from pipegoose.porting.errors import PortError
        from pipegoose.porting.lock import Lock

        try:
            return self.kernel.id not in Lock.load(self.manifest.root / "kernels.lock").kernels
        except (PortError, OSError):   # (its own line says so, in vendored_problems)
            return False

    def vendored_problems(self, digests: dict[str, str] | None = None) -> list[str]:
        """What keeps this kernel's vendored files from being the ones ``tools/port.py`` recorded in ``kernels.lock``,
        one line each (empty for this project's own kernels, and when everything matches): a file whose sha256
        differs, a file in the source's ``vendor/`` folder that the lock does not record (it could shadow a recorded
        header), a kernel the lock does not record, a lock that cannot be read, or a source pin or file list in
        kernels.yaml other than the lock's (the vendored files are the old ones). ``digests``: file -> sha256
        already computed (:meth:`key_inputs`' ``files``)."""
        return [line for line, _advice in self._vendor_state(digests)[1]]

    def modified_files(self, digests: dict[str, str] | None = None) -> list[str]:
        """The vendored files of this kernel whose sha256 differs from ``kernels.lock``, relative to the source's folder
        (part of :meth:`vendored_problems`)."""
        return self._vendor_state(digests)[0]

    def _vendor_state(self, digests: dict[str, str] | None) -> tuple[list[str], list[tuple[str, str]]]:
        """(the vendored files whose sha256 differs from ``kernels.lock``, relative to the source's folder; the lines
        of :meth:`vendored_problems`, each with the advice it takes: ``"lock"`` kernels.lock cannot be read, ``"own"``
        the line names its own command (add, update), ``"sync"`` the files differ from what sync restores)."""
        k = self.kernel
        if self.manifest.sources[k.source].is_local:
            return [], []
        from pipegoose.porting.errors import PortError
        from pipegoose.porting.lock import Lock
        from pipegoose.porting.porter import kernel_disagrees, pin_changed_by_hand, record_differs

        lock_path = self.manifest.root / "kernels.lock"
        try:
            lock = Lock.load(lock_path)
        except (PortError, OSError) as e:
            return [], [(f"kernels.lock cannot be read ({e})", "lock")]
        entry = lock.kernels.get(k.id)
        if entry is None:
            return [], [(f"{lock_path.name} has no record of this kernel (vendor it with python tools/port.py add "
                         f"{k.id})", "own")]
        # kernels.yaml and kernels.lock disagree (a new pin or file list in either): the files are not what
        # kernels.yaml declares, which port.py's list and verify call stale and sync refuses; the builder built them
        # without a word. The words are port.py's (pipegoose.porting.porter), the advice the builder's.
        stale = []
        locked = lock.sources.get(k.source)
        pin = dict(self.manifest.sources[k.source].pin)
        if locked is not None and dict(locked.pin) != pin:
            stale.append((pin_changed_by_hand(k.source, dict(locked.pin), pin), "own"))
        if why := kernel_disagrees(k, entry):
            stale.append((f"{k.id}: {why}: python tools/port.py add {k.id}", "own"))
        if locked is not None and (why := record_differs(locked, self.manifest.sources[k.source])):
            stale.append((f"kernels.yaml and kernels.lock disagree on {k.source}: {why}: python tools/port.py add "
                          f"{k.id}", "own"))
        base = self.manifest.vendor_dir(k.source)
        rel = base.relative_to(self.manifest.root)
        digests = digests or {}
        modified = [f for f, want in sorted(entry.files.items())
                    if (base / f).is_file() and (digests.get(f) or _cache.file_digest(base / f)) != want]
        # a header the lock does not record where an #include of this kernel could find it (under its include dirs or
        # beside its files) could shadow a recorded one; other strays (a .cu of a kernel no longer locked, an editor's
        # swap file) cannot, and are verify's to report
        recorded = lock.files_of_source(k.source)
        roots = [base / d for d in k.include_dirs] + [(base / f).parent for f in k.files]
        extra = sorted(str(p.relative_to(base)) for p in base.rglob("*")
                       if (p.is_file() or p.is_symlink()) and p.suffix in _HEADER_SUFFIXES
                       and str(p.relative_to(base)) not in recorded and any(p.is_relative_to(r) for r in roots))
        # the source's license files, which tools/port.py collects with its files (a review: with LICENSES/<source>/
        # LICENSE removed, doctor passed and the Apache-2.0 kernels built)
        licenses = []
        lic_dir = self.manifest.root / "LICENSES" / k.source
        for f, want in sorted(locked.license_files.items()) if locked is not None else ():
            shown = (lic_dir / f).relative_to(self.manifest.root)
            if not (lic_dir / f).is_file():
                licenses.append((f"{shown}, the source's license, is missing", "license"))
            elif _cache.file_digest(lic_dir / f) != want:
                licenses.append((f"{shown}, the source's license, differs from {lock_path.name}", "license"))
        return modified, (stale + licenses + [(f"{rel / f} differs from {lock_path.name}", "sync") for f in modified]
                          + [(f"{rel / f} is not recorded in {lock_path.name} (it could shadow a recorded header)",
                              "sync") for f in extra])

    def _check_vendored(self, digests: dict[str, str], *, building: bool = True) -> str | None:
        """Refuse to build or load vendored files that are not exactly what ``kernels.lock`` records
        (:meth:`vendored_problems`), unless ``PIPEGOOSE_ALLOW_MODIFIED_VENDOR`` is 1/true/yes/on: then they are built,
        with a warning (``building``: False for ``status``, which builds nothing: it gets the line back instead). A
        source's license file missing from ``LICENSES/<source>/`` or changed is refused whatever the variable says."""
        # The variable's value is checked first, on every build and status: a typo named at once, not only once a
        # vendored file differs (session 32's walkthrough: "2" passed doctor and build on a clean tree).
        raw = os.environ.get("PIPEGOOSE_ALLOW_MODIFIED_VENDOR", "")
        allow = _env.flag(raw)
        tagged = self._vendor_state(digests)[1]
        problems = [line for line, _advice in tagged]
        what = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
        if allow is None:
            raise KernelBuildError(f"PIPEGOOSE_ALLOW_MODIFIED_VENDOR={raw!r}: expected 1/true/yes/on or 0/false/no/off "
                                   f"(or unset)" + (f"; kernel {self.kernel.id}: {what}" if problems else ""))
        if not problems:
            return None
        licenses = [line for line, advice in tagged if advice == "license"]
        if licenses:   # (not code: PIPEGOOSE_ALLOW_MODIFIED_VENDOR builds no vendored kernel without its license)
            raise KernelUnavailableError(f"kernel {self.kernel.id}: {'; '.join(licenses)}: a vendored kernel is built "
                                         "only with the license tools/port.py collected with its files; restore it "
                                         "with python tools/port.py sync")
        if allow:
            if building:  # a warning, not the builder's progress line: PIPEGOOSE_QUIET does not hide it
                warnings.warn(f"{self.kernel.id}: building third-party code that is not what kernels.lock records "
                              f"(PIPEGOOSE_ALLOW_MODIFIED_VENDOR): {what}", UserWarning, stacklevel=3)
            return f"third-party code that is not what kernels.lock records (PIPEGOOSE_ALLOW_MODIFIED_VENDOR): {what}"
        # unavailable (as doctor says, and build's exit status 3), not a failed build: nothing was compiled. A changed
        # pin or file list (lines from kernels.yaml) names its own command: sync refuses those
        advice = {a for _line, a in tagged}
        if "lock" in advice:   # (then the only line; sync refuses such a lock too: a review)
            fix = "restore kernels.lock from git, or build the vendored files as they are with " \
                  "PIPEGOOSE_ALLOW_MODIFIED_VENDOR=1"
        elif "sync" in advice:   # (lines that name their own command, add or update, take none: a kernel the lock
            # does not record was sent to sync, which does not add it: a review)
            fix = ("restore them with python tools/port.py sync (python tools/port.py verify lists what differs; where "
                   "kernels.lock's record is what was edited, sync says so: git checkout kernels.lock), or build them "
                   "as they are with PIPEGOOSE_ALLOW_MODIFIED_VENDOR=1")
        else:
            fix = "or build the vendored files as they are with PIPEGOOSE_ALLOW_MODIFIED_VENDOR=1"
        raise KernelUnavailableError(f"kernel {self.kernel.id}: the vendored files are not what tools/port.py recorded: "
                                     f"{what}; {fix}")

    def _check_object_names(self) -> None:
        # cpp_extension names objects after the source's basename: two sources with one stem would collide.
        seen: dict[str, Path] = {}
        for p in self.source_paths():
            obj = p.stem + (".cuda.o" if p.suffix in (".cu", ".cuh") else ".o")
            if obj in seen:
                raise KernelBuildError(f"kernel {self.kernel.id}: {seen[obj]} and {p} would both compile to {obj}; "
                                       "rename the binding")
            seen[obj] = p

    def preflight(self, create_cache: bool = True) -> list[toolchain.Check]:
        return toolchain.preflight(self.cache_dir, need_cuda=self.needs_cuda, create_cache=create_cache)

    def _toolchain(self, create_cache: bool = True, defer_cache: bool = False) -> dict[str, Any]:
        """Run the preflight checks and gather what the build key and the child build need (``create_cache=False``:
        without making the cache folder, for :meth:`status`). ``defer_cache``: a cache folder that cannot be written,
        or another check that only compiling needs (``MAX_JOBS``, ninja), is not raised here but kept in
        ``self._cache_problem`` (a build that finds its entry there only reads it)."""
        checks = self.preflight(create_cache)
        # (what only compiling needs, and no key takes, does not keep a cached build from loading: a review found
        # MAX_JOBS=² turning every cached kernel unavailable, and the fused ops onto PyTorch)
        self._cache_problem = next((c for c in checks if defer_cache and c.name in _COMPILE_ONLY_CHECKS
                                    and not c.ok), None)
        failed = [c for c in checks if not c.ok and c is not self._cache_problem]
        if failed:
            lines = "; ".join(f"{c.name}: {c.detail}" + (f" -> {c.fix}" if c.fix else "") for c in failed)
            raise KernelUnavailableError(f"cannot build {self.kernel.id}: {lines}")
        import torch

        tc: dict[str, Any] = {
            "torch": [torch.__version__, getattr(torch.version, "git_version", "")],
            "compiler": list(toolchain.host_compiler()),
            "python": [sys.implementation.cache_tag, sysconfig.get_config_var("SOABI") or "",
                       bool(torch._C._GLIBCXX_USE_CXX11_ABI)],
        }
        if self.needs_cuda:
            home = toolchain.find_cuda_home()
            archs, origin = toolchain.arch_list()
            tc.update({
                "cuda_home": str(home),
                "nvcc": list(toolchain.nvcc_version(home) or ()),
                "torch_cuda": torch.version.cuda,
                "archs": toolchain.format_arch_list(archs),
                "arch_origin": origin,
                "cuda_includes": toolchain.cuda_extra_include_dirs(home),
            })
            if tc["cuda_includes"]:
                # searched after the toolkit's folders since session 63 (were -I, first): another build
                tc["cuda_include_order"] = "idirafter"
            # what nvcc itself reads from the environment (the README's fix for a too-new host compiler sets
            # NVCC_CCBIN): a build made with them is another build (a review: one was cached under the plain key)
            nvcc_env = {n: os.environ[n] for n in _NVCC_ENV if os.environ.get(n)}
            if nvcc_env:
                tc["nvcc_env"] = nvcc_env
            # and CC's compiler itself, as the host compiler's (a review: CC=/bin/false was served the cached build)
            if (cc := toolchain.nvcc_host_compiler()) is not None:
                tc["nvcc_host_compiler"] = list(cc)
        return tc

    def key_inputs(self, tc: dict[str, Any] | None = None) -> dict[str, Any]:
        """Every input of the build: file contents, binding (and headers beside it), flags, toolchain, archs."""
        tc = tc if tc is not None else self._toolchain()
        k = self.kernel
        base = self.manifest.vendor_dir(k.source)
        binding = self.manifest.binding_path(k)
        inputs = {
            "kernel": k.id,
            "files": {f: _cache.file_digest(base / f) for f in k.files},
            "binding": _cache.file_digest(binding),
            "includes": {str(p.relative_to(self.manifest.root.resolve())): _cache.file_digest(p)
                         for p in _quoted_includes([p.resolve() for p in self.source_paths()],
                                                   self.include_paths(), self.manifest.root)},
            "include_dirs": list(k.include_dirs),
            "flags": {"cxx": list(k.flags.get("cxx", ())), "nvcc": list(k.flags.get("nvcc", ()))},
            "ops": list(k.ops),
            "fake": k.fake,
            **{n: v for n, v in tc.items() if n != "arch_origin"},
        }
        return inputs

    def build_key(self) -> str:
        return _cache.build_key(self.kernel.short_name, self.key_inputs())

    def cached(self) -> BuildResult | None:
        """The cached build for the current inputs, or None (raises like :meth:`build` when unavailable)."""
        self._check_files()
        return self._cached_for(self.key_inputs(self._toolchain(defer_cache=True)))

    def _cached_for(self, inputs: dict[str, Any]) -> BuildResult | None:
        key = _cache.build_key(self.kernel.short_name, inputs)
        entry = _cache.entry_dir(self.cache_dir, key)
        info = _cache.is_complete(entry)
        return BuildResult(self.kernel, key, entry, info, built=False) if info else None

    # ----------------------------------------------------------------------------------------- build

    def build(self, force: bool = False, on_wait: Callable[[dict], None] | None = None) -> BuildResult:
        """Make sure the cache holds a build for the current inputs, compiling it when absent (or ``force``).

        Concurrent callers with one key (threads, processes, ranks on a node) produce one build: the others wait
        on the key's lock and then take the published entry. Before compiling, with the lock held, it removes the
        key's temp folders whose builder process is gone (killed before publishing; see
        :func:`pipegoose.kernels.cache.clean_stale_tmp`). Returns a :class:`BuildResult`.

        Raises:
            KeyError, KernelUnavailableError: as the class docstring says.
            KernelBuildError: compiling or linking failed (the message shows the first errors and the log path), the
                inputs changed while it compiled, or an OSError met taking the lock, compiling or publishing (the
                cache folder removed during the build, a full disk, a folder that cannot be written: the message names
                the path and the errno text); nothing is cached then, and no temp folder or empty failure record is
                left.
            KernelBuildBusyError (a KernelBuildError): the wait for another process's build of the same key ran past
                ``PIPEGOOSE_BUILD_LOCK_TIMEOUT`` or was stopped (Ctrl-C of ``build``); nothing was attempted.
        """
        t0 = time.monotonic()
        k = self.kernel
        self._check_files()
        self._check_object_names()
        tc = self._toolchain(defer_cache=True)
        inputs = self.key_inputs(tc)
        self._check_vendored(inputs["files"])
        key = _cache.build_key(k.short_name, inputs)
        entry = _cache.entry_dir(self.cache_dir, key)
        if not force and (info := _cache.is_complete(entry)):
            return BuildResult(k, key, entry, info, built=False, seconds=time.monotonic() - t0)
        if self._cache_problem is not None:   # (a read-only cache that holds the build is only read: a review)
            c = self._cache_problem
            raise KernelUnavailableError(f"cannot build {k.id}: {c.name}: {c.detail}" + (f" -> {c.fix}" if c.fix else ""))

        def waiting(owner: dict) -> None:
            if on_wait is not None:
                on_wait(owner)
            _log(f"{k.id}: waiting for the build by pid {owner.get('pid', '?')} on {owner.get('hostname', '?')}")

        # Every OSError of the lock, the compile and the publishing (the cache folder removed meanwhile, a full disk,
        # a folder that cannot be written) becomes a KernelBuildError here, in one place: a raw OSError escaped
        # dispatch.kernel(), which falls back on KernelError only, into a fused model's first forward (a review).
        try:
            return self._build_locked(k, key, entry, tc, inputs, t0, force, waiting)
        except OSError as e:
            raise self._os_error(e) from e

    def _build_locked(self, k: Kernel, key: str, entry: Path, tc: dict[str, Any], inputs: dict[str, Any], t0: float,
                      force: bool, waiting: Callable[[dict], None]) -> BuildResult:
        """:meth:`build`'s part under the key's lock: take the lock, compile into a temp folder, publish it."""
        lock = _cache.BuildLock(self.cache_dir, key, on_wait=waiting, stop=_stop_requested.is_set)
        try:
            lock.acquire()
        except _cache.LockTimeout as e:   # (a TimeoutError, an OSError: made a KernelError before build's wrapper)
            raise KernelBuildBusyError(f"{k.id}: {e}") from None
        except _cache.LockWaitStopped:   # (stop_workers: Ctrl-C of build while another process builds this key)
            raise KernelBuildBusyError(f"{k.id}: build stopped (interrupted) while waiting for another process's "
                                       "build of it; nothing was cached", None) from None
        try:
            if lock.previous_owner:
                po = lock.previous_owner
                _log(f"{k.id}: the build by pid {po.get('pid')} on {po.get('hostname')} did not finish "
                     "(process gone); taking over")
            if not force and (info := _cache.is_complete(entry)):
                return BuildResult(k, key, entry, info, built=False, seconds=time.monotonic() - t0)
            _cache.clean_stale_tmp(self.cache_dir, key)
            # (a forced rebuild keeps the entry there is until the new one replaces it: publish(replace=True))
            tmp = _cache.new_tmp_dir(self.cache_dir, key)
            try:
                lib = self._compile(tmp, tc)
                # the inputs hashed again: a file edited while it compiled would be served under the key of the
                # files as they were (a fresh-clone review, session 60: the cache then served the edited code after
                # the edit was undone)
                changed = sorted(n for n, v in self.key_inputs(tc).items() if inputs.get(n) != v)
                if changed:
                    raise KernelBuildError(f"{k.id}: its inputs changed while it compiled ({', '.join(changed)}); "
                                           "nothing was cached: build again", None)
                info = {
                    "kernel": k.id, "key": key, "library": lib.name, "built_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "seconds": round(time.monotonic() - t0, 2), "archs": tc.get("archs"), "inputs": inputs,
                    "library_bytes": lib.stat().st_size, "library_sha256": _cache.file_digest(lib),
                }
                # (in the try: a publish that fails, say writing build.json on a full disk, left its temp folder)
                entry = _cache.publish(tmp, self.cache_dir, key, info, replace=force)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            # an earlier failure of this key is no longer what doctor should report
            shutil.rmtree(self.cache_dir / "failed" / key, ignore_errors=True)
            return BuildResult(k, key, entry, _cache.is_complete(entry) or info, built=True,
                               seconds=time.monotonic() - t0)
        finally:
            lock.release()

    def _os_error(self, e: OSError) -> KernelBuildError:
        """The KernelBuildError of an OSError met while building or publishing: the path and the errno text, and
        what to do."""
        k = self.kernel
        path = Path(os.fsdecode(e.filename)) if e.filename is not None else None
        what = f"{e.strerror or e}" + (f": {path}" if path is not None else "")
        in_cache = path is not None and path.absolute().is_relative_to(self.cache_dir)
        if isinstance(e, FileNotFoundError) and (in_cache or not self.cache_dir.is_dir()):
            return KernelBuildError(f"{k.id}: the build cache folder {self.cache_dir} (or part of it) disappeared "
                                    f"during the build ({what}); nothing was cached: leave the folder in place while "
                                    "a build runs, and build again", None)
        # (a write to a full disk names no file: the cache folder is where the build writes)
        if in_cache or (path is None and e.errno in _CACHE_WRITE_ERRNOS):
            if path is None:
                what += f": {self.cache_dir}"
            return KernelBuildError(f"{k.id}: the build cache folder {self.cache_dir} could not be written during the "
                                    f"build ({what}); nothing was cached: free disk space or fix the folder's "
                                    "permissions (or set PIPEGOOSE_CACHE_DIR to another folder), and build again", None)
        return KernelBuildError(f"{k.id}: building failed ({what}); nothing was cached", None)

    def _compile(self, tmp: Path, tc: dict[str, Any]) -> Path:
        k = self.kernel
        log_path = tmp / "build.log"
        # the wheel folders of the CUDA library headers the toolkit lacks: searched after the toolkit's own
        inc_cflags, inc_cuda_cflags = toolchain.cuda_extra_include_flags(list(tc.get("cuda_includes", [])))
        spec = {
            "name": self.extension_name,
            "sources": [str(p) for p in self.source_paths()],
            "include_paths": [str(p) for p in self.include_paths()],
            "cflags": list(k.flags.get("cxx", ())) + inc_cflags,
            # (the -gencode flags of the arch list: ours, not torch's table, which lacks some nvcc builds)
            "cuda_cflags": list(k.flags.get("nvcc", ())) + inc_cuda_cflags
            + (toolchain.gencode_flags(toolchain.parse_arch_list(tc["archs"])) if self.needs_cuda else []),
            "build_directory": str(tmp),
            "with_cuda": self.needs_cuda,
            "cuda_home": tc.get("cuda_home"),
            "fake": k.fake,
            "ops": list(k.ops),
            "pythonpath": [str(self.manifest.root)],
            "result": str(tmp / "result.json"),
        }
        spec_path = tmp / "spec.json"
        spec_path.write_text(json.dumps(spec, indent=1))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(_PKG_PARENT), str(self.manifest.root)]
                                            + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        if self.needs_cuda:
            env["TORCH_CUDA_ARCH_LIST"] = tc["archs"]
            env["CUDA_HOME"] = tc["cuda_home"]
            env["PATH"] = os.pathsep.join([str(Path(tc["cuda_home"]) / "bin"), env.get("PATH", "")])
        _log(f"{k.id}: building ({'archs ' + tc['archs'] if self.needs_cuda else 'C++'}), log: {log_path}")
        cmd = [sys.executable, "-m", "pipegoose.kernels", "_worker", str(spec_path)]
        with open(log_path, "wb") as log:
            log.write(f"$ {' '.join(cmd)}\n# TORCH_CUDA_ARCH_LIST={env.get('TORCH_CUDA_ARCH_LIST', '')} "
                      f"CUDA_HOME={env.get('CUDA_HOME', '')} MAX_JOBS={env.get('MAX_JOBS', '')}\n".encode())
            log.flush()
            rc = _run_worker(cmd, env=env, cwd=tmp, log=log, echo=self.verbose)
        result = None
        if rc == 0:
            try:
                result = json.loads((tmp / "result.json").read_text())
            except (OSError, ValueError):
                result = None
        if rc < 0 and _stop_requested.is_set():
            # killed by stop_workers' signal (Ctrl-C of build), not a failure of the sources: no failed/ record,
            # which doctor would report as "last build failed" (a fresh-clone walkthrough)
            raise KernelBuildError(f"{k.id}: build stopped (interrupted); nothing was cached", None)
        if rc != 0 or not result:
            # the log read first: a build whose temp folder was removed (the cache folder deleted meanwhile) raises
            # FileNotFoundError here (build() says so) before failed/ is made, which mkdir(parents=True) would make
            # again, cache folder and all, empty (a review)
            text = log_path.read_bytes()
            failed = self.cache_dir / "failed" / tmp.name.split(".tmp-")[0]
            failed.parent.mkdir(exist_ok=True)   # (not parents=True: a cache folder removed meanwhile stays removed)
            failed.mkdir(exist_ok=True)
            kept = failed / "build.log"
            try:
                kept.write_bytes(text)
            except BaseException:   # (a full disk: no empty or truncated failure record)
                shutil.rmtree(failed, ignore_errors=True)
                raise
            raise KernelBuildError(_failure_message(k.id, text.decode(errors="replace"), kept, rc), kept)
        lib = Path(result["library"])
        # Keep the library and the log; the objects and ninja files are not needed to load it, and the worker's
        # spec.json / result.json name this temporary folder, which publishing renames (build.json is the record).
        for p in tmp.iterdir():
            if p.is_file() and (p.suffix == ".o" or p.name in (".ninja_deps", ".ninja_log", "lock", "spec.json",
                                                               "result.json")):
                p.unlink()
        return tmp / lib.relative_to(tmp) if lib.is_relative_to(tmp) else lib

    # ----------------------------------------------------------------------------------------- load

    def load(self) -> KernelOps:
        """Build (or take from the cache) and load the kernel; the same :class:`KernelOps` on every call.

        Raises:
            KeyError, KernelUnavailableError, KernelBuildError: as the class docstring says.
            KernelError: another build of this kernel, or of one with the same op names, is already loaded in this
                process (a library cannot be unloaded: restart the process).
        """
        k = self.kernel
        reg = (str(self.manifest.path.resolve()), k.id)
        with _LOAD_LOCK:
            if reg in _LOADED:
                return _LOADED[reg]
            for (mpath, kid), ops in _LOADED.items():
                if kid == k.id or set(ops.ops) & set(k.ops):
                    raise KernelError(f"ops of {k.id} are already loaded in this process from {ops.library_path} "
                                      f"(manifest {mpath}); restart the process to load another build")
            res = self.build()
            self._check_gpu_covered(res)
            ops = self._load_library(res)
            _LOADED[reg] = ops
            return ops

    def _check_gpu_covered(self, res: BuildResult) -> None:
        if not self.needs_cuda:
            return
        caps = toolchain.visible_capabilities()
        if not caps or not res.info.get("archs"):
            return
        archs = toolchain.parse_arch_list(res.info["archs"])
        missing = [c for c in caps if not toolchain.arch_covers(archs, c)]
        if missing:
            sm = ", ".join(f"sm_{a}{b}" for a, b in missing)
            raise KernelUnavailableError(
                f"{self.kernel.id} was built for {res.info['archs']}, which does not cover this GPU ({sm}): "
                f"add {';'.join(f'{a}.{b}' for a, b in missing)} to TORCH_CUDA_ARCH_LIST (or unset it) and load again")

    def _load_library(self, res: BuildResult) -> KernelOps:
        import torch

        k = self.kernel
        lib = res.library_path
        try:
            torch.ops.load_library(str(lib))
        except Exception as e:  # undefined symbols, duplicate registrations
            raise KernelBuildError(f"{k.id}: loading {lib} failed: {e}", None) from e
        if k.fake:
            root = str(self.manifest.root)
            if root not in sys.path and str(_PKG_PARENT) != root:
                sys.path.append(root)
            try:
                importlib.import_module(k.fake)
            except Exception as e:
                raise KernelError(f"{k.id}: importing its fake impls {k.fake!r} failed: {e}") from e
        ops: dict[str, Any] = {}
        missing = []
        for op in k.ops:
            try:
                ops[op] = getattr(torch.ops.pipegoose, op)
            except (AttributeError, RuntimeError):
                missing.append(op)
        if missing:
            raise KernelBuildError(f"{k.id}: {lib} loaded but does not define torch.ops.pipegoose."
                                   f"{', '.join(missing)}; check the binding {k.binding}")
        return KernelOps(k, lib, res.key, ops, res.built)

    # ----------------------------------------------------------------------------------------- status

    def status(self) -> dict[str, Any]:
        """The kernel's state without building: ``state`` in {cached, loaded, not built, unavailable}."""
        k = self.kernel
        out: dict[str, Any] = {"kernel": k.id, "state": "not built", "detail": "", "key": None}
        reg = (str(self.manifest.path.resolve()), k.id)
        if reg in _LOADED:
            return {**out, "state": "loaded", "detail": str(_LOADED[reg].library_path), "key": _LOADED[reg].build_key}
        try:  # as cached(), keeping the toolchain and inputs for the "not built" details
            self._check_files()
            # a state makes no folder (doctor, list); a cache that cannot be written still serves what it holds
            tc = self._toolchain(create_cache=False, defer_cache=True)
        except (KernelUnavailableError, KernelBuildError) as e:
            return {**out, "state": "unavailable", "detail": str(e)}
        cache_problem = self._cache_problem
        inputs = self.key_inputs(tc)
        try:
            allowed = self._check_vendored(inputs["files"], building=False)
        except (KernelUnavailableError, KernelBuildError) as e:  # what build() and load() refuse: doctor says so
            return {**out, "state": "unavailable", "detail": str(e)}
        note = f" ({allowed})" if allowed else ""
        res = self._cached_for(inputs)
        if res is None and cache_problem is not None:   # (build would refuse: doctor says so)
            c = cache_problem
            return {**out, "state": "unavailable",
                    "detail": f"cannot build {k.id}: {c.name}: {c.detail}" + (f" -> {c.fix}" if c.fix else "")}
        if res is None:
            key = _cache.build_key(k.short_name, inputs)
            failed = self.cache_dir / "failed" / key / "build.log"
            entry = _cache.entry_dir(self.cache_dir, key)
            if failed.is_file():
                detail = f"last build failed, log: {failed}"
            elif entry.is_dir():  # (it said "not built" and nothing more; a fresh-clone walkthrough)
                detail = (f"the cached build {entry} is incomplete or damaged (its library is not the one recorded "
                          "when it was built): the next build replaces it")
            else:
                detail = self._other_archs_hint(inputs, tc)
            return {**out, "state": "not built", "key": key, "detail": detail + note}
        return {**out, "state": "cached", "key": res.key, "detail": str(res.library_path) + note}

    def _other_archs_hint(self, inputs: dict[str, Any], tc: dict[str, Any]) -> str:
        """A line naming the cached builds of this kernel that differ from the current inputs only in their GPU
        architectures (say, built with ``TORCH_CUDA_ARCH_LIST=9.0`` where this shell targets every architecture),
        or "" when there are none."""
        if not self.needs_cuda:
            return ""
        found = []
        for entry, info in _cache.complete_entries(self.cache_dir, self.kernel.short_name):
            archs = (info.get("inputs") or {}).get("archs") if isinstance(info.get("inputs"), dict) else None
            # the entry is the build of exactly these inputs with its own architectures: its key says so (the
            # recorded inputs alone could differ from the ones that made the key)
            if isinstance(archs, str) and archs != inputs.get("archs") and \
                    _cache.build_key(self.kernel.short_name, {**inputs, "archs": archs}) == entry.name:
                found.append(archs)
        if not found:
            return ""
        lists = " or ".join(f'TORCH_CUDA_ARCH_LIST="{a}"' for a in sorted(set(found)))
        return (f"built for other GPU architectures than this shell's {tc['archs']} (from {tc['arch_origin']}): "
                f"{lists} selects that build where it covers the visible GPUs")


def _quoted_includes(sources: list[Path], search: list[Path], root: Path) -> list[Path]:
    """Files reached from ``sources`` through ``#include "..."`` (resolved against the including file's folder,
    then ``search``), recursively, limited to files under ``root``: part of the build key, so that editing a
    header a kernel or binding includes rebuilds it even when the manifest does not list that header."""
    root = root.resolve()
    seen: dict[Path, None] = {}
    todo = list(sources)
    while todo:
        f = todo.pop()
        try:
            text = f.read_text(errors="replace")
        except OSError:
            continue
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, re.M):
            for base in [f.parent, *search]:
                h = (base / name).resolve()
                if h.is_file():
                    if h.is_relative_to(root) and h not in seen and h not in sources:
                        seen[h] = None
                        todo.append(h)
                    break
    return sorted(seen)


def _failure_message(kernel_id: str, log: str, kept: Path, rc: int) -> str:
    pat = re.compile(r"(\berror\b|undefined (reference|symbol)|FAILED:|fatal|Traceback|Error:)", re.I)
    lines = [ln.rstrip() for ln in log.splitlines() if pat.search(ln) and "-Werror" not in ln]
    first = lines[:12] or log.strip().splitlines()[-12:]
    return (f"building {kernel_id} failed (exit status {rc}); first errors:\n  " + "\n  ".join(first)
            + f"\nfull log: {kept}")


def load(name: str, **kwargs: Any) -> KernelOps:
    """Shortcut for ``KernelBuilder.from_name(name, **kwargs).load()``; raises what :meth:`KernelBuilder.load`
    raises."""
    return KernelBuilder.from_name(name, **kwargs).load()


# The build workers running now (_run_worker), for stop_workers.
_workers: set[subprocess.Popen] = set()
_workers_lock = threading.Lock()
_stop_requested = threading.Event()


def _run_worker(cmd: list[str], *, env: dict, cwd: Path, log: Any, echo: bool) -> int:
    """Runs the build worker ``cmd`` with its output into ``log`` (a binary file; with ``echo`` also to stderr, line
    by line) and returns its exit status. On POSIX the worker leads a process group of its own (ninja and the
    compilers join it): whatever ends the wait early (Ctrl-C, an error while copying the output) stops that whole
    group before it propagates, so that no compiler outlives the build (:func:`_stop_group`). If this process is
    killed outright, the worker notices and stops its group itself (:func:`_exit_with_parent`)."""
    posix = os.name == "posix"
    with _workers_lock:
        if _stop_requested.is_set():
            raise RuntimeError("build stopped: stop_workers() was called")
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE if echo else log,
                                stderr=subprocess.STDOUT, start_new_session=posix)
        _workers.add(proc)
    try:
        if echo:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                sys.stderr.buffer.write(line)
        return proc.wait()
    finally:
        if proc.poll() is None:
            _stop_group(proc, posix)
        with _workers_lock:
            _workers.discard(proc)


def stop_workers() -> None:
    """Stops every build worker of this process and refuses new ones (builds then fail): for a caller that runs
    builds in threads and is interrupted (``python -m pipegoose.kernels build``), where the interrupt reaches only the
    main thread while the workers, in process groups of their own, do not see the terminal's Ctrl-C."""
    with _workers_lock:
        _stop_requested.set()
        live = list(_workers)
    for proc in live:
        if proc.poll() is None:
            _stop_group(proc, os.name == "posix")


def _stop_group(proc: subprocess.Popen, posix: bool, grace_s: float = 5.0) -> None:
    """SIGTERM to the worker's process group (POSIX; elsewhere the worker alone), SIGKILL after ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (getattr(signal, "SIGKILL", signal.SIGTERM), None)):
        try:
            if posix:
                os.killpg(proc.pid, sig)
            elif sig == signal.SIGTERM:
                proc.terminate()
            else:
                proc.kill()
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _exit_with_parent(poll_s: float = 0.5) -> None:
    """In the build worker: a daemon thread that, once the process that started the worker is gone (the worker was
    re-parented: its parent was killed, even with SIGKILL), stops the worker's process group, ninja and the
    compilers with it, when the worker leads that group (as :func:`_run_worker` starts it), else the worker alone.
    The build's temp folder is then left unpublished, for the next build of its key (or ``clean``) to remove."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        if os.name == "posix" and os.getpgrp() == os.getpid():
            os.killpg(0, signal.SIGTERM)
        os._exit(1)

    threading.Thread(target=watch, name="pipegoose-parent-watch", daemon=True).start()


def _worker_main(spec_path: str) -> int:
    """The child build: compile with cpp_extension, load the library, import the fakes, check the ops."""
    _exit_with_parent()
    spec = json.loads(Path(spec_path).read_text())
    for p in spec.get("pythonpath", []):
        if p not in sys.path:
            sys.path.insert(0, p)
    import torch
    import torch.utils.cpp_extension as cpp_extension

    if spec.get("cuda_home"):
        cpp_extension.CUDA_HOME = spec["cuda_home"]
    print(f"# torch {torch.__version__} (CUDA {torch.version.cuda}), CUDA_HOME={cpp_extension.CUDA_HOME}", flush=True)
    lib = cpp_extension.load(
        name=spec["name"], sources=spec["sources"], extra_cflags=spec["cflags"],
        extra_cuda_cflags=spec["cuda_cflags"] if spec["with_cuda"] else None,
        extra_include_paths=spec["include_paths"], build_directory=spec["build_directory"], verbose=True,
        with_cuda=spec["with_cuda"], is_python_module=False)
    print(f"# built {lib}", flush=True)
    if spec.get("fake"):
        importlib.import_module(spec["fake"])
    missing = [op for op in spec["ops"] if not hasattr(torch.ops.pipegoose, op)]
    if missing:
        print(f"error: the library does not define torch.ops.pipegoose.{', '.join(missing)}", flush=True)
        return 3
    Path(spec["result"]).write_text(json.dumps({"library": str(lib)}))
    print("# ok: loaded, every op defined", flush=True)
    return 0
