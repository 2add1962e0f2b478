"""The fixes ONNX Runtime's gradient builders need on an exported forward, for both front ends:
the optional outputs gradients read, embedding padding rows without gradient, normalizations and
broadcast inputs rewritten into ops whose gradients exist and are right; and the eval graph's
training mode turned off."""
from __future__ import annotations

from collections.abc import Collection

import onnx

from .._export.torch_node_symbolics import RECURRENT
from .._onnx import (MARKER_DOMAIN, computed_from, float_constant, inferred_tensors, int64_constant, node_attributes,
                     parameters_as_inputs, set_nodes, set_torch_node_params, torch_node_params_of)
from .._torch_node_catalogue import RRELU_SLOPES
from .gradients import cumsum_as_inclusive, extrema_differentiable, flips_as_gathers, register_gradients
from .missing_gradient import MissingGradientError
from .normalization import decompose_instance_normalization, inference_batch_norm_as_primitives
from .torch_nodes import gradients_through_torch, register_torch_node_gradients

# Nodes whose optional outputs the gradient builder reads, and how many outputs it needs (Dropout's
# mask, SoftmaxCrossEntropyLoss's log_prob, LayerNormalization's mean and inverse standard deviation
# at opset 17); the TorchScript exporter emits them with one output.
_OUTPUTS_THE_GRADIENT_READS = {"Dropout": 2, "SoftmaxCrossEntropyLoss": 2, "LayerNormalization": 3}


def weights_as_inputs(model: onnx.ModelProto, weights: Collection[str]) -> None:
    """The first fixes of an exported forward, for both front ends, in place: the initializers
    named in `weights` (parameters, buffers) become graph inputs, read from the model's own
    tensors (no graph holds weights: copies of it stay small), and nodes get the optional outputs
    their gradients read (`add_second_outputs`). Then `prepare_for_gradient` for a graph with a
    gradient."""
    parameters_as_inputs(model, set(weights))
    add_second_outputs(model)


def add_second_outputs(model):
    """Give Dropout, SoftmaxCrossEntropyLoss and LayerNormalization the optional outputs their
    gradients read (in place)."""
    for node in model.graph.node:
        while 0 < len(node.output) < _OUTPUTS_THE_GRADIENT_READS.get(node.op_type, 0):
            suffix = "__second_output" if len(node.output) == 1 else f"__output{len(node.output)}"
            node.output.append(node.output[0] + suffix)


def disable_training_mode(model):
    """Dropout off (recurrent layers' between layers too), BatchNormalization in inference mode (on
    the running statistics, without the outputs of their update), RReLU's fixed slope.

    Dropout becomes Identity, which ORT then removes (its training build keeps inference-mode
    Dropout nodes, each a copy), unless something reads its mask; then it loses its
    training_mode input."""
    read = {name for node in model.graph.node for name in node.input} | {o.name for o in model.graph.output}
    rrelu_slopes_fixed(model)
    for node in model.graph.node:
        params = torch_node_params_of(node)
        if params.get("function") in RECURRENT and params["args"][3]:  # (has_biases, num_layers, dropout, train, ..)
            params["args"][3] = False
            set_torch_node_params(node, params)
        if node.op_type == "Dropout" and not read.intersection(node.output[1:]):
            node.op_type = "Identity"
            del node.input[1:], node.output[1:], node.attribute[:]
        elif node.op_type == "Dropout" and len(node.input) > 2:
            node.input[2] = ""
        if node.op_type == "BatchNormalization":
            for attribute in node.attribute:
                if attribute.name == "training_mode":
                    attribute.i = 0
            if not read.intersection(node.output[1:]):  # the running statistics it would update
                del node.output[1:]


def rrelu_slopes_fixed(model):
    """The torch node drawing nn.RReLU's slopes (`_export.torch_node_symbolics._rrelu`) becomes the
    slopes of eval mode, in place: 1 where x > 0, else (lower + upper) / 2, as torch's eval computes."""
    nodes, fixed = [], False
    for node in model.graph.node:
        params = torch_node_params_of(node)
        if params.get("function") != RRELU_SLOPES:
            nodes.append(node)
            continue
        fixed = True
        lower, upper, _ = params["args"]
        p, slopes = node.output[1] + "__eval_", node.output[1]
        nodes += [float_constant(p + "zero", 0.0), float_constant(p + "one", 1.0),
                  float_constant(p + "slope", (lower + upper) / 2),
                  onnx.helper.make_node("Greater", [node.input[0], p + "zero"], [p + "positive"]),
                  onnx.helper.make_node("Where", [p + "positive", p + "one", p + "slope"], [slopes])]
    if fixed:
        set_nodes(model.graph, nodes)


