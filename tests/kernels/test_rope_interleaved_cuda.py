"""GPU: the interleaved rotation of ``pipegoose::rope_forward`` / ``rope_backward`` / ``rope`` (``interleaved=True``:
GPT-J's, Cohere's and GLM's RoPE, pairs of neighbours rotating) and of
``pipegoose.nn.fusion.functional.apply_rotary_pos_emb(..., interleaved=True)`` on the kernel, against transformers'
Cohere formula in float64 on the same (already rounded) inputs:

    q_embed = q * cos + rotate_half(q) * sin,   rotate_half(x) = stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2),

on the first R = cos.shape[-1] values of each head (the rest passed through, GLM's partial rotary), and its gradients
by float64 autograd, within ``tests/tolerances.py``. The tables are cos and sin of angles drawn per element (the two
values of a pair see different ones: a kernel reading its neighbour's would fail; Cohere's tables repeat each angle).
Shapes: whole heads of 64 and 128 values, a pair per head, heads whose rotated values take 8- and 4-byte vectors, odd
head sizes (one value a thread, its partner loaded beside it), GLM's half-rotated heads; layouts: contiguous, the
transposed projection, misaligned views (bit for bit the aligned run's), [B, S, H, D]. The outputs are poisoned (NaN
blocks left in the caching allocator) and every element checked finite. Also: 16-bit q and k with fp32 tables, the
autograd op with a double backward, and tiny Cohere and GLM-4 models fused on the GPU (the kernel runs, the output and
gradients match the model's own code).

Run on the GPU machine: ``python -m pytest -m cuda tests/kernels/test_rope_interleaved_cuda.py -q``.
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import poison, seed_of
# (the rotate-half tests' kernel fixture, their per-test counter reset and their tables: angles drawn per element)
from test_rope_cuda import _fresh_stats, ops, tables  # noqa: F401
from tolerances import TOLERANCES, tol

pytestmark = pytest.mark.cuda

DEV = "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (B, Hq, Hk, S, D, R, Bc): R the rotated values a head (R < D: passed through after them), Bc the tables' batch
CASES = [
    (2, 32, 4, 64, 128, 128, 1),   # Cohere's heads of 128, one table
    (2, 8, 2, 33, 64, 64, 2),      # heads of 64, a table per sequence
    (3, 3, 1, 7, 2, 2, 3),         # one pair a head
    (2, 4, 2, 9, 12, 12, 1),       # 12 values: 16-bit vectors of 4 (8 bytes), fp32 vectors of 4
    (2, 4, 2, 9, 6, 6, 1),         # 6 values: vectors of 2
    (2, 8, 2, 17, 128, 64, 1),     # GLM-4's heads: half rotated, half passed through
    (2, 4, 2, 9, 80, 20, 2),       # 20 of 80 rotated: vectors of 4
    (2, 4, 2, 9, 9, 8, 1),         # an odd head (9 values, 8 rotated): one value a thread, its partner beside it
    (1, 40, 7, 300, 128, 128, 1),  # hundreds of blocks, the last one partial
]


def case_id(c) -> str:
    b, hq, hk, s, d, r, bc = c
    return f"B{b}-Hq{hq}-Hk{hk}-S{s}-D{d}-R{r}-cos{bc}"


def make(case, dtype, seed, table_dtype=None):
    b, hq, hk, s, d, r, bc = case
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q, k, dq, dk = (torch.randn(b, h, s, d, generator=gen, device=DEV).to(dtype) for h in (hq, hk, hq, hk))
    cos, sin = tables(bc, s, r, table_dtype or dtype, seed + 1)
    return q, k, cos, sin, dq, dk


def rotate_pairs(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def formula(x, c, s):
    """Cohere's apply_rotary_pos_emb on one tensor (c, s unsqueezed over the heads); narrower tables: GLM's partial
    rotary, the first R values rotated in pairs and the rest passed through."""
    r = c.shape[-1]
    x_rot = x[..., :r]
    return torch.cat((x_rot * c + rotate_pairs(x_rot) * s, x[..., r:]), dim=-1)


def ref64(q, k, cos, sin, dq, dk, unsqueeze_dim=1):
    q64 = q.detach().double().requires_grad_()
    k64 = k.detach().double().requires_grad_()
    c, s = cos.double().unsqueeze(unsqueeze_dim), sin.double().unsqueeze(unsqueeze_dim)
    qe, ke = formula(q64, c, s), formula(k64, c, s)
    gq, gk = torch.autograd.grad((qe, ke), (q64, k64), (dq.double(), dk.double()))
    return qe.detach(), ke.detach(), gq, gk


def check(name, got, want, dtype):
    assert got.shape == want.shape and got.dtype == dtype, f"{name}: {tuple(got.shape)} {got.dtype}"
    bad = int((~torch.isfinite(got)).sum())
    assert bad == 0, f"{name}: {bad} element(s) not finite (not written)"
    torch.testing.assert_close(got.double(), want, **TOLERANCES[dtype], msg=lambda m: f"{name}: {m}")


def run_ops(ops, q, k, cos, sin, dq, dk, dtype=None):
    poison((q.shape, torch.float32), (k.shape, torch.float32))
    qe, ke = ops.rope_forward(q, k, cos, sin, True)
    poison((dq.shape, torch.float32), (dk.shape, torch.float32))
    gq, gk = ops.rope_backward(dq, dk, cos, sin, dtype, True)
    return qe, ke, gq, gk


def _at_offset(t: torch.Tensor, k: int) -> torch.Tensor:
    buf = torch.empty(t.numel() + k, dtype=t.dtype, device=DEV)
    buf[k:] = t.reshape(-1)
    return buf[k:].view(t.shape)


def _row_strided(t: torch.Tensor, extra: int) -> torch.Tensor:
    buf = torch.empty(*t.shape[:-1], t.shape[-1] + extra, dtype=t.dtype, device=DEV)
    buf[..., :t.shape[-1]] = t
    return buf[..., :t.shape[-1]]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_interleaved_ops_match_float64(ops, dtype, case):
    """rope_forward / rope_backward with interleaved=True against float64: every element written, the passed-through
    values exact, the inputs unchanged, outputs in the inputs' (contiguous) layout; views with an odd element offset
    and rows one element longer (narrower vectors, down to one value a thread) bit for bit the aligned run's."""
    r = case[5]
    q, k, cos, sin, dq, dk = make(case, dtype, seed_of("interleaved", case, dtype))
    before = [t.clone() for t in (q, k, cos, sin, dq, dk)]
    got = run_ops(ops, q, k, cos, sin, dq, dk)
    want = ref64(q, k, cos, sin, dq, dk)
    for name, a, w, x in zip(("q_embed", "k_embed", "grad_q", "grad_k"), got, want, (q, k, dq, dk)):
        check(name, a, w, dtype)
        assert a.stride() == x.stride(), f"{name}: strides {a.stride()}, expected {x.stride()}"
        assert torch.equal(a[..., r:], x[..., r:]), f"{name}: the passed-through values changed"
    assert all(torch.equal(a, b) for a, b in zip((q, k, cos, sin, dq, dk), before)), "an input changed"
    for kind, view in (("offset", lambda t: _at_offset(t, 1)), ("row stride", lambda t: _row_strided(t, 1))):
        moved = run_ops(ops, *(view(t) for t in (q, k, cos, sin, dq, dk)))
        for name, a, b in zip(("q_embed", "k_embed", "grad_q", "grad_k"), moved, got):
            assert torch.equal(a, b), f"{kind}: {name} differs from the aligned run's"


