"""CPU: the dispatcher's choice logic with fake implementations (no kernel, no GPU)."""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path

import pytest
import torch

from pipegoose.nn.fusion import dispatch
from pipegoose.nn.fusion.dispatch import (Choice, FusionFallbackError, Implementation, Problem, TuningTable,
                                          TuningTableError)

OP = "fake.op"


def problem(dtype=torch.float16, cols=64, needs_grad=True, **extra):
    base = dict(ours=True, ported=True)
    base.update(extra)
    return Problem(OP, dtype, torch.device("cpu"), cols, needs_grad, base)


@pytest.fixture(autouse=True)
def fake_op(monkeypatch, tmp_path):
    for var in ("PIPEGOOSE_STRICT", "PIPEGOOSE_IMPL_FAKE_OP", "PIPEGOOSE_IMPL_FAKE"):
        monkeypatch.delenv(var, raising=False)
    dispatch.register(Implementation(OP, "torch", "reference", lambda p: (True, "")))
    dispatch.register(Implementation(OP, "megatron", "ported",
                                     lambda p: (p["ported"], "" if p["ported"] else "ported says no")))
    dispatch.register(Implementation(OP, "pipegoose", "ours",
                                     lambda p: (p["ours"], "" if p["ours"] else "ours says no")))
    dispatch.register_problem(OP, lambda x, ours=True, ported=True: Problem(
        OP, x.dtype, x.device, x.shape[-1], x.requires_grad, dict(ours=ours, ported=ported)))
    monkeypatch.setattr(dispatch, "TUNING_DIR", tmp_path)
    dispatch.clear_tuning_cache()
    dispatch.reset_stats()
    yield
    dispatch.unregister(OP)
    dispatch.clear_tuning_cache()
    dispatch.clear_kernel_cache()


def test_builtin_order_ours_then_ported_then_torch():
    assert list(dispatch.implementations(OP)) == ["pipegoose", "megatron", "torch"]
    assert dispatch.select(OP, problem()).impl == "pipegoose"
    c = dispatch.select(OP, problem(ours=False))
    assert (c.impl, c.source, c.fallback) == ("megatron", "builtin", False)
    assert c.reasons["pipegoose"] == "ours says no"
    c = dispatch.select(OP, problem(ours=False, ported=False))
    assert (c.impl, c.source, c.fallback) == ("torch", "fallback", True)
    assert "ours says no" in c.reason and "ported says no" in c.reason
    assert dispatch.stats()[OP] == {"pipegoose": 1, "megatron": 1, "torch": 1}
    assert dispatch.last_choice(OP) == c
    dispatch.reset_stats()
    assert dispatch.stats() == {} and dispatch.last_choice(OP) is None


def test_explicit_argument_beats_env(monkeypatch):
    monkeypatch.setenv("PIPEGOOSE_IMPL_FAKE_OP", "megatron")
    assert dispatch.select(OP, problem()).impl == "megatron"
    assert dispatch.select(OP, problem()).source == "env"
    c = dispatch.select(OP, problem(), impl="torch")
    assert (c.impl, c.source, c.fallback) == ("torch", "argument", False)


def test_family_env_and_auto(monkeypatch):
    monkeypatch.setenv("PIPEGOOSE_IMPL_FAKE", "torch")
    c = dispatch.select(OP, problem())
    assert (c.impl, c.source, c.fallback) == ("torch", "env", False)
    # op-level auto: this op chooses automatically whatever its family asks (a walkthrough: it fell through to the
    # family's request, so that no op of a family could be exempted from it)
    monkeypatch.setenv("PIPEGOOSE_IMPL_FAKE_OP", "auto")
    assert dispatch.select(OP, problem()).source not in ("env", "argument")
    monkeypatch.setenv("PIPEGOOSE_IMPL_FAKE_OP", " ")  # empty or blank: unset, the family applies
    assert dispatch.select(OP, problem()).impl == "torch"
    monkeypatch.setenv("PIPEGOOSE_IMPL_FAKE_OP", "pipegoose")  # op-level beats family
    assert dispatch.select(OP, problem()).impl == "pipegoose"


def test_unsupported_request_falls_through_with_reason(caplog):
    with caplog.at_level(logging.DEBUG, logger="pipegoose.nn.fusion.dispatch"):
        with pytest.warns(UserWarning, match="fake.op: impl='megatron' cannot run this input: ported says no; "
                                             "running pipegoose \\(builtin\\) instead"):
            c = dispatch.select(OP, problem(ported=False), impl="megatron")
    assert (c.impl, c.source) == ("pipegoose", "builtin")
    assert c.reasons["megatron"] == "ported says no"
    assert c.unmet == "impl='megatron' cannot run this input: ported says no"
    assert "megatron" in caplog.text and "ported says no" in caplog.text


def test_unmet_env_request_warns_and_met_requests_do_not(monkeypatch, recwarn):
    monkeypatch.setenv("PIPEGOOSE_IMPL_FAKE_OP", "pipegoose")
    c = dispatch.select(OP, problem())
    assert (c.impl, c.source, c.unmet) == ("pipegoose", "env", "")
    assert not [w for w in recwarn if "cannot run" in str(w.message)]
    with pytest.warns(UserWarning, match="PIPEGOOSE_IMPL_FAKE_OP='pipegoose' cannot run this input: ours says no; "
                                         "running megatron \\(builtin\\) instead"):
        dispatch.select(OP, problem(ours=False))
    recwarn.clear()
    dispatch.select(OP, problem(ours=False))  # the same request, reason and choice: warned once already
    assert not [w for w in recwarn if "cannot run" in str(w.message)]


def test_unmet_request_by_argument_and_variable_gives_the_reason_once(monkeypatch):
    """The same implementation asked by impl= and by the variable gave its reason twice (session 34's walkthrough)."""
    monkeypatch.setenv("PIPEGOOSE_IMPL_FAKE_OP", "megatron")
    with pytest.warns(UserWarning, match="cannot run this input"):
        c = dispatch.select(OP, problem(ported=False), impl="megatron")
    assert c.unmet == "impl='megatron' and PIPEGOOSE_IMPL_FAKE_OP='megatron' cannot run this input: ported says no"
    monkeypatch.setenv("PIPEGOOSE_IMPL_FAKE_OP", "pipegoose")  # two implementations: a clause each
    with pytest.warns(UserWarning, match="cannot run this input"):
        c = dispatch.select(OP, problem(ported=False, ours=False), impl="megatron")
    assert c.unmet == ("impl='megatron' cannot run this input: ported says no; "
                       "PIPEGOOSE_IMPL_FAKE_OP='pipegoose' cannot run this input: ours says no")


def test_fallback_is_logged(caplog):
    with caplog.at_level(logging.DEBUG, logger="pipegoose.nn.fusion.dispatch"):
        dispatch.select(OP, problem(ours=False, ported=False))
    assert "falling back to torch" in caplog.text


