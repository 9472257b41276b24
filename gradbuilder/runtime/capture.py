"""The training step captured as a CUDA graph (``TrainingParameters.enable_cuda_graph``): one
launch a step instead of one per node, through onnxruntime's CUDA graph support (the CUDA
provider's ``enable_cuda_graph``).

A captured graph replays the kernels it recorded with the addresses it recorded, so:

- every input and output of the step lies at a fixed device address: the state is bound as
  ``runner.StepBinding`` binds it (the weights and moments updated in place, the rest taking
  turns between two buffer sets: one captured graph per turn, each with its own graph id; the
  state only read is bound as it is), and the caller's feeds, the learning rate and the outputs
  have buffers of their own that each step copies into (``OrtValue.update_inplace`` from the
  host, an Identity on the device) or writes. The outputs
  ``run_with_ort_values`` returns are those buffers: the next step overwrites them, as PyTorch's
  static outputs of a CUDA graph; ``run`` returns copies;
- the shapes are the ones captured: a feed of another shape is refused;
- a graph that cannot be captured is refused before any step runs, naming each node and why
  (:func:`capture_blockers`): a node the CUDA provider runs on the CPU, control flow (its
  condition is read on the host), a random draw (the replay would draw the same numbers every
  step) and a node whose CUDA kernel reads a computed input on the host.

onnxruntime runs a graph once uncaptured before it captures it, and both runs happen within
the one call that captures: a step that updates its state in place would be applied twice.
The first step of each graph id therefore keeps a host copy of the state it reads, captures,
puts the state back, and then replays the graph once: the step.
"""

from __future__ import annotations

import functools
import itertools
from typing import Mapping

import numpy as np
import onnx
import onnxruntime as ort

from ..compiler.passes.recompute import RANDOM_OPS
from ..dtypes import NP_OF_ORT
from ..errors import InvalidArgumentError, ProviderError
from ..interface import updated
from .executor import RUN_FAILURES, LocalExecutor, updated_and_read
from .graphs import Kind
from .providers import CPU, CUDA, CUDA_GRAPH as OPTION, cached_session, nodes_without_cuda_kernel
from .runner import StepBinding

GRAPH_ID = "gpu_graph_id"  # the run option that picks a captured graph
_ids = itertools.count()  # graph ids are unique in the process: sessions may share an onnxruntime session

# Inputs that onnxruntime's CUDA kernels read on the host (registered as OrtMemTypeCPUInput):
# a computed value there is copied to the host in every run, which a capture cannot hold.
HOST_INPUTS = {
    "Reshape": (1,), "Expand": (1,), "Tile": (1,), "Slice": (1, 2, 3, 4), "TopK": (1,), "ConstantOfShape": (0,),
    "Range": (0, 1, 2), "Resize": (1, 2, 3), "Upsample": (1,), "Pad": (1, 2, 3), "Squeeze": (1,),
    "Unsqueeze": (1,), "Split": (1,), "OneHot": (1,), "CumSum": (1,), "Trilu": (1,), "Clip": (1, 2),
    "Dropout": (1, 2), "ReduceSum": (1,), "ReduceMean": (1,), "ReduceMax": (1,), "ReduceMin": (1,),
    "ReduceProd": (1,), "ReduceL1": (1,), "ReduceL2": (1,), "ReduceLogSumExp": (1,), "ReduceSumSquare": (1,),
}
# Nodes whose output sizes depend on values, read on the host.
DATA_DEPENDENT = frozenset({"NonZero", "Unique", "Compress", "NonMaxSuppression", "Shape", "Size"})


