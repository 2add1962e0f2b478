"""Training-export symbolics that write torch nodes (`_onnx.torch_node`, run by
`_runtime.torch_ops`) where the exporter refuses an op: adaptive average pooling to sizes that do
not divide, elementwise, cumulative and reducing functions and losses (`FUNCTIONS`), integer bitwise
or; and reflect/replicate padding, which it exports but ONNX Runtime cannot differentiate. Ops it exports
that ONNX Runtime cannot differentiate are rewritten on the graph instead, where it is known which
values need gradients (`_graph.torch_nodes.gradients_through_torch`; the trace's requires_grad
flags are False after convolutions). An inference export (export_onnx) keeps torch's own symbolic,
or its refusal: a plain ONNX Runtime could not run the node.

`Tensor.detach` becomes a torch node whose input the gradient builder does not differentiate
(the exporter drops it, which would carry gradients through); values computed inside
`torch.no_grad()` are detached while tracing (`NoGradValuesDetached`).
"""
import onnx
import torch
from torch.onnx import symbolic_helper
from torch.onnx._internal.torchscript_exporter import symbolic_opset9, symbolic_opset11
from torch.onnx._internal.torchscript_exporter._globals import GLOBALS
from torch.onnx.errors import SymbolicValueError, UnsupportedOperatorError
from torch.utils._pytree import tree_flatten, tree_map

from .._onnx import TORCH_NODE_DOMAIN, torch_node_params
from .._torch_node_catalogue import ADAPTIVE_AVG_POOL, DETACH, FUNCTION, RRELU_SLOPES

RECURRENT = frozenset({"rnn_tanh", "rnn_relu", "gru", "lstm"})  # recurrent layers' FUNCTIONs: (output, h_n[, c_n])

# Losses the exporter refuses -> (leading tensors, the index of `reduction` among the constant
# arguments, the unreduced loss's shape: "elementwise" (the inputs') or "rows" (one per row)).
# Their weights must be None (`_function`).
_LOSSES = {
    **{name: (2, 0, "elementwise") for name in ("l1_loss", "smooth_l1_loss", "huber_loss", "soft_margin_loss")},
    "binary_cross_entropy": (2, 1, "elementwise"), "hinge_embedding_loss": (2, 1, "elementwise"),
    "margin_ranking_loss": (3, 1, "elementwise"), "cosine_embedding_loss": (3, 1, "rows"),
    "triplet_margin_loss": (3, 4, "rows"), "multi_margin_loss": (2, 3, "rows"),
    "multilabel_margin_loss": (2, 0, "rows"),
}
_LOSS_WEIGHTS = {"binary_cross_entropy": 0, "multi_margin_loss": 2}  # the index of the weight among the constants

# aten op -> (torch's symbolic or None, the opset to register at: torch's, so that ours wins,
# the number of leading tensor inputs, the torch function that runs it). Constant arguments after
# the tensors go to the function as they are (ints, floats); `_function` knows the keyword ones.
# Ops ONNX exports but ONNX Runtime cannot differentiate are rewritten on the graph instead
# (`_graph.torch_nodes.gradients_through_torch`): here only what the exporter refuses.
FUNCTIONS = {
    **{name: (None, 9, 1, name) for name in ("sinh", "cosh", "asinh", "acosh", "atanh", "erfinv", "trunc", "frac",
                                             "expm1", "cumprod", "logcumsumexp", "exp2", "sinc", "lgamma", "digamma",
                                             "erfc", "i0", "rad2deg", "deg2rad", "mvlgamma", "renorm", "nansum",
                                             "nanmean", "channel_shuffle")},
    **{f"special_{name}": (None, 9, 1, f"special.{name}") for name in ("ndtr", "ndtri", "log_ndtr", "entr")},
    **{name: (None, 9, 2, name) for name in ("xlogy", "hypot", "logaddexp", "logaddexp2", "copysign", "fmin", "fmax",
                                             "ldexp")},
    "special_xlog1py": (None, 9, 2, "special.xlog1py"),
    **{name: (None, 9, tensors, f"ops.aten.{name}") for name, (tensors, _, _) in _LOSSES.items()},
    "threshold": (symbolic_opset9.threshold, 9, 1, "threshold"),  # a non-zero threshold: refused by the exporter
    "round": (symbolic_opset11.round, 11, 1, "round"),  # with decimals: refused by the exporter
    "linalg_inv": (None, 9, 1, "linalg.inv"),
    "bitwise_or": (symbolic_opset9.bitwise_or, 9, 2, "bitwise_or"),  # torch exports bool only
    "multinomial": (symbolic_opset9.multinomial, 9, 1, "multinomial"),
    **{name: (None, 9, 1, name) for name in ("cummax", "cummin", "median", "kthvalue", "mode")},  # (values, indices)
    **{name: (None, 9, 1, name) for name in ("trace", "diag", "pdist")},
    "kron": (None, 9, 2, "kron"),
    **{f"_upsample_nearest_exact{dims}d": (None, 9, 1, f"ops.aten._upsample_nearest_exact{dims}d")
       for dims in (1, 2, 3)},
    "cdist": (symbolic_opset9.cdist, 9, 2, "ops.aten.cdist"),  # in training: torch's zero gradient at distance 0
    "__or_": (getattr(symbolic_opset9, "__or_"), 9, 2, "bitwise_or"),  # `a | b` (the registry drops a "_")
}


