"""fp32 products moved to torch's CPU kernels where they are faster (`_graph.cpu_products`, decided by
`_runtime.product_speed`): each form computes what ONNX Runtime computed, and a model whose products
all go to torch trains as the ONNX Runtime graph does."""
import copy

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

from ort_trainer import ORTTrainer, ORTTrainerOptions, optim
from ort_trainer._graph.cpu_products import MATRIX_PRODUCT, matrix_products_in_torch
from ort_trainer._onnx import torch_node_operator, torch_node_params_of
from ort_trainer._runtime import cpu_buffers, product_kernels, product_speed
from ort_trainer._runtime.torch_ops import register_executor
from ort_trainer._torch_node_catalogue import LAYER_NORM_GRAD, ROWS_ADDED
from ort_trainer.ortmodule import DebugOptions, ORTModule

from . import models


def _model(nodes, inputs, outputs):
    graph = helper.make_graph(nodes, "products", [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)
                                                  for name, shape in inputs.items()],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs])
    opsets = [helper.make_opsetid("", 14), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _run(model, feeds):
    register_executor()
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


make = helper.make_node
# name -> (nodes, input shapes, outputs, the form ONNX Runtime runs: (trans_a, trans_b, m, k, n), op types left)
FORMS = {
    "matmul": ([make("MatMul", ["a", "b"], ["y"])], {"a": [5, 3], "b": [3, 4]}, ["y"], (False, False, 5, 3, 4), []),
    "gemm transposed operands, alpha": (
        [make("Gemm", ["a", "b"], ["y"], transA=1, transB=1, alpha=0.5)], {"a": [3, 5], "b": [4, 3]}, ["y"],
        (True, True, 5, 3, 4), []),
    "gemm with a bias, beta": ([make("Gemm", ["a", "b", "c"], ["y"], beta=2.0, alpha=1.5)],
                               {"a": [5, 3], "b": [3, 4], "c": [4]}, ["y"], (False, False, 5, 3, 4), []),
    "transposed weight folded": ([make("Transpose", ["w"], ["wt"], perm=[1, 0]), make("MatMul", ["a", "wt"], ["y"])],
                                 {"a": [5, 3], "w": [4, 3]}, ["y"], (False, True, 5, 3, 4), []),
    "transposed weight read twice": (
        [make("Transpose", ["w"], ["wt"], perm=[1, 0]), make("MatMul", ["a", "wt"], ["y"]),
         make("Relu", ["wt"], ["r"])], {"a": [5, 3], "w": [4, 3]}, ["y", "r"], (False, True, 5, 3, 4),
        ["Transpose", "Relu"]),
    # a weight gradient: dW = (A^T dY)^T computed as dY^T A, where the Transpose wrote it
    "transposed result": (
        [make("Gemm", ["a", "dy"], ["dwt"], transA=1), make("Transpose", ["dwt"], ["dw"], perm=[1, 0]),
         make("Relu", ["dw"], ["y"])], {"a": [3, 5], "dy": [3, 4]}, ["y"], (True, False, 4, 3, 5), ["Relu"]),
    # a language model's vocabulary projection: a batch of rows by a transposed weight
    "batch of rows": ([make("Transpose", ["w"], ["wt"], perm=[1, 0]), make("MatMul", ["x", "wt"], ["y"])],
                      {"x": [2, 5, 3], "w": [4, 3]}, ["y"], (False, True, 10, 3, 4), []),
    # its input gradient as the gradient builder writes it: dY W, W^T transposed back by the flag
    "fused matmul, alpha": (
        [make("Transpose", ["w"], ["wt"], perm=[1, 0]),
         make("FusedMatMul", ["dy", "wt"], ["dx"], domain="com.microsoft", transB=1, alpha=0.5)],
        {"dy": [2, 5, 4], "w": [4, 3]}, ["dx"], (False, False, 10, 4, 3), []),
}


@pytest.mark.parametrize("name", sorted(FORMS))
def test_a_product_in_torch_computes_what_onnx_runtime_did(name):
    nodes, inputs, outputs, form, left = FORMS[name]
    model = _model(nodes, inputs, outputs)
    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in inputs.items()}
    expected = _run(model, feeds)
    seen = []
    assert matrix_products_in_torch(model, lambda form: seen.append(form) or True) == 1
    assert seen == [form]
    assert sorted(node.op_type for node in model.graph.node if node.op_type != "ATen") == sorted(left)
    assert [node for node in model.graph.node if node.op_type == "ATen"][0].attribute[0].s.decode() == MATRIX_PRODUCT
    for ours, theirs in zip(_run(model, feeds), expected):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)


