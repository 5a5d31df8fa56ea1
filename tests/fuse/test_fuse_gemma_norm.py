"""Gemma's RMSNorm (``x_normed * (1 + weight)``, fp32 math, one rounding to the input's dtype; the weight starts at
zeros): the probe's Gemma style, ``FusedRMSNorm(weight_offset=1.0)`` against float64 and against transformers'
``GemmaRMSNorm``, and fuse / unfuse of tiny Gemma, Gemma 2 and Gemma 3 causal LMs (Gemma 3's per-head ``q_norm`` /
``k_norm`` too). CPU tests run the reference path; the tests marked ``cuda`` run our kernel (strict mode, counters):

    python -m pytest -m cuda tests/fuse/test_fuse_gemma_norm.py -q
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from pipegoose.nn.fusion import FusedRMSNorm, dispatch
from pipegoose.nn.fusion.fuse import fuse, fusion_report, is_fused, unfuse
from pipegoose.nn.fusion.transformers.matching import probe_rms_norm
from tolerances import TOLERANCES, tol

from . import models

transformers = pytest.importorskip("transformers")
modeling_gemma = pytest.importorskip("transformers.models.gemma.modeling_gemma")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
EPS = 1e-6


def _gemma_norm_classes() -> list[type]:
    """transformers' Gemma-style RMSNorm classes present in this version: Gemma's, Gemma 2's, Gemma 3's and
    Qwen3-Next's copy."""
    import importlib

    found = []
    for mod, name in (("gemma", "GemmaRMSNorm"), ("gemma2", "Gemma2RMSNorm"), ("gemma3", "Gemma3RMSNorm"),
                      ("qwen3_next", "Qwen3NextRMSNorm")):
        try:
            found.append(getattr(importlib.import_module(f"transformers.models.{mod}.modeling_{mod}"), name))
        except (ImportError, AttributeError):
            continue
    return found


