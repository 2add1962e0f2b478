"""Every option takes effect or is refused by name: `test_every_option_is_honoured_or_refused` walks the
schema and fails for an option that is accepted and ignored. Then the effect tests of the options
`_session_config.py` derives ONNX Runtime settings from, the file modes of atomic writes, and the
graph options: recomputation, symbolic shape inference, no contrib ops in the export."""
import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch

from ort_trainer import ORTTrainer, ORTTrainerOptions, optim
from ort_trainer._checkpoint_files import atomic_write
from ort_trainer._configuration.options import _NOT_YET_SUPPORTED
from ort_trainer._configuration.runtime_settings import RuntimeSettings
from ort_trainer._configuration.validation import load_schema
from ort_trainer._onnx import MARKER_DOMAIN
from ort_trainer._graph.recompute import Recompute, layer_stack
from ort_trainer._runtime import sessions
from ort_trainer._graph.trainer_graph_builder import symbolic_shapes
from ort_trainer._runtime.session_config import (cpu_arena_config, provider_options_from, save_graphs,
                                                 session_options_from, write_graphs)

from . import models

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
SAVE_PATHS = ("model_after_graph_transforms_path", "model_with_gradient_graph_path", "model_with_training_graph_path",
              "model_with_training_graph_after_optimization_path", "eval_model_path")
CUDA = torch.cuda.is_available() and "CUDAExecutionProvider" in onnxruntime.get_available_providers()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a GPU and ONNX Runtime's CUDA provider")

# Option path -> "file::test" that shows its effect. The options gated in _NOT_YET_SUPPORTED are
# refused by name (tests/test_validation.py::test_not_yet_supported); nothing else is accepted.
HONOURED = {
    "batch.gradient_accumulation_steps": "test_trainer_accumulation.py::test_accumulation_matches_pytorch",
    "device.id": "test_trainer_errors.py::test_cuda_without_a_gpu_build_is_a_clear_error_not_a_cpu_fallback",
    "device.mem_limit": "test_options_effect.py::test_cpu_mem_limit_fails_a_step_over_it",
    "distributed.world_rank": "test_distributed.py::test_options_that_disagree_with_the_process_group",
    "distributed.world_size": "test_distributed.py::test_options_that_disagree_with_the_process_group",
    "distributed.local_rank": "test_distributed.py::test_options_that_disagree_with_the_process_group",
    "distributed.allreduce_post_accumulation":
        "test_distributed.py::test_reducing_after_accumulation_equals_reducing_every_micro_step",
    "distributed.deepspeed_zero_optimization.stage":
        "test_distributed.py::test_training_equals_one_process_on_the_global_batch",
    "lr_scheduler": "test_trainer_features.py::test_scheduler_sets_the_lr_of_every_update",
    "mixed_precision.enabled": "test_mixed_precision.py::test_the_graph_rounds_where_its_rules_say",
    "mixed_precision.dtype": "test_bf16_cpu.py::test_every_product_computes_as_torch_bf16_kernels",
    "mixed_precision.loss_scaler":
        "test_trainer_features.py::test_non_finite_gradients_skip_the_update_and_back_off_the_scale",
    "utils.frozen_weights": "test_trainer_features.py::test_frozen_weights_get_no_gradient_and_stay_put",
    "utils.grad_norm_clip": "test_trainer_parity.py::test_mlp_parity",
    "utils.max_cached_graphs": "test_trainer_shapes.py::test_graph_cache_is_bounded_and_recompiles_evicted_shapes",
    "utils.graph_cache_dir": "test_export_cache.py::test_trainer_reads_its_graphs_from_disk_with_the_same_losses",
    "debug.deterministic_compute": "test_options_effect.py::test_deterministic_compute_reaches_the_sessions",
    "debug.check_model_export":
        "test_trainer_errors.py::test_check_model_export_reports_a_graph_that_differs_from_torch",
    **{f"debug.graph_save_paths.{field}": "test_options_effect.py::test_graph_save_paths_write_the_graphs"
       for field in SAVE_PATHS},
    "_internal_use.onnx_opset_version": "test_trainer_errors.py::test_opset_version_option_is_used",
    "provider_options": "test_options_effect.py::test_cuda_provider_options_and_mem_limit_reach_the_session",
    "session_options": "test_options_effect.py::test_session_options_reach_the_sessions",
    "graph_transformer.gelu_recompute": "test_options_effect.py::test_recompute_lowers_the_memory_onnx_runtime_needs",
    "graph_transformer.attn_dropout_recompute":
        "test_options_effect.py::test_recompute_lowers_the_memory_onnx_runtime_needs",
    "graph_transformer.transformer_layer_recompute":
        "test_options_effect.py::test_recompute_lowers_the_memory_onnx_runtime_needs",
    "graph_transformer.number_recompute_layers":
        "test_options_effect.py::test_number_recompute_layers_counts_the_recomputed_layers",
    "graph_transformer.label_sparsity":
        "test_label_sparsity.py::test_losses_and_weights_equal_the_dense_graph_and_torch",
    "graph_transformer.embedding_sparsity":
        "test_embedding_sparsity.py::test_ortrainer_losses_and_weights_equal_the_dense_graph_and_eager",
    "utils.run_symbolic_shape_infer":
        "test_options_effect.py::test_symbolic_shape_inference_annotates_the_graphs_and_trains_the_same",
    "_internal_use.enable_onnx_contrib_ops": "test_options_effect.py::test_the_export_has_no_onnx_runtime_contrib_op",
}