def _same_known_shape(dims, other):
    return dims is not None and dims == other and None not in dims


# Inputs whose ONNX Runtime 1.19 gradient is the output-shaped one, not summed over the axes the
# input was broadcast along: a broadcast input gets a gradient of the wrong shape.
_GRADIENT_NOT_SUMMED_OVER_BROADCAST = {"Where": (1, 2), "Pow": (0,)}


def expand_broadcast_inputs(model, trainable):
    """Expands the inputs of _GRADIENT_NOT_SUMMED_OVER_BROADCAST that are computed from trainable
    parameters and broadcast by their node, to the node's output shape, in place.

    Why: a broadcast input there (a [1, H, 1, K] position bias chosen by a Where into [B, H, Q, K]
    scores; a [1, C] base raised to [N, C] exponents) would get a gradient of the wrong shape;
    Expand's gradient sums the broadcast axes. Inputs whose shape is known to equal the output's
    are left alone (no copy), as are inputs without a gradient. Returns the number expanded.
    """
    make, nodes, expanded, tensors = onnx.helper.make_node, [], 0, None
    from_parameters = computed_from(model, trainable)
    for node in model.graph.node:
        indices = _GRADIENT_NOT_SUMMED_OVER_BROADCAST.get(node.op_type, ()) if node.domain in ("", "ai.onnx") else ()
        for index in indices:
            data = node.input[index]
            if data not in from_parameters:
                continue
            if tensors is None:
                tensors = inferred_tensors(model)
            output_dims = tensors.get(node.output[0], (None, None))[1]
            if _same_known_shape(tensors.get(data, (None, None))[1], output_dims):
                continue
            p = f"{node.name or node.output[0]}/expanded_input{index}/"
            if output_dims is not None and all(isinstance(dim, int) for dim in output_dims):
                nodes += [int64_constant(p + "shape", list(output_dims)),
                          make("Expand", [data, p + "shape"], [p + "expanded"], name=p + "expanded")]
                data = p + "expanded"
            else:  # Expand broadcasts both ways: by each other input's shape in turn
                for other in (i for i in range(len(node.input)) if i != index):
                    nodes += [make("Shape", [node.input[other]], [p + f"shape{other}"], name=p + f"shape{other}"),
                              make("Expand", [data, p + f"shape{other}"], [p + f"by{other}"], name=p + f"by{other}")]
                    data = p + f"by{other}"
            node.input[index] = data
            expanded += 1
        nodes.append(node)
    set_nodes(model.graph, nodes)
    return expanded


NO_GRADIENT_SUFFIX = "__no_gradient"


