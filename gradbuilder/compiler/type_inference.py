"""Element types and shapes for every value of a model: onnx's shape inference, strict where it
can be, and the loop bodies (Loop, Scan) typed and ranked from their outer graph where onnx
leaves them untyped (``infer_types``); a graph's name -> type map (``value_types``)."""

from __future__ import annotations

import onnx

from .traversal import proto_subgraphs


def infer_types(proto: onnx.ModelProto) -> None:
    """Strict type and shape inference, in place (run on the weight-free skeleton).

    Data propagation (shapes computed by Shape/Gather/Concat/... at run time) finds more
    ranks and sizes, but onnx's propagation also fails on some valid models (Unsqueeze of a
    1-D float tensor followed by an elementwise op: it takes the tensor's dims for shape
    data); a model that type-checks without it is then inferred without it.
    """
    if _untyped_loop_bodies(proto.graph):  # a first pass gives the types their inputs imply
        _type_loop_bodies(proto.graph, onnx.shape_inference.infer_shapes(proto).graph)
    _rank_loop_bodies(proto)
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True, data_prop=True)
    except onnx.shape_inference.InferenceError:
        inferred = onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)
    _take_types(proto.graph, inferred.graph)


_LOOPS = ("Loop", "Scan")


def _loop_nodes(graph: onnx.GraphProto):
    """(graph, node) for the Loop and Scan nodes of ``graph`` and of its subgraphs."""
    for node in graph.node:
        if node.op_type in _LOOPS and node.domain in ("", "ai.onnx"):
            yield graph, node
        for g in proto_subgraphs(node):
            yield from _loop_nodes(g)


def value_types(graph: onnx.GraphProto, types: dict | None = None) -> dict[str, onnx.TypeProto]:
    """Value name -> type, over ``graph`` and its subgraphs (names are unique in a model)."""
    types = {} if types is None else types
    for t in graph.initializer:
        types[t.name] = onnx.helper.make_tensor_type_proto(t.data_type, list(t.dims))
    for v in list(graph.input) + list(graph.value_info) + list(graph.output):
        types[v.name] = v.type
    for node in graph.node:
        for g in proto_subgraphs(node):
            value_types(g, types)
    return types


def _rank_of(t: onnx.TypeProto | None) -> int | None:
    if t is None or not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
        return None
    return len(t.tensor_type.shape.dim)


def _loop_body_pairs(node: onnx.NodeProto):
    """(body input, outer value it starts from, rank offset, body output that carries it on or
    None, node output of its final value or None) for the tensors a Loop or Scan body
    receives from outside."""
    body = next(a.g for a in node.attribute if a.name == "body")
    if node.op_type == "Loop":
        for k, value in enumerate(body.input[2:]):
            if 2 + k < len(node.input) and node.input[2 + k] and 1 + k < len(body.output):
                final = node.output[k] if k < len(node.output) else None
                yield value, node.input[2 + k], 0, body.output[1 + k].name, final
        return
    m = next((a.i for a in node.attribute if a.name == "num_scan_inputs"), 0)
    n_states = len(node.input) - m
    for k, value in enumerate(body.input[:n_states]):
        final = node.output[k] if k < len(node.output) else None
        yield value, node.input[k], 0, body.output[k].name if k < len(body.output) else None, final
    for j, value in enumerate(body.input[n_states:]):
        yield value, node.input[n_states + j], -1, None, None  # one slice along the scanned axis


