"""Label sparsity (`_graph.label_sparsity`, `graph_transformer.label_sparsity`): a cross-entropy with
an ignore_index computes the vocabulary projection and the loss on the kept rows only. Exactness is
the proof: the losses and weights equal the dense graph's and eager PyTorch's, for every pattern of
ignored labels (none kept: torch's NaN loss and zero gradients), new shapes, the seed model,
GPT-2's own loss, ORTModule of a model returning the loss alone; each test also checks that the
graph was rewritten (or, where it must stay dense, that it was not)."""
import copy
import io

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from torch import nn

from examples.wikitext2.train import make_loss_fn
from ort_trainer import ORTModule, ORTTrainer, ORTTrainerOptions, optim
from ort_trainer._graph import label_sparsity
from ort_trainer._graph.label_sparsity import gather_labelled_rows
from ort_trainer._runtime import torch_ops
from ort_trainer._torch_node_catalogue import LABELLED_PROJECTION_GRAD
from ort_trainer.ortmodule import DebugOptions

from . import models

VOCAB, WIDTH = 40, 16


@pytest.fixture(autouse=True)
def small_vocabularies_count(monkeypatch):
    """These tests' vocabularies are small; the rewrite applies from `MIN_CLASSES` classes (a
    vocabulary), which `test_a_classifier_head_stays_dense` checks."""
    monkeypatch.setattr(label_sparsity, "MIN_CLASSES", min(VOCAB, models.VOCAB))
DESC = {"inputs": [("ids", ["batch", "seq"]), ("labels", ["batch", "seq"])],
        "outputs": [("loss", [], True), ("logits", ["batch", "seq", VOCAB])]}


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.hidden = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        return self.head(torch.tanh(self.hidden(self.embed(ids))))


