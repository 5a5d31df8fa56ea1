"""Helpers shared by the benchmark modules: device slug, environment record, tolerance table, result records."""

from __future__ import annotations

import datetime as _dt
import importlib
import importlib.util
import os
import platform
import re
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]

__all__ = ["REPO_ROOT", "slug", "environment", "tolerances", "Measurement", "dtype_name", "today"]


def slug(device_name: str) -> str:
    """Tuning-table slug of a device name (docs/architecture.md "Tuning tables"): lower case, every run of
    characters other than ASCII letters and digits replaced by ``_``, none at either end (``"NVIDIA H200"`` ->
    ``"nvidia_h200"``): the dispatcher's :func:`pipegoose.nn.fusion.dispatch.device_slug`, which looks the table up.

    Raises ValueError when ``device_name`` is empty or has no letter or digit."""
    if not isinstance(device_name, str) or not re.search(r"[A-Za-z0-9]", device_name or ""):
        raise ValueError(f"device_name: expected a device name with letters or digits, got {device_name!r}")
    from pipegoose.nn.fusion.dispatch import device_slug

    return device_slug(device_name)


def today() -> str:
    return _dt.date.today().isoformat()


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (also accepts the name itself)."""
    return str(dtype).replace("torch.", "")


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        pass
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except Exception:
        return None


def _nvidia_smi() -> dict[str, str]:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"nvidia-smi failed: {e}"}
    if out.returncode != 0:
        return {"error": f"nvidia-smi exited {out.returncode}: {out.stderr.strip()[:200]}"}
    first = out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""
    keys = ["name", "driver", "memory_total", "max_sm_clock", "max_mem_clock", "power_limit"]
    return dict(zip(keys, [x.strip() for x in first.split(",")]))


def environment(device: str = "cuda") -> dict[str, Any]:
    """What a reader needs to reproduce the numbers: GPU, driver (nvidia-smi), library versions, date, host."""
    import torch

    env: dict[str, Any] = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "host": platform.node(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "liger_kernel": _version("liger_kernel") if importlib.util.find_spec("liger_kernel") else None,
        "matplotlib": _version("matplotlib"),
        "pipegoose_git": _git_head(),
        "device": device,
    }
    if device == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, capability=f"sm_{p.major}{p.minor}", sm_count=p.multi_processor_count,
                   gpu_memory_gib=round(p.total_memory / 2**30, 1),
                   l2_cache_mib=round(getattr(p, "L2_cache_size", 0) / 2**20, 1))
        smi = _nvidia_smi()
        env["driver"] = smi.get("driver")
        env["nvidia_smi"] = smi
    else:
        env.update(gpu=f"cpu ({platform.processor() or platform.machine()})", driver=None)
    return env


def _git_head() -> str | None:
    """The checkout's commit (``+dirty`` with uncommitted changes); where there is no git checkout or no gitpython
    (a copy of the tree on a GPU machine), pipegoose's version, saying so; None where neither is known."""
    try:
        import git  # gitpython

        repo = git.Repo(REPO_ROOT)
        return repo.head.commit.hexsha[:12] + ("+dirty" if repo.is_dirty(untracked_files=False) else "")
    except Exception:
        pass
    try:
        import pipegoose

        return f"{pipegoose.__version__} (no git checkout)"
    except Exception:
        return None