def test_unknown_names_are_errors(monkeypatch):
    with pytest.raises(ValueError, match="impl.*'nope'.*pipegoose, megatron, torch"):
        dispatch.select(OP, problem(), impl="nope")
    monkeypatch.setenv("PIPEGOOSE_IMPL_FAKE_OP", "apex")
    with pytest.raises(ValueError, match="PIPEGOOSE_IMPL_FAKE_OP"):
        dispatch.select(OP, problem())
    with pytest.raises(KeyError, match="no.such"):
        dispatch.implementations("no.such")


def test_strict_mode(monkeypatch):
    with dispatch.strict():
        assert dispatch.select(OP, problem(ours=False)).impl == "megatron"  # not a fallback
        assert dispatch.select(OP, problem(ours=False, ported=False), impl="torch").impl == "torch"  # asked for
        with pytest.raises(FusionFallbackError, match=r"fake\.op.*ours says no"):
            dispatch.select(OP, problem(ours=False, ported=False))
    dispatch.select(OP, problem(ours=False, ported=False))  # no longer strict
    monkeypatch.setenv("PIPEGOOSE_STRICT", "1")
    assert dispatch.is_strict()
    with pytest.raises(FusionFallbackError):
        dispatch.select(OP, problem(ours=False, ported=False))
    with dispatch.strict(False):
        assert dispatch.select(OP, problem(ours=False, ported=False)).impl == "torch"
    # a raising call is not counted
    assert dispatch.stats()[OP] == {"megatron": 1, "torch": 3}
    # a walkthrough found strict("no") turning strict mode on (bool("no")): anything but a bool is a TypeError
    for bad in ("no", 0, None):
        with pytest.raises(TypeError, match=r"enabled: expected True or False, got "):
            with dispatch.strict(bad):
                pass


@pytest.mark.parametrize("value", ["2", "enabled", "y", "strict"])
def test_unrecognised_strict_value_is_an_error(monkeypatch, value):
    """An unrecognised PIPEGOOSE_STRICT used to mean off, silently (a user who wrote =2 or =enabled got no strict
    mode); it is a ValueError naming the variable, the value and the accepted values, like a bad PIPEGOOSE_IMPL_*."""
    monkeypatch.setenv("PIPEGOOSE_STRICT", value)
    accepted = r"1, true, yes or on .*0, false, no, off or empty"
    with pytest.raises(ValueError, match=rf"PIPEGOOSE_STRICT='{value}': expected {accepted}"):
        dispatch.is_strict()
    with pytest.raises(ValueError, match="PIPEGOOSE_STRICT"):
        dispatch.select(OP, problem())                            # a call that chooses, no fallback
    with pytest.raises(ValueError, match="PIPEGOOSE_STRICT"):
        dispatch.record(Choice(OP, "torch", "fallback", True, {}, "ours says no"))  # a fallback (a cached choice)
    with dispatch.strict(False):                                  # the context overrides the variable
        assert dispatch.select(OP, problem(ours=False, ported=False)).impl == "torch"
    for good, on in (("1", True), (" On ", True), ("YES", True), ("true", True), ("0", False), ("off", False),
                     ("No", False), ("false", False), ("", False), ("  ", False)):
        monkeypatch.setenv("PIPEGOOSE_STRICT", good)
        assert dispatch.is_strict() is on, good


def test_explain_counts_nothing():
    x = torch.zeros(2, 8, requires_grad=True)
    c = dispatch.explain(OP, x, ours=False)
    assert isinstance(c, Choice) and c.impl == "megatron" and c.reasons["pipegoose"] == "ours says no"
    assert "megatron" in str(c)
    assert dispatch.stats() == {}


def test_kernel_load_failure_becomes_a_reason(monkeypatch):
    import pipegoose.kernels as kernels

    class FakeKernelError(Exception):
        pass

    calls = []

    def failing_load(name):
        calls.append(name)
        raise FakeKernelError("nvcc not found; run python -m pipegoose.kernels doctor")

    monkeypatch.setattr(dispatch, "_kernel_error_types", lambda: (FakeKernelError,))
    monkeypatch.setattr(dispatch, "_load_kernel", failing_load)
    dispatch.clear_kernel_cache()
    dispatch.register(Implementation(OP, "pipegoose", "ours", lambda p: (True, ""), ("pipegoose/fake",)))
    c = dispatch.select(OP, problem())
    assert c.impl == "megatron"
    assert c.reasons["pipegoose"].startswith("pipegoose/fake unavailable: FakeKernelError: nvcc not found")
    dispatch.select(OP, problem())
    assert calls == ["pipegoose/fake"]  # cached, not retried per call
    assert kernels is not None


def test_a_cache_folder_removed_during_the_kernels_build_is_a_fallback(monkeypatch, tmp_path):
    """A review: `rm -rf` of the build cache while a kernel built raised FileNotFoundError out of the builder, which
    kernel() does not catch, into a fused model's first CUDA forward. The builder now raises a KernelBuildError: a
    fallback with its reason. (The real builder and lock on a throw-away manifest; the compile step is simulated.)"""
    import shutil
    import uuid

    import pipegoose.kernels.builder as builder_mod
    from pipegoose.kernels.builder import KernelBuilder

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
    try:
        from kernel_helpers import write_manifest
    finally:
        sys.path.pop(0)
    manifest = write_manifest(tmp_path / "proj", f"tiny_{uuid.uuid4().hex[:10]}")
    cache_dir = tmp_path / "cache"
    monkeypatch.setenv("PIPEGOOSE_QUIET", "1")

    def worker(cmd, *, env, cwd, log, echo):
        shutil.rmtree(cache_dir)
        return 1

    monkeypatch.setattr(builder_mod, "_run_worker", worker)
    monkeypatch.setattr(dispatch, "_load_kernel",
                        lambda name: KernelBuilder(name, manifest=manifest, cache_dir=cache_dir).build())
    dispatch.clear_kernel_cache()
    dispatch.register(Implementation(OP, "pipegoose", "ours", lambda p: (True, ""), ("test/tiny",)))
    c = dispatch.select(OP, problem())
    assert c.impl == "megatron"
    assert c.reasons["pipegoose"].startswith(
        f"test/tiny unavailable: KernelBuildError: test/tiny: the build cache folder {cache_dir} (or part of it) "
        "disappeared during the build"), c.reasons["pipegoose"]
    assert not cache_dir.exists()


def test_a_missing_manifest_makes_the_kernel_unavailable(monkeypatch, tmp_path):
    """An installed pipegoose (a wheel) has no kernels.yaml: on a GPU the first fused op raised ManifestError instead
    of falling back with the reason (a fresh-clone walkthrough)."""
    from pipegoose.kernels import manifest

    monkeypatch.setattr(manifest, "default_manifest_path", lambda: tmp_path / "kernels.yaml")
    dispatch.clear_kernel_cache()
    try:
        ops, why = dispatch.kernel("pipegoose/rms_norm")
        assert ops is None and why.startswith("pipegoose/rms_norm unavailable: ManifestNotFoundError: ")
        assert "manifest not found: pipegoose builds its kernels from a clone" in why
        # a malformed manifest in a clone stays an error, not a quiet fallback to PyTorch (a review)
        (tmp_path / "kernels.yaml").write_text("schema: 1\nsources: {}\nkernels: {}\nkernels: {}\n")
        dispatch.clear_kernel_cache()
        with pytest.raises(manifest.ManifestError, match="found the key 'kernels' twice"):
            dispatch.kernel("pipegoose/rms_norm")
    finally:
        dispatch.clear_kernel_cache()


