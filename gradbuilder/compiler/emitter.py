"""The opset-aware emitter that rules and passes write nodes with: ``e.Mul(a, b)`` emits a
``Mul`` node, and inside ``with e.math():`` so does ``a * b``; helpers hide opset differences
and reverse broadcasting; a light type and shape inference records what each new value is."""

from __future__ import annotations

import contextlib

import numpy as np
import onnx_ir as ir

from ..errors import GradientRuleError
from .values import attr, broadcast_dims, constant_of, dims_of


def _to_ir_shape(dims) -> ir.Shape | None:
    if dims is None:
        return None
    return ir.Shape(list(dims))


_ELEMENTWISE_BINARY = frozenset(
    "Add Sub Mul Div Pow Max Min Sum Mean PRelu Mod BitShift".split()
)
_COMPARE = frozenset("Equal Less Greater LessOrEqual GreaterOrEqual And Or Xor".split())
_UNARY_SAME = frozenset(
    """Neg Exp Log Sqrt Reciprocal Tanh Sigmoid Relu Abs Identity Erf Sin Cos Tan Asin Acos
    Atan Sinh Cosh Asinh Acosh Atanh Softmax LogSoftmax Sign Floor Ceil Round Softplus Softsign
    Elu Selu LeakyRelu HardSigmoid HardSwish Gelu CumSum Clip Dropout Celu Mish ThresholdedRelu
    Shrink Hardmax Trilu""".split()
)

_DATA_FIRST = frozenset(
    """Concat Slice Split Range Gather GatherElements GatherND Tile Pad Flatten ScatterND ScatterElements
    Conv ConvTranspose MaxPool AveragePool Gemm Einsum Col2Im Resize DepthToSpace SpaceToDepth
    BatchNormalization LayerNormalization InstanceNormalization GroupNormalization""".split()
)


# ----------------------------------------------------------------------------- emitter


