"""If: gradients through the taken branch, against finite differences, on the reference
evaluator and onnxruntime."""

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from gradbuilder import GradientGraphBuilder
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


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_torch_cond_export_matches_autograd(sign):
    torch.manual_seed(0)
    x = torch.rand(3, 4) * sign
    compare_with_torch(CondModule(), (x, torch.randn(3, 4)), ["x", "target"], dynamo=True, opset=18)
