"""BatchNorm in training mode, for both front ends: the graph normalizes with the batch statistics
and returns them, and the front end updates the module's running statistics from them as torch's
forward does.

The TorchScript exporter writes a training-mode BatchNorm as one BatchNormalization node
(training_mode=1) whose running-statistics outputs follow ONNX's rule (momentum inverted, the
biased variance), which cannot say torch's `momentum=None` (a cumulative average whose factor
changes on every step). So `BatchStatistics.rewrite` replaces each such node by primitive ops whose
ONNX Runtime gradients exist (the same ones as `_graph.normalization.decompose_instance_normalization`, over all
axes but the channel one) plus two extra graph outputs, the batch mean and the unbiased batch
variance per channel, which take no part in the loss (ORTTrainer's gradient is the loss's alone;
ORTModule's backward gets zeros for them, as for any output the loss leaves out). After each run
that trained in torch's sense (ORTTrainer's training runs, micro-steps included; every ORTModule
call in training mode, with or without gradients), `BatchStatistics.update` applies torch's
update to the model's own buffers:
`num_batches_tracked += 1`, factor = momentum (or 1 / num_batches_tracked when momentum is None),
running = (1 - factor) * running + factor * batch statistic. Eval-mode BatchNorms (and eval
graphs) read the buffers as graph inputs, so they see every update without a copy.
"""
import onnx
import torch

from .._export.running_statistics import RUNNING_BUFFERS, tracked_batch_norms, update_running_statistics
from .._export.trace import graph_name
from .._onnx import inferred_tensors, int64_constant, node_attributes, onnx_opset, set_nodes
from .normalization import channel_affine, element_type, normalized_nodes


