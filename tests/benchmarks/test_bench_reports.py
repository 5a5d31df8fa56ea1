"""Results writer, tuning-table writer and plots of the benchmark suite, on fake measurements (CPU only)."""

import json
import re

import _bench_path  # noqa: F401
from pathlib import Path

import pytest

from benchmarks.common import Measurement, slug
from benchmarks.report import fill_pct, load_json, summary_lines, write_json, write_markdown
from benchmarks.tuning import tuning_rules, write_tuning_table


def m(op="softmax.causal", impl="pipegoose", dtype="bfloat16", pas="fwd+bwd", cols=1024, ms=1.0,
      status="ok", tunable="same"):
    t = impl if tunable == "same" else tunable
    return Measurement(op=op, impl=impl, dtype=dtype, pas=pas, shape={"b": 1, "np": 1, "sq": cols, "sk": cols},
                       cols=cols, status=status, bytes=10**9, median_ms=ms if status == "ok" else None,
                       gbps=(1.0 / ms if status == "ok" else None), tunable=t)


def test_slug_follows_the_architecture_doc():
    assert slug("NVIDIA H200") == "nvidia_h200"
    assert slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
    assert slug("Tesla V100-SXM2-16GB") == "tesla_v100_sxm2_16gb"
    assert slug("cpu x86_64 (dry run)") == "cpu_x86_64_dry_run" and slug("(cpu)") == "cpu"  # no "_" at the ends
    with pytest.raises(ValueError, match="device_name"):
        slug("--")


def test_rules_pick_the_fastest_correct_impl_and_merge_buckets():
    ms = [
        m(impl="megatron", cols=512, ms=1.0), m(impl="pipegoose", cols=512, ms=1.2), m(impl="torch", cols=512, ms=3),
        m(impl="megatron", cols=1024, ms=1.0), m(impl="pipegoose", cols=1024, ms=1.1),
        # megatron is fastest at 2048 but FAILED: it must not be chosen
        m(impl="megatron", cols=2048, status="FAILED"), m(impl="pipegoose", cols=2048, ms=2.0),
        m(impl="torch", cols=2048, ms=5.0),
        m(impl="megatron", cols=4096, status="unsupported"), m(impl="pipegoose", cols=4096, ms=4.0),
        # comparisons that the dispatcher cannot choose never enter the table, however fast
        m(impl="liger", cols=4096, ms=0.1, tunable=None), m(impl="compile", cols=512, ms=0.1, tunable=None),
    ]
    rules = tuning_rules(ms)
    assert rules == [
        {"op": "softmax.causal", "dtype": "bfloat16", "pass": "fwd+bwd", "max_cols": 1024, "impl": "megatron"},
        {"op": "softmax.causal", "dtype": "bfloat16", "pass": "fwd+bwd", "max_cols": None, "impl": "pipegoose"},
    ]


def test_a_tie_goes_to_the_first_impl_of_the_dispatchers_built_in_order_whatever_the_rows_order():
    """A review: of equal times the row that came first won (strict <), so the rule depended on the order of the
    impls in results.json. A tie now goes to the impl the dispatcher's built-in order takes first."""
    for rows in ([m(impl="torch", ms=1.0), m(impl="megatron", ms=1.0), m(impl="pipegoose", ms=1.0)],
                 [m(impl="pipegoose", ms=1.0), m(impl="megatron", ms=1.0), m(impl="torch", ms=1.0)]):
        assert [r["impl"] for r in tuning_rules(rows)] == ["pipegoose"]
        assert [r["impl"] for r in tuning_rules(rows[:2] if rows[0].impl == "torch" else rows[1:])] == ["megatron"]
    opt = [m(op="adamw", impl=i, pas="step", cols=10**8, ms=2.0) for i in ("apex", "torch", "torch_fused")]
    assert [r["impl"] for r in tuning_rules(opt)] == ["torch_fused"]
    assert [r["impl"] for r in tuning_rules([m(impl="torch", ms=0.9), m(impl="pipegoose", ms=1.0)])] == ["torch"]

def test_rules_are_per_op_dtype_and_pass_and_skip_bwd_only():
    ms = [m(op="layer_norm", impl="apex", pas="fwd", cols=1024, ms=1), m(op="layer_norm", impl="pipegoose", pas="fwd",
                                                                           cols=1024, ms=2),
          m(op="layer_norm", impl="apex", pas="fwd+bwd", cols=1024, ms=3),
          m(op="layer_norm", impl="pipegoose", pas="fwd+bwd", cols=1024, ms=2),
          m(op="layer_norm", impl="pipegoose", pas="bwd", cols=1024, ms=1),
          m(op="layer_norm", impl="torch", dtype="float32", pas="fwd", cols=1024, ms=1)]
    got = {(r["dtype"], r["pass"]): r["impl"] for r in tuning_rules(ms)}
    assert got == {("bfloat16", "fwd"): "apex", ("bfloat16", "fwd+bwd"): "pipegoose", ("float32", "fwd"): "torch"}


def test_tuning_table_file_is_valid_for_the_dispatcher(tmp_path):
    ms = [m(impl="megatron", cols=1024, ms=1.0), m(impl="pipegoose", cols=4096, ms=1.0)]
    old = {"device": "NVIDIA H200", "measured": "2026-01-01", "benchmark": "x",
           "rules": [{"op": "attention", "dtype": "bfloat16", "pass": "fwd+bwd", "max_cols": None, "impl": "sdpa"},
                     {"op": "softmax.causal", "dtype": "bfloat16", "pass": "fwd", "max_cols": None, "impl": "torch"},
                     {"op": "softmax.causal", "dtype": "float32", "pass": "fwd+bwd", "max_cols": None, "impl": "torch"},
                     {"op": "softmax.causal", "dtype": "bfloat16", "pass": "fwd+bwd", "max_cols": None,
                      "impl": "torch"}]}
    (tmp_path / "nvidia_h200.json").write_text(json.dumps(old))
    path = write_tuning_table("NVIDIA H200", "2026-11-29", "benchmarks/results/nvidia_h200_2026-11-29/results.json",
                              ms, tmp_path)
    assert path.name == "nvidia_h200.json"
    data = json.loads(path.read_text())
    assert data["device"] == "NVIDIA H200" and data["measured"] == "2026-11-29"
    # the earlier rules of the groups measured now (causal softmax, bf16, fwd+bwd) are replaced; those of other ops,
    # dtypes and passes are kept (a walkthrough: a merge of one dtype's sweep dropped the op's other rules)
    assert [(r["op"], r["dtype"], r["pass"], r["impl"]) for r in data["rules"]] == [
        ("attention", "bfloat16", "fwd+bwd", "sdpa"), ("softmax.causal", "bfloat16", "fwd", "torch"),
        ("softmax.causal", "float32", "fwd+bwd", "torch"), ("softmax.causal", "bfloat16", "fwd+bwd", "megatron"),
        ("softmax.causal", "bfloat16", "fwd+bwd", "pipegoose")]
    assert not list(tmp_path.glob(".*"))   # no temp file left behind
    from pipegoose.nn.fusion.dispatch import TuningTable

    table = TuningTable.load(path)   # the consumer accepts what we wrote
    assert [r.impl for r in table.rules] == ["sdpa", "torch", "torch", "megatron", "pipegoose"]


def _old_layer_norm_table(tmp_path):
    (tmp_path / "nvidia_h200.json").write_text(json.dumps({"device": "NVIDIA H200", "rules": [
        {"op": "layer_norm", "dtype": "bfloat16", "pass": "fwd+bwd", "max_cols": 1024, "impl": "torch"},
        {"op": "layer_norm", "dtype": "bfloat16", "pass": "fwd+bwd", "max_cols": None, "impl": "pipegoose"},
        {"op": "layer_norm", "dtype": "float16", "max_cols": None, "impl": "apex"}]}))


def test_an_incomplete_sweep_keeps_the_groups_earlier_rules(tmp_path):
    """A review: rows skipped (the budget ran out: pipegoose, timed last, "checked ok, not timed") or crashed were
    dropped, so the impls timed at a size won it, the last measured bucket became ``max_cols: null`` over the sizes
    the budget left out, and the group's earlier rules went. A group with a dispatchable impl's row without a result
    now gives no rules, its earlier rules stay, and the writer says so; an unavailable impl (not built on the machine
    that measured) or an unsupported shape does not make a group incomplete."""
    from benchmarks.tuning import incomplete_groups

    ln = dict(op="layer_norm", pas="fwd+bwd")
    ms = [m(impl="torch", cols=512, ms=1.0, **ln), m(impl="pipegoose", cols=512, ms=1.2, **ln),
          m(impl="torch", cols=1024, ms=2.0, **ln), m(impl="pipegoose", cols=1024, status="skipped", **ln),
          m(impl="torch", cols=4096, status="skipped", **ln), m(impl="pipegoose", cols=4096, status="skipped", **ln)]
    ms[3].detail = "time budget (checked ok, not timed)"
    assert tuning_rules(ms) == []
    assert incomplete_groups(ms) == {("layer_norm", "bfloat16", "fwd+bwd"): (
        "pipegoose fwd+bwd at 1024: skipped (time budget (checked ok, not timed)); torch fwd+bwd at 4096: skipped; "
        "pipegoose fwd+bwd at 4096: skipped")}
    _old_layer_norm_table(tmp_path)
    before = json.loads((tmp_path / "nvidia_h200.json").read_text())["rules"]
    said = []
    # fp16 complete (apex unavailable there, megatron-free op): its rules replace the old pass-less one only for fp16
    fp16 = [m(impl="torch", cols=512, ms=1.0, dtype="float16", **ln), m(impl="pipegoose", cols=512, ms=0.5,
                                                                        dtype="float16", **ln),
            m(impl="apex", cols=512, status="unavailable", dtype="float16", **ln)]
    path = write_tuning_table("NVIDIA H200", "2026-12-04", "x", ms + fp16, tmp_path, log=said.append)
    rules = json.loads(path.read_text())["rules"]
    assert rules == before[:2] + [{"op": "layer_norm", "dtype": "float16", "pass": "fwd+bwd", "max_cols": None,
                                   "impl": "pipegoose"}]
    assert said == ["tuning table: layer_norm bfloat16 fwd+bwd: earlier rules kept (the sweep is incomplete, no rules "
                    "from it: " + incomplete_groups(ms)[("layer_norm", "bfloat16", "fwd+bwd")] + ")"]
    # the same bad merge in tuning_rules alone: pipegoose fastest at 1024 and 16384 but skipped at 4096 gave
    # pipegoose <= 1024, torch <= 4096, pipegoose null
    gap = [m(impl="torch", cols=c, ms=2.0, **ln) for c in (1024, 4096, 16384)] + [
        m(impl="pipegoose", cols=1024, ms=1.0, **ln), m(impl="pipegoose", cols=4096, status="skipped", **ln),
        m(impl="pipegoose", cols=16384, ms=1.0, **ln)]
    assert tuning_rules(gap) == []
    # an error row (a crash) is a result since a review: pipegoose is no contender at 4096, as where it FAILED
    gap[4].status = "error"
    assert [(r["max_cols"], r["impl"]) for r in tuning_rules(gap)] == [
        (1024, "pipegoose"), (4096, "torch"), (None, "pipegoose")]
    # an incomplete pass keeps an old pass-less rule, which covers it, though the other pass is replaced: written as a
    # rule of the incomplete pass (kept without a pass, it shadowed the new fwd+bwd rules: a review)
    old_fp16 = [m(impl="torch", cols=512, ms=1.0, dtype="float16", op="layer_norm", pas="fwd"),
                m(impl="pipegoose", cols=512, status="skipped", dtype="float16", op="layer_norm", pas="fwd")]
    _old_layer_norm_table(tmp_path)
    rules = json.loads(write_tuning_table("NVIDIA H200", "2026-12-04", "x", fp16 + old_fp16, tmp_path,
                                          log=None).read_text())["rules"]
    assert [(r["dtype"], r.get("pass"), r["impl"]) for r in rules] == [
        ("bfloat16", "fwd+bwd", "torch"), ("bfloat16", "fwd+bwd", "pipegoose"), ("float16", "fwd", "apex"),
        ("float16", "fwd+bwd", "pipegoose")]


