"""The types and shapes of torch nodes' outputs (`declare_torch_node_outputs`): ONNX and ONNX
Runtime infer none for an ATen node, so they are computed here from the inputs' inferred shapes and
the node's parameters, per torch operator and function."""

import onnx

from .._export.torch_node_symbolics import RECURRENT, WITH_INDICES
from .._onnx import TORCH_NODE_DOMAIN as DOMAIN
from .._onnx import in_operand_order, inferred_tensors, node_attributes, torch_node_operator, torch_node_params_of
from .._torch_node_catalogue import ADAPTIVE_AVG_POOL, AUTOGRAD_FUNCTION, DETACH, EINSUM, FUNCTION, TO_BF16, TO_FP32


def _einsum_shape(shapes, params):
    terms, result = params["equation"].split("->")
    sizes, ellipsis = {}, ()
    for term, shape in zip(terms.split(","), shapes):
        head, _, tail = term.partition("...")
        if "..." in term:
            dims = shape[len(head):len(shape) - len(tail)]
            padded = (1,) * (len(dims) - len(ellipsis)) + tuple(ellipsis)
            dims = (1,) * (len(padded) - len(dims)) + tuple(dims)
            ellipsis = tuple(max(a, b) for a, b in zip(padded, dims))
            tail_dims = shape[len(shape) - len(tail):] if tail else []
        else:
            tail_dims = []
        for label, size in [*zip(head, shape), *zip(tail, tail_dims)]:
            sizes[label] = size
    head, _, tail = result.partition("...")
    return [sizes[label] for label in head] + (list(ellipsis) if "..." in result else []) + [sizes[c] for c in tail]


def _adaptive_avg_pool_shape(shapes, params):
    size = params["output_size"]
    return list(shapes[0][:len(shapes[0]) - len(size)]) + list(size)


# Functions whose last two args are (dims: an int, a list or None for all, keepdim); with no args
# they reduce every dim.
_REDUCING = frozenset({"median", "kthvalue", "mode", "prod", "nansum", "nanmean", "linalg.vector_norm"})


