"""Graph nodes that run PyTorch kernels inside ONNX Runtime (`_onnx.torch_node`; the executor:
`_runtime.torch_ops`).

- Forward ops the exporter refuses are exported as torch nodes (`_export.torch_node_symbolics`),
  and ops on the gradient path that ONNX Runtime cannot differentiate become torch nodes
  (`gradients_through_torch`: einsum, atan, floor, det, ...); their gradients,
  torch nodes too, are registered with the gradient builder per node parameters
  (`register_torch_node_gradients`): one node computing every input's gradient in one pass (its
  outputs compacted to the inputs the builder wants: `finish_torch_node_gradients`);
  `Tensor.detach`'s input is registered as a stop-gradient edge.
  The builder keeps a per-input gradient node only where input 0 needs a gradient (it checks the
  node's output position, 0): operands are reordered so that one that needs a gradient is first.
- In built training graphs for the CPU, the gradient nodes its provider has no kernel for
  (`ResizeGrad`, `ConvTransposeGrad`) become torch's backward (`substitute_torch_kernels`).
"""
import json

import onnx
from onnxruntime.capi import _pybind_state as C

from .._onnx import TORCH_NODE_DOMAIN as DOMAIN
from .._onnx import (node_attributes, onnx_opset, set_nodes, set_torch_node_params, torch_node, torch_node_operator,
                     torch_node_params, torch_node_params_of)
from .._torch_node_catalogue import (AUTOGRAD_FUNCTION, AUTOGRAD_FUNCTION_GRAD, CONV_TRANSPOSE_GRAD, DETACH, EINSUM,
                                     FUNCTION, GRADIENT_OPERATORS, GRADIENTS, LABELLED_PROJECTION_GRAD, PRODUCT,
                                     RESIZE_GRAD, STOPS_GRADIENT)
from .torch_node_shapes import declare_torch_node_outputs

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


# ONNX ops ONNX Runtime 1.19 cannot differentiate -> the torch function of the same math.
_TORCH_FUNCTIONS = {"Atan": "atan", "Asin": "asin", "Acos": "acos", "Tan": "tan", "Floor": "floor", "Ceil": "ceil",
                    "Sign": "sign", "Round": "round", "Det": "linalg.det"}


def _as_torch_function(node, opset, reached):
    """(torch function, constant args) of an ONNX node torch can run with its own gradient, or None
    (`reached`: the tensors that need gradients)."""
    attributes = node_attributes(node)
    if node.op_type in _TORCH_FUNCTIONS:
        return _TORCH_FUNCTIONS[node.op_type], []
    if node.op_type == "DepthToSpace" and attributes.get("mode", b"DCR") == b"CRD":  # pixel_shuffle's order
        return "pixel_shuffle", [attributes["blocksize"]]
    if node.op_type == "Mod" and attributes.get("fmod", 0) == 1:
        return "fmod", []
    if node.op_type == "Pow" and node.input[1] in reached:  # ORT's gradient ignores the exponent's
        return "pow", []
    if node.op_type in ("ReduceProd", "ReduceL1") and opset < 18:  # ORT has no gradient for them
        axes, keepdim = attributes.get("axes"), bool(attributes.get("keepdims", 1))
        if node.op_type == "ReduceL1":
            return "linalg.vector_norm", [1, None if axes is None else list(axes), keepdim]
        if axes is None and not keepdim:  # torch.prod(x)
            return "prod", []
        if axes is not None and len(axes) == 1:
            return "prod", [axes[0], keepdim]
    return None


def _explicit_einsum(equation):
    """`equation` with its output spelled out: implicit, it is the labels used once, in
    alphabetical order, after the ellipsis' dims when there is one (torch's rule)."""
    equation = equation.replace(" ", "")
    if "->" in equation:
        return equation
    labels = equation.replace(",", "").replace("...", "")
    once = "".join(sorted(label for label in set(labels) if labels.count(label) == 1))
    return equation + "->" + ("..." if "..." in equation else "") + once


