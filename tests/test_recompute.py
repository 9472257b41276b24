"""The recompute pass: same gradients, fewer activations read by the backward, lower peak
memory on onnxruntime under runtime.recompute_settings.session_settings()."""

import json
import math
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from gradbuilder import GradientGraphBuilder
from gradbuilder.compiler.passes.recompute import RecomputeOptions, RecomputeReport
from gradbuilder.runtime.recompute_settings import make_session, session_settings

from .helpers import make_model, tensor, vi


# ----------------------------------------------------------------------------- models


def _w(rng, *shape):
    return (rng.standard_normal(shape) / math.sqrt(shape[0])).astype(np.float32)


def gelu_mlp(erf_pattern: bool, half_first: bool = False):
    """x @ W1 + B1 -> Gelu -> @ W2 -> mean of squares; Gelu as the opset 20 op or as the Erf
    pattern torch exports."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["xw"], name="/fc1/MatMul"),
             helper.make_node("Add", ["xw", "B1"], ["h"], name="/fc1/Add")]
    if erf_pattern:
        nodes += [helper.make_node("Div", ["h", "sqrt2"], ["hd"], name="/act/Div"),
                  helper.make_node("Erf", ["hd"], ["erf"], name="/act/Erf"),
                  helper.make_node("Add", ["erf", "one"], ["erf1"], name="/act/Add")]
        if half_first:
            nodes += [helper.make_node("Mul", ["h", "half"], ["hh"], name="/act/Mul"),
                      helper.make_node("Mul", ["hh", "erf1"], ["g"], name="/act/Mul_1")]
        else:
            nodes += [helper.make_node("Mul", ["h", "erf1"], ["he"], name="/act/Mul"),
                      helper.make_node("Mul", ["he", "half"], ["g"], name="/act/Mul_1")]
    else:
        nodes.append(helper.make_node("Gelu", ["h"], ["g"], name="/act/Gelu"))
    nodes += [helper.make_node("MatMul", ["g", "W2"], ["y"], name="/fc2/MatMul"),
              helper.make_node("Mul", ["y", "y"], ["sq"], name="/sq"),
              helper.make_node("ReduceMean", ["sq"], ["loss"], name="/mean", keepdims=0)]
    inits = [tensor("W1", _w(rng, 16, 32)), tensor("B1", rng.standard_normal(32).astype(np.float32)),
             tensor("W2", _w(rng, 32, 8)), tensor("sqrt2", np.float32(math.sqrt(2))),
             tensor("one", np.float32(1)), tensor("half", np.float32(0.5))]
    return make_model(nodes, [vi("x", ["batch", 16])], [vi("loss", [])], inits, opset=17 if erf_pattern else 20)


def transformer(layers=3, dropout=False, named=True, d=16, seq=6):
    """A torch-like single-head pre-LN transformer: names /layers.i/..., LayerNormalization,
    Softmax attention (with a seeded training Dropout when ``dropout``), Erf-Gelu MLP."""
    rng = np.random.default_rng(1)
    nodes, inits = [], [tensor("sqrt2", np.float32(math.sqrt(2))), tensor("one", np.float32(1)),
                        tensor("half", np.float32(0.5)), tensor("scale", np.float32(1 / math.sqrt(d))),
                        tensor("ratio", np.float32(0.25)), tensor("train", np.array(True))]
    weights = []

    def node(op, ins, out, name, **kw):
        nodes.append(helper.make_node(op, ins, [out], name=name, **kw))
        return out

    def weight(name, arr):
        inits.append(tensor(name, arr))
        weights.append(name)
        return name

    h = "x"
    for i in range(layers):
        p = f"/layers.{i}/" if named else f"/n{i}_"
        w = f"layers.{i}."
        ln1 = node("LayerNormalization", [h, weight(w + "ln1.g", np.ones(d, np.float32)),
                                          weight(w + "ln1.b", np.zeros(d, np.float32))], p + "ln1", p + "ln1/LN", axis=-1)
        q = node("MatMul", [ln1, weight(w + "q", _w(rng, d, d))], p + "q", p + "attn/q/MatMul")
        k = node("MatMul", [ln1, weight(w + "k", _w(rng, d, d))], p + "k", p + "attn/k/MatMul")
        v = node("MatMul", [ln1, weight(w + "v", _w(rng, d, d))], p + "v", p + "attn/v/MatMul")
        kt = node("Transpose", [k], p + "kt", p + "attn/Transpose", perm=[0, 2, 1])
        s = node("MatMul", [q, kt], p + "s", p + "attn/MatMul")
        s = node("Mul", [s, "scale"], p + "ss", p + "attn/Mul")
        a = node("Softmax", [s], p + "a", p + "attn/Softmax", axis=-1)
        if dropout:
            a = node("Dropout", [a, "ratio", "train"], p + "ad", p + "attn/Dropout", seed=7 + i)
        o = node("MatMul", [a, v], p + "o", p + "attn/MatMul_1")
        o = node("MatMul", [o, weight(w + "o", _w(rng, d, d))], p + "oo", p + "attn/o/MatMul")
        h = node("Add", [h, o], p + "r1", p + "Add")
        ln2 = node("LayerNormalization", [h, weight(w + "ln2.g", np.ones(d, np.float32)),
                                          weight(w + "ln2.b", np.zeros(d, np.float32))], p + "ln2", p + "ln2/LN", axis=-1)
        f = node("MatMul", [ln2, weight(w + "fc1", _w(rng, d, 2 * d))], p + "f", p + "mlp/fc1/MatMul")
        e = node("Erf", [node("Div", [f, "sqrt2"], p + "fd", p + "mlp/act/Div")], p + "fe", p + "mlp/act/Erf")
        g = node("Mul", [node("Mul", [f, node("Add", [e, "one"], p + "fe1", p + "mlp/act/Add")], p + "fm",
                              p + "mlp/act/Mul"), "half"], p + "g", p + "mlp/act/Mul_1")
        f2 = node("MatMul", [g, weight(w + "fc2", _w(rng, 2 * d, d))], p + "f2", p + "mlp/fc2/MatMul")
        h = node("Add", [h, f2], p + "r2", p + "Add_1")
    lnf = node("LayerNormalization", [h, weight("lnf.g", np.ones(d, np.float32)), weight("lnf.b", np.zeros(d, np.float32))],
               "lnf", "/ln_f/LN", axis=-1)
    node("ReduceMean", [node("Mul", [lnf, lnf], "sq", "/sq")], "loss", "/mean", keepdims=0)
    model = make_model(nodes, [vi("x", [2, seq, d])], [vi("loss", [])], inits)
    return model, weights


def wide_chain(layers=6, batch=2048, width=128):
    """Big activations, small weights: per layer MatMul -> Tanh -> Sigmoid -> Mul -> Tanh -> Add."""
    rng = np.random.default_rng(2)
    nodes, inits, h = [], [], "x"
    for i in range(layers):
        p = f"/layers.{i}/"
        inits.append(tensor(f"W{i}", _w(rng, width, width)))
        nodes += [helper.make_node("MatMul", [h, f"W{i}"], [p + "mm"], name=p + "MatMul"),
                  helper.make_node("Tanh", [p + "mm"], [p + "t1"], name=p + "Tanh"),
                  helper.make_node("Sigmoid", [p + "t1"], [p + "s"], name=p + "Sigmoid"),
                  helper.make_node("Mul", [p + "s", p + "t1"], [p + "m"], name=p + "Mul"),
                  helper.make_node("Tanh", [p + "m"], [p + "t2"], name=p + "Tanh_1"),
                  helper.make_node("Add", [p + "t2", h], [p + "out"], name=p + "Add")]
        h = p + "out"
    nodes.append(helper.make_node("ReduceSum", [h], ["loss"], name="/sum", keepdims=0))
    return make_model(nodes, [vi("x", [batch, width])], [vi("loss", [])], inits), [f"W{i}" for i in range(layers)]


# ----------------------------------------------------------------------------- helpers


def build(model, weights, options=None):
    return GradientGraphBuilder(model, weights, ["loss"], "loss", recompute=options).build()


def run(proto, feeds, recompute):
    sess = make_session(proto) if recompute else ort.InferenceSession(
        proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds)))


def assert_same_gradients(model, weights, options, feeds):
    base = build(model, weights)
    rc = build(model, weights, options)
    assert rc.recompute_report.added_nodes > 0, rc.recompute_report
    want, got = run(base.model_proto, feeds, False), run(rc.model_proto, feeds, True)
    for w in weights:
        np.testing.assert_allclose(got[f"{w}_grad"], want[f"{w}_grad"], rtol=1e-5, atol=1e-7, err_msg=w)
    return rc


def forward_names(model):
    return {n.name for n in model.graph.node}


def backward_reads(built, model):
    """Forward values (by name) that non-forward nodes of the built graph read."""
    fwd = forward_names(model)
    produced = {o for n in built.model_proto.graph.node if n.name in fwd for o in n.output}
    return {i for n in built.model_proto.graph.node if n.name not in fwd for i in n.input if i in produced}


def x_feed(shape, seed=3):
    return {"x": np.random.default_rng(seed).standard_normal(shape).astype(np.float32)}


# ----------------------------------------------------------------------------- gradients unchanged


@pytest.mark.parametrize("erf_pattern,half_first", [(False, False), (True, False), (True, True)])
def test_gelu_recompute_same_gradients_and_gelu_output_not_read(erf_pattern, half_first):
    model = gelu_mlp(erf_pattern, half_first)
    rc = assert_same_gradients(model, ["W1", "B1", "W2"], RecomputeOptions(gelu=True), x_feed([4, 16]))
    reads = backward_reads(rc, model)
    assert "g" not in reads and "g" in rc.recompute_report.recomputed
    if erf_pattern:  # every value of the pattern is recomputed from h
        assert not reads & {"hd", "erf", "erf1", "he", "hh"}
    assert "h" in reads or "h" in rc.recompute_report.kept


@pytest.mark.parametrize("options", [
    RecomputeOptions(transformer_layers=True),
    RecomputeOptions(transformer_layers=True, layers=1),
    RecomputeOptions(gelu=True, attention_dropout=True),
    RecomputeOptions(budget_fraction=0.5),
    RecomputeOptions(budget_bytes=0),
], ids=["layers", "layers=1", "gelu+attn_dropout", "budget_fraction", "budget_min"])
@pytest.mark.filterwarnings("ignore:recompute")
def test_transformer_same_gradients(options):
    model, weights = transformer(layers=3, dropout=True)
    assert_same_gradients(model, weights, options, x_feed([2, 6, 16]))


def test_unnamed_layers_cut_at_layer_norms_same_gradients():
    model, weights = transformer(layers=2, named=False)
    rc = assert_same_gradients(model, weights, RecomputeOptions(transformer_layers=True), x_feed([2, 6, 16]))
    assert "/n0_f" in rc.recompute_report.recomputed


# ----------------------------------------------------------------------------- structure


def _layer_values(model, i):
    return {o for n in model.graph.node if n.name.startswith(f"/layers.{i}/") for o in n.output}


def _layer_inputs(model, i):
    inside = _layer_values(model, i)
    return {x for n in model.graph.node if n.name.startswith(f"/layers.{i}/") for x in n.input} - inside


@pytest.mark.parametrize("layers", [0, 1])
def test_transformer_layers_backward_reads_only_layer_inputs_and_masks(layers):
    model, weights = transformer(layers=3, dropout=True)
    rc = build(model, weights, RecomputeOptions(transformer_layers=True, layers=layers))
    reads = backward_reads(rc, model)
    for i in range(3):
        from_layer = reads & _layer_values(model, i)
        allowed = (_layer_inputs(model, i + 1) if i < 2 else {"/layers.2/r2"}) | {f"/layers.{i}/ad_mask"}
        if layers == 0 or i < layers:
            assert from_layer <= allowed, (i, from_layer - allowed)
        else:  # not recomputed: the backward reads the layer's activations
            assert {f"/layers.{i}/a", f"/layers.{i}/g"} <= from_layer
    recomputed = set(rc.recompute_report.recomputed)
    assert "/layers.0/g" in recomputed and ("/layers.1/g" in recomputed) == (layers == 0)


def test_attention_dropout_recomputed_from_softmax_output_and_mask():
    model, weights = transformer(layers=2, dropout=True)
    rc = build(model, weights, RecomputeOptions(attention_dropout=True))
    reads = backward_reads(rc, model)
    assert "/layers.0/ad" not in reads and {"/layers.0/a", "/layers.0/ad_mask"} <= reads
    ops = [n.op_type for n in rc.model_proto.graph.node if "_recompute" in n.name]
    assert "Dropout" not in ops and "Mul" in ops


def test_budget_met_when_feasible_and_warns_when_not():
    model, weights = transformer(layers=3)
    base = build(model, weights, RecomputeOptions(budget_bytes=2**40)).recompute_report
    assert base.recomputed == [] and base.bytes_after == base.bytes_before
    budget = base.bytes_before // 2
    rep = build(model, weights, RecomputeOptions(budget_bytes=budget)).recompute_report
    assert rep.bytes_after <= budget and rep.recomputed and rep.added_flops > 0
    with pytest.warns(UserWarning, match="budget of 1 bytes cannot be met"):
        low = build(model, weights, RecomputeOptions(budget_bytes=1)).recompute_report
    assert low.bytes_after <= rep.bytes_after


def test_symbolic_dims_in_estimates():
    model = gelu_mlp(False)
    one = build(model, ["W1", "B1", "W2"], RecomputeOptions(gelu=True)).recompute_report
    many = build(model, ["W1", "B1", "W2"], RecomputeOptions(gelu=True, dims={"batch": 64})).recompute_report
    loss = 4  # the scalar loss is read too
    assert many.bytes_before - loss == 64 * (one.bytes_before - loss)


def test_report_str():
    model, weights = transformer(layers=2)
    rep = build(model, weights, RecomputeOptions(transformer_layers=True)).recompute_report
    assert isinstance(rep, RecomputeReport)
    text = str(rep)
    assert "recompute" in text and "MiB" in text and str(len(rep.recomputed)) in text


# ----------------------------------------------------------------------------- onnxruntime


def test_session_settings_keep_the_clones_and_the_node_order(tmp_path):
    """CSE merges the clones back; the settings keep them, and the execution order is the
    graph's node order."""
    model, weights = wide_chain(layers=2, batch=8, width=8)
    proto = build(model, weights, RecomputeOptions(transformer_layers=True)).model_proto
    assert sum("_recompute" in n.name for n in proto.graph.node) == 10

    def tanh_nodes(disabled, settings):
        so = ort.SessionOptions()
        for k, v in (session_settings()[0] if settings else {}).items():
            setattr(so, k, v)
        so.optimized_model_filepath = str(tmp_path / "opt.onnx")
        ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"],
                             disabled_optimizers=disabled)
        return sum(n.op_type == "Tanh" for n in onnx.load(str(tmp_path / "opt.onnx")).graph.node)

    assert tanh_nodes([], False) == 4  # the 4 forward Tanh: their 4 clones merged into them
    assert tanh_nodes(session_settings()[1], True) == 8

    ran = _executed(make_session(proto, session_options=_profiling(tmp_path)), x_feed([8, 8]))
    assert ran == [n.name for n in proto.graph.node if n.name in set(ran)]


