"""Rotary position embedding (RoPE) of an attention layer's query and key, in the rotate-half form of GPT-NeoX,
Llama and their copies (transformers' ``apply_rotary_pos_emb``): ``x * cos + rotate_half(x) * sin`` with
``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])``, cos and sin broadcast over the heads. Our kernel with its C++
autograd, the PyTorch reference, dispatch.

Dtypes: one for q, k, cos and sin, or fp16 / bf16 q and k with fp32 cos and sin (a model in fp32 under autocast:
the projections are 16-bit, LlamaRotaryEmbedding's tables fp32), whose results are fp32 as PyTorch's promotion of
``q * cos`` makes them, and whose gradients come back in q's dtype.

Numerics: the kernel computes each output (and, in the backward, each gradient) in fp32 from the stored inputs and
rounds it once to the dtype. Eager PyTorch in fp16 / bf16 rounds both products and their sum (three roundings), so
the two differ by about one unit in the last place of the dtype, the kernel being the closer to exact; in fp32 they
agree to about 1e-7 relative. The kernel saves cos and sin for the backward (as eager PyTorch does: the rotation is
linear in q and k); cos and sin get no gradient from it, so a call where they require one runs PyTorch's ops.

Partial rotary (GPT-NeoX / Pythia, Phi-3, GLM and the other models whose ``apply_rotary_pos_emb`` reads the rotated
size from the tables): cos and sin of ``1 < R < D`` values a head rotate ``x[..., :R]`` of q and k and pass the rest
through, ``cat((rotated, x[..., R:]), -1)``, as those functions do (Llama's raises for such tables; tables of one
value a head broadcast over it, as in Llama's). The kernel takes even R: one launch each way rotates the first R
values of each head and copies the rest (transformers' eager code runs about 40 kernels for q and k, the backward of
its slices among them, which write and add tensors of the whole head). Its outputs are laid out as the whole-head
kernel's (``torch.empty_like`` the input's: a dense input's strides, so a contiguous [B, S, H, D] pair stays so), not
always as the concatenation's (contiguous). The built-in order chooses it; the tuning rules, timed on whole heads,
do not speak for it (``tuned_for``). Measured on an H100 (``benchmarks.rope_partial``, bf16, forward + backward,
share of the device copy, sessions 59 and 60): Pythia's quarter-rotated heads of 64 and 128 values 88%
(``torch.compile`` 83.5-84, transformers' eager code 12-13; 16-bit heads of 16-byte halves run a lane kernel, a lane a 16-byte chunk,
the partner by warp shuffles), Pythia-2.8b's heads of 80 with 20 rotated 85.5 (compile 77.5) and GPT-NeoX-20B's of 96
with 24 rotated 89 (compile 88; heads whose rotated halves are no multiple of 16 bytes are staged whole through shared
memory). On an H200 the 16-bit heads of 64 and 128 run near 70% of its copy, as compile's do; fp32 trails compile by
2-6 points on the H100. The GPT-NeoX ~405M training step (session 56, H100): 143.0k tokens/s against
132.7k with the model's own RoPE.

Interleaved RoPE (``interleaved=True``: GPT-J's, Cohere's, GLM's, Helium's and ERNIE 4.5's functions, whose
``rotate_half`` pairs neighbours, ``stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)``): the same kernel, a thread a
vector of whole pairs; the tables as given (Cohere's repeat each frequency twice; GLM's function makes its own so
before the rotation, and fuse's routing does the same), partial rotary as above (GLM's: the first R values of each
head in pairs, the rest passed through).

Implementations (op ``rope``): ``pipegoose`` (pipegoose/kernels/csrc/rope.cu, this project, MIT) and ``torch``
(transformers' formula in PyTorch ops).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import dispatch
from ..dispatch import Implementation, Problem
from ._common import (HALF_DTYPES, all_have_storage, any_in_transform, call_without_autocast, check_float_tensor,
                      dtype_name, has_tangent, in_dual_level, kernel_input_ok, needs_grad, nested_fallback)

OP = "rope"
FORWARD_AD_ROPE = ("a dual tensor (torch.autograd.forward_ad): the RoPE kernel has no forward derivative (jvp); "
                   "PyTorch's ops have")
SRC_PIPEGOOSE = "pipegoose/rope: pipegoose/kernels/csrc/rope.cu (pipegoose, MIT)"
_NAMES = ("q", "k", "cos", "sin")


def check_args(q: Any, k: Any, cos: Any, sin: Any, unsqueeze_dim: Any = 1, interleaved: Any = False) -> None:
    """Check the arguments (errors name the argument). Shapes are left to the paths: the kernel's ``supports`` says
    which it takes, and PyTorch's broadcasting raises for the rest.

    Raises:
        TypeError: ``q``, ``k``, ``cos`` or ``sin`` not a floating point tensor, or of a dtype no path here takes
            (float8); ``unsqueeze_dim`` not an int; ``interleaved`` not a bool.
        ValueError: a tensor on another device than ``q``.
    """
    for name, t in zip(_NAMES, (q, k, cos, sin)):
        check_float_tensor(t, name)
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, expected q's device {q.device}")
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, int):
        raise TypeError(f"unsqueeze_dim: expected an int (the heads' dimension of q once cos is unsqueezed), got "
                        f"{type(unsqueeze_dim).__name__}")
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved: expected a bool (the rotation of neighbouring pairs), got "
                        f"{type(interleaved).__name__}")


def rope_problem(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 unsqueeze_dim: int = 1, interleaved: bool = False) -> Problem:
    """The dispatcher's description of one call (metadata only)."""
    partial = q.dim() > 0 and cos.dim() > 0 and 1 < cos.shape[-1] < q.shape[-1]
    return Problem(OP, q.dtype, q.device, cols=q.shape[-1] if q.dim() else 1, needs_grad=needs_grad(q, k),
                   extra=dict(shape=tuple(q.shape), k_shape=tuple(k.shape), cos_shape=tuple(cos.shape), partial=partial,
                              sin_shape=tuple(sin.shape), dtypes=(k.dtype, cos.dtype, sin.dtype),
                              unsqueeze_dim=unsqueeze_dim, numel=q.numel() + k.numel(), interleaved=interleaved,
                              table_grad=torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad),
                              storage=all_have_storage(q, k, cos, sin), forward_ad=has_tangent(q, k, cos, sin)))


