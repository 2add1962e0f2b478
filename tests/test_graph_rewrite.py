"""fast_softmax_cross_entropy: the rewritten loss graphs give torch's loss and gradients.

Each case exports a small model + loss, builds the training and eval graphs (build_graphs applies
the rewrite), runs them in plain ONNX Runtime sessions and compares with torch autograd.
"""
import numpy as np
import onnx
import onnxruntime
import pytest
import torch
import torch.nn as nn

from ort_trainer import ORTTrainer, optim
from ort_trainer._compile import trainer_compiler
from ort_trainer._export import trace as _export
from ort_trainer._export.binding import bind_inputs
from ort_trainer._export.trace import graph_name
from ort_trainer._graph import trainer_graph_builder
from ort_trainer._graph.cpu_kernels import (fast_gelu_grad, fast_softmax_cross_entropy, gelu_grads_in_torch,
                                            layer_norm_grads_in_torch, substitute_cpu_kernels)
from ort_trainer._graph.trainer_graph_builder import build_graphs
from ort_trainer._onnx import quiet_session_options
from ort_trainer._runtime.torch_ops import register_executor

from . import models

CLASSES = 11
LOSS_OPS = {"SoftmaxCrossEntropyLoss", "SoftmaxCrossEntropyLossGrad"}


class Head(nn.Module):
    """Logits [rows, CLASSES] (or [rows, CLASSES, extra] with spatial=True) from features."""

    def __init__(self, spatial=False):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(6, CLASSES * (3 if spatial else 1))
        self.spatial = spatial

    def forward(self, x):
        out = self.linear(x)
        return out.view(x.shape[0], CLASSES, 3) if self.spatial else out


def _rows(count, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, 6, generator=generator) * 3, generator


def _labels(generator, shape, ignored=(), ignore_value=-100):
    labels = torch.randint(0, CLASSES, shape, generator=generator)
    for row in ignored:
        labels[row] = ignore_value
    return labels


def _exported(model, loss_fn, input_names, output_names, inputs):
    binding = bind_inputs(model, input_names, loss_fn is not None)
    return _export.export_training_model(model, loss_fn, binding, output_names, dict(zip(input_names, inputs)), 14)


def run(loss_fn, x, labels, spatial=False):
    """(training graph, eval graph, ours {loss, eval_loss, grads}, torch's {loss, grads})."""
    model = Head(spatial)
    exported = _exported(model, loss_fn, ["x", "labels"], ["loss", "logits"], [x, labels])
    names = [graph_name(name) for name, _ in model.named_parameters()]
    training, evaluation = build_graphs(exported, names, [], ["loss", "logits"], "loss",
                                        device_type="cpu")
    params = {graph_name(name): p.detach().numpy() for name, p in model.named_parameters()}
    feeds = {"x": x.numpy(), "labels": labels.numpy(), **params}
    options = quiet_session_options()
    options.intra_op_num_threads = 1
    train_session = onnxruntime.InferenceSession(training, options, providers=["CPUExecutionProvider"])
    outputs = dict(zip([o.name for o in train_session.get_outputs()], train_session.run(None, feeds)))
    eval_session = onnxruntime.InferenceSession(evaluation, options, providers=["CPUExecutionProvider"])
    eval_feeds = {i.name: feeds[i.name] for i in eval_session.get_inputs()}
    eval_loss = eval_session.run(["loss"], eval_feeds)[0]
    ours = {"loss": float(outputs["loss"]), "eval_loss": float(eval_loss),
            "grads": {name: outputs[f"{name}_grad"] for name in names}}

    loss = loss_fn(model(x), labels)
    loss.backward()
    theirs = {"loss": loss.item(),
              "grads": {graph_name(name): p.grad.numpy() for name, p in model.named_parameters()}}
    return onnx.load_from_string(training), onnx.load_from_string(evaluation), ours, theirs


def op_types(model):
    return {node.op_type for node in model.graph.node}


def assert_matches(ours, theirs, tolerance=1e-6):
    assert abs(ours["loss"] - theirs["loss"]) <= tolerance * abs(theirs["loss"]), (ours["loss"], theirs["loss"])
    assert abs(ours["eval_loss"] - theirs["loss"]) <= tolerance * abs(theirs["loss"])
    for name, expected in theirs["grads"].items():
        error = np.abs(ours["grads"][name] - expected).max() / np.abs(expected).max()
        assert error <= tolerance, (name, error)


