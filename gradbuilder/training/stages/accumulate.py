"""Gradient accumulation over ``steps`` micro-steps.

Each weight ``W`` gets a buffer input ``W.grad_accum`` and output ``W.grad_accum.updated``;
a counter input ``Accumulation_Step`` (int64 scalar, micro-steps done since the last update,
0 at the start) and output ``Accumulation_Step.updated``. On micro-steps 1..steps-1 the buffer
sums the gradients; on the last one the optimizer sees the sum (as torch's repeated
``backward()`` calls accumulate ``.grad``), the buffer returns to zero and the counter to 0.
With ``keep`` (a bool scalar), a micro-step where it is false leaves buffers and counter as
they were (a micro-step whose gradients are not finite is dropped).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ...compiler.passes import guarded, named_output, new_input
from ...interface import ACCUMULATION_STEP, grad_accum, updated
from . import Appended

COUNTER = ACCUMULATION_STEP


def accumulate(e, weights: list[ir.Value], grads: dict[str, ir.Value], steps: int,
               keep: ir.Value | None = None) -> Appended:
    """``grads``: the sum on the last micro-step; ``apply``: this micro-step completes the
    accumulation."""
    counter = new_input(e, COUNTER, ir.DataType.INT64, [])
    done = e.Add(counter, e.const(np.array(1, np.int64)))
    last = e.Equal(done, e.const(np.array(steps, np.int64)))
    inputs, buffers, summed = [counter], [], {}
    for w in weights:
        name = grad_accum(w.name)
        buf = new_input(e, name, w.dtype, w.shape)
        inputs.append(buf)
        total = e.Add(buf, grads[w.name])
        summed[w.name] = total
        buffers.append(named_output(e, guarded(e, keep, e.Where(last, e.zeros_like(w), total), buf), updated(name), w))
    next_counter = guarded(e, keep, e.Where(last, e.const(np.array(0, np.int64)), done), counter)
    if keep is not None:
        last = e.And(last, keep)
    outputs = buffers + [named_output(e, next_counter, updated(COUNTER), counter)]
    return Appended(summed, inputs, outputs, apply=last)
