"""LoRA on an ONNX model: low-rank branches added to the weights of its MatMul, Gemm and
MatMulNBits nodes, chosen as PEFT users choose them (``target_modules``-style names such as
``q_proj,v_proj``), trained while everything else stays frozen.

Each target's output becomes ``y + (x @ A) @ B * (alpha / r)`` with ``A`` [K, r] initialized as
PEFT initializes ``lora_A`` (uniform in +-1/sqrt(K), kaiming_uniform with a = sqrt 5) and
``B`` [r, N] zeros, so the model computes exactly what it did until B moves. ``A`` and ``B``
are graph inputs with initializer defaults: onnxruntime's adapters (``AdapterFormat``,
``RunOptions.add_active_adapter``, onnxruntime-genai's ``Adapters``) override exactly such
inputs, so the transformed model runs without an adapter as the base model and with one as
the fine-tuned model. A fused projection (onnxruntime-genai's ``qkv_proj``, Phi-3's
``gate_up_proj``) is split per target: each target's branch fills its own columns.

:func:`add_lora` returns the transformed model (a ``DetachedModel``: usable with
GradientGraphBuilder, TrainingSession and generate_artifacts like any model);
:func:`lora_parameters` names its LoRA inputs; :func:`for_training` loads it with the
causal-LM loss, its LoRA inputs the only weights; :func:`write_adapter` writes trained values as
an ``.onnx_adapter``; :func:`merge_lora` folds them into a float base's weights.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..compiler import modelio
from ..compiler.detached import DetachedModel
from ..errors import InvalidArgumentError

__all__ = ["add_lora", "for_training", "lora_parameters", "lora_layout", "merge_lora", "write_adapter"]

METADATA_KEY = "gradbuilder.lora"  # the transformed model's record of its branches (JSON)
_LINEAR = {("", "MatMul"), ("ai.onnx", "MatMul"), ("", "Gemm"), ("ai.onnx", "Gemm"),
           ("com.microsoft", "MatMulNBits")}
# fused projections -> the targets they hold, in column order
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass
class Branch:
    """One LoRA branch: ``target`` (q_proj) on ``node`` (reading ``weight``), its inputs ``a``
    [K, r] and ``b`` [r, width], filling output columns ``start`` .. ``start + width`` of ``n``."""

    target: str
    node: str
    weight: str
    a: str
    b: str
    k: int
    n: int
    start: int
    width: int


def add_lora(model, targets: str | Sequence[str], rank: int = 8, alpha: float = 16, *, seed: int = 0,
             base_dir=None) -> DetachedModel:
    """``model`` (bytes, a path, a ModelProto or DetachedModel; never modified) with LoRA
    branches of rank ``rank`` and scale ``alpha / rank`` on the weights ``targets`` names
    (comma-separated or a list; a target matches a node whose weight or node name has it as a
    path component, e.g. ``q_proj`` matches ``model.layers.0.attn.q_proj.MatMul.weight``, and
    the q columns of a fused ``qkv_proj``). ``seed`` draws the A matrices. See the module
    docstring."""
    names = _targets(targets)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InvalidArgumentError(f"rank must be an int >= 1, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise InvalidArgumentError(f"alpha must be a number > 0, got {alpha!r}")
    proto, large = modelio.load_detached(model, base_dir)
    if any(p.key == METADATA_KEY for p in proto.metadata_props):
        raise InvalidArgumentError("the model has LoRA branches already (it was made by add_lora); start from the "
                                   "base model")
    branches = _branches(proto, names)
    rng = np.random.default_rng(seed)
    scale = float(alpha) / rank
    for node, parts in _by_node(branches).items():
        _add_branches(proto, node, parts, rank, scale, rng)
    proto.metadata_props.append(onnx.StringStringEntryProto(
        key=METADATA_KEY, value=json.dumps({"rank": rank, "alpha": float(alpha), "scale": scale,
                                            "branches": [asdict(b) for b in branches]})))
    return DetachedModel(proto, large)


def lora_layout(model) -> dict:
    """The record :func:`add_lora` left in ``model``: {"rank", "alpha", "scale", "branches":
    [Branch fields]}; an error for a model without LoRA branches."""
    proto = modelio.read_proto(model)
    for p in proto.metadata_props:
        if p.key == METADATA_KEY:
            return json.loads(p.value)
    raise InvalidArgumentError("the model has no LoRA branches: make it with gradbuilder.add_lora")


def for_training(model, optimizer: str = "adamw"):
    """(TrainingParameters training the LoRA inputs of ``model`` only, with ``optimizer``;
    ``model`` loaded with the causal-LM loss of its ``logits`` against a new input ``labels``):
    what ``gradbuilder lora`` trains, ready for ``TrainingSession(loaded, params)``."""
    from .loaded import LossBlock, load
    from .params import TrainingParameters

    params = TrainingParameters(training_optimizer_name=optimizer, loss_output_name="loss")
    params.weights_to_train = lora_parameters(model)
    return params, load(model, params, loss=LossBlock("causal_lm", "logits", "labels"))


def lora_parameters(model) -> list[str]:
    """The LoRA inputs of a model :func:`add_lora` made, in order (each branch's A, then B)."""
    return [n for b in lora_layout(model)["branches"] for n in (b["a"], b["b"])]


def write_adapter(path, values: Mapping[str, np.ndarray], model_version: int = 1) -> str:
    """Write ``values`` ({LoRA input: array}) as onnxruntime's adapter file (AdapterFormat,
    ``.onnx_adapter``) at ``path``, atomically; onnxruntime's ``LoraAdapter`` and
    onnxruntime-genai's ``Adapters`` load it."""
    import onnxruntime as ort

    from .. import files

    fmt = ort.AdapterFormat()
    fmt.set_adapter_version(1)
    fmt.set_model_version(model_version)
    fmt.set_parameters({n: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v)) for n, v in values.items()})
    with files.atomic_write(path, what="adapter") as (tmp,):
        fmt.export_adapter(str(tmp))
    return str(path)


