"""The correctness gate of the op benchmarks: a wrong implementation is reported FAILED and never timed (CPU)."""

import math
import sys
import types

import _bench_path  # noqa: F401
import pytest
import torch
import torch.nn.functional as F

from benchmarks import ops
from pipegoose.nn.fusion.ops.rope import rope_reference
from benchmarks.common import tolerances
from benchmarks.timing import Timer


def test_check_close_flags_nan_and_off_elements():
    ref = torch.linspace(-1, 1, 100)
    ok, err, bad = ops.check_close(ref.clone(), ref, atol=1e-5, rtol=1e-4)
    assert ok and err == 0 and bad == 0
    out = ref.clone()
    out[7] = float("nan")        # an element the kernel never wrote
    out[9] += 0.1
    ok, err, bad = ops.check_close(out, ref, atol=1e-5, rtol=1e-4)
    assert not ok and bad == 2 and math.isnan(err)
    with pytest.raises(ValueError, match="shape"):
        ops.check_close(ref[:3], ref, 1e-5, 1e-4)


@pytest.mark.parametrize("size", [0, 1])
@pytest.mark.parametrize("op", ops.OPS)
def test_reference_matches_torch_on_fp32(op, size):
    case = ops.make_case(op, torch.float32, ops.sizes_for(op, "dry")[size], "cpu")
    ref = ops.reference(case)
    # (PyTorch has no single op for SwiGLU, GeGLU, the squared ReLU or RoPE: their eager code, transformers')
    fn = ops.IMPLS["eager" if op in (*ops.GATED, "squared_relu", "rope") else "native"](case)
    y = fn(case.inputs)
    ys = y if isinstance(y, tuple) else (y,)
    assert set(ref) == {*case.outs, *(f"d{n}" for n in case.wrt)} and len(ys) == len(case.outs)
    grads = torch.autograd.grad(ys, [case.inputs[n] for n in case.wrt], case.dy)
    for name, t in zip(case.outs, ys):
        torch.testing.assert_close(t, ref[name], atol=1e-5, rtol=1e-4)
    for n, g in zip(case.wrt, grads):
        torch.testing.assert_close(g, ref[f"d{n}"], atol=1e-4, rtol=1e-4)


