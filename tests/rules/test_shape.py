import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradbuilder.errors import GradientRuleError
from gradbuilder.testing import check_model, check_op, make_op_model, numeric_gradient, ort_grad_session

from .harness import check_graph_ints, check_unknown_rank, ort_gradcheck

f32 = np.float32


def arr(rng, *shape):
    return rng.standard_normal(shape).astype(f32)


# ----------------------------------------------------------------------------- harness


# ----------------------------------------------------------------------------- reshapes


@pytest.mark.parametrize("opset", [13, 14, 18])
@pytest.mark.parametrize("shape", [[0, -1], [-1], [0, 4, -1], [2, 0, 2, -1], [24]])
def test_reshape(shape, opset, rng):
    check_op("Reshape", [("x", arr(rng, 2, 3, 4)), ("s", np.array(shape))], opset=opset)


@pytest.mark.parametrize("dims", ["symbolic", "dynamic"])
def test_reshape_dynamic(dims, rng):
    check_op("Reshape", [("x", arr(rng, 2, 3, 4)), ("s", np.array([0, -1, 2]))], opset=14,
             weights_as="inputs", dims=dims)


def test_reshape_allowzero(rng):
    check_op("Reshape", [("x", arr(rng, 2, 3, 4)), ("s", np.array([4, 6]))], {"allowzero": 1}, opset=18,
             weights_as="inputs", dims="dynamic")


def test_reshape_shape_given_at_run_time(rng):
    check_graph_ints("Reshape", [("x", arr(rng, 2, 3, 4)), ("s", np.array([3, -1]))], graph_ints=["s"], opset=13,
                     weights_as="inputs", dims="dynamic")


@pytest.mark.parametrize("axis", [0, 1, 2, 3, -1, -3])
@pytest.mark.parametrize("dims", ["static", "dynamic"])
def test_flatten(axis, dims, rng):
    check_op("Flatten", [("x", arr(rng, 2, 3, 2, 2))], {"axis": axis}, opset=13, weights_as="inputs", dims=dims)


@pytest.mark.parametrize("perm", [None, [0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 2, 1]])
@pytest.mark.parametrize("dims", ["static", "dynamic"])
def test_transpose(perm, dims, rng):
    attrs = {} if perm is None else {"perm": perm}
    check_op("Transpose", [("x", arr(rng, 2, 3, 4))], attrs, opset=13, weights_as="inputs", dims=dims)


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("axes", [None, [1], [-1, 0], [-4]])
@pytest.mark.parametrize("dims", ["static", "dynamic"])
def test_squeeze(axes, opset, dims, rng):
    inputs = [("x", arr(rng, 1, 3, 2, 1))]
    if axes is not None:
        x = inputs[0][1]
        inputs = [("x", x.reshape(3, 1, 2, 1) if axes == [1] else x), ("axes", np.array(axes))]
    check_op("Squeeze", inputs, opset=opset, weights_as="inputs", dims=dims)


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("axes", [[0], [-1], [1, -1], [3, 0]])
@pytest.mark.parametrize("dims", ["static", "dynamic"])
def test_unsqueeze(axes, opset, dims, rng):
    check_op("Unsqueeze", [("x", arr(rng, 3, 2)), ("axes", np.array(axes))], opset=opset,
             weights_as="inputs", dims=dims)


@pytest.mark.parametrize("shapes", [((3, 4), (3, 4)), ((3, 1), (2, 3, 4)), ((), (2, 3)), ((4,), (2, 4)),
                                    ((2, 1, 4), (1, 3, 1))])
@pytest.mark.parametrize("dims", ["static", "dynamic"])
def test_expand(shapes, dims, rng):
    x_shape, target = shapes
    check_op("Expand", [("x", arr(rng, *x_shape)), ("s", np.array(target, dtype=np.int64))], opset=13,
             weights_as="inputs", dims=dims)


