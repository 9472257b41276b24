"""Remove nodes whose outputs nothing uses (gradients no weight needed, dropped outputs)."""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass, RemoveUnusedOpsetsPass


def remove_unused_nodes(model: ir.Model) -> ir.Model:
    RemoveUnusedNodesPass()(model)
    RemoveUnusedOpsetsPass()(model)
    return model