def test_kernel_load_success_is_cached(monkeypatch):
    sentinel = object()
    calls = []
    monkeypatch.setattr(dispatch, "_load_kernel", lambda name: calls.append(name) or sentinel)
    dispatch.clear_kernel_cache()
    dispatch.register(Implementation(OP, "pipegoose", "ours", lambda p: (True, ""), ("pipegoose/fake",)))
    assert dispatch.select(OP, problem()).impl == "pipegoose"
    assert dispatch.select(OP, problem()).impl == "pipegoose"
    assert dispatch.kernel("pipegoose/fake") == (sentinel, "")
    assert calls == ["pipegoose/fake"]


def test_a_kernel_load_neither_blocks_loaded_ops_nor_runs_twice(monkeypatch):
    """A first load may build a kernel (minutes). It ran under the dispatcher's lock, which every op call takes (to
    count and remember its choice): one thread building stalled every other thread's ops (a code review measured 2.85 s
    of a 3 s stand-in load). Now threads loading the same kernel wait for one load, and the others' calls go on (the
    builder itself loads one library at a time, which this stand-in load does not model)."""
    import threading

    release, started, calls, ops = threading.Event(), threading.Event(), [], object()

    def slow_load(name):
        calls.append(name)
        if name == "pipegoose/slow":
            started.set()
            assert release.wait(30)
        return ops

    monkeypatch.setattr(dispatch, "_load_kernel", slow_load)
    dispatch.clear_kernel_cache()
    results = []
    loaders = [threading.Thread(target=lambda: results.append(dispatch.kernel("pipegoose/slow"))) for _ in range(2)]
    for t in loaders:
        t.start()
    assert started.wait(30)
    other = threading.Thread(target=lambda: (dispatch.record(dispatch.choose(OP, problem())),
                                             dispatch.stats(), dispatch.kernel("pipegoose/other")))
    other.start()
    other.join(10)
    alive = other.is_alive()
    release.set()
    for t in loaders + [other]:
        t.join(30)
    assert not alive, "an op call waited for another kernel's load"
    assert results == [(ops, "")] * 2 and calls.count("pipegoose/slow") == 1


def test_kernel_not_loaded_when_static_check_fails(monkeypatch):
    monkeypatch.setattr(dispatch, "_load_kernel", lambda name: pytest.fail("must not load"))
    dispatch.clear_kernel_cache()
    dispatch.register(Implementation(OP, "pipegoose", "ours", lambda p: (False, "cpu"), ("pipegoose/fake",)))
    assert dispatch.select(OP, problem()).impl == "megatron"


# --- tuning tables -------------------------------------------------------------------------------------------

def table(*rules):
    return {"device": "Fake GPU X-1", "measured": "2026-11-29", "benchmark": "b.json", "rules": list(rules)}


def write_table(tmp_path, data, monkeypatch):
    (tmp_path / "fake_gpu_x_1.json").write_text(json.dumps(data))
    monkeypatch.setattr(dispatch, "_device_name", lambda device: "Fake GPU X-1")
    dispatch.clear_tuning_cache()


def test_device_slug():
    assert dispatch.device_slug("NVIDIA H200") == "nvidia_h200"
    assert dispatch.device_slug("NVIDIA A100-SXM4-80GB") == "nvidia_a100_sxm4_80gb"
    assert dispatch.device_slug("Fake GPU X-1") == "fake_gpu_x_1"


def test_tuning_rules_pick_by_op_dtype_and_max_cols(tmp_path, monkeypatch):
    write_table(tmp_path, table(
        {"op": "layer_norm", "dtype": "float16", "impl": "torch"},   # another op's rule
        {"op": OP, "dtype": "bfloat16", "impl": "torch"},
        {"op": OP, "dtype": "float16", "max_cols": 128, "pass": "fwd+bwd", "impl": "megatron"},
        {"op": OP, "dtype": "float16", "max_cols": None, "pass": "fwd+bwd", "impl": "torch"},
    ), monkeypatch)
    c = dispatch.select(OP, problem(cols=128))
    assert (c.impl, c.source, c.fallback) == ("megatron", "tuning", False)
    assert "fake_gpu_x_1.json" in c.reason
    c = dispatch.select(OP, problem(cols=129))
    assert (c.impl, c.source, c.fallback) == ("torch", "tuning", False)  # a tuned torch is not a fallback
    assert dispatch.select(OP, problem(dtype=torch.bfloat16)).impl == "torch"
    assert dispatch.select(OP, problem(dtype=torch.float32)).source == "builtin"  # no rule for fp32
    # the rule's impl cannot take the input -> next matching rule
    c = dispatch.select(OP, problem(cols=100, ported=False))
    assert (c.impl, c.source) == ("torch", "tuning")
    assert c.reasons["megatron"] == "ported says no"
    # argument and env still beat the table
    assert dispatch.select(OP, problem(cols=100), impl="pipegoose").impl == "pipegoose"
    monkeypatch.setenv("PIPEGOOSE_IMPL_FAKE_OP", "pipegoose")
    assert dispatch.select(OP, problem(cols=100)).impl == "pipegoose"


def test_tuning_rule_skipped_where_the_timed_configuration_does_not_apply(tmp_path, monkeypatch):
    """A rule naming an implementation whose tuned_for() says the timings do not describe this problem is skipped:
    the next rule (or the built-in order) decides."""
    dispatch.register(Implementation(OP, "torch", "reference", lambda p: (True, ""),
                                     tuned_for=lambda p: not p.get("slow_torch", False)))
    write_table(tmp_path, table({"op": OP, "dtype": "float16", "impl": "torch"}), monkeypatch)
    c = dispatch.select(OP, problem())
    assert (c.impl, c.source) == ("torch", "tuning")
    c = dispatch.select(OP, problem(slow_torch=True))
    assert (c.impl, c.source) == ("pipegoose", "builtin")


