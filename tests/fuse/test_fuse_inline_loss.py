"""fuse(model) and the loss that BERT-style heads compute inline (``loss_fct = CrossEntropyLoss(); loss_fct(scores,
labels)``, ``CrossEntropyLoss`` a global of their modeling module): the dispatching subclass at that global, the hooks
of fused models, the report's row, the undo (CPU: the op's PyTorch path runs; a spy on
``pipegoose.nn.fusion.functional.cross_entropy`` sees each call that the subclass sends to the op)."""

from __future__ import annotations

import copy
import io
import threading

import pytest
import torch
import torch.nn.functional as F

from pipegoose.nn.fusion import dispatch
from pipegoose.nn.fusion import functional as PF
from pipegoose.nn.fusion.fuse import fuse, fusion_report, is_fused, unfuse
from pipegoose.nn.fusion.transformers import inline_loss as inline_mod
from pipegoose.nn.fusion.transformers import rope as rope_mod
from tolerances import TOLERANCES, tol

from . import models
from .test_fuse_cuda import _assert_parity

transformers = pytest.importorskip("transformers")
mb = pytest.importorskip("transformers.models.bert.modeling_bert")
mr = pytest.importorskip("transformers.models.roberta.modeling_roberta")
md = pytest.importorskip("transformers.models.distilbert.modeling_distilbert")
TORCH_CE = torch.nn.CrossEntropyLoss
MODULES = (mb, mr, md)

V, B, S, LABELS = models.VOCAB, 3, 11, 3
# the models of the tests: (modeling module, class name, MLM or classifier)
FAMILIES = {"bert_mlm": (mb, "BertForMaskedLM", "mlm"), "roberta_mlm": (mr, "RobertaForMaskedLM", "mlm"),
            "bert_cls": (mb, "BertForSequenceClassification", "cls"),
            "distilbert_cls": (md, "DistilBertForSequenceClassification", "cls"),
            # (a masked LM that calls a loss module of its own: self.mlm_loss_fct)
            "distilbert_mlm": (md, "DistilBertForMaskedLM", "own")}


@pytest.fixture(autouse=True)
def _restore_globals():
    """Every test leaves the modeling modules' CrossEntropyLoss as it found it (a failed test must not leak a patch),
    and the stacks of fused forwards empty."""
    yield
    for m in MODULES:
        m.CrossEntropyLoss = TORCH_CE
    inline_mod._USERS.clear()
    inline_mod._CHILD_USERS.clear()
    inline_mod._active.stack = []


@pytest.fixture
def spy(monkeypatch):
    """The calls of pipegoose.nn.fusion.functional.cross_entropy: (thread id, logits dtype, logits shape)."""
    calls = []
    real = PF.cross_entropy

    def cross_entropy(logits, target, **kw):
        calls.append((threading.get_ident(), logits.dtype, tuple(logits.shape)))
        return real(logits, target, **kw)

    monkeypatch.setattr(PF, "cross_entropy", cross_entropy)
    return calls


def _config(family: str):
    tr = transformers
    num = dict(vocab_size=V, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=LABELS,
               attn_implementation="eager")
    size = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    if family.startswith("bert"):
        return tr.BertConfig(**size, **num)
    if family.startswith("roberta"):
        return tr.RobertaConfig(**size, **num, max_position_embeddings=64, pad_token_id=1)
    return tr.DistilBertConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4, hidden_dim=64, dropout=0.0,
                               attention_dropout=0.0, seq_classif_dropout=0.0, num_labels=LABELS,
                               attn_implementation="eager")


def _model(family: str, dtype=torch.float32, seed: int = 0):
    module, name, _ = FAMILIES[family]
    torch.manual_seed(seed)
    return getattr(module, name)(_config(family)).to(dtype).eval()


def _batch(family: str) -> dict:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, V, (B, S), generator=g)
    if FAMILIES[family][2] != "cls":
        labels = ids.clone()
        labels[1, :4] = -100
        labels[2, 6] = -100
    else:
        labels = torch.randint(0, LABELS, (B,), generator=g)
    return dict(input_ids=ids, attention_mask=torch.ones(B, S, dtype=torch.long), labels=labels)


def _run(model, batch):
    """(loss, the parameters' gradients) of model(**batch).loss, backward."""
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rows(report):
    return [r for r in report.rows if r.kind == "cross_entropy"]


