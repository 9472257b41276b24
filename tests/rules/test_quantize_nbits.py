"""com.microsoft MatMulNBits (rules/quantize.py): the gradient to A, and the refusals.

onnx's reference evaluator runs no com.microsoft op, so the layout is pinned against
onnxruntime's kernel: a numpy packer (``pack``/``quantize`` below) writes B, scales and zero
points, onnxruntime's forward must equal ``A @ dequantize(...)^T`` computed from them in numpy,
and the numpy quantizer must write the bytes onnxruntime's own quantizer writes. The gradient
graph then runs on onnxruntime and must match ``dY @ W`` computed in float64 and central finite
differences of the loss onnxruntime computes in float32. A last test builds a 2048 x 2048 int4
layer and checks that onnxruntime's optimized model holds no float copy of its weight.
"""

import itertools
import zlib

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradbuilder import GradientGraphBuilder
from gradbuilder.compiler import registry
from gradbuilder.compiler.emitter import Emitter
from gradbuilder.errors import GradientRuleError, InvalidArgumentError
from gradbuilder.testing import pairwise

MS = "com.microsoft"
f32 = np.float32
_ONNX = {np.dtype(f32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}


# ----------------------------------------------------------------------------- numpy layout


def pack(values, bits):
    """Unsigned values [..., L] -> uint8 [..., ceil(L * bits / 8)]: 8 / bits values a byte, the
    first in the lowest bits, the last byte padded with zeros."""
    per = 8 // bits
    v = np.asarray(values).astype(np.uint8)
    pad = -v.shape[-1] % per
    v = np.concatenate([v, np.zeros(v.shape[:-1] + (pad,), np.uint8)], -1).reshape(v.shape[:-1] + (-1, per))
    out = np.zeros(v.shape[:-1], np.uint8)
    for j in range(per):
        out |= v[..., j] << np.uint8(bits * j)
    return out


def unpack(packed, bits, count):
    """The inverse of ``pack``: uint8 [..., bytes] -> the first ``count`` values of each row."""
    per = 8 // bits
    parts = [(packed >> np.uint8(bits * j)) & np.uint8(2 ** bits - 1) for j in range(per)]
    return np.stack(parts, -1).reshape(packed.shape[:-1] + (-1,))[..., :count]


def dequantize(B, scales, zero_points, *, K, N, bits, block_size):
    """W [N, K] in float64 from MatMulNBits's inputs, as the operator's documentation states it."""
    blocks = -(-K // block_size)
    q = unpack(B.reshape(N, blocks, -1), bits, block_size).astype(np.float64)
    if zero_points is None:
        zp = np.full((N, blocks), 2.0 ** (bits - 1))
    elif zero_points.dtype == np.uint8:
        zp = unpack(zero_points.reshape(N, -1), bits, blocks).astype(np.float64)
    else:
        zp = zero_points.reshape(N, blocks).astype(np.float64)
    w = (q - zp[..., None]) * scales.reshape(N, blocks, 1).astype(np.float64)
    return w.reshape(N, -1)[:, :K]


def quantize(w, bits, block_size, symmetric):
    """Round-to-nearest block quantization of MatMul's weight ``w`` [K, N] the way onnxruntime's
    quantizer does it: (B [N, blocks, blob], scales [N, blocks], packed zero points
    [N, ceil(blocks * bits / 8)], or None when symmetric). The padding of K holds zeros (the
    operator ignores it)."""
    K, N = w.shape
    blocks = -(-K // block_size)
    wt = np.zeros((N, blocks * block_size), f32)
    wt[:, :K] = w.T
    blk = wt.reshape(N, blocks, block_size)
    qmax = 2 ** bits - 1
    if symmetric:  # the value of largest magnitude maps to -2^(bits-1)
        peak = np.take_along_axis(blk, np.abs(blk).argmax(-1)[..., None], -1)[..., 0]
        scale = (peak / f32(-(2 ** (bits - 1)))).astype(f32)
        zp = np.full((N, blocks), 2 ** (bits - 1))
    else:  # [min(0, lo), max(0, hi)] onto [0, qmax]
        lo, hi = np.minimum(blk.min(-1), 0), np.maximum(blk.max(-1), 0)
        scale = ((hi - lo) / f32(qmax)).astype(f32)
        zp = np.clip(np.round(-lo / np.where(scale == 0, 1, scale)), 0, qmax).astype(np.int64)
    inv = np.where(scale == 0, 0, 1 / np.where(scale == 0, 1, scale)).astype(f32)
    q = np.clip(np.round(blk * inv[..., None]) + zp[..., None], 0, qmax).astype(np.uint8)
    q = q.reshape(N, -1)
    q[:, K:] = 0
    B = pack(q, bits).reshape(N, blocks, -1)
    return B, scale, (None if symmetric else pack(zp, bits))


def random_layer(rng, *, K, N, bits, block_size, zero_points, scales_2d=False, dtype=f32):
    """Random MatMulNBits inputs covering every code: (B, scales, zero points or None). The K
    padding holds random codes, which the operator must ignore. ``zero_points``: None, "uint8"
    (packed) or "float"; flat (1-D) scales unless ``scales_2d``."""
    blocks = -(-K // block_size)
    B = pack(rng.integers(0, 2 ** bits, (N, blocks * block_size)), bits).reshape(N, blocks, -1)
    scales = rng.uniform(0.05, 0.5, (N, blocks)).astype(dtype)
    zp = None
    if zero_points == "uint8":
        zp = pack(rng.integers(0, 2 ** bits, (N, blocks)), bits)  # [N, ceil(blocks * bits / 8)]
    elif zero_points == "float":
        zp = rng.uniform(0, 2 ** bits - 1, (N, blocks)).astype(dtype)
    return B, (scales if scales_2d else scales.reshape(-1)), zp


# ----------------------------------------------------------------------------- models and runs


def nbits_model(B, scales, zp=None, *, K, N, bits, block_size, a_shape, bias=None, g_idx=None,
                accuracy_level=None, dtype=f32, seed=3):
    """A (a graph input) -> MatMulNBits -> loss = sum(Y * proj), proj a fixed random [..., N].
    Returns (model, proj)."""
    names = ["A", "B", "scales", "zp" if zp is not None else "", "g_idx" if g_idx is not None else "",
             "bias" if bias is not None else ""]
    while not names[-1]:
        names.pop()
    attrs = dict(K=K, N=N, bits=bits, block_size=block_size)
    if accuracy_level is not None:
        attrs["accuracy_level"] = accuracy_level
    proj = np.random.default_rng(seed).standard_normal((*a_shape[:-1], N)).astype(dtype)
    inits = [numpy_helper.from_array(a, name) for name, a in
             [("B", B), ("scales", scales), ("zp", zp), ("g_idx", g_idx), ("bias", bias), ("proj", proj)]
             if a is not None]
    nodes = [helper.make_node("MatMulNBits", names, ["Y"], domain=MS, **attrs),
             helper.make_node("Mul", ["Y", "proj"], ["m"]),
             helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0)]
    t = _ONNX[np.dtype(dtype)]
    graph = helper.make_graph(nodes, "nbits", [helper.make_tensor_value_info("A", t, list(a_shape))],
                              [helper.make_tensor_value_info("loss", t, [])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)])
    model.ir_version = 10
    return model, proj


def session(model, threads=1, optimized_path=None):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    if optimized_path is not None:
        so.optimized_model_filepath = str(optimized_path)
    if isinstance(model, onnx.ModelProto):
        model = model.SerializeToString()
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def forward_y(model, feeds, threads=1):
    """Y of ``model`` (its MatMulNBits output) on onnxruntime."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.output[:]
    m.graph.output.append(helper.make_empty_tensor_value_info("Y"))
    return session(m, threads).run(None, feeds)[0]


def gradients(model, weights, feeds, threads=1):
    built = GradientGraphBuilder(model, weights=list(weights), outputs=["loss"], loss="loss").build().get_model()
    sess = session(built, threads)
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


# ----------------------------------------------------------------------------- (a) the layout


@pytest.mark.parametrize("bits,block_size,K,zero_points,scales_2d", [
    (bits, block, K, zp, s2)
    for bits, block, zp in itertools.product((2, 4, 8), (16, 32, 128), (None, "uint8", "float"))
    if not (bits == 8 and zp == "float")  # onnxruntime's CPU kernel refuses 8 bits with float zero points
    for K, s2 in ((3 * block, False), (2 * block + 5, True))
])
def test_forward_equals_numpy_dequantization(bits, block_size, K, zero_points, scales_2d, rng):
    """onnxruntime's MatMulNBits equals A @ W^T with W unpacked in numpy: values packed low bits
    first, zero points packed the same way per row of N (or float), default zero point
    2^(bits-1), K padded to whole blocks (random codes in the padding change nothing)."""
    N = 12
    B, scales, zp = random_layer(rng, K=K, N=N, bits=bits, block_size=block_size, zero_points=zero_points,
                                 scales_2d=scales_2d)
    A = rng.standard_normal((5, K)).astype(f32)
    model, _ = nbits_model(B, scales, zp, K=K, N=N, bits=bits, block_size=block_size, a_shape=A.shape)
    y = forward_y(model, {"A": A})
    want = A.astype(np.float64) @ dequantize(B, scales, zp, K=K, N=N, bits=bits, block_size=block_size).T
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


_ORT_QUANTIZE = {}
try:
    from onnxruntime.capi import _pybind_state as _capi

    _ORT_QUANTIZE = {b: getattr(_capi, f"quantize_matmul_{b}bits") for b in (2, 4, 8)
                     if hasattr(_capi, f"quantize_matmul_{b}bits")}
except ImportError:  # a build without the quantization helpers
    pass


@pytest.mark.skipif(not _ORT_QUANTIZE, reason="onnxruntime has no quantize_matmul_*bits")
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("block_size,K", [(16, 64), (32, 103), (128, 391)])
@pytest.mark.parametrize("symmetric", [False, True])
def test_numpy_quantizer_writes_onnxruntimes_bytes(bits, block_size, K, symmetric, rng):
    """The numpy quantizer writes the bytes of onnxruntime's own (the C++ routine its
    MatMulNBitsQuantizer calls): same scales, same packed zero points, same codes for every
    element of K; the padding of the last block is left undefined by onnxruntime."""
    if bits not in _ORT_QUANTIZE:
        pytest.skip(f"onnxruntime has no quantize_matmul_{bits}bits")
    N = 10
    w = rng.standard_normal((K, N)).astype(f32)
    blocks = -(-K // block_size)
    B = np.zeros((N, blocks, block_size * bits // 8), np.uint8)
    scales = np.zeros((N, blocks), f32)
    zp = np.zeros((N, -(-blocks * bits // 8)), np.uint8)
    _ORT_QUANTIZE[bits](B, w, scales, zp, block_size, N, K, symmetric)
    mine_B, mine_scales, mine_zp = quantize(w, bits, block_size, symmetric)
    np.testing.assert_array_equal(unpack(mine_B.reshape(N, -1), bits, K), unpack(B.reshape(N, -1), bits, K))
    np.testing.assert_array_equal(mine_scales, scales)
    if not symmetric:
        np.testing.assert_array_equal(mine_zp, zp)


@pytest.mark.parametrize("bits,symmetric", [(4, False), (4, True), (8, False)])
def test_a_model_quantized_by_onnxruntime(bits, symmetric, rng):
    """A float MatMul quantized by onnxruntime's MatMulNBitsQuantizer: its output matches A @ W^T
    with W dequantized in numpy from the model's initializers, W is within half a step of the
    float weight (a step where symmetric clamps +max to 2^(bits-1) - 1), and dA is dY @ W."""
    quantizer = pytest.importorskip("onnxruntime.quantization.matmul_nbits_quantizer")
    K, N, block = 100, 24, 32
    w = rng.standard_normal((K, N)).astype(f32)
    proj = rng.standard_normal((3, N)).astype(f32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["A", "W"], ["Y"]), helper.make_node("Mul", ["Y", "proj"], ["m"]),
         helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0)], "mm",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [3, K])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(proj, "proj")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    q = quantizer.MatMulNBitsQuantizer(model, bits=bits, block_size=block, is_symmetric=symmetric)
    q.process()
    quantized = q.model.model
    (node,) = [n for n in quantized.graph.node if n.op_type == "MatMulNBits"]
    inits = {i.name: numpy_helper.to_array(i) for i in quantized.graph.initializer}
    B, scales = inits[node.input[1]], inits[node.input[2]]
    zp = inits[node.input[3]] if len(node.input) > 3 and node.input[3] else None
    assert (zp is None) == symmetric
    mine = quantize(w, bits, block, symmetric)
    np.testing.assert_array_equal(mine[1], scales)
    W = dequantize(B, scales, zp, K=K, N=N, bits=bits, block_size=block)
    step = np.repeat(np.abs(scales), block, 1)[:, :K]
    assert np.all(np.abs(W - w.T) <= step * (1.0 if symmetric else 0.5) + 1e-6)
    A = rng.standard_normal((3, K)).astype(f32)
    np.testing.assert_allclose(forward_y(quantized, {"A": A}), A.astype(np.float64) @ W.T, rtol=1e-5, atol=1e-4)
    got = gradients(quantized, ["A"], {"A": A})
    np.testing.assert_allclose(got["A_grad"], proj.astype(np.float64) @ W, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- (b, c) the gradient

_GRID = {
    "bits": [4, 8, 2],
    "zero_points": [None, "uint8", "float"],
    "block_size": [16, 32, 128],
    "padded": [False, True],
    "rank": [2, 3],
    "bias": [False, True],
    "scales_2d": [False, True],
    "threads": [1, 2, 16],
}
# onnxruntime's CPU kernel refuses 8 bits with float zero points
_CASES = [c for c in pairwise(_GRID, whole=("bits", "zero_points")) if not (c[0] == 8 and c[1] == "float")]


@pytest.mark.parametrize(",".join(_GRID), _CASES)
def test_gradient(bits, zero_points, block_size, padded, rank, bias, scales_2d, threads):
    """dA (and dbias) from the gradient graph on onnxruntime equal dY @ W (and dY summed) in
    float64 within float32 rounding, and central finite differences of the loss onnxruntime
    computes in float32 (the loss is linear in A: the differences are exact up to rounding)."""
    rng = np.random.default_rng(zlib.crc32(repr((bits, zero_points, block_size, padded, rank, bias)).encode()))
    N = 20
    K = 2 * block_size + (7 if padded else 0)
    B, scales, zp = random_layer(rng, K=K, N=N, bits=bits, block_size=block_size, zero_points=zero_points,
                                 scales_2d=scales_2d)
    b = rng.standard_normal(N).astype(f32) if bias else None
    a_shape = (2, 3, K) if rank == 3 else (4, K)
    A = rng.standard_normal(a_shape).astype(f32)
    model, proj = nbits_model(B, scales, zp, K=K, N=N, bits=bits, block_size=block_size, a_shape=a_shape, bias=b)
    W = dequantize(B, scales, zp, K=K, N=N, bits=bits, block_size=block_size)

    got = gradients(model, ["A", "bias"] if bias else ["A"], {"A": A}, threads)
    want = proj.astype(np.float64) @ W
    assert got["A_grad"].shape == A.shape and got["A_grad"].dtype == f32
    np.testing.assert_allclose(got["A_grad"], want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    if bias:
        np.testing.assert_allclose(got["bias_grad"], proj.reshape(-1, N).astype(np.float64).sum(0), rtol=1e-5,
                                   atol=1e-6)
        y_ref = A.astype(np.float64) @ W.T + b
    else:
        y_ref = A.astype(np.float64) @ W.T

    proj64 = proj.astype(np.float64)
    np.testing.assert_allclose(got["loss"], np.sum(proj64 * y_ref), rtol=1e-4, atol=1e-4 * np.abs(y_ref).max())

    def loss(a):  # summed in float64 from onnxruntime's float32 Y
        return np.sum(proj64 * forward_y(model, {"A": a.astype(f32)}, threads))

    eps = 0.5
    for _ in range(3):  # random directions
        v = rng.standard_normal(a_shape)
        num = (loss(A + eps * v) - loss(A - eps * v)) / (2 * eps)
        assert num == pytest.approx(float(np.sum(got["A_grad"] * v)), rel=1e-4, abs=1e-4 * np.abs(want).sum())
    for i in rng.choice(A.size, 3, replace=False):  # single elements
        v = np.zeros(A.size)
        v[i] = 1
        v = v.reshape(a_shape)
        num = (loss(A + eps * v) - loss(A - eps * v)) / (2 * eps)
        assert num == pytest.approx(float(got["A_grad"].reshape(-1)[i]), rel=1e-3, abs=1e-3 * np.abs(want).max())


def test_accuracy_level_leaves_the_gradient_exact(rng):
    """accuracy_level 4 lets onnxruntime quantize A to int8 in the forward: the gradient is still
    the exact dY @ W."""
    K, N, bits, block = 96, 16, 4, 32
    B, scales, zp = random_layer(rng, K=K, N=N, bits=bits, block_size=block, zero_points="uint8")
    A = rng.standard_normal((4, K)).astype(f32)
    model, proj = nbits_model(B, scales, zp, K=K, N=N, bits=bits, block_size=block, a_shape=A.shape,
                              accuracy_level=4)
    W = dequantize(B, scales, zp, K=K, N=N, bits=bits, block_size=block)
    got = gradients(model, ["A"], {"A": A})
    np.testing.assert_allclose(got["A_grad"], proj.astype(np.float64) @ W, rtol=1e-5, atol=1e-5)
    want = A.astype(np.float64) @ W.T
    np.testing.assert_allclose(forward_y(model, {"A": A}), want, rtol=0, atol=0.05 * np.abs(want).max())


def test_float16(rng):
    """float16 A and scales: W is computed in float16, dA within float16 rounding of dY @ W."""
    K, N, bits, block = 64, 8, 4, 32
    B, scales, zp = random_layer(rng, K=K, N=N, bits=bits, block_size=block, zero_points=None, dtype=np.float16)
    A = rng.standard_normal((3, K)).astype(np.float16)
    model, proj = nbits_model(B, scales, zp, K=K, N=N, bits=bits, block_size=block, a_shape=A.shape,
                              dtype=np.float16)
    got = gradients(model, ["A"], {"A": A})
    want = proj.astype(np.float64) @ dequantize(B, scales, zp, K=K, N=N, bits=bits, block_size=block)
    assert got["A_grad"].dtype == np.float16
    np.testing.assert_allclose(got["A_grad"], want, rtol=0, atol=2e-3 * np.abs(want).max())


# ----------------------------------------------------------------------------- (d) refusals


def _small(rng, zero_points="uint8", g_idx=False):
    K, N, bits, block = 64, 8, 4, 32
    B, scales, zp = random_layer(rng, K=K, N=N, bits=bits, block_size=block, zero_points=zero_points)
    gi = (np.arange(K) // block).astype(np.int32) if g_idx else None
    model, _ = nbits_model(B, scales, zp, K=K, N=N, bits=bits, block_size=block, a_shape=(2, K), g_idx=gi)
    return model


@pytest.mark.parametrize("weight,zero_points", [("scales", "uint8"), ("zp", "float")])
def test_quantized_weight_is_refused_with_lora_advice(weight, zero_points, rng):
    model = _small(rng, zero_points)
    advice = r"(?s)quantized weight of (a )?MatMulNBits node.*cannot be trained.*LoRA adapter.*gradbuilder lora"
    with pytest.raises(InvalidArgumentError, match=advice):
        GradientGraphBuilder(model, weights=["A", weight], outputs=["loss"], loss="loss").build()


def test_packed_b_is_refused(rng):
    """The builder refuses B as a weight before any rule runs, with the LoRA advice; the rule
    itself, asked for B's gradient, refuses it the same way."""
    model = _small(rng)
    with pytest.raises(InvalidArgumentError, match="weight 'B' is part of the quantized weight.*LoRA adapter"):
        GradientGraphBuilder(model, weights=["B"], outputs=["loss"], loss="loss").build()
    graph = ir.serde.deserialize_model(model).graph
    (node,) = [n for n in graph if n.op_type == "MatMulNBits"]
    rule = registry.lookup(MS, "MatMulNBits", 1).fn
    e = Emitter(graph, 21)
    with e.math(), pytest.raises(GradientRuleError, match=r"B \('B'\).*LoRA adapter"):
        rule(node, [node.outputs[0]], [True, True, False, False], e)


def test_g_idx_is_refused(rng):
    model = _small(rng, g_idx=True)
    with pytest.raises(GradientRuleError, match=r"g_idx.*act-order.*not supported"):
        GradientGraphBuilder(model, weights=["A"], outputs=["loss"], loss="loss").build()


# ----------------------------------------------------------------------------- memory


def _float_initializer_sizes(path):
    floats = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE}
    model = onnx.load(str(path), load_external_data=False)
    return {i.name: int(np.prod(i.dims)) for i in model.graph.initializer if i.data_type in floats}, model


