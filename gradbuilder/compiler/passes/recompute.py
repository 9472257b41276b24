"""Recompute (rematerialization): the backward reads fewer forward activations and computes
the others again, late, from the ones it keeps.

One mechanism, :func:`rematerialize`, does the rewrite for a set KEEP of forward values the
backward may read: every backward use of another forward value is rewired to a clone of its
producer (recursively, down to KEEP values, graph inputs, initializers and constants). The
clones are shared between consumers and inserted right before the first backward node that
needs them. What goes into KEEP is chosen by the selectors, with onnxruntime-training's
meanings (``gelu``, ``attention_dropout``, ``transformer_layers``/``layers``), or by a
min-cut planner under a memory budget (``budget_bytes``/``budget_fraction``). Several
selectors combine: the union of what they recompute.

Never recomputed (always kept when the backward needs them): outputs of nodes with
randomness, of nodes with subgraphs, graph outputs and values that backward subgraphs
capture. A training-mode Dropout whose mask is exposed (passes.expose_masks) is the
exception: its mask is kept and its output is recomputed as the masked multiply.

onnxruntime can undo the rewrite; run the graph with :func:`gradbuilder.runtime.recompute.session_settings`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from dataclasses import field

import numpy as np
import onnx_ir as ir

from ..traversal import has_subgraph, subgraph_nodes
from ..values import attr, constant_of, optional_input

RANDOM_OPS = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
                        "Multinomial", "Bernoulli"})
EXPENSIVE_OPS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "Attention",
                           "MultiHeadAttention", "GroupQueryAttention", "MatMulInteger", "QLinearMatMul"})
GELU_OPS = frozenset({("", "Gelu"), ("com.microsoft", "Gelu"), ("com.microsoft", "FastGelu")})
LAYER_NAME = re.compile(r"(?:layers?|blocks?)[._](\d+)|(?:^|[./_])h[._](\d+)(?=[./_]|$)")


@dataclasses.dataclass
class RecomputeOptions:
    """Which forward activations the backward recomputes instead of keeping."""

    gelu: bool = False  # gelu_recompute
    attention_dropout: bool = False  # attn_dropout_recompute
    transformer_layers: bool = False  # transformer_layer_recompute
    layers: int = 0  # number_recompute_layers (0 = all layers)
    budget_bytes: int | None = None  # memory_budget_mb * 2**20
    budget_fraction: float | None = None  # of the no-recompute activation estimate
    dims: dict[str, int] = field(default_factory=dict)  # values for symbolic dims in estimates (unknown: 1)


@dataclasses.dataclass
class RecomputeReport:
    recomputed: list[str]  # forward values the backward now recomputes
    kept: list[str]  # forward values the backward still reads (checkpoints)
    bytes_before: int  # estimate: bytes of forward activations held for the backward, no recompute
    bytes_after: int  # same with recompute: kept values plus the copies alive at once (held_bytes)
    added_nodes: int
    added_flops: int  # rough estimate (MatMul/Gemm/Conv counted by shape, elementwise by size)

    def __str__(self) -> str:
        def mb(n):
            return f"{n / 2**20:.2f} MiB"

        ratio = f" ({self.bytes_after / self.bytes_before:.0%})" if self.bytes_before else ""
        return (f"recompute: {len(self.recomputed)} values recomputed by {self.added_nodes} added nodes "
                f"(~{self.added_flops:.3g} flops), {len(self.kept)} kept; activations held for the "
                f"backward {mb(self.bytes_before)} -> {mb(self.bytes_after)}{ratio}")


def apply_recompute(model: ir.Model, ctx) -> None:
    """With ``ctx.recompute`` (RecomputeOptions): choose KEEP from them and rewrite the graph so
    the backward reads only KEEP (``ctx.forward`` lists the forward nodes); the report goes to
    ``ctx.reports["recompute"]``."""
    options = ctx.recompute
    if options is None:
        return
    fw = ForwardInfo(model.graph, ctx.forward, options.dims)
    recompute: set[ir.Value] = set()
    if options.gelu:
        recompute |= select_gelu(fw)
    if options.attention_dropout:
        recompute |= select_attention_dropout(fw)
    if options.transformer_layers:
        recompute |= select_transformer_layers(fw, options.layers)
    budget = options.budget_bytes
    if options.budget_fraction is not None:
        before = fw.nbytes(fw.backward_reads)
        frac = int(before * options.budget_fraction)
        budget = frac if budget is None else min(budget, frac)
    if budget is not None:
        keep = plan_budget(fw, budget) - recompute
    else:
        keep = set(fw.produced) - recompute
    ctx.reports["recompute"] = rematerialize(model.graph, fw, keep, ctx.unique)


# ----------------------------------------------------------------------------- the forward


class ForwardInfo:
    """What the passes need to know about the forward part of ``graph``."""

    def __init__(self, graph: ir.Graph, forward, dims: dict[str, int]):
        self.graph = graph
        self.forward = list(forward)
        self.dims = dict(dims)
        self.is_forward = {id(n) for n in self.forward}
        self.position = {id(n): i for i, n in enumerate(self.forward)}
        # forward values computed by a node (Constant outputs count as constants)
        self.produced = {o: n for n in self.forward if not _is_constant(n) for o in n.outputs if o.name}
        self.backward = backward = [n for n in graph if id(n) not in self.is_forward]
        self.backward_reads: set[ir.Value] = {v for n in backward for v in n.inputs if v in self.produced}
        captured = {v for n in backward if has_subgraph(n) for inner in subgraph_nodes(n)
                    for v in inner.inputs if v in self.produced}
        self.backward_reads |= captured
        self.pinned = self._pinned(graph) | captured  # backward subgraphs keep what they capture

    def _pinned(self, graph: ir.Graph) -> set[ir.Value]:
        """Forward values that are never recomputed: graph outputs, outputs of random nodes
        (but a masked Dropout's output) and of nodes with subgraphs."""
        pinned = {v for v in graph.outputs if v in self.produced}
        for v, n in self.produced.items():
            if not _cloneable(n) and not (v.index() == 0 and masked_dropout(n) is not None):
                pinned.add(v)
        return pinned

    def recompute_inputs(self, v: ir.Value) -> list[ir.Value]:
        """The values the recomputation of ``v`` reads."""
        node = self.produced[v]
        md = masked_dropout(node)
        if md is not None:
            return [md[0], node.outputs[1]]
        return [u for u in node.inputs if u is not None]

    def nbytes(self, values) -> int:
        return sum(_nbytes(v, self.dims) for v in values)

    def flops(self, values) -> int:
        """Rough flops of recomputing ``values`` (each producer once)."""
        nodes = {id(self.produced[v]): self.produced[v] for v in values}
        return sum(_flops(n, self.dims) for n in nodes.values())


def _is_constant(node: ir.Node) -> bool:
    return node.op_type == "Constant" and node.domain in ("", "ai.onnx")


def _is_random(node: ir.Node) -> bool:
    if node.domain not in ("", "ai.onnx"):
        return node.op_type in RANDOM_OPS or "Dropout" in node.op_type
    if node.op_type in RANDOM_OPS:
        return True
    if node.op_type == "Dropout":
        training = optional_input(node, 2)
        if training is None:
            return False
        const = constant_of(training)
        return const is None or bool(const)
    return False


def _cloneable(node: ir.Node) -> bool:
    return not _is_random(node) and not has_subgraph(node)


def masked_dropout(node: ir.Node):
    """``(x, scale)`` when ``node`` is a training Dropout with an exposed mask whose output can
    be recomputed as ``x * mask * scale``; None otherwise."""
    if node.op_type != "Dropout" or node.domain not in ("", "ai.onnx") or len(node.outputs) < 2:
        return None
    x, ratio, training = node.inputs[0], optional_input(node, 1), optional_input(node, 2)
    const_training = constant_of(training)
    if not node.outputs[1].name or const_training is None or not bool(const_training) or x.dtype is None:
        return None
    r = 0.5 if ratio is None else constant_of(ratio)
    if r is None:
        return None  # a ratio fed at run time: keep the output
    dt = x.dtype.numpy()
    scale = dt.type(1) / (dt.type(1) - dt.type(float(r)))
    return x, scale


# ----------------------------------------------------------------------------- the mechanism


def plan(fw: ForwardInfo, keep: set[ir.Value]):
    """For a KEEP set: (values to recompute, forward values the backward still reads)."""
    keep = set(keep) | fw.pinned
    need: set[ir.Value] = set()
    kept: set[ir.Value] = set()
    stack = list(fw.backward_reads)
    while stack:
        v = stack.pop()
        if v in keep:
            kept.add(v)
            continue
        if v in need:
            continue
        need.add(v)
        stack.extend(u for u in fw.recompute_inputs(v) if u in fw.produced)
    return need, kept


def _in_recompute_order(fw: ForwardInfo, need: set[ir.Value], value: ir.Value, done):
    """The values of ``need`` to recompute so that ``value`` exists, each after the ``need``
    inputs it is recomputed from (an iterative post-order), skipping those in ``done``. The
    caller makes each value and adds it to ``done`` before asking for the next."""
    stack = [value]
    while stack:
        v = stack[-1]
        if v in done:
            stack.pop()
            continue
        missing = [u for u in fw.recompute_inputs(v) if u in need and u not in done]
        if missing:
            stack.extend(missing)
            continue
        stack.pop()
        yield v


def held_bytes(fw: ForwardInfo, need: set[ir.Value], kept: set[ir.Value]) -> int:
    """Estimated peak bytes of forward activations held for the backward under a plan: the
    kept values until their last backward read, plus the copies from when they are made
    (right before their first reader, as :func:`rematerialize` places them) until their last
    read. Shared copies made early for a later reader count for that whole span. Without
    recompute this is the bytes of all values the backward reads; it is never less than the
    bytes of the kept values."""
    steps: list[tuple[list[ir.Value], list[ir.Value]]] = []  # (copies made, values read)
    made: set[ir.Value] = set()

    def make(value):
        for v in _in_recompute_order(fw, need, value, made):
            new = [o for o in fw.produced[v].outputs if o in need] or [v]
            made.update(new)
            steps.append((new, [u for u in fw.recompute_inputs(v) if u in need or u in kept]))

    for n in fw.backward:
        for v in n.inputs:
            if v is not None and v in need:
                make(v)
        steps.append(([], [v for v in n.inputs if v is not None and (v in need or v in kept)]))
    for n in fw.backward:  # values read inside backward subgraphs live to the end
        if has_subgraph(n):
            steps.append(([], [v for inner in subgraph_nodes(n) for v in inner.inputs if v in kept]))
    last = {v: i for i, (_, reads) in enumerate(steps) for v in reads}
    live = fw.nbytes(kept)
    peak = live
    dying: dict[int, list[ir.Value]] = {}
    for v, i in last.items():
        dying.setdefault(i, []).append(v)
    for i, (new, _) in enumerate(steps):
        live += fw.nbytes(new)
        peak = max(peak, live)
        live -= fw.nbytes(dying.get(i, ()))
    return peak


def rematerialize(graph: ir.Graph, fw: ForwardInfo, keep: set[ir.Value], unique) -> RecomputeReport:
    """Rewire every backward use of a forward value outside KEEP to a recomputed copy.

    A copy is made once per value and inserted right before the first backward node that
    reads it (directly or through another copy), so the node order stays topological and the
    recomputation happens as late as it can. Forward nodes keep their own outputs.
    """
    need, kept = plan(fw, keep)
    held = held_bytes(fw, need, kept)  # before the rewrite: it reads the original inputs
    copies: dict[ir.Value, ir.Value] = {}
    added: list[ir.Node] = []

    def materialize(value: ir.Value, anchor: ir.Node) -> ir.Value:
        # the inputs' copies are inserted before their reader's
        for v in _in_recompute_order(fw, need, value, copies):
            nodes = _copy_producer(fw, v, copies, unique)
            graph.insert_before(anchor, nodes)
            added.extend(nodes)
        return copies[value]

    for node in [n for n in graph if id(n) not in fw.is_forward]:
        for i, v in enumerate(node.inputs):
            if v is not None and v in need:
                node.replace_input_with(i, materialize(v, node))

    flops = fw.flops(need)
    order = {v: (fw.position[id(fw.produced[v])], v.index()) for v in need | kept}
    return RecomputeReport(
        recomputed=[v.name for v in sorted(need, key=order.get)],
        kept=[v.name for v in sorted(kept, key=order.get)],
        bytes_before=fw.nbytes(fw.backward_reads),
        bytes_after=held,
        added_nodes=len(added),
        added_flops=int(flops),
    )


def _copy_producer(fw: ForwardInfo, v: ir.Value, copies: dict, unique) -> list[ir.Node]:
    """New nodes that compute ``v`` (and its producer's other outputs) again from the copies
    of its recomputed inputs; records the new outputs in ``copies``."""
    node = fw.produced[v]
    base = node.name or node.op_type
    md = masked_dropout(node)
    if md is not None:
        x, scale = md
        x = copies.get(x, x)
        const = ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(np.asarray(scale)))],
                        name=unique(f"{base}_recompute_scale"))
        cast = ir.Node("", "Cast", [node.outputs[1]], [ir.AttrInt64("to", int(x.dtype))], name=unique(f"{base}_recompute_cast"))
        masked = ir.Node("", "Mul", [x, cast.outputs[0]], name=unique(f"{base}_recompute_mask"))
        out = ir.Node("", "Mul", [masked.outputs[0], const.outputs[0]], name=unique(f"{base}_recompute"))
        const.outputs[0].name = unique(f"{base}_recompute_scale")
        const.outputs[0].dtype, const.outputs[0].shape = x.dtype, ir.Shape([])
        for n, suffix in ((cast, "_mask_cast"), (masked, "_masked"), (out, "")):
            n.outputs[0].name = unique(f"{v.name}_recompute{suffix}")
            _copy_type(n.outputs[0], v)
        copies[v] = out.outputs[0]
        return [const, cast, masked, out]
    inputs = [None if u is None else copies.get(u, u) for u in node.inputs]
    clone = ir.Node(node.domain, node.op_type, inputs, attributes=node.attributes.values(),
                    num_outputs=len(node.outputs), version=node.version, name=unique(f"{base}_recompute"))
    for o, c in zip(node.outputs, clone.outputs):
        if o.name:
            c.name = unique(f"{o.name}_recompute")
            _copy_type(c, o)
            copies[o] = c
    return [clone]


