"""GPU tests of pipegoose's own fused softmax (``pipegoose/kernels/csrc/softmax.cu``, ``softmax.cuh``,
``softmax_{fp32,fp16,bf16}.cu``) through ``torch.ops.pipegoose.softmax_forward`` / ``softmax_backward``.

Every result is compared with a float64 reference computed from the same (already rounded) inputs, with the
per-dtype tolerances of ``tests/tolerances.py`` applied to each row scaled by its largest reference value (so that a
long row of tiny probabilities is still checked to the dtype's precision, not waved through by ``atol``). Outputs
are poisoned before each kernel call (NaN blocks left in the caching allocator), so an element the kernel fails
to write reads back as NaN.

Run on a GPU machine: ``python -m pytest -m cuda tests/kernels/test_softmax_cuda.py -q`` (builds the kernel on first
use; ``python -m pipegoose.kernels build pipegoose/softmax`` first saves time). The 4.3 GB int64-indexing case is
``test_int64_indexing``.
"""

from __future__ import annotations

import math

import pytest
import torch

from tolerances import TOLERANCES

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

DEV = "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DT_IDS = ["fp32", "fp16", "bf16"]
MODES = ["plain", "masked", "causal"]
# Together these reach every launch plan of softmax.cuh for every dtype, forward and backward: 1..60 keys: 1..16
# threads per row (sub-warp rows); 127..1000: one warp with 1..8 vectors per thread (incl. the Megatron-LM#132
# short-key class); 2048..32768: 64..1024 threads per row, register resident (the backward's largest plans stage dy
# in shared memory; the 16-bit causal forward from 16384 keys stages the row in shared memory); 4097: a partial last
# vector; 32768 (fp32 backward) and 40000: the two-pass kernels; HUGE: far
# beyond the register budget. (The row-pair kernels of square causal matrices: the tests named causal_square.)
KEY_LENS = [1, 2, 5, 16, 31, 60, 127, 128, 300, 1000, 2048, 3000, 4097, 8192, 16384, 32768, 40000]
HUGE = 200_003


@pytest.fixture(scope="module")
def sm():
    from pipegoose.kernels import load

    return load("pipegoose/softmax")


# --------------------------------------------------------------------------------------------------- helpers
def poison(*nbytes: int) -> None:
    """Leave 0xFF-filled blocks (NaN in fp32/fp16/bf16) of the given sizes in the caching allocator, so that an
    output element a kernel does not write reads back as NaN."""
    blocks = [torch.full((max(1, n),), 0xFF, dtype=torch.uint8, device=DEV) for n in nbytes]
    torch.cuda.synchronize()
    del blocks


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def hidden_keys(shape, mask, causal: bool) -> torch.Tensor:
    """Bool tensor of ``shape``: True where the key is hidden (mask and/or causal)."""
    h = torch.zeros(shape, dtype=torch.bool, device=DEV)
    if mask is not None:
        h = h | mask
    if causal:
        sq, sk = shape[-2], shape[-1]
        i = torch.arange(sq, device=DEV)[:, None]
        j = torch.arange(sk, device=DEV)[None, :]
        h = h | (j > i + (sk - sq))
    return h


def ref_forward(x, mask, scale, causal) -> torch.Tensor:
    z = x.double() * scale
    h = hidden_keys(z.shape, mask, causal)
    y = torch.softmax(z.masked_fill(h, -math.inf), dim=-1)
    return y.masked_fill(h.all(dim=-1, keepdim=True), 0.0)  # fully hidden rows: zeros (not NaN)


def ref_backward(dy, y, scale) -> torch.Tensor:
    dy, y = dy.double(), y.double()
    return scale * y * (dy - (dy * y).sum(dim=-1, keepdim=True))


