"""Flat state: the weights of one dtype and one set of optimizer options held as one 1-D
buffer (a *group*), and so their gradients, accumulation buffers and optimizer states, so that
a step's update is a fixed handful of element-wise nodes per group whatever the number of
weight tensors (as PyTorch's multi-tensor optimizers, without pointers).

The graph side, in a step graph:

- the forward reads each member of a group from the buffer: one ``Split`` of the buffer, a
  ``Reshape`` (which aliases) per member of rank other than 1; under mixed precision one
  ``Cast`` of the whole buffer to the half type and one ``Split`` of that, where a member was
  read in half precision (instead of one Cast per weight);
- the gradients of the members are joined into the group's gradient ``Weights.<dtype>_grad``
  by one ``Concat`` (runs of members whose gradients come back from half precision are joined
  in half and cast once);
- every later stage (unscaling, the finiteness check, accumulation, clipping, the optimizer)
  sees the group as one weight named :func:`group_name` with one gradient.

:func:`layout` decides the groups; the runtime keeps each member as a view of its group's
buffer (``runtime.state``), so that everything that reads or writes a weight, an optimizer
state or an accumulation buffer by name sees the same values as without groups.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import numpy as np

from ...interface import FLAT_WEIGHTS, GRADIENT


@dataclasses.dataclass(frozen=True)
class Member:
    name: str  # the weight
    offset: int  # its first element in the group's buffer
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class Group:
    name: str  # the buffer: Weights.<dtype>, Weights.<dtype>.<k> for the k-th options of that dtype
    dtype: np.dtype
    members: tuple[Member, ...]

    @property
    def size(self) -> int:
        last = self.members[-1]
        return last.offset + last.size

    @property
    def sizes(self) -> list[int]:
        return [m.size for m in self.members]


def group_name(dtype: np.dtype, index: int) -> str:
    """``Weights.float32`` for the first group of a dtype, ``Weights.float32.1`` for the next."""
    return f"{FLAT_WEIGHTS}.{np.dtype(dtype).name}" + (f".{index}" if index else "")


# Weights of more elements stay tensors of their own, updated apart: reading a weight from its
# group copies it once a step (the Split) and joining the gradients copies them (the Concat),
# which costs nothing next to the launches it saves for the many small tensors of a layer, but
# doubles the step's memory for an embedding table of gigabytes (tests/test_large_models.py).
LARGEST = 1 << 24


def layout(specs: Mapping[str, np.ndarray], options_of: Callable[[str], dict], optimizer: str) -> list[Group]:
    """The groups of the weights ``specs`` (name -> an array of its dtype and shape), in their
    order: one per dtype and set of options (``options_of(weight)``); none for LAMB, whose
    trust ratio is per weight; weights with no element or more than LARGEST stay apart."""
    if optimizer == "lamb":
        return []
    keyed: dict[tuple, list[str]] = {}
    for name, spec in specs.items():
        if 0 < int(np.prod(spec.shape, dtype=np.int64)) <= LARGEST:
            keyed.setdefault((np.dtype(spec.dtype).str, repr(sorted(options_of(name).items()))), []).append(name)
    groups, per_dtype = [], {}
    for (dtype, _), names in keyed.items():
        index = per_dtype[dtype] = per_dtype.get(dtype, -1) + 1
        members, offset = [], 0
        for n in names:
            members.append(Member(n, offset, tuple(int(d) for d in specs[n].shape)))
            offset += members[-1].size
        groups.append(Group(group_name(dtype, index), np.dtype(dtype), tuple(members)))
    return groups


# ----------------------------------------------------------------------------- the graph
def flatten(e, groups: list[Group], weights: list, grads: dict, low=None) -> tuple[list, dict, list]:
    """Rewrite a differentiated graph so that the members of ``groups`` are read from their
    group's buffer: returns (the weights the later stages see: each group's buffer, a graph
    input, in place of its members, then the other weights; their gradients by name; the
    buffers, to add to the graph's inputs). ``low``: the half type of mixed precision, or
    None. The members stop being graph inputs."""
    from ...compiler.passes import new_input

    by_name = {w.name: w for w in weights}
    graph = e.graph
    buffers, flat_grads = [], {}
    for group in groups:
        members = [by_name[m.name] for m in group.members]
        buffer = new_input(e, group.name, members[0].dtype, [group.size])
        views = _views(e, buffer, group)
        half = None
        for member, w, view in zip(group.members, members, views):
            reads = _half_reads(w, low) if low is not None else []
            if reads:
                half = half or _views(e, e.Cast(buffer, to=int(low)), group)
                for cast, transpose in reads:
                    value = half[group.members.index(member)]
                    if transpose is not None:  # the export's W^T read in half: the half view transposed
                        value = e.Transpose(value, perm=list(transpose.attributes["perm"].value))
                    cast.outputs[0].replace_all_uses_with(value)
            w.replace_all_uses_with(view)
            if w in graph.inputs:
                graph.inputs.remove(w)
            graph.initializers.pop(w.name, None)
        joined = _joined(e, group, [grads[m.name] for m in group.members], members[0].dtype, low)
        joined.name = e.unique(group.name + GRADIENT)  # Weights.float32_grad, as a weight's W_grad
        flat_grads[group.name] = joined
        buffers.append(buffer)
    graph.sort()  # the views before their readers
    grouped = {m.name for g in groups for m in g.members}
    rest = [w for w in weights if w.name not in grouped]
    return buffers + rest, {**flat_grads, **{w.name: grads[w.name] for w in rest}}, buffers


def _views(e, buffer, group: Group) -> list:
    """Each member of ``group`` read from ``buffer`` (its type): Split, then Reshape."""
    parts = e.split_into(buffer, len(group.members), 0, e.ints(group.sizes)) if len(group.members) > 1 else [buffer]
    return [p if len(m.shape) == 1 else e.Reshape(p, list(m.shape)) for p, m in zip(parts, group.members)]


def _half_reads(w, low) -> list:
    """(Cast to ``low``, None) for each Cast that reads ``w``, and (Cast, Transpose) for each
    Cast that reads a Transpose of ``w`` (a torch export's ``W^T``) read by Casts only."""
    reads = []
    for node, _ in w.uses():
        if _casts_to(node, low):
            reads.append((node, None))
        elif node.op_type == "Transpose" and node.domain in ("", "ai.onnx") and "perm" in node.attributes:
            out = node.outputs[0]
            uses = [u for u, _ in out.uses()]
            if uses and not out.is_graph_output() and all(_casts_to(u, low) for u in uses):
                reads.extend((u, node) for u in uses)
    return reads


def _casts_to(node, low) -> bool:
    to = node.attributes.get("to")
    return node.op_type == "Cast" and node.domain in ("", "ai.onnx") and to is not None and to.value == int(low)


def _joined(e, group: Group, grads: list, dtype, low):
    """The members' gradients as one 1-D tensor of ``dtype``: each as a row [1, size] (a
    gradient that a Reshape made from such a row, as a bias's sum over the batch is, taken
    before that Reshape), joined along the rows' axis, then made 1-D; consecutive ones that are
    casts from ``low`` are joined in ``low`` and cast once."""
    parts, run = [], []

    def flush():
        if run:
            joined = e.Concat(*run, axis=1) if len(run) > 1 else run[0]
            parts.append(e.Cast(joined, to=int(dtype)))
            run.clear()

    for member, g in zip(group.members, grads):
        producer = g.producer()
        source = producer.inputs[0] if producer is not None and low is not None and producer.op_type == "Cast" else None
        if source is not None and source.dtype == low:
            run.append(_row(e, source, member))
            continue
        flush()
        parts.append(_row(e, g, member))
    flush()
    joined = e.Concat(*parts, axis=1) if len(parts) > 1 else parts[0]
    return e.Reshape(joined, [-1])


def _row(e, value, member: Member):
    """``value`` as a row [1, size]: what a Reshape read, when it read a row or any tensor it
    reshaped; else one Reshape."""
    from ...compiler.values import dims_of

    producer = value.producer()
    if producer is not None and producer.op_type == "Reshape" and producer.domain in ("", "ai.onnx"):
        value = producer.inputs[0]
        if dims_of(value) == (1, member.size):
            return value
    return e.Reshape(value, [1, -1])
