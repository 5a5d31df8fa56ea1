"""A causal language model's head and loss in one (:func:`pipegoose.nn.fusion.functional.fused_linear_cross_entropy`),
put on a transformers model by ``fuse(model, ops=[..., "linear_cross_entropy"])`` (not part of the default ops: on
the H200's Llama-1.1B training step it saved 0.5 GiB of peak memory at 0.1% fewer tokens/s, session 52). One backward
per forward: a second backward through the loss's graph (``retain_graph=True``) raises RuntimeError; set
``PIPEGOOSE_IMPL_FUSED_LINEAR_CROSS_ENTROPY=torch`` for code that needs one.

transformers' causal LMs (Llama, Mistral, Qwen2/3, Gemma, Phi, Phi-3, OLMo 1-3, StarCoder2, GLM, GLM-4, SmolLM3,
Helium, GPT-NeoX, GPT-2, OPT, Bloom and their copies) compute
``logits = self.lm_head(hidden_states)`` and then ``self.loss_function(logits, labels, vocab_size, **kwargs)``. On a
fused model (this instance: a forward pre-hook and a forward hook, which ``unfuse`` removes; the model's ``forward``
and its signature are untouched), a call in training mode with ``labels`` runs the model's forward without them, with
the head replaced for that call by one that computes, from its input, transformers' causal-LM loss with
:func:`fused_linear_cross_entropy` (inside the forward, so under the autocast the forward runs in: accelerate and the
Trainer put it around the forward, not around the hooks) and returns an empty tensor (no [B, S, V] logits): the
labels shifted by one and padded with ``ignore_index`` (or ``shift_labels`` as given), the mean over the counted
tokens, or the sum divided by ``num_items_in_batch``. The output's ``loss`` is that loss and its ``logits`` None, as
Liger-Kernel's fused forward returns them in training (code that reads ``outputs.logits`` in training, TRL's
``SFTTrainer`` without its Liger option for one, needs the logits: leave ``linear_cross_entropy`` out there; and
with ``logits`` None, ``output[1]`` and ``output.to_tuple()[1]`` are the next field, not the logits). Forward
pre-hooks put on the model after ``fuse`` see such a call without its labels (``labels=None``: the fused pre-hook
runs first and takes them out). A float64 model's loss is transformers' expression (its fp32 logits), as unfused.

Every other call runs the model's forward as it is: evaluation mode, no labels, ``return_dict=False`` (given, or
in the config), ``logits_to_keep`` other than 0, a loss function set on the model after ``fuse``, a head that is not called exactly once in the forward (then the call is run again
the plain way, with a warning once per model class), a head changed or hooked after ``fuse`` (FSDP2's
``fully_shard`` on the head, say: the model's own head and loss run, with a warning once per model class). The hooks
act on the module they are called for, so replicas
(``nn.DataParallel``), copies and DDP / FSDP wrappers get the same behaviour; a wrapper that calls the model's
``forward`` directly (``model.forward(...)``) runs no hooks, so there the model computes its logits and loss as
unfused (``fuse`` reports a model inside PEFT's tuners, which do so, as not fused). A call's state lives per thread
and module, not on the module (replicas share their ``__dict__``'s objects); a recorder left on the head by a call
interrupted with a BaseException (Ctrl-C runs no always-called hook) is removed by the next call and by ``unfuse``.

Only model types whose forward is verified to compute exactly ``CE(lm_head(hidden))`` are taken
(:data:`MODEL_TYPES`): others post-process the logits (Granite's ``logits_scaling``, Gemma-2's soft-capping), add a
router's auxiliary loss when given labels (Mixtral and the other MoE models), or build decoder inputs from the labels
(encoder-decoder models).
"""

from __future__ import annotations

import inspect
import threading
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import functional as PF
from . import loss as _loss

