"""If: gradients through the taken branch, against finite differences, on the reference
evaluator and onnxruntime."""

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from gradbuilder import GradientGraphBuilder
from gradbuilder.errors import GradientRuleError
from gradbuilder.testing import gradcheck, run_onnxruntime

from ..helpers import make_model, tensor, vi
from ..torch_models import compare_with_torch


def if_model(nested=False):
    """y = If(c, W * x + B, W * W) summed; the then-branch optionally holds another If."""
    inner_then = helper.make_graph([helper.make_node("Tanh", ["t"], ["ti"])], "inner_then", [], [vi("ti", [3])])
    inner_else = helper.make_graph([helper.make_node("Mul", ["t", "B"], ["te"])], "inner_else", [], [vi("te", [3])])
    then_nodes = [helper.make_node("Mul", ["W", "x"], ["wx"]), helper.make_node("Add", ["wx", "B"], ["t"])]
    if nested:
        then_nodes.append(helper.make_node("If", ["c2"], ["tn"], then_branch=inner_then, else_branch=inner_else))
    then_out = "tn" if nested else "t"
    then_g = helper.make_graph(then_nodes, "then", [], [vi(then_out, [3])])
    else_g = helper.make_graph([helper.make_node("Mul", ["W", "W"], ["u"]), helper.make_node("Exp", ["u"], ["ue"])],
                               "else", [], [vi("ue", [3])])
    nodes = [helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g),
             helper.make_node("Mul", ["y", "W"], ["yw"]),
             helper.make_node("ReduceSum", ["yw"], ["loss"], keepdims=0)]
    inputs = [vi("x", [3]), vi("c", [], TensorProto.BOOL)] + ([vi("c2", [], TensorProto.BOOL)] if nested else [])
    rng = np.random.default_rng(0)
    return make_model(nodes, inputs, [vi("loss", [])],
                      [tensor("W", rng.uniform(-1, 1, 3).astype(np.float32)),
                       tensor("B", rng.uniform(-1, 1, 3).astype(np.float32))])


@pytest.mark.parametrize("cond", [True, False])
def test_if_gradient_through_the_taken_branch(cond):
    x = np.array([0.5, -1.0, 2.0], np.float32)
    feeds = {"x": x, "c": np.array(cond)}
    report = gradcheck(if_model(), ["W", "B"], "loss", feeds)
    assert report.passed, report
    built = GradientGraphBuilder(if_model(), ["W", "B"], ["loss"], "loss").build().get_model()
    got = run_onnxruntime(built, feeds)
    for w in ("W", "B"):
        np.testing.assert_allclose(got[f"{w}_grad"], report.gradients[w], rtol=1e-5, atol=1e-6)
    if not cond:  # B is not read by the else branch: zero gradient from the If
        np.testing.assert_allclose(got["B_grad"], 0.0)


@pytest.mark.parametrize("c,c2", [(True, True), (True, False), (False, True)])
def test_nested_if(c, c2):
    feeds = {"x": np.array([0.5, -1.0, 2.0], np.float32), "c": np.array(c), "c2": np.array(c2)}
    report = gradcheck(if_model(nested=True), ["W", "B"], "loss", feeds)
    assert report.passed, report
    built = GradientGraphBuilder(if_model(nested=True), ["W", "B"], ["loss"], "loss").build().get_model()
    got = run_onnxruntime(built, feeds)
    for w in ("W", "B"):
        np.testing.assert_allclose(got[f"{w}_grad"], report.gradients[w], rtol=1e-5, atol=1e-6)


def test_backward_graph_is_an_if_and_checks():
    out = GradientGraphBuilder(if_model(), ["W", "B"], ["loss"], "loss").build().model_proto
    onnx.checker.check_model(out, full_check=True)
    assert [n.op_type for n in out.graph.node].count("If") == 2  # forward and backward


