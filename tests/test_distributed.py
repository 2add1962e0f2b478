"""Data parallel and ZeRO stage 1 on 2 gloo processes against one process on the global batch.

The multi-process runs are module-scoped fixtures (one launch per scenario, see
tests/distributed_worker.py); the option checks run in this process, with a 1-rank process group.
"""
import json
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ort_trainer import ORTTrainer, ORTTrainerOptions
from ort_trainer._optimizers.flat import FlatLayout
from ort_trainer._optimizers.hyper import SGDHyper
from ort_trainer._trainer.distributed import Shards, SingleProcess, setup, shard_layout

from . import distributed_worker as worker
from . import models

TOLERANCE = 1e-5


def _relative(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _run(scenario, directory, **launch_options):
    results = worker.launch(scenario, directory, **launch_options)
    for rank, (returncode, stderr, _) in enumerate(results):
        assert returncode == 0, f"rank {rank} exited with {returncode}:\n{stderr[-3000:]}"
    return [torch.load(directory / f"rank{rank}.pt", weights_only=False) for rank in range(worker.WORLD_SIZE)]


def single_process(config, steps, trainer=None):
    """One process on the concatenated global batches: (losses, trainer)."""
    trainer = trainer or worker.make_trainer(config)
    return worker.train(trainer, steps, worker.global_batch), trainer


def assert_matches(losses_per_rank, weights_per_rank, expected_losses, expected_weights):
    """The ranks' mean loss per micro-step and every rank's weights equal one process's."""
    mean_losses = np.mean(losses_per_rank, axis=0)
    np.testing.assert_allclose(mean_losses, expected_losses, rtol=TOLERANCE)
    for weights in weights_per_rank:
        for name, expected in expected_weights.items():
            assert _relative(weights[name], expected) <= TOLERANCE, name


# ---------------------------------------------------------------- training equals one process

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return _run("train", tmp_path_factory.mktemp("train"))


@pytest.mark.parametrize("config", sorted(worker.CONFIGS))
@pytest.mark.parametrize("zero_stage", [0, 1], ids=["data_parallel", "zero1"])
def test_training_equals_one_process_on_the_global_batch(trained, zero_stage, config):
    expected_losses, trainer = single_process(config, worker.MICRO_STEPS)
    runs = [rank_results[zero_stage, config] for rank_results in trained]
    assert_matches([run["losses"] for run in runs], [run["weights"] for run in runs],
                   expected_losses, worker.weights(trainer))


@pytest.mark.parametrize("zero_stage", [0, 1], ids=["data_parallel", "zero1"])
@pytest.mark.parametrize("optimizer", ["adam", "lamb"])
def test_reducing_after_accumulation_equals_reducing_every_micro_step(trained, zero_stage, optimizer):
    for rank_results in trained:
        post = rank_results[zero_stage, f"{optimizer}_accumulate_post"]
        every = rank_results[zero_stage, f"{optimizer}_accumulate_every"]
        np.testing.assert_allclose(post["losses"], every["losses"], rtol=TOLERANCE)
        for name, expected in every["weights"].items():
            assert _relative(post["weights"][name], expected) <= TOLERANCE, name


# ---------------------------------------------------------------- checkpoints

@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    directory = tmp_path_factory.mktemp("checkpoint")
    return directory, _run("checkpoint", directory)


def test_zero_checkpoint_continues_in_one_process(checkpointed):
    directory, ranks = checkpointed
    trainer = worker.make_trainer("lamb")
    assert trainer.load_checkpoint(directory / "zero.pt") == {"note": "zero"}
    losses, trainer = single_process("lamb", 3, trainer)
    straight_losses, straight = single_process("lamb", 6)
    np.testing.assert_allclose(losses, straight_losses[3:], rtol=TOLERANCE)
    assert_matches([rank["continued"] for rank in ranks], [rank["weights"] for rank in ranks],
                   losses, worker.weights(trainer))
    for name, expected in worker.weights(straight).items():
        assert _relative(trainer.model.state_dict()[name], expected) <= TOLERANCE, name


def test_zero_checkpoint_reloads_on_the_same_world_size(checkpointed):
    _, ranks = checkpointed
    for rank in ranks:
        assert rank["user_dict"] == {"note": "zero"}
        assert rank["reloaded"] == rank["continued"]
        for name, expected in rank["weights"].items():
            assert torch.equal(rank["reloaded_weights"][name], expected), name


def test_zero_checkpoint_is_one_file_with_the_full_optimizer_state(checkpointed):
    directory, _ = checkpointed
    assert sorted(path.name for path in directory.glob("zero.pt*")) == ["zero.pt"]
    full = torch.load(directory / "zero.pt", weights_only=True)
    names = {name for name, _ in models.mlp().named_parameters()}
    assert full["optimizer"]["step_count"] == 3
    for state_name in ("exp_avg", "exp_avg_sq"):
        assert set(full["optimizer"]["state"][state_name]) == names


def test_data_parallel_checkpoint_and_a_failed_save(checkpointed):
    directory, ranks = checkpointed
    assert not any(directory.glob("dp.pt.rank*"))
    trainer = worker.make_trainer("adam")
    trainer.load_checkpoint(directory / "dp.pt")
    for name, expected in ranks[0]["dp_weights"].items():
        assert torch.equal(trainer.model.state_dict()[name], expected), name
    assert ranks[0]["save_error"].startswith("FileNotFoundError: cannot write")
    path = directory / "missing" / "dp.pt"
    assert ranks[1]["save_error"] == (f"RuntimeError: ORTTrainer: save_checkpoint({str(path)!r}) failed on "
                                      "rank(s) [0]; see the error there")


# ---------------------------------------------------------------- a failing rank

def test_a_rank_that_raises_stops_the_others_with_a_clear_error(tmp_path):
    (survivor, stderr, seconds), (failed, failed_stderr, _) = worker.launch("rank_fails", tmp_path)
    assert failed != 0 and "rank 1 fails on purpose" in failed_stderr
    assert survivor not in (0, None) and seconds < 30
    assert ("RuntimeError: ORTTrainer: averaging the gradients failed on rank 0 of 2: another rank stopped (an error "
            "or a crash) or did not get there within the process group's timeout") in stderr


def test_a_rank_that_stalls_times_the_others_out(tmp_path):
    results = worker.launch("rank_stalls", tmp_path, group_timeout=5)
    returncode, stderr, seconds = results[0]
    assert returncode not in (0, None)
    assert ("RuntimeError: ORTTrainer: reduce-scattering the gradients failed on rank 0 of 2: another rank "
            "stopped (an error or a crash) or did not get there within the process group's timeout") in stderr
    assert seconds < 30


# ---------------------------------------------------------------- options and the process group

@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=10))
    yield
    dist.destroy_process_group()


