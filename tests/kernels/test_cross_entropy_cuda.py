"""GPU: pipegoose's softmax cross-entropy (``pipegoose/kernels/csrc/cross_entropy.cu``) through
``torch.ops.pipegoose.cross_entropy_forward`` / ``cross_entropy_backward`` / ``cross_entropy_backward_`` and the
functional ``pipegoose.nn.fusion.cross_entropy``.

Every result is compared with a float64 reference computed on the CPU from the same (already rounded) logits:
``lse = logsumexp(x)``, ``loss = lse - x[target]``, ``grad = (softmax(x) - onehot(target)) * grad_loss``, with the
kernel's conventions (a row whose target is ``ignore_index``: loss 0, lse 0, gradient 0; a target outside [0, V) that
is not ``ignore_index``: loss NaN and a NaN gradient row, the other rows unaffected). The loss and lse are computed in
fp32 from exactly representable inputs, so they are checked with the fp32 tolerances of ``tests/tolerances.py``;
the gradient, computed in fp32 and rounded once, with the logits' dtype's. Outputs are poisoned before each kernel
call (0xFF blocks, NaN in every float dtype, left in the caching allocator), so an element the kernel does not write
reads back as NaN: ignored rows must be written as exact zeros.

Run on a GPU machine: ``python -m pytest -m cuda tests/kernels/test_cross_entropy_cuda.py -q`` (the first use builds
the kernel; ``python -m pipegoose.kernels build pipegoose/cross_entropy`` first saves time).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tolerances import FP32_FLOAT64_SUM, FP32_SAME_CODE, TOLERANCES, tol

pytestmark = pytest.mark.cuda

DEV = "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DT_IDS = ["fp32", "fp16", "bf16"]
# one class; two; odd and even small widths around one 16-byte vector of 16-bit values (8) and of fp32 (4); a
# vocabulary of thousands; Llama's, GPT-2's (odd: in 16-bit every row after the first starts misaligned) and Qwen's
VOCABS = [1, 2, 7, 8, 9, 1000, 32000, 50257, 151936]
ROWS = [1, 3, 257]
# the loss and lse: fp32 math on exactly representable inputs
LOSS_TOL = TOLERANCES[torch.float32]


@pytest.fixture(scope="module")
def ops():
    from pipegoose.kernels import load

    return load("pipegoose/cross_entropy")


@pytest.fixture
def dispatch(no_tuning_table):
    """The dispatcher with the GPU's measured choices set aside (the kernel is the built-in choice), its counters
    reset."""
    from pipegoose.nn.fusion import dispatch as d

    d.reset_stats()
    yield d
    d.reset_stats()


@pytest.fixture(params=[False, True], ids=["reduced-by-torch", "reduced-in-kernel"])
def reduce_in_kernel(request, monkeypatch):
    """Both routes of the functional's mean and sum: PyTorch's reductions over the per-row op, and
    cross_entropy_forward_reduced (``REDUCE_IN_KERNEL``)."""
    from pipegoose.nn.fusion.ops import cross_entropy as C

    monkeypatch.setattr(C, "REDUCE_IN_KERNEL", request.param)
    return request.param


# --------------------------------------------------------------------------------------------------- helpers
def poison(*nbytes: int) -> None:
    """Leave 0xFF-filled blocks (NaN in fp32/fp16/bf16) of the given sizes in the caching allocator, so that an
    output element the kernel does not write reads back as NaN. (benchmarks/ops.py's ``poison`` fills fp32 NaN,
    whose low half is a 16-bit zero: an unwritten zero of a 16-bit gradient would pass there.)"""
    blocks = [torch.full((max(1, n),), 0xFF, dtype=torch.uint8, device=DEV) for n in nbytes]
    if DEV == "cuda":
        torch.cuda.synchronize()
    del blocks


def logits_of(n: int, v: int, dtype: torch.dtype, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(n, v, device=DEV, generator=g) * scale).to(dtype)


def targets_of(n: int, v: int, seed: int = 0, ignore_index: int = -100, every: int = 4) -> torch.Tensor:
    """int64 [n] in [0, v); rows 1, 1 + every, ... set to ``ignore_index``."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, v, (n,), generator=g)
    t[1::every] = ignore_index
    return t.to(DEV)


def grad_loss_of(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, generator=g) + 0.5).to(DEV)


def ref64(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, grad_loss: torch.Tensor | None = None):
    """float64 on the CPU, with the kernel's conventions: (loss [N], lse [N]) and, given ``grad_loss``, the logits'
    gradient [N, V]."""
    x = logits.detach().cpu().double()
    t = target.detach().cpu()
    n, v = x.shape
    ignored = t == ignore_index
    valid = ~ignored & (t >= 0) & (t < v)
    lse = torch.logsumexp(x, 1)
    picked = x.gather(1, t.clamp(0, v - 1)[:, None])[:, 0]
    loss = torch.where(valid, lse - picked, math.nan).masked_fill(ignored, 0.0)
    lse_out = lse.masked_fill(ignored, 0.0)
    if grad_loss is None:
        return loss, lse_out
    grad = x.sub_(lse[:, None]).exp_()            # softmax (x is our copy)
    rows = valid.nonzero()[:, 0]
    grad[rows, t[rows]] -= 1.0
    grad.mul_(grad_loss.detach().cpu().double()[:, None])
    grad[ignored] = 0.0
    grad[~valid & ~ignored] = math.nan
    return loss, lse_out, grad


