"""Optimizer configs: defaults, ranges (every message pinned), parameter groups, resolve_groups."""
import dataclasses
import math
import re

import numpy as np
import pytest

from ort_trainer.optim import AdamConfig, DecayMode, LambConfig, SGDConfig

ADAM_GROUP_KEYS = "alpha, beta, do_bias_correction, epsilon, lambda, lambda_coef, params, weight_decay_mode"
SGD_GROUP_KEYS = "lambda, lambda_coef, momentum, nesterov, params"


def raises_exactly(message, error=ValueError):
    return pytest.raises(error, match=f"^{re.escape(message)}$")


# ---------------------------------------------------------------- defaults and good values

def test_sgd_defaults():
    config = SGDConfig()
    assert (config.name, config.lr, config.max_norm_clip, config.params) == ("SGDOptimizer", 0.001, 1.0, ())
    assert config.defaults == {"momentum": 0.0, "nesterov": False, "lambda_coef": 0.0, "dampening": 0.0}


def test_adam_defaults():
    config = AdamConfig()
    assert (config.name, config.lr, config.max_norm_clip, config.params) == ("AdamOptimizer", 0.001, 1.0, ())
    assert config.defaults == {"alpha": 0.9, "beta": 0.999, "lambda_coef": 0.0, "epsilon": 1e-8,
                               "do_bias_correction": True, "weight_decay_mode": 0}
    assert config.weight_decay_mode is DecayMode.BEFORE_WEIGHT_UPDATE
    assert type(config.defaults["weight_decay_mode"]) is int


def test_lamb_defaults():
    config = LambConfig()
    assert (config.name, config.lr, config.max_norm_clip, config.params) == ("LambOptimizer", 0.001, 1.0, ())
    assert config.defaults == {"alpha": 0.9, "beta": 0.999, "lambda_coef": 0.0, "ratio_min": -math.inf,
                               "ratio_max": math.inf, "epsilon": 1e-6, "do_bias_correction": False}


def test_decay_mode():
    assert [(mode.name, int(mode)) for mode in DecayMode] == [("BEFORE_WEIGHT_UPDATE", 0), ("AFTER_WEIGHT_UPDATE", 1)]


def test_decay_mode_has_the_originals_spelling():
    """The original nested the enum in AdamConfig (the only config with a decay mode)."""
    assert AdamConfig.DecayMode is DecayMode
    config = AdamConfig(weight_decay_mode=AdamConfig.DecayMode.AFTER_WEIGHT_UPDATE)
    assert config.weight_decay_mode is DecayMode.AFTER_WEIGHT_UPDATE and config.defaults["weight_decay_mode"] == 1
    assert "DecayMode" not in {field.name for field in dataclasses.fields(AdamConfig)}  # not an argument
    assert not hasattr(LambConfig, "DecayMode") and not hasattr(SGDConfig, "DecayMode")


def test_positional_order_matches_the_original():
    assert AdamConfig([], 0.01, 0.8, 0.99, 0.1, 1e-7, 2.0, False, DecayMode.AFTER_WEIGHT_UPDATE) == AdamConfig(
        lr=0.01, alpha=0.8, beta=0.99, lambda_coef=0.1, epsilon=1e-7, max_norm_clip=2.0, do_bias_correction=False,
        weight_decay_mode=1)
    assert LambConfig([], 0.01, 0.8, 0.99, 0.1, 0.1, 10.0, 1e-7, 2.0, True).ratio_max == 10.0
    assert SGDConfig([], 0.5).lr == 0.5


