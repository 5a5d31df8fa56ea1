"""Op benchmarks: softmax (plain, padding-masked, causal), LayerNorm, RMSNorm, SwiGLU (of two tensors, and packed in
one), GeGLU, GELU alone, squared ReLU alone, cross-entropy, RoPE; every impl checked, then timed.

Ops and their definitions (what the float64 reference computes; ``x`` is the benchmark input in its dtype):

* ``softmax``: ``y = softmax(x)`` over the last dim of ``x [b, np, sq, sk]`` (scale 1, no mask).
* ``softmax.masked``: ``y = softmax(0.125 * x masked)`` with a boolean padding mask ``[b, 1, sq, sk]`` (True =
  masked; each batch row keeps a random key length in ``[sk/2, sk]``, so no row is fully masked).
* ``softmax.causal``: ``y = softmax(0.125 * x)`` with key ``j > i`` masked, ``sq == sk``.
* ``layer_norm``: ``y = (x - mean) * rstd * w + b`` over the last dim of ``x [rows, hidden]``, eps 1e-5.
* ``rms_norm``: ``y = x * rsqrt(mean(x^2) + eps) * w``, eps 1e-6.
* ``swiglu``: ``y = silu(gate) * up`` elementwise, ``gate`` and ``up`` of ``[rows, inter]`` (``inter``: an MLP's
  intermediate size, the op's size axis).
* ``swiglu.packed``: the same of gate and up as the two halves of one contiguous ``x [rows, 2 * inter]`` (what Phi-3's
  and GLM's ``gate_up_proj``, a Linear, produce): ``gate, up = x.chunk(2, -1)``, ``y [rows, inter]``; its gradient is
  ``dx [rows, 2 * inter]``. The same sizes and rows as ``swiglu`` (the size axis ``inter``, the dispatcher's cols).
* ``geglu``: ``y = gelu_tanh(gate) * up`` elementwise, ``gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715
  g^3)))`` (GELU's tanh approximation, ``F.gelu(approximate="tanh")``: Gemma's ``gelu_pytorch_tanh``), ``gate`` and
  ``up`` of ``[rows, inter]``: the sizes, rows and inputs of ``swiglu``.
* ``geglu.packed``: ``geglu`` of gate and up as the two halves of one contiguous ``x [rows, 2 * inter]``, as
  ``swiglu.packed`` is ``swiglu``'s (what Gemma 4's MoE experts' gate computes of the routed tokens' ``gate_up_proj``
  output).
* ``gelu``: ``y = gelu_tanh(x)`` elementwise of ``x [rows, inter]`` (GELU alone, the activation of the MLPs without a
  gate: GPT-2's ``gelu_new``): ``swiglu``'s sizes and rows, ``x`` as its gate.
* ``squared_relu``: ``y = relu(x)^2`` elementwise of ``x [rows, inter]`` (Primer's squared ReLU alone, the activation
  of the MLPs without a gate of Nemotron, Persimmon and Arcee: transformers' ``relu2``), ``dx = dy * 2 relu(x)``:
  ``gelu``'s sizes, rows and ``x``.
* ``cross_entropy``: ``loss = mean over the rows not ignored of (logsumexp(x_i) - x_i[t_i])``, logits ``[rows, vocab]``
  (``vocab``: the size axis), int64 targets, 1 in 16 rows ``ignore_index`` (-100); the loss in fp32.
* ``rope``: ``(q_embed, k_embed) = (q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)``, cos and sin
  broadcast over the heads (transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``): q ``[B, Hq, S,
  D]`` and k ``[B, Hk, S, D]`` in the layout of Llama's attention (``proj(x).view(B, S, H, D).transpose(1, 2)``:
  memory ``[B, S, H, D]``), cos and sin ``[B, S, D]`` in the input dtype as LlamaRotaryEmbedding returns them
  (``cat(freqs, freqs)``, theta 10000, the positions of each batch row starting at a random offset). Size axis: the
  head dim ``D`` (what the dispatcher's rules compare, ``max_cols``), one model's head counts per D at ``B*S = 4 *
  2048`` tokens (``ROPE_HEADS``). The backward is that of both outputs (random gradients of q_embed and k_embed, in
  the outputs' layout); cos and sin get no gradient.

The scale 0.125 (head dim 64) is a power of two, so no implementation loses precision by scaling in low precision.

Implementations (``impl`` in results.json):

* ``eager``: the Python code transformers runs: softmax = ``(x * scale + additive_mask).softmax(-1,
  dtype=float32).to(dtype)`` (additive mask in the input dtype, 0 or the dtype's minimum); RMSNorm = LlamaRMSNorm's
  forward (fp32 variance, ``weight * x.to(input_dtype)``); SwiGLU = LlamaMLP's ``act_fn(gate) * up`` =
  ``F.silu(gate) * up``; packed SwiGLU = Phi3MLP's ``gate, up = x.chunk(2, -1)`` then ``up * act_fn(gate)`` (the same
  product; its backward ends in autograd's concatenation of the halves' gradients into ``dx``); GeGLU = GemmaMLP's
  ``act_fn(gate) * up`` with ``act_fn = ACT2FN["gelu_pytorch_tanh"]`` (``F.gelu(gate, approximate="tanh")``, then the
  product); GELU alone = GPT-2's ``NewGELUActivation`` (``ACT2FN["gelu_new"]``: eight elementwise ops forward);
  squared ReLU alone = ``ReLUSquaredActivation`` (``ACT2FN["relu2"]``: ``F.relu`` then ``torch.square``);
  cross-entropy = transformers' loss, ``F.cross_entropy(logits.float(), target)``; RoPE =
  ``apply_rotary_pos_emb`` of ``transformers.models.llama.modeling_llama``. LayerNorm has no separate eager path:
  transformers calls ``nn.LayerNorm`` = ``native``.
* ``native``: the best single PyTorch op: ``F.softmax`` (for masked/causal: ``masked_fill(-inf)`` then
  ``F.softmax`` in the input dtype), ``F.layer_norm``, ``F.rms_norm``, ``F.cross_entropy`` in the input dtype (its
  loss in that dtype), ``F.gelu(x, approximate="tanh")`` for ``gelu``; none for the SwiGLUs, GeGLU and the squared
  ReLU (two ops: ``eager``) and RoPE (PyTorch has no rotary op).
* ``compile``: ``torch.compile(dynamic=False)`` of the eager code (of ``F.layer_norm`` for LayerNorm, of the
  dispatcher's reference ``pipegoose.nn.fusion.ops.rope.rope_reference`` for RoPE: transformers' formula); its
  compile time is recorded in ``extra.compile_s`` and is not part of the timings.
* ``liger``: Liger-Kernel's functional op where it has one (``liger_softmax``, ``liger_layer_norm``,
  ``liger_rms_norm(in_place=False)``, ``liger_swiglu`` = ``LigerSiLUMulFunction``, whose backward writes into the
  saved gate and up, which are the inputs: run_ops restores them after it; for ``swiglu.packed`` the same Function of
  ``x.chunk(2, -1)``, as Liger's ``LigerPhi3SwiGLUMLP`` calls it: it copies the two halves, which are not contiguous,
  and writes its gradients into those copies; autograd concatenates them into ``dx``), ``LigerGELUMulFunction``
  (``liger_kernel.ops.geglu``, the tanh approximation, what its ``LigerGEGLUMLP`` for Gemma runs; its backward writes
  into the saved gate and up, the inputs, as the SwiGLU's: restored likewise), ``liger_cross_entropy`` (its
  forward writes the gradient into the logits, restored likewise; its backward only scales it), ``liger_rotary_pos_emb``
  (``liger_kernel.transformers.rope``: in Llama's layout its forward rotates q and k in place and returns views of
  them, and its backward rotates the incoming gradients in place; run_ops restores the inputs and the gradients
  after it; it reads only the first half of cos and sin, which equals the second in LlamaRotaryEmbedding's tables),
  only when ``liger_kernel`` is importable.
* ``pipegoose``, ``megatron``, ``apex``, ``torch``: ``pipegoose.nn.fusion.functional`` with ``impl=`` that name (our
  kernel, the Megatron-LM/Apex copies from ColossalAI 0.5.0, the dispatcher's reference path): ``scaled_softmax(x,
  1.0)`` (op ``softmax``: ``functional.softmax`` keeps fp16/bf16 on F.softmax), ``scaled_masked_softmax``,
  ``scaled_upper_triang_masked_softmax`` (on the ``[b*np, sq, sk]`` view), ``layer_norm``, ``rms_norm``, ``swiglu``,
  ``silu_and_mul`` (op ``swiglu.packed``), ``geglu(gate, up, approximate="tanh")``, ``gelu_and_mul(x, "tanh")``
  (op ``geglu.packed``), ``gelu(x, "tanh")``, ``squared_relu(x)``, ``cross_entropy``, ``apply_rotary_pos_emb``
  (op ``rope``); a functional without ``geglu`` or ``squared_relu`` (a checkout before the op) is reported
  ``unavailable``. Run with ``PIPEGOOSE_STRICT=1``, and after the checked call the dispatcher's ``last_choice`` must
  name the requested impl: an input the impl refuses is reported ``unsupported``, never timed under the wrong name.
  These are the names the tuning table may choose.

Correctness gate: on the benchmark inputs each impl's forward output and every input gradient are compared with a
float64 reference (kept in fp32) elementwise: ``|out - ref| <= atol * max|ref| + rtol * |ref|`` with ``atol``,
``rtol`` from ``tests/tolerances.py`` for the input dtype (atol is scaled by the tensor's largest magnitude so
that the same table serves softmax probabilities ~1/sk and weight gradients summed over 16K+ rows). Before the
checked call the caching allocator is filled with NaN blocks of the output's size (``poison``), so an output
element the kernel never writes shows up as NaN and fails the check. A failing impl is reported ``FAILED`` and
not timed.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F

from .byte_counts import op_bytes
from .common import Measurement, dtype_name, raise_compile_limits
from .timing import Timer

__all__ = ["OPS", "SIZES", "make_case", "impls_for", "run_ops", "reference", "check_close", "Case"]

OPS = ("softmax", "softmax.masked", "softmax.causal", "layer_norm", "rms_norm", "swiglu", "swiglu.packed", "geglu",
       "geglu.packed", "gelu", "squared_relu", "cross_entropy", "rope")
SWIGLUS = ("swiglu", "swiglu.packed")   # one size list and shape: swiglu.packed's x is gate and up side by side
GEGLUS = ("geglu", "geglu.packed")
PACKED = ("swiglu.packed", "geglu.packed")   # x [rows, 2 * inter]: gate and up side by side
GATED = (*SWIGLUS, *GEGLUS)   # the gated activations: swiglu's sizes and rows (geglu's gate and up as swiglu's)
ELEMENTWISE = (*GATED, "gelu", "squared_relu")   # swiglu's sizes and rows (gelu, squared_relu: x as swiglu's gate)
GELU_APPROX = "tanh"   # Gemma's hidden_act "gelu_pytorch_tanh"
TUNABLE = ("pipegoose", "megatron", "apex", "torch")
IMPL_ORDER = ("eager", "native", "compile", "liger", "torch", "megatron", "apex", "pipegoose")
SCALE = 0.125
LN_EPS, RMS_EPS = 1e-5, 1e-6

# last-dim sizes: full run, --quick, and the CPU dry run
SIZES = {
    "softmax": {"full": [128, 256, 512, 1024, 2048, 4096, 8192, 16384], "quick": [512, 2048, 8192], "dry": [16, 64]},
    "norm": {"full": [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536], "quick": [1024, 4096, 16384],
             "dry": [32, 128]},
    # intermediate sizes of SwiGLU MLPs: Qwen3-0.6B 3072, TinyLlama / Llama-1.1B 5632, Llama-2-7B 11008,
    # Llama-3-8B / Mistral-7B 14336, Llama-3-70B 28672 (swiglu.packed too: Phi-3-mini's 8192 lies among them; geglu
    # too, side by side with swiglu: Gemma-2B's 16384 and Gemma-7B's 24576 lie among them)
    "swiglu": {"full": [1408, 3072, 5632, 11008, 14336, 28672], "quick": [5632], "dry": [16, 64]},
    # vocabularies: Llama-2 / TinyLlama 32000, GPT-NeoX / Pythia 50304, Llama-3 128256, Qwen2/Qwen3 151936
    "cross_entropy": {"full": [32000, 50304, 128256, 151936], "quick": [32000], "dry": [16, 100]},
    # head dims (the dispatcher's cols for rope), each with one model's head counts (ROPE_HEADS)
    "rope": {"full": [64, 96, 128, 256], "quick": [64, 128], "dry": [16, 64]},
}
# RoPE: (query heads, key/value heads) per head dim: TinyLlama / Llama-1.1B 32/4 at D 64 (the training shape of this
# project's Llama runs), Phi-3-mini 32/32 at 96, Llama-3-8B / Mistral-7B 32/8 at 128, Gemma-7B 16/16 at 256; other
# sizes (the dry ones) 4/2. Tokens: batch 4 x seq 2048 on the GPU (8192: q + k of 19-67M elements), 2 x 16 on the CPU.
ROPE_HEADS = {64: (32, 4), 96: (32, 32), 128: (32, 8), 256: (16, 16)}
ROPE_TOKENS = {"cuda": (4, 2048), "cpu": (2, 16)}
ROPE_THETA = 10000.0
CE_IGNORE = -100
TARGET_ELEMS = {"cuda": 1 << 26, "cpu": 1 << 12}   # elements per input: 64M = 128 MB bf16, > 50 MB of L2
MIN_ROWS = {"cuda": 16384, "cpu": 16}


def sizes_for(op: str, mode: str) -> list[int]:
    return SIZES["softmax" if op.startswith("softmax") else "swiglu" if op in ELEMENTWISE
                 else op if op in ("cross_entropy", "rope") else "norm"][mode]


def shape_for(op: str, cols: int, device: str) -> dict[str, int]:
    """Benchmark shape for an op at last-dim size ``cols``: the softmaxes get ``[b, np, sq=sk, sk]`` with
    ``b*np*sq*sk`` >= the target element count where possible; the norms ``[rows >= 16384, hidden]``; swiglu and
    geglu ``[rows >= 16384, inter]`` (swiglu.packed the same rows, its x ``[rows, 2 * inter]``); rope ``b, seq, hq, hk,
    d`` (``d = cols``: ``ROPE_TOKENS``, ``ROPE_HEADS``)."""
    target = TARGET_ELEMS[device]
    if op.startswith("softmax"):
        per_head = cols * cols
        heads = 16 if device == "cuda" else 2
        if per_head * heads <= target:
            return {"b": max(1, target // (per_head * heads)), "np": heads, "sq": cols, "sk": cols}
        return {"b": 1, "np": max(1, target // per_head), "sq": cols, "sk": cols}
    if op in ELEMENTWISE:
        return {"rows": max(MIN_ROWS[device], target // cols), "inter": cols}
    if op == "cross_entropy":   # 128M logits (256 MB in bf16): 4194 rows of 32000, 883 of 151936
        return {"rows": max(16, 2 * target // cols), "vocab": cols}
    if op == "rope":
        b, seq = ROPE_TOKENS[device]
        hq, hk = ROPE_HEADS.get(cols, (4, 2))
        return {"b": b, "seq": seq, "hq": hq, "hk": hk, "d": cols}
    return {"rows": max(MIN_ROWS[device], target // cols), "hidden": cols}


@dataclass
class Case:
    op: str
    dtype: torch.dtype
    shape: dict[str, int]
    cols: int
    inputs: dict[str, torch.Tensor]           # tensors given to impls (x, w, b require grad)
    wrt: list[str]                             # names of the inputs whose gradients are checked and timed
    dy: torch.Tensor | tuple[torch.Tensor, ...]   # the upstream gradient, one per output
    ref: dict[str, torch.Tensor] = field(default_factory=dict)   # the outputs ("y") and "d<name>", fp32
    outs: tuple[str, ...] = ("y",)             # names of the forward's outputs (rope: "yq", "yk")

    def free(self) -> None:
        self.inputs.clear()
        self.ref.clear()
        self.dy = None  # type: ignore[assignment]


def _padding_mask(b: int, sq: int, sk: int, device: str, gen: torch.Generator) -> torch.Tensor:
    lens = torch.randint(max(1, sk // 2), sk + 1, (b,), generator=gen, device="cpu").to(device)
    keys = torch.arange(sk, device=device)
    return (keys[None, :] >= lens[:, None])[:, None, None, :].expand(b, 1, sq, sk).contiguous()


def make_case(op: str, dtype: torch.dtype, cols: int, device: str, seed: int = 0) -> Case:
    """Fresh random inputs (randn, never zeros) for ``op`` at last-dim ``cols`` in ``dtype`` on ``device``."""
    if op not in OPS:
        raise ValueError(f"op: expected one of {', '.join(OPS)}, got {op!r}")
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = shape_for(op, cols, device)

    def randn(*s: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*s, generator=gen, device=device, dtype=torch.float32).to(dt)

    if op.startswith("softmax"):
        b, h, sq, sk = shape["b"], shape["np"], shape["sq"], shape["sk"]
        x = (randn(b, h, sq, sk) * 2).requires_grad_()
        inputs = {"x": x}
        if op == "softmax.masked":
            inputs["mask"] = _padding_mask(b, sq, sk, device, torch.Generator().manual_seed(seed))
            inputs["additive_mask"] = torch.zeros(b, 1, sq, sk, dtype=dtype, device=device).masked_fill_(
                inputs["mask"], torch.finfo(dtype).min)
        elif op == "softmax.causal":
            inputs["mask"] = torch.ones(sq, sk, dtype=torch.bool, device=device).triu_(1)[None, None]
            inputs["additive_mask"] = torch.zeros(1, 1, sq, sk, dtype=dtype, device=device).masked_fill_(
                inputs["mask"], torch.finfo(dtype).min)
        return Case(op, dtype, shape, cols, inputs, ["x"], randn(b, h, sq, sk))
    if op in ("swiglu", "geglu"):   # (the gate scaled by 2: both curves' bends, and GELU's negative dip, are hit)
        rows, inter = shape["rows"], shape["inter"]
        g = (randn(rows, inter) * 2).requires_grad_()
        u = randn(rows, inter).requires_grad_()
        return Case(op, dtype, shape, cols, {"g": g, "u": u}, ["g", "u"], randn(rows, inter))
    if op in ("gelu", "squared_relu"):   # x as swiglu's gate (both bends hit: GELU's dip, relu's kink at 0)
        rows, inter = shape["rows"], shape["inter"]
        return Case(op, dtype, shape, cols, {"x": (randn(rows, inter) * 2).requires_grad_()}, ["x"],
                    randn(rows, inter))
    if op in PACKED:   # one contiguous [rows, 2 * inter] (a Linear's output), gate scaled as swiglu's
        rows, inter = shape["rows"], shape["inter"]
        x = randn(rows, 2 * inter)
        x[:, :inter] *= 2
        return Case(op, dtype, shape, cols, {"x": x.requires_grad_()}, ["x"], randn(rows, inter))
    if op == "cross_entropy":
        rows, vocab = shape["rows"], shape["vocab"]
        x = (randn(rows, vocab) * 2).requires_grad_()
        t = torch.randint(0, vocab, (rows,), generator=gen, device=device)
        t[::16] = CE_IGNORE
        return Case(op, dtype, shape, cols, {"x": x, "t": t}, ["x"], torch.ones((), device=device))
    if op == "rope":
        b, seq, hq, hk, d = (shape[k] for k in ("b", "seq", "hq", "hk", "d"))

        def heads(h: int) -> torch.Tensor:   # Llama's q / k: proj(x).view(b, seq, h, d).transpose(1, 2)
            return randn(b, seq, h, d).transpose(1, 2)

        q, k = heads(hq).detach().requires_grad_(), heads(hk).detach().requires_grad_()
        # LlamaRotaryEmbedding: positions (each batch row from an offset of its own, so a kernel that reads batch 0's
        # table for every row fails), angles in fp32, cat(freqs, freqs), cos / sin in the model's dtype
        inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
        start = torch.randperm(4 * seq, generator=gen, device=device)[:b, None]
        freqs = (start + torch.arange(seq, device=device)).float()[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        return Case(op, dtype, shape, cols, {"q": q, "k": k, "cos": cos, "sin": sin}, ["q", "k"],
                    (heads(hq), heads(hk)), outs=("yq", "yk"))
    rows, hid = shape["rows"], shape["hidden"]
    x = randn(rows, hid).requires_grad_()
    w = (1 + 0.1 * randn(hid, dt=torch.float32)).to(dtype).requires_grad_()
    inputs = {"x": x, "w": w}
    wrt = ["x", "w"]
    if op == "layer_norm":
        inputs["b"] = (0.1 * randn(hid, dt=torch.float32)).to(dtype).requires_grad_()
        wrt.append("b")
    return Case(op, dtype, shape, cols, inputs, wrt, randn(rows, hid))


# ---------------------------------------------------------------------------------------------------------------
# float64 reference (stored fp32), computed in chunks of rows to bound memory


def _chunks(n: int, per: int) -> Iterable[slice]:
    step = max(1, per)
    for i in range(0, n, step):
        yield slice(i, min(n, i + step))


def reference(case: Case, chunk_elems: int = 1 << 25) -> dict[str, torch.Tensor]:
    """Forward output ``y`` and the gradients ``d<input>`` for upstream gradient ``case.dy``, computed in float64
    from the case's inputs, returned in float32."""
    op, inp = case.op, case.inputs
    out: dict[str, torch.Tensor] = {}
    if op.startswith("softmax"):
        x = inp["x"].detach()
        scale = 1.0 if op == "softmax" else SCALE
        y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        dx = torch.empty_like(y)
        b, h, sq, sk = x.shape
        for bi in range(b):
            for hs in _chunks(h, chunk_elems // (sq * sk)):
                xs = x[bi, hs].double() * scale
                if "mask" in inp:
                    m = inp["mask"][bi if inp["mask"].shape[0] > 1 else 0, 0]
                    xs = xs.masked_fill(m, float("-inf"))
                ys = torch.softmax(xs, dim=-1)
                dys = case.dy[bi, hs].double()
                dxs = scale * ys * (dys - (dys * ys).sum(-1, keepdim=True))
                y[bi, hs] = ys.float()
                dx[bi, hs] = dxs.float()
        return {"y": y, "dx": dx}
    if op in SWIGLUS:
        return _swiglu_reference(case, chunk_elems)
    if op in GEGLUS:
        return _geglu_reference(case, chunk_elems)
    if op == "gelu":
        return _gelu_reference(case, chunk_elems)
    if op == "squared_relu":
        return _squared_relu_reference(case, chunk_elems)
    if op == "cross_entropy":
        x, t = inp["x"].detach(), inp["t"]
        keep = t != CE_IGNORE
        count = int(keep.sum())
        dx = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        total = torch.zeros((), dtype=torch.float64, device=x.device)
        for rs in _chunks(x.shape[0], chunk_elems // x.shape[1]):
            xs, ts, ks = x[rs].double(), t[rs], keep[rs]
            lse = torch.logsumexp(xs, -1)
            picked = xs.gather(1, ts.clamp(min=0)[:, None])[:, 0]
            total += ((lse - picked) * ks).sum()
            p = torch.exp(xs - lse[:, None])
            p[torch.arange(p.shape[0], device=x.device), ts.clamp(min=0)] -= 1
            dx[rs] = (p * ks[:, None] * (float(case.dy) / count)).float()
        return {"y": (total / count).float(), "dx": dx}
    if op == "rope":
        return _rope_reference(case, chunk_elems)
    x, w = inp["x"].detach(), inp["w"].detach().double()
    rows, hid = x.shape
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    dx = torch.empty_like(y)
    dw = torch.zeros(hid, dtype=torch.float64, device=x.device)
    db = torch.zeros(hid, dtype=torch.float64, device=x.device)
    for rs in _chunks(rows, chunk_elems // hid):
        xs, dys = x[rs].double(), case.dy[rs].double()
        if op == "layer_norm":
            mean = xs.mean(-1, keepdim=True)
            xc = xs - mean
            rstd = torch.rsqrt((xc * xc).mean(-1, keepdim=True) + LN_EPS)
            xhat = xc * rstd
            y[rs] = (xhat * w + inp["b"].detach().double()).float()
            g = dys * w
            dx[rs] = (rstd * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))).float()
            db += dys.sum(0)
        else:
            rstd = torch.rsqrt((xs * xs).mean(-1, keepdim=True) + RMS_EPS)
            xhat = xs * rstd
            y[rs] = (xhat * w).float()
            g = dys * w
            dx[rs] = (rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))).float()
        dw += (dys * xhat).sum(0)
    out = {"y": y, "dx": dx, "dw": dw.float()}
    if op == "layer_norm":
        out["db"] = db.float()
    return out