def _einsum_node(node, reached):
    """Einsum as a torch node, its operands reordered so that one that needs a gradient is first
    (the builder fails on a torch node whose input 0 needs none while another does)."""
    equation = _explicit_einsum(node_attributes(node)["equation"].decode())
    terms, result = equation.split("->")
    terms = terms.split(",")
    order = sorted(range(len(node.input)), key=lambda k: node.input[k] not in reached)  # stable
    equation = ",".join(terms[k] for k in order) + "->" + result
    return torch_node(EINSUM, [node.input[k] for k in order], list(node.output), name=node.name,
                      params={"equation": equation})


def gradients_through_torch(model, trainable):
    """Rewrites (in place) each op on the way from the `trainable` inputs that ONNX Runtime cannot
    differentiate, and torch can, as a torch node (FUNCTION: the torch function and its autograd
    gradient): einsum, atan, asin, acos, tan, floor, ceil, sign, round, det, pixel_shuffle
    (DepthToSpace in CRD order), fmod, a pow whose exponent needs a gradient, prod over one axis or
    all, an L1 norm. Exported torch nodes get the inputs that need gradients first. Decided on the
    graph, where the trace's requires_grad flags are not reliable (False after convolutions); the
    eval graph keeps the ONNX ops."""
    reached, opset = needing_gradient(model, trainable), onnx_opset(model)
    nodes, rewritten = [], False
    for node in model.graph.node:
        replacement = None
        if reached.intersection(node.input) and node.domain in ("", "ai.onnx"):
            replacement = (_einsum_node(node, reached) if node.op_type == "Einsum"
                           else _function_node(node, _as_torch_function(node, opset, reached), reached))
        elif torch_node_operator(node) == AUTOGRAD_FUNCTION:
            replacement = _autograd_function_node(node, reached)
        elif reached.intersection(node.input) and node.domain == DOMAIN:
            replacement = _reordered_function(node, reached)
        nodes.append(node if replacement is None else replacement)
        rewritten = rewritten or replacement is not None
    if rewritten:
        replace_nodes(model, nodes)
        declare_torch_node_outputs(model)


# Ops whose outputs carry no gradient to their inputs (shapes, comparisons, indices, random draws).
_NO_GRADIENT_OPS = frozenset({"Shape", "Size", "ConstantOfShape", "EyeLike", "RandomNormalLike", "RandomUniformLike",
                              "Bernoulli", "Multinomial", "ArgMax", "ArgMin", "NonZero", "Equal", "Less", "Greater",
                              "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or", "Xor", "IsNaN", "IsInf"})


def needing_gradient(model, trainable):
    """The tensors of `model` the gradient builder differentiates: computed from the `trainable`
    inputs through ops that pass gradients (not through a shape, a comparison or a detach)."""
    reached = set(trainable)
    for node in model.graph.node:  # topologically sorted
        if (reached.intersection(node.input) and node.op_type not in _NO_GRADIENT_OPS
                and not (node.domain == DOMAIN and node_attributes(node)["operator"].decode() == DETACH)):
            reached.update(node.output)
    return reached


def reached_first(inputs, reached):
    """(`inputs` with those in `reached` first, stably; `operands`: the index in `inputs` of each
    one listed). The gradient builder fails on a torch node whose input 0 needs no gradient while
    another does; the implementation puts them back in order (`params['operands']`)."""
    order = sorted(range(len(inputs)), key=lambda k: inputs[k] not in reached)
    return [inputs[k] for k in order], order


def _function_node(node, torch_function, reached):
    """The FUNCTION torch node of `node` (its first output), or None without a torch function."""
    if torch_function is None:
        return None
    function, args = torch_function
    inputs, operands = reached_first([name for name in node.input if name], reached)
    return torch_node(FUNCTION, inputs, list(node.output)[:1], name=node.name,
                      params={"function": function, "args": args, "kwargs": {}, "operands": operands})


def _reordered_function(node, reached):
    """An exported FUNCTION torch node with its inputs reordered by `reached_first`, or None where
    its input 0 needs a gradient already (or it is another torch node)."""
    attributes = node_attributes(node)
    if attributes["operator"].decode() != FUNCTION or not node.input or node.input[0] in reached:
        return None
    params = torch_node_params_of(node)
    inputs, operands = reached_first(list(node.input), reached)
    return torch_node(FUNCTION, inputs, list(node.output), name=node.name, params={**params, "operands": operands})


