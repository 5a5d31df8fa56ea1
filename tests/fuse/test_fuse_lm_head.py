"""fuse(model, ops=[..., "linear_cross_entropy"]): a causal LM's head and loss in one (CPU: the functional's reference
path runs, so the fused model's loss and gradients equal the unfused model's bit for bit).

What is checked: the five causal architectures of ``models`` (Llama, GPT-2, GPT-NeoX, OPT, Bloom); training with
labels gives transformers' loss (mean, ``num_items_in_batch``, ``shift_labels``, another ``ignore_index``) with
``logits`` None, every other call (eval, no labels, ``return_dict=False``, ``logits_to_keep``) the model's own output;
the report's row and the reasons of models it skips; dry runs, unfuse, the ``fused`` context, copies and pickles; the
default ops leave it out.
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch

from pipegoose.nn.fusion.fuse import DEFAULT_OPS, OPS, fuse, fused, is_fused, unfuse
from pipegoose.nn.fusion.transformers import lm_head

from . import models

CAUSAL = ("llama", "gpt2", "gpt_neox", "opt", "bloom")
KIND = "linear_cross_entropy"


def _lm(arch="llama", seed=0, **cfg):
    import transformers as tr

    torch.manual_seed(seed)
    cls = tr.AutoModelForMaskedLM if arch == "bert" else tr.AutoModelForCausalLM
    return cls.from_config(models.config(arch, "eager", **cfg), attn_implementation="eager").train()


def _batch():
    ids, mask = models.inputs(left_pad=(0, 0, 0))
    labels = ids.clone()
    labels[1, :4] = -100
    labels[2, 6] = -100
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def _run(model, **kw):
    """(output, grads by parameter name) of one forward + backward of the loss."""
    model.zero_grad(set_to_none=True)
    out = model(**dict(_batch(), **kw))
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rows(report):
    return [r for r in report.rows if r.kind == KIND]


def _same(a, b):
    (oa, ga), (ob, gb) = a, b
    assert torch.equal(oa.loss, ob.loss), (oa.loss, ob.loss)
    assert ga.keys() == gb.keys()
    for n in ga:
        assert torch.equal(ga[n], gb[n]), n


@pytest.mark.parametrize("arch", CAUSAL)
def test_training_with_labels_gives_the_same_loss_without_logits(arch):
    model = _lm(arch)
    ref = _run(model)
    report = fuse(model, ops=[KIND])
    (row,) = _rows(report)
    assert (row.path, row.original, row.replacement, row.fused, row.eligible) == (
        "", type(model).__name__, "fused_linear_cross_entropy", True, True), row
    assert "logits is None" in row.reason and row.forward != "-"
    assert lm_head.is_installed(model)
    got = _run(model)
    assert got[0].logits is None and type(got[0]) is type(ref[0])
    _same(got, ref)
    assert "loss" in got[0].keys() and "logits" not in got[0].keys()
    assert unfuse(model) and not lm_head.is_installed(model) and not model._forward_pre_hooks
    assert not model._forward_hooks
    _same(_run(model), ref)


# the verified types beyond models' five, built from their configs (tiny, no dropout; pad/bos/eos in the vocabulary)
OTHER_TYPES = tuple(t for t in lm_head.LLAMA_LIKE if t not in CAUSAL)


def _lm_of_type(model_type, seed=0):
    import transformers as tr

    if model_type not in tr.CONFIG_MAPPING:
        pytest.skip(f"transformers {tr.__version__} has no model type {model_type!r}")
    cfg = tr.AutoConfig.for_model(model_type, vocab_size=97, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    for name in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attention_probs_dropout_prob"):
        if hasattr(cfg, name):
            setattr(cfg, name, 0.0)
    torch.manual_seed(seed)
    return tr.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").train()


@pytest.mark.parametrize("model_type", OTHER_TYPES)
def test_the_other_verified_types_give_the_same_loss_and_gradients(model_type):
    """Gemma, Phi-3 and the other types whose forward is Llama's (lm_head.LLAMA_LIKE; Gemma's and Phi-3's were
    refused before): fused, training with labels gives the unfused loss and gradients bit for bit (CPU: the reference
    path), logits None; unfuse gives the model back."""
    model = _lm_of_type(model_type)
    ref = _run(model)
    (row,) = _rows(fuse(model, ops=[KIND]))
    assert row.fused and row.eligible, row
    got = _run(model)
    assert got[0].logits is None
    _same(got, ref)
    assert unfuse(model) and not lm_head.is_installed(model)
    _same(_run(model), ref)


def _forward_code(cls):
    """``cls.forward``'s code as :func:`_code_of` reads it."""
    import inspect

    return _code_of(inspect.getsource(cls.forward))


