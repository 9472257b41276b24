"""Checkpoints: named numpy arrays plus string metadata in one safetensors file.

File layout (the safetensors format):

    bytes 0..8        N, the header length: unsigned 64-bit little-endian
    bytes 8..8+N      header: UTF-8 JSON, padded with spaces to a multiple of 8 bytes
                      {"<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]},
                       ...,
                       "__metadata__": {"<key>": "<value>", ...}}
    bytes 8+N..       data section: the tensors, little-endian, C order, one after another
                      in header order with no gaps; begin/end are relative to its start

dtypes: F64 F32 F16 BF16 I64 I32 I16 I8 U64 U32 U16 U8 BOOL (BF16 as ``ml_dtypes.bfloat16``
arrays, when ``ml_dtypes`` is installed). A rank-0 tensor has shape ``[]``.

``save`` adds two metadata entries: ``"format": "gradbuilder-checkpoint/1"`` and
``"sha256"``, the hex SHA-256 of the header (every entry and metadata value but the digest,
as sorted JSON) and the data section. ``load`` requires both and checks every part of the
file against the header and the digest.
"""

import hashlib
import json
import os
import struct
import tempfile

import numpy as np

from .errors import CheckpointError, InvalidArgumentError

try:
    import ml_dtypes
except ImportError:  # no BF16 without it
    ml_dtypes = None

__all__ = ["FORMAT", "save", "load"]

FORMAT = "gradbuilder-checkpoint/1"

_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
if ml_dtypes is not None:
    _DTYPES["BF16"] = np.dtype(ml_dtypes.bfloat16)

_CODES = {(dt.kind, dt.itemsize): code for code, dt in _DTYPES.items() if code != "BF16"}


def _dtype_code(name, array):
    if not isinstance(array, np.ndarray):
        raise InvalidArgumentError(
            f"checkpoint tensor {name!r} must be a numpy array, got {type(array).__name__}")
    dt = array.dtype
    if "BF16" in _DTYPES and dt == _DTYPES["BF16"]:
        return "BF16"
    code = _CODES.get((dt.kind, dt.itemsize)) if dt.kind in "fiub" else None
    if code is None:
        raise InvalidArgumentError(
            f"checkpoint tensor {name!r} has dtype {dt}, which a checkpoint cannot hold; "
            f"supported: {', '.join(_DTYPES)}")
    return code


def _data_bytes(array, code):
    """The array as a flat little-endian C-order uint8 array (no copy when already so)."""
    array = np.ascontiguousarray(array, dtype=_DTYPES[code])
    return array.reshape(-1).view(np.uint8)


def save(path, tensors, metadata=None):
    """Write ``tensors`` (str -> numpy array) and ``metadata`` (str -> str) to ``path``.

    Atomic: the file is written to a temporary file beside ``path``, flushed and fsynced, then
    renamed over ``path``; on failure the temporary file is removed and a file already at
    ``path`` is left as it was. ``"format"`` and ``"sha256"`` in ``metadata`` are set by save.
    Bad names, arrays or metadata raise InvalidArgumentError before anything is written;
    failures to write raise CheckpointError.
    """
    path = os.fspath(path)
    if not isinstance(tensors, dict):
        raise InvalidArgumentError(f"tensors must be a dict of name -> numpy array, got {type(tensors).__name__}")
    meta = {}
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidArgumentError(
                f"checkpoint metadata must map str to str; got {key!r}: {value!r}")
        meta[key] = value

    header, chunks, offset = {}, [], 0
    for name, array in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise InvalidArgumentError(
                f"checkpoint tensor names must be strings other than '__metadata__', got {name!r}")
        code = _dtype_code(name, array)
        data = _data_bytes(array, code)
        header[name] = {"dtype": code, "shape": list(array.shape),
                        "data_offsets": [offset, offset + data.size]}
        offset += data.size
        chunks.append(data)
    meta.pop("sha256", None)
    meta["format"] = FORMAT
    header["__metadata__"] = meta
    meta["sha256"] = _digest(header, chunks)
    try:
        header_bytes = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgumentError(f"a checkpoint name or metadata string is not valid Unicode: {e}") from None
    header_bytes += b" " * (-len(header_bytes) % 8)

    directory = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(header_bytes)))
            f.write(header_bytes)
            for data in chunks:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
    except Exception as e:
        raise CheckpointError(f"could not write checkpoint {path!r}: {e}") from e
    finally:
        if tmp is not None:
            try:
                os.remove(tmp)
            except OSError:
                pass
    _fsync_directory(directory)


