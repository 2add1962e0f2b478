"""Options and model description validation: exact messages for bad input, normalized values for good input."""
import re

import onnxruntime
import onnxruntime.training
import pytest
import torch

from ort_trainer._configuration.model_desc import (InputDescription, ModelDescription, OutputDescription,
                                                   parse_model_desc)
from ort_trainer._configuration.options import _NOT_YET_SUPPORTED, ORTTrainerOptions, PropagateCastOpsStrategy, _lookup
from ort_trainer._configuration.validation import load_schema, validate

TOP_LEVEL_KEYS = ("_internal_use, batch, debug, device, distributed, graph_transformer, lr_scheduler, "
                  "mixed_precision, provider_options, session_options, utils")
UTILS_KEYS = ("frozen_weights, grad_norm_clip, invertible_layer_norm_gradient, max_cached_graphs, "
              "memory_efficient_gradient, run_symbolic_shape_infer")
DTYPES = "'bfloat16', 'bool', 'float16', 'float32', 'float64', 'int8', 'int32', 'int64', 'uint8'"


class Scheduler:
    def get_lr(self, train_step_info):
        return 0.1


class Scaler:
    def update(self, train_step_info):
        pass

    def reset(self):
        pass


# ---------------------------------------------------------------- options

DEFAULT_OPTIONS = {
    "batch": {"gradient_accumulation_steps": 1},
    "device": {"id": "cpu", "mem_limit": 0},
    "distributed": {
        "world_rank": 0, "world_size": 1, "local_rank": 0, "data_parallel_size": 1, "horizontal_parallel_size": 1,
        "pipeline_parallel": {
            "pipeline_parallel_size": 1, "num_pipeline_micro_batches": 1, "pipeline_cut_info_string": "",
            "sliced_schema": {}, "sliced_axes": {}, "sliced_tensor_names": [],
        },
        "allreduce_post_accumulation": False,
        "deepspeed_zero_optimization": {"stage": 0},
        "enable_adasum": False,
    },
    "lr_scheduler": None,
    "mixed_precision": {"enabled": False, "dtype": "float16", "loss_scaler": None},
    "graph_transformer": {
        "attn_dropout_recompute": False, "gelu_recompute": False, "transformer_layer_recompute": False,
        "number_recompute_layers": 0, "allow_layer_norm_mod_precision": False, "label_sparsity": True,
        "embedding_sparsity": True,
        "propagate_cast_ops_config": {"strategy": "INSERT_AND_REDUCE", "level": -1, "allow": []},
    },
    "utils": {
        "frozen_weights": [], "grad_norm_clip": True, "memory_efficient_gradient": False,
        "invertible_layer_norm_gradient": False, "run_symbolic_shape_infer": False,
        "max_cached_graphs": 8,
    },
    "debug": {
        "deterministic_compute": False, "check_model_export": False,
        "graph_save_paths": {
            "model_after_graph_transforms_path": "", "model_with_gradient_graph_path": "",
            "model_with_training_graph_path": "", "model_with_training_graph_after_optimization_path": "",
            "eval_model_path": "",
        },
    },
    "_internal_use": {
        "enable_internal_postprocess": True, "extra_postprocess": None, "onnx_opset_version": 14,
        "enable_onnx_contrib_ops": True,
    },
    "provider_options": {},
    "session_options": None,
}


@pytest.mark.parametrize("options", [None, {}], ids=["None", "empty"])
def test_options_defaults(options):
    assert ORTTrainerOptions(options)._validated_opts == DEFAULT_OPTIONS


def test_options_fill_defaults_around_given_values():
    opts = ORTTrainerOptions({"utils": {"frozen_weights": ["fc.bias"]}, "device": {"id": "cuda:1"}})
    assert opts.utils.frozen_weights == ["fc.bias"]
    assert opts.utils.grad_norm_clip is True
    assert opts.device.id == "cuda:1"
    assert opts.device.mem_limit == 0
    assert opts._validated_opts["debug"] == DEFAULT_OPTIONS["debug"]


