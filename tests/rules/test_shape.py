import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradbuilder import GradientGraphBuilder
from gradbuilder.testing import check_op, gradcheck, make_op_model

f32 = np.float32


def arr(rng, *shape):
    return rng.standard_normal(shape).astype(f32)


# ----------------------------------------------------------------------------- harness


def _ort_grads(model, weights, feeds):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    built = GradientGraphBuilder(model, weights=weights, outputs=["loss"], loss="loss").build().get_model()
    sess = ort.InferenceSession(built, so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    run_feeds = {i.name: feeds[i.name] for i in sess.get_inputs() if i.name in feeds}
    return sess, dict(zip(names, sess.run(None, run_feeds)))


def check_model(model, weights, feeds):
    """gradcheck (float64, reference evaluator) plus the float32 graph on onnxruntime."""
    report = gradcheck(model, weights, "loss", feeds)
    assert report.passed, str(report)
    _, got = _ort_grads(model, weights, feeds)
    for w in weights:
        ref = report.gradients[w]
        np.testing.assert_allclose(got[f"{w}_grad"], ref, rtol=2e-3, atol=2e-4 * max(1.0, np.abs(ref).max()))


def check_graph_ints(op, inputs, attrs=None, *, graph_ints, opset, num_outputs=1, **kw):
    """check_op, with the integer inputs ``graph_ints`` as graph inputs of unknown size
    (not constants) so that the rule must read them at run time."""
    model, weights, feeds = make_op_model(op, inputs, attrs, opset=opset, num_outputs=num_outputs, **kw)
    for t in list(model.graph.initializer):
        if t.name in graph_ints:
            value = numpy_helper.to_array(t)
            model.graph.initializer.remove(t)
            model.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, [None] * value.ndim))
            feeds[t.name] = value
    check_model(model, weights, feeds)


def check_unknown_rank(op, inputs, attrs=None, *, opset, num_outputs=1):
    """The first float input reaches the op through a Reshape to a shape given at run time,
    so shape inference knows neither its dims nor its rank (as in torch's exported
    multi-head attention); the op's outputs are flattened before the loss."""
    model, weights, _ = make_op_model(op, inputs, attrs, opset=opset, num_outputs=num_outputs)
    w = weights[0]
    inits = {t.name: t for t in model.graph.initializer}
    node = model.graph.node[0]
    node.input[list(node.input).index(w)] = f"{w}_r"
    nodes = [helper.make_node("Reshape", [w, "shape"], [f"{w}_r"]), node]
    terms = []
    for i in range(num_outputs):
        proj = numpy_helper.to_array(inits.pop(f"y{i}_proj")).reshape(-1)
        inits[f"p{i}"] = numpy_helper.from_array(proj, f"p{i}")
        nodes += [helper.make_node("Reshape", [f"y{i}", "flat"], [f"f{i}"]),
                  helper.make_node("Mul", [f"f{i}", f"p{i}"], [f"m{i}"]),
                  helper.make_node("ReduceSum", [f"m{i}"], [f"s{i}"], keepdims=0)]
        terms.append(f"s{i}")
    nodes.append(helper.make_node("Sum", terms, ["loss"]))
    inits["flat"] = numpy_helper.from_array(np.array([-1]), "flat")
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("shape", TensorProto.INT64, [None])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], list(inits.values()))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    feeds = {"shape": np.array(numpy_helper.to_array(inits[w]).shape, dtype=np.int64)}
    report = gradcheck(model, weights, "loss", feeds)
    assert report.passed, str(report)
    _, got = _ort_grads(model, weights, feeds)
    for name in weights:
        ref = report.gradients[name]
        np.testing.assert_allclose(got[f"{name}_grad"], ref, rtol=2e-3, atol=2e-4 * max(1.0, np.abs(ref).max()))


def ort_gradcheck(op, inputs, attrs=None, *, opset, graph_ints=(), eps=1e-6):
    """Gradcheck on onnxruntime alone (float64), for op forms onnx's reference evaluator
    cannot run (negative pads). ``inputs``: (name, array); float arrays are the weights,
    integer arrays constants, or graph inputs of unknown size when named in ``graph_ints``."""
    ints = {n: a for n, a in inputs if a is not None and a.dtype.kind != "f"}
    floats = {n: a.astype(np.float64) for n, a in inputs if a is not None and a.dtype.kind == "f"}
    node = helper.make_node(op, [n if a is not None else "" for n, a in inputs], ["y"], **dict(attrs or {}))
    vi = [helper.make_tensor_value_info(n, TensorProto.DOUBLE, list(a.shape)) for n, a in floats.items()]
    vi += [helper.make_tensor_value_info(n, TensorProto.INT64, [None] * a.ndim) for n, a in ints.items() if n in graph_ints]
    inits = [numpy_helper.from_array(a, n) for n, a in ints.items() if n not in graph_ints]
    feeds = {**floats, **{n: a for n, a in ints.items() if n in graph_ints}}
    probe = helper.make_model(helper.make_graph([node], "p", vi, [helper.make_empty_tensor_value_info("y")], inits),
                              opset_imports=[helper.make_opsetid("", opset)])
    probe.ir_version = 10
    y = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    proj = np.random.default_rng(7).standard_normal(y.shape)
    nodes = [node, helper.make_node("Mul", ["y", "proj"], ["m"]), helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0)]
    model = helper.make_model(
        helper.make_graph(nodes, "g", vi, [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
                          inits + [numpy_helper.from_array(proj, "proj")]),
        opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    sess, got = _ort_grads(model, list(floats), feeds)
    for w, base in floats.items():
        num = np.zeros_like(base)
        for i in range(base.size):
            plus, minus = base.copy().reshape(-1), base.copy().reshape(-1)
            plus[i] += eps
            minus[i] -= eps
            lp = sess.run(["loss"], {**feeds, w: plus.reshape(base.shape)})[0]
            lm = sess.run(["loss"], {**feeds, w: minus.reshape(base.shape)})[0]
            num.reshape(-1)[i] = (lp - lm) / (2 * eps)
        np.testing.assert_allclose(got[f"{w}_grad"], num, rtol=1e-5, atol=1e-7)


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