def test_interleaved_is_not_rotate_half(ops):
    """The flag changes the result (the two rotations differ on the same inputs), and False is the default."""
    q, k, cos, sin, _, _ = make(CASES[1], torch.float32, 3)
    a = ops.rope_forward(q, k, cos, sin, True)[0]
    b = ops.rope_forward(q, k, cos, sin)[0]
    c = ops.rope_forward(q, k, cos, sin, False)[0]
    assert torch.equal(b, c) and not torch.allclose(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [CASES[0], CASES[5], CASES[7]], ids=case_id)
def test_16bit_q_with_fp32_tables(ops, dtype, case):
    """16-bit q and k with fp32 cos and sin (autocast): fp32 results; the backward takes fp32 output gradients to
    gradients in q's dtype."""
    q, k, cos, sin, dq, dk = make(case, dtype, seed_of("interleaved fp32 tables", case, dtype), torch.float32)
    dq32, dk32 = dq.float() * 3, dk.float() * 3
    qe, ke, gq, gk = run_ops(ops, q, k, cos, sin, dq32, dk32, dtype)
    want = ref64(q, k, cos, sin, dq32, dk32)
    for name, a, w, dt in zip(("q_embed", "k_embed", "grad_q", "grad_k"), (qe, ke, gq, gk), want,
                              (torch.float32, torch.float32, dtype, dtype)):
        check(name, a, w, dt)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_functional_interleaved_on_the_kernel(ops, no_tuning_table, dtype, unsqueeze_dim):
    """apply_rotary_pos_emb(..., interleaved=True) runs the kernel (counted), forward and backward against float64,
    for [B, H, S, D] and [B, S, H, D] (unsqueeze_dim=2) heads of transposed projections; GLM's partial rotary too."""
    from pipegoose.nn.fusion import dispatch
    from pipegoose.nn.fusion import functional as PF

    for case in (CASES[0], CASES[5]):
        q, k, cos, sin, dq, dk = make(case, dtype, seed_of("functional interleaved", case, dtype, unsqueeze_dim))
        if unsqueeze_dim == 2:
            q, k, dq, dk = (t.transpose(1, 2) for t in (q, k, dq, dk))
        qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
        dispatch.reset_stats()
        qe, ke = PF.apply_rotary_pos_emb(qq, kk, cos, sin, unsqueeze_dim, interleaved=True)
        torch.autograd.backward((qe, ke), (dq, dk))
        assert dispatch.stats()["rope"] == {"pipegoose": 1}, dispatch.stats()
        want = ref64(q, k, cos, sin, dq, dk, unsqueeze_dim)
        for name, a, w in zip(("q_embed", "k_embed", "grad_q", "grad_k"), (qe, ke, qq.grad, kk.grad), want):
            check(f"{case_id(case)} {name}", a.detach(), w, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_double_backward_interleaved(ops, dtype):
    """backward with create_graph=True through the autograd op (its gradients by PyTorch's ops, the interleaved
    transposed rotation): the first derivatives, and their derivative by the output gradients (the forward rotation
    of v), against float64 autograd of Cohere's formula; GLM's partial rotary."""
    q, k, cos, sin, dq, dk = make(CASES[5], dtype, seed_of("double interleaved", dtype))
    v1 = torch.randn(q.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(5)).to(dtype)
    v2 = torch.randn(k.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(6)).to(dtype)
    qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
    dqq, dkk = dq.clone().requires_grad_(), dk.clone().requires_grad_()
    qe, ke = torch.ops.pipegoose.rope(qq, kk, cos, sin, True)
    gq, gk = torch.autograd.grad((qe, ke), (qq, kk), (dqq, dkk), create_graph=True)
    assert gq.requires_grad and gk.requires_grad
    d1, d2 = torch.autograd.grad((gq.float() * v1.float()).sum() + (gk.float() * v2.float()).sum(), (dqq, dkk))
    want = ref64(q, k, cos, sin, dq, dk)
    check("grad_q", gq.detach(), want[2], dtype)
    check("grad_k", gk.detach(), want[3], dtype)
    fwd_v = ref64(v1, v2, cos, sin, v1, v2)
    torch.testing.assert_close(d1.double(), fwd_v[0], **tol(dtype, 2))
    torch.testing.assert_close(d2.double(), fwd_v[1], **tol(dtype, 2))


def test_odd_rotated_values_are_refused(ops):
    """An odd R (no whole pairs) is an error of the op naming cos's last size; the functional runs PyTorch's path."""
    q, k, cos, sin, _, _ = make((1, 2, 1, 3, 8, 8, 1), torch.float32, 1)
    with pytest.raises(RuntimeError, match="must be even"):
        ops.rope_forward(q, k, cos[..., :5], sin[..., :5], True)


@pytest.mark.parametrize("model_type", ["cohere", "glm4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_model_runs_the_interleaved_kernel(model_type, dtype, no_tuning_table):
    """A tiny Cohere (interleaved tables as given, fp32 math) and GLM-4 (the tables' first half interleaved by its
    function, half of each head rotated) on the GPU: fuse(model, ops=["rope"]) routes each attention's call to the
    kernel (counted as pipegoose), and the logits and gradients match the unfused model's (fp32: to fp32 rounding;
    bf16: the kernel rounds once where GLM's bf16 code rounds each op)."""
    import transformers

    from pipegoose.nn.fusion import dispatch
    from pipegoose.nn.fusion.fuse import fuse, unfuse

    common = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=97, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    cfg = (transformers.CohereConfig(**common) if model_type == "cohere"
           else transformers.Glm4Config(head_dim=32, **common))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to(DEV, dtype)
    ids = torch.randint(3, 97, (2, 24), device=DEV, generator=torch.Generator(device=DEV).manual_seed(1))

    def step():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits
        logits.float().square().mean().backward()
        return logits.detach().double(), {n: p.grad.double() for n, p in model.named_parameters()
                                          if p.grad is not None and "proj" in n}

    ref, ref_g = step()
    report = fuse(model, ops=["rope"])
    rows = [r for r in report.rows if r.kind == "rope"]
    assert len(rows) == 2 and all(r.fused and r.forward == "pipegoose" for r in rows), rows
    assert all("interleaved" in r.reason for r in rows), rows
    dispatch.reset_stats()
    got, got_g = step()
    assert dispatch.stats()["rope"] == {"pipegoose": 2}, dispatch.stats()
    scale = 1 if dtype == torch.float32 else 4
    torch.testing.assert_close(got, ref, **tol(dtype, scale))
    for n in ref_g:
        torch.testing.assert_close(got_g[n], ref_g[n], **tol(dtype, 8 * scale), msg=lambda m: f"{n}: {m}")
    unfuse(model)
