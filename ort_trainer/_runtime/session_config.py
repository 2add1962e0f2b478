"""ONNX Runtime settings the user gives (`RuntimeSettings`): the session options, the execution
providers' options, the shared arenas' limits; and the debug graphs (ORTTrainer's
``debug.graph_save_paths``, ORTModule's ``DebugOptions(save_onnx=True)``).

Our own settings (threads, spinning, opting in to the shared arena) are `Sessions`'; the functions
here layer the user's over them.
"""
import os
import tempfile

import onnxruntime
import torch

from .._checkpoint_files import atomic_write
from .._configuration.validation import CUDA_PROVIDER

# onnxruntime.SessionOptions attributes; where the user's object keeps ORT's default, ours apply.
_SESSION_ATTRIBUTES = (
    "enable_cpu_mem_arena", "enable_mem_pattern", "enable_mem_reuse", "enable_profiling", "execution_mode",
    "execution_order", "graph_optimization_level", "inter_op_num_threads", "intra_op_num_threads",
    "log_severity_level", "log_verbosity_level", "logid", "optimized_model_filepath", "profile_file_prefix",
)
USE_ENV_ALLOCATORS = "session.use_env_allocators"  # a session config entry: the shared arena
_DISABLED_OPTIMIZERS = "optimization.disable_specified_optimizers"
# Off with recomputation: once the backward reads a LayerNormalization's input from a recompute copy,
# ORT 1.19 fuses the residual Add and the LayerNormalization into a SkipLayerNormalization, and the
# LayerNormalizationGrad then finds its saved mean unset at run time ("Missing Input: saved_mean").
_OFF_WITH_RECOMPUTE = "SkipLayerNormFusion"


def _config_entry(session_options, key):
    """The value of a session config entry, or None when it is not set."""
    try:
        return session_options.get_session_config_entry(key)
    except RuntimeError:  # ORT: "SessionOptions does not have configuration with key"
        return None


def session_options_from(settings, base, entries):
    """The ``onnxruntime.SessionOptions`` a session is created with (`settings`: RuntimeSettings).

    ``settings.session_options`` has the original ORTTrainer's meaning, the SessionOptions the
    sessions use: everything set on it applies (attributes, config entries, initializers, custom
    op libraries). ``base`` holds our settings (``Sessions.session_options()``), ``entries`` our
    session config entries (set on ``base``: ONNX Runtime cannot list them); they are written
    into the user's object where it keeps ONNX Runtime's default, so a user's
    ``intra_op_num_threads`` wins over ours. ``use_deterministic_compute`` is on if either asks
    for it. Without ``settings.session_options``, ``base`` is returned as it is.

    The user's object is updated in place (config entries cannot be copied to a new one: ORT
    cannot list them); sessions copy it when they are created.

    With ``settings.priority_order`` (a recompute option on), the sessions run their nodes in
    PRIORITY_BASED order, as the original's did then (and as `_graph.recompute` schedules the
    copies), without SkipLayerNormFusion
    (added to the user's ``optimization.disable_specified_optimizers``, if any).

    Raises:
        ValueError: ``device.mem_limit`` limits the shared CPU arena, which the user's
            ``enable_cpu_mem_arena=False`` turns off.
    """
    recompute = settings.priority_order
    if recompute:
        base.execution_order = onnxruntime.ExecutionOrder.PRIORITY_BASED
        base.add_session_config_entry(_DISABLED_OPTIMIZERS, _OFF_WITH_RECOMPUTE)
    user = settings.session_options
    if user is None:
        return base
    arena_off = not user.enable_cpu_mem_arena
    if arena_off and settings.mem_limit and settings.device == "cpu":
        raise ValueError(f"Invalid options: device.mem_limit={settings.mem_limit} limits ONNX Runtime's CPU "
                         "arena, but session_options.enable_cpu_mem_arena is False (no arena); drop one of them")
    fresh = onnxruntime.SessionOptions()
    for name in _SESSION_ATTRIBUTES:
        if getattr(user, name) == getattr(fresh, name):
            setattr(user, name, getattr(base, name))
    user.use_deterministic_compute = user.use_deterministic_compute or base.use_deterministic_compute
    for key, value in entries.items():
        if _config_entry(user, key) is not None or (arena_off and key == USE_ENV_ALLOCATORS):
            continue  # the user's own, or the shared arena the user turned off
        user.add_session_config_entry(key, value)
    disabled = [name for name in (_config_entry(user, _DISABLED_OPTIMIZERS) or "").split(",") if name]
    if recompute and _OFF_WITH_RECOMPUTE not in disabled:
        user.add_session_config_entry(_DISABLED_OPTIMIZERS, ",".join([*disabled, _OFF_WITH_RECOMPUTE]))
    return user


