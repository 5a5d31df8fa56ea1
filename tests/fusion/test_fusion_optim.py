"""CPU: FusedAdam's reference path against torch.optim.AdamW/Adam, state_dicts both ways, clip_grad_norm_."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from adam_reference import adam_state, adam_step64
from tolerances import TOLERANCES

from pipegoose.nn.fusion import dispatch
from pipegoose.nn.fusion.optim import FusedAdam, clip_grad_norm_


def small_model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 33), torch.nn.GELU(), torch.nn.LayerNorm(33),
                               torch.nn.Linear(33, 5)).to(dtype)


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 12, generator=g), torch.randn(16, 5, generator=g)) for _ in range(n)]


def train(model, opt, data, dtype):
    losses = []
    for x, t in data:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), t)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("dtype,adam_w_mode", [(torch.float32, True), (torch.bfloat16, True), (torch.float32, False)])
def test_fused_adam_reference_matches_torch_over_100_steps(dtype, adam_w_mode):
    m1, m2 = small_model(dtype), small_model(dtype)
    hp = dict(lr=3e-3, betas=(0.9, 0.98), eps=1e-7, weight_decay=0.05)
    o1 = FusedAdam(m1.parameters(), adam_w_mode=adam_w_mode, **hp)
    o2 = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(m2.parameters(), **hp)
    data = batches(100)
    l1, l2 = train(m1, o1, data, dtype), train(m2, o2, data, dtype)
    assert l1[-1] < l1[0]  # it trains
    # same functional math on the reference path: equal up to summation order
    torch.testing.assert_close(torch.tensor(l1), torch.tensor(l2), **TOLERANCES[dtype])
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p1, p2, **TOLERANCES[dtype])
        s1, s2 = o1.state[p1], o2.state[p2]
        assert set(s1) == set(s2) == {"step", "exp_avg", "exp_avg_sq"}
        assert s1["step"].item() == s2["step"].item() == 100
        assert s1["exp_avg"].dtype == dtype
    assert dispatch.stats()["adam"] == {"torch": 100 * 1}  # one bucket per step on the CPU


def test_fused_adam_without_bias_correction_matches_float64_math():
    torch.manual_seed(3)
    p = torch.nn.Parameter(torch.randn(40))
    p64 = p.detach().double().clone()
    m = torch.zeros(40, dtype=torch.float64)
    v = torch.zeros(40, dtype=torch.float64)
    opt = FusedAdam([p], lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1, bias_correction=False)
    for _ in range(20):
        g = torch.randn(40)
        p.grad = g.clone()
        opt.step()
        p64.mul_(1 - 1e-2 * 0.1)
        m = 0.8 * m + 0.2 * g.double()
        v = 0.9 * v + 0.1 * g.double() ** 2
        p64 -= 1e-2 * m / (v.sqrt() + 1e-6)
    torch.testing.assert_close(p.detach().double(), p64, **TOLERANCES[torch.float32])


def test_state_dict_loads_both_ways():
    data = batches(10)
    # FusedAdam -> AdamW
    m1 = small_model()
    o1 = FusedAdam(m1.parameters(), lr=1e-2, weight_decay=0.01)
    train(m1, o1, data[:5], torch.float32)
    m2 = copy.deepcopy(m1)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, weight_decay=0.01)
    o2.load_state_dict(copy.deepcopy(o1.state_dict()))  # as through torch.save/load
    assert o2.param_groups[0]["decoupled_weight_decay"] and not o2.param_groups[0]["amsgrad"]
    train(m1, o1, data[5:], torch.float32)
    train(m2, o2, data[5:], torch.float32)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, **TOLERANCES[torch.float32])
    # AdamW -> FusedAdam
    m3 = small_model(seed=5)
    o3 = torch.optim.AdamW(m3.parameters(), lr=1e-2, weight_decay=0.01)
    train(m3, o3, data[:5], torch.float32)
    m4 = copy.deepcopy(m3)
    o4 = FusedAdam(m4.parameters(), lr=1e-2, weight_decay=0.01)
    o4.load_state_dict(copy.deepcopy(o3.state_dict()))
    assert o4.param_groups[0]["adam_w_mode"] and o4.param_groups[0]["bias_correction"]
    train(m3, o3, data[5:], torch.float32)
    train(m4, o4, data[5:], torch.float32)
    for a, b in zip(m3.parameters(), m4.parameters()):
        torch.testing.assert_close(a, b, **TOLERANCES[torch.float32])
        assert o4.state[b]["step"].item() == 10


def test_fused_adam_errors():
    p = [torch.nn.Parameter(torch.randn(3))]
    with pytest.raises(ValueError, match="amsgrad"):
        FusedAdam(p, amsgrad=True)
    with pytest.raises(ValueError, match="capturable"):
        FusedAdam(p, capturable=True)
    with pytest.raises(ValueError, match="betas"):
        FusedAdam(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr"):
        FusedAdam(p, lr=-1.0)
    o = torch.optim.AdamW(p, amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        FusedAdam(p).load_state_dict(o.state_dict())
    fo = FusedAdam(p, lr=0.5)
    with pytest.raises(ValueError, match="maximize"):
        fo.load_state_dict(torch.optim.AdamW(p, lr=0.1, maximize=True).state_dict())
    assert fo.param_groups[0]["lr"] == 0.5  # refused before anything was loaded
    fo.param_groups[0]["maximize"] = True
    p[0].grad = torch.ones(3)
    with pytest.raises(ValueError, match="maximize"):
        fo.step()
    emb = torch.nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        FusedAdam(emb.parameters()).step()


def test_fused_adam_closure_and_params_without_grad():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = FusedAdam([a, b], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (a * 2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 6.0
    assert torch.all(a < 1) and torch.equal(b, torch.ones(3)) and b not in opt.state


def _grads(dtypes, seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = []
    for i, dt in enumerate(dtypes):
        p = torch.nn.Parameter(torch.zeros(7 + 13 * i, dtype=dt))
        p.grad = (torch.randn(p.shape, generator=g) * (i + 1)).to(dt)
        ps.append(p)
    return ps


@pytest.mark.parametrize("dtypes", [[torch.float32] * 3, [torch.float16, torch.float32, torch.bfloat16],
                                    [torch.bfloat16] * 2,
                                    # torch takes the groups in its own order (not first appearance), and its
                                    # total's last bit depends on it (a review: 1 ulp off with fp32 before fp16)
                                    [torch.float32, torch.float16], [torch.float32, torch.bfloat16, torch.float16]])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_grad_norm_matches_torch(dtypes, norm_type, max_norm):
    p1, p2 = _grads(dtypes), _grads(dtypes)
    n1 = clip_grad_norm_(p1, max_norm, norm_type)
    n2 = torch.nn.utils.clip_grad_norm_(p2, max_norm, norm_type)
    assert n1.dtype == n2.dtype and n1.shape == n2.shape == ()
    torch.testing.assert_close(n1, n2, rtol=0, atol=0)
    for a, b in zip(p1, p2):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    if max_norm < 1:  # clipping happened
        clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.double(), norm_type)
                                                        for p in p1]), norm_type)
        assert clipped.item() == pytest.approx(max_norm, rel=2e-2)
    assert set(dispatch.stats()["clip_grad_norm"]) == {"torch"}


def test_clip_grad_norm_warns_for_an_empty_generator_as_torch():
    """torch warns where ``parameters`` is a generator that yields nothing (model.parameters() used up before);
    the warning points at the caller."""
    for fn in (torch.nn.utils.clip_grad_norm_, clip_grad_norm_):
        with pytest.warns(UserWarning, match="`parameters` is an empty generator, no gradient clipping will occur") \
                as rec:
            assert fn((p for p in []), 1.0).item() == 0.0
        assert rec[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clip_grad_norm_([], 1.0)   # a list: no warning, as torch


def test_clip_grad_norm_checks_impl_on_every_call():
    """A bad ``impl`` is a ValueError also where no parameter has a gradient (a review: it passed until the first
    gradient)."""
    p = torch.nn.Parameter(torch.ones(3))
    for bad, err in (("bogus", ValueError), (3, TypeError)):
        with pytest.raises(err, match="impl"):
            clip_grad_norm_([p], 1.0, impl=bad)
        with pytest.raises(err, match="impl"):
            clip_grad_norm_([], 1.0, impl=bad)
    assert clip_grad_norm_([p], 1.0, impl="Torch").item() == 0.0


@pytest.mark.parametrize("value", ["nope", "megatron", "torch,apex"])
def test_clip_grad_norm_checks_its_variable_without_a_gradient(monkeypatch, value):
    """A bad PIPEGOOSE_IMPL_CLIP_GRAD_NORM is the same ValueError with and without a gradient (a review: without one
    the call returned tensor(0.) and said nothing)."""
    monkeypatch.setenv("PIPEGOOSE_IMPL_CLIP_GRAD_NORM", value)
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match=f"PIPEGOOSE_IMPL_CLIP_GRAD_NORM='{value}': clip_grad_norm has no "):
        clip_grad_norm_([p], 1.0)
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match=f"PIPEGOOSE_IMPL_CLIP_GRAD_NORM='{value}': clip_grad_norm has no "):
        clip_grad_norm_([p], 1.0)


def test_clip_grad_norm_of_empty_gradients_is_no_fallback_in_strict_mode():
    """Gradients of no elements: the reference returns 0 (source ``empty``), which strict mode does not count as a
    fallback (a review: it raised FusionFallbackError, where the README says an input of no elements is none)."""
    p = torch.nn.Parameter(torch.zeros(0))
    p.grad = torch.zeros(0)
    with dispatch.strict():
        total = clip_grad_norm_([p], 1.0)
    assert total.item() == 0.0 and dispatch.last_choice("clip_grad_norm").source == "empty"


def test_explain_of_clip_checks_norm_type_as_clip_grad_norm_does():
    g = torch.randn(4)
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = g.clone()
    for bad, err, match in (("two", TypeError, "norm_type: expected a number, got 'two'"),
                            (float("nan"), ValueError, "norm_type: expected a number .* got nan")):
        with pytest.raises(err, match=match):
            dispatch.explain("clip_grad_norm", [g], bad)
        with pytest.raises(err, match=match):
            clip_grad_norm_([p], 1.0, bad)
    assert dispatch.explain("clip_grad_norm", [g], "inf").impl == "torch"


def test_fused_adam_with_a_tensor_lr_matches_adamw_bit_for_bit():
    """A 0-d tensor lr: torch's AdamW computes with it as a tensor; so does the reference path (a review: it took
    float(lr), matching neither torch's tensor-lr nor its float-lr results)."""
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(1000))
    b = torch.nn.Parameter(a.detach().clone())
    oa = torch.optim.AdamW([a], lr=torch.tensor(1e-2))
    ob = FusedAdam([b], lr=torch.tensor(1e-2), weight_decay=0.01)
    for _ in range(5):
        g = torch.randn(1000)
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    assert torch.equal(a, b)
    assert torch.equal(oa.state[a]["exp_avg_sq"], ob.state[b]["exp_avg_sq"])


