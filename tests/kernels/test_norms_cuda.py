"""GPU tests of pipegoose's own LayerNorm / RMSNorm kernels (``pipegoose/kernels/csrc/{layer_norm,rms_norm}.cu``,
``norm_kernels.cuh``) through ``torch.ops.pipegoose.{layer_norm,rms_norm}_{forward,backward}``.

Every result is compared with a float64 reference computed from the same (already rounded) inputs, with the
per-dtype tolerances of ``tests/tolerances.py``; outputs are poisoned (NaN blocks left in the caching allocator)
before each kernel call, so an element the kernels fail to write shows up as NaN.

Run on a GPU machine: ``python -m pytest -m cuda tests/kernels/test_norms_cuda.py -q`` (builds both kernels on
first use; ``python -m pipegoose.kernels build pipegoose/layer_norm pipegoose/rms_norm`` first saves time).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernel_helpers import NORM_SPEC_EXTRA as SPEC_EXTRA
from kernel_helpers import NORM_SPEC_HIDDEN as SPEC_HIDDEN
from tolerances import TOLERANCES

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

DEV = "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-5
# The spec's hidden sizes plus two odd ones that take the scalar (non-vector) paths: 1531 stays in registers,
# 5003 takes the generic kernels. Together they reach every kernel variant (warp/sub-warp/multi-warp rows,
# register and shared-memory accumulators, generic) for fp32 and bf16.
HIDDEN = [1, 7, 32, 64, 96, 100, 128, 256, 448, 768, 1000, 1024, 1531, 2048, 4096, 5003, 5120, 8192, 10240, 12288,
          16384, 65536]
ROWS = [1, 3, 129, 16384]
MAX_CASE_ELEMENTS = 2**28  # the float64 reference of larger cases costs more than it tells
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ln():
    from pipegoose.kernels import load

    return load("pipegoose/layer_norm")


@pytest.fixture(scope="module")
def rms():
    from pipegoose.kernels import load

    return load("pipegoose/rms_norm")


# --------------------------------------------------------------------------------------------------- helpers
def poison(*like: tuple[tuple[int, ...], torch.dtype]) -> None:
    """Leave NaN-filled (0xFF bytes: NaN in fp32/fp16/bf16) blocks of the outputs' sizes in the caching
    allocator, so that an output element the kernel does not write reads back as NaN."""
    blocks = [torch.full((max(1, math.prod(s)) * torch.empty((), dtype=d).element_size(),), 0xFF,
                         dtype=torch.uint8, device=DEV) for s, d in like]
    torch.cuda.synchronize()
    del blocks


def check(name: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, reduction: bool = False,
          magnitude: float = 1.0):
    """assert_close against the float64 reference with TOLERANCES[dtype]. ``reduction``: a sum over rows, whose
    fp32 rounding error scales with the magnitude of the partial sums: atol is taken relative to max |expected|.
    ``magnitude``: the size of the terms the result is computed from, where it cancels (dx of a LayerNorm over
    one element is exactly 0 = rstd * (w*dy - mean(w*dy)), rounded at the scale of rstd * |w*dy|)."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    nan = int(torch.isnan(actual).sum())
    assert nan == 0, f"{name}: {nan} element(s) NaN (not written, or a NaN the reference does not have)"
    t = dict(TOLERANCES[dtype])
    if reduction:
        t["atol"] *= max(1.0, float(expected.abs().max()))
    t["atol"] *= max(1.0, magnitude)
    torch.testing.assert_close(actual.double(), expected.double(), **t, msg=lambda m: f"{name}: {m}")


def make(rows: int, h: int, dtype: torch.dtype, pdtype: torch.dtype | None, seed: int = 0, lead=()):
    g = torch.Generator(device=DEV).manual_seed(seed)
    shape = (*lead, rows, h) if lead else (rows, h)
    x = (torch.randn(shape, generator=g, device=DEV) * 2 + 0.5).to(dtype)  # offset: exercises the two-pass mean
    dy = torch.randn(shape, generator=g, device=DEV).to(dtype)
    w = b = None
    if pdtype is not None:
        w = (1 + 0.5 * torch.randn(h, generator=g, device=DEV)).to(pdtype)
        b = (0.5 * torch.randn(h, generator=g, device=DEV)).to(pdtype)
    return x, w, b, dy


def ref_layer_norm(x, w, b, dy, eps=EPS):
    """float64: y, mean, rstd, dx, dw, db (dw/db None when the parameter is None)."""
    h = x.shape[-1]
    x64 = x.detach().double().requires_grad_()
    w64 = None if w is None else w.detach().double().requires_grad_()
    b64 = None if b is None else b.detach().double().requires_grad_()
    y = F.layer_norm(x64, (h,), w64, b64, eps)
    y.backward(dy.double())
    with torch.no_grad():
        mean = x64.mean(-1).reshape(-1)
        rstd = (x64.var(-1, unbiased=False) + eps).rsqrt().reshape(-1)
    return (y.detach(), mean, rstd, x64.grad, None if w64 is None else w64.grad, None if b64 is None else b64.grad)


