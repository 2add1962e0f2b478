"""Kernel substitutions for graphs that run on the CPU provider (`kernel_substitutions`).

ORT's CPU kernels of the softmax cross-entropy (and its gradient), of the embedding gradient and
of the tanh-GELU gradient are single-threaded; these rewrites give the same math with threaded
kernels (BENCHMARKS.md): the GELU and layer norm gradients torch's, where the graph may run torch kernels.
Reductions of a whole tensor run in torch, whose pairwise sums are exact to float rounding
where ORT's running sum was off by 1.7e-5 relative over 1M elements (a mean-squared loss).
Gradients the CPU provider has no kernel for (ResizeGrad, ConvTransposeGrad) run torch's backward
(`_graph.torch_nodes`); fp32 products torch's kernels compute faster run in torch (`_graph.cpu_products`);
a tied embedding's rows are added into the projection's weight gradient (`_graph.tied_embedding_gradient`).
The CUDA provider keeps ORT's own kernels: fewer launches, and its GatherGrad is deterministic
where GatherNDGrad adds with atomics.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable

import onnx

from .._onnx import (inferred_tensors, int64_constant, node_attributes, onnx_opset, set_nodes, set_torch_node_params,
                     torch_node, torch_node_operator, torch_node_params_of)
from .._torch_node_catalogue import FUNCTION, GELU_GRAD, LAYER_NORM_GRAD  # torch's gelu_backward, layer norm's
from .._torch_node_catalogue import LABELLED_PROJECTION, MATRIX_PRODUCT, ROWS_ADDED
from .cpu_products import matrix_products_in_torch
from .torch_node_shapes import set_value_info
from .torch_nodes import replace_nodes, substitute_torch_kernels
from .bf16_products import bf16_casts_in_torch, bf16_logits_into_loss, bf16_outputs_from_products
from .loss_gradient import softmax_grads_in_torch
from .loss_targets import out_of_range_error
from .tied_embedding_gradient import rows_into_weight_gradients


def kernel_substitutions(device_type: str | None) -> Callable[..., None] | None:
    """The kernel substitutions for graphs that run on `device_type` ('cpu', 'cuda'):
    `substitute_cpu_kernels` on the CPU; None (ONNX Runtime's own kernels) elsewhere."""
    return substitute_cpu_kernels if device_type == "cpu" else None


def substitute_cpu_kernels(training, evaluation, *, faster_in_torch=None):
    """Rewrites the built training and eval graphs (ModelProtos) in place. `faster_in_torch`: the
    decision of which fp32 products run in torch (`_graph.cpu_products`); None: none does, and the
    tanh-GELU, LayerNorm and fp32 loss gradients stay ONNX nodes (deterministic and ORT_PARALLEL
    sessions, recomputed graphs)."""
    fast_softmax_cross_entropy(training)
    fast_gather_grad(training)
    if faster_in_torch is not None:
        gelu_grads_in_torch(training)
        layer_norm_grads_in_torch(training)
    fast_gelu_grad(training)
    substitute_torch_kernels(training)
    fast_softmax_cross_entropy(evaluation)
    for model in {id(training): training, id(evaluation): evaluation}.values():
        whole_tensor_sums_in_torch(model)
        bf16_logits_into_loss(model)  # after the loss rewrite, whose LogSoftmax reads the logits
        bf16_outputs_from_products(model)  # then the Casts of outputs the loss does not read
        bf16_casts_in_torch(model)
    if faster_in_torch is not None:
        for model in {id(training): training, id(evaluation): evaluation}.values():
            matrix_products_in_torch(model, faster_in_torch)
        softmax_grads_in_torch(training)  # after bf16_logits_into_loss, which takes the bf16 losses' gradients
    rows_into_weight_gradients(training)  # after the products that write the weights' gradients went to torch
    for model in {id(training): training, id(evaluation): evaluation}.values():
        name_graph_outputs(model)


# The torch nodes that can write a graph output into the caller's bound buffer (`_runtime.cpu_buffers.output`).
_WRITE_BOUND_OUTPUTS = frozenset({MATRIX_PRODUCT, ROWS_ADDED, LABELLED_PROJECTION})


def name_graph_outputs(model: onnx.ModelProto) -> int:
    """Tells each torch node of `_WRITE_BOUND_OUTPUTS` that writes a graph output its name
    (`params['graph_outputs']`, "" for its other outputs), in place; and the product whose result
    an in-place ROWS_ADDED writing a graph output adds rows to, that output's name. Why: ONNX
    Runtime copies a torch node's output into the buffer the caller bound to that output
    (ORTTrainer's gradients, in its flat buffer, and fetched outputs), unless it is that buffer;
    named, the node writes there (GPT-2's weight gradients: one copy of every parameter a step).
    Returns the nodes named."""
    outputs = {value.name for value in model.graph.output}
    producers = {name: node for node in model.graph.node for name in node.output}
    names = {}  # id(node) -> its outputs' graph output names
    for node in model.graph.node:
        if torch_node_operator(node) in _WRITE_BOUND_OUTPUTS and outputs.intersection(node.output):
            names[id(node)] = (node, [name if name in outputs else "" for name in node.output])
            writer = producers.get(node.input[0])
            if (torch_node_operator(node) == ROWS_ADDED and torch_node_params_of(node)["in_place"]
                    and writer is not None and torch_node_operator(writer) == MATRIX_PRODUCT):
                names[id(writer)] = (writer, [node.output[0]])  # its result is the bound buffer, rows added there
    for node, graph_outputs in names.values():
        set_torch_node_params(node, {**torch_node_params_of(node), "graph_outputs": graph_outputs})
    return len(names)


_LOSS_ROWS = "/fast_sce"  # in the names of the rewritten loss's tensors
# Marks the GatherElements that picks each row's target: its name carries what the error needs.
_PICK = "fast_sce_pick"
_OUT_OF_RANGE = re.compile(_PICK + r"\[classes=(\w+),ignore_index=(-?\w+)\].*Out of range value in index tensor", re.S)


def _label_nodes(prefix, label, ignore_index):
    """Nodes for the int64 target index [N, 1, ...] (ignored rows point at class 0) and, with an
    ignore_index, the float 0/1 weight of every row. Returns (nodes, index name, weight name or None).

    A negative target that is not ignore_index points far past the classes, so that the pick's
    GatherElements refuses it as ORT's kernel and torch do (GatherElements would read a negative
    index from the end); `target_out_of_range` turns that error into a clear one."""
    make, p = onnx.helper.make_node, prefix
    nodes = [make("Cast", [label], [p + "label64"], to=onnx.TensorProto.INT64), int64_constant(p + "axis1", [1]),
             int64_constant(p + "zero", 0), int64_constant(p + "out_of_range", 2**62),
             make("Less", [p + "label64", p + "zero"], [p + "negative"])]
    if ignore_index is None:
        nodes += [make("Where", [p + "negative", p + "out_of_range", p + "label64"], [p + "checked"]),
                  make("Unsqueeze", [p + "checked", p + "axis1"], [p + "index"])]
        return nodes, p + "index", None
    nodes += [int64_constant(p + "ignore_index", ignore_index),
              make("Equal", [p + "label64", p + "ignore_index"], [p + "ignored"]),
              make("Where", [p + "negative", p + "out_of_range", p + "label64"], [p + "checked"]),
              make("Where", [p + "ignored", p + "zero", p + "checked"], [p + "safe_label"]),
              make("Unsqueeze", [p + "safe_label", p + "axis1"], [p + "index"]),
              make("Not", [p + "ignored"], [p + "kept"]),
              make("Cast", [p + "kept"], [p + "weight"], to=onnx.TensorProto.FLOAT)]
    return nodes, p + "index", p + "weight"


def target_out_of_range(error: Exception) -> IndexError | None:
    """The IndexError (torch's type for it) that explains ONNX Runtime's `error`, when the error is
    a loss target out of range in a rewritten softmax cross-entropy; else None."""
    match = _OUT_OF_RANGE.search(str(error))
    if match is None:
        return None
    classes, ignore_index = match.groups()
    return out_of_range_error(classes, None if ignore_index == "none" else ignore_index)


def _classes(graph, logits):
    """The class count (dim 1 of the logits) where the graph knows it, else 'C'."""
    for value in (*graph.input, *graph.output, *graph.value_info):
        if value.name == logits:
            dims = value.type.tensor_type.shape.dim
            if len(dims) > 1 and dims[1].HasField("dim_value"):
                return str(dims[1].dim_value)
    return "C"


def fast_softmax_cross_entropy(model):
    """Replaces ORT's SoftmaxCrossEntropyLoss (and its gradient) by multithreaded kernels, in place.

    Why: on the CPU both kernels are single-threaded loops (the forward also mallocs and zeroes
    two scratch copies of the logits every call); on the seed model (700 x 28,782 logits) they
    were ~60% of the training graph's time. The forward becomes LogSoftmax(axis=1) (MLAS,
    threaded) + GatherElements + a masked mean; the gradient, exp(log_prob) - onehot(label)
    scaled per row, becomes Exp + ScatterElements (in place) + Mul. Same math, same outputs
    (loss, log_prob, gradient), torch's semantics: rows whose label is ignore_index count for
    nothing; if every row is ignored the loss is NaN (torch) and the gradient is zero.
    The gradient takes prob[label] as exp of the forward's picked log_prob: that orders the
    forward's GatherElements before the backward, so log_prob dies at the backward's Exp (ORT
    otherwise ran it last, keeping one more logits-sized buffer alive through the backward).

    Rewritten only where exact: reduction 'mean', no class weights, float32 (the loss's type is
    known from the graph's outputs/value_info), opset >= 13; other nodes are left as they are.
    Run on the built training graph (the builder must see the original node to emit
    SoftmaxCrossEntropyLossGrad) and on the eval graph. Returns the number of nodes replaced.
    """
    if onnx_opset(model) < 13:
        return 0
    graph = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.output, *graph.value_info)}
    forwards, nodes, replaced = {}, [], 0  # log_prob name -> (loss attributes, picked log_prob name)
    for node in graph.node:
        attributes = node_attributes(node)
        if _is_rewritable_loss(node, attributes, types):
            nodes += _loss_nodes(graph, node, attributes, forwards)
        elif (node.op_type == "SoftmaxCrossEntropyLossGrad" and len(node.input) == 3
              and node.input[1] in forwards and attributes == forwards[node.input[1]][0]):
            nodes += _loss_gradient_nodes(node, attributes, forwards[node.input[1]][1])
        else:
            nodes.append(node)
            continue
        replaced += 1
    set_nodes(graph, nodes)
    return replaced