def test_products_torch_would_not_run_faster_and_batched_ones_stay():
    nodes = [make("MatMul", ["a", "b"], ["y"]), make("MatMul", ["x", "v"], ["z"]),
             make("FusedMatMul", ["x", "b"], ["t"], domain="com.microsoft", transA=1),
             make("FusedMatMul", ["a", "b"], ["s"], domain="com.microsoft", transBatchA=1)]
    model = _model(nodes, {"a": [5, 3], "b": [3, 4], "x": [2, 3, 5], "v": [2, 5, 4]}, ["y", "z", "t", "s"])
    seen = []
    assert matrix_products_in_torch(model, lambda form: seen.append(form) or False) == 0
    # two batches, a batch of transposed matrices and a batch-transposing product are not asked about
    assert seen == [(False, False, 5, 3, 4)]
    assert [node.op_type for node in model.graph.node] == ["MatMul", "MatMul", "FusedMatMul", "FusedMatMul"]


def test_a_transpose_goes_when_every_product_reading_it_went_to_torch():
    """The weight of a vocabulary projection, transposed once for its forward and its input gradient."""
    nodes = [make("Transpose", ["w"], ["wt"], perm=[1, 0]), make("MatMul", ["x", "wt"], ["y"]),
             make("FusedMatMul", ["dy", "wt"], ["dx"], domain="com.microsoft", transB=1)]
    inputs = {"x": [2, 5, 3], "w": [4, 3], "dy": [2, 5, 4]}
    model = _model(nodes, inputs, ["y", "dx"])
    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in inputs.items()}
    expected = _run(model, feeds)
    assert matrix_products_in_torch(model, lambda form: True) == 2
    assert [node.op_type for node in model.graph.node] == ["ATen", "ATen"]
    for ours, theirs in zip(_run(model, feeds), expected):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
    kept = _model(nodes, inputs, ["y", "dx"])  # only one of them goes: the other still reads it
    assert matrix_products_in_torch(kept, lambda form: form[1]) == 1
    assert sorted(node.op_type for node in kept.graph.node) == ["ATen", "FusedMatMul", "Transpose"]


@pytest.fixture
def every_product_in_torch(monkeypatch):
    """Every product is decided for torch; the forms asked about are recorded."""
    asked = []
    monkeypatch.setattr(product_speed, "torch_product_faster", lambda form, threads: asked.append(form) or True)
    return asked


def _train(make_model, desc, loss_fn, make_batch, options=None, steps=4):
    trainer = ORTTrainer(make_model(), desc, optim.AdamConfig(lr=1e-2), loss_fn=loss_fn,
                         options=ORTTrainerOptions(options or {}))
    losses = [trainer.train_step(*make_batch(step)) for step in range(steps)]
    losses = [(loss[0] if isinstance(loss, (tuple, list)) else loss).item() for loss in losses]
    return losses, dict(trainer.model.named_parameters())


@pytest.fixture
def written_into_bound_buffers(monkeypatch):
    """The graph outputs torch nodes wrote into the caller's bound buffers (`cpu_buffers.bound_output`)."""
    written, original = [], cpu_buffers.bound_output

    def recording(params, k, *args, **kwargs):
        found = original(params, k, *args, **kwargs)
        if found is not None:
            written.append(params["graph_outputs"][k])
        return found
    monkeypatch.setattr(cpu_buffers, "bound_output", recording)
    monkeypatch.setattr(product_kernels, "bound_output", recording)
    return written


