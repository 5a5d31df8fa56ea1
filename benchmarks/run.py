"""``python -m benchmarks.run``: build, check, time and report pipegoose's fused ops against the alternatives.

    python -m benchmarks.run --quick --out benchmarks/results           op + optimizer benchmarks, ~3-4 min on H200
    python -m benchmarks.run --out benchmarks/results                   the full size sweep (< ~8 min)
    python -m benchmarks.run --only softmax.causal,layer_norm --dtypes bf16
    python -m benchmarks.run --no-ops --e2e                             end-to-end training steps (< ~6 min)
    python -m benchmarks.run --no-ops --e2e --e2e-models qwen3 --e2e-variants sdpa,fuse_sdpa   the Qwen3 step
    python -m benchmarks.run --no-ops --e2e --e2e-models phi3 --e2e-variants sdpa,fuse_sdpa,liger   the Phi-3 step
    python -m benchmarks.run --no-ops --e2e --e2e-models gemma --e2e-variants sdpa,fuse_sdpa,liger  the Gemma step
    python -m benchmarks.run --no-ops --e2e --e2e-models qwen3_moe --e2e-variants sdpa,fuse_sdpa,liger   a MoE step
    python -m benchmarks.run --no-ops --e2e --e2e-models gemma4_moe --e2e-variants sdpa,fuse_sdpa   a GELU MoE step
    python -m benchmarks.run --only swiglu,geglu --dtypes bf16                 the two gated activations, side by side
    python -m benchmarks.run --no-ops --build-cost --specialise         cold build / warm load / specialised builds
    python -m benchmarks.run --device cpu --dry-run --out /tmp/bench    the whole pipeline on tiny CPU inputs
    python -m benchmarks.run --report-only DIR [DIR ...] --out OUT      merge results.json files, redo md/plots/table

Writes ``<out>/<gpu slug>_<YYYY-MM-DD>/``: results.json (every measurement + environment), results.md, PNG plots,
and the tuning table ``pipegoose/nn/fusion/tuning/<slug>.json`` (``--tuning-dir`` to write it elsewhere; CPU dry
runs write it inside the run folder). Files are rewritten after each stage, so a run cut short keeps what it did.
Method and byte counts: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from pipegoose._cli import path_arg

from .common import NO_RESULT, REPO_ROOT, Measurement, environment, slug, today, tolerances
from .report import RUN_KEYS
from .tuning import DEFAULT_TUNING_DIR

OP_NAMES = ("softmax", "softmax.masked", "softmax.causal", "layer_norm", "rms_norm", "swiglu", "swiglu.packed", "geglu",
            "geglu.packed", "gelu", "squared_relu", "cross_entropy", "rope", "adamw", "clip_grad_norm")
GROUPS = {"softmaxes": ["softmax", "softmax.masked", "softmax.causal"], "norms": ["layer_norm", "rms_norm"],
          "optim": ["adamw", "clip_grad_norm"]}
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "half": "float16",
          "fp32": "float32", "float32": "float32"}


def _csv(s: str | None) -> list[str]:
    return [x.strip() for x in (s or "").split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=path_arg, default=str(REPO_ROOT / "benchmarks" / "results"),
                    help="results root folder")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    ap.add_argument("--only", default="", help=f"ops, comma separated: {', '.join(OP_NAMES)} or groups "
                                                f"{', '.join(GROUPS)}")
    ap.add_argument("--impls", default="", help="impl names to run (default all); implies --no-tuning")
    ap.add_argument("--dtypes", default="bf16,fp16,fp32")
    ap.add_argument("--sizes", default="", help="last-dim sizes to keep of the mode's list, comma separated, each "
                                                "one a size of every op run (default all; e.g. --only softmaxes "
                                                "--sizes 128,256); implies --no-tuning")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes, few reps: check the pipeline, not speed")
    ap.add_argument("--no-ops", action="store_true", help="skip the op and optimizer benchmarks")
    ap.add_argument("--no-build", action="store_true", help="do not run `python -m pipegoose.kernels build` first")
    ap.add_argument("--jobs", type=int, default=16, help="kernels built in parallel")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile impl")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="time budget of the op + optimizer benchmarks (default 200 quick, 420 full)")
    ap.add_argument("--e2e", action="store_true", help="end-to-end training steps (subprocess per config)")
    ap.add_argument("--e2e-models", default="llama,neox", help="comma separated: llama, neox, qwen3, phi3, gemma, "
                                                                 "qwen3_moe, gemma4_moe, olmo, cohere, glm4, gpt2, "
                                                                 "phi, modernbert_decoder, arcee, nemotron, bloom, "
                                                                 "bloom_1b7, mpt, opt, bert_mlm, distilbert_mlm, "
                                                                 "gptj, qwen3_next, granite4 (default llama,neox)")
    ap.add_argument("--e2e-variants", default="",
                    help="default: all but fuse_sdpa_gated (sdpa, eager, fuse_sdpa, fuse_eager, fuse_sdpa_adam, "
                         "fuse_sdpa_lce, fuse_sdpa_model_rope, compile_sdpa, liger_rmsnorm, liger)")
    ap.add_argument("--e2e-batch", default="", help="e.g. llama=4,neox=8,qwen3=4,phi3=4,gemma=4")
    ap.add_argument("--e2e-budget-s", type=float, default=330.0)
    ap.add_argument("--build-cost", action="store_true", help="cold build of all kernels (-j --jobs), warm load")
    ap.add_argument("--specialise", action="store_true", help="specialised vs generic builds (if a switch exists)")
    ap.add_argument("--specialise-define", action="append", default=[], metavar="KERNEL:FLAG",
                    help="a -D flag for a kernel's specialised build (default: its #ifdef PIPEGOOSE_* switches)")
    ap.add_argument("--tuning-dir", type=path_arg, default=None, help="where the tuning table goes "
                                                       "(default pipegoose/nn/fusion/tuning)")
    ap.add_argument("--no-tuning", action="store_true", help="do not write the tuning table")
    ap.add_argument("--overwrite", action="store_true", help="replace the results of an earlier run of the day in "
                                                             "the same --out folder (refused without it)")
    ap.add_argument("--report-only", nargs="+", default=None, metavar="DIR",
                    help="merge these run folders' results.json (the newer run wins) and rewrite the reports")
    a = ap.parse_args(argv)
    if a.no_tuning and a.tuning_dir:
        ap.error("--tuning-dir: not with --no-tuning, which writes no tuning table")
    # (NotADirectoryError at the first write: a walkthrough; for a path under a file, a review)
    for opt, folder in (("--out", a.out), ("--tuning-dir", a.tuning_dir)):
        on_disk = next((q for q in (Path(folder), *Path(folder).parents) if q.exists()), None) if folder else None
        if on_disk is not None and not on_disk.is_dir():
            ap.error(f"{opt}: expected a folder, got the file {folder}" if on_disk == Path(folder)
                     else f"{opt}: expected a folder, got {folder}, under the file {on_disk}")
    if a.report_only:
        # A merge reads results and writes reports; the options of a run were accepted and ignored (a walkthrough).
        ignored = [f"--{k.replace('_', '-')}" for k in ("quick", "only", "impls", "dtypes", "dry_run", "no_ops",
                                                        "no_build", "jobs", "no_compile", "budget_s", "e2e",
                                                        "build_cost", "specialise", "specialise_define", "device")
                   if getattr(a, k) != ap.get_default(k)]
        if ignored:
            ap.error(f"{', '.join(ignored)}: not with --report-only, which merges results and writes the reports "
                     "(only --out, --tuning-dir, --no-tuning and --overwrite go with it; the merged runs name their "
                     "device)")
    if a.no_ops and not a.report_only:
        # The op benchmarks' options with --no-ops were ignored without a word, as the end-to-end options were
        # without --e2e (a review). (--quick, --dry-run and --device also shape the other stages, --jobs the
        # --build-cost build; --no-build's build is the op benchmarks' alone: there is nothing it could change.)
        ignored = [f"--{k.replace('_', '-')}" for k in ("only", "impls", "dtypes", "sizes", "budget_s", "no_compile")
                   if getattr(a, k) != ap.get_default(k)]
        if ignored:
            ap.error(f"{', '.join(ignored)}: not with --no-ops, which skips the op and optimizer benchmarks")
    ops: list[str] = []
    if a.only.strip() and not _csv(a.only):
        ap.error(f"--only: expected op names, comma separated, got {a.only!r}")
    for o in _csv(a.only) or list(OP_NAMES):
        if o in GROUPS:
            ops += GROUPS[o]
        elif o in OP_NAMES:
            ops.append(o)
        else:
            ap.error(f"--only: unknown op {o!r}; expected {', '.join(OP_NAMES)} or {', '.join(GROUPS)}")
    a.ops = list(dict.fromkeys(ops))
    bad = [d for d in _csv(a.dtypes) if d not in DTYPES]
    if bad:
        ap.error(f"--dtypes: unknown {bad}; expected some of bf16, fp16, fp32")
    a.dtype_names = list(dict.fromkeys(DTYPES[d] for d in _csv(a.dtypes)))
    if not a.dtype_names and not a.report_only:
        ap.error(f"--dtypes: expected some of bf16, fp16, fp32, got {a.dtypes!r}")
    if _csv(a.impls):
        from .ops import IMPL_ORDER
        from .optimizers import ADAMW, CLIP

        known = list(dict.fromkeys([*IMPL_ORDER, *ADAMW, *CLIP]))
        unknown = [i for i in _csv(a.impls) if i not in known]
        if unknown:
            ap.error(f"--impls: unknown {unknown}; expected some of {', '.join(known)}")
        # an impl that none of the ops run has measured nothing, without a word (a review: --only softmax --impls
        # torch_fused wrote a run of 0 measurements)
        from .ops import OPS, impls_for

        have = {i for o in a.ops for i in (impls_for(o) if o in OPS else ADAMW if o == "adamw" else CLIP)}
        absent = [i for i in _csv(a.impls) if i not in have]
        if absent:
            ap.error(f"--impls: {absent} implement none of the ops run ({', '.join(a.ops)}); expected some of "
                     f"{', '.join(i for i in known if i in have)}")
        # Some impls alone must not rewrite the tuning table either: its rules come from a comparison of every
        # dispatchable impl, and a run of one made it the winner of every size (a review: --impls torch_foreach
        # replaced the faster torch_fused's adam rule with torch's). Merge the run with --report-only instead.
        if a.tuning_dir:
            ap.error("--impls: a run of some impls does not write a tuning table; merge it with --report-only "
                     "instead (drop --tuning-dir)")
        a.no_tuning = True
    if a.budget_s is not None and not a.budget_s > 0:
        ap.error(f"--budget-s: expected a number of seconds > 0, got {a.budget_s}")
    # (nan passed, and min(limit, nan) in run_e2e is the limit: nan took the stage's bound away; a review)
    if not a.e2e_budget_s > 0:
        ap.error(f"--e2e-budget-s: expected a number of seconds > 0, got {a.e2e_budget_s}")
    if a.jobs < 1:
        ap.error(f"--jobs: expected an integer >= 1, got {a.jobs}")
    if a.device == "cpu" and not a.dry_run and not a.report_only:
        ap.error("--device cpu: only with --dry-run (CPU timings say nothing about the GPU kernels)")
    a.mode = "dry" if a.dry_run else ("quick" if a.quick else "full")
    try:
        a.size_filter = list(dict.fromkeys(int(v) for v in _csv(a.sizes))) or None
    except ValueError:
        ap.error(f"--sizes: expected comma-separated integers, got {a.sizes!r}")
    if a.sizes.strip() and not a.size_filter:
        ap.error(f"--sizes: expected comma-separated integers, got {a.sizes!r}")
    if a.size_filter:
        from .ops import OPS, sizes_for

        if a.report_only:
            ap.error("--sizes: only for the op benchmarks (not with --report-only)")
        sized = [o for o in a.ops if o in OPS]
        if not sized or len(sized) != len(a.ops):
            ap.error(f"--sizes: every op run must be a sized op ({', '.join(OPS)}); got {', '.join(a.ops)} "
                     "(the optimizers have no sizes: run them without --sizes)")
        for o in sized:
            kept = [c for c in a.size_filter if c in sizes_for(o, a.mode)]
            if len(kept) != len(a.size_filter):
                ap.error(f"--sizes: {[c for c in a.size_filter if c not in kept]} not among the {a.mode} sizes of "
                         f"{o} ({sizes_for(o, a.mode)})")
        # A sweep of some sizes must not rewrite the tuning table, whose rules for an op come from all its sizes
        # (merge the run into the full results with --report-only and derive the table from that).
        if a.tuning_dir:
            ap.error("--sizes: a partial sweep does not write a tuning table; merge it with --report-only instead "
                     "(drop --tuning-dir)")
        a.no_tuning = True
    from .e2e import MODELS as E2E_MODELS, VARIANTS as E2E_VARIANTS

    # The end-to-end options without --e2e were ignored without a word (session 33's walkthrough).
    given = [o for o, v, d in (("--e2e-models", a.e2e_models, "llama,neox"), ("--e2e-variants", a.e2e_variants, ""),
                               ("--e2e-batch", a.e2e_batch, ""), ("--e2e-budget-s", a.e2e_budget_s, 330.0)) if v != d]
    if given and not a.e2e:
        ap.error(f"{', '.join(given)}: only with --e2e (the end-to-end steps)")
    e2e_models = _csv(a.e2e_models)
    bad = [m for m in e2e_models if m not in E2E_MODELS]
    if bad or not e2e_models:
        ap.error(f"--e2e-models: unknown {bad}; expected some of {', '.join(E2E_MODELS)}")
    bad = [v for v in _csv(a.e2e_variants) if v not in E2E_VARIANTS]
    if bad:
        ap.error(f"--e2e-variants: unknown {bad}; expected some of {', '.join(E2E_VARIANTS)}")
    a.batch = {}
    for kv in _csv(a.e2e_batch):
        k, _, v = kv.partition("=")
        if k not in E2E_MODELS or not v.isdigit() or int(v) < 1:
            ap.error(f"--e2e-batch: expected MODEL=N with MODEL one of {', '.join(E2E_MODELS)} and N >= 1, "
                     f"got {kv!r}")
        a.batch[k] = int(v)
    a.defines = {}
    if a.specialise_define and not a.specialise:
        ap.error("--specialise-define: only with --specialise")
    from .build_cost import SPECIALISE_KERNELS, check_defines

    for kd in a.specialise_define:
        k, _, flag = kd.partition(":")
        if not flag.startswith("-D"):
            ap.error(f"--specialise-define: expected KERNEL:-DNAME[=VALUE], got {kd!r}")
        if k not in SPECIALISE_KERNELS:
            ap.error(f"--specialise-define: {kd!r}: expected a kernel among {', '.join(SPECIALISE_KERNELS)}")
        try:
            check_defines([k], [flag])
        except ValueError as e:
            ap.error(f"--specialise-define: {e}")
        a.defines.setdefault(k, []).append(flag)
    return a


def _log(msg: str) -> None:
    print(msg, flush=True)


def build_kernels(jobs: int) -> dict:
    """``python -m pipegoose.kernels build --all -j jobs`` in a child process (each kernel builds in its own
    process; a failed kernel only makes its impls ``unavailable``)."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "pipegoose.kernels", "build", "--all", "-j", str(jobs)],
                       capture_output=True, text=True, cwd=REPO_ROOT, env={**os.environ, "COLUMNS": "200"})
    tail = [ln for ln in p.stdout.splitlines() if any(s in ln for s in ("built", "cached", "FAILED", "unavailable"))]
    return {"exit_code": p.returncode, "wall_s": round(time.perf_counter() - t0, 1), "lines": tail[-20:],
            "stderr_tail": p.stderr.strip().splitlines()[-5:] if p.returncode else []}


