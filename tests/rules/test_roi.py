"""RoiAlign gradients (X and rois) against float64 finite differences and onnxruntime.

onnxruntime has RoiAlign kernels for opsets 10 and 16 (not 22), and onnx's reference treats
RoiAlign-10 as half_pixel (the op then had the output_half_pixel behavior): opset 13 runs on a
reference fixed for that, opset 22 on the reference alone.
"""

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx.reference.op_run import OpRun

from gradbuilder.testing import check_op, patch_reference_evaluator, run_onnxruntime

from .harness import check_graph_ints, ort_gradcheck
from .test_quantize import ort_fd_check

f32 = np.float32

X_SHAPE = (2, 3, 6, 7)
# (x1, y1, x2, y2): inside, across the right/bottom border, below -1 on the left (skipped
# samples), small (under a pixel: output_half_pixel stretches it to 1)
ROIS = np.array([[0.37, 0.61, 4.73, 3.93], [1.13, 0.27, 5.31, 5.17], [2.17, 1.33, 3.07, 2.49],
                 [-1.71, 4.23, 7.63, 6.87]], f32)
BATCH = np.array([0, 1, 1, 0])


def samples(rois, attrs, size, axis, opset):
    """Sample positions (per roi, bin, sample) of one axis, as the op computes them, and each
    roi's grid and length: to keep the test data away from the points where the forward is
    not differentiable."""
    half = attrs.get("coordinate_transformation_mode", "half_pixel" if opset >= 16 else "output_half_pixel")
    off = 0.5 if half == "half_pixel" else 0.0
    scale = attrs.get("spatial_scale", 1.0)
    pooled = attrs.get("output_height" if axis == 0 else "output_width", 1)
    lo, hi = rois[:, 1 - axis].astype(np.float64), rois[:, 3 - axis].astype(np.float64)
    start = lo * scale - off
    raw = hi * scale - off - start
    length = np.maximum(raw, 1.0) if half != "half_pixel" else raw
    bin_ = length / pooled
    ratio = attrs.get("sampling_ratio", 0)
    grid = np.full(len(rois), float(ratio)) if ratio > 0 else np.ceil(bin_)
    out = []
    for r in range(len(rois)):
        g = int(grid[r])
        out.append([start[r] + p * bin_[r] + (i + 0.5) * bin_[r] / g for p in range(pooled) for i in range(g)])
    stretched = (raw < 1.0) if half != "half_pixel" else np.zeros(len(rois), bool)
    return out, bin_, raw, stretched


def assert_smooth(rois, attrs, opset, shape=X_SHAPE, margin=1e-3):
    for axis, size in ((0, shape[2]), (1, shape[3])):
        pos, bin_, raw, stretched = samples(rois, attrs, size, axis, opset)
        for p in np.concatenate([np.asarray(v) for v in pos if v]):
            assert abs(p - round(p)) > margin and abs(p + 1) > margin and abs(p - size) > margin, (axis, p)
        if attrs.get("sampling_ratio", 0) == 0:  # the grid, ceil(bin), steps at integer bins
            moving = bin_[~stretched]
            assert np.all(np.abs(moving - np.round(moving)) > margin), bin_
        assert np.all(np.abs(raw - 1.0) > margin)  # output_half_pixel stretches lengths under 1


