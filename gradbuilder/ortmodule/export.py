"""Export a module call to ONNX with torch's exporter, for one input signature.

The call's arguments are flattened (``torch.utils._pytree``): tensors become graph inputs
``input_<i>`` with every dimension dynamic, everything else is baked into the graph and is
part of the signature. Parameters and buffers become graph inputs named as in
``named_parameters()`` / ``named_buffers()``, fed at run time, so an optimizer's updates and
``load_state_dict`` need no new export. The outputs are flattened the same way: one graph output per
distinct output tensor (a tensor returned twice is one output), non-tensor leaves (None
included) kept from the traced call. The trace runs under the caller's grad mode, so an
output that does not require grad in PyTorch (an integer result, a ``detach()``) takes no
gradient here either.

While tracing, ``_watching`` records a tensor's value handed to Python (``.item()``,
``bool()``, ``int()``, ...), which a single exported graph cannot follow. Each application of a
``torch.autograd.Function`` is exported as one ``FunctionBreak`` node (``_breaking_at_functions``,
``FunctionCall``): PyTorch runs the Function between the graphs around it (``breaks.py``).

The exporter drops what cuts a gradient in PyTorch (``detach()`` becomes the identity, a
``torch.no_grad()`` block inside the forward leaves no trace). ``_GradientStops`` marks, while
the forward is traced with grad enabled, every value PyTorch's autograd cuts off: a floating
result that does not require grad computed from a tensor that does. The marks become
Identity nodes whose outputs are ``Exported.stop_gradients``. It also makes
``torch.max``/``torch.min`` along a dimension take their values at their indices, so that the
gradient goes to the index as in PyTorch.

Training-mode BatchNormalization also returns its new running statistics (outputs
``running/<buffer name>``, ``passes.running_stats.expose_running_statistics``), computed as
PyTorch does: ONNX's running variance uses the biased batch variance, PyTorch's the unbiased one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import sys
import threading
import unittest.mock
import warnings

import onnx
import onnx_ir as ir
import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from ..errors import ExportError
from ..compiler.modelio import to_ir
from ..compiler.passes.running_stats import expose_running_statistics
from ..compiler.pipeline import Context
from .conversions import converting
from .options import logger

OPSET = 17
RUNNING = "running/"
STOP_DOMAIN = "gradbuilder.ortmodule"  # the traced marks of values no gradient flows through


@dataclasses.dataclass
class Exported:
    model: onnx.ModelProto
    inputs: dict[str, int]  # graph input -> index among the call's tensor leaves
    state: dict[str, str]  # graph input -> parameter or buffer name
    outputs: list[str]  # graph outputs of the module's tensor leaves, in order
    out_spec: pytree.TreeSpec
    out_leaves: list  # the traced call's output leaves, tensors as Output(index into outputs)
    differentiable: list[bool]  # per output: it required grad in the traced call
    running: dict[str, str]  # graph output -> buffer it updates (BatchNorm running stats)
    batch_counters: list[str]  # num_batches_tracked buffers to increment each training call
    fixed_sizes: str | None = None  # why the graph holds only for the traced input sizes
    stop_gradients: list[str] = dataclasses.field(default_factory=list)  # values no gradient flows through
    shapes: tuple = ()  # the traced call's tensor shapes
    calls: list = dataclasses.field(default_factory=list)  # FunctionCall per FunctionBreak node, by index
    guards: list = dataclasses.field(default_factory=list)  # Guard per value of an input the code read
    torch_exported: bytes | None = None  # torch.onnx.export's own model, when kept

    def holds_for(self, tensors: list) -> bool:
        """Whether the call's tensors read the same values as the traced call (see ``Guard``)."""
        return all(g.holds(tensors) for g in self.guards)


@dataclasses.dataclass
class Guard:
    """The traced code read the value of one of the call's tensors into Python (``if flag:``,
    ``n = steps.item()``): the graph holds for calls whose tensor ``index`` reads the same."""

    index: int  # among the call's tensor leaves
    method: str  # the Tensor method that read it
    value: object  # what it read
    where: str

    def holds(self, tensors: list) -> bool:
        value = getattr(tensors[self.index], self.method)()
        return value == self.value or repr(value) == repr(self.value)  # NaN reads as NaN


@dataclasses.dataclass(frozen=True)
class Output:
    """An output leaf that is a tensor: the graph output ``index`` of ``Exported.outputs``."""

    index: int


