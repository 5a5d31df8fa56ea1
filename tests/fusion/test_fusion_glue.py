"""CPU: the fused paths' Python glue (argument order, reshapes, dtype handling, the guards around the ported
copies' quirks) against CPU emulations of the kernels' documented semantics (docs/architecture.md "Op schemas").

The emulations are written here from the schemas, including the registry copies' quirks (Megatron gives a fully
masked row 1/sk, Apex writes its output in gamma's dtype and rejects other gamma dtypes), so that the guards in
pipegoose.nn.fusion are exercised without a GPU. The real kernels are tested in test_fusion_cuda.py.
"""

from __future__ import annotations

import dataclasses
import math
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from tolerances import TOLERANCES

from pipegoose.nn.fusion import FusedAdam, clip_grad_norm_, dispatch
from pipegoose.nn.fusion import functional as PF
from pipegoose.nn.fusion.ops._common import grads_through
from pipegoose.nn.fusion.ops.layer_norm import layer_norm_reference
from pipegoose.nn.fusion.ops.rms_norm import rms_norm_reference

CUDA = torch.device("cuda")


def _softmax_rows(s, masked):
    s = s.masked_fill(masked, float("-inf")) if masked is not None else s
    y = torch.softmax(s, -1)
    return torch.nan_to_num(y, nan=0.0) if masked is not None else y


