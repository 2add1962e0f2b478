"""ORTModule composed with what wraps, checks or shards a model: the wrapper is an instance of the
model's class; FSDP2's fully_shard on ORTModule-wrapped blocks (and on a model holding them) and
ZeroRedundancyOptimizer with DistributedDataParallel train in step with the same runs without
ORTModule (2 gloo processes); what cannot work is refused by name."""
import pickle
from copy import deepcopy

import pytest
import torch
import torch.nn as nn

from ort_trainer.ortmodule import ORTModule

from . import ortmodule_fsdp_worker as worker


@pytest.fixture(autouse=True)
def no_fallback(monkeypatch):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Every scenario of the worker, run once on 2 processes: {(scenario, run): result} per rank."""
    directory = tmp_path_factory.mktemp("fsdp")
    for rank, (returncode, stderr) in enumerate(worker.launch(directory)):
        assert returncode == 0, f"rank {rank} exited with {returncode}:\n{stderr[-3000:]}"
    return [torch.load(directory / f"rank{rank}.pt") for rank in range(worker.WORLD_SIZE)]


@pytest.mark.parametrize("scenario", sorted(worker.SCENARIOS))
def test_sharded_training_with_ortmodule_is_in_step_with_the_same_run_without(ranks, scenario):
    for run in ranks:
        eager, ort = run[(scenario, "eager")], run[(scenario, "ort")]
        assert ort["graphs"] == {"fsdp_nested": 2}.get(scenario, 1)  # one per ORTModule, compiled once
        for step, (loss, want) in enumerate(zip(ort["losses"], eager["losses"], strict=True)):
            assert abs(loss - want) <= 1e-5 * abs(want), (step, loss, want)
        assert ort["weights"].keys() == eager["weights"].keys()
        for name, want in eager["weights"].items():
            got = ort["weights"][name]
            assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5, name


def test_fully_shard_that_frees_the_parameters_after_the_forward_is_refused_by_name(ranks):
    for run in ranks:
        assert run["refusal"].startswith("fully_shard(ORTModule(Block)) with reshard_after_forward (True by default "
                                         "below the root)")
        assert "Pass reshard_after_forward=False to fully_shard on the ORTModule" in run["refusal"]


def test_parameters_whose_memory_moves_before_the_backward_are_refused_not_read_freed():
    wrapped = ORTModule(nn.Linear(4, 3))
    output = wrapped(torch.randn(2, 4, requires_grad=True))
    wrapped.weight.data = wrapped.weight.data.clone()  # what FSDP's free and gather again do to its memory
    with pytest.raises(RuntimeError, match=r"the memory of \['weight'\] moved between the forward and the backward"):
        output.sum().backward()


# ---------------------------------------------------------------- the wrapper is an instance of the model's class

class Scaled(nn.Linear):
    """A model class with a class attribute, a property and a helper whose self(...) runs the graph."""

    kind = "scaled"

    @property
    def fan_in(self):
        return self.in_features

    def twice(self, x):
        return 2 * self(x)


def test_the_wrapper_is_an_instance_of_the_models_class_and_keeps_what_it_promises():
    torch.manual_seed(0)
    model = Scaled(4, 3)
    wrapped = ORTModule(model)
    assert isinstance(wrapped, Scaled) and isinstance(wrapped, nn.Linear) and isinstance(wrapped, ORTModule)
    assert type(wrapped).__name__ == "ORTModule" and type(ORTModule(Scaled(4, 3))) is type(wrapped)
    assert not isinstance(ORTModule(nn.Linear(4, 3)), Scaled)
    assert wrapped.kind == type(wrapped).kind == "scaled" and wrapped.fan_in == 4
    assert list(wrapped.state_dict()) == ["weight", "bias"] and wrapped.weight is model.weight
    x = torch.randn(2, 4)
    torch.testing.assert_close(wrapped.twice(x), model.twice(x))
    assert len(wrapped._graphs) == 1  # the helper's self(x) ran the graph
    for copy in (pickle.loads(pickle.dumps(wrapped)), deepcopy(wrapped)):
        assert isinstance(copy, Scaled) and type(copy) is type(wrapped) and len(copy._graphs) == 0
        torch.testing.assert_close(copy(x), model(x))


def test_a_hugging_face_wrapper_is_a_pretrained_model_whose_library_methods_act_on_the_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50,
                                                                 n_positions=16))
    wrapped = ORTModule(model)
    assert isinstance(wrapped, transformers.GPT2LMHeadModel) and isinstance(wrapped, transformers.PreTrainedModel)
    assert wrapped.save_pretrained.__self__ is model and wrapped.generate.__self__ is model
    assert type(wrapped).config_class is transformers.GPT2Config and wrapped.device == torch.device("cpu")
    wrapped.save_pretrained(tmp_path)
    assert transformers.GPT2LMHeadModel.from_pretrained(tmp_path).config.n_embd == 16
