"""Checkpoints: the safetensors layout byte for byte, round trips, atomic writes, files of
the first format still read, and damaged files refused with CheckpointError."""

import base64
import hashlib
import json
import os
import re
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from gradbuilder.runtime import checkpoint
from gradbuilder.errors import CheckpointError, InvalidArgumentError

DAMAGED = r"corrupt|truncated"
FOREIGN = "a safetensors file without gradbuilder's metadata (saved by another program"
FORMAT = "gradbuilder-checkpoint/2"
FORMAT_V1 = "gradbuilder-checkpoint/1"

# safetensors dtype name -> little-endian numpy dtype, written out from the format's spec
SPEC_DTYPES = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": ml_dtypes.bfloat16,
    "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
    "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?",
}


def sample(code, shape, seed=0):
    """Random values covering the dtype's range (floats include nan, inf and -0.0)."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(SPEC_DTYPES[code])
    size = int(np.prod(shape))
    if code == "BOOL":
        flat = rng.integers(0, 2, size).astype(bool)
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        flat = rng.integers(info.min, info.max, size, dtype=dtype, endpoint=True)
    else:
        flat = (rng.standard_normal(size) * 100).astype(dtype)
        flat[: min(size, 4)] = np.array([np.nan, np.inf, -np.inf, -0.0], np.float32)[: min(size, 4)]
    return flat.reshape(shape)


def read_raw(path):
    """(N, header dict, header bytes, data bytes), parsed by hand from the spec."""
    blob = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    raw = blob[8:8 + n]
    return n, json.loads(raw.decode("utf-8")), raw, blob[8 + n:]


def digest_of(header, data):
    """The documented digest of format 1: SHA-256 of the header less the digest (sorted JSON),
    then the data section."""
    described = json.loads(json.dumps(header))
    described.get("__metadata__", {}).pop("sha256", None)
    return hashlib.sha256(json.dumps(described, sort_keys=True, ensure_ascii=False).encode() + data).hexdigest()


def digest_v2(header, data):
    """The documented digest of format 2: SHA-256 of the compact sorted JSON of {"metadata":
    metadata less the digest, "tensors": [[name, dtype, shape], ...] in name order}, then each
    tensor's bytes in name order."""
    header = json.loads(json.dumps(header))
    meta = header.pop("__metadata__", {})
    meta.pop("sha256", None)
    names = sorted(header)
    described = {"metadata": meta, "tensors": [[n, header[n]["dtype"], header[n]["shape"]] for n in names]}
    digest = hashlib.sha256(json.dumps(described, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode())
    for n in names:
        begin, end = header[n]["data_offsets"]
        digest.update(data[begin:end])
    return digest.hexdigest()


def write_raw(path, header, data, fix_sha=True):
    """A file from a header dict and data bytes; sha256 set to the documented digest of the
    header's format if asked."""
    header = json.loads(json.dumps(header))
    if fix_sha and "__metadata__" in header:
        v2 = header["__metadata__"].get("format") == FORMAT
        try:
            header["__metadata__"]["sha256"] = (digest_v2 if v2 else digest_of)(header, data)
        except (TypeError, ValueError, KeyError):  # entries too malformed to digest: any digest will do
            header["__metadata__"]["sha256"] = "0" * 64
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def small_checkpoint(path):
    tensors = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array([1, -2, 3], np.int64),
               "step": np.array(7, np.int64)}
    checkpoint.save(path, tensors, {"model": "tiny"})
    return tensors


