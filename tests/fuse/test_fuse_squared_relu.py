"""Squared ReLU alone (op ``squared_relu``, :func:`pipegoose.nn.fusion.functional.squared_relu`,
:class:`FusedSquaredReLU`) and ``fuse(model)`` replacing transformers' ``ReLUSquaredActivation`` (``relu2``: the MLPs
without a gate of Arcee, Nemotron, Persimmon), on the CPU: the reference path, argument errors, dispatch, the probe,
the report, unfuse. The kernel itself: tests/kernels/test_squared_relu_cuda.py; on a GPU, fused models: the last test
here."""

from __future__ import annotations

import copy
import pickle
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipegoose.nn.fusion import FusedSquaredReLU, dispatch
from pipegoose.nn.fusion import functional as PF
from pipegoose.nn.fusion.fuse import fuse, fusion_report, unfuse
from pipegoose.nn.fusion.ops import swiglu as S
from pipegoose.nn.fusion.transformers import matching
from tolerances import tol

from . import models

transformers = pytest.importorskip("transformers")
from transformers import activations as A  # noqa: E402

ReLUSquared = pytest.importorskip("transformers.activations").ReLUSquaredActivation


@pytest.fixture(autouse=True)
def _fresh_stats():
    dispatch.reset_stats()
    yield


def _x(shape=(3, 5, 7), dtype=torch.float32, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(shape, generator=g)).to(dtype).requires_grad_(requires_grad)


