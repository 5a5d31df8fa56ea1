"""A causal language model's head and loss in one (:func:`pipegoose.nn.fusion.functional.fused_linear_cross_entropy`),
put on a transformers model by ``fuse(model, ops=[..., "linear_cross_entropy"])`` (not part of the default ops: it
has not been measured on a GPU yet).

transformers' causal LMs (Llama, Mistral, Qwen2/3, GPT-NeoX, GPT-2, OPT, Bloom and their copies) compute
``logits = self.lm_head(hidden_states)`` and then ``self.loss_function(logits, labels, vocab_size, **kwargs)``. On a
fused model (this instance: an instance attribute ``forward``, which ``unfuse`` removes), a call in training mode with
``labels`` runs the model's own forward without them, with the head replaced for that call by one that records its
input and returns an empty tensor (no [B, S, V] logits), then computes transformers' causal-LM loss from the recorded
hidden states with :func:`fused_linear_cross_entropy`: the labels shifted by one and padded with ``ignore_index``
(or ``shift_labels`` as given), the mean over the counted tokens, or the sum divided by ``num_items_in_batch``. The
output's ``loss`` is that loss and its ``logits`` None, as Liger-Kernel's fused forward returns them in training.

Every other call runs the model's forward as it is: evaluation mode, no labels, ``return_dict=False``,
``logits_to_keep`` other than 0, a head that is not called exactly once in the forward (then the call is run again
the plain way, with a warning once per model class).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import functional as PF
from . import loss as _loss

NAME = "fused_linear_cross_entropy"
_warned: set[str] = set()


def head_of(model: nn.Module) -> nn.Linear | None:
    """The model's output projection (``get_output_embeddings()``) where it is a plain ``nn.Linear`` (its forward
    not overridden, on the class or the instance; no forward hooks), else None."""
    get = getattr(model, "get_output_embeddings", None)
    try:
        head = get() if callable(get) else None
    except Exception:  # noqa: BLE001 - a model that cannot say has no head we can use
        return None
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward or "forward" in head.__dict__:
        return None
    if head._forward_hooks or head._forward_pre_hooks:
        return None
    return head


def support(model: nn.Module) -> tuple[bool, str]:
    """(whether ``fuse`` can put the fused head and loss on ``model``, the reason): a transformers causal LM whose
    forward calls ``self.loss_function``, whose loss is the causal-LM cross-entropy (transformers' or ours), with a
    plain ``nn.Linear`` head and no logit post-processing (Gemma-2's soft-capping, Cohere's ``logit_scale``)."""
    name, reason, candidate, original = _loss.loss_support(model)
    ours = _loss.ours_is_set(model) and model.__dict__.get("_loss_function") is _loss.causal_lm_loss
    if not candidate:
        return False, "not a language model with transformers' loss_function"
    if name != "causal_lm_loss" and not ours:
        return False, f"its loss is {original or 'not transformers causal-LM loss'}: {reason}"
    if head_of(model) is None:
        return False, "its output projection (get_output_embeddings()) is not a plain torch.nn.Linear"
    config = getattr(model, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(config, attr, None) not in (None, 1, 1.0):
            return False, f"config.{attr} = {getattr(config, attr)!r}: its logits are post-processed after the head"
    if "forward" in model.__dict__:
        return False, "an instance attribute forward is set already: left as it is"
    return True, (f"lm_head + {original} -> {NAME} (in training with labels: no [B, S, V] logits; output.logits is "
                  "None then)")


class FusedLMForward:
    """The instance ``forward`` that ``fuse`` sets on a causal LM (see the module). Holds the model (a plain reference:
    a fused model pickles and deep-copies with it) and calls its class's forward."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        plain = type(model).forward
        try:
            bound = inspect.signature(plain).bind(model, *args, **kwargs)
        except TypeError:
            return plain(model, *args, **kwargs)   # let the model's forward raise its own error
        params = bound.arguments
        var_kw = next((n for n, p in bound.signature.parameters.items() if p.kind is p.VAR_KEYWORD), None)
        extra = params.get(var_kw, {}) if var_kw is not None else {}
        # (labels a named parameter, as in transformers' forwards, or inside **kwargs)
        where = params if "labels" in bound.signature.parameters else extra
        labels = where.get("labels")
        keep = params.get("logits_to_keep", extra.get("logits_to_keep", 0))
        if (labels is None or not model.training or params.get("return_dict", extra.get("return_dict")) is False
                or not (isinstance(keep, int) and keep == 0)):
            return plain(model, *args, **kwargs)
        head = head_of(model)
        if head is None:
            return plain(model, *args, **kwargs)
        where["labels"] = None
        seen: list[torch.Tensor] = []

        def record(x: torch.Tensor) -> torch.Tensor:
            seen.append(x)
            return x.new_empty(x.shape[:-1] + (0,))

        head.__dict__["forward"] = record
        try:
            out = plain(*bound.args, **bound.kwargs)
        finally:
            head.__dict__.pop("forward", None)
        from transformers.utils import ModelOutput

        fields = getattr(out, "__dataclass_fields__", {})
        if len(seen) != 1 or not isinstance(out, ModelOutput) or "logits" not in fields or "loss" not in fields:
            cls = type(model).__name__
            if cls not in _warned:
                _warned.add(cls)
                warnings.warn(f"{cls}: its forward called the output projection {len(seen)} time(s) or returned no "
                              f"ModelOutput; the fused head and loss need one call: this call (and each like it) "
                              f"runs the plain forward again", RuntimeWarning, stacklevel=2)
            return plain(model, *args, **kwargs)
        loss = causal_lm_head_loss(seen[0], head, labels, **{k: v for k, v in extra.items() if k != "labels"})
        # a new output of the same class (ModelOutput keeps its keys and attributes in step only when built so)
        return type(out)(**{k: v for k, v in out.items() if k not in ("loss", "logits")}, loss=loss)


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
    if num_items_in_batch is None:
        return PF.fused_linear_cross_entropy(hidden, head.weight, target, head.bias, ignore_index=ignore_index)
    loss = PF.fused_linear_cross_entropy(hidden, head.weight, target, head.bias, ignore_index=ignore_index,
                                         reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def install(model: nn.Module) -> FusedLMForward:
    fwd = FusedLMForward(model)
    model.__dict__["forward"] = fwd
    return fwd


def uninstall(model: nn.Module | None, fwd: FusedLMForward) -> None:
    """Remove ``fwd`` from ``model`` (nothing when the model is gone or its forward was replaced since)."""
    if model is not None and model.__dict__.get("forward") is fwd:
        del model.__dict__["forward"]


def is_installed(model: nn.Module) -> bool:
    return isinstance(model.__dict__.get("forward"), FusedLMForward)


__all__ = ["FusedLMForward", "causal_lm_head_loss", "head_of", "install", "uninstall", "is_installed", "support"]