def _copy_type(out: ir.Value, like: ir.Value) -> None:
    if like.type is not None:
        out.type = like.type
    if like.shape is not None:
        out.shape = ir.Shape(list(like.shape))


# ----------------------------------------------------------------------------- selectors


def select_gelu(fw: ForwardInfo) -> set[ir.Value]:
    """Gelu outputs (opset 20 Gelu, com.microsoft Gelu/FastGelu) and every value of the Erf
    pattern torch exports, x * 0.5 * (1 + Erf(x / sqrt 2)): all recomputed from x."""
    out: set[ir.Value] = set()
    for node in fw.forward:
        if (node.domain if node.domain != "ai.onnx" else "", node.op_type) in GELU_OPS:
            out.update(o for o in node.outputs if o in fw.produced)
        elif node.op_type == "Erf" and node.domain in ("", "ai.onnx"):
            for n in _erf_gelu_pattern(fw, node):
                out.update(o for o in n.outputs if o in fw.produced)
    return out


def _erf_gelu_pattern(fw: ForwardInfo, erf: ir.Node) -> list[ir.Node]:
    """The nodes of x * 0.5 * (1 + Erf(x / sqrt 2)) around ``erf`` (any order of the two
    products, Div by sqrt 2 or Mul by 1/sqrt 2); [] when ``erf`` is not part of one."""
    scaled = erf.inputs[0]
    pre = scaled.producer()
    if pre is None or pre.op_type not in ("Div", "Mul") or id(pre) not in fw.is_forward:
        return []
    consts = [i for i, u in enumerate(pre.inputs) if _is_const(u)]
    if len(consts) != 1:
        return []
    x = pre.inputs[1 - consts[0]]
    add = _only_consumer(fw, erf.outputs[0])
    if add is None or add.op_type != "Add" or not any(_is_const(u) for u in add.inputs):
        return []
    mul = _only_consumer(fw, add.outputs[0])
    if mul is None or mul.op_type != "Mul":
        return []
    other = mul.inputs[1] if mul.inputs[0] is add.outputs[0] else mul.inputs[0]
    nodes = [pre, erf, add, mul]
    if other is x:  # (x * (1 + erf)) * 0.5
        last = _only_consumer(fw, mul.outputs[0])
        if last is not None and last.op_type == "Mul" and any(_is_const(u) for u in last.inputs):
            nodes.append(last)
        return nodes
    half = other.producer()  # (x * 0.5) * (1 + erf)
    if half is not None and half.op_type == "Mul" and x in half.inputs and any(_is_const(u) for u in half.inputs):
        return [half, *nodes]
    return []