def test_the_reviews_incomplete_sweep_repro_keeps_the_table(tmp_path, capsys):
    """The review's repro, verbatim: the table it wrote held one rule, torch for every size."""
    from benchmarks.tuning import write_tuning_table as write

    d = tmp_path
    (d / "nvidia_h200.json").write_text(json.dumps({"device": "NVIDIA H200", "rules": [
        {"op": "layer_norm", "dtype": "bfloat16", "pass": "fwd+bwd", "max_cols": 1024, "impl": "torch"},
        {"op": "layer_norm", "dtype": "bfloat16", "pass": "fwd+bwd", "max_cols": None, "impl": "pipegoose"}]}))

    def M(i, c, ms, s="ok"):
        return Measurement(op="layer_norm", impl=i, dtype="bfloat16", pas="fwd+bwd", shape={}, cols=c, status=s,
                           median_ms=ms if s == "ok" else None, tunable=i)

    ms = [M("torch", 512, 1.0), M("pipegoose", 512, 1.2), M("torch", 1024, 2.0), M("pipegoose", 1024, None, "skipped"),
          M("torch", 4096, None, "skipped"), M("pipegoose", 4096, None, "skipped")]
    rules = json.load(open(write("NVIDIA H200", "d", "x", ms, d)))["rules"]
    assert [(r["max_cols"], r["impl"]) for r in rules] == [(1024, "torch"), (None, "pipegoose")]
    assert "layer_norm bfloat16 fwd+bwd: earlier rules kept" in capsys.readouterr().out


def test_an_impl_that_now_crashes_loses_its_rules_as_a_failed_one_does(tmp_path):
    """A review: an ``error`` row (a crash or OOM) made its group incomplete, so the group's earlier rules stayed, and
    the GPU was still sent to the kernel that now crashes (a FAILED one lost its rules). An error rules the impl out:
    no contender at that size, its earlier rules in the group go; the group is complete and gives rules from the other
    impls. Only a ``skipped`` row (the time budget) makes a group incomplete; there, too, the errored impl's earlier
    rules go and the others' stay."""
    from benchmarks.tuning import incomplete_groups

    old = {"device": "GPU X", "rules": [
        {"op": "rms_norm", "dtype": "bfloat16", "pass": "fwd+bwd", "max_cols": None, "impl": "pipegoose"}]}
    (tmp_path / "gpu_x.json").write_text(json.dumps(old))
    rn = dict(op="rms_norm", pas="fwd+bwd")
    ms = [m(impl="torch", cols=c, ms=1.0, **rn) for c in (1024, 4096, 65536)] + [
        m(impl="pipegoose", cols=c, ms=2.0, **rn) for c in (1024, 4096)] + [
        m(impl="pipegoose", cols=65536, status="error", **rn)]
    ms[-1].detail = "CUDA error: an illegal memory access"
    assert incomplete_groups(ms) == {}
    said = []
    path = write_tuning_table("GPU X", "2026-12-06", "x", ms, tmp_path, log=said.append)
    assert json.loads(path.read_text())["rules"] == [
        {"op": "rms_norm", "dtype": "bfloat16", "pass": "fwd+bwd", "max_cols": None, "impl": "torch"}]
    assert said == []
    # pipegoose fastest where it ran, crashing at the largest size: the largest goes to torch
    for x in ms[3:5]:
        x.median_ms = 0.5
    (tmp_path / "gpu_x.json").write_text(json.dumps(old))
    got = json.loads(write_tuning_table("GPU X", "d", "x", ms, tmp_path, log=None).read_text())["rules"]
    assert [(r["max_cols"], r["impl"]) for r in got] == [(4096, "pipegoose"), (None, "torch")]
    # an incomplete group (torch skipped at a size) keeps its earlier rules, less the one naming the impl that crashed
    old["rules"].insert(0, {"op": "rms_norm", "dtype": "bfloat16", "pass": "fwd+bwd", "max_cols": 512, "impl": "torch"})
    (tmp_path / "gpu_x.json").write_text(json.dumps(old))
    ms[2].status, ms[2].median_ms = "skipped", None
    assert list(incomplete_groups(ms)) == [("rms_norm", "bfloat16", "fwd+bwd")]
    got = json.loads(write_tuning_table("GPU X", "d", "x", ms, tmp_path, log=None).read_text())["rules"]
    assert [(r["max_cols"], r["impl"]) for r in got] == [(512, "torch")]
    # a run whose only news is the crash still writes the table (run.py writes it where table_inputs gives anything)
    from benchmarks.tuning import table_inputs

    assert table_inputs([ms[-1]]) == ([], {("rms_norm", "bfloat16", "fwd+bwd", "pipegoose")})


def test_an_old_rule_without_a_pass_kept_for_an_incomplete_pass_does_not_shadow_the_other_pass(tmp_path):
    """A review: with one pass incomplete, an older rule without a pass was kept, before the new rules of the other
    pass; the dispatcher reads a rule without a pass for both passes, in table order, so training calls still took
    the old impl. It is kept for the incomplete pass only, written as a rule of that pass."""
    import torch

    from pipegoose.nn.fusion.dispatch import Problem, TuningTable

    old = {"device": "GPU X", "rules": [{"op": "rms_norm", "dtype": "bfloat16", "pass": None, "max_cols": None,
                                         "impl": "torch"}]}
    (tmp_path / "gpu_x.json").write_text(json.dumps(old))
    ms = [m(op="rms_norm", pas="fwd+bwd", impl="torch", cols=c, ms=2.0) for c in (1024, 4096)] + [
        m(op="rms_norm", pas="fwd+bwd", impl="pipegoose", cols=c, ms=1.0) for c in (1024, 4096)] + [
        m(op="rms_norm", pas="fwd", impl="torch", cols=c, ms=2.0) for c in (1024, 4096)] + [
        m(op="rms_norm", pas="fwd", impl="pipegoose", cols=1024, ms=1.0),
        m(op="rms_norm", pas="fwd", impl="pipegoose", cols=4096, status="skipped")]
    path = write_tuning_table("GPU X", "2026-12-06", "x", ms, tmp_path, log=None)
    data = json.loads(path.read_text())
    assert data["rules"] == [
        {"op": "rms_norm", "dtype": "bfloat16", "pass": "fwd", "max_cols": None, "impl": "torch"},
        {"op": "rms_norm", "dtype": "bfloat16", "pass": "fwd+bwd", "max_cols": None, "impl": "pipegoose"}]
    table = TuningTable.parse(data, str(path))

    def chosen(needs_grad, cols):   # the dispatcher takes the first candidate whose impl can run
        problem = Problem("rms_norm", torch.bfloat16, torch.device("cuda", 0), cols, needs_grad, {})
        return table.candidates(problem)[0].impl

    for cols in (512, 4096, 65536):
        assert chosen(True, cols) == "pipegoose" and chosen(False, cols) == "torch", cols

    # the impl of the old rule wrong now in the incomplete pass: it goes there too; with both passes incomplete the
    # old rule stays as it was
    (tmp_path / "gpu_x.json").write_text(json.dumps(old))
    ms[5].status = "FAILED"
    assert json.loads(write_tuning_table("GPU X", "d", "x", ms, tmp_path, log=None).read_text())["rules"] == [
        {"op": "rms_norm", "dtype": "bfloat16", "pass": "fwd+bwd", "max_cols": None, "impl": "pipegoose"}]
    (tmp_path / "gpu_x.json").write_text(json.dumps(old))
    ms[5].status = "ok"
    ms[3].status, ms[3].median_ms = "skipped", None
    assert json.loads(write_tuning_table("GPU X", "d", "x", ms, tmp_path, log=None).read_text())["rules"] == (
        old["rules"])


def test_rows_skipped_before_a_size_was_set_up_name_their_dispatcher_impl():
    """``run_ops`` wrote the rows of a size the budget left out without ``tunable``: the tuning table could not tell
    that a dispatchable impl went untimed. They carry it now, and rows of older runs without it are read by impl name
    (an optimizer's are named by its benchmark already)."""
    import torch

    from benchmarks.ops import run_ops
    from benchmarks.timing import Timer
    from benchmarks.tuning import incomplete_groups

    rows = run_ops(["layer_norm"], [torch.float32], "dry", "cpu", Timer("cpu", warmup=0, reps=1),
                   {torch.float32: None}, None, deadline=0.0, log=lambda msg: None)
    assert rows and {r.status for r in rows} == {"skipped"}
    assert {(r.impl, r.tunable) for r in rows if r.impl in ("pipegoose", "apex", "torch", "compile")} == {
        ("pipegoose", "pipegoose"), ("apex", "apex"), ("torch", "torch"), ("compile", None)}
    for r in rows:
        r.tunable = None   # as an older run wrote them
    assert set(incomplete_groups(rows)) == {("layer_norm", "float32", "fwd"), ("layer_norm", "float32", "fwd+bwd")}

def test_tuning_table_drops_the_rules_of_a_group_whose_impls_now_fail(tmp_path):
    """A review: the groups replaced were those this run made rules for, so where every dispatchable impl FAILED now,
    the old rule (naming the impl that is now wrong) stayed. An old rule naming an impl that FAILED in its group goes;
    rows that measured nothing (skipped, not built, crashed) or a shape an impl declines change nothing; an old rule
    without a pass goes with either pass of its op and dtype."""
    old = {"device": "NVIDIA H200", "measured": "2026-01-01", "benchmark": "x",
           "rules": [{"op": "rms_norm", "dtype": "bfloat16", "pass": "fwd+bwd", "max_cols": None, "impl": "pipegoose"},
                     {"op": "rms_norm", "dtype": "float16", "pass": "fwd+bwd", "max_cols": None, "impl": "pipegoose"},
                     {"op": "layer_norm", "dtype": "bfloat16", "max_cols": None, "impl": "apex"},
                     {"op": "layer_norm", "dtype": "float32", "max_cols": None, "impl": "apex"}]}
    (tmp_path / "nvidia_h200.json").write_text(json.dumps(old))
    old["rules"] += [{"op": "softmax.causal", "dtype": "bfloat16", "pass": "fwd+bwd", "max_cols": None,
                      "impl": "pipegoose"},
                     {"op": "softmax.causal", "dtype": "float16", "pass": "fwd", "max_cols": None, "impl": "pipegoose"}]
    (tmp_path / "nvidia_h200.json").write_text(json.dumps(old))
    ms = [m(op="rms_norm", dtype="bfloat16", status="FAILED"), m(op="rms_norm", dtype="float16", status="skipped"),
          m(op="rms_norm", dtype="float16", impl="torch", status="error"),
          m(op="layer_norm", dtype="bfloat16", pas="fwd", ms=1.0),
          # a shape Megatron's copy declines, another impl's wrong result: the pipegoose rules stay
          m(impl="megatron", cols=4096, status="unsupported"), m(cols=4096, status="skipped"),
          m(dtype="float16", pas="fwd", impl="torch", status="FAILED")]
    path = write_tuning_table("NVIDIA H200", "2026-12-04", "x", ms, tmp_path)
    got = [(r["op"], r["dtype"], r.get("pass"), r["impl"]) for r in json.loads(path.read_text())["rules"]]
    assert got == [("rms_norm", "float16", "fwd+bwd", "pipegoose"), ("layer_norm", "float32", None, "apex"),
                   ("softmax.causal", "bfloat16", "fwd+bwd", "pipegoose"),
                   ("softmax.causal", "float16", "fwd", "pipegoose"), ("layer_norm", "bfloat16", "fwd", "pipegoose")]