def laid_out_checkpoint(path, format=FORMAT):
    """The small checkpoint written by hand in a fixed layout (w: F32 [3,4] at [0,48]; b: I64
    [3] at [48,72]; step: I64 [] at [72,80]) in either format, with its documented digest."""
    tensors = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array([1, -2, 3], np.int64),
               "step": np.array(7, np.int64)}
    header, offset = {}, 0
    for name, array in tensors.items():
        header[name] = {"dtype": {"float32": "F32", "int64": "I64"}[array.dtype.name], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    header["__metadata__"] = {"model": "tiny", "format": format}
    write_raw(path, header, b"".join(a.astype(a.dtype.newbyteorder("<")).tobytes() for a in tensors.values()))
    return tensors


# bytes of a checkpoint written by the first format's writer (gradbuilder.runtime.checkpoint before it
# used the safetensors package): w F32 [2,3], Step I64 [], h BF16 [1.5, -2], flag BOOL, u U16
V1_FILE = base64.b64decode(
    "yAEAAAAAAAB7InciOnsiZHR5cGUiOiJGMzIiLCJzaGFwZSI6WzIsM10sImRhdGFfb2Zmc2V0cyI6WzAsMjRdfSwiU3RlcCI6"
    "eyJkdHlwZSI6Ikk2NCIsInNoYXBlIjpbXSwiZGF0YV9vZmZzZXRzIjpbMjQsMzJdfSwiaCI6eyJkdHlwZSI6IkJGMTYiLCJz"
    "aGFwZSI6WzJdLCJkYXRhX29mZnNldHMiOlszMiwzNl19LCJmbGFnIjp7ImR0eXBlIjoiQk9PTCIsInNoYXBlIjpbMl0sImRh"
    "dGFfb2Zmc2V0cyI6WzM2LDM4XX0sInUiOnsiZHR5cGUiOiJVMTYiLCJzaGFwZSI6WzFdLCJkYXRhX29mZnNldHMiOlszOCw0"
    "MF19LCJfX21ldGFkYXRhX18iOnsibW9kZWwiOiJ0aW55IiwibGVhcm5pbmdfcmF0ZSI6IjAuMDEiLCJmb3JtYXQiOiJncmFk"
    "YnVpbGRlci1jaGVja3BvaW50LzEiLCJzaGEyNTYiOiIzMjk4MDlmOTQ2NTJlZGMyMzQ4OGMwMTlhNzZhMzVjZTY2Y2NkODhj"
    "OWM0Y2U0YjMwYjdhMWRjMTgxNTA0MzhmIn19ICAgICAAAAAAAACAPwAAAEAAAEBAAACAQAAAoEADAAAAAAAAAMA/AMABAAcA")


def raiser(exc):
    def fail(*args, **kwargs):
        raise exc
    return fail


def assert_same(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == np.ascontiguousarray(want).tobytes()


# --- round trips -------------------------------------------------------------------------

@pytest.mark.parametrize("code", sorted(SPEC_DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (2, 3, 4)])
def test_round_trip_every_dtype_and_shape(tmp_path, code, shape):
    array = sample(code, shape)
    path = tmp_path / "c.safetensors"
    checkpoint.save(path, {"t": array})
    tensors, _ = checkpoint.load(path)
    assert list(tensors) == ["t"]
    assert_same(tensors["t"], array)
    _, header, _, _ = read_raw(path)
    assert header["t"]["dtype"] == code and header["t"]["shape"] == list(shape)


def test_round_trip_many_tensors_keeps_order_and_returns_owned_writable_arrays(tmp_path):
    tensors = {f"{code.lower()}.{i}": sample(code, shape, seed=i)
               for i, (code, shape) in enumerate((c, s) for c in SPEC_DTYPES for s in [(), (0, 4), (3, 2)])}
    checkpoint.save(tmp_path / "c", tensors)
    got, _ = checkpoint.load(tmp_path / "c")
    assert list(got) == sorted(tensors)  # name order
    os.remove(tmp_path / "c")  # nothing maps the file
    for name, array in tensors.items():
        assert_same(got[name], array)
        assert got[name].flags.writeable and not any(
            np.shares_memory(got[name], other) for n, other in got.items() if n != name and other.size)
    got["f32.3"][...] = 0  # writable, and independent of the other arrays
    assert_same(got["f32.4"], tensors["f32.4"])


def test_metadata_round_trip_and_format_and_digest_added(tmp_path):
    meta = {"model": "tiny", "epoch": "3", "note": "ünïcode ✓", "empty": ""}
    checkpoint.save(tmp_path / "c", {"x": np.ones(3, np.float32)}, meta)
    _, got = checkpoint.load(tmp_path / "c")
    assert {k: got[k] for k in meta} == meta
    assert got["format"] == FORMAT
    _, header, _, data = read_raw(tmp_path / "c")
    assert got["sha256"] == digest_v2(header, data)
    # what load returns can be saved again: save sets format and sha256 itself
    checkpoint.save(tmp_path / "d", *checkpoint.load(tmp_path / "c"))
    assert checkpoint.load(tmp_path / "d")[1] == got


def test_no_tensors(tmp_path):
    checkpoint.save(tmp_path / "c", {})
    tensors, meta = checkpoint.load(tmp_path / "c")
    _, header, _, data = read_raw(tmp_path / "c")
    assert tensors == {} and data == b"" and meta["sha256"] == digest_v2(header, b"")


# --- the layout, checked by hand against the format -------------------------------------

def test_byte_layout_follows_the_safetensors_spec(tmp_path):
    big_endian = np.arange(6, dtype=">i4").reshape(2, 3)
    fortran = np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3))
    strided = np.arange(10, dtype=np.uint16)[::3]
    tensors = {"z.last": np.array(2.5, np.float16), "big": big_endian, "fortran": fortran,
               "strided": strided, "empty": np.zeros((0,), np.float32), "flag": np.array([True, False])}
    path = tmp_path / "c.safetensors"
    checkpoint.save(path, tensors, {"k": "v"})

    blob = Path(path).read_bytes()
    n, header, raw, data = read_raw(path)
    assert (8 + n) % 8 == 0 and len(blob) == 8 + n + len(data)
    stripped = raw.rstrip(b" ")  # the JSON object, then fewer than 8 spaces of padding
    assert stripped.startswith(b"{") and stripped.endswith(b"}") and len(raw) - len(stripped) < 8
    assert header.pop("__metadata__") == {"k": "v", "format": FORMAT,
                                         "sha256": digest_v2({**header, "__metadata__": {"k": "v", "format": FORMAT}}, data)}
    assert set(header) == set(tensors)  # contiguous, in the order save chose
    offset = 0
    for name in sorted(header, key=lambda n: header[n]["data_offsets"]):
        array, entry = tensors[name], header[name]
        assert set(entry) == {"dtype", "shape", "data_offsets"}
        begin, end = entry["data_offsets"]
        assert begin == offset
        want = np.ascontiguousarray(array, dtype=np.dtype(SPEC_DTYPES[entry["dtype"]]).newbyteorder("<"))
        assert data[begin:end] == want.tobytes(order="C")
        assert entry["shape"] == list(array.shape)
        offset = end
    assert offset == len(data)
    begin = header["big"]["data_offsets"][0]  # a big-endian array is stored little-endian
    assert header["big"]["dtype"] == "I32" and data[begin + 4:begin + 8] == (1).to_bytes(4, "little")
    begin = header["fortran"]["data_offsets"][0]  # a Fortran-ordered array is stored in C order
    assert data[begin + 8:begin + 16] == struct.pack("<d", 1.0)


