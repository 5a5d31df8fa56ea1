"""Randomised differential tests of our CUDA kernels: each case draws a shape, dtypes, layout and options of one op at
random, runs the op through ``pipegoose.nn.fusion.functional`` with ``impl="pipegoose"`` in strict mode (the kernel
must take the input it claims to take: a fallback is a failure), forward and backward, with the outputs' memory
poisoned first (NaN-filled allocator blocks: an element the kernel does not write reads back as NaN), and compares
every output and gradient with a float64 reference, at the tolerances of ``tests/tolerances.py``.

The fixed-shape GPU tests pin the plans' edges that we know of; these cases land where nobody looked (widths between
the specialised ones, odd key lengths, frozen parameters with mixed dtypes, strided rows). The draws cover:

* softmax (plain, padding-masked with broadcast masks and fully masked rows, causal with sq <= sk): 1-40000 keys;
* LayerNorm and RMSNorm: 1-65536 columns, one or two normalised dims, parameters of the input's dtype or another,
  weight and bias present or not and frozen or not, strided rows, large means;
* SwiGLU: any shape, contiguous or strided; silu_and_mul and gelu_and_mul (gate and up packed in x [..., 2d]): d
  1-30000, 1-d to 4-d x, rows of wider tensors at random column offsets, transposed, narrowed and broadcast rows;
  cross-entropy: 2-160000 classes, ignored rows (a share of 0 to all), every reduction, strided rows; RoPE: head dims
  2-256, whole or partial rotary, both layouts, GQA, fp32 tables;
  fused linear cross-entropy: chunkings from 1 row to all, bias or not.

The ported copies run the same draws (``impl="megatron"`` for the softmaxes, ``"apex"`` for LayerNorm and the
clipping, ``"apex"`` and ``"deepspeed"`` for Adam): where a copy does not take a draw, the dispatcher runs another
kernel, which is then the one checked; where it claims a draw, its result must hold against float64 (so a copy's
``supports()`` that lets through an input the copy gets wrong fails here).

Reproduce a failure: its message names the case's draw; ``PIPEGOOSE_FUZZ_SEED=<n>`` (default 0) draws other cases and
``PIPEGOOSE_FUZZ_CASES=<n>`` (default 24) sets how many per op, ``PIPEGOOSE_FUZZ_MAX_NUMEL=<n>`` (default 2**22) the
elements of a case's largest tensor, e.g.
``PIPEGOOSE_FUZZ_SEED=7 python -m pytest -m cuda tests/kernels/test_fuzz_cuda.py``.
"""

from __future__ import annotations

import functools
import math
import os
import random

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import poison
from softmax_reference import softmax_ref
from tolerances import TOLERANCES, tol, weight_scale

from pipegoose.nn.fusion import dispatch
from pipegoose.nn.fusion import functional as PF
from pipegoose.nn.fusion.ops.linear_cross_entropy import default_chunk_rows

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("no_tuning_table")]

DEV = "cuda"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SEED = int(os.environ.get("PIPEGOOSE_FUZZ_SEED", "0"))
CASES = int(os.environ.get("PIPEGOOSE_FUZZ_CASES", "24"))
# elements of a case's largest tensor (2**22 by default: each case well under a second)
MAX_NUMEL = int(os.environ.get("PIPEGOOSE_FUZZ_MAX_NUMEL", str(1 << 22)))


@pytest.fixture(autouse=True)
def _strict_and_counted(monkeypatch):
    """No user override of the choice (PIPEGOOSE_IMPL_*), fresh counters, strict mode: a fallback raises."""
    for k in list(os.environ):
        if k.startswith("PIPEGOOSE_IMPL_"):
            monkeypatch.delenv(k)
    dispatch.reset_stats()
    with dispatch.strict():
        yield


def draw(op: str, i: int) -> random.Random:
    """The case's generator: the same draws for (seed, op, case) on every run and machine."""
    return random.Random(f"{SEED}:{op}:{i}")


def log_int(r: random.Random, lo: int, hi: int) -> int:
    """An integer in [lo, hi], log-uniform (as many short as long sizes)."""
    return min(hi, max(lo, int(round(math.exp(r.uniform(math.log(lo), math.log(hi + 1)))))))