def _routed(module) -> bool:
    return module.CrossEntropyLoss is inline_mod.DispatchingCrossEntropyLoss


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", [f for f, (_, _, kind) in FAMILIES.items() if kind == "mlm"])
def test_the_inline_loss_runs_our_op_and_equals_the_unfused_one(family, dtype, spy):
    """Masked-LM heads (BERT, RoBERTa): after fuse, the model's loss is the
    unfused one's, of the same dtype, and so are the gradients (fp32: bit for bit, the op's path being
    F.cross_entropy on the same logits; bf16, where the op computes in fp32 and PyTorch's CPU path rounds each step:
    against a float64 copy of the model, the fused run's error within twice the unfused run's plus bf16's
    tolerance, as tests/fuse/test_fuse_cuda.py compares); our op ran, once per forward; an unfused model of the same
    class meanwhile runs PyTorch's path; unfuse restores torch.nn.CrossEntropyLoss at the global and PyTorch's
    path."""
    module = FAMILIES[family][0]
    model, other = _model(family, dtype), _model(family, dtype, seed=1)
    batch = _batch(family)
    ref64 = _run(copy.deepcopy(model).double(), batch)
    ref, ref_g = _run(model, batch)
    other_ref, _ = _run(other, batch)
    assert not spy

    report = fuse(model, ops=["cross_entropy"])
    (row,) = _rows(report)
    assert (row.path, row.original, row.replacement, row.fused, row.eligible) == (
        "", "CrossEntropyLoss (inline)", "op cross_entropy", True, True), row
    assert f"{module.__name__.rsplit('.', 1)[-1]}.CrossEntropyLoss -> a dispatching subclass" in row.reason, row
    assert is_fused(model) and _routed(module) and inline_mod.hooked(model)
    assert "_loss_function" not in model.__dict__

    dispatch.reset_stats()
    loss, g = _run(model, batch)
    assert [c[1:] for c in spy] == [(dtype, (B * S, V))]
    assert dispatch.stats()["cross_entropy"] == {"torch": 1}   # through the dispatcher (its PyTorch path here)
    assert loss.dtype == ref.dtype == dtype and g.keys() == ref_g.keys()
    if dtype == torch.float32:
        assert torch.equal(loss, ref), (loss, ref)
        for n in ref_g:
            assert torch.equal(g[n], ref_g[n]), n
    else:
        torch.testing.assert_close(loss, ref, **TOLERANCES[dtype])
        as64 = [(t.double(), {n: x.double() for n, x in d.items()}) for t, d in ((loss, g), (ref, ref_g))]
        _assert_parity(*as64, ref64, dtype)
    spy.clear()
    assert torch.equal(_run(other, batch)[0], other_ref) and not spy   # not fused: PyTorch's path

    assert unfuse(model) and not is_fused(model)
    assert module.CrossEntropyLoss is TORCH_CE and not inline_mod.hooked(model)
    again, _ = _run(model, batch)
    assert torch.equal(again, ref) and not spy


@pytest.mark.parametrize("family", [f for f, (_, _, kind) in FAMILIES.items() if kind == "cls"])
def test_a_classifiers_loss_is_left_to_pytorch_with_the_reason(family, spy):
    """A classifier (no output embeddings: its CrossEntropyLoss is over a few labels) gets a skipped row, not
    eligible, with the reason; nothing is hooked or patched, and its loss is PyTorch's."""
    module = FAMILIES[family][0]
    model = _model(family)
    batch = _batch(family)
    ref = model(**batch).loss
    report = fuse(model)
    (row,) = _rows(report)
    assert (row.original, row.replacement, row.fused, row.eligible) == ("CrossEntropyLoss (inline)", None, False,
                                                                        False), row
    assert "has no output embeddings: a classifier" in row.reason, row
    assert module.CrossEntropyLoss is TORCH_CE and not inline_mod.hooked(model)
    assert torch.equal(model(**batch).loss, ref) and not spy
    unfuse(model)


def test_a_forward_that_writes_nn_cross_entropy_loss_is_left_alone():
    """ELECTRA's masked-LM forward writes ``nn.CrossEntropyLoss()`` (torch's class through ``nn``, not the modeling
    module's global): nothing to route, the "its own loss" row, the global untouched."""
    me = pytest.importorskip("transformers.models.electra.modeling_electra")
    cfg = transformers.ElectraConfig(vocab_size=V, embedding_size=16, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=4, intermediate_size=64)
    model = transformers.ElectraForMaskedLM(cfg)
    assert inline_mod.target(model) is None
    (row,) = _rows(fuse(model, ops=["cross_entropy"]))
    assert (row.original, row.fused, row.eligible) == ("its own loss", False, False), row
    assert getattr(me, "CrossEntropyLoss", TORCH_CE) is TORCH_CE and not inline_mod.hooked(model)
    unfuse(model)


