"""Optimizer configs of the original API (``SGDConfig``, ``AdamConfig``, ``LambConfig``).

Validated by ``schemas/optim_{sgd,adam,lamb}.yaml``. The learning rate and the gradient-clipping norm
are global; every other hyperparameter may be overridden per parameter group:
``params=[{'params': ['fc.weight'], 'lambda_coef': 0.01}]`` ('lambda' is accepted for 'lambda_coef').
"""
import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, ClassVar

from .._configuration.validation import validate

_GLOBAL_KEYS = ("params", "lr", "max_norm_clip")


class DecayMode(enum.IntEnum):
    """Where Adam applies weight decay (the original's numbering)."""

    BEFORE_WEIGHT_UPDATE = 0  # PyTorch AdamW: w -= lr * (m_hat / (sqrt(v_hat) + eps) + lambda * w)
    AFTER_WEIGHT_UPDATE = 1  # HuggingFace AdamW: w' = w - lr*sqrt(c2)/c1 * m/(sqrt(v)+eps); w = w' - lr*lambda*w'


@dataclass(frozen=True, repr=False)
class _OptimizerConfig:
    """Validation, parameter groups and hyperparameter resolution shared by the configs.

    Every config takes ``params`` (parameter groups ``[{'params': [names], 'lambda_coef': 0.0, ...}]``,
    or None), ``lr`` (the learning rate, > 0) and ``max_norm_clip`` (the global gradient-norm bound
    when ``options.utils.grad_norm_clip`` is on, > 0); Adam and Lamb ``alpha`` and ``beta`` (the
    first- and second-moment decays, in [0, 1)) and ``lambda_coef`` (weight decay, >= 0).

    After construction ``params`` holds the normalized groups: read-only mappings with ``'params'``
    a tuple of names and only the keys the group overrides ('lambda' renamed to 'lambda_coef').
    """

    name: ClassVar[str]
    _schema: ClassVar[str]
    _fixed_hyperparameters: ClassVar[Mapping[str, Any]] = MappingProxyType({})

    params: Sequence[Mapping[str, Any]] | None = field(default=None, hash=False)  # groups are mappings
    lr: float = 0.001

    def __post_init__(self):
        prefix = f"Invalid {type(self).__name__}"
        document = {f.name: getattr(self, f.name) for f in fields(self)}
        document["params"] = [] if self.params is None else self.params
        normalized = validate(self._schema, document, prefix)
        groups = normalized.pop("params")
        object.__setattr__(self, "params", tuple(MappingProxyType({**g, "params": tuple(g["params"])}) for g in groups))
        for key, value in normalized.items():
            object.__setattr__(self, key, value)
        self._check_combinations(prefix)

    def _combination_errors(self, hyperparameters: Mapping[str, Any]) -> list[str]:
        """Constraints that span several hyperparameters, as 'field: message' (none by default)."""
        return []

    def _check_combinations(self, prefix: str) -> None:
        errors = self._combination_errors(self.defaults)
        for index, (_, hyperparameters) in enumerate(self._groups()):
            # a group that inherits the failing values repeats the defaults' error: report it once
            errors += [f"params[{index}].{error}" for error in self._combination_errors(hyperparameters)
                       if error not in errors]
        if errors:
            raise ValueError(f"{prefix}: " + "; ".join(sorted(errors)))

    @property
    def defaults(self) -> dict[str, Any]:
        """Hyperparameters of parameters in no group (the keys of DESIGN.md "Hyperparameter keys")."""
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _GLOBAL_KEYS}
        own = {key: int(value) if isinstance(value, DecayMode) else value for key, value in own.items()}
        return {**own, **self._fixed_hyperparameters}

    def _groups(self) -> list[tuple[tuple[str, ...], dict[str, Any]]]:
        """(names, merged hyperparameters) of each group in ``params``."""
        defaults = self.defaults
        return [(group["params"], {**defaults, **{k: v for k, v in group.items() if k != "params"}})
                for group in self.params]

    def resolve_groups(self, param_names: Sequence[str],
                       untrained: Sequence[str] = ()) -> list[tuple[list[str], dict[str, Any]]]:
        """Partition ``param_names`` into the default group and the groups of ``params``.

        Returns ``len(params) + 1`` pairs ``(names, hyperparameters)``: first the parameters named by
        no group (with ``defaults``), then one per group in order (defaults overridden by the group).
        Names keep the order of ``param_names``; a part may be empty. A group may name parameters of
        ``untrained`` (the model's frozen or unused ones): they are left out, as a torch optimizer
        skips parameters that get no gradient (groups built from ``model.named_parameters()``).

        Raises:
            ValueError: a group names a parameter in neither ``param_names`` nor ``untrained``.
        """
        param_names = list(param_names)
        known = set(param_names) | set(untrained)
        unknown = [name for group in self.params for name in group["params"] if name not in known]
        if unknown:
            listed = ", ".join(map(repr, param_names[:10])) + (", ..." if len(param_names) > 10 else "")
            raise ValueError(
                f"Invalid {type(self).__name__}: params: unknown parameter name(s) {', '.join(map(repr, unknown))}; "
                f"parameter names are: {listed}"
            )
        group_of = {name: index for index, group in enumerate(self.params) for name in group["params"]}
        parts = [([name for name in param_names if name not in group_of], self.defaults)]
        for index, (_, hyperparameters) in enumerate(self._groups()):
            parts.append(([name for name in param_names if group_of.get(name) == index], hyperparameters))
        return parts

    def __repr__(self):
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["params"] = [{**group, "params": list(group["params"])} for group in self.params]
        return f"{type(self).__name__}({', '.join(f'{key}={value!r}' for key, value in values.items())})"


