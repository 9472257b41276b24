"""Rules for onnxruntime's com.microsoft contrib ops (rules/contrib.py).

onnx's reference evaluator runs none of these ops, so every case is checked three ways:

* against an equivalent formulation in standard ONNX ops (``standard`` below: Gelu is
  x * (1 + erf(x/sqrt 2))/2, SkipLayerNormalization is Add + the LayerNormalization math, ...):
  onnxruntime's forward of the contrib op must agree with it, and its float64 gradient, built by
  gradbuilder and gradchecked against finite differences on the reference evaluator, is the
  expected gradient;
* the float32 gradient graph of the contrib model runs on onnxruntime's CPU provider (contrib
  forward node included) and must match that expected gradient, and also central finite
  differences of the loss computed by onnxruntime in float32;
* the gradient graph of the contrib model, made float64 and with the contrib node swapped for
  its standard formulation, runs on the reference evaluator and must match the expected
  gradient to float64 precision.

BiasAdd and BiasSoftmax have CUDA kernels only in onnxruntime, and com.microsoft
SimplifiedLayerNormalization is not registered at all (onnxruntime has it in the ai.onnx domain):
for those only the swapped graph runs (on the reference evaluator in float64 and on onnxruntime
in float32); test_cpu_kernels pins which ops have CPU kernels.
"""

import itertools
import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradbuilder import GradientGraphBuilder
from gradbuilder.testing import gradcheck, ort_session, reference_evaluator, to_float64
from gradbuilder.testing import ort_run as _ort_run

MS = "com.microsoft"
f32, f16 = np.float32, np.float16
_ONNX = {np.dtype(f32): TensorProto.FLOAT, np.dtype(np.float64): TensorProto.DOUBLE,
         np.dtype(f16): TensorProto.FLOAT16}

# ops with no CPU kernel in onnxruntime (CUDA/ROCm only), and forms onnxruntime does not register
NOT_ON_CPU = {("BiasAdd", MS), ("BiasSoftmax", MS), ("SimplifiedLayerNormalization", MS)}

# cases where only some outputs reach the loss leave some weights with a zero gradient
pytestmark = pytest.mark.filterwarnings("ignore:these weights do not reach the loss")


def arr(rng, *shape, lo=-1.5, hi=1.5):
    return rng.uniform(lo, hi, shape).astype(f32)


# ----------------------------------------------------------------------------- standard formulations


class Nodes:
    """Collects standard-ONNX nodes (valid at opsets 13..23) with fresh value names."""

    def __init__(self, dtype, prefix="std"):
        self.nodes, self.dtype, self.prefix, self.k = [], np.dtype(dtype), prefix, 0

    def __call__(self, op, *ins, out=None, **attrs):
        if out is None:
            self.k += 1
            out = f"{self.prefix}_{op}_{self.k}"
        self.nodes.append(helper.make_node(op, list(ins), [out], **attrs))
        return out

    def const(self, value, dtype=None):
        self.k += 1
        name = f"{self.prefix}_c{self.k}"
        t = numpy_helper.from_array(np.asarray(value, dtype=dtype or self.dtype), name)
        self.nodes.append(helper.make_node("Constant", [], [name], value=t))
        return name

    def mean(self, v, axes, count):
        return self("Div", self("ReduceSum", v, self.const(axes, np.int64), keepdims=1), self.const(count))


def _gelu(b, x):
    phi = b("Mul", b.const(0.5), b("Add", b.const(1.0), b("Erf", b("Mul", x, b.const(1 / math.sqrt(2))))))
    return b("Mul", x, phi)


def _perm(rank, trans, trans_batch):
    """onnxruntime's FusedMatMul operand permutation: transBatch moves axis 0 to the row axis
    ([1..r-2, 0, r-1]), then trans swaps the last two axes."""
    perm = list(range(rank))
    if trans_batch:
        perm = perm[1:rank - 1] + [perm[0], perm[rank - 1]]
    if trans:
        perm[-2], perm[-1] = perm[-1], perm[-2]
    return perm


