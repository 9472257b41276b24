"""Give training-mode Dropout nodes a mask output, so their gradient uses the exact mask.

Runs on the private copy of the forward graph before differentiation; the node computes the
same values, it only also returns the mask it drew.
"""

from __future__ import annotations

import onnx_ir as ir

from ..registry import constant_of


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
