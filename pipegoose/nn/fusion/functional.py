"""Functional API of the fused ops: each function has autograd, fused paths and a PyTorch reference path, chosen
per call by :mod:`pipegoose.nn.fusion.dispatch` (``impl=`` > ``PIPEGOOSE_IMPL_<OP>`` > tuning table > built-in
order > reference, with the fallback reason recorded; strict mode turns a fallback into an error).

Every function accepts ``impl`` (keyword): ``None``/``"auto"``, or an implementation name of the op
(``pipegoose``, ``megatron``, ``apex``, ``torch``), case and surrounding blanks ignored as in ``PIPEGOOSE_IMPL_*``
values (``"Apex"`` is ``"apex"``); an implementation that cannot take the input is skipped with its reason recorded
(``UserWarning``). Autocast: the output dtype is the one PyTorch's own op gives under the same autocast state
(softmax and layer_norm run in fp32 under CUDA autocast; CPU autocast leaves them in the input dtype).

Double backward (``torch.autograd.grad(..., create_graph=True)`` and a backward through its result, e.g. gradient
penalties or Hessian-vector products): the fused backward kernels are not differentiable, so a backward run with
``create_graph=True`` computes the gradients with the PyTorch reference formulas (on the inputs the fused forward
saved) instead, and second derivatives are PyTorch's; a plain backward runs the kernels. The forward stays fused.
The exception: :func:`fused_linear_cross_entropy`, whose fused path computes its gradients in the forward from
tensors it does not keep, raises RuntimeError on a backward with ``create_graph=True`` (``impl="torch"`` is twice
differentiable).

Transforms and forward mode: inside ``torch.func`` (``vmap``, ``grad``, ``jvp``: any tensor argument of a transform,
the weight or mask too) every op runs its PyTorch reference. With dual tensors (``torch.autograd.forward_ad``) the
softmaxes keep their fused paths (their Functions have a ``jvp``); the norms, whose fused Functions have none, run
the reference (a dispatcher choice with the reason, not an error).

Kernel sources: see :mod:`pipegoose.nn.fusion.ops.softmax`, :mod:`~pipegoose.nn.fusion.ops.layer_norm`,
:mod:`~pipegoose.nn.fusion.ops.rms_norm`, :mod:`~pipegoose.nn.fusion.ops.swiglu`,
:mod:`~pipegoose.nn.fusion.ops.cross_entropy`, :mod:`~pipegoose.nn.fusion.ops.rope`.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import torch

from .ops import cross_entropy as _ce
from .ops import layer_norm as _ln
from .ops import linear_cross_entropy as _flce
from .ops._common import INPUT_DTYPES as _INPUT_DTYPES
from .ops import rms_norm as _rms
from .ops import rms_norm_gated as _rmsg
from .ops import rope as _rope
from .ops import softmax as _sm
from .ops import swiglu as _swiglu

__all__ = ["softmax", "scaled_softmax", "scaled_masked_softmax", "scaled_upper_triang_masked_softmax",
           "layer_norm", "mixed_fused_layer_norm", "rms_norm", "swiglu", "silu_and_mul", "geglu", "gelu_and_mul",
           "gelu", "squared_relu", "cross_entropy", "fused_linear_cross_entropy", "apply_rotary_pos_emb"]


def softmax(input: torch.Tensor, dim: int | None = None, _stacklevel: int = 3, dtype: torch.dtype | None = None, *,
            impl: str | None = None) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.softmax(input, dim, _stacklevel, dtype)`` (the same signature): the same
    result for every input.

    Args:
        input: a float32, float16, bfloat16 or float64 tensor, any shape, any device.
        dim: the dim to normalize over. None (deprecated, as in F.softmax): PyTorch's implicit choice, dim 0 for 0-,
            1- and 3-dimensional ``input``, else dim 1, with F.softmax's deprecation warning.
        _stacklevel: as in F.softmax, the stack level of that warning.
        dtype: if given, ``input`` is cast to it first (as F.softmax does).

    Returns:
        Tensor of ``input``'s shape, dtype ``dtype`` or ``input.dtype`` (fp32 under CUDA autocast, like F.softmax).

    The fused path (pipegoose/softmax, pipegoose/kernels/csrc/softmax.cu, MIT) runs only where its result is
    within ``torch.allclose``'s default tolerance of F.softmax: CUDA, fp32, last dim. fp16/bf16 use F.softmax
    (a fused half result may differ by one ulp; :func:`scaled_softmax` is the fused half-precision path).

    Raises:
        IndexError: ``dim`` out of range. TypeError: ``input`` (or ``dtype``) not float32, float16, bfloat16 or
        float64 (float8 included), ``dim`` not an integer or None, ``impl`` not a str. ValueError: ``impl`` names
        no implementation.
    """
    x = input
    if dim is None and isinstance(x, torch.Tensor):
        # F.softmax's legacy rule (torch.nn.functional._get_softmax_dim, one frame deeper: hence - 1), with its warning
        warnings.warn("Implicit dimension choice for softmax has been deprecated. Change the call to include dim=X "
                      "as an argument.", stacklevel=max(1, _stacklevel - 1))
        dim = 0 if x.dim() in (0, 1, 3) else 1
    if dtype is not None and isinstance(x, torch.Tensor):
        if not isinstance(dtype, torch.dtype) or dtype not in _INPUT_DTYPES:
            raise TypeError(f"dtype: expected torch.float32, float16, bfloat16, float64 or None, got {dtype}")
        x, dtype = x.to(dtype), None  # as F.softmax: cast first (integer input with a float dtype is fine)
    _sm.check_input(x, "input")
    return _sm.run_plain(x, dim, dtype, impl)