def _is_rewritable_loss(node, attributes, types):
    """A SoftmaxCrossEntropyLoss with reduction 'mean', no class weights, on float32."""
    return (node.op_type == "SoftmaxCrossEntropyLoss" and node.domain in ("", "ai.onnx")
            and attributes.get("reduction", b"mean") == b"mean" and len(node.input) == 2
            and onnx.TensorProto.FLOAT in (types.get(node.output[0]), types.get(node.input[0])))


def _loss_nodes(graph, node, attributes, forwards):
    """The loss as LogSoftmax + GatherElements + a masked mean; records in `forwards` what its
    gradient reads (log_prob name -> (attributes, picked log_prob name))."""
    make, p = onnx.helper.make_node, f"{node.output[0]}{_LOSS_ROWS}/"
    log_prob = node.output[1] if len(node.output) > 1 and node.output[1] else p + "log_prob"
    label_nodes, index, weight = _label_nodes(p, node.input[1], attributes.get("ignore_index"))
    nodes = [make("LogSoftmax", [node.input[0]], [log_prob], axis=1), *label_nodes,
             make("GatherElements", [log_prob, index], [p + "picked"], axis=1,
                  name=f"{p}{_PICK}[classes={_classes(graph, node.input[0])},"
                       f"ignore_index={attributes.get('ignore_index', 'none')}]"),
             make("Squeeze", [p + "picked", p + "axis1"], [p + "picked_log_prob"])]
    if weight is None:
        nodes.append(make("ReduceMean", [p + "picked_log_prob"], [p + "mean"], keepdims=0))
    else:
        nodes += [make("Mul", [p + "picked_log_prob", weight], [p + "kept_log_prob"]),
                  make("ReduceSum", [p + "kept_log_prob"], [p + "total"], keepdims=0),
                  make("ReduceSum", [weight], [p + "count"], keepdims=0),
                  make("Div", [p + "total", p + "count"], [p + "mean"])]
    nodes.append(make("Neg", [p + "mean"], [node.output[0]]))
    forwards[log_prob] = (attributes, p + "picked")
    return nodes


