"""TorchScript-exporter symbolics for aten ops it lacks or exports wrong, registered for the
duration of our own exports only (`our_symbolics`)."""
import contextlib
import functools
import threading

import torch
from torch.onnx import symbolic_helper
from torch.onnx._internal.torchscript_exporter import (registration, symbolic_opset9, symbolic_opset11,
                                                       symbolic_opset12, symbolic_opset14)
from torch.onnx._internal.torchscript_exporter._globals import GLOBALS
from torch.onnx.errors import SymbolicValueError

from .._onnx import MARKER_DOMAIN
from .autograd_functions import python_op
from .torch_node_symbolics import torch_node_symbolics

_EXPORTING = threading.RLock()  # the registry is process-wide: one export with our symbolics at a time


@contextlib.contextmanager
def our_symbolics():
    """Our symbolics registered for one export, then removed: a user's own `torch.onnx.export` in
    the same process gets torch's symbolics back (a training export with ours would write torch
    nodes a plain ONNX Runtime cannot run), and a custom symbolic the user registered for the same
    op and opset is restored.

    A symbolic serves its opset and every later one: the exporter picks the newest registration
    at or below the target, ours before torch's at the same opset.
    """
    with _EXPORTING:
        users = {}
        for name, symbolic, opset in _symbolics():
            versions = registration.registry.get_function_group(name)
            if versions is not None and versions._functions.overridden(opset):
                users[name, opset] = versions._functions[opset]
            torch.onnx.register_custom_op_symbolic(name, symbolic, opset)
        try:
            yield
        finally:
            for name, _, opset in _symbolics():
                torch.onnx.unregister_custom_op_symbolic(name, opset)
            for (name, opset), symbolic in users.items():
                torch.onnx.register_custom_op_symbolic(name, symbolic, opset)


@functools.cache
def _symbolics():
    """(aten op, symbolic, opset) of every symbolic of ours."""
    return (("aten::diff", _diff, 9), ("aten::cumsum", _cumsum, 11),  # ONNX CumSum: opset 11
            ("aten::scaled_dot_product_attention", _attention, 14), ("aten::embedding", _embedding, 9),
            ("aten::cross_entropy_loss", _cross_entropy, 12), ("aten::movedim", _movedim, 9),
            ("aten::rms_norm", _rms_norm, 9), ("aten::max", _extremum(symbolic_opset9.max, "ArgMax"), 9),
            ("aten::min", _extremum(symbolic_opset9.min, "ArgMin"), 9),
            *((f"aten::{name}", symbolic, opset) for name, symbolic, opset in _ACTIVATIONS),
            ("prim::PythonOp", python_op, 1),  # reached in training exports only (no autograd inlining)
            *torch_node_symbolics())


# Activations ONNX Runtime 1.19 has no gradient for (PRelu, Elu, Celu, Selu, Softplus and so Mish,
# HardSigmoid, HardSwish) or whose Clip gradient is not torch's at the bounds (hardtanh, ReLU6): in a
# training export, the same function from ops it differentiates as torch does (Relu, Exp, Log,
# Where, Tanh, Clip, arithmetic); an inference export (export_onnx) keeps torch's op.
# Exp reads min(x, 0) (softplus: min(beta x, threshold)): the branch Where leaves out must not
# overflow, or its gradient, multiplied by Where's zero, would be NaN.
def _constant(g, value):
    return g.op("Constant", value_t=torch.tensor(value, dtype=torch.float32))


def _exp_minus_one_below_zero(g, x, scale):
    """Where(x > 0, x, alpha (exp(x / scale) - 1)) without alpha: the negative branch's exp(x/s) - 1."""
    negative = g.op("Min", x, _constant(g, 0.0))
    if scale != 1.0:
        negative = g.op("Div", negative, _constant(g, scale))
    return g.op("Sub", g.op("Exp", negative), _constant(g, 1.0))