def test_readable_by_the_safetensors_library(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import load_file
    from safetensors.torch import load_file as load_torch

    tensors = {code: sample(code, (3, 2), seed=i) for i, code in enumerate(SPEC_DTYPES)}
    tensors["scalar"] = np.array(-4, np.int32)
    tensors["empty"] = np.zeros((2, 0), np.float32)
    path = tmp_path / "c.safetensors"
    checkpoint.save(path, tensors, {"model": "tiny"})

    got = load_file(path)  # numpy has no bfloat16: compare that one through torch
    for name, array in tensors.items():
        if name != "BF16":
            assert_same(got[name], array)
    bf16 = load_torch(path)["BF16"]
    assert str(bf16.dtype) == "torch.bfloat16"
    assert bf16.view(dtype=__import__("torch").int16).numpy().tobytes() == tensors["BF16"].tobytes()
    with safe_open(path, framework="numpy") as f:
        assert f.metadata()["model"] == "tiny"
        assert f.metadata()["format"] == FORMAT


def test_reads_a_file_written_by_the_safetensors_library(tmp_path):
    from safetensors.numpy import save_file

    tensors = {"b": np.arange(5, dtype=np.int16), "a": np.ones((2, 2), np.float64), "c": np.array(1, np.uint8)}
    path = tmp_path / "lib.safetensors"
    meta = {"format": FORMAT_V1, "sha256": "0" * 64}
    save_file(tensors, path, metadata=meta)
    _, header, _, data = read_raw(path)  # the library's own tensor order: fill in the digest
    save_file(tensors, path, metadata={**meta, "sha256": digest_of(header, data)})
    got, _ = checkpoint.load(path)
    assert set(got) == set(tensors)
    for name, array in tensors.items():
        assert_same(got[name], array)


# --- atomic writes ------------------------------------------------------------------------

@pytest.mark.parametrize("failing", ["replace", "fsync"])
def test_failed_save_leaves_previous_file_and_no_temporary(tmp_path, monkeypatch, failing):
    path = tmp_path / "c.safetensors"
    small_checkpoint(path)
    before = path.read_bytes()

    monkeypatch.setattr(checkpoint.os, failing, raiser(OSError("disk on fire")))
    with pytest.raises(CheckpointError, match="disk on fire") as info:
        checkpoint.save(path, {"other": np.zeros(100, np.float32)})
    assert str(path) in str(info.value)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["c.safetensors"]
    assert path.read_bytes() == before


def test_failed_first_save_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint.os, "replace", raiser(OSError("no")))
    with pytest.raises(CheckpointError):
        checkpoint.save(tmp_path / "c", {"x": np.zeros(3)})
    assert os.listdir(tmp_path) == []


