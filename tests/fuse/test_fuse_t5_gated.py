"""fuse() and the gated-MLP probe on T5 v1.1's gated MLP (``wo(dropout(act(wi_0(x)) * wi_1(x)))``: transformers'
``T5DenseGatedActDense`` of T5 v1.1, Flan-T5 and mT5, ``UMT5DenseGatedActDense``, ``LongT5DenseGatedActDense``), with
transformers' own classes (tiny random configs, CPU): the probe takes the ``wi_0/wi_1/wo`` layout with its ``act``
(GELU tanh: ``gelu_new``, Flan-T5's; exact GELU; SiLU) and its ``dropout``, and refuses other activations, other
children, a forward with randomness of its own or its dropout elsewhere; fuse() puts ``FusedT5DenseGatedActDense``
(op ``geglu`` or ``swiglu``, kind ``geglu`` or ``swiglu``) in their place, with the model's loss and gradients
unchanged in training (the same dropout masks, drawn in the same order) and in eval mode, T5's cast of the product to
an fp32 ``wo`` kept, and unfuse() restores the MLPs. The tests marked ``cuda`` run the kernels on a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipegoose.nn.fusion import dispatch, fuse, unfuse
from pipegoose.nn.fusion.fuse import is_fused
from pipegoose.nn.fusion.modules import FusedGeGLUMLP, FusedSwiGLUMLP, FusedT5DenseGatedActDense
from pipegoose.nn.fusion.transformers.matching import probe_swiglu_mlp

from tolerances import tol

tr = pytest.importorskip("transformers")
from transformers.activations import ACT2FN  # noqa: E402
from transformers.models.longt5.modeling_longt5 import LongT5DenseGatedActDense  # noqa: E402
from transformers.models.t5.modeling_t5 import T5DenseActDense, T5DenseGatedActDense  # noqa: E402
from transformers.models.umt5.modeling_umt5 import UMT5DenseGatedActDense  # noqa: E402

D_MODEL, D_FF = 32, 64
# transformers' activation name -> what the probe finds
ACTS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "silu": "silu"}
OP = {"gelu_tanh": "geglu", "gelu": "geglu", "silu": "swiglu"}
MLP_CLASSES = [T5DenseGatedActDense, UMT5DenseGatedActDense, LongT5DenseGatedActDense]


def _config(act="gelu_new", dropout=0.1):
    return tr.T5Config(vocab_size=97, d_model=D_MODEL, d_kv=8, d_ff=D_FF, num_layers=2, num_decoder_layers=2,
                       num_heads=4, feed_forward_proj=f"gated-{act}", dropout_rate=dropout, decoder_start_token_id=0)


def _mlp(cls=T5DenseGatedActDense, act="gelu_new", dropout=0.1, seed=0):
    torch.manual_seed(seed)
    mlp = cls(_config(act, dropout))
    mlp.act = ACT2FN[act]   # ("gated-gelu" gives gelu_new; the others by name)
    return mlp


def _model(kind="t5", act="gelu_new", seed=0):
    """A tiny random T5 / mT5 / UMT5 ForConditionalGeneration with gated MLPs of ``act``, dropout 0.1."""
    torch.manual_seed(seed)
    cls, cfg = {"t5": (tr.T5ForConditionalGeneration, tr.T5Config),
                "mt5": (tr.MT5ForConditionalGeneration, tr.MT5Config),
                "umt5": (tr.UMT5ForConditionalGeneration, tr.UMT5Config),
                "longt5": (tr.LongT5ForConditionalGeneration, tr.LongT5Config)}[kind]
    return cls(cfg(vocab_size=97, d_model=D_MODEL, d_kv=8, d_ff=D_FF, num_layers=2, num_decoder_layers=2, num_heads=4,
                   feed_forward_proj=f"gated-{act}", dropout_rate=0.1, decoder_start_token_id=0))


def _mlps(model):
    return [m for _, m in _mlp_paths(model)]


def _mlp_paths(model):
    return [(p, m) for p, m in model.named_modules() if p.endswith("DenseReluDense")]


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 97, (2, 9), generator=g)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)


def _record_mask(records):
    """A forward hook for a dropout that appends (known, kept) to ``records``: the elements whose input was nonzero
    (where the mask shows: an input of 0 gives 0 either way, and a GELU of a large negative gate is 0 in 16-bit), and
    which of them it kept."""
    def hook(mod, args, out):
        known = args[0].detach() != 0
        records.append((known, known & (out.detach() != 0)))
    return hook


def _same_masks(a, b, dropped=True):
    """Whether two runs' (known, kept) records tell of the same dropout masks: where both know the element, both kept
    it or both dropped it; almost every element known; with ``dropped``, each dropout dropped some."""
    assert len(a) == len(b) and a
    for (ka, ma), (kb, mb) in zip(a, b):
        both = ka & kb
        assert int(both.sum()) >= 0.9 * both.numel()
        assert torch.equal(ma & both, mb & both)
        if dropped:
            assert bool((both & ~ma).any())
    return True


def _close_in_bf16(grads, want):
    """Each gradient within 5% of the other's norm: a bf16 model's gradients, fused against unfused, round apart
    element by element (an element near 0 can differ by more than itself), while a wrong term moves the whole."""
    assert grads.keys() == want.keys()
    for n in want:
        a, b = grads[n].double(), want[n].double()
        assert float((a - b).norm()) <= 0.05 * float(b.norm()) + 1e-6, f"{n}: {(a - b).norm()} of {b.norm()}"


def _loss_grads_and_masks(model, seed=5):
    """The loss, every gradient and what each MLP's dropout kept (:func:`_record_mask`), with torch's generator seeded
    before the forward: fused and unfused runs draw the dropout masks from the same stream."""
    kept = []
    handles = [m.dropout.register_forward_hook(_record_mask(kept)) for m in _mlps(model)]
    try:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        loss = model(**_batch()).loss
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, kept


# ------------------------------------------------------------------------------------------------------- the probe
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("cls", MLP_CLASSES, ids=lambda c: c.__name__)
def test_the_probe_takes_t5s_gated_mlp(cls, act):
    """T5's, UMT5's and LongT5's gated MLP with gelu_new (Flan-T5's, mT5's), gelu_pytorch_tanh, gelu and silu: the
    wi_0/wi_1/wo layout with its activation; T5's and UMT5's forward casts the product to wo's dtype, LongT5's not."""
    probe = probe_swiglu_mlp(_mlp(cls, act))
    assert probe.ok and probe.candidate and not probe.packed, probe
    assert (probe.activation, probe.layout) == (ACTS[act], "wi_0/wi_1/wo")
    assert probe.down_cast == (cls is not LongT5DenseGatedActDense)
    assert probe.reason == f"probe output equals wo(dropout({ACTS[act]}(wi_0(x)) * wi_1(x)))"


def test_the_probe_leaves_the_callers_random_stream_alone():
    mlp = _mlp().train()
    torch.manual_seed(3)
    want = torch.rand(4)
    torch.manual_seed(3)
    probe_swiglu_mlp(mlp)
    assert torch.equal(torch.rand(4), want)


@pytest.mark.parametrize("act,name", [("quick_gelu", "QuickGELUActivation"), ("relu", "ReLU")])
def test_the_probe_refuses_a_gated_t5_mlp_of_another_activation(act, name):
    """Gated QuickGELU and ReLU are neither SiLU nor GELU: refused with the reason, by the probe, the fused module and
    fuse() (a skipped, not eligible row; the MLP kept)."""
    mlp = _mlp(act=act)
    probe = probe_swiglu_mlp(mlp)
    assert probe.candidate and not probe.ok and probe.layout == "wi_0/wi_1/wo", probe
    assert f"act ({name}) is not SiLU or GELU (exact or tanh)" in probe.reason
    with pytest.raises(ValueError, match=r"^mlp: T5DenseGatedActDense does not pass the T5 gated MLP probe: act "):
        FusedT5DenseGatedActDense.from_module(mlp)
    model = _model(act=act)
    mlps = _mlps(model)
    report = fuse(model)
    rows = [r for r in report.rows if r.path.endswith("DenseReluDense")]
    assert len(rows) == 4 and all(not r.fused and not r.eligible and r.replacement is None for r in rows), rows
    assert all(f"act ({name}) is not SiLU or GELU" in r.reason for r in rows)
    assert _mlps(model) == mlps
    unfuse(model)


def test_the_original_t5_relu_mlp_is_no_candidate():
    """T5DenseActDense (original T5: wi, wo, ReLU, not gated) has none of the layouts: no row, nothing replaced."""
    mlp = T5DenseActDense(_config())
    probe = probe_swiglu_mlp(mlp)
    assert not probe.ok and not probe.candidate and probe.layout == "", probe
    torch.manual_seed(0)
    model = tr.T5ForConditionalGeneration(tr.T5Config(vocab_size=97, d_model=D_MODEL, d_kv=8, d_ff=D_FF, num_layers=1,
                                                      num_decoder_layers=1, num_heads=4, feed_forward_proj="relu",
                                                      decoder_start_token_id=0))
    report = fuse(model)
    assert not [r for r in report.rows if "DenseReluDense" in r.path]
    assert all(type(m) is T5DenseActDense for m in _mlps(model))
    unfuse(model)


class _RandomInside(T5DenseGatedActDense):
    """A forward with a functional dropout of its own in training (randomness the fused module would not draw)."""

    def forward(self, hidden_states):
        h = self.dropout(self.act(self.wi_0(hidden_states)) * self.wi_1(hidden_states))
        return self.wo(F.dropout(h, 0.1, self.training))


class _DropsTheInput(T5DenseGatedActDense):
    def forward(self, hidden_states):
        hidden_states = self.dropout(hidden_states)
        return self.wo(self.act(self.wi_0(hidden_states)) * self.wi_1(hidden_states))


class _NoDropout(T5DenseGatedActDense):
    def forward(self, hidden_states):
        return self.wo(self.act(self.wi_0(hidden_states)) * self.wi_1(hidden_states))


class _DropsTwice(T5DenseGatedActDense):
    def forward(self, hidden_states):
        h = self.dropout(self.act(self.wi_0(hidden_states)) * self.wi_1(hidden_states))
        return self.wo(self.dropout(h))


class _DropsTheGate(T5DenseGatedActDense):
    def forward(self, hidden_states):
        return self.wo(self.act(self.dropout(self.wi_0(hidden_states))) * self.wi_1(hidden_states))


class _ScaledDropout(nn.Dropout):
    def forward(self, input):
        return super().forward(input) * 2


class _WithArgument(T5DenseGatedActDense):
    def forward(self, hidden_states, scale=1.0):
        return super().forward(hidden_states) * scale


@pytest.mark.parametrize("cls,why", [
    (_RandomInside, r"output \(training mode\) differs from wo\(dropout\(gelu_tanh\(wi_0\(x\)\) \* wi_1\(x\)\)\)"),
    (_DropsTheInput, r"dropout called on torch.Size\(\[4, 3, 8\]\), not on the product"),
    (_NoDropout, r"its forward \(training mode\) calls dropout 0 times: FusedT5DenseGatedActDense calls it once"),
    (_DropsTwice, r"its forward \(training mode\) calls dropout 2 times"),
    (_DropsTheGate, r"output \(training mode\) differs from wo\(dropout"),
    (_WithArgument, r"forward takes more than the input \(scale\): FusedT5DenseGatedActDense takes the input alone"),
])
def test_the_probe_refuses_a_t5_mlp_whose_forward_is_another(cls, why):
    """Randomness of the forward's own (seen in training mode), the dropout on the input, on the gate, twice or not
    at all (the probe's dropout stand-in, a fixed mask that counts its calls), a further forward argument."""
    probe = probe_swiglu_mlp(_mlp(cls))
    assert probe.candidate and not probe.ok, probe
    assert probe.layout == "wi_0/wi_1/wo"
    import re
    assert re.search(why, probe.reason), probe.reason
    with pytest.raises(ValueError, match="does not pass the T5 gated MLP probe"):
        FusedT5DenseGatedActDense.from_module(_mlp(cls))


def test_the_probe_refuses_other_children_parameters_and_hooks():
    mlp = _mlp()
    mlp.norm = nn.LayerNorm(D_FF)
    assert ("has submodules besides the projections, act and dropout (a torch.nn.Dropout) (norm): not the plain "
            "GeGLU MLP") in probe_swiglu_mlp(mlp).reason
    mlp = _mlp()
    mlp.dropout = _ScaledDropout(0.1)   # a dropout of another computation: not the layout's
    assert "(dropout): not the plain GeGLU MLP" in probe_swiglu_mlp(mlp).reason
    mlp = _mlp()
    mlp.dropout = nn.Identity()
    assert "(dropout): not the plain GeGLU MLP" in probe_swiglu_mlp(mlp).reason
    mlp = _mlp()
    mlp.scale = nn.Parameter(torch.ones(1))
    assert "has parameters or buffers of its own" in probe_swiglu_mlp(mlp).reason
    mlp = _mlp()
    mlp.act.register_forward_hook(lambda *a: None)
    assert "act has forward or backward hooks, which FusedT5DenseGatedActDense" in probe_swiglu_mlp(mlp).reason


# -------------------------------------------------------------------------------------------------- the module
@pytest.mark.parametrize("act", list(ACTS))
def test_from_module_is_a_drop_in_in_eval_and_training_mode(act):
    """The same children in the same order (state_dict keys unchanged), the op of the activation; eval mode: the
    MLP's output (bit for bit where the MLP's act is F.gelu / F.silu itself, within fp32 rounding for gelu_new);
    training mode, seeded alike: the same dropout mask, the same output."""
    mlp = _mlp(act=act)
    fused = FusedT5DenseGatedActDense.from_module(mlp)
    assert list(fused._modules) == list(mlp._modules) == ["wi_0", "wi_1", "wo", "dropout", "act"]
    assert all(fused._modules[n] is m for n, m in mlp._modules.items())
    assert list(fused.state_dict()) == list(mlp.state_dict())
    assert fused.activation == ACTS[act] and fused.cast_to_wo and fused.training == mlp.training
    x = torch.randn(2, 5, D_MODEL) * 3
    exact = act != "gelu_new"   # (NewGELUActivation spells the tanh formula out: within fp32 rounding of F.gelu's)
    kept = []
    mlp.dropout.register_forward_hook(_record_mask(kept))   # (the fused module's too: the same object)
    for training in (False, True):
        mlp.train(training), fused.train(training)
        torch.manual_seed(7)
        want = mlp(x)
        dispatch.reset_stats()
        torch.manual_seed(7)
        got = fused(x)
        assert dispatch.stats()[OP[ACTS[act]]] == {"torch": 1}
        assert _same_masks(kept[:1], kept[1:], dropped=training)
        assert training or all(torch.equal(k, m) for k, m in kept)   # (eval mode: none dropped)
        kept.clear()
        if exact:
            assert torch.equal(got, want)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_from_module_checks_and_constructor():
    mlp = _mlp(act="gelu")
    with pytest.raises(ValueError, match=r"^activation: 'gelu_tanh', but the MLP's act computes 'gelu'"):
        FusedT5DenseGatedActDense.from_module(mlp, activation="gelu_tanh")
    with pytest.raises(ValueError, match=r"^cast_to_wo: False, but the MLP's forward casts the product"):
        FusedT5DenseGatedActDense.from_module(mlp, cast_to_wo=False)
    assert not FusedT5DenseGatedActDense.from_module(_mlp(LongT5DenseGatedActDense)).cast_to_wo
    with pytest.raises(TypeError, match=r"^mlp: expected a module with submodules wi_0, wi_1 and wo, got Linear"):
        FusedT5DenseGatedActDense.from_module(nn.Linear(4, 4))
    fused = FusedT5DenseGatedActDense.from_module(_mlp(act="silu"), verify=False)   # the caller's word
    assert (fused.activation, fused.approximate, fused.cast_to_wo) == ("gelu_tanh", "tanh", True)
    lin = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 4)
    assert FusedT5DenseGatedActDense(*lin).extra_repr() == "activation='gelu_tanh'"
    assert (FusedT5DenseGatedActDense(*lin, activation="silu", cast_to_wo=False, impl="torch").extra_repr()
            == "activation='silu', cast_to_wo=False, impl='torch'")
    with pytest.raises(ValueError, match=r"^activation: expected one of 'silu', 'gelu_tanh', 'gelu', got 'relu'"):
        FusedT5DenseGatedActDense(*lin, activation="relu")
    with pytest.raises(TypeError, match=r"^activation: expected a str"):
        FusedT5DenseGatedActDense(*lin, activation=None)
    with pytest.raises(TypeError, match=r"^cast_to_wo: expected a bool"):
        FusedT5DenseGatedActDense(*lin, cast_to_wo=1)
    with pytest.raises(TypeError, match=r"^dropout: expected a torch.nn.Module or None"):
        FusedT5DenseGatedActDense(*lin, dropout=0.1)
    with pytest.raises(TypeError, match=r"^wi_1: expected a torch.nn.Module, got str"):
        FusedT5DenseGatedActDense(lin[0], "up", lin[2])
    with pytest.raises(ValueError, match=r"^impl: geglu has no implementation 'apex'"):
        FusedT5DenseGatedActDense(*lin, impl="apex")
    with pytest.raises(ValueError, match=r"^impl: swiglu has no implementation 'apex'"):
        FusedT5DenseGatedActDense(*lin, activation="silu", impl="apex")
    x = torch.randn(3, 4)
    bare = FusedT5DenseGatedActDense(*lin, activation="gelu")   # no dropout
    assert torch.equal(bare(x), lin[2](F.gelu(lin[0](x)) * lin[1](x)))


