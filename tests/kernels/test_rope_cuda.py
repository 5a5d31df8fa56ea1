"""GPU: ``pipegoose::rope_forward`` / ``rope_backward``, the autograd op ``pipegoose::rope`` (ours,
``pipegoose/kernels/csrc/rope.cu``, binding ``pipegoose/kernels/bindings/rope.cpp``) and
``pipegoose.nn.fusion.functional.apply_rotary_pos_emb`` on its kernel path, against transformers' formula computed in
float64 on the same (already rounded) inputs:

    q_embed = q * cos + rotate_half(q) * sin,   rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]),

with cos and sin unsqueezed over the heads, and its gradients by float64 autograd, within the per-dtype tolerances of
``tests/tolerances.py`` (the kernel rounds each value once). The tables are cos and sin of angles drawn per element, so
that the two halves of a head see different values (Llama's tables repeat their first half: a kernel reading the wrong
half of cos or sin would pass with them). Shapes: Llama's (grouped-query heads), D 128, odd sizes, head dims that are
no multiple of the 16-byte vector (narrower vectors, down to the scalar path), tables of one batch and of B, partial
rotary (tables of R < D values a head, GPT-NeoX's function); layouts: the transposed projection of Llama (outputs in
the inputs' strides), a fused qkv projection's heads, last dimensions of stride 2 (copied), misaligned views (the
scalar path, bit for bit the vector path's results), [B, S, H, D] (``unsqueeze_dim=2``); autograd with one input or
one output left out, a double backward, cos and sin requiring grad (the functional's fallback, the op's error),
argument errors, empty tensors, special values, a large shape and more than 2**31 elements (64-bit offsets and item
indices). The ops allocate their outputs: the caching allocator is left holding NaN blocks of the outputs' sizes
first (``poison``), and every element is checked finite, so an element a kernel does not write shows up.

Run on the GPU machine: ``python -m pytest -m cuda tests/kernels/test_rope_cuda.py -q`` (builds the kernel on first
use; ``python -m pipegoose.kernels build pipegoose/rope`` first saves time).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from kernel_helpers import poison, require_free_gpu_memory, seed_of
from kernel_loading import calls_of
from tolerances import TOLERANCES, tol

pytestmark = pytest.mark.cuda

DEV = "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (B, Hq, Hk, S, D, Bc): Bc the batch of cos and sin (1: one table broadcast over the batch)
CASES = [
    (2, 32, 4, 128, 64, 1),   # Llama-like: grouped-query heads, one table
    (2, 32, 4, 128, 64, 2),   # a table per sequence
    (2, 8, 2, 64, 128, 2),    # D 128
    (3, 3, 1, 7, 64, 3),      # odd sizes
    (3, 3, 1, 7, 64, 1),
    (1, 1, 1, 1, 64, 1),      # one token, one head each
    (3, 5, 3, 1, 128, 3),     # S 1
    (2, 4, 2, 9, 2, 1),       # D 2: halves of one element (scalar path)
    (2, 4, 2, 9, 6, 2),       # D 6, 10: halves of 3 and 5 elements (scalar path)
    (3, 3, 1, 7, 10, 1),
    (2, 4, 2, 9, 8, 1),       # D 8: one fp32 vector per half; 16-bit: one vector of 4 (8 bytes)
    (2, 4, 2, 9, 24, 2),      # D 24: halves of 12: three fp32 vectors; 16-bit: three vectors of 4 (8 bytes)
    (2, 4, 4, 33, 16, 1),     # D 16: one 16-bit vector per half
    (1, 40, 7, 300, 128, 1),  # hundreds of blocks, the last one partial (Hk 7: no divisor of Hq, which is fine)
    (2, 4, 2, 9, 18, 1),      # D 18: halves of 9 (scalar path; a thread rotates one value of each half)
]
AUTOGRAD_CASES = [CASES[0], CASES[3], CASES[8], CASES[11]]


def case_id(c) -> str:
    b, hq, hk, s, d, bc = c
    return f"B{b}-Hq{hq}-Hk{hk}-S{s}-D{d}-cos{bc}"


@pytest.fixture(scope="module")
def ops():
    from pipegoose.kernels import load

    return load("pipegoose/rope")


@pytest.fixture(autouse=True)
def _fresh_stats():
    """Counters, last choices, the choice cache and the warnings already given, reset for each test."""
    from pipegoose.nn.fusion import dispatch

    dispatch.reset_stats()
    yield


# --------------------------------------------------------------------------------------------------- helpers
def tables(bc, s, d, dtype, seed):
    """cos and sin [bc, s, d] of angles drawn per element (the two halves of a head differ)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    theta = torch.rand(bc, s, d, generator=gen, device=DEV) * (2 * math.pi)
    return theta.cos().to(dtype), theta.sin().to(dtype)


def projected(b, s, h, d, dtype, gen):
    """Llama's query or key heads: a projection's output [B, S, H * D] viewed as [B, H, S, D] (transpose(1, 2): dense,
    not contiguous), random from ``gen``."""
    return torch.randn(b, s, h * d, generator=gen, device=DEV).to(dtype).view(b, s, h, d).transpose(1, 2)


def make(case, dtype, seed):
    """q [B, Hq, S, D], k [B, Hk, S, D], cos and sin [Bc, S, D], output gradients dq, dk; contiguous, on the GPU."""
    b, hq, hk, s, d, bc = case
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(b, hq, s, d, generator=gen, device=DEV).to(dtype)
    k = torch.randn(b, hk, s, d, generator=gen, device=DEV).to(dtype)
    dq = torch.randn(b, hq, s, d, generator=gen, device=DEV).to(dtype)
    dk = torch.randn(b, hk, s, d, generator=gen, device=DEV).to(dtype)
    cos, sin = tables(bc, s, d, dtype, seed + 1)
    return q, k, cos, sin, dq, dk


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def torch_formula(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' formula in PyTorch's ops, in the inputs' dtypes (what the functional's torch path runs)."""
    c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def formula(x, c, s):
    """transformers' apply_rotary_pos_emb on one tensor, c and s unsqueezed over the heads; tables narrower than a
    head (partial rotary): GPT-NeoX's, the first R = c.shape[-1] values rotated and the rest passed through."""
    r = c.shape[-1]
    if r < x.shape[-1]:
        x_rot = x[..., :r]
        return torch.cat((x_rot * c + rotate_half(x_rot) * s, x[..., r:]), dim=-1)
    return x * c + rotate_half(x) * s


