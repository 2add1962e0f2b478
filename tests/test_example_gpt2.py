"""The GPT-2 example (examples/gpt2): data, schedule, both engines in step, outputs that reload."""
import json
import math

import pytest
import torch
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

from examples.gpt2.data import END_OF_TEXT, load_blocks, read_lines, tokenize, train_tokenizer
from examples.gpt2.train import linear_warmup_factor, main, no_decay_parameter_names
from ort_trainer import optim

from . import models

LINES = 300
TINY = ["--block-size", "32", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--vocab-size", "500",
        "--per-device-train-batch-size", "4", "--quiet"]


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return models.shared_text_slice(tmp_path_factory, LINES)


def test_blocks_are_the_concatenated_ids_and_the_last_tenth_is_held_out():
    lines = [" = Valkyria Chronicles = \n", " \n", " The game began development in 2010 , carrying over a large "
             "portion of the work done on Valkyria Chronicles II .\n"] * 20
    tokenizer = train_tokenizer(lines, vocab_size=300)
    ids = tokenize(tokenizer, lines)
    assert tokenizer.decode(ids) == "".join(lines)        # byte-level: nothing lost, line breaks kept
    blocks = load_blocks(tokenizer, lines, None, block_size=16, eval_fraction=0.1)
    n_blocks = len(ids) // 16
    assert blocks.eval.shape == (round(n_blocks * 0.1), 16)
    assert blocks.train.shape == (n_blocks - len(blocks.eval), 16)
    assert blocks.train.dtype == torch.long
    assert torch.cat([blocks.train, blocks.eval]).flatten().tolist() == ids[:n_blocks * 16]   # remainder dropped
    separate = load_blocks(tokenizer, lines, lines[:9], block_size=16)
    assert separate.train.flatten().tolist() == ids[:n_blocks * 16]
    assert separate.eval.flatten().tolist() == tokenize(tokenizer, lines[:9])[:len(separate.eval) * 16]


def test_labels_equal_to_input_ids_train_next_token_prediction():
    """The engines pass labels=input_ids: GPT-2 shifts them itself, so the loss is next-token CE."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=8, n_embd=16, n_layer=1, n_head=2)).eval()
    ids = torch.randint(0, 50, (3, 8))
    output = model(input_ids=ids, labels=ids)
    expected = torch.nn.functional.cross_entropy(output.logits[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(output.loss, expected)


def test_tokenizer_is_deterministic_and_reloads(text, tmp_path):
    lines = read_lines(text)
    tokenizer = train_tokenizer(lines, vocab_size=500)
    assert len(tokenizer) == 500 and tokenizer.eos_token == END_OF_TEXT
    assert train_tokenizer(lines, vocab_size=500).get_vocab() == tokenizer.get_vocab()
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenize(reloaded, lines[:50]) == tokenize(tokenizer, lines[:50])


def test_no_decay_on_biases_and_layer_norms_only():
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=8, n_embd=16, n_layer=1, n_head=2))
    assert sorted(no_decay_parameter_names(model)) == sorted([
        "transformer.h.0.ln_1.weight", "transformer.h.0.ln_1.bias", "transformer.h.0.attn.c_attn.bias",
        "transformer.h.0.attn.c_proj.bias", "transformer.h.0.ln_2.weight", "transformer.h.0.ln_2.bias",
        "transformer.h.0.mlp.c_fc.bias", "transformer.h.0.mlp.c_proj.bias", "transformer.ln_f.weight",
        "transformer.ln_f.bias"])


@pytest.mark.parametrize("total, warmup", [(10, 0), (10, 3), (30, 10), (7, 6), (1000, 37)])
def test_torch_schedule_gives_ort_schedule_lr_for_every_update(total, warmup):
    ort = optim.LinearWarmupLRScheduler(total, warmup=warmup / total)
    for update in range(1, total + 1):
        expected = ort.factor(update, 1.0)
        assert linear_warmup_factor(update, total, warmup) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_smoke_both_engines_write_metrics_and_checkpoints_that_load(text, tmp_path):
    """The CI smoke: a few updates per engine (dropout on), then every output reloads; the saved
    torch model folder trains again through the real from_pretrained() code (offline)."""
    for engine in ("torch", "ort"):
        out = tmp_path / engine
        returned = main(["--engine", engine, "--train-file", str(text), "--max-steps", "3",
                         "--output-dir", str(out)] + TINY)
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["engine"] == engine and metrics["updates"] == 3 == len(metrics["update_losses"])
        assert metrics["eval"] == returned["eval"] and math.isfinite(metrics["eval"]["ppl"])
        assert metrics["wall_time_s"] >= metrics["train_time_s"] > 0

        saved = GPT2LMHeadModel.from_pretrained(out / "model")   # save_pretrained of the trained weights
        checkpoint = torch.load(out / f"checkpoint.{engine}.pt", weights_only=True)
        plain = GPT2LMHeadModel(GPT2Config.from_pretrained(out / "model"))
        plain.load_state_dict(checkpoint["model"])
        for name, tensor in saved.state_dict().items():
            torch.testing.assert_close(plain.state_dict()[name], tensor, rtol=0, atol=0)
        assert checkpoint["optimizer"]   # model and optimizer, for both engines

    again = main(["--engine", "ort", "--train-file", str(text), "--max-steps", "2", "--block-size", "32",
                  "--model_name_or_path", str(tmp_path / "torch" / "model"), "--quiet"])
    assert again["config"]["vocab_size"] == 500 and math.isfinite(again["eval"]["loss"])


def test_engines_agree_per_update_with_dropout_off(text, monkeypatch):
    """Accumulation 2, warmup, weight decay and clipping on: the same math in both engines."""
    norms = []
    clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_",
                        lambda params, max_norm: norms.append(clip(params, max_norm)))
    common = ["--train-file", str(text), "--dropout", "0", "--max-steps", "10", "--gradient-accumulation-steps", "2",
              "--warmup-steps", "3", "--weight-decay", "0.01", "--max-grad-norm", "1.0"] + TINY
    reference = main(common + ["--engine", "torch"])
    ours = main(common + ["--engine", "ort"])
    assert min(norms) > 1.0, norms   # clipping changed every update
    assert len(ours["update_losses"]) == 10
    for update, (a, b) in enumerate(zip(ours["update_losses"], reference["update_losses"])):
        assert a == pytest.approx(b, rel=1e-4), update
    assert ours["learning_rates"] == pytest.approx(reference["learning_rates"], rel=1e-12)
    assert ours["eval"]["loss"] == pytest.approx(reference["eval"]["loss"], rel=1e-4)


@pytest.mark.filterwarnings("ignore:mixed_precision.dtype='float16' on device 'cpu'")
def test_mixed_precision_engines_agree_per_update(text):
    """--mixed-precision: ORTTrainer in fp16 against the PyTorch loop under autocast + GradScaler
    (clipping after unscale_); both round at the products, not at every same op: 5e-4."""
    common = ["--train-file", str(text), "--dropout", "0", "--max-steps", "4", "--mixed-precision"] + TINY
    reference = main(common + ["--engine", "torch"])
    ours = main(common + ["--engine", "ort"])
    for update, (a, b) in enumerate(zip(ours["update_losses"], reference["update_losses"])):
        assert a == pytest.approx(b, rel=5e-4), update


def test_mixed_precision_is_refused_for_the_hf_trainer_engines(capsys):
    with pytest.raises(SystemExit):
        main(["--engine", "hf-trainer", "--mixed-precision"])
    assert "--mixed-precision applies to --engine ort and torch; transformers.Trainer has its own" in \
        capsys.readouterr().err
