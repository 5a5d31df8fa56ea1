"""GPU: fused linear cross-entropy (``pipegoose.nn.fusion.fused_linear_cross_entropy``, op
``fused_linear_cross_entropy``): the cross-entropy kernel per chunk of rows between cuBLAS GEMMs.

Each result is compared with the unfused expression PyTorch runs on the same GPU,
``F.cross_entropy(F.linear(hidden, weight, bias).float(), target)`` (the same logits rounding; the weight's gradient
there rounded once, here once per chunk), and with a float64 reference computed on the CPU from the same rounded
inputs. Gradients are compared relative to their largest element (``close``), with the tolerances of
``tests/tolerances.py`` widened by the number of roundings. Gradient buffers come from the caching allocator after a
NaN fill (``poison``): an element never written reads back as NaN.

Run on a GPU machine: ``python -m pytest -m cuda tests/kernels/test_linear_cross_entropy_cuda.py -q``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tolerances import TOLERANCES, tol, weight_scale

from pipegoose.nn.fusion.ops.linear_cross_entropy import default_chunk_rows

pytestmark = pytest.mark.cuda

DEV = "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DT_IDS = ["fp32", "fp16", "bf16"]
OP = "fused_linear_cross_entropy"


@pytest.fixture
def dispatch(no_tuning_table):
    from pipegoose.nn.fusion import dispatch as d

    d.reset_stats()
    yield d
    d.reset_stats()


def poison(nbytes: int) -> None:
    blocks = [torch.full((max(1, nbytes),), 0xFF, dtype=torch.uint8, device=DEV) for _ in range(3)]
    torch.cuda.synchronize()
    del blocks


def inputs(n, h, v, dtype, seed=0, bias=False, every=5, ignore_index=-100):
    g = torch.Generator(device=DEV).manual_seed(seed)
    hidden = torch.randn(n, h, device=DEV, generator=g).to(dtype)
    weight = (torch.randn(v, h, device=DEV, generator=g) * (2.0 / h ** 0.5)).to(dtype)
    b = (torch.randn(v, device=DEV, generator=g) * 0.5).to(dtype) if bias else None
    target = torch.randint(0, v, (n,), device=DEV, generator=g)
    target[1::every] = ignore_index
    return hidden, weight, b, target


def unfused(hidden, weight, target, bias=None, ignore_index=-100, reduction="mean", **_):
    x = F.linear(hidden.reshape(-1, hidden.shape[-1]), weight, bias)
    return F.cross_entropy(x.double() if x.dtype == torch.float64 else x.float(), target.reshape(-1),
                           ignore_index=ignore_index, reduction=reduction)


def loss_and_grads(fn, hidden, weight, bias, target, upstream=None, **kw):
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias)]
    # (the fused path fills its gradient buffers during the forward, a chunk at a time)
    poison(sum(t.numel() * t.element_size() for t in leaves if t is not None))
    loss = fn(leaves[0], leaves[1], target, leaves[2], **kw)
    loss.backward(upstream)
    return (loss.detach(),) + tuple(None if t is None else t.grad for t in leaves)


def chunks_of(n: int, v: int, h: int) -> int:
    """The default chunking's number of chunks."""
    return -(-n // default_chunk_rows(n, v, h))


def max_error(got, want) -> float:
    return (got.detach().double().cpu() - want.detach().double().cpu()).abs().max().item()


def close(got, want, dtype, scale, what, floor=0.0):
    """|got - want| <= max(rtol(dtype) * scale * max|want|, ``floor``) everywhere (and no NaN where want has none)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert not torch.isnan(got).any() or torch.isnan(want).any(), f"{what}: NaN (an element not written?)"
    bound = max(TOLERANCES[dtype]["rtol"] * scale * want.abs().max().item(), floor) + 1e-12
    err = (got - want).abs().max().item()
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def close64(got, ref, dtype, scale, what):
    """Per element against the float64 reference: ``torch.testing.assert_close(got, ref, **tol(dtype, scale))`` on
    both divided by max|ref|, i.e. |got - ref| <= scale * (atol * max|ref| + rtol * |ref|) everywhere (NaN fails: an
    element not written). The table's atol is for values of order 1; these gradients are means over hundreds of rows
    (of order 1e-3), where the bare atol would pass anything: it is taken relative to the largest element, as in
    ``close``, and rtol per element."""
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    m = ref.abs().max().item()
    m = m if m > 0 else 1.0
    torch.testing.assert_close(got / m, ref / m, **tol(dtype, scale),
                               msg=lambda e: f"{what} vs float64 (both divided by max|ref| = {m:.3g}): {e}")


def float64_of(hidden, weight, bias, target, upstream=None, **kw):
    """The unfused expression in float64 on the CPU, from the same (rounded) inputs: (loss, grads of hidden, weight,
    bias), as in test_matches_unfused_and_float64."""
    return loss_and_grads(unfused, *(None if t is None else t.detach().cpu().double() for t in (hidden, weight, bias)),
                          target.cpu(), None if upstream is None else upstream.cpu().double(), **kw)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("shape", [(1, 64, 1000), (257, 128, 32000), (1031, 256, 50257)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_matches_unfused_and_float64(dtype, shape, reduction, bias, dispatch):
    """The default chunking (strict mode: the fused path) against the unfused expression on the GPU and against
    float64; an upstream gradient of 0.75."""
    from pipegoose.nn.fusion import fused_linear_cross_entropy

    n, h, v = shape
    hidden, weight, b, target = inputs(n, h, v, dtype, seed=n + v, bias=bias)
    up = torch.tensor(0.75, device=DEV)
    with dispatch.strict():
        got = loss_and_grads(fused_linear_cross_entropy, hidden, weight, b, target, up, reduction=reduction)
    assert dispatch.last_choice(OP).impl == "pipegoose"
    want = loss_and_grads(unfused, hidden, weight, b, target, up, reduction=reduction)
    ref = loss_and_grads(unfused, *(None if t is None else t.cpu().double() for t in (hidden, weight, b)),
                         target.cpu(), up.cpu().double(), reduction=reduction)
    assert got[0].dtype == torch.float32 and got[0].shape == ()
    torch.testing.assert_close(got[0], want[0], **tol(dtype, 0.1 if dtype != torch.float32 else 1))
    torch.testing.assert_close(got[0].double().cpu(), ref[0], **TOLERANCES[dtype])
    chunks = chunks_of(n, v, h)
    for name, a, w, r, k in zip(("hidden", "weight", "bias"), got[1:], want[1:], ref[1:], (2, weight_scale(chunks), 2)):
        if w is None:
            assert a is None
            continue
        assert a.dtype == dtype, name
        # fp16's logit gradients of a mean over many rows are partly subnormal (p / count below 2**-14), so the
        # unfused path is itself further from float64 than the table's rtol there, and the fused one divides by the
        # count after its GEMMs (session 52): it may be twice that distance from float64 and from the unfused path
        close(a, w, dtype, k, f"{name} vs unfused", floor=2 * max_error(w, r))
        close(a, r, dtype, k, f"{name} vs float64", floor=2 * max_error(w, r))


@pytest.mark.parametrize("chunk_rows", [1, 7, 100, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunkings(dtype, chunk_rows, dispatch):
    """One row per chunk, chunks that do not divide N, one chunk for every row: the same loss and gradients as the
    unfused path, and against float64 per element (the weight's gradient, rounded once per chunk in its dtype, with
    the tolerance widened by the number of chunks: ``weight_scale``)."""
    from pipegoose.nn.fusion import fused_linear_cross_entropy

    n, h, v = 333, 64, 5000
    hidden, weight, b, target = inputs(n, h, v, dtype, seed=3, bias=True)
    got = loss_and_grads(fused_linear_cross_entropy, hidden, weight, b, target, chunk_rows=chunk_rows)
    assert dispatch.last_choice(OP).impl == "pipegoose"
    want = loss_and_grads(unfused, hidden, weight, b, target)
    torch.testing.assert_close(got[0], want[0], **tol(dtype, 0.1 if dtype != torch.float32 else 1))
    chunks = -(-n // min(n, chunk_rows))
    for name, a, w, k in zip(("hidden", "weight", "bias"), got[1:], want[1:], (2, weight_scale(chunks), 2)):
        close(a, w, dtype, k, f"{name}, {chunk_rows} rows per chunk")
    ref = float64_of(hidden, weight, b, target)
    torch.testing.assert_close(got[0].double().cpu(), ref[0], **TOLERANCES[dtype])
    # hidden: the logits' gradient rounded to the dtype, then a GEMM rounded once; the bias: summed in fp32, rounded
    # once; the weight: one rounding per chunk (weight_scale)
    for name, a, r, k in zip(("hidden", "weight", "bias"), got[1:], ref[1:], (2, weight_scale(chunks), 2)):
        assert a.dtype == dtype, name
        close64(a, r, dtype, k, f"{name}, {chunk_rows} rows per chunk")


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_edges(dtype, dispatch):
    """Every row ignored: mean NaN, sum 0, gradients zeros (written). ignore_index 5 (a valid class), with a bias:
    against the unfused path and float64. A target out of range: a NaN loss."""
    from pipegoose.nn.fusion import fused_linear_cross_entropy

    n, h, v = 40, 64, 1000
    hidden, weight, b, target = inputs(n, h, v, dtype, seed=4, bias=True)
    none = torch.full((n,), -100, device=DEV)
    loss, gh, gw, _ = loss_and_grads(fused_linear_cross_entropy, hidden, weight, None, none)
    assert torch.isnan(loss) and torch.equal(gh, torch.zeros_like(gh)) and torch.equal(gw, torch.zeros_like(gw))
    loss, gh, _, _ = loss_and_grads(fused_linear_cross_entropy, hidden, weight, None, none, reduction="sum")
    assert loss.item() == 0 and torch.equal(gh, torch.zeros_like(gh))
    t5 = target.clone()
    t5[(t5 == 5) | (t5 == -100)] = 6   # (-100 is a class index out of range once ignore_index is 5)
    t5[::3] = 5
    got = loss_and_grads(fused_linear_cross_entropy, hidden, weight, b, t5, ignore_index=5)
    assert dispatch.last_choice(OP).impl == "pipegoose"
    want = loss_and_grads(unfused, hidden, weight, b, t5, ignore_index=5)
    torch.testing.assert_close(got[0], want[0], **tol(dtype, 0.1 if dtype != torch.float32 else 1))
    close(got[1], want[1], dtype, 2, "ignore_index 5: hidden")
    ref = float64_of(hidden, weight, b, t5, ignore_index=5)
    torch.testing.assert_close(got[0].double().cpu(), ref[0], **TOLERANCES[dtype])
    for name, a, r, k in zip(("hidden", "weight", "bias"), got[1:], ref[1:],
                             (2, weight_scale(chunks_of(n, v, h)), 2)):   # (as in test_chunkings)
        assert a.dtype == dtype, name
        close64(a, r, dtype, k, f"ignore_index 5: {name}")
    bad = target.clone()
    bad[3] = v
    assert torch.isnan(fused_linear_cross_entropy(hidden, weight, bad, impl="pipegoose"))


def test_model_layouts_autocast_and_tied_weights(dispatch):
    """hidden as a [B, S, H] model output with target [B, S]; fp32 hidden and weight under bf16 autocast (cast
    first, as F.linear is); a weight tied to an input embedding (one leaf, its gradient from both uses)."""
    from pipegoose.nn.fusion import fused_linear_cross_entropy

    b, s, h, v = 3, 77, 128, 32000
    hidden, weight, _, target = inputs(b * s, h, v, torch.float32, seed=5)
    hidden, target = hidden.view(b, s, h), target.view(b, s)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = loss_and_grads(fused_linear_cross_entropy, hidden, weight, None, target)
        want = loss_and_grads(unfused, hidden, weight, None, target)
    assert dispatch.last_choice(OP).impl == "pipegoose"
    assert got[1].dtype == got[2].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], **tol(torch.bfloat16, 0.1))
    # float64 from the inputs as autocast multiplies them: hidden and weight rounded to bf16
    ref = float64_of(hidden.bfloat16(), weight.bfloat16(), None, target)
    torch.testing.assert_close(got[0].double().cpu(), ref[0], **TOLERANCES[torch.bfloat16])
    for name, a, w, r in zip(("hidden", "weight"), got[1:3], want[1:3], ref[1:3]):
        scale = 2 if name == "hidden" else weight_scale(chunks_of(b * s, v, h))
        close(a, w, torch.bfloat16, scale, f"autocast: {name}")
        close64(a, r, torch.bfloat16, scale, f"autocast: {name}")
    # tied: the embedding's lookup and the output projection share one weight
    emb = torch.nn.Embedding(v, h, device=DEV, dtype=torch.bfloat16)
    ids = torch.randint(0, v, (b, s), device=DEV)
    grads = []
    for fn in (fused_linear_cross_entropy, unfused):
        emb.zero_grad()
        fn(emb(ids) * 2, emb.weight, target).backward()
        grads.append(emb.weight.grad.clone())
    assert dispatch.last_choice(OP).impl == "pipegoose"   # (the fused call's: the unfused one does not dispatch)
    close(grads[0], grads[1], torch.bfloat16, weight_scale(chunks_of(b * s, v, h)), "tied weight")
    e64 = emb.weight.detach().cpu().double().requires_grad_(True)
    unfused(e64[ids.cpu()] * 2, e64, target.cpu()).backward()
    # two roundings more than the projection's gradient: the lookup's gradient, and the sum of the two
    close64(grads[0], e64.grad, torch.bfloat16, weight_scale(chunks_of(b * s, v, h)) + 2, "tied weight")


def test_peak_memory_against_unfused(dispatch):
    """Llama-1.1B's head: 8192 tokens, H 2048, V 32000 in bf16. The unfused path holds the bf16 logits, their fp32
    copy and fp32 gradient (about 2.6 GB); the fused one the gradients of hidden and weight and one chunk's logits
    and gradient: less than a third."""
    from pipegoose.nn.fusion import fused_linear_cross_entropy

    n, h, v = 8192, 2048, 32000
    hidden, weight, _, target = inputs(n, h, v, torch.bfloat16, seed=6)

    def peak(fn):
        hh, ww = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = fn(hh, ww, target)
        loss.backward()
        torch.cuda.synchronize()
        return loss.detach(), hh.grad, ww.grad, torch.cuda.max_memory_allocated() - base

    got = peak(fused_linear_cross_entropy)
    assert dispatch.last_choice(OP).impl == "pipegoose"
    want = peak(unfused)
    torch.testing.assert_close(got[0], want[0], **tol(torch.bfloat16, 0.1))
    close(got[1], want[1], torch.bfloat16, 2, "hidden")
    close(got[2], want[2], torch.bfloat16, weight_scale(chunks_of(n, v, h)), "weight")
    assert got[3] < want[3] / 3, (got[3], want[3])
