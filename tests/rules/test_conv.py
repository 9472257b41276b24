import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from gradbuilder import GradientGraphBuilder
from gradbuilder.errors import GradientRuleError
from gradbuilder.testing import (
    check_op,
    make_op_model,
    numeric_gradient,
    ort_run,
    patch_reference_evaluator,
    reference_fix,
    to_float64,
)

f32 = np.float32


def arr(rng, *shape):
    return rng.standard_normal(shape).astype(f32)


def assert_forward_agrees(op, inputs, attrs, opset):
    """onnx's reference and onnxruntime compute the same forward: the case tests agreed semantics."""
    names = [name for name, _ in inputs]
    node = helper.make_node(op, names, ["y"], **attrs)
    graph = helper.make_graph([node], "g", [], [helper.make_empty_tensor_value_info("y")],
                              [onnx.numpy_helper.from_array(a, nm) for nm, a in inputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    from onnx import reference  # looked up at call time: tests may patch it

    ref = reference.ReferenceEvaluator(model).run(None, {})[0]
    got = ort_run(model, {})["y"]
    assert ref.shape == got.shape and np.allclose(ref, got, atol=1e-5), (op, attrs)


def conv_inputs(rng, x_shape, w_shape, bias, transpose=False, group=1):
    inputs = [("x", arr(rng, *x_shape)), ("w", arr(rng, *w_shape))]
    if bias:
        m = w_shape[1] * group if transpose else w_shape[0]
        inputs.append(("b", arr(rng, m)))
    return inputs


# ----------------------------------------------------------------------------- Conv

# (id, x shape, w shape, attributes, bias)
CONV = [
    ("1d", (2, 4, 7), (3, 4, 3), {}, True),
    ("1d-stride-pads", (2, 4, 7), (3, 4, 3), {"strides": [2], "pads": [1, 0]}, False),
    ("1d-dilation", (2, 4, 7), (3, 4, 2), {"dilations": [2], "pads": [2, 1]}, True),
    ("2d", (2, 4, 5, 6), (3, 4, 3, 3), {}, True),
    ("2d-stride2-pad1", (2, 4, 5, 6), (3, 4, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}, True),
    ("2d-uneven", (2, 4, 5, 6), (3, 4, 2, 3), {"strides": [3, 2], "dilations": [2, 1], "pads": [1, 0, 2, 1]}, False),
    ("2d-1x1-stride2", (2, 4, 5, 6), (6, 4, 1, 1), {"strides": [2, 2]}, True),
    ("2d-big-pads", (2, 4, 5, 6), (3, 4, 2, 2), {"pads": [2, 0, 0, 3]}, False),
    ("2d-kernel_shape", (2, 4, 5, 6), (3, 4, 3, 2), {"kernel_shape": [3, 2], "strides": [1, 2]}, False),
    # kernel volume above 9x the strides: dw as a Conv with the batch as channels, not im2col
    ("2d-big-kernel", (2, 3, 7, 6), (2, 3, 5, 4), {"pads": [1, 2, 0, 1], "dilations": [1, 1]}, True),
    ("group2", (2, 4, 5, 6), (6, 2, 3, 3), {"group": 2, "pads": [1, 1, 1, 1]}, True),
    ("group2-stride", (2, 4, 5, 6), (6, 2, 3, 2), {"group": 2, "strides": [2, 3], "dilations": [1, 2], "pads": [0, 1, 1, 0]}, False),
    ("depthwise", (2, 4, 5, 6), (4, 1, 3, 3), {"group": 4, "strides": [2, 2], "pads": [1, 1, 1, 1]}, True),
    ("depthwise-x2", (2, 4, 5, 6), (8, 1, 3, 3), {"group": 4, "strides": [2, 1], "pads": [1, 0, 1, 2]}, True),
    ("same-upper", (2, 4, 5, 6), (3, 4, 3, 2), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, False),
    ("same-lower", (2, 4, 5, 6), (3, 4, 2, 3), {"auto_pad": "SAME_LOWER", "strides": [2, 1]}, True),
    ("same-lower-group", (2, 4, 5, 6), (4, 2, 2, 2), {"auto_pad": "SAME_LOWER", "group": 2}, False),
    ("valid", (2, 4, 5, 6), (3, 4, 3, 3), {"auto_pad": "VALID", "strides": [2, 2]}, False),
    ("3d", (1, 2, 4, 5, 3), (3, 2, 2, 3, 2), {"strides": [2, 1, 2], "pads": [1, 0, 0, 0, 1, 1]}, True),
    ("3d-group-dilation", (1, 4, 4, 5, 3), (4, 2, 2, 2, 2), {"group": 2, "dilations": [2, 1, 1], "strides": [1, 2, 1]}, False),
]


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("case", CONV, ids=[c[0] for c in CONV])
def test_conv(case, opset, rng):
    _, xs, ws, attrs, bias = case
    inputs = conv_inputs(rng, xs, ws, bias)
    assert_forward_agrees("Conv", inputs, attrs, opset)
    check_op("Conv", inputs, attrs, opset=opset)


@pytest.mark.parametrize("case", [c for c in CONV if c[0] in ("2d-stride2-pad1", "group2-stride", "depthwise-x2",
                                                               "same-lower")], ids=lambda c: c[0])
def test_conv_dynamic(case, rng):
    _, xs, ws, attrs, bias = case
    check_op("Conv", conv_inputs(rng, xs, ws, bias), attrs, weights_as="inputs", dims="dynamic")


def test_conv_dilated_same_reference_only(rng):
    # onnxruntime refuses dilations with SAME_*; the rule follows the spec (reference evaluator).
    check_op("Conv", conv_inputs(rng, (2, 4, 5, 6), (3, 4, 2, 3), False),
             {"auto_pad": "SAME_UPPER", "dilations": [2, 2], "strides": [2, 1]}, ort=False)


def test_conv_weight_only(rng):
    check_op("Conv", conv_inputs(rng, (2, 4, 5, 6), (3, 4, 3, 3), False), {"strides": [2, 2]}, wrt=["w"])


# ----------------------------------------------------------------------------- ConvTranspose

# (id, x shape, w shape, attributes, bias); w is (C, M/group, *K)
CONV_T = [
    ("1d", (2, 4, 5), (4, 3, 3), {}, True),
    ("1d-stride-pads-outpad", (2, 4, 5), (4, 3, 3), {"strides": [2], "pads": [1, 2], "output_padding": [1]}, False),
    ("1d-dilation", (2, 4, 5), (4, 3, 2), {"dilations": [2], "strides": [3], "output_padding": [2]}, True),
    ("2d", (2, 4, 3, 4), (4, 3, 3, 3), {}, True),
    ("2d-stride2-pad1", (2, 4, 3, 4), (4, 3, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}, True),
    ("2d-outpad", (2, 4, 3, 4), (4, 3, 3, 2), {"strides": [2, 3], "pads": [1, 0, 0, 1], "output_padding": [1, 2]}, False),
    ("2d-dilation", (2, 4, 3, 4), (4, 3, 2, 3), {"strides": [2, 1], "dilations": [2, 2], "pads": [0, 2, 1, 1]}, False),
    ("2d-kernel_shape", (2, 4, 3, 4), (4, 3, 2, 2), {"kernel_shape": [2, 2], "strides": [2, 2]}, True),
    ("depthwise", (2, 4, 3, 4), (4, 1, 3, 3), {"group": 4, "strides": [2, 2], "pads": [1, 1, 0, 0]}, False),
    ("same-upper", (2, 4, 3, 4), (4, 3, 3, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, True),
    ("same-lower", (2, 4, 3, 4), (4, 3, 4, 3), {"auto_pad": "SAME_LOWER", "strides": [2, 2]}, False),
    ("valid", (2, 4, 3, 4), (4, 3, 3, 3), {"auto_pad": "VALID", "strides": [2, 1]}, False),
    ("output_shape-upper", (2, 4, 3, 4), (4, 3, 3, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2], "output_shape": [6, 7]}, True),
    ("output_shape-lower", (2, 4, 3, 4), (4, 3, 3, 2), {"auto_pad": "SAME_LOWER", "strides": [2, 2], "output_shape": [5, 8],
                                                        "output_padding": [1, 0]}, False),
    ("output_shape-full", (2, 4, 3, 4), (4, 3, 3, 3), {"strides": [2, 2], "output_shape": [7, 9]}, False),
    ("3d", (1, 2, 3, 2, 3), (2, 3, 2, 3, 2), {"strides": [2, 1, 2], "pads": [1, 0, 0, 0, 1, 1], "output_padding": [1, 0, 0]}, True),
]


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("case", CONV_T, ids=[c[0] for c in CONV_T])
def test_conv_transpose(case, opset, rng):
    _, xs, ws, attrs, bias = case
    inputs = conv_inputs(rng, xs, ws, bias, transpose=True, group=attrs.get("group", 1))
    assert_forward_agrees("ConvTranspose", inputs, attrs, opset)
    check_op("ConvTranspose", inputs, attrs, opset=opset)


@pytest.mark.parametrize("case", [CONV_T[5], CONV_T[10], CONV_T[13]], ids=lambda c: c[0])
def test_conv_transpose_dynamic(case, rng):
    _, xs, ws, attrs, bias = case
    check_op("ConvTranspose", conv_inputs(rng, xs, ws, bias, transpose=True), attrs,
             weights_as="inputs", dims="dynamic")


class _SpecConvTranspose:
    """A ConvTranspose for onnx's reference evaluator that follows the spec where the stock one
    does not: groups (it mixes them up unless in = out = group channels, and adds B[0] to every
    group) and output_shape without auto_pad (it starts the output at 0 instead of at
    total - total // 2), and output_shape longer than the full result with SAME_* (it starts
    such an output before the full result; onnxruntime pads at the end). It turns
    output_shape/SAME_* into explicit pads and runs the stock group=1 code group by group."""

    @staticmethod
    def make():
        from onnx.reference.ops import op_conv_transpose

        stock = op_conv_transpose.ConvTranspose

        class ConvTranspose(stock):  # new_ops are matched by class name
            op_domain = ""

            def _run(self, X, W, B=None, auto_pad=None, dilations=None, group=None, kernel_shape=None,
                     output_padding=None, output_shape=None, pads=None, strides=None):
                r = X.ndim - 2
                strides = strides or [1] * r
                dilations = dilations or [1] * r
                output_padding = output_padding or [0] * r
                if output_shape is not None or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
                    outs = output_shape or [X.shape[2 + i] * strides[i] for i in range(r)]
                    total = [strides[i] * (X.shape[2 + i] - 1) + output_padding[i]
                             + (W.shape[2 + i] - 1) * dilations[i] + 1 - outs[i] for i in range(r)]
                    if output_shape is not None:  # a longer output is padded at the end (onnxruntime)
                        total = [max(t, 0) for t in total]
                    begin = [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in total]
                    pads = begin + [t - b for t, b in zip(total, begin)]
                pads = pads or [0] * (2 * r)
                g = group or 1
                ys = [stock._run(self, x, w, None, dilations=dilations, group=1, output_padding=output_padding,
                                         pads=pads, strides=strides)[0]
                      for x, w in zip(np.split(X, g, axis=1), np.split(W, g, axis=0))]
                y = np.concatenate(ys, axis=1)
                if output_shape is not None:  # zeros past the full result
                    extra = [(0, 0), (0, 0)] + [(0, o - d) for o, d in zip(output_shape[-r:], y.shape[2:])]
                    y = np.pad(y, extra)
                if B is not None:
                    y = y + B.reshape((1, -1) + (1,) * r)
                return (y.astype(X.dtype),)

        return ConvTranspose


@pytest.fixture
def spec_conv_transpose(monkeypatch):
    """onnx.reference.ReferenceEvaluator with :class:`_SpecConvTranspose` (for make_op_model
    and gradcheck alike)."""
    patch_reference_evaluator(monkeypatch, _SpecConvTranspose.make())
    import onnx.reference as reference

    return reference.ReferenceEvaluator


SPEC_ONLY = [
    ("group2", (2, 4, 3, 4), (4, 3, 3, 3), {"group": 2, "strides": [2, 2], "pads": [1, 1, 1, 0], "output_padding": [1, 0]}),
    ("depthwise-x2", (2, 4, 3, 4), (4, 2, 2, 3), {"group": 4, "strides": [2, 1], "dilations": [1, 2]}),
    ("1d-group3", (2, 6, 5), (6, 1, 3), {"group": 3, "strides": [2], "pads": [1, 1]}),
    ("group2-same-lower", (2, 4, 3, 4), (4, 3, 3, 2), {"group": 2, "strides": [2, 2], "auto_pad": "SAME_LOWER"}),
    ("output_shape-notset", (2, 4, 3, 4), (4, 3, 3, 3), {"strides": [2, 2], "output_shape": [5, 8]}),
    ("output_shape-notset-outpad", (2, 4, 3, 4), (4, 3, 2, 3), {"strides": [2, 3], "output_shape": [6, 9],
                                                                "output_padding": [1, 1]}),
]


def test_conv_transpose_grouped_bias(rng, spec_conv_transpose):
    # onnxruntime rejects a bias on grouped ConvTranspose (it sizes B by W's dim 1): reference only
    inputs = conv_inputs(rng, (2, 4, 3, 4), (4, 3, 2, 2), True, transpose=True, group=2)
    check_op("ConvTranspose", inputs, {"group": 2, "strides": [2, 2]}, opset=18, ort=False)


# output_shape longer than the full transposed convolution (by less than a stride, the most
# onnxruntime accepts): the output is padded at the end, with B only (the last two cases are
# the form of onnx's backend case test_convtranspose_output_shape)
LONGER = [
    ("notset-1", (2, 2, 3), (2, 3, 2), {"strides": [2], "output_shape": [7]}),
    ("notset-2", (2, 2, 3), (2, 3, 2), {"strides": [3], "output_shape": [10]}),
    ("same-upper", (2, 2, 3), (2, 3, 2), {"strides": [3], "output_shape": [10], "auto_pad": "SAME_UPPER"}),
    ("same-lower", (2, 2, 3), (2, 3, 2), {"strides": [3], "output_shape": [9], "auto_pad": "SAME_LOWER"}),
    ("2d-outpad", (1, 2, 3, 3), (2, 2, 3, 2), {"strides": [3, 2], "output_shape": [11, 7], "output_padding": [1, 0]}),
    ("2d-backend", (1, 1, 3, 3), (1, 2, 3, 3), {"strides": [3, 2], "output_shape": [10, 8]}),
]


@pytest.mark.parametrize("case,bias", [(c, False) for c in SPEC_ONLY] + [(c, True) for c in LONGER],
                         ids=[c[0] for c in SPEC_ONLY] + [f"longer-{c[0]}" for c in LONGER])
def test_conv_transpose_spec_reference(case, bias, rng, spec_conv_transpose):
    _, xs, ws, attrs = case
    inputs = conv_inputs(rng, xs, ws, bias, transpose=True)
    # the patched reference agrees with onnxruntime on these
    assert_forward_agrees("ConvTranspose", inputs, attrs, 18)
    check_op("ConvTranspose", inputs, attrs, opset=18)


def test_conv_transpose_output_longer_than_full_backend_form(rng):
    # without auto_pad the stock reference agrees too (it starts every output_shape output at 0)
    inputs = conv_inputs(rng, (1, 1, 3, 3), (1, 2, 3, 3), False, transpose=True)
    check_op("ConvTranspose", inputs, {"strides": [3, 2], "output_shape": [10, 8]}, opset=18)
    check_op("ConvTranspose", inputs, {"strides": [3, 2], "output_shape": [10, 8]}, opset=18,
             weights_as="inputs", dims="dynamic")


def test_conv_transpose_same_kernel_shorter_than_stride_is_refused(rng):
    # SAME_* asks for in * stride outputs, longer than the full result when the kernel spans less
    # than a stride: onnxruntime then returns a shorter output than shape inference says
    nodes = [helper.make_node("ConvTranspose", ["x", "w"], ["y"], strides=[3], auto_pad="SAME_UPPER"),
             helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 2, 3])],
                              [helper.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, [])],
                              [onnx.numpy_helper.from_array(arr(rng, 2, 2, 1), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(GradientRuleError, match="less than a stride"):
        GradientGraphBuilder(model, ["x", "w"], ["loss"], "loss").build()


@pytest.mark.parametrize("op,ws,attrs", [
    ("Conv", (6, 2, 3, 3), {"group": 2, "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("Conv", (3, 4, 3, 3), {"pads": [1, 1, 1, 1]}),
    ("ConvTranspose", (4, 3, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 0]}),
], ids=["Conv-group", "Conv-im2col", "ConvTranspose"])
def test_float16(op, ws, attrs, rng):
    inputs = [(name, a.astype(np.float16)) for name, a in conv_inputs(rng, (2, 4, 5, 6), ws, True, op == "ConvTranspose")]
    check_op(op, inputs, attrs, opset=18, ort_rtol=1e-2, ort_atol=1e-2)


def check_symbolic_batch(op, inputs, attrs, opset=18):
    """Like check_op, with x's batch axis a symbolic 'N' (the usual exported model)."""
    from gradbuilder.testing import gradcheck

    model, weights, feeds = make_op_model(op, inputs, attrs, opset=opset, weights_as="inputs")
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"
    report = gradcheck(model, weights, "loss", feeds)
    assert report.passed, str(report)
    got = ort_run(GradientGraphBuilder(model, weights, ["loss"], "loss").build().model_proto, feeds)
    for w in weights:
        np.testing.assert_allclose(got[f"{w}_grad"], report.gradients[w], rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("op,ws,attrs", [
    ("Conv", (3, 4, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("Conv", (6, 2, 3, 2), {"group": 2, "strides": [2, 1], "auto_pad": "SAME_UPPER"}),
    ("ConvTranspose", (4, 3, 3, 3), {"strides": [2, 2], "pads": [1, 0, 1, 1], "output_padding": [1, 1]}),
], ids=["Conv", "Conv-group-same", "ConvTranspose"])
def test_symbolic_batch(op, ws, attrs, rng):
    check_symbolic_batch(op, conv_inputs(rng, (2, 4, 5, 6), ws, True, op == "ConvTranspose"), attrs)


# ----------------------------------------------------------------------------- DeformConv


def deform_conv_reference(X, W, offset, B=None, mask=None, dilations=None, group=None, kernel_shape=None,
                          offset_group=None, pads=None, strides=None):
    """DeformConv (2 spatial axes) in the input's precision: onnx's reference reads X through
    GridSample with float32 coordinates, too coarse for float64 finite differences of the
    offsets. Checked against onnxruntime's float64 forward below."""
    n, c, h, w = X.shape
    m, cpg, kh, kw = W.shape
    g, og = group or 1, offset_group or 1
    dh, dw = dilations or [1, 1]
    sh, sw = strides or [1, 1]
    pt, pl = (pads or [0, 0, 0, 0])[:2]
    oh, ow = offset.shape[2:]
    off = offset.reshape(n, og, kh, kw, 2, oh, ow)
    mask = np.ones((n, og, kh, kw, oh, ow)) if mask is None else mask.reshape(n, og, kh, kw, oh, ow)
    py = (np.arange(kh) * dh)[:, None, None, None] + (np.arange(oh) * sh - pt)[None, None, :, None] + off[:, :, :, :, 0]
    px = (np.arange(kw) * dw)[None, :, None, None] + (np.arange(ow) * sw - pl)[None, None, None, :] + off[:, :, :, :, 1]
    xg = X.reshape(n, og, c // og, h, w)
    y0, x0 = np.floor(py), np.floor(px)
    ni, gi = np.arange(n).reshape(n, 1, 1, 1, 1, 1), np.arange(og).reshape(1, og, 1, 1, 1, 1)
    val = 0.0
    for a in (0, 1):
        for b in (0, 1):
            yi, xi = y0 + a, x0 + b
            weight = (py - y0 if a else 1 - (py - y0)) * (px - x0 if b else 1 - (px - x0))
            inside = (yi >= 0) & (yi < h) & (xi >= 0) & (xi < w)
            v = xg[ni, gi, :, np.where(inside, yi, 0).astype(np.int64), np.where(inside, xi, 0).astype(np.int64)]
            val = val + (weight * inside * mask)[..., None] * v  # (n, og, kh, kw, oh, ow, c/og)
    cols = np.moveaxis(val, -1, 2).reshape(n, c, kh, kw, oh, ow)
    mg = m // g
    y = np.concatenate([np.einsum("mckl,nckluv->nmuv", W[i * mg:(i + 1) * mg], cols[:, i * cpg:(i + 1) * cpg])
                        for i in range(g)], axis=1)
    if B is not None:
        y = y + B.reshape(1, -1, 1, 1)
    return y.astype(X.dtype)


@pytest.fixture
def precise_deform_conv(monkeypatch):
    from onnx.reference.op_run import OpRun

    class DeformConv(OpRun):  # new_ops are matched by class name
        op_domain = ""

        def _run(self, X, W, offset, B=None, mask=None, dilations=None, group=None, kernel_shape=None,
                 offset_group=None, pads=None, strides=None):
            return (deform_conv_reference(X, W, offset, B, mask, dilations, group, kernel_shape, offset_group,
                                          pads, strides),)

    patch_reference_evaluator(monkeypatch, DeformConv)


# (id, x shape, w shape, attributes, bias, mask); offsets within +-1.5 pixels, some samples
# falling (partly) outside X
DEFORM = [
    ("basic", (1, 2, 5, 5), (3, 2, 2, 2), {}, False, False),
    ("pads", (2, 2, 4, 5), (3, 2, 2, 2), {"pads": [1, 1, 1, 1]}, False, False),
    ("groups-all", (2, 4, 6, 5), (4, 2, 3, 2), {"group": 2, "offset_group": 2, "strides": [2, 1],
                                                "pads": [1, 0, 1, 1], "dilations": [1, 2]}, True, True),
    ("offset-groups-mask", (1, 4, 4, 5), (3, 4, 2, 3), {"offset_group": 2, "kernel_shape": [2, 3],
                                                        "pads": [1, 1, 0, 2]}, False, True),
    ("bias", (1, 3, 4, 4), (2, 3, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}, True, False),
]


def deform_inputs(rng, xs, ws, attrs, bias, mask, dtype=f32):
    kh, kw = ws[2:]
    s, p, d = attrs.get("strides", [1, 1]), attrs.get("pads", [0] * 4), attrs.get("dilations", [1, 1])
    oh = (xs[2] + p[0] + p[2] - (kh - 1) * d[0] - 1) // s[0] + 1
    ow = (xs[3] + p[1] + p[3] - (kw - 1) * d[1] - 1) // s[1] + 1
    og = attrs.get("offset_group", 1)
    inputs = [("x", arr(rng, *xs).astype(dtype)), ("w", arr(rng, *ws).astype(dtype)),
              ("offset", rng.uniform(-1.5, 1.5, (xs[0], og * kh * kw * 2, oh, ow)).astype(dtype))]
    if bias or mask:
        inputs.append(("b", arr(rng, ws[0]).astype(dtype)) if bias else ("", None))
    if mask:
        inputs.append(("mask", rng.uniform(0.2, 1.0, (xs[0], og * kh * kw, oh, ow)).astype(dtype)))
    return inputs


@pytest.mark.parametrize("opset", [19, 22])
@pytest.mark.parametrize("case", DEFORM, ids=[c[0] for c in DEFORM])
def test_deform_conv(case, opset, rng, precise_deform_conv):
    _, xs, ws, attrs, bias, mask = case
    inputs = deform_inputs(rng, xs, ws, attrs, bias, mask)
    # the float64 reference above is onnxruntime's forward
    inputs64 = [(k, a.astype(np.float64) if a is not None else None) for k, a in inputs]
    feeds = {k: a for k, a in inputs64 if a is not None}
    node = helper.make_node("DeformConv", [k for k, _ in inputs64], ["y"], **attrs)
    vi = [helper.make_tensor_value_info(k, onnx.TensorProto.DOUBLE, a.shape) for k, a in feeds.items()]
    model = helper.make_model(helper.make_graph([node], "g", vi, [helper.make_empty_tensor_value_info("y")]),
                              opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    args = [feeds.get(k) for k in ("x", "w", "offset", "b", "mask")]
    np.testing.assert_allclose(deform_conv_reference(*args, **attrs), ort_run(model, feeds)["y"], rtol=1e-12,
                               atol=1e-12)
    check_op("DeformConv", inputs, attrs, opset=opset)


@pytest.mark.parametrize("case", [DEFORM[2], DEFORM[3]], ids=lambda c: c[0])
def test_deform_conv_dynamic(case, rng, precise_deform_conv):
    _, xs, ws, attrs, bias, mask = case
    check_op("DeformConv", deform_inputs(rng, xs, ws, attrs, bias, mask), attrs, opset=19, weights_as="inputs",
             dims="dynamic")


def test_deform_conv_some_inputs(rng, precise_deform_conv):
    _, xs, ws, attrs, bias, mask = DEFORM[2]
    inputs = deform_inputs(rng, xs, ws, attrs, bias, mask)
    check_op("DeformConv", inputs, attrs, opset=19, wrt=["offset"])
    check_op("DeformConv", inputs, attrs, opset=19, wrt=["x", "mask"])


# ----------------------------------------------------------------------------- CausalConvWithState
# onnxruntime 1.31 loads no opset-27 model, so everything runs on onnx's reference evaluator.
# Its CausalConvWithState (and the operator's function body) round the silu activation
# through float32 even for float64 inputs, which makes float64 finite differences noise;
# the checks here use gradbuilder.testing's copy of it that keeps the input's precision.


CCWS_OPSET = 27
B, C, L, K = 2, 3, 5, 3  # CausalConvWithState: batch, channels, length, kernel


def causal_evaluator(model):
    """The stock reference evaluator with the float64-preserving CausalConvWithState only."""
    return ReferenceEvaluator(model, new_ops=[reference_fix("CausalConvWithState")])


def causal_model(inputs, attrs, *, used=(0, 1), dims="static", wrt=None, seed=3):
    """One CausalConvWithState node; loss = random projections of the outputs in ``used``.
    The float inputs (or ``wrt``) are graph inputs with ``dims`` static or unknown."""
    rng = np.random.default_rng(seed)
    names, vis, feeds = [], [], {}
    for name, arr in inputs:
        names.append(name or "")
        if name:
            shape = list(arr.shape) if dims == "static" else [None] * arr.ndim
            vis.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(arr.dtype), shape))
            feeds[name] = arr
    weights = [n for n, a in inputs if n and (wrt is None or n in wrt)]
    node = helper.make_node("CausalConvWithState", names, ["y", "state"], **attrs)
    probe = helper.make_model(helper.make_graph([node], "probe", vis, [helper.make_empty_tensor_value_info("y"),
                                                                        helper.make_empty_tensor_value_info("state")]),
                              opset_imports=[helper.make_opsetid("", CCWS_OPSET)])
    values = causal_evaluator(probe).run(None, feeds)
    nodes, inits, terms = [node], [], []
    for i in used:
        out = ("y", "state")[i]
        inits.append(numpy_helper.from_array(rng.standard_normal(values[i].shape).astype(values[i].dtype), f"{out}_p"))
        nodes += [helper.make_node("Mul", [out, f"{out}_p"], [f"{out}_m"]),
                  helper.make_node("ReduceSum", [f"{out}_m"], [f"{out}_s"], keepdims=0)]
        terms.append(f"{out}_s")
    nodes.append(helper.make_node("Sum", terms, ["loss"]))
    dtype = helper.np_dtype_to_tensor_dtype(inputs[0][1].dtype)
    model = helper.make_model(helper.make_graph(nodes, "ccws", vis, [helper.make_tensor_value_info("loss", dtype, [])],
                                                inits), opset_imports=[helper.make_opsetid("", CCWS_OPSET)])
    model.ir_version = 10
    return model, weights, feeds


def causal_gradients(model, weights, feeds, *, float64=False):
    """The built gradients; ``float64``: the graph (built in the model's precision, as the
    op has no float64 type) evaluated in float64."""
    built = GradientGraphBuilder(model, weights=weights, outputs=["loss"], loss="loss").build().model_proto
    if float64:
        built, feeds = to_float64(built), {k: v.astype(np.float64) for k, v in feeds.items()}
    got = causal_evaluator(built).run([f"{w}_grad" for w in weights], feeds)
    return dict(zip(weights, got))


def causal_check(inputs, attrs, **kw):
    """Every element of every weight's gradient against float64 central differences."""
    model, weights, feeds = causal_model(inputs, attrs, **kw)
    feeds64 = {k: v.astype(np.float64) for k, v in feeds.items()}
    got = causal_gradients(model, weights, feeds, float64=True)
    fwd = causal_evaluator(to_float64(model))
    for w in weights:
        num = numeric_gradient(lambda v: float(fwd.run(None, {**feeds64, w: v})[0]), feeds64[w], 1e-6)
        np.testing.assert_allclose(got[w], num, rtol=1e-6, atol=1e-8, err_msg=w)
    return got


@pytest.fixture
def t(rng):
    return lambda *shape: rng.standard_normal(shape).astype(np.float32)


def causal_inputs(t, *, bias=True, past=True, k=K, length=L):
    return [("x", t(B, C, length)), ("w", t(C, 1, k)), ("b", t(C) if bias else None) if bias or past else None,
            ("p", t(B, C, k - 1)) if past else None]


def causal_cleaned(inputs):
    out = [(n, a) if a is not None else ("", None) for n, a in (i for i in inputs if i is not None)]
    while out and not out[-1][0]:
        out.pop()
    return out


CAUSAL_CASES = [  # (name, conv_inputs kwargs, attrs)
    ("plain", dict(bias=False, past=False), {}),
    ("bias", dict(past=False), {}),
    ("past", dict(bias=False), {}),
    ("bias-past", {}, {"activation": "none"}),
    ("silu", dict(bias=False, past=False), {"activation": "silu"}),
    ("swish-bias-past", {}, {"activation": "swish"}),
    ("silu-past-no-bias", dict(bias=False), {"activation": "silu"}),
    ("kernel-1-silu", dict(k=1), {"activation": "silu"}),
    ("short-input-silu", dict(length=1, k=4), {"activation": "silu"}),  # present_state reaches into the past
]


@pytest.mark.parametrize("dims", ["static", "dynamic"])
@pytest.mark.parametrize("case", CAUSAL_CASES, ids=[c[0] for c in CAUSAL_CASES])
def test_causal_conv_with_state(case, dims, t):
    """static: the taps as shifted slices; dynamic (kernel size unknown): the gathered taps."""
    _, kw, attrs = case
    causal_check(causal_cleaned(causal_inputs(t, **kw)), attrs, dims=dims)


@pytest.mark.parametrize("used", [(0,), (1,)], ids=["output-only", "present-state-only"])
@pytest.mark.parametrize("activation", ["none", "silu"])
def test_causal_conv_with_state_one_output(used, activation, t):
    causal_check(causal_cleaned(causal_inputs(t)), {"activation": activation}, used=used)
    causal_check(causal_cleaned(causal_inputs(t, past=False, length=2, k=4)), {"activation": activation}, used=used, dims="dynamic")


@pytest.mark.parametrize("wrt", [["x"], ["w"], ["b"], ["p"], ["w", "p"]])
def test_causal_conv_with_state_some_inputs(wrt, t):
    causal_check(causal_cleaned(causal_inputs(t)), {"activation": "silu"}, wrt=wrt)


def test_causal_conv_with_state_matches_the_function_body(t):
    """The direct rule and the function-body fallback give the same gradients."""
    from gradbuilder.compiler import registry

    model, weights, feeds = causal_model(causal_cleaned(causal_inputs(t)), {"activation": "silu"})
    direct = causal_gradients(model, weights, feeds, float64=True)
    with registry.scoped():
        assert registry.unregister("", "CausalConvWithState")
        body = causal_gradients(model, weights, feeds, float64=True)
    for w in weights:
        np.testing.assert_allclose(direct[w], body[w], rtol=1e-5, atol=1e-6, err_msg=w)  # the body rounds via float32


@pytest.mark.parametrize("dims", ["static", "dynamic"])
def test_causal_conv_with_state_float16(dims, t):
    """float16 inputs: the silu derivative in float32, the result close to float64's."""
    inputs = causal_cleaned(causal_inputs(t))
    ref = causal_check(inputs, {"activation": "silu"}, dims=dims)
    model, weights, feeds = causal_model([(n, a.astype(np.float16) if a is not None else a) for n, a in inputs],
                                       {"activation": "silu"}, dims=dims)
    got = causal_gradients(model, weights, feeds)
    for w in weights:
        assert got[w].dtype == np.float16
        np.testing.assert_allclose(got[w].astype(np.float64), ref[w], rtol=2e-2, atol=2e-2 * np.abs(ref[w]).max())
