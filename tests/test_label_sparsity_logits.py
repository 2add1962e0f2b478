"""Label sparsity where forward() also returns the logits (`_graph.label_sparsity`'s LABELLED_PROJECTION
node, `_runtime.labelled_projection`): ORTModule of a Hugging Face GPT-2 returns every position's
logits, and its loss reads the labelled rows only; the projection's gradients run on those rows when
the user's loss leaves the logits unused (ORTModule feeds their gradient as a scalar zero), dense
when it reads them too. Exactness is the proof: losses and every parameter's gradient equal eager
PyTorch's and the dense graph's, over AdamW steps, ignored-label patterns (none, all, some) and two
shapes reusing their graphs; each test checks which path ran (the node in the graph, the kind of
logits gradient its backward kernel received)."""
import copy
import logging
import re

import onnx
import onnxruntime
import pytest
import torch

from ort_trainer import ORTModule
from ort_trainer._graph.label_sparsity import gather_labelled_rows
from ort_trainer._runtime import torch_ops
from ort_trainer._runtime.labelled_projection import labelled_projection, labelled_projection_grad
from ort_trainer._torch_node_catalogue import LABELLED_PROJECTION, LABELLED_PROJECTION_GRAD
from ort_trainer.ortmodule import DebugOptions

from .test_label_sparsity import VOCAB, WIDTH, _labels  # "half", "all", "scattered" or "none" ignored
from .test_label_sparsity import small_vocabularies_count  # noqa: F401 (autouse: these vocabularies are small)

transformers = pytest.importorskip("transformers")

SHAPES = ((2, 8), (3, 6))


def _gpt2(tied=True):
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=WIDTH, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, tie_word_embeddings=tied, loss_type="ForCausalLM"))
    return model.train()


def _batches(patterns):
    generator = torch.Generator().manual_seed(5)
    batches = []
    for step, pattern in enumerate(patterns):
        batch, seq = SHAPES[step % len(SHAPES)]
        ids = torch.randint(0, VOCAB, (batch, seq), generator=generator)
        batches.append((ids, _labels(pattern, generator, batch, seq)))
    return batches


def _steps(model, batches, loss_of=lambda output: output.loss):
    """AdamW steps: (losses, [{parameter: gradient} per step], {parameter: value after})."""
    adam = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for ids, labels in batches:
        adam.zero_grad()
        output = model(input_ids=ids, labels=labels)
        loss_of(output).backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
        adam.step()
        losses.append(output.loss.item())
    return losses, grads, {name: p.detach().clone() for name, p in model.named_parameters()}


def _comparable(name, tensor):
    """Without the attention key bias: its true gradient is exactly zero, so Adam turns float noise into
    lr-sized steps in both frameworks (tests/test_trainer_parity.py); its gradients are compared."""
    if name.endswith("attn.c_attn.bias"):
        third = tensor.numel() // 3
        return torch.cat([tensor[:third], tensor[2 * third:]])
    return tensor


def _assert_same(ours, theirs, rtol, atol):
    torch.testing.assert_close(torch.tensor(ours[0]), torch.tensor(theirs[0]), rtol=rtol, atol=atol, equal_nan=True)
    for step, (our_grads, their_grads) in enumerate(zip(ours[1], theirs[1])):
        assert sorted(our_grads) == sorted(their_grads), step
        for name, grad in our_grads.items():
            torch.testing.assert_close(grad, their_grads[name], rtol=rtol, atol=atol, msg=f"step {step}: {name}")
    for name, value in ours[2].items():
        torch.testing.assert_close(_comparable(name, value), _comparable(name, theirs[2][name]), rtol=rtol, atol=atol,
                                   msg=name)


@pytest.fixture
def logits_gradients(monkeypatch):
    """The dims of the returned logits' gradient each LABELLED_PROJECTION backward received (0: the
    scalar zero of unused logits, the kept rows' path)."""
    seen, kernel = [], torch_ops.IMPLEMENTATIONS[LABELLED_PROJECTION_GRAD]

    def spy(inputs, params):
        seen.append(inputs[0].dim())
        return kernel(inputs, params)
    monkeypatch.setitem(torch_ops.IMPLEMENTATIONS, LABELLED_PROJECTION_GRAD, spy)
    return seen


