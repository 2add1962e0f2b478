"""The torch nodes' large CPU buffers (`_runtime.cpu_buffers`): reused only when nothing but the
pool holds them, so a tensor ONNX Runtime or the caller still reads is never written again."""
import pytest
import torch

from ort_trainer._runtime import cpu_buffers

LARGE = (1024, 1024)  # 4 MiB in fp32: pooled


@pytest.fixture(autouse=True)
def empty_pool(monkeypatch):
    monkeypatch.setattr(cpu_buffers, "_pools", {})


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


def test_a_free_buffer_serves_any_size_it_holds_down_to_two_thirds_of_it():
    """A masked LM's labelled rows differ in count from batch to batch: one buffer serves them."""
    rows = cpu_buffers.empty((1000, 4096), torch.float32)
    address = rows.data_ptr()
    del rows
    fewer = cpu_buffers.empty((700, 4096), torch.float32)
    assert fewer.data_ptr() == address and fewer.shape == (700, 4096) and fewer.is_contiguous()
    del fewer
    assert cpu_buffers.empty((600, 4096), torch.float32).data_ptr() != address  # under 2/3: its own buffer


def test_a_size_just_above_a_free_buffer_replaces_it_with_room_to_grow():
    rows = cpu_buffers.empty((1000, 4096), torch.float32)
    address = rows.data_ptr()
    del rows
    more = cpu_buffers.empty((1100, 4096), torch.float32)
    grown = more.data_ptr()
    assert grown != address
    del more
    assert cpu_buffers.empty((1240, 4096), torch.float32).data_ptr() == grown  # 1.25 x 1,100 rows held
    assert cpu_buffers.empty((1000, 4096), torch.float32).data_ptr() != address  # the outgrown one was let go


def test_the_tightest_free_buffer_is_taken_and_the_pool_is_bounded(monkeypatch):
    monkeypatch.setattr(cpu_buffers, "_KEPT", 2)
    large, small = cpu_buffers.empty((1400, 4096), torch.float32), cpu_buffers.empty((1000, 4096), torch.float32)
    addresses = large.data_ptr(), small.data_ptr()
    del large, small
    assert cpu_buffers.empty((1000, 4096), torch.float32).data_ptr() == addresses[1]
    held = [cpu_buffers.empty((1000 + 10 * k, 4096), torch.float32) for k in range(3)]  # 2 pooled, 1 not
    assert len(cpu_buffers._pools[torch.float32]) == 2 and len({t.data_ptr() for t in held}) == 3


def test_a_graph_output_bound_by_the_caller_is_written_in_place_only_where_it_fits():
    params = {"graph_outputs": ["", "logits"]}
    logits, other = torch.empty(4, 6), torch.empty(2, 3)
    assert cpu_buffers.bound_output(params, 1, (4, 6), torch.float32) is None  # nothing bound outside a run
    with cpu_buffers.bound_outputs({"logits": logits}):
        assert cpu_buffers.bound_output(params, 1, (24,), torch.float32).data_ptr() == logits.data_ptr()
        assert cpu_buffers.output(params, 1, (2, 12), torch.float32).data_ptr() == logits.data_ptr()
        assert cpu_buffers.bound_output(params, 0, (4, 6), torch.float32) is None  # not a graph output
        assert cpu_buffers.bound_output(params, 1, (4, 5), torch.float32) is None  # another size
        assert cpu_buffers.bound_output(params, 1, (4, 6), torch.float64) is None  # another type
        assert cpu_buffers.bound_output(params, 1, (4, 6), torch.float32, [logits[1:2], other]) is None  # read
        assert cpu_buffers.bound_output(params, 1, (4, 6), torch.float32, [other]) is not None
        assert cpu_buffers.output(params, 1, (4, 5), torch.float32).data_ptr() != logits.data_ptr()
    with cpu_buffers.bound_outputs({"logits": logits.t()}):  # not contiguous
        assert cpu_buffers.bound_output(params, 1, (6, 4), torch.float32) is None