def torch_node_symbolics():
    """(aten op, symbolic, opset) of the symbolics writing torch nodes."""
    return (*((f"aten::adaptive_avg_pool{dims}d", _adaptive_avg_pool(dims), 9) for dims in (1, 2, 3)),
            ("aten::detach", _detach, 9), ("aten::pad", _pad, 11), ("aten::rrelu", _rrelu, 9),
            *((f"aten::{name}", _recurrent(name), 9) for name in ("rnn_tanh", "rnn_relu", "gru", "lstm")),
            *((f"aten::{name}", _function(name, default, tensors, function), opset)
              for name, (default, opset, tensors, function) in FUNCTIONS.items()))


def _torch_node(g, operator, inputs, *, rank, outputs=1, **params):
    """A torch node (`_onnx.torch_node`); one output has input 0's element type and `rank` dims
    (`outputs` > 1: a tuple, typed by the caller)."""
    output = g.op(f"{TORCH_NODE_DOMAIN}::ATen", *inputs, operator_s=operator, overload_name_s=torch_node_params(params),
                  outputs=outputs)
    if rank is not None and outputs == 1:
        output.setType(inputs[0].type().with_sizes([None] * rank))
    return output


def _adaptive_avg_pool(dims):
    """torch's adaptive_avg_pool{dims}d symbolic; where it refuses an output size that does not
    divide the input size, a training export writes a torch node (an inference export keeps the
    refusal: a plain ONNX Runtime could not run the node)."""
    default = getattr(symbolic_opset9, f"adaptive_avg_pool{dims}d")

    def symbolic(g, x, output_size):
        try:
            return default(g, x, output_size)
        except SymbolicValueError:
            if not GLOBALS.export_training:
                raise
        sizes = symbolic_helper._maybe_get_const(output_size, "is")
        if not isinstance(sizes, list):
            raise SymbolicValueError(f"adaptive_avg_pool{dims}d: the output size must be a constant", x)
        return _torch_node(g, ADAPTIVE_AVG_POOL, [x], rank=symbolic_helper._get_tensor_rank(x), output_size=sizes)
    return symbolic


def _pad(g, x, pad, mode, value):
    """F.pad: reflect and replicate padding, in a training export, as a torch node (ONNX Runtime's
    Pad gradient is for constant padding only); the other modes, and inference exports, torch's."""
    torch_mode = symbolic_helper._parse_arg(mode, "s")
    if not GLOBALS.export_training or torch_mode not in ("reflect", "replicate"):
        return symbolic_opset11.pad(g, x, pad, mode, value)
    pads = symbolic_helper._maybe_get_const(pad, "is")
    if not isinstance(pads, list):
        raise SymbolicValueError(f"F.pad(mode={torch_mode!r}): the pads must be constants", x)
    return _torch_node(g, FUNCTION, [x], rank=symbolic_helper._get_tensor_rank(x), function="nn.functional.pad",
                       args=[pads, torch_mode], kwargs={})


