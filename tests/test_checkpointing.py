"""Gradient checkpointing: torch.utils.checkpoint (both forms, checkpoint_sequential) and Hugging
Face's gradient_checkpointing_enable() run in the ONNX Runtime graph, in step with eager PyTorch,
and the graph recomputes the checkpointed segments in the backward instead of keeping their
activations."""
import copy
import re

import onnx
import onnxruntime
import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from ort_trainer import ORTTrainer, optim
from ort_trainer._onnx import torch_node_operator
from ort_trainer._runtime import product_speed
from ort_trainer._torch_node_catalogue import MATRIX_PRODUCT
from ort_trainer.ortmodule import DebugOptions, ORTModule

STEPS = 5


class Block(nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 16)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.fc2(self.drop(nn.functional.gelu(self.fc1(self.norm(x)))))


class Blocks(nn.Module):
    """Four residual blocks, each checkpointed as `form` says (None: not checkpointed)."""

    def __init__(self, form, dropout=0.0):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(dropout) for _ in range(4)])
        self.form = form

    def forward(self, x):
        if self.form == "sequential":
            x = checkpoint_sequential(self.blocks, 2, x, use_reentrant=False)
        else:
            for block in self.blocks:
                x = block(x) if self.form is None else checkpoint(block, x, use_reentrant=self.form == "reentrant")
        return x.pow(2).mean()


def _batches():
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(3, 5, 16, generator=generator, requires_grad=True) for _ in range(STEPS)]