def ref_rms_norm(x, w, dy, eps=EPS):
    """float64: y, rstd, dx, dw (dw None without weight)."""
    x64 = x.detach().double().requires_grad_()
    w64 = None if w is None else w.detach().double().requires_grad_()
    rstd = (x64.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    y = x64 * rstd
    if w64 is not None:
        y = y * w64
    y.backward(dy.double())
    return y.detach(), rstd.detach().reshape(-1), x64.grad, None if w64 is None else w64.grad


def lower(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    order = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
    return a if order[a] >= order[b] else b


def run_layer_norm(ln, x, w, b, dy, out_dtype=None, eps=EPS):
    """Forward + backward through the ops, outputs poisoned first; returns the six results."""
    rows = x.numel() // x.shape[-1]
    ydt = out_dtype or x.dtype
    poison((x.shape, ydt), ((rows,), torch.float32), ((rows,), torch.float32))
    y, mean, rstd = ln.layer_norm_forward(x, w, b, eps, out_dtype)
    g = dy.to(ydt)
    poison((x.shape, x.dtype), *[(p.shape, p.dtype) for p in (w, b) if p is not None])
    dx, dw, db = ln.layer_norm_backward(g, x, w, b, mean, rstd)
    return y, mean, rstd, dx, dw, db


def run_rms_norm(rms, x, w, dy, out_dtype=None, eps=EPS):
    rows = x.numel() // x.shape[-1]
    ydt = out_dtype or x.dtype
    poison((x.shape, ydt), ((rows,), torch.float32))
    y, rstd = rms.rms_norm_forward(x, w, eps, out_dtype)
    g = dy.to(ydt)
    poison((x.shape, x.dtype), *[(p.shape, p.dtype) for p in (w,) if p is not None])
    dx, dw = rms.rms_norm_backward(g, x, w, rstd)
    return y, rstd, dx, dw


def cancel_scale(x, w, dy, rstd) -> float:
    """Over one element both norms' dx is exactly 0, a difference of terms of size rstd * |w * dy| that fp32 rounds
    at that scale; elsewhere 1 (the tolerance table applies as it is)."""
    if x.shape[-1] != 1:
        return 1.0
    wdy = dy.double().abs() * (w.double().abs() if w is not None else 1.0)
    return float((wdy.reshape(-1) * rstd.double().reshape(-1)).max())


def check_layer_norm(ln, x, w, b, dy, out_dtype=None, eps=EPS):
    y, mean, rstd, dx, dw, db = run_layer_norm(ln, x, w, b, dy, out_dtype, eps)
    ydt = out_dtype or x.dtype
    ry, rmean, rrstd, rdx, rdw, rdb = ref_layer_norm(x, w, b, dy.to(ydt), eps)
    assert y.dtype == ydt and dx.dtype == x.dtype
    assert mean.dtype == rstd.dtype == torch.float32
    ydt_check = lower(x.dtype, ydt) if ydt != torch.float32 else torch.float32
    shift = mean_rounding(ydt_check, rmean, rrstd, w)
    check("output", y, ry, ydt_check, magnitude=shift)
    check("mean", mean, rmean, torch.float32)
    check("rstd", rstd, rrstd, torch.float32)
    dx_dt = lower(x.dtype, ydt)
    check("grad_input", dx, rdx, dx_dt,
          magnitude=max(cancel_scale(x, w, dy, rrstd), mean_rounding(dx_dt, rmean, rrstd, w, dy, rrstd)))
    for name, p, got, want in (("grad_weight", w, dw, rdw), ("grad_bias", b, db, rdb)):
        if p is None:
            assert got.numel() == 0, f"{name}: expected an empty tensor without the parameter, got {got.shape}"
        else:
            assert got.dtype == p.dtype and got.shape == p.shape
            check(name, got, want, lower(x.dtype, p.dtype), reduction=True)


def check_rms_norm(rms, x, w, dy, out_dtype=None, eps=EPS):
    y, rstd, dx, dw = run_rms_norm(rms, x, w, dy, out_dtype, eps)
    ydt = out_dtype or x.dtype
    ry, rrstd, rdx, rdw = ref_rms_norm(x, w, dy.to(ydt), eps)
    assert y.dtype == ydt and dx.dtype == x.dtype and rstd.dtype == torch.float32
    check("output", y, ry, lower(x.dtype, ydt) if ydt != torch.float32 else torch.float32)
    check("rstd", rstd, rrstd, torch.float32)
    check("grad_input", dx, rdx, lower(x.dtype, ydt), magnitude=cancel_scale(x, w, dy, rrstd))
    if w is None:
        assert dw.numel() == 0
    else:
        assert dw.dtype == w.dtype and dw.shape == w.shape
        check("grad_weight", dw, rdw, lower(x.dtype, w.dtype), reduction=True)


MEAN_ULPS = 4  # fp32 ulps of |mean| a kernel's mean may be off: the rounding of fp32 sums over the row


def mean_rounding(dtype, rmean, rrstd, *factors) -> float:
    """``check``'s magnitude for a LayerNorm result computed from x - mean: no fp32 kernel holds the mean closer than
    its own rounding, MEAN_ULPS ulps of |mean| (the float64 reference's mean rounded to fp32 is already up to half an
    ulp off), an error that x - mean carries into the result scaled by rstd and ``factors`` (|w|, |dy|, rstd). Below
    1 (means of ordinary size, or 16-bit tolerances) it leaves the tolerance as it is; it matters for fp32 rows whose
    mean is far from their spread (mean 1000, spread 1: 2.4e-4 against fp32's atol of 1e-5)."""
    ulp = torch.finfo(torch.float32).eps * float(rmean.abs().max()) if rmean.numel() else 0.0
    scale = MEAN_ULPS * ulp * float(rrstd.max())
    for f in factors:
        if f is not None:
            scale *= float(f.double().abs().max())
    return scale / TOLERANCES[dtype]["atol"]


def check_dtype_cases(ln, rms, rows, h, cases, seed):
    """Both norms on rows x h for each (input dtype, parameter dtype, out_dtype) case; an out_dtype (autocast's
    fp32 output) makes grad_output fp32 too."""
    for dtype, pdtype, out_dtype in cases:
        x, w, b, dy = make(rows, h, dtype, pdtype, seed=seed)
        if out_dtype is not None:
            dy = dy.float()
        check_layer_norm(ln, x, w, b, dy, out_dtype=out_dtype)
        check_rms_norm(rms, x, w, dy, out_dtype=out_dtype)


def kernels_run(fn) -> str:
    """The names of the CUDA kernels that ``fn()`` launches (torch.profiler), one per line: which launch plan ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return "\n".join(sorted({e.key for e in prof.key_averages()}))


def split_forward_fits() -> bool:
    """Whether a block may have the 128 KB of shared memory of norm_fwd_split_kernel on this GPU (the kernels keep
    1 KB of the opt-in limit for static shared memory)."""
    return torch.cuda.get_device_properties(DEV).shared_memory_per_block_optin - 1024 >= 128 * 1024


# ----------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("pdtype", DTYPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("h", [1000, 1531])  # vector and scalar paths
def test_dtype_combinations(ln, rms, dtype, pdtype, h):
    x, w, b, dy = make(129, h, dtype, pdtype, seed=1)
    check_layer_norm(ln, x, w, b, dy)
    check_rms_norm(rms, x, w, dy)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("h", HIDDEN)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_shapes(ln, rms, dtype, h, rows):
    if rows * h > MAX_CASE_ELEMENTS:
        pytest.skip(f"{rows}x{h}: float64 reference too large; H={h} is covered with fewer rows")
    x, w, b, dy = make(rows, h, dtype, dtype, seed=h + rows)
    check_layer_norm(ln, x, w, b, dy)
    check_rms_norm(rms, x, w, dy)


@pytest.mark.parametrize("h", [64, 1000, 4096, 12288])
def test_fp32_params_with_half_input(ln, rms, h):
    """The Megatron "mixed" case: bf16 / fp16 activations, fp32 weights, at many rows."""
    for dtype in (torch.bfloat16, torch.float16):
        x, w, b, dy = make(4099, h, dtype, torch.float32, seed=h)
        check_layer_norm(ln, x, w, b, dy)
        check_rms_norm(rms, x, w, dy)


@pytest.mark.parametrize("h", [32, 64])
def test_forward_persistent_grid_many_rows(ln, rms, h):
    """16-bit LayerNorm rows of 32 and 64 columns run the forward on a persistent grid without prefetch (fwd_plan:
    128 and 64 rows per 256-thread block): 300007 rows are several times the rows the resident blocks hold, so each
    block walks rows past its first; RMSNorm's full grid on the same rows; fp16 and bf16, with parameters of the
    input's dtype and without."""
    for dtype in (torch.bfloat16, torch.float16):
        x, w, b, dy = make(300007, h, dtype, dtype, seed=h + 40)
        check_layer_norm(ln, x, w, b, dy)
        check_rms_norm(rms, x, w, dy)
        check_layer_norm(ln, x, None, None, dy)


@pytest.mark.parametrize("h", [7, 32, 64, 768, 4096, 16384])
def test_without_parameters(ln, rms, h):
    x, _, _, dy = make(129, h, torch.bfloat16, None, seed=3)
    check_layer_norm(ln, x, None, None, dy)
    check_rms_norm(rms, x, None, dy)


def test_weight_only_bias_only_and_mixed_parameter_dtypes(ln):
    x, w, b, dy = make(257, 1024, torch.bfloat16, torch.float32, seed=4)
    check_layer_norm(ln, x, w, None, dy)
    check_layer_norm(ln, x, None, b, dy)
    check_layer_norm(ln, x, w, b.to(torch.bfloat16), dy)  # grad_bias must come back in bf16
    check_layer_norm(ln, x, w.to(torch.float16), b, dy)  # a parameter dtype that is neither input's nor fp32
    # parameters of the input's dtype: the forward reads an absent one from its stand-ins (fwd_zero_stride)
    for h in (512, 1000, 4096):
        x, w, b, dy = make(257, h, torch.bfloat16, torch.bfloat16, seed=h)
        check_layer_norm(ln, x, w, None, dy)
        check_layer_norm(ln, x, None, b, dy)


@pytest.mark.parametrize("h", [100, 4096, 16384])
def test_out_dtype_float32_for_bf16_input(ln, rms, h):
    """Autocast: bf16 activations, fp32 output (and so an fp32 grad_output in the backward)."""
    x, w, b, dy = make(129, h, torch.bfloat16, torch.float32, seed=5)
    check_layer_norm(ln, x, w, b, dy, out_dtype=torch.float32)
    check_rms_norm(rms, x, w, dy, out_dtype=torch.float32)


@pytest.mark.parametrize("h", [1000, 4096, 8192, 16384])
def test_out_dtype_float32_many_rows(ln, rms, h):
    """Autocast with more rows than the persistent grid holds row groups: each row group walks over several rows,
    so the prefetched next row (x in bf16, grad_output in fp32) is carried over; rows not a multiple of the grid."""
    x, w, b, dy = make(4099, h, torch.bfloat16, torch.float32, seed=15)
    check_layer_norm(ln, x, w, b, dy, out_dtype=torch.float32)
    check_rms_norm(rms, x, w, dy, out_dtype=torch.float32)


SPEC_EXTRA_WIDTHS = sorted({h for by_op in SPEC_EXTRA.values() for widths in by_op.values() for h in widths})


@pytest.mark.parametrize("h", sorted(set(SPEC_HIDDEN) | set(SPEC_EXTRA_WIDTHS)))
def test_backward_specialised_sizes(ln, rms, h):
    """The backward kernels specialised to these sizes (BwdSpecHidden in norm_kernels.cuh, every dtype pair; and
    BwdSpecExtra, pairs of one dtype: 576-7168, SPEC_EXTRA), in every (input, grad_output, parameter) dtype
    combination, over more rows than the grid holds."""
    check_dtype_cases(ln, rms, 4099, h, ((torch.float16, torch.float16, None), (torch.bfloat16, torch.float32, None),
                                         (torch.bfloat16, torch.bfloat16, torch.float32),
                                         (torch.float16, torch.float32, torch.float32),
                                         (torch.float32, torch.float32, None)), seed=h + 1)
    # without parameters: the kernels that always read the weight from shared memory (BwdPcache16Ln, BwdPcache16Rms,
    # and in fp32 BwdPcache32Ln, BwdPcache32Rms) stage ones there
    for dt in (torch.bfloat16, torch.float32):
        x, _, _, dy = make(4099, h, dt, None, seed=h + 2)
        check_layer_norm(ln, x, None, None, dy)
        check_rms_norm(rms, x, None, dy)


@pytest.mark.parametrize("h", SPEC_EXTRA_WIDTHS)
def test_backward_specialisations_are_taken_where_listed(ln, rms, h):
    """Which backward ran: a kernel specialised to H (H among the template arguments of the norm_bwd kernel) for
    inputs and gradients of one dtype at SPEC_EXTRA's widths; none for a bf16 input with fp32 gradients and for the
    widths not listed (no gain or a loss in sessions 39-41's measurements: 16-bit LayerNorm 3584 and 6144; fp32
    LayerNorm 2560, 5120 and 7168; fp32 RMSNorm 896, 960, 1536, 2304 and 2560-6144)."""
    for dt, gdt in ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.bfloat16, torch.float32),
                    (torch.float32, torch.float32)):
        x, w, b, dy = make(64, h, dt, dt, seed=h)
        dy = dy.to(gdt)
        y, mean, rstd = ln.layer_norm_forward(x, w, b, EPS, None)
        _, rstd_r = rms.rms_norm_forward(x, w, EPS, None)
        for op, run in (("layer_norm", lambda: ln.layer_norm_backward(dy, x, w, b, mean, rstd)),
                        ("rms_norm", lambda: rms.rms_norm_backward(dy, x, w, rstd_r))):
            names = kernels_run(run)
            args = [a.split(", ") for a in re.findall(r"norm_bwd\w*kernel<([^<>]*)>", names)]
            assert len(args) == 1, (op, dt, gdt, names)  # one row kernel (and the column reduction)
            want = dt == gdt and h in SPEC_EXTRA[dt.itemsize * 8][op]
            assert (str(h) in args[0]) == want, (op, dt, gdt, names)


