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
import math

import onnx

from .._onnx import (full_shape_outputs_without, graph_index, inferred_tensors, node_attributes, set_nodes, torch_node,
                     torch_node_operator, torch_node_params_of)
from .._torch_node_catalogue import LOG_SOFTMAX_FP32, PRODUCT, PRODUCT_GRAD, SOFTMAX_GRAD_TO_BF16, TO_BF16, TO_FP32
from .torch_node_shapes import set_value_info
from .torch_nodes import needing_gradient, reached_first, register_torch_node_gradients, replace_nodes


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


def scaled_in_fp32(params):
    """Whether a product node (`params`) scales its bf16 result by alpha in fp32: a MatMul's or a
    Gemm's without a third operand (addmm scales in bf16 with one)."""
    return params["kind"] != "convolution" and len(params["operands"]) == 2 and params["alpha"] != 1.0


def bf16_logits_into_loss(model):
    """In a built graph for the CPU (in place): a bf16 product whose result only a (reshaped)
    LogSoftmax reads (the vocabulary projection before the cross-entropy, `_graph.cpu_kernels`)
    returns bf16, the LogSoftmax reads it in fp32 (`LOG_SOFTMAX_FP32`: the values autocast's loss
    sees, without an fp32 copy of the logits); in a training graph, the loss gradient (its Exp,
    ScatterElements and Mul) is one torch node writing bf16 (`SOFTMAX_GRAD_TO_BF16`: no logits-sized
    fp32 tensor), which the product's gradient reads as it is. Same values as the fp32 logits and
    gradient, conversions of logits-sized tensors fewer. A training graph whose loss gradient is not
    those nodes keeps fp32, and so does a product that scales its result in fp32 (`scaled_in_fp32`).
    Returns the number of products rewritten.

    An ORTModule graph may also return the logits (Hugging Face's models compute the loss in
    forward and return both), in bf16 as autocast does (`_graph.autocast.cast_outputs`' Cast):
    then the product writes that output and the loss reads it. In the backward the output's
    gradient (bf16) is added by `SOFTMAX_GRAD_TO_BF16` to the bf16 loss gradient, as autocast's autograd
    sums the two bf16 gradients, in place of ONNX Runtime's Cast to fp32 and Sum; a scalar zero
    adds nothing, so the output's gradient need no longer have its shape (dropped from the YieldOp's
    `full_shape_outputs`): logits the user's loss does not use cost no logits-sized zeros."""
    graph = model.graph
    producers, readers, outputs, yield_op = graph_index(graph)

    def only_reader(name):
        found = readers.get(name, [])
        return found[0] if len(found) == 1 and name not in outputs else None

    def returned_cast(name):
        """The Cast to bf16 of `name` that is a forward output, or None."""
        casts = [node for node in readers.get(name, []) if _returns_bf16(node, outputs)]
        return casts[0] if len(casts) == 1 else None

    training = any(torch_node_operator(node) == PRODUCT_GRAD for node in graph.node)
    replaced, renamed, bf16_values, log_probs, freed, rewritten = {}, {}, [], [], [], 0
    for log_softmax in graph.node:
        if log_softmax.op_type != "LogSoftmax" or log_softmax.domain not in ("", "ai.onnx"):
            continue
        logits, reshapes = log_softmax.input[0], []
        while producers.get(logits) is not None and producers[logits].op_type == "Reshape" \
                and only_reader(logits) is not None:
            reshapes.append(logits)
            logits = producers[logits].input[0]
        product, returned = producers.get(logits), returned_cast(logits)
        loss_readers = [node for node in readers.get(logits, []) if node is not returned]
        if product is None or torch_node_operator(product) != PRODUCT or len(loss_readers) != 1 \
                or logits in outputs or scaled_in_fp32(torch_node_params_of(product)):
            continue
        output_grad = f"{returned.output[0]}_grad" if returned is not None else None
        gradient = _loss_gradient_into(product, log_softmax.input[0], producers, only_reader,
                                       output_grad if output_grad in producers else None) if training else []
        if training and not gradient:
            continue
        params = torch_node_params_of(product)
        axis = int(node_attributes(log_softmax).get("axis", -1))
        if returned is not None:  # the product writes the returned bf16 logits, which the loss reads
            renamed[logits], replaced[id(returned)] = returned.output[0], None
        replaced[id(product)] = torch_node(PRODUCT, list(product.input), list(product.output), name=product.name,
                                           params={**params, "output_bf16": True})
        replaced[id(log_softmax)] = torch_node(LOG_SOFTMAX_FP32, [log_softmax.input[0]], list(log_softmax.output),
                                               name=log_softmax.name, params={"axis": axis})
        bf16_values += [logits, *reshapes]
        log_probs.append((log_softmax.output[0], log_softmax.input[0]))
        if gradient:
            (mul, exp, scatter), grads, merge = gradient
            added = []
            if merge is not None:  # the returned logits' gradient, added to the loss's
                summed, cast_back, chain = merge
                renamed[chain], replaced[id(summed)], replaced[id(cast_back)] = summed.output[0], None, None
                added = [output_grad]
                freed.append(list(yield_op.input).index(returned.output[0]))
            replaced[id(exp)], replaced[id(scatter)] = None, None
            replaced[id(mul)] = torch_node(SOFTMAX_GRAD_TO_BF16, [*exp.input, *scatter.input[1:], mul.input[1], *added],
                                           list(mul.output), name=mul.name, params={})
            bf16_values += grads
        rewritten += 1
    if rewritten:
        nodes = [replaced.get(id(node), node) for node in graph.node]
        for node in (node for node in nodes if node is not None):
            node.input[:] = [renamed.get(name, name) for name in node.input]
            node.output[:] = [renamed.get(name, name) for name in node.output]
        if freed:
            full_shape_outputs_without(yield_op, freed)
        set_nodes(graph, [node for node in nodes if node is not None])
        tensors = inferred_tensors(model)
        for name in bf16_values:
            set_value_info(model, renamed.get(name, name), onnx.TensorProto.BFLOAT16,
                           tensors.get(name, (0, None))[1])
        for name, logits in log_probs:  # a torch node's output: typed here
            set_value_info(model, name, onnx.TensorProto.FLOAT, tensors.get(logits, (0, None))[1])
    return rewritten


