"""Normalizations as primitive ops whose ONNX Runtime gradients exist and are right: per-channel
statistics over a tensor viewed as [N, C, -1] (any rank), shared by InstanceNormalization, the
inference-mode and the training-mode BatchNormalization rewrites."""
import numpy as np
import onnx

from .._onnx import inferred_tensors, int64_constant, node_attributes, onnx_opset, set_nodes


def _reduce_mean(name, data, axes, opset):
    """Nodes of ReduceMean(keepdims=1) over `axes` into `name` (axes became an input in opset 18)."""
    make = onnx.helper.make_node
    if opset < 18:
        return [make("ReduceMean", [data], [name], name=name, axes=axes, keepdims=1)]
    return [int64_constant(name + "_axes", axes),
            make("ReduceMean", [data, name + "_axes"], [name], name=name, keepdims=1)]


def grouped(p, x):
    """Nodes viewing x [N, C, ...] as p + 'grouped' [N, C, -1]: per-channel work for any rank."""
    return [int64_constant(p + "grouped_shape", [0, 0, -1]),
            onnx.helper.make_node("Reshape", [x, p + "grouped_shape"], [p + "grouped"], name=p + "grouped")]


def channel_affine(p, grouped, scale, bias, x, output):
    """Nodes of `output` = grouped * scale[c] + bias[c] (scale, bias: [C]; grouped: x as [N, C, -1])
    in x's shape."""
    make = onnx.helper.make_node
    return [int64_constant(p + "channel_shape", [-1, 1]),
            make("Reshape", [scale, p + "channel_shape"], [p + "channel_scale"], name=p + "channel_scale"),
            make("Reshape", [bias, p + "channel_shape"], [p + "channel_bias"], name=p + "channel_bias"),
            make("Mul", [grouped, p + "channel_scale"], [p + "scaled"], name=p + "scaled"),
            make("Add", [p + "scaled", p + "channel_bias"], [p + "shifted"], name=p + "shifted"),
            make("Shape", [x], [p + "input_shape"], name=p + "input_shape"),
            make("Reshape", [p + "shifted", p + "input_shape"], [output], name=p + "output")]


def element_type(tensors, name):
    """The ONNX element type of tensor `name` in `inferred_tensors`' result (float when unknown)."""
    return tensors.get(name, (onnx.TensorProto.FLOAT,))[0] or onnx.TensorProto.FLOAT


def normalized_nodes(p, node, axes, x_type, opset):
    """Nodes of p + 'normalized' = (g - mean) / sqrt(biased variance + epsilon) for a normalization
    `node` (its input 0 is x, its 'epsilon' attribute read): g is x viewed as [N, C, -1]
    (p + 'grouped'), the mean (p + 'mean') and variance (p + 'variance') are taken over `axes` of
    g and kept as size-1 dims; `x_type` is x's ONNX element type (that of epsilon)."""
    make = onnx.helper.make_node
    epsilon = np.array(node_attributes(node).get("epsilon", 1e-5), onnx.helper.tensor_dtype_to_np_dtype(x_type))
    return [*grouped(p, node.input[0]),
            *_reduce_mean(p + "mean", p + "grouped", axes, opset),
            make("Sub", [p + "grouped", p + "mean"], [p + "centered"], name=p + "centered"),
            make("Mul", [p + "centered", p + "centered"], [p + "squared"], name=p + "squared"),
            *_reduce_mean(p + "variance", p + "squared", axes, opset),
            make("Constant", [], [p + "epsilon"], name=p + "epsilon",
                 value=onnx.numpy_helper.from_array(epsilon, p + "epsilon")),
            make("Add", [p + "variance", p + "epsilon"], [p + "variance_epsilon"], name=p + "variance_epsilon"),
            make("Sqrt", [p + "variance_epsilon"], [p + "deviation"], name=p + "deviation"),
            make("Div", [p + "centered", p + "deviation"], [p + "normalized"], name=p + "normalized")]


def decompose_instance_normalization(model):
    """Rewrites every InstanceNormalization into ops that have gradients, in place.

    Why: ONNX Runtime 1.19 has no InstanceNormalization gradient, and the TorchScript exporter
    emits one for GroupNorm and the InstanceNorm*d modules. Same math as the op: per sample and
    channel, (x - mean) / sqrt(biased variance + epsilon) * scale[c] + bias[c], computed on x
    viewed as [N, C, -1] so that any rank works without knowing it. New nodes and tensors are
    named under the original node's name. Returns the number of nodes rewritten.
    """
    opset = onnx_opset(model)
    nodes, rewritten, tensors = [], 0, None
    for node in model.graph.node:
        if node.op_type != "InstanceNormalization" or node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        if tensors is None:
            tensors = inferred_tensors(model)
        x, scale, bias = node.input
        p = f"{node.name or node.output[0]}/"
        nodes += [*normalized_nodes(p, node, [2], element_type(tensors, x), opset),
                  *channel_affine(p, p + "normalized", scale, bias, x, node.output[0])]
        rewritten += 1
    set_nodes(model.graph, nodes)
    return rewritten


def inference_batch_norm_as_primitives(model):
    """Rewrites inference-mode BatchNormalization into Mul/Add over per-channel constants, in place.

    Why: ORT's gradient builder turns every BatchNormalization into its training kernel
    (BatchNormInternal, batch statistics), so a BatchNorm the user put in eval mode would train
    on batch statistics. Same math as the node: with a = scale / sqrt(var + epsilon) and
    b = bias - mean * a (both [C]), Y = X * a[c] + b[c]. Returns the number of nodes replaced.
    """
    make, nodes, replaced = onnx.helper.make_node, [], 0
    for node in model.graph.node:
        attributes = node_attributes(node)
        if (node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx")
                or attributes.get("training_mode", 0)):
            nodes.append(node)
            continue
        x, scale, bias, mean, var = node.input
        p = f"{node.output[0]}/inference_batch_norm/"
        epsilon = onnx.helper.make_tensor(p + "epsilon", onnx.TensorProto.FLOAT, [], [attributes.get("epsilon", 1e-5)])
        nodes += [make("Constant", [], [p + "epsilon"], value=epsilon),
                  make("Add", [var, p + "epsilon"], [p + "var_eps"]),
                  make("Sqrt", [p + "var_eps"], [p + "std"]),
                  make("Div", [scale, p + "std"], [p + "a"]),
                  make("Mul", [mean, p + "a"], [p + "mean_a"]),
                  make("Sub", [bias, p + "mean_a"], [p + "b"]),
                  *grouped(p, x),
                  *channel_affine(p, p + "grouped", p + "a", p + "b", x, node.output[0])]
        replaced += 1
    set_nodes(model.graph, nodes)
    return replaced