@pytest.mark.parametrize("rows,h", [(20000, 512), (4099, 3000), (4099, 5000), (4099, 6000), (4099, 8000), (2100, 9000),
                                    (2100, 12000)])
def test_async_copy_backward_many_rows(ln, rms, rows, h):
    """The register plan's asynchronous-copy backward (norm_bwd_async_kernel) on generic (not specialised) sizes,
    over several times more rows than the persistent grid holds row groups, so that each row group's ring of
    shared-memory stages wraps around and the rows past the end are zero-filled: 512 columns (eight rows per
    256-thread block, combined at the end), 3000 (bf16: 192 threads per row; fp32: 384, a 512-thread kernel), 5000
    (fp32 RMSNorm: four chunks per thread, 320 threads; fp32 LayerNorm: eight chunks with shared-memory column sums),
    6000 (bf16: 384 threads, 512-thread kernel; fp32: eight chunks with shared-memory column sums, 192 threads), 8000
    (fp32: four chunks per thread, 512 threads), 9000 (16-bit RMSNorm: four chunks per thread, 288 threads; 16-bit
    LayerNorm on sm_90: the cluster kernel), 12000 (16-bit rows on sm_90: the cluster kernel); with and without
    parameters."""
    check_dtype_cases(ln, rms, rows, h, ((torch.bfloat16, torch.bfloat16, None), (torch.float16, torch.float32, None),
                                         (torch.float32, torch.float32, None)), seed=h + 11)
    x, _, _, dy = make(rows, h, torch.bfloat16, None, seed=h + 12)
    check_layer_norm(ln, x, None, None, dy)
    check_rms_norm(rms, x, None, dy)


# Widths that take every threads-per-row size of the register plan's rows without a specialised kernel (two chunks
# per thread: round_tpr(ceil(H / (2 * VEC)))), 32, 64, ..., 512, in 16-bit (multiples of 8 from 264 to 8000 columns)
# and in fp32 (multiples of 4 from 200 to 3848), whichever tprc_mode in norm_kernels.cuh gives them (the kernel of
# run-time geometry, or one compiled for the threads per row, in blocks of 256 or 512, or packed into blocks of 512 or
# 1024 as pack_tpb says); 1500 and 3300 are scalar rows in 16-bit.
TPRC_WIDTHS = [200, 264, 392, 648, 1000, 1160, 1500, 1600, 1800, 2304, 2312, 2816, 3000, 3300, 3336, 3800, 3848, 4104,
               5000, 5400, 6000, 6400, 7000, 7600, 8000]


@pytest.mark.parametrize("h", TPRC_WIDTHS)
def test_backward_compiled_threads_per_row(ln, rms, h):
    """The asynchronous-copy backward of widths without a specialised kernel (most run a kernel compiled for their
    threads per row and rows per block, with H at run time): every threads-per-row size of 16-bit and fp32 rows, with
    16-bit and fp32 parameters and without parameters, over more rows than the persistent grid holds row groups (the
    rings of stages wrap around; rows past the end are zero-filled)."""
    check_dtype_cases(ln, rms, 4099, h, ((torch.bfloat16, torch.bfloat16, None), (torch.float16, torch.float32, None),
                                         (torch.float32, torch.float32, None)), seed=h + 21)
    x, _, _, dy = make(4099, h, torch.float16, None, seed=h + 22)
    check_layer_norm(ln, x, None, None, dy)
    check_rms_norm(rms, x, None, dy)