def tiny_loss(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


def _labels(pattern, generator, batch, seq):
    labels = torch.randint(0, VOCAB, (batch, seq), generator=generator)
    if pattern == "half":
        labels[:, : seq // 2] = -100
    elif pattern == "all":
        labels[:] = -100
    elif pattern == "scattered":
        labels[torch.rand(batch, seq, generator=generator) < 0.6] = -100
    return labels


def _batches(patterns, shapes=((3, 8),)):
    generator = torch.Generator().manual_seed(7)
    batches = []
    for step, pattern in enumerate(patterns):
        batch, seq = shapes[step % len(shapes)]
        batches.append((torch.randint(0, VOCAB, (batch, seq), generator=generator),
                        _labels(pattern, generator, batch, seq)))
    return batches


OPTIMIZERS = {"sgd": (lambda: optim.SGDConfig(lr=0.5), lambda p: torch.optim.SGD(p, lr=0.5)),
              "adam": (lambda: optim.AdamConfig(lr=0.01), lambda p: torch.optim.Adam(p, lr=0.01, foreach=False))}


def _head_reads_gathered_rows(path):
    """Whether the saved graph's vocabulary projection reads the Gather of the kept rows."""
    graph = onnx.load(path).graph
    producers = {output: node for node in graph.node for output in node.output}

    def source(name):  # through mixed precision's Casts
        while name in producers and producers[name].op_type == "Cast":
            name = producers[name].input[0]
        return name

    return any(node.op_type in ("MatMul", "Gemm", "FusedMatMul", "ATen")
               and source(node.input[0]).endswith("label_sparsity/kept_hidden")
               and producers[source(node.input[0])].op_type == "Gather" for node in graph.node)


def _trainer(model, sparse, config, path, loss_fn=None, desc=DESC, grad_norm_clip=True):
    options = {"graph_transformer": {"label_sparsity": sparse}, "utils": {"grad_norm_clip": grad_norm_clip},
               "debug": {"graph_save_paths": {"model_with_training_graph_path": str(path)}}}
    trainer = ORTTrainer(model, desc, config, loss_fn=loss_fn, options=ORTTrainerOptions(options))
    trainer.train_step_info.fetches = ["loss"]
    return trainer


def _train(model, sparse, config, path, batches, loss_fn=tiny_loss, **kwargs):
    model = copy.deepcopy(model)
    trainer = _trainer(model, sparse, config, path, loss_fn, **kwargs)
    losses = [trainer.train_step(*batch).item() for batch in batches]
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}, trainer


def _comparable(name, tensor):
    """Without the attention key bias (against eager PyTorch only): its true gradient is exactly zero,
    so Adam turns float noise into lr-sized steps in both frameworks (tests/test_trainer_parity.py).
    None for a key bias of its own (BERT's)."""
    if name.endswith(("attention.self.key.bias", "attention.k_lin.bias")):
        return None
    if name.endswith(("self_attn.in_proj_bias", "attn.c_attn.bias")):
        third = tensor.numel() // 3
        return torch.cat([tensor[:third], tensor[2 * third:]])
    return tensor


def _assert_same(ours, theirs, rtol, atol=0.0, eager=False):
    (our_losses, our_weights), (their_losses, their_weights) = ours[:2], theirs[:2]
    torch.testing.assert_close(torch.tensor(our_losses), torch.tensor(their_losses), rtol=rtol, atol=atol,
                               equal_nan=True)
    for name, weight in our_weights.items():
        expected = their_weights[name].detach()
        if eager:  # relative to the tensor's largest value, as tests/test_trainer_parity.py
            weight, expected = _comparable(name, weight), _comparable(name, expected)
            if weight is None:
                continue
            assert (weight - expected).abs().max() <= rtol * expected.abs().max(), name
        else:
            torch.testing.assert_close(weight, expected, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("patterns", [["half"] * 3, ["none"] * 3, ["all", "half", "all", "scattered"],
                                      ["scattered", "none", "half"]], ids=lambda p: "-".join(p))
def test_losses_and_weights_equal_the_dense_graph_and_torch(tmp_path, optimizer, patterns):
    config, torch_optimizer = OPTIMIZERS[optimizer]
    torch.manual_seed(0)
    model, batches = TinyLM(), _batches(patterns)
    sparse = _train(model, True, config(), tmp_path / "sparse.onnx", batches)
    dense = _train(model, False, config(), tmp_path / "dense.onnx", batches)
    assert _head_reads_gathered_rows(tmp_path / "sparse.onnx")
    assert not _head_reads_gathered_rows(tmp_path / "dense.onnx")
    _assert_same(sparse, dense, rtol=1e-5, atol=1e-6)
    eager = models.torch_loop(model, tiny_loss, batches, torch_optimizer, max_norm=1.0)
    _assert_same(sparse, eager, rtol=1e-4, atol=1e-5, eager=True)


def test_an_all_ignored_batch_gives_torchs_nan_loss_and_changes_no_weight(tmp_path):
    torch.manual_seed(0)
    model = TinyLM()
    ids, labels = _batches(["all"])[0]
    expected = tiny_loss(model(ids), labels)
    expected.backward()
    assert torch.isnan(expected) and all(not p.grad.any() for p in model.parameters())
    loss, weights, _ = _train(model, True, optim.SGDConfig(lr=0.5), tmp_path / "sparse.onnx", [(ids, labels)])
    assert _head_reads_gathered_rows(tmp_path / "sparse.onnx")
    assert torch.isnan(torch.tensor(loss[0]))
    for name, weight in model.named_parameters():
        assert torch.equal(weights[name], weight), name


def test_new_shapes_compile_new_rewritten_graphs_that_stay_exact(tmp_path):
    torch.manual_seed(0)
    model = TinyLM()
    batches = _batches(["half", "scattered", "half", "all", "scattered"], shapes=((3, 8), (2, 13), (5, 4)))
    sparse = _train(model, True, optim.AdamConfig(lr=0.01), tmp_path / "sparse.onnx", batches)
    dense = _train(model, False, optim.AdamConfig(lr=0.01), tmp_path / "dense.onnx", batches)
    assert len(sparse[2]._graphs) == 3
    assert _head_reads_gathered_rows(tmp_path / "sparse.onnx")
    _assert_same(sparse, dense, rtol=1e-5, atol=1e-6)
    eager = models.torch_loop(model, tiny_loss, batches, OPTIMIZERS["adam"][1], max_norm=1.0)
    _assert_same(sparse, eager, rtol=1e-4, atol=1e-5, eager=True)


@pytest.mark.filterwarnings("ignore:mixed_precision.dtype='float16' on device 'cpu'")
def test_mixed_precision_and_accumulation_equal_the_dense_graph(tmp_path):
    """fp16 products (emulated on the CPU: the rewrite comes before their casts) and accumulated
    micro-batches."""
    torch.manual_seed(0)
    model, batches = TinyLM(), _batches(["half", "scattered", "all", "half"])
    for options in ({"mixed_precision": {"enabled": True}}, {"batch": {"gradient_accumulation_steps": 2}}):
        trained = []
        for sparse in (True, False):
            copied = copy.deepcopy(model)
            path = tmp_path / f"{sparse}.onnx"
            trainer = ORTTrainer(copied, DESC, optim.AdamConfig(lr=0.01), loss_fn=tiny_loss, options=ORTTrainerOptions({
                **options, "graph_transformer": {"label_sparsity": sparse},
                "debug": {"graph_save_paths": {"model_with_training_graph_path": str(path)}}}))
            trainer.train_step_info.fetches = ["loss"]
            losses = [trainer.train_step(*batch).item() for batch in batches]
            trained.append((losses, {name: p.detach().clone() for name, p in copied.named_parameters()}))
        assert _head_reads_gathered_rows(tmp_path / "True.onnx"), options
        _assert_same(*trained, rtol=1e-5, atol=1e-6)


def test_the_eval_graph_computes_the_same_loss(tmp_path):
    torch.manual_seed(0)
    model = TinyLM()
    ids, labels = _batches(["half"])[0]
    expected = tiny_loss(model(ids), labels).item()
    options = {"debug": {"graph_save_paths": {"eval_model_path": str(tmp_path / "eval.onnx")}}}
    trainer = ORTTrainer(model, DESC, optim.SGDConfig(lr=0.5), loss_fn=tiny_loss, options=ORTTrainerOptions(options))
    trainer.train_step_info.fetches = ["loss"]
    assert trainer.eval_step(ids, labels).item() == pytest.approx(expected, rel=1e-6)
    assert _head_reads_gathered_rows(tmp_path / "eval.onnx")


def test_fetched_logits_stay_dense_and_the_loss_reads_the_kept_rows(tmp_path, monkeypatch):
    """The caller gets every position's logits (ORTTrainer's fetches default to every output): they
    stay dense, one torch node also gives the loss the kept rows; the graph differentiates the loss
    alone, so the logits' gradient is a scalar zero and the projection's gradients run on those rows."""
    seen, kernel = [], torch_ops.IMPLEMENTATIONS[LABELLED_PROJECTION_GRAD]
    monkeypatch.setitem(torch_ops.IMPLEMENTATIONS, LABELLED_PROJECTION_GRAD,
                        lambda inputs, params: seen.append(inputs[0].dim()) or kernel(inputs, params))
    torch.manual_seed(0)
    model, batches = TinyLM(), _batches(["half", "all", "scattered", "none"], shapes=((3, 8), (2, 5)))

    def run(sparse, path):
        trained = copy.deepcopy(model)
        trainer = _trainer(trained, sparse, optim.SGDConfig(lr=0.5), path, tiny_loss)
        trainer.train_step_info.fetches = []
        outputs = [trainer.train_step(ids, labels) for ids, labels in batches]
        evaluated = trainer.eval_step(*batches[0])
        weights = {name: p.detach().clone() for name, p in trained.named_parameters()}
        return [loss.item() for loss, _ in outputs], weights, [logits for _, logits in outputs] + list(evaluated)

    sparse, dense = run(True, tmp_path / "sparse.onnx"), run(False, tmp_path / "dense.onnx")
    assert seen == [0] * len(batches)
    graph = onnx.load(tmp_path / "sparse.onnx").graph
    assert any(node.name.endswith("/label_sparsity/projection") for node in graph.node)
    _assert_same(sparse, dense, rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(sparse[2], dense[2]):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_the_seed_model_with_its_own_loss(tmp_path):
    """examples/wikitext2's model and loss (nn.CrossEntropyLoss: ignore_index -100 by default)."""
    model, loss_fn = models.transformer(), make_loss_fn(models.VOCAB)
    batches = []
    for step in range(4):
        data, targets = models.transformer_batch(step, bptt=7, batch=4)
        targets = targets.clone()
        targets[: (step % 3) * 8] = -100  # none, the first 2 time steps, the first 4
        batches.append((data, targets))
    config = lambda: optim.AdamConfig(lr=0.01, max_norm_clip=0.5)  # noqa: E731
    sparse = _train(model, True, config(), tmp_path / "sparse.onnx", batches, loss_fn=loss_fn,
                    desc=models.TRANSFORMER_DESC)
    dense = _train(model, False, config(), tmp_path / "dense.onnx", batches, loss_fn=loss_fn,
                   desc=models.TRANSFORMER_DESC)
    assert _head_reads_gathered_rows(tmp_path / "sparse.onnx")
    _assert_same(sparse, dense, rtol=1e-5, atol=1e-6)
    eager = models.torch_loop(model, loss_fn, batches, lambda p: torch.optim.Adam(p, lr=0.01, foreach=False),
                              max_norm=0.5)
    _assert_same(sparse, eager, rtol=1e-4, atol=1e-5, eager=True)


def _hugging_face_language_model(family):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "distilbert":  # its loss reads the logits' shape (`logits.size(-1)`)
        return transformers.DistilBertForMaskedLM(transformers.DistilBertConfig(
            vocab_size=VOCAB, dim=32, n_layers=1, n_heads=2, hidden_dim=64, max_position_embeddings=32,
            dropout=0.0, attention_dropout=0.0)).train()
    if family == "bert":  # its word embeddings have a padding_idx: the export marks their padding rows
        return transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).train()
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, loss_type="ForCausalLM")).train()


