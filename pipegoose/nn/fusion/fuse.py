"""``fuse(model)``: swap a constructed model's LayerNorms, RMSNorms, SwiGLU and GeGLU MLPs, rotary position
embedding, language-model loss and attention softmax for the fused ones, per instance, with an exact undo
(``unfuse``) and a report of what was done (``FusionReport``).

What is replaced (model knowledge lives in ``pipegoose.nn.fusion.transformers``):

* every ``torch.nn.LayerNorm`` -> ``MixedFusedLayerNorm`` (same ``weight``/``bias`` Parameter objects);
* every module that computes RMSNorm, found by a numerical probe (``transformers.matching.probe_rms_norm``) ->
  ``FusedRMSNorm`` (same ``weight``), Gemma's ``x_normed * (1 + weight)`` (``GemmaRMSNorm`` of Gemma, Gemma 2 and
  Gemma 3, its per-head ``q_norm`` / ``k_norm`` too, and copies such as Qwen3-Next's) with ``weight_offset=1.0``
  (the row's reason says "Gemma style");
* with ``rms_norm_gated`` in ``ops`` (opt-in), every gated RMSNorm (``forward(hidden_states, gate)``) that computes
  Qwen3-Next's and Qwen3.5's formula (the norm, then ``silu`` of the gate) or Mamba2's (``silu`` of the gate, then the
  norm over groups of its ``group_size``: Bamba's, Nemotron-H's, Zamba2's, Granite-4's copies), found by a numerical
  probe (``transformers.matching.probe_rms_norm_gated``) -> ``FusedRMSNormGated`` (same ``weight``, the probe's order
  and group; op ``rms_norm_gated``), kind ``rms_norm_gated`` (since session 78; the gate first since session 79);
* every norm without parameters that computes RMSNorm or LayerNorm over the last dimension in fp32 with one rounding
  to the input's dtype, found by a numerical probe (``transformers.matching.probe_weightless_norm``, which reads an
  epsilon written in the forward from its output): Gemma 4's ``v_norm`` and its router's ``norm``
  (``Gemma4RMSNorm(with_scale=False)``) -> ``FusedRMSNorm`` over the last dimension of each input, OLMo's
  ``OlmoLayerNorm`` -> ``MixedFusedLayerNorm(elementwise_affine=False, output_in_input_dtype=True)``;
* every LayerNorm of a class of its own with a 1-D ``weight`` (and maybe a ``bias``) that computes LayerNorm in fp32
  with one rounding to the input's dtype, found by a numerical probe (``transformers.matching.probe_layer_norm_module``,
  asked before the RMSNorm probe, whose answer stands unless the module computed LayerNorm's formula): Cohere's and
  Cohere 2's ``CohereLayerNorm`` -> ``MixedFusedLayerNorm`` sharing its parameters, kind ``layer_norm``;
* Nemotron's ``NemotronLayerNorm1P`` (a ``torch.nn.LayerNorm`` subclass of ``F.layer_norm(x, shape, weight + 1,
  bias, eps)``, found by its class name, ``LayerNorm1P``, and a numerical probe: ``transformers.matching.
  probe_layer_norm_1p``) -> ``MixedFusedLayerNorm(apply_layernorm_1p=True)`` sharing its parameters (the scale's sum
  and the autocast rule as its own), kind ``layer_norm`` (since session 73);
* every module that computes ``down_proj(silu(gate_proj(x)) * up_proj(x))``, found by a numerical probe
  (``transformers.matching.probe_swiglu_mlp``: transformers' ``LlamaMLP`` and its copies in Mistral, Qwen2, Qwen3, ...)
  -> ``FusedSwiGLUMLP`` (the same projection modules; the activation and product in one kernel, op ``swiglu``), and
  every module that computes it with gate and up in one projection, ``down_proj(silu(gate) * up)`` of ``gate, up =
  gate_up_proj(x).chunk(2, -1)`` (the same probe: transformers' ``Phi3MLP``, Phi-3 and Phi-4-mini, and ``GlmMLP`` /
  ``Glm4MLP``) -> ``FusedGateUpSwiGLUMLP`` (the same modules; op ``swiglu.packed``, whose implementation the row's
  columns show, ``PIPEGOOSE_IMPL_SWIGLU_PACKED`` or ``PIPEGOOSE_IMPL_SWIGLU`` forces); both are kind ``swiglu``;
* every module that computes ``down_proj(gelu(gate_proj(x)) * up_proj(x))``, GELU exact or with the tanh
  approximation (the same probe, which tells the activation: transformers' ``GemmaMLP``, ``Gemma2MLP``,
  ``Gemma3MLP``) -> ``FusedGeGLUMLP`` (the same modules; op ``geglu`` with the probe's ``approximate``), kind
  ``geglu``;
* every module that computes T5 v1.1's gated MLP ``wo(dropout(act(wi_0(x)) * wi_1(x)))`` with ``act`` SiLU or GELU
  (the same probe, layout ``wi_0/wi_1/wo``: transformers' ``T5DenseGatedActDense`` of T5 v1.1, Flan-T5 and mT5,
  ``UMT5DenseGatedActDense``, ``LongT5DenseGatedActDense`` and the other copies) -> ``FusedT5DenseGatedActDense``
  (the same modules, its ``dropout`` called where T5 calls it and T5's cast of the product to ``wo.weight``'s dtype
  where the MLP's forward has it; op ``geglu``, kind ``geglu`` for GELU, op and kind ``swiglu`` for SiLU; the row's
  reason names the layout). Clamped SwiGLU (``swiglu_limit``), other activations (QuickGELU, ReLU), GELU with gate
  and up in one ``gate_up_proj`` (no fused module computes it; a ``swiglu`` row) and MLPs with more inside (Zamba2's
  adapters) get a skipped row, not eligible; the original T5's ``T5DenseActDense`` (ReLU, not gated) is no
  candidate;
* every module that computes Granite's shared MLP ``output_linear(silu(gate) * up)`` of ``gate, up =
  input_linear(x).chunk(2, -1)`` (the same probe, layout ``input_linear/output_linear``: ``GraniteMoeSharedMLP``,
  ``GraniteMoeHybridMLP``, Granite 4.0's) -> ``FusedGraniteMLP`` (op ``swiglu.packed``, kind ``swiglu``; session 72),
  and LFM2's ``w2(silu(w1(x)) * w3(x))`` (layout ``w1/w3/w2``: ``Lfm2MLP``) -> ``FusedLfm2MLP`` (op ``swiglu``);
* every module that computes ModernBERT's MLP ``Wo(drop(act(input) * gate))`` of ``input, gate = Wi(x).chunk(2,
  -1)`` (the same probe, layout ``Wi/Wo``: ``ModernBertMLP``, ``ModernBertDecoderMLP``) -> ``FusedModernBertMLP`` (the
  same modules, its dropout called where the MLP calls it; op ``geglu.packed`` for GELU, its default, kind ``geglu``;
  ``swiglu.packed`` for SiLU, kind ``swiglu``; since session 72);
* every GELU activation module (the MLPs without a gate, ``fc2(act(fc1(x)))``, and wherever else a model holds one:
  a head's ``transform_act_fn``), found by its class name (``gelu`` in it: a leaf without parameters or buffers) and
  a numerical probe (``transformers.matching.probe_gelu``: its forward against exact and tanh GELU):
  transformers' ``NewGELUActivation`` (``gelu_new``: GPT-2, GPT-J, Phi, CodeGen), ``FastGELUActivation``,
  ``GELUActivation``, ``GELUTanh``, Bloom's ``BloomGelu``, ``torch.nn.GELU`` -> ``FusedGELU`` (op ``gelu``, the
  probe's ``approximate``; the module's hooks kept, as for the norms), kind ``gelu`` (since session 72). Those of
  gated MLPs and MoE experts fused by this call or an earlier one are left alone (the fused module keeps but does
  not call them), also where another module shares them; ``QuickGELUActivation``, a clipped GELU and other
  functions named so get a skipped row, not eligible. A gated MLP whose activation an earlier ``fuse()`` replaced
  by a ``FusedGELU`` is skipped with that reason (unfuse first);
* every squared ReLU activation module (``relu(x)^2``: transformers' ``ReLUSquaredActivation``, ``relu2``, of the MLPs
  without a gate of Nemotron, Nemotron-H, Persimmon, Arcee, Jais2, NanoChat), found by its class name (``relu`` with
  ``square`` or ``relu2`` in it: a leaf without parameters or buffers) and a numerical probe
  (``transformers.matching.probe_squared_relu``) -> ``FusedSquaredReLU`` (op ``squared_relu``; hooks kept), kind
  ``squared_relu`` (since session 73); a function named so that computes another (a clipped one) gets a skipped row,
  not eligible;
* the rotary position embedding of every attention module whose forward calls its modeling module's
  ``apply_rotary_pos_emb`` (Llama, Mistral, Qwen2, Qwen3, Gemma, GPT-NeoX with full rotary, ...), where that
  function is transformers' rotate-half RoPE, or an interleaved one (pairs of neighbours: Cohere's, GLM's, since
  session 71; checked numerically): the module is not replaced but gets two hooks, and
  its plain calls run op ``rope`` (query and key in one kernel) through a dispatching function at that global name
  (``pipegoose.nn.fusion.transformers.rope`` says how; the report's row has the module's path and kind ``rope``).
  GPT-NeoX's partial rotary too, where the module's function computes it: each call runs the kernel where the
  dispatcher chooses it (asked per call: a model fused on the CPU runs it once moved to a GPU), else the model's own
  code. So do calls whose dtypes the function computes otherwise than the op's PyTorch path, within the dtype's
  rounding (OLMo's: its fp32 tables in a bf16 model, its results cast back to bf16; the kernel's are cast as its
  are); calls of dtypes it computes otherwise still run its code, as the op's fallback. Modules that rotate part of
  each head by passing the rotated values alone, with tables of that width (Phi's, StableLM's: their function raises
  for narrower tables), make plain whole-width calls and are fused so. Interleaved RoPE and partial rotary with
  narrower tables that the function computes otherwise than GPT-NeoX's do, which the config names, are reported as
  skipped;
* the loss of a transformers language model whose forward calls ``self.loss_function`` and whose loss is
  transformers' ``ForCausalLMLoss`` or ``ForMaskedLMLoss``: the instance's ``loss_function`` is set to
  ``pipegoose.nn.fusion.transformers.loss.causal_lm_loss`` / ``masked_lm_loss`` (the same loss on our kernel, op
  ``cross_entropy``, without the fp32 copy of the logits; the report's row for it has the language model's path:
  ``""`` for the model itself, or the path of one inside a wrapper, PEFT's ``PeftModel`` say);
* the loss of a transformers model whose forward builds its own ``CrossEntropyLoss()`` from its modeling module's
  global of that name and does not call ``self.loss_function`` (BERT's masked-LM and pre-training heads; RoBERTa's,
  XLM-R's, ALBERT's), where that global is ``torch.nn.CrossEntropyLoss`` and the model has output embeddings (a
  classifier's loss over its labels is left to PyTorch, with the reason): the model is not replaced but gets two
  hooks, and the global becomes a dispatching subclass of ``torch.nn.CrossEntropyLoss`` whose calls made by a fused
  model's forward itself run op ``cross_entropy`` where they qualify (scores over the model's vocabulary; no class
  weight or label smoothing; [N, V] fp32/fp16/bf16 scores, [N] int64 labels; the loss in the dtype PyTorch's gives),
  PyTorch's own forward otherwise (``pipegoose.nn.fusion.transformers.inline_loss``; the row:
  kind ``cross_entropy``, ``CrossEntropyLoss (inline) -> op cross_entropy``; inside PEFT, whose tuner calls the
  model's forward directly, skipped). A global that another library patched is reported as skipped. A masked LM
  that calls a ``torch.nn.CrossEntropyLoss`` child of its own instead (DistilBERT's ``mlm_loss_fct``) is routed the
  same way through that child's class (the row: ``CrossEntropyLoss (mlm_loss_fct) -> op cross_entropy``);
* with ``ops`` naming ``linear_cross_entropy`` (opt-in), a causal LM's head and loss in one: two forward hooks that,
  in training with ``labels``, run the model without the [B, S, V] logits and compute transformers' causal-LM
  loss with ``fused_linear_cross_entropy`` (``pipegoose.nn.fusion.transformers.lm_head``; the output's ``logits`` is
  None then);
* the attention softmax of BERT, GPT-2, GPT-NeoX, Llama and OPT models: the model's modules are pointed at a copy of
  its config whose ``_attn_implementation`` is ``"pipegoose"`` (our function in transformers' ``AttentionInterface``)
  or ``"pipegoose_sdpa"`` (ours where the GPU's tuning table says so, SDPA otherwise). The copy keeps other models
  that share the config object unchanged; while fused, change the configuration through ``model.config`` (the
  copy): a reference to the config object taken before ``fuse`` no longer reaches the model. ``unfuse`` carries the
  copy's changes back to the original config and leaves alone the attributes the copy did not change. A module
  without a transformers config of its own (a wrapper: a training module holding the model, ``nn.DataParallel``)
  has the attention of each transformers model inside it fused so, through that model's config (the outermost
  ``PreTrainedModel``: a causal LM's base model shares its config), each with a copy of its own;
* Bloom's attention (``BloomAttention``: ALiBi; it does not go through the interface), whose class's forward computes
  Bloom's formula (``transformers.bloom.probe_bloom_attention``) -> ``FusedBloomAttention`` (the same projection and
  dropout modules; ALiBi and the mask as one bias, built once per forward pass, on our attention function: SDPA with
  the bias, on CUDA and off it, the fused masked softmax where the tuning table or ``PIPEGOOSE_IMPL_ATTENTION`` asks
  and for attention weights), kind ``attention`` (since session 74); ``attention="keep"`` leaves it;
* MPT's attention (``MptAttention``: ALiBi, eager only in transformers too), whose class's forward computes MPT's
  formula (``transformers.mpt.probe_mpt_attention``) -> ``FusedMptAttention`` (the same ``Wqkv`` and ``out_proj``;
  ALiBi, query-relative, and the mask as one bias, once per forward pass, on the same paths as Bloom's), kind
  ``attention``; ``attention="keep"`` leaves it. ``MptBlock`` does not pass ``output_attentions`` to its attention:
  the module holding each fused one (where its forward takes ``output_attentions``) gets a forward pre-hook and an
  always-called forward hook that pass each call's request to it (``transformers.mpt.watch_output_attentions``:
  detached weights besides the output), removed by ``unfuse``.

Rows of what another ``fuse()`` call fused (of a part of the model, of a model or wrapper holding it) are reported as
held: fused, naming that call, whatever ``ops`` says; this call leaves them as they are and records nothing for them.

Skipped, with the reason in the report: LayerNorm subclasses with their own forward (but LayerNorm1P), norms whose
forward is set on the instance (accelerate's ``device_map`` / offloading hooks, patches: a fused module would bypass
it), norms whose weight or bias is computed rather than a Parameter of their own (``torch.nn.utils.parametrize``,
the hook-based ``torch.nn.utils.weight_norm``), whose Parameters a fused module cannot share, gated RMSNorms
(``forward(x, gate)``: Qwen3-Next's, Mamba2's and their copies are fused with ``rms_norm_gated`` in ``ops``, opt-in)
and RMSNorms whose weight broadcasts over other widths. RMSNorms are fused
over whatever size they normalize: the hidden size, a head's (Qwen3's ``q_norm`` / ``k_norm`` over ``head_dim``) or
a projection's.

Two module globals change, nothing else of transformers or torch: a modeling module's ``apply_rotary_pos_emb`` while
a module of it is fused for ``rope`` (or, where it is transformers 5's ``kernels`` wrapper module, that wrapper's
``forward``), routed through a function that runs the model's own code for every call that does not come from a fused
module (other models compute exactly what they did), and a modeling module's ``CrossEntropyLoss`` while a model of it
is fused for its inline loss, routed through a subclass that runs ``torch.nn.CrossEntropyLoss``'s forward for every
call that does not come from a fused model; each is put back when the last one is unfused. No class changes; two
models in one process can be fused differently. Parameters stay the same objects, so ``state_dict()`` keys and tensors,
and optimizers built before fusing, are unaffected. A replacement module shares the hook dictionaries of the module it
replaces (forward, pre-forward, backward and state-dict hooks keep firing, and their handles still remove them), its
training flag and its other instance attributes. Parameters and buffers replaced while fused
(``load_state_dict(assign=True)``, ``to_empty``), ``eps`` and carried attributes changed on the replacement are handed
back to the original modules by ``unfuse``.

Limit: the undo record is kept where ``state_dict`` and pickling see nothing of it (a table keyed weakly by the
model, and on each replacement an attribute that copies and pickles leave out), hence a
``copy.deepcopy`` or a pickled-and-loaded fused model stays fused and cannot be unfused: ``unfuse`` raises a
RuntimeError on it, saying so, and changes nothing (a copy whose attention alone was fused cannot be told from a model
configured with pipegoose attention: ``unfuse`` returns False for it). Unfuse before copying, or copy the unfused
model and fuse the copy. RoPE and the inline loss are the exception to "stays fused": a copy's attention modules (a
copy of a BERT-style model) carry the hooks, but their calls run the model's own RoPE code (PyTorch's
``CrossEntropyLoss``) unless a fused original keeps the dispatching function (class) installed in the process.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from torch.nn.utils import parametrize

from .modules import ORIGINAL_ATTR as _ORIGINAL
from .transformers import bloom as _bloom
from .transformers import experts as _experts
from .transformers import inline_loss as _inline
from .transformers import lm_head as _lm_head
from .transformers import loss as _loss
from .transformers import matching
from .transformers import mpt as _mpt
from .transformers import rope as _rope

OPS = ("layer_norm", "rms_norm", "swiglu", "geglu", "gelu", "squared_relu", "rope", "cross_entropy", "attention",
       "rms_norm_gated", "linear_cross_entropy")
# the kinds fused only when ops names them: linear_cross_entropy (the LM head and loss in one: it saved memory but not
# time on the H200's Llama-1.1B step, session 51) and rms_norm_gated (Qwen3-Next's gated norm on two ops, written in
# session 78 without a GPU: not yet timed in a training step)
OPT_IN = ("rms_norm_gated", "linear_cross_entropy")
# what ops=None fuses: all but the opt-in kinds
DEFAULT_OPS = tuple(o for o in OPS if o not in OPT_IN)
ATTENTION_CHOICES = ("auto", "pipegoose", "keep")

# Hook dictionaries a replacement shares with the module it replaces (those present in this torch version).
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
               "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
_HOOK_FLAGS = ("_is_full_backward_hook",)


@dataclass(frozen=True)
class _OwnAttention:
    """A model's attention module that does not go through transformers' AttentionInterface and that fuse replaces
    by a module of ours (Bloom's, MPT's: ALiBi): how it is found (``candidate``, by class name), probed, built
    (``fused.from_module``), which attributes fuse carries over (``carried``), the words of its row and its name in
    the bare-model row (``owner``)."""

    candidate: Callable[[nn.Module], bool]
    probe: Callable[[nn.Module], Any]
    fused: type
    carried: tuple
    words: str
    owner: str


_OWN_ATTENTIONS = (
    _OwnAttention(_bloom.candidate, _bloom.probe_bloom_attention, _bloom.FusedBloomAttention, _bloom.CARRIED,
                  "ALiBi and the mask as one bias", "Bloom's"),
    _OwnAttention(_mpt.candidate, _mpt.probe_mpt_attention, _mpt.FusedMptAttention, _mpt.CARRIED,
                  "ALiBi (query-relative) and the mask as one bias", "MPT's"),
)
_OWN_FUSED = tuple(a.fused for a in _OWN_ATTENTIONS)


def _own_attention(module: nn.Module) -> _OwnAttention | None:
    """The :class:`_OwnAttention` whose candidate ``module`` is, or None."""
    return next((a for a in _OWN_ATTENTIONS if a.candidate(module)), None)


# ----------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class FusionRow:
    """One (module, kind) considered by :func:`fuse` (an attention module can have a ``rope`` and an ``attention``
    row).

    Attributes:
        path: dotted module path in the model (``""`` for the model itself).
        kind: ``layer_norm``, ``rms_norm``, ``swiglu`` (a SwiGLU MLP: Llama's; T5's gated MLP with SiLU; a MoE
            layer's experts module of SiLU, whose gate runs op ``swiglu.packed``: replacement ``FusedExpertsGate``),
            ``geglu`` (a GeGLU MLP: Gemma's; T5's gated MLP with GELU, Flan-T5's; a MoE layer's experts module of
            GELU, Gemma 4's, whose gate runs op ``geglu.packed``), ``gelu`` (a GELU activation module: GPT-2's),
            ``squared_relu`` (a squared ReLU activation module: Nemotron's), ``rope`` (an attention module's rotary
            embedding), ``cross_entropy`` (the model's loss), ``linear_cross_entropy`` (a causal LM's head and loss
            in one), ``rms_norm_gated`` (a gated RMSNorm, Qwen3-Next's: opt-in) or ``attention``.
        original: class name of the module found.
        replacement: class name (or attention function) put in its place; None when skipped.
        fused: whether it was (or, in a dry run, would be) replaced.
        forward, backward: the implementation the dispatcher picks for it on its current device and the dtype of
            its parameters (``pipegoose``, ``megatron``, ``apex``, ``torch`` ...; ``(fallback)`` when the fused
            paths cannot take it; attention: for a sequence length of 128, ``@128``), for inputs of at least
            ``PIPEGOOSE_SMALL_NUMEL`` elements (smaller ones run the native op / SDPA on CUDA; the reason says so),
            ``-`` when not fused, ``?`` when the dispatcher cannot say. The counts of what actually ran are in
            ``dispatch.stats()``.
        reason: why it was fused or skipped.
        eligible: whether it counts towards the coverage share: modules of a kind we fuse, except attention kept on
            the model's own implementation (an already fused one that fuse keeps, such as SDPA, flash or flex
            attention; ``attention="keep"``; a model whose attention cannot be replaced).
    """

    path: str
    kind: str
    original: str
    replacement: str | None
    fused: bool
    forward: str = "-"
    backward: str = "-"
    reason: str = ""
    eligible: bool = True


@dataclass
class FusionReport:
    """What :func:`fuse` did. ``print(report)`` shows a table; ``report.to_dict()`` / ``report.rows`` give data.

    Attributes:
        rows: one :class:`FusionRow` per (module, kind) considered.
        attention: ``{"previous": ..., "chosen": ..., "reason": ...}`` (the model's attention implementation
            before and after, and why; for a wrapper, that of the transformers model inside it; of several that
            differ in a value, that value names each: ``"student: eager; teacher: sdpa"``); empty when no
            transformers config governs attention.
        dry_run: True when nothing was changed.
        model: class name of the model.
        not_requested: ``{kind: count}`` of modules that ``fuse`` would have considered for a kind left out of
            ``ops`` (a Llama fused with ``ops=["layer_norm"]`` has RMSNorms, not LayerNorms); empty when ``ops``
            named every kind.
    """

    rows: list[FusionRow] = field(default_factory=list)
    attention: dict = field(default_factory=dict)
    dry_run: bool = False
    model: str = ""
    not_requested: dict = field(default_factory=dict)

    @property
    def eligible(self) -> int:
        """Eligible rows: (module, kind) pairs, so an attention module with a RoPE row and an attention row counts
        twice."""
        return sum(r.eligible for r in self.rows)

    @property
    def covered(self) -> int:
        """Eligible rows that are fused."""
        return sum(r.eligible and r.fused for r in self.rows)

    @property
    def modules_fused(self) -> int:
        """Distinct modules with at least one fused row."""
        return len({r.path for r in self.rows if r.fused})

    @property
    def coverage(self) -> float:
        """Share of eligible rows that are fused, 0..1 (1.0 when none is eligible)."""
        return self.covered / self.eligible if self.eligible else 1.0

    def fused_rows(self, kind: str | None = None) -> list[FusionRow]:
        return [r for r in self.rows if r.fused and (kind is None or r.kind == kind)]

    def skipped_rows(self, kind: str | None = None) -> list[FusionRow]:
        return [r for r in self.rows if not r.fused and (kind is None or r.kind == kind)]

    def to_dict(self) -> dict:
        return {"model": self.model, "dry_run": self.dry_run, "attention": dict(self.attention),
                "eligible": self.eligible, "covered": self.covered, "coverage": self.coverage,
                "modules_fused": self.modules_fused,
                "not_requested": dict(self.not_requested), "rows": [asdict(r) for r in self.rows]}

    # The report is a table where its six short columns fit whole and leave the reason this many characters; else a
    # list (a line per module, then its choice and reason, indented): at 90 columns the table broke every word.
    REASON_MIN = 30

    def __rich_console__(self, console, options):
        from rich.padding import Padding
        from rich.table import Table
        from rich.text import Text

        title = self._title()
        notes = self._notes()
        header = ("module", "kind", "original", "replacement", "fused fwd", "fused bwd", "reason")
        cells = [(r.path or "<model>", r.kind, r.original, r.replacement or "skipped", _yes_no(r.fused, r.forward),
                  _yes_no(r.fused, r.backward), r.reason) for r in self.rows]
        widths = [max(len(c[i]) for c in [header, *cells]) for i in range(6)]
        short = sum(w + 3 for w in widths) + 4  # + padding and rules
        if cells and options.max_width >= short + self.REASON_MIN:  # no rows: the title and notes alone
            # cells as Text: a reason or path holding "[...]" was read as rich markup (words lost, or MarkupError)
            table = Table(title=Text(title), title_justify="left", show_lines=False)
            # the short columns whole (rich shrank every column in proportion, folding module paths mid-word at
            # 200 columns); the reason takes the rest and wraps
            for col, w in zip(header, widths):
                table.add_column(col, no_wrap=True, min_width=w)
            table.add_column(header[6], overflow="fold")
            for r, row in zip(self.rows, cells):
                table.add_row(*map(Text, row), style=None if r.fused else "dim")
            if notes:  # notes under the table, left-aligned (rich centres a caption by default)
                table.caption = Text("\n".join(notes))
                table.caption_justify = "left"
            yield table
            return
        yield Text(title, style="bold")
        # the change under the path, indented, where a module's path and change do not fit a line (folded, the line's
        # second half began at the left edge), for every module alike
        split = any(len(c[0]) + len(f"  {c[1]}: {c[2]} -> {c[3]}") > options.max_width for c in cells)
        for r, (path, kind, original, replacement, fwd, bwd, reason) in zip(self.rows, cells):
            style = "" if r.fused else "dim"
            change = f"{kind}: {original} -> {replacement}"
            if not split:
                yield Text(f"{path}  {change}", style=style, overflow="fold")
            else:   # path (continued at 2 after a dot), change at 4, the rest at 6: each level its own indent
                for i, part in enumerate(_fold_path(path, options.max_width)):
                    yield Padding(Text(part, style=style, overflow="fold"), (0, 0, 0, 2 if i else 0))
                yield Padding(Text(change, style=style, overflow="fold"), (0, 0, 0, 4))
            yield Padding(Text(f"fused fwd {fwd}; fused bwd {bwd}; {reason}", style=style, overflow="fold"),
                          (0, 0, 0, 6 if split else 4))
        for n in notes:
            yield Text(n, overflow="fold")

    def _title(self) -> str:
        """The report's first line: the model, the share of eligible fusions in place (rows: an attention module with
        a RoPE row and an attention row has two; rows fused before this call count as in place) and the modules they
        touch, and the rows the share does not count (``eligible`` False: kept attention, attention of a model without
        a config, interleaved RoPE or partial rotary that the function computes otherwise than the kernel's path,
        parametrized norms, norms the RMSNorm probe refused, SwiGLU the probe refused, losses fuse() does not
        replace), by kind: the model's own code runs there."""
        would = "would be " if self.dry_run else ""
        title = f"pipegoose fusion of {self.model}{' (dry run)' if self.dry_run else ''}: "
        if self.eligible:
            n = self.modules_fused
            title += (f"{self.covered}/{self.eligible} eligible fusion{'' if self.eligible == 1 else 's'} {would}in "
                      f"place ({self.coverage:.0%})")
            if n:
                title += f", in {n} module{'' if n == 1 else 's'}"
        else:
            title += f"no eligible fusion (nothing {would or 'is '}fused)"
        uncounted: dict[str, int] = {}
        for r in self.rows:
            if not r.eligible and not r.fused:
                uncounted[r.kind] = uncounted.get(r.kind, 0) + 1
        if uncounted:
            kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(uncounted.items()))
            title += f"; not counted: {kinds} left to the model's own code"
        return title

    def _notes(self) -> list[str]:
        """The lines under the report: the attention choice, the probe's sequence length, the kinds left out."""
        notes = []
        if self.attention:
            a = self.attention
            notes.append(f"attention: {a.get('previous')} -> {a.get('chosen')}: {a.get('reason')}")
        if any(f" @{_PROBE_SEQ}" in impl for r in self.rows if r.fused for impl in (r.forward, r.backward)):
            notes.append(f"@{_PROBE_SEQ}: the choice for a sequence length of {_PROBE_SEQ}; the dispatcher chooses "
                         "again for each input shape at run time (dispatch.stats() counts what ran)")
        if any(f" @{_PROBE_WIDTH} wide" in impl for r in self.rows if r.fused for impl in (r.forward, r.backward)):
            notes.append(f"@{_PROBE_WIDTH} wide: the choice for rows of {_PROBE_WIDTH} values (a norm of rows of any "
                         "width, an activation); the dispatcher chooses again for each input shape at run time")
        if self.not_requested:
            found = ", ".join(f"{n} {kind}" for kind, n in sorted(self.not_requested.items()))
            notes.append(f"not in ops: {found} module(s) of a kind not asked for (ops= names the kinds to fuse; all "
                         f"of {', '.join(DEFAULT_OPS)} by default; {' and '.join(OPT_IN)} only where named)")
        return notes

    def __str__(self) -> str:
        """The report at the terminal's width (``COLUMNS``, else the terminal's; 200 where there is none: a log file, a
        notebook): a table, or a list where the table's short columns and :attr:`REASON_MIN` characters of reason
        do not fit. It was always 200 columns, which broke every row in a narrower terminal."""
        import shutil

        from rich.console import Console

        width = shutil.get_terminal_size((200, 24)).columns
        console = Console(width=max(width, 40), record=True, file=_NullIO(), color_system=None)
        console.print(self)
        return "\n".join(line.rstrip() for line in console.export_text().splitlines())  # (padding to the width)