NAME = "fused_linear_cross_entropy"
# config.model_type of the causal LMs whose forward (transformers 5.25) is: base model, hidden states sliced by
# logits_to_keep, logits = lm_head(hidden), loss = self.loss_function(logits, labels, vocab_size, **kwargs), nothing
# else done with the labels or the logits. LLAMA_LIKE: those whose forward is LlamaForCausalLM's code, docstring and
# annotations aside: decorators, parameters, defaults and statements (tests/fuse/test_fuse_lm_head.py compares them
# with the installed transformers; support() also checks that the model's class runs that forward); the others were
# read one by one
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "phi", "olmo", "olmo2", "olmo3", "starcoder2",
              "glm", "glm4", "smollm3", "helium")
MODEL_TYPES = LLAMA_LIKE + ("gpt_neox", "gpt2", "opt", "bloom")
_warned: set[tuple[str, str]] = set()   # (model class, kind of fallback) warned about


def head_of(model: nn.Module) -> nn.Linear | None:
    """The model's output projection (``get_output_embeddings()``) where it is a plain ``nn.Linear`` (its forward
    not overridden, on the class or the instance; no forward hooks), else None."""
    get = getattr(model, "get_output_embeddings", None)
    try:
        head = get() if callable(get) else None
    except Exception:  # noqa: BLE001 - a model that cannot say has no head we can use
        return None
    if isinstance(head, nn.Module):
        _restore(head)   # (a recorder left by an interrupted call)
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward or "forward" in head.__dict__:
        return None
    if head._forward_hooks or head._forward_pre_hooks:
        return None
    return head


def support(model: nn.Module) -> tuple[bool, str]:
    """(whether ``fuse`` can put the fused head and loss on ``model``, the reason): a transformers causal LM of a
    verified type (:data:`MODEL_TYPES`, not encoder-decoder; its class's ``forward`` the one of transformers'
    causal-LM class for its config) whose forward calls ``self.loss_function``, whose loss is
    the causal-LM cross-entropy (transformers' or ours), with a plain ``nn.Linear`` head and no logit post-processing
    in its config."""
    name, reason, candidate, original = _loss.loss_support(model)
    ours = _loss.ours_is_set(model) and model.__dict__.get("_loss_function") is _loss.causal_lm_loss
    if not candidate:
        return False, "not a language model with transformers' loss_function"
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES or getattr(config, "is_encoder_decoder", False):
        return False, (f"model type {model_type!r}: not one whose forward is verified to compute "
                       f"CE(lm_head(hidden)) alone ({', '.join(MODEL_TYPES)})")
    mismatch = _forward_not_verified(model, config)
    if mismatch is not None:
        return False, mismatch
    if name != "causal_lm_loss" and not ours:
        return False, f"its loss is {original or 'not transformers causal-LM loss'}: {reason}"
    if head_of(model) is None:
        return False, "its output projection (get_output_embeddings()) is not a plain torch.nn.Linear"
    texts = [config] + ([config.get_text_config()] if callable(getattr(config, "get_text_config", None)) else [])
    for cfg in texts:
        for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling", "logits_soft_cap",
                     "output_multiplier_scale"):
            if getattr(cfg, attr, None) not in (None, 1, 1.0):
                return False, f"config.{attr} = {getattr(cfg, attr)!r}: its logits are post-processed after the head"
    if getattr(config, "output_router_logits", False):
        return False, "config.output_router_logits: its loss adds a router's auxiliary loss"
    if "forward" in model.__dict__:
        return False, "an instance attribute forward is set already: left as it is"
    if is_installed(model):
        return False, ("the fused head's hooks are on this model already (a copy of a fused model keeps them; unfuse "
                       "the original before copying): left as they are")
    return True, (f"lm_head + {original} -> {NAME} (in training with labels: no [B, S, V] logits; output.logits is "
                  "None then)")


