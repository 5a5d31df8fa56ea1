"""fuse(model) and the functional with the interleaved RoPE (pairs of neighbours rotating): Cohere's function (the
tables as given, fp32 math cast back), GLM's, GLM-4's, Helium's and ERNIE 4.5's (the tables' first half, each value
twice; GLM-4's rotates half of each head), on the CPU: the probe's findings, the report, and the op's kernel path
(a CPU stand-in of the kernel's ops, tests/rope_stand_in.py) against the models' own code, forward and backward."""

from __future__ import annotations

import pytest
import torch

from pipegoose.nn.fusion import dispatch
from pipegoose.nn.fusion import functional as PF
from pipegoose.nn.fusion.fuse import fuse, unfuse
from pipegoose.nn.fusion.ops import rope as rope_ops
from pipegoose.nn.fusion.transformers import rope as rope_mod

transformers = pytest.importorskip("transformers")

# model type -> (the style the probe must find, whether its function computes partial rotary, whether it computes in
# fp32 and casts back)
FUNCTIONS = {
    "cohere": (rope_mod.INTERLEAVED, False, True),
    "cohere2": (rope_mod.INTERLEAVED, False, True),
    "glm": (rope_mod.INTERLEAVED_FIRST_HALF, True, False),
    "glm4": (rope_mod.INTERLEAVED_FIRST_HALF, True, False),
    "helium": (rope_mod.INTERLEAVED_FIRST_HALF, False, False),
    "ernie4_5": (rope_mod.INTERLEAVED_FIRST_HALF, False, True),
}


def _modeling(model_type):
    return pytest.importorskip(f"transformers.models.{model_type}.modeling_{model_type}")


@pytest.mark.parametrize("model_type", list(FUNCTIONS))
def test_the_probe_finds_the_interleaved_functions(model_type):
    """Each function's style, partial rotary, and call forms: exact where it computes as the op's PyTorch path, close or
    cast (fp32 math rounded to q's dtype) where it computes in fp32, as probed."""
    style, partial, in_fp32 = FUNCTIONS[model_type]
    found = rope_mod.probe(_modeling(model_type).apply_rotary_pos_emb)
    assert found.ok and found.style == style and found.interleaved, found
    assert found.partial == partial and found.narrow_raises == (not partial), found
    kinds = dict(found.forms)
    assert kinds[(torch.float32, torch.float32)] == rope_mod.EXACT
    if in_fp32:
        assert kinds[(torch.bfloat16, torch.bfloat16)] == rope_mod.CLOSE
        assert kinds[(torch.bfloat16, torch.float32)] == rope_mod.CAST
    else:
        assert all(kind == rope_mod.EXACT for kind in kinds.values()), kinds


def test_rotate_half_functions_keep_their_style():
    """Llama's and GPT-NeoX's are still the rotate-half RoPE (tried first)."""
    for model_type in ("llama", "gpt_neox"):
        found = rope_mod.probe(_modeling(model_type).apply_rotary_pos_emb)
        assert found.ok and found.style == rope_mod.ROTATE_HALF and not found.interleaved


def _cohere_function(q, k, cos, sin, unsqueeze_dim=1):
    return _modeling("cohere").apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)