class Emitter:
    """Appends new nodes to a graph, with unique names and light type/shape propagation.

    ``e.Mul(a, b)`` emits a ``Mul`` node and returns its output; ``e.op("Split", x,
    outputs=2, axis=0)`` is the general form. Where an op's form differs between opsets the
    op's own name is the safe form: ``Squeeze``/``Unsqueeze``/``Reshape`` take lists too,
    ``Reshape``'s allowzero and ``Shape``'s start/end are dropped or emulated where the opset
    lacks them, ``Where`` blends bfloat16 before opset 16, ``DFT`` takes its axis as the opset
    wants, ``CastLike`` is a Cast when the type is known. Helpers have names no op has:
    ``reduce``, ``split_into``, ``accumulate`` (None is zero), ``expand_like``, ``zeros_like``,
    ``ones_like``, ``unbroadcast`` (reverse broadcasting), ``if_``, ``const``/``scalar``/``ints``.
    ``typed`` records a value's dtype and shape where the emitter's light inference cannot;
    ``used_names`` is the set of names taken in the model (shared with child emitters).
    ``scope`` prefixes the names of what it emits (``with e.scoped(prefix):`` for a block);
    ``place_before(node)`` moves what it has emitted to just before ``node`` (a pass that
    rewrites a node in place); ``inline(graph, bindings)`` emits a subgraph's nodes here.
    ``with e.math():`` lets values be written as math (``+ - * / ** @``, unary minus, Python
    numbers typed like the other operand): ``dy * (1 - y * y)`` emits Mul, Sub, Mul here.
    """

    def __init__(self, graph: ir.Graph, opset: int, used_names: set[str] | None = None, scope: str = ""):
        self.graph = graph
        self.opset = opset
        self.scope = scope
        self.used_names = used_names if used_names is not None else collect_names(graph)
        self._counter = 0
        self._consts: dict[tuple, ir.Value] = {}
        self.nodes: list[ir.Node] = []
        self.outer: tuple[ir.Graph, ...] = ()  # the graphs around ``graph`` whose values it may read

    def child(self, graph: ir.Graph) -> "Emitter":
        """An emitter for a subgraph (a control-flow body): names stay unique across scopes;
        constants are the subgraph's own."""
        sub = Emitter(graph, self.opset, self.used_names, scope=self.scope)
        sub.outer = (self.graph, *self.outer)
        return sub

    @contextlib.contextmanager
    def math(self):
        """In the block, ``+ - * / ** @`` and unary minus on values emit Add Sub Mul Div Pow
        MatMul Neg here; a Python number is a constant of the other operand's dtype. A value of
        a graph this one cannot read (a subgraph's, while its parent's math is on) is an error:
        use the subgraph emitter's own ``math()``."""
        outer = ir.set_value_magic_handler(_Math(self))
        try:
            yield self
        finally:
            ir.set_value_magic_handler(outer)

    @contextlib.contextmanager
    def scoped(self, prefix: str):
        """Names of the nodes emitted in the block start with ``prefix``."""
        outer, self.scope = self.scope, prefix
        try:
            yield self
        finally:
            self.scope = outer

    def place_before(self, node: ir.Node) -> None:
        """Move every node emitted so far to just before ``node`` of the same graph, in order."""
        self.graph.remove(self.nodes)
        self.graph.insert_before(node, self.nodes)

    def inline(self, graph: ir.Graph, bindings: dict, prefix: str = "") -> tuple[list[ir.Value], list[ir.Node]]:
        """``graph``'s nodes emitted here (``graph`` is consumed: pass a clone), named under the
        scope and ``prefix``, its inputs read as ``bindings`` (its value -> a value here), its
        initializers as Constant nodes: (its outputs as values here, the nodes emitted)."""
        for node in graph:
            node.name = self.unique(f"{self.scope}{prefix}{node.name or node.op_type}")
            for out in node.outputs:
                out.name = self.unique(f"{self.scope}{prefix}{out.name or 'out'}")
        mapping = dict(bindings)
        for init in list(graph.initializers.values()):  # the subgraph's own constants
            mapping[init] = self.op("Constant", value=ir.AttrTensor("value", init.const_value))
        outputs = list(graph.outputs)
        graph.outputs.clear()
        for inner, outer in mapping.items():
            ir.convenience.replace_all_uses_with(inner, outer)
        nodes = list(graph)
        graph.remove(nodes)
        for node in nodes:
            self.graph.append(node)
            self.nodes.append(node)
        return [mapping.get(o, o) for o in outputs], nodes

    # names ---------------------------------------------------------------------------
    def unique(self, hint: str) -> str:
        name = hint
        while name in self.used_names:
            self._counter += 1
            name = f"{hint}__{self._counter}"
        self.used_names.add(name)
        return name

    def reserve(self, *names: str) -> None:
        """Mark ``names`` as taken (values named by hand, or by a pass outside the emitter)."""
        self.used_names.update(names)

    # nodes ---------------------------------------------------------------------------
    def op(self, op_type: str, *inputs, domain: str = "", outputs: int = 1, name: str | None = None, **attrs):
        """Emit one node; returns its output value (or a tuple when ``outputs`` > 1)."""
        ins = [self._as_value(x) for x in inputs]
        attributes = [_attr(k, v) for k, v in attrs.items() if v is not None]
        hint = f"{self.scope}{op_type}" if self.scope else op_type
        node = ir.Node(
            domain,
            op_type,
            ins,
            attributes,
            num_outputs=outputs,
            name=self.unique(f"{hint}_node"),
        )
        for i, out in enumerate(node.outputs):
            out.name = self.unique(name if (name and i == 0) else f"{hint}_out{i}" if outputs > 1 else f"{hint}_out")
        self._infer(node)
        self.graph.append(node)
        self.nodes.append(node)
        return node.outputs[0] if outputs == 1 else tuple(node.outputs)

    def __getattr__(self, op_type: str):
        if op_type[:1].isupper():
            return lambda *inputs, **attrs: self.op(op_type, *inputs, **attrs)
        raise AttributeError(op_type)

    def _as_value(self, x):
        if x is None or isinstance(x, ir.Value):
            return x
        raise GradientRuleError(f"emitter input must be an ir.Value or None, got {type(x).__name__}")

    def CastLike(self, x: ir.Value, like: ir.Value) -> ir.Value:  # noqa: N802 (ONNX op name)
        """``x`` cast to ``like``'s dtype: Cast when the dtype is known (any opset), else CastLike."""
        if like.dtype is not None:
            if x.dtype == like.dtype:
                return x
            return self.op("Cast", x, to=int(like.dtype))
        if self.opset < 15:
            raise GradientRuleError("CastLike needs opset 15; the target dtype is unknown")
        return self.op("CastLike", x, like)

    # constants -------------------------------------------------------------------------
    def const(self, array, dtype: ir.DataType | None = None) -> ir.Value:
        """A constant (cached) from a numpy array or Python scalar/list."""
        arr = np.asarray(array)
        if dtype is not None:
            arr = arr.astype(dtype.numpy())
        elif arr.dtype == np.float64 and not isinstance(array, np.ndarray):
            arr = arr.astype(np.float32)
        elif arr.dtype.kind == "i" and not isinstance(array, np.ndarray):
            arr = arr.astype(np.int64)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        cached = self._consts.get(key)
        if cached is not None:
            return cached
        tensor = ir.tensor(arr, dtype=dtype) if dtype is not None else ir.tensor(arr)
        node = ir.Node("", "Constant", [], [ir.AttrTensor("value", tensor)], name=self.unique("Const_node"))
        out = node.outputs[0]
        out.name = self.unique("const")
        out.dtype = tensor.dtype
        out.shape = ir.Shape(arr.shape)
        out.const_value = tensor
        self.graph.append(node)
        self.nodes.append(node)
        self._consts[key] = out
        return out

    def scalar(self, x: float, like: ir.Value) -> ir.Value:
        """A rank-0 constant ``x`` with the dtype of ``like`` (CastLike when it is unknown)."""
        if like.dtype is None and self.opset >= 15:
            return self.op("CastLike", self.const(np.array(x), dtype=ir.DataType.DOUBLE), like)
        return self.const(np.array(x), dtype=like.dtype or ir.DataType.FLOAT)

    def ints(self, values) -> ir.Value:
        return self.const(np.asarray(list(values) if not np.isscalar(values) else values, dtype=np.int64))

    # opset-aware helpers -----------------------------------------------------------------
    def reduce(self, op_type: str, x: ir.Value, axes=None, keepdims: bool = True) -> ir.Value:
        """``op_type`` (ReduceSum/ReduceMean/...) over ``axes``: a list, an int64 value, or
        None/[] for all axes."""
        axes_as_input = (op_type == "ReduceSum" and self.opset >= 13) or self.opset >= 18
        everything = axes is None or (isinstance(axes, (list, tuple)) and len(axes) == 0)
        if axes_as_input:
            if everything:
                return self.op(op_type, x, keepdims=int(keepdims))
            axes_v = axes if isinstance(axes, ir.Value) else self.ints(axes)
            return self.op(op_type, x, axes_v, keepdims=int(keepdims))
        if isinstance(axes, ir.Value):
            raise GradientRuleError(f"{op_type} at opset {self.opset} needs static axes")
        return self.op(op_type, x, axes=None if everything else list(axes), keepdims=int(keepdims))

    def expand_like(self, v: ir.Value, like: ir.Value) -> ir.Value:
        """``v`` broadcast to the shape of ``like`` (a no-op when the shapes already match)."""
        vd, ld = dims_of(v), dims_of(like)
        if vd is not None and vd == ld and all(d is not None for d in vd):
            return v
        if ld is not None and all(isinstance(d, int) for d in ld):
            return self.op("Expand", v, self.ints(ld))
        return self.op("Expand", v, self.Shape(like))

    def Squeeze(self, x: ir.Value, axes=None) -> ir.Value:  # noqa: N802 (ONNX op name)
        """Squeeze ``axes`` (a list or an int64 value; None: every axis of size 1)."""
        if axes is None:
            return self.op("Squeeze", x)
        return self.op("Squeeze", x, axes if isinstance(axes, ir.Value) else self.ints(axes))

    def Unsqueeze(self, x: ir.Value, axes) -> ir.Value:  # noqa: N802 (ONNX op name)
        """Unsqueeze at ``axes`` (a list or an int64 value)."""
        return self.op("Unsqueeze", x, axes if isinstance(axes, ir.Value) else self.ints(axes))

    def Shape(self, x: ir.Value, start: int | None = None, end: int | None = None) -> ir.Value:  # noqa: N802
        """Shape of ``x`` (dims ``start:end``); Shape's start/end exist from opset 15 only."""
        if (start is None and end is None) or self.opset >= 15:
            return self.op("Shape", x, start=start, end=end)
        full = self.op("Shape", x)
        stop = end if end is not None else 2**62
        return self.op("Slice", full, self.ints([start or 0]), self.ints([stop]), self.ints([0]))

    def Reshape(self, x: ir.Value, shape, allowzero: bool = False) -> ir.Value:  # noqa: N802 (ONNX op name)
        """Reshape ``x`` to ``shape`` (a list or an int64 value). ``allowzero``: a 0 in shape
        means an empty axis, not a copy of x's dim; the attribute exists from opset 14, before
        which it is left out."""
        shape = shape if isinstance(shape, ir.Value) else self.ints(shape)
        if allowzero and self.opset >= 14:
            return self.op("Reshape", x, shape, allowzero=1)
        return self.op("Reshape", x, shape)

    def split_into(self, x: ir.Value, parts: int, axis: int = 0, sizes=None) -> list[ir.Value]:
        """``x`` in ``parts`` pieces along ``axis``: equal pieces (Split's num_outputs attribute
        from opset 18, implied by the output count before), or of ``sizes`` (an int64 value, given
        as Split's input)."""
        if sizes is not None:
            return list(self.op("Split", x, sizes, outputs=parts, axis=axis))
        if parts == 1:
            return [x]
        if self.opset >= 18:
            return list(self.op("Split", x, outputs=parts, axis=axis, num_outputs=parts))
        return list(self.op("Split", x, outputs=parts, axis=axis))

    def Where(self, cond: ir.Value, a: ir.Value, b: ir.Value) -> ir.Value:  # noqa: N802 (ONNX op name)
        """``Where(cond, a, b)``. Where takes bfloat16 only from opset 16; before, a blend with a
        0/1 mask instead."""
        if self.opset >= 16 or ir.DataType.BFLOAT16 not in (a.dtype, b.dtype):
            return self.op("Where", cond, a, b)
        m = self.CastLike(cond, a)
        return self.Add(self.Mul(m, a), self.Mul(self.Sub(self.scalar(1.0, a), m), b))

    def if_(self, cond: ir.Value, then, otherwise, likes: list[ir.Value], name: str = "branch") -> list[ir.Value]:
        """``If(cond, then(emitter), otherwise(emitter))``: each function emits its branch
        with the emitter it is given (a subgraph's; values of the enclosing graphs may be read)
        and returns one value per ``likes``, which types the outputs."""
        branches = []
        for build in (then, otherwise):
            g = ir.Graph([], [], nodes=[], name=self.unique(name))
            sub = self.child(g)
            outputs = []
            for value, like in zip(build(sub), likes):
                if value.producer() is None or value.producer().graph is not g or value in outputs:
                    value = sub.Identity(value)  # a subgraph output is produced inside the subgraph
                value.dtype = like.dtype
                if like.shape is not None:
                    value.shape = like.shape
                outputs.append(value)
            g.outputs.extend(outputs)
            branches.append(g)
        outs = self.op("If", cond, outputs=len(likes), then_branch=branches[0], else_branch=branches[1])
        outs = list(outs) if isinstance(outs, tuple) else [outs]
        for o, like in zip(outs, likes):
            o.dtype, o.shape = like.dtype, like.shape
        return outs

    def DFT(self, x: ir.Value, axis, inverse: int = 0, onesided: int = 0) -> ir.Value:  # noqa: N802 (ONNX op name)
        """DFT of ``x`` along ``axis`` (an int, or a 1-element int64 value from opset 20), no
        dft_length: the axis is an attribute before opset 20, an input from then on."""
        flags = {"inverse": inverse or None, "onesided": onesided or None}
        if self.opset < 20:
            return self.op("DFT", x, axis=axis, **flags)
        axis_v = self.const(np.array(axis, np.int64)) if isinstance(axis, int) else self.Reshape(axis, [])
        return self.op("DFT", x, None, axis_v, **flags)

    def accumulate(self, a: ir.Value | None, b: ir.Value | None) -> ir.Value | None:
        """a + b where None is zero (gradient contributions that may be absent)."""
        if a is None:
            return b
        if b is None:
            return a
        return self.Add(a, b)

    def zeros_like(self, x: ir.Value) -> ir.Value:
        """Zeros shaped like ``x``: one scalar expanded, never a full-size constant."""
        return self.expand_like(self.scalar(0.0, x), x)

    def ones_like(self, x: ir.Value) -> ir.Value:
        dims = dims_of(x)
        if dims is not None and len(dims) == 0:
            return self.scalar(1.0, x)
        return self.expand_like(self.scalar(1.0, x), x)

    def unbroadcast(self, grad: ir.Value, like: ir.Value) -> ir.Value:
        """Sum ``grad`` over the axes broadcasting added, so it takes the shape of ``like``.

        Static shapes (ints and matching symbolic names) give a constant-axes ReduceSum;
        otherwise a Shape-based subgraph computes the axes at run time.
        """
        g = dims_of(grad)
        x = dims_of(like)
        if g is not None and x is not None and len(g) >= len(x):
            lead = len(g) - len(x)
            axes = list(range(lead))
            static = True
            for i, xd in enumerate(x):
                gd = g[lead + i]
                if xd == gd and xd is not None:
                    continue
                if xd == 1:
                    axes.append(lead + i)
                elif isinstance(xd, int) or (gd == 1):
                    continue  # like is the full size (or grad is 1 and like is not: impossible)
                else:
                    static = False
                    break
            if static:
                if not axes:
                    return grad
                if len(axes) == lead and self._sums_as_product(grad, g, lead):
                    # only leading axes, all sizes known, float32: ones[1, M] @ grad[M, N], a
                    # matrix-vector product that onnxruntime runs on every thread, where its
                    # ReduceSum over the leading axes gets slower with a second thread
                    m, n = int(np.prod(g[:lead])), int(np.prod(g[lead:], dtype=np.int64))
                    flat = grad if len(g) == 2 else self.Reshape(grad, self.ints([m, n]))
                    ones = self.const(np.ones((1, m), np.float32))
                    out = self.Reshape(self.MatMul(ones, flat), self.ints(list(x)))
                elif len(axes) == lead:  # only leading axes: one ReduceSum without keepdims
                    out = self.reduce("ReduceSum", grad, axes, keepdims=False)
                else:
                    out = self.reduce("ReduceSum", grad, axes, keepdims=True)
                    if lead:
                        out = self.Squeeze(out, list(range(lead)))
                self.typed(out, like.dtype, x)
                return out
        return self._unbroadcast_dynamic(grad, like)

    @staticmethod
    def _sums_as_product(grad: ir.Value, dims, lead: int) -> bool:
        return (grad.dtype == ir.DataType.FLOAT and lead > 0 and all(isinstance(d, int) for d in dims)
                and int(np.prod(dims[:lead])) >= 64)

    def _unbroadcast_dynamic(self, grad: ir.Value, like: ir.Value) -> ir.Value:
        gshape = self.Shape(grad)
        xshape = self.Shape(like)
        grank = self.Shape(gshape)
        xrank = self.Shape(xshape)
        pad = self.op("Sub", grank, xrank)
        ones = self.op("ConstantOfShape", pad, value=ir.tensor(np.array([1], dtype=np.int64)))
        padded = self.op("Concat", ones, xshape, axis=0)
        mask = self.op("Equal", padded, self.ints([1]))
        axes = self.Reshape(self.op("NonZero", mask), [-1])
        summed = self.op("ReduceSum", grad, axes, keepdims=1, noop_with_empty_axes=1)
        out = self.op("Reshape", summed, xshape)
        self.typed(out, like.dtype, dims_of(like))
        return out

    # type propagation ---------------------------------------------------------------------
    @staticmethod
    def typed(value: ir.Value, dtype, dims) -> ir.Value:
        """Record ``dtype`` and ``dims`` (ints, names or None per dim) on ``value`` where it has
        none yet (what a rule knows and the emitter's inference does not); returns ``value``."""
        if dtype is not None and value.dtype is None:
            value.dtype = dtype
        if dims is not None and value.shape is None:
            value.shape = _to_ir_shape(dims)
        return value

    def _infer(self, node: ir.Node) -> None:
        """Record what the light inference (``_INFERENCE``, by op type) knows of ``node``'s
        output: its dtype and dims (Split: every output's dtype)."""
        out = node.outputs[0]
        if node.domain not in ("", "ai.onnx"):
            return
        infer = _INFERENCE.get(node.op_type)
        if infer is None:
            return
        first = next((v for v in node.inputs if v is not None), None)
        inferred = infer(node, node.inputs, first)
        if inferred is None:
            return
        for o in (node.outputs if node.op_type == "Split" else [out]):
            self.typed(o, *inferred)


# ----------------------------------------------------------------------------- light inference
# Each function takes (node, its inputs, the first input given) and returns the (dtype, dims)
# of the node's output, or None where it knows nothing.


def _all_dims(ins) -> tuple | None:
    return broadcast_dims(*[dims_of(v) for v in ins if v is not None])


def _infer_elementwise(node, ins, first):
    """The first known dtype of the data inputs (Where's condition left out), the broadcast dims."""
    data = ins[1:] if node.op_type == "Where" else ins
    dtype = next((v.dtype for v in data if v is not None and v.dtype is not None), None)
    return dtype, _all_dims(ins)


def _infer_comparison(node, ins, first):
    return ir.DataType.BOOL, _all_dims(ins)


def _infer_same_as_first(node, ins, first):
    return first.dtype, dims_of(first)


def _infer_cast(node, ins, first):
    return ir.DataType(attr(node, "to")), dims_of(first)


def _infer_cast_like(node, ins, first):
    return ins[1].dtype, dims_of(first)


def _infer_shape(node, ins, first):
    """int64 [n], n the number of dims from start to end where the input's rank is known."""
    d = dims_of(first)
    start, end = attr(node, "start", 0), attr(node, "end", None)
    n = len(d[slice(start, end)]) if d is not None else None
    return ir.DataType.INT64, (n,) if n is not None else None