def _fold_path(path: str, width: int) -> list[str]:
    """``path`` in lines of ``width`` characters (``width - 2`` after the first, which the report indents by 2),
    broken after a dot where one falls in the line, else at the width."""
    lines: list[str] = []
    rest = path
    while rest:
        w = max(width - (2 if lines else 0), 1)
        if len(rest) <= w:
            lines.append(rest)
            break
        cut = rest.rfind(".", 0, w) + 1 or w
        lines.append(rest[:cut])
        rest = rest[cut:]
    return lines


_MODEL_CODE = "the model's code"   # what a partial-rotary call that the kernel does not take runs


def _yes_no(fused: bool, impl: str) -> str:
    if not fused:
        return "no"
    if impl == "-":   # (no choice to show)
        return "yes"
    if impl.startswith(("torch", _MODEL_CODE)) or impl == "?":
        return f"no: {impl}"
    return f"yes: {impl}"


class _NullIO:
    def write(self, _s):
        return 0

    def flush(self):
        pass


# ----------------------------------------------------------------------------------------------------------------
# State of a fused model (kept outside the model, so state_dict and pickling see nothing of it)
# ----------------------------------------------------------------------------------------------------------------
# The record holds the model's own modules only through weak references: ``_STATE`` is keyed weakly by the model, and a
# value that reached the model (a parent that is the model itself, a config swapped on it) kept every fused model alive
# for ever, GPU memory included. Each replacement holds the module it replaced (``_ORIGINAL`` in its ``__dict__``,
# dropped when it is pickled or copied), so that what unfuse restores lives exactly as long as the model does.
@dataclass
class _Fusion:
    swaps: list = field(default_factory=list)            # (weakref to parent, name, weakref to new)
    loss_swaps: list = field(default_factory=list)       # (weakref to model, the loss function set on it)
    head_swaps: list = field(default_factory=list)       # (weakref to model, lm_head.install's hook handles)
    rope_hooks: list = field(default_factory=list)       # (weakref to attention module, transformers.rope.Installed)
    # (weakref to a language model whose forward builds its own CrossEntropyLoss, transformers.inline_loss.Installed)
    inline_losses: list = field(default_factory=list)
    # the handles of the hooks that tell a FusedMptAttention its block's output_attentions (transformers.mpt)
    weight_hooks: list = field(default_factory=list)
    # (weakref to a MoE experts module, weakref to the transformers.experts.FusedExpertsGate set on it)
    experts_gates: list = field(default_factory=list)
    # (weakref to module, old_config, new_config, new_config's attributes as fuse() left them): one new_config per
    # transformers model whose attention was fused (the model's own; in a wrapper, each model inside it)
    config_swaps: list = field(default_factory=list)
    report: FusionReport | None = None
    # rows of modules fused before this call (by another fuse(): of a part, or of an enclosing model): (row, path,
    # whether the module at that path runs fused, the row's fused values), for fusion_report to tell when an unfuse()
    # has reverted them since, or a fuse() fused them again
    held: list = field(default_factory=list)


_STATE: "weakref.WeakKeyDictionary[nn.Module, _Fusion]" = weakref.WeakKeyDictionary()


def is_fused(model: nn.Module) -> bool:
    """Whether ``model`` was fused by :func:`fuse` and not yet unfused (False for a copy of a fused model, which
    holds fused modules but no record). Raises TypeError when ``model`` is not a torch.nn.Module."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    return model in _STATE


def fusion_report(model: nn.Module) -> FusionReport | None:
    """The report of the fusion currently applied to ``model`` (None if not fused). Raises TypeError when
    ``model`` is not a torch.nn.Module."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    state = _STATE.get(model)
    if state is None:
        return None
    _refresh_held(model, state)
    return state.report


def _hold(state: _Fusion, row: FusionRow, path: str, runs_fused: Callable[[nn.Module], bool]) -> None:
    """Record ``row`` (a module fused by another fuse() call) for :func:`_refresh_held`."""
    state.held.append((row, path, runs_fused, (row.replacement, row.forward, row.backward, row.reason)))


def _refresh_held(model: nn.Module, state: _Fusion) -> None:
    """Bring the report's rows of modules fused by another fuse() call (of a part of ``model``, or of an enclosing
    model) up to date: not fused where an unfuse() of that call has reverted them since, fused again (as reported
    then) where a fuse() has fused them again. (Reviews, session 60: after fuse(model.model), fuse(model) and
    unfuse(model.model) the outer report still counted them; and, once marked reverted, a second fuse(model.model)
    left them so.)"""
    for row, path, runs_fused, then in state.held:
        try:
            now = runs_fused(model.get_submodule(path))
        except AttributeError:   # (the path is gone: a module deleted or renamed)
            now = False
        if now and not row.fused:
            row.fused = True
            row.replacement, row.forward, row.backward, row.reason = then
        elif not now and row.fused:
            row.fused, row.replacement, row.forward, row.backward = False, None, "-", "-"
            row.reason = ("fused by another fuse() call when this one ran (of a part of this model, or of an "
                          "enclosing one), reverted since by its unfuse()")


# ----------------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------------
def _first_param(module: nn.Module) -> torch.Tensor | None:
    return next(iter(module.parameters()), None)


