"""Bad output paths and files that are not what they should be: each save and load refuses
them with one line naming the path and what to do, before any work, and leaves nothing behind."""

from __future__ import annotations

import os
import pickle
import re

import numpy as np
import onnx
import pytest

from gradbuilder import GradientGraphBuilder, tensorfiles
from gradbuilder.runtime import checkpoint
from gradbuilder.training.artifacts import export_model_for_inferencing, generate_artifacts
from gradbuilder.errors import CheckpointError, GradBuilderError, ModelLoadError, OutputError

from .helpers import linear_model, tree
from .test_session import session

WHAT_A_CHECKPOINT_IS = "a checkpoint is a file written by TrainingSession.save_checkpoint or `gradbuilder train --checkpoint`"


@pytest.fixture(scope="module")
def built():
    return GradientGraphBuilder(linear_model(), ["W"], ["loss"], "loss").build()


@pytest.fixture(scope="module")
def trained():
    return session()



def _no_work(*args, **kwargs):
    raise AssertionError("the model was read before the output path was checked")


# (name, error type, call(path, monkeypatch, fixtures)): each writes one file at ``path``
SAVES = {
    "GradientGraphBuilder.save": (OutputError, lambda p, mp, fx: fx["built"].save(p)),
    "export_model_for_inferencing": (OutputError, lambda p, mp, fx: (
        mp.setattr("gradbuilder.compiler.modelio.load_proto", _no_work),
        export_model_for_inferencing(linear_model(), p, ["loss"]))),
    "checkpoint.save": (CheckpointError, lambda p, mp, fx: checkpoint.save(p, {"w": np.ones(3, np.float32)})),
    "TrainingSession.save_checkpoint": (CheckpointError, lambda p, mp, fx: (
        mp.setattr("gradbuilder.runtime.state.StateStore.array", _no_work), fx["trained"].save_checkpoint(p))),
}

# (name, make(tmp_path) -> path, expected message)
BAD_OUTPUTS = {
    "missing directory": (lambda t: t / "nope" / "out.bin", r"directory '{t}/nope' does not exist; create it first"),
    "missing directories": (lambda t: t / "a" / "b" / "out.bin", r"directory '{t}/a/b' does not exist; create it first"),
    "parent is a file": (lambda t: (t / "f").write_text("x") and t / "f" / "out.bin",
                         r"'{t}/f' is a file, not a directory"),
    "ancestor is a file": (lambda t: (t / "f").write_text("x") and t / "f" / "sub" / "out.bin",
                           r"'{t}/f' is a file, not a directory"),
    "target is a directory": (lambda t: (t / "d").mkdir() or t / "d", r"'{t}/d' is a directory; give the path of a file"),
    "/proc": (lambda t: "/proc/gradbuilder-out.bin", r"cannot create files in directory '/proc' .*'/proc/gradbuilder-out.bin'"),
    "/sys": (lambda t: "/sys/gradbuilder-out.bin", r"cannot create files in directory '/sys' .*'/sys/gradbuilder-out.bin'"),
    "empty path": (lambda t: "", r"the path is empty"),
}


@pytest.mark.parametrize("case", list(BAD_OUTPUTS))
@pytest.mark.parametrize("save", list(SAVES))
def test_bad_output_path_is_refused_before_any_work(tmp_path, monkeypatch, built, trained, save, case):
    error, call = SAVES[save]
    make, message = BAD_OUTPUTS[case]
    path = make(tmp_path)
    before = tree(tmp_path)
    with pytest.raises(error, match=message.format(t=re.escape(str(tmp_path)))) as info:
        call(path, monkeypatch, {"built": built, "trained": trained})
    assert "\n" not in str(info.value)
    assert tree(tmp_path) == before  # nothing left behind, not even a temporary file


BAD_ARTIFACT_DIRECTORIES = {
    "directory is a file": (lambda t: (t / "f").write_text("x") and t / "f",
                            r"artifact directory '{t}/f' is a file, not a directory"),
    "parent is a file": (lambda t: (t / "f").write_text("x") and t / "f" / "artifacts",
                         r"'{t}/f' is a file, not a directory, so artifact directory '{t}/f/artifacts' cannot be created"),
    "an artifact's name is a directory": (lambda t: (t / "training_model.onnx").mkdir() or t,
                                          r"artifact '{t}/training_model.onnx' is a directory"),
    "/proc": (lambda t: "/proc/gradbuilder-artifacts", r"cannot create files in directory '/proc'"),
    "/proc, below": (lambda t: "/proc/gradbuilder/artifacts", r"cannot create files in directory '/proc'"),
}


