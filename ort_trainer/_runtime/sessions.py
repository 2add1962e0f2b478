"""ONNX Runtime sessions, created one way for both front ends: the providers (on CUDA, the
placement's stream, without ONNX Runtime's end-of-run sync), the session and run options as
`RuntimeSettings` say, the device's memory policy, the provider check, the memory released around
a session's first run, and ONNX Runtime's generator seeded from torch's."""
from __future__ import annotations

import dataclasses
import functools

import onnx
import onnxruntime
import torch
from onnxruntime.capi import _pybind_state as C

from .._configuration.validation import CPU_PROVIDER, CUDA_PROVIDER
from .._onnx import TORCH_NODE_DOMAIN, quiet_session_options
from . import product_speed
from .cuda_requirements import require_cuda_provider
from .memory import memory_policy
from .session_config import cuda_provider_options, provider_options_from, session_options_from
from .._configuration.runtime_settings import RuntimeSettings
from .memory import CpuMemory, CudaMemory
from .placement import Placement
from .torch_ops import register_executor


class Sessions:
    """Creates the sessions of one placement (`placement`) as `settings` (a RuntimeSettings) say.

    `providers`, `run_options` and `quiet_run_options` (a run whose failure is expected and
    handled logs nothing), and `memory` (the device's memory policy) are what every session
    and run of this placement uses."""

    def __init__(self, placement: Placement, settings: RuntimeSettings) -> None:
        self.placement = placement
        self._settings = settings
        ours: list[str | tuple[str, dict[str, str]]] = [CPU_PROVIDER]
        if placement.stream is not None:
            ours.insert(0, (CUDA_PROVIDER, cuda_provider_options(placement.index, placement.stream.cuda_stream)))
        self.providers = provider_options_from(settings, ours)
        # ORT's end-of-run sync is dropped on CUDA: `Placement.step()` orders the streams instead
        config = {} if placement.stream is None else {"disable_synchronize_execution_providers": "1"}
        self.run_options = _run_options(**config)
        self.quiet_run_options = _run_options(log_severity_level=4, **config)
        self.memory = memory_policy(placement.torch_device, settings.mem_limit, self.providers)
        self.faster_in_torch = _products_faster_in_torch(placement, settings)

    def session_options(self, *, priority_order: bool = False, weight_gradients_early: bool = False,
                        torch_nodes: bool = False) -> onnxruntime.SessionOptions:
        """A new SessionOptions of these settings (the user's own object when they gave one);
        `priority_order`: in PRIORITY_BASED order whatever the settings say (a graph with recompute
        copies scheduled for it, `_graph.recompute`). `weight_gradients_early`: in PRIORITY_BASED
        order alone (an ORTModule training graph): ONNX Runtime's default order ran every input
        gradient of the backward before the first weight gradient, holding every layer's output
        gradients and activations until the end (BENCHMARKS.md, gradient checkpointing).
        `torch_nodes`: the graph runs torch kernels (`_runtime.torch_ops`), which bring their own
        outputs, so ONNX Runtime's buffer reuse and memory pattern are off: it planned a node's
        output into a dead tensor's buffer, then held until that output died, and its pattern's one
        block kept room for the torch nodes' outputs too (ORTModule at a step's peak, MiB above the
        model: 8 MLP blocks 1,949 with both, 1,683 without reuse, 1,598 without either, eager 1,639;
        a 12-layer GPT-2 3,299 without reuse, 2,105 without either, eager 2,279; speed unchanged)."""
        options = quiet_session_options()
        if torch_nodes:
            options.enable_mem_reuse = options.enable_mem_pattern = False
        if weight_gradients_early:
            options.execution_order = onnxruntime.ExecutionOrder.PRIORITY_BASED
        options.log_severity_level = self._settings.log_severity
        options.intra_op_num_threads = self._settings.threads
        options.use_deterministic_compute = self._settings.deterministic
        # Idle ORT workers block instead of spinning: each step runs torch's clip + optimizer on
        # the same cores right after the graph, and spinning workers starve them (benchmarks/).
        entries = {"session.intra_op.allow_spinning": "0", **self.memory.config_entries()}
        for key, value in entries.items():
            options.add_session_config_entry(key, value)
        settings = dataclasses.replace(self._settings, priority_order=True) if priority_order else self._settings
        return session_options_from(settings, options, entries)

    def create(self, model: bytes, *, optimized_model_path: str | None = None, priority_order: bool = False,
               weight_gradients_early: bool = False) -> onnxruntime.InferenceSession:
        """An InferenceSession of `model` (serialized). A CUDA session ONNX Runtime silently built
        for the CPU (its CUDA provider library failed to load) would fail later, obscurely, on
        device pointers: refused here, by name. `optimized_model_path`: where ONNX Runtime writes
        the graph it runs (debugging); `priority_order`, `weight_gradients_early`: see `session_options`."""
        torch_nodes = _runs_torch_nodes(model)  # the graph runs torch kernels (`_runtime.torch_ops`)
        options = self.session_options(priority_order=priority_order, weight_gradients_early=weight_gradients_early,
                                       torch_nodes=torch_nodes)
        if optimized_model_path is not None:
            options.optimized_model_filepath = optimized_model_path
        if torch_nodes:
            if options.execution_mode == onnxruntime.ExecutionMode.ORT_PARALLEL:
                raise ValueError("Invalid options: session_options.execution_mode=ORT_PARALLEL cannot run this graph: "
                                 "it runs torch kernels inside ONNX Runtime, which would wait on the Python lock "
                                 "held by the run; use ORT_SEQUENTIAL (the default)")
            register_executor()
        session = onnxruntime.InferenceSession(model, options, providers=self.providers)
        if self.placement.stream is not None:
            require_cuda_provider(session.get_providers())
        return session

    def first_run(self) -> FirstRun:
        """A new session's `FirstRun`."""
        return FirstRun(self.memory)


