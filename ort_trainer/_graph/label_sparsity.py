"""Label sparsity (ORTTrainer's `graph_transformer.label_sparsity`, ORTModule's
ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER): a cross-entropy loss with an ignore_index computes its
last per-token work, the vocabulary projection and the loss, on the rows whose label counts only.

Why: fine-tuning batches are padded, and instruction tuning masks the prompt's labels with -100;
the projection to a vocabulary and the log-softmax over it are most of a small language model's
step, and eager PyTorch computes them for every position. The exported forward is rewritten
before ONNX Runtime's gradient builder, which then differentiates through the Gather (GatherGrad
scatters the kept rows' gradients back, the others stay zero: what the dense graph computes).

Models often return the logits too (Hugging Face's outputs hold them; ORTTrainer fetches every
output unless told otherwise): every row's scores are then computed, but the loss still reads the
kept rows only (its log-softmax falls with them), and the projection's gradients run on those rows
where the user's loss leaves the logits unused: one LABELLED_PROJECTION torch node
(`_runtime.labelled_projection`) whose gradient node decides at run time, from the shape of the
logits' gradient (ORTModule's scalar zero for an unused output, `returned_scores_gradient_scalar`;
ORTTrainer's, which differentiates the loss alone, is one too), dense where the user's loss reads
them.
"""
from __future__ import annotations

from collections.abc import Collection

import onnx

from .._onnx import (full_shape_outputs_without, graph_index, inferred_tensors, int64_constant, node_attributes,
                     set_nodes, torch_node, torch_node_operator)
from .._torch_node_catalogue import LABELLED_PROJECTION, LABELLED_PROJECTION_GRAD
from .input_density import input_behind
from .torch_node_shapes import set_value_info
from .torch_nodes import needing_gradient, reached_first, replace_nodes

# Ops between the projection and the loss that compute each row from that row alone.
_ROW_WISE = frozenset({"Cast", "Identity"})
# The fewest classes (a vocabulary, not a classifier's head) for which the rewrite pays. The kept rows'
# count is known only at run time, and ONNX Runtime plans no memory pattern for a graph with such a
# shape: it allocates tensor by tensor from its arena, which grows by doubling. A 10-class head on 6
# feed-forward blocks of 4,096 x 2,048 took 1,154 MiB where the dense graph took 666 (RssAnon peak);
# GPT-2's 32,000-word vocabulary took less sparse than dense (449 vs 682 MiB, half the labels -100).
MIN_CLASSES = 1024


def gather_labelled_rows(model: onnx.ModelProto, fetched: Collection[str], *, returned_scores: bool = False,
                         differentiable: Collection[str] = ()) -> int:
    """Rewrites each SoftmaxCrossEntropyLoss with an ignore_index (reduction 'mean' or 'sum', no class
    weights) of the exported forward `model` (in place) so that the projection feeding its scores
    (MatMul or Gemm, a bias Add of shape [classes], Casts) computes only the rows whose label is not
    ignore_index: `rows = NonZero(Not(Equal(labels, ignore_index)))` (none: row 0, whose label is
    ignored), the projection's input flattened to [N, width] and gathered at `rows`, the labels
    gathered too. The loss is unchanged: ignored rows counted for nothing; with none kept it is NaN
    (mean) or 0 (sum) and every gradient zero, as torch's.

    Only where it pays, for `MIN_CLASSES` classes or more, and only where exact: the scores are the
    [N, classes] flattening of the projection's output, and no
    tensor on the way from the projection to the loss is in `fetched` (the outputs the caller gets)
    or read by another node. Those tensors stop being graph outputs. With `returned_scores` (fp32
    graphs), a loss whose fp32 scores are fetched (a Hugging Face model returns its logits; ORTTrainer
    fetches every output by default) is rewritten too: the projection becomes one LABELLED_PROJECTION torch node writing the
    fetched scores, dense, and the kept rows' scores, which the loss reads (`_rewrite_returned`;
    `differentiable`: the inputs gradients flow from). Returns the number of losses rewritten.
    """
    graph = model.graph
    losses = [node.output[0] for node in graph.node if _is_candidate(node)]
    tensors = inferred_tensors(model) if losses else {}  # (it replaces the graph's nodes: find them after)
    tensors.update({tensor.name: (tensor.data_type, tuple(tensor.dims)) for tensor in graph.initializer})
    rewritten = 0
    for name in losses:
        loss = next(node for node in graph.node if node.output[0] == name)
        chain = _projection_chain(graph, loss, tensors, set(fetched), returned_scores=returned_scores)
        if chain is None:
            continue
        if _dense_shapes(graph, [chain[0], *chain[1]], _dims(tensors, loss.input[0])[1]):  # new nodes: found again
            loss = next(node for node in graph.node if node.output[0] == name)
            chain = _projection_chain(graph, loss, tensors, set(fetched), returned_scores=returned_scores)
        projection, row_wise, reshape, width, returned = chain
        if returned is None:
            _rewrite(graph, loss, projection, row_wise, reshape, width, tensors)
        else:
            _rewrite_returned(model, loss, [projection, *row_wise, *([reshape] if reshape else [])], returned,
                              tensors, differentiable)
        rewritten += 1
    return rewritten


