"""The process's peak resident memory during a piece of work (ORTModule's memory stats,
ORTMODULE_PRINT_MEMORY_STATS=1), from Linux's /proc/self: the peak (VmHWM) is reset before the
work, read after, and reported above the resident memory before it."""
import contextlib
from pathlib import Path

_STATUS, _CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def _kib(field):
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


@contextlib.contextmanager
def peak_above_start():
    """Yields a dict whose 'mib' is, after the block, the peak resident memory during it above the
    resident memory at its start (None where /proc does not tell: not Linux)."""
    measured = {"mib": None}
    try:
        _CLEAR_REFS.write_text("5")  # resets VmHWM to the current resident memory
        start = _kib("VmRSS")
    except OSError:
        yield measured
        return
    yield measured
    measured["mib"] = (_kib("VmHWM") - start) / 1024