class _Flat(torch.nn.Module):
    """The module as a function of its call's tensor leaves, returning its output's distinct
    tensors; records the output's structure and which tensors require grad."""

    def __init__(self, module, leaves, spec, watch: _Watch):
        super().__init__()
        self.inner = module
        self._leaves = leaves
        self._spec = spec
        self._watch = watch
        self.out_spec = None
        self.out_leaves = None
        self.differentiable = None

    def forward(self, *tensors):
        self._watch.inputs = [(t, t._version) for t in tensors]
        it = iter(tensors)
        leaves = [next(it) if isinstance(x, torch.Tensor) else x for x in self._leaves]
        args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        # without grad the graph runs forward only: nothing to cut
        stops = _GradientStops(self._watch) if torch.is_grad_enabled() else contextlib.nullcontext()
        with stops:
            out = self.inner(*args, **kwargs)
        flat, self.out_spec = pytree.tree_flatten(out)
        distinct: list[torch.Tensor] = []
        self.out_leaves = []
        for x in flat:
            if isinstance(x, torch.Tensor):
                index = next((i for i, t in enumerate(distinct) if t is x), None)
                if index is None:
                    index = len(distinct)
                    distinct.append(x)
                x = Output(index)
            self.out_leaves.append(x)
        self.differentiable = [t.requires_grad and t.is_floating_point() for t in distinct]
        return tuple(distinct)


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_UNSUPPORTED = re.compile(r"Exporting the operator '(aten::\w+)' to ONNX opset version \d+ is not supported")
_TO_NUMBER = re.compile(r"Converting a tensor to a Python (number|index|integer|list)")
_TRACING = threading.RLock()  # one trace at a time: _watching replaces methods of torch's classes


def export(module: torch.nn.Module, leaves: list, spec, verbose: bool = False,
           keep_torch_export: bool = False, graph_breaks: bool = False) -> Exported:
    """The call exported. ``graph_breaks``: an operation torch's exporter cannot export runs in
    PyTorch between the graphs (as a Function does) instead of failing the export."""
    what = type(module).__name__
    watch = _Watch()
    ops: frozenset = frozenset()
    first_error, static = None, None  # static: why the graph is traced for the call's sizes only
    while True:
        try:
            data, caught, flat = _trace(module, leaves, spec, verbose, watch, ops, dynamic=static is None)
            break
        except ExportError as exc:
            unsupported = _UNSUPPORTED.search(str(exc.__cause__ or ""))
            if graph_breaks and unsupported is not None and unsupported.group(1) not in ops:
                ops |= {unsupported.group(1)}
            elif static is None and unsupported is None:
                # an operator's export that needs a size as a Python number (a loss's ignore_index
                # from x.size(1)): trace with the call's sizes, and export again for other sizes
                first_error = exc
                static = f"the export with symbolic sizes failed ({_first_lines(str(exc.__cause__))[:200]})"
            else:
                raise first_error or exc
            watch = _Watch()
    for w in caught:
        logger.debug("ORTModule: export of %s: %s: %s (%s:%d)", what, w.category.__name__, w.message, w.filename,
                     w.lineno)
    _refuse(f"{what} changes a tensor in place with grad mode off", watch.in_place,
            "the exported graph cannot keep the gradient out of that change as PyTorch does (PyTorch's gradient "
            "does not see the change of a tensor that requires grad; a view written from a tensor that requires "
            "grad cannot be cut). Make the change out of place")
    _refuse(f"{what} applies a torch.autograd.Function that changes a tensor argument in place without "
            "ctx.mark_dirty", watch.unmarked,
            "PyTorch's autograd does not see that change, and the traced graph would repeat it after the Function "
            "(torch.autograd.Function.mark_dirty). Mark the argument dirty and return it, or make the change out "
            "of place")
    _refuse(f"{what} reads a tensor's value into Python", watch.value_reads,
            "the exported graph would keep what that value was while tracing as a constant (Python control "
            "flow on tensor values). Compute with tensors instead (torch.where, masks)")
    # A size turned into a Python number becomes a constant: where any code did that, trace
    # again with one more row (and, for integer inputs such as token ids, one more column).
    sized = static
    if static is None and any(issubclass(w.category, torch.jit.TracerWarning) and _TO_NUMBER.search(str(w.message)) for w in caught):
        try:
            other, _, _ = _trace(module, [_other_sizes(x) for x in leaves], spec, False, ops=ops)
        except ExportError:
            other = None  # the module takes no other sizes: nothing to compare
        if other is not None and _structure(other) != _structure(data):
            sized = "a graph traced with other input sizes differs"
    for place in dict.fromkeys(watch.stops):
        logger.info("ORTModule: export of %s: no gradient flows through %s", what, place)
    model = onnx.load_from_string(data)
    exported = _exported(model, module, leaves, flat, sized)
    exported.calls = _with_changes(watch, what)
    exported.guards = watch.guards
    for guard in watch.guards:
        logger.info("ORTModule: %s reads the value of its tensor argument %d at %s (Tensor.%s): the exported graph "
                    "holds for calls that read the same, another value exports again", what, guard.index,
                    guard.where, guard.method)
    exported.torch_exported = data if keep_torch_export else None
    return exported