def test_an_activation_replaced_or_hooked_while_fused_is_run_as_the_mlp_would():
    mlp = _mlp().eval()
    fused = FusedT5DenseGatedActDense.from_module(mlp)
    x = torch.randn(3, D_MODEL)
    dispatch.reset_stats()
    fused(x)
    assert dispatch.stats()["geglu"] == {"torch": 1}
    calls = []
    handle = fused.act.register_forward_hook(lambda *a: calls.append(1))
    assert torch.equal(fused(x), mlp(x)) and calls == [1, 1]   # (the fused module's call, then the MLP's own)
    handle.remove()
    fused.act = nn.ReLU()
    assert torch.equal(fused(x), fused.wo(F.relu(fused.wi_0(x)) * fused.wi_1(x)))
    assert dispatch.stats()["geglu"] == {"torch": 1}   # (neither ran the op)


@pytest.mark.parametrize("cls", MLP_CLASSES, ids=lambda c: c.__name__)
def test_an_fp32_wo_in_a_bf16_mlp_gets_t5s_cast(cls):
    """T5's _keep_in_fp32_modules case: wi_0, wi_1 and the input in bf16, wo in fp32. T5's and UMT5's forward cast the
    product to fp32 before wo, and so does the fused module (wo sees fp32; the output is fp32, the MLP's within bf16
    rounding: the activation rounds otherwise); LongT5's has no cast, and neither has its fused module: both raise
    for the mixed dtypes."""
    mlp = _mlp(cls).eval().to(torch.bfloat16)
    mlp.wo.float()
    fused = FusedT5DenseGatedActDense.from_module(mlp)
    x = torch.randn(2, 5, D_MODEL).to(torch.bfloat16)
    seen = []
    mlp.wo.register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))
    if cls is LongT5DenseGatedActDense:
        assert not fused.cast_to_wo
        for m in (mlp, fused):
            with pytest.raises(RuntimeError):
                m(x)
        return
    want, got = mlp(x), fused(x)
    assert seen == [torch.float32, torch.float32] and got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, **tol(torch.bfloat16, 2))
    # the rule's other side: a wo of the product's dtype, or an int8 weight, is left as it is
    fused.wo.to(torch.bfloat16)
    assert fused(x).dtype == torch.bfloat16
    fused.wo.weight = nn.Parameter(torch.zeros(D_MODEL, D_FF, dtype=torch.int8), requires_grad=False)
    fused.wo.forward = lambda h: h   # (F.linear takes no int8 weight: what reaches it is what counts)
    assert fused(x).dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------------------- fuse()