def _is_const(v: ir.Value | None) -> bool:
    return v is not None and constant_of(v) is not None


def _only_consumer(fw: ForwardInfo, v: ir.Value) -> ir.Node | None:
    """The one forward node that reads ``v``, else None."""
    users = {id(u.node): u.node for u in v.uses() if id(u.node) in fw.is_forward}
    return next(iter(users.values())) if len(users) == 1 else None


def select_attention_dropout(fw: ForwardInfo) -> set[ir.Value]:
    """The output of the Dropout (or masked multiply) that follows a Softmax: recomputed from
    the Softmax output, which is kept, and the mask."""
    out: set[ir.Value] = set()
    for node in fw.forward:
        if node.op_type not in ("Dropout", "Mul") or not node.inputs:
            continue
        operands = node.inputs[:1] if node.op_type == "Dropout" else node.inputs
        if any(u is not None and u.producer() is not None and u.producer().op_type == "Softmax" for u in operands):
            if node.outputs[0] in fw.produced:
                out.add(node.outputs[0])
    return out


def select_transformer_layers(fw: ForwardInfo, layers: int = 0) -> set[ir.Value]:
    """Every value computed inside the recomputed transformer layers, except the values read
    after the layer (its outputs: the next layer's inputs); the backward keeps only each
    layer's inputs (and masks). ``layers`` > 0: only the first ``layers`` layers."""
    groups = find_layers(fw)
    if layers > 0:
        groups = groups[:layers]
    out: set[ir.Value] = set()
    for nodes in groups:
        inside = {id(n) for n in nodes}
        for n in nodes:
            for o in n.outputs:
                if o not in fw.produced or o.is_graph_output():
                    continue
                if all(id(u.node) in inside or id(u.node) not in fw.is_forward for u in o.uses()):
                    out.add(o)
    return out


