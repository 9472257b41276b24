"""Linear algebra: MatMul, Gemm, Einsum, Trilu, Det.

Every gradient is again a product of ``dy`` with the other operands; axes that broadcasting
added are summed away (``e.unbroadcast``) and axes that were summed out of one operand only
are broadcast back (``Expand``). Trilu, a 0/1 mask on the last two axes, is its own adjoint.
Det's gradient is the cofactor matrix, computed with Det itself on the minors.
"""

from __future__ import annotations

import string

import numpy as np

import onnx_ir as ir

from gradbuilder.errors import GradientRuleError
from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr, broadcast_dims, constant_of, dims_of, optional_input
from gradbuilder.rules.helpers import rank_of, wants
from gradbuilder.rules.sizes import INT64_MAX, iadd, isub, reshape_like, vec


def _swap_last(e, v, rank):
    """``v`` with its last two axes swapped; of unknown rank, through a 3-D view of it."""
    if rank is not None:
        return e.Transpose(v, perm=list(range(rank - 2)) + [rank - 1, rank - 2])
    shape = e.Shape(v)
    lead, rows, cols = (e.Slice(shape, e.ints([lo]), e.ints([hi])) for lo, hi in
                        ((0, -2), (-2, -1), (-1, INT64_MAX)))
    swapped = e.Transpose(e.Reshape(v, e.Concat(e.ints([-1]), rows, cols, axis=0)), perm=[0, 2, 1])
    return e.Reshape(swapped, e.Concat(lead, cols, rows, axis=0))


def _flat_shape(e, v):
    """The shape [-1, last dim of v] (a constant when the last dim is static; [rows, last dim]
    when every dim is, the shape a bias's gradient reshapes the same value to: one Reshape for
    both once onnxruntime merges equal nodes)."""
    d = dims_of(v)
    if d and all(isinstance(k, int) for k in d):
        return e.ints([int(np.prod(d[:-1], dtype=np.int64)), d[-1]])
    if d and isinstance(d[-1], int):
        return e.ints([-1, d[-1]])
    last = e.Slice(e.Shape(v), e.ints([-1]), e.ints([INT64_MAX]))
    return e.Concat(e.ints([-1]), last, axis=0)


def _as_matrix(e, v, rank, column: bool):
    """``v`` with at least two axes, as MatMul reads it: a vector is a row (1, k), or a column
    (k, 1) when ``column``. Of unknown rank, the missing axis is added at run time."""
    if rank is not None:
        return v if rank >= 2 else e.Unsqueeze(v, [-1] if column else [0])
    shape = e.Shape(v)
    missing = e.Max(e.ints([2]) - e.Shape(shape), e.ints([0]))
    ones = e.ConstantOfShape(missing, value=ir.tensor(np.array([1], dtype=np.int64)))
    return e.Reshape(v, e.Concat(*((shape, ones) if column else (ones, shape)), axis=0))


def _is_matrix(e, v, rank):
    """1 when ``v`` has two or more axes (the product keeps its row or column axis), else 0."""
    if rank is not None:
        return int(rank >= 2)
    return e.Cast(e.Greater(e.Shape(e.Shape(v)), e.ints([1])), to=int(ir.DataType.INT64))


def _matmul_any_rank(e, a, b, dy, needs, ra, rb):
    """The MatMul gradient when a rank is known only at run time: the operands as matrices
    a2 (.., n, k) and b2 (.., k, m), dy as dy2 (.., n, m) (the axes a vector operand drops put
    back), then da2 = dy2 @ b2^T and db2 = a2^T @ dy2, summed over the batch axes broadcasting
    added and reshaped like a and b."""
    a2, b2 = _as_matrix(e, a, ra, column=False), _as_matrix(e, b, rb, column=True)
    dy_shape = e.Shape(dy)
    kept = iadd(e, _is_matrix(e, a, ra), _is_matrix(e, b, rb))  # trailing axes of dy from a and b
    batch = e.Slice(dy_shape, e.ints([0]), vec(e, isub(e, e.Shape(dy_shape), kept)))
    rows = e.Slice(e.Shape(a2), e.ints([-2]), e.ints([-1]))
    cols = e.Slice(e.Shape(b2), e.ints([-1]), e.ints([INT64_MAX]))
    dy2 = e.Reshape(dy, e.Concat(batch, rows, cols, axis=0))
    da = db = None
    if needs[0]:
        da = e.unbroadcast(dy2 @ _swap_last(e, b2, None if rb is None else max(rb, 2)), a2)
        da = da if a2 is a else reshape_like(e, da, a)
    if needs[1]:
        db = e.unbroadcast(_swap_last(e, a2, None if ra is None else max(ra, 2)) @ dy2, b2)
        db = db if b2 is b else reshape_like(e, db, b)
    return da, db


