"""Gradient coverage over ONNX's backend node tests must not drop below the figure recorded
in docs/op-coverage.md (tools/op_coverage.py regenerates it)."""

import os
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"


@pytest.mark.slow  # runs every ONNX backend node test: over a minute
def test_coverage_does_not_drop_below_the_recorded_figure(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))  # importable by name in the worker processes too
    import op_coverage

    recorded = op_coverage.recorded()
    assert recorded is not None, "docs/op-coverage.md has no COVERAGE line"
    results = op_coverage.run(jobs=max(1, min(2, os.cpu_count() or 1)))
    passed, total = op_coverage.summarize(results)
    failing = [r for r in results if r[2] not in ("pass", "notdiff", "undefined")]
    assert passed >= recorded[0], (
        f"{passed}/{total} cases pass, fewer than the recorded {recorded[0]}/{recorded[1]}; "
        f"first failures: {failing[:10]}"
    )
