"""What the installed onnxruntime reads, and fitting our outputs to it.

onnx writes models at its newest IR version (onnx 1.23: IR 14) while onnxruntime reads up to
an older one (onnxruntime 1.31: IR 13) and runs ai.onnx opsets up to its own limit (26). The
limits are asked of onnxruntime itself, once per process: a one-node model stamped far
beyond any version is refused with a message that states the highest one it reads.

The warnings raised for the user (``warn``, ``warnings_at_caller``, ``caller_stacklevel``) are
defined in ``gradbuilder.user_warnings`` and importable from here as before;
``MissingDependencyError`` is defined in ``gradbuilder.errors``.
"""

from __future__ import annotations

import functools
import re

import onnx
import onnxruntime as ort

from .errors import MissingDependencyError, ModelLoadError
from .user_warnings import caller_stacklevel, warn, warnings_at_caller

__all__ = [
    "FALLBACK_LIMITS",
    "KNOWN_LIMITS",
    "MissingDependencyError",
    "caller_stacklevel",
    "check_for_runtime",
    "check_opset",
    "fit_ir_version",
    "stamp_lowest_ir_version",
    "needed_ir_version",
    "runtime_limits",
    "warn",
    "warnings_at_caller",
]

# Checked against the probe: (onnxruntime major.minor) -> (highest IR version, highest ai.onnx opset).
KNOWN_LIMITS = {(1, 31): (13, 26)}
# Where the probe's answer cannot be read and the version is not in the table: what every
# onnxruntime since 1.18 reads.
FALLBACK_LIMITS = (10, 21)

# The IR version that introduced each tensor element type (onnx.proto's Version notes).
_TYPE_IR = {
    onnx.TensorProto.FLOAT8E4M3FN: 9, onnx.TensorProto.FLOAT8E4M3FNUZ: 9, onnx.TensorProto.FLOAT8E5M2: 9,
    onnx.TensorProto.FLOAT8E5M2FNUZ: 9, onnx.TensorProto.UINT4: 10, onnx.TensorProto.INT4: 10,
}
for _name, _ir in (("FLOAT4E2M1", 11), ("FLOAT8E8M0", 12), ("UINT2", 13), ("INT2", 13),
                   ("FLOAT6E2M3", 14), ("FLOAT6E3M2", 14)):
    if hasattr(onnx.TensorProto, _name):
        _TYPE_IR[getattr(onnx.TensorProto, _name)] = _ir


def _probe_error(ir_version: int, opset: int) -> str:
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "probe", [x], [y])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)], ir_version=ir_version)
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - the refusal is the answer
        return str(exc)
    return ""


@functools.lru_cache(maxsize=None)
def runtime_limits() -> tuple[int, int]:
    """(highest IR version, highest ai.onnx opset) the installed onnxruntime loads."""
    version = tuple(int(p) for p in re.findall(r"\d+", ort.__version__)[:2])
    table = KNOWN_LIMITS.get(version, FALLBACK_LIMITS)
    ir_found = re.search(r"max supported IR version: (\d+)", _probe_error(10**6, 13))
    opset_found = re.search(r"support for domain ai\.onnx is till opset (\d+)", _probe_error(8, 10**4))
    return (int(ir_found.group(1)) if ir_found else table[0], int(opset_found.group(1)) if opset_found else table[1])


