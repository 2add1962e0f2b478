"""ONNX model helpers that every stage uses: attributes, opsets and constants, initializers made
inputs or renamed, shape inference, which tensors a graph computes from which, the quiet
SessionOptions ONNX Runtime's graph tools and our sessions start from, and torch nodes."""
import json
import math

import numpy as np
import onnx
from onnxruntime import SessionOptions

_QUIET = 3  # ORT severity: errors only


def quiet_session_options():
    """SessionOptions that log errors only (ORT's gradient builder logs its progress at INFO)."""
    options = SessionOptions()
    options.log_severity_level = _QUIET
    return options


def parameters_as_inputs(model, parameter_names):
    """Parameters become graph inputs so both graphs read them from the flat buffer."""
    kept = []
    for initializer in model.graph.initializer:
        if initializer.name in parameter_names:
            model.graph.input.append(onnx.helper.make_tensor_value_info(
                initializer.name, initializer.data_type, initializer.dims))
        else:
            kept.append(initializer)
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)


def rename_initializers(model, renamed):
    """Renames initializers ({old: new}) and every read of them, subgraphs included (in place)."""
    for output in model.graph.output:
        if output.name in renamed:
            raise ValueError(f"ONNX model: initializer {output.name!r} is also a graph output; add an Identity node")
    for initializer in model.graph.initializer:
        initializer.name = renamed.get(initializer.name, initializer.name)
    _rename_reads(model.graph, renamed)


def _rename_reads(graph, renamed):
    for node in graph.node:
        node.input[:] = [renamed.get(name, name) for name in node.input]
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                _rename_reads(attribute.g, renamed)
            for subgraph in attribute.graphs:
                _rename_reads(subgraph, renamed)


