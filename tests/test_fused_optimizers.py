"""FusedAdam / FusedLamb (ort_trainer.optim) on the CPU: parity with torch.optim.Adam / AdamW and
with float64 transcriptions of apex's kernels (csrc/multi_tensor_adam.cu, multi_tensor_lamb.cu),
missing gradients, param groups, state dicts in torch's layout, and every error message."""
import copy
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ort_trainer._optimizers import cpu as _optim_cpu
from ort_trainer.optim import FusedAdam, FusedLamb

SHAPES = [(7, 5), (1,), (300,), (33, 17), (1025,), (4, 3, 2)]
STEPS = 100
RTOL = 1e-5


def make_params(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def two_groups(params, **second):
    return [{"params": params[:2]}, {"params": params[2:], **second}]


def missing(step, index):
    """Which gradients are None: parameter 0 before step 3, parameter 2 every 7th step."""
    return (index == 0 and step < 3) or (index == 2 and step % 7 == 3)


def set_grads(param_lists, step, generator):
    """The same random gradients into each list of parameters (None where ``missing``)."""
    for index, shape in enumerate(SHAPES[:len(param_lists[0])]):
        grad = torch.randn(shape, generator=generator)
        for params in param_lists:
            params[index].grad = None if missing(step, index) else grad.clone()


def rel_err(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


def assert_close(actual_params, expected_params, rtol=RTOL):
    for index, (a, e) in enumerate(zip(actual_params, expected_params)):
        assert rel_err(a.detach().cpu(), torch.as_tensor(e).detach().cpu()) < rtol, index


def assert_same_state(ours, theirs, rtol=RTOL):
    """Same parameters have state, same steps, exp_avg and exp_avg_sq within rtol."""
    ours, theirs = ours.state_dict()["state"], theirs.state_dict()["state"]
    assert sorted(ours) == sorted(theirs)
    for index in theirs:
        assert float(ours[index]["step"]) == float(theirs[index]["step"]), index
        for key in ("exp_avg", "exp_avg_sq"):
            assert rel_err(ours[index][key].cpu(), theirs[index][key].cpu()) < rtol, (index, key)


# ----------------------------------------------------------------------------------------------
# apex's math, transcribed in float64 (independent of ort_trainer._optimizers.reference)
# ----------------------------------------------------------------------------------------------


class ApexMath:
    """apex's FusedAdam / FusedLAMB updates on float64 copies; the step count per parameter (the
    documented difference from apex, whose count is per group)."""

    def __init__(self, params, groups, lamb=False, adam_w_mode=True, max_grad_norm=1.0,
                 use_nvlamb=False):
        self.params = [p.detach().double().numpy().copy() for p in params]
        self.groups = groups  # [(indices, hyper dict)]
        self.m = [np.zeros_like(p) for p in self.params]
        self.v = [np.zeros_like(p) for p in self.params]
        self.t = [0] * len(params)
        self.lamb, self.adam_w_mode = lamb, adam_w_mode
        self.max_grad_norm, self.use_nvlamb = max_grad_norm, use_nvlamb

    def step(self, grads):
        grads = [None if g is None else g.double().numpy() for g in grads]
        clip = 1.0
        if self.lamb:
            norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads if g is not None))
            clip = norm / self.max_grad_norm if norm > self.max_grad_norm else 1.0
        for indices, h in self.groups:
            beta1, beta2 = h["betas"]
            for i in indices:
                if grads[i] is None:
                    continue
                self.t[i] += 1
                c1, c2 = ((1 - beta1 ** self.t[i], 1 - beta2 ** self.t[i]) if h["bias_correction"]
                          else (1.0, 1.0))
                p, g = self.params[i], grads[i] / clip
                if not self.adam_w_mode:  # MODE_0, L2
                    g = g + h["weight_decay"] * p
                self.m[i] = beta1 * self.m[i] + (1 - beta1) * g
                self.v[i] = beta2 * self.v[i] + (1 - beta2) * g * g
                update = (self.m[i] / c1) / (np.sqrt(self.v[i] / c2) + h["eps"])
                if self.adam_w_mode:
                    update = update + h["weight_decay"] * p
                ratio = h["lr"]
                if self.lamb and (self.use_nvlamb or h["weight_decay"] != 0):
                    p_norm, u_norm = np.linalg.norm(p), np.linalg.norm(update)
                    if p_norm != 0 and u_norm != 0:
                        ratio = h["lr"] * p_norm / u_norm
                self.params[i] = p - ratio * update