def _elu_like(g, x, alpha, scale=1.0, input_scale=1.0, output_scale=1.0):
    """output_scale * (x > 0 ? x : alpha (exp(input_scale x / scale) - 1)), torch's elu family."""
    scaled = g.op("Mul", x, _constant(g, input_scale)) if input_scale != 1.0 else x
    negative = g.op("Mul", _exp_minus_one_below_zero(g, scaled, scale), _constant(g, alpha))
    y = g.op("Where", g.op("Greater", x, _constant(g, 0.0)), x, negative)
    return g.op("Mul", y, _constant(g, output_scale)) if output_scale != 1.0 else y


def _elu(g, x, alpha, scale, input_scale):
    if not GLOBALS.export_training:
        return symbolic_opset9.elu(g, x, alpha, scale, input_scale)
    alpha, scale, input_scale = (symbolic_helper._maybe_get_const(v, "f") for v in (alpha, scale, input_scale))
    return _elu_like(g, x, alpha, input_scale=input_scale, output_scale=scale)


def _celu(g, x, alpha):
    if not GLOBALS.export_training:
        return symbolic_opset12.celu(g, x, alpha)
    alpha = symbolic_helper._maybe_get_const(alpha, "f")
    return _elu_like(g, x, alpha, scale=alpha)


def _selu(g, x):
    if not GLOBALS.export_training:
        return symbolic_opset9.selu(g, x)
    return _elu_like(g, x, 1.6732632423543772, output_scale=1.0507009873554805)


def _softplus_of(g, x, beta=1.0, threshold=20.0):
    """torch.softplus: x where beta x > threshold, else log(1 + exp(beta x)) / beta."""
    z = g.op("Mul", x, _constant(g, beta)) if beta != 1.0 else x
    smooth = g.op("Log", g.op("Add", g.op("Exp", g.op("Min", z, _constant(g, threshold))), _constant(g, 1.0)))
    smooth = g.op("Div", smooth, _constant(g, beta)) if beta != 1.0 else smooth
    return g.op("Where", g.op("Greater", z, _constant(g, threshold)), x, smooth)


def _softplus(g, x, beta, threshold):
    if not GLOBALS.export_training:
        return symbolic_opset9.softplus(g, x, beta, threshold)
    beta, threshold = (symbolic_helper._maybe_get_const(v, "f") for v in (beta, threshold))
    return _softplus_of(g, x, beta, threshold)


def _mish(g, x):
    if not GLOBALS.export_training:
        return symbolic_opset9.mish(g, x)
    return g.op("Mul", x, g.op("Tanh", _softplus_of(g, x)))


def _hardsigmoid(g, x):
    """hardtanh(x + 3, 0, 6) / 6: no gradient at x = -3 and 3, as torch's."""
    if not GLOBALS.export_training:
        return symbolic_opset9.hardsigmoid(g, x)
    return g.op("Div", _hardtanh(g, g.op("Add", x, _constant(g, 3.0)), 0.0, 6.0), _constant(g, 6.0))


def _hardswish(g, x):
    """x * hardtanh(x + 3, 0, 6) / 6: the gradient x / 3 + 1/2 strictly between -3 and 3, 0 at
    -3 and 1 at 3, as torch's."""
    if not GLOBALS.export_training:
        return symbolic_opset14.hardswish(g, x)
    clipped = _hardtanh(g, g.op("Add", x, _constant(g, 3.0)), 0.0, 6.0)
    return g.op("Div", g.op("Mul", x, clipped), _constant(g, 6.0))


def _prelu(g, x, weight):
    """x > 0 ? x : weight x, the weight broadcast over dim 1 as torch's symbolic does (ONNX Runtime
    has no PRelu gradient)."""
    if not GLOBALS.export_training:
        return symbolic_opset9.prelu(g, x, weight)
    rank = symbolic_helper._get_tensor_rank(x)
    if rank is not None and rank > 2:
        weight = symbolic_helper._unsqueeze_helper(g, weight, list(range(1, rank - 1)))
    elif rank == 0:
        weight = g.op("Reshape", weight, g.op("Constant", value_t=torch.tensor([], dtype=torch.int64)))
    return g.op("Where", g.op("Greater", x, _constant(g, 0.0)), x, g.op("Mul", weight, x))


