"""Hugging Face models export with a padded attention_mask under `_hf_compat.export_patches`,
with the same mask values and training numerics as eager torch."""
import inspect
import io
import subprocess
import sys
import warnings

import numpy as np
import onnxruntime
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import masking_utils  # noqa: E402

from ort_trainer import ORTTrainer, ORTTrainerOptions, optim
from ort_trainer._export import hf_compat as _hf_compat  # noqa: E402

VOCAB = 100
DESC = {"inputs": [("input_ids", ["b", "s"]), ("attention_mask", ["b", "s"]), ("labels", ["b", "s"])],
        "outputs": [("loss", [], True), ("logits", ["b", "s", VOCAB])]}


class Wrap(torch.nn.Module):
    """(loss, logits) of a causal LM fed keyword inputs, as the trainer's export traces it."""

    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, input_ids, attention_mask, labels):
        out = self.m(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=False)
        return out.loss, out.logits


def gpt2(attn_implementation="sdpa"):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     attn_implementation=attn_implementation)
    return transformers.GPT2LMHeadModel(config)


def padded_batch(step, batch=3, seq=10, left_padding=True):
    """Right padding of a different length per step in row 0, left padding in row 1."""
    generator = torch.Generator().manual_seed(step)
    input_ids = torch.randint(0, VOCAB, (batch, seq), generator=generator)
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    attention_mask[0, seq - 1 - step % 3:] = 0
    if left_padding:
        attention_mask[1, :2] = 0
    return input_ids, attention_mask, input_ids.clone()


def export_to_bytes(module, args, input_names, output_names):
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, buffer, dynamo=False, training=torch.onnx.TrainingMode.PRESERVE,
                          do_constant_folding=False, opset_version=14, input_names=input_names,
                          output_names=output_names,
                          dynamic_axes={name: {0: "b", 1: "s"} for name in input_names})
    return buffer.getvalue()


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_gpt2_with_padding_exports_and_matches_torch_at_another_shape(attn_implementation):
    model = Wrap(gpt2(attn_implementation)).eval()
    names = ["input_ids", "attention_mask", "labels"]
    with _hf_compat.export_patches(model):
        onnx_bytes = export_to_bytes(model, padded_batch(0), names, ["loss", "logits"])

    session = onnxruntime.InferenceSession(onnx_bytes, providers=["CPUExecutionProvider"])
    batch = padded_batch(1, batch=2, seq=13)
    loss, logits = session.run(None, {name: t.numpy() for name, t in zip(names, batch)})
    with torch.no_grad():
        expected_loss, expected_logits = model(*batch)
    np.testing.assert_allclose(loss, expected_loss.numpy(), rtol=1e-5)
    np.testing.assert_allclose(logits, expected_logits.numpy(), rtol=1e-4, atol=1e-5)


def _create_causal_mask(kind, config, inputs_embeds, attention_mask):
    """transformers' mask for `kind`, called with the arguments of the installed version."""
    create = (masking_utils.create_sliding_window_causal_mask if kind == "sliding"
              else masking_utils.create_causal_mask)
    parameters = inspect.signature(create).parameters
    kwargs = {"config": config, "attention_mask": attention_mask, "past_key_values": None}
    kwargs["inputs_embeds" if "inputs_embeds" in parameters else "input_embeds"] = inputs_embeds
    if "cache_position" in parameters:
        kwargs["cache_position"] = torch.arange(inputs_embeds.shape[1])
    if kind == "or_block":  # tokens flagged in inputs_embeds[..., 0] see each other, like Gemma 3's image tokens
        block = inputs_embeds[..., 0] > 0
        kwargs["or_mask_function"] = (lambda batch_idx, head_idx, q_idx, kv_idx:
                                      block[batch_idx, q_idx] & block[batch_idx, kv_idx])
    return create(**kwargs)