def _loss_gradient_nodes(node, attributes, picked):
    """The gradient, exp(log_prob) - onehot(label) scaled per row, as Exp + ScatterElements + Mul;
    `picked`: the forward's picked log_prob (exp of it is prob[label])."""
    make, p = onnx.helper.make_node, f"{node.output[0]}{_LOSS_ROWS}_grad/"
    loss_grad, log_prob, label = node.input
    label_nodes, index, weight = _label_nodes(p, label, attributes.get("ignore_index"))
    nodes = [*label_nodes, make("Constant", [], [p + "one"], value=onnx.helper.make_tensor(
        p + "one", onnx.TensorProto.FLOAT, [], [1.0]))]
    if weight is None:  # every row counts 1/N
        nodes += [make("Size", [label], [p + "rows"]),
                  make("Cast", [p + "rows"], [p + "count"], to=onnx.TensorProto.FLOAT),
                  make("Div", [loss_grad, p + "count"], [p + "scale"]),
                  make("Shape", [label], [p + "label_shape"]),
                  make("Expand", [p + "scale", p + "label_shape"], [p + "row_scale"])]
    else:  # kept rows count 1/kept; no kept row: zero gradient, as ORT's kernel
        nodes += [make("ReduceSum", [weight], [p + "count"], keepdims=0),
                  make("Max", [p + "count", p + "one"], [p + "safe_count"]),
                  make("Div", [loss_grad, p + "safe_count"], [p + "scale"]),
                  make("Mul", [weight, p + "scale"], [p + "row_scale"])]
    return nodes + [make("Unsqueeze", [p + "row_scale", p + "axis1"], [p + "row_scale1"]),
                    make("Exp", [log_prob], [p + "prob"]),
                    make("Exp", [picked], [p + "prob_at_label"]),
                    make("Sub", [p + "prob_at_label", p + "one"], [p + "grad_at_label"]),
                    make("ScatterElements", [p + "prob", index, p + "grad_at_label"], [p + "unscaled"], axis=1),
                    make("Mul", [p + "unscaled", p + "row_scale1"], [node.output[0]])]


