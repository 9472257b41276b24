"""append_loss: loss blocks against torch.nn.functional, values and gradients."""

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

from gradbuilder import GradientGraphBuilder, InvalidArgumentError
from gradbuilder.training.loss import append_loss
from gradbuilder.testing import run_onnxruntime

N, FEAT, C, D = 5, 3, 4, 2
f32 = np.float32
REDUCTIONS = ["mean", "sum", "none"]


def tiny_model(opset=17, spatial=False, log_softmax=False, seed=0):
    """logits = MatMul(x, W) + B: x [N, F] -> [N, C]; ``spatial``: x [N, D, F] -> [N, C, D].
    ``log_softmax``: the output is LogSoftmax(logits, axis=1), named 'logp'."""
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((FEAT, C)).astype(f32)
    B = rng.standard_normal((C,)).astype(f32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "B"], ["z"])]
    x_shape = [N, D, FEAT] if spatial else [N, FEAT]
    out_shape = [N, C, D] if spatial else [N, C]
    if spatial:
        nodes.append(helper.make_node("Transpose", ["z"], ["logits"], perm=[0, 2, 1]))
    else:
        nodes.append(helper.make_node("Identity", ["z"], ["logits"]))
    out = "logits"
    if log_softmax:
        nodes.append(helper.make_node("LogSoftmax", ["logits"], ["logp"], axis=1))
        out = "logp"
    graph = helper.make_graph(
        nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, out_shape)],
        [numpy_helper.from_array(W, "W"), numpy_helper.from_array(B, "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    x = rng.standard_normal(x_shape).astype(f32)
    return model, out, x, W, B


def torch_forward(x, W, B, spatial, log_softmax):
    x, W, B = (torch.tensor(a, dtype=torch.float64) for a in (x, W, B))
    W.requires_grad_(True)
    B.requires_grad_(True)
    z = x @ W + B
    if spatial:
        z = z.transpose(1, 2)
    if log_softmax:
        z = F.log_softmax(z, dim=1)
    return z, W, B


def check(model_with_loss, feeds, ref_loss, W, B, reduction, out_shape):
    """ORT loss vs torch (rtol 1e-5); gradient graph vs autograd (rtol 1e-4)."""
    got = run_onnxruntime(model_with_loss, feeds)
    np.testing.assert_allclose(got["loss"], ref_loss.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert got["loss"].dtype == np.float32
    if reduction == "none":
        # A fixed random projection of the unreduced loss makes the scalar to differentiate.
        assert got["loss"].shape == tuple(out_shape)
        proj = np.random.default_rng(1).standard_normal(out_shape).astype(f32)
        g = model_with_loss.graph
        g.initializer.append(numpy_helper.from_array(proj, "proj"))
        g.node.append(helper.make_node("Mul", ["loss", "proj"], ["loss_proj"]))
        g.node.append(helper.make_node("ReduceSum", ["loss_proj"], ["total"], keepdims=0))
        g.output.append(helper.make_tensor_value_info("total", TensorProto.FLOAT, []))
        scalar, name = (ref_loss * torch.tensor(proj, dtype=torch.float64)).sum(), "total"
    else:
        assert got["loss"].shape == ()
        scalar, name = ref_loss, "loss"
    scalar.backward()
    built = GradientGraphBuilder(model_with_loss, weights=["W", "B"], outputs=[name], loss=name).build()
    grads = run_onnxruntime(built.get_model(), feeds)
    for w, ref in (("W", W.grad), ("B", B.grad)):
        ref = ref.numpy()
        np.testing.assert_allclose(grads[f"{w}_grad"], ref, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(ref).max()))


def class_targets(rng, shape, ignore_index):
    t = rng.integers(0, C, shape).astype(np.int64)
    flat = t.reshape(-1)
    if ignore_index is not None:
        flat[1::3] = ignore_index
    return t


CLASS_VARIANTS = {
    "plain": {},
    "weight": {"weight": True},
    "ignore": {"ignore_index": 1},
    "ignore_neg": {"ignore_index": -100},
    "weight_ignore": {"weight": True, "ignore_index": 2},
}


@pytest.mark.parametrize("spatial", [False, True], ids=["NC", "NCd"])
@pytest.mark.parametrize("variant", list(CLASS_VARIANTS))
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("kind", ["crossentropy", "nll"])
def test_class_losses_match_torch(kind, reduction, variant, spatial):
    opts = CLASS_VARIANTS[variant]
    nll = kind == "nll"
    model, out, x, W, B = tiny_model(spatial=spatial, log_softmax=nll)
    rng = np.random.default_rng(2)
    t = class_targets(rng, (N, D) if spatial else (N,), opts.get("ignore_index"))
    weight = rng.uniform(0.5, 2.0, (C,)).astype(f32) if opts.get("weight") else None
    m = append_loss(model, kind, out, reduction=reduction, weight=weight, ignore_index=opts.get("ignore_index"))

    target = next(i for i in m.graph.input if i.name == "target")
    assert target.type.tensor_type.elem_type == TensorProto.INT64
    assert [d.dim_value for d in target.type.tensor_type.shape.dim] == list(t.shape)
    if weight is not None:
        assert "loss.class_weight" in {i.name for i in m.graph.initializer}

    z, Wt, Bt = torch_forward(x, W, B, spatial, nll)
    fn = F.nll_loss if nll else F.cross_entropy
    kw = {"ignore_index": opts["ignore_index"]} if "ignore_index" in opts else {}
    ref = fn(z, torch.tensor(t), weight=None if weight is None else torch.tensor(weight, dtype=torch.float64),
             reduction=reduction, **kw)
    check(m, {"x": x, "target": t}, ref, Wt, Bt, reduction, t.shape)


@pytest.mark.parametrize("spatial", [False, True], ids=["NC", "NCd"])
@pytest.mark.parametrize("variant", ["plain", "weight_ignore", "ignore_neg"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy_label_smoothing(reduction, variant, spatial):
    opts = CLASS_VARIANTS[variant]
    model, out, x, W, B = tiny_model(spatial=spatial)
    rng = np.random.default_rng(3)
    t = class_targets(rng, (N, D) if spatial else (N,), opts.get("ignore_index"))
    weight = rng.uniform(0.5, 2.0, (C,)).astype(f32) if opts.get("weight") else None
    m = append_loss(model, "CrossEntropyLoss", out, reduction=reduction, weight=weight,
                    ignore_index=opts.get("ignore_index"), label_smoothing=0.2)
    z, Wt, Bt = torch_forward(x, W, B, spatial, False)
    kw = {"ignore_index": opts["ignore_index"]} if "ignore_index" in opts else {}
    ref = F.cross_entropy(z, torch.tensor(t), weight=None if weight is None else torch.tensor(weight, dtype=torch.float64),
                          reduction=reduction, label_smoothing=0.2, **kw)
    check(m, {"x": x, "target": t}, ref, Wt, Bt, reduction, t.shape)


@pytest.mark.parametrize("opset", [13, 17, 18])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("kind", ["mse", "l1"])
def test_regression_losses_match_torch(kind, reduction, opset):
    model, out, x, W, B = tiny_model(opset=opset)
    y = np.random.default_rng(4).standard_normal((N, C)).astype(f32)
    m = append_loss(model, kind, out, reduction=reduction)
    target = next(i for i in m.graph.input if i.name == "target")
    assert target.type.tensor_type.elem_type == TensorProto.FLOAT
    z, Wt, Bt = torch_forward(x, W, B, False, False)
    fn = F.mse_loss if kind == "mse" else F.l1_loss
    ref = fn(z, torch.tensor(y, dtype=torch.float64), reduction=reduction)
    check(m, {"x": x, "target": y}, ref, Wt, Bt, reduction, (N, C))


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("variant", ["plain", "weight", "pos_weight", "both", "row_weight"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_bce_with_logits_matches_torch(reduction, variant, opset):
    model, out, x, W, B = tiny_model(opset=opset)
    rng = np.random.default_rng(5)
    # soft targets in [0, 1], a few hard 0/1; logits scaled up to exercise the stable form
    y = rng.uniform(0, 1, (N, C)).astype(f32)
    y[0] = [0, 1, 0, 1]
    W = W * 8
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(W, "W"))
    weight = pos_weight = None
    if variant in ("weight", "both"):
        weight = rng.uniform(0.5, 2.0, (C,)).astype(f32)
    if variant == "row_weight":
        weight = rng.uniform(0.5, 2.0, (N, 1)).astype(f32)
    if variant in ("pos_weight", "both"):
        pos_weight = rng.uniform(0.5, 3.0, (C,)).astype(f32)
    m = append_loss(model, "binary_cross_entropy_with_logits", out, reduction=reduction,
                    weight=weight, pos_weight=pos_weight)
    z, Wt, Bt = torch_forward(x, W, B, False, False)
    as_t = lambda a: None if a is None else torch.tensor(a, dtype=torch.float64)  # noqa: E731
    ref = F.binary_cross_entropy_with_logits(z, as_t(y), weight=as_t(weight), pos_weight=as_t(pos_weight),
                                             reduction=reduction)
    check(m, {"x": x, "target": y}, ref, Wt, Bt, reduction, (N, C))


def test_bce_with_logits_is_stable_for_large_logits():
    model, out, x, W, B = tiny_model()
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(W * 1e4, "W"))
    m = append_loss(model, "bcewithlogits", out, reduction="none")
    y = np.zeros((N, C), f32)
    got = run_onnxruntime(m, {"x": x, "target": y})["loss"]
    assert np.isfinite(got).all()
    z = (torch.tensor(x, dtype=torch.float64) @ torch.tensor(W * 1e4, dtype=torch.float64) + torch.tensor(B, dtype=torch.float64))
    ref = F.binary_cross_entropy_with_logits(z, torch.zeros(N, C, dtype=torch.float64), reduction="none")
    np.testing.assert_allclose(got, ref.numpy(), rtol=1e-5)


# ----------------------------------------------------------------------------- API


@pytest.mark.parametrize("name,kind", [
    ("cross_entropy", "SoftmaxCrossEntropyLoss"), ("CrossEntropyLoss", "SoftmaxCrossEntropyLoss"),
    ("CROSSENTROPY", "SoftmaxCrossEntropyLoss"), ("nll_loss", "NegativeLogLikelihoodLoss"),
    ("NLLLoss", "NegativeLogLikelihoodLoss"), ("mse_loss", "Mul"), ("MSELoss", "Mul"), ("L1Loss", "Abs"),
    ("l1_loss", "Abs"), ("BCEWithLogitsLoss", "Relu"), ("binary_cross_entropy_with_logits", "Relu"),
])
def test_kind_aliases(name, kind):
    model, out, *_ = tiny_model()
    m = append_loss(model, name, out)
    assert kind in {n.op_type for n in m.graph.node}


def test_model_forms_outputs_kept_and_caller_untouched(tmp_path):
    model, out, x, W, B = tiny_model()
    before = model.SerializeToString()
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    for form in (model, before, str(path), path):
        m = append_loss(form, "mse", out, target_name="y", loss_name="l2")
        assert [o.name for o in m.graph.output] == ["logits", "l2"]
        assert [i.name for i in m.graph.input] == ["x", "y"]
        onnx.checker.check_model(m, full_check=True)
    assert model.SerializeToString() == before
    # names of the block's nodes never clash with the model's
    m = append_loss(model, "crossentropy", out, weight=np.ones(C), label_smoothing=0.1, ignore_index=0)
    outs = [o for n in m.graph.node for o in n.output]
    assert len(outs) == len(set(outs))
    onnx.checker.check_model(m, full_check=True)


def test_symbolic_batch_types_the_target_and_loss():
    model, out, x, W, B = tiny_model()
    for vi in list(model.graph.input) + list(model.graph.output):
        vi.type.tensor_type.shape.dim[0].dim_param = "batch"
    m = append_loss(model, "crossentropy", out, reduction="none")
    target = next(i for i in m.graph.input if i.name == "target")
    assert [d.dim_param for d in target.type.tensor_type.shape.dim] == ["batch"]
    loss = m.graph.output[-1]
    assert loss.type.tensor_type.elem_type == TensorProto.FLOAT
    assert [d.dim_param for d in loss.type.tensor_type.shape.dim] == ["batch"]
    t = np.array([0, 1, 2, 3, 0, 1, 2], np.int64)
    xx = np.random.default_rng(0).standard_normal((7, FEAT)).astype(f32)
    got = run_onnxruntime(m, {"x": xx, "target": t})["loss"]
    assert got.shape == (7,)


def test_old_opset_is_upgraded_for_class_losses():
    model, out, x, W, B = tiny_model(opset=11)
    m = append_loss(model, "crossentropy", out)
    assert m.opset_import[0].version >= 13
    t = np.arange(N, dtype=np.int64) % C
    z, *_ = torch_forward(x, W, B, False, False)
    np.testing.assert_allclose(run_onnxruntime(m, {"x": x, "target": t})["loss"],
                               F.cross_entropy(z, torch.tensor(t)).item(), rtol=1e-5)


@pytest.mark.parametrize("kwargs,match", [
    ({"kind": "hinge"}, "unknown loss kind"),
    ({"kind": "mse", "reduction": "average"}, "unknown reduction"),
    ({"kind": "mse", "output": "nope"}, "no value named 'nope'"),
    ({"kind": "mse", "loss_name": "xw"}, "already has a value named 'xw'"),
    ({"kind": "mse", "loss_name": "logits"}, "already has a value named 'logits'"),
    ({"kind": "mse", "target_name": "x"}, "already has a value named 'x'"),
    ({"kind": "mse", "target_name": "loss"}, "different names"),
    ({"kind": "mse", "ignore_index": 0}, "ignore_index"),
    ({"kind": "bcewithlogits", "ignore_index": -100}, "ignore_index"),
    ({"kind": "l1", "weight": [1.0] * C}, "takes no weight"),
    ({"kind": "crossentropy", "pos_weight": [1.0] * C}, "pos_weight"),
    ({"kind": "nll", "label_smoothing": 0.1}, "label_smoothing"),
    ({"kind": "crossentropy", "weight": [1.0, 2.0]}, "classes"),
    ({"kind": "bcewithlogits", "weight": [1.0, 2.0]}, "broadcast"),
    ({"kind": "crossentropy", "ignore_index": 1.5}, "integer"),
])
def test_errors(kwargs, match):
    model, out, *_ = tiny_model()
    kwargs = {"output": out, **kwargs}
    kind = kwargs.pop("kind")
    output = kwargs.pop("output")
    with pytest.raises(InvalidArgumentError, match=match):
        append_loss(model, kind, output, **kwargs)


def test_class_loss_on_a_rank_1_output_is_refused():
    model, out, *_ = tiny_model()
    model.graph.node.append(helper.make_node("Flatten", ["logits"], ["flat"], axis=0))
    model.graph.node.append(helper.make_node("Squeeze", ["flat"], ["v"]))
    model.graph.output.append(helper.make_tensor_value_info("v", TensorProto.FLOAT, [N * C]))
    with pytest.raises(InvalidArgumentError, match="rank 1"):
        append_loss(model, "crossentropy", "v")
