"""Make the repository's ``benchmarks`` package importable (it is not installed: pyproject packages pipegoose*)."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
