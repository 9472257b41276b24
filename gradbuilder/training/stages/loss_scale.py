"""Loss scaling for mixed-precision training, inside the graph.

The backward starts from ``loss * scale`` so that small half-precision gradients do not flush
to zero; the gradients are divided by ``scale`` again (in their own, float32, type) before
accumulation, clipping and the optimizer. A step whose gradients hold an inf or NaN is
skipped: weights, optimizer state and ``Step`` come out unchanged.

- static (``scale`` > 0): a constant.
- dynamic: the scale is a graph input ``Loss_Scale`` (float32 scalar) with a counter
  ``Loss_Scale_Good_Steps`` (int64 scalar), both returned as ``<name>.updated``, as
  ``torch.cuda.amp.GradScaler``: an overflow multiplies the scale by ``backoff`` and resets the
  counter; ``growth_interval`` finite steps in a row multiply it by ``growth``. With gradient
  accumulation the scale changes only on the micro-step that updates the weights.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from ...compiler.passes import named_output, new_input
from ...interface import LOSS_SCALE, LOSS_SCALE_GOOD_STEPS, updated

SCALE = LOSS_SCALE
GOOD_STEPS = LOSS_SCALE_GOOD_STEPS


@dataclasses.dataclass(frozen=True)
class LossScaling:
    """``scale`` > 0: static; 0: dynamic, starting at ``initial``."""

    scale: float = 0.0
    initial: float = 2.0 ** 16
    growth: float = 2.0
    backoff: float = 0.5
    growth_interval: int = 2000

    @property
    def dynamic(self) -> bool:
        return self.scale == 0.0

    def initial_state(self) -> dict[str, np.ndarray]:
        if not self.dynamic:
            return {}
        return {SCALE: np.array(self.initial, np.float32), GOOD_STEPS: np.array(0, np.int64)}


@dataclasses.dataclass
class Scaled:
    loss: ir.Value  # loss * scale: the value the backward starts from
    scale: ir.Value  # float32 scalar
    inputs: list[ir.Value]


def scale_loss(e, loss: ir.Value, scaling: LossScaling) -> Scaled:
    if scaling.dynamic:
        scale = new_input(e, SCALE, ir.DataType.FLOAT, [])
        inputs = [scale, new_input(e, GOOD_STEPS, ir.DataType.INT64, [])]
    else:
        scale, inputs = e.const(np.array(scaling.scale, np.float32)), []
    return Scaled(e.Mul(loss, e.CastLike(scale, loss)), scale, inputs)


def unscale(e, grads: dict[str, ir.Value], scaled: Scaled) -> dict[str, ir.Value]:
    """Every gradient divided by the scale (one multiply by its reciprocal)."""
    inverse = e.Reciprocal(scaled.scale)
    return {name: e.Mul(g, e.CastLike(inverse, g)) for name, g in grads.items()}


def all_finite(e, grads: dict[str, ir.Value]) -> ir.Value:
    """A bool scalar: no value of ``grads`` (gradients, the loss) holds an inf or NaN (their
    float32 sum is finite: an inf or NaN anywhere makes it inf or NaN; and a float is finite
    exactly where it minus itself is 0, where inf - inf and NaN are NaN)."""
    sums = []
    for g in grads.values():
        total = g if g.shape is not None and g.shape.rank() == 0 else e.reduce("ReduceSum", g, None, keepdims=False)
        sums.append(total if g.dtype == ir.DataType.FLOAT else e.Cast(total, to=int(ir.DataType.FLOAT)))
    total = e.op("Sum", *sums) if len(sums) > 1 else sums[0]
    finite = e.Equal(e.Sub(total, total), e.const(np.array(0.0, np.float32)))
    finite.dtype, finite.shape = ir.DataType.BOOL, ir.Shape([])
    return finite


def next_scale(e, scaled: Scaled, scaling: LossScaling, finite: ir.Value, applied: ir.Value | None) -> list[ir.Value]:
    """The outputs ``Loss_Scale.updated`` and ``Loss_Scale_Good_Steps.updated`` (dynamic only).
    ``applied``: whether this run updates the weights (None: always)."""
    if not scaling.dynamic:
        return []
    scale, good = scaled.inputs
    one = e.const(np.array(1, np.int64))
    zero = e.const(np.array(0, np.int64))
    counted = e.Add(good, one)
    grow = e.GreaterOrEqual(counted, e.const(np.array(scaling.growth_interval, np.int64)))
    grown = e.Where(grow, e.Mul(scale, e.const(np.array(scaling.growth, np.float32))), scale)
    new_scale = e.Where(finite, grown, e.Mul(scale, e.const(np.array(scaling.backoff, np.float32))))
    new_good = e.Where(finite, e.Where(grow, zero, counted), zero)
    if applied is not None:
        new_scale, new_good = e.Where(applied, new_scale, scale), e.Where(applied, new_good, good)
    return [named_output(e, new_scale, updated(SCALE), scale),
            named_output(e, new_good, updated(GOOD_STEPS), good)]
