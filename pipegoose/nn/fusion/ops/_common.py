"""Helpers shared by the op families: autocast policy, manifest limits, small checks."""

from __future__ import annotations

import functools
import math
import operator
import sys
import threading
from typing import Any, Callable

import torch
from torch.autograd import forward_ad as _fwad

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HALF_DTYPES = (torch.float16, torch.bfloat16)
# The tensor dtypes the norm and softmax ops take (input and parameters): the kernels' three, and float64, which the
# PyTorch reference path computes (a fallback, as for any input the kernels decline). Other floating dtypes
# (float8_e4m3fn, float8_e5m2 and the other 8-bit and narrower formats) have no path here, and PyTorch's own
# layer_norm, rms_norm and softmax had none on CPU either (torch 2.14: NotImplementedError; float8 does not promote
# with other dtypes): a TypeError up front says so.
INPUT_DTYPES = FLOAT_DTYPES + (torch.float64,)
INT32_MAX = 2**31 - 1
GRID_YZ_MAX = 65535

_policy_lock = threading.Lock()
_policy_cache: dict[tuple, torch.dtype] = {}


def autocast_state(device: torch.device) -> tuple:
    kind = device.type
    try:
        enabled = torch.is_autocast_enabled(kind)
    except (TypeError, RuntimeError):  # device types without autocast
        return (kind, False, None)
    return (kind, enabled, torch.get_autocast_dtype(kind) if enabled else None)


def torch_result_dtype(key: str, device: torch.device, dtypes: tuple, probe: Callable[..., torch.Tensor],
                       default: torch.dtype) -> torch.dtype:
    """The dtype PyTorch's own op returns for inputs of ``dtypes`` under the current autocast state.

    Autocast's policy (which ops run in fp32, per device type) is not a public API, so it is measured: ``probe``
    runs the torch op on tiny tensors of ``dtypes`` on ``device`` once per (op, device type, autocast state,
    dtypes), and the answer is cached. A probe that raises (PyTorch rejects that dtype mix) gives ``default``.
    """
    state = autocast_state(device)
    k = (key, state, dtypes)
    hit = _policy_cache.get(k)
    if hit is not None:
        return hit
    # outside a torch.jit.trace in progress: traced, the probe's tensors took value names the traced graph's own then
    # could not have, so the first call's graph differed from a later (cached) one's and the trace check failed
    # ("Graphs differed across invocations"; a review)
    tracing = torch._C._get_tracing_state() if torch.jit.is_tracing() else None
    if tracing is not None:
        torch._C._set_tracing_state(None)
    try:
        with torch.no_grad():
            out = probe(*dtypes).dtype
    except (RuntimeError, TypeError, ValueError):
        out = default
    finally:
        if tracing is not None:
            torch._C._set_tracing_state(tracing)
    with _policy_lock:
        _policy_cache[k] = out
    return out


def call_without_autocast(device: torch.device, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with autocast off on ``device`` (the caller already chose the compute dtype); no context
    manager when autocast is off already (the common case: a few microseconds less per call)."""
    if torch.is_autocast_enabled(device.type) if device.type in ("cuda", "cpu") else autocast_state(device)[1]:
        with torch.autocast(device_type=device.type, enabled=False):
            return fn(*args)
    return fn(*args)


def grads_through(fn: Callable[..., torch.Tensor], tensors: tuple, needs: tuple, dy: torch.Tensor) -> list:
    """The gradients of ``fn(*tensors)`` for the output gradient ``dy``, by autograd with ``create_graph=True``, so
    that they are differentiable again: for each tensor whose ``needs`` flag is set, its gradient (None for the others
    and for None entries).

    What a fused Function's backward returns when it runs with grad mode on (``torch.autograd.grad(...,
    create_graph=True)``, ``backward(create_graph=True)``): the kernels' backward is not differentiable (the
    ``torch.ops.pipegoose`` backward ops have no autograd formula), so ``fn`` is the op's PyTorch reference on the
    Function's saved inputs, which connect the result to the graph of the forward. ``fn`` runs with autocast off."""
    grads: list = [None] * len(tensors)
    want = [i for i, (t, need) in enumerate(zip(tensors, needs)) if need and t is not None]
    if not want:
        return grads
    device = next(t for t in tensors if t is not None).device
    with torch.enable_grad():
        y = call_without_autocast(device, fn, *tensors)
        gs = torch.autograd.grad(y, [tensors[i] for i in want], dy, create_graph=True, allow_unused=True)
    for i, g in zip(want, gs):
        grads[i] = g
    return grads