def _options(**distributed):
    return ORTTrainerOptions({"distributed": distributed})


def test_world_size_without_a_process_group():
    message = ("ORTTrainer: distributed training is asked for (options.distributed.world_size=2), but no "
               "torch.distributed process group is initialized: call torch.distributed.init_process_group() before "
               "creating the ORTTrainer (backend 'gloo' on CPU, 'nccl' on GPU), or launch with torchrun")
    with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"):
        ORTTrainer(models.mlp(), models.MLP_DESC, worker.CONFIGS["adam"][0](), loss_fn=models.mlp_loss,
                   options=_options(world_size=2))


def test_torchrun_environment_without_a_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    message = ("ORTTrainer: distributed training is asked for (options.distributed.world_rank=1, WORLD_SIZE=2 in "
               "the environment (torchrun)), but no torch.distributed process group is initialized")
    with pytest.raises(RuntimeError, match=f"^{re.escape(message)}"):
        setup(_options(world_rank=1))


@pytest.mark.parametrize("distributed, message", [
    ({"world_size": 4}, "distributed.world_size=4, but the torch.distributed process group's world size is 1"),
    ({"world_rank": 1}, "distributed.world_rank=1, but this process is rank 0 of the torch.distributed process group"),
    ({"local_rank": 3}, "distributed.local_rank=3, but the environment says LOCAL_RANK=0"),
])
def test_options_that_disagree_with_the_process_group(one_rank_group, monkeypatch, distributed, message):
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match=f"^{re.escape('Invalid options: ' + message)}$"):
        setup(_options(**distributed))