def test_interrupted_save_removes_temporary(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint.os, "fsync", raiser(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path / "c", {"x": np.zeros(3)})
    assert os.listdir(tmp_path) == []


def test_save_into_missing_directory(tmp_path):
    path = tmp_path / "nope" / "c.safetensors"
    with pytest.raises(CheckpointError, match="nope"):
        checkpoint.save(path, {"x": np.zeros(3)})


def test_save_overwrites_an_existing_checkpoint(tmp_path):
    path = tmp_path / "c"
    small_checkpoint(path)
    checkpoint.save(path, {"new": np.array([1.0])})
    assert list(checkpoint.load(path)[0]) == ["new"]
    assert os.listdir(tmp_path) == ["c"]


# --- bad arguments --------------------------------------------------------------------------

@pytest.mark.parametrize("tensors,metadata,match", [
    ({1: np.zeros(2)}, None, "names"),
    ({"__metadata__": np.zeros(2)}, None, "__metadata__"),
    ({"w": [1.0, 2.0]}, None, "'w' must be a numpy array"),
    ({"w": np.zeros(2, np.complex64)}, None, "'w' has dtype complex64"),
    ({"w": np.array(["a"])}, None, "'w' has dtype"),
    ({"w": np.zeros(2, object)}, None, "'w' has dtype object"),
    ({"w": np.zeros(2, ml_dtypes.float8_e4m3fn)}, None, "'w' has dtype"),
    ({"w": np.zeros(2)}, {"epoch": 3}, "str to str"),
    ({"w": np.zeros(2)}, {3: "x"}, "str to str"),
    ([np.zeros(2)], None, "dict"),
])
def test_bad_arguments_write_nothing(tmp_path, tensors, metadata, match):
    with pytest.raises(InvalidArgumentError, match=match):
        checkpoint.save(tmp_path / "c", tensors, metadata)
    assert os.listdir(tmp_path) == []


# --- damaged files ----------------------------------------------------------------------------

def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "absent.safetensors"
    with pytest.raises(CheckpointError, match="absent.safetensors"):
        checkpoint.load(path)


@pytest.mark.parametrize("cut", ["0", "3", "8", "8+n//2", "8+n-1", "8+n", "8+n+5", "len-1"])
def test_truncated_file(tmp_path, cut):
    path = tmp_path / "c"
    small_checkpoint(path)
    blob = path.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    keep = eval(cut, {"n": n, "len": len(blob)})
    assert 0 <= keep < len(blob)
    path.write_bytes(blob[:keep])
    with pytest.raises(CheckpointError, match=DAMAGED):
        checkpoint.load(path)


def damaged_checkpoint(path, change):
    """A small checkpoint at ``path`` whose bytes ``change(bytearray)`` then alters in place."""
    small_checkpoint(path)
    blob = bytearray(path.read_bytes())
    change(blob)
    path.write_bytes(bytes(blob))


def test_flipped_byte_in_data_is_a_digest_mismatch(tmp_path):
    path = tmp_path / "c"

    def flip(blob):
        blob[-30] ^= 0x01

    damaged_checkpoint(path, flip)
    with pytest.raises(CheckpointError, match=r"corrupt.*SHA-256"):
        checkpoint.load(path)


@pytest.mark.parametrize("target,at", [
    (b"{", 0),            # the JSON itself
    (b'"dtype"', 3),      # an entry's key
    (b"F32", 1),          # a dtype
    (b"[3,4]", 3),        # a shape
    (b'"data_offsets":[', 16),  # data offsets
    (b'"sha256":"', 3),   # the digest's key
    (b"gradbuilder-checkpoint/", 12),
])
@pytest.mark.parametrize("bit", [0x01, 0x20])
def test_flipped_byte_in_header(tmp_path, target, at, bit):
    path = tmp_path / "c"

    def flip(blob):
        blob[at + blob.index(target)] ^= bit

    damaged_checkpoint(path, flip)
    with pytest.raises(CheckpointError, match=DAMAGED):
        checkpoint.load(path)


def test_flipped_digest_character(tmp_path):
    path = tmp_path / "c"

    def change_digit(blob):
        at = blob.index(b'"sha256":"') + len(b'"sha256":"')
        blob[at] = ord("0") if blob[at] != ord("0") else ord("1")

    damaged_checkpoint(path, change_digit)
    with pytest.raises(CheckpointError, match=r"corrupt.*SHA-256"):
        checkpoint.load(path)


@pytest.mark.parametrize("content", [
    b"hello",
    b"not a checkpoint at all, just some text that goes on for a while",
    np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes(),
    struct.pack("<Q", 2) + b"[]",
    struct.pack("<Q", 4) + b"\xff\xfe{}",
])
def test_garbage_file(tmp_path, content):
    path = tmp_path / "c"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=DAMAGED):
        checkpoint.load(path)


