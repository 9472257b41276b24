"""Inputs gradbuilder cannot use as they are: each gets a clear error (type and message) or a
warning that points at the caller's line, and what can be fixed is fixed (IR versions,
external data with base_dir, onnx-graphsurgeon graphs, the training graph's state interface).
"""

from __future__ import annotations

import io
import sys
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper, numpy_helper

from gradbuilder import (GradientGraphBuilder, TrainingGraphBuilder, TrainingParameters, TrainingSession,
                         state_interface)
from gradbuilder.training.artifacts import export_model_for_inferencing, generate_artifacts
from gradbuilder.compat import MissingDependencyError, runtime_limits
from gradbuilder.errors import InvalidArgumentError, ModelLoadError
from gradbuilder.training.web import export_web

CPU = ["CPUExecutionProvider"]
MAX_IR, MAX_OPSET = runtime_limits()
# Whether the installed onnx writes what the installed onnxruntime cannot read (onnxruntime
# 1.31: IR 13 and opset 26 against onnx 1.23's IR 14 and opset 28; a later onnxruntime may
# read all of it, and the cases below then expect what it does).
NEWER_IR = onnx.IR_VERSION > MAX_IR
NEWER_OPSET = onnx.defs.onnx_opset_version() > MAX_OPSET


# ------------------------------------------------------------------ models
def linear(ir_version=8, opset=17, weight_as_input=False, rows=64) -> onnx.ModelProto:
    """loss = ReduceSum(x @ W + B); x: [batch, rows]."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((rows, 2)).astype(np.float32), "W"),
             numpy_helper.from_array(np.zeros(2, np.float32), "B")]
    inputs = [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", rows])]
    if weight_as_input:
        inputs.append(helper.make_tensor_value_info("W", onnx.TensorProto.FLOAT, [rows, 2]))
        inits = inits[1:]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"], name="matmul"),
             helper.make_node("Add", ["xw", "B"], ["y"], name="add"),
             helper.make_node("ReduceSum", ["y"], ["loss"], name="sum", keepdims=0)]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, [])],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version)


def with_ir(ir_version):
    return linear(ir_version=ir_version)


def with_float6(model=None):
    """An IR 14 model with a float6 tensor: nothing older than IR 14 holds it."""
    model = model or linear(ir_version=14)
    t = onnx.TensorProto(name="f6", data_type=onnx.TensorProto.FLOAT6E2M3, dims=[1], raw_data=b"\x00")
    model.graph.initializer.append(t)
    return model


def external(tmp_path) -> bytes:
    model = linear()
    onnx.save(model, tmp_path / "m.onnx", save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    return (tmp_path / "m.onnx").read_bytes()


def params(**kw) -> TrainingParameters:
    return TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw", **kw)


def feeds(batch=3, rows=64):
    return {"x": np.random.default_rng(1).standard_normal((batch, rows)).astype(np.float32)}


class Attention(torch.nn.Module):
    """nn.MultiheadAttention: torch's TorchScript exporter writes its sequence length as a constant."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Linear(8, 16)
        self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = torch.nn.Linear(16, 3)

    def forward(self, x, y):
        h = self.emb(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        return torch.nn.functional.cross_entropy(self.out(a).mean(1), y)


def traced_attention() -> bytes:
    torch.manual_seed(0)
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Attention(), (torch.randn(2, 5, 8), torch.randint(0, 3, (2,))), f, dynamo=False,
                          input_names=["x", "y"], output_names=["loss"], opset_version=17,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          dynamic_axes={"x": {0: "batch", 1: "seq"}, "y": {0: "batch"}})
    return f.getvalue()


def run_attention_at_new_length():
    s = TrainingSession(traced_attention(), params(), providers=CPU)
    y = np.array([0, 1])
    s.run(["loss"], {"x": np.zeros((2, 5, 8), np.float32), "y": y})
    s.run(["loss"], {"x": np.zeros((2, 7, 8), np.float32), "y": y})


def gs_node():
    import onnx_graphsurgeon as gs

    return gs.Node(op="Relu")


def without_graphsurgeon():
    saved = sys.modules.get("onnx_graphsurgeon")
    sys.modules["onnx_graphsurgeon"] = None  # import fails as if not installed
    try:
        GradientGraphBuilder(linear(), ["W"], ["loss"], "loss").build().get_graph()
    finally:
        if saved is None:
            del sys.modules["onnx_graphsurgeon"]
        else:
            sys.modules["onnx_graphsurgeon"] = saved


