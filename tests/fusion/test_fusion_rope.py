"""CPU: the rotary position embedding of the query and key (op ``rope``): ``functional.apply_rotary_pos_emb`` on its
reference path against transformers' ``apply_rotary_pos_emb`` (bit for bit: values and gradients, those of cos and
sin included) and float64, its argument checks, the dispatcher's reasons for the kernel (``_pipegoose_supports`` on
problems described as on a GPU; no GPU needed), strict mode and ``impl=``, transforms and nested tensors, a Llama model
whose attention calls it.

The tests marked ``slow`` load the kernel library (a first run compiles it: minutes; they skip, with the reason,
where nvcc is missing) and run the ops' fake impls and the C++ autograd formula on meta tensors.
"""

from __future__ import annotations

import contextlib
import math
import re
import warnings
from dataclasses import replace

import pytest
import torch
from kernel_loading import calls_of, load_or_skip
from tolerances import tol

import pipegoose.nn.fusion as fusion
from pipegoose.nn.fusion import dispatch
from pipegoose.nn.fusion import functional as PF
from pipegoose.nn.fusion.ops import rope as R
from pipegoose.nn.fusion.ops._common import NO_STORAGE
from pipegoose.nn.fusion.ops.rope import FORWARD_AD_ROPE

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CUDA = torch.device("cuda", 0)   # a device object: no GPU needed to describe a problem on it


def _hf():
    """transformers' apply_rotary_pos_emb (Llama's; Mistral, Qwen2/3 and GPT-NeoX copy it)."""
    return pytest.importorskip("transformers.models.llama.modeling_llama").apply_rotary_pos_emb


def _inputs(b=2, hq=4, hk=2, s=5, d=8, dtype=torch.float32, seed=0, bc=1, bshd=False, table_dtype=None):
    """q [b, hq, s, d] and k [b, hk, s, d] ([b, s, h, d] with ``bshd``), cos and sin [bc, s, d] of angles drawn per
    element (the halves of a head differ)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn((b, s, hq, d) if bshd else (b, hq, s, d), generator=g).to(dtype)
    k = torch.randn((b, s, hk, d) if bshd else (b, hk, s, d), generator=g).to(dtype)
    theta = torch.rand(bc, s, d, generator=g) * (2 * math.pi)
    return q, k, theta.cos().to(table_dtype or dtype), theta.sin().to(table_dtype or dtype)


def _fwd_bwd(fn, q, k, cos, sin, tables_grad=False, seed=9, **kw):
    """fn's outputs and the gradients of q, k, cos and sin (None for tables that do not require grad) for random
    output gradients."""
    leaves = [q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_(),
              cos.detach().clone().requires_grad_(tables_grad), sin.detach().clone().requires_grad_(tables_grad)]
    qe, ke = fn(*leaves, **kw)
    g = torch.Generator().manual_seed(seed)
    dq = torch.randn(qe.shape, generator=g).to(qe.dtype)
    dk = torch.randn(ke.shape, generator=g).to(ke.dtype)
    torch.autograd.backward((qe, ke), (dq, dk))
    return (qe.detach(), ke.detach(), *(t.grad for t in leaves)), (dq, dk)


def _ref64(q, k, cos, sin, dq, dk, unsqueeze_dim=1):
    """float64 by the per-half formulas: y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2, and the transposed rotation
    g1 = dy1 c1 + dy2 s2, g2 = dy2 c2 - dy1 s1 (reduced over broadcast dimensions, as autograd does)."""
    c, s = cos.double().unsqueeze(unsqueeze_dim), sin.double().unsqueeze(unsqueeze_dim)
    h = q.shape[-1] // 2
    c1, c2, s1, s2 = c[..., :h], c[..., h:], s[..., :h], s[..., h:]

    def fwd(x):
        x1, x2 = x.double()[..., :h], x.double()[..., h:]
        return torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), -1)

    def bwd(dy, x):
        d1, d2 = dy.double()[..., :h], dy.double()[..., h:]
        return torch.cat((d1 * c1 + d2 * s2, d2 * c2 - d1 * s1), -1).sum_to_size(x.shape)

    return fwd(q), fwd(k), bwd(dq, q), bwd(dk, k)


# ------------------------------------------------------------------------------------------- the reference path
REFERENCE_CASES = {
    "llama": dict(),
    "cos_per_sequence": dict(bc=2),
    "grouped_heads_odd_sizes": dict(b=3, hq=3, hk=1, s=7),
    "bshd": dict(bshd=True, unsqueeze_dim=2),
    "bshd_negative_dim": dict(bshd=True, unsqueeze_dim=-2),
    "odd_head_dim": dict(d=7),
    "one_position": dict(s=1),
    "tables_require_grad": dict(tables_grad=True, bc=2),
    "empty": dict(s=0),
}


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
@pytest.mark.parametrize("case", list(REFERENCE_CASES), ids=list(REFERENCE_CASES))
def test_reference_path_is_transformers_bit_for_bit(dtype, case):
    """On the CPU the functional runs transformers' formula: both outputs and the gradients of q, k (and of cos and
    sin where they require grad) equal transformers' apply_rotary_pos_emb exactly, counted as the torch path."""
    kw = dict(REFERENCE_CASES[case])
    tables_grad = kw.pop("tables_grad", False)
    unsqueeze_dim = kw.pop("unsqueeze_dim", 1)
    q, k, cos, sin = _inputs(dtype=dtype, seed=len(case), **kw)
    got, _ = _fwd_bwd(PF.apply_rotary_pos_emb, q, k, cos, sin, tables_grad, unsqueeze_dim=unsqueeze_dim)
    want, _ = _fwd_bwd(_hf(), q, k, cos, sin, tables_grad, unsqueeze_dim=unsqueeze_dim)
    names = ("q_embed", "k_embed", "grad_q", "grad_k", "grad_cos", "grad_sin")
    for name, a, b in zip(names, got, want):
        if b is None:
            assert a is None, f"{name}: a gradient where transformers gives none"
            continue
        assert a.dtype == b.dtype == dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name} differs from transformers'"
    assert got[0].shape == q.shape and got[1].shape == k.shape
    assert dispatch.stats()["rope"] == {"torch": 1}
    assert dispatch.last_choice("rope").source == ("empty" if q.numel() == 0 else "fallback")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bshd", [False, True], ids=["bhsd", "bshd"])
def test_reference_path_against_float64(dtype, bshd):
    """The path against the float64 per-half formulas (and the transposed rotation for the gradients) within the
    tolerance table: eager 16-bit rounds both products and their sum (three roundings: scale 2)."""
    q, k, cos, sin = _inputs(3, 4, 2, 33, 64, dtype, seed=3, bc=3, bshd=bshd)
    got, (dq, dk) = _fwd_bwd(PF.apply_rotary_pos_emb, q, k, cos, sin, unsqueeze_dim=2 if bshd else 1)
    want = _ref64(q, k, cos, sin, dq, dk, unsqueeze_dim=2 if bshd else 1)
    for name, a, w in zip(("q_embed", "k_embed", "grad_q", "grad_k"), got, want):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.double(), w, **tol(dtype, 2), msg=lambda m: f"{name}: {m}")
    # (the float64 formulas are transformers', and they tell rotations apart: a swapped half or a sign is far off)
    hf = _hf()(q.double(), k.double(), cos.double(), sin.double(), unsqueeze_dim=2 if bshd else 1)
    torch.testing.assert_close(want[0], hf[0], rtol=1e-12, atol=1e-12)
    assert (want[0] - _ref64(q, k, sin, cos, dq, dk, unsqueeze_dim=2 if bshd else 1)[0]).abs().max() > 0.5


