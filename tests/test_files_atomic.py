"""Atomic writes: a signal (SIGINT, SIGTERM) or an exception during any save leaves the
files that were there as they were and no temporary file; a signal during the final renames
waits for them, so a set of files is never half replaced; written files get the usual mode."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest

from gradbuilder import GradientGraphBuilder, files
from gradbuilder.runtime import checkpoint
from gradbuilder.training.artifacts import export_model_for_inferencing, generate_artifacts
from gradbuilder.errors import OutputError

from .helpers import linear_model, make_model, tensor, tree, vi
from .test_session import session
from gradbuilder.compiler.detached import DetachedModel


def wide_model():
    """loss = ReduceSum((x * W + B)^2) with a 16 x 64 W: large enough to go to external data."""
    from onnx import helper

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Mul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "B"], ["y"]),
             helper.make_node("Mul", ["y", "y"], ["sq"]), helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0)]
    inits = [tensor("W", rng.standard_normal((16, 64)).astype(np.float32)),
             tensor("B", rng.standard_normal((64,)).astype(np.float32))]
    return make_model(nodes, [vi("x", ["batch", 16, 64])], [vi("loss", [])], inits)


@pytest.fixture(scope="module")
def built():
    return GradientGraphBuilder(wide_model(), ["W"], ["loss"], "loss").build()


@pytest.fixture(scope="module")
def trained():
    return session()



def contents(root):
    return {name: (root / name).read_bytes() for name in tree(root) if (root / name).is_file()}


def sigint(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)  # Python raises KeyboardInterrupt at its next instruction


def interrupting(fn):
    """``fn``, then SIGINT to this process."""
    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        sigint()
        return out
    return wrapped


def chunks_then_sigint(self):
    """DetachedModel.chunks that is interrupted after its first chunk: a half-written model."""
    for i, chunk in enumerate(original_chunks(self)):
        yield chunk
        if i == 0:
            sigint()


original_chunks = DetachedModel.chunks


def with_state(version):
    """Checkpoint tensors that differ with ``version``."""
    return {"w": np.full((64, 64), version, np.float32), "step": np.array(version, np.int64)}


# name -> (save(tmp_path, version, fixtures), [(object, attribute) whose call is interrupted mid-save])
SAVES = {
    "checkpoint.save": (lambda t, v, fx: checkpoint.save(t / "c.safetensors", with_state(v)),
                        ["gradbuilder.runtime.checkpoint.host_bytes"]),
    "GradientGraphBuilder.save": (lambda t, v, fx: fx["built"].save(t / "m.onnx"), ["chunks"]),
    "GradientGraphBuilder.save external data": (
        lambda t, v, fx: fx["built"].save(t / "m.onnx", external_data=True), []),
    "export_model_for_inferencing": (
        lambda t, v, fx: export_model_for_inferencing(linear_model(), t / "e.onnx", ["loss"] if v else ["y", "loss"]),
        ["chunks"]),
    "generate_artifacts": (
        lambda t, v, fx: generate_artifacts(linear_model(), optimizer="adamw" if v else "sgd", artifact_directory=t),
        ["chunks", "gradbuilder.tensorfiles.bytes_of"]),
    "TrainingSession.save_checkpoint": (
        lambda t, v, fx: (fx["trained"].set_learning_rate(0.1 * (v + 1)), fx["trained"].save_checkpoint(t / "s.ckpt")),
        ["gradbuilder.runtime.checkpoint.host_bytes"]),
}

POINTS = [(save, point) for save, (_, points) in SAVES.items() for point in ["fsync"] + points]


@pytest.mark.parametrize("save,point", POINTS, ids=[f"{s}-{p}" for s, p in POINTS])
@pytest.mark.parametrize("existing", [False, True], ids=["new", "over-existing"])
def test_sigint_during_save_leaves_no_trace(tmp_path, monkeypatch, built, trained, save, point, existing):
    fx = {"built": built, "trained": trained}
    call = SAVES[save][0]
    if existing:
        call(tmp_path, 0, fx)
    before = contents(tmp_path)
    if point == "fsync":
        monkeypatch.setattr(os, "fsync", interrupting(os.fsync))
    elif point == "chunks":
        monkeypatch.setattr(DetachedModel, "chunks", chunks_then_sigint)
    else:
        module, name = point.rsplit(".", 1)
        monkeypatch.setattr(importlib.import_module(module), name, interrupting(getattr(importlib.import_module(module), name)))
    with pytest.raises(KeyboardInterrupt):
        call(tmp_path, 1, fx)
    monkeypatch.undo()
    assert contents(tmp_path) == before  # no temporary file, no partial or changed target


@pytest.mark.parametrize("save", list(SAVES))
def test_sigint_during_the_renames_waits_for_them(tmp_path, monkeypatch, built, trained, save):
    fx = {"built": built, "trained": trained}
    call = SAVES[save][0]
    call(tmp_path, 0, fx)
    old = contents(tmp_path)
    reference = tmp_path / "reference"
    reference.mkdir()
    call(reference, 1, fx)
    want = contents(reference)
    reference_npz = {}
    for name in tree(reference):
        if name.endswith(".npz"):  # (zip entries carry the time they were written: compare the arrays)
            reference_npz[name] = tmp_path.parent / f"{tmp_path.name}-{name}"
            os.replace(reference / name, reference_npz[name])
        else:
            os.remove(reference / name)
    reference.rmdir()

    replace = os.replace
    calls = []

    def replace_then_sigint(src, dst):
        calls.append(dst)
        if len(calls) == 1:
            sigint()
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_then_sigint)
    with pytest.raises(KeyboardInterrupt):
        call(tmp_path, 1, fx)
    monkeypatch.undo()
    got = contents(tmp_path)
    assert set(got) == set(want)  # no temporary file
    if save in ("checkpoint.save", "generate_artifacts", "TrainingSession.save_checkpoint", "export_model_for_inferencing"):
        assert got != old
    for name in want:  # every file of the set is the new one
        if name.endswith(".npz"):
            with np.load(tmp_path / name) as a, np.load(reference_npz[name]) as b:
                assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a), name
        elif name.endswith((".onnx", ".data")):
            assert got[name] == want[name], name
    if save == "TrainingSession.save_checkpoint":
        assert checkpoint.load(tmp_path / "s.ckpt")[1]["learning_rate"] == repr(0.2)


def test_failed_rename_of_a_model_keeps_the_old_one(tmp_path, monkeypatch, built):
    path = tmp_path / "m.onnx"
    path.write_bytes(b"old")

    def fail(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OutputError, match=r"could not write output model '.*m.onnx': .*No space left"):
        built.save(path)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["m.onnx"] and path.read_bytes() == b"old"


CHILD = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from gradbuilder.runtime import checkpoint
    if sys.argv[2] == "handler":  # the program's own SIGTERM handler is kept
        def stop(signum, frame):
            raise SystemExit(3)
        signal.signal(signal.SIGTERM, stop)
    fsync = os.fsync
    def terminated(fd):
        os.kill(os.getpid(), signal.SIGTERM)
        fsync(fd)
    os.fsync = terminated
    checkpoint.save(sys.argv[1], {"w": np.ones(1000, np.float32)})
    print("saved")
""")