@symbolic_helper.parse_args("v", "f", "f")
def _hardtanh(g, x, min_val, max_val):
    """hardtanh and relu6 (which traces as hardtanh): torch's symbolic writes Clip, whose ONNX Runtime
    gradient passes the gradient at the bounds (torch.clamp's rule); torch's hardtanh passes none
    there, and a ReLU6 after zeros sits at its bound 0 often (MobileNet's BatchNorm biases got
    gradients 27% off). So x where min < x < max, else the bound (x itself for NaN), by Where."""
    if not GLOBALS.export_training:
        return symbolic_opset11.hardtanh(g, x, min_val, max_val)
    dtype = torch.onnx.JitScalarType.from_value(x, torch.onnx.JitScalarType.FLOAT).dtype()
    low, high = (g.op("Constant", value_t=torch.tensor(value, dtype=dtype)) for value in (min_val, max_val))
    below_high = g.op("Where", g.op("Less", x, high), x, high)
    at_or_below_low = g.op("Where", g.op("LessOrEqual", x, low), low, x)  # NaN stays NaN
    return g.op("Where", g.op("Greater", x, low), below_high, at_or_below_low)


def _relu6(g, x):
    if not GLOBALS.export_training:
        return symbolic_opset11.relu6(g, x)
    return _hardtanh(g, x, 0.0, 6.0)


_ACTIVATIONS = (("prelu", _prelu, 9), ("hardtanh", _hardtanh, 11), ("relu6", _relu6, 11), ("elu", _elu, 9),
                ("celu", _celu, 12), ("selu", _selu, 9), ("softplus", _softplus, 9), ("mish", _mish, 9),
                ("hardsigmoid", _hardsigmoid, 9), ("hardswish", _hardswish, 14))


def _extremum_at_index(g, x, dim, keepdim, *, arg_op):
    """(values, indices) of torch.max/min(x, dim, keepdim) as the element at ArgMax/ArgMin, picked
    by GatherElements: torch routes the gradient to that one index, where a ReduceMax's gradient
    (`_graph.gradients.extrema_differentiable`, torch's amax rule) shares it among ties. ArgMax
    picks the first of ties, as torch's CPU kernels do."""
    dim = symbolic_helper._get_const(dim, "i", "dim")
    keepdim = symbolic_helper._get_const(keepdim, "i", "keepdim")
    indices = g.op(arg_op, x, axis_i=dim, keepdims_i=1)
    values = g.op("GatherElements", x, indices, axis_i=dim)
    if keepdim:
        return values, indices
    return symbolic_helper._squeeze_helper(g, values, [dim]), symbolic_helper._squeeze_helper(g, indices, [dim])


def _extremum(default, arg_op):
    """The symbolic of aten::max or aten::min: torch's for max(x) and max(x, y), whose gradients
    are torch's; in a training export, `_extremum_at_index` for max(x, dim, keepdim)."""
    def symbolic(g, x, dim_or_y=None, keepdim=None):
        if not GLOBALS.export_training or keepdim is None:
            return default(g, x, dim_or_y, keepdim)
        return _extremum_at_index(g, x, dim_or_y, keepdim, arg_op=arg_op)
    return symbolic


@symbolic_helper.parse_args("v", "t", "t")
def _movedim(g, data, source, destination):
    """torch.movedim: torch's symbolic writes a negative source dim into the Transpose's perm as it
    is (`x.movedim(-1, 1)` gave perm [0, -1], which ONNX rejects): dims taken modulo the rank."""
    rank = symbolic_helper._get_tensor_rank(data)
    if rank is None:
        raise SymbolicValueError("torch.movedim: the input's rank is unknown to the exporter", data)
    source, destination = ([int(dim) % rank for dim in dims.view(-1).tolist()] for dims in (source, destination))
    perm = [dim for dim in range(rank) if dim not in source]
    for dim, moved in sorted(zip(destination, source)):
        perm.insert(dim, moved)
    if perm == list(range(rank)):
        return data
    return g.op("Transpose", data, perm_i=perm)


