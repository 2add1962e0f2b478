"""The fp32 softmax cross-entropy's gradient in a built CPU training graph as one torch node
(`softmax_grads_in_torch`): what `_graph.cpu_kernels.fast_softmax_cross_entropy` wrote as Exp,
ScatterElements and Mul, and, where ORTModule also returns the logits, ONNX Runtime's Add of their
gradient.

Why: each of those nodes passes over a logits-sized tensor and writes a new one: on GPT-2's
50,257-word vocabulary, 1,024 tokens, the Exp, Mul and Add took 21, 25 and 22 ms a step (ONNX
Runtime's profile, a loaded machine) and held three 196 MiB tensors. One node computes the rows a
block at a time into one tensor; an unused logits' gradient, a scalar zero, adds nothing, and no
longer needs the logits' shape (dropped from the YieldOp's `full_shape_outputs`).
"""
from __future__ import annotations

import onnx

from .._onnx import full_shape_outputs_without, graph_index, node_attributes, set_nodes, torch_node
from .._torch_node_catalogue import SOFTMAX_GRAD  # run by `_runtime.product_kernels.softmax_grad`
from .torch_node_shapes import set_value_info

_UNSCALED = "/fast_sce_grad/unscaled"  # `fast_softmax_cross_entropy`'s ScatterElements output


def softmax_grads_in_torch(model: onnx.ModelProto) -> int:
    """Rewrites `model` (in place): each Exp -> ScatterElements -> Mul of a rewritten loss's gradient
    (fp32: `fast_softmax_cross_entropy` rewrites fp32 losses only, and `bf16_products` takes the bf16
    logits' first), where each is the only reader of the one before, becomes one SOFTMAX_GRAD node; where
    that gradient, reshaped, is added to a YieldOp output's gradient (ORTModule's returned logits)
    and read by nothing else, the Add goes too and the node adds that gradient. Returns how many."""
    graph = model.graph
    producers, readers, _, yield_op = graph_index(graph)
    outputs = {value.name for value in graph.output}

    def only_reader(name):
        found = readers.get(name, [])
        return found[0] if len(found) == 1 and name not in outputs else None

    replaced: dict[int, onnx.NodeProto | None] = {}
    renamed: dict[str, str] = {}
    freed: list[int] = []
    typed: list[str] = []
    for scatter in graph.node:
        if scatter.op_type != "ScatterElements" or not scatter.output[0].endswith(_UNSCALED) \
                or node_attributes(scatter).get("axis") != 1:
            continue
        exp, mul = producers.get(scatter.input[0]), only_reader(scatter.output[0])
        if exp is None or exp.op_type != "Exp" or only_reader(exp.output[0]) is not scatter \
                or mul is None or mul.op_type != "Mul" or mul.input[0] != scatter.output[0]:
            continue
        result, added = mul.output[0], _added_output_gradient(mul.output[0], only_reader, producers, yield_op)
        inputs = [exp.input[0], *scatter.input[1:], mul.input[1]]
        if added is not None:
            reshape, total, external = added
            inputs.append(external)
            renamed[total.output[0]] = reshape.output[0]
            replaced[id(total)] = None
            freed.append(list(yield_op.output).index(external))
        replaced[id(exp)], replaced[id(scatter)] = None, None
        replaced[id(mul)] = torch_node(SOFTMAX_GRAD, inputs, [result], name=f"{result}/torch", params={})
        typed.append(result)
    if replaced:
        nodes = [replaced.get(id(node), node) for node in graph.node]
        for node in (node for node in nodes if node is not None):
            node.input[:] = [renamed.get(name, name) for name in node.input]
        set_nodes(graph, [node for node in nodes if node is not None])
        if freed:  # (the YieldOp's output k is the gradient of its input k)
            full_shape_outputs_without(yield_op, freed)
        for name in typed:  # an ATen node's output: typed here
            set_value_info(model, name, onnx.TensorProto.FLOAT, None)
    return sum(1 for node in replaced.values() if node is not None)


def _added_output_gradient(gradient, only_reader, producers, yield_op):
    """(the Reshape, the Add, the YieldOp output added) where `gradient` is reshaped and added to a
    gradient the YieldOp returns (an output's, from the caller's backward) and nothing else reads
    the reshaped gradient; else None."""
    reshape = only_reader(gradient)
    if yield_op is None or reshape is None or reshape.op_type != "Reshape" or reshape.input[0] != gradient:
        return None
    total = only_reader(reshape.output[0])
    if total is None or total.op_type not in ("Add", "Sum") or len(total.input) != 2:
        return None
    external = next(name for name in total.input if name != reshape.output[0])
    producer = producers.get(external)
    return (reshape, total, external) if producer is yield_op else None