def width(r: random.Random, lo: int, hi: int) -> int:
    """A row length: half the time any length (odd ones included), else a multiple of 8 (the vector paths)."""
    n = log_int(r, lo, hi)
    return n if r.random() < 0.5 else min(hi, max(lo, (n + 7) // 8 * 8))


def lead_and_rows(r: random.Random, row_numel: int) -> tuple:
    """0 to 2 leading dims (1-64 each) and a row count (1-4096), of at most MAX_NUMEL elements in rows of
    ``row_numel``."""
    lead = tuple(log_int(r, 1, 64) for _ in range(r.randint(0, 2)))
    return (*lead, max(1, min(MAX_NUMEL // (row_numel * max(1, math.prod(lead))), log_int(r, 1, 4096))))


def gen(r: random.Random) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(r.getrandbits(62))


def randn(shape, g, dtype=torch.float32, scale=1.0, shift=0.0):
    return (torch.randn(shape, generator=g, device=DEV) * scale + shift).to(dtype)


def strided_rows(t: torch.Tensor, r: random.Random, what: list,
                 kinds: tuple = ("contiguous", "padded rows", "transposed")) -> torch.Tensor:
    """``t`` itself, or a view of the same values whose rows are strided (a wider buffer's first columns), or a
    transposed copy viewed back (last dim not contiguous): of ``kinds``, the layouts the op takes (in the kernel or
    through its own copy). Appends the layout's name to ``what``."""
    kind = r.choice(kinds)
    what.append(kind)
    if kind == "padded rows":
        wide = torch.empty((*t.shape[:-1], t.shape[-1] + r.choice((1, 8, 61))), dtype=t.dtype, device=DEV)
        wide[..., :t.shape[-1]] = t
        return wide[..., :t.shape[-1]]
    if kind == "transposed" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    return t


def ran_kernel(op: str, impl: str = "pipegoose", what: list | None = None) -> None:
    """The op's counters: the kernel of ``impl`` ran, and nothing else did (strict mode already refused a fallback to
    the reference). A ported copy (``megatron``, ``apex``, ``deepspeed``) that does not take the draw is passed over
    by the dispatcher with a warning, for another kernel: then that one must have run, and ``what`` names it (the
    draw is checked against float64 all the same, so the copy's ``supports()`` is tested too: a draw it claims but
    gets wrong fails)."""
    got = dispatch.stats().get(op, {})
    case = f"; case {what}" if what is not None else ""
    if impl == "pipegoose":
        assert set(got) == {"pipegoose"}, f"{op}: expected our kernel, dispatcher counted {got}{case}"
        return
    assert len(got) == 1 and "torch" not in got, f"{op}: expected one fused kernel, dispatcher counted {got}{case}"
    if what is not None:
        what.append(f"ran {next(iter(got))}")


@pytest.fixture
def quiet_routing():
    """The warning of a forced ported copy that cannot take a draw (the dispatcher then runs another kernel)."""
    import warnings

    with warnings.catch_warnings():
        # (the message begins with the op's name: "layer_norm: impl='apex' cannot run this input: ...")
        warnings.filterwarnings("ignore", message=r".*impl='(megatron|apex|deepspeed)' cannot run this input")
        yield


def grads(fn, inputs, upstream):
    """``fn(*inputs)``'s output and the gradients of the inputs that require grad (None for the others), with the
    outputs' and gradients' memory poisoned before the forward and the backward: NaN blocks of the inputs' sizes
    (the gradients') and of the upstream gradients' (the outputs' shapes, in the outputs' dtype or a wider one: the
    losses in fp32, RoPE's fp32 results of 16-bit q and k)."""
    # (detach: new leaves on the same memory, strides kept; clone() would make padded rows contiguous)
    leaves = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in inputs]
    ups = upstream if isinstance(upstream, tuple) else (upstream,)
    sizes = [(t.shape, t.dtype) for t in (*inputs, *ups) if t is not None]
    poison(*sizes)
    out = fn(*leaves)
    poison(*sizes)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward([o for o in outs], [u.to(o.dtype) for o, u in zip(outs, ups)])
    torch.cuda.synchronize()
    return out, [None if t is None or not t.requires_grad else t.grad for t in leaves]


def ref_grads(fn, inputs, upstream):
    """The same in float64 (inputs cast to float64, each keeping its requires_grad)."""
    cast = [None if t is None else (t.detach().double() if t.is_floating_point() else t).requires_grad_(
        t.requires_grad) for t in inputs]
    out = fn(*cast)
    outs = out if isinstance(out, tuple) else (out,)
    ups = upstream if isinstance(upstream, tuple) else (upstream,)
    torch.autograd.backward(list(outs), [u.double() for u in ups])
    return out, [None if t is None or not t.requires_grad else t.grad for t in cast]


def close(name: str, got: torch.Tensor, want: torch.Tensor, what: list, *, dtype: torch.dtype, scale: float = 1.0,
          equal_nan: bool = False, extra_atol: float = 0.0) -> None:
    """Every element written (no NaN where the reference has none), and within the table's tolerance of ``dtype``
    (its ``atol`` widened by ``extra_atol``, an error bound of the op's fp32 math that the table does not know)."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}; case {what}"
    bad = got.isnan() & ~want.isnan()
    assert not bad.any(), f"{name}: {int(bad.sum())} NaN element(s) (unwritten?) where the reference has none; " \
                          f"case {what}"
    t = tol(dtype, scale)
    torch.testing.assert_close(got.double(), want.double(), atol=t["atol"] + extra_atol, rtol=t["rtol"],
                               equal_nan=equal_nan, msg=lambda m: f"{name} vs float64, case {what}: {m}")


# --- softmax -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["pipegoose", "megatron"])
@pytest.mark.parametrize("kind", ["plain", "masked", "causal"])
@pytest.mark.parametrize("case", range(CASES))
def test_softmax(kind, case, impl, quiet_routing):
    r = draw(f"softmax.{kind}", case)
    dtype = r.choice(DTYPES)
    sk = width(r, 1, 40000)
    if kind == "causal":
        sq = r.randint(max(1, sk - 3), sk) if sk <= 2048 and r.random() < 0.7 else log_int(r, 1, min(sk, 64))
        shape = (log_int(r, 1, max(1, min(48, MAX_NUMEL // (sq * sk)))), sq, sk)
    else:
        sq = log_int(r, 1, max(1, min(128, MAX_NUMEL // sk)))
        b = log_int(r, 1, 3)
        shape = (b, log_int(r, 1, max(1, min(8, MAX_NUMEL // (b * sq * sk)))), sq, sk)
    scale = r.choice((1.0, 0.125, 0.5, round(r.uniform(0.05, 2.0), 3)))
    g = gen(r)
    what = [f"seed {SEED}", kind, str(dtype), f"shape {shape}", f"scale {scale}"]
    x = strided_rows(randn(shape, g, dtype, scale=r.choice((1.0, 4.0, 16.0))), r, what)
    dy = randn(shape, g, dtype)
    mask = None
    if kind == "masked":
        b, h, _, _ = shape
        mshape = r.choice(((b, 1, sq, sk), (b, 1, 1, sk), (1, 1, sq, sk), (b, h, sq, sk)))
        mask = torch.rand(mshape, generator=g, device=DEV) < r.choice((0.0, 0.3, 0.9))
        if mshape[2] > 1 and r.random() < 0.5:
            mask[..., r.randrange(mshape[2]), :] = True   # a fully masked row
        what.append(f"mask {mshape}")
    fn = {"plain": lambda t: PF.scaled_softmax(t, scale, impl=impl),
          "masked": lambda t: PF.scaled_masked_softmax(t, mask, scale, impl=impl),
          "causal": lambda t: PF.scaled_upper_triang_masked_softmax(t, scale, impl=impl)}[kind]
    x.requires_grad_(True)
    y, (dx,) = grads(fn, [x], dy)
    ran_kernel({"plain": "softmax", "masked": "softmax.masked", "causal": "softmax.causal"}[kind], impl, what)
    assert y.dtype == dtype
    y64, (dx64,) = ref_grads(lambda t: softmax_ref(t, mask, scale, kind == "causal"), [x], dy)
    close("y", y.detach(), y64.detach(), what, dtype=dtype)
    close("dx", dx, dx64, what, dtype=dtype, scale=4)   # dx: the forward's rounding, then the backward's


# --- LayerNorm and RMSNorm ----------------------------------------------------------------------------------------

def layer_norm_ref(x, shape, w, b, eps):
    dims = tuple(range(x.dim() - len(shape), x.dim()))
    mu = x.mean(dims, keepdim=True)
    y = (x - mu) / torch.sqrt(((x - mu) ** 2).mean(dims, keepdim=True) + eps)
    return y * (1 if w is None else w) + (0 if b is None else b)


def rms_norm_ref(x, shape, w, eps):
    dims = tuple(range(x.dim() - len(shape), x.dim()))
    return x * torch.rsqrt((x * x).mean(dims, keepdim=True) + eps) * (1 if w is None else w)


@pytest.mark.parametrize("op,impl", [("layer_norm", "pipegoose"), ("layer_norm", "apex"), ("rms_norm", "pipegoose")])
@pytest.mark.parametrize("case", range(CASES))
def test_norm(op, impl, case, quiet_routing):
    r = draw(op, case)
    xdt = r.choice(DTYPES)
    h = width(r, 1, 65536)
    nshape = (h,)
    if h % 2 == 0 and r.random() < 0.2:
        nshape = (2, h // 2)   # two normalised dims
    rows = log_int(r, 1, max(1, min(16384, MAX_NUMEL // h)))
    lead = (rows,) if r.random() < 0.6 else (r.randint(1, 3), max(1, rows // 3))
    shape = (*lead, *nshape)
    pdt = r.choice((xdt, torch.float32, r.choice(DTYPES)))
    has_w = r.random() < 0.8
    has_b = op == "layer_norm" and r.random() < 0.7
    eps = r.choice((1e-5, 1e-6, 1e-12))
    g = gen(r)
    what = [f"seed {SEED}", op, f"x {xdt}", f"params {pdt}", f"shape {shape}", f"normalized {nshape}",
            f"weight {has_w}", f"bias {has_b}", f"eps {eps}"]
    shift = r.choice((0.0, 0.3, 50.0)) if op == "layer_norm" else 0.0
    x = strided_rows(randn(shape, g, xdt, scale=2.0, shift=shift), r, what).requires_grad_(True)
    w = randn(nshape, g, pdt).requires_grad_(r.random() < 0.8) if has_w else None
    b = randn(nshape, g, pdt).requires_grad_(r.random() < 0.8) if has_b else None
    what += [f"w grad {w is not None and w.requires_grad}", f"b grad {b is not None and b.requires_grad}"]
    dy = randn(shape, g)
    if op == "layer_norm":
        y, gs = grads(lambda a, c, d: PF.layer_norm(a, nshape, c, d, eps, impl=impl), [x, w, b], dy)
        y64, g64 = ref_grads(lambda a, c, d: layer_norm_ref(a, nshape, c, d, eps), [x, w, b], dy.to(y.dtype))
    else:
        y, gs = grads(lambda a, c: PF.rms_norm(a, nshape, c, eps, impl="pipegoose"), [x, w], dy)
        y64, g64 = ref_grads(lambda a, c: rms_norm_ref(a, nshape, c, eps), [x, w], dy.to(y.dtype))
    ran_kernel(op, impl, what)
    assert y.dtype == xdt, (y.dtype, what)   # (also with parameters of another dtype, as torch.nn.LayerNorm)
    low = xdt   # (parameters of another dtype are exact inputs: the math is fp32 either way)
    close("y", y.detach(), y64.detach(), what, dtype=low, scale=2)
    # dx = rstd * (dy * w - mean(dy * w) - ...): fp32's rounding of the row's means is multiplied by rstd, which a
    # row of one value, or of equal values, with a tiny eps makes huge (LayerNorm over 1 column at eps 1e-12: rstd
    # 1e6, dx 0.015 where float64 gives 0; seed 2). The bound: 4 fp32 roundings of max |dy * w|, times max rstd.
    dims = tuple(range(x.dim() - len(nshape), x.dim()))
    x64 = x.detach().double()
    var = (x64 - x64.mean(dims, keepdim=True)) ** 2 if op == "layer_norm" else x64 * x64
    rstd = torch.rsqrt(var.mean(dims) + eps).max().item()
    gw = (dy.to(y.dtype).double() * (1 if w is None else w.detach().double())).abs().max().item()
    dx_atol = 4 * 2.0 ** -24 * rstd * gw
    for name, got, want, t in zip(("dx", "dweight", "dbias"), gs, g64, (x, w, b)):
        if t is None or not t.requires_grad:
            continue
        assert got.dtype == t.dtype, (name, got.dtype, what)
        # dx: several roundings; the parameters' gradients: sums over every row in fp32, rounded once to their dtype
        close(name, got, want, what, dtype=low if name == "dx" else min_precision(low, t.dtype),
              scale=4 if name == "dx" else 16, extra_atol=dx_atol if name == "dx" else 0.0)


def min_precision(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The lower precision of two dtypes (the one with the wider tolerance)."""
    return max((a, b), key=lambda d: TOLERANCES[d]["rtol"])


# --- SwiGLU ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", range(CASES))
def test_swiglu(case):
    r = draw("swiglu", case)
    dtype = r.choice(DTYPES)
    last = width(r, 1, 30000)
    shape = (*lead_and_rows(r, last), last)
    g = gen(r)
    what = [f"seed {SEED}", str(dtype), f"shape {shape}"]
    gate = strided_rows(randn(shape, g, dtype, scale=r.choice((1.0, 4.0, 30.0))), r, what).requires_grad_(True)
    up = strided_rows(randn(shape, g, dtype), r, what).requires_grad_(True)
    dy = randn(shape, g, dtype)
    y, (dg, du) = grads(lambda a, c: PF.swiglu(a, c, impl="pipegoose"), [gate, up], dy)
    ran_kernel("swiglu", what=what)
    y64, (dg64, du64) = ref_grads(lambda a, c: F.silu(a) * c, [gate, up], dy)
    close("y", y.detach(), y64.detach(), what, dtype=dtype)
    close("dgate", dg, dg64, what, dtype=dtype, scale=2)
    close("dup", du, du64, what, dtype=dtype, scale=2)


def packed_layout(x: torch.Tensor, r: random.Random, what: list) -> torch.Tensor:
    """``x`` [..., 2d] itself or a view of its values that silu_and_mul reads in place or copies: in the rows of a
    wider buffer from a random column (odd ones misalign it: the scalar kernel; multiples of 8 with padding of a
    multiple of 8 keep 16-byte vectors), transposed (copied), the last rows of a taller tensor (in place, from row 1,
    where x has no leading dims; else its leading dims do not flatten to one row stride: copied), or one row
    broadcast (row stride 0). Appends the layout to ``what``."""
    kind = r.choice(("contiguous", "wider rows", "wider rows", "transposed", "narrowed", "broadcast row"))
    if kind == "wider rows":
        offset, extra = r.choice((0, 1, 3, 8, r.randrange(64))), r.choice((0, 1, 8, 61))
        what.append(f"in rows of {offset} + 2d + {extra} from column {offset}")
        wide = torch.full((*x.shape[:-1], offset + x.shape[-1] + extra), float("nan"), dtype=x.dtype, device=DEV)
        wide[..., offset:offset + x.shape[-1]] = x
        return wide[..., offset:offset + x.shape[-1]]
    if kind == "transposed" and x.dim() >= 2:
        what.append(kind)
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "narrowed" and x.dim() >= 2:
        what.append("rows 1: of a taller tensor")
        taller = torch.full((*x.shape[:-2], x.shape[-2] + 1, x.shape[-1]), float("nan"), dtype=x.dtype, device=DEV)
        taller[..., 1:, :] = x
        return taller[..., 1:, :]
    if kind == "broadcast row" and x.dim() >= 2:
        what.append(kind)
        return x[..., :1, :].expand(x.shape)
    what.append("contiguous")
    return x


@pytest.mark.parametrize("case", range(CASES))
def test_silu_and_mul(case):
    r = draw("swiglu.packed", case)
    dtype = r.choice(DTYPES)
    d = width(r, 1, 30000)
    rows = lead_and_rows(r, 2 * d)
    half = (d,) if r.random() < 0.1 else (*rows, d)   # (a 1-d x: one row)
    g = gen(r)
    what = [f"seed {SEED}", str(dtype), f"x {(*half[:-1], 2 * d)}"]
    gate, up = randn(half, g, dtype, scale=r.choice((1.0, 4.0, 30.0))), randn(half, g, dtype)
    x = packed_layout(torch.cat((gate, up), -1), r, what).requires_grad_(True)
    dy = randn(half, g, dtype)
    y, (dx,) = grads(lambda a: PF.silu_and_mul(a, impl="pipegoose"), [x], dy)
    ran_kernel("swiglu.packed", what=what)
    assert y.dtype == dtype and y.shape == dy.shape, (y.dtype, tuple(y.shape), what)
    y64, (dx64,) = ref_grads(lambda a: F.silu(a[..., :d]) * a[..., d:], [x], dy)
    close("y", y.detach(), y64.detach(), what, dtype=dtype)
    close("dx", dx, dx64, what, dtype=dtype, scale=2)


@pytest.mark.parametrize("case", range(CASES))
def test_gelu_and_mul(case):
    """gelu_and_mul (op geglu.packed): the layouts and sizes of test_silu_and_mul, either approximation."""
    r = draw("geglu.packed", case)
    dtype = r.choice(DTYPES)
    approximate = r.choice(("tanh", "none"))
    d = width(r, 1, 30000)
    rows = lead_and_rows(r, 2 * d)
    half = (d,) if r.random() < 0.1 else (*rows, d)
    g = gen(r)
    what = [f"seed {SEED}", str(dtype), approximate, f"x {(*half[:-1], 2 * d)}"]
    gate, up = randn(half, g, dtype, scale=r.choice((1.0, 4.0, 30.0))), randn(half, g, dtype)
    x = packed_layout(torch.cat((gate, up), -1), r, what).requires_grad_(True)
    dy = randn(half, g, dtype)
    y, (dx,) = grads(lambda a: PF.gelu_and_mul(a, approximate, impl="pipegoose"), [x], dy)
    ran_kernel("geglu.packed", what=what)
    assert y.dtype == dtype and y.shape == dy.shape, (y.dtype, tuple(y.shape), what)
    y64, (dx64,) = ref_grads(lambda a: F.gelu(a[..., :d], approximate=approximate) * a[..., d:], [x], dy)
    close("y", y.detach(), y64.detach(), what, dtype=dtype)
    close("dx", dx, dx64, what, dtype=dtype, scale=2)


# --- cross-entropy ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", range(CASES))
def test_cross_entropy(case):
    r = draw("cross_entropy", case)
    dtype = r.choice(DTYPES)
    v = width(r, 2, 160000)
    n = log_int(r, 1, max(1, min(8192, MAX_NUMEL // v)))
    reduction = r.choice(("mean", "sum", "none"))
    ignore_index = r.choice((-100, r.randrange(v)))
    share = r.choice((0.0, 0.1, 0.5, 1.0))
    g = gen(r)
    what = [f"seed {SEED}", str(dtype), f"[{n}, {v}]", reduction, f"ignore_index {ignore_index}",
            f"ignored share {share}"]
    # (the kernel takes rows at any stride, the classes contiguous: a transposed layout is a documented fallback)
    logits = strided_rows(randn((n, v), g, dtype, scale=r.choice((1.0, 5.0, 20.0))), r, what,
                          ("contiguous", "padded rows")).requires_grad_(True)
    target = torch.randint(0, v, (n,), generator=g, device=DEV)
    target[torch.rand(n, generator=g, device=DEV) < share] = ignore_index
    up = randn((n,), g) if reduction == "none" else randn((), g)
    loss, (dl,) = grads(lambda t: PF.cross_entropy(t, target, ignore_index=ignore_index, reduction=reduction,
                                                    impl="pipegoose"), [logits], up)
    ran_kernel("cross_entropy", what=what)
    assert loss.dtype == torch.float32
    loss64, (dl64,) = ref_grads(lambda t: F.cross_entropy(t, target, ignore_index=ignore_index, reduction=reduction),
                                [logits], up)
    every_row_ignored = bool((target == ignore_index).all())
    # the loss in fp32 from exact inputs; a mean over no rows is NaN, as PyTorch's
    close("loss", loss.detach(), loss64.detach(), what, dtype=torch.float32, equal_nan=every_row_ignored)
    close("dlogits", dl, dl64, what, dtype=dtype, equal_nan=every_row_ignored)


# --- RoPE ---------------------------------------------------------------------------------------------------------

def rope_ref(q, k, cos, sin, unsqueeze_dim):
    c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rot = cos.shape[-1]

    def one(x):
        xr, rest = x[..., :rot], x[..., rot:]
        half = rot // 2
        rotated = xr * c + torch.cat((-xr[..., half:], xr[..., :half]), -1) * s
        return torch.cat((rotated, rest), -1)

    return one(q), one(k)


@pytest.mark.parametrize("case", range(CASES))
def test_rope(case):
    r = draw("rope", case)
    dtype = r.choice(DTYPES)
    d = 2 * log_int(r, 1, 128)
    rot = d if r.random() < 0.6 else 2 * r.randint(1, d // 2)
    hq = log_int(r, 1, 16)
    hk = r.choice([h for h in range(1, hq + 1) if hq % h == 0])
    bsz = log_int(r, 1, 3)
    seq = log_int(r, 1, max(1, min(2048, MAX_NUMEL // (bsz * hq * d))))
    dim = r.choice((1, 2))
    tables = r.choice((dtype, torch.float32))
    g = gen(r)
    what = [f"seed {SEED}", str(dtype), f"B {bsz} S {seq} Hq {hq} Hk {hk} D {d} rotary {rot}",
            f"unsqueeze_dim {dim}", f"tables {tables}"]

    def heads(h):   # [B, S, H, D] as a projection gives it; unsqueeze_dim 1: its transposed view [B, H, S, D]
        t = randn((bsz, seq, h, d), g, dtype)
        t = t.transpose(1, 2) if dim == 1 else t
        if r.random() < 0.5:
            what.append(f"contiguous {h}")
            t = t.contiguous()
        return t.requires_grad_(True)

    q, k = heads(hq), heads(hk)
    angle = torch.rand((r.choice((1, bsz)), seq, rot // 2), generator=g, device=DEV, dtype=torch.float64) * 100
    angle = torch.cat((angle, angle), -1)
    cos, sin = angle.cos().to(tables), angle.sin().to(tables)
    out_dtype = torch.float32 if tables == torch.float32 else dtype
    up = (randn(q.shape, g, out_dtype), randn(k.shape, g, out_dtype))
    (qe, ke), (dq, dk, _, _) = grads(lambda a, b, c, s: PF.apply_rotary_pos_emb(a, b, c, s, dim, impl="pipegoose"),
                                     [q, k, cos, sin], up)
    ran_kernel("rope", what=what)
    assert qe.dtype == ke.dtype == out_dtype, (qe.dtype, ke.dtype, what)
    (qe64, ke64), (dq64, dk64, _, _) = ref_grads(lambda a, b, c, s: rope_ref(a, b, c, s, dim), [q, k, cos, sin], up)
    # values: one rounding, to the output's dtype, of products of exact inputs (the tables' own rounding is in both)
    close("q_embed", qe.detach(), qe64.detach(), what, dtype=out_dtype, scale=2)
    close("k_embed", ke.detach(), ke64.detach(), what, dtype=out_dtype, scale=2)
    close("dq", dq, dq64, what, dtype=dtype, scale=2)
    close("dk", dk, dk64, what, dtype=dtype, scale=2)


# --- fused linear cross-entropy --------------------------------------------------------------------------------

@pytest.mark.parametrize("case", range(CASES))
def test_fused_linear_cross_entropy(case):
    r = draw("fused_linear_cross_entropy", case)
    dtype = r.choice(DTYPES)
    hidden = width(r, 8, 1024)
    v = width(r, 2, 50000)
    n = log_int(r, 1, max(1, min(4096, MAX_NUMEL // v)))
    chunk = r.choice((None, 1, log_int(r, 1, n), n))
    reduction = r.choice(("mean", "sum"))
    has_bias = r.random() < 0.3
    g = gen(r)
    what = [f"seed {SEED}", str(dtype), f"N {n} H {hidden} V {v}", f"chunk_rows {chunk}", reduction,
            f"bias {has_bias}"]
    h = randn((n, hidden), g, dtype).requires_grad_(True)
    w = randn((v, hidden), g, dtype, scale=hidden ** -0.5).requires_grad_(True)
    b = randn((v,), g, dtype).requires_grad_(True) if has_bias else None
    target = torch.randint(0, v, (n,), generator=g, device=DEV)
    target[torch.rand(n, generator=g, device=DEV) < 0.1] = -100
    up = randn((), g)
    loss, gs = grads(lambda a, c, d: PF.fused_linear_cross_entropy(a, c, target, d, reduction=reduction,
                                                                   chunk_rows=chunk, impl="pipegoose"), [h, w, b], up)
    ran_kernel("fused_linear_cross_entropy", what=what)

    def unfused(a, c, d):
        return F.cross_entropy(F.linear(a, c, d).float() if a.dtype != torch.float64 else F.linear(a, c, d), target,
                               reduction=reduction)

    loss64, g64 = ref_grads(unfused, [h, w, b], up)
    # The logits are a GEMM in the input's dtype (as lm_head's), so the result is as close to float64 as the unfused
    # expression in that dtype allows: the bound is the table's plus twice the unfused expression's own error.
    loss_u, gs_u = grads(unfused, [h, w, b], up)
    every_row_ignored = bool((target == -100).all())
    # The weight's gradient is accumulated over the chunks in its dtype (documented: one rounding per chunk, as
    # Liger-Kernel's): the allowance of the op's own tests, weight_scale(chunks) times the table's rtol, of its
    # largest value (chunk_rows=1 over 969 rows in bf16 put 1040 of 5440 values past the table's tolerance, the
    # largest difference 1.74, on the H100).
    chunks = -(-n // (chunk or default_chunk_rows(n, v, hidden)))
    for name, got, want, base in zip(("loss", "dhidden", "dweight", "dbias"), (loss, *gs), (loss64, *g64),
                                     (loss_u, *gs_u)):
        if want is None:
            continue
        got, want, base = got.detach().double(), want.detach(), base.detach().double()
        slack = 2 * (base - want).abs().nan_to_num().max().item()
        if name == "dweight" and chunks > 1:
            slack += weight_scale(chunks) * TOLERANCES[dtype]["rtol"] * want.abs().nan_to_num().max().item()
        t = tol(dtype if name != "loss" else torch.float32)
        assert not (got.isnan() & ~want.isnan()).any(), f"{name}: NaN where the reference has none; case {what}"
        torch.testing.assert_close(got, want, atol=t["atol"] + slack, rtol=t["rtol"], equal_nan=every_row_ignored,
                                   msg=lambda m: f"{name} vs float64 (slack {slack:.3g}), case {what}: {m}")


# --- FusedAdam and clip_grad_norm_ -----------------------------------------------------------------------------

def param_shapes(r: random.Random) -> list:
    """1-300 parameters of 0 to 2**18 elements (odd sizes, empty ones, 1-3 dims), at most MAX_NUMEL in all."""
    shapes, total = [], 0
    for _ in range(log_int(r, 1, 300)):
        n = 0 if shapes and r.random() < 0.03 else log_int(r, 1, 1 << 18)   # (the first one not empty)
        if total + n > MAX_NUMEL:
            break
        total += n
        dims = r.choice((1, 1, 2, 3))
        shape = [n]
        for _ in range(dims - 1):   # split n into factors where it has them
            f = next((d for d in (2, 3, 4, 8) if shape[0] % d == 0 and shape[0] > d), 1)
            shape = [shape[0] // f, f, *shape[1:]]
        shapes.append(tuple(shape))
    return shapes


def param_dtypes(r: random.Random, shapes: list) -> list:
    """One dtype for all, or one each; an empty tensor takes the first one's (never empty): a dtype group of empty
    tensors only is no kernel's work (the dispatcher runs the reference there, source ``empty``, not a fallback)."""
    one = r.random() < 0.5
    first = r.choice(DTYPES)
    return [first if one or i == 0 or math.prod(s) == 0 else r.choice(DTYPES) for i, s in enumerate(shapes)]


@pytest.mark.parametrize("impl", ["pipegoose", "apex", "deepspeed"])
@pytest.mark.parametrize("case", range(CASES))
def test_fused_adam(case, impl, quiet_routing):
    from adam_reference import adam_state, adam_step64

    from pipegoose.nn.fusion import FusedAdam

    r = draw("adam", case)
    shapes = param_shapes(r)
    dtypes = param_dtypes(r, shapes)
    lr = math.exp(r.uniform(math.log(1e-3), math.log(0.3)))
    betas = (0.9, 0.999) if r.random() < 0.5 else (round(r.uniform(0.8, 0.95), 3), round(r.uniform(0.95, 0.9999), 4))
    eps = r.choice((1e-8, 1e-6))
    wd = r.choice((0.0, 0.01, 0.1))
    w_mode = r.random() < 0.7
    bias_correction = r.random() < 0.8
    steps_before = r.choice((0, 1, 6, 999))
    what = [f"seed {SEED}", f"{len(shapes)} params", f"dtypes {sorted({str(d) for d in dtypes})}", f"lr {lr:.3g}",
            f"betas {betas}", f"eps {eps}", f"weight_decay {wd}", f"adam_w_mode {w_mode}",
            f"bias_correction {bias_correction}", f"steps before {steps_before}"]
    seed = r.getrandbits(31)
    params, wants = [], []
    for i, (shape, dt) in enumerate(zip(shapes, dtypes)):
        (p,), (g,), (m,), (v,) = adam_state([shape], dt, DEV, seed=seed + i)
        p = torch.nn.Parameter(p)
        p.grad = g
        params.append((p, m, v))
        wants.append(adam_step64(p.detach(), g, m, v, steps_before + 1 if bias_correction else None, lr, betas, eps,
                                 wd, w_mode))
    opt = FusedAdam([p for p, _, _ in params], lr=lr, betas=betas, eps=eps, weight_decay=wd, adam_w_mode=w_mode,
                    bias_correction=bias_correction, impl=impl)
    for p, m, v in params:   # a run already under way: its moments and step count
        opt.state[p] = dict(step=torch.tensor(float(steps_before)), exp_avg=m, exp_avg_sq=v)
    opt.step()
    torch.cuda.synchronize()
    if any(p.numel() for p, _, _ in params):
        got = dispatch.stats().get("adam", {})   # (one call per bucket: the copies may take some buckets only)
        assert got and "torch" not in got, f"adam: expected fused kernels, dispatcher counted {got}; case {what}"
        what.append(f"ran {got}")
    for i, ((p, _, _), want) in enumerate(zip(params, wants)):
        st = opt.state[p]
        assert float(st["step"]) == steps_before + 1, (float(st["step"]), what)
        for name, got, ref in zip(("param", "exp_avg", "exp_avg_sq"), (p.detach(), st["exp_avg"], st["exp_avg_sq"]),
                                  want):
            # the Apex and DeepSpeed copies are built with --use_fast_math, as upstream builds them (approximate
            # square root and division): an fp32 parameter whose update cancels most of it was 1.19e-5 off where the
            # table allowed 1.10e-5 (seed 4, case 12, 2**26 elements); ours, on exact fp32 math, within it
            fast_math = impl != "pipegoose" and "pipegoose" not in dispatch.stats().get("adam", {})
            close(f"{name}[{i}] {tuple(got.shape)}", got, ref.to(DEV), what, dtype=p.dtype,
                  scale=4 if fast_math and name == "param" else 1)


@pytest.mark.parametrize("impl", ["pipegoose", "apex"])
@pytest.mark.parametrize("case", range(CASES))
def test_clip_grad_norm(case, impl, quiet_routing):
    from pipegoose.nn.fusion import clip_grad_norm_

    r = draw("clip_grad_norm", case)
    norm_type = r.choice((1.0, 2.0, 2.0, float("inf")))
    shapes = param_shapes(r)
    if math.isinf(norm_type):   # (torch's inf norm of an empty gradient raises: "does not have an identity")
        shapes = [s for s in shapes if math.prod(s) > 0]
    dtypes = param_dtypes(r, shapes)
    g = gen(r)
    params = []
    for shape, dt in zip(shapes, dtypes):
        p = torch.nn.Parameter(torch.zeros(shape, device=DEV, dtype=dt))
        p.grad = randn(shape, g, dt, scale=r.choice((1e-3, 1.0, 30.0)))
        params.append(p)
    # an fp16 group's norm past fp16's range is inf in torch (it takes each dtype group's norm in that dtype): that
    # overflow is tested elsewhere (test_fusion_cuda.py); here the fp16 groups stay within range
    half = [p for p in params if p.dtype == torch.float16]
    if half:
        n16 = float(torch.linalg.vector_norm(torch.cat([p.grad.double().flatten() for p in half]), norm_type))
        if n16 > 3e4:
            for p in half:
                p.grad = (p.grad.double() * (3e4 / n16)).to(torch.float16)
    g64 = [p.grad.double() for p in params]
    total64 = torch.linalg.vector_norm(torch.cat([t.flatten() for t in g64]), norm_type) if g64 else None
    # max_norm around the total: clipped or not (an inf norm of fp16 gradients stays within fp16's range)
    max_norm = float(total64) * r.choice((0.1, 0.9, 1.1, 1e9)) if total64 is not None else 1.0
    what = [f"seed {SEED}", f"{len(shapes)} params", f"dtypes {sorted({str(d) for d in dtypes})}",
            f"norm_type {norm_type}", f"max_norm {max_norm:.4g}", f"total {float(total64):.4g}"]
    total = clip_grad_norm_(params, max_norm, norm_type, impl=impl)
    torch.cuda.synchronize()
    if any(p.numel() for p in params):
        got = dispatch.stats().get("clip_grad_norm", {})   # (one call per dtype group)
        assert got and "torch" not in got, f"clip_grad_norm: expected fused kernels, counted {got}; case {what}"
        what.append(f"ran {got}")
    coarse = max(dtypes, key=lambda d: TOLERANCES[d]["rtol"])
    want_dtype = functools.reduce(torch.promote_types, dtypes)
    assert total.dtype == want_dtype, (total.dtype, what)
    close("total norm", total, total64, what, dtype=coarse)
    coef = min(1.0, max_norm / (float(total64) + 1e-6))
    for i, (p, want) in enumerate(zip(params, g64)):
        # clipped: the coefficient comes from the total, whose precision is the coarsest dtype's (torch's too: it
        # takes each dtype group's norm in that dtype)
        close(f"grad[{i}] {tuple(p.shape)}", p.grad, want * coef, what,
              dtype=p.dtype if coef == 1.0 else min_precision(p.dtype, coarse))
