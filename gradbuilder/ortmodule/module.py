"""ORTModule: a torch.nn.Module whose forward and backward run in onnxruntime."""

from __future__ import annotations

import copyreg

import collections
import contextlib
import inspect
import types
import warnings

import onnxruntime as ort
import torch
import torch.utils._pytree as pytree

from ..errors import ExportError, GradBuilderError, InvalidArgumentError
from .export import Output, export
from .options import DebugOptions, logger
from . import breaks
from .compiled import Compiled, ORTFunction

_S = ort.capi.onnxruntime_pybind11_state
_OrtFail = (RuntimeError, _S.Fail, _S.InvalidArgument, _S.RuntimeException)  # a failed onnxruntime run


class _ForwardAttribute:
    """``ORTModule.forward``: on an instance, its ``_Forward`` (made once, kept in the instance's
    ``__dict__``, so that an assignment replaces it); on the class, a plain function (tools such
    as transformers' ``find_labels`` inspect the class's ``forward``, which cannot know the
    wrapped module's arguments)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, instance, owner=None):
        if instance is None:
            return _forward_of_the_class
        made = instance.__dict__[self.name] = _Forward(instance)
        return made


def _forward_of_the_class(self, *args, **kwargs):
    """The ORTModule's call (see ``ORTModule``)."""
    return self.forward(*args, **kwargs)