@dataclass(frozen=True, repr=False)
class SGDConfig(_OptimizerConfig):
    """SGD with optional momentum and weight decay, as ``torch.optim.SGD`` (dampening 0).

    ``g = grad + lambda_coef * w``; with momentum ``b = momentum * b + g`` and ``g = g + momentum * b``
    (nesterov) or ``g = b``; then ``w -= lr * g``. The original had only ``lr`` (plain ``w -= lr * g``).

    Args (besides ``params``, ``lr`` and ``max_norm_clip``, see ``_OptimizerConfig``):
        momentum: >= 0.
        nesterov: Nesterov momentum; requires momentum > 0.
        lambda_coef: L2 weight decay, >= 0.
    """

    name: ClassVar[str] = "SGDOptimizer"
    _schema: ClassVar[str] = "optim_sgd"
    _fixed_hyperparameters: ClassVar[Mapping[str, Any]] = MappingProxyType({"dampening": 0.0})

    momentum: float = 0.0
    nesterov: bool = False
    lambda_coef: float = 0.0
    max_norm_clip: float = 1.0

    def _combination_errors(self, hyperparameters):
        if hyperparameters["nesterov"] and hyperparameters["momentum"] <= 0:
            return [f"nesterov: requires momentum > 0, got momentum={hyperparameters['momentum']!r}"]
        return []


@dataclass(frozen=True, repr=False)
class AdamConfig(_OptimizerConfig):
    """Adam/AdamW with the original ORTTrainer's update rule (``alpha``/``beta`` are beta1/beta2).

    ``m = alpha*m + (1-alpha)*g``, ``v = beta*v + (1-beta)*g**2``, bias corrections ``c1 = 1-alpha**t``,
    ``c2 = 1-beta**t`` (1 without ``do_bias_correction``); weight decay per ``weight_decay_mode``
    (see ``DecayMode``).

    Args (besides those of ``_OptimizerConfig``):
        epsilon: added to sqrt(v), >= 0.
        do_bias_correction: divide the moments by c1, c2.
        weight_decay_mode: ``DecayMode`` (or its int value).
    """

    name: ClassVar[str] = "AdamOptimizer"
    _schema: ClassVar[str] = "optim_adam"
    DecayMode: ClassVar[type[DecayMode]] = DecayMode  # the original's spelling, AdamConfig.DecayMode

    alpha: float = 0.9
    beta: float = 0.999
    lambda_coef: float = 0.0
    epsilon: float = 1e-8
    max_norm_clip: float = 1.0
    do_bias_correction: bool = True
    weight_decay_mode: DecayMode = DecayMode.BEFORE_WEIGHT_UPDATE

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "weight_decay_mode", DecayMode(self.weight_decay_mode))


@dataclass(frozen=True, repr=False)
class LambConfig(_OptimizerConfig):
    """LAMB with the original ORTTrainer's update rule.

    ``d = lambda_coef*w + m_hat/(sqrt(v_hat)+epsilon)``, trust ratio
    ``r = clamp(||w|| / ||d||, ratio_min, ratio_max)`` (1 if a norm is 0), ``w -= lr * r * d``.

    Args (besides those of ``_OptimizerConfig``):
        ratio_min: lower clamp of the trust ratio, <= ratio_max.
        ratio_max: upper clamp of the trust ratio.
        epsilon: added to sqrt(v_hat), >= 0.
        do_bias_correction: divide the moments by c1, c2.
    """

    name: ClassVar[str] = "LambOptimizer"
    _schema: ClassVar[str] = "optim_lamb"

    alpha: float = 0.9
    beta: float = 0.999
    lambda_coef: float = 0.0
    ratio_min: float = -math.inf
    ratio_max: float = math.inf
    epsilon: float = 1e-6
    max_norm_clip: float = 1.0
    do_bias_correction: bool = False

    def _combination_errors(self, hyperparameters):
        low, high = hyperparameters["ratio_min"], hyperparameters["ratio_max"]
        return [f"ratio_min: must be <= ratio_max, got ratio_min={low!r}, ratio_max={high!r}"] if low > high else []
