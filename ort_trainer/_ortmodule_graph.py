"""One input signature of an ORTModule, compiled: the model exported (TorchScript, every module in
its own train/eval state), the graph fixes of `_graph`, ONNX Runtime's ORTModule graph builder
(`OrtModuleGraphBuilder`: forward and gradient in one graph, split by a YieldOp) and a
`TrainingAgent` that runs the forward of a call and, when autograd asks, its backward from the
state the forward kept (no recomputation). Calls that need no gradient get the forward alone in an
inference session.

Parameters and buffers are graph inputs read from the model's own tensors on every call (DLPack,
no copy); gradients come back as new tensors, for autograd to accumulate into `.grad`.
"""
import logging
import os
import re
import time

import onnx
import onnxruntime
import torch
from onnxruntime.capi import _pybind_state as C
from torch.utils.dlpack import from_dlpack, to_dlpack

from ._batch_norm import BatchStatistics
from ._binding import BindingError
from ._export import export_training_model
from ._flat import graph_name
from ._graph import (NO_GRADIENT_SUFFIX, add_second_outputs, draws_random_numbers, missing_gradient,
                     padding_rows_without_gradient, parameters_as_inputs, prepare_for_gradient)
from ._ortmodule_options import LogLevel
from ._session import seed_random_ops

LOGGER = logging.getLogger("ort_trainer.ortmodule")
_CONSTANT_LEAVES = (type(None), bool, int, float, str)
_ONNX_TYPES = {torch.float32: onnx.TensorProto.FLOAT, torch.float16: onnx.TensorProto.FLOAT16,
               torch.bfloat16: onnx.TensorProto.BFLOAT16, torch.float64: onnx.TensorProto.DOUBLE,
               torch.int64: onnx.TensorProto.INT64, torch.int32: onnx.TensorProto.INT32,
               torch.int16: onnx.TensorProto.INT16, torch.int8: onnx.TensorProto.INT8,
               torch.uint8: onnx.TensorProto.UINT8, torch.bool: onnx.TensorProto.BOOL}
_UNREACHABLE = re.compile(r"Cannot compute the partial derivative for '([^']+)' as it's unreachable")


class OutputSchema:
    """The structure of what forward() returned, without its tensors: rebuilt around the graph's
    outputs on every call (tuples, lists, named tuples, dicts and Hugging Face ModelOutputs, nested;
    None, numbers and strings kept as returned). Tensors are taken in the order `_binding` reads
    them (select_outputs): depth first, mappings by their values. `shapes`, `dtypes`: the tensors'."""

    def __init__(self, output, tensors):
        """`tensors`: a list that receives the tensors of `output`, in order."""
        self._tree = self._describe(output, tensors)
        self.shapes = [list(tensor.shape) for tensor in tensors]
        self.dtypes = [tensor.dtype for tensor in tensors]
        if not tensors:
            raise BindingError(f"forward() returned no tensor ({type(output).__name__})")

    def _describe(self, value, tensors):
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return ("tensor",)
        if isinstance(value, dict):
            return ("mapping", type(value), [(key, self._describe(item, tensors)) for key, item in value.items()])
        if isinstance(value, (tuple, list)):
            return ("sequence", type(value), [self._describe(item, tensors) for item in value])
        if isinstance(value, _CONSTANT_LEAVES):
            return ("constant", value)
        raise BindingError(f"forward() returned a {type(value).__name__} among its outputs; an ONNX Runtime graph "
                           "returns tensors (and keeps None, numbers and strings as they were)")

    def rebuild(self, tensors):
        return self._rebuild(self._tree, iter(tensors))

    def _rebuild(self, tree, tensors):
        kind = tree[0]
        if kind == "tensor":
            return next(tensors)
        if kind == "constant":
            return tree[1]
        if kind == "mapping":
            return tree[1]((key, self._rebuild(item, tensors)) for key, item in tree[2])
        items = [self._rebuild(item, tensors) for item in tree[2]]
        return tree[1](*items) if hasattr(tree[1], "_fields") else tree[1](items)


def output_names(schema):
    return [f"output_{index}" for index in range(len(schema.shapes))]