def _wrapped(model, monkeypatch, tmp_path, **environ):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    tmp_path.mkdir(exist_ok=True)
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    return ORTModule(model, DebugOptions(save_onnx=True, onnx_prefix="lm"))


def _labelled_nodes(tmp_path, kind="training"):
    graph = onnx.load(tmp_path / f"lm_optimized_{kind}.onnx").graph
    return [node for node in graph.node if node.op_type == "ATen" and any(
        a.name == "operator" and a.s.decode() == LABELLED_PROJECTION for a in node.attribute)]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_gpt2_returning_its_logits_trains_like_eager_and_the_dense_graph(monkeypatch, tmp_path, logits_gradients,
                                                                          tied):
    """GPT-2 ties its head to the token embedding (wte): the head's gradient adds to the lookup's."""
    model, batches = _gpt2(tied), _batches(["half", "scattered", "all", "none", "half"])
    eager = _steps(copy.deepcopy(model), batches)
    sparse = _steps(_wrapped(copy.deepcopy(model), monkeypatch, tmp_path / "sparse"), batches)
    assert len(_labelled_nodes(tmp_path / "sparse")) == 1
    assert logits_gradients == [0] * len(batches)  # the logits unused: every backward on the kept rows
    dense = _steps(_wrapped(copy.deepcopy(model), monkeypatch, tmp_path / "dense",
                            ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER="0"), batches)
    assert _labelled_nodes(tmp_path / "dense") == [] and len(logits_gradients) == len(batches)
    _assert_same(sparse, dense, rtol=1e-5, atol=1e-6)
    _assert_same(sparse, eager, rtol=1e-4, atol=1e-5)


def test_a_loss_that_reads_the_logits_too_gets_the_dense_gradients(monkeypatch, tmp_path, logits_gradients):
    """The user's loss adds a term of the logits (every position's): the projection's gradients are
    the sum of both, computed dense. A backward on the kept rows would drop that term."""
    model, batches = _gpt2(), _batches(["half", "scattered", "half"])

    def loss_of(output):
        return output.loss + 0.1 * output.logits.square().mean()
    eager = _steps(copy.deepcopy(model), batches, loss_of)
    ours = _steps(_wrapped(copy.deepcopy(model), monkeypatch, tmp_path), batches, loss_of)
    assert len(_labelled_nodes(tmp_path)) == 1 and logits_gradients == [3] * len(batches)
    _assert_same(ours, eager, rtol=1e-4, atol=1e-5)


def test_eval_and_no_grad_calls_return_the_same_loss_and_logits(monkeypatch, tmp_path):
    model, batches = _gpt2(), _batches(["half", "all"])
    wrapped = _wrapped(copy.deepcopy(model), monkeypatch, tmp_path)
    for train in (True, False):
        model.train(train)
        wrapped.train(train)
        for ids, labels in batches:
            with torch.no_grad():
                ours, theirs = wrapped(input_ids=ids, labels=labels), model(input_ids=ids, labels=labels)
            torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-5, atol=1e-6, equal_nan=True)
            torch.testing.assert_close(ours.logits, theirs.logits, rtol=1e-5, atol=1e-6)
    assert len(_labelled_nodes(tmp_path, "inference")) == 1


def test_bf16_autocast_keeps_todays_dense_graph(monkeypatch, tmp_path):
    """Under autocast the projection is autocast's bf16 product (`_graph.bf16_products`), not this node."""
    model, (ids, labels) = _gpt2(), _batches(["half"])[0]
    wrapped = _wrapped(model, monkeypatch, tmp_path)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        wrapped(input_ids=ids, labels=labels).loss.backward()
    assert _labelled_nodes(tmp_path) == []


