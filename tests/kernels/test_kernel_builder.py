"""CPU tests of the kernel builder: cache key, locks, concurrent builds, compile errors, preflight messages."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from kernel_helpers import write_manifest

from pipegoose.kernels import cache, toolchain
from pipegoose.kernels.builder import (KernelBuildBusyError, KernelBuildError, KernelBuilder, KernelError,
                                       KernelUnavailableError)
from pipegoose.kernels.manifest import ManifestError

REPO = Path(__file__).resolve().parents[2]


def _env(cache_dir: Path) -> dict:
    env = dict(os.environ, PIPEGOOSE_CACHE_DIR=str(cache_dir), PIPEGOOSE_QUIET="1", MAX_JOBS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


# ------------------------------------------------------------------------------------------------- cache key


def test_key_changes_with_every_input(tiny, fake_toolkit, monkeypatch):
    manifest, op, cache_dir = tiny
    root = manifest.parent

    def key(kernel="test/tiny"):
        toolchain.host_compiler.cache_clear()
        toolchain.nvcc_version.cache_clear()
        toolchain.find_cuda_home.cache_clear()
        return KernelBuilder(kernel, manifest=manifest, cache_dir=cache_dir).build_key()

    base = key()
    assert base == key(), "the key must be deterministic"
    assert base.startswith("tiny-")
    seen = {base}

    def changed(what):
        k = key()
        assert k not in seen, f"key did not change with {what}"
        seen.add(k)

    src = root / "csrc" / "tiny.cpp"
    src.write_text(src.read_text() + "// edit\n")
    changed("the source file")
    b = root / "bindings" / "tiny_binding.cpp"
    b.write_text(b.read_text() + "// edit\n")
    changed("the binding")
    h = root / "bindings" / "tiny_helper.h"
    h.write_text(h.read_text() + "// edit\n")
    changed("a header the binding includes")
    manifest.write_text(manifest.read_text().replace("flags: {cxx: [-O1]}", "flags: {cxx: [-O2]}"))
    changed("the flags")
    monkeypatch.setattr(torch, "__version__", "0.0.0-test")
    changed("the torch version")
    monkeypatch.setattr(toolchain, "host_compiler", lambda: ("/usr/bin/g++-99", "g++ (test) 99.1"))
    monkeypatch.setattr(toolchain.host_compiler, "cache_clear", lambda: None, raising=False)
    changed("the host compiler")
    import pipegoose.kernels.builder as builder_mod

    monkeypatch.setattr(builder_mod.sysconfig, "get_config_var", lambda name: "cpython-399-test")
    changed("the Python ABI")

    # CUDA kernels: the nvcc version and the arch list are inputs too.
    cuda_keys = {key("test/cuda_one")}
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    cuda_keys.add(key("test/cuda_one"))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    cuda_keys.add(key("test/cuda_one"))
    (fake_toolkit / "bin" / "nvcc").write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.1, V13.1.0'\n")
    cuda_keys.add(key("test/cuda_one"))
    assert len(cuda_keys) == 4, "the key must change with the arch list and the nvcc version"


def test_status_names_a_build_cached_for_other_architectures(tiny, fake_toolkit, monkeypatch):
    """A build made with TORCH_CUDA_ARCH_LIST=9.0 (as CI makes them) is not this shell's build when it targets the
    default list; doctor's "not built" then says which list selects the cached one, and nothing for a build whose
    other inputs differ."""
    manifest, op, cache_dir = tiny
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    b = KernelBuilder("test/cuda_one", manifest=manifest, cache_dir=cache_dir)
    inputs = b.key_inputs()
    key = b.build_key()

    def plant(key, inputs):
        entry = cache.entry_dir(cache_dir, key)
        entry.mkdir(parents=True)
        (entry / "lib.so").write_bytes(b"")
        info = {"kernel": "test/cuda_one", "key": key, "library": "lib.so", "archs": inputs["archs"], "inputs": inputs}
        (entry / cache.BUILD_INFO).write_text(json.dumps(info))

    plant(key, inputs)
    assert b.status()["state"] == "cached"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    st = KernelBuilder("test/cuda_one", manifest=manifest, cache_dir=cache_dir).status()
    assert st["state"] == "not built"
    assert 'TORCH_CUDA_ARCH_LIST="9.0"' in st["detail"] and "8.0;9.0+PTX" in st["detail"], st["detail"]
    # a cached build of other sources is not offered, nor an entry whose recorded inputs match but whose key does
    # not (another KEY_SCHEMA, a source edited while it built: a review found this false hint)
    shutil.rmtree(cache.entry_dir(cache_dir, key))
    other = {**inputs, "binding": "0" * 64}
    plant(cache.build_key("cuda_one", other), other)
    plant("cuda_one-000000000000000000000000", inputs)
    st = KernelBuilder("test/cuda_one", manifest=manifest, cache_dir=cache_dir).status()
    assert st["state"] == "not built" and st["detail"] == "", st["detail"]


def test_a_stopped_build_is_no_failure_and_a_success_clears_one(tiny, monkeypatch):
    """A fresh-clone walkthrough interrupted `build` (Ctrl-C: stop_workers) and doctor then said "last build failed"
    with ninja's "interrupted by user" as the log; a later successful build of the key left that record too."""
    import pipegoose.kernels.builder as builder_mod

    manifest, op, cache_dir = tiny
    b = KernelBuilder("tiny", manifest=manifest, cache_dir=cache_dir)
    key = b.build_key()

    def build_while_stopping(rc: int, match: str) -> None:
        """A build whose worker exits with ``rc`` after stop_workers set its flag (as it does before it stops the
        worker's group)."""
        def worker(cmd, **kw):
            builder_mod._stop_requested.set()
            return rc

        monkeypatch.setattr(builder_mod, "_run_worker", worker)
        try:
            with pytest.raises(KernelBuildError, match=match):
                b.build()
        finally:
            builder_mod._stop_requested.clear()

    build_while_stopping(-15, "build stopped")  # killed by the stop's SIGTERM
    assert not (cache_dir / "failed").exists()
    assert b.status()["detail"] == ""
    build_while_stopping(1, "failed")  # a compile error that ends just as Ctrl-C comes: still a failure
    assert "last build failed" in b.status()["detail"]
    shutil.rmtree(cache_dir / "failed")
    # a failure recorded earlier for this key (say, the compiler killed for memory), then a build that succeeds
    (cache_dir / "failed" / key).mkdir(parents=True)
    (cache_dir / "failed" / key / "build.log").write_text("killed\n")
    assert "last build failed" in b.status()["detail"]

    def compiled(self, tmp, tc):
        (tmp / "tiny.so").write_bytes(b"")
        return tmp / "tiny.so"

    monkeypatch.setattr(KernelBuilder, "_compile", compiled)
    assert b.build().built
    assert not (cache_dir / "failed" / key).exists()


def test_a_source_edited_while_it_compiles_is_not_cached(tiny, monkeypatch):
    """A fresh-clone review (session 60): a source edited during the build was compiled and published under the key of
    the source as it was; once the edit was undone, the cache served the edited code. Now the inputs are hashed again
    after compiling, and a change leaves nothing cached."""
    manifest, op, cache_dir = tiny
    b = KernelBuilder("tiny", manifest=manifest, cache_dir=cache_dir)
    src = manifest.parent / "csrc" / "tiny.cpp"
    text = src.read_text()

    def compiled_while_edited(self, tmp, tc):
        src.write_text(text + "// edited while it compiled\n")
        (tmp / "tiny.so").write_bytes(b"")
        return tmp / "tiny.so"

    monkeypatch.setattr(KernelBuilder, "_compile", compiled_while_edited)
    with pytest.raises(KernelBuildError, match=r"^test/tiny: its inputs changed while it compiled \(files\); "
                                               r"nothing was cached: build again$"):
        b.build()
    src.write_text(text)
    assert b.cached() is None and not list(cache_dir.glob("tiny-*"))


@pytest.mark.parametrize("rc", [1, 0], ids=["worker-failed", "worker-ok-no-result"])
def test_a_cache_folder_removed_during_the_build_is_a_build_error(tiny, monkeypatch, rc):
    """A review: `rm -rf` of the cache folder while a build ran raised FileNotFoundError (copying build.log from the
    removed temp folder to failed/), chained with a second one from BuildLock.release (its owner record's folder gone),
    and left an empty failed/<key>/ (the cache folder made again); dispatch.kernel() falls back on KernelError only,
    so the OSError reached a fused model's forward. Now one KernelBuildError says so, and nothing is made again."""
    import pipegoose.kernels.builder as builder_mod

    manifest, op, cache_dir = tiny
    b = KernelBuilder("tiny", manifest=manifest, cache_dir=cache_dir)

    def worker(cmd, *, env, cwd, log, echo):
        log.write(b"compiling\n")
        log.flush()
        shutil.rmtree(cache_dir)   # the folder removed while ninja runs: the build then fails, or finds no result
        return rc

    monkeypatch.setattr(builder_mod, "_run_worker", worker)
    with pytest.raises(KernelBuildError, match=rf"^test/tiny: the build cache folder {re.escape(str(cache_dir))} "
                                               r"\(or part of it\) disappeared during the build \(No such file or "
                                               r"directory: .*build\.log\); nothing was cached: leave the folder in "
                                               r"place while a build runs, and build again$") as ei:
        b.build()
    assert isinstance(ei.value.__cause__, FileNotFoundError) and ei.value.log_path is None
    # no second error (the lock's release) in the chain, and nothing made again: no failed/, no cache folder at all
    assert ei.value.__context__ is ei.value.__cause__ and ei.value.__cause__.__context__ is None
    assert not cache_dir.exists()
    # the next build finds the lock free and its record gone: it builds (a fake compile), no taking over
    def compiled(self, tmp, tc):
        (tmp / "tiny.so").write_bytes(b"")
        return tmp / "tiny.so"

    monkeypatch.setattr(KernelBuilder, "_compile", compiled)
    cache_dir.mkdir()
    assert b.build().built and not (cache_dir / "failed").exists()


@pytest.mark.parametrize("soft", [False, True], ids=["flock", "softlock"])
def test_build_lock_release_tolerates_its_files_gone(tmp_path, soft):
    key = "tiny-0123456789abcdef01234567"
    lock = cache.BuildLock(tmp_path / "c", key, timeout=5, soft=soft).acquire()
    shutil.rmtree(tmp_path / "c")
    lock.release()   # no FileNotFoundError
    assert not (tmp_path / "c").exists()
    again = cache.BuildLock(tmp_path / "c", key, timeout=5, soft=soft).acquire()   # free, nothing taken over
    assert again.previous_owner is None
    again.release()
    assert (again.read_owner() or {}).get("released") is True


def _full_disk(path) -> OSError:
    import errno

    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def test_os_errors_of_building_and_publishing_are_build_errors(tiny, monkeypatch):
    """A review: any OSError of the build/publish path (disk full, permission denied on the cache folder) escaped the
    builder raw, and dispatch.kernel() with it; each is now one KernelBuildError naming the path and the errno text,
    leaving no temp folder, entry or failure record. A programming error is not wrapped."""
    import errno

    import pipegoose.kernels.builder as builder_mod

    manifest, op, cache_dir = tiny
    b = KernelBuilder("tiny", manifest=manifest, cache_dir=cache_dir)
    key = b.build_key()
    writable = (rf"^test/tiny: the build cache folder {re.escape(str(cache_dir))} could not be written during the "
                r"build \({}: {}\); nothing was cached: free disk space or fix the folder's permissions \(or set "
                r"PIPEGOOSE_CACHE_DIR to another folder\), and build again$")

    def nothing_left() -> None:
        # (locks/ stays, and failed/ as an empty folder: no record of this key in it)
        assert not [p for p in cache_dir.iterdir() if p.name != "locks" and not (p.name == "failed" and
                                                                                not any(p.iterdir()))]
        assert b.status()["state"] == "not built"

    def compiled(self, tmp, tc):
        (tmp / "tiny.so").write_bytes(b"x")
        return tmp / "tiny.so"

    # publishing on a full disk: build.json half-written, then ENOSPC
    def full_publish(tmp, cache_dir_, key_, info, **kw):
        (tmp / cache.BUILD_INFO).write_text("{")
        raise _full_disk(tmp / cache.BUILD_INFO)

    with monkeypatch.context() as m:
        m.setattr(KernelBuilder, "_compile", compiled)
        m.setattr(cache, "publish", full_publish)
        with pytest.raises(KernelBuildError, match=writable.format("No space left on device",
                                                                   r".*\.tmp-.*build\.json")):
            b.build()
    nothing_left()

    # the temp folder cannot be made: permission denied on the cache folder (root passes any chmod: simulated)
    def denied(cache_dir_, key_):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(cache_dir_ / f"{key_}.tmp-1-deadbeef"))

    with monkeypatch.context() as m:
        m.setattr(cache, "new_tmp_dir", denied)
        with pytest.raises(KernelBuildError, match=writable.format("Permission denied", r".*\.tmp-1-deadbeef")) as ei:
            b.build()
    assert isinstance(ei.value.__cause__, PermissionError)
    nothing_left()

    # a write to a full disk that names no file (the worker's output into build.log): the cache folder is named;
    # another OSError of the build (a fork without memory) says so as it is
    for err, match in ((OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
                        writable.format("No space left on device", re.escape(str(cache_dir)))),
                       (OSError(errno.ENOMEM, os.strerror(errno.ENOMEM)),
                        r"^test/tiny: building failed \(Cannot allocate memory\); nothing was cached$")):
        def failing_worker(cmd, err=err, **kw):
            raise err

        with monkeypatch.context() as m:
            m.setattr(builder_mod, "_run_worker", failing_worker)
            with pytest.raises(KernelBuildError, match=match):
                b.build()
        nothing_left()

    # a failed compile whose failure record cannot be written (disk full): no empty or truncated record
    real_write_bytes = Path.write_bytes

    def write_bytes(self, data):
        if self.name == "build.log" and self.parent.parent.name == "failed":
            real_write_bytes(self, data[:1])
            raise _full_disk(self)
        return real_write_bytes(self, data)

    with monkeypatch.context() as m:
        m.setattr(builder_mod, "_run_worker", lambda cmd, **kw: 1)
        m.setattr(Path, "write_bytes", write_bytes)
        with pytest.raises(KernelBuildError, match=writable.format(
                "No space left on device", re.escape(str(cache_dir / "failed" / key / "build.log")))):
            b.build()
    assert not (cache_dir / "failed" / key).exists()
    nothing_left()

    # a programming error stays what it is (and its temp folder goes)
    def broken(self, tmp, tc):
        raise TypeError("a bug")

    monkeypatch.setattr(KernelBuilder, "_compile", broken)
    with pytest.raises(TypeError, match="a bug"):
        b.build()
    nothing_left()


