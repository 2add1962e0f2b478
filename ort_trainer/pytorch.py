"""The first ONNX Runtime training front end's API (the seed `001_...`): a trainer made of the
model, a loss criterion and any `torch.optim` optimizer, one call per training step.

    import ort_trainer.pytorch as ort

    trainer = ort.trainer(model, criterion, optimizer)
    loss, y_pred = trainer.step(x, y)      # forward, criterion, backward, update

The model's forward and backward run in ONNX Runtime (`ORTModule`); the criterion, the optimizer
and its update stay torch's, so every torch.optim optimizer works as in an eager loop.
"""
import math
import numbers

import torch

from torch.utils._pytree import tree_map

from .ortmodule import DebugOptions, ORTModule


class Trainer:
    """`trainer(model, criterion, optimizer, *, max_grad_norm=None, debug_options=None)`.

    model: a torch.nn.Module (wrapped in an ORTModule unless it is one); criterion:
    `criterion(y_pred, y)` returns the loss (torch.nn.MSELoss(), a function); optimizer: a
    torch.optim.Optimizer over the model's parameters. max_grad_norm: the gradients' global 2-norm is
    clipped to it before each update (torch.nn.utils.clip_grad_norm_); None: no clipping.
    debug_options: ORTModule's DebugOptions. The model's train/eval flags are the user's."""

    def __init__(self, model, criterion, optimizer, *, max_grad_norm=None, debug_options=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"ort.trainer: model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(criterion):
            raise TypeError(f"ort.trainer: criterion must be callable as criterion(y_pred, y) (a loss such as "
                            f"torch.nn.MSELoss()), got {type(criterion).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"ort.trainer: optimizer must be a torch.optim.Optimizer (such as torch.optim.SGD("
                            f"model.parameters(), lr=1e-4)), got {type(optimizer).__name__}")
        own = {id(parameter) for parameter in model.parameters()}
        foreign = sum(id(parameter) not in own for group in optimizer.param_groups for parameter in group["params"])
        if foreign:
            raise ValueError(f"ort.trainer: optimizer holds {foreign} parameter(s) that are not the model's (an "
                             "optimizer made for another model, or a copy of it): make it from model.parameters()")
        if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(
                max_grad_norm, numbers.Real) or not 0 < max_grad_norm < math.inf):
            raise ValueError(f"ort.trainer: max_grad_norm must be a positive finite number or None, got "
                             f"{max_grad_norm!r}")
        if debug_options is not None and not isinstance(debug_options, DebugOptions):
            raise TypeError(f"ort.trainer: debug_options must be a DebugOptions or None, got "
                            f"{type(debug_options).__name__}")
        self.model = model if isinstance(model, ORTModule) else ORTModule(model, debug_options)
        self.criterion, self.optimizer, self.max_grad_norm = criterion, optimizer, max_grad_norm

    def step(self, x, y):
        """One training step: y_pred = model(x), loss = criterion(y_pred, y), the gradients (the
        previous step's cleared), clipping when asked, the optimizer's update. Returns (loss, y_pred),
        detached (y_pred in the structure the model returns). A criterion that does not return a
        one-element loss is refused before any gradient is touched."""
        y_pred = self.model(x)
        loss = self.criterion(y_pred, y)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            got = (f"a tensor of shape {tuple(loss.shape)}{'' if loss.requires_grad else ' without a gradient'}"
                   if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}")
            raise ValueError(f"ort.trainer: criterion(y_pred, y) must return the loss as a one-element tensor "
                             f"computed from y_pred, got {got}")
        self.optimizer.zero_grad()
        loss.backward()
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        return loss.detach(), tree_map(lambda value: value.detach() if isinstance(value, torch.Tensor) else value,
                                       y_pred)


trainer = Trainer  # the seed's spelling: ort.trainer(model, criterion, optimizer, ...)
