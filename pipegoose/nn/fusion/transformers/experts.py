"""The gated activation of transformers' mixture-of-experts layers on our kernels (op ``swiglu.packed``, or
``geglu.packed`` for GELU experts), for ``fuse(model)``.

transformers 5 holds a MoE layer's experts in one module with 3-d weights (``gate_up_proj`` ``[experts, 2 * inter,
hidden]``, ``down_proj``), of a class decorated with ``transformers.integrations.moe.use_experts_implementation``
(Mixtral's, Qwen2-MoE's, Qwen3-MoE's, OLMoE's, DeepSeek-V3's and some eighty other models'). The config's
``_experts_implementation`` says how the experts run: ``grouped_mm`` (the default where torch has it), ``batched_mm``,
``deepgemm`` or the FP8 ones compute each routed token's ``gate_up_proj`` output, ``[tokens * top_k, 2 * inter]``, and
pass it to the module's ``_apply_gate``; transformers' default one is ``gate, up = gate_up_out.chunk(2, -1);
act_fn(gate) * up``: with SiLU, what op ``swiglu.packed`` (:func:`~pipegoose.nn.fusion.functional.silu_and_mul`)
computes in one kernel forward and one backward (eager PyTorch: SiLU, the product, and in the backward the halves'
gradients concatenated); with GELU (Gemma 4's experts: ``gelu_pytorch_tanh``), what op ``geglu.packed``
(:func:`~pipegoose.nn.fusion.functional.gelu_and_mul`) computes, exact or tanh-approximated. ``eager``, the class's
own loop over the experts, computes the product inline and never calls ``_apply_gate``.

``fuse`` sets a :class:`FusedExpertsGate` as the instance's ``_apply_gate`` (an instance attribute, which Python finds
before the class's method); ``unfuse`` deletes it. The module's class, parameters, ``forward`` and ``state_dict`` are
unchanged. Before that, :func:`probe` checks that the module has a gate (``has_gate``), that its ``act_fn`` is SiLU
or GELU (exact or tanh; through its forward, near 0 and out to +-100, in training and eval mode) without hooks, that
no clamp limit is set (GPT-OSS's ``limit``), and that the class's ``_apply_gate`` computes ``act(gate) * up`` of the
two halves: it is run on fp32 CPU rows whose gate and up reach +-100, against the float64 formula (a class with its
own gate, clamped, interleaved or scaled, differs and is refused with the reason).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import functional as PF
from ..ops import _common
from . import matching

# what the probe's rows reach, besides [-6, 6] (a clamp at any plausible limit shows)
_FAR = (-100.0, -60.0, -30.0, -15.0, -10.0, -8.0, 8.0, 10.0, 15.0, 30.0, 60.0, 100.0)
ACT = "act_fn"


def candidate(module: nn.Module) -> bool:
    """Whether ``module`` is an experts module of transformers' experts interface (the attributes that
    ``use_experts_implementation`` sets, ``has_gate`` and ``is_concatenated``, and a class ``_apply_gate``)."""
    own = module.__dict__
    return "has_gate" in own and "is_concatenated" in own and callable(getattr(type(module), "_apply_gate", None))


@dataclass(frozen=True)
class Probe:
    """Result of :func:`probe`: ``ok``, or not with the ``reason``; ``act`` the ``act_fn`` object vouched for;
    ``approximate`` None for SiLU (op ``swiglu.packed``), else GELU's ``"tanh"`` or ``"none"`` (op
    ``geglu.packed``)."""

    ok: bool
    reason: str
    act: Any = None
    approximate: str | None = None

    @property
    def op(self) -> str:
        """The op the fused gate runs: ``swiglu.packed`` or ``geglu.packed``."""
        return op_of(self.approximate)

    @property
    def kind(self) -> str:
        """The report's kind (and ``fuse``'s ``ops`` name) of the gate: ``swiglu`` or ``geglu``."""
        return "swiglu" if self.approximate is None else "geglu"


def op_of(approximate: str | None) -> str:
    """The op of a gate of SiLU (``approximate`` None: ``swiglu.packed``) or GELU (``geglu.packed``)."""
    return "swiglu.packed" if approximate is None else "geglu.packed"


def _act_of(module: nn.Module) -> Any:
    return module._modules[ACT] if ACT in module._modules else module.__dict__.get(ACT)


@matching.probe_isolated
def probe(module: nn.Module) -> Probe:
    """Check that ``module`` (a :func:`candidate`) computes its gate as ``act(gate) * up`` of the packed projection
    output's halves, ``act`` SiLU or GELU (see the module docstring). Never raises."""
    name = type(module).__name__
    if not module.__dict__.get("has_gate"):
        return Probe(False, f"{name} has no gate (has_gate False: act_fn of up_proj's output alone), no gated "
                            "activation to fuse")
    act = _act_of(module)
    if act is None:
        return Probe(False, f"{name} has no {ACT}: not transformers' default gate")
    # (the activation's kind first: a refused GELU gate is reported under geglu, where ops=["geglu"] finds it; a
    # review: a hooked GELU act_fn was reported as swiglu)
    kind, why = matching._activation_kind(act, ACT, matching._SEPARATE)
    approximate = matching.GELU_APPROXIMATE.get(kind)
    if isinstance(act, nn.Module) and _common.has_module_hooks(act):
        return Probe(False, f"{ACT} has forward or backward hooks, which the fused gate (one kernel for the "
                            "activation and the product) would not run", approximate=approximate)
    if why is not None:
        return Probe(False, why, approximate=approximate)
    formula = "silu(gate) * up" if approximate is None else f"gelu(gate, approximate={approximate!r}) * up"
    clamp = matching._swiglu_clamp(module)
    if clamp is not None:
        if approximate is not None:
            clamp = clamp.replace("not plain SwiGLU", "not plain GeGLU")
        return Probe(False, clamp, approximate=approximate)
    # the class's _apply_gate on a shallow stand-in (the module's attributes, no parameters or buffers: a gate that
    # reads a weight is not transformers' default one), in training and eval mode
    stand_in = object.__new__(type(module))
    stand_in.__dict__.update(module.__dict__)
    stand_in.__dict__.pop("_apply_gate", None)
    object.__setattr__(stand_in, "_parameters", {})
    object.__setattr__(stand_in, "_buffers", {})
    object.__setattr__(stand_in, "_modules", dict(module._modules))
    gen = torch.Generator().manual_seed(2468)
    inter = 40
    line = torch.cat([torch.linspace(-6.0, 6.0, inter - len(_FAR)), torch.tensor(_FAR)])
    gate = torch.stack([line, line.flip(0), torch.randn(inter, generator=gen) * 3.0])
    up = torch.stack([torch.randn(inter, generator=gen) * 2.0, line, line.flip(0)])
    x = torch.cat([gate, up], dim=-1).to(torch.float32)
    g64, u64 = x.double().chunk(2, dim=-1)
    act64 = matching.ACTIVATION_FORMULAS[kind](g64)   # (the formula act_fn was just checked against)
    ref = act64 * u64
    # (the activation's fp32 error, within what matching's check of act_fn accepted, 1e-6 + 1e-5 |act|, times |up|,
    # plus the product's rounding: transformers' fp32 GELUTanh is 7.6e-6 off float64 here, up reaching 100)
    bound = (1e-6 + 1e-5 * act64.abs()) * u64.abs() + 1e-6 + 1e-5 * ref.abs()
    for training in (True, False):
        stand_in.__dict__["training"] = training
        try:
            with torch.set_grad_enabled(training):
                y = type(module)._apply_gate(stand_in, x.clone())
        except Exception as exc:  # noqa: BLE001 - a gate we cannot run we cannot vouch for
            return Probe(False, f"probe of {name}._apply_gate ({'training' if training else 'eval'} mode) failed: "
                                f"{type(exc).__name__}: {exc}", approximate=approximate)
        if not isinstance(y, torch.Tensor) or y.shape != ref.shape:
            return Probe(False, f"{name}._apply_gate returned {getattr(y, 'shape', type(y).__name__)} for rows of "
                                f"{2 * inter} values, not [rows, {inter}]: not {formula} of the two halves",
                         approximate=approximate)
        if not bool(((y.double() - ref).abs() <= bound).all()):
            err = (y.double() - ref).abs().max().item()
            return Probe(False, f"{name}._apply_gate differs from {formula} of the halves of gate_up_proj's "
                                f"output (max abs diff {err:.3g}): a gate of its own", approximate=approximate)
    return Probe(True, f"probe: _apply_gate equals {formula} of the halves", act, approximate)