class ORTModule(torch.nn.Module):
    """Wrap ``module`` so that its forward and backward run in onnxruntime:

    >>> model = ORTModule(model)                     # then train as before
    >>> loss = loss_fn(model(x), y); loss.backward(); optimizer.step()

    On the first call with a new input signature (tensor ranks, dtypes, devices and
    requires_grad, the non-tensor arguments, train/eval mode, which parameters require grad)
    the module is exported with torch's ONNX exporter and split into a forward graph and a
    backward graph (see ``gradbuilder.compiler.split``); later calls with that signature reuse them,
    whatever their batch and sequence sizes. Parameters and buffers stay the wrapped module's
    own tensors: ``parameters()``, ``state_dict()``, ``load_state_dict()``, ``to()``, optimizers and
    schedulers work on them unchanged; ``forward``'s signature is the module's; attributes set and
    parameters, buffers and modules registered on the ORTModule go to the module (and the next call
    compiles again). While wrapped, the module's own ``forward`` runs through the ORTModule too, so
    a method of the module that calls ``self(x)`` runs in onnxruntime. Forward and backward hooks
    on the ORTModule itself run; hooks on inner modules do not (their code runs in onnxruntime).

    A ``torch.autograd.Function`` the module applies runs in PyTorch with its own backward, between
    onnxruntime graphs cut around it (a graph break, see ``breaks``).
    ``graph_breaks=True`` does the same for an operation torch's exporter cannot export (it runs
    in PyTorch, with PyTorch's gradient, instead of failing the export). ``fallback=True`` runs
    the module in PyTorch, with a warning, for a signature whose export or gradient graph fails;
    by default that raises an error naming the operator or construct.
    ``session_options`` (an ``onnxruntime.SessionOptions``) is copied for both sessions.

    Wrap before ``DistributedDataParallel``: ``DDP(ORTModule(model))``. ``torch.nn.DataParallel``
    is not supported.
    """

    def __init__(self, module: torch.nn.Module, debug_options: DebugOptions | None = None, *,
                 fallback: bool = False, graph_breaks: bool = False, session_options=None):
        if isinstance(module, torch.nn.DataParallel):
            raise InvalidArgumentError(_DATA_PARALLEL)
        if isinstance(module, ORTModule):
            raise InvalidArgumentError("the module is already an ORTModule")
        if not isinstance(module, torch.nn.Module):
            raise InvalidArgumentError(f"ORTModule wraps a torch.nn.Module, got {type(module).__name__}")
        if isinstance(module.__dict__.get("forward"), _RoutedForward):
            raise InvalidArgumentError("the module is already wrapped by another ORTModule: wrap it once")
        super().__init__()
        self.module = module
        self._debug = debug_options if debug_options is not None else DebugOptions()
        self._debug.apply_logging()
        self._fallback = bool(fallback)
        self._graph_breaks = bool(graph_breaks)
        self._session_options = session_options
        self._compiled: dict = {}  # signature -> Compiled, "fallback", or {input shapes: Compiled}
        self._exports = 0
        self._saved_files = collections.Counter()  # debug files written, per mode
        self._running_module = False  # the module's own forward runs (tracing, fallback)
        self._loading_prefix = None
        module.forward = _RoutedForward(self, module.__dict__.get("forward"))
        self.register_load_state_dict_post_hook(_state_dict_names)

    # ------------------------------------------------------------------ the module's face
    # Runs the module's forward and backward in onnxruntime; its signature is the module's
    # forward's (tools read it: transformers' Trainer keeps the dataset columns it names).
    # Assigning ``forward`` replaces it, as on any module.
    forward = _ForwardAttribute()

    def _run(self, *args, **kwargs):
        _refuse_data_parallel(self)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        params = dict(self.module.named_parameters())
        buffers = dict(self.module.named_buffers())
        device = _device_of(leaves, params, buffers)
        needs_grad = torch.is_grad_enabled() and (
            any(p.requires_grad for p in params.values())
            or any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves))
        key = _signature(leaves, spec, self.module.training, needs_grad, params, buffers, device)
        shapes = _shapes(leaves)
        compiled = self._compiled.get(key)
        if isinstance(compiled, dict):  # a graph per input shape (see below)
            compiled = compiled.get(shapes)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if isinstance(compiled, list):  # graphs for the values the code read of its tensors
            compiled = next((c for c in compiled if c.exported.holds_for(tensors)), None)
        if compiled is None:
            compiled = self._compile(leaves, spec, params, needs_grad, device)
            if compiled != "fallback" and compiled.exported.fixed_sizes:
                slots, slot = self._per_shape(key, compiled.exported.fixed_sizes), shapes
            else:
                slots, slot = self._compiled, key
            slots[slot] = _joined(slots.get(slot), compiled)
        if compiled == "fallback":
            with self._module_runs():
                return self.module(*args, **kwargs)
        try:
            return self._call(compiled, leaves, params, buffers)
        except _OrtFail as exc:
            if compiled.exported.shapes == shapes:
                raise
            # The graph fixed a size our check did not see: compile for this shape and retry.
            self._per_shape(key, f"onnxruntime failed on input shapes {list(shapes)} with the graph traced for "
                                 f"{list(compiled.exported.shapes)}: {str(exc).splitlines()[0][:300]}")
            return self._run(*args, **kwargs)

    def _per_shape(self, key, why: str) -> dict:
        """Make the signature ``key`` compile once per input shape; its graphs so far stay with the
        shape they were traced for."""
        entry = self._compiled.get(key)
        if not isinstance(entry, dict):
            logger.info("ORTModule: the exported graph of %s holds only for the traced input sizes (%s); it is "
                        "exported again for each new input shape", type(self.module).__name__, why)
            table: dict = {}
            for held in [] if entry is None else entry if isinstance(entry, list) else [entry]:
                table[held.exported.shapes] = _joined(table.get(held.exported.shapes), held)
            self._compiled[key] = table
        return self._compiled[key]

    def _compile(self, leaves, spec, params, needs_grad, device):
        number = self._exports
        self._exports += 1
        what = type(self.module).__name__
        logger.info("ORTModule: exporting %s for a new input signature (%d so far)", what, number)
        training = self.module.training and torch.is_grad_enabled()  # the debug files' mode
        self._warn_constants(leaves, spec)
        try:
            # traced under the call's grad mode: the outputs then require grad as in PyTorch
            with torch.set_grad_enabled(needs_grad), self._module_runs():
                exported = export(self.module, leaves, spec, verbose=self._debug.log_level == 0,
                                  keep_torch_export=self._debug.save_onnx, graph_breaks=self._graph_breaks)
            wrt = []
            if needs_grad:
                tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
                wrt = [n for n, i in exported.inputs.items()
                       if tensors[i].requires_grad and tensors[i].is_floating_point()]
                wrt += [n for n, s in exported.state.items() if s in params and params[s].requires_grad]
            if exported.calls:  # graph breaks: onnxruntime between the Functions, PyTorch runs them
                steps = breaks.cut(exported, set(wrt))
                return breaks.Broken(exported, steps, lambda segment: Compiled(
                    segment.exported, segment.wrt if needs_grad else [], device, self._debug, number,
                    self._session_options, self._saved_files, training))
            return Compiled(exported, wrt, device, self._debug, number, self._session_options, self._saved_files,
                            training)
        except GradBuilderError as exc:
            if not self._fallback:
                if isinstance(exc, ExportError):
                    raise
                raise type(exc)(f"ORTModule({what}): {exc}. Pass fallback=True to ORTModule "
                                "to run the module in PyTorch") from exc
            warnings.warn(f"ORTModule: running {what} in PyTorch for this input signature: "
                          f"{exc}", RuntimeWarning, stacklevel=6)
            return "fallback"

    def _warn_constants(self, leaves, spec) -> None:
        """A str argument is part of the exported graph, not an input of it: say so."""
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        for path, value in pytree.tree_flatten_with_path((args, kwargs))[0]:
            if isinstance(value, str):
                where = ("args" if path[0].idx == 0 else "kwargs") + pytree.keystr(path[1:])
                warnings.warn(f"ORTModule: Received input of type {type(value)} which may be treated as a constant "
                              f"by ORT by default. {type(self.module).__name__} takes the str {value!r} ({where}): "
                              "the exported graph holds it as a constant, and each other value exports the module "
                              "again", UserWarning, stacklevel=7)

    @contextlib.contextmanager
    def _module_runs(self):
        """The module's own forward runs in PyTorch (tracing, fallback), not through the ORTModule."""
        running, self._running_module = self._running_module, True
        try:
            yield
        finally:
            self._running_module = running

    @property
    def exports(self) -> int:
        """How many times the module was exported (one per input signature, or per input shape
        where the exported graph fixed a size)."""
        return self._exports

    @property
    def compiled_graphs(self) -> types.MappingProxyType:
        """What the module was compiled to so far (read-only), per input signature: its
        ``Compiled`` (the forward and backward graphs and their sessions), ``"fallback"`` (it runs
        in PyTorch), a list of them (graphs for the values the code read of its tensors), or a
        dict of them per input shape (an export that holds for the traced sizes only)."""
        return types.MappingProxyType(self._compiled)

    def _call(self, compiled: Compiled | breaks.Broken, leaves, params, buffers):
        ex = compiled.exported
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        state = {**params, **buffers}
        names = list(ex.inputs) + list(ex.state)
        values = [tensors[i] for i in ex.inputs.values()] + [state[s] for s in ex.state.values()]
        if isinstance(compiled, breaks.Broken):
            env = compiled.run(dict(zip(names, values)))
            outs = [env[n] for n in ex.outputs] + [env[n] for n in ex.running]
        else:
            outs = ORTFunction.apply(compiled, names, *values)
        n = len(ex.outputs)
        if ex.running and self.module.training:
            with torch.no_grad():
                for value, out in zip(outs[n:], ex.running):
                    buffers[ex.running[out]].copy_(value)
                for counter in ex.batch_counters:
                    buffers[counter].add_(1)
        flat = [outs[x.index] if isinstance(x, Output) else x for x in ex.out_leaves]
        return pytree.tree_unflatten(flat, ex.out_spec)

    # Parameters, buffers and state_dict are the wrapped module's, under its own names.
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def _load_from_state_dict(self, state_dict, prefix, *args):
        # A parent's load_state_dict reaches the module as this ORTModule's child "module", while
        # state_dict() wrote its keys without that name: move them under it (and name missing keys
        # without it afterwards, in _state_dict_names).
        for key in [k for k in state_dict if k.startswith(prefix)]:
            state_dict[prefix + "module." + key[len(prefix):]] = state_dict.pop(key)
        self._loading_prefix = prefix
        super()._load_from_state_dict(state_dict, prefix, *args)

    # Attributes, parameters, buffers and modules given to the ORTModule are the module's.
    def __setattr__(self, name: str, value):
        if name == "module" and "module" in self._modules:
            raise InvalidArgumentError("ORTModule.module cannot be replaced: wrap the new module in a new ORTModule")
        if name.startswith("_") or name in ("module", "training") or hasattr(type(self), name) \
                or "module" not in self._modules:
            super().__setattr__(name, value)
        else:
            setattr(self.module, name, value)
            self._compiled.clear()  # the module's code may read it

    def register_buffer(self, name: str, tensor, persistent: bool = True) -> None:
        self.module.register_buffer(name, tensor, persistent)
        self._compiled.clear()

    def register_parameter(self, name: str, param) -> None:
        self.module.register_parameter(name, param)
        self._compiled.clear()

    def add_module(self, name: str, module) -> None:
        self.module.add_module(name, module)
        self._compiled.clear()

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_compiled"] = {}  # onnxruntime sessions are not copied: a copy compiles again
        return state

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self._modules.get("module")
            if module is None:
                raise
            return getattr(module, name)

    def _replicate_for_data_parallel(self):
        raise InvalidArgumentError(_DATA_PARALLEL)

    # A wrapped Hugging Face model counts as its class: transformers' Trainer saves with
    # save_pretrained (config.json beside the weights) only for an instance of PreTrainedModel,
    # and save_pretrained itself unwraps ``.module``. ``type()`` stays ORTModule; isinstance
    # also reads ``__class__``.
    @property
    def __class__(self):
        module = self.__dict__.get("_modules", {}).get("module")
        return type(module) if module is not None and _is_pretrained_model(module) else type(self)

    def __reduce_ex__(self, protocol):
        # copy and pickle rebuild an ORTModule, not the class __class__ names
        return copyreg.__newobj__, (type(self),), self.__getstate__()


