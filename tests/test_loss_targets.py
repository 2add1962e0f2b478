"""Loss targets checked before a run where ONNX Runtime's kernel reads them unchecked (CUDA's
SoftmaxCrossEntropyLoss): which inputs are targets, and the same error as the CPU path's."""
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from ort_trainer import ORTTrainer, optim
from ort_trainer._graph.loss_targets import check_targets, loss_targets
from ort_trainer._runtime import trainer_sessions

from . import models


def _cpu_paths_error(labels):
    """The message of the CPU path's refusal (its rewritten loss's), once compiled (the first step runs torch)."""
    trainer = ORTTrainer(models.mlp(), models.MLP_DESC, optim.AdamConfig(lr=0.01), loss_fn=models.mlp_loss)
    x, good = models.mlp_batch(0)
    trainer.train_step(x, good)
    with pytest.raises(IndexError) as raised:
        trainer.train_step(x, labels)
    return str(raised.value)


@pytest.mark.parametrize("target", [-3, 5], ids=["negative", "classes"])
def test_an_unchecked_kernels_targets_get_the_cpu_paths_error(target):
    """The check runs the CUDA path's rule on CPU tensors: same refusal, same message."""
    _, labels = models.mlp_batch(0)
    labels[3] = target
    with pytest.raises(IndexError) as raised:
        check_targets({"x": None, "target": labels}, {"target": (5, -100)})
    assert str(raised.value) == _cpu_paths_error(labels)


def test_targets_in_range_or_ignored_pass_and_unknown_classes_check_the_sign():
    labels = torch.tensor([0, 4, -100, 2])
    check_targets({"target": labels}, {"target": (5, -100)})
    check_targets({"target": torch.tensor([0, 70])}, {"target": (None, None)})
    with pytest.raises(IndexError, match=r"targets in \[0, C\), as torch's"):
        check_targets({"target": labels}, {"target": (None, None)})


def _value(name, elem_type, dims):
    return helper.make_tensor_value_info(name, elem_type, dims)


def test_targets_are_read_through_casts_reshapes_and_selections_to_the_graph_input():
    nodes = [helper.make_node("Cast", ["label"], ["label64"], to=TensorProto.INT64),
             helper.make_node("Reshape", ["label64", "flat"], ["flat_label"]),
             helper.make_node("Gather", ["flat_label", "rows"], ["kept"]),
             helper.make_node("SoftmaxCrossEntropyLoss", ["scores", "kept"], ["loss"], ignore_index=-100),
             helper.make_node("NegativeLogLikelihoodLoss", ["log_probs", "other"], ["nll"]),
             helper.make_node("Add", ["other", "one"], ["shifted"]),  # computed from an input: not a target read
             helper.make_node("SoftmaxCrossEntropyLoss", ["scores", "shifted"], ["computed"])]
    graph = helper.make_graph(
        nodes, "g",
        [_value("scores", TensorProto.FLOAT, ["n", 7]), _value("label", TensorProto.INT32, ["b", "s"]),
         _value("rows", TensorProto.INT64, ["n"]), _value("log_probs", TensorProto.FLOAT, ["n", "classes"]),
         _value("other", TensorProto.INT64, ["n"])],
        [_value(name, TensorProto.FLOAT, []) for name in ("loss", "nll", "computed")],
        initializer=[helper.make_tensor("flat", TensorProto.INT64, [1], [-1]),
                     helper.make_tensor("one", TensorProto.INT64, [], [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    assert loss_targets(model) == {"label": (7, -100), "other": (None, None)}


def test_a_device_whose_kernels_read_targets_unchecked_checks_them_before_the_run(monkeypatch):
    """The CPU standing for CUDA: a sum-reduced loss keeps ORT's SoftmaxCrossEntropyLoss, whose
    targets are then checked before anything runs (no step counted, no weight changed)."""
    monkeypatch.setattr(trainer_sessions, "UNCHECKED_DEVICES", frozenset({"cpu"}))
    trainer = ORTTrainer(models.mlp(), models.MLP_DESC, optim.AdamConfig(lr=0.01),
                         loss_fn=lambda out, t: torch.nn.functional.cross_entropy(out, t, reduction="sum"))
    x, labels = models.mlp_batch(0)
    trainer.train_step(x, labels)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    labels[3] = 5
    for method in (trainer.train_step, trainer.eval_step):
        with pytest.raises(IndexError) as raised:
            method(x, labels)
        assert str(raised.value) == _cpu_paths_error(labels)
    assert trainer.train_step_info.step == 1
    assert all(torch.equal(p, before[name]) for name, p in trainer.model.named_parameters())
