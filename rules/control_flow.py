"""Control flow: If, Loop, Scan.

The gradient of an ``If`` is an ``If`` on the same condition: each branch of the backward
node recomputes its forward branch and walks back through it, from the gradients of the
node's outputs to the outer values the branch reads. Only the taken branch runs, so the
gradient flows through the taken branch alone; values a branch does not read get zeros.

The gradient of a ``Loop`` or ``Scan`` is a ``Scan`` that runs the forward iterations in
reverse. The forward node also returns the values each iteration started from (its
"trips", added by ``passes.store_trips``); backward iteration t takes trip t, recomputes
forward iteration t from it and walks back through it:

    d carried_in(t) = d body(t) / d carried_in  applied to  d carried_out(t)
    d outer         = sum over t of  d body(t) / d outer

Gradients of the carried values are the backward Scan's states (seeded with the gradients
of the loop's final values), gradients of the outer values the body reads are summed in
further states, and gradients of Scan's scan inputs leave as its scan outputs.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx_ir as ir

from gradbuilder.compiler.autodiff import walk
from gradbuilder.compiler.traversal import is_float, node_inputs
from gradbuilder.errors import GradientRuleError
from gradbuilder.compiler.registry import TRIPS, register
from gradbuilder.compiler.values import attr
from gradbuilder.rules.helpers import rank_of


def _clone(graph: ir.Graph, e, suffix: str) -> ir.Graph:
    """A copy of ``graph`` (reading the same outer values) with names unique in the model."""
    g = graph.clone(allow_outer_scope_values=True)
    g.name = e.unique(f"{graph.name or 'body'}_{suffix}")
    for node in ir.traversal.RecursiveGraphIterator(g):
        node.name = e.unique(f"{node.name or node.op_type}_{suffix}")
        for out in node.outputs:
            out.name = e.unique(f"{out.name}_{suffix}")
    for v in g.inputs:
        v.name = e.unique(f"{v.name}_{suffix}")
    return g


def _seed(seeds: dict, value: ir.Value, dy: ir.Value | None, sub) -> None:
    """Add ``dy`` to the gradient seeded at ``value`` (a value of ``sub``'s graph)."""
    if dy is None:
        return
    if value not in seeds:
        seeds[value] = dy
        return
    with sub.math():
        seeds[value] = seeds[value] + dy


def _or_zeros(grads: dict, v: ir.Value, sub) -> ir.Value:
    grad = grads.get(v)
    return grad if grad is not None else sub.zeros_like(v)


def _as_outputs(g: ir.Graph, grads: list[ir.Value], likes: list[ir.Value], sub, shapes=None) -> None:
    """Set ``grads`` as ``g``'s outputs: each produced inside ``g``, distinct, typed like ``likes``
    (shaped ``shapes`` where given)."""
    outputs = []
    for k, (grad, like) in enumerate(zip(grads, likes)):
        if grad.producer() is None or grad.producer().graph is not g or grad in outputs:
            grad = sub.Identity(grad)  # a subgraph output must be produced inside the subgraph
        sub.typed(grad, like.dtype, None)
        shape = shapes[k] if shapes is not None else like.shape
        if shape is not None:
            grad.shape = shape
        outputs.append(grad)
    g.outputs.clear()
    g.outputs.extend(outputs)


def _input_like(like: ir.Value, name: str, shape: ir.Shape | None = None) -> ir.Value:
    return ir.Value(name=name, type=ir.TensorType(like.dtype) if like.dtype is not None else None,
                    shape=shape if shape is not None else like.shape)


def _declared(like: ir.Value, rank: int | None) -> ir.Shape:
    """The shape a backward Scan body output is declared with: onnxruntime's Scan needs a
    rank for every body output. ``like``'s shape, else ``rank`` unknown sizes, else one axis
    (a value of unknown rank travels flattened)."""
    if like.shape is not None:
        return like.shape
    return ir.Shape([None] * rank if rank is not None else [None])


def _flat(e, v: ir.Value) -> ir.Value:
    return e.Reshape(v, e.ints([-1]))


# ----------------------------------------------------------------------------- If


def _backward_branch(branch, wanted, dys, e):
    """A copy of ``branch`` extended with the gradients of ``wanted`` as its outputs, each
    declared with the shape the branch computes for it, not ``wanted``'s: a branch that never
    runs may disagree with the If's declared output (torch's ``squeeze(dim)``: If(size == 1,
    Squeeze, Identity) declared squeezed), and its gradient with it."""
    g = _clone(branch, e, "bw")
    sub = e.child(g)
    seeds: dict = {}
    for out, dy in zip(g.outputs, dys):
        _seed(seeds, out, dy, sub)
    grads = walk(g, wanted, seeds, sub)
    _as_outputs(g, [_or_zeros(grads, v, sub) for v in wanted], wanted, sub, shapes=[None] * len(wanted))
    return g


@register("If")
def if_(n, dys, needs, e):
    """d If(c, then, else) = If(c, d then, d else), each branch differentiated on its own."""
    ins = node_inputs(n)
    wanted = [v for v, need in zip(ins, needs) if need]
    if not wanted:
        return [None] * len(ins)
    then_g = _backward_branch(n.attributes["then_branch"].value, wanted, dys, e)
    else_g = _backward_branch(n.attributes["else_branch"].value, wanted, dys, e)
    outs = e.op("If", n.inputs[0], outputs=len(wanted), then_branch=then_g, else_branch=else_g)
    outs = outs if isinstance(outs, tuple) else (outs,)
    by_value = dict(zip(wanted, outs))
    for v, o in by_value.items():
        e.typed(o, v.dtype, None)
    return [by_value.get(v) if need else None for v, need in zip(ins, needs)]


# ----------------------------------------------------------------------------- Loop, Scan


class Carried(NamedTuple):
    """A float loop-carried value: its gradient is a state of the backward Scan."""

    inside: ir.Value  # the body input
    out: ir.Value  # the body output
    init: ir.Value  # the outer initial value
    d_final: ir.Value | None  # the gradient of the loop's final value


class Stacked(NamedTuple):
    """A value the backward Scan reads one slice per iteration: a feed (body input ``index``,
    the outer stacked value: the trips, Scan's scan inputs) or a scan seed (body output
    ``index``, the gradient of the outer stacked output)."""

    index: int
    value: ir.Value | None
    axis: int
    direction: int


class Sliced(NamedTuple):
    """A scan input (body input ``index``) whose gradient leaves as a scan output."""

    index: int
    axis: int
    direction: int


class _LoopParts(NamedTuple):
    """What a backward Scan is built from (see _reverse_scan)."""

    carried: list[Carried]
    feeds: list[Stacked]
    scan_seeds: list[Stacked]
    slice_grads: list[Sliced]
    outer: list[ir.Value]


class _Ranks(NamedTuple):
    """The ranks of the backward Scan's states (carried values), sums (outer values) and scan
    outputs (scan input slices); None where unknown: that value travels flattened to one axis."""

    states: list
    sums: list
    slices: list

    def all(self) -> list:
        return self.states + self.sums + self.slices


def _reverse_scan(n, e, at, *, carried: list[Carried], feeds: list[Stacked], scan_seeds: list[Stacked],
                  slice_grads: list[Sliced], outer: list[ir.Value]):
    """The backward Scan of a loop node ``n`` whose body is ``n.attributes['body']``.

    carried:     the float loop-carried values: their gradients are the backward states
    feeds:       values fed per iteration in reverse (the trips, and Scan's scan inputs)
    scan_seeds:  the gradients of the stacked (scan) outputs
    slice_grads: the scan inputs whose gradients leave as scan outputs
    outer:       outer values the body reads whose gradients are summed
    The Scan is emitted with the emitter ``at``. Returns (d initial carried values,
    d scan inputs, d outer values).
    """
    parts = _LoopParts(carried, feeds, scan_seeds, slice_grads, outer)
    ranks = _travel_ranks(n, parts)
    g = _backward_body(n, e, parts, ranks)
    outs = _emit_backward_scan(n, at, g, parts, ranks)
    k = len(carried)
    return outs[:k], outs[k + len(outer):], outs[k:k + len(outer)]


def _travel_ranks(n, parts: _LoopParts) -> _Ranks:
    """The ranks the backward Scan's values travel with: a carried value, outer value or scan
    input of unknown rank travels through the backward Scan flattened to one axis, and takes its
    shape back after it (an error for a scan input of unknown rank scanned along another axis)."""
    body = n.attributes["body"].value
    slice_ranks = [_slice_rank(n, body, s) for s in parts.slice_grads]
    for s, r in zip(parts.slice_grads, slice_ranks):
        if r is None and s.axis != 0:
            raise GradientRuleError(
                f"the rank of scan input '{n.inputs[s.index].name}' is unknown and it is scanned along axis "
                f"{s.axis}; declare its shape (at least its rank) in the model")
    return _Ranks([rank_of(c.inside, c.out, c.init) for c in parts.carried], [rank_of(v) for v in parts.outer],
                  slice_ranks)


def _slice_rank(n, body, s: Sliced):
    """The rank of one slice of scan input ``s``: its body input's, else the outer input's less one."""
    if body.inputs[s.index].shape is not None:
        return rank_of(body.inputs[s.index])
    r = rank_of(n.inputs[s.index])
    return r - 1 if r is not None else None


def _backward_body(n, e, parts: _LoopParts, ranks: _Ranks) -> ir.Graph:
    """The backward Scan's body: a copy of the forward body reading (d states, d sums, the fed
    values, d scan outputs) and returning (d states, d sums, d scan inputs) one iteration back."""
    body = n.attributes["body"].value
    g = _clone(body, e, "bw")
    sub = e.child(g)
    d_states = [_input_like(c.inside, e.unique(f"{c.inside.name}_dstate"), _declared(c.inside, r))
                for c, r in zip(parts.carried, ranks.states)]
    d_outer = [_input_like(v, e.unique(f"{v.name}_dsum"), _declared(v, r)) for v, r in zip(parts.outer, ranks.sums)]
    fed_inputs = [g.inputs[f.index] for f in parts.feeds]
    d_slices = [_input_like(body.outputs[s.index], e.unique(f"{body.outputs[s.index].name}_dslice"))
                for s in parts.scan_seeds]
    grads = _walk_body(body, g, sub, parts, ranks, d_states, d_slices)
    outputs = _stepped_back(body, g, sub, grads, parts, ranks, d_outer)
    g.inputs.clear()
    g.inputs.extend(d_states + d_outer + fed_inputs + d_slices)
    likes = [c.inside for c in parts.carried] + list(parts.outer) + [body.inputs[s.index] for s in parts.slice_grads]
    _as_outputs(g, outputs, likes, sub, [_declared(v, r) for v, r in zip(likes, ranks.all())])
    return g


def _walk_body(body, g, sub, parts: _LoopParts, ranks: _Ranks, d_states, d_slices) -> dict:
    """The gradients of the body copy ``g``'s carried inputs, sliced inputs and outer values, from
    the d states at the carried outputs (reshaped to them where they travel flattened) and the
    d scan outputs at the scan outputs."""
    index = {v: i for i, v in enumerate(body.inputs)}
    seeds: dict = {}
    for c, d, r in zip(parts.carried, d_states, ranks.states):
        target = g.outputs[body.outputs.index(c.out)]
        _seed(seeds, target, d if r is not None else sub.Reshape(d, sub.Shape(target)), sub)
    for s, d in zip(parts.scan_seeds, d_slices):
        _seed(seeds, g.outputs[s.index], d, sub)
    wanted = [g.inputs[index[c.inside]] for c in parts.carried]
    wanted += [g.inputs[s.index] for s in parts.slice_grads] + list(parts.outer)
    return walk(g, list(dict.fromkeys(wanted)), seeds, sub)


def _stepped_back(body, g, sub, grads: dict, parts: _LoopParts, ranks: _Ranks, d_outer) -> list:
    """The backward body's outputs from the gradients ``grads``: d carried values one iteration
    back (zeros where the body does not read one), the sums plus this iteration's share, the
    d scan inputs; each flattened where its rank is unknown."""
    index = {v: i for i, v in enumerate(body.inputs)}
    fed = {f.index for f in parts.feeds}

    def flat_unless(v, rank):
        return v if rank is not None else _flat(sub, v)

    new_states = []
    for c, r in zip(parts.carried, ranks.states):
        v = g.inputs[index[c.inside]]
        # a carried value the body never reads is not fed: its zeros take the body output's shape
        grad = grads[v] if v in grads else sub.zeros_like(v if index[c.inside] in fed else
                                                            g.outputs[body.outputs.index(c.out)])
        new_states.append(flat_unless(grad, r))
    with sub.math():
        new_sums = [s + flat_unless(grads[v], r) if v in grads else s
                    for s, v, r in zip(d_outer, parts.outer, ranks.sums)]
    slices = [flat_unless(_or_zeros(grads, g.inputs[s.index], sub), r)
              for s, r in zip(parts.slice_grads, ranks.slices)]
    return new_states + new_sums + slices


def _emit_backward_scan(n, at, g, parts: _LoopParts, ranks: _Ranks) -> list:
    """The backward Scan over body ``g``, emitted with ``at``: it starts from the d final values
    and zero sums, reads the feeds and scan seeds in reverse, and its outputs take back the
    shapes of the values they are the gradients of."""
    init_states, init_sums = _initial_states(at, parts.carried, parts.outer)
    init_states = [v if r is not None else _flat(at, v) for v, r in zip(init_states, ranks.states)]
    init_sums = [v if r is not None else _flat(at, v) for v, r in zip(init_sums, ranks.sums)]
    scanned = parts.feeds + parts.scan_seeds  # read in reverse
    outs = at.op(
        "Scan", *init_states, *init_sums, *[s.value for s in scanned],
        outputs=len(parts.carried) + len(parts.outer) + len(parts.slice_grads),
        body=g,
        num_scan_inputs=len(scanned),
        scan_input_axes=[s.axis for s in scanned],
        scan_input_directions=[1 - s.direction for s in scanned],
        scan_output_axes=[s.axis for s in parts.slice_grads] or None,
        scan_output_directions=[1 - s.direction for s in parts.slice_grads] or None,
    )
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    outer_likes = ([c.init for c in parts.carried] + list(parts.outer)
                   + [n.inputs[s.index] for s in parts.slice_grads])
    for k, (like, r) in enumerate(zip(outer_likes, ranks.all())):
        if r is None:  # back to the shape of the value it is the gradient of
            outs[k] = at.Reshape(outs[k], at.Shape(like))
        at.typed(outs[k], like.dtype, None)
    return outs


def _initial_states(e, carried, outer):
    """The backward states before the last forward iteration: d final values, zero sums."""
    return ([c.d_final if c.d_final is not None else e.zeros_like(c.init) for c in carried],
            [e.zeros_like(v) for v in outer])


def _if_any_trip(e, trips: ir.Value, ran, skipped, likes: list[ir.Value]) -> list[ir.Value]:
    """If(len(trips) > 0, ran(emitter), skipped(emitter)): onnxruntime's Scan refuses empty
    scan inputs, and a Loop may run no iteration at all."""
    count = e.Squeeze(e.Shape(trips, 0, 1), [0])
    ran_any = e.Greater(count, e.const(np.array(0, dtype=np.int64)))
    return e.if_(ran_any, ran, skipped, likes, name="loop_grad_branch")


def _trips(n) -> list[int]:
    trips = n.meta.get(TRIPS)
    if trips is None:
        raise GradientRuleError(f"{n.op_type} was not prepared for differentiation (its trips are missing)")
    return trips


def _outer_wanted(n, needs):
    captured = node_inputs(n)[len(n.inputs):]
    return [v for v, need in zip(captured, needs[len(n.inputs):]) if need]


def _with_outer(n, needs, grads_by_input: dict[int, ir.Value], outer, d_outer):
    """One gradient per node input (``grads_by_input``) then per captured value."""
    captured = node_inputs(n)[len(n.inputs):]
    by_value = dict(zip(outer, d_outer))
    result = [grads_by_input.get(i) if needs[i] else None for i in range(len(n.inputs))]
    return result + [by_value.get(v) for v in captured]


@register("Loop")
def loop(n, dys, needs, e):
    """Loop(M, cond, v0) with body (i, c, v) -> (c', v', s): the backward Scan runs the trips
    in reverse, carrying dv from d v_final down to d v0 and summing the outer values' gradients."""
    body = n.attributes["body"].value
    trips = _trips(n)
    n_carried = len(body.inputs) - 2
    n_scan = len(body.outputs) - 1 - n_carried - len(trips)
    first_trip = n_carried + n_scan
    carried = [Carried(body.inputs[2 + k], body.outputs[1 + k], n.inputs[2 + k], dys[k])
               for k in range(n_carried) if is_float(body.inputs[2 + k])]
    feeds = [Stacked(i, n.outputs[first_trip + k], 0, 0) for k, i in enumerate(trips)]
    scan_seeds = [Stacked(1 + n_carried + k, dys[n_carried + k], 0, 0) for k in range(n_scan)
                  if dys[n_carried + k] is not None]
    outer = _outer_wanted(n, needs)

    def ran(at):
        d_carried, _, d_outer = _reverse_scan(n, e, at, carried=carried, feeds=feeds, scan_seeds=scan_seeds,
                                              slice_grads=[], outer=outer)
        return d_carried + d_outer

    def skipped(at):
        init_states, init_sums = _initial_states(at, carried, outer)
        return init_states + init_sums

    likes = [c.init for c in carried] + outer
    outs = _if_any_trip(e, n.outputs[first_trip], ran, skipped, likes)
    d_carried, d_outer = outs[:len(carried)], outs[len(carried):]
    by_input = {list(body.inputs).index(c.inside): d for c, d in zip(carried, d_carried)}
    return _with_outer(n, needs, by_input, outer, d_outer)


@register("Scan", since=9)
def scan(n, dys, needs, e):
    """Scan(states0, xs) with body (s, x_t) -> (s', y_t): the backward Scan runs the trips in
    reverse over the same axes, carrying ds and returning dx_t per step as its scan outputs."""
    body = n.attributes["body"].value
    trips = _trips(n)
    m = attr(n, "num_scan_inputs", 0)
    n_states = len(n.inputs) - m
    n_scan = len(body.outputs) - n_states - len(trips)
    in_axes = list(attr(n, "scan_input_axes", [0] * m))
    in_dirs = list(attr(n, "scan_input_directions", [0] * m))
    out_axes = list(attr(n, "scan_output_axes", [0] * (n_scan + len(trips))))
    out_dirs = list(attr(n, "scan_output_directions", [0] * (n_scan + len(trips))))
    first_trip = n_states + n_scan
    carried = [Carried(body.inputs[k], body.outputs[k], n.inputs[k], dys[k])
               for k in range(n_states) if is_float(body.inputs[k])]
    feeds = [Stacked(i, n.outputs[first_trip + k], 0, 0) for k, i in enumerate(trips)]
    feeds += [Stacked(n_states + j, n.inputs[n_states + j], in_axes[j], in_dirs[j]) for j in range(m)]
    scan_seeds = [Stacked(n_states + k, dys[n_states + k], out_axes[k], out_dirs[k]) for k in range(n_scan)
                  if dys[n_states + k] is not None]
    wanted_slices = [j for j in range(m) if needs[n_states + j]]
    slice_grads = [Sliced(n_states + j, in_axes[j], in_dirs[j]) for j in wanted_slices]
    outer = _outer_wanted(n, needs)
    d_carried, d_slices, d_outer = _reverse_scan(n, e, e, carried=carried, feeds=feeds, scan_seeds=scan_seeds,
                                                 slice_grads=slice_grads, outer=outer)
    by_input = {list(body.inputs).index(c.inside): d for c, d in zip(carried, d_carried)}
    by_input.update({n_states + j: d for j, d in zip(wanted_slices, d_slices)})
    return _with_outer(n, needs, by_input, outer, d_outer)