def check(got: torch.Tensor, want: torch.Tensor, what: str, **tolerances) -> None:
    torch.testing.assert_close(got.detach().cpu().double(), want, equal_nan=True, **tolerances,
                               msg=lambda m: f"{what}: {m}")


def run_op(ops, x, t, ignore_index, grad_loss):
    """Forward and backward of the ops, each output poisoned first; (loss, lse, grad)."""
    n, v = x.shape
    poison(4 * n, 4 * n)
    loss, lse = ops.cross_entropy_forward(x, t, ignore_index)
    poison(n * v * x.element_size())
    grad = ops.cross_entropy_backward(grad_loss, x, t, lse, ignore_index)
    return loss, lse, grad


def check_op(ops, x, t, ignore_index, grad_loss, what="", loss_tol=None, grad_tol=None):
    """run_op against ref64: values, dtypes, shapes; ignored rows exact zeros."""
    n, v = x.shape
    loss, lse, grad = run_op(ops, x, t, ignore_index, grad_loss)
    want_loss, want_lse, want_grad = ref64(x, t, ignore_index, grad_loss)
    assert loss.dtype == lse.dtype == torch.float32 and loss.shape == lse.shape == (n,), (loss.dtype, loss.shape)
    assert grad.dtype == x.dtype and grad.shape == (n, v) and grad.is_contiguous() and grad.device == x.device
    check(loss, want_loss, f"{what} loss", **(loss_tol or LOSS_TOL))
    check(lse, want_lse, f"{what} lse", **(loss_tol or LOSS_TOL))
    check(grad, want_grad, f"{what} grad", **(grad_tol or TOLERANCES[x.dtype]))
    ignored = (t == ignore_index).cpu()
    assert (loss.cpu()[ignored] == 0).all() and (lse.cpu()[ignored] == 0).all(), f"{what}: ignored rows"
    assert (grad.cpu()[ignored] == 0).all(), f"{what}: ignored rows' gradient must be written as zeros"
    return loss, lse, grad