@pytest.mark.parametrize("ignored", [(), (0, 3, 4)], ids=["all_rows", "ignore_index_rows"])
def test_rewritten_loss_matches_torch(ignored):
    x, generator = _rows(8)
    labels = _labels(generator, (8,), ignored)
    training, evaluation, ours, theirs = run(nn.functional.cross_entropy, x, labels)
    assert not op_types(training) & LOSS_OPS and not op_types(evaluation) & LOSS_OPS
    assert {"LogSoftmax", "ScatterElements"} <= op_types(training)
    assert_matches(ours, theirs)


def test_custom_ignore_index_matches_torch():
    x, generator = _rows(8, seed=1)
    labels = _labels(generator, (8,), ignored=(1, 2), ignore_value=5)
    training, _, ours, theirs = run(lambda out, t: nn.functional.cross_entropy(out, t, ignore_index=5), x, labels)
    assert not op_types(training) & LOSS_OPS
    assert_matches(ours, theirs)


def test_spatial_logits_match_torch():
    """Logits [N, C, d] with labels [N, d]: LogSoftmax on axis 1, gathers along the class axis."""
    x, generator = _rows(5, seed=2)
    labels = _labels(generator, (5, 3))
    labels[1, 2] = -100
    training, _, ours, theirs = run(nn.functional.cross_entropy, x, labels, spatial=True)
    assert not op_types(training) & LOSS_OPS
    assert_matches(ours, theirs)


def test_every_row_ignored_gives_nan_loss_and_zero_gradients():
    x, generator = _rows(4, seed=3)
    labels = torch.full((4,), -100)
    _, _, ours, theirs = run(nn.functional.cross_entropy, x, labels)
    assert np.isnan(ours["loss"]) and np.isnan(theirs["loss"]) and np.isnan(ours["eval_loss"])
    for name, grad in ours["grads"].items():
        assert not grad.any(), name
        assert not theirs["grads"][name].any(), name


@pytest.mark.parametrize("method", ["train_step", "eval_step"])
@pytest.mark.parametrize("target", [-3, 5, 9], ids=["negative", "classes", "past"])
def test_a_target_out_of_range_is_refused_as_torch_does(method, target):
    """torch refuses these targets (IndexError); GatherElements would read a negative one from the end."""
    trainer = ORTTrainer(models.mlp(), models.MLP_DESC, optim.AdamConfig(lr=0.01), loss_fn=models.mlp_loss)
    x, labels = models.mlp_batch(0)
    trainer.train_step(x, labels)  # compiled: later steps run the graph alone, not torch
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    labels[3] = target
    with pytest.raises(IndexError):
        models.mlp_loss(models.mlp()(x), labels)
    with pytest.raises(IndexError, match=r"a target \(class index\) of the cross-entropy loss is out of range: the "
                       r"loss takes targets in \[0, 5\) or ignore_index=-100"):
        getattr(trainer, method)(x, labels)
    assert trainer.train_step_info.step == 1
    assert all(torch.equal(p, before[name]) for name, p in trainer.model.named_parameters())
    labels[3] = -100  # ignore_index is not out of range
    trainer.train_step(x, labels)


@pytest.mark.parametrize("loss_fn", [
    lambda out, t: nn.functional.cross_entropy(out, t, weight=torch.linspace(0.5, 2.0, CLASSES)),
    lambda out, t: nn.functional.cross_entropy(out, t, reduction="sum"),
], ids=["class_weights", "reduction_sum"])
def test_other_losses_are_left_alone(loss_fn):
    x, generator = _rows(8, seed=4)
    labels = _labels(generator, (8,), ignored=(2,))
    training, evaluation, ours, theirs = run(loss_fn, x, labels)
    assert LOSS_OPS <= op_types(training) and "SoftmaxCrossEntropyLoss" in op_types(evaluation)
    assert "LogSoftmax" not in op_types(training)
    assert_matches(ours, theirs, tolerance=1e-5)


def test_untyped_or_old_opset_models_are_left_alone():
    node = onnx.helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"], reduction="mean")
    graph = onnx.helper.make_graph([node], "g", [], [])  # no types known for logits or loss
    assert fast_softmax_cross_entropy(onnx.helper.make_model(graph, opset_imports=[
        onnx.helper.make_opsetid("", 14)])) == 0
    graph = onnx.helper.make_graph([node], "g", [], [
        onnx.helper.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, [])])
    assert fast_softmax_cross_entropy(onnx.helper.make_model(graph, opset_imports=[
        onnx.helper.make_opsetid("", 12)])) == 0


