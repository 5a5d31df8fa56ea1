"""Results writer: results.json (every measurement + environment), results.md (tables), and the closing summary."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from .byte_counts import STEP_PASSES
from .common import Measurement

__all__ = ["write_json", "load_json", "write_markdown", "summary_lines", "fill_pct", "RUN_KEYS", "run_entry"]

SCHEMA = 1
# what a merge (--report-only) records of each run it merges, in results.json's "runs" (the environment of a merge is
# its newest run's: rows of other runs were labelled with its versions, a review)
RUN_KEYS = ("date", "torch", "cuda_runtime", "triton", "transformers", "liger_kernel", "python", "driver",
            "pipegoose_git")


def run_entry(env: dict, results: str) -> dict:
    """One run of a merge: ``run`` (the label its rows carry: the date's day), the ``RUN_KEYS`` of its environment
    ``env`` and the ``results`` file it was read from."""
    return {"run": str(env.get("date") or "")[:10], **{k: env.get(k) for k in RUN_KEYS}, "results": results}


def fill_pct(measurements: Iterable[Measurement], copy_gbps: float | None) -> None:
    """Set ``pct_of_copy`` = 100 * gbps / copy on every timed measurement, where copy is the copy bandwidth of the run
    that measured it (``extra["copy_gbps"]``, which ``--report-only`` records on merged rows), else ``copy_gbps``
    (no-op without either). A merge used to rescale every row to the last run's copy (a walkthrough: 5.45% -> 8.73%
    for a row whose GB/s had not changed)."""
    for m in measurements:
        copy = (m.extra or {}).get("copy_gbps") or copy_gbps
        if m.gbps is not None and copy:
            m.pct_of_copy = 100.0 * m.gbps / copy


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _clean(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else str(x)
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_json(path: str | Path, env: dict, config: dict, copy: dict | None, measurements: list[Measurement],
               extra: dict | None = None) -> Path:
    """Write results.json atomically: ``{schema, environment, config, copy, measurements: [...], **extra}``
    (NaN errors are written as null: JSON has no NaN)."""
    data = {"schema": SCHEMA, "environment": env, "config": config, "copy": copy,
            "measurements": [m.to_json() for m in measurements]}
    data.update(extra or {})
    p = Path(path)
    _atomic_write(p, json.dumps(_clean(data), indent=1) + "\n")
    return p


def load_json(path: str | Path) -> tuple[dict, list[Measurement]]:
    data = json.loads(Path(path).read_text())
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: expected results schema {SCHEMA}, got {data.get('schema')!r}")
    return data, [Measurement.from_json(m) for m in data.get("measurements", [])]


def _cell(m: Measurement | None) -> str:
    if m is None:
        return ""
    if m.status == "ok":
        pct = f" ({m.pct_of_copy:.0f}%)" if m.pct_of_copy is not None else ""
        return (f"{m.gbps:.0f}" if m.gbps >= 10 else f"{m.gbps:.3g}") + pct
    return m.status


def _env_table(env: dict, copy: dict | None) -> list[str]:
    keys = ["gpu", "capability", "driver", "gpu_memory_gib", "l2_cache_mib", "torch", "cuda_runtime", "triton",
            "transformers", "liger_kernel", "python", "pipegoose_git", "date"]
    lines = ["| | |", "|---|---|"]
    lines += [f"| {k} | {env.get(k)} |" for k in keys if k in env]
    if copy:
        lines.append(f"| D2D copy bandwidth | {copy['gbps']:.0f} GB/s ({copy['bytes'] / 1e9:.2f} GB read+written, "
                     f"median {copy['median_ms']:.3f} ms) |")
    return lines


def _runs_table(runs: list[dict]) -> list[str]:
    """A merge's runs, oldest first: a line each with its date and the versions in which the runs differ."""
    differ = [k for k in RUN_KEYS[1:] if len({str(r.get(k)) for r in runs}) > 1]
    if not differ:
        return [f"Merged from {len(runs)} runs of the same versions (the environment above is the newest run's), "
                "of " + ", ".join(str(r.get("date")) for r in runs) + ".", ""]
    return [f"Merged from {len(runs)} runs; the environment above is the newest run's. Each row of results.json and "
            "of the end-to-end table names its run (the date's day); the runs differ in:", "",
            "| run | date | " + " | ".join(differ) + " |", "|---|---|" + "---|" * len(differ),
            *(f"| {r.get('run')} | {r.get('date')} | " + " | ".join(str(r.get(k)) for k in differ) + " |"
              for r in runs), ""]