def _leaf_paths(schema, prefix=""):
    """Every option of a schema, as a dotted path; groups (dicts with their own schema) are walked."""
    for key, rules in schema.items():
        if rules.get("type") == "dict" and isinstance(rules.get("schema"), dict):
            yield from _leaf_paths(rules["schema"], f"{prefix}{key}.")
        else:
            yield prefix + key


def test_every_option_is_honoured_or_refused():
    options = set(_leaf_paths(load_schema("options")))
    assert HONOURED.keys() & _NOT_YET_SUPPORTED.keys() == set()
    assert sorted(options - HONOURED.keys() - _NOT_YET_SUPPORTED.keys()) == [], "accepted and ignored"
    assert sorted(HONOURED.keys() - options) == [] and sorted(_NOT_YET_SUPPORTED.keys() - options) == []


@pytest.mark.parametrize("path", sorted(HONOURED))
def test_the_test_of_each_honoured_option_exists(path):
    file, name = HONOURED[path].split("::")
    tree = ast.parse((TESTS / file).read_text(encoding="utf-8"))
    assert name in {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}, HONOURED[path]


# ---------------------------------------------------------------- helpers

def _mlp_trainer(**options):
    return ORTTrainer(models.mlp(), models.MLP_DESC, optim.AdamConfig(), loss_fn=models.mlp_loss,
                      options=ORTTrainerOptions(options))


def _sessions(trainer):
    """The ONNX Runtime sessions the trainer's compiled graphs run on (train and eval)."""
    return [entry[0] for graph in trainer._graphs._graphs.values() for entry in graph._bound.values()]


