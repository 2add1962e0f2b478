"""What the CUDA path checks and chooses before any GPU work, tested where there is no GPU: the
library folders, the errors that name what is missing, the shared CUDA arena's settings, and the
dtypes and RNG it shares with the CPU path."""
import io
import re
import warnings

import onnx
import onnxruntime
import pytest
import torch

from ort_trainer import ORTTrainer, optim
from ort_trainer._graph.autocast import element_types, lower_precision
from ort_trainer._runtime import cuda_requirements as _cuda
from ort_trainer._runtime import session_config as _session_config
from ort_trainer._runtime.cuda_requirements import (CudaUnavailable, nvidia_library, preload_cuda11_libraries,
                                                    require_cuda, require_cuda_provider)
from ort_trainer._runtime.placement import torch_device

from . import models


def _wheel_folder(root, package, *sonames):
    folder = root / "nvidia" / package / "lib"
    folder.mkdir(parents=True)
    for soname in sonames:
        (folder / soname).write_bytes(b"")
    return folder


def test_a_library_comes_from_the_first_nvidia_folder_that_holds_its_cuda11_soname(tmp_path, monkeypatch):
    """cu12/13 wheels (a CUDA torch's) and cu11 wheels (ORT's) share nvidia/<package>/lib."""
    cuda13 = _wheel_folder(tmp_path / "torch-site", "cublas", "libcublas.so.13", "libcublasLt.so.13")
    cuda11 = _wheel_folder(tmp_path / "ort-site", "cublas", "libcublas.so.11", "libcublasLt.so.11")
    monkeypatch.setattr(_cuda, "_nvidia_roots", lambda: [str(cuda13.parents[1]), str(cuda11.parents[1])])
    assert nvidia_library("libcublas.so.11", "cublas") == str(cuda11 / "libcublas.so.11")
    assert nvidia_library("libcufft.so.10", "cufft") is None


def test_every_library_ort_and_cupy_load_by_name_is_preloaded():
    sonames = [soname for soname, _, _ in _cuda.CUDA11_LIBRARIES]
    for needed in ("libcudnn_ops_infer.so.8", "libcudnn_ops_train.so.8", "libnvrtc.so.11.2",
                   "libnvrtc-builtins.so.11.8", "libcudart.so.11.0", "libcudnn.so.8"):
        assert needed in sonames
    # each after what it needs: cuDNN's sub-libraries before libcudnn, NVRTC's builtins before NVRTC
    assert sonames.index("libcudnn_ops_train.so.8") < sonames.index("libcudnn.so.8")
    assert sonames.index("libnvrtc-builtins.so.11.8") < sonames.index("libnvrtc.so.11.2")


def test_a_library_that_cannot_load_names_its_wheel(monkeypatch):
    monkeypatch.setattr(_cuda, "CUDA11_LIBRARIES", (("libnot-there.so.11", "not_there", "nvidia-not-there-cu11"),))
    with pytest.raises(CudaUnavailable, match=re.escape(
            "device.id asks for CUDA, but libnot-there.so.11 cannot be loaded (")) as error:
        preload_cuda11_libraries()
    assert str(error.value).endswith(
        "install the nvidia-not-there-cu11 wheel (pip install -e '.[gpu]' in the ort-trainer checkout)")


def test_cudnn_libraries_opened_only_for_convolutions_may_be_missing(monkeypatch):
    """A trimmed CUDA install (the GPU bundle ships cuDNN's ops libraries alone) trains models without
    convolutions: their libraries' absence is a warning naming them."""
    monkeypatch.setattr(_cuda, "CUDA11_LIBRARIES", (("libcudnn_cnn_infer.so.8", "not_there", "nvidia-cudnn-cu11==8.9.*"),
                                                    ("libcudnn_adv_train.so.8", "not_there", "nvidia-cudnn-cu11==8.9.*")))
    with pytest.warns(RuntimeWarning, match=re.escape(
            "libcudnn_cnn_infer.so.8, libcudnn_adv_train.so.8 cannot be loaded: convolutions and recurrent layers on "
            "CUDA will fail in cuDNN, other models train; install the nvidia-cudnn-cu11==8.9.* wheel (pip install "
            "-e '.[gpu]' in the ort-trainer checkout)")):
        assert preload_cuda11_libraries() == {}