def _autograd_function_node(node, reached):
    """A custom autograd.Function's node (`_export.autograd_functions`) with the inputs that need
    gradients first (`reached_first`) and listed in `needs_grad` (its ctx.needs_input_grad); None
    where none does (it then runs without recording its backward)."""
    if not reached.intersection(node.input):
        return None
    params = torch_node_params_of(node)
    order = sorted(range(len(node.input)), key=lambda k: node.input[k] not in reached)
    earlier = params.get("operands", range(len(node.input)))
    operands = [earlier[k] for k in order]
    inputs = [node.input[k] for k in order]
    params = {**params, "operands": operands, "needs_grad": [k for k, name in enumerate(inputs) if name in reached]}
    return torch_node(AUTOGRAD_FUNCTION, inputs, list(node.output), name=node.name, params=params)


def replace_nodes(model, nodes):
    """`model`'s nodes become `nodes` (some of them torch nodes): their domain is imported."""
    set_nodes(model.graph, nodes)
    if not any(opset.domain == DOMAIN for opset in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))


def register_torch_node_gradients(model):
    """Registers with ONNX Runtime's gradient builder the gradient of each torch node of `model`
    (keyed by operator and parameters; registering again is harmless)."""
    for node in model.graph.node:
        if node.domain != DOMAIN:
            continue
        attributes = node_attributes(node)
        operator, overload = attributes["operator"].decode(), attributes.get("overload_name", b"").decode()
        if operator in STOPS_GRADIENT:  # detach, a factor's bf16 copy (the product's gradient: to its fp32 factors)
            C.register_custom_stop_gradient_edges(f"{DOMAIN}::ATen::{operator}::{overload}", {0})
        if operator not in GRADIENTS:
            continue
        params = json.loads(overload or "{}")
        # inputs without a gradient (a recurrent layer's constant initial state), by their place in the node
        stop = {params["operands"].index(k) if "operands" in params else k for k in params.get("stop_gradient", ())}
        if stop:
            C.register_custom_stop_gradient_edges(f"{DOMAIN}::ATen::{operator}::{overload}", stop)
        if len(stop) == len(node.input):  # RReLU's slopes: nothing differentiable
            continue
        if operator == AUTOGRAD_FUNCTION:  # its outputs' gradients, then its context
            if not params["differentiable"] or not params.get("needs_grad"):
                C.register_custom_stop_gradient_edges(f"{DOMAIN}::ATen::{operator}::{overload}",
                                                      set(range(len(node.input))))
                continue
            inputs = [f"GO({k})" for k in params["differentiable"]] + [f"O({len(node.output) - 1})"]
        elif operator == PRODUCT:  # the factors' bf16 copies (no gradient to them), a third operand for its shape
            operands = len(params["operands"])
            C.register_custom_stop_gradient_edges(f"{DOMAIN}::ATen::{operator}::{overload}",
                                                  {operands, operands + 1})
            third = [f"I({params['operands'].index(2)})"] if operands > 2 else []
            inputs = ["GO(0)", f"I({operands})", f"I({operands + 1})", *third]
        else:
            inputs = [f"GO({k})" for k in range(params.get("differentiable_outputs", 1))]
            inputs += [f"I({k})" for k in range(len(node.input))]
            if params.get("draws"):  # the generator's state the forward drew from (`_runtime.torch_ops`)
                inputs.append(f"O({len(node.output) - 1})")
        # output k: input k's gradient, "" where the builder needs none
        definition = _gradient_node(GRADIENTS[operator], inputs, [f"GI({k})" for k in range(len(node.input))], params)
        C.register_gradient_definition(f"{DOMAIN}::ATen::{operator}::{overload}", [definition])


