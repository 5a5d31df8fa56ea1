"""CPU: the softmax functions' reference paths against float64 references, forward and backward."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tolerances import TOLERANCES

import pipegoose.nn.fusion as fusion
from pipegoose.nn.fusion import dispatch
from pipegoose.nn.fusion import functional as PF

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def ref64(x, mask, scale, causal=False):
    """float64 reference: -inf masking, fully masked rows -> 0."""
    s = x.double() * scale
    masked = mask
    if causal:
        sq, sk = x.shape[-2], x.shape[-1]
        cm = torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1)
        masked = cm if masked is None else masked | cm
    if masked is None:
        return torch.softmax(s, -1)
    y = torch.softmax(s.masked_fill(masked, float("-inf")), -1)
    return torch.where(masked.all(-1, keepdim=True), torch.zeros_like(y), y)


def fwd_bwd(fn, x, dy):
    x = x.detach().clone().requires_grad_(True)
    y = fn(x)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad.detach()


def check(fn, ref, x, dy, dtype):
    y, dx = fwd_bwd(fn, x.to(dtype), dy)
    y64, dx64 = fwd_bwd(ref, x.double(), dy.double())
    assert y.dtype == dtype and dx.dtype == dtype
    assert not y.isnan().any() and not dx.isnan().any()
    torch.testing.assert_close(y.double(), y64, **TOLERANCES[dtype])
    # dx is O(scale * |dy|); its error is relative to that, not to each (possibly tiny) element
    torch.testing.assert_close(dx.double(), dx64, atol=TOLERANCES[dtype]["atol"] * 4, rtol=TOLERANCES[dtype]["rtol"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 7, 13), (1, 1, 1, 1), (2, 3, 17, 129), (2, 1, 4, 2048 + 3)])
@pytest.mark.parametrize("mask_kind", ["full", "bcast_b", "bcast_q", "none"])
def test_scaled_masked_softmax_reference(dtype, shape, mask_kind):
    g = torch.Generator().manual_seed(zlib.crc32(repr((shape, mask_kind)).encode()))
    b, np_, sq, sk = shape
    x = torch.randn(shape, generator=g) * 3
    dy = torch.randn(shape, generator=g)
    if mask_kind == "none":
        mask = None
    else:
        ms = {"full": (b, 1, sq, sk), "bcast_b": (1, 1, sq, sk), "bcast_q": (b, 1, 1, sk)}[mask_kind]
        mask = torch.rand(ms, generator=g) < 0.3
    scale = 0.37
    check(lambda t: PF.scaled_masked_softmax(t, mask, scale), lambda t: ref64(t, mask, scale), x, dy, dtype)
    op = "softmax.masked" if mask is not None else "softmax"
    assert dispatch.stats()[op] == {"torch": 1}


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows_give_zeros_output_and_grad(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 6, 40, generator=g)
    mask = torch.rand(2, 1, 6, 40, generator=g) < 0.5
    mask[0, 0, 2] = True  # fully masked rows
    mask[1, 0, 5] = True
    xr = x.to(dtype).requires_grad_(True)
    y = PF.scaled_masked_softmax(xr, mask, 1.0)
    y.backward(torch.randn_like(y))
    assert torch.count_nonzero(y[0, :, 2]) == 0 and torch.count_nonzero(y[1, :, 5]) == 0
    assert torch.count_nonzero(xr.grad[0, :, 2]) == 0 and torch.count_nonzero(xr.grad[1, :, 5]) == 0
    # the other rows are proper distributions
    rows = y.float().sum(-1)
    keep = ~mask.all(-1).expand(2, 3, 6)
    torch.testing.assert_close(rows[keep], torch.ones_like(rows[keep]), **TOLERANCES[dtype])
    # masked keys get exactly zero probability
    assert torch.count_nonzero(y.masked_select(mask.expand_as(y))) == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(48, 24, 24), (3, 1, 1), (5, 7, 7), (2, 130, 130), (2, 5, 9), (2, 9, 5)])
def test_causal_reference(dtype, shape):
    g = torch.Generator().manual_seed(shape[1] * 1000 + shape[2])
    x = torch.randn(shape, generator=g) * 2
    dy = torch.randn(shape, generator=g)
    check(lambda t: PF.scaled_upper_triang_masked_softmax(t, 0.125),
          lambda t: ref64(t, None, 0.125, causal=True), x, dy, dtype)
    assert dispatch.stats()["softmax.causal"] == {"torch": 1}


def test_causal_sq_gt_sk_rows_without_keys_are_zero():
    x = torch.randn(2, 9, 5)
    y = PF.scaled_upper_triang_masked_softmax(x, 1.0)
    assert torch.count_nonzero(y[:, :4]) == 0  # query i sees keys j <= i - 4
    torch.testing.assert_close(y[:, 4:].sum(-1), torch.ones(2, 5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7,), (4, 33), (2, 3, 5, 1000), (3, 1)])
def test_scaled_softmax_reference(dtype, shape):
    g = torch.Generator().manual_seed(len(shape))
    x = torch.randn(shape, generator=g)
    dy = torch.randn(shape, generator=g)
    check(lambda t: PF.scaled_softmax(t, 1.7), lambda t: ref64(t, None, 1.7), x, dy, dtype)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("shape,dim", [((4, 33), -1), ((4, 33), 0), ((2, 3, 5), 1), ((7,), 0), ((), 0),
                                       ((2, 0, 3), -1)])
def test_softmax_is_F_softmax(dtype, shape, dim):
    x = torch.randn(shape, dtype=dtype) * 4
    torch.testing.assert_close(PF.softmax(x, dim=dim), F.softmax(x, dim=dim), rtol=0, atol=0)
    assert torch.allclose(PF.softmax(x, dim=dim, dtype=torch.float64), F.softmax(x, dim=dim, dtype=torch.float64))


@pytest.mark.parametrize("shape", [(), (7,), (4, 33), (2, 3, 5), (2, 3, 4, 5)])
def test_softmax_without_dim_follows_F_softmax_legacy_rule(shape):
    """softmax(x) without dim: F.softmax's implicit (deprecated) dim and its warning, not the last dim."""
    x = torch.randn(shape) * 4
    with pytest.warns(UserWarning, match="Implicit dimension choice for softmax"):
        got = PF.softmax(x)
    with pytest.warns(UserWarning, match="Implicit dimension choice for softmax"):
        want = F.softmax(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(TypeError, match="dim"):
        PF.softmax(x, 0.5)


def test_softmax_has_F_softmax_signature():
    """The same parameters as F.softmax (input, dim, _stacklevel, dtype), positional or by name."""
    import inspect

    assert list(inspect.signature(PF.softmax).parameters)[:4] == list(inspect.signature(F.softmax).parameters)
    x = torch.randn(2, 3)
    torch.testing.assert_close(PF.softmax(x, 1, 3, torch.float64), F.softmax(x, 1, 3, torch.float64), rtol=0, atol=0)
    torch.testing.assert_close(PF.softmax(input=x, dim=0), F.softmax(input=x, dim=0), rtol=0, atol=0)


def test_softmax_inf_rows_like_torch():
    x = torch.tensor([[float("-inf")] * 4, [0.0, float("-inf"), 1.0, 2.0]])
    torch.testing.assert_close(PF.softmax(x, -1), F.softmax(x, -1), equal_nan=True)


def test_autocast_cpu_bf16_follows_torch():
    x = torch.randn(2, 3, 8, 16)
    mask = torch.rand(2, 1, 8, 16) < 0.2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.softmax(x, -1).dtype
        assert PF.softmax(x, -1).dtype == want
        assert PF.scaled_masked_softmax(x, mask, 0.5).dtype == want
        assert PF.scaled_masked_softmax(x.bfloat16(), mask, 0.5).dtype == F.softmax(x.bfloat16(), -1).dtype


def test_errors_name_the_argument():
    x = torch.randn(2, 3, 4, 5)
    with pytest.raises(TypeError, match="^mask: .* got float32; convert additive float masks"):
        PF.scaled_masked_softmax(x, torch.zeros(2, 1, 4, 5), 1.0)
    for dt in (torch.int64, torch.int8):  # an integer mask is not told to convert a float mask
        with pytest.raises(TypeError, match=r"^mask: .* got int\d+; pass mask != 0 for an integer mask"):
            PF.scaled_masked_softmax(x, torch.zeros(2, 1, 4, 5, dtype=dt), 1.0)
    with pytest.raises(ValueError, match="mask"):
        PF.scaled_masked_softmax(x, torch.zeros(2, 1, 4, 6, dtype=torch.bool), 1.0)
    with pytest.raises(ValueError, match="x"):
        PF.scaled_masked_softmax(x[0], None, 1.0)
    with pytest.raises(TypeError, match="scale"):
        PF.scaled_masked_softmax(x, None, torch.tensor([1.0]))
    with pytest.raises(ValueError, match="scale"):
        PF.scaled_softmax(x, float("nan"))
    with pytest.raises(ValueError, match="x"):
        PF.scaled_upper_triang_masked_softmax(x, 1.0)
    with pytest.raises(TypeError, match="^input: expected a floating point tensor"):
        PF.softmax(torch.arange(4), -1)
    with pytest.raises(TypeError, match="^input: expected a torch.Tensor, got list"):  # F.softmax's parameter name
        PF.softmax([1.0, 2.0], -1)
    with pytest.raises(ValueError, match="impl"):
        PF.scaled_softmax(x, 1.0, impl="nonexistent")


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_ERROR = r"expected dtype float32, float16, bfloat16 or float64, got float8_e\w+ \(no fused kernel"


@pytest.mark.parametrize("dtype", FP8)
def test_float8_input_is_a_type_error_naming_the_argument(dtype):
    """float8 input gave torch's "softmax_lastdim_kernel_impl not implemented for 'Float8_e4m3fn'" on some entry
    points (softmax, FusedScaleMaskSoftmax) and an fp8 result on others; every one now refuses it up front, naming the
    argument and the dtypes taken (float64 runs the reference path, as before)."""
    x = torch.randn(2, 2, 4, 4).to(dtype)
    mask = torch.zeros(2, 1, 4, 4, dtype=torch.bool)
    calls = {"x": [lambda: PF.scaled_softmax(x, 0.5), lambda: PF.scaled_masked_softmax(x, mask, 0.5),
                   lambda: PF.scaled_masked_softmax(x, None, 0.5),
                   lambda: PF.scaled_upper_triang_masked_softmax(x[0], 0.5),
                   lambda: dispatch.explain("softmax.masked", x, mask, scale=0.5)],
             "input": [lambda: PF.softmax(x, -1),
                       lambda: fusion.FusedScaleMaskSoftmax(False, False, fusion.AttnMaskType.padding, True, None, True,
                                                            None)(x, mask)]}
    for name, fns in calls.items():
        for fn in fns:
            with pytest.raises(TypeError, match=f"^{name}: {FP8_ERROR}"):
                fn()
    with pytest.raises(TypeError, match=r"^dtype: expected torch.float32, float16, bfloat16, float64 or None"):
        PF.softmax(x.float(), -1, dtype=dtype)
    x64 = x.double()
    torch.testing.assert_close(PF.scaled_softmax(x64, 0.5), torch.softmax(x64 * 0.5, -1), **TOLERANCES[torch.float32])


def test_uint8_mask_is_nonzero_masked():
    x = torch.randn(1, 2, 3, 4)
    m8 = torch.tensor([0, 1, 2, 0], dtype=torch.uint8).expand(1, 1, 3, 4)
    torch.testing.assert_close(PF.scaled_masked_softmax(x, m8), PF.scaled_masked_softmax(x, m8 != 0))


def test_strict_mode_raises_on_cpu_fallback(monkeypatch):
    x = torch.randn(2, 2, 4, 8)
    with dispatch.strict():
        with pytest.raises(fusion.FusionFallbackError, match="softmax.masked"):
            PF.scaled_masked_softmax(x, torch.zeros(1, 1, 4, 8, dtype=torch.bool))
    monkeypatch.setenv("PIPEGOOSE_STRICT", "1")
    with pytest.raises(fusion.FusionFallbackError, match="needs a CUDA tensor"):
        PF.scaled_upper_triang_masked_softmax(x[0], 1.0)
    # asking for the reference explicitly is not a fallback
    PF.scaled_upper_triang_masked_softmax(x[0], 1.0, impl="torch")


# --- FusedScaleMaskSoftmax (CPU: the PyTorch path) ------------------------------------------------------------

from pipegoose.nn.fusion.modules import AttnMaskType, FusedScaleMaskSoftmax  # noqa: E402


def _module(kind, dtype=torch.bfloat16, scale=None, mask_func=None):
    return FusedScaleMaskSoftmax(dtype == torch.float16, dtype == torch.bfloat16, kind, True, mask_func, True, scale)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_scale_mask_softmax_padding_and_causal(dtype):
    x = torch.randn(2, 3, 8, 8) * 3
    mask = torch.rand(2, 1, 8, 8) < 0.3
    mask[1, 0, 4] = True
    y = _module(AttnMaskType.padding, dtype, scale=0.5)(x.to(dtype), mask)
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), ref64(x.to(dtype), mask, 0.5), **TOLERANCES[dtype])
    assert torch.count_nonzero(y[1, :, 4]) == 0
    y = _module(AttnMaskType.causal, dtype)(x.to(dtype), None)
    torch.testing.assert_close(y.double(), ref64(x.to(dtype), None, 1.0, causal=True), **TOLERANCES[dtype])
    # Megatron's mask_func (fill -10000) still gives zeros on fully masked rows
    fill = lambda s, m: s.masked_fill(m, -10000.0)  # noqa: E731
    y = _module(AttnMaskType.padding, dtype, mask_func=fill)(x.to(dtype), mask)
    assert torch.count_nonzero(y[1, :, 4]) == 0


