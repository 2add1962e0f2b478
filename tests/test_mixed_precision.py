"""Mixed precision (`mixed_precision.enabled`): the graphs compute their matrix products in fp16 on
fp32 master weights, as torch.autocast does, and train in step with eager PyTorch under
`torch.autocast('cpu', torch.float16)` + `torch.amp.GradScaler` (same init, same data, dropout 0).

Tolerances. fp16 rounds each product's inputs and output to 11 significant bits (unit roundoff
2^-11 = 4.9e-4). The graph and autocast round at the same products but not at every same op
(autocast runs a GELU on an fp16 linear's output in fp16, adds a linear's bias inside the product;
the graph does both in fp32) and accumulate in different orders, so the two fp16 runs differ by
rounding noise of the size fp16 and fp32 runs differ by. Measured over 20 steps on these models:
losses within 3e-5 relative of autocast's (ORT fp32 vs torch fp32: 2e-7); with SGD (linear in the
gradients, so no amplification) weights within 4e-3 relative (max difference over max magnitude per
tensor; torch fp32 vs autocast: up to 5e-3; ORT fp32 vs torch fp32: 1e-6). The tests allow about
3x: losses 1e-4, weights 1e-2. The CNN (Conv, training-mode BatchNorm over 8 rows, Linear) is
noisier: BatchNorm divides by a batch deviation computed from the rounded conv outputs (losses
measured 1.6e-4 against autocast, torch fp32 vs autocast 4.2e-4): its losses get 5e-4.
That the graph rounds as fp16 at all, which those tolerances cannot tell from fp32, is pinned
separately: against a torch reference with the graph's exact rounding
rules, and by fp16 gradient underflow.
"""
import copy
import re
import warnings

import pytest
import torch

from ort_trainer import ORTTrainer, ORTTrainerOptions, amp, optim

from . import models

transformers = pytest.importorskip("transformers")

STEPS = 20
LOSS_RTOL, WEIGHT_RTOL = 1e-4, 1e-2
HF_VOCAB, HF_BATCH, HF_SEQ = 96, 3, 10


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=HF_VOCAB, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))


def _bert():
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        num_labels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, vocab_size=HF_VOCAB))


def _hf_batch(family, step):
    generator = torch.Generator().manual_seed(300 + step)
    input_ids = torch.randint(3, HF_VOCAB, (HF_BATCH, HF_SEQ), generator=generator)
    labels = (torch.randint(0, 3, (HF_BATCH,), generator=generator) if family == "bert"
              else torch.randint(3, HF_VOCAB, (HF_BATCH, HF_SEQ), generator=generator))
    return {"input_ids": input_ids, "labels": labels}


def _hf_desc(family):
    logits = ["batch", 3] if family == "bert" else ["batch", "seq", HF_VOCAB]
    labels = ["batch"] if family == "bert" else ["batch", "seq"]
    return {"inputs": [("input_ids", ["batch", "seq"]), ("labels", labels)],
            "outputs": [("loss", [], True), ("logits", logits)]}


def _sequential():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 4))


def _sequential_batch(step):
    generator = torch.Generator().manual_seed(50 + step)
    return torch.randn(16, 12, generator=generator), torch.randint(0, 4, (16,), generator=generator)


SEQUENTIAL_DESC = {"inputs": [("x", ["batch", 12]), ("target", ["batch"])],
                   "outputs": [("loss", [], True), ("out", ["batch", 4])]}


def _cross_entropy(output, target):
    return torch.nn.functional.cross_entropy(output, target)


def _seed():
    return models.transformer()


# name -> (model, loss_fn or None (the model's loss from `labels`), model_desc, batch(step) as (args, kwargs))
CASES = {
    "seed": (_seed, models.transformer_loss, models.TRANSFORMER_DESC, lambda s: (models.transformer_batch(s), {})),
    "sequential": (_sequential, _cross_entropy, SEQUENTIAL_DESC, lambda s: (_sequential_batch(s), {})),
    "cnn": (models.conv_batch_norm, _cross_entropy, models.CONV_BATCH_NORM_DESC,
            lambda s: (models.conv_batch_norm_batch(s), {})),  # Conv, BatchNorm in training mode, Linear
    "gpt2": (lambda: (torch.manual_seed(0), _gpt2())[1], None, _hf_desc("gpt2"), lambda s: ((), _hf_batch("gpt2", s))),
    "bert": (lambda: (torch.manual_seed(0), _bert())[1], None, _hf_desc("bert"), lambda s: ((), _hf_batch("bert", s))),
}