def scaled_softmax(x: torch.Tensor, scale: float = 1.0, *, impl: str | None = None) -> torch.Tensor:
    """``softmax(scale * x)`` over the last dim, fp32 math (op ``softmax``).

    Args:
        x: [..., sk] fp32/fp16/bf16 (fused: CUDA; the Megatron copy also needs [b, np, sq, sk] fp16/bf16); fp64
            runs the reference path, a nested tensor (either layout) ``F.softmax(x * scale, -1)``.
        scale: a finite number (Python, numpy or a 0-d tensor; one that carries a derivative, a learnable
            temperature that requires grad, a dual tensor or a ``torch.func`` transform's, keeps it: ``x`` is
            multiplied by it first, as in ``F.softmax(x * scale)``, and the op runs with scale 1; a transform's
            tensor has no value to check, so a non-finite one gives NaN there, as ``F.softmax(x * scale)`` does).

    Returns:
        Tensor like ``x`` (dtype fp32 under CUDA autocast).

    Kernels: pipegoose/softmax (pipegoose/kernels/csrc/softmax.cu, MIT); Megatron-LM scaled_masked_softmax via
    ColossalAI 0.5.0 extensions/csrc/kernel/cuda/scaled_masked_softmax_kernel.cu (Apache-2.0), with an all-False
    mask. A row of all ``-inf`` gives NaN on the reference path.

    Raises:
        TypeError: ``x`` not fp32/fp16/bf16/fp64 (float8 included), non-number ``scale``. ValueError: non-finite
        ``scale``.
    """
    _sm.check_input(x)
    x, scale = _sm.fold_scale(x, scale)
    return _sm.run(_sm.OP_PLAIN, x, None, scale, False, impl)


def scaled_masked_softmax(x: torch.Tensor, mask: torch.Tensor | None, scale: float = 1.0, *,
                          impl: str | None = None) -> torch.Tensor:
    """Megatron's scaled masked softmax: ``softmax(scale * x)`` over the last dim with ``mask`` True = masked.

    Args:
        x: [b, np, sq, sk] fp32/fp16/bf16 (fp64: the reference path; a nested tensor, any rank, with ``mask``
            None: ``F.softmax(x * scale, -1)``).
        mask: bool (or uint8, nonzero = masked) [b or 1, np or 1, sq or 1, sk] (any dim but sk may be 1 to
            broadcast; Megatron's kernel takes only np == 1, the others every shape), or None (=
            :func:`scaled_softmax`: the call is then op ``softmax``, counted and forced as that op, with
            ``PIPEGOOSE_IMPL_SOFTMAX``; ``PIPEGOOSE_IMPL_SOFTMAX_MASKED`` does not apply).
        scale: a finite number (Python, numpy or a 0-d tensor; one that carries a derivative, a learnable
            temperature that requires grad, a dual tensor or a ``torch.func`` transform's, keeps it: ``x`` is
            multiplied by it first, as in ``F.softmax(x * scale)``, and the op runs with scale 1; a transform's
            tensor has no value to check, so a non-finite one gives NaN there, as ``F.softmax(x * scale)`` does).

    Returns:
        [b, np, sq, sk] in ``x``'s dtype (fp32 under CUDA autocast). A row whose keys are all masked gives zeros
        in the output and in the gradient, on every path.

    Kernels (op ``softmax.masked``): pipegoose/softmax (MIT); Megatron-LM scaled_masked_softmax (commit 040eac94)
    via ColossalAI 0.5.0 extensions/csrc/kernel/cuda/scaled_masked_softmax_kernel.cu, Apache-2.0 (fp16/bf16,
    sq > 1, sk <= 2048, sk % 4 == 0 beyond 64, sq a multiple of batches_per_block, scale exact in the dtype).

    Raises:
        TypeError: ``x`` not fp32/fp16/bf16/fp64 (float8 included), ``mask`` not bool/uint8, ``scale`` not a
            number, a nested ``x`` with a mask.
        ValueError: ``x`` not 4-D, ``mask`` shape or device wrong, ``scale`` not finite.
    """
    _sm.check_input(x)
    _sm.check_scale_type(scale)   # (its value: fold_scale)
    if getattr(x, "is_nested", False):   # (before the shape checks, which a strided nested tensor fails in: a review)
        if mask is not None:
            raise _sm.nested_with_mask(False)
        x, scale = _sm.fold_scale(x, scale)
        return _sm.run(_sm.OP_PLAIN, x, None, scale, False, impl)
    if x.dim() != 4:
        raise ValueError(f"x: expected [b, np, sq, sk], got shape {list(x.shape)}")
    if mask is not None:
        mask = _sm.check_mask(mask, x)
    x, scale = _sm.fold_scale(x, scale)   # (after the checks: a learnable scale multiplies a valid x only)
    if mask is None:
        return _sm.run(_sm.OP_PLAIN, x, None, scale, False, impl)
    return _sm.run(_sm.OP_MASKED, x, mask, scale, False, impl)