@pytest.mark.parametrize("family", ["gpt2", "bert", "distilbert"])
def test_hugging_face_language_models_with_their_own_loss(tmp_path, family):
    """GPT-2's shifted causal-LM loss; BERT's masked-LM loss, whose projection follows a dense layer,
    GELU and LayerNorm (ORTTrainer's BERT graph kept it dense: the embedding's padding marker hid
    every shape after it); DistilBERT's, which reads the logits' shape (it kept the graph dense)."""
    model = _hugging_face_language_model(family)
    desc = {"inputs": [("input_ids", ["batch", "seq"]), ("labels", ["batch", "seq"])],
            "outputs": [("loss", [], True), ("logits", ["batch", "seq", VOCAB])]}
    batches = _batches(["half", "scattered", "all", "half"])

    def run(sparse, path):
        trained = copy.deepcopy(model)
        trainer = _trainer(trained, sparse, optim.AdamConfig(lr=1e-3), path, desc=desc, grad_norm_clip=False)
        losses = [trainer.train_step(input_ids=ids, labels=labels).item() for ids, labels in batches]
        return losses, {name: p.detach().clone() for name, p in trained.named_parameters()}

    sparse, dense = run(True, tmp_path / "sparse.onnx"), run(False, tmp_path / "dense.onnx")
    assert _head_reads_gathered_rows(tmp_path / "sparse.onnx")
    _assert_same(sparse, dense, rtol=1e-5, atol=1e-6)
    reference, losses = copy.deepcopy(model), []
    adam = torch.optim.Adam(reference.parameters(), lr=1e-3)
    for ids, labels in batches:
        adam.zero_grad()
        loss = reference(input_ids=ids, labels=labels).loss
        loss.backward()
        adam.step()
        losses.append(loss.item())
    _assert_same(sparse, (losses, dict(reference.named_parameters())), rtol=1e-4, atol=1e-5, eager=True)