def _hand_written(product="matmul", fetched="scores"):
    """hidden [6, WIDTH] by weight (a MatMul, or a Gemm of weight^T with alpha 0.5, beta 2 and its C:
    `product` "gemm", "gemm without C"), a bias Add after it unless Gemm has C ("gemm" only), the
    scores an output -> SoftmaxCrossEntropyLoss(ignore_index=-100)."""
    make, value = onnx.helper.make_node, onnx.helper.make_tensor_value_info
    if product == "matmul":
        nodes = [make("MatMul", ["hidden", "weight"], ["product"])]
    else:
        nodes = [make("Gemm", ["hidden", "weight_t", *(["bias"] if product == "gemm" else [])], ["product"],
                      transB=1, alpha=0.5, beta=2.0)]
    nodes.append(make("Identity" if product == "gemm" else "Add", ["product", "bias"][:1 if product == "gemm" else 2],
                      ["scores"]))
    nodes.append(make("SoftmaxCrossEntropyLoss", ["scores", "labels"], ["loss"], ignore_index=-100))
    graph = onnx.helper.make_graph(
        nodes, "hand_written",
        [value("hidden", onnx.TensorProto.FLOAT, [6, WIDTH]), value("labels", onnx.TensorProto.INT64, [6]),
         value("weight", onnx.TensorProto.FLOAT, [WIDTH, VOCAB]),
         value("weight_t", onnx.TensorProto.FLOAT, [VOCAB, WIDTH]),
         value("bias", onnx.TensorProto.FLOAT, [VOCAB])],
        [value("loss", onnx.TensorProto.FLOAT, None), value(fetched, onnx.TensorProto.FLOAT, [6, VOCAB])])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 14)], ir_version=7)


def test_returned_scores_are_rewritten_only_where_exact():
    """The fetched tensor must be the projection's result with its bias: fetched before the bias Add,
    the node's output would not be it; a Gemm's C and a bias Add after it both, or scores of a shape
    not known: refused. Without `returned_scores` (mixed precision) they stay dense."""
    assert gather_labelled_rows(_hand_written(), ["loss", "scores"]) == 0
    assert gather_labelled_rows(_hand_written(fetched="product"), ["loss", "product"], returned_scores=True) == 0
    both = _hand_written("gemm")
    both.graph.node[1].CopyFrom(onnx.helper.make_node("Add", ["product", "bias"], ["scores"]))
    assert gather_labelled_rows(both, ["loss", "scores"], returned_scores=True) == 0
    symbolic = _hand_written()  # rows of unknown count: the node's output could not be declared
    for value in (symbolic.graph.input[0], symbolic.graph.output[1]):
        value.type.tensor_type.shape.dim[0].dim_param = "rows"
    assert gather_labelled_rows(symbolic, ["loss", "scores"], returned_scores=True) == 0


@pytest.mark.parametrize("product", ["matmul", "gemm", "gemm without C"])
def test_the_rewritten_graph_returns_the_dense_scores_and_loss(product):
    """A Gemm's beta scales its C only (not a bias Add after it); every pattern of ignored labels."""
    sparse, dense = _hand_written(product), _hand_written(product)
    assert gather_labelled_rows(sparse, ["loss", "scores"], returned_scores=True) == 1
    assert [node.op_type for node in sparse.graph.node][-2:] == ["ATen", "SoftmaxCrossEntropyLoss"]
    generator = torch.Generator().manual_seed(3)
    feeds = {name: torch.randn(*shape, generator=generator).numpy() for name, shape in (
        ("hidden", (6, WIDTH)), ("weight", (WIDTH, VOCAB)), ("weight_t", (VOCAB, WIDTH)), ("bias", (VOCAB,)))}
    torch_ops.register_executor()
    for labels in ([-100, 3, -100, 7, 1, -100], [-100] * 6, [1, 2, 3, 4, 5, 6]):
        feeds["labels"] = torch.tensor(labels).numpy()
        with torch_ops.raising_torch_op_errors():
            results = [onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
                       .run(None, {i.name: feeds[i.name] for i in model.graph.input}) for model in (sparse, dense)]
        for ours, theirs in zip(*results):
            torch.testing.assert_close(torch.from_numpy(ours), torch.from_numpy(theirs), rtol=1e-5, atol=1e-5,
                                       equal_nan=True)


