"""ORTModule's graphs: ONNX Runtime's ORTModule graph builder (`OrtModuleGraphBuilder`) on the
fixed export (forward and gradient in one graph, split by a YieldOp; or the forward alone for calls
without gradients), and what the autograd Function must know of the result: which outputs the
backward reads, which gradients each output reaches."""
import contextlib
import os
import re
import sys
import tempfile
from dataclasses import dataclass

import onnx
import torch
from onnxruntime.capi import _pybind_state as C

from .._configuration.refusals import OnnxModelRefused
from .missing_gradient import missing_gradient
from .torch_nodes import finish_torch_node_gradients

_ONNX_TYPES = {torch.float32: onnx.TensorProto.FLOAT, torch.float16: onnx.TensorProto.FLOAT16,
               torch.bfloat16: onnx.TensorProto.BFLOAT16, torch.float64: onnx.TensorProto.DOUBLE,
               torch.int64: onnx.TensorProto.INT64, torch.int32: onnx.TensorProto.INT32,
               torch.int16: onnx.TensorProto.INT16, torch.int8: onnx.TensorProto.INT8,
               torch.uint8: onnx.TensorProto.UINT8, torch.bool: onnx.TensorProto.BOOL}
_UNREACHABLE = re.compile(r"Cannot compute the partial derivative for '([^']+)' as it's unreachable")


@dataclass(frozen=True)
class BuiltModuleGraph:
    """The builder's result. `model`: the graph (ModelProto). `differentiated`: the inputs whose
    gradients the backward returns, in order. `non_differentiable`: indices of outputs ONNX
    Runtime marks non-differentiable. `forward`: the names of the forward's
    nodes (those of the training graph before its YieldOp that the builder did not add)."""

    model: onnx.ModelProto
    differentiated: list
    non_differentiable: list
    forward: frozenset


def build_module_graph(exported, initializers, trainable, requiring_grad, outputs, shapes, *, trains, severity,
                       compute_optimizer, propagate_casts=True, pre_grad_path=None, log=None):
    """ORT's ORTModule graph builder on the fixed export. `initializers`: the graph inputs that are
    parameters or buffers; `trainable`, `requiring_grad`: the parameters and call inputs that want a
    gradient; `outputs`: forward()'s output names, `shapes` their torch shapes. `log(message)`
    hears of a rebuild. `propagate_casts` False: ORT's cast propagation is off (it would move the
    mixed-precision casts, and on the CPU fold their rounding away: `_graph.autocast`).

    An input or parameter the outputs do not depend on differentiably (a parameter only
    compared, `w > 0`) gets no gradient, as in torch (ORT refuses to build with it). ORT's
    compute optimizer can move a Reshape above a MatMul whose result is also an output,
    changing that output's shape (GPT-2's logits, [batch, seq, vocab], came out as
    [batch * seq, vocab]): a graph whose outputs do not have torch's shapes is built again
    without it."""
    while True:
        try:
            builder = _builder(exported, initializers, trainable, requiring_grad, outputs, trains=trains,
                               severity=severity, compute_optimizer=compute_optimizer,
                               propagate_casts=propagate_casts, pre_grad_path=pre_grad_path)
        except RuntimeError as error:
            unreachable = _UNREACHABLE.search(str(error))
            if unreachable is None or unreachable.group(1) not in trainable + requiring_grad:
                raise
            trainable = [name for name in trainable if name != unreachable.group(1)]
            requiring_grad = [name for name in requiring_grad if name != unreachable.group(1)]
            continue
        if not (compute_optimizer and _shapes_differ(builder.get_forward_model(), shapes)):
            break
        if log is not None:
            log("ONNX Runtime's compute optimizer changed the shapes of the outputs; built without it")
        compute_optimizer = False
    info = builder.get_graph_info()
    forward_model = onnx.load_from_string(builder.get_forward_model())
    model = onnx.load_from_string(builder.get_gradient_model()) if trains else forward_model
    finish_torch_node_gradients(model)
    return BuiltModuleGraph(
        model=model, differentiated=requiring_grad + trainable,
        non_differentiable=list(info.output_grad_indices_non_differentiable) if trains else [],
        forward=frozenset(node.name for node in forward_model.graph.node))


def _builder(exported, initializers, trainable, requiring_grad, outputs, *, trains, severity, compute_optimizer,
             propagate_casts, pre_grad_path):
    config = C.OrtModuleGraphBuilderConfiguration()
    config.initializer_names = initializers
    config.initializer_names_to_train = trainable
    config.input_names_require_grad = requiring_grad
    config.build_gradient_graph = trains
    config.enable_caching = False
    config.loglevel = C.Severity(int(severity))
    transformers = C.TrainingGraphTransformerConfiguration()
    transformers.enable_compute_optimizer = compute_optimizer
    if not propagate_casts:
        casts = transformers.propagate_cast_ops_config
        casts.level = -1
        transformers.propagate_cast_ops_config = casts
    if pre_grad_path is not None and trains:
        transformers.optimized_pre_grad_filepath = pre_grad_path
    builder = C.OrtModuleGraphBuilder()
    try:
        with _native_output_held(hold=int(severity) >= int(C.Severity.ERROR)):
            builder.initialize(exported.SerializeToString(), config)
            builder.build(transformers)
    except RuntimeError as error:
        duplicate = _DUPLICATE_GRADIENT.search(str(error))
        if duplicate is not None:
            raise OnnxModelRefused(
                f"ONNX Runtime's gradient builder defined the gradient of {duplicate.group(1)!r} twice: a tensor that "
                "needs no gradient is concatenated (torch.cat) twice, which its optimizer made of equal values (ones "
                "of one shape, say). ORTTrainer builds such graphs; with ORTModule concatenate it once, or let this "
                "call run in PyTorch (the default fallback policy)") from error
        missing = missing_gradient(str(error), exported, trainable, outputs)
        if missing is None:
            raise
        raise missing from error
    return builder


