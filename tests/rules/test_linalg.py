import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradbuilder import GradientGraphBuilder
from gradbuilder.errors import GradientRuleError
from gradbuilder.testing import check_model, check_op, gradcheck, make_op_model, ort_run, run_onnxruntime

from ..helpers import make_model, tensor, vi

f32 = np.float32


def arr(rng, *shape):
    return rng.standard_normal(shape).astype(f32)


# ----------------------------------------------------------------------------- MatMul

MATMUL_SHAPES = [
    ((3, 4), (4, 5)),
    ((4,), (4, 5)),  # 1-D a
    ((3, 4), (4,)),  # 1-D b
    ((4,), (4,)),  # dot product
    ((2, 3, 4), (4, 5)),  # batched a, matrix b (folded contraction)
    ((3, 4), (2, 4, 5)),  # matrix a, batched b
    ((2, 1, 3, 4), (5, 4, 2)),  # batch dims broadcast both ways
    ((4,), (2, 4, 5)),  # 1-D a against a batch
    ((2, 3, 4), (4,)),  # batch against 1-D b
    ((1, 3, 4), (2, 4, 5)),
]


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("shapes", MATMUL_SHAPES, ids=str)
def test_matmul(shapes, opset, rng):
    check_op("MatMul", [("a", arr(rng, *shapes[0])), ("b", arr(rng, *shapes[1]))], opset=opset)


@pytest.mark.parametrize("dims", ["symbolic", "dynamic"])
@pytest.mark.parametrize("shapes", [((2, 3, 4), (4, 5)), ((2, 1, 3, 4), (5, 4, 2)), ((4,), (2, 4, 5))], ids=str)
def test_matmul_unknown_dims(shapes, dims, rng):
    check_op("MatMul", [("a", arr(rng, *shapes[0])), ("b", arr(rng, *shapes[1]))],
             weights_as="inputs", dims=dims)


# ----------------------------------------------------------------------------- Gemm


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("trans", [(0, 0), (0, 1), (1, 0), (1, 1)])
@pytest.mark.parametrize("c_shape", [None, (3, 5), (5,), (3, 1), (1, 1), ()], ids=str)
def test_gemm(trans, c_shape, opset, rng):
    ta, tb = trans
    a = arr(rng, *((4, 3) if ta else (3, 4)))
    b = arr(rng, *((5, 4) if tb else (4, 5)))
    inputs = [("a", a), ("b", b)]
    if c_shape is not None:
        inputs.append(("c", arr(rng, *c_shape)))
    check_op("Gemm", inputs, {"transA": ta, "transB": tb, "alpha": 0.7, "beta": 1.3}, opset=opset)


def test_gemm_defaults_dynamic(rng):
    check_op("Gemm", [("a", arr(rng, 3, 4)), ("b", arr(rng, 5, 4)), ("c", arr(rng, 5))], {"transB": 1},
             weights_as="inputs", dims="dynamic")


# ----------------------------------------------------------------------------- Einsum

EINSUM = [
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("ij,jk", [(3, 4), (4, 5)]),  # implicit output
    ("ba,ac", [(3, 4), (4, 5)]),  # implicit output reorders: 'bc'
    ("ij->ji", [(3, 4)]),
    ("ij->", [(3, 4)]),
    ("ij->i", [(3, 4)]),  # j summed out of one operand only
    ("ij,k->ik", [(3, 4), (5,)]),  # j only in operand 0, k only in operand 1
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]),
    ("...ij,jk->...ik", [(2, 3, 3, 4), (4, 5)]),
    ("...ij,...jk->...ik", [(2, 1, 3, 4), (1, 3, 4, 5)]),  # broadcast inside the ellipsis
    ("i...j,j->i...", [(2, 3, 4, 5), (5,)]),  # ellipsis in the middle
    ("...i,...i", [(2, 3), (1, 3)]),  # implicit with ellipsis: '...'
    ("i,j,k->ijk", [(2,), (3,), (4,)]),
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 2)]),
    ("ij,ij->", [(3, 4), (3, 4)]),
    (",ij->ij", [(), (3, 4)]),  # scalar operand
    ("Ab,bA->", [(2, 3), (3, 2)]),  # upper-case labels
    ("ii->i", [(3, 3)]),  # diagonal
    ("ii", [(3, 3)]),  # trace (implicit)
    ("iij->ji", [(2, 2, 3)]),
    ("iji,j->i", [(3, 4, 3), (4,)]),
    ("iii->", [(2, 2, 2)]),
    ("ii,i->i", [(3, 3), (3,)]),
    ("i j , j k -> i k", [(3, 4), (4, 5)]),  # spaces
]


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("eq,shapes", EINSUM, ids=[e for e, _ in EINSUM])
def test_einsum(eq, shapes, opset, rng):
    inputs = [(f"x{i}", arr(rng, *s)) for i, s in enumerate(shapes)]
    check_op("Einsum", inputs, {"equation": eq}, opset=opset)