def ref64(q, k, cos, sin, dq=None, dk=None, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb in float64 (on the inputs' device; partial rotary: GPT-NeoX's, see
    ``formula``): (q_embed, k_embed), and with dq, dk also (grad_q, grad_k) by float64 autograd."""
    q64 = q.detach().double().requires_grad_(dq is not None)
    k64 = k.detach().double().requires_grad_(dk is not None)
    c = cos.detach().double().unsqueeze(unsqueeze_dim)
    s = sin.detach().double().unsqueeze(unsqueeze_dim)
    qe, ke = formula(q64, c, s), formula(k64, c, s)
    if dq is None:
        return qe.detach(), ke.detach()
    gq, gk = torch.autograd.grad((qe, ke), (q64, k64), (dq.double(), dk.double()))
    return qe.detach(), ke.detach(), gq, gk


def layout(t: torch.Tensor) -> tuple:
    """The strides of ``t`` that matter (those of dimensions of more than one element)."""
    return tuple(st if n > 1 else None for n, st in zip(t.shape, t.stride()))


def dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: the dimensions, by increasing stride, tile the storage without gaps."""
    expect = 1
    for n, st in sorted(((n, st) for n, st in zip(t.shape, t.stride()) if n > 1), key=lambda x: x[1]):
        if st != expect:
            return False
        expect *= n
    return True


def check(name, got, want, dtype, like=None):
    """Shape, dtype, device; the strides of ``like`` (the input, where it is dense); every element finite (a NaN: not
    written); assert_close with TOLERANCES[dtype]."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == dtype and got.device.type == torch.device(DEV).type, f"{name}: {got.dtype} on {got.device}"
    if like is not None:
        assert layout(got) == layout(like), f"{name}: strides {got.stride()}, expected the input's {like.stride()}"
    bad = int((~torch.isfinite(got)).sum())
    assert bad == 0, f"{name}: {bad} element(s) not finite (not written, or a value the reference does not have)"
    torch.testing.assert_close(got.double(), want.to(got.device), **TOLERANCES[dtype], msg=lambda m: f"{name}: {m}")


def run_ops(ops, q, k, cos, sin, dq, dk):
    """Forward and backward through the raw ops, each one's outputs poisoned first."""
    poison((q.shape, q.dtype), (k.shape, k.dtype))
    qe, ke = ops.rope_forward(q, k, cos, sin)
    poison((dq.shape, cos.dtype), (dk.shape, cos.dtype))
    gq, gk = ops.rope_backward(dq, dk, cos, sin)
    return qe, ke, gq, gk


def check_ops(ops, q, k, cos, sin, dq, dk, dtype, what="", same_layout=True):
    """run_ops against ref64; outputs in the inputs' strides (``same_layout``, for dense inputs), else dense."""
    got = run_ops(ops, q, k, cos, sin, dq, dk)
    want = ref64(q, k, cos, sin, dq, dk)
    for name, a, b, like in zip(("q_embed", "k_embed", "grad_q", "grad_k"), got, want, (q, k, dq, dk)):
        check(f"{what}{name}", a, b, dtype, like if same_layout else None)
        assert dense(a), f"{what}{name}: strides {a.stride()} not dense"
    return got


def _at_offset(t: torch.Tensor, k: int) -> torch.Tensor:
    """The same values, a contiguous view at element offset ``k`` of a larger buffer (not 16-byte aligned for odd
    ``k``)."""
    buf = torch.empty(t.numel() + k, dtype=t.dtype, device=DEV)
    buf[k:] = t.reshape(-1)
    v = buf[k:].view(t.shape)
    assert v.data_ptr() % 16 != 0, (k, t.dtype)
    return v


def _row_strided(t: torch.Tensor, extra: int) -> torch.Tensor:
    """The same values in a buffer whose last dimension is ``extra`` elements longer (the view's other strides are no
    multiple of the vector for odd ``extra``; its pointer stays aligned)."""
    buf = torch.empty(*t.shape[:-1], t.shape[-1] + extra, dtype=t.dtype, device=DEV)
    buf[..., :t.shape[-1]] = t
    return buf[..., :t.shape[-1]]


def _narrowed(t: torch.Tensor) -> torch.Tensor:
    """The same values as a view narrowed in the head dim of a buffer 2 elements wider, from its element 1: the
    pointer is not 16-byte aligned, and the strides are multiples of D + 2."""
    buf = torch.empty(*t.shape[:-1], t.shape[-1] + 2, dtype=t.dtype, device=DEV)
    buf[..., 1:t.shape[-1] + 1] = t
    v = buf[..., 1:t.shape[-1] + 1]
    assert v.data_ptr() % 16 != 0 and v.stride(-1) == 1
    return v


# --------------------------------------------------------------------------------------------- the formulas
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_ops_match_float64(ops, dtype, case):
    """rope_forward and rope_backward (the transposed rotation) against float64, every element written, the inputs
    unchanged, the outputs contiguous as the inputs."""
    q, k, cos, sin, dq, dk = make(case, dtype, seed_of(case, dtype))
    before = [t.clone() for t in (q, k, cos, sin, dq, dk)]
    check_ops(ops, q, k, cos, sin, dq, dk, dtype)
    assert all(torch.equal(a, b) for a, b in zip((q, k, cos, sin, dq, dk), before)), "an input changed"


def test_reference_of_these_tests_is_transformers(ops):
    """(The float64 reference of this file is transformers' apply_rotary_pos_emb, bit for bit, on float64 inputs:
    Llama's for whole heads, GPT-NeoX's for partial rotary.)"""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    neox = pytest.importorskip("transformers.models.gpt_neox.modeling_gpt_neox")
    q, k, cos, sin, _, _ = make(CASES[3], torch.float32, 7)
    want = llama.apply_rotary_pos_emb(q.double(), k.double(), cos.double(), sin.double())
    got = ref64(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    cos, sin = cos[..., :16], sin[..., :16]
    want = neox.apply_rotary_pos_emb(q.double(), k.double(), cos.double(), sin.double())
    got = ref64(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", AUTOGRAD_CASES, ids=case_id)
@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)], ids=["both", "q", "k"])
def test_autograd_op_matches_float64(ops, dtype, case, needs):
    """torch.ops.pipegoose.rope with backward(): the forward kernel's results and, for the inputs that require them,
    the backward kernel's gradients (None for the other), the very results of the raw ops."""
    q, k, cos, sin, dq, dk = make(case, dtype, seed_of("autograd", case, dtype))
    qq, kk = q.clone().requires_grad_(needs[0]), k.clone().requires_grad_(needs[1])
    poison((q.shape, dtype), (k.shape, dtype))
    qe, ke = torch.ops.pipegoose.rope(qq, kk, cos, sin)
    assert qe.requires_grad and ke.requires_grad and "RoPE" in qe.grad_fn.name()
    poison((q.shape, dtype), (k.shape, dtype))
    torch.autograd.backward((qe, ke), (dq, dk))
    rqe, rke, rgq, rgk = ref64(q, k, cos, sin, dq, dk)
    check("q_embed", qe.detach(), rqe, dtype, q)
    check("k_embed", ke.detach(), rke, dtype, k)
    for name, t, need, want in (("grad_q", qq, needs[0], rgq), ("grad_k", kk, needs[1], rgk)):
        if need:
            check(name, t.grad, want, dtype, t)
        else:
            assert t.grad is None, f"{name}: a gradient for an input that does not require one"
    fq, fk = ops.rope_forward(q, k, cos, sin)
    assert torch.equal(qe.detach(), fq) and torch.equal(ke.detach(), fk)
    gq, gk = ops.rope_backward(dq, dk, cos, sin)
    assert not needs[0] or torch.equal(qq.grad, gq)
    assert not needs[1] or torch.equal(kk.grad, gk)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("used", ["q_embed", "k_embed"])
@pytest.mark.parametrize("rotated", ["whole", "partial"])
def test_autograd_op_with_one_output_left_out_of_the_loss(ops, dtype, used, rotated):
    """A loss of one output (whole heads, and partial rotary): the used side's gradient is right; the other input's
    derivative is zero. (A C++ autograd Function fills an undefined output gradient with zeros by default, so the op
    may give a zero gradient where eager PyTorch gives None: either is accepted, any other value is not.)"""
    case = CASES[3]
    q, k, cos, sin, dq, dk = make(case, dtype, seed_of("unused", used, dtype))
    if rotated == "partial":
        cos, sin = cos[..., :16].contiguous(), sin[..., :16].contiguous()
    _, _, rgq, rgk = ref64(q, k, cos, sin, dq, dk)
    for how in ("backward", "autograd.grad"):
        qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
        qe, ke = torch.ops.pipegoose.rope(qq, kk, cos, sin)
        out, dy = (qe, dq) if used == "q_embed" else (ke, dk)
        if how == "backward":
            out.backward(dy)
            gq, gk = qq.grad, kk.grad
        else:
            gq, gk = torch.autograd.grad(out, (qq, kk), dy, allow_unused=True)
        got, want, other = (gq, rgq, gk) if used == "q_embed" else (gk, rgk, gq)
        check(f"{how}: gradient of the used side", got, want, dtype)
        assert other is None or (other.shape == (k if used == "q_embed" else q).shape and
                                 bool((other == 0).all())), f"{how}: a non-zero gradient for the unused side"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_autograd_op_with_broadcast_output_gradients(ops, dtype):
    """(qe.sum() + ke.sum()).backward(): the output gradients are expanded scalars (every stride 0, the last one too:
    copied by the backward)."""
    q, k, cos, sin, _, _ = make(CASES[4], dtype, seed_of("sum", dtype))
    qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
    qe, ke = torch.ops.pipegoose.rope(qq, kk, cos, sin)
    (qe.sum() + ke.sum()).backward()
    _, _, rgq, rgk = ref64(q, k, cos, sin, torch.ones_like(q), torch.ones_like(k))
    check("grad_q", qq.grad, rgq, dtype)
    check("grad_k", kk.grad, rgk, dtype)


def test_autograd_op_without_grad_and_in_inference_mode(ops):
    q, k, cos, sin, _, _ = make(CASES[3], torch.bfloat16, seed_of("inference"))
    want = ops.rope_forward(q, k, cos, sin)
    with torch.inference_mode():
        got = torch.ops.pipegoose.rope(q, k, cos, sin)
    assert all(t.grad_fn is None and torch.equal(t, w) for t, w in zip(got, want))
    qq = q.clone().requires_grad_()
    with torch.no_grad():
        got = torch.ops.pipegoose.rope(qq, k, cos.clone().requires_grad_(), sin)   # (no grad mode: no error)
    assert all(not t.requires_grad and torch.equal(t, w) for t, w in zip(got, want))


def test_gradients_of_another_dtype_are_converted_first(ops):
    """rope_backward: gradients of another floating dtype are converted to cos's first (the results are those of the
    converted gradients, bit for bit, in cos's dtype)."""
    q, k, cos, sin, dq, dk = make(CASES[3], torch.bfloat16, seed_of("grad dtype"))
    got = ops.rope_backward(dq.float(), dk.double(), cos, sin)
    want = ops.rope_backward(dq.float().bfloat16(), dk.double().bfloat16(), cos, sin)
    assert all(a.dtype == torch.bfloat16 and torch.equal(a, b) for a, b in zip(got, want))
    cos32, sin32 = cos.float(), sin.float()
    got = ops.rope_backward(dq, dk.half(), cos32, sin32)
    want = ops.rope_backward(dq.float(), dk.half().float(), cos32, sin32)
    assert all(a.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", AUTOGRAD_CASES, ids=case_id)
def test_16bit_q_and_k_with_fp32_tables(ops, dtype, case):
    """Autocast's pair: 16-bit q and k (the projections' outputs) with fp32 cos and sin (LlamaRotaryEmbedding under
    autocast): fp32 results, as PyTorch's promotion of q * cos makes them; gradients in q's dtype, from fp32 output
    gradients. Against float64, and the raw ops against the autograd op bit for bit."""
    q, k, _, _, _, _ = make(case, dtype, seed_of("mixed", case))
    b, hq, hk, s_, d, bc = case
    cos, sin = tables(bc, s_, d, torch.float32, seed_of("mixed tables", case))
    gen = torch.Generator(device=DEV).manual_seed(seed_of("mixed grads", case))
    dq = torch.randn(q.shape, generator=gen, device=DEV)
    dk = torch.randn(k.shape, generator=gen, device=DEV)
    poison((q.shape, torch.float32), (k.shape, torch.float32))
    qe, ke = ops.rope_forward(q, k, cos, sin)
    assert qe.dtype == ke.dtype == torch.float32
    gq, gk = ops.rope_backward(dq, dk, cos, sin, dtype)
    assert gq.dtype == gk.dtype == dtype
    want = ref64(q, k, cos, sin, dq, dk)
    for name, got, w, dt in zip(("q_embed", "k_embed", "grad_q", "grad_k"), (qe, ke, gq, gk), want,
                                (torch.float32, torch.float32, dtype, dtype)):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got.double(), w, **tol(dt), msg=lambda m: f"{name}: {m}")
    # the formula in PyTorch (promotion to fp32): the same values up to fp32's rounding
    tq, tk = torch_formula(q, k, cos, sin)
    assert tq.dtype == torch.float32
    torch.testing.assert_close(qe, tq, **tol(torch.float32))
    torch.testing.assert_close(ke, tk, **tol(torch.float32))
    qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
    aq, ak = torch.ops.pipegoose.rope(qq, kk, cos, sin)
    torch.autograd.backward((aq, ak), (dq, dk))
    assert torch.equal(aq, qe) and torch.equal(ak, ke)
    assert qq.grad.dtype == dtype and torch.equal(qq.grad, gq) and torch.equal(kk.grad, gk)


