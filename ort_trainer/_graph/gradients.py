"""Gradients ONNX Runtime 1.19 lacks. CumSum's is registered with its gradient builder (once per
process): the reverse cumulative sum of the output's gradient. A registered definition cannot read
the forward node's attributes, so it is the gradient of an inclusive, forward CumSum, the form
torch exports; `cumsum_as_inclusive` writes the other forms (from ONNX models) in that one.
ReduceMax/ReduceMin are written with ops that have gradients (`extrema_differentiable`)."""
import functools
import json

import numpy as np
import onnx
from onnxruntime.capi import _pybind_state as C

from .._onnx import constant_values, float_constant, int64_constant, set_nodes
from .autocast import element_types


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


def _opset(model):
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)


def _reduce_sum(x, total, *, opset, keepdims, axes=None, axes_input=None):
    """Nodes for total = ReduceSum(x) over `axes` (a list), the tensor `axes_input`, or every axis:
    axes are an attribute before opset 13, an input since."""
    if axes is not None and opset < 13:
        return [onnx.helper.make_node("ReduceSum", [x], [total], axes=axes, keepdims=keepdims)]
    nodes = []
    if axes is not None:
        axes_input = f"{total}__axes"
        nodes.append(int64_constant(axes_input, axes))
    inputs = [x, axes_input] if axes_input else [x]
    return nodes + [onnx.helper.make_node("ReduceSum", inputs, [total], keepdims=keepdims)]


def cumsum_as_inclusive(model):
    """Rewrites each CumSum with `exclusive` or `reverse` set (in place) as an inclusive forward
    CumSum and arithmetic: exclusive = cumsum - x; reverse = sum - cumsum + x (reverse exclusive:
    sum - cumsum), the sum along the CumSum's axis.

    Raises:
        NotImplementedError: such a CumSum's axis is computed in the graph (a constant is needed).
    """
    constants = constant_values(model)
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
            nodes += _reduce_sum(x, total, opset=_opset(model), keepdims=1, axes=[axis])
            before = f"{y}__before"
            nodes.append(onnx.helper.make_node("Sub", [total, inclusive], [before]))
            nodes.append(onnx.helper.make_node("Identity" if flags.get("exclusive") else "Add",
                                               [before] if flags.get("exclusive") else [before, x], [y]))
        else:
            nodes.append(onnx.helper.make_node("Sub", [inclusive, x], [y]))
    set_nodes(model.graph, nodes)


def extrema_differentiable(model):
    """Rewrites each fp32 ReduceMax and ReduceMin (in place; ONNX Runtime 1.19 has no gradient for
    them) as the mean of the input's elements equal to the extremum: the same value, and torch's
    amax/amin gradient (shared evenly among ties). The extremum itself only feeds an Equal, which
    stops the gradient; Where, not a product, keeps -inf elements out of the sum."""
    if not any(node.op_type in ("ReduceMax", "ReduceMin") for node in model.graph.node):
        return  # (type inference of a large model costs a moment)
    opset = _opset(model)
    types = element_types(model)
    nodes = []
    for node in model.graph.node:
        if (node.op_type not in ("ReduceMax", "ReduceMin") or node.domain not in ("", "ai.onnx")
                or types.get(node.input[0]) != onnx.TensorProto.FLOAT):
            nodes.append(node)
            continue
        x, name = node.input[0], node.output[0]
        attributes = {attribute.name: attribute for attribute in node.attribute}
        keepdims = attributes["keepdims"].i if "keepdims" in attributes else 1
        axes = list(attributes["axes"].ints) if "axes" in attributes else None
        extremum, at, zero, one = (f"{name}__{part}" for part in ("extremum", "at", "zero", "one"))
        nodes += [onnx.helper.make_node(node.op_type, list(node.input), [extremum], keepdims=1,
                                        **({"axes": axes} if axes is not None else {})),
                  onnx.helper.make_node("Equal", [x, extremum], [at]),
                  float_constant(zero, 0.0), float_constant(one, 1.0),
                  onnx.helper.make_node("Where", [at, x, zero], [f"{name}__kept"]),
                  onnx.helper.make_node("Where", [at, one, zero], [f"{name}__each"])]
        axes_input = node.input[1] if len(node.input) > 1 else None  # opset 18: axes as an input
        for part in ("kept", "each"):
            nodes += _reduce_sum(f"{name}__{part}", f"{name}__{part}_sum", opset=opset, keepdims=keepdims, axes=axes,
                                 axes_input=axes_input)
        nodes.append(onnx.helper.make_node("Div", [f"{name}__kept_sum", f"{name}__each_sum"], [node.output[0]]))
    set_nodes(model.graph, nodes)


def flips_as_gathers(model):
    """Rewrites each reversing Slice (in place; torch.flip exports Slice(starts -1, ends -inf, steps
    -1), whose gradient ONNX Runtime 1.19 fails to run) as Gathers of the reversed indices, one per
    axis, whose gradient it has."""
    constants = constant_values(model)
    nodes = []
    for node in model.graph.node:
        arguments = [constants.get(name) for name in node.input[1:5]] if node.op_type == "Slice" else []
        if len(arguments) < 4 or any(value is None for value in arguments) or not _reverses(*arguments):
            nodes.append(node)
            continue
        flipped = node.input[0]
        for index, axis in enumerate(np.asarray(arguments[2]).reshape(-1).tolist()):
            name = f"{node.output[0]}__flip{index}"
            nodes += [onnx.helper.make_node("Shape", [flipped], [f"{name}_shape"]),
                      int64_constant(f"{name}_axis", axis),
                      onnx.helper.make_node("Gather", [f"{name}_shape", f"{name}_axis"], [f"{name}_size"]),
                      int64_constant(f"{name}_zero", 0), int64_constant(f"{name}_one", 1),
                      onnx.helper.make_node("Range", [f"{name}_zero", f"{name}_size", f"{name}_one"],
                                            [f"{name}_positions"]),
                      onnx.helper.make_node("Sub", [f"{name}_size", f"{name}_one"], [f"{name}_last"]),
                      # last - positions, not Range(last, -1, -1): ONNX Runtime's GatherToSliceFusion turns
                      # a Gather of a descending Range into an empty Slice
                      onnx.helper.make_node("Sub", [f"{name}_last", f"{name}_positions"], [f"{name}_indices"]),
                      onnx.helper.make_node("Gather", [flipped, f"{name}_indices"], [name], axis=axis)]
            flipped = name
        nodes.append(onnx.helper.make_node("Identity", [flipped], [node.output[0]]))
    set_nodes(model.graph, nodes)


def _reverses(starts, ends, axes, steps):
    """Whether Slice arguments reverse whole axes: starts -1, ends before the first element, steps -1."""
    starts, ends, steps = (np.asarray(value).reshape(-1) for value in (starts, ends, steps))
    return bool(len(steps) and (steps == -1).all() and (starts == -1).all() and (ends <= -(2 ** 31)).all())
