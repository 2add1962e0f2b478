"""The flat layout (where each tensor and param group sits), the flat parameter and gradient
buffers, and the torch parameters that view them."""
from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .._export.trace import graph_name
from .hyper import Hyper


@dataclass(frozen=True)
class GroupSlice:
    """One param group: a contiguous range of the flat buffer, made of whole segments (tensors)."""

    start: int  # first element of the group in the flat buffer
    stop: int  # one past the last element
    seg_start: int  # index of the group's first segment (tensor)
    seg_stop: int  # one past its last segment
    hyper: Hyper  # the group's hyperparameters (``algorithms.typed_hypers``)


@dataclass(frozen=True)
class FlatLayout:
    """Where each tensor and each param group sits in the flat buffers. Validated on creation."""

    seg_offsets: np.ndarray  # int64, shape (nseg + 1,), [0] == 0, [-1] == N, strictly increasing
    groups: tuple[GroupSlice, ...]  # contiguous, in order, covering [0, N)

    def __post_init__(self):
        offsets = np.array(self.seg_offsets, dtype=np.int64)  # a private copy, made read-only
        offsets.setflags(write=False)
        object.__setattr__(self, "seg_offsets", offsets)
        object.__setattr__(self, "groups", tuple(self.groups))
        if offsets.ndim != 1 or offsets.size < 2 or offsets[0] != 0:
            raise ValueError(
                f"FlatLayout.seg_offsets must be 1-D, start at 0 and hold at least one segment, "
                f"got {offsets!r}")
        if np.any(np.diff(offsets) <= 0):
            bad = int(np.argmax(np.diff(offsets) <= 0))
            raise ValueError(
                f"FlatLayout.seg_offsets must be strictly increasing (no empty tensor), "
                f"got {offsets[bad]} then {offsets[bad + 1]} at index {bad}")
        if not self.groups:
            raise ValueError("FlatLayout.groups must hold at least one group, got none")
        expected_seg_start = 0
        for index, group in enumerate(self.groups):
            if group.seg_start != expected_seg_start or group.seg_stop <= group.seg_start:
                raise ValueError(
                    f"FlatLayout.groups[{index}] must cover segments [{expected_seg_start}, k) "
                    f"with k > {expected_seg_start}, got [{group.seg_start}, {group.seg_stop})")
            if group.seg_stop >= offsets.size:
                raise ValueError(
                    f"FlatLayout.groups[{index}].seg_stop must be <= {offsets.size - 1} "
                    f"(the number of segments), got {group.seg_stop}")
            expected = (int(offsets[group.seg_start]), int(offsets[group.seg_stop]))
            if (group.start, group.stop) != expected:
                raise ValueError(
                    f"FlatLayout.groups[{index}] must span elements [{expected[0]}, {expected[1]}) "
                    f"(its segments), got [{group.start}, {group.stop})")
            expected_seg_start = group.seg_stop
        if expected_seg_start != offsets.size - 1:
            raise ValueError(
                f"FlatLayout.groups must cover all {offsets.size - 1} segments, "
                f"they stop at segment {expected_seg_start}")

    @classmethod
    def from_sizes(cls, sizes_per_group: Sequence[Sequence[int]],
                   hypers: Sequence[Hyper]) -> FlatLayout:
        """Lays tensors out in the order given: group after group, tensor after tensor.

        Args:
            sizes_per_group: for each param group, the element count of each of its tensors.
            hypers: for each param group, its hyperparameters (``algorithms.typed_hypers``).
        """
        if len(sizes_per_group) != len(hypers):
            raise ValueError(
                f"FlatLayout.from_sizes needs the hyperparameters of each group: got "
                f"{len(sizes_per_group)} groups and {len(hypers)} hyperparameters")
        for group_index, sizes in enumerate(sizes_per_group):
            if len(sizes) == 0:
                raise ValueError(f"sizes_per_group[{group_index}] must list at least one tensor, "
                                 f"got none")
            for tensor_index, size in enumerate(sizes):
                if not isinstance(size, numbers.Integral) or isinstance(size, bool) or size < 1:
                    raise ValueError(
                        f"sizes_per_group[{group_index}][{tensor_index}] must be an int >= 1, "
                        f"got {size!r}")
        all_sizes = [int(size) for sizes in sizes_per_group for size in sizes]
        offsets = np.concatenate([[0], np.cumsum(all_sizes, dtype=np.int64)])
        groups, seg_start = [], 0
        for sizes, hyper in zip(sizes_per_group, hypers):
            seg_stop = seg_start + len(sizes)
            groups.append(GroupSlice(int(offsets[seg_start]), int(offsets[seg_stop]),
                                     seg_start, seg_stop, hyper))
            seg_start = seg_stop
        return cls(offsets, tuple(groups))

    @property
    def size(self) -> int:
        """N, the number of elements of the flat buffers."""
        return int(self.seg_offsets[-1])

    def local_offsets(self, group: GroupSlice) -> np.ndarray:
        """The group's segment offsets relative to its start: [0, ..., group.stop - group.start]."""
        return self.seg_offsets[group.seg_start:group.seg_stop + 1] - group.start


def as_torch(array):
    """A torch tensor sharing memory with a NumPy (or CuPy, via DLPack) array."""
    if isinstance(array, np.ndarray):
        return torch.from_numpy(array)
    return torch.from_dlpack(array)


class FlatParameters:
    """Trainable parameters packed in one fp32 buffer, ordered by param group; gradients alike.

    After construction every trainable torch parameter *is* a view of the buffer, so the torch
    model always holds the trained weights and nothing is ever copied back. `names` are the
    parameters' graph names (what the graphs read and write), `torch_names` the same ones as the
    model names them (what checkpoints use), in layout order.
    """

    def __init__(self, named_parameters, groups, xp=np):
        """named_parameters: {torch name: torch parameter}; groups: [(torch names, Hyper)]."""
        self.torch_names = [name for names, _ in groups for name in names]
        self.names = [graph_name(name) for name in self.torch_names]
        sizes = [[named_parameters[name].numel() for name in names] for names, _ in groups]
        self.layout = FlatLayout.from_sizes(sizes, [hyper for _, hyper in groups])
        total = int(self.layout.seg_offsets[-1])
        self.params = xp.empty(total, dtype=np.float32)
        self.grads = xp.zeros(total, dtype=np.float32)
        self.shapes = {graph_name(name): tuple(named_parameters[name].shape) for name in self.torch_names}
        self.offsets = dict(zip(self.names, (int(o) for o in self.layout.seg_offsets[:-1])))
        flat_params = as_torch(self.params)
        for name in self.torch_names:
            parameter, start = named_parameters[name], self.offsets[graph_name(name)]
            view = flat_params[start: start + parameter.numel()].view(parameter.shape)
            with torch.no_grad():
                view.copy_(parameter.detach())
            parameter.data = view

    def view(self, buffer, name):
        """The part of `buffer` (params, grads, or any array in this layout) holding graph name `name`."""
        start = self.offsets[name]
        return buffer[start: start + int(np.prod(self.shapes[name], dtype=np.int64))].reshape(self.shapes[name])

    def per_parameter(self, buffer):
        """{torch name: torch view of `buffer`} for every parameter."""
        return {name: as_torch(self.view(buffer, graph)) for name, graph in zip(self.torch_names, self.names)}
