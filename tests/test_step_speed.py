"""The changes that make the training step faster leave its results as they were: the
optimizer update inside If(apply) gives bit for bit the update without the choice, ReLU's
gradient is exactly dy * (y > 0), and the sessions we create keep Add + LayerNormalization
unfused."""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradbuilder import GradientGraphBuilder
from gradbuilder.compiler.emitter import Emitter
from gradbuilder.runtime.runner import SLOWER_FUSIONS, compile_graph
from gradbuilder.training.stages.optimizer import OPTIMIZERS, add_optimizer, initial_state, resolve

CPU = ["CPUExecutionProvider"]


def _update_model(name: str, guarded: bool) -> bytes:
    """The optimizer update of weights W [3, 4] and B [4] alone; with ``guarded`` it applies
    only where the bool input ``apply`` holds."""
    ws = [ir.Value(name=n, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(s)) for n, s in (("W", [3, 4]), ("B", [4]))]
    gs = [ir.Value(name=w.name + "_grad", type=ir.TensorType(ir.DataType.FLOAT), shape=w.shape) for w in ws]
    apply = ir.Value(name="apply", type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
    graph = ir.Graph(ws + gs + ([apply] if guarded else []), [], nodes=[], name="update", opset_imports={"": 17})
    e = Emitter(graph, 17)
    e.reserve(*(v.name for v in graph.inputs))
    done = add_optimizer(e, ws, {w.name: g for w, g in zip(ws, gs)}, name, resolve(name, {"weight_decay": 0.1}),
                         "Learning_Rate", "Step", apply if guarded else None)
    graph.inputs.extend(done.inputs)
    graph.outputs.extend(done.outputs)
    return ir.to_proto(ir.Model(graph, ir_version=8)).SerializeToString()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_update_inside_if_is_bit_identical_and_skips_exactly(name):
    rng = np.random.default_rng(0)
    weights = {"W": rng.standard_normal((3, 4)).astype(np.float32), "B": rng.standard_normal(4).astype(np.float32)}
    feeds = {**weights, **{f"{w}_grad": rng.standard_normal(v.shape).astype(np.float32) for w, v in weights.items()},
             "Learning_Rate": np.array(0.01, np.float32), "Step": np.array(3, np.int64)}
    for w, v in weights.items():
        for s, value in initial_state(name, resolve(name, {}), v).items():
            feeds[f"{w}.{s}"] = value + rng.random(v.shape).astype(np.float32)  # moments >= 0
    plain = ort.InferenceSession(_update_model(name, False), providers=CPU)
    guarded = ort.InferenceSession(_update_model(name, True), providers=CPU)
    names = [o.name for o in plain.get_outputs()]
    want = plain.run(names, feeds)
    got = guarded.run(names, {**feeds, "apply": np.array(True)})
    for n, a, b in zip(names, want, got):
        assert np.array_equal(a, b), n
    kept = guarded.run(names, {**feeds, "apply": np.array(False)})
    for n, value in zip(names, kept):
        assert np.array_equal(value, feeds[n.removesuffix(".updated")]), n


def test_relu_gradient_is_exactly_dy_where_y_is_positive():
    x = np.array([[-2.0, -0.0, 0.0, 1e-30, 3.0, -1e-30]], np.float32)
    nodes = [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Mul", ["y", "c"], ["z"]),
             helper.make_node("ReduceSum", ["z"], ["loss"], keepdims=0)]
    c = np.array([[1.5, -2.0, 3.0, 0.25, -1.0, 7.0]], np.float32)
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              [numpy_helper.from_array(c, "c")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    built = GradientGraphBuilder(model, weights=["x"], outputs=["loss"], loss="loss").build().get_model()
    (dx,) = ort.InferenceSession(built, providers=CPU).run(["x_grad"], {"x": x})
    assert np.array_equal(dx, np.where(x > 0, c, np.float32(0)))


def test_our_sessions_keep_add_and_layer_norm_unfused(tmp_path):
    nodes = [helper.make_node("Add", ["x", "s"], ["a"]),
             helper.make_node("LayerNormalization", ["a", "g", "b"], ["y"], axis=-1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 8, 16]) for n in "xs"],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8, 16])],
                              [numpy_helper.from_array(np.ones(16, np.float32), "g"),
                               numpy_helper.from_array(np.zeros(16, np.float32), "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    assert "SkipLayerNormFusion" in SLOWER_FUSIONS
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    compile_graph(model, so, CPU, [{}], ("cpu", 0))
    ops = {n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node}
    assert "SkipLayerNormalization" not in ops and "LayerNormalization" in ops


@pytest.mark.parametrize("accumulation", [1, 2])
def test_bound_state_steps_are_bit_identical_to_unbound_ones(accumulation):
    """The step with its state bound (moments in place, the rest alternating) against the
    same session running each step with a fresh binding, over steps with a held output, a
    load_state in between and the step-wise API mixed in."""
    from gradbuilder import TrainingParameters, TrainingSession

    from .test_layers import regression_model

    def session():
        params = TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw",
                                    gradient_accumulation_steps=accumulation)
        return TrainingSession(regression_model(), params, providers=CPU)

    bound, fresh = session(), session()
    fresh.executor.bind_state = False
    rng = np.random.default_rng(0)
    batches = [{"x": rng.standard_normal((4, 3)).astype(np.float32), "t": rng.standard_normal((4, 2)).astype(np.float32)}
               for _ in range(12)]
    held = bound.run_with_ort_values(["loss"], batches[0])[0]
    first = held.numpy().copy()
    assert np.array_equal(first, fresh.run(["loss"], batches[0])[0])
    for k, feeds in enumerate(batches[1:], 1):
        if k == 5:
            for s in (bound, fresh):
                s.load_state({"W": np.full((3, 2), 0.5, np.float32)})
        if k in (8, 9):  # the step-wise API, bound as well, twice in a row
            for s in (bound, fresh):
                s.lazy_reset_grad()
                s.train_step(feeds["x"], feeds["t"])
                s.train_step(feeds["x"], feeds["t"])  # accumulated
                s.optimizer_step()
        assert np.array_equal(bound.run(["loss"], feeds)[0], fresh.run(["loss"], feeds)[0]), k
    assert np.array_equal(held.numpy(), first)  # an output the caller holds is never written again
    a, b = bound.get_state(), fresh.get_state()
    for w in ("W", "B"):
        assert np.array_equal(a["model"]["full_precision"][w], b["model"]["full_precision"][w])
        for s, value in a["optimizer"][w].items():
            assert np.array_equal(value, b["optimizer"][w][s]), (w, s)
    assert bound.step == fresh.step


def _softmax_model(masked: bool):
    nodes = [helper.make_node("Add", ["W", "mask"], ["z"]) if masked else helper.make_node("Identity", ["W"], ["z"]),
             helper.make_node("Softmax", ["z"], ["p"], axis=-1), helper.make_node("Mul", ["p", "c"], ["pc"]),
             helper.make_node("ReduceSum", ["pc"], ["loss"], keepdims=0)]
    inputs = [helper.make_tensor_value_info("mask", TensorProto.FLOAT, [2, 3])] if masked else []
    rng = np.random.default_rng(0)
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              [numpy_helper.from_array(rng.standard_normal((2, 3)).astype(np.float32), "W"),
                               numpy_helper.from_array(rng.standard_normal((2, 3)).astype(np.float32), "c")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_softmax_nan_guard_only_where_the_input_can_be_minus_inf():
    plain = onnx.load_from_string(GradientGraphBuilder(_softmax_model(False), ["W"], ["loss"], "loss").build().get_model())
    assert "IsNaN" not in {n.op_type for n in plain.graph.node}  # weights alone: finite
    built = GradientGraphBuilder(_softmax_model(True), ["W"], ["loss"], "loss").build().get_model()
    assert "IsNaN" in {n.op_type for n in onnx.load_from_string(built).graph.node}  # a data input may mask
    mask = np.zeros((2, 3), np.float32)
    mask[1] = -np.inf  # a row masked out entirely: NaN softmax, no gradient through it
    (dw,) = ort.InferenceSession(built, providers=CPU).run(["W_grad"], {"mask": mask})
    assert np.all(np.isfinite(dw)) and np.all(dw[1] == 0)


def test_bias_gradient_as_a_matrix_vector_product_is_the_sum():
    """A float32 bias over 2 x 96 rows: ones @ dy (a MatMul, see Emitter.unbroadcast), equal to
    the float64 sum of dy over the rows within float32 rounding."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 96, 16)).astype(np.float32)
    c = rng.standard_normal((2, 96, 16)).astype(np.float32)
    nodes = [helper.make_node("Add", ["x", "b"], ["y"]), helper.make_node("Mul", ["y", "c"], ["z"]),
             helper.make_node("ReduceSum", ["z"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 96, 16])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              [numpy_helper.from_array(np.zeros(16, np.float32), "b"), numpy_helper.from_array(c, "c")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    built = GradientGraphBuilder(model, ["b"], ["loss"], "loss").build().get_model()
    ops = [n.op_type for n in onnx.load_from_string(built).graph.node]
    assert ops.count("MatMul") == 1 and ops.count("ReduceSum") == 1  # the forward's loss alone reduces
    (db,) = ort.InferenceSession(built, providers=CPU).run(["b_grad"], {"x": x})
    np.testing.assert_allclose(db, c.astype(np.float64).sum(axis=(0, 1)), rtol=1e-5, atol=1e-5)


def test_a_weight_read_after_the_update_may_start_is_not_updated_in_place():
    """A second output reads W but not the loss: onnxruntime may run it after the optimizer's
    If, so W alternates between two buffers instead of being updated in place, and that
    output always sees the weights the step started from."""
    from gradbuilder import TrainingParameters, TrainingSession

    model = _softmax_model(False)  # loss = sum(softmax(W) * c)
    model.graph.node.append(helper.make_node("Mul", ["W", "W"], ["w2"]))
    model.graph.output.append(helper.make_tensor_value_info("w2", TensorProto.FLOAT, [2, 3]))
    sess = TrainingSession(model, TrainingParameters(loss_output_name="loss", training_optimizer_name="sgd"),
                           providers=CPU)
    sess.set_learning_rate(0.5)
    w = numpy_helper.to_array(model.graph.initializer[0])
    for _ in range(3):
        loss, w2 = sess.run(["loss", "w2"], {})
        np.testing.assert_array_equal(w2, w * w)  # the weights before this step's update
        w = sess.get_state()["model"]["full_precision"]["W"]
    in_place = sess.graphs.in_place("step")
    assert "W" not in in_place and "Step" in in_place


def test_slices_that_tile_an_axis_get_their_gradients_concatenated():
    """y_k = Gather(W, k) for k = 0, 1, 2 (a packed QKV weight): dW is the three slices'
    gradients side by side (one Concat, no padded copies), and matches finite differences."""
    from gradbuilder.testing import check_model

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Gather", ["W", f"i{k}"], [f"y{k}"], axis=0) for k in range(3)]
    nodes += [helper.make_node("Mul", ["y0", "y1"], ["p"]), helper.make_node("Mul", ["p", "y2"], ["q"]),
              helper.make_node("ReduceSum", ["q"], ["loss"], keepdims=0)]
    inits = [numpy_helper.from_array(rng.standard_normal((3, 4, 5)), "W")]
    inits += [numpy_helper.from_array(np.array(k, np.int64), f"i{k}") for k in range(3)]
    graph = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    built = onnx.load_from_string(GradientGraphBuilder(model, ["W"], ["loss"], "loss").build().get_model())
    ops = [n.op_type for n in built.graph.node]
    assert "Concat" in ops and "Pad" not in ops and "Sum" not in ops
    check_model(model, ["W"])


def test_layer_norm_backward_reads_the_forward_statistics():
    """A float32 LayerNormalization on a weight's path returns its InvStdDev, which its
    gradients read; xhat comes from one LayerNormalization of the same input without the affine
    part (one kernel where a Sub and a Mul were two); float64 finite differences and the
    float32 graph on onnxruntime agree (check_model)."""
    from gradbuilder.testing import check_model

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]),
             helper.make_node("LayerNormalization", ["h", "g", "b"], ["y"], axis=-1),
             helper.make_node("Mul", ["y", "c"], ["z"]), helper.make_node("ReduceSum", ["z"], ["loss"], keepdims=0)]
    inits = [numpy_helper.from_array(rng.standard_normal((5, 6)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "g"),
             numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "b"),
             numpy_helper.from_array(rng.standard_normal((4, 6)).astype(np.float32), "c")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 5])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    built = onnx.load_from_string(GradientGraphBuilder(model, ["W", "g", "b"], ["loss"], "loss").build().get_model())
    ln, xhat = [n for n in built.graph.node if n.op_type == "LayerNormalization"]
    assert len([o for o in ln.output if o]) == 3 and xhat.input[0] == ln.input[0]
    readers = {i for n in built.graph.node for i in n.input}
    assert ln.output[2] in readers
    inits = {t.name: numpy_helper.to_array(t) for t in built.graph.initializer}
    consts = {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in built.graph.node if n.op_type == "Constant"}
    assert [consts.get(i, inits.get(i)).tolist() for i in xhat.input[1:]] == [[1.0] * 6, [0.0] * 6]
    check_model(model, ["W", "g", "b"], {"x": rng.standard_normal((4, 5)).astype(np.float32)})


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_small_weights_updated_as_one_flat_tensor_are_bit_identical(name, monkeypatch):
    """W [3, 4] and B [4] are small: one flat update for both (optimizer.FLAT_ELEMENTS). The
    same arithmetic element by element as one update per weight (FLAT_ELEMENTS = 0)."""
    from gradbuilder.training.stages import optimizer

    rng = np.random.default_rng(1)
    weights = {"W": rng.standard_normal((3, 4)).astype(np.float32), "B": rng.standard_normal(4).astype(np.float32)}
    feeds = {**weights, **{f"{w}_grad": rng.standard_normal(v.shape).astype(np.float32) for w, v in weights.items()},
             "Learning_Rate": np.array(0.01, np.float32), "Step": np.array(3, np.int64), "apply": np.array(True)}
    for w, v in weights.items():
        for s, value in initial_state(name, resolve(name, {}), v).items():
            feeds[f"{w}.{s}"] = value + rng.random(v.shape).astype(np.float32)
    flat_model = _update_model(name, True)
    monkeypatch.setattr(optimizer, "FLAT_ELEMENTS", 0)
    apart_model = _update_model(name, True)
    concats = [_op_count(m, "Concat") for m in (flat_model, apart_model)]
    assert concats == ([0, 0] if name == "lamb" else [len(initial_state(name, resolve(name, {}), weights["B"])) + 2, 0])
    flat, apart = (ort.InferenceSession(m, providers=CPU) for m in (flat_model, apart_model))
    names = [o.name for o in flat.get_outputs()]
    for n, a, b in zip(names, flat.run(names, feeds), apart.run(names, feeds)):
        assert np.array_equal(a, b), n


def _op_count(model: bytes, op_type: str) -> int:
    """Nodes of ``op_type`` in the model, its subgraphs' included."""
    def count(graph):
        n = 0
        for node in graph.node:
            n += node.op_type == op_type
            for a in node.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    n += count(a.g)
        return n
    return count(onnx.load_from_string(model).graph)