def test_fused_scale_mask_softmax_fallback_is_counted_and_the_choice_cached(monkeypatch):
    """With fusion asked for, the module's PyTorch path ran without a word where no fused path took the input (here:
    CPU): not counted, no last_choice, strict mode silent (the functional op raises there); and it chose afresh on
    every call. The fallback is now recorded like the functional ops' (strict mode raises), the choice cached."""
    x = torch.randn(2, 3, 8, 8, dtype=torch.float16)
    mask = torch.rand(2, 1, 8, 8) < 0.3
    dispatch.reset_stats()
    chose = []
    real_choose = dispatch.choose
    monkeypatch.setattr(dispatch, "choose", lambda *a, **k: chose.append(a[0]) or real_choose(*a, **k))
    m = _module(AttnMaskType.padding, torch.float16, scale=0.5)
    for _ in range(3):
        m(x, mask)
    assert dispatch.stats()["softmax.masked"] == {"torch": 3} and dispatch.last_choice("softmax.masked").fallback
    assert chose == ["softmax.masked"]
    with dispatch.strict(), pytest.raises(dispatch.FusionFallbackError, match="softmax.masked"):
        m(x, mask)
    with dispatch.strict(), pytest.raises(dispatch.FusionFallbackError, match="causal with a padding mask"):
        _module(AttnMaskType.causal, torch.float16)(x, mask)
    # fusion not asked for (Megatron's flag) or fp32 scores: the module's own PyTorch path, no fallback
    with dispatch.strict():
        FusedScaleMaskSoftmax(True, False, AttnMaskType.padding, False, None, True, 0.5)(x, mask)
        _module(AttnMaskType.padding, torch.float32)(x.float(), mask)


