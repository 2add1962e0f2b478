"""BatchNorm in training mode trains as in eager PyTorch, in both front ends: the graph normalizes
with the batch statistics, and the model's running statistics (running_mean, running_var,
num_batches_tracked) are updated after every training run as torch's forward updates them.

Tolerances (fp32 throughout). Losses: rtol 1e-5, as the other parity tests of this repo (seen:
2e-7). Running statistics: |ours - torch's| <= 1e-6 + 1e-5 |torch's| (seen: at most 0.45 of that
bound). The graph's per-channel mean and variance are fp32 reductions in another order than
torch's kernel, the weights they are computed from drift apart by ~1e-7 relative over the steps,
and the atol covers running means near 0 (their relative error is not meaningful);
num_batches_tracked is exact.
"""
import copy

import pytest
import torch
import torch.nn as nn

from ort_trainer import ORTTrainer, ORTTrainerOptions, amp, optim
from ort_trainer.ortmodule import ORTModule

from . import distributed_worker as worker
from . import models

STEPS = 10
LOSS_RTOL = 1e-5
STATISTICS = {"rtol": 1e-5, "atol": 1e-6}


class NormedMLP(nn.Module):
    """A BatchNorm1d (cumulative average: momentum=None) called twice per forward: torch updates its
    statistics twice, in call order."""

    def __init__(self):
        super().__init__()
        self.first, self.second, self.head = nn.Linear(12, 16), nn.Linear(16, 16), nn.Linear(16, 5)
        self.norm = nn.BatchNorm1d(16, momentum=None)

    def forward(self, x):
        hidden = torch.relu(self.norm(self.first(x)))
        return self.head(torch.relu(self.norm(self.second(hidden))))


def _mlp(seed=0):
    torch.manual_seed(seed)
    return NormedMLP()


def _mlp_batch(step, batch=8):
    x, target = models.mlp_batch(step, batch)
    return x * 3 - 1, target


def _conv_batch(step):
    """8 rows, 6 every third step: ORTTrainer re-derives a graph for that shape (n in the unbiased
    variance's n / (n - 1) is read from the input's shape)."""
    return models.conv_batch_norm_batch(step, 6 if step % 3 == 2 else 8)


# name -> (model factory, model_desc, batch of a step)
CASES = {
    "conv": (lambda: models.conv_batch_norm(), models.CONV_BATCH_NORM_DESC, _conv_batch),
    "conv_cumulative_not_affine": (lambda seed=0: models.conv_batch_norm(seed, momentum=None, affine=False),
                                   models.CONV_BATCH_NORM_DESC, models.conv_batch_norm_batch),
    "mlp_cumulative_norm_called_twice": (_mlp, models.MLP_DESC, _mlp_batch),
}


def _trainer(model, desc, accumulation=1, **options):
    return ORTTrainer(model, desc, optim.SGDConfig(lr=0.1, momentum=0.9), loss_fn=models.mlp_loss,
                      options=ORTTrainerOptions({"utils": {"grad_norm_clip": False},
                                                 "batch": {"gradient_accumulation_steps": accumulation},
                                                 **options}))


def _torch_sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _torch_step(model, optimizer, batch, update=True):
    """One eager step (`update=False`: forward and backward only, the gradients accumulate)."""
    loss = models.mlp_loss(model(batch[0]), batch[1])
    loss.backward()
    if update:
        optimizer.step()
        optimizer.zero_grad()
    return loss.item()


def assert_same_statistics(ours, theirs, where=""):
    """The running statistics (every buffer) of two models are torch's, `num_batches_tracked` exactly."""
    theirs = dict(theirs.named_buffers())
    for name, buffer in ours.named_buffers():
        if name.endswith("num_batches_tracked"):
            assert torch.equal(buffer, theirs[name]), f"{name} {where}"
        else:
            torch.testing.assert_close(buffer, theirs[name], **STATISTICS, msg=f"{name} {where}")


# ---------------------------------------------------------------- ORTTrainer

