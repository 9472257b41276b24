"""Reading models in: bytes, a path (external data beside it), a ModelProto, onnx-graphsurgeon's
graph, a ``DetachedModel``; unknown dim names cleared, and declared shapes a Constant's value
contradicts dropped; float Constants lifted to initializers
(``lift_constants``); the opset defaulted and normalized (``normalize``, which types every value
through ``type_inference``); and a model loaded with its large weights apart
(``load_detached``, giving the skeleton and the arrays a ``detached.DetachedModel`` writes
back out)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import onnx
import onnx.inliner
import onnx.version_converter
import onnx_ir as ir

from .. import files
from ..dtypes import FLOAT_TENSOR_TYPES
from ..errors import InvalidModelError, ModelLoadError
from .detached import DetachedModel
from .traversal import proto_subgraphs
from .type_inference import infer_types

MIN_OPSET = 13




def load_proto(model, base_dir: str | os.PathLike | None = None, external: bool = True) -> onnx.ModelProto:
    """A private copy of ``model`` as a ModelProto; the caller's object is never touched.

    ``model`` is bytes, a path, an ``onnx.ModelProto``, an ``onnx_graphsurgeon.Graph`` or a
    :class:`DetachedModel` (its skeleton). Tensors kept in external data files are read from
    ``base_dir`` (default: the folder of the model's path; bytes and protos have none, so they
    need it); with ``external=False`` they are left where they are (see :func:`load_detached`).
    """
    if isinstance(model, DetachedModel):
        model = model.skeleton
    model = _from_graphsurgeon(model)
    if isinstance(model, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
        origin = "the model (a ModelProto)"
    elif isinstance(model, (bytes, bytearray, memoryview)):
        proto = onnx.ModelProto()
        try:
            proto.ParseFromString(bytes(model))
        except Exception as exc:
            raise ModelLoadError(f"the bytes given are not a serialized ONNX ModelProto: {exc}") from exc
        if not proto.graph.node and not proto.graph.input and not proto.opset_import:
            raise ModelLoadError("the bytes given parse to an empty ONNX model (no graph, no opset)")
        origin = "the model (bytes)"
    elif isinstance(model, (str, os.PathLike)):
        path = Path(model)
        files.check_input_file(path, ModelLoadError, "model file")  # not found, or a directory
        try:
            proto = onnx.load(str(path), load_external_data=False)  # external data: below, with its own errors
        except Exception as exc:
            raise ModelLoadError(f"could not read ONNX model '{path}': {exc}") from exc
        origin = f"model '{path}'"
        base_dir = path.parent if base_dir is None else base_dir
    else:
        raise ModelLoadError(
            f"model must be bytes, a path or an onnx.ModelProto (or an onnx_graphsurgeon.Graph), not {type(model).__name__}"
        )
    if proto.ir_version > onnx.IR_VERSION:
        raise ModelLoadError(
            f"{origin} has ONNX IR version {proto.ir_version}; the installed onnx {onnx.__version__} reads IR versions "
            f"up to {onnx.IR_VERSION}: it was written by a newer ONNX (or is damaged). Upgrade onnx, or save the "
            "model again with an ONNX release that reads it"
        )
    if external:
        _load_external_data(proto, base_dir, origin)
    _unknown_declared_dims(proto.graph)
    _drop_wrong_constant_shapes(proto.graph)
    return proto


# Dim names that exporters write for "unknown" on every such axis (paddle2onnx: '?'): not one
# size shared by the axes that carry it, as a real symbolic name is.
UNKNOWN_DIM_NAMES = frozenset({"?", "-1", "None", "unknown", "dynamic"})


def _unknown_declared_dims(graph: onnx.GraphProto) -> None:
    """Declared sizes of -1 or 0 on the graph's (and its subgraphs') inputs, outputs and
    value_info become unknown sizes: paddle2onnx writes -1 for a dynamic axis, other exporters
    0, and a gradient built on such a size would be wrong at run time. So do the dim names that
    mean "unknown" (:data:`UNKNOWN_DIM_NAMES`): read as a symbol, ``[-1, 3, '?', '?']`` would
    say that height equals width. Initializers keep their shapes (a 0 there is a real empty
    axis)."""
    for v in list(graph.input) + list(graph.output) + list(graph.value_info):
        _unknown_dims_of(v.type)
    for node in graph.node:
        for g in proto_subgraphs(node):
            _unknown_declared_dims(g)


def _unknown_dims_of(t: onnx.TypeProto) -> None:
    kind = t.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        for d in getattr(t, kind).shape.dim:
            if d.HasField("dim_value") and d.dim_value <= 0:
                d.ClearField("dim_value")
            elif d.HasField("dim_param") and d.dim_param.strip() in UNKNOWN_DIM_NAMES:
                d.ClearField("dim_param")
    elif kind in ("sequence_type", "optional_type"):
        _unknown_dims_of(getattr(t, kind).elem_type)
    elif kind == "map_type":
        _unknown_dims_of(t.map_type.value_type)


def _drop_wrong_constant_shapes(graph: onnx.GraphProto) -> None:
    """Forget a declared shape of a Constant's output that its value contradicts (onnxruntime-
    genai's builder declares its [1] constants as rank 0): the value is the shape, and the
    wrong one would fail strict inference."""
    constants = {n.output[0]: n for n in graph.node if n.op_type == "Constant" and n.domain in ("", "ai.onnx")
                 and n.output and any(a.name == "value" for a in n.attribute)}
    wrong = set()
    for v in graph.value_info:
        node = constants.get(v.name)
        if node is None or not v.type.tensor_type.HasField("shape"):
            continue
        value = next(a.t for a in node.attribute if a.name == "value")
        if len(v.type.tensor_type.shape.dim) != len(value.dims):
            wrong.add(v.name)
    if wrong:
        kept = [v for v in graph.value_info if v.name not in wrong]
        del graph.value_info[:]
        graph.value_info.extend(kept)


def float_constants(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """The float values ``graph``'s own Constant nodes hold (attribute ``value`` of a float type,
    ``value_float`` or ``value_floats``), by output name: where paddle2onnx and spox keep
    every weight."""
    found = {}
    for node in graph.node:
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.output) != 1:
            continue
        for a in node.attribute:
            if a.name == "value" and a.type == onnx.AttributeProto.TENSOR and a.t.data_type in FLOAT_TENSOR_TYPES:
                t = onnx.TensorProto()
                t.CopyFrom(a.t)
            elif a.name == "value_float":
                t = onnx.helper.make_tensor("", onnx.TensorProto.FLOAT, [], [a.f])
            elif a.name == "value_floats":
                t = onnx.helper.make_tensor("", onnx.TensorProto.FLOAT, [len(a.floats)], list(a.floats))
            else:
                continue
            t.name = node.output[0]
            found[node.output[0]] = t
    return found


def lift_constants(proto: onnx.ModelProto, names) -> list[str]:
    """Make the float Constant nodes of ``proto``'s graph (in place) that compute one of
    ``names`` initializers of the same name and value, so they can be trained as weights;
    returns the names lifted. Other Constant nodes stay as they are."""
    wanted = set(names)
    constants = {n: t for n, t in float_constants(proto.graph).items() if n in wanted}
    if not constants:
        return []
    kept = [n for n in proto.graph.node if not (n.op_type == "Constant" and n.domain in ("", "ai.onnx")
                                                and len(n.output) == 1 and n.output[0] in constants)]
    del proto.graph.node[:]
    proto.graph.node.extend(kept)
    proto.graph.initializer.extend(constants.values())
    proto.ir_version = max(proto.ir_version, 4)  # IR 3 required initializers to be inputs
    return list(constants)


def _from_graphsurgeon(model):
    """An ``onnx_graphsurgeon.Graph`` as a ModelProto (``gs.export_onnx``); anything else as is."""
    if not type(model).__module__.startswith("onnx_graphsurgeon"):
        return model
    import onnx_graphsurgeon as gs

    if not isinstance(model, gs.Graph):
        raise ModelLoadError(f"model must be an onnx_graphsurgeon.Graph, not {type(model).__name__}")
    try:
        return gs.export_onnx(model)
    except Exception as exc:
        raise ModelLoadError(f"onnx_graphsurgeon could not export the graph '{model.name}': {exc}") from exc


def _load_external_data(proto: onnx.ModelProto, base_dir, origin: str) -> None:
    """Read the tensors ``proto`` keeps in external data files from ``base_dir``, or say that
    nothing locates them."""
    from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors, uses_external_data

    external = [t for t in _get_all_tensors(proto) if uses_external_data(t)]
    if not external:
        return
    location = ExternalDataInfo(external[0]).location
    more = f" and {len(external) - 1} more" if len(external) > 1 else ""
    if base_dir is None:
        raise ModelLoadError(
            f"{origin} keeps tensor '{external[0].name}'{more} in the external data file "
            f"'{location}', which nothing locates for bytes or a ModelProto; pass base_dir= the folder holding "
            f"'{location}', or pass the model's path"
        )
    if not Path(base_dir).is_dir():
        raise ModelLoadError(f"base_dir '{base_dir}' is not a folder (it should hold '{location}')")
    for t in external:
        name = ExternalDataInfo(t).location
        if not (Path(base_dir) / name).is_file():
            raise ModelLoadError(f"the external data file '{name}' of tensor '{t.name}' of {origin} is not in "
                                 f"'{base_dir}'; put '{name}' there (beside the model, where the exporter wrote it), "
                                 "or, from Python, pass base_dir= the folder holding it")
    try:
        onnx.load_external_data_for_model(proto, str(base_dir))
    except Exception as exc:
        raise ModelLoadError(
            f"could not read the external data of {origin} ('{location}', tensor '{external[0].name}') from "
            f"base_dir '{base_dir}': {exc}"
        ) from exc


def read_proto(model, base_dir: str | os.PathLike | None = None) -> onnx.ModelProto:
    """``model`` as a ModelProto to read, never to change: the caller's ModelProto itself (no
    copy), a DetachedModel's skeleton, else loaded as :func:`load_proto` does."""
    if isinstance(model, DetachedModel):
        return model.skeleton
    return model if isinstance(model, onnx.ModelProto) else load_proto(model, base_dir)


