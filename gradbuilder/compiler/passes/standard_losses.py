"""SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss become the operators they are made
of, after differentiation.

onnxruntime's CUDA provider has no kernel for either loss (its training build had them, the
inference build does not), so a step on a GPU ran the loss on the CPU, with a copy of the
scores to the host and a sync every step. Written as LogSoftmax, GatherElements and
reductions, every part has a CUDA kernel. The backward was built from the loss node's own rule
(``rules/losses.py``: softmax minus the one-hot, one pass), which reads the node's log-prob
output where it has one: that output becomes the LogSoftmax's.

    lp = LogSoftmax(scores, axis=1)                  (SoftmaxCrossEntropyLoss; NLL: lp = input)
    valid = target != ignore_index;  t = where(valid, target, 0)
    l = -GatherElements(lp, t[:, None], axis=1)[:, 0] * weight[t] * valid
    none: l;  sum: sum(l);  mean: sum(l) / sum(weight[t] * valid)  (mean(l) with neither)
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..emitter import Emitter
from ..values import attr

_LOSSES = ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")


def class_losses_as_standard_ops(model: ir.Model, ctx) -> None:
    graph = model.graph
    e = Emitter(graph, ctx.opset, ctx.emitter.used_names)  # fresh: its constants are forward nodes too
    changed = False
    for node in list(graph):
        if node.op_type not in _LOSSES or node.domain not in ("", "ai.onnx"):
            continue
        x, target = node.inputs[0], node.inputs[1]
        weight = node.inputs[2] if len(node.inputs) > 2 else None
        if x.dtype is None:
            continue  # its type decides the constants' types: left to the node itself
        first = len(e.nodes)
        lp = e.LogSoftmax(x, axis=1) if node.op_type == "SoftmaxCrossEntropyLoss" else x
        ignore = attr(node, "ignore_index", None)
        valid = None
        if ignore is not None:
            valid = e.Not(e.Equal(target, e.const(np.array(ignore, target.dtype.numpy()))))
            target = e.Where(valid, target, e.const(np.array(0, target.dtype.numpy())))
        picked = e.Squeeze(e.GatherElements(lp, e.Unsqueeze(target, [1]), axis=1), [1])
        scale = e.Gather(weight, target, axis=0) if weight is not None else None
        if valid is not None:
            mask = e.CastLike(valid, x)
            scale = mask if scale is None else e.Mul(scale, mask)
        each = e.Neg(picked) if scale is None else e.Mul(e.Neg(picked), scale)
        reduction = attr(node, "reduction", "mean")
        reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
        if reduction == "none":
            new = each
        elif reduction == "sum":
            new = e.reduce("ReduceSum", each, None, keepdims=False)
        elif scale is None:
            new = e.reduce("ReduceMean", each, None, keepdims=False)
        else:
            new = e.Div(e.reduce("ReduceSum", each, None, keepdims=False),
                        e.reduce("ReduceSum", scale, None, keepdims=False))
        if len(node.outputs) > 1:  # SoftmaxCrossEntropyLoss's log_prob: the LogSoftmax's output
            log_prob = node.outputs[1]
            name = log_prob.name
            log_prob.name = ctx.unique(f"{name}_replaced")
            lp.name, lp.dtype, lp.shape = name, log_prob.dtype, log_prob.shape
            log_prob.replace_all_uses_with(lp, replace_graph_outputs=True)
            node.resize_outputs(1)
        # The loss value keeps its identity (the builder and the split hold it): the node that
        # computed it passes the new value on, and onnxruntime drops the Identity
        node.replace_input_with(0, new)
        node.resize_inputs(1)
        node.attributes.clear()
        node.op_type = "Identity"
        ctx.forward.extend(e.nodes[first:])  # forward nodes, as the loss was (pipeline stages, recompute)
        changed = True
    if changed:
        graph.sort()  # the new nodes before the loss's readers
