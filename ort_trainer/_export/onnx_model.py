"""An ONNX model as the model (the original ORTTrainer's other input): the loss is in the graph.

`OnnxModule` holds the graph's floating-point initializers as torch parameters named exactly as
the initializers (nested modules mirror dotted names), so the flat buffers, the optimizer,
`state_dict()`, checkpoints and `utils.frozen_weights` work on them as on a torch model. Other
initializers (shapes, indices) stay constants of the graph. `OnnxExports` hands the graph to the
trainer in place of a torch export: initializers renamed to the graph names the torch path uses
(`_export.trace.graph_name`) and turned into graph inputs, input dims set to each batch's shapes.
"""
from typing import NamedTuple

import numpy
import onnx
import onnx.numpy_helper
import torch

from .._configuration.model_desc import InputDescription, ModelDescription
from .._onnx import parameters_as_inputs, rename_initializers
from .binding import BindingError, InputBinding
from .trace import graph_name, with_input_shapes

_INVALID = "Invalid model_desc: "


class OnnxModule(torch.nn.Module):
    """The parameters of an ONNX model; it runs inside ORTTrainer only."""

    def __init__(self, model):
        super().__init__()
        for initializer in model.graph.initializer:
            tensor = torch.from_numpy(onnx.numpy_helper.to_array(initializer).copy())
            owner, leaf = self._owner(initializer.name)
            if tensor.is_floating_point():
                owner.register_parameter(leaf, torch.nn.Parameter(tensor))
            else:
                owner.register_buffer(leaf, tensor)

    def _owner(self, name):
        """(module, attribute) for a dotted initializer name: 'encoder.0.weight' is the parameter
        'weight' of submodule 'encoder.0'."""
        *path, leaf = name.split(".")
        if not leaf or not all(path):
            raise ValueError(f"ONNX model: initializer name {name!r} has an empty part between dots; rename it "
                             "(onnx.ModelProto.graph.initializer[...].name and the node inputs that read it)")
        owner = self
        for part in path:
            child = owner._modules.get(part)
            if child is None:
                if hasattr(owner, part):
                    raise ValueError(f"ONNX model: initializer {name!r} nests under {part!r}, which is also an "
                                     "initializer; rename one of them")
                child = torch.nn.Module()
                owner.add_module(part, child)
            owner = child
        if hasattr(owner, leaf):
            raise ValueError(f"ONNX model: initializer {name!r} is also the prefix of other initializers' names; "
                             "rename one of them")
        return owner, leaf

    def forward(self, *args, **kwargs):
        raise TypeError("an ONNX model given to ORTTrainer runs in the trainer's graphs only; it has no PyTorch "
                        "forward (use trainer.eval_step)")


def _type_of(value_info):
    elem_type = value_info.type.tensor_type.elem_type
    if elem_type == onnx.TensorProto.BFLOAT16:  # NumPy has no bfloat16
        return torch.bfloat16
    return torch.from_numpy(numpy.empty(0, onnx.helper.tensor_dtype_to_np_dtype(elem_type))).dtype


def describe(desc, model, loss_fn):
    """model_desc checked against the graph (every name an input or output of it), with each
    input's dtype taken from the graph where model_desc gives none, as the original did."""
    if loss_fn is not None:
        raise ValueError("loss_fn must be None when the model is an ONNX model: the loss is computed in the graph "
                         "(mark that output is_loss in model_desc)")
    initializers = {i.name for i in model.graph.initializer}
    inputs = {i.name: i for i in model.graph.input if i.name not in initializers}
    outputs = {o.name for o in model.graph.output}
    unknown_inputs = [spec.name for spec in desc.inputs if spec.name not in inputs]
    unknown_outputs = [name for name in desc.output_names if name not in outputs]
    if unknown_inputs or unknown_outputs:
        raise BindingError(_INVALID + f"inputs {unknown_inputs} and outputs {unknown_outputs} are not in the ONNX "
                                      f"graph; its inputs are {sorted(inputs)}, its outputs {sorted(outputs)}")
    missing = [name for name in inputs if name not in desc.input_names]
    if missing:
        raise BindingError(_INVALID + f"the ONNX graph reads inputs {missing} that model_desc does not describe")
    typed = tuple(InputDescription(spec.name, spec.shape, spec.dtype or _type_of(inputs[spec.name]))
                  for spec in desc.inputs)
    return ModelDescription(inputs=typed, outputs=desc.outputs)


def binding(desc):
    """Every model_desc input feeds the graph input of its name."""
    names = tuple(desc.input_names)
    return InputBinding(names=names, positional=names, keyword=(), labels=(), optional=frozenset(),
                        signature=f"({', '.join(names)})")


class Traced(NamedTuple):
    """What `get` gives (here and in `_compile.exports.TrainingExports`): the ONNX model for the
    inputs, and whether it was re-derived from an earlier trace (proven against torch before use)."""

    model: onnx.ModelProto
    unproven: bool


class OnnxExports:
    """`_compile.exports.TrainingExports`' interface over a given graph: nothing to trace or to prove."""

    def __init__(self, model, module):
        self._model, self._module = model, module
        self._template = _with_graph_names(model)

    def check(self, values, desc):
        """Nothing to probe: there is no torch forward (ONNX Runtime checks the inputs' shapes)."""

    def get(self, values, state) -> Traced:
        """The graph at these input shapes (nothing to prove it against)."""
        return Traced(with_input_shapes(self._template, values), unproven=False)

    def with_weights(self, values):
        """The given model with the current weights as its initializers."""
        return with_weights(self._model, self._module)


def _with_graph_names(model):
    """A copy of `model` whose floating-point initializers are graph inputs named as the torch
    path names parameters (`_export.trace.graph_name`), so both paths share everything after the export."""
    model = _copy(model)
    initializers = {i.name for i in model.graph.initializer}
    kept_inputs = [i for i in model.graph.input if i.name not in initializers]  # IR < 4: initializers as inputs
    del model.graph.input[:]
    model.graph.input.extend(kept_inputs)
    renamed = {i.name: graph_name(i.name) for i in model.graph.initializer
               if onnx.helper.tensor_dtype_to_np_dtype(i.data_type).kind == "f"}
    rename_initializers(model, renamed)
    parameters_as_inputs(model, set(renamed.values()))
    return model


def with_weights(model, module):
    """A copy of the given ONNX model whose initializers hold `module`'s current values."""
    model = _copy(model)
    state = module.state_dict()
    for index, initializer in enumerate(model.graph.initializer):
        tensor = state[initializer.name].detach().cpu()
        model.graph.initializer[index].CopyFrom(onnx.numpy_helper.from_array(tensor.numpy(), initializer.name))
    return model


def _copy(model):
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy
