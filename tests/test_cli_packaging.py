"""The command's start (--version, --help without the heavy imports), the package's version and
its files, the progress bar and the logging of notices."""

import importlib.metadata
import io
import re
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

import gradbuilder
from gradbuilder.cli import main
from gradbuilder.errors import InvalidArgumentError
from gradbuilder.runtime.loop import fit

ROOT = Path(__file__).resolve().parent.parent


def test_version_comes_from_the_package_metadata(capsys):
    assert gradbuilder.__version__ == importlib.metadata.version("gradbuilder")
    assert re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1) == \
        gradbuilder.__version__
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out == f"gradbuilder {gradbuilder.__version__}\n"


HEAVY = ("onnxruntime", "onnx", "numpy", "torch", "onnx_ir", "tqdm")


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["--version"]])
def test_help_and_version_import_no_heavy_module(argv):
    script = "import sys; from gradbuilder.cli import main; sys.exit(main())"  # what the console script runs
    run = subprocess.run([sys.executable, "-X", "importtime", "-c", script, *argv],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "gradbuilder" in run.stdout
    imported = {line.split("|")[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}
    assert "gradbuilder.cli" in imported
    assert not [m for m in imported if m.split(".")[0] in HEAVY]


def test_package_files():
    assert resources.files("gradbuilder").joinpath("py.typed").is_file()
    license_text = (ROOT / "LICENSE").read_text()
    assert license_text.startswith("MIT License") and "Copyright (c) the gradbuilder authors" in license_text
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'license = "MIT"' in pyproject and 'license-files = ["LICENSE"]' in pyproject
    assert "-n auto" not in re.search(r"^addopts = (.*)$", pyproject, re.M).group(1)


def test_every_package_is_in_the_wheel():
    """pyproject.toml lists the packages the wheel holds: every folder with an __init__.py."""
    block = re.search(r"^packages = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S).group(1)
    listed = set(re.findall(r'"([^"]+)"', block))
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "gradbuilder").rglob("__init__.py")}
    found |= {"gradbuilder.rules"} if (ROOT / "rules" / "__init__.py").is_file() else set()
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"


def test_ci_runs_the_readme_quick_start():
    """.ci/run reads the quick start's commands from the README: one line each, the second
    installs the test extras and runs the tests in parallel."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = block.splitlines()
    assert commands == ["pip install . && gradbuilder demo",
                        'pip install torch==2.13.0 && pip install ".[test]" && python -m pytest -n auto --dist worksteal']
    assert "README.md" in (ROOT / ".ci" / "run").read_text()


class _Session:
    """What ``fit`` uses of a TrainingSession; the first run is slow (as building the graphs is)."""

    loss_name, step, scheduler = "loss", 0, None

    def __init__(self):
        self.properties, self.runs = {}, 0

    def get_inputs(self):
        return [type("Arg", (), {"name": "x"})()]

    def run(self, names, feeds):
        self.runs += 1
        time.sleep(0.5 if self.runs == 1 else 0.001)
        return [np.float32(1.0 / self.runs)]


def test_progress_rate_leaves_out_the_first_step():
    stream = io.StringIO()
    fit(_Session(), {"x": np.zeros((64, 2))}, 20, 4, progress=True, stream=stream)
    final = stream.getvalue().rsplit("\r", 1)[-1]
    assert re.search(r"20/20 \[", final) and final.endswith(", loss 0.0500]\n"), final
    rate = float(re.search(r"([\d.]+) steps/s", final).group(1))
    assert rate > 100  # 19 steps of about 1 ms; with the first step's 0.5 s it would be under 40


def test_progress_only_on_a_terminal():
    stream = io.StringIO()  # not a terminal
    fit(_Session(), {"x": np.zeros((64, 2))}, 3, 4, stream=stream)
    assert stream.getvalue() == ""
    fit(_Session(), {"x": np.zeros((64, 2))}, 3, 4, progress=False, stream=stream)
    assert stream.getvalue() == ""


def test_fit_stops_between_steps_when_asked():
    session = _Session()
    losses = fit(session, {"x": np.zeros((64, 2))}, 10, 4, progress=False, stop=lambda: session.runs >= 3)
    assert len(losses) == 3 and session.properties["batches_seen"] == 3


def test_notices_on_stderr_follow_verbosity(tmp_path, capsys):
    from gradbuilder.demo import demo_batch, demo_model_bytes

    (tmp_path / "m.onnx").write_bytes(demo_model_bytes())
    x, labels = demo_batch(64)
    np.savez(tmp_path / "d.npz", x=x, labels=labels)
    argv = ["train", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"), "--steps", "2"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out.startswith("loss ") and err.startswith("training ")  # result on stdout, notice on stderr
    assert main(argv + ["-q"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("loss ") and err == ""
    assert main(["-q"] + argv + ["--lr", "0.1", "--resume", str(tmp_path / "d.npz")]) == 2  # a usage error
    assert capsys.readouterr().err.startswith("gradbuilder: error: --resume ")


def test_progress_counts_the_tokens_of_an_attention_mask():
    stream = io.StringIO()
    mask = np.zeros((64, 2))
    mask[:, 0] = 1  # one token of two in every row
    fit(_Session(), {"x": mask}, 20, 4, progress=True, stream=stream, tokens="x")
    final = stream.getvalue().rsplit("\r", 1)[-1]
    steps = float(re.search(r"([\d.]+) steps/s", final).group(1))
    tokens = float(re.search(r"loss 0\.0500, ([\d.]+) tokens/s", final).group(1))
    assert 2 <= tokens / steps <= 6  # 4 tokens a step (rates rounded, taken a moment apart)
    with pytest.raises(InvalidArgumentError, match="tokens: 'mask' is not an input of the model"):
        fit(_Session(), {"x": mask}, 2, 4, tokens="mask")
