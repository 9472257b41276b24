"""Gradients of Resize, GridSample, AffineGrid, DepthToSpace, SpaceToDepth, Col2Im and
CenterCropPad against finite differences.

Resize and GridSample are also checked on onnxruntime alone (``ort_affine_check``,
``ort_fd_check``), because onnx's reference evaluator and onnxruntime compute different
forwards for a few configurations; there check_op's comparison of onnxruntime's gradient
with the reference's is switched off (ort=False) and the case says why.
"""

import numpy as np
import pytest
from onnx import helper, numpy_helper

from gradbuilder import GradientGraphBuilder
from gradbuilder.testing import check_model, check_op, gradcheck, make_op_model, ort_run, ort_session

f32 = np.float32
EMPTY = np.array([], f32)


def arr(rng, *shape):
    return rng.standard_normal(shape).astype(f32)


# ----------------------------------------------------------------------------- harness


def op_model(op, inputs, attrs, opset, wrt):
    """One ``op`` node, loss = sum(y * proj), the ``wrt`` inputs as graph inputs (the rest
    initializers); the output shape comes from onnxruntime, not from the reference."""
    node = helper.make_node(op, [name if a is not None else "" for name, a in inputs], ["y"], **attrs)
    values = {name: a for name, a in inputs if a is not None}
    vi = [helper.make_tensor_value_info(w, helper.np_dtype_to_tensor_dtype(values[w].dtype), values[w].shape)
          for w in wrt]
    inits = [numpy_helper.from_array(a, name) for name, a in values.items() if name not in wrt]
    probe = helper.make_model(helper.make_graph([node], "p", vi, [helper.make_empty_tensor_value_info("y")], inits),
                              opset_imports=[helper.make_opsetid("", opset)])
    probe.ir_version = 10
    feeds = {w: values[w] for w in wrt}
    y = ort_run(probe, feeds)["y"]
    proj = np.random.default_rng(7).standard_normal(y.shape).astype(y.dtype)
    nodes = [node, helper.make_node("Mul", ["y", "proj"], ["m"]),
             helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0)]
    loss = helper.make_tensor_value_info("loss", helper.np_dtype_to_tensor_dtype(y.dtype), [])
    inits.append(numpy_helper.from_array(proj, "proj"))
    model = helper.make_model(helper.make_graph(nodes, "g", vi, [loss], inits),
                              opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model, feeds


def ort_gradients(op, inputs, attrs, opset, wrt):
    """(feeds, session of the loss, gradients) on onnxruntime."""
    model, feeds = op_model(op, inputs, attrs, opset, wrt)
    built = GradientGraphBuilder(model, list(wrt), ["loss"], "loss").build().model_proto
    grads = ort_run(built, feeds)
    return feeds, ort_session(model), {w: grads[f"{w}_grad"].astype(np.float64) for w in wrt}


def ort_affine_check(op, inputs, attrs, opset):
    """The op is affine in x, so on onnxruntime loss(x + e_i) - loss(x) is exactly dx_i (up to
    float32 rounding): the gradient is checked against the runtime's own forward, whatever
    it computes."""
    feeds, sess, grads = ort_gradients(op, inputs, attrs, opset, ["x"])
    x = feeds["x"]

    def loss(v):
        return float(sess.run(None, {**feeds, "x": v.astype(x.dtype)})[0])

    base = loss(x)
    num = np.array([loss((x.reshape(-1) + np.eye(x.size)[i]).reshape(x.shape)) - base for i in range(x.size)])
    np.testing.assert_allclose(grads["x"].reshape(-1), num, rtol=1e-4, atol=1e-4)


def ort_fd_check(op, inputs, attrs, opset, wrt, dtype=np.float64):
    """Central finite differences of the loss on onnxruntime itself, element by element, in
    float64 (or float32 with a coarse step where onnxruntime has no float64 kernel)."""
    eps, rtol, atol = (1e-6, 1e-5, 1e-6) if dtype == np.float64 else (1e-3, 1e-2, 2e-3)
    inputs = [(n, a.astype(dtype) if a is not None and a.dtype.kind == "f" else a) for n, a in inputs]
    feeds, sess, grads = ort_gradients(op, inputs, attrs, opset, wrt)
    for w in wrt:
        base = feeds[w]
        num = np.zeros(base.size)
        for i in range(base.size):
            step = (np.eye(base.size)[i] * eps).reshape(base.shape).astype(dtype)
            plus, minus = (sess.run(None, {**feeds, w: v})[0] for v in (base + step, base - step))
            num[i] = (plus - minus) / (2 * eps)
        np.testing.assert_allclose(grads[w].reshape(-1), num, rtol=rtol, atol=atol, err_msg=f"{op} {attrs} d{w}")


def with_runtime_inputs(model, feeds, names):
    """``model`` with the initializers ``names`` turned into graph inputs of unknown size."""
    for t in list(model.graph.initializer):
        if t.name in names:
            model.graph.initializer.remove(t)
            value = numpy_helper.to_array(t)
            model.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, [None] * value.ndim))
            feeds[t.name] = value
    return model, feeds


# ----------------------------------------------------------------------------- Resize

X4 = (2, 2, 3, 4)
FAST = {"max_elements": 6, "directions": 2}  # Resize is linear in X: a few directions suffice


