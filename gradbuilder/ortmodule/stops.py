"""Gradient stops while the forward is traced: where PyTorch's autograd cuts a gradient
(``detach()``, ``.data``, a block with grad off, ...), the value is marked (``StopGradient``) and
the mark becomes an Identity no gradient flows through (``gradient_stops``); ``torch.max`` /
``torch.min`` along a dimension give their values at their indices."""

from __future__ import annotations

import sys

import onnx
import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from .watch import Watch, code_place

STOP_DOMAIN = "gradbuilder.ortmodule"  # the traced marks of values no gradient flows through


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


class StopGradient(torch.autograd.Function):
    """The identity, traced as the node ``STOP_DOMAIN::StopGradient`` (attribute ``where``: the
    place that cut the gradient), which ``gradient_stops`` turns into an Identity no gradient
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


class GradientStops(TorchFunctionMode):
    """Active while the module's forward is traced with grad enabled. Where PyTorch's autograd
    cuts a gradient, the result is marked with ``StopGradient``: a floating tensor that does
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

    def __init__(self, watch: Watch):
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
                where = f"{code_place(sys._getframe(1))} ({what}{'' if grad else ' with grad mode off'})"
                self.watch.stops.append(where)
            return StopGradient.apply(t, where)

        changed = _changed_in_place(func, args, kwargs)
        if changed and not grad:
            if any(t.requires_grad for t in changed):
                self.watch.in_place.append(f"{code_place(sys._getframe(1))} ({what} of a tensor that requires grad)")
                return func, args, kwargs, _as_it_is
            if any(t._base is not None for t in changed):
                # the exporter drops a write into a view taken before its source is computed
                self.watch.in_place.append(f"{code_place(sys._getframe(1))} ({what} of a view, from a tensor that "
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


def gradient_stops(model: onnx.ModelProto) -> list[str]:
    """The traced marks of ``StopGradient`` as Identity nodes (the place in their doc string);
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