# onnxruntime refuses an output without ellipsis when an input has one: reference only.
@pytest.mark.parametrize("eq,shapes", [("...i->i", [(2, 3, 4)]), ("...i,i->i", [(2, 3, 4), (4,)]),
                                       ("...ij,...j->", [(2, 3, 4), (2, 4)])], ids=str)
def test_einsum_ellipsis_summed_out(eq, shapes, rng):
    inputs = [(f"x{i}", arr(rng, *s)) for i, s in enumerate(shapes)]
    check_op("Einsum", inputs, {"equation": eq}, ort=False)


@pytest.mark.parametrize("eq,shapes", [("...ij,...jk->...ik", [(2, 1, 3, 4), (1, 3, 4, 5)]),
                                       ("ij->i", [(3, 4)]), ("iij->ji", [(2, 2, 3)]),
                                       ("...ij,jk->...ik", [(2, 3, 3, 4), (4, 5)])], ids=str)
def test_einsum_dynamic(eq, shapes, rng):
    inputs = [(f"x{i}", arr(rng, *s)) for i, s in enumerate(shapes)]
    check_op("Einsum", inputs, {"equation": eq}, weights_as="inputs", dims="dynamic")


def test_einsum_unknown_rank_with_ellipsis_is_refused(rng):
    """x reaches the Einsum through a Reshape to a shape given at run time: the ellipsis'
    width is unknown, and the error names the value and the node that computes it."""
    model = make_model([helper.make_node("Reshape", ["x", "s"], ["xr"], name="to_runtime_shape"),
                        helper.make_node("Einsum", ["xr"], ["y"], equation="...i->i"),
                        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)],
                       [vi("s", [None], TensorProto.INT64)], [vi("loss", [])], [tensor("x", arr(rng, 2, 3))])
    with pytest.raises(GradientRuleError, match="Einsum gradient needs the rank of 'xr' "
                                                r"\(computed by Reshape node 'to_runtime_shape'\)"):
        GradientGraphBuilder(model, ["x"], ["loss"], "loss").build()


@pytest.mark.parametrize("op,shapes,attrs", [
    ("MatMul", [(2, 3, 4), (4, 5)], {}),
    ("Gemm", [(4, 3), (4, 5), (5,)], {"transA": 1}),
    ("Einsum", [(2, 3, 4), (2, 4, 5)], {"equation": "bij,bjk->bik"}),
], ids=["MatMul", "Gemm", "Einsum"])
def test_float16(op, shapes, attrs, rng):
    inputs = [(f"x{i}", arr(rng, *s).astype(np.float16)) for i, s in enumerate(shapes)]
    check_op(op, inputs, attrs, opset=18, ort_rtol=1e-2, ort_atol=1e-2)


# ----------------------------------------------------------------------------- ranks known at run time


def _product_model(rng, a, b, nodes, inputs, feeds, names=("A", "B")):
    """loss = sum(flat(y) * p) for the value y that ``nodes`` compute from initializers A, B."""
    y = np.matmul(a, b)
    nodes = nodes + [helper.make_node("Reshape", ["y", "flat"], ["yf"]), helper.make_node("Mul", ["yf", "p"], ["yp"]),
                     helper.make_node("ReduceSum", ["yp"], ["loss"], keepdims=0)]
    inits = [tensor(names[0], a), tensor(names[1], b), tensor("p", rng.standard_normal(y.size).astype(f32)),
             tensor("flat", np.array([-1]))]
    return make_model(nodes, inputs, [vi("loss", [])], inits), feeds