@pytest.mark.parametrize("what,build", [
    ("tables in bf16, q and k in fp32 (promoted)", lambda: _inputs(dtype=torch.float32, table_dtype=torch.bfloat16)),
    ("q and k of other dtypes", lambda: (lambda q, k, c, s: (q, k.half(), c, s))(*_inputs())),
    ("q of batch 1, tables of batch 2 (q broadcast)", lambda: (lambda q, k, c, s: (q[:1], k[:1], c, s))(
        *_inputs(bc=2))),
    ("an unbatched [H, S, D] q, cos [S, D] at dim 0", lambda: (lambda q, k, c, s: (q[0], k[0], c[0], s[0], 0))(
        *_inputs())),
    ("float64", lambda: _inputs(dtype=torch.float64)),
], ids=["promoted_tables", "mixed_qk", "broadcast_q", "unbatched", "float64"])
def test_what_the_kernel_does_not_take_follows_transformers(what, build):
    """Inputs the kernel declines (dtypes that differ, broadcasting, other ranks, fp64) run transformers' formula
    exactly: shapes and dtypes as PyTorch's promotion and broadcasting give them, gradients reduced likewise."""
    args = build()
    q, k, cos, sin = args[:4]
    unsqueeze_dim = args[4] if len(args) > 4 else 1
    got, _ = _fwd_bwd(PF.apply_rotary_pos_emb, q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    want, _ = _fwd_bwd(_hf(), q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    for a, b in zip(got[:4], want[:4]):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), what
    assert got[2].shape == q.shape and got[3].shape == k.shape
    ok, why = R._pipegoose_supports(_cuda_problem(q, k, cos, sin, unsqueeze_dim))
    assert not ok and why, what


def test_shapes_that_do_not_broadcast_raise_as_transformers():
    """A k of other positions: PyTorch's broadcasting error on the reference path, as transformers' function raises
    it."""
    q, k, cos, sin = _inputs()
    args = (q, k[:, :, :3], cos, sin)
    with pytest.raises(RuntimeError) as want:
        _hf()(*args)
    with pytest.raises(RuntimeError) as got:
        PF.apply_rotary_pos_emb(*args)
    assert str(got.value) == str(want.value)


# ------------------------------------------------------------------------------------------------ partial rotary
def _neox():
    """GPT-NeoX's apply_rotary_pos_emb: tables narrower than a head rotate that many values, the rest pass through."""
    return pytest.importorskip("transformers.models.gpt_neox.modeling_gpt_neox").apply_rotary_pos_emb


def _partial64(q, k, cos, sin, dq, dk, unsqueeze_dim=1):
    """float64 partial rotary: the per-half formulas on the first R = cos.shape[-1] values, the rest (and their
    gradients) passed through."""
    r = cos.shape[-1]
    rot = _ref64(q[..., :r], k[..., :r], cos, sin, dq[..., :r], dk[..., :r], unsqueeze_dim)
    return tuple(torch.cat((a, x[..., r:].double()), -1) for a, x in zip(rot, (q, k, dq, dk)))


PARTIAL_CASES = {
    "pythia": dict(r=2),   # a quarter of each head
    "half": dict(r=4),
    "cos_per_sequence": dict(r=4, bc=2),
    "grouped_heads_odd_sizes": dict(r=4, b=3, hq=3, hk=1, s=7),
    "bshd": dict(r=4, bshd=True, unsqueeze_dim=2),
    "tables_require_grad": dict(r=4, tables_grad=True, bc=2),
    "promoted_tables": dict(r=4, table_dtype=torch.float32),
}


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
@pytest.mark.parametrize("case", list(PARTIAL_CASES), ids=list(PARTIAL_CASES))
def test_partial_rotary_reference_is_gpt_neox_bit_for_bit(dtype, case):
    """Tables of R < D values a head: the reference path computes GPT-NeoX's function exactly (values and gradients,
    those of cos and sin included; 16-bit q with fp32 tables promoted to fp32 as its torch.cat does), and it is the
    float64 partial formula within the tolerance table; Llama's function raises for such tables."""
    kw = dict(PARTIAL_CASES[case])
    r, tables_grad, unsqueeze_dim = kw.pop("r"), kw.pop("tables_grad", False), kw.pop("unsqueeze_dim", 1)
    if kw.get("table_dtype") and dtype not in (torch.float16, torch.bfloat16):
        pytest.skip("promoted tables: 16-bit q and k")
    q, k, cos, sin = _inputs(dtype=dtype, seed=len(case), **kw)
    cos, sin = cos[..., :r].contiguous(), sin[..., :r].contiguous()
    got, (dq, dk) = _fwd_bwd(PF.apply_rotary_pos_emb, q, k, cos, sin, tables_grad, unsqueeze_dim=unsqueeze_dim)
    want, _ = _fwd_bwd(_neox(), q, k, cos, sin, tables_grad, unsqueeze_dim=unsqueeze_dim)
    for name, a, b in zip(("q_embed", "k_embed", "grad_q", "grad_k", "grad_cos", "grad_sin"), got, want):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{name} differs from GPT-NeoX's"
    assert got[0].dtype == (torch.float32 if kw.get("table_dtype") else dtype)
    ref = _partial64(q, k, cos, sin, dq, dk, unsqueeze_dim)
    for name, a, w in zip(("q_embed", "k_embed", "grad_q", "grad_k"), got, ref):
        t = tol(dtype, 2) if dtype != torch.float64 else dict(rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(a.double(), w, **t, msg=lambda m: f"{name}: {m}")
    with pytest.raises(RuntimeError):
        _hf()(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


def test_tables_of_one_value_broadcast_and_heads_of_two_sizes_follow_transformers():
    """Tables of one value a head broadcast over it, as in Llama's function (not partial rotary: a review found them
    taken for it); a q wider than the tables with a k as wide as them: GPT-NeoX's function, per tensor."""
    q, k, cos, sin = _inputs(d=8, dtype=torch.float64)
    got = PF.apply_rotary_pos_emb(q, k, cos[..., :1], sin[..., :1])
    want = _hf()(q, k, cos[..., :1], sin[..., :1])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not R.rope_problem(q, k, cos[..., :1], sin[..., :1])["partial"]
    got = PF.apply_rotary_pos_emb(q, k[..., :4], cos[..., :4], sin[..., :4])
    want = _neox()(q, k[..., :4], cos[..., :4], sin[..., :4])
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_partial_rotary_on_the_gpu_is_the_built_in_choice(monkeypatch):
    """On a GPU the kernel takes partial rotary (even R below D), by the built-in order (session 54's GPT-NeoX step:
    +5%): the tuning rules, timed on whole heads, do not speak for it; whole heads keep the rules' choice."""
    table = dispatch.TuningTable.parse({"device": "Fake GPU", "rules": [
        {"op": "rope", "dtype": "bfloat16", "pass": None, "max_cols": None, "impl": "pipegoose"}]})
    monkeypatch.setattr(dispatch, "tuning_table", lambda device: table)
    monkeypatch.setattr(dispatch, "kernel", lambda name: (object(), "") if name == "pipegoose/rope"
                        else (None, f"{name}: unexpected"))
    monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "0")
    q, k, cos, sin = _inputs(2, 4, 2, 5, 16, torch.bfloat16)
    whole = _cuda_problem(q, k, cos, sin)
    assert not whole["partial"]
    assert (dispatch.choose("rope", whole).impl, dispatch.choose("rope", whole).source) == ("pipegoose", "tuning")
    part = _cuda_problem(q, k, cos[..., :4], sin[..., :4])
    assert part["partial"] and _supports()(part) == (True, "")
    c = dispatch.choose("rope", part)
    assert (c.impl, c.source, c.fallback) == ("pipegoose", "builtin", False)
    monkeypatch.setenv("PIPEGOOSE_IMPL_ROPE", "torch")
    assert (dispatch.choose("rope", part).impl, dispatch.choose("rope", part).source) == ("torch", "env")
    monkeypatch.delenv("PIPEGOOSE_IMPL_ROPE")
    c = dispatch.choose("rope", replace(part, device=torch.device("cpu")))
    assert c.impl == "torch" and c.reasons["pipegoose"] == "needs a CUDA tensor, got device cpu"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["pythia", "cos_per_sequence", "bshd", "promoted_tables", "fused_qkv"])
def test_partial_rotary_on_the_kernel_path(monkeypatch, dtype, case):
    """The kernel's path with partial tables on a CPU stand-in of the kernel's ops (float64 math rounded once, its
    shape checks, dtypes and layouts): one forward op on q and k as they are (views, no copy) and one backward op;
    values and gradients within the tolerance table of float64, the passed-through values and their gradients
    exact; outputs in q's and k's layout where those are dense."""
    from rope_stand_in import kernel_on_cpu

    kw = {"pythia": dict(r=4, d=16), "cos_per_sequence": dict(r=4, bc=2), "bshd": dict(r=4, bshd=True),
          "promoted_tables": dict(r=4, table_dtype=torch.float32), "fused_qkv": dict(r=4)}[case]
    if kw.get("table_dtype") and dtype == torch.float32:
        pytest.skip("promoted tables: 16-bit q and k")
    r = kw.pop("r")
    unsqueeze_dim = 2 if kw.get("bshd") else 1
    q, k, cos, sin = _inputs(b=2, hq=4, hk=2, s=5, **{"d": 8, **kw}, dtype=dtype, seed=11)
    if case == "fused_qkv":   # GPT-NeoX's q and k: chunks of a [B, H, S, 3D] projection (not dense)
        qkv = torch.randn(2, 4, 5, 3 * q.shape[-1], generator=torch.Generator().manual_seed(5)).to(dtype)
        q, k, _ = qkv.chunk(3, dim=-1)
    cos, sin = cos[..., :r].contiguous(), sin[..., :r].contiguous()
    # leaves of q's and k's strides (a clone of the fused projection's chunks would be dense)
    q, k = (torch.empty_strided(t.shape, t.stride(), dtype=dtype).copy_(t).requires_grad_() for t in (q, k))
    with kernel_on_cpu(monkeypatch, dispatch) as calls:
        qe, ke = PF.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim, impl="pipegoose")
        assert dispatch.last_choice("rope").impl == "pipegoose"
        g = torch.Generator().manual_seed(9)
        dq, dk = (torch.randn(t.shape, generator=g).to(t.dtype) for t in (qe, ke))
        torch.autograd.backward((qe, ke), (dq, dk))
    got = (qe.detach(), ke.detach(), q.grad, k.grad)
    assert [c[0] for c in calls] == ["rope_forward", "rope_backward"]
    heads_first = q.transpose(1, 2) if unsqueeze_dim == 2 else q
    for arg, x in zip(calls[0][1:], (heads_first, k.transpose(1, 2) if unsqueeze_dim == 2 else k)):
        assert arg.shape == x.shape and arg.data_ptr() == x.data_ptr() and arg.stride() == x.stride(), \
            "the kernel gets q and k as they are (views), not copies"
    want = _partial64(q, k, cos, sin, dq, dk, unsqueeze_dim)
    # torch.empty_like's layout: contiguous q and k, [B, S, H, D] too, give contiguous results, as GPT-NeoX's
    # concatenation does (a review found session 54's results transposed there, so that a .view(B, S, -1) failed); the
    # chunks of a fused projection (not dense), dense results in their order of dimensions
    for a, x in zip(got[:2], (q, k)):
        assert a.stride() == torch.empty_like(x).stride() and (a.is_contiguous() or case == "fused_qkv"), a.stride()
    out = torch.float32 if kw.get("table_dtype") else dtype
    for name, a, w, like in zip(("q_embed", "k_embed", "grad_q", "grad_k"), got, want, (out, out, dtype, dtype)):
        assert a.dtype == like and a.shape == w.shape, name
        torch.testing.assert_close(a.double(), w, **tol(dtype, 1), msg=lambda m: f"{name}: {m}")
        # (exact: a gradient of fp32 outputs rounded once to q's dtype, as autograd of the concatenation does)
        assert torch.equal(a[..., r:], w[..., r:].to(a.dtype)), f"{name}: the passed-through values changed"


