"""Random graphs: every written model passes onnx.checker, runs on onnxruntime (default graph
optimizations) and its gradients match float64 finite differences.

Hypothesis draws a chain of blocks over many op families (elementwise, MatMul/Gemm,
reductions, Reshape/Transpose/Squeeze/Unsqueeze/Concat/Split/Slice/Gather, Softmax and
LayerNormalization, Pad, If, Loop and Scan with bodies), an opset, and how much the model
declares about its data input: static dims, symbolic dims, unnamed dims, a rank known only at
run time, or no shape at all (which must be refused with a message naming the input). The
runs are derandomized (the same examples in every run); a failure prints the drawn example,
the model's text and a reproduction blob, and running this file again reproduces it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from gradbuilder import GradientGraphBuilder
from gradbuilder.errors import InvalidModelError
from gradbuilder.testing import gradcheck, run_onnxruntime

OPSETS = [13, 17, 18, 21]
DECLARED = ["static", "symbolic", "unnamed", "runtime_rank", "none"]
F32 = np.float32


@dataclasses.dataclass
class Graph:
    """A model under construction: nodes, initializers, graph inputs and their feeds."""

    opset: int
    nodes: list = dataclasses.field(default_factory=list)
    inits: list = dataclasses.field(default_factory=list)
    inputs: list = dataclasses.field(default_factory=list)
    feeds: dict = dataclasses.field(default_factory=dict)
    weights: list = dataclasses.field(default_factory=list)
    count: int = 0

    def name(self, hint: str) -> str:
        self.count += 1
        return f"{hint}{self.count}"

    def node(self, op, inputs, n_out=1, **attrs):
        outs = [self.name(op.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, array, hint="c"):
        name = self.name(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def weight(self, rng, shape, scale=0.7):
        name = self.const(rng.uniform(-scale, scale, shape).astype(F32), "w")
        self.weights.append(name)
        return name

    def reduce(self, op, x, axes, keepdims):
        """op over ``axes``: an input from opset 18 (ReduceSum: 13), an attribute before."""
        if op == "ReduceSum" or self.opset >= 18:
            return self.node(op, [x, self.const(np.array(axes, np.int64))], keepdims=keepdims)
        return self.node(op, [x], axes=list(axes), keepdims=keepdims)


# ----------------------------------------------------------------------------- blocks
# Each block takes (draw, graph, rng, value, shape) and returns (value, shape): the shape is the
# value's true shape at run time (whatever shape inference will know of it).


def unary(draw, g, rng, x, shape):
    op = draw(st.sampled_from(["Tanh", "Sigmoid", "Sin", "Softplus", "Neg"]))
    return g.node(op, [x]), shape


def binary(draw, g, rng, x, shape):
    op = draw(st.sampled_from(["Add", "Mul", "Sub"]))
    kind = draw(st.sampled_from(["full", "last", "scalar", "ones"]))
    wshape = {"full": shape, "last": shape[-1:], "scalar": (),
              "ones": tuple(1 if i % 2 else d for i, d in enumerate(shape))}[kind]
    w = g.weight(rng, wshape)
    ins = [w, x] if draw(st.booleans()) else [x, w]
    return g.node(op, ins), shape


def matmul(draw, g, rng, x, shape):
    n = shape[-1]
    form = draw(st.sampled_from(["matrix", "vector", "left", "transposed_left", "batched"]))
    if form == "vector" and len(shape) >= 2:  # x @ w[n]: the last axis is summed away
        return g.node("MatMul", [x, g.weight(rng, (n,))]), shape[:-1]
    if form in ("left", "transposed_left") and len(shape) == 1:  # w[k, n] @ x[n]
        k = draw(st.integers(1, 3))
        if form == "left":
            return g.node("MatMul", [g.weight(rng, (k, n)), x]), (k,)
        wt = g.node("Transpose", [g.weight(rng, (n, k))], perm=[1, 0])
        return g.node("MatMul", [wt, x]), (k,)
    k = draw(st.integers(1, 3))
    if form == "batched" and len(shape) == 2:
        return g.node("MatMul", [x, g.weight(rng, (2, n, k))]), (2, shape[0], k)
    return g.node("MatMul", [x, g.weight(rng, (n, k))]), shape[:-1] + (k,)


def gemm(draw, g, rng, x, shape):
    if len(shape) != 2:
        return matmul(draw, g, rng, x, shape)
    m, n = shape
    k = draw(st.integers(1, 3))
    trans_b = draw(st.integers(0, 1))
    c_shape = draw(st.sampled_from([(k,), (1, k), (m, k), None]))
    ins = [x, g.weight(rng, (k, n) if trans_b else (n, k))]
    if c_shape is not None:
        ins.append(g.weight(rng, c_shape))
    return g.node("Gemm", ins, transB=trans_b, alpha=0.8, beta=1.2), (m, k)


def reduction(draw, g, rng, x, shape):
    op = draw(st.sampled_from(["ReduceSum", "ReduceMean", "ReduceLogSumExp", "ReduceSumSquare"]))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    keep = 1 if len(shape) == 1 else draw(st.integers(0, 1))
    out = tuple(1 if i == axis % len(shape) else d for i, d in enumerate(shape))
    if not keep:
        out = tuple(d for i, d in enumerate(shape) if i != axis % len(shape))
    return g.reduce(op, x, [axis], keep), out


def reshape(draw, g, rng, x, shape):
    if len(shape) >= 2 and draw(st.booleans()):  # merge the last two axes
        target, out = [0] * (len(shape) - 2) + [-1], shape[:-2] + (shape[-2] * shape[-1],)
    else:  # split the last axis in two (or add a unit axis)
        last = shape[-1]
        a = next(d for d in (2, 3, 1) if last % d == 0)
        target, out = list(shape[:-1]) + [a, -1], shape[:-1] + (a, last // a)
    return g.node("Reshape", [x, g.const(np.array(target, np.int64))]), out


def runtime_reshape(draw, g, rng, x, shape):
    """Reshape to a shape given as a graph input: the rank (or only the sizes, when the shape
    input's length is declared) is known only at run time."""
    out = (int(np.prod(shape)),) if len(shape) > 1 and draw(st.booleans()) else shape
    name = g.name("shape")
    g.inputs.append(helper.make_tensor_value_info(name, TensorProto.INT64, draw(st.sampled_from([[None], [len(out)]]))))
    g.feeds[name] = np.array(out, np.int64)
    return g.node("Reshape", [x, name]), out


def transpose(draw, g, rng, x, shape):
    perm = draw(st.permutations(range(len(shape))))
    return g.node("Transpose", [x], perm=list(perm)), tuple(shape[p] for p in perm)


def squeeze_unsqueeze(draw, g, rng, x, shape):
    axis = draw(st.integers(-len(shape) - 1, len(shape)))
    u = g.node("Unsqueeze", [x, g.const(np.array([axis], np.int64))])
    pos = axis % (len(shape) + 1)
    ushape = shape[:pos] + (1,) + shape[pos:]
    if draw(st.booleans()):
        return u, ushape
    if draw(st.booleans()):  # Squeeze without axes: every size-1 axis
        return g.node("Squeeze", [u]), tuple(d for d in ushape if d != 1)
    return g.node("Squeeze", [u, g.const(np.array([pos], np.int64))]), shape


def concat(draw, g, rng, x, shape):
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    c = draw(st.integers(1, 2))
    wshape = tuple(c if i == axis % len(shape) else d for i, d in enumerate(shape))
    ins = [x, g.weight(rng, wshape)]
    ins = ins[::-1] if draw(st.booleans()) else ins
    out = tuple(d + c if i == axis % len(shape) else d for i, d in enumerate(shape))
    return g.node("Concat", ins, axis=axis), out


def split(draw, g, rng, x, shape):
    splittable = [i for i, d in enumerate(shape) if d >= 2]
    if not splittable:
        return unary(draw, g, rng, x, shape)
    axis = draw(st.sampled_from(splittable))
    size = shape[axis]
    first = draw(st.integers(1, size - 1))
    if g.opset >= 18 and draw(st.booleans()):
        parts = g.node("Split", [x], 2, axis=axis, num_outputs=2)
        first = -(-size // 2)
    else:
        parts = g.node("Split", [x, g.const(np.array([first, size - first], np.int64))], 2, axis=axis)
    if draw(st.booleans()):  # both parts, swapped
        out = g.node("Concat", [parts[1], parts[0]], axis=axis)
        return out, shape
    return parts[0], tuple(first if i == axis else d for i, d in enumerate(shape))


def slice_(draw, g, rng, x, shape):
    axis = draw(st.integers(0, len(shape) - 1))
    size = shape[axis]
    step = draw(st.sampled_from([1, 2, -1]))
    if step > 0:
        start = draw(st.integers(0, size - 1))
        end, count = size, len(range(start, size, step))
    else:
        start, end = size - 1, -size - 1
        count = size
    sl = g.node("Slice", [x, *(g.const(np.array([v], np.int64)) for v in (start, end, axis, step))])
    return sl, tuple(count if i == axis else d for i, d in enumerate(shape))


def gather(draw, g, rng, x, shape):
    axis = draw(st.integers(0, len(shape) - 1))
    idx = draw(st.lists(st.integers(-shape[axis], shape[axis] - 1), min_size=1, max_size=3))
    out = g.node("Gather", [x, g.const(np.array(idx, np.int64))], axis=axis)
    return out, shape[:axis] + (len(idx),) + shape[axis + 1:]


def softmax(draw, g, rng, x, shape):
    op = draw(st.sampled_from(["Softmax", "LogSoftmax"]))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    return g.node(op, [x], axis=axis), shape


def layernorm(draw, g, rng, x, shape):
    if g.opset < 17:
        return softmax(draw, g, rng, x, shape)
    scale = g.weight(rng, shape[-1:], 1.5)
    bias = g.weight(rng, shape[-1:])
    return g.node("LayerNormalization", [x, scale, bias], axis=-1, epsilon=1e-3), shape


def _declared(draw, name, shape, elem=TensorProto.FLOAT):
    """A subgraph value's type: the full shape, only its rank, or no shape."""
    form = draw(st.sampled_from(["full", "rank", "none"]))
    dims = {"full": list(shape), "rank": [None] * len(shape), "none": None}[form]
    return helper.make_tensor_value_info(name, elem, dims)


def if_(draw, g, rng, x, shape):
    """Each branch reads the outer value and a weight of its own; a graph input picks one."""
    wt, we = g.weight(rng, shape[-1:]), g.weight(rng, ())
    t1, t2 = g.name("then"), g.name("then")
    e1, e2 = g.name("else"), g.name("else")
    then_g = helper.make_graph([helper.make_node("Mul", [x, wt], [t1]), helper.make_node("Tanh", [t1], [t2])],
                               g.name("then_branch"), [], [_declared(draw, t2, shape)])
    else_g = helper.make_graph([helper.make_node("Sin", [x], [e1]), helper.make_node("Mul", [e1, we], [e2])],
                               g.name("else_branch"), [], [_declared(draw, e2, shape)])
    cond = g.name("cond")
    g.inputs.append(helper.make_tensor_value_info(cond, TensorProto.BOOL, []))
    g.feeds[cond] = np.array(draw(st.booleans()))
    return g.node("If", [cond], then_branch=then_g, else_branch=else_g), shape


def loop(draw, g, rng, x, shape):
    """h' = tanh(h * w + x * u) for M trips, x the loop's initial value read from outside
    (a value a previous loop may have computed); optionally a scan output stacks h * v."""
    w, u = g.weight(rng, shape[-1:]), g.weight(rng, ())
    i, c, h = g.name("iter"), g.name("c"), g.name("h")
    hw, xu, pre, h2, c2 = (g.name(s) for s in ("hw", "xu", "pre", "h", "c"))
    nodes = [helper.make_node("Mul", [h, w], [hw]), helper.make_node("Mul", [x, u], [xu]),
             helper.make_node("Add", [hw, xu], [pre]), helper.make_node("Tanh", [pre], [h2]),
             helper.make_node("Identity", [c], [c2])]
    outputs = [helper.make_tensor_value_info(c2, TensorProto.BOOL, []), _declared(draw, h2, shape)]
    scan = draw(st.booleans())
    if scan:
        v, y = g.weight(rng, ()), g.name("y")
        nodes.append(helper.make_node("Mul", [h, v], [y]))
        outputs.append(_declared(draw, y, shape))
    body = helper.make_graph(nodes, g.name("body"), [helper.make_tensor_value_info(i, TensorProto.INT64, []),
                                                     helper.make_tensor_value_info(c, TensorProto.BOOL, []),
                                                     _declared(draw, h, shape)], outputs)
    trips = g.name("trips")
    g.inputs.append(helper.make_tensor_value_info(trips, TensorProto.INT64, []))
    g.feeds[trips] = np.array(draw(st.integers(1 if scan else 0, 3)), np.int64)
    outs = g.node("Loop", [trips, "", x], 2 if scan else 1, body=body)
    if not scan:
        return outs, shape
    stacked = g.reduce("ReduceSum", outs[1], [0], 0)
    return g.node("Add", [outs[0], stacked]), shape


def residual(draw, g, rng, x, shape):
    """x + f(x) with f another block keeping the shape: the value has two consumers."""
    f = draw(st.sampled_from([unary, binary, softmax, layernorm]))
    y, _ = f(draw, g, rng, x, shape)
    return g.node("Add", [x, y]), shape


def pad(draw, g, rng, x, shape):
    """Constant Pad; the pads as constants or as a graph input, at opset 18 maybe for some axes."""
    rank = len(shape)
    axes = list(range(rank))
    if g.opset >= 18 and draw(st.booleans()):
        axes = sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1)))
    before = [draw(st.integers(0, 2)) for _ in axes]  # (onnx's reference evaluator cannot crop)
    after = [draw(st.integers(0, 1)) for _ in axes]
    pads = np.array(before + after, np.int64)
    if draw(st.booleans()):
        name = g.name("pads")
        g.inputs.append(helper.make_tensor_value_info(name, TensorProto.INT64, [None]))
        g.feeds[name] = pads
    else:
        name = g.const(pads)
    ins = [x, name]
    if axes != list(range(rank)):
        ins += ["", g.const(np.array(axes, np.int64))]
    out = list(shape)
    for a, b, e in zip(axes, before, after):
        out[a] += b + e
    return g.node("Pad", ins, mode="constant"), tuple(out)