@pytest.mark.parametrize("kind", [AttnMaskType.padding, AttnMaskType.causal])
def test_fused_scale_mask_softmax_runs_its_choice_once_on_the_scores_as_given(monkeypatch, kind):
    """The module chose an implementation and then called the functional op, which chose again (4-7 us of host time
    per call) and, under autocast, cast the 16-bit scores to fp32 for an fp32 kernel (softmax is on autocast's fp32
    list) and the probabilities back. It now runs its own choice on the scores as given, outside autocast, as
    Megatron's kernels do. (A fused implementation is forced here: no kernel runs on the CPU.)"""
    from pipegoose.nn.fusion.ops import softmax as S

    x = torch.randn(2, 3, 8, 8, dtype=torch.bfloat16) * 3
    mask = (torch.rand(2, 1, 8, 8) < 0.3).to(torch.uint8) if kind == AttnMaskType.padding else None
    causal = kind == AttnMaskType.causal
    ran, chose = [], []
    real_run = S._run_choice

    def run_choice(impl, xin, m, scale, is_causal):
        ran.append((impl, xin.dtype, tuple(xin.shape), None if m is None else m.dtype, scale, is_causal,
                    torch.is_autocast_enabled("cpu")))
        return real_run("torch", xin, m, scale, is_causal)

    monkeypatch.setattr(S, "_run_choice", run_choice)
    real_choose = dispatch.choose
    monkeypatch.setattr(dispatch, "choose", lambda *a, **k: chose.append(a[0]) or real_choose(*a, **k))
    monkeypatch.setattr(FusedScaleMaskSoftmax, "_choice", lambda self, t, m: dispatch.Choice(
        self._fused_op(m), "pipegoose", "argument", False, {}, "forced by the test"))
    dispatch.reset_stats()
    m = _module(kind, torch.bfloat16, scale=0.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x, mask)
    assert chose == []
    shape = (6, 8, 8) if causal else (2, 3, 8, 8)
    assert ran == [("pipegoose", torch.bfloat16, shape, None if causal else torch.bool, 0.5, causal, False)]
    op = "softmax.causal" if causal else "softmax.masked"
    assert dispatch.stats()[op] == {"pipegoose": 1}
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    torch.testing.assert_close(y.double(), ref64(x, None if causal else mask.bool(), 0.5, causal=causal),
                               **TOLERANCES[torch.bfloat16])
    # Megatron's public forward_fused_softmax runs the same single choice (it went through the functional op too)
    y2 = m.forward_fused_softmax(x, mask)
    assert chose == [] and len(ran) == 2 and ran[1] == ran[0]
    torch.testing.assert_close(y2, y)


