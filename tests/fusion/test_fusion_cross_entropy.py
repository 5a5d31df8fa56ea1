"""CPU: softmax cross-entropy (op ``cross_entropy``): the functional's reference path against
``F.cross_entropy(logits.float(), ...)`` (bit for bit), its argument checks, the dispatcher's reasons for the kernel
(``_pipegoose_supports`` on hand-made CUDA problems; no GPU needed), strict mode, the Python side of the kernel path
(``PipegooseCrossEntropyFunction``, ``PipegooseCrossEntropyReducedFunction`` and the reductions, on a float64
stand-in for the CUDA ops), and the transformers
glue (``causal_lm_loss`` / ``masked_lm_loss`` against transformers' ``ForCausalLMLoss`` / ``ForMaskedLMLoss``).

The kernel itself is tested on the GPU: ``tests/kernels/test_cross_entropy_cuda.py``.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from ce_stand_in import stand_in_ops
from kernel_loading import load_or_skip
from pipegoose.nn.fusion import cross_entropy, dispatch
from pipegoose.nn.fusion import functional as PF
from pipegoose.nn.fusion.ops import cross_entropy as C
from pipegoose.nn.fusion.ops._common import NO_STORAGE

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REDUCTIONS = ["mean", "sum", "none"]
CUDA = torch.device("cuda", 0)   # a device object: no GPU needed to describe a problem on it


def _inputs(n, v, dtype, seed=0, ignore_index=-100, ignored=(1,)):
    """(logits [n, v] of ``dtype``, int64 target [n]) with the rows ``ignored`` set to ``ignore_index``."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g) * 3).to(dtype)
    target = torch.randint(0, v, (n,), generator=g)
    for i in ignored:
        if i < n:
            target[i] = ignore_index
    return logits, target


def _fwd_bwd(fn, logits, target, upstream=None, **kw):
    x = logits.detach().clone().requires_grad_(True)
    loss = fn(x, target, **kw)
    loss.backward(upstream if upstream is not None and loss.dim() else None)
    return loss.detach(), x.grad


def _torch_upcast(x, target, **kw):
    """What transformers computes: F.cross_entropy on the logits upcast to fp32."""
    return F.cross_entropy(x.float(), target, **kw)


# ------------------------------------------------------------------------------------- the reference path (CPU)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("ignore_index", [-100, 5])
def test_functional_equals_f_cross_entropy_on_cpu(dtype, reduction, ignore_index):
    """On the CPU the functional is F.cross_entropy(logits.float(), ...): loss (fp32) and the logits' gradient (their
    dtype) bit for bit, for every reduction and an ignore_index that is a valid class (rows with target 5 are
    ignored: they add nothing and the mean does not count them)."""
    logits, target = _inputs(7, 11, dtype, seed=1, ignore_index=ignore_index, ignored=(1, 4))
    if ignore_index == 5:
        target[target == 5] = 6
        target[(1, 4),] = 5
    upstream = torch.randn(7, generator=torch.Generator().manual_seed(2))
    kw = dict(ignore_index=ignore_index, reduction=reduction)
    loss, grad = _fwd_bwd(PF.cross_entropy, logits, target, upstream, **kw)
    want, want_grad = _fwd_bwd(_torch_upcast, logits, target, upstream, **kw)
    assert loss.dtype == torch.float32 and loss.shape == want.shape == ((7,) if reduction == "none" else ())
    assert grad.dtype == dtype and grad.shape == logits.shape
    assert torch.equal(loss, want) and torch.equal(grad, want_grad)
    if reduction == "none":
        assert (loss[[1, 4]] == 0).all()
    assert (grad[[1, 4]] == 0).all()
    assert dispatch.stats()["cross_entropy"] == {"torch": 1}


def test_the_reference_is_counted_once_per_call():
    logits, target = _inputs(4, 6, torch.float32)
    PF.cross_entropy(logits, target)
    PF.cross_entropy(logits, target, reduction="sum")
    assert dispatch.stats()["cross_entropy"] == {"torch": 2}
    assert dispatch.last_choice("cross_entropy").impl == "torch"


