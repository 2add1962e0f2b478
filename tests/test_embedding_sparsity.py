"""Embedding sparsity (`_graph.embedding_sparsity`: ORTModule's ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER,
ORTTrainer's `graph_transformer.embedding_sparsity`): the per-token layers after an embedding with a
padding_idx compute the non-padding rows and one shared padded row. Exactness is the proof: losses,
outputs and every gradient equal the dense graph's and eager PyTorch's, for batches with no padding,
all padding, padding whose labels count, new lengths and reused graphs; each test checks that the
graph was rewritten (or, where it must stay dense, that it was not and the report says why)."""
import copy
import logging

import onnx
import pytest
import torch
import transformers
from torch import nn

from ort_trainer import ORTModule, ORTTrainer, ORTTrainerOptions, optim
from ort_trainer._graph import label_sparsity as label_sparsity_rewrite
from ort_trainer._graph.embedding_sparsity import drop_padding_rows
from ort_trainer.ortmodule import DebugOptions

from . import models

VOCAB, WIDTH, PAD = 30, 16, 0


class PaddedLM(nn.Module):
    """An embedding with padding_idx, a LayerNorm and a residual MLP per token, a vocabulary head."""

    def __init__(self):
        super().__init__()
        self.embed, self.norm = nn.Embedding(VOCAB, WIDTH, padding_idx=PAD), nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        hidden = self.norm(self.embed(ids))
        return self.head(hidden + self.down(nn.functional.gelu(self.up(hidden))))


def lm_loss(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


class PaddedMLP(PaddedLM):
    """PaddedLM returning its loss (and its logits when `logits`)."""

    def __init__(self, *, logits=False):
        super().__init__()
        self.logits = logits

    def forward(self, ids, labels):
        logits = super().forward(ids)
        loss = lm_loss(logits, labels)
        return (loss, logits) if self.logits else loss


def _batch(generator, batch, seq, padded, *, padded_labels=False):
    """ids with `padded` ('none', 'all' or a per-row count of trailing padding), labels -100 at
    padding unless `padded_labels` (then the padded positions' loss counts)."""
    ids = torch.randint(1, VOCAB, (batch, seq), generator=generator)
    if padded == "all":
        ids[:] = PAD
    elif padded != "none":
        for row, count in enumerate(padded):
            ids[row, seq - count:] = PAD
    labels = torch.randint(0, VOCAB, (batch, seq), generator=generator)
    if not padded_labels:
        labels[ids == PAD] = -100
    return ids, labels


BATCHES = [(3, 8, (3, 0, 5)), (3, 8, "none"), (3, 8, (7, 1, 2)), (2, 5, "all"), (2, 5, (2, 4)), (3, 8, (8, 8, 1))]


def _run(model, batches, environ, monkeypatch, wrap=lambda model: model):
    """Losses, outputs and gradients of each batch (one SGD step after each) of a copy of `model`,
    wrapped by `wrap` under `environ`; then the loss and outputs of the first batch without gradients
    (the inference graph)."""
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    model = wrap(copy.deepcopy(model))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    results = []
    for ids, labels in batches:
        optimizer.zero_grad()
        out = model(ids, labels)
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
        results.append((loss.detach(), [o.detach() for o in out[1:]] if isinstance(out, tuple) else [],
                        {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}))
        optimizer.step()
    with torch.no_grad():
        out = model(*batches[0])
    results.append((out[0], list(out[1:]), {}) if isinstance(out, tuple) else (out, [], {}))
    for name in environ:
        monkeypatch.delenv(name)
    return results


def _assert_equal(ours, theirs, rtol=1e-5, atol=1e-6):
    for (loss, outputs, grads), (loss2, outputs2, grads2) in zip(ours, theirs, strict=True):
        torch.testing.assert_close(loss, loss2, rtol=rtol, atol=atol, equal_nan=True)
        for output, output2 in zip(outputs, outputs2, strict=True):
            torch.testing.assert_close(output, output2, rtol=rtol, atol=atol)
        assert grads.keys() == grads2.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], grads2[name], rtol=rtol, atol=atol, msg=name)


SAVE = {"ORTMODULE_FALLBACK_POLICY": "FALLBACK_DISABLE"}


