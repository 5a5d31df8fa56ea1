"""GPU: ``pipegoose::multi_tensor_norm`` and ``pipegoose::multi_tensor_mul_`` (ours,
``pipegoose/kernels/csrc/clip_grad_norm.cu``) against float64: the 1, 2 and inf norms in fp32, fp16 and bf16, sizes
around the chunks, more tensors than one launch takes, empty and misaligned tensors, nan and inf, 64-bit offsets; the
multiplication against torch's fp32 product (bit for bit) and float64; the argument checks (a refused call changes
nothing). The fakes are tested on the CPU (``test_clip_grad_norm_fakes.py``). Run on the GPU machine:
``python -m pytest -m cuda tests``."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_helpers import poison
from tolerances import TOLERANCES

pytestmark = pytest.mark.cuda
DEV = "cuda"
ALL = [torch.float32, torch.float16, torch.bfloat16]
NORMS = [2.0, 1.0, math.inf]
# one element; around the chunks (4096 fp32, 8192 16-bit elements) and the 16-byte vectors; 1100 small tensors (a
# launch takes 1024); empty tensors between and at the end
SIZES = [1, 3, 4095, 4096, 4097, 8191, 8192, 8193, 0, 65536 * 3 + 5] + [37] * 1100 + [0, 2]


@pytest.fixture(scope="module")
def ops():
    from pipegoose.kernels import load

    return load("pipegoose/clip_grad_norm")


def _tensors(sizes, dtype, seed, scale=1.0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return [(torch.randn(n, device=DEV, generator=gen) * scale * (1 + i % 7)).to(dtype) for i, n in enumerate(sizes)]


def _at_offset(t, k):
    """The same values at element offset k of a larger buffer (a pointer that is not 16-byte aligned for k % 8)."""
    buf = torch.zeros(t.numel() + k, dtype=t.dtype, device=DEV)
    buf[k:] = t
    return buf[k:]


def _norm64(ts, norm_type):
    return torch.linalg.vector_norm(torch.cat([t.double().reshape(-1) for t in ts]), norm_type)


def _norm(ops, ts, norm_type):
    poison(((), torch.float32))
    return ops.multi_tensor_norm(ts, norm_type)


def test_opcheck(ops):
    ts = _tensors([5, 300, 9000], torch.float32, seed=0)
    torch.library.opcheck(torch.ops.pipegoose.multi_tensor_norm.default, (ts, 2.0))
    torch.library.opcheck(torch.ops.pipegoose.multi_tensor_mul_.default, (ts, torch.tensor(0.5, device=DEV)))


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("norm_type", NORMS)
def test_norm_matches_float64(ops, dtype, norm_type):
    """The values are exact in float64, and the kernel accumulates in fp32 whatever the dtype: the fp32 tolerances
    apply to every dtype."""
    ts = _tensors(SIZES, dtype, seed=1)
    ts[5], ts[9] = _at_offset(ts[5], 1), _at_offset(ts[9], 3)   # two misaligned tensors in the first launch
    assert ts[5].data_ptr() % 16 and ts[9].data_ptr() % 16
    before = [t.clone() for t in ts]
    got = _norm(ops, ts, norm_type)
    assert got.shape == () and got.dtype == torch.float32 and got.device.type == "cuda"
    torch.testing.assert_close(got.double().cpu(), _norm64(ts, norm_type).cpu(), **TOLERANCES[torch.float32])
    assert all(torch.equal(a, b) for a, b in zip(ts, before)), "the norm must not change its tensors"
    assert torch.equal(got, _norm(ops, ts, norm_type)), "the same input must give the same bits"


@pytest.mark.parametrize("dtype", ALL)
def test_norm_of_large_tensors(ops, dtype):
    """Tensors of many chunks each (the blocks walk several chunks), one of them one element past a vector."""
    ts = _tensors([2**22 + 1, 3 * 2**20, 2**21 + 8], dtype, seed=2)
    for norm_type in NORMS:
        got = _norm(ops, ts, norm_type)
        torch.testing.assert_close(got.double(), _norm64(ts, norm_type), **TOLERANCES[torch.float32])


# More chunks than the resident blocks of an H100 or H200 (132 SMs, 6 blocks of 256 an SM: 792) in each of two
# launches (1200 non-empty tensors; the host plan drops empty ones and a launch takes 1024), so that blocks walk ranges
# of several chunks that start inside a tensor and end inside another, past tensors of one short chunk:
# 600 x (an empty tensor, 37 elements, 8 chunks and 3 elements in 16-bit (16 and 3 in fp32), an empty tensor):
# 16-bit 5120 and 880 chunks, fp32 9216 and 1584.
MANY_CHUNKS = [0, 37, 8 * 8192 + 3, 0] * 600


@pytest.mark.parametrize("dtype", ALL)
def test_block_ranges_cross_tensors(ops, dtype):
    """Zeros but for a small integer (1 to 7) at the first element of every chunk and at each tensor's last: the L1
    norm counts the chunks, exact in fp32 (the norm's dtype; under 2**24), so a chunk skipped or counted twice, even
    a tensor of 3 elements, changes it; the max norm finds the one 1000 (second launch); the L2 norm and the
    multiplication (bit for bit torch's product) on random values."""
    chunk = 4096 if dtype == torch.float32 else 8192
    ts = []
    for i, n in enumerate(MANY_CHUNKS):
        t = torch.zeros(n, device=DEV, dtype=dtype)
        t[::chunk] = 1 + i % 7
        t[-1:] = 1 + i % 7
        ts.append(t)
    want = sum(float(t.double().sum()) for t in ts)
    assert want < 2**24
    assert float(_norm(ops, ts, 1.0)) == want, "the L1 norm of the chunks' markers: a chunk missed or counted twice"
    ts[-3][-1] = 1000.0
    assert float(_norm(ops, ts, math.inf)) == 1000.0
    ts = _tensors(MANY_CHUNKS, dtype, seed=8)
    torch.testing.assert_close(_norm(ops, ts, 2.0).double(), _norm64(ts, 2.0), **TOLERANCES[torch.float32])
    c = torch.tensor(0.37, device=DEV)
    want = [(t.float() * c).to(dtype) for t in ts]
    ops.multi_tensor_mul_(ts, c)
    for i, (got, w) in enumerate(zip(ts, want)):
        assert torch.equal(got, w), f"tensors[{i}] ({got.numel()} elements) differs from torch's fp32 product"


@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("bad", ["nan", "inf", "both"])
def test_norm_propagates_nan_and_inf(ops, norm_type, bad):
    """nan wins over inf and over every number (the max norm too, where fmax would drop it), as in torch."""
    ts = _tensors([100, 9000, 5], torch.bfloat16, seed=3)
    if bad in ("nan", "both"):
        ts[1][8500] = float("nan")   # in the second chunk of its tensor
    if bad in ("inf", "both"):
        ts[2][4] = float("-inf")
    got = float(_norm(ops, ts, norm_type))
    want = float(_norm64(ts, norm_type))
    assert math.isnan(got) if bad != "inf" else got == math.inf
    assert math.isnan(want) == math.isnan(got)


def test_norm_of_empty_tensors_is_zero(ops):
    ts = [torch.empty(0, device=DEV, dtype=torch.bfloat16) for _ in range(3)]
    for norm_type in NORMS:
        got = _norm(ops, ts, norm_type)
        assert got.shape == () and float(got) == 0.0


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("coef", [0.37, 1e-3, 0.0, 2.5])
def test_mul_matches_torchs_fp32_product(ops, dtype, coef):
    """Each element becomes x * coef in fp32, rounded once: bit for bit what torch computes, and within the dtype's
    tolerance of float64."""
    ts = _tensors(SIZES, dtype, seed=4)
    ts[3], ts[10] = _at_offset(ts[3], 5), _at_offset(ts[10], 1)
    c = torch.tensor(coef, device=DEV)
    x0 = [t.clone() for t in ts]
    want = [(t.float() * c).to(dtype) for t in x0]
    ops.multi_tensor_mul_(ts, c)
    for i, (got, w, x) in enumerate(zip(ts, want, x0)):
        assert torch.equal(got, w), f"tensors[{i}] ({x.numel()} elements) differs from torch's fp32 product"
        torch.testing.assert_close(got.double(), x.double() * coef, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", ALL)
def test_mul_by_one_keeps_every_bit_and_by_nan_gives_nan(ops, dtype):
    ts = _tensors([7, 9000, 4096], dtype, seed=5)
    ts[1][3] = float("nan")
    ts[2][0] = float("-inf")
    ts[2][1] = -0.0
    bits = [t.view(torch.int16 if t.element_size() == 2 else torch.int32).clone() for t in ts]
    ops.multi_tensor_mul_(ts, torch.ones((), device=DEV))
    for t, b in zip(ts, bits):
        assert torch.equal(t.view(b.dtype), b)
    ops.multi_tensor_mul_(ts, torch.full((1,), float("nan"), device=DEV))
    assert all(t.isnan().all() for t in ts)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_64bit_offsets(ops, dtype):
    """One tensor of 2**31 + 4101 elements (4.3 GB): elements past 2**31 are counted and scaled, and right."""
    n = 2**31 + 4101
    gen = torch.Generator(device=DEV).manual_seed(6)
    t = torch.randn(n, device=DEV, dtype=dtype, generator=gen)
    t[n - 3] = 1000.0   # the max norm is past 2**31
    want = math.sqrt(sum(float(t[i:i + 2**28].double().square().sum()) for i in range(0, n, 2**28)))
    torch.testing.assert_close(float(_norm(ops, [t], 2.0)), want, **TOLERANCES[torch.float32])
    assert float(_norm(ops, [t], math.inf)) == 1000.0
    pieces = [slice(0, 5000), slice(2**31 - 3000, 2**31 + 3000), slice(n - 5000, n)]
    c = torch.tensor(0.25, device=DEV)
    want_pieces = [(t[s].float() * c).to(dtype) for s in pieces]
    ops.multi_tensor_mul_([t], c)
    for s, w in zip(pieces, want_pieces):
        assert torch.equal(t[s], w)


def test_refused_calls_name_the_argument_and_change_nothing(ops):
    ts = _tensors([10, 9000] + [37] * 1030, torch.float32, seed=7)
    before = [t.clone() for t in ts]
    one = torch.tensor(0.5, device=DEV)

    def refused(match, fn):
        with pytest.raises(RuntimeError, match=match):
            fn()
        assert all(torch.equal(a, b) for a, b in zip(ts, before)), "a refused call changed a tensor"

    # an empty list: the norm has no tensor argument left to dispatch on (the dispatcher's NotImplementedError says
    # so); the multiplication dispatches on coef and the kernel refuses it
    with pytest.raises(NotImplementedError, match="no tensor arguments"):
        ops.multi_tensor_norm([], 2.0)
    refused("pipegoose::multi_tensor_mul_: tensors must hold at least one tensor",
            lambda: ops.multi_tensor_mul_([], one))
    for fn in (lambda lst: ops.multi_tensor_norm(lst, 2.0), lambda lst: ops.multi_tensor_mul_(lst, one)):
        refused(r"tensors\[1031\] is Half but tensors\[0\] is Float", lambda: fn(ts[:-1] + [ts[-1].half()]))
        refused(r"tensors\[1031\] must be contiguous", lambda: fn(ts[:-1] + [torch.zeros(37, 2, device=DEV).t()[0]]))
        refused(r"tensors\[1031\] is on cpu", lambda: fn(ts[:-1] + [ts[-1].cpu()]))
        refused(r"tensors must be float32, float16 or bfloat16, got Double", lambda: fn([t.double() for t in ts]))
        refused(r"tensors\[1\] and tensors\[1032\] overlap in memory", lambda: fn(ts + [ts[1]]))
        refused(r"tensors\[1\] and tensors\[1032\] overlap", lambda: fn(ts + [ts[1][8999:]]))
        refused(r"tensors\[0\] and tensors\[1032\] overlap", lambda: fn(ts + [ts[0][2:5]]))   # inside another
    buf = torch.zeros(200, device=DEV)
    assert float(ops.multi_tensor_norm([buf[:100], buf[100:]], 2.0)) == 0.0   # adjacent views do not overlap
    for bad in (3.0, 0.0, -math.inf, math.nan):
        refused(r"norm_type must be 1, 2 or inf", lambda: ops.multi_tensor_norm(ts, bad))
    refused(r"coef must be a float32 tensor of one element, got Double with 1", lambda: ops.multi_tensor_mul_(
        ts, one.double()))
    refused(r"coef must be a float32 tensor of one element, got Float with 2", lambda: ops.multi_tensor_mul_(
        ts, torch.ones(2, device=DEV)))
    refused(r"coef is on cpu but tensors\[0\] is on cuda", lambda: ops.multi_tensor_mul_(ts, one.cpu()))
    refused(r"coef lies in tensors\[1\]", lambda: ops.multi_tensor_mul_(ts, ts[1][5:6]))