def test_options_attribute_access():
    providers = {"CUDAExecutionProvider": {"arena_extend_strategy": "kSameAsRequested"}}
    opts = ORTTrainerOptions({"device": {"id": "cuda"}, "provider_options": providers})
    assert opts.distributed.deepspeed_zero_optimization.stage == 0
    assert opts.distributed.pipeline_parallel.sliced_axes == {}
    assert opts.graph_transformer.propagate_cast_ops_config.strategy == "INSERT_AND_REDUCE"
    assert opts.debug.graph_save_paths.model_with_training_graph_path == ""
    assert opts._internal_use.onnx_opset_version == 14
    assert opts.utils.max_cached_graphs == 8
    assert opts.lr_scheduler is None
    assert opts.provider_options == providers


def test_options_are_read_only():
    opts = ORTTrainerOptions()
    message = "options are read-only (tried to set {}); create new ORTTrainerOptions"
    with pytest.raises(AttributeError, match=f"^{re.escape(message.format('utils.grad_norm_clip'))}$"):
        opts.utils.grad_norm_clip = False
    with pytest.raises(AttributeError, match=f"^{re.escape(message.format('utils'))}$"):
        opts.utils = None


def test_options_none_is_refused_by_name():
    """An explicit None is not the default (cerberus would fill it): the caller asked for None."""
    message = ("Invalid options: debug: must not be None; device.id: must not be None; "
               "utils.grad_norm_clip: must not be None")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        ORTTrainerOptions({"device": {"id": None}, "utils": {"grad_norm_clip": None}, "debug": None})


def test_options_none_where_nullable():
    nulls = {"lr_scheduler": None, "mixed_precision": {"loss_scaler": None}, "session_options": None,
             "_internal_use": {"extra_postprocess": None}}
    assert ORTTrainerOptions(nulls)._validated_opts == DEFAULT_OPTIONS


def test_options_do_not_share_defaults_or_input():
    given = {"utils": {"frozen_weights": ["a"]}}
    first, second = ORTTrainerOptions(given), ORTTrainerOptions()
    first.utils.frozen_weights.append("b")
    second.distributed.pipeline_parallel.sliced_tensor_names.append("x")
    assert given == {"utils": {"frozen_weights": ["a"]}}
    assert ORTTrainerOptions()._validated_opts == DEFAULT_OPTIONS


def test_options_repr():
    text = repr(ORTTrainerOptions({"utils": {"max_cached_graphs": 2}}))
    assert text.startswith("ORTTrainerOptions({")
    assert "'max_cached_graphs': 2" in text
    assert repr(ORTTrainerOptions().device) == "OptionGroup('device', {'id': 'cpu', 'mem_limit': 0})"


def _with_defaults(given, defaults=DEFAULT_OPTIONS):
    """DEFAULT_OPTIONS with the values of ``given`` in place (groups merged key by key)."""
    return {key: _with_defaults(given[key], value) if isinstance(value, dict) and value and key in given
            else given.get(key, value) for key, value in defaults.items()}


@pytest.mark.parametrize("options", [
    {"device": {"id": "cpu"}},
    {"device": {"id": "cuda"}},
    {"device": {"id": "cuda:0"}},
    {"device": {"id": "cuda:12", "mem_limit": 2**30}},
    {"_internal_use": {"onnx_opset_version": 17}},
    {"utils": {"grad_norm_clip": False, "max_cached_graphs": 1, "frozen_weights": ["w"]}},
    {"debug": {"deterministic_compute": True, "check_model_export": True,
               "graph_save_paths": {"model_with_training_graph_path": "t.onnx", "eval_model_path": "e.onnx"}}},
    {"session_options": onnxruntime.SessionOptions()},
    {"provider_options": {"CPUExecutionProvider": {}}},
    {"device": {"id": "cuda:1", "mem_limit": 2**30},
     "provider_options": {"CUDAExecutionProvider": {"arena_extend_strategy": "kSameAsRequested"}}},
    {"device": {"id": "cuda"}, "provider_options": {"CUDAExecutionProvider": {"gpu_mem_limit": 2**30}}},
    {"graph_transformer": {"gelu_recompute": True, "attn_dropout_recompute": True,
                           "transformer_layer_recompute": True, "number_recompute_layers": 3}},
    {"utils": {"run_symbolic_shape_infer": True}, "_internal_use": {"enable_onnx_contrib_ops": False}},
])
def test_options_valid(options):
    assert ORTTrainerOptions(options)._validated_opts == _with_defaults(options)