def described_losses(model: onnx.ModelProto) -> list[str]:
    """For ORTModule's density report: of each cross-entropy with an ignore_index of the exported
    forward `model` after `gather_labelled_rows`, a line saying what it computes on the labelled rows
    or that it stayed dense, naming the input its labels come from where they come from one."""
    producers = {output: node for node in model.graph.node for output in node.output}
    inputs = {value.name for value in model.graph.input}
    lines = []
    for loss in (node for node in model.graph.node if _is_candidate(node)):
        labels, scores = loss.input[1], producers.get(loss.input[0])
        sparse = labels.endswith("/label_sparsity/labels") and labels in producers
        source = input_behind(producers[labels].input[0] if sparse else labels, producers, inputs)
        name = f"the cross-entropy reading {source or 'labels computed in forward()'}"
        if not sparse:
            lines.append(f"{name} stayed dense (fewer than {MIN_CLASSES} classes, or its scores are not a "
                         "projection's that only the loss reads, or are returned under autocast)")
        elif scores is not None and torch_node_operator(scores) == LABELLED_PROJECTION:
            lines.append(f"{name}: the loss on the labelled rows, the returned logits dense (the projection's "
                         "gradients on those rows where the logits go unused)")
        else:
            lines.append(f"{name}: the projection and the loss on the labelled rows")
    return lines


def returned_scores_gradient_scalar(model: onnx.ModelProto) -> int:
    """In ORTModule's built training graph (in place): each output whose gradient only LABELLED_PROJECTION
    gradient nodes read leaves the YieldOp's `full_shape_outputs`, so that ORTModule feeds a scalar
    zero where the user's loss does not use it (`ModuleGraph.zero_gradient`), which those nodes read
    as "the kept rows only". Returns the number of outputs freed."""
    _, readers, _, yield_op = graph_index(model.graph)
    if yield_op is None:
        return 0
    freed = {k for k, name in enumerate(yield_op.output) if readers.get(name) and all(
        torch_node_operator(node) == LABELLED_PROJECTION_GRAD for node in readers[name])}
    full_shape_outputs_without(yield_op, freed)
    return len(freed)


def kept_positions(values, empty, p):
    """Nodes computing, of the 1-D integer tensor `values`, `p + "empty"` (bool: the value is
    `empty`), `p + "kept"` (its negation) and `p + "kept_rows"` (the kept positions, 1-D int64);
    `p + "flat"` is the constant [-1]."""
    make = onnx.helper.make_node
    return [make("Cast", [values], [p + "values64"], to=onnx.TensorProto.INT64),
            int64_constant(p + "empty_value", empty),
            make("Equal", [p + "values64", p + "empty_value"], [p + "empty"]),
            make("Not", [p + "empty"], [p + "kept"]),
            make("NonZero", [p + "kept"], [p + "kept_nonzero"]),
            int64_constant(p + "flat", [-1]),
            make("Reshape", [p + "kept_nonzero", p + "flat"], [p + "kept_rows"])]


def _kept_rows_and_labels(labels, ignore_index, p):
    """Nodes computing `p + "rows"`, the positions of the labels (1-D) that are not `ignore_index`
    (none: row 0, whose label is ignored, so counts for nothing: ORT's kernels refuse empty
    products), and `p + "labels"`, the labels there."""
    make = onnx.helper.make_node
    return [*kept_positions(labels, ignore_index, p),
            int64_constant(p + "first", [0]),
            make("Concat", [p + "kept_rows", p + "first"], [p + "kept_then_first"], axis=0),
            make("Shape", [p + "kept_rows"], [p + "kept_count"]),
            int64_constant(p + "one", [1]),
            make("Max", [p + "kept_count", p + "one"], [p + "count"]),
            make("Slice", [p + "kept_then_first", p + "first", p + "count"], [p + "rows"]),
            make("Gather", [labels, p + "rows"], [p + "labels"], axis=0)]


