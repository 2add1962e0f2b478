"""transformers.Trainer with default arguments on ORTModule(GPT2LMHeadModel): the same steps as on
the plain model, one graph per input signature (not per step), no fallback to PyTorch; and the GPT-2
example's Trainer engines (examples/gpt2, --engine hf-trainer / hf-trainer-torch) end to end."""
import copy
import functools
import inspect
import json
import logging
import math
import warnings

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.utils import find_labels

from examples.gpt2.data import BlockDataset
from examples.gpt2.train import main, no_decay_parameter_names
from ort_trainer.ortmodule import DebugOptions, LogLevel, ORTModule

from . import models

pytest.importorskip("accelerate", reason="transformers.Trainer's PyTorch backend")

VOCAB, BLOCK = 128, 16
TINY = ["--block-size", "32", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--vocab-size", "500",
        "--per-device-train-batch-size", "4", "--dropout", "0", "--quiet"]


@pytest.fixture(autouse=True)
def no_fallback(monkeypatch):
    """A signature that would run in PyTorch fails the test instead (read when an ORTModule is made)."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="ORTModule: ")
        yield


def tiny_gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=BLOCK, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


class IndexedBlocks(BlockDataset):
    """The example's examples plus a column no forward() parameter names: Trainer drops it
    (remove_unused_columns=True) and keeps the ones forward() names."""

    def __getitem__(self, index):
        return {**super().__getitem__(index), "block_index": index}


def run_trainer(model, output_dir, blocks):
    """Trainer's defaults, but for the run's size, a log line per update and no checkpoints."""
    args = TrainingArguments(output_dir=str(output_dir), report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
                             per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=5,
                             learning_rate=3e-3, weight_decay=0.01, warmup_steps=2, max_grad_norm=0.5, logging_steps=1,
                             save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=IndexedBlocks(blocks[:40]),
                      eval_dataset=IndexedBlocks(blocks[40:]))
    trainer.train()
    metrics = trainer.evaluate()
    return trainer, [log for log in trainer.state.log_history if "loss" in log], metrics


def test_trainer_steps_on_ortmodule_match_the_plain_model(tmp_path, caplog):
    """5 updates of 2 micro-batches each (Trainer's num_items_in_batch, warmup, weight decay,
    clipping), then evaluation. Tolerances: ORTModule's fp32 forward and backward agree with torch's
    to ~1e-6 relative (its other tests); AdamW's first steps move each weight by about lr (its
    update m/sqrt(v) is ~±1 whatever the gradient's size), so a gradient that differs in the 7th
    digit can move a weight by much more where m/sqrt(v) is near a sign change: measured 1.4e-6
    absolute at most after these 5 updates (grad norms: 7e-8 relative); 1e-5 leaves room across
    BLAS builds, while a wrong gradient (a dropped micro-batch, a loss scaled by the accumulation)
    moves weights by ~lr = 3e-3.
    Trainer logs the loss rounded to 4 decimals: equal up to that rounding."""
    blocks = torch.randint(0, VOCAB, (48, BLOCK), generator=torch.Generator().manual_seed(1))
    plain = tiny_gpt2()
    reference, initial = copy.deepcopy(plain), copy.deepcopy(plain.state_dict())
    wrapped = ORTModule(plain, DebugOptions(log_level=LogLevel.INFO))
    seen = []
    wrapped.register_forward_pre_hook(lambda module, args, kwargs: seen.append((sorted(kwargs), args)),
                                      with_kwargs=True)
    with caplog.at_level(logging.INFO, logger="ort_trainer.ortmodule"):
        trainer, logs, metrics = run_trainer(wrapped, tmp_path / "ort", blocks)
    compiles = [record.getMessage() for record in caplog.records if "compiled the" in record.getMessage()]
    expected_trainer, expected_logs, expected_metrics = run_trainer(reference, tmp_path / "torch", blocks)

    # Default remove_unused_columns=True kept what forward() names, dropped the rest; Trainer passes
    # num_items_in_batch (a 0-d tensor, so an input of the graph, not a constant compiled per value).
    assert seen and all(args == () for _, args in seen)
    assert {tuple(keys) for keys, _ in seen} == {("attention_mask", "input_ids", "labels", "num_items_in_batch")}
    assert trainer.label_names == ["labels"] == expected_trainer.label_names   # so evaluation has a loss
    # One training graph and one evaluation graph (no_grad) for 10 micro-batches and the evaluation.
    assert len(wrapped._graphs) == 2 and len(compiles) == 2, compiles

    assert len(logs) == len(expected_logs) == 5
    for ours, theirs in zip(logs, expected_logs):
        assert ours["loss"] == pytest.approx(theirs["loss"], abs=1.01e-4), (ours, theirs)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5), (ours, theirs)
        assert ours["learning_rate"] == theirs["learning_rate"]
    assert min(log["grad_norm"] for log in logs) > 0.5   # clipping at max_grad_norm=0.5 acted on every update
    assert metrics["eval_loss"] == pytest.approx(expected_metrics["eval_loss"], rel=1e-5)
    expected_weights = reference.state_dict()
    for name, tensor in wrapped.state_dict().items():
        torch.testing.assert_close(tensor, expected_weights[name], rtol=0, atol=1e-5, msg=name)
        assert not torch.equal(tensor, initial[name]), name   # trained
    # Trainer's AdamW groups: no decay on biases and LayerNorm weights, as the example's engines.
    no_decay = {id(p) for group in trainer.optimizer.param_groups if group["weight_decay"] == 0 for p in group["params"]}
    assert {name for name, p in wrapped.named_parameters() if id(p) in no_decay} == set(no_decay_parameter_names(plain))


def test_trainer_sees_the_model_signature_through_the_wrapper():
    """What Trainer reads before training: the instance's forward() (the dataset columns it keeps),
    the class's forward() (label names, so that evaluate() reports eval_loss), and a forward that
    accelerate's mixed precision sets on the wrapper stays the wrapper's (set on the model, the
    model's forward would call the wrapper again, endlessly)."""
    plain = tiny_gpt2()
    wrapped = ORTModule(plain)
    assert inspect.signature(wrapped.forward) == inspect.signature(plain.forward)
    assert find_labels(type(wrapped)) == ["labels"] and isinstance(wrapped, ORTModule)
    assert type(ORTModule(tiny_gpt2())) is type(wrapped) and type(wrapped).__name__ == "ORTModule"
    assert type(copy.deepcopy(wrapped)) is type(wrapped)   # pickled by the model's class

    calls = []
    inner = wrapped.forward

    @functools.wraps(inner)
    def autocast_like(*args, **kwargs):
        calls.append(kwargs)
        return inner(*args, **kwargs)

    wrapped.forward = autocast_like
    assert "forward" not in vars(plain) and wrapped.forward is autocast_like
    ids = torch.randint(0, VOCAB, (2, BLOCK), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(wrapped(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    assert len(calls) == 1


def test_trainer_defaults_save_checkpoints_of_tied_weights_that_reload_into_the_plain_model(tmp_path):
    """Trainer saves a PreTrainedModel with save_pretrained (GPT-2's lm_head/wte written once, as
    safetensors requires) and anything else as its bare state_dict, which safetensors refuses for
    tied weights ("Some tensors share memory"); accelerate does not unwrap an ORTModule. The
    wrapper's class is the model's, so Trainer sees a PreTrainedModel: the checkpoint is the plain
    model's (config.json, model.safetensors) and reloads into it with the trained weights."""
    blocks = torch.randint(0, VOCAB, (8, BLOCK), generator=torch.Generator().manual_seed(1))
    plain = tiny_gpt2()
    wrapped = ORTModule(plain)
    assert plain.lm_head.weight is plain.transformer.wte.weight
    assert isinstance(wrapped, GPT2LMHeadModel) and type(wrapped).__name__ == "ORTModule"
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
                             per_device_train_batch_size=4, max_steps=2, save_steps=2)
    assert args.save_safetensors
    Trainer(model=wrapped, args=args, train_dataset=BlockDataset(blocks)).train()

    checkpoint = tmp_path / "checkpoint-2"
    assert {"config.json", "model.safetensors"} <= {path.name for path in checkpoint.iterdir()}
    reloaded = GPT2LMHeadModel.from_pretrained(checkpoint)
    assert reloaded.lm_head.weight is reloaded.transformer.wte.weight
    trained = wrapped.state_dict()
    assert list(reloaded.state_dict()) == list(trained)
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    # Trainer resumes an ORTModule from it (the untrained model, no step left to run).
    resumed = ORTModule(tiny_gpt2())
    assert not torch.equal(resumed.transformer.wte.weight, trained["transformer.wte.weight"])
    Trainer(model=resumed, args=args, train_dataset=BlockDataset(blocks)).train(resume_from_checkpoint=str(checkpoint))
    assert resumed.lm_head.weight is resumed.transformer.wte.weight
    for name, tensor in resumed.state_dict().items():
        assert torch.equal(tensor, trained[name]), name


def test_block_dataset_makes_trainer_loss_the_mean_per_predicted_token():
    """Trainer divides GPT-2's summed loss by num_items_in_batch, the labels that are not -100:
    with the first label of each block -100 (never predicted: GPT-2 shifts the labels) that is the
    plain mean cross-entropy the other engines report, not (block - 1) / block of it."""
    model = tiny_gpt2().eval()
    blocks = torch.randint(0, VOCAB, (3, BLOCK), generator=torch.Generator().manual_seed(3))
    batch = {key: torch.stack([example[key] for example in BlockDataset(blocks)]) for key in BlockDataset(blocks)[0]}
    assert sorted(batch) == ["attention_mask", "input_ids", "labels"] and torch.equal(batch["input_ids"], blocks)
    with torch.no_grad():
        trainer_loss = model(**batch, num_items_in_batch=(batch["labels"] != -100).sum()).loss
        torch.testing.assert_close(trainer_loss, model(input_ids=blocks, labels=blocks).loss)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return models.shared_text_slice(tmp_path_factory, 300)


def test_example_hf_trainer_engines_agree_and_write_outputs_that_reload(text, tmp_path):
    """`python -m examples.gpt2 --engine hf-trainer` against `--engine hf-trainer-torch`: same
    updates (dropout off), same evaluation; model/ reloads as the plain GPT-2 class, the
    checkpoint's weights load into the plain model."""
    common = ["--train-file", str(text), "--max-steps", "4", "--warmup-steps", "1", "--fetch-logits",
              "--eval-each-epoch"] + TINY
    reference = main(common + ["--engine", "hf-trainer-torch"])
    ours = main(common + ["--engine", "hf-trainer", "--output-dir", str(tmp_path)])

    assert ours["updates"] == reference["updates"] == 4 == len(ours["update_losses"]) == len(ours["update_seconds"])
    assert ours["update_losses"] == pytest.approx(reference["update_losses"], abs=1.01e-4)
    assert ours["learning_rates"] == reference["learning_rates"] and ours["learning_rates"][0] == 0.0   # HF warmup
    assert ours["eval"]["loss"] == pytest.approx(reference["eval"]["loss"], rel=1e-5)
    assert ours["eval"]["ppl"] == pytest.approx(math.exp(ours["eval"]["loss"]))
    assert ours["eval"]["accuracy"] == pytest.approx(reference["eval"]["accuracy"], abs=1e-3)
    # --eval-each-epoch: Trainer's evaluation at the end of the (short) epoch, the same weights as the final one.
    assert [(epoch["epoch"], epoch["updates"]) for epoch in ours["epochs"]] == [(1, 4)]
    assert ours["epochs"][0]["loss"] == pytest.approx(ours["eval"]["loss"], rel=1e-6)

    assert json.loads((tmp_path / "metrics.json").read_text())["engine"] == "hf-trainer"
    saved = GPT2LMHeadModel.from_pretrained(tmp_path / "model")
    assert saved.config.architectures == ["GPT2LMHeadModel"]
    checkpoint = torch.load(tmp_path / "checkpoint.hf-trainer.pt", weights_only=True)
    assert checkpoint["optimizer"]["state"] and checkpoint["global_step"] == 4
    plain = GPT2LMHeadModel(saved.config)
    plain.load_state_dict(checkpoint["model"])
    for name, tensor in saved.state_dict().items():
        torch.testing.assert_close(plain.state_dict()[name], tensor, rtol=0, atol=0)


@pytest.mark.parametrize("flags", [["--lora"], ["--gradient-checkpointing"], ["--lora", "--gradient-checkpointing"]])
def test_example_hf_trainer_with_lora_or_checkpointing_trains_in_step_with_the_plain_model(text, tmp_path, monkeypatch,
                                                                                           flags):
    """`--lora` (PEFT adapters) and `--gradient-checkpointing` (Trainer's reentrant default), alone
    and together: the ORTModule run in step with the same Trainer run on the plain model, in ONNX
    Runtime (fallback disabled); with --lora, model/ holds the adapter."""
    common = ["--train-file", str(text), "--max-steps", "4", "--warmup-steps", "1", *flags] + TINY
    reference = main(common + ["--engine", "hf-trainer-torch"])
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    ours = main(common + ["--engine", "hf-trainer", "--output-dir", str(tmp_path)])
    assert ours["updates"] == reference["updates"] == 4
    assert ours["update_losses"] == pytest.approx(reference["update_losses"], abs=1.01e-4)
    assert ours["eval"]["loss"] == pytest.approx(reference["eval"]["loss"], rel=1e-5)
    assert (tmp_path / "model" / "adapter_config.json").is_file() == ("--lora" in flags)