@pytest.mark.parametrize("case", list(BAD_ARTIFACT_DIRECTORIES))
def test_bad_artifact_directory_is_refused_before_building(tmp_path, monkeypatch, case):
    make, message = BAD_ARTIFACT_DIRECTORIES[case]
    path = make(tmp_path)
    before = tree(tmp_path)
    monkeypatch.setattr("gradbuilder.compiler.modelio.load_proto", _no_work)
    with pytest.raises(OutputError, match=message.format(t=re.escape(str(tmp_path)))) as info:
        generate_artifacts(linear_model(), artifact_directory=path)
    assert "\n" not in str(info.value)
    assert tree(tmp_path) == before


def test_artifacts_into_new_directories_and_failure_removes_them(tmp_path, monkeypatch):
    written = generate_artifacts(linear_model(), artifact_directory=tmp_path / "a" / "b")
    assert sorted(os.listdir(tmp_path / "a" / "b")) == sorted(os.path.basename(p) for p in written.values())

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    before = tree(tmp_path)
    monkeypatch.setattr(tensorfiles, "bytes_of", fail)  # the checkpoint's tensors
    with pytest.raises(OutputError, match=r"could not write artifacts in '.*/c/d': .*No space left"):
        generate_artifacts(linear_model(), artifact_directory=tmp_path / "c" / "d")
    assert tree(tmp_path) == before  # the directories it created are gone again


