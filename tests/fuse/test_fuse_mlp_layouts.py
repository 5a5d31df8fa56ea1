"""Gated MLPs under other names. ModernBERT's (``Wo(drop(act(input) * gate))`` of ``input, gate = Wi(x).chunk(2, -1)``:
``ModernBertMLP``, ``ModernBertDecoderMLP``) and :class:`FusedModernBertMLP` (op ``geglu.packed`` for GELU, its
default, ``swiglu.packed`` for SiLU): the probe's layout, fuse's rows, the model's output and gradients unchanged on
the CPU (the reference path, the dropout drawn where the MLP draws it), unfuse, the module's checks; on a GPU
(``-m cuda``) the kernel runs and matches the MLP. Granite's shared MLP (``output_linear(silu(gate) * up)`` of
``input_linear(x).chunk(2, -1)``: ``GraniteMoeSharedMLP``, ``GraniteMoeHybridMLP``) and :class:`FusedGraniteMLP`
(op ``swiglu.packed``), then LFM2's (``w2(silu(w1(x)) * w3(x))``: ``Lfm2MLP``) and :class:`FusedLfm2MLP` (op
``swiglu``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipegoose.nn.fusion import (FusedGateUpSwiGLUMLP, FusedGELU, FusedGraniteMLP, FusedLfm2MLP, FusedModernBertMLP,
                                 FusedSwiGLUMLP, dispatch)
from pipegoose.nn.fusion.fuse import fuse, unfuse
from pipegoose.nn.fusion.transformers import matching
from tolerances import tol

transformers = pytest.importorskip("transformers")


def _config(kind="modernbert", **kw):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if kind not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {kind}")
    base = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=64)
    if kind == "modernbert":
        base.update(cls_token_id=1, sep_token_id=2)
    return CONFIG_MAPPING[kind](**{**base, **kw})


def _model(kind="modernbert", seed=0, **kw):
    from transformers import AutoModel

    torch.manual_seed(seed)
    return AutoModel.from_config(_config(kind, **kw)).eval()


def _ids(seed=0):
    return torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["modernbert", "modernbert-decoder"])
def test_fuse_replaces_modernberts_mlps_and_unfuse_puts_them_back(kind):
    model = _model(kind)
    mlps = [layer.mlp for layer in model.layers]
    keys = list(model.state_dict())
    ids = _ids()
    with torch.no_grad():
        want = model(input_ids=ids).last_hidden_state
    report = fuse(model, ops=["geglu", "gelu"])
    rows = [r for r in report.rows if r.kind == "geglu"]
    assert [r.replacement for r in rows] == ["FusedModernBertMLP"] * 2, report
    assert "op geglu.packed, approximate='none'" in rows[0].reason and "(Wi/Wo)" in rows[0].reason, rows[0]
    assert not any(r.kind == "gelu" for r in report.rows), report   # (the MLPs' act: kept, not called)
    fused = [layer.mlp for layer in model.layers]
    assert all(type(m) is FusedModernBertMLP and m.activation == "gelu" for m in fused)
    assert [m.act for m in fused] == [m.act for m in mlps] and list(model.state_dict()) == keys
    dispatch.reset_stats()
    with torch.no_grad():
        got = model(input_ids=ids).last_hidden_state
    assert dispatch.stats()["geglu.packed"] == {"torch": 2}
    assert torch.equal(got, want)   # (the reference path runs the MLP's own ops)
    assert unfuse(model) and [layer.mlp for layer in model.layers] == mlps


def test_training_with_dropout_draws_as_the_mlp_does_and_gradients_match():
    model = _model(mlp_dropout=0.3).train()
    ref = copy.deepcopy(model)
    fuse(model, ops=["geglu"])
    assert isinstance(model.layers[0].mlp, FusedModernBertMLP)
    ids = _ids(1)
    outs = []
    for m in (ref, model):
        torch.manual_seed(7)
        y = m(input_ids=ids).last_hidden_state
        y.square().sum().backward()
        outs.append((y.detach(), [p.grad.clone() for p in m.parameters()]))
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1]))


def test_silu_mlps_run_swiglu_packed_and_the_module_checks():
    mlp = _model().layers[0].mlp
    mlp.act = nn.SiLU()
    probe = matching.probe_swiglu_mlp(mlp)
    assert probe.ok and probe.packed and probe.activation == "silu" and probe.layout == "Wi/Wo", probe
    fused = FusedModernBertMLP.from_module(mlp)
    assert fused.activation == "silu" and fused._OP == "swiglu.packed"
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(fused(x), mlp(x))
    with pytest.raises(ValueError, match=r"activation: 'gelu', but the MLP's act computes 'silu'"):
        FusedModernBertMLP.from_module(mlp, activation="gelu")
    with pytest.raises(ValueError, match=r"activation: expected one of 'silu', 'gelu_tanh', 'gelu', got 'relu'"):
        FusedModernBertMLP(nn.Linear(4, 8), nn.Linear(4, 4), activation="relu")
    with pytest.raises(TypeError, match=r"drop: expected a torch.nn.Module or None, got float"):
        FusedModernBertMLP(nn.Linear(4, 8), nn.Linear(4, 4), 0.1)
    assert FusedModernBertMLP.from_module(mlp, verify=False).activation == "gelu"   # (on the caller's word)
    odd = FusedModernBertMLP(nn.Linear(4, 7), nn.Linear(3, 4))
    with pytest.raises(ValueError, match=r"Wi: returned shape \[2, 7\], expected an even last dimension"):
        odd(torch.randn(2, 4))
    with pytest.raises(TypeError, match=r"mlp: expected a module with submodules Wi and Wo"):
        FusedModernBertMLP.from_module(nn.Sequential(nn.Linear(4, 4)))


def test_an_activation_replaced_or_hooked_while_fused_is_run_and_other_mlps_are_refused():
    model = _model()
    fuse(model, ops=["geglu"])
    mlp = model.layers[0].mlp
    x = torch.randn(2, 5, 32)
    calls = []
    mlp.act.register_forward_hook(lambda *a: calls.append(1))
    mlp(x)
    assert calls == [1]   # (the hooked act runs, as the MLP would run it)
    unfuse(model)

    class WithNorm(nn.Module):   # Wi/Wo with another submodule: not the plain MLP
        def __init__(self):
            super().__init__()
            self.Wi, self.act, self.norm, self.Wo = nn.Linear(8, 24), nn.GELU(), nn.LayerNorm(12), nn.Linear(12, 8)

        def forward(self, x):
            a, g = self.Wi(x).chunk(2, dim=-1)
            return self.Wo(self.norm(self.act(a) * g))

    probe = matching.probe_swiglu_mlp(WithNorm())
    assert probe.candidate and not probe.ok and "norm" in probe.reason

    class GateFirst(nn.Module):   # the activated half second: another computation
        def __init__(self):
            super().__init__()
            self.Wi, self.act, self.Wo = nn.Linear(8, 24), nn.GELU(), nn.Linear(12, 8)

        def forward(self, x):
            g, a = self.Wi(x).chunk(2, dim=-1)
            return self.Wo(self.act(a) * g)

    probe = matching.probe_swiglu_mlp(GateFirst())
    assert not probe.ok and "differs from Wo(drop(gelu(input) * gate))" in probe.reason
    assert not isinstance(_model().layers[0].mlp.act, FusedGELU)


def _kernel_matches_the_mlp(mlp, cls, op, dtype, hidden):
    """On CUDA, strict mode: ``cls.from_module(mlp)`` runs ``op`` on our kernel once, and its output and gradients are
    ``mlp``'s within the dtype's rounding (eager rounds the activation before the product in 16-bit)."""
    mlp = mlp.to("cuda", dtype)
    fused = cls.from_module(copy.deepcopy(mlp))
    x = torch.randn(3, 7, hidden, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(3, 7, hidden, device="cuda", dtype=dtype)
    want = mlp(x)
    want_grads = torch.autograd.grad(want, [x, *mlp.parameters()], dy)
    dispatch.reset_stats()
    with dispatch.strict():
        got = fused(x)
        grads = torch.autograd.grad(got, [x, *fused.parameters()], dy)
    assert dispatch.stats()[op] == {"pipegoose": 1}
    torch.testing.assert_close(got, want, **tol(dtype, 4))
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, **tol(dtype, 8))


@pytest.mark.cuda
@pytest.mark.usefixtures("no_tuning_table")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_on_cuda_the_kernel_runs_and_matches_the_mlp(dtype):
    torch.manual_seed(3)
    _kernel_matches_the_mlp(_model(hidden_size=64, intermediate_size=176).layers[0].mlp, FusedModernBertMLP,
                            "geglu.packed", dtype, 64)


# ================================================================================================= Granite
def _granite(kind="granitemoehybrid", act="silu"):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if kind not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {kind}")
    kw = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, shared_intermediate_size=40, num_local_experts=4, num_experts_per_tok=2,
              pad_token_id=0, hidden_act=act)
    if kind == "granitemoehybrid":
        kw.update(layer_types=["attention", "attention"], mamba_n_heads=4, mamba_d_head=16)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(CONFIG_MAPPING[kind](**kw)).eval()


@pytest.mark.parametrize("kind", ["granitemoehybrid", "granitemoeshared"])
def test_fuse_replaces_granites_shared_mlps_and_unfuse_puts_them_back(kind):
    model = _granite(kind)
    mlps = [layer.shared_mlp for layer in model.model.layers]
    keys = list(model.state_dict())
    ids = _ids()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    report = fuse(model)
    rows = [r for r in report.rows if r.replacement == "FusedGraniteMLP"]
    assert [r.path for r in rows] == [f"model.layers.{i}.shared_mlp" for i in range(2)], report
    assert rows[0].kind == "swiglu" and "op swiglu.packed" in rows[0].reason, rows[0]
    fused = [layer.shared_mlp for layer in model.model.layers]
    assert all(type(m) is FusedGraniteMLP and isinstance(m, FusedGateUpSwiGLUMLP) for m in fused)
    assert [m.activation for m in fused] == [m.activation for m in mlps] and list(model.state_dict()) == keys
    dispatch.reset_stats()
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert dispatch.stats()["swiglu.packed"].get("torch", 0) >= 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert unfuse(model) and [layer.shared_mlp for layer in model.model.layers] == mlps


def test_granites_gelu_mlp_is_refused_and_the_module_checks():
    model = _granite(act="gelu")
    report = fuse(model, ops=["swiglu", "geglu"], dry_run=True)
    row = next(r for r in report.rows if r.path == "model.layers.0.shared_mlp")
    assert not row.fused and "GeGLU MLP with gate and up in one input_linear" in row.reason, row
    mlp = _granite().model.layers[0].shared_mlp
    fused = FusedGraniteMLP.from_module(mlp)
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(fused(x), mlp(x))
    calls = []
    mlp.activation.register_forward_hook(lambda *a: calls.append(1))
    fused(x)
    assert calls == [1]   # (hooked since: run as the MLP would)
    odd = FusedGraniteMLP(nn.Linear(4, 7), nn.Linear(3, 4))
    with pytest.raises(ValueError, match=r"input_linear: returned shape \[2, 7\], expected an even last dimension"):
        odd(torch.randn(2, 4))
    with pytest.raises(TypeError, match=r"mlp: expected a module with submodules input_linear and output_linear"):
        FusedGraniteMLP.from_module(nn.Sequential(nn.Linear(4, 4)))


# ================================================================================================= LFM2
def _lfm2(kind="lfm2"):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if kind not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {kind}")
    kw = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, pad_token_id=0, layer_types=["full_attention", "conv"])
    if kind == "lfm2_moe":
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, num_dense_layers=1)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(CONFIG_MAPPING[kind](**kw)).eval()


@pytest.mark.parametrize("kind", ["lfm2", "lfm2_moe"])
def test_fuse_replaces_lfm2s_mlps_and_unfuse_puts_them_back(kind):
    model = _lfm2(kind)
    before = {p: m for p, m in model.named_modules() if type(m).__name__.endswith("MLP")}
    keys = list(model.state_dict())
    ids = _ids()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    report = fuse(model)
    rows = [r for r in report.rows if r.replacement == "FusedLfm2MLP"]
    assert rows and [r.path for r in rows] == list(before), report
    assert all(r.kind == "swiglu" and "w2(silu(w1(x)) * w3(x))" in r.reason for r in rows), rows
    fused = dict(model.named_modules())
    assert all(type(fused[p]) is FusedLfm2MLP and isinstance(fused[p], FusedSwiGLUMLP) for p in before)
    assert list(model.state_dict()) == keys
    dispatch.reset_stats()
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert dispatch.stats()["swiglu"].get("torch", 0) == len(before)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert unfuse(model)
    assert all(dict(model.named_modules())[p] is m for p, m in before.items())


def test_an_lfm2_style_mlp_of_another_activation_is_refused():
    class GeluW(nn.Module):   # the names, GELU inline: not SwiGLU
        def __init__(self):
            super().__init__()
            self.w1, self.w3, self.w2 = nn.Linear(8, 12), nn.Linear(8, 12), nn.Linear(12, 8)

        def forward(self, x):
            return self.w2(torch.nn.functional.gelu(self.w1(x)) * self.w3(x))

    probe = matching.probe_swiglu_mlp(GeluW())
    assert probe.candidate and not probe.ok and "differs from w2(silu(w1(x)) * w3(x))" in probe.reason, probe
    with pytest.raises(ValueError, match=r"mlp: GeluW does not pass the SwiGLU probe"):
        FusedLfm2MLP.from_module(GeluW())
    with pytest.raises(TypeError, match=r"mlp: expected a module with submodules w1, w3 and w2"):
        FusedLfm2MLP.from_module(nn.Sequential(nn.Linear(4, 4)))


@pytest.mark.cuda
@pytest.mark.usefixtures("no_tuning_table")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("which", ["granite", "lfm2"])
def test_granites_and_lfm2s_fused_mlps_run_the_kernel_on_cuda(which, dtype):
    mlp = (_granite().model.layers[0].shared_mlp if which == "granite" else _lfm2().model.layers[0].feed_forward)
    cls, op = (FusedGraniteMLP, "swiglu.packed") if which == "granite" else (FusedLfm2MLP, "swiglu")
    _kernel_matches_the_mlp(mlp, cls, op, dtype, 32)