class FakeOps:
    """Emulations of torch.ops.pipegoose.* on CPU tensors."""

    calls: list

    def __init__(self):
        self.calls = []

    # pipegoose/softmax
    def softmax_forward(self, x, mask, scale, causal):
        self.calls.append("softmax_forward")
        assert x.is_contiguous() and isinstance(scale, float) and isinstance(causal, bool)
        masked = None if mask is None else mask
        if causal:
            sq, sk = x.shape[-2:]
            cm = torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1)
            masked = cm if masked is None else masked | cm
        return _softmax_rows(x.float() * scale, masked).to(x.dtype)

    @torch.no_grad()  # like the real ops, which have no autograd formula: no gradient flows through the result
    def softmax_backward(self, dy, y, scale, causal=False):
        self.calls.append("softmax_backward")
        assert dy.dtype == y.dtype and dy.shape == y.shape
        yf, dyf = y.float(), dy.float()
        return (scale * yf * (dyf - (dyf * yf).sum(-1, keepdim=True))).to(y.dtype)

    # megatron copies (quirks included: -10000 fill, fully masked row -> 1/sk, scale rounded to the dtype)
    def scaled_masked_softmax_forward(self, x, mask, scale):
        self.calls.append("scaled_masked_softmax_forward")
        b, np_, sq, sk = x.shape
        assert x.dtype in (torch.float16, torch.bfloat16) and x.is_contiguous() and sk <= 2048 and sq > 1
        assert mask.dtype == torch.bool and mask.shape[1] == 1 and mask.shape[2] == sq and mask.shape[0] in (1, b)
        sc = float(torch.tensor(scale, dtype=x.dtype))
        s = (x.float() * sc).masked_fill(mask, -10000.0)
        return torch.softmax(s, -1).to(x.dtype)

    def scaled_masked_softmax_backward(self, dy, y, scale):
        self.calls.append("scaled_masked_softmax_backward")
        return self.softmax_backward(dy, y, scale)

    def scaled_masked_softmax_get_batch_per_block(self, sq, sk, b, np_):
        raise AssertionError("not expected")

    def scaled_upper_triang_masked_softmax_forward(self, x, scale):
        self.calls.append("scaled_upper_triang_masked_softmax_forward")
        assert x.dim() == 3 and x.shape[1] == x.shape[2] and x.dtype in (torch.float16, torch.bfloat16)
        sc = float(torch.tensor(scale, dtype=x.dtype))
        cm = torch.ones(x.shape[1], x.shape[2], dtype=torch.bool).triu(1)
        return _softmax_rows(x.float() * sc, cm).to(x.dtype)

    def scaled_upper_triang_masked_softmax_backward(self, dy, y, scale):
        self.calls.append("scaled_upper_triang_masked_softmax_backward")
        return self.softmax_backward(dy, y, scale)

    # pipegoose/layer_norm, pipegoose/rms_norm
    def layer_norm_forward(self, x, w, b, eps, out_dtype):
        self.calls.append("layer_norm_forward")  # the op's contract: input [..., H], parameters of H elements
        h = x.shape[-1]
        assert x.dim() >= 1 and all(p is None or p.numel() == h for p in (w, b))
        xf = x.float().reshape(-1, h)
        mean = xf.mean(-1)
        rstd = torch.rsqrt(xf.var(-1, unbiased=False) + eps)
        y = (xf - mean[:, None]) * rstd[:, None]
        if w is not None:
            y = y * w.float().reshape(h)
        if b is not None:
            y = y + b.float().reshape(h)
        return y.to(out_dtype or x.dtype).view(x.shape), mean, rstd

    def layer_norm_backward(self, dy, x, w, b, mean, rstd):
        self.calls.append("layer_norm_backward")
        assert dy.shape == x.shape
        with torch.enable_grad():
            xf = x.float().requires_grad_(True)
            wf = None if w is None else w.float().requires_grad_(True)
            bf = None if b is None else b.float().requires_grad_(True)
            y = F.layer_norm(xf, (x.shape[-1],), wf, bf, 1e-5)
            ins = [t for t in (xf, wf, bf) if t is not None]
            gs = list(torch.autograd.grad(y, ins, dy.float()))
        gx = gs.pop(0).to(x.dtype)
        gw = gs.pop(0).to(w.dtype) if w is not None else torch.empty(0)
        gb = gs.pop(0).to(b.dtype) if b is not None else torch.empty(0)
        return gx, gw, gb

    def rms_norm_forward(self, x, w, eps, out_dtype):
        self.calls.append("rms_norm_forward")  # the op's contract: input [..., H], a weight of H elements
        h = x.shape[-1]
        assert x.dim() >= 1 and (w is None or w.numel() == h)
        xf = x.float().reshape(-1, h)
        rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
        y = xf * rstd[:, None]
        if w is not None:
            y = y * w.float().reshape(h)
        return y.to(out_dtype or x.dtype).view(x.shape), rstd

    def rms_norm_backward(self, dy, x, w, rstd):
        self.calls.append("rms_norm_backward")
        with torch.enable_grad():
            xf = x.float().requires_grad_(True)
            wf = None if w is None else w.float().requires_grad_(True)
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
            if wf is not None:
                y = y * wf
            ins = [t for t in (xf, wf) if t is not None]
            gs = torch.autograd.grad(y, ins, dy.float())
        return gs[0].to(x.dtype), (gs[1].to(w.dtype) if w is not None else torch.empty(0))

    # pipegoose::layer_norm, pipegoose::rms_norm: the forward op with its autograd formula (a C++ Function in the
    # real bindings, emulated by _EmulatedNormFunction)
    @property
    def layer_norm(self):
        return types.SimpleNamespace(
            default=lambda x, w, b, eps, out: _EmulatedNormFunction.apply(self, "layer_norm", x, w, b, eps, out))

    @property
    def rms_norm(self):
        return types.SimpleNamespace(
            default=lambda x, w, eps, out: _EmulatedNormFunction.apply(self, "rms_norm", x, w, None, eps, out))

    # apex/fused_layer_norm: output in gamma's dtype; fp16/bf16 input only with gamma of that dtype
    def fused_layer_norm_affine_forward(self, x, shape, g, b, eps):
        self.calls.append("fused_layer_norm_affine_forward")
        assert g.dtype == b.dtype and list(g.shape) == list(shape)
        if x.dtype != torch.float32 and g.dtype != x.dtype:
            raise RuntimeError(f"expected scalar type {x.dtype} but found {g.dtype}")
        h = g.numel()
        y, mean, rstd = self.layer_norm_forward(x.reshape(-1, h), g.reshape(h), b.reshape(h), eps, g.dtype)
        return y.view(x.shape), mean, rstd

    def fused_layer_norm_affine_backward(self, dy, mean, invvar, x, shape, g, b, eps):
        self.calls.append("fused_layer_norm_affine_backward")
        assert dy.dtype == g.dtype
        h = g.numel()
        gx, gg, gb = self.layer_norm_backward(dy.reshape(-1, h), x.reshape(-1, h), g.reshape(h), b.reshape(h),
                                              mean, invvar)
        return gx.view(x.shape), gg.view(g.shape), gb.view(b.shape)

    # multi-tensor
    def _adam(self, grads, params, ms, vs, lr, b1, b2, eps, step, mode, bc, wd):
        for lst in (grads, params, ms, vs):
            assert len({t.dtype for t in lst}) == 1 and all(t.is_contiguous() for t in lst)
        c1, c2 = (1 - b1 ** step, 1 - b2 ** step) if bc else (1.0, 1.0)
        for g, p, m, v in zip(grads, params, ms, vs):
            gf, pf, mf, vf = g.float(), p.float(), m.float(), v.float()
            if mode == 0:
                gf = gf + wd * pf
            mf = b1 * mf + (1 - b1) * gf
            vf = b2 * vf + (1 - b2) * gf * gf
            upd = (mf / c1) / ((vf / c2).sqrt() + eps)
            if mode == 1:
                upd = upd + wd * pf
            p.copy_(pf - lr * upd)
            m.copy_(mf)
            v.copy_(vf)

    def multi_tensor_adam(self, chunk, noop, grads, params, ms, vs, lr, b1, b2, eps, step, mode, bc, wd, div):
        self.calls.append("multi_tensor_adam")
        assert div == -1.0
        self._adam(grads, params, ms, vs, lr, b1, b2, eps, step, mode, bc, wd)

    def deepspeed_multi_tensor_adam(self, chunk, noop, grads, params, ms, vs, lr, b1, b2, eps, step, mode, bc, wd):
        self.calls.append("deepspeed_multi_tensor_adam")
        assert len({grads[0].dtype, params[0].dtype, ms[0].dtype, vs[0].dtype}) == 1
        self._adam(grads, params, ms, vs, lr, b1, b2, eps, step, mode, bc, wd)

    def adam_step(self, grads, params, ms, vs, lr, b1, b2, eps, step, adam_w_mode, bias_correction, wd):
        # the schema of pipegoose::adam_step (bindings/adam_step.cpp): no chunk size or noop flag, bool switches
        self.calls.append("adam_step")
        assert isinstance(adam_w_mode, bool) and isinstance(bias_correction, bool) and isinstance(step, int)
        assert len({t.dtype for lst in (grads, params, ms, vs) for t in lst}) == 1
        self._adam(grads, params, ms, vs, lr, b1, b2, eps, step, 1 if adam_w_mode else 0, int(bias_correction), wd)

    def multi_tensor_l2norm(self, chunk, noop, tensors, per_tensor):
        self.calls.append("multi_tensor_l2norm")
        assert tensors[0].dtype in (torch.float32, torch.float16)
        return torch.sqrt(sum((t.float() ** 2).sum() for t in tensors)).reshape(1), torch.empty(0)

    def multi_tensor_scale(self, chunk, noop, src, dst, scale):
        self.calls.append("multi_tensor_scale")
        for s, d in zip(src, dst):
            d.copy_(s.float() * scale)

    def multi_tensor_norm(self, tensors, norm_type):
        # pipegoose::multi_tensor_norm (bindings/clip_grad_norm.cpp): one dtype, contiguous, distinct tensors; the
        # total norm as a float32 scalar, accumulated in fp32
        self.calls.append("multi_tensor_norm")
        self._clip_lists("multi_tensor_norm", tensors)
        assert isinstance(norm_type, float) and norm_type in (1.0, 2.0, math.inf)
        return torch.linalg.vector_norm(torch.cat([t.float().reshape(-1) for t in tensors]), norm_type)

    @staticmethod
    def _clip_lists(op, tensors):
        # check_tensors of clip_grad_norm.cu: one dtype, contiguous, and no two non-empty tensors sharing memory
        assert tensors and len({t.dtype for t in tensors}) == 1 and all(t.is_contiguous() for t in tensors)
        spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors if t.numel())
        for (_, end), (begin, _) in zip(spans, spans[1:]):
            if begin < end:
                raise RuntimeError(f"pipegoose::{op}: tensors overlap in memory")

    def multi_tensor_mul_(self, tensors, coef):
        # pipegoose::multi_tensor_mul_: the coefficient is a float32 tensor read on the device (no host sync)
        self.calls.append("multi_tensor_mul_")
        assert isinstance(coef, torch.Tensor) and coef.dtype == torch.float32 and coef.numel() == 1
        self._clip_lists("multi_tensor_mul_", tensors)
        for t in tensors:
            t.copy_(t.float() * coef)