@pytest.mark.parametrize("h", [8704, 10240, 12288, 13000, 16384, 20000, 20008, 32768, 40008, 65536])
def test_wide_rows_backward(ln, rms, h):
    """Vector rows from 8200 columns (16-bit RMSNorm: 9224, so 8704 runs its four-chunk register plan, and without
    clusters 10240 the wide register rows, test_wide_register_rows_backward; fp32 RMSNorm: 16384; from 16392 past the
    register plans). With x and dy of one element size on sm_90 and newer: a thread block cluster per row
    (norm_bwd_cluster_kernel; the fewest blocks that hold the row: in 16-bit 2 at 8200-16384 columns, 3 at 20000 and
    20008, 4 at 32768, 5 at 40008, 8 at 65536; in fp32 2, 4 or 8: 2 at 8704-16384 (RMSNorm 16384 only), 4 at
    20000-32768, 8 at 40008 and 65536), 1029 rows,
    more than the clusters that fit the GPU times the stages, so that each cluster's ring of stages wraps and the rows
    past the end are zero-filled; 13000, 20000, 20008 and 40008 columns (1625, 2500, 2501 and 5001 chunks of 8) leave
    the blocks' slabs partial, and the last block's shorter than the others. Each block has as few threads as hold
    its slab (bf16 8704 columns: 288; 13000: 416, its last block's slab 812 chunks; 20000 and 20008: 448, the slabs
    834 chunks and the last 832 and 833; 40008: 512, the slabs 1001 chunks and the last 997). The
    blocks exchange their row sums through mbarriers (16-bit rows, and fp32 slabs that fill at most three quarters of
    a block: fp32 LayerNorm 8704, 10240 and 12288 columns, fp32 20000, 20008 and 40008) or the cluster barrier (the
    other fp32 rows; the fp16 case's fp32 grad_output takes no cluster). fp32 grad_output with a 16-bit input, and GPUs
    before sm_90: the register and shared-memory plans up to 16384 columns, past them the row-statistics kernel and
    column-slab kernel (norm_bwd_rowstats_kernel, norm_bwd_cols_kernel). Five rows: fewer rows than clusters. With and
    without parameters."""
    check_dtype_cases(ln, rms, 1029, h, ((torch.bfloat16, torch.bfloat16, None), (torch.float16, torch.float32, None),
                                         (torch.bfloat16, torch.float32, torch.float32),
                                         (torch.float32, torch.float32, None)), seed=h + 7)
    for dtype in DTYPES:
        x, _, _, dy = make(5, h, dtype, None, seed=h + 8)
        check_layer_norm(ln, x, None, None, dy)
        check_rms_norm(rms, x, None, dy)


@pytest.mark.parametrize("h", [9216, 9224, 10000, 10240, 11264, 11272])
def test_wide_register_rows_backward(ln, rms, h):
    """16-bit RMSNorm rows of 9224-11264 columns (x and dy of one element size): on sm_90 and newer the cluster kernel
    (since session 37; test_wide_register_rows_without_clusters runs the plan below there), elsewhere two chunks per
    thread in one block of up to 768 threads per row, four stages (bwd_plan's wide register rows in norm_kernels.cuh;
    9224 columns: 1153 chunks on 608 threads, 545 of them with a second chunk; 10000: 1250 on 640, 610 with two); 9216
    (the four-chunk register plan) and 11272 (the four-chunk register plan where no cluster runs) are their
    neighbours. 2100 rows: each block's ring of stages wraps and the rows past the end are zero-filled; with and
    without a weight, bf16 and fp16, fp32 parameters and fp32 grad_output; and which kernel ran
    (cluster_kernel_runs says where the cluster kernel runs)."""
    check_dtype_cases(ln, rms, 2100, h, ((torch.bfloat16, torch.bfloat16, None), (torch.float16, torch.float32, None),
                                         (torch.bfloat16, torch.float32, torch.float32)), seed=h + 31)
    for dtype in (torch.bfloat16, torch.float16):
        x, w, _, dy = make(5, h, dtype, dtype, seed=h + 32)
        check_rms_norm(rms, x, w, dy)
        check_rms_norm(rms, x, None, dy)
    x, w, _, dy = make(64, h, torch.bfloat16, torch.bfloat16, seed=h + 33)
    _, rstd = rms.rms_norm_forward(x, w, EPS, None)
    names = kernels_run(lambda: rms.rms_norm_backward(dy, x, w, rstd))
    wide = re.search(WIDE_REG_KERNEL, names) is not None
    if cluster_kernel_runs():
        assert not wide and ("norm_bwd_cluster_kernel" in names) == (h >= 9224), names
    else:
        assert "norm_bwd_cluster_kernel" not in names, names
        assert wide == (9224 <= h <= 11264 and _wide_register_rows_fit(h)), names


def smem_limit() -> int:
    """The dynamic shared memory per block that the norm kernels allow themselves here, in bytes: the GPU's opt-in
    limit less the 1 KB kept for static shared memory, or PIPEGOOSE_NORM_SMEM_LIMIT where that is lower."""
    limit = max(torch.cuda.get_device_properties(DEV).shared_memory_per_block_optin - 1024, 0)
    override = os.environ.get("PIPEGOOSE_NORM_SMEM_LIMIT", "")
    return min(limit, int(override)) if override else limit


def cluster_kernel_runs() -> bool:
    """Whether the backward's cluster kernel runs 16-bit rows here: sm_90 or newer, PIPEGOOSE_NORM_CLUSTERS not 0, and
    its six stages of 32 KB (x and dy of 512 threads x 16 values) within smem_limit()."""
    return (torch.cuda.get_device_capability(DEV)[0] >= 9 and os.environ.get("PIPEGOOSE_NORM_CLUSTERS", "") != "0"
            and smem_limit() >= 6 * 512 * 16 * 4)


def _wide_register_rows_fit(h: int) -> bool:
    """Whether this GPU's shared memory holds the wide register rows' four stages and weight cache at h columns."""
    tpr = math.ceil(h / 16 / 32) * 32
    return 4 * 2 * tpr * 8 * 4 + 4 * h <= smem_limit()


def test_wide_register_rows_without_clusters():
    """PIPEGOOSE_NORM_CLUSTERS=0 on a GPU with clusters: 16-bit RMSNorm rows of 9224-11264 columns take the wide
    register rows (test_wide_register_rows_backward's plan before sm_90) where their shared memory fits; 9216 and 11272
    do not."""
    if torch.cuda.get_device_capability(DEV)[0] < 9:
        pytest.skip("before sm_90 test_wide_register_rows_backward runs these rows without clusters")
    r = _run_with_env("PIPEGOOSE_NORM_CLUSTERS", "0", """
        for h in (9216, 9224, 10000, 11264, 11272):
            T.check_dtype_cases(ln, rms, 2100, h, ((torch.bfloat16, torch.bfloat16, None),
                                                   (torch.float16, torch.float32, None),
                                                   (torch.bfloat16, torch.float32, torch.float32)), seed=h + 34)
            x, w, _, dy = T.make(64, h, torch.float16, torch.float16, seed=h + 35)
            T.check_rms_norm(rms, x, w, dy)
            T.check_rms_norm(rms, x, None, dy)
            _, rstd = rms.rms_norm_forward(x, w, 1e-5, None)
            print("KERNELS", h, T.kernels_run(lambda: rms.rms_norm_backward(dy, x, w, rstd)).replace(chr(10), " "))
        print("WIDE-OK")
    """)
    assert r.returncode == 0 and "WIDE-OK" in r.stdout, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-4000:]}"
    for line in r.stdout.splitlines():
        if line.startswith("KERNELS"):
            h = int(line.split()[1])
            assert "norm_bwd_cluster_kernel" not in line, line
            wide = re.search(WIDE_REG_KERNEL, line) is not None
            assert wide == (9224 <= h <= 11264 and _wide_register_rows_fit(h)), line


# The kernel of the wide register rows (blocks of 768 threads, run-time geometry) in kernels_run's names.
WIDE_REG_KERNEL = r"norm_bwd_async_kernel<[^>]*, 768, 0>"