def scaled_upper_triang_masked_softmax(x: torch.Tensor, scale: float = 1.0, *,
                                       impl: str | None = None) -> torch.Tensor:
    """Megatron's causal softmax: ``softmax(scale * x)`` over the last dim, key ``j`` masked for query ``i`` when
    ``j > i`` (``j > i + sk - sq`` when sq != sk: bottom-right aligned, as with a KV cache).

    Args:
        x: [attn_batches, sq, sk] fp32/fp16/bf16 (Megatron: sq == sk; fp64: the reference path).
        scale: a finite number (Python, numpy or a 0-d tensor; one that carries a derivative, a learnable
            temperature that requires grad, a dual tensor or a ``torch.func`` transform's, keeps it: ``x`` is
            multiplied by it first, as in ``F.softmax(x * scale)``, and the op runs with scale 1; a transform's
            tensor has no value to check, so a non-finite one gives NaN there, as ``F.softmax(x * scale)`` does).

    Returns:
        [attn_batches, sq, sk] in ``x``'s dtype (fp32 under CUDA autocast); rows with no visible key (sq > sk)
        are zeros.

    Kernels (op ``softmax.causal``): pipegoose/softmax (MIT, any length); Megatron-LM
    scaled_upper_triang_masked_softmax (commit 040eac94) via ColossalAI 0.5.0
    extensions/csrc/kernel/cuda/scaled_upper_triang_masked_softmax_kernel.cu, Apache-2.0 (fp16/bf16, sq == sk
    <= 2048, attn_batches a multiple of batches_per_block; longer inputs go to another implementation).

    Raises:
        TypeError: ``x`` not fp32/fp16/bf16/fp64 (float8 included), or nested (no causal mask for those).
        ValueError: ``x`` not 3-D, non-finite ``scale``.
    """
    _sm.check_input(x)
    _sm.check_scale_type(scale)   # (its value: fold_scale)
    if getattr(x, "is_nested", False):
        raise _sm.nested_with_mask(True)
    if x.dim() != 3:
        raise ValueError(f"x: expected [attn_batches, sq, sk], got shape {list(x.shape)}")
    x, scale = _sm.fold_scale(x, scale)
    return _sm.run(_sm.OP_CAUSAL, x, None, scale, True, impl)


def layer_norm(x: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5, *, impl: str | None = None) -> torch.Tensor:
    """LayerNorm over the trailing ``normalized_shape`` dims, statistics in fp32 (op ``layer_norm``).

    Args:
        x: [*, *normalized_shape], fp32, fp16, bf16 (fused paths) or fp64 (the reference path).
        normalized_shape: an int or a sequence of ints, each >= 0.
        weight, bias: [*normalized_shape] or None, fp32/fp16/bf16/fp64 independent of ``x``'s (e.g. bf16 x with
            fp32 weight).
        eps: added to the variance.

    Returns:
        Tensor of ``x``'s shape; dtype = what ``torch.nn.LayerNorm`` gives: ``x.dtype`` (also with fp32
        parameters), fp32 under CUDA autocast. (fp32 ``x`` with half parameters, which PyTorch rejects, gives
        fp32.) An empty ``x`` (no rows, or a 0 in ``normalized_shape``) runs the PyTorch reference path with source
        ``empty``, not a fallback (no kernel runs for it; strict mode does not raise): an empty result and gradients as
        F.layer_norm gives them.

    Kernels: pipegoose/layer_norm (pipegoose/kernels/csrc/layer_norm.cu, MIT); Apex mixed fused LayerNorm via
    ColossalAI 0.5.0 extensions/csrc/kernel/cuda/layer_norm_kernel.cu, Apache-2.0 (used only when gamma/beta
    have the output dtype: apex#1379).

    Raises:
        TypeError: ``x``, ``weight`` or ``bias`` not fp32/fp16/bf16/fp64 (float8 included), ``eps`` not a
        number (a Python or numpy number, or a 0-d tensor, as ``F.layer_norm`` takes).
        ValueError: shapes or devices wrong, ``eps`` negative or not finite.
    """
    return _ln.run(x, normalized_shape, weight, bias, eps, impl)


def mixed_fused_layer_norm(x: torch.Tensor, normalized_shape: int | Sequence[int],
                           weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                           eps: float = 1e-5, *, impl: str | None = None) -> torch.Tensor:
    """Megatron's name for :func:`layer_norm` (MixedFusedLayerNorm: parameters and input in different dtypes).
    Same arguments, result and errors."""
    return _ln.run(x, normalized_shape, weight, bias, eps, impl)


