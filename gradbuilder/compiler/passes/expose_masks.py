"""Give nodes the outputs their gradient reads, so that the backward does not compute them
again: training-mode Dropout its mask (the gradient must use the exact mask drawn), and
MaxPool on a weight's path its Indices (the backward read them from a second MaxPool of x).

Runs on the private copy of the forward graph before differentiation; the nodes compute the
same values, they only also return what they found.
"""

from __future__ import annotations

import onnx_ir as ir

from ..traversal import reached_from
from ..values import attr, constant_of


def expose_dropout_masks(model: ir.Model, ctx) -> None:
    unique = ctx.unique
    for node in model.graph:
        if node.op_type != "Dropout" or node.domain not in ("", "ai.onnx"):
            continue
        has_mask = len(node.outputs) > 1 and node.outputs[1].name
        training = node.inputs[2] if len(node.inputs) > 2 else None
        if has_mask or training is None:
            continue
        const = constant_of(training)
        if const is not None and not bool(const):
            continue
        node.resize_outputs(2)
        mask = node.outputs[1]
        mask.name = unique(f"{node.outputs[0].name}_mask")
        mask.dtype = ir.DataType.BOOL
        mask.shape = node.outputs[0].shape


def expose_pool_indices(model: ir.Model, ctx) -> None:
    """MaxPool nodes that a weight reaches also return their Indices (opset 16 on, where the
    MaxPool rule scatters at them): one MaxPool with indices in the forward instead of a
    MaxPool without them there and another with them in the backward (the CNN benchmark's
    step: 2 of its 4 MaxPools, 22% of its kernel time)."""
    if ctx.opset < 16:
        return
    for node in _reached_by_weights(model, ctx):
        if (node.op_type == "MaxPool" and node.domain in ("", "ai.onnx") and len(node.outputs) == 1
                and attr(node, "storage_order", 0) == 0):
            node.resize_outputs(2)
            indices = node.outputs[1]
            indices.name = ctx.unique(f"{node.outputs[0].name}_indices")
            indices.dtype = ir.DataType.INT64
            indices.shape = node.outputs[0].shape


def expose_norm_statistics(model: ir.Model, ctx) -> None:
    """LayerNormalization nodes (opset 17 on) that a weight reaches also return their Mean and
    InvStdDev, which onnxruntime computes anyway: the backward reads them instead of computing
    the statistics of the input again."""
    if ctx.opset < 17:
        return
    for node in _reached_by_weights(model, ctx):
        if node.op_type != "LayerNormalization" or node.domain not in ("", "ai.onnx"):
            continue
        if len(node.outputs) == 3 and all(o.name for o in node.outputs[1:]):
            continue
        x = node.inputs[0]
        stash = ir.DataType(attr(node, "stash_type", 1))
        if x.dtype is None or x.dtype.itemsize > stash.itemsize:
            continue  # statistics narrower than x (double x, float stash): the rule computes them in x's type
        dims = x.shape
        axis = attr(node, "axis", -1)
        node.resize_outputs(3)
        for out, suffix in ((node.outputs[1], "mean"), (node.outputs[2], "inv_std_dev")):
            if not out.name:
                out.name = ctx.unique(f"{node.outputs[0].name}_{suffix}")
            out.dtype = stash
            if dims is not None:
                a = axis % len(dims)
                out.shape = ir.Shape(list(dims[:a]) + [1] * (len(dims) - a))


def _reached_by_weights(model: ir.Model, ctx) -> list[ir.Node]:
    """The nodes of the main graph that a float value from ``ctx.wrt`` reaches, in order."""
    return reached_from(list(model.graph), ctx.wrt).nodes