def test_opt_in_implementations_run_only_when_named(tmp_path, monkeypatch):
    """An opt_in implementation (a kernel not yet timed against the others) is passed over by the built-in order,
    with the reason; an impl= argument, a PIPEGOOSE_IMPL_* variable or a tuning rule naming it runs it."""
    dispatch.register(Implementation(OP, "pipegoose", "ours",
                                     lambda p: (p["ours"], "" if p["ours"] else "ours says no"), opt_in=True))
    c = dispatch.select(OP, problem())
    assert (c.impl, c.source, c.fallback) == ("megatron", "builtin", False)
    assert c.reasons["pipegoose"] == ("opt-in: runs when requested (impl='pipegoose' or "
                                      "PIPEGOOSE_IMPL_FAKE_OP=pipegoose) or named by a tuning rule")
    c = dispatch.select(OP, problem(ported=False))   # the only fused one left is opt-in: a fallback, as before
    assert (c.impl, c.source, c.fallback) == ("torch", "fallback", True)
    assert "opt-in" in c.reason
    assert dispatch.explain(OP, torch.zeros(2, 3), ours=False).reasons["pipegoose"] == "ours says no"
    c = dispatch.select(OP, problem(), impl="pipegoose")
    assert (c.impl, c.source) == ("pipegoose", "argument")
    monkeypatch.setenv("PIPEGOOSE_IMPL_FAKE_OP", "pipegoose")
    assert (dispatch.select(OP, problem()).impl, dispatch.select(OP, problem()).source) == ("pipegoose", "env")
    monkeypatch.delenv("PIPEGOOSE_IMPL_FAKE_OP")
    write_table(tmp_path, table({"op": OP, "dtype": "float16", "impl": "pipegoose"}), monkeypatch)
    c = dispatch.select(OP, problem())
    assert (c.impl, c.source) == ("pipegoose", "tuning")
    with pytest.raises(ValueError, match="Implementation.opt_in: a reference implementation"):
        Implementation(OP, "torch", "reference", lambda p: (True, ""), opt_in=True)
    with pytest.raises(ValueError, match="Implementation.opt_in: a reference implementation"):
        Implementation(OP, "torch", "reference", lambda p: (True, ""), opt_in=lambda p: False)


def test_opt_in_where_it_could_not_run_gives_that_reason(tmp_path, monkeypatch):
    """An opt-in implementation that does not support the input gets its supports() reason (asked on metadata
    alone: no kernel is loaded), not the suggestion to request it (a review: strict mode's message said to request
    it, and the request then failed for another reason)."""
    loaded = []
    monkeypatch.setattr(dispatch, "_load_kernel", lambda name: loaded.append(name))
    dispatch.register(Implementation(OP, "pipegoose", "ours",
                                     lambda p: (p["ours"], "" if p["ours"] else "ours says no"), ("k",),
                                     opt_in=True))
    c = dispatch.select(OP, problem(ours=False, ported=False))
    assert (c.impl, c.fallback) == ("torch", True) and c.reasons["pipegoose"] == "ours says no"
    assert loaded == []


def test_opt_in_for_some_inputs(tmp_path, monkeypatch):
    """``opt_in`` as a predicate: opt-in for the inputs it names (the reason says "for this input"; with
    ``tuned_for`` excluding them, the rules do not name it and the reason says so), in the built-in order for the
    others."""
    dispatch.register(Implementation(OP, "pipegoose", "ours", lambda p: (True, ""),
                                     opt_in=lambda p: p.get("partial", False),
                                     tuned_for=lambda p: not p.get("partial", False)))
    assert dispatch.select(OP, problem()).impl == "pipegoose"
    c = dispatch.select(OP, problem(partial=True))
    assert (c.impl, c.source) == ("megatron", "builtin")
    assert c.reasons["pipegoose"] == ("opt-in for this input: runs when requested (impl='pipegoose' or "
                                      "PIPEGOOSE_IMPL_FAKE_OP=pipegoose)")
    write_table(tmp_path, table({"op": OP, "dtype": "float16", "impl": "pipegoose"}), monkeypatch)
    assert dispatch.select(OP, problem()).source == "tuning"
    assert dispatch.select(OP, problem(partial=True)).impl == "megatron"
    assert dispatch.select(OP, problem(partial=True), impl="pipegoose").source == "argument"


def test_small_problems_run_the_native_reference(tmp_path, monkeypatch):
    """Below PIPEGOOSE_SMALL_NUMEL elements, where a fused implementation takes the input, a small_first reference
    runs (before the table and the built-in order); requests, fallbacks and references without small_first are
    untouched."""
    monkeypatch.delenv("PIPEGOOSE_SMALL_NUMEL", raising=False)
    dispatch.register(Implementation(OP, "torch", "reference", lambda p: (True, ""), small_first=True,
                                     tuned_for=lambda p: not p.get("eager_torch", False)))
    write_table(tmp_path, table({"op": OP, "dtype": "float16", "impl": "megatron"}), monkeypatch)
    small, big = dispatch.SMALL_NUMEL_DEFAULT - 1, dispatch.SMALL_NUMEL_DEFAULT
    c = dispatch.select(OP, problem(numel=small))
    assert (c.impl, c.source, c.fallback) == ("torch", "small", False)
    assert "PIPEGOOSE_SMALL_NUMEL" in c.reason and "megatron" in c.reason
    assert dispatch.select(OP, problem(numel=big)).impl == "megatron"
    assert dispatch.select(OP, problem(dtype=torch.float32, numel=small)).source == "small"  # built-in -> small
    assert dispatch.select(OP, problem(numel=small, eager_torch=True)).impl == "megatron"  # torch is not native
    assert dispatch.select(OP, problem()).impl == "megatron"  # no numel: the rule does not apply
    assert dispatch.select(OP, problem(numel=small), impl="pipegoose").impl == "pipegoose"
    c = dispatch.select(OP, problem(numel=small, ours=False, ported=False))
    assert (c.source, c.fallback) == ("fallback", True)  # a real fallback stays one (strict mode raises)
    monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "0")
    assert dispatch.select(OP, problem(numel=small)).impl == "megatron"
    monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "100")
    assert dispatch.select(OP, problem(numel=99)).impl == "torch"
    assert dispatch.select(OP, problem(numel=100)).impl == "megatron"
    monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "lots")
    with pytest.raises(ValueError, match="PIPEGOOSE_SMALL_NUMEL"):
        dispatch.select(OP, problem(numel=small))
    dispatch.register(Implementation(OP, "torch", "reference", lambda p: (True, "")))  # no small_first
    monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "100")
    assert dispatch.select(OP, problem(numel=5)).impl == "megatron"


def test_rms_norm_torch_rules_only_for_the_native_kernel(tmp_path, monkeypatch):
    """rms_norm's ``torch`` timings are F.rms_norm's; Llama's rounding (cast_before_weight) and mixed dtypes run the
    eager formula, so a table rule naming torch must not route them there."""
    from pipegoose.nn.fusion.ops import rms_norm as R

    torch_impl = dispatch.implementations("rms_norm")["torch"]

    def prob(cbw, wdt=torch.bfloat16):
        x = torch.empty(4, 64, dtype=torch.bfloat16)
        w = torch.empty(64, dtype=wdt)
        return R.rms_norm_problem(x, (64,), w, R.out_dtype(x, w, cbw), cbw)

    assert torch_impl.tuned_for(prob(False))
    assert not torch_impl.tuned_for(prob(True))
    assert not torch_impl.tuned_for(prob(False, torch.float32))


def test_tuning_pass_prefers_matching_rules(tmp_path, monkeypatch):
    write_table(tmp_path, table(
        {"op": OP, "dtype": "float16", "pass": "fwd+bwd", "impl": "megatron"},
        {"op": OP, "dtype": "float16", "pass": "fwd", "impl": "torch"},
    ), monkeypatch)
    assert dispatch.select(OP, problem(needs_grad=True)).impl == "megatron"
    assert dispatch.select(OP, problem(needs_grad=False)).impl == "torch"