def copy_bandwidth(device: str, timer) -> dict:
    """Device-to-device copy of a 1 GiB tensor (16 MiB on CPU): bytes read + written / median time."""
    import torch

    n = (1 << 30) // 4 if device == "cuda" else 1 << 22
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    t = timer.time(lambda _: dst.copy_(src))
    nbytes = 2 * n * 4
    return {"bytes": nbytes, "gbps": nbytes / (t["median_ms"] * 1e-3) / 1e9, **t}


class Run:
    """One invocation's results, rewritten to disk after each stage."""

    def __init__(self, args: argparse.Namespace, env: dict):
        self.args, self.env = args, env
        self.measurements: list[Measurement] = []
        self.sections: dict = {"copy": None, "e2e": None, "build_cost": None, "specialise": None, "build": None}
        self.runs: list[dict] | None = None   # a merge's runs (report.run_entry), oldest first
        name = slug(env["gpu"]) if args.device == "cuda" else "cpu_dry_run"
        self.dir = Path(args.out) / f"{name}_{today()}"
        self.config = {"command": "python -m benchmarks.run " + " ".join(sys.argv[1:]), "mode": args.mode,
                       "ops": args.ops, "dtypes": args.dtype_names, "device": args.device,
                       "sizes": args.size_filter}

    def write(self) -> None:
        from .report import fill_pct, write_json, write_markdown

        copy = self.sections.get("copy")
        fill_pct(self.measurements, copy["gbps"] if copy else None)
        write_json(self.dir / "results.json", self.env, self.config, copy, self.measurements,
                   {**{k: v for k, v in self.sections.items() if k != "copy"},
                    **({"runs": self.runs} if self.runs else {})})
        write_markdown(self.dir / "results.md", self.env, self.config, copy, self.measurements,
                       self.sections.get("e2e"), self.sections.get("build_cost"), self.sections.get("specialise"),
                       self.runs)

    def tuning_dir(self) -> Path:
        """Where this run's tuning table goes: ``--tuning-dir``; else the repository's table for results the
        repository holds (its "benchmark" field names them); results written elsewhere (and CPU dry runs) get their
        table beside them."""
        if self.args.tuning_dir:
            return Path(self.args.tuning_dir)
        in_repo = (self.dir / "results.json").resolve().is_relative_to(REPO_ROOT.resolve())
        return self.dir / "tuning" if self.args.device == "cpu" or not in_repo else DEFAULT_TUNING_DIR

    def finish(self) -> None:
        from .plots import plot_all
        from .report import summary_lines
        from .tuning import incomplete_groups, kept_lines, table_inputs, write_tuning_table

        self.complete = False
        self.write()
        copy = self.sections.get("copy")
        try:
            plots = plot_all(self.measurements, self.dir, copy["gbps"] if copy else None, self.env.get("gpu", ""))
            _log(f"plots: {len(plots)} PNG in {self.dir}")
        except ImportError as e:
            _log(f"plots: skipped ({e}); pip install matplotlib")
        a = self.args
        # (gated on a rule or a FAILED or errored impl: a run whose every dispatchable impl FAILED or crashed must still
        # drop their rules)
        if not a.no_tuning and any(table_inputs(self.measurements)):
            results = (self.dir / "results.json").resolve()
            in_repo = results.is_relative_to(REPO_ROOT.resolve())
            tdir = self.tuning_dir()
            gpu = self.env["gpu"]
            path = write_tuning_table(gpu, self.env.get("date", today())[:10],
                                      str(results.relative_to(REPO_ROOT.resolve())) if in_repo else str(results),
                                      self.measurements, tdir, log=_log)
            self.complete = True   # (written: a broken pipe in the line below must not remove the merge)
            _log(f"tuning table: {path}" + ("" if in_repo or a.tuning_dir else " (the results are outside the "
                                            "repository: its table is not changed; --tuning-dir "
                                            "pipegoose/nn/fusion/tuning writes it)"))
        elif not a.no_tuning:
            for line in kept_lines(incomplete_groups(self.measurements)):   # (the table is not written: said why)
                _log(line)
        self.complete = True   # (everything is written: what follows only prints)
        _log(f"results: {self.dir / 'results.json'}, {self.dir / 'results.md'}")
        _log("=" * 100)
        for line in summary_lines(self.measurements, copy, self.sections.get("e2e")):
            _log(line)


