"""Training that survives faults: periodic checkpoints (``fit(save_every=...)``,
``gradbuilder train --save-every``), the newest complete one resumed (``--resume auto``, and by
itself after a restart by torch's launcher, ``--max-restarts``), a damaged newest one passed
over, survivors that save. Faults are injected for real: processes SIGKILLed at several points
of a run, while a checkpoint is being written, and one rank of two; every run then finishes
with final weights and optimizer state **bit-identical** to an uninterrupted run's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from gradbuilder import TrainingParameters, TrainingSession
from gradbuilder.runtime import checkpoint
from gradbuilder.runtime.loop import fit
from gradbuilder.runtime.periodic import CheckpointSeries

from .test_distributed import mlp_model

TIMEOUT_S = 300
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _files(tmp_path: Path, rows: int = 64, wide: bool = False):
    onnx.save(wide_model() if wide else mlp_model(), tmp_path / "mlp.onnx")
    rng = np.random.default_rng(5)
    np.savez(tmp_path / "data.npz", x=rng.standard_normal((rows, 8)).astype(np.float32),
             y=rng.integers(0, 4, rows).astype(np.int64))


def wide_model() -> onnx.ModelProto:
    """An MLP with a hidden layer of 2^18: its checkpoint (40 MB with AdamW's states) takes long
    enough to write that a kill can land inside the write."""
    return mlp_model(widths=(1 << 18,), scale=0.01)


def _command(tmp_path: Path, run: str, steps: int, *extra: str) -> list[str]:
    (tmp_path / run).mkdir(exist_ok=True)
    return [sys.executable, "-m", "gradbuilder.cli", "train", str(tmp_path / "mlp.onnx"), "--data",
            str(tmp_path / "data.npz"), "--steps", str(steps), "--batch-size", "8", "--lr", "0.01",
            "--scheduler", "cosine", "--no-progress", "--checkpoint", str(tmp_path / run / "ck.safetensors"), *extra]


def _final(tmp_path: Path, run: str) -> dict:
    tensors, meta = checkpoint.load(tmp_path / run / "ck.safetensors")
    return {**tensors, "learning_rate": meta["learning_rate"], "properties": meta["properties"]}


def _assert_identical(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name in want:
        if isinstance(want[name], str):
            assert got[name] == want[name], name
        else:
            assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), name


def _flat(tree: dict, prefix: str = "") -> dict:
    """``TrainingSession.get_state()``'s nested dicts as {"model/full_precision/W": array, ...}."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = np.asarray(value)
    return out


def _wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = TIMEOUT_S) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            out = proc.communicate()
            pytest.fail(f"the run ended (rc {proc.returncode}) before {what}: {out[1][-2000:] if out[1] else ''}")
        if time.monotonic() > end:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.002)


def _periodic(tmp_path: Path, run: str, update: int) -> Path:
    return tmp_path / run / f"ck.update{update:08d}.safetensors"


# ---------------------------------------------------------------------------- in one process
def _session(**options) -> TrainingSession:
    params = TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw", **options)
    session = TrainingSession(mlp_model().SerializeToString(), params, providers=["CPUExecutionProvider"])
    session.set_learning_rate(0.01)
    return session


def _data(rows: int = 64) -> dict:
    rng = np.random.default_rng(5)
    return {"x": rng.standard_normal((rows, 8)).astype(np.float32), "y": rng.integers(0, 4, rows).astype(np.int64)}


