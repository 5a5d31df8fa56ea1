"""Checks shared by the tests of the modules that replace a model's own ALiBi attention (``FusedBloomAttention``,
``FusedMptAttention``): the same paths (the softmax path, SDPA with the bias), caches, devices and fuse behaviour."""

from __future__ import annotations

import contextlib
import copy
import gc

import pytest
import torch

from pipegoose.nn.fusion import dispatch
from pipegoose.nn.fusion.fuse import fuse, unfuse
from pipegoose.nn.fusion.ops import _common

from tolerances import tol

from . import models


def pretend_cuda(monkeypatch):
    """The SDPA path of pipegoose attention (CUDA only) on the CPU: scores above PIPEGOOSE_SMALL_NUMEL run SDPA."""
    monkeypatch.setattr(_common, "on_kernel_device", lambda t: True)
    monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "1")


def _marked(test, marks):
    for mark in reversed(marks):
        test = mark(test)
    return test


def float64_cases(test):
    """The cases of a CPU test against float64 (``test(monkeypatch, path, dtype, left_pad)``): path ``softmax`` and
    ``sdpa`` (CUDA pretended: :func:`pretend_cuda`), fp32 and bf16, no padding or left padding 0 / 3 / 6 of 9
    positions (its rows without a key)."""
    return _marked(test, (pytest.mark.parametrize("path", ["softmax", "sdpa"]),
                          pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str),
                          pytest.mark.parametrize("left_pad", [(0, 0, 0), (0, 3, 6)], ids=["causal", "left_padded"])))


def check_float64_forward_backward(monkeypatch, path: str, dtype: torch.dtype, att, fused, reference, inputs: tuple,
                                   params: tuple, g: torch.Generator) -> torch.Tensor:
    """``fused(*inputs, *rest)`` (the module replacing ``att``; ``inputs``: its tensor inputs that take gradients,
    in ``dtype``, ``rest``: the other arguments, a function given) against ``reference(att, *inputs)`` (float64
    output and probabilities): the output within 4 roundings, counted on its path (``path``: ``sdpa`` with CUDA
    pretended), the attention weights only on the softmax path; the gradients of ``inputs`` and of ``att``'s
    parameters named in ``params`` within 16, for a random output gradient. Returns the output."""
    if path == "sdpa":
        pretend_cuda(monkeypatch)
    dispatch.reset_stats()
    out, weights = fused(*inputs)
    assert dispatch.stats()["attention"] == {"sdpa": 1} if path == "sdpa" else "attention" not in dispatch.stats()
    ref, ref_probs = reference(att, *inputs)
    assert out.dtype == dtype and out.shape == inputs[0].shape
    torch.testing.assert_close(out.double(), ref, **tol(dtype, 4))
    if path == "sdpa":
        assert weights is None
    else:
        torch.testing.assert_close(weights.double(), ref_probs, **tol(dtype, 4))
    go = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, [*inputs, *(att.get_parameter(n) for n in params)], go.to(dtype))
    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    att64 = copy.deepcopy(att).double()
    want = torch.autograd.grad(reference(att64, *ref_in)[0], [*ref_in, *(att64.get_parameter(n) for n in params)], go)
    for i, (a, w) in enumerate(zip(grads, want)):
        name = params[i - len(inputs)] if i >= len(inputs) else f"input {i}"
        torch.testing.assert_close(a.double(), w, **tol(dtype, 16), msg=lambda m: f"grad of {name}: {m}")
    return out