def _forward_not_verified(model: nn.Module, config: Any) -> str | None:
    """None where ``model``'s class runs the ``forward`` of transformers' causal-LM class for its config (that class,
    or a subclass that does not override ``forward``): the code :data:`MODEL_TYPES` vouches for; else why not (a
    review: the type was taken from ``config.model_type`` alone, so remote code or a subclass keeping a verified
    type but computing more in its forward would have been fused)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except Exception:  # noqa: BLE001 - no causal-LM class of transformers' for this config (remote code, say)
        return (f"{type(config).__name__} has no causal-LM class in transformers' auto mapping: its forward is not "
                "one that was verified")
    if getattr(type(model), "forward", None) is not getattr(cls, "forward", None):
        return (f"{type(model).__name__}.forward is not {cls.__name__}.forward (a subclass or remote code that "
                "overrides it): not the forward that was verified")
    return None


def _bind(module: nn.Module, args: tuple, kwargs: dict) -> inspect.BoundArguments | None:
    try:
        return inspect.signature(type(module).forward).bind(module, *args, **kwargs)
    except (TypeError, ValueError):
        return None   # the model's forward raises its own error


# Calls in flight, per thread and module (id): nn.DataParallel's replicas share their __dict__'s objects and run in
# threads of their own, so the state of a call lives here, not on the module.
_calls = threading.local()


def _stack(module: nn.Module) -> list:
    per = getattr(_calls, "per_module", None)
    if per is None:
        per = _calls.per_module = {}
    return per.setdefault(id(module), [])


def _is_recorder(fn: Any) -> bool:
    return getattr(fn, "_pipegoose_recorder", False)


def _restore(head: nn.Module) -> None:
    """Remove a recorder left on ``head`` (a call interrupted by a BaseException, which runs no always-called hook)."""
    if _is_recorder(head.__dict__.get("forward")):
        del head.__dict__["forward"]


def _pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
    """Before the model's forward: for a call the fused head takes, the labels taken out of the call and the head
    replaced by a recorder that computes the loss where the head would run (under the forward's autocast: accelerate
    and the Trainer wrap the forward in it, not the hooks) and returns no logits; a stack entry per call (None: the
    call runs as it is)."""
    calls = _stack(module)
    while calls:   # a model's forward does not call itself: entries left here are from interrupted calls
        stale = calls.pop()
        if stale is not None:
            _restore(stale["head"])
    entry = None
    args, kwargs = tuple(args), dict(kwargs)   # (the call's own, kept for a plain rerun; binding copies them)
    bound = _bind(module, args, kwargs) if module.training else None
    loss_fn = module.__dict__.get("_loss_function", _loss.causal_lm_loss)   # (one set after fuse: not fused)
    if bound is not None and loss_fn is _loss.causal_lm_loss:
        params = bound.arguments
        var_kw = next((n for n, p in bound.signature.parameters.items() if p.kind is p.VAR_KEYWORD), None)
        extra = params.get(var_kw, {}) if var_kw is not None else {}
        # (labels a named parameter, as in transformers' forwards, or inside **kwargs)
        where = params if "labels" in bound.signature.parameters else extra
        labels = where.get("labels")
        keep = params.get("logits_to_keep", extra.get("logits_to_keep", 0))
        return_dict = params.get("return_dict", extra.get("return_dict"))
        if return_dict is None:
            return_dict = getattr(getattr(module, "config", None), "return_dict", True)
        head = head_of(module)
        takes = labels is not None and return_dict is not False and isinstance(keep, int) and keep == 0
        if takes and head is None:
            _warn_once(module, "head", "its output projection is no longer a plain torch.nn.Linear without hooks "
                       "(changed or hooked after fuse, e.g. by FSDP2's fully_shard on the head): this call (and each "
                       "like it) runs the model's own head and loss")
        if takes and head is not None:
            where["labels"] = None
            loss_extra = {k: v for k, v in extra.items() if k != "labels"}
            losses: list[torch.Tensor] = []

            def record(x: torch.Tensor) -> torch.Tensor:
                # a second call, or hidden states not one per label: not transformers' pattern (the post-hook reruns
                # the forward plainly)
                ok = not losses and tuple(x.shape[:-1]) == tuple(labels.shape)
                losses.append(causal_lm_head_loss(x, head, labels, **loss_extra) if ok else None)
                return x.new_empty(x.shape[:-1] + (0,))

            record._pipegoose_recorder = True
            head.__dict__["forward"] = record
            entry = dict(head=head, losses=losses, args=args, kwargs=kwargs)
            calls.append(entry)
            return bound.args[1:], bound.kwargs
    calls.append(entry)
    return None


def _post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    """After the model's forward (also when it raised an Exception: ``always_call``): the head put back; for a fused
    call, the output rebuilt with the loss and without logits."""
    calls = _stack(module)
    entry = calls.pop() if calls else None
    if not calls:
        getattr(_calls, "per_module", {}).pop(id(module), None)
    if entry is None:
        return None
    _restore(entry["head"])
    if output is None:   # the forward raised: the exception goes on
        return None
    from transformers.utils import ModelOutput

    fields = getattr(output, "__dataclass_fields__", {})
    losses = entry["losses"]
    if len(losses) != 1 or losses[0] is None or not isinstance(output, ModelOutput) or "logits" not in fields or "loss" not in fields:
        _warn_once(module, "calls", f"its forward called the output projection {len(losses)} time(s) or returned no "
                   f"ModelOutput; the fused head and loss need one call: this call (and each like it) runs the plain "
                   f"forward again")
        return type(module).forward(module, *entry["args"], **entry["kwargs"])   # (no hooks: not through __call__)
    # a new output of the same class (ModelOutput keeps its keys and attributes in step only when built so)
    return type(output)(**{k: v for k, v in output.items() if k not in ("loss", "logits")}, loss=losses[0])


def _warn_once(module: nn.Module, what: str, message: str) -> None:
    """A RuntimeWarning, once per model class and kind of fallback, for a fused model's call that runs unfused."""
    cls = type(module).__name__
    if (cls, what) not in _warned:
        _warned.add((cls, what))
        warnings.warn(f"{cls}: {message}", RuntimeWarning, stacklevel=3)


