"""The rotary position embedding of transformers' attention modules, on our kernel (op ``rope``), for ``fuse(model)``.

transformers applies RoPE with a module-level function, ``apply_rotary_pos_emb(q, k, cos, sin)``, that the attention
module's ``forward`` looks up in its modeling module's globals (``modeling_llama.apply_rotary_pos_emb`` for
``LlamaAttention``; Mistral, Qwen2, Qwen3, Gemma, GPT-NeoX and the other copies have their own). No per-instance
hook reaches that call, so ``fuse`` puts a *dispatching* function under that global name (:func:`install`), which
runs our op only while a fused attention module's forward is running, and the original function everywhere else:

* a fused attention module gets a forward pre-hook and an always-called forward hook that count, per thread, the
  fused forwards under way; the dispatching function sends a call to
  :func:`pipegoose.nn.fusion.functional.apply_rotary_pos_emb` (the kernel, or its reference path, as the dispatcher
  chooses) when that count is positive and the call is the plain ``(q, k, cos, sin)`` form with 4-d ``q``, ``k`` and
  3-d ``cos``, ``sin`` of the full head size; any other call (another model of the same type that is not fused,
  partial rotary, extra arguments, ``torch.compile`` tracing) goes to the original function, unchanged;
* before it is installed, the original function is checked numerically (:func:`probe`: float64 CPU inputs against
  transformers' rotate-half formula), so a model whose function computes something else (an interleaved rotation,
  a patch by another library) is reported as skipped instead;
* ``unfuse`` removes the hooks, and the original function is put back when the last fused module of that modeling
  module is unfused (a fused model that is garbage collected without ``unfuse`` leaves the dispatching function in
  place, passing every call through); a function that someone else put there meanwhile is left as it is.

This is the one global that ``fuse`` changes; other models, fused or not, compute exactly what they computed.
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

NAME = "apply_rotary_pos_emb"
_ORIGINAL_ATTR = "__pipegoose_rope_original__"

_active = threading.local()   # .depth: fused attention forwards under way on this thread


@dataclass
class Target:
    """Where an attention module's forward finds its RoPE function: the modeling module's globals and the function
    there now (``current``; ``original``: the function beneath our dispatching one, when that is installed)."""

    module_name: str
    namespace: dict
    current: Callable
    original: Callable


def target(module: nn.Module) -> Target | None:
    """The RoPE function ``module``'s class forward calls by its global name ``apply_rotary_pos_emb``, or None (no
    such call: not an attention module with RoPE)."""
    fwd = getattr(type(module), "forward", None)
    try:
        fwd = inspect.unwrap(fwd)
    except (ValueError, TypeError):
        return None
    code = getattr(fwd, "__code__", None)
    namespace = getattr(fwd, "__globals__", None)
    if code is None or namespace is None or NAME not in code.co_names:
        return None
    current = namespace.get(NAME)
    if not callable(current):
        return None
    original = getattr(current, _ORIGINAL_ATTR, current)
    return Target(namespace.get("__name__", "?"), namespace, current, original)


def _reference64(q, k, cos, sin):
    half = q.shape[-1] // 2
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)

    def rot(x):
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * c + rot(q) * s, k * c + rot(k) * s


_probed: "weakref.WeakKeyDictionary[Callable, tuple[bool, str]]" = weakref.WeakKeyDictionary()


def probe(fn: Callable) -> tuple[bool, str]:
    """Whether ``fn(q, k, cos, sin)`` computes transformers' rotate-half RoPE: (True, "") or (False, why). Checked on
    float64 CPU inputs (grouped-query shapes, cos and sin of a batch and of one batch, random tables rather than real
    cosines so that both halves are told apart) against the formula; cached per function."""
    try:
        return _probed[fn]
    except (KeyError, TypeError):
        pass
    where = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    g = torch.Generator().manual_seed(0)
    result = (True, "")
    try:
        for b_tab in (2, 1):
            q = torch.randn(2, 3, 5, 8, dtype=torch.float64, generator=g)
            k = torch.randn(2, 1, 5, 8, dtype=torch.float64, generator=g)
            cos = torch.randn(b_tab, 5, 8, dtype=torch.float64, generator=g)
            sin = torch.randn(b_tab, 5, 8, dtype=torch.float64, generator=g)
            with torch.no_grad():
                got = fn(q, k, cos, sin)
            want = _reference64(q, k, cos, sin)
            if (not isinstance(got, (tuple, list)) or len(got) != 2
                    or not all(isinstance(t, torch.Tensor) and t.shape == w.shape for t, w in zip(got, want))):
                result = (False, f"{where}(q, k, cos, sin) does not return (q_embed, k_embed) of q's and k's shapes")
                break
            if not all(torch.allclose(t.double(), w, rtol=1e-12, atol=1e-12) for t, w in zip(got, want)):
                result = (False, f"{where} does not compute the rotate-half RoPE (x * cos + rotate_half(x) * sin) "
                                 "that pipegoose's rope kernel computes")
                break
    except Exception as e:   # noqa: BLE001 - any failure means "not the function we can replace"
        result = (False, f"{where}(q, k, cos, sin) failed on float64 CPU inputs: {type(e).__name__}: {e}")
    try:
        _probed[fn] = result
    except TypeError:
        pass
    return result


def _takes(args: tuple, kwargs: dict) -> bool:
    """Whether a call is the plain form the kernel path takes: (q, k, cos, sin), 4-d q and k, 3-d cos and sin of the
    full head size (anything else: the original function)."""
    if len(args) != 4 or kwargs:
        return False
    q, k, cos, sin = args
    if not all(isinstance(t, torch.Tensor) for t in args):
        return False
    return (q.dim() == 4 and k.dim() == 4 and cos.dim() == 3 and sin.shape == cos.shape
            and cos.shape[-1] == q.shape[-1] == k.shape[-1])


def _make_dispatching(original: Callable) -> Callable:
    from ..functional import apply_rotary_pos_emb as fused_rope

    @functools.wraps(original)
    def apply_rotary_pos_emb(*args: Any, **kwargs: Any):
        if getattr(_active, "depth", 0) > 0 and not torch.compiler.is_compiling() and _takes(args, kwargs):
            return fused_rope(*args)
        return original(*args, **kwargs)

    setattr(apply_rotary_pos_emb, _ORIGINAL_ATTR, original)
    apply_rotary_pos_emb.__pipegoose_users__ = weakref.WeakSet()   # the fused modules that use it
    return apply_rotary_pos_emb


def _enter(module, args):
    if not torch.compiler.is_compiling():
        _active.depth = getattr(_active, "depth", 0) + 1


def _leave(module, args, output):
    if not torch.compiler.is_compiling():
        _active.depth = max(0, getattr(_active, "depth", 0) - 1)


@dataclass
class Installed:
    """What :func:`install` did for one attention module: the hooks' handles and the dispatching function."""

    namespace: dict
    dispatching: Callable
    handles: tuple