def _explain(q, k, cos, sin, unsqueeze_dim=1, interleaved=False):
    check_args(q, k, cos, sin, unsqueeze_dim, interleaved)
    return rope_problem(q, k, cos, sin, unsqueeze_dim, interleaved)


def _heads_dim(p: Problem) -> int | None:
    """Where q's heads are: 1 ([B, H, S, D], transformers' default) or 2 ([B, S, H, D]); None for other values."""
    return {1: 1, -3: 1, 2: 2, -2: 2}.get(p["unsqueeze_dim"])


def shape_reason(q: tuple, k: tuple, c: tuple, s_shape: tuple, heads_dim: int = 1, partial: bool = True,
                 interleaved: bool = False) -> str:
    """Why the kernel does not take these shapes of q, k, cos and sin (q's heads at ``heads_dim``: 1 or 2), or "" when
    it does: 4-d q and k of one batch, sequence and head size, cos and sin [batch or 1, seq, R], R the head size
    (even), or with ``partial`` an even size below it (partial rotary). The one place of these conditions (the
    dispatcher's ``supports`` and fuse's RoPE routing ask it)."""
    if len(q) != 4 or len(k) != 4 or len(c) != 3:
        return (f"q {list(q)}, k {list(k)}, cos {list(c)}: the kernel takes 4-d q and k and 3-d cos and sin "
                "[batch or 1, seq, head_dim]")
    if s_shape != c:
        return f"sin's shape {list(s_shape)} differs from cos's {list(c)}"
    s = 3 - heads_dim   # seq's dim: 2 for [B, H, S, D], 1 for [B, S, H, D]
    if k[0] != q[0] or k[s] != q[s] or k[3] != q[3]:
        return f"k's shape {list(k)} differs from q's {list(q)} in batch, seq or head_dim"
    if c[0] not in (1, q[0]) or c[1] != q[s] or not (c[2] == q[3] or (partial and 1 < c[2] < q[3])):
        if partial:
            return (f"cos's shape {list(c)} is not [{q[0]} or 1, {q[s]}, R], R {q[3]} or below it (partial rotary); "
                    "other broadcasts run PyTorch's ops")
        return f"cos's shape {list(c)} is not [{q[0]} or 1, {q[s]}, {q[3]}] (other broadcasts run PyTorch's ops)"
    if c[2] % 2:
        if interleaved:
            return (f"head_dim {q[3]} is odd: pairs of neighbours rotate" if c[2] == q[3] else
                    f"{c[2]} rotated dims (cos's last size) is odd: pairs of neighbours rotate")
        return (f"head_dim {q[3]} is odd: rotate_half splits it in two" if c[2] == q[3] else
                f"{c[2]} rotated dims (cos's last size) is odd: rotate_half splits them in two")
    return ""