def _with_changes(watch: _Watch, what: str) -> list:
    """``watch.calls`` with the in-place changes each Function made while traced: the Functions
    applied, in the order they ran, are those of the break nodes, in graph order."""
    functions = [c for c in watch.calls if isinstance(c.function, type)]
    if [c.function for c in functions] == [cls for cls, _ in watch.applied]:
        for call, (_, changes) in zip(functions, watch.applied):
            call.changes = changes
    elif any(changes for _, changes in watch.applied):
        cls = next(cls for cls, changes in watch.applied if changes)
        raise ExportError(f"{what} applies the torch.autograd.Function {cls.__module__}.{cls.__qualname__}, which "
                          "changes a tensor argument in place, and the traced graph does not hold every Function "
                          "applied in the order they ran, so the graph breaks cannot keep that change in its place: "
                          "make the change out of place, or pass fallback=True to ORTModule to run the module in "
                          "PyTorch")
    return watch.calls


def _refuse(what: str, places: list[str], why: str) -> None:
    """ExportError for ``what`` done at ``places`` (none: nothing to refuse)."""
    if places:
        more = f" (and {len(places) - 1} more places)" if len(places) > 1 else ""
        raise ExportError(f"{what} at {places[0]}{more}: {why}, or pass fallback=True to ORTModule to run the "
                          "module in PyTorch")


def _trace(module, leaves, spec, verbose: bool, watch: _Watch | None = None, ops: frozenset = frozenset(),
           dynamic: bool = True):
    """torch.onnx.export of the call with these leaves (``ops``: operations that run in PyTorch,
    as graph breaks; ``dynamic``: every size of the inputs symbolic, else the call's): the model
    bytes, the warnings, and the wrapper that recorded the output's structure."""
    tensors = tuple(x for x in leaves if isinstance(x, torch.Tensor))
    names = [f"input_{i}" for i in range(len(tensors))]
    watch = watch or _Watch()
    flat = _Flat(module, leaves, spec, watch)
    flat.training = module.training  # the exporter restores the wrapper's mode on its children
    f = io.BytesIO()
    mode = torch.onnx.TrainingMode.TRAINING if module.training else torch.onnx.TrainingMode.EVAL
    # torch's exporter prints its whole graph to stdout when an export fails, verbose or not
    # (its logging switch reads a function as a flag); the error says what failed
    quiet = contextlib.nullcontext() if verbose else unittest.mock.patch.object(torch._C, "_jit_onnx_log",
                                                                               lambda *args: None)
    with _TRACING, warnings.catch_warnings(record=True) as caught, _untouched(module), _watching(watch), \
            _breaking_at_functions(watch, ops), converting(module), quiet:
        warnings.simplefilter("always")
        try:
            torch.onnx.export(
                flat, tensors, f, input_names=names, dynamo=False, opset_version=OPSET, training=mode,
                # the parameters and buffers as inputs without their values: they are fed from the
                # module, and a module over 2 GB exports as one of 2 KB
                do_constant_folding=False, keep_initializers_as_inputs=True, export_params=False, verbose=verbose,
                dynamic_axes={n: {d: f"{n}_dim{d}" for d in range(t.dim())} for n, t in zip(names, tensors)}
                if dynamic else None)
        except Exception as exc:  # the exporter raises many types; all mean the same to the user
            raise ExportError(
                f"torch.onnx.export (TorchScript exporter, opset {OPSET}) could not export {type(module).__name__}: "
                f"{type(exc).__name__}: {_first_lines(str(exc))}. If an operator is unsupported, rewrite that "
                "part of the module with supported operators, pass graph_breaks=True to ORTModule to run it in "
                "PyTorch between onnxruntime graphs, or fallback=True to run the module in PyTorch") from exc
    return f.getvalue(), list(caught), flat