def test_optimizer_rows_give_rules_for_the_dispatchers_optimizer_ops(tmp_path):
    """The optimizers' rows took no part in the tuning table, so FusedAdam's default stayed the Apex copy where torch's
    fused AdamW measured twice as fast (bf16, H200). An ``adamw`` step gives ``adam`` rules (pass null, max_cols the
    parameter count); comparisons (``fused_adam`` = FusedAdam's own choice, ``torch_loop``) take no part; a FAILED
    impl's old rule goes; the dispatcher reads the table and applies it per bucket size."""
    ms = [m(op="adamw", impl="torch_fused", pas="step", cols=10**8, ms=1.0),
          m(op="adamw", impl="apex", pas="step", cols=10**8, ms=2.0),
          m(op="adamw", impl="fused_adam", pas="step", cols=10**8, ms=0.5, tunable=None),
          m(op="adamw", impl="torch_fused", pas="step", cols=10**9, ms=12.0),
          m(op="adamw", impl="deepspeed", pas="step", cols=10**9, ms=11.0),
          m(op="clip_grad_norm", impl="torch", pas="step", cols=10**8, ms=1.0, dtype="float32"),
          m(op="clip_grad_norm", impl="apex", pas="step", cols=10**8, ms=1.5, dtype="float32"),
          m(op="clip_grad_norm", impl="torch_loop", pas="step", cols=10**8, ms=0.1, dtype="float32", tunable=None)]
    assert tuning_rules(ms) == [
        {"op": "adam", "dtype": "bfloat16", "pass": None, "max_cols": 10**8, "impl": "torch_fused"},
        {"op": "adam", "dtype": "bfloat16", "pass": None, "max_cols": None, "impl": "deepspeed"},
        {"op": "clip_grad_norm", "dtype": "float32", "pass": None, "max_cols": None, "impl": "torch"}]
    old = {"device": "NVIDIA H200", "measured": "2026-01-01", "benchmark": "x",
           "rules": [{"op": "adam", "dtype": "float32", "pass": None, "max_cols": None, "impl": "apex"},
                     {"op": "adam", "dtype": "float16", "pass": None, "max_cols": None, "impl": "apex"},
                     {"op": "adam", "dtype": "bfloat16", "pass": None, "max_cols": None, "impl": "apex"}]}
    (tmp_path / "nvidia_h200.json").write_text(json.dumps(old))
    path = write_tuning_table("NVIDIA H200", "2026-12-04", "x",
                              ms + [m(op="adamw", impl="apex", pas="step", dtype="float32", status="FAILED")], tmp_path)
    got = [(r["op"], r["dtype"], r["pass"], r["max_cols"], r["impl"]) for r in json.loads(path.read_text())["rules"]]
    assert got == [("adam", "float16", None, None, "apex"), ("adam", "bfloat16", None, 10**8, "torch_fused"),
                   ("adam", "bfloat16", None, None, "deepspeed"), ("clip_grad_norm", "float32", None, None, "torch")]

    import torch

    from pipegoose.nn.fusion import dispatch
    from pipegoose.nn.fusion.ops import multi_tensor as mt

    table = dispatch.TuningTable.load(path)

    def chosen(numel):
        problem = dispatch.Problem("adam", torch.bfloat16, torch.device("cuda", 0), numel, False, {})
        return [r.impl for r in table.candidates(problem)][0]

    assert chosen(10**8) == "torch_fused" and chosen(10**8 + 1) == "deepspeed"
    ps = [torch.zeros(3, 5), torch.zeros(7)]
    assert mt.adam_problem(ps, ps, ps, ps).cols == 22 and mt.clip_problem(ps, 2.0).cols == 22


def test_results_json_roundtrip_markdown_and_summary(tmp_path):
    ms = [m(impl="pipegoose", cols=1024, ms=0.5), m(impl="eager", cols=1024, ms=2.0, tunable=None),
          m(impl="megatron", cols=1024, status="FAILED"),
          Measurement(op="adamw", impl="torch_fused", dtype="float32", pas="step", shape={"params": 10**8},
                      cols=10**8, status="ok", bytes=28 * 10**8, median_ms=1.0, gbps=2800.0)]
    ms[2].detail = "y: 3 of 10 elements off"
    copy = {"bytes": 2 * 2**30, "gbps": 4000.0, "median_ms": 0.5}
    fill_pct(ms, copy["gbps"])
    assert ms[0].pct_of_copy == pytest.approx(100 * 2.0 / 4000.0)
    assert ms[2].pct_of_copy is None
    env = {"gpu": "NVIDIA H200", "date": "2026-11-29T10:00:00+00:00", "torch": "2.x", "driver": "570"}
    p = write_json(tmp_path / "results.json", env, {"command": "x"}, copy, ms, {"e2e": None})
    data, back = load_json(p)
    assert data["environment"]["gpu"] == "NVIDIA H200" and data["copy"]["gbps"] == 4000.0
    assert [b.to_json() for b in back] == [x.to_json() for x in ms]
    md = write_markdown(tmp_path / "results.md", env, {"command": "x"}, copy, ms,
                        e2e=[{"model": "llama", "variant": "sdpa", "status": "ok", "tokens_per_s": 1000.0,
                              "step_ms": 10.0, "peak_mem_gib": 20.0, "params": 1.1e9, "batch": 4}]).read_text()
    assert "## softmax.causal — bfloat16" in md and "FAILED" in md and "y: 3 of 10 elements off" in md
    assert "| 1024 | fwd+bwd |" in md and "2 (0%)" in md      # 2 GB/s = 0% of 4000 GB/s
    assert "| llama | sdpa |" in md and "NVIDIA H200" in md and "570" in md
    assert not any(ln.startswith("statuses:") for ln in summary_lines([], None))   # (an end-to-end run alone)
    lines = summary_lines(ms, copy)
    assert any("FAILED: megatron/softmax.causal/bfloat16" in ln for ln in lines)
    assert any(ln.strip().startswith("adamw") and "torch_fused=70" in ln for ln in lines)


def test_markdown_lists_a_merges_commands_at_the_end(tmp_path):
    """One run: its command under the environment. A merge (" ; "-joined commands): a line saying how many, and the
    commands one per numbered line in the last section, after the tables."""
    ms = [m(impl="pipegoose", cols=1024, ms=0.5)]
    env = {"gpu": "NVIDIA H200", "date": "2026-11-29T10:00:00+00:00"}
    one = write_markdown(tmp_path / "one.md", env, {"command": "python -m benchmarks.run --only x"}, None,
                         ms).read_text()
    assert "Run: `python -m benchmarks.run --only x`" in one and "Runs merged here" not in one
    cmds = ["python -m benchmarks.run --only a", "python -m benchmarks.run --only b",
            "python -m benchmarks.run --report-only r1 r2 --out o"]
    md = write_markdown(tmp_path / "merged.md", env, {"command": " ; ".join(cmds)}, None, ms).read_text()
    assert "Run: `" not in md and "the 3 commands behind these rows" in md
    tail = md[md.index("## Runs merged here"):]
    assert md.index("## softmax.causal") < md.index("## Runs merged here")
    assert [ln for ln in tail.splitlines() if ln[:1].isdigit()] == [f"{i}. `{c}`" for i, c in enumerate(cmds, 1)]


def test_measurement_rejects_unknown_status():
    with pytest.raises(ValueError, match="status"):
        m(status="fast")