def _profiling(tmp_path):
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "profile")
    return so


def _executed(sess, feeds) -> list[str]:
    """The node names in the order onnxruntime ran them."""
    sess.run(None, feeds)
    events = json.load(open(sess.end_profiling()))
    return [e["name"][: -len("_kernel_time")] for e in events
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]


def test_session_settings_create_no_nodes_so_clones_run_in_the_backward(tmp_path):
    """MatMul + Add (MatMulAddFusion) would become a Gemm with the highest node index: the
    forward would wait on it while the clones ran. Under the settings every node of the graph
    runs, in the graph's order (onnxruntime runs Shape and Size as soon as they are ready), and
    the clones run after the first gradient node."""
    proto = build(gelu_mlp(False), ["W1", "B1", "W2"], RecomputeOptions(gelu=True)).model_proto
    ran = _executed(make_session(proto, session_options=_profiling(tmp_path)), x_feed([4, 16]))
    shapes = {n.name for n in proto.graph.node if n.op_type in ("Shape", "Size")}  # run first
    ours = [n.name for n in proto.graph.node if n.name not in shapes]
    assert "/fc1/MatMul" in ran and "/fc1/Add" in ran
    assert [name for name in ran if name not in shapes] == [name for name in ours if name in set(ran)]
    first_grad = min(i for i, name in enumerate(ran) if "/grad/" in name)
    assert all(i > first_grad for i, name in enumerate(ran) if "_recompute" in name)


