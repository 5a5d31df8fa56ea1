"""CPU: layer_norm / rms_norm reference paths against float64, output dtypes against PyTorch, and the modules
as drop-ins (state_dict keys, parameter identity)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tolerances import TOLERANCES

from pipegoose.nn.fusion import dispatch
from pipegoose.nn.fusion import functional as PF
from pipegoose.nn.fusion.fuse import fuse
from pipegoose.nn.fusion.modules import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def ln64(x, shape, w, b, eps):
    dims = tuple(range(x.dim() - len(shape), x.dim()))
    x = x.double()
    mu = x.mean(dims, keepdim=True)
    var = ((x - mu) ** 2).mean(dims, keepdim=True)
    y = (x - mu) / torch.sqrt(var + eps)
    if w is not None:
        y = y * w.double()
    if b is not None:
        y = y + b.double()
    return y


def rms64(x, shape, w, eps):
    dims = tuple(range(x.dim() - len(shape), x.dim()))
    x = x.double()
    y = x / torch.sqrt((x * x).mean(dims, keepdim=True) + eps)
    return y if w is None else y * w.double()


def grads(fn, tensors, dy):
    ts = [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]
    y = fn(*ts)
    y.backward(dy.to(y.dtype))
    return y.detach(), [None if t is None else t.grad for t in ts]


def close(a, b, dtype, scale=1.0):
    t = TOLERANCES[dtype]
    torch.testing.assert_close(a.double(), b.double(), atol=t["atol"] * scale, rtol=t["rtol"] * scale)


@pytest.mark.parametrize("xdt", DTYPES)
@pytest.mark.parametrize("pdt", ["same", torch.float32])
@pytest.mark.parametrize("shape,nshape", [((3, 7, 33), (33,)), ((2, 5, 4, 6), (4, 6)), ((1, 1), (1,)),
                                          ((4, 1031), (1031,))])
def test_layer_norm_reference(xdt, pdt, shape, nshape):
    pdt = xdt if pdt == "same" else pdt
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * 2 + 0.5
    w = torch.randn(nshape, generator=g)
    b = torch.randn(nshape, generator=g)
    dy = torch.randn(shape, generator=g)
    y, (dx, dw, db) = grads(lambda a, c, d: PF.layer_norm(a, nshape, c, d, 1e-5), [x.to(xdt), w.to(pdt), b.to(pdt)], dy)
    y64, (dx64, dw64, db64) = grads(lambda a, c, d: ln64(a, nshape, c, d, 1e-5), [x.double(), w.double(), b.double()],
                                    dy.double())
    # output dtype: what torch.nn.LayerNorm gives for these dtypes
    assert y.dtype == F.layer_norm(x.to(xdt), nshape, w.to(pdt), b.to(pdt)).dtype == xdt
    assert dx.dtype == xdt and dw.dtype == pdt and db.dtype == pdt
    low = xdt if xdt != torch.float32 else pdt
    close(y, y64, low, 2)
    close(dx, dx64, low, 4)
    # parameter grads sum over rows: error grows with the row count
    close(dw, dw64, low, 8)
    close(db, db64, low, 8)
    assert dispatch.stats()["layer_norm"] == {"torch": 1}


@pytest.mark.parametrize("affine,bias", [(False, False), (True, False)])
def test_layer_norm_without_params(affine, bias):
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    m = torch.nn.LayerNorm(16, elementwise_affine=affine, bias=bias)
    f = FusedLayerNorm.from_layer_norm(m)
    torch.testing.assert_close(f(x), m(x))
    y64 = ln64(x, (16,), m.weight, m.bias, m.eps)
    close(f(x), y64, torch.bfloat16)


def test_layer_norm_fp32_input_half_params_gives_fp32():
    x = torch.randn(4, 8)
    w = torch.randn(8).bfloat16()
    y = PF.layer_norm(x, 8, w, None)
    assert y.dtype == torch.float32
    close(y, ln64(x, (8,), w, None, 1e-5), torch.float32)


@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
def test_layer_norm_autocast_cpu_matches_nn_layernorm(xdt):
    m = torch.nn.LayerNorm(32)
    f = FusedLayerNorm.from_layer_norm(m)
    x = torch.randn(3, 32, dtype=xdt)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = m(x)
        got = f(x)
    assert got.dtype == want.dtype
    close(got, want, want.dtype)


@pytest.mark.parametrize("eps", [True, 0, 2, np.float32(1e-5), np.float16(1e-3), np.int64(1), np.bool_(True),
                                 torch.tensor(1e-5), torch.tensor(1e-5, dtype=torch.float64)],
                         ids=lambda e: f"{type(e).__name__}({e!r})")
def test_eps_of_any_type_torch_takes(eps):
    """eps as F.layer_norm / F.rms_norm take it (Python bools and ints, numpy scalars, 0-d tensors) gives their
    result, in the functions, the modules and a fused model (whose modules kept such an eps)."""
    x, w, b = torch.randn(3, 8), torch.randn(8), torch.randn(8)
    torch.testing.assert_close(PF.layer_norm(x, (8,), w, b, eps), F.layer_norm(x, (8,), w, b, eps))
    torch.testing.assert_close(PF.rms_norm(x, (8,), w, eps), F.rms_norm(x, (8,), w, eps))
    model = torch.nn.Sequential(torch.nn.LayerNorm(8, eps=eps), torch.nn.RMSNorm(8, eps=eps))
    want = model(x)
    report = fuse(model)
    assert len(report.fused_rows("layer_norm")) == 1 and len(report.fused_rows("rms_norm")) == 1, report
    torch.testing.assert_close(model(x), want)


def test_tensor_eps_is_checked_on_every_call():
    """A 0-d tensor eps may change in place between calls: it takes no part in the choice cache, so each call checks
    its value (a cached call with a float eps would not)."""
    x = torch.randn(3, 8)
    eps = torch.tensor(1e-5)
    PF.layer_norm(x, (8,), eps=eps)
    PF.rms_norm(x, (8,), eps=eps)
    eps.fill_(-1.0)
    with pytest.raises(ValueError, match="^eps: expected a finite number"):
        PF.layer_norm(x, (8,), eps=eps)
    with pytest.raises(ValueError, match="^eps: expected a finite number"):
        PF.rms_norm(x, (8,), eps=eps)


@pytest.mark.parametrize("eps,err", [("a", TypeError), (torch.tensor([1e-5]), TypeError), (1j, TypeError),
                                     (-1.0, ValueError), (float("inf"), ValueError), (float("nan"), ValueError)])
def test_eps_errors_name_it(eps, err):
    """What F.layer_norm rejects is a TypeError here too; a negative or non-finite eps (which PyTorch computes with)
    is a ValueError: no kernel of ours takes it."""
    x = torch.randn(3, 8)
    with pytest.raises(err, match="^eps: expected a"):
        PF.layer_norm(x, (8,), eps=eps)
    with pytest.raises(err, match="^eps: expected a"):
        PF.rms_norm(x, (8,), eps=eps)


def test_variance_epsilon_errors_name_it():
    """FusedRMSNorm.variance_epsilon (the Llama-style name of eps) named eps in its errors (walkthrough); the value
    set is still read as eps."""
    m = FusedRMSNorm(8)
    with pytest.raises(TypeError, match="^variance_epsilon: expected a number or None"):
        m.variance_epsilon = "x"
    with pytest.raises(ValueError, match="^variance_epsilon: expected a finite number"):
        m.variance_epsilon = -1.0
    m.variance_epsilon = 1e-3
    assert m.eps == 1e-3 and m.variance_epsilon == 1e-3


def test_layer_norm_errors():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="x: expected shape"):
        PF.layer_norm(x, (7,))
    with pytest.raises(ValueError, match="weight"):
        PF.layer_norm(x, (8,), torch.ones(7))
    with pytest.raises(ValueError, match="eps"):
        PF.layer_norm(x, (8,), eps=-1.0)
    with pytest.raises(TypeError, match="normalized_shape"):
        PF.layer_norm(x, "8")


@pytest.mark.parametrize("xdt", DTYPES)
@pytest.mark.parametrize("wdt", ["same", torch.float32])
@pytest.mark.parametrize("cast_before_weight", [False, True])
@pytest.mark.parametrize("shape,nshape", [((3, 7, 33), (33,)), ((2, 4, 6), (4, 6)), ((5, 1), (1,))])
def test_rms_norm_reference(xdt, wdt, cast_before_weight, shape, nshape):
    wdt = xdt if wdt == "same" else wdt
    g = torch.Generator().manual_seed(sum(shape) + 7)
    x = torch.randn(shape, generator=g)
    w = torch.randn(nshape, generator=g)
    dy = torch.randn(shape, generator=g)
    fn = lambda a, c: PF.rms_norm(a, nshape, c, 1e-6, cast_before_weight=cast_before_weight)  # noqa: E731
    y, (dx, dw) = grads(fn, [x.to(xdt), w.to(wdt)], dy)
    y64, (dx64, dw64) = grads(lambda a, c: rms64(a, nshape, c, 1e-6), [x.double(), w.double()], dy.double())
    if cast_before_weight:
        assert y.dtype == torch.promote_types(xdt, wdt)
    else:
        assert y.dtype == xdt
    low = xdt if xdt != torch.float32 else wdt
    close(y, y64, low, 2)
    close(dx, dx64, low, 4)
    close(dw, dw64, low, 8)


@pytest.mark.parametrize("xdt", DTYPES)
@pytest.mark.parametrize("wdt", DTYPES)
def test_rms_norm_matches_F_rms_norm_exactly(xdt, wdt):
    x = torch.randn(6, 64, dtype=xdt)
    w = torch.randn(64, dtype=wdt)
    with warnings.catch_warnings():  # F.rms_norm warns on mixed dtypes
        warnings.simplefilter("ignore")
        want = F.rms_norm(x, (64,), w, 1e-5)
    got = PF.rms_norm(x, 64, w, 1e-5)
    assert got.dtype == want.dtype == xdt
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # default eps is F.rms_norm's
    torch.testing.assert_close(PF.rms_norm(x, 64, None), F.rms_norm(x, (64,), None))


@pytest.mark.parametrize("xdt", DTYPES)
@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers_llama_bitwise(xdt, wdt):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    m = llama.LlamaRMSNorm(48, eps=1e-6).to(wdt)
    with torch.no_grad():
        m.weight.copy_(torch.randn(48))
    f = FusedRMSNorm.from_module(m)
    assert f.weight is m.weight and f.cast_before_weight and f.eps == 1e-6
    x = torch.randn(3, 5, 48, dtype=xdt)
    want, got = m(x), f(x)
    assert got.dtype == want.dtype
    assert torch.equal(got, want)


def test_fused_rms_norm_from_torch_rmsnorm():
    m = torch.nn.RMSNorm(24, eps=1e-5)
    with torch.no_grad():
        m.weight.uniform_(0.5, 1.5)
    f = FusedRMSNorm.from_module(m)
    assert f.weight is m.weight and not f.cast_before_weight
    x = torch.randn(4, 24, dtype=torch.bfloat16)
    torch.testing.assert_close(f(x), m(x), rtol=0, atol=0)
    assert list(f.state_dict()) == list(m.state_dict()) == ["weight"]
    g = FusedRMSNorm(hidden_size=24)
    g.load_state_dict(m.state_dict())
    torch.testing.assert_close(g.weight, m.weight)


@pytest.mark.parametrize("cls", [FusedLayerNorm, MixedFusedLayerNorm])
@pytest.mark.parametrize("kw", [{}, {"bias": False}, {"elementwise_affine": False}, {"dtype": torch.bfloat16}])
def test_fused_layer_norm_is_a_drop_in(cls, kw):
    ref = torch.nn.LayerNorm((4, 6), eps=1e-6, **kw)
    new = cls((4, 6), eps=1e-6, **kw)
    assert list(new.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in new.named_parameters()] == [n for n, _ in ref.named_parameters()]
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_()
    new.load_state_dict(ref.state_dict())
    ref.load_state_dict(new.state_dict())
    x = torch.randn(3, 4, 6, dtype=kw.get("dtype", torch.float32))
    close(new(x), ref(x), x.dtype)
    # from_layer_norm shares the very same Parameter objects
    f = cls.from_layer_norm(ref)
    assert f.weight is ref.weight and f.bias is ref.bias
    assert list(f.state_dict()) == list(ref.state_dict())
    assert isinstance(f, torch.nn.LayerNorm) and f.normalized_shape == ref.normalized_shape
    close(f(x), ref(x), x.dtype)
    if ref.weight is not None:
        f(x).sum().backward()
        assert ref.weight.grad is not None


def test_from_layer_norm_rejects_other_modules():
    with pytest.raises(TypeError, match="module"):
        FusedLayerNorm.from_layer_norm(torch.nn.Linear(3, 3))
    with pytest.raises(TypeError, match="module"):
        FusedRMSNorm.from_module(torch.nn.ReLU())
    with pytest.raises(TypeError, match="only parameter"):
        FusedRMSNorm.from_module(torch.nn.Linear(16, 16))

    class NoEps(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))

    with pytest.raises(ValueError, match=r"^eps: NoEps has no 'variance_epsilon', 'eps', 'epsilon'; pass eps="):
        FusedRMSNorm.from_module(NoEps(), verify=False)
    with pytest.raises(ValueError, match="does not pass the RMSNorm probe"):  # no forward to check
        FusedRMSNorm.from_module(NoEps(), eps=1e-6)
    with pytest.raises(ValueError, match="does not pass the RMSNorm probe"):  # the probe first, then eps
        FusedRMSNorm.from_module(NoEps())
    assert FusedRMSNorm.from_module(NoEps(), eps=1e-6, verify=False).eps == 1e-6
    # not a module at all; a Linear without bias (one 'weight'): the probe's reason, not a request for eps (a
    # fresh-clone walkthrough: "pass eps=" was asked first, and the probe's error came only after)
    for bad in (None, "x"):
        with pytest.raises(TypeError, match=r"^module: expected torch.nn.RMSNorm or an RMSNorm-style"):
            FusedRMSNorm.from_module(bad)
    with pytest.raises(ValueError, match=r"Linear does not pass the RMSNorm probe: parameter 'weight' is 2-D"):
        FusedRMSNorm.from_module(torch.nn.Linear(8, 8, bias=False))


class _OffsetWeightRMSNorm(torch.nn.Module):
    """Gemma's formula with another offset: x * rsqrt(mean(x^2) + eps) * (offset + weight), with an RMSNorm's
    parameter and eps (offset 1.0: Gemma's)."""

    def __init__(self, n: int, eps: float = 1e-6, offset: float = 2.0):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = torch.nn.Parameter(torch.zeros(n))

    def forward(self, x):
        h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (self.offset + self.weight.float())).to(x.dtype)