# ----------------------------------------------------------------------------- MatMul


@register("MatMul")
def matmul(n, dys, needs, e):
    """y = a @ b (numpy matmul):  da = dy @ b^T,  db = a^T @ dy,  each summed over the batch
    axes that broadcasting added. A 1-D ``a`` acts as a row (1, k) and a 1-D ``b`` as a column
    (k, 1); the axis they gain is dropped from ``dy`` and from their gradients. An operand whose
    rank shape inference left unknown is made a matrix at run time."""
    a, b = n.inputs
    (dy,) = dys
    da_, db_ = dims_of(a), dims_of(b)
    if da_ is None or db_ is None:
        return _matmul_any_rank(e, a, b, dy, needs, None if da_ is None else len(da_),
                                None if db_ is None else len(db_))
    ra, rb = len(da_), len(db_)
    if ra == 1 and rb == 1:  # dot product: y is a scalar
        return (dy * b if needs[0] else None, dy * a if needs[1] else None)

    # Lift to the matrix case: dy2 has shape (batch..., n, m).
    dy2 = dy
    if ra == 1:
        dy2 = e.Unsqueeze(dy2, [-2])
    if rb == 1:
        dy2 = e.Unsqueeze(dy2, [-1])
    rank = max(ra, rb, 2)

    da = db = None
    if needs[0]:
        if rb == 1:  # da[..., n, k] = dy[..., n] * b[k]
            da = e.unbroadcast(dy2 * b, a)
        else:
            g = dy2 @ _swap_last(e, b, rb)  # (batch..., n or 1, k)
            if ra == 1:
                da = e.reduce("ReduceSum", g, list(range(rank - 1)), keepdims=False)
            else:
                da = e.unbroadcast(g, a)
    if needs[1]:
        if ra == 1:  # db[..., k, m] = a[k] * dy[..., m]
            db = e.unbroadcast(e.Unsqueeze(a, [1]) * dy2, b)
        elif rb == 2 and ra > 2:
            # Batched activations times a weight matrix: fold the batch axes into the
            # contraction instead of materialising one (k, m) product per batch element.
            a_flat = e.Reshape(a, _flat_shape(e, a))
            dy_flat = e.Reshape(dy2, _flat_shape(e, dy2))
            db = e.Gemm(a_flat, dy_flat, transA=1)
        else:
            g = _swap_last(e, a, ra) @ dy2  # (batch..., k, m or 1)
            if rb == 1:
                db = e.reduce("ReduceSum", g, list(range(rank - 2)) + [rank - 1], keepdims=False)
            else:
                db = e.unbroadcast(g, b)
    return da, db


# ----------------------------------------------------------------------------- Gemm


@register("Gemm")
def gemm(n, dys, needs, e):
    """y = alpha * A' @ B' + beta * C with A' = A or A^T, B' = B or B^T:
    dA' = alpha * dy @ B'^T, dB' = alpha * A'^T @ dy (transposed back when A or B was),
    dC = beta * dy summed over the axes C was broadcast along."""
    a, b = n.inputs[0], n.inputs[1]
    c = n.inputs[2] if len(n.inputs) > 2 else None
    (dy,) = dys
    alpha = float(attr(n, "alpha", 1.0))
    beta = float(attr(n, "beta", 1.0))
    ta, tb = int(attr(n, "transA", 0)), int(attr(n, "transB", 0))

    da = db = dc = None
    if needs[0]:
        # ta=0: dA = dy @ B'^T ;  ta=1: dA = B' @ dy^T
        if not ta:
            da = e.Gemm(dy, b, alpha=alpha, transB=1 - tb)
        else:
            da = e.Gemm(b, dy, alpha=alpha, transA=tb, transB=1)
    if needs[1]:
        # tb=0: dB = A'^T @ dy ;  tb=1: dB = dy^T @ A'
        if not tb:
            db = e.Gemm(a, dy, alpha=alpha, transA=1 - ta)
        else:
            db = e.Gemm(dy, a, alpha=alpha, transA=1, transB=ta)
    if wants(needs, 2):
        g = dy if beta == 1.0 else beta * dy
        dc = e.unbroadcast(g, c)
    return [da, db, dc][: len(n.inputs)]


# ----------------------------------------------------------------------------- Einsum

_ELL = "..."


def _parse_term(term: str) -> list[str]:
    """'ab...c' -> ['a', 'b', '...', 'c']."""
    out, i = [], 0
    while i < len(term):
        if term.startswith(_ELL, i):
            out.append(_ELL)
            i += 3
        elif term[i].isalpha():
            out.append(term[i])
            i += 1
        else:
            raise GradientRuleError(f"Einsum: cannot parse subscript '{term}'")
    return out


