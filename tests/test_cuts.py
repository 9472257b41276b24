"""Pipeline stages (gradbuilder.compiler.cuts): the stages run in sequence give the whole
model's loss, their backwards run in reverse give its gradients, and bad cuts are refused
with messages that say what to change."""

import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from gradbuilder import GradientGraphBuilder
from gradbuilder.compiler.cuts import CutEdge, Stage, balanced_cuts, cut_model, parse_cuts
from gradbuilder.errors import InvalidArgumentError
from gradbuilder.testing import run_onnxruntime

from .helpers import make_model, tensor, vi
from .torch_models import TinyEncoder

ORT_EXAMPLE = "1393:407-1463/1585/1707,2369:407-2439/2561/2683"


# ---------------------------------------------------------------------------- models
class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8),
                                       torch.nn.ReLU(), torch.nn.Linear(8, 3))

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.net(x), y)


def export(module: torch.nn.Module, feeds: dict[str, np.ndarray]) -> onnx.ModelProto:
    """The module with its loss (TorchScript exporter, opset 17), initializers not graph inputs."""
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), tuple(torch.from_numpy(v) for v in feeds.values()), f,
                          input_names=list(feeds), output_names=["loss"], dynamo=False, opset_version=17,
                          keep_initializers_as_inputs=True)
    model = onnx.load_from_string(f.getvalue())
    inits = {t.name for t in model.graph.initializer}
    kept = [i for i in model.graph.input if i.name not in inits]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    return model


def float_weights(model: onnx.ModelProto) -> list[str]:
    return [t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT]


@pytest.fixture(scope="module")
def mlp():
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((4, 6)).astype(np.float32), "y": rng.integers(0, 3, (4,)).astype(np.int64)}
    return export(MLP(), feeds), feeds


@pytest.fixture(scope="module")
def encoder():
    rng = np.random.default_rng(1)
    feeds = {"x": rng.integers(0, 20, (3, 7)).astype(np.int64), "y": rng.integers(0, 5, (3,)).astype(np.int64)}
    return export(TinyEncoder(20), feeds), feeds


def skip_model() -> onnx.ModelProto:
    """Three layers with a skip from the first to the third, a float mask computed from an
    input, and an integer value computed from the weights read two stages later:

    h1 = tanh(x W1); idx = argmax(x W1); h2 = tanh(h1 W2); h3 = h2 W3 + h1
    loss = sum((h3 * m + gather(h2, idx))^2), m = float(mask)
    """
    rng = np.random.default_rng(2)
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["a1"], name="mm1"),
        helper.make_node("Tanh", ["a1"], ["h1"], name="tanh1"),
        helper.make_node("ArgMax", ["a1"], ["idx"], name="argmax", axis=1, keepdims=0),
        helper.make_node("Cast", ["mask"], ["m"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["h1", "W2"], ["a2"], name="mm2"),
        helper.make_node("Tanh", ["a2"], ["h2"], name="tanh2"),
        helper.make_node("MatMul", ["h2", "W3"], ["a3"], name="mm3"),
        helper.make_node("Add", ["a3", "h1"], ["h3"], name="skip"),
        helper.make_node("Mul", ["h3", "m"], ["masked"], name="apply_mask"),
        helper.make_node("Gather", ["h2", "idx"], ["picked"], name="pick", axis=1),
        helper.make_node("Add", ["masked", "picked"], ["out"], name="add_picked"),
        helper.make_node("Mul", ["out", "out"], ["sq"], name="square"),
        helper.make_node("ReduceSum", ["sq"], ["loss"], name="sum", keepdims=0),
    ]
    inits = [tensor(f"W{i}", rng.standard_normal((4, 4)).astype(np.float32) * 0.5) for i in (1, 2, 3)]
    return make_model(nodes, [vi("x", [4, 4]), vi("mask", [4, 4], TensorProto.BOOL)], [vi("loss", [])], inits)


SKIP_FEEDS = {"x": np.random.default_rng(3).standard_normal((4, 4)).astype(np.float32),
              "mask": np.random.default_rng(4).random((4, 4)) > 0.3}
SKIP_WEIGHTS = ["W1", "W2", "W3"]
# cut 0 after tanh1: h1, the mask and idx go on; cut 1 after tanh2: h1 and m are passed on by stage 1
SKIP_CUTS = "h1:m-apply_mask:idx,h2:h1-skip:m:idx"


