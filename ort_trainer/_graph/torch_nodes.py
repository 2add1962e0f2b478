"""Graph nodes that run PyTorch kernels inside ONNX Runtime: ONNX Runtime 1.19's training build
has an `ATen` op (domain `org.pytorch.aten`) that hands its inputs to a registered executor
(`_runtime.torch_ops`). Our nodes name one of our torch implementations in the `operator`
attribute (`ort_trainer::<name>`) and carry its parameters as JSON in `overload_name`.

The CPU rewrites here replace gradient nodes ONNX Runtime's CPU provider has no kernel for
(`ResizeGrad`, `ConvTransposeGrad`) in built training graphs (`substitute_torch_kernels`).
"""
import json

import onnx

from .._onnx import node_attributes

DOMAIN = "org.pytorch.aten"
PREFIX = "ort_trainer::"

RESIZE_GRAD = PREFIX + "resize_grad"
CONV_TRANSPOSE_GRAD = PREFIX + "conv_transpose_grad"

# ONNX Resize (mode, coordinate_transformation_mode, nearest_mode) as torch exports F.interpolate:
# -> (torch mode by input rank, align_corners)
_RESIZE_MODES = {
    ("nearest", "asymmetric", "floor"): ({3: "nearest", 4: "nearest", 5: "nearest"}, None),
    ("linear", "half_pixel", None): ({3: "linear", 4: "bilinear", 5: "trilinear"}, False),
    ("linear", "pytorch_half_pixel", None): ({3: "linear", 4: "bilinear", 5: "trilinear"}, False),
    ("linear", "align_corners", None): ({3: "linear", 4: "bilinear", 5: "trilinear"}, True),
    ("cubic", "half_pixel", None): ({4: "bicubic"}, False),
    ("cubic", "pytorch_half_pixel", None): ({4: "bicubic"}, False),
    ("cubic", "align_corners", None): ({4: "bicubic"}, True),
}


def torch_node(operator, inputs, outputs, *, params, name):
    """An ATen node running our torch implementation `operator` with `params` (JSON-able)."""
    return onnx.helper.make_node("ATen", inputs, outputs, name=name, domain=DOMAIN, operator=operator,
                                 overload_name=json.dumps(params, sort_keys=True))


def has_torch_nodes(model):
    return any(node.domain == DOMAIN for node in model.graph.node)


def substitute_torch_kernels(training):
    """Replaces, in a built training graph (in place), the gradient nodes the CPU provider has no
    kernel for by torch's backward of the same op.

    Raises:
        NotImplementedError: a Resize whose mode torch has no backward for (torch never exports
            one; an ONNX model may have it), named.
    """
    graph, value_types = training.graph, _value_types(training)
    nodes, added = [], []
    for node in graph.node:
        replacement = None
        if node.domain == "com.microsoft" and node.op_type == "ResizeGrad":
            replacement = _resize_grad(node)
        elif node.domain == "com.microsoft" and node.op_type == "ConvTransposeGrad":
            replacement = _conv_transpose_grad(node)
        if replacement is None:
            nodes.append(node)
            continue
        nodes.append(replacement)
        element_type = value_types.get(node.input[0], onnx.TensorProto.FLOAT)  # the gradients' type
        added += [(output, element_type) for output in replacement.output]
    if not added:
        return
    del graph.node[:]
    graph.node.extend(nodes)
    known = {info.name for info in graph.value_info}
    for output, element_type in added:  # ATen outputs have no type inference: declare them
        if output not in known:
            graph.value_info.append(onnx.helper.make_tensor_value_info(output, element_type, None))
    if not any(opset.domain == DOMAIN for opset in training.opset_import):
        training.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))


def _value_types(model):
    """{value name: ONNX element type} of the values whose type the model states."""
    types = {}
    for info in [*model.graph.value_info, *model.graph.input, *model.graph.output]:
        if info.type.HasField("tensor_type"):
            types[info.name] = info.type.tensor_type.elem_type
    for tensor in model.graph.initializer:
        types[tensor.name] = tensor.data_type
    return types


def _resize_grad(node):
    """ResizeGrad(dY, X, roi, scales) -> torch's backward of F.interpolate at X's shape."""
    attributes = node_attributes(node)
    mode = attributes.get("mode", b"nearest").decode()
    transform = attributes.get("coordinate_transformation_mode", b"half_pixel").decode()
    nearest = attributes.get("nearest_mode", b"round_prefer_floor").decode() if mode == "nearest" else None
    known = _RESIZE_MODES.get((mode, transform, nearest))
    if known is None or (mode == "cubic" and attributes.get("cubic_coeff_a", -0.75) != -0.75) \
            or attributes.get("exclude_outside", 0):
        raise NotImplementedError(
            f"Resize node {node.name!r}: no gradient for mode={mode!r}, coordinate_transformation_mode={transform!r}"
            + (f", nearest_mode={nearest!r}" if nearest else "") + " on the CPU (ONNX Runtime has no ResizeGrad "
            "kernel there, and torch's interpolate backward covers the modes torch exports: nearest/asymmetric/floor, "
            "linear and cubic with half_pixel or align_corners)")
    torch_modes, align_corners = known
    grad, x, _, scales = (list(node.input) + ["", "", "", ""])[:4]
    inputs = [grad, x] + ([scales] if scales else [])
    return torch_node(RESIZE_GRAD, inputs, list(node.output), name=node.name,
                      params={"modes": {str(rank): m for rank, m in torch_modes.items()}, "align_corners": align_corners})


def _conv_transpose_grad(node):
    """ConvTransposeGrad(dY, X, W) -> (dX, dW, dB) from torch's convolution_backward."""
    attributes = node_attributes(node)
    if attributes.get("auto_pad", b"NOTSET") != b"NOTSET":
        raise NotImplementedError(f"ConvTranspose node {node.name!r}: no CPU gradient with auto_pad="
                                  f"{attributes['auto_pad'].decode()!r} (torch exports explicit pads)")
    pads = list(attributes.get("pads", []))
    half = len(pads) // 2
    if pads[:half] != pads[half:]:
        raise NotImplementedError(f"ConvTranspose node {node.name!r}: no CPU gradient with asymmetric pads {pads} "
                                  "(torch pads both sides alike)")
    # every output is written: the ones the builder left unnamed (not needed) get a name
    outputs = [name or f"{node.name}__unused_{k}" for k, name in enumerate((list(node.output) + [""] * 3)[:3])]
    return torch_node(CONV_TRANSPOSE_GRAD, list(node.input)[:3], outputs, name=node.name, params={
        "stride": list(attributes.get("strides", [])), "padding": pads[:half],
        "dilation": list(attributes.get("dilations", [])), "output_padding": list(attributes.get("output_padding", [])),
        "groups": int(attributes.get("group", 1))})
