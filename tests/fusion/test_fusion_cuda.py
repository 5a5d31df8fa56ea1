"""GPU: every implementation of every fused op against float64 references, forward and backward, plus the
issue's must-hold cases. Run on the GPU machine (kernels build on first use; prebuilding saves time):

    python -m pipegoose.kernels build --all && python -m pytest -m cuda tests/fusion -q

Each test names the implementation it wants and then asserts, from the dispatcher's counters, that this very
implementation ran: a test that would also pass on the PyTorch fallback is a defect.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from adam_reference import adam_state, adam_step64
from softmax_reference import softmax_ref
from tolerances import DOUBLE_BACKWARD_GRAD_SCALE, DOUBLE_BACKWARD_HVP_SCALE, TOLERANCES, tol

from pipegoose.nn.fusion import FusedAdam, clip_grad_norm_, dispatch
from pipegoose.nn.fusion import functional as PF
from pipegoose.nn.fusion.modules import AttnMaskType, FusedLayerNorm, FusedRMSNorm, FusedScaleMaskSoftmax

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("no_tuning_table")]
DEV = "cuda"
HALF = [torch.float16, torch.bfloat16]
ALL = [torch.float32, torch.float16, torch.bfloat16]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_env_overrides(monkeypatch):
    """The user's PIPEGOOSE_IMPL_* and PIPEGOOSE_STRICT set aside (the dispatcher's state: conftest's _fresh_stats)."""
    for k in list(os.environ):
        if k.startswith("PIPEGOOSE_IMPL_") or k == "PIPEGOOSE_STRICT":
            monkeypatch.delenv(k)


def poison(*like: torch.Tensor, copies: int = 3) -> None:
    """Fill free blocks of the caching allocator of the sizes of ``like`` with NaN bytes (0xFF is NaN in fp32,
    fp16 and bf16), so that an output element a kernel fails to write shows up as NaN."""
    keep = []
    for t in like:
        for _ in range(copies):
            keep.append(torch.full((t.numel() * t.element_size(),), 255, dtype=torch.uint8, device=DEV))
    torch.cuda.synchronize()
    del keep


def ran(op: str, impl: str, calls: int = 1) -> None:
    got = dispatch.stats().get(op, {})
    assert got == {impl: calls}, f"{op}: expected {impl} x{calls} to run, dispatcher counted {got}; " \
                                 f"last choice: {dispatch.last_choice(op)}"


# --- softmax -------------------------------------------------------------------------------------------------

def softmax_ref64(x, mask, scale, causal):
    return softmax_ref(x.double(), mask, scale, causal)


def softmax_bwd_ref64(y64, dy, scale):
    dy = dy.double()
    return scale * y64 * (dy - (dy * y64).sum(-1, keepdim=True))


def run_softmax(fn, x, dy):
    xr = x.detach().clone().requires_grad_(True)
    poison(x)
    y = fn(xr)
    poison(x)
    y.backward(dy)
    torch.cuda.synchronize()
    return y.detach(), xr.grad.detach()


def check_softmax(y, dx, x, dy, mask, scale, causal, dtype):
    assert y.dtype == dtype and dx.dtype == dtype
    assert not y.isnan().any(), "output has unwritten (NaN-poisoned) elements"
    assert not dx.isnan().any(), "gradient has unwritten (NaN-poisoned) elements"
    y64 = softmax_ref64(x, mask, scale, causal)
    torch.testing.assert_close(y.double(), y64, **TOLERANCES[dtype])
    t = TOLERANCES[dtype]
    torch.testing.assert_close(dx.double(), softmax_bwd_ref64(y64, dy, scale), atol=t["atol"] * 4, rtol=t["rtol"])


MASKED_CASES = [  # (shape, mask shape, megatron takes it)
    ((4, 12, 24, 24), (4, 1, 24, 24), True),     # short keys (Megatron-LM#132 regression)
    ((4, 12, 24, 24), (1, 1, 24, 24), True),
    ((2, 3, 16, 128), (2, 1, 1, 128), True),     # HF padding mask [b, 1, 1, sk]
    ((2, 2, 8, 2048), (2, 1, 8, 2048), True),
    ((3, 5, 7, 13), (3, 1, 7, 13), False),       # odd: sq not a multiple of batches_per_block
    ((2, 3, 16, 130), (2, 1, 16, 130), False),   # sk % 4 != 0 with 4-wide vector accesses
    ((1, 2, 4, 3000), (1, 1, 4, 3000), False),   # sk > 2048
]


@pytest.mark.parametrize("impl", ["pipegoose", "megatron", "torch"])
@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("shape,mshape,megatron_ok", MASKED_CASES)
def test_scaled_masked_softmax_every_impl(impl, dtype, shape, mshape, megatron_ok):
    if impl == "megatron" and (dtype == torch.float32 or not megatron_ok):
        pytest.skip("the Megatron copy does not take this input (routing is tested separately)")
    g = torch.Generator(device=DEV).manual_seed(shape[-1] * 7 + shape[-2])
    x = (torch.randn(shape, generator=g, device=DEV) * 3).to(dtype)
    dy = torch.randn(shape, generator=g, device=DEV).to(dtype)
    mask = torch.rand(mshape, generator=g, device=DEV) < 0.3
    if mshape[2] > 1:
        mask[..., 1, :] = True  # a fully masked row
    scale = 0.125  # exact in fp16/bf16: the Megatron copy rounds its forward scale to the input dtype
    y, dx = run_softmax(lambda t: PF.scaled_masked_softmax(t, mask, scale, impl=impl), x, dy)
    ran("softmax.masked", impl)
    check_softmax(y, dx, x, dy, mask, scale, False, dtype)
    if mshape[2] > 1:
        assert torch.count_nonzero(y[:, :, 1]) == 0 and torch.count_nonzero(dx[:, :, 1]) == 0


CAUSAL_CASES = [((48, 24, 24), True), ((16, 128, 128), True), ((8, 2048, 2048), True), ((6, 7, 7), False),
                ((4, 130, 130), False), ((2, 3000, 3000), False)]


@pytest.mark.parametrize("impl", ["pipegoose", "megatron", "torch"])
@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("shape,megatron_ok", CAUSAL_CASES)
def test_causal_softmax_every_impl(impl, dtype, shape, megatron_ok):
    if impl == "megatron" and (dtype == torch.float32 or not megatron_ok):
        pytest.skip("the Megatron copy does not take this input (routing is tested separately)")
    g = torch.Generator(device=DEV).manual_seed(shape[0] + shape[-1])
    x = (torch.randn(shape, generator=g, device=DEV) * 3).to(dtype)
    dy = torch.randn(shape, generator=g, device=DEV).to(dtype)
    y, dx = run_softmax(lambda t: PF.scaled_upper_triang_masked_softmax(t, 0.5, impl=impl), x, dy)
    ran("softmax.causal", impl)
    check_softmax(y, dx, x, dy, None, 0.5, True, dtype)


