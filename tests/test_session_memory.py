"""TrainingSession with mixed precision, recompute and memory-efficient gradients, driven by
TrainingParameters: a small torch transformer encoder classifier trained with and without each
option from the same weights on the same batches."""

import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from gradbuilder import TrainingParameters, TrainingSession
from gradbuilder.training.stages.loss_scale import SCALE

from .torch_models import TinyEncoder

STEPS = 6
CPU = ["CPUExecutionProvider"]


@pytest.fixture(scope="module")
def encoder():
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 50, (4, 12)).astype(np.int64), rng.integers(0, 5, (4,)).astype(np.int64))
               for _ in range(STEPS)]
    x, y = batches[0]
    f = io.BytesIO()
    with warnings.catch_warnings():  # keep_initializers_as_inputs: no merging of the equal fresh layers
        warnings.simplefilter("ignore")
        torch.onnx.export(TinyEncoder(50).eval(), (torch.from_numpy(x), torch.from_numpy(y)), f, input_names=["x", "y"],
                          output_names=["loss"], dynamo=False, opset_version=17, keep_initializers_as_inputs=True)
    model = onnx.load_from_string(f.getvalue())
    inits = {t.name for t in model.graph.initializer}
    kept = [i for i in model.graph.input if i.name not in inits]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    return model.SerializeToString(), batches


def train(model, batches, sess_options=None, **options):
    params = TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw",
                                enable_grad_norm_clip=False, **options)
    sess = TrainingSession(model, params, sess_options=sess_options, providers=CPU)
    sess.set_learning_rate(1e-2)
    losses = [float(sess.run(["loss"], {"x": x, "y": y})[0]) for x, y in batches]
    return sess, np.array(losses)


@pytest.mark.parametrize("options", [
    {"transformer_layer_recompute": True},
    {"transformer_layer_recompute": True, "number_recompute_layers": 1},
    {"memory_budget_fraction": 0.4},
    {"use_memory_efficient_gradient": True},
], ids=["layers", "first-layer", "budget", "efficient-gradient"])
def test_recompute_trains_exactly_like_without(encoder, options):
    model, batches = encoder
    user_options = ort.SessionOptions()
    before = (user_options.execution_order, user_options.graph_optimization_level)
    base, expected = train(model, batches)
    sess, got = train(model, batches, sess_options=user_options, **options)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    got_w, expected_w = sess.get_model_state()["full_precision"], base.get_model_state()["full_precision"]
    for w in sess.weights:
        a, b = got_w[w], expected_w[w]
        if w.endswith("in_proj_bias"):  # the key bias's true gradient is 0: Adam amplifies round-off
            a, b = np.delete(a, slice(16, 32)), np.delete(b, slice(16, 32))
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=w)
    assert (user_options.execution_order, user_options.graph_optimization_level) == before  # not modified
    if "use_memory_efficient_gradient" in options:
        assert sess.recompute_report is None
        return
    report = sess.recompute_report
    assert report.recomputed and report.bytes_after < report.bytes_before, str(report)
    step = sess.graphs["step"].session.get_session_options()
    assert step.execution_order == ort.ExecutionOrder.PRIORITY_BASED  # what keeps the recompute late


def test_mixed_precision_float16_follows_float32(encoder, tmp_path):
    """float16 MatMuls/Gemms with dynamic loss scaling and float16 first moments: the losses
    follow float32 training (relative 2e-2: float16 keeps 11 significant bits)."""
    model, batches = encoder
    _, expected = train(model, batches)
    sess, got = train(model, batches, use_mixed_precision=True, use_fp16_moments=True)
    np.testing.assert_allclose(got, expected, rtol=2e-2)
    assert sess.loss_scale_input_name == SCALE and sess.loss_scale == 2.0 ** 16  # no overflow: not grown yet
    state = sess.get_model_state(include_mixed_precision_weights=True)
    for w, full in state["full_precision"].items():
        assert full.dtype == np.float32
        np.testing.assert_array_equal(state["mixed_precision"][w], full.astype(np.float16))
    assert "mixed_precision" not in sess.get_model_state()
    assert sess.get_optimizer_state()["shared_optimizer_state"][SCALE] == np.float32(2.0 ** 16)
    assert sess.is_output_fp32_node("loss")
    path = tmp_path / "mixed.ckpt"
    sess.save_checkpoint(path)
    resumed, _ = train(model, [], use_mixed_precision=True, use_fp16_moments=True)
    resumed.load_checkpoint(path)
    x, y = batches[0]
    np.testing.assert_allclose(resumed.run(["loss"], {"x": x, "y": y}), sess.run(["loss"], {"x": x, "y": y}))


def test_frozen_parameters_stay_out_of_the_graphs_bytes_and_can_be_replaced(tmp_path):
    """A large frozen parameter is given to onnxruntime as an external initializer: no graph's
    bytes hold it (one copy in the session, one in onnxruntime), the step computes with it,
    and a new value given to the session is the one the next step uses."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    frozen = rng.standard_normal((256, 256)).astype(np.float32)  # 256 KiB
    w = rng.standard_normal((256, 4)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "F"], ["h"]), helper.make_node("MatMul", ["h", "W"], ["y"]),
             helper.make_node("ReduceSumSquare", ["y"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 256])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              [numpy_helper.from_array(frozen, "F"), numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    params = TrainingParameters(loss_output_name="loss", training_optimizer_name="sgd", weights_not_to_train={"F"})
    for threads in (1, 2, 16):
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        sess = TrainingSession(model.SerializeToString(), params, so, providers=CPU)
        sess.set_learning_rate(0.0)
        x = rng.standard_normal((3, 256)).astype(np.float32)
        (loss,) = sess.run(["loss"], {"x": x})
        np.testing.assert_allclose(loss, np.sum((x @ frozen @ w) ** 2), rtol=1e-4)
        assert len(sess.graphs.serialized("step")) < frozen.nbytes // 4
        assert list(sess.graphs.externals("step")) == ["F"]
        other = frozen * 0.5
        sess.load_state({"F": other})
        (loss,) = sess.run(["loss"], {"x": x})
        np.testing.assert_allclose(loss, np.sum((x @ other @ w) ** 2), rtol=1e-4)
        path = sess.export_model_for_inferencing(str(tmp_path / f"m{threads}.onnx"), ["loss"])
        got = ort.InferenceSession(path, providers=CPU).run(None, {"x": x})[0]
        np.testing.assert_allclose(got, loss, rtol=1e-5)