def check(name: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
          row_scale: torch.Tensor | None = None) -> None:
    """No NaN where the reference has none, then assert_close row by row, each row scaled by max |expected| (or by
    ``row_scale`` where that is larger: the size of the terms the result is computed from)."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == dtype, f"{name}: dtype {actual.dtype} != {dtype}"
    bad = torch.isnan(actual) & ~torch.isnan(expected)
    assert not bool(bad.any()), f"{name}: {int(bad.sum())} element(s) NaN (not written?)"
    a, e = actual.double(), expected.double()
    if e.dim() >= 1 and e.numel() > 0:
        rmax = e.abs().amax(dim=-1, keepdim=True)
        if row_scale is not None:
            rmax = torch.maximum(rmax, row_scale.double())
        rmax = torch.where(rmax > 0, rmax, torch.ones_like(rmax))
        a, e = a / rmax, e / rmax
    torch.testing.assert_close(a, e, **TOLERANCES[dtype], msg=lambda m: f"{name}: {m}")


def make(shape, dtype, seed=0, mask_shape=None, p_mask=0.3):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(shape, generator=g, device=DEV) * 2.0).to(dtype)
    dy = torch.randn(shape, generator=g, device=DEV).to(dtype)
    mask = None
    if mask_shape is not None:
        mask = torch.rand(mask_shape, generator=g, device=DEV) < p_mask
    return x, dy, mask


def fwd(sm, x, mask, scale, causal):
    poison(x.numel() * x.element_size())
    return sm.softmax_forward(x, mask, scale, causal)


def bwd(sm, dy, y, scale, causal=False):
    poison(y.numel() * y.element_size())
    return sm.softmax_backward(dy, y, scale, causal)


def roundtrip(sm, name, x, dy, mask, scale, causal, dtype):
    """Forward and backward against the float64 references; returns the kernel's y."""
    y = fwd(sm, x, mask, scale, causal)
    check(f"{name} fwd", y, ref_forward(x, mask, scale, causal), dtype)
    for flag in ((False, True) if causal else (False,)):
        dx = bwd(sm, dy, y, scale, flag)
        # dx = scale * y * (dy - sum(dy * y)) cancels where y is nearly one-hot (large scales): the rounding of the
        # sum is relative to scale * max|y| * max|dy|, not to the (tiny) result, so rows are scaled by that too.
        terms = scale * dy.double().abs().amax(dim=-1, keepdim=True) * y.double().abs().amax(dim=-1, keepdim=True)
        check(f"{name} bwd(causal={flag})", dx, ref_backward(dy, y, scale), dtype, row_scale=terms)
    return y


def mode_args(mode, shape):
    """(mask shape or None, causal) for a mode, for a 4-D shape [b, np, sq, sk]."""
    if mode == "masked":
        return (shape[0], 1, shape[2], shape[3]), False
    return None, mode == "causal"