def merge_lora(model, values: Mapping[str, np.ndarray]) -> DetachedModel:
    """The base model of ``model`` (made by :func:`add_lora`) with each branch folded into its
    weight: W[:, cols] += (A @ B) * scale (float64, then the weight's dtype), the branches and
    their inputs gone. A MatMulNBits base cannot take it: folding a small update into 4-bit
    weights rounds most of it away; keep the adapter instead."""
    layout = lora_layout(model)
    proto, large = modelio.load_detached(model)
    nodes = {n.name: n for n in proto.graph.node}
    quantized = sorted({b["node"] for b in layout["branches"] if nodes[b["node"]].op_type == "MatMulNBits"})
    if quantized:
        raise InvalidArgumentError(
            f"cannot merge the adapter into quantized (MatMulNBits) weights ({quantized[0]}, ...): folding its small "
            "update into 4-bit weights would round most of it away. Keep the adapter (onnxruntime and "
            "onnxruntime-genai apply it at run time), or merge it into the float model the quantized one was made from")
    missing = [n for b in layout["branches"] for n in (b["a"], b["b"]) if n not in values]
    if missing:
        raise InvalidArgumentError(f"values: no array for the LoRA inputs {missing[:4]}")
    inits = {t.name: t for t in proto.graph.initializer}
    merged: dict[str, tuple[np.ndarray, np.dtype]] = {}  # weight -> (its float64 sum, its dtype)
    for b in layout["branches"]:
        if b["weight"] not in merged:
            base = large[b["weight"]] if b["weight"] in large else numpy_helper.to_array(inits[b["weight"]])
            merged[b["weight"]] = (np.array(base, dtype=np.float64), base.dtype)
        w = merged[b["weight"]][0]
        delta = (np.asarray(values[b["a"]], np.float64) @ np.asarray(values[b["b"]], np.float64)) * layout["scale"]
        node = nodes[b["node"]]
        trans_b = node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute)
        cols = slice(b["start"], b["start"] + b["width"])
        if trans_b:
            w[cols, :] += delta.T
        else:
            w[:, cols] += delta
    for name, (w, dtype) in merged.items():
        if name in large:
            large[name] = w.astype(dtype)
        else:
            inits[name].CopyFrom(numpy_helper.from_array(w.astype(dtype), name))
    _remove_branches(proto, layout)
    return DetachedModel(proto, large)


# ----------------------------------------------------------------------------- finding the targets


def _targets(targets) -> list[str]:
    names = [t.strip() for t in targets.split(",")] if isinstance(targets, str) else list(targets or [])
    names = [t for t in names if t]
    if not names or not all(isinstance(t, str) for t in names):
        raise InvalidArgumentError(f"targets must name at least one module, e.g. 'q_proj,v_proj'; got {targets!r}")
    return names


def _components(name: str) -> list[str]:
    return [c for c in re.split(r"[./]", name) if c]