@pytest.mark.parametrize("path, value", [
    ("lr_scheduler", Scheduler()),
    ("mixed_precision.loss_scaler", Scaler()),
    ("_internal_use.extra_postprocess", lambda model: model),
    ("session_options", onnxruntime.SessionOptions()),
], ids=["lr_scheduler", "loss_scaler", "extra_postprocess", "session_options"])
def test_options_objects_are_kept_as_given(path, value):
    """Objects pass their type checks and come back as the same object, not a copy (validate(): the
    extra_postprocess option itself is gated)."""
    assert _lookup(validate("options", _nested(path, value), "Invalid options"), path) is value


@pytest.mark.parametrize("options, message", [
    ({"utils": {"grad_norm_clip": 1}}, "utils.grad_norm_clip: must be a bool, got 1 (int)"),
    ({"utils": {"max_cached_graphs": 0}}, "utils.max_cached_graphs: must be >= 1, got 0"),
    ({"graph_transformer": {"label_sparsity": "no"}}, "graph_transformer.label_sparsity: must be a bool, got 'no' (str)"),
    ({"utils": {"max_cached_graphs": True}}, "utils.max_cached_graphs: must be an int, got True (bool)"),
    ({"utils": {"frozen_weights": "fc.weight"}}, "utils.frozen_weights: must be a list, got 'fc.weight' (str)"),
    ({"utils": {"frozen_weights": ["a", 3]}}, "utils.frozen_weights[1]: must be a str, got 3 (int)"),
    ({"utils": {"foo": 1}}, f"utils.foo: unknown field (allowed: {UTILS_KEYS})"),
    ({"utils": 5}, "utils: must be a dict, got 5 (int)"),
    ({"foo": {}}, f"foo: unknown field (allowed: {TOP_LEVEL_KEYS})"),
    ({"device": {"id": "gpu"}}, "device.id: must be 'cpu', 'cuda' or 'cuda:N' (N a device index), got 'gpu'"),
    ({"device": {"id": "cuda:x"}}, "device.id: must be 'cpu', 'cuda' or 'cuda:N' (N a device index), got 'cuda:x'"),
    ({"device": {"id": 0}}, "device.id: must be a str, got 0 (int)"),
    ({"device": {"mem_limit": -1}}, "device.mem_limit: must be >= 0, got -1"),
    ({"batch": {"gradient_accumulation_steps": 0}}, "batch.gradient_accumulation_steps: must be >= 1, got 0"),
    ({"_internal_use": {"onnx_opset_version": 13}}, "_internal_use.onnx_opset_version: must be >= 14, got 13"),
    ({"_internal_use": {"onnx_opset_version": 18}}, "_internal_use.onnx_opset_version: must be <= 17, got 18"),
    ({"_internal_use": {"extra_postprocess": 1}}, "_internal_use.extra_postprocess: must be callable, got 1 (int)"),
    ({"distributed": {"deepspeed_zero_optimization": {"stage": 2}}},
     "distributed.deepspeed_zero_optimization.stage: must be <= 1, got 2"),
    ({"distributed": {"pipeline_parallel": {"sliced_schema": {"w": [0, "x"]}}}},
     "distributed.pipeline_parallel.sliced_schema.w[1]: must be an int, got 'x' (str)"),
    ({"graph_transformer": {"propagate_cast_ops_config": {"strategy": "NONE"}}},
     "graph_transformer.propagate_cast_ops_config.strategy: must be one of 'INSERT_AND_REDUCE', 'FLOOD_FILL', "
     "got 'NONE'"),
    ({"graph_transformer": {"propagate_cast_ops_config": {"strategy": PropagateCastOpsStrategy.NONE}}},
     "graph_transformer.propagate_cast_ops_config.strategy: must be one of 'INSERT_AND_REDUCE', 'FLOOD_FILL', "
     "got 'NONE'"),
    ({"graph_transformer": {"propagate_cast_ops_config": {"strategy": 1}}},
     "graph_transformer.propagate_cast_ops_config.strategy: must be a PropagateCastOpsStrategy or its name, "
     "got 1 (int)"),
    ({"graph_transformer": {"propagate_cast_ops_config": {"level": -2}}},
     "graph_transformer.propagate_cast_ops_config.level: must be >= -1, got -2"),
    ({"graph_transformer": {"number_recompute_layers": 2}},
     "graph_transformer.number_recompute_layers: needs graph_transformer.transformer_layer_recompute=True (it "
     "counts the layers that one recomputes), got 2"),
    ({"graph_transformer": {"number_recompute_layers": -1, "transformer_layer_recompute": True}},
     "graph_transformer.number_recompute_layers: must be >= 0, got -1"),
    ({"lr_scheduler": 0.1}, "lr_scheduler: must be an LR scheduler (an object with get_lr()), got 0.1 (float)"),
    ({"mixed_precision": {"loss_scaler": "dynamic"}},
     "mixed_precision.loss_scaler: must be a loss scaler (an object with update() and reset()), got 'dynamic' (str)"),
    ({"session_options": {}}, "session_options: must be an onnxruntime.SessionOptions, got {} (dict)"),
    ({"provider_options": {"CUDAExecutionProvider": "fast"}},
     "provider_options.CUDAExecutionProvider: must be a dict, got 'fast' (str)"),
    ({"provider_options": {"CUDAExecutionProvider": {}}},
     "provider_options.CUDAExecutionProvider: not a provider this trainer runs (device.id='cpu' runs on "
     "CPUExecutionProvider)"),
    ({"device": {"id": "cuda:1"}, "provider_options": {"TensorrtExecutionProvider": {}}},
     "provider_options.TensorrtExecutionProvider: not a provider this trainer runs (device.id='cuda:1' runs on "
     "CUDAExecutionProvider, CPUExecutionProvider)"),
    ({"provider_options": {"CPUExecutionProvider": {"use_arena": "0"}}},
     "provider_options.CPUExecutionProvider: the CPU provider reads no options (ONNX Runtime would ignore them), "
     "got {'use_arena': '0'}; session_options holds the CPU settings"),
    ({"device": {"id": "cuda"}, "provider_options": {"CUDAExecutionProvider": {"device_id": "1", "foo": 1}}},
     "provider_options.CUDAExecutionProvider: 'device_id' is set by the trainer (from device.id, and the "
     "stream the trainer owns), got '1'"),
    ({"device": {"id": "cuda", "mem_limit": 100}, "provider_options": {"CUDAExecutionProvider": {
        "gpu_mem_limit": 200, "user_compute_stream": "0"}}},
     "provider_options.CUDAExecutionProvider: 'gpu_mem_limit' and device.mem_limit=100 both limit the CUDA arena, "
     "got 200; set one of them; provider_options.CUDAExecutionProvider: 'user_compute_stream' is set by the "
     "trainer (from device.id, and the stream the trainer owns), got '0'"),
    # every failing field, sorted by path
    ({"utils": {"grad_norm_clip": "yes", "max_cached_graphs": 0}, "device": {"id": "tpu"}, "batch": []},
     "batch: must be a dict, got [] (list); "
     "device.id: must be 'cpu', 'cuda' or 'cuda:N' (N a device index), got 'tpu'; "
     "utils.grad_norm_clip: must be a bool, got 'yes' (str); utils.max_cached_graphs: must be >= 1, got 0"),
])
def test_options_invalid(options, message):
    with pytest.raises(ValueError, match=f"^{re.escape('Invalid options: ' + message)}$"):
        ORTTrainerOptions(options)