# ----------------------------------------------------------------------------- Concat / Split


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("axis", [0, 1, -1, -3])
@pytest.mark.parametrize("dims", ["static", "dynamic"])
def test_concat(axis, opset, dims, rng):
    shapes = [[2, 3, 4], [2, 3, 4], [2, 3, 4]]
    for i, s in enumerate(shapes):
        s[axis] = i + 1
    inputs = [(f"x{i}", arr(rng, *s)) for i, s in enumerate(shapes)]
    check_op("Concat", inputs, {"axis": axis}, opset=opset, weights_as="inputs", dims=dims)


def test_concat_of_weights_and_a_constant(rng):
    inputs = [("a", arr(rng, 2, 3)), ("c", arr(rng, 1, 3)), ("b", arr(rng, 4, 3))]
    check_op("Concat", inputs, {"axis": 0}, opset=18, wrt=["a", "b"])


def test_concat_single_input(rng):
    check_op("Concat", [("x", arr(rng, 2, 3))], {"axis": 1}, opset=13)


@pytest.mark.parametrize("dims", ["static", "dynamic"])
@pytest.mark.parametrize("split,axis", [([1, 2, 1], 1), ([2, 2], -1), ([3, 0, 1], 2)])
def test_split_sizes(split, axis, dims, rng):
    for opset in (13, 18):
        check_op("Split", [("x", arr(rng, 2, 4, 4)), ("s", np.array(split))], {"axis": axis},
                 num_outputs=len(split), opset=opset, weights_as="inputs", dims=dims)


@pytest.mark.parametrize("dims", ["static", "dynamic"])
def test_split_equal_opset13(dims, rng):
    """qkv-style: no split input, equal chunks."""
    check_op("Split", [("x", arr(rng, 2, 3, 6))], {"axis": -1}, num_outputs=3, opset=13,
             weights_as="inputs", dims=dims)


@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize("dims", ["static", "dynamic"])
def test_split_num_outputs_opset18(parts, dims, rng):
    """num_outputs; 7 elements give an uneven last chunk for 2, 3 and 4 parts."""
    check_op("Split", [("x", arr(rng, 2, 7))], {"axis": 1, "num_outputs": parts}, num_outputs=parts, opset=18,
             weights_as="inputs", dims=dims)


def _drop_from_loss(model, outputs):
    """Remove the projections of ``outputs`` from the loss of a make_op_model model."""
    g = model.graph
    dead = {f"{o}_m" for o in outputs} | {f"{o}_s" for o in outputs}
    keep = [n for n in g.node if not set(n.output) & dead]
    for n in keep:
        if n.op_type == "Sum":
            terms = [t for t in n.input if t not in dead]
            n.op_type = "Sum" if len(terms) > 1 else "Identity"
            del n.input[:]
            n.input.extend(terms)
    del g.node[:]
    g.node.extend(keep)
    return model


@pytest.mark.parametrize("dims", ["static", "dynamic"])
@pytest.mark.parametrize("unused", [["y1"], ["y0", "y2"]])
def test_split_outputs_without_gradient(unused, dims, rng):
    model, weights, feeds = make_op_model("Split", [("x", arr(rng, 3, 7))], {"axis": 1, "num_outputs": 3},
                                          num_outputs=3, opset=18, weights_as="inputs", dims=dims)
    check_model(_drop_from_loss(model, unused), weights, feeds)


# ----------------------------------------------------------------------------- Tile


@pytest.mark.parametrize("shape,repeats", [((2, 3), (2, 1)), ((2, 3), (3, 2)), ((3,), (4,)), ((2, 1, 3), (1, 3, 2)),
                                           ((2, 3), (1, 1))])
@pytest.mark.parametrize("dims", ["static", "dynamic"])
def test_tile(shape, repeats, dims, rng):
    check_op("Tile", [("x", arr(rng, *shape)), ("r", np.array(repeats))], opset=13, weights_as="inputs", dims=dims)


def test_tile_repeats_at_run_time(rng):
    check_graph_ints("Tile", [("x", arr(rng, 2, 3)), ("r", np.array([2, 3]))], graph_ints=["r"], opset=13,
                     weights_as="inputs", dims="dynamic")


# ----------------------------------------------------------------------------- Pad