def _rank_loop_bodies(proto: onnx.ModelProto) -> None:
    """Declare the rank (not the sizes) of Loop and Scan body inputs that have a tensor type
    but no shape, so shape inference reaches inside the body (onnx does not pass the shapes
    of loop-carried values on), and of the loop's final values. A carried value keeps the
    rank of its initial value only if the body gives it back with that rank: each assumption
    is checked by inferring with it, and dropped when the body's output disagrees. Each pass
    reaches one more level of nested or chained loops."""
    refused: set[str] = set()
    for _ in range(4):
        if not any(v.type.HasField("tensor_type") and not v.type.tensor_type.HasField("shape")
                   and v.name not in refused
                   for _, node in _loop_nodes(proto.graph) for v, *_ in _loop_body_pairs(node)):
            return  # (no inference pass for models without such loops)
        types = value_types(onnx.shape_inference.infer_shapes(proto).graph)
        assumed = []
        for graph, node in _loop_nodes(proto.graph):
            for value, outer, offset, carried_out, final in _loop_body_pairs(node):
                tt = value.type.tensor_type
                rank = _rank_of(types.get(outer))
                if (not value.type.HasField("tensor_type") or tt.HasField("shape") or value.name in refused
                        or rank is None or rank + offset < 0):
                    continue
                _set_rank(tt, rank + offset)
                assumed.append((graph, value, carried_out, final, rank + offset))
        if not assumed:
            return
        checked = value_types(onnx.shape_inference.infer_shapes(proto).graph)
        for graph, value, carried_out, final, rank in assumed:
            if carried_out is not None and _rank_of(checked.get(carried_out)) != rank:
                value.type.tensor_type.ClearField("shape")
                refused.add(value.name)
            elif final and _rank_of(checked.get(final)) is None and not any(o.name == final for o in graph.output):
                info = graph.value_info.add()
                info.name = final
                info.type.tensor_type.elem_type = value.type.tensor_type.elem_type
                _set_rank(info.type.tensor_type, rank)


def _set_rank(tt: onnx.TypeProto.Tensor, rank: int) -> None:
    """A shape of ``rank`` axes of unknown size."""
    tt.shape.SetInParent()
    for _ in range(rank):
        tt.shape.dim.add()


def _untyped_loop_bodies(graph: onnx.GraphProto) -> bool:
    return any(node.op_type in ("Loop", "Scan") and node.domain in ("", "ai.onnx")
               and any(not i.type.WhichOneof("value") for a in node.attribute if a.name == "body" for i in a.g.input)
               for node in graph.node)


def _type_loop_bodies(graph: onnx.GraphProto, inferred: onnx.GraphProto) -> None:
    """Give untyped Loop/Scan body inputs (as in some ONNX function bodies) the types the
    node's inputs imply, so shape inference can reach inside the body."""
    types = value_types(inferred)
    for node in graph.node:
        if node.op_type not in ("Loop", "Scan") or node.domain not in ("", "ai.onnx"):
            continue
        body = next(a.g for a in node.attribute if a.name == "body")
        if all(i.type.WhichOneof("value") for i in body.input):
            continue
        scan_inputs = next((a.i for a in node.attribute if a.name == "num_scan_inputs"), 0)
        axes = next((list(a.ints) for a in node.attribute if a.name == "scan_input_axes"), [0] * scan_inputs)
        if node.op_type == "Loop":
            sources = [onnx.helper.make_tensor_type_proto(onnx.TensorProto.INT64, []),
                       onnx.helper.make_tensor_type_proto(onnx.TensorProto.BOOL, [])]
            sources += [types.get(name) for name in node.input[2:]]
        else:
            n_states = len(node.input) - scan_inputs
            sources = [types.get(name) for name in node.input[:n_states]]
            for name, axis in zip(node.input[n_states:], axes):
                t = types.get(name)
                if t is not None and t.HasField("tensor_type") and t.tensor_type.HasField("shape"):
                    t = onnx.TypeProto.FromString(t.SerializeToString())
                    dims = t.tensor_type.shape.dim
                    del dims[axis % len(dims)]
                sources.append(t)
        for value, source in zip(body.input, sources):
            if not value.type.WhichOneof("value") and source is not None:
                value.type.CopyFrom(source)


def _take_types(ours: onnx.GraphProto, theirs: onnx.GraphProto) -> None:
    """Copy the inferred value types of ``theirs`` (same nodes) into ``ours``, subgraphs too."""
    del ours.value_info[:]
    ours.value_info.extend(theirs.value_info)
    for mine, inferred in zip(ours.output, theirs.output):
        mine.CopyFrom(inferred)
    for node, inferred_node in zip(ours.node, theirs.node):
        for g, h in zip(proto_subgraphs(node), proto_subgraphs(inferred_node)):
            _take_types(g, h)
