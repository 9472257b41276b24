"""Resize.

Resize is y = X x_1 M_1 x_2 M_2 ... with one interpolation matrix M_k per resized axis (the
interpolation of every mode is separable), so it is linear in X: dX = dy x_k M_k^T. Each M_k is
the node's own Resize applied to an identity matrix, so it is exactly what the runtime computes
(or, for keep_aspect_ratio_policy lengths no Resize by scale gives, built from the
interpolation formulas). scales and roi move the source positions of M_k's rows: their
gradients contract dL/dM_k with dM_k/dposition, the kernel's derivative at the taps.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import onnx_ir as ir

from gradbuilder.errors import GradientRuleError
from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr, constant_of, dims_of, optional_input, unknown_rank
from gradbuilder.rules.helpers import HALF_TYPES, cast_to, float_type, text_attr, wants
from gradbuilder.rules.sizes import Dims, as_int64, scalar_of, stack
from gradbuilder.rules.spatial import keys_kernel


_RESIZE_ATTRS = ("mode", "coordinate_transformation_mode", "cubic_coeff_a", "exclude_outside", "nearest_mode")


def _is_empty(v) -> bool:
    if v is None:
        return True
    c = constant_of(v)
    if c is not None:
        return c.size == 0
    d = dims_of(v)
    return d is not None and len(d) == 1 and d[0] == 0


# ----------------------------------------------------------------------------- M_k by the node's own Resize


def _interpolation_matrix(e, n, dtype, length, *, scale=None, size=None, roi=None):
    """M_k (out x length): the node's Resize (same mode and coordinate transformation, no
    extrapolation value) applied along the first axis of a length x length identity, with
    axis k's scale or size; the second axis keeps its length (an identity resize)."""
    shape = stack(e, [length, length])
    eye = e.EyeLike(e.ConstantOfShape(shape, value=ir.tensor(np.zeros(1, dtype.numpy()))))
    attrs = {name: attr(n, name) for name in _RESIZE_ATTRS}
    if e.opset >= 18:
        attrs["antialias"] = attr(n, "antialias")
    scales = sizes = None
    if size is not None:
        sizes = stack(e, [size, length])
    elif isinstance(scale, float):
        scales = e.const(np.array([scale, 1.0], np.float32))
    else:
        scales = e.Concat(cast_to(e, scale, ir.DataType.FLOAT), e.const(np.array([1.0], np.float32)), axis=0)
    if e.opset < 13:  # Resize-11: roi and scales are required inputs (empty when unused)
        roi = roi if roi is not None else e.const(np.zeros(0, np.float32))
        scales = scales if scales is not None else e.const(np.zeros(0, np.float32))
    inputs = [eye, roi, scales, sizes]
    while inputs[-1] is None:
        inputs.pop()
    return e.op("Resize", *inputs, extrapolation_value=0.0, **attrs)


def _contract(e, g, m, k, rank):
    """``g`` with its axis k (of length out) multiplied by ``m`` (out x in): g x_k m^T."""
    if k == rank - 1:
        return g @ m
    if k == rank - 2:
        return e.Transpose(m, perm=[1, 0]) @ g
    perm = list(range(rank))
    perm[k], perm[-1] = perm[-1], perm[k]
    return e.Transpose(e.Transpose(g, perm=perm) @ m, perm=perm)


def _outer(e, g, f, k, rank):
    """sum over every axis but k of g[.., j, ..] f[.., i, ..]: the (j, i) matrix dL/dM_k
    when g is the gradient at M_k's output and f the tensor M_k resizes."""
    perm = [a for a in range(rank) if a != k] + [k]
    g2, f2 = (e.Flatten(e.Transpose(v, perm=perm), axis=rank - 1) for v in (g, f))
    return e.Transpose(g2, perm=[1, 0]) @ f2