def _in_child(fn):
    """Run ``fn`` in a forked child, as an unprivileged user when this is root (root writes
    in any directory); the child's exception as (type name, message), or None."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        try:
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            fn()
            result = b"None"
        except BaseException as exc:  # noqa: BLE001 (reported to the parent)
            result = f"{type(exc).__name__}\n{exc}".encode()
        os.write(write, result)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        result = f.read().decode()
    os.waitpid(pid, 0)
    return None if result == "None" else tuple(result.split("\n", 1))


@pytest.mark.parametrize("save", list(SAVES) + ["generate_artifacts"])
def test_read_only_directory(tmp_path_factory, built, trained, save):
    import tempfile

    root = tempfile.mkdtemp(prefix="gradbuilder-test-")  # in /tmp: reachable by an unprivileged user
    try:
        os.chmod(root, 0o755)
        ro = os.path.join(root, "ro")
        os.mkdir(ro)
        os.chmod(ro, 0o555 if os.geteuid() == 0 else 0o500)  # read-only for the (child's) user
        target = os.path.join(ro, "out.bin")

        def call():
            if save == "generate_artifacts":
                generate_artifacts(linear_model(), artifact_directory=ro)
            else:
                SAVES[save][1](target, pytest.MonkeyPatch(), {"built": built, "trained": trained})

        error = "OutputError" if save in ("GradientGraphBuilder.save", "export_model_for_inferencing",
                                          "generate_artifacts") else "CheckpointError"
        result = _in_child(call)
        assert result is not None and result[0] == error, result
        assert f"cannot create files in directory '{ro}' (Permission denied)" in result[1]
        assert os.listdir(ro) == []
    finally:
        os.chmod(os.path.join(root, "ro"), 0o700)
        for d, _, names in os.walk(root, topdown=False):
            for n in names:
                os.remove(os.path.join(d, n))
            os.rmdir(d)


# ------------------------------------------------------------------ files that are not checkpoints

def _torch_zip(path):
    import torch

    torch.save({"w": torch.ones(3)}, path)


def _torch_legacy(path):
    import torch

    torch.save({"w": torch.ones(3)}, path, _use_new_zipfile_serialization=False)


def _hugging_face(path):
    from safetensors.numpy import save_file

    save_file({"model.embed.weight": np.ones((4, 2), np.float32)}, path, metadata={"format": "pt"})


def _npz(path):
    with open(path, "wb") as f:
        np.savez(f, w=np.ones(3))


def _npy(path):
    with open(path, "wb") as f:
        np.save(f, np.ones(3))


def _zip(path):
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        z.writestr("a.txt", "x")


def _bare_safetensors(path):
    from safetensors.numpy import save_file

    save_file({"w": np.ones(3, np.float32), "x": np.zeros((0,), np.complex64)}, path)


# (name, write(path), expected fragment): the message says what the file is and what a checkpoint is
NOT_CHECKPOINTS = {
    "empty file": (lambda p: p.write_bytes(b""), "is an empty file (0 bytes), not a checkpoint"),
    "Hugging Face safetensors": (_hugging_face, "is a safetensors file without gradbuilder's metadata "
                                                "(saved by another program: metadata 'format' 'pt')"),
    "safetensors without metadata": (_bare_safetensors, "is a safetensors file without gradbuilder's metadata "
                                                        "(saved by another program: no '__metadata__')"),
    "PyTorch zip": (_torch_zip, "is a PyTorch file (torch.save; load it with torch.load), not a checkpoint"),
    "PyTorch legacy": (_torch_legacy, "is a Python pickle (a PyTorch file in torch.save's legacy format"),
    "pickle": (lambda p: p.write_bytes(pickle.dumps({"w": [1.0]}, protocol=4)), "is a Python pickle"),
    "ONNX model": (lambda p: onnx.save(linear_model(), p), "is an ONNX model"),
    "npz": (_npz, "is a NumPy .npz archive (numpy.savez)"),
    "npy": (_npy, "is a NumPy .npy file (numpy.save)"),
    "zip": (_zip, "is a zip archive"),
}


@pytest.mark.parametrize("case", list(NOT_CHECKPOINTS))
def test_file_that_is_not_a_checkpoint_says_what_it_is(tmp_path, case):
    write, fragment = NOT_CHECKPOINTS[case]
    path = tmp_path / "c.bin"
    write(path)
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(path)
    message = str(info.value)
    assert fragment in message and WHAT_A_CHECKPOINT_IS in message and str(path) in message
    assert "corrupt" not in message and "truncated" not in message and "\n" not in message


@pytest.mark.parametrize("case", ["Hugging Face safetensors", "PyTorch zip", "ONNX model", "empty file"])
def test_session_load_checkpoint_says_what_the_file_is(tmp_path, trained, case):
    write, fragment = NOT_CHECKPOINTS[case]
    path = tmp_path / "c.bin"
    write(path)
    before = {n: v.copy() for n, v in trained.get_state()["model"]["full_precision"].items()}
    with pytest.raises(CheckpointError, match=re.escape(fragment)):
        trained.load_checkpoint(path)
    for n, v in trained.get_state()["model"]["full_precision"].items():
        np.testing.assert_array_equal(v, before[n])


# (name, make(tmp_path) -> path, expected fragment) for paths given to a load
BAD_INPUTS = {
    "directory": (lambda t: (t / "d").mkdir() or t / "d", "'{t}/d' is a directory, not a file"),
    "missing": (lambda t: t / "absent", "'{t}/absent' not found"),
    "parent is a file": (lambda t: (t / "f").write_text("x") and t / "f" / "c", "'{t}/f/c' not found: '{t}/f' is a file"),
}
LOADS = {
    "checkpoint.load": (CheckpointError, "checkpoint", lambda p, fx: checkpoint.load(p)),
    "TrainingSession.load_checkpoint": (CheckpointError, "checkpoint", lambda p, fx: fx["trained"].load_checkpoint(p)),
    "GradientGraphBuilder (model path)": (ModelLoadError, "model file",
                                          lambda p, fx: GradientGraphBuilder(p, ["W"], ["loss"], "loss").build()),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
@pytest.mark.parametrize("load", list(LOADS))
def test_bad_input_path(tmp_path, trained, load, case):
    error, what, call = LOADS[load]
    make, fragment = BAD_INPUTS[case]
    path = make(tmp_path)
    before = tree(tmp_path)
    with pytest.raises(error) as info:
        call(path, {"trained": trained})
    assert str(info.value).startswith(what) and fragment.format(t=tmp_path) in str(info.value)
    assert isinstance(info.value, GradBuilderError) and tree(tmp_path) == before

