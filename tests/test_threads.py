"""Gradients that sum into shared locations are right at any intra-op thread count, and the
same bits every run.

onnxruntime's CPU ScatterND(reduction="add") splits its updates across the intra-op threads,
which add into the same rows without synchronisation: repeated indices lose updates from 2
threads on (oversubscribing this machine's cores shows it as well as a 16-core one). Each
accumulating gradient below runs at 1, 2 and 16 threads, several times, against a float64
sum computed here with numpy, and must also repeat its own bits exactly."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradbuilder import GradientGraphBuilder, TrainingParameters, TrainingSession
from gradbuilder.testing import racing_nodes

from .helpers import make_model, tensor, vi

THREADS = (1, 2, 16)
REPEATS = 3
ROWS, TOKENS, WIDTH = 64, 4096, 768  # an embedding's gradient: 4096 lookups into 64 rows


def _session(model: bytes, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _check_at_every_thread_count(model: bytes, feeds: dict, name: str, expected: np.ndarray, tol: float = 1e-5):
    """``name`` within ``tol`` (relative to the largest magnitude) of ``expected`` at every thread
    count and repetition, and bit-identical across the repetitions of one thread count."""
    scale = max(1.0, float(np.abs(expected).max()))
    for threads in THREADS:
        s = _session(model, threads)
        runs = [s.run([name], feeds)[0] for _ in range(REPEATS)]
        for got in runs:
            err = float(np.abs(got.astype(np.float64) - expected).max()) / scale
            assert err < tol, f"{name} at {threads} threads is {err:.1e} off float64"
            assert np.array_equal(got, runs[0]), f"{name} at {threads} threads differs between runs"


def _gradient_model(nodes, inputs, inits, weight, opset=18) -> bytes:
    """loss = sum(y * t) for the model's y: the gradient of y is t."""
    nodes = nodes + [helper.make_node("Mul", ["y", "t"], ["p"]), helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0)]
    model = make_model(nodes, inputs, [vi("loss", [])], inits, opset=opset)
    return GradientGraphBuilder(model, weights=[weight], outputs=["loss"], loss="loss").build().get_model()


def _no_reducing_scatter_nd(model: bytes) -> None:
    racing = racing_nodes(onnx.load_from_string(model).graph)
    assert not racing, f"ScatterND with a reduction left in the graph: {racing}"


@pytest.mark.parametrize("axis", [0, 1])
def test_gather_gradient_at_every_thread_count(rng, axis):
    table_shape = (ROWS, WIDTH) if axis == 0 else (WIDTH, ROWS)
    table = rng.standard_normal(table_shape).astype(np.float32)
    ids = rng.integers(-ROWS, ROWS, TOKENS)  # negative ids count from the end
    out_shape = (TOKENS, WIDTH) if axis == 0 else (WIDTH, TOKENS)
    t = rng.standard_normal(out_shape).astype(np.float32)
    model = _gradient_model([helper.make_node("Gather", ["E", "ids"], ["y"], axis=axis)],
                            [vi("ids", [TOKENS], TensorProto.INT64), vi("t", list(out_shape))], [tensor("E", table)], "E")
    _no_reducing_scatter_nd(model)
    expected = np.zeros(table_shape)
    if axis == 0:
        np.add.at(expected, ids % ROWS, t.astype(np.float64))
    else:
        np.add.at(expected.T, ids % ROWS, t.T.astype(np.float64))
    _check_at_every_thread_count(model, {"ids": ids, "t": t, "E": table}, "E_grad", expected)


def test_gather_nd_gradient_at_every_thread_count(rng):
    x = rng.standard_normal((8, 8, WIDTH)).astype(np.float32)
    idx = rng.integers(0, 8, (TOKENS, 2))
    t = rng.standard_normal((TOKENS, WIDTH)).astype(np.float32)
    model = _gradient_model([helper.make_node("GatherND", ["X", "idx"], ["y"])],
                            [vi("idx", [TOKENS, 2], TensorProto.INT64), vi("t", [TOKENS, WIDTH])], [tensor("X", x)], "X")
    _no_reducing_scatter_nd(model)
    expected = np.zeros(x.shape)
    np.add.at(expected, (idx[:, 0], idx[:, 1]), t.astype(np.float64))
    _check_at_every_thread_count(model, {"idx": idx, "t": t, "X": x}, "X_grad", expected)


