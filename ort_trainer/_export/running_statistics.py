"""BatchNorm modules in training mode, on the torch side: which update running statistics, the
refusal of SyncBatchNorm, a trace that updates nothing, and torch's update of the running
statistics from the batch statistics a graph returns (`_graph.batch_statistics`)."""
import contextlib
import warnings

import torch

from .._configuration.refusals import TorchModelRefused


RUNNING_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def tracked_batch_norms(model):
    """{module name: module} of the BatchNorm modules whose forward updates running statistics:
    training mode with `track_running_stats`. SyncBatchNorm is not one of them (its statistics are
    reduced over the ranks, see `sync_batch_norm_refused`)."""
    return {name: module for name, module in model.named_modules()
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
            and not isinstance(module, torch.nn.SyncBatchNorm)
            and module.training and module.track_running_stats and module.running_mean is not None}


def untracked_changes(model, changed):
    """The names among `changed` (buffers a forward changed) that are not the running statistics
    of `tracked_batch_norms`: what no graph writes back."""
    tracked = {f"{name}.{buffer}" if name else buffer
               for name in tracked_batch_norms(model) for buffer in RUNNING_BUFFERS}
    return [name for name in changed if name not in tracked]


def sync_batch_norm_refused(model, remedy):
    """The refusal (a NotImplementedError) of SyncBatchNorm modules in training mode (their statistics are
    reduced over the ranks of a process group, which a graph does not do), else None. `remedy`:
    what the caller can do, the end of the message."""
    names = [name for name, module in model.named_modules()
             if isinstance(module, torch.nn.SyncBatchNorm) and module.training]
    if not names:
        return None
    return TorchModelRefused(
        f"the model has SyncBatchNorm modules {names} in training mode, whose batch statistics are reduced over "
        f"the ranks of a process group; an ONNX Runtime graph computes them on its own batch ({remedy})")


@contextlib.contextmanager
def running_statistics_kept(model):
    """Context of a trace of `model` in which its BatchNorms update nothing: the buffers are
    restored after it (the trace runs forward() for real), and the cumulative average's factor
    (momentum=None: 1 / float(num_batches_tracked), a buffer read as a Python value) is not
    computed (a placeholder momentum instead): graphs never update running statistics, the front
    ends do (`BatchStatistics`). The exporter's note that it drops num_batches_tracked's in-place
    update is silenced."""
    buffers = [buffer for buffer in model.buffers()]
    before = [buffer.detach().clone() for buffer in buffers]
    cumulative = [module for module in tracked_batch_norms(model).values() if module.momentum is None]
    try:
        for module in cumulative:
            module.momentum = 0.1
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="ONNX Preprocess - Removing mutation")
            yield
    finally:
        for module in cumulative:
            module.momentum = None
        with torch.no_grad():
            for buffer, value in zip(buffers, before):
                buffer.copy_(value)


def update_running_statistics(module, mean, unbiased_variance):
    """What torch's `_BatchNorm.forward` and its kernel do to the buffers in training mode, from
    the batch's mean and unbiased variance; the blend in float64, as the CPU kernel."""
    factor = 0.0 if module.momentum is None else module.momentum
    if module.num_batches_tracked is not None:
        module.num_batches_tracked.add_(1)
        if module.momentum is None:  # cumulative moving average
            factor = 1.0 / float(module.num_batches_tracked)
    for running, batch in ((module.running_mean, mean), (module.running_var, unbiased_variance)):
        if running is not None:
            running.copy_(running.double() * (1.0 - factor) + batch.detach().double() * factor)