def test_exported_from_the_package():
    assert fusion.apply_rotary_pos_emb is PF.apply_rotary_pos_emb
    assert "apply_rotary_pos_emb" in fusion.__all__ and "apply_rotary_pos_emb" in PF.__all__


def test_explain_on_cpu_names_why_the_kernel_does_not_run():
    q, k, cos, sin = _inputs(dtype=torch.bfloat16)
    c = dispatch.explain("rope", q, k, cos, sin)
    assert (c.impl, c.source, c.fallback) == ("torch", "fallback", True)
    assert "needs a CUDA tensor" in c.reasons["pipegoose"] and c.reasons["torch"] == ""
    assert "needs a CUDA tensor" in str(c)
    assert dispatch.stats().get("rope", {}) == {}   # explain counts nothing
    c = dispatch.explain("rope", q[:, :, :0], k[:, :, :0], cos[:, :0], sin[:, :0])
    assert (c.impl, c.source, c.fallback) == ("torch", "empty", False)
    c = dispatch.explain("rope", q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)
    assert (c.impl, c.fallback) == ("torch", True)


def test_strict_mode_raises_on_the_cpu_fallback():
    """Off CUDA the kernel cannot run, so the PyTorch path is a fallback, which strict mode refuses; an empty input
    and an explicit impl='torch' are no fallback."""
    q, k, cos, sin = _inputs()
    hf = _hf()
    with dispatch.strict():
        with pytest.raises(dispatch.FusionFallbackError, match=r"rope: strict mode.*needs a CUDA tensor"):
            PF.apply_rotary_pos_emb(q, k, cos, sin)
        got = PF.apply_rotary_pos_emb(q[:, :, :0], k[:, :, :0], cos[:, :0], sin[:, :0])
        assert got[0].shape == (2, 4, 0, 8) and got[1].shape == (2, 2, 0, 8)
        got = PF.apply_rotary_pos_emb(q, k, cos, sin, impl="torch")
        assert all(torch.equal(a, b) for a, b in zip(got, hf(q, k, cos, sin)))
        assert dispatch.last_choice("rope").source == "argument"
    # out of strict mode the same call runs
    assert all(torch.equal(a, b) for a, b in zip(PF.apply_rotary_pos_emb(q, k, cos, sin), hf(q, k, cos, sin)))


def test_impl_argument():
    q, k, cos, sin = _inputs()
    want = _hf()(q, k, cos, sin)
    with pytest.warns(UserWarning, match=r"impl='pipegoose' cannot run this input: needs a CUDA tensor"):
        got = PF.apply_rotary_pos_emb(q, k, cos, sin, impl="pipegoose")
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    c = dispatch.last_choice("rope")
    assert (c.impl, c.fallback) == ("torch", True)
    with pytest.raises(ValueError, match=r"impl: rope has no implementation 'fused'"):
        PF.apply_rotary_pos_emb(q, k, cos, sin, impl="fused")
    with pytest.raises(TypeError, match="impl"):
        PF.apply_rotary_pos_emb(q, k, cos, sin, impl=1)
    got = PF.apply_rotary_pos_emb(q, k, cos, sin, impl=" Torch ")   # any case, as PIPEGOOSE_IMPL_*
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert dispatch.last_choice("rope").source == "argument"


def test_impl_environment_variable(monkeypatch):
    q, k, cos, sin = _inputs()
    monkeypatch.setenv("PIPEGOOSE_IMPL_ROPE", "torch")
    PF.apply_rotary_pos_emb(q, k, cos, sin)
    assert dispatch.last_choice("rope").source == "env"
    monkeypatch.setenv("PIPEGOOSE_IMPL_ROPE", "apex")
    with pytest.raises(ValueError, match="PIPEGOOSE_IMPL_ROPE"):
        PF.apply_rotary_pos_emb(q, k, cos, sin)