def test_gather_elements_gradient_at_every_thread_count(rng):
    x = rng.standard_normal((ROWS, WIDTH)).astype(np.float32)
    idx = rng.integers(0, ROWS, (TOKENS, WIDTH))
    t = rng.standard_normal((TOKENS, WIDTH)).astype(np.float32)
    model = _gradient_model([helper.make_node("GatherElements", ["X", "idx"], ["y"], axis=0)],
                            [vi("idx", [TOKENS, WIDTH], TensorProto.INT64), vi("t", [TOKENS, WIDTH])], [tensor("X", x)], "X")
    expected = np.zeros(x.shape)
    np.add.at(expected, (idx, np.broadcast_to(np.arange(WIDTH), idx.shape)), t.astype(np.float64))
    _check_at_every_thread_count(model, {"idx": idx, "t": t, "X": x}, "X_grad", expected)


def test_forward_scatter_nd_add_at_every_thread_count(rng):
    """A forward model's own ScatterND(reduction="add") (torch's index_put_ with accumulate) is
    rewritten too, so the loss it feeds is right; and its gradient flows to the updates."""
    base = rng.standard_normal((ROWS, WIDTH)).astype(np.float32)
    upd = rng.standard_normal((TOKENS, WIDTH)).astype(np.float32)
    ids = rng.integers(0, ROWS, (TOKENS, 1))
    t = rng.standard_normal((ROWS, WIDTH)).astype(np.float32)
    nodes = [helper.make_node("ScatterND", ["D", "ids", "U"], ["y"], reduction="add")]
    model = _gradient_model(nodes, [vi("ids", [TOKENS, 1], TensorProto.INT64), vi("t", [ROWS, WIDTH])],
                            [tensor("D", base), tensor("U", upd)], "U")
    _no_reducing_scatter_nd(model)
    summed = base.astype(np.float64)
    np.add.at(summed, ids[:, 0], upd.astype(np.float64))
    expected_loss = np.array((summed * t).sum())
    feeds = {"ids": ids, "t": t, "U": upd}
    _check_at_every_thread_count(model, feeds, "loss", expected_loss, tol=1e-6)
    _check_at_every_thread_count(model, feeds, "U_grad", t[ids[:, 0]].astype(np.float64))


def test_scatter_nd_inside_a_loop_body_is_rewritten(rng):
    """The rewrite reaches control-flow bodies: a Loop whose body sums rows by ScatterND."""
    ids = rng.integers(0, 4, (64, 1))
    body = helper.make_graph(
        [helper.make_node("ScatterND", ["acc_in", "ids", "U"], ["acc_out"], reduction="add"),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])], "body",
        [vi("i", [], TensorProto.INT64), vi("cond_in", [], TensorProto.BOOL), vi("acc_in", [4, 8])],
        [vi("cond_out", [], TensorProto.BOOL), vi("acc_out", [4, 8])])
    nodes = [helper.make_node("Loop", ["trips", "", "zero"], ["y"], body=body)]
    u = rng.standard_normal((64, 8)).astype(np.float32)
    t = rng.standard_normal((4, 8)).astype(np.float32)
    model = _gradient_model(nodes, [vi("ids", [64, 1], TensorProto.INT64), vi("t", [4, 8])],
                            [tensor("U", u), tensor("trips", np.array(3, np.int64)),
                             tensor("zero", np.zeros((4, 8), np.float32))], "U")
    _no_reducing_scatter_nd(model)
    summed = np.zeros((4, 8))
    np.add.at(summed, ids[:, 0], u.astype(np.float64))
    _check_at_every_thread_count(model, {"ids": ids, "t": t, "U": u}, "loss", np.array(3 * (summed * t).sum()), tol=1e-6)
    _check_at_every_thread_count(model, {"ids": ids, "t": t, "U": u}, "U_grad", 3 * t[ids[:, 0]].astype(np.float64))


