"""One compiled input signature: onnxruntime sessions for the forward and backward graphs,
and the autograd Function that runs them. Tensors cross between torch and onnxruntime as
DLPack views of the same memory, on CPU and CUDA alike."""

from __future__ import annotations

import collections

import onnx
import onnxruntime as ort
import torch
from torch.autograd.function import once_differentiable

from ..errors import InvalidModelError
from ..runtime import providers as _providers
from ..runtime.dlpack import to_ort, to_torch
from ..runtime.runner import compile_graph, taking_turns
from ..compiler.split import SplitGraphs, build_split
from .export import Exported
from .options import DebugOptions, logger


def _providers_for(device: torch.device):
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        # onnxruntime works on PyTorch's current stream, so that each sees the other's writes
        # in order without a synchronization.
        stream = torch.cuda.current_stream(index).cuda_stream
        options = {"device_id": str(index), "has_user_compute_stream": "1", "user_compute_stream": str(stream),
                   # float32 products in TF32 exactly when PyTorch computes them so
                   **_providers.tf32_option(torch.backends.cuda.matmul.allow_tf32)}
        return ["CUDAExecutionProvider", "CPUExecutionProvider"], [options, {}], ("cuda", index)
    return ["CPUExecutionProvider"], [{}], ("cpu", 0)


class Compiled:
    """The sessions of one signature. ``backward`` is None when no gradient is needed (``wrt``
    empty, or no output requires grad): the forward graph is then the exported model itself.
    ``saved_files`` counts the signatures whose debug files were written, per mode: ``training``
    for a call in training mode with grad enabled, else ``inference`` (onnxruntime-training's
    names)."""

    def __init__(self, exported: Exported, wrt: list[str], device: torch.device, debug: DebugOptions,
                 number: int, session_options: ort.SessionOptions | None = None,
                 saved_files: collections.Counter | None = None, training: bool = True):
        self.exported = exported
        self.mode = "training" if training else "inference"
        providers, options, self.ort_device = _providers_for(device)
        # onnxruntime's INFO is its graph transformers' trace: only VERBOSE goes below WARNING
        severity = 0 if debug.log_level == 0 else max(2, int(debug.log_level))
        # The forward and backward sessions and PyTorch take turns on the same cores (a pool
        # still spinning after its run made the benchmark transformer's forward + backward take
        # 1.5x as long): runner.taking_turns
        so = taking_turns(_providers.options_with(session_options, log_severity_level=severity))
        self.split: SplitGraphs | None = None
        outputs = list(dict.fromkeys(n for n, d in zip(exported.outputs, exported.differentiable) if d))
        if wrt and outputs:
            self.split = build_split(exported.model, wrt, outputs=outputs, stop_gradients=exported.stop_gradients,
                                     keep_gradient_graph=debug.save_onnx)
            forward, backward = self.split.forward, self.split.backward
            for name in self.split.no_gradient:
                logger.info("ORTModule: the outputs do not depend on '%s': its gradient is None", name)
        else:
            forward, backward = exported.model, None
        if debug.save_onnx:
            saved_files = saved_files if saved_files is not None else collections.Counter()
            saved_files[self.mode] += 1
            self._save(debug, saved_files[self.mode], forward, backward)
        self.forward_graph = compile_graph(_checked(forward, "forward", number), so, providers, options,
                                           self.ort_device)
        self.backward_graph = (None if backward is None else
                               compile_graph(_checked(backward, "backward", number), so, providers, options,
                                             self.ort_device))
        self.forward_inputs = list(self.forward_graph.inputs)
        if backward is not None:
            self.backward_inputs = list(self.backward_graph.inputs)
            # the call's tensors and outputs the backward reads (the rest it reads is saved values)
            self.reads = set(self.backward_inputs) - set(self.split.seeds) - set(self.split.saved)
            # each backward seed takes the sum of the gradients of the outputs it stands for
            self.seed_outputs = {seed: [i for i, (n, d) in enumerate(zip(exported.outputs, exported.differentiable))
                                        if n == out and d] for seed, out in self.split.seeds.items()}
        logger.info("ORTModule: compiled signature %d (%d forward inputs, %d saved values, backward: %s)",
                    number, len(self.forward_inputs), len(self.split.saved) if self.split else 0, backward is not None)

    def _save(self, debug: DebugOptions, count: int, forward, backward) -> None:
        """The files onnxruntime-training's ORTModule writes, under its names: what torch's exporter
        wrote, the model the gradient graph is built from, the gradient graph, and the graphs that
        run (the backward graph's file adds ``backward`` to the name)."""
        ex = self.exported
        files = {"torch_exported": ex.torch_exported, "optimized_pre_grad": ex.model,
                 "optimized": self.split.gradient_graph if self.split is not None else ex.model,
                 "execution_model": forward, "execution_model_backward": backward}
        from ..files import atomic_write

        for name, model in files.items():
            if model is None:
                continue
            with atomic_write(debug.path(name, self.mode, count), what="debug model") as (tmp,):
                tmp.write_bytes(model if isinstance(model, bytes) else model.SerializeToString())

    # ------------------------------------------------------------------ running
    def forward(self, feeds: dict[str, ort.OrtValue]) -> dict[str, ort.OrtValue]:
        return self.forward_graph.run({n: feeds[n] for n in self.forward_inputs})

    def backward(self, feeds: dict[str, ort.OrtValue]) -> dict[str, ort.OrtValue]:
        return self.backward_graph.run({n: feeds[n] for n in self.backward_inputs})