def _choice(op: str, module: nn.Module, build_inputs, impl: str | None = None, like: torch.Tensor | None = None):
    """The dispatcher's choice for this module's device and dtype (with the module's own ``impl`` request, if any), or
    None where it cannot be told (a meta module, inputs the dispatcher cannot describe). A module without parameters
    (a weightless norm) takes the device and dtype of ``like`` (the model's first parameter)."""
    try:
        from . import dispatch

        p = _first_param(module)
        if p is None:
            p = like
        device = p.device if p is not None else torch.device("cpu")
        dtype = p.dtype if p is not None and p.is_floating_point() else torch.float32
        if device.type == "meta":
            return None
        args = build_inputs(device, dtype)
        # the choice alone (not explain's check of every implementation, which loads, and on a first run builds, the
        # kernels of implementations the choice does not need: the Apex and Megatron copies)
        return dispatch.choose(op, dispatch.problem_of(op, *args), impl=impl)
    except Exception:  # noqa: BLE001 - the report must not fail because a dispatcher cannot describe an input
        return None


def _impls(op: str, module: nn.Module, build_inputs, impl: str | None = None, like: torch.Tensor | None = None,
           any_width: bool = False) -> tuple[str, str]:
    """(forward, backward) implementation names the dispatcher would pick for this module's device and dtype (with the
    module's own ``impl`` request, if any; ``like``: see :func:`_choice`); "?" where that cannot be told.
    ``any_width``: a norm of rows of any width (or an activation), whose choice is told for rows of
    :data:`_PROBE_WIDTH`."""
    choice = _choice(op, module, build_inputs, impl, like)
    if choice is None:
        return "?", "?"
    name = choice.impl + (" (fallback)" if choice.fallback else "")
    if op.startswith("softmax"):
        name += f" @{_PROBE_SEQ}"
    if any_width:
        name += f" @{_PROBE_WIDTH} wide"
    return name, name


def _adopt(new: nn.Module, old: nn.Module) -> None:
    """Make ``new`` share ``old``'s hooks (the same dictionaries) and training flag."""
    for name in _HOOK_DICTS + _HOOK_FLAGS:
        if name in old.__dict__:
            object.__setattr__(new, name, old.__dict__[name])
    new.training = old.training   # the module's own flag: an MLP's children are the original's, left as they are


def _registration_replaces_parameters() -> bool:
    """Whether registering a parameter on a module now stores another one (accelerate's ``init_empty_weights``
    patches ``nn.Module.register_parameter`` to store a meta copy): then no fused module can take over the parameters
    of the module it replaces (a review: fuse raised "does not reuse its parameters (['weight'] -> ['weight'])")."""
    p = nn.Parameter(torch.empty(0, device="cpu"), requires_grad=False)
    m = nn.Module()
    m.register_parameter("w", p)
    return m._parameters.get("w") is not p


def _check_same_params(new: nn.Module, old: nn.Module) -> None:
    old_p = dict(old.named_parameters(recurse=False))
    new_p = dict(new.named_parameters(recurse=False))
    if old_p.keys() != new_p.keys() or any(old_p[k] is not new_p[k] for k in old_p):
        raise RuntimeError(f"{type(new).__name__} built from {type(old).__name__} does not reuse its parameters "
                           f"({sorted(old_p)} -> {sorted(new_p)}); refusing to fuse (state_dict would change)")


def _parse_ops(ops: Iterable[str] | str | None) -> tuple[str, ...]:
    if ops is None:
        return DEFAULT_OPS
    if isinstance(ops, str):
        ops = [ops]
    try:
        ops = tuple(ops)
    except TypeError:
        raise TypeError(f"ops: expected an op name or an iterable of them ({list(OPS)}) or None, got "
                        f"{type(ops).__name__}") from None
    not_str = [o for o in ops if not isinstance(o, str)]
    if not_str:
        raise TypeError(f"ops: expected op names (str) from {list(OPS)}, got {not_str!r}")
    names = tuple(_choice_name(o) for o in ops)  # case and surrounding blanks ignored, as impl= and PIPEGOOSE_IMPL_*
    bad = [o for o, n in zip(ops, names) if n not in OPS]
    if bad:
        raise ValueError(f"ops: unknown op(s) {bad}; expected a subset of {list(OPS)} or None (all but "
                         f"{' and '.join(OPT_IN)})")
    return names


def _choice_name(value: str) -> str:
    """An ``ops`` or ``attention`` value as :func:`fuse` compares it: case and surrounding blanks ignored, as the
    dispatcher reads ``impl=`` and ``PIPEGOOSE_IMPL_*`` values."""
    return value.strip().lower()


def _parse_attention(attention: Any) -> str:
    if not isinstance(attention, str):
        raise TypeError(f"attention: expected one of {list(ATTENTION_CHOICES)} (str), got {type(attention).__name__}")
    name = _choice_name(attention)
    if name not in ATTENTION_CHOICES:
        raise ValueError(f"attention: expected one of {list(ATTENTION_CHOICES)} (any case), got {attention!r}")
    return name


# ----------------------------------------------------------------------------------------------------------------
# fuse / unfuse
# ----------------------------------------------------------------------------------------------------------------
def fuse(model: nn.Module, ops: Iterable[str] | str | None = None, dry_run: bool = False,
         attention: str = "auto") -> FusionReport:
    """Replace ``model``'s LayerNorms, RMSNorms, SwiGLU and GeGLU MLPs, GELU and squared ReLU activations, the gate of
    its MoE experts (transformers' experts modules: :mod:`~pipegoose.nn.fusion.transformers.experts`), rotary position
    embedding, language-model loss and attention softmax by fused ones, on this instance only.

    Args:
        model: a constructed ``torch.nn.Module`` (typically a transformers ``PreTrainedModel``, e.g. from
            ``from_pretrained``), on any device and dtype. Modules whose parameters are on CPU run the reference
            paths (the dispatcher picks fused kernels on CUDA).
        ops: subset of ``("layer_norm", "rms_norm", "swiglu", "geglu", "gelu", "squared_relu", "rope",
            "cross_entropy", "attention", "rms_norm_gated", "linear_cross_entropy")`` (a name or an iterable of names;
            case and surrounding blanks ignored, as in ``impl=``); None = all but the two opt-in kinds:
            ``rms_norm_gated``, Qwen3-Next's and Mamba2's gated RMSNorms (``forward(hidden_states, gate)``, the norm
            then ``silu`` of the gate, or the gate first over groups, probed bit for bit) as
            :class:`~pipegoose.nn.fusion.modules.FusedRMSNormGated` (op ``rms_norm_gated``; opt-in until timed in a
            training step on a GPU), and ``linear_cross_entropy``: a
            causal LM's head and loss in one (:mod:`pipegoose.nn.fusion.transformers.lm_head`; in training with
            labels the output's ``logits`` is None; on the H200's Llama-1.1B step 0.5 GiB less peak memory at 0.1%
            fewer tokens/s, session 52; one backward per forward: a second backward through a retained graph raises
            RuntimeError).
        dry_run: only report what would be done; the model is not touched.
            A call that fuses nothing (no module of ``ops`` in the model) leaves no record either: ``is_fused``
            stays False, and ``fuse`` may be called again, e.g. with other ``ops``.
        attention: ``"auto"`` (ours on models running eager attention; a model on SDPA keeps it unless the GPU's
            tuning table, op ``"attention"``, names ``pipegoose`` for its dtype, and then ours is used per call
            where the table says so; flash/flex attention is kept), ``"pipegoose"`` (ours whatever the model ran)
            or ``"keep"`` (do not touch attention); any case. Either way ours replaces only the attention of model
            types verified with it (``transformers.matching.ATTENTION_MODEL_TYPES``), Bloom's and MPT's (eager only
            in transformers: ``FusedBloomAttention``, ``FusedMptAttention`` under ``"auto"`` and ``"pipegoose"``);
            the others' attention is reported as skipped, with that reason (Qwen3's, for one).
    Under ``torch.compile`` the replacements emit the PyTorch ops while the compiler traces them (one graph; the
    compiler fuses those ops itself; ``dispatch.compile_passthrough``); the fused kernels run in eager mode.
    torch's random state (the CPU generator's, and the CUDA devices') is left as it was, a dry run included: the
    probes draw their inputs from generators of their own and put back any draw of the module code they run
    (``transformers.matching.probe_isolated``, which also runs them outside CPU autocast and any default device).

    Returns:
        A :class:`FusionReport`.
    Raises:
        TypeError: ``model`` is not an ``nn.Module``; ``ops`` or ``attention`` not str values.
        ValueError: unknown ``ops`` or ``attention`` value; a norm's ``eps`` that the fused ops refuse (negative or
            not finite; TypeError when not a number), named with the module's path; a ``PIPEGOOSE_*`` variable with a
            value the dispatcher refuses (``dispatch.check_env``: e.g. ``PIPEGOOSE_STRICT=2``, which the fused norms'
            small path never reads, so that it would otherwise pass unnoticed). Nothing is changed then.
        RuntimeError: ``model`` is already fused (call :func:`unfuse` first), or a replacement would not reuse
            the parameters of the module it replaces (inside accelerate's ``init_empty_weights``, which replaces
            every parameter registered, this is said before anything is done where ``ops`` has a norm kind, whose
            fused modules take over the norm's weight; the other kinds hold no parameters of their own).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(dry_run, bool):
        raise TypeError(f"dry_run: expected a bool, got {type(dry_run).__name__}")
    ops = _parse_ops(ops)
    attention = _parse_attention(attention)
    if model in _STATE:
        raise RuntimeError(f"model: this {type(model).__name__} is already fused; call unfuse(model) first")
    from . import dispatch
    from .modules import (FusedGateUpSwiGLUMLP, FusedGELU, FusedGeGLUMLP, FusedModernBertMLP, FusedRMSNorm,
                          FusedRMSNormGated, FusedSquaredReLU, FusedSwiGLUMLP, FusedT5DenseGatedActDense,
                          MixedFusedLayerNorm)

    dispatch.check_env()
    # the kinds whose fused modules hold parameters
    norms = [k for k in ("layer_norm", "rms_norm", "rms_norm_gated") if k in ops]
    if not dry_run and norms and _registration_replaces_parameters():
        raise RuntimeError(f"fuse: a parameter registered on a module now is replaced by another (accelerate's "
                           f"init_empty_weights, or another patch of torch.nn.Module.register_parameter, is active), "
                           f"so the fused norms ({', '.join(norms)}) could not share the model's parameters; call "
                           f"fuse(model) outside it, or leave them out of ops")

    report = FusionReport(dry_run=dry_run, model=type(model).__name__)
    state = _Fusion(report=report)
    replaced: dict[int, nn.Module] = {}       # id(old) -> new (a shared module is replaced once, everywhere)
    seen: set[int] = set()
    fused_types = _fused_module_types()
    # the gated MLPs and MoE experts fused by this call (or, in a dry run, that would be): their activation module is
    # kept but not called, so it is no activation (GELU, squared ReLU) of its own to replace (a replaced one would be
    # taken for an activation assigned since, and the MLP would run it instead of its kernel); also those fused before
    # (fused_types)
    absorbed: set[int] = set()
    gated_left_out: set[int] = set()   # gated MLPs counted under a kind left out of ops (their act: not counted again)
    # the parametrization objects of parametrized modules (a _WeightNorm, say): not modules of the model's computation
    internal = {id(m) for mod in model.modules() if parametrize.is_parametrized(mod)
                for m in mod.parametrizations.modules()}

    held: set[int] = set()          # rows of modules fused before this call: no record of this call for them
    like = _first_param(model)      # the device and dtype of the report's choice for modules without parameters
    try:
        for parent_path, parent in list(model.named_modules()):
            for name, child in list(parent._modules.items()):
                if child is None:
                    continue
                path = f"{parent_path}.{name}" if parent_path else name
                act_kind = _activation_candidate(child)   # "gelu", "squared_relu" (by class name) or None
                if act_kind is not None and (id(parent) in absorbed or isinstance(parent, fused_types)):
                    # the activation of a fused gated MLP: left as it is, whether or not another module shares it
                    # (first seen here, it is not marked seen: a later plain user of it is fused; a review)
                    continue
                if id(child) in replaced:                       # second occurrence of a shared module
                    if not dry_run:
                        parent._modules[name] = replaced[id(child)]
                        state.swaps.append((weakref.ref(parent), name, weakref.ref(replaced[id(child)])))
                        _watch_output_attentions(parent, replaced[id(child)], state)
                    continue
                if id(child) in seen or id(child) in internal:
                    continue
                seen.add(id(child))
                if isinstance(child, fused_types):  # put there before this call
                    kind = ("rms_norm" if isinstance(child, FusedRMSNorm) else
                            "rms_norm_gated" if isinstance(child, FusedRMSNormGated) else
                            "attention" if isinstance(child, _OWN_FUSED) else
                            _fused_activation_kind(child) if isinstance(child, (FusedGELU, FusedSquaredReLU)) else
                            "swiglu" if isinstance(child, (FusedSwiGLUMLP, FusedGateUpSwiGLUMLP)) else
                            "geglu" if isinstance(child, FusedGeGLUMLP) else
                            # (T5's, ModernBERT's: the kind of the op it runs)
                            _gated_kind(child) if isinstance(child, (FusedT5DenseGatedActDense, FusedModernBertMLP))
                            else "layer_norm")
                    report.rows.append(FusionRow(path, kind, type(child).__name__, type(child).__name__, True,
                                                 *_fused_impls(child, like),
                                                 reason=_already_fused_reason(model, child)))
                    held.add(id(report.rows[-1]))
                    _hold(state, report.rows[-1], path, lambda m: isinstance(m, fused_types))
                    continue
                if _experts.candidate(child):   # a MoE layer's experts: their gate hooked, the module kept
                    counted = sum(report.not_requested.values())
                    row = _consider_experts(model, child, path, ops, dry_run, state, held)
                    if row is not None:
                        report.rows.append(row)
                        if row.fused:
                            absorbed.add(id(child))
                    elif sum(report.not_requested.values()) > counted:   # (counted under its kind: its act not again)
                        gated_left_out.add(id(child))
                    continue
                if act_kind is not None:
                    if act_kind not in ops:
                        if _ACTIVATIONS[act_kind].probe(child).ok and id(parent) not in gated_left_out:
                            report.not_requested[act_kind] = report.not_requested.get(act_kind, 0) + 1
                        continue
                    row, new = _consider_activation(act_kind, child, path, dry_run, like)
                elif (own := _own_attention(child)) is not None:
                    if "attention" not in ops:
                        if own.probe(child).ok:
                            report.not_requested["attention"] = report.not_requested.get("attention", 0) + 1
                        continue
                    row, new = _consider_own_attention(own, child, parent, path, attention, dry_run)
                else:
                    row, new = _consider(child, path, ops, dry_run, MixedFusedLayerNorm, FusedRMSNorm, like)
                    if row is not None and row.fused and row.kind in ("swiglu", "geglu"):
                        absorbed.add(id(child))
                if row is None:
                    target = _rope.target(child)
                    if target is not None:   # an attention module that applies RoPE: hooked, not replaced
                        # (hooked by another fuse(): held, whatever ops says, as a norm fused before is; with rope
                        # left out of ops it was missing from the report, a review)
                        row = _held_rope_row(model, child, path, target)
                        if row is not None:
                            report.rows.append(row)
                            held.add(id(row))
                            _hold(state, row, path, _rope.hooked)
                        elif "rope" in ops:
                            report.rows.append(_consider_rope(model, child, path, target, dry_run, state))
                        # (a copy of a hooked module: not ours to count; _rope_unused with what the probe found:
                        # without it partial-rotary modules that ops=["rope"] fuses were left out, a review)
                        elif (_rope_found(target).ok and not _rope.hooked(child)
                              and _rope_unused(child, _rope_found(target), getattr(model, "config", None)) is None):
                            report.not_requested["rope"] = report.not_requested.get("rope", 0) + 1
                        continue
                    kind = _norm_kind_left_out(child, ops)
                    if kind is not None:
                        report.not_requested[kind] = report.not_requested.get(kind, 0) + 1
                        if kind in ("swiglu", "geglu"):
                            gated_left_out.add(id(child))
                    continue
                report.rows.append(row)
                if new is not None:
                    _check_same_params(new, child)
                    _adopt(new, child)
                    new.__dict__[_ORIGINAL] = _carry_attrs(child, new)
                    replaced[id(child)] = new
                    parent._modules[name] = new
                    state.swaps.append((weakref.ref(parent), name, weakref.ref(new)))
                    _watch_output_attentions(parent, new, state)

        if _experts.candidate(model):   # the model itself a MoE experts module: its gate is set on it as on any
            row = _consider_experts(model, model, "", ops, dry_run, state, held)
            if row is not None:
                report.rows.append(row)
        _fuse_losses(model, ops, dry_run, report, state, held)
        if "linear_cross_entropy" in ops:
            for path, lm in _loss.language_models(model):
                _fuse_lm_head(lm, path, _wrappers_of(model, path), dry_run, report, state)
        owners, stray = _attention_owners(model)
        if "attention" in ops:
            _fuse_attention(model, owners, stray, attention, dry_run, report, state, held)
        else:
            for _, _, config, modules in owners:
                # (those fused by another fuse() call: held, as with attention in ops; they were missing, a review)
                before = _attention_fused_before(config, modules)
                for p, m in modules:
                    if id(m) in before:
                        _hold_attention(model, p, m, report, state, held)
                n = sum(1 for p, m in modules
                        if matching.attention_support(config, m)[0] and not _runs_our_attention(m))
                if n:
                    report.not_requested["attention"] = report.not_requested.get("attention", 0) + n
            for p, m in stray:
                if _runs_our_attention(m):
                    _hold_attention(model, p, m, report, state, held)
    except BaseException:
        _undo(state)
        raise

    own = _own_attention(model) if "attention" in ops else None
    if own is not None:
        report.rows.append(FusionRow("", "attention", type(model).__name__, None, False, reason=(
            f"the model itself is {own.owner} attention: fuse() replaces submodules in their parent; use "
            f"{own.fused.__name__}.from_module(model) instead, or fuse a module that holds it")))
    kind = _bare_norm_kind(model) if not isinstance(model, fused_types) else None
    if kind in ops:
        # fuse() replaces submodules in their parents; the model itself has none to be replaced in
        use = "FusedRMSNorm.from_module(model)" if kind == "rms_norm" else "MixedFusedLayerNorm.from_module(model)"
        report.rows.append(FusionRow("", kind, type(model).__name__, None, False, reason=(
            f"the model itself is the norm: fuse() replaces submodules in their parent; use {use} instead, or fuse a "
            "module that holds it")))
    order = {p: i for i, (p, _) in enumerate(model.named_modules(remove_duplicate=False))}
    report.rows.sort(key=lambda r: order.get(r.path, len(order)))
    if not dry_run and (state.swaps or state.config_swaps or state.loss_swaps or state.rope_hooks or state.head_swaps
                        or state.experts_gates or state.weight_hooks or state.inline_losses
                        or any(r.fused and id(r) not in held for r in report.rows)):
        _STATE[model] = state  # a call that fused nothing leaves no record: fuse() may be called again
    return report


def _norm_kind_left_out(child: nn.Module, ops: tuple) -> str | None:
    """The kind of norm ``child`` is, where that kind is left out of ``ops`` and fuse() would have counted it as
    eligible (for the report's ``not_requested``; classification only: no dispatcher choice, no kernel loaded)."""
    if isinstance(child, nn.LayerNorm):
        if "layer_norm" in ops:
            return None
        if type(child).forward is nn.LayerNorm.forward:
            return "layer_norm"
        # a subclass computing its own: eligible only as LayerNorm1P (a review: every subclass was counted)
        ok = matching.layer_norm_1p_candidate(child) and matching.probe_layer_norm_1p(child).ok
        return "layer_norm" if ok else None
    if _weightless_leaf(child):
        probe = matching.probe_weightless_norm(child)   # (a norm without parameters: OLMo's, Gemma 4's v_norm)
        return probe.kind if probe.ok and probe.kind not in ops else None
    if _layer_norm_module_leaf(child) and matching.probe_layer_norm_module(child).ok:   # (Cohere's)
        return "layer_norm" if "layer_norm" not in ops else None
    if "swiglu" not in ops or "geglu" not in ops:
        probe = matching.probe_swiglu_mlp(child)
        if probe.ok and _mlp_kind(probe) not in ops:
            return _mlp_kind(probe)
    if "rms_norm_gated" not in ops and matching.gated_rms_norm_candidate(child):
        return "rms_norm_gated" if matching.probe_rms_norm_gated(child).ok else None
    if "rms_norm" in ops or any(True for _ in child.children()):
        return None
    return "rms_norm" if matching.probe_rms_norm(child).ok else None


def _fused_impls(module: nn.Module, like: torch.Tensor | None = None) -> tuple[str, str]:
    """(forward, backward) for a norm fused before this call, as :func:`_consider` gives them for a new one: what the
    dispatcher picks for it (the report showed "yes" there, also where the fallback runs; a walkthrough)."""
    from .modules import (FusedGateUpSwiGLUMLP, FusedGeGLUMLP, FusedModernBertMLP, FusedRMSNorm, FusedRMSNormGated,
                          FusedSwiGLUMLP, FusedT5DenseGatedActDense)

    if isinstance(module, _OWN_FUSED):
        return _own_attention_impls(module)
    impl = getattr(module, "impl", None)   # a request made on the module (FusedRMSNorm(impl="torch"), say)
    act_kind = _fused_activation_kind(module)
    if act_kind is not None:
        args = _ACTIVATIONS[act_kind].op_args(getattr(module, "approximate", None))
        return _activation_impls(act_kind, module, args, impl, like)
    if isinstance(module, (FusedSwiGLUMLP, FusedGateUpSwiGLUMLP, FusedGeGLUMLP, FusedT5DenseGatedActDense,
                           FusedModernBertMLP)):
        return _swiglu_impls(module, isinstance(module, (FusedGateUpSwiGLUMLP, FusedModernBertMLP)), impl,
                             getattr(module, "approximate", None), module._PROJECTIONS[0])
    if isinstance(module, FusedRMSNormGated):
        return _gated_norm_impls(module, impl, like)
    any_width = module.normalized_shape is None   # a FusedRMSNorm of the last dimension
    shape = (_PROBE_WIDTH,) if any_width else tuple(module.normalized_shape)
    if isinstance(module, FusedRMSNorm):
        return _impls("rms_norm", module, lambda d, t: (
            torch.empty(_probe_rows(shape), *shape, device=d, dtype=t), shape,
            _op_weight(module.weight, getattr(module, "weight_offset", 0.0)), module.eps, module.cast_before_weight),
            impl, like, any_width)
    return _impls("layer_norm", module, lambda d, t: (
        torch.empty(_probe_rows(shape), *shape, device=d, dtype=t), shape, module.weight, module.bias), impl, like)


def _already_fused_reason(model: nn.Module, module: nn.Module) -> str:
    """Why fuse() leaves ``module`` (a fused module found in ``model``) as it is, and what reverts it."""
    root = next((r for r, st in list(_STATE.items()) if any(new() is module for _, _, new in st.swaps)), None)
    if root is None:
        return ("already fused before this call (a copy of a fused model, or built with it): not replaced here, and "
                "unfuse() will not revert it")
    return _earlier_fuse_reason(model, root, "not replaced here")


def _earlier_fuse_reason(model: nn.Module, root: nn.Module, kept: str) -> str:
    """The reason of a held row: fused by the fuse() call of ``root`` (a part of ``model``, a model holding it, or
    another model sharing the module), ``kept`` by this call of ``model``, and what reverts it."""
    inside = next((p for p, m in model.named_modules() if m is root), None)
    if inside:
        return f"fused by an earlier fuse() of {inside} ({type(root).__name__}): {kept}; unfuse() of either reverts it"
    if any(m is model for m in root.modules()):
        return (f"fused by an earlier fuse() of an enclosing {type(root).__name__}: {kept}; unfuse() of that model "
                "reverts it")
    return (f"fused by an earlier fuse() of another model that shares this module ({type(root).__name__}): {kept}; "
            "unfuse() of that model reverts it")


def _bare_norm_kind(model: nn.Module) -> str | None:
    """``layer_norm`` / ``rms_norm`` when ``model`` itself is a norm fuse() would replace inside a parent (a
    ``torch.nn.LayerNorm``, ``torch.nn.RMSNorm``, or a module the RMSNorm probe or the probe of norms without
    parameters accepts), else None."""
    if isinstance(model, nn.LayerNorm):
        return "layer_norm"
    if matching.is_torch_rms_norm(model):
        return "rms_norm"
    if any(True for _ in model.children()):
        return None
    if not any(True for _ in model.parameters(recurse=False)):
        probe = matching.probe_weightless_norm(model)
        return probe.kind if probe.ok else None
    if _layer_norm_module_leaf(model) and matching.probe_layer_norm_module(model).ok:
        return "layer_norm"
    return "rms_norm" if matching.probe_rms_norm(model).ok else None


def _build(path, child, make, *args, **kwargs):
    """``make(*args, **kwargs)``; a TypeError/ValueError of the fused module's constructor (an ``eps`` that the fused
    ops refuse, say) names the module's path."""
    try:
        return make(*args, **kwargs)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{path} ({type(child).__name__}): {e}") from None


def _instance_override(child: nn.Module) -> str | None:
    """Why ``child``'s own instance changes how it runs, so that a fused module in its place would bypass that (None
    when nothing does): a ``forward`` set on the instance (accelerate's ``add_hook_to_module``, used by
    ``device_map`` / offloading, and monkey patches do this)."""
    if "forward" in child.__dict__ or "_hf_hook" in child.__dict__:
        what = "an accelerate hook (_hf_hook)" if "_hf_hook" in child.__dict__ else "a forward set on the instance"
        return (f"{what}: the module's own forward is replaced, which a fused module in its place would bypass "
                "(device_map / offloading hooks, a patch)")
    return None


# What a module's __dict__ holds for nn.Module itself: not carried over to a replacement (its own are set up anew).
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) | {"_compiled_call_impl"}
# Where a module holds its names: plain attributes, then nn.Module's registries.
_SLOTS = ("__dict__", "_parameters", "_buffers", "_modules")