class _EmulatedNormFunction(torch.autograd.Function):
    """What the C++ Function of pipegoose::layer_norm / rms_norm does (pipegoose/kernels/bindings/norm_autograd.h):
    the forward op, saving the inputs and statistics; in backward the backward op, or with grad mode on
    (create_graph=True) the gradients of the PyTorch formula on the saved inputs."""

    @staticmethod
    def forward(ctx, ops, kind, x, w, b, eps, out):
        ops.calls.append(kind)
        if kind == "layer_norm":
            y, *stats = ops.layer_norm_forward(x, w, b, eps, out)
        else:
            y, *stats = ops.rms_norm_forward(x, w, eps, out)
        ctx.save_for_backward(x, w, b, *stats)
        ctx.meta = (ops, kind, eps, y.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, b, *stats = ctx.saved_tensors
        ops, kind, eps, out = ctx.meta
        shape = (x.shape[-1],)
        if torch.is_grad_enabled():
            if kind == "layer_norm":
                def ref(x_, w_, b_):
                    return layer_norm_reference(x_, shape, w_, b_, eps, out)
            else:
                def ref(x_, w_, b_):
                    return rms_norm_reference(x_, shape, w_, eps, out, False)
            gs = grads_through(ref, (x, w, b), ctx.needs_input_grad[2:5], dy)
        elif kind == "layer_norm":
            gx, gw, gb = ops.layer_norm_backward(dy, x, w, b, *stats)
            gs = [gx, None if w is None else gw, None if b is None else gb]
        else:
            gx, gw = ops.rms_norm_backward(dy, x, w, *stats)
            gs = [gx, None if w is None else gw, None]
        return (None, None, *gs, None, None)


@pytest.fixture
def fake(monkeypatch):
    """Real supports() checks, run as if the CPU tensors were on a GPU; kernels replaced by FakeOps."""
    ops = FakeOps()
    saved = {}
    for op in ("softmax", "softmax.masked", "softmax.causal", "layer_norm", "rms_norm", "adam", "clip_grad_norm"):
        for name, im in dispatch.implementations(op).items():
            saved[(op, name)] = im
            if im.kind == "reference":
                continue

            def on_gpu(p, _real=im.supports):
                return _real(dataclasses.replace(p, device=CUDA, extra=dict(p.extra, aligned=True)))

            dispatch.register(dataclasses.replace(im, supports=on_gpu))
    monkeypatch.setattr(dispatch, "_load_kernel", lambda name: ops)
    monkeypatch.setattr(dispatch, "_device_name", lambda device: None)
    monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "0")  # small inputs here stand for GPU-sized ones
    dispatch.clear_kernel_cache()
    dispatch.reset_stats()
    yield ops
    for im in saved.values():
        dispatch.register(im)
    dispatch.clear_kernel_cache()
    dispatch.reset_stats()


def ref64(x, mask, scale, causal=False):
    s = x.double() * scale
    masked = mask
    if causal:
        sq, sk = x.shape[-2:]
        cm = torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1)
        masked = cm if masked is None else masked | cm
    return _softmax_rows(s, masked)


