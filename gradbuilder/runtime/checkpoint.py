"""Checkpoints: named numpy arrays plus string metadata in one safetensors file.

A checkpoint is a plain safetensors file, read and written with the ``safetensors`` package
(any safetensors reader opens it):

    bytes 0..8        N, the header length: unsigned 64-bit little-endian
    bytes 8..8+N      header: UTF-8 JSON, padded with spaces to a multiple of 8 bytes
                      {"<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]},
                       ...,
                       "__metadata__": {"<key>": "<value>", ...}}
    bytes 8+N..       data section: the tensors, little-endian, C order, one after another
                      with no gaps; begin/end are relative to its start

dtypes: F64 F32 F16 BF16 I64 I32 I16 I8 U64 U32 U16 U8 BOOL (BF16 as ``ml_dtypes.bfloat16``
arrays). A rank-0 tensor has shape ``[]``. The package chooses the order of the tensors in
the file (by dtype, then name); ``load`` returns them in name order.

``save`` adds two metadata entries: ``"format": "gradbuilder-checkpoint/2"`` and ``"sha256"``,
the hex SHA-256 of (1) the UTF-8 JSON (keys sorted, no spaces) of
``{"metadata": <every metadata entry but sha256>, "tensors": [[name, dtype, shape], ...]}``
with the tensors in name order, then (2) each tensor's bytes (little-endian, C order) in the
same name order. It does not depend on where the tensors lie in the file, so it is computed
while the arrays are handed to the package, and checked while they are read back.

Format ``gradbuilder-checkpoint/1`` (written before the package did the writing) is still
read: its ``sha256`` covers the header (every entry with its data_offsets and the metadata but
the digest, as JSON with sorted keys) and then the data section as it lies in the file.

``load`` checks the header itself first (so a damaged file is named precisely: corrupt or
truncated, and what is wrong), recognises files that are not checkpoints at all (another
program's safetensors file, a PyTorch or NumPy file, an ONNX model, an empty file), then reads
the tensors with the package and checks the digest.
"""

import difflib
import hashlib
import json
import os
import struct
import zipfile

import ml_dtypes
import numpy as np

from .. import files
from ..errors import CheckpointError, InvalidArgumentError, GradBuilderError

__all__ = ["FORMAT", "save", "load"]

FORMAT = "gradbuilder-checkpoint/2"
FORMAT_V1 = "gradbuilder-checkpoint/1"
FORMATS = (FORMAT_V1, FORMAT)

WHAT_A_CHECKPOINT_IS = ("a checkpoint is a file written by TrainingSession.save_checkpoint or "
                        "`gradbuilder train --checkpoint`")

MAX_HEADER = 100_000_000  # the safetensors package refuses longer headers

_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}

_CODES = {(dt.kind, dt.itemsize): code for code, dt in _DTYPES.items() if code != "BF16"}


def _dtype_code(name, array):
    if not isinstance(array, np.ndarray):
        raise InvalidArgumentError(
            f"checkpoint tensor {name!r} must be a numpy array, got {type(array).__name__}")
    dt = array.dtype
    if dt == _DTYPES["BF16"]:
        return "BF16"
    code = _CODES.get((dt.kind, dt.itemsize)) if dt.kind in "fiub" else None
    if code is None:
        raise InvalidArgumentError(
            f"checkpoint tensor {name!r} has dtype {dt}, which a checkpoint cannot hold; "
            f"supported: {', '.join(_DTYPES)}")
    return code


def _bytes_of(array, code):
    """The array as a flat little-endian C-order uint8 array (no copy when already so)."""
    array = np.ascontiguousarray(array, dtype=_DTYPES[code])
    return array.reshape(-1).view(np.uint8)