def standard(op, ins, outs, attrs, shapes, dtype):
    """Standard-ONNX nodes computing ``op``'s outputs ``outs`` (names, "" for absent) from the
    value names ``ins`` ("" for absent) whose shapes are ``shapes``."""
    b = Nodes(dtype)
    present = [i for i in ins if i]
    out = {}
    if op == "Gelu":
        out[0] = _gelu(b, ins[0])
    elif op == "BiasGelu":
        out[0] = _gelu(b, b("Add", *ins))
    elif op == "FastGelu":
        u = b("Add", *present) if len(present) == 2 else present[0]
        inner = b("Mul", b.const(math.sqrt(2 / math.pi)),
                  b("Add", u, b("Mul", b.const(0.044715), b("Mul", u, b("Mul", u, u)))))
        out[0] = b("Mul", b("Mul", b.const(0.5), u), b("Add", b.const(1.0), b("Tanh", inner)))
    elif op == "QuickGelu":
        out[0] = b("Mul", ins[0], b("Sigmoid", b("Mul", b.const(attrs.get("alpha", 1.702)), ins[0])))
    elif op == "FusedMatMul":
        ops = []
        for v, t, tb in ((ins[0], "transA", "transBatchA"), (ins[1], "transB", "transBatchB")):
            rank = len(shapes[v])
            ops.append(b("Transpose", v, perm=_perm(rank, attrs.get(t, 0), attrs.get(tb, 0))) if rank > 1 else v)
        out[0] = b("Mul", b("MatMul", *ops), b.const(attrs.get("alpha", 1.0)))
    elif op in ("SkipLayerNormalization", "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization"):
        x = ins[0]
        if op == "SimplifiedLayerNormalization":
            scale, beta, bias, centered = ins[1], "", "", False
            rank = len(shapes[x])
            axes = list(range(attrs.get("axis", -1) % rank, rank))
            eps = attrs.get("epsilon", 1e-5)
            s = x
        else:
            centered = op == "SkipLayerNormalization"
            scale = ins[2]
            rest = list(ins[3:]) + ["", ""]
            beta, bias = (rest[0], rest[1]) if centered else ("", rest[0])
            axes, eps = [-1], attrs.get("epsilon", 1e-12)
            s = b("Add", x, ins[1])
            if bias:
                s = b("Add", s, bias)
        count = float(np.prod([shapes[x][a] for a in axes]))
        mu = b.mean(s, axes, count) if centered else None
        d = b("Sub", s, mu) if centered else s
        r = b("Reciprocal", b("Sqrt", b("Add", b.mean(b("Mul", d, d), axes, count), b.const(eps))))
        y = b("Mul", b("Mul", d, r), scale)
        out[0] = b("Add", y, beta) if beta else y
        if op == "SimplifiedLayerNormalization":
            out[1] = r
        else:
            out[1] = mu if centered else b("Mul", r, b.const(0.0))  # SkipSimplified's mean: zeros
            out[2] = r
            out[3] = s
    elif op == "BiasAdd":
        out[0] = b("Add", b("Add", ins[0], ins[1]), ins[2])
    elif op == "BiasSoftmax":
        xs, bs = shapes[ins[0]], shapes[ins[1]]
        axis = attrs.get("axis", 1) % len(xs)
        elems = int(np.prod(xs[axis:]))
        rows = int(np.prod(bs)) // elems
        inner = attrs.get("is_inner_broadcast", 1)
        x3 = b("Reshape", ins[0], b.const([rows, -1, elems] if inner else [-1, rows, elems], np.int64))
        b3 = b("Reshape", ins[1], b.const([rows, 1, elems] if inner else [1, rows, elems], np.int64))
        sm = b("Softmax", b("Add", x3, b3), axis=-1)
        out[0] = b("Reshape", sm, b.const(list(xs), np.int64))
    else:
        raise AssertionError(op)
    for i, name in enumerate(outs):
        if name:
            b("Identity", out[i], out=name)
    return b.nodes


# ----------------------------------------------------------------------------- models


def _model(nodes, inputs, outputs, inits, opset, domain=MS):
    opsets = [helper.make_opsetid("", opset)]
    if domain:
        opsets.append(helper.make_opsetid(domain, 1))
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, inits), opset_imports=opsets)
    model.ir_version = 10
    return model