@pytest.mark.parametrize("n", [10**6, 2**63, 2**64 - 1])
def test_header_length_beyond_file(tmp_path, n):
    path = tmp_path / "c"
    small_checkpoint(path)
    blob = path.read_bytes()
    path.write_bytes(struct.pack("<Q", n) + blob[8:])
    with pytest.raises(CheckpointError, match=r"truncated.*header length"):
        checkpoint.load(path)


@pytest.mark.parametrize("n", [0x280, 0x380, 0x480, 0x580])
@pytest.mark.parametrize("keep", [2, 4, 8, 12])
def test_truncated_file_whose_header_length_starts_like_a_pickle(tmp_path, n, keep):
    """Header lengths of 640, 896, 1152 and 1408 bytes start with pickle's PROTO and a protocol."""
    path = tmp_path / "c"
    path.write_bytes((struct.pack("<Q", n) + b'{"w":')[:keep])
    with pytest.raises(CheckpointError, match="truncated"):
        checkpoint.load(path)


def _edited(tmp_path, edit, data_edit=None, format=FORMAT):
    """Write the small checkpoint in its fixed layout, change its parsed header (and data),
    write it back with a matching digest, and return the path."""
    path = tmp_path / "c"
    laid_out_checkpoint(path, format)
    _, header, _, data = read_raw(path)
    edit(header)
    write_raw(path, header, data_edit(data) if data_edit else data)
    return path


def _set(name, key, value):
    def edit(header):
        header[name][key] = value
    return edit