@pytest.mark.parametrize("case", sorted(CASES))
def test_trainer_trains_and_updates_running_statistics_as_torch(case):
    make, desc, batch_of = CASES[case]
    model = make()
    reference = copy.deepcopy(model)
    trainer, optimizer = _trainer(model, desc), _torch_sgd(reference)
    for step in range(STEPS):
        ours = trainer.train_step(*batch_of(step))[0].item()
        theirs = _torch_step(reference, optimizer, batch_of(step))
        assert ours == pytest.approx(theirs, rel=LOSS_RTOL), f"step {step}"
        assert_same_statistics(model, reference, f"after step {step}")
    loss, logits = trainer.eval_step(*batch_of(STEPS))  # eval: the running statistics, not the batch's
    reference.eval()
    with torch.no_grad():
        expected = reference(batch_of(STEPS)[0])
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
    assert loss.item() == pytest.approx(models.mlp_loss(expected, batch_of(STEPS)[1]).item(), rel=1e-4)
    assert_same_statistics(model, reference, "after eval_step")  # eval changes nothing
    x, target = batch_of(STEPS)
    with pytest.raises(ValueError, match="input .x. has shape"):
        trainer.train_step(x[:, :2], target)  # a rejected call changes nothing either
    assert_same_statistics(model, reference, "after a rejected train_step")
    assert model.training


def test_trainer_accumulates_gradients_and_updates_statistics_every_micro_step():
    make, desc, batch_of = CASES["conv"]
    model = make()
    reference = copy.deepcopy(model)
    trainer, optimizer = _trainer(model, desc, accumulation=2), _torch_sgd(reference)
    for step in range(8):  # the gradients of 2 micro-steps summed, as ORTTrainer's accumulation does
        ours = trainer.train_step(*batch_of(step))[0].item()
        theirs = _torch_step(reference, optimizer, batch_of(step), update=step % 2 == 1)
        assert ours == pytest.approx(theirs, rel=LOSS_RTOL), f"micro-step {step}"
        assert_same_statistics(model, reference, f"after micro-step {step}")
    assert model.norm.num_batches_tracked.item() == 8


def test_checkpoints_carry_the_running_statistics_and_graphs_read_them_in_place():
    make, desc, batch_of = CASES["conv_cumulative_not_affine"]
    trainer = _trainer(make(), desc)
    for step in range(3):
        trainer.train_step(*batch_of(step))
    state = trainer.state_dict()
    assert state["model"]["norm.num_batches_tracked"].item() == 3
    plain = make()
    plain.load_state_dict(state["model"])  # loads into the plain torch model
    assert_same_statistics(plain, trainer.model)

    other = _trainer(make(seed=1), desc)
    other.train_step(*batch_of(10))  # its graphs compiled, bound to its buffers
    other.load_state_dict(state)  # copied into those buffers: the compiled graphs read them
    plain.eval()
    with torch.no_grad():
        expected = plain(batch_of(3)[0])
    torch.testing.assert_close(other.eval_step(*batch_of(3))[1], expected, rtol=1e-4, atol=1e-5)
    for step in range(3, 6):
        assert other.train_step(*batch_of(step))[0].item() == pytest.approx(
            trainer.train_step(*batch_of(step))[0].item(), rel=LOSS_RTOL)
    assert_same_statistics(other.model, trainer.model)  # momentum=None: the cumulative average went on


class _OverflowingScaler(amp.LossScaler):
    """A loss scale so large that every gradient overflows: every update is skipped."""

    def update(self, train_step_info):
        return self.loss_scale


def test_a_skipped_update_still_updates_the_running_statistics_as_torchs_forward_does():
    make, desc, batch_of = CASES["conv"]
    model = make()
    reference, weights = copy.deepcopy(model), copy.deepcopy(model.state_dict())
    with pytest.warns(UserWarning, match="mixed_precision.dtype='float16' on device 'cpu'"):
        trainer = _trainer(model, desc, mixed_precision={"enabled": True, "loss_scaler": _OverflowingScaler(3e38)})
    for step in range(3):
        trainer.train_step(*batch_of(step))
    assert not trainer.train_step_info.all_finite and trainer.train_step_info.optimization_step == 0
    for step in range(3):
        with torch.autocast("cpu", dtype=torch.float16):  # the graph's conv rounds to fp16, as autocast's
            reference(batch_of(step)[0])  # torch's forward updates them; the update is skipped
    assert_same_statistics(model, reference)
    for name, value in model.state_dict().items():
        if "running" not in name and "num_batches" not in name:
            assert torch.equal(value, weights[name]), name