# --------------------------------------------------------------------------------------------------- correctness
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sk", KEY_LENS)
def test_key_lengths(sm, dtype, mode, sk):
    lead = (3, 5, 37) if sk <= 2048 else (2, 3, 5)  # 555 rows: not a multiple of any rows-per-block
    shape = (*lead, sk)
    mshape, causal = mode_args(mode, shape)
    x, dy, mask = make(shape, dtype, seed=sk, mask_shape=mshape)
    if mask is not None:
        mask[0, 0, 0, :] = True  # one fully masked row
    roundtrip(sm, f"{mode} {shape}", x, dy, mask, 0.125, causal, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("sk", [2048, 2056, 8192, 12288, 16384, 32768])
def test_causal_square_long_rows(sm, dtype, sk):
    """Whole causal score matrices (sq == sk) of long rows, every row length from 1 to sk: the long-row plans of the
    backward (zeros above the diagonal stored early; in row pairs at 16-bit 2056 and fp32 2048 keys with the zeros
    late, at 12288 and 16384 keys with the zeros early) and of the forward (16-bit: row pairs below 16384 keys; from
    16384 keys the row staged in shared memory, kCausalSmemMin). NaN above the diagonal of dy and y must not change
    the backward's result (the tail is not used). The last 1024 queries again, their rows strided by 8 padding keys:
    the register-resident plans (sq != sk)."""
    heads = 2 if sk <= 8192 else 1
    rows = sk if sk <= 16384 else 1024  # 32768: the last 1024 queries (bottom-right aligned: keys j <= i + sk - rows)
    x, dy, _ = make((1, heads, rows, sk), dtype, seed=sk)
    y = roundtrip(sm, f"causal {rows} x {sk}", x, dy, None, 0.125, True, dtype)
    tail = hidden_keys(x.shape, None, True)
    dx = bwd(sm, dy, y, 0.125, True)
    nan = float("nan")
    dx_nan = bwd(sm, dy.masked_fill(tail, nan), y.masked_fill(tail, nan), 0.125, True)
    assert torch.equal(dx_nan, dx), "NaN in the causal tail of dy / y changed the backward's result"
    r = min(rows, 1024)  # the last 1024 queries again, their rows strided
    base, dyb, _ = make((1, heads, r, sk + 8), dtype, seed=sk + 1)
    roundtrip(sm, f"causal {r} x {sk} strided", base[..., :sk], dyb[..., :sk], None, 0.125, True, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("sk", [8, 16, 20, 24, 36, 40, 48, 120, 128, 132, 136, 512, 516, 1000, 1024, 1032, 1040, 4096])
def test_causal_square_rows_in_pairs(sm, dtype, sk):
    """Square causal matrices (sq == sk, no padding mask, whole vectors): the row-pair kernels, which give one thread
    group a short row and a long one: the forward's in 16-bit from 1025 keys (softmax_fwd_causal_pair_kernel), the
    backward's (softmax_bwd_causal_pair_kernel, causal flag) in 16-bit up to 1024 keys and at 4096, in fp32 up to
    128 keys and at 1032; the other lengths the register-resident plans. Key lengths of an odd and an even number of
    vectors in both vector widths (8 and 4 keys: 20, 36, 132 and 516 are odd in fp32), from one vector per row up in
    16-bit (two in fp32); several heads, contiguous and strided rows (transposed heads); NaN above the diagonal must
    change nothing (the tail is not used, forward and backward) and every output element must be written (poisoned
    outputs). The backward's pairs of 8193-16384 keys (zeros stored early): test_causal_square_long_rows (12288 and
    16384 keys)."""
    heads = 3 if sk <= 1032 else 2
    x, dy, _ = make((2, heads, sk, sk), dtype, seed=sk + 5)
    tail = hidden_keys(x.shape, None, True)
    y = fwd(sm, x.masked_fill(tail, float("nan")), None, 0.125, True)
    assert bool((y[tail.expand(x.shape)] == 0).all()), "the causal tail must be exact zeros"
    check(f"causal pairs {sk} fwd", y, ref_forward(x, None, 0.125, True), dtype)
    nan = float("nan")
    dx = bwd(sm, dy.masked_fill(tail, nan), y.masked_fill(tail, nan), 0.125, True)
    assert bool((dx[tail.expand(x.shape)] == 0).all()), "backward(causal=True) must write zeros in the causal tail"
    terms = 0.125 * dy.double().abs().amax(dim=-1, keepdim=True) * y.double().abs().amax(dim=-1, keepdim=True)
    check(f"causal pairs {sk} bwd", dx, ref_backward(dy, y, 0.125), dtype, row_scale=terms)
    roundtrip(sm, f"causal pairs {sk}", x, dy, None, 0.125, True, dtype)
    # rows strided: [b, sq, heads, sk + 8] seen as [b, heads, sq, sk] (not evenly spaced rows)
    base, dyb, _ = make((2, sk, heads, sk + 8), dtype, seed=sk + 6)
    xs, dys = base.transpose(1, 2)[..., :sk], dyb.transpose(1, 2)[..., :sk]
    roundtrip(sm, f"causal pairs {sk} strided", xs, dys, None, 0.125, True, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_causal_long_rows_more_queries_than_keys(sm, dtype):
    """Causal with sq > sk at 16384 keys (in 16-bit, the forward's staged kernel): the first sq - sk queries see no
    key and give exact zeros, the next ones one key, two keys, and so on. Every query row holds the same scores and
    gradient (stride-0 views: rows evenly spaced 0 elements apart)."""
    sk, extra = 16384, 3
    row, dy_row, _ = make((1, 1, 1, sk), dtype, seed=13)
    x, dy = row.expand(1, 1, sk + extra, sk), dy_row.expand(1, 1, sk + extra, sk)
    y = fwd(sm, x, None, 0.125, True)
    assert bool((y[:, :, :extra] == 0).all()), "queries that see no key must give exact zeros"
    check("causal sq > sk, 16384 keys fwd", y, ref_forward(x, None, 0.125, True), dtype)
    dx = bwd(sm, dy, y, 0.125, True)
    assert bool((dx[:, :, :extra] == 0).all())
    check("causal sq > sk, 16384 keys bwd", dx, ref_backward(dy, y, 0.125), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("sk", [16384, 32768])
def test_causal_tail_of_long_rows_is_not_read(sm, dtype, sk):
    """NaN above the diagonal changes nothing on the long causal rows without a padding mask (in 16-bit, the
    forward's staged kernel, which stores those zeros without reading them): the last 1024 queries, whose hidden tails
    hold up to 1023 keys, whole vectors among them."""
    x, dy, _ = make((1, 1, 1024, sk), dtype, seed=sk + 2)
    tail = hidden_keys(x.shape, None, True)
    y = fwd(sm, x.masked_fill(tail, float("nan")), None, 0.125, True)
    check(f"NaN in the causal tail, {sk} keys fwd", y, ref_forward(x, None, 0.125, True), dtype)
    dx = bwd(sm, dy.masked_fill(tail, float("nan")), y, 0.125, True)
    assert bool((dx[tail.expand(x.shape)] == 0).all()), "backward(causal=True) must write zeros in the causal tail"
    check(f"NaN in the causal tail, {sk} keys bwd", dx, ref_backward(dy, y, 0.125), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("mode", MODES)
def test_huge_row_two_pass(sm, dtype, mode):
    shape = (1, 2, 3, HUGE)
    mshape, causal = mode_args(mode, shape)
    x, dy, mask = make(shape, dtype, seed=7, mask_shape=mshape)
    roundtrip(sm, f"{mode} {shape}", x, dy, mask, 0.5, causal, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("mode", MODES)
def test_odd_shape(sm, dtype, mode):
    shape = (3, 5, 7, 213)
    mshape, causal = mode_args(mode, shape)
    x, dy, mask = make(shape, dtype, seed=3, mask_shape=mshape)
    roundtrip(sm, f"{mode} {shape}", x, dy, mask, 0.3, causal, dtype)


def test_short_keys_masked_fp16(sm):
    """Megatron-LM#132 class: short keys once took a wrong vector width."""
    shape = (4, 12, 24, 24)
    x, dy, mask = make(shape, torch.float16, seed=132, mask_shape=(4, 1, 24, 24))
    roundtrip(sm, "masked [4,12,24,24]", x, dy, mask, 0.125, False, torch.float16)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_short_keys_causal_3d(sm, dtype):
    x, dy, _ = make((48, 24, 24), dtype, seed=48)
    roundtrip(sm, "causal [48,24,24]", x, dy, None, 0.125, True, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("sk", [1, 77, 1000, 4096, 40000])
def test_decode_sq1(sm, dtype, sk):
    shape = (4, 8, 1, sk)
    x, dy, mask = make(shape, dtype, seed=sk, mask_shape=(4, 1, 1, sk))
    mask[1] = True  # a batch row with every key masked (left padding gone wrong): zeros
    roundtrip(sm, f"decode masked {shape}", x, dy, mask, 0.125, False, dtype)
    roundtrip(sm, f"decode causal {shape}", x, dy, None, 0.125, True, dtype)  # sq == 1 sees every key
    roundtrip(sm, f"decode masked+causal {shape}", x, dy, mask, 0.125, True, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("mshape", [(2, 1, 9, 300), (1, 3, 1, 300), (1, 1, 1, 300), (2, 3, 9, 300), (2, 1, 1, 300),
                                    (1, 3, 9, 300)])
def test_mask_broadcast_forms(sm, dtype, mshape):
    shape = (2, 3, 9, 300)
    x, dy, mask = make(shape, dtype, seed=sum(mshape), mask_shape=mshape, p_mask=0.5)
    roundtrip(sm, f"mask {mshape}", x, dy, mask, 0.125, False, dtype)
    roundtrip(sm, f"mask {mshape} + causal", x, dy, mask, 0.125, True, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["masked", "masked+causal"])
@pytest.mark.parametrize("keys", ["vector", "partial vector", "two-pass"])
def test_mask_broadcast_over_large_heads(sm, dtype, causal, keys):
    """A padding mask broadcast over the heads, with heads whose scores and output exceed half this GPU's L2: the
    forward's grid walks the heads innermost (``softmax.cuh``, ``heads_inner_takes``; the output is the same in either
    order, so this checks the order's rows, not that it was taken), in the register-resident kernel
    (whole vectors, or a partial last one) and in the two-pass kernel (40000 keys). Two batches, three heads, an odd
    query count sized from the L2, and a fully masked row; every output element checked (poisoned first)."""
    sk = {"vector": 4096 if dtype != torch.float32 else 2048, "partial vector": 4099, "two-pass": 40000}[keys]
    l2 = torch.cuda.get_device_properties(DEV).L2_cache_size
    # a head's x and y (2 * sq * sk elements) take at least two thirds of the L2 in bytes: the bound is half
    sq = (l2 // (3 * sk * torch.finfo(dtype).bits // 8) + 1) | 1
    x, dy, mask = make((2, 3, sq, sk), dtype, seed=sq, mask_shape=(2, 1, sq, sk))
    mask[1, 0, sq // 2, :] = True
    roundtrip(sm, f"mask over heads [2, 3, {sq}, {sk}]", x, dy, mask, 0.125, causal, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_strided_and_misaligned_masks(sm, dtype):
    shape = (2, 3, 9, 256)
    x, dy, _ = make(shape, dtype, seed=11)
    g = torch.Generator(device=DEV).manual_seed(12)
    wide = torch.rand((2, 1, 9, 263), generator=g, device=DEV) < 0.4
    cases = {
        "offset by one byte (scalar mask loads)": wide[..., 1:257],
        "last dim not contiguous (copied)": (torch.rand((2, 1, 256, 9), generator=g, device=DEV) < 0.4).transpose(-1, -2),
        "expanded": (torch.rand((1, 1, 1, 256), generator=g, device=DEV) < 0.4).expand(2, 3, 9, 256),
    }
    for name, mask in cases.items():
        roundtrip(sm, f"mask {name}", x, dy, mask, 0.125, False, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("sk", [5, 64, 1000, 4096, 40000])
def test_fully_masked_rows_give_zeros(sm, dtype, sk):
    shape = (2, 2, 4, sk)
    x, dy, _ = make(shape, dtype, seed=sk)
    mask = torch.zeros((2, 1, 4, sk), dtype=torch.bool, device=DEV)
    mask[0, 0, 1] = True
    mask[1, 0, :] = True
    y = fwd(sm, x, mask, 1.0, False)
    assert not bool(torch.isnan(y).any())
    assert bool((y[0, :, 1] == 0).all()) and bool((y[1] == 0).all()), "fully masked rows must be exact zeros"
    check("fully masked fwd", y, ref_forward(x, mask, 1.0, False), dtype)
    dx = bwd(sm, dy, y, 1.0)
    assert bool((dx[0, :, 1] == 0).all()) and bool((dx[1] == 0).all()), "their gradient must be exact zeros"
    if sk > 64:
        return
    # causal with sq > sk: the first sq - sk queries see no key
    xc, dyc, _ = make((2, 3, sk + 3, sk), dtype, seed=sk + 1)
    yc = fwd(sm, xc, None, 1.0, True)
    assert bool((yc[:, :, :3] == 0).all())
    check("causal sq > sk fwd", yc, ref_forward(xc, None, 1.0, True), dtype)
    dxc = bwd(sm, dyc, yc, 1.0, True)
    assert bool((dxc[:, :, :3] == 0).all())
    check("causal sq > sk bwd", dxc, ref_backward(dyc, yc, 1.0), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("sk", [24, 333, 2048, 40000])
def test_hidden_keys_are_ignored(sm, dtype, sk):
    """NaN at masked keys and in the causal tail changes nothing: the causal tail is never read (forward, and
    backward with causal=True), masked keys are never used."""
    shape = (2, 2, 6, sk)
    x, dy, mask = make(shape, dtype, seed=sk, mask_shape=(2, 1, shape[2], sk))
    h = hidden_keys(shape, mask, True)
    y = fwd(sm, x.masked_fill(h, float("nan")), mask, 0.125, True)
    check("NaN at hidden keys fwd", y, ref_forward(x, mask, 0.125, True), dtype)
    tail = hidden_keys(shape, None, True)
    dx = bwd(sm, dy.masked_fill(tail, float("nan")), y.masked_fill(tail, float("nan")), 0.125, True)
    assert bool((dx[tail.expand(shape)] == 0).all()), "backward(causal=True) must write zeros in the causal tail"
    check("NaN in the causal tail bwd", dx, ref_backward(dy, y, 0.125), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("sk", [7, 96, 1000, 4096, 40000])
def test_non_contiguous_inputs(sm, dtype, sk):
    b, np_, sq = 2, 3, 5
    g = torch.Generator(device=DEV).manual_seed(sk)
    for pad, start in ((8, 0), (3, 0), (9, 1)):  # aligned strided rows / odd row stride / misaligned start
        base = (torch.randn((b, sq, np_, sk + pad), generator=g, device=DEV) * 2).to(dtype)
        x = base.transpose(1, 2)[..., start:start + sk]  # [b, np, sq, sk], rows strided, last dim contiguous
        assert not x.is_contiguous() and x.stride(-1) == 1
        dbase = torch.randn((b, sq, np_, sk + pad), generator=g, device=DEV).to(dtype)
        dy = dbase.transpose(1, 2)[..., start:start + sk]
        mask = torch.rand((b, 1, sq, sk), generator=g, device=DEV) < 0.3
        for m, causal in ((None, False), (mask, False), (None, True)):
            y = fwd(sm, x, m, 0.125, causal)
            assert y.is_contiguous()
            check(f"strided pad={pad} start={start} fwd", y, ref_forward(x, m, 0.125, causal), dtype)
            ys = torch.empty((b, sq, np_, sk + pad), dtype=dtype, device=DEV).transpose(1, 2)[..., start:start + sk]
            ys.copy_(y)  # a strided y as well
            dx = bwd(sm, dy, ys, 0.125, causal)
            check(f"strided pad={pad} start={start} bwd", dx, ref_backward(dy, y, 0.125), dtype)
    # last dim not contiguous: documented fallback (copy), same results
    xt = (torch.randn((b, np_, sk, sq), generator=g, device=DEV) * 2).to(dtype).transpose(-1, -2)
    y = fwd(sm, xt, None, 0.125, True)
    check("transposed last dim fwd", y, ref_forward(xt, None, 0.125, True), dtype)
    dyt = torch.randn((b, np_, sk, sq), generator=g, device=DEV).to(dtype).transpose(-1, -2)
    check("transposed last dim bwd", bwd(sm, dyt, y, 0.125), ref_backward(dyt, y, 0.125), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_ranks_other_than_4(sm, dtype):
    for shape in [(1000,), (7, 300), (3, 4, 5, 6, 129), (2, 1, 3, 4, 5, 64)]:
        x, dy, _ = make(shape, dtype, seed=len(shape))
        roundtrip(sm, f"plain {shape}", x, dy, None, 0.5, False, dtype)
        if len(shape) >= 2:
            roundtrip(sm, f"causal {shape}", x, dy, None, 0.5, True, dtype)
    x, dy, _ = make((2, 3, 4, 5, 6, 129), dtype, seed=9)  # rank 6, leading dims not mergeable -> reshape copy
    xs = x.transpose(0, 2)
    roundtrip(sm, "rank-6 permuted", xs, dy.transpose(0, 2), None, 0.5, True, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("scale", [0.0, -0.7, 1.0, 8.0])
def test_scales(sm, dtype, scale):
    x, dy, mask = make((2, 4, 8, 520), dtype, seed=5, mask_shape=(2, 1, 8, 520))
    roundtrip(sm, f"scale={scale}", x, dy, mask, scale, False, dtype)


def test_zero_sized(sm):
    for shape in [(0, 3, 4, 16), (2, 3, 4, 0), (2, 0)]:
        x = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
        y = sm.softmax_forward(x, None, 1.0, False)
        assert y.shape == x.shape and y.dtype == x.dtype
        assert sm.softmax_backward(x, y, 1.0).shape == x.shape


def test_deterministic(sm):
    x, dy, mask = make((4, 8, 64, 3000), torch.bfloat16, seed=1, mask_shape=(4, 1, 64, 3000))
    y1, y2 = sm.softmax_forward(x, mask, 0.125, True), sm.softmax_forward(x, mask, 0.125, True)
    assert torch.equal(y1, y2)
    assert torch.equal(sm.softmax_backward(dy, y1, 0.125), sm.softmax_backward(dy, y1, 0.125))


def test_runs_on_the_current_stream(sm):
    x, dy, _ = make((8, 16, 128, 1024), torch.float16, seed=2)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # keep the side stream busy: a launch on another stream would race ahead
        y = sm.softmax_forward(x, None, 0.125, True)
        dx = sm.softmax_backward(dy, y, 0.125, True)
    torch.cuda.current_stream().wait_stream(s)
    check("side stream fwd", y, ref_forward(x, None, 0.125, True), torch.float16)
    check("side stream bwd", dx, ref_backward(dy, y, 0.125), torch.float16)


def test_against_torch_softmax(sm):
    x = torch.randn(64, 5000, device=DEV)
    torch.testing.assert_close(sm.softmax_forward(x, None, 0.5, False), torch.softmax(x * 0.5, -1),
                               **TOLERANCES[torch.float32])


def test_causal_bf16_32x4096x4096(sm):
    shape = (32, 4096, 4096)
    x, dy, _ = make(shape, torch.bfloat16, seed=4096)
    y = fwd(sm, x, None, 0.125, True)
    dx = bwd(sm, dy, y, 0.125, True)
    for h in range(0, 32, 4):  # float64 references in slices of heads: 4 x 4096 x 4096 x 8 B = 512 MB each
        sl = slice(h, h + 4)
        check(f"causal heads {h}.. fwd", y[sl], ref_forward(x[sl], None, 0.125, True), torch.bfloat16)
        check(f"causal heads {h}.. bwd", dx[sl], ref_backward(dy[sl], y[sl], 0.125), torch.bfloat16)


def test_int64_indexing(sm):
    """rows * sk > 2^31: offsets past 2^31 elements (4.3 GB per bf16 tensor, ~18 GB in all)."""
    sk = 4096
    rows = 2**31 // sk + 8
    assert rows * sk > 2**31
    g = torch.Generator(device=DEV).manual_seed(31)
    x = torch.randn((rows, sk), generator=g, device=DEV, dtype=torch.bfloat16)
    y = fwd(sm, x, None, 1.0, False)
    assert not bool(torch.isnan(y).any()), "NaN in the output: elements not written"
    sums = y.sum(dim=-1, dtype=torch.float32)
    assert bool(((sums - 1).abs() < 0.05).all()), "a row does not sum to 1"
    edges = [slice(0, 16), slice(2**31 // sk - 8, rows)]  # first rows and the rows across / past 2^31 elements
    for sl in edges:
        check(f"int64 fwd rows {sl}", y[sl], ref_forward(x[sl], None, 1.0, False), torch.bfloat16)
    dy = torch.randn((rows, sk), generator=g, device=DEV, dtype=torch.bfloat16)
    del x
    dx = bwd(sm, dy, y, 1.0)
    assert not bool(torch.isnan(dx).any()), "NaN in the gradient: elements not written"
    for sl in edges:
        check(f"int64 bwd rows {sl}", dx[sl], ref_backward(dy[sl], y[sl], 1.0), torch.bfloat16)


def test_causal_int64_indexing(sm):
    """A causal [130, 4096, 4096] bf16 matrix (rows * sk > 2^31, 4.4 GB per tensor): the row pairs of the last heads
    lie past 2^31 elements."""
    heads, sk = 130, 4096
    assert heads * sk * sk > 2**31
    g = torch.Generator(device=DEV).manual_seed(32)
    x = torch.randn((heads, sk, sk), generator=g, device=DEV, dtype=torch.bfloat16)
    y = fwd(sm, x, None, 0.125, True)
    dy = torch.randn((heads, sk, sk), generator=g, device=DEV, dtype=torch.bfloat16)
    dx = bwd(sm, dy, y, 0.125, True)
    assert not bool(torch.isnan(y).any()) and not bool(torch.isnan(dx).any()), "NaN in the output: not written?"
    for sl in (slice(0, 1), slice(heads - 3, heads)):  # the first head; the last head below 2^31 elements, two past
        check(f"causal int64 fwd heads {sl}", y[sl], ref_forward(x[sl], None, 0.125, True), torch.bfloat16)
        check(f"causal int64 bwd heads {sl}", dx[sl], ref_backward(dy[sl], y[sl], 0.125), torch.bfloat16)


# --------------------------------------------------------------------------------------------------- contract
def test_opcheck(sm):
    x, dy, mask = make((2, 3, 5, 40), torch.float16, seed=0, mask_shape=(2, 1, 5, 40))
    f, b = torch.ops.pipegoose.softmax_forward.default, torch.ops.pipegoose.softmax_backward.default
    torch.library.opcheck(f, (x, None, 0.125, False))
    torch.library.opcheck(f, (x, mask, 0.125, True))
    torch.library.opcheck(f, (x.transpose(1, 2), None, 0.125, True))
    y = f(x, mask, 0.125, False)
    torch.library.opcheck(b, (dy, y, 0.125))
    torch.library.opcheck(b, (dy, y, 0.125, True))


def test_bad_arguments_name_the_argument(sm):
    f, b = sm.softmax_forward, sm.softmax_backward
    x = torch.randn(2, 3, 5, 7, device=DEV, dtype=torch.float16)
    ok_mask = torch.zeros(2, 1, 5, 7, dtype=torch.bool, device=DEV)
    with pytest.raises(RuntimeError, match="input must be float32, float16 or bfloat16"):
        f(x.double(), None, 1.0, False)
    with pytest.raises(RuntimeError, match="input must have at least 1 dimension"):
        f(torch.tensor(1.0, device=DEV), None, 1.0, False)
    with pytest.raises(RuntimeError, match="causal=True needs input"):
        f(x[0, 0, 0], None, 1.0, True)
    with pytest.raises(RuntimeError, match="scale must be a finite number"):
        f(x, None, float("inf"), False)
    with pytest.raises(RuntimeError, match="mask must be bool"):
        f(x, ok_mask.half(), 1.0, False)
    with pytest.raises(RuntimeError, match="mask must be 4-D"):
        f(x, ok_mask[0], 1.0, False)
    with pytest.raises(RuntimeError, match="mask's last dim must equal the key length"):
        f(x, ok_mask[..., :6], 1.0, False)
    with pytest.raises(RuntimeError, match="does not broadcast"):
        f(x, torch.zeros(2, 2, 5, 7, dtype=torch.bool, device=DEV), 1.0, False)
    with pytest.raises(RuntimeError, match="a mask needs a 4-D input"):
        f(x[0], ok_mask, 1.0, False)
    with pytest.raises(RuntimeError, match="mask must be on the input's device"):
        f(x, ok_mask.cpu(), 1.0, False)
    with pytest.raises((NotImplementedError, RuntimeError)):  # no CPU kernel is registered
        f(x.cpu(), None, 1.0, False)
    y = f(x, None, 1.0, False)
    with pytest.raises(RuntimeError, match="grad_output must have output's shape"):
        b(y[..., :6], y, 1.0)
    with pytest.raises(RuntimeError, match="grad_output must have output's dtype"):
        b(y.float(), y, 1.0)
    with pytest.raises(RuntimeError, match="output must be float32, float16 or bfloat16"):
        b(y.double(), y.double(), 1.0)
    with pytest.raises(RuntimeError, match="scale must be a finite number"):
        b(y, y, float("nan"))
