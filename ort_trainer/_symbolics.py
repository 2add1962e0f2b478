"""TorchScript-exporter symbolics for aten ops it lacks, registered once per process."""
import functools


@functools.cache
def register_symbolics():
    """Registers our symbolics (idempotent; called before every export)."""
