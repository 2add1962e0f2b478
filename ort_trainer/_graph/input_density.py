"""Which inputs of an exported forward hold positions the graph computes for nothing: a
cross-entropy's labels with an ignore_index, an embedding's indices with a padding_idx (the
export's `PaddingRows` marker). ORTModule's density report (`ORTMODULE_PRINT_INPUT_DENSITY=1`)
counts them per call; label sparsity (`_graph.label_sparsity`) skips the ignored labels' rows."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .._onnx import MARKER_DOMAIN, node_attributes

if TYPE_CHECKING:
    import onnx

IGNORE_INDEX, PADDING_IDX = "ignore_index", "padding_idx"
# Ops that move or retype positions without mixing them (HF's shifted labels: a Slice, a Reshape).
_POSITION_PRESERVING = frozenset({"Reshape", "Slice", "Squeeze", "Unsqueeze", "Flatten", "Cast", "Identity"})


def density_inputs(model: onnx.ModelProto) -> dict[str, tuple[str, int]]:
    """{graph input name: (IGNORE_INDEX or PADDING_IDX, the value that marks a position empty)} of
    the exported forward `model`, found before the graph fixes (which drop the padding marker)."""
    producers = {output: node for node in model.graph.node for output in node.output}
    inputs = {value.name for value in model.graph.input}
    found = {}
    for node in model.graph.node:
        attributes = node_attributes(node)
        if node.op_type == "SoftmaxCrossEntropyLoss" and "ignore_index" in attributes and len(node.input) > 1:
            rule = (IGNORE_INDEX, int(attributes["ignore_index"]), node.input[1])
        elif node.domain == MARKER_DOMAIN and node.op_type == "PaddingRows":
            rule = (PADDING_IDX, int(attributes["padding_idx"]), node.input[1])
        else:
            continue
        source = input_behind(rule[2], producers, inputs)
        if source is not None:
            found[source] = rule[:2]
    return found


def input_behind(name, producers, inputs):
    """The graph input `name` is computed from through position-preserving ops alone, or None."""
    while name not in inputs:
        node = producers.get(name)
        if node is None or node.op_type not in _POSITION_PRESERVING or node.domain not in ("", "ai.onnx"):
            return None
        name = node.input[0]
    return name
