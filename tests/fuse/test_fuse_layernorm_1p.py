"""Nemotron's ``NemotronLayerNorm1P`` (LayerNorm of ``weight + 1``): ``FusedLayerNorm(apply_layernorm_1p=True)``
(Megatron-LM's name), the probe ``transformers.matching.probe_layer_norm_1p``, ``FusedLayerNorm.from_module`` and
``fuse(model)`` replacing it by ``MixedFusedLayerNorm(apply_layernorm_1p=True)`` sharing its parameters; on the CPU
(the reference path: the model's own values bit for bit) and, marked ``cuda``, on our LayerNorm kernel."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipegoose.nn.fusion import FusedLayerNorm, MixedFusedLayerNorm, dispatch
from pipegoose.nn.fusion.fuse import fuse, unfuse
from pipegoose.nn.fusion.transformers import matching
from tolerances import tol

from . import models

LayerNorm1P = models.transformers_attr("nemotron", "modeling", "NemotronLayerNorm1P")


def _ln1p(n=48, bias=True, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    ln = LayerNorm1P(n, eps=1e-5, bias=bias)
    with torch.no_grad():
        ln.weight.normal_(0, 0.2)   # (it starts at zeros: the scale weight + 1 starts at 1)
        if bias:
            ln.bias.normal_(0, 0.5)
    return ln.to(dtype)


def _x(shape=(3, 5, 48), dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(shape, generator=g) + 0.5).to(dtype)


# ------------------------------------------------------------------------------------------------- the module
def test_the_constructor_flag_and_its_errors():
    m = FusedLayerNorm(16, apply_layernorm_1p=True)
    assert m.apply_layernorm_1p and torch.equal(m.weight, torch.zeros(16))   # the identity scale
    assert "apply_layernorm_1p=True" in repr(m) and "apply_layernorm_1p" not in repr(FusedLayerNorm(16))
    x = _x((4, 16))
    torch.testing.assert_close(m(x), F.layer_norm(x, (16,)))
    m.weight.data.fill_(3.0)
    m.reset_parameters()
    assert torch.equal(m.weight, torch.zeros(16))
    with pytest.raises(TypeError, match=r"apply_layernorm_1p: expected a bool, got int"):
        FusedLayerNorm(16, apply_layernorm_1p=1)
    with pytest.raises(ValueError, match=r"apply_layernorm_1p: the scale weight \+ 1 needs a weight"):
        FusedLayerNorm(16, elementwise_affine=False, apply_layernorm_1p=True)
    with pytest.raises(ValueError, match=r"apply_layernorm_1p: expected output_in_input_dtype=False"):
        FusedLayerNorm(16, output_in_input_dtype=True, apply_layernorm_1p=True)
    plain = FusedLayerNorm(16)
    with pytest.raises(TypeError, match="apply_layernorm_1p"):
        plain.apply_layernorm_1p = "yes"
    plain.apply_layernorm_1p = True
    assert torch.equal(plain(x), F.layer_norm(x, (16,), plain.weight + 1, plain.bias))
    back = pickle.loads(pickle.dumps(m))
    assert back.apply_layernorm_1p and torch.equal(back(x), m(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("bias", [True, False])
def test_from_module_shares_the_parameters_and_computes_nemotrons_values(dtype, bias):
    ln = _ln1p(bias=bias, dtype=dtype)
    fused = MixedFusedLayerNorm.from_module(ln)
    assert fused.apply_layernorm_1p and fused.weight is ln.weight and fused.bias is ln.bias
    assert fused.eps == ln.eps and fused.normalized_shape == ln.normalized_shape
    x = _x(dtype=dtype).requires_grad_()
    xr = x.detach().clone().requires_grad_()
    y, want = fused(x), ln(xr)
    assert torch.equal(y, want) and y.dtype == dtype   # (the CPU path is F.layer_norm, as the module's)
    dy = _x(dtype=dtype, seed=2)
    grads = torch.autograd.grad(y, [x, *fused.parameters()], dy)
    want_grads = torch.autograd.grad(want, [xr, *ln.parameters()], dy)
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))


def test_cpu_autocast_is_left_alone_as_nemotrons():
    """NemotronLayerNorm1P reads CUDA autocast's flag: under CPU autocast it runs in the input's dtype, and so does
    the fused module."""
    ln = _ln1p()
    fused = MixedFusedLayerNorm.from_module(ln)
    x = _x()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, want = fused(x), ln(x)
    assert y.dtype == want.dtype == torch.float32 and torch.equal(y, want)


def test_flags_carried_checked_at_once_and_the_meta_device():
    """A review's cases: from_module of our own modules (their rules carried over), verify=False on a class named
    LayerNorm1P, the output_in_input_dtype setter, reset_parameters without a weight, a module on the meta device."""
    assert not FusedLayerNorm.from_module(FusedLayerNorm(16)).apply_layernorm_1p
    assert MixedFusedLayerNorm.from_module(FusedLayerNorm(16, apply_layernorm_1p=True)).apply_layernorm_1p
    assert FusedLayerNorm.from_module(FusedLayerNorm(16, output_in_input_dtype=True)).output_in_input_dtype
    assert FusedLayerNorm.from_module(_ln1p(), verify=False).apply_layernorm_1p
    m = FusedLayerNorm(16, apply_layernorm_1p=True)
    with pytest.raises(ValueError, match=r"apply_layernorm_1p: expected output_in_input_dtype=False"):
        m.output_in_input_dtype = True
    assert not m.output_in_input_dtype
    m.apply_layernorm_1p = False
    m.weight, m.elementwise_affine = None, False
    m.reset_parameters()
    meta = FusedLayerNorm(16, apply_layernorm_1p=True, device="meta")
    assert meta(torch.empty(2, 16, device="meta")).shape == (2, 16)
    probe = matching.probe_layer_norm_1p(LayerNorm1P(16, device="meta"))
    assert probe.ok, probe


# ------------------------------------------------------------------------------------------------- the probe
def test_the_probe_takes_layer_norm_1p_and_refuses_the_rest():
    probe = matching.probe_layer_norm_1p(_ln1p())
    assert probe.ok and probe.eps == 1e-5 and not probe.output_in_input_dtype, probe
    assert matching.probe_layer_norm_1p(_ln1p(bias=False)).ok
    assert not matching.layer_norm_1p_candidate(nn.LayerNorm(8))   # (no forward of its own)

    class OtherLayerNorm1P(nn.LayerNorm):   # weight + 2: named so, computing another formula
        def forward(self, x):
            return F.layer_norm(x, self.normalized_shape, self.weight + 2.0, self.bias, self.eps)

    class ScaledLayerNorm(nn.LayerNorm):   # a forward of its own, another name: not looked at
        def forward(self, x):
            return 2 * super().forward(x)

    probe = matching.probe_layer_norm_1p(OtherLayerNorm1P(8))
    assert probe.candidate and not probe.ok and "weight + 1" in probe.reason, probe
    assert not matching.probe_layer_norm_1p(ScaledLayerNorm(8)).candidate
    with pytest.raises(ValueError, match=r"OtherLayerNorm1P is a torch.nn.LayerNorm subclass with a forward of its "
                                         r"own, and not one that FusedLayerNorm computes"):
        FusedLayerNorm.from_module(OtherLayerNorm1P(8))
    with pytest.raises(ValueError, match=r"ScaledLayerNorm .* not a LayerNorm subclass named LayerNorm1P"):
        FusedLayerNorm.from_module(ScaledLayerNorm(8))
    assert not FusedLayerNorm.from_module(ScaledLayerNorm(8), verify=False).apply_layernorm_1p
    ln = _ln1p().eval()
    w = ln.weight.detach().clone()
    state = torch.random.get_rng_state()
    matching.probe_layer_norm_1p(ln)
    assert torch.equal(torch.random.get_rng_state(), state) and not ln.training and torch.equal(ln.weight, w)


# ------------------------------------------------------------------------------------------------- fuse(model)
def _nemotron(attn="sdpa", **extra):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(models.rope_config("nemotron", **extra), attn_implementation=attn)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or name.startswith("model.norm"):
                p.normal_(0, 0.2)
    return model.eval()


def test_fuse_replaces_nemotrons_layer_norm_1p_and_unfuse_puts_it_back():
    model = _nemotron()
    ids = models.inputs()[0]
    norms = {n: m for n, m in model.named_modules() if isinstance(m, LayerNorm1P)}
    assert len(norms) == 5
    with torch.no_grad():
        want = model(input_ids=ids).logits
    keys = list(model.state_dict())
    report = fuse(model, ops=["layer_norm"])
    rows = [r for r in report.rows if r.kind == "layer_norm"]
    assert sorted(r.path for r in rows) == sorted(norms) and all(r.fused for r in rows), report
    assert "LayerNorm of weight + 1" in rows[0].reason and rows[0].replacement == "MixedFusedLayerNorm"
    fused = dict(model.named_modules())
    for name, old in norms.items():
        assert isinstance(fused[name], MixedFusedLayerNorm) and fused[name].apply_layernorm_1p
        assert fused[name].weight is old.weight and fused[name].bias is old.bias
    assert list(model.state_dict()) == keys
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert torch.equal(got, want)
    assert unfuse(model)
    assert all(dict(model.named_modules())[n] is m for n, m in norms.items())


def test_a_model_on_the_meta_device_is_fused():
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(models.rope_config("nemotron"))
    report = fuse(model, ops=["layer_norm"])
    assert [r.fused for r in report.rows] == [True] * 5, report
    unfuse(model)


def test_not_requested_counts_the_layer_norm_1ps_and_not_other_subclasses():
    class ScaledLayerNorm(nn.LayerNorm):   # a forward of its own: never fused, so not counted as left out
        def forward(self, x):
            return 2 * super().forward(x)

    model = _nemotron()
    report = fuse(model, ops=["squared_relu"], dry_run=True)
    assert report.not_requested.get("layer_norm") == 5, report.not_requested
    model.model.norm = ScaledLayerNorm(model.config.hidden_size)
    report = fuse(model, ops=["squared_relu"], dry_run=True)
    assert report.not_requested.get("layer_norm") == 4, report.not_requested


def test_a_layer_norm_1p_of_another_formula_is_a_skipped_row():
    class OtherLayerNorm1P(nn.LayerNorm):
        def forward(self, x):
            return F.layer_norm(x, self.normalized_shape, self.weight + 2.0, self.bias, self.eps)

    model = _nemotron()
    model.model.norm = OtherLayerNorm1P(model.config.hidden_size)
    report = fuse(model, ops=["layer_norm"])
    row = next(r for r in report.rows if r.path == "model.norm")
    assert not row.fused and not row.eligible and "weight + 1" in row.reason, row
    assert sum(r.fused for r in report.rows) == 4
    unfuse(model)


@pytest.mark.cuda
@pytest.mark.usefixtures("no_tuning_table")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_on_cuda_the_layer_norm_kernel_runs_with_nemotrons_values(dtype):
    """Strict mode, ops=["layer_norm"]: every LayerNorm1P runs our kernel with weight + 1; the loss and the gradients
    within the dtype's rounding of the unfused model's (the kernel rounds once, PyTorch's LayerNorm too, in another
    order); under CUDA autocast an fp32 model's norms return bf16, as Nemotron's."""
    model = _nemotron("eager", hidden=64).to("cuda", dtype).train()
    ref = copy.deepcopy(model)
    ids = models.inputs()[0].cuda()
    loss_ref = ref(input_ids=ids, labels=ids).loss
    loss_ref.backward()
    fuse(model, ops=["layer_norm"])
    dispatch.reset_stats()
    with dispatch.strict():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    assert dispatch.stats()["layer_norm"] == {"pipegoose": 5}   # 5 norms (a call counted once, its backward too)
    torch.testing.assert_close(loss, loss_ref, **tol(dtype, 4))
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **tol(dtype, 16), msg=lambda m: f"{name}: {m}")
    ln, fused = ref.model.norm, model.model.norm
    x = torch.randn(2, 7, 64, device="cuda", dtype=dtype)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want, got = ln(x), fused(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, **tol(torch.bfloat16, 2))
    unfuse(model)