def _weight_of(node: onnx.NodeProto, inits: Mapping[str, onnx.TensorProto]) -> tuple[str, int, int] | None:
    """(weight, K, N) of a linear node whose weight is an initializer; None otherwise."""
    if len(node.input) < 2 or node.input[1] not in inits:
        return None
    t = inits[node.input[1]]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "MatMulNBits":
        return t.name, int(attrs["K"]), int(attrs["N"])
    if len(t.dims) != 2:
        return None
    if node.op_type == "Gemm":
        if attrs.get("transA", 0):
            return None
        k, n = (t.dims[1], t.dims[0]) if attrs.get("transB", 0) else (t.dims[0], t.dims[1])
        return t.name, int(k), int(n)
    return t.name, int(t.dims[0]), int(t.dims[1])


def _branches(proto: onnx.ModelProto, targets: list[str]) -> list[Branch]:
    inits = {t.name: t for t in proto.graph.initializer}
    found: list[Branch] = []
    matched: set[str] = set()
    modules: set[str] = set()
    for node in proto.graph.node:
        if (node.domain, node.op_type) not in _LINEAR:
            continue
        w = _weight_of(node, inits)
        if w is None:
            continue
        weight, k, n = w
        parts = set(_components(weight)) | set(_components(node.name))
        modules |= {c for c in parts if c.endswith("_proj") or c in ("lm_head", "dense", "fc1", "fc2")}
        for target in targets:
            if target in parts:
                found.append(_branch(target, node, weight, k, n, 0, n))
                matched.add(target)
        for fused, held in _FUSED.items():
            wanted = [t for t in held if t in targets]
            if fused in parts and wanted and fused not in targets:
                widths = _fused_widths(proto, node, fused, held, n)
                start = 0
                for t, width in zip(held, widths):
                    if t in wanted:
                        found.append(_branch(t, node, weight, k, n, start, width, fused))
                        matched.add(t)
                    start += width
    unmatched = [t for t in targets if t not in matched]
    if unmatched:
        raise InvalidArgumentError(
            f"targets: no MatMul, Gemm or MatMulNBits weight matches {unmatched}; the model's projections are "
            f"{sorted(modules) or 'none that have a name'} (a target matches a component of a weight or node name)")
    return found


def _branch(target, node, weight, k, n, start, width, fused=None) -> Branch:
    base = re.sub(r"(\.MatMul)?(\.weight)?(_Q\d+)?$", "", weight)
    if fused:
        base = re.sub(rf"\b{fused}\b", target, base)
    elif target not in _components(base):
        base = f"{base}.{target}"
    return Branch(target=target, node=node.name, weight=weight, a=f"{base}.lora_A.weight", b=f"{base}.lora_B.weight",
                  k=k, n=n, start=start, width=width)


