"""Hugging Face models passed as they are (keyword inputs, their own loss from `labels`, padded
attention masks) train in step with eager PyTorch. Tiny configs, random init: nothing from a hub."""
import copy

import pytest
import torch

from ort_trainer import ORTTrainer, ORTTrainerOptions, optim

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ, STEPS = 96, 3, 10, 10
LAYERS = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, vocab_size=VOCAB)


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))


def _bert():
    return transformers.BertForSequenceClassification(transformers.BertConfig(num_labels=3, **LAYERS))


def _roberta():
    return transformers.RobertaForMaskedLM(transformers.RobertaConfig(max_position_embeddings=40, **LAYERS))


def _distilbert():
    return transformers.DistilBertForMaskedLM(transformers.DistilBertConfig(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64, dropout=0.0, attention_dropout=0.0))


def _t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, dropout_rate=0.0,
        decoder_start_token_id=0))


def _bart():
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, max_position_embeddings=32))


FAMILIES = {"gpt2": _gpt2, "bert": _bert, "roberta": _roberta, "distilbert": _distilbert, "t5": _t5, "bart": _bart}


def _batch(family, step, masked):
    generator = torch.Generator().manual_seed(300 + step)
    input_ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)
    batch = {"input_ids": input_ids}
    if masked:
        mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
        mask[0, -3:] = 0  # padding at the end of the first row
        batch["attention_mask"] = mask
    batch["labels"] = (torch.randint(0, 3, (BATCH,), generator=generator) if family == "bert"
                       else torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator))
    return batch


def _desc(family, masked):
    inputs = [("input_ids", ["batch", "seq"])] + ([("attention_mask", ["batch", "seq"])] if masked else [])
    inputs.append(("labels", ["batch"] if family == "bert" else ["batch", "seq"]))
    logits = ["batch", 3] if family == "bert" else ["batch", "seq", VOCAB]
    return {"inputs": inputs, "outputs": [("loss", [], True), ("logits", logits)]}


def _train_in_step(family, masked):
    torch.manual_seed(0)
    model = FAMILIES[family]()
    model.train()
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, _desc(family, masked), optim.AdamConfig(lr=1e-3),
                         options=ORTTrainerOptions({"utils": {"grad_norm_clip": False}}))
    adam = torch.optim.Adam(reference.parameters(), lr=1e-3)
    for step in range(STEPS):
        batch = _batch(family, step, masked)
        loss, logits = trainer.train_step(**batch)
        adam.zero_grad()
        expected = reference(**batch)
        expected.loss.backward()
        adam.step()
        assert loss.item() == pytest.approx(expected.loss.item(), rel=1e-4), f"{family} step {step}"
        torch.testing.assert_close(logits, expected.logits.detach(), rtol=1e-3, atol=1e-4)
    return trainer


@pytest.mark.parametrize("family", ["gpt2", "bert", "roberta", "distilbert", "t5", "bart"])
def test_family_with_attention_mask_trains_like_torch(family):
    _train_in_step(family, masked=True)


def test_gpt2_without_a_mask_trains_like_torch():
    _train_in_step("gpt2", masked=False)


def test_only_the_loss_declared_leaves_logits_and_caches_out():
    torch.manual_seed(0)
    model = _gpt2()
    desc = {"inputs": [("input_ids", ["batch", "seq"]), ("labels", ["batch", "seq"])],
            "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(model, desc, optim.AdamConfig(lr=1e-3))
    batch = _batch("gpt2", 0, masked=False)
    with torch.no_grad():
        expected = model(**batch).loss
    assert trainer.eval_step(**batch).item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_padding_tokens_train_like_torch(family):
    """BERT's embeddings have a padding_idx (no gradient for that row from the lookup); GPT-2's
    padding is the mask alone. Real pad tokens in the batch, as a tokenizer pads."""
    torch.manual_seed(0)
    model = FAMILIES[family]()
    model.config.pad_token_id = 0
    model.train()
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, _desc(family, True), optim.SGDConfig(lr=0.5),
                         options=ORTTrainerOptions({"utils": {"grad_norm_clip": False}}))
    sgd = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(5):
        batch = _batch(family, step, masked=True)
        batch["input_ids"][0, -3:] = 0  # pad where the mask is 0
        loss, _ = trainer.train_step(**batch)
        sgd.zero_grad()
        expected = reference(**batch).loss
        expected.backward()
        sgd.step()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-4), f"{family} step {step}"
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-5, msg=name)


def test_a_first_batch_of_one_row_does_not_break_other_batch_sizes():
    """Traced at batch 1, the symbolic export bakes that size in where ORT then rejects the
    re-derived graph at batch 2 (an index out of bounds): that graph is traced again."""
    torch.manual_seed(0)
    model = _gpt2()
    model.train()
    reference = copy.deepcopy(model)
    desc = {"inputs": [("input_ids", ["batch", "seq"]), ("labels", ["batch", "seq"])], "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(model, desc, optim.SGDConfig(lr=0.5),
                         options=ORTTrainerOptions({"utils": {"grad_norm_clip": False}}))
    sgd = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step, rows in enumerate([1, 2, 3, 1]):
        input_ids = torch.randint(3, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(step))
        loss = trainer.train_step(input_ids=input_ids, labels=input_ids)
        sgd.zero_grad()
        expected = reference(input_ids=input_ids, labels=input_ids).loss
        expected.backward()
        sgd.step()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-4), f"step {step}"


def test_layerdrop_is_refused_by_name_and_runs_in_pytorch_under_ortmodule():
    """LayerDrop draws in Python which layers to skip: one trace would skip the same ones on every step."""
    from ort_trainer import ORTModule
    torch.manual_seed(0)
    model = _bart()
    model.model.encoder.layerdrop = 0.5  # as BartConfig(encoder_layerdrop=0.5) builds it
    model.train()
    trainer = ORTTrainer(model, _desc("bart", False), optim.AdamConfig(lr=1e-3))
    with pytest.raises(NotImplementedError, match=(
            r"the model trains with LayerDrop \(model.encoder.layerdrop=0.5\), which draws in Python on every call "
            r"which layers to skip: .* Set those layerdrop attributes to 0.0 to train it in ONNX Runtime")):
        trainer.train_step(**_batch("bart", 0, False))
    assert trainer.train_step_info.step == 0
    wrapped = ORTModule(copy.deepcopy(model))
    with pytest.warns(UserWarning, match="runs in PyTorch .* LayerDrop"):
        wrapped(**_batch("bart", 0, False)).loss.backward()
    model.model.encoder.layerdrop = 0.0
    trainer.train_step(**_batch("bart", 0, False))


def test_ortmodule_keeps_onnx_runtimes_own_warnings_to_itself_at_the_default_log_level(capfd):
    """ONNX Runtime's builder warns on stderr about the graphs it optimizes ("Removing initializer
    ... It is not used by any node"): not the user's to act on; the original ORTModule held them."""
    from ort_trainer import ORTModule
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    ORTModule(_gpt2())(input_ids=ids, labels=ids).loss.backward()
    assert "onnxruntime" not in capfd.readouterr().err