def test_log_prob_is_last_read_by_the_backward(tmp_path):
    """ORT's execution order (its optimized graph, saved in that order) reads the logits-sized
    log_prob last in the gradient's Exp: the forward's Gather must not be left for the end, or
    log_prob stays alive through the whole backward (77 MiB on the seed model)."""
    x, generator = _rows(8, seed=5)
    training, _, _, _ = run(nn.functional.cross_entropy, x, _labels(generator, (8,)))
    log_prob = next(node.output[0] for node in training.graph.node if node.op_type == "LogSoftmax")
    options = quiet_session_options()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    onnxruntime.InferenceSession(training.SerializeToString(), options, providers=["CPUExecutionProvider"])
    readers = [node.op_type for node in onnx.load(options.optimized_model_filepath).graph.node
               if log_prob in node.input]
    assert readers == ["GatherElements", "Exp"], readers


class Lookup(nn.Module):
    """An embedding (Gather on axis 0) or columns of a weight (Gather on axis 1), then a sum."""

    def __init__(self, columns=False):
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(6, 9))
        self.columns = columns

    def forward(self, tokens):
        picked = self.weight[:, tokens] if self.columns else nn.functional.embedding(tokens, self.weight)
        return (picked * torch.arange(picked.numel()).view(picked.shape)).sum()


def _weight_gradient(model, tokens):
    """(training graph, its gradient of model.weight, torch's) for loss = model(tokens)."""
    exported = _exported(model, None, ["tokens"], ["loss"], [tokens])
    name = graph_name("weight")
    training, _ = build_graphs(exported, [name], [], ["loss"], "loss", device_type="cpu")
    session = onnxruntime.InferenceSession(training, quiet_session_options(), providers=["CPUExecutionProvider"])
    ours = session.run([f"{name}_grad"], {"tokens": tokens.numpy(), name: model.weight.detach().numpy()})[0]
    model(tokens).backward()
    return onnx.load_from_string(training), ours, model.weight.grad.numpy()


def test_embedding_gradient_is_gather_nd_grad_and_matches_torch():
    tokens = torch.tensor([[0, 5, 5], [2, 0, 5]])  # repeated rows add up
    training, ours, theirs = _weight_gradient(Lookup(), tokens)
    assert "GatherNDGrad" in op_types(training) and "GatherGrad" not in op_types(training)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)


def test_gather_gradient_on_other_axes_is_left_alone():
    tokens = torch.tensor([8, 1, 1, 3])
    training, ours, theirs = _weight_gradient(Lookup(columns=True), tokens)
    assert "GatherGrad" in op_types(training) and "GatherNDGrad" not in op_types(training)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)


def _gelu_gradient_model(op_type, shape, dtype=onnx.TensorProto.FLOAT):
    inputs = ["dy", "x", "bias"] if op_type == "BiasFastGeluGrad_dX" else ["dy", "x"]
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node(op_type, inputs, ["dx"], domain="com.microsoft")], "gelu_grad",
        [onnx.helper.make_tensor_value_info(name, dtype, shape[-1:] if name == "bias" else shape) for name in inputs],
        [onnx.helper.make_tensor_value_info("dx", dtype, shape)])
    return onnx.helper.make_model(graph, ir_version=8, opset_imports=[
        onnx.helper.make_opsetid("", 14), onnx.helper.make_opsetid("com.microsoft", 1)])


