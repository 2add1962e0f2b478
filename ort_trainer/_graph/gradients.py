"""Gradients ONNX Runtime 1.19 lacks, registered with its gradient builder (once per process):
CumSum's (the reverse cumulative sum of the output's gradient). A registered definition cannot read
the forward node's attributes, so it is the gradient of an inclusive, forward CumSum, the form
torch exports; `cumsum_as_inclusive` writes the other forms (from ONNX models) in that one."""
import functools
import json

import numpy as np
import onnx
from onnx import numpy_helper
from onnxruntime.capi import _pybind_state as C

from .._onnx import int64_constant


@functools.cache
def register_gradients():
    """Registers the definitions (idempotent; called before every gradient build)."""
    node = C.GradientNodeDefinition()
    node.op_type, node.domain = "CumSum", ""
    node.inputs, node.outputs = ["GO(0)", "I(1)"], ["GI(0)"]
    reverse = C.GradientNodeAttributeDefinition()
    reverse.name, reverse.value_json, reverse.dtype, reverse.is_tensor = "reverse", json.dumps(1), "int", False
    node.attributes = [reverse]
    C.register_gradient_definition("::CumSum", [node])


def _sum_along(model, x, total, axis):
    """Nodes for total = ReduceSum(x, axis, keepdims): axes an attribute before opset 13, an input since."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    if opset < 13:
        return [onnx.helper.make_node("ReduceSum", [x], [total], axes=[axis], keepdims=1)]
    axes = f"{total}__axes"
    return [int64_constant(axes, [axis]), onnx.helper.make_node("ReduceSum", [x, axes], [total], keepdims=1)]


def cumsum_as_inclusive(model):
    """Rewrites each CumSum with `exclusive` or `reverse` set (in place) as an inclusive forward
    CumSum and arithmetic: exclusive = cumsum - x; reverse = sum - cumsum + x (reverse exclusive:
    sum - cumsum), the sum along the CumSum's axis.

    Raises:
        NotImplementedError: such a CumSum's axis is computed in the graph (a constant is needed).
    """
    constants = {tensor.name: numpy_helper.to_array(tensor) for tensor in model.graph.initializer}
    constants.update({node.output[0]: numpy_helper.to_array(node.attribute[0].t) for node in model.graph.node
                      if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value"})
    nodes = []
    for node in model.graph.node:
        flags = {attribute.name: attribute.i for attribute in node.attribute}
        if node.op_type != "CumSum" or node.domain not in ("", "ai.onnx") or not any(flags.values()):
            nodes.append(node)
            continue
        if node.input[1] not in constants:
            raise NotImplementedError(f"CumSum node {node.name or node.output[0]!r} with exclusive/reverse set has a "
                                      "computed axis: its gradient needs a constant axis")
        axis = int(np.asarray(constants[node.input[1]]).reshape(-1)[0])
        x, y, inclusive = node.input[0], node.output[0], f"{node.output[0]}__inclusive"
        del node.attribute[:]
        node.output[0] = inclusive
        nodes.append(node)
        if flags.get("reverse"):
            total = f"{y}__total"
            nodes += _sum_along(model, x, total, axis)
            before = f"{y}__before"
            nodes.append(onnx.helper.make_node("Sub", [total, inclusive], [before]))
            nodes.append(onnx.helper.make_node("Identity" if flags.get("exclusive") else "Add",
                                               [before] if flags.get("exclusive") else [before, x], [y]))
        else:
            nodes.append(onnx.helper.make_node("Sub", [inclusive, x], [y]))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
