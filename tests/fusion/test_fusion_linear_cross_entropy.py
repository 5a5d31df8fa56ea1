"""CPU: fused linear cross-entropy (op ``fused_linear_cross_entropy``): the reference path against the unfused
``F.cross_entropy(F.linear(hidden, weight, bias).float(), target)`` (bit for bit), the fused path's Python side
(``PipegooseLinearCrossEntropyFunction``: chunking, the gradients computed in the forward, their scaling in the
backward) on the float64 stand-in for the cross-entropy ops of ``test_fusion_cross_entropy.py``, argument checks, the
dispatcher's reasons, autocast, the module.

The fused path on the GPU: ``tests/kernels/test_linear_cross_entropy_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipegoose.nn.fusion import FusedLinearCrossEntropyLoss, dispatch, fused_linear_cross_entropy
from pipegoose.nn.fusion.ops import cross_entropy as C
from pipegoose.nn.fusion.ops import linear_cross_entropy as L

from ce_stand_in import stand_in_ops

OP = "fused_linear_cross_entropy"
CUDA = torch.device("cuda", 0)


def _inputs(n=13, h=8, v=11, dtype=torch.float32, seed=0, bias=True, ignored=(1, 6)):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h ** 0.5).to(dtype)
    b = (torch.randn(v, generator=g) * 0.1).to(dtype) if bias else None
    target = torch.randint(0, v, (n,), generator=g)
    for i in ignored:
        if i < n:
            target[i] = -100
    return hidden, weight, b, target


def _loss_and_grads(fn, hidden, weight, bias, target, upstream=None, **kw):
    """(loss, grad hidden, grad weight, grad bias) of ``fn(hidden, weight, target, bias, **kw)``."""
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (hidden, weight, bias)]
    loss = fn(leaves[0], leaves[1], target, leaves[2], **kw)
    loss.backward(upstream)
    return (loss.detach(),) + tuple(None if t is None else t.grad for t in leaves)


def _unfused(hidden, weight, target, bias=None, ignore_index=-100, reduction="mean", **_):
    logits = F.linear(hidden.reshape(-1, hidden.shape[-1]), weight, bias)
    x = logits if logits.dtype == torch.float64 else logits.float()
    return F.cross_entropy(x, target.reshape(-1), ignore_index=ignore_index, reduction=reduction)


def _fused_stand_in(monkeypatch, calls=None):
    """The fused path (no dispatcher) with the float64 stand-in for the cross-entropy ops."""
    calls = [] if calls is None else calls
    monkeypatch.setattr(C, "_ops", lambda: stand_in_ops(calls))

    def fn(hidden, weight, target, bias=None, ignore_index=-100, reduction="mean", chunk_rows=None):
        return L._run_pipegoose(hidden, weight, target, bias, ignore_index, reduction, chunk_rows)
    return fn


# ------------------------------------------------------------------------------------- the reference path (CPU)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
def test_reference_path_equals_the_unfused_expression(dtype, reduction):
    """On the CPU the functional is the unfused expression, bit for bit: loss (fp32; fp64 for fp64) and gradients.
    hidden [B, S, H] and target [B, S] are flattened."""
    hidden, weight, bias, target = _inputs(12, 8, 11, dtype)
    hidden, target = hidden.view(3, 4, 8), target.view(3, 4)
    got = _loss_and_grads(fused_linear_cross_entropy, hidden, weight, bias, target, reduction=reduction)
    want = _loss_and_grads(_unfused, hidden, weight, bias, target, reduction=reduction)
    assert got[0].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert dispatch.last_choice(OP).impl == "torch"


def test_reference_path_under_cpu_autocast():
    """Under autocast F.linear runs in autocast's dtype: the functional casts hidden, weight and bias as it would."""
    hidden, weight, bias, target = _inputs(9, 8, 11, torch.float32, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _loss_and_grads(fused_linear_cross_entropy, hidden, weight, bias, target)
        want = _loss_and_grads(_unfused, hidden, weight, bias, target)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert got[1].dtype == torch.float32          # the leaves' gradients in their dtype, through the cast


# ------------------------------------------- the fused path's Python side, on a float64 stand-in for the CUDA ops
@pytest.mark.parametrize("chunk_rows", [1, 3, 5, 13, 64, None])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_fused_path_matches_float64(monkeypatch, chunk_rows, reduction, bias):
    """Every chunking (one row per chunk, chunks that do not divide N, one chunk, the default): loss and the gradients
    of hidden, weight and bias against the unfused expression in float64, with an upstream gradient of 3."""
    calls = []
    fn = _fused_stand_in(monkeypatch, calls)
    hidden, weight, b, target = _inputs(13, 8, 11, torch.float32, seed=2, bias=bias)
    up = torch.tensor(3.0)
    got = _loss_and_grads(fn, hidden, weight, b, target, up, reduction=reduction, chunk_rows=chunk_rows)
    want = _loss_and_grads(_unfused, hidden.double(), weight.double(), None if b is None else b.double(), target,
                           up.double(), reduction=reduction)
    assert got[0].dtype == torch.float32 and got[0].shape == ()
    for name, a, w in zip(("loss", "hidden", "weight", "bias"), got, want):
        if w is None:
            assert a is None, name
            continue
        torch.testing.assert_close(a.double(), w, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    rows = 13 if chunk_rows is None else chunk_rows
    chunks = -(-13 // min(rows, 13)) if chunk_rows is not None else -(-13 // L.default_chunk_rows(13, 11, 8))
    assert calls == [("forward", -100), ("backward_", -100)] * chunks


def test_fused_path_gradients_only_where_asked(monkeypatch):
    """hidden alone, weight alone, neither (no backward kernel call: the loss only), in inference mode."""
    calls = []
    fn = _fused_stand_in(monkeypatch, calls)
    hidden, weight, bias, target = _inputs(6, 8, 11, seed=3)
    want = _loss_and_grads(_unfused, hidden.double(), weight.double(), bias.double(), target)
    h = hidden.clone().requires_grad_(True)
    fn(h, weight, target, bias, chunk_rows=4).backward()
    torch.testing.assert_close(h.grad.double(), want[1], atol=1e-5, rtol=1e-5)
    w = weight.clone().requires_grad_(True)
    fn(hidden, w, target, None, chunk_rows=4).backward()
    want_nb = _loss_and_grads(_unfused, hidden.double(), weight.double(), None, target)
    torch.testing.assert_close(w.grad.double(), want_nb[2], atol=1e-5, rtol=1e-5)
    calls.clear()
    with torch.inference_mode():
        loss = fn(hidden, weight, target, bias, chunk_rows=4)
    assert not loss.requires_grad and calls == [("forward", -100)] * 2
    torch.testing.assert_close(loss.double(), want[0], atol=1e-6, rtol=1e-6)
    # leaves that require grad, under no_grad / inference_mode (an evaluation loop): no gradient work either
    # (autograd.Function's needs_input_grad is True there too)
    for mode in (torch.no_grad, torch.inference_mode):
        calls.clear()
        with mode():
            loss = fn(hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True), target, bias,
                      chunk_rows=4)
        assert not loss.requires_grad and calls == [("forward", -100)] * 2, mode


def test_fused_path_second_backward_raises_and_upstream_scaling(monkeypatch):
    """The backward scales the gradients computed in the forward in place and hands them over: a retained graph's
    second backward raises, naming the way out (no silently doubled scaling); an upstream gradient of 0.5 halves the
    gradients of 1; a backward with retain_graph=True and no second one is fine."""
    fn = _fused_stand_in(monkeypatch)
    hidden, weight, bias, target = _inputs(7, 8, 11, seed=4)
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]

    def loss():
        return fn(leaves[0], leaves[1], target, leaves[2], chunk_rows=3)

    retained = loss()
    first = torch.autograd.grad(retained, leaves, retain_graph=True)
    with pytest.raises(RuntimeError, match=r"second backward through the same graph on the fused path \(after a "
                                           r"backward with retain_graph=True.*impl='torch', or "
                                           r"PIPEGOOSE_IMPL_FUSED_LINEAR_CROSS_ENTROPY=torch"):
        torch.autograd.grad(retained, leaves)
    # backward called twice without retain_graph: the same error (no saved tensor for PyTorch's own check to miss)
    twice = loss()
    twice.backward()
    with pytest.raises(RuntimeError, match=r"or a second call of backward"):
        twice.backward()
    for t in leaves:
        t.grad = None
    again = torch.autograd.grad(loss(), leaves)
    half = torch.autograd.grad(loss(), leaves, torch.tensor(0.5))
    for a, b, c in zip(first, again, half):
        assert torch.equal(a, b)
        torch.testing.assert_close(c, a * 0.5)
    # the unfused path keeps PyTorch's retained-graph semantics
    from pipegoose.nn.fusion import fused_linear_cross_entropy

    retained = fused_linear_cross_entropy(leaves[0], leaves[1], target, leaves[2], impl="torch")
    a = torch.autograd.grad(retained, leaves, retain_graph=True)
    b = torch.autograd.grad(retained, leaves)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("scaler", [1.0, 65536.0], ids=["unscaled", "loss-scaled"])
def test_fused_path_fp16_mean_keeps_a_loss_scalers_precision(monkeypatch, scaler):
    """fp16, the mean over 1024 rows of 32000 classes, the loss multiplied by a GradScaler-like factor before the
    backward: the fused path's gradients are as close to float64 as the unfused path's (it computes the mean's logit
    gradient at the sum's scale and divides in the backward: p / count underflows fp16 before the factor could lift
    it, which put the fused path 250x further from float64 than the unfused one with the factor)."""
    fn = _fused_stand_in(monkeypatch)
    n, h, v = 1024, 64, 32000
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.02
    target = torch.randint(0, v, (n,), generator=g)
    up = torch.tensor(scaler)

    def grads(f, dtype):
        leaves = [t.to(dtype).requires_grad_(True) for t in (hidden, weight)]
        (f(leaves[0], leaves[1], target) * up.to(dtype if dtype == torch.float64 else torch.float32)).backward()
        return [t.grad.double() / scaler for t in leaves]

    want = grads(_unfused, torch.float64)
    fused, unfused = grads(fn, torch.float16), grads(_unfused, torch.float16)
    for name, a, b, w in zip(("hidden", "weight"), fused, unfused, want):
        err, ref_err = ((a - w).norm() / w.norm()).item(), ((b - w).norm() / w.norm()).item()
        assert err <= 2 * ref_err + 1e-4, (name, scaler, err, ref_err)


def test_fused_path_fp16_mean_every_row_ignored(monkeypatch):
    """fp16, mean, every target ignore_index: the loss NaN (0 / 0, as F.cross_entropy) and the gradients zeros, as
    on the path that scales in the forward (bf16 here)."""
    fn = _fused_stand_in(monkeypatch)
    for dtype in (torch.float16, torch.bfloat16):
        hidden, weight, bias, target = _inputs(6, 8, 11, dtype, seed=12, ignored=range(6))
        loss, gh, gw, gb = _loss_and_grads(fn, hidden, weight, bias, target, chunk_rows=4)
        assert torch.isnan(loss), dtype
        for t in (gh, gw, gb):
            assert torch.equal(t, torch.zeros_like(t)), dtype


def test_fused_path_refuses_create_graph(monkeypatch):
    """The gradients come from the forward, without a graph: a backward with create_graph=True raises (it returned
    gradients without a graph, silently wrong second derivatives); impl='torch' is twice differentiable."""
    from pipegoose.nn.fusion import fused_linear_cross_entropy

    fn = _fused_stand_in(monkeypatch)
    hidden, weight, bias, target = _inputs(7, 8, 11, seed=8)
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    loss = fn(leaves[0], leaves[1], target, leaves[2], chunk_rows=3)
    with pytest.raises(RuntimeError, match="not twice differentiable .* impl='torch'"):
        torch.autograd.grad(loss, leaves[0], create_graph=True)
    loss = fused_linear_cross_entropy(leaves[0], leaves[1], target, leaves[2], impl="torch")
    (g,) = torch.autograd.grad(loss, leaves[0], create_graph=True)
    assert g.requires_grad


def test_hidden_size_zero_and_layouts():
    """H = 0 (logits of the bias alone) and a non-contiguous 3-D hidden: the unfused expression as written."""
    from pipegoose.nn.fusion import fused_linear_cross_entropy

    t = torch.tensor([0, 2, 1, 2, -100])
    for bias in (None, torch.randn(3)):
        got = fused_linear_cross_entropy(torch.randn(5, 0), torch.randn(3, 0), t, bias)
        want = F.cross_entropy(F.linear(torch.randn(5, 0), torch.randn(3, 0), bias), t)
        assert torch.equal(got, want)
    h = torch.randn(4, 3, 8, dtype=torch.bfloat16).transpose(0, 1)
    w, b = torch.randn(11, 8, dtype=torch.bfloat16), torch.randn(11, dtype=torch.bfloat16)
    t = torch.randint(0, 11, (3, 4))
    want = F.cross_entropy(F.linear(h, w, b).float().reshape(-1, 11), t.reshape(-1))
    assert torch.equal(fused_linear_cross_entropy(h, w, t, b), want)


def test_fused_path_every_row_ignored_and_out_of_range(monkeypatch):
    """Every row ignored: mean NaN (0 / 0, as F.cross_entropy), sum 0, zero gradients. A target out of range: NaN."""
    fn = _fused_stand_in(monkeypatch)
    hidden, weight, bias, target = _inputs(5, 8, 11, seed=5, ignored=range(5))
    loss, gh, gw, gb = _loss_and_grads(fn, hidden, weight, bias, target)
    assert torch.isnan(loss) and not gh.any() and not gw.any() and not gb.any()
    loss, gh, gw, gb = _loss_and_grads(fn, hidden, weight, bias, target, reduction="sum")
    assert loss.item() == 0 and not gh.any() and not gw.any()
    hidden, weight, bias, target = _inputs(5, 8, 11, seed=6, ignored=())
    target[2] = 11
    assert torch.isnan(fn(hidden, weight, target, bias))


def test_fused_path_16_bit(monkeypatch):
    """bf16 hidden and weight (the logits in bf16, as lm_head's): within bf16's rounding of the unfused path's
    result; gradients in bf16."""
    fn = _fused_stand_in(monkeypatch)
    hidden, weight, bias, target = _inputs(16, 32, 50, torch.bfloat16, seed=7)
    got = _loss_and_grads(fn, hidden, weight, bias, target, chunk_rows=5)
    want = _loss_and_grads(_unfused, hidden, weight, bias, target)
    assert got[1].dtype == got[2].dtype == got[3].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    for a, b in zip(got[1:], want[1:]):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-3, rtol=2e-2)