def finish_torch_node_gradients(model):
    """After the gradient builder, in place: each one-pass gradient node lists the inputs whose
    gradients it computes (`params['wanted']`) and outputs those only (the builder leaves the others'
    outputs empty: the executor cannot tell them apart); gradients of torch nodes' outputs that
    nothing computes become zeros (`_missing_output_gradients_as_zeros`); a custom autograd.Function's
    gradient node lists those (`params['absent']`), which its backward does not get (as in eager)."""
    zeros = _missing_output_gradients_as_zeros(model)
    for node in model.graph.node:
        operator = torch_node_operator(node)
        if operator in GRADIENT_OPERATORS:
            params = torch_node_params_of(node)
            params["wanted"] = [k for k, name in enumerate(node.output) if name]
            if operator == AUTOGRAD_FUNCTION_GRAD:
                params["absent"] = [j for j, name in enumerate(node.input[:-1]) if name in zeros]
            kept = [name for name in node.output if name]
            del node.output[:]
            node.output.extend(kept)
            set_torch_node_params(node, params)


def _missing_output_gradients_as_zeros(model):
    """A torch node's gradient reads the gradient of each of its differentiable outputs, and the
    builder names it (`<output>_grad`) even where nothing computes it (the h_n of an nn.RNN the loss
    does not read): those gradients become zeros of the output's shape (in place), or a scalar zero
    for the nodes that read one as "no gradient" (`_SCALAR_ZEROS`). Returns their names."""
    graph = model.graph
    defined = {value.name for value in (*graph.input, *graph.initializer)} | {
        name for node in graph.node for name in node.output}
    types = {value.name: value.type.tensor_type.elem_type for value in (*graph.value_info, *graph.output)}
    nodes, zeros = [], set()
    for node in graph.node:
        if node.domain == DOMAIN:
            for name in node.input:
                output = name[:-len("_grad")]
                if name.endswith("_grad") and name not in defined and name not in zeros and output in defined:
                    element_type = types.get(output) or onnx.TensorProto.FLOAT
                    if torch_node_operator(node) in _SCALAR_ZEROS:
                        nodes.append(onnx.helper.make_node("Constant", [], [name], value=onnx.helper.make_tensor(
                            f"{name}/zero", element_type, [], [0])))
                    else:
                        zero = onnx.helper.make_tensor(f"{name}/zero", element_type, [1], [0])
                        nodes += [onnx.helper.make_node("Shape", [output], [f"{name}/shape"]),
                                  onnx.helper.make_node("ConstantOfShape", [f"{name}/shape"], [name], value=zero)]
                    zeros.add(name)
        nodes.append(node)
    if zeros:
        replace_nodes(model, nodes)
    return zeros


# gradient nodes that read a scalar zero as an output's absent gradient: label sparsity's projection
# (`_runtime.labelled_projection`: its logits fetched from ORTTrainer's graph, which differentiates the loss alone)
_SCALAR_ZEROS = frozenset({LABELLED_PROJECTION_GRAD})


def _gradient_node(operator, inputs, outputs, params):
    node = C.GradientNodeDefinition()
    node.op_type, node.domain, node.inputs, node.outputs = "ATen", DOMAIN, inputs, outputs
    node.attributes = [_string_attribute("operator", operator),
                       _string_attribute("overload_name", torch_node_params(params))]
    return node


def _string_attribute(name, value):
    attribute = C.GradientNodeAttributeDefinition()
    attribute.name, attribute.value_json = name, json.dumps(value)
    attribute.dtype, attribute.is_tensor = "string", False
    return attribute


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
    replace_nodes(training, nodes)
    known = {info.name for info in graph.value_info}
    for output, element_type in added:  # ATen outputs have no type inference: declare them
        if output not in known:
            graph.value_info.append(onnx.helper.make_tensor_value_info(output, element_type, None))


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
                      params={"modes": {str(rank): mode for rank, mode in torch_modes.items()},
                              "align_corners": align_corners})


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
        "transposed": True, "stride": list(attributes.get("strides", [])), "padding": pads[:half],
        "dilation": list(attributes.get("dilations", [])), "output_padding": list(attributes.get("output_padding", [])),
        "groups": int(attributes.get("group", 1))})
