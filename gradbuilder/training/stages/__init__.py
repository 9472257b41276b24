"""The stages that append graph after the gradients, in the order the training graph runs
them: loss scaling (``loss_scale``: the loss scaled before the backward, the gradients
unscaled after it, the finiteness check), accumulation (``accumulate``), clipping (``clip``)
and the optimizer (``optimizer``: one registry entry per optimizer).

They are not rewrites of the forward graph: each appends nodes through the emitter ``e`` and
has one shape, ``stage(e, weights, grads, <its options>) -> Appended``: ``weights`` the
trained ir.Values, ``grads`` weight name -> gradient; it returns the gradients the next stage
sees, the graph inputs and outputs it adds (state ``X`` with its output ``X.updated``), and,
where it decides it, whether this run updates the weights (``apply``).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Appended:
    grads: dict  # weight name -> the gradient the next stage sees (ir.Value)
    inputs: list = dataclasses.field(default_factory=list)  # graph inputs added (ir.Value)
    outputs: list = dataclasses.field(default_factory=list)  # graph outputs added (ir.Value)
    apply: object = None  # bool scalar ir.Value: this run updates the weights (None: always)