def _other_sizes(x):
    """One more row (the last repeated), and one more column for integer and boolean tensors."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] == 0:
        return x
    x = torch.cat([x, x[-1:]], dim=0)
    if x.dim() >= 2 and x.shape[1] > 0 and not (x.is_floating_point() or x.is_complex()):
        x = torch.cat([x, x[:, -1:]], dim=1)
    return x.detach()


def _structure(data: bytes) -> list[bytes]:
    """The graph's operators with their attributes and constants, without names or order
    (both may change between two traces of the same code)."""
    graph = onnx.load_from_string(data).graph
    parts = []
    for n in graph.node:
        attrs = sorted(a.SerializeToString() for a in n.attribute)
        parts.append(n.op_type.encode() + n.domain.encode() + b"".join(attrs))
    parts += [t.raw_data or t.SerializeToString() for t in graph.initializer if not t.name.startswith("inner.")]
    return sorted(parts)


def _exported(model: onnx.ModelProto, module, leaves, flat: _Flat, sized: str | None) -> Exported:
    """Parameters and buffers as inputs without initializers; the running statistics."""
    names = [f"input_{i}" for i in range(sum(isinstance(x, torch.Tensor) for x in leaves))]
    state = _state_names(module)
    inits = {t.name for t in model.graph.initializer}
    fed = {n: state[n.removeprefix("inner.")] for n in [*inits, *(i.name for i in model.graph.input)]
           if n.removeprefix("inner.") in state}
    kept = [t for t in model.graph.initializer if t.name not in fed]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    inputs = [i for i in model.graph.input if i.name in fed or i.name in names]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    stops = _gradient_stops(model)
    model, running, counters = _running_stats(model, fed, module)
    stops += _embedding_padding(model, fed, module)
    _drop_zero_dropouts(model)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    fixed = sized or _fixed_sizes(model, {d for t in tensors for d in t.shape if d > 1})
    if fixed:  # the graph serves these sizes only: say so, and the gradient graph is static
        for i in model.graph.input:
            if i.name in names:
                for dim, size in zip(i.type.tensor_type.shape.dim, tensors[names.index(i.name)].shape):
                    dim.Clear()
                    dim.dim_value = size
        del model.graph.value_info[:]  # the tracer's symbolic shapes: inferred again from the inputs
    return Exported(model=model, inputs={n: names.index(n) for n in names if n in {i.name for i in inputs}},
                    state=fed, outputs=[o.name for o in model.graph.output if not o.name.startswith(RUNNING)],
                    out_spec=flat.out_spec, out_leaves=flat.out_leaves, differentiable=flat.differentiable,
                    running=running, batch_counters=counters,
                    fixed_sizes=fixed, stop_gradients=stops, shapes=tuple(tuple(t.shape) for t in tensors))


def _drop_zero_dropouts(model: onnx.ModelProto) -> None:
    """A training-mode Dropout with a constant ratio of 0 (``nn.Dropout(0.0)``, HF configs with
    dropout off) is the identity: its readers read its input instead, so that no mask is drawn,
    saved or read."""
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in model.graph.node
           for a in n.attribute):
        return  # subgraphs could read a Dropout's output by name
    constant = {n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node
                if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"}
    constant.update({t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer})
    read = {x for n in model.graph.node for x in n.input} | {o.name for o in model.graph.output}
    dropped: dict[str, str] = {}  # output -> input
    for node in model.graph.node:
        if node.op_type != "Dropout" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        ratio = constant.get(node.input[1])
        if ratio is None or ratio.size != 1 or float(ratio) != 0.0 or any(o in read for o in node.output[1:]):
            continue
        dropped[node.output[0]] = node.input[0]
    if not dropped:
        return
    outputs = {o.name for o in model.graph.output}
    kept = []
    for node in model.graph.node:
        if node.op_type == "Dropout" and node.output[0] in dropped:
            if node.output[0] in outputs:  # a graph output keeps its name
                kept.append(onnx.helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name))
            continue
        for i, x in enumerate(node.input):
            while x in dropped:
                x = dropped[x]
            node.input[i] = x
        kept.append(node)
    del model.graph.node[:]
    model.graph.node.extend(kept)


def _embedding_padding(model: onnx.ModelProto, fed: dict[str, str], module) -> list[str]:
    """``nn.Embedding(padding_idx=p)`` gives row p no gradient; its export is a plain Gather.
    Each Gather of such a weight becomes Where(ids == p, Gather(stop-gradient copy of the
    weight, ids), Gather(weight, ids)): the same values, and row p gets no gradient from it
    (a tied weight still gets the gradient of its other uses). Returns the copies' names."""
    h = onnx.helper
    padding = {f"{name}.weight" if name else "weight": m.padding_idx for name, m in module.named_modules()
               if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None}
    weight_of = {graph_name: padding[param] for graph_name, param in fed.items() if param in padding}
    if not weight_of:
        return []
    nodes, stops = [], []
    for node in model.graph.node:
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if node.op_type != "Gather" or node.input[0] not in weight_of or axis != 0:
            nodes.append(node)
            continue
        w, ids, out = node.input[0], node.input[1], node.output[0]
        p = f"{node.name or out}/padding"
        pad = weight_of[w]
        nodes += [
            h.make_node("Gather", [w, ids], [p + "_rows"], name=node.name),
            h.make_node("Identity", [w], [p + "_weight_nograd"]),
            h.make_node("Gather", [p + "_weight_nograd", ids], [p + "_rows_nograd"]),
            h.make_node("Constant", [], [p + "_idx"], value=h.make_tensor(p + "_idx_t", onnx.TensorProto.INT64, [], [pad])),
            h.make_node("CastLike", [p + "_idx", ids], [p + "_idx_x"]),
            h.make_node("Equal", [ids, p + "_idx_x"], [p + "_is_pad"]),
            h.make_node("Constant", [], [p + "_last"], value=h.make_tensor(p + "_last_t", onnx.TensorProto.INT64, [1], [-1])),
            h.make_node("Unsqueeze", [p + "_is_pad", p + "_last"], [p + "_is_pad_u"]),
            h.make_node("Where", [p + "_is_pad_u", p + "_rows_nograd", p + "_rows"], [out]),
        ]
        stops.append(p + "_weight_nograd")
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return stops