def _aspect_plan(d, axes, sizes, policy):
    """keep_aspect_ratio_policy not_larger / not_smaller: one scale s for every axis (the
    min / max of sizes[i] / in[axis]), out = round(s * in). With constant sizes and static
    lengths, the axis that sets s is resized by its size and the others by the scale s,
    which gives the same output length where floor(s * in) = round(s * in). Returns
    [("size", int) | ("scale", float)] per axis, or None where that does not hold (then
    the matrices are built from the interpolation formulas, see _explicit_matrix)."""
    if sizes is None or any(not isinstance(d[k], int) for k in axes):
        return None
    ratios = [float(sizes[i]) / d[k] for i, k in enumerate(axes)]
    pick = int(np.argmin(ratios) if policy == "not_larger" else np.argmax(ratios))
    s = ratios[pick]
    plan = []
    for i, k in enumerate(axes):
        if i == pick:
            plan.append(("size", int(sizes[i])))
        elif int(np.floor(np.float32(s) * np.float32(d[k]))) == int(s * d[k] + 0.5):
            plan.append(("scale", float(np.float32(s))))
        else:
            return None
    return plan


def _axis_roi(e, roi, i, count):
    """(roi of the helper Resize for the i-th of ``count`` axes: [start, 0, end, 1], whether
    it is the whole axis [0, 1])."""
    c = constant_of(roi)
    if c is not None:
        start, end = float(c[i]), float(c[count + i])
        return e.const(np.array([start, 0.0, end, 1.0], dtype=c.dtype)), start == 0.0 and end == 1.0
    dt = roi.dtype if roi.dtype in (ir.DataType.FLOAT, ir.DataType.DOUBLE, *HALF_TYPES) else ir.DataType.FLOAT
    zero, one = (e.const(np.array([v], dt.numpy()), dtype=dt) for v in (0.0, 1.0))
    return e.Concat(e.Gather(roi, e.ints([i])), zero, e.Gather(roi, e.ints([count + i])), one, axis=0), False


# ----------------------------------------------------------------------------- the interpolation written out

# For keep_aspect_ratio_policy where a Resize by scale cannot reproduce an axis, and for the
# gradients w.r.t. scales and roi: per output position j of an axis, x_j = x_original(j) and
# taps i = floor(x_j) + o with weights k(t (i - x_j)) / sum, as onnx's reference Resize computes
# them.


def _real(e, v, ct):
    """A Python number, a size (int or 1-element int64 tensor) or a value, as ``ct``."""
    if isinstance(v, (int, float)):
        return e.const(np.array(float(v)), dtype=ct)
    return cast_to(e, v, ct)


def _source_coordinates(e, ctm, out, length, s, roi_k, ct):
    """x_original [out] of the output positions 0 .. out-1 of one axis, as
    coordinate_transformation_mode defines it with scale s and output_width = s * length
    (fractional for scales), with its derivatives {"s": dx/ds, "start": dx/droi_start,
    "end": dx/droi_end} and, for tf_crop_and_resize, the positions that take
    extrapolation_value (x outside [0, length - 1]; None otherwise)."""
    y = e.Cast(e.Range(scalar_of(e, 0), scalar_of(e, out), scalar_of(e, 1)), to=int(ct))
    length = _real(e, length, ct)
    if ctm in ("half_pixel", "pytorch_half_pixel", "half_pixel_symmetric"):
        x, d = _half_pixel_coordinates(e, ctm, y, out, length, s, ct)
        return x, d, None
    if ctm == "asymmetric":
        return y / s, {"s": -(y / (s * s))}, None
    if ctm == "align_corners":
        x, d = _align_corners_coordinates(e, y, length, s, ct)
        return x, d, None
    if ctm == "tf_crop_and_resize":
        return _crop_coordinates(e, y, length, s, roi_k, ct)
    raise GradientRuleError(f"Resize: coordinate_transformation_mode {ctm} has no gradient rule")


def _half_pixel_coordinates(e, ctm, y, out, length, s, ct):
    """half_pixel and its variants: x = (y + 0.5) / s - 0.5 (+ length / 2 (1 - out / width)
    for half_pixel_symmetric; -0.5 at output_width 1 for pytorch_half_pixel), and dx/ds."""
    width = s * length
    s2 = s * s
    yh = y + 0.5
    x = yh / s
    ds = -(yh / s2)
    if ctm == "half_pixel_symmetric":  # + length / 2 (1 - out / width) = length / 2 - out / (2 s)
        o = _real(e, out, ct)
        x = length / 2.0 * (1.0 - o / width) + x
        ds = ds + o / (2.0 * s2)
    x = x - 0.5
    if ctm == "pytorch_half_pixel":
        single = e.Equal(width, _real(e, 1.0, ct))  # output_width 1: a fixed position
        x = e.Where(single, _real(e, -0.5, ct), x)
        ds = e.Where(single, _real(e, 0.0, ct), ds)
    return x, {"s": ds}