@pytest.mark.parametrize("options", [[], "cpu", ORTTrainerOptions], ids=["list", "str", "class"])
def test_options_not_a_dict(options):
    with pytest.raises(TypeError, match=f"^Invalid options: expected a dict, got {type(options).__name__}$"):
        ORTTrainerOptions(options)


# A non-default value for every gated option; kept in step with _NOT_YET_SUPPORTED by the test below.
NON_DEFAULT = {
    "distributed.data_parallel_size": 2,
    "distributed.horizontal_parallel_size": 2,
    "distributed.pipeline_parallel.pipeline_parallel_size": 2,
    "distributed.pipeline_parallel.num_pipeline_micro_batches": 2,
    "distributed.pipeline_parallel.pipeline_cut_info_string": "1,2",
    "distributed.pipeline_parallel.sliced_schema": {"x": [0]},
    "distributed.pipeline_parallel.sliced_axes": {"x": 0},
    "distributed.pipeline_parallel.sliced_tensor_names": ["x"],
    "distributed.enable_adasum": True,
    "graph_transformer.allow_layer_norm_mod_precision": True,
    "graph_transformer.propagate_cast_ops_config.strategy": "FLOOD_FILL",
    "graph_transformer.propagate_cast_ops_config.level": 1,
    "graph_transformer.propagate_cast_ops_config.allow": ["Add"],
    "utils.invertible_layer_norm_gradient": True,
    "utils.memory_efficient_gradient": True,
    "_internal_use.enable_internal_postprocess": False,
    "_internal_use.extra_postprocess": print,
}


