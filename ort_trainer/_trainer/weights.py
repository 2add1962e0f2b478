"""The trainer's weights: which parameters it trains (fixed when it is created), and what it lays out
at its first compile: the flat parameter and gradient buffers, the optimizer over them, and the
untrained weights the graphs read as they are."""
import contextlib
import warnings

import torch

from .._export.trace import graph_name
from .._optimizers.algorithms import typed_hypers
from .._optimizers.flat import FlatParameters
from . import checkpoint as _checkpoint


class TrainerWeights:
    """`untrained`: torch names of the parameters the trainer does not train (utils.frozen_weights
    and those that do not require grad when the trainer is created). Until `lay_out` (the first
    compile) `flat` and `optimizer` are None and a loaded optimizer state waits in `pending`."""

    def __init__(self, model, frozen_weights, optim_config):
        named = dict(model.named_parameters())
        unknown = sorted(set(frozen_weights) - set(named))
        if unknown:
            raise ValueError(f"Invalid options: utils.frozen_weights names unknown parameters {unknown}; "
                             f"the model's parameters are {_first(named)}")
        self.untrained = set(frozen_weights) | {name for name, p in named.items() if not p.requires_grad}
        not_float32 = {name: p.dtype for name, p in named.items()
                       if name not in self.untrained and p.dtype != torch.float32}
        if not_float32:
            raise TypeError(f"ORTTrainer trains float32 parameters (one flat fp32 buffer); got {not_float32}: "
                            "call model.float(), or freeze them (utils.frozen_weights)")
        # Validates param groups now (unknown names fail here, before any work).
        optim_config.resolve_groups([name for name in named if name not in self.untrained], self.untrained)
        self._model, self._optim_config = model, optim_config
        self._requires_grad = [(name, p, p.requires_grad) for name, p in named.items()]
        self.flat = self.optimizer = self._scratch = None
        self.read_only = {}  # graph name -> untrained weight the graphs read (bound as it is)
        self.pending = None  # an optimizer state loaded before the first compile

    def check_requires_grad(self):
        """The trained set is fixed when the trainer is created: a requires_grad changed since is
        refused (the flat buffers would keep training, or never train, that parameter)."""
        changed = [name for name, parameter, requires_grad in self._requires_grad
                   if parameter.requires_grad != requires_grad]
        if changed:
            raise ValueError(f"requires_grad of parameters {_first(changed)} changed since the trainer was created: "
                             "the parameters it trains are fixed then (those that require grad, less "
                             "utils.frozen_weights). Create a new ORTTrainer to train another set")

    def lay_out(self, graph_names, placement, distributed):
        """The flat buffers and the optimizer (on `placement`, as `distributed` shards it) for the
        parameters the first graph reads (`graph_names`; unused ones stay untouched, as in torch),
        with any optimizer state loaded before."""
        named = dict(self._model.named_parameters())
        used = {name for name in named if graph_name(name) in graph_names}
        unused = sorted(set(named) - used - self.untrained)
        if unused:
            warnings.warn(f"parameters {unused} are not used by the model's forward/loss and will not be trained")
        trainable = [name for name in named if name in used and name not in self.untrained]
        if not trainable:
            raise ValueError("the model has no trainable parameter used by its forward/loss")
        groups = [(names, hyper) for names, hyper in
                  self._optim_config.resolve_groups(trainable, set(named) - set(trainable)) if names]
        groups = list(zip([names for names, _ in groups],
                          typed_hypers(self._optim_config.name, [hyper for _, hyper in groups])))
        with placement.allocating():
            self.flat = FlatParameters(named, groups, placement.xp)
            self.optimizer = distributed.make_optimizer(self._optim_config.name, self.flat)
        self._read_as_they_are(named, sorted(self.untrained & used))
        if self.pending is not None and self.pending["state"]:
            _checkpoint.load_optimizer_state(self.flat, self.optimizer, self.pending)
        self.pending = None

    def check_same_parameters(self, graph_names, values):
        """Every graph reads the parameters the first one did: the flat buffers and the optimizer
        are laid out once, at the first compile, and each update is one pass over all of them."""
        named = dict(self._model.named_parameters())
        laid_out = set(self.flat.names) | set(self.read_only)
        new = [name for name in named if graph_name(name) in graph_names and graph_name(name) not in laid_out]
        self._read_as_they_are(named, [name for name in new if name in self.untrained])
        new = [name for name in new if name not in self.untrained]
        missing = [name for name in self.flat.torch_names if graph_name(name) not in graph_names]
        if not new and not missing:
            return
        absent = [name for name, value in values.items() if value is None]
        inputs = f"these inputs (None: {absent})" if absent else "these inputs (all given)"
        if new:
            problem = (f"with {inputs} the model uses parameters {new} that the first compiled call did not, so "
                       "they have no place in the trainer's flat buffers")
        else:
            problem = (f"with {inputs} the model leaves the trained parameters {missing} unused, and each update "
                       "would still move them (momentum, weight decay) where torch's optimizer skips them")
        raise ValueError(f"{problem}: the parameters a model uses must not depend on which optional inputs are "
                         "given (the flat buffers are laid out at the first step). Give the same inputs on every "
                         "call, or freeze the parameters that depend on them (utils.frozen_weights)")

    def _read_as_they_are(self, named, names):
        """Adds untrained parameters to the weights every graph reads as they are (contiguous, no copy)."""
        for name in names:
            named[name].data = named[name].data.contiguous()
            self.read_only[graph_name(name)] = named[name].data

    def scratch(self, placement):
        """Where micro-steps after the first write their gradients before adding them up."""
        if self._scratch is None:
            with placement.allocating():
                self._scratch = self.flat.grads.copy()
        return self._scratch

    @contextlib.contextmanager
    def gradients_from_the_graph_only(self, *, check):
        """Around a training run (`check`: its graph runs custom autograd.Functions): a Function
        whose backward sets the `.grad` of parameters the trainer would train itself (reentrant
        torch.utils.checkpoint; a backward calling torch.autograd.backward on weights the Function
        reads without taking them as arguments) is refused before the update: the trainer updates
        the gradients its graph computes, and those weights would get none."""
        if not check:
            yield
            return
        trained = {name: p for name, p in self._model.named_parameters() if name not in self.untrained}
        before = {name: (id(p.grad), p.grad._version if p.grad is not None else None) for name, p in trained.items()}
        yield
        changed = [name for name, p in trained.items()
                   if (id(p.grad), p.grad._version if p.grad is not None else None) != before[name]]
        if changed:
            raise NotImplementedError(
                f"a custom autograd.Function's backward set the .grad of parameters {_first(changed)} itself: "
                "ORTTrainer updates the gradients its graph computes, and would not train them. Pass those "
                "parameters to the Function's apply as arguments (its backward returning their gradients), "
                "or train the model with ORTModule and a torch optimizer")

    def trained(self):
        """{torch name: parameter} of what the optimizer updates (before the first compile: every
        parameter that is not untrained)."""
        named = dict(self._model.named_parameters())
        if self.flat is not None:
            return {name: named[name] for name in self.flat.torch_names}
        return {name: p for name, p in named.items() if name not in self.untrained}

    def optimizer_state_dict(self):
        """The optimizer section of a state_dict: its per-parameter state, or (before the first
        compile) the state a load_state_dict left pending."""
        name = self._optim_config.name
        if self.optimizer is None:
            pending = self.pending or {"step_count": 0, "state": {}}
            return {"name": name, "step_count": pending["step_count"], "state": pending["state"]}
        return {"name": name, "step_count": self.optimizer.step_count,
                "state": _checkpoint.optimizer_state(self.flat, self.optimizer)}

    def load_optimizer_state(self, state):
        """A checked optimizer section: into the optimizer, or pending until the first compile."""
        if self.optimizer is None:
            self.pending = state
        else:
            _checkpoint.load_optimizer_state(self.flat, self.optimizer, state)


def _first(names, count=10):
    """The first `count` of `names`, and '...' if there are more (for error messages)."""
    names = list(names)
    return names[:count] + (["..."] if len(names) > count else [])
