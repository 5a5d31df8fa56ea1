"""Model knowledge for ``fuse(model)``: which modules of a transformers model can be fused, and how.

* LayerNorm: every ``torch.nn.LayerNorm`` instance.
* RMSNorm: found by what a module computes, not by its class name. A candidate has no children, exactly one
  parameter (1-D, of any size: the hidden size, a head's, a projection's), no buffers and an ``eps``-like attribute
  (``variance_epsilon``, ``eps`` or ``epsilon``); it is accepted when, run on CPU in fp32 on a small random input with
  a random weight, its forward equals ``x * rsqrt(mean(x^2, -1) + eps) * weight`` (float64 reference), or Gemma's
  ``x * rsqrt(mean(x^2, -1) + eps) * (1 + weight)`` (``RMSNormProbe.weight_offset`` 1.0: GemmaRMSNorm of Gemma,
  Gemma 2 and Gemma 3, their per-head ``q_norm`` / ``k_norm`` too, and its copies such as Qwen3-Next's), the latter
  only where it rounds as Gemma's does (fp32 math, one rounding to the input's dtype). This finds the Llama, Mistral,
  Qwen2/Qwen3, OLMo-2, T5 and Gemma styles and rejects mean-subtracting norms, other offsets (``2 + weight``) and a
  ``(1 + weight)`` norm of another rounding.
* Norms without parameters (:func:`probe_weightless_norm`: OLMo's LayerNorm, Gemma 4's ``v_norm`` and router norm)
  and LayerNorms of a class of their own with a weight (:func:`probe_layer_norm_module`: Cohere's), found by what they
  compute as RMSNorm is.
* Attention: the model types whose attention goes through transformers' ``AttentionInterface`` and whose math
  our attention function reproduces (:data:`ATTENTION_MODEL_TYPES`); others are reported with the reason.
* SwiGLU and GeGLU MLPs: found by what a module computes, as RMSNorm is. A candidate has children named
  ``gate_proj``, ``up_proj`` and ``down_proj`` (Llama, Mistral, Qwen2/Qwen3 and their copies; Gemma, Gemma 2, Gemma
  3), or ``gate_up_proj`` and ``down_proj`` (gate and up in one projection: Phi-3, Phi-4-mini, GLM, GLM-4); it is
  accepted when it has no other child than an activation (``act_fn``, or Llama 4's ``activation_fn``; in the second
  layout ``activation_fn`` or ``act_fn``; one of them), no parameter or buffer of its own, a forward that takes the
  input alone, and, run on CPU in fp32 with small random ``torch.nn.Linear`` stand-ins for the projections, gives
  ``down_proj(act(gate_proj(x)) * up_proj(x))``, or ``down_proj(silu(gate) * up)`` of ``gate, up =
  gate_up_proj(x).chunk(2, -1)`` (gate the first half), in training mode and in eval mode (a dropout that runs only in
  training is caught either way). ``act`` is what the activation module computes (:data:`ACTIVATION_FORMULAS`, checked
  against float64 on [-6, 6] and out to +-100): SiLU (a SwiGLU MLP: ``FusedSwiGLUMLP``), GELU with the tanh
  approximation (transformers' ``gelu_pytorch_tanh``, ``gelu_new``, ``gelu_fast``: Gemma's) or exact GELU (``gelu``) (a
  GeGLU MLP: ``FusedGeGLUMLP``); a module without an activation child is probed for SiLU. The ``gate_up_proj`` layout is
  SiLU only (no fused module computes GELU of a packed projection: such an MLP is refused, with that reason). A third
  layout is T5 v1.1's gated MLP (``T5DenseGatedActDense`` of T5 v1.1, Flan-T5 and mT5, UMT5's, LongT5's and the other
  copies): children ``wi_0`` (gate), ``wi_1`` (up) and ``wo`` (down), its activation ``act`` and one
  ``torch.nn.Dropout`` named ``dropout``, accepted when it gives ``wo(dropout(act(wi_0(x)) * wi_1(x)))`` with SiLU or
  GELU (``FusedT5DenseGatedActDense``, which calls the MLP's own dropout there). The probe puts a fixed mask in the
  dropout's place (zeros and 1 / 0.7, counting its calls), so the output shows that the forward calls it once, on
  the product; randomness of the forward's own still shows in training mode. A last run with an fp64 ``wo`` tells
  whether the forward casts the product to ``wo.weight``'s dtype (T5's rule, for an fp32 ``wo`` in a 16-bit model)
  or not (LongT5's copy). The probe's
  input gives gate and up of either sign beyond +-50 as well as small ones, so that a clamp (``swiglu_limit``) or
  another bend the formula lacks shows. MLPs of another activation (QuickGELU, ReLU, a clipped GELU), MLPs with
  dropout (but T5's, in its place) and MLPs whose activation has hooks (which the fused module would not run) are
  reported as not fused, with the reason;
  so are clamped SwiGLU MLPs (DeepseekV4, Glm5Next, Step3p7, BailingHybrid, MiniMax-M3's ``gate_up_proj`` MLP),
  refused up front where the module names its limit (``swiglu_limit``, ``limit``: not None) or its forward reads a
  config's ``swiglu_limit``/``swiglu_limits*``, and ``gate_up_proj`` MLPs of another kind (Zamba2's, with GELU, an
  adapter submodule and a ``layer_idx`` argument; Phi-4-multimodal's audio MLP, with a norm and dropout inside and up
  as the first half).
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
import torch.nn.functional as F

from ..ops._common import has_module_hooks

# model_type -> note. These call ALL_ATTENTION_FUNCTIONS with (module, q, k, v, mask, scaling=..., dropout=...)
# and compute softmax(scaling * q k^T + mask) v (with repeat_kv for GQA in Llama).
ATTENTION_MODEL_TYPES = {
    "bert": "BertSelfAttention / BertCrossAttention",
    "gpt2": "GPT2Attention (scaling includes scale_attn_by_inverse_layer_idx)",
    "gpt_neox": "GPTNeoXAttention",
    "llama": "LlamaAttention (GQA)",
    "opt": "OPTAttention (scales Q itself, scaling=1.0)",
}

# model_type -> why its attention is not fused.
ATTENTION_SKIP_REASONS = {
    "bloom": ("BloomAttention adds ALiBi with baddbmm and takes its softmax inline, not through transformers' "
              "AttentionInterface: the config is left as it is; each module has a row of kind attention of its own "
              "(FusedBloomAttention where fuse finds Bloom's formula)"),
    "mpt": ("MptAttention adds ALiBi and takes its softmax inline, not through transformers' AttentionInterface: the "
            "config is left as it is; each module has a row of kind attention of its own (FusedMptAttention where "
            "fuse finds MPT's formula)"),
}

EPS_ATTRIBUTES = ("variance_epsilon", "eps", "epsilon")


def probe_isolated(fn):
    """``fn`` (a probe) run apart from the caller's global torch state: torch's global random state saved and put back
    afterwards (the CPU generator's, and each CUDA device's where CUDA is initialised; it is not initialised for this),
    so that ``fuse``, ``fusion_report`` and a dry run leave the caller's random stream as it was (a probe runs a
    module's or a function's own code, and a forward in training mode may draw for a dropout); CPU autocast off and
    the CPU as the default device (``torch.device`` as a context), so that a probe called inside
    ``torch.autocast("cpu")``, ``with torch.device("meta")`` or accelerate's ``init_empty_weights`` computes as outside
    them (a review: under CPU autocast the gated-MLP probe's stand-in ran its GEMMs in bf16 and refused every gated
    MLP as a mismatch; on the meta device the RMSNorm probe raised). The probes' own inputs come from their own
    ``torch.Generator``, in their own dtypes, whatever ``torch.get_default_dtype()`` is."""

    @functools.wraps(fn)
    def isolated(*args, **kwargs):
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=devices), torch.autocast("cpu", enabled=False), torch.device("cpu"):
            return fn(*args, **kwargs)

    return isolated


def qkv_layout_problem(module: nn.Module, model: str, kinds: dict, attributes: tuple, heads: str) -> str | None:
    """Why ``module`` does not have the layout of ``model``'s attention ("Bloom", "MPT"), None where it has: its
    children of ``kinds`` (name: class; the first the query-key-value projection, ``torch.nn.Linear`` hidden -> 3 x
    hidden, the second the output projection, hidden -> any), no parameter of its own, the ``attributes`` (instance
    attributes) with ``<heads>`` x ``head_dim`` = ``hidden_size``. For the probes of Bloom's and MPT's attention."""
    kids = module._modules
    for name, kind in kinds.items():
        if not isinstance(kids.get(name), kind):
            return (f"{name} is {type(kids.get(name)).__name__}, not a torch.nn.{kind.__name__}: not {model}'s layout "
                    "(a wrapped projection, say)")
    if any(True for _ in module.parameters(recurse=False)):
        return f"it holds parameters of its own: not {model}'s layout"
    missing = [a for a in attributes if a not in module.__dict__]
    if missing:
        return f"it lacks {model}'s attribute(s) {', '.join(missing)}"
    h, d, width = getattr(module, heads), module.head_dim, module.hidden_size
    (qkv_name, qkv), (out_name, out) = ((n, kids[n]) for n in list(kinds)[:2])
    if not (isinstance(h, int) and isinstance(d, int) and h * d == width and qkv.in_features == width
            and qkv.out_features == 3 * width and out.in_features == width):
        return (f"{heads} {h} x head_dim {d}, hidden_size {width}, {qkv_name} {qkv.in_features} -> "
                f"{qkv.out_features}, {out_name} {out.in_features} -> {out.out_features}: not {model}'s sizes")
    return None


def run_attention_probe(setup, model: str, formula: str) -> str | None:
    """The numerical part of the probes of Bloom's and MPT's attention: ``setup()`` gives (``want_out``,
    ``want_probs``: the float64 formula's output and attention probabilities, ``calls``: functions of no argument,
    each a call of the module class's forward on the probe's stand-in and fp32 inputs, in one mode), and each call's
    result, taken without grad, must be ``(output, attention probabilities)`` of their shapes and values (within 1e-4,
    the probabilities 1e-5 absolute). Returns the reason of the first failure (``model``, "Bloom" or "MPT", and its
    ``formula`` in it; or what raised), None where every call passed. Never raises."""
    try:
        want_out, want_probs, calls = setup()
        for call in calls:
            with torch.no_grad():
                got = call()
            if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], torch.Tensor)
                    and isinstance(got[1], torch.Tensor) and got[0].shape == want_out.shape
                    and got[1].shape == want_probs.shape):
                return f"its forward does not return (output, attention probabilities) of {model}'s shapes"
            if not (torch.allclose(got[0].double(), want_out, rtol=1e-4, atol=1e-4)
                    and torch.allclose(got[1].double(), want_probs, rtol=1e-4, atol=1e-5)):
                return f"does not compute {model}'s ALiBi attention ({formula}; fp32 against float64)"
    except Exception as e:  # noqa: BLE001 - a probe never raises: the module is left unfused, with the reason
        return f"its forward raised on the probe's inputs: {type(e).__name__}: {e}"
    return None


def model_type_of(config) -> str | None:
    return getattr(config, "model_type", None) if config is not None else None


def is_attention_module(module: nn.Module) -> bool:
    """A leaf attention block: class name containing ``Attention`` and no child whose class name contains
    ``Attention`` (so ``BertAttention``, a wrapper around ``BertSelfAttention``, is not one)."""
    name = type(module).__name__
    if "Attention" not in name or name.endswith("Model"):
        return False
    return not any("Attention" in type(c).__name__ for c in module.children())


def attention_support(config, module: nn.Module | None = None) -> tuple[bool, str]:
    """Whether the attention of a model with ``config`` (and the given attention module) can use ours, and why."""
    mtype = model_type_of(config)
    if mtype in ATTENTION_SKIP_REASONS:
        return False, ATTENTION_SKIP_REASONS[mtype]
    if mtype not in ATTENTION_MODEL_TYPES:
        return False, f"model type {mtype!r} is not among those verified with the pipegoose attention function"
    if not hasattr(config, "_attn_implementation_internal") and not hasattr(config, "_attn_implementation"):
        return False, "this transformers version has no per-config attention selection"
    if mtype == "gpt2" and getattr(config, "reorder_and_upcast_attn", False):
        return False, "GPT-2 with reorder_and_upcast_attn computes its scores in fp32 outside the AttentionInterface"
    return True, ATTENTION_MODEL_TYPES[mtype]


def get_attn_implementation(config) -> str | None:
    value = getattr(config, "_attn_implementation_internal", None)
    if value is None:
        value = getattr(config, "_attn_implementation", None)
    return value


def set_attn_implementation(config, name: str) -> None:
    """Set the attention implementation on this config object only (not on sub-configs, not on other configs)."""
    if hasattr(config, "_attn_implementation_internal"):
        config._attn_implementation_internal = name
    else:  # pragma: no cover - very old transformers
        config._attn_implementation = name


def is_config(obj) -> bool:
    try:
        from transformers import PretrainedConfig
    except ImportError:  # pragma: no cover
        return False
    return isinstance(obj, PretrainedConfig)


def is_pretrained_model(obj) -> bool:
    """Whether ``obj`` is a transformers ``PreTrainedModel`` (False where transformers is not importable)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(obj, PreTrainedModel)


# --------------------------------------------------------------------------------------------------------------------
# RMSNorm probe
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RMSNormProbe:
    """Result of :func:`probe_rms_norm`: ``ok`` with the module's ``eps``, or not ``ok`` with the ``reason``.
    ``candidate`` says whether the module looked like a norm at all (worth a row in the report)."""

    ok: bool
    eps: float | None
    reason: str
    candidate: bool
    output_in_weight_dtype: bool = False   # T5 style: a half weight makes the output that dtype (see the probe)
    output_in_input_dtype: bool = False    # OLMo-2 style: one rounding, output in the input's dtype (see the probe)
    # Gemma style: the output is normalised(x) * (weight_offset + weight), weight_offset 1.0 (see the probe); with
    # output_in_input_dtype (Gemma's rounding), 0.0 for every other style
    weight_offset: float = 0.0
    # ok, but its epsilon is one the fused ops refuse (eps None): the TypeError / ValueError of eps_of, for fuse to
    # raise naming the module (the formula was checked with a good epsilon in its place)
    eps_error: Exception | None = None