def cuda_provider_options(index, stream):
    """Our CUDA provider options on device `index`, running on the torch stream at `stream` (its
    pointer).

    ``use_tf32`` follows torch's matmul switch as it is now (off by default): ONNX Runtime's
    default multiplies fp32 in TF32, torch's does not, and the parity checks (the re-derived
    graph's proof, ``check_model_export``, ``export_onnx``'s check) compare the two in fp32. The
    switch is read as ``torch.backends.cuda.matmul.fp32_precision``, which ``allow_tf32`` and
    ``torch.set_float32_matmul_precision`` set too (reading ``allow_tf32`` raises once the newer
    API was used). ONNX Runtime has that one switch where torch has two: cuDNN's
    (``torch.backends.cudnn.allow_tf32``, on by default) is not followed, since TF32 where torch
    computes in fp32 breaks parity, fp32 where torch used TF32 does not. The user's own
    ``use_tf32`` in ``provider_options`` wins (`provider_options_from`)."""
    tf32 = torch.backends.cuda.matmul.fp32_precision == "tf32"
    return {"device_id": str(index), "has_user_compute_stream": "1", "user_compute_stream": str(stream),
            "use_tf32": "1" if tf32 else "0"}


def provider_options_from(settings, providers):
    """``providers`` (our list: provider names or ``(name, options)`` pairs) with
    ``settings.provider_options`` merged into the entry of each provider it names, and
    ``settings.mem_limit`` (``device.mem_limit``) as the CUDA provider's ``gpu_mem_limit``.

    The schema has already refused providers the trainer does not run on, the options the trainer
    sets itself, and options for the CPU provider (ONNX Runtime ignores them). Values become
    strings, as ONNX Runtime's Python API passes them.
    """
    extra = {name: dict(values) for name, values in settings.provider_options.items() if values}
    if settings.mem_limit:
        extra.setdefault(CUDA_PROVIDER, {})["gpu_mem_limit"] = settings.mem_limit
    merged = []
    for entry in providers:
        name, values = (entry, {}) if isinstance(entry, str) else entry
        if name in extra:
            values = {**values, **{key: str(value) for key, value in extra[name].items()}}
        merged.append((name, values) if values else name)
    return merged


def cpu_arena_config(mem_limit):
    """The arena config of the shared CPU arena: ``max_mem`` = ``device.mem_limit`` bytes; None
    (ONNX Runtime's defaults) for 0, no limit."""
    return onnxruntime.OrtArenaCfg({"max_mem": mem_limit}) if mem_limit else None


_registered_cpu_arena_limit = None  # device.mem_limit the process's shared CPU arena was created with


def register_shared_cpu_arena(mem_limit):
    """Registers the process's shared CPU arena, limited to ``mem_limit`` bytes (0: no limit), once.

    One CPU arena for all our sessions (train and eval, every shape, every trainer) instead of one
    each: each arena keeps its own peak for the life of its session (BENCHMARKS.md). Sessions opt
    in with ``session.use_env_allocators``, so other ONNX Runtime users in the process are
    unaffected. ONNX Runtime can neither replace nor resize a registered arena, so a trainer asking
    for another limit than the first one's is refused rather than run under the wrong limit.
    """
    global _registered_cpu_arena_limit
    if _registered_cpu_arena_limit is None:
        memory = onnxruntime.OrtMemoryInfo("Cpu", onnxruntime.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                           onnxruntime.OrtMemType.DEFAULT)
        onnxruntime.create_and_register_allocator(memory, cpu_arena_config(mem_limit))
        _registered_cpu_arena_limit = mem_limit
    elif mem_limit != _registered_cpu_arena_limit:
        raise ValueError(f"Invalid options: device.mem_limit={mem_limit}, but this process's CPU arena, shared by "
                         f"every trainer, was created with device.mem_limit={_registered_cpu_arena_limit} by an "
                         "earlier trainer and ONNX Runtime cannot change it; give every trainer the same "
                         "device.mem_limit")


# CUDA provider options that size the arena; the shared one is created with the first trainer's.
_CUDA_ARENA_OPTIONS = ("gpu_mem_limit", "arena_extend_strategy")
_registered_cuda_arenas: dict[int, dict] = {}  # device index -> the arena options it was created with


_EXTEND_STRATEGIES = {"kNextPowerOfTwo": 0, "kSameAsRequested": 1}


def cuda_arena_config(arena):
    """The shared CUDA arena's OrtArenaCfg: ONNX Runtime 1.19 sizes that arena from it, not from the
    provider options, and dereferences it unchecked (None crashed the process on the first GPU
    run). 0 and -1 keep ONNX Runtime's defaults (no limit, doubling growth)."""
    strategy = arena.get("arena_extend_strategy", "-1")
    strategy = _EXTEND_STRATEGIES[strategy] if strategy in _EXTEND_STRATEGIES else int(strategy)
    return onnxruntime.OrtArenaCfg(int(arena.get("gpu_mem_limit", 0)), strategy, -1, -1)


