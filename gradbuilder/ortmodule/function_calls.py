"""Each application of a ``torch.autograd.Function`` (and, with ``graph_breaks=True``, each
operation the exporter lacks) traced as one ``FunctionBreak`` node (``FunctionCall``): PyTorch
runs it between the onnxruntime graphs around it (``breaks.py``)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import threading

import torch
import torch.utils._pytree as pytree

from .stops import STOP_DOMAIN, StopGradient
from .watch import FORWARD_CODES, PACKAGE_DIR, TORCH_DIR, Watch, code_place

BREAK = "FunctionBreak"  # the node (domain STOP_DOMAIN) standing for a Function's application


@dataclasses.dataclass
class FunctionCall:
    """One application of a ``torch.autograd.Function`` in the traced call, which runs in
    PyTorch between the onnxruntime graphs (a graph break): the Function, its arguments as the
    tracer recorded them (``cconv``: ``d`` a tensor, ``c`` a constant from ``constants``), and the
    place that applied it. ``inputs``/``outputs`` name its tensors in the exported graph."""

    function: object  # the Function's class, or an operation (torch.ops.aten.diff) with graph_breaks=True
    cconv: str
    constants: list
    where: str
    inputs: list[str] = dataclasses.field(default_factory=list)
    outputs: list[str] = dataclasses.field(default_factory=list)
    output_types: list = dataclasses.field(default_factory=list)  # (onnx element type, rank) as traced
    changes: list = dataclasses.field(default_factory=list)  # positions among ``inputs`` it changes in place

    @property
    def name(self) -> str:
        if isinstance(self.function, type):
            return f"{self.function.__module__}.{self.function.__qualname__}"
        return f"the PyTorch operation {self.function._qualified_op_name}"

    def __call__(self, tensors: list) -> list:
        """The Function (or operation) applied to ``tensors`` and its constants: its tensor outputs."""
        given, constants = iter(tensors), iter(self.constants)
        run = self.function.apply if isinstance(self.function, type) else self.function
        out = run(*[next(given) if kind == "d" else next(constants) for kind in self.cconv])
        return [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]


def _op_arguments(op: str, args) -> tuple[str, list]:
    """(cconv, constants) of an operation's traced arguments: a value the trace made constant is
    read back as the Python value its schema's argument takes (int, float, bool, a list, None,
    or a tensor); every other value is a tensor computed in the graph."""
    schemas = [s for s in torch._C._jit_get_schemas_for_operator(op)
               if not any(a.is_out for a in s.arguments) and len(s.arguments) >= len(args)]
    kinds = [str(a.type) for a in schemas[0].arguments] if schemas else ["Tensor"] * len(args)
    cconv, constants = "", []
    for value, kind in zip(args, kinds):
        if not isinstance(value, torch._C.Value):
            cconv, constants = cconv + "c", constants + [value]
        elif value.node().kind() == "prim::Constant" and value.node().mustBeNone():
            cconv, constants = cconv + "c", constants + [None]
        elif value.node().kind() == "onnx::Constant":
            data = value.node().t("value")
            python = data if "Tensor" in kind else data.item() if data.dim() == 0 else data.tolist()
            cconv, constants = cconv + "c", constants + [python]
        else:
            cconv += "d"
    return cconv, constants


def _break_node(g, node, watch: Watch, call: FunctionCall, values: list):
    """The ``FunctionBreak`` node of ``call`` (recorded in ``watch.calls``), typed as traced
    with every size dynamic."""
    watch.calls.append(call)
    outs = g.op(f"{STOP_DOMAIN}::{BREAK}", *values, index_i=len(watch.calls) - 1, outputs=node.outputsSize())
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    for out, traced in zip(outs, node.outputs()):
        kind = traced.type()
        out.setType(kind.with_sizes([None] * kind.dim()) if kind.dim() is not None else kind)
        call.output_types.append((_ONNX_TYPES.get(kind.scalarType(), 0), kind.dim()))
    return outs if len(outs) > 1 else outs[0]


# the tracer's scalar type names -> onnx element types
_ONNX_TYPES = {"Float": 1, "Double": 11, "Half": 10, "BFloat16": 16, "Long": 7, "Int": 6, "Short": 5, "Char": 3,
               "Byte": 2, "Bool": 9}


@contextlib.contextmanager
def breaking_at_functions(watch: Watch, ops: frozenset = frozenset()):
    """While tracing, each application of a ``torch.autograd.Function`` (other than ours) is
    exported as one ``STOP_DOMAIN::FunctionBreak`` node (attribute ``index`` into
    ``watch.calls``) instead of its forward inlined; its forward runs as usual to trace what
    follows, with ``watch.inside`` counting (what it does is PyTorch's to run, not ours to watch).
    So is each call of the operations ``ops`` (``aten::diff``, ...: ``graph_breaks=True``)."""
    def symbolic(g, *args, **kwargs):
        node = g.original_node
        cls = getattr(node.pyobj(), "__self__", None)
        values = [a for a in args if isinstance(a, torch._C.Value)]
        if cls is StopGradient:
            return StopGradient.symbolic(g, *values, *node.scalar_args())
        return _break_node(g, node, watch, FunctionCall(cls, node.cconv(), list(node.scalar_args()),
                                                        _traced_at(node)), values)

    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if cls is StopGradient or torch._C._get_tracing_state() is None or watch.inside:
            return original.__func__(cls, *args, **kwargs)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        versions = [t._version for t in tensors]
        watch.inside += 1
        try:
            result = original.__func__(cls, *args, **kwargs)
        finally:
            watch.inside -= 1
        # which tensor arguments it changed in place (see FunctionCall.changes); one it does not
        # return (no mark_dirty) is a change autograd does not see, which the trace repeats
        changes = [k for k, (t, v) in enumerate(zip(tensors, versions)) if t._version != v]
        watch.applied.append((cls, changes))
        returned = [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
        if any(not any(o is tensors[k] for o in returned) for k in changes):
            watch.unmarked.append(f"{code_place(sys._getframe(1))} ({cls.__module__}.{cls.__qualname__}.apply)")
        # an output PyTorch gives no gradient (grad mode off, mark_non_differentiable) is marked
        # as GradientStops marks one: no gradient flows through it in the graphs after the break
        if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves((args, kwargs))):
            return result

        def cut(t):
            return isinstance(t, torch.Tensor) and t.is_floating_point() and not t.requires_grad

        if not any(cut(t) for t in pytree.tree_leaves(result)):
            return result
        where = (f"{code_place(sys._getframe(1))} ({cls.__qualname__}.apply"
                 f"{'' if torch.is_grad_enabled() else ' with grad mode off'})")
        watch.stops.append(where)
        return pytree.tree_map_only(torch.Tensor, lambda t: StopGradient.apply(t, where) if cut(t) else t, result)

    torch.onnx.register_custom_op_symbolic("prim::PythonOp", symbolic, 1)
    for name in ops - _OPERATIONS.registered:  # kept: the exporter cannot take an operation's back
        torch.onnx.register_custom_op_symbolic(name, _operation_symbolic(name), 1)
        _OPERATIONS.registered.add(name)
    torch.autograd.Function.apply = classmethod(apply)
    _OPERATIONS.watch, _OPERATIONS.ops = watch, ops
    try:
        yield
    finally:
        _OPERATIONS.watch, _OPERATIONS.ops = None, frozenset()
        torch.autograd.Function.apply = original
        torch.onnx.unregister_custom_op_symbolic("prim::PythonOp", 1)


class _Operations(threading.local):
    """The operations exported as breaks: registered once (the exporter's registry cannot undo
    a registration), active only in a trace that asked for them (``ops`` of its ``watch``)."""

    registered: set = set()  # shared by every thread, as the exporter's registry is
    watch: Watch | None = None
    ops: frozenset = frozenset()


_OPERATIONS = _Operations()


def _operation_symbolic(name: str):
    """The symbolic of an operation that runs in PyTorch: a break node where the trace asked
    for it, else the exporter's own error for an operation it does not support."""
    def symbolic(g, *args, **kwargs):
        watch = _OPERATIONS.watch
        if watch is None or name not in _OPERATIONS.ops:
            raise torch.onnx.errors.UnsupportedOperatorError(name, g.opset, None)
        node = g.original_node
        cconv, constants = _op_arguments(name, args)
        namespace, op = name.split("::")
        call = FunctionCall(getattr(getattr(torch.ops, namespace), op), cconv, constants, _traced_at(node))
        return _break_node(g, node, watch, call, [a for a, k in zip(args, cconv) if k == "d"])
    return symbolic


_FRAME = re.compile(r"^(.*)\((\d+)\): (\S+)$")


def _traced_at(node) -> str:
    """file:line that applied a traced node, from the Python stack the tracer recorded with it,
    chosen as ``code_place`` chooses."""
    first = None
    for line in node.sourceRange().splitlines():
        frame = _FRAME.match(line.strip())
        if frame is None:
            continue
        file, lineno, function = frame.groups()
        if any(file == code.co_filename and function == code.co_name for code in FORWARD_CODES):
            break  # the traced call itself
        path = os.path.abspath(file)
        if not path.startswith(PACKAGE_DIR):
            first = first or f"{file}:{lineno}"
            if not path.startswith(TORCH_DIR):
                return f"{file}:{lineno}"
    return first or "an unknown place"