class CondModule(torch.nn.Module):
    """Data-dependent control flow as torch exports it: torch.cond -> If."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4) * 0.5)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, target):
        def then_fn(x):
            return torch.sin(self.lin(x) * self.w)

        def else_fn(x):
            return torch.cos(x + self.w) * 2

        out = torch.cond(x.sum() > 0, then_fn, else_fn, (x,))
        return ((out - target) ** 2).mean()


@pytest.mark.slow  # a dynamo export: seconds each
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_torch_cond_export_matches_autograd(sign):
    torch.manual_seed(0)
    x = torch.rand(3, 4) * sign
    compare_with_torch(CondModule(), (x, torch.randn(3, 4)), ["x", "target"], dynamo=True, opset=18)


# ----------------------------------------------------------------------------- Loop, Scan


def _check(model, weights, feeds):
    report = gradcheck(model, weights, "loss", feeds)
    assert report.passed, report
    built = GradientGraphBuilder(model, weights, ["loss"], "loss").build()
    onnx.checker.check_model(built.model_proto, full_check=True)
    got = run_onnxruntime(built.get_model(), feeds)
    for w in weights:
        np.testing.assert_allclose(got[f"{w}_grad"], report.gradients[w], rtol=2e-4, atol=1e-5)
    return built.model_proto


def _op_types(graph):
    """Op types of ``graph`` and its subgraphs."""
    types = []
    for node in graph.node:
        types.append(node.op_type)
        for a in node.attribute:
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                types += _op_types(g)
    return types


def loop_model(early_exit=False, scan_output=True, uses_iter=True):
    """h_{t+1} = tanh(h_t @ W + B * i) for i < M (and while sum(h) < 1.5 with ``early_exit``);
    the scan output stacks h_t * W[0]; loss projects the final h and the stacked outputs."""
    nodes = [helper.make_node("MatMul", ["h", "W"], ["hw"])]
    if uses_iter:
        nodes += [helper.make_node("Cast", ["i"], ["fi"], to=TensorProto.FLOAT),
                  helper.make_node("Mul", ["B", "fi"], ["bi"]),
                  helper.make_node("Add", ["hw", "bi"], ["pre"])]
    else:
        nodes += [helper.make_node("Add", ["hw", "B"], ["pre"])]
    nodes += [helper.make_node("Tanh", ["pre"], ["h2"])]
    if early_exit:
        nodes += [helper.make_node("ReduceSum", ["h2"], ["s"], keepdims=0),
                  helper.make_node("Less", ["s", "limit"], ["c2"])]
    else:
        nodes += [helper.make_node("Identity", ["c"], ["c2"])]
    outs = [vi("c2", [], TensorProto.BOOL), vi("h2", [2, 3])]
    if scan_output:
        nodes += [helper.make_node("Gather", ["W", "zero"], ["w0"], axis=0),
                  helper.make_node("Mul", ["h", "w0"], ["y"])]
        outs.append(vi("y", [2, 3]))
    body = helper.make_graph(nodes, "body", [vi("i", [], TensorProto.INT64), vi("c", [], TensorProto.BOOL),
                                             vi("h", [2, 3])], outs)
    loop_outs = ["hT", "ys"] if scan_output else ["hT"]
    rng = np.random.default_rng(0)
    graph_nodes = [helper.make_node("Loop", ["M", "cond", "h0"], loop_outs, body=body),
                   helper.make_node("Mul", ["hT", "P"], ["hp"]),
                   helper.make_node("ReduceSum", ["hp"], ["l1"], keepdims=0)]
    if scan_output:
        graph_nodes += [helper.make_node("Mul", ["ys", "Q"], ["yq"]),
                        helper.make_node("ReduceSum", ["yq"], ["l2"], keepdims=0),
                        helper.make_node("Add", ["l1", "l2"], ["loss"])]
    else:
        graph_nodes[-1].output[0] = "loss"
    inits = [tensor("W", rng.uniform(-0.8, 0.8, (3, 3)).astype(np.float32)),
             tensor("B", rng.uniform(-0.5, 0.5, 3).astype(np.float32)),
             tensor("P", rng.standard_normal((2, 3)).astype(np.float32)),
             tensor("Q", rng.standard_normal((4, 2, 3)).astype(np.float32)),
             tensor("zero", np.array(0, np.int64)), tensor("limit", np.array(1.5, np.float32))]
    return make_model(graph_nodes, [vi("h0", [2, 3]), vi("M", [], TensorProto.INT64), vi("cond", [], TensorProto.BOOL)],
                      [vi("loss", [])], inits, opset=17)


LOOP_FEEDS = {"h0": np.random.default_rng(1).uniform(-1, 1, (2, 3)).astype(np.float32),
              "M": np.array(4, np.int64), "cond": np.array(True)}


@pytest.mark.parametrize("scan_output", [True, False])
@pytest.mark.parametrize("uses_iter", [True, False])
def test_loop_carried_values_scan_outputs_and_outer_weights(scan_output, uses_iter):
    model = loop_model(scan_output=scan_output, uses_iter=uses_iter)
    out = _check(model, ["W", "B", "h0"], LOOP_FEEDS)
    assert "Scan" in _op_types(out.graph)  # the backward loop


def test_loop_with_data_dependent_exit():
    model = loop_model(early_exit=True, scan_output=False)
    feeds = {**LOOP_FEEDS, "M": np.array(10, np.int64)}
    _check(model, ["W", "B", "h0"], feeds)


def test_loop_that_runs_no_iteration_passes_gradients_through():
    model = loop_model(scan_output=False)
    feeds = {**LOOP_FEEDS, "M": np.array(0, np.int64)}
    _check(model, ["W", "B", "h0"], feeds)


def scan_model(in_axis=0, in_dir=0, out_axis=0, out_dir=0, two_inputs=False):
    """An RNN cell as a Scan: h' = tanh(x_t @ U + h @ W), y_t = h' * V, c' = c + sum(h');
    the states h, c and the scan output all reach the loss; U, W, V are outer weights."""
    nodes = [helper.make_node("MatMul", ["xt", "U"], ["xu"]),
             helper.make_node("MatMul", ["h", "W"], ["hw"]),
             helper.make_node("Add", ["xu", "hw"], ["pre"])]
    inputs = [vi("h", [2, 3]), vi("c", [], TensorProto.FLOAT), vi("xt", [2, 4])]
    if two_inputs:
        nodes += [helper.make_node("Mul", ["pre", "zt"], ["pre2"]), helper.make_node("Tanh", ["pre2"], ["h2"])]
        inputs.append(vi("zt", [2, 3]))
    else:
        nodes.append(helper.make_node("Tanh", ["pre"], ["h2"]))
    nodes += [helper.make_node("ReduceSum", ["h2"], ["hs"], keepdims=0),
              helper.make_node("Add", ["c", "hs"], ["c2"]),
              helper.make_node("Mul", ["h2", "V"], ["y"])]
    body = helper.make_graph(nodes, "cell", inputs, [vi("h2", [2, 3]), vi("c2", [], TensorProto.FLOAT), vi("y", [2, 3])])
    T = 3
    x_shape = [2, 4]
    x_shape.insert(in_axis, T)
    scan_inputs = ["x", "z"] if two_inputs else ["x"]
    attrs = dict(num_scan_inputs=len(scan_inputs), scan_input_axes=[in_axis] * len(scan_inputs),
                 scan_input_directions=[in_dir] + [1 - in_dir] * (len(scan_inputs) - 1),
                 scan_output_axes=[out_axis], scan_output_directions=[out_dir])
    y_shape = [2, 3]
    y_shape.insert(out_axis, T)
    rng = np.random.default_rng(2)
    graph_nodes = [helper.make_node("Scan", ["h0", "c0", *scan_inputs], ["hT", "cT", "ys"], body=body, **attrs),
                   helper.make_node("Mul", ["ys", "Q"], ["yq"]),
                   helper.make_node("ReduceSum", ["yq"], ["l1"], keepdims=0),
                   helper.make_node("Mul", ["hT", "P"], ["hp"]),
                   helper.make_node("ReduceSum", ["hp"], ["l2"], keepdims=0),
                   helper.make_node("Sum", ["l1", "l2", "cT"], ["loss"])]
    inputs = [vi("h0", [2, 3]), vi("c0", [], TensorProto.FLOAT), vi("x", x_shape)]
    z_shape = [2, 3]
    z_shape.insert(in_axis, T)
    if two_inputs:
        inputs.append(vi("z", z_shape))
    inits = [tensor("U", rng.uniform(-0.7, 0.7, (4, 3)).astype(np.float32)),
             tensor("W", rng.uniform(-0.7, 0.7, (3, 3)).astype(np.float32)),
             tensor("V", rng.uniform(-1, 1, 3).astype(np.float32)),
             tensor("P", rng.standard_normal((2, 3)).astype(np.float32)),
             tensor("Q", rng.standard_normal(y_shape).astype(np.float32))]
    feeds = {"h0": rng.uniform(-1, 1, (2, 3)).astype(np.float32), "c0": np.array(0.3, np.float32),
             "x": rng.uniform(-1, 1, x_shape).astype(np.float32),
             "z": rng.uniform(0.5, 1.5, z_shape).astype(np.float32)}
    model = make_model(graph_nodes, inputs, [vi("loss", [])], inits, opset=17)
    return model, {k: v for k, v in feeds.items() if k != "z" or two_inputs}


@pytest.mark.parametrize("in_axis,in_dir,out_axis,out_dir", [
    (0, 0, 0, 0), (0, 1, 0, 0), (1, 0, 0, 1), (2, 1, 2, 0), (1, 1, -1, 1),
])
def test_scan_states_scan_inputs_and_outputs_every_axis_and_direction(in_axis, in_dir, out_axis, out_dir):
    model, feeds = scan_model(in_axis, in_dir, out_axis, out_dir)
    _check(model, ["U", "W", "V", "h0", "c0", "x"], feeds)


def test_scan_with_two_scan_inputs_in_opposite_directions():
    model, feeds = scan_model(1, 0, 0, 0, two_inputs=True)
    _check(model, ["U", "W", "h0", "x", "z"], feeds)


def test_if_inside_a_loop_body_and_loop_inside_an_if():
    """The Loop body picks tanh or sin by the iteration's parity (an If on the trip), and the
    whole Loop sits in the then-branch of an outer If."""
    then_b = helper.make_graph([helper.make_node("Tanh", ["pre"], ["a"])], "t", [], [vi("a", [2, 3])])
    else_b = helper.make_graph([helper.make_node("Sin", ["pre"], ["b"])], "e", [], [vi("b", [2, 3])])
    body = helper.make_graph(
        [helper.make_node("MatMul", ["h", "W"], ["pre"]),
         helper.make_node("Mod", ["i", "two"], ["r"]),
         helper.make_node("Equal", ["r", "zero"], ["even"]),
         helper.make_node("If", ["even"], ["h2"], then_branch=then_b, else_branch=else_b),
         helper.make_node("Identity", ["c"], ["c2"])],
        "body", [vi("i", [], TensorProto.INT64), vi("c", [], TensorProto.BOOL), vi("h", [2, 3])],
        [vi("c2", [], TensorProto.BOOL), vi("h2", [2, 3])])
    outer_then = helper.make_graph([helper.make_node("Loop", ["M", "", "h0"], ["hT"], body=body)], "ot", [],
                                   [vi("hT", [2, 3])])
    outer_else = helper.make_graph([helper.make_node("Mul", ["h0", "h0"], ["sq"])], "oe", [], [vi("sq", [2, 3])])
    rng = np.random.default_rng(3)
    model = make_model(
        [helper.make_node("If", ["go"], ["out"], then_branch=outer_then, else_branch=outer_else),
         helper.make_node("Mul", ["out", "P"], ["op"]),
         helper.make_node("ReduceSum", ["op"], ["loss"], keepdims=0)],
        [vi("h0", [2, 3]), vi("M", [], TensorProto.INT64), vi("go", [], TensorProto.BOOL)], [vi("loss", [])],
        [tensor("W", rng.uniform(-0.8, 0.8, (3, 3)).astype(np.float32)),
         tensor("P", rng.standard_normal((2, 3)).astype(np.float32)),
         tensor("two", np.array(2, np.int64)), tensor("zero", np.array(0, np.int64))])
    feeds = {"h0": rng.uniform(-1, 1, (2, 3)).astype(np.float32), "M": np.array(5, np.int64), "go": np.array(True)}
    _check(model, ["W", "h0"], feeds)
    _check(model, ["W", "h0"], {**feeds, "go": np.array(False)})


class ScriptedRNN(torch.nn.Module):
    """A Python for-loop over the time steps and a data-dependent while-loop, scripted:
    torch's exporter writes both as ONNX Loop nodes."""

    def __init__(self, collect: str = "stack"):
        super().__init__()
        self.collect = collect
        self.cell = torch.nn.Linear(4 + 3, 3)
        self.scale = torch.nn.Parameter(torch.tensor([1.3, 0.9, 1.1]))

    def forward(self, x, target):
        h = torch.zeros(x.size(1), 3)
        outs = []
        for t in range(x.size(0)):
            h = torch.tanh(self.cell(torch.cat([x[t], h], dim=1)))
            outs.append(h)
        k = 0
        while bool(h.abs().sum() < 4.0) and k < 6:
            h = h * self.scale + 0.1
            k += 1
        if self.collect == "stack":
            ys = torch.stack(outs).sum(0)
        elif self.collect == "stack1":
            ys = torch.stack(outs, dim=1).sum(1)
        else:
            ys = torch.cat(outs).reshape(-1, x.size(1), 3).sum(0)
        return ((ys + h - target) ** 2).mean()