CASE_LOSS_RTOL = {"cnn": 5e-4}
# The CNN's BatchNorm runs on autocast's fp16 convolution output in torch's fp16 CPU kernel, which
# computes differently by CPU: on an Intel Xeon with AVX512-FP16 the 10 SGD steps end 1.6e-2 from
# ours (eager fp32 ends 8e-4 from autocast there), on AMD EPYC (AVX2) within 1e-2.
# The seed model's 10 emulated-fp16 SGD steps end 0.28-0.65% from autocast's with ONNX Runtime's
# LayerNormalizationGrad (2 or 1 threads) and 1.1-1.4% with torch's (eager's own kernel, which the
# graph now runs): which fp16 roundings flip moves with any change in rounding order; in fp32 both
# kernels end within 4e-7 of eager.
CASE_WEIGHT_RTOL = {"cnn": 2e-2, "seed": 2e-2}


def _loss_of(model, loss_fn, args, kwargs):
    if loss_fn is None:
        return model(**kwargs).loss
    return loss_fn(model(*args[:-1]), args[-1])


OPTIMIZERS = {"adam": (lambda: optim.AdamConfig(lr=1e-3), lambda p: torch.optim.Adam(p, lr=1e-3)),
              "sgd": (lambda: optim.SGDConfig(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1))}


def autocast_losses(model, loss_fn, batches, *, optimizer, dtype=torch.float16):
    """Eager PyTorch under autocast with a GradScaler (its defaults: 2^16, growth after 2000 steps,
    as DynamicLossScaler's); returns the losses and the trained copy's parameters. `dtype`
    float32: no autocast, no scaler."""
    model = copy.deepcopy(model)
    optimizer = OPTIMIZERS[optimizer][1](model.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    losses = []
    for args, kwargs in batches:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = _loss_of(model, loss_fn, args, kwargs)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
    return losses, dict(model.named_parameters())


def _trainer(model, loss_fn, desc, *, optimizer="adam", **mixed_precision):
    options = {"utils": {"grad_norm_clip": False}}
    if mixed_precision:
        options["mixed_precision"] = {"enabled": True, **mixed_precision}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "mixed_precision.dtype='float16' on device 'cpu'")
        return ORTTrainer(model, desc, OPTIMIZERS[optimizer][0](), loss_fn=loss_fn, options=ORTTrainerOptions(options))


def _relative(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() if b.numel() else 0.0


def train_both(case, *, optimizer="adam", **mixed_precision):
    """(our losses, autocast's losses, max relative weight difference) after STEPS steps;
    `mixed_precision`: options beside enabled=True."""
    make_model, loss_fn, desc, make_batch = CASES[case]
    model = make_model()
    model.train()
    batches = [make_batch(step) for step in range(STEPS)]
    expected_losses, expected = autocast_losses(model, loss_fn, batches, optimizer=optimizer)
    trainer = _trainer(model, loss_fn, desc, optimizer=optimizer, enabled=True, **mixed_precision)
    losses = [trainer.train_step(*args, **kwargs)[0].item() for args, kwargs in batches]
    worst = max(_relative(models.comparable(name, p.detach()), models.comparable(name, expected[name].detach()))
                for name, p in trainer.model.named_parameters())
    return losses, expected_losses, worst


def assert_losses_close(case, losses, expected):
    rtol = CASE_LOSS_RTOL.get(case, LOSS_RTOL)
    for step, (ours, theirs) in enumerate(zip(losses, expected)):
        assert abs(ours - theirs) <= rtol * abs(theirs), (case, step, ours, theirs)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp16_adam_losses_in_step_with_torch_autocast(case):
    losses, expected, _ = train_both(case, optimizer="adam")
    assert_losses_close(case, losses, expected)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp16_sgd_losses_and_weights_in_step_with_torch_autocast(case):
    losses, expected, worst_weight = train_both(case, optimizer="sgd")
    assert_losses_close(case, losses, expected)
    assert worst_weight <= CASE_WEIGHT_RTOL.get(case, WEIGHT_RTOL), (case, worst_weight)


class _GraphRoundingRules(torch.overrides.TorchFunctionMode):
    """Torch with the graph's fp16 rules: a linear's inputs and output rounded to fp16, the product
    in fp32; the GELU and tanh right after one compute in fp16 too (ONNX Runtime's cast
    propagation); autograd then rounds the gradients as the graph's casts do."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.linear:
            rounded = [a.half().float() if isinstance(a, torch.Tensor) else a for a in args]
            return func(*rounded, **(kwargs or {})).half().float()
        if func in (torch.nn.functional.gelu, torch.tanh):
            return func(*args, **(kwargs or {})).half().float()
        return func(*args, **(kwargs or {}))


def _equal_fraction(a, b):
    return (a == b).float().mean().item()


@pytest.mark.parametrize("enabled", [True, False], ids=["fp16", "fp32"])
def test_the_graph_rounds_where_its_rules_say(enabled):
    """One step against torch with exactly the graph's rounding: the logits and the (loss-scaled)
    gradients are fp16 values, and equal torch's but where the accumulation order flips a rounding.
    The fp32 graph's are neither (so this test tells fp16 from fp32, as parity tolerances cannot)."""
    scale = 2.0 ** 10
    model = _sequential()
    x, target = _sequential_batch(0)
    reference = copy.deepcopy(model)
    with _GraphRoundingRules():
        expected_logits = reference(x)
    (_cross_entropy(expected_logits, target) * scale).backward()
    options = {"enabled": True, "loss_scaler": amp.DynamicLossScaler(loss_scale=scale)} if enabled else {}
    trainer = _trainer(model, _cross_entropy, SEQUENTIAL_DESC, optimizer="sgd", **options)
    _, logits = trainer.train_step(x, target)
    flat = trainer._weights.flat
    grads = torch.from_numpy(flat.grads.copy())
    expected_grads = torch.cat([p.grad.flatten() * (1 if enabled else 1 / scale) for p in reference.parameters()])
    logits_equal = _equal_fraction(logits, expected_logits.detach())
    grads_equal = _equal_fraction(grads, expected_grads)
    if enabled:
        assert torch.equal(logits, logits.half().float()) and torch.equal(grads, grads.half().float())
        assert logits_equal >= 0.99 and grads_equal >= 0.95, (logits_equal, grads_equal)
    else:
        assert logits_equal < 0.2 and grads_equal < 0.2, (logits_equal, grads_equal)


# ---------------------------------------------------------------- ORTModule under torch.autocast

def _autocast_loop(model, loss_fn, batches, *, dtype=torch.float16):
    """The user's loop: autocast forward, GradScaler, Adam; the losses and the outputs' dtypes."""
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    losses, dtypes = [], set()
    for args, kwargs in batches:
        adam.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            output = model(*args[:-1]) if loss_fn is not None else model(**kwargs)
            loss = loss_fn(output, args[-1]) if loss_fn is not None else output.loss
        dtypes.add((output if loss_fn is not None else output.logits).dtype)
        scaler.scale(loss).backward()
        scaler.step(adam)
        scaler.update()
        losses.append(loss.item())
    return losses, dtypes


@pytest.mark.parametrize("case", ["sequential", "seed", "gpt2", "cnn"])
def test_ortmodule_under_autocast_trains_in_step_with_torch(case, monkeypatch):
    """The same loop on ORTModule(model) and on the model: same losses (tolerance as above), the
    outputs in the types autocast gives (a linear's output fp16), no fallback."""
    from ort_trainer.ortmodule import ORTModule

    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    make_model, loss_fn, _, make_batch = CASES[case]
    model = make_model()
    model.train()
    batches = [make_batch(step) for step in range(STEPS)]
    expected, expected_dtypes = _autocast_loop(copy.deepcopy(model), loss_fn, batches)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"ORTModule under torch.autocast\('cpu', float16\)")
        losses, dtypes = _autocast_loop(ORTModule(model), loss_fn, batches)
    assert dtypes == expected_dtypes == {torch.float16}
    assert_losses_close(case, losses, expected)