@symbolic_helper.parse_args("v", "f", "f", "i", "none")
def _rrelu(g, x, lower, upper, training, generator):
    """nn.RReLU in training: the slope of each negative element drawn by torch's own kernel
    (`rrelu_with_noise`, from torch's generator: torch.manual_seed reproduces eager's draws) in a
    torch node no gradient goes through, then x * slopes, whose gradient is those same slopes, as
    torch's (its symbolic's PRelu has no ONNX Runtime gradient). ORTTrainer's eval graph gets the
    fixed slope instead (`_graph.gradient_builder_preparation.disable_training_mode`)."""
    if not (GLOBALS.export_training and training):
        return symbolic_opset9.rrelu(g, x, lower, upper, training, generator)
    # the second input is the noise buffer torch's kernel fills: any tensor of x's shape
    _, slopes = _torch_node(g, FUNCTION, [x, x], rank=None, outputs=2, function=RRELU_SLOPES,
                            args=[lower, upper, True], kwargs={}, stop_gradient=[0, 1])
    slopes.setType(x.type())
    return g.op("Mul", x, slopes)


def _recurrent(name):
    """nn.RNN (aten::rnn_tanh, rnn_relu), and nn.GRU / nn.LSTM where ONNX Runtime cannot train them
    (bidirectional: its kernels run the forward direction only; an LSTM with proj_size: the exporter
    refuses it; dropout between layers in training: neither has it): a training export runs torch's
    op as one torch node, (output, h_n[, c_n]) all differentiable. ONNX Runtime has no gradient for
    ONNX's RNN at all. Else torch's symbolic (dropout with one layer draws nothing: left out).

    Dropout between layers draws its masks from torch's generator, as eager does (the same masks
    after the same torch.manual_seed); the node's last output is the generator's state it started
    from (`draws`), from which its gradient node draws the same masks again (`_runtime.torch_ops`)."""
    default = symbolic_opset9.lstm if name == "lstm" else symbolic_opset9._one_hidden_rnn(
        {"gru": "GRU"}.get(name, f"RNN_{name.removeprefix('rnn_').upper()}"))

    def symbolic(g, x, hidden, weights, *flags):
        packed = symbolic_helper._is_tensor_list(flags[0])  # (data, batch_sizes, hx, weights, has_biases, ..)
        if GLOBALS.export_training and packed and _draws(*flags[2:5]):
            module = {"gru": "GRU", "lstm": "LSTM"}.get(name, "RNN")
            dropout = symbolic_helper._parse_arg(flags[3], "f")
            raise SymbolicValueError(f"nn.{module} with dropout={dropout} between its layers cannot be trained in ONNX "
                                     "Runtime on a PackedSequence: pass the padded batch itself (the layer trains "
                                     "with its dropout then), or set dropout=0", x)
        if not GLOBALS.export_training or packed:
            return default(g, x, hidden, weights, *flags)
        has_biases, num_layers, dropout, train, bidirectional, batch_first = (
            symbolic_helper._parse_arg(value, kind) for value, kind in zip(flags, "iifiii"))
        states = symbolic_helper._unpack_list(hidden) if name == "lstm" else [hidden]
        parameters = symbolic_helper._unpack_list(weights)
        per_cell = len(parameters) // (num_layers * (2 if bidirectional else 1))  # 3 or 5: proj_size's weight
        draws = _draws(num_layers, dropout, train)
        if name in ("gru", "lstm") and not bidirectional and per_cell in (2, 4) and not draws:
            return default(g, x, hidden, weights, *flags[:2], 0.0, *flags[3:])
        tensors = [x, *states, *parameters]
        # the zeros the layer starts from when given no state: no gradient (h_0 and c_0, equal
        # constants, become one tensor, whose gradient the builder would define twice)
        constants = [1 + k for k, state in enumerate(states)
                     if state.node().kind() in ("onnx::Constant", "prim::Constant")]
        params = {"function": name, "kwargs": {}, "tensor_lists": [[1, 1 + len(states)]] * (name == "lstm")
                  + [[1 + len(states), len(tensors)]], "differentiable_outputs": 1 + len(states),
                  "args": [bool(has_biases), num_layers, dropout, bool(train), bool(bidirectional), bool(batch_first)],
                  **({"stop_gradient": constants} if constants else {}), **({"draws": True} if draws else {})}
        outputs = _torch_node(g, FUNCTION, tensors, rank=None, outputs=1 + len(states) + draws, **params)
        outputs[0].setType(x.type().with_sizes([None] * 3))
        for output, state in zip(outputs[1:], states):
            output.setType(state.type().with_sizes([None] * 3))
        if draws:
            outputs[-1].setType(x.type().with_dtype(torch.uint8).with_sizes([None]))
            return outputs[:-1]
        return outputs
    return symbolic