def _rms_norm(g, x, normalized_shape, weight, eps):
    """F.rms_norm (nn.RMSNorm), which the exporter lacks: x / sqrt(mean(x^2 over the normalized
    dims) + eps) * weight; eps None is x's dtype's machine epsilon, as torch's."""
    dims = len(symbolic_helper._get_const(normalized_shape, "is", "normalized_shape"))
    if symbolic_helper._is_none(eps):
        dtype = x.type().dtype() if isinstance(x.type(), torch._C.TensorType) and x.type().dtype() else torch.float32
        eps = torch.finfo(dtype).eps
    else:
        eps = symbolic_helper._get_const(eps, "f", "eps")
    mean_square = g.op("ReduceMean", g.op("Mul", x, x), axes_i=list(range(-dims, 0)), keepdims_i=1)
    scale = g.op("Sqrt", g.op("Add", mean_square, g.op("Constant", value_t=torch.tensor(eps, dtype=torch.float32))))
    normalized = g.op("Div", x, scale)
    return normalized if symbolic_helper._is_none(weight) else g.op("Mul", normalized, weight)


def _cross_entropy(g, logits, target, weight, reduction, ignore_index, label_smoothing):
    """F.cross_entropy; with label_smoothing e > 0 (torch's symbolic refuses it), for class-index
    targets: (1 - e) * w_y * nll + e * mean over the classes of -w_c * log_softmax (w: the class
    weights, or 1), both 0 where the target is ignore_index, reduced as `reduction` (mean: divided by
    the counted targets' weights), as torch computes it. Built from LogSoftmax, GatherElements and
    reductions, whose gradients ONNX Runtime has. Class-probability targets:
    `_cross_entropy_of_probabilities`."""
    smoothing = symbolic_helper._maybe_get_const(label_smoothing, "f")
    if not isinstance(smoothing, (float, int)):
        raise SymbolicValueError("cross_entropy: label_smoothing is computed in the graph; pass a Python float",
                                 logits)
    if _scalar_type(target).dtype().is_floating_point:
        return _cross_entropy_of_probabilities(g, logits, target, weight, reduction, float(smoothing))
    if not smoothing:
        return symbolic_opset12.cross_entropy_loss(g, logits, target, weight, reduction, ignore_index,
                                                   label_smoothing)
    reduction = ("none", "mean", "sum")[_constant_int(reduction, "cross_entropy", "reduction")]
    ignore = _constant_int(ignore_index, "cross_entropy", "ignore_index")

    def constant(value, dtype=torch.int64):
        return g.op("Constant", value_t=torch.tensor(value, dtype=dtype))

    log_probs = g.op("LogSoftmax", logits, axis_i=1)
    counted = g.op("Not", g.op("Equal", target, constant(ignore)))
    safe_target = g.op("Where", counted, target, constant(0))
    picked = g.op("Squeeze", g.op("GatherElements", log_probs, g.op("Unsqueeze", safe_target, constant([1])),
                                  axis_i=1), constant([1]))
    mask = g.op("Cast", counted, to_i=_scalar_type(logits).onnx_type())
    if not weight.node().mustBeNone():
        target_weights = g.op("Gather", weight, safe_target, axis_i=0)
        picked = g.op("Mul", picked, target_weights)
        mask_weights = g.op("Mul", mask, target_weights)
        log_probs = _class_weighted(g, log_probs, weight, logits)
    else:
        mask_weights = mask
    mean_over_classes = g.op("ReduceMean", log_probs, axes_i=[1], keepdims_i=0)
    per_target = g.op("Neg", g.op("Add", g.op("Mul", picked, constant(1.0 - smoothing, torch.float32)),
                                  g.op("Mul", mean_over_classes, constant(smoothing, torch.float32))))
    losses = g.op("Mul", per_target, mask)
    if reduction == "none":
        return losses
    total = g.op("ReduceSum", losses, keepdims_i=0)
    return total if reduction == "sum" else g.op("Div", total, g.op("ReduceSum", mask_weights, keepdims_i=0))


def _class_weighted(g, log_probs, weight, logits):
    """log_probs [N, C, ...] times the class weights [C], broadcast over the other dims."""
    rank = symbolic_helper._get_tensor_rank(logits)
    if rank is None:
        raise SymbolicValueError("cross_entropy with class weights: the logits' rank is unknown", logits)
    axes = g.op("Constant", value_t=torch.tensor([0, *range(2, rank)], dtype=torch.int64))
    return g.op("Mul", log_probs, g.op("Unsqueeze", weight, axes))  # [1, C, 1, ...]