@pytest.mark.parametrize("impl", ["pipegoose", "megatron"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_masked_softmax_glue_zeroes_fully_masked_rows(fake, impl, dtype):
    x = torch.randn(2, 3, 16, 64).to(dtype)
    mask = torch.rand(2, 1, 1, 64) < 0.3  # [b, 1, 1, sk]: the Megatron path must expand it
    mask[1] = True  # batch 1: every key masked
    xr = x.clone().requires_grad_(True)
    y = PF.scaled_masked_softmax(xr, mask, 0.125, impl=impl)
    y.backward(torch.randn_like(y))
    assert dispatch.stats()["softmax.masked"] == {impl: 1}
    assert torch.count_nonzero(y[1]) == 0 and torch.count_nonzero(xr.grad[1]) == 0  # Megatron's 1/sk undone
    torch.testing.assert_close(y.double(), ref64(x, mask, 0.125), **TOLERANCES[dtype])
    assert any(c.endswith("_backward") for c in fake.calls)


def test_megatron_rejections_route_to_pipegoose(fake):
    x = torch.randn(2, 3, 16, 64, dtype=torch.bfloat16)
    m = torch.zeros(2, 1, 16, 64, dtype=torch.bool)
    with pytest.warns(UserWarning, match="impl='megatron' cannot run this input: scale 0.1"):
        assert PF.scaled_masked_softmax(x, m, 0.1, impl="megatron") is not None  # 0.1 not exact in bf16
    assert dispatch.stats()["softmax.masked"] == {"pipegoose": 1}
    assert "representable" in dispatch.last_choice("softmax.masked").reasons["megatron"]
    x = torch.randn(2, 3, 7, 64, dtype=torch.bfloat16)  # sq=7: not a multiple of batches_per_block (8)
    with pytest.warns(UserWarning, match="sq=7 not a multiple of batches_per_block"):
        PF.scaled_masked_softmax(x, m[:, :, :7], 0.125, impl="megatron")
    assert "batches_per_block" in dispatch.last_choice("softmax.masked").reasons["megatron"]


@pytest.mark.parametrize("impl", ["pipegoose", "megatron"])
def test_causal_glue(fake, impl):
    x = torch.randn(16, 32, 32, dtype=torch.float16)
    xr = x.clone().requires_grad_(True)
    y = PF.scaled_upper_triang_masked_softmax(xr, 0.5, impl=impl)
    y.sum().backward()
    assert dispatch.stats()["softmax.causal"] == {impl: 1}
    torch.testing.assert_close(y.double(), ref64(x, None, 0.5, causal=True), **TOLERANCES[torch.float16])
    c = dispatch.explain("softmax.causal", torch.empty(4, 3000, 3000, dtype=torch.bfloat16), scale=1.0,
                         impl="megatron")
    assert c.impl == "pipegoose" and c.reasons["megatron"].startswith("key length 3000 outside")


def test_plain_softmax_glue(fake):
    x = torch.randn(5, 100)
    x[2] = float("-inf")
    y = PF.softmax(x, -1)
    assert dispatch.stats()["softmax"] == {"pipegoose": 1}
    ref = F.softmax(x, -1)
    assert torch.allclose(y, ref, equal_nan=True)
    assert PF.softmax(x, 0) is not None and dispatch.stats()["softmax"] == {"pipegoose": 1, "torch": 1}


@pytest.mark.parametrize("impl", ["pipegoose", "apex"])
@pytest.mark.parametrize("xdt,pdt", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                     (torch.float16, torch.float32)])
@pytest.mark.parametrize("affine", ["wb", "none"])
def test_layer_norm_glue(fake, impl, xdt, pdt, affine):
    x = torch.randn(3, 5, 4, 8).to(xdt)
    w = torch.randn(4, 8).to(pdt) if affine == "wb" else None
    b = torch.randn(4, 8).to(pdt) if affine == "wb" else None
    ts = [t.clone().requires_grad_(True) if t is not None else None for t in (x, w, b)]
    expect = impl if not (impl == "apex" and xdt != pdt and affine == "wb") else "pipegoose"  # apex#1379 guard
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = PF.layer_norm(ts[0], (4, 8), ts[1], ts[2], impl=impl)
    fell_back = [str(w.message) for w in caught if "cannot run this input" in str(w.message)]
    assert len(fell_back) == (expect != impl), fell_back  # the fallback says so, once; a direct run is silent
    y.float().sum().backward()
    assert dispatch.stats()["layer_norm"] == {expect: 1}
    assert y.dtype == xdt
    want = F.layer_norm(x.float(), (4, 8), None if w is None else w.float(), None if b is None else b.float())
    torch.testing.assert_close(y.float(), want, **TOLERANCES[xdt])
    if affine == "wb":
        assert ts[1].grad.dtype == pdt and ts[1].grad.shape == (4, 8)


@pytest.mark.parametrize("cast_before_weight", [False, True])
def test_rms_norm_glue(fake, cast_before_weight):
    x = torch.randn(3, 7, 16, dtype=torch.bfloat16)
    w = torch.randn(16)
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = PF.rms_norm(xr, 16, wr, 1e-6, cast_before_weight=cast_before_weight)
    y.float().sum().backward()
    assert dispatch.stats()["rms_norm"] == {"pipegoose": 1}
    with dispatch.strict(False):
        want = PF.rms_norm(x, 16, w, 1e-6, cast_before_weight=cast_before_weight, impl="torch")
    assert y.dtype == want.dtype
    torch.testing.assert_close(y.float(), want.float(), **TOLERANCES[torch.bfloat16])
    assert xr.grad is not None and wr.grad is not None and wr.grad.dtype == torch.float32
    assert fake.calls.count("rms_norm_forward") == 1  # one kernel, the weight applied inside it


@pytest.mark.parametrize("impl", ["pipegoose", "torch_fused", "apex", "deepspeed", None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_adam_glue_matches_adamw(fake, impl, dtype):
    """Each adam implementation's call from FusedAdam (torch_fused: torch's own fused kernel, which runs on the CPU
    too; None: the built-in order, ours first) against torch.optim.AdamW over 10 steps."""
    torch.manual_seed(0)
    m1 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dtype)
    m2 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dtype)
    m2.load_state_dict(m1.state_dict())
    o1 = FusedAdam(m1.parameters(), lr=1e-2, weight_decay=0.1, impl=impl)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(10):
        x = torch.randn(4, 8, dtype=dtype)
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad()
            m(x).float().pow(2).mean().backward()
            o.step()
    assert dispatch.stats()["adam"] == {impl or "pipegoose": 10}
    assert fake.calls.count("adam_step") == (10 if impl in ("pipegoose", None) else 0)
    t = TOLERANCES[dtype]
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, atol=t["atol"] * 10, rtol=t["rtol"] * 10)
        assert o1.state[a]["step"].item() == 10


def test_fused_adam_mixed_buckets(fake):
    a = torch.nn.Parameter(torch.randn(5))
    b = torch.nn.Parameter(torch.randn(5, dtype=torch.bfloat16))
    c = torch.nn.Parameter(torch.randn(5).t())  # fine: 1-D is contiguous
    opt = FusedAdam([a, b, c], lr=0.1, impl="deepspeed")
    a.grad, b.grad, c.grad = torch.randn(5), torch.randn(5, dtype=torch.bfloat16), torch.randn(5)
    opt.step()
    assert dispatch.stats()["adam"] == {"deepspeed": 2}  # one bucket per dtype
    b.grad_dtype = None  # allow an fp32 gradient on a bf16 parameter (master-grad setups)
    b.grad = torch.randn(5)  # fp32 grad for a bf16 param: deepspeed cannot, apex can
    with pytest.warns(UserWarning, match="impl='deepspeed' cannot run this input: grads, params and moments"):
        opt.step()
    assert dispatch.stats()["adam"] == {"deepspeed": 3, "apex": 1}
    assert "one dtype" in dispatch.last_choice("adam").reasons["deepspeed"]


# (dtype, impl= passed, the implementation that runs): without a request, ours
@pytest.mark.parametrize("dtype,request_,impl", [
    (torch.float32, "apex", "apex"), (torch.float16, "apex", "apex"), (torch.bfloat16, "torch", "torch"),
    (torch.bfloat16, None, "pipegoose"), (torch.float16, None, "pipegoose")])