def test_rms_norm_from_module_refuses_another_formula():
    """FusedRMSNorm.from_module(GemmaRMSNorm) returned a module whose output differed by up to 2.55 from the original,
    without a word (a fresh-clone walkthrough; fuse() skipped such norms by its probe). from_module now runs that
    probe: another formula is a ValueError with the probe's reason, verify=False takes the module on the caller's
    word. Gemma's own (1 + weight) is a formula FusedRMSNorm computes since (weight_offset=1.0); (2 + weight) is not."""
    m = _OffsetWeightRMSNorm(16)
    with torch.no_grad():
        m.weight.normal_()
    with pytest.raises(ValueError, match="does not pass the RMSNorm probe: output differs from the RMSNorm formula"):
        FusedRMSNorm.from_module(m)
    assert FusedRMSNorm.from_module(m, verify=False).weight is m.weight
    gemma = pytest.importorskip("transformers.models.gemma.modeling_gemma")
    f = FusedRMSNorm.from_module(gemma.GemmaRMSNorm(16))
    assert f.weight_offset == 1.0 and f.output_in_input_dtype and not f.cast_before_weight
    # Gemma's formula, given the wrong offset: refused, naming it
    with pytest.raises(ValueError, match=r"computes x_normed \* \(1.0 \+ weight\): pass weight_offset=1.0 or leave "
                                         r"it None \(got 2.0\)"):
        FusedRMSNorm.from_module(_OffsetWeightRMSNorm(16, offset=1.0), weight_offset=2.0)


