"""The exported-model cache on disk (ORTMODULE_CACHE_DIR, `utils.graph_cache_dir`): a new ORTModule or
ORTTrainer (a new process in one test) reads the graph from the directory instead of exporting it, with
the same losses and gradients; a changed layer (code or shape), option or library version compiles
again; a corrupt entry is compiled again with a warning; an unusable directory is refused."""
import copy
import importlib.util
import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ort_trainer
from ort_trainer import ORTTrainer, optim
from ort_trainer._compile import exports as trainer_exports
from ort_trainer._compile import module_compiler
from ort_trainer._compile.disk_cache import SUFFIX
from ort_trainer.ortmodule import ORTModule

from . import models

ROOT = Path(__file__).resolve().parents[1]
MODEL_SOURCE = '''
import torch


class Net(torch.nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.first = torch.nn.Linear(8, width)
        self.second = torch.nn.Linear(width, 4)

    def forward(self, x, target):
        hidden = torch.{activation}(self.first(x))
        return torch.nn.functional.cross_entropy(self.second(hidden), target)
'''


@pytest.fixture
def exports(monkeypatch):
    """Counts the traces of both front ends."""
    count = {"traces": 0}

    def counted(original):
        def trace(*args, **kwargs):
            count["traces"] += 1
            return original(*args, **kwargs)
        return trace

    monkeypatch.setattr(module_compiler, "export_training_model", counted(module_compiler.export_training_model))
    monkeypatch.setattr(trainer_exports, "export_training_model", counted(trainer_exports.export_training_model))
    return count


@pytest.fixture(autouse=True)
def _forget_the_model_module():
    yield
    sys.modules.pop("cached_net", None)


def _net_class(tmp_path, activation="tanh", name="cached_net"):
    """A model class from a file of its own (its source is part of the key)."""
    path = tmp_path / f"{name}.py"
    path.write_text(MODEL_SOURCE.format(activation=activation))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import leaves it
    spec.loader.exec_module(module)
    return module.Net


def _batch():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(6, 8, generator=generator), torch.randint(0, 4, (6,), generator=generator)


def _step(model):
    """Loss and gradients of one ORTModule call and backward (the model's grads cleared first)."""
    model.zero_grad()
    loss = model(*_batch())
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _entries(directory):
    return sorted(Path(directory).glob("*" + SUFFIX))


def test_a_new_ortmodule_reads_the_graph_from_disk_with_the_same_loss_and_gradients(tmp_path, monkeypatch, exports):
    net = _net_class(tmp_path)
    torch.manual_seed(0)
    model = net()
    fresh_loss, fresh_grads = _step(ORTModule(copy.deepcopy(model)))  # no cache
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(tmp_path / "cache"))
    _step(ORTModule(copy.deepcopy(model)))
    assert exports["traces"] == 2 and len(_entries(tmp_path / "cache")) == 1
    loss, grads = _step(ORTModule(copy.deepcopy(model)))
    assert exports["traces"] == 2  # read from disk
    assert torch.equal(loss, fresh_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, fresh_grads))


@pytest.mark.parametrize("change", ["code", "shape", "option", "ort_trainer version", "torch version"])
def test_what_changes_the_graph_compiles_again(tmp_path, monkeypatch, exports, change):
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(tmp_path / "cache"))
    net = _net_class(tmp_path)
    torch.manual_seed(0)
    _step(ORTModule(net()))
    if change == "code":  # the same class name in the same file, another activation
        net = _net_class(tmp_path, activation="sigmoid")
    elif change == "option":
        monkeypatch.setenv("ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", "0")
    elif change == "ort_trainer version":
        monkeypatch.setattr(ort_trainer, "__version__", "99.0")
    elif change == "torch version":
        monkeypatch.setattr(torch, "__version__", "99.0")
    torch.manual_seed(0)
    model = net(width=24) if change == "shape" else net()
    loss, grads = _step(ORTModule(copy.deepcopy(model)))
    assert exports["traces"] == 2 and len(_entries(tmp_path / "cache")) == 2
    monkeypatch.delenv("ORTMODULE_CACHE_DIR")
    eager_loss = model(*_batch())
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss.detach())
    for mine, theirs in zip(grads, model.parameters()):
        torch.testing.assert_close(mine, theirs.grad)