@pytest.mark.parametrize("edit,data_edit,match", [
    # w: F32 [3,4] at [0,48]; b: I64 [3] at [48,72]; step: I64 [] at [72,80]
    (_set("b", "data_offsets", [56, 80]), None, "not contiguous"),
    (_set("b", "data_offsets", [40, 64]), None, "overlaps"),
    (_set("step", "data_offsets", [80, 88]), None, "not contiguous"),
    (None, lambda d: d[:-8], "describes 80 data bytes but the file holds 72"),
    (lambda h: h.pop("step"), None, "longer than its header"),
    (None, lambda d: d + b"\0" * 8, "longer than its header"),
    (_set("w", "shape", [3, 5]), None, "needs 60 bytes"),
    (_set("w", "shape", [3, -4]), None, "shape"),
    (_set("w", "shape", "3x4"), None, "shape"),
    (_set("w", "dtype", "F128"), None, "unknown dtype 'F128'"),
    (_set("w", "data_offsets", [48, 0]), None, "data_offsets"),
    (_set("w", "data_offsets", [0, 48, 96]), None, "data_offsets"),
    (_set("w", "extra", 1), None, "entry of tensor 'w'"),
    (lambda h: h.__setitem__("w", [1, 2]), None, "entry of tensor 'w'"),
    (lambda h: h.pop("__metadata__"), None, "__metadata__"),
    (lambda h: h["__metadata__"].pop("format"), None, "format"),
    (lambda h: h["__metadata__"].__setitem__("format", "other/2"), None, "format"),
    (lambda h: h["__metadata__"].__setitem__("format", "gradbuilder-checkpoint/9"), None, "newer gradbuilder"),
    (lambda h: h["__metadata__"].__setitem__("epoch", 3), None, "strings"),
])
@pytest.mark.parametrize("format", [FORMAT, FORMAT_V1])
def test_inconsistent_header(tmp_path, edit, data_edit, match, format):
    path = _edited(tmp_path, edit or (lambda h: None), data_edit, format)
    # a header without gradbuilder's format is another program's safetensors file, not a damaged one
    with pytest.raises(CheckpointError, match=DAMAGED + "|" + re.escape(FOREIGN)) as info:
        checkpoint.load(path)
    assert match in str(info.value)


def test_duplicate_tensor_name(tmp_path):
    path = tmp_path / "c"
    small_checkpoint(path)
    _, header, raw, data = read_raw(path)
    entry = json.dumps(header["b"], separators=(",", ":"))
    text = raw.decode().rstrip().replace('"b":' + entry, '"b":' + entry + ',"b":' + entry)
    text += " " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text.encode() + data)
    with pytest.raises(CheckpointError, match=r"corrupt.*twice"):
        checkpoint.load(path)


def test_missing_digest_is_refused(tmp_path):
    path = tmp_path / "c"
    small_checkpoint(path)
    _, header, _, data = read_raw(path)
    del header["__metadata__"]["sha256"]
    write_raw(path, header, data, fix_sha=False)
    with pytest.raises(CheckpointError, match=r"corrupt.*sha256"):
        checkpoint.load(path)


def test_changed_metadata_value_or_tensor_name_is_a_digest_mismatch(tmp_path):
    path = tmp_path / "c.safetensors"
    checkpoint.save(path, {"weight": np.arange(4, dtype=np.float32)}, {"learning_rate": "0.001"})
    blob = path.read_bytes()
    for old, new in ((b'"0.001"', b'"0.009"'), (b'"weight"', b'"wfight"')):
        path.write_bytes(blob.replace(old, new))  # still valid JSON, same length
        with pytest.raises(CheckpointError, match="corrupt"):
            checkpoint.load(path)


# --- the first format -----------------------------------------------------------------------