SCALED_CASES = [((2, 4, 32, 96), True),
                ((3, 5, 7, 13), False),      # odd: sq not a multiple of batches_per_block, sk odd
                ((2, 3, 16, 130), False)]    # sk % 4 != 0 with 4-wide vector accesses


@pytest.mark.parametrize("impl", ["pipegoose", "megatron", "torch"])
@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("shape,megatron_ok", SCALED_CASES)
def test_scaled_softmax_every_impl(impl, dtype, shape, megatron_ok):
    if impl == "megatron" and (dtype == torch.float32 or not megatron_ok):
        pytest.skip("the Megatron copy does not take this input (routing is tested separately)")
    g = torch.Generator(device=DEV).manual_seed(sum(shape))
    x = torch.randn(shape, generator=g, device=DEV).to(dtype)
    dy = torch.randn(shape, generator=g, device=DEV).to(dtype)
    y, dx = run_softmax(lambda t: PF.scaled_softmax(t, 2.0, impl=impl), x, dy)
    ran("softmax", impl)
    check_softmax(y, dx, x, dy, None, 2.0, False, dtype)


@pytest.mark.parametrize("impl", ["pipegoose", "megatron", "torch"])
@pytest.mark.parametrize("dtype", ALL)
def test_forward_mode_ad_every_softmax_impl(impl, dtype):
    """torch.autograd.forward_ad through the fused Functions (their jvp runs the backward kernel on the tangent: the
    softmax Jacobian is symmetric), padding-masked with a fully masked row and causal, against float64."""
    import torch.autograd.forward_ad as fwAD

    if impl == "megatron" and dtype == torch.float32:
        pytest.skip("the Megatron copy takes fp16/bf16 only")
    g = torch.Generator(device=DEV).manual_seed(11)
    x = (torch.randn(2, 4, 16, 128, generator=g, device=DEV) * 3).to(dtype)
    t = torch.randn(2, 4, 16, 128, generator=g, device=DEV).to(dtype)
    mask = torch.rand(2, 1, 16, 128, generator=g, device=DEV) < 0.3
    mask[:, :, 1] = True
    # causal: [attn_batches, sq, sk] with attn_batches a multiple of the Megatron copy's batches per block (16 at
    # 16 keys), so that the copy takes it instead of handing it to the next implementation
    xc = (torch.randn(32, 16, 16, generator=g, device=DEV) * 3).to(dtype)
    tc = torch.randn(32, 16, 16, generator=g, device=DEV).to(dtype)
    for fn, xx, tt, m, causal, op in (
            (lambda v: PF.scaled_masked_softmax(v, mask, 0.125, impl=impl), x, t, mask, False, "softmax.masked"),
            (lambda v: PF.scaled_upper_triang_masked_softmax(v, 0.125, impl=impl), xc, tc, None, True,
             "softmax.causal")):
        with fwAD.dual_level():
            tan = fwAD.unpack_dual(fn(fwAD.make_dual(xx, tt))).tangent
        ran(op, impl)
        dispatch.reset_stats()
        y64 = softmax_ref64(xx, m, 0.125, causal)
        tl = TOLERANCES[dtype]
        torch.testing.assert_close(tan.double(), softmax_bwd_ref64(y64, tt, 0.125), atol=tl["atol"] * 4,
                                   rtol=tl["rtol"])


@pytest.mark.parametrize("dtype", ALL)
def test_forward_mode_ad_through_the_norms_takes_the_reference(dtype):
    """The fused norms have no forward derivative (the C++ autograd Function has no jvp): a dual tensor
    (torch.autograd.forward_ad) raised where F.layer_norm / F.rms_norm work. It now runs the reference, whose
    tangent is PyTorch's, also after an eager call cached the kernel choice for the same metadata; outside the dual
    level the kernel runs again."""
    import torch.autograd.forward_ad as fwAD

    g = torch.Generator(device=DEV).manual_seed(12)
    x = torch.randn(64, 1024, generator=g, device=DEV).to(dtype)
    t = torch.randn(64, 1024, generator=g, device=DEV).to(dtype)
    w = torch.randn(1024, generator=g, device=DEV).to(dtype)
    for op, fn, ref in (("layer_norm", lambda v: PF.layer_norm(v, (1024,), w, w, 1e-5),
                         lambda v: F.layer_norm(v, (1024,), w, w, 1e-5)),
                        ("rms_norm", lambda v: PF.rms_norm(v, (1024,), w, 1e-6),
                         lambda v: F.rms_norm(v, (1024,), w, 1e-6))):
        fn(x)
        assert dispatch.last_choice(op).impl == "pipegoose"
        with fwAD.dual_level():
            tangent = fwAD.unpack_dual(fn(fwAD.make_dual(x, t))).tangent
            assert dispatch.last_choice(op).impl == "torch"
            want = fwAD.unpack_dual(ref(fwAD.make_dual(x, t))).tangent
        torch.testing.assert_close(tangent, want, **TOLERANCES[dtype])
        fn(x)
        assert dispatch.last_choice(op).impl == "pipegoose"


def test_compiled_softmax_under_cuda_autocast_matches_eager():
    """Under CUDA autocast the scaled softmaxes give fp32 for 16-bit scores (F.softmax's rule); compiled, they emit the
    reference with that rule written out (no dispatcher in the graph): the same dtype and values as the eager call."""
    x = torch.randn(2, 4, 64, 64, device=DEV, dtype=torch.float16)
    mask = torch.rand(2, 1, 64, 64, device=DEV) < 0.3

    def f(t):
        return PF.scaled_masked_softmax(t, mask, 0.125)

    with torch.autocast("cuda", dtype=torch.float16):
        want = f(x)
        import torch._dynamo as dynamo

        dynamo.reset()
        got = torch.compile(f, backend="eager")(x)
    assert want.dtype == got.dtype == torch.float32
    torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])


def test_must_hold_short_keys_fp16_padding_mask_auto():
    x = torch.randn(4, 12, 24, 24, device=DEV, dtype=torch.float16)
    dy = torch.randn_like(x)
    mask = torch.rand(4, 1, 24, 24, device=DEV) < 0.25
    with dispatch.strict():
        y, dx = run_softmax(lambda t: PF.scaled_masked_softmax(t, mask, 0.125), x, dy)
    assert dispatch.last_choice("softmax.masked").impl != "torch"
    check_softmax(y, dx, x, dy, mask, 0.125, False, torch.float16)


