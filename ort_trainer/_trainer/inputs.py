"""The caller's inputs to train_step/eval_step, checked against model_desc before anything runs."""
import numpy as np
import torch


class InputChecks:
    """Checks one call's inputs: names, count, None only where the binding may leave an input out,
    tensor type, device, dtype (model_desc's, else the first batch's) and shapes (int dims fixed,
    named dims equal wherever the name appears)."""

    def __init__(self, desc, binding, device):
        self._desc = desc
        self._binding = binding
        self._device = device
        self._first_dtypes = {}

    def remember_dtypes(self, values):
        """The first compiled batch fixes the dtypes of inputs model_desc gives none for."""
        self._first_dtypes = {name: value.dtype for name, value in values.items() if value is not None}

    def check(self, method, args, kwargs):
        """Returns ({name: contiguous tensor or None}, signature); raises naming the input.

        None means "not passed"; which inputs are None is part of the signature.
        """
        desc = self._desc
        if len(args) == 1 and isinstance(args[0], (list, tuple)) and len(desc.inputs) > 1:
            args = tuple(args[0])
        expected = list(desc.input_names)
        unknown = sorted(set(kwargs) - set(expected))
        if unknown:
            raise TypeError(f"{method}() got unexpected keyword inputs {unknown}; model_desc inputs are {expected}")
        given = dict(zip(expected, args))
        twice = sorted(set(given) & set(kwargs))
        if twice:
            raise TypeError(f"{method}() got inputs {twice} both by position and by keyword")
        given.update(kwargs)
        if len(args) > len(expected) or len(given) != len(expected):
            raise TypeError(f"{method}() expects {len(expected)} inputs {expected}, "
                            f"got {len(args) + len(kwargs)}")
        values, named_dims = {}, {}
        for spec in desc.inputs:
            value = given[spec.name]
            self._binding.check_value(method, spec.name, value)
            if value is None:
                values[spec.name] = None
                continue
            tensor = self._as_tensor(method, spec.name, value)
            expected_dtype = spec.dtype or self._first_dtypes.get(spec.name)
            if expected_dtype and tensor.dtype != expected_dtype:
                origin = "model_desc" if spec.dtype else "the first batch"
                raise TypeError(f"{method}(): input {spec.name!r} has dtype {tensor.dtype}, "
                                f"expected {expected_dtype} (from {origin})")
            _check_shape(method, spec, tuple(tensor.shape), named_dims)
            values[spec.name] = tensor.contiguous()
        signature = tuple(None if t is None else (tuple(t.shape), t.dtype) for t in values.values())
        return values, signature

    def _as_tensor(self, method, name, value):
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(value)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{method}(): input {name!r} must be a torch.Tensor or numpy.ndarray, "
                            f"got {type(value).__name__}")
        if value.device != self._device:
            raise ValueError(f"{method}(): input {name!r} is on {value.device}, but the trainer runs on "
                             f"{self._device} (options.device.id)")
        return value


def _check_shape(method, spec, shape, named_dims):
    if len(shape) != len(spec.shape):
        raise ValueError(f"{method}(): input {spec.name!r} has shape {list(shape)}, expected rank "
                         f"{len(spec.shape)} {list(spec.shape)}")
    if 0 in shape:
        raise ValueError(f"{method}(): input {spec.name!r} has shape {list(shape)}: an empty batch (a dimension of "
                         "size 0) has no memory ONNX Runtime can bind; skip empty batches")
    for axis, (actual, wanted) in enumerate(zip(shape, spec.shape)):
        if isinstance(wanted, str):
            seen = named_dims.setdefault(wanted, (actual, spec.name))
            if seen[0] != actual:
                raise ValueError(f"{method}(): dim {wanted!r} is {seen[0]} in input {seen[1]!r} but {actual} "
                                 f"in input {spec.name!r} (axis {axis})")
        elif actual != wanted:
            raise ValueError(f"{method}(): input {spec.name!r} has shape {list(shape)}, but axis {axis} must be "
                             f"{wanted} (model_desc {list(spec.shape)})")
