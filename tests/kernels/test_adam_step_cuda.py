"""GPU: ``pipegoose::adam_step`` (ours, ``pipegoose/kernels/csrc/multi_tensor_adam.cu``) against the float64 Adam /
AdamW step: odd sizes, more tensors than one launch takes, empty and misaligned tensors, 64-bit offsets, and the
argument checks (a refused call changes nothing). Run on the GPU machine: ``python -m pytest -m cuda tests``."""

from __future__ import annotations

import pytest
import torch
from adam_reference import adam_state, adam_step64
from tolerances import TOLERANCES

pytestmark = pytest.mark.cuda
DEV = "cuda"
ALL = [torch.float32, torch.float16, torch.bfloat16]
HP = dict(lr=0.05, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
# one element; around the chunks (2048 16-bit, 4096 fp32 elements); one past the vector width; 400 small tensors (a
# launch takes 384); empty tensors between and at the end
SIZES = [1, 3, 2047, 2048, 2049, 4095, 4096, 4097, 65536 + 5, 0, 8 * 1000 + 1] + [37] * 400 + [0]


@pytest.fixture(scope="module")
def ops():
    from pipegoose.kernels import load

    return load("pipegoose/multi_tensor_adam")


def _step(ops, g, p, m, v, step=7, adam_w_mode=True, bias_correction=True, **kw):
    hp = {**HP, **kw}
    ops.adam_step(g, p, m, v, hp["lr"], hp["beta1"], hp["beta2"], hp["eps"], step, adam_w_mode, bias_correction,
                  hp["weight_decay"])


def _check(got_lists, wants, dtype):
    for i, want in enumerate(wants):
        for got, ref, what in zip((got_lists[0][i], got_lists[1][i], got_lists[2][i]), want,
                                  ("param", "exp_avg", "exp_avg_sq")):
            torch.testing.assert_close(got.double().cpu(), ref, **TOLERANCES[dtype],
                                       msg=lambda e: f"{what}[{i}] ({got.numel()} elements): {e}")


def test_opcheck(ops):
    p, g, m, v = adam_state([(5,), (300,)], torch.float32, DEV)
    torch.library.opcheck(torch.ops.pipegoose.adam_step.default, (g, p, m, v, 1e-3, 0.9, 0.999, 1e-8, 1, True, True,
                                                                   0.01))


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("step,beta2", [(7, 0.95), (1, 0.999)])
def test_adam_step_matches_float64(ops, dtype, adam_w_mode, bias_correction, step, beta2):
    """(At step 7 with beta2 0.95 the bias correction moves an update by 5%, within the 16-bit tolerances; at step 1
    with beta2 0.999 by a factor of 0.32: a wrong step or correction fails in every dtype there.)"""
    p, g, m, v = adam_state([(n,) for n in SIZES], dtype, DEV, seed=3)
    wants = [adam_step64(*t, step if bias_correction else None, HP["lr"], (HP["beta1"], beta2), HP["eps"],
                         HP["weight_decay"], adam_w_mode) for t in zip(p, g, m, v)]
    g_before = [t.clone() for t in g]
    _step(ops, g, p, m, v, step=step, adam_w_mode=adam_w_mode, bias_correction=bias_correction, beta2=beta2)
    assert all(torch.equal(a, b) for a, b in zip(g, g_before)), "grads must not change"
    _check((p, m, v), wants, dtype)


@pytest.mark.parametrize("dtype", ALL)
def test_misaligned_views_take_the_scalar_path(ops, dtype):
    """Views into flat buffers at odd element offsets (pointers not 16-byte aligned) in one launch with an aligned
    tensor: the first three tensors have one misaligned list each (params, grads, exp_avgs), the last none."""
    sizes = [1000 + 7, 4096 * 2 + 3, 5, 4096 * 3 + 1]
    p, g, m, v = adam_state([(n,) for n in sizes], dtype, DEV, seed=4)

    def offset(t, k):   # the same values at element offset k of a larger buffer
        buf = torch.zeros(t.numel() + k, dtype=t.dtype, device=DEV)
        buf[k:] = t
        return buf[k:]

    p[0], g[1], m[2] = offset(p[0], 1), offset(g[1], 3), offset(m[2], 5)
    assert p[0].data_ptr() % 16 and g[1].data_ptr() % 16 and m[2].data_ptr() % 16
    wants = [adam_step64(*t, 7, HP["lr"], (HP["beta1"], HP["beta2"]), HP["eps"], HP["weight_decay"], True)
             for t in zip(p, g, m, v)]
    _step(ops, g, p, m, v)
    _check((p, m, v), wants, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_64bit_offsets(ops, dtype):
    """One tensor of 2**31 + 4101 elements (2 x 4.3 GB a list): the elements past 2**31 are updated, and right."""
    n = 2**31 + 4101
    gen = torch.Generator(device=DEV).manual_seed(0)
    p = [torch.randn(n, device=DEV, dtype=dtype, generator=gen)]
    g = [torch.randn(n, device=DEV, dtype=dtype, generator=gen)]
    m = [torch.randn(n, device=DEV, dtype=dtype, generator=gen) * 0.1]
    v = [torch.rand(n, device=DEV, dtype=dtype, generator=gen) * 0.1 + 0.01]
    pieces = [slice(0, 5000), slice(2**31 - 3000, 2**31 + 3000), slice(n - 5000, n)]
    wants = [adam_step64(p[0][s], g[0][s], m[0][s], v[0][s], 7, HP["lr"], (HP["beta1"], HP["beta2"]), HP["eps"],
                         HP["weight_decay"], True) for s in pieces]
    _step(ops, g, p, m, v)
    _check(([p[0][s] for s in pieces], [m[0][s] for s in pieces], [v[0][s] for s in pieces]), wants, dtype)


def test_refused_calls_name_the_argument_and_change_nothing(ops):
    p, g, m, v = adam_state([(n,) for n in [10, 4097] + [37] * 400], torch.float32, DEV, seed=5)
    state = p + m + v   # the tensors of every call below (one list at a time is replaced by a bad one)
    before = [t.clone() for t in state]

    def refused(match, g=g, p=p, m=m, v=v, **kw):
        with pytest.raises(RuntimeError, match=match):
            _step(ops, g, p, m, v, **kw)
        assert all(torch.equal(a, b) for a, b in zip(state, before)), "a refused call changed a tensor"

    refused(r"exp_avgs has 401 tensors but grads has 402", m=m[:-1])
    refused(r"params\[401\] is Half but params\[0\] is Float", p=p[:-1] + [p[-1].half()])
    refused(r"exp_avg_sqs\[401\] must be contiguous", v=v[:-1] + [torch.zeros(37, 2, device=DEV).t()[0]])
    refused(r"grads\[401\] has 36 elements but params\[401\] has 37", g=g[:-1] + [g[-1][:36]])
    refused(r"grads\[401\] is on cpu", g=g[:-1] + [g[-1].cpu()])
    refused(r"params must be float32, float16 or bfloat16, got Double", g=[t.double() for t in g],
            p=[t.double() for t in p], m=[t.double() for t in m], v=[t.double() for t in v])
    refused(r"step must be >= 1", step=0)
    refused(r"beta1 and beta2 must be in \[0, 1\)", beta2=1.0)
    refused(r"lr must be finite", lr=float("nan"))
    _step(ops, g, p, m, v, step=0, bias_correction=False)   # no bias correction: step 0 is fine
    assert not torch.equal(p[0], before[0])
