"""Under ``torch.compile`` the op entry points emit PyTorch's reference ops (``dispatch.compile_passthrough``). A
fresh-clone review (session 61): they did so before their argument checks, so a compiled call of bad input gave NaN or
an unintended result where the eager call raised (``layer_norm(eps=-1)``: all NaN; ``fused_linear_cross_entropy(
reduction="none")``: a loss per row). The checks now run first; they are traced into the graph, not a break of it."""

from __future__ import annotations

import math
import operator
import types

import numpy as np
import pytest
import torch
import torch._dynamo as dynamo

from pipegoose.nn import fusion
import pipegoose.nn.fusion.functional as pf
from pipegoose.nn.fusion.ops import _common, layer_norm as ln_ops, softmax as softmax_ops


def _rope_args(q_dtype=torch.float32, k_dtype=torch.float32):
    q, k = torch.randn(2, 3, 5, 8, dtype=q_dtype), torch.randn(2, 3, 5, 8).to(k_dtype)
    return q, k, torch.randn(2, 5, 8), torch.randn(2, 5, 8)


H, W, T = torch.randn(6, 4), torch.randn(7, 4), torch.randint(0, 7, (6,))
X = torch.randn(2, 8)
# (name, a call on bad input, the error it raises in eager mode: type and the start of the message; compiled, the
# same message, in dynamo's error when fullgraph=True; a shape the norms leave to PyTorch's op under compile: torch's)
BAD = [
    ("layer_norm eps<0", lambda: pf.layer_norm(X, 8, eps=-1.0), ValueError, "eps: expected a finite number >= 0"),
    ("rms_norm eps nan", lambda: pf.rms_norm(X, 8, eps=float("nan")), ValueError, "eps: expected a finite number"),
    ("lce reduction", lambda: pf.fused_linear_cross_entropy(H, W, T, reduction="none"), ValueError, "reduction: "),
    ("lce chunk_rows", lambda: pf.fused_linear_cross_entropy(H, W, T, chunk_rows=-3), ValueError, "chunk_rows: "),
    ("lce target size", lambda: pf.fused_linear_cross_entropy(H, W, T[:5]), ValueError, "target: "),
    ("swiglu int up", lambda: pf.swiglu(X, torch.ones(2, 8, dtype=torch.int64)), TypeError, "up: expected a floating"),
    ("geglu approximate", lambda: pf.geglu(X, X, "exact"), ValueError, "approximate: expected 'none'"),
    ("silu_and_mul odd x", lambda: pf.silu_and_mul(X[:, :7]), ValueError, "x: expected an even last dimension"),
    ("silu_and_mul 0-dim x", lambda: pf.silu_and_mul(X[0, 0]), ValueError, "x: expected at least one dimension"),
    ("silu_and_mul int x", lambda: pf.silu_and_mul(torch.ones(2, 8, dtype=torch.int64)), TypeError,
     "x: expected a floating"),
    ("rope int k", lambda: pf.apply_rotary_pos_emb(*_rope_args(k_dtype=torch.int64)), TypeError,
     "k: expected a floating"),
    ("cross_entropy fp8", lambda: pf.cross_entropy(torch.randn(4, 7).to(torch.float8_e4m3fn), T[:4]), TypeError,
     "logits: expected dtype"),
]


@pytest.mark.parametrize("name, call, kind, says", BAD, ids=[b[0] for b in BAD])
def test_a_compiled_call_of_bad_input_raises_as_the_eager_call(name, call, kind, says):
    with pytest.raises(kind, match=f"^{says}"):
        call()
    dynamo.reset()
    with pytest.raises(kind, match=f"^{says}"):
        torch.compile(call, backend="eager")()
    dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="Observed exception"):   # (how dynamo reports any raise)
        torch.compile(call, backend="eager", fullgraph=True)()


def test_a_bad_norm_shape_under_compile_is_pytorchs_error():
    """The norms' shape checks are left to PyTorch's op under torch.compile (a numpy size made them guard on a
    data-dependent value): a weight of the wrong shape is its error there, not a silent result."""
    with pytest.raises(ValueError, match=r"^weight: expected shape \[8\]"):
        pf.layer_norm(X, 8, weight=torch.ones(7))
    dynamo.reset()
    with pytest.raises(RuntimeError, match="Expected weight to be of same shape as normalized_shape"):
        torch.compile(lambda: pf.layer_norm(X, 8, weight=torch.ones(7)), backend="eager")()


