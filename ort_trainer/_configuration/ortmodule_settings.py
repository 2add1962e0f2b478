"""ORTModule's settings: `DebugOptions`, `LogLevel`, and the `ORTMODULE_*` environment variables
of ONNX Runtime's ORTModule (read once, when an ORTModule is created; the variables win over
DebugOptions, as in the original).

Implemented: ORTMODULE_ONNX_OPSET_VERSION, ORTMODULE_FALLBACK_POLICY, ORTMODULE_LOG_LEVEL,
ORTMODULE_SAVE_ONNX_PATH, ORTMODULE_ENABLE_COMPUTE_OPTIMIZER, ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER
(1, the default, with the compute optimizer on: `_graph.label_sparsity` where forward() returns a loss,
its logits too in fp32), ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER (1, the default, with the compute optimizer
on: `_graph.embedding_sparsity`), ORTMODULE_DISABLE_CUSTOM_AUTOGRAD_SUPPORT (1: a model computed through custom
autograd.Functions is refused, so it runs in PyTorch), ORTMODULE_MEMORY_OPT_LEVEL (0, or 1: the
model's layers recomputed in the backward, `_graph.recompute.module_groups`; 2 refused),
ORTMODULE_PRINT_INPUT_DENSITY (1: `ortmodule._density`'s report), ORTMODULE_PRINT_MEMORY_STATS (1: each
graph's largest tensors and first forward's and backward's peak memory, logged), ORTMODULE_CACHE_DIR (the
exported-model cache on disk, `_compile.module_cache`; a directory that cannot be written is refused). The others
of the original are accepted at the value that matches what this ORTModule does and refused, by
name, at any value that asks for a feature it lacks (`_REFUSED`); other `ORTMODULE_*` variables get
a warning that they are not read.
"""
import enum
import os
import warnings
from dataclasses import dataclass

from .validation import directory_problem

_OPSETS = range(14, 18)  # those our symbolics and graph fixes are tested on (ORTTrainer's range)
DEFAULT_OPSET = 14

# Variable -> (value that matches this ORTModule, why any other value is refused).
_REFUSED = {
    "ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT": ("1", "torch.utils.checkpoint always runs inside the graph here, its "
                                                "segments recomputed in the backward"),
    "ORTMODULE_SKIPPED_AUTOGRAD_FUNCTIONS": ("", "every custom torch.autograd.Function runs its own forward and "
                                             "backward inside the graph: inlining one would differentiate its "
                                             "forward instead of running its backward"),
    "ORTMODULE_ENABLE_SPARSE_OPTIMIZER": ("0", "the input-sparsity optimizations of this older switch have a switch "
                                          "each here: ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER and "
                                          "ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER, both on by default"),
}
_READ = {"ORTMODULE_ONNX_OPSET_VERSION", "ORTMODULE_FALLBACK_POLICY", "ORTMODULE_LOG_LEVEL",
         "ORTMODULE_SAVE_ONNX_PATH", "ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", "ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER",
         "ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER", "ORTMODULE_DISABLE_CUSTOM_AUTOGRAD_SUPPORT",
         "ORTMODULE_MEMORY_OPT_LEVEL", "ORTMODULE_PRINT_INPUT_DENSITY", "ORTMODULE_PRINT_MEMORY_STATS", "ORTMODULE_CACHE_DIR",
         *_REFUSED}


class LogLevel(enum.IntEnum):
    """How much ORTModule and ONNX Runtime say (ONNX Runtime's severities)."""

    VERBOSE = 0
    INFO = 1
    WARNING = 2
    ERROR = 3
    FATAL = 4


class DebugOptions:
    """ORTModule's debugging options, as in ONNX Runtime's ORTModule.

    Args:
        log_level: a `LogLevel`; ORTMODULE_LOG_LEVEL (a LogLevel name) wins over it. At INFO and
            below, one line per compiled graph (what was exported, how long it took) to the
            `ort_trainer.ortmodule` logger, and ONNX Runtime's own info (VERBOSE: verbose) logs;
            at WARNING (the default) ONNX Runtime prints its errors only.
        save_onnx: write the ONNX models of every compiled graph (`<onnx_prefix>_<stage>_<mode>.onnx`,
            stage `torch_exported`, `optimized_pre_grad` (training only), `optimized`, `execution_model`; mode
            `training` or `inference`) into ORTMODULE_SAVE_ONNX_PATH, default the working directory.
            A later graph of the same mode overwrites them.
        onnx_prefix: the file name prefix; required with save_onnx.
    """

    def __init__(self, log_level=LogLevel.WARNING, save_onnx=False, onnx_prefix=""):
        if not isinstance(log_level, LogLevel):
            raise TypeError(f"DebugOptions: log_level must be a LogLevel, got {log_level!r}")
        if not isinstance(save_onnx, bool):
            raise TypeError(f"DebugOptions: save_onnx must be a bool, got {save_onnx!r}")
        if not isinstance(onnx_prefix, str):
            raise TypeError(f"DebugOptions: onnx_prefix must be a str, got {onnx_prefix!r}")
        if save_onnx and not onnx_prefix:
            raise ValueError("DebugOptions: save_onnx=True needs an onnx_prefix (the saved files' name prefix), "
                             "got ''")
        self.log_level = log_level
        self.save_onnx = save_onnx
        self.onnx_prefix = onnx_prefix


