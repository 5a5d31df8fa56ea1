"""Optimizer benchmarks: one AdamW step and one clip_grad_norm_ over 100M-1B parameters.

Parameters are laid out like Llama layers (hidden 2048: four 2048x2048 attention matrices, three 2048x5632 MLP
matrices, two 2048 norm vectors per layer) until the requested count is reached; grads, params and optimizer states
share one dtype (fp32, or bf16 for a pure-bf16 setup). Hyper-parameters: lr 1e-3 (timing) or 0.05 (correctness
check, large enough that a wrong update exceeds the bf16 rounding), betas (0.9, 0.999), eps 1e-8, weight decay 0.01,
AdamW (decoupled) mode.

Implementations:

* adamw: ``torch_fused`` = ``torch.optim.AdamW(fused=True)``; ``torch_foreach`` = ``AdamW(foreach=True)``;
  ``pipegoose`` = ``pipegoose.nn.fusion.optim.FusedAdam(impl="pipegoose")`` (our kernel, op ``pipegoose::adam_step``);
  ``fused_adam`` = ``FusedAdam()`` (the dispatcher's choice: what a user gets); ``apex`` / ``deepspeed`` = the raw
  ``torch.ops.pipegoose.multi_tensor_adam`` / ``deepspeed_multi_tensor_adam`` ops (Apex via ColossalAI 0.5.0,
  DeepSpeed 0.19.8) called with chunk size 2048*32, mode 1 (AdamW).
* clip_grad_norm: ``torch_foreach`` = ``torch.nn.utils.clip_grad_norm_(foreach=True)``; ``torch_loop`` =
  ``foreach=False``; ``pipegoose`` = ``pipegoose.nn.fusion.optim.clip_grad_norm_(impl="pipegoose")`` (our kernels,
  ops ``pipegoose::multi_tensor_norm`` and ``multi_tensor_mul_``); ``clip_grad_norm`` = ``clip_grad_norm_()`` (the
  dispatcher's choice: what a user gets); ``apex`` = raw ``multi_tensor_l2norm`` then ``multi_tensor_scale``.
  Two passes. ``step``: max_norm 1.0; before each timed call (untimed, before the L2 flush) the gradients are
  multiplied by :data:`CLIP_RESCALE`, so that every timed call clips (a read for the norm, a read and a write for the
  scale). ``unclipped``: max_norm :data:`UNCLIPPED_MAX_NORM`, above the gradients' norm, as in a step whose gradients
  need no clipping: the minimum is the norm's read (``P*s``); ours then skips the scaling pass, torch's multiplies by
  1, the raw Apex ops scale by 1 as Apex's ``clip_grad_norm_`` does. Only ``step`` rows give tuning rules.

Correctness gate: three steps with fresh random gradients from random (non-zero) parameters, compared with a float64
reference that rounds parameters and states to the storage dtype after every step (the same rounding as the
impls), using ``tests/tolerances.py``. clip_grad_norm_: the returned total norm and the clipped gradients.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any, Callable

import torch

from .byte_counts import op_bytes
from .common import Measurement, dtype_name
from .ops import Unavailable, Unsupported, check_close, classify
from .timing import Timer

__all__ = ["OPT_SIZES", "TUNABLE", "make_params", "run_optimizers", "adamw_reference", "upgrade_row"]

CLIP_RESCALE = 1000.0  # the clipped gradients' norm (~1) times this is far above max_norm 1.0
UNCLIPPED_MAX_NORM = 1e9  # far above the norm of the unit-normal gradients of 1e9 parameters (~3.2e4)

OPT_SIZES = {"full": [100_000_000, 300_000_000, 1_000_000_000], "quick": [100_000_000, 1_000_000_000],
             "dry": [60_000, 200_000]}
LR_CHECK, LR_TIME, BETAS, EPS, WD = 0.05, 1e-3, (0.9, 0.999), 1e-8, 0.01
CHUNK = 2048 * 32
# benchmark impl -> the dispatcher implementation it times (the tuning table's choices); others are comparisons
TUNABLE = {"adamw": {"pipegoose": "pipegoose", "torch_fused": "torch_fused", "torch_foreach": "torch", "apex": "apex",
                     "deepspeed": "deepspeed"},
           "clip_grad_norm": {"pipegoose": "pipegoose", "torch_foreach": "torch", "apex": "apex"}}


def upgrade_row(m: Measurement) -> None:
    """Bring a row of an optimizer benchmark written before session 46 (``tunable`` null; the dispatcher had no
    ``torch_fused`` or kernel of ours) up to date, in place, when a merge reads it: the implementation it timed is named
    (``torch_foreach`` -> ``torch``, ...), and the ``adamw`` row ``pipegoose``, which timed ``FusedAdam()``'s default of
    its day (the Apex copy), becomes ``fused_adam``: as ``pipegoose`` it would pass for our kernel and hide our kernel's
    own row when a later run measured nothing there (a review). Likewise a ``clip_grad_norm`` row ``pipegoose`` written
    before session 53 (``tunable`` null: ``clip_grad_norm_()``, the dispatcher's choice, before we had a kernel)
    becomes ``clip_grad_norm``. Other rows are left as they are."""
    if m.op not in TUNABLE or m.tunable is not None:
        return
    if m.op == "adamw" and m.impl == "pipegoose":
        m.impl = "fused_adam"
    elif m.op == "clip_grad_norm" and m.impl == "pipegoose":
        m.impl = "clip_grad_norm"
    else:
        m.tunable = TUNABLE[m.op].get(m.impl)


def layer_shapes(total: int, hidden: int) -> list[tuple[int, ...]]:
    """Tensor shapes of Llama-like layers (hidden ``hidden``) adding up to about ``total`` parameters (>= 1 layer)."""
    inter = hidden * 11 // 4
    layer = [(hidden, hidden)] * 4 + [(inter, hidden)] * 2 + [(hidden, inter)] + [(hidden,)] * 2
    per = sum(math.prod(s) for s in layer)
    return layer * max(1, round(total / per))


def make_params(total: int, dtype: torch.dtype, device: str, seed: int = 0) -> list[torch.Tensor]:
    hidden = 2048 if device == "cuda" else 32
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(s, generator=gen, device=device, dtype=torch.float32).to(dtype)
            for s in layer_shapes(total, hidden)]


def _randn_like(ts: list[torch.Tensor], seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    gen = torch.Generator(device=ts[0].device).manual_seed(seed)
    return [(torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32) * scale).to(t.dtype)
            for t in ts]


def adamw_reference(p: torch.Tensor, grads: list[torch.Tensor], lr: float, dtype: torch.dtype) -> torch.Tensor:
    """float64 AdamW over the successive ``grads`` starting from zero states, rounding p, m, v to ``dtype`` after
    each step as the impls store them. Returns the final parameter (float64)."""
    p = p.double()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    b1, b2 = BETAS
    for k, g in enumerate(grads, start=1):
        g = g.double()
        m = (b1 * m + (1 - b1) * g).to(dtype).double()
        v = (b2 * v + (1 - b2) * g * g).to(dtype).double()
        mhat, vhat = m / (1 - b1 ** k), v / (1 - b2 ** k)
        p = (p * (1 - lr * WD) - lr * mhat / (vhat.sqrt() + EPS)).to(dtype).double()
    return p


# --- AdamW impls: builder(params, lr) -> step(grads) ----------------------------------------------------------


def _torch_adamw(kind: str) -> Callable:
    def build(params: list[torch.Tensor], lr: float) -> Callable:
        ps = [torch.nn.Parameter(p, requires_grad=True) for p in params]
        opt = torch.optim.AdamW(ps, lr=lr, betas=BETAS, eps=EPS, weight_decay=WD, **{kind: True})

        def step(grads: list[torch.Tensor]) -> None:
            for p, g in zip(ps, grads):
                p.grad = g
            opt.step()
        return step, ps
    return build


def _fused_adam(impl: str | None) -> Callable:
    """``FusedAdam(impl=impl)``: None is the dispatcher's own choice (what a user gets); a named implementation must be
    the one that runs (Unsupported, or Unavailable where its kernel did not load, otherwise)."""
    def build(params: list[torch.Tensor], lr: float) -> Callable:
        try:
            from pipegoose.nn.fusion import dispatch
            from pipegoose.nn.fusion.optim import FusedAdam
        except Exception as e:
            raise Unavailable(f"pipegoose.nn.fusion.optim not importable: {type(e).__name__}: {e}") from None
        ps = [torch.nn.Parameter(p, requires_grad=True) for p in params]
        opt = FusedAdam(ps, lr=lr, betas=BETAS, eps=EPS, weight_decay=WD, adam_w_mode=True, impl=impl)
        checked = []

        def step(grads: list[torch.Tensor]) -> None:
            for p, g in zip(ps, grads):
                p.grad = g
            if impl is None or checked:
                opt.step()
                return
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")   # the request that cannot run: reported below instead
                opt.step()
            choice = dispatch.last_choice("adam")
            if choice is None or choice.impl != impl:
                why = (choice.reasons.get(impl) or choice.unmet) if choice is not None else "no choice recorded"
                exc = Unavailable if "unavailable" in why else Unsupported
                raise exc(f"{impl} not taken (dispatcher ran {choice.impl if choice else '?'}): {why}")
            checked.append(True)
        return step, ps
    return build


def _raw_adamw(kernel: str, op: str) -> Callable:
    def build(params: list[torch.Tensor], lr: float) -> Callable:
        if params[0].device.type != "cuda":
            raise Unavailable(f"{op} needs CUDA tensors (not built on a CPU run)")
        try:
            from pipegoose import kernels
            ops = kernels.load(kernel)
        except Exception as e:
            raise Unavailable(f"kernel {kernel}: {type(e).__name__}: {str(e)[:300]}") from None
        fn = getattr(ops, op)
        ps = list(params)
        m = [torch.zeros_like(p) for p in ps]
        v = [torch.zeros_like(p) for p in ps]
        noop = torch.zeros(1, dtype=torch.int32, device=ps[0].device)
        state = {"step": 0}

        def step(grads: list[torch.Tensor]) -> None:
            state["step"] += 1
            args = [CHUNK, noop, list(grads), ps, m, v, lr, BETAS[0], BETAS[1], EPS, state["step"], 1, 1, WD]
            if op == "multi_tensor_adam":
                args.append(1.0)   # ColossalAI's div_scale
            fn(*args)
        return step, ps
    return build


ADAMW = {"torch_fused": _torch_adamw("fused"), "torch_foreach": _torch_adamw("foreach"),
         "pipegoose": _fused_adam("pipegoose"), "fused_adam": _fused_adam(None),
         "apex": _raw_adamw("apex/multi_tensor_adam", "multi_tensor_adam"),
         "deepspeed": _raw_adamw("deepspeed/multi_tensor_adam", "deepspeed_multi_tensor_adam")}


# --- clip_grad_norm_ impls: builder() -> clip(grads) -> total norm ---------------------------------------------


def _torch_clip(foreach: bool) -> Callable:
    def build(grads: list[torch.Tensor], max_norm: float) -> Callable:
        ps = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]   # clipping reads only .grad
        for p, g in zip(ps, grads):
            p.grad = g
        return lambda: torch.nn.utils.clip_grad_norm_(ps, max_norm, foreach=foreach)
    return build


def _pipegoose_clip(impl: str | None) -> Callable:
    """``clip_grad_norm_(impl=impl)``: None is the dispatcher's own choice (what a user gets); a named implementation
    must be the one that runs (Unsupported, or Unavailable where its kernel did not load, otherwise)."""
    def build(grads: list[torch.Tensor], max_norm: float) -> Callable:
        try:
            from pipegoose.nn.fusion import dispatch
            from pipegoose.nn.fusion.optim import clip_grad_norm_
        except Exception as e:
            raise Unavailable(f"pipegoose.nn.fusion.optim not importable: {type(e).__name__}: {e}") from None
        ps = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]   # clipping reads only .grad
        for p, g in zip(ps, grads):
            p.grad = g
        if impl is not None:
            choice = dispatch.choose("clip_grad_norm", dispatch.problem_of("clip_grad_norm", grads, 2.0), impl)
            if choice.impl != impl:
                why = choice.reasons.get(impl) or choice.unmet
                raise (Unavailable if "unavailable" in why else Unsupported)(
                    f"{impl} not taken (dispatcher would run {choice.impl}): {why}")
        return lambda: clip_grad_norm_(ps, max_norm, impl=impl)
    return build


def _apex_clip(grads: list[torch.Tensor], max_norm: float) -> Callable:
    if grads[0].device.type != "cuda":
        raise Unavailable("multi_tensor_l2norm needs CUDA tensors (not built on a CPU run)")
    if grads[0].dtype not in (torch.float32, torch.float16):
        raise Unsupported(f"the Apex copies take fp32 and fp16 gradients, not {grads[0].dtype}")
    try:
        from pipegoose import kernels
        l2 = kernels.load("apex/multi_tensor_l2norm").multi_tensor_l2norm
        sc = kernels.load("apex/multi_tensor_scale").multi_tensor_scale
    except Exception as e:
        raise Unavailable(f"apex multi-tensor kernels: {type(e).__name__}: {str(e)[:300]}") from None
    noop = torch.zeros(1, dtype=torch.int32, device=grads[0].device)

    def clip() -> torch.Tensor:
        norm, _ = l2(CHUNK, noop, grads, False)
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        sc(CHUNK, noop, grads, grads, float(coef))   # the scale op takes a float: one host sync, as in Apex
        return norm
    return clip


CLIP = {"torch_foreach": _torch_clip(True), "torch_loop": _torch_clip(False), "pipegoose": _pipegoose_clip("pipegoose"),
        "clip_grad_norm": _pipegoose_clip(None), "apex": _apex_clip}


def _check_adamw(build: Callable, params0: list[torch.Tensor], dtype: torch.dtype, tol: dict) -> tuple[str, float, str]:
    params = [p.clone() for p in params0]
    step, ps = build(params, LR_CHECK)
    grad_sets = [_randn_like(params0, seed=100 + k) for k in range(3)]
    for gs in grad_sets:
        step(gs)
    worst, bad = 0.0, []
    for i, (p0, p) in enumerate(zip(params0, ps)):
        ref = adamw_reference(p0, [gs[i] for gs in grad_sets], LR_CHECK, dtype).float()
        ok, err, nbad = check_close(p.detach(), ref, tol["atol"], tol["rtol"])
        worst = max(worst, err) if not math.isnan(err) else err
        if not ok:
            bad.append(f"param {i} {tuple(p.shape)}: {nbad} elements off (max abs err {err:.3g})")
            if len(bad) >= 3:
                break
    return ("FAILED" if bad else "ok"), worst, "; ".join(bad)


def _check_clip(build: Callable, grads0: list[torch.Tensor], tol: dict, max_norm: float) -> tuple[str, float, str]:
    grads = [g.clone() for g in grads0]
    total = build(grads, max_norm)()
    ref_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads0))
    coef = min(1.0, max_norm / (ref_norm + 1e-6))
    problems = []
    got = float(total)
    if not abs(got - ref_norm) <= tol["rtol"] * ref_norm + tol["atol"]:
        problems.append(f"total norm {got:.6g}, expected {ref_norm:.6g}")
    worst = abs(got - ref_norm)
    for i, (g0, g) in enumerate(zip(grads0, grads)):
        ref = (g0.double() * coef).to(g0.dtype).float()
        ok, err, nbad = check_close(g, ref, tol["atol"], tol["rtol"])
        worst = max(worst, err)
        if not ok:
            problems.append(f"grad {i}: {nbad} elements off (max abs err {err:.3g})")
            break
    return ("FAILED" if problems else "ok"), worst, "; ".join(problems)


def run_optimizers(dtypes: list[torch.dtype], mode: str, device: str, timer: Timer, tol_table: dict,
                   impl_filter: list[str] | None, deadline: float, ops: tuple[str, ...] = ("adamw", "clip_grad_norm"),
                   log: Callable[[str], None] = print) -> list[Measurement]:
    results: list[Measurement] = []
    for total in OPT_SIZES[mode]:
        for dtype in dtypes:
            params0 = make_params(total, dtype, device, seed=1)
            n = sum(p.numel() for p in params0)
            shape = {"params": n, "tensors": len(params0)}
            for op, table, pas in (("adamw", ADAMW, "step"), ("clip_grad_norm", CLIP, "step"),
                                   ("clip_grad_norm", CLIP, "unclipped")):
                if op not in ops:
                    continue
                nbytes = op_bytes(op, pas, shape, dtype_name(dtype))
                max_norm = UNCLIPPED_MAX_NORM if pas == "unclipped" else 1.0
                for name, build in table.items():
                    if impl_filter and name not in impl_filter:
                        continue
                    base = dict(op=op, impl=name, dtype=dtype_name(dtype), pas=pas, shape=shape, cols=n,
                                bytes=nbytes, tunable=TUNABLE[op].get(name))
                    if time.perf_counter() > deadline:
                        results.append(Measurement(**base, status="skipped", detail="time budget"))
                        continue
                    try:
                        if op == "adamw":
                            status, err, detail = _check_adamw(build, params0, dtype, tol_table[dtype])
                        else:
                            grads0 = _randn_like(params0, seed=7)
                            status, err, detail = _check_clip(build, grads0, tol_table[dtype], max_norm)
                    except Exception as e:  # noqa: BLE001
                        status, err, detail = classify(e), None, f"{type(e).__name__}: {str(e)[:300]}"
                    if status != "ok":
                        results.append(Measurement(**base, status=status, max_abs_err=err, detail=detail))
                        log(f"  {op:15s} {pas:9s} {dtype_name(dtype):8s} {n/1e6:7.1f}M {name:13s} {status}: "
                            f"{detail[:120]}")
                        continue
                    try:
                        if op == "adamw":
                            step, _ = build([p.clone() for p in params0], LR_TIME)
                            grads = _randn_like(params0, seed=3)
                            t = timer.time(lambda _: step(grads))
                        else:
                            grads = _randn_like(params0, seed=3)
                            clip = build(grads, max_norm)
                            setup = (lambda: torch._foreach_mul_(grads, CLIP_RESCALE)) if pas == "step" else None
                            t = timer.time(lambda _: clip(), setup=setup)
                    except Exception as e:  # noqa: BLE001
                        results.append(Measurement(**base, status="error", max_abs_err=err,
                                                   detail=f"timing: {type(e).__name__}: {str(e)[:300]}"))
                        continue
                    results.append(Measurement(**base, status="ok", max_abs_err=err,
                                               gbps=nbytes / (t["median_ms"] * 1e-3) / 1e9, **t))
                    log(f"  {op:15s} {pas:9s} {dtype_name(dtype):8s} {n/1e6:7.1f}M {name:13s} ok  "
                        f"{t['median_ms']:.3f} ms")
                    del t
                    if device == "cuda":
                        torch.cuda.empty_cache()
            del params0
            if device == "cuda":
                torch.cuda.empty_cache()
    return results
