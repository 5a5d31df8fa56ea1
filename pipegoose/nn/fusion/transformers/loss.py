"""The language-model losses of transformers on our cross-entropy kernel, and how ``fuse`` finds where to put them.

transformers' ``PreTrainedModel.loss_function`` returns the instance attribute ``_loss_function`` when one is set, else
the function of the model's loss type (``ForCausalLMLoss``, ``ForMaskedLMLoss``, ...). ``fuse`` sets that attribute on
the model (this instance only; ``unfuse`` removes it) to :func:`causal_lm_loss` or :func:`masked_lm_loss`: the same
arguments and result as transformers' functions (labels shifted and padded with ``ignore_index`` for the causal loss;
``num_items_in_batch`` turns the mean into a sum divided by it), with the logits' upcast to fp32 and
``F.cross_entropy`` replaced by :func:`pipegoose.nn.fusion.functional.cross_entropy`, which computes the same loss in
fp32 without the fp32 copy (2.5-3 GB less peak memory for a Llama-1.1B step of 8192 tokens of a 32000-word vocabulary).

Models whose forward builds its own ``CrossEntropyLoss()`` from its modeling module's globals instead (BERT's heads and
their copies) are routed through that global: :mod:`pipegoose.nn.fusion.transformers.inline_loss`.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import functional as PF
from . import inline_loss as _inline

# transformers' loss types whose functions these replace (LOSS_MAPPING keys)
LOSS_TYPES = {"ForCausalLM": "causal_lm_loss", "ForConditionalGeneration": "causal_lm_loss",
              "ForMaskedLM": "masked_lm_loss"}
# loss_support's name for a model whose forward calls its modeling module's CrossEntropyLoss (BERT's heads), which
# fuse() routes to our op through that global (pipegoose.nn.fusion.transformers.inline_loss)
INLINE = _inline.ROW_REPLACEMENT


def _reduce(logits: torch.Tensor, target: torch.Tensor, num_items_in_batch: Any, ignore_index: int) -> torch.Tensor:
    """transformers' ``fixed_cross_entropy``: the mean over the rows not ignored, or, with ``num_items_in_batch``, the
    sum divided by it."""
    if num_items_in_batch is None:
        return PF.cross_entropy(logits, target, ignore_index=ignore_index, reduction="mean")
    loss = PF.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, num_items_in_batch: Any = None,
                   ignore_index: int = -100, shift_labels: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` on :func:`~pipegoose.nn.fusion.functional.cross_entropy`.

    Args:
        logits: [batch, seq, vocab_size] (any float dtype: not upcast), labels: [batch, seq] int64 token ids
            (``ignore_index`` where no loss is wanted); token t predicts label t + 1 (the labels are shifted, the last
            position padded with ``ignore_index``), unless ``shift_labels`` [batch, seq] is given, already shifted.
        num_items_in_batch: None (mean over the counted tokens) or the count to divide the sum by (gradient
            accumulation); other keyword arguments are ignored, as transformers' function ignores them.

    Returns:
        The fp32 scalar loss. Raises what :func:`~pipegoose.nn.fusion.functional.cross_entropy` raises.
    """
    if logits.dtype == torch.float64:
        logits = logits.float()   # transformers' upcast (logits.float()) makes fp64 logits fp32 too
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    return _reduce(logits.reshape(-1, vocab_size), shift_labels.reshape(-1).to(logits.device), num_items_in_batch,
                   ignore_index)


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, num_items_in_batch: Any = None,
                   ignore_index: int = -100, **kwargs: Any) -> torch.Tensor:
    """transformers' ``ForMaskedLMLoss`` (no shift) on :func:`~pipegoose.nn.fusion.functional.cross_entropy`;
    arguments and result as :func:`causal_lm_loss`'s."""
    if logits.dtype == torch.float64:
        logits = logits.float()
    return _reduce(logits.reshape(-1, vocab_size), labels.reshape(-1).to(logits.device), num_items_in_batch,
                   ignore_index)


FUNCTIONS = {"causal_lm_loss": causal_lm_loss, "masked_lm_loss": masked_lm_loss}


def ours_is_set(model: nn.Module) -> bool:
    """Whether one of our loss functions is set on ``model`` (by :func:`pipegoose.nn.fusion.fuse`, or copied along with
    a fused model)."""
    fn = model.__dict__.get("_loss_function")
    return any(fn is f for f in FUNCTIONS.values())