def test_an_ort_build_without_cuda_is_named():
    with pytest.raises(CudaUnavailable, match=re.escape(
            f"device.id asks for CUDA, but the installed ONNX Runtime {onnxruntime.__version__} has no "
            "CUDAExecutionProvider (a CPU build?): pip install -e '.[gpu]' in the ort-trainer checkout")):
        require_cuda(0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch here has a usable GPU")
def test_a_torch_without_cuda_is_named_before_anything_else_fails(monkeypatch):
    monkeypatch.setattr(onnxruntime, "get_available_providers",
                        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    with pytest.raises(CudaUnavailable, match=re.escape(
            f"device.id asks for CUDA, but torch {torch.__version__} cannot use a GPU here (")) as error:
        require_cuda(0)
    assert "torch.cuda.is_available() is False): install a CUDA build of torch" in str(error.value)


def test_a_session_ort_built_for_the_cpu_only_is_refused():
    require_cuda_provider(["CUDAExecutionProvider", "CPUExecutionProvider"])
    with pytest.raises(CudaUnavailable, match=re.escape(
            "device.id asks for CUDA, but ONNX Runtime created the session with ['CPUExecutionProvider'] only: "
            "its CUDA provider failed to load")):
        require_cuda_provider(["CPUExecutionProvider"])


def test_cuda_without_an_index_is_torchs_current_device():
    expected = torch.cuda.current_device() if torch.cuda.is_available() else 0
    assert torch_device("cuda") == torch.device("cuda", expected)
    assert torch_device("cuda:3") == torch.device("cuda", 3)


def test_the_shared_cuda_arena_takes_the_arena_options_and_is_made_once_per_device(monkeypatch):
    calls = []
    monkeypatch.setattr(_session_config, "_registered_cuda_arenas", {})
    monkeypatch.setattr(onnxruntime, "create_and_register_allocator_v2", lambda *args: calls.append(args))
    monkeypatch.setattr(onnxruntime, "OrtMemoryInfo", lambda *args: args)
    options = {"device_id": "1", "has_user_compute_stream": "1", "user_compute_stream": "1234",
               "gpu_mem_limit": "1000", "arena_extend_strategy": "kSameAsRequested", "use_tf32": "0"}
    _session_config.register_shared_cuda_arena(1, options)
    _session_config.register_shared_cuda_arena(1, dict(options, use_tf32="1"))  # not an arena setting
    assert len(calls) == 1
    provider, memory, arena_options, arena_config = calls[0]
    # ONNX Runtime 1.19 sizes the arena from the OrtArenaCfg (and crashed on None on the first GPU run)
    assert provider == "CUDAExecutionProvider"
    assert (arena_config.max_mem, arena_config.arena_extend_strategy) == (1000, 1)
    assert memory == ("Cuda", onnxruntime.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 1, onnxruntime.OrtMemType.DEFAULT)
    assert arena_options == {"device_id": "1", "gpu_mem_limit": "1000", "arena_extend_strategy": "kSameAsRequested"}
    with pytest.raises(ValueError, match=re.escape(
            "Invalid options: CUDA arena settings {'gpu_mem_limit': '2000', 'arena_extend_strategy': "
            "'kSameAsRequested'} (device.mem_limit, provider_options), but this process's arena on cuda:1, shared by "
            "every trainer, was created with {'gpu_mem_limit': '1000', 'arena_extend_strategy': 'kSameAsRequested'}")):
        _session_config.register_shared_cuda_arena(1, dict(options, gpu_mem_limit="2000"))
    _session_config.register_shared_cuda_arena(0, {"device_id": "0"})
    assert len(calls) == 2 and calls[1][2] == {"device_id": "0"}


class _Bfloat16Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 3)

    def forward(self, x, target):
        out = self.linear(x.float())
        return torch.nn.functional.mse_loss(out, target), out.to(torch.bfloat16)


def test_bfloat16_inputs_and_outputs_are_bound_like_any_dtype():
    """NumPy has no bfloat16; those tensors are bound through DLPack."""
    torch.manual_seed(0)
    model, reference = _Bfloat16Model(), _Bfloat16Model()
    reference.load_state_dict(model.state_dict())
    desc = {"inputs": [("x", ["batch", 6]), ("target", ["batch", 3])],
            "outputs": [("loss", [], True), ("out", ["batch", 3])]}
    trainer = ORTTrainer(model, desc, optim.SGDConfig(lr=0.1), options={"utils": {"grad_norm_clip": False}})
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        x, target = torch.randn(5, 6).to(torch.bfloat16), torch.randn(5, 3)
        loss, out = trainer.train_step(x, target)
        expected_loss, expected_out = reference(x, target)
        torch_optimizer.zero_grad()
        expected_loss.backward()
        torch_optimizer.step()
        assert out.dtype == torch.bfloat16 and torch.equal(out, expected_out)
        torch.testing.assert_close(loss, expected_loss.detach(), rtol=1e-6, atol=0)


def test_compiling_the_graphs_leaves_torchs_random_stream_alone():
    """The probe and the trace run the model's dropout in torch; the user's next random numbers
    must not depend on whether the trainer compiled a graph in between. (Each step draws its
    dropout seed from torch's generator, as eager dropout draws its masks, compiled or not.)"""
    model = models.transformer()
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.5
    trainer = ORTTrainer(model, models.TRANSFORMER_DESC, optim.AdamConfig(), loss_fn=models.transformer_loss)
    batch = models.transformer_batch(0)
    after_step = []
    for _ in range(2):  # the first step compiles, the second does not
        torch.manual_seed(7)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train_step(*batch)
        after_step.append(torch.rand(5))
    assert torch.equal(after_step[0], after_step[1])


class _SmallCnn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3)
        self.deconv = torch.nn.ConvTranspose2d(4, 2, 3)
        self.linear = torch.nn.Linear(2 * 6 * 6, 3)

    def forward(self, x):
        return self.linear(torch.relu(self.deconv(torch.relu(self.conv(x)))).flatten(1))


