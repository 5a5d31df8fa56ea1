"""Tuning-table writer: the fastest correct dispatchable impl per op, dtype, pass and last-dim bucket.

Format and consumer: docs/architecture.md "Tuning tables" (``pipegoose/nn/fusion/tuning/<slug>.json``). Only
measurements with ``status == "ok"`` and a dispatcher impl name (``tunable``: pipegoose, megatron, apex, deepspeed,
torch, torch_fused; sdpa and eager for attention) take part; the ops' eager/native/compile/Liger rows are comparisons,
not choices the dispatcher can make. The optimizers' rows take part too (``adamw``'s rules are for the dispatcher's
``adam``; a ``step`` gives rules of pass null).

Buckets: for each (op, dtype, pass) the measured sizes are sorted; each size's winner is the impl with the lowest
median time (of equal times, the first in :data:`TIE_ORDER`, the dispatcher's built-in order: ours, PyTorch's fused
kernels, the ported copies, torch; so a tie gives the choice the GPU would make without a table, whatever the rows'
order); consecutive sizes with the same winner form one rule whose ``max_cols`` is the largest size in it; the
last rule has ``max_cols: null`` (any larger size). A size where no dispatchable impl passed gives no rule of its
own (the rule of the next larger size covers it, as it covers unmeasured sizes); a size that is not a positive
integer is a ValueError. Rules are written for the passes the dispatcher tells apart, ``fwd`` (no grad needed) and
``fwd+bwd`` (training); the ``bwd``-only timings stay in results.json.

Complete groups only: an (op, dtype, pass) group gives rules only where every row of a dispatchable impl has a
result: ``ok`` with a time, ``FAILED`` (a wrong result), ``error`` (it crashed, ran out of memory, or could not be
timed), ``unsupported`` (the impl declines the shape) or ``unavailable`` (it did not load or build on the machine that
measured: the others are compared without it, as the dispatcher there would choose without it). An impl that FAILED
or errored at a size is no contender there (never chosen), and :func:`write_tuning_table` drops the earlier rules
naming it in its group (a review: a crashing kernel kept its old rules, so the GPU was still sent to it, where a
FAILED one lost them). A row ``skipped`` (the time budget; ``run_ops`` times ``pipegoose`` last, so a budget running
out mid-size leaves our kernel untimed there), or an ``ok`` row whose time is not a positive finite number, makes the
group *incomplete*: it gives no rules, and :func:`write_tuning_table` keeps the group's earlier rules, less those
naming an impl that FAILED or errored in it now (a review: an incomplete sweep made the impls timed at a size its
winner, made the last measured bucket ``max_cols: null`` over the sizes the budget left out, and dropped the group's
earlier rules). :func:`incomplete_groups` says which and why.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterable

from .common import REPO_ROOT, Measurement, slug

__all__ = ["tuning_rules", "incomplete_groups", "kept_lines", "table_inputs", "read_rules", "write_tuning_table",
           "DEFAULT_TUNING_DIR", "TUNING_OPS"]

DEFAULT_TUNING_DIR = REPO_ROOT / "pipegoose" / "nn" / "fusion" / "tuning"
TUNING_OPS = ("softmax", "softmax.masked", "softmax.causal", "layer_norm", "rms_norm", "swiglu", "swiglu.packed",
              "geglu", "geglu.packed", "gelu", "squared_relu", "cross_entropy", "rope", "attention", "adamw",
              "clip_grad_norm")
RULE_OP = {"adamw": "adam"}   # a benchmark op -> the dispatcher op its rules are for (AdamW is timed; the op is adam)
STEP_OPS = ("adamw", "clip_grad_norm")   # timed as one optimizer "step": their rules hold for any call (pass null)
PASS_ORDER = {"fwd": 0, "fwd+bwd": 1}
RULE_PASSES = ("fwd", "fwd+bwd")   # what the dispatcher distinguishes: inference forward, training step
STEP_RULE_OPS = tuple(RULE_OP.get(op, op) for op in STEP_OPS)   # the rule ops whose rules are of pass null
RULE_FIELDS = ("op", "dtype", "pass", "max_cols", "impl")   # a rule's fields, in the order written


def _rule_pass(m: Measurement) -> tuple[bool, str | None]:
    """(whether ``m``'s pass gives rules, the rules' pass): ``fwd`` and ``fwd+bwd`` as timed; an optimizer's
    ``step`` gives rules for any call (None)."""
    if m.op in STEP_OPS:
        return m.pas == "step", None
    return m.pas in RULE_PASSES, m.pas


# a dispatchable impl's row of one of these statuses lacks a result the sweep could have had: its group is incomplete
INCOMPLETE = ("skipped",)
# a dispatchable impl's row of one of these statuses rules it out: no contender at that size, and the earlier rules
# naming it in its group go (an error, a crash or OOM, made its group incomplete, so a crashing kernel kept its rules
# where a wrong one lost them: a review)
RULED_OUT = ("FAILED", "error")


def _tunable(m: Measurement) -> str | None:
    """The dispatcher impl ``m`` timed: ``m.tunable``; for an op row skipped for the time budget before its size was
    set up, which runs before this fix wrote without one, the impl's own name where it is a dispatcher impl."""
    if m.tunable or m.status != "skipped" or m.op in STEP_OPS:
        return m.tunable
    from .ops import TUNABLE

    return m.impl if m.impl in TUNABLE else None