@pytest.mark.parametrize("name", ["transformer", "mlp"])
def test_a_model_with_its_products_in_torch_trains_as_the_onnx_runtime_graph(
        name, every_product_in_torch, written_into_bound_buffers, monkeypatch):
    """The seed model (linears on sequences: weight gradients as transposed results) and an MLP
    (Gemms with a bias): Adam steps within 1e-6 of the graph with ONNX Runtime's products. The products
    write the weights' gradients, and the MLP's fetched logits, into ORTTrainer's bound buffers (ONNX
    Runtime copied them there)."""
    case = {"transformer": (models.transformer, models.TRANSFORMER_DESC, models.transformer_loss,
                            models.transformer_batch),
            "mlp": (models.mlp, models.MLP_DESC, models.mlp_loss, models.mlp_batch)}[name]
    # label sparsity off: with the logits fetched, it makes the vocabulary projection a torch node of its own
    options = {"graph_transformer": {"label_sparsity": False}}
    losses, weights = _train(*case, options)
    assert len(every_product_in_torch) >= 3
    if name == "transformer":  # the vocabulary projection's weight gradient, after two LayerNormalizations
        assert (True, False, models.VOCAB, 7 * 4, 32) in every_product_in_torch
        assert {"model.decoder.weight_grad", "model.transformer_encoder.layers.0.linear1.weight_grad"} <= set(
            written_into_bound_buffers)
    else:
        assert {"model.net.0.weight_grad", "model.net.3.weight_grad", "logits"} <= set(written_into_bound_buffers)
    monkeypatch.setattr(product_speed, "torch_product_faster", lambda form, threads: False)
    expected_losses, expected_weights = _train(*case, options)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-6)
    assert losses[-1] < losses[0]
    for parameter_name, expected in expected_weights.items():
        torch.testing.assert_close(weights[parameter_name], expected, rtol=1e-5, atol=1e-6)


def _session_options(**settings):
    options = onnxruntime.SessionOptions()
    for name, value in settings.items():
        setattr(options, name, value)
    return options


@pytest.mark.parametrize("options", [
    {"debug": {"deterministic_compute": True}},
    {"session_options": _session_options(use_deterministic_compute=True)},
    {"session_options": _session_options(execution_mode=onnxruntime.ExecutionMode.ORT_PARALLEL)},  # no torch node
], ids=["deterministic_compute", "deterministic session options", "parallel execution"])
def test_every_product_stays_in_onnx_runtime(options, every_product_in_torch):
    def make_model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

    desc = {"inputs": [("x", ["batch", 6]), ("y", ["batch", 2])], "outputs": [("loss", [], True)]}
    x, y = torch.randn(5, 6), torch.randn(5, 2)
    losses, _ = _train(make_model, desc, F.mse_loss, lambda step: (x, y), options=options, steps=2)
    assert every_product_in_torch == []
    assert losses[1] < losses[0]