@contextlib.contextmanager
def _native_output_held(*, hold):
    """ONNX Runtime's own stderr (its default logger's warnings, e.g. "Removing initializer ...
    It is not used by any node", about the builder's passes over a graph the user did not write)
    held back while `hold`, and written out if the block raises: at the default log level, as the
    original ORTModule, the user sees ORT's output only with an error."""
    if not hold:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            held.seek(0)
            sys.stderr.write(held.read().decode(errors="replace"))
            sys.stderr.flush()
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


_DUPLICATE_GRADIENT = re.compile(r"Duplicate definition of name \((.+?)_grad\)")


def describe_outputs(model_proto, names, dtypes, shapes):
    """Records the type and shape of the model's outputs (YieldOp inputs in a training graph,
    which ORT's builder leaves undescribed), in place: they become graph outputs, and the CPU
    rewrites apply only where they know the type (a loss computed inside the model gets the
    threaded softmax cross-entropy)."""
    described = {value.name for value in (*model_proto.graph.value_info, *model_proto.graph.output)}
    for name, dtype, shape in zip(names, dtypes, shapes):
        if name not in described and dtype in _ONNX_TYPES:
            model_proto.graph.value_info.append(onnx.helper.make_tensor_value_info(name, _ONNX_TYPES[dtype], shape))


def forward_outputs_as_graph_outputs(model_proto, names):
    """Makes the forward's outputs (the YieldOp's inputs) outputs of the training graph too, in
    place. ONNX Runtime otherwise plans them as intermediates: the backward reuses their memory
    (GPT-2's loss read 0.0 after backward()) and the memory pattern frees it with the forward's
    state. A graph output gets a buffer of its own that the fetched tensor owns. The backward
    fetches only the gradients (the graph's outputs before this)."""
    described = {value.name: value for value in model_proto.graph.value_info}
    model_proto.graph.output.extend(described[name] for name in names)


def gradients_in_full_shape(model_proto):
    """Indices of the outputs whose gradient must have the output's shape (the YieldOp's
    `full_shape_outputs`; the others' may be a scalar zero: `_onnx.full_shape_outputs_without`, which
    the bf16 and fp32 loss gradients and label sparsity call); none in a graph without a backward."""
    yield_op = next((node for node in model_proto.graph.node if node.op_type == "YieldOp"), None)
    if yield_op is None:
        return set()
    return set(next((a.ints for a in yield_op.attribute if a.name == "full_shape_outputs"), ()))


def outputs_reaching(model_proto, gradients, outputs):
    """For each of the training graph's `gradients` (names), the indices of the model's `outputs`
    whose gradient (`<output>_grad`, a YieldOp output; none for a non-differentiable output) it
    is computed from: the outputs whose autograd graph holds that input or parameter."""
    consumers = {}
    for node in model_proto.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    reaching = [set() for _ in gradients]
    for index, output in enumerate(outputs):
        seen, stack = set(), [f"{output}_grad"]
        while stack:
            name = stack.pop()
            if name not in seen:
                seen.add(name)
                stack.extend(result for node in consumers.get(name, ()) for result in node.output)
        for reach, gradient in zip(reaching, gradients):
            if gradient in seen:
                reach.add(index)
    return reaching


# Ops whose output ONNX Runtime may place in its input's memory (a view, not a copy).
ALIASING_OPS = {"Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten"}


def outputs_read_by_backward(model_proto, outputs):
    """Indices of the forward's `outputs` whose memory the backward reads (Softmax's gradient
    reads its output), directly or through a view of it: changing one in place before
    backward() would change the gradient, so autograd must see it saved."""
    consumers, producers = {}, {}
    for node in model_proto.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
        for name in node.output:
            producers[name] = node
    backward, stack = set(), [f"{output}_grad" for output in outputs]  # the YieldOp's outputs
    while stack:
        for node in consumers.get(stack.pop(), ()):
            if id(node) not in backward:
                backward.add(id(node))
                stack.extend(node.output)
    read = {name for node in model_proto.graph.node if id(node) in backward for name in node.input}
    return [index for index, output in enumerate(outputs) if _views(output, producers, consumers) & read]


def _views(name, producers, consumers):
    """`name` and the tensors that may share its memory through ALIASING_OPS, either way."""
    group, stack = set(), [name]
    while stack:
        name = stack.pop()
        if name in group:
            continue
        group.add(name)
        producer = producers.get(name)
        if producer is not None and producer.op_type in ALIASING_OPS:
            stack.append(producer.input[0])
        stack.extend(node.output[0] for node in consumers.get(name, ()) if node.op_type in ALIASING_OPS)
    return group


def _shapes_differ(serialized, shapes):
    """Whether the outputs of a serialized model have other ranks or (known) sizes than `shapes`."""
    outputs = onnx.load_from_string(serialized).graph.output
    return any(len(output.type.tensor_type.shape.dim) != len(shape)
               or any(dim.HasField("dim_value") and dim.dim_value != size
                      for dim, size in zip(output.type.tensor_type.shape.dim, shape))
               for output, shape in zip(outputs, shapes))
