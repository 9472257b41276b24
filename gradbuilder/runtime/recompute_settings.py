"""The onnxruntime settings under which a recompute graph (``compiler.passes.recompute``)
keeps its lower peak memory: onnxruntime's own optimizers and default execution order would
otherwise undo the rewrite."""

from __future__ import annotations


def session_settings(arena: bool = True):
    """The onnxruntime session settings under which recompute lowers peak memory, for a
    session with onnxruntime's CPU memory arena on (the default) or off (``arena``).

    Returns ``(session_options, disabled_optimizers)``: attributes to set on
    ``onnxruntime.SessionOptions`` and the ``disabled_optimizers`` argument of
    ``onnxruntime.InferenceSession`` (see :func:`make_session`). Measured on onnxruntime 1.31
    (CPU):

    - CommonSubexpressionElimination (a basic-level optimizer) merges every clone back into
      its forward original (same op, inputs and attributes): recompute is undone whole.
    - The DEFAULT execution order is a depth-first order from the graph outputs, not the
      graph's node order: clones may run early, in the forward, and be held as long as the
      values they replace.
    - PRIORITY_BASED with equal priorities runs the ready node with the lowest index, which
      is exactly the graph's node order (the lowest unexecuted node is always ready) -- as
      long as no optimizer creates nodes: new nodes take the highest indices, so a forward
      node replaced by a fused one waits while every ready clone and backward node that only
      reads forward values runs first, in the forward. The extended level is therefore off,
      and so are the basic-level rewrites that create nodes: MatMulAddFusion (MatMul + Add ->
      Gemm), ReshapeFusion and TransposeOptimizer. With them on, the transformer benchmark
      ran its layer-0 clones during the forward and held more activations than without recompute.
    - onnxruntime's buffer reuse (``enable_mem_reuse``) hands a freed buffer to a later value
      of the same size. With the arena on, it kept the transformer benchmark's resident memory
      at its first layer's high-water mark through the whole backward; without it the
      whole-layer recompute step peaks far lower for a little more time
      (docs/guide/mixed-precision-and-recompute.md). With the arena off, buffer reuse is what lets an element-wise
      node write over its dying input. So reuse is turned off only with the arena on.
    """
    import onnxruntime as ort

    options = {
        "execution_order": ort.ExecutionOrder.PRIORITY_BASED,
        "graph_optimization_level": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    }
    if arena:
        options["enable_mem_reuse"] = False
    return options, ["CommonSubexpressionElimination", "MatMulAddFusion", "ReshapeFusion", "TransposeOptimizer"]


def make_session(model, providers=("CPUExecutionProvider",), session_options=None):
    """An ``onnxruntime.InferenceSession`` for a recompute graph (bytes, path or ModelProto)
    with :func:`session_settings` applied to a copy of ``session_options`` (defaults when None)."""
    import onnxruntime as ort

    from .providers import options_with

    options, disabled = session_settings(session_options is None or session_options.enable_cpu_mem_arena)
    so = options_with(session_options, **options)  # the caller's options stay as they were
    if hasattr(model, "SerializeToString"):
        model = model.SerializeToString()
    model = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(model, so, providers=list(providers), disabled_optimizers=disabled)