@pytest.mark.parametrize("unknown", ["a", "b", "ab"])
@pytest.mark.parametrize("shapes", MATMUL_SHAPES, ids=str)
def test_matmul_operand_whose_rank_is_known_only_at_run_time(shapes, unknown, rng):
    """An operand reaches MatMul through a Reshape to a shape given at run time: its rank (1-D
    included) is known only then."""
    a, b = arr(rng, *shapes[0]), arr(rng, *shapes[1])
    nodes, inputs, feeds, operands = [], [], {}, []
    for name, value in (("a", a), ("b", b)):
        if name in unknown:
            nodes.append(helper.make_node("Reshape", [name.upper(), f"{name}_shape"], [f"{name}_r"]))
            inputs.append(vi(f"{name}_shape", [None], TensorProto.INT64))
            feeds[f"{name}_shape"] = np.array(value.shape, np.int64)
        operands.append(f"{name}_r" if name in unknown else name.upper())
    model, feeds = _product_model(rng, a, b, nodes + [helper.make_node("MatMul", operands, ["y"])], inputs, feeds)
    check_model(model, ["A", "B"], feeds)


@pytest.mark.parametrize("weight_first", [False, True])
@pytest.mark.parametrize("weight_shape", [(4, 3), (4,)], ids=str)
def test_matmul_after_squeeze_of_symbolic_dims(weight_shape, weight_first, rng):
    """Squeeze without axes of x[n, 1]: shape inference cannot tell whether n is 1, so the rank
    is unknown; at run time the value is 1-D. The weight may be 1-D itself."""
    x = arr(rng, 4, 1)
    w = arr(rng, *(weight_shape[::-1] if weight_first else weight_shape))
    operands = ["W", "xs"] if weight_first else ["xs", "W"]
    a, b = (w, x[:, 0]) if weight_first else (x[:, 0], w)
    model, _ = _product_model(rng, a, b, [helper.make_node("Squeeze", ["X"], ["xs"]),
                                          helper.make_node("MatMul", operands, ["y"])], [], {},
                              names=("W", "X") if weight_first else ("X", "W"))
    model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "X"))
    model.graph.input.append(vi("X", ["n", 1]))
    check_model(model, ["W", "X"], {"X": x})


def test_matmul_of_a_loop_output(rng):
    """A Loop whose body declares no shapes carries a 1-D value; MatMul reads its result."""
    body = helper.make_graph(
        [helper.make_node("Mul", ["h", "V"], ["hv"]), helper.make_node("Tanh", ["hv"], ["h2"]),
         helper.make_node("Identity", ["c"], ["c2"])], "body",
        [vi("i", [], TensorProto.INT64), vi("c", [], TensorProto.BOOL),
         helper.make_tensor_value_info("h", TensorProto.FLOAT, None)],
        [vi("c2", [], TensorProto.BOOL), helper.make_tensor_value_info("h2", TensorProto.FLOAT, None)])
    h0, w = arr(rng, 4), arr(rng, 4, 3)
    model, _ = _product_model(rng, h0, w, [helper.make_node("Loop", ["M", "", "A"], ["hT"], body=body),
                                           helper.make_node("MatMul", ["hT", "B"], ["y"])],
                              [vi("M", [], TensorProto.INT64)], {})
    model.graph.initializer.append(tensor("V", arr(rng, 4)))
    check_model(model, ["A", "B", "V"], {"M": np.array(2, np.int64)})


# ----------------------------------------------------------------------------- onnxruntime's fused transpose


@pytest.mark.parametrize("k_rank", ["1-D", "1-D at run time", "2-D at run time"])
@pytest.mark.parametrize("w_shape,perm", [((3, 2), None), ((3, 2), [1, 0]), ((2, 3, 2), [0, 2, 1])], ids=str)
def test_transposed_weight_times_vector_on_default_optimizations(w_shape, perm, k_rank, rng):
    """y = Transpose(W) @ k. onnxruntime's default optimizations fuse the Transpose into the
    MatMul and drop it when k is 1-D; once W is a graph input (as every weight of the written
    model) the Transpose is no longer folded away. Loss and gradients on onnxruntime's default
    session options against numpy and float64 finite differences."""
    w = arr(rng, *w_shape)
    k = arr(rng, 3) if k_rank != "2-D at run time" else arr(rng, 3, 2)
    nodes = [helper.make_node("Transpose", ["A"], ["At"], **({"perm": perm} if perm else {}))]
    inputs, feeds, operand = [], {}, "B"
    if k_rank != "1-D":
        nodes.append(helper.make_node("Reshape", ["B", "k_shape"], ["Br"]))
        inputs, feeds, operand = [vi("k_shape", [None], TensorProto.INT64)], {"k_shape": np.array(k.shape)}, "Br"
    wt = np.swapaxes(w, -1, -2)
    model, feeds = _product_model(rng, wt, k, nodes + [helper.make_node("MatMul", ["At", operand], ["y"])], inputs,
                                  feeds)
    next(t for t in model.graph.initializer if t.name == "A").CopyFrom(tensor("A", w))
    check_model(model, ["A", "B"], feeds)
    p = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "p"))
    built = GradientGraphBuilder(model, ["A", "B"], ["loss"], "loss").build().get_model()
    np.testing.assert_allclose(run_onnxruntime(built, feeds)["loss"], np.sum((wt @ k).reshape(-1) * p), rtol=1e-5)