def _infer_transpose(node, ins, first):
    d = dims_of(first)
    perm = attr(node, "perm")
    if d is not None:
        perm = perm if perm is not None else list(reversed(range(len(d))))
        d = tuple(d[p] for p in perm)
    return first.dtype, d


def _infer_matmul(node, ins, first):
    """The batch dims broadcast, then (rows of a, columns of b), for operands of rank 2 or more."""
    a, b = dims_of(ins[0]), dims_of(ins[1])
    dims = None
    if a is not None and b is not None and len(a) >= 2 and len(b) >= 2:
        batch = broadcast_dims(a[:-2], b[:-2])
        dims = None if batch is None else batch + (a[-2], b[-1])
    return first.dtype, dims


def _infer_expand(node, ins, first):
    """The input's dims broadcast with a constant target shape."""
    target = constant_of(ins[1])
    dims = None if target is None else broadcast_dims(dims_of(first), tuple(int(t) for t in target))
    return first.dtype, dims


def _infer_reshape(node, ins, first):
    """The dims a constant target shape gives (_reshaped_dims)."""
    target = constant_of(ins[1])
    dims = None
    if target is not None:
        dims = _reshaped_dims(dims_of(first), [int(t) for t in np.ravel(target)], attr(node, "allowzero", 0))
    return first.dtype, dims