def block_embeds(batch, seq):
    """Embeddings whose first channel flags a block of tokens per row (row r: tokens r+1 .. r+3)."""
    embeds = torch.zeros(batch, seq, 4)
    for row in range(batch):
        embeds[row, row + 1:row + 4, 0] = 1.0
    return embeds


class MaskOnly(torch.nn.Module):
    def __init__(self, kind, config):
        super().__init__()
        self.kind, self.config = kind, config

    def forward(self, inputs_embeds, attention_mask):
        return _create_causal_mask(self.kind, self.config, inputs_embeds, attention_mask)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["causal", "sliding", "or_block"])
def test_exported_mask_equals_eager_mask(kind, attn_implementation):
    """The exported mask, run at another shape and padding, is bit-identical to transformers' own."""
    config = transformers.PretrainedConfig()
    config._attn_implementation = attn_implementation
    config.sliding_window = 4
    module = MaskOnly(kind, config)
    _, attention_mask, _ = padded_batch(0)
    with _hf_compat.export_patches(gpt2()):  # MaskOnly holds no transformers module: GPT-2 stands in
        onnx_bytes = export_to_bytes(module, (block_embeds(3, 10), attention_mask),
                                     ["inputs_embeds", "attention_mask"], ["mask"])

    _, attention_mask, _ = padded_batch(2, batch=2, seq=13)
    inputs_embeds = block_embeds(2, 13)
    session = onnxruntime.InferenceSession(onnx_bytes, providers=["CPUExecutionProvider"])
    (exported,) = session.run(None, {"inputs_embeds": inputs_embeds.numpy(),
                                     "attention_mask": attention_mask.numpy()})
    expected = module(inputs_embeds, attention_mask)
    assert exported.shape == tuple(expected.shape)
    np.testing.assert_array_equal(exported, expected.numpy())


@pytest.mark.parametrize("attn_implementation, left_padding", [
    ("sdpa", False), ("eager", True), ("sdpa", True)])
def test_gpt2_with_padding_trains_like_torch(attn_implementation, left_padding):
    steps = 10
    batches = [padded_batch(step, left_padding=left_padding) for step in range(steps - 3)]
    batches += [padded_batch(step, batch=2, seq=13, left_padding=left_padding) for step in range(steps - 3, steps)]
    reference = Wrap(gpt2(attn_implementation))
    torch_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-3, foreach=False)
    expected = []
    for batch in batches:
        loss = reference(*batch)[0]
        torch_optimizer.zero_grad()
        loss.backward()
        torch_optimizer.step()
        expected.append(loss.item())

    # AdamConfig's default lambda_coef=0.0: plain Adam.
    trainer = ORTTrainer(Wrap(gpt2(attn_implementation)), DESC, optim.AdamConfig(lr=1e-3), loss_fn=None,
                         options=ORTTrainerOptions({"utils": {"grad_norm_clip": False}}))
    losses = [trainer.train_step(*batch)[0].item() for batch in batches]
    np.testing.assert_allclose(losses, expected, rtol=1e-4)


def _patchable():
    names = [*_hf_compat._EXPANSIONS, "TransformGetItemToIndex"]
    return {name: getattr(masking_utils, name) for name in names if hasattr(masking_utils, name)}


def test_patches_are_restored_on_exit_and_on_exception():
    originals = _patchable()
    model = gpt2()
    with _hf_compat.export_patches(model):
        assert _patchable() != originals
    assert _patchable() == originals

    with pytest.raises(ValueError, match="inside"):
        with _hf_compat.export_patches(model):
            raise ValueError("inside")
    assert _patchable() == originals


def test_other_models_are_left_alone():
    originals = _patchable()
    with _hf_compat.export_patches(torch.nn.Linear(2, 2)):
        assert _patchable() == originals


def test_does_not_import_transformers():
    code = ("import sys, torch\n"
            "from ort_trainer._export.hf_compat import export_patches\n"
            "with export_patches(torch.nn.Linear(2, 2)):\n"
            "    pass\n"
            "assert 'transformers' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)