@pytest.mark.parametrize("kind", ["t5", "mt5", "umt5"])
def test_fuse_keeps_loss_gradients_and_dropout_masks_in_training(kind):
    """fuse() of a tiny T5 / mT5 / UMT5 in training mode, dropout 0.1: every gated MLP becomes a
    FusedT5DenseGatedActDense (kind geglu, op geglu, approximate 'tanh', the row naming the layout) over the same
    modules; seeded alike, each dropout keeps the same elements and the loss and every gradient equal the unfused
    model's (fp32; gelu_new against F.gelu's tanh form: within fp32 rounding); state_dict keys unchanged; unfuse()
    puts the same MLP objects back, and the unfused model computes what it did."""
    model = _model(kind).train()
    paths = [p for p, _ in _mlp_paths(model)]
    mlps = _mlps(model)
    keys = list(model.state_dict())
    loss0, grads0, kept0 = _loss_grads_and_masks(model)
    assert len(kept0) == 4
    report = fuse(model)
    rows = [r for r in report.rows if r.path in paths]
    assert [r.path for r in rows] == paths
    for r, mlp in zip(rows, mlps):
        assert (r.kind, r.fused, r.eligible, r.replacement, r.original) == (
            "geglu", True, True, "FusedT5DenseGatedActDense", type(mlp).__name__)
        assert ("T5 gated MLP, GeGLU MLP (probe output equals wo(dropout(gelu_tanh(wi_0(x)) * wi_1(x)))), same "
                "projections (wi_0/wi_1/wo); op geglu, approximate='tanh'; dropout kept") in r.reason, r.reason
    fused = _mlps(model)
    assert all(type(f) is FusedT5DenseGatedActDense and f.approximate == "tanh" and f.cast_to_wo for f in fused)
    assert all(f.wi_0 is m.wi_0 and f.wo is m.wo and f.dropout is m.dropout and f.act is m.act
               for f, m in zip(fused, mlps))
    assert list(model.state_dict()) == keys
    dispatch.reset_stats()
    loss1, grads1, kept1 = _loss_grads_and_masks(model)
    assert dispatch.stats()["geglu"] == {"torch": 4}
    assert _same_masks(kept1, kept0)
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-7)
    assert grads1.keys() == grads0.keys()
    for n in grads0:   # (fp32 rounding relative to the gradient's scale: an element that cancels to near zero is
        # off by more than its own rtol: with torch 2.14.1 on the CPU mT5's EncDecAttention.q gradient was 1.3e-6 off
        # on an element of 0.0087, the tensor's largest 1.84)
        scale = float(grads0[n].abs().max())
        torch.testing.assert_close(grads1[n], grads0[n], rtol=1e-5, atol=max(1e-6, 1e-5 * scale),
                                   msg=lambda m: f"{n}: {m}")
    assert unfuse(model) and not is_fused(model)
    assert _mlps(model) == mlps and list(model.state_dict()) == keys
    loss2, grads2, _ = _loss_grads_and_masks(model)
    assert torch.equal(loss2, loss0) and all(torch.equal(grads2[n], grads0[n]) for n in grads0)