# Inputs that take a shape, or positions along one.
_SHAPE_INPUTS = {"Reshape": (1,), "Expand": (1,), "Tile": (1,), "ConstantOfShape": (0,), "Range": (0, 1, 2),
                 "Slice": (1, 2), "Resize": (3,), "Upsample": (1,), "Pad": (1,)}
_SHAPE_ARITHMETIC = {"Concat", "Unsqueeze", "Squeeze", "Cast", "Mul", "Add", "Sub", "Div", "Identity"}


def _fixed_sizes(model: onnx.ModelProto, sizes: set[int]) -> str | None:
    """Where the tracer turned an input size into a constant: a constant equal to one of the
    traced inputs' sizes (other than 1) that reaches a shape input through shape
    arithmetic. torch's MultiheadAttention, for one, reshapes with the traced sequence
    length as a number. None when there is none."""
    producer = {o: n for n in model.graph.node for o in n.output}
    inits = {t.name: t for t in model.graph.initializer}

    def constants(name, depth=0):
        node = producer.get(name)
        if name in inits:
            yield onnx.numpy_helper.to_array(inits[name])
        elif node is not None and node.op_type == "Constant" and node.attribute[0].name == "value":
            yield onnx.numpy_helper.to_array(node.attribute[0].t)
        elif node is not None and node.op_type in _SHAPE_ARITHMETIC and depth < 8:
            for i in node.input[:1] if node.op_type in ("Unsqueeze", "Squeeze") else node.input:
                yield from constants(i, depth + 1)

    for node in model.graph.node:
        for index in _SHAPE_INPUTS.get(node.op_type, ()):
            if index < len(node.input) and node.input[index]:
                for value in constants(node.input[index]):
                    hit = sorted(sizes & {int(v) for v in value.ravel().tolist()}) if value.dtype.kind in "iu" else []
                    if hit:
                        return f"node '{node.name}' ({node.op_type}) takes the traced size {hit[0]} as a constant"
    return None


@contextlib.contextmanager
def _untouched(module: torch.nn.Module):
    """Tracing runs the module: put back the buffers it updates (BatchNorm's running
    statistics) and the random generators' states it advances (dropout)."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    cpu = torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


# Tensor methods that hand a tensor's value to Python.
_TO_PYTHON = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__complex__")
# Those that may read a (small) tensor of the call itself: the graph is kept for that value only.
_GUARDED = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__"})
_GUARDED_SIZE = 4096
# Traced operators whose result depends on their input's shape only.
_SHAPE_OPS = frozenset({"aten::size", "aten::sym_size", "aten::numel", "aten::dim", "aten::_shape_as_tensor",
                        "aten::len", "prim::shape"})


@dataclasses.dataclass
class _Watch:
    """What the module's code did while it was traced (each entry says what and where)."""

    value_reads: list[str] = dataclasses.field(default_factory=list)
    guards: list[Guard] = dataclasses.field(default_factory=list)  # values of the call's tensors read
    inputs: list = dataclasses.field(default_factory=list)  # (tensor, version) of the call's tensors
    stops: list[str] = dataclasses.field(default_factory=list)  # where a gradient was cut
    in_place: list[str] = dataclasses.field(default_factory=list)  # changes autograd does not see
    calls: list = dataclasses.field(default_factory=list)  # the Functions applied, as FunctionBreak nodes
    applied: list = dataclasses.field(default_factory=list)  # (Function, tensor arguments it changed), in order
    unmarked: list[str] = dataclasses.field(default_factory=list)  # Functions changing an argument unmarked
    inside: int = 0  # > 0 while a Function's own forward runs: PyTorch runs it, nothing to watch


@contextlib.contextmanager
def _watching(watch: _Watch):
    """Record, into ``watch``, the places where the traced code hands a tensor's value to
    Python.

    The tensor methods that turn a value into a Python object (``_TO_PYTHON``) are replaced on
    ``torch.Tensor`` for the duration of the trace; the replacements record only on the tracing
    thread (the tracer's state is per thread) and then call the originals. A conversion counts
    when the traced value depends on the values of the graph inputs (the call's tensors,
    parameters, buffers) or on random numbers; one computed from sizes only (``int(x.shape[0])``)
    does not: other sizes are checked by tracing again (see ``export``)."""
    def conversion(name, original):
        def method(self, *args, **kwargs):
            if torch._C._get_tracing_state() is None or watch.inside:
                return original(self, *args, **kwargs)
            index = next((i for i, (t, version) in enumerate(watch.inputs)
                          if t is self and t._version == version), None)
            if index is not None and name in _GUARDED and not args and not kwargs \
                    and self.numel() <= _GUARDED_SIZE:
                value = original(self)
                watch.guards.append(Guard(index, name, value, _where(sys._getframe(1))))
                return value
            if _reads_values(self):
                watch.value_reads.append(f"{_where(sys._getframe(1))} (Tensor.{name})")
            return original(self, *args, **kwargs)
        return method

    replaced = [(torch.Tensor, name, conversion(name, getattr(torch.Tensor, name))) for name in _TO_PYTHON]
    saved = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in replaced]
    try:
        for owner, name, value in replaced:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            if value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


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


