"""Where graphs run: the device and, on CUDA, the stream the caller's work and ours are ordered on."""
import contextlib

import numpy as np
import torch

from .cuda_requirements import require_cuda


def torch_device(device_id):
    """The torch device of a device id ('cpu', 'cuda', 'cuda:N'), with its index: 'cuda' is torch's
    current CUDA device, as for tensors made with device='cuda' (tensors on the GPU always report
    an index, and torch.device('cuda') != torch.device('cuda', 0)); cuda:0 where torch has no CUDA."""
    device = torch.device(device_id)
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)


class Placement:
    """A device: its torch device, ONNX Runtime's name and index for it, the array module of its
    buffers (NumPy, or CuPy on CUDA) and, on CUDA, one stream owned by the caller of `step()`.

    On CUDA, ONNX Runtime runs every graph on that stream and the CuPy kernels (clip, optimizer)
    queue behind on it; `step()` orders it after the caller's current stream and the caller's
    stream after it.
    """

    def __init__(self, device_id):
        self.torch_device = torch_device(device_id)
        self.ort_device = self.torch_device.type
        self.index = self.torch_device.index or 0
        self.xp, self.stream = np, None
        if self.ort_device == "cuda":
            self.xp = require_cuda(self.index)
            self.stream = torch.cuda.Stream(self.torch_device)

    def take(self, model):
        """Moves `model`'s parameters and buffers to this device (`model.to`; those already there
        stay as they are): the graphs and the torch-side probe read the model's own tensors, and the
        original ORTTrainer accepted a model on any device (it kept the weights in ONNX Runtime)."""
        model.to(self.torch_device)

    def allocating(self):
        """Context in which new CuPy buffers land on this device (flat buffers, optimizer state, the
        loss scale) and their first values (host copies, fills, copies of the model's tensors) are
        queued on the placement's stream, ordered as a step is (`step`): after the caller's work
        that wrote the model's tensors, and before the caller's next work."""
        return self.step()

    @contextlib.contextmanager
    def _on_stream(self):
        """Torch's and CuPy's current stream set to the placement's, on its device."""
        with torch.cuda.stream(self.stream), self.xp.cuda.Device(self.index), \
                self.xp.cuda.ExternalStream(self.stream.cuda_stream, self.index):
            yield

    @contextlib.contextmanager
    def step(self):
        """Context of one step's device work (graph, all-reduce, clip, update) on the placement's
        stream, ordered after the caller's current stream (its inputs are ready) and before it
        (its next work, the outputs' `.item()`, sees the results), also when the step raises.
        Nothing to do on the CPU."""
        if self.stream is None:
            yield
            return
        caller = torch.cuda.current_stream(self.torch_device)
        self.stream.wait_stream(caller)
        try:
            with self._on_stream():
                yield
        finally:  # work queued before an error too: the caller's next work must not overtake it
            caller.wait_stream(self.stream)

    def returned(self, outputs):
        """The step's outputs, handed to the caller's stream: allocated on the placement's stream,
        their memory is not reused before the caller's work queued on them is done."""
        if self.stream is not None:
            caller = torch.cuda.current_stream(self.torch_device)
            for tensor in outputs:
                tensor.record_stream(caller)
        return outputs
