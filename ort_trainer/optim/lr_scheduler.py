"""Learning-rate schedulers of the original API: linear warmup, then constant, cosine, linear or polynomial decay.

Step numbering: ``factor(t, base_lr)`` is the original formula in ``t``, with ``W = warmup * total_steps``
(a float) and a warmup factor ``t / max(1, W)`` while ``t < W``; ``lr_at(base_lr, t)`` is ``base_lr * factor``.
The trainer calls ``_step(train_step_info)`` once per train_step, *before* it increments
``train_step_info.optimization_step`` (the number of updates already applied), and ``get_lr`` evaluates
the formula at ``t = optimization_step + 1``: the k-th update (k = 1, 2, ...) uses ``t = k``.

Legacy quirk fixed: the original evaluated the formula at ``t = optimization_step``, so its first update
had lr 0 whenever ``W > 0``. Here the first update uses ``1 / max(1, W)`` of the base lr, and update
number ``total_steps`` is the one that reaches the end of the decay (Linear and Cosine 0, Poly ``lr_end``).
"""
import math
from collections.abc import Callable, Mapping

from .._checkpoint_files import check_component_state
from .._configuration.validation import validate
from ..amp._device_counters import Counters, DeviceCounters, KeptOnDevice


class _LRScheduler(KeptOnDevice):
    """Validation, warmup, stepping and state shared by the schedulers; subclasses define ``_decay``.

    Every scheduler takes ``total_steps`` (the number of optimizer updates in the schedule, an int
    > 0) and ``warmup`` (the fraction of ``total_steps`` spent warming up, in [0, 1)). Differs from
    the original: the k-th update uses ``t = k`` (the original's first update had lr 0).
    """

    def __init__(self, **config):
        self._configure(f"Invalid {type(self).__name__}", config)

    def _configure(self, prefix: str, config: dict) -> None:
        """Validate, then set the hyperparameters (and ``last_lr``, from a state dict) all at once."""
        config = validate("lr_scheduler", config, prefix)
        config["total_steps"] = int(config["total_steps"])  # a numpy int passes the schema; checkpoints want int
        self._last_lr = config.pop("last_lr", None)
        self._config = config
        for key, value in config.items():
            setattr(self, key, value)

    @property
    def warmup_steps(self) -> float:
        """``W = warmup * total_steps``: updates with ``t < W`` ramp up linearly."""
        return self.warmup * self.total_steps

    def factor(self, t: float, base_lr: float) -> float:
        """lr / base_lr at step ``t`` (the original formula; only Poly's depends on ``base_lr``)."""
        warmup_steps = self.warmup_steps
        return t / max(1.0, warmup_steps) if t < warmup_steps else self._decay(t, base_lr)

    def _decay(self, t: float, base_lr: float) -> float:
        raise NotImplementedError

    def lr_at(self, base_lr: float, t: float) -> float:
        """The learning rate at step ``t`` (``t = k`` for the k-th update, see the module docstring)."""
        return base_lr * self.factor(t, base_lr)

    def get_lr(self, train_step_info) -> list[float]:
        """``[lr]`` for the update about to be applied, given ``optimization_step`` updates applied so far."""
        return [self.lr_at(train_step_info.optimizer_config.lr, train_step_info.optimization_step + 1)]

    def _step(self, train_step_info) -> list[float]:
        """Called by the trainer before an update is applied and counted in ``optimization_step``."""
        self._last_lr = self.get_lr(train_step_info)
        return self._last_lr

    def _decided_on_device(self, device: DeviceCounters, lr_of_update: Callable[[int], float]) -> None:
        """From now on the updates are decided on the device, each with ``lr_of_update(t)`` for
        t = 1, 2, ... (the schedule evaluated ahead, ``_trainer.device_scaling``): the last lr is
        read back from ``device``'s counters after an update."""
        self._lr_of_update = lr_of_update
        self._keep_on_device(device)

    def _from_counters(self, counters: Counters) -> None:
        """The lr the last update was given, applied or skipped (t = applied + 1 for a skipped one)."""
        applied = int(counters.updates_applied)
        self._last_lr = [self._lr_of_update(applied if counters.last_finite == 1.0 else applied + 1)]

    def get_last_lr(self) -> list[float]:
        """``[lr]`` of the last update."""
        self._sync_from_device()
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__}.get_last_lr(): no update yet; the first train_step sets it")
        return list(self._last_lr)

    def state_dict(self) -> dict:
        """Hyperparameters and the last lr (plain values, for checkpoints)."""
        self._sync_from_device()
        last_lr = None if self._last_lr is None else list(self._last_lr)
        return {"type": type(self).__name__, **self._config, "last_lr": last_lr}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore ``state_dict()`` output; like torch's schedulers, the checkpoint's hyperparameters win."""
        prefix = check_component_state(self, state)
        self._sync_from_device()  # the loaded last lr is the newest one
        self._configure(prefix, {key: state[key] for key in [*self._config, "last_lr"]})


class ConstantWarmupLRScheduler(_LRScheduler):
    """Linear warmup, then the base lr (``total_steps``, ``warmup``: see ``_LRScheduler``)."""

    def __init__(self, total_steps, warmup=0.002):
        super().__init__(total_steps=total_steps, warmup=warmup)

    def _decay(self, t, base_lr):
        return 1.0


class CosineWarmupLRScheduler(_LRScheduler):
    """Linear warmup, then ``max(0, 0.5 * (1 + cos(2 * pi * cycles * p)))``, ``p = (t - W) / max(1, total - W)``.

    With the default half cycle the lr reaches 0 at ``t = total_steps``; as in the original, the cosine
    goes on past it (it rises again). ``cycles``: the number of cosine periods over the decay, > 0
    (``total_steps``, ``warmup``: see ``_LRScheduler``).
    """

    def __init__(self, total_steps, cycles=0.5, warmup=0.002):
        super().__init__(total_steps=total_steps, cycles=cycles, warmup=warmup)

    def _decay(self, t, base_lr):
        progress = (t - self.warmup_steps) / max(1.0, self.total_steps - self.warmup_steps)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * self.cycles * 2.0 * progress)))


class LinearWarmupLRScheduler(_LRScheduler):
    """Linear warmup, then ``max(0, (total - t) / max(1, total - W))``: 0 from ``t = total_steps`` on
    (``total_steps``, ``warmup``: see ``_LRScheduler``)."""

    def __init__(self, total_steps, warmup=0.002):
        super().__init__(total_steps=total_steps, warmup=warmup)

    def _decay(self, t, base_lr):
        return max(0.0, (self.total_steps - t) / max(1.0, self.total_steps - self.warmup_steps))


class PolyWarmupLRScheduler(_LRScheduler):
    """Linear warmup, then ``lr = (base_lr - lr_end) * (1 - (t - W) / (total - W)) ** power + lr_end``,
    and ``lr_end`` after ``total_steps``.

    Args (besides ``total_steps`` and ``warmup``, see ``_LRScheduler``):
        lr_end: final learning rate, >= 0 and below the optimizer's lr.
        power: exponent of the decay, >= 0 (1: linear).

    An optimizer lr <= ``lr_end`` raises ValueError naming both (the original's assert message
    itself failed, with a NameError).
    """

    def __init__(self, total_steps, lr_end=1e-7, power=1.0, warmup=0.002):
        super().__init__(total_steps=total_steps, lr_end=lr_end, power=power, warmup=warmup)

    def factor(self, t, base_lr):
        if not base_lr > self.lr_end:
            raise ValueError(f"Invalid {type(self).__name__}: lr_end: must be < the optimizer's lr ({base_lr!r}), "
                             f"got {self.lr_end!r}")
        return super().factor(t, base_lr)

    def _decay(self, t, base_lr):
        if t > self.total_steps:
            return self.lr_end / base_lr
        remaining = 1.0 - (t - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        return ((base_lr - self.lr_end) * remaining**self.power + self.lr_end) / base_lr
