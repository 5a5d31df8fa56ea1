"""Byte counts of the benchmark suite (benchmarks/byte_counts.py) against hand-computed values."""

import _bench_path  # noqa: F401
import pytest

from benchmarks.byte_counts import op_bytes


def test_softmax_plain_counts_read_and_write():
    shape = {"b": 2, "np": 3, "sq": 5, "sk": 7}
    n = 2 * 3 * 5 * 7
    assert op_bytes("softmax", "fwd", shape, "bfloat16") == 2 * n * 2
    assert op_bytes("softmax", "bwd", shape, "float32") == 3 * n * 4
    assert op_bytes("softmax", "fwd+bwd", shape, "float16") == 5 * n * 2


def test_masked_softmax_adds_the_bool_mask_once_per_batch_row():
    shape = {"b": 2, "np": 3, "sq": 5, "sk": 7}
    n, mask = 2 * 3 * 5 * 7, 2 * 5 * 7
    assert op_bytes("softmax.masked", "fwd", shape, "bfloat16") == 2 * n * 2 + mask
    assert op_bytes("softmax.masked", "bwd", shape, "bfloat16") == 3 * n * 2


def test_causal_softmax_reads_the_lower_triangle_writes_all():
    shape = {"b": 1, "np": 2, "sq": 4, "sk": 4}
    tri, full = 2 * 10, 2 * 16          # 4*5/2 = 10 per matrix
    assert op_bytes("softmax.causal", "fwd", shape, "float16") == (tri + full) * 2
    assert op_bytes("softmax.causal", "bwd", shape, "float16") == (2 * tri + full) * 2
    with pytest.raises(ValueError, match="sq == sk"):
        op_bytes("softmax.causal", "fwd", {"b": 1, "np": 1, "sq": 3, "sk": 4}, "float16")


def test_swiglu_reads_two_writes_one_forward_reads_three_writes_two_backward():
    r, i = 4096, 5632
    n = r * i
    assert op_bytes("swiglu", "fwd", {"rows": r, "inter": i}, "bfloat16") == 3 * n * 2
    assert op_bytes("swiglu", "bwd", {"rows": r, "inter": i}, "float32") == 5 * n * 4
    assert op_bytes("swiglu", "fwd+bwd", {"rows": r, "inter": i}, "float16") == 8 * n * 2
    with pytest.raises(ValueError, match="inter"):
        op_bytes("swiglu", "fwd", {"rows": r, "hidden": i}, "bfloat16")


def test_packed_swiglu_reads_x_writes_y_forward_reads_dy_and_x_writes_dx_backward():
    """swiglu.packed (silu_and_mul): x [rows, 2 * inter] holds gate and up, dx [rows, 2 * inter] their gradients (one
    tensor): the bytes of swiglu at the same shape, whatever an impl moves besides (eager's concatenation)."""
    r, d = 16384, 5632
    shape = {"rows": r, "inter": d}
    x, y = r * 2 * d, r * d                  # elements of x (and of dx); of y (and of dy)
    assert op_bytes("swiglu.packed", "fwd", shape, "bfloat16") == (x + y) * 2                       # read x, write y
    assert op_bytes("swiglu.packed", "bwd", shape, "float32") == (y + x + x) * 4             # read dy, x; write dx
    assert op_bytes("swiglu.packed", "fwd+bwd", shape, "float16") == (x + y + y + x + x) * 2 == 8 * y * 2
    for pas in ("fwd", "bwd", "fwd+bwd"):
        for dt in ("bfloat16", "float16", "float32"):
            assert op_bytes("swiglu.packed", pas, shape, dt) == op_bytes("swiglu", pas, shape, dt)
    with pytest.raises(ValueError, match="inter"):
        op_bytes("swiglu.packed", "fwd", {"rows": r, "hidden": d}, "bfloat16")


def test_geglu_is_charged_swiglus_bytes():
    """geglu: read gate and up, write y (forward); read dy, gate, up, write dgate and dup (backward): the bytes of
    swiglu at the same shape (only the activation differs: arithmetic, not bytes)."""
    r, i = 16384, 16384                   # Gemma-2B's intermediate size
    n = r * i
    shape = {"rows": r, "inter": i}
    assert op_bytes("geglu", "fwd", shape, "bfloat16") == 3 * n * 2
    assert op_bytes("geglu", "bwd", shape, "float32") == 5 * n * 4
    assert op_bytes("geglu", "fwd+bwd", shape, "float16") == 8 * n * 2
    for pas in ("fwd", "bwd", "fwd+bwd"):
        for dt in ("bfloat16", "float16", "float32"):
            assert op_bytes("geglu", pas, shape, dt) == op_bytes("swiglu", pas, shape, dt)
    with pytest.raises(ValueError, match="inter"):
        op_bytes("geglu", "fwd", {"rows": r, "hidden": i}, "bfloat16")