@pytest.mark.parametrize("max_norm", [0.5, 1e4])
def test_clip_glue(fake, dtype, request_, impl, max_norm):
    def params():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in (3, 100, 17)]
        for i, p in enumerate(ps):
            p.grad = (torch.randn(p.shape) * (i + 1)).to(dtype)
        return ps

    p1, p2 = params(), params()
    n1 = clip_grad_norm_(p1, max_norm, impl=request_)
    n2 = torch.nn.utils.clip_grad_norm_(p2, max_norm)
    assert dispatch.stats()["clip_grad_norm"] == {impl: 1}
    assert n1.dtype == n2.dtype
    torch.testing.assert_close(n1, n2, **TOLERANCES[dtype])
    for a, b in zip(p1, p2):
        torch.testing.assert_close(a.grad, b.grad, **TOLERANCES[dtype])
    assert ("multi_tensor_scale" in fake.calls) == (impl == "apex" and max_norm < 1)


def _clip_params(dtypes, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    ps = []
    for i, dt in enumerate(dtypes):
        p = torch.nn.Parameter(torch.zeros(7 + 29 * i, dtype=dt))
        p.grad = (torch.randn(p.shape, generator=g) * (i + 1) * scale).to(dt)
        ps.append(p)
    return ps


def _clip64(grads, max_norm, norm_type):
    """float64 clipping: (total norm, clipped gradients)."""
    total = torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for g in grads]), norm_type)
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    return total, [g.double() * coef for g in grads]


@pytest.mark.parametrize("dtypes", [[torch.float32] * 3, [torch.float16] * 2, [torch.bfloat16] * 4,
                                    [torch.bfloat16, torch.float32, torch.bfloat16]])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.5, 1e4])
def test_clip_glue_ours(fake, dtypes, norm_type, max_norm):
    """Our kernels (impl='pipegoose'): one norm and one multiplication per (device, dtype) group, the groups' norms
    combined in fp32, the coefficient passed as a float32 tensor (no host sync), the total in the promoted dtype as
    torch returns it; every gradient within its dtype's tolerance of the float64 clipping."""
    ps = _clip_params(dtypes)
    grads0 = [p.grad.clone() for p in ps]
    total = clip_grad_norm_(ps, max_norm, norm_type, impl="pipegoose")
    groups = len(set(dtypes))
    assert dispatch.stats()["clip_grad_norm"] == {"pipegoose": groups}
    assert fake.calls.count("multi_tensor_norm") == fake.calls.count("multi_tensor_mul_") == groups
    want_total, want = _clip64(grads0, max_norm, norm_type)
    worst = max(dtypes, key=lambda d: torch.finfo(d).eps)   # the coarsest dtype taking part
    assert total.dtype == torch.nn.utils.clip_grad_norm_(_clip_params(dtypes), max_norm, norm_type).dtype
    torch.testing.assert_close(total.double(), want_total, **TOLERANCES[worst])
    for p, w in zip(ps, want):
        torch.testing.assert_close(p.grad.double(), w, **TOLERANCES[p.dtype])


def test_clip_glue_ours_with_a_group_it_declines(fake):
    """A group our kernel declines (a non-contiguous gradient) takes torch's path; both groups are scaled by the one
    coefficient of the total norm."""
    ps = _clip_params([torch.bfloat16, torch.bfloat16])
    q = torch.nn.Parameter(torch.zeros(6, 5))
    q.grad = torch.randn(5, 6).t()   # float32, not contiguous
    grads0 = [p.grad.clone() for p in ps] + [q.grad.clone()]
    with pytest.warns(UserWarning, match="impl='pipegoose' cannot run this input: a tensor is not contiguous"):
        clip_grad_norm_(ps + [q], 0.5, impl="pipegoose")
    assert dispatch.stats()["clip_grad_norm"] == {"pipegoose": 1, "torch": 1}
    _, want = _clip64(grads0, 0.5, 2.0)
    for g, w in zip([p.grad for p in ps] + [q.grad], want):
        torch.testing.assert_close(g.double(), w, **TOLERANCES[g.dtype])


def test_clip_ours_comes_first_and_declines_a_gradient_listed_twice(fake):
    """Without a request or a tuning rule our kernel runs (first in the built-in order since session 56 timed it):
    bf16, fp32 and the inf norm, which the Apex copy does not take. A gradient listed twice goes to torch's path,
    which counts and scales it twice, as torch.nn.utils.clip_grad_norm_ does."""
    ps = _clip_params([torch.bfloat16] * 2)
    clip_grad_norm_(ps, 0.5)
    assert dispatch.stats()["clip_grad_norm"] == {"pipegoose": 1}
    assert dispatch.explain("clip_grad_norm", [p.grad for p in ps], 2.0).impl == "pipegoose"
    assert dispatch.explain("clip_grad_norm", [ps[0].grad.float()], 2.0).impl == "pipegoose"
    assert dispatch.explain("clip_grad_norm", [ps[0].grad.half()], math.inf).impl == "pipegoose"
    assert dispatch.explain("clip_grad_norm", [ps[0].grad.float()], 2.0, impl="apex").impl == "apex"
    c = dispatch.explain("clip_grad_norm", [ps[0].grad, ps[0].grad], 2.0, impl="pipegoose")
    assert c.impl == "torch" and "listed twice" in c.reasons["pipegoose"]
    c = dispatch.explain("clip_grad_norm", [ps[0].grad], 3.0, impl="pipegoose")
    assert c.impl == "torch" and "1, 2 and inf" in c.reasons["pipegoose"]
    p1, p2 = _clip_params([torch.float32]), _clip_params([torch.float32])
    with pytest.warns(UserWarning, match="overlap in memory"):
        n1 = clip_grad_norm_([p1[0], p1[0]], 0.5, impl="pipegoose")
    n2 = torch.nn.utils.clip_grad_norm_([p2[0], p2[0]], 0.5)
    assert torch.equal(n1, n2) and torch.equal(p1[0].grad, p2[0].grad)


