"""Graph breaks: a module whose call applies ``torch.autograd.Function``s runs as onnxruntime
graphs with PyTorch between them.

The exporter writes each application as one ``FunctionBreak`` node (``export.FunctionCall``).
The graph is cut around those nodes into segments. A node's segment is at least the latest
segment of the values it reads, where a value a break returns belongs to the segment after the
one its own inputs were ready in (a break runs once the segment its inputs come from has run),
and then as late as the nodes reading it allow (a weight's transpose runs beside the layer that
reads it, instead of crossing from the first segment).
Constants (not random draws) are copied into each segment that reads them, as pipeline stages
copy them (``compiler.cuts``). Each segment is compiled like a whole
module (its own forward and backward graphs, ``compiled.Compiled``) and runs as an
``ORTFunction``; the Functions run through their own ``apply``. PyTorch's autograd chains them
all, so a Function's backward is the one it defines and the gradients reach the parameters of
the segments before it. Tensors cross as DLPack views, without copies.

Each break costs a return to Python, the Function's own forward and backward in PyTorch, and
one more onnxruntime run each way for the segment after it; the segments are optimized apart
(onnxruntime fuses nothing across a break).
"""

from __future__ import annotations

import dataclasses

import onnx

from ..compiler import modelio
from ..compiler.cuts import constant_nodes, constants_read, inferred_types
from ..dtypes import FLOAT_TENSOR_TYPES
from ..errors import ExportError
from .compiled import ORTFunction
from .export import Exported
from .function_calls import BREAK, FunctionCall
from .stops import STOP_DOMAIN
from .options import logger


@dataclasses.dataclass
class Segment:
    """The nodes of one segment as a model in ``Exported``'s form: ``exported.model`` reads
    ``inputs`` and returns ``exported.outputs``; ``wrt`` are the inputs it differentiates."""

    exported: Exported
    inputs: list[str]
    wrt: list[str]


def is_break(node: onnx.NodeProto) -> bool:
    return node.domain == STOP_DOMAIN and node.op_type == BREAK


def cut(ex: Exported, wrt: set[str]) -> list:
    """The steps of ``ex`` in run order: Segments and FunctionCalls (their ``inputs`` and
    ``outputs`` filled in). ``wrt`` are the module's graph inputs that take gradients; every
    float value a Function or a segment hands on may take one too."""
    graph = ex.model.graph
    nodes = list(graph.node)
    reads = [modelio.node_reads(n) for n in nodes]
    graph_outputs = {o.name for o in graph.output}
    # (a constant the module returns is computed once, in a segment; random draws are never copied)
    constant = constant_nodes(nodes, reads, {t.name for t in graph.initializer}, kept=graph_outputs)
    # a constant a Function takes is computed in a segment and crosses into PyTorch
    into_breaks = set().union(*(r for n, r in zip(nodes, reads) if is_break(n)))
    constant = [c and not (into_breaks & set(n.output)) for c, n in zip(constant, nodes)]
    segment_of, breaks_after, last = _place(ex, nodes, reads, constant, graph_outputs)
    types = inferred_types(_without_breaks(ex.model, ex.calls))
    steps: list = []
    for s in range(last + 1):
        mine = [i for i, st in segment_of.items() if st == s and not is_break(nodes[i])]
        # read after this segment: by later segments, and by the breaks after it or later
        later = set().union(*(reads[i] for i, st in segment_of.items() if st > s or (st == s and is_break(nodes[i]))))
        if mine:
            steps.append(_segment(ex, nodes, reads, constant, sorted(mine), s, later | graph_outputs, types, wrt))
        steps += breaks_after.get(s, [])
    return steps


def _place(ex: Exported, nodes, reads, constant, graph_outputs: set[str]):
    """Each node's segment (a break's: the segment it runs after), the FunctionCalls after each
    segment, and the last segment: every node first as early as what it reads allows, then as
    late as what reads it allows."""
    level: dict[str, int] = {}  # value -> the segment it is ready after
    segment_of: dict[int, int] = {}  # node -> its segment (constants: none, breaks: the one before them)
    breaks_after: dict[int, list[FunctionCall]] = {}
    # A value a Function changes in place: its readers keep their place in the program around
    # the break (the graph's node order): those before it run before it, those after it after.
    changed_at: dict[str, list[tuple[int, int]]] = {}  # value -> (break node, its segment)
    for i, (node, r) in enumerate(zip(nodes, reads)):
        if constant[i]:
            continue
        s = max((level.get(v, 0) for v in r), default=0)
        s = max([s] + [at + 1 for v in r for _, at in changed_at.get(v, [])])
        if is_break(node):
            call = ex.calls[next(a.i for a in node.attribute if a.name == "index")]
            call.inputs, call.outputs = list(node.input), list(node.output)
            changed = {call.inputs[k] for k in call.changes}
            s = max([s] + [segment_of[j] for j in segment_of if reads[j] & changed])  # after what read them
            for v in changed:
                changed_at.setdefault(v, []).append((i, s))
            segment_of[i] = s
            breaks_after.setdefault(s, []).append(call)
            s += 1
        else:
            segment_of[i] = s
        for o in node.output:
            level[o] = s
    last = max(list(level.values()) + [0])
    # then each node as late as what reads it allows: a weight's transpose runs in the segment
    # of the layer that reads it rather than crossing from the first segment
    readers: dict[str, list[int]] = {}
    for i in segment_of:
        for v in reads[i]:
            readers.setdefault(v, []).append(i)
    for i in reversed(sorted(segment_of)):
        if is_break(nodes[i]):
            continue
        later = [segment_of[j] for o in nodes[i].output for j in readers.get(o, [])]
        if graph_outputs & set(nodes[i].output):
            later.append(last)
        later += [at for v in reads[i] for j, at in changed_at.get(v, []) if i < j]  # before the change
        if later:
            segment_of[i] = min(later)
    return segment_of, breaks_after, last


