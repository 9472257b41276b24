"""MaxRoiPool, MelWeightMatrix and EyeLike gradients; random draws as stop-gradient points.

onnx's reference evaluator has no MaxRoiPool and onnxruntime runs it in float32 only (opsets
1-21), so
MaxRoiPool is checked with float32 central differences on onnxruntime (the op is piecewise
linear in X: exact away from ties), and in float64 on onnx's evaluator with a numpy MaxRoiPool
of the spec (a true maximum, where onnxruntime clips each bin's maximum at FLT_MIN).
"""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference.op_run import OpRun

from gradbuilder import GradientGraphBuilder
from gradbuilder.testing import check_op, gradcheck, run_onnxruntime

from ..helpers import make_model, tensor, vi

from .test_quantize import ort_fd_check

f32 = np.float32


def distinct(rng, shape, step=0.05):
    """Values at least ``step`` apart (no ties within a finite-difference step), none near 0
    (onnxruntime clips each bin's maximum at FLT_MIN, a kink at 0)."""
    size = int(np.prod(shape))
    return ((rng.permutation(size) - size / 2 + 0.5) * step).reshape(shape).astype(f32)


# [batch, x1, y1, x2, y2] (fractions away from the .5 rounding points): inside, over the
# right/bottom border, starting left of the image, malformed (x2 < x1: one column), tiny
ROIS = np.array([[0, 0.2, 1.3, 4.8, 5.2], [1, 2.7, 0.1, 7.3, 3.9], [1, -2.2, 2.4, 3.1, 6.6],
                 [0, 5.3, 1.2, 4.1, 4.3], [1, 3.1, 3.2, 3.3, 3.4]], f32)


@pytest.mark.parametrize("pooled", [(2, 2), (3, 2), (1, 1), (4, 3)])
@pytest.mark.parametrize("scale", [1.0, 0.6])
def test_max_roi_pool_ort(pooled, scale, rng):
    x = distinct(rng, (2, 3, 6, 7))
    rois = ROIS.copy()
    if scale != 1.0:
        rois[:, 1:] = rois[:, 1:] / scale  # keep the scaled corners off the .5 rounding points
    ort_fd_check("MaxRoiPool", [("x", x), ("rois", rois)], {"pooled_shape": list(pooled), "spatial_scale": scale},
                 opset=16, wrt=["x"])


def test_max_roi_pool_rois_gradient_is_zero(rng):
    x = distinct(rng, (1, 2, 5, 6))
    rois = np.array([[0, 0.2, 1.3, 4.8, 4.2], [0, 1.1, 0.3, 3.7, 2.2]], f32)
    got = ort_fd_check("MaxRoiPool", [("x", x), ("rois", rois)], {"pooled_shape": [2, 3]}, opset=21)
    assert not got["rois_grad"].any()


@pytest.mark.parametrize("opset", [13, 21])
def test_max_roi_pool_dynamic(opset, rng):
    """X a graph input of unknown dims: sizes come from Shape at run time (opset 13: the
    sums over overlapping bins are a one-hot product, not a ScatterND)."""
    x = distinct(rng, (2, 2, 5, 6))
    ort_fd_check("MaxRoiPool", [("x", x), ("rois", ROIS)], {"pooled_shape": [2, 2]}, opset=opset, wrt=["x"],
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

    monkeypatch.setattr(testing, "_evaluator", lambda proto: ReferenceEvaluator(proto, new_ops=[MaxRoiPool]))
    x = distinct(rng, (2, 3, 6, 7)) - 1.0  # mostly negative
    for pooled in ([3, 2], [2, 4]):
        check_op("MaxRoiPool", [("x", x), ("rois", ROIS)], {"pooled_shape": pooled}, opset=22, wrt=["x"], ort=False)


def test_mel_weight_matrix(rng):
    """The edges (weights) sit where no bin index floor((dft_length + 1) * f / sample_rate)
    is near a jump: finite differences give 0, as the rule does."""
    inputs = [("num_mel_bins", np.array(8, np.int64)), ("dft_length", np.array(16, np.int64)),
              ("sample_rate", np.array(8192, np.int64)), ("lower", np.array(120.0, f32)),
              ("upper", np.array(3100.0, f32))]
    check_op("MelWeightMatrix", inputs, {"output_datatype": 11}, opset=17)  # float64 out: gradcheck
    ort_fd_check("MelWeightMatrix", inputs, {}, opset=17, eps=0.5)


def test_eye_like(rng):
    x = rng.standard_normal((3, 4)).astype(f32)
    check_op("EyeLike", [("x", x)], {"k": 1}, opset=13)
    check_op("EyeLike", [("x", x)], {"k": -1, "dtype": 1}, opset=22, weights_as="inputs", dims="dynamic")


# ----------------------------------------------------------------------------- random draws


def _vae(draw_as_input=False):
    """mu = x W1, logvar = x W2, z = mu + exp(logvar / 2) * eps with eps = RandomNormalLike(mu)
    (seeded) or fed; loss = mean((z W3 - x)^2) - 0.5 * sum(1 + logvar - mu^2 - exp(logvar))."""
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["mu"]), helper.make_node("MatMul", ["x", "W2"], ["logvar"])]
    if not draw_as_input:
        nodes.append(helper.make_node("RandomNormalLike", ["mu"], ["eps"], seed=3.0))
    nodes += [helper.make_node("Mul", ["logvar", "half"], ["lh"]), helper.make_node("Exp", ["lh"], ["std"]),
              helper.make_node("Mul", ["std", "eps"], ["noise"]), helper.make_node("Add", ["mu", "noise"], ["z"]),
              helper.make_node("MatMul", ["z", "W3"], ["recon"]), helper.make_node("Sub", ["recon", "x"], ["err"]),
              helper.make_node("Mul", ["err", "err"], ["sq"]),
              helper.make_node("ReduceMean", ["sq"], ["mse"], keepdims=0),
              helper.make_node("Mul", ["mu", "mu"], ["mu2"]), helper.make_node("Exp", ["logvar"], ["var"]),
              helper.make_node("Sub", ["logvar", "mu2"], ["k1"]), helper.make_node("Sub", ["k1", "var"], ["k2"]),
              helper.make_node("Add", ["k2", "one"], ["k3"]), helper.make_node("ReduceSum", ["k3"], ["k4"], keepdims=0),
              helper.make_node("Mul", ["k4", "mhalf"], ["kl"]), helper.make_node("Add", ["mse", "kl"], ["loss"])]
    rng = np.random.default_rng(1)
    inits = [tensor(n, rng.uniform(-0.5, 0.5, s).astype(f32))
             for n, s in (("W1", (4, 3)), ("W2", (4, 3)), ("W3", (3, 4)))]
    inits += [tensor(n, np.array(v, f32)) for n, v in (("half", 0.5), ("mhalf", -0.5), ("one", 1.0))]
    inputs = [vi("x", [5, 4])] + ([vi("eps", [5, 3])] if draw_as_input else [])
    return make_model(nodes, inputs, [vi("loss", [])], inits)


