"""fp16 and bf16 models on the CPU (`model.half()`, a checkpoint loaded in bf16): ONNX Runtime
1.19's CPU provider has almost no fp16 or bf16 kernels (its session refused the first Gemm), so
the graph computes in fp32 and rounds each result to the model's type, as torch's CPU kernels do
(they compute fp16 and bf16 in fp32 and round each op's output).

Each fp16/bf16 input, weight and constant is read through a Cast to fp32; each node's fp16/bf16
result becomes a round trip: the node computes in fp32, a Cast to the model's type and one back
to fp32 feed the nodes that read it. A graph output is that fp32 result cast to its type at the
end (a gradient it receives from outside and one from the graph's own readers add up in fp32).
Ops that move or pick values (Reshape, Gather, Max, ...) round nothing and need no round trip.
The gradient of a Cast is a Cast back, so gradients are rounded at the same places and come out
in the inputs' types. ONNX Runtime's cast propagation must stay off, or it folds the round trips
away (`build_module_graph`'s `propagate_casts`).
"""
import onnx

from .._onnx import set_nodes
from .autocast import element_types

_LOW = frozenset({onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16})
_FLOAT = onnx.TensorProto.FLOAT
# Ops whose result is their inputs' values moved, picked or compared, or a constant: exact in any float type.
_EXACT = frozenset({"Constant", "ConstantOfShape", "Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze",
                    "Transpose", "Expand", "Tile", "Concat", "Split", "Slice", "Gather", "GatherElements", "GatherND",
                    "Max", "Min", "ReduceMax", "ReduceMin", "Relu", "Neg", "Abs", "Where", "MaxPool", "TopK",
                    "DepthToSpace", "SpaceToDepth"})
# Ops that write their result's type from an attribute: fp32 instead (then rounded, unless _EXACT).
_TYPED_BY_ATTRIBUTE = frozenset({"Cast", "Constant", "ConstantOfShape", "RandomNormal", "RandomUniform",
                                 "RandomNormalLike", "RandomUniformLike", "EyeLike", "Bernoulli"})


def low_precision_in_fp32(model: onnx.ModelProto) -> bool:
    """Rewrites `model` (an exported forward, in place) as the module docstring says. Returns
    whether it had fp16/bf16 tensors."""
    types = element_types(model)
    if not _LOW.intersection(types.values()):
        return False
    infos = {value.name: value for value in (*model.graph.value_info, *model.graph.output)}
    outputs = {value.name for value in model.graph.output}
    read = {}  # fp16/bf16 tensor -> the fp32 tensor its readers read
    nodes, returned = [], []
    for name in dict.fromkeys(value.name for value in (*model.graph.input, *model.graph.initializer)):
        if types.get(name) in _LOW:
            read[name] = f"{name}__fp32"
            nodes.append(_cast(name, read[name], _FLOAT))
    for node in model.graph.node:
        node.input[:] = [read.get(name, name) for name in node.input]
        if node.op_type in _TYPED_BY_ATTRIBUTE:
            _attributes_in_fp32(node)
        nodes.append(node)
        for index, name in enumerate(node.output):
            if types.get(name) not in _LOW:
                continue
            wide = f"{name}__wide"
            node.output[index] = wide
            if name in infos:  # a torch node's output has no inferred type
                info = model.graph.value_info.add()
                info.CopyFrom(infos[name])
                info.name, info.type.tensor_type.elem_type = wide, _FLOAT
            if node.op_type in _EXACT:
                read[name] = wide
            else:
                rounded, read[name] = (f"{name}__rounded" if name in outputs else name), f"{name}__fp32"
                nodes += [_cast(wide, rounded, types[name]), _cast(rounded, read[name], _FLOAT)]
            if name in outputs:
                returned.append(_cast(read[name], name, types[name]))
    set_nodes(model.graph, nodes + returned)
    return True


def _attributes_in_fp32(node):
    """A type attribute (`to`, `dtype`) or a constant's value in fp16/bf16 becomes fp32."""
    for attribute in node.attribute:
        if attribute.name in ("to", "dtype") and attribute.i in _LOW:
            attribute.i = _FLOAT
        elif attribute.name == "value" and attribute.t.data_type in _LOW:
            value = onnx.numpy_helper.to_array(attribute.t).astype("float32")
            attribute.t.CopyFrom(onnx.numpy_helper.from_array(value, attribute.t.name))


def _cast(source, target, element_type):
    return onnx.helper.make_node("Cast", [source], [target], to=element_type, name=f"{target}_cast")