def check_off_cuda_paths(monkeypatch, call, want: torch.Tensor, lm):
    """Off CUDA (the CPU's default, tests/fuse's PIPEGOOSE_SMALL_NUMEL=0 unset): ``call(output_attentions)`` (the
    fused module on fp32 inputs) runs SDPA, counted as attention/sdpa, without weights, and ``lm``'s report row says
    so; PIPEGOOSE_IMPL_ATTENTION=pipegoose or PIPEGOOSE_SMALL_NUMEL=0: the softmax path, with the weights; so does a
    call that asks for them. The output is ``want`` (float64's) on every path."""
    monkeypatch.delenv("PIPEGOOSE_SMALL_NUMEL")
    for env, path in (({}, "sdpa"), ({"PIPEGOOSE_IMPL_ATTENTION": "pipegoose"}, "softmax"),
                      ({"PIPEGOOSE_SMALL_NUMEL": "0"}, "softmax")):
        with monkeypatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            dispatch.reset_stats()
            out, weights = call(False)
            assert (dispatch.stats().get("attention") == {"sdpa": 1}) == (path == "sdpa"), (env, dispatch.stats())
            assert (weights is None) == (path == "sdpa")
            torch.testing.assert_close(out.double(), want, **tol(torch.float32, 4))
            row = next(r for r in fuse(lm, dry_run=True).rows if r.kind == "attention")
            assert (row.forward == "sdpa @128") == (path == "sdpa"), (env, row)
    dispatch.reset_stats()
    assert call(True)[1] is not None
    assert "attention" not in dispatch.stats()


def check_nothing_outlives_the_forward_pass(monkeypatch, make_lm, bias_cache: dict):
    """After a forward pass of ``make_lm()`` fused, on the softmax path and the SDPA path, the one-entry caches (the
    module's ``bias_cache``; the SDPA path's copy of the bias; the mask's plan) hold nothing: their entries go with
    the tensors they were derived from (a review: after unfuse and del model, 256-512 MiB of it stayed cached)."""
    from pipegoose.nn.fusion.transformers import attention as A

    for path in ("softmax", "sdpa"):
        if path == "sdpa":
            pretend_cuda(monkeypatch)
        lm = make_lm().eval()
        fuse(lm)
        ids, mask = models.inputs()
        with torch.no_grad():
            lm(input_ids=ids, attention_mask=mask)
        gc.collect()
        assert "entry" not in bias_cache and "entry" not in A._plan_cache, path
        assert "entry" not in A._sdpa_mask_cache, path