def write_markdown(path: str | Path, env: dict, config: dict, copy: dict | None, measurements: list[Measurement],
                   e2e: list[dict] | None = None, build_cost: dict | None = None,
                   specialise: dict | None = None, runs: list[dict] | None = None) -> Path:
    """results.md: environment (a merge's: of its newest run, then each of its ``runs`` where their versions
    differ), then per op and dtype a table (rows: size x pass, columns: impls, cells: effective GB/s and % of the copy
    bandwidth, or the status), failures with their reasons, then e2e / build sections."""
    out = [f"# pipegoose benchmarks: {env.get('gpu')} ({env.get('date', '')[:10]})", "",
           "Effective bandwidth in GB/s (minimum bytes of the op / median time, see benchmarks/README.md) and, in "
           "parentheses, % of the device-to-device copy bandwidth measured in the same run. `FAILED` = wrong "
           "result against the float64 reference (not timed).", "", *_env_table(env, copy), ""]
    if runs and len(runs) > 1:
        out += _runs_table(runs)
    # a merge (--report-only) records every run's command, " ; "-joined: one line of them outgrew the page, so a
    # merge's list goes to the end of the file, one command per line
    commands = [c for c in str(config.get("command", "")).split(" ; ") if c]
    if len(commands) <= 1:
        out += [f"Run: `{commands[0] if commands else ''}`", ""]
    else:
        out += [f"Merged with `--report-only`: the {len(commands)} commands behind these rows (runs and earlier "
                "merges) are listed under \"Runs merged here\", at the end; each row of results.json names the date "
                "of the run that measured it.", ""]
    by_op: dict[tuple[str, str], list[Measurement]] = defaultdict(list)
    for m in measurements:
        by_op[(m.op, m.dtype)].append(m)
    for (op, dtype), ms in by_op.items():
        impls = list(dict.fromkeys(m.impl for m in ms))
        out += [f"## {op} — {dtype}", "", "| size | pass | " + " | ".join(impls) + " |",
                "|---|---|" + "---|" * len(impls)]
        rows: dict[tuple[int, str], dict[str, Measurement]] = defaultdict(dict)
        for m in ms:
            rows[(m.cols, m.pas)][m.impl] = m
        order = {"fwd": 0, "bwd": 1, "fwd+bwd": 2, "step": 3, "unclipped": 4}
        for (cols, pas) in sorted(rows, key=lambda k: (k[0], order.get(k[1], 9))):
            label = ((f"{cols / 1e6:.0f}M params" if cols >= 10**6 else f"{cols} params") if pas in STEP_PASSES
                     else str(cols))
            out.append(f"| {label} | {pas} | " + " | ".join(_cell(rows[(cols, pas)].get(i)) for i in impls) + " |")
        out.append("")
    bad = [m for m in measurements if m.status in ("FAILED", "error")]
    if bad:
        out += ["## Failures and errors", ""]
        seen = set()
        for m in bad:
            key = (m.op, m.impl, m.dtype, m.cols, m.detail)
            if key in seen:
                continue
            seen.add(key)
            out.append(f"- {m.status} {m.op} {m.impl} {m.dtype} cols={m.cols}: {m.detail}")
        out.append("")
    other = sorted({(m.status, m.impl, m.op, m.detail[:160]) for m in measurements
                    if m.status in ("unsupported", "unavailable")})
    if other:
        out += ["## Not measured (unsupported / unavailable)", ""]
        out += [f"- {s} {impl} {op}: {d}" for s, impl, op, d in other]
        out.append("")
    if e2e:
        # run: the date of the run that measured the row (--report-only merges rows of several runs; a variant
        # compares with the sdpa row of its own run, and the sdpa baseline moves between runs)
        out += ["## End-to-end training step (bf16, seq 2048, AdamW fused)", "",
                "| model | variant | params | batch | status | tokens/s | step ms | peak GiB | run | note |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in e2e:
            tps = f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") else ""
            ms_ = f"{r['step_ms']:.1f}" if r.get("step_ms") else ""
            mem = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") else ""
            params = f"{r['params']/1e6:.0f}M" if r.get("params") else ""
            out.append(f"| {r['model']} | {r['variant']} | {params} | {r.get('batch', '')} | {r['status']} | {tps} "
                       f"| {ms_} | {mem} | {r.get('run', '')} | {str(r.get('detail') or '')[:150]} |")
        out.append("")
    if build_cost:
        out += ["## Build cost", "", "```", json.dumps(build_cost, indent=1), "```", ""]
    if specialise:
        out += ["## Specialised builds", "", "```", json.dumps(specialise, indent=1), "```", ""]
    if len(commands) > 1:
        out += ["## Runs merged here", "", "Oldest first; the last is the merge that wrote this file.", ""]
        out += [f"{i}. `{c}`" for i, c in enumerate(commands, 1)]
        out.append("")
    p = Path(path)
    _atomic_write(p, "\n".join(out) + "\n")
    return p


def _gmean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def summary_lines(measurements: list[Measurement], copy: dict | None, e2e: list[dict] | None = None) -> list[str]:
    """A short text summary for the end of the log: per op/dtype (fwd+bwd, or step) the geometric mean over sizes
    of each impl's % of copy bandwidth (GB/s without a copy figure), counts of FAILED / errors, e2e tokens/s."""
    lines = []
    if copy:
        lines.append(f"D2D copy: {copy['gbps']:.0f} GB/s")
    groups: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for m in measurements:
        if m.status == "ok" and m.pas in ("fwd+bwd", "step"):
            v = m.pct_of_copy if m.pct_of_copy is not None else m.gbps
            if v and v > 0:
                groups[(m.op, m.dtype)][m.impl].append(v)
    unit = "% of copy" if copy else "GB/s"
    lines.append(f"geomean over sizes, fwd+bwd (optimizers: step), {unit}:")
    for (op, dt), impls in groups.items():
        cells = sorted(((_gmean(v), i) for i, v in impls.items()), reverse=True)
        lines.append(f"  {op:15s} {dt:8s} " + "  ".join(f"{i}={g:.0f}" for g, i in cells))
    counts: dict[str, int] = defaultdict(int)
    for m in measurements:
        counts[m.status] += 1
    if counts:   # (an end-to-end run alone printed "statuses: " with nothing after it: a walkthrough)
        lines.append("statuses: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    failed = sorted({f"{m.impl}/{m.op}/{m.dtype}" for m in measurements if m.status == "FAILED"})
    if failed:
        lines.append("FAILED: " + ", ".join(failed[:30]))
    errors = sorted({f"{m.impl}/{m.op}: {m.detail[:80]}" for m in measurements if m.status == "error"})
    if errors:
        lines.append("errors: " + " | ".join(errors[:8]))
    width = max([12, *(len(r["variant"]) for r in e2e or [])])
    for r in e2e or []:
        tps = f"{r['tokens_per_s']:.0f} tok/s" if r.get("tokens_per_s") else str(r.get("detail") or "")[:80]
        mem = f", peak {r['peak_mem_gib']:.1f} GiB" if r.get("peak_mem_gib") else ""
        run = f" (run {r['run']})" if r.get("run") else ""
        # a measured row's note too (e.g. "loss not compared: no ok sdpa run (sdpa oom)")
        note = f" [{str(r['detail'])[:100]}]" if r.get("tokens_per_s") and r.get("detail") else ""
        # (the variant column as wide as the longest variant name: liger_rmsnorm's rows stood a column out)
        lines.append(f"e2e {r['model']:6s} {r['variant']:{width}s} {r['status']:8s} {tps}{mem}{run}{note}")
    return lines
