"""One compiled input signature: onnxruntime sessions for the forward and backward graphs,
and the autograd Function that runs them. Tensors cross between torch and onnxruntime as
DLPack views of the same memory, on CPU and CUDA alike."""

from __future__ import annotations

import onnx
import onnx_ir as ir
import onnxruntime as ort
import onnxruntime.capi._pybind_state as _C
import torch
from torch.autograd.function import once_differentiable

from .. import providers as _providers
from ..registry import FLOAT_TYPES
from ..split import SplitGraphs, build_split
from .export import Exported
from .options import DebugOptions, logger


_SPINNING = "session.intra_op.allow_spinning"


def to_ort(t: torch.Tensor) -> ort.OrtValue:
    t = t.detach().contiguous()
    if t.dtype == torch.bool:  # onnxruntime reads DLPack booleans as bytes flagged boolean
        return ort.OrtValue(_C.OrtValue.from_dlpack(t.view(torch.uint8).__dlpack__(), True))
    return ort.OrtValue.from_dlpack(t)


def to_torch(v: ort.OrtValue) -> torch.Tensor:
    out = torch.utils.dlpack.from_dlpack(v._ortvalue.to_dlpack())
    if v.data_type() == "tensor(bool)" and out.dtype != torch.bool:
        out = out.view(torch.bool)
    return out


def _providers_for(device: torch.device):
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        # onnxruntime works on PyTorch's current stream, so that each sees the other's writes
        # in order without a synchronization.
        stream = torch.cuda.current_stream(index).cuda_stream
        options = {"device_id": str(index), "has_user_compute_stream": "1", "user_compute_stream": str(stream)}
        return ["CUDAExecutionProvider", "CPUExecutionProvider"], [options, {}], ("cuda", index)
    return ["CPUExecutionProvider"], [{}], ("cpu", 0)


class Compiled:
    """The sessions of one signature. ``backward`` is None when no gradient is needed: the
    forward graph is then the exported model itself."""

    def __init__(self, exported: Exported, wrt: list[str], device: torch.device, debug: DebugOptions,
                 number: int, session_options: ort.SessionOptions | None = None):
        self.exported = exported
        providers, options, self.ort_device = _providers_for(device)
        so = _providers.options_with(session_options, log_severity_level=int(debug.log_level))
        try:
            so.get_session_config_entry(_SPINNING)
        except Exception:  # not set by the user
            # The forward and backward sessions and PyTorch take turns on the same cores: a
            # pool still spinning after its run slows the next one down (the benchmark
            # transformer's forward + backward took 1.5x as long).
            so.add_session_config_entry(_SPINNING, "0")
        self.split: SplitGraphs | None = None
        if wrt:
            self.split = build_split(exported.model, wrt, outputs=self._float_outputs(),
                                     stop_gradients=exported.stop_gradients)
            forward, backward = self.split.forward, self.split.backward
            for name in self.split.no_gradient:
                logger.info("ORTModule: the outputs do not depend on '%s': its gradient is None", name)
        else:
            forward, backward = exported.model, None
        if debug.save_onnx:
            for kind, proto in (("exported", exported.model), ("forward", forward), ("backward", backward)):
                if proto is not None:
                    onnx.save(proto, debug.path(f"{number}_{kind}"))
        self.forward_session = ort.InferenceSession(forward.SerializeToString(), so, providers=providers,
                                                    provider_options=options)
        self.backward_session = (None if backward is None else ort.InferenceSession(
            backward.SerializeToString(), so, providers=providers, provider_options=options))
        self.forward_inputs = [i.name for i in self.forward_session.get_inputs()]
        self.forward_outputs = [o.name for o in self.forward_session.get_outputs()]
        if backward is not None:
            self.backward_inputs = [i.name for i in self.backward_session.get_inputs()]
            self.backward_outputs = [o.name for o in self.backward_session.get_outputs()]
        logger.info("ORTModule: compiled signature %d (%d forward inputs, %d saved values, backward: %s)",
                    number, len(self.forward_inputs), len(self.split.saved) if self.split else 0, backward is not None)

    def _float_outputs(self) -> list[str]:
        types = {o.name: o.type.tensor_type.elem_type for o in self.exported.model.graph.output}
        return [n for n in self.exported.outputs if types.get(n) and ir.DataType(types[n]) in FLOAT_TYPES]

    # ------------------------------------------------------------------ running
    def _run(self, session, feeds: dict[str, ort.OrtValue], outputs: list[str]) -> dict[str, ort.OrtValue]:
        binding = session.io_binding()
        for name, value in feeds.items():
            binding.bind_ortvalue_input(name, value)
        kind, index = self.ort_device
        for name in outputs:
            binding.bind_output(name, kind, index)
        session.run_with_iobinding(binding)
        return dict(zip(outputs, binding.get_outputs()))

    def forward(self, feeds: dict[str, ort.OrtValue]) -> dict[str, ort.OrtValue]:
        return self._run(self.forward_session, {n: feeds[n] for n in self.forward_inputs}, self.forward_outputs)

    def backward(self, feeds: dict[str, ort.OrtValue]) -> dict[str, ort.OrtValue]:
        return self._run(self.backward_session, {n: feeds[n] for n in self.backward_inputs}, self.backward_outputs)


class ORTFunction(torch.autograd.Function):
    """forward(ctx, compiled, names, *tensors): ``names[i]`` is the graph input fed by
    ``tensors[i]``; returns the module's output tensors, then the running statistics."""

    @staticmethod
    def forward(ctx, compiled: Compiled, names: list[str], *tensors):
        feeds = {n: to_ort(t) for n, t in zip(names, tensors)}
        results = compiled.forward(feeds)
        ex = compiled.exported
        outs = [to_torch(results[n]) for n in ex.outputs] + [to_torch(results[n]) for n in ex.running]
        ctx.compiled, ctx.names = compiled, names
        ctx.feeds, ctx.results = feeds, results
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()],
                                    *outs[len(ex.outputs):])
        return tuple(outs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        compiled: Compiled = ctx.compiled
        split = compiled.split
        ex = compiled.exported
        feeds = dict(ctx.feeds)
        feeds.update(ctx.results)
        index = {n: i for i, n in enumerate(ex.outputs)}
        for seed, out in split.seeds.items():
            g = grads[index[out]]
            if g is None:
                g = torch.zeros_like(to_torch(ctx.results[out]))
            feeds[seed] = to_ort(g)
        results = compiled.backward(feeds)
        ctx.feeds = ctx.results = None  # free the saved activations
        out = [None, None]
        for name, needs in zip(ctx.names, ctx.needs_input_grad[2:]):
            grad = split.gradients.get(name)
            out.append(to_torch(results[grad]) if needs and grad is not None else None)
        return tuple(out)