def _nested(path, value):
    for key in reversed(path.split(".")):
        value = {key: value}
    return value


def test_not_yet_supported_table_is_covered():
    assert NON_DEFAULT.keys() == _NOT_YET_SUPPORTED.keys()


@pytest.mark.parametrize("path", sorted(_NOT_YET_SUPPORTED))
def test_not_yet_supported(path):
    value = NON_DEFAULT[path]
    message = f"Option(s) not supported yet: {path}={value!r} ({_NOT_YET_SUPPORTED[path]})"
    with pytest.raises(NotImplementedError, match=f"^{re.escape(message)}$"):
        ORTTrainerOptions(_nested(path, value))


def test_not_yet_supported_lists_every_option_sorted():
    options = {"utils": {"memory_efficient_gradient": True}, "distributed": {"enable_adasum": True},
               "graph_transformer": {"allow_layer_norm_mod_precision": True}}
    message = ("Option(s) not supported yet: distributed.enable_adasum=True (Adasum), "
               "graph_transformer.allow_layer_norm_mod_precision=True (LayerNorm in reduced precision; mixed precision "
               "keeps it fp32), "
               "utils.memory_efficient_gradient=True (memory-efficient gradient)")
    with pytest.raises(NotImplementedError, match=f"^{re.escape(message)}$"):
        ORTTrainerOptions(options)


@pytest.mark.parametrize("strategy", [PropagateCastOpsStrategy.INSERT_AND_REDUCE, "INSERT_AND_REDUCE",
                                      onnxruntime.training.PropagateCastOpsStrategy.INSERT_AND_REDUCE],
                         ids=["ours", "name", "onnxruntime"])
def test_cast_strategy_is_taken_as_the_original_enum_or_its_name(strategy):
    """The original took ONNX Runtime's enum; it reads back as the member's name, a plain str (checkpoints
    keep the options as plain values)."""
    options = ORTTrainerOptions({"graph_transformer": {"propagate_cast_ops_config": {"strategy": strategy}}})
    assert type(options.graph_transformer.propagate_cast_ops_config.strategy) is str
    assert options._validated_opts == DEFAULT_OPTIONS


@pytest.mark.parametrize("strategy", [PropagateCastOpsStrategy.FLOOD_FILL,
                                      onnxruntime.training.PropagateCastOpsStrategy.FLOOD_FILL],
                         ids=["ours", "onnxruntime"])
def test_a_cast_strategy_other_than_the_default_is_refused_by_name(strategy):
    message = ("Option(s) not supported yet: graph_transformer.propagate_cast_ops_config.strategy='FLOOD_FILL' "
               f"({_NOT_YET_SUPPORTED['graph_transformer.propagate_cast_ops_config.strategy']})")
    with pytest.raises(NotImplementedError, match=f"^{re.escape(message)}$"):
        ORTTrainerOptions({"graph_transformer": {"propagate_cast_ops_config": {"strategy": strategy}}})