def _code_of(src):
    """A function's decorators, parameters' names and defaults and the code of its body without the docstring, from
    its source ``src``: the dump of their syntax trees (no line numbers, blanks, comments or annotations: GLM-4's
    return annotation differs from Llama's; a review: a decorator that post-processes the logits, or another default,
    passed when only the body was compared)."""
    import ast
    import textwrap

    (fn,) = ast.parse(textwrap.dedent(src)).body
    if fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(getattr(fn.body[0], "value", None), ast.Constant):
        fn.body = fn.body[1:]
    args = fn.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs] + [
        f"*{a.arg}" for a in (args.vararg, args.kwarg) if a is not None]
    defaults = [ast.dump(d) for d in args.defaults + [d for d in args.kw_defaults if d is not None]]
    return [ast.dump(d) for d in fn.decorator_list], names, defaults, [ast.dump(stmt) for stmt in fn.body]


def test_the_llama_like_types_forward_is_llamas_in_this_transformers():
    """lm_head.LLAMA_LIKE says these models' causal-LM forward is LlamaForCausalLM's, which does nothing with the
    labels and the logits but the head and self.loss_function: checked against the installed transformers, so a
    release that changes one (a soft-cap, an auxiliary loss) fails here before a fused model computes another loss."""
    import transformers as tr

    want = _forward_code(tr.LlamaForCausalLM)
    checked = []
    for model_type in lm_head.LLAMA_LIKE:
        if model_type not in tr.CONFIG_MAPPING:
            continue   # (an older transformers: the type cannot be built, so it cannot be fused either)
        cls = tr.MODEL_FOR_CAUSAL_LM_MAPPING[tr.CONFIG_MAPPING[model_type]]
        assert _forward_code(cls) == want, f"{model_type}: {cls.__name__}.forward is not LlamaForCausalLM's"
        checked.append(model_type)
    assert {"gemma", "phi3", "mistral", "qwen2"} <= set(checked)
    # and the check can fail: a forward that post-processes the logits differs, and so does Llama's with another
    # decorator (a soft-cap put around it, say) or another default
    assert _forward_code(tr.Gemma2ForCausalLM) != want
    import inspect

    import textwrap

    src = textwrap.dedent(inspect.getsource(tr.LlamaForCausalLM.forward))
    assert _code_of(src) == want
    changed = ["@softcap\n" + src, src.replace("logits_to_keep: int | torch.Tensor = 0", "logits_to_keep: int = 1")]
    assert all(c != src for c in changed)
    assert all(_code_of(c) != want for c in changed)


def test_a_verified_type_whose_class_overrides_forward_is_skipped():
    """A review: the type was read from config.model_type alone, so a subclass (or remote code) of a verified type
    whose forward post-processes the logits would have been fused, its loss then computed without that. A subclass
    that keeps transformers' forward is taken."""
    import transformers as tr

    class Capped(tr.LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):   # the logits soft-capped before the loss
            out = super().forward(input_ids=input_ids, **kwargs)
            out.logits = 30.0 * torch.tanh(out.logits / 30.0)
            if labels is not None:
                out.loss = self.loss_function(logits=out.logits, labels=labels, vocab_size=self.config.vocab_size)
            return out

    class Plain(tr.LlamaForCausalLM):
        pass

    cfg = models.config("llama", "eager")
    torch.manual_seed(0)
    (row,) = _rows(fuse(Capped(cfg), ops=[KIND], dry_run=True))
    assert not row.fused and not row.eligible
    assert "Capped.forward is not LlamaForCausalLM.forward" in row.reason, row.reason
    torch.manual_seed(0)
    (row,) = _rows(fuse(Plain(cfg), ops=[KIND], dry_run=True))
    assert row.fused, row.reason


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_loss_arguments_as_transformers(arch):
    """num_items_in_batch (the sum divided by it), shift_labels given, another ignore_index: as the unfused model."""
    model = _lm(arch)
    b = _batch()
    shift = torch.nn.functional.pad(b["labels"], (0, 1), value=-100)[..., 1:].clone()
    shift[0, 2] = -100
    labels7 = b["labels"].masked_fill(b["labels"] == -100, 7)
    cases = [dict(num_items_in_batch=torch.tensor(17)), dict(num_items_in_batch=9), dict(shift_labels=shift),
             dict(labels=labels7, ignore_index=7)]
    refs = [_run(model, **kw) for kw in cases]
    fuse(model, ops=[KIND])
    for kw, ref in zip(cases, refs):
        got = _run(model, **kw)
        assert got[0].logits is None, kw
        _same(got, ref)


