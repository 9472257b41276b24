"""Running models and gradient graphs on onnxruntime's CPU provider (the tests' shorthands), and
the check that a gradient graph holds no node that races on onnxruntime's CPU threads."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import onnx

from ..compiler.builder import GradientGraphBuilder
from ..compiler.traversal import proto_subgraphs


def ort_session(model, providers=("CPUExecutionProvider",)):
    """A quiet onnxruntime session for a ModelProto, serialized bytes or a path."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if isinstance(model, onnx.ModelProto):
        model = model.SerializeToString()
    return ort.InferenceSession(model if isinstance(model, bytes) else str(model), so, providers=list(providers))


def run_onnxruntime(model, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run ``model`` on onnxruntime's CPU provider: output name -> value. Feeds the model
    does not take are ignored; weights with initializer defaults can be fed."""
    sess = ort_session(model)
    wanted = {i.name for i in sess.get_inputs()} | {i.name for i in sess.get_overridable_initializers()}
    out = sess.run(None, {k: v for k, v in feeds.items() if k in wanted})
    return dict(zip([o.name for o in sess.get_outputs()], out))


def ort_run(model, feeds: Mapping[str, np.ndarray], *, overridable: bool = True) -> dict[str, np.ndarray]:
    """Run ``model`` on onnxruntime's CPU provider: output name -> value (the tests' shorthand).

    Feeds the model does not take are dropped. With ``overridable=False`` only the graph's
    inputs are fed, never its initializers (even when ``feeds`` holds a value by that name)."""
    if overridable:
        return run_onnxruntime(model, feeds)
    sess = ort_session(model)
    wanted = {i.name for i in sess.get_inputs()}
    out = sess.run(None, {k: v for k, v in feeds.items() if k in wanted})
    return dict(zip([o.name for o in sess.get_outputs()], out))


def ort_grad_session(model, weights: Sequence[str], feeds: Mapping[str, np.ndarray], *, loss: str = "loss"):
    """(session, outputs): the float gradient graph of ``model`` (``loss`` w.r.t. ``weights``)
    run on onnxruntime's CPU provider, fed the graph inputs found in ``feeds``; ``outputs`` maps
    every output name (``loss``, ``<w>_grad``) to its value. The session is returned for
    further runs (finite differences on onnxruntime)."""
    built = GradientGraphBuilder(model, weights=list(weights), outputs=[loss], loss=loss).build().get_model()
    racing = racing_nodes(onnx.load_from_string(built).graph)
    assert not racing, f"the gradient graph holds nodes that race on onnxruntime's CPU threads: {racing}"
    sess = ort_session(built)
    run_feeds = {i.name: feeds[i.name] for i in sess.get_inputs() if i.name in feeds}
    return sess, dict(zip([o.name for o in sess.get_outputs()], sess.run(None, run_feeds)))


def racing_nodes(graph: onnx.GraphProto) -> list[str]:
    """The nodes of ``graph`` (its subgraphs too) whose onnxruntime CPU kernel adds into shared
    places from several threads at once (ScatterND with a reduction; see
    ``compiler/passes/race_free_scatter.py``): a graph gradbuilder writes has none."""
    found = []
    for node in graph.node:
        if node.op_type == "ScatterND" and node.domain in ("", "ai.onnx") and any(
                a.name == "reduction" and a.s not in (b"", b"none") for a in node.attribute):
            found.append(f"{node.op_type} '{node.name}'")
        for sub in proto_subgraphs(node):
            found += racing_nodes(sub)
    return found


def ort_grads(model, weights: Sequence[str], feeds: Mapping[str, np.ndarray], *, loss: str = "loss"
              ) -> dict[str, np.ndarray]:
    """The onnxruntime gradients of ``loss`` w.r.t. ``weights``: weight name -> gradient
    (see :func:`ort_grad_session`)."""
    _, got = ort_grad_session(model, weights, feeds, loss=loss)
    return {w: got[f"{w}_grad"] for w in weights}
