"""Writes gradbuilder/data/demo_mlp.onnx, the small model `gradbuilder demo` ships with.

A two-layer MLP classifier with its loss inside: x[batch, 8] -> MatMul/Add/Relu ->
MatMul/Add -> LayerNormalization-free logits -> SoftmaxCrossEntropyLoss(mean) with int64 labels.
Run: python tools/make_demo_model.py
"""

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OUT = Path(__file__).resolve().parent.parent / "gradbuilder" / "data" / "demo_mlp.onnx"


def build() -> onnx.ModelProto:
    rng = np.random.default_rng(7)
    inits = [
        numpy_helper.from_array((rng.standard_normal((8, 16)) / np.sqrt(8)).astype(np.float32), "fc1.weight"),
        numpy_helper.from_array(np.zeros(16, np.float32), "fc1.bias"),
        numpy_helper.from_array((rng.standard_normal((16, 4)) / 4).astype(np.float32), "fc2.weight"),
        numpy_helper.from_array(np.zeros(4, np.float32), "fc2.bias"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "fc1.weight"], ["h0"], name="fc1/MatMul"),
        helper.make_node("Add", ["h0", "fc1.bias"], ["h1"], name="fc1/Add"),
        helper.make_node("Tanh", ["h1"], ["h2"], name="act"),
        helper.make_node("MatMul", ["h2", "fc2.weight"], ["h3"], name="fc2/MatMul"),
        helper.make_node("Add", ["h3", "fc2.bias"], ["logits"], name="fc2/Add"),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"], name="loss",
                         reduction="mean"),
    ]
    graph = helper.make_graph(
        nodes, "demo_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8]),
         helper.make_tensor_value_info("labels", TensorProto.INT64, ["batch"])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="gradbuilder-demo")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(build(), OUT)
    print(f"wrote {OUT}")