def _gated_buffers(case: Case) -> tuple:
    """(gate, up, y, dgate, dup, the gradients by name) of a gated op's case: gate and up its inputs, or the halves of
    ``x`` for a packed op, whose gradient ``dx`` the fp32 views dgate and dup fill side by side."""
    inp = case.inputs
    if case.op in PACKED:
        x = inp["x"].detach()
        g, u = x.chunk(2, dim=-1)
        dx = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        dg, du = dx.chunk(2, dim=-1)   # views: written through, they fill dx
        grads = {"dx": dx}
    else:
        g, u = inp["g"].detach(), inp["u"].detach()
        dg = torch.empty(g.shape, dtype=torch.float32, device=g.device)
        du = torch.empty_like(dg)
        grads = {"dg": dg, "du": du}
    return g, u, torch.empty(g.shape, dtype=torch.float32, device=g.device), dg, du, grads


def _swiglu_reference(case: Case, chunk_elems: int) -> dict[str, torch.Tensor]:
    """SwiGLU in float64: ``y = g sig(g) u``, ``du = dy g sig(g)``, ``dg = dy u sig(g) (1 + g (1 - sig(g)))``; for
    swiglu.packed of the halves of ``x``, its gradient ``dx`` the two halves' side by side."""
    g, u, y, dg, du, grads = _gated_buffers(case)
    for rs in _chunks(g.shape[0], chunk_elems // g.shape[1]):
        gs, us, dys = g[rs].double(), u[rs].double(), case.dy[rs].double()
        sig = torch.sigmoid(gs)
        y[rs] = (gs * sig * us).float()
        du[rs] = (dys * gs * sig).float()
        dg[rs] = (dys * us * sig * (1 + gs * (1 - sig))).float()
    return {"y": y, **grads}


def _geglu_reference(case: Case, chunk_elems: int) -> dict[str, torch.Tensor]:
    """GeGLU (GELU's tanh approximation) in float64, written out: with ``c = sqrt(2 / pi)``, ``t = tanh(c (g + 0.044715
    g^3))``: ``y = 0.5 g (1 + t) u``, ``du = dy 0.5 g (1 + t)``, ``dg = dy u (0.5 (1 + t) + 0.5 g (1 - t^2) c (1 + 3 *
    0.044715 g^2))``; for geglu.packed of the halves of ``x``, as swiglu.packed's."""
    g, u, y, dg, du, grads = _gated_buffers(case)
    c = math.sqrt(2.0 / math.pi)
    for rs in _chunks(g.shape[0], chunk_elems // g.shape[1]):
        gs, us, dys = g[rs].double(), u[rs].double(), case.dy[rs].double()
        t = torch.tanh(c * (gs + 0.044715 * gs ** 3))
        act = 0.5 * gs * (1 + t)
        y[rs] = (act * us).float()
        du[rs] = (dys * act).float()
        dg[rs] = (dys * us * (0.5 * (1 + t) + 0.5 * gs * (1 - t * t) * c * (1 + 3 * 0.044715 * gs * gs))).float()
    return {"y": y, **grads}


def _gelu_reference(case: Case, chunk_elems: int) -> dict[str, torch.Tensor]:
    """GELU's tanh approximation alone in float64, as geglu's with ``u = 1``: ``y = 0.5 x (1 + t)``, ``dx = dy (0.5 (1
    + t) + 0.5 x (1 - t^2) c (1 + 3 * 0.044715 x^2))``."""
    x = case.inputs["x"].detach()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    dx = torch.empty_like(y)
    c = math.sqrt(2.0 / math.pi)
    for rs in _chunks(x.shape[0], chunk_elems // x.shape[1]):
        xs, dys = x[rs].double(), case.dy[rs].double()
        t = torch.tanh(c * (xs + 0.044715 * xs ** 3))
        y[rs] = (0.5 * xs * (1 + t)).float()
        dx[rs] = (dys * (0.5 * (1 + t) + 0.5 * xs * (1 - t * t) * c * (1 + 3 * 0.044715 * xs * xs))).float()
    return {"y": y, "dx": dx}


def _squared_relu_reference(case: Case, chunk_elems: int) -> dict[str, torch.Tensor]:
    """The squared ReLU alone in float64: ``y = relu(x)^2``, ``dx = dy * 2 relu(x)`` (0 where ``x <= 0``)."""
    x = case.inputs["x"].detach()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    dx = torch.empty_like(y)
    for rs in _chunks(x.shape[0], chunk_elems // x.shape[1]):
        r = x[rs].double().clamp(min=0)
        y[rs] = (r * r).float()
        dx[rs] = (case.dy[rs].double() * 2 * r).float()
    return {"y": y, "dx": dx}


def _rope_reference(case: Case, chunk_elems: int) -> dict[str, torch.Tensor]:
    """RoPE per half of the head dim, in float64: ``y1 = x1 c1 - x2 s1``, ``y2 = x2 c2 + x1 s2``; the gradient is the
    transposed rotation, ``g1 = dy1 c1 + dy2 s2``, ``g2 = dy2 c2 - dy1 s1`` (written out, not via rotate_half)."""
    inp = case.inputs
    cos, sin = inp["cos"], inp["sin"]
    out: dict[str, torch.Tensor] = {}
    for name, dy in zip(("q", "k"), case.dy):
        x = inp[name].detach()
        b, h, seq, d = x.shape
        half = d // 2
        y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        dx = torch.empty_like(y)
        for bi in range(b):
            cb = bi if cos.shape[0] > 1 else 0
            c, s = cos[cb].double(), sin[cb].double()   # [seq, d], broadcast over the heads
            c1, c2, s1, s2 = c[:, :half], c[:, half:], s[:, :half], s[:, half:]
            for hs in _chunks(h, chunk_elems // (seq * d)):
                xs, dys = x[bi, hs].double(), dy[bi, hs].double()
                x1, x2, d1, d2 = xs[..., :half], xs[..., half:], dys[..., :half], dys[..., half:]
                y[bi, hs] = torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), dim=-1).float()
                dx[bi, hs] = torch.cat((d1 * c1 + d2 * s2, d2 * c2 - d1 * s1), dim=-1).float()
        out[f"y{name}"], out[f"d{name}"] = y, dx
    return {k: out[k] for k in ("yq", "yk", "dq", "dk")}


def check_close(out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float,
                chunk_elems: int = 1 << 25) -> tuple[bool, float, int]:
    """Elementwise ``|out - ref| <= atol * max|ref| + rtol * |ref|`` (NaN/inf in ``out`` fail).

    Returns (ok, max abs error, number of bad elements). Raises ValueError when the shapes differ."""
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"out: expected shape {tuple(ref.shape)}, got {tuple(out.shape)}")
    o, r = out.detach().reshape(-1), ref.reshape(-1)
    scale = float(r.abs().max()) if r.numel() else 0.0
    bad, max_err = 0, 0.0
    for s in _chunks(o.numel(), chunk_elems):
        d = (o[s].float() - r[s]).abs()
        lim = atol * scale + rtol * r[s].abs()
        nbad = int((~(d <= lim)).sum())   # NaN compares False -> counted bad
        bad += nbad
        finite = torch.isfinite(d)
        if finite.any():
            max_err = max(max_err, float(d[finite].max()))
        if not bool(finite.all()):
            max_err = float("nan")
    return bad == 0, max_err, bad


def poison(nbytes: int, device: str, count: int = 2) -> None:
    """Leave ``count`` NaN-filled free blocks of ``nbytes`` in the caching allocator, so that an output the kernel
    allocates next most likely starts as NaN: an element it forgets to write then fails the check."""
    if device != "cuda":
        return
    blocks = [torch.full((max(1, nbytes // 4),), float("nan"), dtype=torch.float32, device=device)
              for _ in range(count)]
    del blocks


# ---------------------------------------------------------------------------------------------------------------
# implementations: builder(case) -> callable(inputs) -> y


class Unsupported(Exception):
    """The impl does not handle this input (reported ``unsupported``)."""


class Unavailable(Exception):
    """The impl is not installed or failed to build (reported ``unavailable``)."""


def _eager(case: Case) -> Callable:
    op = case.op
    if op == "softmax":
        return lambda i: i["x"].softmax(-1, dtype=torch.float32).to(i["x"].dtype)
    if op in ("softmax.masked", "softmax.causal"):
        return lambda i: (i["x"] * SCALE + i["additive_mask"]).softmax(-1, dtype=torch.float32).to(i["x"].dtype)
    if op == "rms_norm":
        def llama_rms_norm(i: dict) -> torch.Tensor:  # transformers' LlamaRMSNorm.forward
            h = i["x"]
            dt = h.dtype
            h = h.to(torch.float32)
            var = h.pow(2).mean(-1, keepdim=True)
            h = h * torch.rsqrt(var + RMS_EPS)
            return i["w"] * h.to(dt)
        return llama_rms_norm
    if op == "swiglu":
        return lambda i: F.silu(i["g"]) * i["u"]   # LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)
    if op == "swiglu.packed":
        return _phi3_silu_and_mul
    if op in GEGLUS:   # GemmaMLP: act_fn(gate_proj(x)) * up_proj(x), act_fn = ACT2FN[config.hidden_act]
        try:
            from transformers.activations import ACT2FN
        except Exception as e:  # noqa: BLE001 - not installed, or a version without it
            raise Unavailable(f"transformers' ACT2FN not importable: {e}") from None
        act = ACT2FN["gelu_pytorch_tanh"]
        if op == "geglu.packed":   # transformers' default experts gate (Gemma 4): gate, up = x.chunk(2, -1)
            return lambda i: (lambda gate, up: act(gate) * up)(*i["x"].chunk(2, dim=-1))
        return lambda i: act(i["g"]) * i["u"]
    if op == "gelu":   # GPT2MLP: act(c_fc(x)), act = ACT2FN["gelu_new"] (NewGELUActivation)
        try:
            from transformers.activations import ACT2FN
        except Exception as e:  # noqa: BLE001 - not installed, or a version without it
            raise Unavailable(f"transformers' ACT2FN not importable: {e}") from None
        act = ACT2FN["gelu_new"]
        return lambda i: act(i["x"])
    if op == "squared_relu":   # NemotronMLP: down_proj(act_fn(up_proj(x))), act_fn = ACT2FN["relu2"]
        try:
            from transformers.activations import ACT2FN
        except Exception as e:  # noqa: BLE001 - not installed, or a version without it
            raise Unavailable(f"transformers' ACT2FN not importable: {e}") from None
        try:
            act = ACT2FN["relu2"]   # ReLUSquaredActivation: torch.square(F.relu(x))
        except KeyError:   # (a transformers before it)
            raise Unavailable("transformers' ACT2FN has no relu2") from None
        return lambda i: act(i["x"])
    if op == "cross_entropy":   # transformers' ForCausalLMLoss: the logits upcast, then F.cross_entropy
        return lambda i: F.cross_entropy(i["x"].float(), i["t"], ignore_index=CE_IGNORE)
    if op == "rope":   # LlamaAttention: apply_rotary_pos_emb(query_states, key_states, cos, sin)
        try:
            from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        except Exception as e:  # noqa: BLE001 - not installed, or a version without it
            raise Unavailable(f"transformers' Llama apply_rotary_pos_emb not importable: {e}") from None
        return lambda i: apply_rotary_pos_emb(i["q"], i["k"], i["cos"], i["sin"])
    raise Unsupported("transformers calls nn.LayerNorm (= native) for LayerNorm")


def _phi3_silu_and_mul(i: dict) -> torch.Tensor:
    """Phi3MLP's activation of its gate_up_proj output: ``gate, up_states = x.chunk(2, dim=-1)`` then ``up_states *
    act_fn(gate)`` (``F.silu``); autograd's backward of ``chunk`` concatenates the halves' gradients into ``dx``."""
    gate, up = i["x"].chunk(2, dim=-1)
    return up * F.silu(gate)


def _native(case: Case) -> Callable:
    op = case.op
    if op == "softmax":
        return lambda i: F.softmax(i["x"], dim=-1)
    if op in ("softmax.masked", "softmax.causal"):
        return lambda i: F.softmax((i["x"] * SCALE).masked_fill(i["mask"], float("-inf")), dim=-1)
    if op in SWIGLUS:
        raise Unsupported("PyTorch has no single op for silu(gate) * up (eager runs two)")
    if op in GEGLUS:
        raise Unsupported("PyTorch has no single op for gelu(gate) * up (eager runs two)")
    if op == "gelu":
        return lambda i: F.gelu(i["x"], approximate=GELU_APPROX)
    if op == "squared_relu":
        raise Unsupported("PyTorch has no single op for relu(x)^2: eager runs relu then square")
    if op == "rope":
        raise Unsupported("PyTorch has no rotary embedding op (eager runs the formula)")
    if op == "cross_entropy":
        return lambda i: F.cross_entropy(i["x"], i["t"], ignore_index=CE_IGNORE)
    hid = case.shape["hidden"]
    if op == "layer_norm":
        return lambda i: F.layer_norm(i["x"], (hid,), i["w"], i["b"], LN_EPS)
    if not hasattr(F, "rms_norm"):
        raise Unavailable(f"torch {torch.__version__} has no F.rms_norm")
    return lambda i: F.rms_norm(i["x"], (hid,), i["w"], RMS_EPS)


_COMPILED: dict[tuple, Callable] = {}


def _rope_reference_fn() -> Callable:
    """The dispatcher's RoPE reference (transformers' formula in PyTorch ops), which ``compile`` compiles."""
    try:
        from pipegoose.nn.fusion.ops.rope import rope_reference
    except Exception as e:  # noqa: BLE001
        raise Unavailable(f"pipegoose.nn.fusion.ops.rope not importable: {type(e).__name__}: {e}") from None
    return lambda i: rope_reference(i["q"], i["k"], i["cos"], i["sin"])


def _compile(case: Case) -> Callable:
    base = (_native(case) if case.op == "layer_norm" else _rope_reference_fn() if case.op == "rope"
            else _eager(case))
    key = (case.op, case.dtype, tuple(case.shape.items()))
    fn = _COMPILED.get(key)
    if fn is None:
        raise_compile_limits()
        fn = _COMPILED[key] = torch.compile(base, dynamic=False)
    return fn


def _liger(case: Case) -> Callable:
    try:
        from liger_kernel.transformers import functional as LF
    except Exception as e:  # not installed on this host
        raise Unavailable(f"liger_kernel not importable: {e}") from None
    op = case.op
    if op == "softmax":
        return lambda i: LF.liger_softmax(i["x"])
    if op == "layer_norm":
        return lambda i: LF.liger_layer_norm(i["x"], i["w"], i["b"], LN_EPS)
    if op == "rms_norm":
        # in_place=False: the default writes dx into dy, which would corrupt the repeated backward timing
        return lambda i: LF.liger_rms_norm(i["x"], i["w"], RMS_EPS, in_place=False)
    if op in SWIGLUS:
        try:
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        except Exception as e:  # noqa: BLE001
            raise Unavailable(f"liger_kernel.ops.swiglu not importable: {e}") from None
        # its backward writes dgate and dup into the saved gate and up, which are the inputs themselves: run_ops
        # restores the inputs after this impl (clobbers_inputs). Packed: as Liger's Phi-3 MLP (LigerPhi3SwiGLUMLP)
        # calls it, on x.chunk(2, -1); its ensure_contiguous copies the two strided halves and its backward writes
        # into those copies, not x (a version taking the halves as they are would write into x: restored all the same)
        if op == "swiglu":
            fn = lambda i: LigerSiLUMulFunction.apply(i["g"], i["u"])  # noqa: E731
        else:
            fn = lambda i: LigerSiLUMulFunction.apply(*i["x"].chunk(2, dim=-1))  # noqa: E731
        fn.clobbers_inputs = True
        return fn
    if op in GEGLUS:
        try:
            from liger_kernel.ops.geglu import LigerGELUMulFunction
        except Exception as e:  # noqa: BLE001
            raise Unavailable(f"liger_kernel.ops.geglu not importable: {e}") from None
        # (its kernels compute GELU's tanh approximation only, Gemma's.) Its backward writes dgate and dup into the
        # saved gate and up, which are the inputs (contiguous: ensure_contiguous copies nothing): run_ops restores
        # them. Packed: the Function of x.chunk(2, -1), as for swiglu.packed (Liger has no packed GeGLU)
        if op == "geglu":
            fn = lambda i: LigerGELUMulFunction.apply(i["g"], i["u"])  # noqa: E731
        else:
            fn = lambda i: LigerGELUMulFunction.apply(*i["x"].chunk(2, dim=-1))  # noqa: E731
        fn.clobbers_inputs = True
        return fn
    if op == "gelu":
        raise Unsupported("Liger-Kernel has no GELU alone (only GELU times up, LigerGELUMulFunction)")
    if op == "squared_relu":
        raise Unsupported("Liger-Kernel has no squared ReLU")
    if op == "cross_entropy":
        # its forward writes the logits' gradient into the logits (the input itself): run_ops restores them
        fn = lambda i: LF.liger_cross_entropy(i["x"], i["t"], ignore_index=CE_IGNORE)  # noqa: E731
        fn.clobbers_inputs = True
        return fn
    if op == "rope":
        try:
            from liger_kernel.transformers.rope import liger_rotary_pos_emb
        except Exception as e:  # noqa: BLE001
            raise Unavailable(f"liger_kernel.transformers.rope not importable: {e}") from None
        # q.transpose(1, 2) of Llama's layout is contiguous, so its forward rotates q and k in place (the inputs)
        # and returns views of them, and its backward rotates the incoming gradients (case.dy) in place: run_ops
        # restores both after this impl (clobbers_inputs)
        fn = lambda i: liger_rotary_pos_emb(i["q"], i["k"], i["cos"], i["sin"])  # noqa: E731
        fn.clobbers_inputs = True
        return fn
    raise Unsupported("Liger-Kernel has no masked or causal softmax")


def _fusion_functional():
    os.environ.setdefault("PIPEGOOSE_STRICT", "1")
    try:
        from pipegoose.nn.fusion import functional as PF
    except Exception as e:
        raise Unavailable(f"pipegoose.nn.fusion.functional not importable: {type(e).__name__}: {e}") from None
    return PF


def _ours(impl: str) -> Callable[[Case], Callable]:
    def build(case: Case) -> Callable:
        PF = _fusion_functional()
        op = case.op
        if op == "softmax":
            fn = lambda i: PF.scaled_softmax(i["x"], 1.0, impl=impl)  # noqa: E731 - op "softmax", fused halves
        elif op == "softmax.masked":
            fn = lambda i: PF.scaled_masked_softmax(i["x"], i["mask"], SCALE, impl=impl)  # noqa: E731
        elif op == "softmax.causal":
            def fn(i: dict) -> torch.Tensor:
                x = i["x"]
                # the causal op takes [attn_batches, sq, sk]; the view keeps the leaf's gradient
                return PF.scaled_upper_triang_masked_softmax(x.view(-1, x.shape[-2], x.shape[-1]), SCALE,
                                                             impl=impl).view(x.shape)
        elif op == "layer_norm":
            hid = case.shape["hidden"]
            fn = lambda i: PF.layer_norm(i["x"], (hid,), i["w"], i["b"], LN_EPS, impl=impl)  # noqa: E731
        elif op == "swiglu":
            fn = lambda i: PF.swiglu(i["g"], i["u"], impl=impl)  # noqa: E731
        elif op == "swiglu.packed":
            fn = lambda i: PF.silu_and_mul(i["x"], impl=impl)  # noqa: E731
        elif op == "geglu":
            if not hasattr(PF, "geglu"):   # (a checkout from before the GeGLU op)
                raise Unavailable("pipegoose.nn.fusion.functional has no geglu")
            fn = lambda i: PF.geglu(i["g"], i["u"], approximate=GELU_APPROX, impl=impl)  # noqa: E731
        elif op == "geglu.packed":
            if not hasattr(PF, "gelu_and_mul"):   # (a checkout from before the op)
                raise Unavailable("pipegoose.nn.fusion.functional has no gelu_and_mul")
            fn = lambda i: PF.gelu_and_mul(i["x"], GELU_APPROX, impl=impl)  # noqa: E731
        elif op == "gelu":
            if not hasattr(PF, "gelu"):   # (a checkout from before the op)
                raise Unavailable("pipegoose.nn.fusion.functional has no gelu")
            fn = lambda i: PF.gelu(i["x"], GELU_APPROX, impl=impl)  # noqa: E731
        elif op == "squared_relu":
            if not hasattr(PF, "squared_relu"):   # (a checkout from before the op)
                raise Unavailable("pipegoose.nn.fusion.functional has no squared_relu")
            fn = lambda i: PF.squared_relu(i["x"], impl=impl)  # noqa: E731
        elif op == "cross_entropy":
            fn = lambda i: PF.cross_entropy(i["x"], i["t"], ignore_index=CE_IGNORE, impl=impl)  # noqa: E731
        elif op == "rope":
            fn = lambda i: PF.apply_rotary_pos_emb(i["q"], i["k"], i["cos"], i["sin"], impl=impl)  # noqa: E731
        else:
            hid = case.shape["hidden"]
            fn = lambda i: PF.rms_norm(i["x"], (hid,), i["w"], RMS_EPS, impl=impl)  # noqa: E731
        fn.expect = (op, impl)  # check_impl verifies that the dispatcher really ran this impl
        return fn
    return build


def _verify_choice(fn: Callable) -> None:
    """Raise Unsupported when the dispatcher ran another impl than the one asked for (it takes the next
    supporting impl when the requested one cannot take the input; only a fallback to torch raises in strict
    mode)."""
    expect = getattr(fn, "expect", None)
    if expect is None:
        return
    from pipegoose.nn.fusion import dispatch

    op, impl = expect
    ch = dispatch.last_choice(op)
    if ch is None:
        raise Unsupported(f"dispatcher recorded no choice for {op}")
    if ch.impl != impl:
        raise Unsupported(f"{impl} not taken (dispatcher ran {ch.impl}): {ch.reasons.get(impl) or ch.reason}")


IMPLS: dict[str, Callable[[Case], Callable]] = {
    "eager": _eager, "native": _native, "compile": _compile, "liger": _liger,
    "torch": _ours("torch"), "megatron": _ours("megatron"), "apex": _ours("apex"), "pipegoose": _ours("pipegoose"),
}


def impls_for(op: str) -> list[str]:
    """The impl names that apply to an op (others are not listed in its results)."""
    names = list(IMPL_ORDER)
    if op == "layer_norm":
        names.remove("eager")
    if op in ("softmax.masked", "softmax.causal", "gelu", "squared_relu"):
        names.remove("liger")     # (Liger-Kernel: no masked or causal softmax, no GELU or squared ReLU alone)
    if op.startswith("softmax") or op in ("rms_norm", *ELEMENTWISE, "cross_entropy", "rope"):
        names.remove("apex")      # Apex: only LayerNorm is ported
    if op in ("layer_norm", "rms_norm", *ELEMENTWISE, "cross_entropy", "rope"):
        names.remove("megatron")  # Megatron-LM: only the softmax kernels
    if op in (*GATED, "squared_relu", "rope"):
        names.remove("native")    # no single PyTorch op
    return names


def classify(exc: BaseException) -> str:
    """Map an exception from an impl to a status: unsupported / unavailable / error."""
    if isinstance(exc, Unsupported):
        return "unsupported"
    if isinstance(exc, Unavailable):
        return "unavailable"
    name = type(exc).__name__
    msg = str(exc).lower()
    if "unavailable" in name.lower() or "builderror" in name.lower() or isinstance(exc, ImportError):
        return "unavailable"
    if name == "FusionFallbackError" or isinstance(exc, NotImplementedError):
        return "unavailable" if "unavailable" in msg else "unsupported"
    return "error"


# ---------------------------------------------------------------------------------------------------------------
# running


def _dys(case: Case) -> tuple[torch.Tensor, ...]:
    """The upstream gradients, one per output."""
    return case.dy if isinstance(case.dy, tuple) else (case.dy,)


def _grads(y: torch.Tensor | tuple, case: Case) -> tuple:
    # allow_unused: an impl that ignores an input (no gradient for it) is FAILED by check_impl, not an error
    return torch.autograd.grad(y, [case.inputs[n] for n in case.wrt], case.dy, allow_unused=True)


def check_impl(fn: Callable, case: Case, tol: dict) -> tuple[str, float, str]:
    """Run ``fn`` once (forward + backward) on poisoned memory and compare with ``case.ref``.

    Returns (status "ok"/"FAILED", worst max-abs error, detail)."""
    dy0 = _dys(case)[0]
    dev = dy0.device.type
    first = case.inputs[case.wrt[0]]   # (the cross-entropy's dy is a scalar; its gradient has the logits' size)
    nbytes = max(dy0.numel() * dy0.element_size(), first.numel() * first.element_size())
    poison(nbytes, dev)
    y = fn(case.inputs)
    _verify_choice(fn)
    if len(case.outs) == 1:
        if not isinstance(y, torch.Tensor):
            return "FAILED", float("nan"), f"forward returned {type(y).__name__}, expected a Tensor"
        ys = (y,)
    else:
        ys = tuple(y) if isinstance(y, (tuple, list)) else (y,)
        if len(ys) != len(case.outs) or not all(isinstance(t, torch.Tensor) for t in ys):
            return "FAILED", float("nan"), (f"forward returned {type(y).__name__} of "
                                            f"{[type(t).__name__ for t in ys]}, expected {len(case.outs)} Tensors")
    # the cross-entropy's loss is fp32 (transformers upcasts; so do ours and Liger's) or, natively, the input's dtype
    want = (case.dtype, torch.float32) if case.op == "cross_entropy" else (case.dtype,)
    for t in ys:
        if t.dtype not in want:
            return "FAILED", float("nan"), f"forward returned dtype {t.dtype}, expected {case.dtype}"
    poison(nbytes, dev)
    grads = _grads(y, case)
    worst, problems = 0.0, []
    for name, got in list(zip(case.outs, ys)) + [(f"d{n}", g) for n, g in zip(case.wrt, grads)]:
        if got is None:
            problems.append(f"{name}: no gradient")
            continue
        ok, err, nbad = check_close(got, case.ref[name], tol["atol"], tol["rtol"])
        worst = err if (math.isnan(err) or math.isnan(worst)) else max(worst, err)
        if not ok:
            problems.append(f"{name}: {nbad} of {got.numel()} elements off (max abs err {err:.3g})")
    return ("FAILED" if problems else "ok"), worst, "; ".join(problems)


def time_impl(fn: Callable, case: Case, timer: Timer) -> dict[str, dict]:
    """Median times of fwd (training forward: inputs require grad), bwd (autograd.grad on a fresh forward's graph,
    the forward untimed) and fwd+bwd."""
    inp = case.inputs
    res = {"fwd": timer.time(lambda _: fn(inp))}
    res["bwd"] = timer.time(lambda y: _grads(y, case), setup=lambda: fn(inp))
    res["fwd+bwd"] = timer.time(lambda _: _grads(fn(inp), case))
    return res


def run_ops(ops: list[str], dtypes: list[torch.dtype], mode: str, device: str, timer: Timer, tol_table: dict,
            impl_filter: list[str] | None, deadline: float, log: Callable[[str], None] = print,
            no_compile: bool = False, compile_dtypes: list[torch.dtype] | None = None,
            sizes: list[int] | None = None) -> list[Measurement]:
    """Benchmark every (op, dtype, size, impl); each op gets an equal share of the time left until ``deadline``
    (``time.perf_counter`` seconds); what does not fit is recorded as ``skipped``. ``compile_dtypes``: the dtypes
    for which the ``compile`` impl runs (None = all; --quick compiles bf16 only: each shape costs a compile).
    ``sizes``: the last-dim sizes of the mode's list to keep (None = all)."""
    results: list[Measurement] = []
    for k, op in enumerate(ops):
        op_deadline = time.perf_counter() + max(0.0, deadline - time.perf_counter()) / (len(ops) - k)
        names = [n for n in impls_for(op) if not impl_filter or n in impl_filter]
        if no_compile and "compile" in names:
            names.remove("compile")
        for dtype in dtypes:
            tol = tol_table[dtype]
            for cols in [c for c in sizes_for(op, mode) if sizes is None or c in sizes]:
                shape = shape_for(op, cols, device)
                base = dict(op=op, dtype=dtype_name(dtype), shape=shape, cols=cols)
                if time.perf_counter() > op_deadline:
                    # (named with their dispatcher impl, as every other row: the tuning table keeps the rules of a
                    # group whose dispatchable impls were skipped)
                    results += [Measurement(**base, impl=n, pas=p, status="skipped", detail="time budget",
                                            tunable=n if n in TUNABLE else None)
                                for n in names for p in ("fwd", "bwd", "fwd+bwd")]
                    continue
                case = make_case(op, dtype, cols, device, seed=cols)
                case.ref = reference(case)
                pristine: dict[str, torch.Tensor] = {}
                pristine_dy: tuple[torch.Tensor, ...] = ()
                for name in names:
                    if pristine:   # the impl before wrote into the inputs (or dy): they are put back for this one
                        with torch.no_grad():
                            for k, v in pristine.items():
                                case.inputs[k].copy_(v)
                            for d, v in zip(_dys(case), pristine_dy):
                                d.copy_(v)
                        pristine, pristine_dy = {}, ()
                    tunable = name if name in TUNABLE else None
                    extra: dict[str, Any] = {}
                    if name == "compile" and compile_dtypes is not None and dtype not in compile_dtypes:
                        results += [Measurement(**base, impl=name, pas=p, status="skipped",
                                                detail="compile runs for " + ", ".join(map(dtype_name, compile_dtypes))
                                                + " only in this mode", bytes=op_bytes(op, p, shape, dtype_name(dtype)))
                                    for p in ("fwd", "bwd", "fwd+bwd")]
                        continue
                    try:
                        t0 = time.perf_counter()
                        fn = IMPLS[name](case)
                        if getattr(fn, "clobbers_inputs", False):
                            pristine = {k: v.detach().clone() for k, v in case.inputs.items()}
                            pristine_dy = tuple(d.clone() for d in _dys(case))
                        status, err, detail = check_impl(fn, case, tol)
                        if name == "compile":
                            extra["compile_s"] = round(time.perf_counter() - t0, 2)
                    except Exception as e:  # noqa: BLE001 - every failure is reported, none aborts the run
                        status, err, detail = classify(e), None, f"{type(e).__name__}: {str(e)[:300]}"
                    if status != "ok" or time.perf_counter() > op_deadline:
                        if status == "ok":
                            status, detail = "skipped", "time budget (checked ok, not timed)"
                        results += [Measurement(**base, impl=name, pas=p, status=status, max_abs_err=err,
                                                detail=detail, tunable=tunable, extra=extra,
                                                bytes=op_bytes(op, p, shape, dtype_name(dtype)))
                                    for p in ("fwd", "bwd", "fwd+bwd")]
                        log(f"  {op:15s} {dtype_name(dtype):8s} {cols:6d} {name:10s} {status}: {detail[:120]}")
                        continue
                    try:
                        times = time_impl(fn, case, timer)
                    except Exception as e:  # noqa: BLE001
                        results += [Measurement(**base, impl=name, pas=p, status="error", max_abs_err=err,
                                                detail=f"timing: {type(e).__name__}: {str(e)[:300]}",
                                                tunable=tunable, extra=extra) for p in ("fwd", "bwd", "fwd+bwd")]
                        continue
                    for p, t in times.items():
                        nbytes = op_bytes(op, p, shape, dtype_name(dtype))
                        results.append(Measurement(**base, impl=name, pas=p, status="ok", bytes=nbytes,
                                                   max_abs_err=err, tunable=tunable, extra=extra,
                                                   gbps=nbytes / (t["median_ms"] * 1e-3) / 1e9, **t))
                    log(f"  {op:15s} {dtype_name(dtype):8s} {cols:6d} {name:10s} ok  fwd "
                        f"{times['fwd']['median_ms']:.3f} ms  bwd {times['bwd']['median_ms']:.3f} ms")
                case.free()
                del case
                if device == "cuda":
                    torch.cuda.empty_cache()
    return results
