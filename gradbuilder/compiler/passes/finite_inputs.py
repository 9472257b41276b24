"""Mark the Softmax and LogSoftmax nodes whose input cannot hold -inf, so that their gradient
rule leaves out the NaN guard (a row of -inf has a NaN softmax, which the rule counts as 0;
the guard is an IsNaN and a Where over the whole output, 3% of the benchmark transformer's
step).

An input may hold -inf when a float value on its way comes from a graph input that is not
a trained weight (data, an additive attention mask), from a constant or initializer holding
an infinity, from an op that makes infinities of finite values (Log, Div by a value that may
be 0, Reciprocal, Pow, ...), or through a subgraph. A division by a value computed from
shapes alone (the exporters' 1/sqrt(head size)) and every other op keep finite values finite:
a finite input that overflows on the way makes the step non-finite, which the training step
reports and skips (All_Finite), never silently.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..registry import FINITE_INPUT
from ..traversal import has_subgraph

_SOURCES = frozenset({"Log", "Reciprocal", "Pow", "LogSoftmax", "Tan", "Atanh", "Acosh", "Asin", "Acos",
                      "Div", "Mod"})
_SHAPE_OPS = frozenset({"Shape", "Size", "Constant", "ConstantOfShape"})


def mark_finite_softmax_inputs(model: ir.Model, ctx) -> None:
    trained = set(ctx.wrt)
    memo: dict[int, bool] = {}

    def const_may_be_inf(value: ir.Value) -> bool:
        tensor = value.const_value
        if tensor is None:
            producer = value.producer()
            if producer is None or producer.op_type != "Constant" or "value" not in producer.attributes:
                return True
            tensor = producer.attributes["value"].value
        try:
            return not bool(np.all(np.isfinite(tensor.numpy())))
        except Exception:  # noqa: BLE001 - data we cannot read (external): assume the worst
            return True

    def shapes_only(value: ir.Value, depth: int = 0) -> bool:
        """Computed from shapes and constants alone (no float data, no weight)."""
        producer = value.producer()
        if producer is None:
            return value.const_value is not None and not value.is_graph_input()
        if producer.op_type in _SHAPE_OPS:
            return True
        return depth < 32 and all(shapes_only(v, depth + 1) for v in producer.inputs if v is not None)

    def may_be_inf(value: ir.Value) -> bool:
        key = id(value)
        if key in memo:
            return memo[key]
        memo[key] = True  # a cycle through a subgraph: assume the worst
        if value.dtype is not None and not value.dtype.is_floating_point():
            result = False
        elif value in trained:
            result = False
        elif value.producer() is None or value.producer().op_type == "Constant":
            result = value.is_graph_input() and value.const_value is None or const_may_be_inf(value)
        else:
            node = value.producer()
            if has_subgraph(node) or node.domain not in ("", "ai.onnx"):
                result = True
            elif node.op_type == "Div" and shapes_only(node.inputs[1]):
                result = may_be_inf(node.inputs[0])
            elif node.op_type in _SOURCES:
                result = True
            else:
                result = any(may_be_inf(v) for v in node.inputs if v is not None)
        memo[key] = result
        return result

    for node in model.graph:
        if node.op_type in ("Softmax", "LogSoftmax") and node.domain in ("", "ai.onnx") and not may_be_inf(node.inputs[0]):
            node.meta[FINITE_INPUT] = True