def _normed(x: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class _Offset(nn.Module):
    """An RMSNorm of Gemma's shape (``weight`` from zeros, ``eps``), whose forward the subclasses vary."""

    def __init__(self, n: int, eps: float = EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(n))


class _TwoPlusWeight(_Offset):
    """Gemma's rounding, but (2 + weight): an offset the probe does not know."""

    def forward(self, x):
        return (_normed(x.float(), self.eps) * (2.0 + self.weight.float())).type_as(x)


class _OnePlusWeightLlamaRounding(_Offset):
    """(1 + weight) with Llama's two roundings: the normalised input rounded to the input's dtype, then times
    ``1 + weight`` summed in the weight's dtype."""

    def forward(self, x):
        return (1.0 + self.weight) * _normed(x.float(), self.eps).to(x.dtype)


class _OnePlusWeightSummedInWeightDtype(_Offset):
    """(1 + weight) summed in the weight's dtype (rounded there for a half weight), then fp32 math, one rounding."""

    def forward(self, x):
        return (_normed(x.float(), self.eps) * (1.0 + self.weight).float()).type_as(x)


class _OnePlusWeightFp32Out(_Offset):
    """Gemma's math, but the output stays fp32 whatever the input's dtype."""

    def forward(self, x):
        return _normed(x.float(), self.eps) * (1.0 + self.weight.float())


class _OnePlusWeightMeanSubtracted(_Offset):
    """A LayerNorm without bias, times (1 + weight)."""

    def forward(self, x):
        xf = x.float() - x.float().mean(-1, keepdim=True)
        return (_normed(xf, self.eps) * (1.0 + self.weight.float())).type_as(x)


class _OnePlusWeightEpsOutside(_Offset):
    """(1 + weight), but eps added outside the square root."""

    def forward(self, x):
        xf = x.float()
        return (xf / (xf.pow(2).mean(-1, keepdim=True).sqrt() + self.eps) * (1.0 + self.weight.float())).type_as(x)


class _OnePlusWeightGated(_Offset):
    """Gemma's formula with a gate argument (a gated norm: the model passes more than the input)."""

    def forward(self, x, gate=None):
        if gate is not None:
            x = x * nn.functional.silu(gate)
        return (_normed(x.float(), self.eps) * (1.0 + self.weight.float())).type_as(x)


class _SameInOtherOps(_Offset):
    """Gemma's formula and rounding written with other fp32 ops (division by a square root)."""

    def forward(self, x):
        xf = x.float()
        return (xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).to(x.dtype)


# --- the probe -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls", _gemma_norm_classes(), ids=lambda c: c.__name__)
@pytest.mark.parametrize("n", [2, 8, 64])
def test_probe_accepts_gemma_norms_with_offset_1(cls, n):
    """transformers' Gemma-style norms, over a hidden size or a head's (8, 2): accepted as Gemma style (offset 1.0,
    one rounding to the input's dtype), their eps read; the module's zero weight is not touched."""
    m = cls(n, eps=1e-5)
    p = probe_rms_norm(m)
    assert p.ok and p.candidate, p
    assert p.weight_offset == 1.0 and p.output_in_input_dtype and not p.output_in_weight_dtype, p
    assert p.eps == 1e-5 and "Gemma style" in p.reason, p
    assert torch.equal(m.weight, torch.zeros(n))
    # the other styles report no offset
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    olmo2 = pytest.importorskip("transformers.models.olmo2.modeling_olmo2")
    for other in (llama.LlamaRMSNorm(n), olmo2.Olmo2RMSNorm(n), nn.RMSNorm(n)):
        q = probe_rms_norm(other)
        assert q.ok and q.weight_offset == 0.0 and "Gemma" not in q.reason, (type(other).__name__, q)


def test_probe_accepts_gemmas_formula_in_other_fp32_ops():
    """The rounding check leaves room for the same math in other fp32 ops (a flip or two of the last bf16 bit)."""
    p = probe_rms_norm(_SameInOtherOps(64))
    assert p.ok and p.weight_offset == 1.0 and p.output_in_input_dtype, p


@pytest.mark.parametrize("cls, says", [
    (_TwoPlusWeight, "output differs from the RMSNorm formula"),
    (_OnePlusWeightLlamaRounding, "differs from Gemma's rounding"),
    (_OnePlusWeightSummedInWeightDtype, "differs from Gemma's rounding"),
    (_OnePlusWeightFp32Out, "its output is not a torch.bfloat16 tensor"),
    (_OnePlusWeightMeanSubtracted, "output differs from the RMSNorm formula"),
    (_OnePlusWeightEpsOutside, "eps is used otherwise"),
    (_OnePlusWeightGated, "forward takes more than the input (gate)"),
])
@pytest.mark.parametrize("n", [8, 64])
def test_probe_refuses_other_offsets_and_roundings(cls, says, n):
    """Another offset, (1 + weight) with another rounding or output dtype, and the existing refusals with Gemma's
    offset (mean-subtracting, eps elsewhere, gated): the probe refuses, fuse() leaves the module in place with a row
    that says why (not eligible), and FusedRMSNorm.from_module refuses it too: never a silent wrong result."""
    m = cls(n)
    with torch.no_grad():
        m.weight.uniform_(-0.5, 0.5)
    p = probe_rms_norm(m)
    assert not p.ok and p.candidate and says in p.reason, p
    model = nn.Sequential(nn.Linear(n, n), m)
    report = fuse(model, ops=["rms_norm"])
    (row,) = [r for r in report.rows if r.path == "1"]
    assert not row.fused and not row.eligible and says in row.reason, row
    assert model[1] is m and not is_fused(model)
    with pytest.raises(ValueError, match="does not pass the RMSNorm probe"):
        FusedRMSNorm.from_module(m)


def test_probe_refuses_a_broadcasting_gemma_weight():
    """A Gemma norm of one element broadcasts over rows of any width: refused as the other styles are."""
    p = probe_rms_norm(modeling_gemma.GemmaRMSNorm(1))
    assert not p.ok and "broadcasts" in p.reason, p


# --- FusedRMSNorm(weight_offset) --------------------------------------------------------------------------------------

def _ref64(x: torch.Tensor, w: torch.Tensor, offset: float = 1.0) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * (offset + w.double())


@pytest.mark.parametrize("weight", ["random", "zeros"])
@pytest.mark.parametrize("wdt", ["same", torch.float32])
@pytest.mark.parametrize("xdt", DTYPES, ids=lambda d: str(d)[6:])
def test_fused_rms_norm_with_offset_against_float64(xdt, wdt, weight):
    """FusedRMSNorm(weight_offset=1.0) on the CPU: output (the input's dtype) and the gradients of the input and of
    the weight (in its dtype) against float64 autograd of x_normed * (1 + weight), random and zero weights (Gemma's
    initial one), and bit for bit GemmaRMSNorm's."""
    wdt = xdt if wdt == "same" else wdt
    g = torch.Generator().manual_seed(7)
    n = 96
    f = FusedRMSNorm(n, eps=EPS, output_in_input_dtype=True, weight_offset=1.0, dtype=wdt)
    assert torch.equal(f.weight, torch.zeros(n, dtype=wdt))   # 1 + 0: the identity scale
    if weight == "random":
        with torch.no_grad():
            f.weight.copy_(torch.randn(n, generator=g) * 0.5)
    x = (torch.randn(3, 5, n, generator=g) * 2 + 0.3).to(xdt).requires_grad_()
    dy = torch.randn(3, 5, n, generator=g).to(xdt)
    y = f(x)
    assert y.dtype == xdt
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    w64 = f.weight.detach().double().requires_grad_()
    y64 = _ref64(x64, w64)
    y64.backward(dy.double())
    assert x.grad.dtype == xdt and f.weight.grad.dtype == wdt
    low = xdt if xdt != torch.float32 else wdt
    torch.testing.assert_close(y.double(), y64.detach(), **tol(low, 2))
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol(low, 4))
    torch.testing.assert_close(f.weight.grad.double(), w64.grad, **tol(low, 16))
    # GemmaRMSNorm with the same weight: the same bits, forward and backward
    m = modeling_gemma.GemmaRMSNorm(n, eps=EPS)
    m.weight = nn.Parameter(f.weight.detach().clone())
    xr = x.detach().clone().requires_grad_()
    want = m(xr)
    want.backward(dy)
    assert want.dtype == y.dtype and torch.equal(want, y)
    assert torch.equal(xr.grad, x.grad) and torch.equal(m.weight.grad, f.weight.grad)


