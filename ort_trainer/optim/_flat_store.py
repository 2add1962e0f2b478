"""The flat store of a fused torch.optim optimizer (`FusedAdam`, `FusedLamb`): its parameters' data,
gradients and state as views of flat buffers, the step counts, and the layout tables of the runs
of parameters one call updates."""
import contextlib
from collections import OrderedDict

import numpy as np
import torch

from .._optimizers.algorithms import implementation_of
from .._optimizers.flat import FlatLayout

STATE_KEYS = ("exp_avg", "exp_avg_sq")
# Tables of runs other than the whole buffer are kept while their sizes add up to at most this many
# times the buffer (Lamb's tables hold a direction buffer as large as their run).
_CACHED_TABLE_SIZES = 2


def runs(present, steps, lrs):
    """(lo, hi) segment ranges: the maximal runs of parameters with a gradient and equal step
    count and learning rate."""
    change = (present[1:] != present[:-1]) | (steps[1:] != steps[:-1]) | (lrs[1:] != lrs[:-1])
    bounds = [0, *(np.flatnonzero(change) + 1).tolist(), len(present)]
    return [(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]) if present[lo]]


class FlatStore:
    """The flat buffers of one optimizer (torch tensors on one device, and the NumPy or CuPy arrays
    the implementation takes), each parameter's views of them, the step counts, and the layout
    tables of the runs seen lately."""

    def __init__(self, params, seg_group, device, family):
        self.params = params
        self.seg_group = np.asarray(seg_group, dtype=np.int64)
        self.device = device
        self.family = family
        self.implementation, self.xp = implementation_of(device.type, "FusedOptimizer")
        self.shapes = [p.shape for p in params]
        sizes = [p.numel() for p in params]
        self.offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        size = int(self.offsets[-1])
        names = ("params", "grads", *STATE_KEYS)
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
