"""examples/wikitext2: the torchtext-equivalent data pipeline, loading, download failure, and a short run."""
import json
from pathlib import Path

import pytest
import torch

from examples.wikitext2 import data as wt2
from examples.wikitext2.model import TransformerModel
from examples.wikitext2.train import main

SHARED_TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2" / "valid.txt"


@pytest.mark.parametrize("line, tokens", [
    ("You can now install TorchText using pip!", ["you", "can", "now", "install", "torchtext", "using", "pip", "!"]),
    ("Hello, World. (Yes?)", ["hello", ",", "world", ".", "(", "yes", "?", ")"]),
    ("don't say \"no\"", ["don", "'", "t", "say", "no"]),                  # ' split off, " dropped
    ("a;b:c", ["a", "b", "c"]),                                             # ; and : are dropped
    ("one<br />two<BR />three", ["one", "two", "three"]),                   # lower() runs first
    ("3 @.@ 5 @,@ 000\t<unk>  \n", ["3", "@", ".", "@", "5", "@", ",", "@", "000", "<unk>"]),
    ("   ", []),
])
def test_basic_english_tokenizer(line, tokens):
    assert wt2.tokenize(line) == tokens


def test_tokenize_lines_appends_eos_per_line():
    assert wt2.tokenize_lines(["A b\n", " \n", "c.\n"]) == ["a", "b", "<eos>", "<eos>", "c", ".", "<eos>"]


def test_vocab_order_unk_and_numericalize():
    tokens = wt2.tokenize_lines(["b a c a\n", "c a <unk> d\n"])
    vocab = wt2.Vocab(tokens)
    # specials first (in Field order), then by descending frequency, ties alphabetical;
    # <unk>/<eos> occurrences in the text do not add entries
    assert vocab.itos == ["<unk>", "<pad>", "<sos>", "<eos>", "a", "c", "b", "d"]
    assert len(vocab) == 8 and vocab["c"] == 5
    assert vocab["never-seen"] == 0 and vocab["<unk>"] == 0
    # TEXT.numericalize([text]): ids only, no <sos>; the <eos> are the per-line ones
    ids = vocab.numericalize(wt2.tokenize_lines(["A zebra\n", "b\n"]))
    assert ids.dtype == torch.long and ids.tolist() == [4, 0, 3, 6, 3]


def test_batchify_and_get_batch():
    source = wt2.batchify(torch.arange(23), 4)        # 23 // 4 = 5 rows, 3 elements trimmed
    assert source.shape == (5, 4)
    assert source[:, 1].tolist() == [5, 6, 7, 8, 9]   # each column is a contiguous chunk
    assert source[0].tolist() == [0, 5, 10, 15]

    data, target = wt2.get_batch(source, 0, bptt=3)
    assert data.shape == (3, 4) and target.shape == (12,)
    assert torch.equal(target, source[1:4].reshape(-1))              # shifted by one row
    data, target = wt2.get_batch(source, 3, bptt=3)                   # short last batch
    assert data.tolist() == [source[3].tolist()] and target.tolist() == source[4].tolist()
    assert list(range(0, source.size(0) - 1, 3)) == [0, 3]            # the loop's batch starts


def _write(path, lines):
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")


@pytest.mark.parametrize("layout", ["wiki.{}.tokens", "{}.txt"])
def test_load_directory_layouts(tmp_path, layout):
    for split, text in [("train", "the cat sat"), ("valid", "the dog"), ("test", "a cat")]:
        _write(tmp_path / layout.format(split), [text])
    corpus = wt2.load_corpus(tmp_path)
    assert corpus.vocab.itos[4:] == ["cat", "sat", "the"]
    assert corpus.train.tolist() == [6, 4, 5, 3]
    assert corpus.valid.tolist() == [6, 0, 3] and corpus.test.tolist() == [0, 4, 3]


