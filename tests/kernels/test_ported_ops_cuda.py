"""GPU tests of the ported kernels' ops (torch.ops.pipegoose.*): build + load, opcheck, numerics vs float64.

Run on a GPU machine (after ``python tools/port.py sync``; ``python -m pipegoose.kernels build --all`` first saves
time): ``python -m pytest -m cuda tests/kernels -q``.
"""

from __future__ import annotations

import math

import pytest
import torch

from adam_reference import adam_step64
from tolerances import TOLERANCES, tol

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

DEV = "cuda"
HALF = [torch.float16, torch.bfloat16]


def _load(name):
    from pipegoose.kernels import load

    return load(name)


@pytest.fixture(scope="module")
def smsm():
    return _load("scaled_masked_softmax")


@pytest.fixture(scope="module")
def causal():
    return _load("scaled_upper_triang_masked_softmax")


@pytest.fixture(scope="module")
def fln():
    return _load("fused_layernorm")


@pytest.fixture(scope="module")
def adam():
    return _load("apex/multi_tensor_adam")


@pytest.fixture(scope="module")
def ds_adam():
    return _load("deepspeed_fused_adam")


@pytest.fixture(scope="module")
def l2norm():
    return _load("multi_tensor_l2norm")


@pytest.fixture(scope="module")
def mtscale():
    return _load("multi_tensor_scale")


def poison(*like: tuple[tuple[int, ...], torch.dtype]) -> None:
    """Leave NaN-filled blocks of the outputs' sizes in the caching allocator, so that an output the kernel fails to
    write shows up as NaN (0xFF.. is NaN in fp32, fp16 and bf16)."""
    blocks = [torch.full((math.prod(s) * torch.empty((), dtype=d).element_size(),), 0xFF, dtype=torch.uint8,
                         device=DEV) for s, d in like]
    torch.cuda.synchronize()
    del blocks


def assert_all_written(t: torch.Tensor, what: str) -> None:
    assert not torch.isnan(t).any(), f"{what}: {int(torch.isnan(t).sum())} element(s) not written (NaN)"


def in_dtype(scale: float, dtype: torch.dtype) -> float:
    return torch.tensor(scale, dtype=dtype).item()


# ------------------------------------------------------------------------------------------------- softmax refs


def ref_masked_softmax(x, mask, scale):
    """Megatron semantics in float64: masked logits become -10000 (a fully masked row comes out uniform)."""
    z = x.double() * scale
    if mask is not None:
        z = torch.where(mask.bool(), torch.full_like(z, -10000.0), z)
    return torch.softmax(z, dim=-1)


def ref_causal_softmax(x, scale):
    sq, sk = x.shape[-2:]
    causal = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(1)
    z = (x.double() * scale).masked_fill(causal, float("-inf"))
    return torch.softmax(z, dim=-1)


def ref_softmax_backward(dy, y, scale):
    dy, y = dy.double(), y.double()
    return scale * y * (dy - (dy * y).sum(-1, keepdim=True))


def padding_mask(b, sq, sk, device=DEV, full_row=False):
    lengths = torch.randint(1, sk + 1, (b,), device=device)
    keys = torch.arange(sk, device=device)
    m = (keys[None, :] >= lengths[:, None])[:, None, None, :].expand(b, 1, sq, sk).contiguous()
    if full_row:
        m[0, 0, 1, :] = True
    return m


# ------------------------------------------------------------------------------------------------- build + opcheck


def test_every_ported_kernel_loads(smsm, causal, fln, adam, ds_adam, l2norm, mtscale):
    for ops in (smsm, causal, fln, adam, ds_adam, l2norm, mtscale):
        for op in ops.kernel.ops:
            assert getattr(ops, op) is getattr(torch.ops.pipegoose, op)
            assert ops.library_path.is_file()


