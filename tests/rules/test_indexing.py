import numpy as np
import pytest

from gradbuilder import GradientGraphBuilder
from gradbuilder.testing import check_op, make_op_model

from .harness import check_graph_ints, check_unknown_rank, ort_gradcheck

f32 = np.float32
BIG = 2**63 - 1


def arr(rng, *shape):
    return rng.standard_normal(shape).astype(f32)


# ----------------------------------------------------------------------------- harness


def grad_op_types(op, inputs, attrs=None, **kw):
    model, weights, _ = make_op_model(op, inputs, attrs, **kw)
    built = GradientGraphBuilder(model, weights, ["loss"], "loss").build().model_proto
    return [n.op_type for n in built.graph.node[len(model.graph.node):]]


# ----------------------------------------------------------------------------- Slice


SLICES = [  # (starts, ends, axes, steps) on x of shape (4, 5, 6)
    ([1], [3], None, None),
    ([1, -3], [BIG, -1], [0, 2], None),  # x[1:, :, -3:-1]
    ([-100, 2], [100, BIG], [1, -1], [1, 1]),  # clamped out-of-range starts/ends
    ([0, 0, 0], [-1, -1, -1], None, None),
    ([-1], [-BIG], [1], [-1]),  # flip
    ([3, -2], [0, -100], [0, 2], [-1, -1]),
    ([0], [BIG], [2], [2]),  # x[..., ::2]
    ([5, 1], [-BIG, 4], [-1, 0], [-2, 3]),
    ([4], [4], [1], None),  # empty
    ([2], [1], [0], [1]),  # empty, start after end
]


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("spec", SLICES)
def test_slice(spec, opset, rng):
    starts, ends, axes, steps = spec
    inputs = [("x", arr(rng, 4, 5, 6)), ("s", np.array(starts)), ("e", np.array(ends))]
    if axes is not None or steps is not None:
        inputs.append(("a", np.array(axes if axes is not None else list(range(len(starts))))))
    if steps is not None:
        inputs.append(("t", np.array(steps)))
    check_op("Slice", inputs, opset=opset)


@pytest.mark.parametrize("spec", SLICES)
def test_slice_dynamic_dims(spec, rng):
    starts, ends, axes, steps = spec
    axes = axes if axes is not None else list(range(len(starts)))
    steps = steps if steps is not None else [1] * len(starts)
    check_op("Slice", [("x", arr(rng, 4, 5, 6)), ("s", np.array(starts)), ("e", np.array(ends)),
                       ("a", np.array(axes)), ("t", np.array(steps))], opset=13, weights_as="inputs", dims="dynamic")


def test_slice_int32_bounds(rng):
    check_op("Slice", [("x", arr(rng, 4, 5)), ("s", np.array([-3], np.int32)), ("e", np.array([5], np.int32)),
                       ("a", np.array([1], np.int32))], opset=13, weights_as="inputs", dims="dynamic")


@pytest.mark.parametrize("graph_ints", [["s", "e"], ["e"], ["a"], ["t"], ["s", "e", "a", "t"]])
@pytest.mark.parametrize("steps", [[1, 1], [-1, 2]])
def test_slice_bounds_at_run_time(graph_ints, steps, rng):
    """starts/ends/axes/steps as integer graph inputs: computed at run time."""
    check_graph_ints("Slice", [("x", arr(rng, 4, 5, 6)), ("s", np.array([-2, 1])), ("e", np.array([-BIG, BIG])),
                               ("a", np.array([0, -1])), ("t", np.array(steps))],
                     graph_ints=graph_ints, opset=13, weights_as="inputs", dims="dynamic")


def test_slice_unit_steps_use_pad(rng):
    types = grad_op_types("Slice", [("x", arr(rng, 4, 5)), ("s", np.array([-1, 1])), ("e", np.array([-BIG, BIG])),
                                    ("a", np.array([0, 1])), ("t", np.array([-1, 1]))], opset=13)
    assert "Pad" in types and "ScatterElements" not in types


# ----------------------------------------------------------------------------- Gather


GATHERS = [  # (x shape, indices, axis)
    ((5, 3), np.array([[0, 2, 2], [4, 0, 2]]), 0),  # embedding lookup with repeats
    ((5, 3), np.array([1, -1, 4, -5]), 0),  # negative indices, -1 == 4 and -5 == 0 repeat
    ((2, 4, 3), np.array([3, 0, 3, 3]), 1),
    ((2, 4, 3), np.array([[2], [0]]), -1),
    ((2, 4, 3), np.array([-1, 0, 1]), 2),  # unique
    ((2, 4, 3), np.array(0), 1),  # x[:, 0]
    ((2, 4, 3), np.array(-1), -1),  # x[..., -1]
    ((4,), np.array(2), 0),
    ((4,), np.array([[1, 1], [3, 1]]), 0),
]