def test_rope_case_has_llamas_layout_and_tables():
    """q and k as Llama's attention makes them (a [B, S, H, D] projection seen as [B, H, S, D]), the gradients in the
    same layout, cos and sin [B, S, D] in the dtype with equal halves (LlamaRotaryEmbedding's cat(freqs, freqs)) and
    rows of their own per batch (a kernel reading batch 0's table for every row fails the gate)."""
    case = ops.make_case("rope", torch.bfloat16, 64, "cpu")
    b, seq, hq, hk, d = (case.shape[k] for k in ("b", "seq", "hq", "hk", "d"))
    assert (hq, hk, d) == (32, 4, 64) and case.cols == 64 and case.wrt == ["q", "k"]
    for t, h in ((case.inputs["q"], hq), (case.inputs["k"], hk), *zip(case.dy, (hq, hk))):
        assert t.shape == (b, h, seq, d) and t.dtype == torch.bfloat16
        assert t.transpose(1, 2).is_contiguous() and not t.is_contiguous()
    assert case.inputs["q"].is_leaf and case.inputs["q"].requires_grad
    cos, sin = case.inputs["cos"], case.inputs["sin"]
    assert cos.shape == sin.shape == (b, seq, d) and cos.dtype == torch.bfloat16 and not cos.requires_grad
    assert torch.equal(cos[..., : d // 2], cos[..., d // 2:]) and torch.equal(sin[..., : d // 2], sin[..., d // 2:])
    assert not torch.equal(cos[0], cos[1])
    torch.testing.assert_close(cos.float() ** 2 + sin.float() ** 2, torch.ones(b, seq, d), atol=2e-2, rtol=0)
    assert ops.shape_for("rope", 64, "cuda") == {"b": 4, "seq": 2048, "hq": 32, "hk": 4, "d": 64}
    assert all(ops.shape_for("rope", c, "cuda")["d"] == c for c in ops.sizes_for("rope", "full"))
    assert ops.impls_for("rope") == ["eager", "compile", "liger", "torch", "pipegoose"]


def test_packed_swiglu_case_is_one_contiguous_x_at_swiglus_sizes_and_rows():
    """swiglu.packed runs where swiglu runs (the same sizes, rows and dtypes: side by side in one run), on one contiguous
    x [rows, 2 * inter] as a Linear makes it; its reference is swiglu's of x's halves, its gradient the halves' side by
    side in one dx."""
    for mode in ("full", "quick", "dry"):
        assert ops.sizes_for("swiglu.packed", mode) == ops.sizes_for("swiglu", mode)
        for dev in ("cuda", "cpu"):
            assert all(ops.shape_for("swiglu.packed", c, dev) == ops.shape_for("swiglu", c, dev)
                       for c in ops.sizes_for("swiglu", mode))
    assert ops.sizes_for("swiglu.packed", "full") == [1408, 3072, 5632, 11008, 14336, 28672]
    assert ops.shape_for("swiglu.packed", 5632, "cuda") == {"rows": 16384, "inter": 5632}
    assert ops.impls_for("swiglu.packed") == ops.impls_for("swiglu") == ["eager", "compile", "liger", "torch",
                                                                          "pipegoose"]
    case = ops.make_case("swiglu.packed", torch.bfloat16, 64, "cpu")
    rows = case.shape["rows"]
    x = case.inputs["x"]
    assert set(case.inputs) == {"x"} and case.wrt == ["x"] and case.outs == ("y",) and case.cols == 64
    assert x.shape == (rows, 128) and x.is_contiguous() and x.is_leaf and x.requires_grad and x.dtype == torch.bfloat16
    assert case.dy.shape == (rows, 64) and case.dy.dtype == torch.bfloat16
    ref = ops.reference(case)
    assert set(ref) == {"y", "dx"} and ref["y"].shape == (rows, 64) and ref["dx"].shape == (rows, 128)
    gate, up = x.detach().chunk(2, dim=-1)
    assert gate.abs().max() > 1.5 * up.abs().max()   # (the gate scaled by 2, as swiglu's)
    two = ops.Case("swiglu", torch.bfloat16, case.shape, 64, {"g": gate.contiguous(), "u": up.contiguous()},
                   ["g", "u"], case.dy)
    ref2 = ops.reference(two, chunk_elems=640)   # (rows in chunks, too)
    assert torch.equal(ref["y"], ref2["y"])
    assert torch.equal(ref["dx"], torch.cat((ref2["dg"], ref2["du"]), dim=-1))


def test_packed_swiglus_eager_impl_is_phi3s_and_the_dispatchers_reference():
    """eager: Phi3MLP's chunk then ``up * silu(gate)``, whose backward concatenates the halves' gradients: to the bit
    the dispatcher's ``torch`` reference, ``silu_and_mul_reference`` (F.silu(gate) * up)."""
    from pipegoose.nn.fusion.ops.swiglu import silu_and_mul_reference

    case = ops.make_case("swiglu.packed", torch.bfloat16, 64, "cpu")
    x = case.inputs["x"]
    y = ops.IMPLS["eager"](case)(case.inputs)
    (dx,) = torch.autograd.grad(y, x, case.dy)
    y2 = silu_and_mul_reference(x)
    (dx2,) = torch.autograd.grad(y2, x, case.dy)
    assert torch.equal(y, y2) and torch.equal(dx, dx2) and dx.shape == x.shape


def test_packed_swiglu_impl_of_the_wrong_halves_is_failed():
    case = ops.make_case("swiglu.packed", torch.float32, 16, "cpu")
    case.ref = ops.reference(case)
    tol = tolerances()[torch.float32]
    assert ops.check_impl(ops.IMPLS["eager"](case), case, tol)[0] == "ok"

    def swapped(i):   # gate and up the other way round: the right shapes and dtypes, wrong values and gradient
        up, gate = i["x"].chunk(2, dim=-1)
        return F.silu(gate) * up

    status, _, detail = ops.check_impl(swapped, case, tol)
    assert status == "FAILED" and "y:" in detail and "dx:" in detail


class _LigerSiLUMul(torch.autograd.Function):
    """Liger-Kernel's LigerSiLUMulFunction (0.8.5) in PyTorch, for the CPU (its kernels are Triton): ``ensure_contiguous``
    copies a strided gate and up, the forward rounds silu(gate) to the dtype before the product, and the backward
    writes dgate and dup into the saved gate and up and returns those. Records the arguments it is given."""

    given: list = []

    @staticmethod
    def forward(ctx, a, b):
        _LigerSiLUMul.given.append((a.shape, a.stride(), b.data_ptr() - a.data_ptr(), a.element_size()))
        a, b = a.contiguous(), b.contiguous()
        ctx.save_for_backward(a, b)
        return F.silu(a.float()).to(b.dtype) * b

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        sig = torch.sigmoid(a.float())
        silu = a.float() * sig
        db = dc.float() * silu
        da = dc.float() * (silu * (1 - sig) + sig) * b.float()
        a.copy_(da)
        b.copy_(db)
        return a, b


def _fake_liger(monkeypatch, silu_mul) -> None:
    """liger_kernel's modules that benchmarks.ops imports, with ``silu_mul`` as its LigerSiLUMulFunction."""
    mods = {n: types.ModuleType(n) for n in ("liger_kernel", "liger_kernel.transformers",
                                             "liger_kernel.transformers.functional", "liger_kernel.ops",
                                             "liger_kernel.ops.swiglu")}
    mods["liger_kernel"].transformers = mods["liger_kernel.transformers"]
    mods["liger_kernel.transformers"].functional = mods["liger_kernel.transformers.functional"]
    mods["liger_kernel"].ops = mods["liger_kernel.ops"]
    mods["liger_kernel.ops"].swiglu = mods["liger_kernel.ops.swiglu"]
    mods["liger_kernel.ops.swiglu"].LigerSiLUMulFunction = silu_mul
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)


def test_packed_swiglus_liger_impl_is_liger_silu_mul_of_xs_two_halves(monkeypatch):
    """liger: LigerSiLUMulFunction of x.chunk(2, -1), as Liger's LigerPhi3SwiGLUMLP calls it: the two strided halves of
    x itself (gate first), checked and timed like the others; x is put back after it, as after swiglu's."""
    _fake_liger(monkeypatch, _LigerSiLUMul)
    monkeypatch.setattr(_LigerSiLUMul, "given", [])
    monkeypatch.setenv("PIPEGOOSE_STRICT", "1")   # (what run_ops sets for torch's row; put back after the test)
    case = ops.make_case("swiglu.packed", torch.float32, 16, "cpu")
    fn = ops.IMPLS["liger"](case)
    assert fn.clobbers_inputs
    res = ops.run_ops(["swiglu.packed"], [torch.float32, torch.bfloat16], "dry", "cpu", Timer("cpu", warmup=0, reps=2),
                      tolerances(), ["liger", "torch"], deadline=1e18, log=lambda s: None)
    assert res and {(m.impl, m.status) for m in res} == {("liger", "ok"), ("torch", "ok")}
    assert {(m.dtype, m.cols) for m in res} == {(d, c) for d in ("float32", "bfloat16") for c in (16, 64)}
    assert _LigerSiLUMul.given
    for shape, stride, offset, size in _LigerSiLUMul.given:   # gate then up: x's halves, not copies of them
        rows, d = shape
        assert stride == (2 * d, 1) and offset == d * size
    monkeypatch.delitem(sys.modules, "liger_kernel.ops.swiglu")
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.swiglu", None)   # (an install without it)
    with pytest.raises(ops.Unavailable, match="liger_kernel.ops.swiglu not importable"):
        ops.IMPLS["liger"](case)


def test_packed_swiglus_impls_of_ours_call_silu_and_mul_with_x_and_the_impl(monkeypatch):
    """pipegoose and torch: ``silu_and_mul(x, impl=...)`` (op swiglu.packed), the dispatcher's choice verified after the
    checked call; on the CPU the kernel is declined (``unsupported``), never timed under its name."""
    from pipegoose.nn.fusion import functional as PF

    seen = []
    real = PF.silu_and_mul

    def spy(x, *, impl=None):
        seen.append((x, impl))
        return real(x, impl=impl)

    monkeypatch.setattr(PF, "silu_and_mul", spy)
    monkeypatch.setenv("PIPEGOOSE_STRICT", "1")
    case = ops.make_case("swiglu.packed", torch.float32, 16, "cpu")
    case.ref = ops.reference(case)
    tol = tolerances()[torch.float32]
    for impl in ("torch", "pipegoose"):
        fn = ops.IMPLS[impl](case)
        assert fn.expect == ("swiglu.packed", impl)
        if impl == "torch":
            assert ops.check_impl(fn, case, tol)[0] == "ok"
        else:
            with pytest.raises(Exception) as e:
                ops.check_impl(fn, case, tol)
            assert ops.classify(e.value) == "unsupported" and "swiglu.packed" in str(e.value)
    assert [(x is case.inputs["x"], impl) for x, impl in seen] == [(True, "torch"), (True, "pipegoose")]


def test_geglu_case_is_swiglus_at_swiglus_sizes_and_rows():
    """geglu runs where swiglu runs (the same sizes, rows and dtypes: side by side in one run), on two [rows, inter]
    tensors gate and up; the impls are swiglu's (no native op, no Megatron or Apex copy)."""
    for mode in ("full", "quick", "dry"):
        assert ops.sizes_for("geglu", mode) == ops.sizes_for("swiglu", mode)
        for dev in ("cuda", "cpu"):
            assert all(ops.shape_for("geglu", c, dev) == ops.shape_for("swiglu", c, dev)
                       for c in ops.sizes_for("swiglu", mode))
    assert ops.shape_for("geglu", 5632, "cuda") == {"rows": 16384, "inter": 5632}
    assert ops.impls_for("geglu") == ["eager", "compile", "liger", "torch", "pipegoose"]
    case = ops.make_case("geglu", torch.bfloat16, 64, "cpu")
    rows = case.shape["rows"]
    g, u = case.inputs["g"], case.inputs["u"]
    assert set(case.inputs) == {"g", "u"} and case.wrt == ["g", "u"] and case.outs == ("y",) and case.cols == 64
    for t in (g, u):
        assert t.shape == (rows, 64) and t.is_contiguous() and t.is_leaf and t.requires_grad
        assert t.dtype == torch.bfloat16
    assert case.dy.shape == (rows, 64) and case.dy.dtype == torch.bfloat16
    assert g.abs().max() > 1.5 * u.abs().max()   # (the gate scaled by 2, as swiglu's)
    assert (g < -1).any() and (g > 3).any()      # (GELU's dip and its linear part are both hit)
    with pytest.raises(ValueError, match="op: expected one of .*geglu"):
        ops.make_case("gelu_new", torch.float32, 16, "cpu")


@pytest.mark.parametrize("chunk", [1 << 25, 640])
def test_geglu_reference_is_float64_autograd_of_gelu_tanh_times_up(chunk):
    """The written-out float64 formula (in chunks of rows, too) against autograd of ``F.gelu(g, approximate="tanh") *
    u`` in float64: the same values and gradients to rounding."""
    case = ops.make_case("geglu", torch.bfloat16, 16, "cpu")
    ref = ops.reference(case, chunk_elems=chunk)
    assert set(ref) == {"y", "dg", "du"} and all(t.dtype == torch.float32 for t in ref.values())
    g = case.inputs["g"].detach().double().requires_grad_()
    u = case.inputs["u"].detach().double().requires_grad_()
    y = F.gelu(g, approximate="tanh") * u
    dg, du = torch.autograd.grad(y, (g, u), case.dy.double())
    for name, want in (("y", y), ("dg", dg), ("du", du)):
        torch.testing.assert_close(ref[name], want.float(), atol=1e-6, rtol=1e-6)


def test_geglus_eager_impl_is_gemmas_activation_times_up():
    """eager: GemmaMLP's ``act_fn(gate) * up`` with ``ACT2FN["gelu_pytorch_tanh"]``: to the bit ``F.gelu(gate,
    approximate="tanh") * up``, and its gradients."""
    case = ops.make_case("geglu", torch.bfloat16, 64, "cpu")
    g, u = case.inputs["g"], case.inputs["u"]
    y = ops.IMPLS["eager"](case)(case.inputs)
    grads = torch.autograd.grad(y, (g, u), case.dy)
    y2 = F.gelu(g, approximate="tanh") * u
    grads2 = torch.autograd.grad(y2, (g, u), case.dy)
    assert y.dtype == torch.bfloat16 and torch.equal(y, y2)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads2))
    assert not torch.equal(y, F.gelu(g) * u)   # (the exact GELU differs: the approximation is what is run)


