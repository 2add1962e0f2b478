"""The exported-model cache on disk (ORTModule's ORTMODULE_CACHE_DIR, ORTTrainer's
`utils.graph_cache_dir`): compiled graphs and what their front end needs to run them, one file per
key, reused by a new process that would compile the same graph.

The key is a digest of everything the graph was made from (`_export.fingerprint`: the model's code,
state and weights' names, shapes and dtypes, the libraries' versions; the front end adds the input
signature, the settings that change the graph and the machine its kernel choices were measured
on), so an entry is read only where compiling again would give the same graph: a stale entry is
never found, not overwritten. A file is written atomically (`_checkpoint_files.atomic_write`) and
holds the sha256 of its contents: a file that does not match (truncated, edited) or cannot be read
is removed with a warning, and the graph compiled again.

File: `MAGIC`, the sha256 (hex) of the rest, a newline, then an 8-byte length and the JSON header
({"meta": ..., "blobs": [[name, size], ...]}), then the blobs (serialized ONNX models).
"""
import functools
import hashlib
import json
import logging
import os
import platform
import struct

import torch
from google.protobuf.message import DecodeError

from .._checkpoint_files import atomic_write

LOGGER = logging.getLogger("ort_trainer.cache")
MAGIC = b"ort-trainer-graph-cache 1\n"
SUFFIX = ".graph"
#: what decoding an entry's parts raises where they are not what this code's `store` wrote (another
#: version of it wrote them): a missing field, a wrong type, a class or dtype that is gone, a bad protobuf
UNDECODABLE = (KeyError, TypeError, ValueError, AttributeError, ImportError, DecodeError)


class CorruptEntry(ValueError):
    """A cache file that cannot be what `store` wrote."""


def machine(sessions):
    """What a graph's kernel choices were measured on (`_runtime.product_speed` picks products by their
    speed here): the device, the CPU (or GPU) model, the thread count; whether products were measured."""
    placement = sessions.placement
    gpu = torch.cuda.get_device_name(placement.index) if placement.ort_device == "cuda" else None
    return [placement.ort_device, _cpu_model(), gpu, torch.get_num_threads(), sessions.faster_in_torch is None]


@functools.cache
def _cpu_model():
    try:
        with open("/proc/cpuinfo") as file:
            names = [line.split(":", 1)[1].strip() for line in file if line.startswith("model name")]
    except OSError:
        names = []
    return [platform.machine(), names[0] if names else platform.processor(), torch.backends.cpu.get_cpu_capability()]


class DiskCache:
    """Entries of one directory. `load(key)` -> (meta, {name: bytes}) or None; `store(key, meta,
    blobs)`. `key`: a JSON-able value (hashed into the file name)."""

    def __init__(self, directory):
        self.directory = os.path.abspath(directory)
        self._said_not_cached = False

    def not_cached(self, whose, why):
        """Says once (per front end's cache) that `whose` graphs are not stored, and `why`."""
        if not self._said_not_cached:
            self._said_not_cached = True
            LOGGER.warning("%s are not cached on disk: %s", whose, why)

    def path(self, key):
        return os.path.join(self.directory, hashlib.sha256(
            json.dumps(key, sort_keys=True, default=str).encode()).hexdigest() + SUFFIX)

    def load(self, key):
        path = self.path(key)
        try:
            with open(path, "rb") as file:
                content = file.read()
        except (FileNotFoundError, NotADirectoryError):  # nothing there (`store` says why it cannot write)
            return None
        except OSError as error:
            LOGGER.warning("ort_trainer graph cache: cannot read %s (%s); compiling the graph", path, error)
            return None
        try:
            return _parsed(content)
        except CorruptEntry as error:
            self.discard(key, error)
            return None

    def discard(self, key, reason):
        """Removes an entry that is corrupt or cannot be used (`reason`), with a warning."""
        path = self.path(key)
        LOGGER.warning("ort_trainer graph cache: %s is corrupt (%s); removed, compiling the graph again", path, reason)
        try:
            os.unlink(path)
        except OSError:
            pass

    def store(self, key, meta, blobs):
        """Writes an entry atomically; a failure (the disk full, the directory gone) is a warning:
        the graph is compiled and runs either way."""
        header = json.dumps({"meta": meta, "blobs": [[name, len(blob)] for name, blob in blobs.items()]}).encode()
        body = b"".join([struct.pack("<Q", len(header)), header, *blobs.values()])
        try:
            os.makedirs(self.directory, exist_ok=True)
            atomic_write(self.path(key), lambda file: file.write(MAGIC + hashlib.sha256(body).hexdigest().encode()
                                                                 + b"\n" + body))
        except OSError as error:
            LOGGER.warning("ort_trainer graph cache: cannot write to %s (%s); the graph is not cached",
                           self.directory, error)


def _parsed(content):
    if not content.startswith(MAGIC):
        raise CorruptEntry("not a graph cache file")
    start = len(MAGIC) + 65
    checksum, body = content[len(MAGIC):start - 1], content[start:]
    if content[start - 1:start] != b"\n" or hashlib.sha256(body).hexdigest().encode() != checksum:
        raise CorruptEntry("its checksum does not match its contents")
    (size,) = struct.unpack_from("<Q", body)
    header = json.loads(body[8:8 + size])
    blobs, offset = {}, 8 + size
    for name, length in header["blobs"]:
        blobs[name] = body[offset:offset + length]
        offset += length
    return header["meta"], blobs