def _is_candidate(node):
    attributes = node_attributes(node)
    return (node.op_type == "SoftmaxCrossEntropyLoss" and node.domain in ("", "ai.onnx") and len(node.input) == 2
            and "ignore_index" in attributes and attributes.get("reduction", b"mean") in (b"mean", b"sum"))


def _dims(tensors, name):
    return (tensors.get(name) or (None, None))[1]


def _projection_chain(graph, loss, tensors, fetched, *, returned_scores):
    """(projection node, the row-wise nodes after it in order, the flattening Reshape or None, the
    width to flatten the projection's input to, None when it is [N, width] already, the fetched
    tensor on the way or None: `_returned_exactly` says when one may be); None where the rewrite
    would not be exact."""
    producers = {output: node for node in graph.node for output in node.output}
    reads, shapes = {}, {}  # the readers of each tensor; those that read its shape alone
    for node in graph.node:
        for name in node.input:
            reads[name] = reads.get(name, 0) + 1
        if _is_shape(node):
            shapes[node.input[0]] = shapes.get(node.input[0], 0) + 1
    scores, labels = _dims(tensors, loss.input[0]), _dims(tensors, loss.input[1])
    if scores is None or len(scores) != 2 or labels is None or len(labels) != 1:
        return None
    if not isinstance(scores[1], int) or scores[1] < MIN_CLASSES:
        return None  # a classifier's head: the memory pattern lost would cost more than the rows saved
    outputs = {output.name for output in graph.output}
    if any(name in reads or name in outputs for name in loss.output[1:] if name):
        return None  # the per-row log-probabilities are read: they keep every row
    weights = {tensor.name for tensor in (*graph.input, *graph.initializer)}
    row_wise, reshape, name, returned = [], None, loss.input[0], None
    while True:
        if name in fetched and (returned is not None or not returned_scores):
            return None
        returned = name if name in fetched else returned
        if reads.get(name, 0) - shapes.get(name, 0) != 1 or name not in producers:  # Shapes: `_dense_shapes`
            return None
        node = producers[name]
        if node.op_type in ("MatMul", "Gemm") and node.domain in ("", "ai.onnx"):
            break
        if node.op_type == "Reshape" and reshape is None and _flattens(node, tensors):
            if name in shapes:
                return None  # the flattened scores' shape, read, would be the kept rows'
            reshape, name = node, node.input[0]
            continue
        if node.op_type in _ROW_WISE and node.domain in ("", "ai.onnx"):
            name = node.input[0]
        elif node.op_type == "Add" and _bias(node, weights, tensors, scores[1]) is not None:
            name = next(other for other in node.input if other != _bias(node, weights, tensors, scores[1]))
        else:
            return None
        row_wise.insert(0, node)
    rows, weight = _dims(tensors, node.input[0]), _dims(tensors, node.input[1])
    if rows is None or weight is None or len(weight) != 2 or len(rows) < 2:
        return None
    if node.op_type == "Gemm" and (node_attributes(node).get("transA", 0) or len(rows) != 2 or (
            len(node.input) > 2 and _bias(node, weights, tensors, scores[1]) != node.input[2])):
        return None
    if len(rows) > 2 and (reshape is None or not isinstance(rows[-1], int)):
        return None  # the scores are the projection's [N, classes] or its flattening to it
    if returned is not None and not _returned_exactly([node, *row_wise], returned, tensors):
        return None
    return node, row_wise, reshape, rows[-1] if len(rows) > 2 else None, returned


def _is_shape(node):
    return node.op_type == "Shape" and node.domain in ("", "ai.onnx") and not node.attribute


def _dense_shapes(graph, chain, classes):
    """Each Shape reading a tensor of `chain` (the projection and its row-wise nodes, whose outputs
    are [..., classes] with the projection input's leading dims: a model's `logits.size(-1)`, as
    DistilBERT's and T5's losses read it) computes that shape from the projection's input instead
    (in place): the chain's tensors then hold the kept rows, or are gone. Returns the number redirected."""
    outputs = {node.output[0] for node in chain}
    hidden, make = chain[0].input[0], onnx.helper.make_node
    nodes, redirected = [], 0
    for node in graph.node:
        if _is_shape(node) and node.input[0] in outputs:
            redirected += 1
            p = f"{node.output[0]}/dense_shape/"
            nodes += [make("Shape", [hidden], [p + "hidden"]), int64_constant(p + "first", [0]),
                      int64_constant(p + "last", [-1]), int64_constant(p + "classes", [classes]),
                      make("Slice", [p + "hidden", p + "first", p + "last"], [p + "leading"]),
                      make("Concat", [p + "leading", p + "classes"], [node.output[0]], axis=0)]
        else:
            nodes.append(node)
    if redirected:
        set_nodes(graph, nodes)
    return redirected