def find_layers(fw: ForwardInfo) -> list[list[ir.Node]]:
    """The forward's transformer layers, in order: nodes grouped by the layer prefix of
    torch/HF export names (``/layers.3/``, ``.h.3.``, ``layer.3``, ``blocks.3``); without
    such names, the forward cut at every second LayerNormalization output."""
    groups: dict[str, list[ir.Node]] = {}
    for n in fw.forward:
        m = LAYER_NAME.search(n.name or "")
        if m is not None:
            groups.setdefault(n.name[: m.end()], []).append(n)
    if groups:
        return list(groups.values())
    norms = [i for i, n in enumerate(fw.forward) if n.op_type == "LayerNormalization"]
    cuts = norms[::2]
    return [fw.forward[a + 1: b + 1] for a, b in zip(cuts, cuts[1:])]


# ----------------------------------------------------------------------------- the planner


def plan_budget(fw: ForwardInfo, budget: int) -> set[ir.Value]:
    """KEEP for a memory budget: min-cuts of the forward graph for a sweep of recompute
    penalties, from "never recompute expensive ops" to "recompute anything" (plus the
    selectors' plans: the first k layers, Gelu and attention dropout); the plan with the least
    added flops whose estimate fits ``budget``, else the smallest plan (warns).

    The estimate is :func:`held_bytes`, not only the bytes of the cut: a cut that keeps few
    values but recomputes a long chain from them (a residual stream across all layers) makes
    the copies early, for the first reader, and holds them until the last one; the min-cut
    cannot see that, the estimate can."""
    candidates = [set(fw.produced)]  # no recompute
    for banned in (True, False):
        for alpha in (0.0, 1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0):
            candidates.append(min_cut_keep(fw, alpha, banned))
    everything = set(fw.produced)  # and the selectors' plans: more layers, then gelu/dropout
    for k in range(1, len(find_layers(fw)) + 1):
        candidates.append(everything - select_transformer_layers(fw, k))
    candidates.append(everything - select_gelu(fw) - select_attention_dropout(fw))
    scored = []
    for keep in candidates:
        need, kept = plan(fw, keep)
        scored.append((held_bytes(fw, need, kept), fw.flops(need), keep))
    fits = [s for s in scored if s[0] <= budget]
    if fits:
        return min(fits, key=lambda s: (s[1], s[0]))[2]
    best = min(scored, key=lambda s: (s[0], s[1]))
    warnings.warn(
        f"recompute: the memory budget of {budget} bytes cannot be met; the smallest plan found "
        f"keeps an estimated {best[0]} bytes of activations for the backward (without recompute: "
        f"{fw.nbytes(fw.backward_reads)} bytes)", stacklevel=3)
    return best[2]