def check_meta_and_fake_tensors(lm):
    """``lm`` fused runs on the meta device and under FakeTensorMode, as the eager one (the check for a bias that is
    the same per sequence compares values: skipped there)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fuse(lm)
    meta = copy.deepcopy(lm).to("meta")
    ids = torch.ones(2, 8, dtype=torch.long, device="meta")
    assert meta(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.shape == (2, 8, models.VOCAB)
    with FakeTensorMode(allow_non_fake_inputs=True):
        ids = torch.ones(2, 8, dtype=torch.long)
        assert lm(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.shape == (2, 8, models.VOCAB)


def check_fuse_and_unfuse(lm, paths: list, name: str, fused_name: str, more=None):
    """``fuse(lm)`` replaces the attention modules at ``paths`` (class ``name``) by ``fused_name``'s, fused rows, the
    module's hooks kept (one forward hook, called once), the state_dict's keys and the config's attention unchanged,
    the step eager's (:func:`check_step_matches`); ``more(lm, ref, report, ids, mask)``, where given, checks more
    while fused; ``unfuse`` puts the modules back."""
    ref = copy.deepcopy(lm)
    keys = list(lm.state_dict())
    hook_calls = []
    lm.get_submodule(paths[0]).register_forward_hook(lambda *a: hook_calls.append(1))
    report = fuse(lm)
    rows = [r for r in report.rows if r.kind == "attention"]
    assert [r.path for r in rows] == paths
    assert all(r.fused and r.replacement == fused_name and r.eligible for r in rows)
    assert all(type(lm.get_submodule(p)).__name__ == fused_name for p in paths)
    assert list(lm.state_dict()) == keys
    assert report.attention["chosen"] == "eager" and fused_name in report.attention["reason"]
    ids, mask = check_step_matches(lm, ref)
    assert hook_calls == [1]
    if more is not None:
        more(lm, ref, report, ids, mask)
    assert unfuse(lm)
    assert all(type(lm.get_submodule(p)).__name__ == name for p in paths)
    assert list(lm.state_dict()) == keys


def check_step_matches(lm, ref):
    """``lm`` (fused) and ``ref`` (an unfused copy), on 3 sequences, the second padded on the right (no row without a
    key, so eager's values everywhere): the same logits, loss gradients of every parameter (fp32). Returns the
    inputs (ids, mask)."""
    ids, mask = models.inputs(left_pad=(0, 0, 0))
    mask[1, -3:] = 0
    out = lm(input_ids=ids, attention_mask=mask, labels=ids)
    want = ref(input_ids=ids, attention_mask=mask, labels=ids)
    torch.testing.assert_close(out.logits, want.logits, atol=1e-5, rtol=1e-5)
    out.loss.backward()
    want.loss.backward()
    for (name, p), q in zip(lm.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    return ids, mask


def check_left_padding(lm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``lm`` fused for ``attention`` alone against an unfused copy, left padding 0 / 4 / 2: the positions that are
    not padding get eager's values, every value finite; returns (fused logits, eager logits, the 2-D mask)."""
    ref = copy.deepcopy(lm)
    fuse(lm, ops=["attention"])
    ids, mask = models.inputs()
    got, want = lm(input_ids=ids, attention_mask=mask).logits, ref(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got).all()
    return got, want, mask


def check_generation(monkeypatch, path: str, lm):
    """Greedy generation with the KV cache: ``lm`` fused gives an unfused copy's tokens, on the softmax path
    (``path`` ``"softmax"``: tests/fuse sets PIPEGOOSE_SMALL_NUMEL=0) and the CPU's default, SDPA (``"cpu_sdpa"``)."""
    if path == "cpu_sdpa":
        monkeypatch.delenv("PIPEGOOSE_SMALL_NUMEL")
    lm.eval()
    ref = copy.deepcopy(lm)
    fuse(lm)
    ids = models.inputs(batch=2, left_pad=(0, 0))[0]
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(lm.generate(ids, **kw), ref.generate(ids, **kw))


def check_attributes_handed_back(lm, path: str, changes: dict):
    """The attributes of the fused attention at ``path`` set while fused (``changes``: name -> value) are the original
    module's after unfuse; returns the original module."""
    fuse(lm)
    fused = lm.get_submodule(path)
    for k, v in changes.items():
        setattr(fused, k, v)
    unfuse(lm)
    original = lm.get_submodule(path)
    assert {k: getattr(original, k) for k in changes} == changes
    return original


def check_the_bare_module_is_a_skipped_row(module, name: str):
    """``fuse`` of an attention module itself (no parent to replace it in): one skipped row pointing at
    ``name.from_module``."""
    alone = fuse(module)
    assert [(r.kind, r.fused) for r in alone.rows] == [("attention", False)]
    assert f"use {name}.from_module(model)" in alone.rows[0].reason, alone.rows[0].reason


def check_a_second_fuse_holds(lm, inner: str, name: str):
    """``fuse(lm.<inner>)`` then ``fuse(lm)``: the attention rows held (fused by the earlier call); unfuse of the
    inner model puts back its attention, of class ``name``, at the first block (``lm.<inner>``'s first attention
    row)."""
    fuse(getattr(lm, inner))
    report = fuse(lm)
    rows = [r for r in report.rows if r.kind == "attention"]
    assert len(rows) == 2 and all(r.fused and f"earlier fuse() of {inner}" in r.reason for r in rows)
    unfuse(getattr(lm, inner))
    assert type(lm.get_submodule(rows[0].path)).__name__ == name


def check_left_out_kept_dry_run_and_refused(lm, name: str, refuse, words: str):
    """``lm``'s two attention modules (of class ``name``) in fuse's report: counted as not requested where
    ``attention`` is left out of ``ops``; skipped rows, not eligible, under ``attention="keep"``; fused rows of a dry
    run, the modules left as they are; then, ``refuse(first module)`` having made a change its probe refuses and the
    second module's forward being set on its instance, skipped rows with the reasons (``words`` in the first's)."""
    left = fuse(lm, ops=["layer_norm"])
    assert left.not_requested["attention"] == 2 and not any(r.kind == "attention" for r in left.rows)
    unfuse(lm)
    kept = fuse(lm, attention="keep")
    rows = [r for r in kept.rows if r.kind == "attention"]
    assert len(rows) == 2 and not any(r.fused or r.eligible for r in rows) and rows[0].reason == "attention='keep'"
    first, second = (lm.get_submodule(r.path) for r in rows)
    assert type(first).__name__ == name
    unfuse(lm)
    dry = fuse(lm, dry_run=True)
    assert sum(r.fused for r in dry.rows if r.kind == "attention") == 2
    assert lm.get_submodule(rows[0].path) is first
    refuse(first)
    second.forward = second.forward   # (on the instance)
    report = fuse(lm)
    r0, r1 = [r for r in report.rows if r.kind == "attention"]
    assert not r0.fused and not r0.eligible and words in r0.reason, r0
    assert not r1.fused and "a forward set on the instance" in r1.reason
    unfuse(lm)


def check_a_wrapped_projection_is_refused(probe, candidate, att, name: str):
    """``att``'s projection ``name`` wrapped (a LoRA-style wrapper, say): still a candidate, refused by ``probe`` with
    the reason."""
    setattr(att, name, torch.nn.Sequential(getattr(att, name)))
    assert candidate(att)
    reason = probe(att).reason
    assert reason.startswith(f"{name} is Sequential, not a torch.nn.Linear"), reason


def check_probe_apart(probe, att, meta):
    """``probe`` passes ``meta`` (``att``'s class on the meta device: the probe's stand-in is its own, on the CPU) and
    leaves the caller's random stream as it was."""
    assert probe(meta).ok
    state = torch.random.get_rng_state()
    probe(att)
    assert torch.equal(torch.random.get_rng_state(), state)


# ------------------------------------------------------------------------------------------------ on a GPU
def cuda_float64_cases(shapes: dict):
    """The decorators of a GPU test against float64 (``test(monkeypatch, path, dtype, shape)``): marked ``cuda``,
    without the tuning table (``no_tuning_table``), for each of ``shapes``, path ``softmax`` and ``sdpa``
    (:func:`run_on_cuda`), fp32, fp16 and bf16."""
    marks = (pytest.mark.cuda, pytest.mark.usefixtures("no_tuning_table"),
             pytest.mark.parametrize("shape", list(shapes)), pytest.mark.parametrize("path", ["softmax", "sdpa"]),
             pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str))
    return lambda test: _marked(test, marks)


