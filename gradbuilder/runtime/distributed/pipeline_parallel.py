"""Pipeline-parallel training: each process runs one stage of the model (``compiler.cuts``),
on a 1F1B schedule over the step's micro-batches.

The forward model is cut at ``pipeline_cut_info_string``'s edges (onnxruntime-training's
syntax, or a list of value names) or, without cuts, where the estimated FLOPs and parameter
bytes balance. Each stage has a forward graph that returns the values it sends to the next
stage (and what its backward reads), and a backward graph that takes their gradients and
returns those of the values it received and of its weights (``compiler.split``, as ORTModule's).
A step splits the batch into ``num_pipeline_micro_batches`` equal micro-batches; stage s runs
S - s - 1 forwards ahead, then alternates one forward and one backward (1F1B), then drains
the backwards. Activations go forward and gradients back with torch.distributed's
point-to-point send and recv (sends do not block: the schedule cannot deadlock). The weight
gradients are summed over the micro-batches (as accumulation steps sum them), averaged across
the stage's data-parallel replicas, and each stage updates its own weights, clipped by the
norm over every stage.
"""

from __future__ import annotations

import zlib
from typing import Mapping

import numpy as np
import onnx
import onnxruntime as ort

from ...compiler import cuts as _cuts
from ...dtypes import FLOAT_TENSOR_TYPES
from ...errors import InvalidArgumentError
from ..executor import LocalExecutor
from .data_parallel import DataParallel, agree_on_inputs, shapes_of
from .launch import Topology

_HEADER = 9  # a sent tensor's header: its rank and up to 8 sizes