# a tie goes to the impl the dispatcher's built-in order takes first: ours, PyTorch's fused kernels, the ported
# copies, torch (pipegoose/nn/fusion/dispatch.py); then attention's. It went to whichever row came first: a review
TIE_ORDER = ("pipegoose", "torch_fused", "megatron", "apex", "deepspeed", "torch", "sdpa", "eager")


def _tie_rank(impl: str) -> int:
    return TIE_ORDER.index(impl) if impl in TIE_ORDER else len(TIE_ORDER)


def _timed(m: Measurement) -> bool:
    """An ``ok`` row with a time that can be compared: a NaN would win every comparison it comes first in, a zero or
    negative time every one."""
    t = m.median_ms
    return isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0


def _sweep(measurements: Iterable[Measurement]) -> tuple[dict[tuple, dict[int, tuple[float, str]]], dict[tuple, list]]:
    """(fastest (time, impl) per group and size, the rows without a result per group): groups keyed (benchmark op,
    dtype, rule pass)."""
    best: dict[tuple, dict[int, tuple[float, str]]] = defaultdict(dict)
    missing: dict[tuple, list[Measurement]] = defaultdict(list)
    for m in measurements:
        if m.op not in TUNING_OPS:
            continue
        gives, pas = _rule_pass(m)
        tunable = _tunable(m)
        if not gives or not tunable:
            continue
        key = (m.op, m.dtype, pas)
        if m.status in INCOMPLETE or (m.status == "ok" and not _timed(m)):
            missing[key].append(m)
            continue
        if m.status != "ok":
            continue
        if isinstance(m.cols, bool) or not isinstance(m.cols, int) or m.cols < 1:
            raise ValueError(f"{m.op} {m.impl} {m.dtype} {m.pas}: cols: expected a size >= 1, got {m.cols!r}")
        cur = best[key].get(m.cols)
        if cur is None or (m.median_ms, _tie_rank(tunable)) < (cur[0], _tie_rank(cur[1])):
            best[key][m.cols] = (m.median_ms, tunable)
    return best, missing