def _static_axes(node, ins):
    """The axes of a Reduce*, Squeeze or Unsqueeze: its constant axes input, else its attribute."""
    return constant_of(ins[1]) if len(ins) > 1 else attr(node, "axes")


def _axes_applied(node, ins, first, apply):
    """The first input's dtype, and its dims with ``apply(dims, axes)`` where both are static."""
    d, axes = dims_of(first), _static_axes(node, ins)
    dims = apply(node, d, [int(a) for a in np.atleast_1d(axes)]) if d is not None and axes is not None else None
    return first.dtype, dims


def _reduced(node, d, axes):
    """The reduced axes 1 (keepdims) or dropped."""
    keep = attr(node, "keepdims", 1)
    ax = {a % max(len(d), 1) for a in axes}
    return tuple((1 if i in ax else x) for i, x in enumerate(d) if keep or i not in ax)


def _squeezed(node, d, axes):
    ax = {a % len(d) for a in axes}
    return tuple(x for i, x in enumerate(d) if i not in ax)


def _unsqueezed(node, d, axes):
    r = len(d) + len(axes)
    ax, it = {a % r for a in axes}, iter(d)
    return tuple(1 if i in ax else next(it) for i in range(r))


def _infer_reduce(node, ins, first):
    return _axes_applied(node, ins, first, _reduced)


