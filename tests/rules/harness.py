"""Checks shared by the rule tests, beyond gradbuilder.testing.check_op: integer inputs
given at run time, inputs of unknown rank, and finite differences on onnxruntime for op
forms onnx's reference evaluator cannot run."""

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from gradbuilder import GradientGraphBuilder
from gradbuilder.testing import (check_model, make_op_model, numeric_gradient, ort_grad_session, ort_run, ort_session,
                                 run_onnxruntime)


def distinct(rng, *shape, offset=0.0):
    """Well separated values (no ties within 0.2 of each other)."""
    n = int(np.prod(shape))
    return (rng.permutation(n).reshape(shape) * 0.4 + offset + rng.uniform(-0.05, 0.05, shape)).astype(np.float32)


def signed(rng, *shape, lo=0.5, hi=2.0, dtype=np.float32):
    """|values| in [lo, hi], random signs: away from the kinks of |x| at 0."""
    return (rng.uniform(lo, hi, shape) * rng.choice([-1.0, 1.0], shape)).astype(dtype)


def ort_directional_check(op, inputs, attrs, opset, dims="static", t=1e-2, directions=4, seed=0):
    """For op forms the float64 gradcheck cannot build or run (a spec that admits float32 only,
    a float32 epsilon in a function body, a reference evaluator that computes another forward):
    the float32 gradient on onnxruntime against central differences of the loss on onnxruntime,
    along random directions. Steps of 1e-2 on smooth functions are exact to O(t^2) ~ 1e-4."""
    rng = np.random.default_rng(seed)
    model, weights, feeds = make_op_model(op, inputs, attrs, opset=opset, weights_as="inputs", dims=dims)
    built = GradientGraphBuilder(model, weights, ["loss"], "loss").build().model_proto
    got = ort_run(built, feeds)
    for w in weights:
        grad = got[f"{w}_grad"].astype(np.float64)
        assert grad.shape == feeds[w].shape

        def loss(v):
            return float(ort_run(model, {**feeds, w: v.astype(np.float32)})["loss"])

        for _ in range(directions):
            d = rng.uniform(-1, 1, grad.shape)
            num = (loss(feeds[w] + t * d) - loss(feeds[w] - t * d)) / (2 * t)
            assert abs(num - np.sum(grad * d)) <= 2e-3 * max(1.0, abs(num)), (op, attrs, w, num, np.sum(grad * d))


def run_grads(model, weights, feeds, extra=()):
    """The onnxruntime gradients of ``weights`` and the values ``extra``, by name."""
    built = GradientGraphBuilder(model, weights=weights, outputs=["loss", *extra], loss="loss").build().get_model()
    got = run_onnxruntime(built, feeds)
    return {**{w: got[f"{w}_grad"] for w in weights}, **{x: got[x] for x in extra}}


def check_graph_ints(op, inputs, attrs=None, *, graph_ints, opset, num_outputs=1, static_last=False, **kw):
    """check_op, with the integer inputs ``graph_ints`` as graph inputs of unknown size
    (not constants) so that the rule must read them at run time; ``static_last`` keeps
    their last dim known (GatherND's tuple length)."""
    model, weights, feeds = make_op_model(op, inputs, attrs, opset=opset, num_outputs=num_outputs, **kw)
    for t in list(model.graph.initializer):
        if t.name in graph_ints:
            value = numpy_helper.to_array(t)
            model.graph.initializer.remove(t)
            dims = [None] * value.ndim
            if static_last:
                dims[-1] = value.shape[-1]
            model.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, dims))
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
    check_model(model, weights, feeds)


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
    y = ort_session(probe).run(None, feeds)[0]
    proj = np.random.default_rng(7).standard_normal(y.shape)
    nodes = [node, helper.make_node("Mul", ["y", "proj"], ["m"]), helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0)]
    model = helper.make_model(
        helper.make_graph(nodes, "g", vi, [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
                          inits + [numpy_helper.from_array(proj, "proj")]),
        opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    sess, got = ort_grad_session(model, list(floats), feeds)
    for w, base in floats.items():
        num = numeric_gradient(lambda v: sess.run(["loss"], {**feeds, w: v})[0], base, eps)
        np.testing.assert_allclose(got[f"{w}_grad"], num, rtol=1e-5, atol=1e-7)