def _fsync_directory(directory):
    """Make the rename durable where the platform allows fsync on a directory."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _digest(header: dict, chunks) -> str:
    """SHA-256 over the header (every entry and metadata value except the digest itself, as
    sorted JSON) and then the data section."""
    described = dict(header)
    described["__metadata__"] = {k: v for k, v in header["__metadata__"].items() if k != "sha256"}
    digest = hashlib.sha256(json.dumps(described, sort_keys=True, ensure_ascii=False).encode("utf-8"))
    for chunk in chunks:
        digest.update(chunk)
    return digest.hexdigest()


def load(path):
    """Read a checkpoint written by ``save``: ``(tensors, metadata)``.

    Tensors come back in header order as writable arrays owning their memory. Any
    inconsistency (length field, JSON, dtypes, shapes, offsets, file size, SHA-256) raises
    CheckpointError saying the file is corrupt or truncated and what is wrong.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path!r}: file not found") from None
    except OSError as e:
        raise CheckpointError(f"could not read checkpoint {path!r}: {e}") from None

    def corrupt(why):
        return CheckpointError(f"checkpoint {path!r} is corrupt: {why}")

    def truncated(why):
        return CheckpointError(f"checkpoint {path!r} is truncated: {why}")

    if len(blob) < 8:
        raise truncated(f"{len(blob)} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack_from("<Q", blob)
    if 8 + n > len(blob):
        raise truncated(f"header length {n} goes beyond the end of the {len(blob)}-byte file")
    header = _parse_header(blob[8:8 + n], corrupt)
    meta = header.pop("__metadata__", None)
    _check_metadata(meta, corrupt)

    data = memoryview(blob)[8 + n:]
    entries = [(name, *_parse_entry(name, entry, corrupt)) for name, entry in header.items()]
    end = 0
    for name, _, _, begin, stop in sorted(entries, key=lambda e: (e[3], e[4])):
        if begin < end:
            raise corrupt(f"tensor {name!r} at bytes [{begin}, {stop}) overlaps the tensor before it")
        if begin > end:
            raise corrupt(f"tensors are not contiguous: gap of {begin - end} bytes before {name!r}")
        end = stop
    if end > len(data):
        raise truncated(f"the header describes {end} data bytes but the file holds {len(data)}")
    if end < len(data):
        raise corrupt(f"{len(data) - end} bytes after the last tensor: the file is longer than its header says")
    if _digest({**header, "__metadata__": meta}, [data]) != meta["sha256"]:
        raise corrupt("the SHA-256 of the header and data does not match the one recorded in it")

    tensors = {}
    for name, dtype, shape, begin, stop in entries:
        flat = np.frombuffer(data, dtype=dtype, count=(stop - begin) // dtype.itemsize, offset=begin)
        tensors[name] = flat.reshape(shape).astype(dtype.newbyteorder("="), copy=True)
    return tensors, meta


def _parse_header(raw, corrupt):
    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise corrupt(f"the header names a key twice: {sorted({k for k in keys if keys.count(k) > 1})}")
        return dict(pairs)

    try:
        header = json.loads(bytes(raw).decode("utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, ValueError) as e:
        raise corrupt(f"the header is not valid UTF-8 JSON ({e})") from None
    except RecursionError:
        raise corrupt("the header is not valid JSON (nested too deeply)") from None
    if not isinstance(header, dict):
        raise corrupt(f"the header is JSON {type(header).__name__}, not an object")
    return header


def _check_metadata(meta, corrupt):
    if not isinstance(meta, dict):
        raise corrupt("the header has no '__metadata__' object")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise corrupt("'__metadata__' does not map strings to strings")
    if meta.get("format") != FORMAT:
        raise corrupt(f"metadata 'format' is {meta.get('format')!r}, expected {FORMAT!r} "
                      "(not a gradbuilder checkpoint, or a damaged one)")
    sha = meta.get("sha256")
    if sha is None:
        raise corrupt("metadata has no 'sha256' digest of the data")
    if not isinstance(sha, str) or len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise corrupt(f"metadata 'sha256' is {sha!r}, not a SHA-256 hex digest")


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_entry(name, entry, corrupt):
    """(dtype, shape, begin, end) of one header entry, checked."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise corrupt(f"the entry of tensor {name!r} is not "
                      "{'dtype': ..., 'shape': [...], 'data_offsets': [begin, end]}")
    code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if code not in _DTYPES:
        known = ", ".join(_DTYPES)
        raise corrupt(f"tensor {name!r} has unknown dtype {code!r} (known: {known})")
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
        raise corrupt(f"tensor {name!r} has shape {shape!r}, not a list of ints >= 0")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
            or offsets[0] > offsets[1]):
        raise corrupt(f"tensor {name!r} has data_offsets {offsets!r}, not [begin, end] with begin <= end")
    dtype = _DTYPES[code]
    size = int(np.prod(shape, dtype=object)) * dtype.itemsize  # Python ints: no overflow
    if offsets[1] - offsets[0] != size:
        raise corrupt(f"tensor {name!r} ({code}, shape {shape}) needs {size} bytes but its "
                      f"data_offsets {offsets} span {offsets[1] - offsets[0]}")
    return dtype, tuple(shape), offsets[0], offsets[1]