def _break_node(g, node, watch: _Watch, call: FunctionCall, values: list):
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
def _breaking_at_functions(watch: _Watch, ops: frozenset = frozenset()):
    """While tracing, each application of a ``torch.autograd.Function`` (other than ours) is
    exported as one ``STOP_DOMAIN::FunctionBreak`` node (attribute ``index`` into
    ``watch.calls``) instead of its forward inlined; its forward runs as usual to trace what
    follows, with ``watch.inside`` counting (what it does is PyTorch's to run, not ours to watch).
    So is each call of the operations ``ops`` (``aten::diff``, ...: ``graph_breaks=True``)."""
    def symbolic(g, *args, **kwargs):
        node = g.original_node
        cls = getattr(node.pyobj(), "__self__", None)
        values = [a for a in args if isinstance(a, torch._C.Value)]
        if cls is _StopGradient:
            return _StopGradient.symbolic(g, *values, *node.scalar_args())
        return _break_node(g, node, watch, FunctionCall(cls, node.cconv(), list(node.scalar_args()),
                                                        _traced_at(node)), values)

    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if cls is _StopGradient or torch._C._get_tracing_state() is None or watch.inside:
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
            watch.unmarked.append(f"{_where(sys._getframe(1))} ({cls.__module__}.{cls.__qualname__}.apply)")
        # an output PyTorch gives no gradient (grad mode off, mark_non_differentiable) is marked
        # as _GradientStops marks one: no gradient flows through it in the graphs after the break
        if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves((args, kwargs))):
            return result

        def cut(t):
            return isinstance(t, torch.Tensor) and t.is_floating_point() and not t.requires_grad

        if not any(cut(t) for t in pytree.tree_leaves(result)):
            return result
        where = (f"{_where(sys._getframe(1))} ({cls.__qualname__}.apply"
                 f"{'' if torch.is_grad_enabled() else ' with grad mode off'})")
        watch.stops.append(where)
        return pytree.tree_map_only(torch.Tensor, lambda t: _StopGradient.apply(t, where) if cut(t) else t, result)

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
    watch: _Watch | None = None
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
    chosen as ``_where`` chooses."""
    first = None
    for line in node.sourceRange().splitlines():
        frame = _FRAME.match(line.strip())
        if frame is None:
            continue
        file, lineno, function = frame.groups()
        if file == _Flat.forward.__code__.co_filename and function == "forward":
            break  # the traced call itself
        path = os.path.abspath(file)
        if not path.startswith(_PACKAGE_DIR):
            first = first or f"{file}:{lineno}"
            if not path.startswith(_TORCH_DIR):
                return f"{file}:{lineno}"
    return first or "an unknown place"


# max and min: along a dimension they return (values, indices)
_WITH_INDICES = frozenset({torch.max, torch.min, torch.Tensor.max, torch.Tensor.min})


def _at_indices(args, kwargs, result):
    """The ``(values, indices)`` of max or min along a dimension with the values gathered at
    the indices; any other ``result`` as it is. The tracer exports the values as ReduceMax,
    whose gradient splits among ties, where PyTorch sends the whole gradient to the returned
    index: values gathered at the indices (ArgMax and GatherElements) have PyTorch's gradient."""
    x = args[0] if args else kwargs.get("input")
    if not isinstance(result, tuple) or not isinstance(x, torch.Tensor) or x.dim() == 0 or "out" in kwargs:
        return result  # the whole tensor, elementwise, or into given tensors
    values, indices = result
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    picked = indices if values.dim() == x.dim() else indices.unsqueeze(dim)
    gathered = x.gather(dim, picked)
    return type(result)((gathered if values.dim() == x.dim() else gathered.squeeze(dim), indices))


class _StopGradient(torch.autograd.Function):
    """The identity, traced as the node ``STOP_DOMAIN::StopGradient`` (attribute ``where``: the
    place that cut the gradient), which ``_gradient_stops`` turns into an Identity no gradient
    flows through. Applied only to tensors that do not require grad."""

    @staticmethod
    def forward(ctx, x, where):
        # a copy, not a view: code may write into the result in place with grad on
        # (``new_empty`` then ``copy_`` of slices), which autograd forbids on a Function's view
        return x.clone()

    @staticmethod
    def symbolic(g, x, where):
        out = g.op(f"{STOP_DOMAIN}::StopGradient", x, where_s=where)
        out.setType(x.type())
        return out


_DATA = torch.Tensor.data.__get__  # equal (==) to the getter a TorchFunctionMode sees for ``t.data``


class _GradientStops(TorchFunctionMode):
    """Active while the module's forward is traced with grad enabled. Where PyTorch's autograd
    cuts a gradient, the result is marked with ``_StopGradient``: a floating tensor that does
    not require grad although an input of the call that made it does. That is
    ``detach()``, ``torch.detach``, ``.data``, ``detach_()`` and every call made with grad mode
    off (``torch.no_grad()``, ``torch.set_grad_enabled(False)``, ``torch.inference_mode()``);
    calls that make new tensors (``zeros_like``) are marked too, harmlessly. ``detach_()`` has
    the tensor's traced value replaced by the mark. An in-place change with grad off
    (``buffer.copy_(y)``) reads marks of the tensors that require grad. Recorded in
    ``watch.in_place`` instead: one of a tensor that requires grad (PyTorch's gradient does not
    see it), and one of a view from a tensor that requires grad (the mark would come between
    the view and the write, and the exporter drops such a write). ``torch.max``/``torch.min``
    along a dimension return their values gathered at their indices (``_at_indices``), however
    the module's code reached them.

    ``t.data`` is traced as ``t.detach()`` (the tracer would keep its value as a constant).
    A Python function that handles the mode itself (``F.multi_head_attention_forward``) is one
    call: cuts inside it are not seen."""

    def __init__(self, watch: _Watch):
        super().__init__()
        self.watch = watch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Every call runs from this one line. The tracer records each node with the Python
        # stack that ran it, and torch's ONNX exporter resolves in-place writes into views
        # (``out[..., :4].copy_(a)``, then ``out[..., 4:].copy_(b)``) wrongly when the nodes
        # involved were recorded from different lines here: it drops one of the writes.
        func, args, kwargs, finish = self._around(func, args, kwargs or {})
        return finish(func(*args, **kwargs))

    def _around(self, func, args, kwargs):
        """What to call, with which arguments, and what to do with its result."""
        if torch._C._get_tracing_state() is None or self.watch.inside:
            return func, args, kwargs, _as_it_is
        data = func == _DATA
        if data:
            func = torch.Tensor.detach
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not any(t.requires_grad for t in inputs):
            return func, args, kwargs, _as_it_is
        what = "Tensor.data" if data else _call_name(func)
        grad = torch.is_grad_enabled()
        where = None

        def cut(t):
            return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and not t.requires_grad

        def mark(t):
            nonlocal where
            if where is None:
                where = f"{_where(sys._getframe(1))} ({what}{'' if grad else ' with grad mode off'})"
                self.watch.stops.append(where)
            return _StopGradient.apply(t, where)

        changed = _changed_in_place(func, args, kwargs)
        if changed and not grad:
            if any(t.requires_grad for t in changed):
                self.watch.in_place.append(f"{_where(sys._getframe(1))} ({what} of a tensor that requires grad)")
                return func, args, kwargs, _as_it_is
            if any(t._base is not None for t in changed):
                # the exporter drops a write into a view taken before its source is computed
                self.watch.in_place.append(f"{_where(sys._getframe(1))} ({what} of a view, from a tensor that "
                                           "requires grad)")
                return func, args, kwargs, _as_it_is
            # what it writes comes from marks of the tensors that require grad
            args, kwargs = pytree.tree_map_only(
                torch.Tensor, lambda t: mark(t.detach()) if t.requires_grad else t, (args, kwargs))
            return func, args, kwargs, _as_it_is

        def new_cut(t):
            return cut(t) and not any(t is i for i in inputs)

        def finish(result):
            if func in _WITH_INDICES:
                result = _at_indices(args, kwargs, result)
            for t in changed:  # detach_()
                if cut(t):
                    torch._C._set_value_trace(t, torch._C._get_value_trace(mark(t)))
            if not any(new_cut(t) for t in pytree.tree_leaves(result)):
                return result  # as it is (a torch.Size stays one)
            return pytree.tree_map_only(torch.Tensor, lambda t: mark(t) if new_cut(t) else t, result)

        return func, args, kwargs, finish


def _as_it_is(result):
    return result


def _call_name(func) -> str:
    """``Tensor.detach``, ``torch.norm``, ``Tensor.data``: how the module's code names ``func``."""
    owner = getattr(func, "__self__", None)
    if isinstance(owner, type(torch.Tensor.data)):  # a property's getter
        return f"Tensor.{owner.__name__}"
    qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    for prefix, public in (("TensorBase.", "Tensor."), ("_VariableFunctionsClass.", "torch.")):
        if qualname.startswith(prefix):
            return public + qualname.removeprefix(prefix)
    module = getattr(func, "__module__", None) or "torch"
    if module.startswith("torch._C"):  # torch's bindings: named as the public modules name them
        module = "torch.nn.functional" if module == "torch._C._nn" else "torch"
    return qualname if "." in qualname else f"{module}.{qualname}"


def _changed_in_place(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors ``func`` writes: its first argument for a method named ``x_``, ``__ix__``
    or ``__setitem__``, and ``out=``."""
    name = getattr(func, "__name__", "")
    written = []
    if args and isinstance(args[0], torch.Tensor) and (
            name.endswith("_") and not name.startswith("__") or name.startswith("__i") or name == "__setitem__"):
        written.append(args[0])
    written += [t for t in pytree.tree_leaves(kwargs.get("out")) if isinstance(t, torch.Tensor)]
    return written


def _reads_values(t: torch.Tensor) -> bool:
    """Whether the traced value of ``t`` depends on the values of the graph inputs or on random
    numbers, rather than only on shapes and constants."""
    try:
        pending = [torch._C._get_value_trace(t)]
    except RuntimeError:
        return False  # not traced: a constant
    seen = set()
    while pending:
        value = pending.pop()
        if value.unique() in seen:
            continue
        seen.add(value.unique())
        node = value.node()
        kind = node.kind()
        if kind in ("prim::Param", "prim::GetAttr") or kind.startswith("aten::") and node.isNondeterministic():
            return True
        if kind not in _SHAPE_OPS:
            pending.extend(node.inputs())
    return False


def _where(frame) -> str:
    """file:line of the module's code that made the call: the innermost frame outside torch and
    this package (whose wrappers it passes through, up to the traced forward), else the
    innermost one in torch (torch's own code)."""
    first = None
    while frame is not None and frame.f_code is not _Flat.forward.__code__:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_PACKAGE_DIR):
            first = first or frame
            if not path.startswith(_TORCH_DIR):
                return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return f"{first.f_code.co_filename}:{first.f_lineno}" if first is not None else "an unknown place"


def _state_names(module: torch.nn.Module) -> dict[str, str]:
    """Every name a parameter or buffer answers to (shared ones too) -> its first name."""
    first: dict[int, str] = {}
    names: dict[str, str] = {}
    for n, t in list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False)):
        names[n] = first.setdefault(id(t), n)
    return names


def _first_lines(text: str, n: int = 6) -> str:
    return " ".join(text.strip().splitlines()[:n])


def _gradient_stops(model: onnx.ModelProto) -> list[str]:
    """The traced marks of ``_StopGradient`` as Identity nodes (the place in their doc string);
    returns their outputs' names."""
    stops = []
    for i, node in enumerate(model.graph.node):
        if node.domain == STOP_DOMAIN and node.op_type == "StopGradient":
            where = next((a.s.decode() for a in node.attribute if a.name == "where"), "")
            model.graph.node[i].CopyFrom(onnx.helper.make_node("Identity", list(node.input), list(node.output),
                                                               name=node.name, doc_string=where))
            stops.append(node.output[0])
    kept = [o for o in model.opset_import if o.domain != STOP_DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    return stops


def _running_stats(model: onnx.ModelProto, fed: dict[str, str],
                   module) -> tuple[onnx.ModelProto, dict[str, str], list[str]]:
    """Each training-mode BatchNormalization's new running mean and variance (the variance
    unbiased, as in PyTorch) as graph outputs ``running/<buffer>``
    (``passes.running_stats.expose_running_statistics``); the model, graph output -> buffer,
    and the num_batches_tracked buffers beside them."""
    if not any(n.op_type == "BatchNormalization" for n in model.graph.node):
        return model, {}, []
    ir_model = to_ir(model)
    graph = ir_model.graph
    ctx = Context.of(ir_model, running_statistics=True, unbiased_variance=True)
    e = ctx.emitter
    running: dict[str, str] = {}
    counters: list[str] = []
    buffers = dict(module.named_buffers())
    expose_running_statistics(ir_model, ctx)
    for old, new in ctx.buffers:
        if old.name not in fed:  # a constant, not a buffer of the module
            continue
        buffer = fed[old.name]
        name = RUNNING + buffer
        if new.is_graph_output() or new.is_graph_input():
            new = e.Identity(new)
        new.name = name
        new.dtype, new.shape = old.dtype, ir.Shape(list(buffers[buffer].shape))
        graph.outputs.append(new)
        running[name] = buffer
        counter = buffer.removesuffix("running_mean") + "num_batches_tracked"  # the same module's
        if buffer.endswith("running_mean") and counter in buffers:
            counters.append(counter)
    return ir.to_proto(ir_model), running, counters