def test_fit_saves_every_n_updates_and_keeps_the_newest(tmp_path):
    session = _session(gradient_accumulation_steps=2)
    fit(session, _data(), steps=20, batch_size=8, checkpoint=tmp_path / "ck.safetensors", save_every=3, keep_last=2,
        progress=False)
    series = CheckpointSeries(tmp_path / "ck.safetensors", keep_last=2)
    assert [p.name for p in series.numbered()] == ["ck.update00000006.safetensors", "ck.update00000009.safetensors"]
    _, meta = checkpoint.load(series.numbered()[-1])
    assert '"batches_seen": 18' in meta["properties"]  # 9 updates of 2 batches
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_checkpoints_written_in_the_background_are_the_foreground_ones(tmp_path, monkeypatch):
    """``save_in_background``: a copy of the state written from a thread while training goes on;
    every file equals the one written in the foreground, all there when ``fit`` returns, and a
    failed write is raised (by the next save, or when ``fit`` ends)."""
    from gradbuilder.errors import CheckpointError

    for mode, background in (("fg", False), ("bg", True)):
        fit(_session(), _data(), steps=12, batch_size=8, checkpoint=tmp_path / f"{mode}.safetensors", save_every=4,
            keep_last=3, save_in_background=background, progress=False)
    for update in (4, 8, 12):
        (a, meta_a), (b, meta_b) = (checkpoint.load(tmp_path / f"{m}.update{update:08d}.safetensors")
                                    for m in ("fg", "bg"))
        assert meta_a == meta_b and set(a) == set(b)
        assert all(np.array_equal(a[n], b[n]) for n in a)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "host_bytes", full)
    with pytest.raises(CheckpointError, match="could not write checkpoint .*full.update00000004.* No space left"):
        fit(_session(), _data(), steps=6, batch_size=8, checkpoint=tmp_path / "full.safetensors", save_every=4,
            save_in_background=True, progress=False)


def test_resuming_the_newest_periodic_checkpoint_continues_bit_identically(tmp_path):
    """A run stopped after any number of steps and resumed from the newest periodic checkpoint
    ends where the uninterrupted run ends (weights, states, step, data order, schedule)."""
    want = _session()
    want.register_scheduler("cosine", warmup_steps=2, total_steps=30)
    fit(want, _data(), steps=30, batch_size=8, progress=False)
    for stop_after in (7, 16, 23):
        first = _session()
        first.register_scheduler("cosine", warmup_steps=2, total_steps=30)
        fit(first, _data(), steps=stop_after, batch_size=8, checkpoint=tmp_path / f"{stop_after}.safetensors",
            save_every=5, progress=False)
        again = _session()
        again.register_scheduler("cosine", warmup_steps=2, total_steps=30)
        found = CheckpointSeries(tmp_path / f"{stop_after}.safetensors").resume(again)
        assert found == tmp_path / f"{stop_after}.update{stop_after // 5 * 5:08d}.safetensors"
        fit(again, _data(), steps=30 - int(again.properties["batches_seen"]), batch_size=8, progress=False)
        assert again.step == want.step == 30
        assert again.get_learning_rate() == want.get_learning_rate()
        _assert_identical(_flat(again.get_state()), _flat(want.get_state()))


def test_a_damaged_newest_checkpoint_is_passed_over_and_named(tmp_path):
    session = _session()
    fit(session, _data(), steps=12, batch_size=8, checkpoint=tmp_path / "ck.safetensors", save_every=4,
        keep_last=3, progress=False)
    newest = tmp_path / "ck.update00000012.safetensors"
    raw = newest.read_bytes()
    newest.write_bytes(raw[: len(raw) - 100])  # cut short, as a full disk or a lost write leaves it
    (tmp_path / ".ck.update00000016.safetensors.0badc0de.tmp").write_bytes(b"half")  # a killed write's temporary
    again = _session()
    with pytest.warns(UserWarning) as said:
        found = CheckpointSeries(tmp_path / "ck.safetensors").resume(again)
    assert found == tmp_path / "ck.update00000008.safetensors" and again.step == 8
    text = " ".join(str(w.message) for w in said)
    assert "ck.update00000012.safetensors cannot be resumed" in text and "truncated" in text, text
    assert "resumed from" in text and "the newest complete checkpoint" in text
    assert not (tmp_path / ".ck.update00000016.safetensors.0badc0de.tmp").exists()