def test_the_projection_reads_the_kept_rows_only():
    """On the exported forward: the product reads a Gather of the flattened hidden rows at the kept
    labels' positions, and the loss reads the gathered labels; its logits stop being an output."""
    torch.manual_seed(0)
    model = TinyLM()
    ids, labels = _batches(["half"])[0]

    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids, labels):
            logits = self.model(ids)
            return tiny_loss(logits, labels), logits

    buffer = io.BytesIO()
    torch.onnx.export(WithLoss(), (ids, labels), buffer, input_names=["ids", "labels"],
                      output_names=["loss", "logits"], opset_version=14, dynamo=False)
    exported = onnx.load_from_string(buffer.getvalue())
    head_weight = next(node.input[1] for node in exported.graph.node if node.output[0] == "/model/head/MatMul_output_0")
    assert gather_labelled_rows(copy.deepcopy(exported), ["loss", "logits"]) == 0  # logits fetched: dense
    assert gather_labelled_rows(exported, ["loss"]) == 1
    graph = exported.graph
    producers = {output: node for node in graph.node for output in node.output}
    loss = next(node for node in graph.node if node.op_type == "SoftmaxCrossEntropyLoss")
    assert producers[loss.input[1]].op_type == "Gather"
    product = next(node for node in graph.node if node.op_type == "MatMul" and node.input[1] == head_weight)
    gather = producers[product.input[0]]
    assert gather.op_type == "Gather" and producers[gather.input[0]].op_type == "Reshape"
    assert producers[gather.input[1]].op_type == "Slice" and [o.name for o in graph.output] == ["loss"]
    rows = [info for info in graph.value_info if info.name == product.output[0]][0]
    assert [d.dim_param or d.dim_value for d in rows.type.tensor_type.shape.dim] == ["loss/label_sparsity/rows",
                                                                                     VOCAB]
    session = onnxruntime.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"])
    (ours,) = session.run(None, {"ids": ids.numpy(), "labels": labels.numpy()})
    assert ours == pytest.approx(tiny_loss(model(ids), labels).item(), rel=1e-6)