def test_file_of_the_first_format_loads_and_its_digest_is_checked(tmp_path):
    path = tmp_path / "v1.safetensors"
    path.write_bytes(V1_FILE)
    tensors, meta = checkpoint.load(path)
    assert list(tensors) == ["Step", "flag", "h", "u", "w"]
    assert_same(tensors["w"], np.arange(6, dtype=np.float32).reshape(2, 3))
    assert_same(tensors["Step"], np.array(3, np.int64))
    assert_same(tensors["h"], np.array([1.5, -2], ml_dtypes.bfloat16))
    assert_same(tensors["flag"], np.array([True, False]))
    assert_same(tensors["u"], np.array([7], np.uint16))
    assert meta["format"] == FORMAT_V1 and meta["model"] == "tiny" and meta["learning_rate"] == "0.01"
    checkpoint.save(tmp_path / "again", tensors, meta)  # saved again: the current format
    assert checkpoint.load(tmp_path / "again")[1]["format"] == FORMAT
    for at in (-3, len(V1_FILE) // 2):
        blob = bytearray(V1_FILE)
        blob[at] ^= 0x01
        path.write_bytes(bytes(blob))
        with pytest.raises(CheckpointError, match=DAMAGED):
            checkpoint.load(path)


def test_reads_a_file_written_by_the_safetensors_library_with_the_documented_digest(tmp_path):
    from safetensors.numpy import save_file

    tensors = {"b": np.arange(5, dtype=np.int16), "a": np.ones((2, 2), np.float64), "c": np.array(1, np.uint8),
               "ü": np.array([0.5], ml_dtypes.bfloat16)}
    path = tmp_path / "lib.safetensors"
    meta = {"format": FORMAT, "note": "x", "sha256": "0" * 64}
    save_file(tensors, path, metadata=meta)
    _, header, _, data = read_raw(path)
    save_file(tensors, path, metadata={**meta, "sha256": digest_v2(header, data)})
    got, got_meta = checkpoint.load(path)
    assert list(got) == sorted(tensors) and got_meta["note"] == "x"
    for name, array in tensors.items():
        assert_same(got[name], array)


def write_v1(path, tensors, metadata):
    """``tensors`` laid out as the first format's writer did (in the dict's order) with its digest."""
    codes = {np.dtype(v).str: k for k, v in SPEC_DTYPES.items() if k != "BF16"}
    header, chunks, offset = {}, [], 0
    for name, array in tensors.items():
        raw = np.ascontiguousarray(array).tobytes()
        code = "BF16" if array.dtype == ml_dtypes.bfloat16 else codes[array.dtype.newbyteorder("<").str]
        header[name] = {"dtype": code, "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        chunks.append(raw)
    header["__metadata__"] = {**metadata, "format": FORMAT_V1}
    write_raw(path, header, b"".join(chunks))


def test_session_resumes_from_a_checkpoint_in_the_first_format(tmp_path):
    from .test_session import batches, feeds, session, state_arrays

    s = session()
    for x, y in batches(2, seed=5):
        s.run(["loss"], feeds(x, y))
    s.set_learning_rate(0.003)
    s.save_checkpoint(tmp_path / "new.ckpt")
    tensors, meta = checkpoint.load(tmp_path / "new.ckpt")
    write_v1(tmp_path / "old.ckpt", dict(reversed(list(tensors.items()))), meta)
    assert checkpoint.load(tmp_path / "old.ckpt")[1]["format"] == FORMAT_V1
    resumed = session()
    resumed.load_checkpoint(tmp_path / "old.ckpt")
    want, got = state_arrays(s), state_arrays(resumed)
    assert set(got) == set(want) and all(np.array_equal(got[n], want[n]) for n in want)
    assert resumed.get_learning_rate() == 0.003
    # and one of another model is still refused by the fingerprint
    other = session(hidden=4)
    with pytest.raises(CheckpointError, match="another model or optimizer"):
        other.load_checkpoint(tmp_path / "old.ckpt")


def test_a_checkpoint_between_accumulations_resumes_with_other_accumulation_steps(tmp_path):
    """A checkpoint saved at an accumulation boundary (or without accumulation: a pipeline's
    micro-batches) resumes with any gradient_accumulation_steps; one saved in the middle of an
    accumulation only with its own."""
    from gradbuilder import TrainingParameters, TrainingSession
    from gradbuilder.errors import CheckpointError

    from .helpers import linear_model

    model = linear_model().SerializeToString()
    x = np.random.default_rng(3).standard_normal((2, 1, 4)).astype(np.float32)

    def session(steps):
        p = TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw",
                               gradient_accumulation_steps=steps)
        return TrainingSession(model, p, providers=["CPUExecutionProvider"])

    plain = session(1)
    plain.run(None, {"x": x})
    plain.save_checkpoint(tmp_path / "plain.ckpt")
    two = session(2)
    two.load_checkpoint(tmp_path / "plain.ckpt")
    np.testing.assert_array_equal(two.get_model_state()["full_precision"]["W"],
                                  plain.get_model_state()["full_precision"]["W"])
    two.run(None, {"x": x})  # half an accumulation
    two.save_checkpoint(tmp_path / "half.ckpt")
    with pytest.raises(CheckpointError, match="middle of a gradient accumulation.*Accumulation_Step 1"):
        session(1).load_checkpoint(tmp_path / "half.ckpt")
    two.run(None, {"x": x})
    two.save_checkpoint(tmp_path / "whole.ckpt")
    again = session(1)
    again.load_checkpoint(tmp_path / "whole.ckpt")
    assert again.step == 2


# --- streaming: written from the state's memory, read into the arrays the state keeps -----------

def test_save_writes_ortvalues_as_the_same_file_as_their_arrays(tmp_path):
    import onnxruntime as ort

    arrays = {code: sample(code, (3, 2), seed=i) for i, code in enumerate(SPEC_DTYPES) if code != "BF16"}
    arrays["scalar"] = np.array(-4, np.int32)
    arrays["empty"] = np.zeros((2, 0), np.float32)
    checkpoint.save(tmp_path / "a", arrays, {"model": "tiny"})
    values = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in arrays.items()}
    checkpoint.save(tmp_path / "o", values, {"model": "tiny"})
    assert (tmp_path / "o").read_bytes() == (tmp_path / "a").read_bytes()
    with pytest.raises(InvalidArgumentError, match="'w' must be a numpy array or an onnxruntime OrtValue, got list"):
        checkpoint.save(tmp_path / "c", {"w": [1.0]})


