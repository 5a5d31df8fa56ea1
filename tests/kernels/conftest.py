"""Fixtures for the builder tests: a throw-away manifest with tiny kernels, and an isolated cache."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from kernel_helpers import write_manifest

from pipegoose.kernels import toolchain


def _clear_probes() -> None:
    for f in (toolchain.find_cuda_home, toolchain.nvcc_version, toolchain.host_compiler):
        f.cache_clear()


@pytest.fixture(autouse=True)
def fresh_probes():
    """Toolchain probes are cached per process; tests that monkeypatch them must not leak into others."""
    _clear_probes()
    yield
    _clear_probes()


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """(manifest path, op name, cache dir) with a unique op name and an empty cache."""
    op = f"tiny_{uuid.uuid4().hex[:10]}"
    root = tmp_path / "proj"
    manifest = write_manifest(root, op)
    cache = tmp_path / "cache"
    monkeypatch.setenv("PIPEGOOSE_CACHE_DIR", str(cache))
    monkeypatch.setenv("PIPEGOOSE_QUIET", "1")
    monkeypatch.setenv("MAX_JOBS", "1")
    return manifest, op, cache


@pytest.fixture
def fake_toolkit(tmp_path, monkeypatch):
    """A fake CUDA 13.0 toolkit and a CUDA 13.0 torch, so CUDA kernels' keys and preflight run anywhere."""
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    (home / "include").mkdir()
    for h in ("cuda_runtime.h", *toolchain.TORCH_CUDA_HEADERS):
        (home / "include" / h).write_text("")
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.48'\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(home))
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(toolchain, "torch_cuda_version", lambda: (13, 0))
    monkeypatch.setattr(toolchain, "visible_capabilities", lambda: [])
    return home
