"""``FusedAdam`` and ``FusedLamb``: ``torch.optim.Optimizer``s with apex's names, defaults and math,
run by the flat-buffer implementations the trainer uses (``_optim_cpu``, ``_kernels``).

Why flat: one call updates every parameter (one CUDA launch per phase, cache-sized blocks on the
CPU), and Lamb's per-tensor trust ratio comes from the segment table. PyTorch has no Lamb; apex's
needs a CUDA build. The parameters stay the user's tensors: their ``.data`` becomes a view of one
fp32 buffer, and the per-parameter state (``step``, ``exp_avg``, ``exp_avg_sq``) is made of views
of the flat state, so ``state_dict()`` has the layout of ``torch.optim.Adam``'s.

Gradients are copied into a private flat buffer each step (after ``zero_grad(set_to_none=True)``
backward allocates fresh ones, so a copy is needed anyway; private, it may take Adam's L2 term).
A parameter whose ``grad`` is None is skipped and its step count not advanced, as in torch.optim:
each call into the implementation covers a run of consecutive parameters that have a gradient
and share their step count and learning rate (one run, the whole buffer, in the usual case).
"""
from __future__ import annotations

import contextlib
import math
import numbers
from collections import OrderedDict

import numpy as np
import torch

from .._flat import FlatLayout
from .._optimizers import _implementation

__all__ = ["FusedAdam", "FusedLamb"]

_STATE_KEYS = ("exp_avg", "exp_avg_sq")

# Tables of runs other than the whole buffer are kept while their sizes add up to at most this many
# times the buffer (Lamb's tables hold a direction buffer as large as their run).
_CACHED_TABLE_SIZES = 2


def _runs(present, steps, lrs):
    """(lo, hi) segment ranges: the maximal runs of parameters with a gradient and equal step
    count and learning rate."""
    change = (present[1:] != present[:-1]) | (steps[1:] != steps[:-1]) | (lrs[1:] != lrs[:-1])
    bounds = [0, *(np.flatnonzero(change) + 1).tolist(), len(present)]
    return [(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]) if present[lo]]


class _FlatStore:
    """The flat buffers of one optimizer (torch tensors on one device, and the NumPy or CuPy arrays
    the implementation takes), each parameter's views of them, the step counts, and the layout
    tables of the runs seen lately."""

    def __init__(self, params, seg_group, device, family):
        self.params = params
        self.seg_group = np.asarray(seg_group, dtype=np.int64)
        self.device = device
        self.family = family
        self.implementation, self.xp = _implementation(device.type, "FusedOptimizer")
        self.shapes = [p.shape for p in params]
        sizes = [p.numel() for p in params]
        self.offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        size = int(self.offsets[-1])
        names = ("params", "grads", *_STATE_KEYS)
        self.tensors = {name: torch.zeros(size, dtype=torch.float32, device=device) for name in names}
        self.arrays = {name: self._array(tensor) for name, tensor in self.tensors.items()}
        self.views = {name: [tensor[a:b].view(shape) for a, b, shape in
                             zip(self.offsets[:-1], self.offsets[1:], self.shapes)]
                      for name, tensor in self.tensors.items()}
        self.steps = np.zeros(len(params), dtype=np.float32)  # torch.optim's float32 step counts
        steps = torch.from_numpy(self.steps)
        self.step_views = [steps[i] for i in range(len(params))]
        self.data_ptrs = [view.data_ptr() for view in self.views["params"]]
        self.hypers = None  # the groups' flat hyperparameters the tables were built for
        self.tables = OrderedDict()  # (lo, hi) -> layout table

    def _array(self, tensor):
        return tensor.numpy() if self.device.type == "cpu" else self.xp.from_dlpack(tensor)

    def matches(self, params):
        return (len(params) == len(self.params) and all(p is q for p, q in zip(params, self.params))
                and all(p.shape == shape for p, shape in zip(params, self.shapes)))

    def on_device(self):
        """Context of the implementation's calls: CuPy on the parameters' device and torch's current
        stream there, so that its kernels queue behind the gradients' producers."""
        if self.device.type == "cpu":
            return contextlib.nullcontext()
        index = self.device.index
        stack = contextlib.ExitStack()
        stack.enter_context(self.xp.cuda.Device(index))
        stream = torch.cuda.current_stream(self.device).cuda_stream
        stack.enter_context(self.xp.cuda.ExternalStream(stream, index))
        return stack

    def group_spans(self, lo, hi):
        """(group index, first segment, one past the last) of each param group in [lo, hi)."""
        groups = self.seg_group[lo:hi]
        cuts = [0, *(np.flatnonzero(groups[1:] != groups[:-1]) + 1).tolist(), hi - lo]
        return [(int(groups[a]), lo + a, lo + b) for a, b in zip(cuts[:-1], cuts[1:])]

    def table(self, lo, hi, hypers):
        """The implementation's layout table of segments [lo, hi) (built once per hyperparameters)."""
        if hypers != self.hypers:
            self.tables.clear()
            self.hypers = hypers
        key = (lo, hi)
        if key in self.tables:
            self.tables.move_to_end(key)
            return self.tables[key]
        sizes, group_hypers = [], []
        for group, a, b in self.group_spans(lo, hi):
            sizes.append(np.diff(self.offsets[a:b + 1]).tolist())
            group_hypers.append(hypers[group])
        table = self.implementation.layout_table(FlatLayout.from_sizes(sizes, group_hypers),
                                                 self.family)
        self.tables[key] = table
        budget = _CACHED_TABLE_SIZES * int(self.offsets[-1])
        while sum(int(self.offsets[b] - self.offsets[a]) for a, b in self.tables) > budget:
            self.tables.popitem(last=False)
        return table