GOOD = [
    ("layer_norm", lambda x: pf.layer_norm(x, 8, torch.ones(8), torch.zeros(8), 1e-5)),

    ("rms_norm", lambda x: pf.rms_norm(x, (8,), torch.rand(8), 1e-6)),
    ("rms_norm llama", lambda x: pf.rms_norm(x, 8, torch.rand(8), None, cast_before_weight=True)),
    ("swiglu", lambda x: pf.swiglu(x, x * 2)),
    ("geglu", lambda x: pf.geglu(x, x * 2)),
    ("geglu exact", lambda x: pf.geglu(x, x * 2, "none")),
    ("silu_and_mul", lambda x: pf.silu_and_mul(x)),
    ("silu_and_mul 3-d", lambda x: pf.silu_and_mul(x.view(2, 2, 4)) * 2),
    ("cross_entropy", lambda x: pf.cross_entropy(x, torch.tensor([1, 7]), reduction="sum")),
    ("lce", lambda x: pf.fused_linear_cross_entropy(x, torch.randn(5, 8), torch.tensor([1, -100]))),
    ("rope", lambda x: pf.apply_rotary_pos_emb(*_rope_args())[0] + x.sum()),
]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name, f", GOOD, ids=[g[0] for g in GOOD])
def test_the_checks_trace_into_one_graph(name, f, dynamic):
    """(dynamic=True: a float eps or scale is symbolic there; the checks' float() and getattr broke the graph at every
    norm, a review of the first version of these checks)"""
    torch.manual_seed(0)
    x = torch.randn(2, 8)
    dynamo.reset()
    explained = dynamo.explain(f)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch.manual_seed(1)
    want = f(x)
    dynamo.reset()
    torch.manual_seed(1)
    torch.testing.assert_close(torch.compile(f, backend="eager", fullgraph=True, dynamic=dynamic)(x), want)


EPS = [("layer_norm", lambda x, e: pf.layer_norm(x, 8, torch.ones(8), None, e)),
       ("rms_norm", lambda x, e: pf.rms_norm(x, 8, None, e)),
       ("scaled_softmax", lambda x, e: pf.scaled_softmax(x, e)),
       ("scaled_masked_softmax", lambda x, e: pf.scaled_masked_softmax(x.view(1, 1, 2, 8), None, e))]


@pytest.mark.parametrize("name, f", EPS, ids=[e[0] for e in EPS])
def test_a_float_argument_compiles_to_one_graph_with_dynamic_shapes_and_is_still_checked(name, f):
    """A review (session 61): under torch.compile(dynamic=True) a float eps or scale passed in is symbolic, and the
    checks' getattr / float() / math.isfinite broke the graph (a fused Llama: 12 graphs, 14 breaks; fullgraph=True
    raised). Now one graph; a bad value still raises (dynamo's error with fullgraph, the eager one without)."""
    x = torch.randn(2, 8)
    dynamo.reset()
    torch.testing.assert_close(torch.compile(f, backend="eager", fullgraph=True, dynamic=True)(x, 0.25), f(x, 0.25))
    for bad in (-1.0, float("nan"), float("inf")) if "softmax" not in name else (float("nan"), float("inf")):
        dynamo.reset()
        with pytest.raises(ValueError, match="expected a finite number"):
            torch.compile(f, backend="eager", dynamic=True)(x, bad)


def test_a_fused_llama_compiles_to_one_graph_with_dynamic_shapes():
    """The review's case: fuse(model), then torch.compile(model, dynamic=True, fullgraph=True) of a tiny Llama (it
    raised "Unsupported hasattr call" in the eps check)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
                                         attn_implementation="eager")).eval()
    ids = torch.randint(0, 64, (2, 7))
    fusion.fuse(model, attention="keep")
    with torch.no_grad():
        want = model(input_ids=ids, labels=ids).loss
        dynamo.reset()
        got = torch.compile(model, backend="eager", dynamic=True, fullgraph=True)(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(got, want)
    fusion.unfuse(model)


N8, N8_32 = np.int64(8), np.int32(8)   # (sizes from numpy, as a config read with numpy gives them)


@pytest.mark.parametrize("f", [lambda x: pf.layer_norm(x, N8, torch.ones(8), torch.zeros(8), 1e-5),
                               lambda x: pf.rms_norm(x, (N8,), torch.ones(8), 1e-6),
                               lambda x: pf.layer_norm(x, [N8])],
                         ids=["layer_norm", "rms_norm", "layer_norm list"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_numpy_integer_size_compiles(f, backend):
    """A numpy integer ``normalized_shape`` failed inside dynamo ("Can't unpack scalar tensors": dynamo makes numpy
    scalars tensors, no numbers.Integral), and the shape checks then guarded on a data-dependent value (a review).
    It now compiles to one graph, the shapes left to PyTorch's op there, and gives the eager result."""
    x = torch.randn(2, 8)
    dynamo.reset()
    torch.testing.assert_close(torch.compile(f, backend=backend, fullgraph=True)(x), f(x))