def test_wide_register_rows_fallback():
    """Where the wide register rows' stages and weight cache (200 KB at 10240 columns) do not fit
    (PIPEGOOSE_NORM_SMEM_LIMIT=198000) and no cluster runs (PIPEGOOSE_NORM_CLUSTERS=0: a GPU before sm_90, where these
    rows take the wide register rows), the row takes the four-chunk register plan; without a weight the wide rows fit
    (160 KB) and run."""
    if torch.cuda.get_device_properties(DEV).shared_memory_per_block_optin - 1024 < 198000:
        pytest.skip("the GPU's shared memory per block is below the emulated 198000 bytes")
    r = _run_with_env("PIPEGOOSE_NORM_SMEM_LIMIT", "198000", extra={"PIPEGOOSE_NORM_CLUSTERS": "0"}, body="""
        cases = ((torch.bfloat16, torch.bfloat16, None), (torch.float16, torch.float32, None))
        T.check_dtype_cases(ln, rms, 601, 10240, cases, seed=5)
        x, w, _, dy = T.make(64, 10240, torch.bfloat16, torch.bfloat16, seed=6)
        for wt in (w, None):
            _, rstd = rms.rms_norm_forward(x, wt, 1e-5, None)
            names = T.kernels_run(lambda: rms.rms_norm_backward(dy, x, wt, rstd))
            print("KERNELS", wt is None, names.replace(chr(10), " "))
            T.check_rms_norm(rms, x, wt, dy)
        print("FALLBACK-OK")
    """)
    assert r.returncode == 0 and "FALLBACK-OK" in r.stdout, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-4000:]}"
    with_w = next(line for line in r.stdout.splitlines() if line.startswith("KERNELS False"))
    without_w = next(line for line in r.stdout.splitlines() if line.startswith("KERNELS True"))
    assert re.search(WIDE_REG_KERNEL, with_w) is None and "norm_bwd_cluster_kernel" not in with_w, with_w
    assert re.search(WIDE_REG_KERNEL, without_w) is not None, without_w


# Rows of one 1024-thread block per SM (fp32 31745-32768 columns, 16-bit 63489-65536): the LayerNorm forward stages
# the parameters through shared memory (fwd_param_stages in norm_kernels.cuh); 32000 and 64000 leave the last stride
# of chunks partial. A GPU with less shared memory than the stages takes the forward kernel without staging.
ONE_BLOCK_ROWS = ((torch.float32, 32000), (torch.float32, 32768), (torch.bfloat16, 64000), (torch.bfloat16, 65536),
                  (torch.float16, 65536))


@pytest.mark.parametrize("dtype,h", ONE_BLOCK_ROWS, ids=lambda v: str(v))
def test_rows_of_one_block_per_sm(ln, rms, dtype, h):
    """Every parameter dtype the kernels read (the input's, fp32, and fp32 output of a 16-bit input), absent
    parameters (read from the kernel's stand-ins of ones and zeros), a weight or a bias alone."""
    cases = [(dtype, dtype, None), (dtype, torch.float32, None)]
    if dtype != torch.float32:
        cases.append((dtype, torch.float32, torch.float32))
    check_dtype_cases(ln, rms, 37, h, cases, seed=h + 7)
    x, w, b, dy = make(9, h, dtype, dtype, seed=h + 8)
    check_layer_norm(ln, x, None, None, dy)
    check_layer_norm(ln, x, w, None, dy)
    check_layer_norm(ln, x, None, b, dy)
    check_rms_norm(rms, x, None, dy)


@pytest.mark.parametrize("h", [40000, 57344, 57348, 65536, 65544])
def test_wide_rows_forward(ln, rms, h):
    """Vector rows wider than the forward's register plans (fp32 from 32772 columns, 16-bit from 65544). fp32 rows of
    40000-65536 columns: the first 32768 values of each row in registers, the rest in shared memory
    (norm_fwd_split_kernel; at 40000 and 57348 the shared-memory part is partial; LayerNorm from 57348 columns, the
    first width past 57344, on a grid of one block per SM, which walks rows in the 300-row cases, each block loading
    its next row while it writes one), with and without each parameter, with fp32 parameters and bf16 ones (which the
    op converts to fp32 for an fp32 input). 65544 columns: the two-pass kernel with one-pass statistics
    (norm_fwd_wide_kernel), whose grid (one block per SM) is smaller than 300 rows, so blocks walk several rows; it
    also takes the fp32 rows on a GPU with less shared memory (test_plans_of_smaller_shared_memory). The dtype pairings
    of these widths (a 16-bit input below 65544 columns runs a register plan, or the scalar path where the width is no
    multiple of 8), rows whose mean is far from their spread (where merging moments could cancel), and which kernel
    ran."""
    cases = [(torch.float32, torch.float32, None), (torch.bfloat16, torch.float32, torch.float32)]
    if h <= 65536:
        cases += [(torch.float32, torch.bfloat16, None)]  # 16-bit parameters of an fp32 input (converted to fp32)
    if h % 8 == 0 and h > 65536:
        cases += [(torch.bfloat16, torch.bfloat16, None), (torch.float16, torch.float16, None)]
    check_dtype_cases(ln, rms, 300, h, cases, seed=h + 3)
    x, w, b, dy = make(5, h, torch.float32, torch.float32, seed=h + 4)
    check_layer_norm(ln, x, None, None, dy)
    check_layer_norm(ln, x, w, None, dy)
    check_layer_norm(ln, x, None, b, dy)
    check_rms_norm(rms, x, None, dy)
    # the plan that ran: the split kernel for fp32 rows up to 65536 columns (where a block may have its 128 KB of shared
    # memory), the two-read kernel past them
    names = kernels_run(lambda: (ln.layer_norm_forward(x, w, b, EPS, None), rms.rms_norm_forward(x, w, EPS, None)))
    split = h <= 65536 and split_forward_fits()
    assert ("norm_fwd_split_kernel" in names) == split and ("norm_fwd_wide_kernel" in names) != split, names
    # LayerNorm rows over 57344 columns: the form that walks rows, a block per SM (the last template argument, PF)
    pf = re.findall(r"norm_fwd_split_kernel<float, float, (?:false|0), 8, (true|false|1|0)>", names)
    assert [v in ("true", "1") for v in pf] == ([h > 57344] if split else []), names
    # RMSNorm: a block per row at every split width
    rms_pf = re.findall(r"norm_fwd_split_kernel<float, float, (?:true|1), 8, (true|false|1|0)>", names)
    assert [v in ("true", "1") for v in rms_pf] == ([False] if split else []), names
    g = torch.Generator(device=DEV).manual_seed(h)
    x = (1000.0 + torch.randn(8, h, generator=g, device=DEV)).float()
    x[4:, 0] = 5000.0
    _, w, b, dy = make(8, h, torch.float32, torch.float32, seed=h + 5)
    check_layer_norm(ln, x, w, b, dy)
    y, mean, _ = ln.layer_norm_forward(x, w, b, EPS, None)
    # in units of fp32 eps * 1000 (1000 < 1024: two ulps of the mean); the delta-form merges stay within one
    err = ((mean.double() - x.double().mean(-1)).abs() / (torch.finfo(torch.float32).eps * 1000.0)).max()
    assert err <= 1.0, f"mean: off by {float(err):.2f} x eps * 1000 on rows of mean 1000 (expected <= 1)"


def test_other_out_dtype(ln, rms):
    """An out_dtype that is neither the input's nor fp32 is rounded from fp32 (documented fallback)."""
    x, w, b, dy = make(33, 768, torch.bfloat16, torch.bfloat16, seed=6)
    check_layer_norm(ln, x, w, b, dy, out_dtype=torch.float16)
    x32, w32, _, dy32 = make(33, 768, torch.float32, torch.float32, seed=6)
    check_rms_norm(rms, x32, w32, dy32, out_dtype=torch.bfloat16)


