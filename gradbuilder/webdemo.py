"""``gradbuilder web-demo``: a page that trains a digit classifier in the browser.

The folder it writes holds the web artifacts of an MLP 64-64-10 (``training.web.export_web``,
AdamW, cross-entropy), scikit-learn's 8x8 digits split into ``data.safetensors`` (train) and
``test.safetensors``, the page (``gradbuilder/web/index.html``), ``gradbuilder-train.mjs`` and
onnxruntime-web's files (its WASM and WebGPU builds), copied from an installed
``onnxruntime-web`` npm package: nothing is fetched from the network, by the command or by
the page. ``--serve`` serves the folder on localhost with Python's http.server.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from .errors import InvalidArgumentError

WEB = Path(__file__).with_name("web")
ORT_FILES = ("ort.wasm.min.mjs", "ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm",
             "ort.webgpu.min.mjs", "ort-wasm-simd-threaded.asyncify.mjs", "ort-wasm-simd-threaded.asyncify.wasm")
HIDDEN, CLASSES, LR = 64, 10, 0.01


def find_ort_web(given: str | os.PathLike | None = None) -> Path:
    """onnxruntime-web's ``dist`` folder: ``given``, else ``node_modules/onnxruntime-web/dist``
    here or above the working directory."""
    candidates = [Path(given)] if given else [
        p / "node_modules" / "onnxruntime-web" / "dist" for p in [Path.cwd(), *Path.cwd().parents]]
    for c in candidates:
        if all((c / f).is_file() for f in ORT_FILES):
            return c
    where = f"--ort-web {given}" if given else "no node_modules/onnxruntime-web/dist here or above"
    raise InvalidArgumentError(f"{where}: onnxruntime-web's files are needed for the page; install them with "
                               "`npm install onnxruntime-web@1.30.0` (or `npm ci` in gradbuilder's checkout), or "
                               "pass --ort-web DIR (its dist folder)")


def digits() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """scikit-learn's digits (pixels scaled to [0, 1]), shuffled with a fixed seed: (train, test),
    each {"x": float32 [n, 64], "target": int64 [n]}; the last 360 samples are the test set."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise InvalidArgumentError("the web demo trains on scikit-learn's digits: pip install 'gradbuilder[web]' "
                                   "(or scikit-learn)") from None
    data = load_digits()
    order = np.random.default_rng(0).permutation(len(data.target))
    x, y = (data.data[order] / 16.0).astype(np.float32), data.target[order].astype(np.int64)
    return {"x": x[:-360], "target": y[:-360]}, {"x": x[-360:], "target": y[-360:]}


def mlp():
    """The demo's classifier: logits = relu(x W1 + B1) W2 + B2 (He-initialized, seed 0)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((64, HIDDEN)) * np.sqrt(2 / 64)).astype(np.float32), "W1"),
             numpy_helper.from_array(np.zeros(HIDDEN, np.float32), "B1"),
             numpy_helper.from_array((rng.standard_normal((HIDDEN, CLASSES)) * np.sqrt(2 / HIDDEN)).astype(np.float32),
                                     "W2"),
             numpy_helper.from_array(np.zeros(CLASSES, np.float32), "B2")]
    nodes = [helper.make_node("Gemm", ["x", "W1", "B1"], ["h"]), helper.make_node("Relu", ["h"], ["a"]),
             helper.make_node("Gemm", ["a", "W2", "B2"], ["logits"])]
    graph = helper.make_graph(nodes, "digits_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CLASSES])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8,
                             producer_name="gradbuilder web-demo")


def write(directory: str | os.PathLike, ort_web: str | os.PathLike | None = None) -> Path:
    """Write the demo folder (every input checked first); returns it."""
    from . import files
    from .training.web import export_web, safetensors_bytes

    dist = find_ort_web(ort_web)
    train, test = digits()
    directory = files.check_output_directory(directory, what="demo folder")
    export_web(mlp(), directory, loss="crossentropy", loss_output="logits", lr=LR)
    (directory / "data.safetensors").write_bytes(safetensors_bytes(train))
    (directory / "test.safetensors").write_bytes(safetensors_bytes(test))
    for name in ("index.html", "gradbuilder-train.mjs"):
        shutil.copyfile(WEB / name, directory / name)
    (directory / "ort").mkdir(exist_ok=True)
    for name in ORT_FILES:
        shutil.copyfile(dist / name, directory / "ort" / name)
    return directory


def server(directory: Path, port: int = 0):
    """An http.server for ``directory`` on localhost (``port`` 0: a free one), not yet serving;
    ``.mjs`` and ``.wasm`` go out with the types browsers require of modules and WebAssembly."""
    import http.server

    class Handler(http.server.SimpleHTTPRequestHandler):
        extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map,
                          ".mjs": "text/javascript", ".wasm": "application/wasm", ".onnx": "application/octet-stream"}

        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(directory), **kwargs)

        def log_message(self, *args):  # quiet: the page's requests are not news
            pass

    return http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)


def serve(directory: Path, port: int) -> None:
    """Serve ``directory`` on localhost until interrupted."""
    with server(directory, port) as httpd:
        print(f"open http://127.0.0.1:{httpd.server_address[1]}/ (Ctrl-C stops)", flush=True)
        httpd.serve_forever()