def min_cut_keep(fw: ForwardInfo, alpha: float, banned: bool) -> set[ir.Value]:
    """One min-cut: each forward value v is an edge v_in -> v_out of capacity its bytes;
    recomputing v's producer costs ``alpha`` x its flops (an edge source -> v_in, cut when v
    is recomputed; infinite for MatMul/Gemm/Conv/Attention when ``banned``). Pinned values
    hang from the source, values the backward reads go to the sink; data edges are infinite.
    The cut value edges are KEEP."""
    import networkx as nx

    g = nx.DiGraph()
    g.add_node("source")
    g.add_node("sink")
    for v, node in fw.produced.items():
        g.add_edge(("in", v.name), ("out", v.name), capacity=max(_nbytes(v, fw.dims), 1))
        if v in fw.pinned or (banned and node.op_type in EXPENSIVE_OPS):
            g.add_edge("source", ("in", v.name))
        elif alpha > 0:
            g.add_edge("source", ("in", v.name), capacity=alpha * _flops(node, fw.dims) / len(node.outputs))
        for u in fw.recompute_inputs(v):
            if u in fw.produced:
                g.add_edge(("out", u.name), ("in", v.name))
        if v in fw.backward_reads:
            g.add_edge(("out", v.name), "sink")
    _, (reachable, _) = nx.minimum_cut(g, "source", "sink")
    return {v for v in fw.produced if ("in", v.name) in reachable and ("out", v.name) not in reachable}


