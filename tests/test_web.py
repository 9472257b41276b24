"""Training where inference runs: the artifacts of ``export_web`` trained by stock
onnxruntime-node (examples/train.mjs) and by onnxruntime-web in headless Chromium (the web
demo), against a Python TrainingSession on the same batches.

The Node and browser tests need ``node``, the npm packages of package-lock.json (``npm ci``)
and Debian's ``chromium``; where they are missing the tests say which command installs them,
unless GRADBUILDER_REQUIRE_WEB=1 (set by .ci/run), where that is a failure."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from safetensors.numpy import load_file

from gradbuilder import TrainingParameters, TrainingSession
from gradbuilder.errors import InvalidArgumentError
from gradbuilder.training.loss import append_loss
from gradbuilder.training.web import NAMES, export_web, safetensors_bytes

ROOT = Path(__file__).resolve().parent.parent
TRAIN_MJS = ROOT / "examples" / "train.mjs"
BROWSER_MJS = Path(__file__).with_name("web") / "browser_train.mjs"
RTOL = 1e-5
STEPS = 20
LR = 0.01


def _missing(what: str, install: str):
    message = f"{what} is not installed here; install it with: {install}"
    if os.environ.get("GRADBUILDER_REQUIRE_WEB") == "1":
        pytest.fail(message)
    pytest.skip(message)


def need_node() -> None:
    if shutil.which("node") is None:
        _missing("node", "apt-get install nodejs")
    for package in ("onnxruntime-node", "onnxruntime-web", "puppeteer-core"):
        if not (ROOT / "node_modules" / package / "package.json").exists():
            _missing(f"the npm package {package}", f"npm ci (in {ROOT})")


def need_chromium() -> str:
    path = os.environ.get("CHROMIUM") or shutil.which("chromium")
    if path is None:
        _missing("chromium", "apt-get install chromium")
    return path


# ---------------------------------------------------------------------------- models and data
def mlp() -> onnx.ModelProto:
    from gradbuilder.webdemo import mlp as digits_mlp

    return digits_mlp()


def transformer() -> onnx.ModelProto:
    torch = pytest.importorskip("torch")
    from .torch_models import TinyEncoder, export

    tokens, labels = torch.randint(0, 32, (4, 6)), torch.randint(0, 4, (4,))
    # in training mode (its dropout is off): an eval-mode export would merge the cloned layers' equal weights
    return export(TinyEncoder(32, classes=4).train(), (tokens, labels), ["x", "target"], dynamo=False, opset=17,
                  dynamic_batch=True)


def data_for(name: str, n: int = 64) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    if name == "mlp":
        return {"x": rng.random((n, 64), dtype=np.float32), "target": rng.integers(0, 10, n).astype(np.int64)}
    return {"x": rng.integers(0, 32, (n, 6)).astype(np.int64), "target": rng.integers(0, 4, n).astype(np.int64)}


def batches(data: dict, steps: int, batch: int):
    """examples/train.mjs's order: step i takes rows [i*batch mod n', +batch), n' whole batches."""
    n = len(next(iter(data.values())))
    whole = n // batch * batch
    for i in range(steps):
        start = i * batch % whole
        yield {k: v[start: start + batch] for k, v in data.items()}


def python_run(model: onnx.ModelProto, data: dict, steps: int, batch: int, lr: float = LR):
    """The reference: a TrainingSession with the same parameters as export_web's."""
    params = TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw", enable_grad_norm_clip=False)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = TrainingSession(model.SerializeToString(), params, so, providers=["CPUExecutionProvider"])
    sess.set_learning_rate(lr)
    losses = [float(sess.run(["loss"], b)[0]) for b in batches(data, steps, batch)]
    return losses, sess