PADS = [[1, 0, 2, 0, 2, 1], [0, 0, 1, 0, 0, 0], [0, 2, 0, 1, 0, 3], [0, 0, 0, 0, 0, 0]]  # x is (2, 3, 4)


@pytest.mark.parametrize("mode", ["constant", "edge", "reflect"])
@pytest.mark.parametrize("pads", PADS)
@pytest.mark.parametrize("opset", [13, 18])
def test_pad_modes(mode, pads, opset, rng):
    check_op("Pad", [("x", arr(rng, 2, 3, 4)), ("p", np.array(pads))], {"mode": mode}, opset=opset)


@pytest.mark.parametrize("mode", ["constant", "edge", "reflect", "wrap"])
@pytest.mark.parametrize("pads", PADS[:3])
def test_pad_modes_opset19(mode, pads, rng):
    check_op("Pad", [("x", arr(rng, 2, 3, 4)), ("p", np.array(pads))], {"mode": mode}, opset=19,
             weights_as="inputs", dims="dynamic")


@pytest.mark.parametrize("pads", [[7, 9], [4, 0], [0, 5], [3, 3]])
def test_pad_wrap_several_periods(pads, rng):
    """wrap borders longer than the axis repeat it several times."""
    check_op("Pad", [("x", arr(rng, 2, 3)), ("p", np.array(pads)), ("v", None), ("a", np.array([-1]))],
             {"mode": "wrap"}, opset=19)


@pytest.mark.parametrize("mode", ["constant", "edge", "reflect"])
@pytest.mark.parametrize("axes", [[1], [-1, 0], [2, -2]])
@pytest.mark.parametrize("dims", ["static", "dynamic"])
def test_pad_axes_opset18(mode, axes, dims, rng):
    pads = {1: [1, 2], 2: [2, 1, 1, 0]}[len(axes)]
    check_op("Pad", [("x", arr(rng, 2, 3, 4)), ("p", np.array(pads)), ("v", None), ("a", np.array(axes))],
             {"mode": mode}, opset=18, weights_as="inputs", dims=dims)


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("value_shape", [(), (1,)])
def test_pad_constant_value_gradient(opset, value_shape, rng):
    value = np.full(value_shape, 0.5, dtype=f32)
    check_op("Pad", [("x", arr(rng, 2, 3, 4)), ("p", np.array([1, 0, 2, 0, 3, 1])), ("v", value)],
             {"mode": "constant"}, opset=opset)


def test_pad_constant_value_gradient_dynamic(rng):
    check_op("Pad", [("x", arr(rng, 2, 3)), ("p", np.array([1, 2, 0, 1])), ("v", np.array(0.5, f32))],
             {"mode": "constant"}, opset=13, weights_as="inputs", dims="dynamic")


@pytest.mark.filterwarnings("ignore:these weights do not reach the loss")
@pytest.mark.parametrize("mode", ["edge", "reflect"])
def test_pad_constant_value_unused_in_other_modes(mode, rng):
    check_op("Pad", [("x", arr(rng, 2, 3)), ("p", np.array([1, 1, 1, 1])), ("v", np.array(0.5, f32))],
             {"mode": mode}, opset=13)


@pytest.mark.parametrize("mode", ["constant", "edge", "reflect", "wrap"])
def test_pad_pads_at_run_time(mode, rng):
    check_graph_ints("Pad", [("x", arr(rng, 2, 3, 4)), ("p", np.array([1, 0, 2, 0, 2, 1]))], {"mode": mode},
                     graph_ints=["p"], opset=19, weights_as="inputs", dims="dynamic")


@pytest.mark.parametrize("mode", ["constant", "edge", "reflect", "wrap"])
def test_pad_axes_at_run_time(mode, rng):
    check_graph_ints("Pad", [("x", arr(rng, 2, 3, 4)), ("p", np.array([2, 1, 1, 0])), ("v", None),
                             ("a", np.array([-1, 1]))], {"mode": mode}, graph_ints=["a"], opset=19)