def test_ortmodule_graph_follows_the_autocast_state(monkeypatch):
    """One module called outside and inside autocast: an fp32 graph and an fp16 one (the autocast
    state is part of the graph's key), each as torch computes it."""
    from ort_trainer.ortmodule import ORTModule

    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    model = _sequential()
    wrapped = ORTModule(copy.deepcopy(model))
    x, _ = _sequential_batch(0)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), model(x), rtol=1e-5, atol=1e-6)
        with torch.autocast("cpu", dtype=torch.float16), pytest.warns(UserWarning, match="emulated"):
            ours = wrapped(x)
        with _GraphRoundingRules():
            expected = model(x).half()
        assert ours.dtype == torch.float16 and _equal_fraction(ours, expected) >= 0.99
        assert wrapped(x).dtype == torch.float32


def test_options_of_mixed_precision_are_checked():
    with pytest.raises(ValueError, match=re.escape(
            "Invalid options: mixed_precision.dtype is set, but mixed_precision.enabled is False")):
        ORTTrainer(_sequential(), SEQUENTIAL_DESC, optim.SGDConfig(lr=0.1), loss_fn=_cross_entropy,
                   options=ORTTrainerOptions({"mixed_precision": {"dtype": "bfloat16"}}))
    with pytest.raises(ValueError, match=re.escape(
            "Invalid options: mixed_precision.dtype: must be one of 'float16', 'bfloat16', got 'fp8'")):
        ORTTrainerOptions({"mixed_precision": {"enabled": True, "dtype": "fp8"}})
    with pytest.warns(UserWarning, match=re.escape("mixed_precision.dtype='float16' on device 'cpu': ONNX Runtime's "
                                                   "CPU provider has no fp16 matrix products, so they are emulated")):
        trainer = ORTTrainer(_sequential(), SEQUENTIAL_DESC, optim.SGDConfig(lr=0.1), loss_fn=_cross_entropy,
                             options=ORTTrainerOptions({"mixed_precision": {"enabled": True}}))
    assert isinstance(trainer._loss_scaler, amp.DynamicLossScaler)  # fp16 scales by default