def test_opcheck_softmaxes(smsm, causal):
    x = torch.randn(2, 3, 16, 24, device=DEV, dtype=torch.float16)
    m = padding_mask(2, 16, 24)
    torch.library.opcheck(torch.ops.pipegoose.scaled_masked_softmax_forward.default, (x, m, 0.5))
    y = torch.ops.pipegoose.scaled_masked_softmax_forward(x, m, 0.5)
    torch.library.opcheck(torch.ops.pipegoose.scaled_masked_softmax_backward.default, (torch.randn_like(y), y, 0.5))
    xc = torch.randn(16, 24, 24, device=DEV, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.pipegoose.scaled_upper_triang_masked_softmax_forward.default, (xc, 0.3))
    yc = torch.ops.pipegoose.scaled_upper_triang_masked_softmax_forward(xc, 0.3)
    torch.library.opcheck(torch.ops.pipegoose.scaled_upper_triang_masked_softmax_backward.default,
                          (torch.randn_like(yc), yc, 0.3))
    assert smsm.scaled_masked_softmax_get_batch_per_block(16, 24, 2, 3) == 8


def test_opcheck_layer_norm(fln):
    x = torch.randn(4, 5, 32, device=DEV)
    g = torch.randn(32, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(32, device=DEV, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.pipegoose.fused_layer_norm_affine_forward.default, (x, [32], g, b, 1e-5))
    y, mean, invvar = torch.ops.pipegoose.fused_layer_norm_affine_forward(x, [32], g, b, 1e-5)
    torch.library.opcheck(torch.ops.pipegoose.fused_layer_norm_affine_backward.default,
                          (torch.randn_like(y), mean, invvar, x, [32], g, b, 1e-5))


def _adam_lists(dtype_g, dtype_p, sizes, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    g = [torch.randn(n, device=DEV, generator=gen).to(dtype_g) for n in sizes]
    p = [torch.randn(n, device=DEV, generator=gen).to(dtype_p) for n in sizes]
    m = [(0.1 * torch.randn(n, device=DEV, generator=gen)).to(dtype_p) for n in sizes]
    v = [(0.1 * torch.rand(n, device=DEV, generator=gen)).to(dtype_p) for n in sizes]
    return g, p, m, v


def test_opcheck_multi_tensor(adam, ds_adam, l2norm, mtscale):
    noop = torch.zeros(1, dtype=torch.int32, device=DEV)
    g, p, m, v = _adam_lists(torch.float32, torch.float32, [5, 300])
    torch.library.opcheck(torch.ops.pipegoose.multi_tensor_adam.default,
                          (2048, noop, g, p, m, v, 1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.01, -1.0))
    torch.library.opcheck(torch.ops.pipegoose.deepspeed_multi_tensor_adam.default,
                          (2048, noop, g, p, m, v, 1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.01))
    torch.library.opcheck(torch.ops.pipegoose.multi_tensor_l2norm.default, (2048, noop, g, True))
    dst = [torch.empty_like(t) for t in g]
    torch.library.opcheck(torch.ops.pipegoose.multi_tensor_scale.default, (2048, noop, g, dst, 0.5))


# ------------------------------------------------------------------------------------------------- masked softmax

MASKED_SHAPES = [
    (4, 12, 24, 24),  # the short-key case (Megatron-LM#132 regression)
    (2, 3, 64, 4), (2, 2, 64, 16), (2, 3, 16, 33), (1, 2, 32, 64), (2, 4, 64, 128), (1, 2, 16, 1000),
    (1, 2, 16, 2048), (1, 1, 256, 1),
]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("shape", MASKED_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask_batch", ["b", "1"])
def test_scaled_masked_softmax_matches_float64(smsm, shape, dtype, mask_batch):
    b, np_, sq, sk = shape
    x = (3 * torch.randn(shape, device=DEV)).to(dtype)
    mask = padding_mask(b, sq, sk, full_row=sq > 1)
    if mask_batch == "1":
        mask = (torch.rand(1, 1, sq, sk, device=DEV) < 0.3)
    scale = 0.125
    poison((shape, dtype))
    y = smsm.scaled_masked_softmax_forward(x, mask, scale)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    assert_all_written(y, "forward output")
    torch.testing.assert_close(y.double(), ref_masked_softmax(x, mask, scale), **tol(dtype))

    dy = torch.randn(shape, device=DEV).to(dtype)
    dy_before = dy.clone()
    poison((shape, dtype))
    dx = smsm.scaled_masked_softmax_backward(dy, y, scale)
    assert torch.equal(dy, dy_before), "backward must not write into output_grads"
    assert dx.dtype == dtype and dx.shape == x.shape
    assert_all_written(dx, "backward output")
    torch.testing.assert_close(dx.double(), ref_softmax_backward(dy, y, scale), **tol(dtype, 2))


@pytest.mark.parametrize("dtype", HALF)
def test_scaled_masked_softmax_scale_is_rounded_to_input_dtype(smsm, dtype):
    x = torch.randn(2, 2, 16, 40, device=DEV).to(dtype)
    mask = padding_mask(2, 16, 40)
    y = smsm.scaled_masked_softmax_forward(x, mask, 0.3)
    torch.testing.assert_close(y.double(), ref_masked_softmax(x, mask, in_dtype(0.3, dtype)), **tol(dtype))


def test_scaled_masked_softmax_uint8_mask_any_nonzero_masks(smsm):
    x = torch.randn(1, 2, 16, 32, device=DEV, dtype=torch.float16)
    m = (torch.rand(1, 1, 16, 32, device=DEV) < 0.4).to(torch.uint8) * 2  # 2, not 1: still "masked"
    y = smsm.scaled_masked_softmax_forward(x, m, 1.0)
    torch.testing.assert_close(y.double(), ref_masked_softmax(x, m.bool(), 1.0), **tol(torch.float16))


@pytest.mark.parametrize("shape,match", [
    ((1, 2, 16, 2049), "must be in \\[1, 2048\\]"),
    ((1, 2, 1, 32), "at least 2"),
    ((1, 2, 12, 32), "multiple of 8"),
    ((1, 2, 16, 66), "multiple of 4"),
])
def test_scaled_masked_softmax_rejects_what_the_kernel_cannot_do(smsm, shape, match):
    x = torch.randn(shape, device=DEV, dtype=torch.float16)
    m = torch.zeros(shape[0], 1, *shape[2:], dtype=torch.bool, device=DEV)
    with pytest.raises(RuntimeError, match=match):
        smsm.scaled_masked_softmax_forward(x, m, 1.0)


def test_scaled_masked_softmax_argument_errors(smsm):
    x = torch.randn(2, 2, 16, 32, device=DEV, dtype=torch.float16)
    m = torch.zeros(2, 1, 16, 32, dtype=torch.bool, device=DEV)
    with pytest.raises(RuntimeError, match="input must be float16 or bfloat16"):
        smsm.scaled_masked_softmax_forward(x.float(), m, 1.0)
    with pytest.raises(RuntimeError, match="input must be contiguous"):
        smsm.scaled_masked_softmax_forward(x.transpose(2, 3), m, 1.0)
    with pytest.raises(RuntimeError, match="mask must have shape"):
        smsm.scaled_masked_softmax_forward(x, m[:, :, :8], 1.0)
    with pytest.raises(RuntimeError, match="mask must be bool or uint8"):
        smsm.scaled_masked_softmax_forward(x, m.float(), 1.0)
    with pytest.raises(RuntimeError, match="scale must be finite"):
        smsm.scaled_masked_softmax_forward(x, m, 1e6)


# ------------------------------------------------------------------------------------------------- causal softmax

CAUSAL_SHAPES = [(48, 24, 24), (64, 4, 4), (8, 64, 64), (8, 128, 128), (4, 1000, 1000), (4, 2048, 2048),
                 (256, 1, 1), (32, 33, 33)]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("shape", CAUSAL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_scaled_upper_triang_masked_softmax_matches_float64(causal, shape, dtype):
    x = (3 * torch.randn(shape, device=DEV)).to(dtype)
    scale = 0.25
    poison((shape, dtype))
    y = causal.scaled_upper_triang_masked_softmax_forward(x, scale)
    assert y.dtype == dtype and y.shape == x.shape
    assert_all_written(y, "forward output")
    ref = ref_causal_softmax(x, scale)
    torch.testing.assert_close(y.double(), ref, **tol(dtype))
    assert (y.double().triu(1) == 0).all(), "keys after the query must get exactly 0"

    dy = torch.randn(shape, device=DEV).to(dtype)
    dy_before = dy.clone()
    poison((shape, dtype))
    dx = causal.scaled_upper_triang_masked_softmax_backward(dy, y, scale)
    assert torch.equal(dy, dy_before), "backward must not write into output_grads"
    assert_all_written(dx, "backward output")
    torch.testing.assert_close(dx.double(), ref_softmax_backward(dy, y, scale), **tol(dtype, 2))


def test_scaled_upper_triang_masked_softmax_errors(causal):
    with pytest.raises(RuntimeError, match="sq == sk"):
        causal.scaled_upper_triang_masked_softmax_forward(torch.randn(8, 16, 32, device=DEV).half(), 1.0)
    with pytest.raises(RuntimeError, match="must be in \\[1, 2048\\]"):
        causal.scaled_upper_triang_masked_softmax_forward(torch.randn(4, 2052, 2052, device=DEV).half(), 1.0)
    with pytest.raises(RuntimeError, match="attn_batches \\(dim 0\\) must be a multiple of 8"):
        causal.scaled_upper_triang_masked_softmax_forward(torch.randn(12, 24, 24, device=DEV).half(), 1.0)


# ------------------------------------------------------------------------------------------------- layer norm


def ref_layer_norm(x, normalized_shape, g, b, eps):
    x64 = x.double().requires_grad_()
    g64 = g.double().requires_grad_()
    b64 = b.double().requires_grad_()
    dims = tuple(range(x.dim() - len(normalized_shape), x.dim()))
    mean = x64.mean(dims, keepdim=True)
    var = ((x64 - mean) ** 2).mean(dims, keepdim=True)
    invvar = 1.0 / torch.sqrt(var + eps)
    y = (x64 - mean) * invvar * g64 + b64
    return y, mean.reshape(-1), invvar.reshape(-1), (x64, g64, b64)


LN_CASES = [  # input shape, normalized_shape
    ((4, 7, 96), (96,)), ((3, 423, 213), (213,)), ((2, 5, 1024), (1024,)), ((6, 1), (1,)), ((2, 65536), (65536,)),
    ((4, 6, 8), (6, 8)), ((1, 4097), (4097,)),
]
LN_DTYPES = [(torch.float32, torch.float32), (torch.float32, torch.float16), (torch.float32, torch.bfloat16),
             (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("in_dtype,w_dtype", LN_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("shape,nshape", LN_CASES, ids=lambda s: "x".join(map(str, s)))
def test_fused_layer_norm_matches_float64(fln, shape, nshape, in_dtype, w_dtype):
    x = (2 * torch.randn(shape, device=DEV) + 0.5).to(in_dtype)
    g = (1 + 0.5 * torch.randn(nshape, device=DEV)).to(w_dtype)
    b = (0.5 * torch.randn(nshape, device=DEV)).to(w_dtype)
    eps = 1e-5
    rows = x.numel() // math.prod(nshape)
    poison((shape, w_dtype), ((rows,), torch.float32), ((rows,), torch.float32))
    y, mean, invvar = fln.fused_layer_norm_affine_forward(x, list(nshape), g, b, eps)
    assert y.dtype == w_dtype and y.shape == x.shape and mean.shape == (rows,) and mean.dtype == torch.float32
    for t, what in ((y, "output"), (mean, "mean"), (invvar, "invvar")):
        assert_all_written(t, what)
    ry, rmean, rinv, leaves = ref_layer_norm(x, nshape, g, b, eps)
    low = w_dtype if w_dtype != torch.float32 else in_dtype
    torch.testing.assert_close(y.double(), ry.detach(), **tol(low, 2))
    torch.testing.assert_close(mean.double(), rmean.detach(), **tol(torch.float32, 10))
    torch.testing.assert_close(invvar.double(), rinv.detach(), **tol(torch.float32, 10))

    dy = torch.randn(shape, device=DEV).to(w_dtype)
    poison((shape, in_dtype), (nshape, w_dtype), (nshape, w_dtype))
    dx, dg, db = fln.fused_layer_norm_affine_backward(dy, mean, invvar, x, list(nshape), g, b, eps)
    assert dx.dtype == in_dtype and dg.dtype == w_dtype and db.dtype == w_dtype
    for t, what in ((dx, "grad_input"), (dg, "grad_gamma"), (db, "grad_beta")):
        assert_all_written(t, what)
    rdx, rdg, rdb = torch.autograd.grad(ry, leaves, dy.double())
    # dx = invvar * (rounded terms of the size of g * dy): its rounding error grows with invvar, which reaches
    # 1/sqrt(eps) ~ 316 where a row has no variance (hidden size 1: the exact dx is 0, the kernel's ~7e-5).
    t = tol(low, 4)
    torch.testing.assert_close(dx.double(), rdx, rtol=t["rtol"], atol=t["atol"] * max(1.0, rinv.max().item()))
    # grad_gamma/beta sum over rows: compare relative to the gradient's scale.
    for got, ref, what in ((dg, rdg, "grad_gamma"), (db, rdb, "grad_beta")):
        err = (got.double() - ref).abs().max() / ref.abs().max().clamp_min(1.0)
        assert err < 10 * TOLERANCES[low]["rtol"], f"{what}: relative error {err:.2e}"


def test_fused_layer_norm_rejects_mixed_half_weights(fln):
    x = torch.randn(4, 32, device=DEV, dtype=torch.float16)
    w = torch.ones(32, device=DEV)
    with pytest.raises(RuntimeError, match="gamma/beta dtype is the output dtype"):
        fln.fused_layer_norm_affine_forward(x, [32], w, torch.zeros_like(w), 1e-5)
    with pytest.raises(RuntimeError, match="trailing dims must equal normalized_shape"):
        fln.fused_layer_norm_affine_forward(x, [16], w[:16].half(), w[:16].half(), 1e-5)
    with pytest.raises(RuntimeError, match="beta must have gamma's dtype"):
        fln.fused_layer_norm_affine_forward(x.float(), [32], w, w.half(), 1e-5)


# ------------------------------------------------------------------------------------------------- multi-tensor

SIZES = [1, 1000, 4097 * 3, 0, 65536 + 5] + [37] * 45 + [0]  # > one launch of tensors, empty ones, trailing empty


def ref_adam(g, p, m, v, lr, b1, b2, eps, step, mode, bias_correction, wd, div_scale=-1.0):
    """The float64 step of tests/adam_reference.py in the ported kernels' arguments: mode 0 = L2, 1 = AdamW;
    ColossalAI's div_scale divides the gradients. Returns (p, m, v) on p's device."""
    if div_scale > 0:
        g = g.double() / div_scale
    out = adam_step64(p, g, m, v, step if bias_correction else None, lr, (b1, b2), eps, wd, mode == 1)
    return tuple(t.to(p.device) for t in out)


ADAM_DTYPES = [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
               (torch.float32, torch.bfloat16), (torch.float16, torch.float32)]


@pytest.mark.parametrize("mode", [0, 1], ids=["l2", "adamw"])
@pytest.mark.parametrize("g_dtype,p_dtype", ADAM_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_multi_tensor_adam_matches_float64(adam, g_dtype, p_dtype, mode):
    g, p, m, v = _adam_lists(g_dtype, p_dtype, SIZES)
    refs = [ref_adam(*t, 1e-2, 0.9, 0.999, 1e-8, 3, mode, 1, 0.1, 2.0) for t in zip(g, p, m, v)]
    g_before = [t.clone() for t in g]
    noop = torch.zeros(1, dtype=torch.int32, device=DEV)
    adam.multi_tensor_adam(2048 * 32, noop, g, p, m, v, 1e-2, 0.9, 0.999, 1e-8, 3, mode, 1, 0.1, 2.0)
    assert all(torch.equal(a, b) for a, b in zip(g, g_before)), "grads must not change"
    for i, (rp, rm, rv) in enumerate(refs):
        for got, ref, what in ((p[i], rp, "param"), (m[i], rm, "exp_avg"), (v[i], rv, "exp_avg_sq")):
            torch.testing.assert_close(got.double(), ref, **tol(p_dtype, 2), msg=lambda s: f"{what}[{i}]: {s}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_deepspeed_multi_tensor_adam_matches_float64(ds_adam, dtype):
    g, p, m, v = _adam_lists(dtype, dtype, SIZES, seed=1)
    refs = [ref_adam(*t, 1e-2, 0.9, 0.95, 1e-6, 7, 1, 1, 0.05) for t in zip(g, p, m, v)]
    noop = torch.zeros(1, dtype=torch.int32, device=DEV)
    ds_adam.deepspeed_multi_tensor_adam(2048 * 32, noop, g, p, m, v, 1e-2, 0.9, 0.95, 1e-6, 7, 1, 1, 0.05)
    for i, (rp, rm, rv) in enumerate(refs):
        for got, ref, what in ((p[i], rp, "param"), (m[i], rm, "exp_avg"), (v[i], rv, "exp_avg_sq")):
            torch.testing.assert_close(got.double(), ref, **tol(dtype, 2), msg=lambda s: f"{what}[{i}]: {s}")


def test_multi_tensor_adam_rejects_mixed_lists(adam):
    g, p, m, v = _adam_lists(torch.float32, torch.float32, [10, 20])
    noop = torch.zeros(1, dtype=torch.int32, device=DEV)
    with pytest.raises(RuntimeError, match="every tensor of params must have one dtype"):
        adam.multi_tensor_adam(2048, noop, g, [p[0], p[1].half()], m, v, 1e-3, .9, .999, 1e-8, 1, 1, 1, 0., -1.)
    with pytest.raises(RuntimeError, match="float16 and bfloat16 do not mix"):
        adam.multi_tensor_adam(2048, noop, [t.half() for t in g], [t.bfloat16() for t in p],
                               [t.bfloat16() for t in m], [t.bfloat16() for t in v], 1e-3, .9, .999, 1e-8, 1, 1, 1,
                               0., -1.)
    with pytest.raises(RuntimeError, match="step must be in \\[1"):
        adam.multi_tensor_adam(2048, noop, g, p, m, v, 1e-3, .9, .999, 1e-8, 0, 1, 1, 0., -1.)
    with pytest.raises(RuntimeError, match="exp_avgs has 1 tensors but grads has 2"):
        adam.multi_tensor_adam(2048, noop, g, p, m[:1], v, 1e-3, .9, .999, 1e-8, 1, 1, 1, 0., -1.)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_multi_tensor_l2norm_matches_float64(l2norm, dtype, per_tensor):
    ts = [torch.randn(n, device=DEV).to(dtype) for n in SIZES]
    noop = torch.zeros(1, dtype=torch.int32, device=DEV)
    norm, norms = l2norm.multi_tensor_l2norm(2048 * 32, noop, ts, per_tensor)
    ref = torch.linalg.vector_norm(torch.cat([t.double() for t in ts]))
    assert norm.shape == (1,) and norm.dtype == torch.float32
    torch.testing.assert_close(norm.double()[0], ref, **tol(torch.float32, 10))
    if per_tensor:
        ref_each = torch.stack([torch.linalg.vector_norm(t.double()) for t in ts])
        torch.testing.assert_close(norms.double(), ref_each, **tol(torch.float32, 10))
    else:
        assert norms.numel() == 0
    assert noop.item() == 0
    ts[2][7] = float("inf")
    l2norm.multi_tensor_l2norm(2048 * 32, noop, ts, per_tensor)
    assert noop.item() == 1, "a non-finite value must set the noop flag"


def test_multi_tensor_l2norm_rejects_bfloat16(l2norm):
    noop = torch.zeros(1, dtype=torch.int32, device=DEV)
    with pytest.raises(RuntimeError, match="tensors must be one of Float, Half"):
        l2norm.multi_tensor_l2norm(2048, noop, [torch.randn(4, device=DEV, dtype=torch.bfloat16)], False)


@pytest.mark.parametrize("src_dtype,dst_dtype", [(torch.float32, torch.float32), (torch.float32, torch.float16),
                                                 (torch.float16, torch.float32), (torch.float16, torch.float16)],
                         ids=lambda d: str(d).replace("torch.", ""))
def test_multi_tensor_scale_matches_float64(mtscale, src_dtype, dst_dtype):
    src = [torch.randn(n, device=DEV).to(src_dtype) for n in SIZES]
    dst = [torch.full((n,), float("nan"), device=DEV, dtype=dst_dtype) for n in SIZES]
    noop = torch.zeros(1, dtype=torch.int32, device=DEV)
    mtscale.multi_tensor_scale(2048 * 32, noop, src, dst, 0.37)
    for i, (s, d) in enumerate(zip(src, dst)):
        assert_all_written(d, f"dst[{i}]")
        torch.testing.assert_close(d.double(), s.double() * 0.37, **tol(dst_dtype))
    assert noop.item() == 0
    # In place (dst is src), and the inf/nan flag.
    src[1][3] = float("inf")
    mtscale.multi_tensor_scale(2048 * 32, noop, src, src, 2.0)
    assert noop.item() == 1