@pytest.mark.parametrize("make, expected", [
    (lambda: SGDConfig(lr=1, momentum=0.9, nesterov=True, lambda_coef=1e-4, max_norm_clip=5),
     {"momentum": 0.9, "nesterov": True, "lambda_coef": 1e-4, "dampening": 0.0}),
    (lambda: SGDConfig(momentum=1.5), {"momentum": 1.5, "nesterov": False, "lambda_coef": 0.0, "dampening": 0.0}),
    (lambda: AdamConfig(alpha=0, beta=0, lambda_coef=0, epsilon=0, weight_decay_mode=DecayMode.AFTER_WEIGHT_UPDATE),
     {"alpha": 0.0, "beta": 0.0, "lambda_coef": 0.0, "epsilon": 0.0, "do_bias_correction": True,
      "weight_decay_mode": 1}),
    (lambda: AdamConfig(alpha=np.float32(0.5), beta=0.9999, weight_decay_mode=np.int64(1)),
     {"alpha": 0.5, "beta": 0.9999, "lambda_coef": 0.0, "epsilon": 1e-8, "do_bias_correction": True,
      "weight_decay_mode": 1}),
    (lambda: LambConfig(ratio_min=0.5, ratio_max=0.5, do_bias_correction=True),
     {"alpha": 0.9, "beta": 0.999, "lambda_coef": 0.0, "ratio_min": 0.5, "ratio_max": 0.5, "epsilon": 1e-6,
      "do_bias_correction": True}),
])
def test_valid_values_become_floats(make, expected):
    config = make()
    assert config.defaults == expected
    assert all(type(value) is float for key, value in config.defaults.items() if key in (
        "momentum", "lambda_coef", "alpha", "beta", "epsilon", "ratio_min", "ratio_max", "dampening"))
    assert type(config.lr) is float and type(config.max_norm_clip) is float


def test_adam_weight_decay_mode_from_int():
    assert AdamConfig(weight_decay_mode=1).weight_decay_mode is DecayMode.AFTER_WEIGHT_UPDATE


# ---------------------------------------------------------------- bad values

