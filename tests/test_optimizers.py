"""The optimizer update in the training graph against torch.optim, step for step: a small MLP
exported from torch, trained 25 steps by a plain onnxruntime loop that binds each step's
outputs to the next step's inputs, and by torch with the same data."""

import numpy as np
import pytest
import torch

from gradbuilder.testing import ort_session
from gradbuilder.training.graph import TrainingGraphBuilder

from .torch_models import export

STEPS = 25


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc2(torch.tanh(self.fc1(x))), y)


def training_run(seed: int, runs: int, **builder_options):
    """An MLP (torch seed 0), ``runs`` batches from ``seed``, its training graph on onnxruntime
    and the first feeds: (module, xs, ys, builder, session, output names, state)."""
    torch.manual_seed(0)
    module = MLP()
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((5, 6)).astype(np.float32) for _ in range(runs)]
    ys = [rng.standard_normal((5, 3)).astype(np.float32) for _ in range(runs)]
    model = export(module, (torch.from_numpy(xs[0]), torch.from_numpy(ys[0])), ["x", "y"], dynamo=False, opset=17)
    weights = [n for n, _ in module.named_parameters()]
    builder = TrainingGraphBuilder(model, weights, "loss", **builder_options).build()
    sess = ort_session(builder.get_model())
    state = builder.initial_state()
    state.update({w: p.detach().numpy().copy() for w, p in module.named_parameters()})
    return module, xs, ys, builder, sess, [o.name for o in sess.get_outputs()], state


def next_state(got: dict) -> dict:
    """This step's ``*.updated`` outputs as the next step's inputs."""
    return {k[: -len(".updated")]: v for k, v in got.items() if k.endswith(".updated")}


def assert_weights_match(state, module):
    for w, p in module.named_parameters():
        ref = p.detach().numpy()
        # norm-wise: float32 round-off in the gradients (onnxruntime's kernels vs torch's) moves
        # single elements whose gradient is ~0, which Adam's normalisation amplifies
        assert np.linalg.norm(state[w] - ref) <= 1e-5 * np.linalg.norm(ref), (w, np.abs(state[w] - ref).max())