def test_geglu_impl_of_the_exact_gelu_or_of_silu_is_failed():
    """The gate tells GELU's tanh approximation (Gemma's) from the exact, erf GELU, and from SiLU (SwiGLU's)."""
    case = ops.make_case("geglu", torch.float32, 16, "cpu")
    case.ref = ops.reference(case)
    tol = tolerances()[torch.float32]
    assert ops.check_impl(ops.IMPLS["eager"](case), case, tol)[0] == "ok"
    for wrong in (lambda i: F.gelu(i["g"]) * i["u"], lambda i: F.silu(i["g"]) * i["u"]):
        status, _, detail = ops.check_impl(wrong, case, tol)
        assert status == "FAILED" and all(f"{n}:" in detail for n in ("y", "dg", "du"))


class _LigerGELUMul(torch.autograd.Function):
    """Liger-Kernel's LigerGELUMulFunction (0.8.5) in PyTorch, for the CPU (its kernels are Triton): the forward
    rounds gelu_tanh(gate) to the dtype before the product, and the backward writes dgate and dup into the saved gate
    and up (the inputs) and returns those. Records the tensors it is given."""

    given: list = []

    @staticmethod
    def forward(ctx, a, b):
        _LigerGELUMul.given.append((a.data_ptr(), b.data_ptr()))
        ctx.save_for_backward(a, b)
        return F.gelu(a.float(), approximate="tanh").to(b.dtype) * b

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        with torch.enable_grad():
            a32 = a.detach().float().requires_grad_()
            act = F.gelu(a32, approximate="tanh")
            (dact,) = torch.autograd.grad(act, a32, torch.ones_like(act))
        db = dc.float() * act.detach()
        da = dc.float() * b.float() * dact
        a.copy_(da)
        b.copy_(db)
        return a, b


