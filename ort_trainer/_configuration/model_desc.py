"""Model description: names, shapes and dtypes of the graph's inputs and outputs (``schemas/model_desc.yaml``)."""
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .validation import validate


class InputDescription(NamedTuple):
    """One model input. ``shape``: ints (static sizes) and strs (named symbolic dims); () is a scalar.
    ``dtype`` None means: taken from the first batch."""

    name: str
    shape: tuple[int | str, ...]
    dtype: torch.dtype | None = None


class OutputDescription(NamedTuple):
    """One model output; exactly one output of a model description is the loss."""

    name: str
    shape: tuple[int | str, ...]
    is_loss: bool = False


@dataclass(frozen=True)
class ModelDescription:
    inputs: tuple[InputDescription, ...]
    outputs: tuple[OutputDescription, ...]

    @property
    def loss_index(self) -> int:
        """Position of the loss among the outputs."""
        return next(index for index, output in enumerate(self.outputs) if output.is_loss)

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(entry.name for entry in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(entry.name for entry in self.outputs)


def parse_model_desc(desc: dict) -> ModelDescription:
    """Validate the legacy model description and freeze it.

    Args:
        desc: ``{'inputs': [(name, shape) | (name, shape, dtype)],
            'outputs': [(name, shape) | (name, shape, is_loss)]}``; tuples or lists. ``shape``: a list of
            ints >= 1 and non-empty strs (named dims). ``dtype``: a torch.dtype or its name ('float32',
            'int64', ...). Exactly one output has ``is_loss=True``.

    Raises:
        TypeError: ``desc`` is not a dict.
        ValueError: ``"Invalid model_desc: <path>: <problem>; ..."`` naming every bad field.
    """
    document = validate("model_desc", desc, "Invalid model_desc")
    return ModelDescription(
        inputs=tuple(InputDescription(e["name"], tuple(e["shape"]), e["dtype"]) for e in document["inputs"]),
        outputs=tuple(OutputDescription(e["name"], tuple(e["shape"]), e["is_loss"]) for e in document["outputs"]),
    )
