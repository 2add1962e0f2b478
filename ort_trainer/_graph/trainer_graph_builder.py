"""ORTTrainer's graphs: the exported forward + loss turned into ONNX Runtime's training graph
(forward, loss, backward: a gradient output per parameter) and its eval graph."""
from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import onnx
from onnxruntime.capi._pybind_state import GradientGraphBuilder, get_optimized_model

from .._export.checkpointing import segment_of
from .._onnx import quiet_session_options
from .autocast import lower_precision
from .cpu_kernels import kernel_substitutions
from .embedding_sparsity import drop_padding_rows
from .gradient_builder_preparation import (builder_fixes_after_optimization, disable_training_mode,
                                           padding_rows_without_gradient, prepare_for_gradient, weights_as_inputs)
from .label_sparsity import gather_labelled_rows
from .missing_gradient import missing_gradient
from .recompute import Recompute
from .torch_node_shapes import declare_torch_node_outputs
from .torch_nodes import finish_torch_node_gradients

if TYPE_CHECKING:
    from .batch_statistics import BatchStatistics

LOSS_SCALE_INPUT = "__loss_scale"
# Ops that draw from ONNX Runtime's default generator (ORT's fused forms of Dropout included).
_RANDOM_OPS = {"Dropout", "BitmaskDropout", "BiasDropout", "BitmaskBiasDropout", "RandomNormal", "RandomNormalLike",
               "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli"}


def draws_random_numbers(model: onnx.ModelProto | bytes) -> bool:
    """Whether a run of `model` (an ONNX model, or serialized) draws random numbers: a training-mode
    Dropout, a random op."""
    if isinstance(model, bytes):
        model = onnx.load_from_string(model)
    return any(node.op_type in _RANDOM_OPS for node in model.graph.node)


def _scale_loss(model, loss_name):
    """Adds a scalar input LOSS_SCALE_INPUT and returns the name of loss * scale.

    Differentiating the scaled loss gives scaled gradients (mixed-precision loss scaling); the
    user still gets the unscaled loss.
    """
    model.graph.input.append(onnx.helper.make_tensor_value_info(LOSS_SCALE_INPUT, onnx.TensorProto.FLOAT, []))
    scaled = f"{loss_name}__scaled"
    model.graph.node.append(onnx.helper.make_node("Mul", [loss_name, LOSS_SCALE_INPUT], [scaled]))
    model.graph.output.append(onnx.helper.make_tensor_value_info(scaled, onnx.TensorProto.FLOAT, []))
    return scaled


def _gradient_graph(model, trainable, loss_name, options, *, recompute=None, lower=None):
    """ORT's training graph of `model` (gradients of `loss_name` for `trainable`), as an ONNX model.
    `recompute` (a `_graph.recompute.Recompute`, or None) adds its copies to the optimized forward
    and schedules them in the training graph; torch.utils.checkpoint's segments are recomputed
    either way. `lower`: rewrites the optimized forward (an ONNX model, in place) before the
    gradient is built: the mixed-precision casts, placed after ORT's optimizer so that its cast
    propagation cannot move them (on the CPU, a cast it moves next to one the CPU provider inserts
    is folded away, and with it the rounding).

    Raises MissingGradientError when an op on the way lacks a gradient, chained to ORT's error.
    """
    forward = onnx.load_from_string(get_optimized_model(model.SerializeToString(), set(trainable), options))
    if lower is not None:
        lower(forward)
    builder_fixes_after_optimization(forward)
    optimized = forward.SerializeToString()
    if recompute is None and any(segment_of(node.name) is not None for node in forward.graph.node):
        recompute = Recompute(gelu=False, attention_dropout=False, layers=None)  # checkpointed segments only
    if recompute is not None:
        optimized, plan = recompute.add_nodes(optimized)
    try:
        builder = GradientGraphBuilder(optimized, {loss_name}, set(trainable), loss_name, options)
        builder.build()
    except RuntimeError as error:
        missing = missing_gradient(str(error), model, trainable, [loss_name])
        if missing is None:
            raise
        raise missing from error
    training = onnx.load_from_string(builder.get_model())
    finish_torch_node_gradients(training)
    if recompute is not None:
        recompute.schedule(training, plan)
    return training


def symbolic_shapes(model):
    """`model` annotated by ONNX Runtime's symbolic shape inference (utils.run_symbolic_shape_infer),
    as the original ran it on the exported model: value_info for the tensors ONNX's own inference
    leaves without a shape, which ORT's optimizations and gradient builder then know.

    Raises:
        RuntimeError: the tool failed on this model (it cannot follow every shape computation, e.g.
            nn.MultiheadAttention's in-projection), chained to its error.
    """
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference  # imports sympy: when asked

    try:
        return SymbolicShapeInference.infer_shapes(model, auto_merge=True, guess_output_rank=True)
    except Exception as error:  # the tool raises AssertionError, KeyError, Exception, ...
        detail = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        raise RuntimeError(
            "utils.run_symbolic_shape_infer: ONNX Runtime's symbolic shape inference "
            f"(onnxruntime.tools.symbolic_shape_infer) failed on the exported model ({detail}); "
            "set utils.run_symbolic_shape_infer=False") from error