def test_nvccs_own_environment_variables_are_part_of_the_key(tiny, fake_toolkit, monkeypatch):
    """A fresh-clone review (session 60): NVCC_APPEND_FLAGS=-G (and NVCC_PREPEND_FLAGS, NVCC_CCBIN, which the README
    suggests for a too-new host compiler) changed what nvcc built but not the key: a debug build was cached, and then
    served, under the plain key. A CUDA kernel's key now takes them; unset, the key is what it was."""
    manifest, _op, cache_dir = tiny
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    for n in ("NVCC_APPEND_FLAGS", "NVCC_PREPEND_FLAGS", "NVCC_CCBIN"):
        monkeypatch.delenv(n, raising=False)

    def key():
        return KernelBuilder("test/cuda_one", manifest=manifest, cache_dir=cache_dir).build_key()

    plain = key()
    assert "nvcc_env" not in KernelBuilder("test/cuda_one", manifest=manifest, cache_dir=cache_dir).key_inputs()
    keys = {plain}
    for n, v in (("NVCC_APPEND_FLAGS", "-G"), ("NVCC_PREPEND_FLAGS", "-lineinfo"), ("NVCC_CCBIN", "/usr/bin/g++-12")):
        monkeypatch.setenv(n, v)
        keys.add(key())
        monkeypatch.delenv(n)
    assert len(keys) == 4 and key() == plain
    monkeypatch.setenv("NVCC_APPEND_FLAGS", "-G")   # not a C++ kernel's (nvcc does not build it)
    tiny_key = KernelBuilder("tiny", manifest=manifest, cache_dir=cache_dir).build_key()
    monkeypatch.delenv("NVCC_APPEND_FLAGS")
    assert KernelBuilder("tiny", manifest=manifest, cache_dir=cache_dir).build_key() == tiny_key


def test_cc_is_part_of_a_cuda_builds_key_and_shown_in_the_host_compiler_row(tiny, fake_toolkit, monkeypatch, tmp_path):
    """A review: torch.utils.cpp_extension passes $CC to nvcc as its host compiler (-ccbin), which NVCC_CCBIN names
    too; NVCC_CCBIN was in the key, CC not: `CC=/bin/false ... build multi_tensor_scale` said "cached". A CUDA kernel's
    key now takes CC and its compiler's version (a C++ kernel's does not: nvcc does not build it), doctor's host
    compiler row shows it, and a CC that is not runnable fails the row."""
    manifest, _op, cache_dir = tiny
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    for n in ("CC", "NVCC_CCBIN"):
        monkeypatch.delenv(n, raising=False)

    def builder(name="test/cuda_one"):
        return KernelBuilder(name, manifest=manifest, cache_dir=cache_dir)

    def row():
        return next(c for c in toolchain.preflight(cache_dir) if c.name == "host compiler")

    plain, tiny_key = builder().build_key(), builder("tiny").build_key()
    entry = cache.entry_dir(cache_dir, plain)   # the build made without CC, in the cache
    entry.mkdir(parents=True)
    (entry / "lib.so").write_bytes(b"")
    (entry / cache.BUILD_INFO).write_text(json.dumps({"kernel": "test/cuda_one", "key": plain, "library": "lib.so"}))
    assert builder().status()["state"] == "cached"
    fake = tmp_path / "bin" / "gcc-fake"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'gcc (fake) 12.2.0'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    inputs = builder().key_inputs()
    assert inputs["nvcc_env"] == {"CC": str(fake)} and inputs["nvcc_host_compiler"] == [str(fake), "gcc (fake) 12.2.0"]
    assert builder().build_key() != plain and builder("tiny").build_key() == tiny_key
    assert builder().status()["state"] == "not built"
    assert row().ok and f"nvcc's host compiler: CC={fake} -> {fake} (gcc (fake) 12.2.0)" in row().detail, row()
    fake.write_text("#!/bin/sh\necho 'gcc (fake) 99.1.0'\n")   # newer than nvcc 13 takes: CC's version is checked
    assert row().warn and "newer than nvcc 13 supports" in row().detail and row().fix.startswith("set CC "), row()
    monkeypatch.setenv("CC", "/bin/false")
    assert not row().ok and "CC='/bin/false', which torch passes to nvcc as its host compiler (-ccbin): not found or " \
        "not runnable" in row().detail, row()
    st = builder().status()
    assert st["state"] == "unavailable" and "CC='/bin/false'" in st["detail"], st
    assert builder("tiny").status()["state"] == "not built"   # (a C++ kernel: nvcc is not its compiler)
    monkeypatch.delenv("CC")
    monkeypatch.setenv("NVCC_CCBIN", "/opt/gcc-12/bin")
    assert row().ok and "nvcc's host compiler: NVCC_CCBIN=/opt/gcc-12/bin" in row().detail, row()


def test_a_bad_max_jobs_keeps_cached_builds_usable(tiny, monkeypatch):
    """A fresh-clone review (session 60): MAX_JOBS=² (a value torch cannot read) made every cached kernel unavailable
    (doctor, build, load), and the fused ops quietly ran PyTorch, though MAX_JOBS only matters when compiling. Now a
    cached build is served, and only a build that must compile is refused, naming it."""
    manifest, op, cache_dir = tiny
    b = KernelBuilder("tiny", manifest=manifest, cache_dir=cache_dir)

    def compiled(self, tmp, tc):
        (tmp / "tiny.so").write_bytes(b"")
        return tmp / "tiny.so"

    monkeypatch.setattr(KernelBuilder, "_compile", compiled)
    assert b.build().built
    monkeypatch.setenv("MAX_JOBS", "\u00b2")
    assert not b.build().built and b.cached() is not None and b.status()["state"] == "cached"
    with pytest.raises(KernelUnavailableError, match=r"cannot build test/tiny: MAX_JOBS: '\u00b2'"):
        b.build(force=True)
    shutil.rmtree(b.cached().entry)
    assert b.status()["state"] == "unavailable" and "MAX_JOBS" in b.status()["detail"]


@pytest.mark.parametrize("blank", ["", "  "])
def test_a_blank_cache_dir_is_refused(tiny, blank):
    """A review (session 60): cache_dir='' was the current folder and '  ' a folder named by the spaces."""
    manifest, _op, _cache_dir = tiny
    with pytest.raises(ValueError, match=rf"^cache_dir: expected a folder path \(or None: the default cache\), got "
                                         rf"{re.escape(repr(blank))}$"):
        KernelBuilder("tiny", manifest=manifest, cache_dir=blank)


def test_key_ignores_unrelated_files(tiny):
    manifest, op, cache_dir = tiny
    b = KernelBuilder("tiny", manifest=manifest, cache_dir=cache_dir)
    k1 = b.build_key()
    (manifest.parent / "bindings" / "unrelated.h").write_text("// not included by the binding\n")
    (manifest.parent / "README").write_text("x")
    assert KernelBuilder("tiny", manifest=manifest, cache_dir=cache_dir).build_key() == k1


# ------------------------------------------------------------------------------------------------- preflight


def test_missing_nvcc_message(tiny, monkeypatch):
    manifest, op, cache_dir = tiny
    monkeypatch.setattr(toolchain, "find_cuda_home", lambda: None)
    with pytest.raises(KernelUnavailableError) as e:
        KernelBuilder("test/cuda_one", manifest=manifest, cache_dir=cache_dir).build()
    msg = str(e.value)
    assert "CUDA toolkit" in msg and "no toolkit found" in msg and "CUDA_HOME" in msg


def test_cuda_major_mismatch_message(tiny, fake_toolkit, monkeypatch):
    manifest, op, cache_dir = tiny
    monkeypatch.setattr(toolchain, "nvcc_version", lambda home=None: (12, 4))
    with pytest.raises(KernelUnavailableError) as e:
        KernelBuilder("test/cuda_one", manifest=manifest, cache_dir=cache_dir).build()
    msg = str(e.value)
    assert "nvcc 12.4 but torch was built with CUDA 13.0" in msg and "major versions must match" in msg


def _lock_vendored(manifest: Path) -> None:
    """A kernels.lock beside ``manifest`` that records test/vendored (at the manifest's pin)."""
    from pipegoose.porting.lock import Lock, LockedKernel, LockedSource

    pin = {"name": "upstream", "version": "1.0", "sha256": "a" * 64}
    lock = Lock(manifest.parent / "kernels.lock",
                {"upstream": LockedSource("pypi", pin, "Apache-2.0", {"LICENSE": "b" * 64})},
                {"test/vendored": LockedKernel("upstream", {"src/kernel.cu": "c" * 64, "src/kernel.h": "d" * 64})})
    lock.path.write_text(lock.dumps())


def test_missing_vendored_files_says_run_port_sync(tiny, fake_toolkit):
    """Nothing of the source vendored (a fresh clone): one short line (it listed every file, which doctor showed for
    each kernel before the first sync); a source partly there: the missing files. sync restores a kernel that
    kernels.lock records; one it does not record is vendored by add alone (a review: sync was named for it too)."""
    manifest, op, cache_dir = tiny
    _lock_vendored(manifest)
    with pytest.raises(KernelUnavailableError) as e:
        KernelBuilder("test/vendored", manifest=manifest, cache_dir=cache_dir).build()
    assert str(e.value) == ("kernel test/vendored: not vendored yet (no vendor/upstream/): python tools/port.py sync "
                            "(or: python tools/port.py add test/vendored)")
    (manifest.parent / "vendor" / "upstream" / "src").mkdir(parents=True)
    (manifest.parent / "vendor" / "upstream" / "src" / "other.h").write_text("")
    with pytest.raises(KernelUnavailableError) as e:
        KernelBuilder("test/vendored", manifest=manifest, cache_dir=cache_dir).build()
    assert "python tools/port.py sync" in str(e.value)
    assert "missing 2 file(s): vendor/upstream/src/kernel.cu, vendor/upstream/src/kernel.h;" in str(e.value)
    # not in kernels.lock (declared in kernels.yaml only): add, not sync
    (manifest.parent / "kernels.lock").unlink()
    with pytest.raises(KernelUnavailableError) as e:
        KernelBuilder("test/vendored", manifest=manifest, cache_dir=cache_dir).build()
    assert str(e.value) == ("kernel test/vendored: missing 2 file(s): vendor/upstream/src/kernel.cu, "
                            "vendor/upstream/src/kernel.h; vendor them first: python tools/port.py add test/vendored")
    shutil.rmtree(manifest.parent / "vendor")
    with pytest.raises(KernelUnavailableError) as e:
        KernelBuilder("test/vendored", manifest=manifest, cache_dir=cache_dir).build()
    assert str(e.value) == ("kernel test/vendored: not vendored yet (no vendor/upstream/): python tools/port.py add "
                            "test/vendored")


def test_unwritable_cache_dir(tiny, tmp_path):
    manifest, op, _ = tiny
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(KernelUnavailableError) as e:
        KernelBuilder("tiny", manifest=manifest, cache_dir=blocker / "cache").build()
    assert "cache dir" in str(e.value) and "PIPEGOOSE_CACHE_DIR" in str(e.value)


def test_a_cache_that_cannot_be_written_still_serves_its_builds(tiny, monkeypatch):
    """A fresh-clone review: a read-only cache holding the very build asked for was refused ("not writable") before
    the builder looked in it. Reading a cached build needs no writing; compiling one does, and is still refused."""
    manifest, op, cache_dir = tiny
    first = KernelBuilder("tiny", manifest=manifest, cache_dir=cache_dir).build()
    assert first.built
    monkeypatch.setattr(toolchain, "_writable_check", lambda path, create=True: toolchain.Check(
        "cache dir", False, f"{path}: not writable (Permission denied)", "give a writable folder"))
    b = KernelBuilder("tiny", manifest=manifest, cache_dir=cache_dir)
    again = b.build()
    assert not again.built and again.entry == first.entry
    assert b.cached() is not None and b.cached().entry == first.entry
    assert b.status()["state"] == "cached", b.status()   # doctor as build (a re-test: it said "unavailable")
    shutil.rmtree(first.entry)
    st = b.status()
    assert st["state"] == "unavailable" and "cache dir: " in st["detail"] and "not writable" in st["detail"], st
    with pytest.raises(KernelUnavailableError, match=r"cannot build test/tiny: cache dir: .*not writable \(Permission "
                                                     r"denied\) -> give a writable folder"):
        b.build(force=True)


def test_find_cuda_home_resolves_wrapper_and_skips_header_less_dirs(tmp_path, monkeypatch):
    real = tmp_path / "cuda-13.0"
    (real / "bin").mkdir(parents=True)
    (real / "include").mkdir()
    (real / "include" / "cuda_runtime.h").write_text("")
    nvcc = real / "bin" / "nvcc"
    # Like real nvcc: a dry run names the folder it lives in.
    nvcc.write_text(f"#!/bin/sh\necho '#$ _HERE_={real}/bin' >&2\n")
    nvcc.chmod(0o755)
    # torch's guess: a prefix with bin/nvcc (a wrapper script) but no headers.
    prefix = tmp_path / "usr-local"
    (prefix / "bin").mkdir(parents=True)
    wrapper = prefix / "bin" / "nvcc"
    wrapper.write_text(f"#!/bin/sh\nexec {nvcc} \"$@\"\n")
    wrapper.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(prefix))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(toolchain, "DEFAULT_TOOLKITS", (str(tmp_path / "nowhere"),))
    monkeypatch.setenv("PATH", f"{prefix / 'bin'}:/usr/bin:/bin")
    assert not toolchain.is_cuda_toolkit(prefix)
    # passed over, with a word (a typo in CUDA_HOME was silently ignored)
    with pytest.warns(UserWarning, match=re.escape(f"CUDA_HOME={str(prefix)!r} is not a CUDA toolkit")
                      + ".*" + re.escape(f"using {real.resolve()} instead")):
        assert toolchain.find_cuda_home() == real.resolve()


def test_cuda_extra_include_dirs_found_when_toolkit_lacks_headers(tmp_path, monkeypatch):
    home = tmp_path / "cuda"
    (home / "include").mkdir(parents=True)
    site = tmp_path / "site"
    inc = site / "nvidia" / "cu13" / "include"
    inc.mkdir(parents=True)
    for h in toolchain.TORCH_CUDA_HEADERS:
        (inc / h).write_text("")
    monkeypatch.setattr(sys, "path", [str(site)])
    assert toolchain.cuda_extra_include_dirs(home) == [str(inc)]
    for h in toolchain.TORCH_CUDA_HEADERS:
        (home / "include" / h).write_text("")
    assert toolchain.cuda_extra_include_dirs(home) == []


def _wheel_site(root: Path, layout: dict[str, tuple[str, ...]]) -> Path:
    """A fake site-packages: ``nvidia/<folder>/include/<header>`` for each folder and its headers."""
    for folder, headers in layout.items():
        inc = root / "nvidia" / folder / "include"
        inc.mkdir(parents=True)
        for h in headers:
            (inc / h).write_text("")
    return root


_CU12_WHEELS = {"cublas": ("cublas_v2.h", "cublasLt.h", "cublas_api.h"), "cusparse": ("cusparse.h",),
                "cusolver": ("cusolverDn.h", "cusolver_common.h"), "cuda_runtime": ("cuda_runtime_api.h",)}