def install(module: nn.Module, t: Target) -> Installed:
    """Route ``module``'s RoPE calls to our op: the dispatching function under ``t``'s global name (put there unless
    it is there already) and the module's two hooks. The caller has probed ``t.original``."""
    current = t.namespace.get(NAME)
    if getattr(current, _ORIGINAL_ATTR, None) is t.original:
        dispatching = current
    else:
        dispatching = _make_dispatching(t.original)
        t.namespace[NAME] = dispatching
    dispatching.__pipegoose_users__.add(module)
    handles = (module.register_forward_pre_hook(_enter),
               module.register_forward_hook(_leave, always_call=True))
    return Installed(t.namespace, dispatching, handles)


def uninstall(module: nn.Module | None, rec: Installed) -> None:
    """Undo :func:`install` for one module: its hooks go, and the original function goes back under the global name
    once no live fused module uses the dispatching function (unless someone replaced it there since)."""
    for h in rec.handles:
        h.remove()
    users = rec.dispatching.__pipegoose_users__
    if module is not None:
        users.discard(module)
    if len(users) == 0 and rec.namespace.get(NAME) is rec.dispatching:
        rec.namespace[NAME] = getattr(rec.dispatching, _ORIGINAL_ATTR)


def is_dispatching(fn: Any) -> bool:
    """Whether ``fn`` is a dispatching function of :func:`install`."""
    return hasattr(fn, _ORIGINAL_ATTR)


def hooked(module: nn.Module) -> bool:
    """Whether ``module`` carries :func:`install`'s hooks (a copy of a fused module does: its hooks were copied)."""
    return any(h is _enter for h in module._forward_pre_hooks.values())