def expand_where(draw, g, rng, x, shape):
    """Expand to a new leading axis, or Where picking between x and a weight by a mask."""
    if draw(st.booleans()):
        return g.node("Expand", [x, g.const(np.array((2,) + shape, np.int64))]), (2,) + shape
    mask = g.const(rng.uniform(size=shape) > 0.5)
    return g.node("Where", [mask, x, g.weight(rng, shape[-1:])]), shape


def loop_matmul(draw, g, rng, x, shape):
    """A Loop whose body multiplies by a square weight (MatMul of a value whose declared rank
    the body may leave out), optionally inside an If."""
    n = shape[-1]
    w = g.weight(rng, (n, n), 0.5)
    i, c, h, hw, h2, c2 = (g.name(s) for s in ("iter", "c", "h", "hw", "h", "c"))
    body = helper.make_graph(
        [helper.make_node("MatMul", [h, w], [hw]), helper.make_node("Tanh", [hw], [h2]),
         helper.make_node("Identity", [c], [c2])],
        g.name("body"), [helper.make_tensor_value_info(i, TensorProto.INT64, []),
                         helper.make_tensor_value_info(c, TensorProto.BOOL, []), _declared(draw, h, shape)],
        [helper.make_tensor_value_info(c2, TensorProto.BOOL, []), _declared(draw, h2, shape)])
    trips = g.name("trips")
    g.inputs.append(helper.make_tensor_value_info(trips, TensorProto.INT64, []))
    g.feeds[trips] = np.array(draw(st.integers(0, 2)), np.int64)
    if not draw(st.booleans()):
        return g.node("Loop", [trips, "", x], body=body), shape
    out, other = g.name("loop"), g.name("sin")
    then_g = helper.make_graph([helper.make_node("Loop", [trips, "", x], [out], body=body)], g.name("then"), [],
                               [_declared(draw, out, shape)])
    else_g = helper.make_graph([helper.make_node("Sin", [x], [other])], g.name("else"), [],
                               [_declared(draw, other, shape)])
    cond = g.name("cond")
    g.inputs.append(helper.make_tensor_value_info(cond, TensorProto.BOOL, []))
    g.feeds[cond] = np.array(draw(st.booleans()))
    return g.node("If", [cond], then_branch=then_g, else_branch=else_g), shape