def register_shared_cuda_arena(index, cuda_options):
    """Registers one CUDA arena for device `index`, shared by our sessions there, once.

    `cuda_options`: the sessions' CUDA provider options; their `gpu_mem_limit` (device.mem_limit
    or provider_options) and `arena_extend_strategy` configure the shared arena, since a session on
    it has no arena of its own. A later trainer asking for other settings on that device is
    refused, as for the CPU arena (ONNX Runtime cannot change a registered arena).
    """
    arena = {key: str(cuda_options[key]) for key in _CUDA_ARENA_OPTIONS if key in cuda_options}
    registered = _registered_cuda_arenas.get(index)
    if registered is None:
        memory = onnxruntime.OrtMemoryInfo("Cuda", onnxruntime.OrtAllocatorType.ORT_ARENA_ALLOCATOR, index,
                                           onnxruntime.OrtMemType.DEFAULT)
        onnxruntime.create_and_register_allocator_v2(CUDA_PROVIDER, memory, {"device_id": str(index), **arena},
                                                     cuda_arena_config(arena))
        _registered_cuda_arenas[index] = arena
    elif arena != registered:
        raise ValueError(f"Invalid options: CUDA arena settings {arena} (device.mem_limit, provider_options), but "
                         f"this process's arena on cuda:{index}, shared by every trainer, was created with {registered} "
                         "by an earlier trainer and ONNX Runtime cannot change it; give every trainer the same settings")


# debug.graph_save_paths field -> the graph it writes (the original's names; this library has no
# optimizer in the graph, so its gradient graph and its training graph are the same graph)
_SAVED_GRAPHS = {
    "model_after_graph_transforms_path": "exported",
    "model_with_gradient_graph_path": "training",
    "model_with_training_graph_path": "training",
    "eval_model_path": "evaluation",
}
_OPTIMIZED_PATH = "model_with_training_graph_after_optimization_path"


def save_graphs(paths, *, exported=None, training=None, evaluation=None, session_options=None, providers=None):
    """Writes the graphs ``paths`` (``options.debug.graph_save_paths``) names, each atomically.

    Graphs are bytes or ``onnx.ModelProto``; a graph passed as None, or a path left '', is not
    written. ``exported``: the forward + loss model as exported (``model_after_graph_transforms_path``);
    ``training``: forward + loss + backward with one ``<param>_grad`` output per parameter
    (``model_with_gradient_graph_path`` and ``model_with_training_graph_path``); ``evaluation``:
    the eval graph, dropout off (``eval_model_path``). ``model_with_training_graph_after_optimization_path``
    gets the training graph as ONNX Runtime optimized it for the training session, which is why
    that session's ``session_options`` and ``providers`` are needed with ``training``.

    Every target directory is checked before anything is written.

    Raises:
        FileNotFoundError: a target directory does not exist (the message names the field).
        ValueError: the optimized graph is asked for without ``session_options`` and ``providers``.
    """
    graphs = {"exported": exported, "training": training, "evaluation": evaluation}
    targets = [(f"debug.graph_save_paths.{field}", getattr(paths, field), graphs[graph])
               for field, graph in _SAVED_GRAPHS.items()]
    optimized_path = getattr(paths, _OPTIMIZED_PATH)
    if optimized_path and training is not None:
        if session_options is None or providers is None:
            raise ValueError(f"save_graphs: debug.graph_save_paths.{_OPTIMIZED_PATH} needs the training session's "
                             "session_options and providers")
        targets.append((f"debug.graph_save_paths.{_OPTIMIZED_PATH}", optimized_path,
                        lambda: _optimized(_serialized(training), session_options, providers)))
    write_graphs(targets)


def write_graphs(targets):
    """Writes debug graphs, each atomically: the one writer of ORTTrainer's ``debug.graph_save_paths``
    (`save_graphs`) and ORTModule's ``DebugOptions(save_onnx=True)``.

    ``targets``: ``(setting, path, graph)`` triples; ``setting`` names the option that asked for the
    file, ``graph`` is bytes, an ``onnx.ModelProto`` or a function returning bytes (called once every
    directory has been checked). A target whose path is '' or None, or whose graph is None, is not
    written. Every target directory is checked before anything is written.

    Raises:
        FileNotFoundError: a target directory does not exist (the message names the setting).
    """
    targets = [(setting, path, graph) for setting, path, graph in targets if path and graph is not None]
    for setting, path, _ in targets:
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"{setting}: cannot write {path!r}: directory {directory!r} does not exist")
    for _, path, graph in targets:
        data = graph() if callable(graph) else _serialized(graph)
        atomic_write(path, lambda file, data=data: file.write(data))


def _serialized(graph):
    return graph if isinstance(graph, bytes) else graph.SerializeToString()


def _optimized(model, session_options, providers):
    """``model`` after ONNX Runtime's graph optimizations for these session options and providers:
    what its session runs. ORT writes it only while creating a session, to a file."""
    previous = session_options.optimized_model_filepath
    with tempfile.TemporaryDirectory() as directory:
        session_options.optimized_model_filepath = os.path.join(directory, "optimized.onnx")
        try:
            onnxruntime.InferenceSession(model, session_options, providers=providers)
        finally:
            session_options.optimized_model_filepath = previous
        with open(os.path.join(directory, "optimized.onnx"), "rb") as file:
            return file.read()
