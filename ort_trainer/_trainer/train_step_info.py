"""TrainStepInfo: the step counters the trainer hands to LR schedulers and loss scalers."""
import numbers

from ..amp._device_counters import Counters, KeptOnDevice
from ..optim._config import _OptimizerConfig


def _type_name(value):
    return type(value).__name__


def _optimizer_config(name, value):
    if not isinstance(value, _OptimizerConfig):
        raise TypeError(f"TrainStepInfo: {name} must be an optim.SGDConfig, optim.AdamConfig or optim.LambConfig, "
                        f"got {value!r} ({_type_name(value)})")
    return value


def _flag(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"TrainStepInfo: {name} must be a bool, got {value!r} ({_type_name(value)})")
    return value


def _fetches(name, value):
    if value is None:
        return []
    if not isinstance(value, list | tuple) or not all(isinstance(item, str) for item in value):
        raise TypeError(f"TrainStepInfo: {name} must be a list of output names (str), got {value!r}")
    repeated = sorted({item for item in value if value.count(item) > 1})
    if repeated:
        raise ValueError(f"TrainStepInfo: {name} must name each output once, got {value!r} ({repeated} repeated)")
    return list(value)


def _count(name, value):
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"TrainStepInfo: {name} must be an int >= 0, got {value!r} ({_type_name(value)})")
    if value < 0:
        raise ValueError(f"TrainStepInfo: {name} must be an int >= 0, got {value!r}")
    return int(value)


class _Checked:
    """An attribute whose every assignment is checked: a refused one leaves the old value.
    `on_device` ones may live on a device (`TrainStepInfo._keep_on_device`): read from there, and
    written back."""

    def __init__(self, check, *, on_device=False):
        self._check, self._on_device = check, on_device

    def __set_name__(self, owner, name):
        self._name, self._slot = name, f"_{name}"

    def __get__(self, info, owner=None):
        if info is None:
            return self
        if self._on_device:
            info._sync_from_device()
        return getattr(info, self._slot)

    def __set__(self, info, value):
        value = self._check(self._name, value)
        if self._on_device:
            info._sync_from_device()  # the other values, before this one is written back with them
        setattr(info, self._slot, value)
        if self._on_device:
            info._write_to_device()


class TrainStepInfo(KeptOnDevice):
    """Step counters handed to LR schedulers and loss scalers (the original's signature).

    `step` counts train_step calls; `optimization_step` counts applied optimizer updates;
    `all_finite` is False when the last update was skipped for non-finite gradients;
    `fetches`, when not empty, names the outputs train_step and eval_step compute and return.
    Every argument, and every later assignment, is checked.

    Raises:
        TypeError: an argument of the wrong type (bool is not an int).
        ValueError: a negative count, or an output named twice in `fetches`.
    """

    optimizer_config = _Checked(_optimizer_config)
    all_finite = _Checked(_flag, on_device=True)
    fetches = _Checked(_fetches)
    optimization_step = _Checked(_count, on_device=True)
    step = _Checked(_count)

    def __init__(self, optimizer_config, all_finite=True, fetches=None, optimization_step=0, step=0):
        self.optimizer_config = optimizer_config
        self.all_finite = all_finite
        self.fetches = fetches
        self.optimization_step = optimization_step
        self.step = step

    def _from_counters(self, counters: Counters) -> None:
        self._optimization_step, self._all_finite = int(counters.updates_applied), counters.last_finite == 1.0

    def _into_counters(self, counters: Counters) -> Counters:
        return counters._replace(updates_applied=float(self._optimization_step), last_finite=float(self._all_finite))

    def __repr__(self):
        return (f"TrainStepInfo(optimizer_config={self.optimizer_config!r}, all_finite={self.all_finite!r}, "
                f"fetches={self.fetches!r}, optimization_step={self.optimization_step!r}, step={self.step!r})")