@dataclass
class _Replaced:
    """What a replacement holds of the module it replaced (``new.__dict__[_ORIGINAL]``, see :class:`_Fusion`): the
    module, the instance attributes carried over to the replacement with their values then, the replacement's ``eps``
    then, the original's name for its epsilon (``eps``, ``variance_epsilon``, ``epsilon``; None: none), and the names
    the replacement held then in each slot (``__dict__``, ``_parameters``, ``_buffers``, ``_modules``: what is added
    while fused goes back too), and its parameters and buffers then (``(slot, name)``: the object; what is removed
    while fused goes too)."""

    module: nn.Module
    carried: dict
    eps: object
    eps_attr: str | None
    names_then: dict = field(default_factory=dict)
    tensors_then: dict = field(default_factory=dict)


def _carry_attrs(old: nn.Module, new: nn.Module) -> _Replaced:
    """Give ``new`` the instance attributes of ``old`` that it lacks (a user's tag, a model's bookkeeping), the same
    objects; not nn.Module's internals, not the parameters and not the epsilon attributes, which the fused module
    holds as ``eps``. Returns the record :func:`_carry_back` needs."""
    carried = {}
    for key, value in old.__dict__.items():
        if (key in _MODULE_INTERNALS or key in new.__dict__ or key in matching.EPS_ATTRIBUTES
                or hasattr(type(new), key)):
            continue
        new.__dict__[key] = carried[key] = value
    eps_attr = "eps" if isinstance(old, (nn.LayerNorm, nn.RMSNorm)) else matching.eps_attribute(old)
    return _Replaced(old, carried, new.__dict__.get("eps", _MISSING), eps_attr,
                     {slot: frozenset(getattr(new, slot)) for slot in _SLOTS},
                     {(slot, k): v for slot in ("_parameters", "_buffers") for k, v in getattr(new, slot).items()})


def _carry_back(new: nn.Module, rec: _Replaced) -> None:
    """At unfuse: what was rebound on the replacement while fused goes back to the original (``rec.module``): the
    carried attributes and ``eps`` (under the original's name for it), each only when the replacement's value is no
    longer the one it had at fuse time (a carried attribute deleted on the replacement is deleted), the full-backward
    hook flag, and what was added to the replacement while fused (attributes, parameters, buffers, submodules: they
    were lost, a walkthrough found). What was changed on the original meanwhile stays, and an added name that the
    original holds already, in any slot or on its class, is left out: unfuse cannot fail halfway (a review: prune's
    plain ``weight`` attribute, set back with setattr on a module whose ``weight`` is a Parameter, raised)."""
    old = rec.module
    for key, then in rec.carried.items():
        now = new.__dict__.get(key, _MISSING)
        if now is _MISSING:
            if old.__dict__.get(key, _MISSING) is then:
                del old.__dict__[key]
        elif now is not then:
            old.__dict__[key] = now
    if new.__dict__.get("_is_full_backward_hook") is not None:   # (set by a hook registered while fused)
        old.__dict__["_is_full_backward_hook"] = new.__dict__["_is_full_backward_hook"]

    # A parameter or buffer removed from the replacement while fused leaves the original too, where it still holds
    # the object of fuse time: prune and weight_norm take ``weight`` out of the parameters and leave a plain tensor
    # and a forward pre-hook that sets it, and that hook's setattr over the original's Parameter raised at the first
    # forward after unfuse (session 42).
    for (slot, name), then in rec.tensors_then.items():
        if name not in getattr(new, slot) and getattr(old, slot).get(name, _MISSING) is then:
            del getattr(old, slot)[name]
            old._non_persistent_buffers_set.discard(name)

    def taken(name: str) -> bool:
        return any(name in getattr(old, slot) for slot in _SLOTS) or hasattr(type(old), name)

    for slot in _SLOTS:
        for name, value in getattr(new, slot).items():
            if (name in rec.names_then.get(slot, ()) or name == _ORIGINAL or name in _MODULE_INTERNALS
                    or taken(name)):
                continue
            getattr(old, slot)[name] = value
            if slot == "_buffers" and name in new._non_persistent_buffers_set:
                old._non_persistent_buffers_set.add(name)
    eps = new.__dict__.get("eps", _MISSING)
    if rec.eps_attr is not None and eps is not _MISSING and eps is not rec.eps:
        setattr(old, rec.eps_attr, eps)
    elif rec.eps_attr is None and eps is not _MISSING and eps is not rec.eps:
        # (OLMo's LayerNorm writes its epsilon in its forward: there is nothing to carry the new one back to)
        warnings.warn(f"unfuse: the eps set on the fused replacement of the {type(old).__name__} ({eps!r}) is not "
                      f"carried back: {type(old).__name__} has no epsilon attribute (its forward uses its own)",
                      stacklevel=3)
    _carry_parametrizations_back(new, old)