def run_against_apex_math(optimizer_class, params, groups, steps, **options):
    """Trains ``params`` with the optimizer and ApexMath side by side; returns both."""
    reference = ApexMath(params, [(indices, {**DEFAULT_HYPER[optimizer_class], **hyper})
                                  for indices, hyper in groups],
                         lamb=optimizer_class is FusedLamb, **options)
    optimizer = optimizer_class([{"params": [params[i] for i in indices], **hyper}
                                 for indices, hyper in groups], **options)
    generator = torch.Generator().manual_seed(7)
    for step in range(steps):
        set_grads([params], step, generator)
        reference.step([p.grad for p in params])
        optimizer.step()
    return optimizer, reference


DEFAULT_HYPER = {
    FusedAdam: dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, bias_correction=True),
    FusedLamb: dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, bias_correction=True),
}


# ----------------------------------------------------------------------------------------------
# Parity
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("adam_w_mode,torch_class", [(True, torch.optim.AdamW),
                                                     (False, torch.optim.Adam)])
def test_fused_adam_matches_torch_over_100_steps(adam_w_mode, torch_class):
    """Two groups (own lr, betas, decay), a scheduler giving them different lrs, and gradients
    missing on some steps (so the step counts differ): torch's results, torch's state layout."""
    ours_params, torch_params = make_params(), make_params()
    ours = FusedAdam(two_groups(ours_params, lr=3e-3, betas=(0.8, 0.99), weight_decay=0.1),
                     weight_decay=0.01, adam_w_mode=adam_w_mode)
    theirs = torch_class(two_groups(torch_params, lr=3e-3, betas=(0.8, 0.99), weight_decay=0.1),
                         lr=1e-3, weight_decay=0.01)
    schedule = [lambda step: 1.0 / (1 + step), lambda step: 0.97 ** step]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in (ours, theirs)]
    generator = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        set_grads([ours_params, torch_params], step, generator)
        ours.step()
        theirs.step()
        for scheduler in schedulers:
            scheduler.step()
        if step == 1:  # parameter 0 has had no gradient yet: no state, as in torch
            assert 0 not in ours.state_dict()["state"]
    assert_close(ours_params, torch_params)
    assert_same_state(ours, theirs)
    assert float(ours.state_dict()["state"][2]["step"]) < STEPS  # it missed some


def test_fused_adam_hyperparameter_changes_between_steps_take_effect():
    ours_params, torch_params = make_params(), make_params()
    ours, theirs = FusedAdam(ours_params), torch.optim.AdamW(torch_params, weight_decay=0.0)
    generator = torch.Generator().manual_seed(2)
    for step in range(30):
        if step == 10:
            for optimizer in (ours, theirs):
                optimizer.param_groups[0].update(betas=(0.7, 0.95), weight_decay=0.05, eps=1e-4)
        set_grads([ours_params, torch_params], step, generator)
        ours.step()
        theirs.step()
    assert_close(ours_params, torch_params)
    assert_same_state(ours, theirs)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_without_bias_correction_matches_apex_math(adam_w_mode):
    params = make_params()
    groups = [([0, 1, 2], dict(bias_correction=False, weight_decay=0.02)),
              ([3, 4, 5], dict(lr=2e-3, betas=(0.85, 0.995), weight_decay=0.05))]
    _, reference = run_against_apex_math(FusedAdam, params, groups, STEPS, adam_w_mode=adam_w_mode)
    assert_close(params, [torch.from_numpy(p) for p in reference.params])