def test_torch_cuda_headers_are_those_torchs_cuda_context_includes():
    """The one list the lookup and the check use: every CUDA library header torch's CUDAContextLight.h includes
    unconditionally or for CUDA (cudss.h only in torch's own USE_CUDSS builds, hipsolver for ROCm)."""
    assert {"cusparse.h", "cublas_v2.h", "cublasLt.h", "cusolverDn.h"} <= set(toolchain.TORCH_CUDA_HEADERS)
    light = Path(torch.__file__).parent / "include" / "ATen" / "cuda" / "CUDAContextLight.h"
    if not light.is_file():
        pytest.skip("this torch ships no ATen/cuda headers")
    included = set(re.findall(r"^\s*#\s*include\s*<(cu(?:blas|sparse|solver)\w*\.h)>", light.read_text(), re.M))
    assert included <= set(toolchain.TORCH_CUDA_HEADERS), included


def test_cuda_extra_include_dirs_cuda12_wheels_each_folder(tmp_path, monkeypatch):
    """A review: CUDA 12 wheels put cuBLAS, cuSPARSE and cuSOLVER in separate folders, and only the folders with
    cusparse.h or cublas_v2.h were added, so cusolverDn.h (included by ATen/cuda/CUDAContext.h) was not found."""
    home = tmp_path / "cuda"
    (home / "include").mkdir(parents=True)
    (home / "include" / "cuda_runtime.h").write_text("")
    site = _wheel_site(tmp_path / "site", _CU12_WHEELS)
    other = _wheel_site(tmp_path / "other", {"cusolver": ("cusolverDn.h",)})  # later on sys.path: not used
    monkeypatch.setattr(sys, "path", ["", str(site), str(other)])
    want = [str(site / "nvidia" / f / "include") for f in ("cublas", "cusolver", "cusparse")]
    assert toolchain.cuda_extra_include_dirs(home) == want
    assert toolchain.cuda_header_lookup(home) == (want, [])
    # the toolkit has some of them: only the folders of the others
    for h in ("cublas_v2.h", "cublasLt.h", "cusparse.h"):
        (home / "include" / h).write_text("")
    assert toolchain.cuda_extra_include_dirs(home) == [str(site / "nvidia" / "cusolver" / "include")]
    # all of them: no wheel folder (the toolkit's own headers are used)
    (home / "include" / "cusolverDn.h").write_text("")
    assert toolchain.cuda_header_lookup(home) == ([], [])


def test_cuda_extra_include_flags_search_wheel_folders_last(tmp_path):
    """A review: a wheel folder such as nvidia/cu13/include holds a whole CUDA runtime's headers, and as a -I
    folder it came before the toolkit's, so with nvcc of another CUDA version than the wheel's a build mixed header
    versions. The flags search it after every other folder (-idirafter), for g++ and, through -Xcompiler, nvcc; a
    path with a comma (nvcc splits -Xcompiler values there) goes to nvcc as -I."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b,c")
    assert toolchain.cuda_extra_include_flags([]) == ([], [])
    cflags, cuda_cflags = toolchain.cuda_extra_include_flags([a, b])
    assert cflags == ["-idirafter", a, "-idirafter", b]
    assert cuda_cflags == ["-Xcompiler", "-idirafter", "-Xcompiler", a, f"-I{b}"]


def test_cuda_extra_include_flags_toolkit_header_wins_under_nvcc(tmp_path):
    """nvcc itself: a header the toolkit has comes from the toolkit though the wheel folder has one too (it failed
    with the -I folders used before), and a header only the wheel folder has is found."""
    home = toolchain.find_cuda_home()
    if home is None:
        pytest.skip("no CUDA toolkit (nvcc) on this machine")
    wheel = tmp_path / "wheel"
    wheel.mkdir()
    (wheel / "cuda_runtime.h").write_text("#error the wheel's cuda_runtime.h was used\n")
    (wheel / "pipegoose_wheel_only.h").write_text("#define PIPEGOOSE_WHEEL_ONLY 1\n")
    src = tmp_path / "t.cu"
    src.write_text("#include <cuda_runtime.h>\n#include <pipegoose_wheel_only.h>\n"
                   "static_assert(PIPEGOOSE_WHEEL_ONLY == 1, \"\");\n__global__ void k() {}\n")
    nvcc = str(Path(home) / "bin" / "nvcc")
    flags = toolchain.cuda_extra_include_flags([str(wheel)])[1]
    run = subprocess.run([nvcc, "-E", str(src), *flags], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    # the -I form the builder used before takes the wheel's header: the check above can fail
    old = subprocess.run([nvcc, "-E", str(src), f"-I{wheel}"], capture_output=True, text=True, timeout=300)
    assert old.returncode != 0 and "the wheel's cuda_runtime.h was used" in old.stderr


def test_preflight_cuda_headers_fails_naming_missing_headers(fake_toolkit, tmp_path, monkeypatch):
    """A review: with only nvidia/cusparse/include installed, doctor's "CUDA headers" row read ok though the build
    failed on cublas_v2.h / cusolverDn.h."""
    for h in toolchain.TORCH_CUDA_HEADERS:
        (fake_toolkit / "include" / h).unlink()
    site = _wheel_site(tmp_path / "site", {"cusparse": ("cusparse.h",)})
    monkeypatch.setattr(sys, "path", [str(site)])
    row, = [c for c in toolchain.preflight(None) if c.name == "CUDA headers"]
    assert not row.ok, row
    assert "cublas_v2.h, cublasLt.h, cusolverDn.h" in row.detail and "cusparse.h," not in row.detail, row
    assert str(site / "nvidia" / "cusparse" / "include") in row.detail
    assert "pip install nvidia-cublas nvidia-cusolver" in row.fix and "full CUDA toolkit" in row.fix, row
    # torch built for CUDA 12: the -cu12 wheels
    monkeypatch.setattr(toolchain, "torch_cuda_version", lambda: (12, 8))
    row, = [c for c in toolchain.preflight(None) if c.name == "CUDA headers"]
    assert "pip install nvidia-cublas-cu12 nvidia-cusolver-cu12" in row.fix, row
    # every header in some wheel folder: ok, naming them and the folders
    monkeypatch.setattr(sys, "path", [str(_wheel_site(tmp_path / "site12", _CU12_WHEELS))])
    row, = [c for c in toolchain.preflight(None) if c.name == "CUDA headers"]
    assert row.ok and "cusolverDn.h" in row.detail and "nvidia/cusolver/include" in row.detail, row
    # the toolkit lacks only cusolverDn.h, and no wheel has it: failed, naming it alone
    for h in ("cusparse.h", "cublas_v2.h", "cublasLt.h"):
        (fake_toolkit / "include" / h).write_text("")
    monkeypatch.setattr(sys, "path", [str(site)])
    row, = [c for c in toolchain.preflight(None) if c.name == "CUDA headers"]
    assert not row.ok and row.detail.startswith("cusolverDn.h (") and "pip install nvidia-cusolver-cu12 (" in row.fix
    # all in the toolkit: no row
    (fake_toolkit / "include" / "cusolverDn.h").write_text("")
    assert not [c for c in toolchain.preflight(None) if c.name == "CUDA headers"]


# ------------------------------------------------------------------------------------------------- archs


def test_arch_lists(monkeypatch):
    A = toolchain.Arch
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(toolchain, "visible_capabilities", lambda: [])
    d13 = toolchain.default_arch_list((13, 0))
    assert all((a.major, a.minor) >= (7, 5) for a in d13) and d13[-1].ptx
    assert {"7.5", "9.0", "12.0+PTX"} <= {str(a) for a in d13}
    assert A(7, 0) in toolchain.default_arch_list((12, 4))
    assert toolchain.arch_list((13, 0)) == (d13, "default")
    # Visible GPUs win, PTX for the newest.
    monkeypatch.setattr(toolchain, "visible_capabilities", lambda: [(8, 0), (9, 0)])
    archs, origin = toolchain.arch_list((13, 0))
    assert origin == "gpu" and [str(a) for a in archs] == ["8.0", "9.0+PTX"]
    # An explicit list covering the GPUs is honoured; one that misses a GPU is extended with it.
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    assert toolchain.arch_list((13, 0)) == ([A(8, 0), A(9, 0)], "env")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")
    archs, origin = toolchain.arch_list((13, 0))
    assert origin == "env+gpu" and A(9, 0) in archs
    # compute_70 with CUDA 13 is refused with the reason.
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "7.0;8.0")
    with pytest.raises(ValueError, match="sm_70.*cannot build"):
        toolchain.arch_list((13, 0))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "Hoper")
    with pytest.raises(ValueError, match=r"entry 'Hoper': expected <major>.<minor>\[\+PTX\], e.g. 9.0\+PTX, or a name "
                                         r"torch takes \(Ada, Ampere, Blackwell, Hopper,"):
        toolchain.arch_list((13, 0))


def test_arch_list_takes_torchs_names_and_native_and_refuses_ptx_alone(monkeypatch):
    """A review: TORCH_CUDA_ARCH_LIST=Hopper or =native, which torch's own extension builds take, were refused as
    malformed; compute_90 (PTX alone) was read as sm_90, SASS without the PTX it names."""
    monkeypatch.setattr(toolchain, "visible_capabilities", lambda: [])
    monkeypatch.setattr(toolchain, "nvcc_gpu_archs", lambda home=None: None)
    for text, want in (("Hopper", "9.0+PTX"), ("ampere;9.0", "8.0;8.6+PTX;9.0"), ("sm_90 ADA", "8.9+PTX;9.0"),
                       ("Ampere+Tegra", "8.7")):
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", text)
        assert toolchain.format_arch_list(toolchain.arch_list((13, 0))[0]) == want, text
    for text, write in (("compute_90", "9.0"), ("8.0;compute_100a", "10.0a")):
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", text)
        with pytest.raises(ValueError, match=rf"names PTX alone, which is not built by itself; write {write}\+PTX"):
            toolchain.arch_list((13, 0))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "native")
    with pytest.raises(ValueError, match="TORCH_CUDA_ARCH_LIST='native' takes the architectures of the visible GPUs, "
                                         "and none is visible"):
        toolchain.arch_list((13, 0))
    monkeypatch.setattr(toolchain, "visible_capabilities", lambda: [(8, 0), (9, 0)])
    for text in ("native", " Native "):
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", text)
        archs, origin = toolchain.arch_list((13, 0))
        assert (toolchain.format_arch_list(archs), origin) == ("8.0;9.0+PTX", "gpu"), text


def test_arch_list_refuses_what_nvcc_does_not_know_and_is_one_list_however_written(monkeypatch, tmp_path):
    """A review: TORCH_CUDA_ARCH_LIST=99.0 (or 10.1, which CUDA 13 calls 11.0) passed the preflight and failed in
    torch's build, leaving a failed-build log of a setting; "9.0;9.0" built the same library under a new key."""
    monkeypatch.setattr(toolchain, "visible_capabilities", lambda: [])
    known = frozenset({(7, 5), (8, 0), (8, 6), (9, 0), (10, 0), (11, 0), (12, 0)})
    monkeypatch.setattr(toolchain, "nvcc_gpu_archs", lambda home=None: known)
    for bad, named in (("99.0", "sm_990"), ("10.1", "sm_101"), ("9.0;9.9", "sm_99")):
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", bad)
        with pytest.raises(ValueError, match=rf"names {named}, which nvcc 13.0 does not know \(nvcc --list-gpu-arch: "
                                             r"7.5, 8.0, 8.6, 9.0, 10.0, 11.0, 12.0\)"):
            toolchain.arch_list((13, 0))
    for bad, named in (("8.0a", "sm_80a"), ("9.0f;9.0", "sm_90f")):   # (suffixes nvcc takes from 9.0 / 10.0 on)
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", bad)
        with pytest.raises(ValueError, match=rf"names {named}: architecture-specific 'a' variants exist from 9.0"):
            toolchain.arch_list((13, 0))
    for text in ("9.0;8.0+PTX;9.0", "8.0+PTX;9.0", "9.0 8.0+PTX 8.0"):
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", text)
        archs, origin = toolchain.arch_list((13, 0))
        assert (toolchain.format_arch_list(archs), origin) == ("8.0+PTX;9.0", "env"), text
    # nvcc's own list, read from --list-gpu-arch (a toolkit that prints none: not checked)
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\nprintf 'compute_75\\ncompute_90\\ncompute_100\\ncompute_121\\n'\n")
    nvcc.chmod(0o755)
    monkeypatch.undo()
    assert toolchain.nvcc_gpu_archs(tmp_path / "cuda") == {(7, 5), (9, 0), (10, 0), (12, 1)}
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.48'\n")
    toolchain._listed_gpu_archs.cache_clear()
    assert toolchain.nvcc_gpu_archs(tmp_path / "cuda") is None


def test_the_build_passes_gencode_flags_of_its_own_for_archs_torch_does_not_list(tiny, fake_toolkit, monkeypatch):
    """Session 59's gaps: TORCH_CUDA_ARCH_LIST values that nvcc knows and torch's table does not (8.8; the family
    ones, 10.0f) passed the preflight and failed in torch's build ("Unknown CUDA arch"). The builder now writes the
    -gencode flags itself, as torch writes them, and cpp_extension adds none of its own beside them."""
    import torch.utils.cpp_extension as cpp_extension

    import pipegoose.kernels.builder as builder_mod

    parse = toolchain.parse_arch_list
    assert toolchain.gencode_flags(parse("9.0")) == ["-gencode=arch=compute_90,code=sm_90"]
    assert toolchain.gencode_flags(parse("8.8;9.0a;10.0f+PTX")) == [
        "-gencode=arch=compute_88,code=sm_88", "-gencode=arch=compute_90a,code=sm_90a",
        "-gencode=arch=compute_100f,code=compute_100f", "-gencode=arch=compute_100f,code=sm_100f"]
    # what torch writes for the ones it knows (its private helper, which the build calls: a torch that changes how it
    # spells them, or that adds its own flags beside ours, shows here)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0+PTX")
    assert sorted(cpp_extension._get_cuda_arch_flags()) == sorted(toolchain.gencode_flags(parse("9.0+PTX")))
    assert cpp_extension._get_cuda_arch_flags(toolchain.gencode_flags(parse("8.8"))) == []
    # the worker's spec carries them, after the kernel's own nvcc flags
    monkeypatch.setattr(toolchain, "nvcc_gpu_archs", lambda home=None: frozenset({(8, 8), (9, 0), (10, 0)}))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.8;10.0f")
    manifest, _op, cache_dir = tiny
    seen = {}

    def worker(cmd, **kw):
        seen.update(json.loads(Path(cmd[-1]).read_text()))
        seen["env_archs"] = kw["env"]["TORCH_CUDA_ARCH_LIST"]
        return 1

    monkeypatch.setattr(builder_mod, "_run_worker", worker)
    with pytest.raises(KernelBuildError):
        KernelBuilder("test/cuda_one", manifest=manifest, cache_dir=cache_dir).build()
    assert seen["cuda_cflags"] == ["-O3", "-gencode=arch=compute_88,code=sm_88",
                                   "-gencode=arch=compute_100f,code=sm_100f"], seen
    assert seen["env_archs"] == "8.8;10.0f"