def parse_equation(equation: str) -> tuple[list[list[str]], list[str]]:
    """(input terms, output term) as label lists, the implicit output made explicit."""
    eq = equation.replace(" ", "")
    if "->" in eq:
        lhs, rhs = eq.split("->")
        return [_parse_term(t) for t in lhs.split(",")], _parse_term(rhs)
    terms = [_parse_term(t) for t in eq.split(",")]
    counts: dict[str, int] = {}
    for t in terms:
        for lab in t:
            counts[lab] = counts.get(lab, 0) + 1
    letters = sorted(lab for lab, c in counts.items() if c == 1 and lab != _ELL)
    return terms, ([_ELL] if _ELL in counts else []) + letters


def _label_dim(e, v, term, rank, label):
    """The size of ``label`` in operand ``v`` (subscripts ``term``), as a 1-element int64 tensor."""
    pos = term.index(label)
    if _ELL in term and pos > term.index(_ELL):
        pos += rank - len(term)  # ellipsis expands to rank - (len(term) - 1) axes
    d = dims_of(v)
    if d is not None and isinstance(d[pos], int):
        return e.ints([d[pos]])
    return e.Gather(e.Shape(v), e.ints([pos]), axis=0)


def _eye(e, size, like):
    """An identity matrix of ``size`` (1-element int64 tensor) with ``like``'s dtype."""
    n = constant_of(size)
    if n is not None and like.dtype is not None:
        return e.const(np.eye(int(n[0])), dtype=like.dtype)
    r = e.Range(e.const(np.array(0, np.int64)), e.Squeeze(size, [0]), e.const(np.array(1, np.int64)))
    return e.CastLike(e.Equal(e.Unsqueeze(r, [1]), e.Unsqueeze(r, [0])), like)


@register("Einsum")
def einsum(n, dys, needs, e):
    """y = einsum(eq, x_1..x_n):  dx_i = einsum(dy, x_j (j != i) -> subscripts of x_i).

    Labels of x_i that occur in no other term (summed out of x_i alone) are left out of that
    einsum and broadcast back (Expand); ellipsis axes are summed where x_i was broadcast; a
    label repeated within x_i (a diagonal, 'ii->i') gets its gradient on the diagonal only, by
    multiplying with an identity matrix."""
    (dy,) = dys
    terms, out = parse_equation(attr(n, "equation"))
    if len(terms) != len(n.inputs):
        raise GradientRuleError(
            f"Einsum equation '{attr(n, 'equation')}' has {len(terms)} terms for {len(n.inputs)} inputs"
        )
    used = {lab for t in terms + [out] for lab in t if lab != _ELL}
    fresh = iter(c for c in string.ascii_letters if c not in used)
    grads = []
    for i, (x, term) in enumerate(zip(n.inputs, terms)):
        if not needs[i]:
            grads.append(None)
            continue
        grads.append(_einsum_grad(e, n, dy, i, terms, out, fresh))
    return grads


def _term_dims(v, term):
    """{label: dim} for operand ``v`` with subscripts ``term`` ('...' maps to a tuple), or None."""
    d = dims_of(v)
    if d is None:
        return None
    out, k = {}, 0
    for lab in term:
        if lab == _ELL:
            w = len(d) - (len(term) - 1)
            out[lab] = tuple(d[k:k + w])
            k += w
        else:
            out[lab] = d[k] if lab not in out else out[lab]
            k += 1
    return out


def _result_dims(pairs, labels):
    """Static dims of einsum(pairs -> labels), or None where an operand's shape is unknown."""
    maps = [_term_dims(v, t) for v, t in pairs]
    if any(m is None for m in maps):
        return None
    dims = []
    for lab in labels:
        found = [(m[lab] if lab == _ELL else (m[lab],)) for m in maps if lab in m]
        dims.extend(broadcast_dims(*found))
    return tuple(dims)


def _einsum(e, pairs, labels):
    """einsum of (value, term) ``pairs`` producing ``labels``, with its static shape recorded."""
    eq = ",".join("".join(t) for _, t in pairs) + "->" + "".join(labels)
    out = e.Einsum(*[v for v, _ in pairs], equation=eq)
    e.typed(out, pairs[0][0].dtype, _result_dims(pairs, labels))
    return out