def test_a_numpy_int32_size_compiles_with_a_break():
    """np.int32 sizes in a tuple: dynamo guards on the sign of the data-dependent size (one graph break; fullgraph=True
    refuses them), and the result is the eager one."""
    x = torch.randn(2, 8)
    f = lambda t: pf.rms_norm(t, (N8_32,), torch.ones(8), 1e-6)   # noqa: E731
    dynamo.reset()
    torch.testing.assert_close(torch.compile(f, backend="eager")(x), f(x))


@pytest.mark.parametrize("name, f", EPS, ids=[e[0] for e in EPS])
def test_a_compiled_graph_reused_for_a_bad_float_still_raises(name, f):
    """A re-test (session 61): under dynamic=True a graph compiled for scale 0.5 was reused for scale inf (NaN out, no
    error): a comparison with inf puts no guard on a symbolic float. The checks compare with the largest float."""
    x = torch.randn(2, 8)
    dynamo.reset()
    g = torch.compile(f, backend="eager", dynamic=True)
    g(x, 0.5)
    g(x, 0.25)   # (the second call compiles the dynamic graph)
    for bad in (math.inf, -math.inf, math.nan) + ((-1.0,) if "softmax" not in name else ()):
        with pytest.raises(ValueError, match="expected a finite number"):
            g(x, bad)


def test_a_nested_tensor_compiles_to_one_graph():
    """A re-test: the nested branch of the scaled softmaxes counted the call under the dispatcher's lock, which broke
    the compiled graph (fullgraph=True: "Dynamo does not know how to enter a `RLock` context manager")."""
    nt = torch.nested.nested_tensor([torch.randn(2, 3, 5), torch.randn(2, 4, 5)], layout=torch.jagged)
    f = lambda t: pf.scaled_masked_softmax(t, None, 0.5)   # noqa: E731
    dynamo.reset()
    got = torch.compile(f, backend="eager", fullgraph=True)(nt)
    for g, r in zip(got.unbind(), nt.unbind()):
        torch.testing.assert_close(g, torch.softmax(r * 0.5, -1))


class _InternalError(Exception):
    """Stands in for torch 2.11 dynamo's InternalTorchDynamoError: what a TypeError raised by operator.index inside a
    traced function became there, which an ``except TypeError`` does not catch."""


def _index_as_in_dynamo_2_11(value):
    try:
        return operator.index(value)
    except TypeError as e:
        raise _InternalError(str(e)) from None


@pytest.fixture
def index_as_in_dynamo_2_11(monkeypatch):
    """``operator.index`` of the ops' helpers, raising a non-TypeError where it raises a TypeError (as under torch
    2.11's dynamo): a helper that tells an integer from a shape by catching that TypeError fails here on torch 2.14 too
    (the CI's), not only on the GPU machine's torch 2.11."""
    shim = types.SimpleNamespace(index=_index_as_in_dynamo_2_11)
    for module in (_common, ln_ops, softmax_ops):
        monkeypatch.setattr(module, "operator", shim, raising=False)


SHAPES = [(8, (8,)), ((8,), (8,)), ([8, 2], (8, 2)), (torch.Size([8, 2]), (8, 2)), (N8, (8,)), ((N8_32, 2), (8, 2)),
          (np.uint8(8), (8,))]
NOT_SHAPES = [8.5, "8", True, None, (8.5,), [True], (8, "2"), np.float64(8), np.True_, torch.tensor(8)]