def test_arch_covers():
    parse = toolchain.parse_arch_list
    assert toolchain.arch_covers(parse("8.0"), (8, 6))  # SASS runs on a newer minor of one major
    assert not toolchain.arch_covers(parse("8.6"), (8, 0))
    assert not toolchain.arch_covers(parse("8.0"), (9, 0))
    assert toolchain.arch_covers(parse("8.0+PTX"), (9, 0))  # PTX is JIT-compiled forward
    assert toolchain.arch_covers(parse("sm_90a"), (9, 0)) and not toolchain.arch_covers(parse("9.0a"), (10, 0))


def test_gpu_not_covered_raises(tiny, monkeypatch):
    manifest, op, cache_dir = tiny
    b = KernelBuilder("test/cuda_one", manifest=manifest, cache_dir=cache_dir)
    monkeypatch.setattr(toolchain, "visible_capabilities", lambda: [(9, 0)])
    res = type("R", (), {"info": {"archs": "8.0;8.6"}})()
    with pytest.raises(KernelUnavailableError, match=r"does not cover this GPU \(sm_90\).*TORCH_CUDA_ARCH_LIST"):
        b._check_gpu_covered(res)


# ------------------------------------------------------------------------------------------------- locks

_HOLD = textwrap.dedent("""\
    import sys, time
    from pathlib import Path
    from pipegoose.kernels.cache import BuildLock
    lock = BuildLock(Path(sys.argv[1]), sys.argv[2], soft=sys.argv[3] == "soft").acquire()
    print("locked", flush=True)
    time.sleep(600)
    """)


def _hold_lock(cache_dir: Path, key: str, soft: bool) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _HOLD, str(cache_dir), key, "soft" if soft else "flock"],
                         stdout=subprocess.PIPE, text=True, env=_env(cache_dir))
    assert p.stdout.readline().strip() == "locked"
    return p


def test_cli_build_of_a_key_held_elsewhere_is_busy_not_failed(tiny, monkeypatch):
    """A review (session 60): with PIPEGOOSE_BUILD_LOCK_TIMEOUT=0 and another process building the key, ``build`` said
    FAILED, as for a compile error, though nothing had been attempted. Now the state is ``busy``, the API raises
    KernelBuildBusyError (a KernelBuildError), the exit status stays 1 (not everything was built) and nothing is
    cached."""
    manifest, _op, cache_dir = tiny
    b = KernelBuilder("tiny", manifest=manifest, cache_dir=cache_dir)
    holder = _hold_lock(cache_dir, b.build_key(), soft=False)
    try:
        p = subprocess.run([sys.executable, "-m", "pipegoose.kernels", "--manifest", str(manifest), "build", "tiny"],
                           capture_output=True, text=True, timeout=300,
                           env={**_env(cache_dir), "PIPEGOOSE_BUILD_LOCK_TIMEOUT": "0"})
        out = " ".join(p.stdout.replace("│", " ").split())
        assert p.returncode == 1 and "busy test/tiny" in out and "FAILED" not in out, p.stdout + p.stderr
        assert "is still held by" in out, out
        monkeypatch.setenv("PIPEGOOSE_BUILD_LOCK_TIMEOUT", "0")
        with pytest.raises(KernelBuildBusyError, match="is still held by"):
            b.build()
        assert b.cached() is None
    finally:
        holder.kill()
        holder.wait()


def test_cli_build_sigterm_is_a_line_and_stops_the_build(tiny):
    """A review (session 62): ``build`` killed by SIGTERM (``timeout``, a job scheduler) ended with status 143 and no
    word, its workers left to notice that their parent was gone. Now SIGTERM is handled as Ctrl-C is: the running
    builds are stopped (here one waiting for another process's build of its key), one line says what is left, no
    traceback, exit status 143, nothing cached."""
    manifest, _op, cache_dir = tiny
    b = KernelBuilder("tiny", manifest=manifest, cache_dir=cache_dir)
    holder = _hold_lock(cache_dir, b.build_key(), soft=False)
    p = None
    try:
        p = subprocess.Popen([sys.executable, "-m", "pipegoose.kernels", "--manifest", str(manifest), "build", "tiny"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(cache_dir))
        t0 = time.monotonic()
        while "waiting" not in p.stdout.readline():   # the CLI's line once the build waits for the held lock
            assert p.poll() is None and time.monotonic() - t0 < 120, "build did not reach the held lock"
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 143, (p.returncode, out, err)
        assert "build: terminated (SIGTERM)" in err and "pipegoose.kernels clean" in err, err
        assert "Traceback" not in err, err
        assert b.cached() is None
    finally:
        if p is not None and p.poll() is None:
            p.kill()
        holder.kill()
        holder.wait()


def test_a_stop_ends_the_wait_for_another_build(tiny):
    """A fresh-clone review (session 60): Ctrl-C of ``build`` while another process built the same key waited for that
    build to end (up to PIPEGOOSE_BUILD_LOCK_TIMEOUT, an hour): the waiting thread never looked at the stop. Now
    stop_workers' flag ends the wait within a second or so, and nothing is cached."""
    import pipegoose.kernels.builder as builder_mod

    manifest, op, cache_dir = tiny
    b = KernelBuilder("tiny", manifest=manifest, cache_dir=cache_dir)
    holder = _hold_lock(cache_dir, b.build_key(), soft=False)
    builder_mod._stop_requested.set()
    try:
        t0 = time.monotonic()
        with pytest.raises(KernelBuildBusyError, match=r"^test/tiny: build stopped \(interrupted\) while waiting for "
                                                   r"another process's build of it; nothing was cached$"):
            b.build()
        assert time.monotonic() - t0 < 10
        assert b.cached() is None
    finally:
        builder_mod._stop_requested.clear()
        holder.send_signal(signal.SIGKILL)
        holder.wait()


@pytest.mark.parametrize("soft", [False, True], ids=["flock", "softlock"])
def test_killed_builders_lock_is_taken_over(tmp_path, soft):
    key = "tiny-0123456789abcdef01234567"
    holder = _hold_lock(tmp_path, key, soft)
    try:
        # While the holder lives, waiting is bounded and the message names it.
        waited = []
        with pytest.raises(cache.LockTimeout, match=rf"held by pid {holder.pid} "):
            cache.BuildLock(tmp_path, key, timeout=1.5, soft=soft, on_wait=waited.append).acquire()
        assert waited and waited[0]["pid"] == holder.pid
        (tmp_path / f"{key}.tmp-{holder.pid}-deadbeef").mkdir()  # its half-written build
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    t0 = time.monotonic()
    lock = cache.BuildLock(tmp_path, key, timeout=30, soft=soft).acquire()
    try:
        assert time.monotonic() - t0 < 10
        assert lock.previous_owner is not None and lock.previous_owner["pid"] == holder.pid
        assert cache.clean_stale_tmp(tmp_path, key) and not list(tmp_path.glob(f"{key}.tmp-*"))
    finally:
        lock.release()
    # A released lock is not reported as taken over.
    again = cache.BuildLock(tmp_path, key, timeout=5, soft=soft).acquire()
    assert again.previous_owner is None
    again.release()


def test_owner_alive_detects_dead_and_reused_pids():
    me = cache.process_identity()
    assert cache.owner_alive(me) is True
    assert cache.owner_alive({**me, "start_time": "1"}) is False  # pid reused by another process
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert cache.owner_alive(cache.process_identity(p.pid) | {"pid": p.pid}) is False
    assert cache.owner_alive({**me, "hostname": "elsewhere"}) is None


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _plant_tmp(cache_dir: Path, key: str, pid: int, rand: str = "deadbeef") -> Path:
    d = cache_dir / f"{key}.tmp-{pid}-{rand}"
    d.mkdir(parents=True)
    (d / "half.o").write_bytes(b"x" * 100)
    return d


def test_clean_stale_tmp_removes_only_dead_owners_temp_folders(tmp_path):
    key, other = "tiny-0123456789abcdef01234567", "tiny-76543210fedcba9876543210"
    dead = _dead_pid()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        gone = _plant_tmp(tmp_path, key, dead)
        kept = [_plant_tmp(tmp_path, key, os.getpid(), "0badf00d"),  # this process's own build
                _plant_tmp(tmp_path, key, sleeper.pid, "cafef00d"),  # a live build
                _plant_tmp(tmp_path, other, dead),  # another key's
                _plant_tmp(tmp_path, key, dead, "not-hex!")]  # not a name new_tmp_dir gives
        (tmp_path / key).mkdir()  # the published build
        (tmp_path / f"{key}.tmp-{dead}-feedface").write_text("a file, not a folder")
        assert cache.tmp_owner(gone) == (key, dead) and cache.tmp_owner(tmp_path / key) is None
        assert cache.abandoned_tmp(tmp_path) == sorted([gone, kept[2]])
        with cache.BuildLock(tmp_path, key, timeout=5):
            assert cache.clean_stale_tmp(tmp_path, key) == [gone]
        assert not gone.exists() and all(d.is_dir() for d in kept) and (tmp_path / key).is_dir()
        assert (tmp_path / f"{key}.tmp-{dead}-feedface").is_file()
        assert cache.tmp_owner(cache.new_tmp_dir(tmp_path, key)) == (key, os.getpid())  # the pattern matches it
    finally:
        sleeper.kill()
        sleeper.wait()


def test_clean_abandoned_skips_keys_being_built(tmp_path):
    busy_key, free_key = "tiny-0123456789abcdef01234567", "tiny-76543210fedcba9876543210"
    dead = _dead_pid()
    busy_tmp, free_tmp = _plant_tmp(tmp_path, busy_key, dead), _plant_tmp(tmp_path, free_key, dead)
    holder = _hold_lock(tmp_path, busy_key, soft=False)
    try:
        assert cache.clean_abandoned(tmp_path) == ([free_tmp], [busy_key])
        assert busy_tmp.is_dir() and not free_tmp.exists()
    finally:
        holder.kill()
        holder.wait()
    assert cache.clean_abandoned(tmp_path) == ([busy_tmp], [])
    assert cache.abandoned_tmp(tmp_path) == []


def test_build_removes_killed_builds_temp_folder(tiny):
    manifest, op, cache_dir = tiny
    b = KernelBuilder("tiny", manifest=manifest, cache_dir=cache_dir)
    key = b.build_key()
    dead = _plant_tmp(cache_dir, key, _dead_pid())
    live = _plant_tmp(cache_dir, key, os.getpid(), "0badf00d")
    res = b.build()
    assert res.built and cache.is_complete(res.entry)
    assert not dead.exists() and live.is_dir()


def test_relative_cache_dir_forced_rebuild_and_damaged_library(tiny, monkeypatch, tmp_path):
    """From session 34's walkthrough: a relative cache folder failed every build (the worker runs elsewhere: spec.json
    not found); `build --force` removed the cached build before compiling, so a killed or failed rebuild left none;
    a truncated cached library was taken as cached and crashed the process in dlopen (bus error). Now the folder is
    made absolute, a forced rebuild replaces the old entry only once it is built, and a library whose size or sha256
    differs from the one recorded at publishing is built again. The entry keeps no worker hand-off file (spec.json,
    result.json) naming the temporary folder."""
    manifest, op, _ = tiny
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIPEGOOSE_CACHE_DIR", "relative-default")
    assert cache.default_cache_dir() == Path.cwd() / "relative-default"
    monkeypatch.setenv("PIPEGOOSE_CACHE_DIR", "  ")  # blank: unset (session 35's walkthrough: a folder named "  ")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative-xdg")  # invalid by the XDG spec: ignored
    assert cache.default_cache_dir() == Path.home() / ".cache" / "pipegoose" / "kernels"
    b = KernelBuilder("tiny", manifest=manifest, cache_dir="relcache")
    assert b.cache_dir == Path.cwd() / "relcache"
    first = b.build()
    assert first.built and cache.is_complete(first.entry)
    lib = first.entry / first.info["library"]
    assert first.info["library_bytes"] == lib.stat().st_size and first.info["library_sha256"] == cache.file_digest(lib)
    # the worker's hand-off files named the temporary folder that publishing renamed (session 34's walkthrough)
    assert not (first.entry / "result.json").exists() and not (first.entry / "spec.json").exists()

    def failing_compile(self, tmp, tc):
        raise KernelBuildError("tiny: compile failed (test)", None)

    with monkeypatch.context() as m:
        m.setattr(KernelBuilder, "_compile", failing_compile)
        with pytest.raises(KernelBuildError, match="compile failed"):
            b.build(force=True)
    assert cache.is_complete(first.entry) and cache.file_digest(lib) == first.info["library_sha256"]
    assert not b.build().built  # the old build is still the cached one
    (first.entry / "marker").write_text("")  # a forced build that succeeds replaces the entry
    forced = b.build(force=True)
    assert forced.built and forced.entry == first.entry and not (first.entry / "marker").exists()
    assert cache.is_complete(forced.entry)

    good = lib.read_bytes()
    lib.write_bytes(good[:1000])  # truncated
    assert cache.is_complete(first.entry) is None
    again = b.build()
    assert again.built and again.entry == first.entry and cache.is_complete(again.entry)
    flipped = bytearray(lib.read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF  # same size, other bytes
    lib.write_bytes(bytes(flipped))
    assert cache.is_complete(first.entry) is None
    # what doctor shows: "not built" said nothing more (a fresh-clone walkthrough), as for a key never built
    st = b.status()
    assert st["state"] == "not built" and "is incomplete or damaged" in st["detail"] and str(first.entry) in st["detail"]
    assert not [d for d in (tmp_path / "relcache").iterdir() if ".tmp-" in d.name]


@pytest.mark.parametrize("stray", ["file", "link"])
def test_publish_over_a_stray_file_at_the_key_leaves_nothing_behind(tmp_path, stray):
    """A review: a file (or a link) where a key's entry belongs was moved aside under a temp-folder name and left
    there; `clean` removes temp folders only, so it stayed for good. It holds no build: publish now removes it."""
    key = "tiny-0123456789abcdef01234567"
    final = cache.entry_dir(tmp_path, key)
    if stray == "file":
        final.write_text("not a build")
    else:
        (tmp_path / "elsewhere").mkdir()
        final.symlink_to(tmp_path / "elsewhere")
    tmp = cache.new_tmp_dir(tmp_path, key)
    (tmp / "lib.so").write_bytes(b"x")
    info = {"library": "lib.so", "library_bytes": 1, "library_sha256": cache.file_digest(tmp / "lib.so")}
    assert cache.publish(tmp, tmp_path, key, info) == final
    assert final.is_dir() and not final.is_symlink() and cache.is_complete(final)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([key] + (["elsewhere"] if stray == "link" else []))


@pytest.mark.parametrize("value", ["abc", "-5", "nan"])
def test_bad_build_lock_timeout_names_the_variable(tmp_path, monkeypatch, value):
    """PIPEGOOSE_BUILD_LOCK_TIMEOUT=abc failed a build with a bare 'could not convert string to float' (session 34's
    walkthrough); 0 (do not wait) stays allowed."""
    monkeypatch.setenv("PIPEGOOSE_BUILD_LOCK_TIMEOUT", value)
    with pytest.raises(ValueError, match=f"^PIPEGOOSE_BUILD_LOCK_TIMEOUT: expected a number of seconds >= 0, got "
                                         f"'{value}'$"):
        cache.BuildLock(tmp_path, "k-0123456789abcdef01234567")
    for ok, want in (("12.5", 12.5), ("0", 0.0)):
        monkeypatch.setenv("PIPEGOOSE_BUILD_LOCK_TIMEOUT", ok)
        assert cache.BuildLock(tmp_path, "k-0123456789abcdef01234567").timeout == want


# ------------------------------------------------------------------------------------------------- builds

_LOAD = textwrap.dedent("""\
    import json, sys, time
    import torch  # a user's process has torch imported already: time the load itself
    from pipegoose.kernels import KernelBuilder
    t0 = time.monotonic()
    ops = KernelBuilder.from_name(sys.argv[2], manifest=sys.argv[1]).load()
    dt = time.monotonic() - t0
    out = getattr(ops, sys.argv[3])(torch.arange(3.0)).tolist()
    print(json.dumps({"built": ops.built, "key": ops.build_key, "seconds": dt, "out": out}))
    """)


def _load_in_subprocess(manifest: Path, cache_dir: Path, op: str, name: str = "tiny") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _LOAD, str(manifest), name, op], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(cache_dir))