def _sparse_nodes(path):
    """The nodes of a saved graph that read a tensor of the sparse rows."""
    return [node for node in onnx.load(path).graph.node if any(name.endswith("/sparse") for name in node.input)]


@pytest.mark.parametrize("logits", [False, True], ids=["loss", "loss-and-logits"])
@pytest.mark.parametrize("padded_labels", [False, True], ids=["labels-ignored-at-padding", "labels-at-padding"])
def test_ortmodule_losses_outputs_and_gradients_equal_the_dense_graph_and_eager(monkeypatch, tmp_path, logits,
                                                                                padded_labels):
    torch.manual_seed(0)
    model = PaddedMLP(logits=logits)
    generator = torch.Generator().manual_seed(3)
    batches = [_batch(generator, *shape, padded_labels=padded_labels) for shape in BATCHES]
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    sparse = _run(model, batches, SAVE, monkeypatch,
                  lambda m: ORTModule(m, DebugOptions(save_onnx=True, onnx_prefix="sparse")))
    dense = _run(model, batches, {**SAVE, "ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER": "0"}, monkeypatch,
                 lambda m: ORTModule(m, DebugOptions(save_onnx=True, onnx_prefix="dense")))
    eager = _run(model, batches, {}, monkeypatch)
    assert any(node.op_type in ("MatMul", "FusedMatMul", "ATen")
               for node in _sparse_nodes(tmp_path / "sparse_optimized_training.onnx"))
    assert not _sparse_nodes(tmp_path / "dense_optimized_training.onnx")
    _assert_equal(sparse, dense)
    _assert_equal(sparse, eager, rtol=1e-4, atol=1e-5)


def test_the_shared_padded_row_gets_no_embedding_gradient_and_tied_weights_keep_theirs(monkeypatch):
    """torch's padding_idx row gets no gradient from the lookup; the head tied to the embedding
    still gives it one."""
    torch.manual_seed(0)
    model = PaddedMLP()
    model.head.weight = model.embed.weight
    generator = torch.Generator().manual_seed(5)
    batches = [_batch(generator, *shape, padded_labels=True) for shape in BATCHES[:3]]
    sparse = _run(model, batches, SAVE, monkeypatch, ORTModule)
    eager = _run(model, batches, {}, monkeypatch)
    _assert_equal(sparse, eager, rtol=1e-4, atol=1e-5)
    untied = PaddedMLP()
    sparse = _run(untied, batches, SAVE, monkeypatch, ORTModule)
    assert all(grads["embed.weight"][PAD].abs().max() == 0 for _, _, grads in sparse[:-1])


def _tiny_bert():
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, pad_token_id=PAD,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(config)


class Bert(nn.Module):
    """BERT's masked LM with an attention mask that marks the padding."""

    def __init__(self):
        super().__init__()
        self.bert = _tiny_bert()

    def forward(self, ids, labels):
        return self.bert(input_ids=ids, attention_mask=(ids != PAD).long(), labels=labels).loss


def test_bert_stays_dense_equal_to_eager_and_the_report_says_why(monkeypatch, caplog):
    """BERT adds the position and token-type embeddings to the word embedding's output: per-position
    tensors, so the padded rows differ and the rewrite does not apply."""
    torch.manual_seed(0)
    model = Bert()
    generator = torch.Generator().manual_seed(4)
    batches = [_batch(generator, *shape) for shape in BATCHES[:3]]
    with caplog.at_level(logging.INFO, logger="ort_trainer.ortmodule"):
        sparse = _run(model, batches, {**SAVE, "ORTMODULE_PRINT_INPUT_DENSITY": "1"}, monkeypatch, ORTModule)
    eager = _run(model, batches, {}, monkeypatch)
    _assert_equal(sparse, eager, rtol=1e-4, atol=1e-5)
    reports = [r.getMessage() for r in caplog.records if "input density" in r.getMessage()]
    assert reports and all("embedding bert.bert.embeddings.word_embeddings.weight (indices ids, padding_idx 0) "
                           "stayed dense: Add (another input differs by position)" in report for report in reports)


@pytest.mark.parametrize("label_sparsity, head", [
    ("0", "MatMul (fewer values to remake before it)"),  # its product widens 16 -> 30 values per row
    ("1", "ort_trainer::labelled_projection (org.pytorch.aten)")], ids=["label-sparsity-off", "label-sparsity-on"])