class Case:
    """One contrib node ``op`` on the float ``inputs`` (the weights, fed as graph inputs) with
    the loss sum_i sum(output_i * P_i) over its present outputs (P_i fixed random), and the same
    model with the node in standard ONNX ops."""

    def __init__(self, op, inputs, attrs=None, outputs=("y",), *, loss=None, domain=MS, opset=17, dims="static",
                 seed=0):
        self.op, self.attrs, self.domain, self.opset = op, dict(attrs or {}), domain, opset
        self.ins = [name if a is not None else "" for name, a in inputs]
        self.feeds = {name: a for name, a in inputs if a is not None}
        self.weights = list(self.feeds)
        self.outs = list(outputs)
        self.shapes = {k: v.shape for k, v in self.feeds.items()}
        dtype = next(iter(self.feeds.values())).dtype
        self.graph_inputs = [
            helper.make_tensor_value_info(k, _ONNX[v.dtype], list(v.shape) if dims == "static" else [None] * v.ndim)
            for k, v in self.feeds.items()]
        # output shapes from the standard formulation, then fixed projections
        probe = _model(standard(op, self.ins, self.outs, self.attrs, self.shapes, np.float64),
                       [helper.make_tensor_value_info(k, TensorProto.DOUBLE, v.shape) for k, v in self.feeds.items()],
                       [helper.make_empty_tensor_value_info(o) for o in self.outs if o], [], opset, domain=None)
        values = reference_evaluator(probe).run(None, {k: v.astype(np.float64) for k, v in self.feeds.items()})
        self.expected_forward = dict(zip([o for o in self.outs if o], values))
        rng = np.random.default_rng(seed + 1000)
        self.proj = {o: rng.standard_normal(v.shape).astype(dtype) for o, v in self.expected_forward.items()
                     if loss is None or o in loss}
        self.dtype = dtype

    def _loss(self, dtype, float_outputs=()):
        """sum_i sum(output_i * P_i) in ``dtype``; the ``float_outputs`` (float statistics of
        a float16 model) are projected in float and their terms cast to ``dtype``."""
        nodes, inits, terms = [], [], []
        for o, p in self.proj.items():
            in_float = o in float_outputs
            inits.append(numpy_helper.from_array(p.astype(f32 if in_float else dtype), f"{o}_proj"))
            nodes += [helper.make_node("Mul", [o, f"{o}_proj"], [f"{o}_m"]),
                      helper.make_node("ReduceSum", [f"{o}_m"], [f"{o}_f" if in_float else f"{o}_s"], keepdims=0)]
            if in_float:
                nodes.append(helper.make_node("Cast", [f"{o}_f"], [f"{o}_s"], to=_ONNX[np.dtype(dtype)]))
            terms.append(f"{o}_s")
        nodes.append(helper.make_node("Sum", terms, ["loss"]))
        return nodes, inits, [helper.make_tensor_value_info("loss", _ONNX[np.dtype(dtype)], [])]

    def contrib_node(self):
        return helper.make_node(self.op, self.ins, self.outs, domain=self.domain, **self.attrs)

    def contrib_model(self, dtype=None, float_outputs=()):
        dtype = dtype or self.dtype
        nodes, inits, outputs = self._loss(dtype, float_outputs)
        inputs = [helper.make_tensor_value_info(v.name, _ONNX[np.dtype(dtype)],
                                                [d.dim_value or None for d in v.type.tensor_type.shape.dim])
                  for v in self.graph_inputs]
        return _model([self.contrib_node()] + nodes, inputs, outputs, inits, self.opset)

    def standard_model(self):
        nodes, inits, outputs = self._loss(self.dtype)
        std = standard(self.op, self.ins, self.outs, self.attrs, self.shapes, self.dtype)
        return _model(std + nodes, self.graph_inputs, outputs, inits, self.opset, domain=None)

    def swap_contrib_node(self, built, dtype):
        """``built`` with the contrib node replaced by its standard formulation."""
        proto = onnx.ModelProto()
        proto.CopyFrom(built)
        nodes = list(proto.graph.node)
        k = next(i for i, nd in enumerate(nodes) if nd.op_type == self.op and nd.domain == self.domain)
        outs = list(nodes[k].output)
        std = standard(self.op, list(nodes[k].input), outs, self.attrs, self.shapes, dtype)
        del proto.graph.node[:]
        proto.graph.node.extend(nodes[:k] + std + nodes[k + 1:])
        return proto


def grads_of(model, weights):
    return GradientGraphBuilder(model, weights=weights, outputs=["loss"], loss="loss").build().model_proto


def ort_run(model, feeds):
    """gradbuilder.testing.ort_run feeding graph inputs only (never the initializers)."""
    return _ort_run(model, feeds, overridable=False)


def ort_finite_differences(model, feeds, weights, eps=1e-2):
    """Central differences of the loss, every element, on onnxruntime (the model's dtype)."""
    sess = ort_session(model)
    out = {}
    for w in weights:
        base = feeds[w]
        num = np.zeros(base.shape, np.float64)
        for i in range(base.size):
            vals = []
            for sign in (1, -1):
                p = base.astype(np.float64).copy().reshape(-1)
                p[i] += sign * eps
                vals.append(float(sess.run(["loss"], {**feeds, w: p.reshape(base.shape).astype(base.dtype)})[0]))
            num.reshape(-1)[i] = (vals[0] - vals[1]) / (2 * eps)
        out[w] = num
    return out


def close(got, ref, rtol, atol):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    scale = max(1.0, float(np.abs(ref).max(initial=0)))
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=atol * scale)