# ------------------------------------------------------------------ the table of errors
ERRORS = [
    ("ir-99-builder", lambda tmp: GradientGraphBuilder(with_ir(99), ["W"], ["loss"], "loss").build(),
     ModelLoadError, "IR version 99"),
    ("ir-99-session", lambda tmp: TrainingSession(with_ir(99), params(), providers=CPU),
     ModelLoadError, "IR version 99"),
    ("ir-99-artifacts", lambda tmp: generate_artifacts(with_ir(99), ["W"], artifact_directory=tmp),
     ModelLoadError, "IR version 99"),
    *([("ir-too-new-for-onnxruntime-session", lambda tmp: TrainingSession(with_float6(), params(), providers=CPU),
        ModelLoadError, "needs ONNX IR version 14")] if NEWER_IR else []),
    ("opset-too-new-session", lambda tmp: TrainingSession(linear(opset=MAX_OPSET + 1), params(), providers=CPU),
     ModelLoadError, f"opset {MAX_OPSET + 1}; onnxruntime {ort.__version__} runs ai.onnx opsets up to {MAX_OPSET}"),
    ("external-data-bytes-builder", lambda tmp: GradientGraphBuilder(external(tmp), ["W"], ["loss"], "loss").build(),
     ModelLoadError, "pass base_dir="),
    ("external-data-bytes-session", lambda tmp: TrainingSession(external(tmp), params(), providers=CPU),
     ModelLoadError, "external data file 'm.onnx.data'"),
    ("external-data-bytes-artifacts", lambda tmp: generate_artifacts(external(tmp), ["W"], artifact_directory=tmp),
     ModelLoadError, "pass base_dir="),
    ("external-data-wrong-base-dir",
     lambda tmp: GradientGraphBuilder(external(tmp), ["W"], ["loss"], "loss", base_dir=tmp / "elsewhere").build(),
     ModelLoadError, "is not a folder"),
    ("artifacts-weight-is-graph-input",
     lambda tmp: generate_artifacts(linear(weight_as_input=True), ["W", "B"], artifact_directory=tmp),
     InvalidArgumentError, "'W' is a graph input without an initializer"),
    ("artifacts-unknown-weight", lambda tmp: generate_artifacts(linear(), ["V"], artifact_directory=tmp),
     InvalidArgumentError, "no initializer named 'V'"),
    ("bfloat16-on-cpu",
     lambda tmp: TrainingSession(linear(), params(use_mixed_precision=True, mixed_precision_dtype="bfloat16"),
                                 providers=CPU),
     InvalidArgumentError, "'bfloat16' needs CUDAExecutionProvider"),
    ("traced-sequence-length", lambda tmp: run_attention_at_new_length(),
     InvalidArgumentError, "Reshape node '/attn/Reshape_4' failed on this input: its target shape holds the constant "
                           "size 5"),
    ("graphsurgeon-node-not-graph", lambda tmp: GradientGraphBuilder(gs_node(), ["W"], ["loss"], "loss").build(),
     ModelLoadError, "must be an onnx_graphsurgeon.Graph, not Node"),
    ("get-graph-without-graphsurgeon", lambda tmp: without_graphsurgeon(),
     MissingDependencyError, "pip install 'gradbuilder[graphsurgeon]'"),
    ("state-interface-of-a-forward-model", lambda tmp: state_interface(linear()),
     InvalidArgumentError, "no input X with an output X.updated"),
]


@pytest.mark.parametrize("action,error,fragment", [pytest.param(*row[1:], id=row[0]) for row in ERRORS])
def test_bad_input_gives_clear_error(tmp_path, action, error, fragment):
    with pytest.raises(error) as info:
        action(tmp_path)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value).strip()


def test_traced_size_error_advises_dynamic_axes():
    with pytest.raises(InvalidArgumentError, match=r"dynamic_axes=\{'x': \{0: 'batch', 1: 'seq'\}"):
        run_attention_at_new_length()


# ------------------------------------------------------------------ IR versions and base_dir
def loads_in_onnxruntime(model) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    data = model if isinstance(model, bytes) else model.SerializeToString()
    return ort.InferenceSession(data, so, providers=CPU)


