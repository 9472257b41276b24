"""Small models built with onnx.helper for the builder tests."""

import numpy as np
from onnx import TensorProto, helper, numpy_helper


def make_model(nodes, inputs, outputs, inits=(), opset=17, domains=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in domains]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


def tensor(name, arr):
    return numpy_helper.from_array(np.asarray(arr), name)


def vi(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def linear_model(opset=17):
    """loss = ReduceSum((x * W + B) * (x * W + B)) with W used twice."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Mul", ["x", "W"], ["xw"], name="mul"),
        helper.make_node("Add", ["xw", "B"], ["y"], name="add"),
        helper.make_node("Mul", ["y", "y"], ["sq"], name="square"),
        helper.make_node("ReduceSum", ["sq"], ["loss"], name="sum", keepdims=0),
    ]
    inits = [tensor("W", rng.standard_normal((3, 4)).astype(np.float32)),
             tensor("B", rng.standard_normal((4,)).astype(np.float32))]
    return make_model(nodes, [vi("x", ["batch", 1, 4])], [vi("loss", [])], inits, opset=opset)


def tree(root) -> list[str]:
    """Every path under ``root``, hidden files included (what a write left behind)."""
    import os

    return sorted(os.path.relpath(os.path.join(d, n), root) for d, dirs, names in os.walk(root) for n in dirs + names)