@pytest.mark.parametrize("use_nvlamb", [False, True])
@pytest.mark.parametrize("max_grad_norm", [0.5, math.inf])
def test_fused_lamb_matches_apex_math_over_100_steps(monkeypatch, use_nvlamb, max_grad_norm):
    """Groups with and without decay (the trust ratio only with decay unless use_nvlamb), without
    bias correction, another lr; gradients missing on some steps (out of the global norm);
    clipped (norm about 44 > 0.5) or not. Blocks of 512 elements, so that tensors straddle them."""
    monkeypatch.setattr(_optim_cpu, "_BLOCK", 512)
    params = make_params()
    groups = [([0, 1], dict(weight_decay=0.0)),
              ([2, 3], dict(lr=2e-3, bias_correction=False, eps=1e-5)),
              ([4, 5], dict(betas=(0.8, 0.99), weight_decay=0.1))]
    optimizer, reference = run_against_apex_math(FusedLamb, params, groups, STEPS,
                                                  max_grad_norm=max_grad_norm,
                                                  use_nvlamb=use_nvlamb)
    assert_close(params, [torch.from_numpy(p) for p in reference.params], rtol=2e-5)
    state = optimizer.state_dict()["state"]
    for i in range(len(params)):
        assert float(state[i]["step"]) == reference.t[i]
        assert rel_err(state[i]["exp_avg_sq"], reference.v[i]) < 2e-5


def test_fused_lamb_without_decay_or_nvlamb_is_clipped_adam():
    """weight_decay=0 and no nvlamb: no trust ratio, so FusedLamb is Adam on clipped gradients."""
    lamb_params, adam_params = make_params(), make_params()
    lamb = FusedLamb(lamb_params, weight_decay=0.0, eps=1e-8, max_grad_norm=2.0)
    adam = torch.optim.Adam(adam_params)
    generator = torch.Generator().manual_seed(3)
    for step in range(20):
        set_grads([lamb_params, adam_params], step, generator)
        grads = [p.grad for p in adam_params if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
        for grad in grads:  # apex's clip: g / (norm / max_grad_norm), no epsilon
            grad.div_(max(1.0, norm / 2.0))
        lamb.step()
        adam.step()
    assert_close(lamb_params, adam_params)


# ----------------------------------------------------------------------------------------------
# State dicts
# ----------------------------------------------------------------------------------------------


def train(pairs, steps, seed):
    """Steps each (params, optimizer) pair with the same gradients."""
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        set_grads([params for params, _ in pairs], step + 1, generator)
        for _, optimizer in pairs:
            optimizer.step()


@pytest.mark.parametrize("adam_w_mode,torch_class", [(True, torch.optim.AdamW),
                                                     (False, torch.optim.Adam)])
def test_state_dicts_load_both_ways_with_torch(adam_w_mode, torch_class):
    # ours -> torch.optim.Adam, through a file: the groups' decoupled_weight_decay says which decay
    ours_params = make_params()
    ours = FusedAdam(ours_params, weight_decay=0.01, adam_w_mode=adam_w_mode)
    train([(ours_params, ours)], 10, seed=4)
    buffer = io.BytesIO()
    torch.save(ours.state_dict(), buffer)
    buffer.seek(0)
    torch_params = [torch.nn.Parameter(p.detach().clone()) for p in ours_params]
    theirs = torch.optim.Adam(torch_params)
    theirs.load_state_dict(torch.load(buffer))
    assert theirs.param_groups[0]["decoupled_weight_decay"] is adam_w_mode
    train([(ours_params, ours), (torch_params, theirs)], 10, seed=5)
    assert_close(ours_params, torch_params)
    assert_same_state(ours, theirs)
    # torch.optim.AdamW / Adam -> a new FusedAdam; both go on in step
    source_params = make_params(seed=1)
    source = torch_class(source_params, weight_decay=0.01)
    train([(source_params, source)], 10, seed=6)
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in source_params]
    fresh = FusedAdam(fresh_params, adam_w_mode=adam_w_mode)
    fresh.load_state_dict(source.state_dict())
    assert fresh.param_groups[0]["weight_decay"] == 0.01
    assert fresh.param_groups[0]["bias_correction"] is True  # kept: torch's dict has none
    train([(fresh_params, fresh), (source_params, source)], 10, seed=7)
    assert_close(fresh_params, source_params)
    assert_same_state(fresh, source)


def test_fused_lamb_state_dict_round_trip_continues_exactly():
    params = make_params()
    optimizer = FusedLamb(two_groups(params, lr=2e-3))
    train([(params, optimizer)], 5, seed=8)
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    restored = FusedLamb(two_groups(copies))
    restored.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert restored.param_groups[1]["lr"] == 2e-3
    train([(params, optimizer), (copies, restored)], 5, seed=9)
    for a, b in zip(params, copies):
        assert torch.equal(a, b)


