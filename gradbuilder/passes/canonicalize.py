"""Rewrite sequence idioms that exporters emit into their tensor equivalents.

Unoptimized torch exports split tensors with ``SplitToSequence`` and read the pieces back with
``SequenceAt(seq, constant index)``. When every use of the sequence is such a read, the pair is
the same as one ``Split`` (plus ``Squeeze`` for ``keepdims=0``), whose gradient is a Concat.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..registry import attr, constant_of, dims_of


def split_to_sequence_as_split(graph: ir.Graph, opset: int, unique) -> ir.Graph:
    for node in list(graph):
        if node.op_type != "SplitToSequence" or node.domain not in ("", "ai.onnx"):
            continue
        seq = node.outputs[0]
        if seq.is_graph_output():
            continue
        reads = [(use.node, use.idx) for use in seq.uses()]
        if not reads or any(u.op_type != "SequenceAt" or i != 0 for u, i in reads):
            continue
        x = node.inputs[0]
        dims = dims_of(x)
        axis = attr(node, "axis", 0)
        keepdims = attr(node, "keepdims", 1)
        split = node.inputs[1] if len(node.inputs) > 1 else None
        split_c = constant_of(split)
        if dims is None or not isinstance(dims[axis % len(dims)], int):
            continue
        length = dims[axis % len(dims)]
        if split is None:
            sizes = [1] * length
        elif split_c is not None and split_c.ndim == 0:
            step = int(split_c)
            sizes = [step] * (length // step) + ([length % step] if length % step else [])
        elif split_c is not None:
            sizes = [int(s) for s in split_c]
        else:
            continue
        indices = [constant_of(u.inputs[1]) for u, _ in reads]
        if any(i is None for i in indices):
            continue
        squeeze = split is None and not keepdims
        new_nodes = []
        sizes_v = ir.Value(name=unique(f"{seq.name}_sizes"), const_value=ir.tensor(np.array(sizes, np.int64)))
        const = ir.Node("", "Constant", [], [ir.AttrTensor("value", sizes_v.const_value)],
                        outputs=[sizes_v], name=unique(f"{node.name or seq.name}_sizes"))
        new_nodes.append(const)
        attrs = [ir.AttrInt64("axis", axis)]
        split_node = ir.Node("", "Split", [x, sizes_v], attrs, num_outputs=len(sizes),
                             name=unique(f"{node.name or seq.name}_as_split"))
        ax = axis % len(dims)
        for i, out in enumerate(split_node.outputs):
            out.name = unique(f"{seq.name}_{i}")
            out.dtype = x.dtype
            out.shape = ir.Shape([sizes[i] if k == ax else d for k, d in enumerate(x.shape)])
        new_nodes.append(split_node)
        replacements = []
        for (use, _), index in zip(reads, indices):
            piece = split_node.outputs[int(index) % len(sizes)]
            if squeeze:
                axes_v = ir.Value(name=unique(f"{piece.name}_axes"), const_value=ir.tensor(np.array([axis], np.int64)))
                new_nodes.append(ir.Node("", "Constant", [], [ir.AttrTensor("value", axes_v.const_value)],
                                         outputs=[axes_v], name=unique(f"{piece.name}_axes_node")))
                sq = ir.Node("", "Squeeze", [piece, axes_v], name=unique(f"{piece.name}_squeeze"))
                sq.outputs[0].name = unique(f"{piece.name}_squeezed")
                sq.outputs[0].dtype = x.dtype
                sq.outputs[0].shape = ir.Shape([d for k, d in enumerate(x.shape) if k != ax])
                new_nodes.append(sq)
                piece = sq.outputs[0]
            replacements.append((use.outputs[0], piece))
        graph.insert_before(node, new_nodes)
        for old, new in replacements:
            if old.is_graph_output():
                # keep the graph output's name on the new value
                name = old.name
                old.replace_all_uses_with(new, replace_graph_outputs=True)
                old.name = unique(name + "_unused")
                new.name = name
            else:
                old.replace_all_uses_with(new)
        for use, _ in reads:
            graph.remove(use, safe=True)
        graph.remove(node, safe=True)
    return graph
