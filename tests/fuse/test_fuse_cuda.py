"""fuse(model) on a GPU: the fused kernels really run (strict mode: a fallback to the reference path raises),
outputs and gradients agree with the unfused model, and 30 training steps of small GPT-NeoX and Llama models give
the same losses fused and unfused.

Run: ``python -m pytest -m cuda tests/fuse -q`` (the kernels are built on first use; see pipegoose.kernels).

Criterion for parity in low precision: both the fused and the unfused model are compared with a float64 copy of
the model; the fused error must not exceed twice the unfused error plus the dtype's tolerance (tests/tolerances.py).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from pipegoose.nn.fusion import dispatch
from pipegoose.nn.fusion.fuse import fuse, unfuse
from tolerances import TOLERANCES, TRAIN_LOSS_RTOL, tol

from . import models

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("no_tuning_table")]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _run(model, ids, mask, weights):
    model.zero_grad(set_to_none=True)
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    keep = mask.bool()
    loss = (hidden.double() * weights)[keep].sum()
    loss.backward()
    grads = {n: p.grad.detach().double() for n, p in model.named_parameters() if p.grad is not None}
    return hidden.detach().double()[keep], grads


def _err(a, b):
    return (a - b).abs().max().item()


def _fused_run(model, ids, mask, weights, **fuse_kw):
    """fuse(model, **fuse_kw), one run of _run in strict mode (a fallback to the reference path raises), unfuse:
    (the run's outputs and gradients, fuse's report, dispatch.stats() of the run)."""
    report = fuse(model, **fuse_kw)
    dispatch.reset_stats()
    try:
        with dispatch.strict():
            fus = _run(model, ids, mask, weights)
    finally:
        ran = dispatch.stats()
        unfuse(model)
    return fus, report, ran


def _assert_parity(fus, unf, ref64, dtype):
    """The fused run's output and gradients are within twice the unfused run's error from the float64 run, plus the
    dtype's tolerance (see the module docstring)."""
    t = TOLERANCES[dtype]
    scale = ref64[0].abs().max().item()
    assert _err(fus[0], ref64[0]) <= 2 * _err(unf[0], ref64[0]) + t["atol"] + t["rtol"] * scale
    # Gradients: the error of a whole parameter's gradient (L2 norm) rather than its largest element: in fp16 a
    # single element of a small weight-gradient vector is dominated by rounding noise (seen on the H200: OPT fp16,
    # final_layer_norm.weight, largest-element errors 1.21 fused vs 0.50 unfused at a gradient scale of 14).
    for n, g64 in ref64[1].items():
        gs = g64.norm().item()
        e_f, e_u = (fus[1][n] - g64).norm().item(), (unf[1][n] - g64).norm().item()
        assert e_f <= 2 * e_u + t["atol"] * gs + t["rtol"] * gs, (n, e_f, e_u)


def _parity_runs(model, dtype, hidden, sdpa_reference=True, left_pad=(0, 5, 17, 63), **fuse_kw):
    """The float64 reference (a copy of ``model``, an fp32 model on the GPU, with SDPA: eager casts fp64 scores to
    fp32, where the fp64 mask value overflows to -inf and fully masked rows give NaN; ``sdpa_reference`` False: the
    fp32 eager copy, for Bloom, which has no SDPA), then ``model`` in ``dtype`` unfused and fused (_fused_run, with
    ``fuse_kw``), on inputs of 4 rows of 64 tokens, ``left_pad`` of them padded on the left: (ref64, unfused, fused,
    fuse's report, dispatch.stats() of the fused run)."""
    dev = torch.device("cuda")
    if sdpa_reference:
        model64 = copy.deepcopy(model).double()
        model64.set_attn_implementation("sdpa")
    else:
        model64 = copy.deepcopy(model).float()
    model = model.to(dtype)
    ids, mask = models.inputs(batch=4, seq=64, left_pad=left_pad)
    ids, mask = ids.to(dev), mask.to(dev)
    weights = torch.randn(*ids.shape, hidden, generator=torch.Generator().manual_seed(5),
                          dtype=torch.float64).to(dev)
    ref64 = _run(model64, ids, mask, weights)
    unf = _run(model, ids, mask, weights)
    return (ref64, unf, *_fused_run(model, ids, mask, weights, **fuse_kw))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("arch", models.ARCHS)