def test_ortmodule_with_its_products_in_torch_trains_as_eager(every_product_in_torch):
    model = models.mlp()
    eager, wrapped = copy.deepcopy(model), ORTModule(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, wrapped)]
    for step in range(3):
        x, target = models.mlp_batch(step)
        losses = []
        for module, optimizer in zip((eager, wrapped), optimizers):
            optimizer.zero_grad()
            loss = F.cross_entropy(module(x), target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert every_product_in_torch


def test_a_product_under_half_a_gflop_is_not_measured():
    before = product_speed.measured_products()
    assert product_speed.torch_product_faster((False, False, 700, 200, 800), threads=2) is False  # 0.22 GFLOP
    assert product_speed.measured_products() == before


def test_a_measured_product_is_decided_by_its_timings():
    form = (True, False, 1000, 512, 1024)  # 1.05 GFLOP
    faster = product_speed.torch_product_faster(form, threads=2)
    mlas_ms, torch_ms = product_speed.measured_products()[form, 2]
    assert mlas_ms > 0 and torch_ms > 0
    assert faster == (torch_ms < 1.1 * mlas_ms)  # a near tie goes to torch (`product_speed._MARGIN`)


def test_a_large_product_is_measured_with_its_largest_dim_scaled_down():
    trans_a, trans_b, m, k, n = product_speed._scaled((True, False, 50257, 1024, 768))
    assert (trans_a, trans_b, k, n) == (True, False, 1024, 768)
    assert 2 * m * k * n == pytest.approx(product_speed._MEASURED_FLOPS, rel=1e-3)
    assert product_speed._scaled((False, False, 700, 200, 8000)) == (False, False, 700, 200, 8000)  # 2.2 GFLOP


def test_a_language_model_with_every_product_in_torch_trains_as_eager(every_product_in_torch, tmp_path,
                                                                       monkeypatch):
    """GPT-2 under ORTModule: the vocabulary projection (a batch of rows by the tied embedding,
    transposed) and its input gradient (the builder's FusedMatMul) run in torch too, and the
    embedding's rows are added to the tied weight's gradient in place (`_graph.tied_embedding_gradient`),
    the layer norms' gradients are torch's; losses and every gradient equal eager's. Label sparsity
    off: it makes that projection a torch node of its own."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER", "0")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=40, n_positions=8, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    eager, wrapped = copy.deepcopy(model), ORTModule(model, DebugOptions(save_onnx=True, onnx_prefix="gpt2"))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager, wrapped)]
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, 40, (2, 8), generator=generator)
        losses = []
        for module, optimizer in zip((eager, wrapped), optimizers):
            optimizer.zero_grad()
            loss = module(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            losses.append(loss.item())
        for (name, ours), theirs in zip(wrapped.named_parameters(), eager.parameters()):
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-6)
        for optimizer in optimizers:
            optimizer.step()
        assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    assert (False, True, 16, 16, 40) in every_product_in_torch  # the projection, its 2 x 8 rows as one matrix
    graph = onnx.load(tmp_path / "gpt2_optimized_training.onnx").graph
    [added] = [node for node in graph.node if torch_node_operator(node) == ROWS_ADDED]
    assert added.output[0] == "model.transformer.wte.weight_grad" and torch_node_params_of(added)["in_place"]
    assert sum(torch_node_operator(node) == LAYER_NORM_GRAD for node in graph.node) == 3  # ln_1, ln_2, ln_f
    assert not any(node.op_type == "LayerNormalizationGrad" for node in graph.node)
    assert (False, False, 16, 40, 16) in every_product_in_torch  # its input gradient, dY W


def test_a_tied_embeddings_rows_are_added_in_ortrainers_bound_gradient(every_product_in_torch,
                                                                        written_into_bound_buffers, monkeypatch):
    """GPT-2's wte is also lm_head's weight: the projection's weight gradient is written into the
    bound gradient buffer and the looked-up rows added there (`rows_added` in place); Adam steps as
    the graph with ONNX Runtime's products."""
    transformers = pytest.importorskip("transformers")
    desc = {"inputs": [("input_ids", ["batch", "seq"]), ("labels", ["batch", "seq"])],
            "outputs": [("loss", [], True), ("logits", ["batch", "seq", 40])]}

    def train():
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=1, n_head=2, n_embd=16, vocab_size=40, n_positions=8, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, loss_type="ForCausalLM"))
        trainer = ORTTrainer(model, desc, optim.AdamConfig(lr=1e-2))
        generator = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(3):
            ids = torch.randint(0, 40, (2, 8), generator=generator)
            losses.append(trainer.train_step(input_ids=ids, labels=ids)[0].item())
        return losses, {name: p.detach().clone() for name, p in model.named_parameters()}

    losses, weights = train()
    assert "model.transformer.wte.weight_grad" in written_into_bound_buffers
    monkeypatch.setattr(product_speed, "torch_product_faster", lambda form, threads: False)
    expected_losses, expected_weights = train()
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-6)
    for name, expected in expected_weights.items():
        torch.testing.assert_close(weights[name], expected, rtol=1e-5, atol=1e-6, msg=name)


def test_with_recomputation_every_product_stays_in_onnx_runtime(every_product_in_torch, tmp_path):
    """ORTTrainer's recompute options keep ONNX Runtime's kernels, as ORTModule's checkpointed graphs: a
    torch node's output feeding a recompute copy's wait (a PassThrough) failed the run ("PassThrough input
    and output are not sharing the same buffer"), and torch's outputs beside the arena cost the memory
    recomputation saves. Losses as without recomputation."""
    def make_model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 6), torch.nn.GELU(),
                                   torch.nn.Linear(6, 2))

    desc = {"inputs": [("x", ["batch", 6]), ("y", ["batch", 2])], "outputs": [("loss", [], True)]}
    x, y = torch.randn(5, 6), torch.randn(5, 2)
    path = tmp_path / "training.onnx"
    options = {"graph_transformer": {"gelu_recompute": True},
               "debug": {"graph_save_paths": {"model_with_training_graph_path": str(path)}}}
    losses, _ = _train(make_model, desc, F.mse_loss, lambda step: (x, y), options=options, steps=3)
    assert not [node for node in onnx.load(path).graph.node if node.op_type == "ATen"]
    expected, _ = _train(make_model, desc, F.mse_loss, lambda step: (x, y), steps=3)
    assert every_product_in_torch  # asked without recomputation, and run in torch there
    assert losses == pytest.approx(expected, rel=1e-6)