def scan(draw, g, rng, x, shape):
    """A Scan over a weight stacked along a drawn axis: h' = tanh(h * u_t + v), y_t = h' * h;
    the body declares its outputs' rank (onnxruntime's Scan needs it), its inputs maybe not."""
    steps = draw(st.integers(1, 3))
    axis = draw(st.integers(0, len(shape)))
    u = g.weight(rng, shape[:axis] + (steps,) + shape[axis:])
    v = g.weight(rng, shape[-1:])
    h, ut, hu, pre, h2, y = (g.name(s) for s in ("h", "u", "hu", "pre", "h", "y"))
    rank_only = [None] * len(shape)
    body = helper.make_graph(
        [helper.make_node("Mul", [h, ut], [hu]), helper.make_node("Add", [hu, v], [pre]),
         helper.make_node("Tanh", [pre], [h2]), helper.make_node("Mul", [h2, h], [y])], g.name("cell"),
        [_declared(draw, h, shape), _declared(draw, ut, shape)],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, draw(st.sampled_from([list(shape), rank_only])))
         for n in (h2, y)])
    last, ys = g.node("Scan", [x, u], 2, body=body, num_scan_inputs=1, scan_input_axes=[axis],
                      scan_input_directions=[draw(st.integers(0, 1))])
    return g.node("Add", [last, g.reduce("ReduceSum", ys, [0], 0)]), shape


