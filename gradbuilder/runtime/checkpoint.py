"""Checkpoints: named tensors plus string metadata in one safetensors file.

A checkpoint is a plain safetensors file (any safetensors reader, ``safetensors.safe_open``
included, opens it):

    bytes 0..8        N, the header length: unsigned 64-bit little-endian
    bytes 8..8+N      header: UTF-8 JSON, padded with spaces to a multiple of 8 bytes
                      {"__metadata__": {"<key>": "<value>", ...},
                       "<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]},
                       ...}
    bytes 8+N..       data section: the tensors, little-endian, C order, one after another
                      with no gaps; begin/end are relative to its start

dtypes: F64 F32 F16 BF16 I64 I32 I16 I8 U64 U32 U16 U8 BOOL (BF16 as ``ml_dtypes.bfloat16``
arrays). A rank-0 tensor has shape ``[]``. ``save`` lays the tensors out in name order;
``load`` reads files in any order (the safetensors package's own, by dtype then name,
included) and returns the tensors in name order.

Both directions stream, one tensor at a time, in chunks of ``CHUNK`` bytes: ``save`` writes
each tensor from the memory it already lies in (a numpy array, or a CPU OrtValue's own
memory; an OrtValue on another device is copied to the host one tensor at a time), and
``load`` reads each tensor straight into a new array of its own. Neither holds the file, or
a second copy of the tensors, in memory.

``save`` adds two metadata entries: ``"format": "gradbuilder-checkpoint/2"`` and ``"sha256"``,
the hex SHA-256 of (1) the UTF-8 JSON (keys sorted, no spaces) of
``{"metadata": <every metadata entry but sha256>, "tensors": [[name, dtype, shape], ...]}``
with the tensors in name order, then (2) each tensor's bytes (little-endian, C order) in the
same name order. It does not depend on where the tensors lie in the file; ``save`` computes
it while it writes the data (the header's digest is filled in when the data is written, before
the file appears at its path), ``load`` while it reads the data back.

Format ``gradbuilder-checkpoint/1`` is still read: its ``sha256`` covers the header (every
entry with its data_offsets and the metadata but the digest, as JSON with sorted keys) and
then the data section as it lies in the file.

``load`` checks the header first (so a damaged file is named precisely: corrupt or truncated,
and what is wrong), recognises files that are not checkpoints at all (another program's
safetensors file, a PyTorch or NumPy file, an ONNX model, an empty file), then reads the
tensors and checks the digest.
"""

import difflib
import hashlib
import json
import os
import struct
import zipfile

import numpy as np
import onnxruntime as ort

from .. import files
from ..dtypes import NP_OF_ORT
from ..errors import CheckpointError, InvalidArgumentError
from ..tensorfiles import CHUNK, code_of, header_bytes, json_bytes
from ..tensorfiles import DTYPES as _DTYPES
from ..tensorfiles import bytes_of as _bytes_of

__all__ = ["FORMAT", "save", "load", "resumes"]

FORMAT = "gradbuilder-checkpoint/2"
FORMAT_V1 = "gradbuilder-checkpoint/1"
FORMATS = (FORMAT_V1, FORMAT)

WHAT_A_CHECKPOINT_IS = ("a checkpoint is a file written by TrainingSession.save_checkpoint or "
                        "`gradbuilder train --checkpoint`")

MAX_HEADER = 100_000_000  # the safetensors package refuses longer headers

def _spec(name, value):
    """(dtype code, shape) of a tensor to save: a numpy array or an onnxruntime OrtValue."""
    if isinstance(value, ort.OrtValue):
        np_type = NP_OF_ORT.get(value.data_type()) if value.is_tensor() else None
        if np_type is None:
            raise InvalidArgumentError(
                f"checkpoint tensor {name!r} is an OrtValue of {value.data_type()}, which a checkpoint cannot "
                f"hold; supported: {', '.join(_DTYPES)}")
        dt, shape = np.dtype(np_type), tuple(value.shape())
    elif isinstance(value, np.ndarray):
        dt, shape = value.dtype, value.shape
    else:
        raise InvalidArgumentError(
            f"checkpoint tensor {name!r} must be a numpy array or an onnxruntime OrtValue, got {type(value).__name__}")
    code = code_of(dt)
    if code is None:
        raise InvalidArgumentError(
            f"checkpoint tensor {name!r} has dtype {dt}, which a checkpoint cannot hold; "
            f"supported: {', '.join(_DTYPES)}")
    return code, shape