def test_load_single_file_splits_90_5_5(tmp_path):
    _write(tmp_path / "corpus.txt", [f"line{i}" for i in range(100)])
    splits = wt2.load_splits(tmp_path / "corpus.txt")
    assert [len(splits[s]) for s in wt2.SPLITS] == [90, 5, 5]
    assert splits["valid"][0] == "line90\n" and splits["test"][-1] == "line99\n"
    corpus = wt2.load_corpus(tmp_path / "corpus.txt")
    assert len(corpus.vocab) == 4 + 90 and corpus.valid.tolist() == [0, 3] * 5


def test_load_errors(tmp_path):
    with pytest.raises(wt2.DataError, match="without the WikiText-2 files"):
        wt2.load_splits(tmp_path)
    with pytest.raises(wt2.DataError, match="no such file"):
        wt2.load_splits(tmp_path / "missing")


def test_download_failure_explains_what_to_do(tmp_path):
    with pytest.raises(wt2.DataError) as info:
        wt2.download_wikitext2(tmp_path, url="http://127.0.0.1:9/wikitext-2-v1.zip", timeout=2)
    message = str(info.value)
    assert "Could not download" in message and "--data" in message and "wikitext-2-v1.zip" in message


def test_model_shapes_and_seeded_init():
    torch.manual_seed(0)
    a = TransformerModel(50, dropout=0.0)
    torch.manual_seed(0)
    b = TransformerModel(50, dropout=0.0)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    out = a(torch.randint(0, 50, (7, 3)))
    assert out.shape == (7, 3, 50) and a.src_mask.shape == (7, 7) and a.src_mask[0, 1] == float("-inf")


@pytest.fixture
def text_slice(tmp_path):
    """The first 400 lines of the shared WikiText-2 text (vocabulary ~4k, a few seconds per run)."""
    if not SHARED_TEXT.is_file():
        pytest.skip("shared WikiText-2 text not available")
    with open(SHARED_TEXT, encoding="utf-8") as f:
        _write(tmp_path / "slice.txt", [next(f).rstrip("\n") for _ in range(400)])
    return tmp_path / "slice.txt"


def _short_run(data, *extra):
    return ["--data", str(data), "--epochs", "1", "--max-batches", "3", "--log-interval", "1",
            "--dropout", "0", "--quiet", *extra]


def test_train_torch_end_to_end(text_slice, tmp_path, capsys):
    argv = _short_run(text_slice, "--engine", "torch", "--checkpoint-dir", str(tmp_path / "ckpt"))
    metrics = main(argv + ["--json", str(tmp_path / "m.json")])
    assert metrics["train_batches"] == 3 and len(metrics["epochs"]) == 1
    assert metrics == json.loads((tmp_path / "m.json").read_text())
    assert 0 < metrics["test_loss"] < 10 and metrics["epochs"][0]["valid_ppl"] > 1
    assert "| End of training | test loss" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["epoch0001.meta.pt", "epoch0001.torch"]
    assert len(metrics["train_losses"]) == 3 == len(metrics["train_ms"])
    # a folder written when the engine was called "pytorch" resumes too
    old = tmp_path / "old"
    old.mkdir()
    (tmp_path / "ckpt" / "epoch0001.torch").rename(old / "epoch0001.pytorch")
    torch.save({**torch.load(tmp_path / "ckpt" / "epoch0001.meta.pt"), "engine": "pytorch"}, old / "epoch0001.meta.pt")

    resumed = main(argv[:-1] + [str(old), "--epochs", "2"])
    assert "resumed from" in capsys.readouterr().out
    assert [e["epoch"] for e in resumed["epochs"]] == [1, 2]
    assert resumed["epochs"][0] == metrics["epochs"][0]
    assert resumed["train_losses"][:3] == metrics["train_losses"] and len(resumed["train_losses"]) == 6


def test_cli_without_data_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no such file or directory"):
        main(["--data", str(tmp_path / "nowhere")])
