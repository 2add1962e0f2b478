"""ORTTrainer's exports: one trace per (inputs given, model state), re-derived for each new input
shape, and the proof of a graph against torch's eval-mode forward at its shape."""
import torch

from .._configuration.refusals import ONNX_RUNTIME_ERRORS, device_failure
from .._export.binding import present_inputs, training_flags_kept
from .._export.onnx_model import Traced
from .._export.probe import check_traceable
from .._export.trace import GRAPH_PREFIX, ExportError, TracedStep, export_training_model, graph_name, with_input_shapes
from .._onnx import parameters_as_inputs, rename_initializers


# (rtol, atol) of the proof per compute type: fp32 graphs differ from torch by reassociation only;
# mixed-precision graphs round where autocast rounds, but not always at the same ops (torch runs a
# GELU after an fp16 linear in fp16, the graph in fp32), so their outputs differ by a few units of
# the lower precision's rounding (fp16 2^-11, bf16 2^-8). A baked-in dim fails either way.
PROOF_TOLERANCES = {None: (1e-3, 1e-5), "float16": (2e-2, 2e-3), "bfloat16": (1e-1, 1e-2)}


class GraphDiffers(RuntimeError):
    """The compiled eval graph does not compute what torch's eval-mode forward does; where it fails
    to run, chained to ONNX Runtime's error."""


def check_eval_graph(graph, model, loss_fn, binding, values, output_names, fetched, *, device_type="cpu",
                     compute_dtype=None):
    """Raises GraphDiffers, saying what differs, unless the compiled eval graph computes what torch's
    eval-mode forward (dropout off, no grad; under torch.autocast(device_type, compute_dtype) for a
    mixed-precision graph) does on `values`: the proof of a re-derived graph, and
    debug.check_model_export."""
    names, tensors = present_inputs(values)
    autocast = torch.autocast(device_type, dtype=getattr(torch, compute_dtype or "float32"),
                              enabled=compute_dtype is not None)
    with training_flags_kept(model), torch.no_grad(), autocast:
        model.eval()
        expected = dict(zip(output_names, TracedStep(model, loss_fn, binding, names, output_names)(*tensors)))
    try:
        ours = graph.run(values, training=False, quiet=True)
    except ONNX_RUNTIME_ERRORS as error:  # e.g. a Reshape to a size the exporter baked in
        if device_failure(error):
            raise
        raise GraphDiffers(f"the exported graph fails: {type(error).__name__}: {str(error).splitlines()[0]}") from error
    rtol, atol = PROOF_TOLERANCES[compute_dtype]
    for name, tensor in zip(fetched, ours):
        theirs = expected[name]
        if tensor.shape != theirs.shape:
            raise GraphDiffers(f"output {name!r} of the exported graph has shape {list(tensor.shape)}, torch's "
                               f"{list(theirs.shape)}")
        theirs = theirs.to(tensor.dtype)
        if not torch.allclose(tensor, theirs, rtol=rtol, atol=atol):
            raise GraphDiffers(f"output {name!r} of the exported graph differs from the torch model by up to "
                               f"{(tensor - theirs).abs().max().item():.3g} (rtol {rtol:g}, atol {atol:g})")


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

    def get(self, values, state) -> Traced:
        """The ONNX model for these inputs, and whether it must be proven against torch before use."""
        key = _kind(values, state)
        if key not in self._templates:
            try:
                template = self._export(values, self._dynamic_axes(values))
            except ExportError:  # some exports only work at fixed shapes
                self._templates[key] = None
            else:
                parameters_as_inputs(template, self._parameters)
                self._templates[key] = template
                return Traced(with_input_shapes(template, values), unproven=False)  # traced at these very shapes
        template = self._templates[key]
        if template is None:
            return Traced(self._export(values, None), unproven=False)
        return Traced(with_input_shapes(template, values), unproven=True)

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
    (`_export.guards.ModuleState`: train/eval flags, attributes)."""
    return tuple(present_inputs(values)[0]), state