class LossOnly(nn.Module):
    """forward() returns the loss alone: ORTModule returns no logits, so it can leave rows out."""

    def __init__(self, with_logits=False):
        super().__init__()
        self.model, self.with_logits = TinyLM(), with_logits

    def forward(self, ids, labels):
        logits = self.model(ids)
        loss = tiny_loss(logits, labels)
        return (loss, logits) if self.with_logits else loss


def _ortmodule_steps(monkeypatch, tmp_path, module, batches):
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    wrapped = ORTModule(copy.deepcopy(module), DebugOptions(save_onnx=True, onnx_prefix="lm"))
    losses, weights = _eager_steps(wrapped, batches, copied=False)
    return losses, {name.removeprefix("_original_module."): weight for name, weight in weights.items()}


def _eager_steps(module, batches, *, copied=True):
    """SGD steps of `module` (a copy of it where `copied`): (losses, {name: weight after})."""
    module, losses = copy.deepcopy(module) if copied else module, []
    sgd = torch.optim.SGD(module.parameters(), lr=0.5)
    for ids, labels in batches:
        sgd.zero_grad()
        output = module(ids, labels)
        loss = output[0] if isinstance(output, tuple) else output
        loss.backward()
        sgd.step()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in module.named_parameters()}


@pytest.mark.parametrize("environ, sparse", [({}, True), ({"ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER": "0"}, False),
                                             ({"ORTMODULE_ENABLE_COMPUTE_OPTIMIZER": "0"}, False)], ids=str)
def test_ortmodule_of_a_loss_without_its_logits_trains_like_eager(monkeypatch, tmp_path, environ, sparse):
    """ONNX Runtime's ORTModule switches: label sparsity on by default, off with either."""
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    torch.manual_seed(0)
    module, batches = LossOnly(), _batches(["half", "all", "scattered", "none"])
    ours = _ortmodule_steps(monkeypatch, tmp_path, module, batches)
    assert _head_reads_gathered_rows(tmp_path / "lm_optimized_training.onnx") == sparse
    _assert_same(ours, _eager_steps(module, batches), rtol=1e-5, atol=1e-6)