def _corner_denominator(e, length, s, ct):
    """(output_width 1, width - 1 (1 where output_width is 1), d/ds 1 / (s length - 1)): the
    stretch align_corners and tf_crop_and_resize divide by."""
    width = s * length
    single = e.Equal(width, _real(e, 1.0, ct))  # output_width 1: a fixed position
    den = e.Where(single, _real(e, 1.0, ct), width - 1.0)  # (output_width 1 takes the other branch)
    return single, den, -(length / (den * den))


def _align_corners_coordinates(e, y, length, s, ct):
    """align_corners: x = y (length - 1) / (width - 1) (0 at output_width 1), and dx/ds."""
    single, den, dden = _corner_denominator(e, length, s, ct)
    last = length - 1.0
    zero = _real(e, 0.0, ct)
    return e.Where(single, zero, y * last / den), {"s": e.Where(single, zero, y * last * dden)}


def _crop_coordinates(e, y, length, s, roi_k, ct):
    """tf_crop_and_resize: x = start (length - 1) + y (end - start) (length - 1) / (width - 1)
    (the roi's middle at output_width 1), dx/d{s, start, end}, and the positions outside
    [0, length - 1] (they take extrapolation_value)."""
    single, den, dden = _corner_denominator(e, length, s, ct)
    last = length - 1.0
    start, end = roi_k
    span = end - start
    along = e.Where(single, span * last / 2.0, y * span * last / den)
    x = along + start * last
    d = {"end": e.Where(single, _real(e, 0.5, ct), y / den) * last}
    d["start"] = last - d["end"]
    d["s"] = e.Where(single, _real(e, 0.0, ct), y * span * last * dden)
    extrapolated = e.Or(e.Less(x, _real(e, 0.0, ct)), e.Greater(x, last))
    return x, d, extrapolated


def _kernel(e, z, mode, a):
    """The interpolation kernel at z and its derivative d/dz: the triangle max(1 - |z|, 0)
    (linear) or Keys' cubic with coefficient a (cubic, zero from |z| = 2 on)."""
    if mode == "linear":
        inside = e.Less(e.Abs(z), e.scalar(1.0, like=z))
        zero = e.scalar(0.0, like=z)
        return e.Where(inside, 1.0 - e.Abs(z), zero), e.Where(inside, -e.Sign(z), zero)
    w, dw = keys_kernel(e, e.Abs(z), a, support=True)
    return w, dw * e.Sign(z)


def _taps(e, n, x, length, ct, stretch=None):
    """The interpolation of one axis at source positions x [out]: (tap indices [out, T]
    clamped into [0, length) (edge padding), weights [out, T], d weights / d x,
    d weights / d stretch); weights and derivatives are None for nearest (one tap of weight
    1, rounded as nearest_mode says). Linear and cubic weigh taps floor(x) + o by
    k(t (i - x)) / sum, t = 1 and o in {0, 1} / {-1, .., 2}; with antialias t = stretch =
    min(scale, 1) and o from f = floor(-R / t) + 1 to 1 - f (R the kernel's radius: the
    kernel stretched by 1 / t); exclude_outside drops the taps outside [0, length)
    before the sum."""
    mode = text_attr(n, "mode", "nearest")
    last = _real(e, length, ct) - 1.0
    zero = e.scalar(0.0, like=x)

    def clamp(tap):
        return e.Cast(e.Min(e.Max(tap, zero), last), to=int(ir.DataType.INT64))

    if mode == "nearest":
        return clamp(e.Unsqueeze(_nearest_tap(e, n, x), [1])), None, None, None
    offsets = _tap_offsets(e, mode, x, stretch, ct)
    tap = e.Unsqueeze(e.Floor(x), [1]) + e.Unsqueeze(offsets, [0])  # [out, T]
    dist = tap - e.Unsqueeze(x, [1])
    k, dk = _kernel(e, dist if stretch is None else dist * stretch, mode, attr(n, "cubic_coeff_a", -0.75))
    if attr(n, "exclude_outside", 0):
        inside = e.Cast(e.And(e.GreaterOrEqual(tap, zero), e.LessOrEqual(tap, last)), to=int(ct))
        k, dk = k * inside, dk * inside
    return (clamp(tap), *_normalized_weights(e, k, dk, dist, stretch))


