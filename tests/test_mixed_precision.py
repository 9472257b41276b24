"""Mixed precision (passes/mixed_precision.py): structure of the autocast forward graph, and
the loss and weight gradients of float16 / bfloat16 gradient graphs against float32.

Tolerances: float16 (11-bit significand), max |g16 - g32| <= 2e-2 * max |g32| per weight
gradient and |loss16 - loss32| <= 2e-2 * |loss32|, on onnxruntime CPU and on onnx's reference
evaluator; bfloat16 (8-bit significand), 5e-2 of the same scales, on the reference evaluator
only (onnxruntime CPU lacks most bfloat16 kernels). Measured: float16 errors ~5e-4,
bfloat16 ~2e-3 to 2e-2.
"""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from gradbuilder import GradientGraphBuilder
from gradbuilder.compiler.passes.cleanup import remove_unused_nodes
from gradbuilder.compiler.passes.mixed_precision import autocast, propagation_ops
from gradbuilder.compiler.pipeline import Context

from .helpers import make_model, tensor, vi

F16, BF16, F32 = ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.FLOAT


def _w(rng, *shape, scale=0.3):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ----------------------------------------------------------------------------- models


def mlp(opset=17):
    """x -> MatMul W1 -> Add B1 -> Relu -> MatMul W2 (logits) -> SoftmaxCrossEntropyLoss."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="mm1"),
        helper.make_node("Add", ["h", "B1"], ["hb"], name="add1"),
        helper.make_node("Relu", ["hb"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "W2"], ["logits"], name="mm2"),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"], name="sce"),
    ]
    inits = [tensor("W1", _w(rng, 8, 16)), tensor("B1", _w(rng, 16, scale=0.1)), tensor("W2", _w(rng, 16, 4))]
    inputs = [vi("x", [6, 8]), vi("labels", [6], TensorProto.INT64)]
    outputs = [vi("loss", []), vi("logits", [6, 4])]
    feeds = {"x": rng.standard_normal((6, 8)).astype(np.float32), "labels": np.array([0, 1, 2, 3, 0, 1])}
    return make_model(nodes, inputs, outputs, inits, opset=opset), ["W1", "B1", "W2"], feeds


def conv_net():
    """Conv (bias) -> Relu -> Flatten -> Gemm -> SoftmaxCrossEntropyLoss."""
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("Conv", ["x", "Wc", "Bc"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["cr"], name="relu"),
        helper.make_node("Flatten", ["cr"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "Wf", "Bf"], ["logits"], name="fc", transB=1),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"], name="sce"),
    ]
    inits = [tensor("Wc", _w(rng, 4, 2, 3, 3)), tensor("Bc", _w(rng, 4, scale=0.1)),
             tensor("Wf", _w(rng, 3, 4 * 5 * 5, scale=0.1)), tensor("Bf", _w(rng, 3, scale=0.1))]
    inputs = [vi("x", [2, 2, 5, 5]), vi("labels", [2], TensorProto.INT64)]
    feeds = {"x": rng.standard_normal((2, 2, 5, 5)).astype(np.float32), "labels": np.array([0, 2])}
    return make_model(nodes, inputs, [vi("loss", [])], inits), ["Wc", "Bc", "Wf", "Bf"], feeds


def reshape_transpose(opset=17):
    """MatMul -> Reshape -> Transpose -> MatMul -> ReduceMean(y*y): the shape ops move to low."""
    rng = np.random.default_rng(2)
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="mm1"),
        helper.make_node("Reshape", ["h", "shape"], ["hr"], name="reshape"),
        helper.make_node("Transpose", ["hr"], ["ht"], name="transpose", perm=[1, 0]),
        helper.make_node("MatMul", ["ht", "W2"], ["y"], name="mm2"),
        helper.make_node("Mul", ["y", "y"], ["sq"], name="square"),
        helper.make_node("ReduceMean", ["sq"], ["loss"], name="mean", keepdims=0),
    ]
    inits = [tensor("W1", _w(rng, 6, 8)), tensor("W2", _w(rng, 8, 5)),
             tensor("shape", np.array([-1, 4], np.int64))]
    feeds = {"x": rng.standard_normal((4, 6)).astype(np.float32)}
    return make_model(nodes, [vi("x", [4, 6])], [vi("loss", [])], inits, opset=opset), ["W1", "W2"], feeds


def levels_model():
    """MatMul -> Reshape -> Relu -> MatMul -> Dropout -> MatMul: level 1 moves Reshape+Relu,
    level 2 also the Dropout."""
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="mm1"),
        helper.make_node("Reshape", ["h", "shape"], ["hr"], name="reshape"),
        helper.make_node("Relu", ["hr"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "W2"], ["h2"], name="mm2"),
        helper.make_node("Dropout", ["h2", "ratio", "training"], ["d"], name="dropout"),
        helper.make_node("MatMul", ["d", "W3"], ["y"], name="mm3"),
        helper.make_node("ReduceSum", ["y"], ["loss"], name="sum", keepdims=0),
    ]
    inits = [tensor("W1", _w(rng, 6, 8)), tensor("W2", _w(rng, 8, 8)), tensor("W3", _w(rng, 8, 2)),
             tensor("shape", np.array([-1, 8], np.int64)), tensor("ratio", np.array(0.25, np.float32)),
             tensor("training", np.array(True))]
    return make_model(nodes, [vi("x", [4, 6])], [vi("loss", [])], inits), ["W1", "W2", "W3"]


def attention_block(opset=17):
    """LayerNorm -> Q, K, V projections -> softmax(Q K^T) V -> output projection -> mean(y*y)."""
    rng = np.random.default_rng(4)
    nodes = [
        helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["xn"], name="ln", axis=-1),
        helper.make_node("MatMul", ["xn", "Wq"], ["q"], name="q"),
        helper.make_node("MatMul", ["xn", "Wk"], ["k"], name="k"),
        helper.make_node("MatMul", ["xn", "Wv"], ["v"], name="v"),
        helper.make_node("Transpose", ["k"], ["kt"], name="kt", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["scores"], name="qk"),
        helper.make_node("Softmax", ["scores"], ["p"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["a"], name="pv"),
        helper.make_node("MatMul", ["a", "Wo"], ["y"], name="o"),
        helper.make_node("Mul", ["y", "y"], ["sq"], name="square"),
        helper.make_node("ReduceMean", ["sq"], ["loss"], name="mean", keepdims=0),
    ]
    inits = [tensor("gamma", 1 + _w(rng, 8, scale=0.1)), tensor("beta", _w(rng, 8, scale=0.1)),
             tensor("Wq", _w(rng, 8, 8)), tensor("Wk", _w(rng, 8, 8)), tensor("Wv", _w(rng, 8, 8)),
             tensor("Wo", _w(rng, 8, 8))]
    feeds = {"x": rng.standard_normal((2, 5, 8)).astype(np.float32)}
    weights = ["gamma", "beta", "Wq", "Wk", "Wv", "Wo"]
    return make_model(nodes, [vi("x", [2, 5, 8])], [vi("loss", [])], inits, opset=opset), weights, feeds


def attention23():
    """The opset-23 Attention op on projected Q and K (V is the input) -> sum(a*a)."""
    rng = np.random.default_rng(9)
    nodes = [
        helper.make_node("MatMul", ["x", "Wq"], ["q"], name="q"),
        helper.make_node("MatMul", ["x", "Wk"], ["k"], name="k"),
        helper.make_node("Attention", ["q", "k", "x"], ["a"], name="attention"),
        helper.make_node("Mul", ["a", "a"], ["sq"], name="square"),
        helper.make_node("ReduceSum", ["sq"], ["loss"], name="sum", keepdims=0),
    ]
    proto = make_model(nodes, [vi("x", [1, 2, 3, 4])], [vi("loss", [])],
                       [tensor("Wq", _w(rng, 4, 4)), tensor("Wk", _w(rng, 4, 4))], opset=23)
    proto.ir_version = 11
    return proto, ["Wq", "Wk"], {"x": rng.standard_normal((1, 2, 3, 4)).astype(np.float32)}


# ----------------------------------------------------------------------------- helpers


def run_autocast(proto, low="float16", level=1, allow=()):
    """The forward graph after autocast (and dead-node cleanup), as an IR model, and the counts."""
    model = ir.from_proto(onnx.shape_inference.infer_shapes(proto))
    ctx = Context.of(model, mixed_precision=low, cast_propagation=(level, list(allow)))
    autocast(model, ctx)
    remove_unused_nodes(model)
    return model, ctx.reports["mixed_precision"]


def ops(model, op_type):
    return [n for n in model.graph if n.op_type == op_type]


def consumers(model, value):
    return [u.node for u in value.uses() if u.node.graph is model.graph]


def n_casts(model):
    return len(ops(model, "Cast"))


def float_input_dtypes(node):
    return {v.dtype for v in node.inputs if v is not None and v.dtype is not None and v.dtype.is_floating_point()}


def build(proto, weights, mp=None, outputs=("loss",), **kw):
    return GradientGraphBuilder(proto, weights=weights, outputs=list(outputs), loss="loss",
                                mixed_precision=mp, **kw).build()


def run_ort(builder, feeds):
    sess = ort.InferenceSession(builder.get_model(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds)))


def run_reference(builder, feeds):
    proto = builder.model_proto
    names = [o.name for o in proto.graph.output]
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    graph_inputs = {i.name for i in proto.graph.input}
    feeds = {**{k: v for k, v in inits.items() if k in graph_inputs}, **feeds}
    return dict(zip(names, ReferenceEvaluator(proto).run(None, feeds)))


def assert_close_to_fp32(low, full, weights, tol):
    assert abs(float(low["loss"]) - float(full["loss"])) <= tol * abs(float(full["loss"]))
    for w in weights:
        g, ref = low[f"{w}_grad"], full[f"{w}_grad"]
        assert g.dtype == np.float32 and g.shape == ref.shape
        scale = np.abs(ref).max()
        assert scale > 0
        assert np.abs(g.astype(np.float64) - ref).max() <= tol * scale, w


# ----------------------------------------------------------------------------- structure


@pytest.mark.parametrize("opset", [13, 17])
def test_mlp_matmuls_and_what_follows_them_run_low_the_loss_float32(opset):
    """torch.autocast's rule: the MatMuls run low, and so do the bias Add (a half product and a
    parameter) and the Relu after them; the loss runs in float32."""
    proto, _, _ = mlp(opset)
    model, counts = run_autocast(proto)
    for mm in ops(model, "MatMul"):
        assert float_input_dtypes(mm) == {F16}
        assert mm.outputs[0].dtype == F16
    for op in ("Add", "Relu"):
        assert float_input_dtypes(ops(model, op)[0]) == {F16}
    assert float_input_dtypes(ops(model, "SoftmaxCrossEntropyLoss")[0]) == {F32}
    # x, W1, B1, W2 down; logits back
    assert n_casts(model) == 5 == counts["casts"]
    assert counts["low_nodes"] == 4
    # the graph outputs keep their names and float32
    assert [(v.name, v.dtype) for v in model.graph.outputs] == [("loss", F32), ("logits", F32)]


def test_casts_of_a_value_are_shared():
    proto, _, _ = attention_block()
    model, _ = run_autocast(proto)
    # xn feeds three MatMuls through one Cast
    casts_of_xn = [n for n in ops(model, "Cast") if n.inputs[0].name == "xn"]
    assert len(casts_of_xn) == 1
    assert len(consumers(model, casts_of_xn[0].outputs[0])) == 3


def test_attention_block_softmax_and_layernorm_stay_float32():
    proto, _, _ = attention_block()
    for level in (1, 2):
        model, _ = run_autocast(proto, level=level)
        assert float_input_dtypes(ops(model, "Softmax")[0]) == {F32}
        assert float_input_dtypes(ops(model, "LayerNormalization")[0]) == {F32}
        assert all(float_input_dtypes(mm) == {F16} for mm in ops(model, "MatMul"))
        # the Transpose of K sits between two MatMuls: it runs low, no Cast pair around it
        (kt,) = ops(model, "Transpose")
        assert kt.inputs[0].dtype == F16 and kt.inputs[0].producer().op_type == "MatMul"
        assert [n.op_type for n in consumers(model, kt.outputs[0])] == ["MatMul"]


def test_reshape_and_transpose_between_matmuls_join_the_low_region():
    proto, _, _ = reshape_transpose()
    none, _ = run_autocast(proto, level=-1)
    one, counts = run_autocast(proto, level=1)
    assert n_casts(none) == 6  # x, W1, W2 down; h back, ht down; y back
    assert n_casts(one) == 4 == counts["casts"]  # x, W1, W2 down; the square back
    assert counts["propagated"] == 3  # Reshape, Transpose, and y*y (a half product squared stays half)
    (reshape,) = ops(one, "Reshape")
    assert reshape.inputs[0].dtype == F16
    assert reshape.inputs[1].dtype == ir.DataType.INT64  # the shape is untouched
    assert reshape.inputs[1].producer() is None or reshape.inputs[1].producer().op_type != "Cast"


def test_levels_give_fewer_casts_and_allow_extends_level_0():
    proto, _ = levels_model()
    counts = {level: n_casts(run_autocast(proto, level=level)[0]) for level in (-1, 0, 1, 2)}
    # level 1: Reshape and Relu, and the Dropout that follows a half product (torch.autocast's rule)
    assert counts == {-1: 9, 0: 9, 1: 5, 2: 5}
    allowed, _ = run_autocast(proto, level=0, allow=["Relu", "Reshape"])
    assert n_casts(allowed) == 7
    only_dropout, _ = run_autocast(proto, level=0, allow=["Dropout"])
    assert n_casts(only_dropout) == 7
    model, _ = run_autocast(proto, level=2)
    (dropout,) = ops(model, "Dropout")
    assert dropout.inputs[0].dtype == F16
    assert dropout.inputs[1].dtype == F32  # the ratio keeps its own type
    assert dropout.inputs[2].dtype == ir.DataType.BOOL
    assert model.graph.outputs[0].dtype == F32


def test_propagation_ops_by_level():
    assert propagation_ops(-1, ["Relu"]) == frozenset()
    assert propagation_ops(0) == frozenset()
    assert propagation_ops(0, ["Add"]) == {"Add"}
    assert {"Relu", "Transpose"} <= propagation_ops(1) and "Where" not in propagation_ops(1)
    assert {"Relu", "Where", "LayerNormalization"} <= propagation_ops(2, ["Add"])


def test_region_that_adds_casts_stays_float32():
    """A Relu whose output is also a graph output and feeds float32 ops gains nothing, where
    only the cast count decides (level 2 without torch.autocast's rule, as level 0 with Relu
    allowed); with it (level 1 and up) the Relu follows its half input and comes back once."""
    rng = np.random.default_rng(5)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Softmax", ["r"], ["s"]),
        helper.make_node("ReduceSum", ["s"], ["loss"], keepdims=0),
    ]
    proto = make_model(nodes, [vi("x", [2, 3])], [vi("loss", []), vi("r", [2, 4])], [tensor("W", _w(rng, 3, 4))])
    model, counts = run_autocast(proto, level=0, allow=["Relu"])
    assert counts["propagated"] == 0
    assert ops(model, "Relu")[0].inputs[0].dtype == F32
    assert [(v.name, v.dtype) for v in model.graph.outputs] == [("loss", F32), ("r", F32)]
    model, counts = run_autocast(proto, level=2)
    assert counts["propagated"] == 1 and ops(model, "Relu")[0].inputs[0].dtype == F16
    assert n_casts(model) == 3  # x, W down; r back
    assert [(v.name, v.dtype) for v in model.graph.outputs] == [("loss", F32), ("r", F32)]


def test_low_node_output_that_is_a_graph_output_keeps_name_and_float32():
    rng = np.random.default_rng(6)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"]), helper.make_node("Relu", ["y"], ["r"])]
    proto = make_model(nodes, [vi("x", [2, 3])], [vi("y", [2, 4]), vi("r", [2, 4])], [tensor("W", _w(rng, 3, 4))])
    model, _ = run_autocast(proto, level=1)
    y, r = model.graph.outputs
    assert (y.name, y.dtype, y.producer().op_type) == ("y", F32, "Cast")
    assert (r.name, r.dtype) == ("r", F32)
    x = {"x": np.ones((2, 3), np.float32)}
    ref = ReferenceEvaluator(proto).run(None, x)
    got = ReferenceEvaluator(ir.to_proto(model)).run(None, x)
    for a, b in zip(got, ref):
        assert a.dtype == np.float32
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-3)


def test_exact_cast_pairs_go_lossy_pairs_stay():
    """Cast(Cast(x16 -> f32) -> f16) is x16; Cast(Cast(x32 -> f16) -> f32) is kept."""
    nodes = [
        helper.make_node("Cast", ["a16"], ["a32"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["a32"], ["a16b"], to=TensorProto.FLOAT16),
        helper.make_node("Neg", ["a16b"], ["na"]),
        helper.make_node("Cast", ["b32"], ["b16"], to=TensorProto.FLOAT16),
        helper.make_node("Cast", ["b16"], ["b32b"], to=TensorProto.FLOAT),
    ]
    proto = make_model(nodes, [vi("a16", [3], TensorProto.FLOAT16), vi("b32", [3])],
                       [vi("na", [3], TensorProto.FLOAT16), vi("b32b", [3])])
    model, _ = run_autocast(proto, level=-1)
    (neg,) = ops(model, "Neg")
    assert neg.inputs[0].name == "a16"
    assert [n.outputs[0].name for n in ops(model, "Cast")] == ["b16", "b32b"]


def test_subgraphs_and_other_domains_are_left_alone():
    rng = np.random.default_rng(7)
    body = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["yb"])], "body", [], [vi("yb", [2, 4])])
    nodes = [
        helper.make_node("If", ["cond"], ["y"], then_branch=body, else_branch=body),
        helper.make_node("MatMul", ["x", "W"], ["z"], domain="custom"),
    ]
    proto = make_model(nodes, [vi("x", [2, 3]), vi("cond", [], TensorProto.BOOL)],
                       [vi("y", [2, 4]), vi("z", [2, 4])], [tensor("W", _w(rng, 3, 4))], domains=["custom"])
    model = ir.from_proto(proto)
    ctx = Context.of(model, mixed_precision="float16")
    autocast(model, ctx)
    counts = ctx.reports["mixed_precision"]
    assert counts == {"casts": 0, "low_nodes": 0, "propagated": 0}
    assert [n.op_type for n in ir.traversal.RecursiveGraphIterator(model.graph)].count("Cast") == 0


def test_attention_opset_23_casts_its_float_inputs():
    nodes = [
        helper.make_node("MatMul", ["x", "Wq"], ["q"]),
        helper.make_node("Attention", ["q", "k", "v", "mask"], ["a"]),
        helper.make_node("ReduceSum", ["a"], ["loss"], keepdims=0),
    ]
    rng = np.random.default_rng(8)
    inputs = [vi("x", [1, 2, 3, 4]), vi("k", [1, 2, 3, 4]), vi("v", [1, 2, 3, 4]),
              vi("mask", [3, 3], TensorProto.BOOL)]
    proto = make_model(nodes, inputs, [vi("loss", [])], [tensor("Wq", _w(rng, 4, 4))], opset=23)
    proto.ir_version = 11
    model, counts = run_autocast(proto)
    (att,) = ops(model, "Attention")
    assert [v.dtype for v in att.inputs] == [F16, F16, F16, ir.DataType.BOOL]
    assert att.outputs[0].dtype == F16
    assert counts["low_nodes"] == 2
    # q goes from MatMul to Attention without a Cast pair; a comes back to float32 for the sum
    assert att.inputs[0].producer().op_type == "MatMul"
    assert float_input_dtypes(ops(model, "ReduceSum")[0]) == {F32}


# ----------------------------------------------------------------------------- gradient graphs


def _feeds_with_weights(proto, feeds):
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    return {**feeds, **{k: v for k, v in inits.items() if v.dtype == np.float32}}


MODELS = {
    "mlp17": lambda: mlp(17),
    "mlp13": lambda: mlp(13),
    "conv": conv_net,
    "reshape_transpose": reshape_transpose,
    "attention": attention_block,
    "attention23": attention23,
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_float16_gradients_match_float32_on_onnxruntime_cpu(name):
    proto, weights, feeds = MODELS[name]()
    before = proto.SerializeToString()
    full = run_ort(build(proto, weights), _feeds_with_weights(proto, feeds))
    b16 = build(proto, weights, "float16")
    assert proto.SerializeToString() == before  # the model passed in is not modified
    built = b16.model_proto
    assert sum(n.op_type == "Cast" for n in built.graph.node) > 0
    for out in built.graph.output:
        assert out.type.tensor_type.elem_type == TensorProto.FLOAT, out.name
    low = run_ort(b16, _feeds_with_weights(proto, feeds))
    assert_close_to_fp32(low, full, weights, tol=2e-2)


def test_float16_outputs_computed_by_low_nodes_keep_name_and_dtype():
    """logits is a graph output of the model, h an intermediate value asked for as an output:
    both are MatMul results, and both come out float32 under their names."""
    proto, weights, feeds = mlp()
    outputs = ("loss", "logits", "h")
    full = run_ort(build(proto, weights, outputs=outputs), _feeds_with_weights(proto, feeds))
    low = run_ort(build(proto, weights, "float16", outputs=outputs), _feeds_with_weights(proto, feeds))
    assert list(low) == ["loss", "logits", "h", "W1_grad", "B1_grad", "W2_grad"]
    for name in ("logits", "h"):
        assert low[name].dtype == np.float32
        np.testing.assert_allclose(low[name], full[name], atol=2e-2 * np.abs(full[name]).max())


@pytest.mark.parametrize("low,tol", [("float16", 2e-2), ("bfloat16", 5e-2)])
@pytest.mark.parametrize("name", ["mlp17", "conv", "reshape_transpose", "attention", "attention23"])
def test_low_precision_gradients_match_float32_on_the_reference_evaluator(name, low, tol):
    """The reference evaluator computes in the low type itself (onnxruntime CPU lacks most
    bfloat16 kernels, and may run some float16 ones in float32)."""
    proto, weights, feeds = MODELS[name]()
    full = run_reference(build(proto, weights), feeds)
    b = build(proto, weights, low)
    to = TensorProto.FLOAT16 if low == "float16" else TensorProto.BFLOAT16
    assert any(n.op_type == "Cast" and n.attribute[0].i == to for n in b.model_proto.graph.node)
    lowres = run_reference(b, feeds)
    assert_close_to_fp32(lowres, full, weights, tol=tol)


def test_cast_propagation_reaches_the_builder():
    proto, weights = levels_model()

    def forward_casts(level):
        b = build(proto, weights, "float16", cast_propagation=(level, ()))
        # the forward Casts are those to float16 of values the forward computes or reads
        return sum(1 for n in b.model_proto.graph.node if n.op_type == "Cast"
                   and not any("/grad/" in o or o.endswith("_grad") for o in n.output))

    assert [forward_casts(level) for level in (-1, 1, 2)] == [9, 5, 5]
    # the level-2 graph (a float16 Dropout in training mode) runs, float32 out
    b = build(proto, weights, "float16", cast_propagation=(2, ()))
    out = run_ort(b, {"x": np.ones((4, 6), np.float32)})
    assert all(v.dtype == np.float32 and np.isfinite(v).all() for v in out.values())


def test_bfloat16_conv_waits_for_opset_22():
    proto, _, _ = conv_net()
    model, _ = run_autocast(proto, "bfloat16")
    assert float_input_dtypes(ops(model, "Conv")[0]) == {F32}
    assert float_input_dtypes(ops(model, "Gemm")[0]) == {BF16}
    proto.opset_import[0].version = 22
    proto.ir_version = 10
    model, _ = run_autocast(proto, "bfloat16")
    assert float_input_dtypes(ops(model, "Conv")[0]) == {BF16}
    model, _ = run_autocast(conv_net()[0], "float16")
    assert float_input_dtypes(ops(model, "Conv")[0]) == {F16}
