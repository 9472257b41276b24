"""The package's structure holds: each layer imports only from the layers below it, nothing
outside the package is importable as gradbuilder.*, the graph-interface names are spelled in
one module, and a TrainingSession reads its model once and leaves the builder's model as it
was given."""

import ast
import importlib
import pathlib

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import gradbuilder
from gradbuilder import TrainingParameters, TrainingSession

PACKAGE = pathlib.Path(gradbuilder.__file__).resolve().parent
RULES = PACKAGE.parent / "rules"

# layer -> the layers it must not import (the ones above it or beside it)
FORBIDDEN = {
    "compiler": {"training", "runtime", "ortmodule", "cli", "demo", "testing"},
    "training": {"runtime", "ortmodule", "cli", "demo", "testing"},
    "runtime": {"ortmodule", "cli", "demo", "testing"},
    "ortmodule": {"cli", "demo", "testing"},
}
FOUNDATIONS = {"errors", "files", "interface", "dtypes", "compat", "tensorfiles"}


def _imports(path: pathlib.Path, package: str) -> set[str]:
    """The gradbuilder modules ``path`` (a module of ``package``) imports, absolute."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target] + [f"{target}.{a.name}" for a in node.names]
            out.update(n for n in names if n.startswith("gradbuilder"))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("gradbuilder"))
    return out


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_imports_nothing_above_or_beside_it(layer):
    bad = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        package = ".".join(parts if parts[-1] == "__init__" else parts[:-1]).removesuffix(".__init__")
        for target in _imports(path, package):
            if _layer(target) in FORBIDDEN[layer]:
                bad.append(f"{rel}: {target}")
    assert not bad, bad


def test_rules_import_only_the_compiler_and_the_foundations():
    allowed = {"compiler", "rules"} | FOUNDATIONS
    bad = [f"{path.name}: {t}" for path in sorted(RULES.glob("*.py"))
           for t in _imports(path, "gradbuilder.rules") if _layer(t) not in allowed]
    assert not bad, bad


def _modules(package: pathlib.Path = PACKAGE, rules: pathlib.Path = RULES) -> dict[str, pathlib.Path]:
    """Every module of the package (the rules as ``gradbuilder.rules.*``) -> its file."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in sorted(rules.glob("*.py")):
        out["gradbuilder.rules" if path.stem == "__init__" else f"gradbuilder.rules.{path.stem}"] = path
    return out


def _import_graph(package: pathlib.Path = PACKAGE, rules: pathlib.Path = RULES):
    """module -> the gradbuilder modules it imports, at the top or inside a function (a lazy
    import is a circle all the same). ``from x import y`` is an edge to ``x.y`` when that is a
    module, else to ``x``; importing a package the module lies in is no edge (it is imported
    before the module anyway)."""
    import networkx as nx

    modules = _modules(package, rules)
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        package_name = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package_name.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
        graph.add_edges_from((name, t) for t in targets
                             if t in modules and t != name and not name.startswith(t + "."))
    return graph


def test_no_import_cycle_among_gradbuilder_modules():
    import networkx as nx

    graph = _import_graph()
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not cycles, [nx.find_cycle(graph.subgraph(c)) for c in cycles]


def test_a_pass_imports_neither_the_pipeline_nor_the_builder():
    """Passes sit below the pipeline that lists them and the builder that runs it: a pass
    that reaches either (directly, lazily or through another module) closes a circle."""
    import networkx as nx

    graph = _import_graph()
    above = {"gradbuilder.compiler.pipeline", "gradbuilder.compiler.builder", "gradbuilder.compiler.split",
             "gradbuilder.compiler.cuts"}
    bad = {name: sorted(nx.descendants(graph, name) & above) for name in graph
           if name.startswith("gradbuilder.compiler.passes")}
    assert not {k: v for k, v in bad.items() if v}, bad


@pytest.mark.parametrize("name", ["gradbuilder.tests", "gradbuilder.tools", "gradbuilder.docs"])
def test_nothing_outside_the_package_is_importable_as_gradbuilder(name):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(name)


def test_the_rules_resolve_as_gradbuilder_rules():
    from gradbuilder.compiler import registry

    registry.load_rules()
    assert importlib.import_module("gradbuilder.rules.activations").__name__ == "gradbuilder.rules.activations"


def test_interface_names_are_spelled_in_one_module():
    spelled = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "interface.py":
            continue
        tree = ast.parse(path.read_text())
        exported = {id(c) for n in tree.body if isinstance(n, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)
                    for c in ast.walk(n.value)}  # names of classes (schedulers.Step), not of the interface
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and id(node) not in exported and node.value in (
                    "Step", "Learning_Rate", ".updated", ".grad_accum", "Accumulation_Step", "Loss_Scale",
                    "Loss_Scale_Good_Steps", "All_Finite"):
                spelled.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.value!r}")
    assert not spelled, spelled


def regression_model() -> onnx.ModelProto:
    """x [n, 3] -> MatMul W, Add B -> mean squared error against t [n, 2] (other tests train it too)."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "B"], ["y"]),
             helper.make_node("Sub", ["y", "t"], ["d"]), helper.make_node("Mul", ["d", "d"], ["sq"]),
             helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3]),
                                           helper.make_tensor_value_info("t", TensorProto.FLOAT, ["n", 2])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              [numpy_helper.from_array(rng.standard_normal((3, 2)).astype(np.float32), "W"),
                               numpy_helper.from_array(np.zeros(2, np.float32), "B")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_session_reads_its_model_once_and_leaves_the_builders_model_usable(monkeypatch):
    from gradbuilder.compiler import modelio

    model = regression_model()
    given = model.SerializeToString()
    calls = []
    real = modelio.load_proto
    monkeypatch.setattr(modelio, "load_proto", lambda *a, **k: calls.append(1) or real(*a, **k))
    params = TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw")
    sess = TrainingSession(model, params, providers=["CPUExecutionProvider"])
    assert len(calls) == 1
    assert model.SerializeToString() == given  # the caller's model is untouched
    state = sess.parts.builder.initial_state()  # after construction too
    assert sorted(state) == ["B.exp_avg", "B.exp_avg_sq", "Step", "W.exp_avg", "W.exp_avg_sq"]
    assert state["W.exp_avg"].shape == (3, 2) and state["W.exp_avg"].dtype == np.float32
    loss = sess.run(["loss"], {"x": np.ones((4, 3), np.float32), "t": np.zeros((4, 2), np.float32)})
    assert np.isfinite(loss[0])
