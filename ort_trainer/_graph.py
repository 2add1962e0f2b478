"""Turn the exported forward+loss model into ONNX Runtime's training and eval graphs."""
import copy
import re

import numpy as np
import onnx
from onnxruntime import SessionOptions
from onnxruntime.capi._pybind_state import GradientGraphBuilder, get_optimized_model

from ._symbolics import MARKER_DOMAIN

# Nodes whose optional outputs the gradient builder reads, and how many outputs it needs (Dropout's
# mask, SoftmaxCrossEntropyLoss's log_prob, LayerNormalization's mean and inverse standard deviation
# at opset 17); the TorchScript exporter emits them with one output.
_OUTPUTS_THE_GRADIENT_READS = {"Dropout": 2, "SoftmaxCrossEntropyLoss": 2, "LayerNormalization": 3}
_QUIET = 3  # ORT severity: errors only
LOSS_SCALE_INPUT = "__loss_scale"
# Ops that draw from ONNX Runtime's default generator (ORT's fused forms of Dropout included).
_RANDOM_OPS = {"Dropout", "BitmaskDropout", "BiasDropout", "BitmaskBiasDropout", "RandomNormal", "RandomNormalLike",
               "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli"}


def builder_session_options():
    options = SessionOptions()
    options.log_severity_level = _QUIET
    return options


def draws_random_numbers(model):
    """Whether a run of `model` (an ONNX model, or serialized) draws random numbers: a training-mode
    Dropout, a random op."""
    if isinstance(model, bytes):
        model = onnx.load_from_string(model)
    return any(node.op_type in _RANDOM_OPS for node in model.graph.node)


def used_parameters(model):
    """Names of the initializers and graph inputs of `model`: what it may read as a parameter."""
    return {i.name for i in model.graph.initializer} | {i.name for i in model.graph.input}


def add_second_outputs(model):
    """Give Dropout, SoftmaxCrossEntropyLoss and LayerNormalization the optional outputs their
    gradients read (in place)."""
    for node in model.graph.node:
        while 0 < len(node.output) < _OUTPUTS_THE_GRADIENT_READS.get(node.op_type, 0):
            suffix = "__second_output" if len(node.output) == 1 else f"__output{len(node.output)}"
            node.output.append(node.output[0] + suffix)


def parameters_as_inputs(model, parameter_names):
    """Parameters become graph inputs so both graphs read them from the flat buffer."""
    kept = []
    for initializer in model.graph.initializer:
        if initializer.name in parameter_names:
            model.graph.input.append(onnx.helper.make_tensor_value_info(
                initializer.name, initializer.data_type, initializer.dims))
        else:
            kept.append(initializer)
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)


def rename_initializers(model, renamed):
    """Renames initializers ({old: new}) and every read of them, subgraphs included (in place)."""
    for output in model.graph.output:
        if output.name in renamed:
            raise ValueError(f"ONNX model: initializer {output.name!r} is also a graph output; add an Identity node")
    for initializer in model.graph.initializer:
        initializer.name = renamed.get(initializer.name, initializer.name)
    _rename_reads(model.graph, renamed)


def _rename_reads(graph, renamed):
    for node in graph.node:
        node.input[:] = [renamed.get(name, name) for name in node.input]
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                _rename_reads(attribute.g, renamed)
            for subgraph in attribute.graphs:
                _rename_reads(subgraph, renamed)


def _disable_training_mode(model):
    """Dropout off, BatchNormalization in inference mode (on the running statistics, without the
    outputs of their update).

    Dropout becomes Identity, which ORT then removes (its training build keeps inference-mode
    Dropout nodes, each a copy), unless something reads its mask; then it loses its
    training_mode input."""
    read = {name for node in model.graph.node for name in node.input} | {o.name for o in model.graph.output}
    for node in model.graph.node:
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


def _scale_loss(model, loss_name):
    """Adds a scalar input LOSS_SCALE_INPUT and returns the name of loss * scale.

    Differentiating the scaled loss gives scaled gradients (mixed-precision loss scaling); the
    user still gets the unscaled loss.
    """
    model.graph.input.append(onnx.helper.make_tensor_value_info(LOSS_SCALE_INPUT, onnx.TensorProto.FLOAT, []))
    scaled = f"{loss_name}__scaled"
    model.graph.node.append(onnx.helper.make_node("Mul", [loss_name, LOSS_SCALE_INPUT], [scaled]))
    model.graph.output.append(onnx.helper.make_tensor_value_info(scaled, onnx.TensorProto.FLOAT, []))
    return scaled