def test_clip_grad_norm_edges():
    assert clip_grad_norm_([torch.nn.Parameter(torch.ones(2))], 1.0).item() == 0.0  # no grads
    p = _grads([torch.float32])
    p[0].grad[0] = float("nan")
    before = p[0].grad.clone()
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(p, 1.0, error_if_nonfinite=True)
    torch.testing.assert_close(p[0].grad, before, equal_nan=True)
    n = clip_grad_norm_(p[0], 1.0)  # a single tensor is accepted, nan propagates as in torch
    assert n.isnan() and p[0].grad.isnan().all()


def test_fused_adam_checks_impl_and_param_groups_when_they_are_given():
    """FusedAdam(impl="bogus") was built and failed at the first step(); add_param_group took lr=nan and betas
    (2.0, 5.0), and step() then failed with a complex-dtype cast error. Now both raise at once, naming the argument,
    and a refused group is not added."""
    from pipegoose.nn.fusion.optim import FusedAdam

    p = [torch.nn.Parameter(torch.randn(3))]
    with pytest.raises(ValueError, match="impl: adam has no implementation 'bogus'"):
        FusedAdam(p, impl="bogus")
    with pytest.raises(ValueError, match="lr: expected a finite number >= 0, got nan"):
        FusedAdam(p, lr=float("nan"))
    opt = FusedAdam(p)
    extra = torch.nn.Parameter(torch.randn(2))
    for group, err, match in (({"lr": float("nan")}, ValueError, "lr: expected a finite number >= 0"),
                              ({"betas": (2.0, 5.0)}, ValueError, r"betas: expected two values in \[0, 1\)"),
                              # a string shown as a string (it read "got 0.9"; a fresh-clone walkthrough)
                              ({"betas": "0.9"}, ValueError, r"betas: expected two values in \[0, 1\), got '0.9'"),
                              ({"eps": "1e-8"}, TypeError, "eps: expected a number"),
                              ({"impl": "nope"}, ValueError, "impl: adam has no implementation 'nope'")):
        with pytest.raises(err, match=match):
            opt.add_param_group({"params": [extra], **group})
        assert len(opt.param_groups) == 1
    with pytest.raises(TypeError, match="expected floating point parameters, got torch.int32"):
        opt.add_param_group({"params": [torch.zeros(2, dtype=torch.int32)]})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [extra], "lr": torch.tensor(0.1), "impl": "torch"})
    assert len(opt.param_groups) == 2