def fast_gather_grad(model):
    """Replaces ORT's GatherGrad along axis 0 (an embedding's gradient) by GatherNDGrad, in place.

    Why: the CPU GatherGrad took 11-12 ms per step for the seed model's 700 tokens, whatever the
    vocabulary; GatherNDGrad scatter-adds the same rows in 1.4 ms, deterministically (GatherGrad's
    sums over repeated tokens changed from run to run). Same math: zeros of the weight's shape,
    then dY[k] added to row indices[k] (negative indices counted from the end). Returns the
    number of nodes replaced.
    """
    if onnx_opset(model) < 13:
        return 0
    make, nodes, replaced = onnx.helper.make_node, [], 0
    for node in model.graph.node:
        if node.op_type != "GatherGrad" or node.domain != "com.microsoft" or node_attributes(node).get("axis", 0) != 0:
            nodes.append(node)
            continue
        shape, indices, grad = node.input
        p = f"{node.output[0]}/fast_gather_grad/"
        nodes += [make("Cast", [indices], [p + "indices64"], to=onnx.TensorProto.INT64),
                  int64_constant(p + "last_axis", [-1]),
                  make("Unsqueeze", [p + "indices64", p + "last_axis"], [p + "nd_indices"]),
                  make("GatherNDGrad", [shape, p + "nd_indices", grad], list(node.output), domain="com.microsoft")]
        replaced += 1
    set_nodes(model.graph, nodes)
    return replaced


_GELU_GRADS = {"FastGeluGrad": False, "BiasFastGeluGrad_dX": True}  # op -> whether it takes a bias