def rms_norm(x: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
             eps: float | None = None, *, cast_before_weight: bool = False, impl: str | None = None) -> torch.Tensor:
    """RMSNorm over the trailing ``normalized_shape`` dims, ``rsqrt(mean(x^2) + eps)`` in fp32 (op ``rms_norm``).

    Args:
        x: [*, *normalized_shape], fp32, fp16, bf16 (fused paths) or fp64 (the reference path).
        normalized_shape: an int or a sequence of ints, each >= 0.
        weight: [*normalized_shape] or None, fp32/fp16/bf16/fp64 independent of ``x``'s.
        eps: None -> F.rms_norm's default, ``torch.finfo`` eps of the compute dtype (fp32 for fp16/bf16/fp32
            input); LlamaRMSNorm uses 1e-6: pass it.
        cast_before_weight: False: F.rms_norm numerics (``x * rstd * weight`` in fp32, one rounding, output
            dtype ``x.dtype``). True: transformers' LlamaRMSNorm numerics (``weight * (x * rstd).to(x.dtype)``,
            output dtype ``torch.result_type`` of that product, e.g. fp32 for bf16 x with fp32 weight). For fp64
            ``x`` the statistics are fp64 here, where transformers' modules compute them in fp32 even then (results
            differ by about 1e-7 relative; ours is the more accurate).

    Returns:
        Tensor of ``x``'s shape, dtype as above. An empty ``x`` (no rows, or a 0 in ``normalized_shape``) runs the
        PyTorch reference path with source ``empty``, not a fallback (no kernel runs for it; strict mode does not
        raise): an empty result and gradients as F.rms_norm gives them.

    Kernel: pipegoose/rms_norm (pipegoose/kernels/csrc/rms_norm.cu, MIT).

    Raises:
        TypeError: ``x`` or ``weight`` not fp32/fp16/bf16/fp64 (float8 included), ``cast_before_weight`` not a
        bool, ``eps`` not a number (a Python or numpy number, or a 0-d tensor) or None.
        ValueError: shapes or devices wrong, ``eps`` negative or not finite.
    """
    return _rms.run(x, normalized_shape, weight, eps, cast_before_weight, impl)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
                   group_size: int | None = None, norm_before_gate: bool = True,
                   impl: str | None = None) -> torch.Tensor:
    """The gated RMSNorm of linear-attention and state-space layers (op ``rms_norm_gated``), over groups of
    ``group_size`` values of the last dimension D (None: the whole row), ``rstd = rsqrt(mean(v^2) + eps)`` in fp32:

    * ``norm_before_gate=True`` (Qwen3-Next's and Qwen3.5's ``RMSNormGated``): ``(weight * (x * rstd(x)).to(x.dtype)
      * silu(gate.float())).to(x.dtype)``;
    * ``norm_before_gate=False`` (Mamba2's, Bamba's, Nemotron-H's, Zamba2's, Granite-4's ``MambaRMSNormGated``):
      ``z = x.float() * silu(gate.float())``, ``weight * (z * rstd(z)).to(x.dtype)``.

    Implementations (:mod:`pipegoose.nn.fusion.ops.rms_norm_gated`): ``pipegoose``, one kernel forward and one
    backward for either order (opt-in until timed on a GPU: ``impl="pipegoose"`` or
    ``PIPEGOOSE_IMPL_RMS_NORM_GATED=pipegoose``); ``ops``, the norm before the gate over whole rows as op ``rms_norm``
    with transformers' LlamaRMSNorm numerics then op ``swiglu`` of the gate and that result (two kernels each way where
    eager PyTorch runs about ten ops with fp32 intermediates; with an fp32 weight and 16-bit x, op ``swiglu`` in fp32
    then a cast to x's dtype, as the formula casts); ``torch``, the formulas above.

    Args:
        x: [*, D], fp32, fp16, bf16 (the kernels) or fp64.
        gate: x's shape (the gate projection's output, ``z`` in transformers), of x's dtype or another (Mamba2's
            PyTorch path gives a bf16 model's norm an fp32 x and a bf16 gate: the kernel path casts a gate narrower
            than x to x's dtype, exactly; a wider one takes the reference).
        weight: [D] or None; x's dtype, or fp32 (16-bit x with an fp32 weight: the norm before the gate returns x's
            dtype, the gate first the weight's, as transformers' modules do), or 16-bit with fp32 x.
        eps: the norm's epsilon (transformers' ``variance_epsilon``; 1e-6 by default, as theirs).
        group_size: the values normalised together, a divisor of D (Mamba2's ``intermediate_size // n_groups``);
            None: D. Groups below D take the kernel or the reference (``ops`` normalises whole rows); the kernel
            takes groups of 1 to 16384 values.
        norm_before_gate: the order (above).
        impl: force an implementation (``pipegoose``, ``ops``, ``torch``), default auto.

    Returns:
        Tensor of x's shape, in x's dtype (norm before gate) or the promotion of the weight's and x's (gate first).
        On PyTorch's path (the CPU, or where the dispatcher chooses it) bit for bit transformers' modules in fp32,
        fp16 and bf16 (fp64 x: statistics in fp64). The kernel computes each value in fp32 and rounds once, where the
        modules round the normalised value to x's dtype before the weight (about one unit in the last place of x's
        dtype apart, the kernel the closer to exact); ``ops`` as :func:`rms_norm` with ``cast_before_weight=True``,
        then the gate in fp32 rounded once.

    Kernels: pipegoose/rms_norm_gated (pipegoose/kernels/csrc/rms_norm_gated.cu); ``ops``: pipegoose/rms_norm
    (rms_norm.cu) and pipegoose/swiglu (swiglu.cu); this project, MIT.

    Raises:
        TypeError: ``x`` not a tensor of at least one dimension; ``x``, ``gate`` or ``weight`` not a tensor of a
            floating dtype the ops take; ``eps`` not a number; ``group_size`` not an int; ``norm_before_gate`` not a
            bool.
        ValueError: ``gate`` of another shape or device than ``x``'s; ``weight`` not [D]; ``group_size`` not a
            divisor of D; ``eps`` negative or not finite; ``impl`` unknown.
        FusionFallbackError: in strict mode, where no fused path takes the input.
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise TypeError(f"x: expected a tensor of at least one dimension, got {type(x).__name__}"
                        + (f" of shape {list(x.shape)}" if isinstance(x, torch.Tensor) else ""))
    if not isinstance(gate, torch.Tensor):
        raise TypeError(f"gate: expected a tensor of x's shape, got {type(gate).__name__}")
    return _rmsg.run(x, gate, weight, eps, group_size, norm_before_gate, impl)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, impl: str | None = None) -> torch.Tensor:
    """SwiGLU's gated activation ``silu(gate) * up`` = ``gate * sigmoid(gate) * up``, elementwise (op ``swiglu``):
    ``F.silu(gate) * up`` in one kernel forward and one backward. In an MLP: ``down_proj(swiglu(gate_proj(x),
    up_proj(x)))``.

    Args:
        gate, up: tensors of one shape (any, e.g. [batch, seq, intermediate]) and dtype: fp32, fp16, bf16 (the
            kernel) or fp64; shapes that broadcast or differing dtypes run the PyTorch reference (a fallback with
            the reason).

    Returns:
        Tensor of ``gate``'s shape and dtype (the kernel's output is contiguous; on the reference path, shapes that
        broadcast and mixed dtypes give the broadcast shape and the promoted dtype, as ``F.silu(gate) * up``). The
        kernel computes each value in fp32 and rounds it once (eager PyTorch in 16-bit rounds ``silu(gate)`` first:
        about one unit in the last place apart, the kernel the closer to exact); gradients for ``gate`` and ``up``
        likewise. It saves ``gate`` and ``up`` for the backward, not ``silu(gate)``.

    Kernel: pipegoose/swiglu (pipegoose/kernels/csrc/swiglu.cu, this project, MIT).

    Raises:
        TypeError: ``gate`` or ``up`` not a floating point tensor of fp32/fp16/bf16/fp64.
        ValueError: ``up`` on another device than ``gate``, or of a shape that does not broadcast with it; ``impl``
            naming no implementation of ``swiglu`` (``pipegoose``, ``torch``).
        FusionFallbackError: in strict mode, where the kernel cannot take the input.
    """
    return _swiglu.run(gate, up, impl)


def silu_and_mul(x: torch.Tensor, *, impl: str | None = None) -> torch.Tensor:
    """SwiGLU's gated activation of gate and up packed in one tensor (op ``swiglu.packed``; vLLM's name):
    ``gate, up = x.chunk(2, dim=-1); F.silu(gate) * up`` in one kernel forward and one backward. In an MLP whose gate
    and up come out of one projection (Phi-3, GLM): ``down_proj(silu_and_mul(gate_up_proj(x)))``, what
    :class:`~pipegoose.nn.fusion.modules.FusedGateUpSwiGLUMLP` runs.

    Args:
        x: ``[..., 2 * d]`` (gate the first ``d`` values of each row, up the last ``d``), fp32, fp16, bf16 (the
            kernel) or fp64. The kernel reads rows at any stride (a slice of a wider tensor) where the leading
            dimensions flatten to one row stride and the last dimension is contiguous; another layout is copied first.

    Returns:
        Tensor ``[..., d]`` of ``x``'s dtype (contiguous from the kernel). Each value is computed in fp32 and rounded
        once, as :func:`swiglu`'s; the gradient of ``x`` is one contiguous tensor (eager PyTorch concatenates the
        halves' gradients). It saves ``x`` for the backward.

    Kernel: pipegoose/swiglu (pipegoose/kernels/csrc/swiglu.cu, this project, MIT).

    Raises:
        TypeError: ``x`` not a floating point tensor of fp32/fp16/bf16/fp64.
        ValueError: ``x`` of no dimension or with an odd last dimension; ``impl`` naming no implementation of
            ``swiglu.packed`` (``pipegoose``, ``torch``).
        FusionFallbackError: in strict mode, where the kernel cannot take the input.
    """
    return _swiglu.run_packed(x, impl)


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh", *, impl: str | None = None) -> torch.Tensor:
    """GeGLU's gated activation ``gelu(gate) * up``, elementwise (op ``geglu``): ``F.gelu(gate,
    approximate=approximate) * up`` in one kernel forward and one backward. In an MLP (Gemma's):
    ``down_proj(geglu(gate_proj(x), up_proj(x)))``, what :class:`~pipegoose.nn.fusion.modules.FusedGeGLUMLP` runs.

    Args:
        gate, up: as :func:`swiglu`'s: tensors of one shape (any) and dtype, fp32, fp16, bf16 (the kernel) or fp64;
            shapes that broadcast or differing dtypes run the PyTorch reference (a fallback with the reason).
        approximate: ``"tanh"`` (default: GELU's tanh approximation, transformers' ``gelu_pytorch_tanh``, which
            Gemma uses; ``gelu_new`` and ``gelu_fast`` compute it too) or ``"none"`` (exact GELU, ``0.5 * x * (1 +
            erf(x / sqrt(2)))``: transformers' ``gelu``), as ``F.gelu`` takes it.

    Returns:
        Tensor of ``gate``'s shape and dtype (the broadcast shape and promoted dtype on the reference path, as
        ``F.gelu(gate, approximate=approximate) * up``). The kernel computes each value in fp32 and rounds it once
        (eager PyTorch in 16-bit rounds ``gelu(gate)`` first: about one unit in the last place apart); gradients for
        ``gate`` and ``up`` likewise. It saves ``gate`` and ``up`` for the backward.

    Kernel: pipegoose/swiglu (``pipegoose::geglu``; pipegoose/kernels/csrc/swiglu.cu, this project, MIT).

    Raises:
        TypeError: ``gate`` or ``up`` not a floating point tensor of fp32/fp16/bf16/fp64; ``approximate`` not a str.
        ValueError: ``up`` on another device than ``gate``, or of a shape that does not broadcast with it;
            ``approximate`` neither ``"none"`` nor ``"tanh"``; ``impl`` naming no implementation of ``geglu``
            (``pipegoose``, ``torch``).
        FusionFallbackError: in strict mode, where the kernel cannot take the input.
    """
    return _swiglu.run_geglu(gate, up, approximate, impl)


def gelu(input: torch.Tensor, approximate: str = "none", *, impl: str | None = None) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.gelu(input, approximate=approximate)`` (op ``gelu``; the same arguments):
    GELU alone, the activation of the MLPs without a gate (``fc2(gelu(fc1(x)))``: GPT-2's, GPT-J's, Phi's,
    CodeGen's ``gelu_new`` and Bloom's ``BloomGelu``, which transformers compute as several elementwise ops, forward
    and backward; ``fuse`` puts :class:`~pipegoose.nn.fusion.modules.FusedGELU` in their place).

    Args:
        input: a tensor of any shape (non-contiguous ones are copied first), fp32, fp16, bf16 (the kernel) or fp64.
        approximate: ``"none"`` (default, exact GELU ``0.5 * x * (1 + erf(x / sqrt(2)))``: transformers' ``gelu``)
            or ``"tanh"`` (the tanh approximation: ``gelu_new``, ``gelu_fast``, ``gelu_pytorch_tanh``), as
            ``F.gelu`` takes it.

    Returns:
        Tensor of ``input``'s shape and dtype (contiguous from the kernel). The kernel computes each value in fp32 and
        rounds it once, as ``F.gelu`` does (agreeing to about one unit in the last place; below about -3 the
        kernel's form keeps the relative accuracy that ``0.5 * x * (1 + tanh(...))`` loses); the gradient likewise.
        It saves ``input`` for the backward, as ``F.gelu`` does (transformers' ``gelu_new`` saves four tensors of
        its size).

    Kernel: pipegoose/swiglu (``pipegoose::gelu``; pipegoose/kernels/csrc/swiglu.cu, this project, MIT).

    Raises:
        TypeError: ``input`` not a floating point tensor of fp32/fp16/bf16/fp64; ``approximate`` not a str.
        ValueError: ``approximate`` neither ``"none"`` nor ``"tanh"``; ``impl`` naming no implementation of
            ``gelu`` (``pipegoose``, ``torch``).
        FusionFallbackError: in strict mode, where the kernel cannot take the input.
    """
    return _swiglu.run_gelu(input, approximate, impl)


def squared_relu(input: torch.Tensor, *, impl: str | None = None) -> torch.Tensor:
    """Primer's squared ReLU ``torch.square(F.relu(input))`` in one kernel forward and one backward (op
    ``squared_relu``): transformers' ``relu2`` (``ReLUSquaredActivation``), the activation of the MLPs without a gate
    of Nemotron, Nemotron-H, Persimmon, Arcee, Jais2 and NanoChat, which it runs as two kernels forward and three
    backward (``fuse`` puts :class:`~pipegoose.nn.fusion.modules.FusedSquaredReLU` in its place).

    Args:
        input: a tensor of any shape (non-contiguous ones are copied first), fp32, fp16, bf16 (the kernel) or fp64.

    Returns:
        Tensor of ``input``'s shape and dtype (contiguous from the kernel), the same values as
        ``torch.square(F.relu(input))`` bit for bit (each the product of two values of the dtype, computed in fp32
        and rounded once, as PyTorch's); NaN stays NaN (``F.relu``'s). The gradient ``2 * relu(input) *
        grad_output`` likewise, 0 where ``input <= 0`` (also for an infinite ``grad_output``, as PyTorch's), but for
        fp16 inputs past 32752 (where the output is inf already), for which PyTorch rounds ``2 * input`` to inf
        first and the kernel does not. It saves ``input`` for the backward (PyTorch saves ``relu(input)``, of the
        same size).

    Kernel: pipegoose/swiglu (``pipegoose::squared_relu``; pipegoose/kernels/csrc/swiglu.cu, this project, MIT).

    Raises:
        TypeError: ``input`` not a floating point tensor of fp32/fp16/bf16/fp64.
        ValueError: ``impl`` naming no implementation of ``squared_relu`` (``pipegoose``, ``torch``).
        FusionFallbackError: in strict mode, where the kernel cannot take the input.
    """
    return _swiglu.run_squared_relu(input, impl)


def gelu_and_mul(x: torch.Tensor, approximate: str = "tanh", *, impl: str | None = None) -> torch.Tensor:
    """GeGLU's gated activation of gate and up packed in one tensor (op ``geglu.packed``; vLLM's ``gelu_and_mul`` and
    ``gelu_tanh_and_mul``): ``gate, up = x.chunk(2, dim=-1); F.gelu(gate, approximate=approximate) * up`` in one
    kernel forward and one backward. ``fuse`` sets it as the gate of Gemma 4's MoE experts, whose ``gate_up_proj``
    puts gate and up in one output.

    Args:
        x: ``[..., 2 * d]`` (gate the first ``d`` values of each row, up the last ``d``), fp32, fp16, bf16 (the
            kernel) or fp64, at any row stride as :func:`silu_and_mul`'s.
        approximate: ``"tanh"`` (default, transformers' ``gelu_pytorch_tanh``) or ``"none"`` (exact, erf GELU), as
            :func:`geglu`'s.

    Returns:
        Tensor ``[..., d]`` of ``x``'s dtype (contiguous from the kernel). Each value is computed in fp32 and rounded
        once, as :func:`geglu`'s; the gradient of ``x`` is one contiguous tensor. It saves ``x`` for the backward.

    Kernel: pipegoose/swiglu (``pipegoose::gelu_and_mul``; pipegoose/kernels/csrc/swiglu.cu, this project, MIT).

    Raises:
        TypeError: ``x`` not a floating point tensor of fp32/fp16/bf16/fp64; ``approximate`` not a str.
        ValueError: ``x`` of no dimension or with an odd last dimension; ``approximate`` neither ``"none"`` nor
            ``"tanh"``; ``impl`` naming no implementation of ``geglu.packed`` (``pipegoose``, ``torch``).
        FusionFallbackError: in strict mode, where the kernel cannot take the input.
    """
    return _swiglu.run_geglu_packed(x, approximate, impl)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100, reduction: str = "mean",
                  impl: str | None = None) -> torch.Tensor:
    """Softmax cross-entropy, ``F.cross_entropy(logits.float(), target, ignore_index=..., reduction=...)`` (fp64
    logits: as they are) (op ``cross_entropy``): the loss transformers computes for causal and masked language models,
    without the fp32 copy of the logits.

    Args:
        logits: [N, V] class scores, fp32/fp16/bf16 (the kernel; last dim contiguous, rows at any stride) or fp64;
            other shapes ``F.cross_entropy`` takes run the reference path (a fallback with the reason).
        target: [N] int64 class indices in [0, V), or ``ignore_index`` (those rows add nothing and are not counted by
            the mean). A target outside [0, V) that is not ``ignore_index`` gives a NaN loss on the kernel path
            (PyTorch's path raises an IndexError on CPU and stops with a device-side assert on CUDA).
        ignore_index: the target value to skip (a Python or numpy integer).
        reduction: ``mean`` (over the rows not ignored; NaN when every row is ignored, as PyTorch's), ``sum`` or
            ``none`` (fp32 [N], 0 for ignored rows).

    Returns:
        The loss in fp32 (fp64 for fp64 logits); the gradient of the logits is in their dtype, computed in fp32 and
        rounded once. Double backward (``create_graph=True``): PyTorch's formula on the saved logits, as the module
        says.

    Kernel: pipegoose/cross_entropy (pipegoose/kernels/csrc/cross_entropy.cu, this project, MIT).

    Raises:
        TypeError: ``logits`` not a floating point tensor of fp32/fp16/bf16/fp64 (float8 included), ``target`` not a
            tensor, ``ignore_index`` not an integer.
        ValueError: ``reduction`` not one of ``mean``, ``sum``, ``none``; ``target`` on another device; ``impl``
            naming no implementation of ``cross_entropy`` (``pipegoose``, ``torch``).
        RuntimeError: (PyTorch's path) ``target`` not int64 class indices of the logits' rows, e.g. int32 (the
            kernel declines such a target, and PyTorch's ``F.cross_entropy`` says what it expects).
        FusionFallbackError: in strict mode, where the kernel cannot take the input.
    """
    return _ce.run(logits, target, ignore_index, reduction, impl)


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               bias: torch.Tensor | None = None, *, ignore_index: int = -100, reduction: str = "mean",
                               chunk_rows: int | None = None, impl: str | None = None) -> torch.Tensor:
    """A language model's output projection and its softmax cross-entropy in one,
    ``F.cross_entropy(F.linear(hidden, weight, bias).float(), target, ignore_index=..., reduction=...)`` (op
    ``fused_linear_cross_entropy``), computed chunk by chunk over the rows so that the [N, V] logits and their
    gradient never exist whole: a chunk's logits (a GEMM in the weight's dtype), its loss and the logits' gradient
    (the cross-entropy kernel), then the chunk's gradients of ``hidden`` and ``weight`` (GEMMs), all in the forward;
    the backward scales them by the loss's upstream gradient. No logits are returned.

    Args:
        hidden: [..., H] hidden states (the last layer's output, before ``lm_head``), fp32/fp16/bf16 (the fused path)
            or fp64 (the reference path); flattened to [N, H].
        weight: [V, H], ``lm_head.weight`` (tied or not), the dtype of ``hidden`` on the fused path (under autocast
            both are cast to autocast's dtype first, as ``F.linear`` casts them).
        target: N int64 class indices of any shape (flattened), or ``ignore_index``; already shifted for a causal LM.
            A target outside [0, V) that is not ``ignore_index`` gives a NaN loss on the fused path.
        bias: [V] or None.
        ignore_index: the target value to skip (a Python or numpy integer).
        reduction: ``mean`` (over the rows not ignored; NaN when every row is ignored, as PyTorch's) or ``sum``.
        chunk_rows: rows per chunk (a positive int); None: the largest power of two whose logits hold at most 2**27
            values, at least 2048 and at most N (4096 rows at V 32000, 2048 at V 128256;
            :func:`~pipegoose.nn.fusion.ops.linear_cross_entropy.default_chunk_rows`, measured there). Peak memory
            beyond the inputs: the gradients of ``hidden`` and ``weight`` (kept from the forward) and, while the
            forward runs, one chunk's logits ([chunk_rows, V]; their gradient is written over them). In 16-bit,
            each chunk adds a rounding to the weight's gradient (see Returns), so many small chunks trade precision
            for memory: bf16 with ``chunk_rows=1`` over 969 rows put 19% of the weight's gradient outside bf16's
            test tolerance of the float64 result (GPU fuzz test, ``tests/kernels/test_fuzz_cuda.py``).

    Returns:
        The fp32 scalar loss (fp64 for fp64 inputs, on the reference path). Gradients: ``hidden``'s and ``weight``'s in
        their dtype, ``bias``'s accumulated in fp32 and rounded once; the weight's gradient is accumulated over the
        chunks in its dtype (one rounding per chunk, where the unfused ``F.linear`` rounds once). On the fused path,
        not twice differentiable (a backward with ``create_graph=True`` raises RuntimeError; ``impl="torch"`` is),
        and one backward per forward: the backward scales the gradients computed in the forward in place and hands
        them to autograd (no second copy of the [V, H] weight gradient), so a second backward through a graph kept
        with ``retain_graph=True`` raises RuntimeError. The logits' gradient is rounded before the upstream gradient
        is known, so a loss scaler's factor does not reach it; in fp16 the mean's is computed at the sum's scale and
        divided in the backward, so fp16 with a GradScaler keeps the unfused path's precision.

    Kernel: pipegoose/cross_entropy (pipegoose/kernels/csrc/cross_entropy.cu, this project, MIT), per chunk, between
    cuBLAS GEMMs (``torch.mm``). GPU tests: tests/kernels/test_linear_cross_entropy_cuda.py. On the H200, bf16, 8192
    rows (session 52): 4.83 ms forward + backward for Llama-1.1B's head (``torch.compile`` of the unfused expression
    4.83, Liger-Kernel's fused loss 6.55, transformers' expression 7.28), 407 MiB beyond the inputs (compile 657,
    Liger 188, transformers 3000); Llama-3-8B's 41.3 ms, 1567 MiB (compile 39.5 / 3070, Liger 55.6 / 1129);
    benchmarks/results/nvidia_h200_2026-11-30/linear_cross_entropy.md.

    Raises:
        TypeError: ``hidden``, ``weight`` or ``bias`` not a floating point tensor of fp32/fp16/bf16/fp64; ``target``
            not a tensor; ``ignore_index`` or ``chunk_rows`` not an integer.
        ValueError: ``reduction`` not ``mean`` or ``sum``; ``weight`` not [V, H]; ``bias`` not [V]; ``target`` not one
            index per row of ``hidden``; a tensor on another device; ``chunk_rows`` below 1; ``impl`` naming no
            implementation of ``fused_linear_cross_entropy`` (``pipegoose``, ``torch``).
        RuntimeError: (PyTorch's path) dtypes ``F.linear`` or ``F.cross_entropy`` refuse (``weight`` of another dtype
            than ``hidden`` without autocast, ``target`` not int64).
        FusionFallbackError: in strict mode, where the fused path cannot take the input.
    """
    return _flce.run(hidden, weight, target, bias, ignore_index, reduction, chunk_rows, impl)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         unsqueeze_dim: int = 1, *, interleaved: bool = False,
                         impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of the query and key (op ``rope``): drop-in for transformers'
    ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` of Llama, Mistral, Qwen2/Qwen3, GPT-NeoX and their
    copies: ``q * cos + rotate_half(q) * sin`` and the same for ``k``, with
    ``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])`` and ``cos``, ``sin`` unsqueezed at ``unsqueeze_dim`` to
    broadcast over the heads. Both in one kernel forward and one backward. Tables of R values a head, 1 < R < D
    (partial rotary), rotate ``x[..., :R]`` and pass the rest through, as GPT-NeoX's function does (Llama's raises
    for them); the kernel takes even R. Tables of one value a head (R = 1) broadcast over it, as in Llama's function
    (GPT-NeoX's would rotate ``x[..., :1]`` alone).

    Args:
        q: [B, Hq, S, D] (``unsqueeze_dim=1``) or [B, S, Hq, D] (``unsqueeze_dim=2``), fp32/fp16/bf16 (the kernel;
            any strides, e.g. the transposed view of a projection) or fp64.
        k: the same layout with Hk heads (Hk may differ from Hq: grouped-query attention).
        cos, sin: [B or 1, S, D] (or [B or 1, S, R], partial rotary), q's dtype, or fp32 with 16-bit q and k
            (autocast; the results are then fp32, as PyTorch's promotion makes them): the rotation's tables
            (``LlamaRotaryEmbedding``'s output).
        unsqueeze_dim: where cos and sin get the heads' dimension, as in transformers (1 or 2 on the kernel).
        interleaved: (default False) the rotation of neighbouring pairs, GPT-J's, Cohere's and GLM's
            ``rotate_half(x) = stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)``, with the tables as given
            (Cohere's ``[B, S, D]`` tables repeat each frequency twice; GLM's function interleaves its own tables
            before the call, which the caller then does); partial rotary (GLM's) as above, in pairs.

    Returns:
        ``(q_embed, k_embed)``: on the kernel path of q's and k's shapes and dtype (fp32 with fp32 tables and 16-bit
        q and k); on PyTorch's path the shapes and dtypes its broadcasting and type promotion give, as transformers'
        function (e.g. bf16 q with fp32 k: an fp32 ``q_embed``). On the kernel path each has its input's strides where
        the input is dense (as eager PyTorch's product), else dense strides in its order of dimensions
        (``torch.empty_like``), partial rotary too (GPT-NeoX's ``torch.cat`` gives contiguous results; the chunks of
        its fused projection are not dense, so ours are laid out [B, S, H, D] in memory). The kernel computes each
        value in fp32 and rounds it once (eager PyTorch in 16-bit rounds three times: about one unit in the last
        place apart, the kernel the closer to exact); gradients for ``q`` and ``k`` likewise. It saves only ``cos``
        and ``sin``. Other inputs run the PyTorch reference (a fallback with the reason): dtypes that differ, a cos
        or sin that requires grad (the kernel gives them none), odd D or R, other ranks. Partial rotary on the
        kernel: one launch each way, the first R values of each head rotated and the rest copied.

    Kernel: pipegoose/rope (pipegoose/kernels/csrc/rope.cu, this project, MIT).

    Raises:
        TypeError: a tensor argument not a floating point tensor of fp32/fp16/bf16/fp64; ``unsqueeze_dim`` not an int;
            ``interleaved`` not a bool.
        ValueError: a tensor on another device than ``q``; ``impl`` naming no implementation of ``rope``
            (``pipegoose``, ``torch``).
        RuntimeError: (PyTorch's path) shapes that do not broadcast (PyTorch's message, which names no argument).
        IndexError: (PyTorch's path) ``unsqueeze_dim`` out of cos's range, or a 0-d cos or sin.
        FusionFallbackError: in strict mode, where the kernel cannot take the input.
    """
    return _rope.run(q, k, cos, sin, unsqueeze_dim, impl, interleaved)