@pytest.mark.parametrize("collect", ["stack", "stack1", "cat"])
def test_torchscript_loops_export_matches_autograd(collect):
    """Appends to a Python list in the loop become a scan output of the Loop."""
    torch.manual_seed(0)
    module = torch.jit.script(ScriptedRNN(collect))
    x, target = torch.randn(5, 2, 4) * 0.5, torch.randn(2, 3)
    compare_with_torch(module, (x, target), ["x", "target"], dynamo=False, opset=17)


# ----------------------------------------------------------------------------- undeclared shapes


def _unshaped_body(prefix, reads):
    """Loop body h' = tanh(h @ W + reads), its values declared without a shape."""
    p = prefix
    nodes = [helper.make_node("MatMul", [f"{p}h", "W"], [f"{p}hw"]),
             helper.make_node("Add", [f"{p}hw", reads], [f"{p}pre"]),
             helper.make_node("Tanh", [f"{p}pre"], [f"{p}h2"]),
             helper.make_node("Identity", [f"{p}c"], [f"{p}c2"]),
             helper.make_node("Mul", [f"{p}h", "B"], [f"{p}y"])]
    return helper.make_graph(
        nodes, f"{p}body", [vi(f"{p}i", [], TensorProto.INT64), vi(f"{p}c", [], TensorProto.BOOL),
                            helper.make_tensor_value_info(f"{p}h", TensorProto.FLOAT, None)],
        [vi(f"{p}c2", [], TensorProto.BOOL), helper.make_tensor_value_info(f"{p}h2", TensorProto.FLOAT, None),
         helper.make_tensor_value_info(f"{p}y", TensorProto.FLOAT, None)])