def test_fused_adam_group_checks_cover_named_params_the_callers_dict_and_loaded_state():
    """Review of the change above: (name, tensor) pairs, which torch takes, skipped the dtype check; the group added
    was a copy of the caller's dict (torch keeps the dict itself); load_state_dict took a group with a bad impl, which
    then failed at step()."""
    from pipegoose.nn.fusion.optim import FusedAdam

    with pytest.raises(TypeError, match="expected floating point parameters, got torch.int32"):
        FusedAdam([("w", torch.zeros(2, dtype=torch.int32))])
    with pytest.raises(TypeError, match="complex"):
        FusedAdam([("w", torch.zeros(2, dtype=torch.complex64))])
    opt = FusedAdam([torch.nn.Parameter(torch.randn(3))])
    group = {"params": [torch.nn.Parameter(torch.randn(2))]}
    opt.add_param_group(group)
    assert opt.param_groups[-1] is group and group["lr"] == 1e-3
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["impl"] = "bogus"
    with pytest.raises(ValueError, match="impl: adam has no implementation 'bogus'"):
        opt.load_state_dict(sd)
    sd["param_groups"][0]["impl"] = None
    sd["param_groups"][1]["lr"] = float("nan")
    with pytest.raises(ValueError, match="lr: expected a finite number >= 0, got nan"):
        opt.load_state_dict(sd)
    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))])
    FusedAdam([torch.nn.Parameter(torch.randn(3))]).load_state_dict(adamw.state_dict())   # still loads