def test_package_level_name_is_the_functional():
    logits, target = _inputs(4, 6, torch.float32)
    assert torch.equal(cross_entropy(logits, target), F.cross_entropy(logits, target))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_float64_stays_float64(reduction):
    logits, target = _inputs(5, 9, torch.float64, seed=3)
    upstream = torch.randn(5, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    loss, grad = _fwd_bwd(PF.cross_entropy, logits, target, upstream, reduction=reduction)
    want, want_grad = _fwd_bwd(F.cross_entropy, logits, target, upstream, reduction=reduction)
    assert loss.dtype == grad.dtype == torch.float64
    assert torch.equal(loss, want) and torch.equal(grad, want_grad)


def test_every_row_ignored():
    """Mean over no row: NaN, as PyTorch's; sum: 0; gradients zero."""
    logits, target = _inputs(4, 6, torch.bfloat16, ignored=range(4))
    loss, grad = _fwd_bwd(PF.cross_entropy, logits, target)
    assert torch.isnan(loss) and (grad == 0).all()
    loss, grad = _fwd_bwd(PF.cross_entropy, logits, target, reduction="sum")
    assert loss.item() == 0 and (grad == 0).all()
    loss, _ = _fwd_bwd(PF.cross_entropy, logits, target, torch.ones(4), reduction="none")
    assert torch.equal(loss, torch.zeros(4))


def test_empty_input_runs_the_reference_without_a_fallback():
    logits, target = _inputs(4, 6, torch.float32)
    c = dispatch.explain("cross_entropy", logits[:0], target[:0])
    assert (c.impl, c.source, c.fallback) == ("torch", "empty", False)
    with dispatch.strict():
        assert torch.isnan(PF.cross_entropy(logits[:0], target[:0]))          # as F.cross_entropy's mean
        assert PF.cross_entropy(logits[:0], target[:0], reduction="none").shape == (0,)


def test_inputs_f_cross_entropy_takes_beyond_the_kernel_run_the_reference():
    """Class probabilities as target, [N, C, d] logits with [N, d] targets and unbatched [C] logits: F.cross_entropy's
    results (the reference path)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 6, generator=g, dtype=torch.bfloat16)
    probs = torch.softmax(torch.randn(4, 6, generator=g), -1)
    assert torch.equal(PF.cross_entropy(x, probs), F.cross_entropy(x.float(), probs))
    x3 = torch.randn(2, 6, 5, generator=g)
    t3 = torch.randint(0, 6, (2, 5), generator=g)
    assert torch.equal(PF.cross_entropy(x3, t3, reduction="none"), F.cross_entropy(x3, t3, reduction="none"))
    x1 = torch.randn(6, generator=g)
    assert torch.equal(PF.cross_entropy(x1, torch.tensor(3)), F.cross_entropy(x1, torch.tensor(3)))


# --------------------------------------------------------------------------------------------- argument errors
def test_argument_errors_name_the_argument():
    logits, target = _inputs(3, 5, torch.float32)
    cases = [
        ((1.0, target), {}, TypeError, r"^logits: expected a floating point torch.Tensor, got float"),
        ((logits.int(), target), {}, TypeError, r"^logits: expected a floating point torch.Tensor, got int32"),
        ((logits.long(), target), {}, TypeError, r"^logits: .*got int64"),
        ((logits, [1, 2, 3]), {}, TypeError, r"^target: expected a torch.Tensor of class indices, got list"),
        ((logits, 2), {}, TypeError, r"^target: .*got int"),
        ((logits, target), dict(ignore_index=-100.0), TypeError, r"^ignore_index: expected an int, got float"),
        ((logits, target), dict(ignore_index=True), TypeError, r"^ignore_index: expected an int, got bool"),
        ((logits, target), dict(ignore_index=None), TypeError, r"^ignore_index: "),
        ((logits, target), dict(reduction="avg"), ValueError,
         r"^reduction: expected one of mean, sum, none, got 'avg'"),
        ((logits, target), dict(reduction=None), ValueError, r"^reduction: "),
        ((logits, target.to("meta")), {}, ValueError, r"^target: on meta, expected the logits' device cpu"),
    ]
    for args, kw, err, match in cases:
        with pytest.raises(err, match=match):
            PF.cross_entropy(*args, **kw)
        with pytest.raises(err, match=match):   # explain refuses what the op refuses, with its message
            dispatch.explain("cross_entropy", *args, **kw)
    assert dispatch.stats().get("cross_entropy", {}) == {}   # a refused call is not counted


def test_impl_argument():
    logits, target = _inputs(3, 5, torch.float32)
    with pytest.warns(UserWarning, match=r"impl='pipegoose' cannot run this input: needs a CUDA tensor"):
        loss = PF.cross_entropy(logits, target, impl="pipegoose")
    assert torch.equal(loss, F.cross_entropy(logits, target))
    assert dispatch.last_choice("cross_entropy").impl == "torch"
    with pytest.raises(ValueError, match=r"impl: cross_entropy has no implementation 'fused'"):
        PF.cross_entropy(logits, target, impl="fused")
    assert torch.equal(PF.cross_entropy(logits, target, impl=" Torch "), F.cross_entropy(logits, target))


def test_strict_mode_raises_on_the_cpu_fallback(monkeypatch):
    logits, target = _inputs(3, 5, torch.float32)
    with dispatch.strict():
        with pytest.raises(dispatch.FusionFallbackError, match=r"cross_entropy: strict mode.*needs a CUDA tensor"):
            PF.cross_entropy(logits, target)
        assert torch.equal(PF.cross_entropy(logits, target, impl="torch"), F.cross_entropy(logits, target))
        assert dispatch.last_choice("cross_entropy").source == "argument"
    monkeypatch.setenv("PIPEGOOSE_STRICT", "1")
    with pytest.raises(dispatch.FusionFallbackError, match="needs a CUDA tensor"):
        PF.cross_entropy(logits, target, reduction="sum")
    monkeypatch.delenv("PIPEGOOSE_STRICT")
    assert torch.equal(PF.cross_entropy(logits, target), F.cross_entropy(logits, target))


def test_explain_on_cpu_names_why_the_kernel_does_not_run():
    logits, target = _inputs(3, 5, torch.bfloat16)
    c = dispatch.explain("cross_entropy", logits, target)
    assert (c.impl, c.source, c.fallback) == ("torch", "fallback", True)
    assert c.reasons["pipegoose"] == "needs a CUDA tensor, got device cpu" and c.reasons["torch"] == ""
    assert "needs a CUDA tensor" in str(c)
    assert dispatch.stats().get("cross_entropy", {}) == {}   # explain counts nothing


# ------------------------------------------------------------------------------ the kernel's supports() on CUDA
def _cuda_problem(logits, target):
    """The problem of (logits, target) as if they were on a GPU (metadata only: the CPU tensors describe it)."""
    return replace(C.cross_entropy_problem(logits, target), device=CUDA)


def _supports():
    return dispatch.implementations("cross_entropy")["pipegoose"].supports


def test_problem_describes_the_call():
    logits, target = _inputs(6, 11, torch.bfloat16)
    wide = torch.zeros(6, 16, dtype=torch.bfloat16)[:, :11]
    p = C.cross_entropy_problem(logits.requires_grad_(), target)
    assert (p.op, p.dtype, p.device, p.cols, p.needs_grad) == ("cross_entropy", torch.bfloat16,
                                                               torch.device("cpu"), 11, True)
    assert p["shape"] == (6, 11) and p["target_shape"] == (6,) and p["target_dtype"] == torch.int64
    assert p["numel"] == 66 and p["storage"] is True and p["forward_ad"] is False and p["last_dim_contiguous"]
    assert C.cross_entropy_problem(wide, target)["last_dim_contiguous"]             # rows at a stride: fine
    assert not C.cross_entropy_problem(torch.zeros(11, 6).t(), target)["last_dim_contiguous"]
    assert not C.cross_entropy_problem(logits.detach(), target).needs_grad


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_kernel_takes_2d_logits_and_int64_targets_on_cuda(dtype):
    supports = _supports()
    logits, target = _inputs(6, 11, dtype)
    assert supports(_cuda_problem(logits, target)) == (True, "")
    # rows at a stride (a slice of a wider buffer), a [B, S, V] tensor's view(-1, V), one class
    assert supports(_cuda_problem(torch.zeros(6, 16, dtype=dtype)[:, :11], target)) == (True, "")
    assert supports(_cuda_problem(torch.zeros(2, 3, 11, dtype=dtype).view(-1, 11), target)) == (True, "")
    assert supports(_cuda_problem(logits[:, :1], target)) == (True, "")
    assert supports(C.cross_entropy_problem(logits, target)) == (False, "needs a CUDA tensor, got device cpu")
    # a hand-made Problem, as another caller (the report's probe) builds one
    hand = dispatch.Problem("cross_entropy", dtype, CUDA, 32000, True,
                            dict(shape=(8192, 32000), target_shape=(8192,), target_dtype=torch.int64,
                                 numel=8192 * 32000, storage=True, forward_ad=False, last_dim_contiguous=True))
    assert supports(hand) == (True, "")


@pytest.mark.parametrize("what,build,reason", [
    ("3-D logits", lambda x, t: (x.view(2, 3, 11), t.view(2, 3)),
     r"^logits of shape \[2, 3, 11\]: the kernel takes \[N, V\] \(class scores in the last dim\)$"),
    ("1-D logits", lambda x, t: (x[0], t[0]), r"^logits of shape \[11\]: the kernel takes \[N, V\]"),
    ("float target (probabilities)", lambda x, t: (x, torch.softmax(x.float(), -1)),
     r"^target float32 of shape \[6, 11\]: the kernel takes int64 class indices of shape \[6\] "
     r"\(not probabilities\)$"),
    ("int32 target", lambda x, t: (x, t.int()), r"^target int32 of shape \[6\]: the kernel takes int64"),
    ("uint8 target", lambda x, t: (x, t.to(torch.uint8)), r"^target uint8 of shape \[6\]: the kernel takes int64"),
    ("target of another length", lambda x, t: (x, t[:5]), r"^target int64 of shape \[5\]: the kernel takes int64 "
                                                           r"class indices of shape \[6\]"),
    ("non-contiguous last dim", lambda x, t: (x.t().contiguous().t(), t), r"^logits' last dim is not contiguous$"),
    ("float64", lambda x, t: (x.double(), t), r"^logits dtype float64 not supported \(float32, float16, bfloat16\)$"),
    ("empty (no rows)", lambda x, t: (x[:0], t[:0]), r"^an empty input$"),
    ("empty (no classes)", lambda x, t: (x[:, :0], t), r"^an empty input$"),
], ids=["3d", "1d", "float_target", "int32_target", "uint8_target", "target_length", "last_dim", "float64",
        "empty_rows", "empty_classes"])
def test_kernel_declines_on_cuda_with_the_reason(what, build, reason):
    ok, why = _supports()(_cuda_problem(*build(*_inputs(6, 11, torch.float32))))
    assert not ok, what
    assert re.search(reason, why), (what, why)


def test_kernel_declines_tensors_without_storage_and_dual_tensors():
    p = _cuda_problem(*_inputs(3, 5, torch.float32))
    assert _supports()(replace(p, extra={**p.extra, "storage": False})) == (False, NO_STORAGE)
    ok, why = _supports()(replace(p, extra={**p.extra, "forward_ad": True}))
    assert not ok and why.startswith("a dual tensor (torch.autograd.forward_ad)") and "no forward derivative" in why


def test_kernel_declines_more_rows_than_one_launch_covers():
    p = _cuda_problem(*_inputs(3, 5, torch.float32))
    big = replace(p, extra={**p.extra, "shape": (2**31, 5), "target_shape": (2**31,), "numel": 5 * 2**31})
    ok, why = _supports()(big)
    assert not ok and "2147483648 rows: more than one launch covers" in why


def test_choice_on_cuda_picks_the_kernel_where_it_loads(monkeypatch):
    """On CUDA with the kernel loadable (a stand-in here) the kernel is the built-in choice; where it cannot load the
    reference runs with the load error as the reason (a fallback); an input it declines is a fallback with its
    reason, and strict mode refuses it."""
    monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "0")
    logits, target = _inputs(6, 11, torch.bfloat16)
    monkeypatch.setattr(dispatch, "kernel", lambda name: (object(), "") if name == "pipegoose/cross_entropy"
                        else (None, f"{name}: unexpected"))
    c = dispatch.choose("cross_entropy", _cuda_problem(logits, target))
    assert (c.impl, c.source, c.fallback) == ("pipegoose", "builtin", False)
    c = dispatch.choose("cross_entropy", _cuda_problem(logits.t().contiguous().t(), target))
    assert (c.impl, c.fallback) == ("torch", True) and "logits' last dim is not contiguous" in c.reason
    with dispatch.strict(), pytest.raises(dispatch.FusionFallbackError, match="last dim is not contiguous"):
        dispatch.select("cross_entropy", _cuda_problem(logits.t().contiguous().t(), target))
    monkeypatch.setattr(dispatch, "kernel", lambda name: (None, f"{name} unavailable: nvcc missing"))
    c = dispatch.choose("cross_entropy", _cuda_problem(logits, target))
    assert (c.impl, c.fallback) == ("torch", True) and "pipegoose/cross_entropy unavailable: nvcc missing" in c.reason


def test_choice_on_cuda_of_an_empty_input_loads_no_kernel(monkeypatch):
    def no_kernel(name):
        raise AssertionError(f"loaded {name}")

    monkeypatch.setattr(dispatch, "kernel", no_kernel)
    logits, target = _inputs(6, 11, torch.bfloat16)
    with dispatch.strict():
        c = dispatch.select("cross_entropy", _cuda_problem(logits[:0], target[:0]))
    assert (c.impl, c.source, c.fallback) == ("torch", "empty", False)


# ------------------------------------------- the kernel path's Python side, on a float64 stand-in for the CUDA ops
@pytest.fixture(params=[False, True], ids=["reduced-by-torch", "reduced-in-kernel"])
def reduce_in_kernel(request, monkeypatch):
    """Both routes of the mean and sum: PyTorch's reductions over the per-row op, and the op that reduces in its own
    launch (``C.REDUCE_IN_KERNEL``)."""
    monkeypatch.setattr(C, "REDUCE_IN_KERNEL", request.param)
    return request.param


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("ignore_index", [-100, 5])
def test_kernel_path_reductions_and_backward(monkeypatch, reduction, ignore_index, reduce_in_kernel):
    """The autograd Functions and the reductions around the kernels: mean = sum over the rows not ignored / their
    count, sum, none; the backward gets the upstream gradient per row, the saved lse and ignore_index."""
    calls = []
    monkeypatch.setattr(C, "_ops", lambda: stand_in_ops(calls))
    logits, target = _inputs(8, 13, torch.float32, seed=6, ignore_index=ignore_index, ignored=(0, 5, 6))
    if ignore_index == 5:
        target[target == 5] = 4
        target[[0, 5, 6]] = 5
    upstream = torch.rand(8, generator=torch.Generator().manual_seed(7)) + 0.5
    loss, grad = _fwd_bwd(lambda x, t, **kw: C._run_pipegoose(x, t, ignore_index, reduction), logits, target,
                          upstream)
    want, want_grad = _fwd_bwd(F.cross_entropy, logits.double(), target, upstream.double(),
                               ignore_index=ignore_index, reduction=reduction)
    fwd = "forward_reduced" if reduce_in_kernel and reduction != "none" else "forward"
    assert calls == [(fwd, ignore_index), ("backward", ignore_index)]
    assert loss.dtype == torch.float32 and grad.dtype == torch.float32 and loss.shape == want.shape
    torch.testing.assert_close(loss.double(), want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad.double(), want_grad, atol=1e-6, rtol=1e-6)
    assert (grad[[0, 5, 6]] == 0).all()


def test_kernel_path_every_row_ignored_and_out_of_range_targets(monkeypatch, reduce_in_kernel):
    calls = []
    monkeypatch.setattr(C, "_ops", lambda: stand_in_ops(calls))
    logits, target = _inputs(4, 6, torch.float32, ignored=range(4))
    loss, grad = _fwd_bwd(lambda x, t: C._run_pipegoose(x, t, -100, "mean"), logits, target)
    assert torch.isnan(loss) and torch.equal(grad, torch.zeros_like(grad))        # 0 / 0, as F.cross_entropy
    loss, grad = _fwd_bwd(lambda x, t: C._run_pipegoose(x, t, -100, "sum"), logits, target)
    assert loss.item() == 0 and torch.equal(grad, torch.zeros_like(grad))
    # a target out of range: that row's loss and gradient are NaN, the others are right
    logits, target = _inputs(4, 6, torch.float32, seed=3, ignored=())
    target[1], target[2] = 6, -1
    loss, grad = _fwd_bwd(lambda x, t: C._run_pipegoose(x, t, -100, "none"), logits, target, torch.ones(4))
    assert torch.isnan(loss[[1, 2]]).all() and torch.isfinite(loss[[0, 3]]).all()
    assert torch.isnan(grad[[1, 2]]).all() and torch.isfinite(grad[[0, 3]]).all()
    keep = [0, 3]
    want = F.cross_entropy(logits[keep].double(), target[keep], reduction="none")
    torch.testing.assert_close(loss[keep].double(), want, atol=1e-6, rtol=1e-6)


def test_kernel_path_without_a_gradient_for_the_logits(monkeypatch, reduce_in_kernel):
    calls = []
    monkeypatch.setattr(C, "_ops", lambda: stand_in_ops(calls))
    logits, target = _inputs(4, 6, torch.float32)
    loss = C._run_pipegoose(logits, target, -100, "sum")
    assert not loss.requires_grad and calls == [("forward_reduced" if reduce_in_kernel else "forward", -100)]


def test_kernel_path_reduced_in_kernel_scales_the_gradient_once(monkeypatch):
    """The reduced route's backward: the scalar's upstream gradient (here 3) divided by the count for the mean, once,
    and handed to the backward kernel as one value per row; a second backward through a retained graph gives the same
    gradient (nothing saved is modified)."""
    calls = []
    monkeypatch.setattr(C, "_ops", lambda: stand_in_ops(calls))
    monkeypatch.setattr(C, "REDUCE_IN_KERNEL", True)
    logits, target = _inputs(6, 9, torch.float32, seed=11, ignored=(2, 4))
    for reduction in ("mean", "sum"):
        x = logits.clone().requires_grad_(True)
        loss = C._run_pipegoose(x, target, -100, reduction)
        (g1,) = torch.autograd.grad(loss, x, torch.tensor(3.0), retain_graph=True)
        (g2,) = torch.autograd.grad(loss, x, torch.tensor(3.0))
        xr = logits.double().requires_grad_(True)
        (want,) = torch.autograd.grad(F.cross_entropy(xr, target, reduction=reduction), xr, torch.tensor(3.0).double())
        torch.testing.assert_close(g1.double(), want, atol=1e-6, rtol=1e-6)
        assert torch.equal(g1, g2)


# ------------------------------------------------------------------------------------- fake impls (meta; slow)
@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_fake_impls_on_meta_tensors(dtype):
    """Shapes and dtypes as the kernels return them (pipegoose/kernels/bindings/cross_entropy.py), and the fakes
    refuse the shapes the kernels refuse."""
    load_or_skip("pipegoose/cross_entropy")
    ops = torch.ops.pipegoose
    n, v = 5, 11
    x = torch.empty(n, v, device="meta", dtype=dtype)
    t = torch.empty(n, device="meta", dtype=torch.int64)
    loss, lse = ops.cross_entropy_forward(x, t, -100)
    assert loss.shape == lse.shape == (n,) and loss.dtype == lse.dtype == torch.float32
    for mean in (True, False):
        out, lse, count = ops.cross_entropy_forward_reduced(x, t, -100, mean)
        assert out.shape == count.shape == () and out.dtype == torch.float32 and count.dtype == torch.int64
        assert lse.shape == (n,) and lse.dtype == torch.float32
    grad = ops.cross_entropy_backward(torch.empty((), device="meta").expand(n), x, t, lse, -100)
    assert grad.shape == (n, v) and grad.dtype == dtype
    assert ops.cross_entropy_backward_(torch.empty((), device="meta").expand(n), x, t, lse, -100) is None
    with pytest.raises(RuntimeError, match="logits must be contiguous"):
        ops.cross_entropy_backward_(torch.empty((), device="meta").expand(n), x.t().contiguous().t(), t, lse, -100)
    with pytest.raises(RuntimeError, match="lse must be 1-D with 5 elements"):
        ops.cross_entropy_backward_(torch.empty((), device="meta").expand(n), x, t, lse[:3], -100)
    for bad in (lambda: ops.cross_entropy_forward_reduced(x, t[:3], -100, True),
                lambda: ops.cross_entropy_forward_reduced(x[None], t, -100, False)):
        with pytest.raises(RuntimeError, match="target: expected 1-D with|logits: expected 2-D"):
            bad()


# -------------------------------------------------------------------------------------- the transformers glue
LOSS_UTILS = pytest.importorskip("transformers.loss.loss_utils")
from pipegoose.nn.fusion.transformers.loss import INLINE, causal_lm_loss, loss_support, masked_lm_loss  # noqa: E402

B, S, V = 3, 11, 97


def _lm_inputs(dtype, seed=0, ignore_index=-100):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, S, V, generator=g) * 2).to(dtype)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, :4] = ignore_index          # a padded prompt
    labels[2, 7] = ignore_index
    return logits, labels


def _loss_and_grad(fn, logits, labels, **kw):
    x = logits.detach().clone().requires_grad_(True)
    loss = fn(x, labels, V, **kw)
    loss.backward()
    return loss.detach(), x.grad


NUM_ITEMS = [None, torch.tensor(17), 17]


@pytest.mark.parametrize("num_items", NUM_ITEMS, ids=["mean", "tensor", "int"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("which", ["causal", "masked"])
def test_lm_losses_equal_transformers(which, dtype, num_items):
    """causal_lm_loss / masked_lm_loss equal ForCausalLMLoss / ForMaskedLMLoss bit for bit on the CPU: loss (fp32:
    transformers upcasts 16-bit logits) and the logits' gradient (their dtype)."""
    ours, theirs = ((causal_lm_loss, LOSS_UTILS.ForCausalLMLoss) if which == "causal"
                    else (masked_lm_loss, LOSS_UTILS.ForMaskedLMLoss))
    logits, labels = _lm_inputs(dtype, seed=1)
    kw = {} if num_items is None else dict(num_items_in_batch=num_items)
    loss, grad = _loss_and_grad(ours, logits, labels, **kw)
    want, want_grad = _loss_and_grad(theirs, logits, labels, **kw)
    assert loss.dtype == want.dtype == torch.float32 and loss.shape == ()
    assert grad.dtype == dtype
    assert torch.equal(loss, want) and torch.equal(grad, want_grad)


@pytest.mark.parametrize("num_items", NUM_ITEMS, ids=["mean", "tensor", "int"])
def test_causal_lm_loss_with_shift_labels_equals_transformers(num_items):
    logits, labels = _lm_inputs(torch.bfloat16, seed=2)
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    kw = dict(shift_labels=shift) if num_items is None else dict(shift_labels=shift, num_items_in_batch=num_items)
    loss, grad = _loss_and_grad(causal_lm_loss, logits, labels, **kw)
    want, want_grad = _loss_and_grad(LOSS_UTILS.ForCausalLMLoss, logits, labels, **kw)
    assert torch.equal(loss, want) and torch.equal(grad, want_grad)
    # given shift labels are used as they are (not shifted again): the same as the labels shifted here
    assert torch.equal(loss, _loss_and_grad(causal_lm_loss, logits, labels,
                                            **({} if num_items is None else dict(num_items_in_batch=num_items)))[0])
    # other shift labels: another loss (they are not ignored)
    other = torch.roll(shift, 1, dims=1)
    assert not torch.equal(causal_lm_loss(logits, labels, V, shift_labels=other), loss)
    assert torch.equal(causal_lm_loss(logits, labels, V, shift_labels=other),
                       LOSS_UTILS.ForCausalLMLoss(logits, labels, V, shift_labels=other))


@pytest.mark.parametrize("which", ["causal", "masked"])
def test_lm_losses_with_another_ignore_index_and_extra_kwargs(which):
    """ignore_index passed on (rows with it ignored; the causal loss pads with it); keyword arguments transformers'
    functions ignore (the model's forward passes its **kwargs) are ignored."""
    ours, theirs = ((causal_lm_loss, LOSS_UTILS.ForCausalLMLoss) if which == "causal"
                    else (masked_lm_loss, LOSS_UTILS.ForMaskedLMLoss))
    logits, labels = _lm_inputs(torch.float32, seed=3, ignore_index=0)
    extra = dict(ignore_index=0, output_attentions=False, position_ids=None)
    loss, grad = _loss_and_grad(ours, logits, labels, **extra)
    want, want_grad = _loss_and_grad(theirs, logits, labels, **extra)
    assert torch.equal(loss, want) and torch.equal(grad, want_grad)
    assert not torch.equal(loss, ours(logits, labels, V))   # (label 0 counted with the default ignore_index)


def test_lm_losses_of_every_label_ignored_are_nan_as_transformers():
    logits, labels = _lm_inputs(torch.float32)
    labels[:] = -100
    for ours, theirs in ((causal_lm_loss, LOSS_UTILS.ForCausalLMLoss), (masked_lm_loss, LOSS_UTILS.ForMaskedLMLoss)):
        assert torch.isnan(ours(logits, labels, V)) and torch.isnan(theirs(logits, labels, V))
        n = torch.tensor(5)
        assert torch.equal(ours(logits, labels, V, num_items_in_batch=n), theirs(logits, labels, V,
                                                                               num_items_in_batch=n))


@pytest.mark.parametrize("which", ["causal", "masked"])
def test_lm_losses_of_float64_logits_equal_transformers(which):
    """transformers' functions compute the loss of fp64 logits in fp32 (``logits.float()``) and document an fp32
    loss; ours should give the same (the docstrings: "Returns: The fp32 scalar loss")."""
    ours, theirs = ((causal_lm_loss, LOSS_UTILS.ForCausalLMLoss) if which == "causal"
                    else (masked_lm_loss, LOSS_UTILS.ForMaskedLMLoss))
    logits, labels = _lm_inputs(torch.float64, seed=4)
    loss, grad = _loss_and_grad(ours, logits, labels)
    want, want_grad = _loss_and_grad(theirs, logits, labels)
    assert loss.dtype == want.dtype == torch.float32, (loss.dtype, want.dtype)
    assert torch.equal(loss, want) and torch.equal(grad, want_grad)


def test_loss_support_of_language_models():
    import transformers as tr

    cfg = tr.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    causal = tr.LlamaForCausalLM(cfg)
    assert loss_support(causal)[0] == "causal_lm_loss" and loss_support(causal)[2]
    assert "ForCausalLMLoss -> causal_lm_loss" in loss_support(causal)[1]
    causal.loss_function = lambda *a, **k: None
    name, reason, candidate, _ = loss_support(causal)
    assert name is None and candidate and "already set" in reason
    bert = tr.BertForMaskedLM(tr.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                            intermediate_size=64))
    # (BERT's forward builds its own CrossEntropyLoss from its modeling module's global: routed there)
    name, reason, candidate, original = loss_support(bert)
    assert (name, candidate, original) == (INLINE, True, "CrossEntropyLoss (inline)")
    assert "modeling_bert.CrossEntropyLoss -> a dispatching subclass" in reason, reason
    distil = tr.DistilBertForMaskedLM(tr.DistilBertConfig(vocab_size=V, dim=32, n_layers=1, n_heads=4, hidden_dim=64))
    name, reason, candidate, original = loss_support(distil)   # (a loss module of its own: self.mlm_loss_fct)
    assert (name, candidate, original) == (INLINE, True, "CrossEntropyLoss (mlm_loss_fct)")
    assert "DistilBertForMaskedLM.mlm_loss_fct -> its class a dispatching subclass" in reason, reason
    electra = tr.ElectraForMaskedLM(tr.ElectraConfig(vocab_size=V, embedding_size=16, hidden_size=32,
                                                     num_hidden_layers=1, num_attention_heads=4, intermediate_size=64))
    name, reason, candidate, original = loss_support(electra)   # (nn.CrossEntropyLoss(): neither global nor child)
    assert name is None and candidate and original == "its own loss"
    assert "ElectraForMaskedLM.forward computes its loss without self.loss_function" in reason, reason
    classifier = tr.LlamaForSequenceClassification(cfg)
    name, reason, candidate, _ = loss_support(classifier)
    assert name is None and not candidate and "not a language-model cross-entropy" in reason
    assert loss_support(torch.nn.Linear(2, 2)) == (None, "", False, "")
    # a base model without a head computes no loss: not a candidate (its report had a false "computes its loss
    # without self.loss_function" row)
    assert loss_support(tr.LlamaModel(cfg)) == (None, "", False, "")


