"""WikiText-2 data pipeline, a torchtext-free port of what the notebook gets from torchtext 0.6-0.8.

The notebook builds its data with the legacy torchtext API:

    TEXT = torchtext.data.Field(tokenize=get_tokenizer("basic_english"),
                                init_token='<sos>', eos_token='<eos>', lower=True)
    train_txt, val_txt, test_txt = torchtext.datasets.WikiText2.splits(TEXT)
    TEXT.build_vocab(train_txt)
    data = TEXT.numericalize([train_txt.examples[0].text])

which means, reproduced here:
- ``tokenize``: torchtext's ``_basic_english_normalize`` (lowercase, a fixed list of regex
  substitutions, whitespace split).
- ``LanguageModelingDataset`` reads a split as ONE example: the tokens of every line, each line
  followed by ``<eos>`` (``newline_eos=True``).  See ``tokenize_lines``.
- ``Field.build_vocab`` -> ``Vocab``: specials ``<unk>, <pad>, <sos>, <eos>`` first, then the
  training tokens by descending frequency, ties in alphabetical order.
- ``Field.numericalize`` maps tokens to ids and nothing else: ``init_token``/``eos_token`` are
  added by ``Field.pad``, which the notebook never calls, so ``<sos>`` never occurs in the data
  and the only ``<eos>`` are the per-line ones.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import urllib.request
import zipfile
from collections import Counter
from pathlib import Path
from typing import Iterable, NamedTuple

import torch

WIKITEXT2_URL = "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-2-v1.zip"
DEFAULT_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ort_trainer"
SPLITS = ("train", "valid", "test")
SPLIT_LAYOUTS = ("wiki.{}.tokens", "{}.txt")   # official archive; plain-named copies
UNK, PAD, SOS, EOS = "<unk>", "<pad>", "<sos>", "<eos>"

# torchtext/data/utils.py: _patterns / _replacements, applied in this order after lower().
# Note that ';' and ':' are dropped (replaced by a space), not split off like ',' or '!'.
_BASIC_ENGLISH = [(re.compile(p), r) for p, r in [
    (r"\'", " '  "), (r"\"", ""), (r"\.", " . "), (r"<br \/>", " "), (r",", " , "),
    (r"\(", " ( "), (r"\)", " ) "), (r"\!", " ! "), (r"\?", " ? "), (r"\;", " "),
    (r"\:", " "), (r"\s+", " "),
]]


class DataError(RuntimeError):
    """The data could not be found, read or downloaded; the message says what to do."""


def tokenize(line: str) -> list[str]:
    """torchtext ``get_tokenizer("basic_english")``."""
    line = line.lower()
    for pattern, replacement in _BASIC_ENGLISH:
        line = pattern.sub(replacement, line)
    return line.split()


def tokenize_lines(lines: Iterable[str]) -> list[str]:
    """One split as torchtext's ``LanguageModelingDataset`` reads it: every line's tokens + ``<eos>``."""
    tokens = []
    for line in lines:
        tokens += tokenize(line.rstrip("\n"))
        tokens.append(EOS)
    return tokens


class Vocab:
    """torchtext's legacy ``Vocab`` as ``Field.build_vocab`` makes it (min_freq 1, no max size)."""

    specials = (UNK, PAD, SOS, EOS)

    def __init__(self, tokens: Iterable[str]):
        counter = Counter(tokens)
        for special in self.specials:
            del counter[special]
        ordered = sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))
        self.itos = list(self.specials) + [token for token, _ in ordered]
        self.stoi = {token: i for i, token in enumerate(self.itos)}

    def __len__(self) -> int:
        return len(self.itos)

    def __getitem__(self, token: str) -> int:
        return self.stoi.get(token, 0)   # unknown words map to <unk> (index 0)

    def numericalize(self, tokens: Iterable[str]) -> torch.Tensor:
        """``TEXT.numericalize([tokens])`` as a 1-D LongTensor (torchtext returns shape (N, 1))."""
        return torch.tensor([self[token] for token in tokens], dtype=torch.long)