def test_geglus_liger_impl_is_liger_gelu_mul_of_gate_and_up(monkeypatch):
    """liger: LigerGELUMulFunction of the case's gate and up themselves, checked and timed like the others; it writes
    into them in its backward, so they are put back before the next impl (torch's row would FAIL otherwise)."""
    _fake_liger(monkeypatch, _LigerSiLUMul)
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.geglu", types.ModuleType("liger_kernel.ops.geglu"))
    sys.modules["liger_kernel.ops.geglu"].LigerGELUMulFunction = _LigerGELUMul
    monkeypatch.setattr(_LigerGELUMul, "given", [])
    case = ops.make_case("geglu", torch.float32, 16, "cpu")
    fn = ops.IMPLS["liger"](case)
    assert fn.clobbers_inputs
    fn(case.inputs)
    assert _LigerGELUMul.given == [(case.inputs["g"].data_ptr(), case.inputs["u"].data_ptr())]
    # the row after liger's (torch's, here the eager code) sees gate and up put back: corrupted, it would FAIL
    monkeypatch.setitem(ops.IMPLS, "torch", ops.IMPLS["eager"])
    res = ops.run_ops(["geglu"], [torch.float32, torch.bfloat16], "dry", "cpu", Timer("cpu", warmup=0, reps=2),
                      tolerances(), ["liger", "torch"], deadline=1e18, log=lambda s: None)
    assert res and {(m.impl, m.status) for m in res} == {("liger", "ok"), ("torch", "ok")}
    assert {(m.dtype, m.cols) for m in res} == {(d, c) for d in ("float32", "bfloat16") for c in (16, 64)}
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.geglu", None)   # (an install without it)
    with pytest.raises(ops.Unavailable, match="liger_kernel.ops.geglu not importable"):
        ops.IMPLS["liger"](case)


