"""The correctness gate of the op benchmarks: a wrong implementation is reported FAILED and never timed (CPU)."""

import math

import _bench_path  # noqa: F401
import pytest
import torch

from benchmarks import ops
from benchmarks.common import tolerances
from benchmarks.timing import Timer


def test_check_close_flags_nan_and_off_elements():
    ref = torch.linspace(-1, 1, 100)
    ok, err, bad = ops.check_close(ref.clone(), ref, atol=1e-5, rtol=1e-4)
    assert ok and err == 0 and bad == 0
    out = ref.clone()
    out[7] = float("nan")        # an element the kernel never wrote
    out[9] += 0.1
    ok, err, bad = ops.check_close(out, ref, atol=1e-5, rtol=1e-4)
    assert not ok and bad == 2 and math.isnan(err)
    with pytest.raises(ValueError, match="shape"):
        ops.check_close(ref[:3], ref, 1e-5, 1e-4)


@pytest.mark.parametrize("op", ops.OPS)
def test_reference_matches_torch_on_fp32(op):
    case = ops.make_case(op, torch.float32, ops.sizes_for(op, "dry")[0], "cpu")
    ref = ops.reference(case)
    fn = ops.IMPLS["eager" if op == "swiglu" else "native"](case)   # (PyTorch has no single op for SwiGLU)
    y = fn(case.inputs)
    grads = torch.autograd.grad(y, [case.inputs[n] for n in case.wrt], case.dy)
    torch.testing.assert_close(y, ref["y"], atol=1e-5, rtol=1e-4)
    for n, g in zip(case.wrt, grads):
        torch.testing.assert_close(g, ref[f"d{n}"], atol=1e-4, rtol=1e-4)


def test_wrong_impl_is_failed_not_timed(monkeypatch):
    def wrong(case):   # RMSNorm without the weight: right shape and dtype, wrong values
        return lambda i: i["x"] * torch.rsqrt(i["x"].pow(2).mean(-1, keepdim=True) + ops.RMS_EPS)

    monkeypatch.setitem(ops.IMPLS, "eager", wrong)
    res = ops.run_ops(["rms_norm"], [torch.float32], "dry", "cpu", Timer("cpu", warmup=0, reps=2), tolerances(),
                      ["eager", "native"], deadline=1e18, log=lambda s: None)
    eager = [m for m in res if m.impl == "eager"]
    native = [m for m in res if m.impl == "native"]
    assert eager and all(m.status == "FAILED" and m.median_ms is None for m in eager)
    assert "dw: no gradient" in eager[0].detail and "y:" in eager[0].detail
    assert native and all(m.status == "ok" and m.median_ms > 0 and m.gbps > 0 for m in native)
    assert {m.pas for m in native} == {"fwd", "bwd", "fwd+bwd"}


def test_time_budget_skips_instead_of_running():
    res = ops.run_ops(["layer_norm"], [torch.float32], "dry", "cpu", Timer("cpu", warmup=0, reps=2), tolerances(),
                      ["native"], deadline=0.0, log=lambda s: None)
    assert res and all(m.status == "skipped" for m in res)


def test_sizes_keeps_only_the_sizes_asked_for():
    kw = dict(deadline=1e18, log=lambda s: None)
    timer = Timer("cpu", warmup=0, reps=2)
    res = ops.run_ops(["rms_norm"], [torch.float32], "dry", "cpu", timer, tolerances(), ["native"], sizes=[128], **kw)
    assert res and {m.cols for m in res} == {128}
    every = ops.run_ops(["rms_norm"], [torch.float32], "dry", "cpu", timer, tolerances(), ["native"], **kw)
    assert {m.cols for m in every} == set(ops.SIZES["norm"]["dry"])