def test_periodic_checkpoint_options_are_checked_first(tmp_path):
    from gradbuilder.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="save_every needs checkpoint"):
        fit(_session(), _data(), steps=2, batch_size=8, save_every=1)
    with pytest.raises(InvalidArgumentError, match="save_every must be an int >= 1"):
        fit(_session(), _data(), steps=2, batch_size=8, save_every=0, checkpoint=tmp_path / "c.safetensors")
    _files(tmp_path)
    for extra, message in ((["--save-every", "5"], "--save-every needs --checkpoint"),
                           (["--resume", "auto"], "--resume auto needs --checkpoint"),
                           (["--max-restarts", "1", "--checkpoint", "c.safetensors"],
                            "--max-restarts needs --nproc-per-node")):
        done = subprocess.run([sys.executable, "-m", "gradbuilder.cli", "train", str(tmp_path / "mlp.onnx"),
                               "--data", str(tmp_path / "data.npz"), "--steps", "2", *extra], capture_output=True,
                              text=True, timeout=TIMEOUT_S, env=ENV, cwd=tmp_path)
        assert done.returncode == 2 and message in done.stderr, done.stderr


# ---------------------------------------------------------------------------- SIGKILL, one process
STEPS = 1500


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: the same command, never interrupted."""
    tmp_path = tmp_path_factory.mktemp("reference")
    _files(tmp_path)
    done = subprocess.run(_command(tmp_path, "ref", STEPS), capture_output=True, text=True, timeout=TIMEOUT_S, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    return _final(tmp_path, "ref")


@pytest.mark.parametrize("kill_after", [100, 550, 1200])
def test_a_process_killed_anywhere_resumes_and_ends_bit_identical(tmp_path, uninterrupted, kill_after):
    """SIGKILL (as the out-of-memory killer sends) once the periodic checkpoint of update
    ``kill_after`` exists, the process a few steps further; then the same command with
    ``--resume auto``: at most --save-every updates are trained again, and the end is the
    uninterrupted run's, bit for bit."""
    _files(tmp_path)
    command = _command(tmp_path, "run", STEPS, "--save-every", "50")
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    _wait_for(_periodic(tmp_path, "run", kill_after).exists, proc, f"update {kill_after}")
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "run" / "ck.safetensors").exists()  # nothing written at the end: it was killed
    resumed = subprocess.run(command + ["--resume", "auto"], capture_output=True, text=True, timeout=TIMEOUT_S,
                             env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    _assert_identical(_final(tmp_path, "run"), uninterrupted)


@pytest.mark.slow  # a training run in a subprocess, killed mid-write, then resumed
def test_a_process_killed_while_writing_a_checkpoint_resumes_from_the_one_before(tmp_path):
    """SIGKILL while a periodic checkpoint is being written (its temporary file exists): the
    earlier checkpoints are whole, the resumed run removes the temporary and ends bit-identical."""
    _files(tmp_path, wide=True)
    steps = 200
    reference = subprocess.run(_command(tmp_path, "ref", steps), capture_output=True, text=True, timeout=TIMEOUT_S,
                               env=ENV)
    assert reference.returncode == 0, reference.stderr[-3000:]
    command = _command(tmp_path, "run", steps, "--save-every", "10")
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    folder = tmp_path / "run"

    def writing() -> bool:
        return _periodic(tmp_path, "run", 50).exists() and any(p.name.endswith(".tmp") for p in folder.iterdir())

    _wait_for(writing, proc, "a checkpoint write after update 50")
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=TIMEOUT_S)
    assert [p for p in folder.iterdir() if p.name.endswith(".tmp")]  # the kill landed inside the write
    resumed = subprocess.run(command + ["--resume", "auto"], capture_output=True, text=True, timeout=TIMEOUT_S,
                             env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
    _assert_identical(_final(tmp_path, "run"), _final(tmp_path, "ref"))


# ---------------------------------------------------------------------------- SIGKILL, one rank of two
def _rank_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of the worker of ``rank`` whose command line names ``run_dir`` (torch's launcher
    starts them; their environment says their rank)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            if str(run_dir).encode() not in cmdline or b"--nproc-per-node" in cmdline:
                continue
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return int(entry)
    return None


def _kill_rank_1_after(tmp_path: Path, proc: subprocess.Popen, update: int) -> str:
    """SIGKILL rank 1 of the run ``proc`` once its periodic checkpoint of ``update`` exists;
    the run's stderr, once it has ended well (the launcher restarted the group)."""
    _wait_for(_periodic(tmp_path, "run", update).exists, proc, f"update {update}")
    pid = _rank_pid(tmp_path / "run", 1)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, err[-4000:]
    return err


@pytest.mark.slow
@pytest.mark.parametrize("zero", ["0", "2"])
def test_a_killed_rank_is_restarted_and_the_run_ends_bit_identical(tmp_path, zero):
    """Two processes, data parallel (ZeRO 0 and 2); rank 1 SIGKILLed mid-run under
    --max-restarts 1: the launcher restarts both, they resume from the newest complete
    checkpoint by themselves, and the run ends as the uninterrupted one does, bit for bit."""
    _files(tmp_path)
    steps = 600
    parallel = ["--nproc-per-node", "2", "--zero-stage", zero]
    reference = subprocess.run(_command(tmp_path, "ref", steps, *parallel), capture_output=True, text=True,
                               timeout=TIMEOUT_S, env=ENV)
    assert reference.returncode == 0, reference.stderr[-3000:]
    command = _command(tmp_path, "run", steps, *parallel, "--save-every", "20", "--max-restarts", "1")
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    err = _kill_rank_1_after(tmp_path, proc, 200)
    assert "after a restart" in err
    if zero == "0":  # the survivor saved the last update both completed: the restart loses nothing
        import re

        saved = re.search(r"saved the state after update (\d+) .* to (\S+);", err)
        assert saved, err[-3000:]
        assert f"resumed from {saved.group(2)} at step {saved.group(1)}" in err, err[-3000:]
    else:  # ZeRO-2: no process holds the whole state; the error names the newest checkpoint
        assert "holds only part of the state" in err and "the newest checkpoint is" in err, err[-3000:]
    _assert_identical(_final(tmp_path, "run"), _final(tmp_path, "ref"))


@pytest.mark.slow
def test_a_killed_pipeline_stage_is_restarted_and_the_run_ends_bit_identical(tmp_path):
    """A 2-stage pipeline written with the Python API (``tests/elastic_worker.py``: resume the
    newest checkpoint if any, ``fit(save_every=...)``), under torch's launcher with
    --max-restarts 1; stage 1 SIGKILLed mid-run: the run ends as the uninterrupted one does."""
    import json

    from .test_distributed import params_dict

    _files(tmp_path)
    worker = Path(__file__).with_name("elastic_worker.py")
    params = params_dict(pipeline_parallel_size=2, num_pipeline_micro_batches=2, pipeline_cut_info_string="a1")

    def start(run: str) -> subprocess.Popen:
        (tmp_path / run).mkdir()
        config = tmp_path / run / "config.json"
        config.write_text(json.dumps({"model": str(tmp_path / "mlp.onnx"), "params": params, "lr": 0.01,
                                      "data": str(tmp_path / "data.npz"), "steps": 400, "batch_size": 8,
                                      "save_every": 20, "checkpoint": str(tmp_path / run / "ck.safetensors")}))
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                 "--standalone", "--max-restarts", "1", str(worker), str(config)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)

    reference = start("ref")
    _, err = reference.communicate(timeout=TIMEOUT_S)
    assert reference.returncode == 0, err[-3000:]
    err = _kill_rank_1_after(tmp_path, start("run"), 160)
    assert "resumed from" in err
    _assert_identical(_final(tmp_path, "run"), _final(tmp_path, "ref"))
