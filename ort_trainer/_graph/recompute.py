"""Recomputation, the `graph_transformer` recompute options: forward values the backward reads are
computed again in the backward instead of being kept from the forward, trading compute for memory,
as the original ORTTrainer's GeluRecompute, AttentionDropoutRecompute and TransformerLayerRecompute
transformers did.

Two steps around ONNX Runtime's gradient builder (`_graph.trainer_graph_builder.build_graphs`):

1. `Recompute.add_nodes`, on the optimized forward: each recomputed node gets a copy
   `<node>_recompute` that computes `<output>_recompute` for each output. ORT's gradient builder
   reads a tensor's `_recompute` version wherever one exists, so the backward no longer reads the
   forward's, which is freed once the forward is done with it. A Dropout in training mode is
   recomputed as DropoutGrad(input, mask): its mask applied again, the same values.
2. `Recompute.schedule`, on the training graph: nothing would stop ONNX Runtime from running a copy
   as soon as its inputs exist, in the forward, which would keep it as long as the original. Each
   group of copies (a Gelu, a Dropout, a layer) is moved before the first backward node that reads
   it and waits, through a PassThrough of its first input together with the output of the backward
   node before that one, until the backward gets there. The sessions run in PRIORITY_BASED order
   (`_runtime.session_config`), as the original's did with recomputation.

ONNX Runtime 1.19's own recompute pass (its MemoryOptimizer, `optimization.memory_optimizer_config`)
does not apply here: it splits forward from backward at a YieldOp, which only ORTModule's graphs
have; the trainer runs forward and backward as one graph in one run.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable

import onnx
import torch

from .._configuration.options import recomputes
from .._export.checkpointing import segment_of
from .._onnx import constant_values, set_nodes, torch_node_operator, torch_node_params_of
from .._torch_node_catalogue import draws_random_numbers
from .missing_gradient import torch_module

_SUFFIX = "_recompute"
_MS_DOMAIN = "com.microsoft"
# What ORT's graph optimizations make of torch's GELU (exact, tanh, with the bias folded in).
_GELUS = {"Gelu", "BiasGelu", "FastGelu", "QuickGelu"}
# Left to the forward in a recomputed layer: constants (nothing to save) and random ops (a copy
# would draw other numbers); their recomputed consumers read the forward's outputs.
_KEPT = {"Constant", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
         "Bernoulli"}
_RANDOM_CONTRIB = {"BitmaskDropout", "BiasDropout", "BitmaskBiasDropout"}  # ONNX Runtime's fused dropouts: kept


def _is_onnx(node):
    return node.domain in ("", "ai.onnx")


def _kept(node):
    """Whether `node` is left to the forward: a constant, a random op, a torch node that draws
    random numbers (multinomial, RReLU's slopes, a recurrent layer's dropout)."""
    return (node.op_type in _KEPT or node.op_type in _RANDOM_CONTRIB
            or draws_random_numbers(torch_node_operator(node), torch_node_params_of(node)))


def layer_stack(model):
    """Qualified name and length of the model's longest nn.ModuleList or nn.Sequential whose children
    are all of one class (at least two): its transformer layers, or None."""
    stacks = [(len(module), name) for name, module in model.named_modules()
              if isinstance(module, torch.nn.ModuleList | torch.nn.Sequential) and len(module) > 1
              and len({type(child) for child in module}) == 1]
    if not stacks:
        return None
    length, name = max(stacks, key=lambda stack: stack[0])
    return name, length


class Recompute:
    """What the recompute options ask for, for one model: `from_options` reads them (None: off)."""

    def __init__(self, gelu, attention_dropout, layers):
        """layers: (stack name, number of its first layers to recompute), or None."""
        self._gelu, self._attention_dropout, self._layers = gelu, attention_dropout, layers

    @classmethod
    def from_options(cls, graph_transformer, model):
        """The Recompute for `options.graph_transformer` and the torch `model`, or None when no
        recompute option is on.

        Raises:
            ValueError: transformer_layer_recompute is on and the model has no stack of layers.
        """
        if not recomputes(graph_transformer):
            return None
        layers = None
        if graph_transformer.transformer_layer_recompute:
            stack = layer_stack(model)
            if stack is None:
                raise ValueError(
                    "Invalid options: graph_transformer.transformer_layer_recompute=True, but the model has no stack "
                    "of layers to recompute (an nn.ModuleList or nn.Sequential of at least 2 modules of one class)")
            name, length = stack
            count = graph_transformer.number_recompute_layers or length - 1
            if count > length - 1:
                warnings.warn(f"graph_transformer.number_recompute_layers={count}: {name} has {length} layers and "
                              f"the last one is never recomputed; recomputing the first {length - 1}")
                count = length - 1
            layers = (name, count)
        return cls(graph_transformer.gelu_recompute, graph_transformer.attn_dropout_recompute, layers)

    # ------------------------------------------------------------------ before the gradient
    def add_nodes(self, serialized):
        """(the optimized forward (bytes) with the recompute copies added, as bytes; the plan
        `schedule` needs: the forward's node names and the copies' names, group by group)."""
        model = onnx.load_from_string(serialized)
        nodes = list(model.graph.node)
        forward = {node.name for node in nodes}
        producers = {output: node for node in nodes for output in node.output if output}
        readers = {}
        for node in nodes:
            for name in node.input:
                readers.setdefault(name, []).append(node)
        constants = constant_values(model)
        modes = {id(node): _dropout_mode(node, constants) for node in nodes
                 if node.op_type == "Dropout" and _is_onnx(node)}
        groups = self._groups(nodes, producers, modes, {o.name for o in model.graph.output})
        taken = {id(node) for group in groups for node in group}
        found = {"gelu_recompute": 0, "attn_dropout_recompute": 0}
        for node in nodes:
            if self._gelu and node.domain == _MS_DOMAIN and node.op_type in _GELUS:
                kind = "gelu_recompute"
            elif (self._attention_dropout and modes.get(id(node)) is not None
                  and getattr(producers.get(node.input[0]), "op_type", None) == "Softmax"):
                kind = "attn_dropout_recompute"
            else:
                continue
            found[kind] += 1
            if id(node) not in taken:
                groups.append([node, *_casts_after(node, readers)])
        for kind, asked, what in (("gelu_recompute", self._gelu, "Gelu"),
                                  ("attn_dropout_recompute", self._attention_dropout, "Dropout after a Softmax")):
            if asked and not found[kind]:
                warnings.warn(f"graph_transformer.{kind}=True: the model has no {what}, nothing to recompute")
        copies = [_copies(group, modes) for group in groups]
        for group in copies:
            model.graph.node.extend(group)
        copied = {output for group in groups for node in group for output in node.output if output}
        for info in [*model.graph.value_info, *model.graph.output]:  # torch nodes' copies get no inferred type
            if info.name in copied:
                model.graph.value_info.add().CopyFrom(info)
                model.graph.value_info[-1].name = _recomputed(info.name)
        return model.SerializeToString(), (forward, [{copy.name for copy in group} for group in copies])

    def _groups(self, nodes, producers, modes, graph_outputs):
        """The nodes of each recomputed checkpointed segment (`_export.checkpointing`: recomputed
        whatever the options) and, with transformer_layer_recompute, of each recomputed layer, in
        graph order (the graph is topologically sorted).

        A node belongs to layer i of the stack when the exporter named it inside module
        `<stack>.<i>`; a node ORT's optimizations renamed ('Gelu_token_3') to the layer (segment)
        all the nodes it reads from belong to. A layer's (segment's) outputs (what later layers
        and the loss read) are not recomputed: the next layer's backward reads them anyway, and
        copies of them would have to run as soon as that backward starts.
        """
        stack, count = self._layers or (None, 0)
        layer_of = {}
        for node in nodes:
            segment = segment_of(node.name)
            layer = ("segment", segment) if segment is not None else (
                None if stack is None else _scope_layer(torch_module(node.name), stack))
            if layer is None:
                sources = {layer_of.get(id(producers[name])) for name in node.input if name in producers}
                layer = sources.pop() if len(sources) == 1 else None
            if layer is not None:
                layer_of[id(node)] = layer
        read_by = {name: {None} for name in graph_outputs}  # layer of each reader (None: outside the stack)
        for node in nodes:
            for name in node.input:
                read_by.setdefault(name, set()).add(layer_of.get(id(node)))

        def recomputed(node, layer):
            return (layer_of.get(id(node)) == layer and not _kept(node) and modes.get(id(node), False) is not None
                    and all(read_by.get(output, set()) <= {layer} for output in node.output if output))

        segments = sorted({layer for layer in layer_of.values() if isinstance(layer, tuple)})
        groups = [[node for node in nodes if recomputed(node, layer)] for layer in [*segments, *range(count)]]
        return [group for group in groups if group]

    # ------------------------------------------------------------------ after the gradient
    @staticmethod
    def schedule(training, plan):
        """Moves each group of copies (`plan`, from `add_nodes`) before its first backward reader
        and makes it wait for the backward node before that one (in place); copies nothing reads
        are dropped."""
        forward, groups = plan
        copies = {name for group in groups for name in group}
        _drop_unread(training, copies)
        nodes = list(training.graph.node)
        readers = {}
        for index, node in enumerate(nodes):
            for name in node.input:
                readers.setdefault(name, []).append(index)
        is_backward = [node.name not in forward and node.name not in copies for node in nodes]
        moves = {}  # index of the first backward reader -> nodes to put before it
        moved = set()
        for group in groups:
            members = [node for node in nodes if node.name in group]
            if not members:
                continue
            outputs = {output for node in members for output in node.output}
            first = min((index for output in outputs for index in readers.get(output, ())
                         if is_backward[index]), default=None)
            if first is None:
                continue
            # the group waits for the backward node just before its first reader (which cannot read the group)
            previous = max((index for index in range(first) if is_backward[index]), default=None)
            if previous is None:
                continue
            moves.setdefault(first, []).extend(_delayed(members, outputs, nodes[previous].output[0]))
            moved.update(id(node) for node in members)
        ordered = []
        for index, node in enumerate(nodes):
            ordered.extend(moves.get(index, ()))
            if id(node) not in moved:
                ordered.append(node)
        set_nodes(training.graph, ordered)
        if moves and not any(o.domain == _MS_DOMAIN for o in training.opset_import):
            training.opset_import.append(onnx.helper.make_opsetid(_MS_DOMAIN, 1))


def module_groups(model: torch.nn.Module, layers: bool) -> Callable[[str], tuple[str, int] | None]:
    """`recompute_in_backward`'s groups for ORTModule: a node's checkpointed segment
    (`_export.checkpointing`), else, with `layers` (ORTMODULE_MEMORY_OPT_LEVEL=1), its layer in
    the model's stack of layers (`layer_stack`) but the last one, as ORTTrainer's
    transformer_layer_recompute. A model without a stack gets a warning and its segments only."""
    stack = layer_stack(model) if layers else None
    if layers and stack is None:
        warnings.warn(f"ORTMODULE_MEMORY_OPT_LEVEL=1: {type(model).__name__} has no stack of layers to recompute (an "
                      "nn.ModuleList or nn.Sequential of at least 2 modules of one class); nothing is recomputed "
                      "but its torch.utils.checkpoint segments")

    def group_of(name):
        segment = segment_of(name)
        if segment is not None or stack is None:
            return None if segment is None else ("segment", segment)
        layer = _scope_layer(torch_module(name), stack[0])
        return None if layer is None or layer >= stack[1] - 1 else ("layer", layer)
    return group_of


def has_copies(model: onnx.ModelProto) -> bool:
    """Whether `model` (an ONNX model) computes recompute copies: its sessions run in PRIORITY_BASED
    order, which `Recompute.schedule` orders them for."""
    return any(node.name.endswith(_SUFFIX) for node in model.graph.node)


def recompute_in_backward(training, forward, group_of):
    """ORTModule's training graph (forward, YieldOp, backward: `_graph.module_graph_builder`), in place:
    the forward nodes `group_of(node name)` puts in a group (a checkpointed segment, a layer) get
    copies, and the backward reads the copies instead of the forward's tensors, which the forward
    frees once done with them. Returns the number of copies kept.

    ONNX Runtime's builder differentiates first here, so the copies come after it, unlike
    `Recompute.add_nodes`: the builder's nodes are rewired to them. `forward`: the names of the
    builder's forward nodes. A node ONNX Runtime's fusions renamed (no '/' in its name:
    'Gelu_token_2') is in the group of all the nodes it reads from. A group's outputs that forward
    nodes outside it (or the outputs) read are kept, as torch's checkpoint keeps a segment's
    inputs and outputs; Dropout is recomputed from its mask (`_copies`), other random ops are kept.
    """
    nodes = list(training.graph.node)
    yield_node = next(node for node in nodes if node.op_type == "YieldOp")
    backward = set(yield_node.output)
    for node in nodes:
        if backward.intersection(node.input):
            backward.update(node.output)
    is_backward = {id(node): bool(backward.intersection(node.input)) for node in nodes}
    forward_nodes = [node for node in nodes if node.name in forward]
    producers = {output: node for node in forward_nodes for output in node.output if output}
    group = {}
    for node in forward_nodes:
        key = group_of(node.name)
        if key is None and "/" not in node.name:
            sources = {group.get(id(producers[name])) for name in node.input if name in producers}
            key = sources.pop() if len(sources) == 1 else None
        if key is not None:
            group[id(node)] = key
    read_by = {name: {None} for name in [*yield_node.input, *(o.name for o in training.graph.output)]}
    for node in forward_nodes:
        for name in node.input:
            read_by.setdefault(name, set()).add(group.get(id(node)))
    constants = constant_values(training)
    modes = {id(node): _dropout_mode(node, constants) for node in forward_nodes
             if node.op_type == "Dropout" and _is_onnx(node)}
    groups = {}
    for node in forward_nodes:
        key = group.get(id(node))
        if (key is not None and not _kept(node) and modes.get(id(node), False) is not None
                and all(read_by.get(output, set()) <= {key} for output in node.output if output)):
            groups.setdefault(key, []).append(node)
    if not groups:
        return 0
    copies = [_copies(members, modes) for members in groups.values()]
    recomputed = {output[:-len(_SUFFIX)]: index for index, group in enumerate(copies) for node in group
                  for output in node.output}
    followers = [[] for _ in copies]
    followed = {}  # output of a follower -> its group
    for node in nodes:
        if node.name in forward or node is yield_node:
            continue
        reads = [recomputed[name] for name in node.input if name in recomputed]
        node.input[:] = [_recomputed(name) if name in recomputed else name for name in node.input]
        reads += [followed[name] for name in node.input if name in followed]
        if reads and not is_backward[id(node)]:
            # a builder node that needs no gradient (the Reshape of a MatMul's input for its weight's
            # gradient): it would run in the forward and keep what it reads; it runs after the copies
            followers[reads[0]].append(node)
            followed.update((output, reads[0]) for output in node.output)
    moved = {node.name for group in followers for node in group}
    set_nodes(training.graph, [node for node in nodes if node.name not in moved])
    for group, follow in zip(copies, followers):  # in order: the copies, then what reads them
        training.graph.node.extend([*group, *follow])
    for info in list(training.graph.value_info):  # torch nodes' copies get no inferred type
        if info.name in recomputed:
            training.graph.value_info.add().CopyFrom(info)
            training.graph.value_info[-1].name = _recomputed(info.name)
    before_backward = {node.name for node in nodes
                       if not is_backward[id(node)] and node is not yield_node and node.name not in moved}
    Recompute.schedule(training, (before_backward, [{node.name for node in [*group, *follow]}
                                                    for group, follow in zip(copies, followers)]))
    kept = {copy.name for group in copies for copy in group}
    return sum(node.name in kept for node in training.graph.node)


def _scope_layer(module, stack):
    """The index of the layer of `stack` that `module` (a qualified module name) lies in, or None."""
    if module is None or not module.startswith(stack + "."):
        return None
    child = module[len(stack) + 1:].split(".")[0]
    return int(child) if child.isdigit() else None


def _recomputed(name):
    return name + _SUFFIX if name else name


def _dropout_mode(node, constants):
    """True for a Dropout in training mode (a random mask), False in inference mode (the identity),
    None when its training_mode is computed at run time (then it is not recomputed)."""
    if len(node.input) < 3 or not node.input[2]:
        return False
    value = constants.get(node.input[2])
    return None if value is None else bool(value)


def _casts_after(node, readers):
    """The Casts that read `node`'s output, and the Casts that read theirs (mixed precision's round
    trips, `_graph.autocast`): recomputed with the node, since the backward reads the last cast."""
    casts, frontier = [], [node]
    while frontier:
        frontier = [reader for source in frontier for output in source.output if output
                    for reader in readers.get(output, ()) if reader.op_type == "Cast"]
        casts += frontier
    return casts


def _copies(group, modes):
    """The recompute copies of a group of forward nodes (in order): each reads the copies' outputs
    where the group computes an input, the forward's tensors elsewhere. `modes`: `_dropout_mode`
    of each Dropout (by id)."""
    inside = {output for node in group for output in node.output if output}
    copies = []
    for node in group:
        inputs = [_recomputed(name) if name in inside else name for name in node.input]
        name = _recomputed(node.name or node.output[0])
        if modes.get(id(node)):
            # DropoutGrad(x, mask, ratio) = x * mask / (1 - ratio): the forward's mask again. (It
            # scales whatever its training_mode, so an inference-mode Dropout is copied as it is.)
            copies.append(onnx.helper.make_node("DropoutGrad", [inputs[0], node.output[1], *node.input[1:]],
                                                [_recomputed(node.output[0])], name=name, domain=_MS_DOMAIN))
            continue
        copy = onnx.helper.make_node(node.op_type, inputs, [_recomputed(output) for output in node.output],
                                     name=name, domain=node.domain)
        copy.attribute.extend(node.attribute)
        copies.append(copy)
    return copies


def _drop_unread(model, names):
    """Removes the nodes named in `names` whose outputs nothing reads (in place, until none is left)."""
    while True:
        read = {name for node in model.graph.node for name in node.input} | {o.name for o in model.graph.output}
        kept = [node for node in model.graph.node
                if node.name not in names or any(output in read for output in node.output if output)]
        if len(kept) == len(model.graph.node):
            return
        set_nodes(model.graph, kept)


def _delayed(members, outputs, gradient):
    """`members` (one group's copies, in order), each copy that reads no other copy reading its first
    input through a PassThrough that also takes `gradient`, so that it cannot start before it."""
    nodes = []
    for node in members:
        first = next((index for index, name in enumerate(node.input) if name), None)
        if first is not None and not outputs.intersection(node.input):
            nodes.append(onnx.helper.make_node(
                "PassThrough", [node.input[first], gradient],
                [f"{node.name}/waits_for_gradient", f"{node.name}/gradient"], name=f"{node.name}/wait",
                domain=_MS_DOMAIN))
            node.input[first] = f"{node.name}/waits_for_gradient"
        nodes.append(node)
    return nodes