def test_fused_rms_norm_offset_module_api():
    """The offset's constructor checks (errors name the argument), its initial and reset weight (1 - offset), repr,
    state_dict keys, copies and pickles keep it; from_module shares the Parameter, finds the offset (or takes it with
    verify=False) and refuses one that contradicts the probe."""
    for bad, err in ((True, TypeError), ("1", TypeError), (torch.tensor(1.0), TypeError),
                     (float("nan"), ValueError), (float("inf"), ValueError)):
        with pytest.raises(err, match="^weight_offset: "):
            FusedRMSNorm(8, weight_offset=bad, output_in_input_dtype=True)
    with pytest.raises(ValueError, match=r"^weight_offset: 1.0 needs output_in_input_dtype=True"):
        FusedRMSNorm(8, weight_offset=1.0)
    with pytest.raises(ValueError, match=r"^weight_offset: 1.0 needs a weight \(elementwise_affine=True\)"):
        FusedRMSNorm(8, weight_offset=1.0, output_in_input_dtype=True, elementwise_affine=False)
    f = FusedRMSNorm(8, eps=EPS, weight_offset=1, output_in_input_dtype=True)
    assert f.weight_offset == 1.0 and isinstance(f.weight_offset, float)
    assert "weight_offset=1.0" in repr(f) and "weight_offset" not in repr(FusedRMSNorm(8))
    with torch.no_grad():
        f.weight.fill_(3.0)
    f.reset_parameters()
    assert torch.equal(f.weight, torch.zeros(8))
    assert list(f.state_dict()) == ["weight"]
    for clone in (copy.deepcopy(f), pickle.loads(pickle.dumps(f))):
        assert clone.weight_offset == 1.0 and torch.equal(clone(torch.ones(2, 8)), f(torch.ones(2, 8)))

    m = modeling_gemma.GemmaRMSNorm(8, eps=1e-5)
    f = FusedRMSNorm.from_module(m)
    assert f.weight is m.weight and f.eps == 1e-5 and f.weight_offset == 1.0 and f.output_in_input_dtype
    g = FusedRMSNorm.from_module(m, verify=False, weight_offset=1.0)   # the flag follows the offset
    assert g.weight is m.weight and g.weight_offset == 1.0 and g.output_in_input_dtype and not g.cast_before_weight
    assert FusedRMSNorm.from_module(m, verify=False).weight_offset == 0.0   # on the caller's word
    with pytest.raises(ValueError, match=r"pass weight_offset=1.0 or leave it None \(got 0.0\)"):
        FusedRMSNorm.from_module(m, weight_offset=0.0)
    with pytest.raises(ValueError, match=r"output_in_input_dtype=True does: pass those"):
        FusedRMSNorm.from_module(m, output_in_input_dtype=False)
    with pytest.raises(ValueError, match=r"^weight_offset: 1.0 needs output_in_input_dtype=True"):
        FusedRMSNorm.from_module(m, verify=False, weight_offset=1.0, output_in_input_dtype=False)
    with pytest.raises(ValueError, match=r"^weight_offset: torch.nn.RMSNorm computes x_normed \* weight"):
        FusedRMSNorm.from_module(nn.RMSNorm(8), weight_offset=1.0)
    with pytest.raises(TypeError, match=r"^weight_offset: expected a real number, got str"):
        FusedRMSNorm.from_module(m, weight_offset="1")


