"""MelWeightMatrix and EyeLike gradients; random draws as stop-gradient points."""

import numpy as np
import onnx
from onnx import TensorProto, helper

from gradbuilder import GradientGraphBuilder
from gradbuilder.testing import check_op, gradcheck, run_onnxruntime

from ..helpers import make_model, tensor, vi

from .test_quantize import ort_fd_check

f32 = np.float32


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