def padding_rows_without_gradient(model: onnx.ModelProto, trainable: Collection[str]) -> list[str]:
    """Rewrites the `ort_trainer::PaddingRows` markers (`_export.symbolics._embedding`), in place.

    torch gives an embedding's row padding_idx no gradient from the lookup. For a trainable
    weight W, the rows at padding positions are read from `W + NO_GRADIENT_SUFFIX`, a graph input
    bound to W's memory that the gradient builder does not differentiate:
    Where(indices == padding_idx, Gather(W__no_gradient, indices), Gather(W, indices)). Other uses
    of W (a tied output layer) keep their gradient for that row, as in torch. Markers on weights
    that are not trained (and all markers, with trainable=()) just go away. Returns the aliases
    added.
    """
    make = onnx.helper.make_node
    producers = {output: node for node in model.graph.node for output in node.output}
    inputs = {graph_input.name: graph_input for graph_input in model.graph.input}
    nodes, aliases = [], []
    for node in model.graph.node:
        if node.domain != MARKER_DOMAIN:
            nodes.append(node)
            continue
        rows, indices = node.input
        weight = producers[rows].input[0]
        if weight not in trainable:
            nodes.append(make("Identity", [rows], list(node.output), name=node.name))
            continue
        alias = weight + NO_GRADIENT_SUFFIX
        if alias not in aliases:
            aliases.append(alias)
            model.graph.input.append(onnx.helper.make_tensor_value_info(
                alias, inputs[weight].type.tensor_type.elem_type,
                [dim.dim_value for dim in inputs[weight].type.tensor_type.shape.dim]))
        p = f"{node.output[0]}/padding_rows/"
        nodes += [make("Gather", [alias, indices], [p + "rows_without_gradient"]),
                  make("Cast", [indices], [p + "indices64"], to=onnx.TensorProto.INT64),
                  int64_constant(p + "padding_idx", node_attributes(node)["padding_idx"]),
                  int64_constant(p + "last_axis", [-1]),
                  make("Equal", [p + "indices64", p + "padding_idx"], [p + "is_padding"]),
                  make("Unsqueeze", [p + "is_padding", p + "last_axis"], [p + "is_padding_row"]),
                  make("Where", [p + "is_padding_row", p + "rows_without_gradient", rows], list(node.output))]
    set_nodes(model.graph, nodes)
    imports = [o for o in model.opset_import if o.domain != MARKER_DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(imports)
    return aliases


def prepare_for_gradient(model: onnx.ModelProto, trainable: Collection[str],
                         requiring_grad: Collection[str] = ()) -> list[str]:
    """The rewrites the gradient builder needs on a forward whose parameters are graph inputs and
    whose nodes have their optional outputs (add_second_outputs), in place: embedding padding rows
    without gradient, inference-mode BatchNormalization, InstanceNormalization and broadcast
    Where/Pow inputs as ops whose ORT gradients exist and are right; CumSum in the form whose
    gradient `_graph.gradients` registers; ops ORT cannot differentiate as torch nodes, and the
    torch nodes' gradients; ReduceMax/ReduceMin and
    reversing Slices (torch.flip) as ops with gradients; 'same' padding as explicit pads; then
    `builder_fixes_after_optimization`. `requiring_grad`: the call inputs that want a gradient
    (ORTModule's): the torch nodes computed from them get gradients too. Returns the padding-row
    aliases added (graph inputs to bind to their weights' memory)."""
    register_gradients()
    refuse_reversed_recurrences(model, trainable)
    gradients_through_torch(model, [*trainable, *requiring_grad])
    register_torch_node_gradients(model)
    cumsum_as_inclusive(model)
    extrema_differentiable(model)
    flips_as_gathers(model)
    aliases = padding_rows_without_gradient(model, set(trainable))
    inference_batch_norm_as_primitives(model)
    decompose_instance_normalization(model)
    expand_broadcast_inputs(model, trainable)
    same_padding_explicit(model)
    builder_fixes_after_optimization(model)
    return aliases


def refuse_reversed_recurrences(model, trainable):
    """Raises MissingGradientError for an LSTM, GRU or RNN that runs backwards (bidirectional) between
    the `trainable` parameters and the loss: ONNX Runtime's training kernels run the forward direction
    only (its session failed to load, with an internal error). Only an ONNX model's: a torch model's
    bidirectional layers are exported as torch nodes (`_export.torch_node_symbolics`)."""
    reached = computed_from(model, trainable)
    for node in model.graph.node:
        direction = node_attributes(node).get("direction", b"forward").decode()
        if node.op_type in ("LSTM", "GRU", "RNN") and direction != "forward" and reached.intersection(node.input):
            raise MissingGradientError(node.op_type, [node.name], f"direction {direction!r}: its training kernels "
                                       "run the forward direction only")


def same_padding_explicit(model):
    """A Conv with auto_pad SAME_UPPER/SAME_LOWER and stride 1 (torch's padding='same') gets the
    explicit pads it stands for (in place): ONNX Runtime's ConvGrad
    computed wrong gradients from auto_pad (silently: losses 8e-2 off torch's after 3 steps of
    Conv1d(8, 8, 4, padding='same'))."""
    for node in model.graph.node:
        attributes = node_attributes(node)
        mode = attributes.get("auto_pad", b"NOTSET")
        if node.op_type != "Conv" or mode not in (b"SAME_UPPER", b"SAME_LOWER") \
                or any(stride != 1 for stride in attributes.get("strides", [])) or "kernel_shape" not in attributes:
            continue
        kernel = list(attributes["kernel_shape"])
        dilations = list(attributes.get("dilations", [1] * len(kernel)))
        totals = [d * (k - 1) for k, d in zip(kernel, dilations)]
        small = [total // 2 for total in totals]
        begins = small if mode == b"SAME_UPPER" else [t - b for t, b in zip(totals, small)]
        ends = [t - b for t, b in zip(totals, begins)]
        for attribute in [a for a in node.attribute if a.name in ("auto_pad", "pads")]:
            node.attribute.remove(attribute)
        node.attribute.append(onnx.helper.make_attribute("pads", begins + ends))


def builder_fixes_after_optimization(model):
    """The fixes of an optimized forward (in place), right before the gradient builder: ONNX
    Runtime's optimizer makes patterns they fix (it merges equal nodes, so that one tensor is
    concatenated twice) and removes the Identity nodes one of them adds. Also run on the exported
    forward: ORTModule's builder optimizes inside."""
    concat_inputs_read_once(model)
    reductions_keeping_dims(model)
    scalar_square_roots_as_vectors(model)


def scalar_square_roots_as_vectors(model):
    """Sqrt of a 0-d tensor as Sqrt of it reshaped to [1], reshaped back (in place): ONNX Runtime's
    Sqrt gradient multiplies by a [1]-shaped constant, so a 0-d gradient came out 1-d, and the
    Unsqueeze of a ReduceSum over explicit dims before it then made an input gradient of rank 3
    (torch.linalg.matrix_norm, sqrt((h * h).sum((0, 1))): the session refused the graph)."""
    if not any(node.op_type == "Sqrt" for node in model.graph.node):
        return
    tensors, nodes = inferred_tensors(model), []
    for node in model.graph.node:
        if node.op_type != "Sqrt" or node.domain not in ("", "ai.onnx") \
                or tensors.get(node.input[0], (0, None))[1] != ():
            nodes.append(node)
            continue
        vector, root = f"{node.output[0]}__vector", f"{node.output[0]}__vector_root"
        nodes += [int64_constant(f"{vector}_shape", [1]), int64_constant(f"{vector}_scalar", []),
                  onnx.helper.make_node("Reshape", [node.input[0], f"{vector}_shape"], [vector], name=vector),
                  onnx.helper.make_node("Sqrt", [vector], [root], name=node.name),
                  onnx.helper.make_node("Reshape", [root, f"{vector}_scalar"], [node.output[0]], name=root)]
    set_nodes(model.graph, nodes)


def reductions_keeping_dims(model):
    """ReduceL2 and ReduceLogSumExp with keepdims=0 as the same reduction keeping its dims and a
    Squeeze of them (in place): ONNX Runtime's gradients of the former build invalid graphs
    (torch.linalg.vector_norm(x), torch.logsumexp(x, 1) failed to build)."""
    nodes = []
    for node in model.graph.node:
        attributes = node_attributes(node)
        if node.op_type not in ("ReduceL2", "ReduceLogSumExp") or node.domain not in ("", "ai.onnx") \
                or attributes.get("keepdims", 1) \
                or len(node.input) > 1:  # opset 18's axes input: not exported at our opsets
            nodes.append(node)
            continue
        kept = f"{node.output[0]}__kept_dims"
        squeeze_inputs = [kept]
        if "axes" in attributes:
            nodes.append(int64_constant(f"{kept}_axes", list(attributes["axes"])))
            squeeze_inputs.append(f"{kept}_axes")
        node.attribute.remove(next(a for a in node.attribute if a.name == "keepdims"))
        node.attribute.append(onnx.helper.make_attribute("keepdims", 1))
        squeezed = node.output[0]
        node.output[0] = kept
        nodes += [node, onnx.helper.make_node("Squeeze", squeeze_inputs, [squeezed], name=f"{kept}_squeeze")]
    set_nodes(model.graph, nodes)


def concat_inputs_read_once(model):
    """Each further read of a tensor by a Concat (another Concat, or the same one again) goes through
    an Identity of its own (in place). ORT's Concat gradient names a gradient `<input>_grad` for every
    input, needed or not, so a tensor that needs none (a data input, ones of one shape that
    ONNX Runtime's optimizer merged) read twice got that name defined twice and the builder
    failed."""
    seen, nodes = set(), []
    for node in model.graph.node:
        if node.op_type in ("Concat", "ConcatTraining"):  # the optimizer's training form
            for k, name in enumerate(node.input):
                if name in seen:
                    copy = f"{name}__concat_read_{len(nodes)}"
                    nodes.append(onnx.helper.make_node("Identity", [name], [copy], name=copy))
                    node.input[k] = copy
                seen.add(name)
        nodes.append(node)
    set_nodes(model.graph, nodes)
