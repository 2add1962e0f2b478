"""The torch nodes' large CPU buffers (`_runtime.cpu_buffers`): reused only when nothing but the
pool holds them, so a tensor ONNX Runtime or the caller still reads is never written again."""
import torch

from ort_trainer._runtime import cpu_buffers

LARGE = (1024, 1024)  # 4 MiB in fp32: pooled


def test_a_large_buffer_is_reused_once_released_and_never_while_held():
    first = cpu_buffers.empty(LARGE, torch.float32)
    address = first.data_ptr()
    held = cpu_buffers.empty(LARGE, torch.float32)
    assert held.data_ptr() != address  # `first` is still held
    view = first.reshape(-1)[:10]
    del first
    assert cpu_buffers.empty(LARGE, torch.float32).data_ptr() not in (address, held.data_ptr())  # a view holds it
    del view
    again = cpu_buffers.empty(LARGE, torch.float32)
    assert again.data_ptr() == address
    capsule = torch.utils.dlpack.to_dlpack(again)  # handed to ONNX Runtime
    del again
    assert cpu_buffers.empty(LARGE, torch.float32).data_ptr() != address
    del capsule
    assert cpu_buffers.empty(LARGE, torch.float32).data_ptr() == address


def test_small_tensors_and_conversions():
    small = cpu_buffers.empty((10, 10), torch.float32)
    assert small.shape == (10, 10) and small.dtype == torch.float32
    x = torch.randn(LARGE)
    assert cpu_buffers.converted(x, torch.float32) is x
    converted = cpu_buffers.converted(x, torch.bfloat16)
    assert converted.dtype == torch.bfloat16 and torch.equal(converted, x.bfloat16())
