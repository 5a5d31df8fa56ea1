"""Real registry runs (marker ``network``): skipped with the reason when pip's index cannot be reached."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pipegoose.porting import Porter, audit
from pipegoose.porting.fetch import SimpleIndex, pip_index_config

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.network


@pytest.fixture(scope="module")
def online():
    try:
        links = SimpleIndex(pip_index_config()).sdists("colossalai")
    except Exception as e:  # noqa: BLE001 - any failure means: no registry here
        pytest.skip(f"pip's package index is not reachable: {e}")
    if not links:
        pytest.skip("pip's configured indexes carry no colossalai sdist")


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "repo"
    r.mkdir()
    shutil.copy(ROOT / "kernels.yaml", r / "kernels.yaml")
    shutil.copy(ROOT / "LICENSE", r / "LICENSE")
    return r


def test_real_add_colossalai_kernel(online, root):
    """Default download cache (so a developer's later sync is offline); vendor/ of a temporary root."""
    p = Porter(root / "kernels.yaml")
    p.add(["megatron/scaled_masked_softmax"])
    assert (root / "vendor/colossalai/extensions/csrc/kernel/cuda/scaled_masked_softmax_kernel.cu").is_file()
    assert "Apache License" in (root / "LICENSES/colossalai/LICENSE").read_text()
    assert p.verify() == []
    assert not (ROOT / "vendor" / ".port-txn").exists()


def test_real_audit_against_neighbouring_releases(online, root):
    p = Porter(root / "kernels.yaml")
    p.add(["megatron/scaled_upper_triang_masked_softmax", "deepspeed/multi_tensor_adam"])
    r = audit(p, ["megatron/scaled_upper_triang_masked_softmax"], to="0.4.9")
    s = r.sources[0]
    assert s.error is None and s.to_pin["version"] == "0.4.9"
    assert all(sy.before for k in s.kernels for sy in k.symbols)  # the regex finds fwd_cuda/bwd_cuda at the pin
    assert r.exit_code in (0, 1)
    r = audit(p, ["deepspeed/multi_tensor_adam"], to="0.19.7")
    s = r.sources[0]
    assert s.error is None and s.kernels[0].symbols[0].before
    assert r.exit_code in (0, 1)