def causal_lm_head_loss(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, num_items_in_batch: Any = None,
                        ignore_index: int = -100, shift_labels: torch.Tensor | None = None,
                        **_: Any) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` of ``head(hidden)`` without the logits: :func:`fused_linear_cross_entropy`
    of hidden [B, S, H] and the labels [B, S] shifted by one (the last position padded with ``ignore_index``), or
    ``shift_labels`` as given; the mean over the counted tokens, or the sum divided by ``num_items_in_batch``. The
    other keyword arguments (the model's) are ignored, as transformers' function ignores them."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.reshape(-1).to(hidden.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    if hidden.dtype == torch.float64:
        # transformers' loss rounds a float64 model's logits to fp32 too (logits.float()), which the functional does
        # not (fp64 in, fp64 out): the model's own expression, for the same loss
        logits = F.linear(hidden, head.weight, head.bias).float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target, ignore_index=ignore_index,
                               reduction=reduction)
    else:
        loss = PF.fused_linear_cross_entropy(hidden, head.weight, target, head.bias, ignore_index=ignore_index,
                                             reduction=reduction)
    if num_items_in_batch is None:
        return loss
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def install(model: nn.Module) -> tuple:
    """The hooks on ``model``; returns their handles (for :func:`uninstall`)."""
    pre = model.register_forward_pre_hook(_pre_hook, with_kwargs=True)
    post = model.register_forward_hook(_post_hook, with_kwargs=True, always_call=True)
    return pre, post


def uninstall(model: nn.Module | None, handles: tuple) -> None:
    """Remove the hooks, and a recorder an interrupted call left on the head (nothing where the model is gone)."""
    for h in handles:
        h.remove()
    if model is not None:
        get = getattr(model, "get_output_embeddings", None)
        try:
            head = get() if callable(get) else None
        except Exception:  # noqa: BLE001
            head = None
        if isinstance(head, nn.Module):
            _restore(head)


def is_installed(model: nn.Module) -> bool:
    return any(h is _pre_hook for h in model._forward_pre_hooks.values())


__all__ = ["LLAMA_LIKE", "MODEL_TYPES", "causal_lm_head_loss", "head_of", "install", "uninstall", "is_installed",
           "support"]