def test_clip_glue_ours_empty_and_overlapping_gradients(fake):
    """Empty gradients count 0 (only empty ones: a total of 0); gradients that share memory (views of one buffer)
    are declined with the reason and take torch's path, which gives torch's result."""
    ps = _clip_params([torch.bfloat16] * 3)
    e = torch.nn.Parameter(torch.zeros(0, dtype=torch.bfloat16))
    e.grad = torch.zeros(0, dtype=torch.bfloat16)
    _, want = _clip64([p.grad for p in ps], 0.5, 2.0)
    clip_grad_norm_(ps[:1] + [e] + ps[1:], 0.5, impl="pipegoose")
    assert dispatch.stats()["clip_grad_norm"] == {"pipegoose": 1}
    for p, w in zip(ps, want):
        torch.testing.assert_close(p.grad.double(), w, **TOLERANCES[torch.bfloat16])
    assert float(clip_grad_norm_([e], 0.5, impl="pipegoose")) == 0.0
    buf = torch.randn(20)
    views = []
    for sl in (slice(0, 12), slice(8, 20)):
        p = torch.nn.Parameter(torch.zeros(12))
        p.grad = buf[sl]
        views.append(p)
    c = dispatch.explain("clip_grad_norm", [v.grad for v in views], 2.0, impl="pipegoose")
    assert c.impl == "torch"
    assert c.reasons["pipegoose"].startswith("gradients 0 and 1 of the group overlap in memory")
    assert c.reasons["apex"] == c.reasons["pipegoose"]
    ref = buf.clone()
    want = torch.nn.utils.clip_grad_norm_([_param_with_grad(ref[0:12]), _param_with_grad(ref[8:20])], 0.5)
    with pytest.warns(UserWarning, match="overlap in memory"):
        got = clip_grad_norm_(views, 0.5, impl="pipegoose")
    assert torch.equal(got, want) and torch.equal(buf, ref)


def _param_with_grad(g):
    p = torch.nn.Parameter(torch.zeros(g.shape, dtype=g.dtype))
    p.grad = g
    return p


def test_clip_glue_ours_coefficient_from_the_fp32_total(fake):
    """The coefficient comes from the fp32 total: bf16 gradients are scaled by exactly
    clamp(max_norm / (total32 + 1e-6), max=1) (torch rounds the total to bf16 first, and the result differs here);
    fp16 gradients whose norm exceeds 65504 are clipped to max_norm (torch zeroes them), the total returned being
    inf as torch's; with an fp64 group the groups' norms combine in fp64 (an fp32 combination was off by 7e-10)."""
    ps = _clip_params([torch.bfloat16] * 3, seed=3)
    g0 = [p.grad.clone() for p in ps]
    total32 = torch.linalg.vector_norm(torch.cat([g.float() for g in g0]))
    total = clip_grad_norm_(ps, 0.37, impl="pipegoose")
    coef32 = torch.clamp(0.37 / (total32 + 1e-6), max=1.0)
    assert total.dtype == torch.bfloat16 and torch.equal(total, total32.bfloat16())
    assert all(torch.equal(p.grad, (g.float() * coef32).bfloat16()) for p, g in zip(ps, g0))
    coef16 = torch.clamp(0.37 / (total32.bfloat16() + 1e-6), max=1.0)
    assert any(not torch.equal(p.grad, g * coef16) for p, g in zip(ps, g0)), "the test does not tell them apart"
    big = [_param_with_grad(torch.full((4,), 60000.0, dtype=torch.float16)) for _ in range(2)]
    total = clip_grad_norm_(big, 1.0, impl="pipegoose")
    assert total.dtype == torch.float16 and total.isinf()
    norm = torch.linalg.vector_norm(torch.cat([p.grad.double() for p in big]))
    assert norm.item() == pytest.approx(1.0, rel=1e-3)
    g64 = _param_with_grad(torch.full((1000,), 1 + 1e-12, dtype=torch.float64))
    g32 = _param_with_grad(torch.full((10,), 1e-4))
    want = torch.nn.utils.clip_grad_norm_([_param_with_grad(g64.grad.clone()), _param_with_grad(g32.grad.clone())], 1.0)
    ref = g64.grad.clone() * min(1.0, 1.0 / (float(want) + 1e-6))
    dispatch.reset_stats()
    with pytest.warns(UserWarning, match="impl='pipegoose' cannot run this input: dtype float64"):
        total = clip_grad_norm_([g64, g32], 1.0, impl="pipegoose")
    # the fp32 group ran ours, the fp64 one torch's path
    assert dispatch.stats()["clip_grad_norm"] == {"pipegoose": 1, "torch": 1}
    assert total.dtype == torch.float64 and abs(float(total) - float(want)) < 1e-12
    assert (g64.grad - ref).abs().max().item() < 1e-15


@pytest.mark.parametrize("kw,err,msg", [
    ({"max_norm": "a"}, TypeError, "max_norm: expected a number, got 'a'"),
    ({"max_norm": None}, TypeError, "max_norm: expected a number, got None"),
    ({"max_norm": 1.0, "norm_type": "fro"}, TypeError, "norm_type: expected a number, got 'fro'"),
    ({"max_norm": -1.0}, ValueError, "max_norm: expected a number >= 0"),
    ({"max_norm": float("nan")}, ValueError, "max_norm: expected a number >= 0"),
    ({"max_norm": 1.0, "norm_type": float("nan")}, ValueError, "norm_type: expected a number"),
])
def test_clip_arguments_are_checked(kw, err, msg):
    """A walkthrough: a string max_norm raised float()'s message without the argument's name, and a negative or nan
    max_norm flipped or poisoned every gradient without a word (as torch's does); the gradients stay untouched."""
    p = torch.nn.Parameter(torch.zeros(5))
    p.grad = torch.arange(5.0)
    with pytest.raises(err, match=msg):
        clip_grad_norm_([p], **kw)
    assert torch.equal(p.grad, torch.arange(5.0))
    # what torch takes still works: "inf" as a string, a one-element tensor
    assert float(clip_grad_norm_([p], torch.tensor(100.0), norm_type="inf")) == 4.0