def test_other_calls_run_the_model_as_it_is():
    """eval mode, no labels, return_dict=False, logits_to_keep: the model's own output (logits included)."""
    model = _lm("llama")
    b = _batch()
    fuse(model, ops=[KIND])
    out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
    assert out.logits.shape == (3, 11, models.VOCAB) and out.loss is None
    tup = model(**b, return_dict=False)
    assert isinstance(tup, tuple) and tup[1].shape == (3, 11, models.VOCAB)
    kept = model(**dict(b, labels=None), logits_to_keep=1)
    assert kept.logits.shape == (3, 1, models.VOCAB)
    model.eval()
    ev = model(**b)
    assert ev.logits.shape == (3, 11, models.VOCAB) and ev.loss is not None
    unfuse(model)
    ref = model(**b)
    assert torch.equal(ev.loss, ref.loss) and torch.equal(ev.logits, ref.logits)


def test_with_the_default_ops_the_loss_row_and_the_head_row():
    """Not in the default ops; with them, the head row beside the loss row (our causal_lm_loss set: the head's loss
    is the same), and the model's norms etc. fused as before."""
    assert KIND in OPS and KIND not in DEFAULT_OPS
    model = _lm("llama")
    ref = _run(model)
    report = fuse(model)
    assert not _rows(report)
    unfuse(model)
    report = fuse(model, ops=list(DEFAULT_OPS) + [KIND])
    kinds = {r.kind for r in report.rows if r.fused}
    assert {"cross_entropy", KIND, "rms_norm"} <= kinds, kinds
    got = _run(model)
    assert got[0].logits is None
    torch.testing.assert_close(got[0].loss, ref[0].loss, atol=1e-5, rtol=1e-5)
    assert unfuse(model) and not lm_head.is_installed(model)


def test_skipped_models_say_why():
    """A masked LM (not a verified type; its loss is not the causal LM's); a causal LM whose config post-processes
    the logits; a head with a forward hook; a model with an instance forward already; a base model without a head (no
    row); model types whose forward does more with the labels or the logits (a review: Mixtral adds the router's
    auxiliary loss, Granite divides the logits by logits_scaling, encoder-decoder models build decoder inputs from the
    labels)."""
    import transformers as tr

    report = fuse(_lm("bert"), ops=[KIND], dry_run=True)
    (row,) = _rows(report)
    assert not row.fused and not row.eligible and "model type 'bert'" in row.reason
    small = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2)
    for cfg in (tr.MixtralConfig(num_local_experts=2, num_experts_per_tok=1, **small),
                tr.GraniteConfig(logits_scaling=4.0, **small)):
        torch.manual_seed(0)
        lm = tr.AutoModelForCausalLM.from_config(cfg).train()
        (row,) = _rows(fuse(lm, ops=[KIND], dry_run=True))
        assert not row.fused and f"model type {cfg.model_type!r}: not one whose forward is verified" in row.reason
    capped = _lm("llama", final_logit_softcapping=30.0)
    (row,) = _rows(fuse(capped, ops=[KIND], dry_run=True))
    assert not row.fused and "final_logit_softcapping" in row.reason
    hooked = _lm("llama")
    hooked.lm_head.register_forward_hook(lambda m, a, o: None)
    (row,) = _rows(fuse(hooked, ops=[KIND], dry_run=True))
    assert not row.fused and "not a plain torch.nn.Linear" in row.reason
    patched = _lm("llama")
    patched.forward = patched.forward   # (an instance attribute, as accelerate's hooks set)
    (row,) = _rows(fuse(patched, ops=[KIND], dry_run=True))
    assert not row.fused and "instance attribute forward" in row.reason
    assert not _rows(fuse(models.build("llama"), ops=[KIND], dry_run=True))


def test_dry_run_and_the_fused_context():
    model = _lm("llama")
    report = fuse(model, ops=[KIND], dry_run=True)
    assert _rows(report)[0].fused and not lm_head.is_installed(model) and not is_fused(model)
    with fused(model, ops=[KIND]):
        assert lm_head.is_installed(model)
        assert _run(model)[0].logits is None
    assert not lm_head.is_installed(model) and not is_fused(model)