def weights_as_inputs(proto: onnx.ModelProto, weights) -> None:
    """Make every weight of ``proto`` (in place) a graph input without an initializer: a
    session feeds them, and neither the model nor onnxruntime keeps a copy. The other
    initializers (frozen parameters, constants) are constants only, never graph inputs: the
    session does not feed them, and onnxruntime would warn about each one that is both."""
    names = set(weights)
    have = {i.name for i in proto.graph.input}
    kept = []
    for t in proto.graph.initializer:
        if t.name not in names:
            kept.append(t)
        elif t.name not in have:
            proto.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    if len(kept) != len(proto.graph.initializer):
        del proto.graph.initializer[:]
        proto.graph.initializer.extend(kept)
    constants = {t.name for t in kept}
    inputs = [i for i in proto.graph.input if i.name not in constants]
    if len(inputs) != len(proto.graph.input):
        del proto.graph.input[:]
        proto.graph.input.extend(inputs)
        proto.ir_version = max(proto.ir_version, 4)  # IR 3 required initializers to be inputs


def fix_input_shapes(graph: onnx.GraphProto, shapes: Mapping[str, Sequence[int]]) -> None:
    """Give the graph inputs named in ``shapes`` those sizes (a size the input declares is kept:
    a feed that disagrees is refused when it is fed), and forget the symbolic sizes recorded
    for other values, for shape inference to make them static."""
    for value in graph.input:
        if value.name in shapes and len(value.type.tensor_type.shape.dim) == len(shapes[value.name]):
            for dim, size in zip(value.type.tensor_type.shape.dim, shapes[value.name]):
                if not dim.HasField("dim_value"):
                    dim.dim_value = int(size)
    symbolic = [v for v in graph.value_info if any(d.HasField("dim_param") or not d.HasField("dim_value")
                                                    for d in v.type.tensor_type.shape.dim)]
    for v in symbolic:
        graph.value_info.remove(v)