def _nearest_tap(e, n, x):
    """The one tap of nearest at x, rounded as nearest_mode says."""
    rounding = text_attr(n, "nearest_mode", "round_prefer_floor")
    return {"round_prefer_floor": lambda: e.Ceil(x - 0.5),  # halves down
            "round_prefer_ceil": lambda: e.Floor(x + 0.5),  # halves up
            "floor": lambda: e.Floor(x), "ceil": lambda: e.Ceil(x)}[rounding]()


def _tap_offsets(e, mode, x, stretch, ct):
    """The offsets o of the taps floor(x) + o: 1 - R .. R (R the kernel's radius, 1 linear,
    2 cubic), or with antialias f .. 1 - f, f = floor(-R / stretch) + 1."""
    radius = 1.0 if mode == "linear" else 2.0
    if stretch is None:
        return e.const(np.arange(1 - radius, radius + 1), dtype=ct)
    first = e.Floor(-radius / stretch) + 1.0
    scalar = e.ints([])
    return e.Range(e.Reshape(first, scalar), e.Reshape(2.0 - first, scalar), e.scalar(1.0, like=x))


def _normalized_weights(e, k, dk, dist, stretch):
    """(w = k / sum k over the taps, d w / d x, d w / d stretch (None without antialias)) from
    the kernel values k at the taps' distances ``dist`` and their derivatives dk."""
    total = e.reduce("ReduceSum", k, [1], keepdims=True)
    w = k / total

    def normalized(du):  # d (u / sum u) from du
        return (du - w * e.reduce("ReduceSum", du, [1], keepdims=True)) / total

    dw_dx = normalized(-dk if stretch is None else -(dk * stretch))
    dw_dt = None if stretch is None else normalized(dk * dist)
    return w, dw_dx, dw_dt


def _explicit_matrix(e, idx, w, extrapolated, length, ct):
    """M (out x length): M[j, i] = sum of the weights of the taps of j landing on i; rows
    that take extrapolation_value are zero."""
    grid = e.Range(scalar_of(e, 0), scalar_of(e, length), scalar_of(e, 1))
    onehot = e.Cast(e.Equal(e.Unsqueeze(idx, [2]), grid), to=int(ct))  # [out, T, length]
    m = e.Squeeze(onehot, [1]) if w is None else e.reduce("ReduceSum", onehot * e.Unsqueeze(w, [2]), [1],
                                                            keepdims=False)
    if extrapolated is not None:
        m = e.Where(e.Unsqueeze(extrapolated, [1]), e.scalar(0.0, like=m), m)
    return m


def _policy_scale(e, d, axes, sizes, policy, ct):
    """keep_aspect_ratio_policy's scale: min / max over the axes of sizes[i] / in[axes[i]]."""
    lengths = e.Cast(stack(e, [d[k] for k in axes]), to=int(ct))
    ratios = e.Cast(sizes, to=int(ct)) / lengths
    return e.reduce("ReduceMin" if policy == "not_larger" else "ReduceMax", ratios, [0], keepdims=True)


# ----------------------------------------------------------------------------- the resized axes


class _AxisGeometry(NamedTuple):
    """Where the output positions of one resized axis read from (see _source_coordinates)."""

    x: ir.Value  # source positions x_j [out]
    dx: dict  # dx_j / d{"s", "start", "end"}
    extrapolated: ir.Value | None  # tf_crop_and_resize: rows that take extrapolation_value
    s: ir.Value  # the axis' scale
    stretch: ir.Value | None  # antialias: the kernel's stretch min(s, 1)