def test_leading_dimensions(ln, rms):
    x, w, b, dy = make(37, 640, torch.float16, torch.float16, seed=7, lead=(3, 2))
    check_layer_norm(ln, x, w, b, dy)
    check_rms_norm(rms, x, w, dy)
    y, mean, _ = ln.layer_norm_forward(x, w, b, EPS, None)
    assert y.shape == x.shape and mean.shape == (3 * 2 * 37,)


@pytest.mark.parametrize("h", [1, 768, 4096, 16384])
def test_constant_rows(ln, rms, h):
    """var = 0: rstd = rsqrt(eps), xhat = 0, no NaN; RMSNorm also gets all-zero rows."""
    g = torch.Generator(device=DEV).manual_seed(8)
    c = torch.randn(65, 1, generator=g, device=DEV)
    x = c.expand(65, h).contiguous().to(torch.bfloat16)
    _, w, b, dy = make(65, h, torch.bfloat16, torch.bfloat16, seed=8)
    out = run_layer_norm(ln, x, w, b, dy)
    for name, t in zip(("output", "mean", "rstd", "grad_input", "grad_weight", "grad_bias"), out):
        assert torch.isfinite(t).all(), f"{name}: non-finite values for constant rows"
    check_layer_norm(ln, x, w, b, dy)
    x0 = torch.zeros(65, h, device=DEV, dtype=torch.bfloat16)
    x0[::2] = x[::2]
    check_rms_norm(rms, x0, w, dy)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("h", [1000, 1531, 4096, 16384, 32768, 65536])
def test_layer_norm_statistics_far_from_zero(ln, dtype, h):
    """Rows whose mean is far from zero against their spread (in bf16 at 10^4 the rows are nearly constant: one value
    and a rare neighbour 64 apart), and rows with an outlier column among the first eight: mean, rstd and the output
    must stay at the tolerances of the float64 reference. Formulations that cancel large terms fail here, as two tried
    in session 7 did: one-pass moments shifted by the mean of the first eight columns (rstd off by 3e-4 at 65536
    columns in fp16), and xhat = x * rstd - mean * rstd in one FMA (output off by 0.3 on the nearly constant bf16
    rows, where rstd ~ 1 / sqrt(eps)). In fp32 the tolerance allows the mean's own rounding (mean_rounding)."""
    g = torch.Generator(device=DEV).manual_seed(12)
    offset = 1000.0 if dtype != torch.bfloat16 else 10000.0
    x = (offset + 4 * torch.randn(64, h, generator=g, device=DEV)).to(dtype)
    x[32:] = (50 + torch.randn(32, h, generator=g, device=DEV)).to(dtype)
    x[32:, 0] = 2000.0
    x[48:, 0] = 50.0
    x[48:, 5] = 1000.0
    _, w, b, dy = make(64, h, dtype, dtype, seed=12)
    check_layer_norm(ln, x, w, b, dy)


def _run_with_env(name: str, value: str, body: str, extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs ``body`` (with ``ln``, ``rms``, ``torch`` and this module as ``T`` in scope) in a fresh process with the
    environment variable ``name`` set to ``value`` (and those of ``extra``): the kernels read their variables once per
    process."""
    code = "import sys\nsys.path[:0] = ['tests', 'tests/kernels']\nimport torch\nimport test_norms_cuda as T\n" \
           "from pipegoose.kernels import load\nln, rms = load('pipegoose/layer_norm'), load('pipegoose/rms_norm')\n" \
           + textwrap.dedent(body)
    env = dict(os.environ, **{name: value}, **(extra or {}))
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def _run_with_smem_limit(limit: str, body: str) -> subprocess.CompletedProcess:
    return _run_with_env("PIPEGOOSE_NORM_SMEM_LIMIT", limit, body)


@pytest.mark.parametrize("limit", [100352, 0])
def test_plans_of_smaller_shared_memory(limit):
    """PIPEGOOSE_NORM_SMEM_LIMIT emulates a GPU with less shared memory: 100352 bytes is sm_86/sm_89's 99 KB less the
    1 KB kept for static shared memory, where the four-chunk register plan (fp32 8192 columns; 16-bit RMSNorm 12000 and
    16384 where the cluster kernel does not fit either; fp32 6000 runs the eight-chunk shared-memory plan, which fits)
    must take the shared-memory accumulator plan it replaced, and 16-bit RMSNorm's wide register rows (10240 columns:
    four stages and the weight cache, 200 KB) the four-chunk register plan (the forward's rows of one block per
    SM, ONE_BLOCK_ROWS, still stage their parameters in 96 KB there, while the backward's wide rows, whose cluster
    stages take 192 KB, run the plans they had before clusters); 0 leaves every plan that needs dynamic shared
    memory to the generic kernel, the wide rows' backward to the two-kernel path, and those forward rows to the
    kernel without staged parameters. At both, the forward of fp32 rows past the register plans (40000 and 65536
    columns) takes the two-read kernel instead of the split one (128 KB of shared memory; checked by the kernels that
    ran). All stay at the float64 reference's tolerances."""
    r = _run_with_smem_limit(str(limit), """
        cases = ((torch.bfloat16, torch.bfloat16, None), (torch.float16, torch.float32, None),
                 (torch.float32, torch.float32, None))
        for rows, h in ((3, 6000), (37, 8192), (37, 10240), (37, 12000), (37, 16384), (37, 32768), (2100, 4096),
                        (5, 512)):
            T.check_dtype_cases(ln, rms, rows, h, cases, seed=h)
        for dtype, h in T.ONE_BLOCK_ROWS:  # the forward without staged parameters
            T.check_dtype_cases(ln, rms, 5, h, ((dtype, dtype, None), (dtype, torch.float32, None)), seed=h)
        for h in (40000, 65536):  # fp32 rows past the register plans: the two-read kernel instead of the split one
            T.check_dtype_cases(ln, rms, 7, h, ((torch.float32, torch.float32, None),), seed=h)
        x = torch.randn(3, 40000, device="cuda")
        names = T.kernels_run(lambda: ln.layer_norm_forward(x, None, None, 1e-5, None))
        assert "norm_fwd_split_kernel" not in names and "norm_fwd_wide_kernel" in names, names
        x = torch.randn(37, 10240, device="cuda", dtype=torch.bfloat16)  # not the wide register rows' 768 threads
        _, rstd = rms.rms_norm_forward(x, x[0], 1e-5, None)
        names = T.kernels_run(lambda: rms.rms_norm_backward(torch.randn_like(x), x, x[0], rstd))
        assert T.re.search(T.WIDE_REG_KERNEL, names) is None, names
        print("SMEM-OK")
    """)
    assert r.returncode == 0 and "SMEM-OK" in r.stdout, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-4000:]}"


@pytest.mark.parametrize("dtype,h,limit,want", [
    ("bfloat16", 5120, 130000, "GENERIC"), ("bfloat16", 5120, 143360, "SPEC"),
    ("float32", 1280, 125000, "GENERIC"), ("float32", 1280, 128000, "SPEC")])