def bad_state_dicts():
    """(name, edit of a valid FusedAdam state dict, error, message)."""
    def edit(function):
        def apply(state_dict):
            function(state_dict)
            return state_dict
        return apply

    return [
        ("not a dict", lambda sd: [sd], ValueError,
         r"expected a dict with 'state' \(a dict\) and 'param_groups', got list"),
        ("state not a dict", edit(lambda sd: sd.update(state=[])), ValueError,
         r"expected a dict with 'state' \(a dict\) and 'param_groups', got dict"),
        ("group count", edit(lambda sd: sd["param_groups"].append({"params": []})), ValueError,
         r"param groups hold \[6, 0\] parameters, this optimizer's \[6\]"),
        ("group without params", edit(lambda sd: sd["param_groups"][0].pop("params")),
         ValueError, r"every entry of 'param_groups' must be a dict with 'params'"),
        ("shape", edit(lambda sd: sd["state"][3].update(exp_avg=torch.zeros(33))), ValueError,
         r"state of parameter 3: exp_avg must be a tensor of the parameter's shape \(33, 17\), "
         r"got \(33,\)"),
        ("missing key", edit(lambda sd: sd["state"][1].pop("exp_avg_sq")), ValueError,
         r"state of parameter 1 lacks \['exp_avg_sq'\]"),
        ("negative step", edit(lambda sd: sd["state"][0].update(step=torch.tensor(-1.0))),
         ValueError, r"state of parameter 0: step must be a whole number >= 0, got tensor\(-1\.\)"),
        ("fractional step", edit(lambda sd: sd["state"][0].update(step=2.5)), ValueError,
         r"step must be a whole number >= 0, got 2\.5"),
        ("mode", edit(lambda sd: sd["param_groups"][0].update(decoupled_weight_decay=False)),
         ValueError, r"param group 0: decoupled_weight_decay=False \(from torch.optim.Adam\) "
                     r"needs FusedAdam\(adam_w_mode=False\), this one has adam_w_mode=True"),
        ("amsgrad", edit(lambda sd: sd["param_groups"][0].update(amsgrad=True)), ValueError,
         r"param group 0: amsgrad=True is not supported"),
        ("maximize", edit(lambda sd: sd["param_groups"][0].update(maximize=True)), ValueError,
         r"param group 0: maximize=True is not supported"),
        ("betas", edit(lambda sd: sd["param_groups"][0].update(betas=(0.9, 1.5))), ValueError,
         r"param group 0: betas\[1\] must be >= 0.0 and < 1.0, got 1.5"),
    ]


@pytest.mark.parametrize("name,edit,error,message", bad_state_dicts(),
                         ids=[case[0] for case in bad_state_dicts()])
def test_load_state_dict_refuses_bad_dicts_and_changes_nothing(name, edit, error, message):
    params = make_params()
    optimizer = FusedAdam(params)
    train([(params, optimizer)], 3, seed=10)
    before = copy.deepcopy(optimizer.state_dict())
    weights = [p.detach().clone() for p in params]
    with pytest.raises(error, match=message):
        optimizer.load_state_dict(edit(copy.deepcopy(before)))
    after = optimizer.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for index, state in before["state"].items():
        for key, value in state.items():
            assert torch.equal(after["state"][index][key], value)
    for p, w in zip(params, weights):
        assert torch.equal(p, w)


# ----------------------------------------------------------------------------------------------
# Parameters, gradients, groups
# ----------------------------------------------------------------------------------------------


def test_parameters_stay_the_users_and_replaced_data_is_taken_back():
    model, reference = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    reference.load_state_dict(model.state_dict())
    ours, theirs = FusedAdam(model.parameters()), torch.optim.AdamW(reference.parameters(),
                                                                    weight_decay=0.0)
    weight = model.weight
    inputs = torch.randn(4, 5)

    def closure(module, optimizer):
        def loss():
            optimizer.zero_grad()
            value = module(inputs).square().sum()
            value.backward()
            return value
        return loss

    for step in range(6):
        if step == 3:  # .data replaced (same shape): the optimizer takes it back into its buffer
            with torch.no_grad():
                new = torch.randn(3, 5)
                model.weight.data, reference.weight.data = new.clone(), new.clone()
        assert ours.step(closure(model, ours)) == theirs.step(closure(reference, theirs))
    assert model.weight is weight
    assert_close(model.parameters(), reference.parameters())
    model.weight.data = torch.zeros(2, 5)
    with pytest.raises(ValueError, match=r"FusedAdam: parameter 0 was replaced by a torch.float32 "
                                         r"tensor of shape \(2, 5\) on cpu; expected torch.float32, "
                                         r"shape \(3, 5\) on cpu"):
        ours.step()


