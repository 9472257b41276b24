"""The Reduce family. Each gradient is ``dy`` restored to the input's rank, broadcast back,
times the local derivative of the reduction."""

from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr, constant_of, dims_of
from gradbuilder.rules.norm_stats import count_over


def reduce_axes(n):
    """(axes, keepdims, noop): axes a list of ints, an ir.Value (dynamic), or None for 'all'."""
    keepdims = attr(n, "keepdims", 1)
    noop = attr(n, "noop_with_empty_axes", 0)
    if len(n.inputs) > 1 and n.inputs[1] is not None:
        const = constant_of(n.inputs[1])
        axes = [int(a) for a in const.reshape(-1)] if const is not None else n.inputs[1]
    else:
        axes = attr(n, "axes")
    if isinstance(axes, list) and not axes:
        axes = None
    return axes, keepdims, noop


def restore(n, v, e):
    """``v``, shaped like the node's reduced output, in keepdims form, expanded to the input."""
    x = n.inputs[0]
    axes, keepdims, _ = reduce_axes(n)
    if not keepdims:
        dims = dims_of(x)
        if axes is None and dims is not None:
            v = e.Reshape(v, [1] * len(dims))
        elif isinstance(axes, list) and dims is not None:
            v = e.Unsqueeze(v, sorted(a % len(dims) for a in axes))
        else:
            v = e.op("Reshape", v, e.Shape(e.reduce("ReduceSum", x, axes, keepdims=True)))
    return e.expand_like(v, x)


def _reduction(local):
    """Rule for a reduction whose input gradient is ``local(n, e, x, restored dy, restored y)``.

    When no axes are given and noop_with_empty_axes=1 the op is the identity on its
    elements (or elementwise, for L1/L2/SumSquare/LogSum), handled by ``local`` with
    ``y`` = the output itself and ``ties`` irrelevant.
    """

    def rule(n, dys, needs, e):
        (dy,) = dys
        axes, _, noop = reduce_axes(n)
        x, y = n.inputs[0], n.outputs[0]
        if axes is None and noop:
            return (local(n, e, x, dy, y, True),)
        return (local(n, e, x, restore(n, dy, e), restore(n, y, e), False),)

    rule.__doc__ = local.__doc__
    return rule


def _same(n, e, op, v):
    """``op`` over the node's axes with keepdims, applied to ``v`` (shaped like the input)."""
    axes, _, _ = reduce_axes(n)
    return e.reduce(op, v, axes, keepdims=True)


def _d_sum(n, e, x, dy, y, noop):
    """d sum(x) = dy"""
    return dy


def _d_mean(n, e, x, dy, y, noop):
    """d mean(x) = dy / count (a constant where the sizes are known)"""
    if noop:
        return dy
    axes, _, _ = reduce_axes(n)
    dims = dims_of(x)
    if axes is None and dims is not None:
        axes = list(range(len(dims)))
    return dy / count_over(e, x, axes, n.outputs[0])


def _d_extreme(n, e, x, dy, y, noop):
    """max/min: dy goes to the elements equal to the result, shared evenly between ties"""
    if noop:
        return dy
    mask = e.CastLike(e.Equal(x, y), x)
    return dy * mask / e.expand_like(_same(n, e, "ReduceSum", mask), x)


def _d_l2(n, e, x, dy, y, noop):
    """d sqrt(sum x^2) = dy * (x / y)  (0 where y = 0)"""
    if noop:
        return dy * e.Sign(x)
    safe = e.Where(e.Equal(y, e.scalar(0.0, x)), e.scalar(1.0, x), y)
    return dy * (x / safe)


def _d_l1(n, e, x, dy, y, noop):
    """d sum|x| = dy * sign(x)"""
    return dy * e.Sign(x)


def _d_sum_square(n, e, x, dy, y, noop):
    """d sum x^2 = dy * (2 x)"""
    return dy * (2 * x)


def _d_log_sum_exp(n, e, x, dy, y, noop):
    """d log(sum exp x) = dy * exp(x - y)"""
    if noop:
        return dy
    return dy * e.Exp(x - y)


def _d_log_sum(n, e, x, dy, y, noop):
    """d log(sum x) = dy / sum(x) = dy / exp(y)"""
    if noop:
        return dy / x
    return dy / e.Exp(y)


def _d_prod(n, e, x, dy, y, noop):
    """d prod(x) / dx_i = product of the other elements (exact when some x are zero)"""
    if noop:
        return dy
    zero, one = e.scalar(0.0, x), e.scalar(1.0, x)
    is_zero = e.Equal(x, zero)
    x_nz = e.Where(is_zero, one, x)
    prod_nz = e.expand_like(_same(n, e, "ReduceProd", x_nz), x)
    zeros = e.expand_like(_same(n, e, "ReduceSum", e.CastLike(is_zero, x)), x)
    others = e.Where(
        is_zero,
        e.Where(e.Equal(zeros, one), prod_nz, zero),  # the only zero: product of the rest
        e.Where(e.Equal(zeros, zero), prod_nz / x_nz, zero),
    )
    return dy * others


for _name, _fn in {
    "ReduceSum": _d_sum,
    "ReduceMean": _d_mean,
    "ReduceMax": _d_extreme,
    "ReduceMin": _d_extreme,
    "ReduceL2": _d_l2,
    "ReduceL1": _d_l1,
    "ReduceSumSquare": _d_sum_square,
    "ReduceLogSumExp": _d_log_sum_exp,
    "ReduceLogSum": _d_log_sum,
    "ReduceProd": _d_prod,
}.items():
    register(_name)(_reduction(_fn))
