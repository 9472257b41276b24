"""A model whose large initializers live apart from its protobuf, as numpy arrays
(``DetachedModel``): the pipeline works on the weight-free skeleton, and the arrays are written
back out on the wire (inside the model, or as ONNX external data past 2 GB) without a copy."""

from __future__ import annotations

import os

import numpy as np
import onnx

from .. import files
from ..errors import OutputError

TWO_GB = 2**31
IN_MEMORY = "gradbuilder-in-memory"  # the location of a tensor given to onnxruntime as an OrtValue


class DetachedModel:
    """A model held as a weight-free skeleton proto plus its large tensors as numpy arrays
    (whatever holds them: a session's state, arrays read from external data).

    Written out without ever assembling the full proto: the skeleton (large initializers
    left out) is serialized first, then one ``ModelProto{graph{initializer}}`` record per
    large tensor. Protobuf parsers merge repeated occurrences of a message field, so the
    result parses to the same model, and memory stays at one copy of the weights.
    """

    def __init__(self, skeleton: onnx.ModelProto, weights: dict[str, np.ndarray]):
        self.skeleton = skeleton
        names = {t.name for t in skeleton.graph.initializer}
        self.weights = {n: v for n, v in weights.items() if n in names}  # those the graph still has

    def byte_size(self) -> int:
        return self.skeleton.ByteSize() + sum(v.nbytes + 64 for v in self.weights.values())

    def _split(self):
        """(skeleton without the detached initializers, [their metadata tensors])."""
        head = onnx.ModelProto()
        head.CopyFrom(self.skeleton)
        big = [t for t in head.graph.initializer if t.name in self.weights]
        small = [t for t in head.graph.initializer if t.name not in self.weights]
        big = [_copy(t) for t in big]
        del head.graph.initializer[:]
        head.graph.initializer.extend(small)
        return head, big

    def chunks(self):
        """The serialized model in pieces: the skeleton, then per large tensor the encoding of
        ``ModelProto{graph{initializer{<its metadata> raw_data}}}``, its bytes taken straight
        from the array (never copied into a protobuf). ``to_bytes`` and ``write`` (one file)
        take the model from here: the seam where a test stops a write in the middle of the file."""
        head, big = self._split()
        yield head.SerializeToString()
        for meta in big:
            raw = _raw(self.weights[meta.name])
            tensor = meta.SerializeToString() + _field(_RAW_DATA, raw.size)
            initializer = _field(_INITIALIZER, len(tensor) + raw.size)
            yield _field(_GRAPH, len(initializer) + len(tensor) + raw.size) + initializer + tensor
            yield memoryview(raw)

    def in_memory(self) -> tuple[bytes, dict[str, np.ndarray]]:
        """(the model serialized with each detached tensor an external-data reference to
        ``IN_MEMORY``, those tensors): onnxruntime takes the arrays through
        ``SessionOptions.add_external_initializers`` in place of the references, so the bytes
        never hold the weights."""
        head, big = self._split()
        for meta in big:
            for field in ("raw_data", "float_data", "double_data", "int32_data", "int64_data"):
                meta.ClearField(field)
            meta.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", IN_MEMORY), ("offset", "0"), ("length", str(self.weights[meta.name].nbytes))):
                entry = meta.external_data.add()
                entry.key, entry.value = key, value
        head.graph.initializer.extend(big)
        return head.SerializeToString(), dict(self.weights)

    def to_bytes(self) -> bytes:
        if self.byte_size() >= TWO_GB:
            raise OutputError("the model is over 2 GB and cannot be one byte string; use save(path)")
        return b"".join(self.chunks())

    def to_proto(self) -> onnx.ModelProto:
        full = onnx.ModelProto()
        full.CopyFrom(self.skeleton)
        for t in full.graph.initializer:
            array = self.weights.get(t.name)
            if array is not None:
                t.raw_data = _raw(array).tobytes()
        return full

    def check(self) -> None:
        """onnx.checker with full_check; detached initializers are checked as typed inputs."""
        head, big = self._split()
        # Runtimes define some ops in the ai.onnx domain that onnx has no schema for
        # (onnxruntime's SimplifiedLayerNormalization): check those as custom-domain nodes.
        unknown = [n for n in head.graph.node if n.domain in ("", "ai.onnx") and not onnx.defs.has(n.op_type)]
        for n in unknown:
            n.domain = "gradbuilder.unchecked"
        if unknown:
            head.opset_import.append(onnx.helper.make_opsetid("gradbuilder.unchecked", 1))
        inputs = {i.name for i in head.graph.input}
        for t in big:
            if t.name not in inputs:
                head.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        try:
            onnx.checker.check_model(head, full_check=True)
        except Exception as exc:
            raise OutputError(f"the generated model failed onnx.checker: {exc}") from exc

    def uses_external_data(self, external_data: bool | None = None) -> bool:
        """Whether ``save`` keeps the large tensors in a ``.data`` file: asked for, or over 2 GB."""
        use = external_data if external_data is not None else self.byte_size() >= TWO_GB - 2**24
        return bool(use and self.weights)

    def write(self, model_file, data_file=None, data_name: str | None = None) -> None:
        """Write the model into ``model_file`` and, given ``data_file``, its large tensors
        into that as onnx's external data, recorded as ``data_name`` (the data file's final
        name beside the model). Not atomic by itself: ``save`` writes temporary files with it."""
        if data_file is None:
            with open(model_file, "wb") as f:
                for chunk in self.chunks():
                    f.write(chunk)
            return
        head, big = self._split()
        with open(data_file, "wb") as data:
            for meta in big:
                offset = data.tell()
                raw = _raw(self.weights[meta.name])
                data.write(raw)
                meta.data_location = onnx.TensorProto.EXTERNAL
                for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(raw.size))):
                    entry = meta.external_data.add()
                    entry.key, entry.value = key, value
        head.graph.initializer.extend(big)
        with open(model_file, "wb") as f:
            f.write(head.SerializeToString())

    def save(self, path: str | os.PathLike, external_data: bool | None = None) -> None:
        """Write to ``path`` atomically (``files.atomic_write``): nothing appears there unless
        the whole write succeeds, and no temporary file stays behind.

        Models over 2 GB (or with ``external_data=True``) keep their large tensors in
        ``<name>.data`` beside the model, as onnx's external data. A path that cannot be
        written raises OutputError naming it before anything is serialized.
        """
        path = files.check_output_path(path, OutputError, "output model")
        if not self.uses_external_data(external_data):
            with files.atomic_write(path, what="output model") as (tmp,):
                self.write(tmp)
            return
        data_path = path.with_name(path.name + ".data")
        with files.atomic_write(data_path, path, what="output model") as (tmp_data, tmp_model):
            self.write(tmp_model, tmp_data, data_path.name)


_RAW_DATA = onnx.TensorProto.DESCRIPTOR.fields_by_name["raw_data"].number


_INITIALIZER = onnx.GraphProto.DESCRIPTOR.fields_by_name["initializer"].number


_GRAPH = onnx.ModelProto.DESCRIPTOR.fields_by_name["graph"].number


def _field(number: int, length: int) -> bytes:
    """A protobuf length-delimited field's key and length (the payload follows)."""
    out = bytearray()
    for value in ((number << 3) | 2, length):
        while True:
            low, value = value & 0x7F, value >> 7
            out.append(low | (0x80 if value else 0))
            if not value:
                break
    return bytes(out)


def _raw(array: np.ndarray) -> np.ndarray:
    """The array's bytes, little-endian, in C order, as a flat uint8 view (a copy only when
    the array is not already so)."""
    array = np.ascontiguousarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return array.reshape(-1).view(np.uint8)


def _copy(t: onnx.TensorProto) -> onnx.TensorProto:
    out = onnx.TensorProto()
    out.CopyFrom(t)
    return out
