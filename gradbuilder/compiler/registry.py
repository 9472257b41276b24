"""The gradient-rule registry: rules by (domain, op_type) and opset, stop-gradient edges, and
the node metadata passes leave for rules. Rules emit through ``compiler.emitter.Emitter`` and
read the graph through ``compiler.values``.

A rule is registered for ``(domain, op_type)`` and has the signature::

    rule(node, dys, needs, e) -> sequence of (ir.Value | None), one per node input

``node`` is the forward ``onnx_ir.Node``; ``dys`` the gradients of its outputs (None where
no gradient flows); ``needs[i]`` tells whether input ``i`` needs a gradient; ``e`` is an
``compiler.emitter.Emitter`` bound to the model's opset. Rules never walk the graph and never edit
forward nodes: they only emit new nodes through ``e``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import pkgutil
from typing import Callable, Iterable, Iterator, Sequence

import onnx_ir as ir


Rule = Callable[..., Sequence["ir.Value | None"]]

# Node metadata a pass leaves for a rule: the indices of the body inputs a Loop stores per
# trip (``passes.store_trips``), read by the Loop rule.
TRIPS = "gradbuilder.trips"
# Set by passes.finite_inputs on a Softmax or LogSoftmax whose input cannot hold -inf.
FINITE_INPUT = "gradbuilder.finite_input"


@dataclasses.dataclass(frozen=True)
class RuleEntry:
    domain: str
    op_type: str
    fn: Rule
    since: int
    doc: str


_RULES: dict[tuple[str, str], list[RuleEntry]] = {}
_LOADED = False


def _norm_domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


def register(op_type: str | Iterable[str], domain: str = "", since: int = 1):
    """Decorator: register ``fn`` as the gradient rule of ``op_type`` in ``domain``.

    ``since`` is the first opset the rule applies to; a later registration for a higher
    ``since`` takes over from that opset on.
    """
    names = [op_type] if isinstance(op_type, str) else list(op_type)

    def deco(fn: Rule) -> Rule:
        for name in names:
            entry = RuleEntry(_norm_domain(domain), name, fn, since, (fn.__doc__ or "").strip())
            entries = _RULES.setdefault((entry.domain, name), [])
            entries[:] = [x for x in entries if x.since != since] + [entry]
            entries.sort(key=lambda x: x.since)
        return fn

    return deco


def unregister(domain: str, op_type: str) -> list[RuleEntry]:
    """Take the rules of ``op_type`` in ``domain`` (every opset's) out of the registry and return
    them (none: an empty list); the op is then differentiated as if it had no rule."""
    load_rules()  # else the rule modules would register it again on the next lookup
    return _RULES.pop((_norm_domain(domain), op_type), [])


@contextlib.contextmanager
def scoped() -> Iterator[None]:
    """A block whose registrations are undone at its end: the rules and stop-gradient edges
    registered, replaced or unregistered inside it are as they were before it once it exits."""
    load_rules()  # the built-in rules belong to the state restored, not to the block
    rules = {key: list(entries) for key, entries in _RULES.items()}
    edges = dict(_STOP_EDGES)
    try:
        yield
    finally:
        _RULES.clear()
        _RULES.update(rules)
        _STOP_EDGES.clear()
        _STOP_EDGES.update(edges)


_STOP_EDGES: dict[tuple[str, str], frozenset[int]] = {}


def register_stop_gradient_edges(edges, op_type: str, domain: str = "") -> None:
    """Declare inputs (by index) of ``op_type`` through which no gradient flows, for every
    node of that type (like onnxruntime's ``register_custom_stop_gradient_edges``)."""
    key = (_norm_domain(domain), op_type)
    _STOP_EDGES[key] = _STOP_EDGES.get(key, frozenset()) | frozenset(int(i) for i in edges)


def stop_gradient_edges(domain: str, op_type: str) -> frozenset[int]:
    load_rules()  # the rule modules declare the built-in ones
    return _STOP_EDGES.get((_norm_domain(domain), op_type), frozenset())


def load_rules() -> None:
    """Import every module of ``gradbuilder.rules`` so their rules register themselves."""
    global _LOADED
    if _LOADED:
        return
    rules = _rules_package()
    for info in pkgutil.iter_modules(rules.__path__):
        importlib.import_module(f"gradbuilder.rules.{info.name}")
    _LOADED = True


def _rules_package():
    """``gradbuilder.rules``: installed inside the package by the wheel (setuptools'
    ``package-dir``); in a source tree that is not installed, the top-level ``rules/`` folder
    beside the package, mapped to that one name and nothing else."""
    import sys

    try:
        return importlib.import_module("gradbuilder.rules")
    except ModuleNotFoundError as exc:
        if exc.name != "gradbuilder.rules":
            raise
    from pathlib import Path

    import gradbuilder

    folder = Path(gradbuilder.__file__).resolve().parent.parent / "rules"
    spec = importlib.util.spec_from_file_location("gradbuilder.rules", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    if spec is None:
        raise ModuleNotFoundError(f"gradbuilder.rules is not installed and {folder} has no rules package",
                                  name="gradbuilder.rules")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    gradbuilder.rules = module
    return module


def lookup(domain: str, op_type: str, opset: int) -> RuleEntry | None:
    load_rules()
    entries = _RULES.get((_norm_domain(domain), op_type))
    if not entries:
        return None
    chosen = None
    for entry in entries:
        if entry.since <= opset:
            chosen = entry
    return chosen


def all_rules() -> list[RuleEntry]:
    load_rules()
    out = []
    for entries in _RULES.values():
        out.extend(entries)
    return sorted(out, key=lambda r: (r.domain, r.op_type, r.since))