CASES = [
    ("sgd", {}, torch.optim.SGD, {}),
    ("sgd", {"momentum": 0.9}, torch.optim.SGD, {"momentum": 0.9}),
    ("sgd", {"momentum": 0.9, "dampening": 0.3, "weight_decay": 0.01},
     torch.optim.SGD, {"momentum": 0.9, "dampening": 0.3, "weight_decay": 0.01}),
    ("sgd", {"momentum": 0.8, "nesterov": True, "weight_decay": 0.05},
     torch.optim.SGD, {"momentum": 0.8, "nesterov": True, "weight_decay": 0.05}),
    ("adam", {}, torch.optim.Adam, {}),
    ("adam", {"betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.02, "amsgrad": True},
     torch.optim.Adam, {"betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.02, "amsgrad": True}),
    ("adamw", {}, torch.optim.AdamW, {}),
    ("adamw", {"weight_decay": 0.1, "amsgrad": True}, torch.optim.AdamW, {"weight_decay": 0.1, "amsgrad": True}),
    ("adagrad", {}, torch.optim.Adagrad, {}),
    ("adagrad", {"lr_decay": 0.01, "weight_decay": 0.01, "initial_accumulator_value": 0.1},
     torch.optim.Adagrad, {"lr_decay": 0.01, "weight_decay": 0.01, "initial_accumulator_value": 0.1}),
]


@pytest.mark.parametrize("name,options,torch_cls,torch_options", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_optimizer_matches_torch(name, options, torch_cls, torch_options):
    lr = 0.05
    module, xs, ys, _, sess, out_names, state = training_run(0, STEPS, optimizer=name, optimizer_options=options)
    opt = torch_cls(module.parameters(), lr=lr, **torch_options)
    for step in range(STEPS):
        feeds = {"x": xs[step], "y": ys[step], "Learning_Rate": np.array(lr, np.float32), **state}
        got = dict(zip(out_names, sess.run(None, feeds)))
        opt.zero_grad()
        loss = module(torch.from_numpy(xs[step]), torch.from_numpy(ys[step]))
        loss.backward()
        opt.step()
        np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-5, atol=1e-7)
        state = next_state(got)
    assert_weights_match(state, module)


@pytest.mark.parametrize("accumulation,max_norm", [(1, 0.05), (3, None), (3, 0.05)])
def test_accumulation_and_clipping_match_torch(accumulation, max_norm):
    """torch: backward() on each of N micro-batches sums .grad, then clip_grad_norm_, then
    AdamW.step(); ours: one run per micro-batch, the update on every N-th."""
    runs = 6 * accumulation
    module, xs, ys, _, sess, out_names, state = training_run(1, runs, optimizer="adamw", max_grad_norm=max_norm,
                                                             accumulation_steps=accumulation)
    opt = torch.optim.AdamW(module.parameters(), lr=0.01)
    for k in range(runs):
        feeds = {"x": xs[k], "y": ys[k], "Learning_Rate": np.array(0.01, np.float32), **state}
        state = next_state(dict(zip(out_names, sess.run(None, feeds))))
        module(torch.from_numpy(xs[k]), torch.from_numpy(ys[k])).backward()
        if (k + 1) % accumulation == 0:
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)
            opt.step()
            opt.zero_grad()
        assert int(state["Step"]) == (k + 1) // accumulation  # no update mid-accumulation
    assert_weights_match(state, module)


def lamb_reference(w, g, m, v, t, lr, b1, b2, eps, wd, bias_correction=True):
    """LAMB, Algorithm 2 of You et al. (2019), in float64 numpy."""
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    mh, vh = (m / (1 - b1**t), v / (1 - b2**t)) if bias_correction else (m, v)
    u = mh / (np.sqrt(vh) + eps) + wd * w
    wn, un = np.linalg.norm(w), np.linalg.norm(u)
    ratio = wn / un if wn > 0 and un > 0 else 1.0
    return w - lr * ratio * u, m, v


@pytest.mark.parametrize("wd,bias_correction", [(0.0, True), (0.01, True), (0.01, False)])
def test_lamb_matches_the_paper(wd, bias_correction):
    """Gradients from the graph itself (gradients_as_outputs); the update against the
    paper's formula in float64, 20 steps, from the same gradients."""
    options = {"betas": (0.9, 0.99), "eps": 1e-6, "weight_decay": wd, "bias_correction": bias_correction}
    module, xs, ys, _, sess, names, state = training_run(2, 1, optimizer="lamb", optimizer_options=options,
                                                         gradients_as_outputs=True)
    x, y, weights = xs[0], ys[0], [n for n, _ in module.named_parameters()]
    ref = {w: (state[w].astype(np.float64), 0.0, 0.0) for w in weights}
    for step in range(20):
        got = dict(zip(names, sess.run(None, {"x": x, "y": y, "Learning_Rate": np.array(0.01, np.float32), **state})))
        for w in weights:
            _, m, v = ref[w]
            ref[w] = lamb_reference(state[w].astype(np.float64), got[f"{w}_grad"].astype(np.float64), m, v,
                                    step + 1, 0.01, 0.9, 0.99, 1e-6, wd, bias_correction)
            np.testing.assert_allclose(got[f"{w}.updated"], ref[w][0], rtol=1e-5, atol=1e-6)
        state = next_state(got)


def test_training_parameters_drive_100_steps_like_torch(tmp_path):
    """TrainingParameters with onnxruntime-training's names (AdamOptimizer, alpha/beta/lambda/
    epsilon, max_norm_clip, gradient accumulation) build the graphs; a plain onnxruntime loop
    trains 100 steps and follows torch's loss curve (AdamW + clip_grad_norm_) to 1e-4."""
    from gradbuilder import TrainingParameters
    from gradbuilder.training.graph import from_parameters

    torch.manual_seed(0)
    module = MLP()
    rng = np.random.default_rng(3)
    runs = 100
    xs = [rng.standard_normal((5, 6)).astype(np.float32) for _ in range(runs)]
    ys = [rng.standard_normal((5, 3)).astype(np.float32) for _ in range(runs)]
    model = export(module, (torch.from_numpy(xs[0]), torch.from_numpy(ys[0])), ["x", "y"], dynamo=False, opset=17)
    weights = [n for n, _ in module.named_parameters()]
    attrs = {"alpha": 0.85, "beta": 0.995, "lambda": 0.01, "epsilon": 1e-7, "max_norm_clip": 0.5}
    p = TrainingParameters()
    p.training_optimizer_name = "AdamOptimizer"
    p.loss_output_name = "loss"
    p.optimizer_attributes_map = {w: attrs for w in weights}
    p.gradient_accumulation_steps = 2
    p.model_with_gradient_graph_path = str(tmp_path / "gradient.onnx")
    p.model_with_training_graph_path = str(tmp_path / "training.onnx")
    builder = from_parameters(model, p).build()
    assert sorted(f.name for f in tmp_path.iterdir()) == ["gradient.onnx", "training.onnx"]
    sess = ort_session(builder.get_model())
    names = [o.name for o in sess.get_outputs()]
    state = builder.initial_state()
    state.update({w: p_.detach().numpy().copy() for w, p_ in module.named_parameters()})
    opt = torch.optim.AdamW(module.parameters(), lr=0.01, betas=(0.85, 0.995), eps=1e-7, weight_decay=0.01)
    ours, theirs = [], []
    for k in range(runs):
        got = dict(zip(names, sess.run(None, {"x": xs[k], "y": ys[k], "Learning_Rate": np.array(0.01, np.float32),
                                                **state})))
        state = next_state(got)
        loss = module(torch.from_numpy(xs[k]), torch.from_numpy(ys[k]))
        loss.backward()
        if k % 2 == 1:
            torch.nn.utils.clip_grad_norm_(module.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
        ours.append(float(got["loss"]))
        theirs.append(loss.item())
    np.testing.assert_allclose(ours, theirs, rtol=1e-4)
    assert theirs[-1] < theirs[0]  # it trains


def test_weight_selection_immutable_weights_and_initial_state():
    """Default weights: every float initializer, less weights_not_to_train and the constants
    immutable_weights names (op type, input, value); set_optimizer_initial_state seeds states."""
    from onnx import helper, numpy_helper

    from gradbuilder import InvalidArgumentError, TrainingParameters
    from gradbuilder.training.graph import from_parameters

    from .helpers import make_model, vi

    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "B"], ["y"]),
             helper.make_node("Div", ["y", "scale"], ["z"]), helper.make_node("Mul", ["z", "gain"], ["g"]),
             helper.make_node("ReduceSum", ["g"], ["loss"], keepdims=0)]
    inits = [numpy_helper.from_array(np.ones((3, 2), np.float32), "W"), numpy_helper.from_array(np.ones(2, np.float32), "B"),
             numpy_helper.from_array(np.array(8.0, np.float32), "scale"), numpy_helper.from_array(np.array(2.0, np.float32), "gain")]
    model = make_model(nodes, [vi("x", [2, 3])], [vi("loss", [])], inits)
    p = TrainingParameters()
    p.training_optimizer_name = "adam"
    p.loss_output_name = "loss"
    p.weights_not_to_train = {"gain"}
    p.immutable_weights = {"Div": [(1, 8.0)]}
    seed = np.full((3, 2), 0.5, np.float32)
    p.set_optimizer_initial_state({"W": {"exp_avg": seed}})
    b = from_parameters(model, p)
    assert b.weights == ["W", "B"]
    np.testing.assert_array_equal(b.build().initial_state()["W.exp_avg"], seed)
    p.weights_to_train = {"W", "scale"}
    with pytest.raises(InvalidArgumentError, match="immutable"):
        from_parameters(model, p)
