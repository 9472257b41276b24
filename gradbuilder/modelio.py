"""Reading models in (bytes, path, ModelProto) and writing them out atomically."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import onnx
import onnx.inliner
import onnx.version_converter
import onnx_ir as ir

from .errors import InvalidModelError, ModelLoadError, OutputError

MIN_OPSET = 13
TWO_GB = 2**31


def load_proto(model) -> onnx.ModelProto:
    """A private copy of ``model`` as a ModelProto; the caller's object is never touched."""
    if isinstance(model, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
        return proto
    if isinstance(model, (bytes, bytearray, memoryview)):
        proto = onnx.ModelProto()
        try:
            proto.ParseFromString(bytes(model))
        except Exception as exc:
            raise ModelLoadError(f"the bytes given are not a serialized ONNX ModelProto: {exc}") from exc
        if not proto.graph.node and not proto.graph.input and not proto.opset_import:
            raise ModelLoadError("the bytes given parse to an empty ONNX model (no graph, no opset)")
        return proto
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if not path.is_file():
            raise ModelLoadError(f"model file not found: '{path}'")
        try:
            return onnx.load(str(path))
        except Exception as exc:
            raise ModelLoadError(f"could not read ONNX model '{path}': {exc}") from exc
    raise ModelLoadError(
        f"model must be bytes, a path or an onnx.ModelProto, not {type(model).__name__}"
    )


def default_opset(proto: onnx.ModelProto) -> int:
    for imp in proto.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return imp.version
    raise InvalidModelError("the model imports no ai.onnx opset; add one to opset_import")


def normalize(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Upgrade old opsets, inline local functions and run strict type/shape inference."""
    opset = default_opset(proto)
    max_opset = onnx.defs.onnx_opset_version()
    if opset > max_opset:
        raise ModelLoadError(
            f"the model uses ai.onnx opset {opset}, newer than this onnx package supports "
            f"({max_opset}); upgrade onnx"
        )
    if opset < MIN_OPSET:
        try:
            proto = onnx.version_converter.convert_version(proto, MIN_OPSET)
        except Exception as exc:
            raise ModelLoadError(
                f"the model uses ai.onnx opset {opset}; gradbuilder supports {MIN_OPSET} and newer and "
                f"onnx's version converter could not upgrade it: {exc}. Re-export the model at "
                f"opset {MIN_OPSET} or newer."
            ) from exc
    if proto.functions:
        proto = onnx.inliner.inline_local_functions(proto)
    try:
        infer_types(proto)
    except Exception as exc:
        raise InvalidModelError(f"the model does not type-check (onnx shape inference): {exc}") from exc
    return proto


def infer_types(proto: onnx.ModelProto) -> None:
    """Strict type and shape inference, in place, at any model size.

    The raw bytes of large initializers are set aside while onnx infers (it needs only their
    dims and types), so models over 2 GB are inferred too and no copy of the weights is made.
    """
    stash = {}
    for i, t in enumerate(proto.graph.initializer):
        if len(t.raw_data) > 4096:
            stash[i] = t.raw_data
            t.ClearField("raw_data")
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True, data_prop=True)
    finally:
        for i, raw in stash.items():
            proto.graph.initializer[i].raw_data = raw
    del proto.graph.value_info[:]
    proto.graph.value_info.extend(inferred.graph.value_info)
    for ours, theirs in zip(proto.graph.output, inferred.graph.output):
        ours.CopyFrom(theirs)


def to_ir(proto: onnx.ModelProto) -> ir.Model:
    try:
        return ir.from_proto(proto)
    except Exception as exc:
        raise InvalidModelError(f"the model could not be converted to the IR: {exc}") from exc


def check(proto: onnx.ModelProto) -> None:
    try:
        if proto.ByteSize() < TWO_GB:
            onnx.checker.check_model(proto, full_check=True)
    except Exception as exc:
        raise OutputError(f"the generated model failed onnx.checker: {exc}") from exc


def save_atomic(proto: onnx.ModelProto, path: str | os.PathLike, external_data: bool | None = None) -> None:
    """Write ``proto`` to ``path``; nothing appears at ``path`` unless the whole write succeeds.

    Models over 2 GB (or with ``external_data=True``) store tensors in ``<name>.data``
    beside the model.
    """
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise OutputError(f"output directory does not exist: '{directory}'")
    size = proto.ByteSize() if external_data is None else 0
    use_external = external_data if external_data is not None else size >= TWO_GB - 2**24
    tmpdir = tempfile.mkdtemp(prefix=".gradbuilder-", dir=directory)
    try:
        tmp_model = Path(tmpdir) / path.name
        data_name = path.name + ".data"
        if use_external:
            copy = onnx.ModelProto()
            copy.CopyFrom(proto)  # save_model rewrites tensors to point at the data file
            onnx.save_model(copy, str(tmp_model), save_as_external_data=True,
                            all_tensors_to_one_file=True, location=data_name, size_threshold=0)
            if (Path(tmpdir) / data_name).exists():
                os.replace(Path(tmpdir) / data_name, directory / data_name)
        else:
            with open(tmp_model, "wb") as f:
                f.write(proto.SerializeToString())
        os.replace(tmp_model, path)
    except OSError as exc:
        raise OutputError(f"could not write '{path}': {exc}") from exc
    finally:
        for leftover in Path(tmpdir).glob("*"):
            leftover.unlink()
        os.rmdir(tmpdir)
