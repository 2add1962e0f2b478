"""A tied embedding's gradient (`_graph.tied_embedding_gradient`): the Sum of the embedding's
GatherNDGrad and the projection's weight gradient becomes one torch node adding the rows, with the
values of the Sum, written into the torch node's output it reads (in place) or a copy of ONNX
Runtime's."""
import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper

from ort_trainer._graph.cpu_products import MATRIX_PRODUCT
from ort_trainer._graph.tied_embedding_gradient import rows_into_weight_gradients
from ort_trainer._onnx import TORCH_NODE_DOMAIN, torch_node, torch_node_operator, torch_node_params_of
from ort_trainer._runtime.torch_ops import register_executor
from ort_trainer._torch_node_catalogue import ROWS_ADDED

VOCAB, WIDTH, TOKENS = 6, 4, 9
make = helper.make_node
_ROWS = "wte_grad/fast_gather_grad/nd_indices"


def _tied_gradient_graph(writer, *, dense_read_again=False):
    """Sum(GatherNDGrad(Shape(w), ids as [N, 1], rows), dW) as built graphs have it; `writer`: 'torch'
    (a MATRIX_PRODUCT writes dW) or 'ort' (a MatMul does)."""
    product_params = {"trans_a": True, "trans_b": False, "alpha": 1.0, "beta": 1.0}
    product = (torch_node(MATRIX_PRODUCT, ["dy", "a"], ["dw"], params=product_params) if writer == "torch"
               else make("Gemm", ["dy", "a"], ["dw"], transA=1))
    nodes = [product, make("Shape", ["w"], ["w_shape"]), helper.make_node("Constant", [], ["axis"], value_ints=[-1]),
             make("Unsqueeze", ["ids", "axis"], [_ROWS]),
             make("GatherNDGrad", ["w_shape", _ROWS, "rows"], ["wte_grad_0"], domain="com.microsoft"),
             make("Sum", ["wte_grad_0", "dw"], ["wte_grad"])]
    outputs = [helper.make_tensor_value_info("wte_grad", TensorProto.FLOAT, [VOCAB, WIDTH])]
    if dense_read_again:
        nodes.append(make("Relu", ["dw"], ["dw_relu"]))
        outputs.append(helper.make_tensor_value_info("dw_relu", TensorProto.FLOAT, [VOCAB, WIDTH]))
    inputs = [helper.make_tensor_value_info("dy", TensorProto.FLOAT, [TOKENS, VOCAB]),
              helper.make_tensor_value_info("a", TensorProto.FLOAT, [TOKENS, WIDTH]),
              helper.make_tensor_value_info("w", TensorProto.FLOAT, [VOCAB, WIDTH]),
              helper.make_tensor_value_info("ids", TensorProto.INT64, [TOKENS]),
              helper.make_tensor_value_info("rows", TensorProto.FLOAT, [TOKENS, WIDTH])]
    typed = [helper.make_tensor_value_info("dw", TensorProto.FLOAT, [VOCAB, WIDTH])]  # an ATen output is not inferred
    opsets = [helper.make_opsetid("", 14), helper.make_opsetid("com.microsoft", 1),
              helper.make_opsetid(TORCH_NODE_DOMAIN, 1)]
    graph = helper.make_graph(nodes, "tied", inputs, outputs, value_info=typed)
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _run(model, feeds):
    register_executor()
    return onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("writer", ["torch", "ort"])
def test_the_rows_are_added_with_the_values_of_the_sum(writer):
    """Repeated tokens (their rows summed first, as GatherNDGrad did) and a negative id (from the
    end): every value equal to the dense Sum's, bit for bit."""
    rng = np.random.default_rng(0)
    feeds = {"dy": rng.standard_normal((TOKENS, VOCAB), dtype=np.float32),
             "a": rng.standard_normal((TOKENS, WIDTH), dtype=np.float32),
             "w": np.zeros((VOCAB, WIDTH), np.float32), "ids": np.array([1, 3, 1, -1, 0, 3, 3, 2, 1]),
             "rows": rng.standard_normal((TOKENS, WIDTH), dtype=np.float32)}
    model = _tied_gradient_graph(writer)
    expected = _run(model, feeds)[0]
    assert rows_into_weight_gradients(model) == 1
    assert [node.op_type for node in model.graph.node if node.op_type in ("Sum", "GatherNDGrad", "Shape")] == []
    added = next(node for node in model.graph.node if torch_node_operator(node) == ROWS_ADDED)
    assert torch_node_params_of(added) == {"in_place": writer == "torch"}
    np.testing.assert_array_equal(_run(model, feeds)[0], expected)


def test_a_gradient_another_node_reads_is_copied_not_written_into():
    rng = np.random.default_rng(1)
    feeds = {"dy": rng.standard_normal((TOKENS, VOCAB), dtype=np.float32),
             "a": rng.standard_normal((TOKENS, WIDTH), dtype=np.float32),
             "w": np.zeros((VOCAB, WIDTH), np.float32), "ids": np.arange(TOKENS) % VOCAB,
             "rows": rng.standard_normal((TOKENS, WIDTH), dtype=np.float32)}
    model = _tied_gradient_graph("torch", dense_read_again=True)
    expected = _run(model, feeds)
    assert rows_into_weight_gradients(model) == 1
    added = next(node for node in model.graph.node if torch_node_operator(node) == ROWS_ADDED)
    assert torch_node_params_of(added) == {"in_place": False}
    for ours, theirs in zip(_run(model, feeds), expected):
        np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(expected[1], np.maximum(feeds["dy"].T @ feeds["a"], 0))  # dW itself unchanged
