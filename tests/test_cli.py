import numpy as np
import onnx
import onnxruntime as ort

from gradbuilder import registry
from gradbuilder.cli import main

from .helpers import linear_model

# The ops the exporters emit for common networks: each must have a registered rule.
REQUIRED = """Add Sub Mul Div Neg Pow Sqrt Reciprocal Exp Log Tanh Sigmoid Relu LeakyRelu Elu Selu Gelu Erf
Softplus Softsign HardSigmoid HardSwish Abs Clip Min Max Sum Mean Where Cast CastLike Identity MatMul Gemm Einsum
Conv ConvTranspose MaxPool AveragePool GlobalAveragePool GlobalMaxPool BatchNormalization LayerNormalization
InstanceNormalization GroupNormalization Softmax LogSoftmax SoftmaxCrossEntropyLoss NegativeLogLikelihoodLoss
ReduceSum ReduceMean ReduceMax ReduceMin ReduceL2 ReduceLogSumExp ReduceSumSquare Reshape Flatten Transpose Squeeze
Unsqueeze Concat Split Slice Gather GatherElements GatherND Expand Tile Pad Dropout Trilu CumSum""".split()


def test_every_required_op_has_a_rule():
    have = {r.op_type for r in registry.all_rules() if r.domain == ""}
    assert not [op for op in REQUIRED if op not in have]


def test_ops_lists_rules_with_domain_and_opset(capsys):
    assert main(["ops"]) == 0
    out = capsys.readouterr().out
    assert "gradient rules" in out
    assert any(line.split()[:2] == ["ai.onnx", "LayerNormalization"] and line.split()[2] == "17"
               for line in out.splitlines())


def test_build_writes_a_runnable_model(tmp_path, capsys):
    src = tmp_path / "m.onnx"
    onnx.save(linear_model(), src)
    out = tmp_path / "g.onnx"
    assert main(["build", str(src), "--loss", "loss", "--weights", "W", "B", "--outputs", "loss", "y",
                 "-o", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [o.name for o in sess.get_outputs()] == ["loss", "y", "W_grad", "B_grad"]
    x = np.ones((2, 1, 4), np.float32)
    assert sess.run(["W_grad"], {"x": x})[0].shape == (3, 4)


def test_build_all_initializers_is_the_default(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save(linear_model(), src)
    for extra in ([], ["--all-initializers"]):
        out = tmp_path / "g.onnx"
        assert main(["build", str(src), "--loss", "loss", *extra, "-o", str(out)]) == 0
        names = [o.name for o in onnx.load(str(out)).graph.output]
        assert names == ["loss", "W_grad", "B_grad"]


def test_demo_passes(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "gradcheck" in out and "all checks passed" in out