# --------------------------------------------------------------------------------------------- argument errors
def _bad_argument_cases():
    q, k, cos, sin = _inputs()
    cases = [
        ((1.0, k, cos, sin), TypeError, r"^q: expected a floating point torch.Tensor, got float"),
        ((q, [1.0], cos, sin), TypeError, r"^k: expected a floating point torch.Tensor, got list"),
        ((q, k, None, sin), TypeError, r"^cos: expected a floating point torch.Tensor, got NoneType"),
        ((q, k, cos, sin.numpy()), TypeError, r"^sin: expected a floating point torch.Tensor, got ndarray"),
        ((q.int(), k, cos, sin), TypeError, r"^q: expected a floating point torch.Tensor, got int32"),
        ((q, k.long(), cos, sin), TypeError, r"^k: expected a floating point torch.Tensor, got int64"),
        ((q, k, cos.bool(), sin), TypeError, r"^cos: "),
        ((q, k, cos, sin.to(torch.complex64)), TypeError, r"^sin: "),
        ((q, k, cos, sin, 1.0), TypeError, r"^unsqueeze_dim: expected an int .*got float"),
        ((q, k, cos, sin, True), TypeError, r"^unsqueeze_dim: expected an int .*got bool"),
        ((q, k, cos, sin, "1"), TypeError, r"^unsqueeze_dim: expected an int .*got str"),
        ((q, k, cos, sin, None), TypeError, r"^unsqueeze_dim: expected an int .*got NoneType"),
        ((q, k.to("meta"), cos, sin), ValueError, r"^k: on meta, expected q's device cpu"),
        ((q, k, cos.to("meta"), sin), ValueError, r"^cos: on meta, expected q's device cpu"),
        ((q, k, cos, sin.to("meta")), ValueError, r"^sin: on meta, expected q's device cpu"),
    ]
    if hasattr(torch, "float8_e4m3fn"):
        cases += [((q.to(torch.float8_e4m3fn), k, cos, sin), TypeError, r"^q: expected dtype .*got float8_e4m3fn"),
                  ((q, k, cos, sin.to(torch.float8_e4m3fn)), TypeError, r"^sin: expected dtype .*got float8_e4m3fn")]
    return cases


def test_argument_errors_name_the_argument():
    """(A CUDA tensor needs a GPU; the meta device stands in for another device. tests/kernels/test_rope_cuda.py checks
    the kernel's own device checks.)"""
    for args, err, match in _bad_argument_cases():
        with pytest.raises(err, match=match):
            PF.apply_rotary_pos_emb(*args)
        with pytest.raises(err, match=match):   # explain refuses what the op refuses, with its message
            dispatch.explain("rope", *args)
    with pytest.raises(ValueError, match=r"^k: on cpu, expected q's device meta"):
        dispatch.explain("rope", *(t.to("meta") if i != 1 else t for i, t in enumerate(_inputs())))
    assert dispatch.stats().get("rope", {}) == {}   # a refused call is not counted


def test_tensor_argument_errors_after_a_cached_choice():
    """The choice cache holds a valid call's choice; a call with other tensor metadata is checked again (a wrong
    dtype or device after a right one must still raise)."""
    q, k, cos, sin = _inputs()
    PF.apply_rotary_pos_emb(q, k, cos, sin)
    PF.apply_rotary_pos_emb(q, k, cos, sin)
    with pytest.raises(TypeError, match="^cos: "):
        PF.apply_rotary_pos_emb(q, k, cos.int(), sin)
    with pytest.raises(ValueError, match="^sin: "):
        PF.apply_rotary_pos_emb(q, k, cos, sin.to("meta"))
    with pytest.raises(TypeError, match="^k: "):
        PF.apply_rotary_pos_emb(q, k.long(), cos, sin)


@pytest.mark.parametrize("bad", [True, 1.0, "numpy.int64"], ids=["bool", "float", "numpy_int64"])
def test_unsqueeze_dim_errors_after_a_cached_choice(bad):
    """A refused unsqueeze_dim is refused whether or not a call with unsqueeze_dim=1 came first."""
    import numpy as np

    bad = np.int64(1) if bad == "numpy.int64" else bad
    q, k, cos, sin = _inputs()
    with pytest.raises(TypeError, match="^unsqueeze_dim: "):
        PF.apply_rotary_pos_emb(q, k, cos, sin, bad)
    PF.apply_rotary_pos_emb(q, k, cos, sin, 1)
    with pytest.raises(TypeError, match="^unsqueeze_dim: "):
        PF.apply_rotary_pos_emb(q, k, cos, sin, bad)


# ------------------------------------------------------------------------------ the kernel's supports() on CUDA
def _cuda_problem(q, k, cos, sin, unsqueeze_dim=1):
    """The problem of the call as if its tensors were on a GPU (metadata only: the CPU tensors describe it)."""
    return replace(R.rope_problem(q, k, cos, sin, unsqueeze_dim), device=CUDA)


def _supports():
    return dispatch.implementations("rope")["pipegoose"].supports


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_takes_the_shapes_of_transformers_on_cuda(dtype):
    supports = _supports()
    q, k, cos, sin = _inputs(2, 8, 2, 5, 16, dtype)
    taken = {
        "[B, H, S, D], one table": (q, k, cos, sin, 1),
        "unsqueeze_dim -3": (q, k, cos, sin, -3),
        "a table per sequence": (q, k, *_inputs(2, 8, 2, 5, 16, dtype, bc=2)[2:], 1),
        "[B, S, H, D]": (q.transpose(1, 2), k.transpose(1, 2), cos, sin, 2),
        "unsqueeze_dim -2": (q.transpose(1, 2), k.transpose(1, 2), cos, sin, -2),
        "Llama's transposed projections": (q.transpose(1, 2).contiguous().transpose(1, 2), k, cos, sin, 1),
        "strided views": (q[..., ::2], k[..., ::2], cos[..., ::2], sin[..., ::2], 1),
        "head dim 2": (q[..., :2], k[..., :2], cos[..., :2], sin[..., :2], 1),
        "one head each": (q[:, :1], k[:, :1], cos, sin, 1),
        "no query heads": (q[:, :0], k, cos, sin, 1),
        "one position": (q[:, :, :1], k[:, :, :1], cos[:, :1], sin[:, :1], 1),
        "heads equal to positions": (q[:, :5], k, cos, sin, 1),
        "partial rotary, 4 of 16 values": (q, k, cos[..., :4], sin[..., :4], 1),
        "partial rotary, [B, S, H, D]": (q.transpose(1, 2), k.transpose(1, 2), cos[..., :8], sin[..., :8], 2),
        "partial rotary, 2 of 16 values": (q, k, cos[..., :2], sin[..., :2], 1),
    }
    for what, (qq, kk, cc, ss, dim) in taken.items():
        assert supports(_cuda_problem(qq, kk, cc, ss, dim)) == (True, ""), what
    with torch.no_grad():   # tables that require grad, without grad mode: no gradient is asked for
        assert supports(_cuda_problem(q, k, cos.requires_grad_(), sin, 1)) == (True, "")
    assert supports(R.rope_problem(q, k, cos, sin)) == (False, "needs a CUDA tensor, got device cpu")


def _declined(build):
    q, k, cos, sin = _inputs(2, 4, 2, 5, 8)
    return build(q, k, cos, sin)