def test_autocast_llama_attention_runs_the_kernel(ops, no_tuning_table):
    """A float32 Llama attention under bf16 autocast, fused for rope: the kernel runs (16-bit q and k, fp32 tables),
    and the outputs and gradients match the unfused module's."""
    transformers = pytest.importorskip("transformers")
    from pipegoose.nn.fusion import dispatch, fuse, unfuse

    cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                                   intermediate_size=512, vocab_size=64, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaModel(cfg).to(DEV)
    ids = torch.randint(0, 64, (2, 300), device=DEV)

    def run():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = model(input_ids=ids).last_hidden_state
        h.float().square().mean().backward()
        return h.detach().float(), [p.grad.detach().clone() for p in model.parameters()]

    h0, g0 = run()
    fuse(model, ops=["rope"])
    try:
        with dispatch.strict():
            h1, g1 = run()
        assert dispatch.stats()["rope"] == {"pipegoose": 1}
    finally:
        unfuse(model)
    torch.testing.assert_close(h1, h0, **tol(torch.bfloat16))
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, **tol(torch.bfloat16, 4))


# ------------------------------------------------------------------------------------------ memory layouts
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_transposed_projections_keep_their_layout(ops, dtype):
    """Llama's query and key: q = q_proj(x).view(B, S, H, D).transpose(1, 2) (dense, not contiguous). The outputs
    take the inputs' strides (as eager PyTorch's product), and so do the gradients those of the output gradients
    (contiguous ones, and transposed ones); values bit for bit those of contiguous inputs."""
    b, hq, hk, s, d = 2, 8, 2, 33, 64
    gen = torch.Generator(device=DEV).manual_seed(seed_of("llama layout", dtype))
    q = projected(b, s, hq, d, dtype, gen)
    k = projected(b, s, hk, d, dtype, gen)
    cos, sin = tables(1, s, d, dtype, 3)
    assert not q.is_contiguous() and dense(q) and not k.is_contiguous()
    for grad_layout in ("contiguous", "transposed"):
        dq = torch.randn(b, s, hq, d, generator=gen, device=DEV).to(dtype).transpose(1, 2)
        dk = torch.randn(b, s, hk, d, generator=gen, device=DEV).to(dtype).transpose(1, 2)
        if grad_layout == "contiguous":
            dq, dk = dq.contiguous(), dk.contiguous()
        got = check_ops(ops, q, k, cos, sin, dq, dk, dtype, what=f"{grad_layout} gradients: ")
        want = run_ops(ops, q.contiguous(), k.contiguous(), cos, sin, dq.contiguous(), dk.contiguous())
        for name, a, w in zip(("q_embed", "k_embed", "grad_q", "grad_k"), got, want):
            assert torch.equal(a, w), f"{grad_layout} gradients: {name} differs from the contiguous inputs' result"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_inputs(ops, dtype):
    """Views that are not dense or whose last stride is not 1, of q, k, the gradients, cos and sin: a fused qkv
    projection's heads (dense outputs, as torch.empty_like gives them), a last dimension of stride 2 (copied:
    contiguous outputs), cos and sin expanded over the batch (stride 0), cut from longer tables, of stride 2 in the
    last dimension. Values bit for bit those of contiguous inputs, and float64's within the tolerance."""
    b, hq, hk, s, d = 2, 8, 2, 33, 64
    gen = torch.Generator(device=DEV).manual_seed(seed_of("strided", dtype))
    qkv = torch.randn(b, s, (hq + 2 * hk) * d, generator=gen, device=DEV).to(dtype).view(b, s, hq + 2 * hk, d)
    q_fused, k_fused = qkv[:, :, :hq].transpose(1, 2), qkv[:, :, hq:hq + hk].transpose(1, 2)
    assert not dense(q_fused) and not dense(k_fused)
    wide_q = torch.randn(b, hq, s, 2 * d, generator=gen, device=DEV).to(dtype)
    wide_k = torch.randn(b, hk, s, 2 * d, generator=gen, device=DEV).to(dtype)
    dq = torch.randn(b, hq, s, d, generator=gen, device=DEV).to(dtype)
    dk = torch.randn(b, hk, s, d, generator=gen, device=DEV).to(dtype)
    cos, sin = tables(b, s, d, dtype, 5)
    long_cos, long_sin = tables(b, s + 7, d, dtype, 6)
    wide_cos, wide_sin = tables(b, s, 2 * d, dtype, 8)
    cases = {
        "fused qkv heads": (q_fused, k_fused, cos, sin, dq, dk),
        "last stride 2": (wide_q[..., ::2], wide_k[..., 1::2], cos, sin, dq, dk),
        "gradients of last stride 2": (q_fused, k_fused, cos, sin, wide_q[..., ::2], wide_k[..., ::2]),
        "gradients of the fused heads": (wide_q[..., :d], wide_k[..., :d], cos, sin, q_fused, k_fused),
        "cos, sin expanded": (q_fused, k_fused, cos[:1].expand(b, s, d), sin[1:].expand(b, s, d), dq, dk),
        "cos, sin cut from longer tables": (q_fused, k_fused, long_cos[:, 3:s + 3], long_sin[:, 5:s + 5], dq, dk),
        "cos, sin of last stride 2": (q_fused, k_fused, wide_cos[..., ::2], wide_sin[..., 1::2], dq, dk),
    }
    for name, args in cases.items():
        got = check_ops(ops, *args, dtype, what=f"{name}: ", same_layout=False)
        for out, arg in zip(got, (args[0], args[1], args[4], args[5])):
            want = torch.empty_like(arg.contiguous() if arg.stride(-1) != 1 else arg)
            assert out.stride() == want.stride(), f"{name}: strides {out.stride()}, not torch.empty_like's"
        want = run_ops(ops, *(t.contiguous() for t in args))
        for what, a, w in zip(("q_embed", "k_embed", "grad_q", "grad_k"), got, want):
            assert torch.equal(a, w), f"{name}: {what} differs from the contiguous inputs' result"


MISALIGNED_CASES = [CASES[0], CASES[2], CASES[3], CASES[11], CASES[12]]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", MISALIGNED_CASES, ids=case_id)
def test_misaligned_views_take_the_scalar_path(ops, dtype, case):
    """Views whose pointer is not 16-byte aligned (an odd element offset), whose strides are no multiple of the
    vector (rows of D + 1 elements), or both (a head dim narrowed from element 1 of rows of D + 2): of q alone, k
    alone, cos, sin, the gradients, all of them. The per-vector kernel on narrower vectors (down to scalars), or,
    where only the tables are misaligned and the heads still move in 16-byte chunks, the staged kernel on scalar
    vectors; results bit for bit the aligned run's."""
    q, k, cos, sin, dq, dk = make(case, dtype, seed_of("misaligned", case, dtype))
    aligned = run_ops(ops, q, k, cos, sin, dq, dk)
    views = {"offset": lambda t: _at_offset(t, 1), "row stride": lambda t: _row_strided(t, 1), "narrowed": _narrowed}
    for kind, view in views.items():
        for which in ("q", "k", "cos", "sin", "grads", "all"):
            args = [q, k, cos, sin, dq, dk]
            for i, name in enumerate(("q", "k", "cos", "sin", "grads", "grads")):
                if which in (name, "all"):
                    args[i] = view(args[i])
            got = check_ops(ops, *args, dtype, what=f"{kind} {which}: ", same_layout=False)
            for name, a, b in zip(("q_embed", "k_embed", "grad_q", "grad_k"), got, aligned):
                assert torch.equal(a, b), f"{kind} {which}: {name} differs from the vector path's"


# --------------------------------------------------------------------------------------------- the functional
def _functional():
    from pipegoose.nn.fusion import dispatch
    from pipegoose.nn.fusion import functional as PF

    return PF.apply_rotary_pos_emb, dispatch


