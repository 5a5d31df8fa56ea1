"""``FusedAdam`` (multi-tensor Adam/AdamW) and ``clip_grad_norm_`` (multi-tensor L2 norm + scale).

Kernels: Apex ``multi_tensor_adam`` / ``multi_tensor_l2norm`` / ``multi_tensor_scale`` (copies in ColossalAI
0.5.0 ``extensions/csrc/kernel/cuda/multi_tensor_{adam,l2norm,scale}_kernel.cu``, Apache-2.0, Apex BSD-3 notice)
and DeepSpeed 0.19.8 ``csrc/adam/multi_tensor_adam.cu`` (Apache-2.0), PyTorch's own fused Adam/AdamW kernels
(``torch._fused_adamw_``) and ours (``pipegoose/kernels/csrc/multi_tensor_adam.cu``,
``pipegoose/kernels/csrc/clip_grad_norm.cu``); see
:mod:`pipegoose.nn.fusion.ops.multi_tensor` for each kernel's assumptions. The reference path is PyTorch's own
(foreach) math.
"""

from __future__ import annotations

import functools
import numbers
import types
import warnings
from collections import defaultdict
from typing import Any, Callable, Iterable

import torch

from . import dispatch
from .ops import multi_tensor as _mt

__all__ = ["FusedAdam", "clip_grad_norm_"]


# what a loaded param group may lack (groups saved by torch.optim.Adam / AdamW have no impl) for the checks
_LOADABLE_DEFAULTS = {"lr": 1e-3, "eps": 1e-8, "weight_decay": 0.0, "betas": (0.9, 0.999), "impl": None}