def run_on_cuda(monkeypatch, path: str, dtype: torch.dtype, forward, hidden: torch.Tensor, pad: int,
                g: torch.Generator):
    """``forward(hidden)`` (the fused module's output, ``hidden``'s shape) on the GPU, on the softmax path in strict
    mode or on SDPA (``path``: the small-problem rule sends every size there, ``PIPEGOOSE_IMPL_ATTENTION`` unset), and
    its gradient for a random output gradient that is 0 in the rows without a key (the second sequence's first
    ``pad``: their output does not depend on the input; eager's does): the output copied into poisoned memory and the
    gradient finite, the path counted once. Returns (output, gradient, output gradient)."""
    if path == "sdpa":
        monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "1")
        monkeypatch.delenv("PIPEGOOSE_IMPL_ATTENTION", raising=False)
    poison = torch.full(hidden.shape, float("nan"), device="cuda", dtype=dtype)
    dispatch.reset_stats()
    with dispatch.strict() if path == "softmax" else contextlib.nullcontext():
        out = forward(hidden)
        go = torch.randn(out.shape, generator=g, device="cuda").to(dtype)
        go[1, :pad] = 0
        (grad,) = torch.autograd.grad(out, hidden, go)
    poison.copy_(out)
    assert torch.isfinite(poison).all() and torch.isfinite(grad).all()
    stats = dispatch.stats()
    assert (stats["attention"] == {"sdpa": 1}) if path == "sdpa" else (stats["softmax.masked"] == {"pipegoose": 1})
    return out, grad, go