def _draws(num_layers, dropout, train):
    """Whether a recurrent layer draws dropout masks: between layers, in training mode."""
    num_layers, dropout, train = (symbolic_helper._parse_arg(value, kind) for value, kind in zip((num_layers, dropout,
                                                                                                  train), "ifi"))
    return bool(dropout and train and num_layers > 1)


_FLOATS = frozenset({"Float", "Double", "Half", "BFloat16", None})  # None: not known, treated as floating


def _scalar_type_name(value):
    return value.type().scalarType() if isinstance(value.type(), torch._C.TensorType) else "not a tensor"


# Ops a training export always runs in torch: multinomial draws from torch's generator (ONNX's
# Multinomial from ONNX Runtime's), so that `torch.manual_seed` reproduces the eager draws; cdist's
# export takes a square root of squared distances, whose gradient at a zero distance (a point and
# itself) is NaN where torch's is zero.
_TORCH_IN_TRAINING = frozenset({"multinomial", "cdist"})

# The output's rank from the first input's, where it differs from the inputs' largest rank.
_OUTPUT_RANKS = {"trace": lambda rank: 0, "pdist": lambda rank: 1, "diag": lambda rank: 3 - rank}


def _function(name, default, tensors, function):
    """The symbolic of aten::`name`: torch's where it has one and it takes the case; else, in a
    training export, a torch node (FUNCTION); else torch's refusal."""
    def symbolic(g, *args):
        inputs, constants = list(args[:tensors]), args[tensors:]
        if default is not None and not (GLOBALS.export_training and name in _TORCH_IN_TRAINING):
            try:
                return default(g, *args)
            except SymbolicValueError:  # bitwise_or of integers, round with decimals
                if not GLOBALS.export_training:
                    raise
        elif not GLOBALS.export_training:
            raise UnsupportedOperatorError(f"aten::{name}", GLOBALS.export_onnx_opset_version, None)
        params = {"function": function, "args": [], "kwargs": {}}
        if name == "round":  # round.decimals: a keyword
            if constants and not symbolic_helper._is_none(constants[0]):
                params["kwargs"] = {"decimals": symbolic_helper._get_const(constants[0], "i", "decimals")}
        elif name == "cumprod":  # (dim, dtype=None), dtype a keyword
            params["args"] = [symbolic_helper._get_const(constants[0], "i", "dim")]
            if not symbolic_helper._is_none(constants[1]):
                raise SymbolicValueError("torch.cumprod with a dtype cannot be trained in ONNX Runtime: cast the "
                                         "input instead", inputs[0])
        elif name in ("nansum", "nanmean"):  # (dim=None, keepdim=False, *, dtype=None)
            if not symbolic_helper._is_none(constants[2]):
                raise SymbolicValueError(f"torch.{name} with a dtype cannot be trained in ONNX Runtime: cast the "
                                         "input instead", inputs[0])
            dims = None if symbolic_helper._is_none(constants[0]) else \
                symbolic_helper._maybe_get_const(constants[0], "is")
            params["args"] = [dims or None, bool(symbolic_helper._get_const(constants[1], "b", "keepdim"))]
        elif name == "multinomial":  # (num_samples, replacement, *, generator): int64 indices
            if not symbolic_helper._is_none(constants[2]):
                raise SymbolicValueError("torch.multinomial with a generator cannot be traced: draw from the "
                                         "default generator (torch.manual_seed)", inputs[0])
            params["args"] = [_constant_value(value, name) for value in constants[:2]]
            params["output_type"] = onnx.TensorProto.INT64
        elif name.startswith("_upsample_nearest_exact"):  # (output_size, scale_factors), either None
            params["args"] = [None if symbolic_helper._is_none(value) else symbolic_helper._maybe_get_const(value, kind)
                              for value, kind in zip(constants, ("is", "fs"))]
        else:
            if name in _LOSS_WEIGHTS and not symbolic_helper._is_none(constants[_LOSS_WEIGHTS[name]]):
                raise SymbolicValueError(f"torch's {name} with a weight cannot be trained in ONNX Runtime: multiply "
                                         "its unreduced loss (reduction='none') by the weight instead", inputs[0])
            params["args"] = [_constant_value(value, name) for value in constants]
        ranks = [symbolic_helper._get_tensor_rank(value) for value in inputs]  # None: unknown, or a scalar
        rank = None if ranks[0] is None else max(r for r in ranks if r is not None)
        if name in _LOSSES:
            _, reduction, unreduced = _LOSSES[name]
            params["shape"] = unreduced if params["args"][reduction] == 0 else "scalar"
            rank = {"scalar": 0, "rows": 1}.get(params["shape"], rank)
        if name in WITH_INDICES and (name != "median" or constants):
            return _values_and_indices(g, inputs[0], rank, params)
        if name == "median":  # of all the values: a 0-d value only
            rank = 0
        elif name in _OUTPUT_RANKS and rank is not None:
            rank = _OUTPUT_RANKS[name](rank)
        elif name in ("nansum", "nanmean") and rank is not None and not params["args"][1]:  # dims reduced away
            rank = 0 if params["args"][0] is None else rank - len(params["args"][0])
        output = _torch_node(g, FUNCTION, inputs, rank=rank, **params)
        if "output_type" in params and rank is not None:
            output.setType(inputs[0].type().with_dtype(torch.int64).with_sizes([None] * rank))
        return output
    return symbolic


