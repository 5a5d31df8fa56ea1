"""tests/fuse: the models and inputs here are tiny, so the small-problem rule (``PIPEGOOSE_SMALL_NUMEL``) would send
every attention call to SDPA and every norm to the native op; these tests check our paths, so the rule is off
unless a test turns it on (``test_attention.py`` tests the rule itself)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _small_problem_rule_off(monkeypatch):
    monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "0")