def test_outputs_of_a_newer_ir_model_load_in_onnxruntime(tmp_path):
    """A model at onnx's own IR version: written at the highest IR onnxruntime reads (the
    model's own where onnxruntime reads it), every output loading."""
    model = linear(ir_version=onnx.IR_VERSION)
    b = GradientGraphBuilder(model, ["W"], ["loss"], "loss").build()
    assert b.model_proto.ir_version == min(MAX_IR, onnx.IR_VERSION)
    loads_in_onnxruntime(b.get_model())
    t = TrainingGraphBuilder(model, ["W"], "loss", optimizer="adamw").build()
    loads_in_onnxruntime(t.get_model())
    written = generate_artifacts(model, ["W", "B"], artifact_directory=tmp_path)
    for key in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
        assert onnx.load(written[key]).ir_version <= MAX_IR
        loads_in_onnxruntime(onnx.load(written[key]))
    export_model_for_inferencing(model, tmp_path / "infer.onnx", ["y"])
    loads_in_onnxruntime(onnx.load(tmp_path / "infer.onnx"))
    s = TrainingSession(model, params(), providers=CPU)
    first = s.run(["loss"], feeds())[0]
    assert s.run(["loss"], feeds())[0] != first  # it trains
    s.train_step(feeds()["x"])
    s.optimizer_step()
    s.eval_step(feeds()["x"])
    s.export_model_for_inferencing(tmp_path / "trained.onnx", ["y"])
    loads_in_onnxruntime(onnx.load(tmp_path / "trained.onnx"))


def test_model_with_types_onnxruntime_cannot_read_warns_at_build():
    """A float6 tensor needs IR 14: a warning where onnxruntime reads less, none where it reads it."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        GradientGraphBuilder(with_float6(), ["W"], ["loss"], "loss").build()
    said = [r for r in record if "needs ONNX IR version 14" in str(r.message)]
    if NEWER_IR:
        assert said and said[0].filename == __file__
    else:
        assert not said


def test_opset_beyond_onnxruntime_warns_at_build_naming_both():
    """An opset onnxruntime does not run: a warning naming both; past onnx's own, onnx's error."""
    if NEWER_OPSET:
        with pytest.warns(UserWarning, match=f"opset {MAX_OPSET + 1}; .* up to {MAX_OPSET}") as record:
            GradientGraphBuilder(linear(opset=MAX_OPSET + 1), ["W"], ["loss"], "loss").build()
        assert record[0].filename == __file__
    else:
        with pytest.raises(ModelLoadError, match=f"opset {MAX_OPSET + 1}, newer than this onnx package supports"):
            GradientGraphBuilder(linear(opset=MAX_OPSET + 1), ["W"], ["loss"], "loss").build()


def test_external_data_from_base_dir(tmp_path):
    data = external(tmp_path)
    x = feeds()
    reference = GradientGraphBuilder(linear(), ["W"], ["loss"], "loss").build().get_model()
    want = loads_in_onnxruntime(reference).run(None, x)
    built = GradientGraphBuilder(data, ["W"], ["loss"], "loss", base_dir=tmp_path).build().get_model()
    got = loads_in_onnxruntime(built).run(None, x)
    for a, b in zip(want, got):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    s = TrainingSession(data, params(), providers=CPU, base_dir=tmp_path)
    np.testing.assert_allclose(s.run(["loss"], x)[0], want[0], rtol=1e-6)
    written = generate_artifacts(data, ["W", "B"], artifact_directory=tmp_path / "art", base_dir=tmp_path)
    loads_in_onnxruntime(onnx.load(written["training_model.onnx"]))


# ------------------------------------------------------------------ exports optimized for inference
class CNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4 * 8 * 8, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


# the tests of cnn_exports are slow: its dynamo exports take seconds (the first in a process more)
@pytest.fixture(scope="module")
def cnn_exports() -> dict[str, onnx.ModelProto]:
    torch.manual_seed(0)
    module, x = CNN().train(), torch.randn(2, 3, 8, 8)
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out["dynamo-default"] = torch.onnx.export(module, (x,), None, dynamo=True, input_names=["x"]).model_proto
        out["dynamo-static-batch"] = torch.onnx.export(module, (x,), None, dynamo=True, input_names=["x"],
                                                       optimize=False).model_proto
        batch = torch.export.Dim("batch", min=2, max=64)
        out["dynamo-for-training"] = torch.onnx.export(module, (x,), None, dynamo=True, input_names=["x"],
                                                       optimize=False, dynamic_shapes={"x": {0: batch}}).model_proto
        for name, kw in (("torchscript-default", {}),
                         ("torchscript-for-training", dict(training=torch.onnx.TrainingMode.TRAINING,
                                                           do_constant_folding=False,
                                                           dynamic_axes={"x": {0: "batch"}}))):
            f = io.BytesIO()
            torch.onnx.export(module, (x,), f, dynamo=False, input_names=["x"], output_names=["logits"],
                              opset_version=17, **kw)
            out[name] = onnx.load_from_string(f.getvalue())
    return out


def _logits(model):
    return model.graph.output[0].name


@pytest.mark.parametrize("export,fragment", [
    ("dynamo-default", "FuseBatchNormIntoConv"),
    ("dynamo-default", "bn.running_mean"),
    ("dynamo-default", "the batch size is fixed"),
    ("torchscript-default", "reads the folded constant 'onnx::Conv_"),
])
@pytest.mark.slow
def test_inference_optimized_export_is_refused_with_the_export_to_use(cnn_exports, export, fragment):
    """Training it would train another model: refused in one line with the export call to use
    instead and the option that goes ahead; with that option, the same words as a warning."""
    model = cnn_exports[export]
    with pytest.raises(InvalidArgumentError, match="optimized for inference") as info:
        _build_reduced(model)
    message = str(info.value)
    assert "\n" not in message.strip()
    for words in (fragment, "dynamo=True, optimize=False, dynamic_shapes=",
                  "training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False",
                  "allow_inference_export=True (--allow-inference-export)"):
        assert words in message
    with pytest.warns(UserWarning, match="optimized for inference") as record:
        _build_reduced(model, allow_inference_export=True)
    assert fragment in str(record[0].message) and record[0].filename == __file__


def _build_reduced(model, **options):
    """Gradients of the mean logit: the exported CNN has no loss inside."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    model.graph.node.append(helper.make_node("ReduceMean", [_logits(model)], ["loss"], keepdims=0))
    model.graph.output.append(helper.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, []))
    return GradientGraphBuilder(model, ["fc.weight"], ["loss"], "loss", **options).build()


