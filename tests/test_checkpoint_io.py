"""Checkpoint files: round trip, atomic writes, damaged and foreign files refused, key comparison."""
import os
import re
import zipfile

import numpy as np
import pytest
import torch

from ort_trainer import _checkpoint_files
from ort_trainer._trainer import checkpoint as _checkpoint


def raises_exactly(message, error=ValueError):
    return pytest.raises(error, match=f"^{re.escape(message)}$")


def model_state():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2).state_dict()


STATE = {
    "model": {"full_precision": model_state()},
    "optimizer": {"weight": {"Moment_1": torch.zeros(2, 3), "Update_Count": torch.tensor(4)}},
    "train_step_info": {"optimization_step": 7, "step": 14},
    "misc": [1.5, "text", True, None, (1, 2), {3: "int key"}],
}


def assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def test_round_trip(tmp_path):
    path = tmp_path / "ckpt.pt"
    _checkpoint_files.save(path, STATE)
    loaded = _checkpoint.load(path)
    assert_same(loaded, STATE)
    assert_same(_checkpoint.load(str(path)), STATE)
    _checkpoint_files.save(path, loaded)  # a loaded checkpoint saves again
    assert list(os.listdir(tmp_path)) == ["ckpt.pt"]


def test_plain_torch_reads_it(tmp_path):
    path = tmp_path / "ckpt.pt"
    _checkpoint_files.save(path, STATE)
    raw = torch.load(path, weights_only=True)
    assert (raw["format"], raw["format_version"]) == ("ort-trainer-checkpoint", 1)
    model = torch.nn.Linear(3, 2)
    model.load_state_dict(raw["model"]["full_precision"])
    assert torch.equal(model.weight, model_state()["weight"])


def test_file_permissions(tmp_path):
    path = tmp_path / "ckpt.pt"
    umask = os.umask(0o027)
    try:
        _checkpoint_files.save(path, {})
    finally:
        os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o640  # the umask's, as for open(), not a temporary file's 0600
    os.chmod(path, 0o640)
    _checkpoint_files.save(path, {})
    assert os.stat(path).st_mode & 0o777 == 0o640  # an overwritten file keeps its permissions


def test_atomic_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    _checkpoint_files.save(path, STATE)
    before = path.read_bytes()
    real_save = torch.save

    def failing_save(obj, file):
        real_save(obj, file)
        file.write(b"partial")  # some bytes are out when it fails
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with raises_exactly("disk full", OSError):
        _checkpoint_files.save(path, {"model": {"w": torch.ones(5)}})
    with raises_exactly("disk full", OSError):
        _checkpoint_files.save(tmp_path / "new.pt", {})
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["ckpt.pt"]


def test_atomic_write(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(b"old")

    def failing(file):
        file.write(b"new, then")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _checkpoint_files.atomic_write(path, failing)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["model.onnx"]
    _checkpoint_files.atomic_write(str(path), lambda file: file.write(b"new"))
    assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["model.onnx"]


def test_missing_directory(tmp_path):
    path = tmp_path / "nowhere" / "ckpt.pt"
    with raises_exactly(f"cannot write '{path}': directory '{tmp_path / 'nowhere'}' does not exist",
                        FileNotFoundError):
        _checkpoint_files.save(path, STATE)


@pytest.mark.parametrize("state, message", [
    ({"model": {"w": np.ones(2)}},
     "cannot save checkpoint: state['model']['w'] is a numpy.ndarray; values must be torch tensors, int, float, "
     "bool, str, None, or lists, tuples and dicts of those"),
    ({"train_step_info": {"step": np.int64(3)}},
     "cannot save checkpoint: state['train_step_info']['step'] is a numpy.int64; values must be torch tensors, "
     "int, float, bool, str, None, or lists, tuples and dicts of those"),
    ({"misc": [1, {"f": print}]},
     "cannot save checkpoint: state['misc'][1]['f'] is a builtins.builtin_function_or_method; values must be torch "
     "tensors, int, float, bool, str, None, or lists, tuples and dicts of those"),
    ({"misc": {(1, 2): 3}},
     "cannot save checkpoint: state['misc'] has a key (1, 2) of type tuple; keys must be str or int"),
])
def test_values_checked_before_writing(tmp_path, state, message):
    path = tmp_path / "ckpt.pt"
    with raises_exactly(message, TypeError):
        _checkpoint_files.save(path, state)
    assert os.listdir(tmp_path) == []


def test_reserved_keys_and_non_dict(tmp_path):
    with raises_exactly("cannot save checkpoint: state must not contain the reserved keys ['format_version']"):
        _checkpoint_files.save(tmp_path / "ckpt.pt", {"format_version": 2})
    with raises_exactly("cannot save checkpoint: state must be a dict, got list", TypeError):
        _checkpoint_files.save(tmp_path / "ckpt.pt", [1])


def test_missing_file(tmp_path):
    with raises_exactly(f"checkpoint '{tmp_path / 'none.pt'}' does not exist", FileNotFoundError):
        _checkpoint.load(tmp_path / "none.pt")


def test_truncated_file(tmp_path):
    path = tmp_path / "ckpt.pt"
    _checkpoint_files.save(path, STATE)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with raises_exactly(f"checkpoint '{path}' is truncated or corrupt (BadZipFile: File is not a zip file)"):
        _checkpoint.load(path)


def test_damaged_pickle(tmp_path):
    """torch checks no CRC: without our check, flipped bytes would read as a foreign pickle."""
    path = tmp_path / "ckpt.pt"
    _checkpoint_files.save(path, STATE)
    data = bytearray(path.read_bytes())
    start = data.index(b"\x80\x02")  # the pickle's PROTO opcode, in the stored data.pkl
    data[start + 2:start + 10] = b"\xff" * 8
    path.write_bytes(data)
    with raises_exactly(f"checkpoint '{path}' is truncated or corrupt (BadZipFile: Bad CRC-32 for file "
                        f"'archive/data.pkl')"):
        _checkpoint.load(path)


@pytest.mark.parametrize("content", [b"not a checkpoint at all", b""])
def test_garbage_file(tmp_path, content):
    path = tmp_path / "ckpt.pt"
    path.write_bytes(content)
    with raises_exactly(f"checkpoint '{path}' is truncated or corrupt (BadZipFile: File is not a zip file)"):
        _checkpoint.load(path)


def test_zip_that_is_not_a_torch_archive(tmp_path):
    path = tmp_path / "ckpt.pt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("notes/readme.txt", "hello")
    with raises_exactly(f"checkpoint '{path}' is truncated or corrupt (RuntimeError: Expected hasRecord(\"version\") "
                        f"to be true, but got false)"):
        _checkpoint.load(path)


def test_plain_state_dict_refused(tmp_path):
    path = tmp_path / "weights.pt"
    not_ours = f"checkpoint '{path}' is not an ort-trainer checkpoint (no 'format': 'ort-trainer-checkpoint'); it holds"
    hint = "Plain model weights load with torch.load() and model.load_state_dict()"
    torch.save(torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(3)]).state_dict(), path)
    with raises_exactly(f"{not_ours} a dict with keys ['0.weight', '0.bias', '1.weight', '1.bias', '2.weight'] "
                        f"and 1 more. {hint}"):
        _checkpoint.load(path)
    torch.save(torch.ones(2), path)
    with raises_exactly(f"{not_ours} a Tensor. {hint}"):
        _checkpoint.load(path)