def test_geglus_impls_of_ours_call_functional_geglu_with_gate_up_tanh_and_the_impl(monkeypatch):
    """pipegoose and torch: ``geglu(gate, up, approximate="tanh", impl=...)`` (op geglu; the dispatcher's choice is
    verified after the checked call, fn.expect); a functional without ``geglu`` (a checkout before the op) makes them
    ``unavailable``, never an error."""
    from pipegoose.nn.fusion import functional as PF

    seen = []

    def spy(gate, up, approximate="tanh", *, impl=None):
        seen.append((gate, up, approximate, impl))
        return F.gelu(gate, approximate=approximate) * up

    monkeypatch.setattr(PF, "geglu", spy, raising=False)
    monkeypatch.setenv("PIPEGOOSE_STRICT", "1")   # (the builders set it by default: put back after the test)
    case = ops.make_case("geglu", torch.float32, 16, "cpu")
    for impl in ("torch", "pipegoose"):
        fn = ops.IMPLS[impl](case)
        assert fn.expect == ("geglu", impl)
        assert torch.equal(fn(case.inputs), F.gelu(case.inputs["g"], approximate="tanh") * case.inputs["u"])
    assert [(g is case.inputs["g"], u is case.inputs["u"], a, i) for g, u, a, i in seen] == [
        (True, True, "tanh", "torch"), (True, True, "tanh", "pipegoose")]
    monkeypatch.delattr(PF, "geglu")
    for impl in ("torch", "pipegoose"):
        with pytest.raises(ops.Unavailable, match="functional has no geglu") as e:
            ops.IMPLS[impl](case)
        assert ops.classify(e.value) == "unavailable"


def test_geglus_torch_impl_is_ok_and_our_kernel_declined_on_the_cpu(monkeypatch):
    """With the GeGLU op merged: the dispatcher's torch path passes the gate and runs as asked; our kernel is declined
    on the CPU (``unsupported``), never timed under its name."""
    from pipegoose.nn.fusion import functional as PF

    if not hasattr(PF, "geglu"):
        pytest.skip("pipegoose.nn.fusion.functional has no geglu yet (the GeGLU op is not merged)")
    monkeypatch.setenv("PIPEGOOSE_STRICT", "1")
    case = ops.make_case("geglu", torch.float32, 16, "cpu")
    case.ref = ops.reference(case)
    tol = tolerances()[torch.float32]
    assert ops.check_impl(ops.IMPLS["torch"](case), case, tol)[0] == "ok"
    with pytest.raises(Exception) as e:
        ops.check_impl(ops.IMPLS["pipegoose"](case), case, tol)
    assert ops.classify(e.value) == "unsupported" and "geglu" in str(e.value)