@pytest.mark.parametrize("make, message", [
    (lambda: AdamConfig(lr=0), "Invalid AdamConfig: lr: must be in (0, inf), got 0.0"),
    (lambda: AdamConfig(lr=-0.1), "Invalid AdamConfig: lr: must be in (0, inf), got -0.1"),
    (lambda: AdamConfig(lr=math.inf), "Invalid AdamConfig: lr: must be in (0, inf), got inf"),
    (lambda: AdamConfig(lr=math.nan), "Invalid AdamConfig: lr: must be in (0, inf), got nan"),
    (lambda: AdamConfig(lr=None), "Invalid AdamConfig: lr: must not be None"),
    (lambda: AdamConfig(lr=True), "Invalid AdamConfig: lr: must be a number, got True (bool)"),
    (lambda: AdamConfig(lr="0.1"), "Invalid AdamConfig: lr: must be a number, got '0.1' (str)"),
    (lambda: AdamConfig(alpha=1.0), "Invalid AdamConfig: alpha: must be in [0, 1), got 1.0"),
    (lambda: AdamConfig(alpha=-0.1), "Invalid AdamConfig: alpha: must be in [0, 1), got -0.1"),
    (lambda: AdamConfig(beta=1), "Invalid AdamConfig: beta: must be in [0, 1), got 1.0"),
    (lambda: AdamConfig(epsilon=-1e-8), "Invalid AdamConfig: epsilon: must be in [0, inf), got -1e-08"),
    (lambda: AdamConfig(lambda_coef=-0.01), "Invalid AdamConfig: lambda_coef: must be in [0, inf), got -0.01"),
    (lambda: AdamConfig(max_norm_clip=0), "Invalid AdamConfig: max_norm_clip: must be in (0, inf), got 0.0"),
    (lambda: AdamConfig(max_norm_clip=-1.0), "Invalid AdamConfig: max_norm_clip: must be in (0, inf), got -1.0"),
    (lambda: AdamConfig(do_bias_correction=1), "Invalid AdamConfig: do_bias_correction: must be a bool, got 1 (int)"),
    (lambda: AdamConfig(weight_decay_mode=2), "Invalid AdamConfig: weight_decay_mode: must be one of 0, 1, got 2"),
    (lambda: AdamConfig(weight_decay_mode=True),
     "Invalid AdamConfig: weight_decay_mode: must be an int, got True (bool)"),
    (lambda: AdamConfig(weight_decay_mode="BEFORE_WEIGHT_UPDATE"),
     "Invalid AdamConfig: weight_decay_mode: must be an int, got 'BEFORE_WEIGHT_UPDATE' (str)"),
    (lambda: AdamConfig(alpha=1, beta=2, lr=0),  # every failing field, sorted
     "Invalid AdamConfig: alpha: must be in [0, 1), got 1.0; beta: must be in [0, 1), got 2.0; "
     "lr: must be in (0, inf), got 0.0"),
    (lambda: SGDConfig(lr=0), "Invalid SGDConfig: lr: must be in (0, inf), got 0.0"),
    (lambda: SGDConfig(momentum=-0.5), "Invalid SGDConfig: momentum: must be in [0, inf), got -0.5"),
    (lambda: SGDConfig(nesterov="yes"), "Invalid SGDConfig: nesterov: must be a bool, got 'yes' (str)"),
    (lambda: SGDConfig(lambda_coef=-1), "Invalid SGDConfig: lambda_coef: must be in [0, inf), got -1.0"),
    (lambda: SGDConfig(max_norm_clip=0), "Invalid SGDConfig: max_norm_clip: must be in (0, inf), got 0.0"),
    (lambda: SGDConfig(nesterov=True), "Invalid SGDConfig: nesterov: requires momentum > 0, got momentum=0.0"),
    (lambda: LambConfig(lr=0), "Invalid LambConfig: lr: must be in (0, inf), got 0.0"),
    (lambda: LambConfig(beta=1.0), "Invalid LambConfig: beta: must be in [0, 1), got 1.0"),
    (lambda: LambConfig(ratio_min=math.nan), "Invalid LambConfig: ratio_min: must be in [-inf, inf], got nan"),
    (lambda: LambConfig(ratio_max="inf"), "Invalid LambConfig: ratio_max: must be a number, got 'inf' (str)"),
    (lambda: LambConfig(ratio_min=2, ratio_max=1),
     "Invalid LambConfig: ratio_min: must be <= ratio_max, got ratio_min=2.0, ratio_max=1.0"),
    (lambda: LambConfig(epsilon=-1), "Invalid LambConfig: epsilon: must be in [0, inf), got -1.0"),
    (lambda: LambConfig(do_bias_correction=None), "Invalid LambConfig: do_bias_correction: must not be None"),
])
def test_invalid_values(make, message):
    with raises_exactly(message):
        make()


# ---------------------------------------------------------------- parameter groups

def test_groups_are_normalized_copies():
    given = [{"params": ["fc.weight", "fc.bias"], "lambda": 0}, {"params": ("emb.weight",), "alpha": 0.5, "epsilon": 1}]
    config = AdamConfig(params=given)
    given[0]["params"].append("other")
    assert config.params == ({"params": ("fc.weight", "fc.bias"), "lambda_coef": 0.0},
                             {"params": ("emb.weight",), "alpha": 0.5, "epsilon": 1.0})
    with pytest.raises(TypeError):
        config.params[0]["lambda_coef"] = 1.0


def test_config_from_another_configs_groups():
    config = AdamConfig(params=[{"params": ["w"], "alpha": 0.5}])
    assert AdamConfig(params=config.params, lr=0.1).params == config.params
    assert dataclasses.replace(config, lr=0.5) == AdamConfig(params=[{"params": ["w"], "alpha": 0.5}], lr=0.5)


def test_config_is_immutable():
    config = SGDConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.lr = 0.1
    assert hash(config) == hash(SGDConfig())


def test_repr():
    config = SGDConfig(params=[{"params": ["w"], "momentum": 0.9}], lr=0.1)
    assert repr(config) == ("SGDConfig(params=[{'params': ['w'], 'momentum': 0.9}], lr=0.1, momentum=0.0, "
                            "nesterov=False, lambda_coef=0.0, max_norm_clip=1.0)")


