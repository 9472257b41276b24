"""The safetensors format, which checkpoints (``runtime/checkpoint.py``) and the web artifacts'
state (``training/web.py``) are written in: its dtype codes, a tensor's bytes, and a plain
file written a chunk at a time from the arrays' own memory.

A file: N (unsigned 64-bit little-endian), an N-byte UTF-8 JSON header padded with spaces to a
multiple of 8 (name -> dtype, shape, data_offsets; optionally ``__metadata__``), then the data."""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np

from .errors import InvalidArgumentError

CHUNK = 1 << 24  # bytes written or read (and hashed) at a time

DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}

CODES = {(dt.kind, dt.itemsize): code for code, dt in DTYPES.items() if code != "BF16"}


def code_of(dtype: np.dtype) -> str | None:
    """The safetensors dtype code of a numpy dtype, or None where the format has none."""
    if dtype == DTYPES["BF16"]:
        return "BF16"
    return CODES.get((dtype.kind, dtype.itemsize)) if dtype.kind in "fiub" else None


def bytes_of(array, code: str) -> np.ndarray:
    """The array as a flat little-endian C-order uint8 array (no copy when already so)."""
    array = np.ascontiguousarray(array, dtype=DTYPES[code])
    return array.reshape(-1).view(np.uint8)


def json_bytes(header: dict) -> bytes:
    """The header's JSON as written (before the padding)."""
    return json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def header_bytes(header: dict) -> bytes:
    """The header's JSON, padded with spaces to a multiple of 8 bytes."""
    raw = json_bytes(header)
    return raw + b" " * (-len(raw) % 8)


def write(f, tensors: dict) -> None:
    """``tensors`` (name -> numpy array) as a plain safetensors file (no metadata) into the open
    binary file ``f``, in the given order, a chunk at a time from the arrays' own memory: what
    ``safetensors.numpy.save`` gives, without the whole file in memory."""
    header, end, codes = {}, 0, {}
    for name, value in tensors.items():
        value = np.asarray(value)
        codes[name] = code_of(value.dtype)
        if codes[name] is None:
            raise InvalidArgumentError(f"tensor {name!r} has dtype {value.dtype}, which safetensors cannot hold; "
                                       f"supported: {', '.join(DTYPES)}")
        size = value.size * DTYPES[codes[name]].itemsize
        header[name] = {"dtype": codes[name], "shape": list(value.shape), "data_offsets": [end, end + size]}
        end += size
    raw = header_bytes(header)
    f.write(struct.pack("<Q", len(raw)) + raw)
    for name, code in codes.items():
        data = bytes_of(tensors[name], code)
        for start in range(0, data.size, CHUNK):
            f.write(data[start:start + CHUNK])