# ---------------------------------------------------------------------------- running stages
def whole(model, feeds, weights, loss="loss"):
    """The whole model's loss and weight gradients from GradientGraphBuilder."""
    built = GradientGraphBuilder(model, weights=weights, outputs=[loss], loss=loss).build().get_model()
    out = run_onnxruntime(built, feeds)
    return out[loss], {w: out[f"{w}_grad"] for w in weights}


def run_stages(stages: list[Stage], feeds, values):
    """The loss of the stages' forwards run in sequence, and the weight gradients of their
    backwards run in reverse from a seed of 1 for the loss; each stage sees only what it reads
    and what the stage before sends."""
    sent, saved = {}, []
    for st in stages:
        split = st.split()
        out = run_onnxruntime(split.forward, {**feeds, **values, **{r: sent[r] for r in st.receives}})
        assert set(st.sends) <= set(out)
        saved.append(out)
        sent = {s: out[s] for s in st.sends}
    loss = saved[-1][stages[-1].loss]
    seeds, grads = {stages[-1].loss: np.ones_like(loss)}, {}
    for st in reversed(stages):
        split = st.split()
        received = {r: saved[st.index - 1][r] for r in st.receives}
        fed = {**feeds, **values, **received, **saved[st.index]}
        fed.update({seed: seeds[out] for seed, out in split.seeds.items()})
        out = run_onnxruntime(split.backward, fed)
        grads.update({w: out[split.gradients[w]] for w in st.weights})
        seeds = {r: out[split.gradients[r]] if split.gradients.get(r) else np.zeros_like(received[r])
                 for r in received if r in split.gradients}
        assert set(seeds) == {r for r in received if received[r].dtype == np.float32}
    return loss, grads


def initializer_values(model):
    return {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}


def assert_pipeline_matches(model, cuts, feeds, weights, count):
    before = model.SerializeToString()
    stages = cut_model(model, cuts, "loss", weights)
    assert len(stages) == count
    for st in stages:
        onnx.checker.check_model(st.model, full_check=True)
        ort.InferenceSession(st.model.SerializeToString(), providers=["CPUExecutionProvider"])
        assert [i.name for i in st.model.graph.input] == st.inputs + st.receives
        if st.index:
            assert st.receives == stages[st.index - 1].sends
    assert sorted(w for st in stages for w in st.weights) == sorted(weights)
    assert [o.name for o in stages[-1].model.graph.output] == ["loss"]
    loss, grads = run_stages(stages, feeds, initializer_values(model))
    ref_loss, ref_grads = whole(model, feeds, weights)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for w in weights:
        scale = np.abs(ref_grads[w]).max()
        np.testing.assert_allclose(grads[w], ref_grads[w], rtol=1e-5, atol=1e-5 * scale, err_msg=w)
    assert model.SerializeToString() == before
    return stages


# ---------------------------------------------------------------------------- parse_cuts
def test_parse_ort_string():
    assert parse_cuts(ORT_EXAMPLE) == [
        [CutEdge("1393"), CutEdge("407", ("1463", "1585", "1707"))],
        [CutEdge("2369"), CutEdge("407", ("2439", "2561", "2683"))],
    ]
    assert parse_cuts("a") == [[CutEdge("a")]]
    assert parse_cuts(" a : b-c ") == [[CutEdge("a"), CutEdge("b", ("c",))]]
    assert parse_cuts("") == []


def test_parse_lists():
    assert parse_cuts(["a", ["b", "c"]]) == [[CutEdge("a")], [CutEdge("b"), CutEdge("c")]]
    # names a list can hold and the string cannot
    assert parse_cuts(["/net/x-y:z", [CutEdge("v", ("n/1",))]]) == [[CutEdge("/net/x-y:z")],
                                                                    [CutEdge("v", ("n/1",))]]
    cuts = parse_cuts(ORT_EXAMPLE)
    assert parse_cuts(cuts) == cuts
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        parse_cuts(["a", []])
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        parse_cuts([3])


@pytest.mark.parametrize("spec, piece", [("a,,b", ""), ("a::b", ""), ("a,", ""), ("-b", "-b"), ("a-", "a-"),
                                         ("a-b//c", "a-b//c"), ("a-b-c", "a-b-c"), ("a:b-c/", "b-c/")])
def test_parse_errors(spec, piece):
    with pytest.raises(InvalidArgumentError) as err:
        parse_cuts(spec)
    message = str(err.value)
    assert "\n" not in message
    assert "TrainingParameters.pipeline_cut_info_string" in message
    assert f"cannot read {piece!r}" in message
    assert "separated by ':'" in message and "'value-consumer/consumer/...'" in message