@pytest.mark.slow
def test_dynamo_export_with_fixed_batch_says_only_that(cnn_exports):
    with pytest.warns(UserWarning, match=r"batch size is fixed \(input 'x' is \[2, 3, 8, 8\]") as record:
        _build_reduced(cnn_exports["dynamo-static-batch"])
    assert "optimized for inference" not in str(record[0].message)
    assert "dynamic_shapes={'x': {0: torch.export.Dim('batch')}}" in str(record[0].message)
    assert record[0].filename == __file__


@pytest.mark.slow
@pytest.mark.parametrize("export", ["dynamo-for-training", "torchscript-for-training"])
def test_export_for_training_gives_no_warning(cnn_exports, export):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _build_reduced(cnn_exports[export])


@pytest.mark.slow
def test_inference_optimized_export_is_refused_by_a_session_or_warned_about_once(cnn_exports, tmp_path):
    model = onnx.ModelProto.FromString(cnn_exports["dynamo-default"].SerializeToString())
    model.graph.node.append(helper.make_node("ReduceMean", [_logits(model)], ["loss"], keepdims=0))
    model.graph.output.append(helper.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, []))
    with pytest.raises(InvalidArgumentError, match="optimized for inference.*allow_inference_export=True"):
        TrainingSession(model, params(), providers=CPU)
    for write in (lambda: generate_artifacts(model, artifact_directory=tmp_path / "a"),
                  lambda: export_web(model, tmp_path / "w")):
        with pytest.raises(InvalidArgumentError, match="optimized for inference"):
            write()
    assert list(tmp_path.iterdir()) == []  # nothing written
    allowed = params()
    allowed.allow_inference_export = True
    with pytest.warns(UserWarning, match="optimized for inference") as record:
        s = TrainingSession(model, allowed, providers=CPU)
        x = np.zeros((2, 3, 8, 8), np.float32)
        s.run(["loss"], {"x": x})
        s.train_step(x)
    assert [r.filename for r in record if "optimized for inference" in str(r.message)] == [__file__]


