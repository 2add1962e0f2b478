"""What ONNX Runtime sessions are created with, whichever front end creates them: ORTTrainer's
options, or ORTModule's device and debug settings, become one `RuntimeSettings`."""
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from .options import recomputes

_ORT_ERRORS_ONLY = 3


@dataclass(frozen=True)
class RuntimeSettings:
    """device: 'cpu', 'cuda' or 'cuda:N'. threads: intra-op threads (torch's count). deterministic:
    ONNX Runtime's deterministic kernels. mem_limit: bytes of the shared arena (0: no limit).
    provider_options: {provider: {option: value}} merged into ours. session_options: the user's
    onnxruntime.SessionOptions (the original's `session_options`), or None. priority_order: run
    nodes in PRIORITY_BASED order (recomputation schedules its copies so). log_severity: ONNX
    Runtime's severity for the sessions' logs."""

    device: str = "cpu"
    threads: int = 1
    deterministic: bool = False
    mem_limit: int = 0
    provider_options: Mapping = field(default_factory=lambda: MappingProxyType({}))
    session_options: object = None
    priority_order: bool = False
    log_severity: int = _ORT_ERRORS_ONLY

    @classmethod
    def of_trainer(cls, options, threads):
        """ORTTrainer's: from its ORTTrainerOptions, `threads` intra-op threads."""
        return cls(device=options.device.id, threads=threads, deterministic=options.debug.deterministic_compute,
                   mem_limit=options.device.mem_limit, provider_options=MappingProxyType(dict(options.provider_options)),
                   session_options=options.session_options, priority_order=recomputes(options.graph_transformer))
