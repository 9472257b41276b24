"""PyTorch exports that cannot be trained as they are.

Two kinds are recognised:

- exports optimized for inference: torch's default ``torch.onnx.export`` (dynamo,
  ``optimize=True``) folds BatchNorm into the convolution before it, folds parameters into
  constants and fixes the batch size; the TorchScript exporter in eval mode with constant
  folding does the same. Training such a model trains another model, without an error.
  :func:`inference_export_signs` lists what gives one away, :func:`check_inference_export`
  refuses it with the export call to use instead (or, asked to go ahead, warns).
- traced sizes: the TorchScript exporter writes sizes that the Python code took as ints
  (``nn.MultiheadAttention``'s sequence length, ``x.view(8, -1)``) as constants, so the model
  fails at any other size. :func:`fixed_size_failure` reads onnxruntime's error, finds the
  node and the constant, and words what to do.
"""

from __future__ import annotations

import re
from collections import deque

import onnx
from onnx import numpy_helper

from ..compat import warn
from ..errors import InvalidArgumentError
from ..dtypes import FLOAT_TENSOR_TYPES as _FLOATS

_SIGNATURE = "pkg.torch.export.ExportedProgram.graph_signature"
_RANGES = "pkg.torch.export.ExportedProgram.range_constraints"
_REWRITE_RULE = "pkg.onnxscript.rewriter.rule_name"
_WEIGHT_OPS = {"Conv": (1, 2), "ConvTranspose": (1, 2), "Gemm": (1, 2), "MatMul": (1,), "BatchNormalization": (1, 2),
               "LayerNormalization": (1, 2)}


def _metadata(props) -> dict[str, str]:
    return {p.key: p.value for p in props}


def _dims(value: onnx.ValueInfoProto) -> list:
    if not value.type.HasField("tensor_type") or not value.type.tensor_type.HasField("shape"):
        return []
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in value.type.tensor_type.shape.dim]