def test_an_unfused_model_run_inside_a_fused_forward_computes_its_own_loss(spy):
    """A teacher run from a hook of the fused student's head (distillation): the teacher's loss module is called by
    the teacher's forward, not the student's, so it runs PyTorch's path; the student's own loss runs the op."""
    student, teacher = _model("bert_mlm"), _model("bert_mlm", seed=1)
    batch = _batch("bert_mlm")
    teacher_ref = teacher(**batch).loss
    fuse(student, ops=["cross_entropy"])
    got = []
    h = student.cls.register_forward_hook(lambda *a: got.append(teacher(**batch).loss))
    student(**batch)
    h.remove()
    assert torch.equal(got[0], teacher_ref)
    assert [c[2] for c in spy] == [(B * S, V)]   # (the student's)
    unfuse(student)


def test_bert_for_pretraining_runs_its_masked_lm_loss_on_our_op(spy):
    """BertForPreTraining computes two losses inline (masked LM over the vocabulary, next sentence over 2 classes):
    the masked LM's runs the op, the next sentence's PyTorch's path; the total is the unfused one's."""
    torch.manual_seed(0)
    model = transformers.BertForPreTraining(_config("bert_mlm")).eval()
    batch = _batch("bert_mlm")
    batch["next_sentence_label"] = torch.tensor([0, 1, 1])
    ref = model(**batch).loss
    fuse(model, ops=["cross_entropy"])
    got = model(**batch).loss
    assert [c[2] for c in spy] == [(B * S, V)]
    assert torch.equal(got, ref)
    unfuse(model)


def test_two_fused_models_share_the_global_until_the_last_is_unfused(spy):
    """The class is put at the global once: unfusing the first of two fused models keeps it (the second's calls still
    run the op), unfusing the second puts torch.nn.CrossEntropyLoss back. A model of another modeling module
    (RoBERTa's) has its own global, restored on its own."""
    a, b, c = _model("bert_mlm"), _model("bert_mlm", seed=1), _model("roberta_mlm")
    fuse(a, ops=["cross_entropy"])
    fuse(b, ops=["cross_entropy"])
    fuse(c, ops=["cross_entropy"])
    assert _routed(mb) and _routed(mr)
    assert unfuse(a) and _routed(mb)
    b(**_batch("bert_mlm"))
    assert len(spy) == 1
    spy.clear()
    a(**_batch("bert_mlm"))
    assert not spy                                   # unfused: no hooks, PyTorch's path
    assert unfuse(c) and mr.CrossEntropyLoss is TORCH_CE and _routed(mb)
    assert unfuse(b) and mb.CrossEntropyLoss is TORCH_CE


def _in_forward(model, fn, monkeypatch=None):
    """Run ``fn()`` inside ``model``'s forward (a forward hook of its head, which its forward calls), and its forward
    to the end; returns what ``fn`` returned. With ``monkeypatch``, the class takes ``fn``'s calls for calls made by
    the forward itself (``_fused_caller`` returns the model where the stack's innermost entry is it: what a call from
    the forward's frame finds; the frame test itself is the real forwards' in the other tests)."""
    if monkeypatch is not None:
        def as_if_direct():
            stack = getattr(inline_mod._active, "stack", None)
            return stack[-1][0]() if stack else None

        monkeypatch.setattr(inline_mod, "_fused_caller", as_if_direct)
    out = []
    head = model.cls if hasattr(model, "cls") else model.classifier
    h = head.register_forward_hook(lambda *a: out.append(fn()))
    try:
        model(**{k: v for k, v in _batch("bert_mlm").items() if k != "labels"})
    finally:
        h.remove()
    return out[0]


