"""Export a torch model and its loss to ONNX.

Everything exporter-specific lives here so that a torch.export based path can replace the
TorchScript exporter (deprecated upstream) without touching the rest of the trainer.
"""
import io
import itertools
import re
import warnings

import onnx
import torch

from ._batch_norm import running_statistics_kept, untracked_changes
from ._binding import BindingError, select_outputs, training_flags_kept
from ._flat import GRAPH_PREFIX, graph_name
from ._graph import parameters_as_inputs, rename_initializers
from ._guards import DataDependentTraceError, watch_data_dependence
from ._hf_compat import export_patches
from ._symbolics import register_symbolics

# What the exporter says about itself while we use it on purpose: the TorchScript exporter's
# deprecation, and its notes on training-mode export. Other warnings (the model's own, torch's
# deprecations elsewhere) reach the user. TracerWarnings ("the trace might not generalize") are
# checked, not shown: a conversion of tensor values to Python values refuses the trace
# (`_guards.watch_data_dependence`); one of sizes is what the proof of every re-derived graph checks
# (TrainingExports).
_EXPORTER_NOTICES = ("You are using the legacy TorchScript-based ONNX export",
                     "Setting `training` to something other than default is deprecated",
                     "The feature will be removed",
                     "Constant folding - Only steps=1 can be constant folded")


class ExportError(RuntimeError):
    """The model (or its loss) could not be exported to ONNX."""


class TracedStep(torch.nn.Module):
    """What is exported: the model called as `binding` says, then `loss_fn` on the labels.

    `present`: the names of the inputs given (None ones are left out), in model_desc order, which
    is the order of forward()'s tensors. Returns model_desc's `output_names` as a flat tuple: with
    a loss_fn `(loss, *declared model outputs)`, else the declared model outputs.
    """

    def __init__(self, model, loss_fn, binding, present, output_names):
        super().__init__()
        self.model = model  # so the graph names of its parameters are _flat.graph_name's
        self.loss_fn = loss_fn
        self.binding = binding
        self.present = tuple(present)
        self.output_names = tuple(output_names)

    def forward(self, *tensors):
        values = dict(zip(self.present, tensors))
        output = self.binding.call_model(self.model, values)
        if self.loss_fn is None:
            return select_outputs(output, self.output_names)
        loss = self.loss_fn(output, *(values[name] for name in self.binding.labels))
        if not isinstance(loss, torch.Tensor):
            raise BindingError(f"loss_fn returned a {type(loss).__name__}, expected the loss as a tensor")
        return (loss, *select_outputs(output, self.output_names[1:]))


def present_inputs(values):
    """(names, tensors) of the inputs given, None ones left out, in model_desc order."""
    names = [name for name, value in values.items() if value is not None]
    return names, [values[name] for name in names]


def rng_kept(model, tensors):
    """Context restoring torch's CPU RNG and that of every CUDA device the model or the inputs
    are on: our own forwards (probe, trace) must not shift the user's random stream."""
    devices = {t.device.index or 0 for t in itertools.chain(tensors, model.parameters(), model.buffers())
               if t.is_cuda}
    return torch.random.fork_rng(devices=sorted(devices))


def probe(model, loss_fn, binding, values, output_names):
    """One forward of model + loss as exported, autograd recording, every module in its own
    train/eval state.

    Returns (the declared outputs, names of buffers the forward changed). Binding and output
    errors surface here, before any export. A changed buffer other than BatchNorm running
    statistics (`_batch_norm.untracked_changes`) is one no graph writes back, and the recorded autograd graph
    shows custom autograd.Functions, whose backward the training graph would not run: the trainer
    refuses such models rather than train them silently wrong. Buffers and the RNG are restored.
    """
    names, tensors = present_inputs(values)
    return _probed(model, tensors, TracedStep(model, loss_fn, binding, names, output_names), grad=True)