def test_the_density_report_says_which_embedding_was_made_sparse(monkeypatch, caplog, label_sparsity, head):
    """The dense rows are remade before the head (with its logits returned, label sparsity's torch node)."""
    monkeypatch.setattr(label_sparsity_rewrite, "MIN_CLASSES", 2)  # this head's few classes made sparse all the same
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(3)
    with caplog.at_level(logging.INFO, logger="ort_trainer.ortmodule"):
        _run(PaddedMLP(logits=True), [_batch(generator, *BATCHES[0])],
             {**SAVE, "ORTMODULE_PRINT_INPUT_DENSITY": "1", "ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER": label_sparsity},
             monkeypatch, ORTModule)
    reports = [r.getMessage() for r in caplog.records if "input density" in r.getMessage()]
    assert len(reports) == 2  # the training graph's, the inference graph's
    for report in reports:
        assert report.endswith("; embedding embed.weight (indices ids, padding_idx 0): 19 per-token nodes run on "
                               f"the non-padding rows; dense again for {head}")


def _trainer_run(model, batches, sparse, path, fetches):
    model = copy.deepcopy(model)
    desc = {"inputs": [("ids", ["batch", "seq"]), ("labels", ["batch", "seq"])],
            "outputs": [("loss", [], True), ("logits", ["batch", "seq", VOCAB])]}
    options = {"graph_transformer": {"embedding_sparsity": sparse}, "utils": {"grad_norm_clip": False},
               "debug": {"graph_save_paths": {"model_with_training_graph_path": str(path)}}}
    trainer = ORTTrainer(model, desc, optim.SGDConfig(lr=0.5), loss_fn=lm_loss, options=ORTTrainerOptions(options))
    trainer.train_step_info.fetches = fetches
    results = [trainer.train_step(*batch) for batch in batches]
    losses = [result[0] if isinstance(result, (list, tuple)) else result for result in results]
    logits = [result[1] for result in results] if "logits" in fetches else []
    return losses, logits, {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("fetches", [["loss"], ["loss", "logits"]], ids="-".join)
def test_ortrainer_losses_and_weights_equal_the_dense_graph_and_eager(tmp_path, fetches):
    torch.manual_seed(0)
    model = PaddedLM()
    generator = torch.Generator().manual_seed(3)
    batches = [_batch(generator, *shape, padded_labels=step % 2 == 1) for step, shape in enumerate(BATCHES)]
    sparse = _trainer_run(model, batches, True, tmp_path / "sparse.onnx", fetches)
    dense = _trainer_run(model, batches, False, tmp_path / "dense.onnx", fetches)
    assert any(node.op_type in ("MatMul", "FusedMatMul", "ATen") for node in _sparse_nodes(tmp_path / "sparse.onnx"))
    assert not _sparse_nodes(tmp_path / "dense.onnx")
    torch.testing.assert_close(torch.stack(sparse[0]), torch.stack(dense[0]), rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(sparse[1], dense[1], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    for name, weight in sparse[2].items():
        torch.testing.assert_close(weight, dense[2][name], rtol=1e-5, atol=1e-6, msg=name)
    eager_losses, eager_weights = models.torch_loop(model, lm_loss, batches, lambda p: torch.optim.SGD(p, lr=0.5))
    torch.testing.assert_close(torch.stack(sparse[0]), torch.tensor(eager_losses), rtol=1e-4, atol=1e-5)
    for name, weight in sparse[2].items():
        torch.testing.assert_close(weight, eager_weights[name], rtol=1e-4, atol=1e-5, msg=name)


def test_the_rewrite_leaves_a_graph_without_padding_idx_alone():
    """No marker (an embedding without padding_idx): nothing to rewrite, nothing reported."""
    model = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("Gather", ["w", "ids"], ["rows"])], "g",
        [onnx.helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [2, 3]),
         onnx.helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, [5, 4])],
        [onnx.helper.make_tensor_value_info("rows", onnx.TensorProto.FLOAT, [2, 3, 4])]))
    before = model.SerializeToString()
    assert drop_padding_rows(model, ["w"]) == []
    assert model.SerializeToString() == before