def _checked(model: onnx.ModelProto, which: str, number: int) -> bytes:
    """``model`` serialized, once onnx.checker (its structural check) passed it: a graph it
    refuses is never handed to onnxruntime. The checker wants a shape on every graph input and
    output, which onnxruntime does not (a saved value of unknown rank): those are checked with
    an empty one."""
    data = checked = model.SerializeToString()
    if any(v.type.HasField("tensor_type") and not v.type.tensor_type.HasField("shape")
           for v in (*model.graph.input, *model.graph.output)):
        copy = onnx.ModelProto.FromString(data)
        for v in (*copy.graph.input, *copy.graph.output):
            if v.type.HasField("tensor_type"):
                v.type.tensor_type.shape.SetInParent()
        checked = copy.SerializeToString()
    try:
        onnx.checker.check_model(checked)
    except (onnx.checker.ValidationError, ValueError) as exc:
        raise InvalidModelError(f"the {which} graph built for input signature {number} fails onnx.checker: "
                                f"{str(exc).strip().splitlines()[0]}") from exc
    return data


class ORTFunction(torch.autograd.Function):
    """forward(ctx, compiled, names, *tensors): ``names[i]`` is the graph input fed by
    ``tensors[i]``; returns the module's output tensors, then the running statistics.

    The call's tensors and the outputs that the backward reads go through
    ``ctx.save_for_backward``: autograd then refuses a backward after one of them was modified
    in place, as it does for PyTorch's own operators."""

    @staticmethod
    def forward(ctx, compiled: Compiled, names: list[str], *tensors):
        feeds = {n: to_ort(t) for n, t in zip(names, tensors)}
        results = compiled.forward(feeds)
        ex = compiled.exported
        outs = [to_torch(results[n]) for n in ex.outputs] + [to_torch(results[n]) for n in ex.running]
        ctx.mark_non_differentiable(*[o for o, d in zip(outs, ex.differentiable) if not d],
                                    *outs[len(ex.outputs):])
        ctx.compiled, ctx.names = compiled, names
        if compiled.split is not None:
            saved = [(n, t) for n, t in zip(names, tensors) if n in compiled.reads]
            saved += [(n, o) for n, o in zip(ex.outputs, outs) if n in compiled.reads]
            ctx.saved_names = [n for n, _ in saved]
            ctx.save_for_backward(*[t for _, t in saved])
            ctx.results = {n: results[n] for n in compiled.split.saved}
        return tuple(outs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        compiled: Compiled = ctx.compiled
        split = compiled.split
        feeds = {n: to_ort(t) for n, t in zip(ctx.saved_names, ctx.saved_tensors)}
        feeds.update(ctx.results)
        for seed, positions in compiled.seed_outputs.items():
            feeds[seed] = to_ort(sum(grads[i] for i in positions))
        results = compiled.backward(feeds)
        ctx.results = None  # free the saved activations
        out = [None, None]
        for name, needs in zip(ctx.names, ctx.needs_input_grad[2:]):
            grad = split.gradients.get(name)
            out.append(to_torch(results[grad]) if needs and grad is not None else None)
        return tuple(out)