@pytest.mark.parametrize("opset", [13, 16, 18])
@pytest.mark.parametrize("case", GATHERS)
def test_gather(case, opset, rng):
    shape, idx, axis = case
    check_op("Gather", [("x", arr(rng, *shape)), ("i", idx)], {"axis": axis}, opset=opset)


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("case", GATHERS)
def test_gather_dynamic_dims(case, opset, rng):
    shape, idx, axis = case
    check_op("Gather", [("x", arr(rng, *shape)), ("i", idx)], {"axis": axis}, opset=opset,
             weights_as="inputs", dims="dynamic")


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("case", [GATHERS[0], GATHERS[1], GATHERS[2], GATHERS[5], GATHERS[6]])
def test_gather_indices_at_run_time(case, opset, rng):
    shape, idx, axis = case
    check_graph_ints("Gather", [("x", arr(rng, *shape)), ("i", idx)], {"axis": axis}, graph_ints=["i"],
                     opset=opset, weights_as="inputs", dims="dynamic")


def test_gather_int32_indices(rng):
    check_op("Gather", [("x", arr(rng, 5, 3)), ("i", np.array([[4, -1], [0, 0]], np.int32))], {"axis": 0}, opset=13)


def test_gather_embedding_many_repeats(rng):
    tokens = rng.integers(0, 6, (4, 7))
    for opset in (13, 18):
        check_op("Gather", [("w", arr(rng, 6, 4)), ("tokens", tokens)], {"axis": 0}, opset=opset)


def test_gather_float16(rng):
    check_op("Gather", [("w", arr(rng, 6, 4).astype(np.float16)), ("i", np.array([[1, 1, 5], [5, 0, 1]]))],
             {"axis": 0}, opset=18, ort_rtol=1e-2, ort_atol=1e-2)


def test_gather_accumulation_by_opset(rng):
    """Repeats: a sorted segment sum from opset 16 (the rule's ScatterND add, which races on
    onnxruntime's threads, rewritten), one-hot MatMul before; unique indices: plain ScatterND."""
    repeated = [("x", arr(rng, 5, 3)), ("i", np.array([1, 1, 2]))]
    unique = [("x", arr(rng, 5, 3)), ("i", np.array([1, -1, 2]))]
    assert "MatMul" in grad_op_types("Gather", repeated, opset=13)
    narrow = set(grad_op_types("Gather", repeated, opset=16))  # rows 3 wide: a ScatterElements, in order
    assert "ScatterElements" in narrow and "ScatterND" not in narrow
    wide = set(grad_op_types("Gather", [("x", arr(rng, 5, 8)), ("i", np.array([1, 1, 2]))], opset=16))
    assert {"TopK", "CumSum"} <= wide and "ScatterND" not in wide  # rows 8 wide: sorted
    assert "MatMul" not in grad_op_types("Gather", unique, opset=13)
    assert "ScatterND" in grad_op_types("Gather", unique, opset=13)


# ----------------------------------------------------------------------------- GatherElements


def _elements_cases(rng):
    return [
        ((3, 4), rng.integers(0, 3, (3, 4)), 0),
        ((3, 4), rng.integers(-4, 4, (3, 4)), 1),
        ((3, 4), np.array([[0], [3], [-1]]), 1),  # torch.gather of one target per row
        ((2, 3, 4), rng.integers(-3, 3, (2, 5, 4)), -2),  # more indices than the axis holds
        ((2, 3, 4), np.argsort(rng.random((2, 3, 4)), axis=2), 2),  # a permutation: unique
    ]


@pytest.mark.parametrize("opset", [13, 16, 18])
@pytest.mark.parametrize("k", range(5))
def test_gather_elements(k, opset, rng):
    shape, idx, axis = _elements_cases(rng)[k]
    check_op("GatherElements", [("x", arr(rng, *shape)), ("i", idx)], {"axis": axis}, opset=opset)


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("k", range(5))
def test_gather_elements_dynamic(k, opset, rng):
    shape, idx, axis = _elements_cases(rng)[k]
    check_op("GatherElements", [("x", arr(rng, *shape)), ("i", idx)], {"axis": axis}, opset=opset,
             weights_as="inputs", dims="dynamic")
    check_graph_ints("GatherElements", [("x", arr(rng, *shape)), ("i", idx)], {"axis": axis}, graph_ints=["i"],
                     opset=opset, weights_as="inputs", dims="dynamic")