def test_rope_impl_with_one_output_or_wrong_rotation_is_failed():
    case = ops.make_case("rope", torch.float32, 16, "cpu")
    case.ref = ops.reference(case)
    tol = tolerances()[torch.float32]
    eager = ops.IMPLS["eager"](case)
    assert ops.check_impl(eager, case, tol)[0] == "ok"
    status, _, detail = ops.check_impl(lambda i: eager(i)[0], case, tol)
    assert status == "FAILED" and "expected 2 Tensors" in detail
    # the other direction of rotation (sin negated): right shapes and dtypes, wrong values and gradients
    status, _, detail = ops.check_impl(lambda i: eager({**i, "sin": -i["sin"]}), case, tol)
    assert status == "FAILED" and all(f"{n}:" in detail for n in ("yq", "yk", "dq", "dk"))


class _Clobbering(torch.autograd.Function):
    """RoPE right on the first call, then writing into its inputs (forward) or its incoming gradients (backward), as
    Liger-Kernel's rope does in Llama's layout."""

    where = "inputs"

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        yq, yk = rope_reference(q, k, cos, sin)
        if _Clobbering.where == "inputs":
            q.add_(1.0)
            k.add_(1.0)
        return yq, yk

    @staticmethod
    def backward(ctx, gq, gk):
        cos, sin = ctx.saved_tensors
        with torch.enable_grad():   # the transposed rotation: the vector-Jacobian product of the formula
            q0 = torch.zeros_like(gq, requires_grad=True)
            k0 = torch.zeros_like(gk, requires_grad=True)
            dq, dk = torch.autograd.grad(rope_reference(q0, k0, cos, sin), (q0, k0), (gq, gk))
        if _Clobbering.where == "dy":
            gq.add_(1.0)
            gk.add_(1.0)
        return dq, dk, None, None


@pytest.mark.parametrize("where", ["inputs", "dy"])
@pytest.mark.parametrize("declared", [True, False])
def test_an_impl_that_writes_into_its_inputs_or_gradients_is_undone_for_the_next(monkeypatch, where, declared):
    """An impl marked clobbers_inputs (Liger's in-place kernels) has the case's inputs and upstream gradients put back
    before the next impl runs; undeclared, the next (honest) impl is checked against corrupted inputs and FAILs."""
    monkeypatch.setattr(_Clobbering, "where", where)

    def clobbering(case):
        fn = lambda i: _Clobbering.apply(i["q"], i["k"], i["cos"], i["sin"])  # noqa: E731
        fn.clobbers_inputs = declared
        return fn

    monkeypatch.setitem(ops.IMPLS, "eager", clobbering)
    monkeypatch.setitem(ops.IMPLS, "torch", lambda case: ops._rope_reference_fn())
    res = ops.run_ops(["rope"], [torch.float32], "dry", "cpu", Timer("cpu", warmup=0, reps=2), tolerances(),
                      ["eager", "torch"], deadline=1e18, log=lambda s: None, sizes=[16])
    first = {m.status for m in res if m.impl == "eager"}
    after = {m.status for m in res if m.impl == "torch"}
    assert first == {"ok"}
    assert after == ({"ok"} if declared else {"FAILED"})


def test_rope_runs_through_run_ops_on_the_cpu():
    res = ops.run_ops(["rope"], [torch.float32, torch.bfloat16], "dry", "cpu", Timer("cpu", warmup=0, reps=2),
                      tolerances(), ["eager", "native", "megatron"], deadline=1e18, log=lambda s: None)
    assert res and {m.impl for m in res} == {"eager"}          # no native, megatron or apex row for rope
    assert all(m.status == "ok" and m.gbps > 0 and m.bytes > 0 for m in res)
    assert {(m.dtype, m.cols) for m in res} == {(d, c) for d in ("float32", "bfloat16") for c in (16, 64)}
    assert {tuple(m.shape) for m in res} == {("b", "seq", "hq", "hk", "d")}


def test_wrong_impl_is_failed_not_timed(monkeypatch):
    def wrong(case):   # RMSNorm without the weight: right shape and dtype, wrong values
        return lambda i: i["x"] * torch.rsqrt(i["x"].pow(2).mean(-1, keepdim=True) + ops.RMS_EPS)

    monkeypatch.setitem(ops.IMPLS, "eager", wrong)
    res = ops.run_ops(["rms_norm"], [torch.float32], "dry", "cpu", Timer("cpu", warmup=0, reps=2), tolerances(),
                      ["eager", "native"], deadline=1e18, log=lambda s: None)
    eager = [m for m in res if m.impl == "eager"]
    native = [m for m in res if m.impl == "native"]
    assert eager and all(m.status == "FAILED" and m.median_ms is None for m in eager)
    assert "dw: no gradient" in eager[0].detail and "y:" in eager[0].detail
    assert native and all(m.status == "ok" and m.median_ms > 0 and m.gbps > 0 for m in native)
    assert {m.pas for m in native} == {"fwd", "bwd", "fwd+bwd"}