def running_statistics(onnx_model: onnx.ModelProto, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{graph name: buffer} of the model's buffers that the BatchNormalization nodes of an exported
    graph read (running statistics, also of BatchNorms in eval mode): graph inputs bound to the
    buffers' memory, so that every graph reads their current values."""
    buffers = {graph_name(name): buffer for name, buffer in model.named_buffers()}
    return {name: buffers[name] for node in onnx_model.graph.node
            if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx")
            for name in node.input[3:5] if name in buffers}


class BatchStatistics:
    """The batch statistics one graph returns, for the BatchNorm modules of `model` in training mode.

    `rewrite(onnx_model)` (in place, once) normalizes their nodes with the batch statistics and
    makes those statistics graph outputs, appended after the others: `outputs`, a (mean, unbiased
    variance) pair per node, in graph order (that of torch's calls: a module called twice has two
    pairs), and `modules`, the module of each pair. `update(tensors)`: torch's running-statistics
    update from a run's outputs (the last `len(outputs)` of them).
    """

    def __init__(self, model):
        self._model = model
        self._tracked = {graph_name(f"{name}.running_mean" if name else "running_mean"): name
                         for name in tracked_batch_norms(model)}
        self.modules, self.outputs, self._described = [], [], []

    def rewrite(self, onnx_model):
        """The rewrite (see the class docstring); the running statistics those nodes read are no
        longer graph inputs or initializers (unless another node reads them). Nodes of
        BatchNorms without tracked statistics (eval mode, track_running_stats=False) stay."""
        opset, tensors, nodes, unread = onnx_opset(onnx_model), None, [], set()
        for node in onnx_model.graph.node:
            module = self._tracked.get(node.input[3]) if _trains(node) and len(node.input) == 5 else None
            if module is None:
                nodes.append(node)
                continue
            if tensors is None:
                tensors = _described(onnx_model)
            x, scale, bias, mean, variance = node.input
            x_type = element_type(tensors, x)
            if x_type != element_type(tensors, scale):
                raise NotImplementedError(f"BatchNorm {module!r} in training mode normalizes a {_type_name(x_type)} "
                                          f"input with {_type_name(element_type(tensors, scale))} parameters (e.g. "
                                          "under autocast); only one element type is supported")
            p = f"{node.output[0]}/batch_norm/"
            nodes += [*normalized_nodes(p, node, [0, 2], x_type, opset),
                      *channel_affine(p, p + "normalized", scale, bias, x, node.output[0]),
                      *_statistics_nodes(p, x_type)]
            channels = tensors[mean][1]
            described = [onnx.helper.make_tensor_value_info(p + name, x_type, channels)
                         for name in ("batch_mean", "batch_variance")]
            onnx_model.graph.output.extend(described)
            self._described += described
            self.modules.append(module)
            self.outputs += [p + "batch_mean", p + "batch_variance"]
            unread.update((mean, variance))
        set_nodes(onnx_model.graph, nodes)
        unread -= {name for node in nodes for name in node.input}
        _remove(onnx_model.graph.input, unread)
        _remove(onnx_model.graph.initializer, unread)

    @classmethod
    def restored(cls, model, modules, outputs):
        """The statistics of a graph rewritten in another process (`modules`, `outputs` as it had them)."""
        statistics = cls(model)
        statistics.modules, statistics.outputs = list(modules), list(outputs)
        return statistics

    def describe(self, onnx_model):
        """Adds the type and shape of the statistics to a graph built from the rewritten one (in
        place), where it lacks them (ORTModule's training graph, where they feed the YieldOp)."""
        known = {value.name for value in (*onnx_model.graph.value_info, *onnx_model.graph.output)}
        onnx_model.graph.value_info.extend(value for value in self._described if value.name not in known)

    def buffers(self):
        """The running-statistics buffers of the modules the graph trains (each once, in order)."""
        modules = [self._model.get_submodule(name) for name in dict.fromkeys(self.modules)]
        return [buffer for module in modules for buffer in (getattr(module, name) for name in RUNNING_BUFFERS)
                if buffer is not None]

    def update(self, tensors):
        """torch's update of the running statistics, in place, from a run's outputs whose last
        `len(outputs)` are the statistics (pairs in call order: a module called twice is updated
        twice, as in torch)."""
        if not self.outputs:
            return
        statistics = tensors[len(tensors) - len(self.outputs):]
        with torch.no_grad():
            for name, mean, variance in zip(self.modules, statistics[0::2], statistics[1::2]):
                update_running_statistics(self._model.get_submodule(name), mean, variance)


def _trains(node):
    return (node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx")
            and node_attributes(node).get("training_mode", 0) == 1)


def _statistics_nodes(p, x_type):
    """Nodes of p + 'batch_mean' and p + 'batch_variance' ([C]) from the [1, C, 1] mean and biased
    variance of `normalized_nodes`: variance * n / (n - 1), n the values per channel."""
    make = onnx.helper.make_node
    return [make("Size", [p + "grouped"], [p + "values"], name=p + "values"),
            make("Size", [p + "mean"], [p + "channels"], name=p + "channels"),
            make("Div", [p + "values", p + "channels"], [p + "count_int"], name=p + "count_int"),
            make("Cast", [p + "count_int"], [p + "count"], name=p + "count", to=x_type),
            make("Constant", [], [p + "one"], name=p + "one",
                 value=onnx.helper.make_tensor(p + "one", x_type, [], [1])),
            make("Sub", [p + "count", p + "one"], [p + "count_minus_one"], name=p + "count_minus_one"),
            make("Mul", [p + "variance", p + "count"], [p + "sum_of_squares"], name=p + "sum_of_squares"),
            make("Div", [p + "sum_of_squares", p + "count_minus_one"], [p + "unbiased"], name=p + "unbiased"),
            int64_constant(p + "vector", [-1]),
            make("Reshape", [p + "mean", p + "vector"], [p + "batch_mean"], name=p + "batch_mean"),
            make("Reshape", [p + "unbiased", p + "vector"], [p + "batch_variance"], name=p + "batch_variance")]


def _described(onnx_model):
    """`_onnx.inferred_tensors`, initializers included (element type, dims)."""
    tensors = inferred_tensors(onnx_model)
    tensors.update((i.name, (i.data_type, tuple(i.dims))) for i in onnx_model.graph.initializer)
    return tensors


def _remove(entries, names):
    kept = [entry for entry in entries if entry.name not in names]
    del entries[:]
    entries.extend(kept)


def _type_name(onnx_type):
    return onnx.TensorProto.DataType.Name(onnx_type).lower()