class FallbackPolicy(enum.IntFlag):
    """ORTMODULE_FALLBACK_POLICY's names: which failures to compile a graph run the PyTorch model
    instead (with a warning); FALLBACK_DISABLE raises them. The default is the four kinds."""

    FALLBACK_DISABLE = 1
    FALLBACK_FORCE_TORCH_FORWARD = 2
    FALLBACK_UNSUPPORTED_DEVICE = 8
    FALLBACK_UNSUPPORTED_DATA = 16
    FALLBACK_UNSUPPORTED_TORCH_MODEL = 32
    FALLBACK_UNSUPPORTED_ONNX_MODEL = 64


DEFAULT_FALLBACK = (FallbackPolicy.FALLBACK_UNSUPPORTED_DEVICE | FallbackPolicy.FALLBACK_UNSUPPORTED_DATA
                    | FallbackPolicy.FALLBACK_UNSUPPORTED_TORCH_MODEL | FallbackPolicy.FALLBACK_UNSUPPORTED_ONNX_MODEL)
_NOT_HERE = {"FALLBACK_FORCE_TORCH_BACKWARD": "a backward never falls back here (its forward ran in ONNX Runtime)",
             "FALLBACK_BAD_INITIALIZATION": "creating an ORTModule does no work that could fail"}


@dataclass(frozen=True)
class Settings:
    """Everything one ORTModule reads from DebugOptions and the environment."""

    log_level: LogLevel
    opset: int
    fallback: FallbackPolicy
    compute_optimizer: bool
    label_sparsity: bool  # `_graph.label_sparsity`: the compute optimizer and the label-sparsity switch on
    embedding_sparsity: bool  # `_graph.embedding_sparsity`: the compute optimizer and its switch on
    custom_functions: bool  # custom autograd.Functions run in the graph (else the model is refused: fallback)
    save_directory: str | None  # None: save nothing
    onnx_prefix: str
    layer_recompute: bool  # ORTMODULE_MEMORY_OPT_LEVEL=1
    input_density: bool  # ORTMODULE_PRINT_INPUT_DENSITY=1: `ortmodule._density`
    memory_stats: bool  # ORTMODULE_PRINT_MEMORY_STATS=1: `_compile.module_compiler`
    cache_directory: str | None = None  # ORTMODULE_CACHE_DIR: `_compile.module_cache`; None: no cache

    @property
    def ort_severity(self):
        """ONNX Runtime's log severity: at the default WARNING its errors only (its warnings are
        about its own graph passes, e.g. nodes no gradient flows through); VERBOSE and INFO show
        its verbose and info logs."""
        return LogLevel.ERROR if self.log_level == LogLevel.WARNING else self.log_level

    def falls_back(self, kind):
        """Whether a failure of `kind` (a FallbackPolicy member) runs PyTorch instead of raising."""
        if FallbackPolicy.FALLBACK_DISABLE in self.fallback:
            return False
        return FallbackPolicy.FALLBACK_FORCE_TORCH_FORWARD in self.fallback or kind in self.fallback