def has_storage(t: torch.Tensor) -> bool:
    """False for a tensor without storage: inside a ``torch.func`` transform (vmap, grad, jvp) or a fake tensor.
    The kernels need real memory; such inputs take the reference path."""
    try:
        t.data_ptr()
    except RuntimeError:
        return False
    return True


def _functorch_check() -> Callable[[torch.Tensor], bool]:
    try:
        return torch._C._functorch.is_functorch_wrapped_tensor
    except AttributeError:  # a torch without it: every call is checked (has_storage) instead of cached
        return lambda t: True


_is_functorch_wrapped = _functorch_check()


def in_transform(t: torch.Tensor) -> bool:
    """True for a tensor of a ``torch.func`` transform (vmap, grad, jvp): such a call must not reuse the choice cached
    for a plain tensor of the same metadata (the kernels decline it: :func:`has_storage`), so the ops leave it out of
    the choice cache. ~0.1 us."""
    return _is_functorch_wrapped(t)


NO_STORAGE = "a tensor without storage (inside a torch.func transform such as vmap): the kernels need real memory"
FORWARD_AD = ("a dual tensor (torch.autograd.forward_ad): the fused norms have no forward derivative (jvp); PyTorch's "
              "op has")


def any_in_transform(*tensors: Any) -> bool:
    """:func:`in_transform` of any tensor among ``tensors`` (None and non-tensors skipped): a call with one such
    argument (a mask or weight under ``vmap``, say) must not reuse a choice cached for plain tensors."""
    return any(isinstance(t, torch.Tensor) and _is_functorch_wrapped(t) for t in tensors)


def all_have_storage(*tensors: Any) -> bool:
    """:func:`has_storage` of every tensor among ``tensors`` (None and non-tensors skipped)."""
    return all(has_storage(t) for t in tensors if isinstance(t, torch.Tensor))


def in_dual_level() -> bool:
    """Whether a ``torch.autograd.forward_ad.dual_level`` is open (tensors may then carry tangents): the norms leave
    such calls out of the choice cache. A global read; ``torch.func.jvp`` opens one too."""
    return getattr(_fwad, "_current_level", 0) >= 0   # a torch without the attribute: always checked


def has_tangent(*tensors: Any) -> bool:
    """Whether a tensor among ``tensors`` carries a forward-mode tangent (a dual tensor). Costs nothing outside a dual
    level, ~5 us inside."""
    if not in_dual_level():
        return False
    return any(isinstance(t, torch.Tensor) and _fwad.unpack_dual(t).tangent is not None for t in tensors)


def kernel_input_ok(p: Any, forward_ad: str = FORWARD_AD, what: str = "input") -> tuple[bool, str]:
    """The checks every kernel of ours makes first, on a dispatcher ``Problem``: a CUDA device, tensors with storage,
    no forward-mode tangent (``forward_ad``: the reason given for one), and ``p.dtype`` (``what``'s dtype) one of
    fp32 / fp16 / bf16. (True, "") or (False, the reason)."""
    if p.device.type != "cuda":
        return False, f"needs a CUDA tensor, got device {p.device}"
    if not p.get("storage", True):
        return False, NO_STORAGE
    if p.get("forward_ad"):
        return False, forward_ad
    if p.dtype not in FLOAT_DTYPES:
        return False, f"{what} dtype {dtype_name(p.dtype)} not supported (float32, float16, bfloat16)"
    return True, ""


NESTED = "a nested tensor: the kernels take dense rows; PyTorch's op runs it"