def _run_python(script):
    """Runs `script` in a fresh interpreter (the CPU arena is process-wide); returns its last stdout
    line as JSON."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _tiny_model(*node_types):
    """x -> node_types[0] -> ... -> y, float [n]; each node is unary or adds x."""
    make = onnx.helper.make_node
    nodes, previous = [], "x"
    for index, node_type in enumerate(node_types):
        output = "y" if index == len(node_types) - 1 else f"t{index}"
        nodes.append(make(node_type, [previous, "x"] if node_type in ("Add", "Mul") else [previous], [output]))
        previous = output
    value = onnx.helper.make_tensor_value_info
    graph = onnx.helper.make_graph(nodes, "tiny", [value("x", onnx.TensorProto.FLOAT, ["n"])],
                                   [value("y", onnx.TensorProto.FLOAT, ["n"])])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)], ir_version=7)


# ---------------------------------------------------------------- session_options

def _config(session_options, key):
    try:
        return session_options.get_session_config_entry(key)
    except RuntimeError:
        return None


def _settings(options=None):
    return RuntimeSettings.of_trainer(ORTTrainerOptions(options), threads=1)


def test_without_session_options_the_trainers_are_used():
    base = onnxruntime.SessionOptions()
    assert session_options_from(_settings(), base, {}) is base


def test_the_users_session_options_win_over_the_trainers():
    user = onnxruntime.SessionOptions()
    user.intra_op_num_threads, user.logid = 3, "mine"
    user.add_session_config_entry("session.intra_op.allow_spinning", "1")
    user.add_session_config_entry("session.disable_prepacking", "1")
    base = onnxruntime.SessionOptions()
    base.intra_op_num_threads, base.log_severity_level, base.use_deterministic_compute = 2, 3, True
    entries = {"session.intra_op.allow_spinning": "0", "session.use_env_allocators": "1"}
    for key, value in entries.items():
        base.add_session_config_entry(key, value)

    assert session_options_from(_settings({"session_options": user}), base, entries) is user
    assert (user.intra_op_num_threads, user.logid) == (3, "mine")  # the user's
    assert (user.log_severity_level, user.use_deterministic_compute) == (3, True)  # the trainer's, where unset
    assert [_config(user, key) for key in ("session.intra_op.allow_spinning", "session.disable_prepacking",
                                           "session.use_env_allocators")] == ["1", "1", "1"]


def test_a_users_arena_off_stays_off_and_refuses_a_cpu_mem_limit():
    user = onnxruntime.SessionOptions()
    user.enable_cpu_mem_arena = False
    base, entries = onnxruntime.SessionOptions(), {"session.use_env_allocators": "1"}
    base.add_session_config_entry("session.use_env_allocators", "1")
    session_options_from(_settings({"session_options": user}), base, entries)
    assert not user.enable_cpu_mem_arena and _config(user, "session.use_env_allocators") is None
    limited = _settings({"session_options": user, "device": {"mem_limit": 2**20}})
    with pytest.raises(ValueError, match="^" + re.escape(
            "Invalid options: device.mem_limit=1048576 limits ONNX Runtime's CPU arena, but "
            "session_options.enable_cpu_mem_arena is False (no arena); drop one of them") + "$"):
        session_options_from(limited, base, entries)


def test_session_options_reach_the_sessions():
    """Needs the wiring: Sessions.session_options() returns session_options_from(settings, ...)."""
    user = onnxruntime.SessionOptions()
    threads = torch.get_num_threads() + 1  # not what the trainer would pick
    user.intra_op_num_threads, user.logid = threads, "mine"
    user.add_session_config_entry("session.disable_prepacking", "1")
    trainer = _mlp_trainer(session_options=user)
    trainer.train_step(*models.mlp_batch(0))
    trainer.eval_step(*models.mlp_batch(1))
    sessions = [session.get_session_options() for session in _sessions(trainer)]
    assert len(sessions) == 2
    for options in sessions:
        assert (options.intra_op_num_threads, options.logid) == (threads, "mine")
        assert _config(options, "session.disable_prepacking") == "1"
        assert _config(options, "session.intra_op.allow_spinning") == "0"  # the trainer's, where the user set none


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_compute_reaches_the_sessions(deterministic):
    trainer = _mlp_trainer(debug={"deterministic_compute": deterministic})
    trainer.train_step(*models.mlp_batch(0))
    trainer.eval_step(*models.mlp_batch(1))
    assert [s.get_session_options().use_deterministic_compute for s in _sessions(trainer)] == [deterministic] * 2


# ---------------------------------------------------------------- provider_options and device.mem_limit

CUDA_BASE = [("CUDAExecutionProvider", {"device_id": "1", "has_user_compute_stream": "1", "user_compute_stream": "7"}),
             "CPUExecutionProvider"]


def test_provider_options_merge_into_the_trainers_providers():
    options = ORTTrainerOptions({
        "device": {"id": "cuda:1", "mem_limit": 2**30},
        "provider_options": {"CUDAExecutionProvider": {"arena_extend_strategy": "kSameAsRequested",
                                                       "do_copy_in_default_stream": 1},
                             "CPUExecutionProvider": {}}})
    assert provider_options_from(RuntimeSettings.of_trainer(options, threads=1), CUDA_BASE) == [
        ("CUDAExecutionProvider", {"device_id": "1", "has_user_compute_stream": "1", "user_compute_stream": "7",
                                   "arena_extend_strategy": "kSameAsRequested", "do_copy_in_default_stream": "1",
                                   "gpu_mem_limit": "1073741824"}),
        "CPUExecutionProvider"]
    assert CUDA_BASE[0][1] == {"device_id": "1", "has_user_compute_stream": "1", "user_compute_stream": "7"}


@pytest.mark.parametrize("options", [{}, {"provider_options": {"CPUExecutionProvider": {}}},
                                     {"device": {"mem_limit": 2**30}}], ids=["default", "empty", "cpu_mem_limit"])
def test_cpu_providers_take_no_options(options):
    assert provider_options_from(_settings(options), ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]


def test_cuda_provider_without_options_is_the_trainers():
    assert provider_options_from(_settings({"device": {"id": "cuda:1"}}), CUDA_BASE) == CUDA_BASE


@needs_cuda
def test_cuda_provider_options_and_mem_limit_reach_the_session():
    """Needs the wiring: Sessions.providers = provider_options_from(settings, ...)."""
    options = ORTTrainerOptions({
        "device": {"id": "cuda", "mem_limit": 2**30},
        "provider_options": {"CUDAExecutionProvider": {"arena_extend_strategy": "kSameAsRequested"}}})
    trainer = ORTTrainer(models.mlp().cuda(), models.MLP_DESC, optim.AdamConfig(), loss_fn=models.mlp_loss,
                         options=options)
    trainer.train_step(*(tensor.cuda() for tensor in models.mlp_batch(0)))
    trainer.eval_step(*(tensor.cuda() for tensor in models.mlp_batch(1)))
    providers = [session.get_provider_options()["CUDAExecutionProvider"] for session in _sessions(trainer)]
    assert [(cuda["gpu_mem_limit"], cuda["arena_extend_strategy"]) for cuda in providers] \
        == [(str(2**30), "kSameAsRequested")] * 2


def test_cpu_arena_config():
    assert cpu_arena_config(0) is None
    assert cpu_arena_config(2**20).max_mem == 2**20


def test_the_shared_cpu_arena_holds_onnxruntime_to_the_limit():
    """ONNX Runtime itself refuses a run over max_mem; a second limit in one process is refused."""
    result = _run_python("""
        import json, numpy as np, onnxruntime
        from ort_trainer._runtime.session_config import register_shared_cpu_arena
        from tests.test_options_effect import _tiny_model
        register_shared_cpu_arena(16 << 20)
        register_shared_cpu_arena(16 << 20)  # the same limit again: nothing to do
        try:
            register_shared_cpu_arena(0)
            refused = None
        except ValueError as error:
            refused = str(error)
        options = onnxruntime.SessionOptions()
        options.add_session_config_entry("session.use_env_allocators", "1")
        session = onnxruntime.InferenceSession(_tiny_model("Neg", "Mul", "Add").SerializeToString(), options,
                                               providers=["CPUExecutionProvider"])
        session.run(None, {"x": np.ones(1 << 18, np.float32)})  # 1 MiB tensors
        try:
            session.run(None, {"x": np.ones(1 << 22, np.float32)})  # 16 MiB tensors, two alive at once
            over = None
        except Exception as error:
            over = str(error)
        print(json.dumps({"refused": refused, "over": over}))
    """)
    assert result["refused"] == (
        "Invalid options: device.mem_limit=0, but this process's CPU arena, shared by every trainer, was created "
        "with device.mem_limit=16777216 by an earlier trainer and ONNX Runtime cannot change it; give every trainer "
        "the same device.mem_limit")
    assert "Available memory of" in result["over"] and "is smaller than requested bytes" in result["over"]


def test_cpu_mem_limit_fails_a_step_over_it():
    """Needs the wiring: CPU Sessions register the shared arena with register_shared_cpu_arena()."""
    result = _run_python("""
        import json
        from ort_trainer import ORTTrainer, ORTTrainerOptions, optim
        from tests import models

        def step(mem_limit, batch):
            trainer = ORTTrainer(models.mlp(), models.MLP_DESC, optim.AdamConfig(), loss_fn=models.mlp_loss,
                                 options=ORTTrainerOptions({"device": {"mem_limit": mem_limit}}))
            try:
                trainer.train_step(*models.mlp_batch(0, batch=batch))
                return None
            except Exception as error:
                return str(error)

        print(json.dumps([step(64 << 20, 1 << 14), step(64 << 20, 1 << 18)]))
    """)
    assert result[0] is None  # 2 MiB activations fit in 64 MiB
    assert "Available memory of" in result[1] and "is smaller than requested bytes" in result[1]  # 32 MiB ones


# ---------------------------------------------------------------- debug.graph_save_paths

def _paths(directory, *fields):
    """graph_save_paths naming directory/<field>.onnx for these fields (all by default)."""
    return ORTTrainerOptions({"debug": {"graph_save_paths": {
        field: str(directory / f"{field}.onnx") for field in fields or SAVE_PATHS}}}).debug.graph_save_paths


def test_save_graphs_writes_each_named_graph(tmp_path):
    exported, training, evaluation = _tiny_model("Neg"), _tiny_model("Identity", "Add"), _tiny_model("Abs")
    session_options = onnxruntime.SessionOptions()
    save_graphs(_paths(tmp_path), exported=exported, training=training.SerializeToString(),
                evaluation=evaluation.SerializeToString(), session_options=session_options,
                providers=["CPUExecutionProvider"])
    written = {path.stem: path.read_bytes() for path in tmp_path.iterdir()}
    assert sorted(written) == sorted(SAVE_PATHS)
    assert written["model_after_graph_transforms_path"] == exported.SerializeToString()
    assert written["model_with_gradient_graph_path"] == written["model_with_training_graph_path"] \
        == training.SerializeToString()
    assert written["eval_model_path"] == evaluation.SerializeToString()
    optimized = onnx.load_from_string(written["model_with_training_graph_after_optimization_path"])
    assert [node.op_type for node in optimized.graph.node] == ["Add"]  # ORT removed the Identity
    assert session_options.optimized_model_filepath == ""  # the session's own options are left as they were


def test_save_graphs_writes_only_what_is_named_and_given(tmp_path):
    save_graphs(_paths(tmp_path, "eval_model_path", "model_with_gradient_graph_path"), evaluation=_tiny_model("Abs"))
    save_graphs(ORTTrainerOptions().debug.graph_save_paths, exported=_tiny_model("Neg"), training=b"x",
                evaluation=b"y")
    assert [path.name for path in tmp_path.iterdir()] == ["eval_model_path.onnx"]


def test_save_graphs_checks_every_directory_before_writing(tmp_path):
    paths = ORTTrainerOptions({"debug": {"graph_save_paths": {
        "model_after_graph_transforms_path": str(tmp_path / "exported.onnx"),
        "eval_model_path": str(tmp_path / "missing" / "eval.onnx")}}}).debug.graph_save_paths
    message = (f"debug.graph_save_paths.eval_model_path: cannot write '{tmp_path}/missing/eval.onnx': directory "
               f"'{tmp_path}/missing' does not exist")
    with pytest.raises(FileNotFoundError, match=f"^{re.escape(message)}$"):
        save_graphs(paths, exported=_tiny_model("Neg"), evaluation=_tiny_model("Abs"))
    assert list(tmp_path.iterdir()) == []


def test_the_optimized_graph_needs_the_sessions_options(tmp_path):
    message = ("save_graphs: debug.graph_save_paths.model_with_training_graph_after_optimization_path needs the "
               "training session's session_options and providers")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        save_graphs(_paths(tmp_path, "model_with_training_graph_after_optimization_path"), training=_tiny_model("Neg"))


def test_write_graphs_writes_what_onnx_save_writes_and_skips_what_is_not_asked_for(tmp_path):
    """The one writer of both front ends' debug graphs: ORTModule's files are what onnx.save wrote."""
    model = _tiny_model("Neg")
    onnx.save(model, tmp_path / "by_onnx.onnx")
    write_graphs([("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path / "written.onnx"), model),
                  ("ORTMODULE_SAVE_ONNX_PATH", None, model), ("x", str(tmp_path / "unasked.onnx"), None),
                  ("y", str(tmp_path / "computed.onnx"), lambda: b"bytes")])
    assert sorted(path.name for path in tmp_path.iterdir()) == ["by_onnx.onnx", "computed.onnx", "written.onnx"]
    assert (tmp_path / "written.onnx").read_bytes() == (tmp_path / "by_onnx.onnx").read_bytes()
    assert (tmp_path / "computed.onnx").read_bytes() == b"bytes"
    message = (f"ORTMODULE_SAVE_ONNX_PATH: cannot write '{tmp_path}/gone/m.onnx': directory '{tmp_path}/gone' "
               "does not exist")
    with pytest.raises(FileNotFoundError, match=f"^{re.escape(message)}$"):
        write_graphs([("y", str(tmp_path / "never.onnx"), model),
                      ("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path / "gone" / "m.onnx"), model)])
    assert not (tmp_path / "never.onnx").exists()


def _output_names(path):
    return [output.name for output in onnx.load(path).graph.output]


def test_graph_save_paths_write_the_graphs(tmp_path):
    """Needs the wiring: ORTTrainer's compile step calls save_graphs() around build_graphs()."""
    trainer = _mlp_trainer(debug={"graph_save_paths": {field: str(tmp_path / f"{field}.onnx") for field in SAVE_PATHS}})
    assert list(tmp_path.iterdir()) == []  # graphs exist from the first step on
    trainer.train_step(*models.mlp_batch(0))
    saved = {field: tmp_path / f"{field}.onnx" for field in SAVE_PATHS}
    gradients = sorted(f"model.{name}_grad" for name, _ in trainer.model.named_parameters())
    assert _output_names(saved["model_after_graph_transforms_path"]) == ["loss", "logits"]
    for field in ("model_with_gradient_graph_path", "model_with_training_graph_path",
                  "model_with_training_graph_after_optimization_path"):
        outputs = _output_names(saved[field])
        assert outputs[:2] == ["loss", "logits"] and sorted(outputs[2:]) == gradients, field
    assert _output_names(saved["eval_model_path"]) == ["loss", "logits"]
    assert saved["model_with_gradient_graph_path"].read_bytes() == saved["model_with_training_graph_path"].read_bytes()