WITH_INDICES = frozenset({"cummax", "cummin", "median", "kthvalue", "mode"})


def _values_and_indices(g, x, rank, params):
    """A torch node with two outputs, (values, int64 indices), as torch's cummax or median(dim)
    return; the gradient flows through the values."""
    values, indices = _torch_node(g, FUNCTION, [x], rank=None, outputs=2, **params)
    if params["function"] in ("median", "kthvalue", "mode") and rank is not None and not params["args"][-1]:
        rank -= 1  # the dim is reduced away (keepdim False)
    if rank is not None:
        values.setType(x.type().with_sizes([None] * rank))
        indices.setType(x.type().with_dtype(torch.int64).with_sizes([None] * rank))
    return values, indices


def _constant_value(value, name):
    """A constant argument as a Python number (or list of numbers)."""
    if symbolic_helper._is_none(value):
        return None
    constant = symbolic_helper._maybe_get_const(value, "t")
    if not isinstance(constant, torch.Tensor):
        raise SymbolicValueError(f"aten::{name}: an argument computed in the graph (a constant is needed)", value)
    return constant.tolist()


def _detach(g, x):
    """Tensor.detach: the exporter writes nothing for it, so the gradient builder would carry
    gradients through where torch stops them (silently wrong gradients). In a training export, for
    a floating-point x: a torch node whose input is a stop-gradient edge (`_graph.torch_nodes`).
    Not only where the trace says x needs a gradient: it says False for some values that do (the
    outputs of convolutions)."""
    if not GLOBALS.export_training or _scalar_type_name(x) not in _FLOATS:
        return x
    output = _torch_node(g, DETACH, [x], rank=None)
    output.setType(x.type())  # x's own type and sizes: later symbolics may need them (BatchNorm's channels)
    return output


class NoGradValuesDetached(torch.overrides.TorchFunctionMode):
    """Active during a trace: a value a torch function computes under `torch.no_grad()` from a
    tensor that requires grad comes back `.detach()`ed, so that the trace records the stop (ONNX
    has no no-grad region; the gradient builder would differentiate through it). Only inside a
    trace that itself runs with gradients (a call under `torch.no_grad()` exports no gradient).
    In-place functions (their result is the tensor they changed) are left as they are."""

    def __enter__(self):
        self._tracing_with_grad = torch.is_grad_enabled()
        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if not self._tracing_with_grad or torch.is_grad_enabled() or getattr(func, "__name__", "").endswith("_"):
            return result
        values = tree_flatten((args, kwargs))[0]
        if not any(isinstance(value, torch.Tensor) and value.requires_grad for value in values):
            return result
        return tree_map(lambda value: value.detach() if isinstance(value, torch.Tensor) and value.is_floating_point()
                        else value, result)
