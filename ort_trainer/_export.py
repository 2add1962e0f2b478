"""Export a torch model and its loss to ONNX.

Everything exporter-specific lives here so that a torch.export based path can replace the
TorchScript exporter (deprecated upstream) without touching the rest of the trainer.
"""
import inspect
import io
import re
import warnings

import onnx
import torch

# The wrapper below holds the user's model under this attribute, so exported initializer names
# are "<prefix><torch parameter name>".
MODEL_PREFIX = "model."


class ExportError(RuntimeError):
    """The model (or its loss) could not be exported to ONNX."""


class _ModelWithLoss(torch.nn.Module):
    """Feeds the leading inputs to the model and the trailing ones (labels) to loss_fn.

    Returns a flat tuple: (loss, *model outputs) with a loss_fn, else the model's outputs.
    """

    def __init__(self, model, loss_fn, num_model_inputs):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.num_model_inputs = num_model_inputs

    def forward(self, *inputs):
        output = self.model(*inputs[: self.num_model_inputs])
        if self.loss_fn is None:
            return output
        loss = self.loss_fn(output, *inputs[self.num_model_inputs:])
        return (loss, *flatten_outputs(output))


def flatten_outputs(output):
    """The model's outputs as a flat tuple of tensors (tuples, lists and dicts are flattened)."""
    if isinstance(output, torch.Tensor):
        return (output,)
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return tuple(t for item in output for t in flatten_outputs(item))
    raise ExportError(f"the model returned {type(output).__name__}; expected tensors (or tuples/lists/dicts of them)")


def count_model_inputs(model, input_names, has_loss_fn):
    """How many of model_desc's inputs go to model.forward (the rest are labels for loss_fn).

    The leading inputs whose names are parameters of forward() go to the model; a forward(*args)
    takes all inputs but the last.
    """
    if not has_loss_fn:
        return len(input_names)
    parameters = inspect.signature(model.forward).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return len(input_names) - 1
    forward_names = {p.name for p in parameters}
    count = 0
    while count < len(input_names) and input_names[count] in forward_names:
        count += 1
    return count


def mutated_buffers(model, num_model_inputs, sample_inputs):
    """Names of buffers that a training-mode forward pass changes (BatchNorm running stats...).

    The training graph cannot write those back, so the trainer refuses such models rather than
    train them silently wrong. Buffers and the RNG state are restored afterwards.
    """
    buffers = dict(model.named_buffers())
    before = {name: b.detach().clone() for name, b in buffers.items()}
    was_training = model.training
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model.train()
            model(*sample_inputs[:num_model_inputs])
        return sorted(name for name, b in buffers.items() if not torch.equal(b, before[name]))
    finally:
        with torch.no_grad():
            for name, b in buffers.items():
                b.copy_(before[name])
        model.train(was_training)


def export_training_model(model, loss_fn, num_model_inputs, input_names, output_names,
                          sample_inputs, opset_version):
    """Trace model + loss in training mode at the sample's exact shapes; returns the ONNX model."""
    wrapper = _ModelWithLoss(model, loss_fn, num_model_inputs)
    buffer = io.BytesIO()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                wrapper, tuple(sample_inputs), buffer, dynamo=False,
                input_names=list(input_names), output_names=list(output_names),
                training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                opset_version=opset_version, export_params=True,
            )
    except ExportError:
        raise
    except Exception as error:
        raise ExportError(_describe_export_failure(error)) from error
    exported = onnx.load_from_string(buffer.getvalue())
    produced = [o.name for o in exported.graph.output]
    if produced != list(output_names):
        raise ExportError(
            f"model_desc names {len(output_names)} outputs {list(output_names)}, but the exported "
            f"model (with loss_fn, the loss first) produced {len(produced)}: {produced}")
    return exported


def _describe_export_failure(error):
    message = str(error).split("\n", 1)[0]
    operator = re.search(r"'((?:aten|prim|onnx)::\w+)'", message)
    where = f" at operator {operator.group(1)}" if operator else ""
    return f"exporting the model to ONNX failed{where}: {type(error).__name__}: {message}"


def export_inference_model(model, num_model_inputs, input_specs, output_names, sample_inputs, opset_version):
    """The model alone (no loss), in eval mode, with dynamic axes where they verifiably work.

    input_specs: the model's InputDescriptions (their string dims become dynamic axes). Each
    dynamic dim is probed at another size with ONNX Runtime against torch; dims the TorchScript
    exporter baked into the graph (nn.MultiheadAttention's sequence length, for one) are made
    static so the file says what it accepts. Returns (serialized model, names of static dims).
    """
    names = [spec.name for spec in input_specs]
    dims = {dim for spec in input_specs for dim in spec.shape if isinstance(dim, str)}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            expected = flatten_outputs(model(*sample_inputs))
            probes = {dim: _probe_inputs(input_specs, sample_inputs, dim) for dim in dims}
            expected_probes = {dim: flatten_outputs(model(*inputs)) for dim, inputs in probes.items()}
            baked = set()
            while True:
                serialized = _export_eval(model, names, output_names, sample_inputs, input_specs,
                                          dims - baked, opset_version)
                _check_runs_like_torch(serialized, names, sample_inputs, expected, output_names)
                failing = {dim for dim in dims - baked
                           if not _runs_like_torch(serialized, names, probes[dim], expected_probes[dim])}
                if not failing:
                    return serialized, sorted(baked)
                baked |= failing
    finally:
        model.train(was_training)


def _export_eval(model, input_names, output_names, sample_inputs, input_specs, dynamic_dims, opset_version):
    dynamic_axes = {spec.name: {axis: dim for axis, dim in enumerate(spec.shape) if dim in dynamic_dims}
                    for spec in input_specs}
    buffer = io.BytesIO()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(model, tuple(sample_inputs), buffer, dynamo=False, input_names=input_names,
                              output_names=list(output_names), dynamic_axes=dynamic_axes,
                              training=torch.onnx.TrainingMode.EVAL, do_constant_folding=True,
                              opset_version=opset_version, export_params=True)
    except Exception as error:
        raise ExportError(_describe_export_failure(error)) from error
    return buffer.getvalue()


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
    return session.run(None, {name: tensor.numpy() for name, tensor in zip(names, inputs)})


def _runs_like_torch(serialized, names, inputs, expected):
    try:
        outputs = _session_outputs(serialized, names, inputs)
    except Exception:
        return False
    return all(torch.allclose(torch.from_numpy(out), ref, rtol=1e-4, atol=1e-5) for out, ref in zip(outputs, expected))


def _check_runs_like_torch(serialized, names, inputs, expected, output_names):
    outputs = _session_outputs(serialized, names, inputs)
    for name, out, ref in zip(output_names, outputs, expected):
        difference = (torch.from_numpy(out) - ref).abs().max().item()
        if difference > 1e-5 * max(1.0, ref.abs().max().item()):
            raise ExportError(f"the exported inference model's output {name!r} differs from torch by {difference:.3g}")