def test_default_chunk_rows():
    """The largest power of two of rows whose logits hold at most 2**27 values, at least 2048 rows, at most N."""
    assert (L.CHUNK_ELEMENTS, L.MIN_CHUNK_ROWS) == (1 << 27, 2048)
    assert L.default_chunk_rows(8192, 32000, 2048) == 4096         # Llama-1.1B: 2 chunks
    assert L.default_chunk_rows(8191, 32000, 2048) == 4096
    assert L.default_chunk_rows(65536, 32000, 2048) == 4096
    assert L.default_chunk_rows(65536, 16000, 2048) == 8192        # a smaller vocabulary: larger chunks
    assert L.default_chunk_rows(16384, 128256, 4096) == 2048       # Llama-3-8B: 1046 rows fit, the floor of 2048
    assert L.default_chunk_rows(8192, 151936, 896) == 2048         # Qwen2-0.5B
    assert L.default_chunk_rows(1000, 151936, 896) == 1000         # at most N
    assert L.default_chunk_rows(5, 11, 8) == 5
    assert L.default_chunk_rows(1, 151936, 896) == 1
    assert L.default_chunk_rows(0, 32000, 2048) == 1


# ---------------------------------------------------------------------------------------------- argument errors
def test_argument_errors_name_the_argument():
    hidden, weight, bias, target = _inputs(4, 8, 11)
    cases = [
        (lambda: fused_linear_cross_entropy(hidden.long(), weight, target), TypeError, "hidden: expected a floating"),
        (lambda: fused_linear_cross_entropy(hidden, "w", target), TypeError, "weight: expected a floating"),
        (lambda: fused_linear_cross_entropy(hidden, weight, target, bias.int()), TypeError, "bias: expected"),
        (lambda: fused_linear_cross_entropy(hidden, weight, [1, 2]), TypeError, "target: expected a torch.Tensor"),
        (lambda: fused_linear_cross_entropy(hidden, weight, target, ignore_index=1.5), TypeError, "ignore_index"),
        (lambda: fused_linear_cross_entropy(hidden, weight, target, chunk_rows=2.0), TypeError, "chunk_rows"),
        (lambda: fused_linear_cross_entropy(hidden, weight, target, chunk_rows=0), ValueError, "chunk_rows: expected"),
        (lambda: fused_linear_cross_entropy(hidden, weight, target, reduction="none"), ValueError,
         "reduction: expected one of mean, sum, got 'none'"),
        (lambda: fused_linear_cross_entropy(hidden, weight.t(), target), ValueError, r"weight: expected \[V, 8\]"),
        (lambda: fused_linear_cross_entropy(hidden, weight[None], target), ValueError, "weight: expected"),
        (lambda: fused_linear_cross_entropy(hidden, weight, target, bias[:3]), ValueError, r"bias: expected \[11\]"),
        (lambda: fused_linear_cross_entropy(hidden, weight, target[:3]), ValueError,
         "target: expected 4 class indices"),
        (lambda: fused_linear_cross_entropy(hidden[0, 0], weight, target), ValueError, "hidden: expected"),
        (lambda: fused_linear_cross_entropy(hidden, weight.to("meta"), target), ValueError,
         "weight: on meta, expected hidden's device cpu"),
        (lambda: fused_linear_cross_entropy(hidden, weight, target, impl="nope"), ValueError, "nope"),
    ]
    for call, kind, match in cases:
        with pytest.raises(kind, match=match):
            call()
    with pytest.raises(ValueError, match="reduction"):
        FusedLinearCrossEntropyLoss(reduction="none")
    with pytest.raises(ValueError, match="nope"):
        FusedLinearCrossEntropyLoss(impl="nope")