# ----------------------------------------------------------------------------- Trilu


def uniform(rng, *shape):
    return rng.uniform(-3.0, 3.0, shape).astype(f32)


@pytest.mark.parametrize("opset", [14, 18])
@pytest.mark.parametrize("upper", [None, 0, 1])
@pytest.mark.parametrize("k", [None, -1, 0, 2])
def test_trilu(k, upper, opset, rng):
    attrs = {} if upper is None else {"upper": upper}
    ins = [("x", uniform(rng, 2, 3, 4))] + ([] if k is None else [("k", np.array(k))])
    check_op("Trilu", ins, attrs, opset=opset)


def test_trilu_dynamic_shape(rng):
    check_op("Trilu", [("x", uniform(rng, 4, 3)), ("k", np.array(1))], {"upper": 0}, opset=18,
             weights_as="inputs", dims="dynamic")


# ----------------------------------------------------------------------------- Det


def well_conditioned(rng, *shape, dtype=f32):
    size = shape[-1]
    return (rng.uniform(-1, 1, shape) + 2 * np.eye(size)).astype(dtype)


# opsets 13 and 18, one in float32 (also run on onnxruntime), one in float64 (gradchecked on the
# reference evaluator alone: onnxruntime's CPU provider runs Det in float32 only)
DET_FORMS = [(13, f32), (18, np.float64)]
DET_FORM_IDS = ["13-f32", "18-f64"]
DET_SHAPES = [(1, 1), (2, 2), (3, 3), (4, 4), (2, 3, 3), (2, 1, 2, 2), (3, 1, 1)]


@pytest.mark.parametrize("opset,dtype", DET_FORMS, ids=DET_FORM_IDS)
@pytest.mark.parametrize("shape", DET_SHAPES, ids=[str(s) for s in DET_SHAPES])
def test_det(shape, opset, dtype, rng):
    check_op("Det", [("x", well_conditioned(rng, *shape, dtype=dtype))], opset=opset, ort=dtype != np.float64)


def test_det_singular(rng):
    # rank 2 of 3: det = 0, but its gradient (the cofactors) is not
    x = rng.uniform(-1, 1, (3, 3))
    x[2] = x[0] + 2 * x[1]
    report = check_op("Det", [("x", x.astype(np.float64))], atol=1e-5, ort=False)  # float64: see DET_FORMS
    expected = np.array([[(-1) ** (i + j) * np.linalg.det(np.delete(np.delete(x, i, 0), j, 1))
                          for j in range(3)] for i in range(3)])
    proj = np.random.default_rng(1234).standard_normal(())  # make_op_model's projection
    np.testing.assert_allclose(report.gradients["x"], proj * expected, rtol=1e-6, atol=1e-9)
    assert np.abs(expected).max() > 1e-3


def test_det_symbolic_batch(rng):
    model, weights, feeds = make_op_model("Det", [("x", well_conditioned(rng, 2, 3, 3, 3))], weights_as="inputs")
    dims = model.graph.input[0].type.tensor_type.shape.dim
    dims[0].dim_param, dims[1].dim_param = "B", "C"
    report = gradcheck(model, weights, "loss", feeds)
    assert report.passed, str(report)
    got = ort_run(GradientGraphBuilder(model, weights, ["loss"], "loss").build().model_proto, feeds)
    np.testing.assert_allclose(got["x_grad"], report.gradients["x"], rtol=2e-3, atol=2e-3)


def test_det_dynamic_matrix_size_is_refused(rng):
    model, weights, _ = make_op_model("Det", [("x", well_conditioned(rng, 2, 3, 3))],
                                      weights_as="inputs", dims="dynamic")
    with pytest.raises(GradientRuleError, match="static"):
        GradientGraphBuilder(model, weights, ["loss"], "loss").build()


def test_det_model_checks(rng):
    model, weights, _ = make_op_model("Det", [("x", well_conditioned(rng, 2, 3, 3))], opset=13)
    built = GradientGraphBuilder(model, weights, ["loss"], "loss").build().model_proto
    onnx.checker.check_model(built, full_check=True)