DECLINED = [
    ("k_half", lambda q, k, c, s: (q, k.half(), c, s, 1),
     r"^q is float32 but k, cos, sin are float16, float32, float32: the kernel takes one dtype, or 16-bit q and k "
     r"with fp32 cos and sin \(autocast\)$"),
    ("tables_bf16", lambda q, k, c, s: (q, k, c.bfloat16(), s.bfloat16(), 1),
     r"^q is float32 but k, cos, sin are float32, bfloat16, bfloat16: the kernel takes one dtype, or 16-bit q and "
     r"k with fp32 cos and sin \(autocast\)$"),
    ("float64", lambda q, k, c, s: (q.double(), k.double(), c.double(), s.double(), 1),
     r"^q dtype float64 not supported \(float32, float16, bfloat16\)$"),
    ("cos_requires_grad", lambda q, k, c, s: (q, k, c.requires_grad_(), s, 1),
     r"^cos or sin requires grad: the kernel gives them no gradient$"),
    ("sin_requires_grad", lambda q, k, c, s: (q.requires_grad_(), k, c, s.requires_grad_(), 1),
     r"^cos or sin requires grad"),
    ("unsqueeze_dim_0", lambda q, k, c, s: (q, k, c, s, 0),
     r"^unsqueeze_dim=0: the kernel takes 1 \(\[B, H, S, D\]\) or 2 \(\[B, S, H, D\]\)$"),
    ("unsqueeze_dim_3", lambda q, k, c, s: (q, k, c, s, 3), r"^unsqueeze_dim=3: "),
    ("unsqueeze_dim_-1", lambda q, k, c, s: (q, k, c, s, -1), r"^unsqueeze_dim=-1: "),
    ("q_3d", lambda q, k, c, s: (q[0], k, c, s, 1),
     r"^q \[4, 5, 8\], k \[2, 2, 5, 8\], cos \[1, 5, 8\]: the kernel takes 4-d q and k and 3-d cos and sin "
     r"\[batch or 1, seq, head_dim\]$"),
    ("k_5d", lambda q, k, c, s: (q, k[None], c, s, 1), r"^q \[2, 4, 5, 8\], k \[1, 2, 2, 5, 8\], cos"),
    ("cos_2d", lambda q, k, c, s: (q, k, c[0], s[0], 1), r"cos \[5, 8\]: the kernel takes"),
    ("cos_4d_unsqueezed", lambda q, k, c, s: (q, k, c[:, None], s[:, None], 1), r"cos \[1, 1, 5, 8\]: the kernel"),
    ("sin_per_sequence", lambda q, k, c, s: (q, k, c, s.expand(2, 5, 8), 1),
     r"^sin's shape \[2, 5, 8\] differs from cos's \[1, 5, 8\]$"),
    ("k_batch", lambda q, k, c, s: (q, k[:1], c, s, 1),
     r"^k's shape \[1, 2, 5, 8\] differs from q's \[2, 4, 5, 8\] in batch, seq or head_dim$"),
    ("k_seq", lambda q, k, c, s: (q, k[:, :, :3], c, s, 1), r"^k's shape \[2, 2, 3, 8\] differs from q's"),
    ("k_head_dim", lambda q, k, c, s: (q, k[..., :6], c, s, 1), r"^k's shape \[2, 2, 5, 6\] differs"),
    ("partial_rotary_odd", lambda q, k, c, s: (q, k, c[..., :3], s[..., :3], 1),
     r"^3 rotated dims \(cos's last size\) is odd: rotate_half splits them in two$"),
    ("wider_table", lambda q, k, c, s: (q[..., :6], k[..., :6], c, s, 1),
     r"^cos's shape \[1, 5, 8\] is not \[2 or 1, 5, R\], R 6 or below it \(partial rotary\); other "
     r"broadcasts run PyTorch's ops$"),
    ("longer_table", lambda q, k, c, s: (q[:, :, :3], k[:, :, :3], c, s, 1), r"^cos's shape \[1, 5, 8\] is not "
                                                                             r"\[2 or 1, 3, R\], R 8 or below it"),
    ("cos_batch_3", lambda q, k, c, s: (q, k, c.expand(3, 5, 8), s.expand(3, 5, 8), 1),
     r"^cos's shape \[3, 5, 8\] is not \[2 or 1, 5, R\]"),
    ("q_batch_1_tables_2", lambda q, k, c, s: (q[:1], k[:1], c.expand(2, 5, 8), s.expand(2, 5, 8), 1),
     r"^cos's shape \[2, 5, 8\] is not \[1 or 1, 5, R\]"),
    ("bhsd_as_bshd", lambda q, k, c, s: (q, k, c, s, 2), r"^k's shape \[2, 2, 5, 8\] differs from q's|^cos's shape"),
    ("bshd_as_bhsd", lambda q, k, c, s: (q.transpose(1, 2), k.transpose(1, 2), c, s, 1),
     r"^k's shape \[2, 5, 2, 8\] differs from q's \[2, 5, 4, 8\]"),
    ("odd_head_dim", lambda q, k, c, s: (q[..., :7], k[..., :7], c[..., :7], s[..., :7], 1),
     r"^head_dim 7 is odd: rotate_half splits it in two$"),
    ("empty", lambda q, k, c, s: (q[:, :, :0], k[:, :, :0], c[:, :0], s[:, :0], 1), r"^an empty input$"),
    ("empty_heads", lambda q, k, c, s: (q[:, :0], k[:, :0], c, s, 1), r"^an empty input$"),
]


@pytest.mark.parametrize("what,build,reason", DECLINED, ids=[c[0] for c in DECLINED])
def test_kernel_declines_on_cuda_with_the_reason(what, build, reason):
    ok, why = _supports()(_cuda_problem(*_declined(build)))
    assert not ok, what
    assert re.search(reason, why), (what, why)


def test_kernel_declines_tensors_without_storage_and_dual_tensors():
    supports = _supports()
    p = _cuda_problem(*_inputs())
    assert supports(p) == (True, "")
    assert supports(replace(p, extra={**p.extra, "storage": False})) == (False, NO_STORAGE)
    assert supports(replace(p, extra={**p.extra, "forward_ad": True})) == (False, FORWARD_AD_ROPE)


def test_problem_describes_the_call():
    q, k, cos, sin = _inputs(2, 4, 2, 5, 8, torch.bfloat16)
    p = R.rope_problem(q.requires_grad_(), k, cos, sin)
    assert (p.op, p.dtype, p.device, p.cols, p.needs_grad) == ("rope", torch.bfloat16, torch.device("cpu"), 8, True)
    assert p["shape"] == (2, 4, 5, 8) and p["k_shape"] == (2, 2, 5, 8) and p["cos_shape"] == p["sin_shape"] == (1, 5, 8)
    assert p["dtypes"] == (torch.bfloat16,) * 3 and p["unsqueeze_dim"] == 1 and p["numel"] == 320 + 160
    assert p["table_grad"] is False and p["storage"] is True and p["forward_ad"] is False
    assert not R.rope_problem(q.detach(), k, cos, sin).needs_grad
    assert R.rope_problem(q.detach(), k.requires_grad_(), cos, sin).needs_grad
    with torch.no_grad():
        assert not R.rope_problem(q, k, cos, sin).needs_grad
    assert R.rope_problem(q, k, cos, sin.requires_grad_())["table_grad"] is True
    with torch.no_grad():
        assert R.rope_problem(q, k, cos, sin)["table_grad"] is False
    assert R.rope_problem(q, k, cos, sin, 2)["unsqueeze_dim"] == 2


def test_choice_on_cuda_of_empty_and_small_inputs(monkeypatch):
    """On a GPU an empty input runs the reference (source "empty", no fallback: strict mode passes) on metadata alone:
    no kernel is loaded (or built) for it. The small-problem rule (PIPEGOOSE_SMALL_NUMEL) is not rope's: its reference
    is some ten PyTorch kernels, not one native op, so a small input takes the kernel, and one the kernel declines is a
    fallback strict mode refuses."""
    def no_kernel(name):
        raise AssertionError(f"loaded {name}")

    monkeypatch.setattr(dispatch, "kernel", no_kernel)
    monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "1000")
    assert not dispatch.implementations("rope")["torch"].small_first
    q, k, cos, sin = _inputs(dtype=torch.bfloat16)
    with dispatch.strict():
        c = dispatch.select("rope", _cuda_problem(q[:, :, :0], k[:, :, :0], cos[:, :0], sin[:, :0]))
    assert (c.impl, c.source, c.fallback) == ("torch", "empty", False)
    with dispatch.strict(), pytest.raises(dispatch.FusionFallbackError, match="5 rotated dims"):
        dispatch.select("rope", _cuda_problem(q, k, cos[..., :5], sin[..., :5]))
    with dispatch.strict(), pytest.raises(dispatch.FusionFallbackError, match="cos or sin requires grad"):
        dispatch.select("rope", _cuda_problem(q, k, cos.clone().requires_grad_(), sin))
    monkeypatch.setattr(dispatch, "kernel", lambda name: (object(), "") if name == "pipegoose/rope"
                        else (None, f"{name}: unexpected"))
    p = _cuda_problem(q, k, cos, sin)
    assert p["numel"] < 1000
    with dispatch.strict():
        c = dispatch.select("rope", p)
    assert (c.impl, c.source, c.fallback) == ("pipegoose", "builtin", False)


