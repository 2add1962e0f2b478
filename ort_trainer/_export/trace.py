"""The trace: a torch model (and its loss) to ONNX, every module in its own train/eval state, the
user's random stream and buffers left as they were, a trace that read tensor values refused.

Everything exporter-specific lives here so that a torch.export based path can replace the
TorchScript exporter (deprecated upstream) without touching the rest of the trainer. The graphs
name a torch parameter `graph_name(torch name)`: the exported step holds the model as `model`.
"""
import collections
import contextlib
import io
import itertools
import logging
import re
import warnings

import onnx
import torch

from .._configuration.ortmodule_settings import FallbackPolicy
from .._configuration.refusals import Refusal
from .autograd_functions import AutogradFunctionRefused
from .running_statistics import running_statistics_kept
from .binding import BindingError, present_inputs, select_outputs, training_flags_kept
from .checkpointing import checkpoints_inlined
from .guards import DataDependentTraceError, watch_data_dependence
from .hf_compat import export_patches
from .symbolics import our_symbolics
from .torch_node_symbolics import NoGradValuesDetached

# What the exporter says about itself while we use it on purpose: the TorchScript exporter's
# deprecation, and its notes on training-mode export. Other warnings (the model's own, torch's
# deprecations elsewhere) reach the user. TracerWarnings ("the trace might not generalize") are
# checked, not shown: a conversion of tensor values to Python values refuses the trace
# (`_export.guards.watch_data_dependence`); one of sizes is what the proof of every re-derived graph checks
# (TrainingExports).
_EXPORTER_NOTICES = ("You are using the legacy TorchScript-based ONNX export",
                     "Setting `training` to something other than default is deprecated",
                     "The feature will be removed",
                     "Constant folding - Only steps=1 can be constant folded")


LOGGER = logging.getLogger("ort_trainer.export")


class ExportError(Refusal, RuntimeError):
    """The model (or its loss) could not be exported to ONNX."""

    fallback = FallbackPolicy.FALLBACK_UNSUPPORTED_ONNX_MODEL


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


def _export(module, args, **kwargs):
    """torch.onnx.export (TorchScript) with our symbolics, the Hugging Face patches and checkpointed
    segments inlined (`checkpointing`), every train/eval flag and the RNG kept; returns the
    serialized model. Our own errors pass as they are, the exporter's become an ExportError naming
    the operator; a trace whose Python code read tensor values raises DataDependentTraceError."""
    buffer = io.BytesIO()
    try:
        with our_symbolics(), training_flags_kept(module), rng_kept(module, args), warnings.catch_warnings(), \
                state_dict_pre_hooks_held(module), export_patches(module), checkpoints_inlined(), \
                NoGradValuesDetached(), exporter_log_to_debug(), \
                watch_data_dependence() as data_dependent:
            for message in _EXPORTER_NOTICES:
                warnings.filterwarnings("ignore", message=message)
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
            torch.onnx.export(module, tuple(args), buffer, dynamo=False, do_constant_folding=False,
                              export_params=True, **kwargs)
    except (ExportError, BindingError, AutogradFunctionRefused):
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
            training=torch.onnx.TrainingMode.PRESERVE, opset_version=opset_version,
            autograd_inlining=False))  # custom autograd.Functions as torch nodes (`_export.autograd_functions`)


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
    hint = ""
    if "Unsupported prim::Constant kind: 'ival'" in message and "Generator" in str(error):
        hint = (" (a torch.Generator passed to a random op, e.g. torch.rrelu(..., generator=g), cannot be traced: "
                "draw from the default generator, which torch.manual_seed seeds)")
    return f"exporting the model to ONNX failed{where}: {type(error).__name__}: {message}{hint}"


def export_eval_model(wrapper, input_names, output_names, sample_inputs, input_specs, dynamic_dims, opset_version):
    dynamic_axes = {spec.name: {axis: dim for axis, dim in enumerate(spec.shape) if dim in dynamic_dims}
                    for spec in input_specs}
    return _export(wrapper, sample_inputs, input_names=input_names, output_names=list(output_names),
                   dynamic_axes=dynamic_axes, training=torch.onnx.TrainingMode.EVAL, opset_version=opset_version)


# The exported step holds the user's model as its attribute `model` (_export.TracedStep), so a
# torch parameter's name in the graphs is this prefix + its torch name.
GRAPH_PREFIX = "model."


def graph_name(torch_name):
    """The name of a torch parameter (or buffer) in the exported graphs."""
    return GRAPH_PREFIX + torch_name


@contextlib.contextmanager
def state_dict_pre_hooks_held(model):
    """Context in which `state_dict()` runs no module's pre-hooks: the exporter names the parameters it
    traces by the model's state_dict(), and a pre-hook may swap them in the middle of the forward being
    traced (FSDP2's puts its sharded DTensors back)."""
    held = [(module, module.__dict__["_state_dict_pre_hooks"]) for module in model.modules()
            if module.__dict__.get("_state_dict_pre_hooks")]
    for module, _ in held:
        module.__dict__["_state_dict_pre_hooks"] = collections.OrderedDict()
    try:
        yield
    finally:
        for module, hooks in held:
            module.__dict__["_state_dict_pre_hooks"] = hooks


def rng_kept(model, tensors):
    """Context restoring torch's CPU RNG and that of every CUDA device the model or the inputs
    are on: our own forwards (probe, trace) must not shift the user's random stream."""
    devices = {t.device.index or 0 for t in itertools.chain(tensors, model.parameters(), model.buffers())
               if t.is_cuda}
    return torch.random.fork_rng(devices=sorted(devices))


@contextlib.contextmanager
def exporter_log_to_debug():
    """Context in which the TorchScript exporter's own log (a "Torch IR graph at exception" dump of
    the whole graph before each failure, written on stdout: torch 2.13's exporter turns its log on
    for every export and leaves it on) goes to the `ort_trainer.export` logger at DEBUG; the log's
    switch is left as it was found."""
    enabled, log = torch._C._jit_is_onnx_log_enabled(), torch._C._jit_onnx_log
    torch._C._jit_onnx_log = _debug_log
    try:
        yield
    finally:
        torch._C._jit_onnx_log = log
        torch._C._jit_set_onnx_log_enabled(enabled)


def _debug_log(*parts):
    if LOGGER.isEnabledFor(logging.DEBUG):
        LOGGER.debug("the exporter's log: %s", "".join(str(part) for part in parts))