# ------------------------------------------------------------------------------------------- the ops: values
@pytest.mark.parametrize("ignore_index", [-100, 5])
@pytest.mark.parametrize("n", ROWS)
@pytest.mark.parametrize("v", VOCABS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_ops_match_float64(ops, dtype, v, n, ignore_index):
    """Every vocabulary and row count, forward and backward, with ignored rows: the default ignore_index, and 5, a
    valid class (rows with target 5 are then ignored; where V <= 5 the rows set to 5 are out of range but ignored,
    which takes precedence)."""
    x = logits_of(n, v, dtype, seed=v + n)
    t = targets_of(n, v, seed=n, ignore_index=ignore_index)
    check_op(ops, x, t, ignore_index, grad_loss_of(n, seed=v), what=f"{dtype} [{n}, {v}]")


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_every_row_ignored(ops, dtype, dispatch, reduce_in_kernel):
    """Ops: loss 0, lse 0, gradient zeros (written). Functional: mean NaN (0 / 0, as PyTorch's), sum 0, gradients
    zero, as F.cross_entropy on the GPU."""
    n, v = 6, 1000
    x = logits_of(n, v, dtype, seed=1)
    t = torch.full((n,), -100, device=DEV)
    loss, lse, grad = run_op(ops, x, t, -100, grad_loss_of(n))
    assert torch.equal(loss, torch.zeros_like(loss)) and torch.equal(lse, torch.zeros_like(lse))
    assert torch.equal(grad, torch.zeros_like(grad))
    from pipegoose.nn.fusion import functional as PF

    for reduction in ("mean", "sum"):
        got, got_grad = fwd_bwd(PF.cross_entropy, x, t, reduction=reduction)
        want, want_grad = fwd_bwd(torch_upcast, x, t, reduction=reduction)
        assert dispatch.last_choice("cross_entropy").impl == "pipegoose"
        assert (torch.isnan(got) if reduction == "mean" else got.item() == 0), (reduction, got)
        assert torch.equal(got, want) or (torch.isnan(got) and torch.isnan(want))
        assert torch.equal(got_grad, torch.zeros_like(got_grad)) and torch.equal(got_grad, want_grad)


@pytest.mark.parametrize("ignore_index", [-100, 5])
@pytest.mark.parametrize("v", [7, 1000, 50257])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_out_of_range_targets_give_nan_rows(ops, dtype, v, ignore_index, dispatch):
    """A target outside [0, V) that is not ignore_index: that row's loss NaN and its whole gradient row NaN; every
    other row (ignored ones too) right. (PyTorch's kernel stops the process with a device-side assert there: it is
    not called with these targets.)"""
    n = 9
    x = logits_of(n, v, dtype, seed=2)
    t = targets_of(n, v, seed=3, ignore_index=ignore_index)
    t[[0, 2, 6]] = torch.tensor([v, -1, -100 if ignore_index != -100 else v + 1000], device=DEV)
    bad = torch.zeros(n, dtype=torch.bool)
    bad[[0, 2, 6]] = True
    loss, lse, grad = check_op(ops, x, t, ignore_index, grad_loss_of(n), what="out of range")
    assert torch.isnan(loss.cpu()[bad]).all() and not torch.isnan(loss.cpu()[~bad]).any()
    assert torch.isnan(grad.cpu()[bad]).all() and not torch.isnan(grad.cpu()[~bad]).any()
    assert torch.isfinite(lse).all()
    # the functional (the kernel's path forced: a fallback to PyTorch would assert on the device)
    from pipegoose.nn.fusion import functional as PF

    with dispatch.strict():
        rows, g = fwd_bwd(PF.cross_entropy, x, t, upstream=torch.ones(n, device=DEV), ignore_index=ignore_index,
                          reduction="none", impl="pipegoose")
        assert torch.isnan(PF.cross_entropy(x, t, ignore_index=ignore_index, impl="pipegoose"))
    assert torch.isnan(rows.cpu()[bad]).all() and torch.isfinite(rows.cpu()[~bad]).all()
    assert torch.isnan(g.cpu()[bad]).all() and torch.isfinite(g.cpu()[~bad]).all()
    check(rows, ref64(x, t, ignore_index)[0], "functional rows", **LOSS_TOL)


def test_empty_batch(ops):
    x = logits_of(0, 7, torch.bfloat16)
    t = torch.zeros(0, dtype=torch.long, device=DEV)
    loss, lse = ops.cross_entropy_forward(x, t, -100)
    assert loss.shape == lse.shape == (0,) and loss.dtype == torch.float32
    grad = ops.cross_entropy_backward(loss, x, t, lse, -100)
    assert grad.shape == (0, 7) and grad.dtype == torch.bfloat16


# ----------------------------------------------------------------------- the reduced forward and grad_loss strides
def run_reduced(ops, x, t, ignore_index, mean):
    """cross_entropy_forward_reduced with its outputs and workspace poisoned first; (out, lse, count)."""
    n = x.shape[0]
    poison(4, 4 * n, 8, 4 * n, 4)
    out, lse, count = ops.cross_entropy_forward_reduced(x, t, ignore_index, mean)
    assert out.shape == () and out.dtype == torch.float32 and lse.shape == (n,) and lse.dtype == torch.float32
    assert count.shape == () and count.dtype == torch.int64
    return out, lse, count


@pytest.mark.parametrize("mean", [True, False], ids=["mean", "sum"])
@pytest.mark.parametrize("n", [1, 3, 257, 4099])
@pytest.mark.parametrize("v", [1, 9, 1000, 50257])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_reduced_forward_matches_float64_and_the_rows(ops, dtype, v, n, mean):
    """out = the float64 reference's sum (/ count) of the rows' losses, within the fp32 tolerances, and within 1e-6
    of the per-row op's losses summed in float64 (the same row code; the reduction in fp64: FP32_FLOAT64_SUM); lse
    within two units in the last place of the per-row op's (FP32_SAME_CODE); count the rows not ignored. 4099 rows:
    several waves of blocks arriving at the counter."""
    x = logits_of(n, v, dtype, seed=40 + v + n)
    t = targets_of(n, v, seed=41 + n, every=3)
    out, lse, count = run_reduced(ops, x, t, -100, mean)
    rows, rows_lse = ops.cross_entropy_forward(x, t, -100)
    want_rows, _ = ref64(x, t, -100)
    kept = int((t != -100).sum())
    assert count.item() == kept
    want = want_rows.sum() / (kept if mean else 1)
    check(out, want, "out vs float64", **LOSS_TOL)
    from_rows = rows.double().sum().item() / (kept if mean else 1)
    torch.testing.assert_close(out.item(), from_rows, **FP32_FLOAT64_SUM)
    # the same row code in another kernel: equal but for a possibly different instruction schedule (a unit or two)
    torch.testing.assert_close(lse, rows_lse, **FP32_SAME_CODE)


def test_reduced_forward_is_deterministic_over_many_blocks(ops):
    """100003 rows of 64 classes (blocks arriving in any order): the same bits on every run, and the fp64 sum of the
    per-row op's losses rounded to fp32."""
    n, v = 100003, 64
    x = logits_of(n, v, torch.bfloat16, seed=42)
    t = targets_of(n, v, seed=43, every=5)
    runs = [run_reduced(ops, x, t, -100, True)[0] for _ in range(5)]
    assert all(torch.equal(r, runs[0]) for r in runs), [r.item() for r in runs]
    rows, _ = ops.cross_entropy_forward(x, t, -100)
    want = rows.double().sum() / int((t != -100).sum())
    torch.testing.assert_close(runs[0].double(), want, **FP32_FLOAT64_SUM)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_reduced_forward_edges(ops, dtype):
    """Every row ignored: mean NaN (0 / 0, as F.cross_entropy), sum 0, count 0, lse zeros. A target out of range:
    the mean and the sum NaN. No row: mean NaN, sum 0, count 0."""
    n, v = 6, 1000
    x = logits_of(n, v, dtype, seed=44)
    t = torch.full((n,), -100, device=DEV)
    out, lse, count = run_reduced(ops, x, t, -100, True)
    assert torch.isnan(out) and count.item() == 0 and torch.equal(lse, torch.zeros_like(lse))
    out, _, count = run_reduced(ops, x, t, -100, False)
    assert out.item() == 0 and count.item() == 0
    t = targets_of(n, v, seed=45)
    t[2] = v
    for mean in (True, False):
        out, _, count = run_reduced(ops, x, t, -100, mean)
        assert torch.isnan(out) and count.item() == int((t != -100).sum())
    empty = logits_of(0, v, dtype)
    none = torch.zeros(0, dtype=torch.long, device=DEV)
    out, lse, count = ops.cross_entropy_forward_reduced(empty, none, -100, True)
    assert torch.isnan(out) and lse.shape == (0,) and count.item() == 0
    out, _, count = ops.cross_entropy_forward_reduced(empty, none, -100, False)
    assert out.item() == 0 and count.item() == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_backward_takes_grad_loss_at_any_stride(ops, dtype):
    """grad_loss as one value expanded to every row (stride 0: a reduced loss's gradient), as every other element of
    a longer tensor (stride 2), and in bf16 (converted): each against the float64 reference with those grad_loss
    values, and the gradient of the same values given contiguous."""
    n, v = 37, 50257
    x = logits_of(n, v, dtype, seed=46)
    t = targets_of(n, v, seed=47)
    _, lse = ops.cross_entropy_forward(x, t, -100)
    one = torch.tensor(0.75, device=DEV)
    longer = grad_loss_of(2 * n, seed=48)
    for name, g in (("stride 0", one.expand(n)), ("stride 2", longer[::2]), ("bf16", longer[:n].bfloat16())):
        poison(n * v * x.element_size())
        got = ops.cross_entropy_backward(g, x, t, lse, -100)
        check(got, ref64(x, t, -100, g)[2], f"{name} vs float64", **TOLERANCES[dtype])   # (g as given: bf16 exact)
        want = ops.cross_entropy_backward(g.float().contiguous(), x, t, lse, -100)
        assert torch.equal(got, want), name


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("n,v", [(1, 1), (3, 7), (257, 50257), (5, 151936), (2000, 32000), (0, 9)],
                         ids=["1x1", "3x7", "257x50257", "5x151936", "2000x32000", "0x9"])
def test_backward_in_place_is_the_backward(ops, dtype, n, v):
    """cross_entropy_backward_ writes over the logits exactly what cross_entropy_backward returns: misaligned rows
    (odd V in 16-bit, the scalar path), few long rows (2-8 blocks per row), many rows, ignored rows, a target out of
    range (a NaN row), grad_loss expanded from one value. Every element changes from the logit to its gradient, so
    an element the kernel skipped would differ."""
    x = logits_of(n, v, dtype, seed=60)
    t = targets_of(n, v, seed=61)
    if n > 3:
        t[3] = v
    _, lse = ops.cross_entropy_forward(x, t, -100)
    for g in (grad_loss_of(n, seed=62), torch.tensor(0.25, device=DEV).expand(n)):
        want = ops.cross_entropy_backward(g, x, t, lse, -100)
        y = x.clone()
        ptr = y.data_ptr()
        assert ops.cross_entropy_backward_(g, y, t, lse, -100) is None
        assert y.data_ptr() == ptr and y.dtype == dtype and y.shape == (n, v)
        assert torch.equal(y.isnan(), want.isnan()) and torch.equal(y.nan_to_num(), want.nan_to_num())


def test_backward_in_place_errors_name_the_argument(ops):
    n, v = 4, 33
    x = logits_of(n, v, torch.float32, seed=63)
    t = targets_of(n, v, seed=64)
    _, lse = ops.cross_entropy_forward(x, t, -100)
    gl = torch.ones(n, device=DEV)
    wide = logits_of(n, v + 1, torch.float32, seed=65)
    bwd_ = ops.cross_entropy_backward_
    cases = [
        (lambda: bwd_(gl, wide[:, :v], t, lse, -100), r"cross_entropy_backward_: logits must be contiguous \(the "
                                                      r"gradient is written over it\), got strides \[34, 1\]"),
        (lambda: bwd_(gl, x, t, x[:, 0], -100), r"cross_entropy_backward_: lse must not share memory with logits"),
        (lambda: bwd_(x[:, 1], x, t, lse, -100), r"cross_entropy_backward_: grad_loss must not share memory with "
                                                 r"logits"),
        (lambda: bwd_(gl, x, t, lse[:3], -100), r"cross_entropy_backward_: lse must be 1-D with 4 elements"),
        (lambda: bwd_(gl, x.half(), t, lse.half(), -100), r"cross_entropy_backward_: lse must be float32"),
    ]
    before = x.clone()
    for call, match in cases:
        with pytest.raises(RuntimeError, match=match):
            call()
    assert torch.equal(x, before), "a refused call wrote the logits"


def test_reduced_argument_errors_name_the_argument(ops):
    n, v = 4, 33
    x = logits_of(n, v, torch.float32, seed=49)
    t = targets_of(n, v, seed=50)
    fwd = ops.cross_entropy_forward_reduced
    cases = [
        (lambda: fwd(x.cpu(), t, -100, True), r"cross_entropy_forward_reduced: logits must be a CUDA tensor"),
        (lambda: fwd(x, t.int(), -100, True), r"cross_entropy_forward_reduced: target must be int64"),
        (lambda: fwd(x, t[:3], -100, False), r"cross_entropy_forward_reduced: target must be 1-D with 4 elements"),
        (lambda: fwd(x.double(), t, -100, True), r"logits must be float32, float16 or bfloat16, got Double"),
        (lambda: fwd(x.t(), t[:1].expand(v), -100, True), r"logits' last dim must be contiguous"),
    ]
    for call, match in cases:
        with pytest.raises(RuntimeError, match=match):
            call()


# ------------------------------------------------------------------------------------ layouts and alignment
@pytest.mark.parametrize("v", [9, 1000, 50257, 151936])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_rows_at_a_stride_and_misaligned_rows(ops, dtype, v):
    """The last dim contiguous, rows anywhere: a slice x[:, :V] of a wider buffer (row stride V + 3: rows start at
    every alignment), a view starting one element into a buffer (the first row misaligned too), and a [B, S, V]
    tensor's view(-1, V). (37 rows of 151936, and of 50257 in fp32: the backward splits each row over several
    blocks, on the vector and the scalar path.)"""
    n = 37
    wide = logits_of(n, v + 3, dtype, seed=4)
    sliced = wide[:, :v]
    assert sliced.stride() == (v + 3, 1)
    flat = logits_of(1, n * v + 1, dtype, seed=5).view(-1)
    shifted = flat[1:].view(n, v)
    assert shifted.data_ptr() % 16 != 0
    bsv = logits_of(n * v, 1, dtype, seed=6).view(1, n, v)
    for name, x in (("x[:, :V]", sliced), ("offset by one element", shifted), ("[B, S, V].view(-1, V)",
                                                                              bsv.view(-1, v))):
        t = targets_of(n, v, seed=7)
        check_op(ops, x, t, -100, grad_loss_of(n, seed=8), what=name)


@pytest.mark.parametrize("v", [7, 9, 50257])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_odd_vocab_in_16_bit_takes_the_scalar_path_after_the_first_row(ops, dtype, v):
    """V odd in 16-bit: row i starts 2 * V * i bytes after the first, not on a 16-byte boundary for most i (the
    vectorised loads are for aligned rows only; the gradient's rows likewise)."""
    n = 16
    x = logits_of(n, v, dtype, seed=9)
    starts = [(x.data_ptr() + i * v * x.element_size()) % 16 for i in range(n)]
    assert starts[0] == 0 and sum(s != 0 for s in starts) >= n // 2, starts
    check_op(ops, x, targets_of(n, v, seed=10), -100, grad_loss_of(n, seed=11), what="odd V")


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_one_class_column_of_a_wider_buffer(ops, dtype):
    """V = 1 as a column x[:, :1] of a wider buffer (row stride 8): every row's loss is log(exp(x)) - x = 0 and its
    gradient 0. The rest of the buffer is NaN, so a row read at the wrong place shows."""
    n = 12
    buf = torch.full((n, 8), math.nan, device=DEV, dtype=dtype)
    buf[:, 0] = logits_of(n, 1, dtype, seed=12)[:, 0]
    x = buf[:, :1]
    assert x.stride() == (8, 1)
    t = torch.zeros(n, dtype=torch.long, device=DEV)
    t[3] = -100
    check_op(ops, x, t, -100, grad_loss_of(n), what="column of a wider buffer")


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_last_dim_not_contiguous(ops, dtype, dispatch):
    """A transposed tensor (last dim at stride N): the ops refuse it, naming contiguity; the functional runs PyTorch's
    F.cross_entropy on the logits upcast (a fallback, with the reason in dispatch.explain; strict mode refuses it)."""
    from pipegoose.nn.fusion import functional as PF

    n, v = 8, 1000
    x = logits_of(v, n, dtype, seed=13).t()
    assert x.shape == (n, v) and x.stride(-1) != 1
    t = targets_of(n, v, seed=14)
    with pytest.raises(RuntimeError, match=r"cross_entropy_forward: logits' last dim must be contiguous"):
        ops.cross_entropy_forward(x, t, -100)
    loss, lse = ops.cross_entropy_forward(x.contiguous(), t, -100)
    with pytest.raises(RuntimeError, match=r"cross_entropy_backward: logits' last dim must be contiguous"):
        ops.cross_entropy_backward(torch.ones(n, device=DEV), x, t, lse, -100)
    c = dispatch.explain("cross_entropy", x, t)
    assert (c.impl, c.source, c.fallback) == ("torch", "fallback", True)
    assert c.reasons["pipegoose"] == "logits' last dim is not contiguous", c
    got, got_grad = fwd_bwd(PF.cross_entropy, x, t)
    want, want_grad = fwd_bwd(torch_upcast, x, t)
    assert dispatch.last_choice("cross_entropy").impl == "torch"
    assert torch.equal(got, want) and torch.equal(got_grad, want_grad)
    with dispatch.strict(), pytest.raises(dispatch.FusionFallbackError, match="last dim is not contiguous"):
        PF.cross_entropy(x, t)


# -------------------------------------------------------------------------------------------- extreme values
def _slack(x: torch.Tensor) -> float:
    """The kernel keeps the log-sum-exp in fp32 and forms ``loss = lse - x[t]`` and ``p = exp(x - lse)`` from it, so
    its absolute error in the loss, and relative error in p, grow with the logits' magnitude: about one fp32 ulp of
    |lse| (2^-23 |lse|) where F.cross_entropy's fp32 log-softmax subtracts the maximum first. Twice that, for logits
    far from 0."""
    finite = x.detach().float()[torch.isfinite(x)]
    return 2.0 ** -22 * (finite.abs().max().item() if finite.numel() else 0.0)


@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1e4), (torch.float16, 6e4), (torch.bfloat16, 3e4),
                                         (torch.bfloat16, 1e4)], ids=["fp32-1e4", "fp16-6e4", "bf16-3e4", "bf16-1e4"])