def _returned_exactly(chain, returned, tensors):
    """Whether the fetched tensor `returned` is the projection's result (its bias added) as the
    LABELLED_PROJECTION node computes it: everything on the chain float32, so that its Casts and
    Identities change no value, one bias at most (Gemm's or an Add's), `returned` written by the
    projection or a row-wise node after its bias Add (not by the flattening Reshape), its inferred
    shape concrete (ONNX infers nothing of a torch node's outputs, and ORTTrainer binds its outputs
    at their shapes)."""
    dims = _dims(tensors, returned)
    if dims is None or not all(isinstance(dim, int) for dim in dims):
        return False
    names = [node.input[0] for node in chain[:1]] + [node.input[1] for node in chain[:1]] + [
        node.output[0] for node in chain]
    if any(tensors.get(name, (None,))[0] != onnx.TensorProto.FLOAT for name in names):
        return False
    if len([name for name in chain[0].input[2:] if name]) + sum(node.op_type == "Add" for node in chain) > 1:
        return False
    writer = next((k for k, node in enumerate(chain) if node.output[0] == returned), None)
    return writer is not None and all(node.op_type in _ROW_WISE for node in chain[writer + 1:])


def _flattens(node, tensors):
    """A Reshape from [..., classes] to [N, classes]: rows stay rows, in order."""
    before, after = _dims(tensors, node.input[0]), _dims(tensors, node.output[0])
    return (before is not None and after is not None and len(before) >= 2 and len(after) == 2
            and after[1] is not None and after[1] == before[-1])


def _bias(node, weights, tensors, classes):
    """The input of `node` that is a per-class bias (a weight of shape [classes]: the same for every
    row, whatever their number), or None."""
    return next((name for name in node.input if name in weights and _dims(tensors, name) == (classes,)), None)


def kept_rows_bounds(model: onnx.ModelProto, tensors: dict) -> dict[str, int]:
    """{the kept rows' named dim of each rewritten loss: the count of the labels they are taken from
    (the most they can be)} where that count is known (`tensors`: `inferred_tensors(model)`): the
    size `_graph.cpu_products` decides their products by, as the dense graph's."""
    bounds = {}
    for node in model.graph.node:
        if node.op_type == "Gather" and node.output[0].endswith("/label_sparsity/labels"):
            dims = (tensors.get(node.input[0]) or (None, None))[1]
            if dims is not None and len(dims) == 1 and isinstance(dims[0], int):
                bounds[node.input[1]] = dims[0]  # the positions' tensor, whose name is the dim's
    return bounds


def _rewrite(graph, loss, projection, row_wise, reshape, width, tensors):
    """Moves the projection and its row-wise nodes right before the loss (everything they read is
    computed by then), on the gathered rows; the Reshape goes (the rows are flat already). The new
    shapes are declared with the kept rows as one named dim: ORT's MatMul gradient, not knowing the
    rows of both sides agree, wrote a broadcast reduction that fails at run time."""
    make, p = onnx.helper.make_node, f"{loss.output[0]}/label_sparsity/"
    labels = loss.input[1]
    hidden, classes = projection.input[0], _dims(tensors, loss.input[0])[1]
    hidden_type, hidden_dims = tensors[hidden]
    nodes = _kept_rows_and_labels(labels, node_attributes(loss)["ignore_index"], p)
    if width is not None:
        nodes += [int64_constant(p + "rows_by_width", [-1, width]),
                  make("Reshape", [hidden, p + "rows_by_width"], [p + "hidden"])]
        hidden = p + "hidden"
    nodes.append(make("Gather", [hidden, p + "rows"], [p + "kept_hidden"], axis=0))
    projection.input[0] = p + "kept_hidden"
    chain = [projection, *row_wise]
    loss.input[1] = p + "labels"
    if reshape is not None:  # its reader reads its input
        for node in (*row_wise, loss):
            for i, name in enumerate(node.input):
                if name == reshape.output[0]:
                    node.input[i] = reshape.input[0]
    moved = {node.output[0] for node in (*chain, reshape) if node is not None}  # outputs name nodes
    changed = moved | {output for node in chain for output in node.output} | set(loss.output[1:])
    kept = [node for node in graph.node if node.output[0] not in moved]
    at = next(i for i, node in enumerate(kept) if node.output[0] == loss.output[0])
    set_nodes(graph, kept[:at] + nodes + chain + kept[at:])
    for values in (graph.output, graph.value_info):  # shapes changed; not fetched
        for value in [value for value in values if value.name in changed]:
            values.remove(value)
    kept_rows = p + "rows"  # the named dim
    declared = [(kept_rows, onnx.TensorProto.INT64, [kept_rows]),
                (p + "labels", tensors[labels][0], [kept_rows]),
                (p + "kept_hidden", hidden_type, [kept_rows, hidden_dims[-1]]),
                *((node.output[0], tensors[node.output[0]][0], [kept_rows, classes]) for node in chain)]
    graph.value_info.extend(onnx.helper.make_tensor_value_info(name, elem_type, dims)
                            for name, elem_type, dims in declared)