def test_fused_adam_refuses_unsupported_flags_per_group_and_takes_numpy_numbers():
    """Second review: amsgrad / maximize / capturable set in a param group were taken (and failed at step(), or for
    capturable never); a numpy lr was a TypeError (torch.optim.AdamW takes it); a two-element lr tensor a bare
    ValueError."""
    import numpy as np

    from pipegoose.nn.fusion.optim import FusedAdam

    p = torch.nn.Parameter(torch.randn(3))
    for flag in ("amsgrad", "maximize", "capturable"):
        with pytest.raises(ValueError, match=f"{flag}: a param group with {flag}=True is not supported"):
            FusedAdam([{"params": [p], flag: True}])
    assert FusedAdam([p], lr=np.float32(1e-3)).param_groups[0]["lr"] == np.float32(1e-3)
    with pytest.raises(ValueError, match=r"lr: expected a number or a one-element tensor, got shape \[2\]"):
        FusedAdam([p], lr=torch.tensor([1e-3, 2e-3]))


@pytest.mark.parametrize("flag", ["adam_w_mode", "bias_correction", "amsgrad", "capturable"])
def test_fused_adam_switches_must_be_bools(flag):
    """A walkthrough found adam_w_mode="no" running AdamW (bool("no") is True), bias_correction="no" correcting, and
    amsgrad="no" refused as if AMSGrad were asked for: a switch that is not True or False is a TypeError naming it, in
    the constructor and in a param group."""
    from pipegoose.nn.fusion.optim import FusedAdam

    p = torch.nn.Parameter(torch.randn(3))
    # (adam_w_mode=None is "not given" since decoupled_weight_decay may say it instead: session 38's walkthrough)
    for bad in ("no", 0, torch.tensor(False)) + ((None,) if flag != "adam_w_mode" else ()):
        with pytest.raises(TypeError, match=rf"{flag}: expected True or False, got "):
            FusedAdam([p], **{flag: bad})
        with pytest.raises(TypeError, match=rf"{flag}: expected True or False, got "):
            FusedAdam([{"params": [p], flag: bad}])
    with pytest.raises(TypeError, match=r"maximize: expected True or False, got 'no'"):
        FusedAdam([{"params": [p], "maximize": "no"}])
    FusedAdam([p], adam_w_mode=False, bias_correction=False)  # the bools still work
    assert FusedAdam([p], adam_w_mode=None).param_groups[0]["adam_w_mode"] is True


def test_fused_adam_takes_adamw_arguments_and_keeps_one_weight_decay_mode():
    """A walkthrough replacing torch.optim.AdamW: foreach/fused/maximize/differentiable were TypeErrors, AdamW's sixth
    positional argument (amsgrad) set adam_w_mode here, and a group's adam_w_mode and decoupled_weight_decay (the key
    AdamW follows) drifted apart, so a state dict loaded into AdamW took the other mode (0.18 apart after 3 steps)."""
    from pipegoose.nn.fusion.optim import FusedAdam

    p = torch.nn.Parameter(torch.randn(5))
    FusedAdam([p], foreach=True, fused=False, maximize=False, differentiable=False)
    for name in ("maximize", "differentiable"):
        with pytest.raises(ValueError, match=rf"{name}: {name}=True is not supported"):
            FusedAdam([p], **{name: True})
    with pytest.raises(TypeError, match="foreach: expected None, True or False"):
        FusedAdam([p], foreach="yes")
    with pytest.raises(TypeError, match="positional"):
        FusedAdam([p], 1e-3, (0.9, 0.999), 1e-8, 0.01, False)
    # one setting, two names: either gives both, in the constructor and in a group
    for kw, want in (({"decoupled_weight_decay": False}, False), ({"adam_w_mode": False}, False), ({}, True)):
        g = FusedAdam([p], **kw).param_groups[0]
        assert g["adam_w_mode"] is want and g["decoupled_weight_decay"] is want, kw
        g = FusedAdam([{"params": [p], **kw}]).param_groups[0]
        assert g["adam_w_mode"] is want and g["decoupled_weight_decay"] is want, kw
    with pytest.raises(ValueError, match="adam_w_mode=True and decoupled_weight_decay=False"):
        FusedAdam([p], adam_w_mode=True, decoupled_weight_decay=False)
    # L2 mode (adam_w_mode=False) carries into torch.optim.Adam, which follows decoupled_weight_decay: both take the
    # same steps (torch.optim.AdamW sets decoupled_weight_decay=True on every group it loads, by design)
    o = FusedAdam([{"params": [p], "adam_w_mode": False}], lr=0.1, weight_decay=0.5)
    p.grad = torch.ones(5)
    o.step()
    q = torch.nn.Parameter(p.detach().clone())
    a = torch.optim.Adam([q])
    a.load_state_dict(copy.deepcopy(o.state_dict()))  # (a loaded state shares the tensors it was given)
    for _ in range(3):
        p.grad, q.grad = torch.ones(5), torch.ones(5)
        o.step()
        a.step()
    torch.testing.assert_close(p, q)
    # a group edited by hand into two modes is refused at the step, naming both
    o.param_groups[0]["adam_w_mode"] = True
    with pytest.raises(ValueError, match="adam_w_mode=True and decoupled_weight_decay=False"):
        o.step()


