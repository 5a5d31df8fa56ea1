"""Norms without parameters: OLMo's ``OlmoLayerNorm`` (``F.layer_norm`` of the input in fp32, no weight or bias, eps
1e-5 written in its forward) and Gemma 4's ``Gemma4RMSNorm(with_scale=False)`` (its attention's ``v_norm`` and its
router's ``norm``: no width stored). ``transformers.matching.probe_weightless_norm`` tells them apart and reads their
epsilon; ``fuse`` replaces them with ``MixedFusedLayerNorm(elementwise_affine=False, output_in_input_dtype=True)`` and
``FusedRMSNorm`` over the last dimension of each input. The CPU tests compare with the modules themselves (the fused
modules' CPU path is PyTorch's op); the ``cuda`` tests run the kernels against float64.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import transformers as tr
from torch import nn
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from pipegoose.nn.fusion import dispatch
from pipegoose.nn.fusion.fuse import fuse, unfuse
from pipegoose.nn.fusion.modules import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm
from pipegoose.nn.fusion.transformers.matching import probe_weightless_norm
from tolerances import TOLERANCES, tol

from . import models

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ------------------------------------------------------------------------------------------ modules of the tests
class LiteralEpsRMSNorm(nn.Module):
    """An RMSNorm without parameters whose epsilon is a literal of its forward (none as an attribute)."""

    def __init__(self, eps):
        super().__init__()
        self._e = eps   # (not an epsilon attribute's name: the probe must read it from the output)

    def forward(self, x):
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self._e)).type_as(x)


class AttrLayerNorm(nn.Module):
    """OLMo's LayerNorm with its width and epsilon as attributes; ``used`` the epsilon its forward adds."""

    def __init__(self, n, eps=1e-5, used=None):
        super().__init__()
        self.normalized_shape, self.eps, self.used = (n,), eps, eps if used is None else used

    def forward(self, x):
        return nn.functional.layer_norm(x.float(), self.normalized_shape, None, None, self.used).to(x.dtype)


class AnyWidthLayerNorm(nn.Module):
    def forward(self, x):
        return nn.functional.layer_norm(x.float(), x.shape[-1:], None, None, 1e-5).to(x.dtype)


class UnbiasedNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.normalized_shape = (n,)

    def forward(self, x):
        h = x.float()
        return ((h - h.mean(-1, keepdim=True)) / torch.sqrt(h.var(-1, keepdim=True) + 1e-5)).to(x.dtype)


class Fp32OutRMSNorm(nn.Module):
    variance_epsilon = 1e-6

    def forward(self, x):
        h = x.float()
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


class HalfMathRMSNorm(nn.Module):
    variance_epsilon = 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


class GatedNorm(nn.Module):
    eps = 1e-6

    def forward(self, x, gate=None):
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class BufferNorm(nn.Module):
    eps = 1e-6

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x):
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale).to(x.dtype)


class UnitNorm(nn.Module):
    """nGPT's / QK-L2's normalization: F.normalize (a clamp of the norm at 1e-12), no epsilon to read."""

    def forward(self, x):
        return (nn.functional.normalize(x.float(), dim=-1) * x.shape[-1] ** 0.5).to(x.dtype)


class AutocastDtypeLayerNorm(nn.Module):
    """MPT's low-precision LayerNorm without parameters: under autocast it normalizes in autocast's dtype."""

    def __init__(self, n):
        super().__init__()
        self.normalized_shape, self.eps = (n,), 1e-5

    def forward(self, x):
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        with torch.autocast(x.device.type, enabled=False):
            return nn.functional.layer_norm(x, self.normalized_shape, None, None, self.eps)


class PlainLayerNorm(nn.Module):
    """F.layer_norm of the input as it comes (no cast): fp32 out under CUDA autocast, as F.layer_norm."""

    def __init__(self, n):
        super().__init__()
        self.normalized_shape, self.eps = (n,), 1e-5

    def forward(self, x):
        return nn.functional.layer_norm(x, self.normalized_shape, None, None, self.eps)


class DetachedStatNorm(nn.Module):
    eps = 1e-6

    def forward(self, x):
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True).detach() + self.eps)).to(x.dtype)


class Fp16MathNorm(nn.Module):
    eps = 1e-6

    def forward(self, x):
        h = x if x.dtype == torch.float16 else x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class ClampedNorm(nn.Module):
    eps = 1e-6

    def forward(self, x):
        h = x.float().clamp(-100, 100)
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class DropoutNorm(nn.Module):
    eps = 1e-6

    def forward(self, x):
        h = x.float()
        return nn.functional.dropout(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps), 0.5,
                                     self.training).to(x.dtype)


class Dim2Norm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.normalized_shape, self.eps = (n,), 1e-6

    def forward(self, x):
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(2, keepdim=True) + self.eps)).to(x.dtype)