def incomplete_groups(measurements: Iterable[Measurement]) -> dict[tuple, str]:
    """The groups whose sweep is incomplete (see the module docstring), as the rules key them (op as the dispatcher
    names it, dtype, pass), with why: the rows of dispatchable impls without a result (the first three, and how many
    more)."""
    out: dict[tuple, str] = {}
    for (op, dtype, pas), rows in _sweep(measurements)[1].items():
        said = [f"{m.impl} {m.pas} at {m.cols}: " + (f"{m.status} ({m.detail})" if m.detail else m.status)
                if m.status != "ok" else f"{m.impl} {m.pas} at {m.cols}: no time ({m.median_ms!r})" for m in rows[:3]]
        more = f" and {len(rows) - 3} more" if len(rows) > 3 else ""
        out[(RULE_OP.get(op, op), dtype, pas)] = "; ".join(said) + more
    return out


def kept_lines(incomplete: dict[tuple, str]) -> list[str]:
    """One line per incomplete group: its earlier rules are kept, and why."""
    return [f"tuning table: {op} {dtype} {pas or 'any pass'}: earlier rules kept (the sweep is incomplete, no rules "
            f"from it: {why})" for (op, dtype, pas), why in incomplete.items()]


def tuning_rules(measurements: Iterable[Measurement]) -> list[dict]:
    """Rules (dicts with op, dtype, pass, max_cols, impl; the documented schema, nothing more) from measurements,
    for the complete groups only (see the module docstring; :func:`incomplete_groups` names the others).
    An optimizer's rules are for the dispatcher's op (``adamw`` -> ``adam``), with pass null and ``max_cols`` bounding
    the parameter count of a bucket."""
    best, missing = _sweep(measurements)
    rules: list[dict] = []
    for (op, dtype, pas) in sorted(best, key=lambda k: (TUNING_OPS.index(k[0]), k[1], PASS_ORDER.get(k[2], 9))):
        if (op, dtype, pas) in missing:
            continue
        sizes = sorted(best[(op, dtype, pas)])
        buckets: list[list[int]] = []
        for c in sizes:
            if buckets and best[(op, dtype, pas)][buckets[-1][-1]][1] == best[(op, dtype, pas)][c][1]:
                buckets[-1].append(c)
            else:
                buckets.append([c])
        for i, bucket in enumerate(buckets):
            impl = best[(op, dtype, pas)][bucket[0]][1]
            rules.append({"op": RULE_OP.get(op, op), "dtype": dtype, "pass": pas,
                          "max_cols": None if i == len(buckets) - 1 else bucket[-1], "impl": impl})
    return rules


def table_inputs(measurements: Iterable[Measurement]) -> tuple[list[dict], set[tuple]]:
    """What a run changes in a tuning table: its rules (:func:`tuning_rules`) and the dispatchable impls that FAILED
    or errored (:data:`RULED_OUT`), as (op, dtype, pass, impl). Both empty: the run changes nothing (the table is not
    written)."""
    measurements = list(measurements)
    failed = {(RULE_OP.get(m.op, m.op), m.dtype, _rule_pass(m)[1], m.tunable) for m in measurements
              if m.status in RULED_OUT and m.tunable and m.op in TUNING_OPS and _rule_pass(m)[0]}
    return tuning_rules(measurements), failed


def read_rules(path: str | Path) -> list[dict]:
    """The rules of the tuning table at ``path`` ([] where there is none). Raises ValueError naming the file where it is
    not a table (not UTF-8 JSON, not an object with a list of rule objects): a run would otherwise replace it and drop
    its rules without a word, or crash after its results were written (a walkthrough); and where the dispatcher would
    refuse it (:meth:`pipegoose.nn.fusion.dispatch.TuningTable.parse`: a rule's dtype ``bf16``, an unknown field, op
    or impl): its rules would be written back, and the dispatcher ignore the whole table (a review)."""
    p = Path(path)
    if not p.exists():
        return []
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{p}: not a tuning table ({type(e).__name__}: {e}): mend or remove it") from None
    rules = data.get("rules") if isinstance(data, dict) else None
    if not isinstance(rules, list) or not all(isinstance(r, dict) for r in rules):
        raise ValueError(f"{p}: not a tuning table (expected an object whose 'rules' is a list of objects): mend or "
                         "remove it")
    from pipegoose.nn.fusion.dispatch import TuningTable, TuningTableError

    try:
        TuningTable.parse(data, str(p))
    except TuningTableError as e:
        where = str(e).removeprefix(f"{p}: ")
        raise ValueError(f"{p}: not a tuning table the dispatcher reads ({where}): mend or remove it") from None
    return rules