def test_choice_on_cuda_picks_the_kernel_where_it_loads(monkeypatch):
    """Above the small size, on CUDA, with the kernel loadable (a stand-in here), the kernel is the built-in choice;
    tables that require grad run the reference (a fallback with the reason) although it loads; where it cannot load,
    the reference runs with the load error as the reason."""
    monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "0")
    q, k, cos, sin = _inputs(dtype=torch.float16)
    monkeypatch.setattr(dispatch, "kernel", lambda name: (object(), "") if name == "pipegoose/rope"
                        else (None, f"{name}: unexpected"))
    c = dispatch.choose("rope", _cuda_problem(q, k, cos, sin))
    assert (c.impl, c.source, c.fallback) == ("pipegoose", "builtin", False)
    c = dispatch.choose("rope", _cuda_problem(q.transpose(1, 2), k.transpose(1, 2), cos, sin, 2))
    assert (c.impl, c.source, c.fallback) == ("pipegoose", "builtin", False)
    c = dispatch.choose("rope", _cuda_problem(q, k, cos, sin.requires_grad_()))
    assert (c.impl, c.fallback) == ("torch", True) and "pipegoose: cos or sin requires grad" in c.reason
    c = dispatch.choose("rope", _cuda_problem(q, k, cos, sin.detach()), impl="pipegoose")
    assert (c.impl, c.source) == ("pipegoose", "argument")
    monkeypatch.setattr(dispatch, "kernel", lambda name: (None, f"{name} unavailable: nvcc missing"))
    c = dispatch.choose("rope", _cuda_problem(q, k, cos, sin.detach()))
    assert (c.impl, c.fallback) == ("torch", True) and "pipegoose/rope unavailable: nvcc missing" in c.reason


# -------------------------------------------------------------------------------------------------- other inputs
def test_vmap_and_forward_ad_run_the_reference():
    q, k, cos, sin = _inputs(seed=2)
    hf = _hf()
    qs, ks, cs, ss = (torch.stack([t, 2 * t]) for t in (q, k, cos, sin))
    got = torch.func.vmap(PF.apply_rotary_pos_emb)(qs, ks, cs, ss)
    for i in range(2):
        assert all(torch.equal(a[i], b) for a, b in zip(got, hf(qs[i], ks[i], cs[i], ss[i])))
    tangent = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    _, jvp = torch.func.jvp(lambda x: PF.apply_rotary_pos_emb(x, k, cos, sin)[0], (q,), (tangent,))
    _, want = torch.func.jvp(lambda x: hf(x, k, cos, sin)[0], (q,), (tangent,))
    assert torch.equal(jvp, want)


def test_nested_tensors_run_the_reference():
    """A nested q and k of ragged lengths ([B, j, H, D], unsqueeze_dim=2) with nested tables [B, j, D]: PyTorch's ops
    (a fallback, counted), as transformers' function gives them."""
    g = torch.Generator().manual_seed(8)
    offsets = torch.tensor([0, 2, 5])
    q = torch.nested.nested_tensor_from_jagged(torch.randn(5, 4, 8, generator=g), offsets)
    k = torch.nested.nested_tensor_from_jagged(torch.randn(5, 2, 8, generator=g), offsets)
    cos = torch.nested.nested_tensor_from_jagged(torch.randn(5, 8, generator=g), offsets)
    sin = torch.nested.nested_tensor_from_jagged(torch.randn(5, 8, generator=g), offsets)
    want = _hf()(q, k, cos, sin, unsqueeze_dim=2)
    got = PF.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    assert got[0].is_nested and got[1].is_nested
    for a, b in zip(got, want):
        assert all(torch.equal(x, y) for x, y in zip(a.unbind(), b.unbind()))
    c = dispatch.last_choice("rope")
    assert c.fallback and "nested tensor" in c.reason