def probe_call(model, binding, values, grad=False):
    """One forward of `model` called as `binding` says, every module in its own train/eval state,
    with autograd recording if `grad`: (what it returned, names of the buffers it changed).
    Buffers and the RNG are restored."""
    names, tensors = present_inputs(values)
    return _probed(model, tensors, lambda *tensors: binding.call_model(model, dict(zip(names, tensors))), grad)


def custom_functions(tensors, inputs=()):
    """Names of the custom torch.autograd.Functions in the autograd graph of `tensors` (a probe's
    outputs, recorded with grad): the exporter inlines their forward, so a graph built from it
    differentiates that forward instead of running their backward. The walk stops at the model's
    `inputs`: what computed them (another ORTModule's graph, the caller's Functions) is upstream."""
    found, seen = set(), {tensor.grad_fn for tensor in inputs}
    stack = [tensor.grad_fn for tensor in tensors if tensor.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            found.add(f"{node._forward_cls.__module__}.{node._forward_cls.__qualname__}")
        stack.extend(next_node for next_node, _ in node.next_functions)
    return sorted(found)


def custom_functions_refused(functions, remedy):
    """The error for a model computed through custom autograd.Functions (`custom_functions`),
    ending with what the caller can do about it."""
    if any(name.startswith("torch.utils.checkpoint.") for name in functions):
        remedy = ("torch.utils.checkpoint with use_reentrant=True: leave the checkpointing out (Hugging Face: "
                  "model.gradient_checkpointing_disable()) or call it with use_reentrant=False")
    return NotImplementedError(
        f"the model's outputs are computed through custom torch.autograd.Functions {functions}: the exported "
        f"graph would differentiate their inlined forward instead of running their backward ({remedy})")


def _probed(model, tensors, forward, grad=False):
    """(forward(*tensors), names of the buffers it changed), buffers and RNG restored."""
    buffers = dict(model.named_buffers())
    before = {name: b.detach().clone() for name, b in buffers.items()}
    try:
        with rng_kept(model, tensors), torch.set_grad_enabled(grad):
            outputs = forward(*tensors)
        return outputs, sorted(name for name, b in buffers.items() if not torch.equal(b, before[name]))
    finally:
        with torch.no_grad():
            for name, b in buffers.items():
                b.copy_(before[name])


def layerdrop_refused(model):
    """The NotImplementedError for a model that trains with LayerDrop (Hugging Face's BART, Whisper,
    wav2vec 2, ...: a submodule's `layerdrop` > 0), else None. LayerDrop draws in Python, on every
    call, which layers to skip: a trace keeps one draw, and the graph would skip the same layers
    on every step (the others never trained)."""
    on = {name: module.layerdrop for name, module in model.named_modules()
          if isinstance(getattr(module, "layerdrop", None), float) and module.layerdrop > 0}
    if not on or not model.training:
        return None
    where = ", ".join(f"{name or type(model).__name__}.layerdrop={value}" for name, value in on.items())
    return NotImplementedError(f"the model trains with LayerDrop ({where}), which draws in Python on every call "
                               "which layers to skip: a traced graph would skip the layers of one draw on every "
                               "step. Set those layerdrop attributes to 0.0 to train it in ONNX Runtime (the "
                               "config's *layerdrop fields are read only when the model is built)")


def check_traceable(model, loss_fn, binding, desc, values):
    """Before an export: the probe's forward must leave every buffer but BatchNorm running
    statistics alone and give model_desc's output shapes (named dims resolved from the inputs)."""
    layerdrop = layerdrop_refused(model)
    if layerdrop is not None:
        raise layerdrop
    declared, mutated = probe(model, loss_fn, binding, values, desc.output_names)
    functions = custom_functions(declared, present_inputs(values)[1])
    if functions:
        raise custom_functions_refused(functions, "write their forward with differentiable torch operations, "
                                       "or wrap the model in ORTModule, which runs such models in PyTorch")
    mutated = untracked_changes(model, mutated)  # BatchNorm running statistics: the trainer updates them
    if mutated:
        raise NotImplementedError(
            f"the model updates buffers {mutated} in training mode; the trainer writes back BatchNorm running "
            "statistics only, so this model is refused rather than trained wrong. Ways out: put the modules "
            "that update them in eval mode, build them without running statistics (InstanceNorm: "
            "track_running_stats=False), or update those buffers outside forward()")
    named = {}
    for spec in desc.inputs:
        if values[spec.name] is not None:
            named.update((dim, size) for dim, size in zip(spec.shape, values[spec.name].shape) if isinstance(dim, str))
    for spec, tensor in zip(desc.outputs, declared):
        shape = list(tensor.shape)
        declared_as = f"model_desc output {spec.name!r} is declared {list(spec.shape)}"
        if len(shape) != len(spec.shape):
            raise ValueError(f"{declared_as}, but the model produces shape {shape}")
        expected = [named.setdefault(dim, size) if isinstance(dim, str) else dim
                    for dim, size in zip(spec.shape, shape)]
        if shape != expected:
            raise ValueError(f"{declared_as} (here {expected}), but the model produces shape {shape}")


def eval_graph_differs(graph, model, loss_fn, binding, values, output_names, fetched):
    """None when the compiled eval graph computes what torch's eval-mode forward (dropout off, no
    grad) does on `values`, else what differs: the proof of a re-derived graph, and
    debug.check_model_export."""
    names, tensors = present_inputs(values)
    with training_flags_kept(model), torch.no_grad():
        model.eval()
        expected = dict(zip(output_names, TracedStep(model, loss_fn, binding, names, output_names)(*tensors)))
    try:
        ours = graph.run(False, values, quiet=True)
    except Exception as error:  # e.g. a Reshape to a size the exporter baked in
        return f"the exported graph fails: {type(error).__name__}: {str(error).splitlines()[0]}"
    for name, tensor in zip(fetched, ours):
        theirs = expected[name]
        if tensor.shape != theirs.shape:
            return f"output {name!r} of the exported graph has shape {list(tensor.shape)}, torch's {list(theirs.shape)}"
        if not torch.allclose(tensor, theirs, rtol=1e-3, atol=1e-5):
            return (f"output {name!r} of the exported graph differs from the torch model by up to "
                    f"{(tensor - theirs).abs().max().item():.3g} (rtol 1e-3, atol 1e-5)")
    return None


def _export(module, args, **kwargs):
    """torch.onnx.export (TorchScript) with our symbolics and the Hugging Face patches, every
    train/eval flag and the RNG kept; returns the serialized model. Our own errors pass as they are, the
    exporter's become an ExportError naming the operator; a trace whose Python code read tensor
    values raises DataDependentTraceError."""
    register_symbolics()
    buffer = io.BytesIO()
    try:
        with training_flags_kept(module), rng_kept(module, args), warnings.catch_warnings(), \
                export_patches(module), watch_data_dependence() as data_dependent:
            for message in _EXPORTER_NOTICES:
                warnings.filterwarnings("ignore", message=message)
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
            torch.onnx.export(module, tuple(args), buffer, dynamo=False, do_constant_folding=False,
                              export_params=True, **kwargs)
    except (ExportError, BindingError):
        raise
    except Exception as error:
        raise ExportError(_describe_export_failure(error)) from error
    if data_dependent:
        raise DataDependentTraceError(data_dependent)
    return buffer.getvalue()


def export_training_model(model, loss_fn, binding, output_names, values, opset_version, dynamic_axes=None):
    """Trace model + loss at the sample's shapes, every module in its own train/eval state (a
    frozen backbone in eval mode keeps its dropout off); returns the ONNX model.

    `values`: {model_desc input name: tensor or None (not passed)}. `dynamic_axes`: {input name:
    {axis: dim name}} to leave symbolic. The trace updates no buffer (`running_statistics_kept`).
    """
    names, tensors = present_inputs(values)
    wrapper = TracedStep(model, loss_fn, binding, names, output_names)
    with running_statistics_kept(model):
        return onnx.load_from_string(_export(
            wrapper, tensors, input_names=names, output_names=list(output_names), dynamic_axes=dynamic_axes,
            training=torch.onnx.TrainingMode.PRESERVE, opset_version=opset_version))


class TrainingExports:
    """Exports model + loss once per (inputs given, model state) and re-derives the graph of
    every new input shape from that export instead of tracing again.

    Why: tracing is most of what a new shape costs (8 of 11 s for a BERT-base step at a new
    sequence length; the gradient graph and the sessions take 0.2 s). The export leaves
    model_desc's named dims symbolic and holds no weights (parameters are graph inputs, read from
    the flat buffer); a new shape gets a copy with those dims set. Such a copy is trusted only
    once the caller has proven it against torch at that shape (`get` says when): a dim the
    exporter baked in (nn.MultiheadAttention's sequence length) fails there, and `reject` then
    makes that export trace every shape again, as at first.
    """

    def __init__(self, model, loss_fn, binding, input_specs, output_names, opset_version):
        self._model, self._loss_fn, self._binding = model, loss_fn, binding
        self._input_specs, self._output_names, self._opset = input_specs, tuple(output_names), opset_version
        self._parameters = {graph_name(name) for name, _ in model.named_parameters()}
        self._templates = {}  # (inputs given, state) -> weightless symbolic export, or None: trace per shape

    def check(self, values, desc):
        """`check_traceable` on these inputs, before `get`."""
        check_traceable(self._model, self._loss_fn, self._binding, desc, values)

    def get(self, values, state):
        """(ONNX model for these inputs, whether it must be proven against torch before use)."""
        key = _kind(values, state)
        if key not in self._templates:
            try:
                template = self._export(values, self._dynamic_axes(values))
            except ExportError:  # some exports only work at fixed shapes
                self._templates[key] = None
            else:
                parameters_as_inputs(template, self._parameters)
                self._templates[key] = template
                return with_input_shapes(template, values), False  # traced at these very shapes
        template = self._templates[key]
        if template is None:
            return self._export(values, None), False
        return with_input_shapes(template, values), True

    def with_weights(self, values):
        """The forward + loss model as traced for training, model_desc's named dims symbolic where
        the exporter allows, the current weights as initializers named as in the model's
        state_dict (the original's `save_as_onnx`)."""
        try:
            model = self._export(values, self._dynamic_axes(values))
        except ExportError:
            model = self._export(values, None)
        rename_initializers(model, {i.name: i.name[len(GRAPH_PREFIX):] for i in model.graph.initializer
                                    if i.name.startswith(GRAPH_PREFIX)})
        return model

    def _dynamic_axes(self, values):
        return {spec.name: {axis: dim for axis, dim in enumerate(spec.shape) if isinstance(dim, str)}
                for spec in self._input_specs if values[spec.name] is not None}

    def reject(self, values, state):
        """The derived graph failed its proof: trace every shape of this kind from now on."""
        self._templates[_kind(values, state)] = None

    def _export(self, values, dynamic_axes):
        return export_training_model(self._model, self._loss_fn, self._binding, self._output_names, values,
                                     self._opset, dynamic_axes)


def _kind(values, state):
    """What one symbolic export serves: which inputs are given, and the model's state
    (`_guards.ModuleState`: train/eval flags, attributes)."""
    return tuple(present_inputs(values)[0]), state


def with_input_shapes(template, values):
    """A copy of `template` whose inputs have the shapes of `values` (symbolic dims made concrete)."""
    model = onnx.ModelProto()
    model.CopyFrom(template)
    for graph_input in model.graph.input:
        value = values.get(graph_input.name)
        if value is not None:
            for dim, size in zip(graph_input.type.tensor_type.shape.dim, value.shape):
                dim.Clear()
                dim.dim_value = size
    del model.graph.value_info[:]
    return model


def _describe_export_failure(error):
    message = str(error).split("\n", 1)[0]
    operator = re.search(r"'((?:aten|prim|onnx)::\w+)'", message)
    where = f" at operator {operator.group(1)}" if operator else ""
    return f"exporting the model to ONNX failed{where}: {type(error).__name__}: {message}"


def export_inference_model(model, binding, input_specs, output_names, values, opset_version):
    """The model alone (no loss_fn), in eval mode, with dynamic axes where they verifiably work.

    input_specs: the InputDescriptions of the model's inputs (their string dims become dynamic
    axes); `values`: the sample {name: tensor or None}. Each dynamic dim is probed at another size
    with ONNX Runtime against torch; dims the TorchScript exporter baked into the graph
    (nn.MultiheadAttention's sequence length, for one) are made static so the file says what it
    accepts. Returns (serialized model, names of static dims).
    """
    specs = [spec for spec in input_specs if values[spec.name] is not None]
    names = [spec.name for spec in specs]
    sample = [values[name] for name in names]
    wrapper = TracedStep(model, None, binding, names, output_names)
    dims = {dim for spec in specs for dim in spec.shape if isinstance(dim, str)}
    with training_flags_kept(model):
        model.eval()
        with torch.no_grad():
            expected = wrapper(*sample)
            probes = {dim: _probe_inputs(specs, sample, dim) for dim in dims}
            expected_probes = {dim: wrapper(*inputs) for dim, inputs in probes.items()}
            baked = set()
            while True:
                serialized = _export_eval(wrapper, names, output_names, sample, specs, dims - baked, opset_version)
                _check_runs_like_torch(serialized, names, sample, expected, output_names)
                failing = {dim for dim in dims - baked
                           if not _runs_like_torch(serialized, names, probes[dim], expected_probes[dim])}
                if not failing:
                    return serialized, sorted(baked)
                baked |= failing


def _export_eval(wrapper, input_names, output_names, sample_inputs, input_specs, dynamic_dims, opset_version):
    dynamic_axes = {spec.name: {axis: dim for axis, dim in enumerate(spec.shape) if dim in dynamic_dims}
                    for spec in input_specs}
    return _export(wrapper, sample_inputs, input_names=input_names, output_names=list(output_names),
                   dynamic_axes=dynamic_axes, training=torch.onnx.TrainingMode.EVAL, opset_version=opset_version)


def _probe_inputs(input_specs, sample_inputs, dim):
    """The sample with dim `dim` one smaller (or one larger when it is 1), same values otherwise."""
    probe = []
    for spec, tensor in zip(input_specs, sample_inputs):
        for axis, name in enumerate(spec.shape):
            if name == dim:
                size = tensor.shape[axis]
                tensor = (tensor.narrow(axis, 0, size - 1) if size > 1
                          else torch.cat([tensor, tensor], axis))
        probe.append(tensor)
    return probe


def _session_outputs(serialized, names, inputs):
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4  # a failing probe is an expected outcome, not an error to print
    session = onnxruntime.InferenceSession(serialized, options, providers=["CPUExecutionProvider"])
    outputs = session.run(None, {name: tensor.cpu().numpy() for name, tensor in zip(names, inputs)})
    return [torch.from_numpy(out) for out in outputs]


def _runs_like_torch(serialized, names, inputs, expected):
    try:
        outputs = _session_outputs(serialized, names, inputs)
    except Exception:
        return False
    return all(torch.allclose(out, ref.cpu(), rtol=1e-4, atol=1e-5) for out, ref in zip(outputs, expected))


def _check_runs_like_torch(serialized, names, inputs, expected, output_names):
    outputs = _session_outputs(serialized, names, inputs)
    for name, out, ref in zip(output_names, outputs, expected):
        difference = (out - ref.cpu()).abs().max().item()
        if difference > 1e-5 * max(1.0, ref.abs().max().item()):
            raise ExportError(f"the exported inference model's output {name!r} differs from torch by {difference:.3g}")
