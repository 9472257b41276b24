"""Pipeline stages: a forward model cut into S models that run one after another.

Pipeline-parallel training runs each stage in its own process: stage k receives the values
crossing the cut before it from stage k-1 and sends the values crossing the cut after it to
stage k+1; the backward runs the other way, each stage taking the gradients of what it sent
and returning those of what it received. Cuts are written as onnxruntime-training's
``pipeline_cut_info_string`` (:func:`parse_cuts`) or chosen by :func:`balanced_cuts`.

A node's stage follows from the cuts alone: the latest stage of the nodes producing its
inputs, and at least k+1 where an edge into it is cut by cut k. A value computed in stage i
and read in stage j > i+1 is passed on by every stage between, so it must be in every cut
between (onnxruntime-training's rule: each cut is complete). The graph inputs are no
boundary: every stage is fed the same micro-batch and reads the inputs it needs. Constants
(Constant nodes, non-trainable initializers and what nodes compute from them alone) are
copied into every stage that reads them.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Iterable

import numpy as np
import onnx

from ..dtypes import FLOAT_TENSOR_TYPES
from ..errors import InvalidArgumentError, InvalidModelError
from . import modelio
from .split import SplitGraphs, build_split
from .type_inference import value_types

SYNTAX = ("cuts separated by ',', each one or more edges separated by ':', an edge 'value' or "
          "'value-consumer/consumer/...' (e.g. '1393:407-1463/1585/1707,2369:407-2439/2561/2683')")
_RANDOM = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                     "Bernoulli", "Dropout"})
_SMALL = 1024  # initializers up to this size keep their data for shape inference


@dataclasses.dataclass(frozen=True)
class CutEdge:
    """The edges from ``value`` to ``consumers`` (node names or names of their outputs); None
    cuts every edge from ``value``."""

    value: str
    consumers: tuple[str, ...] | None = None


def parse_cuts(spec) -> list[list[CutEdge]]:
    """The cuts of ``spec``: onnxruntime-training's ``pipeline_cut_info_string`` (see
    :data:`SYNTAX`; empty: no cut), or a list whose items are a value name or a
    :class:`CutEdge` (a cut of one edge) or a list of those (a cut of several edges). Names
    holding ',', ':' or '-' (and consumers holding '/') can only be given in a list."""
    if isinstance(spec, str):
        return [_parse_cut(piece, spec) for piece in spec.split(",")] if spec.strip() else []
    cuts = []
    for item in spec:
        cut = [item] if isinstance(item, (str, CutEdge)) else list(item) if isinstance(item, (list, tuple)) else []
        cut = [CutEdge(e) if isinstance(e, str) else e for e in cut]
        if not cut or not all(isinstance(e, CutEdge) and isinstance(e.value, str) and e.value for e in cut):
            raise InvalidArgumentError(f"pipeline cuts: cannot read {item!r}; each cut is a value name, a CutEdge "
                                       "or a non-empty list of them")
        cuts.append(cut)
    return cuts


def _parse_cut(piece: str, spec: str) -> list[CutEdge]:
    edges = []
    for text in piece.split(":"):
        value, dash, rest = text.partition("-")
        consumers = tuple(c.strip() for c in rest.split("/")) if dash else None
        if not value.strip() or "-" in rest or (consumers is not None and not all(consumers)):
            raise InvalidArgumentError(f"TrainingParameters.pipeline_cut_info_string {spec!r}: cannot read "
                                       f"{text!r}; expected {SYNTAX}")
        edges.append(CutEdge(value.strip(), consumers))
    return edges


@dataclasses.dataclass
class Stage:
    """One stage of a cut model. ``model`` holds the stage's nodes and initializers (its
    weights included); its inputs are the graph inputs it reads (``inputs``) and the values
    it receives (``receives``, in the order the previous stage sends them); its outputs are
    the values it sends (``sends``), or in the last stage the ``loss``, then any other graph
    output it computes."""

    index: int
    model: onnx.ModelProto
    receives: list[str]
    sends: list[str]
    weights: list[str]
    inputs: list[str]
    loss: str | None = None  # the last stage's
    _split: SplitGraphs | None = dataclasses.field(default=None, repr=False, compare=False)

    def split(self) -> SplitGraphs:
        """The stage's forward and backward graphs (built once), weights taken as graph
        inputs as ORTModule's are. The backward takes ``<send>_grad_output`` for each float
        value sent (the last stage: the loss's) and returns the gradients of the float values
        received (the seeds of the stage before) and of the weights; integer values take none."""
        if self._split is None:
            proto = onnx.ModelProto()
            proto.CopyFrom(self.model)
            modelio.weights_as_inputs(proto, self.weights)
            outputs = [self.loss] if self.loss is not None else _floats(self.model.graph.output, self.sends)
            split = build_split(proto, _floats(self.model.graph.input, self.receives) + self.weights, outputs=outputs)
            self._split = split
        return self._split


def _floats(infos, names: list[str]) -> list[str]:
    float_names = {i.name for i in infos if i.type.tensor_type.elem_type in FLOAT_TENSOR_TYPES}
    return [n for n in names if n in float_names]


def cut_model(model, cuts, loss: str, weights: Iterable[str]) -> list[Stage]:
    """The stages of ``model`` (bytes, path or ModelProto; not modified) cut by ``cuts``
    (:func:`parse_cuts`' result, or what it reads; S-1 cuts make S stages). ``loss`` is the
    loss output, ``weights`` the trainable initializers. Cuts that do not make S ordered,
    non-empty stages, each weight in one of them and the loss in the last, raise
    InvalidArgumentError before anything is built."""
    proto = modelio.read_proto(model)
    cuts = parse_cuts(cuts)
    g = _Graph(proto, weights, loss)
    stage = _assign(g, cuts)
    _check(g, cuts, stage)
    types = inferred_types(proto)
    boundary = [list(dict.fromkeys(e.value for e in cut)) for cut in cuts]
    return [_stage(g, s, stage, boundary, types) for s in range(len(cuts) + 1)]


class _Graph:
    """The nodes of a graph, who produces and who reads each value, and which nodes are
    constants (read only constants themselves)."""

    def __init__(self, proto: onnx.ModelProto, weights: Iterable[str], loss: str):
        self.proto = proto
        self.nodes = list(proto.graph.node)
        self.reads = [modelio.node_reads(n) for n in self.nodes]
        self.initializers = {t.name: t for t in proto.graph.initializer}
        self.inputs = [i.name for i in proto.graph.input if i.name not in self.initializers]
        self.weights = list(dict.fromkeys(weights))
        self.trainable = set(self.weights)
        missing = [w for w in self.weights if w not in self.initializers]
        if missing:
            raise InvalidArgumentError(f"pipeline cuts: the weights {missing} are not initializers of the model; "
                                       "name its trainable initializers")
        self.producer = {o: i for i, n in enumerate(self.nodes) for o in n.output if o}
        self.constants = set(self.initializers) - self.trainable
        self.constant = constant_nodes(self.nodes, self.reads, self.constants)
        self.readers: dict[str, list[int]] = {}  # value -> the non-constant nodes reading it
        for i, reads in enumerate(self.reads):
            if not self.constant[i]:
                for v in reads:
                    self.readers.setdefault(v, []).append(i)
        names = Counter(n.name for n in self.nodes)
        self.labels = [n.name if n.name and names[n.name] == 1 else next(iter(n.output), "")
                       for n in self.nodes]
        self.loss = loss
        if self.producer.get(loss) is None or self.constant[self.producer[loss]]:
            raise InvalidArgumentError(f"pipeline cuts: the loss '{loss}' is not computed by a node of the model; "
                                       "name the loss output")

    def label(self, i: int) -> str:
        """The node's name, or its first output where the name is missing or not unique."""
        return self.labels[i]


def constant_nodes(nodes, reads: list[set[str]], constants: set[str], kept: set[str] = frozenset()) -> list[bool]:
    """Which ``nodes`` compute constants, which a cut copies into each part that reads them:
    Constant nodes, and standard nodes other than random draws that read only ``constants``
    (the constant values; their outputs are added to it). A node with an output in ``kept``
    is not one (its value is computed once, in a part of its own)."""
    constant = []
    for node, r in zip(nodes, reads):
        is_constant = node.domain in ("", "ai.onnx") and not kept & set(node.output) and (
            node.op_type == "Constant" or (node.op_type not in _RANDOM and bool(r) and r <= constants))
        constant.append(is_constant)
        if is_constant:
            constants.update(node.output)
    return constant


def constants_read(nodes, reads: list[set[str]], constant: list[bool], needed: set[str]) -> list[int]:
    """The constant nodes that compute what ``needed`` names, and what those read in turn
    (``needed`` grows with their reads)."""
    copied = []
    for i in reversed(range(len(nodes))):
        if constant[i] and any(o in needed for o in nodes[i].output):
            copied.append(i)
            needed |= reads[i]
    return copied


def _assign(g: _Graph, cuts: list[list[CutEdge]]) -> list[int | None]:
    """Each node's stage (None for constants)."""
    edges: dict[tuple[str, int], int] = {}  # (value, reader) -> the last cut on that edge
    for k, cut in enumerate(cuts):
        for e in cut:
            for i in _edge_readers(g, k, e):
                edges[e.value, i] = max(k, edges.get((e.value, i), k))
    stage: list[int | None] = [None] * len(g.nodes)
    for i, reads in enumerate(g.reads):
        if g.constant[i]:
            continue
        s = 0
        for v in reads:
            p = g.producer.get(v)
            if p is not None and stage[p] is not None:
                s = max(s, stage[p])
            if (v, i) in edges:
                s = max(s, edges[v, i] + 1)
        stage[i] = s
    return stage


def _edge_readers(g: _Graph, k: int, e: CutEdge) -> list[int]:
    """The nodes whose edges from ``e.value`` the edge cuts."""
    v, where = e.value, f"pipeline cut {k}"
    if v in g.inputs or v in g.initializers and v not in g.constants:
        raise InvalidArgumentError(f"{where}: '{v}' is a graph input or a weight, which every stage reads directly; "
                                   "cut the values nodes compute from it instead")
    if v in g.constants:
        raise InvalidArgumentError(f"{where}: '{v}' is a constant, which every stage reading it has a copy of; "
                                   "remove it from the cut")
    if v not in g.producer:
        raise InvalidArgumentError(f"{where}: '{v}' is not a value of the graph; name a value a node computes")
    readers = g.readers.get(v, [])
    if not readers:
        raise InvalidArgumentError(f"{where}: no node reads '{v}'; remove it from the cut")
    if e.consumers is None:
        return readers
    chosen = []
    for c in e.consumers:
        hit = [i for i in readers if g.nodes[i].name == c or c in g.nodes[i].output]
        if not hit:
            names = ", ".join(g.label(i) for i in readers[:6]) + (" ..." if len(readers) > 6 else "")
            raise InvalidArgumentError(f"{where}: '{c}' is not a node reading '{v}' (its readers: {names}); name a "
                                       "reader by its node name or one of its outputs")
        chosen += hit
    return chosen


def _check(g: _Graph, cuts: list[list[CutEdge]], stage: list[int | None]) -> None:
    """Refuse cuts that do not make ordered, separated, non-empty stages with the loss in the
    last and each weight in one."""
    last = len(cuts)
    for k, cut in enumerate(cuts):
        for e in cut:
            p = g.producer[e.value]
            if stage[p] > k:
                raise InvalidArgumentError(
                    f"pipeline cut {k}: '{e.value}' is computed by node '{g.label(p)}', which the cuts put in stage "
                    f"{stage[p]}, after cut {k}; the cuts are out of order: list them in the order the graph "
                    "computes them, each cut's values computed before it")
    cut_values = [{e.value for e in cut} for cut in cuts]
    for i, reads in enumerate(g.reads):
        for v in sorted(reads):
            p = g.producer.get(v)
            if stage[i] is None or p is None or stage[p] is None:
                continue
            for k in range(stage[p], stage[i]):
                if v not in cut_values[k]:
                    raise InvalidArgumentError(
                        f"pipeline cut {k} does not separate the graph: '{v}' (computed by node '{g.label(p)}' in "
                        f"stage {stage[p]}) is read by node '{g.label(i)}' in stage {stage[i]}; add it to cut {k}")
    counts = Counter(s for s in stage if s is not None)
    for s in range(1, last + 1):
        if not counts[s]:
            raise InvalidArgumentError(f"pipeline cuts: stage {s} has no node: every node after cut {s - 1} is also "
                                       f"after cut {s}; remove one of the two or move it")
    p = g.producer[g.loss]
    if stage[p] != last:
        raise InvalidArgumentError(f"pipeline cuts: the loss '{g.loss}' (node '{g.label(p)}') is in stage {stage[p]}, "
                                   f"not in the last stage {last}; cut only values the loss is computed from")
    for w in g.weights:
        readers = {}
        for i in g.readers.get(w, []):
            readers.setdefault(stage[i], i)
        if len(readers) > 1:
            where = ", ".join(f"node '{g.label(i)}' in stage {s}" for s, i in sorted(readers.items()))
            raise InvalidArgumentError(f"pipeline cuts: weight '{w}' is read by {where}; tied weights across stages "
                                       f"are not supported: cut so that every node reading '{w}' is in one stage")


def inferred_types(proto: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Value name -> type from onnx shape inference, run on a copy of the graph that holds
    only the small initializers' data (the large ones are typed inputs)."""
    head = onnx.ModelProto(ir_version=max(proto.ir_version, 4))
    head.opset_import.extend(proto.opset_import)
    head.functions.extend(proto.functions)
    graph = proto.graph
    head.graph.node.extend(graph.node)
    head.graph.input.extend(graph.input)
    head.graph.output.extend(graph.output)
    head.graph.value_info.extend(graph.value_info)
    inputs = {i.name for i in graph.input}
    for t in graph.initializer:
        if t.ByteSize() <= _SMALL:
            head.graph.initializer.append(t)
        elif t.name not in inputs:
            head.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    inferred = head
    for data_prop in (True, False):
        try:
            inferred = onnx.shape_inference.infer_shapes(head, data_prop=data_prop)
            break
        except Exception:  # the types the model declares are still there
            continue
    return value_types(inferred.graph)


def _stage(g: _Graph, s: int, stage: list[int | None], boundary: list[list[str]], types) -> Stage:
    last = len(boundary)
    mine = [i for i, st in enumerate(stage) if st == s]
    needed = set().union(*(g.reads[i] for i in mine))
    constants = constants_read(g.nodes, g.reads, g.constant, needed)
    receives = boundary[s - 1] if s > 0 else []
    sends = boundary[s] if s < last else []
    produced = {o for i in mine for o in g.nodes[i].output}
    graph = g.proto.graph
    declared = {o.name: o for o in graph.output}
    outputs = sends + ([g.loss] if s == last else [])
    outputs += [o for o in declared if o in produced and o not in outputs]

    def info(name: str) -> onnx.ValueInfoProto:
        if name in declared and declared[name].type.WhichOneof("value"):
            return declared[name]
        t = types.get(name)
        if t is None or (t.HasField("tensor_type") and not t.tensor_type.elem_type):
            raise InvalidModelError(f"pipeline stage {s}: onnx shape inference finds no type for '{name}', which "
                                    "the stage sends or receives; give it a value_info in the model")
        return onnx.helper.make_value_info(name, t)

    inputs = [i for i in graph.input if i.name in needed and i.name not in g.initializers]
    body = onnx.helper.make_graph(
        [g.nodes[i] for i in sorted(mine + constants)], f"{graph.name}_stage{s}",
        inputs + [info(v) for v in receives], [info(v) for v in outputs],
        [t for t in graph.initializer if t.name in needed],
        value_info=[v for v in graph.value_info if v.name in produced and v.name not in outputs])
    model = onnx.helper.make_model(body, opset_imports=list(g.proto.opset_import),
                                   ir_version=max(g.proto.ir_version, 4), producer_name="gradbuilder",
                                   functions=list(g.proto.functions))
    return Stage(index=s, model=model, receives=list(receives), sends=list(sends),
                 weights=[w for w in g.weights if w in needed], inputs=[i.name for i in inputs],
                 loss=g.loss if s == last else None)


def balanced_cuts(model, stages: int, loss: str, weights: Iterable[str]) -> list[list[CutEdge]]:
    """``stages`` - 1 cuts of ``model`` (not modified) that balance the stages' estimated cost.

    A cut goes where one value computed from the weights crosses: after some node of the
    graph order, a single such value computed at or before it is read after it. Values
    computed from the graph inputs and constants alone (masks, positions) do not count; the
    cuts pass them on to the stages reading them. The cost of a stage is the FLOPs of its
    MatMul, Gemm and Conv nodes from static shapes where shape inference knows them, else 2
    per weight element a node reads; its parameter bytes break ties. The cuts minimize the
    largest stage's cost."""
    proto = modelio.read_proto(model)
    g = _Graph(proto, weights, loss)
    if stages < 1:
        raise InvalidArgumentError(f"balanced_cuts: stages must be 1 or more, not {stages}")
    if stages == 1:
        return []
    data, seq = _weight_path(g)
    position = {i: p for p, i in enumerate(seq)}
    if g.producer[loss] not in position:
        raise InvalidArgumentError(f"balanced_cuts: the loss '{loss}' is not computed from the weights")
    crossing, ids, values, earliest = _crossings(g, seq, position)
    tied, param_bytes = _weight_spans(g, position, len(seq))
    types = inferred_types(proto)
    flops = np.array([_cost(g, i, types) for i in seq], np.float64)
    end = position[g.producer[loss]]
    candidates = [p for p in range(earliest, end) if crossing[p] == 1 and not tied[p]]
    if len(candidates) < stages - 1:
        raise InvalidArgumentError(
            f"balanced_cuts: the graph has {len(candidates)} places where a single value crosses, and {stages} stages "
            f"need {stages - 1}; use fewer stages, or give the cuts (TrainingParameters.pipeline_cut_info_string)")
    chosen = _least_largest_stage(candidates, stages, flops, param_bytes)
    return [_cut_at(g, seq, position, p, values[ids[p]], data) for p in chosen]


def _weight_path(g: _Graph) -> tuple[set[str], list[int]]:
    """(the values computed without the weights: constants, graph inputs and what nodes compute
    from them alone; the nodes computed from the weights, in graph order)."""
    data = set(g.constants) | set(g.inputs)
    seq = []
    for i, reads in enumerate(g.reads):
        if g.constant[i]:
            continue
        if reads <= data:
            data.update(g.nodes[i].output)
        else:
            seq.append(i)
    return data, seq


def _crossings(g: _Graph, seq: list[int], position: dict[int, int]):
    """The values of the weight path that cross each place: (after position p, how many values
    cross; the sum of their ids; the values by id; the first position a cut may follow: that of
    the last node reading no value of the path, which no cut before it could reach)."""
    n = len(seq)
    crossing = np.zeros(n + 1, np.int64)
    ids = np.zeros(n + 1, np.int64)
    values = []
    sources = [0]
    for p, i in enumerate(seq):
        if not any(g.producer.get(v) in position for v in g.reads[i]):
            sources.append(p)  # a node no cut can reach: the cuts must come after it
        for v in g.nodes[i].output:
            readers = [position[r] for r in g.readers.get(v, [])]
            if v and readers and max(readers) > p:
                crossing[p] += 1
                crossing[max(readers)] -= 1
                ids[p] += len(values)
                ids[max(readers)] -= len(values)
                values.append(v)
    return np.cumsum(crossing), np.cumsum(ids), values, max(sources)


def _weight_spans(g: _Graph, position: dict[int, int], n: int):
    """(after position p, how many weights are read both at or before p and after it (a tied
    weight no cut may split); the parameter bytes of each position, a weight counted at its
    first reader)."""
    tied = np.zeros(n + 1, np.int64)
    param_bytes = np.zeros(n, np.float64)
    for w in g.weights:
        readers = sorted(position[r] for r in g.readers.get(w, []) if r in position)
        if readers:
            tied[readers[0]] += 1
            tied[readers[-1]] -= 1
            t = g.initializers[w]
            param_bytes[readers[0]] += np.prod(t.dims) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return np.cumsum(tied), param_bytes


def _least_largest_stage(candidates: list[int], stages: int, flops, param_bytes) -> tuple[int, ...]:
    """The ``stages`` - 1 positions among ``candidates`` to cut after whose largest stage costs
    least (FLOPs, then parameter bytes; among equal costs, the later cuts): over the positions,
    the best cuts ending at each candidate, one cut more per round."""
    n = len(flops)
    total_f, total_b = np.concatenate([[0], np.cumsum(flops)]), np.concatenate([[0], np.cumsum(param_bytes)])

    def cost(a: int, b: int) -> tuple[float, float]:  # of the positions a+1 .. b
        return float(total_f[b + 1] - total_f[a + 1]), float(total_b[b + 1] - total_b[a + 1])

    def later(option):  # among equal costs, cuts after the activations rather than before
        return option[0], [-c for c in option[1]]

    best = {-1: ((0.0, 0.0), ())}  # last cut -> (largest stage cost so far, the cuts)
    for _ in range(stages - 1):
        best = {c: min(((max(worst, cost(a, c)), chosen + (c,)) for a, (worst, chosen) in best.items() if a < c),
                       key=later)
                for c in candidates if any(a < c for a in best)}
    _, chosen = min(((max(worst, cost(a, n - 1)), chosen) for a, (worst, chosen) in best.items()), key=later)
    return chosen


def _cut_at(g: _Graph, seq: list[int], position: dict[int, int], p: int, value: str, data: set[str]) -> list[CutEdge]:
    """The cut after position ``p``: the one value crossing there, and the values computed
    without the weights that nodes after it read."""

    def edge(v: str) -> CutEdge | None:
        readers = g.readers.get(v, [])
        after = [i for i in readers if position.get(i, -1) > p]
        if not after:
            return None
        return CutEdge(v, None if len(after) == len(readers) else tuple(g.label(i) for i in after))

    passed = [v for v in dict.fromkeys(v for i in seq[p + 1:] for v in sorted(g.reads[i]))
              if v in data and v in g.producer and v not in g.constants]
    return [e for e in [edge(value)] + [edge(v) for v in passed] if e is not None]


def _cost(g: _Graph, i: int, types) -> float:
    """The node's FLOPs (MatMul, Gemm, Conv with static shapes), else 2 per weight element read."""
    node = g.nodes[i]

    def dims(name: str):
        t = types.get(name)
        if t is None or not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
            return None
        d = t.tensor_type.shape.dim
        return [x.dim_value for x in d] if all(x.HasField("dim_value") for x in d) else None

    if node.domain in ("", "ai.onnx") and node.op_type in ("MatMul", "Gemm", "Conv") and len(node.input) >= 2:
        out, a, b = dims(node.output[0]), dims(node.input[0]), dims(node.input[1])
        if out is not None and a and b:
            if node.op_type == "MatMul":
                k = a[-1]
            elif node.op_type == "Gemm":
                trans_a = next((x.i for x in node.attribute if x.name == "transA"), 0)
                k = a[0] if trans_a else a[-1]
            else:
                k = int(np.prod(b[1:]))
            return 2.0 * float(np.prod(out)) * k
    return 2.0 * sum(float(np.prod(g.initializers[w].dims)) for w in g.reads[i] if w in g.trainable)