def test_clip_grad_norm_takes_torchs_foreach_argument():
    """torch.nn.utils.clip_grad_norm_(..., foreach=True) was a TypeError here (a walkthrough: "drop-in")."""
    ps = [torch.nn.Parameter(torch.randn(4)) for _ in range(2)]
    for p in ps:
        p.grad = torch.full((4,), 3.0)
    total = clip_grad_norm_(ps, 1.0, 2.0, False, True)
    torch.testing.assert_close(total, torch.tensor(72.0).sqrt())  # 8 gradients of 3
    with pytest.raises(TypeError, match="foreach: expected None, True or False"):
        clip_grad_norm_(ps, 1.0, foreach="yes")


def test_fused_adam_weight_decay_mode_of_loaded_and_none_groups():
    """A review of the one-setting rule: a group given adam_w_mode=None kept None and stepped in L2 mode (bool(None))
    while saying decoupled; a FusedAdam state dict saved before the rule (adam_w_mode=False beside
    decoupled_weight_decay=True) no longer loaded; an older torch.optim.Adam state dict (neither key) turned L2 into
    decoupled. Loading takes adam_w_mode, else decoupled_weight_decay, else the loading optimizer's own mode."""
    from pipegoose.nn.fusion.optim import FusedAdam

    a, b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
    o = FusedAdam([a], lr=0.1, weight_decay=0.1)
    o.add_param_group(dict(params=[b], adam_w_mode=None))
    assert (o.param_groups[1]["adam_w_mode"], o.param_groups[1]["decoupled_weight_decay"]) == (True, True)
    old = copy.deepcopy(o.state_dict())            # as saved before the rule
    old["param_groups"][1]["adam_w_mode"] = False  # (its step read adam_w_mode)
    o.load_state_dict(old)
    assert (o.param_groups[1]["adam_w_mode"], o.param_groups[1]["decoupled_weight_decay"]) == (False, False)
    assert old["param_groups"][1]["decoupled_weight_decay"] is True   # the caller's dict is left as it was
    legacy = copy.deepcopy(torch.optim.Adam([torch.nn.Parameter(torch.randn(4))], weight_decay=0.1).state_dict())
    for g in legacy["param_groups"]:
        g.pop("decoupled_weight_decay", None)
    l2 = FusedAdam([torch.nn.Parameter(torch.randn(4))], adam_w_mode=False)
    l2.load_state_dict(legacy)
    assert l2.param_groups[0]["adam_w_mode"] is False and l2.param_groups[0]["decoupled_weight_decay"] is False
    restored = copy.deepcopy(l2)   # pickling goes through __setstate__ too
    assert restored.param_groups[0]["adam_w_mode"] is False
    bad = copy.deepcopy(l2.state_dict())
    bad["param_groups"][0]["adam_w_mode"] = "no"   # a loaded switch is still checked, not read as bool("no")
    with pytest.raises(TypeError, match="adam_w_mode: expected True or False, got 'no'"):
        l2.load_state_dict(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("step,beta2", [(7, 0.95), (1, 0.999)])
def test_torch_fused_adam_step_matches_float64_math(dtype, adam_w_mode, step, beta2):
    """The ``torch_fused`` implementation's call (torch._fused_adamw_ / _fused_adam_, which torch also has on the CPU):
    lr, betas, eps, weight decay, the mode and the bucket's step count reach the kernel as meant. One step over tensors
    of odd sizes from random moments against the float64 math: p, exp_avg and exp_avg_sq. (At step 1 with beta2 0.999
    the bias correction scales the update by 0.32: a wrong step count fails in every dtype.)"""
    from pipegoose.nn.fusion.ops import multi_tensor as mt

    shapes = [(1,), (7,), (33, 31), (1000 + 3,)]
    ps, gs, ms, vs = adam_state(shapes, dtype, seed=5)
    want = [adam_step64(*t, step, 0.05, (0.9, beta2), 1e-8, 0.1, adam_w_mode) for t in zip(ps, gs, ms, vs)]
    mt.adam_step_fused("torch_fused", gs, ps, ms, vs, step=step, adam_w_mode=adam_w_mode, bias_correction=True,
                       lr=0.05, beta1=0.9, beta2=beta2, eps=1e-8, weight_decay=0.1)
    for i, (wp, wm, wv) in enumerate(want):
        for got, ref, what in ((ps[i], wp, "param"), (ms[i], wm, "exp_avg"), (vs[i], wv, "exp_avg_sq")):
            torch.testing.assert_close(got.double(), ref, **TOLERANCES[dtype], msg=lambda e: f"{what}[{i}]: {e}")
    with pytest.raises(ValueError, match="bias_correction"):
        mt.adam_step_fused("torch_fused", gs, ps, ms, vs, step=8, adam_w_mode=True, bias_correction=False,
                           lr=0.05, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("name", ["pipegoose", "torch_fused"])
def test_adam_kernels_decline_what_they_cannot_run(name):
    """Ours and ``torch_fused`` come first in the built-in order on a GPU; each must decline, with the reason, what its
    kernel would read wrongly (lists of mixed dtypes: both read the four lists in one dtype) or cannot do."""
    from pipegoose.nn.fusion.ops import multi_tensor as mt

    order = list(dispatch.implementations("adam"))
    assert order[:2] == ["pipegoose", "torch_fused"]
    impl = dispatch.implementations("adam")[name]
    assert impl.kind == {"pipegoose": "ours", "torch_fused": "native"}[name]
    bf = [torch.zeros(4, 3, dtype=torch.bfloat16)]

    def on_gpu(problem):   # the same facts, on a CUDA device (the checks read metadata only)
        return dispatch.Problem(problem.op, problem.dtype, torch.device("cuda", 0), problem.cols, False, problem.extra)

    assert impl.supports(on_gpu(mt.adam_problem(bf, bf, bf, bf))) == (True, "")
    assert "needs CUDA" in impl.supports(mt.adam_problem(bf, bf, bf, bf))[1]
    ok, why = impl.supports(on_gpu(mt.adam_problem([torch.zeros(4, 3)], bf, bf, bf)))
    assert not ok and "one dtype" in why
    ok, why = impl.supports(on_gpu(mt.adam_problem(bf, bf, bf, bf, bias_correction=False)))
    assert ok is (name == "pipegoose") and ("bias_correction=False" in why) is (name == "torch_fused")
    t = [torch.zeros(4, 3, dtype=torch.bfloat16).t()]
    ok, why = impl.supports(on_gpu(mt.adam_problem(t, t, t, t)))
    assert not ok and "contiguous" in why
    i64 = [torch.zeros(3, dtype=torch.int64)]
    ok, why = impl.supports(on_gpu(mt.adam_problem(i64, i64, i64, i64)))
    assert not ok and "int64" in why


def test_explain_takes_one_buckets_lists_and_names_a_bad_argument():
    """A walkthrough: explain("adam", g, p, m, v) with tensors for lists gave "Boolean value of Tensor ... ambiguous",
    empty lists a bare IndexError, lists of unequal length no complaint; neither call was documented."""
    g = [torch.randn(3), torch.randn(4)]
    c = dispatch.explain("adam", g, g, g, g)
    assert c.impl == "torch" and "needs CUDA" in c.reasons["pipegoose"]
    assert dispatch.explain("clip_grad_norm", g, 2.0).impl == "torch"
    with pytest.raises(TypeError, match="grads: expected a list of tensors"):
        dispatch.explain("adam", g[0], g[0], g[0], g[0])
    with pytest.raises(TypeError, match="params: expected a non-empty list of tensors"):
        dispatch.explain("adam", g, [], g, g)
    with pytest.raises(ValueError, match="exp_avg_sqs: 1 tensors, but grads has 2"):
        dispatch.explain("adam", g, g, g, g[:1])
    with pytest.raises(TypeError, match="grads: expected a list of tensors"):
        dispatch.explain("clip_grad_norm", g[0])
    with pytest.raises(TypeError, match=r"grads\[1\] is NoneType: expected a list of tensors \(a parameter without a "
                                        r"gradient: leave it out\)"):
        dispatch.explain("clip_grad_norm", [g[0], None])
    with pytest.raises(TypeError, match=r"params\[0\] is int: expected a list of tensors$"):
        dispatch.explain("adam", g, [1, 2], g, g)


def _sparse_embedding_params(seed=0):
    torch.manual_seed(seed)
    emb = torch.nn.Embedding(10, 3, sparse=True)
    (emb(torch.tensor([1, 2])) * 10).sum().backward()
    dense = torch.nn.Parameter(torch.zeros(4, 3))
    dense.grad = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed)) * 5
    return [emb.weight, dense]