class _Unchanged(nn.Module):
    """A placeholder parametrization (see :func:`_carry_parametrizations_back`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _carry_parametrizations_back(new: nn.Module, old: nn.Module) -> None:
    """Parametrizations registered on the replacement while fused (``torch.nn.utils.parametrize``:
    ``register_parametrization``, ``parametrizations.weight_norm``) go to the original, the same
    ``ParametrizationList`` objects (their ``original`` Parameters are those an optimizer holds). The loop of
    :func:`_carry_back` gave the original the ``parametrizations`` container but not the property that computes the
    tensor, which torch puts on a class of its own: the original lost ``weight`` (AttributeError at the first forward
    after unfuse; a walkthrough). ``register_parametrization`` gives it that class and property, on a placeholder that
    the shared list then replaces. (A parametrized module is not fused; one that a user parametrized while fused keeps
    its own lists and takes the replacement's for the names it lacks: returning there lost them, and the original its
    ``weight``, a review. As in :func:`_carry_back`, a name the original holds already is left as it is.)"""
    if not parametrize.is_parametrized(new):
        return
    if old._modules.get("parametrizations") is new.parametrizations:
        del old._modules["parametrizations"]   # (the container alone, as _carry_back's loop added it)
    lists = dict(new.parametrizations.items())
    for name, plist in lists.items():
        if (parametrize.is_parametrized(old, name) or hasattr(type(old), name)
                or any(name in getattr(old, slot) for slot in _SLOTS)):
            continue   # (the original's own, or registered on it while fused: left as it is)
        old.register_buffer(name, torch.empty(0), persistent=False)   # moved into the placeholder list, then dropped
        parametrize.register_parametrization(old, name, _Unchanged(), unsafe=True)
        old.parametrizations[name] = plist


def _computed_params(child: nn.Module) -> str | None:
    """Why ``child``'s weight or bias is not a Parameter of its own (the fused modules share the module's Parameter
    objects, so they cannot take such a module), or None. Parametrized modules (``torch.nn.utils.parametrize``:
    ``parametrizations.weight_norm``, ``spectral_norm``, ``register_parametrization``) compute them on each access;
    the hook-based ``torch.nn.utils.weight_norm`` sets a plain tensor before each forward."""
    if parametrize.is_parametrized(child):
        names = ", ".join(child.parametrizations.keys())
        return (f"parametrized ({names}; torch.nn.utils.parametrize): the fused module shares Parameters, and these "
                "are computed on each access")
    for name in ("weight", "bias"):
        value = child.__dict__.get(name)   # a plain attribute (a Parameter lives in _parameters)
        if isinstance(value, torch.Tensor):
            return (f"its {name} is a plain tensor, not a Parameter (set by a hook, such as "
                    "torch.nn.utils.weight_norm's): the fused module shares Parameters")
    return None


def _consider(child, path, ops, dry_run, MixedFusedLayerNorm, FusedRMSNorm, like=None):
    """(row, replacement or None) for one module; (None, None) when it is not a candidate. ``like``: the model's first
    parameter (the device and dtype of the report's choice for a norm without parameters)."""
    if isinstance(child, nn.LayerNorm):
        if "layer_norm" not in ops:
            return None, None
        own_forward = type(child).forward is not nn.LayerNorm.forward
        if own_forward and not matching.layer_norm_1p_candidate(child):
            return FusionRow(path, "layer_norm", type(child).__name__, None, False,
                             reason="LayerNorm subclass with its own forward"), None
        why = _instance_override(child) or _computed_params(child)
        if why is not None:
            return FusionRow(path, "layer_norm", type(child).__name__, None, False, reason=why), None
        if own_forward:   # Nemotron's LayerNorm1P (weight + 1), where the probe finds that formula
            probe = matching.probe_layer_norm_1p(child)
            if not probe.ok:
                return FusionRow(path, "layer_norm", type(child).__name__, None, False, reason=probe.reason,
                                 eligible=False), None
        new = None if dry_run else _build(path, child, MixedFusedLayerNorm.from_layer_norm, child)
        if new is not None and own_forward:
            new.apply_layernorm_1p = True   # (probed above)
        shape = tuple(child.normalized_shape)
        fwd, bwd = _impls("layer_norm", child, lambda d, t: (
            torch.empty(_probe_rows(shape), *shape, device=d, dtype=t), shape, child.weight, child.bias))
        what = ("LayerNorm of weight + 1 (probed), same parameters: MixedFusedLayerNorm(apply_layernorm_1p=True)"
                if own_forward else "torch.nn.LayerNorm, same parameters")
        return FusionRow(path, "layer_norm", type(child).__name__, "MixedFusedLayerNorm", True, fwd, bwd,
                         what + _small_note(child)), new
    if "swiglu" in ops or "geglu" in ops:
        found = _consider_swiglu(child, path, ops, dry_run)
        if found is not None:
            return found
    if _weightless_leaf(child):
        return _consider_weightless(child, path, ops, dry_run, MixedFusedLayerNorm, FusedRMSNorm, like)
    if _layer_norm_module_leaf(child):
        probe = matching.probe_layer_norm_module(child)
        if probe.ok or probe.candidate:   # (else an RMSNorm, or no norm: the RMSNorm probe's to tell)
            return _consider_layer_norm_module(child, path, ops, dry_run, MixedFusedLayerNorm, probe)
    if matching.gated_rms_norm_candidate(child):
        if "rms_norm_gated" in ops:
            return _consider_gated_norm(child, path, dry_run, like)
        if matching.probe_rms_norm_gated(child).ok:   # (opt-in: counted as not asked for, by _norm_kind_left_out)
            return None, None
    if parametrize.is_parametrized(child) and matching.gated_rms_norm_candidate(child, parametrized=True):
        # (a parametrized gated norm: its parametrizations are children, which the candidate test takes for "not a
        # leaf"; a breaker found it left out of the report, or counted under rms_norm)
        if "rms_norm_gated" not in ops:
            return None, None
        why = _computed_params(child) or "its weight is parametrized"
        return FusionRow(path, "rms_norm_gated", type(child).__name__, None, False, reason=why), None
    if "rms_norm" not in ops:
        return None, None
    # torch.nn.RMSNorm, and parametrized norms (their parametrizations are children, which the probe takes for "not a
    # norm"; a parametrized T5LayerNorm or LlamaRMSNorm is not probed, so it is reported as not eligible)
    parametrized_norm = (parametrize.is_parametrized(child) and "norm" in type(child).__name__.lower()
                         and not isinstance(child, (nn.GroupNorm, nn.modules.batchnorm._NormBase)))
    if isinstance(child, nn.RMSNorm) or parametrized_norm:
        why = _computed_params(child)
        if why is not None:
            return FusionRow(path, "rms_norm", type(child).__name__, None, False, reason=why,
                             eligible=isinstance(child, nn.RMSNorm)), None
    if any(True for _ in child.children()):
        return None, None
    probe = matching.probe_rms_norm(child)
    if not probe.ok:
        if not probe.candidate:
            return None, None
        return FusionRow(path, "rms_norm", type(child).__name__, None, False, reason=probe.reason,
                         eligible=False), None
    why = _instance_override(child)
    if why is not None:
        return FusionRow(path, "rms_norm", type(child).__name__, None, False, reason=why), None
    if probe.eps_error is not None:   # an RMSNorm whose epsilon the fused ops refuse: as for nn.LayerNorm's (a review:
        # it was skipped as having "no eps attribute", under a 100% title)
        e = probe.eps_error
        raise type(e)(f"{path} ({type(child).__name__}): {e}") from None
    new = None if dry_run else _build(path, child, FusedRMSNorm.from_module, child, probe.eps,
                                      output_in_weight_dtype=probe.output_in_weight_dtype,
                                      output_in_input_dtype=probe.output_in_input_dtype,
                                      weight_offset=probe.weight_offset, verify=False)  # probed above
    weight = getattr(child, "weight", None)   # None: torch.nn.RMSNorm(elementwise_affine=False)
    plain = matching.is_torch_rms_norm(child)   # (a subclass with its own forward: as its probe found)
    shape = tuple(child.normalized_shape) if plain else (weight.numel(),)
    cast = not plain and not probe.output_in_input_dtype
    fwd, bwd = _impls("rms_norm", child, lambda d, t: (
        torch.empty(_probe_rows(shape), *shape, device=d, dtype=t), shape, _op_weight(weight, probe.weight_offset),
        probe.eps, cast))
    offset = f", weight_offset={probe.weight_offset}" if probe.weight_offset else ""
    return FusionRow(path, "rms_norm", type(child).__name__, "FusedRMSNorm", True, fwd, bwd,
                     f"RMSNorm ({probe.reason}), eps={probe.eps}{offset}{_small_note(child)}"), new


def _gated_norm_impls(module: nn.Module, impl: str | None = None, like: torch.Tensor | None = None,
                      form: tuple[int | None, bool] | None = None) -> tuple[str, str]:
    """(forward, backward) of a gated RMSNorm's op ``rms_norm_gated`` (its implementation ``ops`` runs ops
    ``rms_norm`` and ``swiglu``, each chosen for the same rows, each call); ``form``: (group size, norm first) of a
    model's module (the probe's), else the fused module's own."""
    n = module.weight.numel()
    eps = matching.eps_of(module)[1]
    group, first = form if form is not None else (module.group_size, module.norm_before_gate)

    def inputs(d, t):
        x = torch.empty(_probe_rows((n,)), n, device=d, dtype=t)
        return x, x, module.weight, 1e-6 if eps is None else eps, group, first

    return _impls("rms_norm_gated", module, inputs, impl, like)


def _consider_gated_norm(child: nn.Module, path: str, dry_run: bool, like=None):
    """The report's row for a gated RMSNorm (``forward(hidden_states, gate)``) with ``rms_norm_gated`` in ops, and its
    replacement (:class:`~pipegoose.nn.fusion.modules.FusedRMSNormGated`, sharing its weight) where
    ``matching.probe_rms_norm_gated`` finds Qwen3-Next's formula or Mamba2's (its form: the probe's order and group);
    else skipped with the probe's reason."""
    from .modules import FusedRMSNormGated

    name = type(child).__name__
    _, _, bad_eps = matching.eps_of(child)
    if bad_eps is not None:   # (an epsilon the ops refuse: an error naming the module, as for an RMSNorm's)
        raise type(bad_eps)(f"{path} ({name}): {bad_eps}") from None
    probe = matching.probe_rms_norm_gated(child)
    if not probe.ok:
        return FusionRow(path, "rms_norm_gated", name, None, False, reason=probe.reason, eligible=False), None
    why = _instance_override(child)
    if why is not None:
        return FusionRow(path, "rms_norm_gated", name, None, False, reason=why), None
    new = None if dry_run else _build(path, child, FusedRMSNormGated.from_module, child, verify=False,  # probed
                                      group_size=probe.group_size, norm_before_gate=probe.norm_before_gate)
    fwd, bwd = _gated_norm_impls(child, None, like, (probe.group_size, probe.norm_before_gate))
    how = ("(implementation ops: op rms_norm, then op swiglu)" if probe.norm_before_gate else
           "(the gate first: the kernel where requested, impl pipegoose; else PyTorch's formula)")
    return FusionRow(path, "rms_norm_gated", name, "FusedRMSNormGated", True, fwd, bwd,
                     f"gated RMSNorm ({probe.reason}), eps={probe.eps}: op rms_norm_gated {how}"
                     + _small_note(child)), new


@dataclass(frozen=True)
class _Activation:
    """How ``fuse`` treats one kind of activation module (the kind is also its op's name): its probe
    (``transformers.matching``), the fused module's class name in ``modules``, whether the op takes the probe's
    ``approximate`` after the input (GELU's), and the row's words after the probe's reason."""

    probe: Callable[[nn.Module], "matching.ActivationProbe"]
    replacement: str
    takes_approximate: bool
    words: str   # ({a}: the probe's approximate)

    def op_args(self, approximate: str | None) -> tuple:
        """The op's arguments after the input."""
        return (approximate,) if self.takes_approximate else ()

    def fused_class(self) -> type:
        from . import modules

        return getattr(modules, self.replacement)


_ACTIVATIONS = {
    "gelu": _Activation(matching.probe_gelu, "FusedGELU", True, "op gelu, approximate={a!r}: one kernel each way, "
                                                                "ours or F.gelu as the dispatcher chooses"),
    "squared_relu": _Activation(matching.probe_squared_relu, "FusedSquaredReLU", False,
                                "op squared_relu: one kernel each way where ours runs (transformers' relu and square: "
                                "two forward, three backward), the same values"),
}


def _fused_activation_kind(module: nn.Module) -> str | None:
    """The kind of a fused activation module (``FusedGELU``: ``gelu``, ``FusedSquaredReLU``: ``squared_relu``), or
    None."""
    return next((k for k, a in _ACTIVATIONS.items() if isinstance(module, a.fused_class())), None)


def _activation_candidate(module: nn.Module) -> str | None:
    """The kind of activation module ``module``'s class name says (``gelu``: :func:`matching.gelu_candidate`;
    ``squared_relu``: :func:`matching.squared_relu_candidate`), or None."""
    if matching.gelu_candidate(module):
        return "gelu"
    return "squared_relu" if matching.squared_relu_candidate(module) else None


def _consider_activation(kind: str, child: nn.Module, path: str, dry_run: bool, like):
    """(row, replacement or None) for an activation module of ``kind`` (:func:`_activation_candidate`; ``kind`` in
    ``ops``): ``FusedGELU`` with the probe's ``approximate``, or ``FusedSquaredReLU``, where the probe passes it, a
    skipped row with the probe's reason where not."""
    act = _ACTIVATIONS[kind]
    probe = act.probe(child)
    if not probe.ok:
        return FusionRow(path, kind, type(child).__name__, None, False, reason=probe.reason, eligible=False), None
    why = _instance_override(child)
    if why is not None:
        return FusionRow(path, kind, type(child).__name__, None, False, reason=why), None
    kwargs = dict(approximate=probe.approximate) if act.takes_approximate else {}
    new = None if dry_run else _build(path, child, act.fused_class().from_module, child, **kwargs,
                                      verify=False)  # probed above
    fwd, bwd = _activation_impls(kind, child, act.op_args(probe.approximate), like=like)
    return FusionRow(path, kind, type(child).__name__, act.replacement, True, fwd, bwd,
                     f"{probe.reason}; {act.words.format(a=probe.approximate)}" + _small_note(child, like)), new


def _consider_own_attention(own: _OwnAttention, child: nn.Module, parent: nn.Module, path: str, attention: str,
                            dry_run: bool):
    """(row, replacement or None) for an attention module fuse replaces by one of ours (``own``: Bloom's, MPT's;
    ``attention`` in ``ops``): ``own.fused`` where its probe passes and ``attention`` is not ``"keep"``, a skipped row
    with the reason where not. ``parent``: the module holding it (MPT's: whether its forward takes
    ``output_attentions``, which the hook of :func:`_watch_output_attentions` tells the fused module)."""
    name = type(child).__name__
    if attention == "keep":
        return FusionRow(path, "attention", name, None, False, reason="attention='keep'", eligible=False), None
    probe = own.probe(child)
    if not probe.ok:
        return FusionRow(path, "attention", name, None, False, reason=probe.reason, eligible=False), None
    why = _instance_override(child)
    if why is not None:
        return FusionRow(path, "attention", name, None, False, reason=why), None
    new = None if dry_run else _build(path, child, own.fused.from_module, child, verify=False)
    if new is not None:
        # the module's attributes, the same objects, carried by the caller (_carry_attrs) rather than held as the new
        # module's own, so that unfuse hands what was changed on the fused module back (a review: Bloom's
        # hidden_dropout set while fused was lost)
        for key in own.carried:
            del new.__dict__[key]
    fwd, bwd = _own_attention_impls(child)
    weights = ""
    if own.fused is _mpt.FusedMptAttention:
        weights = ("; the weights of output_attentions=True (detached) through hooks on the module holding it" if
                   _mpt.takes_output_attentions(parent) else
                   f"; {type(parent).__name__}'s forward takes no output_attentions: the weights only where the "
                   "softmax path runs")
    return FusionRow(path, "attention", name, own.fused.__name__, True, fwd, bwd,
                     f"{probe.reason}: {own.words} (once per forward pass), on pipegoose attention: SDPA with that "
                     "bias (no scores materialised; off CUDA too), the fused masked softmax where the tuning table or "
                     f"PIPEGOOSE_IMPL_ATTENTION asks; fully masked rows give zeros{weights}"), new


def _watch_output_attentions(parent: nn.Module, new: nn.Module, state: "_Fusion") -> None:
    """For a ``FusedMptAttention`` put in ``parent``: the hooks that pass it each call's ``output_attentions``
    (``transformers.mpt.watch_output_attentions``: ``MptBlock`` does not pass it on), their handles kept for
    :func:`_undo`."""
    if isinstance(new, _mpt.FusedMptAttention):
        handles = _mpt.watch_output_attentions(parent)
        if handles is not None:
            state.weight_hooks.append(handles)


def _own_attention_impls(module: nn.Module) -> tuple[str, str]:
    """The report's implementation columns of an attention module fuse replaces by one of ours (Bloom's, MPT's):
    ``sdpa @128`` where it runs SDPA for the probe's scores (on CUDA as :func:`_attention_impls` says; off CUDA unless
    the variables ask for the softmax path), else the softmax op's choice."""
    from .transformers import attention as attn

    p = _first_param(module)
    if p is not None and p.device.type != "meta" and attn.bias_runs_sdpa(p.device, p.dtype, _PROBE_SEQ):
        return f"sdpa @{_PROBE_SEQ}", f"sdpa @{_PROBE_SEQ}"
    return _attention_impls(module, "pipegoose")


def _activation_impls(op: str, module: nn.Module, args: tuple, impl: str | None = None,
                      like: torch.Tensor | None = None) -> tuple[str, str]:
    """(forward, backward) of an activation module, as :func:`_impls` gives them: op ``op`` (``gelu``,
    ``squared_relu``; ``args``: its arguments after the input) for rows of :data:`_PROBE_WIDTH` (an activation has no
    width of its own), enough that it is not a small problem."""
    rows = _probe_rows((_PROBE_WIDTH,))
    return _impls(op, module, lambda d, t: (torch.empty(rows, _PROBE_WIDTH, device=d, dtype=t), *args),
                  impl, like, any_width=True)


def _weightless_leaf(child: nn.Module) -> bool:
    """A leaf module without parameters, other than ``torch.nn.RMSNorm(elementwise_affine=False)`` with torch's own
    forward (whose path is the RMSNorm probe's): the probe of norms without parameters decides whether it is one."""
    return (not matching.is_torch_rms_norm(child) and not any(True for _ in child.parameters())
            and not any(True for _ in child.children()))


def _layer_norm_module_leaf(child: nn.Module) -> bool:
    """A leaf module of a ``weight`` and maybe a ``bias``, not one of torch's norms nor parametrized: the LayerNorm
    probe (``matching.probe_layer_norm_module``) decides whether it is a LayerNorm of its own class (Cohere's)."""
    names = [n for n, _ in child.named_parameters(recurse=False)]
    return ("weight" in names and set(names) <= {"weight", "bias"} and not any(True for _ in child.children())
            and not isinstance(child, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase))
            and not parametrize.is_parametrized(child))


def _consider_layer_norm_module(child, path, ops, dry_run, MixedFusedLayerNorm, probe):
    """:func:`_consider` for a LayerNorm module of its own class (``probe``: ``matching.probe_layer_norm_module``'s,
    ok or a candidate): ``MixedFusedLayerNorm`` sharing its ``weight`` (and ``bias``), kind ``layer_norm``; one the
    probe refuses after it computed LayerNorm's formula gets a skipped row, not eligible."""
    if "layer_norm" not in ops:
        return None, None
    name = type(child).__name__
    if not probe.ok:
        return FusionRow(path, "layer_norm", name, None, False, reason=probe.reason, eligible=False), None
    why = _instance_override(child)
    if why is not None:
        return FusionRow(path, "layer_norm", name, None, False, reason=why), None
    if probe.eps_error is not None:   # an epsilon the fused ops refuse: raised, as for the other norms
        e = probe.eps_error
        raise type(e)(f"{path} ({name}): {e}") from None
    new = None if dry_run else _build(path, child, MixedFusedLayerNorm.from_module, child, probe.eps, verify=False,
                                      output_in_input_dtype=probe.output_in_input_dtype)
    w, b = child.weight, getattr(child, "bias", None)
    shape = tuple(w.shape)
    fwd, bwd = _impls("layer_norm", child, lambda d, t: (
        torch.empty(_probe_rows(shape), *shape, device=d, dtype=t), shape, w, b))
    return FusionRow(path, "layer_norm", name, "MixedFusedLayerNorm", True, fwd, bwd,
                     f"{probe.reason}, same parameters{_small_note(child)}"), new


def _consider_weightless(child, path, ops, dry_run, MixedFusedLayerNorm, FusedRMSNorm, like):
    """:func:`_consider` for a leaf module without parameters: a norm that the weightless probe accepts
    (``matching.probe_weightless_norm``: Gemma 4's ``Gemma4RMSNorm(with_scale=False)``, OLMo's ``OlmoLayerNorm``) ->
    ``FusedRMSNorm`` (of the last dimension where the module takes rows of any width) or ``MixedFusedLayerNorm``,
    without weight, the output's dtype under autocast as the probe found the module's; a norm-like one it refuses
    gets a skipped row (kind ``layer_norm`` where the probe found that formula, else ``rms_norm``), not eligible."""
    probe = matching.probe_weightless_norm(child)
    if not probe.candidate:
        return None, None
    kind = probe.kind or "rms_norm"
    if kind not in ops:
        return None, None
    if not probe.ok:
        return FusionRow(path, kind, type(child).__name__, None, False, reason=probe.reason, eligible=False), None
    why = _instance_override(child)
    if why is not None:
        return FusionRow(path, kind, type(child).__name__, None, False, reason=why), None
    if probe.eps_error is not None:   # an epsilon the fused ops refuse: raised, as for a norm with a weight
        e = probe.eps_error
        raise type(e)(f"{path} ({type(child).__name__}): {e}") from None
    width = (probe.width,) if probe.width else None
    shape = width or (_PROBE_WIDTH,)
    if kind == "layer_norm":
        new = None if dry_run else _build(path, child, MixedFusedLayerNorm, width, eps=probe.eps,
                                          elementwise_affine=False, output_in_input_dtype=probe.output_in_input_dtype)
        fwd, bwd = _impls("layer_norm", child, lambda d, t: (
            torch.empty(_probe_rows(shape), *shape, device=d, dtype=t), shape, None, None), like=like)
        replacement = "MixedFusedLayerNorm"
    else:
        new = None if dry_run else _build(path, child, FusedRMSNorm, width, eps=probe.eps, elementwise_affine=False,
                                          output_in_input_dtype=probe.output_in_input_dtype)
        fwd, bwd = _impls("rms_norm", child, lambda d, t: (
            torch.empty(_probe_rows(shape), *shape, device=d, dtype=t), shape, None, probe.eps, False),
            like=like, any_width=width is None)
        replacement = "FusedRMSNorm"
    if new is not None:
        new.train(child.training)
    return FusionRow(path, kind, type(child).__name__, replacement, True, fwd, bwd,
                     f"{probe.reason}{_small_note(child, like)}"), new


