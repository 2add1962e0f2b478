"""A tied embedding's gradient in a built CPU training graph: the embedding's rows added to the
weight's other gradient by one torch node (`rows_into_weight_gradients`).

Why: a language model whose vocabulary projection reads the embedding's weight (GPT-2's lm_head
is wte) gets that weight's gradient as the Sum of two vocabulary-sized tensors: the projection's
weight gradient and the embedding's (`_graph.cpu_kernels.fast_gather_grad`'s GatherNDGrad, a
zero-filled [vocabulary, width] tensor with the looked-up rows added). Filling, then reading and
writing both cost ~19 ms a step for GPT-2's 50,257 x 256 (ONNX Runtime's profile), for a few
hundred rows. The rows are added into the projection's gradient where a torch node wrote it
(its memory is torch's, and the Sum was its only reader), else into a copy of it.
"""
from __future__ import annotations

import onnx

from .._onnx import TORCH_NODE_DOMAIN, inferred_tensors, set_nodes, torch_node
from .._torch_node_catalogue import ROWS_ADDED  # run by `_runtime.product_kernels.rows_added`
from .torch_node_shapes import set_value_info

# The row indices [N, 1] `fast_gather_grad` makes for each embedding's gradient.
_ROW_INDICES = "/fast_gather_grad/nd_indices"


def rows_into_weight_gradients(model: onnx.ModelProto) -> int:
    """Rewrites `model` (in place): each two-input Sum of a GatherNDGrad (an embedding's gradient,
    only the Sum reads it) and another gradient becomes one ROWS_ADDED node (the other gradient,
    the row indices, the rows' gradient) writing the Sum's output; `in_place` where the other
    gradient is a torch node's output that only the Sum reads. Returns the number of Sums removed."""
    graph = model.graph
    producers = {name: node for node in graph.node for name in node.output}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    outputs = {value.name for value in graph.output}

    def only_reader(name):
        return readers.get(name) == 1 and name not in outputs

    replaced, removed = {}, set()
    for total in graph.node:
        if total.op_type != "Sum" or total.domain not in ("", "ai.onnx") or len(total.input) != 2:
            continue
        found = [(producers.get(name), name) for name in total.input]
        rows = next((node for node, name in found if node is not None and node.op_type == "GatherNDGrad"
                     and node.input[1].endswith(_ROW_INDICES) and only_reader(name)), None)
        if rows is None:
            continue
        dense = next(name for node, name in found if node is not rows)
        writer = producers.get(dense)
        in_place = writer is not None and writer.domain == TORCH_NODE_DOMAIN and only_reader(dense)
        replaced[id(total)] = torch_node(ROWS_ADDED, [dense, *rows.input[1:]], list(total.output),
                                         name=f"{total.name}/rows_added", params={"in_place": in_place})
        removed.add(id(rows))
        shape = producers.get(rows.input[0])
        if shape is not None and shape.op_type == "Shape" and only_reader(shape.output[0]):
            removed.add(id(shape))
    if replaced:
        typed = {value.name for value in (*graph.output, *graph.value_info)}
        untyped = [node.output[0] for node in replaced.values() if node.output[0] not in typed]
        tensors = inferred_tensors(model) if untyped else {}  # (an ATen node's outputs are not inferred)
        set_nodes(graph, [replaced.get(id(node), node) for node in graph.node if id(node) not in removed])
        for name in untyped:
            set_value_info(model, name, *tensors.get(name, (onnx.TensorProto.FLOAT, None)))
    return len(replaced)