@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "silu"])
def test_fuse_in_training_is_exact_where_the_activation_is_torchs(act):
    """With an act that is F.gelu's tanh form or F.silu itself, the fused model (op geglu or swiglu, kind alike: the
    op that runs) computes the unfused model's loss and gradients bit for bit in training mode: the dropout masks
    are drawn in the same order."""
    model = _model("t5", act).train()
    loss0, grads0, kept0 = _loss_grads_and_masks(model)
    report = fuse(model)
    op = OP[ACTS[act]]
    assert {r.kind for r in report.rows if "DenseReluDense" in r.path} == {op}
    dispatch.reset_stats()
    loss1, grads1, kept1 = _loss_grads_and_masks(model)
    assert dispatch.stats()[op] == {"torch": 4}
    assert _same_masks(kept1, kept0)
    assert torch.equal(loss1, loss0)
    assert all(torch.equal(grads1[n], grads0[n]) for n in grads0)
    assert unfuse(model)


def test_fuse_in_eval_mode_and_ops():
    """Eval mode (no dropout): the same logits; ops without geglu leaves the MLPs, counted as not requested."""
    model = _model("t5").eval()
    batch = _batch()
    with torch.no_grad():
        want = model(**batch).logits
    report = fuse(model, ops=["rms_norm", "swiglu"])
    assert report.not_requested.get("geglu") == 4
    assert all(type(m) is T5DenseGatedActDense for m in _mlps(model))
    assert unfuse(model)
    fuse(model)
    assert all(type(m) is FusedT5DenseGatedActDense for m in _mlps(model))
    with torch.no_grad():
        got = model(**batch).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert unfuse(model)