# ------------------------------------------------------------------------------------------------- functional
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_reference_path_is_transformers_relu2_bit_for_bit(dtype):
    x = _x(dtype=dtype, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    dy = _x(dtype=dtype, seed=1)
    y = PF.squared_relu(x)
    want = ReLUSquared()(xr)
    assert torch.equal(y, want) and y.dtype == dtype
    assert (y == 0).any() and (y > 0).any()   # (both sides of the bend)
    y.backward(dy)
    want.backward(dy)
    assert torch.equal(x.grad, xr.grad)
    assert dispatch.stats()["squared_relu"] == {"torch": 1}
    c = dispatch.last_choice("squared_relu")
    assert (c.impl, c.fallback) == ("torch", True) and "needs a CUDA tensor" in c.reasons["pipegoose"]


def test_the_edges_nan_infinity_and_the_bend():
    x = torch.tensor([float("nan"), float("-inf"), float("inf"), -0.0, 0.0, -1.0, 2.0], requires_grad=True)
    y = PF.squared_relu(x)
    assert torch.equal(y.isnan(), torch.tensor([True] + [False] * 6))
    assert y[1:].tolist() == [0.0, float("inf"), 0.0, 0.0, 0.0, 4.0]
    y.backward(torch.full_like(x, float("inf")))   # 0 where x <= 0 even for an infinite grad_output (PyTorch's)
    assert x.grad[1:].tolist() == [0.0, float("inf"), 0.0, 0.0, 0.0, float("inf")] and x.grad[0].isnan()


def test_argument_errors_name_the_argument():
    with pytest.raises(TypeError, match=r"^input: "):
        PF.squared_relu([1.0, 2.0])
    with pytest.raises(TypeError, match=r"^input: "):
        PF.squared_relu(torch.arange(4))
    with pytest.raises(ValueError, match=r"impl: squared_relu has no implementation 'fused'"):
        PF.squared_relu(_x(), impl="fused")
    with pytest.raises(TypeError):
        PF.squared_relu(_x(), "tanh")   # (no approximate: impl is keyword-only)


def test_registration_variable_and_strict_mode(monkeypatch):
    impls = dispatch.implementations("squared_relu")
    assert list(impls) == ["pipegoose", "torch"]
    assert impls["pipegoose"].kernels == ("pipegoose/swiglu",) and impls["torch"].small_first
    assert dispatch._env_names("squared_relu") == ("PIPEGOOSE_IMPL_SQUARED_RELU",)
    x = _x()
    monkeypatch.setenv("PIPEGOOSE_IMPL_SQUARED_RELU", "torch")
    assert torch.equal(PF.squared_relu(x), torch.square(F.relu(x)))
    c = dispatch.last_choice("squared_relu")
    assert (c.impl, c.source) == ("torch", "env")
    monkeypatch.delenv("PIPEGOOSE_IMPL_SQUARED_RELU")
    with dispatch.strict():
        with pytest.raises(dispatch.FusionFallbackError, match=r"squared_relu: strict mode.*needs a CUDA tensor"):
            PF.squared_relu(x)
        assert PF.squared_relu(x[:0]).shape == (0, 5, 7)   # (empty: not a fallback)
        assert torch.equal(PF.squared_relu(x, impl="torch"), torch.square(F.relu(x)))


def test_the_kernel_takes_cuda_fp32_fp16_bf16_and_declines_the_rest():
    ours = dispatch.implementations("squared_relu")["pipegoose"]
    cuda = torch.device("cuda")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert ours.supports(replace(S.squared_relu_problem(_x(dtype=dtype)), device=cuda)) == (True, "")
    ok, why = ours.supports(replace(S.squared_relu_problem(_x(dtype=torch.float64)), device=cuda))
    assert not ok and "float64" in why
    assert ours.supports(replace(S.squared_relu_problem(_x()[:0]), device=cuda)) == (False, "an empty input")
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(_x(), _x(seed=2))
        ok, why = ours.supports(replace(S.squared_relu_problem(dual), device=cuda))
        assert not ok and "squared ReLU kernel has no forward derivative" in why


# ------------------------------------------------------------------------------------------------- the probe
class SquaredReLU(nn.Module):   # Primer's name, written out
    def forward(self, x):
        return F.relu(x) ** 2


def test_the_probe_finds_squared_relu_by_class_name_and_formula():
    for act in (ReLUSquared(), A.ACT2FN["relu2"], SquaredReLU()):
        assert matching.squared_relu_candidate(act)
        probe = matching.probe_squared_relu(act)
        assert probe.candidate and probe.ok and probe.approximate is None, probe
    for act in (nn.ReLU(), A.ACT2FN["relu6"], nn.GELU(), A.NewGELUActivation()):
        assert not matching.squared_relu_candidate(act) and not matching.probe_squared_relu(act).candidate
    assert "class name says squared ReLU" in matching.probe_squared_relu(nn.ReLU()).reason


def test_the_probe_refuses_other_functions_extra_arguments_and_modules_with_state():
    class ClippedReLUSquared(nn.Module):   # a clamp far out shows
        def forward(self, x):
            return F.relu(x).clamp(max=50.0) ** 2

    class ScaledSquaredReLU(nn.Module):
        def forward(self, x):
            return 0.5 * F.relu(x) ** 2

    class SquaredReLUWithScale(nn.Module):
        def forward(self, x, scale=1.0):
            return F.relu(x) ** 2 * scale

    for act in (ClippedReLUSquared(), ScaledSquaredReLU()):
        probe = matching.probe_squared_relu(act)
        assert probe.candidate and not probe.ok and "another function than relu(x)^2" in probe.reason, probe
    assert "more than the input" in matching.probe_squared_relu(SquaredReLUWithScale()).reason
    with_buffer = SquaredReLU()
    with_buffer.register_buffer("scale", torch.ones(1))
    assert not matching.squared_relu_candidate(with_buffer)
    assert "not a leaf module without parameters or buffers" in matching.probe_squared_relu(with_buffer).reason
    hooked = ReLUSquared()
    hooked.register_forward_hook(lambda *a: None)
    assert matching.probe_squared_relu(hooked).ok   # (fuse hands the hooks to the replacement)
    assert not matching.probe_gelu(ReLUSquared()).candidate   # (each probe looks at its own names)


# ------------------------------------------------------------------------------------------------- FusedSquaredReLU
def test_fused_squared_relu_constructor_from_module_and_repr():
    assert repr(FusedSquaredReLU()) == "FusedSquaredReLU()"
    assert repr(FusedSquaredReLU(impl="torch")) == "FusedSquaredReLU(impl='torch')"
    with pytest.raises(ValueError, match=r"impl: squared_relu has no implementation 'apex'"):
        FusedSquaredReLU(impl="apex")
    with pytest.raises(TypeError, match=r"act: expected a torch.nn.Module, got function"):
        FusedSquaredReLU.from_module(lambda x: F.relu(x) ** 2)
    with pytest.raises(ValueError, match=r"act: ReLU does not pass the squared ReLU probe: computes another"):
        FusedSquaredReLU.from_module(nn.ReLU())
    with pytest.raises(ValueError, match=r"act: Sequential does not pass the squared ReLU probe: Sequential is not"):
        FusedSquaredReLU.from_module(nn.Sequential(ReLUSquared()))
    assert isinstance(FusedSquaredReLU.from_module(nn.ReLU(), verify=False), FusedSquaredReLU)

    class Act(nn.Module):   # (fuse() looks only at classes named so; from_module at the module given)
        def forward(self, x):
            return torch.relu(x).square()

    assert FusedSquaredReLU.from_module(Act()).impl is None
    assert not FusedSquaredReLU.from_module(ReLUSquared().eval()).training
    m = pickle.loads(pickle.dumps(FusedSquaredReLU(impl="torch")))
    assert m.impl == "torch" and torch.equal(m(_x()), ReLUSquared()(_x()))


def test_fused_squared_relu_forward_and_backward_are_transformers():
    x = _x(dtype=torch.bfloat16, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y = FusedSquaredReLU()(x)
    want = ReLUSquared()(xr)
    assert torch.equal(y, want)
    y.sum().backward()
    want.sum().backward()
    assert torch.equal(x.grad, xr.grad)


# ------------------------------------------------------------------------------------------------- fuse(model)
def _model(model_type, attn="sdpa", **extra):
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    cfg = models.rope_config(model_type, hidden_act="relu2", **extra)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()


def _act(model, i=0):
    mlp = model.model.layers[i].mlp
    return mlp.act if hasattr(mlp, "act") else mlp.act_fn


@pytest.mark.parametrize("model_type", ["arcee", "nemotron", "persimmon"])
def test_fuse_replaces_the_squared_relu_of_mlps_without_a_gate_and_unfuse_puts_it_back(model_type):
    model = _model(model_type)
    ids, mask = models.inputs()
    old = _act(model)
    assert isinstance(old, ReLUSquared)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    keys = list(model.state_dict())
    assert [r.kind for r in fuse(model, dry_run=True).rows].count("squared_relu") == 2   # (in the default ops)
    report = fuse(model, ops=["squared_relu"])   # (alone: the others' own tests compare them)
    rows = [r for r in report.rows if r.kind == "squared_relu"]
    assert len(rows) == 2 and all(r.fused and r.replacement == "FusedSquaredReLU" for r in rows), report
    assert rows[0].path == f"model.layers.0.mlp.{'act' if model_type == 'persimmon' else 'act_fn'}", rows[0]
    assert "op squared_relu" in rows[0].reason and "@1024 wide" in rows[0].forward, rows[0]
    assert isinstance(_act(model), FusedSquaredReLU) and isinstance(_act(model, 1), FusedSquaredReLU)
    assert list(model.state_dict()) == keys
    dispatch.reset_stats()
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
    assert dispatch.stats()["squared_relu"] == {"torch": 2}
    assert torch.equal(got, want)   # (the reference path is transformers' ops)
    assert unfuse(model)
    assert _act(model) is old


def test_dry_run_ops_the_count_left_out_held_rows_and_copies():
    model = _model("arcee")
    act = _act(model)
    dry = fuse(model, dry_run=True)
    assert [r.path for r in dry.rows if r.kind == "squared_relu"] == ["model.layers.0.mlp.act_fn",
                                                                      "model.layers.1.mlp.act_fn"]
    assert _act(model) is act and fusion_report(model) is None
    report = fuse(model, ops=["rms_norm"], dry_run=True)
    assert report.not_requested.get("squared_relu") == 2 and not any(r.kind == "squared_relu" for r in report.rows)
    fuse(model.model.layers[0], ops=["squared_relu"])
    report = fuse(model, ops=["squared_relu", "rms_norm"])
    row = next(r for r in report.rows if r.path == "model.layers.0.mlp.act_fn")
    assert row.fused and row.kind == "squared_relu" and "earlier fuse()" in row.reason, row
    assert isinstance(_act(model, 1), FusedSquaredReLU)
    with pytest.raises(RuntimeError, match="already fused"):
        fuse(model)
    with pytest.raises(RuntimeError, match=r"holds fused modules .* but fuse\(\) has no record"):
        unfuse(copy.deepcopy(model))
    unfuse(model)
    assert _act(model) is act and not isinstance(_act(model, 1), FusedSquaredReLU)


def test_a_hooked_activation_keeps_its_hooks_a_clipped_one_is_skipped_and_a_shared_one_is_replaced_once():
    class ClippedReLUSquared(nn.Module):
        def forward(self, x):
            return F.relu(x).clamp(max=50.0) ** 2

    model = _model("arcee")
    seen = []
    handle = _act(model).register_forward_hook(lambda m, i, o: seen.append(type(m).__name__))
    model.model.layers[1].mlp.act_fn = ClippedReLUSquared()
    report = fuse(model, ops=["squared_relu"])
    rows = {r.path: r for r in report.rows}
    assert rows["model.layers.0.mlp.act_fn"].fused
    skipped = rows["model.layers.1.mlp.act_fn"]
    assert not skipped.fused and not skipped.eligible and "another function than relu(x)^2" in skipped.reason
    with torch.no_grad():
        model(input_ids=models.inputs()[0])
    assert seen == ["FusedSquaredReLU"]
    handle.remove()
    unfuse(model)
    assert not _act(model)._forward_hooks

    model = _model("arcee")
    shared = _act(model)
    model.model.layers[1].mlp.act_fn = shared
    report = fuse(model, ops=["squared_relu"])
    assert [r.kind for r in report.rows] == ["squared_relu"] and _act(model) is _act(model, 1)
    assert isinstance(_act(model), FusedSquaredReLU)
    unfuse(model)
    assert _act(model) is shared and _act(model, 1) is shared


@pytest.mark.cuda
@pytest.mark.usefixtures("no_tuning_table")
@pytest.mark.parametrize("model_type", ["arcee", "nemotron", "persimmon"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_on_cuda_a_fused_model_runs_the_kernel_with_the_models_values(model_type, dtype):
    """Strict mode, ops=["squared_relu"]: each MLP's activation runs our kernel (op squared_relu, forward and
    backward), the loss is the unfused model's bit for bit (the kernel's values are eager PyTorch's; the rest of the
    model runs the same code, eager attention) and every gradient within the dtype's rounding (other kernels of the
    backward may sum in another order from run to run)."""
    model = _model(model_type, "eager", hidden=64).to("cuda", dtype).train()
    ref = copy.deepcopy(model)
    ids = models.inputs()[0].cuda()
    loss_ref = ref(input_ids=ids, labels=ids).loss
    loss_ref.backward()
    report = fuse(model, ops=["squared_relu"])
    assert [r.forward for r in report.rows] == ["pipegoose @1024 wide"] * 2, report
    dispatch.reset_stats()
    with dispatch.strict():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    assert dispatch.stats()["squared_relu"] == {"pipegoose": 2}
    assert torch.equal(loss, loss_ref)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **tol(dtype, 2), msg=lambda m: f"{name}: {m}")
    unfuse(model)