def _calls(dtype=torch.float32):
    """Calls of modeling_bert's CrossEntropyLoss: (name, construction kwargs, input, target, whether it qualifies)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, V, generator=g).to(dtype).requires_grad_(True)   # (over the model's vocabulary)
    t = torch.tensor([0, 4, -100, 2, 1, V - 1])
    probs = torch.softmax(torch.randn(6, V, generator=g), -1).to(dtype)
    return [
        ("plain", {}, x, t, True),
        ("sum", dict(reduction="sum"), x, t, True),
        ("none", dict(reduction="none"), x, t, True),
        ("ignore_index", dict(ignore_index=4), x, t.clamp(min=0), True),
        ("label_smoothing", dict(label_smoothing=0.1), x, t, False),
        ("weight", dict(weight=torch.rand(V, generator=g).to(dtype)), x, t, False),
        ("probabilities", {}, x, probs, False),
        ("uint8 target", {}, x, t.clamp(min=0).to(torch.uint8), False),
        ("3-D", {}, x.detach().reshape(2, 3, V).transpose(1, 2).requires_grad_(True), t.reshape(2, 3), False),
        ("another width", {}, x.detach()[:, :5].clone().requires_grad_(True), t.clamp(0, 4), False),
        ("fp64", {}, x.detach().double().requires_grad_(True), t, False),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_only_calls_the_op_computes_as_pytorch_does_run_it(dtype, spy, monkeypatch):
    """Inside a fused forward, calls with label smoothing, class weights, probability targets, uint8 targets, more
    dimensions, fp64 or meta tensors, or scores of another width than the model's vocabulary run
    torch.nn.CrossEntropyLoss.forward (their results and gradients PyTorch's, bit for bit); the others (reductions
    mean, sum, none; another ignore_index) run the op, their results of PyTorch's dtype and within its rounding.
    Outside a fused forward, none of them runs the op."""
    model = _model("bert_mlm")
    fuse(model, ops=["cross_entropy"])
    for name, kw, x, t, qualifies in _calls(dtype):
        want = TORCH_CE(**kw)(x, t)
        (want_g,) = torch.autograd.grad(want.sum(), x)
        spy.clear()
        got = _in_forward(model, lambda: mb.CrossEntropyLoss(**kw)(x, t), monkeypatch)
        assert isinstance(mb.CrossEntropyLoss(**kw), TORCH_CE)
        assert len(spy) == int(qualifies), (name, spy)
        (got_g,) = torch.autograd.grad(got.sum(), x)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        if qualifies and dtype != torch.float32:
            torch.testing.assert_close(got, want, **tol(dtype), msg=lambda m: f"{name}: {m}")
            torch.testing.assert_close(got_g, want_g, **tol(dtype), msg=lambda m: f"{name}: {m}")
        else:
            assert torch.equal(got, want) and torch.equal(got_g, want_g), name
        spy.clear()
        mb.CrossEntropyLoss(**kw)(x, t)                 # outside any fused forward
        assert not spy, name
    x, t = _calls(dtype)[0][2:4]
    got = _in_forward(model, lambda: mb.CrossEntropyLoss()(x.to("meta"), t.to("meta")),   # (meta: not dispatched)
                      monkeypatch)
    assert got.device.type == "meta" and got.dtype == dtype and not spy
    unfuse(model)


def test_autocast_keeps_the_loss_dtype_of_pytorch(spy):
    """Under CPU autocast PyTorch computes cross_entropy in fp32 (autocast's fp32 list): the fused loss is fp32 as
    well, and the same."""
    model = _model("bert_mlm")
    batch = _batch("bert_mlm")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(**batch).loss
    fuse(model, ops=["cross_entropy"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(**batch).loss
    assert len(spy) == 1 and spy[0][1] == torch.bfloat16
    assert got.dtype == ref.dtype == torch.float32 and torch.equal(got, ref)
    unfuse(model)


def test_torch_compile_tracing_runs_pytorchs_forward(spy, monkeypatch):
    """While torch.compile traces (torch.compiler.is_compiling()), neither the hooks nor the class do anything: a
    forward traced whole, and a call made while tracing inside a fused forward already entered, run PyTorch's
    forward."""
    model = _model("bert_mlm")
    batch = _batch("bert_mlm")
    ref = model(**batch).loss
    fuse(model, ops=["cross_entropy"])
    tracing = {"on": True}
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: tracing["on"])
    assert torch.equal(model(**batch).loss, ref) and not spy
    assert not getattr(inline_mod._active, "stack", None)       # the hooks did nothing
    tracing["on"] = False
    x, t = torch.randn(4, V), torch.tensor([0, 1, 2, 3])

    def traced_call():
        tracing["on"] = True
        try:
            return mb.CrossEntropyLoss()(x, t)
        finally:
            tracing["on"] = False

    assert torch.equal(_in_forward(model, traced_call, monkeypatch), TORCH_CE()(x, t)) and not spy
    assert torch.equal(_in_forward(model, lambda: mb.CrossEntropyLoss()(x, t), monkeypatch), TORCH_CE()(x, t))
    assert len(spy) == 1                                          # (the same call, not tracing: the op)
    unfuse(model)


def test_calls_from_another_thread_during_a_fused_forward_run_pytorchs_path(spy):
    """The fused forwards under way are per thread: while one thread is inside a fused forward, another thread's
    calls (the global called directly, an unfused model of the class) run PyTorch's path; the fused forward's own
    call runs the op, in its thread."""
    model, other = _model("bert_mlm"), _model("bert_mlm", seed=1)
    batch = _batch("bert_mlm")
    other_ref = other(**batch).loss
    fuse(model, ops=["cross_entropy"])
    inside, release = threading.Event(), threading.Event()

    def wait(*args):
        inside.set()
        assert release.wait(30)

    h = model.cls.register_forward_hook(wait)
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("loss", model(**batch).loss))
    worker.start()
    try:
        assert inside.wait(30)
        x, t = torch.randn(4, V), torch.tensor([0, 1, 2, 3])
        assert torch.equal(mb.CrossEntropyLoss()(x, t), TORCH_CE()(x, t))
        assert torch.equal(other(**batch).loss, other_ref)
        assert not spy
    finally:
        release.set()
        worker.join(30)
        h.remove()
    assert "loss" in result and [c[0] for c in spy] == [worker.ident]
    assert rope_mod._active is not inline_mod._active             # (rope's stack is another)
    unfuse(model)


def test_copies_and_pickles_of_a_fused_model_work(spy):
    """deepcopy and torch.save / torch.load of a fused model: the copy carries the hooks (module-level functions) and
    computes the same loss, on the op while the original keeps the class installed, on PyTorch's path once the
    original is unfused; unfuse of the copy says it has no record; fuse of the copy puts its own pair of hooks in
    place of the one it carries, and its unfuse removes them and puts the global back (a review: the copied pair
    stayed, so a second unfuse raised and a later fuse of another model routed the "unfused" copy's loss)."""
    model = _model("bert_mlm")
    batch = _batch("bert_mlm")
    ref = model(**batch).loss
    fuse(model, ops=["cross_entropy"])
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    copies = [copy.deepcopy(model), torch.load(buf, weights_only=False)]
    for twin in copies:
        assert inline_mod.hooked(twin)
        spy.clear()
        assert torch.equal(twin(**batch).loss, ref) and len(spy) == 1
        with pytest.raises(RuntimeError, match="holds fused modules"):
            unfuse(twin)
    assert unfuse(model) and mb.CrossEntropyLoss is TORCH_CE
    twin = copies[0]
    spy.clear()
    assert torch.equal(twin(**batch).loss, ref) and not spy
    (row,) = _rows(fuse(twin, ops=["cross_entropy"]))
    assert row.fused and _routed(mb) and len(twin._forward_pre_hooks) == len(twin._forward_hooks) == 1
    assert torch.equal(twin(**batch).loss, ref) and len(spy) == 1
    assert unfuse(twin) and mb.CrossEntropyLoss is TORCH_CE
    assert not inline_mod.hooked(twin) and not twin._forward_hooks_always_called and not is_fused(twin)
    assert unfuse(twin) is False
    other = _model("bert_mlm", seed=1)
    fuse(other, ops=["cross_entropy"])   # (the class back at the global: the unfused copy's calls stay PyTorch's)
    spy.clear()
    assert torch.equal(twin(**batch).loss, ref) and not spy
    assert unfuse(other)


def test_dry_run_and_ops_without_cross_entropy_change_nothing():
    model = _model("bert_mlm")
    report = fuse(model, ops=["cross_entropy"], dry_run=True)
    (row,) = _rows(report)
    assert row.fused and report.dry_run
    assert mb.CrossEntropyLoss is TORCH_CE and not inline_mod.hooked(model) and not is_fused(model)
    report = fuse(model, ops=["layer_norm"])
    assert not _rows(report) and report.not_requested["cross_entropy"] == 1
    assert mb.CrossEntropyLoss is TORCH_CE and not inline_mod.hooked(model)
    assert unfuse(model)


def test_a_global_patched_by_another_library_is_left_alone(spy):
    """A modeling module whose CrossEntropyLoss is not torch's (another library's patch) is not touched: the row is
    skipped, not eligible, with the reason. A global replaced while fused stays at unfuse."""
    class TheirLoss(TORCH_CE):
        pass

    mb.CrossEntropyLoss = TheirLoss
    model = _model("bert_mlm")
    report = fuse(model, ops=["cross_entropy"])
    (row,) = _rows(report)
    assert (row.fused, row.eligible, row.replacement) == (False, False, None), row
    assert "modeling_bert.CrossEntropyLoss is" in row.reason and "TheirLoss" in row.reason, row
    assert "not torch.nn.CrossEntropyLoss" in row.reason, row
    assert mb.CrossEntropyLoss is TheirLoss and not inline_mod.hooked(model) and not is_fused(model)
    with pytest.raises(ValueError, match="not torch.nn.CrossEntropyLoss"):
        inline_mod.install(model, inline_mod.target(model))

    mb.CrossEntropyLoss = TORCH_CE
    fuse(model, ops=["cross_entropy"])
    mb.CrossEntropyLoss = TheirLoss
    assert unfuse(model) and mb.CrossEntropyLoss is TheirLoss and not inline_mod.hooked(model)


def test_a_loss_routed_by_another_fuse_call_is_held():
    """As for the other loss rows: fuse(model) then fuse(wrapper holding it) reports the model's inline loss as fused
    by the earlier call, whatever ops says, and records nothing for it; fusion_report follows that call's unfuse.
    The other way round, the row names the enclosing model."""
    lm = _model("bert_mlm")
    wrap = models.Wrapper(lm)
    fuse(lm, ops=["cross_entropy"])
    for ops in (["cross_entropy"], ["layer_norm"]):
        report = fuse(wrap, ops=ops)
        (row,) = _rows(report)
        assert (row.path, row.fused, row.eligible, row.replacement) == ("base_model", True, True,
                                                                        "op cross_entropy"), row
        assert "earlier fuse() of base_model (BertForMaskedLM)" in row.reason, row
        assert "cross_entropy" not in report.not_requested
        if is_fused(wrap):
            assert unfuse(wrap)
            fuse(lm, ops=["cross_entropy"])     # (the wrapper's unfuse reverted the part too)
    assert len(lm._forward_pre_hooks) == 1
    fuse(wrap, ops=["cross_entropy", "layer_norm"])
    unfuse(lm)
    (row,) = _rows(fusion_report(wrap))
    assert not row.fused and "reverted since by its unfuse()" in row.reason, row
    assert unfuse(wrap) and mb.CrossEntropyLoss is TORCH_CE

    fuse(wrap, ops=["cross_entropy"])
    (row,) = _rows(fuse(lm, ops=["cross_entropy"]))
    assert row.fused and "earlier fuse() of an enclosing Wrapper" in row.reason, row
    assert not is_fused(lm) and len(lm._forward_pre_hooks) == 1
    assert unfuse(wrap) and mb.CrossEntropyLoss is TORCH_CE and not inline_mod.hooked(lm)


def test_inside_peft_the_inline_loss_is_skipped():
    """PEFT's tuners call the model's forward directly (no module hooks run), so the model's calls would never reach
    the op: skipped, not eligible, with the reason; nothing changed."""
    Tuner = type("LoraModel", (models.Wrapper,), {"__module__": "peft.tuners.lora.model",
                                                  "forward": lambda self, **kw: self.base_model.forward(**kw)})
    tuner = Tuner(_model("bert_mlm"))
    (row,) = _rows(fuse(tuner, ops=["cross_entropy"]))
    assert (row.path, row.fused, row.eligible) == ("base_model", False, False), row
    assert "inside LoraModel (PEFT)" in row.reason and "runs no module hooks" in row.reason, row
    assert mb.CrossEntropyLoss is TORCH_CE and not inline_mod.hooked(tuner.base_model) and not is_fused(tuner)
    assert "cross_entropy" not in fuse(tuner, ops=["layer_norm"], dry_run=True).not_requested   # (nor counted)


def test_keyboard_interrupt_in_a_fused_forward_leaves_nothing_dispatched(spy):
    """A KeyboardInterrupt skips the always-called hook: the entry stays on the stack, but the class also finds the
    fused forward among its callers, so an unfused model's calls run PyTorch's path afterwards."""
    model, other = _model("bert_mlm"), _model("bert_mlm", seed=1)
    batch = _batch("bert_mlm")
    fuse(model, ops=["cross_entropy"])

    def interrupt(*args):
        raise KeyboardInterrupt

    h = model.cls.register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model(**batch)
    h.remove()
    assert inline_mod._active.stack
    other(**batch)
    assert not spy
    model(**batch)
    assert len(spy) == 1
    unfuse(model)


# ------------------------------------------------------------------------ a loss module of the model's own
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_loss_module_of_the_models_own_runs_our_op(dtype, spy):
    """DistilBertForMaskedLM calls ``self.mlm_loss_fct`` (a child ``torch.nn.CrossEntropyLoss``): after fuse that child
    is the same object with the dispatching class (its state_dict and the model's as they were), the row names it,
    the loss and gradients are the unfused ones (fp32 bit for bit; bf16 against a float64 copy as above), the op ran
    once per forward, an unfused DistilBERT runs PyTorch's path, the module's global is untouched, and unfuse puts
    torch's class back on the same object."""
    model, other = _model("distilbert_mlm", dtype), _model("distilbert_mlm", dtype, seed=1)
    batch = _batch("distilbert_mlm")
    child, keys = model.mlm_loss_fct, list(model.state_dict())
    ref64 = _run(copy.deepcopy(model).double(), batch)
    ref, ref_g = _run(model, batch)
    other_ref, _ = _run(other, batch)

    (row,) = _rows(fuse(model, ops=["cross_entropy"]))
    assert (row.original, row.replacement, row.fused, row.eligible) == (
        "CrossEntropyLoss (mlm_loss_fct)", "op cross_entropy", True, True), row
    assert "DistilBertForMaskedLM.mlm_loss_fct -> its class a dispatching subclass" in row.reason, row
    assert model.mlm_loss_fct is child and type(child) is inline_mod.DispatchingCrossEntropyLoss
    assert type(other.mlm_loss_fct) is TORCH_CE and getattr(md, "CrossEntropyLoss", TORCH_CE) is TORCH_CE
    assert list(model.state_dict()) == keys and inline_mod.is_user(model) and is_fused(model)

    loss, g = _run(model, batch)
    assert [c[1:] for c in spy] == [(dtype, (B * S, V))]
    assert loss.dtype == dtype and g.keys() == ref_g.keys()
    if dtype == torch.float32:
        assert torch.equal(loss, ref) and all(torch.equal(g[n], ref_g[n]) for n in ref_g)
    else:
        torch.testing.assert_close(loss, ref, **TOLERANCES[dtype])
        as64 = [(t.double(), {n: x.double() for n, x in d.items()}) for t, d in ((loss, g), (ref, ref_g))]
        _assert_parity(*as64, ref64, dtype)
    spy.clear()
    assert torch.equal(_run(other, batch)[0], other_ref) and not spy

    assert unfuse(model) and not is_fused(model) and not inline_mod.hooked(model)
    assert model.mlm_loss_fct is child and type(child) is TORCH_CE
    assert torch.equal(_run(model, batch)[0], ref) and not spy


def test_a_loss_module_called_by_hand_or_from_elsewhere_runs_pytorchs_path(spy):
    """The child's class dispatches only the fused model's own calls over its vocabulary: called by hand (outside the
    forward) or with another width it runs PyTorch's forward."""
    model = _model("distilbert_mlm")
    fuse(model, ops=["cross_entropy"])
    logits, target = torch.randn(5, V), torch.randint(0, V, (5,))
    assert torch.equal(model.mlm_loss_fct(logits, target), F.cross_entropy(logits, target)) and not spy
    model(**_batch("distilbert_mlm"))
    assert len(spy) == 1
    assert unfuse(model)


def test_a_loss_module_of_a_subclass_is_left_alone_with_the_reason(spy):
    """A child loss module of another class (the user's subclass, whose forward may differ) is not touched: the row is
    skipped with the reason, nothing hooked."""
    class TheirLoss(TORCH_CE):
        pass

    model = _model("distilbert_mlm")
    model.mlm_loss_fct = TheirLoss()
    (row,) = _rows(fuse(model, ops=["cross_entropy"]))
    assert (row.original, row.fused, row.eligible) == ("CrossEntropyLoss (mlm_loss_fct)", False, False), row
    assert "TheirLoss, a subclass of torch.nn.CrossEntropyLoss" in row.reason, row
    assert type(model.mlm_loss_fct) is TheirLoss and not inline_mod.hooked(model) and not is_fused(model)
    model(**_batch("distilbert_mlm"))
    assert not spy


def test_a_loss_module_of_the_models_own_in_copies_and_a_second_model(spy):
    """A deepcopy of the fused DistilBERT carries the hooks and the child's class: its loss is the same, on the op;
    unfuse of the copy says it has no record; fuse then unfuse of the copy puts torch's class back on the copy's child
    and leaves the original fused. Two fused models each keep their own child's class until their own unfuse."""
    model = _model("distilbert_mlm")
    batch = _batch("distilbert_mlm")
    ref = model(**batch).loss
    fuse(model, ops=["cross_entropy"])
    twin = copy.deepcopy(model)
    assert type(twin.mlm_loss_fct) is inline_mod.DispatchingCrossEntropyLoss and inline_mod.hooked(twin)
    spy.clear()
    assert torch.equal(twin(**batch).loss, ref) and len(spy) == 1
    with pytest.raises(RuntimeError, match="holds fused modules"):
        unfuse(twin)
    (row,) = _rows(fuse(twin, ops=["cross_entropy"]))
    assert row.fused and len(twin._forward_pre_hooks) == 1
    assert unfuse(twin) and type(twin.mlm_loss_fct) is TORCH_CE and not inline_mod.hooked(twin)
    assert type(model.mlm_loss_fct) is inline_mod.DispatchingCrossEntropyLoss and inline_mod.is_user(model)
    spy.clear()
    assert torch.equal(twin(**batch).loss, ref) and not spy
    assert torch.equal(model(**batch).loss, ref) and len(spy) == 1
    assert unfuse(model) and type(model.mlm_loss_fct) is TORCH_CE


def test_a_loss_module_shared_by_two_models_keeps_its_class_until_the_last_is_unfused(spy):
    """One child shared by two fused models of different classes (a review: the registry was keyed by class name and
    id, so unfusing the first put torch's class back under the second, whose loss left the op): it keeps the
    dispatching class until the second is unfused."""
    class MyMLM(md.DistilBertForMaskedLM):
        pass

    a = _model("distilbert_mlm")
    torch.manual_seed(1)
    b = MyMLM(_config("distilbert_mlm")).eval()
    b.mlm_loss_fct = a.mlm_loss_fct
    batch = _batch("distilbert_mlm")
    fuse(a, ops=["cross_entropy"])
    fuse(b, ops=["cross_entropy"])
    assert unfuse(a) and type(b.mlm_loss_fct) is inline_mod.DispatchingCrossEntropyLoss and inline_mod.is_user(b)
    spy.clear()
    b(**batch)
    assert len(spy) == 1
    assert unfuse(b) and type(b.mlm_loss_fct) is TORCH_CE and not inline_mod._CHILD_USERS


@pytest.mark.parametrize("setting", [dict(label_smoothing=0.1), dict(weight=torch.ones(V)), dict(ignore_index=2.0)],
                         ids=["label_smoothing", "weight", "float_ignore_index"])
def test_a_loss_module_with_settings_the_op_does_not_compute_is_skipped(setting, spy):
    """A child whose settings the op does not compute (a review: such a row said fused while no call ever ran the op)
    gets a skipped row naming the setting; nothing is hooked or swapped."""
    model = _model("distilbert_mlm")
    model.mlm_loss_fct = TORCH_CE(**setting)
    (row,) = _rows(fuse(model, ops=["cross_entropy"]))
    assert (row.fused, row.eligible, row.replacement) == (False, False, None), row
    name = next(iter(setting))
    assert f"DistilBertForMaskedLM.mlm_loss_fct has {'a class weight' if name == 'weight' else name}" in row.reason
    assert type(model.mlm_loss_fct) is TORCH_CE and not inline_mod.hooked(model) and not is_fused(model)


def test_luke_routes_its_word_loss_and_leaves_its_entity_loss():
    """LukeForMaskedLM calls its ``loss_fn`` child twice: over its vocabulary (the op) and over its entity vocabulary
    (another width: PyTorch's path); the total is the unfused one's."""
    cfg = transformers.LukeConfig(vocab_size=V, entity_vocab_size=17, hidden_size=32, entity_emb_size=16,
                                  num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.LukeForMaskedLM(cfg).eval()
    g = torch.Generator().manual_seed(5)
    ids, ent = torch.randint(3, V, (B, S), generator=g), torch.randint(1, 17, (B, 3), generator=g)
    batch = dict(input_ids=ids, labels=ids, entity_ids=ent, entity_labels=ent,
                 entity_attention_mask=torch.ones(B, 3, dtype=torch.long),
                 entity_position_ids=torch.zeros(B, 3, 1, dtype=torch.long))
    ref = model(**batch).loss
    calls = []
    real = PF.cross_entropy
    (row,) = _rows(fuse(model, ops=["cross_entropy"]))
    assert (row.original, row.fused) == ("CrossEntropyLoss (loss_fn)", True), row
    try:
        PF.cross_entropy = lambda logits, *a, **k: (calls.append(tuple(logits.shape)), real(logits, *a, **k))[1]
        got = model(**batch).loss
    finally:
        PF.cross_entropy = real
    assert calls == [(B * S, V)] and torch.equal(got, ref)
    assert unfuse(model) and type(model.loss_fn) is TORCH_CE


# ---------------------------------------------------------------------------------------------------- on a GPU
@pytest.mark.cuda
@pytest.mark.usefixtures("no_tuning_table")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("family", ["bert_mlm", "distilbert_mlm"])
def test_fused_bert_masked_lm_on_the_kernel_against_float64(family, dtype):
    """A fused BertForMaskedLM (the global) and DistilBertForMaskedLM (its own loss module) on the GPU, in strict mode
    (a fallback raises): the kernel runs for its loss, of the model's dtype; the loss and the logits' gradient are
    within the dtype's tolerance of F.cross_entropy in float64 on the same logits."""
    model = _model(family, dtype).cuda()
    batch = {k: v.cuda() for k, v in _batch(family).items()}
    fuse(model, ops=["cross_entropy"])
    dispatch.reset_stats()
    try:
        with dispatch.strict():
            out = model(**batch)
            out.logits.retain_grad()
            out.loss.backward()
        assert dispatch.stats()["cross_entropy"] == {"pipegoose": 1}, dispatch.stats()
    finally:
        unfuse(model)
    assert out.loss.dtype == dtype
    logits = out.logits.detach().double().requires_grad_(True)
    want = F.cross_entropy(logits.view(-1, V), batch["labels"].view(-1))
    want.backward()
    torch.testing.assert_close(out.loss.double(), want.detach(), **TOLERANCES[dtype])
    torch.testing.assert_close(out.logits.grad.double(), logits.grad, **TOLERANCES[dtype])