@pytest.mark.parametrize("opset", [13, 18])
def test_gather_elements_indices_smaller_than_x(opset, rng):
    """onnxruntime (like torch.gather) accepts indices shorter than x on the other axes."""
    ort_gradcheck("GatherElements", [("x", arr(rng, 3, 4)), ("i", np.array([[0, 3, 3], [-1, 1, 1]]))],
                  {"axis": 1}, opset=opset)


def test_gather_elements_float16(rng):
    check_op("GatherElements", [("x", arr(rng, 3, 4).astype(np.float16)), ("i", rng.integers(0, 4, (3, 4)))],
             {"axis": 1}, opset=18, ort_rtol=1e-2, ort_atol=1e-2)


# ----------------------------------------------------------------------------- GatherND


ND = [  # (x shape, indices, batch_dims)
    ((3, 4), np.array([[0, 1], [2, -1], [0, 1]]), 0),  # element tuples, one repeated
    ((3, 4), np.array([[1], [-1], [1]]), 0),  # row slices
    ((3, 4, 2), np.array([[[0, 1], [2, 3]], [[2, 3], [1, 0]]]), 0),
    ((3, 4, 2), np.array([[[1], [2], [1]], [[0], [0], [-1]], [[3], [3], [3]]]), 1),
    ((3, 4, 2), np.array([[1, 1], [3, 0], [1, 1]]), 1),
    ((2, 3, 4), np.array([[[1], [1], [3]], [[0], [-1], [2]]]), 2),
    ((3, 4), np.array([[0, 1], [2, 3]]), 0),  # unique
]


@pytest.mark.parametrize("opset", [13, 16, 18])
@pytest.mark.parametrize("case", ND)
def test_gather_nd(case, opset, rng):
    shape, idx, batch_dims = case
    check_op("GatherND", [("x", arr(rng, *shape)), ("i", idx)], {"batch_dims": batch_dims}, opset=opset)


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("case", ND)
def test_gather_nd_dynamic(case, opset, rng):
    shape, idx, batch_dims = case
    check_op("GatherND", [("x", arr(rng, *shape)), ("i", idx)], {"batch_dims": batch_dims}, opset=opset,
             weights_as="inputs", dims="dynamic")
    check_graph_ints("GatherND", [("x", arr(rng, *shape)), ("i", idx)], {"batch_dims": batch_dims},
                     graph_ints=["i"], static_last=True, opset=opset, weights_as="inputs", dims="dynamic")


# ----------------------------------------------------------------------------- unknown rank


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("op,inputs,attrs", [
    ("Gather", [("x", np.ones((2, 4, 3), f32)), ("i", np.array(1))], {"axis": 1}),
    ("Gather", [("x", np.ones((2, 4, 3), f32)), ("i", np.array(-1))], {"axis": -1}),
    ("Gather", [("x", np.ones((2, 4, 3), f32)), ("i", np.array([[0, 3], [3, 3]]))], {"axis": 1}),
    ("Gather", [("x", np.ones((2, 4, 3), f32)), ("i", np.array([2, 2, 0]))], {"axis": -1}),
    ("Gather", [("x", np.ones((5, 3), f32)), ("i", np.array([4, 1, 4]))], {}),
    ("GatherND", [("x", np.ones((3, 4, 2), f32)), ("i", np.array([[1, 1], [3, 0], [1, 1]]))], {"batch_dims": 1}),
    ("GatherND", [("x", np.ones((3, 4), f32)), ("i", np.array([[0, 1], [2, -1], [0, 1]]))], {}),
    ("GatherElements", [("x", np.ones((3, 4), f32)), ("i", np.array([[0, 3], [1, 1], [3, 3]]))], {"axis": 1}),
    ("Slice", [("x", np.ones((4, 5), f32)), ("s", np.array([-1, 0])), ("e", np.array([-BIG, BIG])),
               ("a", np.array([0, -1])), ("t", np.array([-1, 2]))], {}),
    ("Slice", [("x", np.ones((4, 5), f32)), ("s", np.array([1])), ("e", np.array([-1])), ("a", np.array([-1]))], {}),
])
def test_unknown_rank(op, inputs, attrs, opset, rng):
    inputs = [(n, rng.standard_normal(a.shape).astype(f32) if a.dtype == f32 else a) for n, a in inputs]
    check_unknown_rank(op, inputs, attrs, opset=opset)