def capture_blockers(model) -> list[str]:
    """One line per node of ``model`` (a ModelProto or its bytes) that keeps it from being
    captured as a CUDA graph, naming the node, its op and why; empty when it can be."""
    if isinstance(model, (bytes, bytearray)):
        model = onnx.ModelProto.FromString(bytes(model))
    graph = model.graph
    constant = {t.name for t in graph.initializer} | {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    found = [f"{line}: it would run on the CPU" for line in nodes_without_cuda_kernel(model)]
    for node in graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        where = f"node '{node.name}' ({node.op_type})"
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            found.append(f"{where}: control flow reads its condition on the host")
        elif node.op_type in RANDOM_OPS or (node.op_type == "Dropout" and _training_dropout(node, graph)):
            found.append(f"{where}: draws random numbers, and a replay would draw the same ones every step")
        elif node.op_type in DATA_DEPENDENT:
            found.append(f"{where}: its output depends on values read on the host")
        else:
            computed = [node.input[k] for k in HOST_INPUTS.get(node.op_type, ())
                        if k < len(node.input) and node.input[k] and node.input[k] not in constant]
            if computed:
                found.append(f"{where}: its CUDA kernel reads the computed input '{computed[0]}' on the host")
    return found


def _training_dropout(node: onnx.NodeProto, graph: onnx.GraphProto) -> bool:
    """Whether a Dropout draws: in training mode (not a constant false) with a ratio that is not
    a constant 0 (onnxruntime drops a Dropout of ratio 0)."""
    ratio = _constant(graph, node.input[1]) if len(node.input) > 1 and node.input[1] else np.array(0.5)
    training = _constant(graph, node.input[2]) if len(node.input) > 2 and node.input[2] else np.array(False)
    return not (training is not None and not training.any()) and not (ratio is not None and not ratio.any())


def _constant(graph: onnx.GraphProto, name: str) -> np.ndarray | None:
    for t in graph.initializer:
        if t.name == name:
            return onnx.numpy_helper.to_array(t)
    for n in graph.node:
        if n.op_type == "Constant" and name in n.output and n.attribute[0].type == onnx.AttributeProto.TENSOR:
            return onnx.numpy_helper.to_array(n.attribute[0].t)
    return None


class CapturedStep(StepBinding):
    """A ``StepBinding`` whose every input and output lies at a fixed address, each turn run as
    a captured CUDA graph (see the module's docstring). The state it only reads (``read``) is
    bound as it is, like the state it updates: a step made for other values is another
    CapturedStep (``holds``). ``run`` copies ``feeds`` (the caller's and the learning rate) into
    buffers of its own in every step: the caller may refill an array between steps."""

    def __init__(self, graph, state: Mapping[str, ort.OrtValue], in_place: set[str], read: Mapping[str, ort.OrtValue]):
        super().__init__(graph, state, in_place)
        self.read = dict(read)
        for b in self.bindings:
            for name, value in self.read.items():
                b.bind_ortvalue_input(name, value)
        self.ids = (next(_ids), next(_ids))
        self.captured = [False, False]
        self.inputs: dict[str, ort.OrtValue] = {}  # name -> its fixed buffer
        self.fixed_outputs: dict[str, ort.OrtValue] | None = None

    def holds(self, state: Mapping[str, ort.OrtValue], read: Mapping[str, ort.OrtValue] = {}) -> bool:
        return super().holds(state) and len(read) == len(self.read) and all(
            read.get(n) is v for n, v in self.read.items())

    def run(self, feeds, run_options=None) -> tuple[dict, dict]:
        for name, value in feeds.items():
            self._copy_in(name, value)
        turn, b = self.turn, self.bindings[self.turn]
        if not self.captured[turn]:
            saved = {n: np.array(v.numpy(), copy=True) for n, v in {**self.sets[turn], **self.in_place}.items()}
            if self.fixed_outputs is None:
                self._fix_outputs(b, run_options)
                _restore(saved, {**self.sets[turn], **self.in_place})
            self.graph.session.run_with_iobinding(b, _options(run_options, self.ids[turn]))
            _restore(saved, {**self.sets[turn], **self.in_place})
            self.captured[turn] = True
        self.graph.session.run_with_iobinding(b, _options(run_options, self.ids[turn]))
        self.turn = 1 - turn
        return dict(self.fixed_outputs), {**self.sets[self.turn], **self.in_place}

    def _copy_in(self, name: str, value) -> None:
        """``value`` into the input's fixed buffer (made on first use): an array from the host,
        an OrtValue by a copy on its device (the shapes were checked against the captured ones)."""
        fixed = self.inputs.get(name)
        if fixed is None:
            kind, index = self.graph.device
            shape, dtype = (value.shape(), NP_OF_ORT[value.data_type()]) if isinstance(value, ort.OrtValue) else (
                np.shape(value), np.asarray(value).dtype)
            fixed = self.inputs[name] = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, kind, index)
            for b in self.bindings:
                b.bind_ortvalue_input(name, fixed)
        if not isinstance(value, ort.OrtValue):
            fixed.update_inplace(np.ascontiguousarray(value))
        elif value.device_name().lower() != self.graph.device[0]:
            fixed.update_inplace(np.ascontiguousarray(value.numpy()))
        elif value.data_ptr() != fixed.data_ptr():
            _copy_on_device(value, fixed, self.graph.device)

    def _fix_outputs(self, b, run_options) -> None:
        """One uncaptured run (graph id -1) to learn the outputs' shapes; their buffers then bound."""
        self.graph.session.run_with_iobinding(b, _options(run_options, -1))
        kind, index = self.graph.device
        made = b.get_outputs()[: len(self.outputs)]
        self.fixed_outputs = {n: ort.OrtValue.ortvalue_from_shape_and_type(v.shape(), NP_OF_ORT[v.data_type()], kind, index)
                              for n, v in zip(self.outputs, made)}
        for binding in self.bindings:
            for n, v in self.fixed_outputs.items():
                binding.bind_ortvalue_output(n, v)


