"""PyTorch exports that tie parameters the PyTorch model keeps apart.

``torch.onnx.export`` (TorchScript exporter, ``dynamo=False``) in its default eval mode
deduplicates initializers by value: parameters that hold equal values become one initializer,
and each dropped parameter is re-created by an Identity node outside any module scope that
reads the kept initializer under the dropped parameter's name. Layers cloned from one instance
(``nn.TransformerEncoder(layer, num_layers)``, ``copy.deepcopy``) start equal, so their
parameters merge, and training the model trains one set of weights for all of them.

Ties the user made (a tied embedding and output projection, a module applied twice, one
parameter assigned to two modules) are one parameter in PyTorch already: its readers read the
initializer directly, with no such Identity node, and are left alone.
"""

from __future__ import annotations

import re

import onnx

from ..compat import warn
from ..dtypes import FLOAT_TENSOR_TYPES
from .modelio import node_reads

EXPORT_CALL = ("torch.onnx.export(model, args, f, dynamo=False, training=torch.onnx.TrainingMode.TRAINING, "
               "do_constant_folding=False)")
_SHOWN = 4


def merged_parameters(proto: onnx.ModelProto) -> dict[str, list[str]]:
    """For a PyTorch export whose exporter merged float parameters of equal value: each kept
    initializer -> the names of the parameters merged into it; empty otherwise."""
    if proto.producer_name != "pytorch":
        return {}
    graph = proto.graph
    floats = {t.name for t in graph.initializer if t.data_type in FLOAT_TENSOR_TYPES}
    taken = {t.name for t in graph.initializer} | {o.name for o in graph.output}
    merged: dict[str, list[str]] = {}
    for node in graph.node:
        if (node.op_type == "Identity" and node.domain in ("", "ai.onnx") and not node.name.startswith("/")
                and len(node.input) == 1 and node.input[0] in floats and node.output[0] not in taken):
            merged.setdefault(node.input[0], []).append(node.output[0])
    return {kept: sorted(names, key=_natural) for kept, names in merged.items()}


def _natural(name: str) -> list:
    """Sort key putting ``layers.2`` before ``layers.10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _listed(names: list[str], most: int = 6) -> str:
    return ", ".join(names[:most]) + (f", ... ({len(names)} in all)" if len(names) > most else "")


def _scopes(graph: onnx.GraphProto, names: set[str]) -> list[str]:
    """The module scopes (``/enc/layers.0/linear1``) of the nodes that read any of ``names``."""
    scopes = []
    for node in graph.node:
        if node.name.startswith("/") and names & node_reads(node):
            scope = node.name.rsplit("/", 1)[0] or "/"
            if scope not in scopes:
                scopes.append(scope)
    return scopes


def warn_merged_parameters(proto: onnx.ModelProto) -> None:
    """Warn (at the user's call) when ``proto`` is a PyTorch export that merged parameters."""
    merged = merged_parameters(proto)
    if not merged:
        return
    groups = []
    named_first = sorted(merged.items(), key=lambda item: item[0].startswith("onnx::"))
    for kept, names in named_first[:_SHOWN]:
        scopes = _scopes(proto.graph, {kept, *names})
        groups.append(f"'{kept}' also stands for {_listed(names)} (read in {_listed(scopes)})")
    more = f"; and {len(merged) - _SHOWN} more initializers" if len(merged) > _SHOWN else ""
    warn("the model is a PyTorch export that merged parameters of equal value into one initializer, so "
         "training it trains one shared weight where the PyTorch model has separate ones (torch.onnx.export "
         "in eval mode deduplicates initializers by value, and layers cloned from one instance start equal): "
         f"{'; '.join(groups)}{more}. Re-export it with {EXPORT_CALL}")