def _description(entries, meta) -> bytes:
    """What the format-2 digest covers before the data: metadata and (name, dtype, shape)."""
    described = {"metadata": {k: v for k, v in meta.items() if k != "sha256"},
                 "tensors": [[name, code, list(shape)] for name, (code, shape) in sorted(entries.items())]}
    return json.dumps(described, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def save(path, tensors, metadata=None):
    """Write ``tensors`` (str -> numpy array) and ``metadata`` (str -> str) to ``path``.

    Atomic (``gradbuilder.files.atomic_write``): nothing appears at ``path`` unless the whole
    file was written, a file already there is left as it was otherwise, and no temporary file
    stays behind (KeyboardInterrupt included). ``"format"`` and ``"sha256"`` in ``metadata``
    are set by save. A path that cannot be written, bad names, arrays or metadata raise
    (CheckpointError, InvalidArgumentError) before anything is written; failures to write
    raise CheckpointError.
    """
    path = files.check_output_path(path, CheckpointError, "checkpoint")
    if not isinstance(tensors, dict):
        raise InvalidArgumentError(f"tensors must be a dict of name -> numpy array, got {type(tensors).__name__}")
    meta = {}
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidArgumentError(
                f"checkpoint metadata must map str to str; got {key!r}: {value!r}")
        meta[key] = value
    arrays, entries = {}, {}
    for name, array in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise InvalidArgumentError(
                f"checkpoint tensor names must be strings other than '__metadata__', got {name!r}")
        code = _dtype_code(name, array)
        arrays[name] = np.asarray(array, dtype=_DTYPES[code], order="C")  # (ascontiguousarray makes 0-d 1-d)
        entries[name] = (code, arrays[name].shape)
    meta.pop("sha256", None)
    meta["format"] = FORMAT
    try:
        digest = hashlib.sha256(_description(entries, meta))
    except UnicodeEncodeError as e:
        raise InvalidArgumentError(f"a checkpoint name or metadata string is not valid Unicode: {e}") from None
    for name in sorted(arrays):
        digest.update(_bytes_of(arrays[name], entries[name][0]))
    meta["sha256"] = digest.hexdigest()

    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    with files.atomic_write(path, error=CheckpointError, what="checkpoint") as (tmp,):
        mode = os.stat(tmp).st_mode & 0o777  # the usual mode (0o666 less the umask)
        try:
            save_file(arrays, tmp, metadata=meta)  # (the package writes a file of its own, mode 0o600)
            os.chmod(tmp, mode)
        except SafetensorError as e:
            raise CheckpointError(f"could not write checkpoint '{path}': {e}") from e


def load(path):
    """Read a checkpoint written by ``save`` (either format): ``(tensors, metadata)``.

    Tensors come back in name order as writable arrays, each in memory of its own (read with
    the package's pread backend: one copy of the data in memory). A path that is a directory
    or names no file, a file that is not a checkpoint (another program's safetensors file,
    PyTorch, NumPy or ONNX files, an empty file), and any inconsistency (length field, JSON,
    dtypes, shapes, offsets, file size, SHA-256) raise CheckpointError saying what the file is,
    or that it is corrupt or truncated and what is wrong.
    """
    path = files.check_input_file(path, CheckpointError, "checkpoint")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(16)
            n = struct.unpack_from("<Q", head)[0] if len(head) >= 8 else None
            raw = None
            if n is not None and 8 + n <= size and n <= MAX_HEADER:
                f.seek(8)
                raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"could not read checkpoint '{path}': {e}") from None

    def corrupt(why):
        return CheckpointError(f"checkpoint '{path}' is corrupt: {why}")

    def truncated(why):
        return CheckpointError(f"checkpoint '{path}' is truncated: {why}")

    if size == 0:
        raise CheckpointError(f"checkpoint '{path}' is an empty file (0 bytes), not a checkpoint; "
                              f"{WHAT_A_CHECKPOINT_IS}")
    if head[8:9] != b"{":  # every safetensors file has its JSON header there
        kind = _kind_of(path, head)
        if kind is not None:
            raise CheckpointError(f"'{path}' is {kind}, not a checkpoint; {WHAT_A_CHECKPOINT_IS}")
    if n is None:
        raise truncated(f"{size} bytes, shorter than the 8-byte header length")
    if 8 + n > size:
        raise truncated(f"header length {n} goes beyond the end of the {size}-byte file "
                        f"(or it is not a checkpoint: {WHAT_A_CHECKPOINT_IS})")
    if n > MAX_HEADER:
        raise corrupt(f"header length {n} is over the safetensors limit of {MAX_HEADER} bytes")
    header = _parse_header(raw, corrupt)
    meta = header.pop("__metadata__", None)
    _check_foreign(path, header, meta)
    _check_metadata(meta, corrupt)

    entries = {name: _parse_entry(name, entry, corrupt) for name, entry in header.items()}
    end = 0
    for name, (_, _, begin, stop) in sorted(entries.items(), key=lambda e: (e[1][2], e[1][3])):
        if begin < end:
            raise corrupt(f"tensor {name!r} at bytes [{begin}, {stop}) overlaps the tensor before it")
        if begin > end:
            raise corrupt(f"tensors are not contiguous: gap of {begin - end} bytes before {name!r}")
        end = stop
    available = size - 8 - n
    if end > available:
        raise truncated(f"the header describes {end} data bytes but the file holds {available}")
    if end < available:
        raise corrupt(f"{available - end} bytes after the last tensor: the file is longer than its header says")

    if meta["format"] == FORMAT_V1:
        described = {**header, "__metadata__": {k: v for k, v in meta.items() if k != "sha256"}}
        digest = hashlib.sha256(json.dumps(described, sort_keys=True, ensure_ascii=False).encode("utf-8"))
        order = sorted(entries, key=lambda name: (entries[name][2], entries[name][3]))  # as in the file
    else:
        digest = hashlib.sha256(_description({k: (code, shape) for k, (code, shape, _, _) in entries.items()}, meta))
        order = sorted(entries)
    tensors = _read(path, order, entries, digest, corrupt)
    if digest.hexdigest() != meta["sha256"]:
        raise corrupt("the SHA-256 of the header and data does not match the one recorded in it")
    return {name: tensors[name] for name in sorted(tensors)}, meta


