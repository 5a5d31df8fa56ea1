"""fuse(model) and RoPE functions that rotate one tensor a call: GPT-J's and CodeGen's
``apply_rotary_pos_emb(tensor, sin, cos)`` (interleaved pairs, tables of half a head that the function repeats, the
tensor laid out [B, S, H, D]; the module passes it the rotated part of each head, ``rotary_dim`` of them) and Gemma 3n's
and Gemma 4's ``apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1)`` (rotate-half, called with ``unsqueeze_dim=2``).
On the CPU: what the probe finds, the report, the calls the dispatching function takes and leaves to the model's code,
and the op's kernel path (a CPU stand-in of the kernel's ops, tests/rope_stand_in.py: q rotated with an empty k)
against the models' own code, forward and backward. On the GPU (marker ``cuda``): the same models fused run the kernel,
against their own code and a float64 copy."""

from __future__ import annotations

import copy

import pytest
import torch

from pipegoose.nn.fusion import dispatch
from pipegoose.nn.fusion.fuse import fuse, unfuse
from pipegoose.nn.fusion.transformers import rope as rope_mod

transformers = pytest.importorskip("transformers")

# model type -> (the rotation the probe must find, the form: sin first, half tables, the tensor's heads' dimension)
FUNCTIONS = {
    "gptj": (rope_mod.INTERLEAVED_FIRST_HALF, rope_mod.OneTensor("tensor, sin, cos", True, True, 2)),
    "codegen": (rope_mod.INTERLEAVED_FIRST_HALF, rope_mod.OneTensor("tensor, sin, cos", True, True, 2)),
    "gemma3n": (rope_mod.ROTATE_HALF, rope_mod.OneTensor("x, cos, sin, unsqueeze_dim", False, False, None)),
    "gemma4": (rope_mod.ROTATE_HALF, rope_mod.OneTensor("x, cos, sin, unsqueeze_dim", False, False, None)),
}
MODELS = ("gptj", "codegen", "gemma4")   # (Gemma 3n's model is multimodal: its function is probed, not its model)


def _modeling(model_type):
    return pytest.importorskip(f"transformers.models.{model_type}.modeling_{model_type}")


def _original(modeling):
    fn = modeling.apply_rotary_pos_emb
    d = rope_mod.dispatching_of(fn)
    return getattr(d, "__pipegoose_rope_original__") if d is not None else fn


@pytest.mark.parametrize("model_type", list(FUNCTIONS))
def test_the_probe_finds_the_one_tensor_functions(model_type):
    """Each function's rotation and form; every call form computes what the op's PyTorch path does, bit for bit (the
    op runs it); GPT-J's raises for tables narrower than its tensor (its module slices the tensor instead); Gemma's
    takes ``unsqueeze_dim`` as transformers' (q, k, cos, sin) functions do."""
    style, form = FUNCTIONS[model_type]
    found = rope_mod.probe(_original(_modeling(model_type)))
    assert found.ok, found.why
    assert found.style == style and found.one == form, found
    assert all(kind == rope_mod.EXACT for _, kind in found.forms), found.forms
    assert not found.partial
    assert found.unsqueeze == (form.heads_dim is None)


def test_a_one_tensor_function_of_another_rotation_is_skipped():
    """A one-tensor function of the transposed rotation (sin of the other sign), in either form, is refused with the
    reason, as is one that returns the wrong shape."""
    from pipegoose.nn.fusion.ops.rope import rotate_half

    def transposed(x, cos, sin, unsqueeze_dim=1):
        return x * cos.unsqueeze(unsqueeze_dim) - rotate_half(x) * sin.unsqueeze(unsqueeze_dim)

    def transposed_gptj(tensor, sin, cos):
        sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
        cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
        return tensor * cos - rotate_half(tensor, True) * sin

    def squeezed(x, cos, sin, unsqueeze_dim=1):
        return (x * cos.unsqueeze(unsqueeze_dim) + rotate_half(x) * sin.unsqueeze(unsqueeze_dim))[:, :1]

    for fn in (transposed, transposed_gptj, squeezed):
        found = rope_mod.probe(fn, "m.apply_rotary_pos_emb")
        assert not found.ok and "rotates one tensor a call, and computes none of the rotations" in found.why, found