_PEAK = """
import sys, numpy as np, onnxruntime as ort
from gradbuilder.runtime.recompute_settings import make_session
so = ort.SessionOptions()
so.enable_cpu_mem_arena = sys.argv[2] == "arena"
so.enable_mem_pattern = False
so.intra_op_num_threads = 1
sess = make_session(sys.argv[1], session_options=so)
x = np.random.default_rng(0).standard_normal(sess.get_inputs()[0].shape).astype(np.float32)
def hwm():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
open("/proc/self/clear_refs", "w").write("5")  # reset the high-water mark
start = hwm()
sess.run(None, {"x": x})
print(hwm() - start)
"""


def _peak_kib(path, arena):
    out = subprocess.run([sys.executable, "-c", _PEAK, str(path), "arena" if arena else "no-arena"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.parametrize("arena", [True, False], ids=["arena", "no-arena"])
def test_peak_memory_lower_on_onnxruntime(tmp_path, arena):
    model, weights = wide_chain()  # 1 MiB activations, 6 layers
    build(model, weights).save(tmp_path / "base.onnx")
    build(model, weights, RecomputeOptions(transformer_layers=True)).save(tmp_path / "rc.onnx")
    base, rc = _peak_kib(tmp_path / "base.onnx", arena), _peak_kib(tmp_path / "rc.onnx", arena)
    assert base > 16 * 1024, base  # the activations are measured
    assert rc < 0.8 * base, (rc, base)