def build_graphs(model: onnx.ModelProto, trainable: Sequence[str], read_only: Sequence[str],
                 output_names: Sequence[str], loss_name: str, *, device_type: str | None = None,
                 loss_scaling: bool = False, compute_dtype: str | None = None, recompute: Recompute | None = None,
                 shape_inference: bool = False, batch_statistics: BatchStatistics | None = None,
                 faster_in_torch: Callable[..., bool] | None = None, label_sparsity: bool = False,
                 embedding_sparsity: bool = False) -> tuple[bytes, bytes]:
    """Returns (training graph, eval graph) as serialized ONNX models.

    The training graph computes `output_names` (the outputs the caller fetches; the loss is
    differentiated either way) and one `<param>_grad` output per `trainable` parameter (of the
    loss times the LOSS_SCALE_INPUT feed when loss_scaling); the eval graph computes
    `output_names` with dropout off. Outputs not fetched are not graph outputs, so ONNX Runtime
    neither materializes nor keeps them. `model` (the exported forward) is consumed: modified in
    place. `read_only`: the other weights the graphs read as inputs (frozen parameters, BatchNorm
    running statistics). Both graphs get the kernel substitutions of `device_type`
    (`kernel_substitutions`). `compute_dtype` ('float16', 'bfloat16' or None): both graphs compute
    their matrix products in it (`_graph.autocast`). Before the gradient is built, the fixes of
    `_graph.gradient_builder_preparation`; an op without a gradient raises MissingGradientError. `recompute`: a
    `_graph.recompute.Recompute` (the recompute options), or None. `shape_inference`: run
    `symbolic_shapes` on the forward first. `batch_statistics`: a `_graph.batch_statistics.BatchStatistics`,
    or None: its rewrite of the training-mode BatchNorms of the training graph, whose statistics
    outputs follow `output_names`. `faster_in_torch`: which fp32 products run in torch's kernels
    (`_graph.cpu_products`; CPU graphs), or None. `label_sparsity`: both graphs compute the projection
    and cross-entropy of a loss with an ignore_index on the kept rows only (`_graph.label_sparsity`);
    where the logits are fetched (fp32), the loss on those rows and the logits dense.
    `embedding_sparsity`: the per-token nodes after an embedding with a
    padding_idx compute the non-padding rows (`_graph.embedding_sparsity`).
    """
    weights_as_inputs(model, [*trainable, *read_only])  # first: no copy below holds weights
    declare_torch_node_outputs(model)
    if shape_inference:
        model = symbolic_shapes(model)
    if label_sparsity:  # fetched fp32 logits too: a scalar zero is their gradient (`_graph.torch_nodes`)
        gather_labelled_rows(model, output_names, returned_scores=compute_dtype is None, differentiable=trainable)
    if embedding_sparsity:
        drop_padding_rows(model, [*trainable, *read_only])
    eval_model = copy.deepcopy(model)
    disable_training_mode(eval_model)
    padding_rows_without_gradient(eval_model, trainable=())
    lower = None
    if compute_dtype is not None:
        lower = functools.partial(lower_precision, dtype=compute_dtype, device_type=device_type)
        lower(eval_model)
        lower = functools.partial(lower, differentiable=trainable)
    if batch_statistics is not None:
        batch_statistics.rewrite(model)
    prepare_for_gradient(model, trainable)
    if loss_scaling:
        loss_name = _scale_loss(model, loss_name)
    training = _gradient_graph(model, trainable, loss_name, quiet_session_options(), recompute=recompute, lower=lower)
    statistics = list(batch_statistics.outputs) if batch_statistics is not None else []
    _set_outputs(training, list(output_names) + statistics + [f"{name}_grad" for name in trainable])
    _set_outputs(eval_model, output_names)
    substitute = kernel_substitutions(device_type)
    if substitute is not None:  # on the outputs fetched: what is not one may be rewritten
        substitute(training, eval_model, faster_in_torch=faster_in_torch)
    return training.SerializeToString(), eval_model.SerializeToString()


def _set_outputs(model, names):
    """The graph outputs become `names`, in order; the others stay typed as value_info (a torch
    node's output gets no inferred type)."""
    outputs = {o.name: o for o in model.graph.output}
    ordered = [outputs[name] for name in names]
    known = {info.name for info in model.graph.value_info}
    model.graph.value_info.extend(o for name, o in outputs.items() if name not in names and name not in known)
    del model.graph.output[:]
    model.graph.output.extend(ordered)