# ---------------------------------------------------------------- file modes of atomic writes

@pytest.mark.parametrize("umask, mode", [(0o027, 0o640), (0o002, 0o664)])
def test_a_new_file_gets_the_mode_of_the_umask_at_write_time(tmp_path, umask, mode):
    """As a plain open() would (not a temporary file's 0600), under the umask of the moment."""
    previous = os.umask(umask)
    try:
        atomic_write(tmp_path / "graph.onnx", lambda file: file.write(b"graph"))
    finally:
        os.umask(previous)
    assert os.stat(tmp_path / "graph.onnx").st_mode & 0o777 == mode


def test_importing_ort_trainer_leaves_the_umask_alone():
    """A library does not change process state on import (reading the umask means setting it)."""
    calls = _run_python("""
        import json, os
        calls, umask = [], os.umask
        os.umask = lambda mask: calls.append(mask) or umask(mask)
        import ort_trainer, ort_trainer._trainer.checkpoint
        print(json.dumps(calls))
    """)
    assert calls == []


# ---------------------------------------------------------------- recomputation (graph_transformer)

class _Attention(torch.nn.Module):
    """Attention weights, dropped out (a Dropout after a Softmax), applied to the input: a residual block."""

    def __init__(self, width):
        super().__init__()
        self.query = torch.nn.Linear(width, width)

    def forward(self, x):
        weights = torch.softmax(self.query(x) @ x.transpose(-1, -2), -1)
        return x + torch.nn.functional.dropout(weights, 0.1, self.training) @ x


