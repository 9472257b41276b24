"""Graph rewrites applied before differentiation."""

import numpy as np
import pytest
from onnx import helper

from gradbuilder import GradientGraphBuilder
from gradbuilder.testing import gradcheck

from .helpers import make_model, tensor, vi


@pytest.mark.parametrize("split,keepdims", [(None, 0), (None, 1), (np.array([1, 3]), 1), (np.array(2), 1)])
def test_split_to_sequence_read_by_sequence_at_becomes_split(split, keepdims):
    inits = [tensor("W", np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32))]
    ins = ["W"]
    if split is not None:
        inits.append(tensor("split", split.astype(np.int64)))
        ins.append("split")
    nodes = [
        helper.make_node("SplitToSequence", ins, ["seq"], axis=0, keepdims=keepdims),
        helper.make_node("SequenceAt", ["seq", "i0"], ["a"]),
        helper.make_node("SequenceAt", ["seq", "i1"], ["b"]),
        helper.make_node("Mul", ["a", "b"], ["ab"]),
        helper.make_node("ReduceSum", ["ab"], ["loss"], keepdims=0),
    ]
    inits += [tensor("i0", np.array(0, np.int64)), tensor("i1", np.array(-1, np.int64))]
    model = make_model(nodes, [], [vi("loss", [])], inits)
    out = GradientGraphBuilder(model, ["W"], ["loss"], "loss").build().model_proto
    ops = {n.op_type for n in out.graph.node}
    assert "SplitToSequence" not in ops and "SequenceAt" not in ops and "Split" in ops
    assert gradcheck(model, ["W"], "loss").passed


def test_dropout_mask_exposed_only_on_the_private_copy():
    nodes = [helper.make_node("Dropout", ["W", "r", "t"], ["y"], seed=1),
             helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    model = make_model(nodes, [], [vi("loss", [])],
                       [tensor("W", np.ones((3, 4), np.float32)), tensor("r", np.array(0.5, np.float32)),
                        tensor("t", np.array(True))])
    out = GradientGraphBuilder(model, ["W"], ["loss"], "loss").build().model_proto
    drop = next(n for n in out.graph.node if n.op_type == "Dropout")
    assert len(drop.output) == 2 and drop.output[1]
    assert len(model.graph.node[0].output) == 1