def _cuda_autocast_graph(dtype):
    buffer = io.BytesIO()
    torch.onnx.export(_SmallCnn(), (torch.randn(1, 2, 6, 6),), buffer, dynamo=False, input_names=["x"],
                      do_constant_folding=False, export_params=False, opset_version=17)
    model = onnx.load_from_string(buffer.getvalue())
    assert lower_precision(model, dtype, device_type="cuda") == 3
    return model, element_types(model)


def test_cuda_bf16_keeps_convolutions_in_fp32_with_bf16_rounding_around_them():
    """ONNX Runtime 1.19's CUDA Conv and ConvTranspose have no bf16 kernel: they compute in fp32 on
    inputs rounded to bf16, their output rounded too; the linear's product runs in bf16."""
    model, types = _cuda_autocast_graph("bfloat16")
    producers = {output: node for node in model.graph.node for output in node.output}

    def rounded(name):  # Cast(float) of a Cast(bfloat16)
        cast = producers[name]
        return (cast.op_type == "Cast" and cast.attribute[0].i == onnx.TensorProto.FLOAT
                and producers[cast.input[0]].op_type == "Cast"
                and producers[cast.input[0]].attribute[0].i == onnx.TensorProto.BFLOAT16)

    convolutions = [node for node in model.graph.node if node.op_type in ("Conv", "ConvTranspose")]
    assert sorted(node.op_type for node in convolutions) == ["Conv", "ConvTranspose"]
    for node in convolutions:
        assert all(types[name] == onnx.TensorProto.FLOAT and rounded(name) for name in node.input), node
        output = node.output[0].removesuffix("__bfloat16")  # the old name, the rounded output's
        assert types[output] == onnx.TensorProto.FLOAT and rounded(output)
        assert producers[producers[output].input[0]].input == [node.output[0]]
    (product,) = [node for node in model.graph.node if node.op_type in ("Gemm", "MatMul")]
    assert {types[name] for name in product.input} == {onnx.TensorProto.BFLOAT16}


def test_cuda_fp16_casts_convolutions_to_fp16():
    model, types = _cuda_autocast_graph("float16")
    for node in model.graph.node:
        if node.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul"):
            assert {types[name] for name in node.input} == {onnx.TensorProto.FLOAT16}, node