class _FeedForward(torch.nn.Module):
    def __init__(self, width, hidden, dropout=0.0):
        super().__init__()
        self.fc1, self.fc2, self.dropout = torch.nn.Linear(width, hidden), torch.nn.Linear(hidden, width), dropout

    def forward(self, x):
        output = self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        return x + (torch.nn.functional.dropout(output, self.dropout, self.training) if self.dropout else output)


class _Layer(torch.nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.attention, self.feed_forward = _Attention(width), _FeedForward(width, hidden, dropout=0.2)

    def forward(self, x):
        return self.feed_forward(self.attention(x))


class _Stack(torch.nn.Module):
    """Blocks in an nn.Sequential (the layers of transformer_layer_recompute), a head, the mean over positions;
    `project`: a Linear first, so that the first block's input has a gradient (its backward reads more)."""

    def __init__(self, blocks, width, project=False):
        super().__init__()
        self.project = torch.nn.Linear(width, width) if project else torch.nn.Identity()
        self.blocks, self.head = torch.nn.Sequential(*blocks), torch.nn.Linear(width, 4)

    def forward(self, x):
        return self.head(self.blocks(self.project(x))).mean(1)


def _stack_trainer(model, shape, options):
    return ORTTrainer(model, {"inputs": [("x", ["batch", *shape]), ("y", ["batch"])], "outputs": [("loss", [], True)]},
                      optim.AdamConfig(lr=0.01), loss_fn=torch.nn.functional.cross_entropy,
                      options=ORTTrainerOptions(options))


def _stack_batch(step, batch, shape):
    generator = torch.Generator().manual_seed(4000 + step)
    return torch.randn(batch, *shape, generator=generator), torch.randint(0, 4, (batch,), generator=generator)


# model, input shape (positions, width), batch, device.mem_limit in MiB between what ONNX Runtime's arena needs
# for a step without and with recomputation (measured: attention 21-22 MiB without, 16-17 with
# attn_dropout_recompute; feed-forward 20-22 MiB without, at most 14 with gelu or layer recompute)
_MEMORY_MODELS = {"attention": (lambda: _Stack([_Attention(8) for _ in range(4)], 8), (128, 8), 32, 19),
                  "feed_forward": (lambda: _Stack([_FeedForward(32, 256) for _ in range(4)], 32), (2048, 32), 1, 17)}


def _memory_case(model_name, graph_transformer):
    """'ok' when two steps run within the model's device.mem_limit, 'over' when ONNX Runtime's arena
    refuses one; the baseline ({}) runs in the PRIORITY_BASED order recomputation brings along."""
    make, shape, batch, limit = _MEMORY_MODELS[model_name]
    session_options = onnxruntime.SessionOptions()
    session_options.execution_order = onnxruntime.ExecutionOrder.PRIORITY_BASED
    torch.manual_seed(0)
    trainer = _stack_trainer(make(), shape, {"device": {"mem_limit": limit << 20}, "session_options": session_options,
                                             "graph_transformer": graph_transformer})
    try:
        for step in range(2):
            trainer.train_step(*_stack_batch(step, batch, shape))
    except Exception as error:  # ORT's arena: "Available memory of ... is smaller than requested bytes"
        return "over" if "Available memory of" in str(error) else str(error)
    return "ok"


def test_recompute_lowers_the_memory_onnx_runtime_needs():
    """A step that does not fit under the limit without recomputation fits with each option: the copies
    free what the forward kept for the backward. Each case in a fork of one fresh process (the arena
    limit is the process's).

    Needs the wiring: ORTTrainer passes Recompute.from_options(...) to build_graphs(recompute=...)."""
    results = _run_python("""
        import json, os
        from tests.test_options_effect import _memory_case

        def forked(*case):
            read, write = os.pipe()
            if os.fork() == 0:
                os.close(read)
                os.write(write, _memory_case(*case).encode())
                os._exit(0)
            os.close(write)
            answer = os.read(read, 1 << 16).decode()
            os.wait()
            return answer

        print(json.dumps([forked(*case) for case in [
            ("attention", {}), ("attention", {"attn_dropout_recompute": True}),
            ("feed_forward", {}), ("feed_forward", {"gelu_recompute": True}),
            ("feed_forward", {"transformer_layer_recompute": True})]]))
    """)
    assert results == ["over", "ok", "over", "ok", "ok"]


def _train_with_dropout(graph_transformer, directory):
    """Parameters after two Adam steps of a stack of attention + feed-forward layers with dropout, and the
    training graph; ONNX Runtime's seed is set first, so every trainer draws the same dropout masks."""
    onnxruntime.set_seed(11)
    torch.manual_seed(0)
    trainer = _stack_trainer(_Stack([_Layer(16, 64) for _ in range(3)], 16, project=True), (10, 16), {
        "graph_transformer": graph_transformer,
        "debug": {"graph_save_paths": {"model_with_training_graph_path": str(directory / "training.onnx")}}})
    for step in range(2):
        trainer.train_step(*_stack_batch(step, 8, (10, 16)))
    return [p.detach().clone() for p in trainer.model.parameters()], onnx.load(directory / "training.onnx")


@pytest.fixture(scope="module")
def trained_without_recompute(tmp_path_factory):
    """On ONNX Runtime's kernels, as recomputation keeps them (no torch node: `Sessions.faster_in_torch` None)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sessions, "_products_faster_in_torch", lambda placement, settings: None)
        return _train_with_dropout({}, tmp_path_factory.mktemp("without_recompute"))


def _copied_layers(graph):
    """Layer indices of the blocks whose tensors have recompute copies (tensors keep the exporter's
    module scopes; ORT's fused nodes do not: 'Gelu_token_1')."""
    return {int(re.search(r"/blocks\.(\d+)/", output).group(1)) for node in graph.graph.node
            if node.name.endswith("_recompute") for output in node.output if "/blocks." in output}


@pytest.mark.parametrize("graph_transformer, copied_ops, layers", [
    ({"gelu_recompute": True}, {"Gelu"}, {0, 1, 2}),
    ({"attn_dropout_recompute": True}, {"DropoutGrad"}, {0, 1, 2}),
    ({"transformer_layer_recompute": True}, None, {0, 1}),  # every layer but the last
], ids=["gelu", "attention_dropout", "layers"])
def test_recompute_trains_exactly_as_without(graph_transformer, copied_ops, layers, trained_without_recompute,
                                             tmp_path):
    """Bit for bit, with dropout on (a recomputed Dropout applies the forward's mask again); the backward
    reads the copies, not the forward's tensors they copy, and the copies wait for the backward.

    Needs the wiring: ORTTrainer passes Recompute.from_options(...) to build_graphs(recompute=...)."""
    parameters, graph = _train_with_dropout(graph_transformer, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(parameters, trained_without_recompute[0]))
    copies = [node for node in graph.graph.node if node.name.endswith("_recompute")]
    assert copies and _copied_layers(graph) == layers
    if copied_ops is not None:
        assert {node.op_type for node in copies} == copied_ops
    copied = {output[:-len("_recompute")] for node in copies for output in node.output}
    backward_reads = {name for node in graph.graph.node if "_Grad/" in node.name for name in node.input}
    assert copied.isdisjoint(backward_reads) and {name + "_recompute" for name in copied} & backward_reads
    assert any(node.op_type == "PassThrough" for node in graph.graph.node)


@pytest.mark.parametrize("count, layers", [(1, {0}), (5, {0, 1})], ids=["first_layer", "clipped"])
def test_number_recompute_layers_counts_the_recomputed_layers(count, layers, tmp_path):
    """The first `count` layers, never the last (as the original: more is clipped, with a warning).

    Needs the wiring: ORTTrainer passes Recompute.from_options(...) to build_graphs(recompute=...)."""
    options = {"transformer_layer_recompute": True, "number_recompute_layers": count}
    if count < 3:
        graph = _train_with_dropout(options, tmp_path)[1]
    else:
        message = ("graph_transformer.number_recompute_layers=5: blocks has 3 layers and the last one is never "
                   "recomputed; recomputing the first 2")
        with pytest.warns(UserWarning, match=f"^{re.escape(message)}$"):
            graph = _train_with_dropout(options, tmp_path)[1]
    assert _copied_layers(graph) == layers


def test_layer_recompute_needs_a_stack_of_layers():
    options = ORTTrainerOptions({"graph_transformer": {"transformer_layer_recompute": True}})
    message = ("Invalid options: graph_transformer.transformer_layer_recompute=True, but the model has no stack of "
               "layers to recompute (an nn.ModuleList or nn.Sequential of at least 2 modules of one class)")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        Recompute.from_options(options.graph_transformer, models.mlp())  # net: Linear, LayerNorm, GELU, Linear
    assert Recompute.from_options(ORTTrainerOptions().graph_transformer, models.mlp()) is None


def test_the_layers_are_the_longest_stack_of_one_class():
    model = torch.nn.Module()
    model.encoder = torch.nn.ModuleList([_FeedForward(4, 8) for _ in range(2)])
    model.decoder = torch.nn.Sequential(*[_Attention(4) for _ in range(3)])
    model.mixed = torch.nn.Sequential(*[_Attention(4) for _ in range(3)], _FeedForward(4, 8), torch.nn.ReLU())
    assert layer_stack(model) == ("decoder", 3)


def test_recompute_warns_when_the_model_has_nothing_to_recompute():
    recompute = Recompute.from_options(
        ORTTrainerOptions({"graph_transformer": {"gelu_recompute": True, "attn_dropout_recompute": True}})
        .graph_transformer, models.mlp())
    with pytest.warns(UserWarning) as warned:
        serialized, plan = recompute.add_nodes(_tiny_model("Neg", "Relu").SerializeToString())
    assert [str(warning.message) for warning in warned] == [
        "graph_transformer.gelu_recompute=True: the model has no Gelu, nothing to recompute",
        "graph_transformer.attn_dropout_recompute=True: the model has no Dropout after a Softmax, nothing to recompute"]
    assert onnx.load_from_string(serialized) == _tiny_model("Neg", "Relu") and plan[1] == []


@pytest.mark.parametrize("user_disabled, expected", [(None, "SkipLayerNormFusion"),
                                                     ("ConstantFolding", "ConstantFolding,SkipLayerNormFusion")])
def test_recompute_sessions_run_in_priority_order_without_skip_layer_norm_fusion(user_disabled, expected):
    """SkipLayerNormFusion would fuse a residual Add and a LayerNormalization once the backward reads the
    LayerNormalization's input from a copy, and the step fail (its gradient's saved mean is never set)."""
    user = onnxruntime.SessionOptions()
    if user_disabled is not None:
        user.add_session_config_entry("optimization.disable_specified_optimizers", user_disabled)
    options = _settings({"graph_transformer": {"gelu_recompute": True}, "session_options": user})
    chosen = session_options_from(options, onnxruntime.SessionOptions(), {})
    assert chosen.execution_order == onnxruntime.ExecutionOrder.PRIORITY_BASED
    assert _config(chosen, "optimization.disable_specified_optimizers") == expected
    plain = session_options_from(_settings(), onnxruntime.SessionOptions(), {})
    assert plain.execution_order == onnxruntime.ExecutionOrder.DEFAULT
    assert _config(plain, "optimization.disable_specified_optimizers") is None


# ---------------------------------------------------------------- utils.run_symbolic_shape_infer

def test_symbolic_shape_inference_annotates_the_graphs_and_trains_the_same(tmp_path):
    """The graphs carry the shapes ONNX Runtime's tool infers (value_info); training is unchanged.

    Needs the wiring: ORTTrainer passes shape_inference=options.utils.run_symbolic_shape_infer to build_graphs."""
    def train(flag):
        paths = {field: str(tmp_path / f"{field}_{flag}.onnx") for field in ("model_with_training_graph_path",
                                                                              "eval_model_path")}
        trainer = _mlp_trainer(utils={"run_symbolic_shape_infer": flag}, debug={"graph_save_paths": paths})
        for step in range(2):
            trainer.train_step(*models.mlp_batch(step))
        shaped = [{value.name for value in onnx.load(path).graph.value_info} for path in paths.values()]
        return [p.detach().clone() for p in trainer.model.parameters()], shaped

    (plain, plain_shapes), (annotated, annotated_shapes) = train(False), train(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, annotated))
    assert all(without < with_ for without, with_ in zip(plain_shapes, annotated_shapes))
    assert "/model/net/net.2/Mul_1_output_0" in annotated_shapes[0]  # GELU's output, not shaped without


def test_symbolic_shape_inference_failure_names_the_option():
    """The tool cannot follow every shape computation (nn.MultiheadAttention's in-projection fails it)."""
    make = onnx.helper.make_node
    graph = onnx.helper.make_graph(
        [make("Shape", ["x"], ["shape"]), make("Slice", ["shape", "start", "end"], ["kept"]),
         make("Reshape", ["x", "kept"], ["y"])], "reshape_by_a_computed_shape",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 4]),
         onnx.helper.make_tensor_value_info("start", onnx.TensorProto.INT64, [1])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(np.array([3]), "end")])
    message = ("utils.run_symbolic_shape_infer: ONNX Runtime's symbolic shape inference "
               "(onnxruntime.tools.symbolic_shape_infer) failed on the exported model (AssertionError); "
               "set utils.run_symbolic_shape_infer=False")
    with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"):
        symbolic_shapes(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 14)]))


