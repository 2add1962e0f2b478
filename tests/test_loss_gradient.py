"""The fp32 softmax cross-entropy's gradient as one torch node (`_graph.loss_gradient`): ORTModule
on a Hugging Face causal LM, whose forward returns the loss and the logits, trains as eager whether
the user's loss reads the logits or not; the graph has the node, no Exp/Mul/Add of the logits'
size, and an unused logits' gradient is a scalar zero (no logits-sized zeros)."""
import copy

import onnx
import pytest
import torch

from ort_trainer._onnx import torch_node_operator
from ort_trainer._torch_node_catalogue import SOFTMAX_GRAD
from ort_trainer.ortmodule import DebugOptions, ORTModule

transformers = pytest.importorskip("transformers")
VOCAB = 48


def _gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=8, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))


@pytest.mark.parametrize("logits_read", [False, True], ids=["loss only", "loss and logits"])
def test_a_causal_lm_trains_as_eager_with_its_loss_gradient_in_one_node(logits_read, tmp_path, monkeypatch):
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    model = _gpt2()
    eager, wrapped = copy.deepcopy(model), ORTModule(model, DebugOptions(save_onnx=True, onnx_prefix="lm"))
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (2, 8), generator=generator)
        labels = ids.clone()
        labels[:, :3] = -100
        losses = []
        for module in (eager, wrapped):
            module.zero_grad()
            out = module(input_ids=ids, labels=labels, use_cache=False)
            loss = out.loss + (0.01 * out.logits.square().mean() if logits_read else 0)
            loss.backward()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-6)
        for (name, ours), theirs in zip(wrapped.named_parameters(), eager.parameters()):
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-6, msg=name)
    graph = onnx.load(tmp_path / "lm_optimized_training.onnx").graph
    [node] = [node for node in graph.node if torch_node_operator(node) == SOFTMAX_GRAD]
    yield_op = next(node for node in graph.node if node.op_type == "YieldOp")
    logits_gradient = yield_op.output[1]  # the gradient of the returned logits (output 1)
    assert node.input[4] == logits_gradient and not any(node.op_type in ("Exp", "Add") and logits_gradient in
                                                       node.input for node in graph.node)
    full_shape = next(attribute.ints for attribute in yield_op.attribute if attribute.name == "full_shape_outputs")
    assert 1 not in full_shape  # an unused logits' gradient is a scalar zero