def test_rms_norm_from_module_checks_the_rounding_flags():
    """The rounding flags default to what the probe finds (an OLMo-2-style norm: one rounding, the output in the
    input's dtype; T5's: the weight's dtype); a flag given that contradicts the probe is refused, naming the values."""
    olmo2 = pytest.importorskip("transformers.models.olmo2.modeling_olmo2")
    m = olmo2.Olmo2RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        m.weight.uniform_(0.5, 1.5)
    f = FusedRMSNorm.from_module(m)
    assert f.output_in_input_dtype and not f.cast_before_weight
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    assert torch.equal(f(x), m(x))
    with pytest.raises(ValueError, match=r"output_in_input_dtype=True does: pass those or leave them None \(got None, "
                                         r"False\)"):
        FusedRMSNorm.from_module(m, output_in_input_dtype=False)
    assert not FusedRMSNorm.from_module(m, output_in_input_dtype=False, verify=False).output_in_input_dtype
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    n = t5.T5LayerNorm(16, eps=1e-6).to(torch.bfloat16)
    g = FusedRMSNorm.from_module(n)
    assert g.output_in_weight_dtype
    assert torch.equal(g(x.float()), n(x.float())) and g(x.float()).dtype == torch.bfloat16


@pytest.mark.parametrize("module", [torch.nn.LayerNorm(8, bias=False), torch.nn.LayerNorm(8, elementwise_affine=False),
                                    torch.nn.GroupNorm(2, 8), torch.nn.InstanceNorm1d(8, affine=True)],
                         ids=["layernorm-no-bias", "layernorm-no-affine", "groupnorm", "instancenorm"])
def test_rms_norm_from_module_refuses_mean_subtracting_norms(module):
    """A bias-free nn.LayerNorm has exactly an RMSNorm's parameters (weight, eps): from_module took it and gave an
    RMSNorm's output (max error 2.6 on inputs of mean 3, found by a new user's walkthrough)."""
    with pytest.raises(TypeError, match="subtracts the mean"):
        FusedRMSNorm.from_module(module)