def _read(path, order, entries, digest, corrupt):
    """The tensors, read with the safetensors package in ``order``, each added to ``digest``."""
    from safetensors import SafetensorError, safe_open

    tensors = {}
    try:
        with safe_open(path, framework="numpy", backend="pread") as f:
            for name in order:
                array = f.get_tensor(name)
                code, shape = entries[name][:2]
                if array.dtype != _DTYPES[code] or array.shape != shape:  # pragma: no cover (checked above)
                    raise corrupt(f"tensor {name!r} reads back as {array.dtype} {array.shape}")
                digest.update(_bytes_of(array, code))
                tensors[name] = array
    except GradBuilderError:
        raise
    except (SafetensorError, OSError, ValueError) as e:
        raise corrupt(f"the safetensors package cannot read it: {e}") from None
    return tensors


def _kind_of(path, head: bytes):
    """What a file that is not a safetensors file is, from its first bytes, or None."""
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        try:
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
        except (zipfile.BadZipFile, OSError, ValueError):
            return "a zip archive"
        if any(n.endswith("data.pkl") or n.endswith("/version") for n in names):
            return "a PyTorch file (torch.save; load it with torch.load)"
        if names and all(n.endswith(".npy") for n in names):
            return "a NumPy .npz archive (numpy.savez)"
        return "a zip archive"
    # PROTO 2..5 then an opcode (never 0): a safetensors header length of 640 bytes starts
    # with the same two bytes, but its next ones are 0
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05") and head[2:3] not in (b"", b"\x00"):
        return "a Python pickle (a PyTorch file in torch.save's legacy format, or pickle.dump)"
    if head.startswith(b"\x93NUMPY"):
        return "a NumPy .npy file (numpy.save)"
    if head.startswith(b"\x89HDF\r\n"):
        return "an HDF5 file (h5py or Keras)"
    if (len(head) >= 8 and head[0] == 0x08 and 1 <= head[1] <= 0x7F  # ir_version, then another field
            and head[2] in (0x12, 0x1A, 0x22, 0x28, 0x32, 0x3A, 0x42, 0x72) and head[5:8] != b"\0\0\0"):
        return "an ONNX model (a training session reads it as its model, not as a checkpoint)"
    return None


def _check_foreign(path, header, meta):
    """A well-formed safetensors header without gradbuilder's metadata: another program's file."""
    if isinstance(meta, dict) and isinstance(meta.get("format"), str) and (
            "gradbuilder" in meta["format"].lower()
            or difflib.SequenceMatcher(None, meta["format"], FORMAT).ratio() > 0.8):
        return  # ours, perhaps damaged or from another version: _check_metadata words it
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        return  # a malformed __metadata__: reported as corrupt
    if not all(isinstance(e, dict) and set(e) == {"dtype", "shape", "data_offsets"} for e in header.values()):
        return  # a malformed entry: reported as corrupt
    found = "no '__metadata__'" if meta is None else (
        f"metadata 'format' {meta['format']!r}" if "format" in meta else "no 'format' in its '__metadata__'")
    raise CheckpointError(
        f"'{path}' is a safetensors file without gradbuilder's metadata (saved by another program: {found}), "
        f"not a checkpoint; {WHAT_A_CHECKPOINT_IS} (read other safetensors files with safetensors.numpy.load_file)")


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
    if meta.get("format") not in FORMATS:
        raise corrupt(f"metadata 'format' is {meta.get('format')!r}; this gradbuilder reads "
                      f"{' and '.join(map(repr, FORMATS))} (a damaged checkpoint, or one from a newer gradbuilder)")
    sha = meta.get("sha256")
    if sha is None:
        raise corrupt("metadata has no 'sha256' digest of the data")
    if not isinstance(sha, str) or len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise corrupt(f"metadata 'sha256' is {sha!r}, not a SHA-256 hex digest")


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_entry(name, entry, corrupt):
    """(dtype code, shape, begin, end) of one header entry, checked."""
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
    size = int(np.prod(shape, dtype=object)) * _DTYPES[code].itemsize  # Python ints: no overflow
    if offsets[1] - offsets[0] != size:
        raise corrupt(f"tensor {name!r} ({code}, shape {shape}) needs {size} bytes but its "
                      f"data_offsets {offsets} span {offsets[1] - offsets[0]}")
    return code, tuple(shape), offsets[0], offsets[1]
