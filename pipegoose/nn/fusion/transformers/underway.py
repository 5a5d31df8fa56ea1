"""The fused forwards under way in this thread, for a module global that ``fuse`` routes through a dispatching
callable (:mod:`.rope`'s ``apply_rotary_pos_emb``, :mod:`.inline_loss`'s ``CrossEntropyLoss``).

Such a global serves every model of its modeling module, fused or not, so the callable asks, per call, whether the
call comes from a fused module's forward. The fused module has a forward pre-hook and an always-called forward hook
that push and pop it on a per-thread stack (:meth:`Underway.enter`, :meth:`Underway.leave`); the callable takes the
innermost entry only where that module's forward is really running (:meth:`Underway.caller`: its frame, ``self`` the
module, among the callers: a forward left by ``KeyboardInterrupt``, which skips the always-called hook, leaves an
entry that no later call matches). Each user keeps a stack of its own (one :class:`Underway`), and its hooks are
module-level functions of its module that call it, so that a fused model copies and pickles (its hooks by
reference). Under ``torch.compile`` tracing nothing is pushed or popped.
"""

from __future__ import annotations

import functools
import inspect
import threading
import types
import weakref
from typing import Callable

import torch
from torch import nn

FRAMES = 12   # how far up the callers :meth:`Underway.caller` looks for the fused forward's frame


@functools.lru_cache(maxsize=None)
def forward_of(cls: type) -> Callable | None:
    """``cls``'s forward under its decorators (``inspect.unwrap``): the function whose globals hold the names its
    code looks up, and whose frame :meth:`Underway.caller` looks for; None where it has none."""
    try:
        return inspect.unwrap(cls.forward)
    except (AttributeError, ValueError, TypeError):
        return None


class Underway:
    """Per thread, the fused modules whose forward is under way (``local.stack``: (weakref to the module, its class
    forward's code), innermost last)."""

    def __init__(self) -> None:
        self.local = threading.local()

    def enter(self, module: nn.Module) -> None:
        """A fused module's forward begins (its forward pre-hook)."""
        if not torch.compiler.is_compiling():
            stack = getattr(self.local, "stack", None)
            if stack is None:
                stack = self.local.stack = []
            stack.append((weakref.ref(module), getattr(forward_of(type(module)), "__code__", None)))

    def leave(self, module: nn.Module) -> None:
        """A fused module's forward ends, returning or raising (its always-called forward hook)."""
        if not torch.compiler.is_compiling():
            stack = getattr(self.local, "stack", None) or []
            # (entries above this module's: forwards left without their hook, by KeyboardInterrupt)
            while stack:
                ref, _ = stack.pop()
                if ref() is module:
                    break

    def caller(self, frame: types.FrameType | None, direct: bool = False) -> nn.Module | None:
        """The innermost fused module of this thread, where its forward's frame (``self`` the module) is ``frame`` or
        one of the :data:`FRAMES` - 1 frames above it; else None. ``direct``: only where that forward's frame is the
        first above ``frame`` (``frame`` included) that is not ``torch.nn.Module``'s call machinery, i.e. the forward
        called the module whose forward asks, itself (not a hook or another model's forward it runs)."""
        stack = getattr(self.local, "stack", None)
        if not stack:
            return None
        ref, code = stack[-1]
        module = ref()
        if code is None or module is None:
            return None
        f = frame
        for _ in range(FRAMES):
            if f is None:
                return None
            if f.f_code is code and f.f_locals.get("self") is module:
                return module
            if direct and f.f_code.co_filename != _MODULE_FILE:
                return None
            f = f.f_back
        return None


_MODULE_FILE = nn.Module.__call__.__code__.co_filename   # torch/nn/modules/module.py: _wrapped_call_impl, _call_impl