def node_attributes(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def onnx_opset(model):
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def int64_constant(name, value):
    """A Constant node (named as its output): an int64 scalar, or a 1-D tensor for a list."""
    values = value if isinstance(value, list) else [value]
    dims = [len(values)] if isinstance(value, list) else []
    return onnx.helper.make_node("Constant", [], [name], name=name, value=onnx.helper.make_tensor(
        name, onnx.TensorProto.INT64, dims, values))


class MissingGradientError(NotImplementedError):
    """ONNX Runtime has no gradient for an op between the trainable parameters and the loss.

    Raised when the training graph is built (the first step at a new shape). A NotImplementedError:
    the model is valid, ONNX Runtime lacks that op's gradient. `op_type`, `nodes` (the ONNX node
    names) and `modules` (the torch module of each node, see torch_module) say where.
    """

    def __init__(self, op_type, nodes, reason=None):
        self.op_type, self.nodes = op_type, list(nodes)
        self.modules = [torch_module(node) for node in self.nodes]
        where = ", ".join(f"{_describe_module(module)} (ONNX node {node or '<unnamed>'})"
                          for node, module in zip(self.nodes, self.modules))
        where = where or "the model (ONNX Runtime did not say where)"
        said = f" ({reason.rstrip('.')})" if reason else ""
        super().__init__(
            f"ONNX Runtime has no gradient for {op_type}{said}, used by {where} between the trainable "
            "parameters and the loss. Compute that part outside the trained graph (e.g. in the data pipeline), "
            "freeze the parameters that feed it, or write it with ops that have gradients; if you need it as "
            "it is, report it to the ort-trainer maintainers with this message.")


def torch_module(node_name):
    """The torch module an exported node came from: its qualified name ('' for the model's own
    forward()), or None for nodes outside the model (loss_fn) or without a name.

    The exporter names nodes after the module scopes, each scope the module's name in its parent
    container: '/model/backbone/layers/layers.0/norm/InstanceNormalization' is module
    'backbone.layers.0.norm' ('model' is the attribute that holds the user's model in the
    exported wrapper). A ModuleDict's entries appear under their key alone, and a module's later
    calls as '<name>_1', '<name>_2', ... (indistinguishable from modules so named).
    """
    scopes = node_name.strip("/").split("/")[:-1]
    if not scopes or scopes[0] != "model":
        return None
    path = []
    for scope in scopes[1:]:
        if path and scope.startswith(path[-1] + "."):  # a Sequential's child: 'layers' then 'layers.0'
            path[-1] = scope
        else:
            path.append(scope)
    return ".".join(path)


def _describe_module(module):
    if module is None:
        return "loss_fn (outside the model)"
    if not module:
        return "the model's own forward()"
    first_call = re.sub(r"_\d+(?=\.|$)", "", module)
    if first_call != module:  # the exporter suffixes a module's later calls: 'pad', 'pad_1', ...
        return f"module {module!r} or a repeated call of module {first_call!r}"
    return f"module {module!r}"


_NOT_REGISTERED = re.compile(r"The gradient builder has not been registered: (\w+) for node (\S*)")
_UNSUPPORTED_CASE = re.compile(r"Get(\w+)Gradient::GetGradientDefsImpl\(\) const (.+)")


def missing_gradient(message, model, trainable, targets):
    """The MissingGradientError for a failure `message` of the gradient builder (gradients of the
    tensors `targets`), or None for other failures.

    ORT names the node when the op has no gradient at all; when only some of its cases lack one
    (Pad other than constant mode, Pow's exponent) it names the op alone, so every node of that
    type on a path from a trainable parameter to the loss is named.
    """
    found = _NOT_REGISTERED.search(message)
    if found:
        return MissingGradientError(found.group(1), [found.group(2)])
    found = _UNSUPPORTED_CASE.search(message)
    if not found:
        return None
    op_type = found.group(1)
    from_parameters = _computed_from(model, trainable)
    into_loss = _needed_for(model, targets)
    nodes = [node.name for node in model.graph.node if node.op_type == op_type
             and from_parameters.intersection(node.input) and into_loss.intersection(node.output)]
    return MissingGradientError(op_type, nodes, found.group(2).strip())


def _computed_from(model, sources):
    """Names of the tensors computed (transitively) from `sources`, those included."""
    reached = set(sources)
    for node in model.graph.node:  # topologically sorted
        if reached.intersection(node.input):
            reached.update(node.output)
    return reached


def _needed_for(model, targets):
    """Names of the tensors `targets` are computed from, themselves included."""
    needed = set(targets)
    for node in reversed(model.graph.node):
        if needed.intersection(node.output):
            needed.update(node.input)
    return needed


def _inferred_tensors(model):
    """{tensor name: (element type, dims)} by ONNX shape inference; a dim is its size, its symbolic
    name, or None when unknown."""
    graph = onnx.shape_inference.infer_shapes(model, data_prop=True).graph
    tensors = {}
    for value in (*graph.input, *graph.value_info, *graph.output):
        tensor_type = value.type.tensor_type
        dims = (tuple(d.dim_value if d.HasField("dim_value") else d.dim_param or None for d in tensor_type.shape.dim)
                if tensor_type.HasField("shape") else None)
        tensors[value.name] = (tensor_type.elem_type, dims)
    return tensors


def _same_known_shape(dims, other):
    return dims is not None and dims == other and None not in dims


def _reduce_mean(name, data, axes, opset):
    """Nodes of ReduceMean(keepdims=1) over `axes` into `name` (axes became an input in opset 18)."""
    make = onnx.helper.make_node
    if opset < 18:
        return [make("ReduceMean", [data], [name], name=name, axes=axes, keepdims=1)]
    return [int64_constant(name + "_axes", axes),
            make("ReduceMean", [data, name + "_axes"], [name], name=name, keepdims=1)]


def _grouped(p, x):
    """Nodes viewing x [N, C, ...] as p + 'grouped' [N, C, -1]: per-channel work for any rank."""
    return [int64_constant(p + "grouped_shape", [0, 0, -1]),
            onnx.helper.make_node("Reshape", [x, p + "grouped_shape"], [p + "grouped"], name=p + "grouped")]


def _channel_affine(p, grouped, scale, bias, x, output):
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
    """The ONNX element type of tensor `name` in `_inferred_tensors`' result (float when unknown)."""
    return tensors.get(name, (onnx.TensorProto.FLOAT,))[0] or onnx.TensorProto.FLOAT


def normalized_nodes(p, node, axes, x_type, opset):
    """Nodes of p + 'normalized' = (g - mean) / sqrt(biased variance + epsilon) for a normalization
    `node` (its input 0 is x, its 'epsilon' attribute read): g is x viewed as [N, C, -1]
    (p + 'grouped'), the mean (p + 'mean') and variance (p + 'variance') are taken over `axes` of
    g and kept as size-1 dims; `x_type` is x's ONNX element type (that of epsilon)."""
    make = onnx.helper.make_node
    epsilon = np.array(node_attributes(node).get("epsilon", 1e-5), onnx.helper.tensor_dtype_to_np_dtype(x_type))
    return [*_grouped(p, node.input[0]),
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
            tensors = _inferred_tensors(model)
        x, scale, bias = node.input
        p = f"{node.name or node.output[0]}/"
        nodes += [*normalized_nodes(p, node, [2], element_type(tensors, x), opset),
                  *_channel_affine(p, p + "normalized", scale, bias, x, node.output[0])]
        rewritten += 1
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return rewritten


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
    from_parameters = _computed_from(model, trainable)
    for node in model.graph.node:
        indices = _GRADIENT_NOT_SUMMED_OVER_BROADCAST.get(node.op_type, ()) if node.domain in ("", "ai.onnx") else ()
        for index in indices:
            data = node.input[index]
            if data not in from_parameters:
                continue
            if tensors is None:
                tensors = _inferred_tensors(model)
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
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return expanded


def _gradient_graph(model, trainable, loss_name, options, recompute=None):
    """ORT's training graph of `model` (gradients of `loss_name` for `trainable`), as an ONNX model.
    `recompute` (a `_recompute.Recompute`, or None) adds its copies to the optimized forward and
    schedules them in the training graph.

    Raises MissingGradientError when an op on the way lacks a gradient, chained to ORT's error.
    """
    optimized = get_optimized_model(model.SerializeToString(), set(trainable), options)
    if recompute is not None:
        optimized, plan = recompute.add_nodes(optimized)
    try:
        builder = GradientGraphBuilder(optimized, {loss_name}, set(trainable), loss_name, options)
        builder.build()
    except RuntimeError as error:
        missing = missing_gradient(str(error), model, trainable, [loss_name])
        if missing is None:
            raise
        raise missing from error
    training = onnx.load_from_string(builder.get_model())
    if recompute is not None:
        recompute.schedule(training, plan)
    return training


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
                  *_grouped(p, x),
                  *_channel_affine(p, p + "grouped", p + "a", p + "b", x, node.output[0])]
        replaced += 1
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return replaced


NO_GRADIENT_SUFFIX = "__no_gradient"


def padding_rows_without_gradient(model, trainable):
    """Rewrites the `ort_trainer::PaddingRows` markers (`_symbolics._embedding`), in place.

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
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    imports = [o for o in model.opset_import if o.domain != MARKER_DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(imports)
    return aliases


def prepare_for_gradient(model, trainable):
    """The rewrites the gradient builder needs on a forward whose parameters are graph inputs and
    whose nodes have their optional outputs (add_second_outputs), in place: embedding padding rows
    without gradient, inference-mode BatchNormalization, InstanceNormalization and broadcast
    Where/Pow inputs as ops whose ORT gradients exist and are right. Returns the padding-row
    aliases added (graph inputs to bind to their weights' memory)."""
    aliases = padding_rows_without_gradient(model, set(trainable))
    inference_batch_norm_as_primitives(model)
    decompose_instance_normalization(model)
    expand_broadcast_inputs(model, trainable)
    return aliases


def symbolic_shapes(model):
    """`model` annotated by ONNX Runtime's symbolic shape inference (utils.run_symbolic_shape_infer),
    as the original ran it on the exported model: value_info for the tensors ONNX's own inference
    leaves without a shape, which ORT's optimizations and gradient builder then know.

    Raises:
        RuntimeError: the tool failed on this model (it cannot follow every shape computation, e.g.
            nn.MultiheadAttention's in-projection), chained to its error.
    """
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference  # imports sympy: when asked

    try:
        return SymbolicShapeInference.infer_shapes(model, auto_merge=True, guess_output_rank=True)
    except Exception as error:  # the tool raises AssertionError, KeyError, Exception, ...
        detail = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        raise RuntimeError(
            "utils.run_symbolic_shape_infer: ONNX Runtime's symbolic shape inference "
            f"(onnxruntime.tools.symbolic_shape_infer) failed on the exported model ({detail}); "
            "set utils.run_symbolic_shape_infer=False") from error


def build_graphs(model, trainable, frozen, output_names, loss_name, loss_scaling=False, substitute_kernels=None,
                 recompute=None, shape_inference=False, buffers=(), batch_statistics=None):
    """Returns (training graph, eval graph) as serialized ONNX models.

    The training graph computes `output_names` (the outputs the caller fetches; the loss is
    differentiated either way) and one `<param>_grad` output per trainable parameter (of the
    loss times the LOSS_SCALE_INPUT feed when loss_scaling); the eval graph computes
    `output_names` with dropout off. Outputs not fetched are not graph outputs, so ONNX Runtime
    neither materializes nor keeps them. `model` (the exported forward) is consumed: modified in
    place. `substitute_kernels(training, evaluation)`: the device's kernel substitutions on the
    built graphs (`Placement.substitute_kernels`; None: ORT's own kernels). Before the gradient is
    built, the
    training graph's inference-mode BatchNormalization, InstanceNormalization and broadcast
    Where/Pow inputs are rewritten into ops whose ORT gradients exist and are right; an op
    without a gradient raises MissingGradientError. `recompute`: a `_recompute.Recompute` (the
    recompute options), or None. `shape_inference`: run `symbolic_shapes` on the forward first.
    `buffers`: initializers that become graph inputs too (BatchNorm running statistics, which
    change). `batch_statistics`: a `_batch_norm.BatchStatistics`, or None: its rewrite of the
    training-mode BatchNorms of the training graph, whose statistics outputs follow `output_names`.
    """
    parameters_as_inputs(model, set(trainable) | set(frozen) | set(buffers))  # first: no copy below holds weights
    add_second_outputs(model)
    if shape_inference:
        model = symbolic_shapes(model)
    eval_model = copy.deepcopy(model)
    _disable_training_mode(eval_model)
    padding_rows_without_gradient(eval_model, trainable=())
    if batch_statistics is not None:
        batch_statistics.rewrite(model)
    prepare_for_gradient(model, trainable)
    if loss_scaling:
        loss_name = _scale_loss(model, loss_name)
    training = _gradient_graph(model, trainable, loss_name, builder_session_options(), recompute)
    if substitute_kernels is not None:
        substitute_kernels(training, eval_model)
    statistics = list(batch_statistics.outputs) if batch_statistics is not None else []
    _set_outputs(training, list(output_names) + statistics + [f"{name}_grad" for name in trainable])
    _set_outputs(eval_model, output_names)
    return training.SerializeToString(), eval_model.SerializeToString()


def _set_outputs(model, names):
    outputs = {o.name: o for o in model.graph.output}
    ordered = [outputs[name] for name in names]
    del model.graph.output[:]
    model.graph.output.extend(ordered)
