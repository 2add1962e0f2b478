"""Turn the exported forward+loss model into ONNX Runtime's training and eval graphs."""
import copy

import onnx
from onnxruntime import SessionOptions
from onnxruntime.capi._pybind_state import GradientGraphBuilder, get_optimized_model

# Nodes whose optional second output the gradient builder reads (Dropout's mask,
# SoftmaxCrossEntropyLoss's log_prob); the TorchScript exporter may emit them with one output.
_NODES_NEEDING_SECOND_OUTPUT = ("Dropout", "SoftmaxCrossEntropyLoss")
_QUIET = 3  # ORT severity: errors only
LOSS_SCALE_INPUT = "__loss_scale"


def builder_session_options():
    options = SessionOptions()
    options.log_severity_level = _QUIET
    return options


def add_second_outputs(model):
    """Give Dropout and SoftmaxCrossEntropyLoss their optional second output (in place)."""
    for node in model.graph.node:
        if node.op_type in _NODES_NEEDING_SECOND_OUTPUT and len(node.output) == 1:
            node.output.append(f"{node.output[0]}__second_output")


def _move_parameters_to_inputs(model, parameter_names):
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


def _disable_training_mode(model):
    """Dropout off (no training_mode input), BatchNormalization in inference mode."""
    for node in model.graph.node:
        if node.op_type == "Dropout" and len(node.input) > 2:
            node.input[2] = ""
        if node.op_type == "BatchNormalization":
            for attribute in node.attribute:
                if attribute.name == "training_mode":
                    attribute.i = 0


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


def build_graphs(model, trainable, frozen, output_names, loss_name, loss_scaling=False):
    """Returns (training graph, eval graph) as serialized ONNX models.

    The training graph computes the user outputs and one `<param>_grad` output per trainable
    parameter (of the loss times the LOSS_SCALE_INPUT feed when loss_scaling); the eval graph
    computes the user outputs with dropout off.
    """
    model = copy.deepcopy(model)
    add_second_outputs(model)
    _move_parameters_to_inputs(model, set(trainable) | set(frozen))
    eval_model = copy.deepcopy(model)
    _disable_training_mode(eval_model)
    if loss_scaling:
        loss_name = _scale_loss(model, loss_name)

    options = builder_session_options()
    optimized = get_optimized_model(model.SerializeToString(), set(trainable), options)
    builder = GradientGraphBuilder(optimized, {loss_name}, set(trainable), loss_name, options)
    builder.build()
    training = onnx.load_from_string(builder.get_model())
    outputs = {o.name: o for o in training.graph.output}
    ordered = [outputs[name] for name in output_names] + [outputs[f"{name}_grad"] for name in trainable]
    del training.graph.output[:]
    training.graph.output.extend(ordered)
    return training.SerializeToString(), eval_model.SerializeToString()