def check_against_float64_and_eager(dtype: torch.dtype, pad: int, factor: float, hidden: torch.Tensor, run,
                                    reference, eager):
    """``run`` (:func:`run_on_cuda`'s output, gradient and output gradient for ``hidden``) against ``reference``
    (the float64 formula of a float64 copy of ``hidden``, a leaf): fp32 within its tolerance (8 and 16 roundings);
    16 bits against ``eager`` too (the model's own module in ``dtype``, of a copy of ``hidden``), the rows without a
    key (the second sequence's first ``pad``) left out: the worst element within that tolerance, or where eager's
    own worst is beyond it (eager Bloom rounds ``scores + alibi`` to the dtype, 8 apart in bf16 at 1024-2047
    positions) within ``factor`` times eager's, and on average no farther from float64 than ``factor`` times
    eager."""
    out, grad, go = run
    hd = hidden.detach().double().requires_grad_()
    ref = reference(hd)
    (ref_grad,) = torch.autograd.grad(ref, hd, go.double())
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, **tol(dtype, 8))
        torch.testing.assert_close(grad.double(), ref_grad, **tol(dtype, 16))
        return
    he = hidden.detach().clone().requires_grad_()
    eager_out = eager(he)
    (eager_grad,) = torch.autograd.grad(eager_out, he, go)
    b, s, _ = out.shape
    keep = torch.ones(b, s, 1, dtype=torch.bool, device=out.device)
    keep[1, :pad] = False

    def err(x, r):
        return float(((x.detach().double() - r).abs() * keep).sum() / (keep.sum() * x.shape[-1]))

    def worst(x, r, scale):   # the largest |x - r| / (atol + rtol |r|): 1 is the tolerance's edge
        t = tol(dtype, scale)
        return float(((x.detach().double() - r).abs() / (t["atol"] + t["rtol"] * r.abs()) * keep).max())

    for name, x, e, r, scale in (("output", out, eager_out, ref, 8), ("gradient", grad, eager_grad, ref_grad, 16)):
        assert worst(x, r, scale) <= max(1.0, factor * worst(e, r, scale)), (
            name, "worst element / tolerance", worst(x, r, scale), "eager's", worst(e, r, scale))
        assert err(x, r) <= factor * err(e, r) + 1e-7, (name, "mean error", err(x, r), "eager's", err(e, r))


def check_trains_as_eager(lm, steps: int = 5):
    """``lm`` (bf16, on the GPU, in training) fused with the default rules against an unfused copy: the losses of
    ``steps`` AdamW steps on one batch within the training tolerance of each other, the attention on SDPA (each
    layer of the 2, every step), the fused losses falling."""
    from tolerances import TRAIN_LOSS_RTOL

    ref = copy.deepcopy(lm)
    fuse(lm)
    ids = torch.randint(1, models.VOCAB, (4, 128), device="cuda", generator=torch.Generator(device="cuda")
                        .manual_seed(0))
    losses = {}
    for name, m in (("fused", lm), ("eager", ref)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        losses[name] = []
        dispatch.reset_stats()
        for _ in range(steps):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
        if name == "fused":
            assert dispatch.stats()["attention"] == {"sdpa": 2 * steps}
    for a, b in zip(losses["fused"], losses["eager"]):
        assert abs(a - b) <= TRAIN_LOSS_RTOL * abs(b), losses
    assert losses["fused"][-1] < losses["fused"][0]
    return ids