def test_ortmodule_returning_the_logits_computes_its_loss_on_the_kept_rows(monkeypatch, tmp_path):
    """The caller gets the logits of every position (a Hugging Face model's output holds them): the
    projection stays dense, one torch node that also gives the loss the kept rows
    (tests/test_label_sparsity_logits.py)."""
    torch.manual_seed(0)
    module, batches = LossOnly(with_logits=True), _batches(["half", "scattered"])
    ours = _ortmodule_steps(monkeypatch, tmp_path, module, batches)
    graph = onnx.load(tmp_path / "lm_optimized_training.onnx").graph
    assert not _head_reads_gathered_rows(tmp_path / "lm_optimized_training.onnx")
    assert sum(node.name.endswith("/label_sparsity/projection") for node in graph.node) == 1
    _assert_same(ours, _eager_steps(module, batches), rtol=1e-5, atol=1e-6)


def _hand_written(log_prob_output=False, bias_shape=(VOCAB,), reduction="mean"):
    """hidden [N, WIDTH] @ weight + bias -> SoftmaxCrossEntropyLoss(ignore_index=-100)."""
    make, value = onnx.helper.make_node, onnx.helper.make_tensor_value_info
    loss_outputs = ["loss", "log_prob"] if log_prob_output else ["loss"]
    graph = onnx.helper.make_graph(
        [make("MatMul", ["hidden", "weight"], ["product"]), make("Add", ["product", "bias"], ["scores"]),
         make("SoftmaxCrossEntropyLoss", ["scores", "labels"], loss_outputs, ignore_index=-100,
              reduction=reduction)],
        "hand_written",
        [value("hidden", onnx.TensorProto.FLOAT, [6, WIDTH]), value("labels", onnx.TensorProto.INT64, [6]),
         value("weight", onnx.TensorProto.FLOAT, [WIDTH, VOCAB]), value("bias", onnx.TensorProto.FLOAT, bias_shape)],
        [value(name, onnx.TensorProto.FLOAT, None) for name in loss_outputs])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 14)], ir_version=7)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_what_is_left_dense(reduction):
    """Rewritten: a [classes] bias, reduction mean or sum. Dense: the log-probabilities read (every row's),
    a bias of another shape, no ignore_index, reduction 'none'."""
    assert gather_labelled_rows(_hand_written(reduction=reduction), ["loss"]) == 1
    assert gather_labelled_rows(_hand_written(log_prob_output=True, reduction=reduction), ["loss"]) == 0
    assert gather_labelled_rows(_hand_written(bias_shape=(6, VOCAB), reduction=reduction), ["loss"]) == 0
    model = _hand_written(reduction=reduction)
    del model.graph.node[2].attribute[0]  # ignore_index
    assert gather_labelled_rows(model, ["loss"]) == 0
    assert gather_labelled_rows(_hand_written(reduction="none"), ["loss"]) == 0


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_rewritten_loss_equals_the_dense_one_for_every_reduction(reduction):
    generator = torch.Generator().manual_seed(3)
    feeds = {"hidden": torch.randn(6, WIDTH, generator=generator).numpy(),
             "labels": torch.tensor([-100, 3, -100, 7, 1, -100]).numpy(),
             "weight": torch.randn(WIDTH, VOCAB, generator=generator).numpy(),
             "bias": torch.randn(VOCAB, generator=generator).numpy()}
    dense = _hand_written(reduction=reduction)
    sparse = copy.deepcopy(dense)
    assert gather_labelled_rows(sparse, ["loss"]) == 1
    results = [onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
               .run(None, feeds)[0] for model in (sparse, dense)]
    assert results[0] == pytest.approx(results[1], rel=1e-6)
    feeds["labels"][:] = -100  # none kept: NaN (mean) or 0 (sum), as the dense loss
    results = [onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
               .run(None, feeds)[0] for model in (sparse, dense)]
    assert results[0] == pytest.approx(results[1], nan_ok=True)


