"""ORTTrainer on CUDA against the same trainer on the CPU (the CPU path is proven against PyTorch).

Needs ONNX Runtime's CUDA build, a CUDA torch and CuPy (the `gpu` extra, or the GPU bundle);
skipped otherwise. TF32 is off in ORT (`use_tf32`) and torch, so the two devices differ only by
summation order: losses and weights agree to 1e-4 over 5 steps. Losses are read with `.item()`
and no explicit synchronize: a missing stream dependency shows up as a wrong value.
"""
import copy
import warnings

import pytest
import torch

onnxruntime = pytest.importorskip("onnxruntime")
if "CUDAExecutionProvider" not in onnxruntime.get_available_providers() or not torch.cuda.is_available():
    pytest.skip("needs ONNX Runtime's CUDA build and a CUDA torch", allow_module_level=True)

from ort_trainer import ORTTrainer, optim  # noqa: E402

from .. import models  # noqa: E402

TOLERANCE = 1e-4
STEPS = 5
NO_TF32 = {"CUDAExecutionProvider": {"use_tf32": 0}}
pytestmark = pytest.mark.usefixtures("torch_tf32_off")


def _trainer(device, config=None, *, model_device=None, **options):
    """`model_device`: where the model is when the trainer gets it (default `device`)."""
    options = {"device": {"id": device}, **options}
    if device.startswith("cuda"):
        options["provider_options"] = NO_TF32
    model = models.transformer().to(model_device or device)
    return ORTTrainer(model, models.TRANSFORMER_DESC, config or optim.AdamConfig(lr=1e-3, max_norm_clip=0.5),
                      loss_fn=models.transformer_loss, options=options)


def _train(trainer, device, steps=STEPS, stream=None):
    """Losses read on the caller's stream right after each step (no synchronize)."""
    losses = []
    for step in range(steps):
        src, label = (t.to(device) for t in models.transformer_batch(step))
        if stream is None:
            losses.append(trainer.train_step(src, label)[0].item())
        else:
            with torch.cuda.stream(stream):
                loss = trainer.train_step(src, label)[0]
                losses.append(loss.item())
    return losses


def _weights(trainer):
    return {name: t.detach().cpu() for name, t in trainer.model.state_dict().items()}


def _assert_close(cuda_losses, cpu_losses, cuda_weights, cpu_weights):
    torch.testing.assert_close(torch.tensor(cuda_losses), torch.tensor(cpu_losses), rtol=TOLERANCE, atol=0)
    for name, expected in cpu_weights.items():  # not the attention key bias, whose true gradient is zero
        torch.testing.assert_close(models.comparable(name, cuda_weights[name]), models.comparable(name, expected),
                                   rtol=TOLERANCE, atol=TOLERANCE, msg=name)


@pytest.fixture(scope="module")
def cpu_run():
    trainer = _trainer("cpu")
    return _train(trainer, "cpu"), _weights(trainer)


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_trains_like_the_cpu(device, cpu_run):
    trainer = _trainer(device)
    _assert_close(_train(trainer, device), cpu_run[0], _weights(trainer), cpu_run[1])


def test_a_model_on_the_cpu_is_moved_to_the_cuda_trainers_device(cpu_run):
    """As the original, which took a model on any device: the trainer moves it there (`model.to`)."""
    trainer = _trainer("cuda", model_device="cpu")
    assert {t.device for t in (*trainer.model.parameters(), *trainer.model.buffers())} == {torch.device("cuda", 0)}
    _assert_close(_train(trainer, "cuda"), cpu_run[0], _weights(trainer), cpu_run[1])


def test_a_target_out_of_range_is_refused_before_the_cuda_kernel_reads_it():
    """ONNX Runtime's CUDA loss kernel does not check targets: the trainer does, with the CPU's error."""
    trainer = _trainer("cuda")
    src, label = (t.to("cuda") for t in models.transformer_batch(0))
    trainer.train_step(src, label)
    label[0] = models.VOCAB
    with pytest.raises(IndexError, match=r"out of range: the loss takes targets in \[0, 50\) or ignore_index=-100"):
        trainer.train_step(src, label)
    assert trainer.train_step_info.step == 1


def test_cuda_trains_like_the_cpu_inside_the_callers_stream(cpu_run):
    trainer = _trainer("cuda")
    losses = _train(trainer, "cuda", stream=torch.cuda.Stream())
    _assert_close(losses, cpu_run[0], _weights(trainer), cpu_run[1])


def test_outputs_are_ready_on_the_callers_stream_without_synchronize():
    """The logits, consumed by a torch kernel on the caller's stream right away, equal the eval
    step's (run later, after a full synchronize)."""
    trainer = _trainer("cuda")
    src, label = (t.to("cuda") for t in models.transformer_batch(0))
    output = trainer.eval_step(src, label)[1]
    first = output.sum().item()
    torch.cuda.synchronize()
    assert first == trainer.eval_step(src, label)[1].sum().item()


@pytest.mark.parametrize("options", [
    {"batch": {"gradient_accumulation_steps": 2}},
    {"utils": {"grad_norm_clip": False}},
], ids=["accumulation", "no-clip"])
def test_cuda_features_train_like_the_cpu(options):
    cpu, cuda = _trainer("cpu", **copy.deepcopy(options)), _trainer("cuda", **copy.deepcopy(options))
    _assert_close(_train(cuda, "cuda", 6), _train(cpu, "cpu", 6), _weights(cuda), _weights(cpu))


def test_loss_scaling_on_cuda_trains_like_the_cpu():
    """fp16 on CUDA (real fp16 products) against the CPU's emulation of them: the same roundings,
    but where a different summation order flips one (tests/test_mixed_precision.py): losses 1e-4."""
    options = {"mixed_precision": {"enabled": True, "loss_scaler": None}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU's emulated fp16 is announced
        cpu = _trainer("cpu", **copy.deepcopy(options))
        cuda = _trainer("cuda", **copy.deepcopy(options))
    torch.testing.assert_close(torch.tensor(_train(cuda, "cuda")), torch.tensor(_train(cpu, "cpu")), rtol=1e-4, atol=0)
    assert cuda.train_step_info.optimization_step == cpu.train_step_info.optimization_step


def test_lamb_on_cuda_trains_like_the_cpu():
    cpu, cuda = _trainer("cpu", optim.LambConfig(lr=1e-3)), _trainer("cuda", optim.LambConfig(lr=1e-3))
    _assert_close(_train(cuda, "cuda"), _train(cpu, "cpu"), _weights(cuda), _weights(cpu))


def test_a_cuda_checkpoint_resumes_on_cuda_and_on_the_cpu(tmp_path):
    trainer = _trainer("cuda")
    _train(trainer, "cuda", 3)
    trainer.save_checkpoint(tmp_path / "run.pt")
    expected = _train(trainer, "cuda", 2)
    for device in ("cuda", "cpu"):
        resumed = _trainer(device)
        resumed.load_checkpoint(tmp_path / "run.pt")
        torch.testing.assert_close(torch.tensor(_train(resumed, device, 2)), torch.tensor(expected),
                                   rtol=TOLERANCE, atol=0)


def test_export_onnx_from_cuda_runs_like_the_trained_model(tmp_path):
    trainer = _trainer("cuda")
    _train(trainer, "cuda", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fixed sequence length is announced
        trainer.export_onnx(tmp_path / "model.onnx")
    src, _ = models.transformer_batch(0)
    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    (output,) = session.run(None, {"src": src.numpy()})
    model = copy.deepcopy(trainer.model).cpu().eval()
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(output), model(src), rtol=1e-4, atol=1e-5)