@pytest.mark.parametrize("kind", [AttnMaskType.causal, AttnMaskType.padding])
def test_fused_scale_mask_softmax_forward_fused_softmax_keeps_the_padding_mask(kind):
    """Megatron's public forward_fused_softmax, where the choice is the PyTorch path (a causal module given a padding
    mask: no fused kernel takes both; any module on the CPU), ran the causal op with no mask: weight on masked keys
    (a review). It gives forward's result: both masks applied, fully masked rows zero."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 6, 6, generator=g).bfloat16()
    mask = torch.rand(2, 1, 6, 6, generator=g) < 0.4
    mask[0, 0, 2] = True   # a fully masked row
    m = _module(kind, torch.bfloat16, scale=0.5)
    causal = kind == AttnMaskType.causal
    y = m.forward_fused_softmax(x, mask)
    torch.testing.assert_close(y, m(x, mask))
    torch.testing.assert_close(y.double(), ref64(x, mask, 0.5, causal=causal), **TOLERANCES[torch.bfloat16])
    masked = mask | (torch.ones(6, 6, dtype=torch.bool).triu(1) if causal else False)
    assert (y.masked_select(masked.expand_as(y)) == 0).all()


@pytest.mark.parametrize("shape", [(2, 3, 0, 8), (2, 3, 8, 0), (0, 3, 8, 8)])
def test_fused_scale_mask_softmax_causal_empty_scores(shape):
    """A causal module given scores with no queries or no keys raised "cannot reshape tensor of 0 elements into shape
    [-1, 0, 8]" (the reshape for the causal op inferred its first dim); it returns the empty probabilities, as the
    padding module and the functional ops do."""
    x = torch.randn(*shape, dtype=torch.bfloat16, requires_grad=True)
    y = _module(AttnMaskType.causal, torch.bfloat16, scale=0.5)(x, None)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    y.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_scale_mask_softmax_scores_not_of_the_flagged_dtype_are_a_fallback(dtype):
    """A module whose flags say bf16, given fp32 or fp64 scores with fusion asked for, took the PyTorch path without a
    word: nothing counted, strict mode silent (Megatron's kernels refuse such scores). It is now a counted fallback
    that names the argument, and the result is still the PyTorch path's."""
    x = torch.randn(2, 3, 8, 8, dtype=dtype)
    mask = torch.rand(2, 1, 8, 8) < 0.3
    m = _module(AttnMaskType.padding, torch.bfloat16, scale=0.5)
    dispatch.reset_stats()
    y = m(x, mask)
    assert dispatch.stats()["softmax.masked"] == {"torch": 1} and dispatch.last_choice("softmax.masked").fallback
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), ref64(x, mask, 0.5), **TOLERANCES[torch.float32])
    with dispatch.strict(), pytest.raises(dispatch.FusionFallbackError,
                                          match="input: float.. scores with input_in_bf16"):
        m(x, mask)