@pytest.mark.parametrize("trans_b, bias, alpha, beta, operands", [
    (False, False, 1.0, 1.0, [0, 1, 2]), (True, True, 0.5, 2.0, [1, 0, 2, 3]), (True, False, 1.0, 1.0, [1, 0, 2])])
@pytest.mark.parametrize("logits_grad", ["unused", "used"])
def test_the_kernels_equal_torch_autograd_of_the_projection(trans_b, bias, alpha, beta, operands, logits_grad):
    """Gemm's flags and factors, operands listed in another order: the forward's two outputs and every
    operand's gradient against autograd of alpha * x @ op(w) + beta * b, the kept rows' gradient
    scattered into the logits' (plus theirs where used)."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 4, generator=generator, requires_grad=True)
    w = torch.randn(*((7, 4) if trans_b else (4, 7)), generator=generator, requires_grad=True)
    b = torch.randn(7, generator=generator, requires_grad=True)
    rows = torch.tensor([1, 4, 6, 9])
    op_order = [x, w, rows, *([b] if bias else [])]
    listed = [op_order[k] for k in operands]
    params = {"trans_b": trans_b, "alpha": alpha, "beta": beta, "operands": operands}
    logits = alpha * x @ (w.mT if trans_b else w) + (beta * b if bias else 0)
    returned, kept = labelled_projection([t.detach() for t in listed], params)
    torch.testing.assert_close(returned, logits.detach())
    torch.testing.assert_close(kept, logits.detach().reshape(10, 7)[rows])
    kept_grad = torch.randn(4, 7, generator=generator)
    returned_grad = torch.randn(2, 5, 7, generator=generator) if logits_grad == "used" else torch.zeros(())
    target = (logits.reshape(10, 7)[rows] * kept_grad).sum() + (
        (logits * returned_grad).sum() if logits_grad == "used" else 0)
    wanted = [k for k, operand in enumerate(operands) if operand != 2]
    expected = torch.autograd.grad(target, [listed[k] for k in wanted])
    found = labelled_projection_grad([returned_grad, kept_grad, *(t.detach() for t in listed)],
                                     {**params, "wanted": wanted})
    for ours, theirs in zip(found, expected):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_the_density_report_says_the_loss_runs_on_the_labelled_rows(monkeypatch, tmp_path, caplog):
    model, (ids, labels) = _gpt2(), _batches(["half"])[0]
    with caplog.at_level(logging.INFO, logger="ort_trainer.ortmodule"):
        _wrapped(model, monkeypatch, tmp_path, ORTMODULE_PRINT_INPUT_DENSITY="1")(input_ids=ids, labels=labels)
    reports = [record.getMessage() for record in caplog.records if "input density" in record.getMessage()]
    # GPT-2 shifts its labels by a Pad, which moves positions: they are not traced back to the input
    assert len(reports) == 1 and reports[0].endswith(
        "; the cross-entropy reading labels computed in forward(): the loss on the labelled rows, the returned "
        "logits dense (the projection's gradients on those rows where the logits go unused)")


def test_a_logits_gradient_of_another_size_is_refused():
    hidden, weight, rows = torch.randn(2, 3, 4), torch.randn(4, 5), torch.tensor([0, 4])
    params = {"trans_b": False, "alpha": 1.0, "beta": 1.0, "operands": [0, 1, 2], "wanted": [0, 1]}
    with pytest.raises(ValueError, match=re.escape("labelled_projection_grad: the returned scores' gradient has shape "
                                                   "[6, 4] for scores of 6 rows x 5 classes (expected their shape, "
                                                   "or a scalar zero)")):
        labelled_projection_grad([torch.randn(6, 4), torch.randn(2, 5), hidden, weight, rows], params)