def _tensors_and_types(graph: onnx.GraphProto):
    """(element type, where) for every tensor and declared type of ``graph`` and its subgraphs."""
    for t in graph.initializer:
        yield t.data_type, f"initializer '{t.name}'"
    for v in list(graph.input) + list(graph.output) + list(graph.value_info):
        t = v.type
        while t.WhichOneof("value") in ("sequence_type", "optional_type"):
            t = t.sequence_type.elem_type if t.HasField("sequence_type") else t.optional_type.elem_type
        if t.HasField("tensor_type"):
            yield t.tensor_type.elem_type, f"value '{v.name}'"
    for node in graph.node:
        where = f"{node.op_type} node '{node.name}'"
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                yield a.t.data_type, where
            elif a.type == onnx.AttributeProto.INT and a.name in ("to", "dtype", "output_dtype"):
                yield a.i, where
            elif a.type == onnx.AttributeProto.GRAPH:
                yield from _tensors_and_types(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from _tensors_and_types(g)


def needed_ir_version(proto: onnx.ModelProto) -> tuple[int, str]:
    """The lowest IR version that holds what ``proto`` uses (its element types, device
    configurations), and what needs it (empty when nothing past IR 8 is used)."""
    needed, what = 8, ""
    graphs = [proto.graph] + [onnx.helper.make_graph(f.node, f.name, [], []) for f in proto.functions]
    for graph in graphs:
        for dtype, where in _tensors_and_types(graph):
            ir = _TYPE_IR.get(dtype, 0)
            if ir > needed:
                needed, what = ir, f"{onnx.helper.tensor_dtype_to_string(dtype)} ({where})"
    if len(getattr(proto, "configuration", ())) and needed < 11:
        needed, what = 11, "device configurations (ModelProto.configuration)"
    return needed, what


def stamp_lowest_ir_version(proto: onnx.ModelProto) -> None:
    """Stamp ``proto`` (in place) with the lowest IR version that holds its opsets and types, so
    that older runtimes (onnxruntime-node, -web, mobile builds) load it too."""
    by_opset = onnx.helper.find_min_ir_version_for(list(proto.opset_import), ignore_unknown=True)
    proto.ir_version = max(by_opset, needed_ir_version(proto)[0])


def fit_ir_version(proto: onnx.ModelProto, strict: bool = False, quiet: bool = False) -> None:
    """Stamp ``proto`` (in place) with the highest IR version onnxruntime reads when the model
    is newer than that and uses nothing the older version lacks; otherwise say so: an error
    with ``strict`` (the caller runs it on onnxruntime), else a warning."""
    max_ir, _ = runtime_limits()
    if proto.ir_version <= max_ir:
        return
    needed, what = needed_ir_version(proto)
    if needed <= max_ir:
        proto.ir_version = max_ir
        return
    message = (f"the model uses {what}, which needs ONNX IR version {needed}; onnxruntime {ort.__version__} "
               f"reads IR versions up to {max_ir}, so it cannot load the result. Convert those values to a type "
               f"it has, or use an onnxruntime that reads IR version {needed}")
    _refuse_or_warn(message, strict, quiet)


def check_opset(proto: onnx.ModelProto, strict: bool = False, quiet: bool = False) -> None:
    """Warn (``strict``: raise) when the model's ai.onnx opset is newer than onnxruntime runs."""
    _, max_opset = runtime_limits()
    opset = next((i.version for i in proto.opset_import if i.domain in ("", "ai.onnx")), None)
    if opset is None or opset <= max_opset:
        return
    message = (f"the model uses ai.onnx opset {opset}; onnxruntime {ort.__version__} runs ai.onnx opsets up to "
               f"{max_opset}, so it cannot load the result. Convert the model first: "
               f"onnx.version_converter.convert_version(model, {max_opset}), or export it at opset {max_opset}")
    _refuse_or_warn(message, strict, quiet)


def _refuse_or_warn(message: str, strict: bool, quiet: bool) -> None:
    """Raise ModelLoadError with ``strict``; else warn unless ``quiet``."""
    if strict:
        raise ModelLoadError(message)
    if not quiet:
        warn(message)


def check_for_runtime(proto: onnx.ModelProto, strict: bool = False, quiet: bool = False) -> None:
    """``check_opset`` and ``fit_ir_version``: what a model to be run by onnxruntime needs."""
    check_opset(proto, strict, quiet)
    fit_ir_version(proto, strict, quiet)