def with_loss(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    return append_loss(model, "crossentropy", "logits", target_name="target", loss_name="loss") if name == "mlp" \
        else model


def export(model: onnx.ModelProto, name: str, directory: Path) -> None:
    if name == "mlp":
        export_web(model, directory, loss="crossentropy", loss_output="logits", lr=LR)
    else:
        export_web(model, directory, lr=LR)


# ---------------------------------------------------------------------------- the artifacts
def test_the_artifacts_describe_a_loop_that_trains_as_a_training_session(tmp_path):
    """Driving training_model.onnx by its manifest in Python's onnxruntime is the session's step."""
    model, data = mlp(), data_for("mlp")
    export(model, "mlp", tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(NAMES)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    state = load_file(tmp_path / "state.safetensors")
    assert sorted(s["input"] for s in manifest["state"]) == sorted(state)
    assert [i["name"] for i in manifest["training"]["inputs"]] == ["x", "target"]
    sess = ort.InferenceSession(str(tmp_path / "training_model.onnx"), providers=["CPUExecutionProvider"])
    losses = []
    for b in batches(data, 5, 16):
        feeds = {**b, **state, manifest["learning_rate"]["input"]: np.array(LR, np.float32)}
        out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        losses.append(float(out["loss"]))
        state = {s["input"]: out[s["output"]] for s in manifest["state"]}
    ref_losses, ref = python_run(with_loss(model, "mlp"), data, 5, 16)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for w, v in ref.get_model_state()["full_precision"].items():
        np.testing.assert_allclose(state[w], v, rtol=1e-6, err_msg=w)
    # the inference model reads its initializers from the data file at the manifest's offsets
    raw = (tmp_path / "inference_model.onnx.data").read_bytes()
    for t in manifest["inference"]["tensors"]:
        np.testing.assert_array_equal(np.frombuffer(raw[t["offset"]: t["offset"] + t["length"]], np.float32)
                                      .reshape(t["shape"]), load_file(tmp_path / "state.safetensors")[t["name"]])
    inference = ort.InferenceSession(str(tmp_path / "inference_model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in inference.get_inputs()] == ["x"] and [o.name for o in inference.get_outputs()] == ["logits"]
    assert all(onnx.load(tmp_path / n, load_external_data=False).ir_version == 8
               for n in ("training_model.onnx", "eval_model.onnx", "inference_model.onnx"))


def test_bad_arguments_leave_nothing_behind(tmp_path):
    with pytest.raises(InvalidArgumentError, match="lr must be a finite number"):
        export_web(mlp(), tmp_path / "a", lr=float("nan"))
    with pytest.raises(InvalidArgumentError, match="unknown|optimizer"):
        export_web(mlp(), tmp_path / "b", optimizer="rmsprop")
    (tmp_path / "file").write_text("x")
    with pytest.raises(Exception, match="file"):
        export_web(mlp(), tmp_path / "file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


# ---------------------------------------------------------------------------- Node
@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_onnxruntime_node_trains_as_python_does(tmp_path, name):
    need_node()
    model, data = (mlp(), data_for("mlp")) if name == "mlp" else (transformer(), data_for("transformer"))
    export(model, name, tmp_path)
    (tmp_path / "data.safetensors").write_bytes(safetensors_bytes(data))
    run = subprocess.run(["node", str(TRAIN_MJS), str(tmp_path), "--steps", str(STEPS), "--batch", "16", "--threads",
                          "1", "--out", str(tmp_path / "trained.safetensors"), "--losses", str(tmp_path / "losses.json")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = json.loads((tmp_path / "losses.json").read_text())["losses"]
    ref_losses, ref = python_run(with_loss(model, name), data, STEPS, 16)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    trained = load_file(tmp_path / "trained.safetensors")
    expected = {**ref.get_model_state()["full_precision"],
                **{f"{w}.{s}": v for w, states in ref.get_optimizer_state().items() if w != "shared_optimizer_state"
                   for s, v in states.items()}}
    for k, v in expected.items():
        np.testing.assert_allclose(trained[k], v, rtol=RTOL, atol=1e-7, err_msg=k)
    assert int(trained["Step"]) == ref.step == STEPS
    # the model exported for inference from JavaScript gives the trained model's outputs
    inference = ort.InferenceSession(str(tmp_path / "trained" / "inference_model.onnx"),
                                     providers=["CPUExecutionProvider"])
    ref.export_model_for_inferencing(str(tmp_path / "python.onnx"), [inference.get_outputs()[0].name])
    feeds = {i.name: data[i.name][:8] for i in inference.get_inputs()}
    np.testing.assert_allclose(inference.run(None, feeds)[0],
                               ort.InferenceSession(str(tmp_path / "python.onnx")).run(None, feeds)[0], rtol=1e-4,
                               atol=1e-6)


def test_node_state_round_trip_and_eval_step(tmp_path):
    """saveState / loadState carry the training on exactly; a state of another shape is
    refused; evalStep gives what Python's onnxruntime gives from the same state."""
    need_node()
    model, data = mlp(), data_for("mlp")
    export(model, "mlp", tmp_path)
    (tmp_path / "data.safetensors").write_bytes(safetensors_bytes(data))
    run = subprocess.run(["node", str(Path(__file__).with_name("web") / "state_roundtrip.mjs"), str(tmp_path),
                          str(tmp_path / "out.json")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["losses"][0] == out["losses"][1] and out["step"] == 3
    assert "loadState: 'W1' must be float32 [64,64]" in out["refused"]
    state = load_file(tmp_path / "after.safetensors")
    evaluation = ort.InferenceSession(str(tmp_path / "eval_model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {i.name: (state[i.name] if i.name in state else data[i.name][24:32]) for i in evaluation.get_inputs()}
    expected = dict(zip([o.name for o in evaluation.get_outputs()], evaluation.run(None, feeds)))
    for name, got in out["eval"].items():
        np.testing.assert_allclose(np.array(got["data"], np.float32).reshape(got["dims"]), expected[name], rtol=1e-5,
                                   atol=1e-6, err_msg=name)


# ---------------------------------------------------------------------------- the browser
def test_chromium_trains_the_web_demo(tmp_path):
    need_node()
    chromium = need_chromium()
    from gradbuilder import webdemo

    folder = webdemo.write(tmp_path / "demo", ROOT / "node_modules" / "onnxruntime-web" / "dist")
    server = _serve(folder)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/?steps=300&backend=wasm"
        run = subprocess.run(["node", str(BROWSER_MJS), url, str(tmp_path / "page.png"), "240"], capture_output=True,
                             text=True, timeout=300, cwd=ROOT, env={**os.environ, "CHROMIUM": chromium})
    finally:
        server.shutdown()
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["error"] is None, result["error"]
    assert result["backend"] == "wasm" and len(result["losses"]) == 300
    assert result["accuracy"] >= 0.93, result["accuracies"]
    train, _ = webdemo.digits()
    ref_losses, _ = python_run(with_loss(webdemo.mlp(), "mlp"), train, 20, 32, lr=webdemo.LR)
    np.testing.assert_allclose(result["losses"][:20], ref_losses, rtol=RTOL)
    assert (tmp_path / "page.png").stat().st_size > 10_000


def _serve(folder: Path):
    """The demo folder on a free localhost port, served from a thread."""
    from gradbuilder import webdemo

    server = webdemo.server(folder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


# ---------------------------------------------------------------------------- the command line
def test_cli_export_web_and_web_demo(tmp_path, capsys, monkeypatch):
    from gradbuilder.cli import main

    onnx.save(mlp(), tmp_path / "mlp.onnx")
    assert main(["export-web", str(tmp_path / "mlp.onnx"), "-o", str(tmp_path / "web"), "--loss", "crossentropy",
                 "--loss-output", "logits", "--lr", "0.05"]) == 0
    assert "node examples/train.mjs" in capsys.readouterr().out
    assert json.loads((tmp_path / "web" / "manifest.json").read_text())["learning_rate"]["value"] == 0.05
    assert main(["export-web", str(tmp_path / "mlp.onnx"), "-o", str(tmp_path / "x"), "--target", "t"]) == 2
    assert "--loss-output and --target need --loss" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)  # no node_modules here or above
    assert main(["web-demo", "-o", str(tmp_path / "demo"), "--ort-web", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "onnxruntime-web's files are needed" in err and "npm install onnxruntime-web@1.30.0" in err
    assert not (tmp_path / "demo").exists()