def _einsum_grad(e, n, dy, i, terms, out, fresh):
    x, term = n.inputs[i], terms[i]
    rank = rank_of(x, op="Einsum") if _ELL in term else len(term)
    others = [(v, t) for j, (v, t) in enumerate(zip(n.inputs, terms)) if j != i]
    available = set(out).union(*[set(t) for _, t in others])

    unique = list(dict.fromkeys(term))  # x's labels, first occurrences, in order
    kept = [lab for lab in unique if lab in available]
    pairs = [(dy, out)] + others
    if not others and kept == out:
        g = dy
    elif _ELL in available and _ELL not in kept:
        # x has no ellipsis but the others do. onnxruntime wants an ellipsis in the output
        # whenever an input has one, so keep those axes in front and sum them here.
        v, t = next((v, t) for v, t in pairs if _ELL in t)
        n_ell = rank_of(v, op="Einsum") - (len(t) - 1)
        g = _einsum(e, pairs, [_ELL] + kept)
        if n_ell:
            g = e.reduce("ReduceSum", g, list(range(n_ell)), keepdims=False)
    else:
        g = _einsum(e, pairs, kept)

    # Labels summed out of x alone are missing from g: insert them as size-1 axes.
    width = {lab: (rank - (len(term) - 1) if lab == _ELL else 1) for lab in unique}
    axes, pos = [], 0
    for lab in unique:
        if lab not in available:
            axes.extend(range(pos, pos + width[lab]))
        pos += width[lab]
    if axes:
        g = e.Unsqueeze(g, axes)

    # The shape g must reach: x itself, or x's diagonal view when a label repeats.
    diagonal = len(unique) != len(term)
    target = _einsum(e, [(x, term)], unique) if diagonal else x
    if _maybe_smaller(g, target):
        g = e.expand_like(g, target)  # Expand broadcasts both ways: then sum what x lacks
    g = e.unbroadcast(g, target)
    if not diagonal:
        return g

    # Put the gradient on the diagonal: one identity matrix per repeated occurrence.
    seen, pairs, out_sub = set(), [(g, unique)], []
    for lab in term:
        if lab in seen:
            f = next(fresh)
            pairs.append((_eye(e, _label_dim(e, x, term, rank, lab), x), [lab, f]))
            out_sub.append(f)
        else:
            seen.add(lab)
            out_sub.append(lab)
    res = e.Einsum(*[v for v, _ in pairs], equation=",".join("".join(t) for _, t in pairs) + "->" + "".join(out_sub))
    e.typed(res, x.dtype, dims_of(x))
    return res


def _maybe_smaller(g, target) -> bool:
    """Whether ``g`` may still have size-1 axes where ``target`` is larger."""
    gd, td = dims_of(g), dims_of(target)
    if gd is None or td is None or len(gd) != len(td):
        return True
    return any(a != b and not (isinstance(a, int) and a != 1) for a, b in zip(gd, td))


# ----------------------------------------------------------------------------- Trilu


@register("Trilu")
def trilu(n, dys, needs, e):
    """A 0/1 mask on the last two axes, its own adjoint: dx = Trilu(dy, k, upper)."""
    k = optional_input(n, 1)
    extra = [k] if k is not None else []
    return (e.Trilu(dys[0], *extra, upper=attr(n, "upper", 1)),)


# ----------------------------------------------------------------------------- Det


@register("Det")
def det(n, dys, needs, e):
    """y = det(X) over the last two axes (n x n):  dX = dy * cof(X), the cofactor matrix
    (= det(X) inv(X)^T where X is invertible, and exact where it is singular).

    ONNX has no inverse; the cofactors are determinants of the n^2 minors, gathered with two
    static Gathers and computed by Det itself: cof[i, j] = (-1)^(i+j) det(X without row i and
    column j). That is O(n^4) memory per matrix, for static n (any batch shape). (An unrolled
    Gauss-Jordan inverse would need pivoting and fails where X is singular; cofactors need
    neither.)"""
    (x,) = n.inputs
    (dy,) = dys
    d = dims_of(x)
    if d is None or len(d) < 2 or not isinstance(d[-1], int) or not isinstance(d[-2], int):
        raise GradientRuleError("Det: the gradient needs the matrix size (the last two dims) to be static")
    size, r = d[-1], len(d)
    if size == 1:
        return (e.expand_like(e.Unsqueeze(dy, [r - 2, r - 1]), x),)
    others = np.array([[k for k in range(size) if k != i] for i in range(size)], dtype=np.int64)
    rows = e.Gather(x, e.const(others), axis=r - 2)  # (..., n_i, n-1, n)
    minors = e.Gather(rows, e.const(others), axis=r)  # (..., n_i, n-1, n_j, n-1)
    batch = list(range(r - 2))
    minors = e.Transpose(minors, perm=batch + [r - 2, r, r - 1, r + 1])  # (..., n_i, n_j, n-1, n-1)
    signs = np.array([[(-1.0) ** (i + j) for j in range(size)] for i in range(size)])
    signs = e.const(signs, dtype=x.dtype) if x.dtype is not None else e.CastLike(e.const(signs), x)
    cof = signs * e.Det(minors)
    return (e.Unsqueeze(dy, [r - 2, r - 1]) * cof,)