def test_no_table_for_device_means_builtin(tmp_path, monkeypatch):
    monkeypatch.setattr(dispatch, "_device_name", lambda device: "Other GPU")
    dispatch.clear_tuning_cache()
    assert dispatch.tuning_table(torch.device("cpu")) is None
    assert dispatch.select(OP, problem()).source == "builtin"


@pytest.mark.parametrize("bad,field", [
    ({"rules": []}, "device"),
    ({"device": "X", "rules": {}}, "rules"),
    ({"device": "X", "rules": [{"op": OP, "dtype": "fp16", "impl": "torch"}]}, r"rules\[0\]\.dtype"),
    ({"device": "X", "rules": [{"op": OP, "dtype": "float16", "impl": "cudnn"}]}, r"rules\[0\]\.impl"),
    ({"device": "X", "rules": [{"op": OP, "dtype": "float16", "impl": "torch", "max_cols": 0}]}, "max_cols"),
    ({"device": "X", "rules": [{"op": OP, "dtype": "float16", "impl": "torch", "pass": "bwd"}]}, r"\.pass"),
    ({"device": "X", "rules": [{"dtype": "float16", "impl": "torch"}]}, r"rules\[0\]\.op"),
    # a review: typos were accepted (an unknown field ignored, any op, any impl of any op) and the rules skipped later
    ({"device": "X", "rules": [{"op": OP, "dtype": "float16", "impl": "torch", "max_col": 64}]},
     r"^t\.json: rules\[0\]\.max_col: unknown field \(did you mean 'max_cols'\?\); expected only op, dtype, pass, "
     r"max_cols, impl$"),
    ({"device": "X", "rules": [{"op": "softmax", "dtype": "float16", "impl": "torch"},
                               {"op": "layernorm", "dtype": "float16", "impl": "torch"}]},
     r"^t\.json: rules\[1\]\.op: unknown op 'layernorm' \(did you mean 'layer_norm'\?\); expected one of .*adam.*"
     r"attention.*clip_grad_norm"),
    ({"device": "X", "rules": [{"op": "layer_norm", "dtype": "float16", "impl": "sdpa"}]},
     r"^t\.json: rules\[0\]\.impl: layer_norm has no implementation 'sdpa'; expected one of pipegoose, apex, torch$"),
    ({"device": "X", "rules": [{"op": "rms_norm", "dtype": "float16", "impl": "megatron"}]},
     r"rules\[0\]\.impl: rms_norm has no implementation 'megatron'"),
    ({"device": "X", "rules": [{"op": "attention", "dtype": "float16", "impl": "torch"}]},
     r"rules\[0\]\.impl: attention has no implementation 'torch'; expected one of pipegoose, sdpa, eager$"),
])
def test_tuning_table_errors_name_the_field(bad, field):
    with pytest.raises(TuningTableError, match=field):
        TuningTable.parse(bad, "t.json")


def test_tables_name_every_op_and_impl_that_reads_them():
    """What the stricter parse must still take: each dispatcher op's implementations (the optimizer ops' too, which
    register with the built-in ops), ``attention`` with pipegoose, sdpa and eager, an op registered at run time
    (tests' fake op) and every committed table."""
    from pathlib import Path

    rules = [{"op": op, "dtype": "bfloat16", "pass": None, "max_cols": None, "impl": impl}
             for op, impls in (("adam", ("pipegoose", "torch_fused", "apex", "deepspeed", "torch")),
                               ("clip_grad_norm", ("pipegoose", "apex", "torch")), ("rope", ("pipegoose", "torch")),
                               ("attention", ("pipegoose", "sdpa", "eager")), (OP, ("pipegoose", "megatron", "torch")))
             for impl in impls]
    assert len(TuningTable.parse({"device": "X", "rules": rules}).rules) == len(rules)
    committed = sorted((Path(dispatch.__file__).parent / "tuning").glob("*.json"))
    assert committed
    for path in committed:
        table = TuningTable.load(path)
        assert table.rules and len(table.rules) == len(json.loads(path.read_text())["rules"]), path


def test_malformed_table_file_is_ignored_with_a_warning(tmp_path, monkeypatch, caplog):
    (tmp_path / "fake_gpu_x_1.json").write_text("{not json")
    monkeypatch.setattr(dispatch, "_device_name", lambda device: "Fake GPU X-1")
    dispatch.clear_tuning_cache()
    with caplog.at_level(logging.WARNING, logger="pipegoose.nn.fusion.dispatch"):
        c = dispatch.select(OP, problem())
    assert c.source == "builtin" and "ignoring tuning table" in caplog.text


def test_a_table_file_that_is_not_utf8_is_ignored_once_with_a_warning(tmp_path, monkeypatch, caplog):
    """A review: a byte that is not UTF-8 raised UnicodeDecodeError (neither JSONDecodeError nor TuningTableError)
    out of every op call, and nothing was cached. Now: one warning naming the file, the table cached as None, the
    built-in order."""
    path = tmp_path / "fake_gpu_x_1.json"
    path.write_bytes(b'{"device":"X","rules":[],"n":"\xff"}')
    monkeypatch.setattr(dispatch, "_device_name", lambda device: "Fake GPU X-1")
    dispatch.clear_tuning_cache()
    with pytest.raises(TuningTableError, match=r"fake_gpu_x_1\.json: not UTF-8"):
        TuningTable.load(path)
    with caplog.at_level(logging.WARNING, logger="pipegoose.nn.fusion.dispatch"):
        assert dispatch.select(OP, problem()).source == "builtin"
        assert dispatch.select(OP, problem(cols=65)).source == "builtin"
    warned = [r for r in caplog.records if "ignoring tuning table" in r.getMessage()]
    assert len(warned) == 1 and "fake_gpu_x_1.json" in warned[0].getMessage()
    assert dispatch._tables["Fake GPU X-1"] is None


def test_real_ops_are_registered():
    for op, names in {"softmax": ["pipegoose", "megatron", "torch"],
                      "softmax.masked": ["pipegoose", "megatron", "torch"],
                      "softmax.causal": ["pipegoose", "megatron", "torch"],
                      "layer_norm": ["pipegoose", "apex", "torch"], "rms_norm": ["pipegoose", "torch"],
                      "swiglu": ["pipegoose", "torch"], "swiglu.packed": ["pipegoose", "torch"],
                      "adam": ["pipegoose", "torch_fused", "apex", "deepspeed", "torch"],
                      "clip_grad_norm": ["pipegoose", "apex", "torch"]}.items():
        assert list(dispatch.implementations(op)) == names


