"""Before a trace: one probe forward of the model (and loss) in torch, which shows what a graph
could not do right: buffers the forward changes, LayerDrop, model_desc's output shapes; the
refusals that name them. It also finds the custom autograd.Functions on the way to the outputs
(run inside the graph: `_export.autograd_functions`; refused where the user turned that off)."""
import torch

from .._configuration.refusals import TorchModelRefused
from .running_statistics import untracked_changes
from .binding import present_inputs
from .trace import TracedStep, rng_kept


def probe(model, loss_fn, binding, values, output_names):
    """One forward of model + loss as exported, autograd recording, every module in its own
    train/eval state.

    Returns (the declared outputs, names of buffers the forward changed). Binding and output
    errors surface here, before any export. A changed buffer other than BatchNorm running
    statistics (`_export.running_statistics.untracked_changes`) is one no graph writes back: the trainer
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
    outputs, recorded with grad): inlined, their forward would be differentiated instead of their
    backward run (ORTMODULE_DISABLE_CUSTOM_AUTOGRAD_SUPPORT=1 refuses them). The walk stops at the model's
    `inputs`: what computed them (another ORTModule's graph, the caller's Functions) is upstream."""
    found, seen = set(), {tensor.grad_fn for tensor in inputs}
    stack = [tensor.grad_fn for tensor in tensors if tensor.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        # torch's reentrant checkpoint is inlined by the export and recomputed by the graph (`checkpointing`)
        if (isinstance(node, torch.autograd.function.BackwardCFunction)
                and node._forward_cls is not torch.utils.checkpoint.CheckpointFunction):
            found.add(f"{node._forward_cls.__module__}.{node._forward_cls.__qualname__}")
        stack.extend(next_node for next_node, _ in node.next_functions)
    return sorted(found)


def custom_functions_refused(functions, remedy):
    """The error for a model computed through custom autograd.Functions (`custom_functions`),
    ending with what the caller can do about it."""
    return TorchModelRefused(
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
    return TorchModelRefused(f"the model trains with LayerDrop ({where}), which draws in Python on every call "
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