def _op_weight(weight: torch.Tensor | None, offset: float) -> torch.Tensor | None:
    """The weight a FusedRMSNorm with ``weight_offset`` ``offset`` hands op ``rms_norm`` (for the dispatcher's
    choice in the report): ``weight`` itself, or with an offset an empty fp32 tensor like it (fp64 for an fp64 one),
    as its forward passes ``weight.float() + offset``."""
    if not offset or weight is None:
        return weight
    return torch.empty(weight.shape, device=weight.device,
                       dtype=torch.float64 if weight.dtype == torch.float64 else torch.float32)


def _swiglu_impls(mlp: nn.Module, packed: bool, impl: str | None = None,
                  approximate: str | None = None, gate: str = "gate_proj") -> tuple[str, str]:
    """(forward, backward) of a SwiGLU or GeGLU MLP's activation, as :func:`_impls` gives them: op ``swiglu`` (or,
    with GELU's ``approximate``, ``geglu``) for gate and up of the intermediate size (the gate projection's, ``gate``:
    ``gate_proj``, T5's ``wi_0``; its ``out_features``, else its weight's first dim), or, ``packed`` (gate and up in
    one projection, ``gate``: ``gate_up_proj``, ModernBERT's ``Wi``), op ``swiglu.packed`` (``geglu.packed``) for
    one input of twice that (that projection's); rows enough that it is not a small problem."""
    proj = getattr(mlp, gate, None)
    width = int(getattr(proj, "out_features", None) or getattr(getattr(proj, "weight", None), "shape", (1,))[0])
    rows = _probe_rows((width,))
    if packed:
        op, more = ("swiglu.packed", ()) if approximate is None else ("geglu.packed", (approximate,))
        return _impls(op, mlp, lambda d, t: (torch.empty(rows, width, device=d, dtype=t), *more), impl)
    op, more = ("swiglu", ()) if approximate is None else ("geglu", (approximate,))
    return _impls(op, mlp, lambda d, t: (torch.empty(rows, width, device=d, dtype=t),
                                         torch.empty(rows, width, device=d, dtype=t), *more), impl)


def _gated_kind(module: nn.Module) -> str:
    """The report's kind of a fused T5 gated MLP: ``geglu`` where it runs op geglu (GELU), else ``swiglu``."""
    return "swiglu" if getattr(module, "approximate", None) is None else "geglu"


def _mlp_kind(probe: matching.SwiGLUProbe) -> str:
    """The report's kind of a gated MLP the probe looked at: ``geglu`` for GELU (what ``FusedGeGLUMLP`` takes with
    gate and up apart; a ``gate_up_proj`` MLP of GELU is refused, no fused module takes it, but reported under
    ``geglu`` too, as GELU MoE experts are), else ``swiglu``."""
    return "geglu" if probe.approximate is not None else "swiglu"


def _consider_swiglu(child, path, ops, dry_run):
    """(row, replacement or None) for a module with SwiGLU's projections (``gate_proj``, ``up_proj`` and
    ``down_proj``: ``FusedSwiGLUMLP``, or with GELU ``FusedGeGLUMLP``; ``gate_up_proj`` and ``down_proj``:
    ``FusedGateUpSwiGLUMLP``; T5's ``wi_0``, ``wi_1`` and ``wo``: ``FusedT5DenseGatedActDense``, op ``swiglu`` or
    ``geglu`` by its activation; ModernBERT's ``Wi`` and ``Wo``: ``FusedModernBertMLP``; Granite's ``input_linear``
    and ``output_linear``: ``FusedGraniteMLP``; LFM2's ``w1``, ``w3`` and ``w2``: ``FusedLfm2MLP``); None when it has
    none of them (not a candidate) or is of a kind (``swiglu``, ``geglu``) left out of ``ops``. The row's reason names
    the layout."""
    from .modules import (FusedGateUpSwiGLUMLP, FusedGeGLUMLP, FusedGraniteMLP, FusedLfm2MLP, FusedModernBertMLP,
                          FusedSwiGLUMLP, FusedT5DenseGatedActDense)

    probe = matching.probe_swiglu_mlp(child)
    kind = _mlp_kind(probe)
    if not probe.candidate or kind not in ops:
        return None
    if not probe.ok:
        return FusionRow(path, kind, type(child).__name__, None, False, reason=probe.reason, eligible=False), None
    why = _instance_override(child)
    if why is None:
        from .modules import FusedGELU

        held_act = next((n for n, m in child.named_children() if isinstance(m, FusedGELU)), None)
        if held_act is not None:   # (fused again here, unfuse could not put the GELU back in place; a review)
            why = (f"its activation {held_act} is a FusedGELU of an earlier fuse(): unfuse that model first, then fuse "
                   "the MLP with its own activation")
    if why is not None:
        return FusionRow(path, kind, type(child).__name__, None, False, reason=why), None
    t5 = probe.layout == "/".join(FusedT5DenseGatedActDense._PROJECTIONS)
    modernbert = probe.layout == "/".join(FusedModernBertMLP._PROJECTIONS)
    what = (("T5 gated MLP, " if t5 else "ModernBERT MLP, " if modernbert else "")
            + ("GeGLU MLP" if kind == "geglu" else "SwiGLU MLP"))
    if t5:
        cls, more = FusedT5DenseGatedActDense, dict(activation=probe.activation, cast_to_wo=probe.down_cast)
    elif modernbert:
        cls, more = FusedModernBertMLP, dict(activation=probe.activation)
    elif kind == "geglu":
        cls, more = FusedGeGLUMLP, dict(approximate=probe.approximate)
    elif probe.layout == "/".join(FusedGraniteMLP._PROJECTIONS):
        cls, more = FusedGraniteMLP, {}
    elif probe.layout == "/".join(FusedLfm2MLP._PROJECTIONS):
        cls, more = FusedLfm2MLP, {}
    else:
        cls, more = FusedGateUpSwiGLUMLP if probe.packed else FusedSwiGLUMLP, {}
    new = None if dry_run else _build(path, child, cls.from_module, child, verify=False, **more)  # probed above
    fwd, bwd = _swiglu_impls(child, probe.packed, approximate=probe.approximate if kind == "geglu" else None,
                             gate=probe.layout.split("/")[0])
    note = (f"; op geglu.packed, approximate={probe.approximate!r}" if probe.packed and kind == "geglu" else
            "; op swiglu.packed" if probe.packed else
            f"; op geglu, approximate={probe.approximate!r}" if kind == "geglu" else "")
    # (the other layouts' reasons as before: their formula names them)
    layout = f" ({probe.layout})" if t5 or modernbert else ""
    if t5 or modernbert:
        note += "; dropout kept"
    if t5 and not probe.down_cast:
        note += "; no cast to wo's dtype (LongT5's forward has none)"
    return FusionRow(path, kind, type(child).__name__, cls.__name__, True, fwd, bwd,
                     f"{what} ({probe.reason}), same projections{layout}{note}" + _small_note(child)), new


def _consider_experts(model, child, path, ops, dry_run, state, held: set) -> FusionRow | None:
    """The report's row (kind ``swiglu``, or ``geglu`` for GELU experts) for a MoE layer's experts module of
    transformers' experts interface (:mod:`~pipegoose.nn.fusion.transformers.experts`), whose gate ``fuse`` routes to
    op ``swiglu.packed`` (``geglu.packed``): held where another fuse() call (or a copy of a fused model) put the gate
    there; None where its kind is left out of ``ops`` (counted as not requested where it would be fused)."""
    name = type(child).__name__
    if _experts.hooked(child):
        owner = next((r for r, st in list(_STATE.items())
                      if any(ref() is child for ref, *_ in st.experts_gates)), None)
        why = (_earlier_fuse_reason(model, owner, "kept") if owner is not None else
               "already fused before this call (a copy of a fused model): kept here, and unfuse() will not revert it")
        kind = "swiglu" if getattr(child.__dict__["_apply_gate"], "approximate", None) is None else "geglu"
        row = FusionRow(path, kind, name, "FusedExpertsGate", True, "-", "-", reason=why)
        held.add(id(row))
        _hold(state, row, path, _experts.hooked)
        return row
    found = _experts.probe(child)
    patched = None
    if "_apply_gate" in child.__dict__:
        patched = "an _apply_gate set on the instance (a patch): the fused gate would take its place"
    elif "forward" in child.__dict__ and not ("_hf_hook" in child.__dict__ and "_old_forward" in child.__dict__):
        # (accelerate's hook calls the class's forward, _old_forward, which calls _apply_gate as before: taken)
        patched = ("a forward set on the instance (a patch, or a wrapper of another library), which fuse cannot "
                   "vouch calls _apply_gate")
    kind = found.kind
    if kind not in ops:
        if found.ok and patched is None:
            state.report.not_requested[kind] = state.report.not_requested.get(kind, 0) + 1
        return None
    if not found.ok:
        return FusionRow(path, kind, name, None, False, reason=found.reason, eligible=False)
    if patched is not None:
        return FusionRow(path, kind, name, None, False, reason=patched)
    impl = _experts.implementation(child)
    width = _experts.gate_width(child)
    if not _experts.runs_gate(child, impl):
        fwd = bwd = _MODEL_CODE
        if impl in _experts.OWN_ACTIVATION:
            what = f"is {impl!r} (a kernel that computes the activation itself, never calling _apply_gate)"
        elif impl == "eager":
            what = "is 'eager' (transformers' loop, which computes act_fn(gate) * up itself)"
        else:
            what = ("names none (a module outside a transformers model: transformers runs the class's loop, which "
                    "computes act_fn(gate) * up itself)")
        where = (f"; its config's experts implementation {what}: the fused gate runs once another is set (grouped_mm, "
                 "batched_mm: model.set_experts_implementation, or the config's _experts_implementation)")
    else:
        rows = _probe_rows((width or 2,))
        extra = () if found.approximate is None else (found.approximate,)
        fwd, bwd = _impls(found.op, child, lambda d, t: (torch.empty(rows, width or 2, device=d, dtype=t), *extra))
        where = f"; experts implementation {impl!r}" if impl else ""
        if impl in (None, "eager"):   # a class whose own loop calls _apply_gate (Step3p7's)
            where = (f"; experts implementation {repr(impl) if impl else 'none'} (the class's own forward, which "
                     "calls _apply_gate)")
    if not dry_run:
        gate = _experts.install(child, found.act, found.approximate)
        state.experts_gates.append((weakref.ref(child), weakref.ref(gate), path))
    return FusionRow(path, kind, name, "FusedExpertsGate", True, fwd, bwd,
                     "MoE experts' gate (" + found.reason.removeprefix("probe: ") + "): the packed gate_up_proj output "
                     f"of the routed tokens runs op {found.op} (the instance's _apply_gate; weights and forward "
                     "unchanged)" + where + _small_note(child))


def _rope_probe_inputs(module: nn.Module, rotary: int | None = None, head: int | None = None,
                       interleaved: bool = False):
    """The report's probe of an attention module's RoPE: q and k of its heads and head size (``head``, else from the
    module, else its config), one batch of positions enough that it is not a small problem, and tables of ``rotary``
    values (None: the head size), for the op's rotation (``interleaved`` or not); None where they cannot be told."""
    config = getattr(module, "config", None)
    heads = _config_value(config, "num_attention_heads")
    kv_heads = _config_value(config, "num_key_value_heads") or heads
    dim = head or getattr(module, "head_dim", None) or _config_value(config, "head_dim")
    hidden = _config_value(config, "hidden_size")
    if not dim and isinstance(heads, int) and heads > 0 and isinstance(hidden, int):
        dim = hidden // heads
    if not all(isinstance(v, int) and v > 0 for v in (heads, kv_heads, dim)):
        return None
    seq = _probe_rows(((heads + kv_heads) * dim,))
    r = rotary or dim
    return lambda d, t: (torch.empty(1, heads, seq, dim, device=d, dtype=t),
                         torch.empty(1, kv_heads, seq, dim, device=d, dtype=t),
                         torch.empty(1, seq, r, device=d, dtype=t), torch.empty(1, seq, r, device=d, dtype=t), 1,
                         interleaved)


def _config_value(config, name: str):
    """``config.<name>``, or None where it is missing or cannot be read (transformers raises a RuntimeError for an
    attribute that differs between the layers of a heterogeneous config)."""
    try:
        return getattr(config, name, None)
    except Exception:   # noqa: BLE001 - a config that cannot say gives no value
        return None


_PROPORTIONAL = "proportional"   # (transformers' rope_type whose tables cover the whole head whatever the factor)