def _infer_squeeze(node, ins, first):
    return _axes_applied(node, ins, first, _squeezed)


def _infer_unsqueeze(node, ins, first):
    return _axes_applied(node, ins, first, _unsqueezed)


def _infer_constant_of_shape(node, ins, first):
    v = attr(node, "value")
    return ir.DataType.FLOAT if v is None else ir.tensor(v).dtype, None


def _infer_int64_index(node, ins, first):
    """NonZero ArgMax ArgMin: int64 of unknown dims; Size: an int64 scalar."""
    return ir.DataType.INT64, () if node.op_type == "Size" else None


def _infer_data_first(node, ins, first):
    """The dtype of the first input (the data), dims unknown."""
    return None if first is None else (first.dtype, None)


_REDUCTIONS = frozenset(
    "ReduceSum ReduceMean ReduceMax ReduceMin ReduceProd ReduceSumSquare ReduceL1 ReduceL2 ReduceLogSumExp "
    "ReduceLogSum".split()
)

_INFERENCE = {
    **{op: _infer_elementwise for op in _ELEMENTWISE_BINARY | {"Where"}},
    **{op: _infer_comparison for op in _COMPARE | {"Not"}},
    **{op: _infer_same_as_first for op in _UNARY_SAME},
    "Cast": _infer_cast,
    "CastLike": _infer_cast_like,
    "Shape": _infer_shape,
    "Transpose": _infer_transpose,
    "MatMul": _infer_matmul,
    "Expand": _infer_expand,
    "Reshape": _infer_reshape,
    **{op: _infer_reduce for op in _REDUCTIONS},
    "Squeeze": _infer_squeeze,
    "Unsqueeze": _infer_unsqueeze,
    "ConstantOfShape": _infer_constant_of_shape,
    **{op: _infer_int64_index for op in ("NonZero", "ArgMax", "ArgMin", "Size")},
    **{op: _infer_data_first for op in _DATA_FIRST},
}


