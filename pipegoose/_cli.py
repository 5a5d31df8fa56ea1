"""What the command-line tools (``tools/port.py``, ``python -m pipegoose.kernels``) share."""

from __future__ import annotations

import argparse
import os

__all__ = ["path_arg"]


def path_arg(text: str) -> str:
    """argparse type of a path option: ``~`` expanded (a shell leaves ``--cache-dir=~/x`` as it is, which made a folder
    named ``~``), and an empty or blank value refused (``--cache-dir ""`` built into the working folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path, got an empty value")
    return os.path.expanduser(text)