@pytest.mark.parametrize("make, message", [
    (lambda: AdamConfig(params={"params": ["w"]}),
     "Invalid AdamConfig: params: must be a list, got {'params': ['w']} (dict)"),
    (lambda: AdamConfig(params=["w"]), "Invalid AdamConfig: params[0]: must be a dict, got 'w' (str)"),
    (lambda: AdamConfig(params=[{"params": ["w"]}]),
     "Invalid AdamConfig: params[0]: must set at least one hyperparameter besides 'params', got {'params': ['w']}"),
    (lambda: AdamConfig(params=[{"alpha": 0.5}]), "Invalid AdamConfig: params[0].params: required field"),
    (lambda: AdamConfig(params=[{"params": [], "alpha": 0.5}]),
     "Invalid AdamConfig: params[0].params: must have at least 1 item(s), got 0"),
    (lambda: AdamConfig(params=[{"params": "w", "alpha": 0.5}]),
     "Invalid AdamConfig: params[0].params: must be a list, got 'w' (str)"),
    (lambda: AdamConfig(params=[{"params": ["w", 1, ""], "alpha": 0.5}]),
     "Invalid AdamConfig: params[0].params[1]: must be a str, got 1 (int); params[0].params[2]: must not be empty"),
    (lambda: AdamConfig(params=[{"params": ["w", "b", "w"], "alpha": 0.5}]),
     "Invalid AdamConfig: params[0].params: entries must be unique, got 'w' more than once"),
    (lambda: AdamConfig(params=[{"params": ["w"], "lr": 0.1}]),
     "Invalid AdamConfig: params[0].lr: cannot be set per parameter group (lr is global), got 0.1"),
    (lambda: AdamConfig(params=[{"params": ["w"], "max_norm_clip": 2.0}]),
     "Invalid AdamConfig: params[0].max_norm_clip: cannot be set per parameter group (max_norm_clip is global), "
     "got 2.0"),
    (lambda: AdamConfig(params=[{"params": ["w"], "betas": (0.9, 0.99)}]),
     f"Invalid AdamConfig: params[0].betas: unknown field (allowed: {ADAM_GROUP_KEYS})"),
    (lambda: AdamConfig(params=[{"params": ["w"], "alpha": 1.0}]),
     "Invalid AdamConfig: params[0].alpha: must be in [0, 1), got 1.0"),
    (lambda: AdamConfig(params=[{"params": ["w"], "lambda": -1}]),
     "Invalid AdamConfig: params[0].lambda_coef: must be in [0, inf), got -1.0"),
    (lambda: AdamConfig(params=[{"params": ["w"], "weight_decay_mode": 3}]),
     "Invalid AdamConfig: params[0].weight_decay_mode: must be one of 0, 1, got 3"),
    (lambda: AdamConfig(params=[{"params": ["a", "w"], "alpha": 0.5}, {"params": ["b"], "beta": 0.5},
                                {"params": ["w", "b"], "epsilon": 0.0}]),
     "Invalid AdamConfig: params: 'b' is in groups 1 and 2; params: 'w' is in groups 0 and 2"),
    (lambda: SGDConfig(params=[{"params": ["w"], "alpha": 0.5}]),
     f"Invalid SGDConfig: params[0].alpha: unknown field (allowed: {SGD_GROUP_KEYS})"),
    (lambda: SGDConfig(params=[{"params": ["w"], "dampening": 0.1}]),
     f"Invalid SGDConfig: params[0].dampening: unknown field (allowed: {SGD_GROUP_KEYS})"),
    (lambda: SGDConfig(params=[{"params": ["w"], "nesterov": True}]),
     "Invalid SGDConfig: params[0].nesterov: requires momentum > 0, got momentum=0.0"),
    (lambda: SGDConfig(momentum=0.9, nesterov=True, params=[{"params": ["w"], "momentum": 0.0}]),
     "Invalid SGDConfig: params[0].nesterov: requires momentum > 0, got momentum=0.0"),
    # a group that only inherits the failing defaults is not reported again
    (lambda: SGDConfig(nesterov=True, params=[{"params": ["w"], "lambda": 0.1}]),
     "Invalid SGDConfig: nesterov: requires momentum > 0, got momentum=0.0"),
    (lambda: LambConfig(params=[{"params": ["w"], "ratio_min": 1.0, "ratio_max": 0.5}]),
     "Invalid LambConfig: params[0].ratio_min: must be <= ratio_max, got ratio_min=1.0, ratio_max=0.5"),
    (lambda: LambConfig(ratio_max=1.0, params=[{"params": ["w"], "ratio_min": 2.0},
                                               {"params": ["b"], "alpha": math.nan}]),
     "Invalid LambConfig: params[1].alpha: must be in [0, 1), got nan"),
])
def test_invalid_groups(make, message):
    with raises_exactly(message):
        make()


