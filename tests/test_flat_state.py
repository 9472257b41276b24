"""The flat state of a session's step (training.stages.flat, runtime.state, runtime.views): the
weights of one dtype and options, their gradients and optimizer states in one buffer each, the
update a fixed handful of nodes whatever the number of weights, and everything that reads or
writes the state by name unchanged."""

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from gradbuilder import TrainingParameters, TrainingSession
from gradbuilder.runtime.views import view
from gradbuilder.training.stages import flat

from .helpers import make_model, tensor, vi

CPU = ["CPUExecutionProvider"]


def mlp(layers: int, width: int = 8, seed: int = 0) -> onnx.ModelProto:
    """``layers`` x (MatMul, Add, Relu), a MatMul to 3 classes, SoftmaxCrossEntropyLoss."""
    rng = np.random.default_rng(seed)
    nodes, inits, h = [], [], "x"
    for k in range(layers):
        nodes += [helper.make_node("MatMul", [h, f"W{k}"], [f"m{k}"]), helper.make_node("Add", [f"m{k}", f"b{k}"], [f"a{k}"]),
                  helper.make_node("Relu", [f"a{k}"], [f"h{k}"])]
        inits += [tensor(f"W{k}", (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)),
                  tensor(f"b{k}", (0.1 * rng.standard_normal(width)).astype(np.float32))]
        h = f"h{k}"
    nodes += [helper.make_node("MatMul", [h, "Wo"], ["logits"]),
              helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"], reduction="mean")]
    inits.append(tensor("Wo", rng.standard_normal((width, 3)).astype(np.float32)))
    return make_model(nodes, [vi("x", [4, width]), vi("y", [4], TensorProto.INT64)], [vi("loss", [])], inits)


def batches(n: int, width: int = 8, seed: int = 1):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((4, width)).astype(np.float32), "y": rng.integers(0, 3, 4)} for _ in range(n)]


def session(model, threads: int = 1, per_tensor: bool = False, **options) -> TrainingSession:
    """A session on ``model`` with the flat state (on the CPU it is asked for: "auto" picks a
    tensor per weight there), or with ``per_tensor`` a tensor per weight."""
    params = TrainingParameters(loss_output_name="loss", training_optimizer_name=options.pop("optimizer", "adamw"),
                                enable_grad_norm_clip=False,
                                optimizer_state_layout="per_tensor" if per_tensor else "flat", **options)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    return TrainingSession(model, params, sess_options=so, providers=CPU)


def step_graph(s: TrainingSession) -> onnx.ModelProto:
    return onnx.ModelProto.FromString(s.graphs.serialized("step"))


def update_nodes(model: onnx.ModelProto) -> int:
    """The nodes between the groups' gradients (``Weights.<dtype>_grad``) and the state outputs."""
    nodes = list(model.graph.node)
    producer = {o: n for n in nodes for o in n.output}
    consumers = collections.defaultdict(list)
    for n in nodes:
        for i in n.input:
            consumers[i].append(n)
    after, stack = set(), [v for n in nodes for v in n.output if v.endswith("_grad") and v.startswith("Weights.")]
    assert stack
    while stack:
        for n in consumers[stack.pop()]:
            if id(n) not in after:
                after.add(id(n))
                stack.extend(n.output)
    before, stack = set(), [o.name for o in model.graph.output if o.name.endswith(".updated")]
    while stack:
        n = producer.get(stack.pop())
        if n is not None and id(n) not in before:
            before.add(id(n))
            stack.extend(n.input)
    return len(after & before)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "adagrad"])
def test_the_update_does_not_grow_with_the_number_of_weights(optimizer):
    params = {"optimizer": optimizer, "gradient_accumulation_steps": 2}
    counts = [update_nodes(step_graph(session(mlp(layers), **params))) for layers in (4, 40)]
    assert counts[0] == counts[1] and counts[0] < 40, counts