@pytest.mark.parametrize("start", ["static", "rank_at_run_time"])
def test_loops_whose_bodies_declare_no_shapes(start):
    """The first loop's values have no declared shape; the second loop's body reads the first
    loop's output. With h0 reshaped to a shape given at run time no rank is known anywhere."""
    rng = np.random.default_rng(5)
    model = make_model(
        [helper.make_node("Reshape", ["h0", "shape"], ["hr"]),
         helper.make_node("Loop", ["M", "", "hr"], ["h1", "ys1"], body=_unshaped_body("a", "B")),
         helper.make_node("Loop", ["M", "", "hr"], ["h2", "ys2"], body=_unshaped_body("b", "h1")),
         helper.make_node("ReduceSum", ["ys2", "zero"], ["ysum"], keepdims=0),
         helper.make_node("Add", ["h2", "ysum"], ["out"]),
         helper.make_node("Mul", ["out", "P"], ["op"]),
         helper.make_node("ReduceSum", ["op"], ["loss"], keepdims=0)],
        [vi("h0", [2, 3]), vi("M", [], TensorProto.INT64),
         vi("shape", [2] if start == "static" else [None], TensorProto.INT64)], [vi("loss", [])],
        [tensor("W", rng.uniform(-0.8, 0.8, (3, 3)).astype(np.float32)),
         tensor("B", rng.uniform(-0.5, 0.5, 3).astype(np.float32)),
         tensor("P", rng.standard_normal((2, 3)).astype(np.float32)), tensor("zero", np.array([0]))])
    feeds = {"h0": rng.uniform(-1, 1, (2, 3)).astype(np.float32), "M": np.array(3, np.int64),
             "shape": np.array([2, 3], np.int64)}
    out = _check(model, ["W", "B", "h0"], feeds)
    scans = [a.g for n in _nodes(out.graph) if n.op_type == "Scan" for a in n.attribute if a.name == "body"]
    assert scans and all(o.type.tensor_type.HasField("shape") for g in scans for o in g.output)