def host_bytes(value, code):
    """A tensor's bytes on the host: a view of a numpy array's or a CPU OrtValue's own memory
    when it is little-endian C order already, a copy of this one tensor otherwise. ``save``
    calls it through this module's name for each tensor, after the header: the seam where a
    test makes a write fail or stop in the middle of the file."""
    return _bytes_of(value.numpy() if isinstance(value, ort.OrtValue) else value, code)


def _description(entries, meta) -> bytes:
    """What the format-2 digest covers before the data: metadata and (name, dtype, shape)."""
    described = {"metadata": {k: v for k, v in meta.items() if k != "sha256"},
                 "tensors": [[name, code, list(shape)] for name, (code, shape) in sorted(entries.items())]}
    return json.dumps(described, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def save(path, tensors, metadata=None):
    """Write ``tensors`` (str -> numpy array or onnxruntime OrtValue) and ``metadata`` (str ->
    str) to ``path``, one tensor at a time, from the memory each lies in (an OrtValue that is
    not on the CPU is copied to the host one tensor at a time).

    Atomic (``gradbuilder.files.atomic_write``): nothing appears at ``path`` unless the whole
    file was written, a file already there is left as it was otherwise, and no temporary file
    stays behind (KeyboardInterrupt included). ``"format"`` and ``"sha256"`` in ``metadata``
    are set by save. A path that cannot be written, bad names, tensors or metadata raise
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
    entries = {}
    for name, value in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise InvalidArgumentError(
                f"checkpoint tensor names must be strings other than '__metadata__', got {name!r}")
        entries[name] = _spec(name, value)
    meta.pop("sha256", None)
    meta["format"] = FORMAT
    try:
        digest = hashlib.sha256(_description(entries, meta))
    except UnicodeEncodeError as e:
        raise InvalidArgumentError(f"a checkpoint name or metadata string is not valid Unicode: {e}") from None

    header, end = {"__metadata__": {**meta, "sha256": "0" * 64}}, 0
    at = 8 + len(json_bytes(header)) - 64 - len('"}}')  # where the digest goes: the first entry's last value
    for name in sorted(entries):
        code, shape = entries[name]
        size = int(np.prod(shape, dtype=object)) * _DTYPES[code].itemsize
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [end, end + size]}
        end += size
    raw = header_bytes(header)
    with files.atomic_write(path, error=CheckpointError, what="checkpoint") as (tmp,):
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for name in sorted(entries):
                data = host_bytes(tensors[name], entries[name][0])
                for start in range(0, data.size, CHUNK):
                    digest.update(data[start:start + CHUNK])
                    f.write(data[start:start + CHUNK])
                del data
            f.seek(at)
            f.write(digest.hexdigest().encode("ascii"))


def load(path):
    """Read a checkpoint written by ``save`` (either format): ``(tensors, metadata)``.

    Tensors come back in name order as writable arrays, each in memory of its own that nothing
    else refers to (read straight from the file: one copy of the data in memory). A path that
    is a directory or names no file, a file that is not a checkpoint (another program's
    safetensors file, PyTorch, NumPy or ONNX files, an empty file), and any inconsistency
    (length field, JSON, dtypes, shapes, offsets, file size, SHA-256) raise CheckpointError
    saying what the file is, or that it is corrupt or truncated and what is wrong.
    """
    reader = open_checkpoint(path)
    return reader.read(), reader.metadata


class Reader:
    """An opened checkpoint whose header has been checked: ``metadata``, ``specs`` (name ->
    a zero-strided array of the tensor's dtype and shape: no memory), ``value(name)`` (one
    small tensor, unverified: to decide whether the checkpoint fits), and ``read(into)``."""

    def __init__(self, path, size, start, entries, metadata, digest, order, corrupt, truncated):
        self.path, self.metadata = path, metadata
        self._size, self._start, self._entries, self._digest, self._order = size, start, entries, digest, order
        self._corrupt, self._truncated = corrupt, truncated
        self.specs = {n: np.broadcast_to(np.zeros((), _DTYPES[code]), shape) for n, (code, shape, _, _) in entries.items()}

    def value(self, name: str) -> np.ndarray:
        return _read(self.path, self._start, [name], self._entries, hashlib.sha256(), self._truncated)[name]

    def read(self, into=None) -> dict[str, np.ndarray]:
        """Every tensor, in name order, its SHA-256 checked. ``into`` maps names to writable C-order
        arrays of their dtype and shape to read those tensors into: the whole file is then
        verified first (read and hashed, nothing kept), so they change only with a checkpoint
        that is whole; a file changed between the two reads raises, saying so."""
        if into:
            self._verify(None)
        tensors = self._verify(into or {})
        return {name: tensors[name] for name in sorted(tensors)}

    def _verify(self, into):
        """Read (``into`` None: hash only) and check the digest; the tensors read."""
        digest = self._digest.copy()
        tensors = _read(self.path, self._start, self._order, self._entries, digest, self._truncated, into)
        if digest.hexdigest() != self.metadata["sha256"]:
            if into:
                raise CheckpointError(f"checkpoint '{self.path}' changed while it was being read (it was whole when "
                                      "first read); the tensors read since are not the ones checked: load it again")
            raise self._corrupt("the SHA-256 of the header and data does not match the one recorded in it")
        return tensors


def open_checkpoint(path) -> Reader:
    """A :class:`Reader` of the checkpoint at ``path``, once its header is checked (as ``load``
    checks it; the data is read by ``Reader.read``)."""
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
    return Reader(path, size, 8 + n, entries, meta, digest, order, corrupt, truncated)


def resumes(path, reader: Reader, identity, shapes) -> bool:
    """Whether the session ``identity`` (``state.Identity``) holding state of ``shapes`` (name
    -> shape) may resume from the checkpoint ``reader`` opened at ``path``; raises
    CheckpointError, saying what differs, when it may not. True: the checkpoint was saved
    between accumulations by a session that differs only in its accumulation state (another
    number of accumulation steps, or a pipeline's micro-batches): the session takes it with
    its accumulation state zeroed. A checkpoint saved in the middle of an accumulation resumes
    only with the same accumulation steps."""
    from ..interface import ACCUMULATION_STEP

    specs, saved = reader.specs, reader.metadata.get("model")
    theirs = {n: v for n, v in specs.items() if not n.endswith(".grad")}
    between = saved != identity.model and identity.between == identity.between_of(theirs)
    if between:
        step = int(reader.value(ACCUMULATION_STEP)) if ACCUMULATION_STEP in specs else 0
        if step:
            raise CheckpointError(f"checkpoint {os.fspath(path)} was saved in the middle of a gradient accumulation"
                                  f" (Accumulation_Step {step}); resume it with the gradient_accumulation_steps it "
                                  "was saved with")
    elif saved != identity.model:
        ours = set(shapes)
        detail = []
        if set(theirs) - ours:
            detail.append(f"it has {sorted(set(theirs) - ours)[:5]} which this session does not")
        if ours - set(theirs):
            detail.append(f"it lacks {sorted(ours - set(theirs))[:5]}")
        for n in sorted(ours & set(theirs)):
            if tuple(specs[n].shape) != tuple(shapes[n]):
                detail.append(f"'{n}' is {list(specs[n].shape)}, here {list(shapes[n])}")
                break
        raise CheckpointError(f"checkpoint {os.fspath(path)} was saved from another model or optimizer"
                              + (": " + "; ".join(detail) if detail else ""))
    return between


def _read(path, start, order, entries, digest, truncated, into=()):
    """The tensors, each read in ``order`` straight into an array (its own new one, or the one
    ``into`` gives; ``into`` None: a buffer of CHUNK bytes, nothing kept) and added to
    ``digest`` as it arrives; ``start``: where the data section begins in the file."""
    tensors = {}
    scratch = np.empty(CHUNK, np.uint8) if into is None else None
    try:
        with open(path, "rb", buffering=0) as f:
            for name in order:
                code, shape, begin, stop = entries[name]
                if into is None:
                    f.seek(start + begin)
                    for at in range(begin, stop, CHUNK):
                        part = scratch[: min(CHUNK, stop - at)]
                        got = f.readinto(part)
                        if got != part.size:
                            raise truncated(f"tensor {name!r} ends beyond the end of the file (cut while being read)")
                        digest.update(part)
                    continue
                array = into[name] if name in into else np.empty(shape, _DTYPES[code])
                data = array.reshape(-1).view(np.uint8)
                f.seek(start + begin)
                done = 0
                while done < data.size:
                    got = f.readinto(data[done:done + CHUNK])
                    if not got:
                        raise truncated(f"tensor {name!r} ends beyond the end of the file (cut while being read)")
                    digest.update(data[done:done + got])
                    done += got
                tensors[name] = array
    except OSError as e:
        raise CheckpointError(f"could not read checkpoint '{path}': {e}") from None
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