def test_llama_attention_calling_the_functional_is_unchanged(monkeypatch):
    """A small Llama (eager attention) whose attention calls our apply_rotary_pos_emb instead of transformers': the
    same hidden states and parameter gradients, bit for bit on the CPU; one call per layer through the dispatcher."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = llama.LlamaModel(cfg)
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(3))

    def run():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids).last_hidden_state
        out.pow(2).mean().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]

    want, want_grads = run()
    monkeypatch.setattr(llama, "apply_rotary_pos_emb", PF.apply_rotary_pos_emb)
    got, grads = run()
    assert dispatch.stats()["rope"] == {"torch": 2}
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))


def test_no_warnings_on_the_plain_cpu_call():
    q, k, cos, sin = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PF.apply_rotary_pos_emb(q, k, cos, sin)
        PF.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)


# ----------------------------------------------------------------------- fake impls and C++ autograd (meta; slow)
def _load_library():
    return load_or_skip("pipegoose/rope")


def _meta(*shape, dtype=torch.float32, requires_grad=False):
    return torch.empty(*shape, device="meta", dtype=dtype, requires_grad=requires_grad)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fake_impls_on_meta_tensors(dtype):
    """Shapes, dtypes and strides as the kernels return them: each output of its input's shape; its input's strides
    where that is dense (Llama's transposed projections), torch.empty_like's dense strides in the input's order where
    it is not (a fused qkv projection's heads), contiguous where the last dimension was copied; the backward's in
    cos's dtype."""
    _load_library()
    ops = torch.ops.pipegoose
    b, hq, hk, s, d = 2, 4, 2, 5, 8
    q, k, cos, sin = _meta(b, hq, s, d, dtype=dtype), _meta(b, hk, s, d, dtype=dtype), _meta(1, s, d, dtype=dtype), \
        _meta(1, s, d, dtype=dtype)
    for qe, ke in (ops.rope_forward(q, k, cos, sin), ops.rope(q, k, cos, sin)):
        assert qe.device.type == ke.device.type == "meta" and qe.dtype == ke.dtype == dtype
        assert qe.shape == (b, hq, s, d) and ke.shape == (b, hk, s, d) and qe.is_contiguous() and ke.is_contiguous()
    # Llama's layout: [B, S, H, D] transposed
    qt, kt = _meta(b, s, hq, d, dtype=dtype).transpose(1, 2), _meta(b, s, hk, d, dtype=dtype).transpose(1, 2)
    for qe, ke in (ops.rope_forward(qt, kt, cos, sin), ops.rope(qt, kt, cos, sin),
                   ops.rope_backward(qt, kt, cos, sin)):
        assert qe.shape == qt.shape and qe.stride() == qt.stride() and ke.stride() == kt.stride()
    # a fused qkv projection's heads (not dense): dense, in the input's order
    qkv = _meta(b, s, hq + 2 * hk, d, dtype=dtype)
    qf, kf = qkv[:, :, :hq].transpose(1, 2), qkv[:, :, hq:hq + hk].transpose(1, 2)
    qe, ke = ops.rope_forward(qf, kf, cos, sin)
    assert qe.shape == qf.shape and qe.stride() == (s * hq * d, d, hq * d, 1) and ke.stride() == (s * hk * d, d,
                                                                                                   hk * d, 1)
    # a last dimension of stride 2 (copied first): contiguous
    qw = _meta(b, hq, s, 2 * d, dtype=dtype)[..., ::2]
    qe, _ = ops.rope_forward(qw, k, cos, sin)
    assert qe.shape == (b, hq, s, d) and qe.is_contiguous()
    # the backward: outputs in cos's dtype, whatever the gradients' dtype
    gq, gk = ops.rope_backward(_meta(b, hq, s, d), _meta(b, hk, s, d, dtype=torch.float16), cos, sin)
    assert gq.dtype == gk.dtype == dtype and gq.shape == (b, hq, s, d) and gk.shape == (b, hk, s, d)
    qe, ke = ops.rope_forward(q[:, :, :0], k[:, :, :0], cos[:, :0], sin[:, :0])
    assert qe.shape == (b, hq, 0, d) and ke.shape == (b, hk, 0, d)
    # partial rotary: tables narrower than a head (2 of 8, 6 of 8), whole heads out; and GPT-NeoX's chunks of a fused
    # [B, S, H, 3D] projection (not dense): dense, in the input's order
    for r in (2, 6):
        for op in (ops.rope_forward, ops.rope, ops.rope_backward):
            qe, ke = op(q, k, cos[..., :r], sin[..., :r])
            assert qe.shape == q.shape and ke.shape == k.shape and qe.is_contiguous() and ke.is_contiguous()
    qn, kn, _ = _meta(b, s, hq, 3 * d, dtype=dtype).transpose(1, 2).chunk(3, dim=-1)
    qe, ke = ops.rope(qn, kn, cos[..., :4], sin[..., :4])
    assert qe.shape == qn.shape and qe.stride() == (s * hq * d, d, hq * d, 1)


@pytest.mark.slow
def test_fake_impls_refuse_what_the_kernels_refuse():
    _load_library()
    ops = torch.ops.pipegoose
    q, k, cos, sin = _meta(2, 4, 5, 8), _meta(2, 2, 5, 8), _meta(1, 5, 8), _meta(1, 5, 8)
    cases = [
        (lambda: ops.rope_forward(q, k, cos[0], sin[0]), r"cos: expected 3 dimensions \[batch or 1, seq, rotated "
                                                         r"dims\], got 2"),
        (lambda: ops.rope_forward(q, k, cos, _meta(2, 5, 8)), r"sin: expected cos's shape \(1, 5, 8\), got "
                                                              r"\(2, 5, 8\)"),
        (lambda: ops.rope_forward(q[0], k, cos, sin), r"q: expected 4 dimensions \[batch, heads, seq, head_dim\], "
                                                      r"got 3"),
        (lambda: ops.rope(q, k[None], cos, sin), r"k: expected 4 dimensions"),
        (lambda: ops.rope_forward(q, k[:, :, :3], cos, sin), r"k: shape \(2, 2, 3, 8\) does not match q's "
                                                             r"\(2, 4, 5, 8\) in batch, seq, head_dim"),
        (lambda: ops.rope_backward(_meta(2, 4, 5, 8), _meta(1, 2, 5, 8), cos, sin),
         r"grad_k_embed: shape \(1, 2, 5, 8\) does not match grad_q_embed's"),
        (lambda: ops.rope_forward(_meta(2, 4, 5, 7), _meta(2, 2, 5, 7), _meta(1, 5, 7), _meta(1, 5, 7)),
         r"q: head_dim must be even, got 7"),
        # partial rotary: an odd number of rotated values, one, or more than a head
        (lambda: ops.rope_forward(q, k, cos[..., :3], sin[..., :3]),
         r"cos: its last size \(the rotated values a head\) must be even, got 3"),
        (lambda: ops.rope_forward(q, k, cos[..., :1], sin[..., :1]), r"cos: shape \(1, 5, 1\) is not \[2 or 1, 5, R\], "
                                                                     r"R 8 or 2 to 7 \(partial rotary\)"),
        (lambda: ops.rope(q, k, _meta(1, 5, 10), _meta(1, 5, 10)), r"cos: shape \(1, 5, 10\) is not"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()


@pytest.mark.slow
@pytest.mark.parametrize("bad", ["cos_seq", "cos_wider", "cos_odd_partial", "cos_batch", "dtype"])
def test_fake_impls_check_cos_and_the_dtypes_as_the_kernels_do(bad):
    _load_library()
    q, k = _meta(2, 4, 5, 8), _meta(2, 2, 5, 8)
    cos = {"cos_seq": _meta(1, 4, 8), "cos_wider": _meta(1, 5, 10), "cos_odd_partial": _meta(1, 5, 5),
           "cos_batch": _meta(3, 5, 8)}.get(bad, _meta(1, 5, 8))
    if bad == "dtype":
        q = q.bfloat16()
    with pytest.raises(RuntimeError):
        torch.ops.pipegoose.rope_forward(q, k, cos, cos)


@pytest.mark.slow
@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)], ids=["both", "q", "k"])
def test_autograd_gives_gradients_for_the_inputs_that_need_them(needs):
    """The C++ autograd formula: one call of the backward op, gradients (of the inputs' shapes and dtype) for the
    inputs that require them and None for the others; cos and sin saved, not q and k."""
    _load_library()
    q = _meta(2, 4, 5, 64, dtype=torch.bfloat16, requires_grad=needs[0])
    k = _meta(2, 2, 5, 64, dtype=torch.bfloat16, requires_grad=needs[1])
    cos, sin = _meta(1, 5, 64, dtype=torch.bfloat16), _meta(1, 5, 64, dtype=torch.bfloat16)
    qe, ke = torch.ops.pipegoose.rope(q, k, cos, sin)
    assert qe.requires_grad and ke.requires_grad and qe.grad_fn is ke.grad_fn
    assert "RoPEFunction" in qe.grad_fn.name()
    with calls_of({"pipegoose::rope_backward", "pipegoose::rope_forward"}) as log:
        torch.autograd.backward((qe, ke), (torch.empty_like(qe), torch.empty_like(ke)))
    assert log.calls == ["pipegoose::rope_backward"]
    for t, need in zip((q, k), needs):
        assert (t.grad is not None) == need
        if need:
            assert t.grad.shape == t.shape and t.grad.dtype == t.dtype and t.grad.device.type == "meta"


@pytest.mark.slow
@pytest.mark.parametrize("used", ["q_embed", "k_embed"])
def test_autograd_with_one_output_left_out_of_the_loss(used):
    """A loss of one output: the backward op runs once, and the used side's input gets its gradient."""
    _load_library()
    q, k = _meta(2, 4, 5, 8, requires_grad=True), _meta(2, 2, 5, 8, requires_grad=True)
    cos, sin = _meta(1, 5, 8), _meta(1, 5, 8)
    qe, ke = torch.ops.pipegoose.rope(q, k, cos, sin)
    out, leaf = (qe, q) if used == "q_embed" else (ke, k)
    with calls_of({"pipegoose::rope_backward"}) as log:
        out.backward(torch.empty_like(out))
    assert log.calls == ["pipegoose::rope_backward"]
    assert leaf.grad is not None and leaf.grad.shape == leaf.shape


@pytest.mark.slow
@pytest.mark.parametrize("used", ["q_embed", "k_embed"])
def test_an_output_left_out_of_the_loss_gives_its_input_no_gradient(used):
    _load_library()
    q, k = _meta(2, 4, 5, 8, requires_grad=True), _meta(2, 2, 5, 8, requires_grad=True)
    cos, sin = _meta(1, 5, 8), _meta(1, 5, 8)
    qe, ke = torch.ops.pipegoose.rope(q, k, cos, sin)
    out, other = (qe, k) if used == "q_embed" else (ke, q)
    out.backward(torch.empty_like(out))
    assert other.grad is None


@contextlib.contextmanager
def _ops_on_cpu():
    """The built library's ops with CPU kernels: the stand-in's float64 math (tests/rope_stand_in.py) registered for
    pipegoose::rope_forward, rope_backward and rope on the CPU key (removed afterwards), so that the C++ autograd of
    pipegoose::rope (bindings/rope.cpp) runs on CPU tensors; yields the stand-in's log of calls (name, q-like, k-like
    argument)."""
    from rope_stand_in import stand_in_ops

    _load_library()
    calls: list = []
    ops = stand_in_ops(calls)
    lib = torch.library.Library("pipegoose", "IMPL")
    try:
        lib.impl("rope_forward", ops.rope_forward, "CPU")
        lib.impl("rope_backward", ops.rope_backward, "CPU")
        lib.impl("rope", ops.rope_forward, "CPU")   # below autograd the forward alone, as on CUDA
        yield calls
    finally:
        lib._destroy()


@pytest.mark.slow
@pytest.mark.parametrize("r", [8, 4, 2], ids=["whole", "half", "quarter"])
def test_cpp_autograd_gradients_and_the_sides_it_skips(r):
    """The C++ autograd of pipegoose::rope over CPU stand-ins of its kernels, whole heads and partial rotary (tables of
    R of 8 values): gradcheck in float64; an output left out of the loss, or an input that needs no gradient, gives
    that input None and sends that side to the backward op with no heads (no work); a loss of both, one backward
    call with both sides whole."""
    with _ops_on_cpu() as calls:
        q, k, cos, sin = _inputs(2, 3, 1, 5, 8, torch.float64, seed=6)
        cos, sin = cos[..., :r].contiguous(), sin[..., :r].contiguous()
        q.requires_grad_()
        k.requires_grad_()
        assert torch.autograd.gradcheck(lambda a, b: torch.ops.pipegoose.rope(a, b, cos, sin), (q, k))
        for used in (0, 1):
            calls.clear()
            q.grad = k.grad = None
            torch.ops.pipegoose.rope(q, k, cos, sin)[used].sum().backward()
            assert [c[0] for c in calls] == ["rope_forward", "rope_backward"]
            assert calls[1][1].shape[1] == (3 if used == 0 else 0) and calls[1][2].shape[1] == (1 if used else 0)
            got, other = (q.grad, k.grad) if used == 0 else (k.grad, q.grad)
            want = torch.autograd.grad(_neox_or_llama(q, k, cos, sin)[used].sum(), (q, k)[used])[0]
            assert other is None and torch.equal(got, want)
        calls.clear()
        qe, ke = torch.ops.pipegoose.rope(q, k.detach(), cos, sin)   # k needs no gradient
        (qe.sum() + ke.sum()).backward()
        assert calls[1][2].shape[1] == 0 and calls[1][1].shape[1] == 3


def _neox_or_llama(q, k, cos, sin):
    """transformers' function for these tables: GPT-NeoX's for partial rotary, Llama's for whole heads."""
    if cos.shape[-1] < q.shape[-1]:
        return _neox()(q, k, cos, sin)
    return pytest.importorskip("transformers.models.llama.modeling_llama").apply_rotary_pos_emb(q, k, cos, sin)


@pytest.mark.slow
@pytest.mark.parametrize("r", [8, 2], ids=["whole", "quarter"])
def test_cpp_autograd_create_graph_with_partial_tables(r):
    """create_graph=True (the C++ rotate_back: PyTorch's ops in fp32, the rest of each head passed through): the
    gradient of a loss that is not linear and its Hessian-vector product, against transformers' function in float64
    (fp32's rounding apart); mixed dtypes: bf16 q and k with fp32 tables give fp32 results and bf16 gradients."""
    with _ops_on_cpu():
        q, k, cos, sin = _inputs(2, 3, 1, 5, 8, torch.float64, seed=8)
        cos, sin = cos[..., :r].contiguous(), sin[..., :r].contiguous()
        v = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        got, want = [], []
        for fn, out in ((torch.ops.pipegoose.rope, got), (_neox_or_llama, want)):
            qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
            qe, ke = fn(qq, kk, cos, sin)
            gq, gk = torch.autograd.grad((qe ** 2).sum() + (ke ** 3).sum(), (qq, kk), create_graph=True)
            out += [gq, gk, *torch.autograd.grad((gq * v).sum() + gk.sum(), (qq, kk))]
        for name, a, b in zip(("grad_q", "grad_k", "hvp_q", "hvp_k"), got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        qb, kb = q.bfloat16().requires_grad_(), k.bfloat16().requires_grad_()
        qe, ke = torch.ops.pipegoose.rope(qb, kb, cos.float(), sin.float())
        assert qe.dtype == ke.dtype == torch.float32
        (qe.sum() + ke.sum()).backward()
        assert qb.grad.dtype == kb.grad.dtype == torch.bfloat16
        assert torch.equal(qb.grad[..., r:], torch.ones_like(qb.grad[..., r:]))


@pytest.mark.slow
def test_autograd_without_grad_and_in_inference_mode():
    _load_library()
    q, k = _meta(2, 4, 5, 8, requires_grad=True), _meta(2, 2, 5, 8)
    cos, sin = _meta(1, 5, 8), _meta(1, 5, 8)
    with torch.no_grad():
        assert not any(t.requires_grad for t in torch.ops.pipegoose.rope(q, k, cos, sin))
    with torch.inference_mode():
        qe, ke = torch.ops.pipegoose.rope(q, k, cos, sin)
    assert qe.grad_fn is None and ke.grad_fn is None and qe.shape == (2, 4, 5, 8)
    assert not any(t.requires_grad for t in torch.ops.pipegoose.rope(q.detach(), k, cos, sin))


@pytest.mark.slow
def test_create_graph_differentiates_pytorch_ops_instead_of_the_backward_op():
    """backward with create_graph=True: gradients that are differentiable again (PyTorch's ops on the output
    gradients and the saved tables), without the backward op (which has no derivative)."""
    _load_library()
    q, k = _meta(2, 4, 5, 8, requires_grad=True), _meta(2, 2, 5, 8, requires_grad=True)
    cos, sin = _meta(1, 5, 8), _meta(1, 5, 8)
    qe, ke = torch.ops.pipegoose.rope(q, k, cos, sin)
    dq, dk = torch.empty_like(qe).requires_grad_(), torch.empty_like(ke).requires_grad_()
    with calls_of({"pipegoose::rope_backward"}) as log:
        gq, gk = torch.autograd.grad((qe, ke), (q, k), (dq, dk), create_graph=True)
    assert log.calls == []
    assert gq.requires_grad and gk.requires_grad and gq.shape == q.shape and gk.shape == k.shape
    ddq, ddk = torch.autograd.grad(gq.sum() + gk.sum(), (dq, dk))
    assert ddq.shape == q.shape and ddk.shape == k.shape


@pytest.mark.slow
def test_op_refuses_tables_that_require_grad():
    """pipegoose::rope gives cos and sin no gradient: with grad mode on, tables that require grad are an error naming
    them (the functional sends such calls to PyTorch's ops); without grad mode the op takes them."""
    _load_library()
    q, k = _meta(2, 4, 5, 8, requires_grad=True), _meta(2, 2, 5, 8)
    cos, sin = _meta(1, 5, 8), _meta(1, 5, 8)
    for cc, ss in ((cos.requires_grad_(), sin), (cos.detach(), sin.requires_grad_())):
        with pytest.raises(RuntimeError, match=r"pipegoose::rope: cos and sin must not require grad"):
            torch.ops.pipegoose.rope(q, k, cc, ss)
        with pytest.raises(RuntimeError, match=r"cos and sin must not require grad"):
            torch.ops.pipegoose.rope(q.detach(), k, cc, ss)
        with torch.no_grad():
            qe, _ = torch.ops.pipegoose.rope(q, k, cc, ss)
        assert qe.shape == q.shape


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_kernel_takes_16bit_q_and_k_with_fp32_tables(dtype):
    """Autocast's pair (16-bit projections, LlamaRotaryEmbedding's fp32 tables) is the kernel's on CUDA; the reverse
    (fp32 q with 16-bit tables) and 16-bit tables of the other 16-bit dtype are not."""
    q, k, cos, sin = _inputs(dtype=dtype, table_dtype=torch.float32)
    assert R._pipegoose_supports(_cuda_problem(q, k, cos, sin, 1)) == (True, "")
    other = torch.bfloat16 if dtype == torch.float16 else torch.float16
    for args in (_inputs(dtype=torch.float32, table_dtype=dtype), _inputs(dtype=dtype, table_dtype=other)):
        ok, why = R._pipegoose_supports(_cuda_problem(*args, 1))
        assert not ok and "the kernel takes one dtype, or 16-bit q and k with fp32 cos and sin" in why
    # the reference path (CPU) gives PyTorch's promotion, as transformers' function
    got = PF.apply_rotary_pos_emb(q, k, cos, sin)
    want = _hf()(q, k, cos, sin)
    assert all(a.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(got, want))
