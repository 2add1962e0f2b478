"""The host side of the CUDA optimizer kernels' tables: NumPy mirrors of common.cuh's constants and
structs (`OrtGroup`: a param group's range and hyperparameters; `OrtChunk`: a piece of one
tensor), built from a flat layout (`group_table`, `chunk_table`). Pure NumPy: testable without
CuPy or a GPU."""
import numpy as np

from .hyper import HYPER_TYPES, AdamHyper, Hyper, SGDHyper

#: Mirrors of common.cuh's ORT_BLOCK, ORT_CHUNK, ORT_MAX_PARTIALS (checked by the compile test).
BLOCK = 256
CHUNK = 16384
MAX_PARTIALS = 1024

#: common.cuh's ``struct OrtGroup`` (112 bytes) and ``struct OrtChunk`` (24 bytes).
GROUP_DTYPE = np.dtype({"names": ["start", "stop", "d", "f", "flags"],
                        "formats": ["<i8", "<i8", ("<f8", (4,)), ("<f4", (12,)), ("<i4", (4,))],
                        "offsets": [0, 8, 16, 48, 96], "itemsize": 112})
CHUNK_DTYPE = np.dtype({"names": ["start", "stop", "seg", "group"],
                        "formats": ["<i8", "<i8", "<i4", "<i4"],
                        "offsets": [0, 8, 16, 20], "itemsize": 24})

#: Where each hyperparameter sits in OrtGroup: name -> (field, index). Mirrors the
#: ``#define ORT_<FAMILY>_<NAME> <index>  // <field>[<index>]`` lines of each .cu file.
GROUP_FIELDS = {
    "sgd": {"MOMENTUM": ("f", 0), "ONE_MINUS_DAMPENING": ("f", 1), "LAMBDA": ("f", 2),
            "NESTEROV": ("flags", 0)},
    "adam": {"ALPHA": ("f", 0), "ONE_MINUS_ALPHA": ("f", 1), "BETA": ("f", 2),
             "ONE_MINUS_BETA": ("f", 3), "LAMBDA": ("f", 4), "EPSILON": ("f", 5),
             "ALPHA_D": ("d", 0), "BETA_D": ("d", 1),
             "BIAS_CORRECTION": ("flags", 0), "DECAY_MODE": ("flags", 1)},
    "lamb": {"ALPHA": ("f", 0), "ONE_MINUS_ALPHA": ("f", 1), "BETA": ("f", 2),
             "ONE_MINUS_BETA": ("f", 3), "LAMBDA": ("f", 4), "EPSILON": ("f", 5),
             "ALPHA_D": ("d", 0), "BETA_D": ("d", 1), "RATIO_MIN": ("d", 2),
             "RATIO_MAX": ("d", 3), "BIAS_CORRECTION": ("flags", 0)},
}


def _hyper_values(hyper: Hyper) -> dict[str, float | int]:
    """The OrtGroup fields of one group (derived values computed in double, then rounded)."""
    if isinstance(hyper, SGDHyper):
        return {"MOMENTUM": float(hyper.momentum),
                "ONE_MINUS_DAMPENING": 1.0 - float(hyper.dampening),
                "LAMBDA": float(hyper.lambda_coef),
                "NESTEROV": int(bool(hyper.nesterov))}
    alpha, beta = float(hyper.alpha), float(hyper.beta)
    values: dict[str, float | int] = {
        "ALPHA": alpha, "ONE_MINUS_ALPHA": 1.0 - alpha, "BETA": beta,
        "ONE_MINUS_BETA": 1.0 - beta, "LAMBDA": float(hyper.lambda_coef),
        "EPSILON": float(hyper.epsilon), "ALPHA_D": alpha, "BETA_D": beta,
        "BIAS_CORRECTION": int(bool(hyper.do_bias_correction))}
    if isinstance(hyper, AdamHyper):
        mode = int(hyper.weight_decay_mode)
        if mode not in (0, 1):
            raise ValueError(f"weight_decay_mode must be 0 or 1, got {hyper.weight_decay_mode!r}")
        values["DECAY_MODE"] = mode
    else:
        values["RATIO_MIN"] = float(hyper.ratio_min)
        values["RATIO_MAX"] = float(hyper.ratio_max)
    return values


def group_table(layout, family: str) -> np.ndarray:
    """The host OrtGroup array (GROUP_DTYPE) of a layout for one kernel family."""
    if family not in GROUP_FIELDS:
        raise ValueError(f"family must be one of {sorted(GROUP_FIELDS)}, got {family!r}")
    table = np.zeros(len(layout.groups), dtype=GROUP_DTYPE)
    expected_start = 0
    for index, group in enumerate(layout.groups):
        if group.start != expected_start or group.stop <= group.start:
            raise ValueError(f"layout.groups[{index}] must be a non-empty range starting at "
                             f"{expected_start}, got [{group.start}, {group.stop})")
        expected_start = group.stop
        if not isinstance(group.hyper, HYPER_TYPES[family]):
            raise ValueError(f"layout.groups[{index}].hyper is {type(group.hyper).__name__}, the {family} "
                             f"kernels need {HYPER_TYPES[family].__name__}")
        values = _hyper_values(group.hyper)
        row = table[index]
        row["start"], row["stop"] = group.start, group.stop
        for name, (field, k) in GROUP_FIELDS[family].items():
            row[field][k] = values[name]
    if expected_start != int(layout.seg_offsets[-1]):
        raise ValueError(f"layout.groups must cover [0, {int(layout.seg_offsets[-1])}), "
                         f"they stop at {expected_start}")
    return table


def chunk_table(layout) -> tuple[np.ndarray, np.ndarray]:
    """(OrtChunk array, seg_chunk): pieces of at most CHUNK elements inside one segment each,
    cut at segment boundaries and at multiples of CHUNK; seg_chunk[s]..seg_chunk[s + 1] are
    segment s's chunks."""
    offsets = np.asarray(layout.seg_offsets, dtype=np.int64)
    nseg, n = offsets.size - 1, int(offsets[-1])
    bounds = np.union1d(offsets, np.arange(0, n, CHUNK, dtype=np.int64))
    starts, stops = bounds[:-1], bounds[1:]
    seg = np.searchsorted(offsets, starts, side="right") - 1
    group_of_seg = np.empty(nseg, dtype=np.int32)
    for index, group in enumerate(layout.groups):
        group_of_seg[group.seg_start:group.seg_stop] = index
    if starts.size >= 2**31:
        raise ValueError(f"{starts.size} chunks of {CHUNK} elements: too many for int32 indices")
    chunks = np.zeros(starts.size, dtype=CHUNK_DTYPE)
    chunks["start"], chunks["stop"] = starts, stops
    chunks["seg"], chunks["group"] = seg, group_of_seg[seg]
    seg_chunk = np.searchsorted(seg, np.arange(nseg + 1), side="left").astype(np.int32)
    return chunks, seg_chunk