def test_onnxruntime_folds_a_dequantization_of_initializers(tmp_path):
    """The control for the next test: onnxruntime's constant folding turns a dequantization of
    an initializer into a float initializer of the weight's size."""
    K, N = 64, 32
    q = np.random.default_rng(0).integers(0, 16, (K, N)).astype(np.uint8)
    graph = helper.make_graph(
        [helper.make_node("Cast", ["q"], ["w"], to=TensorProto.FLOAT), helper.make_node("MatMul", ["x", "w"], ["y"])],
        "fold", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, N])], [numpy_helper.from_array(q, "q")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    session(model, optimized_path=tmp_path / "opt.onnx")
    sizes, _ = _float_initializer_sizes(tmp_path / "opt.onnx")
    assert K * N in sizes.values()


def test_backward_holds_no_float_copy_of_the_weight(tmp_path):
    """A 2048 x 2048 int4 layer (2 MiB packed, 16 MiB as float): onnxruntime's optimized gradient
    graph holds no float initializer of K*N elements (the dequantization runs in the backward,
    not at session creation), no second copy of B or of the scales, and it runs."""
    K = N = 2048
    bits, block = 4, 32
    rng = np.random.default_rng(5)
    B, scales, zp = random_layer(rng, K=K, N=N, bits=bits, block_size=block, zero_points=None)
    scales = (scales * 0.05).astype(f32)
    A = rng.standard_normal((2, K)).astype(f32)
    model, proj = nbits_model(B, scales, zp, K=K, N=N, bits=bits, block_size=block, a_shape=A.shape)
    built = GradientGraphBuilder(model, weights=["A"], outputs=["loss"], loss="loss").build().get_model()
    sess = session(built, optimized_path=tmp_path / "opt.onnx")

    sizes, optimized = _float_initializer_sizes(tmp_path / "opt.onnx")
    assert max(sizes.values()) < K * N // 8, sizes
    packed = [i.name for i in optimized.graph.initializer if int(np.prod(i.dims)) == B.size]
    assert packed == ["B"], packed  # B is not copied (a folded Reshape of it would be)
    assert [n for n, s in sizes.items() if s == scales.size] == ["scales"], sizes

    out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"A": A})))
    want = proj.astype(np.float64) @ dequantize(B, scales, zp, K=K, N=N, bits=bits, block_size=block)
    np.testing.assert_allclose(out["A_grad"], want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("zero_points,padded,rank", [(None, True, 3), ("uint8", True, 2), ("float", False, 3)])
def test_the_weight_is_dequantized_a_few_rows_at_a_time(zero_points, padded, rank, monkeypatch):
    """A large projection's backward makes its float weight in row chunks (dA summed over
    them): with chunks of 3 rows of the 20 (the last one short), the gradient is the same."""
    from gradbuilder.rules import quantize

    block = 32
    K = 2 * block + (7 if padded else 0)
    monkeypatch.setattr(quantize, "CHUNK_ELEMENTS", 3 * (-(-K // block)) * block)
    test_gradient(4, zero_points, block, padded, rank, True, False, 2)
