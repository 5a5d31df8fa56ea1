"""The ``repo`` fixture of the porting tests (helpers: porting_helpers.py)."""

from __future__ import annotations

import pytest

from porting_helpers import MIT, Repo


@pytest.fixture
def repo(tmp_path, monkeypatch) -> Repo:
    root = tmp_path / "repo"
    root.mkdir()
    (root / "LICENSE").write_text(MIT)
    index = tmp_path / "index"
    index.mkdir()
    monkeypatch.setenv("PIPEGOOSE_PORT_CACHE", str(tmp_path / "cache"))
    return Repo(root, tmp_path / "cache", index.as_uri())