def test_fuse_longt5_keeps_its_forward_without_the_cast():
    model = _model("longt5").train()
    loss0, grads0, kept0 = _loss_grads_and_masks(model)
    report = fuse(model)
    rows = [r for r in report.rows if "DenseReluDense" in r.path]
    assert rows and all(r.fused and "no cast to wo's dtype (LongT5's forward has none)" in r.reason for r in rows)
    assert all(not m.cast_to_wo for m in _mlps(model))
    loss1, grads1, kept1 = _loss_grads_and_masks(model)
    assert _same_masks(kept1, kept0)
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-7)
    assert unfuse(model)


def test_a_fused_t5_mlp_is_held_by_a_second_fuse():
    """A T5 model fused in part (its encoder) and then as a whole: the encoder's MLP rows are held, kind geglu."""
    model = _model("t5")
    fuse(model.encoder)
    report = fuse(model)
    held = [r for r in report.rows if r.path.startswith("encoder.") and "DenseReluDense" in r.path]
    assert held and all(r.kind == "geglu" and r.fused and r.replacement == "FusedT5DenseGatedActDense" for r in held)
    assert unfuse(model)   # (and the encoder's fusion with it: unfuse undoes the parts' too)
    assert all(type(m) is T5DenseGatedActDense for m in _mlps(model)) and not is_fused(model.encoder)


