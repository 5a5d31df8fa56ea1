"""Modules over the fused ops: Megatron's ``FusedScaleMaskSoftmax``, Apex/Megatron's ``MixedFusedLayerNorm`` /
``FusedLayerNorm`` (drop-ins for ``torch.nn.LayerNorm``), ``FusedRMSNorm`` (drop-in for ``torch.nn.RMSNorm``
and transformers' Llama-style RMSNorm), ``FusedSwiGLUMLP`` (for transformers' Llama-style MLP),
``FusedGateUpSwiGLUMLP`` (for Phi-3's and GLM's MLP: gate and up in one ``gate_up_proj``), ``FusedGeGLUMLP`` (for
Gemma's MLP: GELU instead of SiLU), ``FusedT5DenseGatedActDense`` (for T5 v1.1's gated MLP: Flan-T5, mT5, UMT5) and
``FusedLinearCrossEntropyLoss`` (a language model's output projection and loss in one). Kernel sources: see
:mod:`pipegoose.nn.fusion.functional`."""

from __future__ import annotations

import enum
import functools
import math
import numbers
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import dispatch
from . import functional as PF
from .ops import softmax as _sm
from .ops import swiglu as _swiglu
from .ops import _common
from .ops._common import megatron_batches_per_block
from .ops.layer_norm import normalize_shape

__all__ = ["AttnMaskType", "FusedScaleMaskSoftmax", "MixedFusedLayerNorm", "FusedLayerNorm", "FusedRMSNorm",
           "FusedRMSNormGated",
           "FusedSwiGLUMLP", "FusedGateUpSwiGLUMLP", "FusedGeGLUMLP", "FusedT5DenseGatedActDense",
           "FusedGELU", "FusedSquaredReLU", "FusedModernBertMLP", "FusedGraniteMLP", "FusedLfm2MLP",
           "FusedLinearCrossEntropyLoss"]


class AttnMaskType(enum.Enum):
    """Megatron's attention mask types: ``padding`` (a boolean mask) and ``causal`` (upper triangle masked)."""

    padding = 1
    causal = 2


