"""ORTModule: a torch.nn.Module whose forward and backward run in onnxruntime."""

from __future__ import annotations

import inspect
import warnings

import onnxruntime as ort
import torch
import torch.utils._pytree as pytree

from ..errors import GradBuilderError, InvalidArgumentError
from .export import ExportError, export
from .options import DebugOptions, logger
from .runner import Compiled, ORTFunction

_S = ort.capi.onnxruntime_pybind11_state
_OrtFail = (RuntimeError, _S.Fail, _S.InvalidArgument, _S.RuntimeException)  # a failed onnxruntime run


class ORTModule(torch.nn.Module):
    """Wrap ``module`` so that its forward and backward run in onnxruntime:

    >>> model = ORTModule(model)                     # then train as before
    >>> loss = loss_fn(model(x), y); loss.backward(); optimizer.step()

    On the first call with a new input signature (tensor ranks, dtypes, devices and
    requires_grad, the non-tensor arguments, train/eval mode, which parameters require grad)
    the module is exported with torch's ONNX exporter and split into a forward graph and a
    backward graph (see ``gradbuilder.split``); later calls with that signature reuse them,
    whatever their batch and sequence sizes. Parameters and buffers stay the wrapped module's
    own tensors: ``parameters()``, ``state_dict()``, ``load_state_dict()``, ``to()``, optimizers and
    schedulers work on them unchanged. Forward and backward hooks on the ORTModule itself run; hooks on
    inner modules do not (their code runs in onnxruntime).

    ``fallback=True`` runs the module in PyTorch, with a warning, for a signature whose export or
    gradient graph fails; by default that raises an error naming the operator or construct.
    ``session_options`` (an ``onnxruntime.SessionOptions``) is copied for both sessions.

    Wrap before ``DistributedDataParallel``: ``DDP(ORTModule(model))``. ``torch.nn.DataParallel``
    is not supported.
    """

    def __init__(self, module: torch.nn.Module, debug_options: DebugOptions | None = None, *,
                 fallback: bool = False, session_options=None):
        if isinstance(module, torch.nn.DataParallel):
            raise InvalidArgumentError(_DATA_PARALLEL)
        if isinstance(module, ORTModule):
            raise InvalidArgumentError("the module is already an ORTModule")
        if not isinstance(module, torch.nn.Module):
            raise InvalidArgumentError(f"ORTModule wraps a torch.nn.Module, got {type(module).__name__}")
        super().__init__()
        self.module = module
        self._debug = debug_options if debug_options is not None else DebugOptions()
        self._debug.apply_logging()
        self._fallback = bool(fallback)
        self._session_options = session_options
        self._compiled: dict = {}  # signature -> Compiled, "fallback", or {input shapes: Compiled}
        self._exports = 0

    # ------------------------------------------------------------------ the module's face
    def forward(self, *args, **kwargs):
        _refuse_data_parallel(self)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        params = dict(self.module.named_parameters())
        buffers = dict(self.module.named_buffers())
        device = _device_of(leaves, params, buffers)
        needs_grad = torch.is_grad_enabled() and (
            any(p.requires_grad for p in params.values())
            or any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves))
        key = _signature(leaves, spec, self.module.training, needs_grad, params, device)
        shapes = _shapes(leaves)
        compiled = self._compiled.get(key)
        if isinstance(compiled, dict):  # a graph per input shape (see below)
            compiled = compiled.get(shapes)
        if compiled is None:
            compiled = self._compile(leaves, spec, params, needs_grad, device)
            if compiled != "fallback" and compiled.exported.fixed_sizes:
                self._per_shape(key, compiled.exported.fixed_sizes)[shapes] = compiled
            else:
                self._compiled[key] = compiled
        if compiled == "fallback":
            return self.module(*args, **kwargs)
        try:
            return self._call(compiled, leaves, params, buffers)
        except _OrtFail as exc:
            if compiled.exported.shapes == shapes:
                raise
            # The graph fixed a size our check did not see: compile for this shape and retry.
            self._per_shape(key, f"onnxruntime failed on input shapes {list(shapes)} with the graph traced for "
                                 f"{list(compiled.exported.shapes)}: {str(exc).splitlines()[0][:300]}")
            return self.forward(*args, **kwargs)

    def _per_shape(self, key, why: str) -> dict:
        """Make the signature ``key`` compile once per input shape; its graphs so far stay with the
        shape they were traced for."""
        entry = self._compiled.get(key)
        if not isinstance(entry, dict):
            logger.info("ORTModule: the exported graph of %s holds only for the traced input sizes (%s); it is "
                        "exported again for each new input shape", type(self.module).__name__, why)
            self._compiled[key] = {} if entry is None else {entry.exported.shapes: entry}
        return self._compiled[key]

    def _compile(self, leaves, spec, params, needs_grad, device):
        number = self._exports
        self._exports += 1
        logger.info("ORTModule: exporting %s for a new input signature (%d so far)", type(self.module).__name__, number)
        try:
            with torch.no_grad():
                exported = export(self.module, leaves, spec, verbose=self._debug.log_level == 0)
            wrt = []
            if needs_grad:
                tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
                wrt = [n for n, i in exported.inputs.items()
                       if tensors[i].requires_grad and tensors[i].is_floating_point()]
                wrt += [n for n, s in exported.state.items() if s in params and params[s].requires_grad]
            return Compiled(exported, wrt, device, self._debug, number, self._session_options)
        except GradBuilderError as exc:
            if not self._fallback:
                if isinstance(exc, ExportError):
                    raise
                raise type(exc)(f"ORTModule({type(self.module).__name__}): {exc}. Pass fallback=True to ORTModule "
                                "to run the module in PyTorch") from exc
            warnings.warn(f"ORTModule: running {type(self.module).__name__} in PyTorch for this input signature: "
                          f"{exc}", RuntimeWarning, stacklevel=4)
            return "fallback"

    @property
    def exports(self) -> int:
        """How many times the module was exported (one per input signature, or per input shape
        where the exported graph fixed a size)."""
        return self._exports

    def _call(self, compiled: Compiled, leaves, params, buffers):
        ex = compiled.exported
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        state = {**params, **buffers}
        names = list(ex.inputs) + list(ex.state)
        values = [tensors[i] for i in ex.inputs.values()] + [state[s] for s in ex.state.values()]
        outs = ORTFunction.apply(compiled, names, *values)
        n = len(ex.outputs)
        if ex.running and self.module.training:
            with torch.no_grad():
                for value, out in zip(outs[n:], ex.running):
                    buffers[ex.running[out]].copy_(value)
                for counter in ex.batch_counters:
                    buffers[counter].add_(1)
        it = iter(outs[:n])
        flat = [next(it) if x is None else x for x in ex.out_leaves]
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


def _signature(leaves, spec, training: bool, needs_grad: bool, params, device) -> tuple:
    parts = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            parts.append(("tensor", x.dim(), x.dtype, x.device, x.requires_grad))
        else:
            parts.append(("value", type(x).__name__, repr(x)))
    return (str(spec), tuple(parts), training, needs_grad, tuple(p.requires_grad for p in params.values()),
            tuple(p.dtype for p in params.values()), device)