_E2E_NO_RESULT = ("skipped", "unavailable", "timeout", "error")
_E2E_NUMBERS = ("tokens_per_s", "step_ms", "peak_mem_gib", "params", "batch", "seq", "steps", "setup_s", "warmup_s")


def _run_time(date) -> datetime | None:
    """A run's ``environment.date`` (ISO 8601) as a datetime in UTC (one without an offset is taken as UTC), or None
    where it is missing or not a date. (Compared as text, 2026-12-03T01:00+05:00 came after 2026-12-02T23:00+00:00,
    which is later: a review.)"""
    text = str(date)
    try:   # ("Z" for UTC: Python 3.10's fromisoformat does not read it; OverflowError: year 1 at +05:00, say)
        t = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)
        return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).astimezone(timezone.utc)
    except (ValueError, OverflowError):
        return None


def _check_e2e_rows(rows: list) -> None:
    """Raises ValueError naming the row and field of an end-to-end row that the reports cannot show (a walkthrough:
    such rows gave tracebacks, some after results.json was written): each a mapping with a model and a variant
    (strings), a status of benchmarks.e2e.STATUSES, numbers or nothing for the measured fields, a string or nothing
    for the detail."""
    from .e2e import STATUSES

    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise ValueError(f"e2e[{i}]: expected a mapping, got {r!r}")
        for k in ("model", "variant"):
            if not isinstance(r.get(k), str) or not r[k]:
                raise ValueError(f"e2e[{i}]: {k}: expected a name, got {r.get(k)!r}")
        if r.get("status") not in STATUSES:
            raise ValueError(f"e2e[{i}] ({r['model']} {r['variant']}): status: expected one of {', '.join(STATUSES)}, "
                             f"got {r.get('status')!r}")
        for k in _E2E_NUMBERS:
            v = r.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ValueError(f"e2e[{i}] ({r['model']} {r['variant']}): {k}: expected a number, got {v!r}")
        if r.get("detail") is not None and not isinstance(r["detail"], str):
            raise ValueError(f"e2e[{i}] ({r['model']} {r['variant']}): detail: expected text, got {r['detail']!r}")
        if r["status"] == "ok" and not _number(r.get("tokens_per_s")):
            raise ValueError(f"e2e[{i}] ({r['model']} {r['variant']}): tokens_per_s: expected a number for a row "
                             f"that is ok, got {r.get('tokens_per_s')!r}")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_ROW_NUMBERS = ("bytes", "median_ms", "p20_ms", "p80_ms", "reps", "gbps", "pct_of_copy", "max_abs_err")


