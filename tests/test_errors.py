"""Bad input: each gets a clear GradBuilderError and no output file."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from gradbuilder import (
    GradBuilderError,
    GradientGraphBuilder,
    InvalidArgumentError,
    InvalidModelError,
    ModelLoadError,
    UnsupportedOpError,
)
from gradbuilder.cli import main

from .helpers import linear_model, make_model, tensor, vi


def build_and_save(model, weights, outputs, loss, path):
    GradientGraphBuilder(model, weights, outputs, loss).build().save(path)


def expect(exc, match, tmp_path, model, weights=("W",), outputs=("loss",), loss="loss"):
    out = tmp_path / "out.onnx"
    with pytest.raises(exc, match=match):
        build_and_save(model, list(weights), list(outputs), loss, out)
    assert list(tmp_path.iterdir()) == []


def test_malformed_bytes(tmp_path):
    expect(ModelLoadError, "not a serialized ONNX", tmp_path, b"\x00\x01not a model at all\xff")


def test_missing_file(tmp_path):
    expect(ModelLoadError, "not found", tmp_path, str(tmp_path / "missing.onnx"))


def test_wrong_model_type(tmp_path):
    expect(ModelLoadError, "bytes, a path or an onnx.ModelProto", tmp_path, 42)


def test_unknown_weight(tmp_path):
    expect(InvalidArgumentError, "weights: no value named 'nope'", tmp_path, linear_model(), weights=["nope"])


def test_unknown_output_and_loss(tmp_path):
    expect(InvalidArgumentError, "outputs: no value named 'zz'", tmp_path, linear_model(), outputs=["zz"])
    expect(InvalidArgumentError, "loss: no value named 'zz'", tmp_path, linear_model(), loss="zz")


def test_non_scalar_loss(tmp_path):
    expect(InvalidArgumentError, "must be a scalar", tmp_path, linear_model(), outputs=["y"], loss="y")


def test_integer_loss(tmp_path):
    nodes = [helper.make_node("Mul", ["x", "W"], ["y"]), helper.make_node("ReduceSum", ["y"], ["s"], keepdims=0),
             helper.make_node("Cast", ["s"], ["loss"], to=TensorProto.INT64)]
    model = make_model(nodes, [vi("x", [2])], [vi("loss", [], TensorProto.INT64)], [tensor("W", np.ones(2, np.float32))])
    expect(InvalidArgumentError, "loss 'loss' has type INT64", tmp_path, model)


def test_integer_weight(tmp_path):
    nodes = [helper.make_node("Cast", ["W"], ["wf"], to=TensorProto.FLOAT), helper.make_node("Mul", ["x", "wf"], ["y"]),
             helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    model = make_model(nodes, [vi("x", [2])], [vi("loss", [])], [tensor("W", np.ones(2, np.int64))])
    expect(InvalidArgumentError, "weight 'W' has type INT64", tmp_path, model)


def test_weight_computed_by_a_node(tmp_path):
    expect(InvalidArgumentError, "weight 'xw' is computed by node 'mul'", tmp_path, linear_model(), weights=["xw"])


def test_swapped_arguments_onnxruntime_training_order(tmp_path):
    # onnxruntime-training order: (model, outputs, weights, loss)
    with pytest.raises(InvalidArgumentError, match="look swapped.*keyword form"):
        GradientGraphBuilder(linear_model(), ["loss"], ["W", "B"], "loss").build()


def test_op_without_rule_names_node_op_domain_opset_and_supported_list(tmp_path):
    nodes = [helper.make_node("Mul", ["x", "W"], ["y"]),
             helper.make_node("Frobnicate", ["y"], ["z"], name="custom_node", domain="my.domain"),
             helper.make_node("ReduceSum", ["z"], ["loss"], keepdims=0)]
    model = make_model(nodes, [vi("x", [2])], [vi("loss", [])], [tensor("W", np.ones(2, np.float32))],
                       domains=["my.domain"])
    with pytest.raises(UnsupportedOpError) as info:
        build_and_save(model, ["W"], ["loss"], "loss", tmp_path / "out.onnx")
    msg = str(info.value)
    for part in ["'custom_node'", "op_type=Frobnicate", "domain='my.domain'", "opset=1", "Supported ops:", "MatMul"]:
        assert part in msg, part
    assert list(tmp_path.iterdir()) == []


def test_graph_that_does_not_type_check(tmp_path):
    nodes = [helper.make_node("Add", ["x", "W"], ["y"]), helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    model = make_model(nodes, [vi("x", [2], TensorProto.INT64)], [vi("loss", [])], [tensor("W", np.ones(2, np.float32))])
    expect(InvalidModelError, "does not type-check", tmp_path, model)


def test_opset_too_old_to_convert(tmp_path):
    model = linear_model(opset=17)
    model.opset_import[0].version = 1  # ReduceSum/Mul at opset 1 cannot be converted
    with pytest.raises(GradBuilderError):
        build_and_save(model, ["W"], ["loss"], "loss", tmp_path / "o.onnx")
    assert list(tmp_path.iterdir()) == []


def test_output_directory_missing(tmp_path):
    from gradbuilder import OutputError

    b = GradientGraphBuilder(linear_model(), ["W"], ["loss"], "loss").build()
    with pytest.raises(OutputError, match="does not exist"):
        b.save(tmp_path / "no" / "such" / "dir.onnx")


def test_every_error_is_a_gradbuilder_error():
    for exc in (ModelLoadError, InvalidArgumentError, InvalidModelError, UnsupportedOpError):
        assert issubclass(exc, GradBuilderError)


def test_cli_error_exit_code_and_no_file(tmp_path, capsys):
    src = tmp_path / "m.onnx"
    onnx.save(linear_model(), src)
    out = tmp_path / "o.onnx"
    assert main(["build", str(src), "--loss", "nope", "-o", str(out)]) == 2
    assert "no value named 'nope'" in capsys.readouterr().err
    assert not out.exists()