def node_attributes(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def onnx_opset(model):
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def int64_constant(name, value):
    """A Constant node (named as its output): an int64 scalar, or a 1-D tensor for a list."""
    values = value if isinstance(value, list) else [value]
    dims = [len(values)] if isinstance(value, list) else []
    return onnx.helper.make_node("Constant", [], [name], name=name, value=onnx.helper.make_tensor(
        name, onnx.TensorProto.INT64, dims, values))


def float_constant(name, value):
    """A Constant node (named as its output): an fp32 scalar."""
    return onnx.helper.make_node("Constant", [], [name], name=name, value=onnx.numpy_helper.from_array(
        np.array(value, np.float32), name))


def torch_node_operator(node):
    """The torch implementation a torch node (`torch_node`) runs; "" for another node."""
    if node.domain != TORCH_NODE_DOMAIN:
        return ""
    return node_attributes(node).get("operator", b"").decode()


def torch_node_params_of(node):
    """The params of a torch node (`torch_node`); {} for another node."""
    if node.domain != TORCH_NODE_DOMAIN:
        return {}
    return json.loads(node_attributes(node).get("overload_name", b"").decode() or "{}")


def set_torch_node_params(node, params):
    """Gives a torch node `params` (in place)."""
    for attribute in node.attribute:
        if attribute.name == "overload_name":
            attribute.s = torch_node_params(params).encode()


def inferred_tensors(model):
    """{tensor name: (element type, dims)} by ONNX shape inference; a dim is its size, its symbolic
    name, or None when unknown. The inference runs on a stand-in of the graph (`_inference_nodes`)
    where what it cannot see through is made plain: small integer tensors computed from constants
    alone are Constants (torch's export writes a Slice's bounds as Unsqueezes of Constants, and the
    inference reads a Slice's bounds from constants only: `x[:4]` had unknown dims), and ONNX
    Runtime's own ops that keep their input's shape (LayerNormalization before opset 17, FastGelu)
    are Identities: past them, every shape was unknown."""
    stand_in = _inference_nodes(model.graph.node, onnx_opset(model))
    if stand_in is None:
        graph = onnx.shape_inference.infer_shapes(model, data_prop=True).graph
    else:
        original = list(model.graph.node)
        set_nodes(model.graph, stand_in)
        try:
            graph = onnx.shape_inference.infer_shapes(model, data_prop=True).graph
        finally:
            set_nodes(model.graph, original)
    tensors = {}
    for value in (*graph.input, *graph.value_info, *graph.output):
        tensor_type = value.type.tensor_type
        dims = (tuple(d.dim_value if d.HasField("dim_value") else d.dim_param or None for d in tensor_type.shape.dim)
                if tensor_type.HasField("shape") else None)
        tensors[value.name] = (tensor_type.elem_type, dims)
    return tensors


def set_nodes(graph, nodes):
    """`graph`'s nodes become `nodes` (in place)."""
    del graph.node[:]
    graph.node.extend(nodes)


_INDEX_OPS = frozenset({"Unsqueeze", "Squeeze", "Concat", "Cast", "Identity"})
_MAX_INDEX_ELEMENTS = 64
# Domain of the marker nodes our export symbolics leave for `_graph.gradient_builder_preparation` to
# rewrite (none reaches ORT).
MARKER_DOMAIN = "ort_trainer"
# ONNX Runtime's ops whose output 0 has input 0's shape, unknown to ONNX's inference, and the export's
# marker of an embedding's padding rows (`_export.symbolics`: every shape past a BERT's lookup was unknown)
_SHAPE_KEEPING = frozenset({("com.microsoft", name) for name in (
    "LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization", "FastGelu", "Gelu", "BiasGelu",
    "QuickGelu", "Scale", "BiasDropout", "BitmaskDropout")} | {("", "SimplifiedLayerNormalization"),
                                                                (MARKER_DOMAIN, "PaddingRows")})


def _inference_nodes(nodes, opset):
    """`nodes` as ONNX's shape inference should see them (`inferred_tensors`); None when they
    need no change. An index op whose inputs are all small integer constants becomes a Constant
    of its value; a shape-keeping ONNX Runtime op, an Identity of its input 0 (its other outputs
    are left out: only its gradient reads them, whose types the gradient builder states)."""
    shape_keeping = _SHAPE_KEEPING | ({("", "LayerNormalization")} if opset < 17 else set())
    known, stand_in, changed = {}, [], False
    for node in nodes:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            if node.attribute and node.attribute[0].name == "value":
                value = onnx.numpy_helper.to_array(node.attribute[0].t)
                if value.dtype.kind in "iu" and value.size <= _MAX_INDEX_ELEMENTS:
                    known[node.output[0]] = value
        elif (node.op_type in _INDEX_OPS and node.domain in ("", "ai.onnx") and node.input
              and all(name in known for name in node.input)):
            value = _index_op(node, [known[name] for name in node.input])
            if value is not None and value.dtype.kind in "iu" and value.size <= _MAX_INDEX_ELEMENTS:
                known[node.output[0]] = value
                node = onnx.helper.make_node("Constant", [], [node.output[0]], name=node.name,
                                             value=onnx.numpy_helper.from_array(value, node.output[0]))
                changed = True
        elif (node.domain or "", node.op_type) in shape_keeping:
            node = onnx.helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name)
            changed = True
        stand_in.append(node)
    return stand_in if changed else None


def _index_op(node, values):
    """The value of an index op on constant inputs (NumPy); None where not evaluated here."""
    attributes = node_attributes(node)
    if node.op_type == "Identity":
        return values[0]
    if node.op_type == "Concat":
        return np.concatenate(values, axis=attributes["axis"])
    if node.op_type == "Cast":
        dtype = onnx.helper.tensor_dtype_to_np_dtype(attributes["to"])
        return values[0].astype(dtype) if np.dtype(dtype).kind in "iu" else None
    axes = values[1].tolist() if len(values) > 1 else attributes.get("axes")
    if node.op_type == "Squeeze":
        return np.squeeze(values[0], axis=None if axes is None else tuple(axes))
    rank = values[0].ndim + len(axes)  # Unsqueeze: axes of the output
    return np.expand_dims(values[0], tuple(sorted(axis % rank for axis in axes)))