def test_the_step_reads_no_size_on_the_host_and_updates_its_buffers_in_place():
    s = session(mlp(3))
    ops = collections.Counter(n.op_type for n in step_graph(s).graph.node)
    assert not ops.keys() & {"If", "Loop", "Scan", "Shape", "Size", "Range", "ConstantOfShape", "NonZero"}, ops
    assert sorted(s.state.flat) == ["Weights.float32", "Weights.float32.exp_avg", "Weights.float32.exp_avg_sq"]
    pointers = {n: v.data_ptr() for n, v in s.state.flat.items()}
    for feeds in batches(3):
        s.run(["loss"], feeds)
    assert {n: v.data_ptr() for n, v in s.state.flat.items()} == pointers


def _train(s: TrainingSession, feeds_list, nonfinite_at=None, load_at=None) -> list:
    losses = []
    for k, feeds in enumerate(feeds_list):
        if k == load_at:
            values = {"W1": np.full((8, 8), 0.05, np.float32)}
            if "b0.exp_avg" in s.state:  # adam's first moment (float16 with use_fp16_moments)
                values["b0.exp_avg"] = np.full(8, 0.01, s.get_optimizer_state()["b0"]["exp_avg"].dtype)
            s.load_state(values)
        if k == nonfinite_at:
            feeds = {**feeds, "x": np.full_like(feeds["x"], np.nan)}
        losses.append(s.run(["loss"], feeds)[0])
    return losses


@pytest.mark.parametrize("threads", [1, 2, 16])
@pytest.mark.parametrize("options", [
    {"optimizer": "adamw"},
    {"optimizer": "adam", "optimizer_attributes_map": {}},
    {"optimizer": "sgd", "gradient_accumulation_steps": 2},
    {"optimizer": "adagrad"},
    {"optimizer": "adamw", "use_fp16_moments": True},
])
def test_flat_steps_are_bit_identical_to_a_tensor_per_weight(threads, options):
    """The same model trained with groups and with a tensor per weight: the same losses, weights
    and optimizer states to the bit, across a skipped non-finite step and a load_state."""
    model, data = mlp(3), batches(10)
    sessions = [session(model, threads, per_tensor=p, **dict(options)) for p in (False, True)]
    with pytest.warns(RuntimeWarning, match="inf or NaN"):
        got = [_train(s, data, nonfinite_at=3, load_at=6) for s in sessions]
    assert np.array_equal(got[0], got[1], equal_nan=True) and np.isnan(got[0][3])
    assert_same_state(*sessions)
    assert sessions[0].step == sessions[1].step > 3


def assert_same_state(a: TrainingSession, b: TrainingSession) -> None:
    x, y = a.get_state(), b.get_state()
    for w, value in y["model"]["full_precision"].items():
        assert np.array_equal(x["model"]["full_precision"][w], value), w
        for name, state in y["optimizer"][w].items():
            assert np.array_equal(x["optimizer"][w][name], state), (w, name)
    assert np.array_equal(x["optimizer"]["shared_optimizer_state"]["Step"], y["optimizer"]["shared_optimizer_state"]["Step"])


@pytest.mark.parametrize("threads", [1, 2, 16])
def test_the_state_by_name_is_the_groups_buffer(threads):
    flat_s, tensor_s = (session(mlp(3), threads, per_tensor=p) for p in (False, True))
    for feeds in batches(4):
        for s in (flat_s, tensor_s):
            s.run(["loss"], feeds)
    assert_same_state(flat_s, tensor_s)
    a = flat_s.get_state()
    # each weight is its place in the buffer, and a weight set by name is written there
    (group,) = [g for g in flat.layout(flat_s.parts.facts.specs, flat_s.parts.builder.options_of, "adamw")]
    buffer = flat_s.state.flat[group.name].numpy()
    for m in group.members:
        assert np.array_equal(buffer[m.offset: m.offset + m.size].reshape(m.shape), a["model"]["full_precision"][m.name])
    flat_s.load_state({"b1": np.arange(8, dtype=np.float32)})
    member = next(m for m in group.members if m.name == "b1")
    assert np.array_equal(flat_s.state.flat[group.name].numpy()[member.offset: member.offset + 8], np.arange(8))
    assert np.array_equal(flat_s.get_state()["model"]["full_precision"]["b1"], np.arange(8))


