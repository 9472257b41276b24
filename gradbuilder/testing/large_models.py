"""A model over 2 GB that costs little to run, written in chunks (the tests and benchmarks of large
models)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def embedding_model_on_disk(directory, gib: float, width: int = 1024) -> tuple[str, int]:
    """A model of ``gib`` GiB that costs little to run, for the tests and benchmarks of models
    over 2 GB: an embedding table ``E`` [rows, width] float32 in the external data file
    ``E.bin`` (written in chunks, never held whole), read by a Gather of ``ids``; ``logits =
    e @ W`` (W [width, 4]); ``loss`` = SoftmaxCrossEntropyLoss(logits, labels). Returns (the
    model's path, the table's bytes)."""
    import os

    rows = int(gib * 2**30) // (width * 4)
    chunk = (np.random.default_rng(0).standard_normal((1024, width)) * 0.01).astype(np.float32)
    with open(os.path.join(directory, "E.bin"), "wb") as f:
        for start in range(0, rows, len(chunk)):
            f.write(chunk[: rows - start].tobytes())
    table = onnx.TensorProto(name="E", data_type=TensorProto.FLOAT, dims=[rows, width],
                             data_location=TensorProto.EXTERNAL)
    for key, value in (("location", "E.bin"), ("offset", "0"), ("length", str(rows * width * 4))):
        table.external_data.add(key=key, value=value)
    head = numpy_helper.from_array(np.full((width, 4), 0.01, np.float32), "W")
    nodes = [helper.make_node("Gather", ["E", "ids"], ["e"]),
             helper.make_node("MatMul", ["e", "W"], ["logits"]),
             helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"])]
    graph = helper.make_graph(nodes, "embedding", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch"]),
                                                   helper.make_tensor_value_info("labels", TensorProto.INT64, ["batch"])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
                               helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])], [table, head])
    path = os.path.join(directory, "embedding.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return path, rows * width * 4
