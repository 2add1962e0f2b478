"""bf16 matrix products on the CPU as torch nodes (`_graph.autocast`, on CPUs with bf16
instructions): ONNX Runtime's CPU provider has no bfloat16 kernel, torch's (oneDNN, AMX or
AVX512-BF16) run the product and its gradients in bf16, with fp32 accumulation, as under
`torch.autocast('cpu', torch.bfloat16)`.

A MatMul, Gemm, FusedMatMul, Conv or ConvTranspose that computes in fp32 becomes one torch node
with the same fp32 inputs and output: it casts its inputs to bf16, computes in bf16 and returns the
result in fp32, so everything after it computes in fp32 as with the other mixed-precision graphs.
Its two factors it reads as bf16 copies (`TO_BF16` nodes, one per tensor, whatever number of
products and gradients read it, as autocast's weight cache converts a weight once; the node also
takes the fp32 factors, which the gradients flow to). Its one gradient node reads those copies and
the output gradient, cast to bf16 once for all the operands' gradients, and returns them in fp32:
the gradients torch's autograd of the same casts gives. The operands are listed with one that
needs a gradient first (`reached_first`). Products torch cannot state the same way (ONNX's
auto_pad or asymmetric pads, an explicit ConvTranspose output_shape, FusedMatMul's batch
transposes) are left to the caller's rounding emulation.
"""
import onnx

from .._onnx import inferred_tensors, node_attributes, torch_node
from .torch_node_shapes import set_value_info
from .torch_nodes import (PRODUCT, TO_BF16, needing_gradient, reached_first, register_torch_node_gradients,
                          replace_nodes)


def products_as_torch_nodes(model, computes_in_fp32, *, differentiable=()):
    """Rewrites (in place) each product node of `model` that computes in fp32 (`computes_in_fp32(node)`)
    and that `product_params` can state, as a bf16 torch node (its output keeps its name, type and
    inferred shape), and registers the nodes' gradients. `differentiable`: the inputs gradients
    flow from (the operand order depends on them). Returns the names of the rewritten outputs."""
    reached, tensors = needing_gradient(model, differentiable), inferred_tensors(model)
    transposes = {node.output[0]: node for node in model.graph.node if _swaps_last_two_dims(node)}
    readers = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    graph_outputs = {output.name for output in model.graph.output}
    available = {value.name for value in (*model.graph.input, *model.graph.initializer)}  # so far, in order
    nodes, outputs, copies, folded_adds = [], [], {}, set()
    for node in model.graph.node:
        available.update(node.output)
        params = product_params(node)
        if node.op_type == "Add" and node.output[0] in folded_adds:
            continue
        if params is None or not computes_in_fp32(node):
            nodes.append(node)
            continue
        inputs, output = list(node.input), node.output[0]
        if params["kind"] != "convolution":  # a transposed operand read as it is, transposed by the kernel
            for k, flag in ((0, "trans_a"), (1, "trans_b")):
                if inputs[k] in transposes:
                    inputs[k], params[flag] = transposes[inputs[k]].input[0], not params[flag]
        bias_add = None if output in graph_outputs else _bias_add(node, params, readers.get(output, []), tensors,
                                                                  available)
        if bias_add is not None:  # added inside the product, as torch's linear adds its bias
            inputs.append(bias_add.input[1] if bias_add.input[0] == output else bias_add.input[0])
            output = bias_add.output[0]
            folded_adds.add(output)
        listed, operands = reached_first([name for name in inputs if name], reached)
        for name in inputs[:2]:  # one bf16 copy of each factor, read by every product and gradient that needs it
            if name not in copies:
                copies[name] = f"{name}__bf16"
                nodes.append(torch_node(TO_BF16, [name], [copies[name]], name=f"{name}__to_bf16",
                                        params={"output_type": onnx.TensorProto.BFLOAT16}))
        nodes.append(torch_node(PRODUCT, [*listed, *(copies[name] for name in inputs[:2])], [output],
                                name=node.name, params={**params, "operands": operands}))
        outputs.append(output)
    if not outputs:
        return outputs
    read = {name for node in nodes for name in node.input} | {output.name for output in model.graph.output}
    replace_nodes(model, [node for node in nodes if node.op_type != "Transpose" or node.output[0] in read])
    known = {value.name for value in (*model.graph.value_info, *model.graph.output)}
    for name in outputs:  # ATen outputs get no type or shape inference: the product's inferred ones
        dims = tensors.get(name, (0, None))[1]
        if dims is not None or name not in known:
            set_value_info(model, name, onnx.TensorProto.FLOAT, dims)
    for name, copy in copies.items():
        set_value_info(model, copy, onnx.TensorProto.BFLOAT16, tensors.get(name, (0, None))[1])
    register_torch_node_gradients(model)
    return outputs


def _bias_add(node, params, readers, tensors, available):
    """The Add that is the only reader of a MatMul's output and adds a 1-d fp32 tensor, `available`
    already (the torch node takes the MatMul's place), to it (the bias of a linear on a batch of
    sequences, which the exporter splits from its product), or None."""
    if params["kind"] != "matmul" or params["alpha"] != 1.0 or len(readers) != 1:
        return None
    add = readers[0]
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or list(add.input).count(node.output[0]) != 1:
        return None
    bias = add.input[1] if add.input[0] == node.output[0] else add.input[0]
    element_type, dims = tensors.get(bias, (0, None))
    folds = bias in available and element_type == onnx.TensorProto.FLOAT and dims is not None and len(dims) == 1
    return add if folds else None


def _swaps_last_two_dims(node):
    """A Transpose that swaps its input's last two dims and keeps the others (a matrix's transpose)."""
    if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
        return False
    perm = list(node_attributes(node).get("perm", []))
    return len(perm) >= 2 and perm == list(range(len(perm) - 2)) + [len(perm) - 1, len(perm) - 2]


def product_params(node):
    """The torch node parameters of a product node (`kind`: matmul, gemm or convolution, and its
    attributes), or None where torch's op cannot state it."""
    attributes = node_attributes(node)
    if node.op_type in ("MatMul", "FusedMatMul"):
        if attributes.get("transBatchA", 0) or attributes.get("transBatchB", 0):
            return None
        return {"kind": "matmul", "alpha": float(attributes.get("alpha", 1.0)),
                "trans_a": bool(attributes.get("transA", 0)), "trans_b": bool(attributes.get("transB", 0))}
    if node.op_type == "Gemm":
        return {"kind": "gemm", "alpha": float(attributes.get("alpha", 1.0)),
                "beta": float(attributes.get("beta", 1.0)),
                "trans_a": bool(attributes.get("transA", 0)), "trans_b": bool(attributes.get("transB", 0))}
    if node.op_type in ("Conv", "ConvTranspose"):
        return _convolution_params(node.op_type, attributes)
    return None


def _convolution_params(op_type, attributes):
    pads = list(attributes.get("pads", []))
    half = len(pads) // 2
    if (attributes.get("auto_pad", b"NOTSET") != b"NOTSET" or pads[:half] != pads[half:]
            or "output_shape" in attributes):
        return None
    return {"kind": "convolution", "transposed": op_type == "ConvTranspose",
            "stride": list(attributes.get("strides", [])),
            "padding": pads[:half], "dilation": list(attributes.get("dilations", [])),
            "output_padding": list(attributes.get("output_padding", [])), "groups": int(attributes.get("group", 1))}
