import numpy as np
import pytest

from gradbuilder.errors import GradientRuleError
from gradbuilder.testing import check_op, make_op_model

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
    from gradbuilder import GradientGraphBuilder

    model, weights, _ = make_op_model("Einsum", [("x0", arr(rng, 2, 3))], {"equation": "...i->i"},
                                      weights_as="inputs")
    del model.graph.input[0].type.tensor_type.shape.dim[:]
    model.graph.input[0].type.tensor_type.ClearField("shape")
    with pytest.raises(GradientRuleError, match="rank"):
        GradientGraphBuilder(model, weights, ["loss"], "loss").build()


@pytest.mark.parametrize("op,shapes,attrs", [
    ("MatMul", [(2, 3, 4), (4, 5)], {}),
    ("Gemm", [(4, 3), (4, 5), (5,)], {"transA": 1}),
    ("Einsum", [(2, 3, 4), (2, 4, 5)], {"equation": "bij,bjk->bik"}),
], ids=["MatMul", "Gemm", "Einsum"])
def test_float16(op, shapes, attrs, rng):
    inputs = [(f"x{i}", arr(rng, *s).astype(np.float16)) for i, s in enumerate(shapes)]
    check_op(op, inputs, attrs, opset=18, ort_rtol=1e-2, ort_atol=1e-2)
