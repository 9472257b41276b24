"""Training speed of the web demo's model (an MLP 64-64-10, AdamW, batch 32, scikit-learn's
digits) in each runtime that trains it from the same `gradbuilder web-demo` artifacts:

- ``python``:          a TrainingSession (onnxruntime, 1 intra-op thread);
- ``node``:            onnxruntime-node 1.30 through gradbuilder-train.mjs (examples/train.mjs, 1 thread);
- ``chromium-wasm``:   onnxruntime-web 1.30 in headless Chromium, WASM, 1 thread (the page is not
                       cross-origin isolated, so no WASM threads);
- ``chromium-webgpu``: the same on WebGPU, where headless Chromium offers an adapter (on a
                       machine without a GPU that is SwiftShader, a software renderer).

Each contender trains ``--steps`` steps per round, rounds taking turns, with /proc/pressure/cpu
read around each; printed: steps/s (median over rounds, the first step included everywhere).
``--screenshot PATH`` keeps the screenshot of one more WASM run, which draws the test accuracy
as it goes (docs/web-demo.png).

    npm ci && python tools/bench_web.py [--steps 600] [--rounds 2] [--screenshot docs/web-demo.png]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import benchlib

ROOT = Path(__file__).resolve().parent.parent


def python_steps(folder: Path, steps: int) -> float:
    import numpy as np
    import onnxruntime as ort
    from safetensors.numpy import load_file

    from gradbuilder import TrainingParameters, TrainingSession
    from gradbuilder import webdemo
    from gradbuilder.training.loss import append_loss

    model = append_loss(webdemo.mlp(), "crossentropy", "logits", target_name="target", loss_name="loss")
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = TrainingSession(model.SerializeToString(),
                           TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw",
                                              enable_grad_norm_clip=False), so, providers=["CPUExecutionProvider"])
    sess.set_learning_rate(webdemo.LR)
    data = load_file(folder / "data.safetensors")
    n, batch = len(data["target"]), 32
    whole = n // batch * batch
    start = time.perf_counter()
    for i in range(steps):
        s = i * batch % whole
        sess.run(["loss"], {k: np.ascontiguousarray(v[s: s + batch]) for k, v in data.items()})
    return steps / (time.perf_counter() - start)


def node_steps(folder: Path, steps: int) -> float:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run(["node", str(ROOT / "examples" / "train.mjs"), str(folder), "--steps", str(steps), "--batch", "32",
                        "--threads", "1", "--losses", f.name], check=True, cwd=ROOT, capture_output=True)
        result = json.loads(Path(f.name).read_text())
    return result["steps"] / result["seconds"]


def browser_steps(url: str, backend: str, steps: int, screenshot: Path, every: int | None = None) -> float | None:
    """Steps/s of the page (test accuracy only after the last step unless ``every``)."""
    run = subprocess.run(["node", str(ROOT / "tests" / "web" / "browser_train.mjs"),
                          f"{url}?steps={steps}&backend={backend}&every={every or steps}", str(screenshot), "600"],
                         check=True, cwd=ROOT, capture_output=True, text=True)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    if result["error"] or result["backend"] != backend:
        return None
    return steps / result["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--screenshot", help="keep the page's screenshot of the last WASM run here")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from gradbuilder import webdemo

    with tempfile.TemporaryDirectory() as tmp:
        folder = webdemo.write(Path(tmp) / "demo")
        server = webdemo.server(folder)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        shot = Path(tmp) / "page.png"
        contenders = {
            "python": lambda: python_steps(folder, args.steps),
            "node": lambda: node_steps(folder, args.steps),
            "chromium-wasm": lambda: browser_steps(url, "wasm", args.steps, shot),
            "chromium-webgpu": lambda: browser_steps(url, "webgpu", args.steps, Path(tmp) / "gpu.png"),
        }
        print(f"MLP 64-64-10, batch 32, {args.steps} steps a round; {benchlib.reading()}")
        rates: dict[str, list] = {k: [] for k in contenders}
        for r in range(args.rounds):
            for name, run in contenders.items():
                rate, before, after = benchlib.measured_round(run, f"round {r + 1} {name}")
                print(benchlib.round_line(f"round {r + 1} {name:<16}", before, after) + ": "
                      + (f"{rate:.1f} steps/s" if rate else "not available"))
                rates[name].append(rate)
        if args.screenshot:  # a run that draws the test accuracy as it goes, not timed
            browser_steps(url, "wasm", args.steps, shot, every=25)
            shutil.copyfile(shot, args.screenshot)
        server.shutdown()
    print(f"\n{'runtime':<18} {'steps/s':>9} {'vs python':>10}")
    base = statistics.median(rates["python"])
    for name, got in rates.items():
        got = [g for g in got if g]
        if got:
            print(f"{name:<18} {statistics.median(got):>9.1f} {statistics.median(got) / base:>10.2f}")
        else:
            print(f"{name:<18} {'n/a':>9}")
    print(benchlib.reading())


if __name__ == "__main__":
    main()