def _reshaped_dims(src: tuple | None, target: list[int], allowzero: int) -> tuple:
    """The dims a Reshape to the constant ``target`` gives: a 0 copies the input's dim (unless
    ``allowzero``), a -1 is what the input's static size leaves (unknown otherwise)."""
    dims = []
    for i, t in enumerate(target):
        if t == 0 and not allowzero:
            dims.append(src[i] if src is not None and i < len(src) else None)
        else:
            dims.append(None if t == -1 else t)
    if -1 in target and src is not None and all(isinstance(d, int) for d in src):
        known = [d for d, t in zip(dims, target) if t != -1]
        if all(isinstance(d, int) for d in known) and np.prod(known, dtype=np.int64) > 0:
            dims[target.index(-1)] = int(np.prod(src, dtype=np.int64) // np.prod(known, dtype=np.int64))
    return tuple(dims)


def _attr(name: str, v) -> ir.Attr:
    """A Python value as an ONNX attribute (the types rules use), without protocol checks."""
    if isinstance(v, bool) or isinstance(v, (int, np.integer)):
        return ir.AttrInt64(name, int(v))
    if isinstance(v, (float, np.floating)):
        return ir.AttrFloat32(name, float(v))
    if isinstance(v, str):
        return ir.AttrString(name, v)
    if isinstance(v, (list, tuple)):
        if all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in v):
            return ir.AttrInt64s(name, [int(x) for x in v])
        if all(isinstance(x, (int, float, np.number)) for x in v):
            return ir.AttrFloat32s(name, [float(x) for x in v])
        if all(isinstance(x, str) for x in v):
            return ir.AttrStrings(name, list(v))
    if isinstance(v, ir.Attr):
        return v
    if isinstance(v, ir.Graph):
        return ir.AttrGraph(name, v)
    return ir.convenience.convert_attribute(name, v)