def resize_inputs(x, scales=None, sizes=None, roi=EMPTY):
    """X, roi, scales[, sizes]; with sizes, scales is an empty constant (as exporters write it)."""
    inputs = [("x", x), ("roi", roi), ("scales", EMPTY if scales is None else np.array(scales, f32))]
    if sizes is not None:
        inputs.append(("sizes", np.array(sizes, np.int64)))
    return inputs


def check_resize(inputs, attrs, opset, **kw):
    check_op("Resize", inputs, attrs, opset=opset, wrt=["x"], **FAST, **kw)


ROI = [0.0, 0.0, 0.1, -0.2, 1.0, 1.0, 0.8, 1.1]  # crops in on H, reaches outside on W
COORDINATE_MODES = ["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_crop_and_resize",
                    "half_pixel_symmetric"]


def coordinate_case(rng, ctm, resize):
    attrs = {"coordinate_transformation_mode": ctm}
    roi = EMPTY
    if ctm == "tf_crop_and_resize":
        attrs["extrapolation_value"] = 0.5
        roi = np.array(ROI, f32)
    x = arr(rng, *X4)
    if resize == "up-scales":
        return resize_inputs(x, scales=[1, 1, 2, 1.5], roi=roi), attrs
    return resize_inputs(x, sizes=[2, 2, 2, 3], roi=roi), attrs


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
@pytest.mark.parametrize("ctm", COORDINATE_MODES)
@pytest.mark.parametrize("resize", ["up-scales", "down-sizes"])
def test_resize_coordinate_modes(resize, ctm, mode, rng):
    inputs, attrs = coordinate_case(rng, ctm, resize)
    check_resize(inputs, {**attrs, "mode": mode}, 19)


@pytest.mark.parametrize("opset,resize", [(11, "down-sizes"), (13, "up-scales"), (18, "down-sizes")])
@pytest.mark.parametrize("ctm", COORDINATE_MODES[:-1])  # half_pixel_symmetric: opset 19
def test_resize_coordinate_modes_before_19(ctm, opset, resize, rng):
    inputs, attrs = coordinate_case(rng, ctm, resize)
    check_resize(inputs, {**attrs, "mode": "linear"}, opset)