def _losses(model, step_loss):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = step_loss(model, step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture(autouse=True)
def _no_fallback(monkeypatch):
    """A model the graph cannot take raises instead of running in PyTorch (where it would pass)."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")


def _saved_graph(tmp_path, monkeypatch):
    """The training graph the next ORTModule (made with `_debug`) compiles, as it runs."""
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    return lambda: onnx.load(tmp_path / "m_optimized_training.onnx")


_debug = DebugOptions(save_onnx=True, onnx_prefix="m")


def _kept_for_backward(graph):
    """{tensor the backward reads from the forward: its producer}, recompute copies excluded."""
    nodes = list(graph.graph.node)
    yielded = next(node for node in nodes if node.op_type == "YieldOp")
    backward = set(yielded.output)
    for node in nodes:
        if backward.intersection(node.input):
            backward.update(node.output)
    producers = {output: node for node in nodes for output in node.output}
    return {name: producers[name] for node in nodes if backward.intersection(node.input) for name in node.input
            if name in producers and name not in backward}


def _blocks_like_eager(form, tmp_path, monkeypatch):
    """Blocks(form) trained by ORTModule and eagerly, losses equal; returns what ORTModule's backward
    keeps from its forward (`_kept_for_backward`)."""
    torch.manual_seed(0)
    model = Blocks(form)
    eager = copy.deepcopy(model)
    batches = _batches()
    graph = _saved_graph(tmp_path, monkeypatch)
    ours = _losses(ORTModule(model, debug_options=_debug), lambda m, step: m(batches[step]))
    assert ours == pytest.approx(_losses(eager, lambda m, step: m(batches[step])), rel=1e-5)
    return _kept_for_backward(graph())


@pytest.mark.parametrize("form", ["reentrant", "non_reentrant", "sequential"])
def test_checkpointed_blocks_train_like_eager_and_are_recomputed_in_the_backward(form, tmp_path, monkeypatch):
    kept = {name: node for name, node in _blocks_like_eager(form, tmp_path, monkeypatch).items()
            if "_checkpoint_" in name and node.op_type != "Constant"}
    assert kept  # the segments' outputs
    for name, node in kept.items():  # no activation inside a segment: its outputs and dropout masks only
        assert (node.op_type == "Add" and name.endswith("/Add_1_output_0")) or (
            node.op_type == "Dropout" and name == node.output[1]), (name, node.op_type)


@pytest.mark.parametrize("form", [None, "non_reentrant"])
def test_products_torch_runs_faster_stay_in_onnx_runtime_where_segments_are_recomputed(form, tmp_path, monkeypatch):
    """Their outputs in torch's heap beside ONNX Runtime's arena doubled a checkpointed step's peak."""
    monkeypatch.setattr(product_speed, "torch_product_faster", lambda form, threads: True)
    torch.manual_seed(0)
    graph = _saved_graph(tmp_path, monkeypatch)
    model = ORTModule(Blocks(form), debug_options=_debug)
    model(_batches()[0]).backward()
    products = [node for node in graph().graph.node if node.op_type in ("MatMul", "Gemm", "FusedMatMul")]
    moved = [node for node in graph().graph.node if torch_node_operator(node) == MATRIX_PRODUCT]
    assert (bool(products), bool(moved)) == ((False, True) if form is None else (True, False))


def test_memory_opt_level_1_recomputes_every_layer_but_the_last_and_trains_like_eager(tmp_path, monkeypatch):
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", "1")
    kept = _blocks_like_eager(None, tmp_path, monkeypatch)
    for layer in range(3):  # the layers' outputs and dropout masks only
        inside = {name: node for name, node in kept.items() if f"/blocks.{layer}/" in name}
        assert all(node.op_type == "Add" or node.op_type == "Dropout" and name == node.output[1]
                   for name, node in inside.items()), sorted(inside)
    assert any("/blocks.3/fc1/" in name for name in kept)  # the last layer keeps its activations


@pytest.mark.parametrize("value, message", [
    ("2", "ORTMODULE_MEMORY_OPT_LEVEL='2' is not supported by ort_trainer's ORTModule: "
          "TRANSFORMER_LAYERWISE_RECOMPUTE_WITH_COMPROMISE (ONNX Runtime's memory optimizer's compromised "
          "subgraphs) is not implemented; use 0 (off) or 1 (layer-wise recompute)"),
    ("on", "ORTMODULE_MEMORY_OPT_LEVEL='on' must be 0 (off) or 1 (layer-wise recompute)")])
def test_unsupported_memory_opt_levels_are_refused_by_name(monkeypatch, value, message):
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", value)
    with pytest.raises(ValueError, match=re.escape(message)):
        ORTModule(Blocks(None))


def test_memory_opt_level_1_without_a_stack_of_layers_says_so(monkeypatch):
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", "1")
    model = ORTModule(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    with pytest.warns(UserWarning, match=re.escape(
            "ORTMODULE_MEMORY_OPT_LEVEL=1: Sequential has no stack of layers to recompute (an nn.ModuleList or "
            "nn.Sequential of at least 2 modules of one class); nothing is recomputed but its "
            "torch.utils.checkpoint segments")):
        model(torch.randn(2, 4)).sum().backward()


def test_dropout_inside_a_segment_is_applied_again_not_drawn_again():
    """ORT draws its own masks (not torch's): the checkpointed graph must train exactly as the
    same graph without checkpointing, under the same seed. Its recomputed Dropout reuses the
    forward's mask (a fresh draw would give the weights before it other gradients)."""
    batches = _batches()
    losses = {}
    for form in ("reentrant", None):
        torch.manual_seed(0)
        model = ORTModule(Blocks(form, dropout=0.3))
        losses[form] = _losses(model, lambda m, step: m(batches[step]))
    assert losses["reentrant"] == pytest.approx(losses[None], rel=1e-6)


def test_hugging_face_gradient_checkpointing_trains_like_eager(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=96, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, use_cache=False))
    model.gradient_checkpointing_enable()  # use_reentrant=True, transformers' default
    model.train()
    eager = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(2)
    batches = [torch.randint(3, 96, (3, 10), generator=generator) for _ in range(STEPS)]

    def step_loss(m, step):
        return m(input_ids=batches[step], labels=batches[step]).loss

    graph = _saved_graph(tmp_path, monkeypatch)
    ours = _losses(ORTModule(model, debug_options=_debug), step_loss)
    assert ours == pytest.approx(_losses(eager, step_loss), rel=1e-5)
    kept = _kept_for_backward(graph())
    attention = [name for name, node in kept.items() if "_checkpoint_" in name and node.op_type == "Softmax"]
    assert not attention  # the attention probabilities are recomputed, not kept


@pytest.mark.parametrize("form", ["reentrant", "non_reentrant"])
def test_ort_trainer_trains_a_checkpointed_model_like_eager_and_recomputes_the_segments(form, tmp_path):
    """The reentrant form was refused (torch's CheckpointFunction is a custom autograd.Function)."""
    torch.manual_seed(0)
    model = Blocks(form)
    eager = copy.deepcopy(model)
    eager.form = None  # torch's reentrant form gives no gradient from inputs that need none
    batches = _batches()
    path = tmp_path / "training.onnx"
    trainer = ORTTrainer(model, {"inputs": [("x", [3, 5, 16])], "outputs": [("loss", [], True)]},
                         optim.AdamConfig(lr=1e-2), options={"utils": {"grad_norm_clip": False}, "debug": {
                             "graph_save_paths": {"model_with_training_graph_path": str(path)}}})
    ours = [trainer.train_step(batch.detach()).item() for batch in batches]
    adam = torch.optim.Adam(eager.parameters(), lr=1e-2)
    expected = []
    for batch in batches:
        loss = eager(batch.detach())
        loss.backward()
        adam.step()
        adam.zero_grad()
        expected.append(loss.item())
    assert ours == pytest.approx(expected, rel=1e-5)
    copies = [node for node in onnx.load(path).graph.node if node.name.endswith("_recompute")]
    assert {node.op_type for node in copies} >= {"LayerNormalization", "MatMul", "Gelu"}
    (graph,) = trainer._graphs._graphs.values()  # in the order the copies are scheduled for
    assert graph._bound[True][0].get_session_options().execution_order == onnxruntime.ExecutionOrder.PRIORITY_BASED


def test_transformers_trainer_gradient_checkpointing_runs_in_the_graph(tmp_path):
    """Trainer(gradient_checkpointing=True) calls the model's gradient_checkpointing_enable()
    (reentrant): that ran in PyTorch (the fallback) before."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers.Trainer's PyTorch backend")
    from examples.gpt2.data import BlockDataset

    blocks = torch.randint(0, 96, (16, 12), generator=torch.Generator().manual_seed(1))
    losses = {}
    for engine in ("ort", "torch"):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=96, n_positions=12, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0))
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / engine), report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
            per_device_train_batch_size=4, max_steps=3, learning_rate=3e-3, logging_steps=1, save_strategy="no",
            gradient_checkpointing=True)
        trainer = transformers.Trainer(model=ORTModule(model) if engine == "ort" else model, args=args,
                                       train_dataset=BlockDataset(blocks))
        trainer.train()
        losses[engine] = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses["ort"]) == 3
    assert losses["ort"] == pytest.approx(losses["torch"], abs=1.01e-4)  # Trainer logs 4 decimals


def test_training_graphs_run_in_priority_order_and_those_with_recompute_copies_without_skip_layer_norm_fusion():
    """ONNX Runtime's default order ran every segment's copies before the first weight gradient
    (the copies of all segments alive at once: the 8-block benchmark's peak 1,251 -> 654 MiB), and
    without checkpointing every input gradient before the first weight gradient (every layer's
    output gradients held to the end); SkipLayerNormFusion would fuse a copy's residual Add and
    LayerNormalization, whose gradient then lacks its saved mean (`_runtime.session_config`)."""
    def options(form):
        torch.manual_seed(0)
        model = ORTModule(Blocks(form))
        model(_batches()[0]).backward()
        (graph,) = model._graphs._graphs.values()
        return graph._runner._session.get_session_options()

    checkpointed, plain = options("non_reentrant"), options(None)
    assert checkpointed.execution_order == onnxruntime.ExecutionOrder.PRIORITY_BASED
    assert checkpointed.get_session_config_entry("optimization.disable_specified_optimizers") == "SkipLayerNormFusion"
    assert plain.execution_order == onnxruntime.ExecutionOrder.PRIORITY_BASED
    with pytest.raises(RuntimeError, match="does not have configuration"):
        plain.get_session_config_entry("optimization.disable_specified_optimizers")