class FusedScaleMaskSoftmax(nn.Module):
    """Megatron-LM's fused ``scale -> mask -> softmax`` over attention scores, with its constructor and methods.

    Args:
        input_in_fp16, input_in_bf16: the scores' dtype (at most one True).
        attn_mask_type: :class:`AttnMaskType` ``padding`` or ``causal``.
        scaled_masked_softmax_fusion: allow the fused kernels.
        mask_func: ``mask_func(scores, mask) -> scores`` for the PyTorch path (Megatron fills -10000); None =
            fill with ``-inf``. Either way a row whose keys are all masked gives zeros.
        softmax_in_fp32: with a 16-bit flag, the PyTorch path computes in fp32 (else in the scores' dtype); ``scale``
            needs it, as in Megatron.
        scale: multiplier of the scores, or None (1.0); needs ``softmax_in_fp32`` (as in Megatron). A constant: a
            tensor that requires grad is refused (the functional ``scaled_masked_softmax`` passes a gradient to one).

    ``forward(input [b, np, sq, sk], mask [b or 1, np or 1, sq or 1, sk] bool (uint8: nonzero = masked) or None)``
    returns probabilities in the input's dtype, under CUDA autocast too: the fused kernels then run on the 16-bit
    scores as given (as Megatron's do). The PyTorch path computes in fp32 when a 16-bit flag and ``softmax_in_fp32``
    are set, else in the input's dtype. Scores that are not 16-bit although a flag says so take the PyTorch path,
    counted as a fallback (strict mode raises on it). ``causal`` masks key ``j > i + sk - sq`` (plus ``mask`` if
    given). Fused kernels (through :mod:`~pipegoose.nn.fusion.dispatch`): pipegoose/softmax (MIT; this repository's
    pipegoose/kernels/csrc/softmax.cuh), Megatron-LM's scaled_masked_softmax / scaled_upper_triang_masked_softmax
    (megatron/fused_kernels/ at commit 040eac94) via ColossalAI 0.5.0 extensions/csrc/kernel/cuda/
    scaled_masked_softmax_kernel.cu and scaled_upper_triang_masked_softmax_kernel.cu (Apache-2.0).

    Raises:
        TypeError: a flag that is not a bool, a ``mask_func`` that is not callable (or None), an ``attn_mask_type``
            that is not an :class:`AttnMaskType`, a ``scale`` that is not a number or is a tensor that requires grad.
        ValueError: both fp16 and bf16 flags, or ``scale`` without ``softmax_in_fp32``, or a non-4-D input.
    """

    def __init__(self, input_in_fp16: bool, input_in_bf16: bool, attn_mask_type: AttnMaskType,
                 scaled_masked_softmax_fusion: bool, mask_func: Callable | None, softmax_in_fp32: bool,
                 scale: float | None) -> None:
        super().__init__()
        for name, flag in (("input_in_fp16", input_in_fp16), ("input_in_bf16", input_in_bf16),
                           ("scaled_masked_softmax_fusion", scaled_masked_softmax_fusion),
                           ("softmax_in_fp32", softmax_in_fp32)):
            if not (isinstance(flag, bool) or getattr(getattr(flag, "dtype", None), "kind", None) == "b"):
                raise TypeError(f"{name}: expected a bool, got {flag!r} ({type(flag).__name__})")
        if mask_func is not None and not callable(mask_func):
            raise TypeError(f"mask_func: expected a callable mask_func(scores, mask) or None, got {mask_func!r} "
                            f"({type(mask_func).__name__})")
        if input_in_fp16 and input_in_bf16:
            raise ValueError("input_in_fp16, input_in_bf16: both fp16 and bf16 flags cannot be active at the same time")
        if not isinstance(attn_mask_type, AttnMaskType):
            raise TypeError(f"attn_mask_type: expected AttnMaskType, got {attn_mask_type!r}")
        if scale is not None and not softmax_in_fp32:
            raise ValueError("scale: softmax should be in fp32 when scaled (softmax_in_fp32=True)")
        self.input_in_fp16 = input_in_fp16
        self.input_in_bf16 = input_in_bf16
        self.input_in_float16 = input_in_fp16 or input_in_bf16
        self.attn_mask_type = attn_mask_type
        self.scaled_masked_softmax_fusion = scaled_masked_softmax_fusion
        self.mask_func = mask_func
        self.softmax_in_fp32 = softmax_in_fp32
        if isinstance(scale, torch.Tensor) and scale.requires_grad:   # (it was taken as a float, its gradient lost)
            raise TypeError("scale: a tensor that requires grad; FusedScaleMaskSoftmax takes a constant scale, as "
                            "Megatron's does (pipegoose.nn.fusion.scaled_masked_softmax(x, mask, scale) passes the "
                            "gradient to a learnable one; scale.detach() takes its value)")
        self.scale = None if scale is None else _sm.check_scale(scale)

    def forward(self, input: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        _sm.check_input(input, "input")
        if input.dim() != 4:
            raise ValueError(f"input: expected [b, np, sq, sk], got shape {list(input.shape)}")
        if (self.scaled_masked_softmax_fusion and self.input_in_float16
                and not dispatch.compile_passthrough(self._fused_op(mask))):
            if input.dtype not in _HALF:  # fusion asked for, but the scores are not the 16-bit dtype the flags say
                flag = "input_in_fp16" if self.input_in_fp16 else "input_in_bf16"
                dispatch.record(dispatch.Choice(
                    self._fused_op(mask), "torch", "fallback", True, {},
                    f"input: {_common.dtype_name(input.dtype)} scores with {flag}=True; the fused kernels take the "
                    f"16-bit scores the flags declare (the PyTorch path)"))
                return self.forward_torch_softmax(input, mask)
            if mask is not None:
                mask = _sm.check_mask(mask, input)
            choice = self._choice(input, mask)
            # counted either way; a fallback (fusion asked for, no fused path takes the input) raises in strict mode
            dispatch.record(choice)
            if choice.impl != "torch":
                return self._run_fused(choice.impl, input, mask)
        return self.forward_torch_softmax(input, mask)

    def _run_fused(self, impl: str, input: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The chosen fused implementation on the 16-bit scores as given, without choosing again (the functional
        op would, at a few microseconds of host time) and outside autocast, as Megatron's kernels run: under CUDA
        autocast the functional op computes softmax in fp32 (F.softmax's rule), which cost a cast of the scores and of
        the probabilities around an fp32 kernel; the probabilities are the input's dtype either way."""
        scale = self.scale if self.scale is not None else 1.0
        if self.attn_mask_type == AttnMaskType.causal:
            b, np, sq, sk = input.shape
            probs = _common.call_without_autocast(input.device, _sm._run_choice, impl,
                                                  input.reshape(b * np, sq, sk), None, scale, True)
            return probs.view(b, np, sq, sk)
        return _common.call_without_autocast(input.device, _sm._run_choice, impl, input, mask, scale, False)

    def _fused_op(self, mask: torch.Tensor | None) -> str:
        if self.attn_mask_type == AttnMaskType.causal:
            return _sm.OP_CAUSAL
        return _sm.OP_MASKED if mask is not None else _sm.OP_PLAIN

    def is_kernel_available(self, mask: torch.Tensor | None, b: int, np: int, sq: int, sk: int,
                            _input: torch.Tensor | None = None) -> bool:
        """Whether a fused implementation will take these sizes: fusion enabled, fp16/bf16 input, and the
        dispatcher finds a fused (non-torch) implementation that supports them on the current CUDA device."""
        if not (self.scaled_masked_softmax_fusion and self.input_in_float16):
            return False
        if _input is not None:
            x = _input
        else:
            if not torch.cuda.is_available():
                return False
            x = torch.empty((b, np, sq, sk), dtype=torch.float16 if self.input_in_fp16 else torch.bfloat16,
                            device="cuda")
        if x.dtype not in (torch.float16, torch.bfloat16):
            return False
        return self._choice(x, mask).impl != "torch"

    def _choice(self, x: torch.Tensor, mask: torch.Tensor | None) -> dispatch.Choice:
        """The dispatcher's choice for scores ``x`` (fp16/bf16, [b, np, sq, sk]) and ``mask``, cached as the functional
        ops cache theirs (a call costs a dictionary lookup once its metadata was seen)."""
        op = self._fused_op(mask)
        if op == _sm.OP_CAUSAL and mask is not None:
            return dispatch.Choice(op, "torch", "fallback", True, {}, "causal with a padding mask: no fused kernel "
                                   "takes both (the PyTorch path)")
        scale = self.scale if self.scale is not None else 1.0
        sig = _sm._signature(x, mask, "FusedScaleMaskSoftmax", scale)
        key = None if sig is None else dispatch.choice_key(op, None, sig)
        hit = None if key is None else dispatch.cached_choice(key)
        if hit is None:
            if op == _sm.OP_CAUSAL:
                problem = _sm.softmax_problem(op, x.reshape(x.shape[0] * x.shape[1], x.shape[2], x.shape[3]), None,
                                              scale)
            else:
                problem = _sm.softmax_problem(op, x, mask, scale)
            hit = dispatch.choose(op, problem)
            if key is not None:
                dispatch.remember_choice(key, hit)
        return hit

    def forward_fused_softmax(self, input: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Megatron's method: the dispatcher's choice for these scores, run as :meth:`forward` runs it (counted; the
        reference path, as a fallback, where no fused implementation takes them)."""
        if mask is not None:
            mask = _sm.check_mask(mask, input)
        choice = self._choice(input, mask)
        dispatch.record(choice)
        if choice.impl == "torch":
            # the reference path as forward runs it: both masks, mask_func, softmax_in_fp32 (the causal op's run
            # dropped a padding mask: no fused kernel takes both, and the causal call passes none; a review)
            return self.forward_torch_softmax(input, mask)
        return self._run_fused(choice.impl, input, mask)

    def forward_torch_softmax(self, input: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = input.float() if (self.input_in_float16 and self.softmax_in_fp32) else input
        if self.scale is not None:
            x = x * self.scale
        masked = None
        if mask is not None:
            masked = _sm.check_mask(mask, input)
        if self.attn_mask_type == AttnMaskType.causal:
            cm = _sm.causal_mask(input.shape[-2], input.shape[-1], input.device)
            masked = cm if masked is None else (masked | cm)
        if masked is not None:
            if self.mask_func is not None:
                x = self.mask_func(x, masked)
            else:
                x = x.masked_fill(masked, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if masked is not None:
            probs = probs.masked_fill(masked.all(dim=-1, keepdim=True), 0.0)
        return probs.to(input.dtype)

    @staticmethod
    def get_batch_per_block(sq: int, sk: int, b: int, np: int) -> int:
        """Rows per CUDA block of the Megatron kernels (their ``get_batch_per_block``; depends on ``sk`` only)."""
        return megatron_batches_per_block(sk)


# Set by fuse() on a replacement: the module it replaced, which unfuse() puts back. Held by the replacement (so it lives
# as long as the model does) and left out when the replacement is pickled or copied (a copy has no record to unfuse).
ORIGINAL_ATTR = "_pipegoose_original"


class _DropsFuseRecord:
    """The fused norms' ``__getstate__`` (pickling, ``copy.deepcopy``): without :data:`ORIGINAL_ATTR`."""

    def __getstate__(self):
        state = super().__getstate__()
        state.pop(ORIGINAL_ATTR, None)
        return state


_SMALL_CHOICE = {op: dispatch.Choice(op, "torch", "small", False, {}, f"input below PIPEGOOSE_SMALL_NUMEL elements: "
                                     f"the native op (module fast path)") for op in ("layer_norm", "rms_norm")}


_HALF = (torch.float16, torch.bfloat16)
_AUTOCAST_CASTS = (torch.float32, torch.float16, torch.bfloat16)   # (autocast's cast leaves float64 alone)


def _small_native(op: str, impl: str | None, input: Any, shape: tuple[int, ...], eps: Any) -> bool:
    """Whether the dispatcher's small-problem rule would choose the native op for this module call and nothing
    overrides it: a CUDA tensor in a dtype our kernels take (so that the choice is the rule's, not a fallback that
    strict mode must see), rows our kernel takes (its hidden size limits), fewer than ``PIPEGOOSE_SMALL_NUMEL`` elements
    but not none (an empty input is the
    dispatcher's, which counts it as ``empty``), trailing dims ``shape``, a finite float
    ``eps`` >= 0 or None (anything else goes to the dispatcher, whose checks name the argument), no ``impl`` and no
    ``PIPEGOOSE_IMPL_*`` variable, not while ``torch.compile`` traces. The module then calls the native op, as the
    unfused module does."""
    # cheapest tests first: this runs on every call of every fused norm of a host-bound model
    n = len(shape)
    # not while torch.compile traces: record() takes the dispatcher's lock, a graph break at every norm; the op entry
    # points emit the reference op there (dispatch.compile_passthrough), one graph
    return (impl is None and isinstance(input, torch.Tensor) and _common.on_kernel_device(input)
            and not torch.compiler.is_compiling()
            and input.dim() >= n and input.shape[-n:] == shape and _in_kernel_range(op, shape)
            and (eps is None or (type(eps) is float and 0.0 <= eps < math.inf))
            and 0 < input.numel() < dispatch.small_numel() and dispatch._env_request(op)[0] is None)


@functools.cache
def _kernel_range(op: str) -> tuple[int, int]:
    return _common.hidden_range(f"pipegoose/{op}")


def _in_kernel_range(op: str, shape: tuple[int, ...]) -> bool:
    """Whether our kernel takes rows of ``shape`` (its ``hidden_min`` / ``hidden_max`` in kernels.yaml): the
    small-problem rule applies only where a fused implementation could run (else the native op is a fallback, which
    strict mode and the counters must see)."""
    lo, hi = _kernel_range(op)
    return lo <= (shape[0] if len(shape) == 1 else math.prod(shape)) <= hi


def _as_input_error(e: Exception) -> Exception:
    """An error of the functional op about its ``x``, renamed for the module's argument ``input`` (as
    ``torch.nn.LayerNorm.forward(input)``); other errors as they are."""
    msg = str(e)
    return type(e)("input" + msg[1:].replace("e.g. x.to(", "e.g. input.to(")) if msg.startswith("x:") else e


def _last_dim(input: Any) -> tuple[int]:
    """The normalized shape of a norm over the last dimension of ``input`` (a FusedRMSNorm built without one):
    ``(input.shape[-1],)``. TypeError where ``input`` is not a tensor, ValueError where it is 0-d."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input: expected a torch.Tensor, got {type(input).__name__}")
    if input.dim() < 1:
        raise ValueError("input: expected a tensor of at least 1 dimension (a norm without normalized_shape "
                         "normalizes the last one), got a 0-d tensor")
    return (input.shape[-1],)


def _ln_shape(normalized_shape: Any, name: str = "normalized_shape") -> tuple[int, ...]:
    """A module's normalized shape as a tuple of ints: an integer of any kind (a numpy one too, as torch.nn.LayerNorm
    takes) or a sequence of them, each >= 0, as the functional ops check it (a bool is not a size). TypeError or
    ValueError naming ``name``."""
    try:
        return normalize_shape(normalized_shape)
    except (TypeError, ValueError) as e:
        if name == "normalized_shape":
            raise
        raise type(e)(str(e).replace("normalized_shape", name, 1)) from None


def _check_module_args(op: str, eps: Any, impl: Any, allow_none_eps: bool = False) -> None:
    """What the op checks at every call, checked once when a module is built: ``eps`` (a number >= 0 and finite, as
    the functional ops take it), ``impl`` (None, ``auto`` or an implementation of ``op``)."""
    _common.eps_value(eps, allow_none=allow_none_eps)
    dispatch.check_impl(op, impl)


class FusedLayerNorm(_DropsFuseRecord, nn.LayerNorm):
    """Drop-in for ``torch.nn.LayerNorm`` (same constructor, parameters ``weight``/``bias``, state_dict keys)
    running :func:`pipegoose.nn.fusion.functional.layer_norm`: statistics in fp32, parameters may have another
    dtype than the input (e.g. fp32 weights with bf16 activations), output dtype as ``nn.LayerNorm``'s.

    Args: as ``torch.nn.LayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None,
    dtype=None)``; ``impl``: force an implementation (``pipegoose``, ``apex``, ``torch``), default auto;
    ``output_in_input_dtype`` (default False): the output in the input's dtype, under CUDA autocast too, where
    ``torch.nn.LayerNorm``'s is fp32 (OLMo's ``OlmoLayerNorm``, which normalizes in fp32 and casts back).
    ``apply_layernorm_1p`` (default False; Megatron-LM's name): the norm's scale is ``weight + 1`` (the weight starts
    at zeros), the sum computed in the weight's dtype at each forward, and where CUDA autocast is on, the input, that
    scale and the bias cast to the autocast dtype first (autocast's own cast), the norm run with autocast off
    (Nemotron's ``NemotronLayerNorm1P``, exactly); needs a weight (``elementwise_affine``) and
    ``output_in_input_dtype=False``.
    ``normalized_shape``: an integer or a sequence of integers, each >= 0 (stored as a tuple of ints; a 0, as
    ``nn.LayerNorm`` takes it, gives empty outputs). ``eps``: what :func:`~pipegoose.nn.fusion.functional.layer_norm`
    takes (a bool, int, float, numpy scalar or 0-d tensor, finite and >= 0).

    Raises (when constructed, not at the first forward):
        TypeError: ``normalized_shape`` not an integer or a sequence of them, ``eps`` not a number, ``impl`` not a
            str or None, ``output_in_input_dtype`` or ``apply_layernorm_1p`` not a bool.
        ValueError: a negative size or no dimension, ``eps`` negative or not finite, ``impl`` naming no
            implementation of ``layer_norm`` (names are read in any case, as ``PIPEGOOSE_IMPL_*`` values are);
            ``apply_layernorm_1p`` without a weight or with ``output_in_input_dtype``.

    ``forward(input [..., *normalized_shape])`` returns a tensor of the input's shape.

    Kernels: pipegoose/layer_norm (MIT; this repository's pipegoose/kernels/csrc/layer_norm.cu and norm_kernels.cuh);
    Apex's fused LayerNorm (csrc/layer_norm_cuda_kernel.cu) via ColossalAI 0.5.0
    extensions/csrc/kernel/cuda/layer_norm_kernel.cu (Apache-2.0).
    """

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None, *, impl: str | None = None,
                 output_in_input_dtype: bool = False, apply_layernorm_1p: bool = False) -> None:
        shape = _ln_shape(normalized_shape)
        _check_module_args("layer_norm", eps, impl)
        if not isinstance(output_in_input_dtype, bool):
            raise TypeError(f"output_in_input_dtype: expected a bool, got {type(output_in_input_dtype).__name__}")
        _check_1p(apply_layernorm_1p, elementwise_affine, output_in_input_dtype)
        super().__init__(shape, eps=eps, elementwise_affine=elementwise_affine, bias=bias,
                         device=device, dtype=dtype)
        self.impl = impl
        self.output_in_input_dtype = output_in_input_dtype
        if apply_layernorm_1p:
            self.__dict__["apply_layernorm_1p"] = True
            nn.init.zeros_(self.weight)   # the identity scale: weight + 1 = 1

    @property
    def variance_epsilon(self) -> float:
        """``eps`` under transformers' name for it, read and written (Cohere's LayerNorm's ``variance_epsilon``, set by
        model code on a fused one, would otherwise be an attribute that nothing reads: a review; as
        :class:`FusedRMSNorm`'s)."""
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value: float) -> None:
        _common.eps_value(value, name="variance_epsilon")
        self.eps = value

    @property
    def output_in_input_dtype(self) -> bool:
        """The output in the input's dtype, under CUDA autocast too (see the class). Stored in the instance's
        ``__dict__`` (False where absent: a module pickled before the flag existed, or built by
        :meth:`from_layer_norm`); set, it must be a bool."""
        return self.__dict__.get("output_in_input_dtype", False)

    @output_in_input_dtype.setter
    def output_in_input_dtype(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"output_in_input_dtype: expected a bool, got {type(value).__name__}")
        if value and self.__dict__.get("apply_layernorm_1p", False):
            _check_1p(True, True, value)
        self.__dict__["output_in_input_dtype"] = value

    @property
    def apply_layernorm_1p(self) -> bool:
        """The scale is ``weight + 1`` (see the class). Stored in the instance's ``__dict__`` (False where absent: a
        module pickled before the flag existed); set, it must be a bool, with a weight and without
        ``output_in_input_dtype``."""
        return self.__dict__.get("apply_layernorm_1p", False)

    @apply_layernorm_1p.setter
    def apply_layernorm_1p(self, value: bool) -> None:
        _check_1p(value, self.weight is not None, self.output_in_input_dtype)
        self.__dict__["apply_layernorm_1p"] = value

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.__dict__.get("apply_layernorm_1p", False) and self.weight is not None:
            nn.init.zeros_(self.weight)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias  # once each: a module attribute lookup costs ~0.6 us of host time
        if self.__dict__.get("apply_layernorm_1p", False) and isinstance(input, torch.Tensor):
            in_dtype = self.__dict__.get("output_in_input_dtype", False)
            if w is None or in_dtype:
                _check_1p(True, w is not None, in_dtype)   # (changed after the flag was set)
            w = w + 1.0   # (in the weight's dtype, as NemotronLayerNorm1P; the gradient flows to the weight)
            device = input.device.type
            if torch.is_autocast_enabled():   # its rule (CUDA autocast's flag, as it reads it): autocast's cast
                dt = torch.get_autocast_dtype(device)
                input, w, b = (t.to(dt) if t is not None and t.device.type == device and t.dtype in _AUTOCAST_CASTS
                               else t for t in (input, w, b))
            if device != "meta" and torch.is_autocast_enabled(device):   # (transformers' maybe_autocast)
                with torch.autocast(device, enabled=False):
                    return self._norm(input, w, b)
            return self._norm(input, w, b)
        if (self.__dict__.get("output_in_input_dtype", False) and isinstance(input, torch.Tensor)
                and input.dtype in _HALF and not _common.on_kernel_device(input)):
            # off the kernels' devices (the CPU) the op is PyTorch's, whose 16-bit backward is less exact than the fp32
            # one: OLMo's and Cohere's own computation there (fp32, one rounding), as the kernels compute it (a
            # walkthrough)
            return self.forward(input.float()).to(input.dtype)
        return self._norm(input, w, b)

    def _norm(self, input: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
        if (_small_native("layer_norm", self.impl, input, self.normalized_shape, self.eps)
                and (w is None or w.dtype == input.dtype) and (b is None or b.dtype == input.dtype)):
            # What the dispatcher would choose (the small-problem rule), without its per-call cost: at these sizes
            # the step is bound by the host, and ~25 us of Python per call cost MiniLM 4% on the H200.
            dispatch.record(_SMALL_CHOICE["layer_norm"])
            # the ATen op F.layer_norm calls (it handles __torch_function__ itself; its last argument, cudnn_enable, is
            # unused): F.layer_norm's Python layer costs ~0.5 us more per call
            y = torch.layer_norm(input, self.normalized_shape, w, b, self.eps, True)
        else:
            try:
                y = PF.layer_norm(input, self.normalized_shape, w, b, self.eps, impl=self.impl)
            except (TypeError, ValueError) as e:
                raise _as_input_error(e) from None
        if y.dtype != input.dtype and self.__dict__.get("output_in_input_dtype", False):
            return y.to(input.dtype)   # under autocast F.layer_norm's rule gives fp32; OLMo's is the input's
        return y

    def extra_repr(self) -> str:
        return (super().extra_repr()
                + (", output_in_input_dtype=True" if self.__dict__.get("output_in_input_dtype", False) else "")
                + (", apply_layernorm_1p=True" if self.__dict__.get("apply_layernorm_1p", False) else ""))

    @classmethod
    def from_module(cls, module: nn.Module, eps: float | None = None, *, impl: str | None = None,
                    output_in_input_dtype: bool | None = None, verify: bool = True) -> "FusedLayerNorm":
        """A fused module for ``module``: a ``torch.nn.LayerNorm`` (:meth:`from_layer_norm`: its parameter objects
        shared; ``eps`` and ``output_in_input_dtype`` must not be given; a subclass with a forward of its own, with
        ``verify``, only where ``transformers.matching.probe_layer_norm_1p`` finds Nemotron's LayerNorm1P:
        ``apply_layernorm_1p=True``; with ``verify=False`` that where its class's name says LayerNorm1P, else a plain
        LayerNorm; a ``FusedLayerNorm``: its rules too); a LayerNorm module of its own class with a
        1-D ``weight`` and maybe a ``bias`` (Cohere's ``CohereLayerNorm``: fp32 math, one rounding to the input's
        dtype), its Parameter objects shared, its epsilon attribute (or ``eps``), checked with ``verify`` by
        ``transformers.matching.probe_layer_norm_module``; or a LayerNorm without parameters such as
        OLMo's ``OlmoLayerNorm`` (``F.layer_norm`` of the input in fp32 without weight and bias, cast back to the
        input's dtype): ``elementwise_affine=False``, with the width, epsilon and ``output_in_input_dtype`` that
        ``transformers.matching.probe_weightless_norm`` finds (OLMo's epsilon, a literal in its forward, is read from
        its output; a module that returns ``F.layer_norm``'s fp32 under CUDA autocast gets
        ``output_in_input_dtype=False``). ``eps`` overrides the epsilon (also an attribute the fused ops refuse).

        ``verify`` (default True) runs that probe; ``verify=False`` takes the module's ``normalized_shape`` (one
        size), its epsilon attribute (``variance_epsilon``, ``eps``, ``epsilon``) or ``eps``, and
        ``output_in_input_dtype`` (default True) on the caller's word.

        Raises:
            TypeError: ``module`` is not an ``nn.Module``, or has parameters other than a 1-D ``weight`` and maybe a
                ``bias`` of its size (or children), or is a ``torch.nn.RMSNorm``, ``GroupNorm`` or batch / instance
                norm, or, without parameters, does not look like a norm (no ``norm`` in its class name and no epsilon
                attribute); ``output_in_input_dtype`` not a bool or None.
            ValueError: a ``torch.nn.LayerNorm`` subclass with a forward of its own that is not LayerNorm1P (with
                ``verify``); the probe refuses it (its reason is given: a norm of rows of any width that names none,
                another formula or rounding) or finds an RMSNorm (use ``FusedRMSNorm.from_module``) or another
                ``output_in_input_dtype`` than the one given; with ``verify=False``, no ``normalized_shape`` of one
                size, or no epsilon attribute and no ``eps``; ``eps`` or ``output_in_input_dtype`` given for a
                ``torch.nn.LayerNorm``.
            What the constructor raises for the epsilon (the attribute's, named) and ``impl``.
        """
        if isinstance(module, nn.LayerNorm):
            if eps is not None or output_in_input_dtype is not None:
                raise ValueError("eps / output_in_input_dtype: a torch.nn.LayerNorm's are its own (from_layer_norm)")
            if type(module).forward is not nn.LayerNorm.forward and not isinstance(module, FusedLayerNorm):
                from .transformers.matching import layer_norm_1p_candidate, probe_layer_norm_1p

                # a subclass computing its own: with verify, only LayerNorm1P (probed); without, LayerNorm1P where
                # its class's name says so, else a plain LayerNorm on the caller's word
                probe = probe_layer_norm_1p(module) if verify else None
                if probe is not None and not probe.ok:
                    raise ValueError(f"module: {type(module).__name__} is a torch.nn.LayerNorm subclass with a forward "
                                     f"of its own, and not one that FusedLayerNorm computes: {probe.reason}; "
                                     "verify=False takes it on the caller's word (LayerNorm1P where its class's name "
                                     "says so, else a plain LayerNorm)")
                new = cls.from_layer_norm(module, impl=impl)
                new.apply_layernorm_1p = probe is not None or layer_norm_1p_candidate(module)
                return new
            return cls.from_layer_norm(module, impl=impl)
        if isinstance(module, nn.RMSNorm):
            raise TypeError("module: expected a torch.nn.LayerNorm or a LayerNorm-style module, got "
                            "torch.nn.RMSNorm, which does not subtract the mean: use FusedRMSNorm.from_module")
        if isinstance(module, (nn.GroupNorm, nn.modules.batchnorm._NormBase)):
            raise TypeError(f"module: expected a torch.nn.LayerNorm or a LayerNorm-style module, got "
                            f"{type(module).__name__}, whose statistics are per group / over the batch")
        if not isinstance(module, nn.Module):
            raise TypeError(f"module: expected a torch.nn.LayerNorm or a LayerNorm-style module, got "
                            f"{type(module).__name__}")
        if any(True for _ in module.parameters()):
            return cls._from_layer_norm_module(module, eps, impl, output_in_input_dtype, verify)
        shape, eps, in_dtype = _weightless_style(module, "layer_norm", eps, verify, output_in_input_dtype)
        new = cls(shape, eps=eps, elementwise_affine=False, impl=impl, output_in_input_dtype=in_dtype)
        new.train(module.training)
        return new

    @classmethod
    def _from_layer_norm_module(cls, module: nn.Module, eps: float | None, impl: str | None,
                                output_in_input_dtype: bool | None, verify: bool) -> "FusedLayerNorm":
        """:meth:`from_module` for a LayerNorm module of its own class, with a ``weight`` and maybe a ``bias``
        (Cohere's ``CohereLayerNorm``): the same Parameter objects, its epsilon attribute (or ``eps``), and with
        ``verify`` what ``transformers.matching.probe_layer_norm_module`` finds."""
        from .transformers.matching import probe_layer_norm_module, probe_rms_norm

        name = type(module).__name__
        own = dict(module.named_parameters(recurse=False))
        w, b = own.get("weight"), own.get("bias")
        if (set(own) - {"weight", "bias"} or w is None or w.dim() != 1 or any(True for _ in module.children())
                or (b is not None and b.shape != w.shape)):
            children = [n for n, _ in module.named_children()]
            raise TypeError(f"module: expected a torch.nn.LayerNorm or a LayerNorm-style module (a leaf of a 1-D "
                            f"'weight' and maybe a 'bias' of its size, or of no parameters), got {name} with "
                            f"parameters {[(n, tuple(p.shape)) for n, p in module.named_parameters()]}"
                            + (f" and children {children}" if children else ""))
        if output_in_input_dtype is not None and not isinstance(output_in_input_dtype, bool):
            raise TypeError(f"output_in_input_dtype: expected a bool or None, got "
                            f"{type(output_in_input_dtype).__name__}")
        in_dtype = True if output_in_input_dtype is None else output_in_input_dtype
        if verify:
            probe = probe_layer_norm_module(module)
            if not probe.ok and not probe.candidate and probe_rms_norm(module).ok:
                raise ValueError(f"module: {name} computes RMSNorm (it does not subtract the mean); use "
                                 "FusedRMSNorm.from_module")
            if not probe.ok:
                raise ValueError(f"module: {name} does not pass the LayerNorm probe: {probe.reason}; verify=False "
                                 "takes the module on the caller's word")
            _check_found_dtype_rule(name, output_in_input_dtype, probe.output_in_input_dtype)
            in_dtype = probe.output_in_input_dtype
        new = cls(tuple(w.shape), eps=_module_eps(module, eps), elementwise_affine=False, bias=False,
                  impl=impl, output_in_input_dtype=in_dtype)
        new.elementwise_affine = True
        new.weight = w   # the same Parameter objects
        if b is not None:
            new.bias = b
        new.train(module.training)
        return new

    @classmethod
    def from_layer_norm(cls, module: nn.LayerNorm, *, impl: str | None = None) -> "FusedLayerNorm":
        """A fused module sharing ``module``'s parameter objects (``new.weight is module.weight``): optimizers and
        tied references keep working. Raises TypeError if ``module`` is not a ``torch.nn.LayerNorm``, and what the
        constructor raises for its ``eps`` and ``impl``."""
        if not isinstance(module, nn.LayerNorm):
            raise TypeError(f"module: expected a torch.nn.LayerNorm, got {type(module).__name__}")
        _check_module_args("layer_norm", module.eps, impl)
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.normalized_shape = tuple(module.normalized_shape)
        new.eps = module.eps
        new.elementwise_affine = module.elementwise_affine
        new.register_parameter("weight", module.weight)  # the same Parameter objects (or None)
        new.register_parameter("bias", module.bias)
        new.impl = impl
        if isinstance(module, FusedLayerNorm):   # (its rules, which a plain LayerNorm lacks, carried over)
            new.output_in_input_dtype = module.output_in_input_dtype
            new.apply_layernorm_1p = module.apply_layernorm_1p
        new.train(module.training)
        return new


def _check_1p(apply_layernorm_1p: Any, has_weight: bool, output_in_input_dtype: bool) -> None:
    if not isinstance(apply_layernorm_1p, bool):
        raise TypeError(f"apply_layernorm_1p: expected a bool, got {type(apply_layernorm_1p).__name__}")
    if apply_layernorm_1p and not has_weight:
        raise ValueError("apply_layernorm_1p: the scale weight + 1 needs a weight (elementwise_affine=True)")
    if apply_layernorm_1p and output_in_input_dtype:
        raise ValueError("apply_layernorm_1p: expected output_in_input_dtype=False with it (Nemotron's LayerNorm1P "
                         "runs in the autocast dtype under autocast)")


class MixedFusedLayerNorm(FusedLayerNorm):
    """Megatron's name for :class:`FusedLayerNorm` (fp32 parameters with fp16/bf16 activations); identical: its
    arguments, shapes, errors and kernels are :class:`FusedLayerNorm`'s."""


class FusedRMSNorm(_DropsFuseRecord, nn.Module):
    """RMSNorm module over :func:`pipegoose.nn.fusion.functional.rms_norm`.

    Args:
        normalized_shape (or ``hidden_size``): int or shape of the trailing dims. Neither, with
            ``elementwise_affine=False``: the last dimension of each input, whatever its size (the weightless norms of
            transformers that store no width: Gemma 4's ``v_norm``, ``Gemma4RMSNorm(with_scale=False)``).
        eps: None -> F.rms_norm's default (fp32 machine epsilon for fp16/bf16/fp32 input), as torch.nn.RMSNorm.
        elementwise_affine: learnable ``weight`` (ones) if True.
        cast_before_weight: False: ``torch.nn.RMSNorm`` numerics; True: transformers' LlamaRMSNorm numerics
            (see the functional).
        output_in_weight_dtype: T5LayerNorm's rule: with an fp16/bf16 weight, the input normalised in fp32 is
            rounded to the weight's dtype and multiplied by the weight in it (the output in the weight's dtype,
            whatever the input's; one kernel when input and weight share the dtype, else the kernel without weight, a
            cast and a multiply); with an fp32 weight, ``torch.nn.RMSNorm``'s numerics in ``promote(input dtype,
            weight dtype)``. ``cast_before_weight`` is then ignored.
        output_in_input_dtype: OLMo-2's rule (``Olmo2RMSNorm`` and others: ``(weight * x_normed_fp32).to(input
            dtype)``): ``torch.nn.RMSNorm`` numerics (one rounding), the output in the input's dtype whatever the
            weight's; needs ``cast_before_weight=False`` and ``output_in_weight_dtype=False``.
        weight_offset: a number added to the weight (default 0.0): the output is ``normalised(x) * (weight_offset +
            weight)``, Gemma's rule with 1.0 (``GemmaRMSNorm``: ``(x_normed_fp32 * (1.0 + weight.float())).to(input
            dtype)``; its weight starts at zeros): the op takes the fp32 tensor ``weight.float() + weight_offset``
            (fp64 for an fp64 weight) and computes ``torch.nn.RMSNorm``'s numerics with it (one rounding), the output
            in the input's dtype; autograd carries the gradient back through the sum to ``weight``, in its dtype.
            Nonzero needs ``output_in_input_dtype=True`` and a weight (``elementwise_affine``), which starts at ``1 -
            weight_offset`` (zeros for Gemma's; ``reset_parameters`` too). For fp64 input the statistics are fp64,
            where Gemma's module computes them in fp32.
        device, dtype: of the weight.
        impl: force an implementation (``pipegoose``, ``torch``; any case), default auto.

    ``forward(input [..., *normalized_shape])`` (without ``normalized_shape``: ``input [..., d]``, any ``d``, at least
    one dimension) returns a tensor of the input's shape (dtype: by the rounding flags above). Parameters/state_dict:
    ``weight`` (as torch.nn.RMSNorm and LlamaRMSNorm). Kernel: pipegoose/rms_norm (MIT;
    this repository's pipegoose/kernels/csrc/rms_norm.cu and norm_kernels.cuh).

    Raises (when constructed, not at the first forward):
        TypeError: both of ``normalized_shape`` / ``hidden_size``, or neither with ``elementwise_affine=True``;
            ``elementwise_affine`` not a bool; the one given not an integer or a
            sequence of them; ``eps`` not a number or None (a bool, int, float, numpy scalar or 0-d tensor, as
            :func:`~pipegoose.nn.fusion.functional.rms_norm` takes); ``cast_before_weight``,
            ``output_in_weight_dtype`` or ``output_in_input_dtype`` not a bool; ``impl`` not a str or None;
            ``weight_offset`` not a real number (a bool is not one).
        ValueError: a negative size or no dimension, ``eps`` negative or not finite, ``impl`` naming no
            implementation of ``rms_norm``; ``output_in_input_dtype`` with ``cast_before_weight`` or
            ``output_in_weight_dtype``; ``weight_offset`` not finite, or nonzero without ``output_in_input_dtype``
            or with ``elementwise_affine=False``.
    """

    def __init__(self, normalized_shape: int | Sequence[int] | None = None, eps: float | None = None,
                 elementwise_affine: bool = True, *, hidden_size: int | None = None, cast_before_weight: bool = False,
                 output_in_weight_dtype: bool = False, output_in_input_dtype: bool = False, weight_offset: float = 0.0,
                 device=None, dtype=None, impl: str | None = None) -> None:
        super().__init__()
        self.output_in_weight_dtype = output_in_weight_dtype
        if not isinstance(elementwise_affine, bool):
            raise TypeError(f"elementwise_affine: expected a bool, got {type(elementwise_affine).__name__}")
        if normalized_shape is None and hidden_size is None and not elementwise_affine:
            self.normalized_shape = None   # the last dimension of each input (see the class)
        elif (normalized_shape is None) == (hidden_size is None):
            raise TypeError("normalized_shape / hidden_size: give exactly one (or neither with "
                            "elementwise_affine=False: the last dimension of each input)")
        elif normalized_shape is not None:
            self.normalized_shape = _ln_shape(normalized_shape)
        else:
            self.normalized_shape = _ln_shape(hidden_size, "hidden_size")
        if not isinstance(cast_before_weight, bool):
            raise TypeError(f"cast_before_weight: expected a bool, got {type(cast_before_weight).__name__}")
        if not isinstance(output_in_input_dtype, bool):
            raise TypeError(f"output_in_input_dtype: expected a bool, got {type(output_in_input_dtype).__name__}")
        if not isinstance(output_in_weight_dtype, bool):
            raise TypeError(f"output_in_weight_dtype: expected a bool, got {type(output_in_weight_dtype).__name__}")
        if output_in_input_dtype and (cast_before_weight or output_in_weight_dtype):
            raise ValueError("output_in_input_dtype: expected cast_before_weight=False and "
                             "output_in_weight_dtype=False with it (OLMo-2's rule is torch.nn.RMSNorm's numerics)")
        self.output_in_input_dtype = output_in_input_dtype
        offset = _weight_offset(weight_offset)
        _check_offset_rule(offset, output_in_input_dtype, elementwise_affine)
        self.__dict__["weight_offset"] = offset   # (the property's storage; see weight_offset)
        _check_module_args("rms_norm", eps, impl, allow_none_eps=True)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.cast_before_weight = cast_before_weight
        self.impl = impl
        if elementwise_affine:   # the identity scale: weight_offset + weight = 1 (Gemma's weight starts at zeros)
            self.weight = nn.Parameter(torch.full(self.normalized_shape, 1.0 - self.weight_offset, device=device,
                                                  dtype=dtype))
        else:
            self.register_parameter("weight", None)

    @property
    def variance_epsilon(self) -> float | None:
        """``eps`` under transformers' Llama-style name, read and written (a fused Llama norm's ``variance_epsilon``
        set by model code would otherwise be an attribute that nothing reads)."""
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value: float | None) -> None:
        _common.eps_value(value, allow_none=True, name="variance_epsilon")
        self.eps = value

    @property
    def weight_offset(self) -> float:
        """The number added to the weight (see the class); set, it is checked as the constructor checks it (a
        review: a NaN set after construction gave NaN outputs without an error), and a nonzero one is checked again
        against ``output_in_input_dtype`` and the weight at each forward. Stored in the instance's ``__dict__`` under
        its own name, as before it was a property, so pickles read the same in either version."""
        return self.__dict__.get("weight_offset", 0.0)

    @weight_offset.setter
    def weight_offset(self, value: float) -> None:
        value = _weight_offset(value)
        _check_offset_rule(value, getattr(self, "output_in_input_dtype", False), self.weight is not None)
        self.__dict__["weight_offset"] = value

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.constant_(self.weight, 1.0 - self.weight_offset)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        w = self.weight  # once: a module attribute lookup costs ~0.6 us of host time
        shape = self.normalized_shape
        if shape is None:   # the last dimension of each input
            shape = _last_dim(input)
        if (w is None and getattr(self, "output_in_input_dtype", False) and isinstance(input, torch.Tensor)
                and input.dtype in _HALF and not _common.on_kernel_device(input)):
            # off the kernels' devices the op is PyTorch's, whose 16-bit backward is less exact than the fp32 one:
            # Gemma 4's own computation there (fp32, one rounding), as the kernels compute it (see FusedLayerNorm)
            return self.forward(input.float()).to(input.dtype)
        # (the property's storage read directly; a module pickled before the field existed has none: 0.0)
        offset = self.__dict__.get("weight_offset", 0.0)
        if offset:
            # (the rule again: output_in_input_dtype or the weight changed after the offset was set; a review)
            _check_offset_rule(offset, self.output_in_input_dtype, w is not None)
            return self._offset_forward(input, w, shape)
        if self.output_in_weight_dtype:
            try:
                return self._t5_forward(input, w, shape)
            except (TypeError, ValueError) as e:
                raise _as_input_error(e) from None
        if (not self.cast_before_weight
                and _small_native("rms_norm", self.impl, input, shape, self.eps)
                and (w is None or w.dtype == input.dtype)):
            dispatch.record(_SMALL_CHOICE["rms_norm"])  # see FusedLayerNorm.forward
            y = torch.rms_norm(input, shape, w, self.eps)
        else:
            try:
                y = PF.rms_norm(input, shape, w, self.eps, cast_before_weight=self.cast_before_weight,
                                impl=self.impl)
            except (TypeError, ValueError) as e:
                raise _as_input_error(e) from None
        if getattr(self, "output_in_input_dtype", False) and y.dtype != input.dtype:
            return y.to(input.dtype)  # under autocast F.rms_norm's rule can give fp32; OLMo-2's is the input's
        return y

    def _offset_forward(self, input: torch.Tensor, w: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        # Gemma: normalised(x) * (offset + weight) in fp32, rounded once to the input's dtype. The op takes input and
        # weight of independent dtypes (so does its kernel), so it gets the fp32 sum as its weight and does the rest
        # in one pass; the sum is a weight-sized op whose backward hands the weight's gradient back in its dtype.
        # (An fp64 weight stays fp64: rounding it to fp32 would lose what the caller keeps it for)
        wo = (w if w.dtype == torch.float64 else w.float()) + self.weight_offset
        if _small_native("rms_norm", self.impl, input, shape, self.eps) and wo.dtype == input.dtype:
            dispatch.record(_SMALL_CHOICE["rms_norm"])  # see FusedLayerNorm.forward
            return torch.rms_norm(input, shape, wo, self.eps)
        try:
            y = PF.rms_norm(input, shape, wo, self.eps, cast_before_weight=False, impl=self.impl)
        except (TypeError, ValueError) as e:
            raise _as_input_error(e) from None
        # F.rms_norm's rule gives the input's dtype here, but fp32 under autocast where PyTorch lists rms_norm
        return y if y.dtype == input.dtype else y.to(input.dtype)

    def _t5_forward(self, input: torch.Tensor, w: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
        # T5LayerNorm: the normalised input in fp32 (or fp64); with a half weight rounded to the weight's dtype and
        # multiplied in it (two roundings), else multiplied by the weight as F.rms_norm does (one rounding).
        # The input is checked before it is cast (an integer one was cast to fp32 and normalised; a review)
        _common.check_float_tensor(input)
        if w is not None and w.dtype in _HALF:
            if input.dtype == w.dtype:  # LlamaRMSNorm's numerics are T5's here, in one kernel
                return PF.rms_norm(input, shape, w, self.eps, cast_before_weight=True,
                                   impl=self.impl)
            h = PF.rms_norm(input if input.dtype in (torch.float32, torch.float64) else input.float(),
                            shape, None, self.eps, cast_before_weight=False, impl=self.impl)
            return w * h.to(w.dtype)
        if w is not None and w.dtype != input.dtype:  # fp32 weight: T5 returns promote(input, weight)
            dt = torch.promote_types(input.dtype, w.dtype)
            input = input.to(dt)
        return PF.rms_norm(input, shape, w, self.eps, cast_before_weight=False, impl=self.impl)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
                f"cast_before_weight={self.cast_before_weight}"
                + (", output_in_weight_dtype=True" if self.output_in_weight_dtype else "")
                + (", output_in_input_dtype=True" if getattr(self, "output_in_input_dtype", False) else "")
                + (f", weight_offset={self.weight_offset}" if getattr(self, "weight_offset", 0.0) else ""))

    @classmethod
    def from_module(cls, module: nn.Module, eps: float | None = None, *, impl: str | None = None,
                    output_in_weight_dtype: bool | None = None, output_in_input_dtype: bool | None = None,
                    weight_offset: float | None = None, verify: bool = True) -> "FusedRMSNorm":
        """A fused module sharing ``module.weight`` (same Parameter object).

        ``module``: ``torch.nn.RMSNorm`` (-> F.rms_norm numerics, its ``eps``) or a transformers Llama-style
        RMSNorm (``weight`` + ``variance_epsilon``, ``eps`` or ``epsilon``; -> ``cast_before_weight=True``). ``eps``
        overrides (also an attribute the fused ops would refuse).
        ``output_in_weight_dtype``: the module is T5-style; ``output_in_input_dtype``: OLMo-2 style (one rounding,
        the output in the input's dtype; then ``cast_before_weight=False``); ``weight_offset`` 1.0: Gemma style
        (``x_normed * (1 + weight)``, ``GemmaRMSNorm`` and its copies: Gemma's rounding, so ``output_in_input_dtype``
        too unless given). See the class. None (the default): as the probe below finds (False / 0.0 for
        ``torch.nn.RMSNorm`` and with ``verify=False``).
        ``verify`` (default True): a module other than ``torch.nn.RMSNorm`` (a subclass of it with its own
        ``forward`` included) must pass the probe that ``fuse`` runs
        (``transformers.matching.probe_rms_norm``: its forward on random CPU inputs against the RMSNorm formula with
        its eps attribute, or Gemma's with ``(1 + weight)``, a 1-D weight, no buffers), so that a norm of another
        formula (``x * (2 + weight)``, say, or Gemma's with another rounding) is refused instead of silently
        replaced; a flag or offset given that contradicts what it finds is refused too. ``verify=False`` takes the
        module on the caller's word (a module without a runnable forward, or one whose eps lives under another name).

        A module without parameters (Gemma 4's ``Gemma4RMSNorm(with_scale=False)``, its ``v_norm`` and router norm)
        gives a module without weight: with ``verify``, of the width, epsilon and ``output_in_input_dtype`` that
        ``transformers.matching.probe_weightless_norm`` finds (width None, the last dimension of each input, where
        the module takes rows of any width; an epsilon the forward writes is read from its output); with
        ``verify=False``, its ``normalized_shape`` where it names one size (else None), its epsilon attribute or
        ``eps``, and ``output_in_input_dtype`` True unless given. ``output_in_weight_dtype`` and ``weight_offset``
        need a weight.

        Raises:
            TypeError: ``module`` is not ``torch.nn.RMSNorm`` and does not have exactly one parameter of its own, a
                ``weight`` of one or more dims (an ``nn.Linear``, with its bias, is refused), nor none (a module
                without parameters that does not look like a norm: no ``norm`` in its class name and no epsilon
                attribute; or one holding a plain tensor ``weight``), or it is a ``torch.nn.LayerNorm`` (even
                without bias), ``GroupNorm`` or batch/instance norm.
            TypeError / ValueError: ``eps`` is not given and the module's epsilon attribute holds no number / a
                negative or non-finite one (the error names the attribute; numpy scalars and 0-d tensors are taken).
            TypeError / ValueError: ``weight_offset`` as the class refuses it (and nonzero with
                ``output_in_input_dtype=False``, or for a module without a weight).
            ValueError: the module's epsilon is unknown (no ``variance_epsilon`` / ``eps`` / ``epsilon``) and ``eps``
                is not given;
                with ``verify``, the probe finds another formula (the message gives its reason), or a rounding or
                offset other than an ``output_in_weight_dtype`` / ``output_in_input_dtype`` / ``weight_offset`` given
                says (it names the values); a nonzero ``weight_offset`` for ``torch.nn.RMSNorm``; for a module without
                parameters: the probe of norms without parameters refuses it (its reason) or finds a LayerNorm (use
                ``FusedLayerNorm.from_module``), ``output_in_weight_dtype`` given, buffers with ``verify=False``.
        """
        if not isinstance(module, nn.Module):
            raise TypeError(f"module: expected torch.nn.RMSNorm or an RMSNorm-style torch.nn.Module, got "
                            f"{type(module).__name__}")
        w = getattr(module, "weight", None)
        if isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)):
            # their statistics subtract the mean: a bias-free one has RMSNorm's parameters, not its output
            raise TypeError(f"module: expected torch.nn.RMSNorm or an RMSNorm-style module, got "
                            f"{type(module).__name__}, which subtracts the mean (a LayerNorm: "
                            f"FusedLayerNorm.from_layer_norm)")
        if weight_offset is not None:
            weight_offset = _weight_offset(weight_offset)
        from .transformers.matching import is_torch_rms_norm

        if is_torch_rms_norm(module):   # (a subclass with its own forward: as any module, probed with verify)
            if verify and weight_offset:
                raise ValueError(f"weight_offset: torch.nn.RMSNorm computes x_normed * weight (offset 0.0), got "
                                 f"{weight_offset}; verify=False takes it")
            shape, cast, mod_eps = tuple(module.normalized_shape), False, module.eps
        elif not any(True for _ in module.parameters()):
            if output_in_weight_dtype:
                raise ValueError(f"output_in_weight_dtype: {type(module).__name__} has no weight")
            shape, eps, output_in_input_dtype = _weightless_style(module, "rms_norm", eps, verify,
                                                                  output_in_input_dtype)
            mod_eps, cast = eps, False
        else:
            own = [n for n, _ in module.named_parameters(recurse=False)]
            if not isinstance(w, nn.Parameter) or w.dim() < 1 or own != ["weight"]:
                raise TypeError(f"module: expected torch.nn.RMSNorm or an RMSNorm-style module whose only parameter "
                                f"is 'weight', got {type(module).__name__} with parameters {own}")
            if verify:   # first: a module that is no RMSNorm (an nn.Linear without bias) is told so, not asked for eps
                output_in_weight_dtype, output_in_input_dtype, weight_offset = _verify_rms_style(
                    module, output_in_weight_dtype, output_in_input_dtype, weight_offset)
            if weight_offset and output_in_input_dtype is None:   # Gemma's rounding goes with its offset
                output_in_input_dtype = True
            mod_eps = _module_eps(module, eps)   # (a numpy or 0-d tensor value is taken: eps_value)
            shape, cast = tuple(w.shape), not output_in_input_dtype
        output_in_weight_dtype, output_in_input_dtype = bool(output_in_weight_dtype), bool(output_in_input_dtype)
        weight_offset = weight_offset or 0.0
        # built without a weight (the module's is shared, not copied), and without the offset, which the class refuses
        # without a weight: both set below (the offset's checks against the flags first)
        if weight_offset and not output_in_input_dtype:
            raise ValueError(f"weight_offset: {weight_offset} needs output_in_input_dtype=True (Gemma's rule: fp32 "
                             "math, one rounding to the input's dtype)")
        if weight_offset and w is None:   # (as the constructor: the forward would ignore it; a review)
            raise ValueError(f"weight_offset: {weight_offset} needs a weight ({type(module).__name__} has none)")
        new = cls(shape, eps=eps if eps is not None else mod_eps, elementwise_affine=False,
                  output_in_weight_dtype=output_in_weight_dtype, output_in_input_dtype=output_in_input_dtype,
                  cast_before_weight=cast, impl=impl)
        new.elementwise_affine = w is not None
        new.weight = w
        new.weight_offset = weight_offset
        new.train(module.training)
        return new


class FusedRMSNormGated(_DropsFuseRecord, nn.Module):
    """A gated RMSNorm over :func:`pipegoose.nn.fusion.functional.rms_norm_gated` (op ``rms_norm_gated``): the norm,
    then ``silu`` of the gate (Qwen3-Next's and Qwen3.5's ``RMSNormGated`` and their copies; ``norm_before_gate=True``,
    the default), or the gate first, over groups of ``group_size`` values (Mamba2's ``MambaRMSNormGated`` and its
    copies in Bamba, Nemotron-H, Zamba2, Granite-4: ``norm_before_gate=False``).

    Args:
        hidden_size: the normalised size D (the weight's).
        eps: the norm's epsilon (``variance_epsilon``; 1e-6 as transformers').
        group_size: the values normalised together (a divisor of D; Mamba2's ``group_size``); None: D.
        norm_before_gate: the order (above).
        device, dtype: of the weight (ones).
        impl: force an implementation of op ``rms_norm_gated`` (``pipegoose``, ``ops``, ``torch``; any case), default
            auto.

    ``forward(hidden_states [..., D], gate [..., D])`` (gate of the input's shape; of its dtype or another: a bf16
    Mamba2 mixer passes an fp32 input and a bf16 gate; the gate first takes no gate too, Mamba2's ``gate=None``: the
    grouped norm alone) returns a tensor of the input's shape, in its dtype (norm before gate) or the promotion of the
    weight's and its (gate first, as Mamba2's module): on PyTorch's path bit for bit transformers' module (fp64 aside:
    see the functional), on the kernels within their rounding of it. Parameters/state_dict: ``weight``, as
    transformers' modules. ``eps``, also under transformers' name ``variance_epsilon`` (read and written; a value set
    while fused goes back to the model's module at ``unfuse``). ``activation`` is ``"silu"`` (read-only: the
    kernel's). Kernels: pipegoose/rms_norm_gated, or pipegoose/rms_norm and pipegoose/swiglu (this project, MIT).

    Raises (when constructed): TypeError: ``hidden_size`` or ``group_size`` not an int, ``eps`` not a number,
    ``norm_before_gate`` not a bool, ``impl`` not a str or None; ValueError: ``hidden_size`` below 1, ``group_size``
    not a divisor of it, ``eps`` negative or not finite, ``impl`` naming no implementation. At forward, what the
    functional raises (a ``gate`` of another shape, a missing one with the norm first), and a ValueError naming
    ``hidden_states`` for one whose last dimension is not ``hidden_size``.
    """

    # (class defaults: a module pickled before session 79 has neither attribute, and computes Qwen3-Next's form)
    group_size: int | None = None
    norm_before_gate: bool = True

    @property
    def activation(self) -> str:
        """``"silu"``: the gate's activation, the kernel's (read-only)."""
        return "silu"

    @property
    def variance_epsilon(self) -> float:
        """``eps`` under transformers' name, read and written (checked as the constructor checks it)."""
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value: float) -> None:
        self.eps = _common.eps_value(value, name="variance_epsilon")

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, group_size: int | None = None,
                 norm_before_gate: bool = True, device=None, dtype=None, impl: str | None = None) -> None:
        super().__init__()
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, numbers.Integral) or hidden_size < 1:
            raise (ValueError if isinstance(hidden_size, numbers.Integral) and not isinstance(hidden_size, bool)
                   else TypeError)(f"hidden_size: expected a positive int, got {hidden_size!r}")
        _check_module_args("rms_norm_gated", eps, impl)
        if group_size is not None:
            if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral):
                raise TypeError(f"group_size: expected an int or None, got {type(group_size).__name__}")
            if not (1 <= group_size <= hidden_size and hidden_size % group_size == 0):
                raise ValueError(f"group_size: expected a divisor of hidden_size {int(hidden_size)}, got {group_size}")
        if not isinstance(norm_before_gate, bool):
            raise TypeError(f"norm_before_gate: expected a bool, got {type(norm_before_gate).__name__}")
        # (None where the group is the whole row: the form Qwen3-Next's norm has, and what op "ops" takes)
        self.group_size = None if group_size is None or group_size == hidden_size else int(group_size)
        self.norm_before_gate = norm_before_gate
        self.hidden_size = int(hidden_size)
        self.eps = _common.eps_value(eps, name="eps")
        self.impl = impl
        self.weight = nn.Parameter(torch.ones(self.hidden_size, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        if gate is None:
            if self.norm_before_gate:
                raise TypeError("gate: FusedRMSNormGated with the norm first needs the gate (a tensor of "
                                "hidden_states' shape and dtype), got None")
            # Mamba2's module without a gate: the grouped norm alone, op rms_norm with Llama's rounding (the
            # normalised value cast to x's dtype, then times the weight), over each group
            try:
                return self._norm_alone(hidden_states)
            except (TypeError, ValueError) as e:
                raise _as_input_error(e) from None
        if isinstance(hidden_states, torch.Tensor) and (hidden_states.dim() < 1
                                                        or hidden_states.shape[-1] != self.hidden_size):
            raise ValueError(f"hidden_states: expected a tensor [..., {self.hidden_size}], got shape "
                             f"{list(hidden_states.shape)}")
        try:
            return PF.rms_norm_gated(hidden_states, gate, self.weight, self.eps, group_size=self.group_size,
                                     norm_before_gate=self.norm_before_gate, impl=self.impl)
        except (TypeError, ValueError) as e:
            raise _as_input_error(e) from None

    def _norm_alone(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states: expected a tensor [..., {self.hidden_size}], got "
                             + (str(list(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__))
        g = self.group_size or self.hidden_size
        # (a request of the reference, impl="torch", holds here too; op rms_norm has no "ops")
        impl = "torch" if self.impl is not None and self.impl.strip().lower() == "torch" else None
        h = PF.rms_norm(x.unflatten(-1, (self.hidden_size // g, g)), g, None, self.eps, cast_before_weight=True,
                        impl=impl)
        return self.weight * h.flatten(-2)

    def extra_repr(self) -> str:
        group = "" if self.group_size is None else f", group_size={self.group_size}"
        order = "" if self.norm_before_gate else ", norm_before_gate=False"
        return f"{self.hidden_size}, eps={self.eps}{group}{order}, activation={self.activation!r}"

    @classmethod
    def from_module(cls, module: nn.Module, *, impl: str | None = None, verify: bool = True,
                    group_size: int | None = None, norm_before_gate: bool | None = None) -> "FusedRMSNormGated":
        """A fused module sharing ``module.weight`` (the same Parameter object), with its epsilon attribute
        (``variance_epsilon``, ``eps`` or ``epsilon``). ``verify`` (default True): ``module`` must pass
        ``transformers.matching.probe_rms_norm_gated`` (its forward on random CPU inputs, bit for bit Qwen3-Next's
        gated norm or Mamba2's in fp32, bf16, fp16 and with an fp32 weight), which also gives the form (the order, the
        group size), so that a sigmoid gate or another rounding is refused instead of silently replaced; a
        ``group_size`` or ``norm_before_gate`` given too must agree with it. Without ``verify`` the form is those two
        arguments (the probe's, where the caller ran it): ``norm_before_gate`` is then required.

        Raises:
            TypeError: ``module`` is not an ``nn.Module`` with one 1-D ``weight`` and ``forward(hidden_states,
                gate)``.
            ValueError: the probe refuses it (its reason), or it has no epsilon attribute the ops take; a form given
                that differs from the probe's; ``verify=False`` without ``norm_before_gate``.
        """
        from .transformers.matching import eps_of, gated_rms_norm_candidate, probe_rms_norm_gated

        if not isinstance(module, nn.Module) or not gated_rms_norm_candidate(module):
            raise TypeError(f"module: expected a gated RMSNorm (one 1-D weight, forward(hidden_states, gate)), got "
                            f"{type(module).__name__}")
        if verify:
            probe = probe_rms_norm_gated(module)
            if not probe.ok:
                raise ValueError(f"module ({type(module).__name__}): {probe.reason}")
            n = module.weight.numel()
            given = (None if group_size is None or group_size == n else group_size, norm_before_gate)
            if ((given[0] is not None and given[0] != probe.group_size)
                    or given[1] not in (None, probe.norm_before_gate)):
                raise ValueError(f"group_size, norm_before_gate: given {group_size}, {norm_before_gate}, but module "
                                 f"({type(module).__name__}) computes {probe.group_size}, {probe.norm_before_gate} "
                                 f"(probed: {probe.reason})")
            eps, group_size, norm_before_gate = probe.eps, probe.group_size, probe.norm_before_gate
        else:
            if norm_before_gate is None:
                raise ValueError("norm_before_gate: required with verify=False (the order of the norm and the gate; "
                                 "the probe finds it with verify=True)")
            name, eps, bad = eps_of(module)
            if name is None or bad is not None:
                raise ValueError(f"module ({type(module).__name__}): "
                                 + ("no epsilon attribute" if name is None else str(bad)))
        new = cls(module.weight.numel(), eps, group_size=group_size, norm_before_gate=norm_before_gate, device="meta",
                  impl=impl)
        new.weight = module.weight
        new.train(module.training)
        return new


class _FusedSwiGLUBase(_DropsFuseRecord, nn.Module):
    """What the fused gated MLPs (SwiGLU, GeGLU) share: their projections (``_PROJECTIONS``, checked and held in that
    order), the op whose ``impl`` they take (``_OP``), the activation module of the MLP they were built from
    (``_act_name``, one of ``_ACTIVATIONS``; held, not called, unless replaced or hooked since), the probe's
    activations they compute (``_KINDS``, keys of ``transformers.matching.ACTIVATION_FORMULAS``) and
    :meth:`_from_mlp`."""

    _PROJECTIONS: tuple[str, ...] = ()
    _ACTIVATIONS: tuple[str, ...] = ()
    _OP = ""
    _KINDS: tuple[str, ...] = ("silu",)
    _PROBE_NAME: str | None = None   # the probe's name in from_module's error (None: SwiGLU or GeGLU by _KINDS)
    _act_name: str | None = None   # the MLP's activation attribute (from_module sets the one the MLP has)

    def _hold(self, projections: Sequence[Any], impl: str | None) -> None:
        for name, m in zip(self._PROJECTIONS, projections):
            if not isinstance(m, nn.Module):
                raise TypeError(f"{name}: expected a torch.nn.Module, got {type(m).__name__}")
        dispatch.check_impl(self._OP, impl)
        for name, m in zip(self._PROJECTIONS, projections):
            setattr(self, name, m)
        self.impl = impl

    def _changed_activation(self) -> Any:
        """The MLP's activation (a module, or a function attribute such as ``F.silu``) where it was replaced, given
        forward or backward hooks, or an attribute of its changed (``approximate``: ``_common.act_state``) since the
        probe vouched for it (the fused module then runs it, as the original MLP would, and its hooks fire), else
        None."""
        name = self._act_name
        if name is None:
            return None
        act = self._modules[name] if name in self._modules else self.__dict__.get(name)
        if act is None:
            return None
        if act is not self.__dict__.get("_probed_act"):
            return act
        if isinstance(act, nn.Module) and _common.has_module_hooks(act):
            return act
        state = self.__dict__.get("_probed_state")   # (None in a module pickled before it was kept)
        if state is not None and not _common.same_act_state(_common.act_state(act), state):
            return act
        return None

    def extra_repr(self) -> str:
        return f"impl={self.impl!r}" if self.impl is not None else ""

    def _gate_up_apart(self, x: torch.Tensor, op: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        """The forward of the MLPs with ``gate_proj`` and ``up_proj`` apart: ``down_proj(op(gate_proj(x),
        up_proj(x), *args))`` (``op``: the functional, ``swiglu`` or ``geglu``), or, where the MLP's activation was
        replaced or hooked since the probe vouched for it, that activation, run as the original MLP would."""
        gate, up, down = (getattr(self, n) for n in self._PROJECTIONS)   # (gate_proj, up_proj, down_proj; LFM2's names)
        act = self._changed_activation()
        if act is not None:
            return down(act(gate(x)) * up(x))
        return down(op(gate(x), up(x), *args, impl=self.impl))

    @classmethod
    def _probed(cls, probe: Any, kwargs: dict) -> dict:
        """The constructor's further keywords (``kwargs``, the caller's), given what the probe found (FusedGeGLUMLP:
        ``approximate``); ValueError where the caller's contradict it."""
        return kwargs

    @classmethod
    def _probed_activation(cls, probe: Any, kwargs: dict, whose: str) -> dict:
        """``kwargs`` with the probe's ``activation``, for the classes that take one (T5's, ModernBERT's MLP):
        ValueError where the probe found another layout (a module holding gate_proj, up_proj and down_proj too) or
        the caller's ``activation`` contradicts it (``whose``: the layout's owner, for the message)."""
        if probe.layout != "/".join(cls._PROJECTIONS):
            raise ValueError(f"mlp: probed as a {probe.layout} MLP, not {whose} {'/'.join(cls._PROJECTIONS)}; "
                             "verify=False skips this check")
        given = kwargs.get("activation")
        if given is not None and given != probe.activation:
            raise ValueError(f"activation: {given!r}, but the MLP's act computes {probe.activation!r}: pass that or "
                             "None, or verify=False")
        return {**kwargs, "activation": probe.activation}

    @classmethod
    def _from_mlp(cls, mlp: nn.Module, impl: str | None, verify: bool, **kwargs: Any):
        """:meth:`from_module` of each class (see there); ``kwargs``: the constructor's further keywords."""
        from .transformers.matching import probe_swiglu_mlp

        children = dict(mlp.named_children()) if isinstance(mlp, nn.Module) else {}
        missing = [n for n in cls._PROJECTIONS if not isinstance(children.get(n), nn.Module)]
        if missing:
            names = ", ".join(cls._PROJECTIONS[:-1]) + " and " + cls._PROJECTIONS[-1]
            raise TypeError(f"mlp: expected a module with submodules {names}, got {type(mlp).__name__} without "
                            f"{', '.join(missing)}")
        if verify:
            probe = probe_swiglu_mlp(mlp)
            gated = cls._PROBE_NAME or ("SwiGLU" if "silu" in cls._KINDS else "GeGLU")
            why = probe.reason if not probe.ok else None
            if why is None and probe.activation not in cls._KINDS:
                # (the probe names the activation module alike for both; the other class takes it)
                act = next((getattr(mlp, n) for n in cls._ACTIVATIONS if n in mlp._modules or n in mlp.__dict__),
                           None)
                named = "its forward (no act_fn)" if act is None else f"{cls._act_name} ({type(act).__name__})"
                why = (f"{named} is not SiLU but GELU (approximate={probe.approximate!r}): a GeGLU MLP, which "
                       "FusedGeGLUMLP.from_module takes" if probe.approximate is not None else
                       f"{named} computes SiLU, not GELU: a SwiGLU MLP, which FusedSwiGLUMLP.from_module takes")
            if why is not None:
                raise ValueError(f"mlp: {type(mlp).__name__} does not pass the {gated} probe: {why}; verify=False "
                                 "skips this check")
            kwargs = cls._probed(probe, kwargs)
        new = cls(*(children[n] for n in cls._PROJECTIONS), impl=impl, **kwargs)
        new._modules = dict(mlp._modules)   # every child, in the original's order
        # the activation the probe found to be SiLU or GELU (not a submodule of its own: an attribute state_dict does
        # not see): a submodule, or a function attribute (``self.act_fn = F.silu``; fuse() carries it over with the
        # MLP's other attributes, and back at unfuse), so that one assigned while fused is run as the MLP's forward
        # would run it
        # (before, only a submodule was watched: a module assigned over a function attribute was ignored; a review)
        act_name = next((n for n in cls._ACTIVATIONS if n in mlp._modules or n in mlp.__dict__), None)
        new.__dict__["_act_name"] = act_name   # (None: the MLP has none; an activation added while fused is not run)
        new.__dict__["_probed_act"] = (None if act_name is None else mlp._modules[act_name] if act_name in mlp._modules
                                       else mlp.__dict__[act_name])
        new.__dict__["_probed_state"] = _common.act_state(new.__dict__["_probed_act"])
        new.training = mlp.training
        return new


class FusedSwiGLUMLP(_FusedSwiGLUBase):
    """The SwiGLU MLP ``down_proj(silu(gate_proj(x)) * up_proj(x))`` with the activation and product in one kernel
    (:func:`pipegoose.nn.fusion.functional.swiglu`): what ``fuse`` puts in place of transformers' ``LlamaMLP`` and
    its copies (Mistral, Qwen2, Qwen3, ...). :class:`FusedGateUpSwiGLUMLP` is the same for gate and up in one
    projection (Phi-3, GLM).

    Args:
        gate_proj, up_proj: modules mapping ``[..., hidden]`` to ``[..., intermediate]`` (``torch.nn.Linear`` in
            transformers' models; any module works), held as they are: the same objects, so parameters, optimizers
            and ``state_dict`` keys (``gate_proj.weight``, ...) are unchanged.
        down_proj: ``[..., intermediate]`` -> ``[..., hidden]``.
        impl: force an implementation of op ``swiglu`` (``pipegoose``, ``torch``; any case), default auto.

    ``forward(x [..., hidden])`` -> ``[..., hidden]``. The activation runs our kernel where the dispatcher chooses it
    (CUDA, gate and up of one shape and dtype, at least ``PIPEGOOSE_SMALL_NUMEL`` elements), else
    ``F.silu(gate) * up``. Built by :meth:`from_module`, it keeps the MLP's ``act_fn`` (Llama 4's ``activation_fn``)
    without calling it; an ``act_fn`` replaced, or given forward or backward hooks, while fused is called as the
    original MLP would (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, no kernel). Kernel: pipegoose/swiglu
    (pipegoose/kernels/csrc/swiglu.cu, this project, MIT).

    Raises (when constructed):
        TypeError: a projection that is not a ``torch.nn.Module``; ``impl`` not a str or None.
        ValueError: ``impl`` naming no implementation of ``swiglu``.
    """

    _PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
    _ACTIVATIONS = ("act_fn", "activation_fn")   # (Llama's; Llama 4's)
    _OP = "swiglu"
    _act_name = "act_fn"

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module, *,
                 impl: str | None = None) -> None:
        super().__init__()
        self._hold((gate_proj, up_proj, down_proj), impl)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._gate_up_apart(x, PF.swiglu)

    @classmethod
    def from_module(cls, mlp: nn.Module, *, impl: str | None = None, verify: bool = True) -> "FusedSwiGLUMLP":
        """A fused module holding ``mlp``'s children, the same objects in the same order (its ``act_fn`` too, which
        it does not call: ``named_modules()`` and ``state_dict`` keys are unchanged), and its training flag.

        ``verify`` (default True): ``mlp`` must pass the probe that ``fuse`` runs
        (``transformers.matching.probe_swiglu_mlp``: its forward, with small random projections on CPU, against
        ``down_proj(silu(gate_proj(x)) * up_proj(x))``), so that a gated MLP of another activation (Gemma's GELU) is
        refused instead of silently replaced.

        Raises:
            TypeError: ``mlp`` lacks a ``gate_proj``, ``up_proj`` or ``down_proj`` submodule.
            ValueError: with ``verify``, the probe finds another computation (the message gives its reason).
        """
        return cls._from_mlp(mlp, impl, verify)


class FusedLfm2MLP(FusedSwiGLUMLP):
    """LFM2's SwiGLU MLP (transformers' ``Lfm2MLP``, and the copies of LFM2-MoE's dense layers and LFM3),
    ``w2(silu(w1(x)) * w3(x))``: :class:`FusedSwiGLUMLP` under LFM2's names (``w1`` the gate, ``w3`` up, ``w2`` down;
    its forward calls ``F.silu`` itself, no activation module), on the same kernel (op ``swiglu``): what ``fuse`` puts
    in place of those modules.

    Args:
        w1, w3: ``[..., hidden]`` -> ``[..., intermediate]``, gate and up (held as they are: the same objects, so
            parameters, optimizers and ``state_dict`` keys are unchanged).
        w2: ``[..., intermediate]`` -> ``[..., hidden]``.
        impl: as :class:`FusedSwiGLUMLP`'s.

    ``forward`` as :class:`FusedSwiGLUMLP`'s. Kernel: pipegoose/swiglu (pipegoose/kernels/csrc/swiglu.cu, this
    project, MIT).

    Raises (when constructed): as :class:`FusedSwiGLUMLP`'s.
    """

    _PROJECTIONS = ("w1", "w3", "w2")
    _ACTIVATIONS = ("act_fn",)

    def __init__(self, w1: nn.Module, w3: nn.Module, w2: nn.Module, *, impl: str | None = None) -> None:
        super().__init__(w1, w3, w2, impl=impl)

    @classmethod
    def from_module(cls, mlp: nn.Module, *, impl: str | None = None, verify: bool = True) -> "FusedLfm2MLP":
        """As :meth:`FusedSwiGLUMLP.from_module`, for an MLP with ``w1``, ``w3`` and ``w2`` (the probe's layout
        ``w1/w3/w2``).

        Raises:
            TypeError: ``mlp`` lacks a ``w1``, ``w3`` or ``w2`` submodule.
            ValueError: with ``verify``, the probe finds another computation (the message gives its reason).
        """
        return cls._from_mlp(mlp, impl, verify)


class FusedGateUpSwiGLUMLP(_FusedSwiGLUBase):
    """The SwiGLU MLP with gate and up in one projection, ``down_proj(silu(gate) * up)`` of ``gate, up =
    gate_up_proj(x).chunk(2, dim=-1)``, with the activation and product in one kernel
    (:func:`pipegoose.nn.fusion.functional.silu_and_mul`, op ``swiglu.packed``): what ``fuse`` puts in place of
    transformers' ``Phi3MLP`` (Phi-3, Phi-4-mini) and ``GlmMLP`` / ``Glm4MLP`` (GLM).

    Args:
        gate_up_proj: a module mapping ``[..., hidden]`` to ``[..., 2 * intermediate]``, gate the first half of the
            last dimension and up the second (``torch.nn.Linear`` in transformers' models; any module works), held
            as it is: the same object, so parameters, optimizers and ``state_dict`` keys (``gate_up_proj.weight``,
            ...) are unchanged.
        down_proj: ``[..., intermediate]`` -> ``[..., hidden]``.
        impl: force an implementation of op ``swiglu.packed`` (``pipegoose``, ``torch``; any case), default auto
            (``PIPEGOOSE_IMPL_SWIGLU_PACKED``, then ``PIPEGOOSE_IMPL_SWIGLU``, choose one for the process).

    ``forward(x [..., hidden])`` -> ``[..., hidden]``, in the projections' result dtype: fp32, fp16 or bf16 take the
    kernel (fp64 the reference). The activation runs our kernel where the dispatcher chooses it (CUDA, at least
    ``PIPEGOOSE_SMALL_NUMEL`` elements of ``gate_up_proj``'s output), reading the two halves where they lie and
    returning their gradient as one tensor, else ``gate, up = h.chunk(2, -1); F.silu(gate) * up``; the kernel computes
    each value in fp32 and rounds it once (eager PyTorch in 16-bit rounds ``silu(gate)`` first: about one unit in the
    last place apart). Built by :meth:`from_module`, it keeps the MLP's activation (``activation_fn``, Phi-3's and
    GLM's name, or ``act_fn``) without calling it; one replaced, or given forward or backward hooks, while fused is
    called as the original MLP would (``down_proj(up * activation_fn(gate))``, no kernel). Kernel: pipegoose/swiglu
    (pipegoose/kernels/csrc/swiglu.cu, this project, MIT).

    Raises (when constructed):
        TypeError: a projection that is not a ``torch.nn.Module``; ``impl`` not a str or None.
        ValueError: ``impl`` naming no implementation of ``swiglu.packed``.
    Raises (forward): ValueError where ``gate_up_proj``'s output has an odd last dimension (no two halves).
    """

    _PROJECTIONS = ("gate_up_proj", "down_proj")
    _ACTIVATIONS = ("activation_fn", "act_fn")
    _OP = "swiglu.packed"
    _act_name = "activation_fn"

    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module, *, impl: str | None = None) -> None:
        super().__init__()
        self._hold((gate_up_proj, down_proj), impl)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed, down = (getattr(self, n) for n in self._PROJECTIONS)   # (gate_up_proj, down_proj; Granite's names)
        act = self._changed_activation()
        if act is not None:
            # an activation replaced or hooked since the probe vouched for it: run it, as the original MLP would
            gate, up = packed(x).chunk(2, dim=-1)
            return down(act(gate) * up)
        h = packed(x)
        # (silu_and_mul's error would name "x", which the caller never passed)
        if isinstance(h, torch.Tensor) and not h.is_nested and h.dim() and h.shape[-1] % 2:
            raise ValueError(f"{self._PROJECTIONS[0]}: returned shape {list(h.shape)}, expected an even last "
                             f"dimension (gate and up are its two halves) for the input of shape {list(x.shape)}")
        return down(PF.silu_and_mul(h, impl=self.impl))

    @classmethod
    def from_module(cls, mlp: nn.Module, *, impl: str | None = None, verify: bool = True) -> "FusedGateUpSwiGLUMLP":
        """A fused module holding ``mlp``'s children, the same objects in the same order (its activation too, which
        it does not call: ``named_modules()`` and ``state_dict`` keys are unchanged), and its training flag.

        ``verify`` (default True): ``mlp`` must pass the probe that ``fuse`` runs
        (``transformers.matching.probe_swiglu_mlp``: its forward, with small random projections on CPU, against
        ``down_proj(silu(gate) * up)`` of ``gate, up = gate_up_proj(x).chunk(2, -1)``, gate and up past +-50, in
        training and eval mode), so that a ``gate_up_proj`` MLP of another activation (Zamba2's GELU), a clamped one
        (``swiglu_limit``: MiniMax-M3's), one with up as the first half or with other submodules, parameters or
        forward arguments is refused instead of silently replaced. ``verify=False`` takes the module on the caller's
        word.

        Raises:
            TypeError: ``mlp`` lacks a ``gate_up_proj`` or ``down_proj`` submodule.
            ValueError: with ``verify``, the probe finds another computation (the message gives its reason);
                ``impl`` naming no implementation of ``swiglu.packed``.
        """
        return cls._from_mlp(mlp, impl, verify)


class FusedGraniteMLP(FusedGateUpSwiGLUMLP):
    """Granite's gated MLP (transformers' ``GraniteMoeSharedMLP`` and ``GraniteMoeHybridMLP``: the shared MLP of
    Granite 3 MoE-shared and Granite 4.0 models), ``output_linear(activation(gate) * up)`` of ``gate, up =
    input_linear(x).chunk(2, dim=-1)``: :class:`FusedGateUpSwiGLUMLP` under Granite's names, on the same kernel
    (:func:`pipegoose.nn.fusion.functional.silu_and_mul`, op ``swiglu.packed``), what ``fuse`` puts in place of
    those modules where their activation is SiLU (Granite's ``hidden_act``).

    Args:
        input_linear: ``[..., hidden]`` -> ``[..., 2 * intermediate]``, gate the first half (held as it is: the same
            object, so parameters, optimizers and ``state_dict`` keys are unchanged).
        output_linear: ``[..., intermediate]`` -> ``[..., hidden]``.
        impl: as :class:`FusedGateUpSwiGLUMLP`'s.

    ``forward`` as :class:`FusedGateUpSwiGLUMLP`'s; its ``activation`` is kept, not called, unless replaced or
    hooked while fused. Kernel: pipegoose/swiglu (pipegoose/kernels/csrc/swiglu.cu, this project, MIT).

    Raises (when constructed): as :class:`FusedGateUpSwiGLUMLP`'s. Raises (forward): ValueError where
    ``input_linear``'s output has an odd last dimension.
    """

    _PROJECTIONS = ("input_linear", "output_linear")
    _ACTIVATIONS = ("activation",)
    _act_name = "activation"

    def __init__(self, input_linear: nn.Module, output_linear: nn.Module, *, impl: str | None = None) -> None:
        super().__init__(input_linear, output_linear, impl=impl)

    @classmethod
    def from_module(cls, mlp: nn.Module, *, impl: str | None = None, verify: bool = True) -> "FusedGraniteMLP":
        """As :meth:`FusedGateUpSwiGLUMLP.from_module`, for an MLP with ``input_linear``, ``output_linear`` and
        ``activation`` (the probe's layout ``input_linear/output_linear``).

        Raises:
            TypeError: ``mlp`` lacks an ``input_linear`` or ``output_linear`` submodule.
            ValueError: with ``verify``, the probe finds another computation (the message gives its reason).
        """
        return cls._from_mlp(mlp, impl, verify)


class FusedGeGLUMLP(_FusedSwiGLUBase):
    """The GeGLU MLP ``down_proj(gelu(gate_proj(x)) * up_proj(x))`` with the activation and product in one kernel
    (:func:`pipegoose.nn.fusion.functional.geglu`, op ``geglu``): what ``fuse`` puts in place of transformers'
    ``GemmaMLP``, ``Gemma2MLP`` and ``Gemma3MLP`` (and of any Llama-style MLP whose ``act_fn`` is GELU).
    :class:`FusedSwiGLUMLP` is the same with SiLU.

    Args:
        gate_proj, up_proj, down_proj: as :class:`FusedSwiGLUMLP`'s (held as they are: parameters, optimizers and
            ``state_dict`` keys are unchanged).
        approximate: GELU's form, as ``F.gelu`` takes it: ``"tanh"`` (default; transformers' ``gelu_pytorch_tanh``,
            ``gelu_new``, ``gelu_fast``: Gemma's) or ``"none"`` (exact, erf: transformers' ``gelu``).
        impl: force an implementation of op ``geglu`` (``pipegoose``, ``torch``; any case), default auto
            (``PIPEGOOSE_IMPL_GEGLU`` chooses one for the process).

    ``forward(x [..., hidden])`` -> ``[..., hidden]``. The activation runs our kernel where the dispatcher chooses it
    (CUDA, gate and up of one shape and dtype, at least ``PIPEGOOSE_SMALL_NUMEL`` elements), else ``F.gelu(gate,
    approximate=approximate) * up``; the kernel computes each value in fp32 and rounds it once (eager PyTorch in 16-bit
    rounds ``gelu(gate)`` first: about one unit in the last place apart). Built by :meth:`from_module`, it keeps the
    MLP's ``act_fn`` without calling it; an ``act_fn`` replaced, or given forward or backward hooks, while fused is
    called as the original MLP would (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, no kernel). Kernel:
    pipegoose/swiglu (``pipegoose::geglu``; pipegoose/kernels/csrc/swiglu.cu, this project, MIT).

    Raises (when constructed):
        TypeError: a projection that is not a ``torch.nn.Module``; ``approximate`` or ``impl`` not a str (``impl``:
            or None).
        ValueError: ``approximate`` neither ``"none"`` nor ``"tanh"``; ``impl`` naming no implementation of
            ``geglu``.
    """

    _PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
    _ACTIVATIONS = ("act_fn", "activation_fn")   # (Llama's; Llama 4's)
    _OP = "geglu"
    _KINDS = ("gelu_tanh", "gelu")
    _act_name = "act_fn"

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module, *, approximate: str = "tanh",
                 impl: str | None = None) -> None:
        super().__init__()
        self.approximate = _swiglu.check_approximate(approximate)
        self._hold((gate_proj, up_proj, down_proj), impl)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._gate_up_apart(x, PF.geglu, self.approximate)

    def extra_repr(self) -> str:
        return ", ".join([f"approximate={self.approximate!r}"] + ([f"impl={self.impl!r}"] if self.impl is not None
                                                                 else []))

    @classmethod
    def _probed(cls, probe: Any, kwargs: dict) -> dict:
        given = kwargs.get("approximate")
        if given is not None:   # (a bad value is the constructor's TypeError / ValueError, not a mismatch; a review)
            _swiglu.check_approximate(given)
        if given is not None and given != probe.approximate:
            raise ValueError(f"approximate: {given!r}, but the MLP's act_fn computes GELU with approximate="
                             f"{probe.approximate!r}: pass that or None, or verify=False")
        return {**kwargs, "approximate": probe.approximate}

    @classmethod
    def from_module(cls, mlp: nn.Module, *, approximate: str | None = None, impl: str | None = None,
                    verify: bool = True) -> "FusedGeGLUMLP":
        """A fused module holding ``mlp``'s children, the same objects in the same order (its ``act_fn`` too, which
        it does not call: ``named_modules()`` and ``state_dict`` keys are unchanged), and its training flag.

        ``verify`` (default True): ``mlp`` must pass the probe that ``fuse`` runs
        (``transformers.matching.probe_swiglu_mlp``: its ``act_fn`` against float64 SiLU and GELU, then its forward,
        with small random projections on CPU, against ``down_proj(gelu(gate_proj(x)) * up_proj(x))``) and its
        activation must be GELU, whose form gives ``approximate`` (``approximate``, where given, must agree). So a
        SwiGLU MLP, or one of another activation (QuickGELU, a clipped GELU), is refused instead of silently
        replaced. ``verify=False`` takes the module on the caller's word, with ``approximate`` (None: ``"tanh"``).

        Raises:
            TypeError: ``mlp`` lacks a ``gate_proj``, ``up_proj`` or ``down_proj`` submodule.
            ValueError: with ``verify``, the probe finds another computation (the message gives its reason), or an
                ``approximate`` other than its GELU's; ``approximate`` or ``impl`` that the constructor refuses.
        """
        if not verify and approximate is None:
            approximate = "tanh"
        return cls._from_mlp(mlp, impl, verify, approximate=approximate)


class FusedT5DenseGatedActDense(_FusedSwiGLUBase):
    """T5 v1.1's gated MLP (transformers' ``T5DenseGatedActDense``: T5 v1.1, Flan-T5, mT5; ``UMT5DenseGatedActDense``,
    ``LongT5DenseGatedActDense`` and the other copies), ``wo(dropout(act(wi_0(x)) * wi_1(x)))`` with ``act`` SiLU or
    GELU (exact, or the tanh approximation: ``gelu_new``, Flan-T5's and mT5's), with the activation and product in one
    kernel (:func:`pipegoose.nn.fusion.functional.swiglu`, op ``swiglu``, for SiLU; :func:`~pipegoose.nn.fusion.
    functional.geglu`, op ``geglu``, for GELU): what ``fuse`` puts in place of those modules.

    Args:
        wi_0, wi_1: modules mapping ``[..., d_model]`` to ``[..., d_ff]``, gate and up (``torch.nn.Linear`` in
            transformers' models; any module works), held as they are: the same objects, so parameters, optimizers
            and ``state_dict`` keys (``wi_0.weight``, ...) are unchanged.
        wo: ``[..., d_ff]`` -> ``[..., d_model]``.
        dropout: the module applied to the product before ``wo`` (the MLP's ``torch.nn.Dropout``, called as it is:
            in training it draws its mask from torch's generator where the MLP would, so a seeded run drops the same
            elements fused or not), or None (none).
        activation: ``"silu"``, ``"gelu_tanh"`` (default) or ``"gelu"`` (the probe's names: keys of
            ``transformers.matching.ACTIVATION_FORMULAS``); SiLU runs op ``swiglu``, GELU op ``geglu`` with
            :attr:`approximate` ``"tanh"`` or ``"none"``.
        cast_to_wo: apply T5's rule before ``wo`` (default True): the product is cast to ``wo.weight``'s dtype where
            ``wo.weight`` is a tensor of another dtype and not int8 (an fp32 ``wo`` in a bf16 model: transformers'
            ``_keep_in_fp32_modules``). False for LongT5's copy, which does not cast.
        impl: force an implementation of the op (``pipegoose``, ``torch``; any case), default auto
            (``PIPEGOOSE_IMPL_SWIGLU`` or ``PIPEGOOSE_IMPL_GEGLU`` chooses one for the process).

    ``forward(x [..., d_model])`` -> ``[..., d_model]``, in ``wo``'s result dtype. The activation runs our kernel where
    the dispatcher chooses it (CUDA, gate and up of one shape and dtype, at least ``PIPEGOOSE_SMALL_NUMEL`` elements),
    else ``F.silu(gate) * up`` or ``F.gelu(gate, approximate=approximate) * up``; the kernel computes each value in
    fp32 and rounds it once (eager PyTorch in 16-bit rounds the activation first: about one unit in the last place
    apart). Built by :meth:`from_module`, it keeps the MLP's ``act`` without calling it; an ``act`` replaced, or given
    forward or backward hooks, while fused is called as the original MLP would (``act(wi_0(x)) * wi_1(x)``, no
    kernel), then the dropout, the cast and ``wo`` as above. Kernel: pipegoose/swiglu (``pipegoose::swiglu``,
    ``pipegoose::geglu``; pipegoose/kernels/csrc/swiglu.cu, this project, MIT).

    Raises (when constructed):
        TypeError: ``wi_0``, ``wi_1``, ``wo`` or a ``dropout`` (not None) that is not a ``torch.nn.Module``;
            ``activation`` not a str, ``cast_to_wo`` not a bool, ``impl`` not a str or None.
        ValueError: ``activation`` none of ``"silu"``, ``"gelu_tanh"``, ``"gelu"``; ``impl`` naming no
            implementation of the op.
    """

    _PROJECTIONS = ("wi_0", "wi_1", "wo")
    _ACTIVATIONS = ("act",)
    _KINDS = ("silu", "gelu_tanh", "gelu")
    _PROBE_NAME = "T5 gated MLP"
    _act_name = "act"

    def __init__(self, wi_0: nn.Module, wi_1: nn.Module, wo: nn.Module, dropout: nn.Module | None = None, *,
                 activation: str = "gelu_tanh", cast_to_wo: bool = True, impl: str | None = None) -> None:
        super().__init__()
        self._check_args(activation, cast_to_wo, given=True)
        if dropout is not None and not isinstance(dropout, nn.Module):
            raise TypeError(f"dropout: expected a torch.nn.Module or None, got {type(dropout).__name__}")
        self.activation = activation
        self.approximate = {"gelu_tanh": "tanh", "gelu": "none"}.get(activation)   # F.gelu's; None for SiLU
        self._OP = "swiglu" if self.approximate is None else "geglu"   # (the instance's: _hold checks impl for it)
        self.cast_to_wo = cast_to_wo
        self._hold((wi_0, wi_1, wo), impl)
        self.dropout = dropout

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        act = self._changed_activation()
        if act is not None:
            # an activation replaced or hooked since the probe vouched for it: run it, as the original MLP would
            h = act(self.wi_0(hidden_states)) * self.wi_1(hidden_states)
        elif self.approximate is None:
            h = PF.swiglu(self.wi_0(hidden_states), self.wi_1(hidden_states), impl=self.impl)
        else:
            h = PF.geglu(self.wi_0(hidden_states), self.wi_1(hidden_states), self.approximate, impl=self.impl)
        if self.dropout is not None:
            h = self.dropout(h)
        if self.cast_to_wo:
            # T5's rule, as its forward has it (an fp32 wo kept in a 16-bit model; int8 weights left to wo)
            w = self.wo.weight
            if isinstance(w, torch.Tensor) and h.dtype != w.dtype and w.dtype != torch.int8:
                h = h.to(w.dtype)
        return self.wo(h)

    def extra_repr(self) -> str:
        return ", ".join([f"activation={self.activation!r}"] + ([] if self.cast_to_wo else ["cast_to_wo=False"])
                         + ([f"impl={self.impl!r}"] if self.impl is not None else []))

    @classmethod
    def _check_args(cls, activation: Any, cast_to_wo: Any, given: bool = False) -> None:
        """The constructor's checks of ``activation`` and ``cast_to_wo`` (``given`` False: None is "not given", as
        ``from_module`` takes it; the constructor refuses None)."""
        if (given or activation is not None) and not isinstance(activation, str):
            raise TypeError(f"activation: expected a str, got {type(activation).__name__}")
        if activation is not None and activation not in cls._KINDS:
            raise ValueError(f"activation: expected one of {', '.join(map(repr, cls._KINDS))}, got {activation!r}")
        if (given or cast_to_wo is not None) and not isinstance(cast_to_wo, bool):
            raise TypeError(f"cast_to_wo: expected a bool, got {type(cast_to_wo).__name__}")

    @classmethod
    def _probed(cls, probe: Any, kwargs: dict) -> dict:
        # (bad values are the constructor's TypeError / ValueError first, not a mismatch with the probe; a review)
        cls._check_args(kwargs.get("activation"), kwargs.get("cast_to_wo"))
        kwargs = cls._probed_activation(probe, kwargs, "T5's")
        cast = kwargs.get("cast_to_wo")
        if cast is not None and cast != probe.down_cast:
            does = "casts" if probe.down_cast else "does not cast"
            raise ValueError(f"cast_to_wo: {cast!r}, but the MLP's forward {does} the product to wo.weight's dtype: "
                             f"pass {probe.down_cast} or None, or verify=False")
        return {**kwargs, "cast_to_wo": probe.down_cast}

    @classmethod
    def from_module(cls, mlp: nn.Module, *, activation: str | None = None, cast_to_wo: bool | None = None,
                    impl: str | None = None, verify: bool = True) -> "FusedT5DenseGatedActDense":
        """A fused module holding ``mlp``'s children, the same objects in the same order (``wi_0``, ``wi_1``, ``wo``,
        ``dropout`` and ``act``, which it does not call: ``named_modules()`` and ``state_dict`` keys are unchanged),
        and its training flag.

        ``verify`` (default True): ``mlp`` must pass the probe that ``fuse`` runs
        (``transformers.matching.probe_swiglu_mlp``: its ``act`` against float64 SiLU and GELU, then its forward, with
        small random projections on CPU and its dropout replaced by a fixed mask, against ``wo(dropout(act(wi_0(x)) *
        wi_1(x)))`` in training and eval mode, then with an fp64 ``wo`` for the cast rule), which gives
        ``activation`` and ``cast_to_wo`` (each, where given, must agree). So an MLP of another activation
        (ReLU, QuickGELU), with other submodules, parameters or forward arguments, or whose forward draws randomness
        of its own or calls its dropout elsewhere, is refused instead of silently replaced. ``verify=False`` takes the
        module on the caller's word, with ``activation`` (None: ``"gelu_tanh"``) and ``cast_to_wo`` (None: True,
        T5's cast).

        Raises:
            TypeError: ``mlp`` lacks a ``wi_0``, ``wi_1`` or ``wo`` submodule.
            ValueError: with ``verify``, the probe finds another computation (the message gives its reason), or an
                ``activation`` other than its ``act``'s, a ``cast_to_wo`` other than its forward's;
                ``activation``, ``cast_to_wo`` or ``impl`` that the constructor refuses.
        """
        if not verify:
            activation = "gelu_tanh" if activation is None else activation
            cast_to_wo = True if cast_to_wo is None else cast_to_wo
        return cls._from_mlp(mlp, impl, verify, activation=activation, cast_to_wo=cast_to_wo,
                             dropout=mlp._modules.get("dropout") if isinstance(mlp, nn.Module) else None)


class FusedModernBertMLP(_FusedSwiGLUBase):
    """ModernBERT's gated MLP (transformers' ``ModernBertMLP`` and ``ModernBertDecoderMLP``), ``Wo(drop(act(input) *
    gate))`` of ``input, gate = Wi(x).chunk(2, dim=-1)``, with the activation and product in one kernel that reads the
    two halves of ``Wi``'s output where they lie (:func:`pipegoose.nn.fusion.functional.gelu_and_mul`, op
    ``geglu.packed``, for GELU, ModernBERT's default ``gelu``; :func:`~pipegoose.nn.fusion.functional.silu_and_mul`,
    op ``swiglu.packed``, for SiLU): what ``fuse`` puts in place of those modules.

    Args:
        Wi: a module mapping ``[..., hidden]`` to ``[..., 2 * intermediate]``, the activated half first
            (``torch.nn.Linear`` in transformers' models; any module works), held as it is: the same object, so
            parameters, optimizers and ``state_dict`` keys (``Wi.weight``, ...) are unchanged.
        Wo: ``[..., intermediate]`` -> ``[..., hidden]``.
        drop: the module applied to the product before ``Wo`` (the MLP's ``torch.nn.Dropout``, called as it is: in
            training it draws its mask where the MLP would, so a seeded run drops the same elements fused or not), or
            None (none).
        activation: ``"gelu"`` (default, exact GELU), ``"gelu_tanh"`` or ``"silu"`` (keys of
            ``transformers.matching.ACTIVATION_FORMULAS``).
        impl: force an implementation of the op (``pipegoose``, ``torch``; any case), default auto.

    ``forward(x [..., hidden])`` -> ``[..., hidden]``. The activation runs our kernel where the dispatcher chooses it
    (CUDA, fp32/fp16/bf16, at least ``PIPEGOOSE_SMALL_NUMEL`` elements of ``Wi``'s output), returning the gradient of
    ``Wi``'s output as one tensor, else ``input, gate = h.chunk(2, -1); act(input) * gate`` in PyTorch; the kernel
    computes each value in fp32 and rounds it once (eager PyTorch in 16-bit rounds the activation first: about one
    unit in the last place apart). Built by :meth:`from_module`, it keeps the MLP's ``act`` without calling it; an
    ``act`` replaced, or given forward or backward hooks, while fused is called as the original MLP would. Kernel:
    pipegoose/swiglu (``pipegoose::gelu_and_mul``, ``pipegoose::silu_and_mul``; pipegoose/kernels/csrc/swiglu.cu,
    this project, MIT).

    Raises (when constructed):
        TypeError: ``Wi``, ``Wo`` or a ``drop`` (not None) that is not a ``torch.nn.Module``; ``activation`` not a
            str, ``impl`` not a str or None.
        ValueError: ``activation`` none of ``"gelu"``, ``"gelu_tanh"``, ``"silu"``; ``impl`` naming no
            implementation of the op.
    Raises (forward): ValueError where ``Wi``'s output has an odd last dimension (no two halves).
    """

    _PROJECTIONS = ("Wi", "Wo")
    _ACTIVATIONS = ("act",)
    _KINDS = ("silu", "gelu_tanh", "gelu")
    _PROBE_NAME = "ModernBERT MLP"
    _act_name = "act"

    def __init__(self, Wi: nn.Module, Wo: nn.Module, drop: nn.Module | None = None, *,  # noqa: N803 (its names)
                 activation: str = "gelu", impl: str | None = None) -> None:
        super().__init__()
        self._check_activation(activation, given=True)
        if drop is not None and not isinstance(drop, nn.Module):
            raise TypeError(f"drop: expected a torch.nn.Module or None, got {type(drop).__name__}")
        self.activation = activation
        self.approximate = {"gelu_tanh": "tanh", "gelu": "none"}.get(activation)   # F.gelu's; None for SiLU
        self._OP = "swiglu.packed" if self.approximate is None else "geglu.packed"   # (_hold checks impl for it)
        self._hold((Wi, Wo), impl)
        self.drop = drop

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        act = self._changed_activation()
        if act is not None:
            # an activation replaced or hooked since the probe vouched for it: run it, as the original MLP would
            input, gate = self.Wi(hidden_states).chunk(2, dim=-1)
            h = act(input) * gate
        else:
            h = self.Wi(hidden_states)
            # (the op's error would name "x", which the caller never passed)
            if isinstance(h, torch.Tensor) and not h.is_nested and h.dim() and h.shape[-1] % 2:
                raise ValueError(f"Wi: returned shape {list(h.shape)}, expected an even last dimension (input and "
                                 f"gate are its two halves) for the input of shape {list(hidden_states.shape)}")
            h = (PF.silu_and_mul(h, impl=self.impl) if self.approximate is None
                 else PF.gelu_and_mul(h, self.approximate, impl=self.impl))
        if self.drop is not None:
            h = self.drop(h)
        return self.Wo(h)

    def extra_repr(self) -> str:
        return ", ".join([f"activation={self.activation!r}"] + ([f"impl={self.impl!r}"] if self.impl is not None
                                                                 else []))

    @classmethod
    def _check_activation(cls, activation: Any, given: bool = False) -> None:
        if (given or activation is not None) and not isinstance(activation, str):
            raise TypeError(f"activation: expected a str, got {type(activation).__name__}")
        if activation is not None and activation not in cls._KINDS:
            raise ValueError(f"activation: expected one of {', '.join(map(repr, cls._KINDS))}, got {activation!r}")

    @classmethod
    def _probed(cls, probe: Any, kwargs: dict) -> dict:
        cls._check_activation(kwargs.get("activation"))
        return cls._probed_activation(probe, kwargs, "ModernBERT's")

    @classmethod
    def from_module(cls, mlp: nn.Module, *, activation: str | None = None, impl: str | None = None,
                    verify: bool = True) -> "FusedModernBertMLP":
        """A fused module holding ``mlp``'s children, the same objects in the same order (``Wi``, ``act``, which it
        does not call, ``drop`` and ``Wo``: ``named_modules()`` and ``state_dict`` keys are unchanged), and its
        training flag.

        ``verify`` (default True): ``mlp`` must pass the probe that ``fuse`` runs
        (``transformers.matching.probe_swiglu_mlp``: its ``act`` against float64 SiLU and GELU, then its forward,
        with small random projections on CPU and its dropout replaced by a fixed mask, against ``Wo(drop(act(input)
        * gate))`` in training and eval mode), which gives ``activation`` (where given, it must agree): an MLP of
        another activation, with other submodules, parameters or forward arguments, or whose forward draws
        randomness of its own or calls its dropout elsewhere, is refused instead of silently replaced.
        ``verify=False`` takes the module on the caller's word, with ``activation`` (None: ``"gelu"``).

        Raises:
            TypeError: ``mlp`` lacks a ``Wi`` or ``Wo`` submodule.
            ValueError: with ``verify``, the probe finds another computation (the message gives its reason), or an
                ``activation`` other than its ``act``'s; ``activation`` or ``impl`` that the constructor refuses.
        """
        if not verify:
            activation = "gelu" if activation is None else activation
        return cls._from_mlp(mlp, impl, verify, activation=activation,
                             drop=mlp._modules.get("drop") if isinstance(mlp, nn.Module) else None)


class FusedGELU(_DropsFuseRecord, nn.Module):
    """GELU in one kernel forward and one backward (:func:`pipegoose.nn.fusion.functional.gelu`, op ``gelu``): what
    ``fuse`` puts in place of the activation modules of the MLPs without a gate that compute GELU, ``fc2(act(fc1(x)))``:
    transformers' ``NewGELUActivation`` (``gelu_new``: GPT-2, GPT-J, Phi, CodeGen), ``FastGELUActivation``,
    ``GELUActivation``, ``AccurateGELUActivation``, ``GELUTanh``, Bloom's ``BloomGelu`` and ``torch.nn.GELU``. Several
    of those run GELU as four to eight elementwise ops forward, more backward, saving a tensor of the input's size for
    each; this runs one kernel each way and saves the input alone.

    Args:
        approximate: ``"none"`` (default, exact GELU, erf) or ``"tanh"`` (the tanh approximation), as ``F.gelu``.
        impl: force an implementation of op ``gelu`` (``pipegoose``, ``torch``: ``F.gelu``; any case), default auto.

    ``forward(input [*])`` -> ``[*]``, in ``input``'s dtype: fp32, fp16 or bf16 take the kernel on CUDA (at least
    ``PIPEGOOSE_SMALL_NUMEL`` elements), fp64 and the rest ``F.gelu``. Under autocast too the output keeps the
    input's dtype (as ``F.gelu``'s; ``NewGELUActivation`` under CUDA autocast returns fp32 for a 16-bit input, its
    ``torch.pow`` being an fp32 op there: the values agree, rounded once to the input's dtype, which the next
    ``Linear`` under autocast casts to anyway). Kernel: pipegoose/swiglu (pipegoose/kernels/csrc/swiglu.cu, this
    project, MIT).

    Raises (when constructed):
        TypeError: ``approximate`` not a str; ``impl`` not a str or None.
        ValueError: ``approximate`` neither ``"none"`` nor ``"tanh"``; ``impl`` naming no implementation of ``gelu``.
    """

    def __init__(self, approximate: str = "none", *, impl: str | None = None) -> None:
        super().__init__()
        self.approximate = _swiglu.check_approximate(approximate)
        dispatch.check_impl(_swiglu.GELU_OP, impl)
        self.impl = impl

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return PF.gelu(input, self.approximate, impl=self.impl)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}" + (f", impl={self.impl!r}" if self.impl is not None else "")

    @classmethod
    def from_module(cls, act: nn.Module, *, approximate: str | None = None, impl: str | None = None,
                    verify: bool = True) -> "FusedGELU":
        """The fused module for the activation module ``act``, in its training mode.

        ``verify`` (default True): ``act`` must pass the probe that ``fuse`` runs (``transformers.matching.
        probe_gelu``, less fuse's rule that the class's name has "gelu" in it: a leaf module without parameters or
        buffers, whose forward on CPU, in training and eval mode, computes GELU, exact or tanh, as the float64 formula
        within atol 1e-6 and rtol 1e-5, near 0 and out to +-100); the probe tells ``approximate``. ``act``'s hooks
        are not carried over (``fuse`` hands them to the replacement). ``verify=False`` takes ``approximate`` from
        the argument, else from ``act``'s attribute of that name (``torch.nn.GELU``'s).

        Raises:
            TypeError: ``act`` not a module; with ``verify=False``, no ``approximate`` given or found.
            ValueError: with ``verify``, the probe refuses ``act`` (the message gives its reason), or
                ``approximate`` other than the probe's; ``approximate`` or ``impl`` that the constructor refuses.
        """
        from .transformers.matching import probe_gelu

        if not isinstance(act, nn.Module):
            raise TypeError(f"act: expected a torch.nn.Module, got {type(act).__name__}")
        if approximate is not None:
            _swiglu.check_approximate(approximate)
        if verify:
            probe = probe_gelu(act, by_name=False)
            if not probe.ok:
                raise ValueError(f"act: {type(act).__name__} does not pass the GELU probe: {probe.reason}; "
                                 "verify=False skips this check")
            if approximate is not None and approximate != probe.approximate:
                raise ValueError(f"approximate: {approximate!r}, but {type(act).__name__} computes GELU with "
                                 f"approximate={probe.approximate!r}")
            approximate = probe.approximate
        elif approximate is None:
            approximate = getattr(act, "approximate", None)
            if approximate is None:
                raise TypeError(f"approximate: required with verify=False ({type(act).__name__} has no attribute "
                                "approximate)")
        new = cls(approximate, impl=impl)
        new.training = act.training
        return new


class FusedSquaredReLU(_DropsFuseRecord, nn.Module):
    """Squared ReLU, ``relu(x)^2``, in one kernel forward and one backward (:func:`pipegoose.nn.fusion.functional.
    squared_relu`, op ``squared_relu``): what ``fuse`` puts in place of transformers' ``ReLUSquaredActivation``
    (``relu2``: the MLPs without a gate of Nemotron, Nemotron-H, Persimmon, Arcee, Jais2, NanoChat), which runs ``relu``
    and ``square``, two kernels forward and three backward. The same values bit for bit (the one exception:
    :func:`~pipegoose.nn.fusion.functional.squared_relu` says it), the same saved tensor size.

    Args:
        impl: force an implementation of op ``squared_relu`` (``pipegoose``, ``torch``: ``torch.square(F.relu(x))``;
            any case), default auto.

    ``forward(input [*])`` -> ``[*]``, in ``input``'s dtype: fp32, fp16 or bf16 take the kernel on CUDA (at least
    ``PIPEGOOSE_SMALL_NUMEL`` elements), fp64 and the rest PyTorch's ops. Kernel: pipegoose/swiglu
    (pipegoose/kernels/csrc/swiglu.cu, this project, MIT).

    Raises (when constructed):
        TypeError: ``impl`` not a str or None. ValueError: ``impl`` naming no implementation of ``squared_relu``.
    """

    def __init__(self, *, impl: str | None = None) -> None:
        super().__init__()
        dispatch.check_impl(_swiglu.SQUARED_RELU_OP, impl)
        self.impl = impl

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return PF.squared_relu(input, impl=self.impl)

    def extra_repr(self) -> str:
        return f"impl={self.impl!r}" if self.impl is not None else ""

    @classmethod
    def from_module(cls, act: nn.Module, *, impl: str | None = None, verify: bool = True) -> "FusedSquaredReLU":
        """The fused module for the activation module ``act``, in its training mode.

        ``verify`` (default True): ``act`` must pass the probe that ``fuse`` runs (``transformers.matching.
        probe_squared_relu``, less fuse's rule on the class's name: a leaf module without parameters or buffers whose
        forward on CPU, in training and eval mode, computes ``relu(x)^2`` as the float64 formula within atol 1e-6 and
        rtol 1e-5, near 0 and out to +-100). ``act``'s hooks are not carried over (``fuse`` hands them to the
        replacement).

        Raises:
            TypeError: ``act`` not a module; ``impl`` as the constructor.
            ValueError: with ``verify``, the probe refuses ``act`` (the message gives its reason); ``impl`` as the
                constructor.
        """
        from .transformers.matching import probe_squared_relu

        if not isinstance(act, nn.Module):
            raise TypeError(f"act: expected a torch.nn.Module, got {type(act).__name__}")
        if verify:
            probe = probe_squared_relu(act, by_name=False)
            if not probe.ok:
                raise ValueError(f"act: {type(act).__name__} does not pass the squared ReLU probe: {probe.reason}; "
                                 "verify=False skips this check")
        new = cls(impl=impl)
        new.training = act.training
        return new


class FusedLinearCrossEntropyLoss(nn.Module):
    """A language model's output projection and loss in one (:func:`pipegoose.nn.fusion.functional.
    fused_linear_cross_entropy`): ``F.cross_entropy(F.linear(hidden, weight, bias).float(), target)`` computed chunk
    by chunk over the rows, without the [N, V] logits.

    Args:
        ignore_index: the target value to skip (default -100, transformers' and PyTorch's).
        reduction: ``mean`` (over the rows not ignored) or ``sum``.
        chunk_rows: rows per chunk, or None (the largest power of two whose logits hold at most 2**27
            values, at least 2048 and at most N: ``ops.linear_cross_entropy.default_chunk_rows``).
        impl: force an implementation of op ``fused_linear_cross_entropy`` (``pipegoose``, ``torch``), default auto.

    ``forward(hidden [..., H], weight [V, H], target [...] int64, bias [V] or None)`` -> the fp32 scalar loss.
    Kernel: pipegoose/cross_entropy (pipegoose/kernels/csrc/cross_entropy.cu, this project, MIT), between cuBLAS
    GEMMs. On the fused path one backward per forward: a second backward through a retained graph, or one with
    ``create_graph=True``, raises RuntimeError (``impl="torch"`` allows both).

    Raises (when constructed): the TypeError and ValueError the functional raises for these arguments.
    """

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", chunk_rows: int | None = None, *,
                 impl: str | None = None) -> None:
        super().__init__()
        from .ops import linear_cross_entropy as _flce

        probe = torch.empty(1, 1)
        self.ignore_index = _flce.check_args(probe, probe, torch.empty(1, dtype=torch.long), None, ignore_index,
                                             reduction, chunk_rows)
        dispatch.check_impl("fused_linear_cross_entropy", impl)
        self.reduction = reduction
        self.chunk_rows = chunk_rows
        self.impl = impl

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        return PF.fused_linear_cross_entropy(hidden, weight, target, bias, ignore_index=self.ignore_index,
                                             reduction=self.reduction, chunk_rows=self.chunk_rows, impl=self.impl)

    def extra_repr(self) -> str:
        parts = [f"ignore_index={self.ignore_index}", f"reduction={self.reduction!r}"]
        parts += [f"chunk_rows={self.chunk_rows}"] if self.chunk_rows is not None else []
        parts += [f"impl={self.impl!r}"] if self.impl is not None else []
        return ", ".join(parts)


def _weight_offset(value: Any) -> float:
    """FusedRMSNorm's ``weight_offset`` as a float: a real number (a Python or numpy one; not a bool, not a tensor,
    which would be a learnable offset taken as a constant), finite.

    Raises:
        TypeError: not a real number. ValueError: not finite.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"weight_offset: expected a real number, got {type(value).__name__}")
    value = float(value)
    # (fp32's range: the op adds it to the fp32 weight, and the constructor's initial weight is 1 - offset in fp32)
    if not math.isfinite(value) or abs(value) > torch.finfo(torch.float32).max:
        raise ValueError(f"weight_offset: expected a finite number within fp32's range, got {value}")
    return value


def _check_offset_rule(offset: float, output_in_input_dtype: bool, has_weight: bool) -> None:
    """FusedRMSNorm's rule for a nonzero ``weight_offset``: Gemma's rounding (``output_in_input_dtype``) and a weight.

    Raises:
        ValueError: ``offset`` nonzero without them.
    """
    if offset and not output_in_input_dtype:
        raise ValueError(f"weight_offset: {offset} needs output_in_input_dtype=True (Gemma's rule: fp32 math, one "
                         "rounding to the input's dtype)")
    if offset and not has_weight:
        raise ValueError(f"weight_offset: {offset} needs a weight (elementwise_affine=True)")


def _module_eps(module: nn.Module, eps: float | None) -> float:
    """``eps`` where given, else the value of ``module``'s epsilon attribute (``transformers.matching.eps_of``):
    ValueError naming the attributes where it has none, the attribute's TypeError / ValueError where the fused ops
    refuse its value (both say to pass ``eps=``)."""
    if eps is not None:
        return eps
    from .transformers.matching import EPS_ATTRIBUTES, eps_of

    name = type(module).__name__
    eps_name, value, error = eps_of(module)
    if eps_name is None:
        raise ValueError(f"eps: {name} has no {', '.join(map(repr, EPS_ATTRIBUTES))}; pass eps=")
    if error is not None:
        raise type(error)(f"{name}.{error}; pass eps= to use another")
    return value


def _check_found_dtype_rule(name: str, given: bool | None, found: bool) -> None:
    """ValueError where an ``output_in_input_dtype`` given contradicts what a probe found for module class ``name``."""
    if given is not None and given != found:
        raise ValueError(f"output_in_input_dtype: {name} returns {'the input dtype' if found else 'fp32'} under "
                         f"autocast (output_in_input_dtype={found}), got {given}; verify=False takes it")


def _weightless_style(module: nn.Module, kind: str, eps: float | None, verify: bool,
                      output_in_input_dtype: bool | None) -> tuple[tuple[int, ...] | None, float | None, bool]:
    """``from_module`` of FusedRMSNorm (``kind`` ``rms_norm``) or FusedLayerNorm (``layer_norm``) for a module without
    parameters (Gemma 4's ``Gemma4RMSNorm(with_scale=False)``, OLMo's ``OlmoLayerNorm``): its normalized shape (None:
    the last dimension of each input, an RMSNorm's only), epsilon (``eps`` where given) and
    ``output_in_input_dtype``. With ``verify`` the module must pass ``transformers.matching.probe_weightless_norm``
    as a norm of ``kind`` (which also reads an epsilon the module does not name, and whether it casts back to the
    input's dtype under autocast); without, the width is its ``normalized_shape`` where it names one size, the epsilon
    its attribute or ``eps``, and ``output_in_input_dtype`` True unless given. TypeError for a module that does not
    look like a norm (no ``norm`` in its class name and no epsilon attribute) or holds a plain tensor ``weight``;
    ValueError where the probe refuses it, finds the other kind, or finds another ``output_in_input_dtype`` than the
    one given, or where no epsilon is known."""
    from .transformers.matching import _width_of, probe_weightless_norm

    name = type(module).__name__
    expected = ("torch.nn.RMSNorm or an RMSNorm-style module (one 'weight', or none and a norm's name or epsilon "
                "attribute)" if kind == "rms_norm" else
                "a torch.nn.LayerNorm or a LayerNorm-style module (without parameters: a norm's name or epsilon "
                "attribute)")
    if isinstance(getattr(module, "weight", None), torch.Tensor):   # (set by a hook: the fused module would drop it)
        raise TypeError(f"module: {name}'s 'weight' is a plain tensor, not a Parameter: the fused module shares "
                        "Parameters")
    if output_in_input_dtype is not None and not isinstance(output_in_input_dtype, bool):
        raise TypeError(f"output_in_input_dtype: expected a bool or None, got {type(output_in_input_dtype).__name__}")
    if verify:
        probe = probe_weightless_norm(module)
        if not probe.candidate:
            raise TypeError(f"module: expected {expected}, got {name} without parameters")
        if probe.ok and probe.kind != kind:
            other = ("FusedLayerNorm.from_module: it subtracts the mean" if kind == "rms_norm" else
                     "FusedRMSNorm.from_module: it does not subtract the mean")
            raise ValueError(f"module: {name} computes {'LayerNorm' if kind == 'rms_norm' else 'RMSNorm'} without "
                             f"parameters; use {other}")
        if not probe.ok:
            raise ValueError(f"module: {name} does not pass the probe of norms without parameters: {probe.reason}; "
                             "verify=False takes the module on the caller's word")
        _check_found_dtype_rule(name, output_in_input_dtype, probe.output_in_input_dtype)
        width, found, in_dtype = probe.width, probe.eps, probe.output_in_input_dtype
        if eps is None and probe.eps_error is not None:
            raise type(probe.eps_error)(f"{name}.{probe.eps_error}; pass eps= to use another")
    else:
        if list(module.buffers(recurse=False)):
            raise ValueError(f"module: {name} has buffers ({', '.join(n for n, _ in module.named_buffers())}), which "
                             "the fused module would drop")
        width = _width_of(module)
        if isinstance(width, str) or (width is None and kind == "layer_norm"):
            raise ValueError(f"module: {name} has no normalized_shape of one size (got "
                             f"{getattr(module, 'normalized_shape', None)!r}): FusedLayerNorm takes one")
        found = _module_eps(module, eps)
        in_dtype = True if output_in_input_dtype is None else output_in_input_dtype
    return ((width,) if width else None), (eps if eps is not None else found), in_dtype


def _verify_rms_style(module: nn.Module, output_in_weight_dtype: bool | None, output_in_input_dtype: bool | None,
                      weight_offset: float | None = None) -> tuple[bool, bool, float]:
    """FusedRMSNorm.from_module's check (``verify``): the two rounding flags and the weight offset (each None: as
    the probe finds), or ValueError when ``module`` fails fuse's RMSNorm probe or a value given contradicts what it
    finds."""
    from .transformers.matching import probe_layer_norm_module, probe_rms_norm

    name = type(module).__name__
    probe = probe_rms_norm(module)
    if not probe.ok and probe_layer_norm_module(module).ok:
        raise ValueError(f"module: {name} computes LayerNorm (it subtracts the mean); use FusedLayerNorm.from_module")
    if not probe.ok:
        raise ValueError(f"module: {name} does not pass the RMSNorm probe: {probe.reason}. FusedRMSNorm computes "
                         "x * rsqrt(mean(x^2) + eps) * (weight_offset + weight); verify=False skips this check, for a "
                         "module known to compute that whose probe cannot run (its outputs would otherwise differ from "
                         "the module's)")
    found = (probe.output_in_weight_dtype, probe.output_in_input_dtype)
    given = (output_in_weight_dtype, output_in_input_dtype)
    if any(g is not None and bool(g) != f for g, f in zip(given, found)):
        raise ValueError(f"module: {name} rounds its output as FusedRMSNorm with output_in_weight_dtype={found[0]}, "
                         f"output_in_input_dtype={found[1]} does: pass those or leave them None (got "
                         f"{given[0]}, {given[1]}), or verify=False")
    if weight_offset is not None and weight_offset != probe.weight_offset:
        raise ValueError(f"module: {name} computes x_normed * ({probe.weight_offset} + weight): pass "
                         f"weight_offset={probe.weight_offset} or leave it None (got {weight_offset}), or verify=False")
    return (*found, probe.weight_offset)
