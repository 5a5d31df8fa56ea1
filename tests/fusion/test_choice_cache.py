"""CPU: the dispatcher's choice cache (a repeated call skips validation and choice, and is still counted, checked
in strict mode and re-chosen whenever anything the choice depends on changes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipegoose.nn.fusion import dispatch
from pipegoose.nn.fusion import functional as PF
from pipegoose.nn.fusion.dispatch import FusionFallbackError

ENV = ("PIPEGOOSE_STRICT", "PIPEGOOSE_SMALL_NUMEL", "PIPEGOOSE_IMPL_LAYER_NORM", "PIPEGOOSE_IMPL_RMS_NORM", "PIPEGOOSE_IMPL_SOFTMAX",
       "PIPEGOOSE_IMPL_SOFTMAX_MASKED")


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for var in ENV:
        monkeypatch.delenv(var, raising=False)
    dispatch.reset_stats()
    yield
    dispatch.reset_stats()


@pytest.fixture
def chooses(monkeypatch):
    """Counts the calls of dispatch.choose (the slow path)."""
    calls = []
    real = dispatch.choose

    def counting(op, problem, impl=None, check_all=False):
        calls.append((op, problem))
        return real(op, problem, impl, check_all)

    monkeypatch.setattr(dispatch, "choose", counting)
    return calls


def ln_args(requires_grad=True, dtype=torch.float32):
    x = torch.randn(6, 40, dtype=dtype, requires_grad=requires_grad)
    return x, torch.randn(40, requires_grad=True), torch.randn(40, requires_grad=True)


def test_repeated_call_chooses_once_counts_every_call(chooses):
    x, w, b = ln_args()
    for _ in range(3):
        y = PF.layer_norm(x, (40,), w, b, 1e-5)
        torch.testing.assert_close(y, F.layer_norm(x, (40,), w, b, 1e-5), rtol=0, atol=0)
    assert len(chooses) == 1
    assert dispatch.stats()["layer_norm"] == {"torch": 3}


@pytest.mark.parametrize("change", ["shape", "dtype", "grad_mode", "requires_grad", "eps", "weight_dtype"])
def test_a_changed_signature_chooses_again(chooses, change):
    x, w, b = ln_args()
    PF.layer_norm(x, (40,), w, b, 1e-5)
    eps = 1e-5
    if change == "shape":
        x = torch.randn(7, 40, requires_grad=True)
    elif change == "dtype":
        x = x.detach().double().requires_grad_()
    elif change == "requires_grad":
        x = x.detach()
    elif change == "eps":
        eps = 1e-6
    elif change == "weight_dtype":
        w = w.detach().double()
    if change == "grad_mode":
        with torch.no_grad():
            PF.layer_norm(x, (40,), w, b, eps)
    else:
        PF.layer_norm(x, (40,), w, b, eps)
    assert len(chooses) == 2
    assert dispatch.last_choice("layer_norm").op == "layer_norm"


def test_env_request_is_part_of_the_key(monkeypatch, chooses):
    x, w, b = ln_args()
    PF.layer_norm(x, (40,), w, b)
    assert dispatch.last_choice("layer_norm").source == "fallback"  # CPU: no kernel runs, torch falls back
    monkeypatch.setenv("PIPEGOOSE_IMPL_LAYER_NORM", "torch")
    PF.layer_norm(x, (40,), w, b)
    assert dispatch.last_choice("layer_norm").source == "env"
    monkeypatch.setenv("PIPEGOOSE_IMPL_LAYER_NORM", "not-an-impl")
    with pytest.raises(ValueError, match="PIPEGOOSE_IMPL_LAYER_NORM"):
        PF.layer_norm(x, (40,), w, b)
    assert len(chooses) == 3


def test_small_numel_variable_is_part_of_the_key(monkeypatch, chooses):
    x, w, b = ln_args()
    PF.layer_norm(x, (40,), w, b)
    monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "0")
    PF.layer_norm(x, (40,), w, b)
    assert len(chooses) == 2


def test_impl_argument_is_part_of_the_key(chooses):
    x, w, b = ln_args()
    PF.layer_norm(x, (40,), w, b)
    PF.layer_norm(x, (40,), w, b, impl="torch")
    assert dispatch.last_choice("layer_norm").source == "argument"
    with pytest.raises(ValueError, match="impl"):
        PF.layer_norm(x, (40,), w, b, impl="nope")


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "softmax.masked"])
def test_strict_mode_is_checked_on_cached_calls(op):
    x, w, b = ln_args()
    x4 = torch.randn(2, 3, 5, 8)
    mask = torch.zeros(2, 1, 5, 8, dtype=torch.bool)
    call = {"layer_norm": lambda: PF.layer_norm(x, (40,), w, b),
            "rms_norm": lambda: PF.rms_norm(x, (40,), w, 1e-6),
            "softmax.masked": lambda: PF.scaled_masked_softmax(x4, mask, 0.5)}[op]
    call()
    call()  # now cached
    assert dispatch.last_choice(op).fallback  # CPU: the fused paths cannot run
    with dispatch.strict():
        with pytest.raises(FusionFallbackError, match=op):
            call()


def test_bad_arguments_raise_after_a_good_call_was_cached():
    x, w, b = ln_args()
    PF.layer_norm(x, (40,), w, b, 1.0)
    # True == 1.0 as a dict key: the key carries the type, and True is checked (F.layer_norm takes it as 1.0)
    torch.testing.assert_close(PF.layer_norm(x, (40,), w, b, True), F.layer_norm(x, (40,), w, b, 1.0))
    with pytest.raises(TypeError, match="eps: expected a number, got 'a'"):
        PF.layer_norm(x, (40,), w, b, "a")  # as F.layer_norm, a TypeError
    with pytest.raises(TypeError, match="eps: expected a number or None, got 'a'"):
        PF.rms_norm(x, [40], w, "a")
    with pytest.raises(ValueError, match="weight"):
        PF.layer_norm(x, (40,), torch.randn(41), b, 1.0)
    with pytest.raises(TypeError, match="normalized_shape"):
        PF.layer_norm(x, "40", w, b, 1.0)
    PF.rms_norm(x, [40], w, 1e-6)
    with pytest.raises(ValueError, match="eps"):
        PF.rms_norm(x, [40], w, -1.0)


def test_rms_norm_default_eps_is_resolved_once_and_reused(chooses):
    x, w, _ = ln_args()
    y1 = PF.rms_norm(x, (40,), w)
    y2 = PF.rms_norm(x, (40,), w)
    ref = F.rms_norm(x, (40,), w)
    torch.testing.assert_close(y1, ref, rtol=0, atol=0)
    torch.testing.assert_close(y2, ref, rtol=0, atol=0)
    assert len(chooses) == 1


def test_softmax_key_holds_layout_and_mask(chooses):
    x = torch.randn(2, 3, 5, 8)
    mask = torch.rand(2, 1, 5, 8) < 0.3
    PF.scaled_masked_softmax(x, mask, 0.5)
    PF.scaled_masked_softmax(x, mask, 0.5)
    assert len(chooses) == 1
    PF.scaled_masked_softmax(x.transpose(-1, -2).contiguous().transpose(-1, -2), mask, 0.5)  # other strides
    PF.scaled_masked_softmax(x, mask[:1], 0.5)  # other mask shape
    PF.scaled_masked_softmax(x, mask, 0.25)  # other scale
    assert len(chooses) == 4
    y = PF.softmax(x, dim=1)
    torch.testing.assert_close(y, F.softmax(x, dim=1), rtol=0, atol=0)
    PF.softmax(x, dim=-1)
    assert len(chooses) == 6  # dim is part of the plain softmax's key (last_dim)


def test_cache_is_cleared_by_the_documented_calls(chooses):
    x, w, b = ln_args()
    for clear in (dispatch.clear_choice_cache, dispatch.clear_kernel_cache, dispatch.clear_tuning_cache,
                  dispatch.reset_stats):
        PF.layer_norm(x, (40,), w, b)
        n = len(chooses)
        clear()
        PF.layer_norm(x, (40,), w, b)
        assert len(chooses) == n + 1, clear.__name__


def test_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(dispatch, "_MEMO_MAX", 4)
    for n in range(1, 12):
        PF.layer_norm(torch.randn(n, 8), (8,))
    assert len(dispatch._memo) <= 4


def test_compile_tracing_is_not_cached(monkeypatch, chooses):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    x, w, b = ln_args()
    # an implementation asked for: the dispatcher runs while tracing, without the choice cache
    PF.layer_norm(x, (40,), w, b, impl="torch")
    PF.layer_norm(x, (40,), w, b, impl="torch")
    assert len(chooses) == 2
    # nothing asked for: the PyTorch op is emitted for the compiler (dispatch.compile_passthrough), no choice
    torch.testing.assert_close(PF.layer_norm(x, (40,), w, b), torch.nn.functional.layer_norm(x, (40,), w, b))
    assert len(chooses) == 2


def test_environment_reads_are_cheap_and_exact(monkeypatch):
    """The variables read on every call go through dispatch._environ_get: on POSIX a lookup in os.environ's own
    store (not os.environ.get, ~0.8 us), which must see every change made through os.environ, as os.environ.get."""
    import os

    get = dispatch._environ_get
    if os.name == "posix" and isinstance(getattr(os.environ, "_data", None), dict):
        assert get != os.environ.get  # bound methods compare equal, not identical
    var = "PIPEGOOSE_TEST_ENVIRON_GET"
    monkeypatch.delenv(var, raising=False)
    assert get(var) is None and get(var, "d") == "d"
    for value in ("1", " auto ", "", "h\u00e9llo \udcff"):  # a surrogate escape: bytes that are not UTF-8
        monkeypatch.setenv(var, value)
        assert get(var) == os.environ.get(var) == value
    os.environ.pop(var)
    assert get(var, "gone") == "gone"
    monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "7")
    assert dispatch.small_numel() == 7
    monkeypatch.setenv("PIPEGOOSE_STRICT", "yes")
    assert dispatch.is_strict()
    monkeypatch.setenv("PIPEGOOSE_IMPL_LAYER_NORM", "torch")
    assert dispatch._env_request("layer_norm") == ("torch", "PIPEGOOSE_IMPL_LAYER_NORM")


def test_environ_get_without_a_posix_store(monkeypatch):
    """Where os.environ has no encoded store (another platform or Python), os.environ.get itself."""
    import os

    with monkeypatch.context() as m:
        m.setattr(os, "name", "nt")
        assert dispatch._make_environ_get() == os.environ.get
    fake = type("Env", (), {"get": os.environ.get})()  # a mapping without the store
    with monkeypatch.context() as m:
        m.setattr(os, "environ", fake)
        assert dispatch._make_environ_get() == os.environ.get


def test_environ_get_follows_a_replaced_os_environ(monkeypatch):
    """mock.patch("os.environ", {...}) replaces the object: the variables are read from the replacement, as
    os.environ.get did (the fast path bound the store at import)."""
    import os
    from unittest import mock

    with mock.patch("os.environ", {"PIPEGOOSE_STRICT": "yes", "PIPEGOOSE_SMALL_NUMEL": "5"}):
        assert dispatch.is_strict() and dispatch.small_numel() == 5
    assert dispatch._environ_get("PIPEGOOSE_SMALL_NUMEL") == os.environ.get("PIPEGOOSE_SMALL_NUMEL")
