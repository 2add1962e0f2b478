"""Variable input shapes: one compiled graph per shape, shared weights, never a crash mid-epoch."""
import torch

from examples.wikitext2.data import batchify, get_batch
from ort_trainer import ORTTrainer, ORTTrainerOptions, optim

from . import models

BPTT = 7


def split_batches(length=6 * BPTT + 4, batch=4):
    """A whole split as the seed iterates it: full bptt batches, then a shorter last one."""
    generator = torch.Generator().manual_seed(7)
    source = batchify(torch.randint(0, models.VOCAB, (length * batch,), generator=generator), batch)
    return [get_batch(source, i, BPTT) for i in range(0, source.size(0) - 1, BPTT)]


def make_trainer(**utils):
    return ORTTrainer(models.transformer(), models.TRANSFORMER_DESC, optim.AdamConfig(lr=0.01, max_norm_clip=0.5),
                      loss_fn=models.transformer_loss, options=ORTTrainerOptions({"utils": utils}))


def test_whole_split_with_short_last_batch_matches_pytorch_for_two_epochs():
    batches = split_batches()
    assert {tuple(data.shape) for data, _ in batches} == {(BPTT, 4), (3, 4)}
    epochs = batches + batches
    expected, _ = models.torch_loop(models.transformer(), models.transformer_loss, epochs,
                                    lambda p: torch.optim.Adam(p, lr=0.01, foreach=False), max_norm=0.5)
    trainer = make_trainer()
    losses = [trainer.train_step(data, targets)[0].item() for data, targets in epochs]
    assert len(trainer._graphs) == 2
    for step, (ours, theirs) in enumerate(zip(losses, expected)):
        assert abs(ours - theirs) <= 1e-4 * abs(theirs), step


def test_graph_cache_is_bounded_and_recompiles_evicted_shapes():
    batches = split_batches()
    reference = make_trainer()
    bounded = make_trainer(max_cached_graphs=1)
    for data, targets in batches + batches:
        expected = reference.train_step(data, targets)[0]
        assert len(bounded._graphs) <= 1
        assert torch.allclose(bounded.train_step(data, targets)[0], expected, rtol=1e-5)


def test_eval_step_at_a_new_shape_uses_the_trained_weights():
    trainer = make_trainer()
    for data, targets in split_batches()[:3]:
        trainer.train_step(data, targets)
    data, targets = split_batches(length=3 * BPTT + 1, batch=2)[0]
    loss, output = trainer.eval_step(data, targets)
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(data)
    assert torch.allclose(output, expected, atol=1e-5)
    assert abs(loss.item() - models.transformer_loss(expected, targets).item()) < 1e-5
    assert trainer._train_step_info.step == 3