def test_a_0d_tensor_eps_that_requires_grad():
    """A 0-d tensor eps is accepted (as F.layer_norm's callers pass it); the LayerNorm passed the tensor itself to
    F.layer_norm, which refuses it, after a "converting a tensor that requires grad" warning; a meta one (no value) is
    the TypeError naming eps."""
    from pipegoose.nn.fusion.functional import layer_norm, rms_norm

    x = torch.randn(3, 8)
    eps = torch.tensor(1e-3, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(layer_norm(x, 8, eps=eps), F.layer_norm(x, (8,), eps=1e-3))
        torch.testing.assert_close(rms_norm(x, 8, eps=eps), F.rms_norm(x, (8,), eps=1e-3))
    with pytest.raises(TypeError, match="eps: .* without a value"):
        layer_norm(x, 8, eps=torch.tensor(1e-3, device="meta"))


def test_normalized_shape_must_be_integers():
    import numpy as np

    x = torch.randn(2, 8)
    with pytest.raises(TypeError, match="normalized_shape"):
        PF.layer_norm(x, (8.5,))
    with pytest.raises(TypeError, match="normalized_shape"):
        PF.rms_norm(x, [8.0])
    torch.testing.assert_close(PF.layer_norm(x, (np.int64(8),)), F.layer_norm(x, (8,)))


def test_module_fast_path_for_small_inputs(monkeypatch):
    """MixedFusedLayerNorm / FusedRMSNorm call the native op directly below PIPEGOOSE_SMALL_NUMEL elements (what the
    dispatcher's small-problem rule chooses, without its per-call cost); an impl argument, a PIPEGOOSE_IMPL_*
    variable, mixed dtypes or Llama rounding go through the dispatcher; PIPEGOOSE_SMALL_NUMEL=0 turns it off."""
    from pipegoose.nn.fusion import dispatch
    from pipegoose.nn.fusion.modules import FusedRMSNorm, MixedFusedLayerNorm
    from pipegoose.nn.fusion.ops import _common

    monkeypatch.setattr(_common, "on_kernel_device", lambda t: t.dtype != torch.float64)   # the rule applies where our kernels run
    monkeypatch.delenv("PIPEGOOSE_SMALL_NUMEL", raising=False)
    monkeypatch.delenv("PIPEGOOSE_IMPL_LAYER_NORM", raising=False)
    monkeypatch.delenv("PIPEGOOSE_IMPL_RMS_NORM", raising=False)
    x = torch.randn(3, 5, 64)
    ln = MixedFusedLayerNorm(64)
    torch.nn.init.normal_(ln.weight)
    rms = FusedRMSNorm(64, eps=1e-6)
    for mod, ref, op in ((ln, lambda: torch.nn.functional.layer_norm(x, (64,), ln.weight, ln.bias, 1e-5), "layer_norm"),
                         (rms, lambda: torch.nn.functional.rms_norm(x, (64,), rms.weight, 1e-6), "rms_norm")):
        assert torch.equal(mod(x), ref())
        assert dispatch.last_choice(op).source == "small"
        monkeypatch.setenv(f"PIPEGOOSE_IMPL_{op.upper()}", "torch")
        mod(x)
        assert dispatch.last_choice(op).source == "env"
        monkeypatch.delenv(f"PIPEGOOSE_IMPL_{op.upper()}")
        monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "0")
        mod(x)
        assert dispatch.last_choice(op).source != "small"
        monkeypatch.delenv("PIPEGOOSE_SMALL_NUMEL")
        # an empty input is the dispatcher's "empty" (no kernel has anything to compute), not a small problem: the
        # module's shortcut counted it as "small", where the functional op said "empty"
        x0 = x[:0]
        assert mod(x0).shape == x0.shape and dispatch.last_choice(op).source == "empty"
    ln.impl = "torch"
    ln(x)
    assert dispatch.last_choice("layer_norm").source == "argument"
    dispatch.reset_stats()
    FusedRMSNorm(64, eps=1e-6, cast_before_weight=True)(x)   # Llama rounding: the dispatcher's eager formula
    assert "module fast path" not in dispatch.last_choice("rms_norm").reason
    # arguments the dispatcher would refuse go to it, whatever the size: its errors name them
    with pytest.raises(ValueError, match="eps"):
        MixedFusedLayerNorm(64, eps=-1.0)(x)
    with pytest.raises(ValueError):
        MixedFusedLayerNorm(32)(x)
    # float64 (no kernel takes it): the dispatcher's choice, a fallback that strict mode sees
    with dispatch.strict(), pytest.raises(dispatch.FusionFallbackError):
        MixedFusedLayerNorm(64).double()(x.double())
    # rows wider than our kernels take (65536): a fallback too, not the small rule (the shortcut counted it "small", and
    # strict mode did not raise where the functional op does)
    wide = torch.randn(2, 65537)
    for mod in (MixedFusedLayerNorm(65537), FusedRMSNorm(65537)):
        with dispatch.strict(), pytest.raises(dispatch.FusionFallbackError, match="would fall back to torch"):
            mod(wide)


def test_module_fast_path_leaves_cpu_to_the_dispatcher():
    """Off CUDA our kernels cannot run, so the native op there is a fallback: strict mode raises (it did not when
    the module took the fast path on any device)."""
    from pipegoose.nn.fusion import dispatch
    from pipegoose.nn.fusion.modules import FusedRMSNorm, MixedFusedLayerNorm

    x = torch.randn(3, 5, 64)
    for mod in (MixedFusedLayerNorm(64), FusedRMSNorm(64, eps=1e-6)):
        with dispatch.strict(), pytest.raises(dispatch.FusionFallbackError):
            mod(x)


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(normalized_shape=-4), ValueError, r"normalized_shape: expected a size >= 0, got -4"),
    (dict(normalized_shape=(4, -1)), ValueError, r"normalized_shape: expected sizes >= 0"),
    (dict(normalized_shape=4.0), TypeError, r"normalized_shape: expected an int or a sequence of ints"),
    (dict(normalized_shape=True), TypeError, r"normalized_shape: expected an int or a sequence of ints"),
    (dict(normalized_shape=(4, True)), TypeError, r"normalized_shape: expected an int or a sequence of ints"),
    (dict(normalized_shape=[torch.tensor(True)]), TypeError, r"normalized_shape: expected an int or a sequence"),
    (dict(normalized_shape=4, eps=-1e-5), ValueError, r"eps: expected a finite number >= 0"),
    (dict(normalized_shape=4, eps=float("inf")), ValueError, r"eps: expected a finite number >= 0"),
    (dict(normalized_shape=4, eps="1e-5"), TypeError, r"eps: expected a number"),
    (dict(normalized_shape=4, impl="nope"), ValueError, r"impl: \w+ has no implementation 'nope'"),
    (dict(normalized_shape=4, impl=1), TypeError, r"impl: expected an implementation name"),
])
@pytest.mark.parametrize("cls_name", ["MixedFusedLayerNorm", "FusedLayerNorm", "FusedRMSNorm"])
def test_norm_modules_check_their_arguments_when_built(cls_name, kwargs, err, match):
    """The norm modules checked eps, impl and the size only at the first forward (and a negative size gave torch's
    'Trying to create tensor with negative dimension'); now the constructor raises, naming the argument, what the
    functional ops would refuse at every call."""
    from pipegoose.nn.fusion import modules

    with pytest.raises(err, match=match):
        getattr(modules, cls_name)(**kwargs, elementwise_affine=False)
    if "normalized_shape" in match:
        with pytest.raises(err, match=match):
            getattr(modules, cls_name)(**kwargs)            # with a weight: before torch.ones(-4) is tried


