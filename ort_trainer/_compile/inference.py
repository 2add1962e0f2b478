"""`export_onnx`'s inference model: the model alone in eval mode, its dynamic axes proven with ONNX
Runtime against torch (dims the exporter baked in made static)."""
import torch

from .._configuration.refusals import ONNX_RUNTIME_ERRORS, device_failure
from .._export.binding import training_flags_kept
from .._export.trace import ExportError, TracedStep, export_eval_model


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
                serialized = export_eval_model(wrapper, names, output_names, sample, specs, dims - baked, opset_version)
                _check_runs_like_torch(serialized, names, sample, expected, output_names)
                failing = {dim for dim in dims - baked
                           if not _runs_like_torch(serialized, names, probes[dim], expected_probes[dim])}
                if not failing:
                    return serialized, sorted(baked)
                baked |= failing


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
    """Whether the model computes what torch does on `inputs`; False where ONNX Runtime fails on them
    (a dim the exporter baked in). Other errors (the device failing too) propagate."""
    try:
        outputs = _session_outputs(serialized, names, inputs)
    except ONNX_RUNTIME_ERRORS as error:
        if device_failure(error):
            raise
        return False
    return all(torch.allclose(out, ref.cpu(), rtol=1e-4, atol=1e-5) for out, ref in zip(outputs, expected))


def _check_runs_like_torch(serialized, names, inputs, expected, output_names):
    outputs = _session_outputs(serialized, names, inputs)
    for name, out, ref in zip(output_names, outputs, expected):
        difference = (out - ref.cpu()).abs().max().item()
        if difference > 1e-5 * max(1.0, ref.abs().max().item()):
            raise ExportError(f"the exported inference model's output {name!r} differs from torch by {difference:.3g}")