def test_cuda_bf16_gives_a_tensor_read_by_a_convolution_and_a_product_a_copy_of_each_type():
    """The convolution reads a rounded fp32 copy, the MatMul a bf16 one: two tensors, not one name."""
    make, value = onnx.helper.make_node, onnx.helper.make_tensor_value_info
    model = onnx.helper.make_model(onnx.helper.make_graph(
        [make("Conv", ["x", "x"], ["c"]), make("MatMul", ["x", "x"], ["m"])], "g",
        [value("x", onnx.TensorProto.FLOAT, [1, 1, 3, 3])],
        [value("c", onnx.TensorProto.FLOAT, [1, 1, 1, 1]), value("m", onnx.TensorProto.FLOAT, [1, 1, 3, 3])]),
        opset_imports=[onnx.helper.make_opsetid("", 17)])
    assert lower_precision(model, "bfloat16", device_type="cuda") == 2
    onnx.checker.check_model(model, full_check=True)
    types = element_types(model)
    nodes = {node.op_type: node for node in model.graph.node}
    assert {types[name] for name in nodes["Conv"].input} == {onnx.TensorProto.FLOAT}
    assert {types[name] for name in nodes["MatMul"].input} == {onnx.TensorProto.BFLOAT16}


def _cuda_options(user_options=None):
    """The CUDA provider options a trainer on cuda:0 with `user_options` (its provider_options) runs."""
    from ort_trainer import ORTTrainerOptions
    from ort_trainer._configuration.runtime_settings import RuntimeSettings

    options = ORTTrainerOptions({"device": {"id": "cuda:0"},
                                 "provider_options": {"CUDAExecutionProvider": user_options or {}}})
    providers = _session_config.provider_options_from(RuntimeSettings.of_trainer(options, threads=1), [
        ("CUDAExecutionProvider", _session_config.cuda_provider_options(0, 1234)), "CPUExecutionProvider"])
    return providers[0][1]


@pytest.fixture
def torch_tf32():
    """Sets torch's TF32 switch for cuBLAS matmuls (`api`: the legacy `allow_tf32` or
    `fp32_precision`) for one test. Restored through both APIs: after a mix of the two, torch
    refuses to read `allow_tf32`."""
    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision
    yield lambda api, value: setattr(matmul, api, value)
    matmul.allow_tf32 = saved == "tf32"
    matmul.fp32_precision = saved


@pytest.mark.parametrize("api, value, expected", [
    ("fp32_precision", "none", "0"), ("allow_tf32", False, "0"), ("allow_tf32", True, "1"),
    ("fp32_precision", "ieee", "0"), ("fp32_precision", "tf32", "1")])
def test_ort_multiplies_in_tf32_where_torchs_matmul_does(torch_tf32, api, value, expected):
    """ONNX Runtime's default is TF32; torch's is fp32, which the parity checks compare against."""
    torch_tf32(api, value)
    assert _cuda_options() == {"device_id": "0", "has_user_compute_stream": "1", "user_compute_stream": "1234",
                               "use_tf32": expected}


@pytest.mark.parametrize("torch_allows, users", [(True, 0), (False, 1), (False, "1")])
def test_the_users_use_tf32_wins_over_torchs_switch(torch_tf32, torch_allows, users):
    torch_tf32("allow_tf32", torch_allows)
    assert _cuda_options({"use_tf32": users})["use_tf32"] == str(users)


def test_a_changed_tf32_switch_shares_the_cuda_arena(torch_tf32, monkeypatch):
    """use_tf32 is a session's setting, not the arena's: a trainer created after torch's switch
    changed shares the first one's arena."""
    calls = []
    monkeypatch.setattr(_session_config, "_registered_cuda_arenas", {})
    monkeypatch.setattr(onnxruntime, "create_and_register_allocator_v2", lambda *args: calls.append(args))
    monkeypatch.setattr(onnxruntime, "OrtMemoryInfo", lambda *args: args)
    resolved = []
    for allowed in (False, True):
        torch_tf32("allow_tf32", allowed)
        resolved.append(_cuda_options({"gpu_mem_limit": 1000}))
        _session_config.register_shared_cuda_arena(0, resolved[-1])
    assert [options["use_tf32"] for options in resolved] == ["0", "1"]
    assert len(calls) == 1 and calls[0][2] == {"device_id": "0", "gpu_mem_limit": "1000"}