@pytest.mark.parametrize("which", [slice(0, 1), slice(0, 2), slice(None, None, -1)], ids=["sparse", "mixed",
                                                                                          "dense-first"])
def test_clip_grad_norm_takes_sparse_gradients_as_torch(which):
    """A sparse gradient (nn.Embedding(sparse=True)) crashed with "Cannot access data pointer of Tensor that doesn't
    have storage" (the overlap check read every gradient's data pointer, also with impl="torch"; a review). Now its
    group takes torch's path, whole, and the result is torch.nn.utils.clip_grad_norm_'s, alone or beside dense ones."""
    for impl in (None, "torch"):
        p1, p2 = _sparse_embedding_params()[which], _sparse_embedding_params()[which]
        n1 = clip_grad_norm_(p1, 1.0, impl=impl)
        n2 = torch.nn.utils.clip_grad_norm_(p2, 1.0)
        assert torch.equal(n1, n2)
        if which == slice(0, 1):
            assert n1.item() == pytest.approx(24.4949, abs=1e-4)   # six gradients of 10
        for a, b in zip(p1, p2):
            assert a.grad.layout == b.grad.layout
            assert torch.equal(a.grad.to_dense(), b.grad.to_dense())
    assert set(dispatch.stats()["clip_grad_norm"]) == {"torch"}