BLOCKS = [unary, binary, matmul, gemm, reduction, reshape, runtime_reshape, transpose, squeeze_unsqueeze,
          concat, split, slice_, gather, softmax, layernorm, if_, loop, residual, pad, expand_where, loop_matmul,
          scan]


@st.composite
def random_models(draw):
    opset = draw(st.sampled_from(OPSETS))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    g = Graph(opset)
    shape = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    declared = draw(st.sampled_from(DECLARED))
    dims = {"static": list(shape), "symbolic": [f"n{i}" for i in range(len(shape))],
            "unnamed": [None] * len(shape), "runtime_rank": list(shape), "none": None}[declared]
    g.inputs.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, dims))
    g.feeds["x"] = rng.uniform(-1, 1, shape).astype(F32)
    value = "x"
    if declared == "runtime_rank":
        value, shape = runtime_reshape(draw, g, rng, value, shape)
    blocks = draw(st.lists(st.sampled_from(BLOCKS), min_size=1, max_size=6))
    for block in blocks:
        value, shape = block(draw, g, rng, value, shape)
        if len(shape) == 0:  # keep at least one axis for the next block
            value = g.node("Unsqueeze", [value, g.const(np.array([0], np.int64))])
            shape = (1,)
        if len(shape) > 4 or int(np.prod(shape)) > 64:  # keep the sizes small
            value = g.node("Reshape", [value, g.const(np.array([-1], np.int64))])
            value = g.node("Slice", [value, *(g.const(np.array([v], np.int64)) for v in (0, 6, 0))])
            shape = (min(6, int(np.prod(shape))),)
    # loss = sum(flat(value) * p): a random projection, so every entry weighs differently
    flat = g.node("Reshape", [value, g.const(np.array([-1], np.int64))])
    proj = g.const(rng.standard_normal(int(np.prod(shape))).astype(F32), "proj")
    g.nodes.append(helper.make_node("ReduceSum", [g.node("Mul", [flat, proj])], ["loss"], keepdims=0))
    if not g.weights or draw(st.booleans()):
        g.weights.append("x")  # the data input as a weight too
    model = helper.make_model(
        helper.make_graph(g.nodes, "random", g.inputs, [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                          g.inits),
        opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model, list(dict.fromkeys(g.weights)), g.feeds, declared, [b.__name__ for b in blocks]


@pytest.mark.slow  # 120 generated models
@settings(derandomize=True, max_examples=120, deadline=None, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(random_models())
def test_random_graph_gradients(case):
    model, weights, feeds, declared, blocks = case
    note(f"opset {model.opset_import[0].version}, input {declared}, blocks {blocks}, weights {weights}")
    note(onnx.printer.to_text(model.graph))
    if declared == "none":  # onnx.checker needs a shape on every graph input: refused, naming it
        with pytest.raises(InvalidModelError, match="graph input 'x' declares no shape"):
            GradientGraphBuilder(model, weights, ["loss"], "loss").build()
        return
    built = GradientGraphBuilder(model, weights, ["loss"], "loss").build()
    onnx.checker.check_model(built.model_proto, full_check=True)
    got = run_onnxruntime(built.get_model(), feeds)
    report = gradcheck(model, weights, "loss", feeds, max_elements=6, directions=1)
    assert report.passed, str(report)
    for w in weights:
        ref = report.gradients[w]
        np.testing.assert_allclose(got[f"{w}_grad"], ref, rtol=2e-3, atol=2e-4 * max(1.0, np.abs(ref).max()),
                                   err_msg=f"onnxruntime gradient of '{w}'")
