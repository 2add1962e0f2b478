"""The machinery FusedAdam and FusedLamb share: a torch.optim.Optimizer over a `FlatStore`, its
param groups checked as apex's, steps run as calls into the flat implementations over runs of
parameters, and state_dicts in torch.optim.Adam's layout."""
import math
import numbers

import numpy as np
import torch

from .._optimizers.hyper import Hyper
from ._flat_store import STATE_KEYS, FlatStore, runs


def check_real(where, name, value, minimum, *, above=False, maximum=None):
    """A real number (not a bool) >= minimum (> when ``above``), < maximum when given."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise TypeError(f"{where}: {name} must be a real number, got {value!r}")
    low_ok = value > minimum if above else value >= minimum
    if not low_ok or (maximum is not None and not value < maximum):
        bounds = f"{'>' if above else '>='} {minimum}" + (f" and < {maximum}" if maximum else "")
        raise ValueError(f"{where}: {name} must be {bounds}, got {value!r}")


def check_bool(where, name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be True or False, got {value!r}")


class FusedOptimizer(torch.optim.Optimizer):
    """What FusedAdam and FusedLamb share: the flat store, validation, runs, state dicts."""

    _family: str  # the implementation's family, 'adam' or 'lamb'

    def __init__(self, params, defaults, set_grad_none):
        check_bool(type(self).__name__, "set_grad_none", set_grad_none)
        self.set_grad_none = set_grad_none
        self._store = None
        super().__init__(params, defaults)
        self._pack()

    # ------------------------------------------------------------------------------------------
    # Validation
    # ------------------------------------------------------------------------------------------

    def _check_group(self, index, group):
        """Rejects a param group (defaults filled in) whose hyperparameters cannot run."""
        where = f"{type(self).__name__}: param group {index}"
        check_real(where, "lr", group["lr"], 0.0)
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise TypeError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
        for name, beta in zip(("betas[0]", "betas[1]"), betas):
            check_real(where, name, beta, 0.0, maximum=1.0)
        check_real(where, "eps", group["eps"], 0.0)
        check_real(where, "weight_decay", group["weight_decay"], 0.0)
        check_bool(where, "bias_correction", group["bias_correction"])
        for name in ("amsgrad", "maximize"):  # keys of torch.optim.Adam's groups
            if group.get(name, False):
                raise ValueError(f"{where}: {name}={group[name]!r} is not supported (apex's "
                                 f"{type(self).__name__} has no such variant)")

    def _check_groups(self, groups):
        """Every group, and what must agree across groups."""
        for index, group in enumerate(groups):
            self._check_group(index, group)

    def _check_params(self):
        """Every parameter: fp32, not empty, each once, all on one CPU or CUDA device."""
        name, seen, device = type(self).__name__, set(), None
        for index, group in enumerate(self.param_groups):
            for position, p in enumerate(group["params"]):
                where = f"{name}: param group {index}, parameter {position}"
                if p.dtype != torch.float32:
                    raise TypeError(f"{where} is {p.dtype}: only torch.float32 parameters are "
                                    f"supported (the flat buffers are fp32)")
                if p.layout != torch.strided:
                    raise TypeError(f"{where} has layout {p.layout}: only dense parameters are "
                                    f"supported")
                if p.numel() == 0:
                    raise ValueError(f"{where} has no elements (shape {tuple(p.shape)}): a flat "
                                     f"buffer cannot hold it, leave it out")
                if p.device.type not in ("cpu", "cuda"):
                    raise ValueError(f"{where} is on {p.device}: expected a 'cpu' or 'cuda' device")
                if device is not None and p.device != device:
                    raise ValueError(f"{where} is on {p.device}, the others on {device}: all "
                                     f"parameters must be on one device (use one optimizer "
                                     f"per device)")
                if p in seen:
                    raise ValueError(f"{where} appears twice in the optimizer's parameters")
                seen.add(p)
                device = p.device

    def _flat_hyper(self, group) -> Hyper:
        """The implementation's hyperparameters (ORT's names, typed) of one valid param group."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------
    # Param groups, layout, state dicts
    # ------------------------------------------------------------------------------------------

    def add_param_group(self, param_group):
        """torch.optim's, then checked and packed into (new, larger) flat buffers; a rejected group
        is removed again."""
        super().add_param_group(param_group)
        try:
            self._check_groups(self.param_groups)
            self._check_params()
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise
        if self._store is not None:
            self._pack()

    def _pack(self):
        """Lays the parameters and their state out in the flat buffers (new ones unless the
        parameters are those of the current buffers): each parameter's ``.data`` and state become
        views, a parameter without state gets zeros and step 0."""
        params = [p for group in self.param_groups for p in group["params"]]
        if not params:
            raise ValueError(f"{type(self).__name__}: the param groups hold no parameter")
        seg_group = [index for index, group in enumerate(self.param_groups) for _ in group["params"]]
        store = self._store
        if store is None or not store.matches(params):
            store = FlatStore(params, seg_group, params[0].device, self._family)
        with torch.no_grad(), store.on_device():
            for i, p in enumerate(params):
                view = store.views["params"][i]
                if p.data_ptr() != view.data_ptr():
                    view.copy_(p.detach())
                    p.data = view
                state = self.state.get(p)  # .get: the defaultdict adds no entry
                if state:
                    for key in STATE_KEYS:
                        store.views[key][i].copy_(state[key].reshape(p.shape))
                    store.steps[i] = float(state["step"])
                    self.state[p] = self._views(store, i)
                else:
                    for key in STATE_KEYS:
                        store.views[key][i].zero_()
                    store.steps[i] = 0.0
                    self.state.pop(p, None)
        self._store = store

    @staticmethod
    def _views(store, i):
        """Parameter i's state as torch.optim.Adam holds it, made of views of the flat state."""
        return {"step": store.step_views[i], **{key: store.views[key][i] for key in STATE_KEYS}}

    def load_state_dict(self, state_dict):
        """torch.optim's, checked first (a rejected dict changes nothing); then the state is copied
        into the flat buffers. Hyperparameters the dict lacks (``bias_correction`` in a
        torch.optim.Adam dict) keep their current values."""
        self._check_loadable(state_dict)
        current = [{key: value for key, value in group.items() if key != "params"}
                   for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, kept in zip(self.param_groups, current):
            for key, value in kept.items():
                group.setdefault(key, value)
        self._pack()

    def _check_loadable(self, state_dict):
        name = f"{type(self).__name__}.load_state_dict"
        if (not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys()
                or not isinstance(state_dict["state"], dict)):
            raise ValueError(f"{name}: expected a dict with 'state' (a dict) and 'param_groups', "
                             f"got {type(state_dict).__name__}")
        saved_groups = state_dict["param_groups"]
        if not all(isinstance(saved, dict) and "params" in saved for saved in saved_groups):
            raise ValueError(f"{name}: every entry of 'param_groups' must be a dict with 'params'")
        if len(saved_groups) != len(self.param_groups) or any(
                len(saved["params"]) != len(group["params"])
                for saved, group in zip(saved_groups, self.param_groups)):
            raise ValueError(
                f"{name}: the dict's param groups hold {[len(g['params']) for g in saved_groups]} "
                f"parameters, this optimizer's {[len(g['params']) for g in self.param_groups]}")
        self._check_groups([{**group, **saved} for saved, group in zip(saved_groups, self.param_groups)])
        ids = [i for saved in saved_groups for i in saved["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, p in zip(ids, params):
            state = state_dict["state"].get(saved_id)
            if not state:
                continue
            where = f"{name}: state of parameter {saved_id}"
            missing = sorted({"step", *STATE_KEYS} - set(state))
            if missing:
                raise ValueError(f"{where} lacks {missing} (has {sorted(state)})")
            for key in STATE_KEYS:
                value = state[key]
                if not isinstance(value, torch.Tensor) or value.shape != p.shape:
                    got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
                    raise ValueError(f"{where}: {key} must be a tensor of the parameter's shape "
                                     f"{tuple(p.shape)}, got {got}")
            step = state["step"]
            if isinstance(step, torch.Tensor):
                step = step.item() if step.numel() == 1 else None
            if (isinstance(step, bool) or not isinstance(step, numbers.Real) or not step >= 0
                    or step != int(step)):
                raise ValueError(f"{where}: step must be a whole number >= 0, got {state['step']!r}")

    def zero_grad(self, set_to_none=None):
        """torch.optim's; ``set_to_none`` defaults to the constructor's ``set_grad_none``."""
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)

    # ------------------------------------------------------------------------------------------
    # Step
    # ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient. Returns the closure's loss, if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        store = self._store
        self._check_groups(self.param_groups)
        hypers = tuple(self._flat_hyper(group) for group in self.param_groups)
        grads, moved = self._collect(store)
        present = np.array([grad is not None for grad in grads], dtype=bool)
        if not present.any():
            return loss
        lrs = np.array([float(group["lr"]) for group in self.param_groups])
        with store.on_device():
            for i in moved:  # the user set .data: it is taken back into the buffer
                store.views["params"][i].copy_(store.params[i].detach())
                store.params[i].data = store.views["params"][i]
            torch._foreach_copy_([store.views["grads"][i] for i in np.flatnonzero(present)],
                                 [grad for grad in grads if grad is not None])
            context = self._prepare(store, present)
            t = store.steps + 1
            for lo, hi in runs(present, t, lrs[store.seg_group]):
                part = slice(int(store.offsets[lo]), int(store.offsets[hi]))
                self._update(store, lo, hi, store.table(lo, hi, hypers), part, step=int(t[lo]),
                             lr=float(lrs[store.seg_group[lo]]), context=context)
        store.steps[present] += 1
        for i in np.flatnonzero(present & (store.steps == 1)):
            self.state[store.params[i]] = self._views(store, i)
        return loss

    def _collect(self, store):
        """(each parameter's gradient or None, indices of parameters whose .data was replaced),
        everything checked before anything changes."""
        name, grads, moved = type(self).__name__, [], []
        for i, p in enumerate(store.params):
            if p.data_ptr() != store.data_ptrs[i] or p.shape != store.shapes[i]:
                if p.shape != store.shapes[i] or p.device != store.device or p.dtype != torch.float32:
                    raise ValueError(
                        f"{name}: parameter {i} was replaced by a {p.dtype} tensor of shape "
                        f"{tuple(p.shape)} on {p.device}; expected torch.float32, shape "
                        f"{tuple(store.shapes[i])} on {store.device} (build the optimizer after "
                        f"moving or converting the model)")
                moved.append(i)
            grad = p.grad
            if grad is not None and grad.layout != torch.strided:
                raise TypeError(f"{name}: parameter {i} has a {grad.layout} gradient: sparse "
                                f"gradients are not supported")
            grads.append(grad)
        return grads, moved

    def _prepare(self, store, present):
        """Work over all gradients before the runs (Lamb: the global norm); returns what the runs
        need of it."""
        return None

    def _update(self, store, lo, hi, table, part, *, step, lr, context):
        """Updates segments [lo, hi) (elements ``part``) with the implementation."""
        raise NotImplementedError
