"""Bad command lines: each is refused with one line on stderr and the documented exit status
(2 a usage error, 1 a failure while working) before any training, and leaves no file behind."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from gradbuilder.cli import exit_status, main
from gradbuilder.demo import demo_batch, demo_model_bytes
from gradbuilder.errors import (
    CheckpointError,
    InvalidArgumentError,
    InvalidModelError,
    ModelLoadError,
    OutputError,
    UnsupportedOpError,
)

from .helpers import linear_model, make_model, vi


@pytest.fixture
def files(tmp_path):
    """The demo model and data, and inputs that are wrong in one way each."""
    (tmp_path / "model.onnx").write_bytes(demo_model_bytes())
    onnx.save(linear_model(), tmp_path / "linear.onnx")
    x, labels = demo_batch(64, seed=5)
    np.savez(tmp_path / "data.npz", x=x, labels=labels)
    np.savez(tmp_path / "small.npz", x=x[:8], labels=labels[:8])
    np.savez(tmp_path / "ragged.npz", x=x, labels=labels[:50])
    np.savez(tmp_path / "objects.npz", x=x, labels=np.array([{"a": 1}] * 64, dtype=object))
    np.savez(tmp_path / "scalar.npz", x=x, labels=np.int64(3))
    np.savez(tmp_path / "other.npz", features=x)
    np.save(tmp_path / "x.npy", x)
    (tmp_path / "afile").write_text("not a directory, not an array, not a checkpoint\n")
    (tmp_path / "adir").mkdir()
    # an op of a domain no rule covers, between the weight and the loss
    nodes = [helper.make_node("Mul", ["x", "W"], ["xw"]), helper.make_node("Mystery", ["xw"], ["m"], domain="my.ops"),
             helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0)]
    custom = make_model(nodes, [vi("x", [2, 3])], [vi("loss", [])],
                        [helper.make_tensor("W", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])], domains=["my.ops"])
    onnx.save(custom, tmp_path / "custom.onnx")
    return tmp_path


TRAIN = ["train", "{d}/model.onnx", "--data", "{d}/data.npz", "--steps", "3", "--batch-size", "16"]

# (command line, exit status, a fragment of the one line on stderr)
CASES = {
    "checkpoint into a missing directory": (TRAIN + ["--checkpoint", "{d}/missing/c.safetensors"], 2,
                                            "missing' does not exist; create it first"),
    "checkpoint under a file": (TRAIN + ["--checkpoint", "{d}/afile/c.safetensors"], 2, "afile' is a file, not a directory"),
    "checkpoint is a directory": (TRAIN + ["--checkpoint", "{d}/adir"], 2, "is a directory"),
    "checkpoint where nothing can be written": (TRAIN + ["--checkpoint", "/proc/c.safetensors"], 2, "'/proc'"),
    "output into a missing directory": (TRAIN + ["-o", "{d}/missing/t.onnx"], 2, "missing' does not exist; create it first"),
    "output under a file": (TRAIN + ["-o", "{d}/afile/t.onnx"], 2, "afile' is a file, not a directory"),
    "output and checkpoint the same file": (TRAIN + ["-o", "{d}/t", "--checkpoint", "{d}/t"], 2, "the same file"),
    "keep a value the model lacks": (TRAIN + ["-o", "{d}/t.onnx", "--keep", "nope"], 2, "--keep: the model has no"),
    "keep without output": (TRAIN + ["--keep", "logits"], 2, "--keep needs -o"),
    "accuracy of an unknown output": (TRAIN + ["--accuracy", "nope:labels"], 2, "no value 'nope'"),
    "accuracy against an unknown array": (TRAIN + ["--accuracy", "logits:nope"], 2, "no array 'nope'"),
    "accuracy without a colon": (TRAIN + ["--accuracy", "logits"], 2, "is not OUTPUT:TARGET"),
    "eval data shorter than a batch": (TRAIN + ["--accuracy", "logits:labels", "--eval-data", "{d}/small.npz"], 2,
                                       "8 rows, fewer than --batch-size 16"),
    "eval data without accuracy": (TRAIN + ["--eval-data", "{d}/data.npz"], 2, "--eval-data needs --accuracy"),
    "zero steps": (TRAIN + ["--steps", "0"], 2, "argument --steps: must be 1 or more, got 0"),
    "negative steps": (TRAIN + ["--steps", "-5"], 2, "argument --steps: must be 1 or more, got -5"),
    "zero batch size": (TRAIN + ["--batch-size", "0"], 2, "argument --batch-size: must be 1 or more"),
    "negative seed": (TRAIN + ["--seed", "-1"], 2, "argument --seed: must be 0 or more"),
    "negative learning rate": (TRAIN + ["--lr", "-0.1"], 2, "argument --lr: must be a finite number > 0"),
    "frozen weight the model lacks": (TRAIN + ["--frozen", "nope"], 2,
                                      "--frozen: the model has no float initializer named nope"),
    "weight the model lacks": (TRAIN + ["--weights", "fc1.weight", "nope"], 2,
                               "--weights: the model has no float initializer named nope"),
    "missing data": (["train", "{d}/model.onnx", "--data", "{d}/none.npz"], 2, "none.npz' not found"),
    "data is a .npy": (["train", "{d}/model.onnx", "--data", "{d}/x.npy"], 2, "holds a single array (.npy)"),
    "data is a directory": (["train", "{d}/model.onnx", "--data", "{d}/adir"], 2, "is a directory, not a file"),
    "data is not numpy's": (["train", "{d}/model.onnx", "--data", "{d}/afile"], 2, "not a numpy .npz file"),
    "data with an object array": (["train", "{d}/model.onnx", "--data", "{d}/objects.npz"], 2,
                                  "array 'labels' cannot be read: Object arrays cannot be loaded"),
    "data with a scalar": (["train", "{d}/model.onnx", "--data", "{d}/scalar.npz"], 2, "['labels'] are scalars"),
    "data of different lengths": (["train", "{d}/model.onnx", "--data", "{d}/ragged.npz"], 2,
                                  "differ in length along axis 0: {'x': 64, 'labels': 50}"),
    "data without a model input": (["train", "{d}/model.onnx", "--data", "{d}/other.npz"], 2,
                                   "no arrays for the model input(s) x, labels; it has features"),
    "missing model": (["train", "{d}/none.onnx", "--data", "{d}/data.npz"], 2, "model '{d}/none.onnx' not found"),
    "model is not ONNX": (["train", "{d}/afile", "--data", "{d}/data.npz"], 2, "could not read ONNX model"),
    "missing checkpoint to resume": (TRAIN + ["--resume", "{d}/none.safetensors"], 2, "--resume"),
    "corrupt checkpoint to resume": (TRAIN + ["--resume", "{d}/afile"], 2, "--resume {d}/afile: "),
    "loss output without a loss": (TRAIN + ["--loss-output", "logits"], 2, "--loss-output needs --loss"),
    "warm-up without a schedule": (TRAIN + ["--warmup-steps", "5"], 2, "--warmup-steps needs --scheduler"),
    "unknown option": (TRAIN + ["--stpes", "5"], 2, "unrecognized arguments: --stpes"),
    "demo into a missing directory": (["demo", "--output", "{d}/missing/t.onnx"], 2, "missing' does not exist; create it first"),
    "demo with zero steps": (["demo", "--steps", "0"], 2, "argument --steps: must be 1 or more, got 0"),
    "build with weights and all initializers": (["build", "{d}/linear.onnx", "--loss", "loss", "--weights", "W",
                                                 "--all-initializers", "-o", "{d}/g.onnx"], 2, "not allowed with"),
    "build into a missing directory": (["build", "{d}/linear.onnx", "--loss", "loss", "-o", "{d}/missing/g.onnx"], 2,
                                       "missing' does not exist; create it first"),
    "build an op without a rule": (["build", "{d}/custom.onnx", "--loss", "loss", "-o", "{d}/g.onnx"], 1, "Mystery"),
    "artifacts into a file": (["artifacts", "{d}/model.onnx", "-o", "{d}/afile/out"], 2, "afile' is a file, not a directory"),
    "artifacts freezing what the model lacks": (["artifacts", "{d}/model.onnx", "--frozen", "nope", "-o", "{d}/out"],
                                                2, "--frozen: the model has no float initializer named nope"),
    "artifacts target without a loss": (["artifacts", "{d}/model.onnx", "--target", "y", "-o", "{d}/out"], 2,
                                        "--target needs --loss"),
}


def _tree(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.parametrize("argv,status,fragment", CASES.values(), ids=CASES.keys())
def test_bad_command_line(files, capsys, argv, status, fragment):
    before = _tree(files)
    assert main([a.replace("{d}", str(files)) for a in argv]) == status
    out, err = capsys.readouterr()
    assert fragment.replace("{d}", str(files)) in err
    assert len(err.splitlines()) == 1, err  # one line, no traceback
    assert err.startswith("gradbuilder")
    assert "loss" not in out  # refused before training
    assert _tree(files) == before  # nothing written


def test_status_of_each_error_kind():
    assert [exit_status(e("x")) for e in (InvalidArgumentError, ModelLoadError)] == [2, 2]
    assert [exit_status(e("x")) for e in (InvalidModelError, UnsupportedOpError, CheckpointError, OutputError)] == [1] * 4


def test_a_failed_write_is_one_line_with_status_1(files, capsys, monkeypatch):
    import gradbuilder.compiler.builder

    def disk_full(self, path):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(gradbuilder.compiler.builder.GradientGraphBuilder, "save", disk_full)
    assert main(["build", str(files / "linear.onnx"), "--loss", "loss", "-o", str(files / "g.onnx")]) == 1
    err = capsys.readouterr().err
    assert err == f"gradbuilder: error: [Errno 28] No space left on device: '{files / 'g.onnx'}'\n"