def test_plots_on_fake_data(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.plots import plot_all

    ms = [m(impl=i, cols=c, ms=ms_, dtype=d) for i, f in (("pipegoose", 1.0), ("eager", 3.0))
          for c, ms_ in ((512, 0.5 * f), (2048, 1.0 * f)) for d in ("bfloat16", "float32")]
    ms.append(m(impl="megatron", cols=512, status="FAILED"))
    files = plot_all(ms, tmp_path, copy_gbps=4.0, gpu="fake GPU")
    assert [f.name for f in files] == ["softmax_causal_fwd_bwd.png"]
    head = files[0].read_bytes()[:8]
    assert head == b"\x89PNG\r\n\x1a\n" and files[0].stat().st_size > 5000


def test_report_only_merges_e2e_rows_and_dates_each_row(tmp_path, monkeypatch, capsys):
    """--report-only: measurements and end-to-end rows merge per key, the later run winning, and every merged row
    names the run (date) that measured it."""
    # benchmarks.run turns strict mode on for its process when imported (os.environ.setdefault); keep it to this test
    monkeypatch.setenv("PIPEGOOSE_STRICT", "")
    from benchmarks.run import main

    copy = {"bytes": 2 * 2**30, "gbps": 4000.0, "median_ms": 0.5}
    runs = []
    for i, (date, rows, e2e) in enumerate((
            ("2026-11-29T10:00:00+00:00", [m(cols=512, ms=1.0), m(cols=1024, ms=1.0)],
             [{"model": "llama", "variant": "sdpa", "status": "ok", "tokens_per_s": 1.0},
              {"model": "llama", "variant": "liger", "status": "ok", "tokens_per_s": 2.0}]),
            ("2026-11-30T01:00:00+00:00", [m(cols=1024, ms=0.5)],
             [{"model": "llama", "variant": "sdpa", "status": "ok", "tokens_per_s": 3.0}]))):
        fill_pct(rows, copy["gbps"])
        env = {"gpu": "NVIDIA H200", "date": date, "device": "cuda"}
        d = tmp_path / f"run{i}"
        d.mkdir()
        write_json(d / "results.json", env, {"command": f"run {i}"}, copy, rows, {"e2e": e2e})
        runs.append(str(d))
    assert main(["--report-only", *runs, "--out", str(tmp_path / "out"), "--no-tuning"]) == 0
    data, back = load_json(tmp_path / "out" / "nvidia_h200_2026-11-30" / "results.json")
    got = {x.cols: (x.median_ms, x.extra["run"]) for x in back}
    assert got == {512: (1.0, "2026-11-29"), 1024: (0.5, "2026-11-30")}
    e2e = {(r["model"], r["variant"]): (r["tokens_per_s"], r["run"]) for r in data["e2e"]}
    assert e2e == {("llama", "sdpa"): (3.0, "2026-11-30"), ("llama", "liger"): (2.0, "2026-11-29")}
    md = (tmp_path / "out" / "nvidia_h200_2026-11-30" / "results.md").read_text()
    assert "| run | note |" in md  # the end-to-end table names each row's run
    assert re.search(r"\| llama \| sdpa \|.*\| 2026-11-30 \|", md)
    assert re.search(r"\| llama \| liger \|.*\| 2026-11-29 \|", md)
    assert "run 0" in data["config"]["command"] and "run 1" in data["config"]["command"]
    # a later run that measured nothing for a row (skipped for the time budget, timed out, crashed, not
    # installed) keeps the earlier measurement; a FAILED row (loss off sdpa's) or an oom replaces it
    skipped = tmp_path / "run2"
    skipped.mkdir()
    write_json(skipped / "results.json", {"gpu": "NVIDIA H200", "date": "2026-12-01T01:00:00+00:00", "device": "cuda"},
               {"command": "run 2"}, copy, [m(cols=512, status="skipped")],
               {"e2e": [{"model": "llama", "variant": "liger", "status": "skipped"},
                        {"model": "llama", "variant": "sdpa", "status": "timeout", "detail": "over 113 s"}]})
    capsys.readouterr()
    assert main(["--report-only", *runs, str(skipped), "--out", str(tmp_path / "out2"), "--no-tuning"]) == 0
    data, back = load_json(tmp_path / "out2" / "nvidia_h200_2026-12-01" / "results.json")
    assert {x.cols: x.status for x in back} == {512: "ok", 1024: "ok"}
    assert {r["variant"]: (r["status"], r["run"]) for r in data["e2e"]} == {"sdpa": ("ok", "2026-11-30"),
                                                                          "liger": ("ok", "2026-11-29")}
    # a timeout (or error) may be a hang (or crash) of the code under test: the kept row's note and the merge's
    # output name it; the summary names each end-to-end row's run
    sdpa = next(r for r in data["e2e"] if r["variant"] == "sdpa")
    assert sdpa["detail"] == "run 2026-12-01: timeout (over 113 s)"
    out = capsys.readouterr().out
    assert "note: e2e llama sdpa: run 2026-12-01: timeout (over 113 s); the 2026-11-30 row is kept" in out
    assert "(run 2026-11-30)" in out and "(run 2026-11-29)" in out
    assert "run 2026-12-01: timeout" in (tmp_path / "out2" / "nvidia_h200_2026-12-01" / "results.md").read_text()
    for i, (sdpa, liger, want) in enumerate((("error", "unavailable", {"sdpa": "ok", "liger": "ok"}),
                                             ("FAILED", "oom", {"sdpa": "FAILED", "liger": "oom"}))):
        later = tmp_path / f"later{i}"
        later.mkdir()
        env = {"gpu": "NVIDIA H200", "date": "2026-12-02T01:00:00+00:00", "device": "cuda"}
        write_json(later / "results.json", env, {"command": f"later {i}"}, copy, [m(cols=512)],
                   {"e2e": [{"model": "llama", "variant": "sdpa", "status": sdpa},
                            {"model": "llama", "variant": "liger", "status": liger}]})
        out = tmp_path / f"out_later{i}"
        assert main(["--report-only", *runs, str(later), "--out", str(out), "--no-tuning"]) == 0
        data, _ = load_json(out / "nvidia_h200_2026-12-02" / "results.json")
        assert {r["variant"]: r["status"] for r in data["e2e"]} == want
    # a measurement that crashed in a later run keeps the earlier one, and the merge says so
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    boom = m(cols=1024, status="error")
    boom.detail = "RuntimeError: boom"
    write_json(crashed / "results.json", {"gpu": "NVIDIA H200", "date": "2026-12-03T01:00:00+00:00", "device": "cuda"},
               {"command": "crashed"}, copy, [boom])
    capsys.readouterr()
    assert main(["--report-only", *runs, str(crashed), "--out", str(tmp_path / "out_crash"), "--no-tuning"]) == 0
    _, back = load_json(tmp_path / "out_crash" / "nvidia_h200_2026-12-03" / "results.json")
    assert {x.cols: (x.status, x.extra["run"]) for x in back} == {512: ("ok", "2026-11-29"), 1024: ("ok", "2026-11-30")}
    assert "run 2026-12-03: error (RuntimeError: boom); the 2026-11-30 row is kept" in capsys.readouterr().out
    # runs of another GPU, a missing folder, a file that is not a results.json: a clear error, nothing written
    other = tmp_path / "run3"
    other.mkdir()
    write_json(other / "results.json", {"gpu": "NVIDIA A100", "date": "2026-12-01T01:00:00+00:00", "device": "cuda"},
               {"command": "run 3"}, copy, [m(cols=512)])
    notes = tmp_path / "notes.json"
    notes.write_text("[1, 2]")
    for bad, match in ((other, "different GPUs"), (tmp_path / "nowhere", "nowhere"), (notes, "notes.json")):
        with pytest.raises(SystemExit, match=match):
            main(["--report-only", runs[0], str(bad), "--out", str(tmp_path / "out3"), "--no-tuning"])
    assert not (tmp_path / "out3").exists()


def test_report_only_refuses_what_it_would_ignore_or_lose(tmp_path, monkeypatch, capsys):
    """A walkthrough of --report-only: a second merge into the same folder replaced the first one's results without a
    word; options of a run (--quick, --only, --dtypes) were accepted and ignored; malformed end-to-end rows gave
    tracebacks, some after results.json was written; runs given newest first replaced newer rows without a word; of
    two attempts that measured nothing, the earlier was kept."""
    monkeypatch.setenv("PIPEGOOSE_STRICT", "")
    from benchmarks.run import main

    copy = {"bytes": 2 * 2**30, "gbps": 4000.0, "median_ms": 0.5}

    def run(name, date, e2e, rows=None):
        d = tmp_path / name
        d.mkdir()
        rows = rows or [m(cols=512)]
        fill_pct(rows, copy["gbps"])
        write_json(d / "results.json", {"gpu": "NVIDIA H200", "date": date, "device": "cuda"}, {"command": name},
                   copy, rows, {"e2e": e2e})
        return str(d)

    old = run("old", "2026-12-01T01:00:00+00:00", [{"model": "llama", "variant": "sdpa", "status": "ok",
                                                   "tokens_per_s": 100.0},
                                                  {"model": "llama", "variant": "eager", "status": "skipped"}])
    new = run("new", "2026-12-02T01:00:00+00:00", [{"model": "llama", "variant": "sdpa", "status": "ok",
                                                   "tokens_per_s": 90.0},
                                                  {"model": "llama", "variant": "eager", "status": "timeout",
                                                   "detail": "over 90 s"}])
    out = tmp_path / "out"
    assert main(["--report-only", old, new, "--out", str(out), "--no-tuning"]) == 0
    data, _ = load_json(out / "nvidia_h200_2026-12-02" / "results.json")
    assert {r["variant"]: r["status"] for r in data["e2e"]} == {"sdpa": "ok", "eager": "timeout"}  # the later attempt
    # a second merge into that folder: refused, the first merge's results kept; --overwrite replaces them
    with pytest.raises(SystemExit, match="exists: pass another --out, or --overwrite"):
        main(["--report-only", new, "--out", str(out), "--no-tuning"])
    assert len(load_json(out / "nvidia_h200_2026-12-02" / "results.json")[0]["e2e"]) == 2
    # newest first: the runs merge in order of their dates all the same, the newer winning (a review: the later
    # argument won, the older run's rows replacing the newer one's), and the merge says it reordered them
    capsys.readouterr()
    assert main(["--report-only", new, old, "--out", str(tmp_path / "reversed"), "--no-tuning"]) == 0
    assert (f"note: the runs were merged in order of their dates in UTC, the newer winning, not as given: "
            f"{old}/results.json (2026-12-01 01:00 UTC), {new}/results.json (2026-12-02 01:00 UTC)"
            in capsys.readouterr().out)
    data, _ = load_json(tmp_path / "reversed" / "nvidia_h200_2026-12-02" / "results.json")
    assert {r["variant"]: (r["status"], r.get("tokens_per_s"), r["run"]) for r in data["e2e"]} == {
        "sdpa": ("ok", 90.0, "2026-12-02"), "eager": ("timeout", None, "2026-12-02")}
    assert data["config"]["command"].startswith("old ; new ; ")   # the runs' commands, oldest first
    # the options of a run are refused with it (argparse's usage error, exit 2)
    for extra in (["--quick"], ["--only", "softmax"], ["--dtypes", "fp32"], ["--e2e"], ["--budget-s", "9"],
                  ["--device", "cpu"]):
        with pytest.raises(SystemExit) as e:
            main(["--report-only", old, "--out", str(tmp_path / "x"), *extra])
        assert e.value.code == 2, extra
    assert "not with --report-only" in capsys.readouterr().err
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(SystemExit) as e:
        main(["--report-only", old, "--out", str(a_file), "--no-tuning"])
    assert e.value.code == 2 and "--out: expected a folder" in capsys.readouterr().err
    # malformed end-to-end rows: a clear error naming the row and field, nothing written
    for i, (row, match) in enumerate((("oops", r"e2e\[0\]: expected a mapping"),
                                      ({"model": "llama", "variant": "sdpa"}, "status: expected one of"),
                                      ({"variant": "sdpa", "status": "ok"}, "model: expected a name"),
                                      ({"model": "llama", "variant": "sdpa", "status": "Timeout"}, "'Timeout'"),
                                      ({"model": "llama", "variant": "sdpa", "status": "ok", "tokens_per_s": "fast"},
                                       "tokens_per_s: expected a number"),
                                      ({"model": "llama", "variant": "sdpa", "status": "ok", "detail": 3},
                                       "detail: expected text"))):
        bad = run(f"bad{i}", "2026-12-03T01:00:00+00:00", [row])
        with pytest.raises(SystemExit, match=match):
            main(["--report-only", old, bad, "--out", str(tmp_path / f"bad_out{i}"), "--no-tuning"])
        assert not (tmp_path / f"bad_out{i}").exists()


def test_report_only_review_findings(tmp_path, monkeypatch, capsys):
    """A review of --report-only: a row with "detail": null passed the checks, then crashed the summary after
    results.json was written (and results.md showed "None"); dates with different UTC offsets were compared as text;
    a later skipped row replaced an earlier crash without a word; a row the tuning table refuses (cols 0) was found
    after results.json was written; --out under a file gave a traceback."""
    monkeypatch.setenv("PIPEGOOSE_STRICT", "")
    from benchmarks.run import main

    copy = {"bytes": 2 * 2**30, "gbps": 4000.0, "median_ms": 0.5}

    def run(name, date, e2e, rows=None):
        d = tmp_path / name
        d.mkdir()
        rows = rows if rows is not None else [m(cols=512)]
        fill_pct(rows, copy["gbps"])
        write_json(d / "results.json", {"gpu": "NVIDIA H200", "date": date, "device": "cuda"}, {"command": name},
                   copy, rows, {"e2e": e2e})
        return str(d)

    crash = m(cols=1024, status="error")
    crash.detail = None   # as a results.json row with "detail": null loads
    a = run("a", "2026-12-02T23:00:00+00:00",
            [{"model": "llama", "variant": "sdpa", "status": "ok", "tokens_per_s": 5.0, "detail": None},
             {"model": "llama", "variant": "eager", "status": "error", "detail": "CUDA error"}], [m(cols=512), crash])
    # 01:00 at +05:00 is 20:00 UTC of the day before: older than run a, though its text sorts after
    b = run("b", "2026-12-03T01:00:00+05:00",
            [{"model": "llama", "variant": "eager", "status": "skipped", "detail": None}],
            [m(cols=1024, status="skipped")])
    capsys.readouterr()
    out = tmp_path / "out"
    assert main(["--report-only", a, b, "--out", str(out), "--no-tuning"]) == 0
    said = capsys.readouterr().out
    # b is merged first, a (the newer in UTC) after it: a's crash is the later row, kept over b's skipped
    assert f"not as given: {b}/results.json (2026-12-02 20:00 UTC), {a}/results.json (2026-12-02 23:00 UTC)" in said
    assert "is replaced by" not in said
    assert re.search(r"e2e llama +sdpa +ok +5 tok/s \(run 2026-12-02\)", said)
    md = next(out.glob("*/results.md")).read_text()
    assert "None" not in md
    data, back = load_json(next(out.glob("*/results.json")))
    assert {x.cols: x.status for x in back} == {512: "ok", 1024: "error"}
    assert {r["variant"]: r["status"] for r in data["e2e"]} == {"sdpa": "ok", "eager": "error"}
    assert data["environment"]["date"] == "2026-12-02T23:00:00+00:00"   # dated by its newest run
    # given in date order: no note; a later skipped row replacing an earlier crash is said
    assert main(["--report-only", b, a, "--out", str(tmp_path / "out2"), "--no-tuning"]) == 0
    assert "not as given" not in capsys.readouterr().out
    c = run("c", "2026-12-03T01:00:00+00:00", [{"model": "llama", "variant": "eager", "status": "skipped"}],
            [m(cols=1024, status="skipped")])
    assert main(["--report-only", a, c, "--out", str(tmp_path / "out2c"), "--no-tuning"]) == 0
    said = capsys.readouterr().out
    assert "e2e llama eager: the 2026-12-02 row's error (CUDA error) is replaced by run 2026-12-03's skipped" in said
    assert "1024: the 2026-12-02 row's error is replaced by run 2026-12-03's skipped" in said
    # a row the tuning table refuses: a clear error before anything is written
    bad = run("bad", "2026-12-04T01:00:00+00:00", [], [m(cols=0)])
    with pytest.raises(SystemExit, match="cols: expected a size >= 1, got 0"):
        main(["--report-only", a, bad, "--out", str(tmp_path / "out3"), "--tuning-dir", str(tmp_path / "t")])
    assert not (tmp_path / "out3").exists() and not (tmp_path / "t").exists()
    # --out or --tuning-dir under a file: argparse's usage error naming the file
    (tmp_path / "a-file").write_text("")
    for opt in ("--out", "--tuning-dir"):
        with pytest.raises(SystemExit) as e:
            main(["--report-only", a, opt, str(tmp_path / "a-file" / "sub"),
                  *(["--out", str(tmp_path / "out4")] if opt != "--out" else [])])
        assert e.value.code == 2 and f"{opt}: expected a folder" in capsys.readouterr().err
    assert not (tmp_path / "out4").exists()
    # dates that are not dates, or out of the datetime range in UTC: a clear error, no traceback, nothing written
    for i, date in enumerate(("0001-01-01T00:30:00+05:00", "9999-12-31T23:00:00-05:00", "yesterday")):
        odd = run(f"odd{i}", date, [])
        with pytest.raises(SystemExit, match="environment.date: expected an ISO 8601 date"):
            main(["--report-only", a, odd, "--out", str(tmp_path / f"odd_out{i}"), "--no-tuning"])
        assert not (tmp_path / f"odd_out{i}").exists()
    capsys.readouterr()
    # a "Z" date is UTC (Python 3.10's fromisoformat does not read it)
    z = run("z", "2026-12-01T00:00:00Z", [])
    assert main(["--report-only", a, z, "--out", str(tmp_path / "z_out"), "--no-tuning"]) == 0
    assert f"not as given: {z}/results.json (2026-12-01 00:00 UTC), {a}/results.json" in capsys.readouterr().out
    # a run whose only dispatchable rows FAILED drops the old rule naming the impl (it was kept: the table was written
    # only where some row was ok)
    tdir = tmp_path / "tuning"
    tdir.mkdir()
    (tdir / "nvidia_h200.json").write_text(json.dumps({"device": "NVIDIA H200", "measured": "2026-01-01",
                                                       "benchmark": "x", "rules": [
        {"op": "rms_norm", "dtype": "bfloat16", "pass": "fwd+bwd", "max_cols": None, "impl": "pipegoose"},
        {"op": "layer_norm", "dtype": "bfloat16", "pass": "fwd+bwd", "max_cols": None, "impl": "pipegoose"}]}))
    wrong = run("wrong", "2026-12-05T01:00:00+00:00", [], [m(op="rms_norm", status="FAILED"),
                                                           m(op="rms_norm", impl="torch", status="FAILED")])
    assert main(["--report-only", wrong, "--out", str(tmp_path / "wrong_out"), "--tuning-dir", str(tdir)]) == 0
    assert [r["op"] for r in json.loads((tdir / "nvidia_h200.json").read_text())["rules"]] == ["layer_norm"]


def test_report_only_refuses_malformed_runs_and_tables_before_writing(tmp_path, monkeypatch, capsys):
    """A fresh-clone walkthrough edited a results.json: an ok row without its GB/s, a null or numeric date, a copy
    without its bytes, a size given as text, numbers as text, extra or config of the wrong kind, and an ok end-to-end
    row without numbers gave tracebacks, most after results.json was written; a tuning table that is not one crashed
    the merge after writing (or, not JSON, was replaced without a word); `--out ""` wrote into the working folder and
    the repository's tuning table; a merge interrupted halfway left a folder the next merge refused."""
    monkeypatch.setenv("PIPEGOOSE_STRICT", "")
    from benchmarks.run import main

    good = write_run(tmp_path / "good", "2026-12-01T01:00:00+00:00", {"bytes": 2 * 2**30, "gbps": 4000.0,
                                                                     "median_ms": 0.5}, [m(cols=512)])
    base = json.loads((Path(good) / "results.json").read_text())

    def edited(name, edit):
        data = json.loads(json.dumps(base))
        edit(data)
        d = tmp_path / name
        d.mkdir()
        (d / "results.json").write_text(json.dumps(data))
        return str(d)

    row = lambda **kw: (lambda d: d["measurements"][0].update(kw))   # noqa: E731
    cases = [("gbps_null", row(gbps=None), "a row that is ok needs its median_ms and gbps"),
             ("date_null", lambda d: d["environment"].update(date=None), "environment.date"),
             ("date_int", lambda d: d["environment"].update(date=20261205), "environment.date"),
             ("copy_bytes", lambda d: d["copy"].pop("bytes"), "copy: expected a mapping with the numbers"),
             ("cols_text", row(cols="1024", tunable=None), "cols: expected a size >= 1, got '1024'"),
             ("cols_null", row(cols=None, tunable=None), "cols: expected a size >= 1, got None"),
             ("gbps_text", row(gbps="900"), "gbps: expected a number, got '900'"),
             ("extra_list", row(extra=[1]), "extra: expected a mapping"),
             ("extra_copy", row(extra={"copy_gbps": "4000"}), "extra.copy_gbps: expected a number"),
             ("extra_run", row(extra={"run": 5}), "extra.run: expected the run's date or label as text"),
             ("config_list", lambda d: d.update(config=["a"]), "config: expected a mapping"),
             ("e2e_ok_empty", lambda d: d.update(e2e=[{"model": "llama", "variant": "sdpa", "status": "ok"}]),
              "tokens_per_s: expected a number for a row that is ok")]
    for name, edit, match in cases:
        bad = edited(name, edit)
        with pytest.raises(SystemExit, match=match):
            main(["--report-only", good, bad, "--out", str(tmp_path / f"out_{name}"), "--no-tuning"])
        assert not (tmp_path / f"out_{name}").exists(), name
    # a tuning table that is not one: refused before anything is written, the table left as it is
    for i, text in enumerate(("[]", '{"rules": null}', "not json")):
        tdir = tmp_path / f"t{i}"
        tdir.mkdir()
        (tdir / "nvidia_h200.json").write_text(text)
        with pytest.raises(SystemExit, match="not a tuning table"):
            main(["--report-only", good, "--out", str(tmp_path / f"tout{i}"), "--tuning-dir", str(tdir)])
        assert not (tmp_path / f"tout{i}").exists() and (tdir / "nvidia_h200.json").read_text() == text
    # blank path options and --tuning-dir with --no-tuning: usage errors
    for args in (["--out", ""], ["--out", str(tmp_path / "o"), "--tuning-dir", " "],
                 ["--out", str(tmp_path / "o"), "--no-tuning", "--tuning-dir", str(tmp_path / "t")]):
        with pytest.raises(SystemExit) as e:
            main(["--report-only", good, *args])
        assert e.value.code == 2, args
    err = capsys.readouterr().err
    assert "expected a path, got an empty value" in err and "--tuning-dir: not with --no-tuning" in err
    # interrupted halfway (here: while plotting): the folder it made is gone, and the same merge runs again
    import benchmarks.plots

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(benchmarks.plots, "plot_all", interrupt)
    out = tmp_path / "interrupted"
    assert main(["--report-only", good, "--out", str(out), "--no-tuning"]) == 130
    assert "interrupted" in capsys.readouterr().err and not (out / "nvidia_h200_2026-12-01").exists()
    monkeypatch.undo()
    monkeypatch.setenv("PIPEGOOSE_STRICT", "")
    assert main(["--report-only", good, "--out", str(out), "--no-tuning"]) == 0
    # a failure after everything was written (a broken pipe in the summary, `| head`) keeps the finished merge and
    # its tuning table (it removed both before: a review); Ctrl-C there says the merge was complete
    import benchmarks.report

    import benchmarks.run

    log = benchmarks.run._log
    for exc, where in ((BrokenPipeError, "summary"), (KeyboardInterrupt, "summary"), (BrokenPipeError, "table")):
        def broken(*a, **k):
            raise exc()

        def broken_log(msg, *a, **k):   # the line that names the tuning table, printed after it was written
            if str(msg).startswith("tuning table:"):
                raise exc()
            return log(msg, *a, **k)

        if where == "summary":
            monkeypatch.setattr(benchmarks.report, "summary_lines", broken)
        else:
            monkeypatch.setattr(benchmarks.run, "_log", broken_log)
        done, tdir = tmp_path / f"done_{exc.__name__}_{where}", tmp_path / f"tdone_{exc.__name__}_{where}"
        if exc is KeyboardInterrupt:
            assert main(["--report-only", good, "--out", str(done), "--tuning-dir", str(tdir)]) == 130
            assert "the merge was complete" in capsys.readouterr().err
        else:
            with pytest.raises(BrokenPipeError):
                main(["--report-only", good, "--out", str(done), "--tuning-dir", str(tdir)])
        assert (done / "nvidia_h200_2026-12-01" / "results.json").exists(), exc
        assert (done / "nvidia_h200_2026-12-01" / "results.md").exists(), exc
        assert (tdir / "nvidia_h200.json").exists(), exc
        monkeypatch.undo()
        monkeypatch.setenv("PIPEGOOSE_STRICT", "")


def write_run(folder: Path, date: str, copy: dict, rows: list) -> str:
    """A results.json of one H200 run in ``folder`` (made), its rows' % of copy filled from ``copy``."""
    fill_pct(rows, copy["gbps"])
    folder.mkdir()
    write_json(folder / "results.json", {"gpu": "NVIDIA H200", "date": date, "device": "cuda"},
               {"command": f"run {folder.name}"}, copy, rows)
    return str(folder)


def test_report_only_keeps_each_rows_percent_of_its_own_runs_copy(tmp_path, monkeypatch):
    """--report-only recomputed every row's % of copy against the last run's copy bandwidth (a walkthrough: a row
    whose GB/s had not changed went from 5.45% to 8.73%). Each row now keeps its own run's copy figure."""
    monkeypatch.setenv("PIPEGOOSE_STRICT", "")
    from benchmarks.run import main

    runs = []
    for i, (gbps, cols) in enumerate(((4000.0, 512), (2000.0, 1024))):
        copy = {"bytes": 2 * 2**30, "gbps": gbps, "median_ms": 0.5}
        runs.append(write_run(tmp_path / f"run{i}", f"2026-11-2{i + 1}T10:00:00+00:00", copy, [m(cols=cols, ms=1.0)]))
    before = {x.cols: x.pct_of_copy for r in runs for x in load_json(Path(r) / "results.json")[1]}
    assert main(["--report-only", *runs, "--out", str(tmp_path / "out"), "--no-tuning"]) == 0
    _, back = load_json(tmp_path / "out" / "nvidia_h200_2026-11-22" / "results.json")
    assert {x.cols: x.pct_of_copy for x in back} == before
    assert {x.cols: x.extra["copy_gbps"] for x in back} == {512: 4000.0, 1024: 2000.0}
    # merged again (a merged file's copy is its last run's): the rows keep their own figures
    assert main(["--report-only", str(tmp_path / "out" / "nvidia_h200_2026-11-22"), "--out", str(tmp_path / "o2"),
                 "--no-tuning"]) == 0
    _, again = load_json(tmp_path / "o2" / "nvidia_h200_2026-11-22" / "results.json")
    assert {x.cols: x.pct_of_copy for x in again} == before
    # a results.json without a copy section keeps its stored % (a review: they were rescaled to the other run's copy);
    # a malformed copy section is one clear error
    bare = tmp_path / "bare"
    bare.mkdir()
    data = json.loads((Path(runs[0]) / "results.json").read_text())
    data["copy"] = None
    (bare / "results.json").write_text(json.dumps(data))
    assert main(["--report-only", str(bare), runs[1], "--out", str(tmp_path / "o3"), "--no-tuning"]) == 0
    _, mixed = load_json(tmp_path / "o3" / "nvidia_h200_2026-11-22" / "results.json")
    assert {x.cols: round(x.pct_of_copy, 9) for x in mixed} == {c: round(v, 9) for c, v in before.items()}
    data["copy"] = {"gbps": "4.2"}
    (bare / "results.json").write_text(json.dumps(data))
    with pytest.raises(SystemExit, match=r"--report-only: .*results.json: ValueError: copy: expected a mapping"):
        main(["--report-only", str(bare), "--out", str(tmp_path / "o4"), "--no-tuning"])


def test_rules_leave_out_timings_that_are_no_time_and_refuse_bad_sizes():
    """A walkthrough: a NaN median won when it came first (every comparison with NaN is False), a zero or negative one
    won outright, and a size that is not a number crashed the sort with a traceback. Such a time never wins; since
    the review of incomplete sweeps it is a row without a result: its group gives no rules (the earlier ones stay)."""
    from benchmarks.tuning import incomplete_groups

    for bad in (float("nan"), 0.0, -1.0, None):
        ms = [m(impl="torch", cols=512, ms=0.5), m(impl="pipegoose", cols=512, ms=1.0)]
        ms[0].median_ms = bad
        assert tuning_rules(ms) == [], bad
        assert list(incomplete_groups(ms)) == [("softmax.causal", "bfloat16", "fwd+bwd")], bad
    with pytest.raises(ValueError, match="cols: expected a size >= 1, got 'big'"):
        tuning_rules([m(cols=512), m(cols="big")])


def test_report_only_keeps_a_measurement_over_a_later_row_that_measured_nothing(tmp_path, monkeypatch):
    """A walkthrough: a later run where our kernel did not load (unavailable) or crashed (error) replaced the earlier
    run's timings, and the merged tuning table sent large softmaxes to the slow reference path. Such rows no longer
    hide a measurement; a later FAILED (a wrong result) still does. A table derived from results outside the repository
    is written beside them, not over the repository's."""
    monkeypatch.setenv("PIPEGOOSE_STRICT", "")
    from benchmarks.run import main
    from benchmarks.tuning import DEFAULT_TUNING_DIR

    copy = {"bytes": 2 * 2**30, "gbps": 4000.0, "median_ms": 0.5}
    runs = []
    for i, rows in enumerate(([m(impl="pipegoose", cols=4096, ms=1.0), m(impl="torch", cols=4096, ms=5.0)],
                              [m(impl="pipegoose", cols=4096, status="unavailable"),
                               m(impl="torch", cols=4096, status="error")])):
        runs.append(write_run(tmp_path / f"run{i}", f"2026-12-0{i + 1}T01:00:00+00:00", copy, rows))
    repo_table = DEFAULT_TUNING_DIR / "nvidia_h200.json"
    before = repo_table.read_bytes() if repo_table.exists() else None
    assert main(["--report-only", *runs, "--out", str(tmp_path / "out")]) == 0
    out = tmp_path / "out" / "nvidia_h200_2026-12-02"
    _, back = load_json(out / "results.json")
    assert {(x.impl, x.status) for x in back} == {("pipegoose", "ok"), ("torch", "ok")}
    table = json.loads((out / "tuning" / "nvidia_h200.json").read_text())
    assert [r["impl"] for r in table["rules"]] == ["pipegoose"] and table["benchmark"] == str(out / "results.json")
    assert (repo_table.read_bytes() if repo_table.exists() else None) == before


def test_report_only_names_the_impls_of_optimizer_rows_written_before_they_were_named(tmp_path, monkeypatch):
    """A review: optimizer rows of runs before session 46 carry no ``tunable``, and their ``pipegoose`` AdamW row timed
    FusedAdam's default of the day (the Apex copy). Merged with a run where our kernel did not load and torch's fused
    AdamW was skipped at a size, the old rows stood: torch_fused took no part in the choice there, the rule named Apex,
    and the old row passed for our kernel. Old rows are now read with their implementations named and the old
    ``pipegoose`` row as ``fused_adam``."""
    monkeypatch.setenv("PIPEGOOSE_STRICT", "")
    from benchmarks.run import main

    def opt(impl, ms=None, status="ok", tunable="same"):
        row = m(op="adamw", impl=impl, pas="step", cols=10**9, ms=ms or 1.0, status=status, tunable=tunable)
        row.shape = {"params": 10**9, "tensors": 200}
        return row

    old = [opt("torch_fused", 5.0, tunable=None), opt("apex", 9.6, tunable=None), opt("pipegoose", 10.0, tunable=None),
           opt("torch_foreach", 12.6, tunable=None)]
    new = [opt("torch_fused", status="skipped"), opt("pipegoose", status="unavailable"), opt("apex", 9.4),
           opt("fused_adam", status="skipped", tunable=None)]
    copy = {"bytes": 2 * 2**30, "gbps": 4000.0, "median_ms": 0.5}
    runs = [write_run(tmp_path / f"run{i}", f"2026-12-0{i + 1}T01:00:00+00:00", copy, rows)
            for i, rows in enumerate((old, new))]
    assert main(["--report-only", *runs, "--out", str(tmp_path / "out")]) == 0
    out = tmp_path / "out" / "nvidia_h200_2026-12-02"
    _, back = load_json(out / "results.json")
    got = {(x.impl, x.status, x.tunable, x.median_ms) for x in back}
    assert got == {("torch_fused", "ok", "torch_fused", 5.0), ("apex", "ok", "apex", 9.4),
                   ("fused_adam", "ok", None, 10.0), ("pipegoose", "unavailable", "pipegoose", None),
                   ("torch_foreach", "ok", "torch", 12.6)}
    table = json.loads((out / "tuning" / "nvidia_h200.json").read_text())
    assert [(r["op"], r["impl"]) for r in table["rules"]] == [("adam", "torch_fused")]


def test_optimizer_benchmark_impls_name_implementations_of_the_dispatchers_ops():
    """The optimizer rows' ``tunable`` names (benchmarks.optimizers.TUNABLE) must be implementations of the op their
    rules are for: a misspelt one would write rules the dispatcher skips."""
    from benchmarks.optimizers import ADAMW, CLIP, TUNABLE
    from benchmarks.tuning import RULE_OP
    from pipegoose.nn.fusion import dispatch

    for op, impls in TUNABLE.items():
        assert set(impls) <= set({"adamw": ADAMW, "clip_grad_norm": CLIP}[op])
        assert set(impls.values()) <= set(dispatch.implementations(RULE_OP.get(op, op))), op
    assert TUNABLE["adamw"]["pipegoose"] == "pipegoose" and TUNABLE["adamw"]["torch_foreach"] == "torch"
    assert "fused_adam" not in TUNABLE["adamw"]   # FusedAdam's own choice: a comparison, not an implementation
    assert TUNABLE["clip_grad_norm"]["pipegoose"] == "pipegoose" and "clip_grad_norm" not in TUNABLE["clip_grad_norm"]


def test_unclipped_clip_rows_give_no_tuning_rules():
    """The ``unclipped`` pass (gradients already within max_norm: ours skips its scaling pass) is shown, not tuned
    on: the rules come from ``step``, where every call clips."""
    rows = [m(op="clip_grad_norm", impl="torch_foreach", pas="step", cols=10**8, ms=1.0, tunable="torch"),
            m(op="clip_grad_norm", impl="pipegoose", pas="step", cols=10**8, ms=1.5),
            m(op="clip_grad_norm", impl="pipegoose", pas="unclipped", cols=10**8, ms=0.1),
            m(op="clip_grad_norm", impl="torch_foreach", pas="unclipped", cols=10**8, ms=1.0, tunable="torch")]
    assert [(r["op"], r["pass"], r["impl"]) for r in tuning_rules(rows)] == [("clip_grad_norm", None, "torch")]


def test_old_clip_rows_named_pipegoose_are_read_as_the_dispatchers_choice():
    """Before session 53 the clip_grad_norm row ``pipegoose`` timed ``clip_grad_norm_()`` (the dispatcher's choice:
    torch's foreach path or the Apex copy); from session 53 ``pipegoose`` is our kernel. An old row is read as
    ``clip_grad_norm``, so that it cannot pass for our kernel; a new row is left as it is."""
    from benchmarks.optimizers import upgrade_row

    old = m(op="clip_grad_norm", impl="pipegoose", pas="step", cols=10**8, ms=1.0, tunable=None)
    upgrade_row(old)
    assert (old.impl, old.tunable) == ("clip_grad_norm", None)
    upgrade_row(old)   # read again by a later merge: unchanged
    assert (old.impl, old.tunable) == ("clip_grad_norm", None)
    new = m(op="clip_grad_norm", impl="pipegoose", pas="step", cols=10**8, ms=1.0, tunable="pipegoose")
    upgrade_row(new)
    assert (new.impl, new.tunable) == ("pipegoose", "pipegoose")
    foreach = m(op="clip_grad_norm", impl="torch_foreach", pas="step", cols=10**8, ms=1.0, tunable=None)
    upgrade_row(foreach)
    assert (foreach.impl, foreach.tunable) == ("torch_foreach", "torch")


def test_summary_end_to_end_columns_line_up():
    """A walkthrough: liger_rmsnorm, wider than the variant column, put its row's status a column out of line."""
    rows = [{"model": "qwen3", "variant": v, "status": "ok", "tokens_per_s": 1.0} for v in ("sdpa", "liger_rmsnorm")]
    lines = [x for x in summary_lines([], None, rows) if x.startswith("e2e")]
    assert len({x.index(" ok ") for x in lines}) == 1, lines


def test_a_run_refuses_a_tuning_table_that_is_not_one_before_measuring(tmp_path, monkeypatch, capsys):
    """The check of the merge, at the start of a run: a table that is not one failed the run at its end."""
    monkeypatch.setenv("PIPEGOOSE_STRICT", "")
    from benchmarks.run import main

    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "cpu_x86_64_dry_run.json").write_text("[]")
    monkeypatch.setattr("benchmarks.run.environment", lambda device: {"gpu": "cpu x86_64 (dry run)",
                                                                      "date": "2026-12-04T00:00:00+00:00"})
    assert main(["--device", "cpu", "--dry-run", "--no-build", "--out", str(tmp_path / "o"),
                 "--tuning-dir", str(tmp_path / "t")]) == 2
    assert "not a tuning table" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_a_run_of_some_impls_writes_no_tuning_table(tmp_path, monkeypatch, capsys):
    """A review: ``--impls torch_foreach`` wrote the tuning table from a comparison of one impl, whose rule replaced the
    faster torch_fused's. ``--impls`` implies ``--no-tuning`` (as ``--sizes`` does) and is refused with
    ``--tuning-dir``."""
    monkeypatch.setenv("PIPEGOOSE_STRICT", "")
    from benchmarks.run import main, parse_args

    assert parse_args(["--impls", "torch_foreach"]).no_tuning and not parse_args([]).no_tuning
    with pytest.raises(SystemExit):
        parse_args(["--impls", "torch", "--tuning-dir", str(tmp_path / "t")])
    assert "--impls: a run of some impls does not write a tuning table" in capsys.readouterr().err
    # (a CPU dry run's table goes into its run folder: none there)
    assert main(["--device", "cpu", "--dry-run", "--no-build", "--only", "adamw", "--dtypes", "fp32",
                 "--impls", "torch_foreach", "--out", str(tmp_path / "o")]) == 0
    assert list((tmp_path / "o").rglob("results.json")) and not list((tmp_path / "o").rglob("tuning"))


