"""Embedding sparsity (ORTTrainer's `graph_transformer.embedding_sparsity`, ORTModule's
ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER): the per-token layers after an embedding with a
padding_idx run on the rows whose token is not padding, plus one row standing for every padded one.

Why: dynamically padded batches leave 20-60% of positions empty, and eager PyTorch computes every
one. Exact, where the rewrite applies: every padded position looks up the same row (padding_idx),
and a per-token op whose other inputs are the same for every token (weights, constants) maps equal
rows to equal rows, so the padded positions all hold one value, computed once. Where a tensor is
needed in its dense form (an op that mixes positions, adds a per-position tensor, draws random
numbers, or an output), a Gather puts each position's row back (the padded ones read the shared
row). ONNX Runtime's gradient builder differentiates both Gathers: the shared row's gradient is the
sum of the padded positions' gradients, which is what the dense graph sums into the weights.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import onnx

from .._onnx import (MARKER_DOMAIN, inferred_tensors, int64_constant, node_attributes, set_nodes,
                     torch_node_operator)
from .input_density import input_behind
from .label_sparsity import kept_positions

# Ops computing each element from the same element of their inputs (broadcast along the last axis).
_ELEMENTWISE = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Where", "Equal", "Less", "Greater", "And", "Or", "Not",
    "Cast", "Identity", "Relu", "Tanh", "Sigmoid", "Erf", "Sqrt", "Exp", "Log", "Neg", "Abs", "Reciprocal",
    "Softplus", "Gelu", "LeakyRelu", "Elu", "Selu", "HardSigmoid", "Clip", "Floor", "Ceil", "Sin", "Cos"})
# Ops over the last axis alone (attribute -> its default): LayerNorm, softmax, reductions keeping dims.
_LAST_AXIS = {"LayerNormalization": ("axis", -1), "Softmax": ("axis", -1), "LogSoftmax": ("axis", -1),
              **{op: ("axes", None) for op in ("ReduceMean", "ReduceMax", "ReduceMin", "ReduceL2", "ReduceProd",
                                               "ReduceLogSumExp", "ReduceSumSquare")}}
# What makes rows worth gathering: the region computes one of these.
_WORTH = frozenset({"MatMul", "Gemm", "LayerNormalization", "ReduceMean"})


@dataclass(frozen=True)
class Outcome:
    """What became of one embedding: `sparse` (its per-token layers run on the kept rows), `nodes`
    (how many), `dense` (why the dense form is needed where it is: op names, or the reason nothing
    was rewritten)."""

    weight: str
    indices: str
    padding_idx: int
    sparse: bool
    nodes: int
    dense: tuple

    def describe(self):
        """One line for the density report."""
        name = f"embedding {self.weight} (indices {self.indices}, padding_idx {self.padding_idx})"
        if self.sparse:
            return f"{name}: {self.nodes} per-token nodes run on the non-padding rows; dense again for " \
                   + ", ".join(self.dense)
        return f"{name} stayed dense: " + ", ".join(self.dense)


def drop_padding_rows(model: onnx.ModelProto, weights: Collection[str]) -> list[Outcome]:
    """Rewrites the exported forward `model` (in place; its `ort_trainer::PaddingRows` markers still
    there, its weights graph inputs named in `weights`) so that the per-token nodes after each
    marked embedding compute the kept rows (see the module docstring). Returns an Outcome per
    marker."""
    markers = [node.output[0] for node in model.graph.node
               if node.domain == MARKER_DOMAIN and node.op_type == "PaddingRows"]
    outcomes = []
    for name in markers:
        tensors = _tensors(model, name)
        marker = next(node for node in model.graph.node if node.output[0] == name)
        region = _region(model, marker, weights, tensors)
        producers = {output: node for node in model.graph.node for output in node.output}
        weight = producers[marker.input[0]].input[0]
        inputs = {value.name for value in model.graph.input}
        indices = input_behind(marker.input[1], producers, inputs) or marker.input[1]
        padding_idx = node_attributes(marker)["padding_idx"]
        worth = any(node.op_type in _WORTH for node in region.nodes)
        if worth:
            _rewrite(model, marker, region, tensors)
        elif region.nodes:
            region.dense.append("no product or normalization before them to gather the rows for")
        outcomes.append(Outcome(weight, indices, padding_idx, worth, len(region.nodes), tuple(region.dense)))
    return outcomes


def _tensors(model, marker):
    """{name: (element type, dims)} of `model`, the `marker` output's declared first (its lookup's:
    an export without fixed shapes leaves it undeclared, and the inference cannot see through it).
    (The inference replaces the graph's nodes: find them after.)"""
    tensors = inferred_tensors(model)
    lookup = next(node.input[0] for node in model.graph.node if node.output[0] == marker)
    if tensors.get(marker, (None, None))[1] is None and tensors.get(lookup, (None, None))[1] is not None:
        elem_type, dims = tensors[lookup]
        model.graph.value_info.append(onnx.helper.make_tensor_value_info(marker, elem_type, dims))
        tensors = inferred_tensors(model)
    tensors.update({t.name: (t.data_type, tuple(t.dims)) for t in model.graph.initializer})
    return tensors


@dataclass
class _Region:
    nodes: list  # the per-token nodes, in graph order
    sparse: dict  # dense tensor name -> whether its dense form is flat ([positions, width])
    densified: set  # the tensors of the region needed dense
    dense: list  # why, per op (no repeats)
    reasons: dict = field(default_factory=dict)  # node (its first output) -> why it reads the dense form


def _region(model, marker, weights, tensors):
    """The nodes after `marker` that can compute the kept rows: each reads a tensor of the region,
    its other inputs are the same for every token, and it computes per token."""
    graph = model.graph
    variant = {value.name for value in graph.input if value.name not in weights}
    ids = _dims(tensors, marker.input[1])
    if ids is None:
        return _Region([], {}, set(), ["the indices' shape is not known"])
    region = _Region([], {marker.output[0]: len(ids) == 1}, set(), [])
    started = False
    for node in graph.node:
        if node.output[0] == marker.output[0]:
            started = True
            continue
        read = [name for name in node.input if name in region.sparse]
        if not started or not read:
            if any(name in variant for name in node.input):
                variant.update(node.output)
            continue
        reason = _not_per_token(node, read, region.sparse, variant, tensors)
        if reason is None:
            region.nodes.append(node)
            flat = region.sparse[read[0]] or node.op_type == "Reshape"
            region.sparse.update((name, flat) for name in node.output if name)
        else:
            region.densified.update(read)
            variant.update(node.output)
            region.reasons[node.output[0]] = reason
    outputs = {value.name for value in graph.output}
    region.densified.update(name for name in region.sparse if name in outputs)
    _trim(region, tensors)
    region.dense = list(dict.fromkeys(region.reasons[node.output[0]] for node in graph.node
                                      if node.output[0] in region.reasons
                                      and any(name in region.densified for name in node.input)))
    if any(name in outputs for name in region.sparse):
        region.dense.append("a graph output")
    return region


def _trim(region, tensors):
    """Gives the region's last nodes back to the dense graph where the dense rows are cheaper to
    remake before them: walking back from each tensor needed dense through nodes with one sparse
    input, the rows are remade at the narrowest tensor (the latest of equal ones; one remade anyway
    costs nothing). The Gather that
    remakes rows, and its gradient's scatter, cost per value: a vocabulary head's product widens
    each row from its width to the vocabulary."""
    def width(name):
        dims = _dims(tensors, name)
        return dims[-1] if dims and isinstance(dims[-1], int) else None

    for end in sorted(region.densified):
        producers = {name: node for node in region.nodes for name in node.output if name}
        readers = {}
        for node in region.nodes:
            for name in node.input:
                readers.setdefault(name, []).append(node)
        if readers.get(end) or width(end) is None:
            continue  # computed sparse for the region's own readers anyway
        path, names, cut, narrowest = [], [end], 0, width(end)
        while names[-1] in producers:
            node = producers[names[-1]]
            inputs = [name for name in node.input if name in region.sparse]
            if len(inputs) != 1 or width(inputs[0]) is None or any(
                    readers.get(other) for other in node.output if other and other != names[-1]):
                break
            path.append(node)
            names.append(inputs[0])
            cost = 0 if inputs[0] in region.densified else width(inputs[0])  # remade already: free
            if cost < narrowest:
                cut, narrowest = len(path), cost
            if len(readers[inputs[0]]) > 1 or inputs[0] in region.densified:
                break
        for node in path[:cut]:
            region.nodes.remove(node)
            for output in node.output:
                region.sparse.pop(output, None)
                region.densified.discard(output)
            region.reasons[node.output[0]] = f"{node.op_type} (fewer values to remake before it)"
        if cut:
            region.densified.add(names[cut])


def _not_per_token(node, read, sparse, variant, tensors):
    """None when `node` computes per token from the sparse tensors `read`, else why not."""
    op = node.op_type
    if node.domain not in ("", "ai.onnx"):  # a torch node by its operator (label sparsity's projection)
        return f"{torch_node_operator(node) or op} ({node.domain})"
    if op == "Dropout":
        return "Dropout (each padded position draws its own mask)"
    if op not in _ELEMENTWISE and op not in _LAST_AXIS and op not in ("MatMul", "Gemm", "Reshape"):
        return f"{op} (not per token)"
    if len({sparse[name] for name in read}) > 1:
        return f"{op} (its inputs differ in rank)"
    dims = _dims(tensors, read[0])
    others = [name for name in node.input if name and name not in sparse]
    if dims is None or any(_dims(tensors, name) is None for name in node.output if name):
        return f"{op} (shapes not known)"
    if op != "Reshape" and any(len(_dims(tensors, name)) != len(dims) for name in node.output if name):
        return f"{op} (it changes the rank)"
    if op in ("MatMul", "Gemm"):  # by a weight matrix (and Gemm's bias per column)
        bias = len(_dims(tensors, node.input[2]) or (0, 0)) <= 1 if len(node.input) > 2 else True
        if read == [node.input[0]] and len(_dims(tensors, node.input[1]) or ()) == 2 and bias and not (
                op == "Gemm" and node_attributes(node).get("transA", 0)):
            return None
        return f"{op} (of positions)"
    if op == "Reshape":
        after = _dims(tensors, node.output[0])
        if (node.input[0] in sparse and not sparse[read[0]] and len(after) == 2 and isinstance(dims[-1], int)
                and after[-1] == dims[-1]):
            return None  # flattened to [positions, width]: rows stay rows
        return "Reshape (not per token)"
    if any(name in variant for name in others):
        return f"{op} (another input differs by position)"
    if any(_dims(tensors, name) is None or len(_dims(tensors, name)) > 1 for name in others):
        return f"{op} (another input differs by position)"
    if op in _LAST_AXIS and not _last_axis(node, len(dims)):
        return f"{op} (not over the last axis)"
    return None


def _last_axis(node, rank):
    name, default = _LAST_AXIS[node.op_type]
    value = node_attributes(node).get(name, default)
    axes = [value] if isinstance(value, int) else list(value) if value is not None else None
    return axes is not None and len(axes) == 1 and axes[0] in (-1, rank - 1) and node_attributes(node).get(
        "keepdims", 1)


def _dims(tensors, name):
    return (tensors.get(name) or (None, None))[1]


def _rewrite(model, marker, region, tensors):
    """The marker's lookup reads the kept indices; the region's nodes read and write the sparse
    names (`<name>/sparse`); a Gather by `position_rows` remakes each tensor needed dense."""
    make, p = onnx.helper.make_node, f"{marker.output[0]}/embedding_sparsity/"
    graph, ids = model.graph, marker.input[1]
    lookup = next(node for node in graph.node if node.output[0] == marker.input[0])
    rows_dim = p + "rows"

    def sparse_name(name):
        return f"{name}/sparse"

    index_nodes = [
        int64_constant(p + "all", [-1]),
        make("Reshape", [ids, p + "all"], [p + "flat_ids"]),
        *kept_positions(p + "flat_ids", node_attributes(marker)["padding_idx"], p),
        # the shared padded row, where there is padding: the first padded position's
        make("Cast", [p + "empty"], [p + "padded32"], to=onnx.TensorProto.INT32),
        make("ArgMax", [p + "padded32"], [p + "first_padded"], axis=0, keepdims=1),
        make("Concat", [p + "kept_rows", p + "first_padded"], [p + "kept_then_first_padded"], axis=0),
        make("Shape", [p + "kept_rows"], [p + "kept_count"]),
        make("ReduceMax", [p + "padded32"], [p + "any_padded32"], keepdims=1),
        make("Cast", [p + "any_padded32"], [p + "any_padded"], to=onnx.TensorProto.INT64),
        make("Add", [p + "kept_count", p + "any_padded"], [p + "row_count"]),
        int64_constant(p + "start", [0]),
        make("Slice", [p + "kept_then_first_padded", p + "start", p + "row_count"], [rows_dim]),
        # each position's row: its place among the kept rows, or the shared row (after them)
        make("Cast", [p + "kept"], [p + "kept64"], to=onnx.TensorProto.INT64),
        int64_constant(p + "axis0", 0),
        make("CumSum", [p + "kept64", p + "axis0"], [p + "kept_through"]),
        int64_constant(p + "one", 1),
        make("Sub", [p + "kept_through", p + "one"], [p + "kept_place"]),
        make("Where", [p + "kept", p + "kept_place", p + "kept_count"], [p + "position_rows"]),
        make("Gather", [p + "values64", rows_dim], [p + "sparse_ids"], axis=0),
        make("Gather", [lookup.input[0], p + "sparse_ids"], [p + "sparse_lookup"], axis=0),
        make("PaddingRows", [p + "sparse_lookup", p + "sparse_ids"], [sparse_name(marker.output[0])],
             domain=MARKER_DOMAIN, padding_idx=node_attributes(marker)["padding_idx"]),
    ]
    in_region = {node.output[0] for node in region.nodes}
    lookup_read_elsewhere = any(lookup.output[0] in node.input for node in graph.node
                                if node.output[0] != marker.output[0])
    nodes = []
    for node in graph.node:
        if node.output[0] == lookup.output[0] and not lookup_read_elsewhere:
            continue
        if node.output[0] == marker.output[0]:
            nodes += index_nodes
            nodes += _densify(marker.output[0], region, p, ids, sparse_name)
            continue
        if node.output[0] in in_region:
            outputs = list(node.output)
            _to_sparse(node, region.sparse, sparse_name)
            nodes.append(node)
            for name in outputs:
                nodes += _densify(name, region, p, ids, sparse_name)
            continue
        nodes.append(node)
    set_nodes(graph, nodes)
    stale = [value for value in graph.value_info if value.name in region.sparse and value.name not in region.densified]
    for value in stale:  # computed sparse only
        graph.value_info.remove(value)
    graph.value_info.extend(
        onnx.helper.make_tensor_value_info(sparse_name(name), tensors[name][0], [rows_dim, tensors[name][1][-1]])
        for name in region.sparse if name in tensors and tensors[name][1])
    graph.value_info.append(onnx.helper.make_tensor_value_info(rows_dim, onnx.TensorProto.INT64, [rows_dim]))


def _to_sparse(node, sparse, sparse_name):
    """`node` reads and writes the sparse forms; its axes count from the last (rank 2 now)."""
    for i, name in enumerate(node.input):
        if name in sparse:
            node.input[i] = sparse_name(name)
    for i, name in enumerate(node.output):
        if name:
            node.output[i] = sparse_name(name)
    if node.op_type in _LAST_AXIS:
        attribute, _ = _LAST_AXIS[node.op_type]
        kept = [a for a in node.attribute if a.name != attribute]
        del node.attribute[:]
        node.attribute.extend([*kept, onnx.helper.make_attribute(attribute, -1 if attribute == "axis" else [-1])])
    if node.op_type == "Reshape":  # to [positions, width]: the sparse rows are that already
        node.op_type = "Identity"
        del node.input[1:]
        del node.attribute[:]


def _densify(name, region, p, ids, sparse_name):
    """The nodes remaking the dense `name` from its sparse form, where it is needed."""
    if name not in region.densified:
        return []
    make = onnx.helper.make_node
    if region.sparse[name]:
        return [make("Gather", [sparse_name(name), p + "position_rows"], [name], axis=0)]
    q = f"{name}/embedding_sparsity/"
    return [make("Gather", [sparse_name(name), p + "position_rows"], [q + "flat"], axis=0),
            make("Shape", [ids], [q + "positions"]),
            make("Shape", [sparse_name(name)], [q + "sparse_shape"]),
            int64_constant(q + "one", [1]), int64_constant(q + "two", [2]),
            make("Slice", [q + "sparse_shape", q + "one", q + "two"], [q + "width"]),
            make("Concat", [q + "positions", q + "width"], [q + "shape"], axis=0),
            make("Reshape", [q + "flat", q + "shape"], [name])]