def _shape_read(name):
    """The hand-written graph whose tensor `name` a Shape also reads, its shape a graph output."""
    model = _hand_written()
    model.graph.node.append(onnx.helper.make_node("Shape", [name], ["read_shape"]))
    model.graph.output.append(onnx.helper.make_tensor_value_info("read_shape", onnx.TensorProto.INT64, None))
    return model


def test_a_shape_read_of_the_scores_is_computed_from_the_dense_rows():
    """`logits.size(-1)` (DistilBERT's and T5's losses): the Shape of a projection's tensor is taken
    from its input's leading dims, still the dense shape; the flattened scores' is not (it stays dense)."""
    feeds = {"hidden": np.ones((6, WIDTH), np.float32), "labels": np.array([-100, 3, -100, 7, 1, -100]),
             "weight": np.ones((WIDTH, VOCAB), np.float32), "bias": np.ones(VOCAB, np.float32)}
    for name in ("product", "scores"):
        model = _shape_read(name)
        assert gather_labelled_rows(model, ["loss", "read_shape"]) == 1
        assert not any(node.op_type == "Shape" and node.input[0] == name for node in model.graph.node)
        session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        assert session.run(["read_shape"], feeds)[0].tolist() == [6, VOCAB]
    flattened = _hand_written()
    flattened.graph.node[1].output[0] = "unflattened"  # scores = Reshape(unflattened), whose Shape is read
    flattened.graph.node.insert(2, onnx.helper.make_node("Reshape", ["unflattened", "flat"], ["scores"]))
    flattened.graph.initializer.append(onnx.numpy_helper.from_array(np.array([-1, VOCAB]), "flat"))
    flattened.graph.node.append(onnx.helper.make_node("Shape", ["scores"], ["read_shape"]))
    flattened.graph.output.append(onnx.helper.make_tensor_value_info("read_shape", onnx.TensorProto.INT64, None))
    assert gather_labelled_rows(flattened, ["loss", "read_shape"]) == 0


def test_a_classifier_head_stays_dense(monkeypatch):
    """Under `MIN_CLASSES` classes the rows' count known at run time would cost ONNX Runtime its
    memory pattern for more than the rows save: the graph stays dense."""
    monkeypatch.setattr(label_sparsity, "MIN_CLASSES", VOCAB + 1)
    assert gather_labelled_rows(_hand_written(), ["loss"]) == 0
    monkeypatch.setattr(label_sparsity, "MIN_CLASSES", VOCAB)
    assert gather_labelled_rows(_hand_written(), ["loss"]) == 1



def test_the_kept_rows_products_are_decided_as_the_dense_graphs(tmp_path, monkeypatch):
    """A product over the kept rows (a count known at run time) is decided for the count of labels
    they are taken from (`kept_rows_bounds`): with every product decided for torch, the projection
    and its gradients run in torch, as the dense graph's do, and the losses stay the dense graph's."""
    from ort_trainer._runtime import product_speed

    asked = []
    monkeypatch.setattr(product_speed, "torch_product_faster", lambda form, threads: asked.append(form) or True)
    torch.manual_seed(0)
    model, batches = TinyLM(), _batches(["half", "scattered"])
    sparse = _train(model, True, OPTIMIZERS["adam"][0](), tmp_path / "sparse.onnx", batches)
    dense = _train(model, False, OPTIMIZERS["adam"][0](), tmp_path / "dense.onnx", batches)
    _assert_same(sparse, dense, rtol=1e-5, atol=1e-6)
    graph = onnx.load(tmp_path / "sparse.onnx").graph
    kept_rows = [node for node in graph.node if any("label_sparsity/kept_hidden" in name for name in node.input)]
    assert kept_rows and not [node.op_type for node in kept_rows if node.op_type in ("MatMul", "Gemm", "FusedMatMul")]
    assert (False, True, 3 * 8, WIDTH, VOCAB) in asked  # the projection, for the batch's 24 labels