def test_sparse_gradients_are_a_fallback_with_their_reason():
    """explain() of a sparse gradient crashed as clip_grad_norm_ did; now every kernel declines a group holding one
    (any layout but strided), with that reason, as it declines other inputs it cannot take: a fallback, which strict
    mode refuses (here on the CPU too)."""
    from pipegoose.nn.fusion.ops import multi_tensor as mt

    dense = torch.randn(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # torch: "Sparse CSR tensor support is in beta state"
        csr = torch.randn(4, 3).to_sparse_csr()
    for sparse in (torch.randn(4, 3).to_sparse(), csr):
        c = dispatch.explain("clip_grad_norm", [sparse])
        assert c.impl == "torch" and c.fallback
        problem = mt.clip_problem([dense, sparse], 2.0)
        on_gpu = dispatch.Problem(problem.op, problem.dtype, torch.device("cuda", 0), problem.cols, False,
                                  problem.extra)
        for name in ("pipegoose", "apex"):
            ok, why = dispatch.implementations("clip_grad_norm")[name].supports(on_gpu)
            assert not ok and why.startswith(f"a tensor has layout {sparse.layout} (a sparse gradient)"), why
    ps = _sparse_embedding_params()
    with dispatch.strict(), pytest.raises(dispatch.FusionFallbackError, match="clip_grad_norm: strict mode"):
        clip_grad_norm_(ps, 1.0)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_fused_adam_with_tensor_betas_matches_adamw_bit_for_bit(weight_decay):
    """Tensor betas were read as Python floats before the step on the reference path, 3e-8 off torch.optim.AdamW after
    5 steps (which computes with them as tensors; a review). Now bit-equal, as for a tensor lr."""
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(50)) for _ in range(2)]
    b = [torch.nn.Parameter(x.detach().clone()) for x in a]
    betas = (torch.tensor(0.8), torch.tensor(0.95))
    oa = torch.optim.AdamW(a, lr=0.01, betas=betas, weight_decay=weight_decay)
    ob = FusedAdam(b, lr=0.01, betas=betas, weight_decay=weight_decay)
    for _ in range(5):
        for x, y in zip(a, b):
            g = torch.randn(50)
            x.grad, y.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    for x, y in zip(a, b):
        assert torch.equal(x, y)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(oa.state[x][k], ob.state[y][k]), k
    # one-element tensors are kept 0-d, as torch keeps them
    g = FusedAdam(b, betas=(torch.tensor([0.8]), torch.tensor([0.9]))).param_groups[0]
    assert [t.shape for t in g["betas"]] == [torch.Size([])] * 2


def test_fused_adam_refuses_one_tensor_beta_as_torch():
    """betas=(tensor, float) was taken; torch.optim.AdamW refuses it ("betas must be either both floats or both
    Tensors"): so does FusedAdam, naming betas, in the constructor and in a param group (a review). A beta tensor of
    several elements is the ValueError about betas (it was a bare RuntimeError of float())."""
    p = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="betas must be either both floats or both Tensors"):
        torch.optim.AdamW([p], betas=(torch.tensor(0.8), 0.95))
    for betas in ((torch.tensor(0.8), 0.95), (0.8, torch.tensor(0.95))):
        with pytest.raises(ValueError, match="betas: expected two numbers or two one-element tensors, not one of "
                                             "each"):
            FusedAdam([p], betas=betas)
        with pytest.raises(ValueError, match="betas: expected two numbers or two one-element tensors"):
            FusedAdam([{"params": [p], "betas": betas}])
    with pytest.raises(ValueError, match=r"betas: expected two values in \[0, 1\)"):
        FusedAdam([p], betas=(torch.tensor([0.8, 0.9]), torch.tensor(0.9)))
    FusedAdam([p], betas=(0, 0.9))   # numbers of any kind, as before


def _snapshot(opt):
    """Parameters and state, the state by the parameter's place (two optimizers compare)."""
    ps = [p for g in opt.param_groups for p in g["params"]]
    return ([p.detach().clone() for p in ps],
            {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(ps) if p in opt.state})


def _same(a, b):
    (pa, sa), (pb, sb) = a, b
    assert len(pa) == len(pb) and all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys() and all(torch.equal(sa[k][n], sb[k][n]) for n in sa[k])


def _two_groups(seed=0):
    """Two groups: the first asks for torch (no fallback), the second falls back (a CPU tensor: no kernel takes it)."""
    torch.manual_seed(seed)
    a, b, c = (torch.nn.Parameter(torch.randn(n)) for n in (4, 5, 6))
    opt = FusedAdam([{"params": [a], "impl": "torch"}, {"params": [b, c]}], lr=0.1, weight_decay=0.01)
    return opt, (a, b, c)


def _grads_for(ps, k):
    g = torch.Generator().manual_seed(k)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)