class CountingNorm(nn.Module):
    eps = 1e-6

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append(tuple(x.shape))
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class SafeLog(nn.Module):
    eps = 1e-6

    def forward(self, x):
        return torch.log(x.abs() + self.eps)


def _olmo(layers=2, hidden=64):
    if "olmo" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no olmo")
    torch.manual_seed(0)
    cfg = tr.OlmoConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
                        num_hidden_layers=layers, vocab_size=models.VOCAB, max_position_embeddings=64,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return tr.OlmoForCausalLM(cfg).eval()


def _gemma4(hidden=32, head_dim=8):
    if "gemma4_text" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no gemma4_text")
    torch.manual_seed(0)
    cfg = tr.AutoConfig.for_model(
        "gemma4_text", hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=head_dim, vocab_size=models.VOCAB, max_position_embeddings=64, intermediate_size=2 * hidden,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=48,
        vocab_size_per_layer_input=models.VOCAB, hidden_size_per_layer_input=8,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return tr.AutoModelForCausalLM.from_config(cfg).eval()


def _weightless(model):
    return {p: m for p, m in model.named_modules() if type(m).__name__ in ("OlmoLayerNorm", "Gemma4RMSNorm")
            and not any(True for _ in m.parameters())}


def _step(model, dtype=torch.float32, device="cpu"):
    ids = torch.randint(3, models.VOCAB, (2, 12), generator=torch.Generator().manual_seed(4)).to(device)
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _layer_norm_model_on_cuda(model, dtype, calls):
    """``model`` (on CUDA, fp32) in ``dtype``, unfused and fused with ``ops=["layer_norm"]`` (strict mode: ``calls``
    layer_norm calls, each on pipegoose's kernel), against a float64 copy: :func:`_assert_near_float64`."""
    ref = _step(copy.deepcopy(model).double(), device="cuda")
    model = model.to(dtype)
    unf = _step(model, device="cuda")
    fuse(model, ops=["layer_norm"])
    try:
        dispatch.reset_stats()
        with dispatch.strict():
            fus = _step(model, device="cuda")
        assert dispatch.stats().get("layer_norm") == {"pipegoose": calls}, dispatch.stats()
    finally:
        unfuse(model)
    _assert_near_float64(fus, unf, ref, dtype)


def _assert_near_float64(fus, unf, ref, dtype):
    """The fused run's loss and gradients (``_step``'s) within twice the unfused run's error from the float64 run's,
    plus the dtype's tolerance (gradients: the L2 norm of each parameter's error, as tests/fuse/test_fuse_cuda.py)."""
    t = TOLERANCES[dtype]
    e_f, e_u = (fus[0].double() - ref[0]).abs().item(), (unf[0].double() - ref[0]).abs().item()
    assert e_f <= 2 * e_u + t["atol"] + t["rtol"] * ref[0].abs().item(), (e_f, e_u)
    for n, g64 in ref[1].items():
        gs = g64.norm().item()
        e_f = (fus[1][n].double() - g64).norm().item()
        e_u = (unf[1][n].double() - g64).norm().item()
        assert e_f <= 2 * e_u + (t["atol"] + t["rtol"]) * gs, (n, e_f, e_u)


# ------------------------------------------------------------------------------------------------------ probe
@pytest.mark.parametrize("eps", [1e-5, 1e-6, 1e-12, 0.0, torch.finfo(torch.float32).eps])
def test_probe_reads_an_epsilon_written_in_the_forward(eps):
    """The epsilon a forward adds without naming it is read from its output (to three significant digits where it has
    no more, else as read, torch's fp32 machine epsilon say), and the formula with it is checked."""
    p = probe_weightless_norm(LiteralEpsRMSNorm(eps))
    assert p.ok and p.kind == "rms_norm" and p.width is None and p.eps_attr is None, p
    assert p.eps == pytest.approx(eps, rel=1e-5, abs=1e-30), p
    if eps in (1e-5, 1e-6, 1e-12, 0.0):
        assert p.eps == eps
    assert "read from its output" in p.reason


def test_probe_of_transformers_modules():
    olmo = tr.models.olmo.modeling_olmo.OlmoLayerNorm(48)
    p = probe_weightless_norm(olmo)
    assert (p.ok, p.kind, p.eps, p.width, p.eps_attr) == (True, "layer_norm", 1e-5, 48, None), p
    if "gemma4_text" in CONFIG_MAPPING:
        g = tr.models.gemma4.modeling_gemma4.Gemma4RMSNorm(16, eps=1e-6, with_scale=False)
        p = probe_weightless_norm(g)
        assert (p.ok, p.kind, p.eps, p.width, p.eps_attr) == (True, "rms_norm", 1e-6, None, "variance_epsilon"), p
        assert "of any width" in p.reason
        # the same class with its weight is the RMSNorm probe's, not this one's
        assert not probe_weightless_norm(tr.models.gemma4.modeling_gemma4.Gemma4RMSNorm(16)).ok


@pytest.mark.parametrize("module, kind, reason", [
    (AttrLayerNorm(16, eps=1e-5, used=1e-6), "layer_norm", "output differs from the formula with eps=1e-05 (its eps)"),
    (UnbiasedNorm(16), "layer_norm", "output differs from the formula with eps=1e-05 (read from its output) on a "
                                     "random input"),
    (AnyWidthLayerNorm(), "layer_norm", "FusedLayerNorm takes one"),
    (Fp32OutRMSNorm(), "rms_norm", "with bf16 input its output is not a bf16 tensor"),
    (HalfMathRMSNorm(), "rms_norm", "rounded once to bf16"),
    (Fp16MathNorm(), "rms_norm", "rounded once to fp16"),
    (GatedNorm(), None, "forward takes more than the input (gate)"),
    (BufferNorm(), None, "has parameters or buffers"),
    # (the review of session 70: each was accepted, and the fused module computed otherwise)
    (UnitNorm(), "rms_norm", "eps=0 (read from its output) on rows of zeros"),
    (LiteralEpsRMSNorm(1e-30), "rms_norm", "eps=0 (read from its output) on rows of zeros"),
    (AutocastDtypeLayerNorm(16), "layer_norm", "under autocast (bf16) it returns torch.bfloat16 for an fp32 input"),
    (DetachedStatNorm(), "rms_norm", "the gradient of its input differs"),
    (ClampedNorm(), "rms_norm", "on inputs whose statistic is 1e+06"),
    (DropoutNorm().eval(), "rms_norm", "in training mode on 4-d rows"),
    (Dim2Norm(16), "rms_norm", "in eval mode on 4-d rows"),
], ids=["eps-used-otherwise", "unbiased-variance", "layernorm-of-any-width", "fp32-output", "bf16-math", "fp16-math",
        "gated", "buffer", "F.normalize", "eps-1e-30", "autocast-dtype", "detached-statistic", "clamp",
        "dropout-in-training", "over-dim-2"])
def test_probe_refuses_what_the_fused_norms_would_compute_otherwise(module, kind, reason):
    p = probe_weightless_norm(module)
    assert not p.ok and p.candidate and p.kind == kind and reason in p.reason, p


def test_probe_accepts_what_the_fused_norms_compute():
    """F.layer_norm without a cast back: fused with output_in_input_dtype=False (fp32 under CUDA autocast, as the
    module); a numpy width; a LayerNorm that names its width and normalizes rows of any (fused at its width); an
    epsilon attribute the fused ops refuse: ok, with the error for fuse to raise."""
    p = probe_weightless_norm(PlainLayerNorm(16))
    assert p.ok and p.kind == "layer_norm" and not p.output_in_input_dtype and p.width == 16, p
    assert p.reason.endswith("one rounding, fp32 under autocast, as F.layer_norm")
    olmo = tr.models.olmo.modeling_olmo.OlmoLayerNorm(np.int64(16))
    assert probe_weightless_norm(olmo).width == 16

    class NamedWidthAnyRowsNorm(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.normalized_shape = (n,)

        def forward(self, x):
            return nn.functional.layer_norm(x.float(), x.shape[-1:], None, None, 1e-5).to(x.dtype)

    p = probe_weightless_norm(NamedWidthAnyRowsNorm(16))
    assert p.ok and p.width == 16 and p.eps == 1e-5, p

    class BadEpsNorm(nn.Module):
        variance_epsilon = -1.0

        def forward(self, x):
            h = x.float()
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype)

    p = probe_weightless_norm(BadEpsNorm())
    assert p.ok and p.eps is None and "variance_epsilon" in str(p.eps_error), p
    model = nn.Sequential(nn.Linear(8, 8), BadEpsNorm())
    with pytest.raises(ValueError, match=r"^1 \(BadEpsNorm\): variance_epsilon: expected"):
        fuse(model)
    assert type(model[1]) is BadEpsNorm   # (nothing changed)
    assert FusedRMSNorm.from_module(BadEpsNorm(), eps=1e-6).eps == 1e-6


def test_probe_leaves_the_module_as_it_was():
    """The probe runs a stand-in whose lists and dicts are copies: a forward that appends to one leaves the module's
    (a review: five entries after a dry run)."""
    m = CountingNorm()
    assert probe_weightless_norm(m).ok and m.seen == []
    fuse(nn.Sequential(nn.Linear(8, 8), m), dry_run=True)
    assert m.seen == []


def test_a_parameterless_module_that_is_no_norm_gets_no_row():
    """A module with an eps attribute that computes no norm and whose name says none: no row (a review: SafeLog got
    an rms_norm row, counted in the title; a walkthrough: so did x * 2, which passes the proportionality check)."""

    class Twice(nn.Module):
        eps = 1e-6

        def forward(self, x):
            return x * 2

    for m in (SafeLog(), Twice()):
        report = fuse(nn.Sequential(nn.Linear(8, 8), m), dry_run=True)
        assert not report.rows, report.rows


def test_walkthrough_fixes_of_the_modules():
    """On the CPU, 16-bit inputs of OLMo's and Gemma 4's norms: the fused module computes in fp32 and rounds once, as
    the module does (PyTorch's 16-bit CPU backward is less exact), so input gradients equal the module's; the flag
    exists on every FusedLayerNorm and takes a bool; the argument checks name the argument; an epsilon changed on a
    fused OLMo norm warns at unfuse, having nothing to go back to."""
    mods = [(tr.models.olmo.modeling_olmo.OlmoLayerNorm(256), FusedLayerNorm)]
    if "gemma4_text" in CONFIG_MAPPING:
        mods.append((tr.models.gemma4.modeling_gemma4.Gemma4RMSNorm(256, eps=1e-6, with_scale=False), FusedRMSNorm))
    for m, cls in mods:
        f = cls.from_module(m)
        for dt in (torch.bfloat16, torch.float16):
            x = (torch.randn(8, 256, generator=torch.Generator().manual_seed(1)) * 2 + 0.5).to(dt)
            g = torch.randn(8, 256, generator=torch.Generator().manual_seed(2)).to(dt)
            xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
            m(xa).backward(g)
            f(xb).backward(g)
            torch.testing.assert_close(xb.grad, xa.grad, **tol(dt, 0.05))
    assert FusedLayerNorm(8).output_in_input_dtype is False
    assert FusedLayerNorm.from_layer_norm(nn.LayerNorm(8)).output_in_input_dtype is False
    with pytest.raises(TypeError, match=r"^output_in_input_dtype: expected a bool, got str"):
        FusedLayerNorm(8).output_in_input_dtype = "yes"
    with pytest.raises(TypeError, match=r"^elementwise_affine: expected a bool, got str"):
        FusedRMSNorm(8, elementwise_affine="no")
    with pytest.raises(TypeError, match=r"got torch.nn.RMSNorm, which does not subtract the mean: use "
                                        r"FusedRMSNorm.from_module"):
        FusedLayerNorm.from_module(nn.RMSNorm(8, elementwise_affine=False))
    with pytest.raises(TypeError, match=r"got GroupNorm, whose statistics are per group"):
        FusedLayerNorm.from_module(nn.GroupNorm(1, 8, affine=False))
    with pytest.raises(ValueError, match=r"^module: BufferNorm has buffers \(scale\), which the fused module"):
        FusedRMSNorm.from_module(BufferNorm(), verify=False)
    assert FusedLayerNorm.from_module(tr.models.olmo.modeling_olmo.OlmoLayerNorm(8), 1e-3, verify=False).eps == 1e-3
    model = _olmo(layers=1)
    fuse(model)
    model.model.norm.eps = 1e-3
    with pytest.warns(UserWarning, match=r"unfuse: the eps set on the fused replacement of the OlmoLayerNorm \(0.001\) "
                                         r"is not carried back"):
        unfuse(model)


def test_probe_leaves_modules_that_are_not_norms():
    for m in (nn.ReLU(), nn.Dropout(0.1), nn.Identity()):
        p = probe_weightless_norm(m)
        assert not p.ok and not p.candidate, (m, p)


# ---------------------------------------------------------------------------------------------------- modules
@pytest.mark.parametrize("shape", [(7,), (3, 64), (2, 5, 17), (4, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_of_the_last_dimension(shape, dtype):
    """FusedRMSNorm() without a shape and weight normalizes the last dimension of each input, whatever its size."""
    f = FusedRMSNorm(eps=1e-6, elementwise_affine=False)
    assert f.normalized_shape is None and f.weight is None
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    torch.testing.assert_close(f(x), torch.rms_norm(x, x.shape[-1:], None, 1e-6), rtol=0, atol=0)


def test_fused_rms_norm_without_a_shape_errors():
    with pytest.raises(TypeError, match=r"^normalized_shape / hidden_size: give exactly one \(or neither with "
                                        r"elementwise_affine=False"):
        FusedRMSNorm(eps=1e-6)
    f = FusedRMSNorm(eps=1e-6, elementwise_affine=False)
    with pytest.raises(ValueError, match=r"^input: expected a tensor of at least 1 dimension"):
        f(torch.tensor(1.0))
    with pytest.raises(TypeError, match=r"^input: expected a torch.Tensor, got list"):
        f([1.0, 2.0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_from_module_of_weightless_norms_equals_them(dtype):
    """FusedRMSNorm.from_module (Gemma 4's v_norm) and MixedFusedLayerNorm.from_module (OLMo's) give the module's
    output, bit for bit on the CPU, in its dtype, under CPU autocast too."""
    mods = [(tr.models.olmo.modeling_olmo.OlmoLayerNorm(40), MixedFusedLayerNorm, (3, 5, 40))]
    if "gemma4_text" in CONFIG_MAPPING:
        g = tr.models.gemma4.modeling_gemma4.Gemma4RMSNorm(8, eps=1e-6, with_scale=False)
        mods += [(g, FusedRMSNorm, (3, 5, 8)), (g, FusedRMSNorm, (4, 33))]
    for m, cls, shape in mods:
        f = cls.from_module(m)
        assert f.weight is None and f.output_in_input_dtype and not list(f.parameters())
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(3)).to(dtype)
        torch.testing.assert_close(f(x), m(x), rtol=0, atol=0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert f(x).dtype == m(x).dtype == dtype
    olmo = FusedLayerNorm.from_module(tr.models.olmo.modeling_olmo.OlmoLayerNorm(40))
    assert repr(olmo) == "FusedLayerNorm((40,), eps=1e-05, elementwise_affine=False, bias=False, " \
                         "output_in_input_dtype=True)"


def test_from_module_errors():
    olmo = tr.models.olmo.modeling_olmo.OlmoLayerNorm(8)
    with pytest.raises(ValueError, match=r"^module: OlmoLayerNorm computes LayerNorm without parameters; use "
                                         r"FusedLayerNorm.from_module"):
        FusedRMSNorm.from_module(olmo)
    with pytest.raises(ValueError, match=r"computes RMSNorm without parameters; use FusedRMSNorm.from_module"):
        FusedLayerNorm.from_module(LiteralEpsRMSNorm(1e-6))
    with pytest.raises(ValueError, match=r"^output_in_weight_dtype: LiteralEpsRMSNorm has no weight"):
        FusedRMSNorm.from_module(LiteralEpsRMSNorm(1e-6), output_in_weight_dtype=True)
    with pytest.raises(ValueError, match=r"^output_in_input_dtype: PlainLayerNorm returns fp32 under autocast"):
        FusedLayerNorm.from_module(PlainLayerNorm(8), output_in_input_dtype=True)
    assert not FusedLayerNorm.from_module(PlainLayerNorm(8)).__dict__.get("output_in_input_dtype", False)
    with pytest.raises(ValueError, match=r"output differs from the formula with eps=1e-05 \(its eps\) on a random"):
        FusedLayerNorm.from_module(AttrLayerNorm(8, used=1e-3))
    for bad in (nn.ReLU(), nn.Linear(4, 4)):
        with pytest.raises(TypeError, match=r"^module: expected a torch.nn.LayerNorm or a LayerNorm-style module"):
            FusedLayerNorm.from_module(bad)
    with pytest.raises(TypeError, match=r"^module: expected torch.nn.RMSNorm or an RMSNorm-style"):
        FusedRMSNorm.from_module(nn.ReLU())
    # verify=False: the module's attributes, on the caller's word
    f = FusedLayerNorm.from_module(AttrLayerNorm(8, eps=1e-3, used=1e-6), verify=False)
    assert (f.normalized_shape, f.eps) == ((8,), 1e-3)
    with pytest.raises(ValueError, match=r"^eps: OlmoLayerNorm has no 'variance_epsilon', 'eps', 'epsilon'; pass "
                                         r"eps="):
        FusedLayerNorm.from_module(olmo, verify=False)
    assert FusedLayerNorm.from_module(olmo, eps=1e-5, verify=False).eps == 1e-5
    with pytest.raises(ValueError, match=r"^eps: LiteralEpsRMSNorm has no 'variance_epsilon', 'eps', 'epsilon'; "
                                         r"pass eps="):
        FusedRMSNorm.from_module(LiteralEpsRMSNorm(1e-6), verify=False)
    assert FusedRMSNorm.from_module(LiteralEpsRMSNorm(1e-6), eps=1e-6, verify=False).eps == 1e-6


# ------------------------------------------------------------------------------------------------------- fuse
def test_fuse_olmo_norms_as_layer_norms():
    """Every OlmoLayerNorm of an OLMo model is fused (kind layer_norm, MixedFusedLayerNorm of the hidden size, eps
    1e-5 read from its output); loss and gradients equal the unfused model's; state_dict keys unchanged; unfuse
    restores the modules; ops without layer_norm leaves them (counted under not_requested)."""
    model = _olmo()
    norms = _weightless(model)
    assert len(norms) == 5
    keys = set(model.state_dict())
    ref = _step(model)
    report = fuse(model)
    rows = [r for r in report.rows if r.path in norms]
    assert len(rows) == 5 and all((r.kind, r.replacement, r.fused, r.eligible) == (
        "layer_norm", "MixedFusedLayerNorm", True, True) for r in rows), rows
    assert all("LayerNorm without parameters over 64 values, eps=1e-05 (read from its output)" in r.reason
               for r in rows), rows
    fused = dict(model.named_modules())
    for p in norms:
        m = fused[p]
        assert isinstance(m, MixedFusedLayerNorm) and m.eps == 1e-5 and m.normalized_shape == (64,), m
    assert set(model.state_dict()) == keys
    got = _step(model)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
    for n, g in ref[1].items():
        torch.testing.assert_close(got[1][n], g, rtol=0, atol=0)
    clone = copy.deepcopy(model)
    assert unfuse(model)
    assert all(dict(model.named_modules())[p] is m for p, m in norms.items())
    torch.testing.assert_close(_step(clone)[0], ref[0], rtol=0, atol=0)
    report = fuse(model, ops=["rms_norm", "swiglu"], dry_run=True)
    assert not [r for r in report.rows if r.path in norms] and report.not_requested.get("layer_norm") == 5, report


def test_fuse_gemma4_weightless_rms_norms():
    """Gemma 4's v_norm and router norm (Gemma4RMSNorm(with_scale=False)) are fused as FusedRMSNorm of the last
    dimension (its report choice told at 1024 wide, with the note); loss and gradients equal the unfused model's;
    unfuse restores them."""
    model = _gemma4()
    norms = _weightless(model)
    assert sorted(p.rsplit(".", 2)[-2] + "." + p.rsplit(".", 1)[-1] for p in norms) == \
        ["router.norm"] * 2 + ["self_attn.v_norm"] * 2
    ref = _step(model)
    report = fuse(model)
    rows = [r for r in report.rows if r.path in norms]
    assert len(rows) == 4 and all((r.kind, r.replacement, r.fused) == ("rms_norm", "FusedRMSNorm", True)
                                  for r in rows), rows
    assert all(r.forward.endswith("@1024 wide") and "of any width, eps=1e-06 (its variance_epsilon)" in r.reason
               for r in rows), rows
    assert any(n.startswith("@1024 wide: the choice for rows of 1024 values") for n in report._notes())
    fused = dict(model.named_modules())
    assert all(isinstance(fused[p], FusedRMSNorm) and fused[p].normalized_shape is None for p in norms)
    got = _step(model)
    # (forward bit for bit; the backward is torch.rms_norm's, not autograd through Gemma's ops: fp32 rounding apart)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
    for n, g in ref[1].items():
        torch.testing.assert_close(got[1][n], g, **tol(torch.float32), msg=lambda m: f"grad of {n}: {m}")
    assert unfuse(model)
    assert all(dict(model.named_modules())[p] is m for p, m in norms.items())


def test_a_weightless_norm_with_an_instance_forward_is_left():
    """A norm whose forward was set on the instance (a patch) is left, with the reason, as a weighted one is."""
    model = _olmo(layers=1)
    norm = model.model.norm
    norm.forward = lambda x: x
    row = next(r for r in fuse(model, dry_run=True).rows if r.path == "model.norm")
    assert not row.fused and row.kind == "layer_norm", row


def test_fuse_of_a_bare_weightless_norm_names_from_module():
    report = fuse(tr.models.olmo.modeling_olmo.OlmoLayerNorm(8), dry_run=True)
    row = report.rows[-1]
    assert row.kind == "layer_norm" and "MixedFusedLayerNorm.from_module(model)" in row.reason, report.rows


# ------------------------------------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("shape", [(4, 64, 8, 256), (3, 7, 1), (5, 4097), (2, 3, 1000)],
                         ids=["gemma4-v_norm", "width-1", "width-4097", "width-1000"])
def test_weightless_rms_norm_on_cuda_against_float64(no_tuning_table, dtype, shape):
    """FusedRMSNorm of the last dimension on the kernel (strict mode: no fallback), forward and backward against
    float64, on non-contiguous input (a transposed view), outputs in the input's dtype."""
    f = FusedRMSNorm(eps=1e-6, elementwise_affine=False, output_in_input_dtype=True, impl="pipegoose")
    g = torch.Generator(device="cuda").manual_seed(7)
    base = torch.randn(*shape[:-2], shape[-1], shape[-2], device="cuda", generator=g)
    x = base.transpose(-1, -2).to(dtype).requires_grad_()   # (non-contiguous)
    dy = torch.randn(x.shape, device="cuda", generator=g).to(dtype)
    dispatch.reset_stats()
    with dispatch.strict():
        y = f(x)
        y.backward(dy)
    assert dispatch.stats().get("rms_norm") == {"pipegoose": 1}, dispatch.stats()
    x64 = x.detach().double().requires_grad_()
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    y64.backward(dy.double())
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), y64, **TOLERANCES[dtype])
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol(dtype, 2))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_fused_olmo_on_cuda_runs_the_kernel(no_tuning_table, dtype):
    """A fused OLMo model on CUDA in each dtype: every layer_norm call ran pipegoose's kernel (strict mode), and
    loss and gradients are within twice the unfused model's error from a float64 copy plus the dtype's tolerance."""
    _layer_norm_model_on_cuda(_olmo(hidden=128).cuda(), dtype, calls=5)


def test_the_rms_norm_probe_runs_the_other_training_mode_too():
    """An RMSNorm with a weight and a dropout in training only, probed in eval mode: refused (the probe of norms with
    a weight ran the module's current mode only; found by session 70's review of the weightless probe)."""
    from pipegoose.nn.fusion.transformers.matching import probe_rms_norm

    class DropoutRMSNorm(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.weight, self.variance_epsilon = nn.Parameter(torch.ones(n)), 1e-6

        def forward(self, x):
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return self.weight * nn.functional.dropout(h, 0.5, self.training).to(x.dtype)

    for m in (DropoutRMSNorm(16).eval(), DropoutRMSNorm(16).train()):
        p = probe_rms_norm(m)
        assert not p.ok and "mode differs from that in its current mode (a dropout?)" in p.reason, p
    assert probe_rms_norm(models.LlamaStyleRMSNorm(16).train()).ok



# ------------------------------------------------------------------------------- LayerNorms of their own class
def _cohere(qk_norm=False, hidden=64):
    if "cohere" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no cohere")
    torch.manual_seed(0)
    cfg = tr.CohereConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
                          num_key_value_heads=2, num_hidden_layers=2, vocab_size=models.VOCAB,
                          max_position_embeddings=64, use_qk_norm=qk_norm, pad_token_id=0, bos_token_id=1,
                          eos_token_id=2)
    model = tr.CohereForCausalLM(cfg).eval()
    for m in model.modules():   # (weights off 1, so that a dropped weight shows)
        if type(m).__name__ == "CohereLayerNorm":
            nn.init.uniform_(m.weight, 0.5, 1.5)
    return model


class BiasLayerNorm(nn.Module):
    """Cohere's LayerNorm with a bias too: fp32 math, one rounding to the input's dtype."""

    def __init__(self, n, eps=1e-5):
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.ones(n)), nn.Parameter(torch.zeros(n)), eps

    def forward(self, x):
        return nn.functional.layer_norm(x.float(), x.shape[-1:], self.weight.float(), self.bias.float(),
                                        self.eps).to(x.dtype)


class HalfLayerNorm(BiasLayerNorm):
    """The same with the parameters cast to the input's dtype: an fp32 weight rounded to bf16 first, another
    rounding."""

    def forward(self, x):
        return nn.functional.layer_norm(x, x.shape[-1:], self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)


def test_layer_norm_probe_of_modules_with_a_weight():
    """probe_layer_norm_module accepts Cohere's and Cohere 2's LayerNorm and one with a bias; Cohere's per-head q/k
    norms (a 2-D weight, each head normalized over its own values), RMSNorms (Llama's, T5's "LayerNorm") and a
    LayerNorm of another rounding are not (the RMSNorm ones are no candidate: the RMSNorm probe reports them)."""
    from pipegoose.nn.fusion.transformers.matching import probe_layer_norm_module

    cohere = tr.models.cohere.modeling_cohere
    for m in (cohere.CohereLayerNorm(32, eps=1e-5), BiasLayerNorm(32)):
        p = probe_layer_norm_module(m)
        assert p.ok and p.eps == 1e-5 and p.output_in_input_dtype, p
    p = probe_layer_norm_module(cohere.CohereLayerNorm((4, 8), eps=1e-5))
    assert not p.ok and not p.candidate and "its weight is (4, 8)" in p.reason, p
    for m in (models.LlamaStyleRMSNorm(32), tr.models.t5.modeling_t5.T5LayerNorm(32)):
        p = probe_layer_norm_module(m)
        assert not p.ok and not p.candidate, p
    p = probe_layer_norm_module(HalfLayerNorm(32))
    assert not p.ok and p.candidate and "with bf16 input and fp32 parameters its output differs" in p.reason, p


def test_fuse_cohere_layer_norms():
    """Every CohereLayerNorm of a Cohere model is fused (kind layer_norm, MixedFusedLayerNorm sharing its weight,
    eps its variance_epsilon); loss and gradients equal the unfused model's within fp32 rounding, under CPU autocast
    too; state_dict keys unchanged; unfuse restores them. With use_qk_norm, the per-head q/k norms are skipped with
    the reason (kind rms_norm, as before)."""
    model = _cohere()
    norms = {p: m for p, m in model.named_modules() if type(m).__name__ == "CohereLayerNorm"}
    assert len(norms) == 3
    keys = set(model.state_dict())
    ref = _step(model)
    report = fuse(model)
    rows = [r for r in report.rows if r.path in norms]
    assert len(rows) == 3 and all((r.kind, r.replacement, r.fused) == ("layer_norm", "MixedFusedLayerNorm", True)
                                  for r in rows), rows
    assert all(r.reason.startswith("LayerNorm of a weight over 64 values, eps=1e-05 (its variance_epsilon)")
               for r in rows), rows
    fused = dict(model.named_modules())
    for p, m in norms.items():
        assert isinstance(fused[p], MixedFusedLayerNorm) and fused[p].weight is m.weight and fused[p].bias is None
    assert set(model.state_dict()) == keys
    got = _step(model)
    torch.testing.assert_close(got[0], ref[0], **tol(torch.float32))
    for n, g in ref[1].items():
        torch.testing.assert_close(got[1][n], g, **tol(torch.float32), msg=lambda m: f"grad of {n}: {m}")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused_loss = _step(model)[0]
    assert unfuse(model)
    assert all(dict(model.named_modules())[p] is m for p, m in norms.items())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(_step(model)[0], fused_loss, **tol(torch.bfloat16))
    qk = _cohere(qk_norm=True)
    rows = [r for r in fuse(qk, dry_run=True).rows if r.path.endswith(("q_norm", "k_norm"))]
    assert len(rows) == 4 and all(not r.fused and "is 2-D" in r.reason for r in rows), rows


def test_from_module_of_a_layer_norm_module():
    m = BiasLayerNorm(16)
    nn.init.uniform_(m.weight, 0.5, 1.5)
    nn.init.normal_(m.bias)
    f = FusedLayerNorm.from_module(m)
    assert f.weight is m.weight and f.bias is m.bias and f.eps == 1e-5 and f.output_in_input_dtype
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 16, generator=torch.Generator().manual_seed(5)).to(dt)
        torch.testing.assert_close(f(x), m(x), **tol(dt, 0.1))
    with pytest.raises(ValueError, match=r"^module: HalfLayerNorm does not pass the LayerNorm probe: with bf16"):
        FusedLayerNorm.from_module(HalfLayerNorm(16))
    assert FusedLayerNorm.from_module(HalfLayerNorm(16), verify=False).weight is not None
    with pytest.raises(TypeError, match=r"^module: expected a torch.nn.LayerNorm or a LayerNorm-style module \(a leaf "
                                        r"of a 1-D"):
        FusedLayerNorm.from_module(tr.models.cohere.modeling_cohere.CohereLayerNorm((4, 8)))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_fused_cohere_on_cuda_runs_the_kernel(no_tuning_table, dtype):
    """A fused Cohere model on CUDA in each dtype: every layer_norm call ran pipegoose's kernel (strict mode), loss
    and gradients within twice the unfused model's error from a float64 copy plus the dtype's tolerance. (The copy's
    CohereLayerNorms compute in fp32, which they cast to: the reference is float64 elsewhere.)"""
    _layer_norm_model_on_cuda(_cohere(hidden=128).cuda(), dtype, calls=3)