def test_copies_pickles_and_replicas_run_on_themselves():
    """The hooks act on the module they are called for: a deep copy, a pickled model and a replica made as
    nn.DataParallel makes them (its __dict__ copied) compute with their own parameters and head; a second fuse of a
    copy is refused (its hooks came along)."""
    model = _lm("llama")
    ref = _run(model)
    fuse(model, ops=[KIND])
    twin = copy.deepcopy(model)
    assert lm_head.is_installed(twin)
    _same(_run(twin), ref)
    with torch.no_grad():
        twin.lm_head.weight.mul_(2)
    changed = _run(twin)
    assert not torch.equal(changed[0].loss, ref[0].loss)           # its own head, not the original's
    _same(_run(model), ref)
    (row,) = _rows(fuse(twin, ops=[KIND], dry_run=True))
    assert not row.fused and "hooks are on this model already" in row.reason
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    _same(_run(loaded), ref)
    _same(_run(pickle.loads(pickle.dumps(model))), ref)
    replica = model._replicate_for_data_parallel()
    assert lm_head.is_installed(replica)
    out = replica(**_batch())
    assert out.logits is None and torch.equal(out.loss, ref[0].loss)


def test_the_forward_signature_and_garbage_collection():
    """model.forward keeps its signature (the HF Trainer keeps the batch columns it names: a fused forward of
    (*args, **kwargs) made it drop input_ids); a fused model that is dropped is collected (no strong reference from
    fuse's records)."""
    import gc
    import inspect
    import weakref

    model = _lm("llama")
    before = inspect.signature(model.forward)
    fuse(model, ops=[KIND])
    assert inspect.signature(model.forward) == before and "input_ids" in before.parameters
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_a_head_called_twice_runs_the_plain_forward_with_a_warning(monkeypatch):
    """A forward that calls the output projection more than once (not transformers' pattern): the call runs again
    the plain way, with one warning per class."""
    model = _lm("llama")
    ref = _run(model)
    fuse(model, ops=[KIND])
    real = type(model).forward

    def twice(self, *a, **k):
        self.lm_head(torch.zeros(1, model.config.hidden_size))
        return real(self, *a, **k)
    monkeypatch.setattr(type(model), "forward", twice)
    monkeypatch.setattr(lm_head, "_warned", set())
    with pytest.warns(RuntimeWarning, match="called the output projection 2 time"):
        got = _run(model)
    assert got[0].logits is not None
    _same(got, ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run(model)


def test_a_head_hooked_after_fuse_runs_the_models_head_with_a_warning(monkeypatch):
    """A hook put on the head after fuse (FSDP2's fully_shard on the head, say): the model's own head and loss run,
    with one warning per class, and the fused head again once the hook is gone."""
    model = _lm("llama")
    ref = _run(model)
    fuse(model, ops=[KIND])
    seen = []
    handle = model.lm_head.register_forward_hook(lambda m, a, out: seen.append(tuple(out.shape)))
    monkeypatch.setattr(lm_head, "_warned", set())
    with pytest.warns(RuntimeWarning, match="no longer a plain torch.nn.Linear without hooks"):
        got = _run(model)
    assert got[0].logits is not None and seen == [tuple(got[0].logits.shape)]
    _same(got, ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run(model)   # once per class
        handle.remove()
        got = _run(model)
    assert got[0].logits is None
    _same(got, ref)


def test_a_float64_model_keeps_transformers_fp32_loss():
    """transformers' loss rounds a float64 model's logits to fp32 (logits.float()); the fused model's loss is the
    same fp32 value, and its gradients the same."""
    model = _lm("llama").double()
    ref = _run(model)
    fuse(model, ops=[KIND])
    got = _run(model)
    assert got[0].logits is None and got[0].loss.dtype == ref[0].loss.dtype == torch.float32
    _same(got, ref)
    got = _run(model, num_items_in_batch=torch.tensor(9))
    unfuse(model)
    _same(got, _run(model, num_items_in_batch=torch.tensor(9)))


def test_labels_inside_the_forwards_kwargs(monkeypatch):
    """A forward that takes everything as ``**kwargs`` (a wrapper's, say): labels found there, the head fused."""
    model = _lm("llama")
    ref = _run(model)
    fuse(model, ops=[KIND])
    real = type(model).forward

    def via_kwargs(self, **k):
        return real(self, **k)
    monkeypatch.setattr(type(model), "forward", via_kwargs)
    got = _run(model)
    assert got[0].logits is None
    _same(got, ref)


def test_inside_wrappers():
    """A wrapper that calls the model (hooks run): fused, the loss the unfused one's. A PEFT-like tuner (a class of
    a module named peft...), whose forward calls model.forward(...) directly and so runs no hooks: not fused, with the
    reason."""
    lm = _lm("llama")
    ref = _run(lm)
    wrap = models.Wrapper(lm)
    (row,) = _rows(fuse(wrap, ops=[KIND]))
    assert row.path == "base_model" and row.fused
    out = wrap(**_batch())
    assert out.logits is None and torch.equal(out.loss, ref[0].loss)
    unfuse(wrap)

    Tuner = type("LoraModel", (models.Wrapper,), {"__module__": "peft.tuners.lora.model",
                                        "forward": lambda self, **kw: self.base_model.forward(**kw)})
    (row,) = _rows(fuse(Tuner(_lm("llama")), ops=[KIND], dry_run=True))
    assert not row.fused and "inside LoraModel (PEFT)" in row.reason and "runs no module hooks" in row.reason


def test_the_loss_runs_under_the_forwards_autocast():
    """accelerate (and the Trainer's bf16) wrap the instance forward in autocast; the hooks run outside it. The loss
    is computed where the head runs, inside the forward, so it sees that autocast as the unfused head does (a
    break-test: it ran in fp32 there)."""
    def make(fused):
        model = _lm("llama")
        if fused:
            fuse(model, ops=[KIND])
        model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
        return model

    ref = _run(make(False))
    got = _run(make(True))
    assert got[0].logits is None
    _same(got, ref)


def test_replicas_in_threads_keep_their_own_calls():
    """nn.DataParallel's replicas share the original's __dict__ objects and run in threads: each call's state is
    per thread and module, so after the original ran once, two replicas in two threads still get their own losses
    (a break-test: they shared one stack and swapped entries)."""
    import threading

    model = _lm("llama")
    fuse(model, ops=[KIND])
    model.eval()
    model(**_batch())                          # the original runs once (in eval: not fused)
    model.train()
    batches = [_batch(), dict(_batch(), labels=_batch()["labels"].roll(1, dims=1))]
    want = [model(**b).loss for b in batches]
    def replicate(m):
        """As torch.nn.parallel.replicate makes a replica: every module copied (its __dict__ shallowly), the
        children the copies' (parameters shared here: one device)."""
        r = m._replicate_for_data_parallel()
        r._parameters = dict(m._parameters)     # (replicate assigns the device's copies; here the same ones)
        r._modules = {k: None if c is None else replicate(c) for k, c in m._modules.items()}
        return r

    for _ in range(5):
        replicas = [replicate(model) for _ in batches]
        got = [None, None]

        def work(i):
            got[i] = replicas[i](**batches[i]).loss
        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(torch.equal(g, w) for g, w in zip(got, want)), (got, want)


def test_an_interrupted_call_leaves_no_recorder_on_the_head():
    """A KeyboardInterrupt (a BaseException: no always-called hook runs) inside a fused forward left the head's
    recorder in place (a break-test: logits of width 0 after it, unfuse could not repair it). The next call, a
    fused or an unfused one, and unfuse remove it."""
    model = _lm("llama")
    ref = _run(model)
    fuse(model, ops=[KIND])
    fired = []

    def interrupt(module, args, output):
        if not fired:
            fired.append(1)
            raise KeyboardInterrupt
    h = model.model.layers[1].register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model(**_batch())
    h.remove()
    assert "forward" in model.lm_head.__dict__          # left by the interrupted call
    _same(_run(model), ref)                             # the next call clears it
    with pytest.raises(KeyboardInterrupt):
        fired.clear()
        h = model.model.layers[1].register_forward_hook(interrupt)
        model(**_batch())
    h.remove()
    unfuse(model)
    assert "forward" not in model.lm_head.__dict__
    model.eval()
    assert model(**_batch()).logits.shape[-1] == models.VOCAB


def test_a_loss_function_set_after_fuse_and_return_dict_in_the_config():
    """A loss function set on the fused model later is used (the call is not fused); a config with return_dict
    False gives the model's tuple (not fused: no plain rerun either)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    model = _lm("llama")
    fuse(model, ops=[KIND])
    model.loss_function = lambda *a, **k: 2 * ForCausalLMLoss(*a, **k)
    doubled = model(**_batch())
    assert doubled.logits is not None
    plain = _lm("bloom")
    ref = plain(**_batch()).loss
    fuse(plain, ops=[KIND])
    plain.config.return_dict = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = plain(**_batch())
    assert isinstance(out, tuple) and torch.equal(out[0], ref)