def test_loss_support_of_a_model_without_a_loss():
    """A base model (no head, no labels argument: LlamaModel, BertModel) computes no loss at all: it is no candidate
    (fuse() gives it no cross_entropy row), and asking does not call its loss_function property (transformers logs
    "loss_type=None was set in the config but it is unrecognized" there)."""
    import transformers as tr

    cfg = tr.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    base = tr.LlamaModel(cfg)
    assert loss_support(base)[2] is False, loss_support(base)


def test_forward_ad_and_vmap_run_the_reference():
    import torch.autograd.forward_ad as fwAD

    logits, target = _inputs(4, 6, torch.float32, seed=8)
    tangent = torch.randn(4, 6, generator=torch.Generator().manual_seed(9))
    with fwAD.dual_level():
        got = fwAD.unpack_dual(PF.cross_entropy(fwAD.make_dual(logits, tangent), target))
        want = fwAD.unpack_dual(F.cross_entropy(fwAD.make_dual(logits, tangent), target))
    assert torch.equal(got.primal, want.primal) and torch.equal(got.tangent, want.tangent)
    batched = torch.stack([logits, logits * 2])
    got = torch.func.vmap(lambda x: PF.cross_entropy(x, target, reduction="sum"))(batched)
    assert torch.equal(got, torch.func.vmap(lambda x: F.cross_entropy(x, target, reduction="sum"))(batched))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_kernel_path_double_backward_is_pytorchs(monkeypatch, reduction, reduce_in_kernel):
    """A backward with create_graph=True (a gradient penalty) differentiates PyTorch's formula on the saved logits:
    the second derivatives equal the reference's; without create_graph the kernel's backward runs."""
    calls = []
    monkeypatch.setattr(C, "_ops", lambda: stand_in_ops(calls))
    logits, target = _inputs(6, 9, torch.float64, seed=21, ignored=(1,))

    def penalty(run):
        x = logits.clone().requires_grad_(True)
        loss = run(x)
        (g,) = torch.autograd.grad(loss.sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad((g ** 2).sum() + loss.sum(), x)
        return g.detach(), gg

    got = penalty(lambda x: C._run_pipegoose(x, target, -100, reduction))
    want = penalty(lambda x: F.cross_entropy(x, target, reduction=reduction))
    # (create_graph: PyTorch's formula, no kernel backward; the second grad's loss.sum() term: the kernel's)
    assert [c[0] for c in calls] == ["forward_reduced" if reduce_in_kernel and reduction != "none" else "forward",
                                     "backward"]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-8, rtol=1e-6)   # (the stand-in keeps an fp32 lse, as the kernel)
