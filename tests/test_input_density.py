"""ORTMODULE_PRINT_INPUT_DENSITY=1: ORTModule logs, per call input that is a loss's labels with an
ignore_index or an embedding's indices with a padding_idx, how many positions hold data, on a
signature's first call and every INTERVAL calls after. ORTMODULE_PRINT_MEMORY_STATS=1: each graph's
largest tensors and its first forward's and backward's peak memory."""
import logging
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ort_trainer.ortmodule import ORTModule
from ort_trainer.ortmodule import _density


class Tagger(nn.Module):
    """Embedding with padding_idx 0, a projection, and its loss with ignore_index -100 on labels
    shifted by one position (as Hugging Face's causal LM loss: a Slice, then a Reshape)."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(20, 8, padding_idx=0), nn.Linear(8, 20)

    def forward(self, input_ids, labels):
        logits = self.head(self.embed(input_ids))
        return F.cross_entropy(logits[:, :-1].reshape(-1, 20), labels[:, 1:].reshape(-1), ignore_index=-100)


def _batch():
    input_ids = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 10, 11, 0]])
    labels = torch.where(input_ids == 0, torch.tensor(-100), input_ids)
    labels[:, :2] = -100  # a masked prompt
    return input_ids, labels


def _records(caplog):
    return [record.getMessage() for record in caplog.records if "input density" in record.getMessage()]


def test_the_density_of_labels_and_padded_inputs_is_logged_on_a_signatures_first_call_and_every_interval(
        monkeypatch, caplog):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    monkeypatch.setenv("ORTMODULE_PRINT_INPUT_DENSITY", "1")
    monkeypatch.setattr(_density, "INTERVAL", 3)
    model = ORTModule(Tagger())
    input_ids, labels = _batch()
    with caplog.at_level(logging.INFO, logger="ort_trainer.ortmodule"):
        for _ in range(4):
            model(input_ids, labels).backward()
    records = _records(caplog)
    assert len(records) == 2  # calls 1 and 4
    # input_ids: 7 of 10 tokens not padding; labels: 3 of 10 neither padding nor prompt
    assert records[0] == ("ORTModule input density, call 1 of this signature: input_ids 7 of 10 positions hold data "
                          "(70.0%, padding_idx 0); labels 3 of 10 positions hold data (30.0%, ignore_index -100); "
                          "the cross-entropy reading labels stayed dense (fewer than 1024 classes, or its scores are "
                          "not a projection's that only the loss reads, or are returned under autocast); embedding "
                          "embed.weight (indices input_ids, padding_idx 0) stayed dense: MatMul (fewer values to remake "
                          "before it)")
    assert records[1].startswith("ORTModule input density, call 4 of this signature: ")


def test_no_report_unless_asked_and_models_without_such_inputs_say_so(monkeypatch, caplog):
    input_ids, labels = _batch()
    with caplog.at_level(logging.INFO, logger="ort_trainer.ortmodule"):
        ORTModule(Tagger())(input_ids, labels).backward()
    assert _records(caplog) == []
    monkeypatch.setenv("ORTMODULE_PRINT_INPUT_DENSITY", "1")
    with caplog.at_level(logging.INFO, logger="ort_trainer.ortmodule"):
        ORTModule(nn.Linear(4, 2))(torch.randn(3, 4)).sum().backward()
    assert _records(caplog) == ["ORTModule input density, call 1 of this signature: no input is a loss's labels with "
                                "an ignore_index or an embedding's indices with a padding_idx"]


def test_a_bad_value_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("ORTMODULE_PRINT_INPUT_DENSITY", "yes")
    with pytest.raises(ValueError, match=re.escape("ORTMODULE_PRINT_INPUT_DENSITY='yes' must be 0 or 1")):
        ORTModule(nn.Linear(4, 2))


def test_memory_stats_log_each_graphs_largest_tensors_and_first_peaks(monkeypatch, caplog):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    monkeypatch.setenv("ORTMODULE_PRINT_MEMORY_STATS", "1")
    model = ORTModule(nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 8)))
    x = torch.randn(256, 64)
    with caplog.at_level(logging.INFO, logger="ort_trainer.ortmodule"):
        for _ in range(2):
            model(x).sum().backward()
        with torch.no_grad():
            model(x)
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("ORTModule memory")]
    assert len(lines) == 3  # training: first forward, first backward; inference: first forward
    forward, backward, inference = lines
    assert re.fullmatch(r"ORTModule memory, the training graph of Sequential: its first forward's peak [+-]\d+\.\d MiB; "
                        r"its largest tensors: .+ \[256, 512\] float 0\.5 MiB, .+", forward), forward
    assert re.fullmatch(r"ORTModule memory, the training graph of Sequential: its first backward's peak [+-]\d+\.\d "
                        r"MiB", backward), backward
    assert inference.startswith("ORTModule memory, the inference graph of Sequential: its first forward's peak ")
