"""Gradient coverage over ONNX's backend node tests must not drop below the figure recorded
in docs/op-coverage.md (tools/op_coverage.py regenerates it)."""

import importlib.util
import os
from pathlib import Path

TOOL = Path(__file__).resolve().parent.parent / "tools" / "op_coverage.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("op_coverage", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_coverage_does_not_drop_below_the_recorded_figure():
    tool = load_tool()
    recorded = tool.recorded()
    assert recorded is not None, "docs/op-coverage.md has no COVERAGE line"
    results = tool.run(jobs=max(1, min(2, os.cpu_count() or 1)))
    passed, total = tool.summarize(results)
    failing = [r for r in results if r[2] not in ("pass", "notdiff", "undefined")]
    assert passed >= recorded[0], (
        f"{passed}/{total} cases pass, fewer than the recorded {recorded[0]}/{recorded[1]}; "
        f"first failures: {failing[:10]}"
    )