def tolerances() -> dict:
    """The project's single tolerance table, ``tests/tolerances.py: TOLERANCES`` (dtype -> dict(atol, rtol)).

    Loaded by path because ``tests`` is not an installed package. Raises FileNotFoundError when it is missing."""
    path = REPO_ROOT / "tests" / "tolerances.py"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the tolerance table is missing (TOLERANCES per dtype)")
    spec = importlib.util.spec_from_file_location("_pipegoose_tolerances", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod.TOLERANCES


STATUSES = ("ok", "FAILED", "unsupported", "unavailable", "error", "skipped")
# the statuses of rows that measured nothing (skipped for the budget; the impl did not load or build; it crashed or
# could not be timed): a merge keeps an earlier measurement over them. In the tuning table (benchmarks/tuning.py) a
# dispatchable impl's skipped row makes its group's sweep incomplete (the group keeps its earlier rules); an error row
# rules the impl out as a FAILED one does (no contender at that size, its earlier rules in the group go); an
# unavailable impl could not run on the machine that measured: the others are compared without it
NO_RESULT = ("skipped", "unavailable", "error")


@dataclass
class Measurement:
    """One row of results.json.

    ``status``: ``ok`` (checked against the float64 reference, then timed), ``FAILED`` (wrong result: not timed),
    ``unsupported`` (the impl refuses this input, e.g. key length > 2048 for the Megatron kernels), ``unavailable``
    (impl not installed / failed to build), ``error`` (it raised), ``skipped`` (time budget or filter).
    Times in milliseconds, bandwidth in GB/s (1e9 bytes/s), ``pct_of_copy`` in percent of the device-to-device
    copy bandwidth measured in the same run.
    """

    op: str
    impl: str
    dtype: str
    pas: str
    shape: dict
    cols: int
    status: str
    bytes: int = 0
    median_ms: float | None = None
    p20_ms: float | None = None
    p80_ms: float | None = None
    reps: int = 0
    gbps: float | None = None
    pct_of_copy: float | None = None
    max_abs_err: float | None = None
    detail: str = ""
    tunable: str | None = None   # dispatcher impl name (pipegoose, megatron, apex, torch, ...) or None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status: expected one of {', '.join(STATUSES)}, got {self.status!r}")
        if self.detail is None:   # (a results.json row with "detail": null crashed the reports: a review)
            self.detail = ""
        if not isinstance(self.detail, str):
            raise ValueError(f"detail: expected text, got {self.detail!r}")

    def to_json(self) -> dict:
        d = asdict(self)
        d["pass"] = d.pop("pas")
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Measurement":
        d = dict(d)
        d["pas"] = d.pop("pass")
        for k in _FLOATS:   # report._clean writes an infinite number as "inf" (JSON has none): read it back
            if d.get(k) in ("inf", "-inf"):
                d[k] = float(d[k])
        return cls(**d)


_FLOATS = ("median_ms", "p20_ms", "p80_ms", "gbps", "pct_of_copy", "max_abs_err")


def raise_compile_limits(at_least: int = 1024) -> None:
    """Raise dynamo's recompile limits to ``at_least``: a benchmark compiles one function for many shapes and dtypes
    (``dynamic=False``), and past the default limit (8) dynamo runs the function eagerly, timing eager PyTorch under
    the name of ``torch.compile`` (session 60: rope_partial's fp16 and fp32 compile rows at 9-19% of copy)."""
    import torch._dynamo as dynamo

    for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(dynamo.config, knob):
            setattr(dynamo.config, knob, max(getattr(dynamo.config, knob), at_least))


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


def parse_sizes(text: str, letters: str, meaning: str) -> tuple[int, ...]:
    """A ``--shapes`` value of the single-op benchmarks, ``AxBx...`` (``letters``: "RxD", say; ``meaning``: what each
    is, for the message) -> the positive sizes. Raises argparse.ArgumentTypeError (the value named) otherwise."""
    import argparse

    try:
        sizes = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        sizes = ()
    if len(sizes) != len(letters.split("x")):
        raise argparse.ArgumentTypeError(f"expected {letters} ({meaning}), got {text!r}")
    if min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected positive sizes, got {text!r}")
    return sizes


def parse_dtypes_reps_impls(ap: Any, args: Any, dtypes: dict, impls: tuple) -> tuple[list, tuple | None]:
    """The single-op benchmarks' shared options, checked: ``--dtypes`` (comma separated names of ``dtypes``, each
    once), ``--reps`` (positive) and ``--impls`` (comma separated names of ``impls``; empty: all, None). Errors go
    through ``ap.error`` (exit 2, the option named). Returns (the dtypes, the implementations or None)."""
    names = [x.strip().lower() for x in args.dtypes.split(",") if x.strip()]
    chosen = [dtypes.get(n) for n in names]
    if not chosen or None in chosen:
        ap.error(f"--dtypes: expected some of {', '.join(dtypes)}, got {args.dtypes!r}")
    if len(set(chosen)) != len(chosen):
        ap.error(f"--dtypes: {args.dtypes!r} names a dtype twice")
    if args.reps < 1:
        ap.error(f"--reps: expected a positive number of repetitions, got {args.reps}")
    picked = tuple(x.strip() for x in args.impls.split(",") if x.strip()) or None
    if args.impls and picked is None:
        ap.error(f"--impls: expected some of {', '.join(impls)}, got {args.impls!r}")
    unknown = [x for x in picked or () if x not in impls]
    if unknown:
        ap.error(f"--impls: unknown {', '.join(unknown)}; expected some of {', '.join(impls)}")
    return chosen, picked


def versions_line(env: dict, copy_gbps: float) -> str:
    """The single-op benchmarks' report line under the title: versions, the copy bandwidth, how to read the rows."""
    return (f"torch {env.get('torch')}, CUDA {env.get('cuda_runtime')}, triton {env.get('triton')}, transformers "
            f"{env.get('transformers')}, pipegoose {env.get('pipegoose_git')}. Device copy: {copy_gbps:.0f} GB/s. "
            "Time: median ms (L2 flushed); GB/s of the fewest bytes the pass moves; % of that copy.")


def timing_cells(row: dict) -> str:
    """A timed row's last cells, ``| impl | ms | GB/s | % of copy | status |``, or the status and why of one that was
    not timed."""
    if row["status"] == "ok":
        pct = f"{row['pct_copy']:.1f}" if row.get("pct_copy") is not None else ""
        return f"| {row['impl']} | {row['median_ms']:.4f} | {row['gbps']:.0f} | {pct} | ok |"
    return f"| {row['impl']} | | | | {row['status']}: {row.get('why', '')} |"