def _check_real(where, name, value, minimum, *, above=False, maximum=None):
    """A real number (not a bool) >= minimum (> when ``above``), < maximum when given."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise TypeError(f"{where}: {name} must be a real number, got {value!r}")
    low_ok = value > minimum if above else value >= minimum
    if not low_ok or (maximum is not None and not value < maximum):
        bounds = f"{'>' if above else '>='} {minimum}" + (f" and < {maximum}" if maximum else "")
        raise ValueError(f"{where}: {name} must be {bounds}, got {value!r}")


def _check_bool(where, name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be True or False, got {value!r}")


class _FusedOptimizer(torch.optim.Optimizer):
    """What FusedAdam and FusedLamb share: the flat store, validation, runs, state dicts."""

    _family: str  # the implementation's family, 'adam' or 'lamb'

    def __init__(self, params, defaults, set_grad_none):
        _check_bool(type(self).__name__, "set_grad_none", set_grad_none)
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
        _check_real(where, "lr", group["lr"], 0.0)
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise TypeError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
        for name, beta in zip(("betas[0]", "betas[1]"), betas):
            _check_real(where, name, beta, 0.0, maximum=1.0)
        _check_real(where, "eps", group["eps"], 0.0)
        _check_real(where, "weight_decay", group["weight_decay"], 0.0)
        _check_bool(where, "bias_correction", group["bias_correction"])
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

    def _flat_hyper(self, group) -> dict:
        """The implementation's hyperparameters (ORT's names) of one valid param group."""
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
            store = _FlatStore(params, seg_group, params[0].device, self._family)
        with torch.no_grad(), store.on_device():
            for i, p in enumerate(params):
                view = store.views["params"][i]
                if p.data_ptr() != view.data_ptr():
                    view.copy_(p.detach())
                    p.data = view
                state = self.state.get(p)  # .get: the defaultdict adds no entry
                if state:
                    for key in _STATE_KEYS:
                        store.views[key][i].copy_(state[key].reshape(p.shape))
                    store.steps[i] = float(state["step"])
                    self.state[p] = self._views(store, i)
                else:
                    for key in _STATE_KEYS:
                        store.views[key][i].zero_()
                    store.steps[i] = 0.0
                    self.state.pop(p, None)
        self._store = store

    @staticmethod
    def _views(store, i):
        """Parameter i's state as torch.optim.Adam holds it, made of views of the flat state."""
        return {"step": store.step_views[i], **{key: store.views[key][i] for key in _STATE_KEYS}}

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
            missing = sorted({"step", *_STATE_KEYS} - set(state))
            if missing:
                raise ValueError(f"{where} lacks {missing} (has {sorted(state)})")
            for key in _STATE_KEYS:
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
            for lo, hi in _runs(present, t, lrs[store.seg_group]):
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


