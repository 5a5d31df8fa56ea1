"""Shared pytest configuration: GPU tests (marker ``cuda``) are skipped, with the reason, where no GPU is visible."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# tests/kernels' helpers (kernel_helpers: poison, seed_of, ...) for the GPU tests of other folders: importable also
# where tests/kernels is not collected in the same run (a run of tests/fuse alone failed to import them on the H100,
# session 79). Appended, so that it shadows nothing.
_KERNEL_TESTS = str(Path(__file__).resolve().parent / "kernels")
if _KERNEL_TESTS not in sys.path:
    sys.path.append(_KERNEL_TESTS)


def _cuda_skip_reason() -> str | None:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return "torch is not installed"
    if not torch.cuda.is_available():
        return (f"needs an NVIDIA GPU (torch {torch.__version__} sees none); "
                "run on a GPU machine with: python -m pytest -m cuda")
    return None


def pytest_collection_modifyitems(config, items):
    reason = _cuda_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def no_tuning_table(tmp_path, monkeypatch):
    """Set the GPU's measured choices aside (the committed tuning table and the small-problem rule), for tests that
    check that our kernels run and are right (both may route a shape to PyTorch where PyTorch is faster; their own
    behaviour is tested on the CPU)."""
    from pipegoose.nn.fusion import dispatch

    monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "0")
    monkeypatch.setattr(dispatch, "TUNING_DIR", tmp_path)
    dispatch.clear_tuning_cache()
    yield
    dispatch.clear_tuning_cache()