def nested_fallback(op: str, impl: Any = None) -> Any:
    """The choice recorded for a nested tensor (``torch.nested``, either layout), which every op hands to PyTorch's
    own op: a fallback (counted; strict mode raises), with the ``impl`` request it cannot honour (checked: a name the
    op does not have is the ValueError it is for dense inputs)."""
    from .. import dispatch

    name = dispatch.check_impl(op, impl)
    unmet = f"impl={name!r} cannot run this input: {NESTED}" if name not in (None, "auto", "torch") else ""
    return dispatch.Choice(op, "torch", "fallback", True, {}, NESTED, unmet)


def on_kernel_device(t: torch.Tensor) -> bool:
    """Whether our fused kernels could run on ``t``: a CUDA tensor in fp16, bf16 or fp32. The small-problem
    shortcuts (fused norm modules, the attention function) apply only there: elsewhere the native op is a fallback,
    which strict mode must see (a nested tensor is no kernel input either). Tests replace this function
    (``_common.on_kernel_device``) to exercise them on CPU."""
    return t.is_cuda and t.dtype in (torch.float16, torch.bfloat16, torch.float32) and not t.is_nested


def shape_signature(shape: Any) -> tuple:
    """Hashable metadata of a ``normalized_shape`` argument for the choice cache: its type, each element's type and
    the values (``(8.0,) == (8,)`` and hash alike, but only the second is valid; a list and its tuple share
    one entry). TypeError if it is not hashable."""
    if isinstance(shape, (list, tuple)):
        return (tuple, tuple(type(d) for d in shape), tuple(shape))
    hash(shape)
    return (type(shape), None, shape)


def param_signature(p: Any) -> tuple | None:
    """Hashable metadata of an optional tensor argument, for the dispatch choice cache (AttributeError if ``p``
    is neither None nor a tensor)."""
    if p is None:
        return None
    return (type(p), p.dtype, p.device, p.shape, p.requires_grad)


