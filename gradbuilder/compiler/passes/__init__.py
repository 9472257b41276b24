"""Graph passes, one module each. Every pass is a function ``fn(model, ctx)`` over the onnx_ir
model (``ctx``: ``passes.context.Context``), listed in the pipeline's PREPARE or FINISH; a pass
imports the context, the IR helpers (``compiler.values``, ``compiler.traversal``) and the
emitter, never the pipeline or the builder. This module holds the few helpers the passes and
the training stages share."""

import onnx_ir as _ir


def copy_type(out: _ir.Value, value: _ir.Value, stacked: bool = False) -> None:
    """Give ``out`` the dtype and shape of ``value`` (with a new leading axis of unknown
    length when ``stacked``), leaving unknown what ``value`` leaves unknown."""
    if value.dtype is not None:
        out.dtype = value.dtype
    if value.shape is not None:
        out.shape = _ir.Shape([None, *value.shape]) if stacked else value.shape


def named_output(e, value: _ir.Value, name: str, like: _ir.Value) -> _ir.Value:
    """``value`` renamed ``name`` (a graph output), typed like ``like``. A value that cannot
    take the name (a graph input or initializer, or one already named as another output)
    goes through an Identity instead; renaming spares the runtime a copy of every updated
    weight and state per step."""
    e.reserve(name)
    if value.producer() is not None and not value.is_graph_input() and not value.meta.get("gradbuilder.output"):
        out = value
    else:
        out = e.Identity(value)
    out.name = name
    out.meta["gradbuilder.output"] = True
    out.dtype, out.shape = like.dtype, like.shape
    return out


def new_input(e, name: str, dtype: _ir.DataType, shape) -> _ir.Value:
    """A graph input ``name`` (the caller appends it to the inputs), its name reserved in ``e``."""
    e.reserve(name)
    return _ir.Value(name=name, type=_ir.TensorType(dtype), shape=_ir.Shape(list(shape)) if shape is not None else None)


def guarded(e, cond: _ir.Value | None, new: _ir.Value, old: _ir.Value) -> _ir.Value:
    """``new`` where the bool scalar ``cond`` holds, else ``old`` (``new`` when ``cond`` is None):
    how a run leaves state as it was (accumulation micro-steps, skipped steps)."""
    return new if cond is None else e.Where(cond, new, old)