def test_layer_norm_module_review_fixes():
    """A review of the LayerNorm probe: a fused Cohere norm reads and writes variance_epsilon (carried back by
    unfuse); a module that computes fp16 otherwise is refused (the probe tried bf16 only); a bias registered as None
    (nn.LayerNorm(bias=False)'s idiom) is accepted; from_module of the other kind names the right one."""
    from pipegoose.nn.fusion.transformers.matching import probe_layer_norm_module

    model = _cohere()
    orig = model.model.norm
    fuse(model)
    fused = model.model.norm
    assert fused.variance_epsilon == 1e-5
    fused.variance_epsilon = 1e-2
    assert fused.eps == 1e-2
    with pytest.raises(ValueError, match=r"^variance_epsilon: expected"):
        fused.variance_epsilon = -1.0
    assert unfuse(model) and orig.variance_epsilon == 1e-2

    class Fp16NativeLayerNorm(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(n)), 1e-5

        def forward(self, x):
            if x.dtype == torch.float16:
                return nn.functional.layer_norm(x, x.shape[-1:], self.weight.half(), None, self.eps)
            return nn.functional.layer_norm(x.float(), x.shape[-1:], self.weight.float(), None, self.eps).to(x.dtype)

    p = probe_layer_norm_module(Fp16NativeLayerNorm(32))
    assert not p.ok and p.candidate and "with fp16 input and fp32 parameters its output differs" in p.reason, p

    class NoBiasLayerNorm(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(n)), 1e-5
            self.register_parameter("bias", None)

        def forward(self, x):
            b = None if self.bias is None else self.bias.float()
            return nn.functional.layer_norm(x.float(), x.shape[-1:], self.weight.float(), b, self.eps).to(x.dtype)

    assert probe_layer_norm_module(NoBiasLayerNorm(32)).ok
    f = FusedLayerNorm.from_module(NoBiasLayerNorm(32))
    assert f.bias is None and f.weight is not None
    with pytest.raises(ValueError, match=r"^module: LlamaStyleRMSNorm computes RMSNorm \(it does not subtract the "
                                         r"mean\); use FusedRMSNorm.from_module"):
        FusedLayerNorm.from_module(models.LlamaStyleRMSNorm(16))
    with pytest.raises(ValueError, match=r"^module: CohereLayerNorm computes LayerNorm \(it subtracts the mean\); use "
                                         r"FusedLayerNorm.from_module"):
        FusedRMSNorm.from_module(tr.models.cohere.modeling_cohere.CohereLayerNorm(16))