class ModuleGraph:
    """The compiled graph of one input signature and how to run it (see the module docstring)."""

    def __init__(self, model, binding, values, schema, placement, settings, needs_grad):
        self.schema, self.trains, self._placement, self._first_run = schema, needs_grad, placement, True
        started = time.perf_counter()
        outputs = output_names(schema)
        exported = export_training_model(model, None, binding, outputs, values, settings.opset)
        _save(settings, exported, "torch_exported", needs_grad)
        self.batch_statistics = BatchStatistics(model)  # training-mode BatchNorms: batch statistics as outputs
        self.batch_statistics.rewrite(exported)
        by_graph_name = {graph_name(name): name for name, _ in (*model.named_parameters(), *model.named_buffers())}
        initializers = [i.name for i in exported.graph.initializer if i.name in by_graph_name]
        parameters = dict(model.named_parameters())
        trainable = [name for name in initializers if needs_grad and by_graph_name[name] in parameters
                     and parameters[by_graph_name[name]].requires_grad]
        parameters_as_inputs(exported, set(initializers))
        add_second_outputs(exported)
        aliases = (prepare_for_gradient(exported, trainable) if needs_grad
                   else padding_rows_without_gradient(exported, ()))
        known = set(initializers) | set(aliases)
        user = [i.name for i in exported.graph.input if i.name not in known]  # unused inputs are not graph inputs
        requiring_grad = [name for name in user if needs_grad and values[name].requires_grad]
        model_proto, differentiated = self._build(exported, initializers + aliases, trainable, requiring_grad,
                                                  outputs, settings)
        _describe_outputs(model_proto, outputs, schema)
        self.batch_statistics.describe(model_proto)
        if placement.substitute_kernels is not None:
            placement.substitute_kernels(model_proto, model_proto)  # each rewrite finds its nodes in either kind
        self._outputs = [o.name for o in model_proto.graph.output]  # the gradients, or the forward's outputs
        self._random = draws_random_numbers(model_proto)
        if needs_grad:
            self._reaching = _outputs_reaching(model_proto, self._outputs, outputs)
            self.read_by_backward = _outputs_read_by_backward(model_proto, outputs)
            _forward_outputs_as_graph_outputs(model_proto, outputs + self.batch_statistics.outputs)
        _save(settings, model_proto, "optimized", needs_grad)
        self._session(model_proto, settings)
        # Each graph input: (0, input name) of the call, (1, torch name) of a parameter or buffer,
        # or (2, torch name) of the weight a padding-row alias reads without a gradient.
        sources = {**{name: (0, name) for name in user},
                   **{name: (1, by_graph_name[name]) for name in initializers},
                   **{name: (2, by_graph_name[name[:-len(NO_GRADIENT_SUFFIX)]]) for name in aliases}}
        self._sources = [sources[name] for name in self._inputs]
        slots = {name: index for index, name in enumerate(differentiated)}
        self.gradient_slots = [slots.get(name) for name in self._inputs]  # each feed's backward output
        _info(settings, "compiled the %s graph of %s for inputs %s in %.2f s", self.kind, type(model).__name__,
              {name: list(values[name].shape) for name in user}, time.perf_counter() - started)

    def feeds(self, values, named):
        """The graph's inputs for one call, in order: `values` {input name: tensor} of the call,
        `named` {torch name: tensor} of the model's parameters and buffers."""
        return [values[key] if source == 0 else named[key] if source == 1 else named[key].detach()
                for source, key in self._sources]

    @property
    def kind(self):
        return "training" if self.trains else "inference"

    def _build(self, exported, initializers, trainable, requiring_grad, outputs, settings):
        """ORT's ORTModule graph builder on the fixed export: (forward + YieldOp + gradient graph,
        or the optimized forward alone; the names whose gradients the backward returns, in order).
        Records what the autograd Function needs to know.

        An input or parameter the outputs do not depend on differentiably (a parameter only
        compared, `w > 0`) gets no gradient, as in torch (ORT refuses to build with it). ORT's
        compute optimizer can move a Reshape above a MatMul whose result is also an output,
        changing that output's shape (GPT-2's logits, [batch, seq, vocab], came out as
        [batch * seq, vocab]): a graph whose outputs do not have torch's shapes is built again
        without it."""
        compute_optimizer = settings.compute_optimizer
        while True:
            try:
                builder = self._builder(exported, initializers, trainable, requiring_grad, outputs, settings,
                                        compute_optimizer)
            except RuntimeError as error:
                unreachable = _UNREACHABLE.search(str(error))
                if unreachable is None or unreachable.group(1) not in trainable + requiring_grad:
                    raise
                trainable = [name for name in trainable if name != unreachable.group(1)]
                requiring_grad = [name for name in requiring_grad if name != unreachable.group(1)]
                continue
            if not (compute_optimizer and _shapes_differ(builder.get_forward_model(), self.schema.shapes)):
                break
            _info(settings, "ONNX Runtime's compute optimizer changed the shapes of the outputs; built without it")
            compute_optimizer = False
        info = builder.get_graph_info()
        self.non_differentiable = list(info.output_grad_indices_non_differentiable) if self.trains else []
        self.full_shape_grads = set(info.output_grad_indices_require_full_shape) if self.trains else set()
        model = builder.get_gradient_model() if self.trains else builder.get_forward_model()
        return onnx.load_from_string(model), requiring_grad + trainable

    def _builder(self, exported, initializers, trainable, requiring_grad, outputs, settings, compute_optimizer):
        config = C.OrtModuleGraphBuilderConfiguration()
        config.initializer_names = initializers
        config.initializer_names_to_train = trainable
        config.input_names_require_grad = requiring_grad
        config.build_gradient_graph = self.trains
        config.enable_caching = False
        config.loglevel = C.Severity(int(settings.ort_severity))
        transformers = C.TrainingGraphTransformerConfiguration()
        transformers.enable_compute_optimizer = compute_optimizer
        if settings.save_directory is not None and self.trains:
            transformers.optimized_pre_grad_filepath = _path(settings, "pre_grad", True)
        builder = C.OrtModuleGraphBuilder()
        try:
            builder.initialize(exported.SerializeToString(), config)
            builder.build(transformers)
        except RuntimeError as error:
            missing = missing_gradient(str(error), exported, trainable, outputs)
            if missing is None:
                raise
            raise missing from error
        return builder

    def _session(self, model_proto, settings):
        placement = self._placement
        options = placement.session_options()
        options.log_severity_level = int(settings.ort_severity)
        if settings.save_directory is not None:
            options.optimized_model_filepath = _path(settings, "execution_model", self.trains)
        self._ort_session = onnxruntime.InferenceSession(model_proto.SerializeToString(), options,
                                                         providers=placement.providers)
        placement.check_providers(self._ort_session)
        device = C.OrtDevice(C.OrtDevice.cuda() if placement.ort_device == "cuda" else C.OrtDevice.cpu(),
                             C.OrtDevice.default_memory(), placement.index)
        self._inputs = [i.name for i in model_proto.graph.input]
        if self.trains:
            forward_outputs = len(self.schema.shapes) + len(self.batch_statistics.outputs)
            self._agent = C.TrainingAgent(self._ort_session._sess, self._inputs, [device] * forward_outputs,
                                          self._outputs, [device] * len(self._outputs), placement.index)
        else:
            self._devices = [device] * len(self._outputs)

    def infer(self, feeds):
        """The forward alone (no gradient): the outputs as tensors."""
        fetched = C.OrtValueVector()
        self._before_first_run()
        if self._random:
            seed_random_ops()
        with self._placement.step():
            self._ort_session._sess.run_with_ortvaluevector(self._placement.run_options, self._inputs,
                                                            _ort_values(feeds), self._outputs, fetched, self._devices)
        self._after_first_run()
        return self._placement.returned(_torch_tensors(fetched))

    def _before_first_run(self):
        """A session's first run allocates tensor by tensor (ONNX Runtime records its memory
        pattern), later ones take one planned block: as CompiledGraph does, the device's cached
        memory is released before the first run (built on the memory in use) and after it (so
        the process holds one of the two)."""
        if self._first_run:
            self._placement.memory.release_cached_memory()

    def _after_first_run(self):
        if self._first_run:
            self._placement.memory.release_cached_memory()
            self._first_run = False

    def run_forward(self, feeds):
        """(outputs, state): the forward of a training call; `state` keeps what its backward reads.

        The outputs are the graph's own (no copy): `_forward_outputs_as_graph_outputs` keeps their
        memory out of the backward's reuse and out of the memory pattern, so they live as long as
        the caller holds them."""
        state, fetched = C.PartialGraphExecutionState(), C.OrtValueVector()
        self._before_first_run()
        if self._random:
            seed_random_ops()
        with self._placement.step():
            self._agent.run_forward(_ort_values(feeds), fetched, state, None)
        return self._placement.returned(_torch_tensors(fetched)), state

    def run_backward(self, state, output_grads, used):
        """The gradients of the forward's inputs that require one, in feed order, from the gradients
        of its outputs (`output_grads`: tensors, in output order; `used`: the indices of the outputs
        that received a gradient, the others' are zeros). None for the others, and for those no
        output in `used` depends on: torch leaves them without a gradient, ONNX Runtime gives zeros."""
        fetched = C.OrtValueVector()
        with self._placement.step():
            self._agent.run_backward(_ort_values(output_grads), fetched, state)
        grads = self._placement.returned(_torch_tensors(fetched))
        self._after_first_run()  # of a training graph: its forward and backward
        return [None if slot is None or not self._reaching[slot] & used else grads[slot]
                for slot in self.gradient_slots]