def default_opset(proto: onnx.ModelProto, missing: int | None = None) -> int:
    """The model's ai.onnx opset; when it imports none, ``missing``, or an error when that is
    None."""
    for imp in proto.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return imp.version
    if missing is not None:
        return missing
    raise InvalidModelError("the model imports no ai.onnx opset; add one to opset_import")


def add_default_opset(proto: onnx.ModelProto) -> None:
    """A model made only of other domains' ops (ai.onnx.ml) gets the ai.onnx opset released
    with its ai.onnx.ml version, for the standard ops of the backward graph."""
    if any(imp.domain in ("", "ai.onnx") for imp in proto.opset_import):
        return
    ml = next((imp.version for imp in proto.opset_import if imp.domain == "ai.onnx.ml"), None)
    rows = [row for row in onnx.helper.VERSION_TABLE if ml is None or row[3] == ml]
    version = max(MIN_OPSET, min(row[2] for row in rows) if ml is not None and rows else MIN_OPSET)
    proto.opset_import.append(onnx.helper.make_opsetid("", version))
    ir_version = min(row[1] for row in onnx.helper.VERSION_TABLE if row[2] >= version)
    proto.ir_version = max(proto.ir_version, ir_version)


def normalize(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Upgrade old opsets, inline local functions and run strict type/shape inference."""
    add_default_opset(proto)
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
    _fill_default_axes(proto.graph)
    try:
        infer_types(proto)
    except Exception as exc:
        raise InvalidModelError(f"the model does not type-check (onnx shape inference): {exc}") from exc
    return proto


def _fill_default_axes(graph: onnx.GraphProto) -> None:
    """Spell out MeanVarianceNormalization's default axes: onnx's strict inference fails in
    the op's function body without them."""
    for node in graph.node:
        if node.op_type == "MeanVarianceNormalization" and node.domain in ("", "ai.onnx") \
                and not any(a.name == "axes" for a in node.attribute):
            node.attribute.append(onnx.helper.make_attribute("axes", [0, 2, 3]))


def node_reads(node: onnx.NodeProto) -> set[str]:
    """Every name ``node`` reads, its subgraphs' reads from the enclosing scopes included."""
    names = set(node.input)
    for g in proto_subgraphs(node):
        inner = {i.name for i in g.input} | {t.name for t in g.initializer}
        for n in g.node:
            inner.update(n.output)
        for n in g.node:
            names.update(x for x in node_reads(n) if x not in inner)
    names.discard("")
    return names


def to_ir(proto: onnx.ModelProto) -> ir.Model:
    try:
        return ir.from_proto(proto)
    except Exception as exc:
        raise InvalidModelError(f"the model could not be converted to the IR: {exc}") from exc


DETACH_BYTES = 1024


def load_detached(model, base_dir=None, weights=()) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The model as a weight-free skeleton proto, and its large initializers as numpy arrays
    (the float Constant nodes computing ``weights`` lifted to initializers first).

    A tensor in an external data file is read from the file straight into its array (never
    into a protobuf, which cannot hold 2 GB); one inside the model is copied out of it. The
    whole pipeline (inference, IR, backward graph, output proto, checker) runs on the
    skeleton, whose types and shapes are all still there; :class:`DetachedModel` writes the
    arrays back out. So no copy of the weights is made along the way, and the skeleton is
    re-parsed so the memory the full proto held is returned at once. A DetachedModel given
    as ``model`` shares its arrays.
    """
    if isinstance(model, DetachedModel):
        proto = onnx.ModelProto()
        proto.CopyFrom(model.skeleton)
        lift_constants(proto, weights)
        return proto, dict(model.weights)
    proto = load_proto(model, base_dir, external=False)
    lift_constants(proto, weights)
    directory = _data_dir(model, base_dir)
    stash = {}
    for t in proto.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL and directory is not None and _readable(t):
            stash[t.name] = _read_external(t, directory)
            t.data_location = onnx.TensorProto.DEFAULT
            del t.external_data[:]
        elif len(t.raw_data) >= DETACH_BYTES:
            stash[t.name] = onnx.numpy_helper.to_array(t)
            t.ClearField("raw_data")
    _load_external_data(proto, base_dir if base_dir is not None else directory, _origin(model))  # the rest
    if not stash:
        return proto, stash
    skeleton = onnx.ModelProto.FromString(proto.SerializeToString())
    return skeleton, stash


def _data_dir(model, base_dir):
    """Where ``model``'s external data files are: base_dir, else the folder of its path."""
    if base_dir is not None:
        return Path(base_dir)
    if isinstance(model, (str, os.PathLike)):
        return Path(model).parent
    return None


def _origin(model) -> str:
    return f"model '{model}'" if isinstance(model, (str, os.PathLike)) else "the model"


def _readable(t: onnx.TensorProto) -> bool:
    """A tensor of whole bytes per element (not int4/float4 pairs, not strings)."""
    try:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type))
    except Exception:
        return False
    return t.data_type not in _PACKED and dtype.kind != "O"