def _fwd_bwd(fn, q, k, cos, sin, dq, dk, **kw):
    qq, kk = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    qe, ke = fn(qq, kk, cos, sin, **kw)
    torch.autograd.backward((qe, ke), (dq, dk))
    return qe.detach(), ke.detach(), qq.grad, kk.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_functional_on_cuda_runs_the_kernel(ops, no_tuning_table, dtype):
    """On CUDA (tuning table and small-problem rule set aside) apply_rotary_pos_emb runs pipegoose::rope: no fallback
    (strict mode passes), the ops' results bit for bit, float64 within the tolerance, outputs in the layout of Llama's
    transposed projections; what the kernel does not take (dtypes that differ) is a fallback strict mode refuses;
    partial rotary runs the kernel's partial path (GPT-NeoX's formula)."""
    apply, dispatch = _functional()
    b, hq, hk, s, d = 2, 8, 2, 33, 64
    gen = torch.Generator(device=DEV).manual_seed(seed_of("functional", dtype))
    q = projected(b, s, hq, d, dtype, gen)
    k = projected(b, s, hk, d, dtype, gen)
    dq = torch.randn(b, hq, s, d, generator=gen, device=DEV).to(dtype)
    dk = torch.randn(b, hk, s, d, generator=gen, device=DEV).to(dtype)
    cos, sin = tables(1, s, d, dtype, 4)
    with dispatch.strict(), warnings.catch_warnings():
        warnings.simplefilter("error")
        qe, ke, gq, gk = _fwd_bwd(apply, q, k, cos, sin, dq, dk)
    c = dispatch.last_choice("rope")
    assert (c.impl, c.fallback) == ("pipegoose", False), c
    assert layout(qe) == layout(q) and layout(ke) == layout(k)
    want = torch.ops.pipegoose.rope_forward(q, k, cos, sin)
    assert torch.equal(qe, want[0]) and torch.equal(ke, want[1])
    want = torch.ops.pipegoose.rope_backward(dq, dk, cos, sin)
    assert torch.equal(gq, want[0]) and torch.equal(gk, want[1])
    for name, got, w, like in zip(("q_embed", "k_embed", "grad_q", "grad_k"), (qe, ke, gq, gk),
                                  ref64(q, k, cos, sin, dq, dk), (q, k, q, k)):
        check(name, got, w, dtype, like)
    with dispatch.strict(), pytest.raises(dispatch.FusionFallbackError, match="q is .* but k, cos, sin are"):
        apply(q, k.double(), cos, sin)
    k2 = k.float() if dtype != torch.float32 else k.half()
    got = apply(q, k2, cos, sin)
    c = dispatch.last_choice("rope")
    assert (c.impl, c.fallback) == ("torch", True) and "the kernel takes one dtype, or 16-bit q and k with fp32" in \
        c.reasons["pipegoose"], c
    want = torch_formula(q, k2, cos, sin)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))
    # partial rotary (cos narrower than D): the same kernel, GPT-NeoX's formula; the raw op's results bit for bit
    cos, sin = cos[..., :32], sin[..., :32]
    with dispatch.strict():
        qe, ke, gq, gk = _fwd_bwd(apply, q, k, cos, sin, dq, dk)
    assert dispatch.last_choice("rope").impl == "pipegoose"
    assert all(torch.equal(a, b) for a, b in zip((qe, ke), torch.ops.pipegoose.rope_forward(q, k, cos, sin)))
    assert all(torch.equal(a, b) for a, b in zip((gq, gk), torch.ops.pipegoose.rope_backward(dq, dk, cos, sin)))
    for name, got, w, like in zip(("q_embed", "k_embed", "grad_q", "grad_k"), (qe, ke, gq, gk),
                                  ref64(q, k, cos, sin, dq, dk), (q, k, q, k)):
        check(name, got, w, dtype, like)


# (B, Hq, Hk, S, D, R, Bc): R rotated values a head. A thread passes through two 16-byte vectors, or as many narrower
# ones as divide their count, up to 16 bytes (16-bit here)
PARTIAL_CASES = [
    (8, 16, 16, 256, 64, 16, 1),   # Pythia-410m: a quarter of each head (R/2 = 8: one 16-bit vector a half; 6 vectors
                                   # passed through, 2 a thread)
    (2, 8, 2, 33, 128, 32, 2),     # grouped heads, a table per sequence
    (3, 3, 1, 7, 64, 16, 3),       # odd sizes
    (2, 4, 2, 9, 64, 6, 1),        # R/2 = 3: the scalar path
    (2, 4, 2, 9, 80, 8, 1),        # R/2 = 4: one fp32 vector a half; 16-bit: vectors of 4 (8 bytes)
    (2, 4, 2, 9, 80, 20, 1),       # R/2 = 10 (Pythia-2.8b's head): vectors of 2, the staged kernel (its views: the
                                   # per-vector kernel, 3 vectors a thread passed through; fp32: 2)
    (2, 4, 2, 9, 96, 24, 1),       # R/2 = 12 (GPT-NeoX-20B's head): vectors of 4
    (2, 4, 2, 9, 88, 24, 1),       # vectors of 4, 16 passed through, 2 a thread (fp32's are 16 bytes wide)
    (2, 4, 2, 9, 78, 2, 1),        # R/2 = 1: the scalar path, 76 values passed through, 4 a thread
    (2, 2, 1, 5, 520, 8, 1),       # 512 values passed through in vectors of 4, 2 a thread: 64 threads a head
    (2, 3, 1, 5, 72, 16, 1),       # 16-bit: 7 vectors of 16 bytes passed through, an odd count: 1 a thread
    (2, 3, 1, 5, 76, 16, 1),       # fp32 (and 16-bit with fp32 tables): 15 vectors of 4, 1 a thread; 16-bit: 8 bytes
]


def partial_id(c) -> str:
    b, hq, hk, s, d, r, bc = c
    return f"B{b}-Hq{hq}-Hk{hk}-S{s}-D{d}-R{r}-cos{bc}"


def make_partial(case, dtype, seed, table_dtype=None):
    """make() of a PARTIAL_CASES case: q, k and the output gradients of head size D, cos and sin [Bc, S, R] (in
    ``table_dtype``, default ``dtype``)."""
    b, hq, hk, s, d, r, bc = case
    q, k, _, _, dq, dk = make((b, hq, hk, s, d, bc), dtype, seed)
    cos, sin = tables(bc, s, r, table_dtype or dtype, seed + 1)
    return q, k, cos, sin, dq, dk


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PARTIAL_CASES, ids=partial_id)
def test_partial_rotary_ops_match_float64(ops, dtype, case):
    """The raw ops with tables narrower than a head (partial rotary, one launch each way): GPT-NeoX's formula in
    float64 within the tolerance, the passed-through values (and their gradients) exact, every element written
    (outputs poisoned), the inputs unchanged, outputs in the inputs' layout; misaligned views (the scalar path) bit
    for bit the vector path's; 16-bit q and k with fp32 tables: fp32 results, the passed-through values converted
    exactly, gradients in q's dtype."""
    r = case[5]
    q, k, cos, sin, dq, dk = make_partial(case, dtype, seed_of("partial ops", case, dtype))
    before = [t.clone() for t in (q, k, cos, sin, dq, dk)]
    got = check_ops(ops, q, k, cos, sin, dq, dk, dtype)
    assert all(torch.equal(a, b) for a, b in zip((q, k, cos, sin, dq, dk), before)), "an input changed"
    for name, a, x in zip(("q_embed", "k_embed", "grad_q", "grad_k"), got, (q, k, dq, dk)):
        assert torch.equal(a[..., r:], x[..., r:]), f"{name}: the passed-through values changed"
    views = {"offset": lambda t: _at_offset(t, 1), "row stride": lambda t: _row_strided(t, 1), "narrowed": _narrowed}
    for kind, view in views.items():
        moved = check_ops(ops, *(view(t) for t in (q, k, cos, sin, dq, dk)), dtype, what=f"{kind}: ",
                          same_layout=False)
        for name, a, b in zip(("q_embed", "k_embed", "grad_q", "grad_k"), moved, got):
            assert torch.equal(a, b), f"{kind}: {name} differs from the vector path's"
    if dtype == torch.float32:
        return
    cos32, sin32 = tables(case[6], case[3], r, torch.float32, seed_of("partial fp32 tables", case))
    dq32, dk32 = dq.float() * 3, dk.float() * 3   # (values that 16-bit does not hold: the conversion rounds)
    poison((q.shape, torch.float32), (k.shape, torch.float32))
    qe, ke = ops.rope_forward(q, k, cos32, sin32)
    poison((q.shape, dtype), (k.shape, dtype))
    gq, gk = ops.rope_backward(dq32, dk32, cos32, sin32, dtype)
    want = ref64(q, k, cos32, sin32, dq32, dk32)
    for name, a, w, x, dt in zip(("q_embed", "k_embed", "grad_q", "grad_k"), (qe, ke, gq, gk), want,
                                 (q, k, dq32, dk32), (torch.float32, torch.float32, dtype, dtype)):
        check(name, a, w, dt)
        assert torch.equal(a[..., r:], x[..., r:].to(dt)), f"fp32 tables: {name}: the passed-through values"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PARTIAL_CASES, ids=partial_id)
