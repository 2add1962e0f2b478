"""Runs one ORTModule graph: a `TrainingAgent` that runs the forward of a call and, when autograd
asks, its backward from the state the forward kept (no recomputation), or an inference session
for calls without gradients. Tensors cross to ONNX Runtime and back through DLPack (no copy)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from onnxruntime.capi import _pybind_state as C
from torch.utils.dlpack import from_dlpack, to_dlpack

from .sessions import Sessions, seed_random_ops
from .torch_ops import FunctionContexts, raising_torch_op_errors


class ModuleRunner:
    """`sessions`: the placement's `Sessions`; `model`: the serialized graph; `forward_outputs`:
    how many outputs its forward has (a training graph); `trains`: a training graph (forward,
    then backward) or the forward alone; `draws_random_numbers`: it has dropout.
    `optimized_model_path`: where ONNX Runtime writes the graph it runs (debugging).
    `priority_order`: run its nodes in PRIORITY_BASED order (recompute copies, `_graph.recompute`)."""

    def __init__(self, sessions: Sessions, model: bytes, input_names: Sequence[str], output_names: Sequence[str],
                 forward_outputs: int, *, trains: bool, draws_random_numbers: bool,
                 optimized_model_path: str | None = None, priority_order: bool = False) -> None:
        self._sessions, self._random = sessions, draws_random_numbers
        self._first_run = sessions.first_run()
        self._session = sessions.create(model, optimized_model_path=optimized_model_path, priority_order=priority_order,
                                        weight_gradients_early=trains)
        placement = sessions.placement
        device = C.OrtDevice(C.OrtDevice.cuda() if placement.ort_device == "cuda" else C.OrtDevice.cpu(),
                             C.OrtDevice.default_memory(), placement.index)
        self._inputs, self._outputs = list(input_names), list(output_names)
        if trains:
            self._agent = C.TrainingAgent(self._session._sess, self._inputs, [device] * forward_outputs,
                                          self._outputs, [device] * len(self._outputs), placement.index)
        else:
            self._devices = [device] * len(self._outputs)

    def infer(self, feeds: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The forward alone (no gradient): the outputs as tensors."""
        placement, fetched = self._sessions.placement, C.OrtValueVector()
        self._first_run.begin()
        self._seed()
        with placement.step(), raising_torch_op_errors():
            self._session._sess.run_with_ortvaluevector(self._sessions.run_options, self._inputs, _ort_values(feeds),
                                                        self._outputs, fetched, self._devices)
        self._first_run.end()
        return placement.returned(_torch_tensors(fetched))

    def run_forward(self, feeds: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], ForwardState]:
        """(outputs, state): the forward of a training call; `state` keeps what its backward reads
        (ONNX Runtime's, and the contexts of the custom autograd.Functions that ran).

        The outputs are the graph's own (no copy): `_graph.module_graph_builder.forward_outputs_as_graph_outputs`
        keeps their memory out of the backward's reuse and out of the memory pattern, so they live
        as long as the caller holds them."""
        placement = self._sessions.placement
        state, fetched = C.PartialGraphExecutionState(), C.OrtValueVector()
        self._first_run.begin()
        self._seed()
        with placement.step(), raising_torch_op_errors() as contexts:
            self._agent.run_forward(_ort_values(feeds), fetched, state, None)
        return placement.returned(_torch_tensors(fetched)), ForwardState(state, contexts)

    def run_backward(self, state: ForwardState, output_grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The backward's gradients, in the graph's order, from the gradients of the forward's
        outputs (`output_grads`: tensors, in output order)."""
        placement, fetched = self._sessions.placement, C.OrtValueVector()
        with placement.step(), raising_torch_op_errors():
            self._agent.run_backward(_ort_values(output_grads), fetched, state.execution)
        self._first_run.end()  # of a training graph: its forward and backward
        return placement.returned(_torch_tensors(fetched))

    def _seed(self):
        if self._random:
            seed_random_ops()


class ForwardState(NamedTuple):
    """What a training call's backward reads: ONNX Runtime's state of the forward, and the custom
    autograd.Function contexts the forward kept (freed with it when no backward comes)."""

    execution: C.PartialGraphExecutionState
    contexts: FunctionContexts


def _ort_values(tensors):
    """An OrtValueVector viewing `tensors` (DLPack: no copy for contiguous tensors)."""
    vector = C.OrtValueVector()
    vector.reserve(len(tensors))
    for tensor in tensors:
        tensor = tensor.detach()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        is_bool = tensor.dtype == torch.bool
        vector.push_back(to_dlpack(tensor.view(torch.uint8) if is_bool else tensor), is_bool)
    return vector


def _torch_tensors(vector):
    """The tensors of an OrtValueVector (DLPack: no copy); bool ones travel as uint8."""
    tensors = vector.to_dlpacks(from_dlpack)
    for index in vector.bool_tensor_indices():
        tensors[index] = tensors[index].view(torch.bool)
    return tensors