def test_norm_module_arguments_checked_when_built_rms_and_copies():
    from pipegoose.nn.fusion.modules import FusedRMSNorm, MixedFusedLayerNorm

    with pytest.raises(ValueError, match="hidden_size: expected a size >= 0, got -4"):
        FusedRMSNorm(hidden_size=-4)
    with pytest.raises(TypeError, match="cast_before_weight: expected a bool, got int"):
        FusedRMSNorm(4, cast_before_weight=1)
    with pytest.raises(ValueError, match="impl: rms_norm has no implementation 'apex'"):
        FusedRMSNorm(4, impl="apex")                         # a layer_norm implementation, not an rms_norm one
    with pytest.raises(ValueError, match="impl: layer_norm has no implementation 'nope'"):
        MixedFusedLayerNorm.from_layer_norm(torch.nn.LayerNorm(4), impl="nope")
    with pytest.raises(ValueError, match="eps: expected a finite number >= 0 or None"):
        FusedRMSNorm.from_module(torch.nn.RMSNorm(4, eps=-1.0))
    # what the functional ops take still builds, and computes what it did
    x = torch.randn(3, 4)
    for eps in (1e-5, 0, True, np.float32(1e-5), np.int64(0), torch.tensor(1e-5)):
        ln = MixedFusedLayerNorm(np.int64(4), eps=eps, impl="auto")
        assert ln.normalized_shape == (4,)
        assert torch.equal(ln(x), F.layer_norm(x, (4,), ln.weight, ln.bias, float(eps)))
        rms = FusedRMSNorm([4], eps=eps, impl="torch")
        assert torch.equal(rms(x), F.rms_norm(x, (4,), rms.weight, float(eps)))
    assert FusedRMSNorm(hidden_size=4, eps=None).normalized_shape == (4,)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_input_is_a_type_error_naming_the_argument(dtype):
    """float8 input gave torch's '"LayerNormKernelImpl" not implemented for 'Float8_e4m3fn'' (layer_norm, rms_norm,
    the modules) on some paths and an fp8 result on others (Llama rounding, a wider weight); now a TypeError naming x
    (or the float8 parameter) and the dtypes taken, on every path (float64 runs the reference path, as before)."""
    from pipegoose.nn.fusion.modules import FusedRMSNorm, MixedFusedLayerNorm

    x = torch.randn(3, 8).to(dtype)
    w = torch.ones(8)
    match = r"^x: expected dtype float32, float16, bfloat16 or float64, got float8_e\w+ \(no fused kernel"
    for fn in (lambda: PF.layer_norm(x, (8,)), lambda: PF.layer_norm(x, (8,), w, w),
               lambda: PF.mixed_fused_layer_norm(x, (8,), w), lambda: PF.rms_norm(x, (8,)),
               lambda: PF.rms_norm(x, (8,), w), lambda: PF.rms_norm(x, (8,), w, 1e-6, cast_before_weight=True),
               lambda: dispatch.explain("rms_norm", x, (8,))):
        with pytest.raises(TypeError, match=match):
            fn()
    for fn in (lambda: MixedFusedLayerNorm(8)(x), lambda: FusedRMSNorm(8)(x),   # the modules' argument: input
               lambda: FusedRMSNorm(8, eps=1e-6, cast_before_weight=True)(x)):
        with pytest.raises(TypeError, match=match.replace("^x", "^input")):
            fn()
    # a float8 parameter: refused too (Llama rounding failed in torch's type promotion, other paths upcast it)
    w8, xf = torch.ones(8).to(dtype), torch.randn(3, 8)
    for name, fn in (("weight", lambda: PF.layer_norm(xf, (8,), w8)), ("bias", lambda: PF.layer_norm(xf, (8,), w, w8)),
                     ("weight", lambda: PF.rms_norm(xf, (8,), w8)),
                     ("weight", lambda: PF.rms_norm(xf, (8,), w8, 1e-6, cast_before_weight=True))):
        with pytest.raises(TypeError, match=match.replace("^x", f"^{name}")):
            fn()
    x64 = x.double()
    torch.testing.assert_close(PF.layer_norm(x64, (8,)), F.layer_norm(x64, (8,)), **TOLERANCES[torch.float32])
    torch.testing.assert_close(PF.rms_norm(x64, (8,)), F.rms_norm(x64, (8,)), **TOLERANCES[torch.float32])


def test_cast_before_weight_is_checked_whatever_the_cache_holds():
    """1 and numpy's bool equal True/False and hash alike, and the choice cache keyed cast_before_weight by value: a
    call with True cached first let cast_before_weight=1 through, which a first call refuses. Now refused either
    way."""
    from pipegoose.nn.fusion.functional import rms_norm

    x = torch.randn(4, 8)
    for good, bad in ((True, 1), (False, 0), (True, np.bool_(True)), (False, np.bool_(False))):
        dispatch.clear_choice_cache()
        with pytest.raises(TypeError, match="cast_before_weight: expected a bool"):
            rms_norm(x, (8,), cast_before_weight=bad)           # a first call: refused
        rms_norm(x, (8,), cast_before_weight=good)
        with pytest.raises(TypeError, match="cast_before_weight: expected a bool"):
            rms_norm(x, (8,), cast_before_weight=bad)           # after the valid call was cached: refused too