@pytest.mark.parametrize("layout_", ["contiguous", "fused_qkv", "bshd", "fp32_tables"])
def test_partial_rotary_kernel_path_matches_float64(ops, no_tuning_table, dtype, case, layout_):
    """Partial rotary through the functional (impl='pipegoose'): one forward launch and one backward launch (the ops'
    calls logged); values and gradients within the tolerance of GPT-NeoX's formula in float64, the passed-through
    values exact; every element written (outputs poisoned first); no fallback (strict mode).
    Layouts: contiguous [B, H, S, D]; GPT-NeoX's chunks of a fused qkv projection (not dense); [B, S, H, D]
    (unsqueeze_dim=2); 16-bit q and k with fp32 tables (autocast: fp32 results, gradients in q's dtype)."""
    if layout_ == "fp32_tables" and dtype == torch.float32:
        pytest.skip("fp32 tables with 16-bit q and k")
    apply, dispatch = _functional()
    b, hq, hk, s, d, r, bc = case
    gen = torch.Generator(device=DEV).manual_seed(seed_of("partial", dtype, case, layout_))
    dim = 2 if layout_ == "bshd" else 1
    if layout_ == "fused_qkv" and hq == hk:   # GPT-NeoX's: [B, H, S, 3D] chunked in the last dimension
        qkv = torch.randn(b, s, hq, 3 * d, generator=gen, device=DEV).to(dtype).transpose(1, 2)
        q, k, _ = qkv.chunk(3, dim=-1)
    elif layout_ == "fused_qkv":   # a fused projection's heads
        qkv = torch.randn(b, s, hq + 2 * hk, d, generator=gen, device=DEV).to(dtype).transpose(1, 2)
        q, k = qkv[:, :hq], qkv[:, hq:hq + hk]
    else:
        q = torch.randn(b, hq, s, d, generator=gen, device=DEV).to(dtype)
        k = torch.randn(b, hk, s, d, generator=gen, device=DEV).to(dtype)
        if dim == 2:
            q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    tab = torch.float32 if layout_ == "fp32_tables" else dtype
    cos, sin = tables(bc, s, r, tab, seed_of("partial tables", case))
    out = torch.float32 if layout_ == "fp32_tables" else dtype
    dq = torch.randn(q.shape, generator=gen, device=DEV).to(out)
    dk = torch.randn(k.shape, generator=gen, device=DEV).to(out)
    qq, kk = q.detach().requires_grad_(), k.detach().requires_grad_()
    poison((q.shape, out), (k.shape, out))
    with dispatch.strict(), calls_of({"pipegoose::rope_forward", "pipegoose::rope_backward"}) as log:
        qe, ke = apply(qq, kk, cos, sin, dim, impl="pipegoose")
        poison((q.shape, dtype), (k.shape, dtype))
        torch.autograd.backward((qe, ke), (dq, dk))
    assert dispatch.last_choice("rope").impl == "pipegoose"
    assert log.calls == ["pipegoose::rope_forward", "pipegoose::rope_backward"], log.calls
    want = ref64(q, k, cos, sin, dq, dk, dim)
    for name, got, w, dt in zip(("q_embed", "k_embed", "grad_q", "grad_k"), (qe, ke, qq.grad, kk.grad), want,
                                (out, out, dtype, dtype)):
        check(name, got, w, dt)
        assert torch.equal(got[..., r:], w[..., r:].to(dt)), f"{name}: the passed-through values changed"


def _kernels_run(fn) -> set[str]:
    """The names of the CUDA kernels that ``fn()`` launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d, r, where", [
    # (kernel in 16-bit, in fp32)
    (80, 20, ("staged", "staged")),   # Pythia-2.8b: halves of 10 values, narrower than a 16-byte vector in every dtype
    (96, 24, ("staged", "vector")),   # GPT-NeoX-20B: halves of 12 values (fp32: three 16-byte vectors; 24 chunks
                                      # leave lanes of a warp idle)
    (64, 16, ("lane", "vector")),     # Pythia-410m: halves of one 16-bit vector of 16 bytes (fp32: two; no lanes)
    (128, 32, ("lane", "vector")),    # Pythia-1.4b / 6.9b
    (256, 64, ("lane", "vector")),    # 32 chunks of 16 bytes in 16-bit, a warp a head
    (128, 128, ("vector", "vector")),  # Llama's whole heads
], ids=["80-20", "96-24", "64-16", "128-32", "256-64", "128-128"])
def test_kernel_by_launch_rule(ops, dtype, d, r, where):
    """The launch rule, by the kernel names in a profile: rope_staged_kernel where the halves of the rotated values
    take vectors narrower than 16 bytes and the heads move in 16-byte chunks; rope_lane_kernel where the halves take
    16-byte vectors, part of the head is passed through and a 16-bit head is a divisor of 32 chunks; rope_kernel
    otherwise (whole heads, fp32, wider heads or others; a view whose rows are no multiple of 16 bytes). Forward and backward, within the tolerance of
    float64; the staged, lane and per-vector kernels' results bit for bit the same."""
    want_kernel = where[dtype == torch.float32]
    # 74 tokens of 8 + 3 heads: 814 heads, no multiple of the heads a warp stages (16-bit 80/20: 6, fp32: 3; 96/24: 5)
    # nor of a lane kernel's warps (16-bit 64/16: 4 heads a tile and 2 tiles a warp)
    q, k, cos, sin, dq, dk = make_partial((2, 8, 3, 37, d, r, 1), dtype, seed_of("staged", dtype, d, r))
    got = {}

    def run():
        got["fwd"] = ops.rope_forward(q, k, cos, sin)
        got["bwd"] = ops.rope_backward(dq, dk, cos, sin)

    names = _kernels_run(run)
    kinds = {"staged" if "rope_staged_kernel" in n else "lane" if "rope_lane_kernel" in n else "vector"
             for n in names if "rope_" in n}
    assert kinds == {want_kernel}, names
    want = ref64(q, k, cos, sin, dq, dk)
    for name, a, w in zip(("q_embed", "k_embed", "grad_q", "grad_k"), (*got["fwd"], *got["bwd"]), want):
        check(name, a, w, dtype)
    # rows of D + 1 elements (no multiple of 16 bytes: the per-vector kernel, on scalars), bit for bit the results
    # above
    longer = [_row_strided(t, 1) for t in (q, k, dq, dk)]
    moved = {}

    def run_moved():
        moved["fwd"] = ops.rope_forward(longer[0], longer[1], cos, sin)
        moved["bwd"] = ops.rope_backward(longer[2], longer[3], cos, sin)

    names = _kernels_run(run_moved)
    assert not any("rope_staged_kernel" in n or "rope_lane_kernel" in n for n in names), names
    for name, a, b in zip(("q_embed", "k_embed", "grad_q", "grad_k"), (*moved["fwd"], *moved["bwd"]),
                          (*got["fwd"], *got["bwd"])):
        assert torch.equal(a, b), f"rows of D + 1: {name} differs"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("unsqueeze_dim", [2, -2, 1, -3])