def _tiny(model_type, dtype=torch.float32, hidden=64, heads=4, layers=2, **extra):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    name = "gemma4_text" if model_type == "gemma4" else model_type
    if name not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {name}")
    if model_type in ("gptj", "codegen"):
        # (a quarter of each head rotated, as GPT-J-6B's 64 of 256)
        kw = dict(n_embd=hidden, n_layer=layers, n_head=heads, rotary_dim=hidden // heads // 4, vocab_size=97,
                  n_positions=64, bos_token_id=1, eos_token_id=2, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
        if model_type == "codegen":
            kw["n_ctx"] = 64
    else:
        kw = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
                  head_dim=hidden // heads, global_head_dim=hidden // heads, intermediate_size=2 * hidden,
                  vocab_size=97, max_position_embeddings=64,
                  layer_types=["sliding_attention", "full_attention"][-layers:], vocab_size_per_layer_input=97,
                  hidden_size_per_layer_input=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg = CONFIG_MAPPING[name](**{**kw, **extra})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to(dtype)


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    logits.float().square().mean().backward()
    return logits.detach().double(), {n: p.grad.double() for n, p in model.named_parameters()
                                      if p.grad is not None and "proj" in n}


def _rotated(model, model_type):
    """The values of each head that the model's attention rotates (the tensor each call passes)."""
    attn = next(m for m in model.modules() if rope_mod.target(m) is not None)
    return attn.rotary_dim if model_type in ("gptj", "codegen") else attn.head_dim


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type", MODELS)
def test_one_tensor_models_are_fused_and_compute_what_they_did(model_type, dtype, monkeypatch):
    """fuse(model, ops=["rope"]) hooks each attention module and says how its function takes its tensor; on the CPU
    the calls run the op's PyTorch path, bit for bit the model's own code; on the kernel's path (the stand-in) each
    layer's q and k reach the op one at a time (an empty k beside each), forward and backward, of the rotated part of
    each head only, and the logits and gradients match the unfused model's; unfuse puts the function back."""
    from rope_stand_in import kernel_on_cpu

    modeling = _modeling(model_type)
    original = modeling.apply_rotary_pos_emb
    model = _tiny(model_type, dtype)
    layers = len([m for m in model.modules() if rope_mod.target(m) is not None])
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    ref, ref_g = _step(model, ids)
    rows = [r for r in fuse(model, ops=["rope"]).rows if r.kind == "rope"]
    assert len(rows) == layers and all(r.fused and r.eligible for r in rows), rows
    params = FUNCTIONS[model_type][1].params
    assert all(f"one tensor a call, ({params})" in r.reason for r in rows), rows
    if model_type in ("gptj", "codegen"):
        assert all(f"on the {_rotated(model, model_type)} values of each head" in r.reason for r in rows), rows
        # (its tables: half the rotated values, each for a pair; a breaker read "the tables' first half (GLM's)")
        assert all("half-width tables used for a pair of neighbours (GPT-J's)" in r.reason
                   and "with tables of half that width" in r.reason and "GLM" not in r.reason for r in rows), rows
    dispatch.reset_stats()
    got, got_g = _step(model, ids)
    assert dispatch.stats()["rope"] == {"torch": 2 * layers}, dispatch.stats()
    assert torch.equal(got, ref) and all(torch.equal(got_g[n], ref_g[n]) for n in ref_g)
    with kernel_on_cpu(monkeypatch, dispatch) as calls:
        dispatch.clear_choice_cache()
        dispatch.reset_stats()
        got, got_g = _step(model, ids)
        assert dispatch.stats()["rope"] == {"pipegoose": 2 * layers}, dispatch.stats()
        names = [c[0] for c in calls]
        assert names.count("rope_forward") == names.count("rope_backward") == 2 * layers, names
        assert all(c[2].numel() == 0 and c[1].shape[-1] == _rotated(model, model_type) for c in calls), \
            [(tuple(c[1].shape), tuple(c[2].shape)) for c in calls]
        assert all((c[-1] == "interleaved") == (model_type in ("gptj", "codegen")) for c in calls)
    dispatch.clear_choice_cache()
    # (the stand-in rounds once from float64; the models' code rounds each op in 16-bit)
    t = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(got, ref, **t)
    for n in ref_g:
        torch.testing.assert_close(got_g[n], ref_g[n], rtol=t["rtol"] * 10, atol=t["atol"] * 10,
                                   msg=lambda m: f"{n}: {m}")
    assert unfuse(model) is True
    assert modeling.apply_rotary_pos_emb is original and rope_mod.dispatching_of(original) is None


@pytest.mark.parametrize("model_type", ["gptj", "gemma4"])
def test_the_call_forms_the_op_takes(model_type):
    """What the dispatching function takes of a call (the rest runs the model's own function): the plain call, and
    Gemma's ``unsqueeze_dim`` by keyword or position (1, 2, -3, -2; left out: its default, 1); not an odd number of
    rotated values, tables of two dtypes, a 3-d tensor, tables of another sequence, an unknown keyword, another
    ``unsqueeze_dim``, nor tensors that are not tensors. A taken call gives the op q, an empty k of q's layout and the
    tables as given."""
    fn = _original(_modeling(model_type))
    found = rope_mod.probe(fn)
    sig = rope_mod._signature(fn)
    g = torch.Generator().manual_seed(2)

    def takes(*args, **kwargs):
        return rope_mod._takes_one(args, kwargs, found, sig)

    if model_type == "gptj":   # (tensor [B, S, H, R], sin, cos [B, S, R / 2])
        x = torch.randn(2, 5, 4, 8, generator=g)
        sin, cos = torch.randn(2, 5, 4, generator=g), torch.randn(2, 5, 4, generator=g)
        call = takes(x, sin, cos)
        assert call is not None
        (q, k, c, s), unsqueeze_dim, kind = call
        assert q is x and k.shape == (2, 5, 0, 8) and c is cos and s is sin and unsqueeze_dim == 2
        assert kind == rope_mod.EXACT
        assert takes(tensor=x, sin=sin, cos=cos) is not None
        assert takes(x[..., :6], sin[..., :3], cos[..., :3]) is not None   # 6 values, 3 pairs (a strided view)
        for bad in ((x[..., :7], sin[..., :3], cos[..., :3]),    # an odd count
                    (x, sin, cos.double()), (x[0], sin, cos), (x, sin[:, :4], cos[:, :4]), (x, sin, "cos"),
                    (x, torch.randn(2, 5, 8), cos)):             # (sin of the tensor's width: the function raises)
            assert takes(*bad) is None, [getattr(t, "shape", t) for t in bad]
        assert takes(x, sin, cos, unsqueeze_dim=2) is None
        assert rope_mod._call_tables(found, cos, sin)[0].shape == (2, 5, 8)
        torch.testing.assert_close(rope_mod._call_tables(found, cos, sin)[0][..., 1::2], cos, rtol=0, atol=0)
    else:   # (x [B, H, S, D] or [B, S, H, D], cos, sin [B, S, D])
        x = torch.randn(2, 3, 5, 8, generator=g)
        cos, sin = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
        for args, kwargs, dim in (((x, cos, sin), {}, 1), ((x, cos, sin, 1), {}, 1),
                                  ((x, cos, sin), {"unsqueeze_dim": -3}, -3),
                                  ((x.transpose(1, 2), cos, sin), {"unsqueeze_dim": 2}, 2),
                                  ((x.transpose(1, 2), cos, sin, -2), {}, -2)):
            call = takes(*args, **kwargs)
            assert call is not None and call[1] == dim
            (q, k, c, s), _, kind = call
            assert q is args[0] and k.numel() == 0 and k.shape[rope_mod._HEADS[dim]] == 0 and c is cos and s is sin
            assert kind == rope_mod.EXACT
        for args, kwargs in (((x, cos, sin), {"unsqueeze_dim": 0}), ((x, cos, sin), {"unsqueeze_dim": True}),
                             ((x, cos, sin), {"position_ids": None}), ((x[..., :7], cos[..., :7], sin[..., :7]), {}),
                             ((x, cos, sin.half()), {}), ((x, cos, sin), {"unsqueeze_dim": 2})):
            assert takes(*args, **kwargs) is None, kwargs


# --------------------------------------------------------------------------------------------------- on the GPU


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("style", ["gptj", "gemma"])
def test_the_kernel_rotates_q_alone(style, dtype, no_tuning_table):
    """The functional with an empty k (what a one-tensor call gives the op) on the kernel (strict mode): q as GPT-J's
    module passes it (the rotated quarter of each head of its projection, a strided view, [B, S, H, R], interleaved,
    tables of half a head each value twice) or as Gemma's ([B, S, H, D], rotate-half); the forward and q's gradient
    against the float64 formula within the dtype's tolerance; the outputs poisoned first, every element written."""
    from kernel_helpers import poison
    from tolerances import TOLERANCES

    from pipegoose.nn.fusion import functional as PF
    from pipegoose.nn.fusion.ops.rope import rope_reference

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(7)
    b, s, h = 2, 37, 6
    if style == "gptj":
        full = torch.randn(b, s, h, 256, generator=g, device=dev).to(dtype)
        x = full[..., :64]   # (GPT-J-6B's: 64 of each head of 256, a view of the projection)
        half = torch.rand(b, s, 32, generator=g, device=dev) * 6.3
        cos, sin = half.cos().repeat_interleave(2, -1).to(dtype), half.sin().repeat_interleave(2, -1).to(dtype)
    else:
        x = torch.randn(b, s, h, 128, generator=g, device=dev).to(dtype)
        ang = torch.rand(b, s, 128, generator=g, device=dev) * 6.3
        cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    inter = style == "gptj"
    x = x.requires_grad_()
    dy = torch.randn(x.shape, generator=g, device=dev).to(dtype)
    poison((x.shape, torch.float32), (x.shape, torch.float32))
    dispatch.reset_stats()
    with dispatch.strict():
        y, k_embed = PF.apply_rotary_pos_emb(x, x.detach().narrow(2, 0, 0), cos, sin, 2, interleaved=inter)
        (dx,) = torch.autograd.grad(y, x, dy)
    assert dispatch.stats()["rope"] == {"pipegoose": 1}, dispatch.stats()
    assert k_embed.shape == (b, s, 0, x.shape[-1])
    x64 = x.detach().double().requires_grad_()
    want = rope_reference(x64, x64.detach()[:, :, :0], cos.double(), sin.double(), 2, interleaved=inter)[0]
    (want_dx,) = torch.autograd.grad(want, x64, dy.double())
    for name, got, ref in (("forward", y, want), ("grad", dx, want_dx)):
        assert got.dtype == dtype and got.shape == ref.shape, name
        assert bool(torch.isfinite(got).all()), f"{name}: elements not written"
        torch.testing.assert_close(got.double(), ref.detach(), **TOLERANCES[dtype], msg=lambda m: f"{name}: {m}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("model_type", MODELS)
def test_fused_one_tensor_models_run_the_kernel(model_type, dtype, no_tuning_table):
    """A tiny GPT-J, CodeGen and Gemma 4 on the GPU: fuse(model, ops=["rope"]) runs every q and k call on the kernel
    (strict mode: no fallback), and the logits and gradients match the unfused model's (fp32: to fp32 rounding; bf16:
    the kernel rounds once where the models' bf16 code rounds each op)."""
    from tolerances import tol

    model = _tiny(model_type, dtype, hidden=256, heads=4).to("cuda")   # (heads of 64: GPT-J's rotates 16)
    layers = len([m for m in model.modules() if rope_mod.target(m) is not None])
    ids = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(1)).to("cuda")
    ref, ref_g = _step(model, ids)
    unfused = copy.deepcopy(model)
    rows = [r for r in fuse(model, ops=["rope"]).rows if r.kind == "rope"]
    assert len(rows) == layers and all(r.fused and r.forward == "pipegoose" for r in rows), \
        [(r.path, r.fused, r.forward, r.reason) for r in rows]   # (the rows' repr truncates the reason)
    dispatch.reset_stats()
    with dispatch.strict():
        got, got_g = _step(model, ids)
    assert dispatch.stats()["rope"] == {"pipegoose": 2 * layers}, dispatch.stats()
    # (bf16: the logits after two layers, each op of the model's rounding to bf16 where the kernel rounds once: up to
    # 0.106 apart at 6 of 7760 logits of Gemma 4 on the H100, session 79, past 4x the table's tolerance, 0.064)
    scale = 1 if dtype == torch.float32 else 8
    torch.testing.assert_close(got, ref, **tol(dtype, scale))
    for n in ref_g:
        torch.testing.assert_close(got_g[n], ref_g[n], **tol(dtype, 8 if dtype == torch.float32 else 32),
                                   msg=lambda m: f"{n}: {m}")
    unfuse(model)
    again, _ = _step(unfused, ids)
    assert torch.equal(again, ref)


def test_gemma4_full_attention_reports_whole_heads(monkeypatch):
    """Gemma 4's full-attention layers take a proportional RoPE (``partial_rotary_factor`` 0.25 in their
    ``rope_parameters``) whose tables cover the whole head: the report says plain calls, not a slice of each head
    (a review: "on the 8 values of each head", while the calls rotate heads of 32), and each call, on the stand-in,
    takes the whole head."""
    from rope_stand_in import kernel_on_cpu

    model = _tiny("gemma4", global_head_dim=32)
    params = model.config.rope_parameters["full_attention"]
    assert params["rope_type"] == "proportional" and params["partial_rotary_factor"] < 1
    rows = [r for r in fuse(model, ops=["rope"]).rows if r.kind == "rope"]
    assert len(rows) == 2 and all(r.fused for r in rows), rows
    assert not any("values of each head that it rotates" in r.reason for r in rows), rows
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    with kernel_on_cpu(monkeypatch, dispatch) as calls:
        dispatch.clear_choice_cache()
        _step(model, ids)
    dispatch.clear_choice_cache()
    assert sorted({c[1].shape[-1] for c in calls}) == [16, 32], [tuple(c[1].shape) for c in calls]
    unfuse(model)


def test_a_module_without_a_config_rotates_as_its_model_says():
    """DeepSeek V4's compressor (no config of its own) calls the model's one-tensor function, which rotates the last
    values of each head for narrower tables (not GPT-NeoX's partial rotary): with the model's partial rotary it is
    skipped with the reason, as its attention is (a review: reported fused, every call left to the model's code)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "deepseek_v4" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no deepseek_v4")
    cfg = CONFIG_MAPPING["deepseek_v4"](
        vocab_size=97, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        head_dim=32, q_lora_rank=32, n_routed_experts=4, num_experts_per_tok=2, index_n_heads=2, index_head_dim=16,
        index_topk=4, o_groups=2, o_lora_rank=16, sliding_window=8, hc_mult=2, num_nextn_predict_layers=0,
        max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    rows = [r for r in fuse(model, ops=["rope"]).rows if r.kind == "rope"]
    inner = [r for r in rows if not r.path.endswith("self_attn")]
    assert rows and inner, rows
    assert all(not r.fused and "partial rotary" in r.reason for r in rows), rows
    unfuse(model)


def test_a_one_tensor_function_that_fails_on_the_cpu_says_so():
    """A one-tensor function that raises for CPU inputs (a GPU-only patch) is refused with its error (a review: it read
    "computes none of the rotations")."""
    def gpu_only(x, cos, sin, unsqueeze_dim=1):
        if not x.is_cuda:
            raise RuntimeError("expected a CUDA tensor")
        return x

    found = rope_mod.probe(gpu_only, "m.apply_rotary_pos_emb")
    assert not found.ok and "RuntimeError: expected a CUDA tensor" in found.why, found.why
    assert "rotates one tensor a call" in found.why