def test_must_hold_causal_48x24x24_fp16_auto():
    x = torch.randn(48, 24, 24, device=DEV, dtype=torch.float16)
    dy = torch.randn_like(x)
    with dispatch.strict():
        y, dx = run_softmax(lambda t: PF.scaled_upper_triang_masked_softmax(t, 0.125), x, dy)
    assert dispatch.last_choice("softmax.causal").impl != "torch"
    check_softmax(y, dx, x, dy, None, 0.125, True, torch.float16)


def test_must_hold_causal_bf16_4096_routes_around_megatron():
    b, s = 32, 4096
    x = torch.randn(b, s, s, device=DEV, dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    scale = 0.125
    choice = dispatch.explain("softmax.causal", x, scale=scale, impl="megatron")
    assert choice.impl == "pipegoose", str(choice)
    assert "2048" in choice.reasons["megatron"]
    with dispatch.strict():
        xr = x.clone().requires_grad_(True)
        with pytest.warns(UserWarning, match=r"impl='megatron' cannot run this input: key length 4096 outside "
                                             r"\[1, 2048\].*running pipegoose"):
            y = PF.scaled_upper_triang_masked_softmax(xr, scale, impl="megatron")  # asked for it: routed, not crashed
        y.backward(dy)
    ran("softmax.causal", "pipegoose")
    assert not y.isnan().any() and not xr.grad.isnan().any()
    t = TOLERANCES[torch.bfloat16]
    for i in range(0, b, 4):  # float64 reference in slices (4 GiB per full tensor)
        y64 = softmax_ref64(x[i:i + 4], None, scale, True)
        torch.testing.assert_close(y[i:i + 4].double(), y64, **t)
        torch.testing.assert_close(xr.grad[i:i + 4].double(), softmax_bwd_ref64(y64, dy[i:i + 4], scale),
                                   atol=t["atol"] * 4, rtol=t["rtol"])
        del y64


def test_megatron_routing_reasons():
    x = torch.randn(2, 2, 16, 130, device=DEV, dtype=torch.float16)
    m = torch.zeros(2, 1, 16, 130, dtype=torch.bool, device=DEV)
    assert "multiple of 4" in dispatch.explain("softmax.masked", x, m, scale=0.125).reasons["megatron"]
    x = torch.randn(2, 2, 16, 64, device=DEV, dtype=torch.bfloat16)
    m = torch.zeros(2, 1, 16, 64, dtype=torch.bool, device=DEV)
    assert "representable" in dispatch.explain("softmax.masked", x, m, scale=0.1).reasons["megatron"]
    assert dispatch.explain("softmax.masked", x, m, scale=0.125, impl="megatron").impl == "megatron"
    x = torch.randn(2, 2, 1, 64, device=DEV, dtype=torch.bfloat16)  # decode step, sq = 1
    assert "sq=1" in dispatch.explain("softmax.masked", x, m[:, :, :1], scale=0.125).reasons["megatron"]


def test_get_batch_per_block_matches_kernel():
    ops, why = dispatch.kernel("megatron/scaled_masked_softmax")
    assert ops is not None, why
    for sk in (1, 2, 16, 33, 64, 100, 128, 129, 512, 2048):
        assert FusedScaleMaskSoftmax.get_batch_per_block(64, sk, 2, 4) == \
            ops.scaled_masked_softmax_get_batch_per_block(64, sk, 2, 4)


@pytest.mark.parametrize("kind", [AttnMaskType.padding, AttnMaskType.causal])
def test_fused_scale_mask_softmax_module_uses_a_kernel(kind):
    x = torch.randn(2, 4, 32, 32, device=DEV, dtype=torch.float16)
    mask = (torch.rand(2, 1, 32, 32, device=DEV) < 0.2) if kind == AttnMaskType.padding else None
    m = FusedScaleMaskSoftmax(True, False, kind, True, None, True, 0.125)
    assert m.is_kernel_available(mask, 2, 4, 32, 32)
    y = m(x, mask)
    op = "softmax.causal" if kind == AttnMaskType.causal else "softmax.masked"
    assert set(dispatch.stats()[op]) <= {"pipegoose", "megatron"}
    torch.testing.assert_close(y.double(), softmax_ref64(x, mask, 0.125, kind == AttnMaskType.causal),
                               **TOLERANCES[torch.float16])


@pytest.mark.parametrize("kind", [AttnMaskType.padding, AttnMaskType.causal])
def test_fused_scale_mask_softmax_forward_fused_softmax_equals_forward(kind):
    """Megatron's public forward_fused_softmax gives forward's result on the GPU, also where no fused kernel takes the
    scores (a causal module given a padding mask: the PyTorch path, which had dropped the padding mask)."""
    x = torch.randn(2, 4, 48, 48, device=DEV, dtype=torch.bfloat16) * 3
    mask = torch.rand(2, 1, 48, 48, device=DEV) < 0.3
    mask[1, 0, 5] = True   # a fully masked row
    m = FusedScaleMaskSoftmax(False, True, kind, True, None, True, 0.125)
    y = m.forward_fused_softmax(x, mask)
    torch.testing.assert_close(y, m(x, mask))
    torch.testing.assert_close(y.double(), softmax_ref64(x, mask, 0.125, kind == AttnMaskType.causal),
                               **TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("kind", [AttnMaskType.padding, AttnMaskType.causal])
def test_fused_scale_mask_softmax_under_autocast_runs_the_16bit_kernel(kind):
    """Under CUDA autocast the module's fused path went through the functional op, which computes softmax in fp32
    there: a cast of the scores to fp32, an fp32 kernel and a cast of the probabilities back. It now runs the 16-bit
    kernel it chose on the scores as given (as Megatron's do): no cast, the same probabilities and gradients."""
    x = (torch.randn(2, 4, 64, 64, device=DEV, dtype=torch.float16) * 3).requires_grad_()
    mask = (torch.rand(2, 1, 64, 64, device=DEV) < 0.2) if kind == AttnMaskType.padding else None
    causal = kind == AttnMaskType.causal
    m = FusedScaleMaskSoftmax(True, False, kind, True, None, True, 0.125)
    dy = torch.randn(2, 4, 64, 64, device=DEV, dtype=torch.float16)
    with torch.autocast("cuda", dtype=torch.float16):
        m(x, mask)  # the choice is made (and cached) outside the profile
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            y = m(x, mask)
    casts = [e.name for e in prof.events() if e.name in ("aten::to", "aten::_to_copy", "aten::copy_")]
    assert casts == []
    assert y.dtype == torch.float16
    op = "softmax.causal" if causal else "softmax.masked"
    assert dispatch.last_choice(op).impl in ("pipegoose", "megatron")
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    y64 = softmax_ref64(x64, mask, 0.125, causal)
    y64.backward(dy.double())
    torch.testing.assert_close(y.double(), y64.detach(), **TOLERANCES[torch.float16])
    torch.testing.assert_close(x.grad.double(), x64.grad, **TOLERANCES[torch.float16])


def test_plain_softmax_fused_fp32_is_allclose_to_F_softmax():
    """The fused fp32 path of the drop-in softmax: within torch.allclose's defaults of F.softmax (its documented
    promise), and against float64 forward and backward at the fp32 tolerances of the table; a row of all -inf is NaN
    as F.softmax's is."""
    g = torch.Generator(device=DEV).manual_seed(64)
    x = torch.randn(64, 1000, generator=g, device=DEV) * 5
    x[3] = float("-inf")
    dy = torch.randn(64, 1000, generator=g, device=DEV)
    y, dx = run_softmax(lambda t: PF.softmax(t, -1), x, dy)   # (NaN-poisoned before the forward and the backward)
    ran("softmax", "pipegoose")
    rows = torch.arange(64, device=DEV) != 3
    ref = F.softmax(x, -1)
    assert torch.allclose(y[rows], ref[rows])
    assert y[3].isnan().all() and ref[3].isnan().all()
    assert not y[rows].isnan().any() and not dx[rows].isnan().any(), "unwritten (NaN-poisoned) elements"
    y64 = softmax_ref64(x[rows], None, 1.0, False)
    torch.testing.assert_close(y[rows].double(), y64, **TOLERANCES[torch.float32])
    torch.testing.assert_close(dx[rows].double(), softmax_bwd_ref64(y64, dy[rows], 1.0), **TOLERANCES[torch.float32])
    PF.softmax(x.half(), -1)
    assert dispatch.stats()["softmax"] == {"pipegoose": 1, "torch": 1}


def test_softmax_under_cuda_autocast_follows_torch():
    x = torch.randn(2, 4, 16, 64, device=DEV, dtype=torch.float16)
    mask = torch.rand(2, 1, 16, 64, device=DEV) < 0.2
    with torch.autocast("cuda", dtype=torch.float16):
        want = F.softmax(x, -1).dtype
        y = PF.scaled_masked_softmax(x, mask, 0.125)
    assert y.dtype == want
    assert dispatch.last_choice("softmax.masked").impl == "pipegoose"


# --- layer norm -----------------------------------------------------------------------------------------------

def ln_ref64(x, shape, w, b, eps):
    dims = tuple(range(x.dim() - len(shape), x.dim()))
    x = x.double()
    mu = x.mean(dims, keepdim=True)
    y = (x - mu) / torch.sqrt(((x - mu) ** 2).mean(dims, keepdim=True) + eps)
    if w is not None:
        y = y * w.double()
    if b is not None:
        y = y + b.double()
    return y


def run_with_grads(fn, tensors, dy):
    ts = [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]
    given = [t for t in ts if t is not None]
    # the output has the input's shape, in a dtype no wider than the inputs' promoted one (cast_before_weight): NaN
    # blocks of that size (a meta tensor: only its size is read) and of the inputs', so that the forward is poisoned too
    out_like = torch.empty(ts[0].shape, dtype=functools.reduce(torch.promote_types, [t.dtype for t in given]),
                           device="meta")
    poison(out_like, *given)
    y = fn(*ts)
    poison(*given)   # (the gradients have the inputs' shapes and dtypes)
    y.backward(dy.to(y.dtype))
    torch.cuda.synchronize()
    return y.detach(), [None if t is None else t.grad for t in ts]


def check_norm(y, gs, y64, g64s, low):
    assert not y.isnan().any()
    torch.testing.assert_close(y.double(), y64, **tol(low, 2))
    for i, (g, g64) in enumerate(zip(gs, g64s)):
        if g64 is None:
            continue
        assert not g.isnan().any(), f"grad {i} has unwritten elements"
        # dx (i == 0): several roundings (x_hat and the two row means of w * dy recomputed in fp32, a difference of
        # terms larger than dx where they cancel, then one rounding to the low dtype): 4x one rounding; the weight
        # and bias gradients: sums over all rows (up to 4099 here) in fp32, whose error grows with the rows, then one
        # rounding to the parameter's dtype: 16x
        torch.testing.assert_close(g.double(), g64, **tol(low, 4 if i == 0 else 16))


LN_CASES = [((8, 1024), (1024,)), ((3, 7, 33), (33,)), ((2, 5, 4, 96), (4, 96)), ((1, 1), (1,)),
            ((4, 65536), (65536,)), ((4099, 4096), (4096,))]


@pytest.mark.parametrize("impl", ["pipegoose", "apex", "torch"])
@pytest.mark.parametrize("xdt", ALL)
@pytest.mark.parametrize("shape,nshape", LN_CASES)
@pytest.mark.parametrize("affine", ["wb", "w", "none"])
def test_layer_norm_every_impl(impl, xdt, shape, nshape, affine):
    g = torch.Generator(device=DEV).manual_seed(sum(shape))
    x = torch.randn(shape, generator=g, device=DEV).mul(2).add(0.3).to(xdt)
    w = torch.randn(nshape, generator=g, device=DEV).to(xdt) if affine != "none" else None
    b = torch.randn(nshape, generator=g, device=DEV).to(xdt) if affine == "wb" else None
    dy = torch.randn(shape, generator=g, device=DEV)
    y, gs = run_with_grads(lambda a, c, d: PF.layer_norm(a, nshape, c, d, 1e-5, impl=impl), [x, w, b], dy)
    ran("layer_norm", impl)
    assert y.dtype == xdt
    y64, g64s = run_with_grads(lambda a, c, d: ln_ref64(a, nshape, c, d, 1e-5),
                               [x.double(), None if w is None else w.double(), None if b is None else b.double()],
                               dy.to(y.dtype).double())  # the gradient the op received
    check_norm(y, gs, y64, g64s, xdt)


@pytest.mark.parametrize("xdt", HALF)
def test_must_hold_layer_norm_half_input_fp32_params_no_autocast(xdt):
    """apex#1379: fp16 input with fp32 weight/bias. The Apex copy would reject or round the weight; the
    dispatcher must route it and the result must be right, in the input's dtype (what torch.nn.LayerNorm returns on
    the CPU; torch's CUDA layer_norm rejects these mixed dtypes outright)."""
    x = torch.randn(64, 1024, device=DEV).to(xdt)
    w = torch.randn(1024, device=DEV)
    b = torch.randn(1024, device=DEV)
    dy = torch.randn(64, 1024, device=DEV)
    choice = dispatch.explain("layer_norm", x, (1024,), w, b, impl="apex")
    assert "apex#1379" in choice.reasons["apex"] and choice.impl == "pipegoose", str(choice)
    with dispatch.strict(), pytest.warns(UserWarning, match=r"impl='apex' cannot run this input.*apex#1379"):
        y, gs = run_with_grads(lambda a, c, d: PF.layer_norm(a, 1024, c, d, impl="apex"), [x, w, b], dy)
    ran("layer_norm", "pipegoose")
    assert y.dtype == torch.nn.functional.layer_norm(x.cpu(), (1024,), w.cpu(), b.cpu()).dtype == xdt
    assert gs[1].dtype == gs[2].dtype == torch.float32
    y64, g64s = run_with_grads(lambda a, c, d: ln_ref64(a, (1024,), c, d, 1e-5),
                               [x.double(), w.double(), b.double()], dy.to(y.dtype).double())
    check_norm(y, gs, y64, g64s, xdt)


def test_layer_norm_under_cuda_autocast_matches_nn_layernorm():
    ref = torch.nn.LayerNorm(512, device=DEV)
    f = FusedLayerNorm.from_layer_norm(ref)
    x = torch.randn(16, 512, device=DEV, dtype=torch.float16)
    with torch.autocast("cuda", dtype=torch.float16):
        want = ref(x)
        got = f(x)
    assert got.dtype == want.dtype == torch.float32
    assert dispatch.last_choice("layer_norm").impl in ("pipegoose", "apex")
    torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("frozen", ["weight", "bias", "both"])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_frozen_norm_parameters_get_no_gradient_computed(op, frozen):
    """A frozen parameter (requires_grad False: LoRA, a frozen backbone) got its gradient computed by the backward
    kernel and dropped. Now the C++ autograd formula asks the backward op for the gradients that are needed only: the
    others stay None, the rest equal the full backward's bit for bit, and with every parameter frozen no column
    reduction runs (torch.profiler)."""
    if op == "rms_norm" and frozen == "bias":
        pytest.skip("RMSNorm has no bias")
    g = torch.Generator(device=DEV).manual_seed(5)
    x = torch.randn(4096, 1024, generator=g, device=DEV).to(torch.bfloat16)
    w = torch.randn(1024, generator=g, device=DEV)
    b = torch.randn(1024, generator=g, device=DEV)
    dy = torch.randn(x.shape, generator=g, device=DEV).to(torch.bfloat16)

    def step(train_w, train_b):
        xs, ws, bs = (t.detach().clone().requires_grad_(r) for t, r in ((x, True), (w, train_w), (b, train_b)))
        if op == "layer_norm":
            y = PF.layer_norm(xs, (1024,), ws, bs, 1e-5, impl="pipegoose")
        else:
            y = PF.rms_norm(xs, (1024,), ws, 1e-6, impl="pipegoose")
        y.backward(dy)
        return xs.grad, ws.grad, bs.grad

    full = step(True, True)
    got = step(frozen == "bias", frozen == "weight")
    torch.testing.assert_close(got[0], full[0], rtol=0, atol=0)
    if frozen in ("weight", "both"):
        assert got[1] is None
    else:
        torch.testing.assert_close(got[1], full[1], rtol=0, atol=0)
    if op == "layer_norm":
        if frozen in ("bias", "both"):
            assert got[2] is None
        else:
            torch.testing.assert_close(got[2], full[2], rtol=0, atol=0)
    if frozen == "both":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step(False, False)
            torch.cuda.synchronize()
        names = {e.key for e in prof.key_averages()}
        assert not any("col_reduce" in n for n in names) and any("norm_bwd" in n for n in names), names


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_norm_autograd_runs_in_cpp(op):
    """impl=pipegoose: the graph's node is the C++ Function of ``pipegoose::<op>`` (a Python autograd.Function cost
    22-48 us of host time per forward, which made fused mid-size models slower), its gradients are the kernels'
    (the same as the backward op's), and in inference mode, below autograd, the op's forward alone gives the same
    output."""
    g = torch.Generator(device=DEV).manual_seed(3)
    x = torch.randn(6, 40, 96, generator=g, device=DEV).to(torch.bfloat16).requires_grad_(True)
    w = torch.randn(96, generator=g, device=DEV).requires_grad_(True)
    b = torch.randn(96, generator=g, device=DEV).requires_grad_(True)
    if op == "layer_norm":
        def fn(a):
            return PF.layer_norm(a, (96,), w, b, 1e-5, impl="pipegoose")
    else:
        def fn(a):
            return PF.rms_norm(a, (96,), w, 1e-6, impl="pipegoose")
    y = fn(x)
    node = {"layer_norm": "pipegoose::LayerNormFunction", "rms_norm": "pipegoose::RMSNormFunction"}[op]
    assert node in y.grad_fn.name(), y.grad_fn.name()
    dy = torch.randn(y.shape, generator=g, device=DEV).to(y.dtype)
    y.backward(dy)
    ops = dispatch.kernel(f"pipegoose/{op}")[0]
    with torch.no_grad():
        if op == "layer_norm":
            _, mean, rstd = ops.layer_norm_forward(x, w, b, 1e-5, y.dtype)
            want = ops.layer_norm_backward(dy, x, w, b, mean, rstd)
        else:
            _, rstd = ops.rms_norm_forward(x, w, 1e-6, y.dtype)
            want = ops.rms_norm_backward(dy, x, w, rstd)
    for got, exp in zip((x.grad, w.grad, b.grad), want):
        torch.testing.assert_close(got, exp, rtol=0, atol=0)
    # below autograd the op's CUDA kernel calls the forward directly; through the Function, the forward op is
    # dispatched (and profiled) on its own
    def events(grad):
        with torch.inference_mode(not grad), torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = fn(x if grad else x.detach())
        return out, {e.name for e in prof.events()}

    _, seen = events(True)
    assert f"pipegoose::{op}" in seen and f"pipegoose::{op}_forward" in seen, seen
    yi, seen = events(False)
    assert f"pipegoose::{op}" in seen and f"pipegoose::{op}_forward" not in seen, seen
    assert yi.grad_fn is None
    torch.testing.assert_close(yi, y.detach(), rtol=0, atol=0)
    ran(op, "pipegoose", 3)


# --- rms norm -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["pipegoose", "torch"])
@pytest.mark.parametrize("xdt", ALL)
@pytest.mark.parametrize("wdt", ["same", torch.float32])
@pytest.mark.parametrize("cast_before_weight", [False, True])
@pytest.mark.parametrize("shape", [(8, 4096), (3, 7, 33), (5, 1), (4, 65536)])
def test_rms_norm_every_impl(impl, xdt, wdt, cast_before_weight, shape):
    wdt = xdt if wdt == "same" else wdt
    h = shape[-1]
    g = torch.Generator(device=DEV).manual_seed(h)
    x = torch.randn(shape, generator=g, device=DEV).to(xdt)
    w = torch.randn(h, generator=g, device=DEV).to(wdt)
    dy = torch.randn(shape, generator=g, device=DEV)
    fn = lambda a, c: PF.rms_norm(a, h, c, 1e-6, cast_before_weight=cast_before_weight, impl=impl)  # noqa: E731
    y, gs = run_with_grads(fn, [x, w], dy)
    ran("rms_norm", impl)
    assert y.dtype == (torch.promote_types(xdt, wdt) if cast_before_weight else xdt)

    def ref(a, c):
        a = a.double()
        return a / torch.sqrt((a * a).mean(-1, keepdim=True) + 1e-6) * c.double()

    y64, g64s = run_with_grads(ref, [x.double(), w.double()], dy.to(y.dtype).double())
    check_norm(y, gs, y64, g64s, xdt if xdt != torch.float32 else wdt)


def test_rms_norm_llama_module_fused():
    """FusedRMSNorm from transformers' LlamaRMSNorm (fp32 weight, bf16 input: the normalized value rounded to bf16,
    then multiplied by the weight in fp32): the same output as Llama's module, and output and gradients (input and
    weight) against float64 autograd on the same inputs, NaN-poisoned before the forward and the backward."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    g = torch.Generator(device=DEV).manual_seed(2048)
    m = llama.LlamaRMSNorm(2048, eps=1e-6).to(DEV)
    with torch.no_grad():
        m.weight.normal_(generator=g)
    f = FusedRMSNorm.from_module(m)
    x = torch.randn(4, 16, 2048, generator=g, device=DEV, dtype=torch.bfloat16)
    dy = torch.randn(4, 16, 2048, generator=g, device=DEV)   # (the output is fp32)
    with torch.no_grad():
        want = m(x)
    xr = x.clone().requires_grad_(True)
    poison(torch.empty(x.shape, dtype=torch.float32, device="meta"), x)   # (the output: fp32, x's shape)
    got = f(xr)
    ran("rms_norm", "pipegoose")
    assert got.dtype == want.dtype == torch.float32
    # the kernel's normalized value is rounded to bf16 as Llama's is; at most one bf16 ulp apart there
    torch.testing.assert_close(got.detach(), want, **TOLERANCES[torch.bfloat16])
    poison(x, m.weight)
    got.backward(dy)
    assert m.weight.grad is f.weight.grad and f.weight.grad.dtype == torch.float32

    def ref(a, c):   # Llama's formula in float64 (no rounding of the normalized value)
        return a / torch.sqrt((a * a).mean(-1, keepdim=True) + 1e-6) * c

    y64, g64s = run_with_grads(ref, [x.double(), m.weight.detach().double()], dy.double())
    # (the same bounds as the other RMSNorm tests: the output 2 bf16 roundings, dx 4, the weight gradient 16)
    check_norm(got.detach(), [xr.grad, f.weight.grad], y64, g64s, torch.bfloat16)


# --- optimizer ------------------------------------------------------------------------------------------------

def small_model(dtype, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 257), torch.nn.GELU(), torch.nn.LayerNorm(257),
                               torch.nn.Linear(257, 10)).to(DEV, dtype)


def train(model, opt, data, dtype):
    losses = []
    for x, t in data:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x.to(dtype)).float(), t)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses)


@pytest.mark.parametrize("impl", ["pipegoose", "torch_fused", "apex", "deepspeed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_vs_torch_100_steps(impl, dtype, adam_w_mode):
    g = torch.Generator(device=DEV).manual_seed(0)
    data = [(torch.randn(32, 64, generator=g, device=DEV), torch.randn(32, 10, generator=g, device=DEV))
            for _ in range(100)]
    m1, m2 = small_model(dtype), small_model(dtype)
    hp = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    o1 = FusedAdam(m1.parameters(), adam_w_mode=adam_w_mode, impl=impl, **hp)
    o2 = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(m2.parameters(), **hp)
    l1, l2 = train(m1, o1, data, dtype), train(m2, o2, data, dtype)
    ran("adam", impl, 100)
    assert l1[-1] < l1[0]
    if dtype == torch.float32:
        t = tol(torch.float32, 10)
    else:  # the kernel rounds each update once, torch after each op: bf16 parameters drift by a few ulps
        t = tol(torch.bfloat16, 3)
    torch.testing.assert_close(l1, l2, **t)
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p1, p2, **t)
        assert o1.state[p1]["exp_avg"].dtype == dtype and o1.state[p1]["step"].item() == 100


def test_fused_adam_state_dict_with_torch_on_cuda():
    m1 = small_model(torch.float32)
    o1 = FusedAdam(m1.parameters(), lr=1e-3)
    m1(torch.randn(4, 64, device=DEV)).sum().backward()
    o1.step()
    ran("adam", "pipegoose")   # the first of the built-in order (this file sets the tuning table aside)
    o2 = torch.optim.AdamW(m1.parameters(), lr=1e-3)
    o2.load_state_dict(o1.state_dict())
    o3 = FusedAdam(m1.parameters(), lr=1e-3)
    o3.load_state_dict(o2.state_dict())
    o3.step()
    assert all(o3.state[p]["step"].item() == 2 for p in m1.parameters())


# torch's foreach path rounds after each op (v before the update, g + wd * p in L2 mode): in 16 bits it drifts from
# the one-rounding math; it is the reference, compared with torch.optim.Adam itself in test_fusion_optim.py
ADAM_CASES = [(impl, dt) for impl in ("pipegoose", "torch_fused", "apex", "deepspeed") for dt in ALL] + [
    ("torch", torch.float32)]


@pytest.mark.parametrize("impl,dtype", ADAM_CASES)
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_every_adam_impl_against_float64(impl, dtype, adam_w_mode):
    """Each implementation of ``adam`` through FusedAdam: one step from a loaded state (moments given, the step count
    0: this is step 1, where the bias correction with beta2 0.999 scales the update by 0.32, so a wrong step count fails
    in every dtype) over tensors of odd sizes (one element; one past the 65536-element chunk of the ported
    multi-tensor kernels; three of them and a bit) against the float64 math: the parameters and both moments, each
    within one rounding."""
    shapes = [(1,), (2048 * 32 + 5,), (97, 2048 + 3), (3,)]
    p0, gs, m0, v0 = adam_state(shapes, dtype, DEV, seed=11)
    want = [adam_step64(*t, 1, 0.05, (0.9, 0.999), 1e-8, 0.1, adam_w_mode) for t in zip(p0, gs, m0, v0)]
    ps = [torch.nn.Parameter(p.clone()) for p in p0]
    opt = FusedAdam(ps, lr=0.05, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, adam_w_mode=adam_w_mode, impl=impl)
    for p, g, m, v in zip(ps, gs, m0, v0):
        p.grad = g
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    opt.step()
    ran("adam", impl)
    for i, (wp, wm, wv) in enumerate(want):
        st = opt.state[ps[i]]
        assert st["step"].item() == 1
        for got, ref, what in ((ps[i], wp, "param"), (st["exp_avg"], wm, "exp_avg"), (st["exp_avg_sq"], wv, "v")):
            torch.testing.assert_close(got.detach().double().cpu(), ref, **TOLERANCES[dtype],
                                       msg=lambda e: f"{what}[{i}]: {e}")


@pytest.mark.parametrize("dtype,impl,expected", [(torch.float32, None, "pipegoose"), (torch.float16, None, "pipegoose"),
                                                  (torch.bfloat16, None, "pipegoose"), (torch.float32, "apex", "apex"),
                                                  (torch.float16, "apex", "apex"), (torch.bfloat16, "torch", "torch")])
def test_clip_grad_norm_vs_torch(dtype, impl, expected):
    """clip_grad_norm_ against torch.nn.utils.clip_grad_norm_: the default (without a tuning table, the built-in
    order: our kernel first) and the Apex copies and torch by name."""
    def params():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.zeros(n, device=DEV, dtype=dtype)) for n in (3, 1000, 65537, 17)]
        for i, p in enumerate(ps):
            p.grad = (torch.randn(p.shape, device=DEV) * (i + 1)).to(dtype)
        return ps

    p1, p2 = params(), params()
    n1 = clip_grad_norm_(p1, 1.0, impl=impl)
    n2 = torch.nn.utils.clip_grad_norm_(p2, 1.0)
    ran("clip_grad_norm", expected)
    assert n1.dtype == n2.dtype and n1.device == n2.device
    torch.testing.assert_close(n1.double(), n2.double(), **TOLERANCES[dtype])
    for a, b in zip(p1, p2):
        torch.testing.assert_close(a.grad, b.grad, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtypes", [[torch.bfloat16] * 4, [torch.float32] * 4, [torch.float16] * 4,
                                    [torch.bfloat16, torch.float32, torch.bfloat16, torch.float32]])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("max_norm", [1.0, 1e9])
def test_clip_grad_norm_ours_vs_float64_without_a_host_sync(dtypes, norm_type, max_norm):
    """clip_grad_norm_(impl="pipegoose"): the total norm and every clipped gradient against float64 (max_norm 1e9:
    nothing is clipped, and the multiplication returns at once), with no synchronizing CUDA call (torch's sync debug
    mode raises on one; the Apex path reads the coefficient on the host)."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.zeros(n, device=DEV, dtype=dt)) for n, dt in zip((3, 1000, 65537, 17), dtypes)]
    for i, p in enumerate(ps):
        p.grad = (torch.randn(p.shape, device=DEV) * (i + 1)).to(p.dtype)
    g64 = [p.grad.double() for p in ps]
    total64 = torch.linalg.vector_norm(torch.cat(g64), norm_type)
    coef = min(1.0, max_norm / (float(total64) + 1e-6))
    warm = [torch.nn.Parameter(torch.zeros(5, device=DEV, dtype=dt)) for dt in dtypes]
    for w in warm:
        w.grad = torch.ones_like(w)
    clip_grad_norm_(warm, max_norm, norm_type, impl="pipegoose")   # the kernel loaded before the sync check
    dispatch.reset_stats()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        total = clip_grad_norm_(ps, max_norm, norm_type, impl="pipegoose")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ran("clip_grad_norm", "pipegoose", calls=len(set(dtypes)))   # one call per dtype group
    coarse = max(dtypes, key=lambda d: torch.finfo(d).eps)
    assert total.dtype == functools.reduce(torch.promote_types, dtypes) and total.device == ps[0].device
    # returned in the gradients' (promoted) dtype, as torch does: fp16's L1 norm here (~1.6e5) is inf in fp16
    torch.testing.assert_close(total.double(), total64.to(total.dtype).double(), **TOLERANCES[coarse])
    for p, g in zip(ps, g64):
        torch.testing.assert_close(p.grad.double(), g * coef, **TOLERANCES[p.dtype])
        if max_norm > 1e6:
            assert torch.equal(p.grad, g.to(p.dtype)), "a coefficient of 1 must leave the gradients as they were"


# --- double backward ---------------------------------------------------------------------------------------

def _grad_and_hvp(fn, inputs, seed):
    """(grads, Hessian-vector products) of sum(fn(*inputs) * v): a backward with create_graph=True, then one
    through it (zeros where a gradient does not depend on an input)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    ins = [t.detach().clone().requires_grad_(True) for t in inputs]
    y = fn(*ins)
    v = torch.randn(y.shape, generator=g, device=DEV)

    def wide(t):  # fp32, or float64 for the float64 reference (the same v and u: drawn in fp32 from the same seed)
        return t.to(torch.promote_types(t.dtype, torch.float32))

    grads = torch.autograd.grad((wide(y) * v).sum(), ins, create_graph=True)
    u = [torch.randn(t.shape, generator=g, device=DEV) for t in ins]
    hvp = torch.autograd.grad(sum((wide(gr) * uu).sum() for gr, uu in zip(grads, u)), ins, allow_unused=True)
    torch.cuda.synchronize()
    return [gr.detach() for gr in grads], [torch.zeros_like(t) if h is None else h for t, h in zip(ins, hvp)]


_MASK16 = (torch.arange(16) % 5 == 0).reshape(1, 1, 1, 16).expand(2, 1, 16, 16)
DOUBLE_BACKWARD = {  # name: (op, impl, fn(impl), input shapes and dtypes, dtype of the result)
    "layer_norm-pipegoose": ("layer_norm", "pipegoose", lambda i: lambda x, w, b: PF.layer_norm(x, (96,), w, b, impl=i),
                             [((4, 96), torch.float32), ((96,), torch.float32), ((96,), torch.float32)], torch.float32),
    "layer_norm-pipegoose-bf16": ("layer_norm", "pipegoose",
                                  lambda i: lambda x, w, b: PF.layer_norm(x, (96,), w, b, impl=i),
                                  [((4, 96), torch.bfloat16), ((96,), torch.float32), ((96,), torch.float32)],
                                  torch.bfloat16),
    "layer_norm-apex": ("layer_norm", "apex", lambda i: lambda x, w, b: PF.layer_norm(x, (96,), w, b, impl=i),
                        [((4, 96), torch.float16), ((96,), torch.float16), ((96,), torch.float16)], torch.float16),
    "layer_norm-pipegoose-weight-only": ("layer_norm", "pipegoose",
                                         lambda i: lambda x, w: PF.layer_norm(x, (96,), w, None, impl=i),
                                         [((4, 96), torch.float32), ((96,), torch.float32)], torch.float32),
    "layer_norm-pipegoose-fp16-mixed": ("layer_norm", "pipegoose",
                                        lambda i: lambda x, w, b: PF.layer_norm(x, (96,), w, b, impl=i),
                                        [((4, 96), torch.float16), ((96,), torch.float16), ((96,), torch.float32)],
                                        torch.float16),
    "layer_norm-pipegoose-2d-shape": ("layer_norm", "pipegoose",
                                      lambda i: lambda x, w, b: PF.layer_norm(x, (6, 16), w, b, impl=i),
                                      [((4, 6, 16), torch.float32), ((6, 16), torch.float32), ((6, 16), torch.float32)],
                                      torch.float32),
    "rms_norm-pipegoose-2d-shape": ("rms_norm", "pipegoose",
                                    lambda i: lambda x, w: PF.rms_norm(x, (6, 16), w, 1e-6, impl=i),
                                    [((4, 6, 16), torch.bfloat16), ((6, 16), torch.bfloat16)], torch.bfloat16),
    "rms_norm-pipegoose": ("rms_norm", "pipegoose", lambda i: lambda x, w: PF.rms_norm(x, (96,), w, 1e-6, impl=i),
                           [((4, 96), torch.float32), ((96,), torch.float32)], torch.float32),
    "rms_norm-pipegoose-llama": ("rms_norm", "pipegoose",
                                 lambda i: lambda x, w: PF.rms_norm(x, 96, w, 1e-6, cast_before_weight=True, impl=i),
                                 [((4, 96), torch.bfloat16), ((96,), torch.float32)], torch.bfloat16),
    "softmax-pipegoose": ("softmax", "pipegoose", lambda i: lambda x: PF.scaled_softmax(x, 0.5, impl=i),
                          [((4, 33), torch.float32)], torch.float32),
    "softmax.masked-pipegoose": ("softmax.masked", "pipegoose",
                                 lambda i: lambda x: PF.scaled_masked_softmax(x, _MASK16.to(DEV), 0.5, impl=i),
                                 [((2, 2, 16, 16), torch.float16)], torch.float16),
    "softmax.masked-megatron": ("softmax.masked", "megatron",
                                lambda i: lambda x: PF.scaled_masked_softmax(x, _MASK16.to(DEV), 0.5, impl=i),
                                [((2, 2, 16, 16), torch.float16)], torch.float16),
    "softmax.causal-pipegoose": ("softmax.causal", "pipegoose",
                                 lambda i: lambda x: PF.scaled_upper_triang_masked_softmax(x, 0.5, impl=i),
                                 [((16, 16, 16), torch.bfloat16)], torch.bfloat16),
    "softmax.causal-megatron": ("softmax.causal", "megatron",
                                lambda i: lambda x: PF.scaled_upper_triang_masked_softmax(x, 0.5, impl=i),
                                [((16, 16, 16), torch.bfloat16)], torch.bfloat16),
}


@pytest.mark.parametrize("case", list(DOUBLE_BACKWARD))
def test_double_backward_every_fused_function(case, recwarn):
    """create_graph=True through a fused Function, then a backward through the gradients: first and second
    derivatives against the PyTorch reference path run in float64 on the same (rounded) inputs, and the same as the
    reference path in the same dtype; no "autograd kernel was not registered" warning (the backward kernels are not
    differentiable; with them the second backward lost its terms)."""
    op, impl, make, specs, dtype = DOUBLE_BACKWARD[case]
    g = torch.Generator(device=DEV).manual_seed(7)
    inputs = [torch.randn(shape, generator=g, device=DEV).to(dt) for shape, dt in specs]
    grads, hvp = _grad_and_hvp(make(impl), inputs, 11)
    ran(op, impl)
    assert not [w for w in recwarn if "autograd kernel was not registered" in str(w.message)]
    ref_grads, ref_hvp = _grad_and_hvp(make("torch"), inputs, 11)
    grads64, hvp64 = _grad_and_hvp(make("torch"), [t.double() for t in inputs], 11)
    n = len(inputs)
    for i, (a, b, c) in enumerate(zip(grads + hvp, ref_grads + ref_hvp, grads64 + hvp64)):
        what = f"{'grad' if i < n else 'hvp'} of input {i % n}"
        assert a.dtype == b.dtype, what
        assert c.dtype == torch.float64, what
        assert torch.isfinite(a).all(), what
        torch.testing.assert_close(a.float(), b.float(), **tol(dtype, 2), msg=lambda m: f"{what} vs {dtype}: {m}")
        scale = DOUBLE_BACKWARD_GRAD_SCALE if i < n else DOUBLE_BACKWARD_HVP_SCALE
        torch.testing.assert_close(a.double(), c, **tol(dtype, scale), msg=lambda m: f"{what} vs float64: {m}")


# --- fresh process: first call of the causal path with a fresh kernel build (ColossalAI#3092 class) -------------

@pytest.mark.slow
def test_causal_first_call_in_fresh_process_with_fresh_build(tmp_path):
    # (the tolerances from the table: tests/ on the child's sys.path; a random output gradient: with dy = 1 the
    # softmax's input gradient is 0 whatever the probabilities)
    code = textwrap.dedent("""
        import sys
        import torch
        sys.path.insert(0, TESTS_DIR)
        from tolerances import TOLERANCES
        from pipegoose.nn.fusion import dispatch
        from pipegoose.nn.fusion import functional as PF
        g = torch.Generator(device="cuda").manual_seed(48)
        x = torch.randn(48, 24, 24, generator=g, device="cuda", dtype=torch.float16, requires_grad=True)
        dy = torch.randn(48, 24, 24, generator=g, device="cuda", dtype=torch.float16)
        with dispatch.strict():
            y = PF.scaled_upper_triang_masked_softmax(x, 0.125, impl="megatron")
            y.backward(dy)
        assert dispatch.stats() == {"softmax.causal": {"megatron": 1}}, dispatch.stats()
        ops, why = dispatch.kernel("megatron/scaled_upper_triang_masked_softmax")
        assert ops is not None and ops.built, ("expected a fresh build in this process", why)
        s = x.detach().double() * 0.125
        ref = torch.softmax(s.masked_fill(torch.ones(24, 24, dtype=torch.bool, device="cuda").triu(1), float("-inf")), -1)
        t = TOLERANCES[torch.float16]
        torch.testing.assert_close(y.detach().double(), ref, **t)
        assert not x.grad.isnan().any()
        dy64 = dy.double()
        want = 0.125 * ref * (dy64 - (dy64 * ref).sum(-1, keepdim=True))   # softmax_bwd_ref64
        torch.testing.assert_close(x.grad.double(), want, atol=t["atol"] * 4, rtol=t["rtol"])   # as check_softmax
        print("FRESH-OK")
    """).replace("TESTS_DIR", repr(str(REPO / "tests")))
    env = dict(os.environ, PIPEGOOSE_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("PIPEGOOSE_IMPL_SOFTMAX_CAUSAL", None)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "FRESH-OK" in r.stdout, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-4000:]}"