def test_add_param_group_after_steps_matches_torch():
    ours_params, torch_params = make_params(), make_params()
    ours = FusedAdam(ours_params[:3], weight_decay=0.01)
    theirs = torch.optim.AdamW(torch_params[:3], weight_decay=0.01)
    generator = torch.Generator().manual_seed(11)
    for step in range(10):
        if step == 4:
            ours.add_param_group({"params": ours_params[3:], "lr": 5e-3})
            theirs.add_param_group({"params": torch_params[3:], "lr": 5e-3})
        set_grads([ours_params, torch_params], step, generator)
        ours.step()
        theirs.step()
    assert_close(ours_params, torch_params)
    assert_same_state(ours, theirs)


def test_zero_grad_follows_set_grad_none():
    params = make_params()
    for optimizer, expect_none in ((FusedAdam(params), True),
                                   (FusedLamb(params, set_grad_none=False), False)):
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.zero_grad()
        assert all((p.grad is None) if expect_none else not p.grad.any() for p in params)
    params[0].grad = torch.ones_like(params[0])
    optimizer.zero_grad(set_to_none=True)
    assert params[0].grad is None


def test_step_without_any_gradient_changes_nothing():
    params = make_params()
    optimizer = FusedLamb(params)
    weights = [p.detach().clone() for p in params]
    assert optimizer.step(lambda: 1.5) == 1.5
    assert optimizer.state_dict()["state"] == {}
    for p, w in zip(params, weights):
        assert torch.equal(p, w)


def test_sparse_gradient_is_refused_and_nothing_changes():
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    dense = torch.nn.Parameter(torch.randn(3))
    optimizer = FusedAdam([dense, embedding.weight])
    dense.grad = torch.ones(3)
    embedding(torch.tensor([1, 2])).sum().backward()
    weights = [dense.detach().clone(), embedding.weight.detach().clone()]
    with pytest.raises(TypeError, match=r"FusedAdam: parameter 1 has a torch.sparse_coo gradient: "
                                        r"sparse gradients are not supported"):
        optimizer.step()
    assert torch.equal(dense, weights[0]) and torch.equal(embedding.weight, weights[1])
    assert optimizer.state_dict()["state"] == {}


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(amsgrad=True), ValueError, r"FusedAdam: amsgrad=True is not supported"),
    (dict(amsgrad=1), TypeError, r"FusedAdam: amsgrad must be True or False, got 1"),
    (dict(adam_w_mode="yes"), TypeError, r"FusedAdam: adam_w_mode must be True or False, got 'yes'"),
    (dict(set_grad_none=None), TypeError, r"FusedAdam: set_grad_none must be True or False, got None"),
    (dict(lr=-1e-3), ValueError, r"FusedAdam: param group 0: lr must be >= 0.0, got -0.001"),
    (dict(lr="1e-3"), TypeError, r"FusedAdam: param group 0: lr must be a real number, got '1e-3'"),
    (dict(lr=float("nan")), TypeError, r"lr must be a real number, got nan"),
    (dict(betas=(0.9, 1.0)), ValueError, r"param group 0: betas\[1\] must be >= 0.0 and < 1.0, got 1.0"),
    (dict(betas=(-0.1, 0.9)), ValueError, r"betas\[0\] must be >= 0.0 and < 1.0, got -0.1"),
    (dict(betas=0.9), TypeError, r"param group 0: betas must be a pair \(beta1, beta2\), got 0.9"),
    (dict(eps=-1e-8), ValueError, r"param group 0: eps must be >= 0.0, got -1e-08"),
    (dict(weight_decay=-0.1), ValueError, r"param group 0: weight_decay must be >= 0.0, got -0.1"),
    (dict(bias_correction=1), TypeError, r"param group 0: bias_correction must be True or False, got 1"),
])
def test_fused_adam_refuses_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        FusedAdam(make_params(), **kwargs)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(adam_w_mode=False), ValueError,
     r"FusedLamb: adam_w_mode=False \(L2 decay inside the moments\) is not supported"),
    (dict(amsgrad=True), ValueError, r"FusedLamb: amsgrad=True is not supported"),
    (dict(use_nvlamb=1), TypeError, r"FusedLamb: use_nvlamb must be True or False, got 1"),
    (dict(grad_averaging=False), ValueError,
     r"FusedLamb: param group 0: grad_averaging=False is not supported"),
    (dict(grad_averaging=None), TypeError, r"param group 0: grad_averaging must be True or False"),
    (dict(max_grad_norm=0.0), ValueError, r"param group 0: max_grad_norm must be > 0.0, got 0.0"),
    (dict(max_grad_norm=None), TypeError, r"param group 0: max_grad_norm must be a real number"),
])
def test_fused_lamb_refuses_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        FusedLamb(make_params(), **kwargs)