@pytest.mark.parametrize("mode", ["constant", "edge", "reflect", "wrap"])
@pytest.mark.parametrize("pads", [[0, -1, 0, 2], [-1, 1, 1, -2], [0, 0, -2, -1], [1, -1, -1, 2]])
def test_pad_negative_pads_crop(mode, pads, rng):
    """Negative pads crop x first (onnx's reference evaluator cannot run them: onnxruntime)."""
    ort_gradcheck("Pad", [("x", arr(rng, 3, 4)), ("p", np.array(pads))], {"mode": mode}, opset=19)


@pytest.mark.parametrize("mode", ["constant", "edge", "reflect", "wrap"])
def test_pad_negative_pads_at_run_time(mode, rng):
    ort_gradcheck("Pad", [("x", arr(rng, 3, 4)), ("p", np.array([-1, 1, 1, -2]))], {"mode": mode}, opset=19,
                  graph_ints=["p"])


def test_pad_negative_pads_constant_value(rng):
    ort_gradcheck("Pad", [("x", arr(rng, 3, 4)), ("p", np.array([-1, 2, 1, -2])), ("v", np.array(0.3, f32))],
                  {"mode": "constant"}, opset=13)


def test_pad_float16(rng):
    x = arr(rng, 2, 3, 4).astype(np.float16)
    check_op("Pad", [("x", x), ("p", np.array([1, 0, 2, 0, 2, 1]))], {"mode": "reflect"}, opset=18,
             ort_rtol=1e-2, ort_atol=1e-2)



# ----------------------------------------------------------------------------- unknown rank


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("op,inputs,attrs", [
    ("Reshape", [("x", np.ones((2, 3, 4), f32)), ("s", np.array([0, -1]))], {}),
    ("Flatten", [("x", np.ones((2, 3, 4), f32))], {"axis": 2}),
    ("Transpose", [("x", np.ones((2, 3, 4), f32))], {"perm": [2, 0, 1]}),
    ("Transpose", [("x", np.ones((2, 3, 4), f32))], {}),
    ("Squeeze", [("x", np.ones((2, 1, 4), f32))], {}),
    ("Squeeze", [("x", np.ones((2, 1, 4), f32)), ("a", np.array([-2]))], {}),
    ("Unsqueeze", [("x", np.ones((2, 4), f32)), ("a", np.array([-1]))], {}),
    ("Expand", [("x", np.ones((3, 1), f32)), ("s", np.array([2, 3, 4]))], {}),
    ("Concat", [("x", np.ones((2, 3), f32)), ("c", np.ones((2, 2), f32))], {"axis": -1}),
    ("Tile", [("x", np.ones((2, 3), f32)), ("r", np.array([2, 3]))], {}),
    ("Pad", [("x", np.ones((2, 3), f32)), ("p", np.array([1, 0, 0, 2]))], {"mode": "reflect"}),
    ("Pad", [("x", np.ones((2, 3), f32)), ("p", np.array([1, 0, 0, 2]))], {"mode": "constant"}),
])
def test_unknown_rank(op, inputs, attrs, opset, rng):
    inputs = [(n, rng.standard_normal(a.shape).astype(f32) if a.dtype == f32 else a) for n, a in inputs]
    check_unknown_rank(op, inputs, attrs, opset=opset)


@pytest.mark.parametrize("opset", [13, 18])
def test_split_unknown_rank(opset, rng):
    check_unknown_rank("Split", [("x", arr(rng, 2, 6)), ("s", np.array([2, 4]))], {"axis": -1}, opset=opset,
                       num_outputs=2)


