"""Loss scalers of the original API: under fp16 the loss is multiplied by ``loss_scale`` so that small
gradients do not underflow; the gradients are divided by it again before the update."""
import abc
from collections.abc import Mapping

from .._checkpoint_files import check_component_state
from .._configuration.validation import validate
from ._device_counters import Counters, KeptOnDevice


class LossScaler(KeptOnDevice, abc.ABC):
    """Base of the loss scalers.

    The trainer feeds ``loss_scale`` to the graph and, once per optimizer update (at gradient-accumulation
    boundaries), calls ``update(train_step_info)`` with ``train_step_info.all_finite`` set.

    Args:
        loss_scale: the initial scale, > 0.
    """

    def __init__(self, loss_scale):
        self._initial_loss_scale = self._checked_scale(loss_scale)
        self.reset()

    def _checked_scale(self, value) -> float:
        return validate("loss_scaler", {"loss_scale": value}, f"Invalid {type(self).__name__}")["loss_scale"]

    @property
    def loss_scale(self) -> float:
        self._sync_from_device()
        return self._loss_scale

    @loss_scale.setter
    def loss_scale(self, value):
        value = self._checked_scale(value)
        self._sync_from_device()
        self._loss_scale = value
        self._write_to_device()

    def reset(self) -> None:
        """Back to the initial scale."""
        self._sync_from_device()
        self._reset()
        self._write_to_device()

    def _reset(self):
        self._loss_scale = self._initial_loss_scale

    @abc.abstractmethod
    def update(self, train_step_info) -> float:
        """Adjust the scale after an update (``train_step_info.all_finite``); returns the new scale."""


class DynamicLossScaler(LossScaler):
    """Doubles the scale after ``up_scale_window`` consecutive updates with finite gradients and halves
    it after each non-finite one, within ``[min_loss_scale, max_loss_scale]``.

    Args:
        automatic_update: False: ``update()`` keeps the scale, the caller sets ``loss_scale`` itself.
            (The original's docstring said False was the default; it is True.)
        loss_scale: initial scale, in [min_loss_scale, max_loss_scale].
        up_scale_window: consecutive finite updates before doubling, an int >= 1.
        min_loss_scale: lower bound, > 0.
        max_loss_scale: upper bound, >= min_loss_scale.
    """

    def __init__(self, automatic_update=True, loss_scale=float(2**16), up_scale_window=2000, min_loss_scale=1.0,
                 max_loss_scale=float(2**24)):
        # validates loss_scale together with its bounds, so LossScaler.__init__ is not needed
        self._configure(f"Invalid {type(self).__name__}", {
            "automatic_update": automatic_update, "loss_scale": loss_scale, "up_scale_window": up_scale_window,
            "min_loss_scale": min_loss_scale, "max_loss_scale": max_loss_scale})

    def _configure(self, prefix: str, config: dict) -> None:
        """Validate all fields (constructor arguments, or a state dict) and set them all at once."""
        config = validate("loss_scaler", config, prefix)
        low, high, window = config["min_loss_scale"], config["max_loss_scale"], config["up_scale_window"]
        errors = []
        if low > high:
            errors.append(f"max_loss_scale: must be >= min_loss_scale ({low!r}), got {high!r}")
        else:
            errors += [f"{key}: must be in [min_loss_scale, max_loss_scale] = [{low!r}, {high!r}], "
                       f"got {config[key]!r}"
                       for key in ("initial_loss_scale", "loss_scale")
                       if key in config and not low <= config[key] <= high]
        if config.get("stable_steps", 0) >= window:
            errors.append(f"stable_steps: must be < up_scale_window ({window}), got {config['stable_steps']}")
        if errors:
            raise ValueError(f"{prefix}: " + "; ".join(errors))
        self.automatic_update = config["automatic_update"]
        self.up_scale_window = int(window)  # a numpy int passes the schema; checkpoints want int
        self.min_loss_scale, self.max_loss_scale = low, high
        self._initial_loss_scale = config.get("initial_loss_scale", config["loss_scale"])
        self._loss_scale = config["loss_scale"]
        self._stable_steps = int(config.get("stable_steps", 0))

    def _reset(self):
        super()._reset()
        self._stable_steps = 0

    def _from_counters(self, counters: Counters) -> None:
        self._loss_scale, self._stable_steps = counters.loss_scale, int(counters.stable_steps)

    def _into_counters(self, counters: Counters) -> Counters:
        return counters._replace(stable_steps=float(self._stable_steps), loss_scale=self._loss_scale)

    def update(self, train_step_info) -> float:
        self._sync_from_device()
        if self.automatic_update:
            if train_step_info.all_finite:
                self._stable_steps += 1
                if self._stable_steps >= self.up_scale_window:
                    self._loss_scale = min(self.max_loss_scale, 2.0 * self._loss_scale)
                    self._stable_steps = 0
            else:
                self._loss_scale = max(self.min_loss_scale, self._loss_scale / 2.0)
                self._stable_steps = 0
        self._write_to_device()
        return self._loss_scale

    def state_dict(self) -> dict:
        """Settings, current scale and finite-update count (plain values, for checkpoints)."""
        self._sync_from_device()
        return {"type": type(self).__name__, "automatic_update": self.automatic_update,
                "initial_loss_scale": self._initial_loss_scale, "loss_scale": self._loss_scale,
                "up_scale_window": self.up_scale_window, "min_loss_scale": self.min_loss_scale,
                "max_loss_scale": self.max_loss_scale, "stable_steps": self._stable_steps}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore ``state_dict()`` output; like torch's GradScaler, the checkpoint's settings win."""
        prefix = check_component_state(self, state)
        self._sync_from_device()
        self._configure(prefix, {key: value for key, value in state.items() if key != "type"})
        self._write_to_device()
