"""A new input shape re-derives its graph from the first export instead of tracing again, and only
once that graph is proven against torch at the new shape."""
import copy

import pytest
import torch
import torch.nn as nn

from ort_trainer import ORTTrainer, ORTTrainerOptions, optim
from ort_trainer._compile import exports as _export

from . import models


@pytest.fixture
def exports(monkeypatch):
    """Counts traces: one entry per torch.onnx export of the training model."""
    calls = []
    original = _export.export_training_model

    def counted(*args, **kwargs):
        calls.append(args[-1] if len(args) > 6 else kwargs.get("dynamic_axes"))
        return original(*args, **kwargs)

    monkeypatch.setattr(_export, "export_training_model", counted)
    return calls


def _mlp_trainer():
    return ORTTrainer(models.mlp(), models.MLP_DESC, optim.SGDConfig(lr=0.1), loss_fn=models.mlp_loss,
                      options=ORTTrainerOptions({"utils": {"grad_norm_clip": False}}))


def test_a_shape_generic_model_is_traced_once_and_trains_like_torch(exports):
    trainer = _mlp_trainer()
    reference = models.mlp()
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step, rows in enumerate([8, 5, 3, 8, 11]):
        x, y = models.mlp_batch(step, batch=rows)
        loss, _ = trainer.train_step(x, y)
        sgd.zero_grad()
        expected = models.mlp_loss(reference(x), y)
        expected.backward()
        sgd.step()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert exports == [{"x": {0: "batch"}, "target": {0: "batch"}}]
    assert len(trainer._graphs) == 4


class BakedRowCount(nn.Module):
    """Divides by the row count as a Python int: the trace bakes the first batch's count in, so
    the symbolic export is silently wrong at other batch sizes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(12, 5)

    def forward(self, x):
        rows = int(x.shape[0])
        return self.linear(x).sum(1) / rows


def test_a_graph_that_baked_a_shape_in_is_caught_by_the_proof_and_traced_again(exports):
    model = BakedRowCount()
    reference = copy.deepcopy(model)
    desc = {"inputs": [("x", ["batch", 12]), ("y", ["batch"])], "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(model, desc, optim.SGDConfig(lr=0.1), loss_fn=nn.functional.mse_loss,
                         options=ORTTrainerOptions({"utils": {"grad_norm_clip": False}}))
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step, rows in enumerate([8, 4, 6, 4]):
        x = torch.randn(rows, 12, generator=torch.Generator().manual_seed(step))
        y = torch.randn(rows, generator=torch.Generator().manual_seed(100 + step))
        loss = trainer.train_step(x, y)
        sgd.zero_grad()
        expected = nn.functional.mse_loss(reference(x), y)
        expected.backward()
        sgd.step()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5), f"step {step}"
    # symbolic export at 8 rows; 4 rows fails its proof: traced at 4, then at 6 without trying again
    assert [axes is not None for axes in exports] == [True, False, False]


def test_the_transformer_whose_sequence_length_is_baked_in_still_matches_torch(exports, capfd):
    trainer = ORTTrainer(models.transformer(), models.TRANSFORMER_DESC, optim.SGDConfig(lr=0.1),
                         loss_fn=models.transformer_loss)
    reference = models.transformer()
    trainer.train_step(*models.transformer_batch(0))
    with torch.no_grad():
        reference.load_state_dict(trainer.model.state_dict())
        reference.eval()
        for bptt, batch in [(7, 3), (5, 4)]:
            data, targets = models.transformer_batch(1, bptt=bptt, batch=batch)
            loss, _ = trainer.eval_step(data, targets)
            expected = models.transformer_loss(reference(data), targets)
            assert loss.item() == pytest.approx(expected.item(), rel=1e-5), (bptt, batch)
    assert exports[0] is not None and len(exports) <= 3
    assert "onnxruntime" not in capfd.readouterr().err  # a failed proof is ours to handle, not logged as an error
