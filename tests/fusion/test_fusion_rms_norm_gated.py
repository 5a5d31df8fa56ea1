"""CPU: op ``rms_norm_gated`` (:mod:`pipegoose.nn.fusion.ops.rms_norm_gated`) for both orders: the reference is
transformers' gated norms bit for bit (Mamba2's gate-first grouped norm and its copies; Qwen3-Next's norm-first is
checked in tests/fuse/test_fuse_rms_norm_gated.py), the kernel's formula in float64 agrees with the reference in
float64, the argument errors name the argument, the dispatcher's reasons, ``FusedRMSNormGated`` with groups and the gate
first, and the kernel's path through a stand-in of its op (the arguments the op gets, its result returned).
The kernel itself: tests/kernels/test_rms_norm_gated_cuda.py (GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipegoose.nn.fusion import FusedRMSNormGated, dispatch, rms_norm_gated
from pipegoose.nn.fusion.ops import rms_norm_gated as op

from fuse.models import gated_norm   # (tests/fuse's helpers: tests/ is on the path, as for tolerances)

transformers = pytest.importorskip("transformers")

# transformers' gate-first grouped norms (Mamba2's formula and its copies)
GATE_FIRST = [("mamba2", "Mamba2RMSNormGated"), ("bamba", "BambaRMSNormGated"), ("nemotron_h", "NemotronHRMSNormGated"),
              ("zamba2", "Zamba2RMSNormGated"), ("granitemoehybrid", "GraniteMoeHybridRMSNormGated")]
FORMS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
         (torch.bfloat16, torch.float32)]


def _module(modeling, cls, width, group, wdtype, seed=0):
    return gated_norm(modeling, cls, width, wdtype, seed, group_size=group, eps=1e-5)


def _inputs(dtype, width, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 7, width, generator=g) + 0.3).to(dtype).requires_grad_()
    gate = (torch.randn(2, 7, width, generator=g) * 2).to(dtype).requires_grad_()
    return x, gate


@pytest.mark.parametrize("dtype, wdtype", FORMS, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("modeling, cls", GATE_FIRST, ids=[c for _, c in GATE_FIRST])
def test_the_reference_is_transformers_gate_first_norm_bit_for_bit(modeling, cls, dtype, wdtype):
    """The gate first over groups (24 values in groups of 8, and one group of 24): output (in the promotion of the
    weight's and x's dtypes, as the module's) and the gradients of x, gate and weight, bit for bit the module's."""
    for group in (8, 24):
        norm = _module(modeling, cls, 24, group, wdtype)
        x, gate = _inputs(dtype, 24)
        want = norm(x, gate)
        dispatch.reset_stats()
        got = rms_norm_gated(x, gate, norm.weight, norm.variance_epsilon, group_size=group, norm_before_gate=False)
        assert got.dtype == want.dtype == torch.promote_types(dtype, wdtype) and torch.equal(got, want)
        assert dispatch.stats()["rms_norm_gated"] == {"torch": 1}
        dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(got.dtype)
        for a, b in zip(torch.autograd.grad(got, (x, gate, norm.weight), dy),
                        torch.autograd.grad(want, (x, gate, norm.weight), dy)):
            assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("first", [True, False], ids=["norm_first", "gate_first"])
def test_the_kernel_formula_is_the_reference_in_float64(first):
    """In float64 the kernel's numerics (one rounding) and the modules' (a rounding to x's dtype before the weight:
    none in float64) are one formula: equal to float64 rounding, groups and the whole row, with and without a weight."""
    x, gate = (t.detach().double() for t in _inputs(torch.float64, 24))
    w = torch.rand(24, dtype=torch.float64) + 0.5
    for group in (4, 24):
        for weight in (w, None):
            a = op.rms_norm_gated_kernel_math(x, gate, weight, 1e-6, group, first, torch.float64)
            b = op.rms_norm_gated_reference(x, gate, weight, 1e-6, group, first)
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


def test_argument_errors_name_the_argument():
    x, gate = _inputs(torch.float32, 24)
    w = torch.ones(24)
    cases = [(dict(group_size=5), ValueError, "group_size"), (dict(group_size=48), ValueError, "group_size"),
             (dict(group_size=0), ValueError, "group_size"), (dict(group_size=2.0), TypeError, "group_size"),
             (dict(group_size=True), TypeError, "group_size"),
             (dict(norm_before_gate=1), TypeError, "norm_before_gate"),
             (dict(impl="nope"), ValueError, "nope")]
    for kw, err, name in cases:
        with pytest.raises(err, match=name):
            rms_norm_gated(x, gate, w, 1e-6, **kw)
    with pytest.raises(TypeError, match="gate"):
        rms_norm_gated(x, gate.int(), w)
    with pytest.raises(ValueError, match="gate"):
        rms_norm_gated(x, gate[..., :8], w)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_gated(x, gate, torch.ones(8))
    with pytest.raises(ValueError, match="eps"):
        rms_norm_gated(x, gate, w, -1.0)
    with pytest.raises(TypeError, match="x"):
        rms_norm_gated(torch.tensor(1.0), torch.tensor(1.0), None)


def test_the_dispatcher_says_why_each_implementation_does_not_run():
    """On the CPU the reference runs (a fallback: the fused paths need CUDA); the kernel is opt-in; ops refuses the
    gate first and groups below the row, with the reason."""
    x, gate = _inputs(torch.bfloat16, 24)
    c = dispatch.explain("rms_norm_gated", x, gate, None, 1e-6, 8, False)
    assert c.impl == "torch" and c.fallback
    assert "CUDA" in c.reasons["pipegoose"] and "two ops" in c.reasons["ops"]
    p = op.rms_norm_gated_problem(x, None, 8, True, torch.bfloat16)
    p = dataclasses.replace(p, device=torch.device("cuda", 0))
    ok, why = dispatch.implementations("rms_norm_gated")["ops"].supports(p)
    assert not ok and "groups of 8" in why
    assert dispatch.implementations("rms_norm_gated")["pipegoose"].supports(p) == (True, "")
    big = dataclasses.replace(p, extra=dict(p.extra, group=32768))
    ok, why = dispatch.implementations("rms_norm_gated")["pipegoose"].supports(big)
    assert not ok and "16384" in why


@pytest.mark.parametrize("dtype, wdtype", FORMS, ids=lambda d: str(d)[6:])
def test_fused_module_with_groups_and_the_gate_first(dtype, wdtype):
    """FusedRMSNormGated(group_size=8, norm_before_gate=False) sharing a Mamba2 norm's weight: the module's output and
    gradients bit for bit; repr says the form; a bad group_size or order raises naming it."""
    norm = _module("mamba2", "Mamba2RMSNormGated", 24, 8, wdtype)
    fused = FusedRMSNormGated(24, 1e-5, group_size=8, norm_before_gate=False)
    fused.weight = norm.weight
    x, gate = _inputs(dtype, 24)
    got, want = fused(x, gate), norm(x, gate)
    assert torch.equal(got, want) and got.dtype == want.dtype
    for a, b in zip(torch.autograd.grad(got.sum(), (x, gate, norm.weight)),
                    torch.autograd.grad(want.sum(), (x, gate, norm.weight))):
        assert torch.equal(a, b)
    assert "group_size=8" in repr(fused) and "norm_before_gate=False" in repr(fused)
    assert FusedRMSNormGated(24, group_size=24).group_size is None   # (the whole row)
    with pytest.raises(ValueError, match="group_size"):
        FusedRMSNormGated(24, group_size=5)
    with pytest.raises(TypeError, match="group_size"):
        FusedRMSNormGated(24, group_size=8.0)
    with pytest.raises(TypeError, match="norm_before_gate"):
        FusedRMSNormGated(24, norm_before_gate="no")


def test_the_kernel_path_through_a_stand_in(monkeypatch):
    """With the kernel's op stood in by its formula on the CPU (the dispatcher's real ``supports`` asked as for a
    GPU), impl="pipegoose" calls ``torch.ops.pipegoose.rms_norm_gated`` once with x, gate, the weight, eps, the group
    (the row's width for None), the order and the output dtype (fp32 for bf16 x with an fp32 weight, the gate first;
    x's dtype with the norm first), and returns its result (gradients through it)."""
    calls = []

    def rms_norm_gated_op(x, gate, weight, eps, group, first, out):
        calls.append((x, gate, weight, eps, group, first, out))
        return op.rms_norm_gated_kernel_math(x, gate, weight, eps, group, first, out)

    ops = type("Ops", (), {})()
    ops.rms_norm_gated = type("Op", (), {"default": staticmethod(rms_norm_gated_op)})()
    im = dispatch.implementations("rms_norm_gated")["pipegoose"]

    def on_gpu(p, _real=im.supports):
        return _real(dataclasses.replace(p, device=torch.device("cuda", 0)))

    real_load = dispatch._load_kernel
    monkeypatch.setattr(dispatch, "_load_kernel", lambda n: ops if n == "pipegoose/rms_norm_gated" else real_load(n))
    monkeypatch.setattr(dispatch, "_device_name", lambda device: None)
    dispatch.register(dataclasses.replace(im, supports=on_gpu))
    dispatch.clear_kernel_cache()
    try:
        x, gate = _inputs(torch.bfloat16, 24)
        w = torch.ones(24, requires_grad=True)
        for group, first, out in ((None, True, torch.bfloat16), (8, False, torch.float32)):
            calls.clear()
            dispatch.reset_stats()
            y = rms_norm_gated(x, gate, w, 1e-5, group_size=group, norm_before_gate=first, impl="pipegoose")
            assert dispatch.stats()["rms_norm_gated"] == {"pipegoose": 1}
            (cx, cg, cw, eps, cgroup, cfirst, cout), = calls
            assert cx is x and cg is gate and cw is w and eps == 1e-5 and cgroup == (group or 24)
            assert cfirst is first and cout == out and y.dtype == out
            want = op.rms_norm_gated_kernel_math(x, gate, w, 1e-5, group or 24, first, out)
            assert torch.equal(y, want)
            assert all(g is not None for g in torch.autograd.grad(y.sum(), (x, gate, w)))
        # Mamba2's PyTorch path in a bf16 model: fp32 x, bf16 gate and weight; cast to fp32 (exactly) for the kernel,
        # the output fp32 (the module's promotion), the gradients back in bf16
        x32 = x.detach().float().requires_grad_()
        wb = torch.rand(24).bfloat16().requires_grad_()
        calls.clear()
        y = rms_norm_gated(x32, gate, wb, 1e-5, group_size=8, norm_before_gate=False, impl="pipegoose")
        (cx, cg, cw, _, _, _, cout), = calls
        assert cx is x32 and cg.dtype == cw.dtype == cout == y.dtype == torch.float32
        assert torch.equal(cg, gate.float()) and torch.equal(cw, wb.float())
        gx, gg, gw = torch.autograd.grad(y.sum(), (x32, gate, wb))
        assert gx.dtype == torch.float32 and gg.dtype == gw.dtype == torch.bfloat16
    finally:
        dispatch.register(im)
        dispatch.clear_kernel_cache()
        dispatch.reset_stats()


def test_impl_auto_compiles_as_the_default():
    """A breaker: torch.compile(fullgraph=True) of a fused module built with impl="auto" broke its graph (the
    dispatcher's lock) where impl=None compiled: "auto" is no request there either."""
    x, gate = (t.detach() for t in _inputs(torch.float32, 24))
    want = FusedRMSNormGated(24)(x, gate)
    for impl in (None, "auto", " Auto "):
        got = torch.compile(FusedRMSNormGated(24, impl=impl), fullgraph=True, backend="eager")(x, gate)
        torch.testing.assert_close(got, want)