def _pipegoose_supports(p: Problem) -> tuple[bool, str]:
    ok, why = kernel_input_ok(p, FORWARD_AD_ROPE, "q")
    if not ok:
        return ok, why
    k_dt, cos_dt, sin_dt = p["dtypes"]
    if k_dt != p.dtype or sin_dt != cos_dt or not (cos_dt == p.dtype or (cos_dt == torch.float32
                                                                           and p.dtype in HALF_DTYPES)):
        return False, (f"q is {dtype_name(p.dtype)} but k, cos, sin are "
                       f"{', '.join(dtype_name(d) for d in p['dtypes'])}: the kernel takes one dtype, or 16-bit q and "
                       "k with fp32 cos and sin (autocast)")
    if p["table_grad"]:
        return False, "cos or sin requires grad: the kernel gives them no gradient"
    h = _heads_dim(p)
    if h is None:
        return False, f"unsqueeze_dim={p['unsqueeze_dim']}: the kernel takes 1 ([B, H, S, D]) or 2 ([B, S, H, D])"
    why = shape_reason(p["shape"], p["k_shape"], p["cos_shape"], p["sin_shape"], h,
                       interleaved=p.get("interleaved", False))
    if why:
        return False, why
    if p["numel"] == 0:
        return False, "an empty input"
    return True, ""


def _whole_heads(p: Problem) -> bool:
    return not p.get("partial", False) and not p.get("interleaved", False)


# partial rotary and the interleaved rotation: out of the tuning rules (timed on whole heads, rotate-half); the built-in
# order takes them (session 54's NeoX step)
dispatch.register(Implementation(OP, "pipegoose", "ours", _pipegoose_supports, ("pipegoose/rope",), SRC_PIPEGOOSE,
                                 tuned_for=_whole_heads))
dispatch.register(Implementation(OP, "torch", "reference", lambda p: (True, ""), (),
                                 "PyTorch: q * cos + rotate_half(q) * sin (transformers' formula)"))
dispatch.register_problem(OP, _explain)


