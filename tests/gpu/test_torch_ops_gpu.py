"""Torch nodes (`_runtime.torch_ops`) on CUDA: ONNX Runtime's CUDA ATen kernel calls the same
executor with CUDA tensors; the torch kernels run on the trainer's stream (the calling thread's
current one). Parity with eager PyTorch, TF32 off. Not yet run on a GPU (issue #26)."""
import copy

import pytest
import torch
import torch.nn.functional as F

onnxruntime = pytest.importorskip("onnxruntime")
if "CUDAExecutionProvider" not in onnxruntime.get_available_providers() or not torch.cuda.is_available():
    pytest.skip("needs ONNX Runtime's CUDA build and a CUDA torch", allow_module_level=True)

from ort_trainer import ORTTrainer, optim  # noqa: E402

from ..test_torch_ops import CASES, _batches, _eager_losses, assert_losses_close, desc_for  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_tf32_off")
NO_TF32 = {"CUDAExecutionProvider": {"use_tf32": 0}}


@pytest.mark.parametrize("case", ["einsum input first", "adaptive_avg_pool2d", "function erfinv", "function detach"])
def test_torch_nodes_train_in_step_with_torch_on_cuda(case):
    make, shape = CASES[case]
    model = make().cuda()
    batches = [(x.cuda(), target.cuda()) for x, target in _batches(shape)]
    expected = _eager_losses(copy.deepcopy(model), batches)
    trainer = ORTTrainer(model, desc_for(shape), optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options={
        "device": {"id": "cuda"}, "provider_options": NO_TF32, "utils": {"grad_norm_clip": False}})
    assert_losses_close([trainer.train_step(x, target)[0].item() for x, target in batches], expected)
