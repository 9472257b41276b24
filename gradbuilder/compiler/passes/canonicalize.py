"""Rewrite sequence idioms that exporters emit into their tensor equivalents.

Unoptimized torch exports split tensors with ``SplitToSequence`` and read the pieces back with
``SequenceAt(seq, constant index)``. When every use of the sequence is such a read, the pair is
the same as one ``Split`` (plus ``Squeeze`` for ``keepdims=0``), whose gradient is a Concat.

onnxscript's constant folder folds the exporters' shape subgraphs (``fold_shape_computations``).
It also rewrites some SplitToSequence nodes, but not one without ``split`` (a piece per element,
``keepdims``), and below opset 18 it writes a Split that onnx.checker refuses; so the rewrites
here run first. List appends in a Loop body stacked after the loop are a rewrite across the body
and the outer graph, which onnxscript's pattern rewriter (matching within one graph) does not
express.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..traversal import has_subgraph
from ..values import attr, constant_of, dims_of
from ..emitter import collect_names
from . import copy_type


def split_to_sequence_as_split(model: ir.Model, ctx) -> None:
    graph, unique = model.graph, ctx.unique
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


def sequence_appends_as_scan_outputs(model: ir.Model, ctx) -> None:
    """A Loop that appends one tensor per iteration to a loop-carried sequence, read after
    the loop only by ``ConcatFromSequence``, is a Loop with that tensor as a scan output.

    This is how torch's exporter writes ``outs.append(h)`` in a scripted loop followed by
    ``torch.stack(outs)`` (or ``torch.cat(outs)``). The scan output is stacked along axis 0;
    a stack along another axis becomes a Transpose, a concatenation along axis 0 a Reshape.
    """
    graph, unique = model.graph, ctx.unique
    for node in list(graph):
        if node.op_type != "Loop" or node.domain not in ("", "ai.onnx"):
            continue
        for k in reversed(range(len(node.inputs) - 2)):
            if _appended_sequence(node, k):
                node = _as_scan_output(graph, node, k, unique)


def _appended_sequence(node: ir.Node, k: int):
    """The SequenceInsert appending to carried value ``k`` of ``node``, if the idiom holds."""
    body = node.attributes["body"].value
    init, seq_in, seq_out = node.inputs[2 + k], body.inputs[2 + k], body.outputs[1 + k]
    start = init.producer() if init is not None else None
    if start is None or not (start.op_type == "SequenceEmpty"
                             or (start.op_type == "SequenceConstruct" and not start.inputs)):
        return None
    uses = list(seq_in.uses())
    if len(uses) != 1 or uses[0].node.op_type != "SequenceInsert" or uses[0].idx != 0:
        return None
    insert = uses[0].node
    if len(insert.inputs) > 2 or insert.outputs[0] is not seq_out or list(seq_out.uses()):
        return None
    if list(body.outputs).count(seq_out) != 1 or seq_out in body.outputs[:1 + k]:
        return None
    final = node.outputs[k]
    if final.is_graph_output():
        return None
    reads = [u.node for u in final.uses()]
    element_rank = len(insert.inputs[1].shape) if insert.inputs[1].shape is not None else None
    for r in reads:
        if r.op_type != "ConcatFromSequence" or r.graph is not node.graph:
            return None
        axis, new_axis = attr(r, "axis", 0), attr(r, "new_axis", 0)
        if new_axis and axis not in (0, -(element_rank or 0) - 1) and element_rank is None:
            return None
        if not new_axis and axis != 0:
            return None
    return insert


def _as_scan_output(graph: ir.Graph, node: ir.Node, k: int, unique) -> ir.Node:
    body = node.attributes["body"].value
    insert = _appended_sequence(node, k)
    element = insert.inputs[1]
    body.inputs.pop(2 + k)
    body.outputs.pop(1 + k)
    body.remove(insert, safe=True)
    copy = ir.Node("", "Identity", [element], name=unique(f"{element.name}_scan_node"))
    copy.outputs[0].name = unique(f"{element.name}_scan")
    copy_type(copy.outputs[0], element)
    body.append(copy)
    body.outputs.append(copy.outputs[0])

    inputs = [v for i, v in enumerate(node.inputs) if i != 2 + k]
    new = ir.Node("", "Loop", inputs, list(node.attributes.values()), num_outputs=len(node.outputs),
                  name=node.name or unique("Loop_scan_outputs"))
    old_outputs = [o for i, o in enumerate(node.outputs) if i != k]
    for old, out in zip(old_outputs, new.outputs):
        copy_type(out, old)
    stacked = new.outputs[-1]
    stacked.name = unique(f"{node.outputs[k].name}_stacked")
    copy_type(stacked, element, stacked=True)
    graph.insert_before(node, new)
    for r in [u.node for u in node.outputs[k].uses()]:
        _replace_concat(graph, r, stacked, element, unique)
    for old, out in zip(old_outputs, new.outputs):
        name = old.name
        old.replace_all_uses_with(out, replace_graph_outputs=True)
        old.name = unique(name + "_unused")
        out.name = name
    graph.remove(node, safe=True)
    return new


def _replace_concat(graph: ir.Graph, concat: ir.Node, stacked: ir.Value, element: ir.Value, unique) -> None:
    """ConcatFromSequence of the appended tensors, from their stack along axis 0."""
    axis, new_axis = attr(concat, "axis", 0), attr(concat, "new_axis", 0)
    nodes = []
    if new_axis:
        rank = len(element.shape) + 1 if element.shape is not None else None
        axis = axis % rank if rank is not None else 0
        if axis == 0:
            result = ir.Node("", "Identity", [stacked], name=unique(f"{concat.name or 'stack'}_as_scan"))
        else:
            perm = list(range(1, axis + 1)) + [0] + list(range(axis + 1, rank))
            result = ir.Node("", "Transpose", [stacked], [ir.AttrInt64s("perm", perm)],
                             name=unique(f"{concat.name or 'stack'}_as_scan"))
    else:  # concatenation along axis 0: merge the stack axis into the first
        consts = {}
        for key, value in (("minus_one", [-1]), ("two", [2]), ("end", [2**62]), ("zero", [0])):
            consts[key] = ir.Value(name=unique(key), const_value=ir.tensor(np.array(value, np.int64)))
            nodes.append(ir.Node("", "Constant", [], [ir.AttrTensor("value", consts[key].const_value)],
                                 outputs=[consts[key]], name=unique(f"{key}_node")))
        shape = ir.Node("", "Shape", [stacked], name=unique("stacked_shape"))
        tail = ir.Node("", "Slice", [shape.outputs[0], consts["two"], consts["end"], consts["zero"]],
                       name=unique("stacked_tail"))
        target = ir.Node("", "Concat", [consts["minus_one"], tail.outputs[0]], [ir.AttrInt64("axis", 0)],
                         name=unique("concat_shape"))
        result = ir.Node("", "Reshape", [stacked, target.outputs[0]], name=unique(f"{concat.name or 'cat'}_as_scan"))
        nodes += [shape, tail, target]
    nodes.append(result)
    graph.insert_before(concat, nodes)
    out = concat.outputs[0]
    copy_type(result.outputs[0], out)
    name = out.name
    out.replace_all_uses_with(result.outputs[0], replace_graph_outputs=True)
    out.name = unique(name + "_unused")
    result.outputs[0].name = name
    graph.remove(concat, safe=True)


_INDEX_OF = {"ReduceMax": "ArgMax", "ReduceMin": "ArgMin"}


def indexed_max_as_gather(model: ir.Model, ctx) -> None:
    """``torch.max(x, dim)`` (and ``min``) with its indices used is exported as ReduceMax and
    ArgMax of the same ``x`` along the same single axis. PyTorch sends the values' gradient to
    the returned index only, where ReduceMax's splits it among ties: the values become
    GatherElements(x, ArgMax(x, axis, keepdims=1)) (squeezed when keepdims=0), with the
    ArgMax's ``select_last_index``. A ReduceMax without such an ArgMax (``torch.amax``, or
    ``torch.max(x, dim)`` whose indices nothing reads) keeps its own gradient."""
    graph, opset, unique = model.graph, ctx.opset, ctx.unique
    index_nodes: dict[tuple, ir.Node] = {}
    for node in graph:
        if node.op_type in ("ArgMax", "ArgMin") and node.domain in ("", "ai.onnx"):
            index_nodes.setdefault((node.op_type, id(node.inputs[0]), _axis(node, attr(node, "axis", 0))), node)
    for node in list(graph):
        if node.op_type not in _INDEX_OF or node.domain not in ("", "ai.onnx"):
            continue
        axes = attr(node, "axes") if len(node.inputs) < 2 else constant_of(node.inputs[1])
        if axes is None or len(np.ravel(axes)) != 1:
            continue
        x = node.inputs[0]
        axis = _axis(node, int(np.ravel(axes)[0]))
        index_node = index_nodes.get((_INDEX_OF[node.op_type], id(x), axis))
        if index_node is None or axis is None:
            continue
        _as_gather(graph, node, index_node, axis, opset, unique)


def _axis(node: ir.Node, axis: int) -> int | None:
    """``axis`` of ``node``'s first input made non-negative; None when its rank is unknown."""
    shape = node.inputs[0].shape
    if axis >= 0:
        return axis
    return axis % len(shape) if shape is not None else None