def test_clip_runs_without_autograd():
    """clip_grad_norm_ runs under torch.no_grad, as torch's: gradients that require grad (create_graph=True) are
    scaled in place and the norm carries no graph (a decorator once moved to a helper by mistake, session 33)."""
    p = torch.nn.Parameter(torch.zeros(5))
    p.grad = torch.arange(5.0).requires_grad_()
    n = clip_grad_norm_([p], 1.0)
    assert not n.requires_grad
    torch.testing.assert_close(p.grad.detach(), torch.arange(5.0) / torch.arange(5.0).norm(), rtol=1e-5, atol=1e-6)


def test_small_problem_rule_through_the_ops(fake, monkeypatch):
    """With the default small-problem size, a small LayerNorm / F.rms_norm-style RMSNorm runs the native op
    (source "small"); Llama-style RMSNorm, whose torch path is the eager formula, keeps the fused kernel."""
    monkeypatch.delenv("PIPEGOOSE_SMALL_NUMEL")
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    PF.layer_norm(x, (8,), w, None)
    assert dispatch.last_choice("layer_norm").source == "small"
    PF.rms_norm(x, (8,), w, 1e-6)
    assert dispatch.last_choice("rms_norm").source == "small"
    PF.rms_norm(x, (8,), w, 1e-6, cast_before_weight=True)
    assert dispatch.last_choice("rms_norm").impl == "pipegoose"
    assert dispatch.stats() == {"layer_norm": {"torch": 1}, "rms_norm": {"torch": 1, "pipegoose": 1}}
    assert "layer_norm_forward" not in fake.calls


def _first_and_second_order(fn, inputs, calls, seed=0):
    """(grads, Hessian-vector products, kernel calls of the first backward) of sum(fn(*inputs) * v) for random v, u:
    the first backward with create_graph=True, then a backward through it (zeros where a gradient does not depend on
    an input: a LayerNorm's bias)."""
    g = torch.Generator().manual_seed(seed)
    ins = [t.detach().clone().requires_grad_(True) for t in inputs]
    y = fn(*ins)
    v = torch.randn(y.shape, generator=g)
    n = len(calls)
    grads = torch.autograd.grad((y.float() * v).sum(), ins, create_graph=True)
    first = calls[n:]
    u = [torch.randn(t.shape, generator=g) for t in ins]
    hvp = torch.autograd.grad(sum((gr.float() * uu).sum() for gr, uu in zip(grads, u)), ins, allow_unused=True)
    hvp = [torch.zeros_like(t) if h is None else h for t, h in zip(ins, hvp)]
    return [gr.detach() for gr in grads], hvp, first


_R = lambda *shape, dtype=torch.float32: torch.randn(*shape).to(dtype)  # noqa: E731
_MASK = torch.rand(2, 1, 16, 16, generator=torch.Generator().manual_seed(1)) < 0.3
DOUBLE_BACKWARD_CASES = {
    # name: (op, impl, fn(impl) -> callable, inputs, dtype the results are computed in)
    "layer_norm-pipegoose": ("layer_norm", "pipegoose",
                             lambda i: lambda x, w, b: PF.layer_norm(x, (4, 8), w, b, impl=i),
                             (_R(3, 5, 4, 8), _R(4, 8), _R(4, 8)), torch.float32),
    "layer_norm-pipegoose-mixed": ("layer_norm", "pipegoose",
                                   lambda i: lambda x, w, b: PF.layer_norm(x, (8,), w, b, impl=i),
                                   (_R(6, 8, dtype=torch.bfloat16), _R(8), _R(8)), torch.bfloat16),
    "layer_norm-apex": ("layer_norm", "apex", lambda i: lambda x, w, b: PF.layer_norm(x, (8,), w, b, impl=i),
                        (_R(6, 8), _R(8), _R(8)), torch.float32),
    "rms_norm-pipegoose": ("rms_norm", "pipegoose", lambda i: lambda x, w: PF.rms_norm(x, (4, 8), w, 1e-6, impl=i),
                           (_R(3, 5, 4, 8), _R(4, 8)), torch.float32),
    "rms_norm-pipegoose-llama": ("rms_norm", "pipegoose",
                                 lambda i: lambda x, w: PF.rms_norm(x, 8, w, 1e-6, cast_before_weight=True, impl=i),
                                 (_R(6, 8, dtype=torch.bfloat16), _R(8)), torch.bfloat16),
    "softmax-pipegoose": ("softmax", "pipegoose", lambda i: lambda x: PF.scaled_softmax(x, 0.5, impl=i),
                          (_R(4, 33),), torch.float32),
    "softmax-plain-pipegoose": ("softmax", "pipegoose", lambda i: lambda x: PF.softmax(x, -1, impl=i),
                                (_R(4, 33),), torch.float32),
    "softmax.masked-pipegoose": ("softmax.masked", "pipegoose",
                                 lambda i: lambda x: PF.scaled_masked_softmax(x, _MASK, 0.5, impl=i),
                                 (_R(2, 2, 16, 16, dtype=torch.float16),), torch.float16),
    "softmax.masked-megatron": ("softmax.masked", "megatron",
                                lambda i: lambda x: PF.scaled_masked_softmax(x, _MASK, 0.5, impl=i),
                                (_R(2, 2, 16, 16, dtype=torch.float16),), torch.float16),
    "softmax.causal-pipegoose": ("softmax.causal", "pipegoose",
                                 lambda i: lambda x: PF.scaled_upper_triang_masked_softmax(x, 0.5, impl=i),
                                 (_R(16, 16, 16, dtype=torch.float16),), torch.float16),
    "softmax.causal-megatron": ("softmax.causal", "megatron",
                                lambda i: lambda x: PF.scaled_upper_triang_masked_softmax(x, 0.5, impl=i),
                                (_R(16, 16, 16, dtype=torch.float16),), torch.float16),
}


