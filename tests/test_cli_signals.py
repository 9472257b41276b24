"""SIGINT (Ctrl-C) and SIGTERM stop `gradbuilder train` between steps: with --checkpoint the
state after the last finished step is saved and resuming from it gives what an uninterrupted
run gives; without it the command says nothing was saved. The exit status is 128 + signal."""

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from gradbuilder.runtime import checkpoint
from gradbuilder.cli import main
from gradbuilder.demo import demo_batch, demo_model_bytes


@pytest.fixture
def files(tmp_path):
    (tmp_path / "model.onnx").write_bytes(demo_model_bytes())
    x, labels = demo_batch(200, seed=5)
    np.savez(tmp_path / "data.npz", x=x, labels=labels)
    return tmp_path


def _common(d):
    return ["train", str(d / "model.onnx"), "--data", str(d / "data.npz"), "--batch-size", "16", "--lr", "0.01",
            "--scheduler", "constant_with_warmup", "--warmup-steps", "40", "--seed", "7"]


def _train_until_signal(argv, signum, after_steps: int = 5):
    """Run the command in a child process, send ``signum`` once its progress bar shows
    ``after_steps`` finished steps; returns (exit status, stderr)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    child = subprocess.Popen([sys.executable, "-m", "gradbuilder.cli", *argv, "--progress"], stderr=subprocess.PIPE,
                             stdout=subprocess.PIPE, env=env)
    seen, deadline = b"", time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            chunk = os.read(child.stderr.fileno(), 4096)
            if not chunk:
                break
            seen += chunk
            steps = [int(n) for n in re.findall(rb"\| (\d+)/\d+ ", seen)]
            if steps and max(steps) >= after_steps:
                child.send_signal(signum)
                break
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    return child.returncode, (seen + err).decode()


@pytest.mark.slow  # a CLI training run in a subprocess, signalled, then resumed
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_saves_a_checkpoint_that_resumes_as_one_run(files, capsys, signum):
    stopped = files / "stopped.safetensors"
    status, err = _train_until_signal(_common(files) + ["--steps", "100000", "--checkpoint", str(stopped),
                                                        "-o", str(files / "t.onnx")], signum)
    assert status == 128 + signum
    last = err.strip().splitlines()[-1]
    name = signal.Signals(signum).name
    assert re.fullmatch(rf"gradbuilder: {name} after \d+ of 100000 batches: saved the training state to "
                        rf"{re.escape(str(stopped))}; to continue, run the same command with --resume "
                        rf"{re.escape(str(stopped))}", last), last
    assert not (files / "t.onnx").exists()  # only the checkpoint is written
    _, meta = checkpoint.load(stopped)
    seen = int(re.search(r"after (\d+) of", last).group(1))
    assert seen >= 5 and f'"batches_seen": {seen}' in meta["properties"]

    total = seen + 23  # past the warm-up and past an epoch boundary (12 batches of 16 per epoch)
    whole, resumed = files / "whole.safetensors", files / "resumed.safetensors"
    assert main(_common(files) + ["--steps", str(total), "--checkpoint", str(whole)]) == 0
    assert main(_common(files) + ["--steps", str(total), "--resume", str(stopped), "--checkpoint", str(resumed)]) == 0
    assert f"resumed from {stopped} at step {seen} ({seen} batches)" in capsys.readouterr().err
    a, meta_a = checkpoint.load(whole)
    b, meta_b = checkpoint.load(resumed)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    assert meta_a["learning_rate"] == meta_b["learning_rate"] and meta_a["properties"] == meta_b["properties"]


@pytest.mark.slow  # a CLI training run in a subprocess
def test_signal_without_checkpoint_saves_nothing(files):
    status, err = _train_until_signal(_common(files) + ["--steps", "100000", "-o", str(files / "t.onnx")],
                                      signal.SIGTERM, after_steps=2)
    assert status == 143
    assert re.fullmatch(r"gradbuilder: SIGTERM after \d+ of 100000 batches: nothing was saved \(with --checkpoint "
                        r"PATH the state is saved there when training is stopped\)", err.strip().splitlines()[-1])
    assert sorted(p.name for p in files.iterdir()) == ["data.npz", "model.onnx"]