def test_checkpoints_move_between_flat_and_per_tensor_sessions(tmp_path):
    """A checkpoint holds weights and states by name whatever the layout: one written by a
    session with a tensor per weight (as every earlier release) resumes in a flat one, and the
    other way round, continuing exactly as the session that wrote it."""
    model, data = mlp(3), batches(8)
    for writer_flat in (False, True):
        writer = session(model, per_tensor=not writer_flat)
        _train(writer, data[:4])
        path = tmp_path / f"ck{writer_flat}.safetensors"
        writer.save_checkpoint(path)
        reader = session(model, per_tensor=writer_flat)
        reader.load_checkpoint(path)
        assert [float(x) for x in _train(reader, data[4:])] == [float(x) for x in _train(writer, data[4:])]


def test_a_weight_over_the_largest_stays_apart(monkeypatch):
    """A weight of more than flat.LARGEST elements is a tensor of its own, updated in the If as
    before; the others are grouped; both train as a tensor per weight does."""
    monkeypatch.setattr(flat, "LARGEST", 50)
    model, data = mlp(2), batches(5)
    s = session(model)
    assert {m.name for g in s.parts.builder.flat_layout for m in g.members} == {"b0", "b1", "Wo"}
    ops = collections.Counter(n.op_type for n in step_graph(s).graph.node)
    assert ops["If"] == 1
    reference = session(model, per_tensor=True)
    assert [float(x) for x in _train(s, data)] == [float(x) for x in _train(reference, data)]


def test_the_export_and_eval_read_the_trained_weights(tmp_path):
    s = session(mlp(2))
    for feeds in batches(3):
        s.run(["loss"], feeds)
    path = s.export_model_for_inferencing(tmp_path / "inference.onnx", ["loss"])
    feeds = batches(1, seed=5)[0]
    exported = ort.InferenceSession(str(path), providers=CPU).run(None, feeds)[0]
    assert np.allclose(exported, s.eval_step(feeds["x"], feeds["y"]), rtol=1e-6)


def test_a_view_shares_the_buffers_memory_and_keeps_it_alive():
    for dtype in (np.float32, np.float16, np.float64):
        buffer = ort.OrtValue.ortvalue_from_numpy(np.arange(12, dtype=dtype))
        v, scalar = view(buffer, 2, [2, 3]), view(buffer, 11, [])
        del buffer
        assert v.shape() == [2, 3] and np.array_equal(v.numpy(), np.arange(2, 8, dtype=dtype).reshape(2, 3))
        assert float(scalar.numpy()) == 11
        v.update_inplace(np.full((2, 3), 7, dtype))
        v.numpy()[0, 0] = 5  # on the CPU numpy() is the memory itself
        assert v.numpy().tolist() == [[5, 7, 7], [7, 7, 7]]


def test_the_layout_follows_the_device_unless_asked():
    """"auto" (the default) is a tensor per weight on the CPU, whose caches hold one weight's
    update and not the whole model's (PyTorch's optimizers too use their foreach kernels on
    CUDA only); "flat" and "per_tensor" are what they say; anything else is refused."""
    params = TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw")
    assert params.optimizer_state_layout == "auto"
    assert TrainingSession(mlp(2), params, providers=CPU).state.flat == {}
    assert session(mlp(2)).state.flat and not session(mlp(2), per_tensor=True).state.flat
    with pytest.raises(Exception, match="optimizer_state_layout: must be 'auto'"):
        TrainingParameters(optimizer_state_layout="fused")