class FirstRun:
    """A session's first run allocates tensor by tensor (ONNX Runtime records its memory pattern;
    a graph with torch nodes has none), later ones take one planned block: the device's cached
    memory is released before the first run
    (`begin`: it runs on the memory in use, not on another session's free block) and after it
    (`end`: the process holds one of the two). No-ops once the first run has ended."""

    def __init__(self, memory: CpuMemory | CudaMemory) -> None:
        self._memory, self.pending = memory, True

    def begin(self) -> None:
        if self.pending:
            self._memory.release_cached_memory()

    def end(self) -> None:
        if self.pending:
            self._memory.release_cached_memory()
            self.pending = False


def seed_random_ops() -> None:
    """Seeds ONNX Runtime's generator from torch's before a run that draws random numbers (dropout).

    Why: ORT's CPU Dropout seeds a minstd engine with its generator's next seed, one more per
    call, from the process seed, which torch.manual_seed(s) also sets: seeds 0 and 1 give that
    engine the same state, so the first two dropout calls after manual_seed(0) shared a mask.
    A fresh seed from torch's generator per run gives every run masks of its own, reproducible
    under torch.manual_seed, as torch's dropout is."""
    C.set_seed(int(torch.randint(1, _SEEDS, ())))


_SEEDS = 2**31 - 2**16  # minstd's modulus is 2**31 - 1; a run's nodes take the seeds after its own


def _run_options(log_severity_level=None, **config):
    options = onnxruntime.RunOptions()
    if log_severity_level is not None:
        options.log_severity_level = log_severity_level
    for key, value in config.items():
        options.add_run_config_entry(key, value)
    return options


def _products_faster_in_torch(placement, settings):
    """Which fp32 products of this placement's graphs run in torch (`_graph.cpu_products`): on the
    CPU, those torch computes faster here (`product_speed`, at the sessions' thread count). None on
    CUDA, under deterministic compute (a close measurement could decide differently next run) and
    under the user's ORT_PARALLEL execution (it cannot run torch nodes)."""
    user = settings.session_options
    if placement.stream is not None or settings.deterministic or (user is not None and (
            user.use_deterministic_compute or user.execution_mode == onnxruntime.ExecutionMode.ORT_PARALLEL)):
        return None
    threads = (user.intra_op_num_threads if user is not None else 0) or settings.threads
    return functools.partial(product_speed.torch_product_faster, threads=threads)


def _runs_torch_nodes(model):
    """Whether the serialized `model` has a torch node. Their domain is imported by graphs with none
    (the exporter imports it): its name in the bytes alone refused ORT_PARALLEL for every graph."""
    return (TORCH_NODE_DOMAIN.encode() in model
            and any(node.domain == TORCH_NODE_DOMAIN for node in onnx.load_from_string(model).graph.node))
