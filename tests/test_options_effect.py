"""Every option takes effect or is refused by name: `test_every_option_is_honoured_or_refused` walks the
schema and fails for an option that is accepted and ignored. Then the effect tests of the options
`_session_config.py` derives ONNX Runtime settings from, and the file modes of atomic writes."""
import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import onnx
import onnxruntime
import pytest
import torch

from ort_trainer import ORTTrainer, ORTTrainerOptions, optim
from ort_trainer._checkpoint import atomic_write
from ort_trainer._options import _NOT_YET_SUPPORTED
from ort_trainer._session_config import (
    cpu_arena_config,
    provider_options_from,
    save_graphs,
    session_options_from,
)
from ort_trainer._validation import load_schema

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
    "mixed_precision.enabled": "test_trainer_features.py::test_loss_scaling_matches_unscaled_training",
    "mixed_precision.loss_scaler":
        "test_trainer_features.py::test_non_finite_gradients_skip_the_update_and_back_off_the_scale",
    "utils.frozen_weights": "test_trainer_features.py::test_frozen_weights_get_no_gradient_and_stay_put",
    "utils.grad_norm_clip": "test_trainer_parity.py::test_mlp_parity",
    "utils.max_cached_graphs": "test_trainer_shapes.py::test_graph_cache_is_bounded_and_recompiles_evicted_shapes",
    "debug.deterministic_compute": "test_options_effect.py::test_deterministic_compute_reaches_the_sessions",
    "debug.check_model_export":
        "test_trainer_errors.py::test_check_model_export_reports_a_graph_that_differs_from_torch",
    **{f"debug.graph_save_paths.{field}": "test_options_effect.py::test_graph_save_paths_write_the_graphs"
       for field in SAVE_PATHS},
    "_internal_use.onnx_opset_version": "test_trainer_errors.py::test_opset_version_option_is_used",
    "provider_options": "test_options_effect.py::test_cuda_provider_options_and_mem_limit_reach_the_session",
    "session_options": "test_options_effect.py::test_session_options_reach_the_sessions",
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
    return [entry[0] for graph in trainer._graphs._graphs.values() for entry in graph._sessions.values()]


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


def test_without_session_options_the_trainers_are_used():
    base = onnxruntime.SessionOptions()
    assert session_options_from(ORTTrainerOptions(), base) is base


def test_the_users_session_options_win_over_the_trainers():
    user = onnxruntime.SessionOptions()
    user.intra_op_num_threads, user.logid = 3, "mine"
    user.add_session_config_entry("session.intra_op.allow_spinning", "1")
    user.add_session_config_entry("session.disable_prepacking", "1")
    base = onnxruntime.SessionOptions()
    base.intra_op_num_threads, base.log_severity_level, base.use_deterministic_compute = 2, 3, True
    base.add_session_config_entry("session.intra_op.allow_spinning", "0")
    base.add_session_config_entry("session.use_env_allocators", "1")

    assert session_options_from(ORTTrainerOptions({"session_options": user}), base) is user
    assert (user.intra_op_num_threads, user.logid) == (3, "mine")  # the user's
    assert (user.log_severity_level, user.use_deterministic_compute) == (3, True)  # the trainer's, where unset
    assert [_config(user, key) for key in ("session.intra_op.allow_spinning", "session.disable_prepacking",
                                           "session.use_env_allocators")] == ["1", "1", "1"]


def test_a_users_arena_off_stays_off_and_refuses_a_cpu_mem_limit():
    user = onnxruntime.SessionOptions()
    user.enable_cpu_mem_arena = False
    base = onnxruntime.SessionOptions()
    base.add_session_config_entry("session.use_env_allocators", "1")
    session_options_from(ORTTrainerOptions({"session_options": user}), base)
    assert not user.enable_cpu_mem_arena and _config(user, "session.use_env_allocators") is None
    limited = ORTTrainerOptions({"session_options": user, "device": {"mem_limit": 2**20}})
    with pytest.raises(ValueError, match="^" + re.escape(
            "Invalid options: device.mem_limit=1048576 limits ONNX Runtime's CPU arena, but "
            "session_options.enable_cpu_mem_arena is False (no arena); drop one of them") + "$"):
        session_options_from(limited, base)


def test_session_options_reach_the_sessions():
    """Needs the wiring: Placement.session_options() returns session_options_from(options, ...)."""
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
    assert provider_options_from(options, CUDA_BASE) == [
        ("CUDAExecutionProvider", {"device_id": "1", "has_user_compute_stream": "1", "user_compute_stream": "7",
                                   "arena_extend_strategy": "kSameAsRequested", "do_copy_in_default_stream": "1",
                                   "gpu_mem_limit": "1073741824"}),
        "CPUExecutionProvider"]
    assert CUDA_BASE[0][1] == {"device_id": "1", "has_user_compute_stream": "1", "user_compute_stream": "7"}


@pytest.mark.parametrize("options", [{}, {"provider_options": {"CPUExecutionProvider": {}}},
                                     {"device": {"mem_limit": 2**30}}], ids=["default", "empty", "cpu_mem_limit"])
def test_cpu_providers_take_no_options(options):
    assert provider_options_from(ORTTrainerOptions(options), ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]


def test_cuda_provider_without_options_is_the_trainers():
    assert provider_options_from(ORTTrainerOptions({"device": {"id": "cuda:1"}}), CUDA_BASE) == CUDA_BASE


@needs_cuda
def test_cuda_provider_options_and_mem_limit_reach_the_session():
    """Needs the wiring: Placement.providers = provider_options_from(options, ...)."""
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
        from ort_trainer._session_config import register_shared_cpu_arena
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
    """Needs the wiring: a CPU Placement registers the shared arena with register_shared_cpu_arena()."""
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
        import ort_trainer, ort_trainer._checkpoint
        print(json.dumps(calls))
    """)
    assert calls == []