def _function_shape(shapes, params):
    """Elementwise (the inputs broadcast) or cumulative: the broadcast shape; a reduction drops or
    keeps (as 1) its dims; a determinant drops the last two dims; pixel_shuffle moves channels into
    the spatial dims."""
    rank = max(len(shape) for shape in shapes)
    padded = [[1] * (rank - len(shape)) + list(shape) for shape in shapes]
    broadcast = [max(dims) if 1 in dims else dims[0] for dims in zip(*padded)]
    function, args = params["function"], params["args"]
    if "shape" in params:  # a loss: reduced, one per row, or elementwise
        return {"scalar": [], "rows": broadcast[:1]}.get(params["shape"], broadcast)
    if function in _REDUCING:
        dims, keepdim = args[-2:] if args else (None, False)
        reduced = set(range(rank)) if dims is None else {d % rank for d in ([dims] if isinstance(dims, int) else dims)}
        return [1 if k in reduced else size for k, size in enumerate(broadcast) if keepdim or k not in reduced]
    if function == "multinomial":  # [..., classes] -> [..., num_samples]
        return broadcast[:-1] + [args[0]]
    if function == "nn.functional.pad":  # (pads of the last dim first, mode)
        pads = args[0]
        return [size + sum(pads[2 * k:2 * k + 2]) if 2 * k < len(pads) else size
                for k, size in ((rank - 1 - axis, size) for axis, size in enumerate(broadcast))]
    if function == "pixel_shuffle":  # [..., C r^2, H, W] -> [..., C, H r, W r]
        r = args[0]
        return broadcast[:-3] + [broadcast[-3] // (r * r), broadcast[-2] * r, broadcast[-1] * r]
    if function in _SHAPE_CHANGING:
        return _SHAPE_CHANGING[function](shapes, args)
    return broadcast[:-2] if function == "linalg.det" else broadcast


def _diag_shape(shapes, args):
    """torch.diag: a vector into a square matrix (its diagonal moved off the main one by
    `diagonal`), a matrix's diagonal out."""
    diagonal = args[0] if args else 0
    if len(shapes[0]) == 1:
        return [shapes[0][0] + abs(diagonal)] * 2
    rows, columns = shapes[0]
    return [max(0, min(rows, columns - diagonal) if diagonal >= 0 else min(rows + diagonal, columns))]


def _kron_shape(shapes, args):
    rank = max(len(shape) for shape in shapes)
    a, b = ([1] * (rank - len(shape)) + list(shape) for shape in shapes)
    return [x * y for x, y in zip(a, b)]


def _nearest_exact_shape(shapes, args):
    """F.interpolate(mode='nearest-exact'): (output_size, scale_factors), one of them None."""
    output_size, scales = args
    spatial = shapes[0][2:]
    sizes = output_size if output_size is not None else [int(size * scale) for size, scale in zip(spatial, scales)]
    return list(shapes[0][:2]) + list(sizes)


def _recurrent_shape(shapes, args):
    """A recurrent layer's output: the input's shape with h_0's last size (the hidden size, or an
    LSTM's proj_size), times 2 when bidirectional, last."""
    bidirectional = args[4]
    return list(shapes[0][:-1]) + [shapes[1][-1] * (2 if bidirectional else 1)]


# Functions whose output shape is neither the inputs' broadcast nor a reduction's.
_SHAPE_CHANGING = {
    "ops.aten.cdist": lambda shapes, args: list(shapes[0][:-1]) + [shapes[1][-2]],  # [.., P, D], [.., R, D]
    "trace": lambda shapes, args: [],
    "pdist": lambda shapes, args: [shapes[0][0] * (shapes[0][0] - 1) // 2],
    "diag": _diag_shape, "kron": _kron_shape, **{name: _recurrent_shape for name in RECURRENT},
    **{f"ops.aten._upsample_nearest_exact{dims}d": _nearest_exact_shape for dims in (1, 2, 3)},
}


#: forward operator -> output shape(input shapes, params); the catalogue says which operators need none
SHAPE_RULES = {EINSUM: _einsum_shape, ADAPTIVE_AVG_POOL: _adaptive_avg_pool_shape, FUNCTION: _function_shape,
               DETACH: lambda shapes, params: list(shapes[0]), TO_BF16: lambda shapes, params: list(shapes[0]),
               TO_FP32: lambda shapes, params: list(shapes[0])}


def declare_torch_node_outputs(model: onnx.ModelProto) -> None:
    """States the type and shape of the forward torch nodes' outputs (in place): ONNX and ONNX
    Runtime infer none for an ATen node, and without them nothing after it has a shape (an export
    re-derived at new shapes has lost its value_info). Shapes from the inputs' inferred ones; the
    type alone where those are unknown: input 0's, or the node's `output_type` parameter."""
    nodes = [node for node in model.graph.node if node.domain == DOMAIN]
    _declare_autograd_function_outputs(model, nodes)
    for _ in range(len(nodes)):  # a torch node's shape may need an earlier one's
        tensors, declared = inferred_tensors(model), False
        for node in nodes:
            element_type, known = tensors.get(node.output[0], (0, None))
            if element_type and known is not None and all(isinstance(d, int) for d in known):
                continue
            attributes = node_attributes(node)
            if attributes["operator"].decode() == AUTOGRAD_FUNCTION:
                continue
            params = torch_node_params_of(node)
            shape_of = SHAPE_RULES.get(attributes["operator"].decode())
            inputs = in_operand_order([tensors.get(name, (0, None)) for name in node.input], params)
            shape = None
            if shape_of is not None and all(dims is not None and all(isinstance(d, int) for d in dims)
                                            for _, dims in inputs):
                shape = shape_of([dims for _, dims in inputs], params)
            if element_type and shape is None:
                continue  # typed already, and no shape to add
            element_type = params.get("output_type") or inputs[0][0] or onnx.TensorProto.FLOAT
            set_value_info(model, node.output[0], element_type, shape)
            if params.get("function") in RECURRENT:  # (output, h_n[, c_n]): the initial states' shapes
                for state, (_, dims) in zip(node.output[1:params["differentiable_outputs"]], inputs[1:]):
                    set_value_info(model, state, element_type, dims)
                if params.get("draws"):  # the generator's state
                    set_value_info(model, node.output[-1], onnx.TensorProto.UINT8, None)
            else:  # (values, indices) functions: int64, the values' shape; RReLU's slopes: the values'
                for second in node.output[1:]:
                    set_value_info(model, second, onnx.TensorProto.INT64 if params.get("function") in WITH_INDICES
                                   else element_type, shape)
            declared = True
        if not declared:
            return


def _declare_autograd_function_outputs(model, nodes):
    """The outputs of custom autograd.Functions' nodes (`_export.autograd_functions`): their traced
    types; their traced shapes where the inputs have the traced shapes, else each dim as the input
    dim of its traced size (a graph re-derived at other shapes is proven against torch); the
    context number: int64, 0-d."""
    calls = [node for node in nodes if torch_node_operator(node) == AUTOGRAD_FUNCTION]
    if not calls:
        return
    tensors = inferred_tensors(model)
    for node in calls:
        params = torch_node_params_of(node)
        operands = [None if dims is None else list(dims)
                    for dims in in_operand_order([tensors.get(name, (0, None))[1] for name in node.input], params)]
        as_traced = operands == params["input_shapes"]
        for name, element_type, traced, dims in zip(node.output, params["output_types"], params["output_shapes"],
                                                    params["output_dims"]):
            shape = traced if as_traced else [_operand_dim(operands, dim) for dim in dims]
            set_value_info(model, name, element_type, shape)
        set_value_info(model, node.output[-1], onnx.TensorProto.INT64, [])


def _operand_dim(operands, dim):
    """A dim of `output_dims`: a size, or [input, dim] read from the inputs' shapes (None: unknown)."""
    if isinstance(dim, int):
        return dim
    shape = operands[dim[0]]
    return shape[dim[1]] if shape is not None and dim[1] < len(shape) else None


def set_value_info(model, name, element_type, shape):
    """The type of value `name`: in its graph output when it is one, else in value_info."""
    info = onnx.helper.make_tensor_value_info(name, element_type, shape)
    for values in (model.graph.output, model.graph.value_info):
        for k, value in enumerate(values):
            if value.name == name:
                values[k].CopyFrom(info)
                return
    model.graph.value_info.append(info)