def eps_attribute(module: nn.Module) -> str | None:
    """The name of the attribute that holds a norm's epsilon: the first of :data:`EPS_ATTRIBUTES` that the module has,
    not None, or None. Whether its value is one the fused ops take (a finite number >= 0: a Python or numpy number, a
    0-d tensor) is :func:`eps_of`'s to say. (Before session 60 a value other than a plain int or float, or a negative
    or non-finite one, counted as no attribute: fuse skipped the norm as having "no eps attribute", where numpy and
    tensor values are ones the module runs with, and a bad value deserved the error fuse documents.)"""
    for name in EPS_ATTRIBUTES:
        if getattr(module, name, None) is not None:
            return name
    return None


def eps_of(module: nn.Module) -> tuple[str | None, float | None, Exception | None]:
    """The module's epsilon attribute (:func:`eps_attribute`), its value as a float, and None; or the name, None and
    the TypeError / ValueError that :func:`pipegoose.nn.fusion.ops._common.eps_value` raises for its value (a string,
    a negative or non-finite number: the fused ops refuse it); (None, None, None) without one."""
    from ..ops._common import eps_value

    name = eps_attribute(module)
    if name is None:
        return None, None, None
    try:
        return name, eps_value(getattr(module, name), name=name), None
    except (TypeError, ValueError) as e:
        return name, None, e


def _stand_in(module: nn.Module) -> nn.Module:
    """A shallow stand-in for a probe: ``module``'s class, its instance attributes (lists, dicts and sets copied, so
    that a forward appending to one leaves the module as it was: a review), without a forward set on the instance
    (accelerate's hooks, a patch: that one must not run on the probe's CPU tensors)."""
    stand_in = object.__new__(type(module))
    stand_in.__dict__.update({k: copy.copy(v) if isinstance(v, (list, dict, set)) else v
                              for k, v in module.__dict__.items()})
    for name in ("forward", "_hf_hook", "_old_forward"):
        stand_in.__dict__.pop(name, None)
    return stand_in


def is_torch_rms_norm(module: nn.Module) -> bool:
    """Whether ``module`` computes ``torch.nn.RMSNorm``'s forward: an instance of it (or of a subclass) whose class
    does not override ``forward``. A subclass with its own forward is probed as any module."""
    return isinstance(module, nn.RMSNorm) and type(module).forward is nn.RMSNorm.forward


@probe_isolated
def probe_rms_norm(module: nn.Module) -> RMSNormProbe:
    """Check numerically whether ``module`` computes RMSNorm (see the module docstring), over whatever size its weight
    has: the model's hidden size, or a head's (Qwen3's ``q_norm`` / ``k_norm``) or a projection's.

    The module itself is not run: a shallow stand-in sharing its class and attributes, holding a random fp32 CPU
    weight, is, through ``forward`` directly (so the module's hooks do not fire and its parameters are untouched).
    Never raises: a forward that fails means "not an RMSNorm".
    """
    params = list(module.named_parameters(recurse=False))
    looks_like_norm = "norm" in type(module).__name__.lower()
    if is_torch_rms_norm(module):
        return RMSNormProbe(True, module.eps, "torch.nn.RMSNorm", True)
    # (a subclass with its own forward, Gemma's (1 + weight) written on nn.RMSNorm say, is probed as any module: a
    # review, session 77, found one fused as torch.nn.RMSNorm, its own forward's results silently replaced)
    if isinstance(module, nn.RMSNorm) and module.eps is None:
        return RMSNormProbe(False, None, f"a torch.nn.RMSNorm subclass with its own forward ({type(module).__name__}) "
                            "and eps=None (F.rms_norm's epsilon of each input's dtype): not probed", True)
    if isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or any(True for _ in module.children()):
        return RMSNormProbe(False, None, "not a leaf norm", False)
    if len(params) != 1:
        # (OLMo's parameter-free LayerNorm read "0 parameters (an RMSNorm has one weight)", as if it were an RMSNorm)
        return RMSNormProbe(False, None, f"{len(params)} parameters of its own: not an RMSNorm (one weight), and not a "
                            "torch.nn.LayerNorm", looks_like_norm)
    pname, weight = params[0]
    if pname != "weight":
        return RMSNormProbe(False, None, f"parameter is named '{pname}' (FusedRMSNorm's is 'weight': state_dict "
                            "keys would change)", looks_like_norm)
    if weight.dim() != 1:
        return RMSNormProbe(False, None, f"parameter '{pname}' is {weight.dim()}-D", looks_like_norm)
    looks_like_norm = looks_like_norm or eps_attribute(module) is not None
    extra = _extra_forward_arguments(type(module))
    if extra:
        # a gated norm (Bamba's, Mamba2's, GraniteMoeHybrid's RMSNormGated: forward(x, gate=None)): the probe's call
        # with x alone matches the formula, but the model passes more, which FusedRMSNorm does not take
        return RMSNormProbe(False, None, f"forward takes more than the input ({', '.join(extra)}): FusedRMSNorm takes "
                            "the input alone", looks_like_norm)
    return _probe_rms_norm(module, pname, weight, looks_like_norm)


@dataclass(frozen=True)
class GatedRMSNormProbe:
    """Result of :func:`probe_rms_norm_gated`: ``ok`` with the module's ``eps`` and form (``norm_before_gate``, the
    ``group_size`` it normalises over: None for the whole row), or not with the ``reason``; ``candidate``: the module
    looked like a gated RMSNorm (worth a row in the report)."""

    ok: bool
    eps: float | None
    reason: str
    candidate: bool
    norm_before_gate: bool = True
    group_size: int | None = None


def gated_rms_norm_candidate(module: nn.Module, parametrized: bool = False) -> bool:
    """Whether ``module`` looks like a gated RMSNorm (``forward(hidden_states, gate)``: transformers' ``RMSNormGated``
    of Qwen3-Next, Qwen3.5, Mamba2, Bamba, ...): a leaf with one 1-D ``weight`` whose forward takes a ``gate`` after
    the input. ``parametrized``: ``module`` is one whose weight ``torch.nn.utils.parametrize`` computes (its
    parametrizations its only child; the weight read through them)."""
    if isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)):
        return False
    if parametrized:
        if set(module._modules) != {"parametrizations"} or "weight" not in module.parametrizations:
            return False
        weight = getattr(module, "weight", None)
        return (isinstance(weight, torch.Tensor) and weight.dim() == 1 and not list(module._parameters)
                and _extra_forward_arguments(type(module))[:1] == ["gate"])
    if any(True for _ in module.children()):
        return False
    params = list(module.named_parameters(recurse=False))
    return (len(params) == 1 and params[0][0] == "weight" and params[0][1].dim() == 1
            and _extra_forward_arguments(type(module))[:1] == ["gate"])


