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

The trace is watched and rewritten by the modules beside this one, one concept each:

- ``watch``: a tensor's value handed to Python (``.item()``, ``bool()``, ``int()``, ...), which
  a single exported graph cannot follow, and the place in the module's code that did it;
- ``function_calls``: each application of a ``torch.autograd.Function`` as one
  ``FunctionBreak`` node (``FunctionCall``), which PyTorch runs between the graphs around it
  (``breaks.py``);
- ``stops``: what cuts a gradient in PyTorch (``detach()``, a ``torch.no_grad()`` block, which
  the exporter drops) marked while the forward is traced with grad enabled, the marks turned
  into Identity nodes whose outputs are ``Exported.stop_gradients``; ``torch.max``/``torch.min``
  along a dimension take their values at their indices, as in PyTorch;
- ``conversions``: what the exporter lacks, traced as what it has;
- ``fixes``: the exported model fixed before it is differentiated (zero Dropouts, Embedding
  padding, the sizes it holds for, and training-mode BatchNormalization's running statistics
  as outputs ``running/<buffer name>``, computed as PyTorch does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import threading
import unittest.mock
import warnings

import onnx
import torch
import torch.utils._pytree as pytree

from ..errors import ExportError
from .conversions import converting
from .options import logger
from .fixes import RUNNING, drop_zero_dropouts, embedding_padding, fixed_sizes, running_stats
from .function_calls import breaking_at_functions
from .stops import GradientStops, gradient_stops
from .watch import FORWARD_CODES, Watch, watching

OPSET = 17




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


@dataclasses.dataclass(frozen=True)
class Output:
    """An output leaf that is a tensor: the graph output ``index`` of ``Exported.outputs``."""

    index: int


class _Flat(torch.nn.Module):
    """The module as a function of its call's tensor leaves, returning its output's distinct
    tensors; records the output's structure and which tensors require grad."""

    def __init__(self, module, leaves, spec, watch: Watch):
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
        stops = GradientStops(self._watch) if torch.is_grad_enabled() else contextlib.nullcontext()
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


FORWARD_CODES.add(_Flat.forward.__code__)


_UNSUPPORTED = re.compile(r"Exporting the operator '(aten::\w+)' to ONNX opset version \d+ is not supported")


_TO_NUMBER = re.compile(r"Converting a tensor to a Python (number|index|integer|list)")


_TRACING = threading.RLock()  # one trace at a time: watching replaces methods of torch's classes


def export(module: torch.nn.Module, leaves: list, spec, verbose: bool = False,
           keep_torch_export: bool = False, graph_breaks: bool = False) -> Exported:
    """The call exported. ``graph_breaks``: an operation torch's exporter cannot export runs in
    PyTorch between the graphs (as a Function does) instead of failing the export."""
    what = type(module).__name__
    watch = Watch()
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
            watch = Watch()
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


def _with_changes(watch: Watch, what: str) -> list:
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


def _trace(module, leaves, spec, verbose: bool, watch: Watch | None = None, ops: frozenset = frozenset(),
           dynamic: bool = True):
    """torch.onnx.export of the call with these leaves (``ops``: operations that run in PyTorch,
    as graph breaks; ``dynamic``: every size of the inputs symbolic, else the call's): the model
    bytes, the warnings, and the wrapper that recorded the output's structure."""
    tensors = tuple(x for x in leaves if isinstance(x, torch.Tensor))
    names = [f"input_{i}" for i in range(len(tensors))]
    watch = watch or Watch()
    flat = _Flat(module, leaves, spec, watch)
    flat.training = module.training  # the exporter restores the wrapper's mode on its children
    f = io.BytesIO()
    mode = torch.onnx.TrainingMode.TRAINING if module.training else torch.onnx.TrainingMode.EVAL
    # torch's exporter prints its whole graph to stdout when an export fails, verbose or not
    # (its logging switch reads a function as a flag); the error says what failed
    quiet = contextlib.nullcontext() if verbose else unittest.mock.patch.object(torch._C, "_jit_onnx_log",
                                                                               lambda *args: None)
    with _TRACING, warnings.catch_warnings(record=True) as caught, _untouched(module), watching(watch), \
            breaking_at_functions(watch, ops), converting(module), quiet:
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
    stops = gradient_stops(model)
    model, running, counters = running_stats(model, fed, module)
    stops += embedding_padding(model, fed, module)
    drop_zero_dropouts(model)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    fixed = sized or fixed_sizes(model, {d for t in tensors for d in t.shape if d > 1})
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


def _state_names(module: torch.nn.Module) -> dict[str, str]:
    """Every name a parameter or buffer answers to (shared ones too) -> its first name."""
    first: dict[int, str] = {}
    names: dict[str, str] = {}
    for n, t in list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False)):
        names[n] = first.setdefault(id(t), n)
    return names


def _first_lines(text: str, n: int = 6) -> str:
    return " ".join(text.strip().splitlines()[:n])