def test_weight_cache_that_does_not_fit_takes_the_generic_backward(dtype, h, limit, want):
    """LayerNorm at these widths runs a kernel that always reads the weight from shared memory (bf16 5120:
    BwdPcache16Ln, 122880 bytes of stages (2 stages x 3 rows of 320 threads x 2 chunks x 8 values x 4 bytes) and 20480
    of weight cache; fp32 1280: BwdPcache32Ln, 122880 bytes of stages (2 x 6 rows of 160 threads x 2 x 4 values x 8
    bytes) and 5120 of cache). Under a limit where the stages fit and the cache does not, the generic kernel runs,
    never that kernel without its cache; where both fit, the specialised one. Both at the float64 reference's
    tolerances."""
    r = _run_with_smem_limit(str(limit), f"""
        x, w, b, dy = T.make(4099, {h}, torch.{dtype}, torch.{dtype}, seed=5)
        T.check_layer_norm(ln, x, w, b, dy)
        T.check_layer_norm(ln, x, None, None, dy)
        _, mean, rstd = ln.layer_norm_forward(x, w, b, 1e-5, None)
        names = T.kernels_run(lambda: ln.layer_norm_backward(dy, x, w, b, mean, rstd))
        bwd = [n for n in names.splitlines() if "norm_bwd" in n]
        print("GENERIC" if any("norm_bwd_generic_kernel" in n for n in bwd) else
              "SPEC" if any(", {h}, " in n for n in bwd) else f"OTHER {{bwd}}")
    """)
    assert r.returncode == 0 and r.stdout.split()[-1:] == [want], \
        f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-4000:]}"


def test_plans_without_clusters():
    """PIPEGOOSE_NORM_CLUSTERS=0 gives the backward plans of a GPU without thread block clusters (before sm_90) on one
    that has them: the wide rows take the register and shared-memory plans up to 16384 columns, past them the
    row-statistics and column-slab kernels, instead of norm_bwd_cluster_kernel, and the column reduction is an
    ordinary launch instead of a programmatic dependent one. Rows of test_wide_rows_backward's widths (x and dy of one
    element size: the rows the cluster kernel takes on sm_90; here 16-bit RMSNorm at 10240 takes the wide register
    rows), 37 and 1029 of them; and which kernels ran, with the variable and (on sm_90 and newer) without it."""
    body = """
        x = torch.randn(37, 20008, device="cuda", dtype=torch.bfloat16)
        _, rstd = rms.rms_norm_forward(x, None, 1e-5, None)
        print("KERNELS", T.kernels_run(lambda: rms.rms_norm_backward(torch.randn_like(x), x, None, rstd)))
    """
    r = _run_with_env("PIPEGOOSE_NORM_CLUSTERS", "0", body + """
        for rows, h in ((37, 10240), (37, 12288), (37, 13000), (37, 16384), (1029, 20008), (37, 32768), (37, 65536)):
            T.check_dtype_cases(ln, rms, rows, h, ((torch.bfloat16, torch.bfloat16, None),
                                                   (torch.float32, torch.float32, None)), seed=h)
        print("NO-CLUSTER-OK")
    """)
    assert r.returncode == 0 and "NO-CLUSTER-OK" in r.stdout, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-4000:]}"
    assert "norm_bwd_cluster_kernel" not in r.stdout and "norm_bwd_rowstats_kernel" in r.stdout, r.stdout
    if torch.cuda.get_device_capability(DEV)[0] >= 9:  # the control: the same call with clusters
        on = _run_with_env("PIPEGOOSE_NORM_CLUSTERS", "1", body)
        assert on.returncode == 0 and "norm_bwd_cluster_kernel" in on.stdout, f"{on.stdout}\n{on.stderr[-4000:]}"


@pytest.mark.parametrize("name,value,h,expect", [
    ("PIPEGOOSE_NORM_CLUSTERS", "off", 65536, "PIPEGOOSE_NORM_CLUSTERS: expected 0 or 1, got 'off'"),
    ("PIPEGOOSE_NORM_SMEM_LIMIT", "99KB", 1024,
     "PIPEGOOSE_NORM_SMEM_LIMIT: expected a number of bytes >= 0, got '99KB'"),
])
def test_bad_kernel_variable_is_an_error_naming_it(name, value, h, expect):
    """A malformed PIPEGOOSE_NORM_* variable is a RuntimeError naming it, raised by the first call that reads it (the
    backward of a row the cluster kernel would take reads PIPEGOOSE_NORM_CLUSTERS)."""
    r = _run_with_env(name, value, f"""
        x = torch.randn(4, {h}, device="cuda")
        _, rstd = rms.rms_norm_forward(x, None, 1e-5, None)
        try:
            rms.rms_norm_backward(torch.randn_like(x), x, None, rstd)
        except RuntimeError as e:
            print("ERROR:", e)
    """)
    assert r.returncode == 0, r.stderr[-4000:]
    assert expect in r.stdout, r.stdout


def test_non_contiguous_input(ln, rms):
    """Inputs with a strided last dim are made contiguous by the binding; a transposed view as well."""
    x, w, b, dy = make(96, 2048, torch.bfloat16, torch.bfloat16, seed=9)
    xs = x[:, ::2]
    dys = dy[:, ::2]
    check_layer_norm(ln, xs, w[:1024], b[:1024], dys)
    check_rms_norm(rms, xs, w[:1024], dys)
    xt = x[:, :96].t()  # [96, 96], last dim strided
    check_layer_norm(ln, xt, w[:96], b[:96], dy[:96, :96])
    check_rms_norm(rms, xt, w[:96], dy[:96, :96])


def test_misaligned_parameters_take_the_scalar_path(ln, rms):
    x, _, _, dy = make(129, 4096, torch.bfloat16, None, seed=10)
    base = torch.randn(4097, device=DEV, dtype=torch.bfloat16)
    w = base[1:]  # 2-byte offset: no 16-byte vector loads
    check_layer_norm(ln, x, w, None, dy)
    check_rms_norm(rms, x, w, dy)


def test_zero_rows(ln, rms):
    x = torch.empty(0, 256, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(256, device=DEV, dtype=torch.bfloat16)
    y, mean, rstd = ln.layer_norm_forward(x, w, w, EPS, None)
    assert y.shape == (0, 256) and mean.shape == (0,) and rstd.shape == (0,)
    dx, dw, db = ln.layer_norm_backward(x, x, w, w, mean, rstd)
    assert dx.shape == (0, 256) and (dw == 0).all() and (db == 0).all()
    y, rstd = rms.rms_norm_forward(x, w, EPS, None)
    dx, dw = rms.rms_norm_backward(x, x, w, rstd)
    assert dx.shape == (0, 256) and (dw == 0).all()


def test_backward_is_deterministic(ln, rms):
    x, w, b, dy = make(16384, 4096, torch.bfloat16, torch.bfloat16, seed=11)
    _, mean, rstd = ln.layer_norm_forward(x, w, b, EPS, None)
    first = ln.layer_norm_backward(dy, x, w, b, mean, rstd)
    second = ln.layer_norm_backward(dy, x, w, b, mean, rstd)
    for a, c in zip(first, second):
        assert torch.equal(a, c)
    _, rstd = rms.rms_norm_forward(x, w, EPS, None)
    assert all(torch.equal(a, c) for a, c in zip(rms.rms_norm_backward(dy, x, w, rstd),
                                                   rms.rms_norm_backward(dy, x, w, rstd)))


@pytest.mark.parametrize("h", [64, 768, 4096, 8192, 20008, 65536])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32], ids=str)
def test_frozen_parameters_skip_their_gradients(ln, rms, h, dt):
    """weight_grad / bias_grad False (what the autograd formula passes for a frozen parameter): the gradient is not
    computed (an empty [0] tensor, no column-reduction launch) and dx is bit for bit that of the full backward, over
    every backward plan (register, asynchronous copy, cluster, wide rows); the other parameter's gradient too."""
    x, w, b, dy = make(1029 if h <= 8192 else 37, h, dt, dt, seed=h)
    _, mean, rstd = ln.layer_norm_forward(x, w, b, EPS, None)
    full = ln.layer_norm_backward(dy, x, w, b, mean, rstd)
    for wg, bg in ((False, False), (True, False), (False, True)):
        poison((x.shape, x.dtype))
        dx, dw, db = ln.layer_norm_backward(dy, x, w, b, mean, rstd, wg, bg)
        assert torch.equal(dx, full[0])
        assert torch.equal(dw, full[1]) if wg else dw.shape == (0,)
        assert torch.equal(db, full[2]) if bg else db.shape == (0,)
    _, rstd = rms.rms_norm_forward(x, w, EPS, None)
    full = rms.rms_norm_backward(dy, x, w, rstd)
    poison((x.shape, x.dtype))
    dx, dw = rms.rms_norm_backward(dy, x, w, rstd, False)
    assert torch.equal(dx, full[0]) and dw.shape == (0,)
    ran = kernels_run(lambda: ln.layer_norm_backward(dy, x, w, b, mean, rstd, False, False))
    assert "col_reduce" not in ran, ran
    assert "col_reduce" in kernels_run(lambda: ln.layer_norm_backward(dy, x, w, b, mean, rstd)), "control"