def test_cached_choice_does_not_skip_argument_checks():
    """(8.0,) equals (8,) and hashes alike: a valid call cached first must not let the invalid one through."""
    from pipegoose.nn.fusion.functional import layer_norm, rms_norm

    x = torch.randn(4, 8)
    for fn in (layer_norm, rms_norm):
        fn(x, (8,))
        with pytest.raises(TypeError, match="normalized_shape"):
            fn(x, (8.0,))
    rms_norm(x, (8,), cast_before_weight=True)
    with pytest.raises(TypeError, match="cast_before_weight"):
        rms_norm(x, (8,), cast_before_weight="no")


def test_error_messages_name_the_argument():
    """Found by a new user: each of these blamed another argument or did not say what was expected."""
    from pipegoose.nn.fusion import fuse, unfuse
    from pipegoose.nn.fusion.functional import layer_norm, softmax

    x = torch.randn(4, 8)
    with pytest.raises(TypeError, match="weight: .* got int64"):
        layer_norm(x, 8, torch.ones(8, dtype=torch.long))
    for bad in (-8, 0, (8, -1)):
        with pytest.raises(ValueError, match="normalized_shape"):
            layer_norm(x, bad)
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        unfuse("abc")
    with pytest.raises(TypeError, match="ops: "):
        fuse(torch.nn.Linear(2, 2), ops=5)
    with pytest.raises(TypeError, match="dtype: "):
        softmax(x, -1, dtype=torch.int32)
    with pytest.raises(TypeError, match="impl: "):
        softmax(x, -1, impl=3)


def test_explain_errors_say_what_to_pass():
    from pipegoose.nn.fusion import dispatch

    with pytest.raises(KeyError, match="softmax.masked"):
        dispatch.explain("attention", torch.randn(2, 2))
    with pytest.raises(TypeError, match="functional arguments"):
        dispatch.explain("layer_norm")


def test_fused_adam_refuses_bad_types():
    from pipegoose.nn.fusion import FusedAdam

    with pytest.raises(TypeError, match="lr: expected a number"):
        FusedAdam([torch.nn.Parameter(torch.ones(3))], lr="a")
    with pytest.raises(TypeError, match="floating point parameters"):
        FusedAdam([torch.ones(3, dtype=torch.long)])


@pytest.mark.parametrize("xdt", [torch.float16, torch.bfloat16], ids=str)
def test_layer_norm_reference_fp64_parameters_of_half_input_are_not_rounded_down(xdt):
    """A fp64 weight of a 16-bit input is not rounded to the input's dtype (1e5 overflowed fp16 to inf before): the
    reference computes in fp64 and rounds the result once; gradients keep each tensor's dtype."""
    x = torch.tensor([[-3.0, -1.0, 1.0, 3.0]], dtype=xdt, requires_grad=True)
    w = torch.tensor([1.0, 1.0, 1e5, 1.0], dtype=torch.float64, requires_grad=True)
    b = torch.tensor([0.5, 0.0, 0.0, -0.5], dtype=torch.float64, requires_grad=True)
    y = PF.layer_norm(x, 4, w, b, 0.0)
    want = F.layer_norm(x.detach().double(), (4,), w.detach(), b.detach(), 0.0).to(xdt)
    assert y.dtype == xdt and torch.isfinite(y).all()
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    y.float().sum().backward()
    assert x.grad.dtype == xdt and w.grad.dtype == b.grad.dtype == torch.float64


def test_norm_arguments_numpy_sizes_and_flag_types():
    """The functional norms took a numpy integer size only inside a sequence (a bare np.int64 was a TypeError, though
    the modules take it, as torch.nn.LayerNorm does); FusedRMSNorm's output_in_weight_dtype took any value ("no" turned
    T5's rule on), where its other flags must be bools."""
    import numpy as np

    from pipegoose.nn.fusion import functional as PF
    from pipegoose.nn.fusion.modules import FusedRMSNorm

    x = torch.randn(3, 16)
    assert torch.equal(PF.layer_norm(x, np.int64(16)), torch.nn.functional.layer_norm(x, (16,)))
    assert torch.equal(PF.rms_norm(x, np.int32(16), eps=1e-6), torch.nn.functional.rms_norm(x, (16,), eps=1e-6))
    with pytest.raises(ValueError, match="normalized_shape: expected a size >= 0"):
        PF.layer_norm(x, np.int64(-1))
    with pytest.raises(TypeError, match="normalized_shape: expected an int"):
        PF.rms_norm(x, np.float32(16))
    with pytest.raises(TypeError, match="output_in_weight_dtype: expected a bool, got str"):
        FusedRMSNorm(16, output_in_weight_dtype="no")


