"""The backward of an ORTModule graph reads the weights as they are when it runs, not where the
forward found them.

ONNX Runtime's forward keeps its feeds (DLPack views of the model's tensors) in the state its
backward runs from, and the backward's nodes read those: their memory as it was in the forward.
FSDP2's `fully_shard` (reshard_after_forward, its default below the root) frees the gathered
parameters after the forward and gathers them again, into new memory, before the backward; an
assignment to `.data` does the same. Each weight (parameter or buffer) that a node after the
YieldOp reads therefore travels through the YieldOp: an extra YieldOp input (a forward output
nobody reads) and the matching output `<weight>_backward`, which the backward's nodes read instead
and the autograd Function feeds with the weight's tensor at backward time, as eager autograd reads
a saved parameter. Each reaches its readers through a PassThrough (no copy): ONNX Runtime 1.19's
GemmSumFusion refuses a Gemm that reads the third or a later output of a node (its check reads the
producer's output index where it meant the Gemm's input index). Views of a weight made in the forward
(Reshape, Squeeze, ... which ONNX Runtime places in their input's memory) that the backward reads are
made again from `<weight>_backward`.
"""
from __future__ import annotations

from collections.abc import Sequence

import onnx

from .module_graph_builder import ALIASING_OPS

SUFFIX = "_backward"
_FED = "_fed"  # the YieldOp's output, read by the PassThrough to `<weight>_backward`
_MS_DOMAIN = "com.microsoft"


def weights_read_in_backward(model_proto: onnx.ModelProto, weights: Sequence[str]) -> tuple[list[str], list[str]]:
    """Rewrites the training graph in place (see the module docstring); returns (the weights, graph
    input names among `weights`, the backward now takes again, in the order of the YieldOp's added
    outputs; the weights whose memory it still reads where the forward found them). A weight that a
    subgraph (If, Loop, Scan) after the YieldOp reads is left as it was, the second kind: its memory
    must not move before the backward (`_GraphFunction` checks it)."""
    graph = model_proto.graph
    yield_op = next(node for node in graph.node if node.op_type == "YieldOp")
    producers = {name: node for node in graph.node for name in node.output}
    forward, stack = set(), list(yield_op.input)
    while stack:
        producer = producers.get(stack.pop())
        if producer is not None and id(producer) not in forward:
            forward.add(id(producer))
            stack.extend(producer.input)
    backward = [node for node in graph.node if id(node) not in forward and node is not yield_op]
    in_subgraphs = {name for node in backward for name in _subgraph_names(node)}
    movable = set(weights) - in_subgraphs
    renamed, taken, copies = {}, [], []

    def backward_name(name):
        """The name the backward reads for `name`: `<weight>_backward`, a view of it made again, or `name`."""
        if name not in renamed:
            producer = producers.get(name)
            if name in movable:
                renamed[name] = name + SUFFIX
                taken.append(name)
            elif producer is not None and id(producer) in forward and producer.op_type in ALIASING_OPS:
                source = backward_name(producer.input[0])
                renamed[name] = name
                if source != producer.input[0]:
                    copy = onnx.NodeProto()
                    copy.CopyFrom(producer)
                    copy.name = producer.name + SUFFIX
                    copy.input[0] = source
                    copy.output[:] = [output + SUFFIX for output in producer.output]
                    copies.append(copy)
                    renamed[name] = name + SUFFIX
            else:
                renamed[name] = name
        return renamed[name]

    for node in backward:
        node.input[:] = [backward_name(name) if name else name for name in node.input]
    if not taken:
        return [], sorted(in_subgraphs & set(weights))
    types = {value.name: value.type for value in graph.input}
    first = len(yield_op.input)
    yield_op.input.extend(taken)
    yield_op.output.extend(name + SUFFIX + _FED for name in taken)
    full_shape = next((a for a in yield_op.attribute if a.name == "full_shape_outputs"), None)
    if full_shape is None:
        full_shape = yield_op.attribute.add(name="full_shape_outputs", type=onnx.AttributeProto.INTS)
    full_shape.ints.extend(range(first, first + len(taken)))  # their type and shape: the weight's
    graph.value_info.extend(onnx.ValueInfoProto(name=name + suffix, type=types[name])
                            for name in taken for suffix in (SUFFIX + _FED, SUFFIX))
    passes = [onnx.helper.make_node("PassThrough", [name + SUFFIX + _FED], [name + SUFFIX], name=name + SUFFIX,
                                    domain=_MS_DOMAIN) for name in taken]
    position = list(graph.node).index(yield_op) + 1
    for offset, node in enumerate(passes + copies):
        graph.node.insert(position + offset, node)
    return taken, sorted(in_subgraphs & set(weights))


def _subgraph_names(node):
    """The names the subgraphs of `node` (If, Loop, Scan bodies) read, at any depth."""
    for attribute in node.attribute:
        for subgraph in (*([attribute.g] if attribute.HasField("g") else ()), *attribute.graphs):
            for inner in subgraph.node:
                yield from inner.input
                yield from _subgraph_names(inner)