def needs_grad(*tensors: Any) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def megatron_batches_per_block(sk: int) -> int:
    """Rows per 128-thread block in the Megatron softmax copies (ColossalAI 0.5.0
    extensions/csrc/kernel/cuda/scaled_masked_softmax_kernel.cu, get_batch_per_block): warp = min(next_pow2, 32),
    2 rows per warp when next_pow2 <= 128 else 1, 128 / warp warps per block."""
    p = next_pow2(sk)
    warp = min(p, 32)
    return (128 // warp) * (2 if p <= 128 else 1)


def python_finite(v: int | float) -> bool:
    """Whether the Python number ``v`` is finite, in the comparisons a compiled graph can hold: under
    ``torch.compile(dynamic=True)`` a float argument is symbolic, and ``float()`` / ``math.isfinite`` broke the graph
    (a fused Llama: 12 graphs), while ``v == inf`` put no guard on it (a graph compiled for 0.5 was reused for inf).
    NaN is tested first (a symbolic NaN fails the ordered comparison)."""
    return v == v and -sys.float_info.max <= v <= sys.float_info.max


def eps_value(eps: Any, allow_none: bool = False, name: str = "eps") -> float | None:
    """``eps`` of a norm as a float, accepting what ``F.layer_norm`` / ``F.rms_norm`` accept for it: a Python bool, int
    or float, a numpy bool, integer or floating scalar, a 0-d tensor (``None`` too when ``allow_none``). Raises
    TypeError naming ``name`` (``eps``; a module's ``variance_epsilon``) for anything else (a str, a 1-element tensor of
    more dimensions, a Decimal), ValueError for a negative or non-finite value, which PyTorch would take but no kernel
    of ours does. Under ``torch.compile`` a Python int or float comes back as given (it may be symbolic there)."""
    if eps is None and allow_none:
        return None
    if isinstance(eps, (bool, int, float)):   # (first: the getattr below broke a compiled graph, as python_finite says)
        if not python_finite(eps) or not eps >= 0:
            raise ValueError(f"{name}: expected a finite number >= 0{' or None' if allow_none else ''}, got {eps!r}")
        return eps if torch.compiler.is_compiling() and not isinstance(eps, bool) else float(eps)
    kind = getattr(getattr(eps, "dtype", None), "kind", None)  # numpy scalars: "b", "i", "u" or "f"
    ok = ((kind in ("b", "i", "u", "f") and getattr(eps, "ndim", 1) == 0)
          or (isinstance(eps, torch.Tensor) and eps.dim() == 0 and not eps.is_complex()))
    if not ok:
        raise TypeError(f"{name}: expected a number{' or None' if allow_none else ''}, got {eps!r} "
                        f"({type(eps).__name__})")
    if isinstance(eps, torch.Tensor):  # detached: no "converting a tensor that requires grad" warning
        try:
            value = float(eps.detach().item())
        except RuntimeError:  # a meta or fake tensor holds no value
            raise TypeError(f"{name}: expected a number, got a 0-d tensor without a value "
                            f"(device {eps.device})") from None
    else:
        value = float(eps)
    if not value >= 0 or not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number >= 0{' or None' if allow_none else ''}, got {eps!r}")
    return value


_UNSIGNED = tuple(getattr(torch, f"uint{n}") for n in (8, 16, 32, 64) if hasattr(torch, f"uint{n}"))


def numpy_kind(value: Any) -> str | None:
    """The numpy dtype kind of a 0-d numpy value (a numpy scalar or 0-d array): ``"b"``, ``"i"``, ``"u"``, ``"f"`` or
    ``"c"``; None for anything else, a numpy array of more dimensions included. Under ``torch.compile`` dynamo traces
    numpy values as tensors and refuses their ``.dtype`` ("Unsupported ndarray attribute access": fullgraph=True
    failed for a numpy ``ignore_index``, a review): there the kind is read from ``torch.as_tensor(value)``'s dtype."""
    np = sys.modules.get("numpy")   # (not a dependency: without it imported, no value is numpy's)
    if np is None or not isinstance(value, (np.generic, np.ndarray)) or value.ndim != 0:
        return None
    if not torch.compiler.is_compiling():
        return value.dtype.kind
    t = torch.as_tensor(value)
    if t.dtype == torch.bool:
        return "b"
    return "c" if t.is_complex() else "f" if t.is_floating_point() else "u" if t.dtype in _UNSIGNED else "i"


def integer_or_none(value: Any) -> Any:
    """``value`` as an int where it is one integer, else None: a Python int as it is (a ``torch.SymInt`` too, under
    ``torch.compile``), a 0-d numpy value of an integer dtype, a 0-d integer tensor or another object with
    ``__index__`` by ``operator.index``; None for None, a bool (Python's, numpy's, a bool tensor), a float, a str and
    any sequence (a tuple, list or ``torch.Size``: a shape).

    The common kinds are told apart by type, not by ``operator.index`` in a try/except: under ``torch.compile``,
    torch 2.11's dynamo turns the TypeError it raises for a tuple into an ``InternalTorchDynamoError``, which the except
    did not catch, and every fused norm module (its ``normalized_shape`` a tuple) failed to compile (a review). Only
    other objects go through ``operator.index`` and its TypeError."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, torch.SymInt)):
        return value
    if isinstance(value, (float, complex, str, bytes, bytearray, tuple, list, dict, set, frozenset, range)):
        return None
    kind = numpy_kind(value)
    if kind is not None:
        if kind == "i" or (kind == "u" and not torch.compiler.is_compiling()):
            # (.tolist(), a Python int: under torch.compile operator.index / int() of a numpy value made in the
            # compiled function is a data-dependent .item(), which fullgraph=True refuses)
            return value.tolist()
        # (dynamo's tolist() takes signed integers only: an unsigned one made in the compiled function breaks the graph)
        return operator.index(value) if kind == "u" else None
    if isinstance(value, torch.Tensor) and value.dtype == torch.bool:
        return None
    try:   # a 0-d integer tensor, a numpy array of more dimensions (an error), an object with __index__
        return operator.index(value)
    except TypeError:
        return None


def int_value(value: Any, name: str) -> int:
    """``value`` as an int: a Python or numpy integer, a 0-d integer tensor (:func:`integer_or_none`), not a bool.
    Raises TypeError naming ``name`` otherwise."""
    v = integer_or_none(value)
    if v is None:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    return v


def dtype_name(dtype: torch.dtype | None) -> str:
    return "None" if dtype is None else str(dtype).replace("torch.", "")


def check_float_tensor(x: Any, name: str = "x") -> None:
    """TypeError naming ``name`` unless ``x`` is a floating point tensor of a dtype some path here takes
    (:func:`check_input_dtype`): the first check of every op's tensor inputs."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating point torch.Tensor, got "
                        f"{dtype_name(x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__}")
    check_input_dtype(x, name)


