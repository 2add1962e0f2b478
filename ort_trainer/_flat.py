"""The flat parameter and gradient buffers, and the torch parameters that view them."""
import numpy as np
import torch

from ._optimizers import FlatLayout


def as_torch(array):
    """A torch tensor sharing memory with a NumPy (or CuPy, via DLPack) array."""
    if isinstance(array, np.ndarray):
        return torch.from_numpy(array)
    return torch.from_dlpack(array)


class FlatParameters:
    """Trainable parameters packed in one fp32 buffer, ordered by param group; gradients alike.

    After construction every trainable torch parameter *is* a view of the buffer, so the torch
    model always holds the trained weights and nothing is ever copied back.
    """

    def __init__(self, named_parameters, groups, xp=np):
        """named_parameters: {name: torch parameter}; groups: [(names, hyperparameters)]."""
        self.names = [name for names, _ in groups for name in names]
        sizes = [[named_parameters[name].numel() for name in names] for names, _ in groups]
        self.layout = FlatLayout.from_sizes(sizes, [hyper for _, hyper in groups])
        total = int(self.layout.seg_offsets[-1])
        self.params = xp.empty(total, dtype=np.float32)
        self.grads = xp.zeros(total, dtype=np.float32)
        self.shapes = {name: tuple(named_parameters[name].shape) for name in self.names}
        self.offsets = dict(zip(self.names, (int(o) for o in self.layout.seg_offsets[:-1])))
        flat_params = as_torch(self.params)
        for name in self.names:
            parameter = named_parameters[name]
            view = flat_params[self.offsets[name]: self.offsets[name] + parameter.numel()].view(parameter.shape)
            with torch.no_grad():
                view.copy_(parameter.detach())
            parameter.data = view

    def view(self, buffer, name):
        """The part of `buffer` (params, grads, or any array in this layout) holding `name`."""
        start = self.offsets[name]
        return buffer[start: start + int(np.prod(self.shapes[name], dtype=np.int64))].reshape(self.shapes[name])