@pytest.mark.parametrize("xdt,pdt", [(torch.float32, None), (torch.float32, "same"), (torch.bfloat16, "same"),
                                     (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                     (torch.float64, "same")], ids=str)
@pytest.mark.parametrize("shape,nshape", [((4, 0), (0,)), ((3, 2, 0), (2, 0)), ((0, 0), (0,)), ((0, 8), (8,))])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_empty_inputs_as_pytorch(xdt, pdt, shape, nshape, device):
    """A zero-size normalized_shape (x [4, 0] with (0,)) was a ValueError, where F.layer_norm and F.rms_norm return an
    empty tensor (and empty gradients); an empty batch ([0, 8]) already ran. Both now give exactly what PyTorch gives,
    output and gradients (weight and bias gradients of an empty batch: zeros), on the reference path; on a GPU too,
    in strict mode (an empty input is no fallback)."""
    pdt = xdt if pdt == "same" else pdt
    x = torch.randn(shape, dtype=xdt, device=device)
    w = None if pdt is None else torch.randn(nshape, dtype=pdt, device=device)
    b = None if pdt is None else torch.randn(nshape, dtype=pdt, device=device)
    dy = torch.randn(shape, dtype=xdt, device=device)
    with warnings.catch_warnings(), dispatch.strict(device == "cuda"):
        warnings.simplefilter("ignore")  # F.rms_norm: "Mismatch dtype between input and weight"
        for ours, theirs, params in (
                (lambda x_, w_, b_: PF.layer_norm(x_, nshape, w_, b_), F.layer_norm, (x, w, b)),
                (lambda x_, w_: PF.rms_norm(x_, nshape, w_), F.rms_norm, (x, w))):
            y, gs = grads(ours, params, dy)
            try:
                want, want_gs = grads(lambda *t: theirs(t[0], nshape, *t[1:]), params, dy)
            except RuntimeError as e:
                # F.layer_norm on CUDA refuses a 16-bit input with fp32 parameters ("expected scalar type"), which
                # ours takes (input and parameter dtypes are independent): PyTorch's answer is then its CPU one
                assert device == "cuda" and pdt is not None and pdt != xdt and "scalar type" in str(e)
                want, want_gs = grads(lambda *t: theirs(t[0], nshape, *t[1:]),
                                      [None if t is None else t.cpu() for t in params], dy.cpu())
                want, want_gs = want.to(device), [None if g is None else g.to(device) for g in want_gs]
            assert y.shape == want.shape == shape and y.dtype == want.dtype and y.device == want.device
            assert torch.equal(y, want)
            for g, want_g in zip(gs, want_gs):
                assert (g is None) == (want_g is None)
                if g is not None:
                    assert g.dtype == want_g.dtype and torch.equal(g, want_g)
        y = PF.rms_norm(x, nshape, w, cast_before_weight=True)   # Llama's rounding: its eager formula
        assert y.shape == shape and y.dtype == (xdt if w is None else torch.promote_types(xdt, pdt))
    # the integer form and the modules, as torch.nn.LayerNorm(0) / torch.nn.RMSNorm(0) take it
    if nshape == (0,):
        assert torch.equal(PF.layer_norm(x, 0), F.layer_norm(x, (0,)))
        kw = {"dtype": xdt, "device": device}
        assert FusedLayerNorm(0, **kw)(x).shape == torch.nn.LayerNorm(0, **kw)(x).shape == shape
        assert FusedRMSNorm(0, **kw)(x).shape == torch.nn.RMSNorm(0, **kw)(x).shape == shape
    for bad in (-1, (2, -1)):
        with pytest.raises(ValueError, match=r"normalized_shape: expected (a size|sizes) >= 0"):
            PF.layer_norm(x, bad)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("shape,nshape", [((4, 0), (0,)), ((0, 8), (8,))])
def test_empty_inputs_on_cuda_take_the_reference_path(monkeypatch, op, shape, nshape):
    """On a CUDA device, an empty input is declined by every kernel (metadata alone: no kernel is loaded) with the
    reason, and runs the PyTorch reference path (the kernels' bindings refuse a hidden size of 0): source "empty", not
    a fallback, so that strict mode does not raise on it (a code review: it did), also where impl= asks for a kernel
    (a warning names the unmet request)."""
    from dataclasses import replace

    from pipegoose.nn.fusion.ops import layer_norm as ln, rms_norm as rms

    def no_kernel(name):
        raise AssertionError(f"loaded {name} for an empty input")

    monkeypatch.setattr(dispatch, "kernel", no_kernel)
    x = torch.randn(shape, dtype=torch.bfloat16)
    p = (ln.layer_norm_problem(x, nshape, None, None, x.dtype) if op == "layer_norm"
         else rms.rms_norm_problem(x, nshape, None, x.dtype, False))
    problem = replace(p, device=torch.device("cuda", 0))
    choice = dispatch.choose(op, problem, check_all=True)
    assert (choice.impl, choice.source, choice.fallback) == ("torch", "empty", False)
    for name in dispatch.implementations(op):
        if name != "torch":
            assert f"empty input, shape {list(shape)}" in choice.reasons[name]
    with dispatch.strict():
        assert dispatch.select(op, problem).source == "empty"
        with pytest.warns(UserWarning, match="impl='pipegoose' cannot run this input"):
            assert dispatch.select(op, problem, impl="pipegoose").impl == "torch"


@pytest.mark.parametrize("impl,want", [("Torch", "torch"), ("TORCH", "torch"), (" torch ", "torch"),
                                       ("Auto", "torch"), ("PipeGoose", "torch")])
def test_impl_argument_is_case_insensitive(impl, want):
    """``impl="Torch"`` was a ValueError ("no implementation 'Torch'") while PIPEGOOSE_IMPL_LAYER_NORM=Torch worked:
    the argument now takes any case (and surrounding blanks), as the variables do, in the functional ops and the
    modules; a name the op does not have still names the argument, the op and its implementations."""
    x = torch.randn(3, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # impl="PipeGoose" on CPU: "cannot run this input" (a UserWarning)
        assert torch.equal(PF.layer_norm(x, 8, impl=impl), F.layer_norm(x, (8,)))
        assert dispatch.last_choice("layer_norm").impl == want
        assert torch.equal(PF.rms_norm(x, 8, impl=impl), F.rms_norm(x, (8,)))
        assert torch.equal(FusedLayerNorm(8, impl=impl)(x), F.layer_norm(x, (8,), torch.ones(8), torch.zeros(8)))
        assert torch.equal(PF.softmax(x, -1, impl=impl), F.softmax(x, -1))
    if impl.strip().lower() == "torch":
        assert dispatch.last_choice("softmax").source == "argument"
    with pytest.raises(ValueError, match=r"impl: layer_norm has no implementation 'Megatron'; expected one of "
                                         r"pipegoose, apex, torch or 'auto' \(any case\)"):
        PF.layer_norm(x, 8, impl="Megatron")
    with pytest.raises(ValueError, match="impl: rms_norm has no implementation 'Apex'"):
        FusedRMSNorm(8, impl="Apex")


@pytest.mark.parametrize("impl", ["", "  "])
def test_empty_impl_argument_says_what_to_pass(impl, monkeypatch):
    """An empty PIPEGOOSE_IMPL_* variable means no request (as an unset one); an empty impl= argument is refused, and
    the message now says so (it read "has no implementation ''; expected one of ... or 'auto'", as for a typo)."""
    x = torch.randn(3, 8)
    monkeypatch.setenv("PIPEGOOSE_IMPL_LAYER_NORM", impl)
    assert torch.equal(PF.layer_norm(x, 8), F.layer_norm(x, (8,)))   # the variable: no request
    for call in (lambda: PF.layer_norm(x, 8, impl=impl), lambda: FusedRMSNorm(8, impl=impl),
                 lambda: PF.softmax(x, -1, impl=impl)):
        with pytest.raises(ValueError, match=r"impl: an empty name .*; pass None or 'auto' for the automatic choice"):
            call()


def test_olmo2_rule_on_the_small_path_keeps_the_input_dtype(monkeypatch):
    """OLMo-2's rule (output_in_input_dtype) gives the input's dtype. Under CUDA autocast torch.rms_norm returns fp32
    (rms_norm is on autocast's fp32 list); the module's small-problem shortcut returned that as it was, while the
    dispatched path cast it back: bf16 above PIPEGOOSE_SMALL_NUMEL, fp32 below. Emulated here: the shortcut taken as on
    a GPU, torch.rms_norm returning fp32 as under CUDA autocast."""
    from pipegoose.nn.fusion.ops import _common

    monkeypatch.setattr(_common, "on_kernel_device", lambda t: t.dtype != torch.float64)
    monkeypatch.delenv("PIPEGOOSE_SMALL_NUMEL", raising=False)
    native = torch.rms_norm
    monkeypatch.setattr(torch, "rms_norm", lambda x, *a: native(x.float(), *[t.float() if isinstance(t, torch.Tensor)
                                                                               else t for t in a]))
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    mod = FusedRMSNorm(64, eps=1e-6, output_in_input_dtype=True, dtype=torch.bfloat16)
    y = mod(x)
    assert dispatch.last_choice("rms_norm").source == "small"
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, F.rms_norm(x.float(), (64,), mod.weight.float(), 1e-6).to(torch.bfloat16))


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_nested_tensors_run_pytorchs_op(layout):
    """torch.nn.LayerNorm and F.softmax take nested tensors; FusedLayerNorm and PF.softmax raised "NestedTensorImpl
    doesn't support sizes" on a strided one (reading its shape for the choice cache), and on a GPU a jagged one would
    have reached the kernels, which take dense rows. Every nested input now runs PyTorch's op, as a recorded fallback."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the strided layout is a prototype: a UserWarning
        nt = torch.nested.nested_tensor([torch.randn(3, 16), torch.randn(5, 16)], layout=layout)
    mod = FusedLayerNorm(16)
    torch.nn.init.normal_(mod.weight)
    for got, want, op in ((lambda: mod(nt), lambda: F.layer_norm(nt, (16,), mod.weight, mod.bias), "layer_norm"),
                          (lambda: PF.softmax(nt, -1), lambda: F.softmax(nt, -1), "softmax")):
        y, ref = got(), want()
        assert y.is_nested
        for a, b in zip(y.unbind(), ref.unbind()):
            assert torch.equal(a, b)
        choice = dispatch.last_choice(op)
        assert choice.fallback and "nested tensor" in choice.reason
        with dispatch.strict(), pytest.raises(dispatch.FusionFallbackError, match="nested tensor"):
            got()
    # a review: the nested path skipped the arguments' checks and Llama's rounding
    with pytest.raises(ValueError, match="eps"):
        PF.layer_norm(nt, (16,), None, None, -1.0)
    for bad in (lambda: PF.rms_norm(nt, (16,), impl="bogus"), lambda: PF.softmax(nt, -1, impl="bogus")):
        with pytest.raises(ValueError, match="impl"):
            bad()
    with pytest.warns(UserWarning, match="impl='pipegoose' cannot run this input: a nested tensor"):
        PF.layer_norm(nt, (16,), mod.weight, mod.bias, impl="pipegoose")
    if layout == torch.jagged:  # Llama's rounding (cast_before_weight) on a jagged bf16 input with an fp32 weight
        nb = nt.to(torch.bfloat16)
        w = torch.randn(16)
        y = PF.rms_norm(nb, (16,), w, 1e-6, cast_before_weight=True)
        for a, xb in zip(y.unbind(), nb.unbind()):
            h = xb.float()
            want = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
            assert a.dtype == torch.float32 and torch.equal(a, want)


def test_module_errors_name_the_modules_argument():
    """The modules' forward takes ``input`` (as torch.nn.LayerNorm's); their errors said "x: expected shape [*, 8]", the
    functional op's name for it."""
    t5 = FusedRMSNorm(8, eps=1e-6, output_in_weight_dtype=True)
    for mod in (FusedLayerNorm(8), FusedRMSNorm(8, eps=1e-6, cast_before_weight=True), t5):
        with pytest.raises(ValueError, match=r"^input: expected shape \[\*, 8\]"):
            mod(torch.randn(2, 7))
        if mod is not t5:  # T5's rule promotes an integer input with its fp32 weight, as T5LayerNorm computes it
            with pytest.raises(TypeError, match=r"^input: expected a floating point"):
                mod(torch.ones(2, 8, dtype=torch.int64))


