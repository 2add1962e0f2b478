"""The class-index targets of a graph's cross-entropy losses, checked before a run where ONNX
Runtime's kernel would not check them, and the error for one out of range (both paths give it).

Why: ONNX Runtime's CUDA SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss read a target
outside [0, classes) unchecked (a wrong loss, or a device assert that ends the process's CUDA
context), where torch raises and the CPU path's rewritten loss raises (`cpu_kernels`)."""
from __future__ import annotations

from collections.abc import Mapping

import onnx
import torch

from .._onnx import inferred_tensors, node_attributes

#: the devices whose loss kernels read targets unchecked: the graph inputs that reach a loss's
#: targets are checked there before each run
UNCHECKED_DEVICES = frozenset({"cuda"})
_LOSSES = ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")
# ops whose output holds values of their input 0, reshaped, cast or a subset of them: a target
# read through them is checked at the graph input (all of it: an unselected value is checked too)
_CARRIES_VALUES = frozenset({"Cast", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Transpose",
                             "Expand", "Slice", "Gather", "GatherElements", "GatherND", "Compress"})

Targets = Mapping[str, tuple[int | None, int | None]]


def out_of_range_error(classes: int | str | None, ignore_index: int | str | None) -> IndexError:
    """The error for a loss target outside [0, classes) other than ignore_index (None: none)."""
    ignored = "" if ignore_index is None else f" or ignore_index={ignore_index}"
    return IndexError(f"a target (class index) of the cross-entropy loss is out of range: the loss takes targets in "
                      f"[0, {'C' if classes is None else classes}){ignored}, as torch's cross_entropy (which "
                      "raises 'Target ... is out of bounds' for the same batch); nothing was updated and the step "
                      "is not counted")


def loss_targets(model: onnx.ModelProto) -> dict[str, tuple[int | None, int | None]]:
    """{graph input: (classes or None where the graph does not know them, ignore_index or None)}
    for each cross-entropy loss whose targets are read from a graph input (through `_CARRIES_VALUES`)."""
    graph = model.graph
    inputs = {value.name for value in graph.input}
    producers = {name: node for node in graph.node for name in node.output}
    losses = [node for node in graph.node if node.op_type in _LOSSES and len(node.input) > 1]
    tensors = inferred_tensors(model) if losses else {}
    targets = {}
    for node in losses:
        source = node.input[1]
        while source in producers and producers[source].op_type in _CARRIES_VALUES:
            source = producers[source].input[0]
        if source in inputs:
            dims = tensors.get(node.input[0], (None, ()))[1]
            classes = dims[1] if len(dims) > 1 and isinstance(dims[1], int) else None
            targets[source] = (classes, node_attributes(node).get("ignore_index"))
    return targets


def check_targets(inputs: Mapping[str, torch.Tensor | None], targets: Targets) -> None:
    """Raises `out_of_range_error` where a target input holds a value outside [0, classes) (only
    negative ones where the classes are unknown) other than ignore_index: one reduction on the
    device and one read of its result per target input."""
    for name, (classes, ignore_index) in targets.items():
        tensor = inputs.get(name)
        if tensor is None:
            continue
        bad = tensor < 0 if classes is None else (tensor < 0) | (tensor >= classes)
        if ignore_index is not None:
            bad &= tensor != ignore_index
        if bool(bad.any()):
            raise out_of_range_error(classes, ignore_index)