# ---------------------------------------------------------------------------- stages reproduce the model
def test_mlp_two_stages(mlp):
    model, feeds = mlp
    stages = assert_pipeline_matches(model, "/net/net.1/Relu_output_0", feeds, float_weights(model), 2)
    assert stages[0].sends == stages[1].receives == ["/net/net.1/Relu_output_0"]
    assert stages[0].weights == ["net.0.weight", "net.0.bias"]
    assert stages[0].inputs == ["x"] and stages[1].inputs == ["y"]


def test_mlp_three_stages(mlp):
    model, feeds = mlp
    cuts = ["/net/net.1/Relu_output_0", "/net/net.3/Relu_output_0"]
    stages = assert_pipeline_matches(model, cuts, feeds, float_weights(model), 3)
    assert [st.weights for st in stages] == [["net.0.weight", "net.0.bias"], ["net.2.weight", "net.2.bias"],
                                             ["net.4.weight", "net.4.bias"]]
    assert stages[1].inputs == [] and stages[2].sends == []


@pytest.mark.parametrize("count, values", [(2, ["/net/net.1/Relu_output_0"]),
                                           (3, ["/net/net.1/Relu_output_0", "/net/net.3/Relu_output_0"])])
def test_mlp_balanced(mlp, count, values):
    """Three Gemms of 2*4*6*8, 2*4*8*8 and 2*4*8*3 FLOPs: two stages split after the first
    (384 | 704 rather than 896 | 192), three take one each; among equal costs the cut goes
    after the activation."""
    model, feeds = mlp
    before = model.SerializeToString()
    cuts = balanced_cuts(model, count, "loss", float_weights(model))
    assert model.SerializeToString() == before
    assert cuts == [[CutEdge(v)] for v in values]
    assert_pipeline_matches(model, cuts, feeds, float_weights(model), count)


def encoder_layer_output(model, layer=0):
    name = f"/enc/layers.{layer}/norm2/LayerNormalization"
    return next(n.output[0] for n in model.graph.node if n.name == name)


def test_encoder_two_stages(encoder):
    model, feeds = encoder
    weights = float_weights(model)
    assert len(weights) > 20
    stages = assert_pipeline_matches(model, [encoder_layer_output(model)], feeds, weights, 2)
    assert stages[0].inputs == ["x"] and stages[1].inputs == ["y"]
    assert "emb.weight" in stages[0].weights and "head.weight" in stages[1].weights
    # constants that layer 1 reads from layer 0's Constant nodes are copied into stage 1
    shared = {n.output[0] for n in model.graph.node if n.op_type == "Constant" and "layers.0" in n.name}
    assert shared & {v for n in stages[1].model.graph.node for v in n.input}


def test_encoder_balanced(encoder):
    model, feeds = encoder
    weights = float_weights(model)
    cuts = balanced_cuts(model, 2, "loss", weights)
    assert len(cuts) == 1 and len(cuts[0]) == 1
    stages = assert_pipeline_matches(model, cuts, feeds, weights, 2)
    cost = [sum(int(np.prod(initializer_values(model)[w].shape)) for w in st.weights) for st in stages]
    assert min(cost) > 0.25 * sum(cost)  # the cut is near the middle, between the two layers
    assert cuts[0][0].value.startswith(("/enc/layers.0/", "/enc/layers.1/"))


def test_pass_through_mask_and_integer_values():
    """A value cut twice (onnxruntime-training's example shape: the same value in both cuts,
    each with its own consumers) is passed on by the middle stage; integer values take no
    gradient; a float mask computed from an input is passed on like an activation."""
    model = skip_model()
    stages = assert_pipeline_matches(model, SKIP_CUTS, SKIP_FEEDS, SKIP_WEIGHTS, 3)
    assert stages[0].sends == ["h1", "m", "idx"] and stages[1].sends == ["h2", "h1", "m", "idx"]
    assert stages[0].inputs == ["x", "mask"] and stages[1].inputs == [] and stages[2].inputs == []
    middle = stages[1].split()
    assert set(middle.seeds) == {"h2_grad_output", "h1_grad_output", "m_grad_output"}
    assert set(middle.gradients) == {"h1", "m", "W2"}
    stages = assert_pipeline_matches(model, balanced_cuts(model, 3, "loss", SKIP_WEIGHTS), SKIP_FEEDS,
                                     SKIP_WEIGHTS, 3)


