"""Fixes to the exported model before it is differentiated: Dropouts of ratio 0 dropped, an
Embedding's padding row kept from training, the sizes an export holds for, and training-mode
BatchNormalization's running statistics as outputs."""

from __future__ import annotations


import onnx
import onnx_ir as ir
import torch

from ..compiler.modelio import to_ir
from ..compiler.passes.running_stats import expose_running_statistics
from ..compiler.pipeline import Context
from ..compiler.traversal import proto_subgraphs

RUNNING = "running/"


def drop_zero_dropouts(model: onnx.ModelProto) -> None:
    """A training-mode Dropout with a constant ratio of 0 (``nn.Dropout(0.0)``, HF configs with
    dropout off) is the identity: its readers read its input instead, so that no mask is drawn,
    saved or read."""
    if any(next(proto_subgraphs(n), None) is not None for n in model.graph.node):
        return  # subgraphs could read a Dropout's output by name
    constant = {n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node
                if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"}
    constant.update({t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer})
    read = {x for n in model.graph.node for x in n.input} | {o.name for o in model.graph.output}
    dropped: dict[str, str] = {}  # output -> input
    for node in model.graph.node:
        if node.op_type != "Dropout" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        ratio = constant.get(node.input[1])
        if ratio is None or ratio.size != 1 or float(ratio) != 0.0 or any(o in read for o in node.output[1:]):
            continue
        dropped[node.output[0]] = node.input[0]
    if not dropped:
        return
    outputs = {o.name for o in model.graph.output}
    kept = []
    for node in model.graph.node:
        if node.op_type == "Dropout" and node.output[0] in dropped:
            if node.output[0] in outputs:  # a graph output keeps its name
                kept.append(onnx.helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name))
            continue
        for i, x in enumerate(node.input):
            while x in dropped:
                x = dropped[x]
            node.input[i] = x
        kept.append(node)
    del model.graph.node[:]
    model.graph.node.extend(kept)


def embedding_padding(model: onnx.ModelProto, fed: dict[str, str], module) -> list[str]:
    """``nn.Embedding(padding_idx=p)`` gives row p no gradient; its export is a plain Gather.
    Each Gather of such a weight becomes Where(ids == p, Gather(stop-gradient copy of the
    weight, ids), Gather(weight, ids)): the same values, and row p gets no gradient from it
    (a tied weight still gets the gradient of its other uses). Returns the copies' names."""
    h = onnx.helper
    padding = {f"{name}.weight" if name else "weight": m.padding_idx for name, m in module.named_modules()
               if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None}
    weight_of = {graph_name: padding[param] for graph_name, param in fed.items() if param in padding}
    if not weight_of:
        return []
    nodes, stops = [], []
    for node in model.graph.node:
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if node.op_type != "Gather" or node.input[0] not in weight_of or axis != 0:
            nodes.append(node)
            continue
        w, ids, out = node.input[0], node.input[1], node.output[0]
        p = f"{node.name or out}/padding"
        pad = weight_of[w]
        nodes += [
            h.make_node("Gather", [w, ids], [p + "_rows"], name=node.name),
            h.make_node("Identity", [w], [p + "_weight_nograd"]),
            h.make_node("Gather", [p + "_weight_nograd", ids], [p + "_rows_nograd"]),
            h.make_node("Constant", [], [p + "_idx"], value=h.make_tensor(p + "_idx_t", onnx.TensorProto.INT64, [], [pad])),
            h.make_node("CastLike", [p + "_idx", ids], [p + "_idx_x"]),
            h.make_node("Equal", [ids, p + "_idx_x"], [p + "_is_pad"]),
            h.make_node("Constant", [], [p + "_last"], value=h.make_tensor(p + "_last_t", onnx.TensorProto.INT64, [1], [-1])),
            h.make_node("Unsqueeze", [p + "_is_pad", p + "_last"], [p + "_is_pad_u"]),
            h.make_node("Where", [p + "_is_pad_u", p + "_rows_nograd", p + "_rows"], [out]),
        ]
        stops.append(p + "_weight_nograd")
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return stops


# Inputs that take a shape, or positions along one.
_SHAPE_INPUTS = {"Reshape": (1,), "Expand": (1,), "Tile": (1,), "ConstantOfShape": (0,), "Range": (0, 1, 2),
                 "Slice": (1, 2), "Resize": (3,), "Upsample": (1,), "Pad": (1,)}


_SHAPE_ARITHMETIC = {"Concat", "Unsqueeze", "Squeeze", "Cast", "Mul", "Add", "Sub", "Div", "Identity"}


def fixed_sizes(model: onnx.ModelProto, sizes: set[int]) -> str | None:
    """Where the tracer turned an input size into a constant: a constant equal to one of the
    traced inputs' sizes (other than 1) that reaches a shape input through shape
    arithmetic. torch's MultiheadAttention, for one, reshapes with the traced sequence
    length as a number. None when there is none."""
    producer = {o: n for n in model.graph.node for o in n.output}
    inits = {t.name: t for t in model.graph.initializer}

    def constants(name, depth=0):
        node = producer.get(name)
        if name in inits:
            yield onnx.numpy_helper.to_array(inits[name])
        elif node is not None and node.op_type == "Constant" and node.attribute[0].name == "value":
            yield onnx.numpy_helper.to_array(node.attribute[0].t)
        elif node is not None and node.op_type in _SHAPE_ARITHMETIC and depth < 8:
            for i in node.input[:1] if node.op_type in ("Unsqueeze", "Squeeze") else node.input:
                yield from constants(i, depth + 1)

    for node in model.graph.node:
        for index in _SHAPE_INPUTS.get(node.op_type, ()):
            if index < len(node.input) and node.input[index]:
                for value in constants(node.input[index]):
                    hit = sorted(sizes & {int(v) for v in value.ravel().tolist()}) if value.dtype.kind in "iu" else []
                    if hit:
                        return f"node '{node.name}' ({node.op_type}) takes the traced size {hit[0]} as a constant"
    return None


def running_stats(model: onnx.ModelProto, fed: dict[str, str],
                   module) -> tuple[onnx.ModelProto, dict[str, str], list[str]]:
    """Each training-mode BatchNormalization's new running mean and variance (the variance
    unbiased, as in PyTorch) as graph outputs ``running/<buffer>``
    (``passes.running_stats.expose_running_statistics``); the model, graph output -> buffer,
    and the num_batches_tracked buffers beside them."""
    if not any(n.op_type == "BatchNormalization" for n in model.graph.node):
        return model, {}, []
    ir_model = to_ir(model)
    graph = ir_model.graph
    ctx = Context.of(ir_model, running_statistics=True, unbiased_variance=True)
    e = ctx.emitter
    running: dict[str, str] = {}
    counters: list[str] = []
    buffers = dict(module.named_buffers())
    expose_running_statistics(ir_model, ctx)
    for old, new in ctx.buffers:
        if old.name not in fed:  # a constant, not a buffer of the module
            continue
        buffer = fed[old.name]
        name = RUNNING + buffer
        if new.is_graph_output() or new.is_graph_input():
            new = e.Identity(new)
        new.name = name
        new.dtype, new.shape = old.dtype, ir.Shape(list(buffers[buffer].shape))
        graph.outputs.append(new)
        running[name] = buffer
        counter = buffer.removesuffix("running_mean") + "num_batches_tracked"  # the same module's
        if buffer.endswith("running_mean") and counter in buffers:
            counters.append(counter)
    return ir.to_proto(ir_model), running, counters