def test_functional_layouts_of_unsqueeze_dim(ops, dtype, unsqueeze_dim):
    """impl='pipegoose' with q and k [B, S, H, D] (unsqueeze_dim 2 or -2: run as transposed views) and
    [B, H, S, D] (1 or -3): the kernel runs (no warning), float64's values and gradients, the outputs in the inputs'
    layout (contiguous [B, S, H, D] stays so), bit for bit the raw op's on the [B, H, S, D] views."""
    apply, dispatch = _functional()
    b, hq, hk, s, d = 3, 6, 2, 17, 128
    bshd = unsqueeze_dim in (2, -2)
    gen = torch.Generator(device=DEV).manual_seed(seed_of("unsqueeze", dtype, unsqueeze_dim))
    shape_q, shape_k = ((b, s, hq, d), (b, s, hk, d)) if bshd else ((b, hq, s, d), (b, hk, s, d))
    q, dq = (torch.randn(shape_q, generator=gen, device=DEV).to(dtype) for _ in range(2))
    k, dk = (torch.randn(shape_k, generator=gen, device=DEV).to(dtype) for _ in range(2))
    cos, sin = tables(b, s, d, dtype, 9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qe, ke, gq, gk = _fwd_bwd(apply, q, k, cos, sin, dq, dk, unsqueeze_dim=unsqueeze_dim, impl="pipegoose")
    assert dispatch.last_choice("rope").impl == "pipegoose"
    want = ref64(q, k, cos, sin, dq, dk, unsqueeze_dim=unsqueeze_dim)
    for name, got, w, like in zip(("q_embed", "k_embed", "grad_q", "grad_k"), (qe, ke, gq, gk), want, (q, k, q, k)):
        check(name, got, w, dtype, like)
    t = (lambda x: x.transpose(1, 2)) if bshd else (lambda x: x)
    raw = torch.ops.pipegoose.rope_forward(t(q), t(k), cos, sin)
    assert torch.equal(t(qe), raw[0]) and torch.equal(t(ke), raw[1])


def test_functional_matches_transformers_with_llama_tables(ops, no_tuning_table):
    """Llama's own tables (LlamaRotaryEmbedding, positions with an offset, as after a cache): fp32 as transformers'
    apply_rotary_pos_emb (fp32 rounding apart), bf16 as float64 within the tolerance, and both through autograd."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=4096)
    rotary = llama.LlamaRotaryEmbedding(cfg).to(DEV)
    apply, dispatch = _functional()
    b, s = 2, 40
    pos = torch.arange(1000, 1000 + s, device=DEV).expand(b, s)
    for dtype in DTYPES:
        gen = torch.Generator(device=DEV).manual_seed(seed_of("llama tables", dtype))
        x = torch.empty(1, device=DEV, dtype=dtype)
        cos, sin = rotary(x, pos)
        assert cos.shape == (b, s, 64) and cos.dtype == dtype
        q = projected(b, s, 8, 64, dtype, gen)
        k = projected(b, s, 2, 64, dtype, gen)
        dq, dk = torch.randn_like(q), torch.randn_like(k)
        with dispatch.strict():
            got = _fwd_bwd(apply, q, k, cos, sin, dq, dk)
        assert dispatch.last_choice("rope").impl == "pipegoose"
        for name, a, w in zip(("q_embed", "k_embed", "grad_q", "grad_k"), got, ref64(q, k, cos, sin, dq, dk)):
            check(f"{dtype} {name}", a, w, dtype)
        if dtype == torch.float32:
            hf = _fwd_bwd(llama.apply_rotary_pos_emb, q, k, cos, sin, dq, dk)
            for name, a, w in zip(("q_embed", "k_embed", "grad_q", "grad_k"), got, hf):
                torch.testing.assert_close(a, w, **TOLERANCES[dtype], msg=lambda m: f"transformers' {name}: {m}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cos_and_sin_requiring_grad(ops, no_tuning_table, dtype):
    """With grad mode on, a cos or sin that requires grad: the functional runs PyTorch's ops (a fallback naming the
    reason; impl='pipegoose' warns; strict mode refuses), which give cos and sin their gradients; the raw autograd op
    refuses the call with a RuntimeError naming cos and sin. Under no_grad the kernel runs."""
    apply, dispatch = _functional()
    q, k, cos, sin, dq, dk = make(CASES[3], dtype, seed_of("table grad", dtype))
    for which in ("cos", "sin", "both"):
        dispatch.reset_stats()   # (the warning about impl= comes once per reason)
        cc = cos.clone().requires_grad_(which in ("cos", "both"))
        ss = sin.clone().requires_grad_(which in ("sin", "both"))
        with pytest.warns(UserWarning, match=r"impl='pipegoose' cannot run this input: cos or sin requires grad"):
            qe, ke = apply(q, k, cc, ss, impl="pipegoose")
        c = dispatch.last_choice("rope")
        assert (c.impl, c.fallback) == ("torch", True) and "cos or sin requires grad" in c.reasons["pipegoose"], c
        c = dispatch.explain("rope", q, k, cc, ss)
        assert c.impl == "torch" and c.fallback
        assert c.reasons["pipegoose"] == "cos or sin requires grad: the kernel gives them no gradient"
        with dispatch.strict(), pytest.raises(dispatch.FusionFallbackError, match="cos or sin requires grad"):
            apply(q, k, cc, ss)
        want = torch_formula(q, k, cos, sin)
        assert torch.equal(qe, want[0]) and torch.equal(ke, want[1])   # PyTorch's ops: eager's roundings
        torch.autograd.backward((qe, ke), (dq, dk))
        c64, s64 = cos.double().requires_grad_(), sin.double().requires_grad_()
        qe64, ke64 = torch_formula(q.double(), k.double(), c64, s64)
        gc64, gs64 = torch.autograd.grad((qe64, ke64), (c64, s64), (dq.double(), dk.double()))
        # (sums over the heads of 16-bit products: a few roundings per element)
        for name, t, w in (("grad_cos", cc, gc64), ("grad_sin", ss, gs64)):
            if t.requires_grad:
                assert t.grad is not None and t.grad.shape == t.shape, name
                torch.testing.assert_close(t.grad.double(), w, **tol(dtype, 8), msg=lambda m: f"{which} {name}: {m}")
            else:
                assert t.grad is None, name
        with pytest.raises(RuntimeError, match=r"pipegoose::rope: cos and sin must not require grad"):
            torch.ops.pipegoose.rope(q, k, cc, ss)
        with pytest.raises(RuntimeError, match=r"cos and sin must not require grad"):
            torch.ops.pipegoose.rope(q.clone().requires_grad_(), k, cc, ss)
        with torch.no_grad():
            got = apply(q, k, cc, ss)
            assert dispatch.last_choice("rope").impl == "pipegoose"
            raw = ops.rope_forward(q, k, cos, sin)
            assert torch.equal(got[0], raw[0]) and torch.equal(got[1], raw[1])
            got = torch.ops.pipegoose.rope(q, k, cc, ss)   # (no grad mode: the op takes them)
            assert torch.equal(got[0], raw[0]) and torch.equal(got[1], raw[1])


def test_functional_transforms_run_the_reference_on_cuda(ops, no_tuning_table):
    """vmap (tensors without storage) and forward-mode AD (dual tensors) on CUDA: the kernel declines them with the
    reason, and PyTorch's ops give what transformers' formula gives."""
    import torch.autograd.forward_ad as fwAD

    apply, dispatch = _functional()
    from pipegoose.nn.fusion.ops._common import NO_STORAGE
    from pipegoose.nn.fusion.ops.rope import FORWARD_AD_ROPE

    q, k, cos, sin, dq, _ = make(CASES[3], torch.float32, seed_of("transforms"))
    qs, ks, cs, ss = (torch.stack([t, 2 * t]) for t in (q, k, cos, sin))   # vmap over a leading dimension
    got = torch.func.vmap(apply)(qs, ks, cs, ss)
    assert dispatch.last_choice("rope").reasons["pipegoose"] == NO_STORAGE
    for i in range(2):
        want = torch_formula(qs[i], ks[i], cs[i], ss[i])
        assert torch.equal(got[0][i], want[0]) and torch.equal(got[1][i], want[1])
    with fwAD.dual_level():
        out = apply(fwAD.make_dual(q, dq), k, cos, sin)[0]
        assert dispatch.last_choice("rope").reasons["pipegoose"] == FORWARD_AD_ROPE
        primal, jvp = fwAD.unpack_dual(out)
    _, want = torch.func.jvp(lambda x: torch_formula(x, k, cos, sin)[0], (q,), (dq,))
    assert torch.equal(primal, torch_formula(q, k, cos, sin)[0]) and torch.equal(jvp, want)


# ------------------------------------------------------------------------------------ double backward
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rotated", ["whole", "partial"])
def test_double_backward(ops, dtype, rotated):
    """backward with create_graph=True (the gradients by PyTorch's ops in fp32, one rounding, differentiable again),
    against float64 autograd of transformers' formula (partial: GPT-NeoX's, a quarter of each head): (1) the
    derivative of <grad_q, v1> + <grad_k, v2> by the output gradients (the forward rotation of v1, v2; none by q and
    k: the rotation is linear), and (2) of a loss that is not linear, sum(w1 * q_embed**2) + sum(w2 * k_embed**2):
    first derivatives and the Hessian-vector product by q, k."""
    q, k, cos, sin, dq, dk = make(CASES[3], dtype, seed_of("double", dtype))
    if rotated == "partial":
        cos, sin = cos[..., :16].contiguous(), sin[..., :16].contiguous()
    gen = torch.Generator(device=DEV).manual_seed(5)
    v1, w1 = (torch.randn(q.shape, generator=gen, device=DEV).to(dtype) for _ in range(2))
    v2, w2 = (torch.randn(k.shape, generator=gen, device=DEV).to(dtype) for _ in range(2))

    # (1) by the output gradients
    qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
    dqq, dkk = dq.clone().requires_grad_(), dk.clone().requires_grad_()
    qe, ke = torch.ops.pipegoose.rope(qq, kk, cos, sin)
    gq, gk = torch.autograd.grad((qe, ke), (qq, kk), (dqq, dkk), create_graph=True)
    assert gq.requires_grad and gk.requires_grad and gq.dtype == gk.dtype == dtype
    second = torch.autograd.grad((gq.float() * v1.float()).sum() + (gk.float() * v2.float()).sum(),
                                 (dqq, dkk, qq, kk), allow_unused=True)
    q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
    dq64, dk64 = dq.double().requires_grad_(), dk.double().requires_grad_()
    c, s = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    qe64, ke64 = formula(q64, c, s), formula(k64, c, s)
    gq64, gk64 = torch.autograd.grad((qe64, ke64), (q64, k64), (dq64, dk64), create_graph=True)
    second64 = torch.autograd.grad((gq64 * v1.double()).sum() + (gk64 * v2.double()).sum(), (dq64, dk64, q64, k64),
                                   allow_unused=True)
    check("grad_q", gq.detach(), gq64.detach(), dtype)
    check("grad_k", gk.detach(), gk64.detach(), dtype)
    for name, a, b in zip(("d/d(grad_q_embed)", "d/d(grad_k_embed)"), second[:2], second64[:2]):
        torch.testing.assert_close(a.double(), b, **tol(dtype, 2), msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(a.double(), ref64(v1, v2, cos, sin)[0 if "q" in name else 1],
                                   **tol(dtype, 2), msg=lambda m: f"{name} (the forward rotation of v): {m}")
    assert second[2] is None and second[3] is None and second64[2] is None and second64[3] is None

    # (2) a loss that is not linear: Hessian-vector products by q and k
    qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
    qe, ke = torch.ops.pipegoose.rope(qq, kk, cos, sin)
    loss = (w1.float() * qe.float() ** 2).sum() + (w2.float() * ke.float() ** 2).sum()
    gq, gk = torch.autograd.grad(loss, (qq, kk), create_graph=True)
    hq, hk = torch.autograd.grad((gq.float() * v1.float()).sum() + (gk.float() * v2.float()).sum(), (qq, kk))
    q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
    qe64, ke64 = formula(q64, c, s), formula(k64, c, s)
    loss64 = (w1.double() * qe64 ** 2).sum() + (w2.double() * ke64 ** 2).sum()
    gq64, gk64 = torch.autograd.grad(loss64, (q64, k64), create_graph=True)
    hq64, hk64 = torch.autograd.grad((gq64 * v1.double()).sum() + (gk64 * v2.double()).sum(), (q64, k64))
    # the 16-bit chain rounds q_embed, the output gradient 2 * w * q_embed (up to ~20) and each gradient, and the
    # rotations add two such values: several units in the last place of values larger than 1
    for name, a, b in (("grad_q", gq, gq64), ("grad_k", gk, gk64), ("hvp_q", hq, hq64), ("hvp_k", hk, hk64)):
        assert a.dtype == dtype and bool(torch.isfinite(a).all()), name
        torch.testing.assert_close(a.detach().double(), b.detach(), **tol(dtype, 8), msg=lambda m: f"{name}: {m}")


# -------------------------------------------------------------------------------------------------- empty
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shapes", [
    ((2, 4, 0, 8), (2, 2, 0, 8), (1, 0, 8)),    # no positions
    ((0, 4, 5, 8), (0, 2, 5, 8), (1, 5, 8)),    # no batch
    ((2, 4, 5, 0), (2, 2, 5, 0), (2, 5, 0)),    # head dim 0
    ((2, 0, 5, 8), (2, 2, 5, 8), (1, 5, 8)),    # no query heads: the kernel rotates k alone
    ((2, 4, 5, 16), (2, 0, 5, 16), (2, 5, 16)),  # no key heads: q alone
    ((2, 4, 5, 16), (2, 0, 5, 16), (2, 5, 4)),   # no key heads, partial rotary
    ((2, 4, 0, 16), (2, 2, 0, 16), (1, 0, 8)),   # no positions, partial rotary
], ids=["S0", "B0", "D0", "Hq0", "Hk0", "Hk0-partial", "S0-partial"])
def test_empty_tensors(ops, dtype, shapes):
    sq, sk, sc = shapes
    gen = torch.Generator(device=DEV).manual_seed(seed_of("empty", shapes))
    q = torch.randn(sq, generator=gen, device=DEV).to(dtype)
    k = torch.randn(sk, generator=gen, device=DEV).to(dtype)
    cos, sin = tables(*sc, dtype, 2)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    got = run_ops(ops, q, k, cos, sin, dq, dk)
    want = ref64(q, k, cos, sin, dq, dk)
    for name, a, w in zip(("q_embed", "k_embed", "grad_q", "grad_k"), got, want):
        check(name, a, w, dtype)
    qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
    qe, ke = torch.ops.pipegoose.rope(qq, kk, cos, sin)
    torch.autograd.backward((qe, ke), (dq, dk))
    assert qq.grad.shape == q.shape and kk.grad.shape == k.shape
    check("autograd grad_k", kk.grad, want[3], dtype)
    torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------ special values
def test_inf_and_nan_as_pytorch(ops):
    """fp32: infinite, NaN, zero and large values in q, k and the gradients, zeros in the tables: the same NaN
    positions and infinities as PyTorch's formula in fp32, the rest close."""
    b, h, s, d = 1, 2, 16, 16
    # (no product of finite values overflows: where one would, a fused multiply-add and PyTorch's separate product
    # and sum legitimately differ)
    specials = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e30, -1e30, 3.0], device=DEV)
    gen = torch.Generator(device=DEV).manual_seed(13)
    q = specials[torch.randint(0, 8, (b, h, s, d), generator=gen, device=DEV)]
    k = specials[torch.randint(0, 8, (b, h, s, d), generator=gen, device=DEV)]
    cos = torch.tensor([0.0, 1.0, -0.5, 0.75], device=DEV)[torch.randint(0, 4, (1, s, d), generator=gen, device=DEV)]
    sin = torch.tensor([0.0, -1.0, 0.5, -0.25], device=DEV)[torch.randint(0, 4, (1, s, d), generator=gen, device=DEV)]
    want = torch_formula(q, k, cos, sin)
    got = ops.rope_forward(q, k, cos, sin)
    qq, kk = q.detach().requires_grad_(), k.detach().requires_grad_()
    ref = torch_formula(qq, kk, cos, sin)
    want_g = torch.autograd.grad(ref, (qq, kk), (q, k))   # (the special values as output gradients too)
    got_g = ops.rope_backward(q, k, cos, sin)
    for name, a, w in zip(("q_embed", "k_embed", "grad_q", "grad_k"), (*got, *got_g), (*want, *want_g)):
        where = (torch.isnan(a) != torch.isnan(w)).nonzero().tolist()
        assert not where, f"{name}: NaN where PyTorch has none, or the other way round, at {where[:5]}"
        assert torch.isnan(w).any() and torch.isinf(w).any(), f"{name}: the test lost its special values"
        torch.testing.assert_close(a, w, equal_nan=True, **TOLERANCES[torch.float32], msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------------------- argument checks
def test_bad_arguments_name_the_argument(ops):
    q, k, cos, sin, dq, dk = make((2, 4, 2, 5, 8, 1), torch.float32, seed_of("bad"))
    fwd, bwd, rope = ops.rope_forward, ops.rope_backward, torch.ops.pipegoose.rope
    cases = [
        (lambda: fwd(q, k, cos.cpu(), sin), r"rope_forward: cos must be a CUDA tensor, got device cpu"),
        (lambda: fwd(q.cpu(), k, cos, sin), r"rope_forward: q is on cpu but cos is on cuda:\d+"),
        (lambda: fwd(q, k.cpu(), cos, sin), r"rope_forward: k is on cpu but cos is on cuda:\d+"),
        (lambda: fwd(q, k, cos, sin.cpu()), r"rope_forward: sin is on cpu but cos is on cuda:\d+"),
        (lambda: fwd(q.double(), k.double(), cos.double(), sin.double()),
         r"rope_forward: cos must be float32, float16 or bfloat16, got Double"),
        (lambda: fwd(q, k, cos, sin.half()), r"rope_forward: sin is Half but cos is Float; expected one dtype"),
        (lambda: fwd(q.bfloat16(), k, cos, sin), r"rope_forward: k is Float but q is BFloat16; expected one dtype"),
        (lambda: fwd(q, k.half(), cos, sin), r"rope_forward: k is Half but q is Float; expected one dtype"),
        (lambda: fwd(q, k, cos.half(), sin.half()),
         r"rope_forward: q is Float and cos Half; expected one dtype, or float16 / bfloat16 q and k with float32 cos "
         r"and sin \(autocast\)"),
        (lambda: bwd(dq, dk, cos.half(), sin.half(), torch.bfloat16),
         r"rope_backward: dtype BFloat16 with cos of Half; expected cos's dtype, or float16 / bfloat16 with float32"),
        (lambda: fwd(q, k, cos[0], sin[0]), r"rope_forward: cos must have 3 dimensions \[batch or 1, seq, "
                                            r"rotated dims\], got shape \[5, 8\]"),
        (lambda: fwd(q, k, cos, sin[..., :6]), r"rope_forward: sin has shape \[1, 5, 6\] but cos has \[1, 5, 8\]; "
                                               r"expected equal shapes"),
        (lambda: fwd(q[0], k, cos, sin), r"rope_forward: q must have 4 dimensions \[batch, heads, seq, head_dim\], "
                                         r"got shape \[4, 5, 8\]"),
        (lambda: fwd(q, k[None], cos, sin), r"rope_forward: k must have 4 dimensions .*got shape \[1, 2, 2, 5, 8\]"),
        (lambda: fwd(q, k[:1], cos, sin), r"rope_forward: k has shape \[1, 2, 5, 8\] but q has \[2, 4, 5, 8\]; "
                                          r"expected the same batch, seq and head_dim"),
        (lambda: fwd(q, k[:, :, :4], cos, sin), r"k has shape \[2, 2, 4, 8\] but q has \[2, 4, 5, 8\]"),
        (lambda: fwd(q, k.transpose(1, 2), cos, sin), r"k has shape \[2, 5, 2, 8\] but q has"),   # [B, S, H, D]
        (lambda: fwd(q, k, cos[:, :4], sin[:, :4]), r"rope_forward: cos has shape \[1, 4, 8\] but q has "
                                                    r"\[2, 4, 5, 8\]; expected \[2 or 1, 5, R\], R the rotated "
                                                    r"values a head: 8, or 2 to 7 \(partial rotary\)"),
        # partial rotary: one value a head (the Python layer broadcasts it), an odd count, more than a head
        (lambda: fwd(q, k, cos[..., :1], sin[..., :1]), r"cos has shape \[1, 5, 1\] but q has"),
        (lambda: fwd(q, k, cos[..., :3], sin[..., :3]),
         r"rope_forward: cos's last size \(the rotated values a head\) must be even, got 3"),
        (lambda: bwd(dq, dk, cos[..., :5], sin[..., :5]), r"rope_backward: cos's last size .* must be even, got 5"),
        (lambda: fwd(q, k, tables(1, 5, 10, torch.float32, 0)[0], tables(1, 5, 10, torch.float32, 0)[1]),
         r"cos has shape \[1, 5, 10\] but q has"),
        (lambda: fwd(q, k, cos.expand(3, 5, 8), sin.expand(3, 5, 8)), r"cos has shape \[3, 5, 8\] but q has"),
        (lambda: fwd(q[..., :7], k[..., :7], cos[..., :7], sin[..., :7]),
         r"rope_forward: head_dim must be even \(two halves rotate\), got 7"),
        (lambda: bwd(dq[0], dk, cos, sin), r"rope_backward: grad_q_embed must have 4 dimensions"),
        (lambda: bwd(dq, dk[:1], cos, sin), r"rope_backward: grad_k_embed has shape \[1, 2, 5, 8\] but grad_q_embed "
                                            r"has \[2, 4, 5, 8\]"),
        (lambda: bwd(dq, dk.cpu(), cos, sin), r"rope_backward: grad_k_embed is on cpu but cos is on cuda:\d+"),
        (lambda: bwd(dq.int(), dk, cos, sin), r"rope_backward: grad_q_embed and grad_k_embed must be floating point "
                                              r"tensors, got Int and Float"),
        (lambda: bwd(dq, dk, cos, sin.bfloat16()), r"rope_backward: sin is BFloat16 but cos is Float"),
        (lambda: bwd(dq, dk, cos[:, :4], sin[:, :4]), r"rope_backward: cos has shape \[1, 4, 8\] but grad_q_embed"),
        (lambda: rope(q, k, cos, sin.half()), r"rope_forward: sin is Half but cos is Float"),
        (lambda: rope(q.clone().requires_grad_(), k[:1], cos, sin), r"k has shape \[1, 2, 5, 8\]"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()
    # no CUDA tensor at all: no kernel of ours runs (the ops have none for the CPU); PyTorch says so, naming the op
    with pytest.raises(NotImplementedError, match=r"pipegoose::rope_forward.*CPU"):
        fwd(q.cpu(), k.cpu(), cos.cpu(), sin.cpu())


@pytest.mark.skipif("torch.cuda.device_count() < 2", reason="needs two GPUs")
def test_second_gpu(ops):
    """Inputs on cuda:1 while cuda:0 is current: the launch on their device (results right); devices that differ
    are an error naming q."""
    q, k, cos, sin, dq, dk = (t.to("cuda:1") for t in make(CASES[3], torch.bfloat16, seed_of("gpu1")))
    with torch.cuda.device(0):
        got = (*ops.rope_forward(q, k, cos, sin), *ops.rope_backward(dq, dk, cos, sin))
    assert all(t.device == torch.device("cuda", 1) for t in got)
    for name, a, w in zip(("q_embed", "k_embed", "grad_q", "grad_k"), got, ref64(q, k, cos, sin, dq, dk)):
        torch.testing.assert_close(a.double(), w, **TOLERANCES[torch.bfloat16], msg=lambda m: f"{name}: {m}")
    with pytest.raises(RuntimeError, match=r"q is on cuda:0 but cos is on cuda:1"):
        ops.rope_forward(q.to("cuda:0"), k, cos, sin)


# ------------------------------------------------------------------------------------------------ opcheck
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck(ops, dtype):
    q, k, cos, sin, dq, dk = make((2, 4, 2, 5, 16, 1), dtype, seed_of("opcheck", dtype))
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)   # Llama's layout: the fake impl must give its strides too
    kt = k.transpose(1, 2).contiguous().transpose(1, 2)
    torch.library.opcheck(torch.ops.pipegoose.rope_forward.default, (q, k, cos, sin))
    torch.library.opcheck(torch.ops.pipegoose.rope_forward.default, (qt, kt, cos, sin))
    torch.library.opcheck(torch.ops.pipegoose.rope_forward.default, (q[..., ::2], k[..., ::2], cos[..., ::2],
                                                                     sin[..., ::2]))
    torch.library.opcheck(torch.ops.pipegoose.rope_backward.default, (dq, dk, cos, sin))
    torch.library.opcheck(torch.ops.pipegoose.rope_backward.default, (dq.float(), dk.float(), cos, sin))
    # the op with its autograd formula (a C++ Function), with inputs that need gradients
    qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
    torch.library.opcheck(torch.ops.pipegoose.rope.default, (qq, kk, cos, sin))
    torch.library.opcheck(torch.ops.pipegoose.rope.default, (qq, k, cos, sin))
    torch.library.opcheck(torch.ops.pipegoose.rope.default, (q, kk, cos, sin))
    torch.library.opcheck(torch.ops.pipegoose.rope.default, (qt.clone().requires_grad_(), kt, cos, sin))
    torch.library.opcheck(torch.ops.pipegoose.rope.default, (q, k, cos, sin))
    # partial rotary (tables of 4 values a head of 16)
    c4, s4 = cos[..., :4].contiguous(), sin[..., :4].contiguous()
    torch.library.opcheck(torch.ops.pipegoose.rope_forward.default, (qt, kt, c4, s4))
    torch.library.opcheck(torch.ops.pipegoose.rope_backward.default, (dq, dk, c4, s4))
    torch.library.opcheck(torch.ops.pipegoose.rope.default, (qq, kk, c4, s4))
    torch.library.opcheck(torch.ops.pipegoose.rope.default, (qq, k, c4, s4))


# ----------------------------------------------------------------------------------------------- large shapes
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_shape(ops, no_tuning_table, dtype):
    """Llama-7B-like attention at 2048 positions, batch 4 (B 4, Hq 32, Hk 8, S 2048, D 128: 42M elements), in the
    layout of the transposed projections, through the functional (the kernel chosen by itself: no impl=, strict mode)
    and autograd; every element written and float64's within the tolerance."""
    apply, dispatch = _functional()
    b, hq, hk, s, d = 4, 32, 8, 2048, 128
    gen = torch.Generator(device=DEV).manual_seed(seed_of("large", dtype))
    q = projected(b, s, hq, d, dtype, gen)
    k = projected(b, s, hk, d, dtype, gen)
    dq = torch.randn(b, hq, s, d, generator=gen, device=DEV).to(dtype)
    dk = torch.randn(b, hk, s, d, generator=gen, device=DEV).to(dtype)
    cos, sin = tables(b, s, d, dtype, 11)
    qq, kk = q.detach().requires_grad_(), k.detach().requires_grad_()
    poison((q.shape, dtype), (k.shape, dtype))
    with dispatch.strict():
        qe, ke = apply(qq, kk, cos, sin)
    assert dispatch.last_choice("rope").impl == "pipegoose"
    poison((q.shape, dtype), (k.shape, dtype))
    torch.autograd.backward((qe, ke), (dq, dk))
    want = ref64(q, k, cos, sin, dq, dk)
    for name, got, w, like in zip(("q_embed", "k_embed", "grad_q", "grad_k"), (qe.detach(), ke.detach(), qq.grad,
                                                                              kk.grad), want, (q, k, None, None)):
        check(name, got, w, dtype, like)


def test_more_than_2_31_elements(ops):
    """bf16 q and k of 2**31 + 384 elements each (one head of 16777219 positions of 128; 4.3 GB a tensor): element
    offsets past 2**31 on the vector path, and on the scalar path (q and k at offset 1) more than 2**31 work items (the
    64-bit item index); against float64 on the positions at the start, around element 2**31 and at the end, and
    finite everywhere (written), forward and backward."""
    require_free_gpu_memory(60)
    dtype = torch.bfloat16
    s, d = 2**31 // 128 + 3, 128
    n = s * d
    gen = torch.Generator(device=DEV).manual_seed(31)
    q_buf = torch.randn(n + 1, generator=gen, device=DEV, dtype=dtype)
    k_buf = torch.randn(n + 1, generator=gen, device=DEV, dtype=dtype)
    cos = torch.empty(1, s, d, device=DEV, dtype=dtype)
    sin = torch.empty(1, s, d, device=DEV, dtype=dtype)
    for start in range(0, s, 2**22):   # (the angles in pieces: a float32 table of this size is 8.6 GB)
        c, sn = tables(1, min(2**22, s - start), d, dtype, start)
        cos[:, start:start + c.shape[1]] = c
        sin[:, start:start + c.shape[1]] = sn
        del c, sn
    pieces = [slice(0, 20), slice(2**31 // 128 - 20, 2**31 // 128 + 3), slice(s - 20, s)]
    for what, q, k in (("aligned", q_buf[:n], k_buf[:n]), ("misaligned", q_buf[1:], k_buf[1:])):
        q, k = q.view(1, 1, s, d), k.view(1, 1, s, d)
        assert (q.data_ptr() % 16 != 0) == (what == "misaligned")
        for step in ("forward", "backward"):
            poison(((n,), dtype), ((n,), dtype))
            op = ops.rope_forward if step == "forward" else ops.rope_backward
            qe, ke = op(q, k, cos, sin)     # (backward: q and k as the output gradients)
            assert qe.shape == q.shape and ke.shape == k.shape
            assert bool(torch.isfinite(qe).all()) and bool(torch.isfinite(ke).all()), f"{what} {step}: not written"
            for p in pieces:
                qs, ks, cs, ss = q[:, :, p], k[:, :, p], cos[:, p], sin[:, p]
                if step == "forward":
                    rq, rk = ref64(qs, ks, cs, ss)
                else:
                    _, _, rq, rk = ref64(torch.zeros_like(qs), torch.zeros_like(ks), cs, ss, qs, ks)
                check(f"{what} {step} q[{p.start}:{p.stop}]", qe[:, :, p], rq, dtype)
                check(f"{what} {step} k[{p.start}:{p.stop}]", ke[:, :, p], rk, dtype)
            del qe, ke