def constant_values(model):
    """{name: NumPy array} of the model's initializers and Constant nodes' outputs."""
    values = {tensor.name: onnx.numpy_helper.to_array(tensor) for tensor in model.graph.initializer}
    values.update({node.output[0]: onnx.numpy_helper.to_array(node.attribute[0].t) for node in model.graph.node
                   if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value"})
    return values


def computed_from(model, sources):
    """Names of the tensors computed (transitively) from `sources`, those included."""
    reached = set(sources)
    for node in model.graph.node:  # topologically sorted
        if reached.intersection(node.input):
            reached.update(node.output)
    return reached


def needed_for(model, targets):
    """Names of the tensors `targets` are computed from, themselves included."""
    needed = set(targets)
    for node in reversed(model.graph.node):
        if needed.intersection(node.output):
            needed.update(node.input)
    return needed


def full_shape_outputs_without(yield_op, indices):
    """The YieldOp's `full_shape_outputs` (the outputs whose gradient must have their shape)
    without `indices` (in place): those outputs' gradients may be a scalar zero (ORTModule's for an
    output the user's loss did not use)."""
    for attribute in yield_op.attribute:
        if attribute.name == "full_shape_outputs":
            kept = [index for index in attribute.ints if index not in indices]
            del attribute.ints[:]
            attribute.ints.extend(kept)


def graph_index(graph):
    """(producers {tensor: node}, readers {tensor: [nodes]}, the forward's outputs (the graph's and
    the YieldOp's inputs), the YieldOp or None) of `graph`."""
    producers = {name: node for node in graph.node for name in node.output}
    readers = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    yield_op = next((node for node in graph.node if node.op_type == "YieldOp"), None)
    outputs = {output.name for output in graph.output} | set(yield_op.input if yield_op is not None else ())
    return producers, readers, outputs, yield_op


# Torch nodes: ONNX Runtime's `ATen` op (this domain) running one of our torch implementations
# (`_runtime.torch_ops`), named in `operator` (`_torch_node_catalogue`), its parameters as JSON in
# `overload_name`. ATen outputs get no type inference: the graph must state their types.
TORCH_NODE_DOMAIN = "org.pytorch.aten"


def torch_node(operator, inputs, outputs, *, params, name=""):
    """An ATen node running our torch implementation `operator` with `params` (JSON-able)."""
    return onnx.helper.make_node("ATen", inputs, outputs, name=name, domain=TORCH_NODE_DOMAIN, operator=operator,
                                 overload_name=torch_node_params(params))


def torch_node_params(params):
    """The `overload_name` of a torch node (one spelling per value: it is part of gradient keys)."""
    return json.dumps(params, sort_keys=True, separators=(",", ":"))


def in_operand_order(inputs, params):
    """The inputs of a torch node (tensors, or what is known of them) in its op's order: a node may
    list them reordered (`params['operands']`: the op's index of each input listed;
    `_graph.torch_nodes.reached_first`)."""
    if "operands" not in params:
        return list(inputs)
    ordered = [None] * len(inputs)
    for position, operand in enumerate(params["operands"]):
        ordered[operand] = inputs[position]
    return ordered


def largest_tensors(model, count):
    """The `count` largest tensors of `model` whose shape ONNX's inference knows: [(bytes, name,
    dims, element type name)], largest first (what a graph's memory goes to)."""
    found = []
    for name, (element_type, dims) in inferred_tensors(model).items():
        if element_type and dims is not None and all(isinstance(dim, int) for dim in dims):
            itemsize = onnx.helper.tensor_dtype_to_np_dtype(element_type).itemsize
            found.append((math.prod(dims) * itemsize, name, list(dims),
                          onnx.TensorProto.DataType.Name(element_type).lower()))
    return sorted(found, reverse=True)[:count]
