"""DeepSpeed ZeRO stage 3 under ORTModule: the model's parameters are partitioned across the ranks
(`param.data` empty, `param.ds_tensor` this rank's part), and DeepSpeed gathers each submodule's in
that submodule's forward and backward hooks, which a graph (one run over all parameters, no
submodule forward) does not call. ORTModule gathers them all itself: for its forward (then
partitions again those it gathered), and again for its backward (partitioned again at the end of the
backward pass, after autograd has handed their gradients to DeepSpeed's reduction hooks). The
backward reads the parameters gathered anew (`_graph.backward_weights`).

While a parameter is gathered for the graph, `ds_active_sub_modules` holds IN_USE, so that
DeepSpeed's own release (a submodule's post-forward hook while the probe and the export run the
model) leaves it whole, as it does for a submodule still running.
"""
import contextlib

import torch

IN_USE = -1  # not a DeepSpeed module id (those count from 0)


def partitioned(parameters):
    """The parameters among `parameters` that DeepSpeed ZeRO stage 3 partitions."""
    return [parameter for parameter in parameters if hasattr(parameter, "ds_active_sub_modules")]


@contextlib.contextmanager
def gathered(parameters):
    """`parameters` (ZeRO-3's) whole during the block; those it gathered partitioned again after."""
    gathered_here = _gather(parameters)
    try:
        yield
    finally:
        _release(parameters, gathered_here)


def gathered_until_backward_ends(parameters):
    """`parameters` whole now, partitioned again (those gathered here) when the backward pass ends."""
    gathered_here = _gather(parameters)
    torch.autograd.Variable._execution_engine.queue_callback(lambda: _release(parameters, gathered_here))


@contextlib.contextmanager
def deepspeed_hooks_suspended(model):
    """The forward hooks DeepSpeed put on the model's submodules taken off during the block (the
    probe and the export run the model): their backward Functions would be traced into the graph."""
    saved = []
    for module in model.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            theirs = [key for key, hook in hooks.items() if getattr(hook, "__module__", "").startswith("deepspeed.")]
            if theirs:
                saved.append((hooks, dict(hooks)))
                for key in theirs:
                    del hooks[key]
    try:
        yield
    finally:
        for hooks, entries in saved:
            hooks.clear()
            hooks.update(entries)


def _gather(parameters):
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    missing = [parameter for parameter in parameters if parameter.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    if missing:
        missing[0].all_gather(param_list=missing)
    for parameter in parameters:
        parameter.ds_active_sub_modules.add(IN_USE)
    return missing


def _release(parameters, gathered_here):
    for parameter in parameters:
        parameter.ds_active_sub_modules.discard(IN_USE)
    release = [parameter for parameter in gathered_here
               if not parameter.ds_active_sub_modules and not parameter.ds_persist]
    if release:
        release[0].partition(param_list=release)