@pytest.mark.parametrize("op_type", ["FastGeluGrad", "BiasFastGeluGrad_dX"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("rewrite", [fast_gelu_grad, gelu_grads_in_torch])
def test_tanh_gelu_gradient_rewrite_matches_ort_kernel_and_torch(op_type, seed, rewrite):
    """As ONNX nodes (within 1e-5 of torch's gelu_backward) or as torch's kernel itself (equal)."""
    generator = np.random.default_rng(seed)
    shape = [int(size) for size in generator.integers(1, 9, size=generator.integers(1, 4))] + [37]
    feeds = {"dy": generator.standard_normal(shape, dtype=np.float32),
             "x": 3 * generator.standard_normal(shape, dtype=np.float32),
             "bias": generator.standard_normal(shape[-1:], dtype=np.float32)}
    model = _gelu_gradient_model(op_type, shape)
    feeds = {i.name: feeds[i.name] for i in model.graph.input}

    def run(model):
        register_executor()
        session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return session.run(None, feeds)[0]

    theirs = run(model)
    assert rewrite(model) == 1 and not {"FastGeluGrad", "BiasFastGeluGrad_dX"} & op_types(model)
    assert ("ATen" in op_types(model)) == (rewrite is gelu_grads_in_torch)
    ours = run(model)
    x = torch.from_numpy(feeds["x"] + feeds.get("bias", 0))
    expected = torch.ops.aten.gelu_backward(torch.from_numpy(feeds["dy"]), x, approximate="tanh").numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    if rewrite is gelu_grads_in_torch:
        np.testing.assert_array_equal(ours, expected)
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5)


def test_tanh_gelu_gradient_of_other_types_is_left_alone():
    model = _gelu_gradient_model("FastGeluGrad", [4, 8], dtype=onnx.TensorProto.FLOAT16)
    assert fast_gelu_grad(model) == 0 and op_types(model) == {"FastGeluGrad"}
    assert gelu_grads_in_torch(model) == 0 and op_types(model) == {"FastGeluGrad"}


def _layer_norm_gradient_model(shape, axis):
    """ONNX Runtime's LayerNormalizationGrad over the dims from `axis`: dX, dscale, dbias."""
    normalized = shape[axis:]
    stats = shape[:axis] + [1] * len(normalized)
    value = onnx.helper.make_tensor_value_info
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("LayerNormalizationGrad", ["dy", "x", "scale", "mean", "inv_std"], ["dx", "ds", "db"],
                               domain="com.microsoft", axis=axis)], "layer_norm_grad",
        [value("dy", onnx.TensorProto.FLOAT, shape), value("x", onnx.TensorProto.FLOAT, shape),
         value("scale", onnx.TensorProto.FLOAT, normalized), value("mean", onnx.TensorProto.FLOAT, stats),
         value("inv_std", onnx.TensorProto.FLOAT, stats)],
        [value(name, onnx.TensorProto.FLOAT, shape if name == "dx" else normalized) for name in ("dx", "ds", "db")])
    return onnx.helper.make_model(graph, ir_version=8, opset_imports=[
        onnx.helper.make_opsetid("", 14), onnx.helper.make_opsetid("com.microsoft", 1)])


@pytest.mark.parametrize("shape, axis", [([6, 37], -1), ([2, 5, 16], -1), ([3, 4, 5], 1)])
def test_layer_norm_gradient_in_torch_matches_ort_kernel_and_torch(shape, axis):
    """torch's native_layer_norm_backward (eager's own: equal) within 1e-5 of ORT's kernel."""
    generator = np.random.default_rng(0)
    x = torch.from_numpy(3 * generator.standard_normal(shape, dtype=np.float32))
    scale, bias = torch.randn(shape[axis:]), torch.randn(shape[axis:])
    _, mean, inv_std = torch.ops.aten.native_layer_norm(x, shape[axis:], scale, bias, 1e-5)
    dy = torch.from_numpy(generator.standard_normal(shape, dtype=np.float32))
    feeds = {"dy": dy.numpy(), "x": x.numpy(), "scale": scale.numpy(), "mean": mean.numpy(),
             "inv_std": inv_std.numpy()}
    model = _layer_norm_gradient_model(shape, axis % len(shape))

    def run(model):
        register_executor()
        return onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, feeds)

    theirs = run(model)
    assert layer_norm_grads_in_torch(model) == 1 and op_types(model) == {"ATen"}
    ours = run(model)
    expected = torch.ops.aten.native_layer_norm_backward(dy, x, shape[axis:], mean, inv_std, scale, bias,
                                                         [True, True, True])
    for mine, ort_kernel, torch_kernel in zip(ours, theirs, expected):
        np.testing.assert_array_equal(mine, torch_kernel.numpy())
        np.testing.assert_allclose(mine, ort_kernel, rtol=1e-5, atol=1e-5)


def test_layer_norm_gradient_of_other_types_is_left_alone():
    model = _layer_norm_gradient_model([4, 8], 1)
    model.graph.output[0].type.tensor_type.elem_type = onnx.TensorProto.DOUBLE
    assert layer_norm_grads_in_torch(model) == 0 and op_types(model) == {"LayerNormalizationGrad"}