@pytest.mark.parametrize("damage", ["truncated", "a byte changed", "not a cache file"])
def test_a_corrupt_entry_is_compiled_again_with_a_warning(tmp_path, monkeypatch, exports, caplog, damage):
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = _net_class(tmp_path)()
    expected, _ = _step(ORTModule(copy.deepcopy(model)))
    (entry,) = _entries(tmp_path)
    content = entry.read_bytes()
    entry.write_bytes({"truncated": content[:len(content) // 2],
                       "a byte changed": content[:-10] + bytes([content[-10] ^ 1]) + content[-9:],
                       "not a cache file": b"hello"}[damage])
    with caplog.at_level(logging.WARNING, logger="ort_trainer.cache"):
        loss, _ = _step(ORTModule(copy.deepcopy(model)))
    assert exports["traces"] == 2
    assert torch.equal(loss, expected)
    (record,) = [r for r in caplog.records if r.name == "ort_trainer.cache"]
    reason = {"truncated": "its checksum does not match its contents",
              "a byte changed": "its checksum does not match its contents",
              "not a cache file": "not a graph cache file"}[damage]
    assert record.levelno == logging.WARNING
    assert record.getMessage() == f"ort_trainer graph cache: {entry} is corrupt ({reason}); removed, compiling the " \
                                  "graph again"
    assert entry.read_bytes() == content  # written again
    _step(ORTModule(copy.deepcopy(model)))
    assert exports["traces"] == 2


def test_a_directory_that_cannot_be_written_is_refused_by_both_front_ends(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(blocker / "cache"))
    with pytest.raises(ValueError) as error:
        ORTModule(models.mlp())
    assert str(error.value) == (f"ORTMODULE_CACHE_DIR='{blocker}/cache' must be a directory ORTModule can write its "
                                f"graph cache to (it is created if missing): '{blocker}' is not a directory")
    monkeypatch.delenv("ORTMODULE_CACHE_DIR")
    with pytest.raises(ValueError) as error:
        ORTTrainer(models.mlp(), models.MLP_DESC, optim.SGDConfig(lr=0.1), loss_fn=models.mlp_loss,
                   options={"utils": {"graph_cache_dir": str(blocker)}})
    assert str(error.value) == (f"Invalid options: utils.graph_cache_dir: must be a directory the graph cache can "
                                f"write to (created if missing), got '{blocker}': '{blocker}' is not a directory")


def test_a_failed_write_is_a_warning_and_the_graph_runs(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)
    model = _net_class(tmp_path)()
    wrapped = ORTModule(copy.deepcopy(model))
    (tmp_path / "cache").write_text("")  # the directory's place taken after the check
    with caplog.at_level(logging.WARNING, logger="ort_trainer.cache"):
        loss, _ = _step(wrapped)
    assert [r.getMessage().split(" (")[0] for r in caplog.records if r.name == "ort_trainer.cache"] == \
        [f"ort_trainer graph cache: cannot write to {tmp_path / 'cache'}"]
    assert torch.isfinite(loss)


def test_a_model_with_custom_autograd_functions_is_not_cached_and_says_so_once(tmp_path, monkeypatch, caplog):
    class Clamped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 4)

        def forward(self, x):
            return models.StraightThroughClamp.apply(self.linear(x)).sum()

    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(tmp_path))
    wrapped = ORTModule(Clamped())
    with caplog.at_level(logging.WARNING, logger="ort_trainer.cache"):
        wrapped(torch.randn(3, 8)).backward()
        wrapped(torch.randn(5, 8)).backward()
    assert [r.getMessage() for r in caplog.records if r.name == "ort_trainer.cache"] == [
        "ORTModule: the graphs of Clamped are not cached on disk: its graph runs custom autograd.Functions, which only "
        "this process can call"]
    assert _entries(tmp_path) == []


def _trainer(model, directory, **graph_transformer):
    options = {"utils": {"graph_cache_dir": str(directory)}, "graph_transformer": graph_transformer}
    return ORTTrainer(model, models.MLP_DESC, optim.AdamConfig(lr=1e-2), loss_fn=models.mlp_loss, options=options)


def test_trainer_reads_its_graphs_from_disk_with_the_same_losses(tmp_path, exports):
    torch.manual_seed(0)
    model = models.mlp()
    batches = [models.mlp_batch(seed) for seed in range(3)]

    def losses(trainer):
        return [trainer.train_step(*batch)[0].item() for batch in batches] + [trainer.eval_step(*batches[0])[0].item()]

    fresh = losses(ORTTrainer(copy.deepcopy(model), models.MLP_DESC, optim.AdamConfig(lr=1e-2),
                              loss_fn=models.mlp_loss))
    assert losses(_trainer(copy.deepcopy(model), tmp_path)) == fresh
    traced = exports["traces"]
    assert losses(_trainer(copy.deepcopy(model), tmp_path)) == fresh
    assert exports["traces"] == traced  # every graph from disk
    _trainer(copy.deepcopy(model), tmp_path, gelu_recompute=True).train_step(*batches[0])
    assert exports["traces"] > traced  # another option, another graph


def test_another_process_reads_the_graph_this_one_wrote(tmp_path, monkeypatch):
    """What the in-process tests cannot show: another process's objects, hash salt, caches and imports
    (this one has imported transformers, the other has not)."""
    import transformers  # noqa: F401
    script = textwrap.dedent(f"""
        import json, sys, torch
        sys.path[:0] = [{str(ROOT)!r}, {str(tmp_path)!r}]
        from ort_trainer.ortmodule import ORTModule
        from ort_trainer._compile import module_compiler
        module_compiler.export_training_model = None  # a trace fails
        from cached_net import Net
        torch.manual_seed(0)
        model = ORTModule(Net())
        generator = torch.Generator().manual_seed(0)
        x, y = torch.randn(6, 8, generator=generator), torch.randint(0, 4, (6,), generator=generator)
        loss = model(x, y)
        loss.backward()
        print(json.dumps([loss.item(), [p.grad.tolist() for p in model.parameters()]]))
    """)
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)
    loss, grads = _step(ORTModule(_net_class(tmp_path)()))
    env = {"ORTMODULE_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "random",
           "OMP_NUM_THREADS": str(torch.get_num_threads()), "ORTMODULE_FALLBACK_POLICY": "FALLBACK_DISABLE"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.splitlines()[-1]) == [loss.item(), [grad.tolist() for grad in grads]]
