"""Checkpoint load benchmark: time and peak memory of reading one checkpoint of ``--mb`` MB.

    python tools/bench_checkpoint.py                          # 384 MB, 3 rounds
    python tools/bench_checkpoint.py --before-source OLD.py   # also an earlier runtime/checkpoint.py

The state is shaped like a model trained with AdamW: 32 float32 weights of ``--mb``/96 MB
each, their ``exp_avg`` and ``exp_avg_sq``, and ``Step``. Contenders, each load in a child
process of its own (so peaks do not mix), rounds interleaved:

    gradbuilder          gradbuilder.runtime.checkpoint.load of a file written by gradbuilder.runtime.checkpoint.save
    gradbuilder-v1file   the same load of a file in the first checkpoint format
                         (written by ``--before-source``; only with it)
    before               ``--before-source``'s load of its own file (an earlier checkpoint.py)
    safetensors          safetensors.numpy.load_file of the gradbuilder file (the package alone:
                         no digest, arrays backed by its own buffers)

Time: wall time of the load call, median over the rounds. Memory: VmHWM after the load minus
the resident size before it (the peak is reset first through /proc/self/clear_refs), the
largest over the rounds. The file is in the page cache (it was just written), so the figures
are of the reading code, not the disk. /proc/pressure/cpu is printed before and after: the
figures mean something only while avg10 stays low (another busy process shares the cores).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchlib import avg10, pressure_line


def old_module(source: str):
    """An earlier gradbuilder/runtime/checkpoint.py, imported beside the current one."""
    spec = importlib.util.spec_from_file_location("gradbuilder.runtime._checkpoint_before", source)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def state(mb: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(0)
    size = mb * 2**20 // 96 // 4  # float32 elements per tensor
    tensors = {}
    for i in range(32):
        w = rng.standard_normal(size, dtype=np.float32).reshape(-1, 256)
        tensors[f"layer{i}.weight"] = w
        tensors[f"layer{i}.weight.exp_avg"] = w * np.float32(0.1)
        tensors[f"layer{i}.weight.exp_avg_sq"] = w * w
    tensors["Step"] = np.array(100, np.int64)
    return tensors


def write(kind: str, path: str, mb: int, source: str | None) -> None:
    from gradbuilder.runtime import checkpoint

    module = old_module(source) if kind == "before" else checkpoint
    module.save(path, state(mb), {"model": "bench"})


def load(kind: str, path: str, source: str | None) -> dict:
    from gradbuilder.runtime import checkpoint
    from gradbuilder.testing import reset_peak, resident_bytes
    from safetensors.numpy import load_file

    if kind == "safetensors":
        fn = load_file
    elif kind == "before":
        fn = old_module(source).load
    else:
        fn = checkpoint.load
    try:
        reset_peak()  # VmHWM made the current resident size
    except OSError:
        pass
    base = resident_bytes("VmRSS")
    t0 = time.perf_counter()
    out = fn(path)
    seconds = time.perf_counter() - t0
    tensors = out[0] if isinstance(out, tuple) else out
    peak_mb = (resident_bytes("VmHWM") - base) / 2**20
    assert len(tensors) == 97 and tensors["layer3.weight.exp_avg_sq"].min() >= 0
    return {"seconds": seconds, "peak_mb": peak_mb}


def child(args) -> int:
    if args.child == "write":
        write(args.kind, args.path, args.mb, args.before_source)
        return 0
    print(json.dumps(load(args.kind, args.path, args.before_source)))
    return 0


def run_child(*argv) -> dict | None:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *argv], check=True,
                         capture_output=True, text=True).stdout.strip()
    return json.loads(out) if out else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=384, help="checkpoint size in MB (default 384)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--before-source", help="an earlier gradbuilder/checkpoint.py to compare with")
    p.add_argument("--dir", help="where to write the files (default: a temporary directory)")
    p.add_argument("--child", choices=["write", "load"], help=argparse.SUPPRESS)
    p.add_argument("--kind", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)

    before = pressure_line()
    print(f"/proc/pressure/cpu before: {before}")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        files = {"gradbuilder": os.path.join(tmp, "new.safetensors")}
        extra = ["--before-source", args.before_source] if args.before_source else []
        if args.before_source:
            files["before"] = os.path.join(tmp, "old.safetensors")
        for kind, path in files.items():
            run_child("--child", "write", "--kind", kind, "--path", path, "--mb", str(args.mb), *extra)
        contenders = {"gradbuilder": files["gradbuilder"], "safetensors": files["gradbuilder"]}
        if args.before_source:
            contenders["gradbuilder-v1file"] = files["before"]
            contenders["before"] = files["before"]
        for kind in contenders:  # one unmeasured pass: the files are in the page cache
            run_child("--child", "load", "--kind", kind, "--path", contenders[kind], *extra)
        results = {kind: [] for kind in contenders}
        for _ in range(args.rounds):
            for kind, path in contenders.items():
                results[kind].append(run_child("--child", "load", "--kind", kind, "--path", path, *extra))
        size = os.path.getsize(files["gradbuilder"]) / 2**20
    after = pressure_line()

    ref = statistics.median(r["seconds"] for r in results["safetensors"])
    print(f"checkpoint: {size:.0f} MB, {args.rounds} rounds, each load in a fresh process")
    print("| contender | load s (median) | min-max s | vs safetensors | peak MB over baseline (max) |")
    print("|---|---|---|---|---|")
    for kind, runs in results.items():
        times = [r["seconds"] for r in runs]
        seconds = statistics.median(times)
        peak = max(r["peak_mb"] for r in runs)
        print(f"| {kind} | {seconds:.2f} | {min(times):.2f}-{max(times):.2f} | {seconds / ref:.2f}x | {peak:.0f} |")
    print(f"/proc/pressure/cpu after:  {after}")
    busy = max(avg10(before), avg10(after))
    if busy >= 10:
        print(f"the machine was busy (avg10 {busy:.1f}% >= 10%): run again when it is idle")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