def _as_gather(graph: ir.Graph, reduce: ir.Node, index_node: ir.Node, axis: int, opset: int, unique) -> None:
    x, out = reduce.inputs[0], reduce.outputs[0]
    base = reduce.name or out.name
    index = ir.Node("", index_node.op_type, [x], [ir.AttrInt64("axis", axis), ir.AttrInt64("keepdims", 1),
                    ir.AttrInt64("select_last_index", attr(index_node, "select_last_index", 0))],
                    name=unique(f"{base}_index"))
    gather = ir.Node("", "GatherElements", [x, index.outputs[0]], [ir.AttrInt64("axis", axis)],
                     name=unique(f"{base}_at_index"))
    kept = ir.Shape([1 if k == axis else d for k, d in enumerate(x.shape)]) if x.shape is not None else None
    for node, dtype in ((index, ir.DataType.INT64), (gather, x.dtype)):
        node.outputs[0].name, node.outputs[0].dtype, node.outputs[0].shape = unique(node.name), dtype, kept
    nodes, result = [index, gather], gather.outputs[0]
    if not attr(reduce, "keepdims", 1):
        if opset >= 13:
            axes = ir.Value(name=unique(f"{base}_axes"), const_value=ir.tensor(np.array([axis], np.int64)))
            nodes.append(ir.Node("", "Constant", [], [ir.AttrTensor("value", axes.const_value)], outputs=[axes],
                                 name=unique(f"{base}_axes")))
            squeeze = ir.Node("", "Squeeze", [result, axes], name=unique(f"{base}_squeeze"))
        else:
            squeeze = ir.Node("", "Squeeze", [result], [ir.AttrInt64s("axes", [axis])], name=unique(f"{base}_squeeze"))
        nodes.append(squeeze)
        result = squeeze.outputs[0]
        result.name = unique(f"{base}_squeezed")
    copy_type(result, out)
    graph.insert_before(reduce, nodes)
    name = out.name
    out.replace_all_uses_with(result, replace_graph_outputs=True)
    if result.is_graph_output():  # the graph output keeps its name
        out.name = unique(name + "_unused")
        result.name = name
    graph.remove(reduce, safe=True)


