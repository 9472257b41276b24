"""The package's structure holds: each layer imports only from the layers below it, nothing
outside the package is importable as gradbuilder.*, the graph-interface names are spelled in
one module, and a TrainingSession reads its model once and leaves the builder's model as it
was given."""

import ast
import importlib
import pathlib
import re

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


# ---------------------------------------------------------------------------- private names
ROOT = PACKAGE.parent

# (file, private name) -> why that file reads the name from outside the module defining it: no
# public way to do it yet, and where one belongs. An entry must still be read there (the test
# fails on one that is not), so fixing a read means deleting its entry.
READ_FROM_OUTSIDE: dict[tuple[str, str], str] = {}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_"


def _scanned() -> dict[pathlib.Path, str]:
    """Every file the private-name check reads -> its module: the package's (the rules as
    gradbuilder.rules.*), the tests' (tests.*) and the tools' (by their stem: they import each
    other from tools/ on sys.path)."""
    out = {path: name for name, path in _modules().items()}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        out[path] = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    out.update({path: path.stem for path in sorted((ROOT / "tools").glob("*.py"))})
    return out


ATTRIBUTE_CALLS = {"getattr", "setattr", "hasattr", "delattr", "object", "__setattr__"}  # f(x, "_name", ...)


class _Names:
    """What one module holds and reads of private names: ``top`` (bound at its top level) and
    ``attributes`` (in a class body, on ``self`` / ``cls``, by ``setattr(self, "_x", ...)``)
    it defines; the project modules and names it imports (``imports``: local name -> dotted
    target) and the other packages' names (``external``); the private names it reads off
    something (``reads``: ``x._name``, ``getattr(x, "_name")``, ``monkeypatch.setattr(x,
    "_name", ...)``, ``mock.patch.object(x, "_name")``), the private names it imports and the
    dotted project paths it spells in strings (``monkeypatch.setattr("gradbuilder.m._name", ...)``)."""

    def __init__(self, tree: ast.Module, module: str, is_package: bool, tops: set[str]):
        self.module, self.is_package, self.tops = module, is_package, tops
        self.top: set[str] = set()
        self.attributes: set[str] = set()
        self.imports: dict[str, str] = {}
        self.external: set[str] = set()
        self.reads: list[tuple[int, ast.expr, str]] = []  # (line, what it is read off, name)
        self.private_imports: list[tuple[int, str]] = []  # (line, dotted name)
        self.paths: list[tuple[int, str]] = []  # (line, "gradbuilder.x.y")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                if _private(node.attr):
                    if isinstance(node.ctx, ast.Store) and _is_self(node.value):
                        self.attributes.add(node.attr)
                    self.reads.append((node.lineno, node.value, node.attr))
            elif isinstance(node, ast.Call):
                self._call(node)
            elif isinstance(node, ast.Constant):
                if isinstance(node.value, str) and node.value.partition(".")[0] in tops and "." in node.value:
                    self.paths.append((node.lineno, node.value))
            elif isinstance(node, ast.ClassDef):
                self.attributes.update(_bound(node.body))
                for stmt in node.body:
                    if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                                            for t in stmt.targets):
                        self.attributes.update(c.value for c in ast.walk(stmt.value) if isinstance(c, ast.Constant))
            elif isinstance(node, ast.ImportFrom):
                self._import_from(node)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    local = a.asname or a.name.partition(".")[0]
                    if a.name.partition(".")[0] in tops:
                        self.imports[local] = a.name if a.asname else local
                    else:
                        self.external.add(local)
        self.top = _bound(tree.body)

    def _import_from(self, node: ast.ImportFrom) -> None:
        target = node.module or ""
        if node.level:
            parts = self.module.split(".")
            parts = parts if self.is_package else parts[:-1]
            target = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
        elif target.partition(".")[0] not in self.tops:
            self.external.update(a.asname or a.name for a in node.names)
            return
        for a in node.names:
            self.imports[a.asname or a.name] = f"{target}.{a.name}"
            if _private(a.name):
                self.private_imports.append((node.lineno, f"{target}.{a.name}"))

    def _call(self, node: ast.Call) -> None:
        func = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        name = node.args[1] if func in ATTRIBUTE_CALLS and len(node.args) >= 2 else None
        if isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value):
            if func in ("setattr", "__setattr__") and _is_self(node.args[0]):
                self.attributes.add(name.value)
            self.reads.append((node.lineno, node.args[0], name.value))