def test_a_shape_is_told_from_a_size_without_a_caught_type_error(index_as_in_dynamo_2_11):
    """A review (torch 2.11, the GPU machine's): ``torch.compile`` of any FusedLayerNorm / FusedRMSNorm failed
    ("InternalTorchDynamoError: TypeError: 'tuple' object cannot be interpreted as an integer"): normalize_shape tried
    operator.index on the module's tuple shape and caught the TypeError, which dynamo 2.11 made an internal error. The
    helpers tell sizes, shapes and bad values apart by type now; the eager errors are unchanged."""
    for shape, want in SHAPES:
        assert ln_ops.normalize_shape(shape) == want
    for bad in NOT_SHAPES:
        with pytest.raises(TypeError, match=r"^normalized_shape: expected an int or a sequence of ints, got"):
            ln_ops.normalize_shape(bad)
    for good in (3, -100, N8, np.int32(-1), np.uint8(3)):
        assert _common.int_value(good, "ignore_index") == good
    for bad, kind in ((3.0, "float"), (True, "bool"), (np.True_, "bool"), (np.float32(3), "float32"), ((3,), "tuple"),
                      ("3", "str"), (None, "NoneType")):
        with pytest.raises(TypeError, match=f"^ignore_index: expected an int, got {kind}$"):
            _common.int_value(bad, "ignore_index")
    for dim in (1, -1, N8 - 7):
        torch.testing.assert_close(pf.softmax(X, dim), torch.softmax(X, int(dim)))
    for bad, kind in ((1.0, "float"), (True, "bool"), ("1", "str")):
        with pytest.raises(TypeError, match=f"^dim: expected an int, got {kind}$"):
            pf.softmax(X, bad)


@pytest.mark.parametrize("module", [fusion.FusedLayerNorm, fusion.FusedRMSNorm])
@pytest.mark.parametrize("shape", [8, (8,), [8]], ids=["int", "tuple", "list"])
def test_a_fused_norm_module_compiles_without_a_caught_type_error(module, shape, index_as_in_dynamo_2_11):
    """The review's case, with operator.index raising as under torch 2.11's dynamo: the module (its shape stored as a
    tuple) compiles to one graph and gives the eager result."""
    m = module(shape)
    x = torch.randn(2, 8)
    dynamo.reset()
    torch.testing.assert_close(torch.compile(m, backend="eager", fullgraph=True)(x), m(x))


IGNORE = [("cross_entropy", lambda x, i: pf.cross_entropy(x, torch.tensor([1, 3, 0, 3]), ignore_index=i)),
          ("lce", lambda x, i: pf.fused_linear_cross_entropy(x, torch.ones(7, 8) / 8, torch.tensor([1, 3]),
                                                             ignore_index=i, chunk_rows=np.int64(1)))]


@pytest.mark.parametrize("name, f", IGNORE, ids=[c[0] for c in IGNORE])
@pytest.mark.parametrize("made", ["inside", "argument"])
def test_a_numpy_ignore_index_compiles_to_one_graph(name, f, made):
    """A review: a numpy ``ignore_index`` failed fullgraph=True ("Unsupported ndarray attribute access": the check read
    its dtype's kind, which dynamo refuses for the numpy value it traces as a tensor) where F.cross_entropy compiles.
    Now one graph, the eager result; a float or bool ignore_index is still the eager TypeError."""
    x = torch.randn(2, 8) if name == "lce" else torch.randn(4, 7)
    want = f(x, 3)
    g = (lambda t: f(t, np.int64(3))) if made == "inside" else (lambda t: f(t, N8 - 5))
    dynamo.reset()
    torch.testing.assert_close(torch.compile(g, backend="eager", fullgraph=True)(x), want)
    for bad, kind in ((np.float32(3), "float32"), (np.True_, "bool"), (3.0, "float"), (True, "bool")):
        with pytest.raises(TypeError, match=f"^ignore_index: expected an int, got {kind}$"):
            f(x, bad)
        dynamo.reset()
        with pytest.raises(TypeError, match="^ignore_index: expected an int, got "):
            torch.compile(lambda t: f(t, bad), backend="eager")(x)


F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
# (x, weight, bias) dtypes: the review's pairs first, then others the docs promise (parameters independent of x's)
MIXED = [(F32, F16, F16), (F16, F64, F64), (F32, F64, F64), (F64, F32, F32), (BF16, F32, BF16), (F16, BF16, BF16),
         (BF16, F32, F32), (F16, F32, None), (F32, None, BF16), (F64, F16, None), (BF16, BF16, F16), (F32, F32, F32)]


def _mixed_args(xd, wd, bd, device="cpu"):
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(4, 5, generator=g) * 3 + 1, torch.rand(5, generator=g) + 0.5, torch.randn(5, generator=g))
    return (x.to(device, xd), None if wd is None else w.to(device, wd), None if bd is None else b.to(device, bd))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("autocast", [False, True], ids=["", "cpu-autocast"])
