"""Every torch-node operator (`_onnx.torch_node`: ONNX Runtime's ATen op running one of our torch
kernels), declared once, with the parts of its contract. The parts live in the stages that use
them, keyed by these names; `tests/test_torch_node_catalogue.py` checks each registry against this
list, both ways:

- its kernel: `_runtime.torch_ops.IMPLEMENTATIONS` (every operator has one);
- its output shape rule: `_graph.torch_node_shapes.SHAPE_RULES` (ONNX infers nothing of an ATen
  node's outputs), or why it needs none (`shape`);
- its gradient (`gradient`): the operator of its gradient node, which
  `_graph.torch_nodes.register_torch_node_gradients` registers with ONNX Runtime's gradient builder;
  or STOP_GRADIENT (no gradient flows through it: a stop-gradient edge); or why it needs none;
- whether its nodes may draw from torch's generator (`draws`): recompute never repeats a node that
  does (`draws_random_numbers`; a copy would draw other numbers).

Who writes the nodes: the training export's symbolics (`_export.torch_node_symbolics`,
`_export.autograd_functions`), the graph rewrites (`_graph.torch_nodes`, `_graph.bf16_products`,
`_graph.cpu_kernels`, `_graph.cpu_products`, `_graph.label_sparsity`) and, for gradient nodes, ONNX
Runtime's gradient builder.
"""
from dataclasses import dataclass

_PREFIX = "ort_trainer::"

SHAPE_RULE = "a rule in `_graph.torch_node_shapes.SHAPE_RULES`"
# why an operator needs no shape rule
TYPED_WHERE_WRITTEN = ("none needed: typed where its nodes are written (by the rewrite, or as the outputs of the "
                       "node it replaces)")
TYPED_BY_THE_BUILDER = "none needed: a gradient node, whose outputs ONNX Runtime's gradient builder types"
TRACED = "none needed: its outputs' traced types and shapes are in its params (`_graph.torch_node_shapes`)"

STOP_GRADIENT = "none: a stop-gradient edge, no gradient flows through it"
# why an operator needs no gradient
BUILT_GRAPHS_ONLY = "none needed: its nodes are written into built graphs only, after the gradient builder"


@dataclass(frozen=True)
class TorchOperator:
    """One torch-node operator and its parts (the module docstring says where each lives)."""

    name: str
    gradient: str  # its gradient node's operator, STOP_GRADIENT or BUILT_GRAPHS_ONLY
    shape: str = SHAPE_RULE  # or why it needs no rule
    draws: bool = False  # some of its nodes draw from torch's generator (`draws_random_numbers` says which)


#: operator name -> TorchOperator
CATALOGUE = {}


def _declare(name, **parts):
    """Adds the operator `ort_trainer::<name>` to CATALOGUE; returns its full name."""
    full = _PREFIX + name
    CATALOGUE[full] = TorchOperator(full, **parts)
    return full


# Gradient nodes: one node computes the gradients of every input the builder wants, by one autograd
# pass of the forward recomputed (a bf16 product's from the bf16 factors its forward kept, a custom
# autograd.Function's on its kept ctx), its outputs compacted after the build
# (`_graph.torch_nodes.finish_torch_node_gradients`).
EINSUM_GRAD = _declare("einsum_grad", gradient=BUILT_GRAPHS_ONLY, shape=TYPED_BY_THE_BUILDER)
ADAPTIVE_AVG_POOL_GRAD = _declare("adaptive_avg_pool_grad", gradient=BUILT_GRAPHS_ONLY, shape=TYPED_BY_THE_BUILDER)
# a FUNCTION that drew random numbers draws the same again, from the state its forward started from
FUNCTION_GRAD = _declare("function_grad", gradient=BUILT_GRAPHS_ONLY, shape=TYPED_BY_THE_BUILDER)
PRODUCT_GRAD = _declare("bf16_product_grad", gradient=BUILT_GRAPHS_ONLY, shape=TYPED_BY_THE_BUILDER)
AUTOGRAD_FUNCTION_GRAD = _declare("autograd_function_grad",  # the Function's own backward, on the ctx kept
                                  gradient=BUILT_GRAPHS_ONLY, shape=TYPED_BY_THE_BUILDER)
# on the kept rows only where the returned scores' gradient is a scalar zero (unused), else dense
LABELLED_PROJECTION_GRAD = _declare("labelled_projection_grad", gradient=BUILT_GRAPHS_ONLY,
                                    shape=TYPED_BY_THE_BUILDER)