def test_cross_entropy_reads_the_logits_once_forward_and_writes_their_gradient_backward():
    r, v = 4194, 32000
    n = r * v
    extra = r * 8 + r * 4                 # int64 targets, fp32 log-sum-exp
    assert op_bytes("cross_entropy", "fwd", {"rows": r, "vocab": v}, "bfloat16") == n * 2 + extra
    assert op_bytes("cross_entropy", "bwd", {"rows": r, "vocab": v}, "bfloat16") == 2 * n * 2 + extra
    assert op_bytes("cross_entropy", "fwd+bwd", {"rows": r, "vocab": v}, "float32") == 3 * n * 4 + 2 * extra


def test_rope_reads_and_writes_q_and_k_once_and_reads_cos_and_sin_once_each_pass():
    shape = {"b": 4, "seq": 2048, "hq": 32, "hk": 4, "d": 64}     # Llama-1.1B's training shape
    qk, table = 4 * 2048 * (32 + 4) * 64, 4 * 2048 * 64          # elements of q + k; of cos (and of sin)
    one = 2 * qk * 2 + 2 * table * 2                               # bf16: q, k read and written; cos, sin read
    assert op_bytes("rope", "fwd", shape, "bfloat16") == one
    assert op_bytes("rope", "bwd", shape, "bfloat16") == one       # dq_embed, dk_embed in; dq, dk out; cos, sin
    assert op_bytes("rope", "fwd+bwd", shape, "float32") == 2 * 2 * one
    with pytest.raises(ValueError, match="hk"):
        op_bytes("rope", "fwd", {"b": 4, "seq": 2048, "hq": 32, "d": 64}, "bfloat16")



@pytest.mark.parametrize("op", ["gelu", "squared_relu"])
def test_one_input_activations_read_x_write_y_forward_read_dy_and_x_write_dx_backward(op):
    """gelu and squared_relu (an activation alone, of x [rows, inter]): read x, write y (forward); read dy and x, write
    dx (backward): 2 and 3 tensors of x's size, whatever an impl saves besides (eager's relu(x) for the square)."""
    r, i = 4096, 5632
    n = r * i
    shape = {"rows": r, "inter": i}
    assert op_bytes(op, "fwd", shape, "bfloat16") == 2 * n * 2
    assert op_bytes(op, "bwd", shape, "float32") == 3 * n * 4
    assert op_bytes(op, "fwd+bwd", shape, "float16") == 5 * n * 2
    assert op_bytes(op, "fwd", shape, "float32") < op_bytes("swiglu", "fwd", shape, "float32")   # (one input, not two)
    with pytest.raises(ValueError, match="missing"):
        op_bytes(op, "fwd", {"rows": r, "hidden": i}, "bfloat16")

def test_norm_counts_include_params_and_fp32_stats():
    r, h = 16384, 1000
    n = r * h
    assert op_bytes("layer_norm", "fwd", {"rows": r, "hidden": h}, "bfloat16") == 2 * n * 2 + 2 * h * 2 + 2 * r * 4
    assert op_bytes("layer_norm", "bwd", {"rows": r, "hidden": h}, "bfloat16") == 3 * n * 2 + 3 * h * 2 + 2 * r * 4
    assert op_bytes("rms_norm", "fwd", {"rows": r, "hidden": h}, "float32") == 2 * n * 4 + h * 4 + r * 4
    assert op_bytes("rms_norm", "bwd", {"rows": r, "hidden": h}, "float32") == 3 * n * 4 + 2 * h * 4 + r * 4


def test_optimizer_and_copy_counts():
    assert op_bytes("adamw", "step", {"params": 10}, "float32") == 7 * 10 * 4
    assert op_bytes("clip_grad_norm", "step", {"params": 10}, "bfloat16") == 3 * 10 * 2
    assert op_bytes("clip_grad_norm", "unclipped", {"params": 10}, "bfloat16") == 10 * 2   # the norm's read alone
    assert op_bytes("copy", "step", {"numel": 8}, "float32") == 64


@pytest.mark.parametrize("args, match", [
    (("softmax", "sideways", {"b": 1, "np": 1, "sq": 1, "sk": 1}, "float32"), "pas"),
    (("softmax", "fwd", {"b": 1, "np": 1, "sq": 1, "sk": 1}, "int8"), "dtype"),
    (("softmax", "fwd", {"b": 1, "np": 1, "sq": 1}, "float32"), "missing"),
    (("softmax", "fwd", {"b": 0, "np": 1, "sq": 1, "sk": 1}, "float32"), ">= 1"),
    (("silu", "fwd", {"rows": 1}, "float32"), "unknown op"),
    (("relu2", "fwd", {"rows": 1, "inter": 1}, "float32"), "unknown op .*gelu, squared_relu, cross_entropy"),
    (("adamw", "fwd", {"params": 1}, "float32"), "single pass"),
    (("adamw", "unclipped", {"params": 1}, "float32"), "single pass"),
    (("clip_grad_norm", "fwd", {"params": 1}, "float32"), "clip_grad_norm has the passes 'step', 'unclipped'"),
])
def test_bad_arguments_name_the_argument(args, match):
    with pytest.raises(ValueError, match=match):
        op_bytes(*args)
