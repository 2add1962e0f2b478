"""Text -> GPT-2 training blocks, as Hugging Face's ``run_clm.py`` prepares them.

``run_clm.py`` tokenizes the text line by line (line breaks kept), concatenates all the ids and
cuts them into blocks of ``block_size`` tokens, dropping the remainder; the labels are the
input ids themselves (GPT-2 shifts them inside its own loss). No padding. ``BlockDataset``
serves the blocks to ``transformers.Trainer`` as run_clm's examples (with an all-ones attention mask).

Offline, the tokenizer is a byte-level BPE (GPT-2's scheme: ``Ġ`` marks a leading space)
trained with the ``tokenizers`` library on the training text, wrapped as a
``GPT2TokenizerFast`` so that ``save_pretrained`` / ``AutoTokenizer.from_pretrained`` work on it.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2TokenizerFast

END_OF_TEXT = "<|endoftext|>"   # GPT-2's only special token: bos, eos and unk at once
IGNORE_INDEX = -100              # a label the loss skips (torch's cross_entropy default)


class DataError(ValueError):
    """The text cannot make the requested blocks; the message names the flag to change."""


def read_lines(path: str | os.PathLike) -> list[str]:
    """The lines of a UTF-8 text file, line breaks kept (run_clm's ``keep_linebreaks=True``)."""
    with open(path, encoding="utf-8") as f:
        return f.readlines()


def train_tokenizer(lines: list[str], vocab_size: int) -> GPT2TokenizerFast:
    """A byte-level BPE tokenizer of at most ``vocab_size`` tokens, trained on ``lines``.

    What ``tokenizers.ByteLevelBPETokenizer`` builds (all 256 bytes in the alphabet, so no text
    is ever unknown), assembled from the public building blocks so it can be wrapped directly.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(lines, trainer)
    return GPT2TokenizerFast(tokenizer_object=tokenizer, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT,
                             unk_token=END_OF_TEXT)


def tokenize(tokenizer, lines: list[str]) -> list[int]:
    """The ids of every line, concatenated (run_clm's ``tokenize_function`` + ``group_texts``)."""
    # verbose=False: a line longer than the tokenizer's model_max_length is fine here (it is
    # cut into blocks afterwards); transformers would otherwise warn about it.
    ids = tokenizer(lines, verbose=False)["input_ids"]
    return [token for line in ids for token in line]


def group_blocks(ids: list[int], block_size: int) -> torch.Tensor:
    """(n_blocks, block_size) int64 blocks of consecutive ids; the remainder is dropped."""
    n_blocks = len(ids) // block_size
    return torch.tensor(ids[:n_blocks * block_size], dtype=torch.long).view(n_blocks, block_size)


class Blocks(NamedTuple):
    train: torch.Tensor   # (n_train, block_size) int64
    eval: torch.Tensor    # (n_eval, block_size) int64


def load_blocks(tokenizer, train_lines: list[str], eval_lines: list[str] | None, block_size: int,
                eval_fraction: float = 0.1) -> Blocks:
    """Train and eval blocks; without ``eval_lines`` the last ``eval_fraction`` of the training
    blocks (at least one) are held out for evaluation."""
    train = group_blocks(tokenize(tokenizer, train_lines), block_size)
    if eval_lines is not None:
        evaluation = group_blocks(tokenize(tokenizer, eval_lines), block_size)
        if len(evaluation) == 0:
            raise DataError(f"--eval-file has fewer than --block-size {block_size} tokens: no eval block")
    else:
        n_eval = max(1, round(len(train) * eval_fraction))
        train, evaluation = train[:len(train) - n_eval], train[len(train) - n_eval:]
    if len(train) == 0:
        raise DataError(f"--train-file has too few tokens for one training block of --block-size {block_size}")
    return Blocks(train, evaluation)


class BlockDataset(torch.utils.data.Dataset):
    """Blocks as ``transformers.Trainer`` examples: ``{"input_ids", "attention_mask", "labels"}``
    per block, the keys of ``run_clm.py``'s examples (Trainer keeps the columns the model's
    forward() names). The mask is all ones (no padding): eager GPT-2 drops it, an ORTModule graph
    builds and applies it, at no measurable cost on the default model (interleaved updates: 359
    against 363 ms median).

    The labels are the input ids with the first one set to -100. GPT-2 never predicts the first
    token (it shifts the labels), so the loss is unchanged; but Trainer divides the summed loss by
    the number of labels that are not -100 (``num_items_in_batch``), which is then the number of
    predicted tokens: its loss is the mean per predicted token, as the other engines report it,
    instead of (block_size - 1) / block_size of it."""

    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks.cpu()   # Trainer's DataLoader pins memory: CPU tensors; Trainer moves batches

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, index):
        ids = self.blocks[index]
        labels = ids.clone()
        labels[0] = IGNORE_INDEX
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