def test_sync_batch_norm_in_training_mode_is_refused_by_name():
    model = nn.Sequential(nn.Linear(12, 16), nn.SyncBatchNorm(16), nn.Linear(16, 5))
    trainer = _trainer(model, models.MLP_DESC)
    before = {name: b.clone() for name, b in model.named_buffers()}
    with pytest.raises(NotImplementedError, match=r"the model has SyncBatchNorm modules \['1'\] in training mode, "
                                                  r"whose batch statistics are reduced over the ranks .* \(convert "
                                                  r"them to BatchNorm: each rank then normalizes"):
        trainer.train_step(*_mlp_batch(0))
    for name, b in model.named_buffers():
        assert torch.equal(b, before[name]), name
    model[1].eval()  # on its running statistics: nothing to synchronize
    trainer.train_step(*_mlp_batch(0))


# ---------------------------------------------------------------- ORTModule

@pytest.mark.filterwarnings("error:ORTModule")  # a fallback to PyTorch fails the test
@pytest.mark.parametrize("case", sorted(CASES))
def test_ortmodule_trains_and_updates_running_statistics_as_torch(case):
    make, _, batch_of = CASES[case]
    model = make()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model)
    # SGD: the bias of a layer before a BatchNorm has a gradient of 0 up to rounding, which Adam would
    # scale up to steps of lr, in torch and ONNX Runtime alike (their rounding differs).
    ours, theirs = _torch_sgd(wrapped), _torch_sgd(reference)
    for step in range(STEPS):
        loss = _torch_step(wrapped, ours, batch_of(step))
        assert loss == pytest.approx(_torch_step(reference, theirs, batch_of(step)), rel=LOSS_RTOL), f"step {step}"
        assert_same_statistics(model, reference, f"after step {step}")
    with torch.no_grad():  # no gradient, training mode: torch updates the statistics too
        torch.testing.assert_close(wrapped(batch_of(STEPS)[0]), reference(batch_of(STEPS)[0]), rtol=1e-4, atol=1e-5)
    assert_same_statistics(model, reference, "after a no_grad call")
    wrapped.eval()
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(wrapped(batch_of(0)[0]), reference(batch_of(0)[0]), rtol=1e-4, atol=1e-5)
    assert_same_statistics(model, reference, "after an eval call")


def test_ortmodule_falls_back_for_sync_batch_norm_in_training_mode():
    model = nn.Sequential(nn.Linear(12, 16), nn.SyncBatchNorm(16), nn.Linear(16, 5))
    wrapped = ORTModule(copy.deepcopy(model))
    x = _mlp_batch(0)[0]
    with pytest.warns(UserWarning, match=r"runs in PyTorch for this input signature \(FALLBACK_UNSUPPORTED_TORCH_MODEL"
                                         r"\): NotImplementedError: the model has SyncBatchNorm modules \['1'\]"):
        torch.testing.assert_close(wrapped(x), model(x))
    assert_same_statistics(wrapped, model)


# ---------------------------------------------------------------- data parallel against DistributedDataParallel

@pytest.fixture(scope="module")
def data_parallel(tmp_path_factory):
    directory = tmp_path_factory.mktemp("batch_norm")
    results = worker.launch("batch_norm", directory, timeout=120)
    for rank, (returncode, stderr, _) in enumerate(results):
        assert returncode == 0, f"rank {rank} exited with {returncode}:\n{stderr[-3000:]}"
    return [torch.load(directory / f"rank{rank}.pt", weights_only=False) for rank in range(worker.WORLD_SIZE)]


@pytest.mark.parametrize("ours", ["ORTTrainer", "DDP(ORTModule)"])
def test_data_parallel_matches_ddp_rank_by_rank(data_parallel, ours):
    """DistributedDataParallel broadcasts rank 0's buffers before every forward: each rank's running
    statistics after a step are rank 0's before it, updated with that rank's batch."""
    for rank, results in enumerate(data_parallel):
        expected = results["DDP"]
        for step, (got, want) in enumerate(zip(results[ours], expected)):
            assert got["loss"] == pytest.approx(want["loss"], rel=LOSS_RTOL), f"rank {rank} step {step}"
            for name, value in want["buffers"].items():
                torch.testing.assert_close(got["buffers"][name], value, **STATISTICS,
                                           msg=f"{name}, rank {rank} step {step}")
    assert not torch.equal(data_parallel[0]["DDP"][-1]["buffers"]["norm.running_mean"],
                           data_parallel[1]["DDP"][-1]["buffers"]["norm.running_mean"])  # ranks' own batches