def check(case: Case, contrib_forward_on_ort=None):
    """The checks of the module docstring for one case; ``contrib_forward_on_ort=False`` runs
    the swapped graph only (ops without a CPU kernel, forms where the kernel is off the spec)."""
    w, feeds = case.weights, case.feeds
    # 1. expected gradient: the standard formulation, float64, finite differences on the reference
    report = gradcheck(case.standard_model(), w, "loss", feeds, max_elements=8)
    assert report.passed, str(report)
    expected = report.gradients

    # 2. the rule's graph in float64, contrib node swapped for the standard formulation
    built32 = grads_of(case.contrib_model(), w)
    built64 = case.swap_contrib_node(to_float64(built32), np.float64)
    got = dict(zip([o.name for o in built64.graph.output],
                   reference_evaluator(built64).run(None, {k: v.astype(np.float64) for k, v in feeds.items()})))
    for name in w:
        close(got[f"{name}_grad"], expected[name], 1e-7, 1e-9)

    if contrib_forward_on_ort is None:
        contrib_forward_on_ort = (case.op, case.domain) not in NOT_ON_CPU
    if not contrib_forward_on_ort:
        # 3'. no kernel for the contrib node: the float32 graph runs on onnxruntime swapped
        got = ort_run(case.swap_contrib_node(built32, np.float32), feeds)
        for name in w:
            close(got[f"{name}_grad"], expected[name], 1e-3, 1e-4)
        return

    # 3. the contrib op on onnxruntime computes what the standard formulation does
    probe = case.contrib_model()
    del probe.graph.output[:]
    probe.graph.output.extend(helper.make_empty_tensor_value_info(o) for o in case.expected_forward)
    forward = ort_run(probe, feeds)
    for o, ref in case.expected_forward.items():
        close(forward[o], ref, 1e-4, 1e-5)

    # 4. the float32 gradient graph on onnxruntime, contrib forward node and all
    got = ort_run(built32, feeds)
    numeric = ort_finite_differences(case.contrib_model(), feeds, w)
    for name in w:
        close(got[f"{name}_grad"], expected[name], 1e-3, 1e-4)
        close(got[f"{name}_grad"], numeric[name], 2e-2, 2e-3)


# ----------------------------------------------------------------------------- which kernels run


def test_cpu_kernels(rng):
    """Pins what runs on onnxruntime's CPU provider (float32), which decides how each op is
    tested: a forward run of each contrib op."""
    x, bias = arr(rng, 2, 3, 4), arr(rng, 4)
    cases = {
        ("Gelu", MS): [("x", x)], ("BiasGelu", MS): [("x", x), ("b", bias)],
        ("FastGelu", MS): [("x", x), ("b", bias)], ("QuickGelu", MS): [("x", x)],
        ("FusedMatMul", MS): [("x", x), ("w", arr(rng, 4, 2))],
        ("SkipLayerNormalization", MS): [("x", x), ("s", x), ("g", bias)],
        ("SkipSimplifiedLayerNormalization", MS): [("x", x), ("s", x), ("g", bias)],
        ("SimplifiedLayerNormalization", ""): [("x", x), ("g", bias)],
        ("SimplifiedLayerNormalization", MS): [("x", x), ("g", bias)],
        ("BiasAdd", MS): [("x", x), ("b", bias), ("s", x)],
        ("BiasSoftmax", MS): [("x", x), ("b", arr(rng, 2, 1, 4))],
    }
    attrs = {"BiasSoftmax": {"axis": 2, "is_inner_broadcast": 1}}
    runs = set()
    for (op, domain), inputs in cases.items():
        node = helper.make_node(op, [n for n, _ in inputs], ["y"], domain=domain, **attrs.get(op, {}))
        model = _model([node], [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(a.shape)) for n, a in inputs],
                       [helper.make_empty_tensor_value_info("y")], [], 17, domain=domain or MS)
        try:
            ort_run(model, dict(inputs))
            runs.add((op, domain))
        except Exception:  # noqa: BLE001 - no kernel / not registered
            pass
    assert runs == set(cases) - NOT_ON_CPU


# ----------------------------------------------------------------------------- GELU family


@pytest.mark.parametrize("opset", [13, 17])
@pytest.mark.parametrize("shape", [(2, 3, 4), (5,)])
def test_gelu(shape, opset, rng):
    check(Case("Gelu", [("x", arr(rng, *shape, lo=-3, hi=3))], opset=opset))


@pytest.mark.parametrize("bias_shape", [(4,), None])
def test_fast_gelu(bias_shape, rng):
    x = arr(rng, 2, 3, 4, lo=-3, hi=3)
    b = None if bias_shape is None else arr(rng, *bias_shape)
    check(Case("FastGelu", [("x", x), ("b", b)] if b is not None else [("x", x)]))


@pytest.mark.parametrize("opset", [13, 18])
def test_bias_gelu(opset, rng):
    check(Case("BiasGelu", [("a", arr(rng, 2, 3, 4, lo=-3, hi=3)), ("b", arr(rng, 4))], opset=opset))