def language_models(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of ``model`` and of the modules inside it whose class has transformers' ``loss_function``
    property (cheap: a class attribute), outermost first, each once."""
    return [(p, m) for p, m in model.named_modules() if isinstance(getattr(type(m), "loss_function", None), property)]


def _current_loss(model: nn.Module) -> Any:
    """``model.loss_function`` without transformers' "loss_type=None ... unrecognized" warning, which reading it logs
    for a model whose config names no loss type (GPT-2's, say: the default, the causal-LM loss, is meant)."""
    import logging

    log = logging.getLogger("transformers.modeling_utils")
    was = log.disabled
    log.disabled = True
    try:
        return model.loss_function
    finally:
        log.disabled = was


def _takes_labels(cls: type) -> bool:
    try:
        return "labels" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False


def loss_support(model: nn.Module) -> tuple[str | None, str, bool, str]:
    """(name of our loss function for ``model`` or None, reason, whether ``model`` is a candidate at all, the name of
    the loss it has). A candidate has transformers' ``loss_function`` property and a forward that takes ``labels``
    (a base model without a head, ``LlamaModel``, computes no loss: not a candidate).

    A candidate qualifies when its forward calls ``self.loss_function`` (among the names its code uses), no loss
    function is set on the instance already, and the loss type's function is transformers' causal- or masked-LM loss;
    or when its forward calls its modeling module's global ``CrossEntropyLoss`` and not ``self.loss_function``
    (BERT's masked-LM heads, RoBERTa's, ALBERT's, ...), that global is ``torch.nn.CrossEntropyLoss`` (or our
    dispatching subclass of it) and the model has output embeddings (a vocabulary): the name is then :data:`INLINE`,
    the loss it has ``CrossEntropyLoss (inline)``, and ``fuse`` routes those calls to our op through the global
    (:mod:`~pipegoose.nn.fusion.transformers.inline_loss`); likewise for a child loss module of the model's own that
    its forward calls (DistilBERT's ``mlm_loss_fct``: the loss it has ``CrossEntropyLoss (mlm_loss_fct)``), routed
    through the child's class. A global that another library patched, a child of a subclass, and a classifier (no
    output embeddings: BERT's sequence, token and multiple-choice heads), give a candidate with the reason and no
    name."""
    prop = getattr(type(model), "loss_function", None)
    if not isinstance(prop, property) or not _takes_labels(type(model)):
        return None, "", False, ""
    try:
        code = inspect.unwrap(type(model).forward).__code__
        names = code.co_names
    except (AttributeError, ValueError):
        names = ()
    if "loss_function" not in names:
        t = _inline.target(model)
        if t is None:
            why = (f"{type(model).__name__}.forward computes its loss without self.loss_function, its modeling "
                   f"module's {_inline.NAME} or one {_inline.NAME} child of its own (nn.CrossEntropyLoss() built in "
                   "the forward, say): nothing to replace per instance")
            return None, why, True, "its own loss"
        if not t.ok:
            return None, t.why, True, t.row
        if _inline.classes_of(model) is None:
            return None, (f"{type(model).__name__} has no output embeddings: a classifier, whose CrossEntropyLoss over "
                          "its labels is left to PyTorch (op cross_entropy is for a vocabulary's rows; PyTorch's path "
                          "also checks the labels)"), True, t.row
        return INLINE, t.reason(model), True, t.row
    if "_loss_function" in model.__dict__:
        name = getattr(model.__dict__["_loss_function"], "__name__", "loss_function")
        if ours_is_set(model):   # (fuse() reports it as a held row, fused, naming the call that set it)
            return None, f"pipegoose's {name} is set already: left as it is", True, name
        return (None, "a loss function is already set on this model (model.loss_function = ...): left as it is",
                True, name)
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING
    except ImportError as e:
        return None, f"transformers' LOSS_MAPPING is not importable: {e}", True, "loss_function"
    try:
        current = _current_loss(model)
    except Exception as e:  # noqa: BLE001 - a property that cannot answer: leave the model alone
        return None, f"model.loss_function raised {type(e).__name__}: {e}", True, "loss_function"
    name = getattr(current, "__name__", type(current).__name__)
    for loss_type, ours in LOSS_TYPES.items():
        if LOSS_MAPPING.get(loss_type) is current:
            return ours, (f"transformers' {name} -> {ours} (the same loss; where our kernel runs, no fp32 copy of the "
                          "logits)"), True, name
    return None, f"its loss is {name}, not a language-model cross-entropy", False, name


__all__ = ["causal_lm_loss", "masked_lm_loss", "loss_support", "language_models", "ours_is_set", "LOSS_TYPES",
           "FUNCTIONS", "INLINE"]
