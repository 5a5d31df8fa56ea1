"""The ``PIPEGOOSE_*`` environment variables this project reads, so that a misspelt one is named instead of ignored.

The dispatcher's ``PIPEGOOSE_IMPL_<OP>`` variables are checked against the registered ops
(:func:`pipegoose.nn.fusion.dispatch.warn_unknown_env`); every other name is listed here, each with where it is read.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Mapping

__all__ = ["KNOWN", "flag", "unknown_names", "user_cache_dir"]

ON = ("1", "true", "yes", "on")
OFF = ("", "0", "false", "no", "off")


def flag(raw: str) -> bool | None:
    """A switch variable's value: True for 1/true/yes/on, False for 0/false/no/off or empty (case and surrounding
    blanks ignored), None for anything else (the caller raises, naming the variable)."""
    value = raw.strip().lower()
    return True if value in ON else False if value in OFF else None

KNOWN: dict[str, str] = {
    "PIPEGOOSE_STRICT": "pipegoose.nn.fusion.dispatch (a fallback raises)",
    "PIPEGOOSE_SMALL_NUMEL": "pipegoose.nn.fusion.dispatch (the small-problem size)",
    "PIPEGOOSE_IMPL_ATTENTION": "pipegoose.nn.fusion.transformers.attention",
    "PIPEGOOSE_CACHE_DIR": "pipegoose.kernels (the build cache)",
    "PIPEGOOSE_BUILD_LOCK_TIMEOUT": "pipegoose.kernels (seconds a build waits for another's lock)",
    "PIPEGOOSE_QUIET": "pipegoose.kernels (no progress lines)",
    "PIPEGOOSE_ALLOW_MODIFIED_VENDOR": "pipegoose.kernels (build vendored code kernels.lock does not record)",
    "PIPEGOOSE_MANIFEST": "tools/port.py (the kernels.yaml to use)",
    "PIPEGOOSE_PORT_CACHE": "tools/port.py (the download cache)",
    "PIPEGOOSE_NORM_CLUSTERS": "the norm kernels (thread block clusters on sm_90)",
    "PIPEGOOSE_NORM_SMEM_LIMIT": "the norm kernels (shared memory per block)",
    # research switches of the norm kernels (benchmarks.norm_raw), read at their first launch
    "PIPEGOOSE_NORM_FWD_EXP": "the norm kernels (forward experiment)",
    "PIPEGOOSE_NORM_FWD_WIDE": "the norm kernels (forward experiment)",
    "PIPEGOOSE_NORM_BWD_EXP": "the norm kernels (backward experiment)",
    "PIPEGOOSE_NORM_BWD_PDL": "the norm kernels (programmatic dependent launch of the column reduction)",
    # read only by builds with -DPIPEGOOSE_NORM_BWD_EXPERIMENT (the cluster backward's A/B runs)
    "PIPEGOOSE_NORM_BWD_CL_SIZE": "the norm kernels, experiment builds (blocks per cluster)",
    "PIPEGOOSE_NORM_BWD_CL_THREADS": "the norm kernels, experiment builds (full or slab: the cluster blocks' threads)",
    "PIPEGOOSE_NORM_BWD_CL_EXCHANGE": "the norm kernels, experiment builds (barrier or mbar)",
    # read by the GPU tests only (tests/kernels/test_fuzz_cuda.py: its random draws)
    "PIPEGOOSE_FUZZ_SEED": "tests/kernels/test_fuzz_cuda.py (the draws' seed)",
    "PIPEGOOSE_FUZZ_CASES": "tests/kernels/test_fuzz_cuda.py (cases per op)",
    "PIPEGOOSE_FUZZ_MAX_NUMEL": "tests/kernels/test_fuzz_cuda.py (elements of a case's largest tensor)",
}


def user_cache_dir(variable: str, name: str) -> Path:
    """A cache folder: ``$<variable>`` (``~`` expanded), else ``$XDG_CACHE_HOME/pipegoose/<name>``, else
    ``~/.cache/pipegoose/<name>``. A blank variable counts as unset (it made a folder named by the spaces), and a
    relative ``XDG_CACHE_HOME`` is ignored (invalid by the XDG base directory spec)."""
    env = os.environ.get(variable, "")
    if env.strip():
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg and Path(xdg).expanduser().is_absolute() else Path.home() / ".cache"
    return base / "pipegoose" / name


def unknown_names(environ: Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
    """``(name, closest known name or None)`` for each ``PIPEGOOSE_*`` variable set that this project does not read
    (``PIPEGOOSE_IMPL_*`` excepted: the dispatcher checks those against its ops)."""
    env = os.environ if environ is None else environ
    out = []
    for name in sorted(env):
        if name.startswith("PIPEGOOSE_") and not name.startswith("PIPEGOOSE_IMPL_") and name not in KNOWN:
            close = difflib.get_close_matches(name, list(KNOWN), n=1, cutoff=0.8)
            out.append((name, close[0] if close else None))
    return out