def test_cross_field_rules_report_defaults_and_groups():
    with raises_exactly("Invalid LambConfig: "
                        "params[0].ratio_min: must be <= ratio_max, got ratio_min=2.0, ratio_max=0.5; "
                        "ratio_min: must be <= ratio_max, got ratio_min=1.0, ratio_max=0.5"):
        LambConfig(ratio_min=1.0, ratio_max=0.5, params=[{"params": ["w"], "ratio_min": 2.0}])


# ---------------------------------------------------------------- resolve_groups

NAMES = ["emb.weight", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def test_resolve_groups_without_groups():
    config = AdamConfig(lambda_coef=0.01)
    assert config.resolve_groups(NAMES) == [(NAMES, config.defaults)]


def test_resolve_groups_partitions_in_given_order():
    config = AdamConfig(lambda_coef=0.01, params=[{"params": ["fc2.bias", "fc1.bias"], "lambda": 0.0},
                                                  {"params": ["emb.weight"], "alpha": 0.8, "weight_decay_mode": 1}])
    defaults = config.defaults
    assert config.resolve_groups(NAMES) == [
        (["fc1.weight", "fc2.weight"], defaults),
        (["fc1.bias", "fc2.bias"], {**defaults, "lambda_coef": 0.0}),
        (["emb.weight"], {**defaults, "alpha": 0.8, "weight_decay_mode": 1}),
    ]


def test_resolve_groups_keeps_an_empty_default_group():
    config = SGDConfig(params=[{"params": NAMES, "momentum": 0.9}])
    assert config.resolve_groups(NAMES) == [
        ([], {"momentum": 0.0, "nesterov": False, "lambda_coef": 0.0, "dampening": 0.0}),
        (NAMES, {"momentum": 0.9, "nesterov": False, "lambda_coef": 0.0, "dampening": 0.0}),
    ]


def test_resolve_groups_returns_fresh_dicts():
    config = SGDConfig(params=[{"params": ["fc1.bias"], "momentum": 0.9}])
    config.resolve_groups(NAMES)[1][1]["momentum"] = 0.0
    assert config.resolve_groups(NAMES)[1][1]["momentum"] == 0.9


def test_resolve_groups_unknown_names():
    config = AdamConfig(params=[{"params": ["fc1.weight", "head.weight"], "alpha": 0.5},
                                {"params": ["x"], "beta": 0.5}])
    with raises_exactly("Invalid AdamConfig: params: unknown parameter name(s) 'head.weight', 'x'; "
                        "parameter names are: 'emb.weight', 'fc1.weight', 'fc1.bias', 'fc2.weight', 'fc2.bias'"):
        config.resolve_groups(NAMES)


def test_resolve_groups_unknown_names_lists_the_first_ten():
    names = [f"layer{i}.weight" for i in range(12)]
    listed = ", ".join(repr(name) for name in names[:10])
    message = f"Invalid SGDConfig: params: unknown parameter name(s) 'w'; parameter names are: {listed}, ..."
    with raises_exactly(message):
        SGDConfig(params=[{"params": ["w"], "momentum": 0.5}]).resolve_groups(names)
