"""transformers' ``Trainer`` with a fused model and ``FusedAdam`` (CPU: the reference paths run): the same losses as
the unfused model with ``torch.optim.AdamW`` (Trainer's gradient clipping included), checkpoints that resume to the
same losses (the fused model's state dict and FusedAdam's through Trainer's own saving and loading), and a saved
model that an unfused model loads. Needs ``accelerate`` (a Trainer dependency; in the ``test`` extras)."""

from __future__ import annotations

import copy

import pytest
import torch

from pipegoose.nn.fusion import FusedAdam, dispatch, fuse, is_fused, unfuse

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

STEPS = 4


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def _data():
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 128, (16,), generator=g) for _ in range(12)]
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def _train(model, out, optimizer, resume=None, cpu=True):
    """STEPS steps of Trainer (batch 2, lr 1e-3 with its linear decay, max_grad_norm 0.5: the gradients are
    clipped, a checkpoint every 2 steps): (the trainer, the logged losses)."""
    args = transformers.TrainingArguments(str(out), max_steps=STEPS, per_device_train_batch_size=2,
                                          learning_rate=1e-3, max_grad_norm=0.5, report_to=[], use_cpu=cpu,
                                          logging_steps=1, save_strategy="steps", save_steps=2, seed=3, data_seed=3,
                                          dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_data(),
                                   optimizer_cls_and_kwargs=(optimizer, {"lr": 1e-3, "weight_decay": 0.01}))
    trainer.train(resume_from_checkpoint=resume)
    return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_with_a_fused_model_and_fused_adam(base, tmp_path):
    unfused = copy.deepcopy(base)
    _, want = _train(unfused, tmp_path / "unfused", torch.optim.AdamW)
    assert len(want) == STEPS and want[0] > want[-1]

    model = copy.deepcopy(base)
    report = fuse(model)
    assert {r.kind for r in report.rows if r.fused} >= {"rms_norm", "swiglu", "rope", "cross_entropy"}
    dispatch.reset_stats()
    trainer, got = _train(model, tmp_path / "fused", FusedAdam)
    ran = dispatch.stats()
    assert all(ran.get(op) for op in ("rms_norm", "swiglu", "rope", "cross_entropy", "adam")), ran
    assert isinstance(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer,
                      FusedAdam)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=0)

    # resumed from the step-2 checkpoint (the fused model's weights and FusedAdam's state, saved by Trainer):
    # the same losses at steps 3 and 4
    resumed = copy.deepcopy(base)
    fuse(resumed)
    _, again = _train(resumed, tmp_path / "resumed", FusedAdam, resume=str(tmp_path / "fused" / "checkpoint-2"))
    torch.testing.assert_close(torch.tensor(again[-2:]), torch.tensor(got[-2:]), rtol=1e-6, atol=0)

    # the saved model loads into an unfused model, which computes what the trained fused model computes
    trainer.save_model(str(tmp_path / "saved"))
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "saved")).eval()
    ids = _data()[0]["input_ids"][None]
    model.eval()
    with torch.no_grad():
        fused_logits = model(input_ids=ids).logits
        assert unfuse(model) and not is_fused(model)
        torch.testing.assert_close(loaded(input_ids=ids).logits, fused_logits, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model(input_ids=ids).logits, fused_logits, rtol=1e-5, atol=1e-6)
    unfuse(resumed)


@pytest.mark.cuda
def test_trainer_on_the_gpu_runs_our_kernels(base, tmp_path, no_tuning_table):
    """On a GPU (fp32 model, our kernels forced past the small-problem rule and the tuning table): the fused model's
    ops and FusedAdam run our kernels under Trainer, and the losses follow the unfused model's with AdamW."""
    _, want = _train(copy.deepcopy(base).cuda(), tmp_path / "unfused", torch.optim.AdamW, cpu=False)
    model = copy.deepcopy(base).cuda()
    fuse(model)
    dispatch.reset_stats()
    _, got = _train(model, tmp_path / "fused", FusedAdam, cpu=False)
    ran = dispatch.stats()
    for op in ("rms_norm", "swiglu", "rope", "cross_entropy", "adam"):
        assert ran.get(op, {}).get("pipegoose"), (op, ran)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=0)
    unfuse(model)