@pytest.mark.parametrize("handler", ["default", "handler"])
def test_sigterm_during_save_leaves_no_temporary_file(tmp_path, handler):
    path = tmp_path / "c.safetensors"
    done = subprocess.run([sys.executable, "-c", CHILD, str(path), handler], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.stdout == ""
    assert done.returncode == (-signal.SIGTERM if handler == "default" else 3), done.stderr
    assert os.listdir(tmp_path) == []


def test_sigterm_handler_is_restored_after_a_save(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    checkpoint.save(tmp_path / "c", {"w": np.ones(3, np.float32)})
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("save", ["checkpoint", "model", "artifacts"])
def test_written_files_have_the_usual_mode(tmp_path, built, save):
    umask = os.umask(0o022)
    os.umask(umask)
    if save == "checkpoint":
        checkpoint.save(tmp_path / "c", {"w": np.ones(3, np.float32)})
    elif save == "model":
        built.save(tmp_path / "m.onnx")
    else:
        generate_artifacts(linear_model(), artifact_directory=tmp_path)
    for name in os.listdir(tmp_path):
        assert os.stat(tmp_path / name).st_mode & 0o777 == 0o666 & ~umask, name


def test_atomic_write_of_several_files(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    with files.atomic_write(a, b) as (ta, tb):
        assert os.path.dirname(ta) == str(tmp_path) and os.path.basename(ta).startswith(".a.")
        ta.write_text("A")
        tb.write_text("B")
        assert sorted(os.listdir(tmp_path)) == sorted([ta.name, tb.name])
    assert a.read_text() == "A" and b.read_text() == "B" and sorted(os.listdir(tmp_path)) == ["a", "b"]
    with pytest.raises(ValueError):
        with files.atomic_write(a, b) as (ta, tb):
            ta.write_text("new A")
            raise ValueError("stop")
    assert a.read_text() == "A" and sorted(os.listdir(tmp_path)) == ["a", "b"]


def test_model_files_load(tmp_path, built):
    """What the atomic writer wrote is the model: with and without external data."""
    built.save(tmp_path / "m.onnx")
    built.save(tmp_path / "x.onnx", external_data=True)
    assert sorted(os.listdir(tmp_path)) == ["m.onnx", "x.onnx", "x.onnx.data"]
    want = built.model_proto
    for got in (onnx.load(tmp_path / "m.onnx"), onnx.load(tmp_path / "x.onnx")):
        assert list(got.graph.node) == list(want.graph.node)
        assert {t.name: t.raw_data for t in got.graph.initializer} == {t.name: t.raw_data for t in want.graph.initializer}
    assert os.path.getsize(tmp_path / "x.onnx.data") == 16 * 64 * 4
