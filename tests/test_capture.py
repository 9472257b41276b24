"""TrainingParameters.enable_cuda_graph (runtime.capture): what can and cannot be captured, the
refusals before any step runs, and the captured step's bindings (fixed buffers, the state put
back after the capture, the two turns) against the uncaptured step.

onnxruntime's CPU provider ignores the graph id a captured run asks for, so on the CPU the
CapturedExecutor runs its step exactly as on a GPU minus the capture itself: every buffer at a
fixed address, the first step of each turn run two more times and its state put back. The GPU
case (captured against uncaptured) is in test_cuda.py."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradbuilder import InvalidArgumentError, TrainingParameters, TrainingSession
from gradbuilder.runtime import capture, executor, providers
from gradbuilder.runtime.graphs import Kind

CPU = "CPUExecutionProvider"


def one_line(error: Exception) -> None:
    assert "\n" not in str(error).strip()


def capture_model(dropout: float = 0.0) -> onnx.ModelProto:
    """x [n, 8] -> Linear -> Relu -> BatchNorm (running statistics: state that takes turns) ->
    LayerNorm -> (Dropout) -> Linear -> mean squared error against t [n, 4]."""
    rng = np.random.default_rng(0)
    init = {"W1": rng.standard_normal((8, 16)) * 0.3, "B1": np.zeros(16), "g": np.ones(16), "b": np.zeros(16),
            "bn_s": np.ones(16), "bn_b": np.zeros(16), "bn_m": np.zeros(16), "bn_v": np.ones(16),
            "W2": rng.standard_normal((16, 4)) * 0.3}
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h1"]), helper.make_node("Add", ["h1", "B1"], ["h2"]),
             helper.make_node("Relu", ["h2"], ["h3"]),
             helper.make_node("BatchNormalization", ["h3", "bn_s", "bn_b", "bn_m", "bn_v"], ["h4", "rm", "rv"],
                              training_mode=1, momentum=0.9),
             helper.make_node("LayerNormalization", ["h4", "g", "b"], ["h5"], axis=-1)]
    last = "h5"
    if dropout:
        nodes.append(helper.make_node("Dropout", ["h5", "ratio", "training"], ["h6"], name="the_dropout"))
        init["ratio"] = np.array(dropout)
        last = "h6"
    nodes += [helper.make_node("MatMul", [last, "W2"], ["y"]), helper.make_node("Sub", ["y", "t"], ["d"]),
              helper.make_node("Mul", ["d", "d"], ["sq"]), helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0)]
    initializers = [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in init.items()]
    if dropout:
        initializers.append(numpy_helper.from_array(np.array(True), "training"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8]),
                                           helper.make_tensor_value_info("t", TensorProto.FLOAT, ["n", 4])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def capture_batches(n=6, rows=5):
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((rows, 8)).astype(np.float32), "t": rng.standard_normal((rows, 4)).astype(np.float32)}
            for _ in range(n)]


def _session(threads: int, captured: bool, **options) -> TrainingSession:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    params = TrainingParameters(loss_output_name="loss", training_optimizer_name=options.pop("optimizer", "adamw"),
                                **options)
    sess = TrainingSession(capture_model(), params, sess_options=so, providers=[CPU])
    if captured:  # what enable_cuda_graph picks on a GPU, here on the CPU (see the module's docstring)
        sess.set_executor(capture.CapturedExecutor(sess.parts))
    return sess


CONFIGS = {
    "adamw flat, clipped": dict(optimizer_state_layout="flat", enable_grad_norm_clip=True),
    "adamw per tensor, 2 accumulation steps": dict(optimizer_state_layout="per_tensor", gradient_accumulation_steps=2),
    "lamb": dict(optimizer="lamb"),
    "float16, dynamic loss scale": dict(optimizer_state_layout="flat", use_mixed_precision=True),
}


@pytest.mark.parametrize("threads", [1, 2, 16])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_captured_steps_bindings_train_as_the_uncaptured_step(config, threads):
    """Losses, weights, optimizer states, running statistics and Step over six steps equal the
    uncaptured session's, with the caller refilling one feed array in place between steps (the
    captured step copies every feed in every step) and feeding OrtValues every other step (copied
    on their device), at a learning rate that changes every step."""
    import onnxruntime as ort

    plain, captured = _session(threads, False, **CONFIGS[config]), _session(threads, True, **CONFIGS[config])
    feed = {k: v.copy() for k, v in capture_batches()[0].items()}
    for step, batch in enumerate(capture_batches(), 1):
        for sess in (plain, captured):  # a schedule: another rate every step, copied into the captured step's
            sess.set_learning_rate(0.01 / step)
        expected = float(plain.run(["loss"], batch)[0])
        for k in feed:
            feed[k][...] = batch[k]
        given = feed if step % 2 else {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in batch.items()}
        got = float(captured.run(["loss"], given)[0])
        np.testing.assert_allclose(got, expected, rtol=1e-6, err_msg=f"step {step}")
        assert captured.step == plain.step  # the first step was applied once, not once per run inside the capture
    for name in plain.state:
        np.testing.assert_allclose(captured.state.array(name), plain.state.array(name), rtol=1e-5, atol=1e-6,
                                   err_msg=name)


def test_the_captured_step_has_no_shape_computation_no_control_flow_and_nothing_to_refuse():
    sess = _session(1, True, optimizer_state_layout="per_tensor", gradient_accumulation_steps=2)
    sess.run(["loss"], capture_batches()[0])
    model = onnx.ModelProto.FromString(sess.graphs.serialized(Kind.STEP))
    ops = {n.op_type for n in model.graph.node}
    assert not ops & {"If", "Loop", "Scan", "Shape", "Size", "Range", "ConstantOfShape", "NonZero"}, ops
    assert [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim] == [5, 8]  # the first feed's
    assert capture.capture_blockers(model) == []


def test_another_shape_after_the_capture_is_refused_and_changes_nothing():
    sess = _session(1, True)
    sess.run(["loss"], capture_batches()[0])
    before = {n: sess.state.array(n) for n in sess.state}
    with pytest.raises(InvalidArgumentError, match=r"input 'x' has shape \[3, 8\], but the step was captured") as e:
        sess.run(["loss"], capture_batches(rows=3)[0])
    one_line(e.value)
    assert all(np.array_equal(sess.state.array(n), v) for n, v in before.items())


def test_a_step_that_cannot_be_captured_is_refused_before_it_runs_naming_the_node():
    params = TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw")
    sess = TrainingSession(capture_model(dropout=0.1), params, providers=[CPU])
    sess.set_executor(capture.CapturedExecutor(sess.parts))
    before = {n: sess.state.array(n) for n in sess.state}
    with pytest.raises(InvalidArgumentError, match="node 'the_dropout' \\(Dropout\\): draws random numbers") as e:
        sess.run(["loss"], capture_batches()[0])
    one_line(e.value)
    assert all(np.array_equal(sess.state.array(n), v) for n, v in before.items())
    assert sess.step == 0


def _node_model(nodes, inputs, initializers=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_capture_blockers_name_each_node_and_why():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6])
    shape = numpy_helper.from_array(np.array([6, 4], np.int64), "shape")
    ok = _node_model([helper.make_node("Reshape", ["x", "shape"], ["y"], name="r")], [x], [shape])
    assert capture.capture_blockers(ok) == []
    computed = _node_model([helper.make_node("Shape", ["x"], ["s"], name="s"),
                            helper.make_node("Reshape", ["x", "s"], ["y"], name="r")], [x])
    assert capture.capture_blockers(computed) == [
        "node 's' (Shape): its output depends on values read on the host",
        "node 'r' (Reshape): its CUDA kernel reads the computed input 's' on the host"]
    zero = numpy_helper.from_array(np.array(0.0, np.float32), "zero")
    tenth = numpy_helper.from_array(np.array(0.1, np.float32), "tenth")
    true = numpy_helper.from_array(np.array(True), "true")
    drop = lambda ratio: _node_model([helper.make_node("Dropout", ["x", ratio, "true"], ["y"], name="d")], [x],  # noqa: E731
                                     [zero, tenth, true])
    assert capture.capture_blockers(drop("zero")) == []  # ratio 0 draws nothing
    assert capture.capture_blockers(drop("tenth")) == [
        "node 'd' (Dropout): draws random numbers, and a replay would draw the same ones every step"]
    cpu_only = _node_model([helper.make_node("Celu", ["x"], ["y"], name="c")], [x])
    (line,) = capture.capture_blockers(cpu_only)
    assert line.startswith("node 'c' (Celu, domain ai.onnx, version 12: the CUDA provider has no kernel") and line.endswith(
        "it would run on the CPU")
    cond = helper.make_tensor_value_info("c", TensorProto.BOOL, [])
    branch = helper.make_graph([helper.make_node("Identity", ["x"], ["z"])], "b", [],
                               [helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, 6])])
    branched = _node_model([helper.make_node("If", ["c"], ["y"], name="i", then_branch=branch, else_branch=branch)],
                           [x, cond])
    assert "node 'i' (If): control flow reads its condition on the host" in capture.capture_blockers(branched)


def test_enable_cuda_graph_off_cuda_is_refused_when_the_session_is_made():
    params = TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw", enable_cuda_graph=True)
    with pytest.raises(InvalidArgumentError, match="enable_cuda_graph=True captures the step as a CUDA graph and needs "
                                                   "CUDAExecutionProvider; this session runs on CPUExecutionProvider") as e:
        TrainingSession(capture_model(), params, providers=[CPU])
    one_line(e.value)


def test_moving_a_captured_session_to_the_cpu_is_refused():
    sess = _session(1, True)
    with pytest.raises(InvalidArgumentError, match="needs CUDAExecutionProvider"):
        sess.set_providers([CPU])


def test_the_cuda_providers_own_graph_option_is_refused_for_the_training_parameter(monkeypatch):
    """Given to the CUDA provider directly, onnxruntime would capture the step with its state bound
    for one of its two turns and the first step applied twice: the session says which option does it."""
    monkeypatch.setattr(providers, "resolve_providers",  # what executor.resolve_providers calls
                        lambda p, o, tf32: (["CUDAExecutionProvider", CPU], [{"enable_cuda_graph": "1"}, {}]))
    with pytest.raises(InvalidArgumentError, match="set TrainingParameters.enable_cuda_graph=True instead") as e:
        executor.resolve_providers(["CUDAExecutionProvider"], [{"enable_cuda_graph": "1"}])
    one_line(e.value)
