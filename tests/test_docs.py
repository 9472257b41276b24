"""The documentation runs: every code block of every tutorial (``docs/tutorials/*.md``) and
the README's example is executed, in order, in an empty folder: ```python blocks in one
namespace per page, ```bash blocks line by line in a shell (the installed ``gradbuilder``
command first on the PATH), ```js blocks written to the file their first line names (then run
by a bash block with node; as tests/test_web.py, they need Node.js and ``npm ci``). A tutorial that drifts from the code fails here. The site itself
builds with warnings as errors (``mkdocs build --strict``, in ``.ci/run``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
TUTORIALS = sorted((DOCS / "tutorials").glob("*.md"))
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.S | re.M)


def blocks(page: Path) -> list[tuple[str, str]]:
    """(language, code) of each fenced block of ``page``, in order."""
    return [(m.group(1), m.group(2)) for m in BLOCK.finditer(page.read_text())]


def test_every_tutorial_has_code_and_only_code_the_tests_run():
    assert len(TUTORIALS) >= 5
    for page in TUTORIALS:
        found = blocks(page)
        assert found, page.name
        assert {language for language, _ in found} <= {"python", "bash", "js"}, page.name
        assert all(code.startswith("// ") and code.split("\n")[0].endswith(".mjs") for language, code in found
                   if language == "js"), f"{page.name}: a js block starts with // FILE.mjs, the file it is written to"


def _node_modules(folder: Path) -> None:
    """What ``npm install onnxruntime-node /path/to/gradbuilder`` gives a folder: the checkout's
    onnxruntime-node (npm ci) and gradbuilder-train, linked in."""
    from .test_web import need_node

    need_node()
    modules = folder / "node_modules"
    modules.mkdir()
    (modules / "onnxruntime-node").symlink_to(ROOT / "node_modules" / "onnxruntime-node")
    (modules / "gradbuilder-train").symlink_to(ROOT)


def test_the_readme_example_runs(tmp_path, monkeypatch):
    """The README's python block (its quick start is bash, run by .ci/run)."""
    monkeypatch.chdir(tmp_path)
    (example,) = [code for language, code in blocks(ROOT / "README.md") if language == "python"]
    namespace: dict = {"__name__": "readme"}
    exec(compile(example, "README.md", "exec"), namespace)  # noqa: S102
    assert float(namespace["loss"]) < 0.5 and (tmp_path / "trained.onnx").is_file()


@pytest.mark.parametrize("page", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_a_tutorial_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    namespace: dict = {"__name__": f"tutorial_{page.stem}"}
    if any(language == "js" for language, _ in blocks(page)):
        _node_modules(tmp_path)
    for number, (language, code) in enumerate(blocks(page), 1):
        if language == "python":
            exec(compile(code, f"{page.name} block {number}", "exec"), namespace)  # noqa: S102
            continue
        if language == "js":
            (tmp_path / code.split("\n")[0][3:].strip()).write_text(code)
            continue
        for line in code.strip().splitlines():
            done = subprocess.run(line, shell=True, env=env, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, f"{page.name} block {number}: {line}\n{done.stderr[-2000:]}"
