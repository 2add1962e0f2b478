"""fp32 matrix products of a built CPU graph that torch's kernels compute faster than ONNX Runtime's
MLAS, as torch nodes (`matrix_products_in_torch`).

Which library wins depends on the CPU and the shape (BENCHMARKS.md: on an AMD EPYC, the weight
gradient of the seed model's vocabulary projection, dW = dY^T A, 700 x 28,782 x 200, takes MLAS
98 ms and torch 74 ms; MLAS wins that product's forward by 2x). So nothing is decided here: each
2-D product is described in the form ONNX Runtime would run it, after its optimizer folds the
transposes around it into the product's flags (MatmulTransposeFusion, GemmTransposeFusion), and
the caller's `faster_in_torch(form)` decides (`_runtime.product_speed` measures both). A product
that goes to torch keeps that form: torch reads the same operands, transposed as views.

A batch of rows times a matrix is one 2-D product over all the rows (m: their count): a language
model's vocabulary projection [batch, seq, width] x W^T and its input gradient dY W, which the
gradient builder writes as a FusedMatMul (ONNX Runtime's MatMul with transpose flags and alpha).
"""
import math

from .._onnx import inferred_tensors, node_attributes, torch_node
from .._torch_node_catalogue import MATRIX_PRODUCT  # run by `_runtime.product_kernels.matrix_product`
from .label_sparsity import kept_rows_bounds
from .torch_node_shapes import set_value_info
from .torch_nodes import replace_nodes

_FLOAT = 1  # onnx.TensorProto.FLOAT
_PRODUCTS = {("", "MatMul"), ("ai.onnx", "MatMul"), ("", "Gemm"), ("ai.onnx", "Gemm"), ("com.microsoft", "FusedMatMul")}


def matrix_products_in_torch(model, faster_in_torch):
    """Rewrites, in place, each float32 MatMul, FusedMatMul or Gemm of a matrix or a batch of rows
    by a matrix (with the transposes folded into it) for which `faster_in_torch((trans_a, trans_b,
    m, k, n))` is true into one torch node; returns how many. A Transpose whose readers all went
    goes too. Products in torch's bf16 nodes, products of two batches and other types are left."""
    graph = model.graph
    tensors, producers, readers = inferred_tensors(model), {}, {}
    for node in graph.node:
        for name in node.output:
            producers[name] = node
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {value.name for value in graph.output}
    replaced, removed = {}, set()
    bounds = kept_rows_bounds(model, tensors)
    for node in graph.node:
        product = _product_form(node, tensors, producers, readers, outputs, bounds)
        if product is None or not faster_in_torch(product["form"]):
            continue
        trans_a, trans_b, _, _, n = product["form"]
        params = {"trans_a": trans_a, "trans_b": trans_b, "alpha": product["alpha"], "beta": product["beta"]}
        output = product["output"]
        replaced[id(product["last"])] = torch_node(MATRIX_PRODUCT, product["inputs"], [output],
                                                   name=f"{node.name or output}/torch_product", params=params)
        removed.update(id(done) for done in product["consumed"])
        set_value_info(model, output, _FLOAT, [*product["rows"], n])
    if replaced:
        kept = [replaced.get(id(node), node) for node in graph.node if id(node) not in removed or id(node) in replaced]
        replace_nodes(model, _without_unread_transposes(kept, outputs))
    return len(replaced)


def _without_unread_transposes(nodes, outputs):
    """`nodes` less the matrix Transposes nothing reads any more (each of their readers folded them
    into a product that went to torch), as ONNX Runtime's fusion would have dropped them."""
    read = {name for node in nodes for name in node.input} | outputs
    return [node for node in nodes if not (_transposes_matrix(node) and node.output[0] not in read)]


def _product_form(node, tensors, producers, readers, outputs, bounds):
    """What ONNX Runtime would run for `node`, a float32 product of a matrix or a batch of rows by a
    matrix: {"form": (trans_a, trans_b, m, k, n), "inputs": the operands (and Gemm's C), "alpha",
    "beta", "rows": the output's dims but its last, "output": the tensor it writes, "last": the node
    whose place it takes, "consumed": the nodes it replaces}; else None. `bounds`: {a dim known at
    run time: the most it can be}, the size the decision is made for (label sparsity's kept rows)."""
    if (node.domain, node.op_type) not in _PRODUCTS:
        return None
    attributes = node_attributes(node)
    if attributes.get("transBatchA", 0) or attributes.get("transBatchB", 0):
        return None
    # FusedMatMul's output type is ONNX Runtime's to infer: it is its operands'
    typed = node.input if node.op_type == "FusedMatMul" else (*node.input, node.output[0])
    if any(tensors.get(name, (0, None))[0] != _FLOAT for name in typed):
        return None
    a, b, *bias = node.input
    trans_a, trans_b = bool(attributes.get("transA", 0)), bool(attributes.get("transB", 0))
    consumed = [node]
    (a, trans_a), (b, trans_b) = (_folded_transpose(name, flag, producers, readers, consumed)
                                  for name, flag in ((a, trans_a), (b, trans_b)))
    dims = [tensors.get(name, (0, None))[1] for name in (a, b)]  # a dim may be named (known at run time)
    if any(shape is None for shape in dims):
        return None
    shapes = [[bounds.get(d, d) for d in shape] for shape in dims]  # the sizes the decision is made for
    if any(not all(isinstance(d, int) for d in shape) for shape in shapes):
        return None
    if len(shapes[1]) != 2 or len(shapes[0]) < 2 or (len(shapes[0]) > 2 and trans_a):
        return None  # a batch of rows (the leading dims of A) by a matrix is one product; others are not
    rows = list(dims[0][:-1])
    if len(rows) > 1:
        shapes[0], dims[0] = [math.prod(shapes[0][:-1]), shapes[0][-1]], [None, dims[0][-1]]
    output, last = node.output[0], node
    transposes = readers.get(output, [])
    if (not bias and len(rows) == 1 and output not in outputs and len(transposes) == 1
            and _transposes_matrix(transposes[0])):
        # (op(A) op(B))^T = op(B)^T op(A)^T, written where the Transpose wrote
        (a, trans_a), (b, trans_b) = (b, not trans_b), (a, not trans_a)
        shapes.reverse()
        dims.reverse()
        last = transposes[0]
        output = last.output[0]
        consumed.append(last)
    m, k = reversed(shapes[0]) if trans_a else shapes[0]
    n = shapes[1][0] if trans_b else shapes[1][1]
    return {"form": (trans_a, trans_b, m, k, n), "inputs": [a, b, *bias], "output": output, "last": last,
            "consumed": consumed, "alpha": float(attributes.get("alpha", 1.0)),
            "beta": float(attributes.get("beta", 1.0)),
            "rows": rows if len(rows) > 1 else [dims[0][1] if trans_a else dims[0][0]]}


def _transposes_matrix(node):
    return (node.op_type == "Transpose" and node.domain in ("", "ai.onnx")
            and list(node_attributes(node).get("perm", [])) == [1, 0])


def _folded_transpose(name, flag, producers, readers, consumed):
    """(operand, flag) with a Transpose that produces the operand folded into the flag, as ONNX
    Runtime's optimizer folds it; the Transpose is consumed when the product is its only reader."""
    producer = producers.get(name)
    if producer is None or not _transposes_matrix(producer):
        return name, flag
    if len(readers.get(name, [])) == 1:
        consumed.append(producer)
    return producer.input[0], not flag