def _float_gelu_grads(model):
    """The positions of the FastGeluGrad and BiasFastGeluGrad_dX nodes of `model` whose gradient is float32."""
    graph = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.output, *graph.value_info)}
    return {k for k, node in enumerate(graph.node) if node.domain == "com.microsoft" and node.op_type in _GELU_GRADS
            and types.get(node.output[0]) == onnx.TensorProto.FLOAT}


def gelu_grads_in_torch(model):
    """Replaces ORT's float32 FastGeluGrad and BiasFastGeluGrad_dX by one torch node each, torch's
    threaded `gelu_backward(approximate='tanh')` (the bias added first), in place; returns how many.

    Why: ORT's kernel is single-threaded and `fast_gelu_grad`'s 15 elementwise nodes pass over the
    tensor 15 times: (8, 128, 1024) takes 3.0 ms there, 0.9 ms in torch (BENCHMARKS.md), per layer
    and step. For graphs that may run torch kernels (`substitute_cpu_kernels`)."""
    chosen = _float_gelu_grads(model)
    nodes = [torch_node(GELU_GRAD, list(node.input), list(node.output), name=f"{node.name or node.output[0]}/torch",
                        params={}) if k in chosen else node for k, node in enumerate(model.graph.node)]
    if chosen:
        replace_nodes(model, nodes)
    return len(chosen)


def layer_norm_grads_in_torch(model):
    """Replaces ORT's float32 LayerNormalizationGrad by one torch node each, torch's threaded
    `native_layer_norm_backward` (eager PyTorch's own), in place; returns how many.

    Why: ORT's CPU kernel took 1.67 ms for a [512, 512] input where torch takes 0.11, 62 ms for
    [8192, 512] where torch takes 15 (2 threads): 10 ms a step of GPT-2 width 512 with 4 layers.
    For graphs that may run torch kernels (`substitute_cpu_kernels`)."""
    types = {v.name: v.type.tensor_type.elem_type for v in (*model.graph.output, *model.graph.value_info)}
    chosen = {k for k, node in enumerate(model.graph.node) if node.op_type == "LayerNormalizationGrad"
              and node.domain == "com.microsoft" and len(node.input) == 5
              and all(types.get(name) == onnx.TensorProto.FLOAT for name in node.output)}
    nodes = [torch_node(LAYER_NORM_GRAD, list(node.input), list(node.output),
                        name=f"{node.name or node.output[0]}/torch",
                        params={"axis": int(node_attributes(node).get("axis", -1))})
             if k in chosen else node for k, node in enumerate(model.graph.node)]
    if chosen:
        replace_nodes(model, nodes)
    return len(chosen)


def fast_gelu_grad(model):
    """Replaces ORT's FastGeluGrad and BiasFastGeluGrad_dX (the gradient of the tanh GELU, GPT-2's)
    by elementwise ONNX operators, in place.

    Why: ORT's CPU kernel is a single-threaded loop, 17.6 ms for one (8, 128, 1024) tensor with 1
    or 2 threads, 67 of the 258 ms per step of the GPT-2 example; the same math in 15 threaded
    elementwise nodes takes 3.0 ms. With t = tanh(k (x + c x^3)), k = sqrt(2/pi), c = 0.044715:
    dx = dy (0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 c x^2)), x with the bias added for the Bias
    variant. Rewritten where the gradient's type is known to be float32 (the constants' type).
    Returns the number of nodes replaced.
    """
    graph, make = model.graph, onnx.helper.make_node
    chosen = _float_gelu_grads(model)
    k, c = math.sqrt(2 / math.pi), 0.044715
    nodes, replaced = [], 0
    for position, node in enumerate(graph.node):
        if position not in chosen:
            nodes.append(node)
            continue
        p = f"{node.output[0]}/fast_gelu_grad/"
        dy, x = node.input[0], node.input[1]
        if _GELU_GRADS[node.op_type]:
            nodes.append(make("Add", [x, node.input[2]], [p + "x"]))
            x = p + "x"
        constants = {"k": k, "kc": k * c, "3kc": 3 * k * c, "half": 0.5, "one": 1.0}
        nodes += [make("Constant", [], [p + name], value=onnx.helper.make_tensor(p + name, onnx.TensorProto.FLOAT, [],
                                                                                  [value]))
                  for name, value in constants.items()]
        nodes += [make("Mul", [x, x], [p + "x2"]),
                  make("Mul", [p + "x2", p + "kc"], [p + "kc_x2"]),
                  make("Add", [p + "kc_x2", p + "k"], [p + "inner_slope"]),   # k (1 + c x^2)
                  make("Mul", [x, p + "inner_slope"], [p + "inner"]),         # k (x + c x^3)
                  make("Tanh", [p + "inner"], [p + "t"]),
                  make("Mul", [p + "x2", p + "3kc"], [p + "3kc_x2"]),
                  make("Add", [p + "3kc_x2", p + "k"], [p + "inner_derivative"]),  # k (1 + 3 c x^2)
                  make("Mul", [p + "t", p + "t"], [p + "t2"]),
                  make("Sub", [p + "one", p + "t2"], [p + "sech2"]),
                  make("Mul", [x, p + "sech2"], [p + "x_sech2"]),
                  make("Mul", [p + "x_sech2", p + "inner_derivative"], [p + "right"]),
                  make("Add", [p + "t", p + "right"], [p + "sum"]),
                  make("Add", [p + "sum", p + "one"], [p + "twice_derivative"]),
                  make("Mul", [p + "twice_derivative", p + "half"], [p + "derivative"]),
                  make("Mul", [dy, p + "derivative"], list(node.output))]
        replaced += 1
    set_nodes(graph, nodes)
    return replaced