def test_not_yet_supported_accepts_defaults_spelled_out():
    spelled_out = {"mixed_precision": {"enabled": False}, "lr_scheduler": None, "distributed": {"world_size": 1},
                   "utils": {"memory_efficient_gradient": False}}
    assert ORTTrainerOptions(spelled_out)._validated_opts == DEFAULT_OPTIONS


def test_invalid_values_are_reported_before_unsupported_ones():
    with pytest.raises(ValueError, match=r"^Invalid options: utils\.max_cached_graphs: must be >= 1, got 0$"):
        ORTTrainerOptions({"mixed_precision": {"enabled": True}, "utils": {"max_cached_graphs": 0}})


# ---------------------------------------------------------------- model description

def test_model_desc_normalized():
    desc = parse_model_desc({
        "inputs": [("src", ["bptt", "batch"]), ["label", ["bptt_x_batch"], "int64"], ("mask", [4, 4], torch.bool)],
        "outputs": [("loss", [], True), ("output", ["bptt", "batch", 28785])],
    })
    assert desc == ModelDescription(
        inputs=(InputDescription("src", ("bptt", "batch")), InputDescription("label", ("bptt_x_batch",), torch.int64),
                InputDescription("mask", (4, 4), torch.bool)),
        outputs=(OutputDescription("loss", (), True), OutputDescription("output", ("bptt", "batch", 28785), False)),
    )
    assert desc.loss_index == 0
    assert desc.input_names == ("src", "label", "mask")
    assert desc.output_names == ("loss", "output")


def test_model_desc_loss_not_first():
    desc = parse_model_desc({"inputs": (("x", [2]),), "outputs": (("y", [2]), ("loss", [], True), ("z", [1], False))})
    assert desc.loss_index == 1
    assert desc.outputs[0].is_loss is False


@pytest.mark.parametrize("name", ["bfloat16", "bool", "float16", "float32", "float64", "int8", "int32", "int64",
                                  "uint8"])
def test_model_desc_dtype_names(name):
    desc = parse_model_desc({"inputs": [("x", [1], name)], "outputs": [("loss", [], True)]})
    assert desc.inputs[0].dtype is getattr(torch, name)


def test_model_desc_round_trip():
    desc = parse_model_desc({"inputs": [("x", ["batch", 3], "float16")], "outputs": [("loss", [], True)]})
    assert parse_model_desc({"inputs": desc.inputs, "outputs": desc.outputs}) == desc


def test_model_desc_is_frozen():
    desc = parse_model_desc({"inputs": [("x", [1])], "outputs": [("loss", [], True)]})
    with pytest.raises(AttributeError):
        desc.inputs = ()


GOOD_OUTPUTS = [("loss", [], True)]