def _fused_widths(proto: onnx.ModelProto, node: onnx.NodeProto, fused: str, held: tuple, n: int) -> list[int]:
    """The column widths of each part of a fused projection: q, k, v from the attention node
    that reads it (its num_heads and kv_num_heads), gate and up halves."""
    if fused == "gate_up_proj":
        return [n // 2, n // 2]
    readers = {}
    for other in proto.graph.node:
        for i in other.input:
            readers.setdefault(i, []).append(other)
    frontier, seen = list(node.output), set()
    while frontier:
        value = frontier.pop()
        for reader in readers.get(value, []):
            if reader.op_type in ("GroupQueryAttention", "MultiHeadAttention", "Attention"):
                attrs = {a.name: helper.get_attribute_value(a) for a in reader.attribute}
                heads = int(attrs.get("num_heads", 0))
                kv = int(attrs.get("kv_num_heads", heads))
                if heads and n % (heads + 2 * kv) == 0:
                    d = n // (heads + 2 * kv)
                    return [heads * d, kv * d, kv * d]
            if reader.op_type in ("Add", "Identity", "Cast") and reader.name not in seen:
                seen.add(reader.name)
                frontier.extend(reader.output)
    raise InvalidArgumentError(
        f"cannot split the fused projection '{node.name}' into {', '.join(held)}: no attention node with num_heads "
        f"reads it; target '{fused}' instead")


def _by_node(branches: list[Branch]) -> dict[str, list[Branch]]:
    out: dict[str, list[Branch]] = {}
    for b in branches:
        out.setdefault(b.node, []).append(b)
    return out


# ----------------------------------------------------------------------------- the branches


def _add_branches(proto: onnx.ModelProto, node_name: str, parts: list[Branch], rank: int, scale: float,
                  rng) -> None:
    """y -> y + sum over parts of Pad((x @ A) @ B * scale) into the part's columns."""
    if modelio.default_opset(proto) < 18 and any(p.width != p.n for p in parts):
        raise InvalidArgumentError(f"splitting the fused projection '{node_name}' needs ai.onnx opset 18 (Pad's axes "
                                   f"input); the model has opset {modelio.default_opset(proto)}")
    graph = proto.graph
    index = next(i for i, n in enumerate(graph.node) if n.name == node_name)
    node = graph.node[index]
    x, y = node.input[0], node.output[0]
    dtype = _float_type(graph, node)
    base = f"{y}/lora_base"
    node.output[0] = base
    new: list[onnx.NodeProto] = []
    terms = []
    for p in parts:
        a = rng.uniform(-1.0 / math.sqrt(p.k), 1.0 / math.sqrt(p.k), (p.k, rank))
        b = np.zeros((rank, p.width))
        for name, value in ((p.a, a), (p.b, b)):
            value = value.astype(helper.tensor_dtype_to_np_dtype(dtype))
            graph.initializer.append(numpy_helper.from_array(value, name))
            graph.input.append(helper.make_tensor_value_info(name, dtype, list(value.shape)))
        prefix = f"{node_name}/lora_{p.target}"
        new += [helper.make_node("MatMul", [x, p.a], [f"{prefix}/xA"], name=f"{prefix}/MatMul_A"),
                helper.make_node("MatMul", [f"{prefix}/xA", p.b], [f"{prefix}/xAB"], name=f"{prefix}/MatMul_B"),
                helper.make_node("Mul", [f"{prefix}/xAB", f"{prefix}/scale"], [f"{prefix}/delta"], name=f"{prefix}/Mul")]
        graph.initializer.append(numpy_helper.from_array(
            np.array(scale, helper.tensor_dtype_to_np_dtype(dtype)), f"{prefix}/scale"))
        term = f"{prefix}/delta"
        if p.width != p.n:  # its columns of the fused output
            pads = f"{prefix}/pads"
            graph.initializer.append(numpy_helper.from_array(np.array([p.start, p.n - p.start - p.width], np.int64),
                                                             pads))
            graph.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), f"{prefix}/axes"))
            new.append(helper.make_node("Pad", [term, pads, "", f"{prefix}/axes"], [f"{prefix}/padded"],
                                        name=f"{prefix}/Pad"))
            term = f"{prefix}/padded"
        terms.append(term)
    total = base
    for i, term in enumerate(terms):
        out = y if i == len(terms) - 1 else f"{node_name}/lora_sum{i}"
        new.append(helper.make_node("Add", [total, term], [out], name=f"{node_name}/lora_Add{i}"))
        total = out
    for offset, n in enumerate(new):
        graph.node.insert(index + 1 + offset, n)


def _float_type(graph: onnx.GraphProto, node: onnx.NodeProto) -> int:
    """The float type of a linear node's weight (MatMulNBits: of its scales)."""
    inits = {t.name: t for t in graph.initializer}
    name = node.input[2] if node.op_type == "MatMulNBits" else node.input[1]
    return inits[name].data_type


def _remove_branches(proto: onnx.ModelProto, layout: dict) -> None:
    """``proto`` as it was before :func:`add_lora`: each branched node writes its output again,
    the branch nodes, inputs and initializers gone."""
    graph = proto.graph
    branched = {b["node"] for b in layout["branches"]}
    lora_values = {n for b in layout["branches"] for n in (b["a"], b["b"])}
    keep = []
    for n in graph.node:
        if n.name in branched:
            n.output[0] = n.output[0].removesuffix("/lora_base")
            keep.append(n)
        elif not any(n.name.startswith(f"{b}/lora_") for b in branched):
            keep.append(n)
    del graph.node[:]
    graph.node.extend(keep)
    inits = [t for t in graph.initializer if t.name not in lora_values
             and not any(t.name.startswith(f"{b}/lora_") for b in branched)]
    del graph.initializer[:]
    graph.initializer.extend(inits)
    inputs = [i for i in graph.input if i.name not in lora_values]
    del graph.input[:]
    graph.input.extend(inputs)
    props = [p for p in proto.metadata_props if p.key != METADATA_KEY]
    del proto.metadata_props[:]
    proto.metadata_props.extend(props)