@pytest.mark.parametrize("kind", ["t5", "mt5", "umt5"])
def test_fuse_in_bf16(kind):
    """bf16 model, training mode: loose (the activation rounds otherwise than eager's gelu_new in bf16)."""
    model = _model(kind).to(torch.bfloat16).train()
    loss0, grads0, kept0 = _loss_grads_and_masks(model)
    fuse(model)
    assert all(type(m) is FusedT5DenseGatedActDense for m in _mlps(model))
    loss1, grads1, kept1 = _loss_grads_and_masks(model)
    assert _same_masks(kept1, kept0)
    torch.testing.assert_close(loss1, loss0, rtol=2e-2, atol=2e-2)
    _close_in_bf16(grads1, grads0)
    assert unfuse(model)


def test_fuse_with_fp32_wo_in_a_bf16_model():
    """T5's _keep_in_fp32_modules (wo): bf16 model, each wo in fp32. The fused MLPs cast the product to fp32 before
    wo as T5's do (wo sees fp32), and the loss and gradients stay the unfused model's within bf16 rounding."""
    model = _model("t5").to(torch.bfloat16).train()
    for m in _mlps(model):
        m.wo.float()
    loss0, grads0, _ = _loss_grads_and_masks(model)
    fuse(model)
    seen = []
    for m in _mlps(model):
        assert type(m) is FusedT5DenseGatedActDense and m.cast_to_wo
        m.wo.register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))
    loss1, grads1, _ = _loss_grads_and_masks(model)
    assert seen == [torch.float32] * 4
    torch.testing.assert_close(loss1.float(), loss0.float(), rtol=2e-2, atol=2e-2)
    assert all(grads1[n].dtype == grads0[n].dtype for n in grads0)
    _close_in_bf16(grads1, grads0)
    assert unfuse(model)


