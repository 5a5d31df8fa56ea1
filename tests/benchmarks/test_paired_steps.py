"""benchmarks.paired_steps: argument checks and a CPU smoke run (tiny configs; the times mean nothing there)."""

import json

import _bench_path  # noqa: F401
import pytest

from benchmarks import paired_steps


@pytest.mark.parametrize("argv,expect", [
    (["--cases", "bert:sdpa:8x8"], "MODEL is bert-base or gpt2-small"),
    (["--cases", "bert-base:flash:8x8"], "ATTENTION eager or sdpa"),
    (["--cases", "bert-base:sdpa:8"], "expected MODEL:ATTENTION:BxS"),
    (["--steps", "0", "--device", "cpu"], "--steps: expected an integer >= 1"),
])
def test_bad_arguments_are_named(capsys, argv, expect):
    with pytest.raises(SystemExit) as e:
        paired_steps.main(argv)
    assert expect in (str(e.value) + capsys.readouterr().err)


def test_cpu_smoke_run_writes_results(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert paired_steps.main(["--device", "cpu", "--tiny", "--steps", "2", "--cases",
                              "bert-base:eager:2x8,gpt2-small:sdpa:2x8", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "bert-base:eager:2x8: unfused" in printed and "gpt2-small:sdpa:2x8: unfused" in printed
    data = json.loads(out.read_text())
    assert [r["case"] for r in data["results"]] == ["bert-base:eager:2x8", "gpt2-small:sdpa:2x8"]
    assert all(r["unfused_ms"] > 0 and r["fused_ms"] > 0 and r["speedup"] > 0 for r in data["results"])
    assert data["results"][0]["attention"]["chosen"] == "pipegoose"      # eager attention was replaced
    assert data["environment"]["torch"] and data["environment"]["date"]
