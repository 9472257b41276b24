"""Write matrix-transpose-times-vector products in a form onnxruntime computes correctly.

onnxruntime 1.31 fuses ``MatMul(Transpose(W), k)`` into one kernel under its default graph
optimizations, and when ``k`` is 1-D at run time the fused kernel drops the transpose (the
result is correct with the optimizations off). The runtime folds the Transpose away when
``W`` is a constant, so a forward model can run correctly there and then fail in the written
model, where the weights are graph inputs. The product equals ``MatMul(k, W)`` for a 1-D
``k`` (a 1-D first operand is a row: ``sum_n k[n] W[.., n, m]``), a form that is not fused.

Runs on the forward graph before differentiation, so the gradients follow the new form.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..values import attr, dims_of


def _swaps_last_two(node: ir.Node) -> bool:
    """Whether Transpose ``node`` swaps the last two axes of its input and nothing else."""
    dims = dims_of(node.inputs[0])
    perm = attr(node, "perm")
    if perm is None:  # reverses every axis
        return dims is not None and len(dims) == 2
    rank = len(perm)
    return rank >= 2 and list(perm) == list(range(rank - 2)) + [rank - 1, rank - 2]


def vector_products_without_transpose(model: ir.Model, ctx) -> None:
    """Rewrite, in place, every ``MatMul(Transpose(W), k)`` (in the graph and its subgraphs)
    whose ``k`` may be 1-D: as ``MatMul(k, W)`` when ``k`` is 1-D, and when its rank is known
    only at run time as ``If(rank(k) == 1, MatMul(k, W), MatMul(Transpose(W), k))`` (the
    fused kernel is right for a k of two or more axes). The node keeps its output value."""
    unique = ctx.unique
    for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
            continue
        wt, k = node.inputs
        transpose = wt.producer() if wt is not None else None
        if (transpose is None or transpose.op_type != "Transpose" or transpose.domain not in ("", "ai.onnx")
                or k is None or not _swaps_last_two(transpose)):
            continue
        k_dims = dims_of(k)
        if k_dims is not None and len(k_dims) == 1:
            node.replace_input_with(0, k)
            node.replace_input_with(1, transpose.inputs[0])
        elif k_dims is None:
            _by_rank(node, wt, k, transpose.inputs[0], unique)


def _by_rank(node: ir.Node, wt: ir.Value, k: ir.Value, w: ir.Value, unique) -> None:
    """Turn MatMul ``node`` into an If on whether ``k`` is 1-D."""
    def emit(op, inputs, dtype=None, **attrs):
        n = ir.Node("", op, inputs, [ir.convenience.convert_attribute(a, v) for a, v in attrs.items()],
                    name=unique(f"{node.name or 'MatMul'}_{op}_node"))
        n.outputs[0].name = unique(f"{node.name or 'MatMul'}_{op}_out")
        n.outputs[0].dtype = dtype
        return n

    def branch(first, second, label):
        product = emit("MatMul", [first, second], node.outputs[0].dtype)
        return ir.Graph([], [product.outputs[0]], nodes=[product], name=unique(label))

    int64 = ir.DataType.INT64
    one = emit("Constant", [], int64, value=ir.tensor(np.array(1, dtype=np.int64)))
    shape = emit("Shape", [k], int64)
    rank = emit("Size", [shape.outputs[0]], int64)
    is_vector = emit("Equal", [rank.outputs[0], one.outputs[0]], ir.DataType.BOOL)
    node.graph.insert_before(node, [one, shape, rank, is_vector])
    then_g = branch(k, w, "vector_times_matrix")
    else_g = branch(wt, k, "transposed_matrix_product")
    node.resize_inputs(1)
    node.replace_input_with(0, is_vector.outputs[0])
    node.op_type = "If"
    node.attributes["then_branch"] = ir.AttrGraph("then_branch", then_g)
    node.attributes["else_branch"] = ir.AttrGraph("else_branch", else_g)