class _ResizeAxes:
    """The resized axes of one Resize node (of rank ``rank``, interpolation ``mode``): axis i
    of ``axes`` is tensor axis axes[i] (k). For each: its size or scale as the node gets it,
    its geometry (built once, where first needed: M_k from the formulas or the scales / roi
    gradients), its taps and its interpolation matrix M_k. keep_aspect_ratio_policy's one
    scale is built once too."""

    def __init__(self, e, n, d, axes, *, rank, mode, hd, use_sizes, given_c, policy, plan, ctm, antialias):
        self.e, self.n, self.d, self.axes, self.rank, self.mode, self.hd = e, n, d, axes, rank, mode, hd
        self.roi, self.scales, self.sizes = (optional_input(n, i) for i in (1, 2, 3))
        self.use_sizes, self.given_c, self.policy, self.plan = use_sizes, given_c, policy, plan
        self.explicit = policy != "stretch" and plan is None  # every M_k from the formulas
        self.ctm, self.crop, self.antialias = ctm, ctm == "tf_crop_and_resize", antialias
        self.out_dims = Dims(e, n.outputs[0])
        self._geometries = {}

    @functools.cached_property
    def policy_scale(self) -> ir.Value:
        return _policy_scale(self.e, self.d, self.axes, as_int64(self.e, self.sizes), self.policy, self.hd)

    def given(self, i):
        """Axis i's size (int, or int64 [1]) or scale (float, or [1]) as the node gets it."""
        e = self.e
        if self.use_sizes:
            return int(self.given_c[i]) if self.given_c is not None else e.Gather(as_int64(e, self.sizes), e.ints([i]))
        return float(self.given_c[i]) if self.given_c is not None else e.Gather(self.scales, e.ints([i]))

    def scale(self, i, length) -> ir.Value:
        """Axis i's scale s (length its input length): the policy's, size / length or the given scale."""
        e, hd = self.e, self.hd
        if self.policy != "stretch":
            return self.policy_scale
        if self.use_sizes:
            return _real(e, self.given(i), hd) / _real(e, length, hd)
        return _real(e, self.given(i), hd)

    def roi_bounds(self, i):
        """(start, end) of axis i in the roi (tf_crop_and_resize; None otherwise)."""
        if not self.crop:
            return None
        e, hd, roi = self.e, self.hd, self.roi
        c = constant_of(roi)
        return tuple(_real(e, float(c[j]), hd) if c is not None else cast_to(e, e.Gather(roi, e.ints([j])), hd)
                     for j in (i, len(self.axes) + i))

    def geometry(self, i) -> _AxisGeometry:
        if i not in self._geometries:
            e, hd, k = self.e, self.hd, self.axes[i]
            length = self.d[k]
            s = self.scale(i, length)
            roi_k = self.roi_bounds(i)
            stretch = e.Min(s, _real(e, 1.0, hd)) if self.antialias else None
            self._geometries[i] = _AxisGeometry(
                *_source_coordinates(e, self.ctm, self.out_dims[k], length, s, roi_k, hd), s, stretch)
        return self._geometries[i]

    def taps(self, i):
        """_taps of axis i at its source positions."""
        g = self.geometry(i)
        return _taps(self.e, self.n, g.x, self.d[self.axes[i]], self.hd, g.stretch)

    def formula_matrix(self, i) -> ir.Value:
        """M_k of axis i built from the interpolation formulas."""
        extrapolated = self.geometry(i).extrapolated
        idx, w, _, _ = self.taps(i)
        return _explicit_matrix(self.e, idx, w, extrapolated, self.d[self.axes[i]], self.hd)

    def matrix(self, i):
        """M_k of axis i: the node's Resize of an identity, or from the formulas (explicit
        policy, or a scale that keeps a static length); None where it is an identity."""
        e, k = self.e, self.axes[i]
        length = self.d[k]
        if self.explicit:
            return self.formula_matrix(i)
        roi_k, whole = _axis_roi(e, self.roi, i, len(self.axes)) if self.crop else (None, True)
        if self.plan is not None:
            kind, value = self.plan[i]
        else:
            kind, value = "size" if self.use_sizes else "scale", self.given(i)
        if whole and (kind == "scale" and isinstance(value, float) and value == 1.0
                      or kind == "size" and isinstance(value, int) and isinstance(length, int) and value == length):
            return None
        if kind == "scale" and isinstance(length, int) and self.out_dims[k] == length:
            # a scale != 1 that keeps the length: onnxruntime returns X unchanged from a
            # Resize whose output shape is X's, so the helper on a length x length identity
            # would give one, where the node resamples: from the formulas
            return self.formula_matrix(i)
        return _interpolation_matrix(e, self.n, self.hd, length, roi=roi_k, **{kind: value})