# --- fuse / unfuse of Gemma models ------------------------------------------------------------------------------------

def _gemma_lm(family: str, seed: int = 0) -> nn.Module:
    """A tiny causal LM of ``family`` (eager attention), fp32, its norm weights random (their zeros hide a wrong
    offset's sign and size less than random ones do)."""
    common = dict(vocab_size=models.VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, intermediate_size=64, attn_implementation="eager")
    torch.manual_seed(seed)
    if family == "gemma":
        model = transformers.GemmaForCausalLM(transformers.GemmaConfig(**common))
    elif family == "gemma2":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**common))
    else:
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**common))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def _norm_paths(model: nn.Module) -> list[str]:
    return [p for p, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")]


def _loss_and_grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("ops", [["rms_norm"], None], ids=["rms_norm", "default_ops"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3"])
def test_fuse_gemma_lms(family, dtype, ops):
    """Every RMSNorm of a tiny Gemma / Gemma 2 / Gemma 3 causal LM (Gemma 3: the per-head q_norm / k_norm too) is
    fused as FusedRMSNorm with weight_offset 1.0, the report's rows say Gemma style; loss and every gradient equal
    the unfused model's (fp32: tight; bf16: within bf16's tolerance); unfuse restores the modules, Parameters and
    state_dict exactly, and the original loss."""
    model = _gemma_lm(family).to(dtype)
    paths = _norm_paths(model)
    if family == "gemma3":
        assert "model.layers.0.self_attn.q_norm" in paths and "model.layers.1.self_attn.k_norm" in paths
    originals = {p: model.get_submodule(p) for p in paths}
    params = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, models.VOCAB, (2, 12), generator=g)
    labels = ids.clone()
    want_loss, want_grads = _loss_and_grads(model, ids, labels)

    report = fuse(model, ops=ops)
    rows = {r.path: r for r in report.rows if r.kind == "rms_norm"}
    assert sorted(rows) == sorted(paths), report
    for p in paths:
        assert rows[p].fused and "Gemma style" in rows[p].reason and "weight_offset=1.0" in rows[p].reason, rows[p]
        new = model.get_submodule(p)
        assert type(new) is FusedRMSNorm and new.weight_offset == 1.0 and new.weight is originals[p].weight
    assert list(model.state_dict()) == list(state)
    got_loss, got_grads = _loss_and_grads(model, ids, labels)
    close = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(got_loss, want_loss, **close)
    assert got_grads.keys() == want_grads.keys()
    for n, want in want_grads.items():
        assert got_grads[n].dtype == want.dtype, n
        # bf16: a parameter's gradient as a whole (its largest element is rounding noise where it is small)
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got_grads[n].float(), want.float(), rtol=close["rtol"],
                                   atol=close["atol"] * max(1.0, scale), msg=n)
    assert fusion_report(model).rows

    assert unfuse(model) and not is_fused(model)
    for p in paths:
        assert model.get_submodule(p) is originals[p]
    assert all(q is params[n] for n, q in model.named_parameters())
    after = model.state_dict()
    assert list(after) == list(state) and all(torch.equal(after[k], v) for k, v in state.items())
    loss, _ = _loss_and_grads(model, ids, labels)
    assert torch.equal(loss, want_loss)


def test_fuse_gemma_with_its_zero_initialised_norms():
    """A freshly built Gemma 3 (its norm weights zeros: 1 + 0): fused, the same loss as unfused, fp32."""
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=models.VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=64, attn_implementation="eager"))
    assert all(torch.equal(p, torch.zeros_like(p)) for n, p in model.named_parameters() if "norm" in n)
    ids = torch.randint(0, models.VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    want, _ = _loss_and_grads(model, ids, ids)
    report = fuse(model, ops=["rms_norm"])
    assert len(report.fused_rows()) == len(_norm_paths(model)) == 7   # 4 per layer, q_norm, k_norm, the final norm
    got, _ = _loss_and_grads(model, ids, ids)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert unfuse(model)


# --- on the GPU: our kernel ----------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.usefixtures("no_tuning_table")
@pytest.mark.parametrize("weight", ["random", "zeros"])
@pytest.mark.parametrize("wdt", ["same", torch.float32])
@pytest.mark.parametrize("xdt", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("shape", [(8, 4096), (3, 7, 33), (64, 256), (4, 16, 16)])
def test_fused_rms_norm_with_offset_on_the_kernel(shape, xdt, wdt, weight):
    """FusedRMSNorm(weight_offset=1.0) on CUDA: our kernel runs once forward (strict mode; the dispatcher's counter),
    with the input in its dtype and the fp32 weight + 1; output, input gradient and weight gradient (in the weight's
    dtype) against float64 autograd, with the bounds of the other RMSNorm kernel tests (output 2 roundings, dx 4, the
    weight 16), and the output within one rounding of GemmaRMSNorm's on the same GPU."""
    dev = torch.device("cuda")
    wdt = xdt if wdt == "same" else wdt
    n = shape[-1]
    g = torch.Generator(device=dev).manual_seed(n)
    f = FusedRMSNorm(n, eps=EPS, output_in_input_dtype=True, weight_offset=1.0, device=dev, dtype=wdt)
    if weight == "random":
        with torch.no_grad():
            f.weight.copy_(torch.randn(n, generator=g, device=dev) * 0.5)
    x = (torch.randn(shape, generator=g, device=dev) * 2 + 0.3).to(xdt).requires_grad_()
    dy = torch.randn(shape, generator=g, device=dev).to(xdt)
    dispatch.reset_stats()
    with dispatch.strict():
        y = f(x)
        y.backward(dy)
    torch.cuda.synchronize()
    assert dispatch.stats().get("rms_norm") == {"pipegoose": 1}, dispatch.stats()
    assert y.dtype == xdt and x.grad.dtype == xdt and f.weight.grad.dtype == wdt
    x64 = x.detach().double().requires_grad_()
    w64 = f.weight.detach().double().requires_grad_()
    y64 = _ref64(x64, w64)
    y64.backward(dy.double())
    low = xdt if xdt != torch.float32 else wdt
    assert not y.isnan().any() and not x.grad.isnan().any() and not f.weight.grad.isnan().any()
    torch.testing.assert_close(y.double(), y64.detach(), **tol(low, 2))
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol(low, 4))
    torch.testing.assert_close(f.weight.grad.double(), w64.grad, **tol(low, 16))
    m = modeling_gemma.GemmaRMSNorm(n, eps=EPS).to(dev)
    m.weight = nn.Parameter(f.weight.detach().clone())
    with torch.no_grad():
        torch.testing.assert_close(y.detach(), m(x.detach()), **TOLERANCES[low])


@pytest.mark.cuda
@pytest.mark.usefixtures("no_tuning_table")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("family", ["gemma", "gemma3"])
def test_gemma_norms_parity_with_kernels(family, dtype):
    """A Gemma / Gemma 3 base model fused for its RMSNorms (Gemma 3: q_norm / k_norm over head_dim too): our kernel
    runs every norm call (strict mode: no fallback), and outputs and gradients agree with the unfused model as in
    tests/fuse/test_fuse_cuda.py's test_parity_with_kernels (twice the unfused error from float64, plus the dtype's
    tolerance)."""
    from .test_fuse_cuda import _assert_parity, _parity_runs

    dev = torch.device("cuda")
    common = dict(vocab_size=models.VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=128, attn_implementation="sdpa")
    torch.manual_seed(0)
    if family == "gemma":
        model = transformers.GemmaModel(transformers.GemmaConfig(**common))
    else:
        model = transformers.Gemma3TextModel(transformers.Gemma3TextConfig(**common))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    paths = _norm_paths(model)
    model = model.to(dev)
    # no padding: SDPA's rows without a key (its own, unfused here) are not what this test is about
    ref64, unf, fus, report, ran = _parity_runs(model, dtype, 64, left_pad=(0, 0, 0, 0), ops=["rms_norm"])
    rows = {r.path: r for r in report.rows if r.kind == "rms_norm"}
    assert sorted(rows) == sorted(paths) and all(r.fused and r.forward == "pipegoose" for r in rows.values()), report
    # one forward per norm module (Gemma: 2 per layer + the final norm; Gemma 3: 6 per layer + the final norm)
    assert ran.get("rms_norm") == {"pipegoose": len(paths)}, ran
    _assert_parity(fus, unf, ref64, dtype)


def test_from_module_refuses_an_offset_for_a_norm_without_a_weight():
    """verify=False with weight_offset for a norm without a weight: refused as the constructor refuses it (it was
    accepted, and the forward ignored the offset; a review)."""
    with pytest.raises(ValueError, match=r"weight_offset: 2.0 needs a weight \(RMSNorm has none\)"):
        FusedRMSNorm.from_module(torch.nn.RMSNorm(8, elementwise_affine=False), verify=False, weight_offset=2.0,
                                 output_in_input_dtype=True)


@pytest.mark.parametrize("offset", [1e300, -1e39])
def test_an_offset_past_fp32s_range_is_a_value_error(offset):
    with pytest.raises(ValueError, match=r"weight_offset: expected a finite number within fp32's range"):
        FusedRMSNorm(8, weight_offset=offset, output_in_input_dtype=True)


@pytest.mark.parametrize("value, error, match", [
    (float("nan"), ValueError, r"weight_offset: expected a finite number"),
    (float("inf"), ValueError, r"weight_offset: expected a finite number"),
    ("abc", TypeError, r"weight_offset: expected a real number, got str"),
    (True, TypeError, r"weight_offset: expected a real number, got bool"),
])
def test_weight_offset_set_after_construction_is_checked_as_the_constructor_checks_it(value, error, match):
    """A review: ``norm.weight_offset = nan`` after construction gave NaN outputs without an error ("abc" a TypeError
    naming no argument); it is a checked property now, and the norm keeps its offset when refused."""
    norm = FusedRMSNorm(8, eps=1e-6, output_in_input_dtype=True, weight_offset=1.0)
    with pytest.raises(error, match=match):
        norm.weight_offset = value
    assert norm.weight_offset == 1.0
    norm.weight_offset = 0.5
    x = torch.randn(3, 8, dtype=torch.float64)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (0.5 + norm.weight.detach().double())
    torch.testing.assert_close(norm(x), want)


def test_a_nonzero_offset_set_after_construction_needs_gemmas_rounding_and_a_weight():
    with pytest.raises(ValueError, match=r"^weight_offset: 1.0 needs output_in_input_dtype=True"):
        FusedRMSNorm(8).weight_offset = 1.0
    with pytest.raises(ValueError, match=r"^weight_offset: 1.0 needs a weight"):
        FusedRMSNorm(8, elementwise_affine=False, output_in_input_dtype=True).weight_offset = 1.0
    norm = FusedRMSNorm(8)
    norm.weight_offset = 0.0   # (zero needs neither)
    assert norm.weight_offset == 0.0 and "weight_offset" not in repr(norm)


def test_the_offset_rule_is_checked_again_at_the_forward():
    """A review: the flag or the weight changed after the offset was set (``output_in_input_dtype = False``, ``weight
    = None``) left a state the constructor refuses, and the forward then ignored the offset silently."""
    x = torch.randn(2, 8)
    norm = FusedRMSNorm(8, eps=1e-6, output_in_input_dtype=True, weight_offset=1.0)
    norm.output_in_input_dtype = False
    with pytest.raises(ValueError, match=r"^weight_offset: 1.0 needs output_in_input_dtype=True"):
        norm(x)
    norm = FusedRMSNorm(8, eps=1e-6, output_in_input_dtype=True, weight_offset=1.0)
    norm.weight = None
    with pytest.raises(ValueError, match=r"^weight_offset: 1.0 needs a weight"):
        norm(x)


def test_the_offset_is_stored_under_its_own_name_for_pickles_of_either_version():
    """The property keeps the value in the instance's ``__dict__`` as ``weight_offset``, where the module kept it
    before the property: a pickle of either version reads the same offset in the other."""
    norm = FusedRMSNorm(8, eps=1e-6, output_in_input_dtype=True, weight_offset=1.0)
    assert norm.__dict__["weight_offset"] == 1.0 and "_weight_offset" not in norm.__dict__
    state = pickle.loads(pickle.dumps(norm)).__dict__
    assert state["weight_offset"] == 1.0