def test_int64_indexing(ln, rms):
    """More than 2^31 elements (bf16 [2^31/8192 + 3, 8192]): rows past the 2^31-th element, all statistics and the
    parameter gradients (a float64 reference computed in chunks)."""
    h = 8192
    rows = 2**31 // h + 3
    assert rows * h > 2**31
    g = torch.Generator(device=DEV).manual_seed(12)
    x = torch.randn(rows, h, generator=g, device=DEV, dtype=torch.bfloat16)
    dy = torch.randn(rows, h, generator=g, device=DEV, dtype=torch.bfloat16)
    w = (1 + 0.5 * torch.randn(h, generator=g, device=DEV)).to(torch.bfloat16)
    b = (0.5 * torch.randn(h, generator=g, device=DEV)).to(torch.bfloat16)
    picks = torch.tensor([0, 1, rows // 2, rows - 3, rows - 2, rows - 1], device=DEV)

    y, mean, rstd, dx, dw, db = run_layer_norm(ln, x, w, b, dy)
    ry, rmean, rrstd, rdx, _, _ = ref_layer_norm(x[picks], w, b, dy[picks])
    check("output[picked rows]", y[picks], ry, torch.bfloat16)
    check("grad_input[picked rows]", dx[picks], rdx, torch.bfloat16)
    assert not torch.isnan(y).any() and not torch.isnan(dx).any()
    del y, dx
    ref_dw = torch.zeros(h, dtype=torch.float64, device=DEV)
    ref_db = torch.zeros(h, dtype=torch.float64, device=DEV)
    for s in range(0, rows, 8192):
        xc, dyc = x[s:s + 8192].double(), dy[s:s + 8192].double()
        m = xc.mean(-1, keepdim=True)
        r = (xc.var(-1, unbiased=False, keepdim=True) + EPS).rsqrt()
        check(f"mean[{s}:]", mean[s:s + 8192], m.reshape(-1), torch.float32)
        check(f"rstd[{s}:]", rstd[s:s + 8192], r.reshape(-1), torch.float32)
        ref_dw += (dyc * (xc - m) * r).sum(0)
        ref_db += dyc.sum(0)
    check("grad_weight", dw, ref_dw, torch.bfloat16, reduction=True)
    check("grad_bias", db, ref_db, torch.bfloat16, reduction=True)
    del mean, rstd

    y, rstd, dx, dw = run_rms_norm(rms, x, w, dy)
    ry, rrstd, rdx, _ = ref_rms_norm(x[picks], w, dy[picks])
    check("rms output[picked rows]", y[picks], ry, torch.bfloat16)
    check("rms rstd[picked rows]", rstd[picks], rrstd, torch.float32)
    check("rms grad_input[picked rows]", dx[picks], rdx, torch.bfloat16)
    assert not torch.isnan(y).any() and not torch.isnan(dx).any()
    del y, dx
    ref_dw.zero_()
    for s in range(0, rows, 8192):
        xc, dyc = x[s:s + 8192].double(), dy[s:s + 8192].double()
        ref_dw += (dyc * xc * (xc.pow(2).mean(-1, keepdim=True) + EPS).rsqrt()).sum(0)
    check("rms grad_weight", dw, ref_dw, torch.bfloat16, reduction=True)


def test_opcheck(ln, rms):
    x, w, b, dy = make(6, 64, torch.bfloat16, torch.float32, seed=13, lead=(2,))
    _, mean, rstd = ln.layer_norm_forward(x, w, b, EPS, None)
    torch.library.opcheck(torch.ops.pipegoose.layer_norm_forward.default, (x, w, b, EPS, None))
    torch.library.opcheck(torch.ops.pipegoose.layer_norm_forward.default, (x, None, None, EPS, torch.float32))
    torch.library.opcheck(torch.ops.pipegoose.layer_norm_backward.default, (dy, x, w, b, mean, rstd))
    torch.library.opcheck(torch.ops.pipegoose.layer_norm_backward.default, (dy, x, None, None, mean, rstd))
    _, rstd = rms.rms_norm_forward(x, w, EPS, None)
    torch.library.opcheck(torch.ops.pipegoose.rms_norm_forward.default, (x, w, EPS, None))
    torch.library.opcheck(torch.ops.pipegoose.rms_norm_backward.default, (dy, x, w, rstd))
    torch.library.opcheck(torch.ops.pipegoose.rms_norm_backward.default, (dy, x, None, rstd))
    # the ops with their autograd formula (C++ Functions), with inputs that need gradients
    xg, wg, bg = (t.detach().requires_grad_(True) for t in (x, w, b))
    torch.library.opcheck(torch.ops.pipegoose.layer_norm.default, (xg, wg, bg, EPS, torch.bfloat16))
    torch.library.opcheck(torch.ops.pipegoose.layer_norm.default, (xg, None, bg, EPS, None))
    torch.library.opcheck(torch.ops.pipegoose.layer_norm.default, (xg, None, None, EPS, torch.float32))
    torch.library.opcheck(torch.ops.pipegoose.rms_norm.default, (xg, wg, EPS, torch.bfloat16))
    torch.library.opcheck(torch.ops.pipegoose.rms_norm.default, (xg, None, EPS, None))


def test_bad_arguments_name_the_argument(ln, rms):
    x, w, b, dy = make(8, 64, torch.float16, torch.float16, seed=14)
    _, mean, rstd = ln.layer_norm_forward(x, w, b, EPS, None)
    cases = [
        (lambda: ln.layer_norm_forward(x, w[:63], b, EPS, None), "weight: expected H = 64"),
        (lambda: ln.layer_norm_forward(x, w, b[:2], EPS, None), "bias: expected H = 64"),
        (lambda: ln.layer_norm_forward(x, w, b, -1.0, None), "eps: expected"),
        (lambda: ln.layer_norm_forward(x, w, b, EPS, torch.int32), "out_dtype: expected"),
        (lambda: ln.layer_norm_forward(x.int(), w, b, EPS, None), "input: expected dtype"),
        (lambda: ln.layer_norm_forward(x, w.cpu(), b, EPS, None), "weight: expected a CUDA tensor"),
        (lambda: ln.layer_norm_backward(dy[:4], x, w, b, mean, rstd), "grad_output: expected the input's shape"),
        (lambda: ln.layer_norm_backward(dy, x, w, b, mean[:4], rstd), "mean: expected 8 elements"),
        (lambda: ln.layer_norm_backward(dy, x, w, b, mean, rstd.half()), "rstd: expected dtype float32"),
        (lambda: rms.rms_norm_forward(x, w[:3], EPS, None), "weight: expected H = 64"),
        (lambda: rms.rms_norm_backward(dy, x, w, rstd[:1]), "rstd: expected 8 elements"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()