def _loss_gradient_into(product, loss_input, producers, only_reader, output_grad):
    """((the Exp, ScatterElements and Mul of the rewritten loss's gradient of `loss_input`), the
    gradient values from the Mul to the product's gradient node, the merge) where that gradient
    reaches `product`'s gradient node only through Reshapes and, where the logits are also returned
    (`output_grad`: the returned output's gradient), the Sum with that gradient cast to fp32: the
    merge is (the Sum, the Cast, the value the Sum adds it to), else None. Returns None where the
    gradient goes elsewhere."""
    mul = producers.get(f"{loss_input}_grad")
    if mul is not None and mul.op_type == "Sum" and output_grad is not None:  # the loss reads the returned logits
        mul = next((producers[name] for name in mul.input if name in producers and producers[name].op_type == "Mul"),
                   None)
    if mul is None or mul.op_type != "Mul" or not mul.input[0].endswith("/fast_sce_grad/unscaled"):
        return None
    scatter = producers.get(mul.input[0])
    exp = producers.get(scatter.input[0]) if scatter is not None and scatter.op_type == "ScatterElements" else None
    if exp is None or exp.op_type != "Exp" or only_reader(exp.output[0]) is not scatter \
            or only_reader(mul.input[0]) is not mul:
        return None
    grads, value, merge = [mul.output[0]], mul.output[0], None
    while True:
        reader = only_reader(value)
        if reader is None:
            return None
        if torch_node_operator(reader) == PRODUCT_GRAD and list(reader.input[:1]) == [value] \
                and torch_node_params_of(reader).get("kind") == torch_node_params_of(product).get("kind") \
                and reader.input[1:3] == product.input[len(torch_node_params_of(product)["operands"]):]:
            return ((mul, exp, scatter), grads, merge) if (merge is None) == (output_grad is None) else None
        if reader.op_type == "Sum" and merge is None and output_grad is not None and len(reader.input) == 2:
            other = reader.input[1] if reader.input[0] == value else reader.input[0]
            cast_back = producers.get(other)
            if cast_back is None or cast_back.op_type != "Cast" or list(cast_back.input) != [output_grad] \
                    or only_reader(other) is not reader:
                return None
            merge = (reader, cast_back, value)
        elif reader.op_type != "Reshape":
            return None
        value = reader.output[0]
        if merge is None or merge[0] is not reader:
            grads.append(value)


def _returns_bf16(node, outputs):
    """Whether `node` is a Cast to bf16 whose result is a forward output (`_graph.autocast.cast_outputs`)."""
    return node.op_type == "Cast" and node.output[0] in outputs \
        and node_attributes(node).get("to") == onnx.TensorProto.BFLOAT16