def forward_agrees(inputs, attrs, opset):
    """onnx's reference (as the tests patch it) and onnxruntime compute the same forward."""
    from onnx import reference

    node = helper.make_node("RoiAlign", ["x", "rois", "bi"], ["y"], **attrs)
    graph = helper.make_graph([node], "g", [], [helper.make_empty_tensor_value_info("y")],
                              [onnx.numpy_helper.from_array(a, k) for k, a in inputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    ref = reference.ReferenceEvaluator(model).run(None, {})[0]
    np.testing.assert_allclose(ref, run_onnxruntime(model, {})["y"], rtol=1e-5, atol=1e-5)


def roi_inputs(rng, rois=ROIS, batch=BATCH, shape=X_SHAPE):
    return [("x", rng.standard_normal(shape).astype(f32)), ("rois", rois), ("bi", batch)]


CASES = [
    ("default", {}),
    ("output-half-pixel", {"coordinate_transformation_mode": "output_half_pixel"}),
    ("ratio2-bins", {"sampling_ratio": 2, "output_height": 2, "output_width": 3}),
    ("scale", {"output_height": 3, "output_width": 2, "spatial_scale": 0.8}),
    ("ratio1-ohp", {"sampling_ratio": 1, "output_height": 2, "output_width": 2,
                    "coordinate_transformation_mode": "output_half_pixel"}),
    ("max-ratio2", {"mode": "max", "sampling_ratio": 2, "output_height": 2, "output_width": 3}),
    ("max-adaptive", {"mode": "max", "output_height": 2, "output_width": 3, "spatial_scale": 0.8}),
    ("max-ohp", {"mode": "max", "output_height": 3, "output_width": 2,
                 "coordinate_transformation_mode": "output_half_pixel"}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_roi_align(case, rng):
    _, attrs = case
    assert_smooth(ROIS, attrs, 16)
    inputs = roi_inputs(rng)
    forward_agrees(inputs, attrs, 16)
    check_op("RoiAlign", inputs, attrs, opset=16)


@pytest.mark.parametrize("case", [CASES[0], CASES[6]], ids=lambda c: c[0])
def test_roi_align_opset22(case, rng):
    # onnxruntime has no RoiAlign-22 kernel: the reference alone
    _, attrs = case
    check_op("RoiAlign", roi_inputs(rng), attrs, opset=22, ort=False)


@pytest.fixture
def roi_align_10(monkeypatch):
    """RoiAlign-10 had no coordinate_transformation_mode and sampled as output_half_pixel does
    (onnxruntime); onnx's reference applies the later default, half_pixel."""
    from onnx.reference.ops.op_roi_align import RoiAlign as Stock

    class RoiAlign(Stock):  # new_ops are matched by class name
        op_domain = ""

        def _run(self, X, rois, batch_indices, coordinate_transformation_mode=None, **kwargs):
            return super()._run(X, rois, batch_indices, coordinate_transformation_mode="output_half_pixel", **kwargs)

    patch_reference_evaluator(monkeypatch, RoiAlign)


@pytest.mark.parametrize("attrs", [{}, {"mode": "max", "sampling_ratio": 2, "output_height": 2}],
                         ids=["avg", "max"])
def test_roi_align_opset13(attrs, rng, roi_align_10):
    assert_smooth(ROIS, attrs, 13)
    inputs = roi_inputs(rng)
    forward_agrees(inputs, attrs, 13)
    check_op("RoiAlign", inputs, attrs, opset=13)


def test_roi_align_opset13_on_onnxruntime(rng):
    # the same form against finite differences of onnxruntime's own float64 forward
    ort_gradcheck("RoiAlign", roi_inputs(rng), {"output_height": 2, "output_width": 2}, opset=13)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[6]], ids=lambda c: c[0])
def test_roi_align_dynamic(case, rng):
    _, attrs = case
    inputs = roi_inputs(rng)
    check_op("RoiAlign", inputs, attrs, opset=16, weights_as="inputs", dims="dynamic")
    # batch_indices given at run time, of unknown length
    check_graph_ints("RoiAlign", inputs, attrs, graph_ints=["bi"], opset=16, weights_as="inputs", dims="dynamic")


def test_roi_align_empty_rois(rng):
    # a roi wholly outside X (every sample skipped) and an inverted half_pixel roi (no samples):
    # zero output, zero gradient; the others unaffected
    rois = np.concatenate([ROIS[:2], np.array([[9.3, 8.4, 11.7, 12.2], [4.6, 3.3, 2.2, 1.7]], f32)])
    attrs = {"output_height": 2, "output_width": 2}
    assert_smooth(rois[:2], attrs, 16)
    check_op("RoiAlign", roi_inputs(rng, rois), attrs, opset=16)


def test_roi_align_x_only(rng):
    check_op("RoiAlign", roi_inputs(rng), {"mode": "max", "output_height": 2}, opset=16, wrt=["x"])
    check_op("RoiAlign", roi_inputs(rng), {"sampling_ratio": 3}, opset=16, wrt=["rois"])


# ----------------------------------------------------------------------------- MaxRoiPool
# onnx's reference evaluator has no MaxRoiPool and onnxruntime runs it in float32 only (opsets
# 1-21), so MaxRoiPool is checked with float32 central differences on onnxruntime (the op is
# piecewise linear in X: exact away from ties), and in float64 on onnx's evaluator with a numpy
# MaxRoiPool of the spec (a true maximum, where onnxruntime clips each bin's maximum at FLT_MIN).


def max_roi_distinct(rng, shape, step=0.05):
    """Values at least ``step`` apart (no ties within a finite-difference step), none near 0
    (onnxruntime clips each bin's maximum at FLT_MIN, a kink at 0)."""
    size = int(np.prod(shape))
    return ((rng.permutation(size) - size / 2 + 0.5) * step).reshape(shape).astype(f32)


# [batch, x1, y1, x2, y2] (fractions away from the .5 rounding points): inside, over the
# right/bottom border, starting left of the image, malformed (x2 < x1: one column), tiny
MAX_ROI_ROIS = np.array([[0, 0.2, 1.3, 4.8, 5.2], [1, 2.7, 0.1, 7.3, 3.9], [1, -2.2, 2.4, 3.1, 6.6],
                 [0, 5.3, 1.2, 4.1, 4.3], [1, 3.1, 3.2, 3.3, 3.4]], f32)


@pytest.mark.parametrize("pooled", [(2, 2), (3, 2), (1, 1), (4, 3)])
@pytest.mark.parametrize("scale", [1.0, 0.6])
def test_max_roi_pool_ort(pooled, scale, rng):
    x = max_roi_distinct(rng, (2, 3, 6, 7))
    rois = MAX_ROI_ROIS.copy()
    if scale != 1.0:
        rois[:, 1:] = rois[:, 1:] / scale  # keep the scaled corners off the .5 rounding points
    ort_fd_check("MaxRoiPool", [("x", x), ("rois", rois)], {"pooled_shape": list(pooled), "spatial_scale": scale},
                 opset=16, wrt=["x"])


def test_max_roi_pool_rois_gradient_is_zero(rng):
    x = max_roi_distinct(rng, (1, 2, 5, 6))
    rois = np.array([[0, 0.2, 1.3, 4.8, 4.2], [0, 1.1, 0.3, 3.7, 2.2]], f32)
    got = ort_fd_check("MaxRoiPool", [("x", x), ("rois", rois)], {"pooled_shape": [2, 3]}, opset=21)
    assert not got["rois_grad"].any()


@pytest.mark.parametrize("opset", [13, 21])
def test_max_roi_pool_dynamic(opset, rng):
    """X a graph input of unknown dims: sizes come from Shape at run time (opset 13: the
    sums over overlapping bins are a one-hot product, not a ScatterND)."""
    x = max_roi_distinct(rng, (2, 2, 5, 6))
    ort_fd_check("MaxRoiPool", [("x", x), ("rois", MAX_ROI_ROIS)], {"pooled_shape": [2, 2]}, opset=opset, wrt=["x"],
                 dynamic=True)


class MaxRoiPool(OpRun):
    """The spec's MaxRoiPool (bins as onnxruntime computes them, a true maximum)."""

    op_domain = ""

    def _run(self, x, rois, pooled_shape=None, spatial_scale=None):
        ph, pw = pooled_shape
        scale = np.float32(1.0 if spatial_scale is None else spatial_scale)
        y = np.zeros((len(rois), x.shape[1], ph, pw), x.dtype)

        def bins(lo, hi, pooled, size):
            lo, hi = (int(np.sign(v) * np.floor(abs(v) + 0.5)) for v in (np.float32(lo) * scale, np.float32(hi) * scale))
            b = np.float32(max(hi - lo + 1, 1)) / np.float32(pooled)
            return [(min(max(int(np.floor(np.float32(p) * b)) + lo, 0), size),
                     min(max(int(np.ceil(np.float32(p + 1) * b)) + lo, 0), size)) for p in range(pooled)]

        for r, roi in enumerate(rois):
            for p, (h0, h1) in enumerate(bins(roi[2], roi[4], ph, x.shape[2])):
                for q, (w0, w1) in enumerate(bins(roi[1], roi[3], pw, x.shape[3])):
                    if h1 > h0 and w1 > w0:
                        y[r, :, p, q] = x[int(roi[0]), :, h0:h1, w0:w1].max(axis=(1, 2))
        return (y,)


def test_max_roi_pool_spec_float64(rng, monkeypatch):
    """float64 finite differences on onnx's evaluator with the numpy MaxRoiPool above: the
    negative maxima (clipped by onnxruntime) get their gradient too."""
    from onnx.reference import ReferenceEvaluator

    import gradbuilder.testing as testing

    monkeypatch.setattr(testing, "make_evaluator", lambda proto: ReferenceEvaluator(proto, new_ops=[MaxRoiPool]))
    x = max_roi_distinct(rng, (2, 3, 6, 7)) - 1.0  # mostly negative
    for pooled in ([3, 2], [2, 4]):
        check_op("MaxRoiPool", [("x", x), ("rois", MAX_ROI_ROIS)], {"pooled_shape": pooled}, opset=22, wrt=["x"], ort=False)