@pytest.mark.parametrize("steps_before", [0, 2])
def test_fused_adam_step_refused_in_strict_mode_changes_nothing(steps_before):
    """A step that failed in strict mode left the optimizer half-stepped: the first group was updated, the second's
    parameters given state (a review). Now every bucket is chosen and the strict check made before anything changes:
    after the FusionFallbackError parameters and state are exactly as before, nothing is counted, and the next step
    (not strict) is the one step a fresh optimizer takes."""
    opt, ps = _two_groups()
    ref, rps = _two_groups()
    for k in range(steps_before):
        _grads_for(ps, k)
        _grads_for(rps, k)
        opt.step()
        ref.step()
    _grads_for(ps, 99)
    _grads_for(rps, 99)
    before = _snapshot(opt)
    dispatch.reset_stats()
    with dispatch.strict(), pytest.raises(dispatch.FusionFallbackError, match="adam: strict mode: would fall back"):
        opt.step()
    _same(_snapshot(opt), before)
    assert len(opt.state) == (3 if steps_before else 0)
    assert dispatch.stats().get("adam", {}) == {}
    assert dispatch.last_choice("adam").fallback   # the refused choice, for explaining it
    opt.step()
    ref.step()
    _same(_snapshot(opt), _snapshot(ref))
    assert dispatch.stats()["adam"] == {"torch": 4}


def test_fused_adam_sparse_gradient_in_a_later_group_changes_nothing():
    """The sparse-gradient RuntimeError of a later group came after the earlier groups were stepped."""
    a = torch.nn.Parameter(torch.randn(4))
    emb = torch.nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    a.grad = torch.randn(4)
    opt = FusedAdam([{"params": [a]}, {"params": emb.parameters()}])
    before = _snapshot(opt)
    with pytest.raises(RuntimeError, match="sparse gradients"):
        opt.step()
    _same(_snapshot(opt), before)
    assert len(opt.state) == 0


def test_fused_adam_of_empty_parameters_is_no_fallback_in_strict_mode():
    """A parameter of no elements: FusedAdam raised FusionFallbackError in strict mode, where clip_grad_norm_ of the
    same gradient (nothing to compute) is no fallback (a review). Now a bucket of empty parameters is the dispatcher's
    ``empty`` case as well: the reference counts the step (as torch.optim.AdamW does), strict mode is satisfied. A
    bucket with elements still falls back (here on the CPU)."""
    z = torch.nn.Parameter(torch.zeros(0))
    z.grad = torch.zeros(0)
    opt = FusedAdam([z])
    with dispatch.strict():
        opt.step()
    c = dispatch.last_choice("adam")
    assert c.impl == "torch" and c.source == "empty" and not c.fallback
    assert opt.state[z]["step"].item() == 1 and opt.state[z]["exp_avg"].shape == (0,)
    assert dispatch.explain("adam", [z.grad], [z], [z.grad], [z.grad]).source == "empty"
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    with dispatch.strict(), pytest.raises(dispatch.FusionFallbackError):
        FusedAdam([z, p]).step()


@pytest.mark.parametrize("value", ["nope", "megatron", "torch,apex"])
def test_fused_adam_checks_its_variable_without_a_gradient(monkeypatch, value):
    """A bad PIPEGOOSE_IMPL_ADAM is the same ValueError with and without a gradient (a review: without one step()
    returned and said nothing, as clip_grad_norm_ did before its fix)."""
    monkeypatch.setenv("PIPEGOOSE_IMPL_ADAM", value)
    p = torch.nn.Parameter(torch.ones(3))
    opt = FusedAdam([p])
    with pytest.raises(ValueError, match=f"PIPEGOOSE_IMPL_ADAM='{value}': adam has no "):
        opt.step()
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match=f"PIPEGOOSE_IMPL_ADAM='{value}': adam has no "):
        opt.step()
    assert torch.equal(p, torch.ones(3)) and len(opt.state) == 0
    monkeypatch.setenv("PIPEGOOSE_IMPL_ADAM", "Torch")
    FusedAdam([torch.nn.Parameter(torch.ones(3))]).step()   # a good one, without a gradient


def test_fused_adam_docstring_lists_what_step_raises(monkeypatch):
    """FusedAdam's Raises listed only the RuntimeError of sparse gradients for step(), which also raises
    FusionFallbackError in strict mode and ValueError for a bad PIPEGOOSE_IMPL_ADAM (a review): each is documented,
    and raised."""
    doc = " ".join(FusedAdam.__doc__.split())
    step_doc = doc[doc.index("Raises (from ``step``"):]
    for what in ("RuntimeError: a sparse gradient", "FusionFallbackError: in strict mode",
                 "ValueError: ``PIPEGOOSE_IMPL_ADAM`` naming no implementation of ``adam``"):
        assert what in step_doc, what
    assert "FusionFallbackError" in FusedAdam.step.__doc__ and "PIPEGOOSE_IMPL_ADAM" in FusedAdam.step.__doc__
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    with dispatch.strict(), pytest.raises(dispatch.FusionFallbackError):
        FusedAdam([p]).step()
    monkeypatch.setenv("PIPEGOOSE_IMPL_ADAM", "bogus")
    with pytest.raises(ValueError, match="PIPEGOOSE_IMPL_ADAM"):
        FusedAdam([p]).step()
