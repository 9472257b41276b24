"""Run onnxruntime-training's own ORTModule tests against gradbuilder's ORTModule, on the CPU.

    python tools/peer_suite.py ORT_TESTS_DIR [--jobs N] [-k EXPR] [--report FILE]

ORT_TESTS_DIR is ``orttraining/orttraining/test/python`` of an onnxruntime checkout (its
``orttraining_test_ortmodule_api.py``, ``..._autograd.py``, ``..._fallback.py``, ``_test_helpers.py``
and ``_orttraining_ortmodule_models.py``). Nothing of it is kept here: the files are copied into
a temporary folder, with the CUDA device names turned into the CPU's, and run with pytest there.

``onnxruntime.training.ortmodule`` is provided by a thin layer over ``gradbuilder.ortmodule``:
ORTModule, DebugOptions and LogLevel are ours; ``ORTMODULE_FALLBACK_POLICY`` other than
``FALLBACK_DISABLE`` means ``fallback=True``. The peer's private modules (``_utils``, ``_io``,
``_fallback``, ``_graph_execution_manager``, its gradient registry, FusedAdam, its C++ extensions,
its legacy ORTTrainer) do not exist here.

Which tests count ("selected"): every collected test but
  - those the file itself skips here (a CUDA-only test, a torch version condition);
  - those whose own code reaches into the peer's private parts (the names in ``PRIVATE``):
    they test how onnxruntime-training is built, not what ORTModule does.
Hugging Face models the tests download (``from_pretrained("bert-base-uncased")``) are made from
their default configuration with random weights instead (no download).

Prints the counts, the pass rate over the selected tests, and each failing test with the last
line of its error; ``--report`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

FILES = ["orttraining_test_ortmodule_api.py", "orttraining_test_ortmodule_autograd.py",
         "orttraining_test_ortmodule_fallback.py"]
SUPPORT = ["_test_helpers.py", "_orttraining_ortmodule_models.py"]

# Names of onnxruntime-training's private parts: a test whose code uses one is not selected.
PRIVATE = ["_utils", "_io", "_fallback", "_graph_execution_manager", "_execution_manager", "_torch_module",
           "register_gradient", "FusedAdam", "_onnx_models", "torch_cpp_extensions", "ORTMODULE_TORCH_CPP_DIR",
           "_runtime_inspector", "_graph_info", "_custom_autograd_function", "_custom_op_symbolic_registry",
           "ORTMODULE_ONNX_OPSET_VERSION", "ORTMODULE_SKIPCHECK_POLICY", "_skip_check", "_export_mode",
           "_get_inference_graph", "_flattened_module", "is_all_or_nothing_fallback_enabled",
           "register_custom_op_symbolic", "_rt_inspector", "_runtime_options", "ortmodule.experimental",
           "_debug_options", "_mem_efficient", "_first_skip_check_warning", "OrtValue", "C.OrtValue",
           "_pybind_state", "_logger", "ortmodule_module", "_SkipCheck", "AdamWMode", "ORTMODULE_FALLBACK_RETRY",
           "ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER", "ORTMODULE_CACHE_DIR", "is_dynamic_axes", "_is_training"]

# Tests that cannot say anything here, each for the reason given.
NOT_HERE = {
    "test_model_without_device": "needs CUDA (a CPU model given a CUDA input)",
    "test_bert_inputs_with_dynamic_shape": "fails on the plain PyTorch model with the installed transformers "
                                           "(BertForSequenceClassification.forward takes fewer positional arguments)",
}

# What only a CUDA device has: a test whose code uses one is not selected (this runs on the CPU).
CUDA_ONLY = ["torch.cuda.Stream", "torch.cuda.stream", "torch.cuda._sleep", "torch.cuda.current_stream",
             "get_device_capability", "torch.cuda.memory_reserved", "torch.cuda.device_count"]

# The thin layer: onnxruntime.training.ortmodule over gradbuilder.ortmodule.
SHIM = r'''
import os, sys, types
import torch
import gradbuilder.ortmodule as _gb

class _Private:
    """A private part of onnxruntime-training: importable, failing when used."""
    def __init__(self, name):
        self._name = name
    def _fail(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} is onnxruntime-training's private part; gradbuilder has no such thing")
    def __getattr__(self, name):
        return _Private(f"{self._name}.{name}")
    __call__ = __enter__ = __iter__ = __bool__ = _fail

class _Missing(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Private(f"{self.__name__}.{name}")

def _module(name, **attrs):
    m = _Missing(name)
    m.__dict__.update(attrs)
    m.__path__ = []
    sys.modules[name] = m
    return m

def _fallback_from_env():
    return os.environ.get("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE") != "FALLBACK_DISABLE"

class ORTModule(_gb.ORTModule):
    def __init__(self, module, debug_options=None, *args, **kwargs):
        kwargs.setdefault("fallback", _fallback_from_env())
        super().__init__(module, debug_options, **kwargs)

import onnxruntime
training = _module("onnxruntime.training")
ortmodule = _module("onnxruntime.training.ortmodule", ORTModule=ORTModule, DebugOptions=_gb.DebugOptions,
                    LogLevel=_gb.LogLevel)
training.ortmodule = ortmodule
training.ORTModule = ORTModule
onnxruntime.training = training
for _name in ["_utils", "_io", "_fallback", "_graph_execution_manager", "_custom_gradient_registry",
              "torch_cpp_extensions", "_custom_op_symbolic_registry", "experimental", "options"]:
    setattr(ortmodule, _name, _module("onnxruntime.training.ortmodule." + _name))
optim = _module("onnxruntime.training.optim")
training.optim = optim
optim.fused_adam = _module("onnxruntime.training.optim.fused_adam")
training.orttrainer = _module("onnxruntime.training.orttrainer")
_module("onnxruntime.capi.ort_trainer")

# A CPU-only torch: the tests' CUDA synchronisation and device queries are the CPU's.
torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.current_device = lambda: "cpu"

# transformers 5 dropped AdamW; the tests' hub downloads become random weights of the default config.
import transformers
if not hasattr(transformers, "AdamW"):
    transformers.AdamW = torch.optim.AdamW
_config_from = transformers.AutoConfig.from_pretrained.__func__
def _offline_config(cls, name, *args, **kwargs):
    if name == "bert-base-uncased":
        return transformers.BertConfig(**kwargs)
    return _config_from(cls, name, *args, **kwargs)
transformers.AutoConfig.from_pretrained = classmethod(_offline_config)
_model_from = transformers.PreTrainedModel.from_pretrained.__func__
def _offline_model(cls, name, *args, config=None, **kwargs):
    if name == "bert-base-uncased":
        torch.manual_seed(0)
        return cls(config if config is not None else transformers.BertConfig())
    return _model_from(cls, name, *args, config=config, **kwargs)
transformers.PreTrainedModel.from_pretrained = classmethod(_offline_model)
'''

# Selection and the report, as a pytest plugin.
PLUGIN = r'''
import inspect, json, re
import pytest

PRIVATE = %r
CUDA_ONLY = %r
NOT_HERE = %r
_pattern = re.compile("|".join(r"(?<![A-Za-z0-9])" + re.escape(n) + r"(?![A-Za-z0-9_])" for n in PRIVATE))
_cuda = re.compile("|".join(re.escape(n) for n in CUDA_ONLY))
_results = {}
_MARK = "not selected: "

def _private_use(item):
    if item.originalname in NOT_HERE:
        return NOT_HERE[item.originalname]
    try:
        source = inspect.getsource(item.function)
    except (OSError, TypeError):
        return None
    found = _cuda.search(source)
    if found:
        return f"needs CUDA ({found.group(0)})"
    found = _pattern.search(source)
    return f"uses the peer's private {found.group(0)}" if found else None

def pytest_collection_modifyitems(config, items):
    # skipped with a reason (not deselected): the reason reaches the report from every worker
    for item in items:
        why = _private_use(item)
        if why:
            item.add_marker(pytest.mark.skip(reason=_MARK + why))

def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        if report.skipped:
            why = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            if why.startswith("Skipped: "):
                why = why[len("Skipped: "):]
            outcome = "not selected" if why.startswith(_MARK) else "skipped"
            _results.setdefault(report.nodeid, (outcome, why[len(_MARK):] if outcome == "not selected" else why))
        elif report.failed:
            text = str(report.longrepr).strip().splitlines()
            last = next((l for l in reversed(text) if l.startswith("E ")), text[-1] if text else "")
            _results[report.nodeid] = ("failed", last[:300])
        elif report.when == "call":
            _results.setdefault(report.nodeid, ("passed", ""))

def pytest_sessionfinish(session):
    with open(session.config.getoption("--peer-report") + "." + str(__import__("os").getpid()), "w") as f:
        json.dump({"results": _results}, f)

def pytest_addoption(parser):
    parser.addoption("--peer-report", default="peer_report")
'''


def _to_cpu(text: str) -> str:
    text = re.sub(r"""(['"])cuda(:\d+)?\1""", '"cpu"', text)
    text = re.sub(r"\.cuda\(\)", ".cpu()", text)
    return text


def _run(work: str, target: str, jobs: int, k: str | None, results: dict) -> None:
    """pytest on ``target`` in ``work``, its results added to ``results`` (node id -> (outcome, why))."""
    stem = os.path.join(work, "report")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "peer_plugin", "--peer-report", stem,
           "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", work, target]
    if jobs > 1:  # a worker that dies is replaced however often (xdist stops the run after 4 per worker)
        cmd += ["-n", str(jobs), "--max-worker-restart", "1000000"]
    if k:
        cmd += ["-k", k]
    env = dict(os.environ, PYTHONPATH=work + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run(cmd, cwd=work, env=env)
    for name in os.listdir(work):
        if name.startswith("report."):
            path = os.path.join(work, name)
            with open(path) as f:
                part = json.load(f)
            os.remove(path)
            results.update(part["results"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tests", help="orttraining/orttraining/test/python of an onnxruntime checkout")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("-k", default=None, help="pytest -k expression")
    ap.add_argument("--report", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    missing = [f for f in FILES + SUPPORT if not os.path.isfile(os.path.join(args.tests, f))]
    if missing:
        print(f"peer_suite: {args.tests} has no {', '.join(missing)}: give the folder "
              "orttraining/orttraining/test/python of an onnxruntime checkout", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="peer_suite_")
    try:
        for f in FILES + SUPPORT:
            with open(os.path.join(args.tests, f), encoding="utf-8") as src:
                text = src.read()
            with open(os.path.join(work, f), "w", encoding="utf-8") as dst:
                dst.write(_to_cpu(text))
        with open(os.path.join(work, "conftest.py"), "w") as f:
            f.write(SHIM)
        with open(os.path.join(work, "peer_plugin.py"), "w") as f:
            f.write(PLUGIN % (PRIVATE, CUDA_ONLY, NOT_HERE))
        results: dict = {}
        for test_file in FILES:  # one pytest each: every file sets and deletes the same variables
            _run(work, test_file, args.jobs, args.k, results)
        # A worker that died (out of memory: the tests are sized for an 80 GB GPU) takes one test
        # with it: run each such test again alone.
        crashed = [node for node, (outcome, why) in results.items() if outcome == "failed" and "crashed" in why]
        for node in crashed:
            del results[node]
            _run(work, node, 1, None, results)
            if node not in results:
                results[node] = ("failed", "the test process died (out of memory) when run alone")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    counts = {k: sum(1 for v in results.values() if v[0] == k) for k in ("passed", "failed", "skipped")}
    selected = counts["passed"] + counts["failed"]
    deselected = {node: why for node, (outcome, why) in results.items() if outcome == "not selected"}
    reasons = {}
    for why in deselected.values():
        key = why.split(" (")[0] if why.startswith(("needs CUDA", "uses the peer")) else why
        reasons[key] = reasons.get(key, 0) + 1
    print(f"\ncollected {len(results)}: skipped by the tests {counts['skipped']}, "
          f"not selected {len(deselected)}, selected {selected}")
    for why, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
        print(f"  not selected: {n} {why}")
    for node, (outcome, why) in sorted(results.items()):
        if outcome == "failed":
            print(f"FAILED {node}: {why}")
    rate = counts["passed"] / selected if selected else 0.0
    print(f"passed {counts['passed']} of {selected} selected ({100 * rate:.1f}%)")
    if args.report:
        with open(args.report, "w") as f:
            json.dump({"counts": counts, "selected": selected, "rate": rate, "results": results}, f, indent=1)
    return 0 if selected else 1


if __name__ == "__main__":
    sys.exit(main())