class FusedAdam(_FusedOptimizer):
    """Adam over flat buffers, with the arguments and math of apex's ``FusedAdam``.

    ``adam_w_mode=True`` (default) is ``torch.optim.AdamW`` (decoupled decay); ``False`` is
    ``torch.optim.Adam`` (L2: ``g + weight_decay * w``, added to a private copy of the gradient).
    ``bias_correction=False`` drops ``1 - beta**t``. CPU: torch's fused CPU kernels over the flat
    buffer; CUDA: one kernel launch (CuPy). ``amsgrad=True`` is refused, as by apex. Differences
    from apex: fp32 parameters only; the step count is per parameter (``torch.optim.Adam``'s), not
    per group, which only matters for parameters that miss gradients.

    ``state_dict()`` loads into ``torch.optim.AdamW`` (``Adam`` with ``adam_w_mode=False``) and
    theirs into this: per parameter ``step``, ``exp_avg``, ``exp_avg_sq``; each group carries
    ``decoupled_weight_decay`` for torch.
    """

    _family = "adam"

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True):
        _check_bool("FusedAdam", "adam_w_mode", adam_w_mode)
        _check_bool("FusedAdam", "amsgrad", amsgrad)
        if amsgrad:
            raise ValueError("FusedAdam: amsgrad=True is not supported (nor is it by apex's "
                             "FusedAdam)")
        self.adam_w_mode = adam_w_mode
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults, set_grad_none)

    def _check_group(self, index, group):
        super()._check_group(index, group)
        decoupled = group.get("decoupled_weight_decay", self.adam_w_mode)
        if decoupled != self.adam_w_mode:
            raise ValueError(
                f"FusedAdam: param group {index}: decoupled_weight_decay={decoupled!r} (from "
                f"torch.optim.{'AdamW' if decoupled else 'Adam'}) needs "
                f"FusedAdam(adam_w_mode={decoupled!r}), this one has adam_w_mode={self.adam_w_mode!r}")

    def _flat_hyper(self, group):
        beta1, beta2 = group["betas"]
        return dict(alpha=float(beta1), beta=float(beta2), epsilon=float(group["eps"]),
                    lambda_coef=float(group["weight_decay"]) if self.adam_w_mode else 0.0,
                    do_bias_correction=group["bias_correction"], weight_decay_mode=0)

    def state_dict(self):
        """torch.optim's, each group with ``decoupled_weight_decay`` = ``adam_w_mode``: without it
        torch.optim.AdamW would load the groups as L2 Adam."""
        state_dict = super().state_dict()
        for group in state_dict["param_groups"]:
            group["decoupled_weight_decay"] = self.adam_w_mode
        return state_dict

    def _update(self, store, lo, hi, table, part, *, step, lr, context):
        grads, params = store.tensors["grads"], store.tensors["params"]
        if not self.adam_w_mode:  # L2: g += weight_decay * w, in the private gradient copy
            for group, a, b in store.group_spans(lo, hi):
                decay = float(self.param_groups[group]["weight_decay"])
                if decay:
                    span = slice(int(store.offsets[a]), int(store.offsets[b]))
                    grads[span].add_(params[span], alpha=decay)
        arrays = store.arrays
        store.implementation.adam_step(
            table, arrays["params"][part], arrays["grads"][part], arrays["exp_avg"][part],
            arrays["exp_avg_sq"][part], step=step, lr=lr)