def _nodes(graph):
    for node in graph.node:
        yield node
        for a in node.attribute:
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                yield from _nodes(g)


def _runtime_rank_scan(axis=0):
    """An RNN cell as a Scan over x, whose state and input reach it through Reshapes to shapes
    given at run time (no rank known); the body declares no input shape, and of its outputs
    only the rank (onnxruntime's Scan runs no body without them)."""
    body = helper.make_graph(
        [helper.make_node("Mul", ["h", "W"], ["hw"]), helper.make_node("Add", ["hw", "xt"], ["pre"]),
         helper.make_node("Tanh", ["pre"], ["h2"]), helper.make_node("Mul", ["h2", "V"], ["y"])],
        "cell", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("h", "xt")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [None, None]) for n in ("h2", "y")])
    rng = np.random.default_rng(6)
    model = make_model(
        [helper.make_node("Reshape", ["h0", "hs"], ["hr"]), helper.make_node("Reshape", ["x", "xs"], ["xr"]),
         helper.make_node("Scan", ["hr", "xr"], ["hT", "ys"], body=body, num_scan_inputs=1,
                          scan_input_axes=[axis], scan_output_axes=[axis]),
         helper.make_node("ReduceSum", ["ys"], ["l1"], keepdims=0), helper.make_node("Mul", ["hT", "P"], ["hp"]),
         helper.make_node("ReduceSum", ["hp"], ["l2"], keepdims=0), helper.make_node("Add", ["l1", "l2"], ["loss"])],
        [vi("h0", [2, 3]), vi("x", [4, 2, 3] if axis == 0 else [2, 4, 3]),
         vi("hs", [None], TensorProto.INT64), vi("xs", [None], TensorProto.INT64)], [vi("loss", [])],
        [tensor("W", rng.uniform(-0.8, 0.8, 3).astype(np.float32)),
         tensor("V", rng.uniform(-1, 1, 3).astype(np.float32)),
         tensor("P", rng.standard_normal((2, 3)).astype(np.float32))])
    feeds = {"h0": rng.uniform(-1, 1, (2, 3)).astype(np.float32), "hs": np.array([2, 3]),
             "x": rng.uniform(-1, 1, (4, 2, 3) if axis == 0 else (2, 4, 3)).astype(np.float32),
             "xs": np.array([4, 2, 3] if axis == 0 else [2, 4, 3])}
    return model, feeds


def test_scan_of_values_whose_rank_is_known_only_at_run_time():
    model, feeds = _runtime_rank_scan()
    _check(model, ["W", "V", "h0", "x"], feeds)


def test_scan_input_of_unknown_rank_along_another_axis_is_refused_naming_it():
    model, _ = _runtime_rank_scan(axis=1)
    with pytest.raises(GradientRuleError, match="rank of scan input 'xr' is unknown and it is scanned along axis 1"):
        GradientGraphBuilder(model, ["W", "x"], ["loss"], "loss").build()
