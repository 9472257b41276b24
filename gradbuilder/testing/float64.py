"""Models made float64, for finite differences: every float16/bfloat16/float32 tensor, declared
type and dtype attribute of a model (and of its subgraphs) becomes float64."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..compiler import modelio
from ..dtypes import FLOAT_TENSOR_TYPES
from ..compiler.traversal import proto_subgraphs

_FLOATS = FLOAT_TENSOR_TYPES


def _retype(type_proto: onnx.TypeProto) -> None:
    kind = type_proto.WhichOneof("value")
    if kind == "tensor_type" and type_proto.tensor_type.elem_type in _FLOATS:
        type_proto.tensor_type.elem_type = TensorProto.DOUBLE
    elif kind == "sequence_type":
        _retype(type_proto.sequence_type.elem_type)
    elif kind == "optional_type":
        _retype(type_proto.optional_type.elem_type)


def _tensor64(t: onnx.TensorProto) -> onnx.TensorProto:
    if t.data_type not in _FLOATS or t.data_type == TensorProto.DOUBLE:
        return t
    arr = numpy_helper.to_array(t).astype(np.float64)
    return numpy_helper.from_array(arr, t.name)


_DTYPE_ATTRS = {"Cast": "to", "EyeLike": "dtype", "RandomNormal": "dtype", "RandomUniform": "dtype",
                "RandomNormalLike": "dtype", "RandomUniformLike": "dtype", "Bernoulli": "dtype",
                "Multinomial": "dtype", "Attention": "softmax_precision",
                "GroupNormalization": "stash_type", "FlexAttention": "softmax_precision"}


# Inputs that must stay float32 whatever the model's precision: (op, input index).
_FLOAT32_INPUTS = {("Resize", 2), ("Upsample", 1)}


def _graph64(graph: onnx.GraphProto) -> None:
    keep = {n.input[i] for n in graph.node for (op, i) in _FLOAT32_INPUTS
            if n.op_type == op and len(n.input) > i and n.input[i]}
    for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
        if vi.name not in keep:
            _retype(vi.type)
    for i, t in enumerate(graph.initializer):
        if t.name not in keep:
            graph.initializer[i].CopyFrom(_tensor64(t))
    for node in graph.node:
        if node.op_type == "Constant" and node.output[0] in keep:
            continue
        for g in proto_subgraphs(node):
            _graph64(g)
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                a.t.CopyFrom(_tensor64(a.t))
            elif a.name == _DTYPE_ATTRS.get(node.op_type) and a.i in _FLOATS:
                a.i = TensorProto.DOUBLE
        if node.op_type == "GroupNormalization" and not any(a.name == "stash_type" for a in node.attribute):
            node.attribute.append(helper.make_attribute("stash_type", TensorProto.DOUBLE))
        if node.op_type == "ConstantOfShape" and not any(a.name == "value" for a in node.attribute):
            node.attribute.append(helper.make_attribute("value", numpy_helper.from_array(np.zeros(1))))  # float zeros
        if node.op_type == "Constant":
            for a in list(node.attribute):
                if a.name in ("value_float", "value_floats"):
                    vals = np.array(a.f if a.name == "value_float" else list(a.floats), dtype=np.float64)
                    node.attribute.remove(a)
                    node.attribute.append(helper.make_attribute("value", numpy_helper.from_array(vals)))


def to_float64(model) -> onnx.ModelProto:
    """A copy of ``model`` with every float16/bfloat16/float32 tensor made float64."""
    proto = modelio.load_proto(model)
    del proto.graph.value_info[:]
    _graph64(proto.graph)
    _outputs_as_inferred(proto)
    return proto


def _outputs_as_inferred(proto: onnx.ModelProto) -> None:
    """Graph outputs take the types inference gives: an op may keep a float32 output in a
    float64 model (LayerNormalization's Mean/InvStdDev follow stash_type, not the input)."""
    produced = {o for n in proto.graph.node for o in n.output}
    probe = onnx.ModelProto()
    probe.CopyFrom(proto)
    for out in probe.graph.output:
        if out.name in produced:
            out.type.tensor_type.elem_type = 0
    try:
        inferred = onnx.shape_inference.infer_shapes(probe)
    except Exception:
        return
    types = {o.name: o.type.tensor_type.elem_type for o in inferred.graph.output}
    types.update({v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info})
    for out in proto.graph.output:
        t = types.get(out.name, 0)
        if t and out.name in produced and out.type.tensor_type.elem_type != t:
            out.type.tensor_type.elem_type = t