def _check_run(data: dict, measurements: list[Measurement]) -> None:
    """Raises ValueError naming the field of a results.json that the merge and the reports cannot take, before anything
    is written (a walkthrough: a null date, a copy without its bytes, an ok row without its GB/s, a size that is
    text gave tracebacks, most after results.json was written): the environment's GPU and date (ISO 8601), the copy
    figures, the config, each row's names, size, numbers and extra fields, the end-to-end rows."""
    env = data.get("environment")
    if not isinstance(env, dict) or not isinstance(env.get("gpu"), str) or not env["gpu"]:
        raise ValueError("expected a results.json of benchmarks.run (environment with gpu)")
    if not isinstance(env.get("date"), str) or _run_time(env["date"]) is None:
        raise ValueError(f"environment.date: expected an ISO 8601 date and time, got {env.get('date')!r}")
    copy = data.get("copy")
    if copy is not None and not (isinstance(copy, dict) and all(_number(copy.get(k)) for k in
                                                                ("gbps", "bytes", "median_ms"))):
        raise ValueError(f"copy: expected a mapping with the numbers gbps, bytes and median_ms, got {copy!r}")
    if not isinstance(data.get("config") or {}, dict):
        raise ValueError(f"config: expected a mapping, got {data['config']!r}")
    if not isinstance(data.get("runs") or [], list):
        raise ValueError(f"runs: expected a list of the merged runs, got {data['runs']!r}")
    for i, r in enumerate(data.get("runs") or []):
        if not isinstance(r, dict) or not isinstance(r.get("date"), str) or _run_time(r["date"]) is None:
            raise ValueError(f"runs[{i}]: expected a mapping with an ISO 8601 date, got {r!r}")
    for i, m in enumerate(measurements):
        where = f"measurements[{i}]"
        for k in ("op", "impl", "dtype", "pas"):
            if not isinstance(getattr(m, k), str) or not getattr(m, k):
                raise ValueError(f"{where}: {'pass' if k == 'pas' else k}: expected a name, got {getattr(m, k)!r}")
        where += f" ({m.op} {m.impl} {m.dtype} {m.pas})"
        if isinstance(m.cols, bool) or not isinstance(m.cols, int) or m.cols < 1:
            raise ValueError(f"{where}: cols: expected a size >= 1, got {m.cols!r}")
        for k in _ROW_NUMBERS:
            v = getattr(m, k)
            if v is not None and not _number(v):
                raise ValueError(f"{where}: {k}: expected a number, got {v!r}")
        if m.status == "ok" and not (_number(m.median_ms) and _number(m.gbps)):
            raise ValueError(f"{where}: a row that is ok needs its median_ms and gbps, got {m.median_ms!r} and "
                             f"{m.gbps!r}")
        for k in ("shape", "extra"):
            if not isinstance(getattr(m, k) or {}, dict):
                raise ValueError(f"{where}: {k}: expected a mapping, got {getattr(m, k)!r}")
        extra = m.extra or {}
        if extra.get("copy_gbps") is not None and not _number(extra["copy_gbps"]):
            raise ValueError(f"{where}: extra.copy_gbps: expected a number, got {extra['copy_gbps']!r}")
        if extra.get("run") is not None and not isinstance(extra["run"], str):   # (a date or a label: text)
            raise ValueError(f"{where}: extra.run: expected the run's date or label as text, got {extra['run']!r}")
        if m.tunable is not None and not isinstance(m.tunable, str):
            raise ValueError(f"{where}: tunable: expected an impl name or null, got {m.tunable!r}")
    if not isinstance(data.get("e2e") or [], list):
        raise ValueError(f"e2e: expected a list, got {data['e2e']!r}")
    _check_e2e_rows(data.get("e2e") or [])