def _cross_entropy_of_probabilities(g, logits, target, weight, reduction, smoothing):
    """F.cross_entropy with class-probability targets (torch's symbolic writes a
    SoftmaxCrossEntropyLoss, which takes class indices only): per sample -sum_c w_c t_c log p_c with
    the targets smoothed, t (1 - e) + e / C, as torch computes it; mean: over the samples."""
    log_probs = g.op("LogSoftmax", logits, axis_i=1)
    if not weight.node().mustBeNone():
        log_probs = _class_weighted(g, log_probs, weight, logits)
    classes = g.op("Constant", value_t=torch.tensor([1], dtype=torch.int64))
    losses = g.op("Neg", g.op("ReduceSum", g.op("Mul", target, log_probs), classes, keepdims_i=0))
    if smoothing:
        spread = g.op("Neg", g.op("ReduceMean", log_probs, axes_i=[1], keepdims_i=0))
        losses = g.op("Add", g.op("Mul", losses, _constant(g, 1.0 - smoothing)),
                      g.op("Mul", spread, _constant(g, smoothing)))
    reduction = ("none", "mean", "sum")[_constant_int(reduction, "cross_entropy", "reduction")]
    if reduction == "none":
        return losses
    return g.op("ReduceSum" if reduction == "sum" else "ReduceMean", losses, keepdims_i=0)


def _diff(g, data, n, dim, prepend, append):
    """torch.diff: prepend and append concatenated along `dim` (in their promoted type), then
    x[1:] - x[:-1] along it, n times (logical xor for bool, as torch).

    Why: transformers' masking_utils (4.57 and 5) calls it on the position ids when a model gets
    no attention mask (`find_packed_sequence_indices`: GPT-2, Llama, ...). `n` and `dim` must be
    constants: they are plain ints when traced.
    """
    n = _constant_int(n, "torch.diff", "n")
    dim = _constant_int(dim, "torch.diff", "dim")
    rank = symbolic_helper._get_tensor_rank(data)
    if dim < 0 and rank is not None:  # Slice and Concat take negative axes from opset 11 only
        dim += rank
    parts = [part for part in (prepend, data, append) if not symbolic_helper._is_none(part)]
    scalar_type = functools.reduce(torch.promote_types, (_scalar_type(part).dtype() for part in parts))
    parts = [_cast(g, part, scalar_type) for part in parts]
    x = g.op("Concat", *parts, axis_i=dim) if len(parts) > 1 else parts[0]
    subtract = "Xor" if scalar_type == torch.bool else "Sub"
    for _ in range(n):
        later = symbolic_helper._slice_helper(g, x, axes=[dim], starts=[1], ends=[torch.iinfo(torch.int64).max])
        earlier = symbolic_helper._slice_helper(g, x, axes=[dim], starts=[0], ends=[-1])
        x = g.op(subtract, later, earlier)
    return x


def _cumsum(g, data, dim, dtype):
    """torch.cumsum with torch's result type: bool and integer inputs sum as int64, or as `dtype`.

    Why: torch's symbolic leaves a bool input bool (which ONNX CumSum rejects; transformers'
    packed-sequence check `(position_diff != 1).cumsum(-1)` has one), an int32 one int32, and
    ignores a constant `dtype`.
    """
    dim = _constant_int(dim, "torch.cumsum", "dim")
    if not symbolic_helper._is_none(dtype):
        result = torch.onnx.JitScalarType(_constant_int(dtype, "torch.cumsum", "dtype")).dtype()
    else:
        result = _scalar_type(data).dtype()
        if not (result.is_floating_point or result.is_complex):
            result = torch.int64
    axis = g.op("Constant", value_t=torch.tensor(dim, dtype=torch.int64))
    return g.op("CumSum", _cast(g, data, result), axis)


