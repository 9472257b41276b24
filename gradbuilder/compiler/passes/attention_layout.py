"""Torch's multi-head attention with one Transpose each way between tokens and heads.

torch's TorchScript exporter writes ``nn.MultiheadAttention`` (``TransformerEncoderLayer`` and
its kin, ``batch_first`` or not) in the sequence-first layout of its Python code: the tokens
``x [B, S, E]`` are transposed to ``[S, B, E]``, the packed projection ``P [S, B, 3E]`` becomes
the heads by Reshape, Unsqueeze, Transpose, Squeeze, three Gathers and, for each of q, k and v,
Reshape ``[S, B*H, d]``, Transpose and Reshape ``[B, H, S, d]``; the heads' output ``O [B, H, S, d]``
goes back by Transpose, Reshape ``[S*B, E]``, the output projection, Reshape ``[S, B, E]`` and
Transpose ``[B, S, E]``. Each of those nodes runs again in the backward, mirrored: 28 layout
nodes a layer where the arithmetic needs four.

Rewritten here before differentiation, when every size is static:

- the heads: ``Split(Transpose(Reshape(P, [S, B, 3H, d]), [1, 2, 0, 3]), axis 1)``, which gives
  q, k and v ``[B, H, S, d]`` at once (a Reshape, a Transpose and a Split). The projection keeps
  reading the transposed tokens: read from ``x`` itself, onnxruntime fuses two Transposes a
  layer fewer into the attention's products, which costs more than the one it saves;
- the output: ``Reshape(Transpose(O, [0, 2, 1, 3]), [B*S, E])`` into the output projection,
  whose rows are then in the tokens' order, and a Reshape to ``[B, S, E]`` after it.

The values are the same (only where each number lies changes), so the gradients are too; the
attention itself (scaling, masks, softmax, dropout) is not touched. A layer that differs from
these shapes in any way is left as it is; the exporter's shape reads, constant by now and
dead, do not count as readers.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..values import attr, constant_of, dims_of


def attention_heads_in_one_transpose(model: ir.Model, ctx) -> None:
    graph = model.graph
    dead = _dead_nodes(graph)  # the exporter's shape reads, folded to constants, are dead by now
    for node in list(graph):
        if node.graph is None:  # removed by an earlier rewrite
            continue
        if _is(node, "Squeeze"):
            _heads(graph, node, ctx.unique, dead)
        elif _is(node, "Transpose") and attr(node, "perm") == [2, 0, 1, 3]:
            _output(graph, node, ctx.unique, dead)


def _is(node: ir.Node | None, op: str) -> bool:
    return node is not None and node.op_type == op and node.domain in ("", "ai.onnx")


def _dead_nodes(graph: ir.Graph) -> frozenset[int]:
    """The ids of the nodes no graph output depends on (removed after differentiation)."""
    live, stack = set(), [v.producer() for v in graph.outputs if v.producer() is not None]
    while stack:
        node = stack.pop()
        if id(node) not in live:
            live.add(id(node))
            stack.extend(v.producer() for v in node.inputs if v is not None and v.producer() is not None)
    return frozenset(id(n) for n in graph if id(n) not in live)


def _uses(value: ir.Value, dead: frozenset[int]) -> list:
    return [u for u in value.uses() if id(u.node) not in dead]


def _only_use(value: ir.Value, op: str, dead: frozenset[int]) -> ir.Node | None:
    """The one live node that reads ``value``, if it is an ``op`` and ``value`` is not a graph output."""
    uses = _uses(value, dead)
    if len(uses) != 1 or value.is_graph_output() or uses[0].idx != 0 or not _is(uses[0].node, op):
        return None
    return uses[0].node


def _axes(node: ir.Node) -> list[int] | None:
    axes = attr(node, "axes")
    if axes is None and len(node.inputs) > 1:
        c = constant_of(node.inputs[1])
        axes = None if c is None else [int(a) for a in np.ravel(c)]
    return axes


def _static(value: ir.Value) -> list[int] | None:
    dims = dims_of(value)
    return list(dims) if dims is not None and all(isinstance(d, int) for d in dims) else None


def _heads(graph: ir.Graph, squeeze: ir.Node, unique, dead: frozenset[int]) -> None:
    """Squeeze(Transpose(Unsqueeze(Reshape(P, [S, B, 3, E]), 0), [3, 1, 2, 0, 4]), 3), read by
    three Gathers 0, 1, 2 each followed by Reshape [S, B*H, d], Transpose [1, 0, 2] and
    Reshape [B, H, S, d]."""
    transpose = squeeze.inputs[0].producer()
    unsqueeze = transpose.inputs[0].producer() if _is(transpose, "Transpose") else None
    reshape = unsqueeze.inputs[0].producer() if _is(unsqueeze, "Unsqueeze") else None
    if not _is(reshape, "Reshape") or _axes(squeeze) != [3] or _axes(unsqueeze) != [0] \
            or attr(transpose, "perm") != [3, 1, 2, 0, 4]:
        return
    p = reshape.inputs[0]
    dims = _static(p)
    if dims is None or len(dims) != 3 or _static(reshape.outputs[0]) != [dims[0], dims[1], 3, dims[2] // 3]:
        return
    if any(_only_use(v, op, dead) is None for v, op in ((reshape.outputs[0], "Unsqueeze"), (unsqueeze.outputs[0], "Transpose"),
                                                  (transpose.outputs[0], "Squeeze"))):
        return
    s, b, e = dims[0], dims[1], dims[2] // 3
    gathers = {}
    for use in _uses(squeeze.outputs[0], dead):
        index = constant_of(use.node.inputs[1]) if _is(use.node, "Gather") and use.idx == 0 else None
        if index is None or index.shape != () or attr(use.node, "axis", 0) != 0:
            return
        gathers[int(index)] = use.node
    if sorted(gathers) != [0, 1, 2] or len(_uses(squeeze.outputs[0], dead)) != 3:
        return
    chains, heads = [], None
    for i in range(3):
        first = _only_use(gathers[i].outputs[0], "Reshape", dead)
        swap = _only_use(first.outputs[0], "Transpose", dead) if first is not None else None
        last = _only_use(swap.outputs[0], "Reshape", dead) if swap is not None else None
        if last is None or attr(swap, "perm") != [1, 0, 2]:
            return
        mid, out = _static(first.outputs[0]), _static(last.outputs[0])
        if mid is None or out is None or len(mid) != 3 or len(out) != 4:
            return
        h, d = out[1], out[3]
        if mid != [s, b * h, d] or out != [b, h, s, d] or h * d != e or heads not in (None, (h, d)):
            return
        heads = (h, d)
        chains.append((first, swap, last))
    h, d = heads
    order = (s, b)  # P [S, B, 3E] -> [S, B, 3H, d] -> [B, 3H, S, d]
    shape = _constant(unique, f"{p.name}_heads_shape", np.array([*order, 3 * h, d], np.int64))
    split_sizes = _constant(unique, f"{p.name}_heads_split", np.array([h, h, h], np.int64))
    by_heads = _node(unique, "Reshape", [p, shape.outputs[0]], [*order, 3 * h, d], p.dtype)
    moved = _node(unique, "Transpose", [by_heads.outputs[0]], [b, 3 * h, s, d], p.dtype, perm=[1, 2, 0, 3])
    split = ir.Node("", "Split", [moved.outputs[0], split_sizes.outputs[0]], [ir.AttrInt64("axis", 1)],
                    num_outputs=3, name=unique(f"{p.name}_heads_split_node"))
    for i, out in enumerate(split.outputs):
        out.name, out.dtype, out.shape = unique(f"{p.name}_head_{'qkv'[i]}"), p.dtype, ir.Shape([b, h, s, d])
    graph.insert_before(reshape, [shape, split_sizes, by_heads, moved, split])
    for out, (_, _, last) in zip(split.outputs, chains):
        last.outputs[0].replace_all_uses_with(out)
    _drop(graph, [n for chain in chains for n in reversed(chain)]
          + [*gathers.values(), squeeze, transpose, unsqueeze, reshape])


def _output(graph: ir.Graph, transpose: ir.Node, unique, dead: frozenset[int]) -> None:
    """Transpose(O [B, H, S, d], [2, 0, 1, 3]) -> Reshape [S*B, E] -> Gemm or MatMul (+ Add) ->
    Reshape [S, B, E] -> Transpose [1, 0, 2]."""
    o = transpose.inputs[0]
    dims = _static(o)
    merge = _only_use(transpose.outputs[0], "Reshape", dead)
    if dims is None or len(dims) != 4 or merge is None:
        return
    b, h, s, d = dims
    e = h * d
    if _static(merge.outputs[0]) != [s * b, e]:
        return
    uses = _uses(merge.outputs[0], dead)
    project = uses[0].node if len(uses) == 1 and uses[0].idx == 0 and not merge.outputs[0].is_graph_output() else None
    if not (_is(project, "Gemm") and not attr(project, "transA", 0)) and not _is(project, "MatMul"):
        return
    last = project
    if _is(project, "MatMul"):
        last = _only_use(project.outputs[0], "Add", dead)
        if last is None or len(dims_of(last.inputs[1]) or ()) > 1 or len(dims_of(last.inputs[0]) or ()) > 2:
            return
    unmerge = _only_use(last.outputs[0], "Reshape", dead)
    back = _only_use(unmerge.outputs[0], "Transpose", dead) if unmerge is not None else None
    width = _static(last.outputs[0])
    if back is None or attr(back, "perm") != [1, 0, 2] or width is None or width[0] != s * b \
            or _static(unmerge.outputs[0]) != [s, b, width[1]]:
        return
    shape = _constant(unique, f"{o.name}_tokens_shape", np.array([b * s, e], np.int64))
    out_shape = _constant(unique, f"{o.name}_out_shape", np.array([b, s, width[1]], np.int64))
    tokens = _node(unique, "Transpose", [o], [b, s, h, d], o.dtype, perm=[0, 2, 1, 3])
    rows = _node(unique, "Reshape", [tokens.outputs[0], shape.outputs[0]], [b * s, e], o.dtype)
    graph.insert_before(transpose, [shape, out_shape, tokens, rows])
    project.replace_input_with(0, rows.outputs[0])
    result = _node(unique, "Reshape", [last.outputs[0], out_shape.outputs[0]], [b, s, width[1]], last.outputs[0].dtype)
    graph.insert_after(last, [result])
    back.outputs[0].replace_all_uses_with(result.outputs[0])
    _drop(graph, [back, unmerge, merge, transpose])


def _drop(graph: ir.Graph, nodes: list[ir.Node]) -> None:
    """Remove ``nodes`` (readers before what they read) that nothing reads any more; one that a
    dead node still reads stays until the cleanup after differentiation."""
    for node in nodes:
        if not any(o.uses() or o.is_graph_output() for o in node.outputs):
            graph.remove(node, safe=True)


def _constant(unique, hint: str, array: np.ndarray) -> ir.Node:
    value = ir.Value(name=unique(hint), const_value=ir.tensor(array))
    value.dtype, value.shape = ir.DataType.INT64, ir.Shape(array.shape)
    return ir.Node("", "Constant", [], [ir.AttrTensor("value", value.const_value)], outputs=[value],
                   name=unique(f"{hint}_node"))


def _node(unique, op: str, inputs, dims, dtype, **attrs) -> ir.Node:
    node = ir.Node("", op, inputs, [ir.convenience.convert_attribute(k, v) for k, v in attrs.items()],
                   name=unique(f"{inputs[0].name}_{op.lower()}_node"))
    out = node.outputs[0]
    out.name, out.dtype, out.shape = unique(f"{inputs[0].name}_{op.lower()}"), dtype, ir.Shape(dims)
    return node