_SUMS = {"ReduceSum": "sum", "ReduceMean": "mean"}  # op -> torch function
_SMALL_SUM = 16384  # elements: ORT's running sum is exact enough, and a torch node's call costs more


def whole_tensor_sums_in_torch(model):
    """Replaces float32 ReduceSum / ReduceMean of a whole tensor to a scalar by torch's sum / mean, in
    place, where the tensor is large or its size is not known.

    Why: ORT's CPU kernel adds the elements one after another in float32: the mean of 1M squares
    (an MSE loss over a 16 x 256 x 256 output) was 1.7e-5 relative from float64, torch's pairwise
    sum 3e-8, and 4x faster. The loss is what users compare against eager PyTorch. Gradients are
    other nodes (the builder's Expand / Div), unchanged. The rewritten cross-entropy's sums over its
    rows stay ORT's: a running sum is unchanged by the ignored rows' zeros, so the label-sparse
    graph's loss equals the dense one's bit for bit. Returns the number of nodes replaced.
    """
    nodes = list(model.graph.node)
    candidates = [k for k, node in enumerate(nodes) if _is_whole_tensor_sum(node, onnx_opset(model))
                  and _LOSS_ROWS not in node.output[0]]
    if not candidates:
        return 0
    tensors, replaced = inferred_tensors(model), 0
    for k in candidates:
        node = nodes[k]
        element_type, dims = tensors.get(node.input[0], (0, None))
        known = dims is not None and all(isinstance(dim, int) for dim in dims)
        if element_type != onnx.TensorProto.FLOAT or (known and math.prod(dims) < _SMALL_SUM):
            continue
        nodes[k] = torch_node(FUNCTION, [node.input[0]], list(node.output), name=node.name,
                              params={"function": _SUMS[node.op_type], "args": [], "kwargs": {}})
        set_value_info(model, node.output[0], element_type, [])  # ONNX Runtime infers nothing of a torch node
        replaced += 1
    replace_nodes(model, nodes)
    return replaced


def _is_whole_tensor_sum(node, opset):
    """A ReduceSum / ReduceMean to a scalar: no axes (input from opset 13 for ReduceSum, 18 for
    ReduceMean; attribute before), not a no-op on empty axes, keepdims 0 (torch's `sum()`, `mean()`)."""
    if node.op_type not in _SUMS or node.domain not in ("", "ai.onnx"):
        return False
    attributes = node_attributes(node)
    axes_as_input = opset >= (13 if node.op_type == "ReduceSum" else 18)
    no_axes = (len(node.input) < 2 or not node.input[1]) if axes_as_input else "axes" not in attributes
    return no_axes and not attributes.get("noop_with_empty_axes", 0) and attributes.get("keepdims", 1) == 0
