"""Control flow: If.

The gradient of an ``If`` is an ``If`` on the same condition: each branch of the backward
node recomputes its forward branch and walks back through it, from the gradients of the
node's outputs to the outer values the branch reads. Only the taken branch runs, so the
gradient flows through the taken branch alone; values a branch does not read get zeros.
"""

from gradbuilder.autodiff import node_inputs, walk
from gradbuilder.registry import register


def _backward_branch(n, branch, wanted, dys, e):
    """A copy of ``branch`` extended with the gradients of ``wanted`` as its outputs."""
    g = branch.clone(allow_outer_scope_values=True)
    g.name = e.unique(f"{branch.name or 'branch'}_grad")
    for node in g:
        node.name = e.unique(f"{node.name or node.op_type}_bw")
        for out in node.outputs:
            out.name = e.unique(f"{out.name}_bw")
    sub = e.child(g)
    seeds = {out: dy for out, dy in zip(g.outputs, dys) if dy is not None}
    grads = walk(g, wanted, seeds, sub.opset, sub)
    outputs = []
    for v in wanted:
        grad = grads.get(v)
        if grad is None:
            grad = sub.zeros_like(v)
        if grad.producer() is None or grad.producer().graph is not g or grad in outputs:
            grad = sub.Identity(grad)  # a branch output must be produced inside the branch
        sub._set(grad, v.dtype, None)
        grad.shape = v.shape
        outputs.append(grad)
    g.outputs.clear()
    g.outputs.extend(outputs)
    return g


@register("If")
def if_(n, dys, needs, e):
    """d If(c, then, else) = If(c, d then, d else), each branch differentiated on its own."""
    ins = node_inputs(n)
    wanted = [v for v, need in zip(ins, needs) if need]
    if not wanted:
        return [None] * len(ins)
    then_g = _backward_branch(n, n.attributes["then_branch"].value, wanted, dys, e)
    else_g = _backward_branch(n, n.attributes["else_branch"].value, wanted, dys, e)
    outs = e.op("If", n.inputs[0], outputs=len(wanted), then_branch=then_g, else_branch=else_g)
    outs = outs if isinstance(outs, tuple) else (outs,)
    by_value = dict(zip(wanted, outs))
    for v, o in by_value.items():
        e._set(o, v.dtype, None)
    return [by_value.get(v) if need else None for v, need in zip(ins, needs)]
