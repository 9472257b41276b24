import re

import numpy as np
import onnx
import onnxruntime as ort

from gradbuilder.compiler import registry
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


def _losses(out: str) -> tuple[float, float]:
    """The first and last loss of the result line ``loss A -> B after N steps``."""
    first, last = re.search(r"^loss (\S+) -> (\S+) after \d+ steps$", out, re.M).groups()
    return float(first), float(last)


def _demo_files(tmp_path):
    from gradbuilder.demo import demo_batch, demo_model_bytes

    model = tmp_path / "demo.onnx"
    model.write_bytes(demo_model_bytes())
    x, labels = demo_batch(512, seed=5)
    data = tmp_path / "data.npz"
    np.savez(data, x=x, labels=labels)
    return model, data, x, labels


def test_train_trains_saves_a_checkpoint_and_exports(tmp_path, capsys):
    model, data, x, labels = _demo_files(tmp_path)
    ckpt, out = tmp_path / "c.safetensors", tmp_path / "trained.onnx"
    assert main(["train", str(model), "--data", str(data), "--lr", "0.01", "--steps", "120", "--batch-size", "32",
                 "--scheduler", "cosine", "--warmup-steps", "10", "--checkpoint", str(ckpt), "-o", str(out),
                 "--keep", "logits", "--accuracy", "logits:labels"]) == 0
    text = capsys.readouterr().out
    first, last = _losses(text)
    assert last < 0.5 * first
    assert ckpt.exists() and out.exists()
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["x"]
    acc = float(np.mean(np.argmax(sess.run(["logits"], {"x": x})[0], -1) == labels))
    assert f"accuracy (logits vs labels): {acc:.1%}" in text and acc > 0.8


def test_train_resumed_continues_schedule_and_data_order_as_one_run(tmp_path, capsys):
    """60 + 60 batches through a checkpoint give the weights of 120 without stopping: the
    schedule continues at its position (its warm-up spans the checkpoint), the batches continue
    in the same order (120 batches of 32 are 7.5 epochs of the 512 rows)."""
    from gradbuilder.runtime import checkpoint

    model, data, _, _ = _demo_files(tmp_path)
    common = ["train", str(model), "--data", str(data), "--batch-size", "32", "--scheduler", "constant_with_warmup",
              "--warmup-steps", "80", "--lr", "0.01", "--seed", "3"]
    whole, half, resumed = (tmp_path / f"{n}.safetensors" for n in ("whole", "half", "resumed"))
    assert main(common + ["--steps", "120", "--checkpoint", str(whole)]) == 0
    assert main(common + ["--steps", "60", "--checkpoint", str(half)]) == 0
    capsys.readouterr()
    assert main(["train", str(model), "--data", str(data), "--batch-size", "32", "--steps", "120",
                 "--lr", "0.5", "--resume", str(half), "--checkpoint", str(resumed)]) == 0
    err = capsys.readouterr().err  # notices and warnings on stderr, results on stdout
    assert f"resumed from {half} at step 60 (60 batches)" in err
    assert "gradbuilder: warning: --lr are ignored with --resume" in err
    a, meta_a = checkpoint.load(whole)
    b, meta_b = checkpoint.load(resumed)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert meta_a["learning_rate"] == meta_b["learning_rate"]
    assert main(["train", str(model), "--data", str(data), "--steps", "100", "--resume", str(resumed)]) == 0
    assert "nothing to train" in capsys.readouterr().err


def test_train_with_appended_loss_on_a_logits_model(tmp_path, capsys):
    onnx.save(linear_model(), tmp_path / "m.onnx")  # x [batch, 1, 4] -> y [batch, 3, 4] -> loss
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 1, 4)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x, target=rng.standard_normal((16, 3, 4)).astype(np.float32))
    assert main(["train", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"), "--loss", "mse",
                 "--loss-output", "y", "--loss-name", "mse_loss", "--steps", "30", "--batch-size", "2", "--lr", "0.05"]) == 0
    first, last = _losses(capsys.readouterr().out)
    assert last < first


def test_train_reports_data_without_the_model_inputs(tmp_path, capsys):
    model, _, x, _ = _demo_files(tmp_path)
    np.savez(tmp_path / "bad.npz", x=x)
    assert main(["train", str(model), "--data", str(tmp_path / "bad.npz"), "--steps", "2"]) == 2
    assert "labels" in capsys.readouterr().err


def test_artifacts_target_names_the_loss_input(tmp_path, capsys):
    from .helpers import make_model, tensor, vi

    logits = make_model([onnx.helper.make_node("MatMul", ["x", "W"], ["logits"])], [vi("x", ["batch", 4])],
                        [vi("logits", ["batch", 3])], [tensor("W", np.ones((4, 3), np.float32))])
    model = tmp_path / "logits.onnx"
    onnx.save(logits, model)
    out = tmp_path / "artifacts"
    assert main(["artifacts", str(model), "--loss", "crossentropy", "--target", "y", "-o", str(out)]) == 0
    inputs = [i.name for i in onnx.load(str(out / "training_model.onnx")).graph.input]
    assert "y" in inputs and "target" not in inputs
