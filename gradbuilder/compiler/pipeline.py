"""The pipeline: how a forward model becomes a differentiated graph, in one place.

    source ──load──▶ ModelProto ──normalize, expand_functions──▶ onnx_ir.Model
           ──PREPARE (one list of passes)──▶ walk (autodiff) ──name_gradients──▶ FINISH

``GradientGraphBuilder`` (and so the training graphs and the session's graphs) and
``build_split`` (ORTModule) all run it; they differ only in what they differentiate (the
loss, or the model's outputs with gradients given at run time) and in what they append.

Every pass has one shape: a function ``fn(model, ctx)`` over the ``onnx_ir`` model, run as an
``onnx_ir.passes.InPlacePass`` (:class:`Pass`); ``ctx`` (:class:`Context`) carries the names
in use (the emitter), the values differentiated and the options that decide what a pass
does. Both live in ``passes/context.py`` (a pass imports them from there, never from this
module) and are importable from here too. A pass that does not apply returns at once. To add
a pass: write the function in ``compiler/passes/`` and put it in PREPARE (before
differentiation) or FINISH (after).
"""

from __future__ import annotations

import contextlib
import gc

import onnx_ir as ir

from .. import compat
from ..errors import InvalidArgumentError
from . import modelio
from .passes.canonicalize import (
    bfloat16_indices_in_float32,
    fold_shape_computations,
    indexed_max_as_gather,
    sequence_appends_as_scan_outputs,
    split_to_sequence_as_split,
)
from .passes.attention_layout import attention_heads_in_one_transpose
from .passes.cleanup import remove_unused_nodes
from .passes.context import Context, Pass, PassFunction, opset_of
from .passes.expand_functions import expand_functions
from .passes.finite_inputs import mark_finite_softmax_inputs
from .passes.expose_masks import expose_dropout_masks, expose_norm_statistics, expose_pool_indices
from .passes.mixed_precision import autocast
from .passes.padded_sums import padded_sums_as_concat
from .passes.race_free_scatter import scatter_reductions_race_free
from .passes.recompute import apply_recompute
from .passes.running_stats import expose_running_statistics, restore_training_mode
from .passes.standard_losses import class_losses_as_standard_ops
from .passes.store_trips import store_loop_trips
from .passes.vector_products import vector_products_without_transpose
from ..interface import GRADIENT
from .emitter import Emitter
from .type_inference import infer_types

__all__ = ["Context", "Pass", "PREPARE", "FINISH", "run", "load", "values_by_name", "name_gradients",
           "opset_of", "cyclic_collection_paused", "release"]


# Before differentiation, in this order. The sequence rewrites run before the shape folder
# (below opset 18 the folder writes a Split the checker refuses); the running statistics are
# exposed after the dropout masks and before the rewrites that read the final forward.
PREPARE: tuple[PassFunction, ...] = (
    split_to_sequence_as_split,
    sequence_appends_as_scan_outputs,
    fold_shape_computations,
    attention_heads_in_one_transpose,
    indexed_max_as_gather,
    bfloat16_indices_in_float32,
    restore_training_mode,
    expose_dropout_masks,
    expose_pool_indices,
    expose_norm_statistics,
    expose_running_statistics,
    vector_products_without_transpose,
    store_loop_trips,
    mark_finite_softmax_inputs,
    autocast,
)

# After the backward nodes and the graph's outputs are in place.
FINISH: tuple[PassFunction, ...] = (
    class_losses_as_standard_ops,
    padded_sums_as_concat,
    apply_recompute,
    scatter_reductions_race_free,
    remove_unused_nodes,
)


def run(passes, model: ir.Model, ctx: Context) -> None:
    """Run ``passes`` (PREPARE or FINISH) over ``model``, in order."""
    ir.passes.Sequential(*(Pass(fn, ctx) for fn in passes))(model)


def load(proto, wrt: list[str], quiet: bool = False) -> ir.Model:
    """A loaded model (``modelio.load_detached``) as an onnx_ir model ready for PREPARE:
    normalized (opset, local functions, types), stamped with an IR version the installed
    onnxruntime reads, and with the rule-less function ops on ``wrt``'s paths expanded.
    ``quiet`` leaves out the warnings about the model (a session that said them already)."""
    compat.check_opset(proto, quiet=quiet)
    proto = modelio.normalize(proto)
    compat.fit_ir_version(proto, quiet=quiet)
    if expand_functions(proto, wrt, modelio.default_opset(proto)):
        infer_types(proto)
    return modelio.to_ir(proto)


def values_by_name(graph: ir.Graph) -> dict[str, ir.Value]:
    """Every named value of the main graph: inputs, initializers, node outputs."""
    values: dict[str, ir.Value] = {}
    for v in graph.inputs:
        values[v.name] = v
    for name, v in graph.initializers.items():
        values[name] = v
    for node in graph:
        for o in node.outputs:
            if o.name:
                values[o.name] = o
    return values


def name_gradients(e: Emitter, weights: list[ir.Value], grads: dict[str, ir.Value],
                   suffix: str = GRADIENT) -> list[ir.Value]:
    """Give each weight's gradient the output name ``<weight><suffix>`` (``W_grad``), typed
    like the weight; returns the gradient outputs in ``weights``' order."""
    ours = {id(n) for n in e.nodes}
    taken: set[ir.Value] = set()
    outputs = []
    existing = values_by_name(e.graph)
    for w in weights:
        g = grads[w.name]
        name = f"{w.name}{suffix}"
        clash = existing.get(name)
        if clash is not None and clash is not g:
            if clash.producer() is not None and id(clash.producer()) in ours:
                clash.name = e.unique(name + "_part")
            else:
                raise InvalidArgumentError(
                    f"the model already has a value named '{name}', the name of weight '{w.name}'s "
                    "gradient output; rename that value or pass another gradient_suffix (e.g. "
                    "'_grad2' when differentiating a gradient graph again)"
                )
        producer = g.producer()
        own = producer is not None and id(producer) in ours and producer.op_type != "Constant"
        if not own or g in taken or g.is_graph_output():
            g = e.op("Identity", g)
        g.name = name
        e.reserve(name)
        g.dtype = w.dtype
        g.shape = ir.Shape(list(w.shape)) if w.shape is not None else None
        taken.add(g)
        outputs.append(g)
    return outputs


@contextlib.contextmanager
def cyclic_collection_paused():
    """No cyclic garbage collection during a build: the IR makes millions of small objects,
    and the collector's repeated scans over them would cost more than the build itself.
    Every object made meanwhile stays in the youngest generation: :func:`release` frees the
    IR by collecting that generation alone."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def release() -> None:
    """Free the IR a build no longer references, before the next memory-hungry step (the
    checker, the split's protos). The IR is cyclic, so only the collector frees it; its
    objects are all young (:func:`cyclic_collection_paused`), so collecting the youngest
    generation frees it without scanning the process's long-lived objects, which a full
    ``gc.collect()`` did, at most of a small build's time when torch is loaded. Without it the
    IR stayed beside the checker and raised the build's peak (docs/guide/build-speed.md)."""
    gc.collect(0)