# ------------------------------------------------------------------ the training graph's interface
def test_hand_written_loop_with_state_interface_trains_like_the_session():
    model = linear()
    b = TrainingGraphBuilder(model, ["W", "B"], "loss", optimizer="adamw").build()
    written = b.model_proto
    for doc in (written.doc_string, written.graph.doc_string):
        for word in ("get_inputs()", "X.updated", "Learning_Rate", "Step", "All_Finite", "running statistics B"):
            assert word in doc
    pairs = state_interface(b.get_model())
    assert pairs == b.state_interface()
    assert ("W", "W.updated") in pairs and ("Step", "Step.updated") in pairs and ("W.exp_avg", "W.exp_avg.updated") in pairs
    sess = loads_in_onnxruntime(b.get_model())
    assert "W" not in [i.name for i in sess.get_inputs()]  # what such a loop would otherwise miss
    inits = {t.name: numpy_helper.to_array(t) for t in written.graph.initializer}
    state = {**b.initial_state(), **{name: inits[name] for name, _ in pairs if name in inits}}
    reference = TrainingSession(model, params(enable_grad_norm_clip=False), providers=CPU)
    reference.set_learning_rate(0.01)
    for step in range(3):
        x = feeds(batch=2 + step)
        out = dict(zip([o.name for o in sess.get_outputs()],
                       sess.run(None, {**x, **state, "Learning_Rate": np.array(0.01, np.float32)})))
        state = {name: out[updated] for name, updated in pairs}
        np.testing.assert_allclose(out["loss"], reference.run(["loss"], x)[0], rtol=1e-5)
    for w in ("W", "B"):
        np.testing.assert_allclose(state[w], reference.get_model_state()["full_precision"][w], rtol=1e-5, atol=1e-7)
    assert not np.allclose(state["W"], inits["W"])


# ------------------------------------------------------------------ noise and warning locations
def test_session_graphs_give_onnxruntime_no_initializer_warning(capfd):
    model = linear()
    model.graph.input.append(helper.make_tensor_value_info("B", onnx.TensorProto.FLOAT, [2]))  # a frozen one too
    p = params()
    p.weights_not_to_train = {"B"}
    so = ort.SessionOptions()
    so.log_severity_level = 2  # warnings shown
    s = TrainingSession(model, p, so, providers=CPU)
    capfd.readouterr()
    s.run(["loss"], feeds())
    s.train_step(feeds()["x"])
    s.optimizer_step()
    s.eval_step(feeds()["x"])
    err = capfd.readouterr().err
    assert "appears in graph inputs" not in err
    # by default onnxruntime's other warnings still reach the user
    assert TrainingSession(model, p, providers=CPU).get_session_options().log_severity_level == 2


def test_unreached_weight_warning_points_at_the_caller():
    model = linear()
    model.graph.initializer.append(numpy_helper.from_array(np.ones(2, np.float32), "unused"))
    with pytest.warns(UserWarning, match="do not reach the loss") as record:
        GradientGraphBuilder(model, ["W", "unused"], ["loss"], "loss").build()
    assert record[0].filename == __file__
    with pytest.warns(UserWarning, match="do not reach the loss") as record:
        TrainingGraphBuilder(model, ["W", "unused"], "loss").build()
    assert record[0].filename == __file__


def test_nonfinite_step_warning_points_at_the_caller():
    s = TrainingSession(linear(), params(), providers=CPU)
    with pytest.warns(RuntimeWarning, match="inf or NaN") as record:
        s.run(["loss"], {"x": np.full((2, 64), np.inf, np.float32)})
    assert record[0].filename == __file__


