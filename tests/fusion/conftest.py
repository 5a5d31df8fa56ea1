"""Shared fixtures of the functional and dispatch tests."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _fresh_stats():
    """The dispatcher's counters, last choices, choice cache and warnings already given, reset before each test (a
    module may override this fixture to reset more)."""
    from pipegoose.nn.fusion import dispatch

    dispatch.reset_stats()
    yield
