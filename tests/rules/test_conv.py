import numpy as np
import onnx
import pytest
from onnx import helper

from gradbuilder import GradientGraphBuilder
from gradbuilder.errors import GradientRuleError
from gradbuilder.testing import check_op, make_op_model, run_onnxruntime

f32 = np.float32


def arr(rng, *shape):
    return rng.standard_normal(shape).astype(f32)


def ort_run(model, feeds):
    return run_onnxruntime(model, feeds)


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


@pytest.mark.parametrize("case", [CONV[4], CONV[10], CONV[12], CONV[14]], ids=lambda c: c[0])
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
    total - total // 2). It turns output_shape/SAME_* into explicit pads and runs the stock
    group=1 code group by group."""

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
                    begin = [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in total]
                    pads = begin + [t - b for t, b in zip(total, begin)]
                pads = pads or [0] * (2 * r)
                g = group or 1
                ys = [stock._run(self, x, w, None, dilations=dilations, group=1, output_padding=output_padding,
                                         pads=pads, strides=strides)[0]
                      for x, w in zip(np.split(X, g, axis=1), np.split(W, g, axis=0))]
                y = np.concatenate(ys, axis=1)
                if B is not None:
                    y = y + B.reshape((1, -1) + (1,) * r)
                return (y.astype(X.dtype),)

        return ConvTranspose


@pytest.fixture
def spec_conv_transpose(monkeypatch):
    """onnx.reference.ReferenceEvaluator with :class:`_SpecConvTranspose` (for make_op_model
    and gradcheck alike)."""
    import onnx.reference as reference

    stock = reference.ReferenceEvaluator
    op = _SpecConvTranspose.make()

    class Evaluator(stock):
        def __init__(self, proto, *args, new_ops=None, **kwargs):
            super().__init__(proto, *args, new_ops=[*(new_ops or []), op], **kwargs)

    monkeypatch.setattr(reference, "ReferenceEvaluator", Evaluator)
    return Evaluator


SPEC_ONLY = [
    ("group2", (2, 4, 3, 4), (4, 3, 3, 3), {"group": 2, "strides": [2, 2], "pads": [1, 1, 1, 0], "output_padding": [1, 0]}),
    ("depthwise-x2", (2, 4, 3, 4), (4, 2, 2, 3), {"group": 4, "strides": [2, 1], "dilations": [1, 2]}),
    ("1d-group3", (2, 6, 5), (6, 1, 3), {"group": 3, "strides": [2], "pads": [1, 1]}),
    ("group2-same-lower", (2, 4, 3, 4), (4, 3, 3, 2), {"group": 2, "strides": [2, 2], "auto_pad": "SAME_LOWER"}),
    ("output_shape-notset", (2, 4, 3, 4), (4, 3, 3, 3), {"strides": [2, 2], "output_shape": [5, 8]}),
    ("output_shape-notset-outpad", (2, 4, 3, 4), (4, 3, 2, 3), {"strides": [2, 3], "output_shape": [6, 9],
                                                                "output_padding": [1, 1]}),
]


@pytest.mark.parametrize("case", SPEC_ONLY, ids=[c[0] for c in SPEC_ONLY])
def test_conv_transpose_spec_reference(case, rng, spec_conv_transpose):
    _, xs, ws, attrs = case
    inputs = conv_inputs(rng, xs, ws, False, transpose=True)
    # the patched reference agrees with onnxruntime on these
    assert_forward_agrees("ConvTranspose", inputs, attrs, 18)
    check_op("ConvTranspose", inputs, attrs, opset=18)


def test_conv_transpose_grouped_bias(rng, spec_conv_transpose):
    # onnxruntime rejects a bias on grouped ConvTranspose (it sizes B by W's dim 1): reference only
    inputs = conv_inputs(rng, (2, 4, 3, 4), (4, 3, 2, 2), True, transpose=True, group=2)
    check_op("ConvTranspose", inputs, {"group": 2, "strides": [2, 2]}, opset=18, ort=False)


def test_conv_transpose_output_larger_than_full_is_refused(rng):
    inputs = conv_inputs(rng, (1, 2, 3), (2, 2, 2), False, transpose=True)
    model, weights, _ = make_op_model("ConvTranspose", inputs, {"strides": [2], "auto_pad": "SAME_UPPER",
                                                                "output_shape": [7]}, opset=18, weights_as="inputs")
    with pytest.raises(GradientRuleError, match="larger than the full"):
        GradientGraphBuilder(model, weights, ["loss"], "loss").build()


@pytest.mark.parametrize("op,ws,attrs", [
    ("Conv", (6, 2, 3, 3), {"group": 2, "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("ConvTranspose", (4, 3, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 0]}),
], ids=["Conv", "ConvTranspose"])
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