def _is_pretrained_model(module) -> bool:
    """Whether ``module`` is a transformers PreTrainedModel (without importing transformers)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(module).__mro__)


class _Forward:
    """``ORTModule.forward``: calls the ORTModule's run, with the module's forward's signature."""

    def __init__(self, owner: ORTModule):
        self.owner = owner

    def __call__(self, *args, **kwargs):
        return self.owner._run(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.owner.module.forward)


class _RoutedForward:
    """The wrapped module's ``forward`` while it is wrapped: a call of the module (``self(x)`` in
    one of its methods) runs through the ORTModule, as with onnxruntime-training's ORTModule;
    the module's own forward (``own``: an instance attribute it had, else its class's) runs when
    the ORTModule runs it in PyTorch."""

    def __init__(self, owner: ORTModule, own=None):
        self.owner = owner
        self.own = own

    def _forward(self):
        module = self.owner.module
        return self.own if self.own is not None else type(module).forward.__get__(module)

    def __call__(self, *args, **kwargs):
        if self.owner._running_module:
            return self._forward()(*args, **kwargs)
        return self.owner(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self._forward())


def _joined(held, compiled):
    """What a slot of the signature cache holds once ``compiled`` is added: a graph kept for the
    values its code read of the call's tensors (``Exported.guards``) joins the others of the slot,
    in a list; any other replaces what the slot held."""
    if compiled != "fallback" and compiled.exported.guards:
        return (held if isinstance(held, list) else []) + [compiled]
    return compiled