def test_time_budget_skips_instead_of_running():
    res = ops.run_ops(["layer_norm"], [torch.float32], "dry", "cpu", Timer("cpu", warmup=0, reps=2), tolerances(),
                      ["native"], deadline=0.0, log=lambda s: None)
    assert res and all(m.status == "skipped" for m in res)


def test_sizes_keeps_only_the_sizes_asked_for():
    kw = dict(deadline=1e18, log=lambda s: None)
    timer = Timer("cpu", warmup=0, reps=2)
    res = ops.run_ops(["rms_norm"], [torch.float32], "dry", "cpu", timer, tolerances(), ["native"], sizes=[128], **kw)
    assert res and {m.cols for m in res} == {128}
    every = ops.run_ops(["rms_norm"], [torch.float32], "dry", "cpu", timer, tolerances(), ["native"], **kw)
    assert {m.cols for m in every} == set(ops.SIZES["norm"]["dry"])


def test_gelu_case_and_reference_are_gelu_new_at_swiglus_sizes_and_rows():
    """gelu (GELU alone, GPT-2's gelu_new): x as swiglu's gate, swiglu's sizes; the float64 reference is F.gelu's
    tanh approximation and its derivative; eager is transformers' NewGELUActivation, native F.gelu."""
    from benchmarks import ops

    assert ops.sizes_for("gelu", "full") == ops.sizes_for("swiglu", "full")
    case = ops.make_case("gelu", torch.float32, 16, "cpu")
    x = case.inputs["x"]
    assert list(case.inputs) == ["x"] and case.wrt == ["x"] and x.shape == case.dy.shape
    assert x.shape == (ops.shape_for("swiglu", 16, "cpu")["rows"], 16)
    ref = ops.reference(case)
    x64 = x.detach().double().requires_grad_()
    y64 = torch.nn.functional.gelu(x64, approximate="tanh")
    (dx64,) = torch.autograd.grad(y64, x64, case.dy.double())
    torch.testing.assert_close(ref["y"].double(), y64.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ref["dx"].double(), dx64, rtol=1e-6, atol=1e-7)
    for impl in ("eager", "native"):
        fn = ops.IMPLS[impl](case)
        torch.testing.assert_close(fn(case.inputs).double(), y64.detach(), rtol=1e-5, atol=1e-6)



@pytest.mark.parametrize("chunk", [1 << 25, 48])
def test_squared_relu_case_and_reference_are_relu2_at_gelus_sizes_rows_and_x(chunk):
    """squared_relu (transformers' relu2, Nemotron's MLP activation): gelu's x, sizes and rows; the float64 reference
    (in chunks of rows, too) is autograd of torch.square(F.relu(x)): 0, and a gradient of 0, where x <= 0; eager is
    transformers' ReLUSquaredActivation."""
    assert ops.sizes_for("squared_relu", "full") == ops.sizes_for("gelu", "full") == ops.sizes_for("swiglu", "full")
    assert ops.shape_for("squared_relu", 64, "cpu") == ops.shape_for("gelu", 64, "cpu")
    case = ops.make_case("squared_relu", torch.float32, 16, "cpu")
    x = case.inputs["x"]
    assert list(case.inputs) == ["x"] and case.wrt == ["x"] and case.outs == ("y",) and x.shape == case.dy.shape
    assert x.shape == (ops.shape_for("swiglu", 16, "cpu")["rows"], 16) and x.is_leaf and x.requires_grad
    assert torch.equal(x, ops.make_case("gelu", torch.float32, 16, "cpu").inputs["x"])   # (gelu's x)
    assert (x < -1).any() and (x > 2).any()   # (the kink at 0 and the parabola both hit)
    ref = ops.reference(case, chunk_elems=chunk)
    assert set(ref) == {"y", "dx"} and ref["y"].dtype == ref["dx"].dtype == torch.float32
    x64 = x.detach().double().requires_grad_()
    y64 = torch.square(F.relu(x64))
    (dx64,) = torch.autograd.grad(y64, x64, case.dy.double())
    torch.testing.assert_close(ref["y"].double(), y64.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ref["dx"].double(), dx64, rtol=1e-6, atol=1e-7)
    neg = x.detach() <= 0
    assert neg.any() and not ref["y"][neg].any() and not ref["dx"][neg].any()
    y = ops.IMPLS["eager"](case)(case.inputs)
    assert torch.equal(y, torch.square(F.relu(x)))
    (dx,) = torch.autograd.grad(y, x, case.dy)
    torch.testing.assert_close(dx, ref["dx"], rtol=1e-5, atol=1e-6)