def test_eight_concurrent_processes_make_one_build(tiny):
    manifest, op, cache_dir = tiny
    procs = [_load_in_subprocess(manifest, cache_dir, op) for _ in range(8)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(r["built"] for r in results) == 1, results
    assert len({r["key"] for r in results}) == 1
    assert all(r["out"] == [1.0, 2.0, 3.0] for r in results)
    key = results[0]["key"]
    assert cache.is_complete(cache_dir / key)
    assert not list(cache_dir.glob("*.tmp-*")), "no temp folder may be left behind"
    assert [p.name for p in cache_dir.iterdir() if p.is_dir() and p.name not in ("locks",)] == [key]

    # A later process loads it from the cache, quickly.
    p = _load_in_subprocess(manifest, cache_dir, op)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    r = json.loads(out.strip().splitlines()[-1])
    assert r["built"] is False and r["key"] == key and r["seconds"] < 1.0, r

    # In this process: loading twice (by alias, id or subclass) returns the same object.
    ops = KernelBuilder.from_name("tiny", manifest=manifest, cache_dir=cache_dir).load()

    class Tiny(KernelBuilder):
        def absolute_name(self):
            return "test/tiny"

    assert Tiny(manifest=manifest, cache_dir=cache_dir).load() is ops
    assert KernelBuilder("test/tiny", manifest=manifest, cache_dir=cache_dir).load() is ops
    assert ops.kernel.id == "test/tiny" and ops.library_path.is_file() and ops.build_key == key
    assert getattr(ops, op) is getattr(torch.ops.pipegoose, op)
    assert torch.equal(getattr(ops, op)(torch.zeros(2)), torch.ones(2))
    with pytest.raises(AttributeError, match="has no op"):
        ops.not_an_op


def test_compile_error_is_readable_and_leaves_no_entry(tmp_path, monkeypatch):
    manifest = write_manifest(tmp_path / "proj", "tiny_broken",
                              cpp_body="#include <ATen/ATen.h>\nint broken( { return 0 }\n")
    cache_dir = tmp_path / "cache"
    monkeypatch.setenv("PIPEGOOSE_QUIET", "1")
    b = KernelBuilder("tiny", manifest=manifest, cache_dir=cache_dir)
    with pytest.raises(KernelBuildError) as e:
        b.build()
    msg = str(e.value)
    assert "building test/tiny failed" in msg and "error" in msg and "tiny.cpp" in msg
    log = e.value.log_path
    assert log is not None and log.is_file() and str(log) in msg
    assert log == cache_dir / "failed" / b.build_key() / "build.log"
    assert "error" in log.read_text()
    assert not list(cache_dir.glob("*.tmp-*"))
    assert not (cache_dir / b.build_key()).exists()
    assert isinstance(e.value, KernelError)


def test_wrong_op_name_in_binding_is_caught(tmp_path, monkeypatch):
    """A binding that does not define the manifest's op must not be published."""
    manifest = write_manifest(tmp_path / "proj", "tiny_x")
    manifest.write_text(manifest.read_text().replace("op: tiny_x, role", "op: tiny_not_defined, role"))
    monkeypatch.setenv("PIPEGOOSE_QUIET", "1")
    b = KernelBuilder("tiny", manifest=manifest, cache_dir=tmp_path / "cache")
    with pytest.raises(KernelBuildError, match="tiny_not_defined"):
        b.build()
    assert not (tmp_path / "cache" / b.build_key()).exists()


# ------------------------------------------------------------------------------------------------- CLI


def test_readme_says_what_ci_runs():
    """README's test section said only that CI runs `python -m pytest`; .ci/run first vendors, verifies and compiles
    every kernel (`python -m pipegoose.kernels build --all -j 2`). Every python step of .ci/run, and the architecture it
    builds for, must be in the README."""
    ci = (REPO / ".ci" / "run").read_text()
    readme = (REPO / "README.md").read_text()
    steps = [line.strip().replace("python3 ", "python ") for line in ci.splitlines()
             if line.strip().startswith("python3 ") and " pip " not in line]
    assert "python -m pipegoose.kernels build --all -j 2" in steps and "python -m pytest" in steps, steps
    for step in steps:
        assert step in readme, f"README does not say that CI runs {step!r}"
    assert "TORCH_CUDA_ARCH_LIST=9.0" in readme and 'TORCH_CUDA_ARCH_LIST:-9.0' in ci


def _without_vendored(manifest: Path) -> Path:
    """The tiny manifest without its kernel test/vendored (whose files are never vendored: unavailable), beside it."""
    text = manifest.read_text()
    clean = manifest.with_name("clean.yaml")
    clean.write_text(text.split("  test/vendored:")[0])
    return clean


def test_cli_build_reports_missing_and_doctor_runs(tiny):
    manifest, op, cache_dir = tiny
    env = _env(cache_dir)
    p = subprocess.run([sys.executable, "-m", "pipegoose.kernels", "--manifest", str(manifest), "build",
                        "test/vendored", "-j", "2"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 3, p.stdout + p.stderr
    # the state as doctor names it (it was "missing", for changed files too, which build called FAILED)
    # (no kernels.lock records it: add vendors it; sync adds no kernel)
    assert "unavailable test/vendored" in p.stdout and "tools/port.py add test/vendored" in \
        p.stdout.replace("\n", "").replace("│", "")
    p = subprocess.run([sys.executable, "-m", "pipegoose.kernels", "--manifest", str(manifest), "doctor"],
                       capture_output=True, text=True, env={**env, "PIPEGOOSE_CACHE_DIRR": "/elsewhere"}, timeout=300)
    assert "preflight" in p.stdout and "test/tiny" in p.stdout and "unavailable" in p.stdout, p.stdout + p.stderr
    # a misspelt variable is named (the build cache silently stayed the default one)
    assert "PIPEGOOSE_CACHE_DIRR: pipegoose reads no variable of that name" in " ".join(p.stdout.split()), p.stdout
    # a kernel that cannot be built here is exit 3, as for build (it was 0: a passing preflight hid a missing or changed
    # vendored file from CI; session 35's walkthrough; then 2, which is also argparse's usage error); without it, 0
    assert p.returncode == 3, p.stdout + p.stderr
    env.pop("COLUMNS", None)
    p = subprocess.run([sys.executable, "-m", "pipegoose.kernels", "--manifest", str(_without_vendored(manifest)),
                        "doctor"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0 and "unavailable" not in p.stdout, p.stdout + p.stderr
    # piped: 160 columns, not rich's 80, which split names mid-word (session 35's walkthrough)
    assert max(map(len, p.stdout.splitlines())) > 80 and "│ test/cuda_one " in p.stdout, p.stdout


@pytest.mark.parametrize("where", ["before", "after"])
def test_cli_bad_manifest_is_a_clean_error(tmp_path, where):
    # --manifest missing or not YAML: one line naming the file, exit code 2, no traceback
    bad = tmp_path / "notes.md"
    bad.write_text("# a title\nsome: [unclosed\n")
    for path, says in ((tmp_path / "nope.yaml", "manifest not found"), (bad, "not valid YAML")):
        opt = ["--manifest", str(path)]
        args = opt + ["build", "softmax"] if where == "before" else ["build", "softmax"] + opt
        p = subprocess.run([sys.executable, "-m", "pipegoose.kernels", *args], capture_output=True, text=True,
                           env=_env(tmp_path / "cache"), timeout=300)
        assert p.returncode == 2, p.stdout + p.stderr
        assert says in p.stderr and path.name in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_cli_doctor_reports_and_clean_removes_killed_builds_temp_folders(tiny):
    manifest, op, cache_dir = tiny
    env = _env(cache_dir)
    dead = _plant_tmp(cache_dir, "tiny-0123456789abcdef01234567", _dead_pid())
    live = _plant_tmp(cache_dir, "tiny-0123456789abcdef01234567", os.getpid(), "0badf00d")
    cli = [sys.executable, "-m", "pipegoose.kernels", "--manifest", str(manifest)]
    p = subprocess.run(cli + ["doctor"], capture_output=True, text=True, env=env, timeout=300)
    assert "1 temp folder(s) of killed builds" in p.stdout and "pipegoose.kernels clean" in p.stdout, p.stdout
    p = subprocess.run(cli + ["clean", "--dry-run"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0 and f"would remove {dead}" in p.stdout and str(live) not in p.stdout, p.stdout + p.stderr
    assert dead.is_dir()
    p = subprocess.run(cli + ["clean"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0 and f"removed {dead}" in p.stdout, p.stdout + p.stderr
    assert not dead.exists() and live.is_dir()


def test_cli_clean_checks_its_manifest_and_cache_dir(tmp_path):
    """A review: `clean --manifest /nonexist` exited 0 (the docstring: every subcommand exits 2 for a missing or
    invalid --manifest), and `clean --cache-dir <a file>` printed "removed 0" and exited 0."""
    cli = [sys.executable, "-m", "pipegoose.kernels"]
    env = _env(tmp_path / "cache")
    for args in (["--manifest", str(tmp_path / "nope.yaml"), "clean"], ["clean", "--manifest", str(tmp_path / "nope.yaml")],
                 ["clean", "--dry-run", "--manifest", str(tmp_path / "nope.yaml")]):
        p = subprocess.run(cli + args, capture_output=True, text=True, env=env, timeout=300)
        assert p.returncode == 2 and "manifest not found" in p.stderr and "nope.yaml" in p.stderr, p.stdout + p.stderr
        assert "removed" not in p.stdout, p.stdout
    a_file = tmp_path / "passwd"
    a_file.write_text("root:x:0:0\n")
    for extra in ([], ["--dry-run"]):
        p = subprocess.run(cli + ["clean", "--cache-dir", str(a_file), *extra], capture_output=True, text=True, env=env,
                           timeout=300)
        assert p.returncode == 2, p.stdout + p.stderr
        assert f"clean: --cache-dir {a_file}: expected the build cache's folder, got a file" in p.stderr, p.stderr
        assert "removed" not in p.stdout, p.stdout
    p = subprocess.run(cli + ["clean"], capture_output=True, text=True, env={**env, "PIPEGOOSE_CACHE_DIR": str(a_file)},
                       timeout=300)
    assert p.returncode == 2 and f"PIPEGOOSE_CACHE_DIR {a_file}: expected" in p.stderr, p.stdout + p.stderr
    # and a path under a file (a review: "removed 0 temp folder(s)", exit 0)
    under = a_file / "sub" / "cache"
    for extra in ([], ["--dry-run"]):
        p = subprocess.run(cli + ["clean", "--cache-dir", str(under), *extra], capture_output=True, text=True, env=env,
                           timeout=300)
        assert p.returncode == 2, p.stdout + p.stderr
        assert (f"clean: --cache-dir {under}: expected the build cache's folder, got a path under the file {a_file}"
                in p.stderr), p.stderr
        assert "removed" not in p.stdout and "temp folder" not in p.stdout, p.stdout
    p = subprocess.run(cli + ["clean"], capture_output=True, text=True, env={**env, "PIPEGOOSE_CACHE_DIR": str(under)},
                       timeout=300)
    assert p.returncode == 2 and f"PIPEGOOSE_CACHE_DIR {under}: expected" in p.stderr, p.stdout + p.stderr
    # a cache that is not there yet holds nothing to clean: 0, as before
    p = subprocess.run(cli + ["clean", "--cache-dir", str(tmp_path / "none")], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0 and "removed 0 temp folder(s)" in p.stdout, p.stdout + p.stderr


@pytest.mark.parametrize("jobs", ["0", "-3", "two"])
def test_cli_build_jobs_must_be_a_positive_count(tmp_path, jobs):
    """-j 0 (or a negative count) was taken as 1 and started building; now an argparse error naming -j/--jobs."""
    p = subprocess.run([sys.executable, "-m", "pipegoose.kernels", "build", "--all", "-j", jobs], capture_output=True,
                       text=True, env=_env(tmp_path / "cache"), timeout=300)
    assert p.returncode == 2 and "-j/--jobs" in p.stderr and "expected an integer >= 1" in p.stderr, p.stderr
    assert "building" not in p.stdout, p.stdout


@pytest.mark.parametrize("columns", [40, 60])
def test_cli_build_results_fit_narrow_terminals(tiny, columns):
    """A walkthrough (session 42): at 40 columns build's results table folded every cell to 7 characters a line
    ("apex/mu|lti_ten|sor_sca|le") and its "unavailable" explanation to one fragment a line. Now the kernel, result and
    seconds stay whole (a list where the detail would not fit) and every line fits."""
    manifest, _op, cache_dir = tiny
    _lock_vendored(manifest)   # (kernels.lock records it: the longer advice, sync's)
    p = subprocess.run([sys.executable, "-m", "pipegoose.kernels", "--manifest", str(manifest), "build",
                        "test/vendored"], capture_output=True, text=True,
                       env={**_env(cache_dir), "COLUMNS": str(columns)}, timeout=300)
    assert p.returncode == 3, p.stdout + p.stderr
    results = p.stdout[p.stdout.index("build results"):]
    assert max(map(len, results.splitlines())) <= columns, results
    assert "test/vendored  unavailable" in results and "tools/port.py sync" in " ".join(results.split()), results


@pytest.mark.parametrize("value, warned", [("abc", "torch ignores it"), ("0", "no limit"), ("4", None)])
def test_cli_build_warns_about_a_max_jobs_torch_ignores(tiny, value, warned):
    """MAX_JOBS=abc was taken by build without a word (only doctor said it; session 35's walkthrough)."""
    manifest, _op, cache_dir = tiny
    p = subprocess.run([sys.executable, "-m", "pipegoose.kernels", "--manifest", str(manifest), "build",
                        "test/vendored"], capture_output=True, text=True,
                       env={**_env(cache_dir), "MAX_JOBS": value}, timeout=300)
    assert p.returncode == 3, p.stdout + p.stderr  # (its files are not vendored: unavailable)
    if warned:
        assert f"build: warning: MAX_JOBS='{value}'" in p.stderr or f"MAX_JOBS={value}" in p.stderr, p.stderr
        assert warned in p.stderr, p.stderr
    else:
        assert "MAX_JOBS" not in p.stderr, p.stderr


@pytest.mark.parametrize("value", ["abc", "-1"])
def test_cli_build_refuses_a_bad_lock_timeout_before_building(tiny, value):
    """A review: PIPEGOOSE_BUILD_LOCK_TIMEOUT=abc failed the uncached kernels mid-run (FAILED, a ValueError, exit 1)
    and passed where every kernel was cached (exit 0, no word). Now a configuration error up front: exit 2, the
    variable named, nothing built."""
    manifest, _op, cache_dir = tiny
    p = subprocess.run([sys.executable, "-m", "pipegoose.kernels", "--manifest", str(manifest), "build",
                        "test/vendored", "test/tiny"], capture_output=True, text=True,
                       env={**_env(cache_dir), "PIPEGOOSE_BUILD_LOCK_TIMEOUT": value}, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"build: PIPEGOOSE_BUILD_LOCK_TIMEOUT: expected a number of seconds >= 0, got '{value}'" in p.stderr, p.stderr
    assert "building" not in p.stdout and "Traceback" not in p.stderr, p.stdout + p.stderr
    assert not cache_dir.exists() or not any(cache_dir.iterdir())


@pytest.mark.parametrize("value", ["2", "maybe"])
def test_cli_build_refuses_a_bad_allow_modified_vendor_before_building(tiny, value):
    """A review: PIPEGOOSE_ALLOW_MODIFIED_VENDOR=2 made each kernel FAILED, our own kernels included, exit 1. It is
    now a usage error up front, as a bad PIPEGOOSE_BUILD_LOCK_TIMEOUT is: exit 2, the variable named, nothing built."""
    manifest, _op, cache_dir = tiny
    p = subprocess.run([sys.executable, "-m", "pipegoose.kernels", "--manifest", str(manifest), "build", "test/tiny"],
                       capture_output=True, text=True,
                       env={**_env(cache_dir), "PIPEGOOSE_ALLOW_MODIFIED_VENDOR": value}, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"build: PIPEGOOSE_ALLOW_MODIFIED_VENDOR='{value}': expected 1/true/yes/on or 0/false/no/off" in p.stderr, \
        p.stderr
    assert "FAILED" not in p.stdout and "Traceback" not in p.stderr, p.stdout + p.stderr
    assert not cache_dir.exists() or not any(cache_dir.iterdir())


def test_cli_build_all_with_names_is_an_error(tmp_path):
    """`build --all nope` ignored the name and built every kernel (half an hour on 2 cores); --all and names
    exclude each other."""
    p = subprocess.run([sys.executable, "-m", "pipegoose.kernels", "build", "--all", "nope"], capture_output=True,
                       text=True, env=_env(tmp_path / "cache"), timeout=300)
    assert p.returncode == 2 and "not both (got nope)" in p.stderr, p.stderr
    assert "building" not in p.stdout, p.stdout


def test_cli_unknown_kernel_and_options_after_the_subcommand(tiny, tmp_path):
    """An unknown name is a clean error (exit 2, close matches), not a traceback; --manifest / --cache-dir work
    after the subcommand as well as before it."""
    manifest, op, cache_dir = tiny
    env = _env(cache_dir)
    p = subprocess.run([sys.executable, "-m", "pipegoose.kernels", "--manifest", str(manifest), "build", "tiny_typo"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "unknown kernel 'tiny_typo'" in p.stderr, p.stderr
    other = tmp_path / "other-cache"
    p = subprocess.run([sys.executable, "-m", "pipegoose.kernels", "doctor", "--manifest",
                        str(_without_vendored(manifest)), "--cache-dir", str(other)],
                       capture_output=True, text=True, env=env, timeout=300)
    out = p.stdout.replace("\n", "").replace("│", "").replace(" ", "")
    assert p.returncode == 0 and "test/tiny" in p.stdout and str(other).replace(" ", "") in out, p.stdout + p.stderr


def test_cli_doctor_makes_no_cache_folder(tiny, tmp_path):
    """doctor made the cache folder it checked (and its parents; session 35's walkthrough): a diagnosis now leaves the
    file system as it found it, checks a missing folder through the parent a build would make it in, and fails where
    that parent is a file."""
    manifest, _op, _cache = tiny
    cli = [sys.executable, "-m", "pipegoose.kernels", "--manifest", str(_without_vendored(manifest)), "doctor"]
    missing = tmp_path / "new" / "cache"
    p = subprocess.run(cli, capture_output=True, text=True, env={**_env(missing), "COLUMNS": "300"}, timeout=300)
    out = " ".join(p.stdout.replace("│", " ").split())
    assert p.returncode == 0 and f"cache dir ok {missing} (not made yet; a build makes it in {tmp_path})" in out, out
    assert not (tmp_path / "new").exists()
    (tmp_path / "file").write_text("")
    p = subprocess.run(cli, capture_output=True, text=True, env={**_env(tmp_path / "file" / "cache"), "COLUMNS": "300"},
                       timeout=300)
    out = " ".join(p.stdout.replace("│", " ").split())
    assert p.returncode == 1 and f"{tmp_path / 'file'} is not a folder" in out, out
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")  # a build's mkdir fails on it: not "ok" (a review)
    p = subprocess.run(cli, capture_output=True, text=True, env={**_env(tmp_path / "dangling"), "COLUMNS": "300"},
                       timeout=300)
    out = " ".join(p.stdout.replace("│", " ").split())
    assert p.returncode == 1 and "a symbolic link to" in out and "which does not exist" in out, out


def test_a_cache_path_that_is_a_file_gets_one_reason(tmp_path):
    """A cache path naming a file was "not writable (Not a directory)" in doctor and "not writable (File exists)" in
    build (a fresh-clone walkthrough): both now say what it is."""
    (tmp_path / "f").write_text("")
    for create in (False, True):  # doctor, build
        c = toolchain._writable_check(tmp_path / "f", create=create)
        assert not c.ok and c.detail == f"{tmp_path / 'f'}: a file, not a folder", c


def test_cli_path_options_expand_the_home_folder_and_refuse_blanks(tiny, tmp_path):
    """`doctor --cache-dir=~/x` made a folder named `~` in the working folder (a shell leaves `~` after `=` as it is),
    and `build --cache-dir ""` built into the working folder (a fresh-clone walkthrough): `~` is now expanded, and a
    blank path option is a usage error naming the option."""
    manifest, _op, _cache = tiny
    cli = [sys.executable, "-m", "pipegoose.kernels", "--manifest", str(_without_vendored(manifest))]
    env = {**_env(tmp_path / "unused"), "HOME": str(tmp_path / "home"), "COLUMNS": "300"}
    p = subprocess.run(cli + ["doctor", "--cache-dir=~/x"], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=300)
    out = " ".join(p.stdout.replace("│", " ").split())
    assert p.returncode == 0 and f"cache {tmp_path / 'home' / 'x'}" in out, out
    assert not (tmp_path / "~").exists()
    for flag in ("--cache-dir", "--manifest"):
        p = subprocess.run(cli + ["build", "--all", flag, ""], capture_output=True, text=True, env=env, cwd=tmp_path,
                           timeout=300)
        assert p.returncode == 2 and f"argument {flag}: expected a path, got an empty value" in p.stderr, p.stderr
    assert not (tmp_path / "locks").exists()
    # each subcommand's help lists them too (`doctor -h` did not; a fresh-clone check)
    for cmd in ("doctor", "build", "clean"):
        p = subprocess.run(cli + [cmd, "-h"], capture_output=True, text=True, env=env, timeout=300)
        assert p.returncode == 0 and "--cache-dir CACHE_DIR" in p.stdout and "--manifest MANIFEST" in p.stdout, p.stdout
    # the description without the docstring's reST backticks (session 40's walkthrough)
    p = subprocess.run(cli + ["--help"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0 and "doctor | build | clean" in p.stdout and "``" not in p.stdout, p.stdout


def test_cli_cache_dir_help_names_every_default(tmp_path):
    """`--cache-dir`'s help said "default: $PIPEGOOSE_CACHE_DIR or ~/.cache/...", where the builder also honours
    $XDG_CACHE_HOME (pipegoose._env.user_cache_dir; a review): the help names the three, in the order they are taken,
    before and after the subcommand."""
    env = {**_env(tmp_path / "unused"), "COLUMNS": "300"}
    want = "$PIPEGOOSE_CACHE_DIR, else $XDG_CACHE_HOME/pipegoose/kernels, else ~/.cache/pipegoose/kernels"
    for args in (["--help"], ["doctor", "-h"], ["build", "-h"], ["clean", "-h"]):
        p = subprocess.run([sys.executable, "-m", "pipegoose.kernels", *args], capture_output=True, text=True, env=env,
                           timeout=300)
        assert p.returncode == 0 and want in " ".join(p.stdout.split()), (args, p.stdout)


def test_cli_doctor_fails_on_a_bad_allow_modified_vendor(tiny):
    """PIPEGOOSE_ALLOW_MODIFIED_VENDOR=maybe made every kernel unavailable, but doctor exited 0 (session 33's
    walkthrough): it is now a failed preflight row naming the variable and the values it takes, and the exit code 1."""
    manifest, _op, cache_dir = tiny
    cli = [sys.executable, "-m", "pipegoose.kernels", "--manifest", str(_without_vendored(manifest)), "doctor"]
    env = {**_env(cache_dir), "COLUMNS": "300"}  # rich's tables unwrapped
    ok = subprocess.run(cli, capture_output=True, text=True, env={**env, "PIPEGOOSE_ALLOW_MODIFIED_VENDOR": "1"},
                        timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    p = subprocess.run(cli, capture_output=True, text=True, env={**env, "PIPEGOOSE_ALLOW_MODIFIED_VENDOR": "maybe"},
                       timeout=300)
    out = " ".join(p.stdout.replace("│", " ").split())
    assert p.returncode == 1, p.stdout + p.stderr
    assert "PIPEGOOSE_ALLOW_MODIFIED_VENDOR FAIL 'maybe'" in out and "1/true/yes/on or 0/false/no/off" in out, out
    # said once, in its preflight row; the kernel rows point there (every row repeated it: session 40's walkthrough)
    assert out.count("1/true/yes/on or 0/false/no/off") == 1 and "see preflight" in out, out


def test_cli_doctor_fits_narrow_terminals(tiny):
    """At 40 and 60 columns doctor's tables cut the variable names ("TORCH_CUDA_ARCH…") and broke cells mid-word
    (session 41's walkthrough). Where the names, checks, kernels and states do not fit whole in a table, each table is
    a list: a line of them, the rest indented below; at 200 columns, tables."""
    manifest, _op, cache_dir = tiny
    cli = [sys.executable, "-m", "pipegoose.kernels", "--manifest", str(_without_vendored(manifest)), "doctor"]
    for cols in ("40", "60"):
        p = subprocess.run(cli, capture_output=True, text=True, env={**_env(cache_dir), "COLUMNS": cols}, timeout=300)
        lines = p.stdout.splitlines()
        assert p.returncode in (0, 3) and "…" not in p.stdout and "┃" not in p.stdout, p.stdout + p.stderr
        for name in ("TORCH_CUDA_ARCH_LIST", "PIPEGOOSE_ALLOW_MODIFIED_VENDOR", "PIPEGOOSE_CACHE_DIR"):
            i = lines.index(name)
            assert lines[i + 1].startswith("    "), (name, p.stdout)
        assert any(ln.startswith("nvcc  ") for ln in lines), p.stdout
        assert any(ln.startswith("test/tiny  ") for ln in lines), p.stdout
        assert all(len(ln) <= int(cols) for ln in lines if ln.startswith("    ")), p.stdout
    p = subprocess.run(cli, capture_output=True, text=True, env={**_env(cache_dir), "COLUMNS": "200"}, timeout=300)
    assert "│ TORCH_CUDA_ARCH_LIST " in p.stdout and "┃ check " in p.stdout, p.stdout
    # COLUMNS=0 as unset (160 when piped): doctor printed nothing (the final read of session 41; port.py's rule)
    p = subprocess.run(cli, capture_output=True, text=True, env={**_env(cache_dir), "COLUMNS": "0"}, timeout=300)
    lines = p.stdout.splitlines()
    assert "│ TORCH_CUDA_ARCH_LIST " in p.stdout and max(map(len, lines)) <= 160, p.stdout


def test_cli_doctor_says_a_passed_over_cuda_home_in_its_row(tiny, tmp_path):
    """CUDA_HOME pointing at no toolkit: doctor printed a raw UserWarning with a source line while its "CUDA toolkit"
    row said ok (session 40's walkthrough). The row is a warning now, naming the variable and the fix; no traceback
    text on stderr. (Needs a toolkit elsewhere, as on CI.)"""
    from pipegoose.kernels import toolchain

    env_home = {v: os.environ.pop(v) for v in ("CUDA_HOME", "CUDA_PATH") if v in os.environ}
    try:
        toolchain.find_cuda_home.cache_clear()
        if toolchain.find_cuda_home() is None:
            pytest.skip("no CUDA toolkit on this machine")
    finally:
        os.environ.update(env_home)
        toolchain.find_cuda_home.cache_clear()
    manifest, _op, cache_dir = tiny
    cli = [sys.executable, "-m", "pipegoose.kernels", "--manifest", str(_without_vendored(manifest)), "doctor"]
    env = {**_env(cache_dir), "COLUMNS": "400", "CUDA_HOME": str(tmp_path / "nonexistent")}
    env.pop("CUDA_PATH", None)
    p = subprocess.run(cli, capture_output=True, text=True, env=env, timeout=300)
    out = " ".join(p.stdout.replace("│", " ").split())
    assert p.returncode == 0, p.stdout + p.stderr
    assert "CUDA toolkit warn" in out and "is not a CUDA toolkit" in out and "unset CUDA_HOME" in out, out
    assert "UserWarning" not in p.stderr and "find_cuda_home()" not in p.stderr, p.stderr


@pytest.mark.parametrize("var, value", [("PIPEGOOSE_IMPL_LAYER_NORM", "foo"), ("PIPEGOOSE_STRICT", "maybe"),
                                        ("PIPEGOOSE_SMALL_NUMEL", "abc"), ("PIPEGOOSE_BUILD_LOCK_TIMEOUT", "x")])
def test_cli_doctor_checks_the_dispatcher_variables(tiny, var, value):
    """doctor exited 0 without a word on a bad PIPEGOOSE_IMPL_*, PIPEGOOSE_STRICT or PIPEGOOSE_SMALL_NUMEL, which fail
    the first call of an op (session 34's walkthrough): a failed preflight row naming the variable, exit 1."""
    manifest, _op, cache_dir = tiny
    cli = [sys.executable, "-m", "pipegoose.kernels", "--manifest", str(_without_vendored(manifest)), "doctor"]
    env = {**_env(cache_dir), "COLUMNS": "400"}
    p = subprocess.run(cli, capture_output=True, text=True, env={**env, var: value}, timeout=300)
    out = " ".join(p.stdout.replace("│", " ").split())
    row = "PIPEGOOSE_BUILD_LOCK_TIMEOUT FAIL" if var == "PIPEGOOSE_BUILD_LOCK_TIMEOUT" else "dispatcher variables FAIL"
    assert p.returncode == 1 and row in out and var in out and value in out, out + p.stderr
    ok = subprocess.run(cli, capture_output=True, text=True, env=env, timeout=300)
    assert ok.returncode == 0 and "dispatcher variables ok" in " ".join(ok.stdout.replace("│", " ").split()), ok.stdout
    if var == "PIPEGOOSE_IMPL_LAYER_NORM":  # a misspelt op name: a warning line, exit 0 (the review of session 34)
        typo = subprocess.run(cli, capture_output=True, text=True, env={**env, "PIPEGOOSE_IMPL_LAYERNORM": "apex"},
                              timeout=300)
        assert typo.returncode == 0 and "PIPEGOOSE_IMPL_LAYERNORM: no fused op of that name" in typo.stdout, typo.stdout


@pytest.mark.parametrize("value, state", [("x", "warn"), ("-1", "warn"), ("0", "warn"), ("2.5", "warn"),
                                          ("\u00b2", "fail"), ("4", "ok"), ("\u0664", "ok")])
def test_preflight_max_jobs(fake_toolkit, monkeypatch, value, state):
    """MAX_JOBS=x was taken without a word, though torch ignores it (ninja then runs its default number of jobs),
    and MAX_JOBS=0 sets no limit (session 33's walkthrough): a warning row naming the variable; a value torch takes
    as digits but int() refuses ('²': every build fails there) a failed row; a positive count (also in other
    digits, as torch reads it) an ok row; no row when it is unset."""
    monkeypatch.setenv("MAX_JOBS", value)
    rows = [c for c in toolchain.preflight(None) if c.name == "MAX_JOBS"]
    assert len(rows) == 1, rows
    row = rows[0]
    assert (row.ok, row.warn) == {"ok": (True, False), "warn": (True, True), "fail": (False, False)}[state], row
    if state == "ok":
        assert row.detail == "4 compile jobs per build"
    else:
        assert repr(value) in row.detail or value == "0", row
        assert "positive integer" in row.fix
    monkeypatch.delenv("MAX_JOBS")
    assert not [c for c in toolchain.preflight(None) if c.name == "MAX_JOBS"]


def _names_manifest(tmp_path, kernels: dict[str, tuple[str, ...]]):
    from pipegoose.kernels.manifest import Kernel, Manifest

    return Manifest(tmp_path / "kernels.yaml", {}, {
        i: Kernel(i, "src", ("a.cu",), "b.cpp", (), ("float32",), False, aliases=a) for i, a in kernels.items()})


def test_unknown_name_suggests_substring_and_close_matches(tmp_path):
    """A review: "adam" got only "adam_step" (difflib found one, so the substring matches never ran), leaving out
    fused_adam, multi_tensor_adam, ... apex/multi_tensor_adam; "" got the first five ids."""
    from pipegoose.kernels.manifest import SUGGESTIONS, UnknownNameError

    m = _names_manifest(tmp_path, {
        "megatron/scaled_masked_softmax": ("scaled_masked_softmax",),
        "apex/multi_tensor_adam": ("fused_adam", "multi_tensor_adam"),
        "deepspeed/multi_tensor_adam": ("deepspeed_fused_adam",),
        "pipegoose/rms_norm": ("rms_norm", "fused_rms_norm"),
        "pipegoose/multi_tensor_adam": ("adam_step",),
    })
    with pytest.raises(UnknownNameError) as ei:
        m.resolve("adam")
    hint = str(ei.value).split("did you mean: ", 1)[1].split(", ")
    assert {"adam_step", "fused_adam", "multi_tensor_adam", "deepspeed_fused_adam", "apex/multi_tensor_adam"} \
        <= set(hint), hint
    assert len(hint) == len(set(hint)) <= SUGGESTIONS == 6, hint
    assert not [h for h in hint if "adam" not in h], hint
    # the last path part, any case, - for _
    assert "fused_adam" in m.suggest("foo/adam") and m.suggest("Fused-Adam")[0] == "fused_adam"
    # typos still get close matches; unrelated names the known kernels
    assert m.suggest("rms_nrom")[:2] == ["rms_norm", "fused_rms_norm"]
    assert m.suggest("rmsnorm")[:2] == ["rms_norm", "fused_rms_norm"]
    with pytest.raises(UnknownNameError, match="unknown kernel 'nothere' in kernels.yaml; known kernels: megatron/"):
        m.resolve("nothere")
    assert len(m.suggest("a")) == SUGGESTIONS and m.suggest("a", n=2) == m.suggest("a")[:2]
    # an empty or blank name: its own error, no suggestions
    for blank in ("", "  "):
        with pytest.raises(UnknownNameError, match=re.escape(f"no kernel name given ({blank!r}): name a kernel id or "
                                                             "alias of kernels.yaml")) as ei:
            m.resolve(blank)
        assert "did you mean" not in str(ei.value) and "known kernels" not in str(ei.value)


def test_from_name_and_cli_unknown_and_empty_names(tiny):
    """The repo's manifest: from_name("adam") names every adam kernel's names; the CLI's build with "" says the
    name is empty (exit 2)."""
    with pytest.raises(KeyError) as ei:
        KernelBuilder.from_name("adam")
    for n in ("fused_adam", "multi_tensor_adam", "deepspeed_fused_adam", "apex/multi_tensor_adam", "adam_step"):
        assert n in str(ei.value), str(ei.value)
    with pytest.raises(KeyError, match="no kernel name given"):
        KernelBuilder.from_name("")
    manifest, _op, cache_dir = tiny
    p = subprocess.run([sys.executable, "-m", "pipegoose.kernels", "--manifest", str(manifest), "build", ""],
                       capture_output=True, text=True, env=_env(cache_dir), timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "no kernel name given ('')" in p.stderr, p.stderr


def test_from_name_checks_the_name_at_once(tiny):
    """KernelBuilder.from_name resolves the name when called: a typo raises KeyError with close matches there, not
    later at load(); a known alias or id gives the builder."""
    manifest, _op, cache_dir = tiny
    with pytest.raises(KeyError, match="unknown kernel 'tiny_typo'"):
        KernelBuilder.from_name("tiny_typo", manifest=manifest, cache_dir=cache_dir)
    assert KernelBuilder.from_name("tiny", manifest=manifest, cache_dir=cache_dir).kernel.id == "test/tiny"
    for bad in (1, b"tiny", ("tiny",), Path("tiny")):
        with pytest.raises(TypeError, match="^name: expected a kernel id or alias"):
            KernelBuilder.from_name(bad, manifest=manifest, cache_dir=cache_dir)
    with pytest.raises(ManifestError, match="cannot read the manifest: IsADirectoryError"):
        KernelBuilder.from_name("tiny", manifest=manifest.parent, cache_dir=cache_dir)


@pytest.mark.parametrize("where", ["locks folder", "lock"])
def test_cli_clean_of_a_read_only_cache_is_a_usage_error(tmp_path, monkeypatch, capsys, where):
    """A review: `clean` of a read-only cache holding a dead temp folder ended in a raw OSError [Errno 30] from
    filelock, exit 1 (`--dry-run` worked). It is now "cache not writable: <path>", exit 2, and nothing removed."""
    import errno
    import filelock

    from pipegoose.kernels import __main__ as cli

    cache_dir = tmp_path / "cache"
    dead = _plant_tmp(cache_dir, "tiny-0123456789abcdef01234567", _dead_pid())
    if where == "lock":   # (the locks folder there, its lock file not writable)
        (cache_dir / "locks").mkdir()

        def read_only(self, *a, **kw):
            raise OSError(errno.EROFS, "Read-only file system", self.lock_file)

        monkeypatch.setattr(filelock.FileLock, "acquire", read_only)
    else:
        real = Path.mkdir

        def read_only(self, *a, **kw):
            if self.name == "locks":
                raise OSError(errno.EROFS, "Read-only file system", str(self))
            return real(self, *a, **kw)

        monkeypatch.setattr(Path, "mkdir", read_only)
    assert cli.main(["--cache-dir", str(cache_dir), "clean"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"python -m pipegoose.kernels clean: cache not writable: {cache_dir} (Read-only file system: " \
           f"{cache_dir / 'locks'}" in err and "clean --dry-run lists them" in err and "Traceback" not in err, err
    assert dead.is_dir()
    assert cli.main(["--cache-dir", str(cache_dir), "clean", "--dry-run"]) == 0


def test_cli_ctrl_c_is_a_line_not_a_traceback(monkeypatch, capsys):
    """Ctrl-C during `python -m pipegoose.kernels build` printed a KeyboardInterrupt traceback; now one line saying
    what is left (nothing cached half-built; how to remove a temp folder) and exit status 130."""
    from pipegoose.kernels import __main__ as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_build", interrupted)
    assert cli.main(["build", "--all"]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "pipegoose.kernels clean" in err and "Traceback" not in err


def test_cli_build_says_when_it_waits_for_another_build(tiny, monkeypatch, capsys):
    """A second `python -m pipegoose.kernels build` whose kernel another process was building sat silent until that
    build ended (the builder's waiting line is off under PIPEGOOSE_QUIET, which the CLI sets): the CLI now prints a
    line naming the kernel and the lock's holder."""
    from pipegoose.kernels import __main__ as cli

    manifest, _op, _cache_dir = tiny
    calls = []

    def busy_build(self, force=False, on_wait=None):
        calls.append(on_wait)
        on_wait({"pid": 4242, "hostname": "node7"})   # what BuildLock.acquire calls when it finds the lock held
        raise KernelBuildError("stand-in")

    monkeypatch.setattr(KernelBuilder, "build", busy_build)
    assert cli.main(["--manifest", str(manifest), "build", "tiny"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert calls and calls[0] is not None
    assert "waiting test/tiny: pid 4242 on node7 is building it" in out, out
    # PIPEGOOSE_BUILD_LOCK_TIMEOUT=0 does not wait: the line says so (it said "waiting", then failed after 0 s)
    monkeypatch.setenv("PIPEGOOSE_BUILD_LOCK_TIMEOUT", "0")
    assert cli.main(["--manifest", str(manifest), "build", "tiny"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "busy test/tiny: pid 4242 on node7 is building it; PIPEGOOSE_BUILD_LOCK_TIMEOUT=0: not waiting" in out, out
    assert "waiting for that build" not in out, out


def test_modified_vendored_files_are_refused(tiny, fake_toolkit, monkeypatch):
    """A walkthrough: a vendored file changed after tools/port.py recorded it in kernels.lock was compiled and loaded
    without a word (port.py list said "modified"). The builder now refuses it, naming the files and the ways out;
    PIPEGOOSE_ALLOW_MODIFIED_VENDOR=1 builds it as it is."""
    import hashlib

    from pipegoose.porting.lock import Lock, LockedKernel, LockedSource

    manifest, _op, cache_dir = tiny
    root = manifest.parent
    src = root / "vendor" / "upstream" / "src"
    src.mkdir(parents=True)
    (src / "kernel.cu").write_text("// vendored\n")
    (src / "kernel.h").write_text("// header\n")
    (root / "LICENSES" / "upstream").mkdir(parents=True)
    (root / "LICENSES" / "upstream" / "LICENSE").write_text("Apache License, Version 2.0\n")
    lock = Lock(root / "kernels.lock")
    lock.sources["upstream"] = LockedSource("pypi", {"name": "upstream", "version": "1.0", "sha256": "a" * 64},
                                            "Apache-2.0", {"LICENSE": hashlib.sha256(
                                                b"Apache License, Version 2.0\n").hexdigest()})
    lock.kernels["test/vendored"] = LockedKernel("upstream", {
        f: hashlib.sha256((src.parent / f).read_bytes()).hexdigest() for f in ("src/kernel.cu", "src/kernel.h")})
    (root / "kernels.lock").write_text(lock.dumps())
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    b = KernelBuilder("test/vendored", manifest=manifest, cache_dir=cache_dir)
    assert b.modified_files() == []
    (src / "kernel.cu").write_text("// vendored, then changed\n")
    assert b.modified_files() == ["src/kernel.cu"]
    # unavailable, as doctor says (it was a KernelBuildError: build's "FAILED", exit status 1; a walkthrough)
    with pytest.raises(KernelUnavailableError, match=r"not what tools/port.py recorded: vendor/upstream/src/kernel.cu "
                                               r"differs from kernels.lock.*tools/port.py sync"):
        b.build()
    st = b.status()   # what doctor shows
    assert st["state"] == "unavailable" and "differs from kernels.lock" in st["detail"]
    # a second walkthrough: a file the lock does not record could shadow a recorded header (an include path finds it
    # first), and a missing or unreadable lock switched the check off
    (src / "kernel.cu").write_text("// vendored\n")
    (src / "common").mkdir()
    (src / "common" / "kernel.h").write_text("#error shadow\n")
    assert b.vendored_problems() == ["vendor/upstream/src/common/kernel.h is not recorded in kernels.lock (it could "
                                     "shadow a recorded header)"]
    (src / "common" / "kernel.h").unlink()
    # strays that no #include can find (a second review: a .cu of a kernel no longer locked, an editor's swap file
    # blocked every kernel of the source) are verify's to report, not the builder's to refuse
    (src / "other.cu").write_text("// a kernel no longer locked\n")
    (src / ".kernel.h.swp").write_text("swap")
    assert b.vendored_problems() == []
    # kernels.yaml changed since the files were vendored (a fresh-clone walkthrough: a new pin in kernels.yaml alone
    # was built from the old files without a word, where port.py's list said "stale" and sync refused)
    text = manifest.read_text()
    for edited, says in ((text.replace('version: "1.0"', 'version: "0.9"'), "kernels.yaml pins upstream otherwise "
                          "than kernels.lock records (version: '1.0' -> '0.9'): one of the two was edited by hand (or "
                          "by a merge): restore it from git (git checkout kernels.yaml, or git checkout kernels.lock; "
                          "git diff kernels.yaml kernels.lock shows which changed), then move both with `python "
                          "tools/port.py update upstream --to ...`"),
                         (text.replace("files: [src/kernel.cu, src/kernel.h]", "files: [src/kernel.cu]"),
                          "test/vendored: kernels.yaml's files differ from kernels.lock's: -src/kernel.h: python "
                          "tools/port.py add test/vendored"),
                         # (a license file declared since: port.py's verify and sync call it stale now, a review)
                         (text.replace("license: Apache-2.0\n    license_files: [LICENSE]",
                                       "license: Apache-2.0\n    license_files: [LICENSE, NOTICE]"),
                          "kernels.yaml and kernels.lock disagree on upstream: kernels.yaml license files LICENSE, "
                          "NOTICE != kernels.lock's LICENSE: python tools/port.py add test/vendored")):
        assert edited != text
        manifest.write_text(edited)
        stale = KernelBuilder("test/vendored", manifest=manifest, cache_dir=cache_dir)
        assert says in stale.vendored_problems()[0], stale.vendored_problems()
        with pytest.raises(KernelUnavailableError,
                           match="not what tools/port.py recorded: (test/vendored: )?kernels.yaml") as e:
            stale.build()
        assert "port.py sync" not in str(e.value), e.value  # sync refuses a changed pin or file list (a review)
        assert stale.status()["state"] == "unavailable"
    manifest.write_text(text)
    assert b.vendored_problems() == []
    # a lock that fetches the source by another kind than kernels.yaml (port.py's list and verify call it stale; the
    # builder ignored the kind, session 59's gaps)
    good_lock = (root / "kernels.lock").read_text()
    lock.sources["upstream"] = LockedSource("git", dict(lock.sources["upstream"].pin), "Apache-2.0",
                                            dict(lock.sources["upstream"].license_files))
    (root / "kernels.lock").write_text(lock.dumps())
    assert b.vendored_problems() == ["kernels.yaml and kernels.lock disagree on upstream: kernels.lock fetches it by "
                                     "git, kernels.yaml by pypi: python tools/port.py add test/vendored"]
    (root / "kernels.lock").write_text(good_lock)
    assert b.vendored_problems() == []
    # a value of neither kind is an error on a clean tree too (session 32's walkthrough: it passed there)
    monkeypatch.setenv("PIPEGOOSE_ALLOW_MODIFIED_VENDOR", "2")
    with pytest.raises(KernelBuildError, match=r"PIPEGOOSE_ALLOW_MODIFIED_VENDOR='2': expected 1/true/yes/on"):
        b.build()
    st = b.status()   # doctor names it
    assert st["state"] == "unavailable" and "PIPEGOOSE_ALLOW_MODIFIED_VENDOR='2'" in st["detail"], st
    monkeypatch.delenv("PIPEGOOSE_ALLOW_MODIFIED_VENDOR")
    (root / "kernels.lock").rename(root / "kernels.lock.away")
    assert "no record of this kernel" in b.vendored_problems()[0]
    # its advice is add, not sync (which does not add a kernel; a review, session 60)
    with pytest.raises(KernelUnavailableError, match=r"vendor it with python tools/port.py add test/vendored\); or "
                                                     r"build the vendored files as they are") as e:
        b.build()
    assert "port.py sync" not in str(e.value), e.value
    (root / "kernels.lock").write_text("version: 2\n")
    assert "kernels.lock cannot be read" in b.vendored_problems()[0]
    with pytest.raises(KernelUnavailableError, match="cannot be read") as e:
        b.build()
    # (not sync, which refuses such a lock too: a re-test)
    assert "restore kernels.lock from git" in str(e.value) and "port.py sync" not in str(e.value), e.value
    (root / "kernels.lock.away").replace(root / "kernels.lock")
    (src / "kernel.cu").write_text("// vendored, then changed\n")
    monkeypatch.setenv("PIPEGOOSE_ALLOW_MODIFIED_VENDOR", "2")   # a value of neither kind: named, not taken as "off"
    with pytest.raises(KernelBuildError, match=r"PIPEGOOSE_ALLOW_MODIFIED_VENDOR='2': expected 1/true/yes/on"):
        b.build()
    monkeypatch.setenv("PIPEGOOSE_ALLOW_MODIFIED_VENDOR", "yes")
    st = b.status()   # doctor: not refused, and says what it would build
    assert st["state"] != "unavailable" and "PIPEGOOSE_ALLOW_MODIFIED_VENDOR" in st["detail"]
    with pytest.warns(UserWarning, match="building third-party code that is not what kernels.lock records"), \
            pytest.raises(KernelError) as e:   # on to the compiler (the fake toolkit's nvcc compiles nothing)
        b.build()
    assert "differs from kernels.lock" not in str(e.value)
    assert KernelBuilder("test/tiny", manifest=manifest, cache_dir=cache_dir).vendored_problems() == []  # our own


def test_vendored_problems_with_a_relative_manifest_path(monkeypatch):
    """A review: after vendored_problems and modified_files were made to share one list (168cd1b), a manifest loaded
    from a relative path (``--manifest kernels.yaml``) made them raise for this project's own kernels ("'/work/main' is
    not in the subpath of ''"): the vendor folder is absolute, the manifest's root relative. Our own kernels have no
    vendored files to check."""
    from pipegoose.kernels.manifest import load_manifest

    monkeypatch.chdir(REPO)
    m = load_manifest("kernels.yaml")
    b = KernelBuilder("pipegoose/softmax", manifest=m)
    assert b.vendored_problems() == [] and b.modified_files() == []


@pytest.mark.parametrize("value, expect", [("1", True), ("true", True), (" Yes ", True), ("on", True), ("0", False),
                                           ("off", False), ("", False), ("maybe", None)])
def test_quiet_takes_the_switch_values(monkeypatch, capsys, value, expect):
    """Only PIPEGOOSE_QUIET=1 silenced the builder: true/yes/on printed on without a word (a fresh-clone walkthrough).
    It now reads as the other switches; another value keeps the progress lines, with a warning naming it."""
    from pipegoose.kernels import builder

    monkeypatch.setenv("PIPEGOOSE_QUIET", value)
    builder._QUIET_WARNED.clear()
    if expect is None:
        with pytest.warns(UserWarning, match=r"PIPEGOOSE_QUIET='maybe': expected 1/true/yes/on"):
            builder._log("hello")
    else:
        builder._log("hello")
    assert ("[pipegoose.kernels] hello" in capsys.readouterr().err) == (expect is not True)


def test_cli_doctor_fails_on_a_bad_quiet(tiny):
    manifest, _op, cache_dir = tiny
    cli = [sys.executable, "-m", "pipegoose.kernels", "--manifest", str(_without_vendored(manifest)), "doctor"]
    p = subprocess.run(cli, capture_output=True, text=True, env={**_env(cache_dir), "COLUMNS": "300",
                                                                 "PIPEGOOSE_QUIET": "maybe"}, timeout=300)
    out = " ".join(p.stdout.replace("│", " ").split())
    assert p.returncode == 1 and "PIPEGOOSE_QUIET FAIL 'maybe'" in out, out


def test_cli_build_warns_on_a_bad_quiet_before_any_build(tiny):
    """PIPEGOOSE_QUIET=maybe: the warning came only from a progress line, so a build whose kernels were all cached (or,
    here, none to build: an unknown name) said nothing (a fresh-clone walkthrough). The CLI now reads it first."""
    manifest, _op, cache_dir = tiny
    cli = [sys.executable, "-m", "pipegoose.kernels", "--manifest", str(manifest), "build", "no_such_kernel"]
    p = subprocess.run(cli, capture_output=True, text=True, env={**_env(cache_dir), "PIPEGOOSE_QUIET": "maybe"},
                       timeout=300)
    assert p.returncode == 2 and "PIPEGOOSE_QUIET='maybe': expected 1/true/yes/on" in p.stderr, p.stderr


def test_quiet_warns_once_across_threads(monkeypatch):
    """Threads reading a bad PIPEGOOSE_QUIET at once (parallel builds log from several) each passed the "warned
    already?" check before any recorded the value, and each warned. A set whose membership test waits for a second
    thread makes that interleaving certain."""
    import threading
    import warnings

    from pipegoose.kernels import builder

    both_checked = threading.Barrier(2, timeout=2)

    class SlowSet(set):
        def __contains__(self, item):
            found = super().__contains__(item)
            try:
                both_checked.wait()  # a second reader gets here only if the check is not under a lock
            except threading.BrokenBarrierError:
                pass
            return found

    monkeypatch.setattr(builder, "_QUIET_WARNED", SlowSet())
    monkeypatch.setenv("PIPEGOOSE_QUIET", "maybe")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=builder.quiet) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len([w for w in caught if "PIPEGOOSE_QUIET='maybe'" in str(w.message)]) == 1


def _vendor_upstream(root: Path) -> None:
    """test/vendored vendored as tools/port.py leaves it: its files, its source's license and a kernels.lock that
    records them all."""
    import hashlib

    from pipegoose.porting.lock import Lock, LockedKernel, LockedSource

    src = root / "vendor" / "upstream" / "src"
    src.mkdir(parents=True, exist_ok=True)
    (src / "kernel.cu").write_text("// vendored\n")
    (src / "kernel.h").write_text("// header\n")
    lic = root / "LICENSES" / "upstream" / "LICENSE"
    lic.parent.mkdir(parents=True, exist_ok=True)
    lic.write_text("Apache License, Version 2.0\n")

    def digest(p: Path) -> str:
        return hashlib.sha256(p.read_bytes()).hexdigest()

    lock = Lock(root / "kernels.lock")
    lock.sources["upstream"] = LockedSource("pypi", {"name": "upstream", "version": "1.0", "sha256": "a" * 64},
                                            "Apache-2.0", {"LICENSE": digest(lic)})
    lock.kernels["test/vendored"] = LockedKernel("upstream", {f: digest(src.parent / f)
                                                              for f in ("src/kernel.cu", "src/kernel.h")})
    (root / "kernels.lock").write_text(lock.dumps())


def test_a_pending_port_change_makes_vendored_kernels_unavailable(tiny, fake_toolkit, monkeypatch):
    """A review: a `kill -9` of `sync` left vendor/<source> in place and LICENSES/<source> missing, and doctor exited 0
    and would build; one of `update` left no kernels.yaml, and doctor said to reinstall. A transaction of
    tools/port.py in vendor/.port-txn/ (interrupted, or running: the repository lock says which) now makes the vendored
    kernels unavailable, saying to run verify (or sync) to roll it back, and is a failed doctor row; our own kernels
    build; a manifest missing beside it is named with the same advice."""
    manifest, _op, cache_dir = tiny
    root = manifest.parent
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    _vendor_upstream(root)
    b = KernelBuilder("test/vendored", manifest=manifest, cache_dir=cache_dir)
    assert b.status()["state"] == "not built"
    txn = root / "vendor" / ".port-txn" / "0123456789ab"
    txn.mkdir(parents=True)
    (txn / "journal.json").write_text(json.dumps({"committed": False, "entries": []}))
    says = ("kernel test/vendored: an interrupted tools/port.py change waits in vendor/.port-txn/ (vendor/, LICENSES/, "
            "kernels.lock and kernels.yaml may be half-swapped): run `python tools/port.py verify` (or sync) to roll "
            "it back")
    with pytest.raises(KernelUnavailableError) as e:
        b.build()
    assert str(e.value) == says
    assert b.status() == {"kernel": "test/vendored", "state": "unavailable", "detail": says, "key": None}
    assert KernelBuilder("test/tiny", manifest=manifest, cache_dir=cache_dir).status()["state"] == "not built"
    # a run holding the repository lock: under way, not interrupted
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom filelock import FileLock\n"
                               f"lk = FileLock({str(root / 'vendor' / '.port.lock')!r})\nlk.acquire()\n"
                               "print('held', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert "a tools/port.py run is changing vendor/, LICENSES/ and kernels.lock now (vendor/.port-txn/ holds its " \
               "transaction): build once it has finished" in b.status()["detail"]
    finally:
        holder.kill()
        holder.wait()
    # doctor: a failed row (exit 1), the kernel's row unavailable
    env = {**_env(cache_dir), "COLUMNS": "400", "TORCH_CUDA_ARCH_LIST": "9.0"}
    p = subprocess.run([sys.executable, "-m", "pipegoose.kernels", "--manifest", str(manifest), "doctor"],
                       capture_output=True, text=True, env=env, timeout=300)
    out = " ".join(p.stdout.replace("│", " ").split())
    assert p.returncode == 1, p.stdout + p.stderr
    assert "tools/port.py change FAIL an interrupted tools/port.py change waits in vendor/.port-txn/" in out, out
    # the manifest moved aside (what an update killed mid-swap left before single files were replaced in one rename)
    manifest.rename(root / "kernels.yaml.away")
    p = subprocess.run([sys.executable, "-m", "pipegoose.kernels", "--manifest", str(manifest), "doctor"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2 and "kernels.yaml: manifest not found; an interrupted tools/port.py change waits in " \
        "vendor/.port-txn/" in " ".join(p.stderr.split()) and "roll it back" in p.stderr, p.stderr
    (root / "kernels.yaml.away").rename(manifest)
    shutil.rmtree(txn.parent)
    assert b.status()["state"] == "not built"


def test_a_vendored_kernel_without_its_collected_license_is_refused(tiny, fake_toolkit, monkeypatch):
    """A review: the builder never looked at LICENSES/: with LICENSES/<source>/LICENSE removed, doctor exited 0 and the
    Apache-2.0 kernels built (and cached builds loaded). A vendored kernel whose source's license file is missing or
    not what kernels.lock records is now unavailable, saying to run sync, PIPEGOOSE_ALLOW_MODIFIED_VENDOR=1 or not;
    our own kernels are not concerned."""
    manifest, _op, cache_dir = tiny
    root = manifest.parent
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    _vendor_upstream(root)
    b = KernelBuilder("test/vendored", manifest=manifest, cache_dir=cache_dir)
    assert b.vendored_problems() == []
    key = b.build_key()
    entry = cache.entry_dir(cache_dir, key)   # a build of it in the cache
    entry.mkdir(parents=True)
    (entry / "lib.so").write_bytes(b"")
    (entry / cache.BUILD_INFO).write_text(json.dumps({"kernel": "test/vendored", "key": key, "library": "lib.so"}))
    assert b.status()["state"] == "cached"
    lic = root / "LICENSES" / "upstream" / "LICENSE"
    text = lic.read_text()
    for change, says in ((lic.unlink, "LICENSES/upstream/LICENSE, the source's license, is missing"),
                         (lambda: lic.write_text("MIT License\n"),
                          "LICENSES/upstream/LICENSE, the source's license, differs from kernels.lock")):
        change()
        assert b.vendored_problems() == [says]
        for allow in ("0", "1"):
            monkeypatch.setenv("PIPEGOOSE_ALLOW_MODIFIED_VENDOR", allow)
            with pytest.raises(KernelUnavailableError) as e:
                b.build()
            assert str(e.value) == (f"kernel test/vendored: {says}: a vendored kernel is built only with the license "
                                    "tools/port.py collected with its files; restore it with python tools/port.py sync")
            st = b.status()
            assert st["state"] == "unavailable" and st["detail"] == str(e.value), st
        monkeypatch.delenv("PIPEGOOSE_ALLOW_MODIFIED_VENDOR")
        lic.write_text(text)
        assert b.status()["state"] == "cached"
    lic.unlink()
    assert KernelBuilder("test/tiny", manifest=manifest, cache_dir=cache_dir).vendored_problems() == []
