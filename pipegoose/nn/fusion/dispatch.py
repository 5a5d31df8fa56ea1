"""One dispatcher for every fused op: implementations, ``supports()`` checks, choice, counters and strict mode.

Each op (``softmax``, ``softmax.masked``, ``softmax.causal``, ``layer_norm``, ``rms_norm``, ``rms_norm_gated``,
``swiglu``, ``swiglu.packed``, ``geglu``, ``geglu.packed``, ``gelu``, ``squared_relu``, ``rope``, ``cross_entropy``,
``fused_linear_cross_entropy``, ``adam``, ``clip_grad_norm``) has several :class:`Implementation` s: ours
(``pipegoose``; ``ops`` for ``rms_norm_gated``: two other ops of ours), fused kernels that ship in PyTorch
(``torch_fused``: ``adam``'s ``torch._fused_adamw_``), ported registry copies (``megatron``, ``apex``, ``deepspeed``)
and the PyTorch reference (``torch``). Each declares
``supports(problem) -> (ok, reason)`` over a :class:`Problem` (shapes, dtypes, device, layout: metadata only, no
kernel runs), and names the manifest kernel it needs; the kernel is loaded on first use
(``pipegoose.kernels.load``) and a failed load becomes a reason (``"pipegoose/softmax unavailable: ..."``).

Choice, first that supports the input wins:

1. the explicit ``impl=`` argument of the call (case and surrounding blanks ignored, as in the variables);
2. the environment: ``PIPEGOOSE_IMPL_<OP>`` (``.`` -> ``_``, e.g. ``PIPEGOOSE_IMPL_SOFTMAX_CAUSAL``), then the
   family's ``PIPEGOOSE_IMPL_<FAMILY>`` (``PIPEGOOSE_IMPL_SOFTMAX`` covers the three softmax ops,
   ``PIPEGOOSE_IMPL_SWIGLU`` both SwiGLU ops, ``PIPEGOOSE_IMPL_GEGLU`` both GeGLU ops); ``auto`` = none (in the op's
   own variable it overrides the family's);
3. the tuning table of the input's GPU (``pipegoose/nn/fusion/tuning/<slug>.json``, docs/architecture.md
   "Tuning tables"): the first rule whose op and dtype match, whose ``max_cols`` is not exceeded and whose
   implementation supports the input (rules whose ``pass`` matches the call, ``fwd`` or ``fwd+bwd``, first);
4. the built-in order: ours, then PyTorch's fused kernels, then the ported copies, then ``torch``; an implementation
   registered ``opt_in`` (a kernel, or a path of one for some inputs, not yet timed against the others on a GPU) is
   left out of it (for those inputs): it runs when a request (1, 2) or a tuning rule (3) names it;
5. before 3 and 4, small problems: when the input has fewer than ``PIPEGOOSE_SMALL_NUMEL`` elements (default
   2**24; 0 turns this off), a fused implementation supports it, and the op's reference implementation is
   registered ``small_first`` for it (``Implementation.small_first``, set for the ops ``layer_norm``
   (``F.layer_norm``), ``rms_norm`` (``F.rms_norm``; its ``tuned_for`` limits it to the problems the reference runs
   as that one op, not Llama's rounding or mixed dtypes), ``swiglu`` (``F.silu(gate) * up``, two native ops),
   ``swiglu.packed`` (the same of ``x.chunk(2, -1)``; ``x``'s elements count), ``geglu`` (``F.gelu(gate,
   approximate=approximate) * up``), ``geglu.packed`` (the same of ``x.chunk(2, -1)``), ``gelu`` (``F.gelu``) and
   ``squared_relu`` (``torch.square(F.relu(x))``)),
   the reference runs (source ``small``, not a fallback; no kernel is loaded). At such sizes a step is bound by the
   host, and a fused op's path (the Python dispatch above the op, the op's own host code) costs more host time than
   its kernel can save on the GPU (MiniLM, BERT-base and GPT-2 small steps with their LayerNorms fused were slower
   than unfused ones on the H200; see :data:`SMALL_NUMEL_DEFAULT`; no measurement of SwiGLU at these sizes is
   recorded). No other op has the rule (RoPE's reference, transformers' formula, is ten kernels).
6. before 5, an input of no elements (a problem whose ``numel`` is 0: a zero-size normalized_shape, an empty batch):
   the reference runs (source ``empty``, not a fallback: there is nothing for a kernel to compute); a request that
   named a kernel still warns that it could not run. (The fused modules' small-input shortcut counts such inputs as
   ``small``; ``adam``'s and ``clip_grad_norm``'s problems carry one, so that a bucket of empty parameters or a group
   of empty gradients is ``empty``.)

Ending on ``torch`` after a fused implementation was wanted is a *fallback*: the reason is recorded
(:func:`explain`, :func:`last_choice`), logged at debug level on ``pipegoose.nn.fusion.dispatch``, and in strict
mode (``PIPEGOOSE_STRICT=1`` or ``with dispatch.strict():``) raises :class:`FusionFallbackError`.
``PIPEGOOSE_STRICT`` takes ``1``/``true``/``yes``/``on`` and ``0``/``false``/``no``/``off``/empty (any case); another
value raises ``ValueError`` naming it wherever strict mode is read (when a call chooses: the first call of each
signature, see "Choice cache"; at every fallback; when ``torch.compile`` traces a call), as a bad
``PIPEGOOSE_IMPL_*`` value does, instead of meaning off. Asking for
``torch`` (argument, environment or tuning rule) is not a fallback. A request (``impl=`` argument,
``PIPEGOOSE_IMPL_*``) that cannot run the input warns (``UserWarning``, naming the request, why, and what runs
instead; once per op, request and reason until :func:`reset_stats`), and the choice goes on as without it.

Under ``torch.compile``: while the compiler traces a call and nothing asks for an implementation (no ``impl=``
argument, no ``PIPEGOOSE_IMPL_*`` variable for the op, not strict mode), the op entry points emit the PyTorch
reference op (:func:`compile_passthrough`), which the compiler fuses into its own kernels; the dispatcher's Python
(choice cache, locks, counters) would otherwise break the graph at every fused module. Such calls are not counted.
Asking for an implementation keeps the dispatcher (and its graph breaks). The request is read when the compiler
traces: a compiled graph keeps what it saw (no recompilation when the variable or strict mode changes later; set them
before the first compiled call, or call ``torch._dynamo.reset()``).

Counters: :func:`stats` -> ``{op: {impl: calls}}``, :func:`reset_stats`.

Choice cache. A choice depends only on metadata (dtypes, shapes, devices, grad and autocast state), so the op
entry points remember it per call signature (:func:`cached_choice` / :func:`remember_choice`, keyed by the op, the
``impl`` argument, the op's signature tuple and the values of its ``PIPEGOOSE_IMPL_*`` variables and of
``PIPEGOOSE_SMALL_NUMEL``): a repeated call
skips argument validation and :func:`choose` (tens of microseconds of Python per call, which a small model pays on
every layer). Every cached call is still counted, remembered for :func:`last_choice` and checked against strict
mode. The cache is emptied by :func:`register`, :func:`unregister`, :func:`clear_kernel_cache`,
:func:`clear_tuning_cache`, :func:`reset_stats` and :func:`clear_choice_cache`, and when it holds 4096 entries.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import importlib
import json
import logging
import os
import re
import sys
import threading
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from pipegoose import _env
from pipegoose.kernels.manifest import UnknownNameError

__all__ = [
    "FusionFallbackError",
    "TuningTableError",
    "Problem",
    "Implementation",
    "Choice",
    "TuningRule",
    "TuningTable",
    "register",
    "register_problem",
    "implementations",
    "check_impl",
    "check_env",
    "check_attention_env",
    "ATTENTION_ENV_VALUES",
    "choose",
    "select",
    "record",
    "choice_key",
    "cached_choice",
    "remember_choice",
    "clear_choice_cache",
    "explain",
    "problem_of",
    "last_choice",
    "stats",
    "reset_stats",
    "strict",
    "is_strict",
    "kernel",
    "clear_kernel_cache",
    "tuning_table",
    "small_numel",
    "SMALL_NUMEL_DEFAULT",
    "compile_passthrough",
    "device_slug",
    "TUNING_DIR",
    "IMPL_NAMES",
]

logger = logging.getLogger(__name__)

TUNING_DIR = Path(__file__).resolve().parent / "tuning"
IMPL_NAMES = ("pipegoose", "megatron", "apex", "deepspeed", "torch", "torch_fused", "sdpa", "eager")
# native (a fused kernel that ships in PyTorch) before the ported copies: where both exist (adam) it measured faster
# (H200, 2026-11-29/30: AdamW bf16 2.67-2.74 TB/s against the Apex copy's 1.35-1.42, fp32 3.43-3.48 against 3.30-3.34)
_KIND_ORDER = {"ours": 0, "native": 1, "ported": 2, "reference": 3}
_PASSES = ("fwd", "fwd+bwd")
# Small problems (see the module docstring). Measured on the H200 host (benchmarks/overhead.py, 2026-11-29): a fused
# LayerNorm/RMSNorm call cost about 230 us more host time per forward + backward than F.layer_norm / F.rms_norm
# (session 20 cut the excess by ~40%, measured on a CPU with the kernels emulated), while ours saves the GPU about 3 ps
# per bf16 element over the native LayerNorm (fwd+bwd, ~10 bytes at 87.5% instead of 39% of 4.2 TB/s). Whether a step
# hides the host cost depends on the model; measured (H200, bf16, paired steps,
# benchmarks/results/nvidia_h200_2026-11-30/session20.log) with the default at 2**20: BERT-base at batch 32 x 128 and
# 16 x 512 (LayerNorm inputs of 3.1M and 6.3M elements) and GPT-2 small with SDPA at 8 x 1024 (6.3M) took 20-30%
# longer per step fused than unfused (x0.77-0.83; GPT-2 with eager attention 3% longer), while GPT-NeoX ~405M at
# 8 x 2048 (16.8M; one older run in results.json, 2026-11-30) ran 2% faster. Hence 2**24, from these two points (nothing
# measured between 6.3M and 16.8M): below it the native op (and SDPA for attention scores) runs. Session 21
# (session21.log) profiled BERT-base at 32 x 128: the step is bound by the host (self CPU 36.3 ms per step unfused,
# 46.3 fused; GPU time 14.8 and 14.1). It moved the norms' autograd into C++: a LayerNorm of 4096-16384 x 768 then
# cost 56-62 us more host time per forward + backward than nn.LayerNorm instead of 85-127, and the same paired steps
# with ours at every size (PIPEGOOSE_SMALL_NUMEL=0) ran x0.84-0.94 (GPT-2 with eager attention x1.12) instead of
# x0.80-0.87 (x0.875): still slower, so the default stays.
SMALL_NUMEL_DEFAULT = 1 << 24


class FusionFallbackError(RuntimeError):
    """Strict mode: an op would have fallen back to its PyTorch reference path. The message names op and reason."""


class TuningTableError(ValueError):
    """A tuning table is malformed: the message names the file, the rule and the field."""


@dataclass(frozen=True)
class Problem:
    """What an implementation needs to know to say whether it supports a call (metadata only).

    Attributes:
        op: the op name (``softmax.masked``, ``layer_norm``, ...).
        dtype: the compute input dtype (after any autocast cast), used for tuning rules.
        device: the device of the inputs.
        cols: size of the last (normalized / key) dimension, for tuning rules' ``max_cols``; None if meaningless.
        needs_grad: whether a backward will run (tuning rules' ``pass``).
        extra: op-specific facts (shapes, mask shape and dtype, scale, contiguity, parameter dtypes, ...).
    """

    op: str
    dtype: torch.dtype
    device: torch.device
    cols: int | None = None
    needs_grad: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.extra[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.extra.get(key, default)


SupportsFn = Callable[[Problem], "tuple[bool, str]"]


@dataclass(frozen=True)
class Implementation:
    """One implementation of an op.

    Attributes:
        op: the op it implements.
        name: ``pipegoose``, ``megatron``, ``apex``, ``deepspeed``, ``torch_fused`` or ``torch`` (``sdpa``/``eager``
            for attention).
        kind: ``ours``, ``native`` (a fused kernel that ships in PyTorch), ``ported`` or ``reference`` (orders the
            built-in choice in that order).
        supports: ``supports(problem) -> (ok, reason)``; the reason says what is not supported.
        kernels: manifest kernels (ids or aliases) loaded, in order, before the first use; empty for ``torch``.
        source: where the kernel comes from (project, file, version, license) for docs and reports.
        tuned_for: ``tuned_for(problem) -> bool``, whether the benchmark timings behind the tuning table describe
            what this implementation runs for ``problem`` (None: always). The benchmarks time each implementation
            in one configuration (rms_norm's ``torch`` as the single ``F.rms_norm`` kernel, say); where the
            implementation runs other code for a problem (Llama's rounding needs the multi-kernel eager formula),
            a tuning rule naming it does not apply, and the choice goes on to the next rule.
        small_first: (reference implementations) the op's reference path is native PyTorch, cheaper on the host
            than any fused path (``F.layer_norm``, ``F.rms_norm``, ``F.silu(gate) * up``): problems below
            :func:`small_numel` elements run it (see "Small problems"; choice step 5).
        opt_in: left out of the built-in order (choice step 4): it runs only where a request (``impl=``,
            ``PIPEGOOSE_IMPL_*``) or a tuning rule names it. For a kernel whose speed against the others has not been
            measured yet: a default must come from a benchmark, not from being ours. True, or
            ``opt_in(problem) -> bool`` for a path of the kernel that only some inputs take (pair it with
            ``tuned_for``, so that the rules timed on the other inputs do not name it either). No implementation is
            registered opt-in now (our clipping kernel was, until session 56 timed it; so was rope's partial rotary
            path on slices, until session 55 replaced it).
    """

    op: str
    name: str
    kind: str
    supports: SupportsFn
    kernels: tuple[str, ...] = ()
    source: str = ""
    tuned_for: Callable[[Problem], bool] | None = None
    small_first: bool = False
    opt_in: bool | Callable[[Problem], bool] = False

    def is_opt_in(self, problem: Problem) -> bool:
        """Whether this implementation is opt-in for ``problem`` (see ``opt_in``)."""
        return self.opt_in(problem) if callable(self.opt_in) else bool(self.opt_in)

    def __post_init__(self) -> None:
        if self.kind not in _KIND_ORDER:
            raise ValueError(f"Implementation.kind: expected one of {sorted(_KIND_ORDER)}, got {self.kind!r}")
        if self.opt_in is not False and self.kind == "reference":
            raise ValueError(f"Implementation.opt_in: a reference implementation ({self.op} {self.name}) is the "
                             "fallback of every choice and cannot be opt-in")


@dataclass(frozen=True)
class Choice:
    """The result of a choice: the implementation to run and why.

    Attributes:
        op, impl: the op and the chosen implementation's name.
        source: ``argument``, ``env``, ``tuning``, ``builtin``, ``small``, ``empty`` (an input of no elements: the
            reference, not a fallback) or ``fallback``.
        fallback: True when the reference path runs because the wanted fused paths cannot.
        reasons: implementation name -> why it was not taken (empty string when it was not looked at).
        reason: one line summarising why the chosen implementation runs.
        unmet: the requests (``impl=`` argument, ``PIPEGOOSE_IMPL_*``) that could not run this input and why (an
            argument that could not run also where the variable's request then ran); empty when none was made or the
            first one ran. :func:`record` warns about them (``UserWarning``).
    """

    op: str
    impl: str
    source: str
    fallback: bool
    reasons: Mapping[str, str]
    reason: str
    unmet: str = ""

    def __str__(self) -> str:
        details = [(name, why) for name, why in self.reasons.items() if why]
        reason = self.reason
        if details and reason == "; ".join(f"{name}: {why}" for name, why in details):
            reason = "no fused implementation takes it (why, below)"  # the summary is the list below: once
        lines = [f"{self.op}: {self.impl} ({self.source}){' FALLBACK' if self.fallback else ''}: {reason}"]
        if self.unmet:  # a request that could not run (impl=, PIPEGOOSE_IMPL_*): said first, it is what the caller asked
            lines.append(f"  not as requested: {self.unmet}")
        lines += [f"  {name}: {why}" for name, why in details]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Registry

_lock = threading.RLock()
_impls: dict[str, dict[str, Implementation]] = {}
_problem_builders: dict[str, Callable[..., Problem]] = {}
_stats: dict[str, dict[str, int]] = {}
_last: dict[str, Choice] = {}
_warned_unmet: set[tuple[str, str, str]] = set()  # (op, unmet, impl) already warned about (record)
_memo: dict[tuple, Any] = {}  # the choice cache
_MEMO_MAX = 4096


def register(impl: Implementation) -> Implementation:
    """Register (or replace) an implementation of ``impl.op``; returns it."""
    with _lock:
        _impls.setdefault(impl.op, {})[impl.name] = impl
        _memo.clear()
    return impl


def register_problem(op: str, builder: Callable[..., Problem]) -> None:
    """Register how :func:`explain` turns the op's call arguments into a :class:`Problem`."""
    with _lock:
        _problem_builders[op] = builder


def unregister(op: str) -> None:
    """Forget an op (tests use it for fake ops)."""
    with _lock:
        _impls.pop(op, None)
        _problem_builders.pop(op, None)
        _stats.pop(op, None)
        _last.pop(op, None)
        _memo.clear()


def _ensure_builtin_ops() -> None:
    importlib.import_module("pipegoose.nn.fusion.ops")


def implementations(op: str) -> dict[str, Implementation]:
    """The implementations of ``op`` by name, in built-in order (ours, native, ported, torch).

    Raises:
        KeyError: unknown op (the message lists the known ones).
    """
    if op not in _impls:
        _ensure_builtin_ops()
    with _lock:
        if op not in _impls:
            raise _unknown_op(op)
        items = sorted(_impls[op].values(), key=lambda i: _KIND_ORDER[i.kind])
    return {i.name: i for i in items}


def _unknown_op(op: Any, *also: str) -> UnknownNameError:
    """The error for an ``op`` argument that names no registered op (nor one of ``also``), listing the known ones and
    the closest (``layernorm``: did you mean ``layer_norm``?)."""
    known = sorted({*_impls, *also})
    close = difflib.get_close_matches(op, known, n=1, cutoff=0.6) if isinstance(op, str) else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return UnknownNameError(f"op: unknown fused op {op!r}{hint}; known ops: {', '.join(known)}")


# ---------------------------------------------------------------------------------------------------------------
# Strict mode

def _make_environ_get() -> Callable[[str, str | None], str | None]:
    """``os.environ.get``, made cheap for the variables read on every op and module call. ``os.environ.get`` costs
    ~0.8 us of host time (it encodes the key, and for an unset variable raises and catches a KeyError); a fused
    module of a host-bound model reads three variables per call. On POSIX CPython, ``os.environ`` keeps the encoded
    variables in its ``_data`` dict, which every ``os.environ`` assignment and deletion updates: one lookup there
    (~0.1 us) reads what ``os.environ.get`` would. Elsewhere (no such dict), ``os.environ.get`` itself."""
    data = getattr(os.environ, "_data", None)
    encode, decode = getattr(os.environ, "encodekey", None), getattr(os.environ, "decodevalue", None)
    if os.name != "posix" or not isinstance(data, dict) or encode is None or decode is None:
        return os.environ.get
    keys: dict[str, Any] = {}
    environ = os.environ

    def get(name: str, default: str | None = None) -> str | None:
        if os.environ is not environ:   # replaced (mock.patch("os.environ", {...})): read what is there now
            return os.environ.get(name, default)
        key = keys.get(name)
        if key is None:
            key = keys[name] = encode(name)
        value = data.get(key)
        return default if value is None else decode(value)

    return get


_environ_get = _make_environ_get()


_strict_var: contextvars.ContextVar[bool | None] = contextvars.ContextVar("pipegoose_strict", default=None)


def is_strict() -> bool:
    """Whether a fallback raises: the innermost :func:`strict` context, else ``PIPEGOOSE_STRICT``: ``1``, ``true``,
    ``yes`` or ``on`` (strict), ``0``, ``false``, ``no``, ``off`` or empty/unset (not strict); case and surrounding
    blanks are ignored.

    Raises:
        ValueError: ``PIPEGOOSE_STRICT`` holds another value (``2``, ``enabled``, ...), naming the variable, the value
            and the accepted values; not raised inside a :func:`strict` context, which overrides the variable.
    """
    v = _strict_var.get()
    if v is not None:
        return v
    raw = _environ_get("PIPEGOOSE_STRICT", "")
    value = _env.flag(raw)
    if value is not None:
        return value
    raise ValueError(f"PIPEGOOSE_STRICT={raw!r}: expected 1, true, yes or on (strict), or 0, false, no, off or empty "
                     f"(not strict)")


@contextlib.contextmanager
def strict(enabled: bool = True) -> Iterator[None]:
    """Context in which a fallback to the reference path raises :class:`FusionFallbackError` (or, with
    ``enabled=False``, does not, whatever ``PIPEGOOSE_STRICT`` says).

    Raises:
        TypeError: ``enabled`` is not True or False (on entering the context)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected True or False, got {enabled!r}")
    token = _strict_var.set(enabled)
    try:
        yield
    finally:
        _strict_var.reset(token)


# ---------------------------------------------------------------------------------------------------------------
# Kernel loading (lazy, cached, failures become reasons)

_kernel_cache: dict[str, Any] = {}  # name -> KernelOps, or str (the failure reason)
_kernel_loading: dict[str, threading.Lock] = {}  # name -> the lock of its one load (see kernel())


def _load_kernel(name: str) -> Any:
    """Load one manifest kernel; separated so that tests can replace it."""
    import pipegoose.kernels as kernels

    return kernels.load(name)


def _kernel_error_types() -> tuple[type[BaseException], ...]:
    """What a kernel load raises that makes the kernel unavailable (a fallback with its reason), not an error: the
    builder's errors, and no manifest at all (an installed wheel has none: the first fused op on a GPU raised there,
    a walkthrough's finding). A malformed manifest stays an error."""
    try:
        import pipegoose.kernels as kernels

        return (kernels.KernelError, kernels.ManifestNotFoundError)
    except (ImportError, AttributeError):  # the kernel layer is not there (yet): loading cannot succeed either
        return (ImportError,)


def kernel(name: str) -> tuple[Any | None, str]:
    """Load kernel ``name`` (manifest id or alias) once: ``(ops, "")``, or ``(None, reason)`` when it cannot load.

    A ``KernelError`` (build failure, preflight failure) or a missing manifest (``ManifestNotFoundError``) is cached
    as the reason ``"<name> unavailable: <msg>"`` and not retried in this process (:func:`clear_kernel_cache`
    retries).

    Threads loading one kernel wait for a single load (a first load may build it: minutes); the dispatcher's own
    lock is not held meanwhile, so other threads' calls of ops whose kernels are loaded go on. (Loads of different
    kernels still follow one another: the builder loads one library at a time per process.)
    """
    hit = _kernel_cache.get(name)
    if hit is None:
        with _lock:
            once = _kernel_loading.setdefault(name, threading.Lock())
        with once:
            hit = _kernel_cache.get(name)  # loaded by the thread this one waited for
            if hit is None:
                try:
                    hit = _load_kernel(name)
                except _kernel_error_types() + (ImportError,) as e:
                    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    hit = f"{name} unavailable: {type(e).__name__}: {msg}"
                    logger.debug("kernel %s could not load: %s", name, e)
                with _lock:
                    _kernel_cache[name] = hit
    if isinstance(hit, str):
        return None, hit
    return hit, ""


def clear_kernel_cache() -> None:
    with _lock:
        _kernel_cache.clear()
        _memo.clear()


def kernel_ops(impl: Implementation) -> Any:
    """The loaded ops of ``impl``'s first kernel (the dispatcher loaded it while choosing)."""
    ops, why = kernel(impl.kernels[0])
    if ops is None:
        raise RuntimeError(why)
    return ops


# ---------------------------------------------------------------------------------------------------------------
# Tuning tables

_DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64}


def device_slug(name: str) -> str:
    """``NVIDIA H200`` -> ``nvidia_h200``: lower case, every run of other characters than letters/digits -> ``_``,
    none at either end (``cpu (x86_64)`` -> ``cpu_x86_64``, not ``cpu_x86_64_``: a walkthrough's tuning file name)."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


_RULE_FIELDS = ("op", "dtype", "pass", "max_cols", "impl")
# ops a table may name that are no op of the dispatcher, with the impls their reader tells apart: the attention function
# (transformers/attention.py) reads the "attention" rules (pipegoose: our softmax path; sdpa, eager: not ours)
_TABLE_ONLY_OPS = {"attention": ("pipegoose", "sdpa", "eager")}


def _table_impls(op: str) -> tuple[str, ...] | None:
    """The implementation names a tuning rule of ``op`` may name: the registered implementations of a dispatcher op
    (the built-in ops are imported first: the optimizer ops register with them), those of :data:`_TABLE_ONLY_OPS`;
    None for an op the table has no reader for."""
    if op in _TABLE_ONLY_OPS:
        return _TABLE_ONLY_OPS[op]
    if op not in _impls:
        _ensure_builtin_ops()
    with _lock:
        impls = _impls.get(op)
        return tuple(impls) if impls else None


@dataclass(frozen=True)
class TuningRule:
    op: str
    dtype: torch.dtype
    impl: str
    max_cols: int | None = None
    pass_: str | None = None  # "fwd", "fwd+bwd" or None (any)

    def matches(self, problem: Problem) -> bool:
        if self.op != problem.op or self.dtype != problem.dtype:
            return False
        if self.max_cols is not None and problem.cols is not None and problem.cols > self.max_cols:
            return False
        return True


@dataclass(frozen=True)
class TuningTable:
    device: str
    rules: tuple[TuningRule, ...]
    path: str = "<memory>"

    @classmethod
    def parse(cls, data: Any, path: str = "<memory>") -> "TuningTable":
        """Validate a tuning table (the JSON object of docs/architecture.md "Tuning tables").

        A rule has the fields ``op``, ``dtype``, ``pass``, ``max_cols`` and ``impl`` and no others (a misspelt
        ``max_col`` was ignored, and the rule covered every size); ``op`` is an op of the dispatcher (registered:
        the built-in ops are imported) or ``attention`` (read by the attention function); ``impl`` is one of that
        op's implementations (for ``attention``: ``pipegoose``, ``sdpa``, ``eager``). A rule naming an op or an impl
        nothing reads was accepted and then skipped without a word (a review: ``layernorm``, ``sdpa`` for
        ``layer_norm``).

        Raises:
            TuningTableError: naming the file, the rule index and the field.
        """

        def err(where: str, msg: str) -> TuningTableError:
            return TuningTableError(f"{path}: {where}: {msg}")

        if not isinstance(data, Mapping):
            raise err("<top>", f"expected an object with 'device' and 'rules', got {type(data).__name__}")
        device = data.get("device")
        if not isinstance(device, str) or not device:
            raise err("device", f"expected the GPU name as a string, got {device!r}")
        rules_raw = data.get("rules")
        if not isinstance(rules_raw, list):
            raise err("rules", f"expected a list, got {type(rules_raw).__name__}")
        rules = []
        for i, r in enumerate(rules_raw):
            w = f"rules[{i}]"
            if not isinstance(r, Mapping):
                raise err(w, f"expected an object, got {r!r}")
            unknown = [k for k in r if k not in _RULE_FIELDS]
            if unknown:
                close = difflib.get_close_matches(str(unknown[0]), _RULE_FIELDS, n=1, cutoff=0.6)
                raise err(f"{w}.{unknown[0]}", "unknown field" + (f" (did you mean {close[0]!r}?)" if close else "")
                          + f"; expected only {', '.join(_RULE_FIELDS)}")
            op, dt, impl = r.get("op"), r.get("dtype"), r.get("impl")
            if not isinstance(op, str) or not op:
                raise err(f"{w}.op", f"expected an op name, got {op!r}")
            impls = _table_impls(op)
            if impls is None:
                known = sorted({*_impls, *_TABLE_ONLY_OPS})
                close = difflib.get_close_matches(op, known, n=1, cutoff=0.6)
                raise err(f"{w}.op", f"unknown op {op!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                          + f"; expected one of {', '.join(known)}")
            if dt not in _DTYPE_NAMES:
                raise err(f"{w}.dtype", f"expected one of {', '.join(_DTYPE_NAMES)}, got {dt!r}")
            if impl not in impls:
                raise err(f"{w}.impl", f"{op} has no implementation {impl!r}; expected one of {', '.join(impls)}")
            mc = r.get("max_cols")
            if mc is not None and (isinstance(mc, bool) or not isinstance(mc, int) or mc < 1):
                raise err(f"{w}.max_cols", f"expected a positive integer or null, got {mc!r}")
            ps = r.get("pass")
            if ps is not None and ps not in _PASSES:
                raise err(f"{w}.pass", f"expected one of {', '.join(_PASSES)} or null, got {ps!r}")
            rules.append(TuningRule(op, _DTYPE_NAMES[dt], impl, mc, ps))
        return cls(device, tuple(rules), path)

    @classmethod
    def load(cls, path: str | Path) -> "TuningTable":
        """Read and :meth:`parse` the table at ``path`` (UTF-8 JSON).

        Raises:
            TuningTableError: the file is not UTF-8 (a stray byte made every op call raise a UnicodeDecodeError: a
                review), not JSON, or not a table (:meth:`parse`).
            OSError: it cannot be read.
        """
        p = Path(path)
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise TuningTableError(f"{p}: not UTF-8 text (JSON is UTF-8): {e}") from None
        except json.JSONDecodeError as e:
            raise TuningTableError(f"{p}: not valid JSON: {e}") from None
        return cls.parse(data, str(p))

    def candidates(self, problem: Problem) -> list[TuningRule]:
        """Rules matching ``problem``, those whose ``pass`` fits the call (or is unset) first."""
        want = "fwd+bwd" if problem.needs_grad else "fwd"
        matching = [r for r in self.rules if r.matches(problem)]
        return ([r for r in matching if r.pass_ in (None, want)]
                + [r for r in matching if r.pass_ not in (None, want)])


_tables: dict[str, TuningTable | None] = {}


def _device_name(device: torch.device) -> str | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(device)


_NOT_LOADED = object()


def tuning_table(device: torch.device) -> TuningTable | None:
    """The tuning table of ``device``'s GPU model, or None (no GPU, no table, or a malformed one: logged once)."""
    name = _device_name(device)
    if name is None:
        return None
    table = _tables.get(name, _NOT_LOADED)   # read without the lock once loaded (attention asks on every call)
    if table is not _NOT_LOADED:
        return table
    # the ops the table's rules are checked against (TuningTable.parse), imported before the lock is taken: their
    # registration takes it
    _ensure_builtin_ops()
    with _lock:
        if name in _tables:
            return _tables[name]
        path = Path(TUNING_DIR) / f"{device_slug(name)}.json"
        table = None
        if path.is_file():
            try:
                table = TuningTable.load(path)
            except (OSError, TuningTableError) as e:
                logger.warning("ignoring tuning table %s (built-in order instead): %s", path, e)
        _tables[name] = table
        return table


def clear_tuning_cache() -> None:
    with _lock:
        _tables.clear()
        _memo.clear()


# ---------------------------------------------------------------------------------------------------------------
# Choice

def _check(impl: Implementation, problem: Problem) -> tuple[bool, str]:
    ok, why = impl.supports(problem)
    if not ok:
        return False, why or "not supported"
    for k in impl.kernels:
        ops, why = kernel(k)
        if ops is None:
            return False, why
    return True, ""


_env_names_cache: dict[str, tuple[str, ...]] = {}


def _env_names(op: str) -> tuple[str, ...]:
    names = _env_names_cache.get(op)
    if names is None:
        names = (f"PIPEGOOSE_IMPL_{op.upper().replace('.', '_')}",)
        family = op.split(".", 1)[0]
        if family != op:
            names += (f"PIPEGOOSE_IMPL_{family.upper()}",)
        _env_names_cache[op] = names
    return names


def _impl_name(value: str) -> str:
    """An implementation name as the dispatcher compares it: case and surrounding blanks ignored, for ``impl=``
    arguments (:func:`check_impl`) and ``PIPEGOOSE_IMPL_*`` values alike."""
    return value.strip().lower()


def _env_request(op: str) -> tuple[str | None, str]:
    """(implementation, variable) asked for by the op's ``PIPEGOOSE_IMPL_*`` variables, or (None, ""): the op's own
    variable first, then its family's (``PIPEGOOSE_IMPL_SOFTMAX`` for ``softmax.masked``); an unset or empty one is
    skipped, and ``auto`` in the op's own variable ends the search (it overrides a family request)."""
    for var in _env_names(op):
        v = _impl_name(_environ_get(var, ""))
        if v == "auto":
            return None, ""
        if v:
            return v, var
    return None, ""


def check_op_env(op: str) -> None:
    """Check ``op``'s ``PIPEGOOSE_IMPL_*`` variables as a call of the op would (for a call that returns before it
    chooses, e.g. ``clip_grad_norm_`` without a gradient).

    Raises:
        KeyError: unknown op.
        ValueError: the variable names no implementation of the op (named with its value and the implementations).
    """
    _checked_env_request(op, implementations(op))


def _checked_env_request(op: str, impls: Mapping[str, Implementation]) -> tuple[str | None, str]:
    """:func:`_env_request`, with a ValueError naming the variable when its value is no implementation of ``op``."""
    env_impl, env_var = _env_request(op)
    if env_impl is not None and env_impl not in impls:
        raise ValueError(f"{env_var}={env_impl!r}: {op} has no implementation {env_impl!r}; expected one of "
                         f"{', '.join(impls)} or 'auto'")
    return env_impl, env_var


_env_checked = False
# pipegoose's own files, and torch's (nn.Module.__call__ between a model and a fused module)
_INTERNAL_DIRS = tuple(str(Path(m.__file__).resolve().parent) + os.sep
                       for m in (sys.modules["pipegoose"], torch))


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` in the function calling this one name the first frame outside
    pipegoose and torch: the user's line, or the model code that called a fused module."""
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        frame = frame.f_back
        level += 1
    return level


def warn_unknown_env() -> list[str]:
    """Warn (``UserWarning``, once per process from :func:`choose`, and from :func:`check_env`, which ``fuse`` calls)
    about ``PIPEGOOSE_IMPL_*`` variables that name no op or op family (a misspelling such as
    ``PIPEGOOSE_IMPL_LAYERNORM`` would otherwise be ignored silently) and about other ``PIPEGOOSE_*`` names that
    pipegoose does not read (:mod:`pipegoose._env`, with the closest known name).
    ``PIPEGOOSE_IMPL_ATTENTION`` is known: the attention function reads it (:func:`compile_passthrough`), though
    attention is no op of the dispatcher. Returns the unknown names."""
    global _env_checked
    _env_checked = True
    _ensure_builtin_ops()
    known = {name for op in (*_impls, "attention") for name in _env_names(op)}
    unknown = sorted(k for k in os.environ if k.startswith("PIPEGOOSE_IMPL_") and k not in known)
    for k in unknown:
        warnings.warn(f"{k}: no fused op of that name, so it is ignored; known: {', '.join(sorted(known))}",
                      stacklevel=_caller_stacklevel())
    # every other PIPEGOOSE_* name this project does not read (PIPEGOOSE_STRCT=1 left strict mode off without a word)
    for k, close in _env.unknown_names():
        warnings.warn(f"{k}: pipegoose reads no variable of that name, so it is ignored"
                      + (f"; did you mean {close}?" if close else ""), stacklevel=_caller_stacklevel())
        unknown.append(k)
    return unknown


def check_env() -> None:
    """Check the environment the dispatcher reads, as its calls would, but up front (before a long job, say): each
    op's ``PIPEGOOSE_IMPL_*`` value (its own variable, else its family's) must name one of the op's implementations
    or be ``auto``; ``PIPEGOOSE_SMALL_NUMEL`` and ``PIPEGOOSE_STRICT`` must parse. (At a call, a bad value is the same
    ValueError, at the first call of the op it applies to.) ``PIPEGOOSE_IMPL_ATTENTION``: :func:`check_attention_env`;
    the norm kernels' ``PIPEGOOSE_NORM_CLUSTERS`` and ``PIPEGOOSE_NORM_SMEM_LIMIT``: :func:`check_kernel_env`.
    Unknown ``PIPEGOOSE_*`` names get :func:`warn_unknown_env`'s warning (once per process).

    Raises:
        ValueError: the first bad variable, named with its value and what was expected.
    """
    _ensure_builtin_ops()
    if not _env_checked:  # unknown PIPEGOOSE_* names: warned once per process, here or at the first choice
        warn_unknown_env()
    for op in list(_impls):
        _checked_env_request(op, implementations(op))
    check_attention_env()
    small_numel()
    is_strict()
    check_kernel_env()


# What the norm kernels' C++ side accepts (norm_kernels.cuh: has_clusters, smem_limit; strtoll's base-10 form).
_SMEM_LIMIT_RE = re.compile(r"[ \t\n\v\f\r]*[+-]?[0-9]+", re.ASCII)


def check_kernel_env() -> None:
    """Check the variables the norm kernels read in C++ (once per process, at their first launch on a GPU), up front:
    ``PIPEGOOSE_NORM_CLUSTERS`` (0 or 1, or unset) and ``PIPEGOOSE_NORM_SMEM_LIMIT`` (a number of bytes >= 0, or
    unset); the messages are the kernels'.

    Raises:
        ValueError: the first bad variable, named with its value and what was expected.
    """
    v = _environ_get("PIPEGOOSE_NORM_CLUSTERS")
    if v not in (None, "", "0", "1"):
        raise ValueError(f"PIPEGOOSE_NORM_CLUSTERS: expected 0 or 1, got '{v}'")
    v = _environ_get("PIPEGOOSE_NORM_SMEM_LIMIT")
    if v not in (None, "") and not (_SMEM_LIMIT_RE.fullmatch(v) and int(v) >= 0):
        raise ValueError(f"PIPEGOOSE_NORM_SMEM_LIMIT: expected a number of bytes >= 0, got '{v}'")


def check_impl(op: str, impl: Any) -> str | None:
    """Check an ``impl`` argument of ``op``: None, ``"auto"`` or the name of one of its implementations, case and
    surrounding blanks ignored as in ``PIPEGOOSE_IMPL_*`` values (what :func:`choose` accepts; the fused modules check
    theirs when constructed).

    Returns:
        The name as the dispatcher uses it (``"Apex"`` -> ``"apex"``, ``"AUTO"`` -> ``"auto"``), or None.

    Raises:
        KeyError: unknown op.
        TypeError: ``impl`` is neither a str nor None.
        ValueError: ``impl`` names no implementation of the op (the message lists them), or is empty or blank
            (an empty ``PIPEGOOSE_IMPL_*`` variable is the same as an unset one; an empty argument is refused).
    """
    if op not in _impls:
        implementations(op)   # the unknown-op KeyError, also for None and "auto" (they returned without it: a review)
    if impl is None:
        return None
    if not isinstance(impl, str):
        raise TypeError(f"impl: expected an implementation name (str), 'auto' or None, got {type(impl).__name__}")
    name = _impl_name(impl)
    if not name:
        # an unset or empty PIPEGOOSE_IMPL_* variable means "no request"; an empty argument is more likely a bug
        # (a name read from a missing setting) than a wish, so it is refused rather than read as "auto"
        raise ValueError(f"impl: an empty name ({impl!r}); pass None or 'auto' for the automatic choice, or one of "
                         f"{', '.join(implementations(op))}")
    if name != "auto":
        impls = implementations(op)
        if name not in impls:
            raise ValueError(f"impl: {op} has no implementation {impl!r}; expected one of "
                             f"{', '.join(impls)} or 'auto' (any case)")
    return name


def choose(op: str, problem: Problem, impl: str | None = None, check_all: bool = False) -> Choice:
    """Choose the implementation of ``op`` for ``problem`` (no counters, no strict check; see :func:`select`).

    Args:
        impl: the explicit request (an implementation name, ``auto`` or None; any case, see :func:`check_impl`).
        check_all: also ask the implementations that the choice did not need to look at, so that ``reasons``
            says why each one would or would not run (what :func:`explain` shows).

    Raises:
        KeyError: unknown op.
        TypeError: ``impl`` is neither a str nor None.
        ValueError: ``impl`` (or the ``PIPEGOOSE_IMPL_*`` variable) names no implementation of the op;
            ``PIPEGOOSE_STRICT`` holds an unrecognised value (:func:`is_strict`).
    """
    impls = implementations(op)
    if not _env_checked:
        warn_unknown_env()
    reasons: dict[str, str] = {name: "" for name in impls}
    checked: dict[str, bool] = {}

    def ok(name: str) -> bool:
        if name not in checked:
            good, why = _check(impls[name], problem)
            checked[name] = good
            reasons[name] = "" if good else why
        return checked[name]

    if check_all:
        for name in impls:
            ok(name)

    requests: list[tuple[str, str]] = []
    impl = check_impl(op, impl)
    if impl is not None and impl != "auto":
        requests.append((impl, "argument"))
    env_impl, env_var = _checked_env_request(op, impls)
    if env_impl is not None:
        requests.append((env_impl, "env"))
    is_strict()  # a bad PIPEGOOSE_STRICT is an error here, where a bad PIPEGOOSE_IMPL_* is, not only at a fallback

    def unmet(failed: list[tuple[str, str]]) -> str:
        # one clause per implementation: the argument and the variable naming the same one share its reason
        asked: dict[str, list[str]] = {}
        for name, source in failed:
            asked.setdefault(name, []).append(f"{'impl=' if source == 'argument' else env_var + '='}{name!r}")
        return "; ".join(f"{' and '.join(who)} cannot run this input: {reasons[name]}" for name, who in asked.items())

    for i, (name, source) in enumerate(requests):
        if ok(name):
            why = "requested by the impl= argument" if source == "argument" else f"requested by {env_var}"
            # an impl= argument that could not run, the variable's request taking over, is still said (a walkthrough:
            # it was dropped without a word when the variable was set)
            return Choice(op, name, source, False, reasons, why, unmet(requests[:i]))
        logger.debug("%s: requested implementation %s (%s) cannot run: %s", op, name, source, reasons[name])
    if requests:
        return replace(_choose_unrequested(op, problem, impls, reasons, ok), unmet=unmet(requests))
    return _choose_unrequested(op, problem, impls, reasons, ok)


def _choose_unrequested(op: str, problem: Problem, impls: Mapping[str, Implementation], reasons: dict[str, str],
                        ok: Callable[[str], bool]) -> Choice:
    """The choice when no request can run: an empty input, the small-problem rule, then :func:`_automatic`."""
    if problem.get("numel") == 0:
        # nothing for a kernel to compute (every kernel's supports declines it): the reference returns the empty
        # result, and that is no fallback (strict mode does not raise on it)
        ref = next((n for n, im in impls.items() if im.kind == "reference"), None)
        if ref is not None:
            return Choice(op, ref, "empty", False, reasons,
                          "an empty input: no kernel runs, the reference path returns the empty result")
    small = _small_problem(problem, impls)
    if small is not None:
        # only where a fused implementation takes the input (else it is a real fallback); checked on metadata
        # alone, so that a small input never loads (or builds) a kernel
        fused = [n for n, im in impls.items() if im.kind != "reference" and im.supports(problem)[0]]
        if fused:
            name, why = small
            return Choice(op, name, "small", False, reasons, f"{why} (fused paths that take it: {', '.join(fused)})")
    return _automatic(op, problem, impls, reasons, ok)


def _automatic(op: str, problem: Problem, impls: Mapping[str, Implementation], reasons: dict[str, str],
               ok: Callable[[str], bool]) -> Choice:
    """The choice without a request: the tuning table, else the built-in order, else the reference (fallback)."""
    table = tuning_table(problem.device)
    if table is not None:
        for rule in table.candidates(problem):
            if rule.impl not in impls:
                continue
            tuned_for = impls[rule.impl].tuned_for
            if tuned_for is not None and not tuned_for(problem):
                continue
            if ok(rule.impl):
                return Choice(op, rule.impl, "tuning", False, reasons,
                              f"tuning table {Path(table.path).name}: {rule.op} {str(rule.dtype)[6:]} "
                              f"max_cols={rule.max_cols} -> {rule.impl}")

    for name, im in impls.items():
        if im.kind == "reference":
            continue
        if im.is_opt_in(problem):
            if not reasons[name]:
                # where it could not run anyway, that reason (asked on metadata alone: no kernel is loaded for an
                # implementation that is not going to run), not a suggestion to request it (a review: the reason
                # said to request it, and the request failed for another reason)
                good, why = im.supports(problem)
                ruled = im.tuned_for is None or im.tuned_for(problem)
                reasons[name] = (why or "not supported") if not good else (
                    f"opt-in{' for this input' if callable(im.opt_in) else ''}: runs when requested "
                    f"(impl={name!r} or {_env_names(op)[0]}={name})" + (" or named by a tuning rule" if ruled else ""))
            continue
        if ok(name):
            return Choice(op, name, "builtin", False, reasons, "first supported implementation in built-in order")

    ref = [n for n, im in impls.items() if im.kind == "reference"]
    if not ref:
        raise RuntimeError(f"{op}: no implementation supports this input and there is no reference path: "
                           + "; ".join(f"{n}: {w}" for n, w in reasons.items()))
    name = ref[0]
    fused = [n for n, im in impls.items() if im.kind != "reference"]
    why = "; ".join(f"{n}: {reasons[n]}" for n in fused if reasons[n]) or "no fused implementation"
    return Choice(op, name, "fallback", bool(fused), reasons, why)


@torch.compiler.assume_constant_result
def _requested(op: str) -> str:
    # read when torch.compile traces the call (a constant of the graph, like the module's configuration): "" (no
    # request), "requested", or the message of a bad PIPEGOOSE_STRICT, which the caller raises (raised in here, the
    # ValueError would reach the user wrapped in dynamo's InternalTorchDynamoError)
    try:
        strict_mode = is_strict()
        if op == "attention":
            check_attention_env()
    except ValueError as e:
        return str(e)
    return "requested" if strict_mode or _env_request(op)[0] is not None else ""


ATTENTION_ENV_VALUES = ("auto", "pipegoose")


def check_attention_env() -> None:
    """Check ``PIPEGOOSE_IMPL_ATTENTION``: unset, empty, ``auto`` or ``pipegoose`` (case and surrounding blanks
    ignored). ``pipegoose`` asks the attention function for the fused softmax path on scores of at least
    ``PIPEGOOSE_SMALL_NUMEL`` elements (else SDPA, unless the tuning table names ours), and under ``torch.compile``
    for its own paths (a graph break per call) instead of SDPA; attention is no op of the dispatcher, so no other
    implementation can be asked for there.

    Raises:
        ValueError: another value, named with the variable and the accepted values.
    """
    raw = _environ_get("PIPEGOOSE_IMPL_ATTENTION", "")
    value = raw.strip().lower()
    if value and value not in ATTENTION_ENV_VALUES:
        raise ValueError(f"PIPEGOOSE_IMPL_ATTENTION={raw!r}: expected 'pipegoose' (our attention function's fused "
                         f"softmax path for large scores and under torch.compile) or 'auto'")


def compile_passthrough(op: str, impl: str | None = None) -> bool:
    """Whether the op entry points should emit the PyTorch reference op for this call: ``torch.compile`` is
    tracing it and neither ``impl`` (``auto`` asks for none) nor a ``PIPEGOOSE_IMPL_*`` variable for ``op`` nor strict
    mode asks for an implementation (see the module docstring). Outside a compiled region: False.

    Raises:
        ValueError: while tracing, ``PIPEGOOSE_STRICT`` holds a value :func:`is_strict` rejects (its message).
    """
    if not torch.compiler.is_compiling():
        return False
    requested = _requested(op)
    if requested not in ("", "requested"):
        raise ValueError(requested)
    # ("auto", any case: the default's request, as choose() reads it; a breaker's compiled module with impl="auto"
    # broke its graph where impl=None did not)
    auto = impl is None or (isinstance(impl, str) and impl.strip().lower() == "auto")
    return auto and not requested


def small_numel() -> int:
    """The small-problem size: ``PIPEGOOSE_SMALL_NUMEL`` (elements; 0 turns the rule off), default
    :data:`SMALL_NUMEL_DEFAULT`.

    Raises:
        ValueError: the variable is not a non-negative integer.
    """
    raw = _environ_get("PIPEGOOSE_SMALL_NUMEL", "").strip()
    if not raw:
        return SMALL_NUMEL_DEFAULT
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"PIPEGOOSE_SMALL_NUMEL={raw!r}: expected a non-negative integer (elements; 0 = off)")
    return n


def _small_problem(problem: Problem, impls: Mapping[str, Implementation]) -> tuple[str, str] | None:
    """(reference name, reason) when the problem is below the small-problem size and the op's reference
    implementation is registered ``small_first`` for it (``tuned_for``); else None."""
    n = problem.get("numel")
    limit = small_numel()
    if not limit or n is None or n >= limit:
        return None
    for name, im in impls.items():
        if im.kind == "reference" and im.small_first and (im.tuned_for is None or im.tuned_for(problem)):
            return name, (f"{n} elements < {limit} (PIPEGOOSE_SMALL_NUMEL): a host-bound size, where the native "
                          f"op's lower host overhead outweighs any kernel time a fused op could save")
    return None


def select(op: str, problem: Problem, impl: str | None = None) -> Choice:
    """:func:`choose`, then :func:`record` it (count, remember, log, strict check).

    Raises:
        FusionFallbackError: strict mode and the choice is a fallback to the reference path.
    """
    return record(choose(op, problem, impl))


def record(choice: Choice) -> Choice:
    """Count a call that runs ``choice``, remember it for :func:`last_choice`, log a fallback and, in strict mode,
    raise on it. Returns ``choice``.

    Raises:
        FusionFallbackError: strict mode and the choice is a fallback to the reference path.
    """
    op = choice.op
    with _lock:
        _last[op] = choice
        if choice.fallback and is_strict():
            raise FusionFallbackError(f"{op}: strict mode: would fall back to {choice.impl}: {choice.reason}")
        per_op = _stats.get(op)
        if per_op is None:
            per_op = _stats[op] = {}
        per_op[choice.impl] = per_op.get(choice.impl, 0) + 1
    if choice.fallback:
        logger.debug("%s: falling back to %s: %s", op, choice.impl, choice.reason)
    if choice.unmet and (op, choice.unmet, choice.impl) not in _warned_unmet:
        # once per op, request and reason: a cached choice is recorded on every call of a hot loop
        _warned_unmet.add((op, choice.unmet, choice.impl))
        warnings.warn(f"{op}: {choice.unmet}; running {choice.impl} ({choice.source}) instead",
                      stacklevel=_caller_stacklevel())
    return choice


# ---------------------------------------------------------------------------------------------------------------
# Choice cache (see the module docstring)


def choice_key(op: str, impl: str | None, signature: tuple) -> tuple:
    """The cache key of a call: op, ``impl`` argument, the op's metadata ``signature`` (hashable; it must hold
    everything validation and choice depend on, and no tensors), the op's ``PIPEGOOSE_IMPL_*`` values and
    ``PIPEGOOSE_SMALL_NUMEL``."""
    return (op, impl, signature, tuple(_environ_get(n) for n in _env_names(op)),
            _environ_get("PIPEGOOSE_SMALL_NUMEL"))


def cached_choice(key: tuple) -> Any:
    """What :func:`remember_choice` stored under ``key`` (None if nothing)."""
    return _memo.get(key)


def remember_choice(key: tuple, value: Any) -> None:
    """Store ``value`` (a :class:`Choice`, or a tuple starting with one plus what the op derived while validating)
    under ``key``; the cache is emptied first when full."""
    with _lock:
        if len(_memo) >= _MEMO_MAX:
            _memo.clear()
        _memo[key] = value


def clear_choice_cache() -> None:
    """Forget every cached choice (the next call of each signature validates and chooses again)."""
    with _lock:
        _memo.clear()


def explain(op: str, *inputs: Any, impl: str | None = None, **kwargs: Any) -> Choice:
    """What the op would run for these inputs and why (per implementation); counts nothing, runs nothing.

    ``inputs``/``kwargs`` are the op's functional arguments, e.g.
    ``explain("softmax.masked", x, mask, scale=0.125)``, ``explain("softmax.causal", x, 0.125)`` (as
    ``scaled_upper_triang_masked_softmax(x, scale)``), ``explain("layer_norm", x, (1024,), w, b)``; the optimizer ops
    take one bucket's lists (one tensor per parameter): ``explain("adam", grads, params, exp_avgs, exp_avg_sqs)``
    (``bias_correction=False`` as a keyword) and ``explain("clip_grad_norm", grads, norm_type)``, ``grads`` the
    gradients of one (device, dtype) group (``clip_grad_norm_`` splits a model's gradients into such groups and asks
    for each; the kernels decline a list that mixes dtypes, which ``clip_grad_norm_`` never asks about) and no None
    (a parameter without a gradient: leave it out, as ``clip_grad_norm_`` does).

    Every implementation is asked, so the kernel of each one that takes the input is loaded (and, on a first run,
    built); :func:`choose` of :func:`problem_of` loads only what the choice needs.

    Raises:
        KeyError: ``op`` is not a dispatcher op (the message names the closest one; ``attention`` says what to
            explain instead).
        TypeError, ValueError: the arguments that the op's own checks refuse, with the functional's messages;
            ``impl`` naming no implementation of ``op``. Inputs that only PyTorch refuses, where the reference path
            would run them (a float ``target`` of ``cross_entropy``, a target of another batch size, cos and sin that
            do not broadcast over q), are described, not refused: explain runs nothing.
    """
    return choose(op, problem_of(op, *inputs, **kwargs), impl, check_all=True)


def problem_of(op: str, *inputs: Any, **kwargs: Any) -> Problem:
    """The :class:`Problem` the op's call with these functional arguments chooses on (see :func:`explain`). Raises
    what :func:`explain` raises for them."""
    if op == "attention":
        raise UnknownNameError("attention: not a dispatcher op; the attention function chooses per call (the GPU's "
                               "tuning table, the small-problem rule) and counts it as 'attention' in stats(); explain "
                               "the softmax it runs instead, e.g. explain('softmax.masked', scores, mask, scale=...)")
    implementations(op)
    builder = _problem_builders.get(op)
    if builder is None:
        raise UnknownNameError(f"{op}: no problem builder registered; explain() cannot describe its inputs")
    try:
        problem = builder(*inputs, **kwargs)
    except TypeError as e:
        if "positional argument" not in str(e) and "keyword argument" not in str(e):
            raise
        bad = re.search(r"unexpected keyword argument '(\w+)'", str(e))
        # the builders' own names (_explain...) mean nothing to the caller: name the keyword alone
        detail = f"{bad.group(1)!r} is not one of them" if bad else re.sub(r"^[\w.<>]+\(\) ", "", str(e))
        raise TypeError(f"explain({op!r}, ...): expected the op's functional arguments, e.g. "
                        f"explain('layer_norm', x, (1024,), w, b) or explain('softmax.masked', x, mask, "
                        f"scale=0.125); {detail}") from None
    return problem


def last_choice(op: str) -> Choice | None:
    """The last choice :func:`select` (or :func:`record`) made for ``op`` in this process: a dispatcher op, or
    ``attention`` (our attention function records its choices). None when ``op`` has not run since the process
    started or the last :func:`reset_stats`.

    Raises:
        KeyError: ``op`` names no op (the message lists the known ones).
    """
    if not isinstance(op, str):
        raise TypeError(f"op: expected an op name (str), got {type(op).__name__}")
    with _lock:
        hit = _last.get(op)
    if hit is None and op != "attention" and op not in _impls:
        _ensure_builtin_ops()
        with _lock:
            if op not in _impls:
                raise _unknown_op(op, "attention")
    return hit


def stats() -> dict[str, dict[str, int]]:
    """Calls per op and implementation since the last :func:`reset_stats`: ``{op: {impl: count}}``."""
    with _lock:
        return {op: dict(c) for op, c in _stats.items()}


def reset_stats() -> None:
    """Zero the counters and forget the last choices (and the choice cache, so that every next call chooses, and the
    unmet requests already warned about)."""
    with _lock:
        _stats.clear()
        _last.clear()
        _memo.clear()
        _warned_unmet.clear()