@pytest.mark.parametrize("attrs", [{}, {"alpha": 1.0}, {"alpha": -0.7}])
def test_quick_gelu(attrs, rng):
    check(Case("QuickGelu", [("x", arr(rng, 3, 5, lo=-3, hi=3))], attrs))


# ----------------------------------------------------------------------------- FusedMatMul


def _fused_operands(rng, ra, rb, ta, tb, tba, tbb, batch=(2, 3), m=2, k=4, n=5):
    """A and B whose permuted forms are (batch.., m, k) and (batch.., k, n) (rank 1: (k,), (k,))."""
    def make(rank, rows, cols, trans, tbatch):
        if rank == 1:
            return arr(rng, k)
        target = tuple(batch[len(batch) - (rank - 2):]) + (rows, cols)
        perm = _perm(rank, trans, tbatch)
        return np.ascontiguousarray(arr(rng, *target).transpose(np.argsort(perm)))
    return make(ra, m, k, ta, tba), make(rb, k, n, tb, tbb)


FUSED = [dict(zip(["transA", "transB", "transBatchA", "transBatchB"], bits))
         for bits in itertools.product([0, 1], repeat=4)]


@pytest.mark.parametrize("attrs", FUSED, ids=lambda a: "".join(str(v) for v in a.values()))
def test_fused_matmul_rank3_all_transposes(attrs, rng):
    a, b = _fused_operands(rng, 3, 3, attrs["transA"], attrs["transB"], attrs["transBatchA"], attrs["transBatchB"],
                           batch=(3,))
    check(Case("FusedMatMul", [("a", a), ("b", b)], {**attrs, "alpha": 0.5}))


@pytest.mark.parametrize("ranks,attrs", [
    ((2, 2), {}), ((2, 2), {"transA": 1, "transB": 1, "alpha": 2.0}),
    ((4, 2), {"transB": 1, "alpha": 0.125}),            # a weight broadcast over the batch axes
    ((2, 4), {"transA": 1}), ((3, 4), {"transB": 1}),     # batch broadcast
    ((4, 4), {"transBatchA": 1, "transB": 1}),          # transBatch on rank 4 (equal ranks >= 3)
    ((4, 4), {"transBatchA": 1, "transBatchB": 1, "transA": 1}),
    ((1, 3), {"transB": 1}), ((1, 2), {"transA": 1}),   # transA/transB leave a vector as it is
    ((3, 1), {"alpha": 3.0}), ((2, 1), {"transB": 1}), ((1, 1), {"alpha": 0.5}),
])
def test_fused_matmul_ranks(ranks, attrs, rng):
    a, b = _fused_operands(rng, *ranks, attrs.get("transA", 0), attrs.get("transB", 0),
                           attrs.get("transBatchA", 0), attrs.get("transBatchB", 0))
    check(Case("FusedMatMul", [("a", a), ("b", b)], attrs))


@pytest.mark.parametrize("ra", [2, 3])
def test_fused_matmul_trans_a_vector_b(ra, rng):
    """transA with a 1-D B: by the spec (and the schema's shape inference) A is transposed;
    onnxruntime's CPU kernel (1.31) reads A's data untransposed, with the transposed shape, so
    only the swapped graph runs here."""
    a, b = _fused_operands(rng, ra, 1, 1, 0, 0, 0)
    check(Case("FusedMatMul", [("a", a), ("b", b)], {"transA": 1, "alpha": 1.5}), contrib_forward_on_ort=False)


def test_fused_matmul_dynamic_dims(rng):
    a, b = _fused_operands(rng, 3, 3, 1, 0, 1, 0, batch=(2,))
    check(Case("FusedMatMul", [("a", a), ("b", b)], {"transA": 1, "transBatchA": 1, "alpha": 0.3}, dims="dynamic"))


# ----------------------------------------------------------------------------- normalizations

# (the node's outputs, the outputs the loss projects); output 0 is required
SKIP_OUTPUTS = {
    "all": (("y", "mean", "inv_std", "sum"), None),
    "y": (("y",), None),
    "stats": (("y", "mean", "inv_std"), None),
    "y+sum": (("y", "", "", "sum"), None),
    "sum-only": (("y", "", "", "sum"), ("sum",)),
    "inv_std-only": (("y", "", "inv_std"), ("inv_std",)),
    "mean-only": (("y", "mean"), ("mean",)),
}


def _skip_inputs(rng, x_shape, skip_shape, beta, bias, simplified=False):
    h = x_shape[-1]
    inputs = [("x", arr(rng, *x_shape)), ("skip", arr(rng, *skip_shape)), ("gamma", arr(rng, h, lo=0.5, hi=1.5))]
    if not simplified:
        inputs.append(("beta", arr(rng, h)) if beta else ("", None))
    inputs.append(("bias", arr(rng, h)) if bias else ("", None))
    while inputs[-1][1] is None:
        inputs.pop()
    return inputs