def settings(debug_options, environ=os.environ):
    """The Settings of DebugOptions (or None) under `environ`; every bad value raises, naming it."""
    if debug_options is None:
        debug_options = DebugOptions()
    elif not isinstance(debug_options, DebugOptions):
        raise TypeError(f"ORTModule: debug_options must be a DebugOptions or None, got {type(debug_options).__name__}")
    for name, (accepted, why) in _REFUSED.items():
        value = environ.get(name)
        if value is not None and value.strip() != accepted:
            raise ValueError(f"{name}={value!r} is not supported by ort_trainer's ORTModule: {why} "
                             f"(unset it, or set it to {accepted!r})")
    unknown = sorted(name for name in environ if name.startswith("ORTMODULE_") and name not in _READ)
    if unknown:
        warnings.warn(f"ORTModule: environment variables {unknown} are not read by ort_trainer's ORTModule "
                      f"(it reads {sorted(_READ)})")
    save_directory = None
    if debug_options.save_onnx:
        save_directory = environ.get("ORTMODULE_SAVE_ONNX_PATH") or os.getcwd()
        if not os.path.isdir(save_directory) or not os.access(save_directory, os.W_OK):
            raise ValueError(f"ORTModule: ORTMODULE_SAVE_ONNX_PATH={save_directory!r} must be a writable directory "
                             "for DebugOptions(save_onnx=True)")
    return Settings(log_level=_log_level(environ, debug_options.log_level), opset=_opset(environ),
                    fallback=_fallback(environ), compute_optimizer=_flag(environ, "ORTMODULE_ENABLE_COMPUTE_OPTIMIZER"),
                    label_sparsity=(_flag(environ, "ORTMODULE_ENABLE_COMPUTE_OPTIMIZER")
                                    and _flag(environ, "ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER")),
                    embedding_sparsity=(_flag(environ, "ORTMODULE_ENABLE_COMPUTE_OPTIMIZER")
                                        and _flag(environ, "ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER")),
                    custom_functions=not _flag(environ, "ORTMODULE_DISABLE_CUSTOM_AUTOGRAD_SUPPORT", default="0"),
                    save_directory=save_directory, onnx_prefix=debug_options.onnx_prefix,
                    layer_recompute=_memory_opt_level(environ) == 1,
                    input_density=_flag(environ, "ORTMODULE_PRINT_INPUT_DENSITY", default="0"),
                    memory_stats=_flag(environ, "ORTMODULE_PRINT_MEMORY_STATS", default="0"),
                    cache_directory=_cache_directory(environ))


def _cache_directory(environ):
    """ORTMODULE_CACHE_DIR: a directory the cache can write (created on the first write), or None."""
    value = environ.get("ORTMODULE_CACHE_DIR")
    if not value:
        return None
    problem = directory_problem(value)
    if problem is not None:
        raise ValueError(f"ORTMODULE_CACHE_DIR={value!r} must be a directory ORTModule can write its graph cache to "
                         f"(it is created if missing): {problem}")
    return os.path.abspath(value)


def _log_level(environ, default):
    value = environ.get("ORTMODULE_LOG_LEVEL")
    if value is None:
        return default
    if value not in LogLevel.__members__:
        raise ValueError(f"ORTMODULE_LOG_LEVEL={value!r} must be one of {list(LogLevel.__members__)}")
    return LogLevel[value]


def _opset(environ):
    value = environ.get("ORTMODULE_ONNX_OPSET_VERSION")
    if value is None:
        return DEFAULT_OPSET
    if not value.strip().isdigit() or int(value) not in _OPSETS:
        raise ValueError(f"ORTMODULE_ONNX_OPSET_VERSION={value!r} must be an ONNX opset from {_OPSETS.start} to "
                         f"{_OPSETS.stop - 1}")
    return int(value)


def _memory_opt_level(environ):
    """ORTMODULE_MEMORY_OPT_LEVEL: 0 (the default) or 1 (TRANSFORMER_LAYERWISE_RECOMPUTE)."""
    value = environ.get("ORTMODULE_MEMORY_OPT_LEVEL", "0")
    if value.strip() == "2":
        raise ValueError("ORTMODULE_MEMORY_OPT_LEVEL='2' is not supported by ort_trainer's ORTModule: "
                         "TRANSFORMER_LAYERWISE_RECOMPUTE_WITH_COMPROMISE (ONNX Runtime's memory optimizer's "
                         "compromised subgraphs) is not implemented; use 0 (off) or 1 (layer-wise recompute)")
    if value.strip() not in ("0", "1"):
        raise ValueError(f"ORTMODULE_MEMORY_OPT_LEVEL={value!r} must be 0 (off) or 1 (layer-wise recompute)")
    return int(value)


def _fallback(environ):
    """ORTMODULE_FALLBACK_POLICY: FallbackPolicy names joined by '|'."""
    value = environ.get("ORTMODULE_FALLBACK_POLICY")
    if value is None:
        return DEFAULT_FALLBACK
    policy = FallbackPolicy(0)
    for name in (part.strip() for part in value.split("|")):
        if name in _NOT_HERE:
            raise ValueError(f"ORTMODULE_FALLBACK_POLICY={value!r}: {name} is not supported: {_NOT_HERE[name]}")
        if name not in FallbackPolicy.__members__:
            raise ValueError(f"ORTMODULE_FALLBACK_POLICY={value!r}: {name!r} is not one of "
                             f"{list(FallbackPolicy.__members__)} (join several with '|')")
        policy |= FallbackPolicy[name]
    return policy


def _flag(environ, name, default="1"):
    """A 0/1 variable."""
    value = environ.get(name, default).strip()
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r} must be 0 or 1")
    return value == "1"