def _shape(value) -> list[int]:
    return list(value.shape() if isinstance(value, ort.OrtValue) else np.shape(value))


def _copy_on_device(source: ort.OrtValue, target: ort.OrtValue, device: tuple[str, int]) -> None:
    """``source`` into ``target``, both on ``device``, by an Identity node onnxruntime runs there
    (no trip through the host)."""
    kind, index = device
    providers, options = ([CUDA], [{"device_id": str(index)}]) if kind == "cuda" else ([CPU], [{}])
    session = cached_session(_identity(source.data_type(), len(source.shape())), None, providers, options)
    binding = session.io_binding()
    binding.bind_ortvalue_input("x", source)
    binding.bind_ortvalue_output("y", target)
    session.run_with_iobinding(binding)


@functools.lru_cache(maxsize=None)
def _identity(data_type: str, rank: int) -> bytes:
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(NP_OF_ORT[data_type]))
    value = lambda name: onnx.helper.make_tensor_value_info(name, elem, [None] * rank)  # noqa: E731
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "copy", [value("x")], [value("y")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    return model.SerializeToString()


def _restore(saved: Mapping[str, np.ndarray], buffers: Mapping[str, ort.OrtValue]) -> None:
    for name, array in saved.items():
        buffers[name].update_inplace(array)


def _options(run_options, graph_id: int) -> ort.RunOptions:
    """A RunOptions picking ``graph_id``, with the caller's logging and termination settings (the
    caller's object is left as it was)."""
    options = ort.RunOptions()
    if run_options is not None:
        for attr in ("log_severity_level", "log_verbosity_level", "logid", "terminate"):
            setattr(options, attr, getattr(run_options, attr))
    options.add_run_config_entry(GRAPH_ID, str(graph_id))
    return options


class CapturedExecutor(LocalExecutor):
    """A ``LocalExecutor`` whose full step (``run``) replays a captured CUDA graph; the
    step-wise API and evaluation run uncaptured. A failure is raised, never retried on the CPU
    (the state a captured graph holds is on the GPU)."""

    def __init__(self, parts):
        super().__init__(parts)
        parts.params.enable_cuda_graph = True  # the session's private copy: a move checks it (check_device)
        parts.builder.branch_free_update = True  # no If: its condition would be read on the host
        parts.graphs.captured = True
        self._step: CapturedStep | None = None
        self._checked = False

    def run(self, feeds, rate, outputs, run_options=None):
        p = self.parts
        if not self._checked:  # before anything of the step runs
            if p.graphs.built(Kind.STEP) is None:  # built for the shapes of the first feeds: they are the ones captured
                declared = {v.name: len(v.type.tensor_type.shape.dim) for v in p.facts.model.graph.input}
                p.graphs.step_shapes = {n: _shape(v) for n, v in feeds.items() if declared.get(n) == len(_shape(v))}
            blockers = capture_blockers(p.graphs.serialized(Kind.STEP))
            if blockers:
                more = f" (and {len(blockers) - 1} more)" if len(blockers) > 1 else ""
                raise InvalidArgumentError(f"TrainingParameters.{OPTION}=True: the step cannot be captured as a CUDA "
                                           f"graph: {blockers[0]}{more}; leave {OPTION} off for this model")
            self._checked = True
        for name, shape in p.graphs.step_shapes.items():
            if name in feeds and _shape(feeds[name]) != shape:
                raise InvalidArgumentError(
                    f"input '{name}' has shape {_shape(feeds[name])}, but the step was captured as a "
                    f"CUDA graph for {shape} and replays that shape; feed batches of one shape (drop or pad the last "
                    f"one), or leave TrainingParameters.{OPTION} off")
        graph = p.graphs[Kind.STEP]
        state, read = updated_and_read(graph, p.state.bound())
        checked = self.check_feeds(Kind.STEP, feeds, {**state, **read, p.builder.lr_name: rate})
        step = self._step
        if step is None or step.graph is not graph or not step.holds(state, read):
            step = self._step = CapturedStep(graph, state, p.graphs.in_place(Kind.STEP) & set(state), read)
        try:
            results, new_state = step.run({**checked, p.builder.lr_name: rate}, run_options)
        except RUN_FAILURES as exc:
            raise ProviderError(f"onnxruntime failed running the captured step on {p.graphs.providers[0]}: {exc}") from exc
        results.update({updated(n): v for n, v in new_state.items()})
        self.check_finite(results)
        p.state.commit(results)
        return results

    def place(self, providers, provider_options=None):
        super().place(providers, provider_options)  # refuses a device without CUDA (check_device)
        self._step = None