class FusedAdam(torch.optim.Optimizer):
    """Adam / AdamW over the multi-tensor kernels (op ``adam``), with torch.optim.AdamW's state layout.

    Args:
        params: iterable of parameters or of param groups (dicts).
        lr: learning rate (> 0 or 0). betas: (beta1, beta2) in [0, 1). eps: > 0 or 0, added to sqrt(v_hat).
            ``lr`` and ``betas`` may be one-element tensors (the betas both or neither, as in torch.optim.AdamW; kept
            as 0-d tensors): the reference path (``torch``) computes with them as tensors, as torch.optim.AdamW does,
            with the same results (with ``bias_correction=True``; without it, which torch does not offer, and on the
            kernel paths, they are read as Python floats: a host sync where such a tensor is on the GPU).
        weight_decay: >= 0, default 0.0 as Apex's and DeepSpeed's FusedAdam (torch.optim.AdamW's default is 0.01:
            pass it when replacing AdamW); decoupled (``p *= 1 - lr * wd``, AdamW) with ``adam_w_mode=True``
            (default), L2 (``g += wd * p``, torch.optim.Adam) otherwise.
        Keyword-only (the positional order is torch.optim.AdamW's up to ``weight_decay``; AdamW's sixth,
        ``amsgrad``, was ``adam_w_mode`` here, so a sixth positional argument is a TypeError):
        adam_w_mode: decoupled weight decay (True, the default) or L2. ``decoupled_weight_decay`` is
            torch.optim.Adam's name for it: either may be given (a group keeps both keys, equal; different values
            are a ValueError).
        bias_correction: divide the moments by ``1 - beta**step`` (True, as torch).
        amsgrad, maximize, capturable, differentiable: must be False (the kernels have no AMSGrad, only minimize,
            keep the step on the host, and are not differentiable): ValueError otherwise.
        foreach, fused: taken for torch.optim.AdamW's signature and ignored (the step is always multi-tensor).
        impl: ``pipegoose``, ``torch_fused``, ``apex``, ``deepspeed``, ``torch``, or None/``auto``
            (``PIPEGOOSE_IMPL_ADAM``, then the GPU's tuning table, then that built-in order); any case.

    Parameters may be fp32, fp16 or bf16 (each kernel call takes one bucket of tensors that share device,
    dtypes and step); the moments have the parameter's dtype and the math is fp32 in the kernels (so fp16/bf16
    parameters are updated with one rounding, where torch.optim.AdamW rounds after each op).

    State per parameter: ``step`` (float32 scalar tensor on the CPU), ``exp_avg``, ``exp_avg_sq``, as
    torch.optim.AdamW keeps them, so state_dicts load both ways (param groups carry AdamW's keys too).

    Parameters of no elements: a bucket of only such parameters takes the reference path, which counts their step as
    torch does, and that is no fallback (strict mode takes it; dispatch source ``empty``), as for clip_grad_norm_.

    Kernels: ``pipegoose``: ours, pipegoose/kernels/csrc/multi_tensor_adam.cu (op ``pipegoose::adam_step``; one dtype
    for every list); ``torch_fused``: PyTorch's ``torch._fused_adamw_`` / ``torch._fused_adam_``
    (aten/src/ATen/native/cuda/FusedAdamWKernel.cu / FusedAdamKernel.cu of the installed torch, what
    ``torch.optim.AdamW(fused=True)`` runs; one dtype for every list, bias correction on); ``apex``: Apex's
    csrc/multi_tensor_adam.cu via ColossalAI 0.5.0 extensions/csrc/kernel/cuda/multi_tensor_adam_kernel.cu
    (Apache-2.0; ColossalAI adds a div_scale argument); ``deepspeed``: DeepSpeed 0.19.8 csrc/adam/multi_tensor_adam.cu
    (Apache-2.0, adapted from Apex's); ``torch``: ``torch.optim.adam.adam`` (see
    :mod:`pipegoose.nn.fusion.ops.multi_tensor`). On the H200 (benchmarks/results/nvidia_h200_2026-11-30, 100M-1B
    parameters, bf16 AdamW step): ours 3.61-3.72 TB/s (85-88% of the copy bandwidth), ``torch_fused`` 2.70-2.74, the
    Apex copy 1.45-1.46; the GPU's tuning table picks ours.

    Raises (when built, and from ``add_param_group`` for a group's own values):
        ValueError: bad hyper-parameters (lr, eps, weight_decay not finite and >= 0; betas not in [0, 1), or one a
            tensor and the other not), an ``impl`` that names no implementation of ``adam``, amsgrad, maximize,
            capturable or differentiable True, ``adam_w_mode`` and ``decoupled_weight_decay`` different.
        TypeError: complex or non-floating parameters, a hyper-parameter that is not a number, a switch that is not
            True or False, a sixth positional argument.

    Raises (from ``step``, before any parameter or state is changed):
        RuntimeError: a sparse gradient (any layout but ``torch.strided``).
        FusionFallbackError: in strict mode (``dispatch.strict()``, ``PIPEGOOSE_STRICT=1``), where no kernel takes a
            bucket of parameters (on the CPU, every bucket with elements; ``impl="torch"`` is no fallback).
        ValueError: ``PIPEGOOSE_IMPL_ADAM`` naming no implementation of ``adam`` (also when no parameter has a
            gradient), ``PIPEGOOSE_STRICT`` not a value :func:`dispatch.is_strict` takes; a group edited by hand
            since (the checks above, TypeError for a value that is not a number).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, adam_w_mode: bool | None = None,
                 bias_correction: bool = True, amsgrad: bool = False, maximize: bool = False,
                 capturable: bool = False, differentiable: bool = False, foreach: bool | None = None,
                 fused: bool | None = None, decoupled_weight_decay: bool | None = None,
                 impl: str | None = None) -> None:
        flags = dict(bias_correction=bias_correction, amsgrad=amsgrad, maximize=maximize, capturable=capturable,
                     differentiable=differentiable)
        for name, v in (("adam_w_mode", adam_w_mode), ("decoupled_weight_decay", decoupled_weight_decay)):
            if v is not None:
                flags[name] = v
        for name, v in (("foreach", foreach), ("fused", fused)):
            if v is not None and not isinstance(v, bool):
                raise TypeError(f"{name}: expected None, True or False, got {v!r}")
        self._check_flags(flags)
        if amsgrad:
            raise ValueError("amsgrad: FusedAdam does not support AMSGrad (the multi-tensor kernels have no max "
                             "state); use torch.optim.AdamW(amsgrad=True)")
        for name, why in (("maximize", "the kernels only minimize"), ("capturable", "FusedAdam keeps the step on "
                          "the host"), ("differentiable", "the kernels are not differentiable")):
            if flags[name]:
                raise ValueError(f"{name}: {name}=True is not supported by FusedAdam ({why})")
        decoupled = self._decoupled(flags)
        self._check_hyperparameters(dict(lr=lr, eps=eps, betas=betas, weight_decay=weight_decay, impl=impl))
        # tensor betas as 0-d tensors, as torch.optim.Adam/AdamW keep them (its _to_scalar)
        betas = tuple(b.squeeze() if torch.is_tensor(b) and b.dim() else b for b in betas)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam_w_mode=decoupled,
                        bias_correction=bias_correction, amsgrad=False, capturable=False, maximize=False,
                        foreach=foreach, differentiable=False, fused=fused, decoupled_weight_decay=decoupled,
                        impl=impl)
        super().__init__(params, defaults)  # each group through add_param_group: checked there

    @staticmethod
    def _decoupled(group: dict) -> bool:
        """A group's weight decay mode from ``adam_w_mode`` or ``decoupled_weight_decay`` (torch.optim.Adam's name,
        which torch.optim.AdamW state dicts carry), whichever it has (True when neither). A group with both, different,
        is a ValueError: they drifted apart per group, and a state dict loaded into torch.optim.Adam followed the
        other one (a walkthrough)."""
        a, d = group.get("adam_w_mode"), group.get("decoupled_weight_decay")
        if a is not None and d is not None and bool(a) != bool(d):
            raise ValueError(f"adam_w_mode={a!r} and decoupled_weight_decay={d!r}: one setting (decoupled weight "
                             "decay) under FusedAdam's and torch's names, given two values; give one, or set both "
                             "(group['adam_w_mode'] = group['decoupled_weight_decay'] = ...)")
        return bool(a if a is not None else d if d is not None else True)

    @staticmethod
    def _check_flags(group: dict) -> None:
        """The switches of a group that are present (``adam_w_mode``, ``bias_correction``, ``amsgrad``, ``maximize``,
        ``capturable``) must be True or False: a TypeError naming the argument otherwise (``bool("no")`` is True)."""
        for name in ("adam_w_mode", "decoupled_weight_decay", "bias_correction", "amsgrad", "maximize", "capturable",
                     "differentiable"):
            if name in ("adam_w_mode", "decoupled_weight_decay") and group.get(name, False) is None:
                continue  # not given: the other name, else True (:meth:`_decoupled`)
            if name in group and not isinstance(group[name], bool):
                raise TypeError(f"{name}: expected True or False, got {group[name]!r}")

    @staticmethod
    def _check_hyperparameters(group: dict) -> None:
        """The constructor's checks, for a param group too (``add_param_group``): ``lr``, ``eps``, ``weight_decay``
        finite numbers >= 0 (a 0-d tensor too), ``betas`` two numbers or two one-element tensors in [0, 1), ``impl``
        an implementation of ``adam`` (or None / ``auto``), the switches True or False (:meth:`_check_flags`).
        TypeError or ValueError naming the argument."""
        FusedAdam._check_flags(group)
        for name in ("lr", "eps", "weight_decay"):
            v = group[name]
            if isinstance(v, bool) or not isinstance(v, (numbers.Real, torch.Tensor)):   # numpy scalars too
                raise TypeError(f"{name}: expected a number, got {type(v).__name__}")
            if isinstance(v, torch.Tensor) and v.numel() != 1:
                raise ValueError(f"{name}: expected a number or a one-element tensor, got shape {list(v.shape)}")
            if not (0.0 <= float(v) < float("inf")):
                raise ValueError(f"{name}: expected a finite number >= 0, got {v}")
        for name, why in (("amsgrad", "the multi-tensor kernels have no max state; use torch.optim.AdamW("
                                      "amsgrad=True)"),
                          ("maximize", "the kernels only minimize"),
                          ("capturable", "FusedAdam keeps the step on the host"),
                          ("differentiable", "the kernels are not differentiable")):
            if group.get(name, False):
                raise ValueError(f"{name}: a param group with {name}=True is not supported by FusedAdam ({why})")
        betas = group["betas"]
        try:
            ok = len(betas) == 2 and all(not isinstance(b, bool) and 0.0 <= float(b) < 1.0 for b in betas)
        except (TypeError, ValueError, RuntimeError):   # (RuntimeError: float() of a tensor of several elements)
            ok = False
        if not ok:
            raise ValueError(f"betas: expected two values in [0, 1), got {betas!r}")
        if torch.is_tensor(betas[0]) != torch.is_tensor(betas[1]):
            # torch.optim.Adam/AdamW refuse it too ("betas must be either both floats or both Tensors")
            raise ValueError(f"betas: expected two numbers or two one-element tensors, not one of each, got {betas!r}")
        dispatch.check_impl(_mt.OP_ADAM, group.get("impl"))
        FusedAdam._decoupled(group)

    def add_param_group(self, param_group: dict) -> None:
        """``torch.optim.Optimizer.add_param_group``, with the constructor's checks of the group's hyperparameters
        (its own or the defaults).

        Raises:
            TypeError, ValueError: a bad ``lr``, ``eps``, ``weight_decay``, ``betas`` or ``impl``, named.
        """
        if isinstance(param_group, dict) and "params" in param_group:
            for k in ("adam_w_mode", "decoupled_weight_decay"):  # None: not given (the defaults' value); it was kept
                if k in param_group and param_group[k] is None:      # as None, and step read bool(None): L2 (review)
                    del param_group[k]
            own = {k: param_group[k] for k in ("adam_w_mode", "decoupled_weight_decay") if k in param_group}
            self._check_flags(own)
            if own:  # one of the two names given (or both, equal): the group keeps both, equal
                param_group["adam_w_mode"] = param_group["decoupled_weight_decay"] = self._decoupled(own)
            self._check_hyperparameters({**self.defaults, **param_group})
            params = param_group["params"]
            if not isinstance(params, set):  # (torch's add_param_group refuses a set, with its message)
                params = [params] if isinstance(params, torch.Tensor) else list(params)  # once: may be a generator
                for p in params:  # before the group is added: a refused group leaves the optimizer as it was
                    t = p[1] if isinstance(p, tuple) and len(p) == 2 else p   # (name, tensor), as torch takes them
                    if isinstance(t, torch.Tensor) and torch.is_complex(t):
                        raise TypeError("params: FusedAdam does not support complex parameters")
                    if isinstance(t, torch.Tensor) and not t.is_floating_point():
                        raise TypeError(f"params: expected floating point parameters, got {t.dtype}")
                param_group["params"] = params   # in place: torch keeps the caller's dict as the group
        super().add_param_group(param_group)

    @staticmethod
    def _check_loadable(groups: list) -> None:
        """Refuse param groups (e.g. saved by torch.optim.AdamW) asking for what the kernels do not do (amsgrad,
        maximize, capturable) or holding bad hyperparameters: :meth:`_check_hyperparameters`."""
        for group in groups:
            FusedAdam._check_hyperparameters({**_LOADABLE_DEFAULTS, **group})

    @staticmethod
    def _loaded_mode(group: dict, fallback: bool = True) -> dict:
        """A saved group with one weight decay mode under both names: ``adam_w_mode`` where it has it (FusedAdam's
        own key, the one its step read; a FusedAdam saved before the two were kept equal may hold a different
        ``decoupled_weight_decay``), else ``decoupled_weight_decay`` (torch.optim.Adam/AdamW), else ``fallback`` (an
        older torch state dict has neither: the loading optimizer's own setting). A copy; the caller's is kept."""
        a, d = group.get("adam_w_mode"), group.get("decoupled_weight_decay")
        mode = a if a is not None else d if d is not None else fallback
        if not isinstance(mode, bool):  # left as saved: the checks name it (bool("no") would be True)
            return dict(group)
        return {**group, "adam_w_mode": mode, "decoupled_weight_decay": mode}

    def __setstate__(self, state: dict) -> None:
        state = {**state, "param_groups": [self._loaded_mode(g) for g in state.get("param_groups", [])]}
        self._check_loadable(state["param_groups"])
        super().__setstate__(state)
        for group in self.param_groups:  # groups saved by torch.optim.Adam/AdamW lack our keys
            group.setdefault("bias_correction", True)
            group.setdefault("impl", None)
            for p in group["params"]:
                st = self.state.get(p)
                if st and not torch.is_tensor(st.get("step")):
                    st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)

    def load_state_dict(self, state_dict: dict) -> None:
        """``torch.optim.Optimizer.load_state_dict``, also from ``torch.optim.Adam``/``AdamW`` state dicts. The weight
        decay mode of a group is its ``adam_w_mode``, else its ``decoupled_weight_decay``, else this optimizer's.

        Raises:
            ValueError: a group asks for amsgrad or maximize, or holds a bad ``lr``, ``eps``, ``weight_decay``,
                ``betas`` or ``impl`` (checked before anything is loaded; TypeError for a value that is not a
                number).
        """
        now = [g.get("adam_w_mode", True) for g in self.param_groups]
        groups = [self._loaded_mode(g, now[i] if i < len(now) else True)
                  for i, g in enumerate(state_dict.get("param_groups", []))]
        state_dict = {**state_dict, "param_groups": groups}
        self._check_loadable(groups)
        super().load_state_dict(state_dict)
        self.__setstate__({"state": self.state, "param_groups": self.param_groups})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step over every parameter with a gradient; returns ``closure()``'s loss (or None).

        Every bucket's implementation is chosen, and whatever makes the step fail is raised, before any parameter or
        state is changed: a step that raises leaves the optimizer as it was.

        Raises:
            RuntimeError: a sparse gradient.
            FusionFallbackError: strict mode, and no kernel takes a bucket.
            ValueError: a bad ``PIPEGOOSE_IMPL_ADAM`` or ``PIPEGOOSE_STRICT``, or a group's bad hyperparameter
                (TypeError for one that is not a number); see the class docstring.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_loadable(self.param_groups)  # a group edited by hand after construction
        plan, fresh = self._plan()
        if not plan:   # no gradient: nothing chose, so a bad PIPEGOOSE_IMPL_ADAM is refused here (a review)
            dispatch.check_op_env(_mt.OP_ADAM)
        if dispatch.is_strict():
            for *_, choice in plan:
                if choice.fallback:
                    dispatch.record(choice)   # FusionFallbackError, before anything changed (a review: earlier
                                              # groups were stepped and later ones given state)
        for p, st in fresh.items():
            self.state[p].update(st)
        for group, hp, ps, step, choice in plan:
            grads = [p.grad for p in ps]
            m = [self.state[p]["exp_avg"] for p in ps]
            v = [self.state[p]["exp_avg_sq"] for p in ps]
            steps = [self.state[p]["step"] for p in ps]
            dispatch.record(choice)
            if choice.impl == "torch":   # (a tensor lr or betas as torch takes them: its math differs from a float's)
                tensors = {}
                beta1, beta2 = group["betas"]
                if hp["bias_correction"] and torch.is_tensor(group["lr"]):
                    tensors["lr"] = group["lr"]
                if hp["bias_correction"] and torch.is_tensor(beta1):
                    tensors["beta1"], tensors["beta2"] = beta1, beta2
                _mt.adam_step_reference(grads, ps, m, v, steps, **{**hp, **tensors})
            else:
                for s in steps:
                    s += 1
                _mt.adam_step_fused(choice.impl, grads, ps, m, v, step=step + 1, **hp)
        return loss

    def _plan(self) -> tuple[list[tuple[dict, dict, list, int, dispatch.Choice]], dict]:
        """The buckets of a step, each (group, hyperparameters as floats, parameters, step count, choice), chosen
        (``dispatch.choose``: not yet counted nor checked against strict mode), and the state of the parameters
        stepped for the first time (not yet in ``self.state``). Changes nothing.

        Raises:
            RuntimeError: a sparse gradient. ValueError: what :func:`dispatch.choose` raises (a bad
                ``PIPEGOOSE_IMPL_ADAM`` or ``PIPEGOOSE_STRICT``).
        """
        plan: list[tuple[dict, dict, list, int, dispatch.Choice]] = []
        fresh: dict[torch.Tensor, dict] = {}
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            hp = dict(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                      adam_w_mode=bool(group["adam_w_mode"]), bias_correction=bool(group["bias_correction"]),
                      weight_decay=float(group["weight_decay"]))
            buckets: dict[tuple, list] = defaultdict(list)
            states: dict[torch.Tensor, dict] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.layout != torch.strided:
                    raise RuntimeError(f"FusedAdam does not support sparse gradients (a gradient of layout "
                                       f"{p.grad.layout})")
                st = self.state.get(p)   # (not self.state[p]: the defaultdict would add an entry)
                if not st:
                    st = fresh[p] = dict(step=torch.tensor(0.0, dtype=torch.float32),
                                         exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                                         exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))
                states[p] = st
                key = (p.device, p.dtype, p.grad.dtype, st["exp_avg"].dtype, st["exp_avg_sq"].dtype,
                       int(st["step"].item()))
                buckets[key].append(p)
            for key, ps in buckets.items():
                problem = _mt.adam_problem([p.grad for p in ps], ps, [states[p]["exp_avg"] for p in ps],
                                           [states[p]["exp_avg_sq"] for p in ps], hp["bias_correction"])
                plan.append((group, hp, ps, key[-1], dispatch.choose(_mt.OP_ADAM, problem, group.get("impl"))))
        return plan, fresh


def _groups(grads: list[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    """The gradients by (device, dtype), in the order torch's clip_grad_norm_ takes the groups (its total norm
    stacks the groups' norms in that order, and vector_norm's result depends on it in the last bit)."""
    try:
        from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype
    except ImportError:   # (a private helper: without it, first appearance)
        groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        for g in grads:
            groups[(g.device, g.dtype)].append(g)
        return dict(groups)
    return {key: list(ts[0]) for key, (ts, _) in _group_tensors_by_device_and_dtype([grads]).items()}


def _result_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    return functools.reduce(torch.promote_types, dtypes)


@torch.no_grad()
def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None, *,
                    impl: str | None = None) -> torch.Tensor:
    """Drop-in for ``torch.nn.utils.clip_grad_norm_``: scale the gradients in place so that their total norm is
    at most ``max_norm``; return the total norm (before clipping) as a scalar tensor, on the first gradient's
    device, in the gradients' (promoted) dtype, as torch does.

    Per (device, dtype) group (op ``clip_grad_norm``; ``impl=`` or ``PIPEGOOSE_IMPL_CLIP_GRAD_NORM`` picks):
    ``pipegoose`` computes the norm with ``pipegoose::multi_tensor_norm`` (fp32 accumulation, fp32, fp16 and bf16
    gradients, ``norm_type`` 1, 2 or inf) and scales with ``pipegoose::multi_tensor_mul_``, which reads the
    coefficient on the device (no host sync) and skips the pass when it is 1 (gradients within ``max_norm``); the
    dispatcher's first choice where no tuning rule names another (kernel: pipegoose's
    pipegoose/kernels/csrc/clip_grad_norm.cu).
    ``apex`` computes the L2 norm with ``multi_tensor_l2norm`` (fp32 accumulation) and scales with
    ``multi_tensor_scale`` (fp32/fp16 gradients, ``norm_type=2``; one host sync reads the clip coefficient); kernels:
    Apex's csrc/multi_tensor_l2norm_kernel.cu and csrc/multi_tensor_scale_kernel.cu via ColossalAI 0.5.0
    extensions/csrc/kernel/cuda/ (Apache-2.0). Otherwise ``torch._foreach_norm`` / ``torch._foreach_mul_``. Both
    kernels decline gradients whose memory overlaps (a parameter listed twice), tensor subclasses (DTensor) and sparse
    gradients (any layout but ``torch.strided``: ``nn.Embedding(sparse=True)``'s): such a group takes torch's path,
    whole (its dense gradients too), as a fallback with that reason (counted; FusionFallbackError in strict mode), and
    the result is torch.nn.utils.clip_grad_norm_'s.

    Where a kernel's fp32 norm takes part, the groups' norms are combined in fp32 (fp64 with fp64 gradients) and the
    clip coefficient ``min(1, max_norm / (total + 1e-6))`` is computed from that total; the total returned is its
    rounding to the gradients' dtype. torch computes the coefficient from the rounded total: a bf16 coefficient for
    bf16 gradients, and for fp16 gradients whose norm exceeds 65504 (inf in fp16) a coefficient of 0, which zeroes
    them; here they are clipped to ``max_norm`` (the total returned is inf, as torch's). With no gradient:
    ``tensor(0.)``. ``foreach`` is taken for torch's signature and ignored (the paths above are multi-tensor
    already). No host sync on the ``pipegoose`` path with a number for ``max_norm`` and ``error_if_nonfinite=False``
    (reading a tensor ``max_norm`` and checking the total are syncs, as in torch).

    Raises:
        TypeError: ``max_norm`` or ``norm_type`` is not a number (or a one-element tensor); ``foreach`` not None, True
            or False; ``impl`` not a str or None.
        ValueError: ``max_norm`` is negative or nan (torch would flip the gradients' signs or make them nan), or
            ``norm_type`` is nan; ``impl`` or ``PIPEGOOSE_IMPL_CLIP_GRAD_NORM`` naming no implementation of
            ``clip_grad_norm``; another ``PIPEGOOSE_*`` variable with a value the dispatcher refuses
            (``dispatch.check_env``: e.g. ``PIPEGOOSE_STRICT=2``).
        FusionFallbackError: in strict mode (``dispatch.strict()``), where no kernel takes a group of gradients
            (every group with elements on the CPU; on a GPU, a group holding a sparse gradient, ...).
        RuntimeError: ``error_if_nonfinite`` and the total norm is nan/inf (gradients untouched).
    """
    if foreach is not None and not isinstance(foreach, bool):
        raise TypeError(f"foreach: expected None, True or False, got {foreach!r}")
    dispatch.check_impl(_mt.OP_CLIP, impl)   # on every call, also those without a gradient (a review)
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    else:   # torch's warning for a used-up generator (model.parameters() consumed before)
        is_generator = isinstance(parameters, types.GeneratorType)
        parameters = list(parameters)
        if is_generator and not parameters:
            warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=3)
    grads = [p.grad for p in parameters if p.grad is not None]
    max_norm, norm_type = _mt.number("max_norm", max_norm), _mt.check_norm_type(norm_type)
    if not max_norm >= 0:
        raise ValueError(f"max_norm: expected a number >= 0 (inf: no clipping), got {max_norm}")
    if not grads:
        dispatch.check_op_env(_mt.OP_CLIP)   # a bad PIPEGOOSE_IMPL_CLIP_GRAD_NORM is refused here too (a review)
        return torch.tensor(0.0)
    groups = _groups(grads)
    first = grads[0].device
    norms: list[torch.Tensor] = []
    ours: list[list[torch.Tensor]] = []
    fused: list[list[torch.Tensor]] = []
    plain: list[list[torch.Tensor]] = []
    for (dev, _), gs in groups.items():
        choice = dispatch.select(_mt.OP_CLIP, _mt.clip_problem(gs, norm_type), impl)
        if choice.impl == "pipegoose":
            norms.append(_mt.norm_ours(gs, norm_type))
            ours.append(gs)
        elif choice.impl == "apex":
            norms.append(_mt.l2norm_fused(gs))
            fused.append(gs)
        else:
            if dev.type in ("cuda", "cpu"):
                norms.extend(torch._foreach_norm(gs, norm_type))
            else:
                norms.extend(torch.linalg.vector_norm(g, norm_type) for g in gs)
            plain.append(gs)
    out_dtype = _result_dtype(g.dtype for g in grads)
    if ours or fused:
        # a kernel's norm (fp32) takes part: combine in fp32 (fp64 where fp64 gradients take part), and compute the
        # coefficient from that total, not from its rounding to a 16-bit dtype
        acc = torch.promote_types(torch.float32, out_dtype)
        total_acc = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(
            torch.stack([n.to(first, acc) for n in norms]), norm_type)
        total = total_acc.to(out_dtype)
    else:
        total_acc = total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), norm_type)
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so "
                           f"it cannot be clipped. To disable this error and scale the gradients by the non-finite "
                           f"norm anyway, set `error_if_nonfinite=False`")
    coef = torch.clamp(max_norm / (total_acc + 1e-6), max=1.0)
    for gs in plain:
        torch._foreach_mul_(gs, coef.to(gs[0].device))
    for gs in ours:  # the kernel reads coef on the device and returns at once when it is 1: no host sync
        _mt.mul_ours(gs, coef.to(gs[0].device, torch.float32))
    if fused:
        c = float(coef)  # host sync: the scale kernel takes a float
        if not c >= 1.0:  # 1.0 leaves the gradients unchanged; nan must still propagate as in torch
            for gs in fused:
                _mt.scale_fused(gs, c)
    return total