def fold_shape_computations(model: ir.Model, ctx) -> None:
    """Fold, with onnxscript's constant folder, the integer and bool computations whose inputs
    are known: the exporters' shape subgraphs (Shape of a value of static shape, then Gather,
    Concat, Unsqueeze, Mod, ... of constants), which onnx shape inference cannot see through,
    so that the sizes and ranks they compute become constants. Nodes with a float output are
    never touched, nor are their inputs rewired (the folder would otherwise read through an
    Identity that is a stop-gradient point): the weights, and every gradient path, stay as
    they are."""
    from onnxscript.optimizer import constant_folding

    class ShapeFolder(constant_folding.FoldConstantsPass):
        def process_node(self, node, is_function):
            if node.domain not in ("", "ai.onnx") or not all(_integer_like(o) for o in node.outputs):
                if node.domain in ("", "ai.onnx") and not has_subgraph(node) and _shape_unknown(node):
                    self._do_inference(node)  # a shape the folded sizes now give (a Reshape's)
                return None
            return super().process_node(node, is_function)

    ShapeFolder(shape_inference=False, input_size_limit=1024, output_size_limit=1024)(model)
    ctx.emitter.reserve(*collect_names(model.graph))  # the folder's new names are taken too




def _shape_unknown(node: ir.Node) -> bool:
    """Some output of ``node`` lacks a rank or a size that its inputs may now give."""
    return any(o.shape is None or any(not isinstance(d, int) for d in o.shape) for o in node.outputs)


def _integer_like(value: ir.Value) -> bool:
    return value.dtype is not None and not value.dtype.is_floating_point()


def bfloat16_indices_in_float32(model: ir.Model, ctx) -> None:
    """ArgMax and ArgMin of a bfloat16 tensor read it cast to float32: onnxruntime's CPU provider
    has no bfloat16 kernel for them, and the cast is exact, so the index is the same."""
    graph, unique = model.graph, ctx.unique
    for node in list(graph):
        if node.op_type not in ("ArgMax", "ArgMin") or node.domain not in ("", "ai.onnx"):
            continue
        x = node.inputs[0]
        if x.dtype != ir.DataType.BFLOAT16:
            continue
        cast = ir.Node("", "Cast", [x], [ir.AttrInt64("to", ir.DataType.FLOAT)], name=unique(f"{node.name}_float"))
        wide = cast.outputs[0]
        wide.name, wide.dtype, wide.shape = unique(f"{x.name}_float"), ir.DataType.FLOAT, x.shape
        graph.insert_before(node, cast)
        node.replace_input_with(0, wide)