def test_explain_refuses_what_the_softmax_ops_refuse():
    x = torch.randn(2, 4, 8, 16)
    with pytest.raises(ValueError, match="mask"):
        dispatch.explain("softmax.masked", x, torch.zeros(1, 1, 8, 15, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask"):
        dispatch.explain("softmax.masked", x, torch.zeros(1, 1, 8, 16))
    with pytest.raises(TypeError, match="floating"):
        dispatch.explain("softmax", torch.ones(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="scale"):
        dispatch.explain("softmax.causal", x[0], scale=float("nan"))
    with pytest.raises(ValueError, match="attn_batches"):
        dispatch.explain("softmax.causal", x, scale=0.5)
    # a mask of the wrong type is named first, whatever x's shape
    with pytest.raises(TypeError, match="^mask: expected a bool torch.Tensor .* got float"):
        dispatch.explain("softmax.masked", x[0], 0.5)
    with pytest.raises(IndexError, match="dim"):
        dispatch.explain("softmax", x, 4)


def test_explain_of_softmax_with_a_dim_describes_softmax(monkeypatch):
    """A walkthrough: explain("softmax", x) described scaled_softmax (fused in 16-bit) while softmax(x, dim), the
    F.softmax drop-in, is fused only where exact (fp32) and over the last dim: on a GPU it said "pipegoose" for a bf16
    call that ran the reference (a fallback, which strict mode raises on). explain("softmax", x, dim) (or dim=) now
    describes softmax(x, dim); a float after x stays scaled_softmax's scale."""
    from dataclasses import replace

    from pipegoose.nn.fusion.ops import softmax as sm

    x = torch.randn(2, 4, 8, 16, dtype=torch.bfloat16)
    import numpy as np

    for args, kw, exact, last in (((-1,), {}, True, True), ((1,), {}, True, False), ((), {"dim": 3}, True, True),
                                  ((np.int64(-1),), {}, True, True), ((0.5,), {}, False, True), ((), {}, False, True)):
        p = dispatch.problem_of("softmax", x, *args, **kw)
        assert (p["exact"], p["last_dim"]) == (exact, last), (args, kw)
    p = dispatch.problem_of("softmax", x, -1, dtype=torch.float32)   # softmax(x, -1, dtype=torch.float32)
    assert p.dtype == torch.float32 and p["exact"]
    monkeypatch.setattr(dispatch, "_load_kernel", lambda name: object())
    dispatch.clear_kernel_cache()
    on_gpu = lambda p: replace(p, device=torch.device("cuda"), extra=dict(p.extra, aligned=True))  # noqa: E731
    assert dispatch.choose("softmax", on_gpu(dispatch.problem_of("softmax", x, -1))).impl == "torch"
    assert dispatch.choose("softmax", on_gpu(dispatch.problem_of("softmax", x.float(), -1))).impl == "pipegoose"
    assert dispatch.choose("softmax", on_gpu(dispatch.problem_of("softmax", x.float(), 1))).impl == "torch"
    dispatch.clear_kernel_cache()


def test_explain_refuses_keywords_the_op_does_not_take():
    """A fresh-clone walkthrough: explain("layer_norm", x, (8,), wieght=w) explained a call without a weight, and
    explain("softmax", x, dim=0) a last-dim softmax: unknown keywords were dropped. Now a TypeError naming it."""
    x, w = torch.randn(4, 8), torch.randn(8)
    for op, args, kw, name in (("layer_norm", (x, (8,)), {"wieght": w}, "wieght"),
                               ("rms_norm", (x, (8,)), {"epsilon": 1e-6}, "epsilon"),
                               ("softmax", (x,), {"axis": 0}, "axis"),
                               ("softmax.masked", (x.view(1, 1, 4, 8),), {"mask_": None}, "mask_")):
        with pytest.raises(TypeError, match=rf"explain\('{re.escape(op)}', \.\.\.\).*'{name}' is not one of them"):
            dispatch.explain(op, *args, **kw)
    assert dispatch.explain("rms_norm", x, (8,), w, cast_before_weight=True).impl == "torch"  # a real keyword


def test_explain_of_softmax_says_dim_or_scale_for_what_is_neither():
    """A fresh-clone review: explain("softmax", x, "a") said "scale: expected a number", where the argument after x is
    softmax(x, dim)'s dim or scaled_softmax(x, scale)'s scale; the message now names both."""
    x = torch.randn(4, 8)
    for bad in ("a", True, [1]):
        with pytest.raises(TypeError, match=r"softmax\(x, dim\)'s dim \(an int\) or scaled_softmax\(x, scale\)'s "
                                            r"scale \(a float\), got"):
            dispatch.explain("softmax", x, bad)
    assert dispatch.explain("softmax", x, -1).impl == dispatch.explain("softmax", x, dim=-1).impl


def test_explain_takes_the_scale_of_the_plain_and_causal_functions():
    """explain("softmax.causal", x, 0.5) as scaled_upper_triang_masked_softmax(x, 0.5) is called (and "softmax" as
    scaled_softmax(x, 0.5)): the number after x is the scale, checked as the op checks it."""
    x = torch.randn(4, 8, 16)
    for op in ("softmax.causal", "softmax"):
        a, b = dispatch.explain(op, x, 0.5), dispatch.explain(op, x, scale=0.5)
        assert (a.impl, a.reasons) == (b.impl, b.reasons)
        with pytest.raises(ValueError, match="scale"):
            dispatch.explain(op, x, float("nan"))
        with pytest.raises(TypeError, match="scale given twice"):
            dispatch.explain(op, x, 0.5, scale=0.5)
    assert dispatch.explain("softmax.causal", x, 2).impl == dispatch.explain("softmax.causal", x, scale=2.0).impl


def test_explain_real_ops_on_cpu():
    x = torch.randn(2, 4, 8, 16)
    c = dispatch.explain("softmax.masked", x, torch.zeros(1, 1, 8, 16, dtype=torch.bool), scale=0.5)
    assert c.impl == "torch" and c.fallback and "CUDA" in c.reasons["pipegoose"]
    c = dispatch.explain("layer_norm", x, (16,), torch.ones(16), torch.zeros(16))
    assert c.impl == "torch" and "CUDA" in c.reasons["apex"]
    text = str(c)  # each implementation's reason once (the summary line used to repeat them all)
    assert text.count("apex: ") == 1 and text.count("pipegoose: ") == 1, text
    # a request that cannot run is printed (it was only in .unmet: print(explain(..., impl="apex")) never named it)
    text = str(dispatch.explain("layer_norm", x, (16,), impl="apex"))
    assert "not as requested: impl='apex' cannot run this input" in text, text


def test_misspelt_impl_variable_warns(monkeypatch):
    """PIPEGOOSE_IMPL_LAYERNORM (no underscore) was ignored without a word."""
    monkeypatch.setenv("PIPEGOOSE_IMPL_LAYERNORM", "apex")
    monkeypatch.setattr(dispatch, "_env_checked", False)
    with pytest.warns(UserWarning, match="PIPEGOOSE_IMPL_LAYERNORM: no fused op"):
        assert dispatch.warn_unknown_env() == ["PIPEGOOSE_IMPL_LAYERNORM"]
    monkeypatch.delenv("PIPEGOOSE_IMPL_LAYERNORM")
    monkeypatch.setenv("PIPEGOOSE_IMPL_LAYER_NORM", "torch")
    assert dispatch.warn_unknown_env() == []


def test_check_env_names_the_bad_variable(monkeypatch):
    """check_env: what the calls would raise, up front: an implementation the op lacks (its own variable, or its
    family's: PIPEGOOSE_IMPL_SOFTMAX covers softmax.masked and softmax.causal), PIPEGOOSE_SMALL_NUMEL and
    PIPEGOOSE_STRICT, PIPEGOOSE_IMPL_ATTENTION other than auto / pipegoose (it accepted anything). Valid values and
    auto pass."""
    for var in [k for k in __import__("os").environ if k.startswith("PIPEGOOSE_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("PIPEGOOSE_IMPL_LAYER_NORM", "Apex")      # read case-insensitively, as the calls read it
    monkeypatch.setenv("PIPEGOOSE_IMPL_RMS_NORM", "auto")
    monkeypatch.setenv("PIPEGOOSE_IMPL_ATTENTION", " PipeGoose ")
    dispatch.check_env()
    monkeypatch.delenv("PIPEGOOSE_IMPL_ATTENTION")
    for var, value, expect in (("PIPEGOOSE_IMPL_LAYER_NORM", "megatron", "layer_norm has no implementation 'megatron'"),
                               ("PIPEGOOSE_IMPL_SOFTMAX", "apex", "softmax has no implementation 'apex'"),
                               ("PIPEGOOSE_IMPL_SOFTMAX_CAUSAL", "nope", "softmax.causal has no implementation"),
                               ("PIPEGOOSE_IMPL_SWIGLU_PACKED", "apex", "swiglu.packed has no implementation 'apex'"),
                               ("PIPEGOOSE_SMALL_NUMEL", "-3", "PIPEGOOSE_SMALL_NUMEL='-3'"),
                               ("PIPEGOOSE_STRICT", "maybe", "PIPEGOOSE_STRICT='maybe'"),
                               ("PIPEGOOSE_IMPL_ATTENTION", "bogus", "expected 'pipegoose'")):
        monkeypatch.setenv(var, value)
        with pytest.raises(ValueError, match=f"^{var}="):
            dispatch.check_env()
        with pytest.raises(ValueError, match=expect):
            dispatch.check_env()
        monkeypatch.delenv(var)
    dispatch.check_env()


def test_check_env_checks_the_norm_kernels_variables(monkeypatch):
    """PIPEGOOSE_NORM_CLUSTERS and PIPEGOOSE_NORM_SMEM_LIMIT, which the kernels read in C++ at their first launch on a
    GPU, are checked up front by check_env (so by fuse too), with the kernels' rules and messages (strtoll's form for
    the byte count: leading blanks and a sign, nothing after the digits)."""
    for var in [k for k in __import__("os").environ if k.startswith("PIPEGOOSE_")]:
        monkeypatch.delenv(var)
    for var, good, bad, expect in (
            ("PIPEGOOSE_NORM_CLUSTERS", ("0", "1", ""), ("2", "off", " 1", "true"), "expected 0 or 1"),
            ("PIPEGOOSE_NORM_SMEM_LIMIT", ("0", "100352", " +5", "-0", ""), ("99KB", "-1", "1.5", "5 ", "x"),
             "expected a number of bytes >= 0")):
        for value in good:
            monkeypatch.setenv(var, value)
            dispatch.check_env()
        for value in bad:
            monkeypatch.setenv(var, value)
            with pytest.raises(ValueError, match=f"^{var}: {expect}, got '{re.escape(value)}'$"):
                dispatch.check_env()
        monkeypatch.delenv(var)


def test_impl_attention_variable_is_known(monkeypatch, recwarn):
    """PIPEGOOSE_IMPL_ATTENTION keeps the attention function's own paths under torch.compile (compile_passthrough
    reads it); the check of unknown variables warned that it was ignored."""
    monkeypatch.setenv("PIPEGOOSE_IMPL_ATTENTION", "pipegoose")
    monkeypatch.setattr(dispatch, "_env_checked", False)
    assert dispatch.warn_unknown_env() == []
    assert not [w for w in recwarn if "PIPEGOOSE_IMPL_ATTENTION" in str(w.message)]


def test_warnings_name_the_callers_line_not_pipegoose():
    """An unmet request warns at the user's line: through the functional op, and through a fused module called from
    a model's forward (past nn.Module.__call__), not inside pipegoose or torch."""
    from pipegoose.nn.fusion import FusedRMSNorm, softmax

    dispatch._warned_unmet.clear()
    with pytest.warns(UserWarning, match="cannot run this input") as rec:
        softmax(torch.randn(4, 8), dim=-1, impl="megatron"); line = sys._getframe().f_lineno  # noqa: E702
    assert [(w.filename, w.lineno) for w in rec if "cannot run" in str(w.message)] == [(__file__, line)]

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = FusedRMSNorm(8, impl="pipegoose")  # no GPU here, or a CPU input: unmet

        def forward(self, x):
            self.line = sys._getframe().f_lineno + 1
            return self.norm(x)

    model = Model()
    with pytest.warns(UserWarning, match="cannot run this input") as rec:
        model(torch.randn(4, 8))
    assert [(w.filename, w.lineno) for w in rec if "cannot run" in str(w.message)] == [(__file__, model.line)]


def test_last_choice_of_an_unknown_op_is_a_key_error():
    """last_choice("nope") returned None, as for a known op that has not run: a misspelt name went unnoticed. It is
    now a KeyError naming the argument and the known ops (as implementations() and explain() raise); a known op that
    has not run, and attention (no dispatcher op, but the attention function records its choices), give None."""
    # (a name near no op: "nope" now gets "did you mean 'rope'?")
    with pytest.raises(KeyError, match=r"op: unknown fused op 'xyzzy'; known ops: .*attention.*fake\.op.*layer_norm"):
        dispatch.last_choice("xyzzy")
    assert dispatch.last_choice(OP) is None
    assert dispatch.last_choice("layer_norm") is None and dispatch.last_choice("attention") is None
    c = dispatch.select(OP, problem())
    assert dispatch.last_choice(OP) is c
    with pytest.raises(KeyError, match="unknown fused op 'Fake.op'"):   # op names are not case-insensitive
        dispatch.last_choice("Fake.op")
    # the closest name (a walkthrough: explain("layernorm", x) said only KeyError with the list)
    with pytest.raises(KeyError, match=r"unknown fused op 'layernorm' \(did you mean 'layer_norm'\?\); known ops"):
        dispatch.explain("layernorm", torch.randn(2, 8), (8,))
    with pytest.raises(TypeError, match=r"op: expected an op name \(str\), got list"):  # not "unhashable type"
        dispatch.last_choice(["layer_norm"])


def test_impl_argument_is_case_insensitive_as_the_variables(monkeypatch):
    """``impl="Megatron"`` was a ValueError, though PIPEGOOSE_IMPL_FAKE_OP=Megatron chose megatron: the argument is
    now read as the variables are (case and surrounding blanks ignored), by check_impl, which choose calls; a name the
    op does not have is still a ValueError naming the argument, the op and its implementations."""
    for impl in ("Megatron", "MEGATRON", " megatron "):
        assert dispatch.check_impl(OP, impl) == "megatron"
        c = dispatch.select(OP, problem(), impl=impl)
        assert (c.impl, c.source) == ("megatron", "argument")
    assert dispatch.check_impl(OP, "AUTO") == "auto" and dispatch.check_impl(OP, None) is None
    assert dispatch.select(OP, problem(), impl="Auto").source == "builtin"
    with pytest.warns(UserWarning, match=r"impl='megatron' cannot run this input: ported says no"):
        assert dispatch.select(OP, problem(ported=False), impl="MegaTron").impl == "pipegoose"
    with pytest.raises(ValueError, match=r"^impl: fake\.op has no implementation 'Apex'; expected one of pipegoose, "
                                         r"megatron, torch or 'auto' \(any case\)$"):
        dispatch.select(OP, problem(), impl="Apex")
    with pytest.raises(TypeError, match="impl: expected an implementation name"):
        dispatch.check_impl(OP, b"torch")


@pytest.mark.parametrize("impl", [None, "auto", "AUTO", "torch"])
def test_check_impl_refuses_an_unknown_op_whatever_the_impl(impl):
    """A review: check_impl("softmax.cuasal", None) and (..., "auto") returned without the unknown-op KeyError its
    docstring promises (only a named impl looked the op up)."""
    with pytest.raises(KeyError, match=r"unknown fused op 'softmax\.cuasal' \(did you mean 'softmax\.causal'\?\)"):
        dispatch.check_impl("softmax.cuasal", impl)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "softmax.masked"])
def test_explain_describes_the_problem_the_call_chooses_on(op, monkeypatch):
    """Under CUDA autocast the ops cast x to the output dtype (fp32) and choose for that; explain() described the
    uncast x, so that it could say an implementation cannot run an input that the call then ran on it (the Apex
    copy: "input bfloat16 with output float32"). Emulated: the output dtype rule returns fp32 for bf16 input."""
    from pipegoose.nn.fusion.ops import layer_norm as ln, rms_norm as rms, softmax as sm

    fp32 = lambda *a, **k: torch.float32  # noqa: E731 - what autocast's fp32 policy gives
    monkeypatch.setattr({"layer_norm": ln, "rms_norm": rms, "softmax.masked": sm}[op],
                        "softmax_out_dtype" if op.startswith("softmax") else "out_dtype", fp32)
    x = torch.randn(2, 3, 4, 16, dtype=torch.bfloat16)
    w = torch.randn(16, dtype=torch.float32)
    args = {"layer_norm": (x, (16,), w, w), "rms_norm": (x, (16,), w),
            "softmax.masked": (x, torch.zeros(2, 1, 4, 16, dtype=torch.bool), 0.5)}[op]
    problem = dispatch._problem_builders[op](*args)
    assert problem.dtype == torch.float32 and problem["shape"] == tuple(x.shape)
    if op == "rms_norm":  # Llama's rounding keeps the input dtype: no cast
        assert dispatch._problem_builders[op](x, (16,), w, None, True).dtype == torch.bfloat16


def test_misspelt_pipegoose_variables_of_any_kind_warn(monkeypatch):
    """A walkthrough: PIPEGOOSE_STRCT=1 left strict mode off without a word (only PIPEGOOSE_IMPL_* names were checked);
    every PIPEGOOSE_* name pipegoose does not read now gets a warning naming the closest one it does."""
    monkeypatch.setenv("PIPEGOOSE_STRCT", "1")
    monkeypatch.setenv("PIPEGOOSE_SMALLNUMEL", "0")
    monkeypatch.setattr(dispatch, "_env_checked", False)
    with pytest.warns(UserWarning) as rec:
        unknown = dispatch.warn_unknown_env()
    assert {"PIPEGOOSE_STRCT", "PIPEGOOSE_SMALLNUMEL"} <= set(unknown)
    text = " ".join(str(w.message) for w in rec)
    assert "PIPEGOOSE_STRCT: pipegoose reads no variable of that name, so it is ignored; did you mean " \
           "PIPEGOOSE_STRICT?" in text and "did you mean PIPEGOOSE_SMALL_NUMEL?" in text


def test_every_variable_the_code_reads_is_known():
    """Each ``PIPEGOOSE_*`` name the Python code or the C++ kernels read (as a quoted literal) is in ``_env.KNOWN``:
    the cluster experiment's ``PIPEGOOSE_NORM_BWD_CL_SIZE`` (the method of session 37) was reported as "pipegoose reads
    no variable of that name" with a wrong "did you mean" (docs audit, session 38). Compile-time switches (``-D``
    macros) are not read from the environment and are not quoted in the sources."""
    from pathlib import Path

    from pipegoose import _env

    root = Path(dispatch.__file__).resolve().parents[3]
    read = set()
    for folder in ("pipegoose", "tools"):
        for path in (root / folder).rglob("*"):
            if path.suffix in (".py", ".cu", ".cuh", ".cpp", ".h") and path.name != "_env.py":
                read |= set(re.findall(r'"(PIPEGOOSE_[A-Z0-9_]*[A-Z0-9])"', path.read_text(encoding="utf-8")))
    read = {n for n in read if not n.startswith("PIPEGOOSE_IMPL_")}
    assert "PIPEGOOSE_NORM_BWD_CL_SIZE" in read and "PIPEGOOSE_QUIET" in read  # the scan finds both kinds of file
    assert sorted(read - set(_env.KNOWN)) == []
    assert _env.unknown_names({"PIPEGOOSE_NORM_BWD_CL_SIZE": "3"}) == []


def test_an_unknown_name_prints_its_message_as_written():
    """str() of a KeyError is the repr of its message: explain("layernorm", ...) printed it inside quotes, with
    escaped quotes within (a walkthrough). The unknown-name errors are still KeyErrors."""
    from pipegoose.kernels.manifest import UnknownNameError, load_manifest

    with pytest.raises(KeyError) as ei:
        dispatch.explain("layernorm", torch.randn(2, 32), (32,))
    assert isinstance(ei.value, UnknownNameError)
    assert str(ei.value).startswith("op: unknown fused op 'layernorm' (did you mean 'layer_norm'?)")
    with pytest.raises(KeyError) as ei:
        load_manifest().resolve("nope")
    assert str(ei.value).startswith("unknown kernel 'nope' in kernels.yaml")


def test_an_impl_argument_that_cannot_run_is_said_where_the_variable_takes_over(monkeypatch):
    """A walkthrough: FusedAdam(impl="pipegoose") on CPU tensors with PIPEGOOSE_IMPL_ADAM=torch ran torch without a
    word about the argument (without the variable the same request warned)."""
    import warnings

    from pipegoose.nn.fusion.optim import FusedAdam

    monkeypatch.setenv("PIPEGOOSE_IMPL_ADAM", "torch")
    dispatch.reset_stats()
    p = torch.nn.Parameter(torch.randn(5))
    p.grad = torch.randn(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FusedAdam([p], impl="pipegoose").step()
    c = dispatch.last_choice("adam")
    assert (c.impl, c.source) == ("torch", "env") and "impl='pipegoose' cannot run this input: needs CUDA" in c.unmet
    said = [str(w.message) for w in caught]
    assert any("impl='pipegoose' cannot run this input" in m for m in said), said
    monkeypatch.setenv("PIPEGOOSE_IMPL_ADAM", "auto")   # no variable's request: the argument's failure said as before
    dispatch.reset_stats()
    with pytest.warns(UserWarning, match="impl='pipegoose' cannot run this input"):
        FusedAdam([p], impl="pipegoose").step()