def write_tuning_table(device_name: str, measured: str, benchmark: str, measurements: Iterable[Measurement],
                       out_dir: str | Path | None = None, log: Callable[[str], None] | None = print) -> Path:
    """Write ``<out_dir>/<slug(device_name)>.json`` (default dir: ``pipegoose/nn/fusion/tuning``) atomically.

    Rules of the (op, dtype, pass) groups timed now replace that device's earlier rules for those groups; the rules of
    other groups (an earlier ``attention`` run, a dtype or pass this run did not time, a group whose sweep is
    incomplete: :func:`incomplete_groups`, each said through ``log``) are kept, less those naming an impl that FAILED or
    errored (crashed, ran out of memory) in their group now. (Keyed by op alone, a merge of one dtype's sweep dropped
    the op's rules for the other dtypes: a walkthrough.) An older rule without a pass (of an op whose rules have one: it
    covers both passes) goes with the new rules of its op and dtype, except for a pass whose group is incomplete: for
    that pass it is kept, written as a rule of that pass (kept without one, it shadowed the new rules of the other pass:
    the dispatcher reads a rule without a pass for both passes, in table order; a review).
    ``measured``: date ``YYYY-MM-DD``; ``benchmark``: the repository-relative path of the results.json the rules come
    from. Returns the path written. Raises ValueError on an empty device name (see :func:`benchmarks.common.slug`) and
    where the file there is not a tuning table (:func:`read_rules`)."""
    measurements = list(measurements)
    rules, failed = table_inputs(measurements)
    out = Path(out_dir) if out_dir is not None else DEFAULT_TUNING_DIR
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{slug(device_name)}.json"
    incomplete = incomplete_groups(measurements)
    new_groups = {(r["op"], r["dtype"], r["pass"]) for r in rules}
    new_op_dtypes = {(op, dt) for op, dt, _ in new_groups}

    def stays(op: str, dt: str, p: str | None, impl: str, passless: bool) -> bool:
        """Whether an earlier rule of ``impl`` stays for the group (op, dt, p); ``passless``: a rule without a pass
        of an op whose rules have one (it covers both passes), asked per pass."""
        # an impl that gave a wrong result or crashed now loses its rules, though no impl of the group passed or the
        # group is incomplete (reviews: the old rule, naming the impl that is now wrong, stayed; one naming an impl
        # that now crashes stayed, its group being incomplete)
        if (op, dt, p, impl) in failed:
            return False
        if (op, dt, p) in incomplete:
            return True
        # replaced: a rule without a pass, from an older table, goes with the new rules of its op and dtype
        return (op, dt) not in new_op_dtypes if passless else (op, dt, p) not in new_groups

    kept: list[dict] = []
    for r in read_rules(path):
        op, dt, ps, impl = r.get("op"), r.get("dtype"), r.get("pass"), r.get("impl")
        if ps is not None or op in STEP_RULE_OPS:
            if stays(op, dt, ps, impl, False):
                kept.append(r)
            continue
        passes = [p for p in RULE_PASSES if stays(op, dt, p, impl, True)]
        if len(passes) == len(RULE_PASSES):
            kept.append(r)
        else:
            # kept for some passes only (one incomplete, the other replaced): written as a rule of each, for the
            # dispatcher reads a rule without a pass for both, in table order, so it shadowed the new rules of the
            # other pass (a review: training calls still took the old impl)
            kept += [{k: (p if k == "pass" else r.get(k)) for k in RULE_FIELDS} for p in passes]

    table = {"device": device_name, "measured": measured, "benchmark": benchmark, "rules": kept + rules}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=out)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if log is not None:
        for line in kept_lines(incomplete):
            log(line)
    return path