@pytest.mark.parametrize("dtypes", MIXED, ids=["-".join(str(d).replace("torch.", "") for d in m) for m in MIXED])
def test_a_compiled_layer_norm_takes_mixed_parameter_dtypes_as_eager_mode(dtypes, autocast, backend):
    """A review: under torch.compile layer_norm / mixed_fused_layer_norm passed the parameters to F.layer_norm as they
    were, which refuses most mixes ("mixed dtype"), where eager mode's reference path upcasts them. The compiled call
    now gives eager mode's values and dtype, in one graph (same-dtype parameters still go to F.layer_norm alone)."""
    args = _mixed_args(*dtypes)
    for f in (lambda a, w, b: pf.layer_norm(a, 5, w, b), lambda a, w, b: pf.mixed_fused_layer_norm(a, (5,), w, b)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            want = f(*args)
            dynamo.reset()
            got = torch.compile(f, backend=backend, fullgraph=True)(*args)
        torch.testing.assert_close(got, want)   # (and its dtype)
    dynamo.reset()
    explained = dynamo.explain(f)(*args)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")   # (PyTorch's, as it takes the mix)
@pytest.mark.parametrize("dtypes", [(F32, F16), (F16, F32), (BF16, F64), (F64, BF16)], ids=str)
@pytest.mark.parametrize("cast_before_weight", [False, True])
def test_a_compiled_rms_norm_takes_mixed_weight_dtypes_as_eager_mode(dtypes, cast_before_weight):
    """rms_norm's compiled branch, checked for the same defect (F.rms_norm takes the mixes): eager mode's result."""
    x, w, _ = _mixed_args(dtypes[0], dtypes[1], None)
    f = lambda a, w_: pf.rms_norm(a, 5, w_, 1e-6, cast_before_weight=cast_before_weight)   # noqa: E731
    dynamo.reset()
    torch.testing.assert_close(torch.compile(f, backend="aot_eager", fullgraph=True)(x, w), f(x, w))


def test_a_compiled_fused_layer_norm_module_of_half_parameters_takes_fp32_input():
    """The review's module case: torch.compile(FusedLayerNorm(5, dtype=torch.float16))(fp32 x) raised."""
    m = fusion.FusedLayerNorm(5, dtype=torch.float16)
    with torch.no_grad():
        m.weight.uniform_(0.5, 1.5)
        m.bias.normal_()
    x = torch.randn(4, 5)
    want = m(x)
    assert want.dtype == torch.float32
    dynamo.reset()
    torch.testing.assert_close(torch.compile(m, backend="aot_eager", fullgraph=True)(x), want)


def test_a_compiled_linear_cross_entropy_casts_as_eager_mode_under_autocast():
    """Another op's compiled branch with the same defect: fused_linear_cross_entropy casts hidden / weight / bias to
    autocast's dtype in eager mode (fp64 weight too), while the compiled branch left that to autocast, which leaves a
    fp64 weight alone ("expected m1 and m2 to have the same dtype"). The compiled call now casts as eager mode does."""
    h, w, t = torch.randn(3, 8), torch.randn(5, 8, dtype=torch.float64), torch.tensor([1, 4, 0])
    f = lambda a, b: pf.fused_linear_cross_entropy(a, b, t)   # noqa: E731
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = f(h, w)
        dynamo.reset()
        torch.testing.assert_close(torch.compile(f, backend="aot_eager", fullgraph=True)(h, w), want)


@pytest.mark.cuda
@pytest.mark.parametrize("autocast", [False, True], ids=["", "cuda-autocast"])
@pytest.mark.parametrize("dtypes", MIXED, ids=["-".join(str(d).replace("torch.", "") for d in m) for m in MIXED])
def test_a_compiled_layer_norm_takes_mixed_parameter_dtypes_on_cuda(dtypes, autocast):
    """The mixed parameter dtypes on CUDA, without and with CUDA autocast (fp32 output there unless a tensor is fp64:
    the compiled branch's rule, traced_out_dtype, against eager mode's measured one; eager may run a kernel)."""
    args = _mixed_args(*dtypes, device="cuda")
    f = lambda a, w, b: pf.layer_norm(a, 5, w, b)   # noqa: E731
    with torch.autocast("cuda", enabled=autocast):
        want = f(*args)
        dynamo.reset()
        got = torch.compile(f, backend="aot_eager", fullgraph=True)(*args)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