def test_swiglu_geglu_and_t5_modules_are_not_mixed_up():
    """The Llama and Gemma MLP classes refuse a T5 MLP (no gate_proj) and the T5 class refuses theirs (no wi_0)."""
    mlp = _mlp()
    for cls in (FusedSwiGLUMLP, FusedGeGLUMLP):
        with pytest.raises(TypeError, match=r"without gate_proj, up_proj, down_proj"):
            cls.from_module(mlp)


# ------------------------------------------------------------------------------------------------ on a GPU
@pytest.mark.cuda
@pytest.mark.parametrize("act", ["gelu_new", "gelu", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_t5_mlp_on_cuda_runs_the_kernel(no_tuning_table, dtype, act):
    """On CUDA (tuning table and small-problem rule set aside) FusedT5DenseGatedActDense runs pipegoose::geglu or
    pipegoose::swiglu by its activation: no fallback (strict mode), counted as pipegoose; in training mode, seeded
    alike, the same dropout mask, and output and gradients as the MLP's within the dtype's rounding."""
    torch.manual_seed(1)
    mlp = _mlp(act=act).to("cuda", dtype).train()
    fused = FusedT5DenseGatedActDense.from_module(mlp)
    op = OP[ACTS[act]]
    x = torch.randn(3, 7, D_MODEL, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(3, 7, D_MODEL, device="cuda", dtype=dtype)
    torch.manual_seed(9)
    want = mlp(x)
    want_grads = torch.autograd.grad(want, [x, *mlp.parameters()], dy)
    dispatch.reset_stats()
    with dispatch.strict():
        torch.manual_seed(9)
        got = fused(x)
        grads = torch.autograd.grad(got, [x, *fused.parameters()], dy)
    assert dispatch.last_choice(op).impl == "pipegoose" and dispatch.stats()[op] == {"pipegoose": 1}
    torch.testing.assert_close(got, want, **tol(dtype, 4))
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, **tol(dtype, 8))


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["t5", "umt5"])
def test_fuse_t5_on_cuda_matches_the_unfused_model(no_tuning_table, kind):
    """A tiny T5 / UMT5 on CUDA, bf16 with each wo in fp32 (T5's _keep_in_fp32_modules), training mode: its MLPs run
    pipegoose::geglu, the dropout masks are the unfused model's (seeded alike), loss and gradients within bf16
    rounding."""
    model = _model(kind).to("cuda", torch.bfloat16).train()
    for m in _mlps(model):
        m.wo.float()
    batch = {k: v.cuda() for k, v in _batch().items()}

    def run():
        kept = []
        # (known, kept) per dropout call, as _same_masks reads them (a first GPU run: this hook appended the kept
        # mask alone, which _same_masks unpacked along the batch)
        handles = [m.dropout.register_forward_hook(_record_mask(kept)) for m in _mlps(model)]
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        loss = model(**batch).loss
        loss.backward()
        for h in handles:
            h.remove()
        return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()
                                       if p.grad is not None}, kept

    loss0, grads0, kept0 = run()
    fuse(model)
    dispatch.reset_stats()
    loss1, grads1, kept1 = run()
    assert dispatch.stats()["geglu"] == {"pipegoose": 4}
    assert _same_masks(kept1, kept0)
    torch.testing.assert_close(loss1, loss0, rtol=2e-2, atol=2e-2)
    _close_in_bf16(grads1, grads0)
    assert unfuse(model)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(activation=5), TypeError, r"activation: expected a str, got int"),
    (dict(activation="gelu_fast"), ValueError, r"activation: expected one of"),
    (dict(cast_to_wo="yes"), TypeError, r"cast_to_wo: expected a bool, got str"),
    (dict(cast_to_wo=1), TypeError, r"cast_to_wo: expected a bool, got int"),
])
@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_from_module_checks_its_arguments_as_the_constructor_does(kwargs, error, match, verify):
    """Bad values are the constructor's TypeError / ValueError with verify on too (they were a mismatch ValueError,
    and cast_to_wo=1 passed; a review)."""
    with pytest.raises(error, match=match):
        FusedT5DenseGatedActDense.from_module(_mlp(), verify=verify, **kwargs)


@pytest.mark.parametrize("hook", ["register_full_backward_hook", "register_full_backward_pre_hook"])
def test_backward_hooks_on_act_fire_or_refuse(hook):
    """A backward hook on act: before fuse, the probe refuses the MLP (the fused module would not run act); added
    after fuse, the fused module runs act as T5 does, and the hook fires (it was dropped silently; a review)."""
    calls = []

    def record(*args):
        calls.append(1)

    mlp = _mlp()
    getattr(mlp.act, hook)(record)
    probe = probe_swiglu_mlp(mlp)
    assert not probe.ok and "forward or backward hooks" in probe.reason
    mlp = _mlp()
    fused = FusedT5DenseGatedActDense.from_module(mlp)
    handle = getattr(mlp.act, hook)(record)
    x = torch.randn(2, 3, mlp.wi_0.in_features, requires_grad=True)
    fused.eval()(x).sum().backward()
    assert calls, "the backward hook did not fire"
    handle.remove()