def _resized_axes(e, n) -> _ResizeAxes:
    """The resized axes of Resize node ``n`` as its inputs and attributes describe them;
    an error for a tf_crop_and_resize without a roi."""
    x = n.inputs[0]
    roi, scales, sizes = (optional_input(n, i) for i in (1, 2, 3))
    d = Dims(e, x)
    use_sizes = not _is_empty(sizes)
    given = sizes if use_sizes else scales
    rank, axes = _rank_and_axes(n, d, given)
    mode = text_attr(n, "mode", "nearest")
    ctm = text_attr(n, "coordinate_transformation_mode", "half_pixel")
    if ctm == "tf_crop_and_resize" and _is_empty(roi):
        raise GradientRuleError(f"Resize '{n.name}': tf_crop_and_resize without a roi")
    policy = text_attr(n, "keep_aspect_ratio_policy", "stretch") if use_sizes else "stretch"
    given_c = constant_of(given)
    plan = _aspect_plan(d, axes, given_c, policy) if policy != "stretch" else None
    antialias = bool(attr(n, "antialias", 0)) and mode != "nearest" and e.opset >= 18
    return _ResizeAxes(e, n, d, axes, rank=rank, mode=mode, hd=float_type(x), use_sizes=use_sizes, given_c=given_c,
                       policy=policy, plan=plan, ctm=ctm, antialias=antialias)


def _rank_and_axes(n, d, given):
    """(X's rank, the resized axes): the ``axes`` attribute or every axis; the rank from X's
    dims or, without ``axes``, from the length of the scales or sizes ``given``."""
    axes_attr = attr(n, "axes")
    rank = d.rank
    if rank is None and axes_attr is None:
        count = (dims_of(given) or [None])[0]
        rank = count if isinstance(count, int) else None
    if rank is None:
        raise unknown_rank(n.inputs[0], "Resize")
    return rank, [int(a) % rank for a in axes_attr] if axes_attr else list(range(rank))


# ----------------------------------------------------------------------------- through the matrices


def _through_matrices(e, g, matrices, rank, cast_like=None):
    """``g`` contracted with every M_k in order (g x_k M_k^T), M_k cast like ``cast_like``
    when given; with before[i], g as it reaches axes[i] (through the axes before it)."""
    before = []
    for k, mk in matrices:
        before.append(g)
        if mk is not None:
            g = _contract(e, g, mk if cast_like is None else e.CastLike(mk, cast_like), k, rank)
    return g, before


def _resized_after(e, f, matrices, rank):
    """after[i]: ``f`` resized along every axis after axes[i] (f x_k M_k, the last axis first)."""
    after = [None] * len(matrices)
    for i in reversed(range(len(matrices))):
        k, mk = matrices[i]
        after[i] = f
        if mk is not None:
            f = _contract(e, f, e.Transpose(mk, perm=[1, 0]), k, rank)
    return after


def _total(e, v):
    """The sum of every entry of ``v``, as [1]."""
    return e.Reshape(e.reduce("ReduceSum", v, None, keepdims=False), [1])


def _position_grads(e, axes, i, before, after, rank, *, want_scales, want_roi):
    """dL/ds and dL/droi (start, end) of axis i ([1] each, None where not wanted). dL/dM_k
    [out, in] pairs ``before`` (dy through the axes before axes[i]) with ``after`` (X through
    the axes after it); dL/dx_j = sum over the taps of dL/dM_k at the taps times dw/dx_j,
    times dx_j/ds, dx_j/dstart, dx_j/dend; with antialias, the stretch's share dt/ds = 1
    where s < 1."""
    g = axes.geometry(i)
    idx, _, dw_dx, dw_dt = axes.taps(i)
    hd = axes.hd
    dm = _outer(e, cast_to(e, before, hd), after, axes.axes[i], rank)  # dL/dM_k [out, in]
    if g.extrapolated is not None:
        dm = e.Where(e.Unsqueeze(g.extrapolated, [1]), e.scalar(0.0, like=dm), dm)
    at_taps = e.GatherElements(dm, idx, axis=1)  # [out, T]
    dl_dx = e.reduce("ReduceSum", at_taps * dw_dx, [1], keepdims=False)  # [out]
    g_s = g_start = g_end = None
    if want_scales:
        g_s = _total(e, dl_dx * g.dx["s"])
        if g.stretch is not None:  # dt/ds = 1 where s < 1
            below = e.Cast(e.Less(g.s, _real(e, 1.0, hd)), to=int(hd))
            g_s = g_s + _total(e, at_taps * dw_dt) * e.Reshape(below, [1])
    if want_roi:
        g_start = _total(e, dl_dx * g.dx["start"])
        g_end = _total(e, dl_dx * g.dx["end"])
    return g_s, g_start, g_end