def test_a_one_rank_group_trains_as_one_process(one_rank_group):
    assert type(setup(_options(deepspeed_zero_optimization={"stage": 1}))) is SingleProcess


def test_zero_on_a_gpu_is_refused():
    options = ORTTrainerOptions({"device": {"id": "cuda:0"},
                                 "distributed": {"deepspeed_zero_optimization": {"stage": 1}}})
    message = "distributed.deepspeed_zero_optimization.stage=1 runs on the CPU only for now, got device.id='cuda:0'"
    with pytest.raises(NotImplementedError, match=f"^{re.escape(message)}$"):
        setup(options)


# ---------------------------------------------------------------- shards

def test_shards_are_equal_but_the_last():
    assert [(s.start, s.stop) for s in (Shards(645, rank, 2) for rank in range(2))] == [(0, 323), (323, 645)]
    assert [(s.start, s.stop) for s in (Shards(12, rank, 3) for rank in range(3))] == [(0, 4), (4, 8), (8, 12)]


def test_too_few_elements_for_non_empty_shards():
    message = ("ZeRO stage 1: 9 trainable elements cannot be cut into 4 non-empty equal shards; "
               "use deepspeed_zero_optimization.stage=0 for so small a model")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        Shards(9, 0, 4)


def test_shard_layout_cuts_tensors_and_keeps_group_hyperparameters():
    first, second = (SGDHyper(momentum=momentum, nesterov=False, lambda_coef=0.0, dampening=0.0)
                     for momentum in (0.1, 0.2))
    layout = FlatLayout.from_sizes([[10, 6], [4, 5]], [first, second])  # offsets 0 10 16 20 25
    local, segments = shard_layout(layout, 8, 22)
    assert local.seg_offsets.tolist() == [0, 2, 8, 12, 14]
    assert segments.tolist() == [0, 1, 2, 3]
    assert [(g.start, g.stop, g.seg_start, g.seg_stop, g.hyper) for g in local.groups] == [
        (0, 8, 0, 2, first), (8, 14, 2, 4, second)]
    local, segments = shard_layout(layout, 20, 25)
    assert local.seg_offsets.tolist() == [0, 5] and segments.tolist() == [3]
    assert [g.hyper for g in local.groups] == [second]


# ---------------------------------------------------------------- the example under torchrun

@pytest.mark.parametrize("argv, message", [
    (["--engine", "pytorch"], "error: under torchrun use --engine ort (ORTTrainer trains data parallel)"),
    (["--engine", "ort", "--batch-size", "5"], "error: --batch-size 5 must be a multiple of the 2 ranks"),
])
def test_example_under_torchrun_refuses(monkeypatch, argv, message):
    from examples.wikitext2.train import join_process_group, parse_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match=f"^{re.escape(message)}$"):
        join_process_group(parse_args(["--data", "unused.txt"] + argv))


def test_example_runs_under_torchrun_with_two_processes(tmp_path):
    from examples.wikitext2.train import DEFAULT_DATA

    if not DEFAULT_DATA.is_file():
        pytest.skip("shared WikiText-2 text not available")
    with open(DEFAULT_DATA, encoding="utf-8") as source:
        (tmp_path / "slice.txt").write_text("".join(next(source) for _ in range(400)), encoding="utf-8")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "examples.wikitext2", "--engine", "ort", "--data", str(tmp_path / "slice.txt"),
               "--epochs", "1", "--max-batches", "2", "--quiet", "--json", str(tmp_path / "m.json")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("| End of training |") == 1  # rank 0 alone reports
    assert json.loads((tmp_path / "m.json").read_text())["train_batches"] == 2