def test_gpt2_trains_like_torch_with_the_rewritten_gelu_gradient(monkeypatch):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=96, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    reference = transformers.GPT2LMHeadModel(config)
    reference.load_state_dict(model.state_dict())
    rewritten = []
    trainer = ORTTrainer(model, {"inputs": [("input_ids", ["batch", "seq"]), ("labels", ["batch", "seq"])],
                                 "outputs": [("loss", [], True)]}, optim.SGDConfig(lr=0.1),
                         options={"utils": {"grad_norm_clip": False}})
    monkeypatch.setattr(trainer_graph_builder, "kernel_substitutions",
                        lambda device_type: lambda training, evaluation, **_: (
        rewritten.append((substitute_cpu_kernels(training, evaluation), op_types(training)))))
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)
    for step in range(4):
        ids = torch.randint(0, 96, (3, 10), generator=generator)
        loss = trainer.train_step(input_ids=ids, labels=ids)
        sgd.zero_grad()
        expected = reference(input_ids=ids, labels=ids).loss
        expected.backward()
        sgd.step()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5), step
    assert rewritten and all("FastGeluGrad" not in types and "Tanh" in types for _, types in rewritten)
    for name, parameter in reference.named_parameters():
        torch.testing.assert_close(trainer.model.state_dict()[name], parameter.detach(), rtol=1e-4, atol=1e-5)


def test_graphs_for_cuda_keep_ort_kernels():
    _, generator = _rows(6, seed=6)
    labels = _labels(generator, (6,))
    model = nn.Sequential(nn.Embedding(CLASSES, 6), nn.Linear(6, CLASSES))
    tokens = torch.randint(0, CLASSES, (6,), generator=generator)
    exported = _exported(model, nn.functional.cross_entropy, ["tokens", "labels"], ["loss", "logits"],
                         [tokens, labels])
    names = [graph_name(name) for name, _ in model.named_parameters()]
    training, evaluation = build_graphs(exported, names, [], ["loss"], "loss")
    assert LOSS_OPS | {"GatherGrad"} <= op_types(onnx.load_from_string(training))
    assert "SoftmaxCrossEntropyLoss" in op_types(onnx.load_from_string(evaluation))


def test_the_cpu_trainer_builds_graphs_for_the_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(trainer_compiler, "build_graphs",
                        lambda *args, **kwargs: calls.append(kwargs) or build_graphs(*args, **kwargs))
    trainer = ORTTrainer(models.mlp(), models.MLP_DESC, optim.SGDConfig(lr=0.1), loss_fn=models.mlp_loss)
    trainer.train_step(*models.mlp_batch(0))
    assert [call["device_type"] for call in calls] == ["cpu"]


class _AttentionWithDropout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.query = torch.nn.Linear(8, 8)

    def forward(self, x):
        dropout = 0.5 if self.training else 0.0
        return torch.nn.functional.scaled_dot_product_attention(self.query(x), x, x, dropout_p=dropout).square().sum()


def test_attention_dropout_drops_in_the_training_graph(tmp_path):
    """torch's sdpa symbolic exports an inference-mode Dropout (it dropped nothing while ORT's
    DropoutGrad still scaled the gradient by 1/(1-p)): in the training graph it drops, as torch does."""
    torch.manual_seed(0)
    path = tmp_path / "training.onnx"
    trainer = ORTTrainer(_AttentionWithDropout(), {"inputs": [("x", [2, 4, 8])], "outputs": [("loss", [], True)]},
                         optim.SGDConfig(lr=1e-30), options={"utils": {"grad_norm_clip": False}, "debug": {
                             "graph_save_paths": {"model_with_training_graph_path": str(path)}}})
    x = torch.randn(2, 4, 8)
    losses = {trainer.train_step(x).item() for _ in range(6)}
    assert len(losses) > 1  # a mask drawn per step
    graph = onnx.load(path).graph
    dropouts = [node for node in graph.node if node.op_type == "Dropout"]
    constants = {node.output[0]: onnx.numpy_helper.to_array(node.attribute[0].t) for node in graph.node
                 if node.op_type == "Constant"}
    constants.update({tensor.name: onnx.numpy_helper.to_array(tensor) for tensor in graph.initializer})
    assert len(dropouts) == 1 and constants[dropouts[0].input[2]].item() is True
    with torch.no_grad():
        expected = trainer.model.eval()(x).item()
    assert trainer.eval_step(x).item() == pytest.approx(expected, rel=1e-5)