# ---------------------------------------------------------------- _internal_use.enable_onnx_contrib_ops

class _UsesOurSymbolics(torch.nn.Module):
    """Every op our export symbolics serve (sdpa with a bool mask, embedding with a padding_idx, cumsum of
    bool, diff) and ops ONNX Runtime's contrib symbolics exported as com.microsoft ops (gelu, tril)."""

    def __init__(self):
        super().__init__()
        self.embed, self.proj = torch.nn.Embedding(10, 8, padding_idx=0), torch.nn.Linear(8, 8)

    def forward(self, ids):
        x = self.embed(ids)
        causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
        x = torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=causal & (ids > 0).unsqueeze(1))
        steps = torch.diff((ids > 0).cumsum(-1), dim=-1)
        return torch.nn.functional.gelu(self.proj(x)).square().mean() + steps.sum() * 0.0


def test_the_export_has_no_onnx_runtime_contrib_op(tmp_path):
    """enable_onnx_contrib_ops=False as the original meant it: the exported model holds no ONNX Runtime
    contrib op (ORT's own optimizations add their fused kernels later, as in the original)."""
    path = tmp_path / "exported.onnx"
    trainer = ORTTrainer(_UsesOurSymbolics(), {"inputs": [("ids", ["batch", "positions"])],
                                               "outputs": [("loss", [], True)]}, optim.SGDConfig(),
                         options=ORTTrainerOptions({"_internal_use": {"enable_onnx_contrib_ops": False},
                                                    "debug": {"graph_save_paths": {
                                                        "model_after_graph_transforms_path": str(path)}}}))
    trainer.train_step(torch.tensor([[0, 3, 4, 5], [1, 2, 0, 9]]))
    exported = onnx.load(path)
    assert {node.domain for node in exported.graph.node} == {"", MARKER_DOMAIN}  # the marker never reaches ORT
    assert {"Trilu", "Erf", "CumSum", "Where"} <= {node.op_type for node in exported.graph.node}
