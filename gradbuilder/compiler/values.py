"""Reading an onnx_ir graph's values and nodes: attributes as Python values, optional inputs,
constants, static dims and their broadcast, and the error of a rule that needs a rank shape
inference did not find. Rules, passes and the emitter read graphs through these."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..dtypes import FLOAT_TENSOR_TYPES
from ..errors import GradientRuleError

FLOAT_TYPES = frozenset(ir.DataType(t) for t in FLOAT_TENSOR_TYPES)  # as onnx_ir's DataType


# ----------------------------------------------------------------------------- attributes


def attr(node: ir.Node, name: str, default=None):
    """The Python value of attribute ``name`` of ``node`` (``default`` when absent)."""
    a = node.attributes.get(name)
    if a is None:
        return default
    if a.type == ir.AttributeType.TENSOR:
        return a.value.numpy()
    v = a.value
    if isinstance(v, tuple):
        return list(v)
    return v


def optional_input(node: ir.Node, i: int) -> ir.Value | None:
    """Input ``i`` of ``node``, or None when it is absent (omitted or "")."""
    return node.inputs[i] if len(node.inputs) > i else None


def constant_of(value: ir.Value | None) -> np.ndarray | None:
    """The numpy value of ``value`` when it is statically known (initializer or Constant)."""
    if value is None or value.is_graph_input():
        return None  # a graph input can be fed at run time, even with an initializer default
    if value.const_value is not None:
        try:
            return value.const_value.numpy()
        except Exception:  # external data that cannot be read
            return None
    prod = value.producer()
    if prod is not None and prod.op_type == "Constant" and prod.domain in ("", "ai.onnx"):
        for key in ("value", "value_float", "value_floats", "value_int", "value_ints"):
            a = prod.attributes.get(key)
            if a is not None:
                if key == "value":
                    return a.value.numpy()
                return np.array(a.value, dtype=np.float32 if "float" in key else np.int64)
    return None


# ----------------------------------------------------------------------------- shapes


def unknown_rank(value: ir.Value, op: str) -> GradientRuleError:
    """The error of a rule that needs the rank of ``value``, which shape inference (with data
    propagation) left unknown: it names the value, where it comes from, and what to declare."""
    producer = value.producer()
    if producer is not None:
        origin = (f"computed by {producer.op_type} node '{producer.name}'" if producer.name
                  else f"computed by an unnamed {producer.op_type} node")
        fix = ("declare its shape (at least its rank) with a value_info entry, or give that node "
               "what fixes its output's rank (Squeeze's axes, Reshape's shape as a constant)")
    elif value.is_graph_input():
        origin = "a graph input"
        fix = "declare the input's shape, with symbolic names (e.g. 'batch') for sizes that vary"
    else:
        origin = "a value of an enclosing graph"
        fix = "declare its shape (at least its rank) with a value_info entry"
    return GradientRuleError(
        f"the {op} gradient needs the rank of '{value.name}' ({origin}), which onnx shape inference "
        f"could not find; {fix}"
    )


def dims_of(value: ir.Value) -> tuple | None:
    """Static dims of ``value``: ints, symbolic names (str) or None per dim; None if rank unknown."""
    shape = value.shape
    if shape is None:
        return None
    return tuple(d if isinstance(d, int) else (d.value or None) for d in shape.dims)


def _bcast_dim(a, b):
    if a == 1:
        return b
    if b == 1:
        return a
    if a == b and a is not None:
        return a
    if isinstance(a, int) and not isinstance(b, int):
        return a  # a is the real size (b must be a or 1)
    if isinstance(b, int) and not isinstance(a, int):
        return b
    return None


def broadcast_dims(*shapes) -> tuple | None:
    if any(s is None for s in shapes):
        return None
    rank = max(len(s) for s in shapes)
    out = []
    for i in range(rank):
        dim = 1
        first = True
        for s in shapes:
            k = i - (rank - len(s))
            if k < 0:
                continue
            dim = s[k] if first else _bcast_dim(dim, s[k])
            first = False
        out.append(dim)
    return tuple(out)