def _bound(body: list[ast.stmt]) -> set[str]:
    """The names the statements ``body`` bind at their own level (inside if / try / with / for
    too, not in the functions and classes they define)."""
    out, todo = set(), list(body)
    while todo:
        stmt = todo.pop()
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(stmt.name)
            continue
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            out.update(a.asname or a.name.partition(".")[0] for a in stmt.names)
        targets = (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                   if isinstance(stmt, (ast.AnnAssign, ast.AugAssign, ast.For)) else
                   [i.optional_vars for i in stmt.items if i.optional_vars] if isinstance(stmt, ast.With) else [])
        out.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        for field in ("body", "orelse", "finalbody", "handlers"):
            todo.extend(getattr(stmt, field, []))
    return out


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _root(node: ast.expr) -> str | None:
    """The name ``node`` (``a.b[c].d``) is read off."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _private_reaches(files: dict[pathlib.Path, str], root: pathlib.Path) -> list[tuple[str, str, str]]:
    """(file:line, private name, how) for each read, in ``files`` (path -> module), of a
    private name (``_x``, not ``__x__``) another of them defines:

    - ``from m import _x`` (relative too), and ``"m._x"`` / ``"m.C._x"`` spelled in a string
      (``monkeypatch.setattr("gradbuilder.m._x", ...)``) where ``m`` defines ``_x``;
    - ``x._y`` (or ``getattr`` / ``setattr`` / ``monkeypatch.setattr`` / ``mock.patch.object``
      of ``x, "_y"``) where ``x`` is an imported project module or a name imported from one;
    - ``<expr>._y`` where another module defines ``_y`` as an attribute (in a class body or on
      ``self``) and this one does not: a session's ``_state`` read by a test, a subclass reading
      its base class's privates.

    A module's own private names are its own (``self._x`` in the class that sets it, its
    helpers); another package's (``torch._dynamo``, ``x._y`` off a name imported from one) are
    not the project's business."""
    tops = {module.partition(".")[0] for module in files.values()}
    # A file with none of these spellings neither reads nor defines a private name as the check
    # looks at them (``._x``, ``"_x"``, ``import _x``, ``"gradbuilder.``, a class body's ``_x``):
    # it is not parsed (half the bytes, half the time).
    spelled = re.compile(r"\._[A-Za-z]|[\"']_[A-Za-z]|import[^\n(]*\b_[A-Za-z]|import\s*\([^)]*\b_[A-Za-z]|"
                         r"^[ \t]+(?:async[ \t]+)?(?:def|class)[ \t]+_[A-Za-z]|^[ \t]+_[A-Za-z]\w*[ \t]*[:=,]|"
                         r"__slots__|[\"'](?:%s)\." % "|".join(map(re.escape, sorted(tops))), re.M)
    texts = {path: path.read_text() for path in files}
    names = {module: _Names(ast.parse(texts[path], str(path)) if spelled.search(texts[path]) else ast.Module([], []),
                            module, path.name == "__init__.py", tops) for path, module in files.items()}
    owners: dict[str, set[str]] = {}
    for found in names.values():
        for name in found.attributes:
            owners.setdefault(name, set()).add(found.module)
    out = []
    for path, module in files.items():
        here, where = names[module], str(path.relative_to(root))
        out += [(f"{where}:{line}", target.rpartition(".")[2], f"imports {target}")
                for line, target in here.private_imports]
        for line, dotted in here.paths:
            parts = dotted.split(".")
            if not all(p.isidentifier() for p in parts):
                continue
            at = max((i for i in range(1, len(parts)) if ".".join(parts[:i]) in names), default=0)
            if at:
                defined = names[".".join(parts[:at])]
                hit = [p for p in parts[at:] if _private(p) and p in defined.top | defined.attributes]
                out += [(f"{where}:{line}", hit[0], f"names {dotted!r}")] if hit else []
        for line, value, name in here.reads:
            base = _root(value)
            if base in here.imports:
                out.append((f"{where}:{line}", name, f"{ast.unparse(value)}.{name} ({here.imports[base]})"))
            elif base in here.external:
                continue
            elif name not in here.attributes and owners.get(name, set()) - {module}:
                out.append((f"{where}:{line}", name, f"{ast.unparse(value)}.{name} (an attribute of "
                                                     f"{', '.join(sorted(owners[name] - {module}))})"))
    return out


def test_no_module_reads_another_modules_private_names():
    """A private name is its module's own: what another module needs is public (named without
    a leading underscore, with a docstring). Reads with no public way yet are listed in
    READ_FROM_OUTSIDE with their reasons."""
    found = _private_reaches(_scanned(), ROOT)
    listed = {(f.rpartition(":")[0], name) for f, name, _ in found}
    bad = [" ".join(r) for r in found if (r[0].rpartition(":")[0], r[1]) not in READ_FROM_OUTSIDE]
    assert not bad, "\n".join(bad)
    assert set(READ_FROM_OUTSIDE) <= listed, sorted(set(READ_FROM_OUTSIDE) - listed)  # an entry no longer read


def test_the_private_name_check_finds_each_kind_of_reach(tmp_path):
    import textwrap

    a = """
        _TABLE = {}
        class Base:
            _kind = 1
            def __init__(self):
                self._state, self._own = {}, 1
            def read(self, other: "Base"):
                return self._own, other._state  # its own names
    """
    b = """
        import torch
        from . import a
        from .a import _TABLE, Base
        class Sub(Base):
            def go(self):
                return self._state, super()._kind
        def reads(session, monkeypatch):
            monkeypatch.setattr(a, "_TABLE", {})
            monkeypatch.setattr("pkg.a._TABLE", {})
            monkeypatch.setattr("pkg._made_up", {})  # nothing pkg defines
            getattr(session, "_own")
            torch._dynamo.reset()  # torch's
            return a._TABLE, Base._kind, session._state, session.state, a.__name__
    """
    (tmp_path / "pkg").mkdir()
    files = {tmp_path / "pkg" / "__init__.py": "pkg", tmp_path / "pkg" / "a.py": "pkg.a",
             tmp_path / "pkg" / "b.py": "pkg.b"}
    for (path, _), text in zip(files.items(), ["", a, b]):
        path.write_text(textwrap.dedent(text))
    found = sorted((int(f.rpartition(":")[2]), name) for f, name, _ in _private_reaches(files, tmp_path)
                   if f.startswith("pkg/b.py:"))
    assert found == [(4, "_TABLE"),  # from .a import _TABLE
                     (7, "_kind"), (7, "_state"),  # a subclass's reads
                     (9, "_TABLE"), (10, "_TABLE"),  # monkeypatched, either way
                     (12, "_own"),  # getattr
                     (14, "_TABLE"), (14, "_kind"), (14, "_state")]
    assert len(found) == len(_private_reaches(files, tmp_path))  # nothing in a.py