def _state_dict_names(module: ORTModule, incompatible) -> None:
    """Missing keys under this ORTModule's child "module" are named as state_dict() names them."""
    prefix, module._loading_prefix = module._loading_prefix, None
    if prefix is not None:
        inner = prefix + "module."
        incompatible.missing_keys[:] = [prefix + k[len(inner):] if k.startswith(inner) else k
                                        for k in incompatible.missing_keys]


_DATA_PARALLEL = ("ORTModule does not support torch.nn.DataParallel; use "
                  "torch.nn.parallel.DistributedDataParallel, wrapped around the ORTModule: DDP(ORTModule(model))")


def _refuse_data_parallel(module: ORTModule) -> None:
    """DataParallel on a machine without GPUs calls its module directly (no replicate); find
    it on the call stack."""
    frame = inspect.currentframe()
    for _ in range(12):
        frame = frame.f_back if frame is not None else None
        if frame is None:
            return
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.DataParallel):
            raise InvalidArgumentError(_DATA_PARALLEL)


def _shapes(leaves) -> tuple:
    return tuple(tuple(x.shape) for x in leaves if isinstance(x, torch.Tensor))


def _device_of(leaves, params, buffers) -> torch.device:
    for t in list(params.values()) + list(buffers.values()) + [x for x in leaves if isinstance(x, torch.Tensor)]:
        return t.device
    return torch.device("cpu")


def _signature(leaves, spec, training: bool, needs_grad: bool, params, buffers, device) -> tuple:
    parts = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            parts.append(("tensor", x.dim(), x.dtype, x.device, x.requires_grad))
        else:
            parts.append(("value", type(x).__name__, repr(x)))
    state = tuple((n, p.requires_grad, p.dtype, p.shape) for n, p in params.items())
    return (str(spec), tuple(parts), training, needs_grad, state,
            tuple((n, b.dtype, b.shape) for n, b in buffers.items()), device)