def _older_row(when: datetime | None, kept_when: datetime | None, no_result: bool, kept_no_result: bool) -> bool:
    """Whether a row measured at ``when`` (its run's date in UTC) is older than the row already merged for its key
    (``kept_when``) and so does not replace it (a review: a merged file sorts by its newest run, so its older rows
    came after a separately given run of a date between, and replaced that run's newer rows). Unknown dates compare as
    nothing (the merge order decides). A measurement of an older run still replaces a newer row that measured nothing
    (as a later one does)."""
    if when is None or kept_when is None:
        return False
    return when < kept_when and not (kept_no_result and not no_result)


def _row_times(data: dict) -> dict:
    """A merged file's run labels (its rows' ``run``: the day) -> that run's date in UTC, from its ``runs`` (of two
    runs of one label, the later); a row whose label is not there takes its file's date (the caller's default)."""
    times: dict = {}
    for r in data.get("runs") or []:
        label, t = r.get("run"), _run_time(r.get("date"))   # (_check_run: a mapping with a date)
        if label is not None and t is not None and (label not in times or t > times[label]):
            times[label] = t
    return times


def report_only(args: argparse.Namespace) -> int:
    from .optimizers import upgrade_row
    from .report import load_json, run_entry
    from .tuning import read_rules

    merged: dict = {}
    runs: dict[tuple, dict] = {}   # every run merged (those of a merged file too), by its date and versions
    ms: dict[tuple, Measurement] = {}
    commands: list[str] = []
    e2e: dict[tuple, dict] = {}
    hidden: list[str] = []  # later rows of a crash or a hang that an earlier measurement outlives, the merge order
    loaded: list[tuple] = []   # (time in UTC, argument index, path, data, measurements) of each run
    gpu = None
    for i, d in enumerate(args.report_only):
        p = Path(d) / "results.json" if Path(d).is_dir() else Path(d)
        try:
            data, measurements = load_json(p)
            _check_run(data, measurements)
            env = data["environment"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise SystemExit(f"--report-only: {p}: {type(e).__name__}: {e}") from None
        if gpu is not None and env["gpu"] != gpu:
            raise SystemExit(f"--report-only: {p} was measured on {env['gpu']}, the runs before it on {gpu}: "
                             "results of different GPUs are not merged")
        gpu = env["gpu"]
        loaded.append((_run_time(env["date"]), i, p, data, measurements))   # (_check_run: a date it reads)
    # Runs merge in order of their dates in UTC, of equal dates in the order given: the newer measurement wins. (Later
    # arguments won, and an older run given last replaced a newer one's rows, with a note: a review. Compared as text,
    # 2026-12-03T01:00+05:00 came after 2026-12-02T23:00+00:00, which is later: an earlier review.)
    loaded.sort(key=lambda r: (r[0], r[1]))
    if [r[1] for r in loaded] != sorted(r[1] for r in loaded):
        hidden.append("the runs were merged in order of their dates in UTC, the newer winning, not as given: "
                      + ", ".join(f"{p} ({when:%Y-%m-%d %H:%M} UTC)" for when, _, p, _, _ in loaded))
    row_time: dict = {}   # (kind, key) -> the UTC date of the run of the row merged for it
    for file_time, _, p, data, measurements in loaded:
        label_times = _row_times(data)
        # each run's date and versions (the merged environment is the newest run's alone; a review)
        for r in data.get("runs") or [run_entry(data["environment"], str(p))]:
            runs.setdefault(tuple(str(r.get(k)) for k in RUN_KEYS), r)
        cmd = (data.get("config") or {}).get("command")
        for c in ([cmd] if isinstance(cmd, str) else cmd or []):
            if c not in commands:
                commands.append(c)
        # Each merged row keeps the date of the run that measured it ("run"; rows merged before keep theirs).
        run_date = str((data.get("environment") or {}).get("date") or "")[:10] or p.parent.name
        for k, v in data.items():
            if k == "e2e" and isinstance(v, list):
                # end-to-end rows merge per (model, variant) like the measurements, the later run winning; a row
                # that measured nothing (skipped, unavailable, timeout, error) keeps the earlier one. FAILED (a loss
                # off the sdpa run's) and oom replace it: they are results of the step. A timeout or an error may
                # also be a hang or a crash of the code under test: the kept row's note and the merge's output say so.
                for row in v:
                    key = (row.get("model"), row.get("variant"))
                    row_run = row.get("run") or run_date
                    when = label_times.get(row.get("run"), file_time)
                    if key in e2e and _older_row(when, row_time.get(("e2e", key)),
                                                 row.get("status") in _E2E_NO_RESULT,
                                                 e2e[key].get("status") in _E2E_NO_RESULT):
                        continue
                    if (row.get("status") not in _E2E_NO_RESULT or key not in e2e
                            or e2e[key].get("status") in _E2E_NO_RESULT):   # (of two attempts, the later)
                        before = e2e.get(key)
                        if (before and before.get("status") in ("timeout", "error")
                                and row.get("status") in ("skipped", "unavailable")):
                            # a later run that did not try says nothing of the hang or crash: say it went
                            hidden.append(f"e2e {key[0]} {key[1]}: the {before.get('run')} row's {before['status']}"
                                          + (f" ({before['detail']})" if before.get("detail") else "")
                                          + f" is replaced by run {row_run}'s {row['status']}")
                        e2e[key] = {**row, "run": row_run}
                        row_time[("e2e", key)] = when
                    elif row.get("status") in ("timeout", "error") and e2e[key].get("status") not in _E2E_NO_RESULT:
                        later = f"run {row_run}: {row['status']}" + (f" ({row['detail']})" if row.get("detail") else "")
                        kept = e2e[key]
                        if later not in (kept.get("detail") or ""):  # (a merge of a merge says it once)
                            kept["detail"] = "; ".join(x for x in (kept.get("detail"), later) if x)
                        hidden.append(f"e2e {key[0]} {key[1]}: {later}; the {kept.get('run')} row is kept")
            elif k not in ("measurements", "runs") and v is not None:
                merged[k] = v
        run_copy = (data.get("copy") or {}).get("gbps")
        for m in measurements:
            # the row's run, and the copy bandwidth its % of copy was computed against: recorded (a row merged
            # since session 38), else what its stored % implies (the file's copy, or for an older merge the copy it
            # used), else the file's copy; so a merge keeps every stored %
            m.extra = {**(m.extra or {}), "run": (m.extra or {}).get("run") or run_date}
            if not m.extra.get("copy_gbps"):
                implied = 100.0 * m.gbps / m.pct_of_copy if m.gbps and m.pct_of_copy else None
                if implied or run_copy:
                    m.extra["copy_gbps"] = implied or run_copy
            upgrade_row(m)   # optimizer rows from before their impls were named (renames an old row, so first)
            key = (m.op, m.impl, m.dtype, m.pas, m.cols)
            when = label_times.get((m.extra or {}).get("run"), file_time)
            if key in ms and _older_row(when, row_time.get(("op", key)), m.status in NO_RESULT,
                                        ms[key].status in NO_RESULT):
                continue
            # a row that measured nothing (skipped; unavailable: the impl did not load or build; error: it crashed or
            # could not be timed) never hides a measured one: it would take the impl out of the tuning table's
            # choices for that size. FAILED (a wrong result) and unsupported (the impl declines the shape) do replace.
            if m.status not in NO_RESULT or key not in ms or ms[key].status in NO_RESULT:
                if key in ms and ms[key].status == "error" and m.status in ("skipped", "unavailable"):
                    was = f" ({ms[key].detail[:120]})" if ms[key].detail else ""
                    hidden.append(f"{m.impl}/{m.op}/{m.dtype}/{m.pas}/{m.cols}: the {ms[key].extra.get('run')} row's "
                                  f"error{was} is replaced by run {m.extra['run']}'s {m.status}")
                ms[key] = m
                row_time[("op", key)] = when
            elif m.status == "error" and ms[key].status not in NO_RESULT:
                hidden.append(f"{m.impl}/{m.op}/{m.dtype}/{m.pas}/{m.cols}: run {m.extra['run']}: error "
                              f"({(m.detail or '')[:120]}); the {ms[key].extra.get('run')} row is kept")
    if e2e:
        merged["e2e"] = list(e2e.values())
    env = merged.get("environment", {})
    args.device = "cuda" if env.get("device") == "cuda" else "cpu"
    run = Run(args, env)
    run.config = dict(merged.get("config", run.config))
    # every run merged here (each measurement keeps the last run that measured it), then this merge
    run.config["command"] = " ; ".join(commands + ["python -m benchmarks.run " + " ".join(sys.argv[1:])])
    run.measurements = list(ms.values())
    run.runs = sorted(runs.values(), key=lambda r: _run_time(r.get("date")))
    for k in run.sections:
        run.sections[k] = merged.get(k)
    if env.get("date"):
        run.dir = Path(args.out) / f"{slug(env['gpu']) if args.device == 'cuda' else 'cpu_dry_run'}_{env['date'][:10]}"
    if (run.dir / "results.json").exists() and not args.overwrite:
        # as a run does: a merge into a folder that holds results replaced them without a word (a walkthrough)
        raise SystemExit(f"--report-only: {run.dir / 'results.json'} exists: pass another --out, or --overwrite to "
                         "replace it (e.g. when that folder is among the merged ones)")
    if not args.no_tuning:   # (a table that is not one crashed the merge after its results were written)
        try:
            read_rules(run.tuning_dir() / f"{slug(env['gpu'])}.json")
        except ValueError as e:
            raise SystemExit(f"--report-only: {e}") from None
    # A merge interrupted (Ctrl-C) or failing halfway left results.json without the rest, which the next merge refused
    # as finished (a walkthrough): a folder this merge made goes again, but only while the merge is incomplete (a
    # broken pipe in the summary, `| head`, once removed a finished merge: a review).
    fresh = not run.dir.exists()
    try:
        run.finish()
    except BaseException as e:
        done = getattr(run, "complete", False)
        if fresh and not done:
            shutil.rmtree(run.dir, ignore_errors=True)
        if isinstance(e, KeyboardInterrupt):
            print("--report-only: interrupted; " + (f"the merge was complete: {run.dir}" if done else
                  f"{run.dir} removed" if fresh else
                  f"{run.dir} may hold part of this merge: run it again with --overwrite"), file=sys.stderr)
            return 130
        raise
    for line in hidden:
        _log(f"note: {line}")
    return 0


def main(argv: list[str] | None = None) -> int:
    # A fallback must raise, never be timed under a fused impl's name. Set here, not at import: importing this module
    # (tests do) must not switch the whole process to strict mode.
    os.environ.setdefault("PIPEGOOSE_STRICT", "1")
    args = parse_args(argv)
    if args.report_only:
        return report_only(args)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible: run on a GPU, or use --device cpu --dry-run", file=sys.stderr)
        return 2
    env = environment(args.device)
    run = Run(args, env)
    if (run.dir / "results.json").exists() and not args.overwrite and not args.dry_run:  # a dry run checks the pipeline
        # a second run of the day into the same --out would replace the first one's results (the reports and plots
        # of ops it does not run would stay, no longer matching them)
        print(f"python -m benchmarks.run: {run.dir / 'results.json'} exists (an earlier run of today): pass another "
              f"--out and merge the two with --report-only, or --overwrite to replace it", file=sys.stderr)
        return 2
    if not args.no_tuning:
        from .tuning import read_rules

        try:   # (before the measurements: a table that is not one would fail the run at its end)
            read_rules(run.tuning_dir() / f"{slug(env['gpu'])}.json")
        except ValueError as e:
            print(f"python -m benchmarks.run: {e}", file=sys.stderr)
            return 2
    _log(f"pipegoose benchmarks: {env['gpu']} | torch {env['torch']} | CUDA {env.get('cuda_runtime')} | "
         f"triton {env.get('triton')} | transformers {env.get('transformers')} | liger {env.get('liger_kernel')}"
         f" | mode {args.mode} -> {run.dir}")
    t_start = time.perf_counter()
    if not args.no_ops:
        from .ops import OPS, run_ops
        from .optimizers import run_optimizers
        from .timing import Timer

        if args.device == "cuda" and not args.no_build:
            _log(f"building kernels (-j {args.jobs}) ...")
            run.sections["build"] = build_kernels(args.jobs)
            _log(f"  build: exit {run.sections['build']['exit_code']} in {run.sections['build']['wall_s']} s")
        warm, reps = {"dry": (1, 3), "quick": (3, 15), "full": (5, 40)}[args.mode]
        timer = Timer(args.device, warmup=warm, reps=reps, max_s=0.5 if args.mode != "full" else 1.5)
        run.sections["copy"] = copy_bandwidth(args.device, timer)
        _log(f"D2D copy: {run.sections['copy']['gbps']:.0f} GB/s")
        budget = args.budget_s or {"dry": 120.0, "quick": 200.0, "full": 420.0}[args.mode]
        deadline = time.perf_counter() + budget
        tol = tolerances()
        dtypes = [getattr(torch, d) for d in args.dtype_names]
        op_list = [o for o in args.ops if o in OPS]
        opt_list = tuple(o for o in args.ops if o in ("adamw", "clip_grad_norm"))
        impl_filter = _csv(args.impls) or None
        no_compile = args.no_compile or args.device == "cpu"
        # the optimizers get a fixed 20% of the budget: they are cheap but must not be starved
        op_deadline = deadline - (0.2 * budget if opt_list else 0.0)
        if op_list:
            run.measurements += run_ops(op_list, dtypes, args.mode, args.device, timer, tol, impl_filter,
                                        op_deadline, log=_log, no_compile=no_compile,
                                        compile_dtypes=[torch.bfloat16] if args.mode == "quick" else None,
                                        sizes=args.size_filter)
            run.write()
        if opt_list:
            opt_dtypes = [d for d in dtypes if d in (torch.float32, torch.bfloat16)]
            run.measurements += run_optimizers(opt_dtypes, args.mode, args.device, timer, tol, impl_filter,
                                               deadline, ops=opt_list, log=_log)
            run.write()
        _log(f"op benchmarks: {time.perf_counter() - t_start:.0f} s")
    if args.e2e:
        from .e2e import DEFAULT_VARIANTS, MODELS, run_e2e

        if args.device != "cuda":
            run.sections["e2e"] = [{"model": m, "variant": "-", "status": "skipped", "detail": "needs CUDA"}
                                   for m in _csv(args.e2e_models)]
        else:
            models = [m for m in _csv(args.e2e_models) if m in MODELS]
            variants = _csv(args.e2e_variants) or list(DEFAULT_VARIANTS)
            run.sections["e2e"] = run_e2e(models, variants, time.perf_counter() + args.e2e_budget_s,
                                          quick=args.quick, batch=args.batch, log=_log)
        run.write()
    if args.build_cost:
        from .build_cost import build_cost

        _log("build cost: cold build of every kernel ...")
        run.sections["build_cost"] = build_cost(args.jobs)
        _log(f"  cold build {run.sections['build_cost'].get('cold_build_s')} s, warm load "
             f"{run.sections['build_cost'].get('warm_load_total_s')} s")
        run.write()
    if args.specialise:
        from .build_cost import specialise

        run.sections["specialise"] = specialise(args.defines or None)
        for k, v in run.sections["specialise"].items():
            _log(f"  specialise {k}: " + (v.get("reason", "") if not v.get("available") else
                                         f"generic {v.get('generic')} | specialised {v.get('specialised')}"))
        run.write()
    run.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