def test_tensors_over_a_chunk_round_trip(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "CHUNK", 40)  # every tensor but the smallest in several chunks
    tensors = {"a": sample("F64", (7, 3)), "b": sample("U8", (101,)), "c": sample("BOOL", (40,)),
               "d": sample("I16", ())}
    checkpoint.save(tmp_path / "c", tensors, {"model": "tiny"})
    got, meta = checkpoint.load(tmp_path / "c")
    for name, array in tensors.items():
        assert_same(got[name], array)
    _, header, _, data = read_raw(tmp_path / "c")
    assert meta["sha256"] == digest_v2(header, data)
    header.pop("__metadata__")
    assert sorted(header, key=lambda n: header[n]["data_offsets"]) == sorted(tensors)  # laid out in name order


def _session_state(s) -> dict:
    """Copies of every state value and step-wise gradient, as save_checkpoint names them."""
    out = {n: np.array(s.state[n].numpy(), copy=True) for n in s.state}
    out.update({f"{w}.grad": np.array(v.numpy(), copy=True) for w, v in s.state.grads.items()})
    return out


def test_session_round_trip_is_bit_for_bit_and_the_file_reads_with_safe_open(tmp_path):
    from safetensors import safe_open

    from .test_session import batches, session

    s = session()
    data = batches(4, seed=31)
    for x, y in data[:2]:
        s.run(["loss"], {"x": x, "y": y})
    s.train_step(*data[2])  # gradients in the step-wise API's buffers: saved as "<weight>.grad"
    saved = _session_state(s)
    assert any(n.endswith(".grad") for n in saved)
    s.save_checkpoint(tmp_path / "c.safetensors")
    s.optimizer_step()
    s.run(["loss"], dict(zip(["x", "y"], data[3])))
    assert any(not np.array_equal(v, saved[n]) for n, v in _session_state(s).items() if not n.endswith(".grad"))

    s.load_checkpoint(tmp_path / "c.safetensors")
    got = _session_state(s)
    assert sorted(got) == sorted(saved)
    for name in saved:
        assert_same(got[name], saved[name])
    with safe_open(tmp_path / "c.safetensors", framework="numpy") as f:
        assert sorted(f.keys()) == sorted(saved) and f.metadata()["format"] == FORMAT
        for name in saved:
            assert_same(f.get_tensor(name), saved[name])

    # the state now lies in the arrays load read: two sessions resumed from the file train alike
    other = session()
    other.load_checkpoint(tmp_path / "c.safetensors")
    s.optimizer_step()
    other.optimizer_step()
    for n, v in _session_state(other).items():
        assert_same(v, _session_state(s)[n])
    assert checkpoint.load(tmp_path / "c.safetensors")[0].keys() == saved.keys()


def test_load_state_copies_the_callers_arrays():
    from .test_session import session

    s = session()
    weight = np.full(s.state.spec("fc1.weight")[0], 0.25, np.float32)
    s.load_state({"fc1.weight": weight})
    weight[...] = 7.0  # the caller's array, changed afterwards
    np.testing.assert_array_equal(s.get_model_state()["full_precision"]["fc1.weight"], 0.25)
