"""Spatial and resampling ops: Resize GridSample AffineGrid DepthToSpace SpaceToDepth Col2Im
CenterCropPad.

All of them are linear in their data input, so each data gradient is the transpose of the
op's own linear map:

* DepthToSpace / SpaceToDepth / CenterCropPad move elements: dx moves dy back (the inverse
  rearrangement, or the same crop/pad back to x's size).
* Col2Im adds columns into an image: dx reads the image back into columns (Im2Col), a
  convolution of dy with one-hot kernels.
* Resize is y = X x_1 M_1 x_2 M_2 ... with one interpolation matrix M_k per resized axis (the
  interpolation of every mode is separable): dX = dy x_k M_k^T. Each M_k is the node's own
  Resize applied to an identity matrix, so it is exactly what the runtime computes (or, for
  keep_aspect_ratio_policy lengths no Resize by scale gives, built from the interpolation
  formulas). scales and roi move the source positions of M_k's rows: their gradients
  contract dL/dM_k with dM_k/dposition, the kernel's derivative at the taps.
* AffineGrid is grid = theta @ (base, 1): dtheta = dy^T @ (base, 1), base being the
  runtime's AffineGrid of the identity transform.
* GridSample reads X at a few taps around each sampling point with weights that depend on
  the grid: dX scatter-adds dy times the weights at the taps, dgrid sums dy times X at the
  taps times the weights' derivatives.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import onnx_ir as ir

from gradbuilder.errors import GradientRuleError
from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr, constant_of, dims_of, optional_input, unknown_rank
from gradbuilder.rules.helpers import HALF_TYPES, accumulation_type, cast_to, float_type, text_attr, wants
from gradbuilder.rules.sizes import Dims, as_int64, iprod, isub, reshape_like, scalar_of, stack, vec, zeros
from gradbuilder.rules.windows import spatial_rank


# ----------------------------------------------------------------------------- rearrangements


@register("DepthToSpace")
def depth_to_space(n, dys, needs, e):
    """DCR mode is undone by SpaceToDepth: dx = SpaceToDepth(dy).
    CRD mode: y[n, c, h*b + i, w*b + j] = x[n, c*b*b + i*b + j, h, w], so dx is dy viewed
    as [N, C, H, b, W, b], transposed to [N, C, b, b, H, W] and viewed as x."""
    (dy,) = dys
    b = attr(n, "blocksize")
    if text_attr(n, "mode", "DCR") != "CRD":
        return (e.SpaceToDepth(dy, blocksize=b),)
    d = Dims(e, n.inputs[0])
    blocks = e.Reshape(dy, stack(e, [d[0], -1, d[2], b, d[3], b]))
    return (reshape_like(e, e.Transpose(blocks, perm=[0, 1, 3, 5, 2, 4]), n.inputs[0]),)


@register("SpaceToDepth")
def space_to_depth(n, dys, needs, e):
    """SpaceToDepth is undone by DepthToSpace in the same mode (``mode``, DCR or CRD, since
    opset 28; DCR before): dx = DepthToSpace(dy, mode). Both move x[n, c, h*b + i, w*b + j]
    to channel (i*b + j)*C + c (DCR) or c*b*b + i*b + j (CRD), DepthToSpace back."""
    mode = text_attr(n, "mode", "DCR")
    if mode not in ("DCR", "CRD"):
        raise GradientRuleError(f"SpaceToDepth '{n.name}': mode {mode} has no gradient rule")
    return (e.DepthToSpace(dys[0], blocksize=attr(n, "blocksize"), mode=mode),)


@register("CenterCropPad")
def center_crop_pad(n, dys, needs, e):
    """y = x centre-cropped / zero-padded to ``shape`` on ``axes``. Cropping a length L to l
    keeps x[(L-l)//2 :][:l]; padding l to L puts x at offset (L-l)//2: the same offset, so
    crop and pad are each other's transpose and dx = CenterCropPad(dy, shape(x)[axes])."""
    x = n.inputs[0]
    axes = attr(n, "axes")
    d = Dims(e, x)
    target = d.vector() if axes is None else stack(e, [d[int(a)] for a in axes])
    return (e.CenterCropPad(dys[0], target, axes=axes), None)


# ----------------------------------------------------------------------------- Col2Im


@register("Col2Im")
def col2im(n, dys, needs, e):
    """y = Col2Im(x): entry (c*K + k, l) of x is added into channel c of the image at
    position l*strides + k*dilations - pads (k a kernel offset of the K = prod(block_shape),
    l a block). Linear in x, so dx is the Im2Col of dy: dx[c*K + k, l] = dy at that
    position (zero in the padding), i.e. each channel of dy convolved with the K one-hot
    kernels e_k (same strides, dilations, pads): Conv(dy as [N*C, 1, ...], eye(K) as
    [K, 1, *block_shape]) is [N*C, K, blocks...], which is x's layout."""
    x, _, block_shape = n.inputs[:3]
    (dy,) = dys
    ct = float_type(dy)
    block = constant_of(block_shape)
    if block is not None:
        k = int(np.prod(block))
        kernel = e.const(np.eye(k).reshape(k, 1, *[int(b) for b in block]), dtype=ct)
    else:
        blocks = as_int64(e, block_shape)
        k = e.reduce("ReduceProd", blocks, None, keepdims=True)
        square = e.ConstantOfShape(e.Concat(k, k, axis=0), value=ir.tensor(np.zeros(1, ct.numpy())))
        kernel = e.Reshape(e.EyeLike(square), e.Concat(k, e.ints([1]), blocks, axis=0))
    image = dims_of(dy)
    if image is not None and all(isinstance(a, int) for a in image[2:]):
        planes = e.Reshape(dy, [-1, 1, *image[2:]])
    else:
        planes = e.Reshape(dy, e.Concat(e.ints([-1, 1]), e.Shape(dy, 2), axis=0))
    cols = e.Conv(cast_to(e, planes, ct), kernel, strides=attr(n, "strides"), dilations=attr(n, "dilations"),
                  pads=attr(n, "pads"))
    return (cast_to(e, reshape_like(e, cols, x), dy.dtype), None, None)


# ----------------------------------------------------------------------------- Resize


_RESIZE_ATTRS = ("mode", "coordinate_transformation_mode", "cubic_coeff_a", "exclude_outside", "nearest_mode")


def _is_empty(v) -> bool:
    if v is None:
        return True
    c = constant_of(v)
    if c is not None:
        return c.size == 0
    d = dims_of(v)
    return d is not None and len(d) == 1 and d[0] == 0


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
        return e.MatMul(g, m)
    if k == rank - 2:
        return e.MatMul(e.Transpose(m, perm=[1, 0]), g)
    perm = list(range(rank))
    perm[k], perm[-1] = perm[-1], perm[k]
    return e.Transpose(e.MatMul(e.Transpose(g, perm=perm), m), perm=perm)


def _outer(e, g, f, k, rank):
    """sum over every axis but k of g[.., j, ..] f[.., i, ..]: the (j, i) matrix dL/dM_k
    when g is the gradient at M_k's output and f the tensor M_k resizes."""
    perm = [a for a in range(rank) if a != k] + [k]
    g2, f2 = (e.Flatten(e.Transpose(v, perm=perm), axis=rank - 1) for v in (g, f))
    return e.MatMul(e.Transpose(g2, perm=[1, 0]), f2)


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


# The interpolation written out (for keep_aspect_ratio_policy where a Resize by scale cannot
# reproduce an axis, and for the gradients w.r.t. scales and roi): per output position j of
# an axis, x_j = x_original(j) and taps i = floor(x_j) + o with weights k(t (i - x_j)) / sum,
# as onnx's reference Resize computes them.


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

    def c(v):
        return _real(e, v, ct)

    y = e.Cast(e.Range(scalar_of(e, 0), scalar_of(e, out), scalar_of(e, 1)), to=int(ct))
    length = c(length)
    width = e.Mul(s, length)
    single = e.Equal(width, c(1.0))  # output_width 1: a fixed position
    s2 = e.Mul(s, s)
    d, extrapolated = {}, None
    if ctm in ("half_pixel", "pytorch_half_pixel", "half_pixel_symmetric"):
        yh = e.Add(y, c(0.5))
        x = e.Div(yh, s)  # (y + 0.5) / s - 0.5
        d["s"] = e.Neg(e.Div(yh, s2))
        if ctm == "half_pixel_symmetric":  # + length / 2 (1 - out / width) = length / 2 - out / (2 s)
            o = c(out)
            x = e.Add(e.Mul(e.Div(length, c(2.0)), e.Sub(c(1.0), e.Div(o, width))), x)
            d["s"] = e.Add(d["s"], e.Div(o, e.Mul(c(2.0), s2)))
        x = e.Sub(x, c(0.5))
        if ctm == "pytorch_half_pixel":
            x = e.Where(single, c(-0.5), x)
            d["s"] = e.Where(single, c(0.0), d["s"])
    elif ctm == "asymmetric":
        x = e.Div(y, s)
        d["s"] = e.Neg(e.Div(y, s2))
    elif ctm in ("align_corners", "tf_crop_and_resize"):
        last = e.Sub(length, c(1.0))
        den = e.Where(single, c(1.0), e.Sub(width, c(1.0)))  # (output_width 1 takes the other branch)
        dden = e.Neg(e.Div(length, e.Mul(den, den)))  # d/ds 1 / (s length - 1)
        if ctm == "align_corners":  # y (length - 1) / (width - 1)
            x = e.Where(single, c(0.0), e.Div(e.Mul(y, last), den))
            d["s"] = e.Where(single, c(0.0), e.Mul(e.Mul(y, last), dden))
        else:  # start (length - 1) + y (end - start) (length - 1) / (width - 1)
            start, end = roi_k
            span = e.Sub(end, start)
            along = e.Where(single, e.Div(e.Mul(span, last), c(2.0)), e.Div(e.Mul(e.Mul(y, span), last), den))
            x = e.Add(along, e.Mul(start, last))
            d["end"] = e.Mul(e.Where(single, c(0.5), e.Div(y, den)), last)
            d["start"] = e.Sub(last, d["end"])
            d["s"] = e.Where(single, c(0.0), e.Mul(e.Mul(e.Mul(y, span), last), dden))
            extrapolated = e.Or(e.Less(x, c(0.0)), e.Greater(x, last))
    else:
        raise GradientRuleError(f"Resize: coordinate_transformation_mode {ctm} has no gradient rule")
    return x, d, extrapolated


def _kernel(e, z, mode, a):
    """The interpolation kernel at z and its derivative d/dz: the triangle max(1 - |z|, 0)
    (linear) or Keys' cubic with coefficient a (cubic, zero from |z| = 2 on)."""
    if mode == "linear":
        inside = e.Less(e.Abs(z), e.scalar(1.0, like=z))
        zero = e.scalar(0.0, like=z)
        return (e.Where(inside, e.Sub(e.scalar(1.0, like=z), e.Abs(z)), zero),
                e.Where(inside, e.Neg(e.Sign(z)), zero))
    w, dw = _keys(e, e.Abs(z), a, support=True)
    return w, e.Mul(dw, e.Sign(z))


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
    last = e.Sub(_real(e, length, ct), e.scalar(1.0, like=x))
    zero = e.scalar(0.0, like=x)

    def clamp(tap):
        return e.Cast(e.Min(e.Max(tap, zero), last), to=int(ir.DataType.INT64))

    if mode == "nearest":
        half = e.scalar(0.5, like=x)
        rounding = text_attr(n, "nearest_mode", "round_prefer_floor")
        tap = {"round_prefer_floor": lambda: e.Ceil(e.Sub(x, half)),  # halves down
               "round_prefer_ceil": lambda: e.Floor(e.Add(x, half)),  # halves up
               "floor": lambda: e.Floor(x), "ceil": lambda: e.Ceil(x)}[rounding]()
        return clamp(e.Unsqueeze(tap, [1])), None, None, None
    radius = 1.0 if mode == "linear" else 2.0
    if stretch is None:
        offsets = e.const(np.arange(1 - radius, radius + 1), dtype=ct)
    else:
        first = e.Add(e.Floor(e.Div(e.scalar(-radius, like=x), stretch)), e.scalar(1.0, like=x))
        scalar = e.ints([])
        offsets = e.Range(e.Reshape(first, scalar), e.Reshape(e.Sub(e.scalar(2.0, like=x), first), scalar),
                          e.scalar(1.0, like=x))
    tap = e.Add(e.Unsqueeze(e.Floor(x), [1]), e.Unsqueeze(offsets, [0]))  # [out, T]
    dist = e.Sub(tap, e.Unsqueeze(x, [1]))
    k, dk = _kernel(e, dist if stretch is None else e.Mul(dist, stretch), mode, attr(n, "cubic_coeff_a", -0.75))
    if attr(n, "exclude_outside", 0):
        inside = e.Cast(e.And(e.GreaterOrEqual(tap, zero), e.LessOrEqual(tap, last)), to=int(ct))
        k, dk = e.Mul(k, inside), e.Mul(dk, inside)
    total = e.reduce("ReduceSum", k, [1], keepdims=True)
    w = e.Div(k, total)

    def normalized(du):  # d (u / sum u) from du
        return e.Div(e.Sub(du, e.Mul(w, e.reduce("ReduceSum", du, [1], keepdims=True))), total)

    dw_dx = normalized(e.Neg(dk) if stretch is None else e.Neg(e.Mul(dk, stretch)))
    dw_dt = None if stretch is None else normalized(e.Mul(dk, dist))
    return clamp(tap), w, dw_dx, dw_dt


def _explicit_matrix(e, idx, w, extrapolated, length, ct):
    """M (out x length): M[j, i] = sum of the weights of the taps of j landing on i; rows
    that take extrapolation_value are zero."""
    grid = e.Range(scalar_of(e, 0), scalar_of(e, length), scalar_of(e, 1))
    onehot = e.Cast(e.Equal(e.Unsqueeze(idx, [2]), grid), to=int(ct))  # [out, T, length]
    m = e.Squeeze(onehot, [1]) if w is None else e.reduce("ReduceSum", e.Mul(onehot, e.Unsqueeze(w, [2])), [1],
                                                            keepdims=False)
    if extrapolated is not None:
        m = e.Where(e.Unsqueeze(extrapolated, [1]), e.scalar(0.0, like=m), m)
    return m


def _policy_scale(e, d, axes, sizes, policy, ct):
    """keep_aspect_ratio_policy's scale: min / max over the axes of sizes[i] / in[axes[i]]."""
    lengths = e.Cast(stack(e, [d[k] for k in axes]), to=int(ct))
    ratios = e.Div(e.Cast(sizes, to=int(ct)), lengths)
    return e.reduce("ReduceMin" if policy == "not_larger" else "ReduceMax", ratios, [0], keepdims=True)


class _AxisGeometry(NamedTuple):
    """Where the output positions of one resized axis read from (see _source_coordinates)."""

    x: ir.Value  # source positions x_j [out]
    dx: dict  # dx_j / d{"s", "start", "end"}
    extrapolated: ir.Value | None  # tf_crop_and_resize: rows that take extrapolation_value
    s: ir.Value  # the axis' scale
    stretch: ir.Value | None  # antialias: the kernel's stretch min(s, 1)


class _ResizeAxes:
    """The resized axes of one Resize node: axis i of ``axes`` is tensor axis axes[i] (k).
    For each: its size or scale as the node gets it, its geometry (built once, where first
    needed: M_k from the formulas or the scales / roi gradients), its taps and its
    interpolation matrix M_k. keep_aspect_ratio_policy's one scale is built once too."""

    def __init__(self, e, n, d, axes, *, hd, use_sizes, given_c, policy, plan, ctm, antialias):
        self.e, self.n, self.d, self.axes, self.hd = e, n, d, axes, hd
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
            return e.Div(_real(e, self.given(i), hd), _real(e, length, hd))
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
    dl_dx = e.reduce("ReduceSum", e.Mul(at_taps, dw_dx), [1], keepdims=False)  # [out]
    g_s = g_start = g_end = None
    if want_scales:
        g_s = _total(e, e.Mul(dl_dx, g.dx["s"]))
        if g.stretch is not None:  # dt/ds = 1 where s < 1
            below = e.Cast(e.Less(g.s, _real(e, 1.0, hd)), to=int(hd))
            g_s = e.Add(g_s, e.Mul(_total(e, e.Mul(at_taps, dw_dt)), e.Reshape(below, [1])))
    if want_roi:
        g_start = _total(e, e.Mul(dl_dx, g.dx["start"]))
        g_end = _total(e, e.Mul(dl_dx, g.dx["end"]))
    return g_s, g_start, g_end


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
    x = n.inputs[0]
    roi, scales, sizes = (optional_input(n, i) for i in (1, 2, 3))
    (dy,) = dys
    if e.opset < 11:
        raise GradientRuleError(f"Resize '{n.name}': opset {e.opset} < 11 is not supported")
    d = Dims(e, x)
    use_sizes = not _is_empty(sizes)
    given = sizes if use_sizes else scales
    axes_attr = attr(n, "axes")
    rank = d.rank
    if rank is None and axes_attr is None:
        count = (dims_of(given) or [None])[0]
        rank = count if isinstance(count, int) else None
    if rank is None:
        raise unknown_rank(x, "Resize")
    axes = [int(a) % rank for a in axes_attr] if axes_attr else list(range(rank))

    mode = text_attr(n, "mode", "nearest")
    ctm = text_attr(n, "coordinate_transformation_mode", "half_pixel")
    crop = ctm == "tf_crop_and_resize"
    if crop and _is_empty(roi):
        raise GradientRuleError(f"Resize '{n.name}': tf_crop_and_resize without a roi")
    policy = text_attr(n, "keep_aspect_ratio_policy", "stretch") if use_sizes else "stretch"
    given_c = constant_of(given)
    plan = _aspect_plan(d, axes, given_c, policy) if policy != "stretch" else None
    hd = float_type(x)
    want_scales = wants(needs, 2) and not use_sizes and mode != "nearest"
    want_roi = wants(needs, 1) and crop and mode != "nearest"
    antialias = bool(attr(n, "antialias", 0)) and mode != "nearest" and e.opset >= 18
    resized = _ResizeAxes(e, n, d, axes, hd=hd, use_sizes=use_sizes, given_c=given_c, policy=policy, plan=plan,
                          ctm=ctm, antialias=antialias)

    matrices = [(k, resized.matrix(i)) for i, k in enumerate(axes)]  # (axis, M_k or None for an identity)
    dx, back = _through_matrices(e, dy, matrices, rank, None if x.dtype == hd else dy)  # back[i]: dy before axes[i]
    grads = [dx, None, None, None]

    if want_scales or want_roi:
        fwd = _resized_after(e, cast_to(e, x, hd), matrices, rank)  # fwd[i]: X through the axes after axes[i]
        ds, dstart, dend = [], [], []
        for i in range(len(axes)):
            g_s, g_start, g_end = _position_grads(e, resized, i, back[i], fwd[i], rank, want_scales=want_scales,
                                                  want_roi=want_roi)
            ds.append(g_s)
            dstart.append(g_start)
            dend.append(g_end)
        if want_scales:
            grads[2] = cast_to(e, e.Concat(*ds, axis=0), scales.dtype)
        if want_roi:
            grads[1] = cast_to(e, e.Concat(*dstart, *dend, axis=0), roi.dtype)
    for i in (1, 2):
        if grads[i] is None and wants(needs, i):
            grads[i] = e.zeros_like(n.inputs[i])  # nearest (piecewise constant), roi unused, scales unused
    return grads[: len(n.inputs)]


# ----------------------------------------------------------------------------- AffineGrid


@register("AffineGrid")
def affine_grid(n, dys, needs, e):
    """grid[n, p] = theta[n] @ (base[p], 1) with base[p] the normalized coordinates
    (x, y[, z]) of output position p (align_corners as the node). Linear in theta:
    dtheta[n] = sum_p dy[n, p] (base[p], 1)^T = [dy[n]^T @ base | dy[n]^T @ 1].
    base is the node's AffineGrid of the identity transform, the runtime's own grid."""
    theta, size = n.inputs
    (dy,) = dys
    td = dims_of(theta)
    r = td[1] if td is not None and isinstance(td[1], int) else None
    if r is None:
        sd = dims_of(size)
        r = sd[0] - 2 if sd is not None and isinstance(sd[0], int) else spatial_rank(n, dy, required=False)
    if r is None:
        raise GradientRuleError("AffineGrid gradient: cannot tell whether the grid is 2-D or 3-D")
    # batch 2: onnxruntime's float16 AffineGrid (a function) fails for a batch of one
    identity = e.const(np.stack([np.eye(r, r + 1)] * 2), dtype=theta.dtype or ir.DataType.FLOAT)
    size_c = constant_of(size)
    if size_c is not None:
        two_size = e.ints([2, *[int(s) for s in size_c[1:]]])
    else:
        two_size = e.Concat(e.ints([2]), e.Slice(as_int64(e, size), e.ints([1]), e.ints([r + 2])), axis=0)
    grids = e.AffineGrid(e.CastLike(identity, dy), two_size, align_corners=attr(n, "align_corners", 0))
    base = e.Reshape(e.Gather(grids, e.ints([0]), axis=0), [-1, r])  # [P, r]
    dyt = e.Transpose(e.Reshape(dy, [0, -1, r]), perm=[0, 2, 1])  # [N, r, P]
    linear = e.MatMul(dyt, base)  # [N, r, r]
    offset = e.reduce("ReduceSum", dyt, [2], keepdims=True)  # [N, r, 1]
    return (e.Concat(linear, offset, axis=2), None)


# ----------------------------------------------------------------------------- GridSample

_CUBIC_A = -0.75  # GridSample's cubic kernel (Keys, a = -0.75)


def _poly(e, t, coeffs):
    """coeffs[0] t^n + coeffs[1] t^(n-1) + ... + coeffs[n] (Horner)."""
    out = e.scalar(coeffs[0], like=t)
    for c in coeffs[1:]:
        out = e.Add(e.Mul(out, t), e.scalar(c, like=t))
    return out


def _keys(e, dist, a=_CUBIC_A, support=False):
    """The cubic convolution kernel at distance ``dist`` >= 0 and its derivative:
    (a+2)d^3 - (a+3)d^2 + 1 for d <= 1, a d^3 - 5a d^2 + 8a d - 4a for 1 < d < 2 (and 0
    from d = 2 on with ``support``; without it every dist must be < 2)."""
    near = e.LessOrEqual(dist, e.scalar(1.0, like=dist))
    w = e.Where(near, _poly(e, dist, [a + 2, -(a + 3), 0.0, 1.0]), _poly(e, dist, [a, -5 * a, 8 * a, -4 * a]))
    dw = e.Where(near, _poly(e, dist, [3 * (a + 2), -2 * (a + 3), 0.0]), _poly(e, dist, [3 * a, -10 * a, 8 * a]))
    if support:
        far = e.GreaterOrEqual(dist, e.scalar(2.0, like=dist))
        zero = e.scalar(0.0, like=dist)
        w, dw = e.Where(far, zero, w), e.Where(far, zero, dw)
    return w, dw


_OFFSETS = {"nearest": [0], "linear": [0, 1], "cubic": [-1, 0, 1, 2]}


def _reflect(e, idx, length, align):
    """Integer tap positions reflected into [0, length): about -0.5 and length - 0.5 (period
    2 length) without align_corners, about 0 and length - 1 (period 2 length - 2) with it."""
    if isinstance(length, int):
        period = e.ints([max(2 * length - 2 * align, 1)])
    else:
        period = e.Max(e.Sub(e.Mul(length, e.ints([2])), e.ints([2 * align])), e.ints([1]))
    m = e.Mod(idx, period)
    back = e.Sub(e.Sub(period, e.ints([1 - align])), m)
    return e.Where(e.Less(m, vec(e, length)), m, back)


def _axis_taps(e, coord, length, mode, padding, align, ct):
    """One spatial axis: ``coord`` [N, 1, P] normalized sampling coordinates. Returns
    (tap positions [N, T, P] int64 in range, weights [N, T, P] or None for all ones,
    d weights / d coord [N, T, P] or None) with zero padding folded into the weights."""
    lf = e.scalar(float(length), like=coord) if isinstance(length, int) else e.Cast(length, to=int(ct))
    one = e.scalar(1.0, like=coord)
    two = e.scalar(2.0, like=coord)
    shifted = e.Add(coord, one)
    if align:  # [-1, 1] -> [0, length - 1]
        lm1 = e.Sub(lf, one)
        pos, scale = e.Mul(e.Div(shifted, two), lm1), e.Div(lm1, two)
    else:  # [-1, 1] -> [-0.5, length - 0.5]
        pos, scale = e.Div(e.Sub(e.Mul(shifted, lf), one), two), e.Div(lf, two)
    if mode == "nearest":
        pos = e.Round(pos)  # half to even
    start = e.Floor(pos)
    frac = e.Sub(pos, start)
    offsets = _OFFSETS[mode]
    idx = e.Add(e.Cast(start, to=int(ir.DataType.INT64)), e.const(np.array(offsets, np.int64).reshape(1, -1, 1)))
    w = dw = None
    if mode == "linear":
        w = e.Concat(e.Sub(one, frac), frac, axis=1)
        dw = e.const(np.array([-1.0, 1.0]).reshape(1, 2, 1), dtype=ct)
    elif mode == "cubic":
        u = e.Sub(frac, e.const(np.array(offsets, dtype=float).reshape(1, -1, 1), dtype=ct))
        w, dk = _keys(e, e.Abs(u))
        dw = e.Mul(dk, e.Sign(u))
    last = vec(e, isub(e, length, 1))
    if padding == "zeros":
        inside = e.And(e.GreaterOrEqual(idx, e.ints([0])), e.LessOrEqual(idx, last))
        mask = e.Cast(inside, to=int(ct))
        w = mask if w is None else e.Mul(w, mask)
        dw = None if dw is None else e.Mul(dw, mask)
    if padding == "reflection":
        idx = _reflect(e, idx, length, align)
    else:  # border, and zeros (whose outside taps weigh 0)
        idx = e.Min(e.Max(idx, e.ints([0])), last)
    return idx, w, dw, scale


def _place(e, v, a, r):
    """[N, T_a, P] -> [N, 1, .., T_a, .., 1, P] with T_a on axis 1 + a of r tap axes."""
    others = [1 + b for b in range(r) if b != a]
    return e.Unsqueeze(v, others) if others else v


def _product(e, factors):
    factors = [f for f in factors if f is not None]
    if not factors:
        return None
    out = factors[0]
    for f in factors[1:]:
        out = e.Mul(out, f)
    return out


@register("GridSample")
def grid_sample(n, dys, needs, e):
    """Y[n, c, p] = sum over taps t of w_t(grid[n, p]) X[n, c, i_t(grid[n, p])]: the
    sampling point x_a = denormalize(grid[..., a]) on every spatial axis (align_corners),
    rounded half to even for nearest; taps floor(x_a) + {0} / {0, 1} / {-1, 0, 1, 2}
    (nearest / linear / cubic), weights the products over axes of 1, (1 - f, f) or the
    cubic kernel (a = -0.75) at the taps' distances; padding maps each tap index: zeros
    drops taps outside, border clamps them, reflection reflects them (as onnxruntime and
    torch do).

    dX[n, c, i] = sum of dy[n, c, p] w_t(p) over the taps landing on i (ScatterND, add).
    dgrid[n, p, a] = sum_c dy[n, c, p] sum_t X[n, c, i_t] dw_t / dx_a * dx_a / dgrid:
    (w_t)' on axis a times the other axes' weights, times the denormalization slope
    (length - 1) / 2 or length / 2; zero for nearest."""
    x, grid = n.inputs
    (dy,) = dys
    mode = text_attr(n, "mode", "linear")
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode)  # opset 16 names
    padding = text_attr(n, "padding_mode", "zeros")
    align = int(attr(n, "align_corners", 0))
    if mode not in _OFFSETS or padding not in ("zeros", "border", "reflection"):
        raise GradientRuleError(f"GridSample '{n.name}': mode {mode} / padding_mode {padding} has no gradient rule")
    r = spatial_rank(n, x, grid, dy, required=False)
    gd = dims_of(grid)
    if gd is not None and isinstance(gd[-1], int):
        r = gd[-1]
    if r is None:
        raise unknown_rank(x, "GridSample")
    ct = float_type(grid)
    xd = Dims(e, x)
    lengths = [xd[2 + a] for a in range(r)]
    batch, channels = xd[0], xd[1]
    plane = iprod(e, lengths)  # H*W(*D)

    coords = e.Transpose(e.Reshape(cast_to(e, grid, ct), [0, -1, r]), perm=[0, 2, 1])  # [N, r, P]
    idx, w, dw, slope = [], [], [], []
    for a in range(r):  # grid[..., 0] is the last spatial axis
        taps = _axis_taps(e, e.Gather(coords, e.ints([r - 1 - a]), axis=1), lengths[a], mode, padding, align, ct)
        idx.append(_place(e, taps[0], a, r))
        w.append(None if taps[1] is None else _place(e, taps[1], a, r))
        dw.append(None if taps[2] is None else _place(e, taps[2], a, r))
        slope.append(taps[3])
    count = int(np.prod([len(_OFFSETS[mode])] * r))  # taps per sampling point

    # flat row of each tap in X viewed as [N * plane, C]: n * plane + sum_a i_a * stride_a
    flat, stride = None, 1
    for a in reversed(range(r)):
        term = idx[a] if stride == 1 else e.Mul(idx[a], vec(e, stride))
        flat = term if flat is None else e.Add(flat, term)
        stride = iprod(e, [stride, lengths[a]])
    rows = e.Range(scalar_of(e, 0), scalar_of(e, batch), scalar_of(e, 1))
    first = e.Reshape(e.Mul(rows, vec(e, plane)), [-1] + [1] * (r + 1))
    flat = e.Reshape(e.Add(flat, first), [0, count, -1])  # [N, T, P]

    def per_tap(v):  # [N, T_0, .., T_r-1, P] -> [N, T, P]
        return e.Reshape(v, [0, count, -1])

    weight = _product(e, w)  # None: every weight is 1 (nearest without zero padding)
    dyt = e.Transpose(e.Reshape(dy, [0, 0, -1]), perm=[0, 2, 1])  # [N, P, C]
    width = vec(e, channels)

    dx = None
    if needs[0]:
        acc = accumulation_type(x, unique=False) or ir.DataType.FLOAT
        upd = e.Unsqueeze(cast_to(e, dyt, acc), [1])  # [N, 1, P, C]
        if weight is not None:
            upd = e.Mul(upd, e.Unsqueeze(cast_to(e, per_tap(weight), acc), [3]))  # [N, T, P, C]
        upd = e.Reshape(upd, e.Concat(e.ints([-1]), width, axis=0))
        base = zeros(e, e.Concat(vec(e, iprod(e, [batch, plane])), width, axis=0), x, acc)
        summed = e.ScatterND(base, e.Reshape(flat, [-1, 1]), upd, reduction="add")  # [N * plane, C]
        per_batch = e.Reshape(summed, e.Concat(vec(e, batch), vec(e, plane), width, axis=0))
        dx = cast_to(e, reshape_like(e, e.Transpose(per_batch, perm=[0, 2, 1]), x), x.dtype)

    dgrid = None
    if needs[1]:
        if mode == "nearest":
            dgrid = e.zeros_like(grid)
        else:
            table = e.Reshape(e.Transpose(e.Reshape(cast_to(e, x, ct), [0, 0, -1]), perm=[0, 2, 1]),
                              e.Concat(e.ints([-1]), width, axis=0))  # [N * plane, C]
            picked = e.Gather(table, flat, axis=0)  # [N, T, P, C]
            dot = e.reduce("ReduceSum", e.Mul(picked, e.Unsqueeze(cast_to(e, dyt, ct), [1])), [3],
                           keepdims=False)  # [N, T, P]: sum_c dy X at each tap
            parts = [None] * r
            for a in range(r):
                da = per_tap(_product(e, [dw[a]] + [w[b] for b in range(r) if b != a]))
                da = e.reduce("ReduceSum", e.Mul(dot, da), [1], keepdims=True)  # [N, 1, P]
                parts[r - 1 - a] = e.Mul(da, slope[a])
            dgrid = e.Transpose(e.Concat(*parts, axis=1) if r > 1 else parts[0], perm=[0, 2, 1])  # [N, P, r]
            dgrid = cast_to(e, reshape_like(e, dgrid, grid), grid.dtype)
    return (dx, dgrid)