def test_mixed_precision_reads_one_half_copy_of_each_group():
    """float16: the forward reads the weights from one Cast of the group's buffer (no Cast per
    weight), the half gradients are joined in half and cast once, and training follows float32
    training to float16's rounding (a static loss scale: no step skipped). (A tensor per weight
    is no reference here: onnxruntime's CPU provider, which has no float16 MatMul, drops each
    weight's Cast pair around it and computes those products in float32.)"""
    model, data = mlp(3), batches(8)
    half = session(model, use_mixed_precision=True, loss_scale=128.0)
    step = step_graph(half)
    casts = [n for n in step.graph.node if n.op_type == "Cast"]
    weights = {m.name for g in half.parts.builder.flat_layout for m in g.members}
    assert sum(n.input[0] == "Weights.float32" for n in casts) == 1
    assert not any(n.input[0] in weights for n in casts)
    got = _train(half, data)
    want = _train(session(model), data)
    np.testing.assert_allclose(got, want, rtol=2e-3)
    assert half.step == len(data) and half.skipped_steps == 0


@pytest.mark.parametrize("threads", [1, 2, 16])
def test_a_flat_session_trains_as_pytorch_does(tmp_path, threads):
    """The whole workflow against PyTorch with the flat state: a torch MLP exported, ten AdamW
    steps (losses and weights), then the exported inference model against the module."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))

    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.net(x), y)

    from .test_cuts import export

    data = batches(10)
    s = session(export(WithLoss(), data[0]), threads)
    assert s.state.flat
    reference = WithLoss()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    s.set_learning_rate(1e-3)
    for feeds in data:
        loss = float(s.run(["loss"], feeds)[0])
        opt.zero_grad()
        want = reference(torch.from_numpy(feeds["x"]), torch.from_numpy(feeds["y"]))
        want.backward()
        opt.step()
        assert abs(loss - float(want)) <= 1e-5 * max(1.0, abs(float(want)))
    got = s.get_state()["model"]["full_precision"]
    for name, p in reference.named_parameters():
        np.testing.assert_allclose(got[name], p.detach().numpy(), rtol=1e-5, atol=1e-6)
    path = s.export_model_for_inferencing(tmp_path / "inference.onnx", ["loss"])
    feeds = batches(1, seed=9)[0]
    exported = ort.InferenceSession(str(path), providers=CPU).run(None, feeds)[0]
    with torch.no_grad():
        np.testing.assert_allclose(exported, float(reference(torch.from_numpy(feeds["x"]), torch.from_numpy(feeds["y"]))),
                                   rtol=1e-5)


def test_mixed_precision_reads_a_torch_exports_transposed_weights_from_the_half_copy():
    """A TorchScript export reads each Linear weight as Transpose(W) (W^T): under float16 the
    step reads it as the Transpose of the weight's half view, not a Cast per weight, and still
    trains as float32 does to float16's rounding."""
    import torch

    from .torch_models import TinyEncoder, export

    tokens, labels = torch.randint(0, 20, (4, 6)), torch.randint(0, 5, (4,))
    model = export(TinyEncoder(20).train(), (tokens, labels), ["x", "y"], dynamo=False, opset=17)
    data = [{"x": tokens.numpy(), "y": labels.numpy()}] * 6
    half = session(model, use_mixed_precision=True, loss_scale=128.0)
    step = step_graph(half)
    producer = {o: n for n in step.graph.node for o in n.output}
    casts = [n for n in step.graph.node if n.op_type == "Cast"]
    assert sum(n.input[0] == "Weights.float32" for n in casts) == 1

    def of_float32_buffer(name: str, layout=("Split", "Reshape", "Transpose")) -> bool:
        node = producer.get(name)
        return node is not None and node.op_type in layout and (
            node.input[0] == "Weights.float32" or of_float32_buffer(node.input[0]))

    assert not [n.name for n in casts if of_float32_buffer(n.input[0])]  # no weight cast on its own
    np.testing.assert_allclose(_train(half, data), _train(session(model), data), rtol=5e-3)
    assert half.skipped_steps == 0
