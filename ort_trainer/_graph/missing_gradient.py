"""`MissingGradientError`: an op on the way from the trainable parameters to the loss that ONNX
Runtime cannot differentiate, named with the torch module it came from."""
import re

from .._configuration.refusals import OnnxModelRefused
from .._export.checkpointing import SCOPE as CHECKPOINT_SCOPE
from .._onnx import computed_from, needed_for


class MissingGradientError(OnnxModelRefused):
    """ONNX Runtime has no gradient for an op between the trainable parameters and the loss.

    Raised when the training graph is built (the first step at a new shape). A NotImplementedError:
    the model is valid, ONNX Runtime lacks that op's gradient. `op_type`, `nodes` (the ONNX node
    names) and `modules` (the torch module of each node, see torch_module) say where.
    """

    def __init__(self, op_type, nodes, reason=None):
        self.op_type, self.nodes = op_type, list(nodes)
        self.modules = [torch_module(node) for node in self.nodes]
        where = ", ".join(f"{_describe_module(module)} (ONNX node {node or '<unnamed>'})"
                          for node, module in zip(self.nodes, self.modules))
        where = where or "the model (ONNX Runtime did not say where)"
        said = f" ({reason.rstrip('.')})" if reason else ""
        super().__init__(
            f"ONNX Runtime has no gradient for {op_type}{said}, used by {where} between the trainable "
            "parameters and the loss. Compute that part outside the trained graph (e.g. in the data pipeline), "
            "freeze the parameters that feed it, or write it with ops that have gradients; if you need it as "
            "it is, report it to the ort-trainer maintainers with this message.")


def torch_module(node_name):
    """The torch module an exported node came from: its qualified name ('' for the model's own
    forward()), or None for nodes outside the model (loss_fn) or without a name.

    The exporter names nodes after the module scopes, each scope the module's name in its parent
    container: '/model/backbone/layers/layers.0/norm/InstanceNormalization' is module
    'backbone.layers.0.norm' ('model' is the attribute that holds the user's model in the
    exported wrapper). A ModuleDict's entries appear under their key alone, and a module's later
    calls as '<name>_1', '<name>_2', ... (indistinguishable from modules so named). The scopes of
    checkpointed segments (`_export.checkpointing`) are no modules.
    """
    scopes = [scope for scope in node_name.strip("/").split("/")[:-1] if not scope.startswith(CHECKPOINT_SCOPE)]
    if not scopes or scopes[0] != "model":
        return None
    path = []
    for scope in scopes[1:]:
        if path and scope.startswith(path[-1] + "."):  # a Sequential's child: 'layers' then 'layers.0'
            path[-1] = scope
        else:
            path.append(scope)
    return ".".join(path)


def _describe_module(module):
    if module is None:
        return "loss_fn (outside the model)"
    if not module:
        return "the model's own forward()"
    first_call = re.sub(r"_\d+(?=\.|$)", "", module)
    if first_call != module:  # the exporter suffixes a module's later calls: 'pad', 'pad_1', ...
        return f"module {module!r} or a repeated call of module {first_call!r}"
    return f"module {module!r}"


_NOT_REGISTERED = re.compile(r"The gradient builder has not been registered: (\w+) for node (\S*)")


_UNSUPPORTED_CASE = re.compile(r"Get(\w+)Gradient::GetGradientDefsImpl\(\) const (.+)")


def missing_gradient(message, model, trainable, targets):
    """The MissingGradientError for a failure `message` of the gradient builder (gradients of the
    tensors `targets`), or None for other failures.

    ORT names the node when the op has no gradient at all; when only some of its cases lack one
    (Pad other than constant mode, Pow's exponent) it names the op alone, so every node of that
    type on a path from a trainable parameter to the loss is named.
    """
    found = _NOT_REGISTERED.search(message)
    if found:
        return MissingGradientError(found.group(1), [found.group(2)])
    found = _UNSUPPORTED_CASE.search(message)
    if not found:
        return None
    op_type = found.group(1)
    from_parameters = computed_from(model, trainable)
    into_loss = needed_for(model, targets)
    nodes = [node.name for node in model.graph.node if node.op_type == op_type
             and from_parameters.intersection(node.input) and into_loss.intersection(node.output)]
    return MissingGradientError(op_type, nodes, found.group(2).strip())


