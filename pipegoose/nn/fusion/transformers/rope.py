"""The rotary position embedding of transformers' attention modules, on our kernel (op ``rope``), for ``fuse(model)``.

transformers applies RoPE with a module-level function, ``apply_rotary_pos_emb(q, k, cos, sin)``, that the attention
module's ``forward`` looks up in its modeling module's globals (``modeling_llama.apply_rotary_pos_emb`` for
``LlamaAttention``; Mistral, Qwen2, Qwen3, Gemma, GPT-NeoX and the other copies have their own). No per-instance
hook reaches that call, so ``fuse`` routes it through a *dispatching* function (:func:`install`), which runs our op
only for calls made inside a fused attention module's forward, and the model's own code for every other call:

* where the global is a plain function (older transformers), the dispatching function takes its place; where it is
  the ``kernels`` library's wrapper module (transformers 5: an ``nn.Module`` instance, ``Func``, whose forward calls
  the function), the global object stays and the dispatching function becomes that instance's ``forward`` (so the
  wrapper's pickling by name, its ``kernelize`` hooks and its identity are kept);
* a fused attention module gets a forward pre-hook and an always-called forward hook that keep, per thread, the fused
  forwards under way (:mod:`.underway`, a stack of rope's own); the dispatching function sends a call to
  :func:`pipegoose.nn.fusion.functional.apply_rotary_pos_emb` (the kernel, or its reference path, as the dispatcher
  chooses) only when the innermost of them is really running and called the function itself (its forward's frame is
  the caller's, past ``torch.nn.Module``'s call machinery: a forward left by ``KeyboardInterrupt``, which skips the
  hook, leaves nothing behind, and an unfused attention run from a hook inside a fused forward runs its own code) and
  the call is the plain ``(q, k, cos, sin)`` form the kernel takes (with ``unsqueeze_dim`` 1 or 2 and an unused
  ``position_ids``, by position or keyword, where the probe found that the function takes them as transformers' do:
  ESM's and ModernBERT's attention pass ``unsqueeze_dim=1``): 4-d q and k of one batch, sequence and even head size,
  cos and sin ``[batch or 1, seq, head]``, one dtype, or 16-bit q and k with fp32 tables. Where the probe found that
  the model's function computes such a call as the op's PyTorch path does, bit for bit (Llama's, in every dtype), it
  runs the op (the kernel, or that path, as the dispatcher chooses). Where it computes it otherwise but within the
  dtype's rounding (OLMo's: 16-bit q with fp32 tables computed in fp32 and cast back to q's dtype; its bf16 calls too,
  so that a module's calls run one way whichever tables its rotary embedding gives; ESM's and ModernBERT's, which
  compute on ``q.float()`` and cast back, in bf16 and fp16), and for GPT-NeoX's partial rotary (cos and sin narrower
  than the head, where the probe found that the function computes it), the call runs the kernel where the dispatcher
  chooses it for the call (its fp32 results cast to q's dtype where the function casts its own;
  :func:`~pipegoose.nn.fusion.ops.rope.choice_of`: asked per call, so that a model fused on the CPU and moved to a GPU
  afterwards runs it there), else the model's own code (which computes what the function does, where PyTorch's path
  would not, and at less host time); a call whose dtypes the function computes otherwise than the op (off the
  formula's rounding, or results of another dtype) runs the model's own code as the op's fallback. Those choices are
  recorded as the op's are (``dispatch.stats()`` counts the model's code as ``torch``, strict mode refuses a fallback,
  an unmet ``PIPEGOOSE_IMPL_ROPE`` request warns). A function that rotates one tensor a call (GPT-J's and CodeGen's
  ``(tensor, sin, cos)``, interleaved, with tables of half its values that it repeats, the tensor laid out [B, S, H, D];
  Gemma 3n's and Gemma 4's ``(x, cos, sin, unsqueeze_dim=1)``) is probed as the pair of its calls for q and for k
  (:func:`_as_pair`, :class:`OneTensor`), and its plain calls (:func:`_takes_one`) run the op on that tensor as q beside
  an empty k, each call a launch of its own. Any other call (another model of the same type that is not fused, extra
  arguments, other shapes, ``torch.compile`` tracing) goes to the model's own code, unchanged;
* before it is installed, the model's function is checked numerically (:func:`probe`: float64 CPU inputs against
  transformers' rotate-half formula or one of the interleaved rotations, :data:`STYLES` (Cohere's on its tables as
  given; GLM's on the first half of its tables, each value twice), or fp32 ones for a function that computes in fp32;
  then the dtype and values of its results per call form against the op's, and the keywords it takes), so a model
  whose function computes something else (another rotation, a patch by another library) is reported as skipped
  instead; calls of an interleaved function run the op with ``interleaved=True``, on the tables
  :func:`kernel_tables` gives;
* ``unfuse`` removes the hooks, and the global (or the wrapper's forward) is put back when the last fused module
  using it is unfused (a fused model that is garbage collected without ``unfuse`` leaves the dispatching function in
  place, passing every call through); a function that someone else put there meanwhile is left as it is.

This is one of the two globals that ``fuse`` changes (the other: a modeling module's ``CrossEntropyLoss``,
:mod:`.inline_loss`); other models, fused or not, compute exactly what they computed.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .. import dispatch
from ..ops._common import dtype_name
from ..ops.rope import choice_of, rope_reference, run_choice, shape_reason
from .matching import probe_isolated
from .underway import Underway, forward_of as _forward

NAME = "apply_rotary_pos_emb"
_FALLBACK_ATTR = "__pipegoose_rope_original__"   # on a dispatching function: the model's own code it falls back to
_HALF = (torch.float16, torch.bfloat16)

_underway = Underway()          # the fused attention modules' forwards under way (a stack of their own)
_active = _underway.local       # .stack: (weakref to a fused attention module, its forward's code) under way


@dataclass
class Target:
    """Where an attention module's forward finds its RoPE: the modeling module (name, globals), the object under the
    global name now (``current``: a function, or transformers' ``kernels`` wrapper module), and the callable that
    computes the model's own RoPE (``original``: ``current`` itself, or what the dispatching function installed on it
    falls back to)."""

    module_name: str
    namespace: dict
    current: Any
    original: Callable

    @property
    def where(self) -> str:
        return f"{self.module_name}.{NAME}"


def dispatching_of(obj: Any) -> Callable | None:
    """The dispatching function of :func:`install` at ``obj`` (the global, or the wrapper module's ``forward``), or
    None."""
    if is_dispatching(obj):
        return obj
    if isinstance(obj, nn.Module) and is_dispatching(obj.__dict__.get("forward")):
        return obj.__dict__["forward"]
    return None


def target(module: nn.Module) -> Target | None:
    """Where ``module``'s class forward finds the RoPE function it calls by its global name ``apply_rotary_pos_emb``,
    or None (no such call: not an attention module with RoPE)."""
    fwd = _forward(type(module))
    code = getattr(fwd, "__code__", None)
    namespace = getattr(fwd, "__globals__", None)
    if code is None or namespace is None or NAME not in code.co_names:
        return None
    current = namespace.get(NAME)
    if not callable(current):
        return None
    d = dispatching_of(current)
    original = getattr(d, _FALLBACK_ATTR) if d is not None else current
    return Target(namespace.get("__name__", "?"), namespace, current, original)


# The rotations a probed function may compute (Probe.style): transformers' rotate-half RoPE (Llama's, GPT-NeoX's and
# their copies); the interleaved one on the tables as given (pairs of neighbours rotate: Cohere's, with tables that
# repeat each frequency twice); the interleaved one on tables that the function makes from the first half of those it
# is given, each value twice (``cos[..., :R/2].repeat_interleave(2, -1)``: GLM's, GLM-4's, Helium's, ERNIE 4.5's,
# whose rotary embeddings give rotate-half tables).
ROTATE_HALF, INTERLEAVED, INTERLEAVED_FIRST_HALF = "rotate_half", "interleaved", "interleaved_first_half"
STYLES = (ROTATE_HALF, INTERLEAVED, INTERLEAVED_FIRST_HALF)
STYLE_WORDS = {ROTATE_HALF: "the rotate-half RoPE",
               INTERLEAVED: "the interleaved RoPE (pairs of neighbours rotate; the tables as given)",
               INTERLEAVED_FIRST_HALF: "the interleaved RoPE of the tables' first half, each value twice (GLM's)"}


def kernel_tables(cos: torch.Tensor, sin: torch.Tensor, style: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables that op ``rope`` takes for a call of ``style`` given ``cos`` and ``sin`` (the same tensors, but for
    :data:`INTERLEAVED_FIRST_HALF`: the first half of each, each value twice, as GLM's function makes them)."""
    if style == INTERLEAVED_FIRST_HALF:
        half = cos.shape[-1] // 2
        return cos[..., :half].repeat_interleave(2, -1), sin[..., :half].repeat_interleave(2, -1)
    return cos, sin


def _reference64(q, k, cos, sin, style: str = ROTATE_HALF):
    """transformers' rotate-half RoPE, or the interleaved one of ``style``; with tables of R < D values (partial
    rotary), GPT-NeoX's (GLM's, interleaved): the first R values of each head rotate, the others pass through."""
    cos, sin = kernel_tables(cos, sin, style)
    return rope_reference(q, k, cos, sin, 1, interleaved=style != ROTATE_HALF)


EXACT, CLOSE, CAST = "exact", "close", "cast"   # what a probed function computes for one call form (Probe.forms)
# the call forms probed: (q's and k's dtype, cos's and sin's dtype)
_FORMS = ((torch.float64, torch.float64), (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
          (torch.float16, torch.float16), (torch.bfloat16, torch.float32), (torch.float16, torch.float32))


@dataclass(frozen=True)
class Probe:
    """What :func:`probe` found: ``ok`` (the rotate-half RoPE, or an interleaved one: ``style``), ``why`` (when not),
    ``forms`` (per call form, q's dtype and the tables', what the function computes: see :meth:`kind`), ``promotes``
    (16-bit q and k with fp32 tables give the op's fp32 results, as Llama's function does), ``partial`` (tables of
    fewer values than a head rotate that many and pass the rest through, as GPT-NeoX's function does),
    ``narrow_raises`` (it raises for such tables instead, as Llama's and Phi's: the shapes do not broadcast; so a
    module with partial rotary that calls it, Phi's, StableLM's, passes it the rotated part of each head alone with
    tables of that width), ``unsqueeze`` and ``position_ids`` (the keywords its calls may pass, as ESM's and
    ModernBERT's ``unsqueeze_dim=1``, that it takes as transformers' functions do: checked on the probe's inputs),
    ``style`` (the rotation: :data:`ROTATE_HALF`, :data:`INTERLEAVED` or :data:`INTERLEAVED_FIRST_HALF`; the op runs
    the interleaved ones on the tables :func:`kernel_tables` gives), ``one`` (a function that rotates one tensor a
    call: :class:`OneTensor`, how it takes it; every other field then says what it computes called for q and for k, as
    :func:`_as_pair` calls it)."""

    ok: bool
    why: str = ""
    promotes: bool = False
    partial: bool = False
    forms: tuple = ()   # ((q dtype, table dtype), EXACT | CLOSE | CAST | None), for _FORMS
    unsqueeze: bool = False      # takes unsqueeze_dim (1 or -3: [B, H, S, D]; 2 or -2: [B, S, H, D]) as transformers'
    position_ids: bool = False   # takes position_ids and leaves it unused (transformers' older signature)
    narrow_raises: bool = False  # raises for tables of fewer values than a head (Llama's, Phi's)
    style: str = ROTATE_HALF     # the rotation it computes (STYLES)
    one: "OneTensor | None" = None   # how it takes its one tensor a call (GPT-J's, Gemma 4's); None: q and k

    @property
    def interleaved(self) -> bool:
        """Whether the op runs its calls with ``interleaved=True``."""
        return self.style != ROTATE_HALF

    def kind(self, q_dtype: torch.dtype, table_dtype: torch.dtype) -> str | None:
        """What the function computes for q (and k) of ``q_dtype`` with cos and sin of ``table_dtype``: ``EXACT``
        (what the op's PyTorch path computes, bit for bit: the op runs it), ``CLOSE`` (the op's result dtype, values
        within the dtype's rounding of the formula: the kernel where the dispatcher chooses it, else the function),
        ``CAST`` (16-bit q with fp32 tables, results in q's dtype: the fp32 formula rounded to it, as OLMo's, ESM's
        functions: the kernel's fp32 results cast to q's dtype, else the function), or None (another dtype, or values
        off the formula: the function, as the op's fallback)."""
        return self._kinds.get((q_dtype, table_dtype))

    @functools.cached_property
    def _kinds(self) -> dict:   # (asked per call)
        return dict(self.forms)


_probed: "weakref.WeakKeyDictionary[Any, Probe]" = weakref.WeakKeyDictionary()


def probe(fn: Callable, where: str = NAME) -> Probe:
    """Whether ``fn(q, k, cos, sin)`` computes transformers' rotate-half RoPE, or an interleaved one (:data:`STYLES`:
    Cohere's, GLM's); for a function that rotates one tensor a call (:class:`OneTensor`), the pair of its calls for q
    and for k, each way it may take its tensor and tables (:func:`_as_pair`). Checked on float64 CPU inputs
    (grouped-query shapes, cos and sin of a batch and of one batch, random tables rather than real cosines so that both
    halves are told apart) against each formula (a function that computes in fp32, as ESM's, ModernBERT's and Cohere's
    ``q.float()``, is off it and checked on fp32 inputs instead, to fp32's rounding); then, per call form
    (:data:`_FORMS`: one dtype for all, or 16-bit q and k with fp32 tables), the dtype and values of its results
    against the op's (:meth:`Probe.kind`), and the keywords ``unsqueeze_dim`` and ``position_ids`` where it has
    them. Cached per function (``where`` names it in the reason)."""
    try:
        return _probed[fn]
    except (KeyError, TypeError):
        pass
    result = _probe(fn, where)
    if not isinstance(fn, types.MethodType):   # (a bound method is made anew at each access: not cached)
        try:
            _probed[fn] = result
        except TypeError:
            pass
    return result


def _pair_of(got, like) -> bool:
    """Whether ``got`` is a pair of tensors of the shapes of ``like``'s."""
    return (isinstance(got, (tuple, list)) and len(got) == 2
            and all(isinstance(t, torch.Tensor) and t.shape == w.shape for t, w in zip(got, like)))


def _partner(x: torch.Tensor, style: str) -> torch.Tensor:
    """Each value's partner in the rotation of whole heads: the other half's (rotate-half), or its neighbour's."""
    if style == ROTATE_HALF:
        return x.roll(x.shape[-1] // 2, -1)
    return x.unflatten(-1, (x.shape[-1] // 2, 2)).flip(-1).flatten(-2)


def _within(got, args, dtype: torch.dtype, style: str = ROTATE_HALF) -> bool:
    """Whether ``got`` is within ``dtype``'s rounding of the formula of ``style`` on ``args`` (in float64): two units
    of its epsilon relative to the products' sizes (eager code that rounds each op, or computes in fp32 and rounds
    once, is; values of tables rounded to a 16-bit dtype first are too)."""
    q, k, cos, sin = (t.double() for t in args)
    want = _reference64(q, k, cos, sin, style)
    cos, sin = kernel_tables(cos, sin, style)
    c, s = cos.abs().unsqueeze(1), sin.abs().unsqueeze(1)
    eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).tiny
    for t, w, x in zip(got, want, (q, k)):
        size = x.abs() * c + _partner(x.abs(), style) * s   # |x| |cos| + |rotate_half(x)| |sin|
        if not bool(((t.double() - w).abs() <= 2 * eps * size + tiny).all()):
            return False
    return True


def _form_kind(fn: Callable, inputs: list, q_dtype: torch.dtype, table_dtype: torch.dtype,
               style: str = ROTATE_HALF) -> str | None:
    """:meth:`Probe.kind` of one call form, from ``fn`` on ``inputs`` (float64 (q, k, cos, sin) tuples) cast to it,
    against the op on the tables of ``style`` (:func:`kernel_tables`)."""
    op_dtype = torch.float32 if q_dtype in _HALF and table_dtype == torch.float32 else q_dtype   # (the op's results)
    kinds = set()
    for q, k, cos, sin in inputs:
        args = (q.to(q_dtype), k.to(q_dtype), cos.to(table_dtype), sin.to(table_dtype))
        try:
            with torch.no_grad():
                got = fn(*args)
        except Exception:   # noqa: BLE001 - then such calls run its own code
            return None
        if not _pair_of(got, args[:2]) or got[0].dtype != got[1].dtype:
            return None
        dt = got[0].dtype
        ours = rope_reference(*args[:2], *kernel_tables(*args[2:], style), 1, style != ROTATE_HALF)
        if dt == op_dtype and all(torch.equal(t, r) for t, r in zip(got, ours)):
            kinds.add(EXACT)
        elif dt == op_dtype and _within(got, args, dt, style):
            kinds.add(CLOSE)
        elif dt == q_dtype != op_dtype and _within(got, args, dt, style):
            kinds.add(CAST)
        else:
            return None
    if kinds <= {EXACT, CLOSE}:
        return EXACT if kinds == {EXACT} else CLOSE
    return CAST if kinds == {CAST} else None


def _forms(fn: Callable, inputs: list, style: str = ROTATE_HALF) -> tuple:
    """:attr:`Probe.forms`. A 16-bit form of one dtype for all that the op's path computes exactly is taken as
    ``CLOSE`` where the same q with fp32 tables is not ``EXACT`` (OLMo's: its fp32 tables, in a bf16 model): a module's
    calls then run one way whichever tables its rotary embedding gives, as the report says from the module's dtype."""
    forms = {form: _form_kind(fn, inputs, *form, style) for form in _FORMS}
    for half in _HALF:
        if forms[(half, half)] == EXACT and forms[(half, torch.float32)] != EXACT:
            forms[(half, half)] = CLOSE
    return tuple(forms.items())


@probe_isolated   # the model's function runs: the caller's random stream is left as it was
def _probe(fn: Callable, where: str) -> Probe:
    names = _one_tensor_params(fn)
    if names is None:
        return _probe_pair(fn, where)
    # (one tensor a call: each way it may take it, probed through _as_pair as a (q, k, cos, sin) function)
    sin_first = names[1] == "sin"
    whys = set()
    for half in (False, True):
        for heads_dim in ((None,) if "unsqueeze_dim" in names else (1, 2)):
            form = OneTensor(", ".join(names), sin_first, half, heads_dim)
            found = _probe_pair(_as_pair(fn, form), where)
            if found.ok:
                return dataclasses.replace(found, one=form)
            whys.add(found.why)
    if len(whys) == 1 and "failed on float64 CPU inputs" in next(iter(whys)):   # (the same failure each way: say it)
        return Probe(False, f"{where}({', '.join(names)}) rotates one tensor a call; called for q and for k it "
                            + next(iter(whys)).split("(q, k, cos, sin) ", 1)[-1])
    return Probe(False, f"{where}({', '.join(names)}) rotates one tensor a call, and computes none of the rotations "
                        "pipegoose's rope kernel takes (probed with tables of a head's values and of half of them, "
                        "q laid out [batch, heads, seq, head_dim] and [batch, seq, heads, head_dim])")


def _probe_pair(fn: Callable, where: str) -> Probe:
    g = torch.Generator().manual_seed(0)
    inputs, outputs = [], []
    try:
        for b_tab in (2, 1):
            q = torch.randn(2, 3, 5, 8, dtype=torch.float64, generator=g)
            k = torch.randn(2, 1, 5, 8, dtype=torch.float64, generator=g)
            cos = torch.randn(b_tab, 5, 8, dtype=torch.float64, generator=g)
            sin = torch.randn(b_tab, 5, 8, dtype=torch.float64, generator=g)
            inputs.append((q, k, cos, sin))
            with torch.no_grad():
                got = fn(q, k, cos, sin)
            if not _pair_of(got, (q, k)):
                return Probe(False, f"{where}(q, k, cos, sin) does not return (q_embed, k_embed) of q's and k's "
                                    "shapes")
            outputs.append(got)
    except Exception as e:   # noqa: BLE001 - any failure means "not the function we can replace"
        return Probe(False, f"{where}(q, k, cos, sin) failed on float64 CPU inputs: {type(e).__name__}: {e}")

    def on64(style):
        return all(torch.allclose(t.double(), w, rtol=1e-12, atol=1e-12)
                   for args, got in zip(inputs, outputs) for t, w in zip(got, _reference64(*args, style)))

    style = next((st for st in STYLES if on64(st)), None)
    if style is not None:
        forms = _forms(fn, inputs, style)
    else:
        # (off float64's formulas, but on fp32's: a function that computes in fp32, as ESM's, ModernBERT's and
        # Cohere's, whose q.float() rounds float64 inputs; its float64 calls run its own code, as the op's fallback)
        for style in STYLES:
            forms = _forms(fn, inputs, style)
            if dict(forms)[(torch.float32, torch.float32)] in (EXACT, CLOSE):
                break
        else:
            return Probe(False, f"{where} does not compute the rotate-half RoPE (x * cos + rotate_half(x) * sin), nor "
                                "its interleaved form (pairs of neighbours), that pipegoose's rope kernel computes")
    promotes = dict(forms)[(torch.bfloat16, torch.float32)] == EXACT
    partial, narrow_raises = _probe_partial(fn, g, style)
    return Probe(True, "", promotes, partial, forms, *_keywords(fn, inputs[0]), narrow_raises, style)


@dataclass(frozen=True)
class OneTensor:
    """How a RoPE function that rotates one tensor a call takes it (:attr:`Probe.one`): GPT-J's and CodeGen's
    ``apply_rotary_pos_emb(tensor, sin, cos)`` (``sin_first``; ``half``: tables of R / 2 values, each used for a pair
    of neighbours, as its ``repeat_interleave(..., 2, 3)``; ``heads_dim`` 2: the tensor laid out [B, S, H, D]),
    Gemma 3n's and Gemma 4's ``apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1)`` (``heads_dim`` None: it takes
    ``unsqueeze_dim``, as transformers' (q, k, cos, sin) functions do). ``params`` names its parameters."""

    params: str
    sin_first: bool = False
    half: bool = False
    heads_dim: int | None = None


def _one_tensor_params(fn: Callable) -> list | None:
    """The parameters of ``fn`` (a module's: its forward's), where it takes one tensor and then the tables (Gemma 4's
    and Gemma 3n's ``apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim)``, GPT-J's ``(tensor, sin, cos)``); else
    None."""
    sig = _signature(fn)
    names = list(sig.parameters) if sig is not None else []
    return names if len(names) >= 3 and names[1] in ("cos", "sin") and names[2] in ("cos", "sin") else None


def _as_pair(fn: Callable, form: OneTensor) -> Callable:
    """``fn``, a function that rotates one tensor a call taken as ``form`` says, as a ``(q, k, cos, sin[,
    unsqueeze_dim])`` function of [B, H, S, D] q and k (``unsqueeze_dim`` where ``fn`` takes it): ``fn`` called for
    q and for k, with the tables' first half where it takes half tables (so that GPT-J's, which repeats each value
    for a pair of neighbours, computes GLM's rotation, :data:`INTERLEAVED_FIRST_HALF`, of the given tables)."""

    def tables(cos, sin):
        if form.half:
            cos, sin = cos[..., :cos.shape[-1] // 2], sin[..., :sin.shape[-1] // 2]
        return (sin, cos) if form.sin_first else (cos, sin)

    if form.heads_dim is None:
        def pair(q, k, cos, sin, unsqueeze_dim=1):
            t = tables(cos, sin)
            return fn(q, *t, unsqueeze_dim=unsqueeze_dim), fn(k, *t, unsqueeze_dim=unsqueeze_dim)
    elif form.heads_dim == 2:
        def pair(q, k, cos, sin):
            t = tables(cos, sin)
            return fn(q.transpose(1, 2), *t).transpose(1, 2), fn(k.transpose(1, 2), *t).transpose(1, 2)
    else:
        def pair(q, k, cos, sin):
            t = tables(cos, sin)
            return fn(q, *t), fn(k, *t)
    return pair


def _signature(fn: Callable) -> inspect.Signature | None:
    """``fn``'s signature (a module's: its forward's), or None."""
    try:
        return inspect.signature(fn.forward if isinstance(fn, nn.Module) else fn)
    except (TypeError, ValueError):
        return None


def _params(fn: Callable) -> inspect.Signature | None:
    """``fn``'s signature (a module's: its forward's), where its first four parameters take q, k, cos and sin by
    position; else None (its calls with keywords or more arguments run its own code)."""
    if isinstance(fn, nn.Module):
        fn = fn.forward
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    first = list(sig.parameters.values())[:4]
    if len(first) < 4 or any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in first):
        return None
    return sig


def _keywords(fn: Callable, args: tuple) -> tuple[bool, bool]:
    """(:attr:`Probe.unsqueeze`, :attr:`Probe.position_ids`): whether ``fn`` has those parameters and computes with
    them what transformers' functions do, on ``args`` (float64 q, k, cos, sin): ``unsqueeze_dim`` 1 and -3 as its
    default, 2 and -2 the same for q and k laid out [B, S, H, D]; ``position_ids`` left unused."""
    sig = _params(fn)
    if sig is None:
        return False, False
    q, k, cos, sin = args

    def same(got, want):
        return _pair_of(got, want) and all(torch.equal(a, b) for a, b in zip(got, want))

    unsqueeze = position_ids = False
    try:
        with torch.no_grad():
            base = fn(q, k, cos, sin)
            if "unsqueeze_dim" in sig.parameters:
                qt, kt = q.transpose(1, 2), k.transpose(1, 2)
                unsqueeze = (all(same(fn(q, k, cos, sin, unsqueeze_dim=d), base) for d in (1, -3))
                             and all(same(tuple(t.transpose(1, 2) for t in fn(qt, kt, cos, sin, unsqueeze_dim=d)),
                                          base) for d in (2, -2)))
            if "position_ids" in sig.parameters:
                pos = torch.arange(q.shape[2]).flip(0).expand(q.shape[0], -1)
                position_ids = same(fn(q, k, cos, sin, position_ids=pos), base)
    except Exception:   # noqa: BLE001 - then calls with that keyword run its own code
        pass
    return unsqueeze, position_ids


def _probe_partial(fn: Callable, g: torch.Generator, style: str = ROTATE_HALF) -> tuple[bool, bool]:
    """(:attr:`Probe.partial`, :attr:`Probe.narrow_raises`): whether ``fn`` computes GPT-NeoX's partial rotary (GLM's,
    for its ``style``) for tables of fewer values than a head (4 and 2 of 8, tables of a batch and of one batch), and
    whether it raises for them instead (Llama's: the shapes do not broadcast); (False, False) where it returns
    something else."""
    try:
        for b_tab, r in ((2, 4), (1, 2)):
            q = torch.randn(2, 3, 5, 8, dtype=torch.float64, generator=g)
            k = torch.randn(2, 1, 5, 8, dtype=torch.float64, generator=g)
            cos = torch.randn(b_tab, 5, r, dtype=torch.float64, generator=g)
            sin = torch.randn(b_tab, 5, r, dtype=torch.float64, generator=g)
            with torch.no_grad():
                got = fn(q, k, cos, sin)
            want = _reference64(q, k, cos, sin, style)
            if (not _pair_of(got, want)
                    or not all(torch.allclose(t.double(), w, rtol=1e-12, atol=1e-12) for t, w in zip(got, want))):
                return False, False
    except Exception:   # noqa: BLE001 - then no call with narrower tables runs, fused or not
        return False, True
    return True, False


_HEADS = {1: 1, -3: 1, 2: 2, -2: 2}   # unsqueeze_dim -> where q's heads are (1: [B, H, S, D], 2: [B, S, H, D])


def _takes(args: tuple, kwargs: dict, found: Probe, sig: inspect.Signature | None) -> tuple | None:
    """A call in a form the kernel takes (the dispatcher's ``rope`` problem with the kernel's shape conditions; k of
    q's dtype, sin of cos's): ``((q, k, cos, sin), unsqueeze_dim, kind)``, ``kind`` what the probed function
    computes for its dtypes (:meth:`Probe.kind`; partial rotary where ``found.partial``: it computes GPT-NeoX's, so
    calls with tables of fewer values than a head qualify). Besides the four tensors, the call may pass (by position
    or keyword, as ``sig``, the function's signature, binds them) ``unsqueeze_dim`` (1, 2, -3 or -2, where the probe
    found transformers' meaning) and ``position_ids`` (None, or anything where the probe found it unused, as in
    transformers' older functions). None for anything else, which runs the model's own code."""
    unsqueeze_dim = 1
    if kwargs or len(args) != 4:
        bound, names = _bind(sig, args, kwargs, 4)
        if bound is None:
            return None
        for name, value in bound.items():
            if name in names or (name == "position_ids" and (value is None or found.position_ids)):
                continue
            if name == "unsqueeze_dim" and found.unsqueeze and type(value) is int and value in _HEADS:
                unsqueeze_dim = value
                continue
            return None
        args = tuple(bound[n] for n in names)
    if not all(isinstance(t, torch.Tensor) for t in args):
        return None
    q, k, cos, sin = args
    if shape_reason(tuple(q.shape), tuple(k.shape), tuple(cos.shape), tuple(sin.shape), _HEADS[unsqueeze_dim],
                    partial=found.partial, interleaved=found.interleaved):
        return None
    if k.dtype != q.dtype or sin.dtype != cos.dtype:
        return None
    return args, unsqueeze_dim, found.kind(q.dtype, cos.dtype)


def _bind(sig: inspect.Signature | None, args: tuple, kwargs: dict, n: int) -> tuple[dict | None, list]:
    """A call's arguments bound by the function's signature ``sig`` (name -> value, as passed), and the names of its
    first ``n`` parameters (the tensors :func:`_takes` and :func:`_takes_one` need); (None, []) where ``sig`` is
    unknown, the call does not bind, or one of those ``n`` is not passed."""
    if sig is None:
        return None, []
    try:
        bound = sig.bind(*args, **kwargs).arguments
    except TypeError:
        return None, []
    names = list(sig.parameters)[:n]
    return (bound, names) if all(name in bound for name in names) else (None, [])


def _takes_one(args: tuple, kwargs: dict, found: Probe, sig: inspect.Signature | None) -> tuple | None:
    """:func:`_takes` for a function that rotates one tensor a call (``found.one``): ``((x, k, cos, sin),
    unsqueeze_dim, kind)``, ``k`` a view of ``x`` with no heads (the op rotates q and k; here k is empty) and ``cos``,
    ``sin`` the tables as given (of R / 2 values where the function takes half tables: :func:`_call_tables` makes the
    op's). The call may pass its three tensors and, where the function takes it as transformers' do,
    ``unsqueeze_dim`` (1, 2, -3 or -2; left out: the function's default); None for anything else."""
    form = found.one
    bound, names = _bind(sig, args, kwargs, 3)
    if bound is None:
        return None
    unsqueeze_dim = form.heads_dim
    if unsqueeze_dim is None:   # (it takes unsqueeze_dim: the call's, else its default)
        default = sig.parameters["unsqueeze_dim"].default
        unsqueeze_dim = bound.get("unsqueeze_dim", default)
        if not found.unsqueeze or type(unsqueeze_dim) is not int or unsqueeze_dim not in _HEADS:
            return None
    if any(n not in names and n != "unsqueeze_dim" for n in bound):
        return None
    x, t1, t2 = (bound[n] for n in names)
    if not all(isinstance(t, torch.Tensor) for t in (x, t1, t2)) or x.dim() != 4:
        return None
    cos, sin = (t2, t1) if form.sin_first else (t1, t2)
    heads = _HEADS[unsqueeze_dim]
    k = x.narrow(heads, 0, 0)

    def width(t):   # (the op's tables: each value twice where the function takes half tables)
        shape = tuple(t.shape)
        return (*shape[:-1], 2 * shape[-1]) if form.half and shape else shape

    if shape_reason(tuple(x.shape), tuple(k.shape), width(cos), width(sin), heads, partial=found.partial,
                    interleaved=found.interleaved):
        return None
    if sin.dtype != cos.dtype:
        return None
    return (x, k, cos, sin), unsqueeze_dim, found.kind(x.dtype, cos.dtype)


def _call_tables(found: Probe, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables the op takes for a call's ``cos`` and ``sin``: :func:`kernel_tables` of the probed style, or, for a
    function of one tensor a call that takes half tables (GPT-J's), each value twice."""
    if found.one is not None and found.one.half:
        return cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    return kernel_tables(cos, sin, found.style)


def _declined(choice: dispatch.Choice, why: str) -> dispatch.Choice:
    """``choice`` (the kernel) turned into the op's fallback for a call whose dtypes the model's function computes
    otherwise than the op (``why``): the model's own code runs, counted as ``torch``; a request for the kernel
    (``PIPEGOOSE_IMPL_ROPE``) is said to be unmet."""
    unmet = (f"impl {choice.impl!r} ({choice.reason}) cannot run this call: {why}"
             if choice.source in ("argument", "env") else choice.unmet)
    return dataclasses.replace(choice, impl="torch", source="fallback", fallback=True,
                               reasons={**choice.reasons, choice.impl: why}, reason=why, unmet=unmet)


def _fused_caller() -> nn.Module | None:
    """The innermost fused attention module of this thread, where its forward called the function itself (its frame,
    ``self`` the module, is the caller's, past ``torch.nn.Module``'s call machinery: the ``kernels`` wrapper module's;
    an unfused attention that a hook inside it runs calls its own); else None."""
    return _underway.caller(sys._getframe(2), direct=True)


def _make_dispatching(fallback: Callable, found: Probe, where: str = NAME) -> Callable:
    from ..functional import apply_rotary_pos_emb as fused_rope

    one = found.one is not None   # (one tensor a call: the op rotates it as q, with an empty k)
    sig = _signature(fallback) if one else _params(fallback)
    takes = _takes_one if one else _takes

    def apply_rotary_pos_emb(*args: Any, **kwargs: Any):
        module = None if torch.compiler.is_compiling() else _fused_caller()
        call = None if module is None else takes(args, kwargs, found, sig)
        if call is None:
            return fallback(*args, **kwargs)
        (q, k, cos, sin), unsqueeze_dim, kind = call
        # (GLM's: the first half of each, each value twice; GPT-J's half tables: each value twice)
        cos, sin = _call_tables(found, cos, sin)
        inter = found.interleaved
        if kind == EXACT and cos.shape[-1] == q.shape[-1]:   # the op's paths compute what the function does
            got = fused_rope(q, k, cos, sin, unsqueeze_dim, interleaved=inter)
            return got[0] if one else got
        # partial rotary, and dtypes that the op's PyTorch path computes otherwise than the function: the kernel where
        # the dispatcher chooses it for this call (its results cast to q's dtype where the function casts them), else
        # the model's own code (the choice recorded either way: counted, warned about, refused in strict mode where it
        # is a fallback)
        choice = choice_of(q, k, cos, sin, unsqueeze_dim, interleaved=inter)
        if choice.impl == "pipegoose":
            if kind is not None:
                q_embed, k_embed = run_choice(choice, q, k, cos, sin, unsqueeze_dim, inter)
                if kind == CAST:
                    q_embed, k_embed = q_embed.to(q.dtype), k_embed.to(k.dtype)
                return q_embed if one else (q_embed, k_embed)
            choice = _declined(choice, f"{where} computes {dtype_name(q.dtype)} {'x' if one else 'q and k'} with "
                                       f"{dtype_name(cos.dtype)} cos and sin otherwise than the op (probed): the "
                                       "model's own code runs")
        dispatch.record(choice)
        return fallback(*args, **kwargs)

    functools.update_wrapper(apply_rotary_pos_emb, getattr(fallback, "__func__", fallback))
    setattr(apply_rotary_pos_emb, _FALLBACK_ATTR, fallback)
    apply_rotary_pos_emb.__pipegoose_users__ = weakref.WeakSet()   # the fused modules that use it
    return apply_rotary_pos_emb


def _enter(module, args):
    _underway.enter(module)


def _leave(module, args, output):
    _underway.leave(module)


@dataclass
class Installed:
    """What :func:`install` did for one attention module: the hooks' handles, the dispatching function, where it is
    (``namespace[NAME]``, or ``holder``'s forward) and what it replaced there (``replaced``; None: nothing)."""

    namespace: dict
    dispatching: Callable
    handles: tuple
    holder: nn.Module | None = None
    replaced: Any = None


def install(module: nn.Module, t: Target, found: Probe) -> Installed:
    """Route ``module``'s RoPE calls to our op: the dispatching function (put in place unless it is there already)
    and the module's two hooks. The caller has probed ``t.original`` (``found``: what it computes per call form, see
    :meth:`Probe.kind`, and whether it computes GPT-NeoX's partial rotary, so that calls with narrower tables go to
    our op too, each where the dispatcher chooses the kernel for it)."""
    current = t.namespace.get(NAME)
    dispatching = dispatching_of(current)
    holder = current if isinstance(current, nn.Module) else None
    replaced = None
    if dispatching is None:
        if holder is not None:   # transformers' kernels wrapper: its forward, the object stays
            replaced = holder.__dict__.get("forward")
            fallback = replaced if replaced is not None else types.MethodType(type(holder).forward, holder)
            dispatching = _make_dispatching(fallback, found, t.where)
            holder.__dict__["forward"] = dispatching
        else:
            dispatching = _make_dispatching(current, found, t.where)
            t.namespace[NAME] = dispatching
    elif holder is not None:
        replaced = dispatching.__pipegoose_replaced__
    if holder is not None and not hasattr(dispatching, "__pipegoose_replaced__"):
        dispatching.__pipegoose_replaced__ = replaced
    dispatching.__pipegoose_users__.add(module)
    # (module-level functions: a fused model pickles, its hooks by reference)
    handles = (module.register_forward_pre_hook(_enter), module.register_forward_hook(_leave, always_call=True))
    return Installed(t.namespace, dispatching, handles, holder, replaced)


def uninstall(module: nn.Module | None, rec: Installed) -> None:
    """Undo :func:`install` for one module: its hooks go, and the global (or the wrapper's forward) goes back once no
    live fused module uses the dispatching function (unless someone replaced it there since)."""
    for h in rec.handles:
        h.remove()
    users = rec.dispatching.__pipegoose_users__
    if module is not None:
        users.discard(module)
    if len(users):
        return
    if rec.holder is not None:
        if rec.holder.__dict__.get("forward") is rec.dispatching:
            if rec.replaced is None:
                del rec.holder.__dict__["forward"]
            else:
                rec.holder.__dict__["forward"] = rec.replaced
    elif rec.namespace.get(NAME) is rec.dispatching:
        rec.namespace[NAME] = getattr(rec.dispatching, _FALLBACK_ATTR)


def is_dispatching(fn: Any) -> bool:
    """Whether ``fn`` is a dispatching function of :func:`install`."""
    return callable(fn) and hasattr(fn, _FALLBACK_ATTR)


def hooked(module: nn.Module) -> bool:
    """Whether ``module`` carries :func:`install`'s hooks (a copy of a fused module does: its hooks were copied)."""
    return any(h is _enter for h in module._forward_pre_hooks.values())