def rotate_half(x: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """``cat(-x[..., D/2:], x[..., :D/2])`` (transformers' ``rotate_half``); ``interleaved``: the pairs of neighbours,
    ``stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)`` (Cohere's and GLM's ``rotate_half``)."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   unsqueeze_dim: int = 1, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch path: transformers' ``apply_rotary_pos_emb`` (broadcasting; the promoted dtype); where the tables
    hold fewer values than a head, but more than one (partial rotary), GPT-NeoX's: the first ``cos.shape[-1]`` values
    of each head of that tensor rotate, the rest pass through. ``interleaved``: the rotation of neighbouring pairs
    (:func:`rotate_half`'s), partial rotary as GLM's (the tables as given)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    r = cos.shape[-1] if cos.dim() else 0

    def rotate(x):
        if x.dim() and 1 < r < x.shape[-1]:
            x_rot = x[..., :r]
            return torch.cat((x_rot * cos + rotate_half(x_rot, interleaved) * sin, x[..., r:]), dim=-1)
        return x * cos + rotate_half(x, interleaved) * sin

    return rotate(q), rotate(k)


def _run_pipegoose(q, k, cos, sin, heads_dim: int, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """pipegoose/rope through ``torch.ops.pipegoose.rope(q, k, cos, sin, interleaved)`` (q and k as [B, H, S, D]: a
    [B, S, H, D] pair goes through as transposed views, and its results come back transposed): the forward kernel with
    its autograd formula in C++ (pipegoose/kernels/bindings/rope.cpp), partial rotary included (cos and sin of R < D
    values a head). A backward with ``create_graph=True`` rotates the gradients back with PyTorch's ops (fp32, one
    rounding) instead."""
    ops, why = dispatch.kernel("pipegoose/rope")
    if ops is None:
        raise RuntimeError(why)
    if heads_dim == 2:
        qe, ke = ops.rope.default(q.transpose(1, 2), k.transpose(1, 2), cos, sin, interleaved)
        return qe.transpose(1, 2), ke.transpose(1, 2)
    return ops.rope.default(q, k, cos, sin, interleaved)


def _signature(q, k, cos, sin, unsqueeze_dim, interleaved=False) -> tuple | None:
    if torch.compiler.is_compiling():
        return None
    try:
        if any_in_transform(q, k, cos, sin) or in_dual_level():
            return None
        # (the type too: True, 1.0 and numpy.int64(1) equal 1, and check_args refuses them)
        sig = (type(unsqueeze_dim), unsqueeze_dim, type(interleaved), interleaved, torch.is_grad_enabled()) + tuple(
            (type(t), t.dtype, t.device, t.shape, t.requires_grad) for t in (q, k, cos, sin))
        hash(sig)
    except (AttributeError, TypeError):
        return None
    return sig


def choice_of(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1,
              impl: str | None = None, interleaved: bool = False) -> dispatch.Choice:
    """The dispatcher's choice for these (plain, not nested) inputs, from the choice cache that :func:`run` fills;
    nothing counted or run (choosing may load the kernel, and build it on a first run, as :func:`dispatch.choose`
    does). fuse's RoPE routing asks it for partial-rotary calls, which run the model's own code where the kernel does
    not take them.

    Raises:
        TypeError, ValueError: as :func:`check_args`; ``impl`` naming no implementation of ``rope``.
    """
    sig = _signature(q, k, cos, sin, unsqueeze_dim, interleaved)
    key = None if sig is None else dispatch.choice_key(OP, impl, sig)
    choice = None if key is None else dispatch.cached_choice(key)
    if choice is None:
        check_args(q, k, cos, sin, unsqueeze_dim, interleaved)
        choice = dispatch.choose(OP, rope_problem(q, k, cos, sin, unsqueeze_dim, interleaved), impl)
        if key is not None:
            dispatch.remember_choice(key, choice)
    return choice


def run(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int,
        impl: str | None, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pipegoose.nn.fusion.functional.apply_rotary_pos_emb` behind the checks; runs the implementation the
    dispatcher chooses (``impl``: a forced one or None).

    Raises:
        TypeError, ValueError: as :func:`check_args`; ``impl`` naming no implementation of ``rope``.
        FusionFallbackError: in strict mode, where the kernel cannot take the input.
    """
    if dispatch.compile_passthrough(OP, impl):  # torch.compile fuses the ops itself, after eager mode's checks
        check_args(q, k, cos, sin, unsqueeze_dim, interleaved)
        return rope_reference(q, k, cos, sin, unsqueeze_dim, interleaved)
    if any(getattr(t, "is_nested", False) for t in (q, k, cos, sin)):
        check_args(q, k, cos, sin, unsqueeze_dim, interleaved)
        dispatch.record(nested_fallback(OP, impl))
        return rope_reference(q, k, cos, sin, unsqueeze_dim, interleaved)
    return run_choice(choice_of(q, k, cos, sin, unsqueeze_dim, impl, interleaved), q, k, cos, sin, unsqueeze_dim,
                      interleaved)


def run_choice(choice: dispatch.Choice, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               unsqueeze_dim: int = 1, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Record ``choice`` (:func:`choice_of`'s for these inputs: counted, warned, refused in strict mode where it is a
    fallback) and run it: the kernel, or PyTorch's reference path.

    Raises:
        FusionFallbackError: in strict mode, where ``choice`` is a fallback to the reference path.
    """
    choice = dispatch.record(choice)
    if choice.impl == "pipegoose":
        heads_dim = 2 if unsqueeze_dim in (2, -2) else 1
        return call_without_autocast(q.device, _run_pipegoose, q, k, cos, sin, heads_dim, interleaved)
    return rope_reference(q, k, cos, sin, unsqueeze_dim, interleaved)