def _constant_int(value, op, name):
    if symbolic_helper._is_constant(value):
        return symbolic_helper._get_const(value, "i", name)
    raise SymbolicValueError(
        f"{op}: argument {name} is computed in the graph (from a dynamic size?), the ONNX export "
        f"needs it constant: pass a Python int for {name}", value)


def _scalar_type(value):
    return torch.onnx.JitScalarType.from_value(value)


def _cast(g, value, scalar_type):
    if _scalar_type(value).dtype() == scalar_type:
        return value
    return g.op("Cast", value, to_i=torch.onnx.JitScalarType.from_dtype(scalar_type).onnx_type())


@symbolic_helper.parse_args("v", "v", "v", "v", "f", "b", "v", "b")
def _attention(g, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch's sdpa symbolic, with its dropout in training mode and a boolean mask turned into
    the dtype's lowest finite value instead of -inf.

    Dropout: torch's symbolic emits Dropout(weights, ratio) without a training_mode input, a
    Dropout that drops nothing, although sdpa drops whenever dropout_p > 0; ORT's DropoutGrad
    would still divide by 1 - ratio (gradients through the attention weights 1/(1-p) too large).

    Why: with -inf, a query row that may attend to no key (left padding in a causal LM) comes
    out of Softmax as NaN; torch's symbolic zeroes that output, but ORT's Softmax gradient still
    multiplies by the NaN and every gradient turns NaN. With the lowest finite value masked
    keys still get exactly 0 weight (exp underflows), such a row gets finite weights, and its
    output is zeroed by "does the row allow any key", as torch's own sdpa does.
    """
    attention = symbolic_opset14.scaled_dot_product_attention
    if (symbolic_helper._is_none(attn_mask)
            or torch.onnx.JitScalarType.from_value(attn_mask) != torch.onnx.JitScalarType.BOOL):
        return _dropping(g, attention(g, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa))
    dtype = torch.onnx.JitScalarType.from_value(query)
    allowed, masked = (g.op("Constant", value_t=torch.tensor([number], dtype=dtype.dtype()))
                       for number in (0.0, torch.finfo(dtype.dtype()).min))
    output = _dropping(g, attention(g, query, key, value, g.op("Where", attn_mask, allowed, masked), dropout_p,
                                    is_causal, scale, enable_gqa))
    mask = g.op("Cast", attn_mask, to_i=dtype.onnx_type())
    row_allows_a_key = g.op("ReduceMax", mask, axes_i=[-1], keepdims_i=1)  # axes attribute: opsets 14-17
    return g.op("Mul", output, row_allows_a_key)


def _dropping(g, output):
    """`output` (sdpa's final MatMul) with the Dropout before it, if any, given training_mode=True."""
    dropout = output.node().inputsAt(0).node()
    if dropout.kind() == "onnx::Dropout" and dropout.inputsSize() == 2:
        training_mode = g.op("Constant", value_t=torch.tensor(True))
        training_mode.node().moveBefore(dropout)
        dropout.addInput(training_mode)
    return output


def _embedding(g, weight, indices, padding_idx, scale_grad_by_freq, sparse):
    """torch's embedding symbolic (a Gather), marked when a training export has a padding_idx.

    Why: torch gives row padding_idx no gradient from the lookup, ONNX's Gather has no such
    argument (torch's symbolic only warns). The marker `ort_trainer::PaddingRows(rows, indices,
    padding_idx)` tells `_graph.gradient_builder_preparation` which rows to keep out of the gradient.
    """
    rows = g.op("Gather", weight, indices)
    padding_idx = symbolic_helper._maybe_get_const(padding_idx, "i")
    if symbolic_helper._maybe_get_const(scale_grad_by_freq, "b") and GLOBALS.export_training:
        raise SymbolicValueError("embedding with scale_grad_by_freq=True cannot be trained in ONNX Runtime "
                                 "(its gradient is not scaled by frequency there): set scale_grad_by_freq=False",
                                 weight)
    if not isinstance(padding_idx, int) or padding_idx < 0 or not GLOBALS.export_training:
        return rows
    marked = g.op(f"{MARKER_DOMAIN}::PaddingRows", rows, indices, padding_idx_i=padding_idx)
    marked.setType(rows.type())
    return marked