class PipelineParallel(DataParallel):
    """One stage of a pipeline, an executor (``executor.Executor``) over this process's
    ``local`` one: ``run`` is the pipeline's step; the step-wise API, ``eval_step`` and exports
    are refused (each stage holds its own weights)."""

    def __init__(self, local: LocalExecutor, topo: Topology, params):
        if params.deepspeed_zero_stage:
            raise InvalidArgumentError("TrainingParameters: deepspeed_zero_stage with pipeline_parallel_size > 1 is "
                                       "not supported; each stage already holds only its own optimizer state")
        if params.gradient_accumulation_steps > 1:
            raise InvalidArgumentError("TrainingParameters: with pipeline_parallel_size > 1, accumulate with "
                                       "num_pipeline_micro_batches (the step's micro-batches), not "
                                       "gradient_accumulation_steps")
        facts = local.parts.facts
        if facts.buffers:
            raise InvalidArgumentError(f"pipeline-parallel training of a model with running statistics "
                                       f"{facts.buffers[:3]} is not supported; train it data parallel")
        model_with_weights = _with_weights(facts)
        cuts = (params.pipeline_cut_info_string and _cuts.parse_cuts(params.pipeline_cut_info_string)) or \
            _cuts.balanced_cuts(model_with_weights, topo.stages, facts.loss, facts.weights)
        if len(cuts) != topo.stages - 1:
            raise InvalidArgumentError(f"TrainingParameters.pipeline_cut_info_string has {len(cuts)} cuts; "
                                       f"pipeline_parallel_size={topo.stages} needs {topo.stages - 1}")
        self.stage = _cuts.cut_model(model_with_weights, cuts, facts.loss, facts.weights)[topo.stage]
        del model_with_weights
        self.micro = params.num_pipeline_micro_batches
        super().__init__(local, topo, params, self.stage.weights)
        self.split = self.stage.split()
        self.first, self.last = topo.stage == 0, topo.stage == topo.stages - 1
        self.prev = topo.rank - topo.replicas
        self.next = topo.rank + topo.replicas
        graphs = self.parts.graphs
        self.forward = graphs.compile(self.split.forward.SerializeToString())
        self.backward = graphs.compile(self.split.backward.SerializeToString())
        received = {i.name: i.type.tensor_type.elem_type for i in self.stage.model.graph.input}
        self.receive_types = {n: received[n] for n in self.stage.receives}
        self.seeds = {out: seed for seed, out in self.split.seeds.items()}  # sent value -> its seed input
        sent = {o.name: o.type.tensor_type.elem_type for o in self.stage.model.graph.output}
        self.float_sends = [n for n in self.stage.sends if not self.last and sent[n] in FLOAT_TENSOR_TYPES]
        self.float_receives = [n for n in self.stage.receives if self.receive_types[n] in FLOAT_TENSOR_TYPES]
        self.model_inputs = [i.name for i in facts.model.graph.input if i.name not in set(facts.weights)]

    # ------------------------------------------------------------------ one step
    def gradients(self, feeds: Mapping[str, object]) -> tuple[dict, dict]:
        """The step's micro-batches through the pipeline: (the loss, the mean of the
        micro-batches', on every stage; {weight: gradient summed over the micro-batches and
        averaged across the replicas})."""
        micro = self._micro_batches(feeds)
        env: dict[int, dict] = {}
        grads: dict[str, object] = {}
        losses: list[float] = []
        pending: list = []
        ahead = min(self.topo.stages - self.topo.stage - 1, self.micro)
        order = [("f", i) for i in range(ahead)]
        for j in range(self.micro - ahead):
            order += [("f", ahead + j), ("b", j)]
        order += [("b", j) for j in range(self.micro - ahead, self.micro)]
        for kind, i in order:
            if kind == "f":
                env[i] = self._forward(micro[i], pending, losses)
            else:
                self._backward(env.pop(i), pending, grads)
        for work in pending[::2]:  # (send, its tensor kept alive) pairs
            self.comm.call("sending along the pipeline", work.wait)
        loss = self._loss(losses)
        return {self.parts.facts.loss: loss}, self.reduce(grads)

    def _micro_batches(self, feeds) -> list[dict[str, np.ndarray]]:
        """The feeds split into equal micro-batches, checked here and against the other stages
        (every stage of a replica must be fed the same batch) and replicas (the same shapes)."""
        error = None
        try:
            if not isinstance(feeds, Mapping):
                raise InvalidArgumentError(f"input_feed must be a dict of input name -> array, got {type(feeds).__name__}")
            missing = [n for n in self.model_inputs if n not in feeds]
            unknown = [n for n in feeds if n not in self.model_inputs]
            if missing or unknown:
                raise InvalidArgumentError(f"input_feed: missing {missing}, unknown {unknown}; every stage is fed "
                                           f"the model's inputs {self.model_inputs}")
            arrays = {n: np.asarray(v.numpy() if isinstance(v, ort.OrtValue) else v) for n, v in feeds.items()}
            sizes = {a.shape[0] if a.ndim else None for a in arrays.values()}
            if len(sizes) != 1 or None in sizes or next(iter(sizes)) % self.micro:
                raise InvalidArgumentError(
                    f"input_feed: the inputs' first dimension {sorted(a.shape[0] if a.ndim else 0 for a in arrays.values())} "
                    f"must be one batch size divisible by num_pipeline_micro_batches={self.micro}")
        except InvalidArgumentError as exc:
            error, arrays = str(exc), {}
        digest = zlib.crc32(b"".join(np.ascontiguousarray(arrays[n]).tobytes() for n in sorted(arrays)))
        agree_on_inputs(self.norm_comm, error, shapes_of(arrays), "stages of a pipeline", digest)
        agree_on_inputs(self.comm, error, shapes_of(arrays), "replicas")
        return [{n: np.ascontiguousarray(np.split(a, self.micro)[i]) for n, a in arrays.items()}
                for i in range(self.micro)]

    def _forward(self, feeds: dict, pending: list, losses: list) -> dict:
        import torch

        from ..dlpack import to_ort, to_torch

        s = self.parts.state
        env = {n: s.ortvalue(feeds[n]) for n in self.stage.inputs if n in self.split.forward_inputs}
        for name in self.stage.receives:
            env[name] = to_ort(self._recv(name, self.receive_types[name]))
        env.update({w: s[w] for w in self.stage.weights})
        results = self.forward.run({n: env[n] for n in self.split.forward_inputs})
        env.update(results)
        for name in self.stage.sends:
            self._send(to_torch(results[name]), pending)
        if self.last:
            losses.append(float(results[self.stage.loss].numpy()))
            env["__seed__"] = torch.ones((), dtype=torch.float32)
        return env

    def _backward(self, env: dict, pending: list, grads: dict) -> None:
        import torch

        from ..dlpack import to_ort, to_torch

        feeds = {name: env[name] for name in self.split.backward_inputs if name in env}
        if self.last:
            feeds.update({seed: to_ort(env["__seed__"]) for seed in self.split.seeds})
        for out in self.float_sends:  # the next stage sends the gradient of each float value it received
            buf = torch.empty_like(to_torch(env[out]))
            self.comm.call(f"receiving the gradient of '{out}' from rank {self.next}", self.comm.dist.recv, buf,
                            self.next)
            if out in self.seeds:
                feeds[self.seeds[out]] = to_ort(buf)
        results = self.backward.run(feeds)
        for name in [] if self.first else self.float_receives:
            g = self.split.gradients.get(name)
            grad = to_torch(results[g]) if g is not None else torch.zeros_like(to_torch(env[name]))
            self._send(grad, pending, self.prev)
        for w in self.stage.weights:
            g = results[self.split.gradients[w]]
            if w in grads:
                to_torch(grads[w]).add_(to_torch(g))
            else:
                grads[w] = g

    def _send(self, tensor, pending: list, dst: int | None = None) -> None:
        import torch

        dst = self.next if dst is None else dst
        tensor = tensor.contiguous()
        if dst == self.next:  # activations carry their shape ahead of them; gradients match it
            header = torch.zeros(_HEADER, dtype=torch.int64)
            header[0] = tensor.dim()
            header[1: 1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
            pending.append(self.comm.call("sending along the pipeline", self.comm.dist.isend, header, dst))
            pending.append(header)
        pending.append(self.comm.call("sending along the pipeline", self.comm.dist.isend, tensor, dst))
        pending.append(tensor)  # kept alive until the send is done

    def _recv(self, name: str, elem_type: int):
        import torch
        from onnx import helper

        header = torch.zeros(_HEADER, dtype=torch.int64)
        self.comm.call(f"receiving '{name}' from rank {self.prev}", self.comm.dist.recv, header, self.prev)
        shape = header[1: 1 + int(header[0])].tolist()
        dtype = torch.from_numpy(np.zeros(0, helper.tensor_dtype_to_np_dtype(elem_type))).dtype
        buf = torch.empty(shape, dtype=dtype)
        self.comm.call(f"receiving '{name}' from rank {self.prev}", self.comm.dist.recv, buf, self.prev)
        return buf

    def _loss(self, losses: list[float]):
        """The mean of the micro-batches' losses, from the last stage to every stage."""
        import torch

        value = torch.tensor([np.mean(losses) if losses else 0.0], dtype=torch.float64)
        last = self.norm_comm.ranks[-1]
        self.norm_comm.call("passing the loss along the pipeline", self.comm.dist.broadcast, value, src=last,
                             group=self.norm_comm.group)
        return self.parts.state.ortvalue(np.array(value[0], np.float32))

    # ------------------------------------------------------------------ the session's calls
    def train_step(self, feeds, reset: bool) -> dict:
        raise InvalidArgumentError("train_step with pipeline_parallel_size > 1: the pipeline's step is run() (its "
                                   "micro-batches are num_pipeline_micro_batches)")

    def optimizer_step(self, rate) -> None:
        raise InvalidArgumentError("optimizer_step with pipeline_parallel_size > 1: the pipeline's step is run()")

    def check(self, call: str) -> None:
        if call == "eval_step":
            raise InvalidArgumentError("eval_step with pipeline_parallel_size > 1 is not supported: save a checkpoint "
                                       "and evaluate it in one process")
        if call == "export_model_for_inferencing":
            raise InvalidArgumentError("export_model_for_inferencing with pipeline_parallel_size > 1: each stage holds "
                                       "its own weights; save a checkpoint and export it from one process")


def _with_weights(facts) -> onnx.ModelProto:
    """The session's model with its weights as initializers the cuts place (dtype and shape
    only: their values stay in the state)."""
    whole = facts.detached().to_proto()  # the large frozen parameters' values written in
    specs = facts.specs
    whole.graph.initializer.extend(onnx.TensorProto(name=w, dims=specs[w].shape,
                                                    data_type=onnx.helper.np_dtype_to_tensor_dtype(specs[w].dtype))
                                   for w in facts.weights)
    return whole