@pytest.mark.parametrize("nearest_mode", ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"])
@pytest.mark.parametrize("ctm,scales", [("half_pixel", [1, 1, 2.5, 0.5]), ("asymmetric", [1, 1, 0.75, 1.75])],
                         ids=["half_pixel-up-down", "asymmetric-down-up"])
def test_resize_nearest_modes(scales, ctm, nearest_mode, rng):
    attrs = {"mode": "nearest", "nearest_mode": nearest_mode, "coordinate_transformation_mode": ctm}
    check_resize(resize_inputs(arr(rng, 1, 2, 4, 4), scales=scales), attrs, 13)


@pytest.mark.parametrize("a", [-0.75, -0.5])
@pytest.mark.parametrize("exclude_outside", [0, 1])
@pytest.mark.parametrize("scales", [[1, 1, 1.5, 2], [1, 1, 0.75, 0.5]], ids=["up", "down"])
def test_resize_cubic(scales, exclude_outside, a, rng):
    attrs = {"mode": "cubic", "cubic_coeff_a": a, "exclude_outside": exclude_outside}
    check_resize(resize_inputs(arr(rng, 1, 2, 4, 4), scales=scales), attrs, 13)


ANTIALIAS = [(18, "linear", 0, "half_pixel"), (18, "cubic", 0, "align_corners"), (18, "cubic", 1, "asymmetric"),
             (18, "linear", 0, "pytorch_half_pixel"), (19, "linear", 0, "half_pixel_symmetric"),
             (19, "cubic", 1, "half_pixel")]


@pytest.mark.parametrize("opset,mode,exclude_outside,ctm", ANTIALIAS, ids=["-".join(map(str, c)) for c in ANTIALIAS])
def test_resize_antialias(opset, mode, exclude_outside, ctm, rng):
    attrs = {"mode": mode, "antialias": 1, "exclude_outside": exclude_outside, "coordinate_transformation_mode": ctm}
    check_resize(resize_inputs(arr(rng, 1, 2, 6, 7), sizes=[1, 2, 3, 2]), attrs, opset)


AXES = [("nearest", [2, 3], [2.0, 0.5], None), ("linear", [3], [1.5], None), ("cubic", [2], None, [5]),
        ("linear", [3, 2], None, [3, 5])]


@pytest.mark.parametrize("mode,axes,scales,sizes", AXES, ids=[f"{m}-{a}" for m, a, _, _ in AXES])
def test_resize_axes(mode, axes, scales, sizes, rng):
    check_resize(resize_inputs(arr(rng, *X4), scales=scales, sizes=sizes), {"mode": mode, "axes": axes}, 18)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_resize_negative_axes(mode, rng):
    # onnx's reference Resize fails on negative axes: onnxruntime only
    ort_affine_check("Resize", resize_inputs(arr(rng, *X4), scales=[0.5, 2.0]), {"mode": mode, "axes": [-1, -2]}, 18)


ASPECT = [("not_larger", [2, 4], "nearest"),  # scale 2/3 set by H: W 5 -> 3
          ("not_larger", [4, 9], "linear"),  # scale 4/3 set by H: W 5 -> 7 (6.67 rounds up: see below)
          ("not_smaller", [5, 4], "cubic"),  # scale 5/3 set by H: W 5 -> 8
          ("not_smaller", [1, 4], "linear")]  # scale 4/5 set by W: H 3 -> 2


@pytest.mark.parametrize("policy,sizes,mode", ASPECT, ids=[f"{p}-{s}" for p, s, _ in ASPECT])
def test_resize_keep_aspect_ratio(policy, sizes, mode, rng):
    # [4, 9]: W round(4/3 * 5) = 7 but floor(4/3 * 5) = 6, which no Resize by scale
    # reproduces: that M_k is built from the interpolation formulas, which must agree with
    # onnxruntime's own forward too
    attrs = {"mode": mode, "axes": [2, 3], "keep_aspect_ratio_policy": policy}
    inputs = resize_inputs(arr(rng, 1, 2, 3, 5), sizes=sizes)
    check_resize(inputs, attrs, 18)
    if sizes == [4, 9]:
        ort_affine_check("Resize", inputs, {**attrs, "coordinate_transformation_mode": "pytorch_half_pixel"}, 18)


ASPECT_AT_RUN_TIME = [("not_larger", [7, 8], "nearest", "half_pixel", (1, 1, 2, 2)),  # onnx's test cases
                      ("not_smaller", [1, 3], "nearest", "half_pixel", (1, 1, 2, 4)),
                      ("not_larger", [4, 9], "linear", "asymmetric", (1, 2, 3, 5)),
                      ("not_smaller", [5, 4], "cubic", "pytorch_half_pixel", (1, 2, 3, 5)),
                      ("not_larger", [2, 8], "linear", "align_corners", (1, 2, 3, 5)),
                      ("not_smaller", [2, 4], "nearest", "half_pixel_symmetric", (1, 2, 3, 5))]


@pytest.mark.parametrize("policy,sizes,mode,ctm,shape", ASPECT_AT_RUN_TIME,
                         ids=[f"{p}-{s}-{m}-{c}" for p, s, m, c, _ in ASPECT_AT_RUN_TIME])
def test_resize_keep_aspect_ratio_sizes_at_run_time(policy, sizes, mode, ctm, shape, rng):
    # sizes a graph input: the scale min / max(sizes / in) is computed in the graph and the
    # interpolation matrices are built from the formulas (x of static or unknown dims)
    dims = "dynamic" if mode == "linear" else "static"
    attrs = {"mode": mode, "axes": [2, 3], "keep_aspect_ratio_policy": policy, "coordinate_transformation_mode": ctm}
    model, weights, feeds = make_op_model("Resize", resize_inputs(arr(rng, *shape), sizes=sizes), attrs, opset=19,
                                          wrt=["x"], weights_as="inputs", dims=dims)
    model, feeds = with_runtime_inputs(model, feeds, {"sizes"})
    next(v for v in model.graph.input if v.name == "sizes").type.tensor_type.shape.dim[0].dim_value = 2
    check_model(model, weights, feeds, **FAST)


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
@pytest.mark.parametrize("shape,scales", [((2, 3, 5), [1, 1, 1.6]), ((2, 5), [0.6, 2.0]),
                                          ((1, 2, 2, 3, 3), [1, 1, 1.5, 2, 0.7])], ids=["1d", "2d-input", "3d"])
def test_resize_other_ranks(shape, scales, mode, rng):
    # onnxruntime's cubic Resize takes 2-D and 4-D inputs only: reference only for the others
    check_resize(resize_inputs(arr(rng, *shape), scales=scales), {"mode": mode}, 13,
                 ort=mode != "cubic" or len(shape) == 2)


# Where onnx's reference and onnxruntime compute different forwards, the rule follows the
# runtime that runs the graph (its M_k is the runtime's own Resize), so onnxruntime's gradient
# differs from the reference's: check_op runs with ort=False, and the float32 graph is checked
# against onnxruntime's own forward instead.
ORT_DIFFERS = [
    # an output length of 1 (3 * 0.6 = 1.8): onnxruntime takes source position -0.5
    # (pytorch_half_pixel), the reference its formula with the fractional length 1.8
    ("pytorch_half_pixel", "linear", [1, 1, 0.6, 0.5]),
    ("pytorch_half_pixel", "cubic", [1, 1, 0.6, 0.5]),
    ("pytorch_half_pixel", "nearest", [1, 1, 0.6, 0.5]),
    # fractional output lengths (3 * 1.7, 4 * 0.8): the reference divides by length - 1 with
    # the fractional length, onnxruntime with the integer one
    ("align_corners", "linear", [1, 1, 1.7, 0.8]),
    ("align_corners", "cubic", [1, 1, 1.7, 0.8]),
    ("tf_crop_and_resize", "linear", [1, 1, 1.7, 0.8]),
]


@pytest.mark.parametrize("ctm,mode,scales", ORT_DIFFERS, ids=[f"{c}-{m}" for c, m, _ in ORT_DIFFERS])
def test_resize_where_onnxruntime_differs(ctm, mode, scales, rng):
    attrs = {"mode": mode, "coordinate_transformation_mode": ctm, "nearest_mode": "ceil"}
    roi = np.array(ROI, f32) if ctm == "tf_crop_and_resize" else EMPTY
    inputs = resize_inputs(arr(rng, *X4), scales=scales, roi=roi)
    check_resize(inputs, attrs, 18, ort=False)
    ort_affine_check("Resize", inputs, attrs, 18)


RESIZE_DYNAMIC = [(13, "nearest", "asymmetric", "scales"), (18, "linear", "half_pixel", "sizes"),
                  (13, "cubic", "align_corners", "sizes"), (18, "linear", "tf_crop_and_resize", "scales")]


@pytest.mark.parametrize("opset,mode,ctm,given", RESIZE_DYNAMIC, ids=["-".join(map(str, c)) for c in RESIZE_DYNAMIC])
def test_resize_dynamic(opset, mode, ctm, given, rng):
    # x of unknown dims: each M_k is built for a length known at run time only
    attrs = {"mode": mode, "coordinate_transformation_mode": ctm}
    roi = np.array(ROI, f32) if ctm == "tf_crop_and_resize" else EMPTY
    kw = {"scales": [1, 1, 2, 0.75]} if given == "scales" else {"sizes": [2, 2, 5, 3]}
    check_resize(resize_inputs(arr(rng, *X4), roi=roi, **kw), attrs, opset, weights_as="inputs", dims="dynamic")


@pytest.mark.parametrize("mode,ctm", [("nearest", "half_pixel"), ("linear", "tf_crop_and_resize"),
                                      ("cubic", "pytorch_half_pixel")])
@pytest.mark.parametrize("given", ["scales", "sizes"])
def test_resize_values_given_at_run_time(given, mode, ctm, rng):
    # roi, scales and sizes as graph inputs: nothing is known statically, every axis is resized
    attrs = {"mode": mode, "coordinate_transformation_mode": ctm}
    roi = np.array(ROI, f32) if ctm == "tf_crop_and_resize" else EMPTY
    inputs = [("x", arr(rng, *X4)), ("roi", roi)]
    if given == "scales":
        inputs.append(("scales", np.array([1, 1, 2, 0.75], f32)))
    else:
        inputs += [("", None), ("sizes", np.array([2, 2, 5, 3]))]
    model, weights, feeds = make_op_model("Resize", inputs, attrs, opset=18, wrt=["x"], weights_as="inputs",
                                          dims="dynamic")
    model, feeds = with_runtime_inputs(model, feeds, {"roi", given} if roi.size else {given})
    # onnx's shape inference rejects sizes of unknown length: its length stays known
    next(v for v in model.graph.input if v.name == given).type.tensor_type.shape.dim[0].dim_value = 4
    check_model(model, weights, feeds, **FAST)


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_resize_axis_keeping_its_length(mode, rng):
    # H 3 * 1.3 -> 3 is resampled though its length stays; onnxruntime returns a Resize whose
    # whole output shape is its input's unchanged, so that M_k is built from the formulas
    inputs = resize_inputs(arr(rng, 1, 2, 3, 5), scales=[1, 1, 1.3, 0.7])
    check_resize(inputs, {"mode": mode}, 13)
    ort_affine_check("Resize", inputs, {"mode": mode}, 13)


def test_resize_float16(rng):
    x = arr(rng, 1, 2, 3, 4).astype(np.float16)
    check_resize(resize_inputs(x, scales=[1, 1, 2, 1.5]), {"mode": "linear"}, 18, ort_rtol=1e-2, ort_atol=1e-2)
    # float16 X, float32 scales
    inputs = [("x", x), ("roi", EMPTY), ("scales", np.array([1.7, 1.3], f32))]
    check_op("Resize", inputs, {"mode": "linear", "axes": [2, 3]}, opset=19, wrt=["x", "scales"], **FAST,
             ort_rtol=1e-2, ort_atol=1e-2)


def test_resize_identity_axes_are_skipped(rng):
    model, weights, _ = make_op_model("Resize", resize_inputs(arr(rng, *X4), scales=[1, 1, 2, 1]),
                                      {"mode": "linear"}, opset=13, wrt=["x"])
    built = GradientGraphBuilder(model, weights, ["loss"], "loss").build().model_proto
    assert [n.op_type for n in built.graph.node].count("Resize") == 2  # the forward and one M_k


# ----------------------------------------------------------------------------- Resize: scales and roi


# (mode, coordinate transformation, antialias, exclude_outside, cubic_coeff_a, scales)
# on X [1, 2, 4, 4]: H 4 * 1.7 -> 6, W 4 * 0.8 -> 3 (or 4 * 0.55 -> 2, 4 * 1.3 -> 5); no
# output length is integral (a smaller scale would drop a row) and no source position
# sits on a kink of the kernel
RESIZE_PARAMS = [
    ("linear", "half_pixel", 0, 0, -0.75, [1.7, 0.8]),
    ("linear", "asymmetric", 0, 0, -0.75, [0.55, 1.3]),
    ("linear", "pytorch_half_pixel", 0, 0, -0.75, [1.7, 0.8]),
    ("linear", "align_corners", 0, 0, -0.75, [0.55, 1.3]),
    ("linear", "half_pixel_symmetric", 0, 0, -0.75, [1.7, 0.8]),
    ("linear", "tf_crop_and_resize", 0, 0, -0.75, [0.55, 1.3]),
    ("cubic", "half_pixel", 0, 0, -0.75, [0.55, 1.3]),
    ("cubic", "asymmetric", 0, 1, -0.5, [1.7, 0.8]),
    ("cubic", "align_corners", 0, 0, -0.75, [1.7, 0.8]),
    ("cubic", "tf_crop_and_resize", 0, 1, -0.75, [1.7, 0.8]),
    ("cubic", "half_pixel_symmetric", 0, 1, -0.5, [0.55, 1.3]),
    ("linear", "half_pixel", 1, 0, -0.75, [0.55, 1.3]),  # antialias: the kernel stretches with 1 / scale
    ("linear", "pytorch_half_pixel", 1, 1, -0.75, [1.7, 0.8]),
    ("cubic", "half_pixel", 1, 0, -0.75, [1.7, 0.8]),
    ("cubic", "asymmetric", 1, 1, -0.5, [0.55, 1.3]),
    ("nearest", "half_pixel", 0, 0, -0.75, [1.7, 0.8]),  # piecewise constant: zero
    ("nearest", "tf_crop_and_resize", 0, 0, -0.75, [0.55, 1.3]),
]
ROI2 = [0.1, -0.2, 0.8, 1.1]  # H cropped in, W reaching outside (extrapolated columns)


@pytest.mark.parametrize("mode,ctm,antialias,exclude,a,scales", RESIZE_PARAMS,
                         ids=[f"{m}-{c}-aa{aa}-ex{x}-{s[0]}" for m, c, aa, x, _, s in RESIZE_PARAMS])
def test_resize_scales_and_roi(mode, ctm, antialias, exclude, a, scales, rng):
    # source positions depend on the scale (and roi): dL/dscales, dL/droi
    attrs = {"mode": mode, "coordinate_transformation_mode": ctm, "axes": [2, 3], "antialias": antialias,
             "exclude_outside": exclude, "cubic_coeff_a": a, "extrapolation_value": 0.5}
    roi = np.array(ROI2 if ctm == "tf_crop_and_resize" else [], f32)
    wrt = ["x", "scales"] + (["roi"] if roi.size else [])
    # fractional output lengths (s * 4): onnxruntime's align_corners / tf_crop_and_resize
    # forward takes the integer length, onnx's reference (and the spec's test data) the
    # fractional one, which the gradients w.r.t. scales follow
    ort = ctm not in ("align_corners", "tf_crop_and_resize")
    check_op("Resize", [("x", arr(rng, 1, 2, 4, 4)), ("roi", roi), ("scales", np.array(scales, f32))], attrs,
             opset=19, wrt=wrt, ort=ort, max_elements=6, directions=2)


@pytest.mark.parametrize("mode", ["linear", "cubic"])
def test_resize_scales_all_axes(mode, rng):
    # scales for every axis (no axes attribute, opset 13), none of them 1; H keeps its length
    inputs = [("x", arr(rng, 3, 5)), ("roi", EMPTY), ("scales", np.array([1.3, 0.7], f32))]
    check_op("Resize", inputs, {"mode": mode}, opset=13, wrt=["x", "scales"], max_elements=6, directions=2)


# every resized axis changes its length: onnxruntime leaves an axis whose length stays
# alone, whatever its roi (onnx's reference crops it)
ROI_SIZES = [("linear", [0.0, 0.0, 0.4, 0.6, 1.0, 1.0, 0.6, 0.8], None, [1, 1, 3, 3]),  # onnx's test case
             ("linear", [0.4, 0.6, 0.6, 0.8], [2, 3], [3, 3]),
             ("linear", [0.6, 0.4, 0.8, 0.6], [3, 2], [3, 3]),
             ("cubic", [0.1, -0.3, 0.85, 1.2], [2, 3], [3, 5]),
             ("nearest", [0.1, -0.3, 0.85, 1.2], [2, 3], [3, 5])]


@pytest.mark.parametrize("mode,roi,axes,sizes", ROI_SIZES, ids=[f"{m}-{a}" for m, _, a, _ in ROI_SIZES])
def test_resize_roi_with_sizes(mode, roi, axes, sizes, rng):
    # sizes given: the output lengths do not depend on roi, the source positions do
    attrs = {"mode": mode, "coordinate_transformation_mode": "tf_crop_and_resize", "extrapolation_value": 10.0}
    if axes is not None:
        attrs["axes"] = axes
    # N, C of length 1: their roi moves nothing (a longer axis would put its first and last
    # source positions on the extrapolation border at roi 0 and 1)
    inputs = [("x", arr(rng, 1, 1, 4, 4)), ("roi", np.array(roi, f32)), ("", None), ("sizes", np.array(sizes))]
    check_op("Resize", inputs, attrs, opset=19, wrt=["x", "roi"], max_elements=8, directions=2)


@pytest.mark.parametrize("sizes", [[4, 9], [2, 8]], ids=["from-formulas", "resize-by-scale"])
def test_resize_roi_with_keep_aspect_ratio(sizes, rng):
    attrs = {"mode": "linear", "axes": [2, 3], "keep_aspect_ratio_policy": "not_larger",
             "coordinate_transformation_mode": "tf_crop_and_resize"}
    inputs = [("x", arr(rng, 1, 1, 3, 5)), ("roi", np.array([0.1, -0.2, 0.85, 1.1], f32)), ("", None),
              ("sizes", np.array(sizes))]
    check_op("Resize", inputs, attrs, opset=19, wrt=["x", "roi"], ort=False, max_elements=8, directions=2)


def test_resize_roi_and_scales_at_run_time(rng):
    # roi, scales and x graph inputs of unknown dims; checked with axes [2, 3], then the
    # same resize written for every axis (N, C by 1, where the output length drops on the
    # left: no derivative there) must give the same H, W entries
    attrs = {"mode": "cubic", "coordinate_transformation_mode": "tf_crop_and_resize"}
    x = arr(rng, 1, 2, 4, 4)
    inputs = [("x", x), ("roi", np.array(ROI2, f32)), ("scales", np.array([1.7, 0.8], f32))]
    wrt = ["x", "roi", "scales"]
    want = check_op("Resize", inputs, {**attrs, "axes": [2, 3]}, opset=18, wrt=wrt, weights_as="inputs",
                    dims="dynamic", ort=False, max_elements=8, directions=2).gradients
    full = [("x", x), ("roi", np.array([0, 0, ROI2[0], ROI2[1], 1, 1, ROI2[2], ROI2[3]], f32)),
            ("scales", np.array([1, 1, 1.7, 0.8], f32))]
    model, weights, feeds = make_op_model("Resize", full, attrs, opset=18, wrt=wrt, weights_as="inputs",
                                          dims="dynamic")
    got = gradcheck(model, weights, "loss", feeds, max_elements=0, directions=0).gradients
    np.testing.assert_allclose(got["x"], want["x"], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got["scales"][2:], want["scales"], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got["roi"][[2, 3, 6, 7]], want["roi"], rtol=1e-9, atol=1e-12)


# ----------------------------------------------------------------------------- GridSample


GRID_CASES = [(20, mode, padding, align) for mode in ["linear", "nearest", "cubic"]
              for padding in ["zeros", "border", "reflection"] for align in [0, 1]]
GRID_CASES += [(16, mode, padding, 0) for mode in ["bilinear", "nearest", "bicubic"]
               for padding in ["zeros", "border", "reflection"]]  # opset 16's mode names


def grid_inputs(rng, x_shape, out_shape, reach=1.2):
    x = arr(rng, *x_shape)
    grid = rng.uniform(-reach, reach, (x_shape[0], *out_shape, len(x_shape) - 2)).astype(f32)
    return [("x", x), ("grid", grid)]


@pytest.mark.parametrize("opset,mode,padding,align", GRID_CASES, ids=["-".join(map(str, c)) for c in GRID_CASES])
def test_grid_sample(opset, mode, padding, align, rng):
    attrs = {"mode": mode, "padding_mode": padding, "align_corners": align}
    # reflection folds points far outside several times
    inputs = grid_inputs(rng, (2, 2, 3, 4), (2, 2), reach=3.0 if padding == "reflection" else 1.2)
    if mode.endswith("cubic") and padding == "border":
        # onnx's reference clamps the sampling point into the image before taking its 4x4
        # taps; onnxruntime (and torch) clamp each tap instead, which the rule follows.
        # onnxruntime has no float64 GridSample at opset 16: float32 there
        ort_fd_check("GridSample", inputs, attrs, opset, ["x", "grid"], np.float64 if opset >= 20 else f32)
    else:
        check_op("GridSample", inputs, attrs, opset=opset, max_elements=8, directions=2)


GRID_3D = [("linear", "zeros", 0), ("linear", "zeros", 1), ("linear", "border", 1), ("linear", "reflection", 0),
           ("linear", "reflection", 1), ("nearest", "zeros", 0), ("nearest", "zeros", 1), ("nearest", "reflection", 0),
           ("nearest", "border", 1), ("cubic", "zeros", 0), ("cubic", "reflection", 1)]


@pytest.mark.parametrize("mode,padding,align", GRID_3D, ids=["-".join(map(str, c)) for c in GRID_3D])
def test_grid_sample_3d(mode, padding, align, rng):
    # volumetric, at grid points off the pixel centres (linear's kinks) and off the
    # half-way points (nearest's jumps). onnxruntime has no 3-D cubic GridSample: reference
    # only there (and no cubic border, where the reference clamps before taking the taps,
    # see test_grid_sample)
    attrs = {"mode": mode, "padding_mode": padding, "align_corners": align}
    check_op("GridSample", grid_inputs(rng, (2, 2, 2, 3, 3), (2, 1, 2)), attrs, opset=20, ort=mode != "cubic",
             max_elements=8, directions=2)


@pytest.mark.parametrize("mode,padding", [("linear", "zeros"), ("cubic", "reflection"), ("nearest", "border")])
def test_grid_sample_dynamic(mode, padding, rng):
    check_op("GridSample", grid_inputs(rng, (2, 2, 3, 4), (2, 2)), {"mode": mode, "padding_mode": padding},
             opset=20, weights_as="inputs", dims="dynamic", max_elements=8, directions=2)


@pytest.mark.parametrize("mode", ["linear", "cubic"])
def test_grid_sample_opset22(mode, rng):
    check_op("GridSample", grid_inputs(rng, (2, 2, 3, 4), (2, 2)), {"mode": mode, "padding_mode": "reflection"},
             opset=22, max_elements=8, directions=2)


def test_grid_sample_one_input(rng):
    inputs = grid_inputs(rng, (1, 3, 4, 3), (3, 2))
    check_op("GridSample", inputs, {"mode": "cubic"}, opset=20, wrt=["grid"], max_elements=8)
    check_op("GridSample", inputs, {"mode": "linear", "padding_mode": "border"}, opset=20, wrt=["x"], max_elements=8)


# ----------------------------------------------------------------------------- against torch


def torch_gradients(fn, inputs, wrt):
    """Gradients of sum(fn(*inputs) * proj) by torch's autograd, proj as in op_model."""
    import torch

    ts = {name: torch.tensor(a, requires_grad=name in wrt) for name, a in inputs}
    y = fn(*ts.values())
    proj = np.random.default_rng(7).standard_normal(tuple(y.shape)).astype(inputs[0][1].dtype)
    (y * torch.tensor(proj)).sum().backward()
    return {w: ts[w].grad.numpy() for w in wrt}


TORCH_GRID = [(m, p, (i + j) % 2) for i, m in enumerate(["linear", "nearest", "cubic"])
              for j, p in enumerate(["zeros", "border", "reflection"])]
TORCH_GRID.append(("cubic", "border", 0))  # where onnx's reference differs, both align_corners


@pytest.mark.parametrize("mode,padding,align", TORCH_GRID, ids=["-".join(map(str, c)) for c in TORCH_GRID])
def test_grid_sample_matches_torch(mode, padding, align, rng):
    # torch.nn.functional.grid_sample's autograd, float64 (onnxruntime's forward is torch's)
    import torch.nn.functional as F

    inputs = [(n, a.astype(np.float64)) for n, a in grid_inputs(rng, (2, 3, 4, 5), (3, 2), reach=1.5)]
    attrs = {"mode": mode, "padding_mode": padding, "align_corners": align}
    _, _, got = ort_gradients("GridSample", inputs, attrs, 20, ["x", "grid"])
    kw = {"mode": {"linear": "bilinear", "cubic": "bicubic"}.get(mode, mode), "padding_mode": padding,
          "align_corners": bool(align)}
    want = torch_gradients(lambda x, g: F.grid_sample(x, g, **kw), inputs, ["x", "grid"])
    for w in ("x", "grid"):
        np.testing.assert_allclose(got[w], want[w], rtol=1e-9, atol=1e-12, err_msg=w)


TORCH_RESIZE = [("linear", "pytorch_half_pixel", False, 1.5), ("linear", "align_corners", True, 0.5),
                ("cubic", "pytorch_half_pixel", False, 2.0), ("cubic", "align_corners", True, 1.5),
                ("nearest", "asymmetric", None, 1.5), ("nearest", "asymmetric", None, 0.5)]


@pytest.mark.parametrize("mode,ctm,align,scale", TORCH_RESIZE, ids=[f"{m}-{c}-{s}" for m, c, _, s in TORCH_RESIZE])
def test_resize_matches_torch(mode, ctm, align, scale, rng):
    # torch.nn.functional.interpolate's autograd (bilinear / bicubic / nearest)
    import torch.nn.functional as F

    attrs = {"mode": mode, "coordinate_transformation_mode": ctm, "nearest_mode": "floor"}
    inputs = resize_inputs(arr(rng, 1, 2, 4, 5), scales=[1, 1, scale, scale])
    _, _, got = ort_gradients("Resize", inputs, attrs, 13, ["x"])
    kw = {} if align is None else {"align_corners": align}
    tmode = {"linear": "bilinear", "cubic": "bicubic"}.get(mode, mode)
    want = torch_gradients(lambda x: F.interpolate(x, scale_factor=scale, mode=tmode, **kw), inputs[:1], ["x"])
    np.testing.assert_allclose(got["x"], want["x"], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- AffineGrid


@pytest.mark.parametrize("align", [0, 1])
@pytest.mark.parametrize("size", [[2, 3, 4, 5], [2, 1, 2, 3, 4], [1, 1, 3, 2]], ids=["2d", "3d", "2d-batch-1"])
def test_affine_grid(size, align, rng):
    theta = arr(rng, size[0], len(size) - 2, len(size) - 1)
    check_op("AffineGrid", [("theta", theta), ("size", np.array(size))], {"align_corners": align}, opset=20)


@pytest.mark.parametrize("size", [[2, 3, 4, 5], [2, 1, 2, 3, 4]], ids=["2d", "3d"])
def test_affine_grid_size_at_run_time(size, rng):
    theta = arr(rng, size[0], len(size) - 2, len(size) - 1)
    model, weights, feeds = make_op_model("AffineGrid", [("theta", theta), ("size", np.array(size))],
                                          {"align_corners": 1}, opset=20, weights_as="inputs", dims="dynamic")
    model, feeds = with_runtime_inputs(model, feeds, {"size"})
    # the size's length still tells 2-D from 3-D
    model.graph.input[-1].type.tensor_type.shape.dim[0].dim_value = len(size)
    check_model(model, weights, feeds)


@pytest.mark.parametrize("align", [0, 1])
@pytest.mark.parametrize("size", [[2, 3, 4, 5], [2, 1, 2, 3, 4]], ids=["2d", "3d"])
def test_affine_grid_matches_torch(size, align, rng):
    import torch.nn.functional as F

    theta = rng.standard_normal((size[0], len(size) - 2, len(size) - 1))
    inputs = [("theta", theta), ("size", np.array(size))]
    _, _, got = ort_gradients("AffineGrid", inputs, {"align_corners": align}, 20, ["theta"])
    want = torch_gradients(lambda t, s: F.affine_grid(t, size, align_corners=bool(align)), inputs, ["theta"])
    np.testing.assert_allclose(got["theta"], want["theta"], rtol=1e-9, atol=1e-12)


def test_affine_grid_float16(rng):
    theta = arr(rng, 2, 2, 3).astype(np.float16)
    check_op("AffineGrid", [("theta", theta), ("size", np.array([2, 3, 4, 5]))], opset=20,
             ort_rtol=1e-2, ort_atol=1e-2)


# ----------------------------------------------------------------------------- DepthToSpace / SpaceToDepth


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
@pytest.mark.parametrize("blocksize,shape", [(2, (2, 8, 2, 3)), (3, (1, 18, 2, 1))])
@pytest.mark.parametrize("dims", ["static", "dynamic"])
def test_depth_to_space(dims, blocksize, shape, mode, rng):
    check_op("DepthToSpace", [("x", arr(rng, *shape))], {"blocksize": blocksize, "mode": mode}, opset=13,
             weights_as="inputs", dims=dims)


@pytest.mark.parametrize("opset", [11, 13])
def test_depth_to_space_default_mode(opset, rng):
    check_op("DepthToSpace", [("x", arr(rng, 1, 8, 2, 2))], {"blocksize": 2}, opset=opset)


@pytest.mark.parametrize("blocksize,shape", [(2, (2, 3, 4, 6)), (3, (1, 2, 3, 6))])
@pytest.mark.parametrize("dims", ["static", "dynamic"])
def test_space_to_depth(dims, blocksize, shape, rng):
    check_op("SpaceToDepth", [("x", arr(rng, *shape))], {"blocksize": blocksize}, opset=13,
             weights_as="inputs", dims=dims)


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
@pytest.mark.parametrize("dims", ["static", "dynamic"])
def test_space_to_depth_mode(dims, mode, rng):
    # SpaceToDepth-28's mode; onnxruntime 1.31 does not load opset 28: reference only
    check_op("SpaceToDepth", [("x", arr(rng, 2, 3, 4, 6))], {"blocksize": 2, "mode": mode}, opset=28,
             weights_as="inputs", dims=dims, ort=False)


# ----------------------------------------------------------------------------- Col2Im


COL2IM = [
    # (image, block, attrs)
    ([3, 4], [2, 2], {}),
    ([5, 5], [2, 3], {"strides": [2, 1]}),
    ([4, 5], [2, 2], {"dilations": [2, 1], "pads": [1, 0, 0, 1]}),
    ([5, 4], [3, 2], {"strides": [2, 2], "pads": [1, 1, 1, 1], "dilations": [1, 2]}),
    ([3, 3, 4], [2, 1, 2], {"strides": [1, 2, 1], "pads": [0, 1, 0, 1, 0, 0]}),
    ([6], [3], {"strides": [2], "pads": [1, 2]}),
]


def col2im_input(rng, batch, channels, image, block, attrs):
    r = len(image)
    strides, dilations = attrs.get("strides", [1] * r), attrs.get("dilations", [1] * r)
    pads = attrs.get("pads", [0] * 2 * r)
    blocks = [(image[i] + pads[i] + pads[r + i] - dilations[i] * (block[i] - 1) - 1) // strides[i] + 1
              for i in range(r)]
    return arr(rng, batch, channels * int(np.prod(block)), int(np.prod(blocks)))


@pytest.mark.parametrize("image,block,attrs", COL2IM, ids=[f"{len(c[0])}d-{i}" for i, c in enumerate(COL2IM)])
def test_col2im(image, block, attrs, rng):
    x = col2im_input(rng, 2, 2, image, block, attrs)
    check_op("Col2Im", [("x", x), ("image", np.array(image)), ("block", np.array(block))], attrs, opset=18)


def test_col2im_dynamic(rng):
    image, block, attrs = [5, 4], [3, 2], {"strides": [2, 2], "pads": [1, 1, 1, 1]}
    x = col2im_input(rng, 2, 3, image, block, attrs)
    inputs = [("x", x), ("image", np.array(image)), ("block", np.array(block))]
    model, weights, feeds = make_op_model("Col2Im", inputs, attrs, opset=18, weights_as="inputs", dims="dynamic")
    # image and block shapes given at run time: the one-hot kernels are built in the graph
    model, feeds = with_runtime_inputs(model, feeds, {"image", "block"})
    for v in model.graph.input[-2:]:
        v.type.tensor_type.shape.dim[0].dim_value = 2
    check_model(model, weights, feeds)


def test_col2im_float16(rng):
    x = col2im_input(rng, 1, 2, [3, 4], [2, 2], {}).astype(np.float16)
    check_op("Col2Im", [("x", x), ("image", np.array([3, 4])), ("block", np.array([2, 2]))], opset=18,
             ort_rtol=1e-2, ort_atol=1e-2)


# ----------------------------------------------------------------------------- CenterCropPad


@pytest.mark.parametrize("shape,axes", [
    ([2, 5, 2, 7], None),  # pad, crop by an odd amount, crop, pad by an odd amount
    ([5, 3], [2, 3]),
    ([1, 6], [-2, -1]),
    ([4], [1]),
    ([2, 2, 3, 4], None),  # unchanged
], ids=["all-axes", "hw", "negative-axes", "one-axis", "same"])
@pytest.mark.parametrize("dims", ["static", "dynamic"])
def test_center_crop_pad(shape, axes, dims, rng):
    attrs = {} if axes is None else {"axes": axes}
    check_op("CenterCropPad", [("x", arr(rng, 2, 2, 3, 4)), ("shape", np.array(shape))], attrs, opset=18,
             weights_as="inputs", dims=dims)