def inference_export_signs(proto: onnx.ModelProto) -> list[str]:
    """What shows that ``proto`` (a PyTorch export) was optimized for inference, one phrase
    each; empty for other producers and for exports fit for training."""
    if proto.producer_name != "pytorch":
        return []
    graph = proto.graph
    inits = {t.name: t for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    has_bn = any(n.op_type == "BatchNormalization" for n in graph.node)
    signs = []
    rules = sorted({_metadata(n.metadata_props).get(_REWRITE_RULE, "") for n in graph.node} - {""})
    if rules:
        signs.append(f"the exporter's optimizer rewrote the graph ({', '.join(rules)})")
    meta = _metadata(graph.metadata_props)
    signature = meta.get(_SIGNATURE, "")
    targets = {t for _, t in re.findall(r"(PARAMETER|BUFFER) target='([^']+)'", signature)}
    folded = sorted(t for t in targets if t not in inits and not t.endswith("num_batches_tracked"))
    # a parameter shared by two modules (tied embeddings) is one initializer under one of its
    # names: missing names mean folding where running statistics are gone or new tensors
    # stand in for them
    new = [n for n, t in inits.items() if n not in targets and t.data_type in _FLOATS and sum(t.dims) > len(t.dims)]
    if folded and (new or any(t.endswith(("running_mean", "running_var")) for t in folded)):
        signs.append(f"parameters and buffers of the module are not initializers of the model (folded into "
                     f"others): {', '.join(folded[:6])}{' ...' if len(folded) > 6 else ''}")
    for node in graph.node:
        if node.op_type not in ("Conv", "ConvTranspose") or len(node.input) < 2:
            continue
        weight = node.input[1]
        p = producers.get(weight)
        if p is not None and p.op_type in ("Mul", "Div") and any(i in inits or i in producers and
                                                                 producers[i].op_type == "Constant" for i in p.input):
            signs.append(f"{node.op_type} node '{node.name}' reads a weight computed by {p.op_type} node '{p.name}' "
                         "(a BatchNorm folded into it)")
        elif weight.startswith("onnx::") and weight in inits and not has_bn:
            signs.append(f"{node.op_type} node '{node.name}' reads the folded constant '{weight}' as its weight "
                         "(a BatchNorm folded into it)")
    stats = [n for n in inits if "running_mean" in n or "running_var" in n]
    if stats and not has_bn:
        signs.append(f"initializers {stats[:4]} are running statistics but no BatchNormalization node is left")
    constants = []
    for node in graph.node:
        for index in _WEIGHT_OPS.get(node.op_type, ()):
            p = producers.get(node.input[index]) if index < len(node.input) else None
            if p is not None and p.op_type == "Constant" and p.attribute and p.attribute[0].type == onnx.AttributeProto.TENSOR:
                t = p.attribute[0].t
                if t.data_type in _FLOATS and len(t.dims) and max(1, *t.dims) > 1:
                    constants.append(node.input[index])
    if constants:
        signs.append(f"weights are Constant nodes, not initializers, so they cannot be trained: {constants[:4]}")
    fixed = fixed_batch(proto)
    if fixed:
        signs.append(fixed)
    return signs


def fixed_batch(proto: onnx.ModelProto) -> str:
    """For a dynamo export made without ``dynamic_shapes`` (every input size fixed), a phrase
    saying so; else empty."""
    graph = proto.graph
    meta = _metadata(graph.metadata_props)
    if proto.producer_name != "pytorch" or _SIGNATURE not in meta or meta.get(_RANGES, "").strip() not in ("", "{}"):
        return ""
    inits = {t.name for t in graph.initializer}
    user = [i for i in graph.input if i.name not in inits]
    fixed = [i for i in user if _dims(i) and all(isinstance(d, int) and d > 0 for d in _dims(i))]
    if not fixed or len(fixed) != len(user):
        return ""
    return f"the batch size is fixed (input '{fixed[0].name}' is {_dims(fixed[0])}; no dynamic_shapes)"


def export_advice(proto: onnx.ModelProto) -> str:
    """The export calls that keep a model trainable, with the model's own input names."""
    inits = {t.name for t in proto.graph.initializer}
    names = [i.name for i in proto.graph.input if i.name not in inits][:1] or ["x"]
    return (f"torch.onnx.export(model.train(), args, dynamo=True, optimize=False, dynamic_shapes="
            f"{{'{names[0]}': {{0: torch.export.Dim('batch')}}}}) or the TorchScript exporter: "
            f"torch.onnx.export(model, args, f, dynamo=False, training=torch.onnx.TrainingMode.TRAINING, "
            f"do_constant_folding=False, dynamic_axes={{'{names[0]}': {{0: 'batch'}}}})")


ALLOW = "allow_inference_export"  # the option that trains such a model anyway (--allow-inference-export)


def check_inference_export(proto: onnx.ModelProto, allow: bool = False) -> None:
    """Refuse ``proto`` when it looks like an inference-optimized PyTorch export (training it
    would train another model), unless ``allow``: then warn, as for what is only unusual (a
    batch size fixed by the export)."""
    signs = inference_export_signs(proto)
    fixed = fixed_batch(proto)
    if signs and signs != [fixed]:
        message = ("the model looks like a PyTorch export optimized for inference, and training it would train a "
                   f"different model: {'; '.join(signs)}. Re-export it for training: {export_advice(proto)}")
        if not allow:
            raise InvalidArgumentError(f"{message}; or pass {ALLOW}=True (--allow-inference-export) to train it as it is")
        warn(message)
    elif fixed:
        warn(f"the model is a PyTorch dynamo export whose {fixed[4:]}: it trains and runs at that batch size "
             f"only. For other sizes, re-export it: {export_advice(proto)}")


# ------------------------------------------------------------------ traced sizes
_FAILED_NODE = re.compile(r"running (\w+) node\. Name:'([^']*)'")
_ORT_SHAPES = re.compile(r"(Input shape:\s*\{[^}]*\},?\s*requested shape:\s*\{[^}]*\})")
# shape-taking inputs of the ops whose target sizes a trace can fix
_SHAPE_INPUTS = {"Reshape": (1,), "Expand": (1,), "Tile": (1,), "ConstantOfShape": (0,), "Split": (1,),
                 "Resize": (3,), "Slice": (1, 2)}
_PASS_THROUGH = {"Concat": None, "Unsqueeze": (0,), "Squeeze": (0,), "Cast": (0,), "Identity": (0,),
                 "Reshape": (0,), "Flatten": (0,)}


def _constant_leaves(name: str, producers, inits) -> list[tuple[str, list[int]]]:
    """The constants (name, values) that ``name`` is assembled from by Concat/Unsqueeze/Cast
    and the like, without any size read at run time in between."""
    if name in inits:
        return [(name, numpy_helper.to_array(inits[name]).reshape(-1).tolist())]
    node = producers.get(name)
    if node is None:
        return []
    if node.op_type == "Constant":
        attr = node.attribute[0] if node.attribute else None
        if attr is not None and attr.type == onnx.AttributeProto.TENSOR:
            return [(node.name or name, numpy_helper.to_array(attr.t).reshape(-1).tolist())]
        if attr is not None and attr.type in (onnx.AttributeProto.INT, onnx.AttributeProto.INTS):
            return [(node.name or name, [attr.i] if attr.type == onnx.AttributeProto.INT else list(attr.ints))]
        return []
    if node.op_type not in _PASS_THROUGH:
        return []
    indices = _PASS_THROUGH[node.op_type] or range(len(node.input))
    leaves = []
    for i in indices:
        if i < len(node.input) and node.input[i]:
            leaves += _constant_leaves(node.input[i], producers, inits)
    return leaves


def fixed_size_failure(error: str, graphs, shapes: dict[str, list[int]]) -> str | None:
    """When onnxruntime's ``error`` comes from a node whose target shape (or that of a node
    it reads from) holds constants a trace fixed, a message naming them and what to do;
    None otherwise. ``graphs``: the graphs the node may be in; ``shapes``: the fed inputs."""
    found = _FAILED_NODE.search(error)
    if not found:
        return None
    op, name = found.groups()
    for graph in graphs:
        nodes = {n.name: n for n in graph.node if n.name}
        if name in nodes:
            break
    else:
        return None
    producers = {o: n for n in graph.node for o in n.output}
    inits = {t.name: t for t in graph.initializer}
    queue, seen = deque([nodes[name]]), set()
    while queue and len(seen) < 400:
        node = queue.popleft()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for index in _SHAPE_INPUTS.get(node.op_type, ()):
            if index >= len(node.input) or not node.input[index]:
                continue
            leaves = [(c, [v for v in values if v not in (-1, 0, 1)])
                      for c, values in _constant_leaves(node.input[index], producers, inits)]
            leaves = [(c, values) for c, values in leaves if values]
            if not leaves:
                continue
            where = "" if node.name == name else f" it reads the output of {node.op_type} node '{node.name}', and"
            sizes = ", ".join(f"{values[0] if len(values) == 1 else values} (from '{c}')" for c, values in leaves[:3])
            detail = _ORT_SHAPES.search(error)
            fed = ", ".join(f"'{n}' {list(s)}" for n, s in shapes.items())
            axes = {i.name: {k: d for k, d in enumerate(_dims(i)) if isinstance(d, str) and d != "?"} for i in graph.input}
            axes = {n: a for n, a in axes.items() if a} or {"x": {0: "batch", 1: "seq"}}
            return (f"{op} node '{name}' failed on this input:{where} its target shape holds the constant size "
                    f"{sizes}, which the export fixed when it traced the model"
                    + (f" (onnxruntime: {detail.group(1)})" if detail else "")
                    + (f"; this run feeds {fed}" if fed else "")
                    + ". Re-export with the sizes read from the tensors (x.shape / x.size(), not Python ints) and "
                    f"dynamic axes: torch.onnx.export(..., dynamic_axes={axes}), or dynamo=True with "
                    "dynamic_shapes=...; or feed the sizes the model was exported with")
        for i in node.input:
            if i in producers:
                queue.append(producers[i])
    return None