@pytest.mark.parametrize("case", list(DOUBLE_BACKWARD_CASES))
def test_double_backward_through_the_fused_functions(fake, case):
    """A backward with create_graph=True through a fused Function, then a backward through that: the kernels'
    backward is not differentiable (it used to be called all the same, and its result had no graph back to the
    input: the second backward failed, or with the real ops lost those terms), so such a backward runs the reference
    formula and the second derivatives equal the reference path's. A plain backward still runs the kernel."""
    op, impl, make, inputs, dtype = DOUBLE_BACKWARD_CASES[case]
    grads, hvp, first = _first_and_second_order(make(impl), inputs, fake.calls)
    assert dispatch.stats()[op] == {impl: 1}
    ref_grads, ref_hvp, _ = _first_and_second_order(make("torch"), inputs, [])
    for a, b in zip(grads + hvp, ref_grads + ref_hvp):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), **TOLERANCES[dtype])
    assert not any(c.endswith("_backward") for c in first), first    # not the kernel under create_graph
    ins = [t.detach().clone().requires_grad_(True) for t in inputs]
    n = len(fake.calls)
    make(impl)(*ins).float().sum().backward()              # no create_graph: the kernel
    assert any(c.endswith("_backward") for c in fake.calls[n:])


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_torch_func_after_an_eager_call_of_the_same_metadata(fake, op):
    """An eager call caches its choice (pipegoose); a call of the same shapes inside torch.func.grad / vmap (tensors
    without storage, which report the same metadata) must not reuse it: the kernels decline such tensors, and the
    norm Functions cannot run inside a transform (the C++ one raises "cannot use C++ torch::autograd::Function with
    functorch transforms"). It runs the reference instead."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 16, generator=g).requires_grad_(True)
    w = torch.randn(16, generator=g)
    if op == "layer_norm":
        def fn(t):
            return PF.layer_norm(t, (16,), w, None, 1e-5)

        def ref(t):
            return F.layer_norm(t, (16,), w, None, 1e-5)
    else:
        def fn(t):
            return PF.rms_norm(t, (16,), w, 1e-6)

        def ref(t):
            return F.rms_norm(t, (16,), w, 1e-6)
    fn(x)
    assert dispatch.last_choice(op).impl == "pipegoose"
    got = torch.func.grad(lambda t: fn(t).pow(2).sum())(x.detach())
    want = torch.func.grad(lambda t: ref(t).pow(2).sum())(x.detach())
    torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])
    assert dispatch.last_choice(op).impl == "torch"
    torch.testing.assert_close(torch.func.vmap(fn)(x.detach()), ref(x.detach()), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_norm_transforms_and_dual_tensors_in_any_argument(fake, op):
    """A code review: the choice cache looked only at ``x`` for torch.func tensors, so after an eager call a call
    whose weight or bias came from a transform (vmap over weights) reused the cached kernel choice and crashed inside
    the norm Function; and the fused norms have no forward derivative (their C++ Function has no jvp), so a dual
    tensor (torch.autograd.forward_ad) crashed where F.layer_norm / F.rms_norm work. Both now run the reference."""
    import torch.autograd.forward_ad as fwAD

    g = torch.Generator().manual_seed(9)
    x = torch.randn(4, 16, generator=g)
    ws = torch.randn(3, 16, generator=g)
    t = torch.randn(4, 16, generator=g)
    if op == "layer_norm":
        def fn(x_, w_):
            return PF.layer_norm(x_, (16,), w_, w_ * 0.5, 1e-5)

        def ref(x_, w_):
            return F.layer_norm(x_, (16,), w_, w_ * 0.5, 1e-5)
    else:
        def fn(x_, w_):
            return PF.rms_norm(x_, (16,), w_, 1e-6)

        def ref(x_, w_):
            return F.rms_norm(x_, (16,), w_, 1e-6)
    fn(x, ws[0])
    assert dispatch.last_choice(op).impl == "pipegoose"          # cached for plain tensors of this metadata
    got = torch.func.vmap(lambda w_: fn(x, w_))(ws)               # the weight (and bias) under vmap, x plain
    torch.testing.assert_close(got, torch.stack([ref(x, w_) for w_ in ws]), **TOLERANCES[torch.float32])
    assert dispatch.last_choice(op).impl == "torch"
    fn(x, ws[0])
    with fwAD.dual_level():
        y = fn(fwAD.make_dual(x, t), ws[0])
        tangent = fwAD.unpack_dual(y).tangent
        assert dispatch.last_choice(op).impl == "torch" and "forward_ad" in dispatch.last_choice(op).reasons["pipegoose"]
        want = fwAD.unpack_dual(ref(fwAD.make_dual(x, t), ws[0])).tangent
    torch.testing.assert_close(tangent, want, **TOLERANCES[torch.float32])
    fn(x, ws[0])
    assert dispatch.last_choice(op).impl == "pipegoose"           # outside the dual level: the kernel again


def test_softmax_mask_under_vmap_after_an_eager_call(fake):
    """The softmax's cache key took a mask from vmap (no storage) for a plain one: after an eager call, vmap over masks
    reused the kernel choice and crashed in the fused Function; it now runs the reference."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 5, 8, generator=g)
    masks = torch.rand(4, 2, 1, 5, 8, generator=g) < 0.3
    PF.scaled_masked_softmax(x, masks[0], 0.5)
    assert dispatch.last_choice("softmax.masked").impl == "pipegoose"
    got = torch.func.vmap(lambda m: PF.scaled_masked_softmax(x, m, 0.5))(masks)
    assert dispatch.last_choice("softmax.masked").impl == "torch"
    want = torch.stack([_softmax_rows(x.double() * 0.5, m) for m in masks])
    torch.testing.assert_close(got.double(), want, **TOLERANCES[torch.float32])


def test_fuse_report_loads_only_the_kernels_its_choices_need(fake, monkeypatch):
    """fuse() filled each report row with dispatch.explain, which asks every implementation and so loaded (on a first
    run: built, a minute each) the kernels of implementations the choice never needed, such as the Apex copy. The
    report now asks only for the choice."""
    from pipegoose.nn.fusion.fuse import fuse, unfuse

    loaded = []
    monkeypatch.setattr(dispatch, "_load_kernel", lambda name: loaded.append(name) or fake)
    dispatch.clear_kernel_cache()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    report = fuse(model)
    assert report.fused_rows("layer_norm")[0].forward == "pipegoose"
    assert loaded == ["pipegoose/layer_norm"], loaded
    unfuse(model)