def check_input_dtype(x: torch.Tensor, name: str = "x") -> None:
    """TypeError naming ``name`` when the floating tensor ``x`` (an input or a parameter) has a dtype outside
    :data:`INPUT_DTYPES` (float8 and narrower formats: no kernel and no reference path here takes them)."""
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"{name}: expected dtype {', '.join(map(dtype_name, INPUT_DTYPES[:-1]))} or "
                        f"{dtype_name(INPUT_DTYPES[-1])}, got {dtype_name(x.dtype)} (no fused kernel or reference path "
                        f"here takes it); cast it first, e.g. {name}.to(torch.bfloat16)")


@functools.lru_cache(maxsize=None)
def manifest_limit(kernel: str, key: str, default: Any) -> Any:
    """A limit of a kernel from kernels.yaml (``limits:``), or ``default`` when the manifest lacks it."""
    try:
        from pipegoose.kernels.manifest import load_manifest

        return load_manifest().resolve(kernel).limits.get(key, default)
    except Exception:  # noqa: BLE001 - a missing/odd manifest must not break the reference path
        return default


def hidden_range(kernel: str) -> tuple[int, int]:
    """The row lengths (hidden sizes) a norm kernel takes: its ``hidden_min`` / ``hidden_max`` in kernels.yaml, or
    [1, 65536] where the manifest lacks them."""
    return manifest_limit(kernel, "hidden_min", 1), manifest_limit(kernel, "hidden_max", 65536)


def representable(value: float, dtype: torch.dtype) -> bool:
    """Whether ``value`` survives a round trip through ``dtype`` unchanged (fp32 first: kernels take float)."""
    v32 = float(torch.tensor(value, dtype=torch.float32))
    return v32 == value and float(torch.tensor(value, dtype=dtype)) == value


def has_module_hooks(m: torch.nn.Module) -> bool:
    """Whether ``m`` has forward, forward-pre, backward or backward-pre hooks of its own (a fused MLP does not call
    its activation: hooks on it would not fire, so an activation with any is run as the MLP would, or refused by the
    probe; backward hooks were not looked at before, and were silently dropped: a review)."""
    return bool(m._forward_hooks or m._forward_pre_hooks or getattr(m, "_forward_hooks_with_kwargs", None)
                or m._backward_hooks or m._backward_pre_hooks)


def act_state(act: Any) -> dict[str, Any]:
    """What an activation module computes with besides its class: its public attributes (``nn.GELU``'s
    ``approximate``, transformers' ``GELUTanh.act``, ``nn.SiLU``'s ``inplace``; not ``training`` or the hook
    dictionaries), the objects themselves; empty for a function. A fused module or gate keeps the probed activation's
    and runs the activation itself where :func:`same_act_state` says it changed (an ``approximate`` set on it after
    the probe counts as another activation; a review)."""
    if not isinstance(act, torch.nn.Module):
        return {}
    return {k: v for k, v in act.__dict__.items() if not k.startswith("_") and k != "training"}


def same_act_state(now: dict[str, Any], then: dict[str, Any]) -> bool:
    """Whether :func:`act_state` ``now`` holds the very objects of ``then`` (identity: an attribute assigned since is
    a change, even to an equal value; copies made through one memo, deepcopy or pickle, keep identities)."""
    return now.keys() == then.keys() and all(now[k] is v for k, v in then.items())