def test_squared_relu_has_no_native_or_liger_impl_and_its_list_is_gelus_without_native(monkeypatch):
    """PyTorch has no single op for relu(x)^2 (eager runs two), Liger-Kernel no squared ReLU, Apex and Megatron none:
    squared_relu's impls are gelu's but native, and native / liger say why if asked all the same."""
    assert ops.impls_for("squared_relu") == ["eager", "compile", "torch", "pipegoose"]
    assert ops.impls_for("gelu") == ["eager", "native", "compile", "torch", "pipegoose"]
    assert ops.IMPL_ORDER.index("native") < ops.IMPL_ORDER.index("compile")   # (so the lists above are in order)
    case = ops.make_case("squared_relu", torch.float32, 16, "cpu")
    with pytest.raises(ops.Unsupported, match=r"no single op for relu\(x\)\^2: eager runs relu then square") as e:
        ops.IMPLS["native"](case)
    assert ops.classify(e.value) == "unsupported"
    _fake_liger(monkeypatch, _LigerSiLUMul)   # (liger_kernel importable, so the op itself is what is refused)
    with pytest.raises(ops.Unsupported, match="Liger-Kernel has no squared ReLU"):
        ops.IMPLS["liger"](case)


def test_squared_relu_impl_of_relu_alone_or_of_an_unclipped_square_is_failed():
    """The gate tells relu(x)^2 from relu(x) (the square forgotten) and from x^2 (negative side squared too)."""
    case = ops.make_case("squared_relu", torch.float32, 16, "cpu")
    case.ref = ops.reference(case)
    tol = tolerances()[torch.float32]
    assert ops.check_impl(ops.IMPLS["eager"](case), case, tol)[0] == "ok"
    for wrong in (lambda i: F.relu(i["x"]), lambda i: torch.square(i["x"])):
        status, _, detail = ops.check_impl(wrong, case, tol)
        assert status == "FAILED" and all(f"{n}:" in detail for n in ("y", "dx"))


def test_squared_relus_impls_of_ours_call_functional_squared_relu_with_x_and_the_impl(monkeypatch):
    """pipegoose and torch: ``squared_relu(x, impl=...)`` (op squared_relu; the dispatcher's choice is verified after
    the checked call, fn.expect); a functional without ``squared_relu`` (a checkout before the op) makes them
    ``unavailable``, never an error."""
    from pipegoose.nn.fusion import functional as PF

    seen = []

    def spy(x, *, impl=None):
        seen.append((x, impl))
        return torch.square(F.relu(x))

    monkeypatch.setattr(PF, "squared_relu", spy, raising=False)
    monkeypatch.setenv("PIPEGOOSE_STRICT", "1")   # (the builders set it by default: put back after the test)
    case = ops.make_case("squared_relu", torch.float32, 16, "cpu")
    for impl in ("torch", "pipegoose"):
        fn = ops.IMPLS[impl](case)
        assert fn.expect == ("squared_relu", impl)
        assert torch.equal(fn(case.inputs), torch.square(F.relu(case.inputs["x"])))
    assert [(x is case.inputs["x"], i) for x, i in seen] == [(True, "torch"), (True, "pipegoose")]
    monkeypatch.delattr(PF, "squared_relu")
    for impl in ("torch", "pipegoose"):
        with pytest.raises(ops.Unavailable, match="functional has no squared_relu") as e:
            ops.IMPLS[impl](case)
        assert ops.classify(e.value) == "unavailable"


def test_squared_relus_torch_impl_is_ok_and_our_kernel_declined_on_the_cpu(monkeypatch):
    """The dispatcher's torch path passes the gate and runs as asked; our kernel is declined on the CPU
    (``unsupported``), never timed under its name."""
    from pipegoose.nn.fusion import functional as PF

    if not hasattr(PF, "squared_relu"):
        pytest.skip("pipegoose.nn.fusion.functional has no squared_relu yet (the op is not merged)")
    monkeypatch.setenv("PIPEGOOSE_STRICT", "1")
    case = ops.make_case("squared_relu", torch.float32, 16, "cpu")
    case.ref = ops.reference(case)
    tol = tolerances()[torch.float32]
    assert ops.check_impl(ops.IMPLS["torch"](case), case, tol)[0] == "ok"
    with pytest.raises(Exception) as e:
        ops.check_impl(ops.IMPLS["pipegoose"](case), case, tol)
    assert ops.classify(e.value) == "unsupported" and "squared_relu" in str(e.value)
