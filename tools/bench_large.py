"""A model over 2 GB through the whole flow, with the peak resident memory of each stage.

Protobuf cannot hold 2 GB: every model gradbuilder reads, writes or serializes must keep its
large tensors in external data. The model here is an embedding table of ``--gib`` GiB (an
initializer in external data, written straight to disk, never held in a protobuf) read by a
Gather, with a small dense layer after it: little compute, all the size. One process runs
the stages a user runs, in order, and prints for each its peak resident memory (VmHWM,
reset before the stage through /proc/self/clear_refs) over the memory before the model was
touched, as a multiple of the weights' bytes:

    build         GradientGraphBuilder(...).build().save(...)   (external data)
    session       TrainingSession(...)                          (SGD)
    step          one training step
    save          save_checkpoint
    load          load_checkpoint
    export        export_model_for_inferencing
    artifacts     generate_artifacts (training, eval, optimizer models and checkpoint)

    python tools/bench_large.py                  # 2.1 GiB
    python tools/bench_large.py --gib 0.25 --stages build session step   # quick

Each stage must stay under 3x the weights' bytes (``--limit``); the script exits 1 when one
does not, or when one fails.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time

import numpy as np

WIDTH = 1024  # the table's width (gradbuilder.testing.embedding_model_on_disk)
STAGES = ("build", "session", "step", "save", "load", "export", "artifacts")


def run(args) -> int:
    from gradbuilder import GradientGraphBuilder, TrainingParameters, TrainingSession
    from gradbuilder.testing import embedding_model_on_disk, reset_peak, resident_bytes
    from gradbuilder.training.artifacts import generate_artifacts

    work = tempfile.mkdtemp(prefix="bench_large_")
    path, nbytes = embedding_model_on_disk(work, args.gib)
    gc.collect()
    base = resident_bytes("VmRSS")
    print(f"model: {path}, E {nbytes / 2**30:.2f} GiB in external data; resident before: {base / 2**20:.0f} MiB")
    rng = np.random.default_rng(1)
    feeds = {"ids": rng.integers(0, nbytes // (WIDTH * 4), 64), "labels": rng.integers(0, 4, 64)}
    params = TrainingParameters(loss_output_name="loss", training_optimizer_name="sgd", enable_grad_norm_clip=False)
    state: dict = {}

    def stage_build():
        GradientGraphBuilder(path, weights=["E", "W"], outputs=["loss"], loss="loss").build().save(
            os.path.join(work, "grad.onnx"))

    def stage_session():
        state["session"] = TrainingSession(path, params)

    def stage_step():
        state["loss"] = float(state["session"].run(["loss"], feeds)[0])

    def stage_save():
        state["session"].save_checkpoint(os.path.join(work, "ckpt"))

    def stage_load():
        state["session"].load_checkpoint(os.path.join(work, "ckpt"))

    def stage_export():
        state["session"].export_model_for_inferencing(os.path.join(work, "infer.onnx"), ["logits"])

    def stage_artifacts():
        state.pop("session", None)
        gc.collect()
        generate_artifacts(path, requires_grad=["E", "W"], optimizer="sgd", artifact_directory=os.path.join(work, "art"))

    stages = {"build": stage_build, "session": stage_session, "step": stage_step, "save": stage_save,
              "load": stage_load, "export": stage_export, "artifacts": stage_artifacts}
    failed = []
    print(f"{'stage':<10} {'seconds':>8} {'peak over base':>16} {'x weights':>10}")
    for name in args.stages:
        gc.collect()
        reset_peak()
        t0 = time.perf_counter()
        try:
            stages[name]()
        except Exception as exc:  # a stage that fails is reported, and the run goes on
            failed.append(name)
            print(f"{name:<10} failed: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        peak = resident_bytes("VmHWM") - base
        ratio = peak / nbytes
        flag = "" if ratio < args.limit else f"  over {args.limit}x"
        if flag:
            failed.append(name)
        print(f"{name:<10} {time.perf_counter() - t0:8.1f} {peak / 2**30:12.2f} GiB {ratio:10.2f}{flag}")
    written = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(work) for f in fs)
    print(f"written: {written / 2**30:.1f} GiB under {work}")
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=2.1, help="size of the embedding table (default 2.1 GiB)")
    ap.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    ap.add_argument("--limit", type=float, default=3.0, help="peak over base, in weights' bytes, a stage must stay under")
    ap.add_argument("--keep", action="store_true", help="keep the files written")
    sys.exit(run(ap.parse_args()))


if __name__ == "__main__":
    main()