def test_functional_interleaved_equals_cohere_and_glm():
    """apply_rotary_pos_emb(..., interleaved=True) on PyTorch's path computes Cohere's function (float64, bit for bit
    up to its fp32 cast: compared in fp32 where it casts), with the tables as given; GLM's function equals it on
    kernel_tables' tables, partial rotary included; interleaved=False is the rotate-half RoPE; a non-bool is refused."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 16, generator=g), torch.randn(2, 2, 5, 16, generator=g)
    cos, sin = torch.randn(1, 5, 16, generator=g), torch.randn(1, 5, 16, generator=g)
    got = PF.apply_rotary_pos_emb(q, k, cos, sin, interleaved=True)
    want = _cohere_function(q, k, cos, sin)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    glm = _modeling("glm").apply_rotary_pos_emb
    for width in (16, 8):   # whole heads, half of each head
        c, s = cos[..., :width], sin[..., :width]
        got = PF.apply_rotary_pos_emb(q, k, *rope_mod.kernel_tables(c, s, rope_mod.INTERLEAVED_FIRST_HALF),
                                      interleaved=True)
        for a, b in zip(got, glm(q, k, c, s)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    plain = PF.apply_rotary_pos_emb(q, k, cos, sin)
    assert not torch.allclose(plain[0], got[0])
    with pytest.raises(TypeError, match="interleaved: expected a bool"):
        PF.apply_rotary_pos_emb(q, k, cos, sin, interleaved=1)


def test_functional_interleaved_on_the_kernel_path(monkeypatch):
    """On the kernel's path (its ops replaced by the CPU stand-in), the call reaches the op with interleaved=True,
    forward and backward, and computes the float64 formula to fp32's rounding; odd rotated values run PyTorch's
    path with the reason."""
    from rope_stand_in import kernel_on_cpu

    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 6, 16, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 6, 16, generator=g, requires_grad=True)
    cos, sin = torch.randn(2, 6, 8, generator=g), torch.randn(2, 6, 8, generator=g)
    dq, dk = torch.randn(q.shape, generator=g), torch.randn(k.shape, generator=g)
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    want = rope_ops.rope_reference(q64, k64, cos.double(), sin.double(), interleaved=True)
    want_g = torch.autograd.grad(want, (q64, k64), (dq.double(), dk.double()))
    with kernel_on_cpu(monkeypatch, dispatch) as calls:
        dispatch.reset_stats()
        got = PF.apply_rotary_pos_emb(q, k, cos, sin, interleaved=True)
        got_g = torch.autograd.grad(got, (q, k), (dq, dk))
        assert dispatch.stats()["rope"] == {"pipegoose": 1}
        assert [c[0] for c in calls] == ["rope_forward", "rope_backward"]
        assert all(c[-1] == "interleaved" for c in calls), calls
        dispatch.reset_stats()
        choice = dispatch.explain("rope", q, k, cos[..., :5], sin[..., :5], 1, True)
        assert choice.impl == "torch" and "pairs of neighbours rotate" in choice.reasons["pipegoose"], choice
    for a, b in zip(got + got_g, want + want_g):
        torch.testing.assert_close(a.double(), b.detach(), rtol=1e-5, atol=1e-6)


def _tiny(model_type, dtype):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    extra = {"head_dim": 16} if model_type in ("glm", "glm4", "helium", "ernie4_5") else {}
    cfg = CONFIG_MAPPING[model_type](hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=97, pad_token_id=0, eos_token_id=1,
                                     bos_token_id=2, **extra)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to(dtype)


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    logits.float().square().mean().backward()
    return logits.detach().double(), {n: p.grad.double() for n, p in model.named_parameters()
                                      if p.grad is not None and "proj" in n}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type", list(FUNCTIONS))
def test_interleaved_models_are_fused_and_compute_what_they_did(model_type, dtype, monkeypatch):
    """fuse(model, ops=["rope"]) hooks each attention module, the report names the rotation (GLM-4's: its partial
    rotary, half of each head); on the CPU the calls run PyTorch's path or the model's own code (fp32 Cohere: the op's
    path computes what its function does; GLM's in any dtype), and with the kernel's path (the stand-in) every
    layer's call reaches the op with interleaved=True, forward and backward; the logits and gradients match the
    unfused model's; unfuse puts the function back."""
    from rope_stand_in import kernel_on_cpu

    style, partial, _ = FUNCTIONS[model_type]
    modeling = _modeling(model_type)
    original = modeling.apply_rotary_pos_emb
    model = _tiny(model_type, dtype)
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    ref, ref_g = _step(model, ids)
    rows = [r for r in fuse(model, ops=["rope"]).rows if r.kind == "rope"]
    assert len(rows) == layers and all(r.fused and r.eligible for r in rows), rows
    assert all(rope_mod.STYLE_WORDS[style] in r.reason for r in rows), rows
    assert all(("partial rotary as GLM's" in r.reason) == partial for r in rows), rows
    with kernel_on_cpu(monkeypatch, dispatch) as calls:
        dispatch.clear_choice_cache()
        dispatch.reset_stats()
        got, got_g = _step(model, ids)
        assert dispatch.stats()["rope"] == {"pipegoose": layers}, dispatch.stats()
        names = [c[0] for c in calls]
        assert names.count("rope_forward") == names.count("rope_backward") == layers, names
        assert all(c[-1] == "interleaved" for c in calls)
        head = model.config.head_dim if hasattr(model.config, "head_dim") else 16
        assert all(c[1].shape[-1] == head for c in calls)
    dispatch.clear_choice_cache()
    # (the stand-in rounds once from float64; the models' code rounds each op in 16-bit, or computes in fp32)
    t = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(got, ref, **t)
    for n in ref_g:
        torch.testing.assert_close(got_g[n], ref_g[n], rtol=t["rtol"] * 10, atol=t["atol"] * 10,
                                   msg=lambda m: f"{n}: {m}")
    assert unfuse(model) is True
    assert modeling.apply_rotary_pos_emb is original and rope_mod.dispatching_of(original) is None