def bf16_outputs_from_products(model):
    """In a built ORTModule graph for the CPU (in place): an output autocast returns in bf16 that
    only a Cast of a bf16 product's fp32 result computes (the seed model's logits, its loss computed
    by the user in torch) is written by the product in bf16, and in a training graph its gradient
    (bf16) goes to the product's gradient node as it is, without ONNX Runtime's Cast to fp32: two
    conversions of an output-sized tensor fewer, the same values (bf16 -> fp32 -> bf16 is exact).
    A product whose result something else reads, or scaled in fp32 (`scaled_in_fp32`), keeps its
    Cast. Returns the number of outputs rewritten."""
    graph = model.graph
    producers, readers, outputs, _ = graph_index(graph)
    replaced, renamed = {}, {}
    for cast in (node for node in graph.node if _returns_bf16(node, outputs)):
        result, output, grad = cast.input[0], cast.output[0], f"{cast.output[0]}_grad"
        product = producers.get(result)
        if product is None or torch_node_operator(product) != PRODUCT or readers[result] != [cast] \
                or result in outputs or scaled_in_fp32(torch_node_params_of(product)):
            continue
        back = readers[grad][0] if len(readers.get(grad, [])) == 1 else None
        if grad in producers and not _cast_into_product_gradient(back, product, readers):
            continue
        replaced[id(product)] = torch_node(PRODUCT, list(product.input), [output], name=product.name,
                                           params={**torch_node_params_of(product), "output_bf16": True})
        replaced[id(cast)] = None
        if back is not None:  # the product's gradient node reads the bf16 gradient
            replaced[id(back)], renamed[back.output[0]] = None, grad
    if replaced:
        nodes = [replaced.get(id(node), node) for node in graph.node]
        for node in (node for node in nodes if node is not None):
            node.input[:] = [renamed.get(name, name) for name in node.input]
        set_nodes(graph, [node for node in nodes if node is not None])
    return sum(node is not None for node in replaced.values())  # the products rewritten


def _cast_into_product_gradient(back, product, readers):
    """Whether `back` is a Cast whose result only `product`'s gradient node reads, as the output
    gradient it computes the operands' gradients from."""
    found = readers.get(back.output[0], []) if back is not None and back.op_type == "Cast" else []
    if len(found) != 1:
        return False
    node, factors = found[0], product.input[len(torch_node_params_of(product)["operands"]):]
    return torch_node_operator(node) == PRODUCT_GRAD and node.input[0] == back.output[0] \
        and node.input[1:3] == factors


_LARGE_CAST = 1 << 16  # elements: a smaller Cast stays ONNX Runtime's (a torch node's call costs more there)
_CASTS = {onnx.TensorProto.BFLOAT16: (onnx.TensorProto.FLOAT, TO_BF16), onnx.TensorProto.FLOAT:
          (onnx.TensorProto.BFLOAT16, TO_FP32)}  # target type -> (the source type, the torch node)


def bf16_casts_in_torch(model):
    """In a built graph for the CPU (in place): each Cast between fp32 and bf16 of a large tensor
    (autocast's bf16 outputs of an ORTModule, their gradients) becomes a torch node converting into a reused
    buffer: ONNX Runtime's CPU Cast to and from bf16 is a scalar loop, 4x slower than torch's
    (1024 x 50,257 logits: 124 ms there and back, 33 ms in torch). Returns the number replaced."""
    if not any(node.op_type == "Cast" and node_attributes(node).get("to") in _CASTS for node in model.graph.node):
        return 0
    tensors = inferred_tensors(model)  # first: it sets the graph's nodes anew
    nodes, replaced = [], []
    for node in model.graph.node:
        target = node_attributes(node).get("to") if node.op_type == "Cast" and node.domain in ("", "ai.onnx") else None
        source, operator = _CASTS.get(target, (None, None))
        element_type, dims = tensors.get(node.input[0], (0, None)) if node.input else (0, None)
        large = dims is not None and all(isinstance(dim, int) for dim in dims) and math.prod(dims) >= _LARGE_CAST
        if operator is None or element_type != source or not large:
            nodes.append(node)
            continue
        nodes.append(torch_node(operator, [node.input[0]], [node.output[0]], name=node.name,
                                params={"output_type": target}))
        replaced.append((node.output[0], target, dims))
    if replaced:
        set_nodes(model.graph, nodes)
        for name, target, dims in replaced:
            set_value_info(model, name, target, dims)
    return len(replaced)