class FusedLamb(_FusedOptimizer):
    """LAMB over flat buffers, with the arguments and math of apex's ``FusedLAMB``.

    Gradients are divided by ``max(1, ||g|| / max_grad_norm)`` (global norm over every gradient);
    then Adam's direction plus ``weight_decay * w``, and the per-tensor trust ratio
    ``||w|| / ||d||`` (1 where either is 0), applied only to groups with ``weight_decay != 0``
    unless ``use_nvlamb``. ``grad_averaging`` scales the gradient's share of ``exp_avg`` by
    ``1 - beta1``. ``max_grad_norm`` may be ``math.inf`` (no clipping) and must be the same in
    every group (the norm is global).

    Differences from apex: fp32 parameters only; ``adam_w_mode=False`` and
    ``grad_averaging=False`` are refused (the flat implementations do not have them); the step
    count is per parameter, as in torch.optim, not per group; where the direction or the new
    weight is not finite, the moments or the weight keep their old values (ORT's LambOptimizer
    rules) instead of propagating NaN.
    """

    _family = "lamb"

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
                 weight_decay=0.01, amsgrad=False, adam_w_mode=True, grad_averaging=True,
                 set_grad_none=True, max_grad_norm=1.0, use_nvlamb=False):
        for name, value in (("amsgrad", amsgrad), ("adam_w_mode", adam_w_mode),
                            ("use_nvlamb", use_nvlamb)):
            _check_bool("FusedLamb", name, value)
        if amsgrad:
            raise ValueError("FusedLamb: amsgrad=True is not supported (nor is it by apex's "
                             "FusedLAMB)")
        if not adam_w_mode:
            raise ValueError("FusedLamb: adam_w_mode=False (L2 decay inside the moments) is not "
                             "supported: only decoupled weight decay, adam_w_mode=True")
        self.adam_w_mode = adam_w_mode
        self.use_nvlamb = use_nvlamb
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        max_grad_norm=max_grad_norm)
        super().__init__(params, defaults, set_grad_none)

    def _check_group(self, index, group):
        super()._check_group(index, group)
        where = f"FusedLamb: param group {index}"
        _check_bool(where, "grad_averaging", group["grad_averaging"])
        if not group["grad_averaging"]:
            raise ValueError(f"{where}: grad_averaging=False is not supported: exp_avg always "
                             f"takes (1 - beta1) * g")
        _check_real(where, "max_grad_norm", group["max_grad_norm"], 0.0, above=True)

    def _check_groups(self, groups):
        super()._check_groups(groups)
        norms = [group["max_grad_norm"] for group in groups]
        if len(set(norms)) > 1:
            raise ValueError(f"FusedLamb: every param group must have the same max_grad_norm (the "
                             f"gradient norm is global), got {norms}")

    def _flat_hyper(self, group):
        beta1, beta2 = group["betas"]
        decay = float(group["weight_decay"])
        ratio_min, ratio_max = (0.0, math.inf) if self.use_nvlamb or decay else (1.0, 1.0)
        return dict(alpha=float(beta1), beta=float(beta2), epsilon=float(group["eps"]),
                    lambda_coef=decay, ratio_min=ratio_min, ratio_max=ratio_max,
                    do_bias_correction=group["bias_correction"])

    def _prepare(self, store, present):
        """The clip divisor: the norm counts the gradients of this step only."""
        if not present.all():
            torch._foreach_zero_([store.views["grads"][i] for i in np.flatnonzero(~present)])
        divisor, _ = store.implementation.clip_divisor(store.arrays["grads"],
                                                       float(self.param_groups[0]["max_grad_norm"]))
        return divisor

    def _update(self, store, lo, hi, table, part, *, step, lr, context):
        arrays = store.arrays
        store.implementation.lamb_step(
            table, arrays["params"][part], arrays["grads"][part], arrays["exp_avg"][part],
            arrays["exp_avg_sq"][part], step=step, lr=lr, grad_divisor=context)