def _gated_reference(x: torch.Tensor, gate: torch.Tensor | None, w: torch.Tensor, eps: float, first: bool = True,
                     group: int | None = None) -> torch.Tensor:
    """The gated RMSNorms op ``rms_norm_gated`` computes (:func:`pipegoose.nn.fusion.ops.rms_norm_gated.
    rms_norm_gated_reference`, transformers' formulas): Qwen3-Next's (``first``: the norm in fp32, rounded to x's
    dtype, times the weight, times ``silu`` of the gate in fp32, rounded to x's dtype) or Mamba2's (the gate first in
    fp32, the norm over groups of ``group`` values, rounded to x's dtype, times the weight); ``gate`` None (Mamba2's
    call without one): the grouped norm alone."""
    from ..ops.rms_norm_gated import rms_norm_gated_reference

    n = x.shape[-1]
    if gate is None:
        xf = x.float()
        v = xf.unflatten(-1, (n // (group or n), group or n))
        h = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
        return w * h.to(x.dtype)
    return rms_norm_gated_reference(x, gate, w, eps, group or n, first)


def _group_attribute(module: nn.Module, n: int) -> int | None:
    """The module's ``group_size`` (Mamba2's and its copies') where it is an int dividing ``n`` (None otherwise: the
    whole row)."""
    from ..ops._common import integer_or_none

    g = integer_or_none(module.__dict__.get("group_size", getattr(type(module), "group_size", None)))
    if g is None or not 1 <= g <= n or n % g:
        return None
    return None if g == n else g


def _gated_form_differs(stand_in: nn.Module, module: nn.Module, n: int, eps: float, first: bool, group: int | None,
                        seed: int) -> str | None:
    """None where ``stand_in`` computes the form (``first``, ``group``) bit for bit on random inputs (x, gate and
    weight: fp32, bf16, fp16, bf16 x with an fp32 weight, and fp32 x with a bf16 gate and weight, what a bf16 Mamba2
    mixer passes; both training modes), else what differs."""
    gen = torch.Generator().manual_seed(seed)
    f32, b16 = torch.float32, torch.bfloat16
    forms = ((f32, f32, f32), (b16, b16, b16), (torch.float16, torch.float16, torch.float16), (b16, b16, f32),
             (f32, b16, b16))
    for training in (module.training, not module.training):
        object.__setattr__(stand_in, "training", training)
        for dt, gdt, wdt in forms:
            w = (torch.rand(n, generator=gen) + 0.5).to(wdt)
            x = (torch.randn(2, 3, n, generator=gen) + 0.5).to(dt)
            gate = (torch.randn(2, 3, n, generator=gen) * 3).to(gdt)
            object.__setattr__(stand_in, "_parameters", {"weight": nn.Parameter(w, requires_grad=False)})
            with torch.no_grad():
                y = stand_in.forward(x, gate)
            want = _gated_reference(x, gate, w, eps, first, group)
            if not isinstance(y, torch.Tensor) or y.dtype != want.dtype or not torch.equal(y, want):
                return f"{str(dt)[6:]} x with a {str(gdt)[6:]} gate and a {str(wdt)[6:]} weight"
    object.__setattr__(stand_in, "training", module.training)
    return None


@probe_isolated
def probe_rms_norm_gated(module: nn.Module) -> GatedRMSNormProbe:
    """Whether ``module`` computes one of the gated RMSNorms of op ``rms_norm_gated``, bit for bit, over its weight's
    size: Qwen3-Next's and Qwen3.5's (the norm, then ``silu`` of the gate) or Mamba2's and its copies' (Bamba,
    Nemotron-H, Zamba2, Granite-4: ``silu`` of the gate first, then the norm over groups of its ``group_size``
    attribute's values) (:func:`_gated_reference`). A shallow stand-in of it (its class and attributes, a random
    weight; hooks not run) on random CPU inputs with a nonzero mean, x and gate in fp32, bf16 and fp16 with a weight of
    their dtype, and bf16 x with an fp32 weight, in both training modes, then fp32 inputs whose mean square is near eps
    (a forward that adds its epsilon elsewhere, clamps, or uses another value than its attribute agrees on the
    others). A norm that gates with a sigmoid or multiplies by the weight in fp32 (Kimi Linear's, Falcon-H1's) is
    refused with the reason, as is one whose forward fails. A ``gate`` with a default (its model may leave it out):
    refused for the norm first; for the gate first (Mamba2's ``gate=None``) the call without it must be the grouped
    norm alone, which the fused module computes then. Never raises."""
    if not gated_rms_norm_candidate(module):
        return GatedRMSNormProbe(False, None, "not a leaf with one 1-D weight and forward(hidden_states, gate)", False)
    if list(module.buffers(recurse=False)):
        return GatedRMSNormProbe(False, None, "has buffers", True)
    extra = _extra_forward_arguments(type(module))[1:]
    if extra:   # (its model may pass them, which FusedRMSNormGated does not take: a breaker's crash)
        return GatedRMSNormProbe(False, None, f"forward takes more than (hidden_states, gate) ({', '.join(extra)}): "
                                 "FusedRMSNormGated takes those two alone", True)
    eps_name, eps, bad_eps = eps_of(module)
    if eps_name is None or bad_eps is not None:
        why = f"no eps attribute ({', '.join(EPS_ATTRIBUTES)})" if eps_name is None else str(bad_eps)
        return GatedRMSNormProbe(False, None, why, True)
    n = module.weight.numel()
    stand_in = _stand_in(module)
    object.__setattr__(stand_in, "_buffers", {})
    object.__setattr__(stand_in, "_modules", {})
    group = _group_attribute(module, n)
    tried = []
    form = None
    # (the gate first over the whole row too: transformers' Mamba2 norms ignored group_size before a fix, 5.17 among
    # them: a GPU run of session 79 found 5.17's Mamba2RMSNormGated normalising rows of 8192 set to groups of 1024)
    for first, g in ((True, None), (False, group)) + (((False, None),) if group else ()):
        try:
            differs = _gated_form_differs(stand_in, module, n, eps, first, g, 4321)
        except Exception as exc:  # noqa: BLE001 - any failure means we cannot vouch for the module
            return GatedRMSNormProbe(False, None, f"probe forward failed: {type(exc).__name__}: {exc}", True)
        if differs is None:
            form = (first, g)
            break
        tried.append(("the norm first" if first else f"the gate first{f' over groups of {g}' if g else ''}")
                     + f" differs at {differs}")
    if form is None:
        return GatedRMSNormProbe(
            False, None, "computes another gated norm than Qwen3-Next's (the norm, then silu of the gate) and Mamba2's "
            f"(silu of the gate, then the norm{f' over groups of {group}' if group else ''}) as op rms_norm_gated "
            f"computes them (probed: {'; '.join(tried)}): a sigmoid gate, an fp32 weight product, or other rounding",
            True)
    first, group = form
    # eps: the inputs above (mean square ~1.3) barely see it; near it (or, with eps 0, tiny inputs: the formula is
    # then scale-invariant) a forward that adds it elsewhere, clamps or uses another value than its attribute differs
    gen = torch.Generator().manual_seed(8765)
    w = torch.rand(n, generator=gen) + 0.5
    object.__setattr__(stand_in, "_parameters", {"weight": nn.Parameter(w, requires_grad=False)})
    for mean_square in ((eps, 0.1 * eps) if eps > 0 else (1e-6, 1e-12, 1e-18)):
        gate = torch.randn(2, 3, n, generator=gen) * 3
        x = torch.randn(2, 3, n, generator=gen) + 0.5
        # the normalised values' mean square (of x, or of x * silu(gate) for the gate first) set to mean_square
        # (scaling x scales x * silu(gate) alike)
        g = group or n
        v = (x if first else x * F.silu(gate)).unflatten(-1, (n // g, g))
        x = (x.unflatten(-1, (n // g, g)) * torch.sqrt(mean_square / v.pow(2).mean(-1, keepdim=True))).flatten(-2)
        try:
            with torch.no_grad():
                y = stand_in.forward(x, gate)
        except Exception as exc:  # noqa: BLE001 - any failure means we cannot vouch for the module
            return GatedRMSNormProbe(False, None, f"probe forward failed on a small input: {type(exc).__name__}: "
                                     f"{exc}", True)
        from ..ops.rms_norm_gated import rms_norm_gated_kernel_math

        want = rms_norm_gated_kernel_math(x.double(), gate.double(), w.double(), eps, group or n, first, torch.float64)
        if (not isinstance(y, torch.Tensor) or y.shape != x.shape
                or not torch.allclose(y.double(), want, atol=1e-5, rtol=1e-3)):
            return GatedRMSNormProbe(False, None, f"on inputs whose mean square is near eps ({mean_square:.3g}) it "
                                     f"computes otherwise than with its eps attribute ({eps}) under the square root "
                                     "(probed): another epsilon, or one added elsewhere", True)
    try:
        gate_param = inspect.signature(type(module).forward).parameters["gate"]
    except (TypeError, ValueError, KeyError):
        gate_param = None
    if gate_param is not None and gate_param.default is not inspect.Parameter.empty:
        if first or gate_param.default is not None:
            return GatedRMSNormProbe(False, None, f"forward(hidden_states, gate={gate_param.default!r}): its model may "
                                     "call it without the gate, which FusedRMSNormGated needs with the norm first",
                                     True)
        x = torch.randn(2, 3, n, generator=gen) + 0.5
        try:
            with torch.no_grad():
                y = stand_in.forward(x)
        except Exception as exc:  # noqa: BLE001
            return GatedRMSNormProbe(False, None, f"probe forward without the gate failed: {type(exc).__name__}: "
                                     f"{exc}", True)
        if not isinstance(y, torch.Tensor) or not torch.equal(y, _gated_reference(x, None, w, eps, first, group)):
            return GatedRMSNormProbe(False, None, "without the gate (its default, None) it computes another norm than "
                                     "the grouped RMSNorm (probed)", True)
    if first:
        return GatedRMSNormProbe(True, eps, "the norm, then silu of the gate (Qwen3-Next's, probed)", True)
    where = f"over groups of {group}" if group else "over the row"
    return GatedRMSNormProbe(True, eps, f"silu of the gate, then the norm {where} (Mamba2's, probed)", True,
                             norm_before_gate=False, group_size=group)


def _extra_forward_arguments(cls: type) -> list[str]:
    """The parameters of ``cls.forward`` after ``self`` and the input (``*args`` and ``**kwargs`` included); empty
    when the signature cannot be read."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[2:]
    except (TypeError, ValueError):
        return []
    return [("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "") + p.name for p in params]


def _forward_or_failure(stand_in: nn.Module, x: torch.Tensor, what: str, candidate: bool) -> Any:
    """``stand_in.forward(x)`` without grad, or the not-ok probe result saying that it failed (any exception: a
    module we cannot run we cannot vouch for)."""
    try:
        with torch.no_grad():
            return stand_in.forward(x)
    except Exception as exc:  # noqa: BLE001
        return RMSNormProbe(False, None, f"probe forward {what} failed: {type(exc).__name__}: {exc}", candidate)


def _probe_rms_norm(module: nn.Module, pname: str, weight: torch.Tensor, looks_like_norm: bool) -> RMSNormProbe:
    """The numerical part of :func:`probe_rms_norm`, for a leaf module with one 1-D parameter ``pname``."""
    if list(module.buffers(recurse=False)):
        return RMSNormProbe(False, None, "has buffers", looks_like_norm)
    eps_name, eps, bad_eps = eps_of(module)
    if eps_name is None:
        return RMSNormProbe(False, None, f"no eps attribute ({', '.join(EPS_ATTRIBUTES)})", looks_like_norm)

    n = weight.numel()
    gen = torch.Generator().manual_seed(1234)
    w = torch.rand(n, generator=gen, dtype=torch.float32) + 0.5
    x = torch.randn(2, 3, n, generator=gen, dtype=torch.float32) + 0.5   # nonzero mean: rejects mean-subtracting norms
    # (the class's computation, not a forward set on the instance: fuse() leaves such modules alone anyway)
    stand_in = _stand_in(module)
    if bad_eps is not None:
        # an epsilon the fused ops refuse: the formula is checked with a good one in its place, and an RMSNorm is
        # reported with bad_eps, for fuse to raise it naming the module (as it does for nn.LayerNorm's) and for
        # FusedRMSNorm.from_module to take an eps= given instead
        # (an instance attribute shadows a plain class attribute too; a property it does not: a review)
        if hasattr(getattr(type(module), eps_name, None), "__set__"):
            return RMSNormProbe(False, None, f"{bad_eps} (a property of its class: the probe cannot try another)",
                                looks_like_norm)
        eps = stand_in.__dict__[eps_name] = 1e-6
    object.__setattr__(stand_in, "_parameters", {pname: nn.Parameter(w, requires_grad=False)})
    object.__setattr__(stand_in, "_buffers", {})
    object.__setattr__(stand_in, "_modules", {})
    try:
        with torch.no_grad():
            y = stand_in.forward(x)
    except Exception as exc:  # noqa: BLE001 - any failure means we cannot vouch for the module
        return RMSNormProbe(False, None, f"probe forward failed: {type(exc).__name__}: {exc}", looks_like_norm)
    if not isinstance(y, torch.Tensor) or y.shape != x.shape or y.device != x.device:
        return RMSNormProbe(False, None, "probe output has another shape or device", looks_like_norm)
    # the other training mode gives the same (a dropout in training only; session 70's review of the weightless probe)
    other = "eval" if module.training else "training"
    object.__setattr__(stand_in, "training", not module.training)
    try:
        y_other = _forward_or_failure(stand_in, x, f"in {other} mode", looks_like_norm)
    finally:
        object.__setattr__(stand_in, "training", module.training)
    if isinstance(y_other, RMSNormProbe):
        return y_other
    if not isinstance(y_other, torch.Tensor) or y_other.shape != y.shape or not torch.equal(y_other, y):
        return RMSNormProbe(False, None, f"its output in {other} mode differs from that in its current mode (a "
                            "dropout?): FusedRMSNorm computes the same in both", looks_like_norm)
    # a weight that broadcasts (one element over rows of any width): FusedRMSNorm normalizes over the weight's size
    # only, so a module that also runs on other widths is not one it can stand in for
    try:
        with torch.no_grad():
            stand_in.forward(torch.randn(2, 3, n + 1, generator=gen, dtype=torch.float32))
    except Exception:  # noqa: BLE001 - the expected outcome: the weight does not fit the wider rows
        pass
    else:
        return RMSNormProbe(False, None, f"its weight of {n} element(s) broadcasts over rows of another width: "
                            "FusedRMSNorm normalizes over the weight's size only", looks_like_norm)
    xd = x.double()
    normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    # the weight as it scales the output: w itself, or Gemma's (1 + w) (GemmaRMSNorm's weight starts at zeros). The
    # probe's w (0.5..1.5) keeps the two apart: (1 + w) / w is at least 1.67. Another offset (2 + w, say) matches
    # neither and is refused.
    for offset in (0.0, 1.0):
        ref = normed * (w.double() + offset)
        if torch.allclose(y.double(), ref, atol=1e-5, rtol=1e-4):
            break
    else:
        err = (y.double() - normed * w.double()).abs().max().item()
        return RMSNormProbe(False, None, f"output differs from the RMSNorm formula (max abs diff {err:.3g}), and from "
                            "Gemma's x * rsqrt(mean(x^2) + eps) * (1 + weight)", looks_like_norm)
    # eps: the input above (mean square ~1.3) barely sees it. A norm that adds eps elsewhere (outside the square root)
    # or whose forward uses another value than its eps attribute agrees there and differs on inputs whose mean square
    # is near eps, where FusedRMSNorm (which takes the attribute) would then be silently wrong.
    # With eps 0 the formula is scale-invariant: tiny inputs expose an eps (or a clamp) hidden in the forward.
    for mean_square in ((eps, 0.1 * eps) if eps > 0 else (1e-6, 1e-12, 1e-18)):
        xs = x * torch.sqrt(mean_square / x.pow(2).mean(-1, keepdim=True))
        ys = _forward_or_failure(stand_in, xs, "on a small input", looks_like_norm)
        if isinstance(ys, RMSNormProbe):
            return ys
        xsd = xs.double()
        ref_s = xsd * torch.rsqrt(xsd.pow(2).mean(-1, keepdim=True) + eps) * (w.double() + offset)
        if (not isinstance(ys, torch.Tensor) or ys.shape != x.shape
                or not torch.allclose(ys.double(), ref_s, atol=1e-5, rtol=1e-3)):
            err = (ys.double() - ref_s).abs().max().item() if isinstance(ys, torch.Tensor) and \
                ys.shape == x.shape else float("nan")
            return RMSNormProbe(False, None, f"output differs from the RMSNorm formula with eps={eps:g} (its "
                                f"eps attribute) on inputs whose mean square is {mean_square:.3g} (max abs diff "
                                f"{err:.3g}): eps is used otherwise", looks_like_norm)
    if offset:
        return _gemma_rounding(stand_in, pname, x, w, eps, bad_eps, looks_like_norm)
    # Rounding (bf16 input and weight): Llama-style norms round the normalised input to the input's dtype, then
    # multiply by the weight in that dtype (two roundings), which FusedRMSNorm(cast_before_weight=True) reproduces;
    # OLMo-2-style norms (Olmo2RMSNorm, GptOssRMSNorm, Gemma3nRMSNorm, ...: 26 classes of transformers 5.24) multiply
    # in fp32 and round once to the input's dtype, whatever the weight's: FusedRMSNorm(output_in_input_dtype=True).
    # A norm that rounds once but returns another dtype with a bf16 input and an fp32 weight matches no rule.
    x16 = x.to(torch.bfloat16)
    w16 = w.to(torch.bfloat16)
    object.__setattr__(stand_in, "_parameters", {pname: nn.Parameter(w16, requires_grad=False)})
    y16 = _forward_or_failure(stand_in, x16, "in bf16", looks_like_norm)
    if isinstance(y16, RMSNormProbe):
        return y16
    x32 = x16.float()
    h = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    twice = w16 * h.to(torch.bfloat16)
    once = (w16.float() * h).to(torch.bfloat16)
    if not isinstance(y16, torch.Tensor) or y16.shape != x.shape or y16.dtype != torch.bfloat16:
        return RMSNormProbe(False, None, "with bf16 input and weight the probe output is not a bf16 tensor of the "
                            "input's shape", looks_like_norm)
    if int((y16 != once).sum()) < int((y16 != twice).sum()):
        object.__setattr__(stand_in, "_parameters", {pname: nn.Parameter(w, requires_grad=False)})
        try:
            with torch.no_grad():
                mixed = stand_in.forward(x16).dtype
        except Exception as exc:  # noqa: BLE001
            return RMSNormProbe(False, None, f"probe forward with bf16 input and an fp32 weight failed: "
                                f"{type(exc).__name__}: {exc}", looks_like_norm)
        if mixed != torch.bfloat16:
            return RMSNormProbe(False, None, f"rounds once like F.rms_norm, but with bf16 input and an fp32 weight "
                                f"it returns {mixed} (OLMo-2 style returns bfloat16; no FusedRMSNorm rule for it)",
                                looks_like_norm)
        return RMSNormProbe(True, None if bad_eps else eps, "probe output equals the formula; one rounding, output in "
                            "the input's dtype (OLMo-2 style)", True, output_in_input_dtype=True, eps_error=bad_eps)
    # Mixed dtypes (fp32 input, bf16 weight): Llama-style norms return promote(weight, input) = fp32; T5-style ones
    # cast the normalised input to a half weight's dtype first and return bf16. FusedRMSNorm follows the module.
    object.__setattr__(stand_in, "_parameters", {pname: nn.Parameter(w.to(torch.bfloat16), requires_grad=False)})
    try:
        with torch.no_grad():
            mixed = stand_in.forward(x).dtype
    except Exception as exc:  # noqa: BLE001
        return RMSNormProbe(False, None, f"probe forward with a bf16 weight failed: {type(exc).__name__}: {exc}",
                            looks_like_norm)
    if mixed not in (torch.float32, torch.bfloat16):
        return RMSNormProbe(False, None, f"with fp32 input and a bf16 weight it returns {mixed} (expected float32, "
                            f"Llama style, or bfloat16, T5 style)", looks_like_norm)
    t5 = mixed == torch.bfloat16
    return RMSNormProbe(True, None if bad_eps else eps, "probe output equals the formula"
                        + ("; output in a half weight's dtype (T5 style)" if t5 else ""), True, t5, eps_error=bad_eps)


def _gemma_rounding(stand_in: nn.Module, pname: str, x: torch.Tensor, w: torch.Tensor, eps: float,
                    bad_eps: Exception | None, looks_like_norm: bool) -> RMSNormProbe:
    """The rounding part of :func:`_probe_rms_norm` for a module that computes ``normalised(x) * (1 + weight)`` in
    fp32 (``x`` [2, 3, n] and ``w`` [n], fp32, the probe's): accepted (``weight_offset`` 1.0, ``output_in_input_dtype``)
    where it rounds as GemmaRMSNorm does, ``(normalised(x.float()) * (1.0 + weight.float())).type_as(x)``: fp32 math,
    one rounding to the input's dtype, whatever the weight's, which is what FusedRMSNorm computes with the op's fp32
    weight ``weight.float() + 1``. Checked with bf16 input and weight (against ``1 + w`` summed in bf16, and against
    the normalised input rounded to bf16 before the product, Llama's rounding: such a norm is refused, as FusedRMSNorm
    would round it otherwise), bf16 input with an fp32 weight (a bf16 output, one rounding) and fp32 input with a bf16
    weight (an fp32 output, ``1 + w`` in fp32)."""

    def run(xi: torch.Tensor, wi: torch.Tensor, what: str) -> torch.Tensor | RMSNormProbe:
        object.__setattr__(stand_in, "_parameters", {pname: nn.Parameter(wi, requires_grad=False)})
        y = _forward_or_failure(stand_in, xi, what, looks_like_norm)
        if isinstance(y, torch.Tensor) and (y.shape != x.shape or y.dtype != xi.dtype):
            return RMSNormProbe(False, None, f"computes Gemma's (1 + weight) formula, but {what} its output is not a "
                                f"{xi.dtype} tensor of the input's shape (Gemma's is in the input's dtype)",
                                looks_like_norm)
        return y

    x16, w16 = x.to(torch.bfloat16), w.to(torch.bfloat16)
    x32 = x16.float()
    h = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    for xi, wi, what in ((x16, w16, "with bf16 input and weight"), (x16, w, "with bf16 input and an fp32 weight")):
        y = run(xi, wi, what)
        if isinstance(y, RMSNormProbe):
            return y
        once = (h * (1.0 + wi.float())).to(torch.bfloat16)
        # the roundings FusedRMSNorm does not reproduce: 1 + w summed in bf16, and Llama's normalised input rounded
        # to bf16 before the product (in bf16 with a bf16 weight)
        others = [(h * (1 + wi).float()).to(torch.bfloat16), (1 + wi) * h.to(torch.bfloat16)]
        off = int((y != once).sum())
        closest = min(int((y != o.to(torch.bfloat16)).sum()) for o in others)
        # Gemma's own module gives `once` bit for bit (the same fp32 ops); a few flips are left for a forward that
        # computes the same in other fp32 ops
        if off > max(1, y.numel() // 64) or (off and off >= closest):
            return RMSNormProbe(False, None, f"computes Gemma's (1 + weight) formula, but {what} its output differs "
                                f"from Gemma's rounding (fp32 math, one rounding to the input's dtype) in {off} of "
                                f"{y.numel()} elements: FusedRMSNorm would round it otherwise", looks_like_norm)
    y = run(x, w16, "with fp32 input and a bf16 weight")
    if isinstance(y, RMSNormProbe):
        return y
    xd = x.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * (w16.double() + 1.0)
    if not torch.allclose(y.double(), ref, atol=1e-6, rtol=1e-5):
        err = (y.double() - ref).abs().max().item()
        return RMSNormProbe(False, None, "computes Gemma's (1 + weight) formula, but with fp32 input and a bf16 weight "
                            f"its output differs from it in fp32 (max abs diff {err:.3g}; 1 + weight rounded to the "
                            "weight's dtype?): FusedRMSNorm would round it otherwise", looks_like_norm)
    return RMSNormProbe(True, None if bad_eps else eps, "probe output equals the formula with (1 + weight); one "
                        "rounding, output in the input's dtype (Gemma style)", True, output_in_input_dtype=True,
                        weight_offset=1.0, eps_error=bad_eps)


# --------------------------------------------------------------------------------------------------------------------
# Norms without parameters
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightlessNormProbe:
    """Result of :func:`probe_weightless_norm`: ``ok`` with the ``kind`` (``rms_norm`` or ``layer_norm``), ``eps``
    and ``width`` (the size of the last dimension it normalizes; None: rows of any width), or not ``ok`` with the
    ``reason`` (``kind`` then the kind it looked like, where the probe got that far, else None). ``eps_attr`` names
    the attribute ``eps`` was read from, None where the probe measured it (OLMo's LayerNorm has its 1e-5 in its
    forward). ``candidate``: whether the module looked like a norm at all (worth a row in the report).
    ``output_in_input_dtype``: the module returns a 16-bit input's dtype under CUDA autocast too (it casts back, as
    OLMo's and Gemma 4's do), else the fp32 that ``F.layer_norm`` / ``F.rms_norm`` give there. ``eps_error``: ok,
    but its epsilon attribute holds a value the fused ops refuse (``eps`` None; the formula was checked with 1e-6 in
    its place): the error, for fuse to raise naming the module, as for an RMSNorm with a weight."""

    ok: bool
    kind: str | None
    eps: float | None
    width: int | None
    reason: str
    candidate: bool
    eps_attr: str | None = None
    output_in_input_dtype: bool = True
    eps_error: Exception | None = None


# the scales (mean square, or variance) at which the probe reads an epsilon that the module does not name from its
# output: the first at which it shows (more than 1e-3 of the scale) is used; below the last, eps is taken as 0
_EPS_SCALES = (1e-8, 1e-16, 1e-24)


def _weightless_ref(x: torch.Tensor, kind: str, eps: float) -> torch.Tensor:
    """The float64 formula of a norm of ``kind`` without parameters over the last dimension of ``x``."""
    xd = x.double()
    if kind == "layer_norm":
        xd = xd - xd.mean(-1, keepdim=True)
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)


def _proportional(y: torch.Tensor, x: torch.Tensor, kind: str) -> bool:
    """Whether each row of ``y`` is a positive multiple of the row of ``x`` (centred for a LayerNorm), whatever the
    multiple: the formula of ``kind`` up to its epsilon, which the probe checks afterwards."""
    c = x.double() - x.double().mean(-1, keepdim=True) if kind == "layer_norm" else x.double()
    yd = y.double()
    s = (yd * c).sum(-1, keepdim=True) / c.pow(2).sum(-1, keepdim=True)
    return bool((s > 0).all()) and torch.allclose(yd, s * c, atol=1e-5, rtol=1e-4)


def _measured_eps(stand_in: nn.Module, x: torch.Tensor, kind: str) -> float | None:
    """The epsilon ``stand_in`` (a norm of ``kind`` without parameters) adds to the mean square (the variance),
    read from its fp32 output on ``x`` scaled down to the statistics :data:`_EPS_SCALES`: the output is ``c /
    sqrt(v + eps)`` (``c`` the input, centred for a LayerNorm; ``v`` its statistic), so the least-squares scale ``s``
    of the output on ``c`` gives ``eps = 1 / s**2 - v``, to about 1e-6 of eps where eps is far above ``v``. It is
    rounded to three significant digits where that is within 1e-4 of it (1e-05, 1e-06) and kept as read otherwise
    (torch's fp32 machine epsilon, say); the formula with it is checked afterwards. None where a forward fails."""
    c = x.double() - x.double().mean(-1, keepdim=True) if kind == "layer_norm" else x.double()
    for v in _EPS_SCALES:
        xs = (x.double() * math.sqrt(v) / c.pow(2).mean(-1, keepdim=True).sqrt()).float()
        try:
            with torch.no_grad():
                y = stand_in.forward(xs)
        except Exception:  # noqa: BLE001 - the caller reports a failed forward
            return None
        if not isinstance(y, torch.Tensor) or y.shape != x.shape:
            return None
        cs = xs.double() - xs.double().mean(-1, keepdim=True) if kind == "layer_norm" else xs.double()
        vs = cs.pow(2).mean(-1)
        s = (y.double() * cs).sum(-1) / cs.pow(2).sum(-1)
        eps = float((1.0 / s.pow(2) - vs).median())
        if eps > 1e-3 * v:
            rounded = float(f"{eps:.3g}")
            return rounded if abs(rounded - eps) <= 1e-4 * eps else eps
    return 0.0


class _CudaAutocastNorms(torch.overrides.TorchFunctionMode):
    """CUDA autocast's rule for the norm ops, on the CPU (whose autocast leaves them in a 16-bit input's dtype): the
    16-bit tensors given to ``layer_norm``, ``rms_norm`` and ``group_norm`` while CPU autocast is on are cast to fp32
    first, so that they return fp32, as under ``torch.autocast("cuda")``. The probe of norms without parameters runs
    the module under it to learn whether it casts back to the input's dtype (OLMo's, Gemma 4's) or returns what the op
    gives there."""

    FUNCS = frozenset({torch.nn.functional.layer_norm, torch.layer_norm, torch.nn.functional.rms_norm,
                       torch.rms_norm, torch.nn.functional.group_norm, torch.group_norm})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FUNCS and torch.is_autocast_enabled("cpu"):   # (not in a region that turns autocast off)
            def up(a):
                return a.float() if isinstance(a, torch.Tensor) and a.dtype in (torch.float16, torch.bfloat16) else a
            args, kwargs = tuple(up(a) for a in args), {k: up(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _stand_in_differs(stand_in: nn.Module, module: nn.Module, xi: torch.Tensor, what: str, ref: torch.Tensor,
                      atol: float, rtol: float, mode: bool | None, candidate: bool) -> str | None:
    """A norm probe's check of the stand-in's fp32 output on ``xi`` (in training mode ``mode``; None: the module's)
    against the float64 ``ref`` (NaN where ``ref`` has NaN): None where it agrees, else the reason (the forward's
    failure, or the largest difference, in words that follow "output differs from the formula ...")."""
    if mode is not None:
        object.__setattr__(stand_in, "training", mode)
    try:
        yi = _forward_or_failure(stand_in, xi, what, candidate)
    finally:
        object.__setattr__(stand_in, "training", module.training)
    if isinstance(yi, RMSNormProbe):
        return yi.reason
    if (not isinstance(yi, torch.Tensor) or yi.shape != xi.shape
            or not torch.allclose(yi.double(), ref, atol=atol, rtol=rtol, equal_nan=True)):
        err = ((yi.double() - ref).abs().max().item() if isinstance(yi, torch.Tensor) and yi.shape == xi.shape
               else float("nan"))
        return f"{what} (max abs diff {err:.3g})"
    return None


def _stand_in_backward(stand_in: nn.Module, x: torch.Tensor, gen: torch.Generator):
    """A norm probe's backward: the stand-in's forward on a copy of ``x`` that requires grad, back from a random
    gradient of ``gen``: (that copy, holding its gradient, and the gradient), or (the failure's reason, None)."""
    xg = x.clone().requires_grad_()
    dy = torch.randn(x.shape, generator=gen, dtype=torch.float32)
    try:
        with torch.enable_grad():
            stand_in.forward(xg).backward(dy)
    except Exception as exc:  # noqa: BLE001
        return f"probe backward failed: {type(exc).__name__}: {exc}", None
    return xg, dy


def _autocast_dtypes(stand_in: nn.Module, x: torch.Tensor) -> list[torch.dtype] | str:
    """The stand-in's output dtypes for fp32 ``x`` and its bf16 copy under CPU autocast (bf16) with CUDA autocast's
    rule for the norm ops (:class:`_CudaAutocastNorms`), or the failure's reason."""
    dtypes = []
    for xi in (x, x.to(torch.bfloat16)):
        try:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), _CudaAutocastNorms():
                dtypes.append(stand_in.forward(xi).dtype)
        except Exception as exc:  # noqa: BLE001
            return f"probe forward under autocast failed: {type(exc).__name__}: {exc}"
    if dtypes[0] != torch.float32 or dtypes[1] not in (torch.bfloat16, torch.float32):
        return (f"under autocast (bf16) it returns {dtypes[0]} for an fp32 input and {dtypes[1]} for a bf16 one (the "
                "fused norms: the input's dtype, or fp32 as F.layer_norm / F.rms_norm)")
    return dtypes


def _width_of(module: nn.Module) -> int | None | str:
    """The width a module's ``normalized_shape`` names (an int, a numpy integer, or a sequence of one), None without
    one, or the refusal's reason for another shape."""
    shape = getattr(module, "normalized_shape", None)
    if shape is None:
        return None
    if not isinstance(shape, (tuple, list, torch.Size)):
        shape = (shape,)
    try:
        sizes = [operator.index(d) for d in shape if not isinstance(d, bool)]
    except TypeError:
        sizes = []
    if len(sizes) != 1 or len(shape) != 1 or sizes[0] < 2:
        return f"normalized_shape is {shape!r}: the probe takes one size of 2 or more"
    return sizes[0]


@probe_isolated
def probe_weightless_norm(module: nn.Module) -> WeightlessNormProbe:
    """Check numerically whether ``module``, a leaf module without parameters or buffers whose class name says
    ``norm`` (or that has an epsilon attribute, :data:`EPS_ATTRIBUTES`), computes RMSNorm (``x * rsqrt(mean(x^2) +
    eps)``: Gemma 4's ``v_norm`` and its router's ``norm``, ``Gemma4RMSNorm(with_scale=False)``) or LayerNorm (``(x -
    mean) * rsqrt(var + eps)``: OLMo's ``OlmoLayerNorm``) over its last dimension, in fp32 with one rounding to the
    input's dtype, as the fused norms compute it.

    ``eps`` is the module's epsilon attribute where it has one, else read from its output (OLMo's 1e-5 is a literal
    in its forward: :func:`_measured_eps`). The checks, each against the float64 formula: fp32 rows of statistic ~1
    (to 1e-5 relative), 1e6, eps and 0.1 eps (without an eps, 1e-6 to 1e-18), rows of zeros (zeros out, or NaN with
    an epsilon of 0, as the fused norms give: a clamp or an epsilon too small to read differs there), 4-d rows in the
    other training mode (a dropout or a reshape shows), the input's gradient (a statistic detached from the graph
    shows), rows of another width (refused by a module of one width, ``normalized_shape``; else the width is None:
    rows of any width, Gemma 4's, for an RMSNorm), bf16 and fp16 inputs (the output in their dtype, the fp32 formula
    rounded once) and the output's dtype under CUDA autocast's rule for the norm ops (:class:`_CudaAutocastNorms`:
    ``output_in_input_dtype``).

    The module itself is not run: a stand-in sharing its class and attributes is (:func:`_stand_in`), through
    ``forward``, on CPU inputs (so its hooks do not fire). Never raises: a forward that fails means "not a norm".
    fp64 inputs are not probed: the fused norms compute them in fp64, where OLMo's and Gemma 4's modules round to
    fp32.
    """
    name = type(module).__name__
    named = "norm" in name.lower()
    candidate = named or eps_attribute(module) is not None
    if (not candidate or any(True for _ in module.children()) or is_torch_rms_norm(module)
            or isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase))):
        # (a torch.nn.RMSNorm subclass with its own forward is probed here, as any module)
        return WeightlessNormProbe(False, None, None, None, "not a leaf norm of its own class", False)
    if list(module.parameters(recurse=False)) or list(module.buffers(recurse=False)):
        return WeightlessNormProbe(False, None, None, None, "has parameters or buffers", candidate)
    extra = _extra_forward_arguments(type(module))
    if extra:
        return WeightlessNormProbe(False, None, None, None, f"forward takes more than the input ({', '.join(extra)}): "
                                   "the fused norms take the input alone", candidate)

    def refuse(reason: str, kind: str | None = None) -> WeightlessNormProbe:
        # (a refused module whose name does not say norm: no row, however it holds an eps; any positive scaling of the
        # rows, x * 2, passes the first check: a walkthrough)
        return WeightlessNormProbe(False, kind, None, None, reason, named)

    width = _width_of(module)
    if isinstance(width, str):
        return refuse(width)
    stand_in = _stand_in(module)
    eps_name, eps, bad_eps = eps_of(module)
    if bad_eps is not None:   # checked with a good epsilon in its place; fuse raises the error (see _probe_rms_norm)
        if hasattr(getattr(type(module), eps_name, None), "__set__"):
            return refuse(f"{bad_eps} (a property of its class: the probe cannot try another)")
        eps = stand_in.__dict__[eps_name] = 1e-6
    n = width or 24
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(2, 3, n, generator=gen, dtype=torch.float32) + 0.5   # nonzero mean: LayerNorm and RMSNorm differ
    y = _forward_or_failure(stand_in, x, "on a random input", candidate)
    if isinstance(y, RMSNormProbe):
        return refuse(y.reason)
    if not isinstance(y, torch.Tensor) or y.shape != x.shape or y.dtype != x.dtype:
        return refuse("probe output is not a tensor of the input's shape and dtype")
    kind = next((k for k in ("rms_norm", "layer_norm") if _proportional(y, x, k)), None)
    if kind is None:
        return refuse("output is neither x * rsqrt(mean(x^2) + eps) (RMSNorm) nor (x - mean) * rsqrt(var + eps) "
                      "(LayerNorm) over the last dimension")
    if eps_name is None:
        eps = _measured_eps(stand_in, x, kind)
        if eps is None:
            return refuse("probe forward on a small input failed", kind)
    where = f"its {eps_name}" if eps_name else "read from its output"

    def differs(xi: torch.Tensor, what: str, atol: float = 1e-5, rtol: float = 1e-4, mode: bool | None = None):
        why = _stand_in_differs(stand_in, module, xi, what, _weightless_ref(xi, kind, eps), atol, rtol, mode,
                                candidate)
        return why and refuse(why if why.startswith("probe ") else
                              f"output differs from the formula with eps={eps:g} ({where}) {why}", kind)

    bad = differs(x, "on a random input", atol=1e-6, rtol=1e-5)
    if bad:
        return bad
    # eps at work (see _probe_rms_norm), large rows (a clamp shows), and zero rows: zeros out, NaN with eps 0
    c = x - x.mean(-1, keepdim=True) if kind == "layer_norm" else x
    for stat in (1e6,) + ((eps, 0.1 * eps) if eps > 0 else (1e-6, 1e-12, 1e-18)):
        bad = differs(x * torch.sqrt(stat / c.pow(2).mean(-1, keepdim=True)),
                      f"on inputs whose statistic is {stat:.3g}", rtol=1e-3)
        if bad:
            return bad
    bad = differs(torch.zeros_like(x), "on rows of zeros")
    if bad:
        return bad
    # the other training mode, on 4-d rows (a dropout in training, a norm over another dimension)
    x4 = torch.randn(2, 1, 3, n, generator=gen, dtype=torch.float32) + 0.5
    bad = differs(x4, f"in {'eval' if module.training else 'training'} mode on 4-d rows", mode=not module.training)
    if bad:
        return bad
    # the gradient of the input (a statistic detached from the graph, a custom backward)
    xg, dy = _stand_in_backward(stand_in, x, gen)
    if isinstance(xg, str):
        return refuse(xg, kind)
    xd = x.double().requires_grad_()
    with torch.enable_grad():
        _weightless_ref(xd, kind, eps).backward(dy.double())
    if xg.grad is None or not torch.allclose(xg.grad.double(), xd.grad, atol=1e-5, rtol=1e-4):
        err = (xg.grad.double() - xd.grad).abs().max().item() if xg.grad is not None else float("nan")
        return refuse(f"the gradient of its input differs from the formula's (max abs diff {err:.3g})", kind)
    # the width: rows of another one are refused by a module of one width, and normalized over by one of any
    x2 = torch.randn(2, n + 5, generator=gen, dtype=torch.float32) + 0.5
    try:
        with torch.no_grad():
            y2 = stand_in.forward(x2)
    except Exception:  # noqa: BLE001 - a module of one width
        if width is None:
            return refuse(f"refuses rows of {n + 5} values and names no width (normalized_shape)", kind)
    else:
        if not isinstance(y2, torch.Tensor) or y2.shape != x2.shape or not torch.allclose(
                y2.double(), _weightless_ref(x2, kind, eps), atol=1e-5, rtol=1e-4):
            return refuse(f"on rows of {n + 5} values its output is not the formula over the last dimension", kind)
        if kind == "rms_norm":
            width = None   # (a LayerNorm keeps the width it names: FusedLayerNorm takes one, and the model's is it)
    if kind == "layer_norm" and width is None:
        return refuse("normalizes rows of any width and names none (normalized_shape): FusedLayerNorm takes one",
                      kind)
    # the rounding: fp32 math, one rounding to a 16-bit input's dtype, the output in it
    for dt, short in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        xh = x.to(dt)
        yh = _forward_or_failure(stand_in, xh, f"in {short}", candidate)
        if isinstance(yh, RMSNormProbe):
            return refuse(yh.reason, kind)
        if not isinstance(yh, torch.Tensor) or yh.shape != x.shape or yh.dtype != dt:
            return refuse(f"with {short} input its output is not a {short} tensor of the input's shape (the fused "
                          "norms return the input's dtype)", kind)
        once = _weightless_ref(xh, kind, eps).to(dt)
        off = int((yh != once).sum())
        if off > max(1, yh.numel() // 64):
            return refuse(f"with {short} input its output differs from the fp32 formula rounded once to {short} in "
                          f"{off} of {yh.numel()} elements: the fused norms would round it otherwise", kind)
    # the output's dtype under autocast (CUDA's rule for the norm ops): the input's (it casts back), or fp32
    dtypes = _autocast_dtypes(stand_in, x)
    if isinstance(dtypes, str):
        return refuse(dtypes, kind)
    in_dtype = dtypes[1] == torch.bfloat16
    what = "RMSNorm" if kind == "rms_norm" else "LayerNorm"
    over = f"over {width} values" if width else "over the last dimension of any width"
    cast = "output in the input's dtype" if in_dtype else "fp32 under autocast, as F." + kind
    return WeightlessNormProbe(True, kind, None if bad_eps else eps, width,
                               f"{what} without parameters {over}, eps={eps:g} ({where}); one rounding, {cast}",
                               True, eps_name, in_dtype, bad_eps)


# --------------------------------------------------------------------------------------------------------------------
# LayerNorm modules of their own class (Cohere's)
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerNormProbe:
    """Result of :func:`probe_layer_norm_module`: ``ok`` with ``eps`` and ``output_in_input_dtype`` (see
    :class:`WeightlessNormProbe`), or not ``ok`` with the ``reason``. ``candidate``: it computed LayerNorm's formula
    with its epsilon on the probe's first input, so a refusal is worth a row of kind ``layer_norm`` in the report
    (else the module is the RMSNorm probe's to report: T5's ``T5LayerNorm`` is an RMSNorm). ``eps_error``: as
    :class:`WeightlessNormProbe`'s."""

    ok: bool
    eps: float | None
    reason: str
    candidate: bool
    output_in_input_dtype: bool = True
    eps_error: Exception | None = None


def layer_norm_1p_candidate(module: nn.Module) -> bool:
    """A ``torch.nn.LayerNorm`` subclass with a forward of its own and a weight, whose class name says LayerNorm1P
    (``layernorm1p`` in it, any case: Nemotron's ``NemotronLayerNorm1P``, Megatron-LM's LayerNorm of ``weight +
    1``)."""
    return (isinstance(module, nn.LayerNorm) and type(module).forward is not nn.LayerNorm.forward
            and "layernorm1p" in type(module).__name__.lower() and module.weight is not None)


@probe_isolated
def probe_layer_norm_1p(module: nn.Module) -> LayerNormProbe:
    """Whether ``module``, a :func:`layer_norm_1p_candidate`, computes ``F.layer_norm(x, normalized_shape, weight + 1,
    bias, eps)`` with its own ``eps`` (``FusedLayerNorm(apply_layernorm_1p=True)``'s formula): its forward, called
    directly on a copy with a random weight (-0.5 to 0.5) and bias, on CPU, in fp32 against the float64 formula (rows
    of statistics ~1 and ~1e3, training and eval mode) and in bf16 with bf16 parameters (a bf16 output: the scale's
    sum in bf16, as the fused module's). Its rule under autocast is the class's (the input and parameters cast to the
    autocast dtype), which this CPU probe does not see: the class's name stands for it. Never raises."""
    import copy

    name = type(module).__name__
    if not layer_norm_1p_candidate(module):
        return LayerNormProbe(False, None, f"{name} is not a LayerNorm subclass named LayerNorm1P with a weight", False)
    extra = _extra_forward_arguments(type(module))
    if extra:
        return LayerNormProbe(False, None, f"its forward takes more than the input ({', '.join(extra)})", True)
    shape, eps = tuple(module.normalized_shape), module.eps
    if len(shape) != 1 or not isinstance(eps, (int, float)):
        return LayerNormProbe(False, None, f"normalized_shape {shape} and eps {eps!r}: one dimension and a number "
                                           "expected", True)
    try:
        with torch.no_grad():
            # (on the CPU, whatever device the module is on: the meta device included; its values are set below)
            stand_in = copy.deepcopy(module).to_empty(device="cpu").float()
            g = torch.Generator().manual_seed(0)
            stand_in.weight.copy_(torch.rand(shape, generator=g) - 0.5)
            if stand_in.bias is not None:
                stand_in.bias.copy_(torch.randn(shape, generator=g))
            x = torch.cat([torch.randn(4, *shape, generator=g), 1e3 + 30 * torch.randn(4, *shape, generator=g)])
            w, b = stand_in.weight + 1.0, stand_in.bias
            want = _layer_norm_ref(x.double(), eps, w, b)
            for mode in (True, False):
                stand_in.train(mode)
                got = type(stand_in).forward(stand_in, x.clone())
                if not (isinstance(got, torch.Tensor) and got.shape == x.shape
                        and torch.allclose(got.double(), want, atol=1e-4, rtol=1e-4)):
                    return LayerNormProbe(False, None, "does not compute LayerNorm of weight + 1 (fp32, against "
                                                       "float64)", True)
            half = stand_in.to(torch.bfloat16)
            xb = x[:4].to(torch.bfloat16)
            got = type(half).forward(half, xb)
            ref = torch.nn.functional.layer_norm(xb, shape, half.weight + 1.0, half.bias, eps)
            if got.dtype != torch.bfloat16 or not torch.equal(got, ref):
                return LayerNormProbe(False, None, "in bf16 it does not return F.layer_norm of the bf16 weight + 1",
                                      True)
    except Exception as exc:  # noqa: BLE001
        return LayerNormProbe(False, None, f"probe failed: {type(exc).__name__}: {exc}", True)
    return LayerNormProbe(True, float(eps), "LayerNorm of weight + 1 (LayerNorm1P)", True, output_in_input_dtype=False)


def _layer_norm_ref(x: torch.Tensor, eps: float, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = _weightless_ref(x, "layer_norm", eps) * w.double()
    return y if b is None else y + b.double()


@probe_isolated
def probe_layer_norm_module(module: nn.Module) -> LayerNormProbe:
    """Check numerically whether ``module``, a leaf module other than ``torch.nn.LayerNorm`` whose parameters are a
    1-D ``weight`` and optionally a ``bias`` of its size, computes LayerNorm ``(x - mean) * rsqrt(var + eps) * weight
    (+ bias)`` over its last dimension in fp32 with one rounding, the output in the input's dtype whatever the
    parameters' (Cohere's ``CohereLayerNorm``, Cohere 2's; their per-head q/k norms, of a 2-D weight, are not one),
    with ``eps`` its epsilon attribute (:data:`EPS_ATTRIBUTES`).

    The checks mirror :func:`probe_weightless_norm`'s, with a random fp32 weight (0.5-1.5) and bias in a stand-in:
    float64 formula at statistics ~1, 1e6, eps and 0.1 eps and on rows of zeros; the other training mode on 4-d rows;
    the gradients of input, weight and bias; rows of another width refused (the weight does not broadcast); bf16 input
    with bf16 parameters and with fp32 ones (a bf16 output, the fp32 formula rounded once), fp32 input with bf16
    parameters (an fp32 output), fp16 input likewise; the output's dtype under CUDA autocast's rule for the norm ops.
    ``fuse`` asks it before :func:`probe_rms_norm`, whose answer stands where this one's ``candidate`` is False (T5's
    ``T5LayerNorm``, an RMSNorm); never raises."""
    params = dict(module.named_parameters(recurse=False))
    w0 = params.get("weight")
    if (isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase))
            or any(True for _ in module.children()) or w0 is None or not set(params) <= {"weight", "bias"}):
        return LayerNormProbe(False, None, "not a leaf module of a weight (and bias)", False)

    def refuse(reason: str, candidate: bool = False) -> LayerNormProbe:
        return LayerNormProbe(False, None, reason, candidate)

    if w0.dim() != 1 or ("bias" in params and params["bias"].shape != w0.shape):
        return refuse(f"its weight is {tuple(w0.shape)}"
                      + (f" and its bias {tuple(params['bias'].shape)}" if "bias" in params else "")
                      + ": FusedLayerNorm's are 1-D, of the normalized size")
    if list(module.buffers(recurse=False)):
        return refuse("has buffers")
    extra = _extra_forward_arguments(type(module))
    if extra:
        return refuse(f"forward takes more than the input ({', '.join(extra)})")
    eps_name, eps, bad_eps = eps_of(module)
    if eps_name is None:
        return refuse(f"no eps attribute ({', '.join(EPS_ATTRIBUTES)})")
    stand_in = _stand_in(module)
    if bad_eps is not None:
        if hasattr(getattr(type(module), eps_name, None), "__set__"):
            return refuse(f"{bad_eps} (a property of its class: the probe cannot try another)")
        eps = stand_in.__dict__[eps_name] = 1e-6
    n = w0.numel()
    gen = torch.Generator().manual_seed(1234)
    w = torch.rand(n, generator=gen, dtype=torch.float32) + 0.5
    b = torch.randn(n, generator=gen, dtype=torch.float32) if "bias" in params else None
    slots = list(module._parameters)   # (a bias registered as None, nn.LayerNorm(bias=False)'s idiom, stays None)

    def use(wi: torch.Tensor, bi: torch.Tensor | None, grad: bool = False) -> tuple[nn.Parameter, nn.Parameter | None]:
        pw = nn.Parameter(wi.clone(), requires_grad=grad)
        pb = None if bi is None else nn.Parameter(bi.clone(), requires_grad=grad)
        object.__setattr__(stand_in, "_parameters", {k: pw if k == "weight" else pb if k == "bias" else None
                                                     for k in slots})
        return pw, pb

    use(w, b)
    x = torch.randn(2, 3, n, generator=gen, dtype=torch.float32) + 0.5
    y = _forward_or_failure(stand_in, x, "on a random input", False)
    if isinstance(y, RMSNormProbe):
        return refuse(y.reason)
    if not isinstance(y, torch.Tensor) or y.shape != x.shape or y.dtype != x.dtype:
        return refuse("probe output is not a tensor of the input's shape and dtype")
    if not torch.allclose(y.double(), _layer_norm_ref(x, eps, w, b), atol=1e-4, rtol=1e-3):
        return refuse("output is not (x - mean) * rsqrt(var + eps) * weight" + (" + bias" if b is not None else ""))
    where = f"its {eps_name}"

    def differs(xi: torch.Tensor, what: str, atol: float = 1e-5, rtol: float = 1e-4, mode: bool | None = None):
        why = _stand_in_differs(stand_in, module, xi, what, _layer_norm_ref(xi, eps, w, b), atol, rtol, mode, True)
        return why and refuse(why if why.startswith("probe ") else
                              f"output differs from LayerNorm's formula with eps={eps:g} ({where}) {why}", True)

    bad = differs(x, "on a random input", atol=1e-6, rtol=1e-5)
    c = x - x.mean(-1, keepdim=True)
    for stat in (1e6, eps, 0.1 * eps) if eps > 0 else (1e6, 1e-6, 1e-12):
        bad = bad or differs(x * torch.sqrt(stat / c.pow(2).mean(-1, keepdim=True)),
                             f"on inputs whose variance is {stat:.3g}", rtol=1e-3)
    if eps > 0:   # (with eps 0 a row of zeros is 0/0 for the module and the fused norm alike)
        bad = bad or differs(torch.zeros_like(x), "on rows of zeros")
    x4 = torch.randn(2, 1, 3, n, generator=gen, dtype=torch.float32) + 0.5
    bad = bad or differs(x4, f"in {'eval' if module.training else 'training'} mode on 4-d rows",
                         mode=not module.training)
    if bad:
        return bad
    # gradients of the input and the parameters
    pw, pb = use(w, b, grad=True)
    xg, dy = _stand_in_backward(stand_in, x, gen)
    if isinstance(xg, str):
        return refuse(xg, True)
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    bd = None if b is None else b.double().requires_grad_()
    with torch.enable_grad():
        _layer_norm_ref(xd, eps, wd, bd).backward(dy.double())
    for got, want, what in ((xg.grad, xd.grad, "input"), (pw.grad, wd.grad, "weight"),
                            (None if pb is None else pb.grad, None if bd is None else bd.grad, "bias")):
        if want is None:
            continue
        if got is None or not torch.allclose(got.double(), want, atol=1e-5, rtol=1e-4):
            return refuse(f"the gradient of its {what} differs from the formula's", True)
    use(w, b)
    try:
        with torch.no_grad():
            stand_in.forward(torch.randn(2, n + 1, generator=gen, dtype=torch.float32))
    except Exception:  # noqa: BLE001 - the expected outcome: the weight does not fit the wider rows
        pass
    else:
        return refuse(f"its weight of {n} elements broadcasts over rows of another width", True)
    # roundings and dtypes: fp32 math, one rounding to the input's dtype, whatever the parameters'
    x16 = x.to(torch.bfloat16)
    xh = x.to(torch.float16)
    for xi, wi, bi, what in ((x16, w.bfloat16(), None if b is None else b.bfloat16(), "bf16 input and parameters"),
                             (x16, w, b, "bf16 input and fp32 parameters"),
                             (xh, w.half(), None if b is None else b.half(), "fp16 input and parameters"),
                             (xh, w, b, "fp16 input and fp32 parameters"),
                             (x, w.bfloat16(), None if b is None else b.bfloat16(), "fp32 input and bf16 parameters")):
        use(wi, bi)
        yi = _forward_or_failure(stand_in, xi, f"with {what}", True)
        if isinstance(yi, RMSNormProbe):
            return refuse(yi.reason, True)
        if not isinstance(yi, torch.Tensor) or yi.shape != x.shape or yi.dtype != xi.dtype:
            return refuse(f"with {what} its output is not in the input's dtype (the fused norm's)", True)
        ref = _layer_norm_ref(xi, eps, wi, bi)
        if xi.dtype == torch.float32:   # (fp32 math: the formula to fp32's accuracy)
            if not torch.allclose(yi.double(), ref, atol=1e-5, rtol=1e-4):
                return refuse(f"with {what} its output differs from the formula (the parameters rounded to bf16?)",
                              True)
            continue
        off = int((yi != ref.to(xi.dtype)).sum())
        if off > max(1, yi.numel() // 64):
            return refuse(f"with {what} its output differs from the fp32 formula rounded once in {off} of "
                          f"{yi.numel()} elements: the fused norm would round it otherwise", True)
    use(w, b)
    dtypes = _autocast_dtypes(stand_in, x)
    if isinstance(dtypes, str):
        return refuse(dtypes, True)
    in_dtype = dtypes[1] == torch.bfloat16
    cast = "output in the input's dtype" if in_dtype else "fp32 under autocast, as F.layer_norm"
    params_of = "a weight and bias" if b is not None else "a weight"
    return LayerNormProbe(True, None if bad_eps else eps, f"LayerNorm of {params_of} "
                          f"over {n} values, eps={eps:g} ({where}); one rounding, {cast}", True, in_dtype, bad_eps)


# --------------------------------------------------------------------------------------------------------------------
# SwiGLU MLP probe
# --------------------------------------------------------------------------------------------------------------------
SWIGLU_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
GATE_UP_PROJECTIONS = ("gate_up_proj", "down_proj")   # Phi-3, GLM: gate and up in one projection
# the names the activation module of each layout may have (the fused module keeps it, not called): Llama's act_fn, or
# activation_fn (Llama 4's Llama4TextMLP, its shared expert too; session 71's survey); Phi-3's and GLM's
# activation_fn, or act_fn (Zamba2's, Phi-4-multimodal's audio MLP)
SWIGLU_ACTIVATIONS = ("act_fn", "activation_fn")
GATE_UP_ACTIVATIONS = ("activation_fn", "act_fn")
# T5 v1.1's gated MLP (T5DenseGatedActDense; Flan-T5, mT5, UMT5, LongT5, Pop2Piano, UDOP, Pix2Struct's and Kosmos-2.5's
# copies): gate wi_0, up wi_1, down wo, its activation act and an nn.Dropout between the product and wo
T5_PROJECTIONS = ("wi_0", "wi_1", "wo")
T5_ACTIVATIONS = ("act",)
# ModernBERT's MLP (ModernBertMLP, ModernBertDecoderMLP): gate and up in one Wi, the activated half first (its
# "input"), then an nn.Dropout (drop) of the product before Wo; GELU (exact) by default
MODERNBERT_PROJECTIONS = ("Wi", "Wo")
MODERNBERT_ACTIVATIONS = ("act",)
# Granite's shared MLP (GraniteMoeSharedMLP, GraniteMoeHybridMLP: Granite 4.0): gate_up_proj's layout under the names
# input_linear / output_linear, its activation "activation"
GRANITE_PROJECTIONS = ("input_linear", "output_linear")
GRANITE_ACTIVATIONS = ("activation",)
# LFM2's MLP (Lfm2MLP; LFM2-MoE's dense layers, LFM3): gate w1, up w3, down w2, F.silu in its forward (no module)
LFM2_PROJECTIONS = ("w1", "w3", "w2")
LFM2_ACTIVATIONS = ("act_fn",)


# the activations the probe tells apart (SwiGLUProbe.activation) -> the float64 formula the activation module must
# compute (atol 1e-6, rtol 1e-5: exact GELU and its tanh approximation differ by up to 4.4e-4 on the probe's points,
# transformers' gelu_new / gelu_fast compute the tanh one within 2.5e-7 in fp32)
ACTIVATION_FORMULAS = {
    "silu": torch.nn.functional.silu,
    "gelu_tanh": functools.partial(torch.nn.functional.gelu, approximate="tanh"),
    "gelu": torch.nn.functional.gelu,
}
# a GeGLU activation -> F.gelu's ``approximate`` (FusedGeGLUMLP's, op geglu's)
GELU_APPROXIMATE = {"gelu_tanh": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class _Layout:
    """A gated MLP layout the probe knows: its projections (``down_proj`` last), the names its activation module may
    have, the fused module that takes it with each activation (for the reasons; an activation it lacks is refused)
    and the formula it must compute (``{act}``: the activation's name)."""

    projections: tuple[str, ...]
    activations: tuple[str, ...]
    fused: dict[str, str]
    formula: str
    # the name of the one torch.nn.Dropout child the layout may have (the fused module keeps it and calls it on the
    # product, before the last projection), or None: no dropout child is taken
    dropout: str | None = None

    @property
    def name(self) -> str:
        """The projections' names, as the report gives the layout (``wi_0/wi_1/wo``)."""
        return "/".join(self.projections)


_SEPARATE = _Layout(SWIGLU_PROJECTIONS, SWIGLU_ACTIVATIONS,
                    {"silu": "FusedSwiGLUMLP", "gelu_tanh": "FusedGeGLUMLP", "gelu": "FusedGeGLUMLP"},
                    "down_proj({act}(gate_proj(x)) * up_proj(x))")
_PACKED = _Layout(GATE_UP_PROJECTIONS, GATE_UP_ACTIVATIONS, {"silu": "FusedGateUpSwiGLUMLP"},
                  "down_proj({act}(gate) * up) with gate, up = gate_up_proj(x).chunk(2, -1)")
_T5 = _Layout(T5_PROJECTIONS, T5_ACTIVATIONS, dict.fromkeys(ACTIVATION_FORMULAS, "FusedT5DenseGatedActDense"),
              "wo(dropout({act}(wi_0(x)) * wi_1(x)))", dropout="dropout")
_LFM2 = _Layout(LFM2_PROJECTIONS, LFM2_ACTIVATIONS, {"silu": "FusedLfm2MLP"}, "w2({act}(w1(x)) * w3(x))")
_GRANITE = _Layout(GRANITE_PROJECTIONS, GRANITE_ACTIVATIONS, {"silu": "FusedGraniteMLP"},
                   "output_linear({act}(gate) * up) with gate, up = input_linear(x).chunk(2, -1)")
_MODERNBERT = _Layout(MODERNBERT_PROJECTIONS, MODERNBERT_ACTIVATIONS,
                      dict.fromkeys(ACTIVATION_FORMULAS, "FusedModernBertMLP"),
                      "Wo(drop({act}(input) * gate)) with input, gate = Wi(x).chunk(2, -1)", dropout="drop")


def _swiglu_layout(children: dict) -> _Layout | None:
    """The layout whose projections ``children`` (a module's, by name) hold: gate_proj, up_proj and down_proj first
    (a module holding these and a gate_up_proj too is probed as that layout, and refused for the extra submodule), then
    gate_up_proj and down_proj, then T5's wi_0, wi_1 and wo, then ModernBERT's Wi and Wo, then Granite's input_linear
    and output_linear, then LFM2's w1, w3 and w2; None for none of them."""
    for layout in (_SEPARATE, _PACKED, _T5, _MODERNBERT, _GRANITE, _LFM2):
        if all(isinstance(children.get(n), nn.Module) for n in layout.projections):
            return layout
    return None


@dataclass(frozen=True)
class SwiGLUProbe:
    """Result of :func:`probe_swiglu_mlp`: ``ok``, or not with the ``reason``; ``candidate`` says whether the module
    has the three projections, or ``gate_up_proj`` and ``down_proj`` (worth a row in the report); ``packed`` that it
    has the second layout (gate and up in one ``gate_up_proj``: ``FusedGateUpSwiGLUMLP``, op ``swiglu.packed``);
    ``activation`` what its activation module computes (a key of :data:`ACTIVATION_FORMULAS`): ``silu`` (SwiGLU,
    also where the probe stopped before looking at it), ``gelu_tanh`` or ``gelu`` (GeGLU: ``FusedGeGLUMLP``, op
    ``geglu``, with :attr:`approximate`); ``layout`` the projections' names of its layout (``gate_proj/up_proj/
    down_proj``, ``gate_up_proj/down_proj``, T5's ``wi_0/wi_1/wo``: ``FusedT5DenseGatedActDense``, op ``swiglu`` or
    ``geglu`` by the activation, ModernBERT's ``Wi/Wo``, packed too: ``FusedModernBertMLP``, op ``swiglu.packed``
    or ``geglu.packed``, Granite's ``input_linear/output_linear``, packed SiLU: ``FusedGraniteMLP``, or LFM2's
    ``w1/w3/w2``: ``FusedLfm2MLP``; ``""`` for no candidate); ``down_cast``, for an accepted T5 MLP, that its forward
    casts the product to ``wo.weight``'s dtype where they differ (T5's rule: False for LongT5's copy, which does
    not)."""

    ok: bool
    reason: str
    candidate: bool
    packed: bool = False
    activation: str = "silu"
    layout: str = ""
    down_cast: bool = False

    @property
    def approximate(self) -> str | None:
        """``F.gelu``'s ``approximate`` of a GeGLU MLP (``tanh`` or ``none``); None for SiLU."""
        return GELU_APPROXIMATE.get(self.activation)


@probe_isolated
def probe_swiglu_mlp(module: nn.Module) -> SwiGLUProbe:
    """Check whether ``module`` computes ``down_proj(act(gate_proj(x)) * up_proj(x))`` with ``act`` SiLU (SwiGLU) or
    GELU, exact or with the tanh approximation (GeGLU: Gemma's MLP; ``activation`` says which), or, with gate and up
    in one projection (Phi-3, GLM), ``down_proj(silu(gate) * up)`` of ``gate, up = gate_up_proj(x).chunk(2, -1)``
    (gate the first half), or T5's ``wo(dropout(act(wi_0(x)) * wi_1(x)))`` with its dropout (see the module
    docstring; ``down_cast`` says whether its forward casts the product to ``wo.weight``'s dtype), or ModernBERT's
    ``Wo(drop(act(input) * gate))`` of ``input, gate = Wi(x).chunk(2, -1)`` with its dropout.

    The module itself is not run: a shallow stand-in sharing its class and attributes, whose projections are small
    random fp32 ``torch.nn.Linear`` modules on CPU (``gate_up_proj``: hidden -> 2 * intermediate), whose dropout (T5's
    layout) is a fixed mask that counts its calls, and whose activation (``act_fn``; in the ``gate_up_proj`` layout
    ``activation_fn`` or ``act_fn``; T5's ``act``) is ``torch.nn.SiLU()`` or
    ``torch.nn.GELU(approximate=...)`` (once the module's own is found to compute that, through its ``forward``
    directly), is, through ``forward`` directly, in training and in eval mode: no hook of the module or its children
    fires, and its projections, which may be large or on a GPU, are not touched. The input has small rows and rows
    whose gate and up reach beyond +-``PROBE_FAR`` (50) on each side (:func:`_swiglu_probe_input`), so a clamp of gate
    or up at a plausible limit changes the output; a module naming a clamp limit is refused before that
    (:func:`_swiglu_clamp`): MiniMax-M3's clamped ``gate_up_proj`` MLP, say. Never raises.
    """
    children = dict(module.named_children())
    layout = _swiglu_layout(children)
    if layout is None:
        return SwiGLUProbe(False, "", False)
    packed = len(layout.projections) == 2   # (gate and up in one projection: gate_up_proj's, ModernBERT's, Granite's)
    acts = [n for n in layout.activations if n in children]
    # the activation first (its module's forward alone, cheap), so that every refusal below names the MLP's kind (a
    # GeGLU MLP's row is the report's geglu row); its own refusal comes last, as before. One held as a plain function
    # attribute (``self.act_fn = F.gelu``: no submodule) is classified too (the stand-in calls it as it is); before, it
    # was taken for SiLU, so a GELU one was refused as a SwiGLU MLP that differs from the formula (a review)
    fn_acts = [n for n in layout.activations if not acts and callable(module.__dict__.get(n))
               and not isinstance(module.__dict__.get(n), nn.Module)]
    if acts:
        kind, act_why = _activation_kind(children[acts[0]], acts[0], layout)
    elif fn_acts:
        kind, act_why = _activation_kind(module.__dict__[fn_acts[0]], fn_acts[0], layout)
    else:
        kind, act_why = "silu", None
    kind = kind or "silu"

    def refused(reason: str) -> SwiGLUProbe:
        return SwiGLUProbe(False, reason, True, packed, kind, layout.name)

    clamp = _swiglu_clamp(module)
    if clamp is not None:
        return refused(clamp)
    gated = _GATED_NAME[kind]
    # the layout's dropout: a torch.nn.Dropout of its own class's computation (the fused module calls it where the MLP
    # does, which the probe checks below); a subclass with its own forward is another submodule
    drop = layout.dropout if (isinstance(children.get(layout.dropout), nn.Dropout)
                              and type(children[layout.dropout]).forward is nn.Dropout.forward) else None
    other = [n for n in children if n not in layout.projections and n not in layout.activations and n != drop]
    if other:
        also = f", {' or '.join(layout.activations)} and {layout.dropout} (a torch.nn.Dropout)" if layout.dropout \
            else f" and {' or '.join(layout.activations)}"
        return refused(f"has submodules besides the projections{also} ({', '.join(other)}): not the plain {gated} "
                       "MLP")
    if len(acts) > 1:
        return refused(f"has two activations ({', '.join(acts)}): not the plain {gated} MLP")
    fused = layout.fused.get(kind, layout.fused["silu"])
    if any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
        return refused(f"has parameters or buffers of its own: not the plain {gated} MLP")
    extra = _extra_forward_arguments(type(module))
    if extra:
        return refused(f"forward takes more than the input ({', '.join(extra)}): {fused} takes the input alone")
    if act_why is not None:
        return refused(act_why)
    hidden, inter = 8, 12
    gen = torch.Generator().manual_seed(4321)

    def linear(n_in: int, n_out: int, like: nn.Module) -> nn.Linear:
        # skip_init: nn.Linear's own initialisation drew from the global generator (fuse() changed torch's RNG state,
        # a dry run too, a review of session 61); the weights come from gen alone
        lin = torch.nn.utils.skip_init(nn.Linear, n_in, n_out, bias=getattr(like, "bias", None) is not None,
                                       dtype=torch.float32)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n_out, n_in, generator=gen, dtype=torch.float32) / math.sqrt(n_in))
            if lin.bias is not None:
                lin.bias.copy_(torch.randn(n_out, generator=gen, dtype=torch.float32) * 0.1)
        return lin

    # (gate, up, down) or (gate_up, down), by position: the layouts name them differently
    widths = [(hidden, 2 * inter), (inter, hidden)] if packed else [(hidden, inter), (hidden, inter), (inter, hidden)]
    stand = {n: linear(*w, children[n]) for n, w in zip(layout.projections, widths)}
    if packed:   # gate and up: the halves of gate_up_proj's (Wi's) rows (and bias)
        gate_up = stand[layout.projections[0]]
        biases = (None, None) if gate_up.bias is None else gate_up.bias.chunk(2)
        (gate_w, up_w), (gate_b, up_b) = gate_up.weight.chunk(2), biases
    else:
        gate, up = (stand[n] for n in layout.projections[:2])
        gate_w, gate_b, up_w, up_b = gate.weight, gate.bias, up.weight, up.bias
    stand_in = _stand_in(module)
    object.__setattr__(stand_in, "_parameters", {})
    object.__setattr__(stand_in, "_buffers", {})
    act = {acts[0]: nn.SiLU() if kind == "silu" else nn.GELU(approximate=GELU_APPROXIMATE[kind])} if acts else {}
    x = _swiglu_probe_input(gate_w, up_w, gen)
    # the dropout: a stand-in that scales the product by a fixed mask (zeros and 1 / 0.7, as a dropout's draw) in
    # both modes, so the output shows that the forward calls it once, on act(gate) * up, before the last projection,
    # where the fused module calls the MLP's own (an identity in its place would not tell whether, or where, the
    # forward calls it). Randomness of the forward's own (a functional dropout) still shows in training mode.
    mask = (torch.rand(*x.shape[:-1], inter, generator=gen, dtype=torch.float32) > 0.3) / 0.7 if drop else None
    dropped = {drop: _MaskDropout(mask)} if drop else {}
    object.__setattr__(stand_in, "_modules", {**children, **stand, **act, **dropped})
    ys = []
    for training in (True, False):   # a forward that reads self.training (functional dropout) differs in one
        stand_in.__dict__["training"] = training
        try:
            # training mode with gradients on, as training runs it (a forward that branches on is_grad_enabled()
            # differs in one; a review), eval mode without
            with torch.set_grad_enabled(training):
                ys.append(stand_in.forward(x))
        except Exception as exc:  # noqa: BLE001 - a forward we cannot run we cannot vouch for
            return refused(f"probe forward ({'training' if training else 'eval'} mode) failed: "
                           f"{type(exc).__name__}: {exc}")
        if drop and dropped[drop].calls != 1:
            return refused(f"its forward ({'training' if training else 'eval'} mode) calls {drop} "
                           f"{dropped[drop].calls} times: {layout.fused[kind]} calls it once, on the product")
        if drop:
            dropped[drop].calls = 0
    with torch.no_grad():
        F = torch.nn.functional
        xd, down = x.double(), stand[layout.projections[-1]]
        h = (ACTIVATION_FORMULAS[kind](F.linear(xd, gate_w.double(), _double(gate_b)))
             * F.linear(xd, up_w.double(), _double(up_b)))
        if mask is not None:
            h = h * mask.double()
        ref = F.linear(h, down.weight.double(), _double(down.bias))
        # fp32 rounding of the stand-in's products: relative to the sum of the magnitudes each output adds up (its
        # elements reach 1e4 on the large rows and may cancel to near 0)
        scale = F.linear(h.abs(), down.weight.double().abs())
        if down.bias is not None:
            scale = scale + down.bias.double().abs()
    formula = layout.formula.format(act=kind)
    for mode, y in zip(("training", "eval"), ys):
        if not isinstance(y, torch.Tensor) or y.shape != ref.shape:
            return refused(f"probe output ({mode} mode) is not a tensor of the input's shape")
        if not bool(((y.double() - ref).abs() <= 1e-5 + 1e-4 * scale).all()):
            err = (y.double() - ref).abs().max().item()
            return refused(f"output ({mode} mode) differs from {formula} (max abs diff {err:.3g})")
    down_cast = False
    if layout is _T5:   # (with its dropout or without)
        # T5's rule: the product cast to wo.weight's dtype where they differ (an fp32 wo in a bf16 model, transformers'
        # _keep_in_fp32_modules); LongT5's copy does without (F.linear then raises for the mixed dtypes)
        down64 = copy.deepcopy(down).double()
        stand_in._modules[layout.projections[-1]] = down64
        stand_in.__dict__["training"] = False
        try:
            with torch.no_grad():
                y64 = stand_in.forward(x)
        except Exception:  # noqa: BLE001 - what F.linear raises for an fp32 input and an fp64 weight: no cast
            y64 = None
        if y64 is not None:
            if not isinstance(y64, torch.Tensor) or y64.dtype != torch.float64 or y64.shape != ref.shape:
                return refused(f"with an fp64 {layout.projections[-1]} and fp32 input its output is "
                               f"{getattr(y64, 'dtype', type(y64).__name__)}: neither T5's cast of the product to "
                               f"{layout.projections[-1]}.weight's dtype nor none")
            down_cast = True
    return SwiGLUProbe(True, f"probe output equals {formula}", True, packed, kind, layout.name, down_cast)


class _MaskDropout(nn.Module):
    """The probe's stand-in for a T5 MLP's dropout: ``input * mask`` (``mask``: fixed, of the product's shape, zeros
    and 1 / 0.7), counting its calls; ValueError for an input of another shape (the forward drops out something
    else than the product)."""

    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.mask = mask
        self.calls = 0

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if not isinstance(input, torch.Tensor) or input.shape != self.mask.shape:
            raise ValueError(f"dropout called on {getattr(input, 'shape', type(input).__name__)}, not on the product "
                             f"of shape {tuple(self.mask.shape)}")
        return input * self.mask


def activation_formula(act: Any, formulas: dict | None = None) -> str | None:
    """What the activation ``act`` computes: the key of ``formulas`` (default :data:`ACTIVATION_FORMULAS`; the
    squared ReLU probe's, :data:`SQUARED_RELU_FORMULAS`) whose float64 formula it matches (atol 1e-6, rtol 1e-5)
    near 0 and far out on either side (``ACT_FAR``: a clamp past 6, or any other bend, shows), or None. A module is
    checked through its ``forward`` (no hook fires), in training and in eval mode (its own and its submodules' flags
    set for the call and put back); a plain function (``F.gelu``) is called. An exception of the activation
    propagates."""
    t = torch.cat([torch.linspace(-6.0, 6.0, 25, dtype=torch.float32), torch.tensor(ACT_FAR, dtype=torch.float32)])
    outs = []
    with torch.no_grad():
        if isinstance(act, nn.Module):
            flags = [(m, m.training) for m in act.modules()]
            try:
                for mode in (True, False):
                    for m, _ in flags:
                        m.training = mode
                    # its forward, not __call__ (no hook fires); a copy of t: nn.SiLU(inplace=True) must not change it
                    outs.append(type(act).forward(act, t.clone()))
            finally:
                for m, was in flags:
                    m.training = was
        else:
            outs.append(act(t.clone()))
    if not all(isinstance(a, torch.Tensor) and a.shape == t.shape for a in outs):
        return None
    return next((k for k, f in (ACTIVATION_FORMULAS if formulas is None else formulas).items()
                 if all(torch.allclose(a.double(), f(t.double()), atol=1e-6, rtol=1e-5) for a in outs)), None)


# --------------------------------------------------------------------------------------------------------------------
# GELU activation probe (the MLPs without a gate)
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ActivationProbe:
    """What :func:`probe_gelu` and :func:`probe_squared_relu` found: ``candidate`` (a leaf module without parameters
    or buffers whose class name says GELU, or squared ReLU), ``ok`` (it computes that function and nothing else),
    ``approximate`` (F.gelu's: ``"none"`` or ``"tanh"``, where a GELU is ok; None for squared ReLU) and ``reason``
    (what it computes, or why it is refused)."""

    candidate: bool
    ok: bool
    approximate: str | None
    reason: str


GeluProbe = ActivationProbe   # (its name before op squared_relu shared it, session 73)


def _leaf_without_state(module: nn.Module) -> bool:
    return (not any(True for _ in module.children()) and not any(True for _ in module.parameters())
            and not any(True for _ in module.buffers()))


def gelu_candidate(module: nn.Module) -> bool:
    """A leaf module without parameters or buffers whose class name has ``gelu`` in it (any case): transformers'
    ``NewGELUActivation``, ``GELUActivation``, ``FastGELUActivation``, ``GELUTanh``, ``AccurateGELUActivation``,
    ``QuickGELUActivation``, Bloom's ``BloomGelu``, ``torch.nn.GELU``; the probe tells which compute GELU."""
    return "gelu" in type(module).__name__.lower() and _leaf_without_state(module)


def squared_relu_candidate(module: nn.Module) -> bool:
    """A leaf module without parameters or buffers whose class name says squared ReLU (any case: ``relu`` with
    ``square`` or ``relu2`` in it): transformers' ``ReLUSquaredActivation`` (``relu2``), a ``SquaredReLU``; the
    probe tells whether it computes ``relu(x)^2``."""
    name = type(module).__name__.lower()
    return "relu" in name and ("square" in name or "relu2" in name) and _leaf_without_state(module)


# the function squared ReLU's probe checks (activation_formula's formulas)
SQUARED_RELU_FORMULAS = {"relu2": lambda x: torch.square(torch.relu(x))}


def _probe_leaf_activation(module: nn.Module, by_name: bool, candidate: Any, rule: str,
                           formulas: dict | None) -> tuple[ActivationProbe | None, str | None]:
    """The probe shared by :func:`probe_gelu` and :func:`probe_squared_relu`: (a refusal, None) or (None, the key of
    ``formulas`` that ``module``'s forward computes, or None for none of them)."""
    name = type(module).__name__
    extra = _extra_forward_arguments(type(module))
    if not _leaf_without_state(module):
        why, looked_at = f"{name} is not a leaf module without parameters or buffers", False
    elif by_name and not candidate(module):
        why, looked_at = f"{name}: fuse() looks at activation modules whose class name {rule}", False
    elif extra:
        why, looked_at = f"its forward takes more than the input ({', '.join(extra)})", True
    else:
        try:
            return None, probe_isolated(activation_formula)(module, formulas)
        except Exception as exc:  # noqa: BLE001
            why, looked_at = f"probe failed: {type(exc).__name__}: {exc}", True
    return ActivationProbe(looked_at, False, None, why), None


def probe_gelu(module: nn.Module, *, by_name: bool = True) -> ActivationProbe:
    """Whether ``module``, a :func:`gelu_candidate` (``by_name`` False: any leaf module without parameters or
    buffers, whatever its class's name: ``FusedGELU.from_module``'s, where the caller chose the module), computes
    GELU, exact (erf) or with the tanh approximation, as ``F.gelu(x, approximate=...)`` does
    (:func:`activation_formula`: its forward, called directly, so no hook fires, on CPU in fp32, training and eval
    mode, against the float64 formulas), with no forward arguments beyond the input. Hooks do not refuse it: ``fuse``
    hands them to the replacement (as it does a norm's)."""
    refused, kind = _probe_leaf_activation(module, by_name, gelu_candidate, 'has "gelu" in it', None)
    if refused is not None:
        return refused
    if kind not in GELU_APPROXIMATE:
        what = "SiLU" if kind == "silu" else "another function (QuickGELU's, a clipped GELU, ...)"
        return ActivationProbe(True, False, None, f"computes {what}, not GELU (exact or tanh)")
    approximate = GELU_APPROXIMATE[kind]
    what = "GELU, tanh approximation" if approximate == "tanh" else "GELU, exact (erf)"
    return ActivationProbe(True, True, approximate, what)


def probe_squared_relu(module: nn.Module, *, by_name: bool = True) -> ActivationProbe:
    """Whether ``module``, a :func:`squared_relu_candidate` (``by_name`` False: any leaf module without parameters or
    buffers: ``FusedSquaredReLU.from_module``'s), computes ``relu(x)^2`` (transformers' ``ReLUSquaredActivation``),
    checked as :func:`probe_gelu` checks GELU (its forward on CPU in fp32, training and eval mode, against the float64
    formula near 0 and far out), with no forward arguments beyond the input. Hooks do not refuse it. ``approximate``
    is None."""
    refused, kind = _probe_leaf_activation(module, by_name, squared_relu_candidate,
                                           'says squared ReLU ("relu" with "square" or "relu2")',
                                           SQUARED_RELU_FORMULAS)
    if refused is not None:
        return refused
    if kind is None:
        return ActivationProbe(True, False, None,
                               "computes another function than relu(x)^2 (a clipped or scaled one, ...)")
    return ActivationProbe(True, True, None, "squared ReLU, relu(x)^2")


# an activation -> the gated MLP it makes (the reasons' words)
_GATED_NAME = {"silu": "SwiGLU", "gelu_tanh": "GeGLU", "gelu": "GeGLU"}


def _activation_kind(act: Any, name: str, layout: _Layout) -> tuple[str | None, str | None]:
    """(what the activation ``act``, the MLP's attribute ``name``, computes: a key of :data:`ACTIVATION_FORMULAS`,
    or None; why the MLP is refused for it, or None). A module is checked through its ``forward`` (no hook fires), in
    training and in eval mode (its own and its submodules' flags set for the call and put back: an activation that
    behaves otherwise in one mode, a dropout inside say, was checked in the mode it happened to be in, and the fused
    module, which does not call it, then dropped that behaviour in the other; a review); a plain function (a function
    attribute, ``F.gelu``) is called. Near 0 and far out on either side (a clamp past 6, or any other bend, shows).
    Refused: forward or backward hooks (which the fused module would not run), another activation, a GELU in a
    layout no fused module takes GELU in (``gate_up_proj``)."""
    try:
        kind = activation_formula(act)
    except Exception as exc:  # noqa: BLE001
        return None, f"probe of {name} failed: {type(exc).__name__}: {exc}"
    if kind is None:
        return None, (f"{name} ({type(act).__name__}) is not SiLU or GELU (exact or tanh): a gated MLP of another "
                      "activation, which neither the SwiGLU nor the GeGLU kernel computes")
    if kind not in layout.fused:
        return kind, (f"{name} ({type(act).__name__}) is not SiLU but GELU (approximate="
                      f"{GELU_APPROXIMATE[kind]!r}): a GeGLU MLP with gate and up in one {layout.projections[0]}, for "
                      f"which there is no fused module ({layout.fused['silu']} computes SiLU)")
    if isinstance(act, nn.Module) and has_module_hooks(act):
        return kind, (f"{name} has forward or backward hooks, which {layout.fused[kind]} (one kernel for the "
                      "activation and the product) would not run")
    return kind, None


# where the act_fn check looks besides [-6, 6]: far enough that a clamp of the gate at any plausible limit shows, and
# |x| <= 100 keeps silu(x) * x far from fp32's range
ACT_FAR = [-100.0, -60.0, -30.0, -15.0, -10.0, -8.0, 8.0, 10.0, 15.0, 30.0, 60.0, 100.0]
# what the probe's input gives gate and up at least, on each side, somewhere (beyond any plausible swiglu_limit)
PROBE_FAR = 50.0


def _swiglu_probe_input(gate_w: torch.Tensor, up_w: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The probe's input [4, 3, hidden] for the stand-in's gate and up weights (``gate_up_proj``'s halves in that
    layout): rows 0-1 small (gate and up within a few units, the curve near 0), rows 2-3
    scaled so that gate and up, from the stand-in projections, each reach +-2 * PROBE_FAR on their weaker side (with
    the probe's generator, gate and up span about -240..150 with biases, -150..150 without): a clamp of gate, up or
    the activation at any plausible limit, of either sign, changes the output (a review: the probe's gate stayed below
    ~5, so DeepseekV4's clamp at swiglu_limit=10 passed). Deterministic: from ``gen`` alone. fp32: |silu(g) * u| stays
    below 1e4."""
    hidden = gate_w.shape[1]
    small = torch.randn(2, 3, hidden, generator=gen, dtype=torch.float32) * 2.0
    big = torch.randn(2, 3, hidden, generator=gen, dtype=torch.float32)
    with torch.no_grad():
        lo = float("inf")
        for w in (gate_w, up_w):
            v = torch.nn.functional.linear(big, w)    # bias aside: it is small (0.1 scale)
            lo = min(lo, float(v.max()), float(-v.min()))
    big = big * (2.0 * PROBE_FAR / max(lo, 1e-3))     # the weaker side of gate and up at 2 * PROBE_FAR
    return torch.cat([small, big])


# a module's attributes naming a clamp of gate and up (DeepseekV4MLP: limit; Glm5NextTextMLP: swiglu_limit; Step3p7MLP,
# BailingHybridMLP: limit, None where the layer's limit is off)
CLAMP_ATTRIBUTES = ("swiglu_limit", "limit", "swiglu_limits", "swiglu_limits_shared", "clamp_limit", "clip_limit")
# a config's (read by a forward whose source mentions a limit or a clamp): DeepseekV4, Glm5Next, HY-V4 (experts only:
# HYV4MLP does not read it), Step3p7 and BailingHybrid (per-layer lists, 0 for off)
CONFIG_CLAMP_ATTRIBUTES = ("swiglu_limit", "swiglu_limits", "swiglu_limits_shared")


def _limit_set(value: Any) -> bool:
    """Whether a limit value clamps: not None; a list or tuple (per layer) with an entry neither None nor 0."""
    if value is None or isinstance(value, bool) and not value:
        return False
    if isinstance(value, (list, tuple)):
        return any(v is not None and v != 0 for v in value)
    return True


def _swiglu_clamp(module: nn.Module) -> str | None:
    """Why ``module`` is refused up front as a clamped SwiGLU (``gate.clamp(max=limit)``, ``up.clamp(-limit,
    limit)``, before or after the activation), or None. The probe's large activations show a clamp at a plausible
    limit; this names the reason, and catches one past what the probe reaches. Its own attribute decides where it has
    one (None: the layer's clamp is off, as Step3p7MLP's with a zero limit); else a config limit its forward's source
    reads (a limit, a clamp), or any where that source cannot be read."""
    own = module.__dict__
    named = [n for n in CLAMP_ATTRIBUTES if n in own]
    for name in named:
        if _limit_set(own[name]):
            return f"clamps gate and up at {name}={own[name]!r}: not plain SwiGLU"
    if named:
        return None
    config = own.get("config")
    if config is None:
        return None
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        source = None
    for name in CONFIG_CLAMP_ATTRIBUTES:
        try:
            value = getattr(config, name, None)
        except Exception:  # noqa: BLE001 - a config attribute that raises is not a limit we can read
            continue
        if not _limit_set(value):
            continue
        if source is None:
            return (f"its config sets {name}={value!r} (a clamp of gate and up) and its forward's source cannot be "
                    "read: not vouched for as plain SwiGLU")
        if any(tok in source for tok in ("limit", "clamp", "clip")):
            return f"clamps gate and up at config.{name}={value!r}: not plain SwiGLU"
    return None


def _double(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.double()


__all__ = ["ACTIVATION_FORMULAS", "ATTENTION_MODEL_TYPES", "ATTENTION_SKIP_REASONS", "GELU_APPROXIMATE", "RMSNormProbe",
           "SwiGLUProbe", "attention_support",
           "get_attn_implementation", "is_attention_module", "is_config",
           "model_type_of", "probe_rms_norm", "is_torch_rms_norm",
           "probe_swiglu_mlp", "probe_isolated", "set_attn_implementation",
           "LayerNormProbe", "WeightlessNormProbe", "probe_layer_norm_module", "probe_weightless_norm", "GeluProbe",
           "ActivationProbe", "activation_formula", "gelu_candidate", "probe_gelu", "SQUARED_RELU_FORMULAS",
           "squared_relu_candidate", "probe_squared_relu", "layer_norm_1p_candidate", "probe_layer_norm_1p",
           "GatedRMSNormProbe", "gated_rms_norm_candidate", "probe_rms_norm_gated"]