def _rewrite_returned(model, loss, chain, returned, tensors, differentiable):
    """The projection, its bias Add, Casts and Identities (float32: no value changed) and flattening
    Reshape (`chain`) become one LABELLED_PROJECTION torch node (`_runtime.labelled_projection`)
    before the loss, reading the projection's input and weight (a Transpose of it folded into
    `trans_b`, as ONNX Runtime folds it), the kept rows and the bias, and writing `returned` (every
    row's scores) and the kept rows' scores, which the loss reads with the gathered labels. Its
    gradient node computes the projection's gradients on the kept rows when `returned`'s gradient
    is a scalar zero (`returned_scores_gradient_scalar` lets ORTModule feed one), dense otherwise."""
    graph, p = model.graph, f"{loss.output[0]}/label_sparsity/"
    producers = {output: node for node in graph.node for output in node.output}
    projection, classes = chain[0], _dims(tensors, loss.input[0])[1]
    attributes = node_attributes(projection)
    value = projection.output[0]
    biases = [name for name in projection.input[2:] if name]  # Gemm's C, scaled by its beta
    beta = float(attributes.get("beta", 1.0)) if biases else 1.0
    for node in chain[1:]:  # the bias Add's other input
        if node.op_type == "Add":
            biases.append(node.input[1] if node.input[0] == value else node.input[0])
        value = node.output[0]
    weight, trans_b = projection.input[1], bool(attributes.get("transB", 0))
    transpose = producers.get(weight)
    readers = [node for node in graph.node if weight in node.input]
    folded = transpose is not None and transpose.op_type == "Transpose" and transpose.domain in ("", "ai.onnx") \
        and list(node_attributes(transpose).get("perm", [])) == [1, 0] and len(readers) == 1
    if folded:
        weight, trans_b = transpose.input[0], not trans_b
    operands = [projection.input[0], weight, p + "rows", *biases]
    listed, order = reached_first(operands, needing_gradient(model, differentiable))
    kept_scores = p + "kept_scores"
    nodes = [*_kept_rows_and_labels(loss.input[1], node_attributes(loss)["ignore_index"], p),
             torch_node(LABELLED_PROJECTION, listed, [returned, kept_scores], name=p + "projection", params={
                 "trans_b": trans_b, "alpha": float(attributes.get("alpha", 1.0)), "beta": beta, "operands": order,
                 "differentiable_outputs": 2})]
    labels_type = tensors[loss.input[1]][0]
    loss.input[0], loss.input[1] = kept_scores, p + "labels"
    removed = {node.output[0] for node in (*chain, *([transpose] if folded else []))}  # outputs name nodes
    kept = [node for node in graph.node if node.output[0] not in removed]
    at = next(i for i, node in enumerate(kept) if node.output[0] == loss.output[0])
    replace_nodes(model, kept[:at] + nodes + kept[at:])
    changed = (removed - {returned}) | set(loss.output[1:])
    for value_info in [value_info for value_info in graph.value_info if value_info.name in changed]:
        graph.value_info.remove(value_info)
    set_value_info(model, returned, onnx.TensorProto.FLOAT, list(tensors[returned][1]))  # as inferred before
    kept_rows = p + "rows"  # the named dim
    graph.value_info.extend(onnx.helper.make_tensor_value_info(name, elem_type, dims) for name, elem_type, dims in (
        (kept_rows, onnx.TensorProto.INT64, [kept_rows]), (p + "labels", labels_type, [kept_rows]),
        (kept_scores, onnx.TensorProto.FLOAT, [kept_rows, classes])))
