"""Mixed precision for the forward graph (autocast), before differentiation.

Like ``torch.autocast``'s op lists, run on the private copy of the forward graph:

- LOW ops (:data:`LOW_OPS`: MatMul, Gemm, Conv, ConvTranspose, Einsum, Attention) compute in
  the low precision (float16 or bfloat16). Each float32 data input gets a ``Cast(to=low)``
  (one per source value, shared by all its low consumers, placed right after the value's
  producer); each float output gets a ``Cast`` back to float32 for its consumers. Integer
  inputs (shapes, indices) are untouched. A node runs low only when its float data inputs are
  all float32 (known dtypes) and its schema at the model's opset takes the low type (so Conv
  stays float32 in bfloat16 before opset 22).
- Everything else stays float32, in particular :data:`FP32_OPS` (Softmax, the
  normalizations, Reduce*, losses, Exp, Log, Pow, Sqrt, Reciprocal, Div, Erf, CumSum).
- Cast propagation (onnxruntime's ``propagate_cast_ops_level``): -1 none; 0 only the op
  types in ``allow``; 1 also Transpose, Relu, Reshape, Split, Tanh; 2 also Dropout, Gather,
  Gelu, LayerNormalization, Where (FastGelu and BiasGelu are listed for parity but live in
  com.microsoft, and nodes of other domains are never touched). ``allow`` adds op types at
  any level >= 0. Candidate nodes connected by data edges form regions; a region moves to low
  precision only when that removes more casts than it adds (counting the casts the region
  would need on its inputs and outputs and the Cast pairs that disappear), repeated until no
  region moves. Graph output dtypes never change.
- From level 1 (the default), first, torch.autocast's rule for the ops outside its lists
  (:data:`FOLLOW_OPS`: element-wise and layout ops): in graph order, one whose float inputs
  are low-precision results, or parameters beside at least one (a value that depends on
  weights and constants only and holds one row: a bias, a scale), runs low; one beside a
  float32 activation stays float32 (torch's type promotion: a residual Add).
- Always: ``Cast(Cast(x: low -> float32) -> low)`` is ``x`` (exact); the lossy
  ``Cast(Cast(x: float32 -> low) -> float32)`` is never removed.
- Only main-graph nodes of the default domain change; If/Loop/Scan bodies and other domains
  are left alone.

Every value of the original graph keeps its identity, name and float32 dtype (the builder
holds the user's outputs and loss by object): a converted node gets fresh low-precision
outputs and the original values become the outputs of the Casts back to float32. Dtype
metadata of the new values is set; shape inference is not re-run. Casts back that nothing
uses any more stay in the graph (the builder's final cleanup removes them) because a
requested output may still name them.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

from ..traversal import has_subgraph

F32 = ir.DataType.FLOAT
LOW_TYPES = {"float16": ir.DataType.FLOAT16, "bfloat16": ir.DataType.BFLOAT16}

# Attention (opset 23): Q, K, V, a float attn_mask and past key/value all share the compute
# type (its float outputs too), so the generic "every float input and output" rule fits it.
LOW_OPS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "Attention"})
FP32_OPS = frozenset({
    "Softmax", "LogSoftmax", "LayerNormalization", "BatchNormalization", "InstanceNormalization",
    "GroupNormalization", "RMSNormalization", "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin",
    "ReduceProd", "ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp",
    "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss", "Exp", "Log", "Pow", "Sqrt",
    "Reciprocal", "Div", "Erf", "CumSum",
})  # documentation: every op outside LOW_OPS stays float32 unless propagation moves it
LEVEL_OPS = {
    1: frozenset({"Transpose", "Relu", "Reshape", "Split", "Tanh"}),
    2: frozenset({"Dropout", "Gather", "Gelu", "LayerNormalization", "Where", "FastGelu", "BiasGelu"}),
}
# Inputs / outputs that carry the compute type where not every float one does (Dropout's ratio
# is its own type; LayerNormalization's Mean and InvStdDev stay float32). Other ops: every
# float input and output.
_DATA_INPUTS = {"Dropout": (0,), "Resize": (0,), "Upsample": (0,)}
# Ops that torch.autocast runs in the type of their inputs (none of its float32 lists): fed by
# low-precision results and parameters only, they stay low (``_Autocast.promote``).
FOLLOW_OPS = frozenset({"Add", "Sub", "Mul", "Neg", "Relu", "Gelu", "Tanh", "Sigmoid", "Transpose", "Reshape",
                        "Split", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Concat", "Slice", "Dropout"})
_DATA_OUTPUTS = {"Dropout": (0,), "LayerNormalization": (0,)}


def propagation_ops(level: int, allow=()) -> frozenset[str]:
    """The op types cast propagation may move into low precision at ``level``."""
    if level < 0:
        return frozenset()
    ops = set(allow)
    for at, extra in LEVEL_OPS.items():
        if level >= at:
            ops |= extra
    return frozenset(ops - LOW_OPS)


def autocast(model: ir.Model, ctx) -> None:
    """With ``ctx.mixed_precision`` ("float16"/"bfloat16"): run LOW ops in that precision,
    propagate casts up to level ``ctx.cast_propagation[0]`` (plus the op types of
    ``ctx.cast_propagation[1]``), and drop exact Cast pairs. Counts go to
    ``ctx.reports["mixed_precision"]``: ``casts`` (live Casts the pass added), ``low_nodes``
    (nodes running low) and ``propagated`` (of those, the ones moved by propagation)."""
    if ctx.mixed_precision is None:
        return
    graph, low, unique = model.graph, ctx.mixed_precision, ctx.unique
    level, allow = ctx.cast_propagation
    ac = _Autocast(graph, LOW_TYPES.get(low, low), unique)
    low_nodes = [n for n in list(graph) if n.op_type in LOW_OPS and ac.convertible(n)]
    for node in low_nodes:
        ac.convert(node)
    ac.drop_cast_pairs()
    followed = ac.promote(FOLLOW_OPS, _parameter_like(graph, ctx.wrt)) if level >= 1 else 0
    moved = followed + ac.propagate(propagation_ops(level, allow))
    ac.sweep()
    casts = sum(1 for n in ac.created if n.graph is graph and _live(n))
    ctx.reports["mixed_precision"] = {"casts": casts, "low_nodes": len(low_nodes) + moved, "propagated": moved}


def _parameter_like(graph: ir.Graph, wrt) -> "callable":
    """Whether a value is a parameter as torch sees one beside an activation: it depends on
    no input but weights and constants, and holds at most one row (a bias, a scale)."""
    weights = {id(w) for w in wrt}
    data = {id(v) for v in graph.inputs if id(v) not in weights and v.name not in graph.initializers}
    for node in graph:
        if any(v is not None and id(v) in data for v in node.inputs):
            data.update(id(o) for o in node.outputs)

    def like(v: ir.Value) -> bool:
        dims = None if v.shape is None else list(v.shape.dims)
        return id(v) not in data and dims is not None and all(isinstance(d, int) and d == 1 for d in dims[:-1])

    return like


def _is_cast(node: ir.Node | None, to: ir.DataType) -> bool:
    if node is None or node.op_type != "Cast" or node.domain not in ("", "ai.onnx"):
        return False
    a = node.attributes.get("to")
    return a is not None and a.value == int(to)


def _live(node: ir.Node) -> bool:
    """Whether some output of ``node`` is used (one level: enough to skip dead Casts)."""
    return any(o.uses() or o.is_graph_output() for o in node.outputs)


def _live_uses(v: ir.Value):
    return [u for u in v.uses() if u.node.graph is not v.graph or _live(u.node)]


class _Autocast:
    def __init__(self, graph: ir.Graph, low: ir.DataType, unique):
        if low not in LOW_TYPES.values():
            raise ValueError(f"mixed precision is float16 or bfloat16, got {low!r}")
        self.graph, self.low, self.unique = graph, low, unique
        self.opset = graph.opset_imports.get("", graph.opset_imports.get("ai.onnx", onnx.defs.onnx_opset_version()))
        self.suffix = "fp16" if low == ir.DataType.FLOAT16 else "bf16"
        self.low_of: dict[ir.Value, ir.Value] = {}  # float32 value -> its shared Cast to low
        self.created: list[ir.Node] = []

    # ------------------------------------------------------------------ which inputs/outputs
    def data_inputs(self, node: ir.Node) -> list[int]:
        listed = _DATA_INPUTS.get(node.op_type)
        return [
            i for i, v in enumerate(node.inputs)
            if v is not None and (i in listed if listed else v.dtype is None or v.dtype.is_floating_point())
        ]

    def data_outputs(self, node: ir.Node) -> list[int]:
        listed = _DATA_OUTPUTS.get(node.op_type)
        return [i for i, v in enumerate(node.outputs)
                if (i in listed if listed else v.dtype in (None, F32)) and v.dtype in (None, F32)]

    def convertible(self, node: ir.Node) -> bool:
        """A main-graph default-domain node whose data inputs are all known float32."""
        if node.graph is not self.graph or node.domain not in ("", "ai.onnx"):
            return False
        if has_subgraph(node):
            return False
        data = self.data_inputs(node)
        return bool(data) and all(node.inputs[i].dtype == F32 for i in data) and self.schema_allows(node, data)

    def schema_allows(self, node: ir.Node, data: list[int]) -> bool:
        """Whether the op's schema at the model's opset takes the low type on its data inputs
        and outputs (Conv takes bfloat16 only from opset 22)."""
        try:
            schema = onnx.defs.get_schema(node.op_type, self.opset, "")
        except onnx.defs.SchemaError:
            return False
        allowed = {c.type_param_str: c.allowed_type_strs for c in schema.type_constraints}
        want = f"tensor({self.low.name.lower()})"
        params = [(schema.inputs, i) for i in data] + [(schema.outputs, j) for j in self.data_outputs(node)]
        for formal, i in params:
            type_str = formal[min(i, len(formal) - 1)].type_str
            if want not in allowed.get(type_str, [type_str]):
                return False
        return True

    # ------------------------------------------------------------------ rewriting
    def from_low(self, v: ir.Value) -> ir.Value | None:
        """``x`` when ``v`` is ``Cast(x: low -> float32)``."""
        p = v.producer()
        if _is_cast(p, F32) and p.inputs[0] is not None and p.inputs[0].dtype == self.low:
            return p.inputs[0]
        return None

    def low_source(self, v: ir.Value) -> ir.Value:
        """``v`` in low precision: the value it was cast from, or one shared Cast of it."""
        x = self.from_low(v)
        if x is not None:
            return x
        if v not in self.low_of:
            cast = ir.Node("", "Cast", [v], [ir.AttrInt64("to", int(self.low))],
                           name=self.unique(f"{v.name}_to_{self.suffix}_node"))
            out = cast.outputs[0]
            out.name, out.dtype, out.shape = self.unique(f"{v.name}_{self.suffix}"), self.low, v.shape
            p = v.producer()
            if p is not None and p.graph is self.graph:
                self.graph.insert_after(p, cast)
            else:
                self.graph.insert_before(next(iter(self.graph)), cast)
            self.created.append(cast)
            self.low_of[v] = out
        return self.low_of[v]

    def convert(self, node: ir.Node) -> None:
        """Run ``node`` in low precision: low data inputs, fresh low outputs, and the original
        output values (same object, name and dtype) produced by Casts back to float32."""
        for i in self.data_inputs(node):
            node.replace_input_with(i, self.low_source(node.inputs[i]))
        data_out = set(self.data_outputs(node))
        olds = list(node.outputs)
        holders = [self._detach(y) for y in olds]
        node.resize_outputs(0)
        node.resize_outputs(len(olds))
        after = []
        for i, (old, new, holder) in enumerate(zip(olds, node.outputs, holders)):
            new.shape = old.shape
            if holder is None and not old.name:  # an omitted optional output stays omitted
                new.dtype = self.low if i in data_out else old.dtype
            elif i in data_out:
                old.dtype = F32
                new.dtype, new.name = self.low, self.unique(f"{old.name}_{self.suffix}")
                after.append(ir.Node("", "Cast", [new], [ir.AttrInt64("to", int(F32))], outputs=[old],
                                     name=self.unique(f"{old.name}_to_fp32_node")))
            elif holder is None:  # unused non-data output (Dropout's mask): takes the name
                new.dtype, name, old.name = old.dtype, old.name, None
                new.name = name
            else:
                new.dtype, new.name = old.dtype, self.unique(f"{old.name}_out")
                after.append(ir.Node("", "Identity", [new], outputs=[old], name=self.unique(f"{old.name}_node")))
        self.graph.insert_after(node, after)
        self.created.extend(n for n in after if n.op_type == "Cast")
        for old, holder in zip(olds, holders):
            if holder is not None:
                holder.replace_all_uses_with(old, replace_graph_outputs=True)

    @staticmethod
    def _detach(y: ir.Value) -> ir.Value | None:
        """Move ``y``'s uses (graph outputs included) to a placeholder, so its node can let go."""
        if not y.uses() and not y.is_graph_output():
            return None
        holder = ir.Value(name=None)
        y.replace_all_uses_with(holder, replace_graph_outputs=True)
        return holder

    def drop_cast_pairs(self) -> None:
        """``Cast(Cast(x: low -> float32) -> low)`` -> ``x`` (the outer Cast is left unused)."""
        for node in list(self.graph):
            if not _is_cast(node, self.low) or node.outputs[0].is_graph_output():
                continue
            x = self.from_low(node.inputs[0]) if node.inputs[0] is not None else None
            if x is not None and node.outputs[0].uses():
                node.outputs[0].replace_all_uses_with(x)

    def sweep(self) -> None:
        """Remove the added Casts to low that nothing uses (their outputs are our own)."""
        dead = [c for v, c in self.low_of.items() if not c.uses() and not c.is_graph_output()]
        for out in dead:
            self.created.remove(out.producer())
            self.graph.remove(out.producer(), safe=True)
        self.low_of = {v: c for v, c in self.low_of.items() if c.producer() is not None and c.graph is not None}

    # ------------------------------------------------------------------ propagation
    def promote(self, ops: frozenset[str], parameter_like) -> int:
        """torch.autocast's rule for the ops outside its lists, in graph order: an ``ops`` node
        whose float inputs are low-precision results, or parameters (``parameter_like``: a
        bias, a scale) beside at least one such result, runs low; an activation in float32
        beside it keeps it in float32 (torch's type promotion)."""
        moved = 0
        for node in list(self.graph):
            if node.op_type not in ops or not self.convertible(node) or not _live(node):
                continue
            data = self.data_inputs(node)
            low = [i for i in data if self.from_low(node.inputs[i]) is not None]
            if low and all(i in low or parameter_like(node.inputs[i]) for i in data):
                self.convert(node)
                moved += 1
        self.drop_cast_pairs()
        return moved

    def propagate(self, ops: frozenset[str]) -> int:
        """Move regions of ``ops`` nodes to low precision while that saves casts."""
        moved = 0
        while ops:
            regions = [r for r in self.regions(ops) if self.saving(r) > 0]
            if not regions:
                return moved
            # Regions are disjoint and not adjacent: each saving holds whatever the others do.
            for region in regions:
                for node in region:
                    self.convert(node)
                moved += len(region)
            self.drop_cast_pairs()
        return moved

    def regions(self, ops: frozenset[str]) -> list[list[ir.Node]]:
        """Candidate nodes (in ``ops``, convertible) grouped by data edges, in graph order."""
        nodes = [n for n in self.graph if n.op_type in ops and self.convertible(n) and _live(n)]
        parent = {id(n): id(n) for n in nodes}

        def root(k):
            while parent[k] != k:
                parent[k] = parent[parent[k]]
                k = parent[k]
            return k

        for n in nodes:
            for i in self.data_inputs(n):
                p = n.inputs[i].producer()
                if p is not None and id(p) in parent:
                    parent[root(id(n))] = root(id(p))
        groups: dict[int, list[ir.Node]] = {}
        for n in nodes:
            groups.setdefault(root(id(n)), []).append(n)
        return list(groups.values())

    def saving(self, region: list[ir.Node]) -> int:
        """Casts removed minus casts added if ``region`` ran in low precision."""
        inside = {id(n) for n in region}

        def internal(use) -> bool:
            return id(use.node) in inside and use.idx in self.data_inputs(use.node)

        added = removed = 0
        seen = set()
        for node in region:
            for i in self.data_inputs(node):
                v = node.inputs[i]
                if id(v.producer()) in inside or v in seen:
                    continue
                seen.add(v)
                shared = self.low_of.get(v)
                if self.from_low(v) is not None:
                    if not v.is_graph_output() and all(internal(u) for u in _live_uses(v)):
                        removed += 1  # the Cast back to float32 dies
                elif shared is None or not shared.uses():
                    added += 1
            for j in self.data_outputs(node):
                y = node.outputs[j]
                outside = [u for u in _live_uses(y) if not internal(u)]
                to_low = sum(1 for u in outside if _is_cast(u.node, self.low))
                removed += to_low
                if y.is_graph_output() or len(outside) > to_low:
                    added += 1
        return removed - added