def test_extreme_logits(ops, dtype, scale):
    """Logits spread over +-scale (no overflow of the running sum: the online softmax rescales), with rows of exact
    ties at +scale, all equal at -scale, and a near tie (whose loss is small beside |lse|); tolerances widened by
    :func:`_slack` (the fp32 lse's rounding at this magnitude)."""
    n, v = 8, 1000
    g = torch.Generator(device=DEV).manual_seed(15)
    x = ((torch.rand(n, v, device=DEV, generator=g) * 2 - 1) * scale).to(dtype)
    x[1, :10] = scale
    x[1, 10:] = -scale
    x[2] = -scale
    x[3, :2] = torch.tensor([scale, scale - 1], device=DEV)
    x[3, 2:] = -scale
    t = targets_of(n, v, seed=16, every=100)
    t[1], t[2], t[3] = 3, 500, 0
    s = _slack(x)
    gl = grad_loss_of(n, seed=17)
    loss_tol = dict(atol=LOSS_TOL["atol"] + s, rtol=LOSS_TOL["rtol"])
    grad_tol = dict(atol=TOLERANCES[dtype]["atol"] + s * gl.max().item(), rtol=TOLERANCES[dtype]["rtol"] + s)
    loss, _, grad = check_op(ops, x, t, -100, gl, what=f"+-{scale:g}", loss_tol=loss_tol, grad_tol=grad_tol)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    torch.testing.assert_close(loss[1].item(), math.log(10), **loss_tol)
    torch.testing.assert_close(loss[2].item(), math.log(1000), **loss_tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_infinite_logits(ops, dtype, dispatch):
    """-inf entries with a finite target (their probability and gradient 0), a target whose logit is -inf (loss inf,
    gradient -g there), a row of -inf only (NaN loss and gradient, as PyTorch's): the reference's, and the
    functional's as F.cross_entropy(logits.float()) on the GPU."""
    n, v = 5, 1000
    x = logits_of(n, v, dtype, seed=18)
    x[0, ::2] = -math.inf
    x[1, 5:] = -math.inf
    x[2] = -math.inf
    x[3, 7] = -math.inf
    t = torch.tensor([1, 3, 4, 7, 9], device=DEV)
    loss, _, grad = check_op(ops, x, t, -100, grad_loss_of(n, seed=19), what="-inf")
    assert torch.isnan(loss[2]) and torch.isnan(grad[2]).all()
    assert loss[3].item() == math.inf and torch.isfinite(grad[3]).all()
    assert (grad[0, ::2] == 0).all() and (grad[1, 5:] == 0).all()
    assert torch.isfinite(loss[[0, 1, 4]]).all() and torch.isfinite(grad[[0, 1, 3, 4]]).all()
    from pipegoose.nn.fusion import functional as PF

    got, got_grad = fwd_bwd(PF.cross_entropy, x, t, upstream=torch.ones(n, device=DEV), reduction="none")
    want, want_grad = fwd_bwd(torch_upcast, x, t, upstream=torch.ones(n, device=DEV), reduction="none")
    assert dispatch.last_choice("cross_entropy").impl == "pipegoose"
    check(got, want.cpu().double(), "functional vs torch", **LOSS_TOL)
    check(got_grad, want_grad.cpu().double(), "functional grad vs torch", **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logits_near_the_float_max(ops, dtype):
    """fp32 and bf16 hold logits up to 3.4e38; F.cross_entropy(logits.float()) gives their exact loss and gradient.
    Row [3e38, 0, ..., 0]: lse = 3e38, p = [1, 0, ...]: target 0 -> loss 0, gradient 0; target 1 -> loss 3e38,
    gradient [g, -g, 0, ...]. (The backward forms lse * log2(e), which passes the fp32 range above 2.36e38.)"""
    n, v = 2, 64
    x = torch.zeros(n, v, device=DEV, dtype=dtype)
    x[:, 0] = 3e38
    t = torch.tensor([0, 1], device=DEV)
    gl = torch.tensor([1.0, 0.5], device=DEV)
    loss, lse, grad = run_op(ops, x, t, -100, gl)
    want_loss, want_lse, want_grad = ref64(x, t, -100, gl)
    check(loss, want_loss, "loss", **LOSS_TOL)
    check(lse, want_lse, "lse", **LOSS_TOL)
    assert torch.isfinite(lse).all(), lse
    check(grad, want_grad, "grad", **TOLERANCES[dtype])


# -------------------------------------------------------------------------------------------- argument errors
def test_argument_errors_name_the_argument(ops):
    n, v = 4, 33
    x = logits_of(n, v, torch.float32, seed=20)
    t = targets_of(n, v, seed=21)
    fwd, bwd = ops.cross_entropy_forward, ops.cross_entropy_backward
    loss, lse = fwd(x, t, -100)
    gl = torch.ones(n, device=DEV)
    cases = [
        (lambda: fwd(x.cpu(), t, -100), r"cross_entropy_forward: logits must be a CUDA tensor, got device cpu"),
        (lambda: fwd(x, t.cpu(), -100), r"cross_entropy_forward: target is on cpu but logits is on cuda"),
        (lambda: fwd(x, t.int(), -100), r"cross_entropy_forward: target must be int64 class indices, got Int"),
        (lambda: fwd(x, t[:3], -100), r"cross_entropy_forward: target must be 1-D with 4 elements \(logits' rows\), "
                                      r"got shape \[3\]"),
        (lambda: fwd(x, t[:, None], -100), r"target must be 1-D with 4 elements"),
        (lambda: fwd(x.view(2, 2, v), t, -100), r"cross_entropy_forward: logits must be 2-D \[N, V\], got shape "
                                                r"\[2, 2, 33\]"),
        (lambda: fwd(x.double(), t, -100), r"logits must be float32, float16 or bfloat16, got Double"),
        (lambda: fwd(x[:, :0], t, -100), r"logits must have at least one class"),
        (lambda: bwd(gl, x, t, lse.half(), -100), r"cross_entropy_backward: lse must be float32, got Half"),
        (lambda: bwd(gl, x, t, lse[:3], -100), r"cross_entropy_backward: lse must be 1-D with 4 elements"),
        (lambda: bwd(gl[:3], x, t, lse, -100), r"cross_entropy_backward: grad_loss must be 1-D with 4 elements"),
        (lambda: bwd(gl.cpu(), x, t, lse, -100), r"cross_entropy_backward: grad_loss must be a tensor on logits' "
                                                 r"device"),
        (lambda: bwd(gl, x, t.int(), lse, -100), r"cross_entropy_backward: target must be int64"),
        (lambda: bwd(gl, x.cpu(), t, lse, -100), r"cross_entropy_backward: logits must be a CUDA tensor"),
    ]
    for call, match in cases:
        with pytest.raises(RuntimeError, match=match):
            call()
    # every tensor on the CPU: the op has no CPU kernel (the dispatcher says so, naming the backend)
    with pytest.raises(RuntimeError, match="CPU"):
        fwd(x.cpu(), t.cpu(), -100)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_opcheck(ops, dtype):
    n, v = 5, 33
    x = logits_of(n, v, dtype, seed=22)
    t = targets_of(n, v, seed=23)
    torch.library.opcheck(torch.ops.pipegoose.cross_entropy_forward.default, (x, t, -100))
    loss, lse = ops.cross_entropy_forward(x, t, -100)
    torch.library.opcheck(torch.ops.pipegoose.cross_entropy_backward.default,
                          (grad_loss_of(n), x, t, lse, -100))
    torch.library.opcheck(torch.ops.pipegoose.cross_entropy_backward_.default,
                          (grad_loss_of(n), x.clone(), t, lse, -100))
    for mean in (True, False):
        torch.library.opcheck(torch.ops.pipegoose.cross_entropy_forward_reduced.default, (x, t, -100, mean))


# ----------------------------------------------------------------------------------------------- the functional
def fwd_bwd(fn, logits, target, upstream=None, **kw):
    """(loss, logits' gradient) of ``fn(logits, target, **kw)``; the gradient buffer poisoned first."""
    x = logits.detach().clone().requires_grad_(True)
    loss = fn(x, target, **kw)
    if DEV == "cuda":
        poison(x.numel() * x.element_size())
    loss.backward(upstream if loss.dim() else None)
    return loss.detach(), x.grad


def torch_upcast(x, target, **kw):
    """What transformers computes: F.cross_entropy on the logits upcast to fp32."""
    return F.cross_entropy(x.float(), target, **kw)


def ref_reduced(x, t, ignore_index, reduction, upstream=None):
    """float64 (loss, gradient) of the functional's reduction."""
    n = x.shape[0]
    ignored = (t == ignore_index).cpu()
    count = int((~ignored).sum())
    if reduction == "none":
        g = upstream
    else:
        g = torch.full((n,), 1.0 / count if reduction == "mean" else 1.0, device=DEV)
    rows, _, grad = ref64(x, t, ignore_index, g)
    loss = rows if reduction == "none" else rows.sum() / (count if reduction == "mean" else 1)
    return loss, grad


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("v", [9, 32000, 50257, 151936])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_functional_matches_float64_and_pytorch(dtype, v, reduction, dispatch, reduce_in_kernel):
    """The functional on the kernel (strict mode: no fallback) against the float64 reference and against
    F.cross_entropy(logits.float(), target) on the GPU (what transformers computes): loss and .backward()."""
    from pipegoose.nn.fusion import functional as PF

    n = 257
    x = logits_of(n, v, dtype, seed=24 + v)
    t = targets_of(n, v, seed=25)
    upstream = grad_loss_of(n, seed=26) if reduction == "none" else None
    with dispatch.strict():
        got, got_grad = fwd_bwd(PF.cross_entropy, x, t, upstream, reduction=reduction)
    c = dispatch.last_choice("cross_entropy")
    assert (c.impl, c.fallback) == ("pipegoose", False), c
    assert got.dtype == torch.float32 and got_grad.dtype == dtype and got.shape == ((n,) if reduction == "none"
                                                                                   else ())
    want, want_grad = ref_reduced(x, t, -100, reduction, upstream)
    check(got, want, "loss vs float64", **LOSS_TOL)
    check(got_grad, want_grad, "grad vs float64", **TOLERANCES[dtype])
    pt, pt_grad = fwd_bwd(torch_upcast, x, t, upstream, reduction=reduction)
    check(got, pt.cpu().double(), "loss vs F.cross_entropy", **LOSS_TOL)
    # both round an fp32 gradient to the dtype once: one unit in the last place apart at most
    check(got_grad, pt_grad.cpu().double(), "grad vs F.cross_entropy", **tol(dtype, 2))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_functional_on_views_of_model_outputs(dtype, dispatch, reduce_in_kernel):
    """The shapes a language model hands over: a [B, S, V] output's view(-1, V), and its slice [:, :-1] flattened
    (a copy), and logits at a row stride (a slice of a wider buffer), all on the kernel."""
    from pipegoose.nn.fusion import functional as PF

    b, s, v = 2, 33, 1000
    out = logits_of(b * s, v, dtype, seed=27).view(b, s, v)
    wide = logits_of(b * s, v + 5, dtype, seed=28)[:, :v]
    t = targets_of(b * s, v, seed=29)
    for name, x, tt in (("view", out.view(-1, v), t), ("shifted", out[:, :-1].reshape(-1, v), t[: b * (s - 1)]),
                        ("strided rows", wide, t)):
        with dispatch.strict():
            got, got_grad = fwd_bwd(PF.cross_entropy, x, tt)
        assert dispatch.last_choice("cross_entropy").impl == "pipegoose", name
        want, want_grad = ref_reduced(x, tt, -100, "mean")
        check(got, want, f"{name} loss", **LOSS_TOL)
        check(got_grad, want_grad, f"{name} grad", **TOLERANCES[dtype])


def test_functional_custom_ignore_index_and_autocast(dispatch):
    """ignore_index = 5 (a valid class) on the kernel; under autocast the kernel runs on the logits as given (the
    loss is fp32 either way): the same result as without it."""
    from pipegoose.nn.fusion import functional as PF

    n, v = 64, 777
    x = logits_of(n, v, torch.bfloat16, seed=30)
    t = targets_of(n, v, seed=31, ignore_index=5, every=3)
    with dispatch.strict():
        got, got_grad = fwd_bwd(PF.cross_entropy, x, t, ignore_index=5)
        with torch.autocast("cuda", dtype=torch.float16):
            auto, auto_grad = fwd_bwd(PF.cross_entropy, x, t, ignore_index=5)
    assert dispatch.last_choice("cross_entropy").impl == "pipegoose"
    want, want_grad = ref_reduced(x, t, 5, "mean")
    check(got, want, "loss", **LOSS_TOL)
    check(got_grad, want_grad, "grad", **TOLERANCES[torch.bfloat16])
    assert auto.dtype == torch.float32 and auto_grad.dtype == torch.bfloat16
    assert torch.equal(auto, got)                         # the forward runs with autocast off
    check(auto_grad, want_grad, "grad under autocast", **TOLERANCES[torch.bfloat16])


def test_functional_float64_runs_pytorch_with_the_reason(dispatch):
    from pipegoose.nn.fusion import functional as PF

    x = logits_of(8, 100, torch.float64, seed=32)
    t = targets_of(8, 100, seed=33)
    c = dispatch.explain("cross_entropy", x, t)
    assert c.fallback and "logits dtype float64 not supported" in c.reasons["pipegoose"]
    got = PF.cross_entropy(x, t)
    assert got.dtype == torch.float64 and torch.equal(got, F.cross_entropy(x, t))


def test_functional_double_backward_is_pytorchs(dispatch, reduce_in_kernel):
    """A gradient penalty through the kernel path: the backward with create_graph=True differentiates PyTorch's
    formula on the saved logits, so the second derivatives are the reference's."""
    from pipegoose.nn.fusion import functional as PF

    x0 = logits_of(8, 100, torch.float32, seed=34)
    t = targets_of(8, 100, seed=35)

    def penalty(fn):
        x = x0.clone().requires_grad_(True)
        loss = fn(x, t)
        (g,) = torch.autograd.grad(loss, x, create_graph=True)
        (gg,) = torch.autograd.grad((g ** 2).sum() + loss, x)
        return g.detach(), gg

    got = penalty(PF.cross_entropy)
    assert dispatch.last_choice("cross_entropy").impl == "pipegoose"
    want = penalty(lambda x, t: F.cross_entropy(x.double(), t).float())
    # fp32 values of at most 1/6 (means over the 6 rows kept), a handful of fp32 roundings from the float64
    # reference's (measured on the CPU, PyTorch's fp32 formula: under 0.3% of the table's fp32 bound): a tenth of that
    # bound keeps the check as tight as the values' size asks
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol(torch.float32, 0.1))


# ------------------------------------------------------------------------------------------------ a Llama step
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
def test_llama_step_size(ops, dtype, dispatch, reduce_in_kernel):
    """8192 tokens x 32000 classes in bf16 (a Llama training step): the ops against the float64 reference in chunks
    of rows; the functional's mean against F.cross_entropy(logits.float(), target), with less than half its peak
    memory (no fp32 copy of the logits)."""
    from pipegoose.nn.fusion import functional as PF

    n, v = 8192, 32000
    x = logits_of(n, v, dtype, seed=36)
    t = targets_of(n, v, seed=37, every=7)
    gl = grad_loss_of(n, seed=38)
    loss, lse, grad = run_op(ops, x, t, -100, gl)
    ignored = (t == -100).cpu()
    for lo in range(0, n, 512):
        rows = slice(lo, lo + 512)
        want_loss, want_lse, want_grad = ref64(x[rows], t[rows], -100, gl[rows])
        check(loss[rows], want_loss, f"loss rows {lo}:", **LOSS_TOL)
        check(lse[rows], want_lse, f"lse rows {lo}:", **LOSS_TOL)
        check(grad[rows], want_grad, f"grad rows {lo}:", **TOLERANCES[dtype])
    assert (grad.cpu()[ignored] == 0).all()
    del loss, lse, grad

    def peak(fn):
        xx = x.detach().clone().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn(xx, t)
        out.backward()
        torch.cuda.synchronize()
        return out.detach(), xx.grad, torch.cuda.max_memory_allocated() - base

    with dispatch.strict():
        got, got_grad, got_peak = peak(PF.cross_entropy)
    assert dispatch.last_choice("cross_entropy").impl == "pipegoose"
    want, want_grad, want_peak = peak(torch_upcast)
    check(got, want.cpu().double(), "mean loss vs F.cross_entropy", **LOSS_TOL)
    for lo in range(0, n, 1024):
        rows = slice(lo, lo + 1024)
        check(got_grad[rows], want_grad[rows].cpu().double(), f"grad rows {lo}: vs F.cross_entropy", **tol(dtype, 2))
    assert got_peak < want_peak / 2, (got_peak, want_peak)