class FusedExpertsGate:
    """The ``_apply_gate`` that ``fuse`` sets on a transformers experts module: ``silu_and_mul(gate_up_out)`` (op
    ``swiglu.packed``), or for a GELU ``act_fn`` ``gelu_and_mul(gate_up_out, approximate)`` (op ``geglu.packed``),
    where the module's ``act_fn`` is still the one :func:`probe` vouched for, in the state it had (``act_state``:
    an ``approximate`` set on it since counts as another activation; a review) and without hooks, and
    its class's ``_apply_gate`` is still the one probed, else the class's own ``_apply_gate`` (what the unfused module
    runs: an activation replaced or hooked since is run, and its hooks fire; a gate of its own given to the class since,
    or a class of another gate set on the module, runs).

    Called by transformers' experts implementations with ``gate_up_out`` ``[rows, 2 * inter]`` (gate the first
    ``inter`` values of each row), fp32, fp16 or bf16; returns ``[rows, inter]`` of its dtype. Kernel:
    pipegoose/swiglu (pipegoose/kernels/csrc/swiglu.cu, this project, MIT); on the CPU, or where the dispatcher does
    not choose it, PyTorch's ``F.silu(gate) * up`` (``F.gelu(gate, approximate=approximate) * up``). Raises what
    :func:`~pipegoose.nn.fusion.functional.silu_and_mul` (:func:`~pipegoose.nn.fusion.functional.gelu_and_mul`)
    raises (ValueError for an odd last dimension, naming ``x``, the op's argument); RuntimeError where its module was
    collected.

    It holds its module by a weak reference (the module holds it: a strong one made a reference cycle, and a deleted
    model's experts were freed only by Python's cycle collector, a review); a copy (``copy.deepcopy``, pickling) is
    rebuilt on the copy's module and ``act_fn`` (:meth:`__reduce__`).
    """

    def __init__(self, module: nn.Module, act: Any, impl: str | None = None, approximate: str | None = None,
                 probed_state: dict[str, Any] | None = None) -> None:
        self._module = weakref.ref(module)
        self.probed_act = act
        self.probed_state = _common.act_state(act) if probed_state is None else probed_state
        self.probed_gate = getattr(type(module), "_apply_gate", None)
        self.impl = impl
        self.approximate = approximate

    @property
    def op(self) -> str:
        """The op it runs: ``swiglu.packed`` (SiLU) or ``geglu.packed`` (GELU)."""
        return op_of(self.approximate)

    @property
    def module(self) -> nn.Module | None:
        """The experts module whose gate this is (None once it is collected)."""
        return self._module()

    def __call__(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        module = self._module()
        if module is None:   # (called by hand after its model was deleted; transformers calls it from the module)
            raise RuntimeError("FusedExpertsGate: its experts module no longer exists (collected); call the gate of "
                               "a live module (module._apply_gate)")
        act = _act_of(module)
        gate = type(module)._apply_gate
        if (act is not self.probed_act or gate is not self.probed_gate
                or (isinstance(act, nn.Module) and _common.has_module_hooks(act))
                or not _common.same_act_state(_common.act_state(act), self.probed_state)):
            return gate(module, gate_up_out)
        if self.approximate is None:
            return PF.silu_and_mul(gate_up_out, impl=self.impl)
        return PF.gelu_and_mul(gate_up_out, self.approximate, impl=self.impl)

    def __reduce__(self):
        # (copies: the copy's module and act_fn, found in the copy's memo; the class's gate as the copy finds it; the
        # probed state through the same memo: attributes unchanged since the probe stay the copy's own, one changed
        # is another object in the copy too, which then runs the class's gate as the original does)
        return (FusedExpertsGate, (self._module(), self.probed_act, self.impl, self.approximate, self.probed_state))

    def __repr__(self) -> str:
        extra = "" if self.approximate is None else f", approximate={self.approximate!r}"
        return f"FusedExpertsGate(op={self.op!r}{extra}, impl={self.impl!r})"


def hooked(module: nn.Module) -> bool:
    """Whether ``module`` runs a :class:`FusedExpertsGate` (set by ``fuse``, or held by a copy of a fused model)."""
    return isinstance(module.__dict__.get("_apply_gate"), FusedExpertsGate)


def install(module: nn.Module, act: Any, approximate: str | None = None) -> FusedExpertsGate:
    """Set a :class:`FusedExpertsGate` as ``module``'s ``_apply_gate`` (``approximate``: None for SiLU, else GELU's,
    :attr:`Probe.approximate`); returns it."""
    gate = FusedExpertsGate(module, act, approximate=approximate)
    module.__dict__["_apply_gate"] = gate
    return gate


def uninstall(module: nn.Module | None, gate: FusedExpertsGate | None) -> bool:
    """Delete ``gate`` from ``module`` (nothing where the module was collected, or where the instance has no
    ``_apply_gate`` left: deleted since, the class's runs already; a walkthrough: unfuse raised there); False where
    another ``_apply_gate`` was set on it since (it is left in place)."""
    if module is None or "_apply_gate" not in module.__dict__:
        return True
    if gate is not None and module.__dict__.get("_apply_gate") is gate:
        del module.__dict__["_apply_gate"]
        return True
    return False


def implementation(module: nn.Module) -> str | None:
    """The experts implementation the module's config names (``grouped_mm``, ``eager`` ...), or None."""
    try:
        return getattr(module.__dict__.get("config"), "_experts_implementation", None)
    except Exception:  # noqa: BLE001 - a config that raises names none
        return None


# transformers' experts implementations whose kernel computes the activation itself (from the config's hidden_act),
# never calling the module's _apply_gate
OWN_ACTIVATION = frozenset({"sonicmoe", "deepgemm_megamoe"})


def runs_gate(module: nn.Module, impl: str | None) -> bool:
    """Whether the experts implementation ``impl`` (:func:`implementation`) calls the module's ``_apply_gate``: not
    :data:`OWN_ACTIVATION`'s; ``eager`` and None (a module built outside a model, whose config names none: transformers
    then runs the class's own forward too) only where the class's own forward calls it (GPT-OSS's, Step3p7's; Mixtral's
    loop computes ``act_fn(gate) * up`` inline). A class whose ``forward`` is its own (a subclass overriding the
    interface's wrapper: no implementation is dispatched) runs the gate only where that forward calls it."""
    forward = type(module).forward
    own = getattr(forward, "__wrapped__", None)   # use_experts_implementation wraps the class's forward
    if own is None:
        return "_apply_gate" in getattr(getattr(forward, "__code__", None), "co_names", ())
    if impl in OWN_ACTIVATION:
        return False
    if impl not in (None, "eager"):
        return True
    return "_apply_gate" in getattr(getattr(own, "__code__", None), "co_names", ())


def gate_width(module: nn.Module) -> int | None:
    """The packed projection's output width, ``2 * inter`` (``gate_up_proj`` ``[experts, 2 * inter, hidden]``, or
    transposed ``[experts, hidden, 2 * inter]``), or None."""
    w = getattr(module, "gate_up_proj", None)
    shape = getattr(w, "shape", None)
    if shape is None or len(shape) != 3:
        return None
    return int(shape[2] if module.__dict__.get("is_transposed") else shape[1])


__all__ = ["OWN_ACTIVATION", "FusedExpertsGate", "Probe", "candidate", "gate_width", "hooked", "implementation",
           "install", "op_of", "probe", "runs_gate", "uninstall"]