_PACKED = {getattr(onnx.TensorProto, n) for n in ("INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2") if hasattr(onnx.TensorProto, n)}


def _read_external(t: onnx.TensorProto, directory: Path) -> np.ndarray:
    """An externally stored tensor, read from its file into a writable array of its own."""
    from onnx.external_data_helper import ExternalDataInfo

    info = ExternalDataInfo(t)
    path = Path(directory) / info.location
    if not Path(directory).is_dir():
        raise ModelLoadError(f"base_dir '{directory}' is not a folder (it should hold '{info.location}')")
    if not path.is_file():
        raise ModelLoadError(f"the external data file '{info.location}' of tensor '{t.name}' is not in '{directory}'; "
                             f"put '{info.location}' there (beside the model, where the exporter wrote it), or, from "
                             "Python, pass base_dir= the folder holding it")
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type))
    count = int(np.prod(t.dims, dtype=np.int64))
    if info.length is not None and info.length != count * dtype.itemsize:
        raise ModelLoadError(f"tensor '{t.name}' {list(t.dims)} of {dtype} needs {count * dtype.itemsize} bytes, but its "
                             f"external data entry says {info.length} (file '{info.location}')")
    try:
        size = path.stat().st_size
        if (info.offset or 0) + count * dtype.itemsize > size:
            raise ModelLoadError(f"the external data file '{path}' ({size} bytes) is too short for tensor '{t.name}' at "
                                 f"offset {info.offset or 0} ({count * dtype.itemsize} bytes)")
        array = np.fromfile(path, dtype=dtype, count=count, offset=info.offset or 0)
    except OSError as exc:
        raise ModelLoadError(f"could not read the external data of tensor '{t.name}' from '{path}': {exc}") from exc
    return array.reshape(tuple(t.dims))