# Forward nodes the export writes (`_export.torch_node_symbolics`, `_export.autograd_functions`) or
# the graph rewrites before the gradient builder (`_graph.torch_nodes`, `_graph.bf16_products`).
FUNCTION = _declare("function", gradient=FUNCTION_GRAD, draws=True)  # torch.<function>(*inputs, *args, **kwargs)
ADAPTIVE_AVG_POOL = _declare("adaptive_avg_pool", gradient=ADAPTIVE_AVG_POOL_GRAD)
EINSUM = _declare("einsum", gradient=EINSUM_GRAD)
DETACH = _declare("detach", gradient=STOP_GRADIENT)  # Tensor.detach
AUTOGRAD_FUNCTION = _declare("autograd_function", gradient=AUTOGRAD_FUNCTION_GRAD, shape=TRACED)  # Function.apply
PRODUCT = _declare("bf16_product", gradient=PRODUCT_GRAD, shape=TYPED_WHERE_WRITTEN)  # a product computed in bf16
# a vocabulary projection whose scores are returned, and their labelled rows, which the loss reads
# (`_graph.label_sparsity`)
LABELLED_PROJECTION = _declare("labelled_projection", gradient=LABELLED_PROJECTION_GRAD, shape=TYPED_WHERE_WRITTEN)
# a factor's bf16 copy (the product's gradient goes to the fp32 factors); in built CPU graphs, a Cast to bf16
TO_BF16 = _declare("to_bf16", gradient=STOP_GRADIENT)

# Kernel substitutions in built CPU graphs (`_graph.cpu_kernels`, `_graph.torch_nodes`,
# `_graph.bf16_products`, `_graph.cpu_products`).
TO_FP32 = _declare("to_fp32", gradient=BUILT_GRAPHS_ONLY)  # a Cast from bf16
LOG_SOFTMAX_FP32 = _declare("log_softmax_fp32", gradient=BUILT_GRAPHS_ONLY, shape=TYPED_WHERE_WRITTEN)  # bf16 logits
SOFTMAX_GRAD_TO_BF16 = _declare("softmax_grad_to_bf16", gradient=BUILT_GRAPHS_ONLY, shape=TYPED_WHERE_WRITTEN)
SOFTMAX_GRAD = _declare("softmax_grad", gradient=BUILT_GRAPHS_ONLY, shape=TYPED_WHERE_WRITTEN)  # the same in fp32
# an fp32 product torch's kernel computes faster than ONNX Runtime's
MATRIX_PRODUCT = _declare("matrix_product", gradient=BUILT_GRAPHS_ONLY, shape=TYPED_WHERE_WRITTEN)
# a tied embedding's rows added to the weight's other gradient (`_graph.tied_embedding_gradient`)
ROWS_ADDED = _declare("embedding_rows_added", gradient=BUILT_GRAPHS_ONLY, shape=TYPED_WHERE_WRITTEN)
# torch's native_layer_norm_backward for ONNX Runtime's LayerNormalizationGrad
LAYER_NORM_GRAD = _declare("layer_norm_grad", gradient=BUILT_GRAPHS_ONLY, shape=TYPED_WHERE_WRITTEN)
GELU_GRAD = _declare("tanh_gelu_grad", gradient=BUILT_GRAPHS_ONLY, shape=TYPED_WHERE_WRITTEN)  # torch's gelu_backward
# torch's backward where the CPU provider has no ResizeGrad, ConvTransposeGrad kernel
RESIZE_GRAD = _declare("resize_grad", gradient=BUILT_GRAPHS_ONLY, shape=TYPED_WHERE_WRITTEN)
CONV_TRANSPOSE_GRAD = _declare("conv_transpose_grad", gradient=BUILT_GRAPHS_ONLY, shape=TYPED_WHERE_WRITTEN)

#: forward operator -> its gradient node's operator
GRADIENTS = {name: entry.gradient for name, entry in CATALOGUE.items() if entry.gradient in CATALOGUE}
#: the gradient nodes' operators
GRADIENT_OPERATORS = frozenset(GRADIENTS.values())
#: the operators no gradient flows through
STOPS_GRADIENT = frozenset(name for name, entry in CATALOGUE.items() if entry.gradient == STOP_GRADIENT)

RRELU_SLOPES = "ops.aten.rrelu_with_noise_functional"  # the FUNCTION whose output 1 is nn.RReLU's slopes


def draws_random_numbers(operator, params):
    """Whether a torch node of `operator` and `params` draws from torch's generator: multinomial,
    RReLU's slopes, a recurrent layer's dropout (`draws`). A copy of it would draw other numbers."""
    entry = CATALOGUE.get(operator)
    return entry is not None and entry.draws and (
        bool(params.get("draws")) or params.get("function") in ("multinomial", RRELU_SLOPES))