def test_fused_scale_mask_softmax_megatron_api():
    m = _module(AttnMaskType.padding)
    assert not m.is_kernel_available(None, 2, 3, 8, 8, _input=torch.randn(2, 3, 8, 8, dtype=torch.bfloat16))
    # rows per 128-thread block of the Megatron copies
    assert [FusedScaleMaskSoftmax.get_batch_per_block(64, sk, 2, 4) for sk in (1, 16, 32, 64, 128, 256, 2048)] \
        == [256, 16, 8, 8, 8, 4, 4]
    with pytest.raises(ValueError, match="fp16 and bf16"):
        FusedScaleMaskSoftmax(True, True, AttnMaskType.padding, True, None, True, None)
    with pytest.raises(ValueError, match="softmax_in_fp32"):
        FusedScaleMaskSoftmax(True, False, AttnMaskType.padding, True, None, False, 0.5)
    with pytest.raises(ValueError, match="input"):
        m(torch.randn(3, 8, 8, dtype=torch.bfloat16), None)
    # arguments Megatron takes on trust, checked when constructed (a fresh-clone walkthrough: a mask_func of 5 failed
    # at the first masked forward with "'int' object is not callable")
    with pytest.raises(TypeError, match=r"^mask_func: expected a callable"):
        FusedScaleMaskSoftmax(False, False, AttnMaskType.padding, True, 5, True, None)
    with pytest.raises(TypeError, match=r"^input_in_fp16: expected a bool, got 'yes'"):
        FusedScaleMaskSoftmax("yes", False, AttnMaskType.padding, True, None, True, None)
    with pytest.raises(TypeError, match=r"^softmax_in_fp32: expected a bool"):
        FusedScaleMaskSoftmax(False, False, AttnMaskType.padding, True, None, 1, None)
    assert FusedScaleMaskSoftmax(np.bool_(True), False, AttnMaskType.padding, True, None, True, None).input_in_fp16


@pytest.mark.parametrize("scale", [0.5, 1, np.float32(0.5), np.float64(0.5), np.int64(2), torch.tensor(0.5),
                                   torch.tensor(2, dtype=torch.int32)], ids=str)
def test_scale_takes_what_eps_takes(scale):
    """A Python, numpy or 0-d tensor number, as the norms' eps (numpy float32 and 0-d tensors were refused with
    "expected a Python float" while numpy float64 passed: a fresh-clone walkthrough)."""
    x = torch.randn(2, 2, 4, 4)
    want = torch.softmax(x * float(scale), -1)
    torch.testing.assert_close(PF.scaled_softmax(x, scale), want)
    assert FusedScaleMaskSoftmax(False, False, AttnMaskType.padding, True, None, True, scale).scale == float(scale)


@pytest.mark.parametrize("scale", [True, "0.5", torch.tensor([0.5]), torch.tensor(True), None], ids=str)
def test_scale_refuses_what_is_not_a_number(scale):
    with pytest.raises(TypeError, match=r"^scale: expected a number"):
        PF.scaled_softmax(torch.randn(2, 2, 4, 4), scale)