def _rotary_factor(module: nn.Module, outer=None) -> tuple[float | None, int | None]:
    """(the share of each head that ``module`` rotates, the rotated values a head) from the module (GPT-NeoX's
    ``rotary_ndims``, GPT-J's ``rotary_dim``, against its head size) or its config, else ``outer`` (the model's: a
    module of no config of its own, DeepSeek V4's compressor, rotates as its model's attention does; transformers 5
    reads ``rope_parameters`` first: a top-level ``partial_rotary_factor`` may be stale there); (None, None) where
    none says, or where the factor is a proportional RoPE's (Gemma 4's full attention: tables of the whole head, the
    frequencies past the factor zero)."""
    config = getattr(module, "config", None)
    if config is None:
        config = outer
    ndims = getattr(module, "rotary_ndims", None)   # what the module rotates (GPT-NeoX), against its head size
    if not isinstance(ndims, int):
        ndims = getattr(module, "rotary_dim", None)   # (GPT-J's, CodeGen's; None: the whole head)
    head = getattr(module, "head_size", None) or getattr(module, "head_dim", None)
    if isinstance(ndims, int) and isinstance(head, int) and head > 0:
        return ndims / head, ndims
    params = _config_value(config, "rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        # per layer type (Laguna, MiMo-V2-Flash, ...): this module's, else the smallest factor of any type
        types, idx = _config_value(config, "layer_types"), getattr(module, "layer_idx", None)
        if isinstance(types, (list, tuple)) and isinstance(idx, int) and 0 <= idx < len(types) and types[idx] in params:
            params = params[types[idx]]
        else:
            fs = [v.get("partial_rotary_factor") for v in params.values() if v.get("rope_type") != _PROPORTIONAL]
            fs = [f for f in fs if isinstance(f, (int, float)) and not isinstance(f, bool)]
            params = {"partial_rotary_factor": min(fs)} if fs else {}
    if isinstance(params, dict) and params.get("rope_type") == _PROPORTIONAL:
        return None, None
    factors = [params.get("partial_rotary_factor") if isinstance(params, dict) else None,
               _config_value(config, "partial_rotary_factor"), _config_value(config, "rotary_pct")]
    factor = next((f for f in factors if isinstance(f, (int, float)) and not isinstance(f, bool)), None)
    if factor is None:
        return None, None
    if not isinstance(head, int) or head <= 0:
        heads, hidden = _config_value(config, "num_attention_heads"), _config_value(config, "hidden_size")
        head = _config_value(config, "head_dim") or (hidden // heads if isinstance(heads, int) and heads > 0
                                                     and isinstance(hidden, int) else None)
    return factor, (int(head * factor) if isinstance(head, int) and head > 0 else None)


def _rope_unused(module: nn.Module, found, outer=None) -> str | None:
    """Why an attention module that mentions ``apply_rotary_pos_emb`` would never call it in a form the op takes
    (None: it would): an interleaved rotation selected by the config (it calls another function), or partial rotary
    (a factor below 1) where its function (``found``, the function's
    :class:`~pipegoose.nn.fusion.transformers.rope.Probe`) takes tables narrower than a head and computes them
    otherwise than GPT-NeoX's partial rotary. Partial rotary is no reason where the function computes GPT-NeoX's
    (GPT-NeoX's, Phi-3's: calls with narrower tables run the kernel's partial path) or raises for narrower tables
    (Llama's): a module whose calls run then passes it the rotated part of each head alone, with tables of that width
    (Phi's and StableLM's ``q[..., :rotary_ndims]``), the plain whole-width form. Nothing here depends on the module's
    device, dtype or shapes: whether the kernel takes a call is asked per call (a model fused on the CPU runs the
    kernel once moved to a GPU; calls that the kernel does not take, an odd number of rotated values say, run the
    model's own code)."""
    config = getattr(module, "config", None)
    if config is None:
        config = outer
    if _config_value(config, "rope_interleave") is True:
        return "rope_interleave=True: the model calls its interleaved RoPE function, not apply_rotary_pos_emb"
    factor, rotary = _rotary_factor(module, outer)
    if factor is None or factor >= 1 or found.partial or found.narrow_raises:
        return None
    return (f"partial rotary (factor {factor}): its function takes tables narrower than a head but does not compute "
            "GPT-NeoX's partial rotary with them (probed), which the kernel's path computes: its calls run the "
            "model's own code")


def _rope_found(target):
    """What :func:`~pipegoose.nn.fusion.transformers.rope.probe` finds of ``target``'s function (cached)."""
    return _rope.probe(target.original, target.where)


def _held_rope_row(model, child, path, target) -> FusionRow | None:
    """The report's row for an attention module whose RoPE another fuse() call hooked (of a part of ``model``, or of
    a model holding it), or None when no call did."""
    installed = _rope.dispatching_of(target.current)
    users = installed.__pipegoose_users__ if installed is not None else ()
    if child not in users:
        return None
    owner = next((r for r, st in list(_STATE.items()) if any(ref() is child for ref, _ in st.rope_hooks)), None)
    inside = next((p for p, m in model.named_modules() if m is owner), None) if owner is not None else None
    why = (f"fused by an earlier fuse() of {inside} ({type(owner).__name__}): unfuse() of either reverts it"
           if inside else "fused by an earlier fuse() of a model holding this module: unfuse() of that model "
           "reverts it")
    # (replacement: the hooks, as for a module hooked now; None read "skipped" beside "fused: yes", a review)
    return FusionRow(path, "rope", type(child).__name__, "rope hooks", True, "-", "-", reason=why)


def _consider_rope(model, child, path, target, dry_run, state) -> FusionRow:
    """The report's row for an attention module that applies RoPE through ``target`` (its modeling module's global
    ``apply_rotary_pos_emb``), not hooked by another fuse() call (:func:`_held_rope_row`), and the hooks that route
    its calls to our op (``transformers.rope.install``)."""
    name = type(child).__name__
    found = _rope.probe(target.original, target.where)
    if not found.ok:
        return FusionRow(path, "rope", name, None, False, reason=found.why, eligible=False)
    outer = getattr(model, "config", None)
    why = _rope_unused(child, found, outer)
    if why is not None:
        return FusionRow(path, "rope", name, None, False, reason=why, eligible=False)
    why = _instance_override(child)
    if why is not None:
        return FusionRow(path, "rope", name, None, False, reason=why)
    factor, rotary = _rotary_factor(child, outer)
    # partial rotary: GPT-NeoX's (whole heads and narrower tables; the function computes it), or the module's own
    # slicing (its function raises for narrower tables: the calls that run pass the rotated values alone, Phi's)
    partial = factor is not None and factor < 1 and found.partial
    sliced = factor is not None and factor < 1 and not found.partial and bool(rotary)
    if partial and rotary:
        # (an odd count: transformers' tables hold a cos and sin per frequency, twice, one value more; the function
        # rotates as many values as they hold)
        rotary += rotary % 2
    build = _rope_probe_inputs(child, rotary if partial else None, rotary if sliced else None, found.interleaved)
    choice = _choice("rope", child, build) if build is not None else None
    fwd = bwd = "?" if choice is None else choice.impl + (" (fallback)" if choice.fallback else "")
    p = _first_param(child)
    dtype = p.dtype if p is not None and p.is_floating_point() else torch.float32
    kind = found.kind(dtype, dtype)
    where = ""
    if kind is None:   # (the function computes this dtype otherwise than the op: its own code, the op's fallback)
        fwd = bwd = _MODEL_CODE + " (fallback)"
        where = (f"; here its {_dtype_name(dtype)} calls run the model's own code: its function computes them "
                 "otherwise than the op (probed)")
    elif partial or kind != _rope.EXACT:
        where = (" where the dispatcher chooses the kernel (asked per call), else the model's own code (" +
                 ("what PyTorch's path computes, at less host time)" if kind == _rope.EXACT else
                  f"for {_dtype_name(dtype)} q its function computes, with fp32 or {_dtype_name(dtype)} tables, what "
                  "PyTorch's path does not bit for bit: probed)"))
        if choice is not None and choice.impl != "pipegoose":
            fwd = bwd = _MODEL_CODE + (" (fallback)" if choice.fallback else "")
            where += f"; here now the model's own code: pipegoose: {choice.reasons.get('pipegoose') or choice.reason}"
    if dtype in (torch.float16, torch.bfloat16) and found.kind(dtype, torch.float32) == _rope.CAST:
        where += (f"; {_dtype_name(dtype)} q with fp32 tables: the kernel's fp32 results cast to q's dtype, as the "
                  "function casts its own")
    if not dry_run:
        rec = _rope.install(child, target, found)
        state.rope_hooks.append((weakref.ref(child), rec))
    half = found.one is not None and found.one.half   # (GPT-J's: tables of half the rotated values, each used twice)
    style = ("the interleaved RoPE, each value of its half-width tables used for a pair of neighbours (GPT-J's)"
             if half else _rope.STYLE_WORDS[found.style])
    whose = f"{style}, partial rotary as GLM's" if found.interleaved else "GPT-NeoX's partial rotary"
    # (a function of one tensor a call: GPT-J's, Gemma 4's)
    one = (f" (one tensor a call, ({found.one.params}): each call a launch of its own)" if found.one is not None
           else "")
    tables = ("with tables of half that width; its function raises for other widths" if half else
              "with tables of that width; its function raises for narrower tables")
    what = (f"{whose}, {rotary} of each head's values (probed): its calls{one}" if partial
            else f"{style} (probed): its plain calls{one}, on the {rotary} values of each head that it rotates "
                 f"(partial rotary, factor {factor}: it passes them alone, {tables})," if sliced
            else f"{style} (probed): its plain calls{one}")
    return FusionRow(path, "rope", name, "rope hooks", True, fwd, bwd,
                     f"{target.module_name.rsplit('.', 1)[-1]}.{_rope.NAME}, {what} from this module run op rope"
                     + where + _small_note(child))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _fuse_losses(model, ops, dry_run, report, state, held: set) -> None:
    """The report's rows for the losses of ``model`` and of the language models inside it (a wrapper's: PEFT's
    ``PeftModel``, a training module holding the model), and the swaps (each one's ``loss_function``, per instance;
    or, for a model whose forward builds its own ``CrossEntropyLoss``, the hooks and the class at that global:
    :func:`_fuse_inline_loss`); with ``cross_entropy`` left out of ``ops``, the count of those it would replace
    (``not_requested``). A loss of ours set before this call, and a model whose inline loss another fuse() call routed,
    are held rows whatever ``ops`` says (:func:`_hold_loss`, :func:`_held_inline_row`)."""
    for path, lm in _loss.language_models(model):
        support = _loss.loss_support(lm)
        name, _, candidate, _ = support
        if candidate and name is None and _loss.ours_is_set(lm):
            _hold_loss(model, lm, path, report, state, held)
        elif name == _loss.INLINE and (row := _held_inline_row(model, lm, path)) is not None:
            report.rows.append(row)
            held.add(id(row))
            _hold(state, row, path, _inline.is_user)
        elif "cross_entropy" in ops:
            _fuse_loss(lm, path, support, dry_run, report, state, _wrappers_of(model, path))
        elif name is not None and not (name == _loss.INLINE and _peft_wrapper(_wrappers_of(model, path))):
            # (an inline loss inside PEFT: skipped when asked for, so not counted)
            report.not_requested["cross_entropy"] = report.not_requested.get("cross_entropy", 0) + 1


def _loss_impls(model: nn.Module, inline: bool = False) -> tuple[str, str]:
    """The report's implementation columns of a language model's loss on our cross-entropy (the dispatcher's choice
    for a probe of its vocabulary's width; "?" where its config names none). ``inline``: a model whose forward builds
    its own CrossEntropyLoss, whose classes are its output embeddings' rows (a masked LM's vocabulary: the calls the
    class routes)."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if inline:
        vocab = _inline.classes_of(model)
    if not (isinstance(vocab, int) and vocab > 0):
        return "?", "?"
    rows = _probe_rows((vocab,))
    return _impls("cross_entropy", model, lambda d, t: (torch.empty(rows, vocab, device=d, dtype=t),
                                                         torch.zeros(rows, dtype=torch.long, device=d)))


def _hold_loss(root, model, path, report, state, held: set) -> None:
    """The report's held row for language model ``model`` (at ``path`` in ``root``, the model passed to fuse()),
    whose loss function is one of ours already: set by another fuse() call (of a part of ``root``, of a model holding
    it, of another model sharing it), or, where no live call did, copied with a fused model (or set by hand), which
    no unfuse() removes. Both run our loss: fused, eligible, as a norm fused before is. (A review, session 63: the row
    said fused=False, not eligible, "a copy of a fused model keeps it", for a loss that fuse() of a wrapper had set.)"""
    fn = model.__dict__["_loss_function"]
    name = fn.__name__
    owner = next((r for r, st in list(_STATE.items())
                  if any(ref() is model and f is fn for ref, f in st.loss_swaps)), None)
    if owner is not None:
        reason = _earlier_fuse_reason(root, owner, f"its loss_function is pipegoose's {name}, left as it is here")
    else:
        reason = (f"pipegoose's {name} is set already, by no fuse() call in this process (a copy of a fused model "
                  "keeps it, or it was set by hand): left as it is, and unfuse() will not remove it")
    report.rows.append(FusionRow(path, "cross_entropy", name, name, True, *_loss_impls(model), reason=reason))
    held.add(id(report.rows[-1]))
    _hold(state, report.rows[-1], path, _loss.ours_is_set)


def _fuse_loss(model, path, support, dry_run, report, state, wrappers=()) -> None:
    """The report's row for one language model's loss (``support``: :func:`~.transformers.loss.loss_support` of
    it), and the swap (``model.loss_function``, this instance; or :func:`_fuse_inline_loss`). ``wrappers``: the
    modules holding it (:func:`_wrappers_of`)."""
    name, reason, candidate, original = support
    if not candidate:
        return
    if name is None:
        report.rows.append(FusionRow(path, "cross_entropy", original, None, False, reason=reason, eligible=False))
        return
    if name == _loss.INLINE:
        _fuse_inline_loss(model, path, original, reason, wrappers, dry_run, report, state)
        return
    fwd, bwd = _loss_impls(model)
    if not dry_run:
        fn = _loss.FUNCTIONS[name]
        model.__dict__["_loss_function"] = fn     # transformers' loss_function property returns it
        state.loss_swaps.append((weakref.ref(model), fn))
    report.rows.append(FusionRow(path, "cross_entropy", original, name, True, fwd, bwd, reason))


def _held_inline_row(root, model, path) -> FusionRow | None:
    """The report's held row for language model ``model`` (at ``path`` in ``root``, the model passed to fuse()) whose
    CrossEntropyLoss calls another fuse() call routed (of a part of ``root``, of a model holding it), or None where
    no live call did (not fused, or a copy of a fused model: :func:`_fuse_inline_loss` takes it)."""
    if not _inline.is_user(model):
        return None
    owner = next((r for r, st in list(_STATE.items()) if any(ref() is model for ref, _ in st.inline_losses)), None)
    kept = "its CrossEntropyLoss calls left routed as they are here"
    reason = (_earlier_fuse_reason(root, owner, kept) if owner is not None else
              "fused by an earlier fuse() of a model holding this one: unfuse() of that model reverts it")
    return FusionRow(path, "cross_entropy", _inline.target(model).row, _inline.ROW_REPLACEMENT, True,
                     *_loss_impls(model, inline=True), reason=reason)


def _fuse_inline_loss(model, path, original, reason, wrappers, dry_run, report, state) -> None:
    """The report's row (``original``: the loss the model has) for a language model whose forward builds its own
    ``CrossEntropyLoss`` from its modeling module's global (BERT's heads) or calls a child loss module of its own
    (DistilBERT's ``mlm_loss_fct``), and the routing of those calls to our op (``transformers.inline_loss.install``:
    the model's hooks and the dispatching class at that global or as that child's class). Inside PEFT, whose tuner
    calls the model's forward directly (no module hooks run), skipped with the reason; a copy of a fused model keeps
    the hooks it carries."""
    replacement = _inline.ROW_REPLACEMENT
    peft = _peft_wrapper(wrappers)
    if peft is not None:
        report.rows.append(FusionRow(path, "cross_entropy", original, None, False, eligible=False, reason=(
            f"inside {type(peft).__name__} (PEFT), whose tuner calls the model's forward directly "
            "(model.forward(...)), which runs no module hooks: its CrossEntropyLoss calls would never run our op")))
        return
    fwd, bwd = _loss_impls(model, inline=True)
    if not dry_run:
        state.inline_losses.append((weakref.ref(model), _inline.install(model, _inline.target(model))))
    report.rows.append(FusionRow(path, "cross_entropy", original, replacement, True, fwd, bwd, reason))


def _peft_wrapper(wrappers: list[nn.Module]) -> nn.Module | None:
    """The first of ``wrappers`` that is PEFT's (its class from the ``peft`` package), or None."""
    return next((w for w in wrappers if type(w).__module__.split(".")[0] == "peft"), None)


def _wrappers_of(model: nn.Module, path: str) -> list[nn.Module]:
    """The modules on the way from ``model`` down to the one at ``path`` (``model`` first; none for ``path == ""``)."""
    if not path:
        return []
    parts = path.split(".")
    out, m = [model], model
    for name in parts[:-1]:
        m = m._modules[name]
        out.append(m)
    return out


def _fuse_lm_head(model, path, wrappers, dry_run, report, state) -> None:
    """The report's row for one causal LM's head and loss in one (``linear_cross_entropy``), and the hooks
    (:mod:`pipegoose.nn.fusion.transformers.lm_head`). ``wrappers``: the modules holding it (PEFT's tuners call its
    ``forward`` directly, which runs no hooks: not fused inside them)."""
    if _loss.loss_support(model)[2] is False:   # not a language model with transformers' loss_function: no row
        return
    peft = _peft_wrapper(wrappers)
    ok, reason = _lm_head.support(model)
    if ok and peft is not None:
        ok, reason = False, (f"inside {type(peft).__name__} (PEFT), whose tuner calls the model's forward directly "
                             f"(model.forward(...)), which runs no module hooks: the fused head would never run")
    if not ok:
        report.rows.append(FusionRow(path, "linear_cross_entropy", type(model).__name__, None, False, reason=reason,
                                     eligible=False))
        return
    head = _lm_head.head_of(model)
    rows = _probe_rows((head.weight.shape[0],))
    # (the weight's stand-in an expanded 0-dim tensor: its shape without its memory, 1 GB for Llama-3-8B's head)
    fwd, bwd = _impls("fused_linear_cross_entropy", model, lambda d, t: (
        torch.empty(rows, head.weight.shape[1], device=d, dtype=t),
        torch.empty((), device=d, dtype=t).expand(head.weight.shape), torch.zeros(rows, dtype=torch.long, device=d)))
    if not dry_run:
        state.head_swaps.append((weakref.ref(model), _lm_head.install(model)))
    report.rows.append(FusionRow(path, "linear_cross_entropy", type(model).__name__, _lm_head.NAME, True, fwd, bwd,
                                 reason))


def _runs_our_attention(m: nn.Module) -> bool:
    """Whether attention module ``m``'s own config selects our attention function."""
    from .transformers import attention as attn

    own = m.__dict__.get("config")
    return matching.is_config(own) and matching.get_attn_implementation(own) in attn.OUR_NAMES


def _attention_owners(model: nn.Module):
    """(owners, stray): the models whose config selects the attention of the attention modules inside them, each as
    (path, module, config, [(path, attention module), ...]) (paths from ``model``), and the attention modules of
    ``model`` that none governs.

    The owner is ``model`` itself where it has a transformers config (its attention modules follow it, whatever
    holds them: one attention module fused alone is its own owner); else the outermost transformers ``PreTrainedModel``
    inside it that has one (a training module holding the model, ``nn.DataParallel``, two models in one wrapper; a
    base model inside a ``*ForCausalLM`` shares the latter's config and is governed by it, as when the causal LM is
    fused alone). (A review, session 63: fuse() of a wrapper took the wrapper's own config, None, so the attention of
    the model inside it was skipped as "model has no transformers config" and the title said "100%", while its loss,
    found inside wrappers, was fused.)"""
    def attention_modules(root, root_path):
        # (root itself too: fuse() of one attention module swapped its config and reported nothing; a review)
        # (Bloom's and MPT's are replaced as modules, by the main loop: no config of theirs is swapped)
        return [(f"{root_path}.{p}" if root_path and p else root_path or p, m) for p, m in root.named_modules()
                if matching.is_attention_module(m) and _own_attention(m) is None and not isinstance(m, _OWN_FUSED)]

    config = getattr(model, "config", None)
    if matching.is_config(config):
        return [("", model, config, attention_modules(model, ""))], []
    owners = []
    for path, m in model.named_modules():
        if not path or any(path.startswith(f"{p}.") for p, *_ in owners):
            continue
        own = getattr(m, "config", None)
        if matching.is_pretrained_model(m) and matching.is_config(own):
            owners.append((path, m, own, attention_modules(m, path)))
    governed: set[int] = set()
    for *_, modules in owners:   # (a module two models share: the first one's)
        modules[:] = [(p, m) for p, m in modules if id(m) not in governed]
        governed.update(id(m) for _, m in modules)
    stray = [(p, m) for p, m in attention_modules(model, "") if id(m) not in governed]
    return owners, stray


def _config_swapped_by(m: nn.Module) -> nn.Module | None:
    """The model whose (live) fuse() call swapped the config of module ``m``, or None."""
    return next((root for root, st in list(_STATE.items())
                 if any(ref() is m for ref, *_ in st.config_swaps)), None)


def _attention_fused_before(config, modules) -> set[int]:
    """The ids of the attention modules among ``modules`` (those a model with ``config`` governs) fused by another
    fuse() call.

    Those are the modules whose own config selects ours, set by another call: of a part of the model (their config is
    not the model's; a review, session 60: after fuse(model.model), fuse(model) reported them fused here, "was
    'eager'", and swapped only the outer config), or of a model holding it, or of the model itself inside a wrapper
    fused now (the model's config is that call's copy: fuse(model) then fuse(model.model) counted them as the part's
    own, and unfuse(model.model) "reverted" them without a change)."""
    swapped = any(any(new is config for _, _, new, _ in st.config_swaps) for st in list(_STATE.values()))
    return {id(m) for _, m in modules
            if _runs_our_attention(m) and (m.__dict__.get("config") is not config or swapped)}