def test_refuses_parameters_it_cannot_hold():
    with pytest.raises(TypeError, match=r"FusedAdam: param group 0, parameter 1 is torch.float64: "
                                        r"only torch.float32 parameters are supported"):
        FusedAdam([torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2).double())])
    with pytest.raises(ValueError, match=r"param group 0, parameter 0 has no elements \(shape \(0, 3\)\)"):
        FusedAdam([torch.nn.Parameter(torch.ones(0, 3))])
    with pytest.raises(ValueError, match=r"param group 0, parameter 0 is on meta: expected a 'cpu' "
                                         r"or 'cuda' device"):
        FusedAdam([torch.nn.Parameter(torch.ones(2, device="meta"))])
    twice = torch.nn.Parameter(torch.ones(2))
    with pytest.warns(UserWarning, match="duplicate parameters"), \
            pytest.raises(ValueError, match=r"param group 0, parameter 1 appears twice"):
        FusedAdam([twice, twice])
    with pytest.raises(ValueError, match=r"FusedLamb: the param groups hold no parameter"):
        FusedLamb([{"params": []}])


def test_rejected_param_group_is_not_added():
    params = make_params()
    lamb = FusedLamb(params[:3])
    with pytest.raises(ValueError, match=r"FusedLamb: every param group must have the same "
                                         r"max_grad_norm \(the gradient norm is global\), got \[1.0, 2.0\]"):
        lamb.add_param_group({"params": params[3:], "max_grad_norm": 2.0})
    with pytest.raises(ValueError, match=r"FusedLamb: param group 1: lr must be >= 0.0, got -1"):
        lamb.add_param_group({"params": params[3:], "lr": -1})
    assert len(lamb.param_groups) == 1
    lamb.add_param_group({"params": params[3:]})  # the same group, valid, still goes in
    train([(params, lamb)], 3, seed=12)
    assert sorted(lamb.state_dict()["state"]) == [0, 1, 2, 3, 4, 5]


def test_hyperparameters_set_wrong_between_steps_are_refused_before_any_change():
    params = make_params()
    optimizer = FusedAdam(params)
    train([(params, optimizer)], 1, seed=13)
    weights = [p.detach().clone() for p in params]
    optimizer.param_groups[0]["eps"] = -1.0
    with pytest.raises(ValueError, match=r"FusedAdam: param group 0: eps must be >= 0.0, got -1.0"):
        optimizer.step()
    for p, w in zip(params, weights):
        assert torch.equal(p, w)
    assert all(float(state["step"]) == 1 for state in optimizer.state_dict()["state"].values())


def test_benchmark_script_runs_on_a_tiny_model(tmp_path):
    out = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/fused_optimizer.py", "--models", "small", "--layers", "1",
         "--width", "16", "--vocab", "50", "--context", "8", "--repeats", "2", "--warmup", "1",
         "--threads", "1", "--json", str(out)],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    steps = json.loads(out.read_text())["models"]["small"]["steps"]
    assert set(steps) == {"torch Adam fused", "torch Adam foreach", "FusedAdam", "FusedLamb",
                          "grad copy"}