def _scaled(op, mask):
    """(ours, want): the scaled softmax ``op`` of [2, 3, 5, 5] inputs, and F.softmax(x * scale) masked alike."""
    def ours(x, t):
        if op == "plain":
            return PF.scaled_softmax(x, t)
        if op == "masked":
            return PF.scaled_masked_softmax(x, mask, t)
        return PF.scaled_upper_triang_masked_softmax(x.flatten(0, 1), t).view_as(x)

    def want(x, t):
        s = x * t
        if op == "masked":
            s = s.masked_fill(mask, float("-inf"))
        elif op == "causal":
            s = s.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
        return F.softmax(s, -1)

    return ours, want


@pytest.mark.parametrize("op", ["plain", "masked", "causal"])
def test_a_learnable_scale_gets_its_gradient(op):
    """A review (session 60): a 0-d tensor scale that requires grad (a learnable temperature) was taken as a float, its
    gradient lost without a word. Now the three softmaxes pass it the gradient of F.softmax(x * scale) (float64,
    both gradients), and the module, which takes a constant as Megatron's does, refuses it."""
    gen = torch.Generator().manual_seed(60)
    x = torch.randn(2, 3, 5, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, 1, 5, 5, generator=gen) < 0.3
    w = torch.randn(2, 3, 5, 5, generator=gen, dtype=torch.float64)
    t = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    ours, want = _scaled(op, mask)
    got = torch.autograd.grad((ours(x, t) * w).sum(), (x, t))
    ref = torch.autograd.grad((want(x, t) * w).sum(), (x, t))
    assert got[1] is not None and float(ref[1].abs()) > 1e-3
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
    with torch.no_grad():   # no gradient wanted: the value, as before
        torch.testing.assert_close(ours(x, t), want(x, t))
    with pytest.raises(TypeError, match=r"^scale: a tensor that requires grad; FusedScaleMaskSoftmax takes a constant"):
        FusedScaleMaskSoftmax(False, False, AttnMaskType.padding, True, None, True, t)