# ---------------------------------------------------------------------------------------------------- dispatch
def _cuda_problem(**kw):
    hidden, weight, bias, target = _inputs(6, 8, 11)
    p = L.problem(hidden, weight, target, bias)
    extra = dict(p.extra, **{k: v for k, v in kw.items() if k in p.extra})
    return type(p)(p.op, kw.get("dtype", p.dtype), CUDA, p.cols, p.needs_grad, extra)


def test_kernel_path_takes_cuda_inputs_and_says_why_not():
    assert L._pipegoose_supports(_cuda_problem()) == (True, "")
    ok, why = L._pipegoose_supports(_cuda_problem(weight_dtype=torch.bfloat16))
    assert not ok and "weight bfloat16 with hidden float32" in why
    ok, why = L._pipegoose_supports(_cuda_problem(target_dtype=torch.int32))
    assert not ok and "int64" in why
    ok, why = L._pipegoose_supports(_cuda_problem(numel=0))
    assert not ok and why == "an empty input"
    ok, why = L._pipegoose_supports(_cuda_problem(dtype=torch.float64, weight_dtype=torch.float64,
                                                  bias_dtype=torch.float64))
    assert not ok and "float64 not supported" in why
    c = dispatch.explain(OP, *_inputs(6, 8, 11)[:2], _inputs(6, 8, 11)[3])
    assert c.impl == "torch" and c.fallback and "CUDA" in c.reasons["pipegoose"]


def test_strict_mode_and_impl_on_cpu():
    hidden, weight, bias, target = _inputs(4, 8, 11)
    with dispatch.strict(), pytest.raises(dispatch.FusionFallbackError, match="CUDA"):
        fused_linear_cross_entropy(hidden, weight, target, bias)
    assert torch.equal(fused_linear_cross_entropy(hidden, weight, target, bias, impl="torch"),
                       _unfused(hidden, weight, target, bias))


def test_module_equals_the_functional():
    hidden, weight, bias, target = _inputs(6, 8, 11, seed=8)
    m = FusedLinearCrossEntropyLoss(reduction="sum", chunk_rows=4)
    assert repr(m) == "FusedLinearCrossEntropyLoss(ignore_index=-100, reduction='sum', chunk_rows=4)"
    assert torch.equal(m(hidden, weight, target, bias), _unfused(hidden, weight, target, bias, reduction="sum"))
    assert not list(m.parameters())