def test_parity_with_kernels(arch, dtype):
    model = models.build(arch, "eager", hidden=64, heads=4).to(torch.device("cuda"))
    ref64, unf, fus, report, ran = _parity_runs(model, dtype, 64, sdpa_reference=arch != "bloom")
    # the fused kernels ran, and nothing fell back to the reference path (strict mode)
    assert ran.get("layer_norm" if arch != "llama" else "rms_norm"), ran
    assert all(impl != "torch" for per_op in ran.values() for impl in per_op), ran
    # the GELU of the MLPs without a gate (gelu_new, BloomGelu, GELUActivation) on the kernel (op gelu, session 72)
    assert bool(ran.get("gelu")) == (arch in ("bert", "gpt2", "gpt_neox", "bloom")), ran
    if arch != "bloom":
        assert report.attention["chosen"] == "pipegoose"
    else:   # (Bloom's ALiBi attention: FusedBloomAttention, the same softmax kernel with the bias, since session 74)
        rows = [r for r in report.rows if r.kind == "attention"]
        assert rows and all(r.replacement == "FusedBloomAttention" for r in rows), report
    assert ran.get("softmax.masked"), ran
    _assert_parity(fus, unf, ref64, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_gpt_neox_partial_rotary_on_the_kernel_parity(dtype):
    """GPT-NeoX with Pythia's partial rotary (a quarter of each head): the rope rows are fused, every layer's call ran
    the kernel's partial path (strict mode: no fallback), and outputs and gradients agree with the unfused model as in
    test_parity_with_kernels."""
    model = models.build("gpt_neox", "eager", hidden=128, heads=4).to(torch.device("cuda"))   # 8 of 32 rotated
    assert model.config.rope_parameters["partial_rotary_factor"] == 0.25
    ref64, unf, fus, report, ran = _parity_runs(model, dtype, 128)
    rows = [r for r in report.rows if r.kind == "rope"]
    assert rows and all(r.fused and r.forward == "pipegoose" for r in rows), rows
    assert ran.get("rope") == {"pipegoose": model.config.num_hidden_layers}, ran
    _assert_parity(fus, unf, ref64, dtype)


def test_gpt_neox_fused_on_the_cpu_runs_the_partial_rotary_kernel_on_the_gpu():
    """A review: fuse(model) while the model is on the CPU (from_pretrained loads there; the Trainer moves it
    afterwards) left Pythia's partial rotary unfused for good. Fused on the CPU and moved to the GPU, every layer's
    call now runs the kernel's partial path (strict mode: no fallback), and outputs and gradients agree with the
    unfused model as in test_parity_with_kernels (fp32)."""
    model = models.build("gpt_neox", "eager", hidden=128, heads=4)   # 8 of 32 rotated, on the CPU
    dev = torch.device("cuda")
    model64 = copy.deepcopy(model).double().to(dev)
    model64.set_attn_implementation("sdpa")
    ids, mask = models.inputs(batch=4, seq=64, left_pad=(0, 0, 0, 0))
    ids, mask = ids.to(dev), mask.to(dev)
    weights = torch.randn(*ids.shape, 128, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(dev)
    ref64 = _run(model64, ids, mask, weights)
    report = fuse(model, ops=["rope"])
    try:
        rows = [r for r in report.rows if r.kind == "rope"]
        assert rows and all(r.fused and r.forward == "the model's code (fallback)" for r in rows), rows
        model.to(dev)
        dispatch.reset_stats()
        with dispatch.strict():
            fus = _run(model, ids, mask, weights)
        assert dispatch.stats().get("rope") == {"pipegoose": model.config.num_hidden_layers}, dispatch.stats()
    finally:
        unfuse(model)
    unf = _run(model, ids, mask, weights)
    _assert_parity(fus, unf, ref64, torch.float32)


def _rope_model(model_type: str):
    """A small model whose RoPE fuse() routes since a review: OLMo-2 (fp32 tables in a bf16 model, results cast back
    by its function), ESM (rotate-half in fp32 on q.float(), called with unsqueeze_dim=1) and Phi (a quarter of each
    head rotated, sliced by the module); or a skip."""
    transformers = pytest.importorskip("transformers")
    extra = dict(partial_rotary_factor=0.25) if model_type == "phi" else {}
    cfg = models.rope_config(model_type, hidden=128, max_positions=128, **extra)
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(cfg, attn_implementation="eager")


@pytest.mark.parametrize("model_type, dtype", [("olmo2", torch.bfloat16), ("esm", torch.bfloat16),
                                               ("esm", torch.float32), ("phi", torch.float32),
                                               ("phi", torch.bfloat16)])
def test_rope_of_olmo_esm_and_phi_runs_the_kernel(model_type, dtype):
    """Every attention's RoPE call of a fused OLMo-2 (bf16 q with fp32 tables: the kernel's fp32 results cast back to
    bf16, as OLMo's function casts its own), ESM (unsqueeze_dim=1 by keyword; its function computes in fp32) and Phi
    (the module's slice of each head) runs the kernel (strict mode: no fallback), and outputs and gradients agree with
    the unfused model as in test_parity_with_kernels."""
    dev = torch.device("cuda")
    model = _rope_model(model_type).to(dev)
    ids = torch.randint(4, 30, (4, 64), generator=torch.Generator().manual_seed(0)).to(dev)
    mask = torch.ones_like(ids)
    weights = torch.randn(*ids.shape, 128, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(dev)
    ref64 = _run(copy.deepcopy(model).double(), ids, mask, weights)
    model.to(dtype)
    unf = _run(model, ids, mask, weights)
    fus, report, ran = _fused_run(model, ids, mask, weights, ops=["rope"])
    rows = [r for r in report.rows if r.kind == "rope"]
    assert len(rows) == model.config.num_hidden_layers and all(r.fused and r.forward == "pipegoose" for r in rows)
    assert ran.get("rope") == {"pipegoose": model.config.num_hidden_layers}, ran
    _assert_parity(fus, unf, ref64, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_per_head_rms_norms_parity_with_kernels(dtype):
    """Qwen3's q_norm / k_norm (RMSNorm over head_dim) fused with the rest: our kernel runs on them (strict mode:
    no fallback), and outputs and gradients agree with the unfused model as in test_parity_with_kernels."""
    transformers = pytest.importorskip("transformers")
    dev = torch.device("cuda")
    cfg = transformers.Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, intermediate_size=128, vocab_size=models.VOCAB,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.Qwen3Model(cfg).to(dev)
    # no padding: SDPA's rows without a key (its own, unfused here) are not what this test is about
    ref64, unf, fus, report, ran = _parity_runs(model, dtype, 64, left_pad=(0, 0, 0, 0), ops=["rms_norm"])
    rows = {r.path: r for r in report.rows}
    assert rows["layers.0.self_attn.q_norm"].fused and rows["layers.1.self_attn.k_norm"].fused, report
    # 2 layers x (input, post-attention, q, k) + the final norm: 9 forwards, all ours
    assert ran.get("rms_norm") == {"pipegoose": 9}, ran
    _assert_parity(fus, unf, ref64, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_phi3_gate_up_mlps_parity_with_kernels(dtype):
    """Phi-3's MLPs (gate and up in one gate_up_proj) fused as FusedGateUpSwiGLUMLP: every layer's call runs
    pipegoose::silu_and_mul (op swiglu.packed; strict mode: no fallback), and outputs and gradients agree with the
    unfused model as in test_parity_with_kernels."""
    transformers = pytest.importorskip("transformers")
    dev = torch.device("cuda")
    cfg = models.rope_config("phi3", hidden=64, max_positions=128)   # (a skip where transformers lacks Phi-3)
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(cfg, attn_implementation="sdpa").to(dev)
    # no padding: SDPA's rows without a key (its own, unfused here) are not what this test is about
    ref64, unf, fus, report, ran = _parity_runs(model, dtype, 64, left_pad=(0, 0, 0, 0), ops=["swiglu"])
    rows = report.fused_rows("swiglu")
    assert len(rows) == cfg.num_hidden_layers, report.rows
    assert all(r.replacement == "FusedGateUpSwiGLUMLP" and r.forward == "pipegoose" for r in rows), rows
    assert ran.get("swiglu.packed") == {"pipegoose": cfg.num_hidden_layers} and "swiglu" not in ran, ran
    _assert_parity(fus, unf, ref64, dtype)


def _lm(arch, seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = models.config(arch, "eager", hidden=256, layers=4, heads=8)
    cfg.vocab_size = 512
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").cuda()


def _train(model, batches, steps=30):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    losses = []
    model.train()
    for i in range(steps):
        ids, mask, labels = batches[i % len(batches)]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("arch", ["gpt_neox", "llama"])
def test_training_losses_match(arch):
    g = torch.Generator().manual_seed(0)
    batches = []
    for b in range(4):
        ids = torch.randint(0, 512, (4, 256), generator=g)
        mask = torch.ones_like(ids)
        if b % 2:                                  # half the batches left-padded: padding-masked softmax
            mask[1, :40] = 0
            mask[3, :200] = 0
        labels = ids.masked_fill(mask == 0, -100)
        batches.append(tuple(t.cuda() for t in (ids, mask, labels)))

    unfused = _lm(arch)
    fused_model = _lm(arch)
    assert all(torch.equal(a, b) for a, b in zip(unfused.parameters(), fused_model.parameters()))
    ref = _train(unfused, batches)
    report = fuse(fused_model)
    assert report.covered == report.eligible
    dispatch.reset_stats()
    with dispatch.strict():
        out = _train(fused_model, batches)
    ran = dispatch.stats()
    unfuse(fused_model)
    assert ran.get("softmax.causal") and ran.get("softmax.masked"), ran
    assert all(impl != "torch" for per_op in ran.values() for impl in per_op), ran
    assert ref[-1] < ref[0] - 0.5, f"the unfused run did not train: {ref}"
    for i, (a, b) in enumerate(zip(ref, out)):
        assert abs(a - b) <= TRAIN_LOSS_RTOL * abs(a), f"step {i}: unfused {a:.5f} fused {b:.5f}\n{ref}\n{out}"


class _AttnModule(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("path", ["small_problem", "transformers_sdpa"])
def test_sdpa_paths_give_zeros_for_rows_without_keys(monkeypatch, dtype, path):
    """The paths that call F.scaled_dot_product_attention with a bool mask (our small-problem path, and
    transformers' sdpa function behind 'pipegoose_sdpa'), on CUDA, with query rows that have no key to attend (a
    left-padded causal batch, and a batch row of padding only): outputs and gradients match the float64 reference,
    where such rows give zeros. On the H200 (torch 2.11) SDPA ran cuDNN attention in fp16/bf16, whose outputs for
    such rows were nonzero, and the fused GPT-2 demo's gradients NaN (fp32 runs another backend: zeros)."""
    from pipegoose.nn.fusion.transformers import attention as A

    monkeypatch.delenv("PIPEGOOSE_SMALL_NUMEL")  # tests/fuse turn the small-problem rule off; this test is about it
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(11)
    b, h, s, d, scale = 3, 4, 16, 32, 0.2
    q, k, v = (torch.randn(b, h, s, d, generator=g).to(dev, dtype).requires_grad_() for _ in range(3))
    pad = torch.tensor([0, 5, s])
    j = torch.arange(s)
    attend = (j[None, :] <= j[:, None])[None] & (j[None, None, :] >= pad[:, None, None])   # [b, sq, sk]
    mask = attend[:, None].to(dev)
    dispatch.reset_stats()
    if path == "small_problem":
        out, probs = A.pipegoose_attention_forward(_AttnModule(), q, k, v, mask, scaling=scale)
        assert probs is None and dispatch.stats() == {"attention": {"sdpa": 1}}
    else:
        out, _ = A._transformers_sdpa(_AttnModule(), q, k, v, mask, scaling=scale)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    sc = (q64 @ k64.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    ref = (torch.softmax(sc, -1).nan_to_num(0.0) @ v64).transpose(1, 2)
    assert out.shape == ref.shape and out.dtype == dtype
    assert out[2].abs().max().item() == 0 and out[1, :5].abs().max().item() == 0   # rows without keys: zeros
    torch.testing.assert_close(out.double(), ref, **tol(dtype, 4))
    go = torch.randn(ref.shape, generator=g, dtype=torch.float64).to(dev)
    grads = torch.autograd.grad(out, (q, k, v), go.to(dtype))
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), go)
    for name, a, r in zip("qkv", grads, ref_grads):
        assert torch.isfinite(a).all(), f"grad {name}: not finite"
        torch.testing.assert_close(a.double(), r, **tol(dtype, 8), msg=lambda m: f"grad {name}: {m}")


def test_demo_gpt2_bf16_left_padding_on_gpu(capsys, monkeypatch):
    """The main job on a GPU with a left-padded batch (--model gpt2: fully masked causal rows) in bf16: at this size
    the attention runs the small-problem SDPA path (the rule on, as for a user: tests/fuse turn it off); the fused
    model's gradients are finite and within the parity rule (they were NaN before that path opened rows without
    keys)."""
    from pipegoose.nn.fusion import demo

    monkeypatch.delenv("PIPEGOOSE_SMALL_NUMEL")

    assert demo.main(["--model", "gpt2", "--device", "cuda", "--dtype", "bfloat16", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "parity (bfloat16" in out and "PASS" in out and not re.search(r"\bnan\b", out)