def test_unsafe_pickle_refused(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"format": "ort-trainer-checkpoint", "format_version": 1, "w": np.ones(2)}, path)
    with raises_exactly(f"checkpoint '{path}' is not an ort-trainer checkpoint: it holds objects that "
                        f"torch.load(weights_only=True) refuses (UnpicklingError: Unsupported global: GLOBAL "
                        f"numpy._core.multiarray._reconstruct was not an allowed global by default)"):
        _checkpoint.load(path)


def test_a_damaged_hdf5_file_is_named(tmp_path):
    path = tmp_path / "ORT_checkpoint.ort.pt"
    path.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(100))
    with pytest.raises(ValueError, match=re.escape(f"checkpoint '{path}' is a truncated or corrupt HDF5 file (")):
        _checkpoint.load(path)


@pytest.mark.parametrize("version, message", [
    (2, "has format_version 2, newer than this ort-trainer reads (1); upgrade ort-trainer"),
    ("1", "has an invalid format_version '1'"),
    (None, "has an invalid format_version None"),
])
def test_format_version(tmp_path, version, message):
    path = tmp_path / "ckpt.pt"
    torch.save({"format": "ort-trainer-checkpoint", "format_version": version}, path)
    with raises_exactly(f"checkpoint '{path}' {message}"):
        _checkpoint.load(path)


# ---------------------------------------------------------------- compare_keys

def test_compare_keys_all_match():
    assert _checkpoint_files.compare_keys("model", model_state(), model_state()) is None
    assert _checkpoint_files.compare_keys("counters", {"step": 1}, {"step": 2.5}) is None  # only tensors are compared


def test_compare_keys_lists_everything():
    expected = {"a": torch.zeros(3, 2), "b": torch.zeros(2), "c": torch.zeros(()), "gone": torch.zeros(1), "n": 1}
    actual = {"a": torch.zeros(2, 3), "b": torch.zeros(2, dtype=torch.float16), "c": torch.zeros(1, dtype=torch.int64),
              "extra": 0, "n": torch.ones(1)}
    with raises_exactly("model: missing keys ['gone']; unexpected keys ['extra']; shape mismatch for 'a': checkpoint "
                        "(2, 3) vs model (3, 2); dtype mismatch for 'b': checkpoint torch.float16 vs model "
                        "torch.float32; shape mismatch for 'c': checkpoint (1,) vs model (); dtype mismatch for 'c': "
                        "checkpoint torch.int64 vs model torch.float32; type mismatch for 'n': checkpoint Tensor vs "
                        "model int"):
        _checkpoint_files.compare_keys("model", expected, actual)


def test_compare_keys_shortens_long_lists():
    expected = {f"w{i:02d}": torch.zeros(1) for i in range(13)}
    actual = {f"v{i:02d}": torch.zeros(1) for i in range(11)}
    missing = ", ".join(f"'w{i:02d}'" for i in range(10))
    unexpected = ", ".join(f"'v{i:02d}'" for i in range(10))
    with raises_exactly(f"optimizer: missing keys [{missing}, ... and 3 more]; unexpected keys [{unexpected}, "
                        f"... and 1 more]"):
        _checkpoint_files.compare_keys("optimizer", expected, actual)
    shapes = {key: torch.zeros(2) for key in expected}
    message = "; ".join(f"shape mismatch for 'w{i:02d}': checkpoint (2,) vs model (1,)" for i in range(10))
    with raises_exactly(f"optimizer: {message}; ... and 3 more mismatches"):
        _checkpoint_files.compare_keys("optimizer", expected, shapes)