@pytest.mark.parametrize("desc, message", [
    ({"inputs": [("x", [1])]}, "outputs: required field"),
    ({"inputs": [("x", [1])], "outputs": GOOD_OUTPUTS, "inputz": []},
     "inputz: unknown field (allowed: inputs, outputs)"),
    ({"inputs": [], "outputs": GOOD_OUTPUTS}, "inputs: must have at least 1 item(s), got 0"),
    ({"inputs": ("x", [1]), "outputs": GOOD_OUTPUTS},
     "inputs[0]: must be a (name, shape) or (name, shape, dtype) tuple, got 'x' (str); "
     "inputs[1]: must be a (name, shape) or (name, shape, dtype) tuple, got [1] (list)"),
    ({"inputs": [("x",)], "outputs": GOOD_OUTPUTS},
     "inputs[0]: must be a (name, shape) or (name, shape, dtype) tuple, got ('x',) (tuple)"),
    ({"inputs": [("x", [1], "float32", 0)], "outputs": GOOD_OUTPUTS},
     "inputs[0]: must be a (name, shape) or (name, shape, dtype) tuple, got ('x', [1], 'float32', 0) (tuple)"),
    ({"inputs": [(0, [1])], "outputs": GOOD_OUTPUTS}, "inputs[0].name: must be a str, got 0 (int)"),
    ({"inputs": [("", [1])], "outputs": GOOD_OUTPUTS}, "inputs[0].name: must not be empty"),
    ({"inputs": [("x", 3)], "outputs": GOOD_OUTPUTS}, "inputs[0].shape: must be a list, got 3 (int)"),
    ({"inputs": [("x", "batch")], "outputs": GOOD_OUTPUTS}, "inputs[0].shape: must be a list, got 'batch' (str)"),
    ({"inputs": [("x", [0, -1, True, 1.5, ""])], "outputs": GOOD_OUTPUTS},
     "inputs[0].shape[0]: must be >= 1, got 0; inputs[0].shape[1]: must be >= 1, got -1; "
     "inputs[0].shape[2]: must be an int or a str, got True (bool); "
     "inputs[0].shape[3]: must be an int or a str, got 1.5 (float); "
     "inputs[0].shape[4]: must not be empty"),
    ({"inputs": [("x", [1], "float8")], "outputs": GOOD_OUTPUTS},
     f"inputs[0].dtype: must be a torch.dtype or one of {DTYPES}, got 'float8'"),
    ({"inputs": [("x", [1], torch.complex64)], "outputs": GOOD_OUTPUTS},
     f"inputs[0].dtype: must be a torch.dtype or one of {DTYPES}, got torch.complex64"),
    ({"inputs": [("x", [1], True)], "outputs": GOOD_OUTPUTS},
     f"inputs[0].dtype: must be a torch.dtype or one of {DTYPES}, got True"),
    ({"inputs": [("x", [1]), ("y", [1]), ("x", [2])], "outputs": GOOD_OUTPUTS},
     "inputs: names must be unique, got 'x' more than once"),
    ({"inputs": [("x", [1])], "outputs": [("loss", [], True), ("loss", [1])]},
     "outputs: names must be unique, got 'loss' more than once"),
    ({"inputs": [("x", [1])], "outputs": [("loss", [])]},
     "outputs: exactly one output must have is_loss=True, got none"),
    ({"inputs": [("x", [1])], "outputs": [("loss", [], True), ("aux", [], True)]},
     "outputs: exactly one output must have is_loss=True, got 2: 'loss', 'aux'"),
    ({"inputs": [("x", [1])], "outputs": [("loss", [], 1)]}, "outputs[0].is_loss: must be a bool, got 1 (int)"),
    ({"inputs": [("x", [1])], "outputs": [("loss", [], True), ("y", [1], None)]},
     "outputs[1].is_loss: must not be None"),
    ({"inputs": [("x", [1])], "outputs": [("loss", [], None)]},
     "outputs[0].is_loss: must not be None"),
    ({"inputs": [("x", [1])], "outputs": [("loss", [], True), "y"]},
     "outputs[1]: must be a (name, shape) or (name, shape, is_loss) tuple, got 'y' (str)"),
    ({"inputs": None, "outputs": None}, "inputs: must not be None; outputs: must not be None"),
])
def test_model_desc_invalid(desc, message):
    with pytest.raises(ValueError, match=f"^{re.escape('Invalid model_desc: ' + message)}$"):
        parse_model_desc(desc)


@pytest.mark.parametrize("desc", [[("x", [1])], None], ids=["list", "None"])
def test_model_desc_not_a_dict(desc):
    with pytest.raises(TypeError, match=f"^Invalid model_desc: expected a dict, got {type(desc).__name__}$"):
        parse_model_desc(desc)


# ---------------------------------------------------------------- schema loading

@pytest.mark.parametrize("name", ["options", "model_desc", "optim_sgd", "optim_adam", "optim_lamb"])
def test_load_schema_returns_a_fresh_copy(name):
    schema = load_schema(name)
    schema.clear()
    assert load_schema(name)


@pytest.mark.parametrize("path", ["graphs/", "."], ids=["trailing-separator", "existing-directory"])
def test_a_graph_save_path_naming_a_directory_is_refused(path):
    with pytest.raises(ValueError, match=re.escape(
            f"Invalid options: debug.graph_save_paths.eval_model_path: must be a file path, got '{path}' "
            "(a directory)")):
        ORTTrainerOptions({"debug": {"graph_save_paths": {"eval_model_path": path}}})