@pytest.mark.parametrize("op", ["plain", "masked", "causal"])
def test_a_tensor_scale_keeps_its_forward_derivative_and_maps_under_vmap(op):
    """A review (session 61): the scale's forward-mode derivative was lost (torch.func.jvp gave 0.0; a dual scale gave
    no tangent), and vmap over the scale failed with "a 0-d tensor without a value". Now a scale of a transform, or a
    dual one, multiplies x first, as a learnable one does (float64 against F.softmax(x * scale))."""
    import torch.autograd.forward_ad as fwAD

    gen = torch.Generator().manual_seed(61)
    x = torch.randn(2, 3, 5, 5, generator=gen, dtype=torch.float64)
    mask = torch.rand(2, 1, 5, 5, generator=gen) < 0.3
    w = torch.randn(2, 3, 5, 5, generator=gen, dtype=torch.float64)
    t, dt = torch.tensor(0.7, dtype=torch.float64), torch.tensor(1.3, dtype=torch.float64)
    ours, want = _scaled(op, mask)
    got = torch.func.jvp(lambda s: (ours(x, s) * w).sum(), (t,), (dt,))[1]
    ref = torch.func.jvp(lambda s: (want(x, s) * w).sum(), (t,), (dt,))[1]
    assert float(ref.abs()) > 1e-3
    torch.testing.assert_close(got, ref)
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(ours(x, fwAD.make_dual(t, dt))).tangent
        ref_tangent = fwAD.unpack_dual(want(x, fwAD.make_dual(t, dt))).tangent
    assert tangent is not None
    torch.testing.assert_close(tangent, ref_tangent)
    scales = torch.tensor([0.5, 1.0, 2.5], dtype=torch.float64)
    torch.testing.assert_close(torch.func.vmap(lambda s: ours(x, s))(scales), torch.stack([want(x, s) for s in scales]))
    torch.testing.assert_close(torch.func.grad(lambda s: (ours(x, s) * w).sum())(t),
                               torch.func.grad(lambda s: (want(x, s) * w).sum())(t))
    with pytest.raises(ValueError, match="^scale: expected a finite number, got nan"):
        with fwAD.dual_level():
            ours(x, fwAD.make_dual(torch.tensor(float("nan"), dtype=torch.float64), dt))


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_a_nested_tensor_through_the_scaled_softmax(layout):
    """A review (session 61): scaled_softmax of a nested tensor crashed in the dispatcher ("NestedTensorImpl doesn't
    support sizes"), where softmax and the norms run PyTorch's ops. Now it runs F.softmax(x * scale, -1) (a fallback,
    counted); a mask or a causal mask with a nested x is refused, naming x."""
    rows = [torch.randn(3, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)]
    nt = torch.nested.nested_tensor(rows, layout=layout)
    dispatch.reset_stats()
    got = PF.scaled_softmax(nt, 0.5)
    assert got.is_nested
    for g, r in zip(got.unbind(), rows):
        torch.testing.assert_close(g, F.softmax(r * 0.5, -1))
    assert dispatch.stats() == {"softmax": {"torch": 1}}, dispatch.stats()
    assert dispatch.last_choice("softmax").fallback
    with pytest.raises(TypeError, match="^x: a nested tensor is taken without a mask only .*; a causal mask was given"):
        PF.scaled_upper_triang_masked_softmax(nt, 0.5)
    # (a re-test: a strided one of another rank, or with a mask, crashed in the functionals' shape checks first)
    nt4 = torch.nested.nested_tensor([torch.randn(2, 3, 5), torch.randn(2, 4, 5)], layout=layout)
    with pytest.raises(TypeError, match="^x: a nested tensor is taken without a mask only .*; a mask was given"):
        PF.scaled_masked_softmax(nt4, torch.zeros(1, 1, 1, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="^x: a nested tensor is taken without a mask only .*; a causal mask was given"):
        PF.scaled_upper_triang_masked_softmax(nt4, 0.5)
    got = PF.scaled_masked_softmax(nt4, None, 0.5)
    for g, r in zip(got.unbind(), nt4.unbind()):
        torch.testing.assert_close(g, F.softmax(r * 0.5, -1))


def test_torch_func_transforms_through_the_softmaxes():
    """vmap / grad through the softmaxes (the inputs there have no storage: the fused paths decline them, and the
    reference path runs plain ops)."""
    from pipegoose.nn.fusion.ops import softmax as S

    x = torch.randn(3, 2, 4, 5, 5, dtype=torch.float64)
    m = torch.rand(2, 1, 5, 5) < 0.3
    torch.testing.assert_close(torch.func.vmap(lambda t: PF.softmax(t, -1))(x), F.softmax(x, -1))
    got = torch.func.vmap(lambda t: PF.scaled_masked_softmax(t, m, 0.5))(x)
    want = torch.stack([PF.scaled_masked_softmax(t, m, 0.5) for t in x])
    torch.testing.assert_close(got, want)
    w = torch.arange(5.0, dtype=torch.float64)
    g = torch.func.grad(lambda t: (PF.scaled_masked_softmax(t, m, 0.5) * w).sum())(x[0])
    t = x[0].clone().requires_grad_()
    (PF.scaled_masked_softmax(t, m, 0.5) * w).sum().backward()
    torch.testing.assert_close(g, t.grad)
    xc = torch.randn(3, 4, 6, 6, dtype=torch.float64)
    got = torch.func.vmap(lambda t: PF.scaled_upper_triang_masked_softmax(t, 0.5))(xc)
    torch.testing.assert_close(got, torch.stack([PF.scaled_upper_triang_masked_softmax(t, 0.5) for t in xc]))
    seen = []
    torch.func.vmap(lambda t: seen.append(S.softmax_problem(S.OP_MASKED, t, m, 0.5)) or t)(x)
    assert seen[0]["storage"] is False and seen[0]["aligned"] is False
    assert S.softmax_problem(S.OP_MASKED, x[0], m, 0.5)["storage"] is True


def jvp64(fn, x, t):
    """Forward-mode derivative of fn at x along t, by torch.func.jvp of fn in float64 (NaN of -inf rows -> 0)."""
    return torch.nan_to_num(torch.func.jvp(fn, (x.double(),), (t.double(),))[1])


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")  # raised inside torch.func
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_mode_ad_through_the_softmaxes(dtype):
    """torch.func.jvp and torch.autograd.forward_ad through every softmax (the reference Function's jvp: the tangent
    of y is the backward's formula applied to the tangent of x), against float64 jvp of the plain PyTorch formula;
    fully masked rows and masked keys give zero tangents."""
    import torch.autograd.forward_ad as fwAD

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(2, 3, 6, 9, generator=g) * 2).to(dtype)
    t = torch.randn(2, 3, 6, 9, generator=g).to(dtype)
    m = torch.rand(2, 1, 6, 9, generator=g) < 0.3
    m[0, 0, 2] = True  # a fully masked row
    cm = torch.ones(6, 6, dtype=torch.bool).triu(1)  # causal: square [b * np, sq, sq], the key after the query masked
    # the tangent is O(scale * |t|), like the backward's dx: check() widens atol the same way
    tol = dict(atol=TOLERANCES[dtype]["atol"] * 4, rtol=TOLERANCES[dtype]["rtol"])
    cases = [
        (lambda v: PF.softmax(v, -1), lambda v: F.softmax(v, -1)),
        (lambda v: PF.scaled_softmax(v, 0.7), lambda v: F.softmax(v * 0.7, -1)),
        (lambda v: PF.scaled_masked_softmax(v, m, 0.7),
         lambda v: F.softmax((v * 0.7).masked_fill(m, -float("inf")), -1)),
        (lambda v: PF.scaled_upper_triang_masked_softmax(v[..., :6].flatten(0, 1), 0.7),
         lambda v: F.softmax((v[..., :6].flatten(0, 1) * 0.7).masked_fill(cm, -float("inf")), -1)),
    ]
    for fn, ref in cases:
        want = jvp64(ref, x, t)
        _, got = torch.func.jvp(fn, (x,), (t,))
        torch.testing.assert_close(got.double(), want, **tol)
        with fwAD.dual_level():
            tan = fwAD.unpack_dual(fn(fwAD.make_dual(x, t))).tangent
        assert tan is not None
        torch.testing.assert_close(tan.double(), want, **tol)
    _, got = torch.func.jvp(cases[2][0], (x,), (t,))
    assert torch.count_nonzero(got[0, :, 2]) == 0 and torch.count_nonzero(got.masked_fill(~m, 0)) == 0