def _without_breaks(model: onnx.ModelProto, calls: list[FunctionCall]) -> onnx.ModelProto:
    """``model`` without its break nodes, whose outputs become inputs typed as the exporter
    wrote them or, where it left them untyped, as traced (shape inference knows no
    FunctionBreak)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    typed = {v.name: v for v in graph.value_info if v.type.WhichOneof("value")}
    kept = [n for n in graph.node if not is_break(n)]
    del graph.node[:]
    graph.node.extend(kept)
    for call in calls:
        for name, (elem, rank) in zip(call.outputs, call.output_types):
            if name in typed:
                graph.input.append(typed[name])
            elif elem:
                graph.input.append(onnx.helper.make_tensor_value_info(name, elem, None if rank is None else
                                                                      [None] * rank))
    return copy


def _segment(ex: Exported, nodes, reads, constant, mine: list[int], s: int, read_later: set[str], types,
             module_wrt: set[str]) -> Segment:
    graph = ex.model.graph
    needed = set().union(*(reads[i] for i in mine))
    copied = constants_read(nodes, reads, constant, needed)
    produced = {o for i in mine + copied for o in nodes[i].output}
    initializers = {t.name for t in graph.initializer}
    inputs = [v for v in dict.fromkeys(v for i in mine for v in sorted(reads[i]))
              if v not in produced and v not in initializers]
    outputs = [o for i in mine for o in nodes[i].output if o and o in read_later]
    declared = {v.name: v for v in (*graph.input, *graph.output, *graph.value_info)}

    def info(name: str) -> onnx.ValueInfoProto:
        if name in declared and declared[name].type.WhichOneof("value"):
            return declared[name]
        return onnx.helper.make_value_info(name, types[name]) if name in types else \
            onnx.helper.make_empty_tensor_value_info(name)

    def is_float(name: str) -> bool:
        return info(name).type.tensor_type.elem_type in FLOAT_TENSOR_TYPES

    fed = set(ex.inputs) | set(ex.state)  # the module's own inputs: only those that take gradients
    wrt = [v for v in inputs if is_float(v) and (v in module_wrt or v not in fed)]
    grads = set(wrt)  # which outputs depend on them
    for i in sorted(mine + copied):
        if reads[i] & grads:
            grads.update(nodes[i].output)
    body = onnx.helper.make_graph(
        [nodes[i] for i in sorted(mine + copied)], f"{graph.name}_segment{s}",
        [info(v) for v in inputs], [info(v) for v in outputs],
        [t for t in graph.initializer if t.name in needed],
        value_info=[v for v in graph.value_info if v.name in produced and v.name not in outputs])
    model = onnx.helper.make_model(body, opset_imports=[o for o in ex.model.opset_import if o.domain != STOP_DOMAIN],
                                   ir_version=ex.model.ir_version, functions=list(ex.model.functions))
    part = dataclasses.replace(
        ex, model=model, inputs={}, state={}, outputs=outputs,
        differentiable=[o in grads and is_float(o) for o in outputs], running={}, batch_counters=[],
        stop_gradients=[v for v in ex.stop_gradients if v in produced], calls=[], torch_exported=None)
    return Segment(part, inputs, wrt)


def describe(steps: list) -> str:
    """Where the breaks are and what crosses them, for the log."""
    lines = []
    for step in steps:
        if isinstance(step, FunctionCall):
            lines.append(f"graph break at {step.name} (applied at {step.where}): {len(step.inputs)} tensors into "
                         f"PyTorch, {len(step.outputs)} back")
        else:
            lines.append(f"onnxruntime segment of {len(step.exported.model.graph.node)} nodes")
    return "; ".join(lines)


class Broken:
    """A signature whose module applies Functions: its steps, each segment compiled."""

    def __init__(self, exported: Exported, steps: list, compile_segment):
        self.exported = exported
        self.steps = [(step, compile_segment(step)) if isinstance(step, Segment) else (step, None) for step in steps]
        logger.info("ORTModule: %s", describe(steps))

    def run(self, values: dict) -> dict:
        """Every value the steps compute, from the module's graph inputs ``values`` (name -> tensor)."""
        env = dict(values)
        for step, compiled in self.steps:
            if compiled is None:
                outs = step([env[n] for n in step.inputs])
                if len(outs) != len(step.outputs):
                    raise ExportError(
                        f"the torch.autograd.Function {step.name} (applied at {step.where}) returned {len(outs)} "
                        f"tensors where it returned {len(step.outputs)} when traced: for one input signature a "
                        "Function must return the same tensors; pass fallback=True to ORTModule to run the module "
                        "in PyTorch")
            else:
                outs = ORTFunction.apply(compiled, step.inputs, *[env[n] for n in step.inputs])
                outs = outs[:len(step.exported.outputs)]
            env.update(zip(step.outputs if compiled is None else step.exported.outputs, outs))
        return env