def _pad_of_unknown_rank(rng, pads, axes=None, value=None, opset=18, mode="constant", dtype=f32):
    """x[2, 3, 4] reshaped to a shape given at run time (no rank known), then Pad with pads
    (and axes) given at run time too; loss = sum(flat(y) * p)."""
    x = rng.standard_normal((2, 3, 4)).astype(dtype)
    elem = TensorProto.FLOAT if dtype == f32 else TensorProto.DOUBLE
    pad_axes = list(range(3)) if axes is None else [a % 3 for a in axes]
    out = list(x.shape)
    for i, a in enumerate(pad_axes):
        out[a] += pads[i] + pads[len(pad_axes) + i]
    ins = ["xr", "pads", "v" if value is not None else "", "axes" if axes is not None else ""]
    while not ins[-1]:
        ins.pop()
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["xr"]), helper.make_node("Pad", ins, ["y"], mode=mode),
             helper.make_node("Reshape", ["y", "flat"], ["yf"]), helper.make_node("Mul", ["yf", "p"], ["yp"]),
             helper.make_node("ReduceSum", ["yp"], ["loss"], keepdims=0)]
    inits = [numpy_helper.from_array(x, "x"), numpy_helper.from_array(np.array([-1]), "flat"),
             numpy_helper.from_array(rng.standard_normal(int(np.prod(out))).astype(dtype), "p")]
    if value is not None:
        inits.append(numpy_helper.from_array(np.array(value, dtype), "v"))
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, [None]) for n in ("shape", "pads")]
    feeds = {"shape": np.array(x.shape), "pads": np.array(pads)}
    if axes is not None:
        inputs.append(helper.make_tensor_value_info("axes", TensorProto.INT64, [None]))
        feeds["axes"] = np.array(axes)
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("loss", elem, [])],
                                                inits), opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model, ["x"] + (["v"] if value is not None else []), feeds


@pytest.mark.parametrize("pads,axes,value,opset", [
    ([1, 0, 2, 0, 2, 1], None, None, 13),
    ([1, 0, 2, 0, 2, 1], None, 0.5, 18),
    ([2, 1, 0, 1], [-1, 0], 0.3, 18),
], ids=str)
def test_pad_of_unknown_rank_with_pads_given_at_run_time(pads, axes, value, opset, rng):
    model, weights, feeds = _pad_of_unknown_rank(rng, pads, axes, value, opset)
    check_model(model, weights, feeds)


@pytest.mark.parametrize("pads,axes", [([-1, 2, 0, 1, -2, 1], None), ([-1, 1, 0, -2], [1, 2])], ids=str)
def test_pad_of_unknown_rank_that_crops(pads, axes, rng):
    """Negative pads crop (onnx's reference evaluator cannot run them): float64 finite
    differences on onnxruntime."""
    model, weights, feeds = _pad_of_unknown_rank(rng, pads, axes, 0.7, 18, dtype=np.float64)
    base = {"x": numpy_helper.to_array(model.graph.initializer[0]), "v": np.array(0.7)}
    sess, got = ort_grad_session(model, weights, {**feeds, **base})
    for w in weights:
        num = numeric_gradient(lambda v: sess.run(["loss"], {**feeds, **base, w: v})[0], base[w], 1e-6)
        np.testing.assert_allclose(got[f"{w}_grad"], num, rtol=1e-5, atol=1e-7)


def test_pad_reflect_of_unknown_rank_is_refused_naming_the_value(rng):
    from gradbuilder import GradientGraphBuilder

    model, weights, _ = _pad_of_unknown_rank(rng, [1, 0, 2, 0, 2, 1], mode="reflect")
    with pytest.raises(GradientRuleError, match=r"Pad \(mode 'reflect'\) gradient needs the rank of 'xr' "
                                                r"\(computed by an unnamed Reshape node\)"):
        GradientGraphBuilder(model, weights, ["loss"], "loss").build()


# ----------------------------------------------------------------------------- ReverseSequence


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("shape,attrs,lens", [
    ((4, 3, 2), {}, np.array([4, 1, 2])),  # time 0, batch 1 (the defaults)
    ((3, 4, 2), {"batch_axis": 0, "time_axis": 1}, np.array([2, 4, 3])),
    ((3, 5), {"batch_axis": 0, "time_axis": 1}, np.array([1, 5, 0], np.int64)),
])
def test_reverse_sequence(shape, attrs, lens, opset, rng):
    check_op("ReverseSequence", [("x", arr(rng, *shape)), ("lens", lens)], attrs, opset=opset)
    check_op("ReverseSequence", [("x", arr(rng, *shape)), ("lens", lens)], attrs, opset=opset,
             weights_as="inputs", dims="dynamic")