def test_deterministic_compute_rewrites_the_scatter_elements_sums(rng):
    """deterministic_compute: ScatterElements(reduction="add") (CUDA adds it with atomics) is a
    sorted segment sum too; the gradient equals the float64 sum and repeats its bits."""
    x = rng.standard_normal((16, 32)).astype(np.float32)
    idx = rng.integers(-16, 16, (512, 32))
    t = rng.standard_normal((512, 32)).astype(np.float32)
    inputs = [vi("idx", [512, 32], TensorProto.INT64), vi("t", [512, 32])]
    nodes = [helper.make_node("GatherElements", ["X", "idx"], ["y"], axis=0),
             helper.make_node("Mul", ["y", "t"], ["p"]), helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0)]
    model = make_model(nodes, inputs, [vi("loss", [])], [tensor("X", x)], opset=18)
    plain = GradientGraphBuilder(model, weights=["X"], outputs=["loss"], loss="loss").build().get_model()
    fixed = GradientGraphBuilder(model, weights=["X"], outputs=["loss"], loss="loss",
                                 deterministic=True).build().get_model()
    count = {m: sum(n.op_type == "ScatterElements" for n in onnx.load_from_string(m).graph.node) for m in (plain, fixed)}
    assert count[plain] == 1 and count[fixed] == 0
    expected = np.zeros(x.shape)
    np.add.at(expected, (idx % 16, np.broadcast_to(np.arange(32), idx.shape)), t.astype(np.float64))
    _check_at_every_thread_count(fixed, {"idx": idx, "t": t, "X": x}, "X_grad", expected)


def test_deterministic_compute_is_a_training_parameter():
    p = TrainingParameters()
    assert p.deterministic_compute is False
    p.deterministic_compute = True
    assert TrainingParameters.from_json(p.to_json()).deterministic_compute is True
    with pytest.raises(Exception, match="deterministic_compute"):
        p.deterministic_compute = 1


# ----------------------------------------------------------------------------- a whole workflow


VOCAB, SEQ, BATCH, DIM = 64, 128, 32, 96


def embedding_model(rng) -> onnx.ModelProto:
    """logits = mean over the sequence of Embedding(ids) @ W; loss = cross-entropy on labels."""
    nodes = [
        helper.make_node("Gather", ["emb", "ids"], ["e"]),  # [B, S, D]
        helper.make_node("ReduceMean", ["e", "axis1"], ["pooled"], keepdims=0),
        helper.make_node("MatMul", ["pooled", "W"], ["logits"]),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"]),
    ]
    inits = [tensor("emb", (rng.standard_normal((VOCAB, DIM)) * 0.5).astype(np.float32)),
             tensor("W", (rng.standard_normal((DIM, 8)) * 0.3).astype(np.float32)),
             tensor("axis1", np.array([1], np.int64))]
    return make_model(nodes, [vi("ids", [BATCH, SEQ], TensorProto.INT64), vi("labels", [BATCH], TensorProto.INT64)],
                      [vi("loss", [])], inits, opset=18)


def _torch_run(model: onnx.ModelProto, batches, lr: float):
    torch = pytest.importorskip("torch")
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    emb = torch.tensor(inits["emb"], dtype=torch.float64, requires_grad=True)
    w = torch.tensor(inits["W"], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([emb, w], lr=lr)
    losses = []
    for ids, labels in batches:
        opt.zero_grad()
        logits = emb[torch.as_tensor(ids)].mean(1) @ w
        loss = torch.nn.functional.cross_entropy(logits, torch.as_tensor(labels))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, emb.detach().numpy(), w.detach().numpy()


@pytest.mark.parametrize("threads", [1, 2, 4, 16])
def test_embedding_training_matches_torch_at_every_thread_count(threads):
    rng = np.random.default_rng(0)
    model = embedding_model(rng)
    batches = [(rng.integers(0, VOCAB, (BATCH, SEQ)), rng.integers(0, 8, BATCH)) for _ in range(6)]
    lr = 0.5
    losses_ref, emb_ref, w_ref = _torch_run(model, batches, lr)
    params = TrainingParameters(training_optimizer_name="sgd", weights_to_train={"emb", "W"}, loss_output_name="loss",
                                enable_grad_norm_clip=False)
    for _ in range(3):
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        session = TrainingSession(model.SerializeToString(), params, sess_options=so)
        session.set_learning_rate(lr)
        losses = [float(session.run(["loss"], {"ids": ids, "labels": labels})[0]) for ids, labels in batches]
        np.testing.assert_allclose(losses, losses_ref, rtol=1e-5, atol=1e-6)
        state = session.get_model_state()["full_precision"]
        np.testing.assert_allclose(state["emb"], emb_ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(state["W"], w_ref, rtol=1e-5, atol=1e-5)