@pytest.mark.parametrize("cls", ["FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm"])
def test_torch_jit_trace_of_a_fused_norm_passes_its_check(cls, monkeypatch):
    """A review (session 61): torch.jit.trace of a fused norm's first call failed its own check ("Graphs differed
    across invocations", value names %input.1 against %input): the output-dtype probe, which runs once per dtype mix,
    ran inside the trace. It now runs outside it, so the first call's graph is the later calls' graph."""
    import pipegoose.nn.fusion as fusion
    from pipegoose.nn.fusion.ops import _common

    monkeypatch.setattr(_common, "_policy_cache", {})   # the probe's first run, as in a fresh process
    m = getattr(fusion, cls)(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # (the tracer's warnings about the checks' Python values)
        traced = torch.jit.trace(m, (torch.randn(4, 5),))
    x = torch.randn(3, 5)
    torch.testing.assert_close(traced(x), m(x))
    assert _common._policy_cache, "the probe did not run in the trace"


@pytest.mark.parametrize("t5", [False, True], ids=["llama", "t5"])
def test_fused_rmsnorm_refuses_integer_and_float8_input_in_every_mode(t5):
    """A review (session 61): with output_in_weight_dtype (T5's numerics) an integer input was cast to fp32 and
    normalised, where the other modes raise; a float8 one raised torch's "Promotion for Float8 Types is not
    supported", naming no argument. Every mode now raises the same TypeError naming ``input``."""
    from pipegoose.nn.fusion import FusedRMSNorm

    m = FusedRMSNorm(5, eps=1e-6, output_in_weight_dtype=t5)
    with pytest.raises(TypeError, match="^input: expected a floating point torch.Tensor, got int64$"):
        m(torch.tensor([[1, 2, 3, 4, 5]]))
    with pytest.raises(TypeError, match=r"^input: expected dtype float32, .* got float8_e4m3fn .* e\.g\. input\.to\("):
        m(torch.randn(1, 5).to(torch.float8_e4m3fn))