class _Math:
    """onnx_ir's handler of arithmetic on values (``ir.set_value_magic_handler``), emitting
    through one emitter."""

    def __init__(self, e: Emitter):
        self.e = e

    def _operands(self, op: str, a, b):
        if not isinstance(a, ir.Value) and not isinstance(b, ir.Value):
            raise GradientRuleError(f"{op} of two numbers: one operand must be a graph value")
        a = a if isinstance(a, ir.Value) else self.e.scalar(a, b)
        b = b if isinstance(b, ir.Value) else self.e.scalar(b, a)
        for v in (a, b):
            self._check_graph(v, op)
        return a, b

    def _check_graph(self, v: ir.Value, op: str) -> None:
        g = v.graph
        if g is not None and g is not self.e.graph and g not in self.e.outer:
            raise GradientRuleError(f"{op} reads '{v.name}', a value of a graph this emitter cannot read "
                                    "(a subgraph's): write it inside that subgraph emitter's math()")

    def Add(self, a, b):  # noqa: N802 (the handler's protocol names)
        return self.e.Add(*self._operands("Add", a, b))

    def Sub(self, a, b):  # noqa: N802
        return self.e.Sub(*self._operands("Sub", a, b))

    def Mul(self, a, b):  # noqa: N802
        return self.e.Mul(*self._operands("Mul", a, b))

    def Div(self, a, b):  # noqa: N802
        return self.e.Div(*self._operands("Div", a, b))

    def Pow(self, a, b):  # noqa: N802
        return self.e.Pow(*self._operands("Pow", a, b))

    def MatMul(self, a, b):  # noqa: N802
        return self.e.MatMul(*self._operands("MatMul", a, b))

    def Neg(self, a):  # noqa: N802
        self._check_graph(a, "Neg")
        return self.e.Neg(a)


def _install_power_and_matmul() -> None:
    """onnx_ir's arithmetic hook covers ``+ - * /`` and unary minus; ``**`` and ``@`` go
    through the same handler."""
    base = next(c for c in ir.Value.__mro__ if "__add__" in vars(c))  # the class holding the hook
    if "__pow__" in vars(base):
        return
    base.__pow__ = lambda self, other: self._get_magic_handler().Pow(self, other)
    base.__rpow__ = lambda self, other: self._get_magic_handler().Pow(other, self)
    base.__matmul__ = lambda self, other: self._get_magic_handler().MatMul(self, other)
    base.__rmatmul__ = lambda self, other: self._get_magic_handler().MatMul(other, self)


_install_power_and_matmul()


def collect_names(graph: ir.Graph) -> set[str]:
    names = set()
    for v in graph.inputs:
        names.add(v.name)
    for name in graph.initializers:
        names.add(name)
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if node.name:
            names.add(node.name)
        for o in node.outputs:
            if o.name:
                names.add(o.name)
    return names