SKIP_CASES = [(o, True, True) for o in SKIP_OUTPUTS] + [("all", False, False), ("all", False, True),
                                                        ("all", True, False)]


@pytest.mark.parametrize("outputs,beta,bias", SKIP_CASES)
def test_skip_layer_norm(outputs, beta, bias, rng):
    inputs = _skip_inputs(rng, (2, 3, 4), (2, 3, 4), beta, bias)
    outs, loss = SKIP_OUTPUTS[outputs]
    check(Case("SkipLayerNormalization", inputs, {"epsilon": 1e-5}, outs, loss=loss))


@pytest.mark.parametrize("x_shape,skip_shape", [((2, 3, 4), (1, 3, 4)), ((2, 3, 4), (3, 4)), ((3, 4), (3, 4))])
@pytest.mark.parametrize("opset", [13, 18])
def test_skip_layer_norm_shapes(x_shape, skip_shape, opset, rng):
    inputs = _skip_inputs(rng, x_shape, skip_shape, True, True)
    check(Case("SkipLayerNormalization", inputs, {}, SKIP_OUTPUTS["all"][0], opset=opset))  # default epsilon


@pytest.mark.parametrize("opset", [13, 17])
def test_skip_layer_norm_dynamic_dims(opset, rng):
    inputs = _skip_inputs(rng, (2, 3, 4), (3, 4), True, True)
    check(Case("SkipLayerNormalization", inputs, {"epsilon": 1e-3}, SKIP_OUTPUTS["all"][0], opset=opset,
               dims="dynamic"))


@pytest.mark.parametrize("outputs,bias", [(o, True) for o in ("all", "y", "y+sum", "inv_std-only", "sum-only",
                                                               "mean-only")] + [("all", False)])
def test_skip_simplified_layer_norm(outputs, bias, rng):
    """The mean output is not computed (zeros): no gradient flows through it."""
    inputs = _skip_inputs(rng, (2, 3, 4), (2, 3, 4), False, bias, simplified=True)
    outs, loss = SKIP_OUTPUTS[outputs]
    check(Case("SkipSimplifiedLayerNormalization", inputs, {"epsilon": 1e-5}, outs, loss=loss))


@pytest.mark.parametrize("opset", [13, 18])
def test_skip_simplified_layer_norm_shapes_dynamic(opset, rng):
    inputs = _skip_inputs(rng, (2, 3, 4), (1, 3, 4), False, True, simplified=True)
    check(Case("SkipSimplifiedLayerNormalization", inputs, {}, SKIP_OUTPUTS["all"][0], opset=opset, dims="dynamic"))


def test_onnx_domain_simplified_layer_norm_passes_the_output_check(rng):
    """onnxruntime's SimplifiedLayerNormalization lives in the ai.onnx domain, where onnx has no
    schema for it: the output check treats it as a custom-domain node instead of rejecting it."""
    case = Case("SimplifiedLayerNormalization", [("x", arr(rng, 2, 4)), ("scale", arr(rng, 4))], domain="")
    grads_of(case.contrib_model(), case.weights)


@pytest.mark.parametrize("domain", ["", MS])
@pytest.mark.parametrize("axis,outputs,loss", [(-1, ("y", "inv_std"), None), (-1, ("y",), None),
                                               (1, ("y", "inv_std"), None), (-2, ("y", "inv_std"), None),
                                               (2, ("y", "inv_std"), ("inv_std",))])
def test_simplified_layer_norm(domain, axis, outputs, loss, rng):
    x = arr(rng, 2, 3, 4)
    scale = arr(rng, *x.shape[axis:], lo=0.5, hi=1.5)
    check(Case("SimplifiedLayerNormalization", [("x", x), ("scale", scale)], {"axis": axis, "epsilon": 1e-4},
               outputs, loss=loss, domain=domain))


@pytest.mark.parametrize("opset", [13, 17, 18])
@pytest.mark.parametrize("axis", [-1, 1])
def test_simplified_layer_norm_dynamic_dims(opset, axis, rng):
    x = arr(rng, 2, 3, 4)
    check(Case("SimplifiedLayerNormalization", [("x", x), ("scale", arr(rng, *x.shape[axis:]))],
               {"axis": axis, "stash_type": 1}, ("y", "inv_std"), domain="", opset=opset, dims="dynamic"))


# ----------------------------------------------------------------------------- BiasAdd, BiasSoftmax


@pytest.mark.parametrize("dims", ["static", "dynamic"])
def test_bias_add(dims, rng):
    x = arr(rng, 2, 3, 4)
    check(Case("BiasAdd", [("x", x), ("bias", arr(rng, 4)), ("skip", arr(rng, 2, 3, 4))], dims=dims))


