"""Steps whose loss or gradients hold an inf or NaN never reach the weights.

The graph leaves weights, optimizer state, Step, accumulation buffers and running statistics
as they went in; the session warns and counts (``skipped_steps``) or, with
``on_nonfinite_step="raise"``, raises NonFiniteError.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from onnx import helper

from gradbuilder import NonFiniteError, TrainingParameters
from gradbuilder.errors import InvalidArgumentError
from gradbuilder.runtime.session import TrainingSession

from .helpers import make_model, tensor, vi

CPU = ["CPUExecutionProvider"]
W0 = np.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.5]], np.float32)


def sqrt_model() -> bytes:
    """loss = sum(sqrt(|x W|)): a zero in x W has a finite loss and an infinite gradient."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Abs", ["xw"], ["a"]),
             helper.make_node("Sqrt", ["a"], ["s"]), helper.make_node("ReduceSum", ["s"], ["loss"], keepdims=0)]
    return make_model(nodes, [vi("x", ["batch", 2])], [vi("loss", [])], [tensor("W", W0)]).SerializeToString()


def session(**options) -> TrainingSession:
    p = TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw", enable_grad_norm_clip=False,
                           **options)
    s = TrainingSession(sqrt_model(), p, providers=CPU)
    s.set_learning_rate(0.1)
    return s


GOOD = np.array([[1.0, 2.0], [0.5, -1.0]], np.float32)
NAN_LOSS = np.array([[np.nan, 2.0], [0.5, -1.0]], np.float32)
INF_GRAD = np.array([[0.0, 0.0], [0.5, -1.0]], np.float32)  # row 0: x W = 0, d sqrt = inf


def state(s):
    return {**s.get_model_state()["full_precision"], **{f"W.{k}": v for k, v in s.get_optimizer_state()["W"].items()},
            "Step": s.get_optimizer_state()["shared_optimizer_state"]["Step"]}


@pytest.mark.parametrize("bad", [NAN_LOSS, INF_GRAD], ids=["nan-loss", "inf-gradient"])
def test_nonfinite_step_is_skipped_with_a_warning_and_counted(bad):
    s = session()
    s.run(["loss"], {"x": GOOD})
    before = state(s)
    with pytest.warns(RuntimeWarning, match="inf or NaN; the update was skipped"):
        s.run(["loss"], {"x": bad})
    assert s.skipped_steps == 1
    for k, v in state(s).items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    # training goes on as if the bad batch had not been there: torch's AdamW on the good batches
    w = torch.tensor(W0, requires_grad=True)
    opt = torch.optim.AdamW([w], lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        torch.sqrt(torch.abs(torch.from_numpy(GOOD) @ w)).sum().backward()
        opt.step()
    s.run(["loss"], {"x": GOOD})
    np.testing.assert_allclose(s.get_model_state()["full_precision"]["W"], w.detach().numpy(), rtol=2e-5)
    assert s.step == 2


def test_raise_mode_raises_and_changes_nothing():
    s = session(on_nonfinite_step="raise")
    s.run(["loss"], {"x": GOOD})
    before = state(s)
    with pytest.raises(NonFiniteError, match="step 2"):
        s.run(["loss"], {"x": INF_GRAD})
    for k, v in state(s).items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    with pytest.raises(InvalidArgumentError, match="on_nonfinite_step"):
        TrainingParameters(on_nonfinite_step="ignore")


def test_accumulation_drops_the_nonfinite_micro_step():
    s = session(gradient_accumulation_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        s.run(["loss"], {"x": GOOD})       # micro-step 1
        s.run(["loss"], {"x": INF_GRAD})   # dropped: the buffer keeps micro-step 1's gradient
        s.run(["loss"], {"x": GOOD})       # micro-step 2: update with the sum of the good two
    assert s.step == 1 and s.skipped_steps == 1
    w = torch.tensor(W0, requires_grad=True)
    opt = torch.optim.AdamW([w], lr=0.1)
    for _ in range(2):
        torch.sqrt(torch.abs(torch.from_numpy(GOOD) @ w)).sum().backward()
    opt.step()
    np.testing.assert_allclose(s.get_model_state()["full_precision"]["W"], w.detach().numpy(), rtol=2e-5)


def test_step_wise_api_optimizer_step_skips_nonfinite_gradients():
    s = session()
    s.train_step(INF_GRAD)
    before = state(s)
    with pytest.warns(RuntimeWarning, match="skipped"):
        s.optimizer_step()
    for k, v in state(s).items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    s.lazy_reset_grad()
    s.train_step(GOOD)
    s.optimizer_step()
    assert s.step == 1 and s.skipped_steps == 1


def test_eval_step_of_a_transposed_weight_times_a_vector_is_right():
    """onnxruntime fuses MatMul(Transpose(W), k) and drops the transpose for a 1-D k once W is a
    graph input, as in the session's graphs: the eval graph is rewritten like the training ones."""
    w = np.arange(6, dtype=np.float32).reshape(2, 3) / 4
    nodes = [helper.make_node("Transpose", ["W"], ["wt"], perm=[1, 0]), helper.make_node("MatMul", ["wt", "k"], ["y"]),
             helper.make_node("Mul", ["y", "y"], ["y2"]), helper.make_node("ReduceSum", ["y2"], ["loss"], keepdims=0)]
    model = make_model(nodes, [vi("k", [2])], [vi("loss", [])], [tensor("W", w)])
    s = TrainingSession(model.SerializeToString(), TrainingParameters(loss_output_name="loss",
                                                                      training_optimizer_name="sgd"), providers=CPU)
    k = np.array([1.0, -2.0], np.float32)
    np.testing.assert_allclose(s.eval_step(k), np.sum((w.T @ k) ** 2), rtol=1e-6)