def _compare_with_fed_draws(model, fed_model, weights, feeds, draws):
    """The gradients onnxruntime computes with its own draws equal those of the model fed the
    same draws, whose gradients match float64 finite differences."""
    built = GradientGraphBuilder(model, weights, ["loss", *draws], "loss").build()
    onnx.checker.check_model(built.model_proto, full_check=True)
    got = run_onnxruntime(built.get_model(), feeds)
    report = gradcheck(fed_model, weights, "loss", {**feeds, **{d: got[d] for d in draws}})
    assert report.passed, str(report)
    for w in weights:
        np.testing.assert_allclose(got[f"{w}_grad"], report.gradients[w], rtol=1e-4, atol=1e-5)


def test_vae_reparameterisation_holds_the_draw_fixed():
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(f32)
    weights = ["W1", "W2", "W3"]
    report = gradcheck(_vae(), weights, "loss", {"x": x})  # the seed fixes onnx's draw too
    assert report.passed, str(report)
    _compare_with_fed_draws(_vae(), _vae(draw_as_input=True), weights, {"x": x}, ["eps"])


def _bernoulli_multinomial(draws_as_inputs=False):
    """p = sigmoid(x Wp), mask = Bernoulli(p), idx = Multinomial(x Wp); loss = sum((x Wh) *
    mask) + sum(p) * (1 + sum(idx)): the draws' inputs lie on the path to the loss."""
    nodes = [helper.make_node("MatMul", ["x", "Wp"], ["logit"]), helper.make_node("Sigmoid", ["logit"], ["p"]),
             helper.make_node("MatMul", ["x", "Wh"], ["h"])]
    if not draws_as_inputs:
        nodes += [helper.make_node("Bernoulli", ["p"], ["mask"], seed=5.0),
                  helper.make_node("Multinomial", ["logit"], ["idx"], sample_size=2, seed=7.0)]
    nodes += [helper.make_node("Mul", ["h", "mask"], ["hm"]), helper.make_node("ReduceSum", ["hm"], ["s1"], keepdims=0),
              helper.make_node("Cast", ["idx"], ["fidx"], to=TensorProto.FLOAT),
              helper.make_node("ReduceSum", ["fidx"], ["n"], keepdims=0), helper.make_node("Add", ["n", "one"], ["n1"]),
              helper.make_node("ReduceSum", ["p"], ["s2"], keepdims=0), helper.make_node("Mul", ["s2", "n1"], ["s3"]),
              helper.make_node("Add", ["s1", "s3"], ["loss"])]
    rng = np.random.default_rng(2)
    inits = [tensor("Wp", rng.standard_normal((4, 3)).astype(f32)),
             tensor("Wh", rng.standard_normal((4, 3)).astype(f32)), tensor("one", np.array(1.0, f32))]
    inputs = [vi("x", [5, 4])]
    if draws_as_inputs:
        inputs += [vi("mask", [5, 3]), vi("idx", [5, 2], TensorProto.INT32)]
    return make_model(nodes, inputs, [vi("loss", [])], inits)


def test_bernoulli_and_multinomial_inputs_take_no_gradient():
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(f32)
    _compare_with_fed_draws(_bernoulli_multinomial(), _bernoulli_multinomial(True), ["Wp", "Wh"], {"x": x},
                            ["mask", "idx"])