SOFTMAX = [
    # attention mask (batch, 1, 1, seq) on scores (batch, heads, seq, seq): inner broadcast
    ((2, 3, 2, 4), (2, 1, 1, 4), {"axis": 3, "is_inner_broadcast": 1}),
    # relative position bias (1, heads, seq, seq) reused per batch: outer broadcast
    ((2, 3, 2, 4), (1, 3, 2, 4), {"axis": 3, "is_inner_broadcast": 0}),
    # softmax over the flattened axes [2, 4), bias rows per batch
    ((2, 3, 2, 4), (2, 1, 2, 4), {"axis": 2, "is_inner_broadcast": 1}),
    # the default axis 1; one bias row for all rows
    ((3, 2, 4), (1, 2, 4), {"is_inner_broadcast": 0}),
    # no broadcast at all; negative axis
    ((2, 5), (2, 5), {"axis": -1, "is_inner_broadcast": 1}),
    # the older schema's broadcast_axis form (bias broadcast over [broadcast_axis, axis))
    ((2, 3, 2, 4), (2, 1, 1, 4), {"axis": 3, "broadcast_axis": 1}),
]


@pytest.mark.parametrize("x_shape,b_shape,attrs", SOFTMAX)
@pytest.mark.parametrize("dims", ["static", "dynamic"])
def test_bias_softmax(x_shape, b_shape, attrs, dims, rng):
    x = arr(rng, *x_shape, lo=-2, hi=2)
    check(Case("BiasSoftmax", [("x", x), ("b", arr(rng, *b_shape, lo=-2, hi=2))], attrs, dims=dims))


# ----------------------------------------------------------------------------- models of several nodes


@pytest.mark.parametrize("opset", [13, 17])
def test_chain_of_contrib_ops(opset, rng):
    """SkipLayerNormalization -> FusedMatMul -> BiasGelu -> FastGelu -> QuickGelu: onnx's shape
    inference gives no value between them a dtype or shape, so the rules see unknown types and
    shapes (constants by CastLike from opset 15, float before) and FusedMatMul an A of unknown
    rank."""
    h = 4
    feeds = {"x": arr(rng, 2, 3, h), "skip": arr(rng, 2, 3, h), "gamma": arr(rng, h, lo=0.5, hi=1.5),
             "beta": arr(rng, h), "w": arr(rng, 5, h), "b1": arr(rng, 5), "b2": arr(rng, 5)}
    nodes = [
        helper.make_node("SkipLayerNormalization", ["x", "skip", "gamma", "beta"], ["n", "", "", "s"], domain=MS),
        helper.make_node("FusedMatMul", ["n", "w"], ["mm"], domain=MS, transB=1, alpha=0.7),
        helper.make_node("BiasGelu", ["mm", "b1"], ["g1"], domain=MS),
        helper.make_node("FastGelu", ["g1", "b2"], ["g2"], domain=MS),
        helper.make_node("QuickGelu", ["g2"], ["g3"], domain=MS, alpha=1.2),
        helper.make_node("ReduceSum", ["g3"], ["l1"], keepdims=0),
        helper.make_node("Mul", ["s", "s"], ["s2"]),
        helper.make_node("ReduceSum", ["s2"], ["l2"], keepdims=0),
        helper.make_node("Add", ["l1", "l2"], ["loss"]),
    ]
    inputs = [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape)) for k, v in feeds.items()]
    model = _model(nodes, inputs, [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [], opset)
    weights = list(feeds)
    got = ort_run(grads_of(model, weights), feeds)
    numeric = ort_finite_differences(model, feeds, weights)
    # float64 reference: the same chain in numpy
    x = {k: v.astype(np.float64) for k, v in feeds.items()}

    def loss(x):
        s = x["x"] + x["skip"]
        mu = s.mean(-1, keepdims=True)
        n = (s - mu) / np.sqrt(((s - mu) ** 2).mean(-1, keepdims=True) + 1e-12) * x["gamma"] + x["beta"]
        u = 0.7 * n @ x["w"].T + x["b1"]
        g1 = u * 0.5 * (1 + np.vectorize(math.erf)(u / math.sqrt(2)))
        v = g1 + x["b2"]
        g2 = 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))
        g3 = g2 / (1 + np.exp(-1.2 * g2))
        return g3.sum() + (s * s).sum()

    for w in weights:
        close(got[f"{w}_grad"], numeric[w], 2e-2, 2e-3)
        ref = np.zeros(x[w].shape)
        for i in range(ref.size):  # float64 central differences of the numpy chain
            p, m = {**x, w: x[w].copy()}, {**x, w: x[w].copy()}
            p[w].reshape(-1)[i] += 1e-6
            m[w].reshape(-1)[i] -= 1e-6
            ref.reshape(-1)[i] = (loss(p) - loss(m)) / 2e-6
        close(got[f"{w}_grad"], ref, 1e-3, 1e-4)