# ----------------------------------------------------------------------------- estimates


def _numel(v: ir.Value, dims: dict[str, int]) -> int:
    if v.shape is None:
        return 1
    n = 1
    for d in v.shape.dims:
        n *= d if isinstance(d, int) else dims.get(getattr(d, "value", None), 1)
    return n


def _nbytes(v: ir.Value, dims: dict[str, int]) -> int:
    size = 4
    if v.dtype is not None:
        try:
            size = v.dtype.itemsize
        except Exception:
            pass
    return int(math.ceil(_numel(v, dims) * size))


def _flops(node: ir.Node, dims: dict[str, int]) -> int:
    """Rough flops of ``node``: 2 x output size x reduced length for MatMul/Gemm/Conv,
    output size for the others."""
    out = max((_numel(o, dims) for o in node.outputs), default=1)
    ins = [u for u in node.inputs if u is not None]
    if node.op_type == "MatMul" and ins and ins[0].shape is not None and len(ins[0].shape):
        return 2 * out * _dim(ins[0].shape[-1], dims)
    if node.op_type == "Gemm" and ins and ins[0].shape is not None and len(ins[0].shape) == 2:
        return 2 * out * _dim(ins[0].shape[0 if attr(node, "transA", 0) else 1], dims)
    if node.op_type == "Conv" and len(ins) > 1 and ins[1].shape is not None:
        return 2 * out * _numel(ins[1], dims) // max(_dim(ins[1].shape[0], dims), 1)
    if node.op_type in EXPENSIVE_OPS:
        return 2 * max([out] + [_numel(u, dims) for u in ins])
    return out


def _dim(d, dims: dict[str, int]) -> int:
    return d if isinstance(d, int) else dims.get(getattr(d, "value", None), 1)
