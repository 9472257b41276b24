"""The documentation runs: every code block of every tutorial (``docs/tutorials/*.md``) and
the README's example is executed, in order, in an empty folder: ```python blocks in one
namespace per page, ```bash blocks line by line in a shell (the installed ``gradbuilder``
command first on the PATH), ```js and ```html blocks written to the file their first line
names (then run by a bash block with node, or served). A ``python -m http.server`` line serves
its folder on a free port while headless Chromium opens the page, which must set
``window.result`` (as tests/test_web.py, these need Node.js, ``npm ci`` and Chromium). A
tutorial that drifts from the code fails here. The site itself builds with warnings as errors
(``mkdocs build --strict``, in ``.ci/run``)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
TUTORIALS = sorted((DOCS / "tutorials").glob("*.md"))
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.S | re.M)
FILE_LINE = {"js": re.compile(r"^// (\S+\.mjs)\n"), "html": re.compile(r"^<!-- (\S+\.html) -->\n")}
SERVE = re.compile(r"^python -m http\.server (\d+) --directory (\S+)$")


def blocks(page: Path) -> list[tuple[str, str]]:
    """(language, code) of each fenced block of ``page``, in order."""
    return [(m.group(1), m.group(2)) for m in BLOCK.finditer(page.read_text())]


def test_every_tutorial_has_code_and_only_code_the_tests_run():
    assert len(TUTORIALS) >= 5
    for page in TUTORIALS:
        found = blocks(page)
        assert found, page.name
        assert {language for language, _ in found} <= {"python", "bash", "js", "html"}, page.name
        assert all(FILE_LINE[language].match(code) for language, code in found if language in FILE_LINE), \
            f"{page.name}: a js block starts with // FILE.mjs, an html one with <!-- FILE.html -->, the file it is"
        served = [line for language, code in found if language == "bash" for line in code.splitlines()
                  if "http.server" in line]
        assert all(SERVE.match(line) for line in served), f"{page.name}: serve as python -m http.server PORT --directory DIR"


def _node_modules(folder: Path) -> None:
    """What ``npm install onnxruntime-node onnxruntime-web /path/to/gradbuilder`` gives a folder:
    the checkout's onnxruntime-node and onnxruntime-web (npm ci) and gradbuilder-train, linked in."""
    from .test_web import need_node

    need_node()
    modules = folder / "node_modules"
    modules.mkdir()
    for package in ("onnxruntime-node", "onnxruntime-web"):
        (modules / package).symlink_to(ROOT / "node_modules" / package)
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
    if any(language in FILE_LINE for language, _ in blocks(page)):
        _node_modules(tmp_path)
    for number, (language, code) in enumerate(blocks(page), 1):
        if language == "python":
            exec(compile(code, f"{page.name} block {number}", "exec"), namespace)  # noqa: S102
            continue
        if language in FILE_LINE:
            target = tmp_path / FILE_LINE[language].match(code).group(1)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(code)
            continue
        for line in code.strip().splitlines():
            if SERVE.match(line):
                _open_served_page(tmp_path / SERVE.match(line).group(2), tmp_path, f"{page.name} block {number}")
                continue
            done = subprocess.run(line, shell=True, env=env, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, f"{page.name} block {number}: {line}\n{done.stderr[-2000:]}"


def _open_served_page(folder: Path, tmp_path: Path, where: str) -> None:
    """``python -m http.server`` on a free port for ``folder``, and its index page in headless
    Chromium until the page sets ``window.result``: no page error, an accuracy above 0.9."""
    from .test_web import BROWSER_MJS, need_chromium

    chromium = need_chromium()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                               "--directory", str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):  # until it listens
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        run = subprocess.run(["node", str(BROWSER_MJS), f"http://127.0.0.1:{port}/", str(tmp_path / "page.png"), "240",
                              "result"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                             env={**os.environ, "CHROMIUM": chromium})
    finally:
        server.terminate()
        server.wait()
    assert run.returncode == 0, f"{where}: the page did not train\n{run.stdout[-2000:]}{run.stderr[-2000:]}"
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert not any(line.startswith("pageerror") for line in result["console"]), (where, result["console"])
    assert result["accuracy"] > 0.9, (where, result)