@pytest.mark.parametrize("opset", [13, 18])
def test_optimized_block_after_symbolic_shape_inference(opset, rng):
    """A transformer-optimizer style block with plain ops between the contrib ops: gradbuilder's
    own rules (MatMul) need ranks, which onnx cannot infer past a com.microsoft op;
    onnxruntime's symbolic shape inference gives every value its type and shape first."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    h = 4
    feeds = {"x": arr(rng, 2, 3, h), "skip": arr(rng, 2, 3, h), "gamma": arr(rng, h, lo=0.5, hi=1.5),
             "beta": arr(rng, h), "w1": arr(rng, h, 6), "b1": arr(rng, 6), "w2": arr(rng, 6, h),
             "g2": arr(rng, h, lo=0.5, hi=1.5)}
    nodes = [
        helper.make_node("SkipLayerNormalization", ["x", "skip", "gamma", "beta"], ["n", "", "", "s"],
                         domain=MS, epsilon=1e-5),
        helper.make_node("MatMul", ["n", "w1"], ["h1"]),
        helper.make_node("FastGelu", ["h1", "b1"], ["a1"], domain=MS),
        helper.make_node("MatMul", ["a1", "w2"], ["h2"]),
        helper.make_node("SkipSimplifiedLayerNormalization", ["h2", "s", "g2"], ["out"], domain=MS, epsilon=1e-5),
        helper.make_node("ReduceSumSquare", ["out"], ["loss"], keepdims=0),
    ]
    inputs = [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape)) for k, v in feeds.items()]
    model = _model(nodes, inputs, [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [], opset)
    inferred = SymbolicShapeInference.infer_shapes(model, auto_merge=True)
    weights = list(feeds)
    got = ort_run(grads_of(inferred, weights), feeds)
    numeric = ort_finite_differences(model, feeds, weights)
    for w in weights:
        close(got[f"{w}_grad"], numeric[w], 2e-2, 2e-3)


# ----------------------------------------------------------------------------- float16


F16_CASES = [
    ("Gelu", lambda rng: [("x", arr(rng, 2, 3, 4, lo=-3, hi=3))], {}, ("y",), MS),
    ("BiasGelu", lambda rng: [("a", arr(rng, 2, 3, 4, lo=-3, hi=3)), ("b", arr(rng, 4))], {}, ("y",), MS),
    ("FastGelu", lambda rng: [("x", arr(rng, 2, 3, 4, lo=-3, hi=3)), ("b", arr(rng, 4))], {}, ("y",), MS),
    ("QuickGelu", lambda rng: [("x", arr(rng, 2, 3, 4, lo=-3, hi=3))], {"alpha": 1.5}, ("y",), MS),
    ("FusedMatMul", lambda rng: [("a", arr(rng, 2, 4, 3)), ("b", arr(rng, 5, 4))],
     {"transA": 1, "transB": 1, "alpha": 0.5}, ("y",), MS),
    ("SkipLayerNormalization", lambda rng: _skip_inputs(rng, (2, 3, 4), (2, 3, 4), True, True), {"epsilon": 1e-3},
     ("y", "mean", "inv_std", "sum"), MS),
    ("SkipSimplifiedLayerNormalization", lambda rng: _skip_inputs(rng, (2, 3, 4), (2, 3, 4), False, True, True),
     {"epsilon": 1e-3}, ("y", "", "inv_std", "sum"), MS),
    ("SimplifiedLayerNormalization", lambda rng: [("x", arr(rng, 2, 3, 4)), ("scale", arr(rng, 4))],
     {"epsilon": 1e-3}, ("y", "inv_std"), ""),
]


@pytest.mark.parametrize("op,make,attrs,outputs,domain", F16_CASES, ids=[c[0] for c in F16_CASES])
def test_float16(op, make, attrs, outputs, domain, rng):
    """The float16 model (statistics in float: mean and inv_std_var are float outputs) builds
    and runs on onnxruntime; its gradient agrees with the float64 one at float16 precision."""
    inputs = [(k, v.astype(f16)) for k, v in make(rng)]
    case = Case(op, [(k, v.astype(f32)) for k, v in inputs], attrs, outputs, domain=domain)
    expected = gradcheck(case.standard_model(), case.weights, "loss", case.feeds, max_elements=8).gradients
    model = case.contrib_model(f16, float_outputs={"mean", "inv_std"})
    got = ort_run(grads_of(model, case.weights), {k: v for k, v in inputs})
    for w in case.weights:
        assert got[f"{w}_grad"].dtype == f16
        close(got[f"{w}_grad"], expected[w], 3e-2, 3e-2)