def batchify(data: torch.Tensor, bsz: int) -> torch.Tensor:
    """The notebook's ``batchify`` on already numericalized data: (N,) -> (N // bsz, bsz)."""
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)          # trim what does not fit evenly
    return data.view(bsz, -1).t().contiguous()     # column j is the j-th contiguous chunk


def get_batch(source: torch.Tensor, i: int, bptt: int = 35) -> tuple[torch.Tensor, torch.Tensor]:
    """The notebook's ``get_batch``: rows i..i+seq_len as input, the next rows flattened as target."""
    seq_len = min(bptt, len(source) - 1 - i)
    data = source[i:i + seq_len]
    target = source[i + 1:i + 1 + seq_len].view(-1)
    return data, target


def read_lines(path: Path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return f.readlines()


def split_lines(lines: list[str], train: float = 0.9, valid: float = 0.05) -> dict[str, list[str]]:
    """Split one text into consecutive train/valid/test parts by lines (default 90/5/5)."""
    a, b = int(len(lines) * train), int(len(lines) * (train + valid))
    return dict(zip(SPLITS, (lines[:a], lines[a:b], lines[b:])))


def load_splits(path: str | os.PathLike) -> dict[str, list[str]]:
    """The lines of each split: ``path`` is a WikiText-2 directory or one text file (split 90/5/5)."""
    path = Path(path)
    if path.is_file():
        parts = split_lines(read_lines(path))
        if not all(parts.values()):
            raise DataError(f"{path} has too few lines to split into train/valid/test (90/5/5)")
        return parts
    if path.is_dir():
        for layout in SPLIT_LAYOUTS:
            files = [path / layout.format(split) for split in SPLITS]
            if all(f.is_file() for f in files):
                return {split: read_lines(f) for split, f in zip(SPLITS, files)}
        wanted = " or ".join(", ".join(layout.format(s) for s in SPLITS) for layout in SPLIT_LAYOUTS)
        raise DataError(f"{path} is a directory without the WikiText-2 files ({wanted})")
    raise DataError(f"--data {path}: no such file or directory")


class Corpus(NamedTuple):
    vocab: Vocab
    train: torch.Tensor   # 1-D LongTensors of token ids
    valid: torch.Tensor
    test: torch.Tensor


def load_corpus(path: str | os.PathLike) -> Corpus:
    """Tokenize the splits, build the vocabulary on train, numericalize every split."""
    tokens = {split: tokenize_lines(lines) for split, lines in load_splits(path).items()}
    vocab = Vocab(tokens["train"])
    return Corpus(vocab, *(vocab.numericalize(tokens[split]) for split in SPLITS))


def download_wikitext2(cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR, url: str = WIKITEXT2_URL,
                       timeout: float = 30.0) -> Path:
    """Fetch and unpack the official archive once; returns the directory with ``wiki.*.tokens``."""
    target = Path(cache_dir) / "wikitext-2"
    if all((target / f"wiki.{split}.tokens").is_file() for split in SPLITS):
        return target
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, \
                tempfile.TemporaryFile(dir=cache_dir) as archive:
            shutil.copyfileobj(response, archive)
            with zipfile.ZipFile(archive) as zf:
                zf.extractall(cache_dir)   # the archive holds wikitext-2/wiki.{train,valid,test}.tokens
    except (OSError, zipfile.BadZipFile) as exc:   # URLError and timeouts are OSErrors
        raise DataError(
            f"Could not download WikiText-2 from {url}: {exc}\n"
            f"Download wikitext-2-v1.zip (from that address or a mirror) on a machine with network "
            f"access, unzip it and pass its folder with --data /path/to/wikitext-2 (the one holding "
            f"wiki.train.tokens), or pass any text file with --data FILE (split 90/5/5 by lines)."
        ) from exc
    if not (target / "wiki.train.tokens").is_file():
        raise DataError(f"{url} did not contain wikitext-2/wiki.train.tokens; pass --data instead")
    return target