def test_nested_forward_mode_through_the_softmaxes():
    """jvp of jvp and jacfwd of jacfwd (second order, forward over forward) match PyTorch's own ops in float64: inside
    torch.func transforms the softmaxes run plain ops (an autograd.Function with a custom jvp gave wrong values
    there, without an error); fully masked rows stay zero in every derivative, never NaN."""
    from torch.func import jacfwd, jvp

    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 2, 4, 5, generator=g, dtype=torch.float64)
    t = torch.randn(2, 2, 4, 5, generator=g, dtype=torch.float64)
    m = torch.rand(2, 1, 4, 5, generator=g) < 0.3
    m[0, 0, 1] = True  # a fully masked row
    empty = m.all(-1, keepdim=True)
    cm = torch.ones(4, 4, dtype=torch.bool).triu(1)
    cases = [
        (lambda v: PF.scaled_softmax(v, 0.5), lambda v: F.softmax(v * 0.5, -1)),
        (lambda v: PF.scaled_masked_softmax(v, m, 0.5),
         lambda v: F.softmax((v * 0.5).masked_fill(m & ~empty, -float("inf")), -1).masked_fill(empty, 0.0)),
        (lambda v: PF.scaled_upper_triang_masked_softmax(v[..., :4].flatten(0, 1), 0.5),
         lambda v: F.softmax((v[..., :4].flatten(0, 1) * 0.5).masked_fill(cm, -float("inf")), -1)),
    ]
    for fn, ref in cases:
        def second(f):
            return jvp(lambda v: jvp(f, (v,), (t,))[1], (x,), (t,))[1]

        got, want = second(fn), second(ref)
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)

        def loss(f):
            return lambda v: (f(v) ** 2).sum() + f(v).sum(-1).pow(2).sum()

        torch.testing.assert_close(jacfwd(jacfwd(loss(fn)))(x), jacfwd(jacfwd(loss(ref)))(x),
                                   rtol=1e-10, atol=1e-12)


def test_softmax_accepts_what_F_softmax_accepts():
    import numpy as np

    ints = torch.arange(5)
    torch.testing.assert_close(PF.softmax(ints, -1, dtype=torch.float32), F.softmax(ints, -1, dtype=torch.float32))
    x = torch.randn(2, 3)
    torch.testing.assert_close(PF.softmax(x, np.int64(1)), F.softmax(x, 1))
    with pytest.raises(TypeError, match="dim"):
        PF.softmax(x, 1.0)
    with pytest.raises(TypeError, match="floating"):
        PF.softmax(ints, -1)


def test_a_mask_without_its_leading_dims_says_so():
    """A 3-D mask (which PyTorch would broadcast from the right) was refused with "expected ... broadcastable to
    [2, 3, 4, 5]", which it is; the message now says that 4 dims are expected and how to add them."""
    x = torch.randn(2, 3, 4, 5)
    with pytest.raises(ValueError, match=r"mask: expected 4 dims .* got 3-D shape \[1, 4, 5\]: add the missing"):
        fusion.scaled_masked_softmax(x, torch.zeros(1, 4, 5, dtype=torch.bool), 1.0)


def test_the_softmaxes_compile_to_one_graph_under_autocast():
    """A code review: under autocast the scaled softmaxes took the dispatcher's path while torch.compile traced them
    (its locks broke the graph: 4 graphs, 3 breaks for one call); they now emit the reference there too, in the
    output dtype F.softmax has under autocast, and compute what the eager call does."""
    import torch._dynamo as dynamo

    x = torch.randn(2, 3, 8, 8)
    mask = torch.rand(2, 1, 8, 8) < 0.3

    def f(t):
        return fusion.scaled_masked_softmax(t, mask, 0.5) + fusion.scaled_upper_triang_masked_softmax(t[0], 0.5)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = f(x)
        dynamo.reset()
        explained = dynamo.explain(f)(x)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        dynamo.reset()
        got = torch.compile(f, backend="eager")(x)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want)