@pytest.mark.parametrize("layout", ["per_tensor", "flat"])
def test_provider_fallback_warning_points_at_the_caller(monkeypatch, layout):
    from gradbuilder.runtime.runner import StepBinding

    s = TrainingSession(linear(), params(optimizer_state_layout=layout), providers=CPU)
    real = StepBinding.run
    calls = []

    def fail_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the device failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(StepBinding, "run", fail_once)
    s.state.device = ("cuda", 0)  # as if it ran on a GPU
    monkeypatch.setattr(s.state, "ortvalue", lambda v: ort.OrtValue.ortvalue_from_numpy(np.asarray(v)))
    with pytest.warns(RuntimeWarning, match="falling back to CPUExecutionProvider") as record:
        s.run(["loss"], feeds())
    assert record[0].filename == __file__
    # the step the fallback ran is the state's, whatever its layout (a flat state's weights are
    # views of the buffers the fallback's run wrote), and the next step starts from it
    reference = TrainingSession(linear(), params(optimizer_state_layout="per_tensor"), providers=CPU)
    for _ in range(2):
        reference.run(["loss"], feeds())
    s.run(["loss"], feeds())
    assert s.step == reference.step == 2
    got, want = s.get_state()["model"]["full_precision"], reference.get_state()["model"]["full_precision"]
    for w in ("W", "B"):
        np.testing.assert_array_equal(got[w], want[w])


def test_ortmodule_info_log_level_keeps_onnxruntime_at_warning(capfd):
    from gradbuilder.ortmodule import DebugOptions, LogLevel, ORTModule

    torch.manual_seed(0)
    m = ORTModule(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)),
                  debug_options=DebugOptions(log_level=LogLevel.INFO))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m(torch.randn(3, 4)).sum().backward()
    err = capfd.readouterr().err
    assert "[I:onnxruntime" not in err


# ------------------------------------------------------------------ onnx-graphsurgeon
def test_graphsurgeon_graph_round_trip(tmp_path):
    import onnx_graphsurgeon as gs

    model = linear()
    graph = gs.import_onnx(model)
    b = GradientGraphBuilder(graph, ["W"], ["loss"], "loss").build()
    out = b.get_graph()
    assert isinstance(out, gs.Graph)
    assert "W_grad" in [t.name for t in out.outputs]
    x = feeds()
    want = loads_in_onnxruntime(GradientGraphBuilder(model, ["W"], ["loss"], "loss").build().get_model()).run(None, x)
    got = loads_in_onnxruntime(gs.export_onnx(out)).run(None, x)
    for a, c in zip(want, got):
        np.testing.assert_allclose(a, c, rtol=1e-6)
    s = TrainingSession(gs.import_onnx(model), params(), providers=CPU)
    s.run(["loss"], x)


def test_unusable_provider_warning_points_at_the_caller(monkeypatch):
    from gradbuilder.runtime import providers

    monkeypatch.setattr(providers, "works", lambda name: name == "CPUExecutionProvider")
    providers.forget(["CUDAExecutionProvider"])  # reported again here, and again after
    try:
        with pytest.warns(RuntimeWarning, match="CUDAExecutionProvider is not usable") as record:
            TrainingSession(linear(), params(), providers=["CUDAExecutionProvider"])
    finally:
        providers.forget(["CUDAExecutionProvider"])
    assert record[0].filename == __file__


def test_recompute_budget_warning_points_at_the_caller():
    p = params(memory_budget_mb=1e-6)
    s = TrainingSession(linear(), p, providers=CPU)
    with pytest.warns(UserWarning, match="memory budget .* cannot be met") as record:
        s.run(["loss"], feeds())
    assert record[0].filename == __file__


@pytest.mark.slow
def test_the_command_line_refuses_an_inference_export_unless_told_to_go_ahead(cnn_exports, tmp_path, capsys):
    """`gradbuilder train` on torch's default (BatchNorm folded into Conv) export: exit 2 with the
    advice, nothing written; with --allow-inference-export it trains."""
    from gradbuilder.cli import main

    model = onnx.ModelProto.FromString(cnn_exports["torchscript-default"].SerializeToString())
    path, data = tmp_path / "cnn.onnx", tmp_path / "d.npz"
    onnx.save(model, path)
    rng = np.random.default_rng(0)
    np.savez(data, x=rng.standard_normal((8, 3, 8, 8)).astype(np.float32), target=rng.integers(0, 5, 8))
    out = tmp_path / "trained.onnx"
    args = ["train", str(path), "--data", str(data), "--loss", "crossentropy", "--steps", "2", "--batch-size", "2",
            "-o", str(out), "-q"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "optimized for inference" in err and "--allow-inference-export" in err and not out.exists()
    assert main(args + ["--allow-inference-export"]) == 0 and out.exists()