def test_the_packed_swiglu_is_chosen_on_the_command_line_and_timed_beside_swiglu(tmp_path, monkeypatch, capsys):
    """``--only swiglu,swiglu.packed`` runs both SwiGLUs in one run (the sizes, dtypes and impls of each), every row with
    its op's minimum bytes, GB/s and % of copy, and the tuning table gets the rules of both, which the dispatcher
    reads; the default run has the packed one too, and ``--sizes`` and ``--impls`` take it."""
    monkeypatch.setenv("PIPEGOOSE_STRICT", "1")   # (as a run sets it; monkeypatched, it goes after the test)
    from benchmarks.byte_counts import op_bytes
    from benchmarks.ops import shape_for
    from benchmarks.run import main, parse_args
    from benchmarks.tuning import TUNING_OPS
    from pipegoose.nn.fusion.dispatch import TuningTable

    assert "swiglu.packed" in TUNING_OPS
    a = parse_args(["--only", "swiglu,swiglu.packed", "--dtypes", "bf16"])
    assert a.ops == ["swiglu", "swiglu.packed"] and a.dtype_names == ["bfloat16"] and a.mode == "full"
    assert not a.no_tuning and a.size_filter is None and not a.no_ops
    assert parse_args(["--only", "swiglu.packed"]).ops == ["swiglu.packed"]
    assert "swiglu.packed" in parse_args([]).ops
    a = parse_args(["--only", "swiglu,swiglu.packed", "--sizes", "5632,28672"])
    assert a.size_filter == [5632, 28672] and a.no_tuning
    assert parse_args(["--only", "swiglu.packed", "--impls", "liger,compile,eager"]).no_tuning
    for argv, said in ((["--only", "swiglu.pack"], "--only: unknown op 'swiglu.pack'"),
                       (["--only", "swiglu.packed", "--impls", "native"], "implement none of the ops run"),
                       (["--only", "swiglu.packed", "--sizes", "8192"], "not among the full sizes of swiglu.packed")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert said in capsys.readouterr().err, argv
    assert main(["--device", "cpu", "--dry-run", "--no-build", "--only", "swiglu,swiglu.packed", "--dtypes",
                 "fp32,bf16", "--out", str(tmp_path / "o")]) == 0
    run = next((tmp_path / "o").glob("cpu_dry_run_*"))
    data, rows = load_json(run / "results.json")
    assert data["config"]["ops"] == ["swiglu", "swiglu.packed"]
    packed = [r for r in rows if r.op == "swiglu.packed"]
    want = {(i, d, p, c) for i in ("eager", "liger", "torch", "pipegoose") for d in ("float32", "bfloat16")
            for p in ("fwd", "bwd", "fwd+bwd") for c in (16, 64)}   # (no compile on the CPU)
    assert {(r.impl, r.dtype, r.pas, r.cols) for r in packed} == want
    assert {(r.impl, r.dtype, r.pas, r.cols) for r in rows if r.op == "swiglu"} == want
    ok = [r for r in packed if r.status == "ok"]
    assert {r.impl for r in ok} == {"eager", "torch"}   # (pipegoose: no kernel on the CPU; liger: not installed)
    for r in ok:
        assert r.shape == shape_for("swiglu", r.cols, "cpu") and set(r.shape) == {"rows", "inter"}
        assert r.bytes == op_bytes("swiglu.packed", r.pas, r.shape, r.dtype) == op_bytes("swiglu", r.pas, r.shape,
                                                                                          r.dtype)
        assert r.gbps == pytest.approx(r.bytes / (r.median_ms * 1e-3) / 1e9)
        assert r.pct_of_copy == pytest.approx(100 * r.gbps / data["copy"]["gbps"])
    assert "## swiglu.packed — bfloat16" in (run / "results.md").read_text()
    (table,) = (run / "tuning").glob("*.json")
    rules = json.loads(table.read_text())["rules"]
    assert {(r["op"], r["dtype"], r["pass"]) for r in rules} == {
        (op, d, p) for op in ("swiglu", "swiglu.packed") for d in ("float32", "bfloat16") for p in ("fwd", "fwd+bwd")}
    assert [r.op for r in TuningTable.load(table).rules].count("swiglu.packed") == 4


def test_geglu_runs_beside_swiglu_through_the_cli_with_swiglus_bytes(tmp_path, monkeypatch, capsys):
    """``--only geglu`` selects the GeGLU sweep (and ``--only swiglu,geglu`` both, side by side); a CPU dry run writes
    its rows (the impls of swiglu, swiglu's shapes and bytes) and its results.md section; the tuning table gets geglu's
    rules where the dispatcher has the op (its torch path is timed on the CPU), none where it has not (the rows of ours
    are unavailable then: no rules for an op the dispatcher would refuse the table over)."""
    monkeypatch.setenv("PIPEGOOSE_STRICT", "1")   # (as a run sets it; monkeypatched, it goes after the test)
    from benchmarks.byte_counts import op_bytes
    from benchmarks.ops import shape_for
    from benchmarks.run import main, parse_args
    from pipegoose.nn.fusion import functional as PF

    assert parse_args(["--only", "geglu"]).ops == ["geglu"]
    a = parse_args(["--only", "swiglu,geglu", "--dtypes", "bf16"])
    assert a.ops == ["swiglu", "geglu"] and a.dtype_names == ["bfloat16"] and not a.no_tuning
    assert "geglu" in parse_args([]).ops
    assert parse_args(["--only", "geglu", "--sizes", "14336"]).size_filter == [14336]
    for argv, said in ((["--only", "gelu_new"], "--only: unknown op 'gelu_new'"),
                       (["--only", "geglu", "--impls", "native"], "implement none of the ops run"),
                       (["--only", "geglu", "--sizes", "8192"], "not among the full sizes of geglu")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert said in capsys.readouterr().err, argv
    assert main(["--device", "cpu", "--dry-run", "--no-build", "--only", "swiglu,geglu", "--dtypes", "fp32",
                 "--out", str(tmp_path / "o")]) == 0
    run = next((tmp_path / "o").glob("cpu_dry_run_*"))
    data, rows = load_json(run / "results.json")
    assert data["config"]["ops"] == ["swiglu", "geglu"]
    geglu = [r for r in rows if r.op == "geglu"]
    assert {(r.impl, r.dtype, r.pas, r.cols) for r in geglu} == {
        (i, "float32", p, c) for i in ("eager", "liger", "torch", "pipegoose") for p in ("fwd", "bwd", "fwd+bwd")
        for c in (16, 64)}   # (no compile on the CPU)
    merged = hasattr(PF, "geglu")
    ok = [r for r in geglu if r.status == "ok"]
    assert {r.impl for r in ok} == ({"eager", "torch"} if merged else {"eager"})
    if not merged:
        assert {r.status for r in geglu if r.impl in ("torch", "pipegoose")} == {"unavailable"}
    for r in ok:
        assert r.shape == shape_for("swiglu", r.cols, "cpu") and set(r.shape) == {"rows", "inter"}
        assert r.bytes == op_bytes("geglu", r.pas, r.shape, r.dtype) == op_bytes("swiglu", r.pas, r.shape, r.dtype)
        assert r.gbps == pytest.approx(r.bytes / (r.median_ms * 1e-3) / 1e9)
    assert "## geglu — float32" in (run / "results.md").read_text()
    (table,) = (run / "tuning").glob("*.json")
    rules = json.loads(table.read_text())["rules"]
    assert {(r["op"], r["pass"]) for r in rules if r["op"] == "geglu"} == (
        {("geglu", "fwd"), ("geglu", "fwd+bwd")} if merged else set())
    assert {(r["op"], r["pass"]) for r in rules if r["op"] == "swiglu"} == {("swiglu", "fwd"), ("swiglu", "fwd+bwd")}


def test_the_benchmarks_time_every_op_the_tuning_table_takes_but_the_linear_loss():
    """docs/architecture.md "Tuning tables": benchmarks/ writes rules for every op a table may name but
    ``fused_linear_cross_entropy`` and ``rms_norm_gated`` (timed by their own benchmarks, without rules) (``TUNING_OPS``;
    it left out ``swiglu.packed``, an op of the dispatcher since silu_and_mul came). Each such op of the dispatcher is
    an op of the sweep, or an optimizer's."""
    from benchmarks.ops import OPS
    from benchmarks.tuning import RULE_OP, STEP_OPS, TUNING_OPS
    from pipegoose.nn.fusion import dispatch

    dispatch._ensure_builtin_ops()
    ours = {op for op in dispatch._impls   # (not the ops other tests register)
            if all(im.supports.__module__.startswith("pipegoose.") for im in dispatch.implementations(op).values())}
    table_ops = ours | set(dispatch._TABLE_ONLY_OPS)
    # geglu: swept before its dispatcher op is merged (its rows of ours are unavailable then, and give no rules);
    # with the op in the dispatcher, the sets are equal with it
    pending = {"geglu"} - set(dispatch._impls)
    assert {RULE_OP.get(op, op) for op in TUNING_OPS} - pending == table_ops - {"fused_linear_cross_entropy",
                                                                                 "rms_norm_gated"}
    assert "geglu" in TUNING_OPS
    assert set(TUNING_OPS) - {"attention"} == set(OPS) | set(STEP_OPS)


def test_a_table_the_dispatcher_would_refuse_is_refused_before_measuring_and_never_written_back(tmp_path, monkeypatch,
                                                                                               capsys):
    """A review: read_rules checked the JSON's shape alone, so a kept rule of dtype ``bf16`` (or a misspelt field, an
    unknown op or impl) was written back beside the new rules, and the dispatcher then ignored the whole table. The
    check is the dispatcher's parse: a run refuses the table before measuring, the writer before writing."""
    monkeypatch.setenv("PIPEGOOSE_STRICT", "")
    from benchmarks.run import main
    from benchmarks.tuning import read_rules

    bad_rules = ({"op": "layer_norm", "dtype": "bf16", "pass": "fwd", "max_cols": None, "impl": "torch"},
                 {"op": "layer_norm", "dtype": "bfloat16", "pass": "fwd", "max_col": 1024, "impl": "torch"},
                 {"op": "layer_norm", "dtype": "bfloat16", "pass": "fwd", "max_cols": None, "impl": "sdpa"})
    for i, rule in enumerate(bad_rules):
        t = tmp_path / f"t{i}"
        t.mkdir()
        table = t / "nvidia_h200.json"
        table.write_text(json.dumps({"device": "NVIDIA H200", "rules": [rule]}))
        before = table.read_bytes()
        field = ("dtype", "max_col", "impl")[i]
        with pytest.raises(ValueError, match=rf"^{re.escape(str(table))}: not a tuning table the dispatcher reads "
                                             rf"\(rules\[0\]\.{field}: .*\): mend or remove it$"):
            read_rules(table)
        with pytest.raises(ValueError, match=rf"rules\[0\]\.{field}"):
            write_tuning_table("NVIDIA H200", "2026-12-04", "x", [m(op="layer_norm", pas="fwd")], t)
        assert table.read_bytes() == before
        (t / "cpu_x86_64_dry_run.json").write_text(json.dumps({"device": "cpu", "rules": [rule]}))
        monkeypatch.setattr("benchmarks.run.environment", lambda device: {"gpu": "cpu x86_64 (dry run)",
                                                                          "date": "2026-12-04T00:00:00+00:00"})
        assert main(["--device", "cpu", "--dry-run", "--no-build", "--out", str(tmp_path / f"o{i}"),
                     "--tuning-dir", str(t)]) == 2
        err = capsys.readouterr().err
        assert f"rules[0].{field}" in err and not (tmp_path / f"o{i}").exists(), err


def test_report_only_reads_back_the_infinite_errors_a_run_writes(tmp_path, monkeypatch):
    """A FAILED row whose error is infinite (a clip, say) is written as "inf" (JSON has no infinity); the merge's
    checks refused it as "expected a number" (a review). It is read back as a float and kept."""
    monkeypatch.setenv("PIPEGOOSE_STRICT", "")
    from benchmarks.run import main

    bad = m(impl="megatron", status="FAILED")
    bad.max_abs_err = float("inf")
    run = write_run(tmp_path / "run", "2026-12-01T01:00:00+00:00", {"bytes": 2 * 2**30, "gbps": 4000.0,
                                                                   "median_ms": 0.5}, [m(), bad])
    assert json.loads((Path(run) / "results.json").read_text())["measurements"][1]["max_abs_err"] == "inf"
    assert load_json(Path(run) / "results.json")[1][1].max_abs_err == float("inf")
    assert main(["--report-only", run, "--out", str(tmp_path / "out"), "--no-tuning"]) == 0
    out = tmp_path / "out" / "nvidia_h200_2026-12-01" / "results.json"
    assert [x.max_abs_err for x in load_json(out)[1] if x.impl == "megatron"] == [float("inf")]


def test_results_md_tells_optimizer_sizes_under_a_million_apart(tmp_path):
    """A walkthrough: the CPU dry run's optimizer sizes (about 63k and 200k parameters) were both "0M params"."""
    ms = [Measurement(op="adamw", impl="torch_fused", dtype="float32", pas="step", shape={"params": n}, cols=n,
                      status="ok", bytes=28 * n, median_ms=1.0, gbps=1.0) for n in (63_000, 200_000, 10**8)]
    copy = {"bytes": 2 * 2**30, "gbps": 4000.0, "median_ms": 0.5}
    md = write_markdown(tmp_path / "results.md", {"gpu": "cpu", "date": "2026-12-04T00:00:00+00:00"}, {}, copy,
                        ms).read_text()
    assert "| 63000 params |" in md and "| 200000 params |" in md and "| 100M params |" in md


@pytest.mark.parametrize("module", ["run", "rope_partial", "linear_cross_entropy", "norm_raw", "softmax_raw",
                                    "paired_steps", "overhead", "build_cost"])
def test_every_benchmark_cli_answers_help(module):
    """A walkthrough (session 61): `python -m benchmarks.build_cost --help` was its usage error, exit 2, where every
    other benchmark CLI prints its help and exits 0."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--help"], capture_output=True, text=True,
                       cwd=_bench_path.ROOT, timeout=120)
    assert p.returncode == 0 and "usage:" in p.stdout, p.stdout + p.stderr


def test_report_only_records_each_merged_runs_environment(tmp_path, monkeypatch, capsys):
    """A review: a merge kept only one run's environment (torch, triton, transformers, Liger, git versions, date), so
    rows measured under other versions were labelled with the wrong ones. Each run's date and versions are now in
    results.json's "runs" and, where they differ, in results.md; the merge's environment is its newest run's."""
    monkeypatch.setenv("PIPEGOOSE_STRICT", "")
    from benchmarks.run import main

    copy = {"bytes": 2 * 2**30, "gbps": 4000.0, "median_ms": 0.5}

    def run(name, date, torch_version, rows):
        d = tmp_path / name
        d.mkdir()
        fill_pct(rows, copy["gbps"])
        env = {"gpu": "NVIDIA H200", "date": date, "device": "cuda", "torch": torch_version, "triton": "3.5.0",
               "pipegoose_git": f"git-{name}"}
        write_json(d / "results.json", env, {"command": name}, copy, rows)
        return str(d)

    new = run("new", "2026-12-02T01:00:00+00:00", "2.10.0", [m(cols=1024, ms=0.5)])
    old = run("old", "2026-11-20T01:00:00+00:00", "2.9.0", [m(cols=512)])
    out = tmp_path / "out"
    assert main(["--report-only", new, old, "--out", str(out), "--no-tuning"]) == 0
    folder = out / "nvidia_h200_2026-12-02"   # the newest run's date, whatever the order of the arguments
    data, back = load_json(folder / "results.json")
    assert data["environment"]["date"] == "2026-12-02T01:00:00+00:00" and data["environment"]["torch"] == "2.10.0"
    assert [(r["run"], r["date"], r["torch"], r["triton"], r["pipegoose_git"], r["results"]) for r in data["runs"]] == [
        ("2026-11-20", "2026-11-20T01:00:00+00:00", "2.9.0", "3.5.0", "git-old", f"{old}/results.json"),
        ("2026-12-02", "2026-12-02T01:00:00+00:00", "2.10.0", "3.5.0", "git-new", f"{new}/results.json")]
    # each row's run names its entry of "runs"
    by_run = {r["run"]: r for r in data["runs"]}
    assert {x.cols: by_run[x.extra["run"]]["torch"] for x in back} == {512: "2.9.0", 1024: "2.10.0"}
    md = (folder / "results.md").read_text()
    assert "# pipegoose benchmarks: NVIDIA H200 (2026-12-02)" in md
    assert "| run | date | torch | pipegoose_git |" in md   # the versions that differ (triton does not)
    assert "| 2026-11-20 | 2026-11-20T01:00:00+00:00 | 2.9.0 | git-old |" in md
    assert "| 2026-12-02 | 2026-12-02T01:00:00+00:00 | 2.10.0 | git-new |" in md
    # merged again with a newer run (and one of its runs again): every run once, the newest the environment
    newer = run("newer", "2026-12-05T01:00:00+00:00", "2.10.0", [m(cols=2048)])
    assert main(["--report-only", str(folder), old, newer, "--out", str(tmp_path / "again"), "--no-tuning"]) == 0
    data, _ = load_json(tmp_path / "again" / "nvidia_h200_2026-12-05" / "results.json")
    assert [r["pipegoose_git"] for r in data["runs"]] == ["git-old", "git-new", "git-newer"]
    assert data["environment"]["pipegoose_git"] == "git-newer"
    # A review: a merged file sorts by its newest run, so its older rows came after a separately given run of a day
    # between, and replaced that run's newer rows. Merge (2026-11-20 and 2026-12-02) with 2026-11-25's row of the
    # same key as the 2026-11-20 one: 2026-11-25's measurement wins, whatever the order.
    mid = run("mid", "2026-11-25T01:00:00+00:00", "2.9.5", [m(cols=512, ms=0.25)])
    for order in ((str(folder), mid), (mid, str(folder))):
        dest = tmp_path / f"mid_{order[0] == mid}"
        assert main(["--report-only", *order, "--out", str(dest), "--no-tuning"]) == 0
        _, rows = load_json(dest / "nvidia_h200_2026-12-02" / "results.json")
        row = next(x for x in rows if x.cols == 512)
        assert (row.extra["run"], row.median_ms) == ("2026-11-25", 0.25), order
    # runs of the same versions: one line says so
    same = run("same", "2026-12-06T01:00:00+00:00", "2.10.0", [m(cols=4096)])
    data = json.loads((Path(same) / "results.json").read_text())
    data["environment"]["pipegoose_git"] = "git-newer"
    (Path(same) / "results.json").write_text(json.dumps(data))
    assert main(["--report-only", newer, same, "--out", str(tmp_path / "same_out"), "--no-tuning"]) == 0
    md = (tmp_path / "same_out" / "nvidia_h200_2026-12-06" / "results.md").read_text()
    assert "Merged from 2 runs of the same versions" in md and "| run | date |" not in md
    # a "runs" that is not a list of dated runs: a clear error before anything is written
    data["runs"] = [{"date": "yesterday"}]
    (Path(same) / "results.json").write_text(json.dumps(data))
    with pytest.raises(SystemExit, match=r"runs\[0\]: expected a mapping with an ISO 8601 date"):
        main(["--report-only", same, "--out", str(tmp_path / "bad_out"), "--no-tuning"])
    assert not (tmp_path / "bad_out").exists()


def test_squared_relu_runs_through_the_cli_with_gelus_bytes_and_impls(tmp_path, monkeypatch, capsys):
    """``--only squared_relu`` selects the squared-ReLU sweep (relu2 alone); a CPU dry run writes its rows (eager,
    torch, pipegoose: no native, Liger, Apex or Megatron; gelu's shapes and bytes), its results.md section and, where
    the dispatcher has the op, its tuning rules (its torch path is timed on the CPU; our kernel is declined there)."""
    monkeypatch.setenv("PIPEGOOSE_STRICT", "1")   # (as a run sets it; monkeypatched, it goes after the test)
    from benchmarks.byte_counts import op_bytes
    from benchmarks.ops import shape_for
    from benchmarks.run import OP_NAMES, main, parse_args
    from benchmarks.tuning import TUNING_OPS
    from pipegoose.nn.fusion import functional as PF

    assert "squared_relu" in TUNING_OPS and OP_NAMES.index("squared_relu") == OP_NAMES.index("gelu") + 1
    assert parse_args(["--only", "squared_relu"]).ops == ["squared_relu"]
    assert parse_args(["--only", "gelu,squared_relu"]).ops == ["gelu", "squared_relu"]
    assert "squared_relu" in parse_args([]).ops
    for argv, said in ((["--only", "relu2"], "--only: unknown op 'relu2'"),
                       (["--only", "squared_relu", "--impls", "native,liger"], "implement none of the ops run")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert said in capsys.readouterr().err, argv
    assert main(["--device", "cpu", "--dry-run", "--no-build", "--no-compile", "--only", "squared_relu", "--dtypes",
                 "fp32", "--out", str(tmp_path / "o")]) == 0
    run = next((tmp_path / "o").glob("cpu_dry_run_*"))
    data, rows = load_json(run / "results.json")
    assert data["config"]["ops"] == ["squared_relu"] and {r.op for r in rows} == {"squared_relu"}
    assert {(r.impl, r.dtype, r.pas, r.cols) for r in rows} == {
        (i, "float32", p, c) for i in ("eager", "torch", "pipegoose") for p in ("fwd", "bwd", "fwd+bwd")
        for c in (16, 64)}   # (no compile: --no-compile)
    merged = hasattr(PF, "squared_relu")
    ok = [r for r in rows if r.status == "ok"]
    assert {r.impl for r in ok} == ({"eager", "torch"} if merged else {"eager"})
    assert {r.status for r in rows if r.impl == "pipegoose"} == ({"unsupported"} if merged else {"unavailable"})
    for r in ok:
        assert r.shape == shape_for("gelu", r.cols, "cpu") and set(r.shape) == {"rows", "inter"}
        assert r.bytes == op_bytes("squared_relu", r.pas, r.shape, r.dtype) == op_bytes("gelu", r.pas, r.shape,
                                                                                          r.dtype)
    assert "## squared_relu — float32" in (run / "results.md").read_text()
    (table,) = (run / "tuning").glob("*.json")
    rules = json.loads(table.read_text())["rules"]
    assert {(r["op"], r["pass"]) for r in rules} == (
        {("squared_relu", "fwd"), ("squared_relu", "fwd+bwd")} if merged else set())