def _info(settings, message, *args):
    """A line for the `ort_trainer.ortmodule` logger, at LogLevel INFO and below."""
    if settings.log_level <= LogLevel.INFO:
        LOGGER.info("ORTModule: " + message, *args)


def _describe_outputs(model_proto, names, schema):
    """Records the type and shape of the model's outputs (YieldOp inputs in a training graph,
    which ORT's builder leaves undescribed), in place: they become graph outputs, and the CPU
    rewrites apply only where they know the type (a loss computed inside the model gets the
    threaded softmax cross-entropy)."""
    described = {value.name for value in (*model_proto.graph.value_info, *model_proto.graph.output)}
    for name, dtype, shape in zip(names, schema.dtypes, schema.shapes):
        if name not in described and dtype in _ONNX_TYPES:
            model_proto.graph.value_info.append(onnx.helper.make_tensor_value_info(name, _ONNX_TYPES[dtype], shape))


def _forward_outputs_as_graph_outputs(model_proto, names):
    """Makes the forward's outputs (the YieldOp's inputs) outputs of the training graph too, in
    place. ONNX Runtime otherwise plans them as intermediates: the backward reuses their memory
    (GPT-2's loss read 0.0 after backward()) and the memory pattern frees it with the forward's
    state. A graph output gets a buffer of its own that the fetched tensor owns. The backward
    fetches only the gradients (the graph's outputs before this)."""
    described = {value.name: value for value in model_proto.graph.value_info}
    model_proto.graph.output.extend(described[name] for name in names)