def _scales_and_roi_grads(e, resized, back, matrices, *, want_scales, want_roi):
    """(dscales, droi), each None where not wanted: the position gradients of every resized
    axis (_position_grads), with ``back[i]`` dy before axes[i]."""
    x = resized.n.inputs[0]
    # fwd[i]: X through the axes after axes[i]
    fwd = _resized_after(e, cast_to(e, x, resized.hd), matrices, resized.rank)
    per_axis = [_position_grads(e, resized, i, back[i], fwd[i], resized.rank, want_scales=want_scales,
                                want_roi=want_roi) for i in range(len(resized.axes))]
    ds, dstart, dend = zip(*per_axis)
    dscales = cast_to(e, e.Concat(*ds, axis=0), resized.scales.dtype) if want_scales else None
    droi = cast_to(e, e.Concat(*dstart, *dend, axis=0), resized.roi.dtype) if want_roi else None
    return dscales, droi


# ----------------------------------------------------------------------------- the rule


@register("Resize")
def resize(n, dys, needs, e):
    """Resize is linear in X and separable: y = X x_1 M_1 x_2 M_2 ..., M_k (out_k x in_k)
    the 1-D interpolation matrix of resized axis k (tf_crop_and_resize sets outputs whose
    source lies outside to extrapolation_value, a constant: their rows of M_k are zero).
    dX = dy x_k M_k^T for every resized axis, each a MatMul along axis k.

    M_k is the node's own Resize (every mode, coordinate transformation, nearest_mode,
    cubic_coeff_a, exclude_outside, antialias, roi) applied along the first axis of an
    identity matrix with axis k's scale or size, so it is what the runtime computes, also
    for lengths known only at run time. Axes resized by 1 (and the whole roi) are skipped
    when that is known statically; an axis whose scale keeps its (static) length is built
    from the formulas (onnxruntime returns a same-shape Resize's input unchanged, so the
    helper would give an identity). keep_aspect_ratio_policy resizes every axis by one
    scale s to round(s * in) elements: with constant sizes and static lengths where a
    Resize by s gives that length (floor = round), M_k is that Resize; otherwise (sizes
    at run time, floor < round) M_k is built from the interpolation formulas (_taps), s
    computed in the graph.

    scales and roi: M_k depends on them through the source positions x_j of its rows
    (x_j = (j + 0.5) / s - 0.5, start (in - 1) + j (end - start) (in - 1) / (s in - 1), ...)
    and, with antialias, through the kernel's stretch min(s, 1):
    dL/ds = sum_j sum_i dL/dM_k[j, i] (dM_k[j, i]/dx_j dx_j/ds + dM_k[j, i]/dt dt/ds), with
    dL/dM_k = sum over the other axes of (dy back through the axes before k) (X through
    the axes after k). Nearest is piecewise constant in scales and roi: zero. The source
    positions follow the spec (output_width = s * in, fractional for scales) like onnx's
    reference; onnxruntime takes the integer output length in align_corners,
    tf_crop_and_resize and pytorch_half_pixel's length-1 case, where its forward differs.
    sizes gets no gradient."""
    (dy,) = dys
    if e.opset < 11:
        raise GradientRuleError(f"Resize '{n.name}': opset {e.opset} < 11 is not supported")
    resized = _resized_axes(e, n)
    matrices = [(k, resized.matrix(i)) for i, k in enumerate(resized.axes)]  # (axis, M_k or None for an identity)
    cast_like = None if n.inputs[0].dtype == resized.hd else dy
    dx, back = _through_matrices(e, dy, matrices, resized.rank, cast_like)  # back[i]: dy before axes[i]
    grads = [dx, None, None, None]
    want_scales = wants(needs, 2) and not resized.use_sizes and resized.mode != "nearest"
    want_roi = wants(needs, 1) and resized.crop and resized.mode != "nearest"
    if want_scales or want_roi:
        grads[2], grads[1] = _scales_and_roi_grads(e, resized, back, matrices, want_scales=want_scales,
                                                   want_roi=want_roi)
    for i in (1, 2):
        if grads[i] is None and wants(needs, i):
            grads[i] = e.zeros_like(n.inputs[i])  # nearest (piecewise constant), roi unused, scales unused
    return grads[: len(n.inputs)]