def _hold_attention(model, path, m, report, state, held: set) -> None:
    """The report's held row for attention module ``m`` (at ``path`` in ``model``, the model passed to fuse()), whose
    own config selects our attention already: fused by another fuse() call (:func:`_attention_fused_before`), named,
    whatever this call's ``ops`` and ``attention``; or configured so before this call, by no fuse() in this process
    (a copy of a model fused in parts, say), which no unfuse() reverts."""
    impl = matching.get_attn_implementation(m.__dict__["config"])
    fwd, bwd = _attention_impls(m, impl)
    root = _config_swapped_by(m)
    if root is not None:
        reason = _earlier_fuse_reason(model, root, "its config selects pipegoose attention, left as it is here")
    else:
        reason = ("its config selects pipegoose attention already, set by no fuse() call in this process (a copy of "
                  "a fused model, or configured so): left as it is, and unfuse() will not revert it")
    report.rows.append(FusionRow(path, "attention", type(m).__name__, f"'{impl}' attention function", True, fwd, bwd,
                                 reason))
    held.add(id(report.rows[-1]))
    _hold(state, report.rows[-1], path, _runs_our_attention)


def _fuse_attention(model, owners, stray, attention, dry_run, report, state, held: set) -> None:
    """The attention of each owner (:func:`_attention_owners`) through its config (:func:`_fuse_attention_of`), and the
    report's rows of the attention modules no config governs; ``report.attention`` says what was chosen (for several
    owners that chose otherwise, each value names them: ``"inner_a: eager; inner_b: sdpa"``)."""
    choices = []
    for path, owner, config, modules in owners:
        choices.append((path, _fuse_attention_of(model, owner, config, modules, attention, dry_run, report, state,
                                                 held)))
    for p, m in stray:
        if _runs_our_attention(m):   # (configured so, or by another fuse() call: it runs ours)
            _hold_attention(model, p, m, report, state, held)
        else:
            why = ("model has no transformers config" if not owners else
                   "outside the transformers models in this model (" + ", ".join(p for p, *_ in owners) +
                   "): no config of theirs selects its attention")
            report.rows.append(FusionRow(p, "attention", type(m).__name__, None, False, reason=why, eligible=False))
    if len(choices) == 1:
        report.attention = choices[0][1]
    elif choices:
        report.attention = {key: (choices[0][1][key] if len({c[key] for _, c in choices}) == 1 else
                                  "; ".join(f"{p}: {c[key]}" for p, c in choices))
                            for key in ("previous", "chosen", "reason")}


def _fuse_attention_of(model, owner, config, modules, attention, dry_run, report, state, held: set) -> dict:
    """The attention of ``owner`` (``model`` itself, or a transformers model inside it) whose transformers ``config``
    governs ``modules`` ((path from ``model``, attention module)): the report's rows, the config swap; returns the
    choice (``{"previous", "chosen", "reason"}``)."""
    from .transformers import attention as attn

    before = _attention_fused_before(config, modules)
    previous = matching.get_attn_implementation(config)
    supported, why = matching.attention_support(config)
    p0 = _first_param(owner)
    device = p0.device if p0 is not None else torch.device("cpu")
    dtype = p0.dtype if p0 is not None else None

    chosen, reason = previous, why
    if not supported:
        pass
    elif attention == "keep":
        reason = "attention='keep'"
    elif previous in attn.OUR_NAMES:
        reason = "the config already selects pipegoose attention"
    elif attention == "pipegoose":
        chosen, reason = attn.ATTENTION_NAME, f"attention='pipegoose' requested (was {previous})"
    elif previous in (None, "eager"):
        chosen = attn.ATTENTION_NAME
        reason = ("the model ran eager attention (scores materialised, unfused mask + softmax); our attention "
                  "function replaces it: on CUDA SDPA (fully masked rows give zeros, as on the softmax path; eager "
                  "gives them uniform weights), the fused scaled "
                  "masked softmax for scores of PIPEGOOSE_SMALL_NUMEL elements or more where the GPU's tuning table "
                  "names it or PIPEGOOSE_IMPL_ATTENTION=pipegoose asks for it, at every size with "
                  "PIPEGOOSE_SMALL_NUMEL=0 or when attention weights or a head_mask are asked for")
    elif previous == "sdpa":
        if attn.table_prefers_pipegoose(device, dtype):
            chosen = attn.ATTENTION_SDPA_NAME
            reason = ("the tuning table for this GPU names pipegoose for op 'attention'; ours runs where its rules "
                      "say so, SDPA elsewhere")
        else:
            where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"device {device.type}"
            reason = (f"kept sdpa: it fuses the softmax itself and no tuning table for {where} says pipegoose "
                      f"attention is faster (pass attention='pipegoose' to force ours)")
    else:
        reason = f"kept {previous}: it fuses the whole attention (pass attention='pipegoose' to force ours)"
    if modules and len(before) == len(modules) and chosen != previous:
        chosen, reason = previous, ("every attention module runs pipegoose attention already, fused by another fuse() "
                                    "call: the model's config is left as it is")
    choice = {"previous": previous, "chosen": chosen, "reason": reason}

    selected = chosen in attn.OUR_NAMES and chosen != previous
    for p, m in modules:
        if id(m) in before:
            _hold_attention(model, p, m, report, state, held)
            continue
        if selected:
            fwd, bwd = _attention_impls(m, chosen)
            report.rows.append(FusionRow(p, "attention", type(m).__name__, f"'{chosen}' attention function", True,
                                         fwd, bwd, f"AttentionInterface, was '{previous}'"))
        else:
            # kept on the model's own attention: unsupported, attention='keep', or already a fused one (SDPA, flash,
            # flex) that fuse chose to keep; none of these is a module fuse left undone, so none counts in the coverage
            ours = chosen in attn.OUR_NAMES
            fwd, bwd = _attention_impls(m, chosen) if ours else ("-", "-")   # (ours already: what it runs)
            report.rows.append(FusionRow(p, "attention", type(m).__name__,
                                         f"'{chosen}' attention function" if ours else None, ours, fwd, bwd,
                                         reason=reason, eligible=ours))
    if not selected or dry_run:
        return choice

    attn.register()
    new_config = copy.copy(config)
    # a str that registers our attention again when the model is unpickled in another process (AttentionName)
    matching.set_attn_implementation(new_config, attn.AttentionName(chosen))
    snapshot = dict(new_config.__dict__)
    for module in owner.modules():   # (the owner's: another model in the same wrapper gets its own copy)
        if module.__dict__.get("config") is config:
            state.config_swaps.append((weakref.ref(module), config, new_config, snapshot))
            module.__dict__["config"] = new_config
    return choice


_PROBE_SEQ = 128
_PROBE_WIDTH = 1024   # the report's rows for a norm of rows of any width (Gemma 4's v_norm)
_PROBE_MAX_NUMEL = 1 << 24   # the report's probe inputs stay this small (64 MiB in fp32) whatever the settings


def _probe_rows(shape: tuple[int, ...]) -> int:
    """Rows of the report's norm probe: enough that it is not a small problem (``PIPEGOOSE_SMALL_NUMEL``), so the
    report shows the choice for training-size inputs (smaller ones run the native op, see :func:`_small_note`)."""
    from . import dispatch

    h = max(1, math.prod(shape))
    # both rounded up: with the cap equal to the size (2**24 each by default), a floor left a 768-wide probe at
    # 16776960 elements, a small problem, and the report showed the native op for training-size inputs
    return max(2, min(-(-dispatch.small_numel() // h), -(-_PROBE_MAX_NUMEL // h)))


def _small_note(module: nn.Module, like: torch.Tensor | None = None) -> str:
    """The small-problem rule, for the reason column: only where it applies (fused kernels run on CUDA). ``like``:
    see :func:`_choice`."""
    from . import dispatch

    from .ops import _common

    p = _first_param(module)
    if p is None:
        p = like
    if p is None or not _common.on_kernel_device(p):
        return ""
    n = dispatch.small_numel()
    return f"; inputs < {n} elements: the native op (PIPEGOOSE_SMALL_NUMEL)" if n else ""


def _attention_impls(module: nn.Module, chosen: str) -> tuple[str, str]:
    """The report's implementation columns of an attention module on our function ``chosen``: ``sdpa @128`` where
    it runs SDPA for the probe's scores (``pipegoose``: ``attention.runs_sdpa``; ``pipegoose_sdpa``: unless the tuning
    table or ``PIPEGOOSE_IMPL_ATTENTION`` asks for ours), else the softmax op's choice."""
    from .transformers import attention as attn

    p = _first_param(module)
    if p is not None:
        if chosen == attn.ATTENTION_SDPA_NAME:
            sdpa = not attn._ours_asked_for(p.device, p.dtype, _PROBE_SEQ)
        else:
            sdpa = attn.runs_sdpa(p.device, p.dtype, _PROBE_SEQ)
        if sdpa:
            return f"sdpa @{_PROBE_SEQ}", f"sdpa @{_PROBE_SEQ}"
    return _impls(*_attention_probe(module))


def _attention_probe(module: nn.Module):
    """(op, module, build_inputs) describing a representative softmax call of an attention module (sequence
    length 128, padding mask, a batch that is not a small problem; causal modules without padding use the causal
    op) for the report."""
    heads = int(getattr(module, "num_heads", getattr(module, "num_attention_heads", 0)) or
                getattr(getattr(module, "config", None), "num_attention_heads", 1))
    n = _PROBE_SEQ
    b = _probe_rows((heads, n, n))   # batch: not a small problem (smaller scores run SDPA on CUDA)
    if getattr(module, "is_causal", False):
        return "softmax.causal", module, lambda d, t: (torch.empty(b * heads, n, n, device=d, dtype=t), None, 1.0)
    return "softmax.masked", module, lambda d, t: (
        torch.empty(b, heads, n, n, device=d, dtype=t), torch.zeros(b, 1, n, n, dtype=torch.bool, device=d), 1.0)


def _undo(state: _Fusion) -> list[str]:
    """Put back every swapped module and config; returns the paths that could not be restored (changed since)."""
    problems = []
    for module_ref, old_config, new_config, snapshot in reversed(state.config_swaps):
        module = module_ref()
        if module is None:  # no longer part of anything (collected): nothing to restore in it
            continue
        if module.__dict__.get("config") is new_config:
            _sync_config_back(new_config, old_config, snapshot)
            module.__dict__["config"] = old_config
        else:
            problems.append(f"{type(module).__name__}.config was replaced after fuse()")
    for module_ref, rec in reversed(state.rope_hooks):
        _rope.uninstall(module_ref(), rec)
    for model_ref, rec in reversed(state.inline_losses):
        _inline.uninstall(model_ref(), rec)
    for handles in reversed(state.weight_hooks):
        for h in handles:
            h.remove()
    for module_ref, gate_ref, path in reversed(state.experts_gates):
        module = module_ref()
        if not _experts.uninstall(module, gate_ref()):
            where = f" (at {path!r})" if path else ""
            problems.append(f"{type(module).__name__}._apply_gate{where} was replaced after fuse()")
    for model_ref, handles in reversed(state.head_swaps):
        _lm_head.uninstall(model_ref(), handles)
    for model_ref, fn in reversed(state.loss_swaps):
        model = model_ref()
        if model is None:
            continue
        if model.__dict__.get("_loss_function") is fn:
            del model.__dict__["_loss_function"]
        # else: a loss function set by the user while fused: theirs stays (as a change made on an original module
        # while fused wins over the replacement's)
    done = []
    for parent_ref, name, new_ref in reversed(state.swaps):
        parent, new = parent_ref(), new_ref()
        if parent is None:  # collected: it was taken out of the model, nothing to restore in it
            continue
        if new is not None and parent._modules.get(name) is new:
            rec = new.__dict__[_ORIGINAL]
            old = rec.module
            old.training = new.training   # (train() would also set the children's, which may differ)
            _carry_tensors_back(new, old)
            _carry_back(new, rec)
            parent._modules[name] = old
            done.append(new)
        else:
            problems.append(f"{type(parent).__name__}.{name} was replaced after fuse()")
    for new in done:  # after every parent of a shared module is restored
        new.__dict__.pop(_ORIGINAL, None)
    state.swaps.clear()
    state.config_swaps.clear()
    state.loss_swaps.clear()
    state.head_swaps.clear()
    state.rope_hooks.clear()
    state.inline_losses.clear()
    state.weight_hooks.clear()
    state.experts_gates.clear()
    return problems


def _carry_tensors_back(new: nn.Module, old: nn.Module) -> None:
    """Give the original module the replacement's current parameters, buffers and submodules (the same objects at
    fuse time; replaced since by ``load_state_dict(assign=True)``, ``to_empty``, a conversion that overwrites
    parameters, an assignment, or, for a fused MLP, an adapter library wrapping its projections), so that unfusing
    loses nothing the user did while fused."""
    for slot in ("_parameters", "_buffers", "_modules"):
        old_d, new_d = getattr(old, slot), getattr(new, slot)
        for key in old_d:
            # (parametrizations: each module's own container, which _carry_parametrizations_back merges)
            if key in new_d and new_d[key] is not old_d[key] and not (slot == "_modules" and key == "parametrizations"):
                old_d[key] = new_d[key]


def _sync_config_back(new_config, old_config, snapshot: dict) -> None:
    """Carry over to the original config what was changed on the model's config (the copy) while fused (not the
    attention setting), so that unfusing loses no configuration change: only the attributes that differ from
    ``snapshot`` (the copy as fuse() left it), so that a change made meanwhile on the original config object (held
    elsewhere, or shared with another model) is not overwritten with a stale value."""
    for key, value in new_config.__dict__.items():
        if key in ("_attn_implementation_internal", "_attn_implementation"):
            continue
        if snapshot.get(key, _MISSING) is value:
            continue
        old_config.__dict__[key] = value


_MISSING = object()


def unfuse(model: nn.Module) -> bool:
    """Undo :func:`fuse`: the original module objects and the original config object (hence attention setting)
    are put back exactly. Hooks added while fused are kept (the dictionaries were shared).

    The record of what was swapped lives outside the model (so that ``state_dict`` and pickling see nothing of it),
    so it belongs to the fused instance: a copy of a fused model (``copy.deepcopy``, pickling) holds fused modules
    but no record, and cannot be unfused; unfuse the original before copying it. (A copy of a model whose attention
    alone was fused cannot be told from a model configured with pipegoose attention by its user: ``unfuse``
    returns False for it and its config keeps the pipegoose attention name.)

    Parts of ``model`` fused by their own :func:`fuse` calls (``fuse(model.model.layers[0])`` before or after
    ``fuse(model)``) are unfused with it: no fused module that fuse() put in ``model`` is left.

    Returns:
        True if the model (or a part of it) was fused, False if there was nothing to undo.
    Raises:
        TypeError: ``model`` is not a torch.nn.Module.
        RuntimeError: some module or config swapped by ``fuse`` was replaced since by someone else; everything
            else is restored and the message lists what could not be. Also when ``model`` holds fused modules
            but was not fused by :func:`fuse` (a copy of a fused model): nothing is changed then.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    return _unfuse(model)


def _fused_module_types() -> tuple[type, ...]:
    """The classes ``fuse`` puts in place of a model's modules (a module of one of them in a model was fused before,
    by this record or another)."""
    from . import modules as m

    return (m.MixedFusedLayerNorm, m.FusedRMSNorm, m.FusedRMSNormGated, m.FusedSwiGLUMLP, m.FusedGateUpSwiGLUMLP,
            m.FusedGeGLUMLP, m.FusedT5DenseGatedActDense, m.FusedModernBertMLP, m.FusedGELU, m.FusedSquaredReLU,
            *_OWN_FUSED)


def _fused_parts(model: nn.Module) -> list[nn.Module]:
    """The parts of ``model`` (not itself) fused by their own fuse() calls."""
    return [m for p, m in model.named_modules() if p and m in _STATE]


def _unfuse(model: nn.Module, keep: Iterable[nn.Module] = (), quiet: bool = False) -> bool:
    """:func:`unfuse`, leaving the fusions of the parts in ``keep`` in place (``fused()`` keeps those made before it
    was entered); ``quiet``: nothing to undo is no error even where the model holds fused modules (``fused()``, whose
    ``fuse`` call recorded nothing)."""
    kept = {id(m) for m in keep}
    parts = [m for m in _fused_parts(model) if id(m) not in kept]
    state = _STATE.pop(model, None)
    if state is None and not parts and quiet:
        return False  # fused(): its fuse() recorded nothing, so there is nothing of its own to undo
    if state is None and not parts:
        found = [p or "<model>" for p, m in model.named_modules()
                 if isinstance(m, _fused_module_types())
                 or _loss.ours_is_set(m)
                 or _rope.hooked(m) or _experts.hooked(m) or _inline.hooked(m)]
        if found:
            raise RuntimeError(
                f"unfuse: this {type(model).__name__} holds fused modules ({found[0]}"
                f"{f' and {len(found) - 1} more' if len(found) > 1 else ''}) but fuse() has no record of it: it is "
                "a copy of a fused model (copy.deepcopy, pickle; the record stays with the original: unfuse the "
                "original before copying it), a part of a fused model or the model inside a torch.compile wrapper "
                "(unfuse the module that was passed to fuse()), or built with fused modules; nothing was changed")
        return False
    problems: list[str] = []
    try:
        if state is not None:
            problems += _undo(state)
    finally:  # the parts are reverted even when the model's own undo raised
        for part in parts:
            part_state = _STATE.pop(part, None)
            if part_state is not None:
                problems += _undo(part_state)
    if problems:
        raise RuntimeError("unfuse: restored everything except: " + "; ".join(problems))
    return True


@contextlib.contextmanager
def fused(model: nn.Module, ops: Iterable[str] | str | None = None, attention: str = "auto") -> Iterator[FusionReport]:
    """``with fused(model) as report: ...``: :func:`fuse` on entry, :func:`unfuse` on exit (also on error). Parts of
    ``model`` fused by their own :func:`fuse` calls before the block stay fused after it; those fused inside it are
    reverted with the model. Raises what :func:`fuse` raises, on entry (nothing is changed then)."""
    earlier = _fused_parts(model) if isinstance(model, nn.Module) else []
    report = fuse(model, ops=ops, attention=attention)
    try:
        yield report
    finally:
        _unfuse(model, keep=earlier, quiet=True)


__all__ = ["FusionReport", "FusionRow", "fuse", "unfuse", "fused", "is_fused", "fusion_report", "OPS", "DEFAULT_OPS",
           "OPT_IN"]