def _outputs_reaching(model_proto, gradients, outputs):
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
_ALIASING_OPS = {"Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten"}


def _outputs_read_by_backward(model_proto, outputs):
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
    """`name` and the tensors that may share its memory through _ALIASING_OPS, either way."""
    group, stack = set(), [name]
    while stack:
        name = stack.pop()
        if name in group:
            continue
        group.add(name)
        producer = producers.get(name)
        if producer is not None and producer.op_type in _ALIASING_OPS:
            stack.append(producer.input[0])
        stack.extend(node.output[0] for node in consumers.get(name, ()) if node.op_type in _ALIASING_OPS)
    return group


def _shapes_differ(serialized, shapes):
    """Whether the outputs of a serialized model have other ranks or (known) sizes than `shapes`."""
    outputs = onnx.load_from_string(serialized).graph.output
    return any(len(output.type.tensor_type.shape.dim) != len(shape)
               or any(dim.HasField("dim_value") and dim.dim_value != size
                      for dim, size in zip(output.type.tensor_type.shape.dim, shape))
               for output, shape in zip(outputs, shapes))


def _path(settings, stage, training):
    return os.path.join(settings.save_directory,
                        f"{settings.onnx_prefix}_{stage}_{'training' if training else 'inference'}.onnx")


def _save(settings, model_proto, stage, training):
    if settings.save_directory is not None:
        onnx.save(model_proto, _path(settings, stage, training))


def _ort_values(tensors):
    """An OrtValueVector viewing `tensors` (DLPack: no copy for contiguous tensors)."""
    vector = C.OrtValueVector()
    vector.reserve(len(tensors))
    for tensor in tensors:
        tensor = tensor.detach()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        is_bool = tensor.dtype == torch.bool
        vector.push_back(to_dlpack(tensor.view(torch.uint8) if is_bool else tensor), is_bool)
    return vector


def _torch_tensors(vector):
    """The tensors of an OrtValueVector (DLPack: no copy); bool ones travel as uint8."""
    tensors = vector.to_dlpacks(from_dlpack)
    for index in vector.bool_tensor_indices():
        tensors[index] = tensors[index].view(torch.bool)
    return tensors