def test_model_given_as_bytes_and_path(tmp_path, mlp):
    model, _ = mlp
    path = tmp_path / "mlp.onnx"
    onnx.save(model, path)
    for given in (model.SerializeToString(), str(path)):
        stages = cut_model(given, "/net/net.1/Relu_output_0", "loss", float_weights(model))
        assert [st.sends for st in stages] == [["/net/net.1/Relu_output_0"], []]


# ---------------------------------------------------------------------------- refused cuts
def refused(model, cuts, match, weights=SKIP_WEIGHTS):
    before = model.SerializeToString()
    with pytest.raises(InvalidArgumentError, match=match) as err:
        cut_model(model, cuts, "loss", weights)
    assert "\n" not in str(err.value)
    assert model.SerializeToString() == before


def test_unknown_value_and_consumer():
    model = skip_model()
    refused(model, "nope", r"pipeline cut 0: 'nope' is not a value of the graph")
    refused(model, "h1,h2:h1-tanh2:m:idx", r"pipeline cut 1: 'tanh2' is not a node reading 'h1' \(its readers: "
                                          r"mm2, skip\); name a reader by its node name or one of its outputs")
    refused(model, "x", r"pipeline cut 0: 'x' is a graph input or a weight, which every stage reads directly")
    refused(model, "W1", r"'W1' is a graph input or a weight")


def test_consumers_named_by_output():
    model = skip_model()
    by_name = cut_model(model, "h1:m-apply_mask:idx,h2:h1-skip:m:idx", "loss", SKIP_WEIGHTS)
    by_output = cut_model(model, "h1:m-masked:idx,h2:h1-h3:m:idx", "loss", SKIP_WEIGHTS)
    assert [st.model.SerializeToString() for st in by_name] == [st.model.SerializeToString() for st in by_output]


def test_cut_that_does_not_separate():
    model = skip_model()
    # m is computed in stage 0 and read in stage 2: cut 1 must pass it on too
    refused(model, "h1:m-apply_mask:idx,h2:h1-skip:idx",
            r"pipeline cut 1 does not separate the graph: 'm' \(computed by node 'cast' in stage 0\) is read by "
            r"node 'apply_mask' in stage 2; add it to cut 1")
    # the skip h1 -> h3 crosses cut 0 as well
    refused(model, "a2,h2:h1-skip:m:idx", r"pipeline cut 0 does not separate the graph: 'h1' .* add it to cut 0")


def test_empty_stage(mlp):
    model, _ = mlp
    refused(model, "/net/net.1/Relu_output_0,/net/net.1/Relu_output_0",
            r"pipeline cuts: stage 1 has no node: every node after cut 0 is also after cut 1", float_weights(model))


def test_loss_not_in_last_stage():
    model = skip_model()
    model.graph.node.append(helper.make_node("Tanh", ["h2"], ["aux"], name="aux"))
    model.graph.output.append(vi("aux", [4, 4]))
    refused(model, "h2-aux", r"the loss 'loss' \(node 'sum'\) is in stage 0, not in the last stage 1; cut only "
                             r"values the loss is computed from")
    with pytest.raises(InvalidArgumentError, match="the loss 'nope' is not computed by a node"):
        cut_model(model, "h1", "nope", SKIP_WEIGHTS)


def test_tied_weights_across_stages():
    model = skip_model()
    model.graph.node[4].input[1] = "W1"  # mm2 reads W1: the first and second layers share it
    refused(model, "h1:m:idx", r"weight 'W1' is read by node 'mm1' in stage 0, node 'mm2' in stage 1; tied weights "
                               r"across stages are not supported")


def test_cuts_out_of_order(mlp):
    model, _ = mlp
    refused(model, "/net/net.3/Relu_output_0,/net/net.1/Relu_output_0",
            r"pipeline cut 0: '/net/net.3/Relu_output_0' is computed by node '/net/net.3/Relu', which the cuts put "
            r"in stage 2, after cut 0; the cuts are out of order", float_weights(model))


def test_unknown_weight(mlp):
    model, _ = mlp
    refused(model, "/net/net.1/Relu_output_0", r"the weights \['w'\] are not initializers", ["w"])


def test_balanced_needs_enough_places(mlp):
    model, _ = mlp
    with pytest.raises(InvalidArgumentError, match=r"balanced_cuts: the graph has 5 places where a single value "
                                                   r"crosses, and 10 stages need 9"):
        balanced_cuts(model, 10, "loss", float_weights(model))
    assert balanced_cuts(model, 1, "loss", float_weights(model)) == []
