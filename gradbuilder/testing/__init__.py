"""Numerical gradient checking: built gradients against float64 finite differences.

``gradcheck`` converts the model to float64, builds its gradient graph, evaluates it with
onnx's reference evaluator and compares every weight's gradient with central finite
differences of the loss (on sampled elements and random directions).

``check_op`` wraps one operator in a model whose loss is a fixed random projection of
every float output, and gradchecks it; it also runs the float32 gradient graph on
onnxruntime, so a rule is known to emit graphs the stock runtime loads.

Helpers shared by the test suite: ``check_model`` (check_op's two checks on a prepared model),
``ort_run``, ``ort_grad_session`` and ``ort_grads`` (onnxruntime runs), ``reference_evaluator``,
``reference_fixes``/``reference_fix`` (the reference evaluator's op replacements) and
``patch_reference_evaluator`` (more replacements for one pytest test).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..compiler import modelio
from ..compiler.builder import GradientGraphBuilder
from ..dtypes import FLOAT_TENSOR_TYPES
from ..errors import InvalidArgumentError, InvalidModelError

_FLOATS = FLOAT_TENSOR_TYPES


# ----------------------------------------------------------------------------- float64


def _retype(type_proto: onnx.TypeProto) -> None:
    kind = type_proto.WhichOneof("value")
    if kind == "tensor_type" and type_proto.tensor_type.elem_type in _FLOATS:
        type_proto.tensor_type.elem_type = TensorProto.DOUBLE
    elif kind == "sequence_type":
        _retype(type_proto.sequence_type.elem_type)
    elif kind == "optional_type":
        _retype(type_proto.optional_type.elem_type)


def _tensor64(t: onnx.TensorProto) -> onnx.TensorProto:
    if t.data_type not in _FLOATS or t.data_type == TensorProto.DOUBLE:
        return t
    arr = numpy_helper.to_array(t).astype(np.float64)
    return numpy_helper.from_array(arr, t.name)


_DTYPE_ATTRS = {"Cast": "to", "EyeLike": "dtype", "RandomNormal": "dtype", "RandomUniform": "dtype",
                "RandomNormalLike": "dtype", "RandomUniformLike": "dtype", "Bernoulli": "dtype",
                "Multinomial": "dtype", "Attention": "softmax_precision",
                "GroupNormalization": "stash_type", "FlexAttention": "softmax_precision"}


# Inputs that must stay float32 whatever the model's precision: (op, input index).
_FLOAT32_INPUTS = {("Resize", 2), ("Upsample", 1)}


def _graph64(graph: onnx.GraphProto) -> None:
    keep = {n.input[i] for n in graph.node for (op, i) in _FLOAT32_INPUTS
            if n.op_type == op and len(n.input) > i and n.input[i]}
    for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
        if vi.name not in keep:
            _retype(vi.type)
    for i, t in enumerate(graph.initializer):
        if t.name not in keep:
            graph.initializer[i].CopyFrom(_tensor64(t))
    for node in graph.node:
        if node.op_type == "Constant" and node.output[0] in keep:
            continue
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                a.t.CopyFrom(_tensor64(a.t))
            elif a.type == onnx.AttributeProto.GRAPH:
                _graph64(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    _graph64(g)
            elif a.name == _DTYPE_ATTRS.get(node.op_type) and a.i in _FLOATS:
                a.i = TensorProto.DOUBLE
        if node.op_type == "GroupNormalization" and not any(a.name == "stash_type" for a in node.attribute):
            node.attribute.append(helper.make_attribute("stash_type", TensorProto.DOUBLE))
        if node.op_type == "ConstantOfShape" and not any(a.name == "value" for a in node.attribute):
            node.attribute.append(helper.make_attribute("value", numpy_helper.from_array(np.zeros(1))))  # float zeros
        if node.op_type == "Constant":
            for a in list(node.attribute):
                if a.name in ("value_float", "value_floats"):
                    vals = np.array(a.f if a.name == "value_float" else list(a.floats), dtype=np.float64)
                    node.attribute.remove(a)
                    node.attribute.append(helper.make_attribute("value", numpy_helper.from_array(vals)))


def to_float64(model) -> onnx.ModelProto:
    """A copy of ``model`` with every float16/bfloat16/float32 tensor made float64."""
    proto = modelio.load_proto(model)
    del proto.graph.value_info[:]
    _graph64(proto.graph)
    _outputs_as_inferred(proto)
    return proto


def _outputs_as_inferred(proto: onnx.ModelProto) -> None:
    """Graph outputs take the types inference gives: an op may keep a float32 output in a
    float64 model (LayerNormalization's Mean/InvStdDev follow stash_type, not the input)."""
    produced = {o for n in proto.graph.node for o in n.output}
    probe = onnx.ModelProto()
    probe.CopyFrom(proto)
    for out in probe.graph.output:
        if out.name in produced:
            out.type.tensor_type.elem_type = 0
    try:
        inferred = onnx.shape_inference.infer_shapes(probe)
    except Exception:
        return
    types = {o.name: o.type.tensor_type.elem_type for o in inferred.graph.output}
    types.update({v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info})
    for out in proto.graph.output:
        t = types.get(out.name, 0)
        if t and out.name in produced and out.type.tensor_type.elem_type != t:
            out.type.tensor_type.elem_type = t


# ----------------------------------------------------------------------------- gradcheck


@dataclasses.dataclass
class WeightCheck:
    name: str
    checked: int
    max_abs_err: float
    max_rel_err: float
    passed: bool


@dataclasses.dataclass
class GradcheckReport:
    weights: list[WeightCheck]
    loss: float
    gradients: dict[str, np.ndarray]

    @property
    def passed(self) -> bool:
        return all(w.passed for w in self.weights)

    def __str__(self) -> str:
        lines = [f"gradcheck loss={self.loss:.6g}: {'PASS' if self.passed else 'FAIL'}"]
        for w in self.weights:
            lines.append(
                f"  {w.name:30s} checked={w.checked:4d} max_abs={w.max_abs_err:.3g} "
                f"max_rel={w.max_rel_err:.3g} {'ok' if w.passed else 'MISMATCH'}"
            )
        return "\n".join(lines)


def reference_evaluator(proto: onnx.ModelProto):
    """onnx's reference evaluator for ``proto`` with :func:`reference_fixes` installed (the one
    :func:`gradcheck` and :func:`make_op_model` use; ``onnx.reference.ReferenceEvaluator`` is
    looked up at call time, so a test may patch it, see :func:`patch_reference_evaluator`)."""
    return _evaluator(proto)


def _evaluator(proto: onnx.ModelProto):
    """:func:`reference_evaluator` (kept under this name: tests patch it)."""
    from onnx.reference import ReferenceEvaluator

    ops = list(reference_fixes())

    class Evaluator(ReferenceEvaluator):
        """Passes the replacements on to the evaluators of function bodies (Gelu's, ...)."""

        def __init__(self, proto, *args, new_ops=None, **kwargs):
            super().__init__(proto, *args, new_ops=ops if new_ops is None else new_ops, **kwargs)

    return Evaluator(proto)


def reference_fix(name: str):
    """The replacement OpRun class called ``name`` among :func:`reference_fixes`."""
    return next(op for op in reference_fixes() if op.__name__ == name)


@functools.lru_cache(maxsize=None)  # the classes hold no state: built once per process
def reference_fixes() -> tuple:
    """The OpRun classes that fix onnx's reference evaluator for gradient checks (pass them as
    ``new_ops``): ops that round through float32 replaced by versions that keep the input's precision (float64 finite differences need it): Erf, GridSample
    (which also learns opset 16's mode names) and AffineGrid, Adam, cubic Resize, LinearAttention,
    unseeded Dropout (one fixed draw), Scatter (deprecated, missing), MaxPool (Indices as
    the spec and onnxruntime compute them), LpNormalization (|x|**p), MeanVarianceNormalization,
    CausalConvWithState, in function bodies too; and Scan and Loop, which onnx's evaluator runs only along axis 0
    forwards, and stacks wrongly, respectively."""
    import math

    from onnx.reference.ops.op_affine_grid import AffineGrid as StockAffineGrid
    from onnx.reference.ops.op_affine_grid import construct_original_grid
    from onnx.reference.ops.op_erf import Erf as StockErf
    from onnx.reference.ops.op_grid_sample import GridSample as StockGridSample

    class Erf(StockErf):  # new_ops are matched by class name
        op_domain = ""

        def _run(self, x):
            return (np.vectorize(math.erf, otypes=[x.dtype])(x),)

    class GridSample(StockGridSample):
        op_domain = ""

        def _gs_denormalize_coordinates(self, n, dims, align_corners):
            return np.array([self._gs_denormalize(v, d, align_corners) for v, d in zip(n, dims)])

        def _run(self, X, grid, mode=None, padding_mode=None, align_corners=None):
            mode = mode or self.mode
            mode = {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode)
            return super()._run(X, grid, mode=mode, padding_mode=padding_mode, align_corners=align_corners)

    class AffineGrid(StockAffineGrid):
        op_domain = ""

        def _run(self, theta, size, align_corners=None):
            base = construct_original_grid(list(size[2:]), align_corners or self.align_corners)
            return (np.einsum("nij,...j->n...i", theta, base).astype(theta.dtype),)

    from onnx.reference.ops.aionnx_preview_training.op_adam import Adam as StockAdam

    class Adam(StockAdam):  # the stock multi-group path rounds to float32
        op_domain = "ai.onnx.preview.training"

        def _run(self, *data, **kw):
            n = (len(data) - 2) // 4
            groups = [self._run1(*data[:2], *data[2 + i::n][:4], **kw) for i in range(n)]
            return tuple(g[k] for k in range(3) for g in groups)

    from onnx.reference.ops.op_resize import Resize as StockResize

    class Resize(StockResize):  # the stock one keeps cubic_coeff_a float32 under NumPy 2
        op_domain = ""

        def _run(self, X, roi, scales=None, sizes=None, **kwargs):
            a = kwargs.get("cubic_coeff_a")
            kwargs["cubic_coeff_a"] = float(self.cubic_coeff_a if a is None else a)
            return super()._run(X, roi, scales, sizes, **kwargs)

    from onnx.reference.ops.op_dropout import Dropout_12

    class Dropout(Dropout_12):  # unseeded: one fixed draw, so finite differences see one function
        op_domain = ""

        def _run(self, *inputs, seed=None, ratio=None):
            if ratio is not None:  # Dropout-7/10, ratio an attribute: the identity
                return self._private_run(inputs[0], ratio=ratio)
            seed = seed if seed is not None else getattr(self, "seed", None)
            return super()._run(*inputs, seed=0 if seed is None else seed)

    from onnx.reference.ops.op_scatter_elements import ScatterElements

    class Scatter(ScatterElements):  # the deprecated name of ScatterElements (opsets 9, 10)
        op_domain = ""

    from onnx.reference.op_run import OpRun

    class MaxPool(OpRun):  # the stock Indices miss the channel offset with unit strides
        op_domain = ""

        def _run(self, x, auto_pad=None, ceil_mode=None, dilations=None, kernel_shape=None, pads=None,
                 storage_order=None, strides=None):
            y, ind = max_pool_reference(x, list(kernel_shape), auto_pad or "NOTSET", ceil_mode or 0,
                                        dilations, pads, storage_order or 0, strides)
            return (y,) if len(self.output) == 1 else (y, ind)

    from onnx.reference.ops.op_lp_normalization import LpNormalization as StockLpNormalization

    class LpNormalization(StockLpNormalization):  # the stock one sums x**p, not |x|**p
        op_domain = ""

        def _run(self, x, axis=None, p=None):
            axis = self.axis if axis is None else axis
            p = self.p if p is None else p
            norm = np.power(np.sum(np.abs(x) ** p, axis=axis, keepdims=True), 1.0 / p)
            return (np.where(norm == 0, 0, x / np.where(norm == 0, 1, norm)).astype(x.dtype),)

    class MeanVarianceNormalization(OpRun):  # its function body adds a float32 epsilon
        op_domain = ""

        def _run(self, x, axes=None):
            axes = tuple(axes if axes is not None else (self.axes if self.axes is not None else (0, 2, 3)))
            mean = x.mean(axis=axes, keepdims=True)
            std = np.sqrt((x * x).mean(axis=axes, keepdims=True) - mean * mean)
            return ((x - mean) / (std + x.dtype.type(1e-9)),)

    ops = [Erf, GridSample, AffineGrid, Adam, Resize, Dropout, Scatter, MaxPool, LpNormalization,
           MeanVarianceNormalization,
           *_control_flow_classes(),
           _widened("op_linear_attention", "LinearAttention"),
           _widened("op_causal_conv_with_state", "CausalConvWithState")]

    return tuple(ops)


def max_pool_reference(x, kernel_shape, auto_pad="NOTSET", ceil_mode=0, dilations=None, pads=None,
                       storage_order=0, strides=None):
    """MaxPool as the ONNX spec and onnxruntime compute it: (Y, Indices), each window's first
    maximum in row-major order, Indices flat over the whole tensor (spatial axes column-major
    with storage_order=1)."""
    r = len(kernel_shape)
    size = x.shape[2:]
    strides = list(strides or [1] * r)
    dilations = list(dilations or [1] * r)
    pads = list(pads or [0] * (2 * r))
    begins, outs = [], []
    for i in range(r):
        span = (kernel_shape[i] - 1) * dilations[i] + 1
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            out = -(-size[i] // strides[i]) if ceil_mode else (size[i] - 1) // strides[i] + 1
            total = max(0, (out - 1) * strides[i] + span - size[i])
            begin = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
        elif auto_pad == "VALID":
            num = size[i] - span
            out, begin = (-(-num // strides[i]) if ceil_mode else num // strides[i]) + 1, 0
        else:
            begin = pads[i]
            num = size[i] + pads[i] + pads[r + i] - span
            out = (-(-num // strides[i]) if ceil_mode else num // strides[i]) + 1
            if ceil_mode and (out - 1) * strides[i] >= size[i] + pads[i]:
                out -= 1  # a window starting in the end padding is dropped
        begins.append(begin)
        outs.append(out)
    spans = [(k - 1) * d + 1 for k, d in zip(kernel_shape, dilations)]
    after = [max(0, (o - 1) * s + sp - b - n) for o, s, sp, b, n in zip(outs, strides, spans, begins, size)]
    padded = np.pad(x, [(0, 0), (0, 0)] + list(zip(begins, after)), constant_values=-np.inf)
    offsets = list(itertools.product(*[range(k) for k in kernel_shape]))
    cols = np.stack([padded[(slice(None), slice(None)) + tuple(
        slice(k[i] * dilations[i], k[i] * dilations[i] + (outs[i] - 1) * strides[i] + 1, strides[i])
        for i in range(r))] for k in offsets], axis=2)  # (N, C, taps, *out)
    arg = np.argmax(cols, axis=2)
    y = np.take_along_axis(cols, arg[:, :, None], axis=2)[:, :, 0].astype(x.dtype)
    grid = np.meshgrid(*[np.arange(o) for o in outs], indexing="ij")
    pos = [grid[i] * strides[i] - begins[i] + np.array(offsets)[arg, i] * dilations[i] for i in range(r)]
    flat = np.zeros_like(arg)
    for i in (reversed(range(r)) if storage_order else range(r)):
        flat = flat * size[i] + pos[i]
    n, c = x.shape[:2]
    plane = np.arange(n * c).reshape([n, c] + [1] * r) * int(np.prod(size))
    return y, (plane + flat).astype(np.int64)


@functools.lru_cache(maxsize=None)  # compiled once per process
def _widened(module: str, name: str):
    """onnx's reference implementation of an op that computes in float32 whatever its input,
    recompiled with float64 in place of float32 (finite differences need the precision)."""
    import importlib
    import inspect

    mod = importlib.import_module(f"onnx.reference.ops.{module}")
    namespace = {"__name__": mod.__name__}
    exec(compile(inspect.getsource(mod).replace("np.float32", "np.float64"), mod.__file__, "exec"), namespace)
    cls = namespace[name]
    cls.op_domain = ""
    return cls


@functools.lru_cache(maxsize=None)
def _control_flow_classes():
    from onnx.reference.op_run import OpRun

    class Scan(OpRun):
        """Scan with every scan_input/output axis and direction (onnx's takes only 0)."""

        op_domain = ""

        def need_context(self) -> bool:
            return True

        def _run(self, *args, context=None, attributes=None, bindings=None, **_):
            m = self.num_scan_inputs
            n_states = len(args) - m
            names_in, names_out = self.body.input_names, self.body.output_names
            n_out = len(names_out) - n_states
            in_axes = list(self.scan_input_axes or [0] * m)
            in_dirs = list(self.scan_input_directions or [0] * m)
            out_axes = list(self.scan_output_axes or [0] * n_out)
            out_dirs = list(self.scan_output_directions or [0] * n_out)
            xs = [np.moveaxis(x, a, 0) for x, a in zip(args[n_states:], in_axes)]
            xs = [x[::-1] if d else x for x, d in zip(xs, in_dirs)]
            states = list(args[:n_states])
            stacked: list[list] = [[] for _ in range(n_out)]
            for t in range(xs[0].shape[0]):
                feeds = dict(context or {})
                feeds.update(zip(names_in, states + [x[t] for x in xs]))
                outs = self._run_body(feeds, attributes=attributes, bindings=bindings)
                states = list(outs[:n_states])
                for k in range(n_out):
                    stacked[k].append(outs[n_states + k])
            results = []
            for k, parts in enumerate(stacked):
                y = np.stack(parts[::-1] if out_dirs[k] else parts)
                results.append(np.moveaxis(y, 0, out_axes[k] % y.ndim))
            return tuple(states + results)

    class Loop(OpRun):
        """Loop that stacks scan outputs along a new axis (onnx's concatenates them)."""

        op_domain = ""

        def need_context(self) -> bool:
            return True

        def _run(self, M, cond, *carried, context=None, attributes=None, bindings=None, **_):
            names_in, names_out = self.body.input_names, self.body.output_names
            n = len(names_in) - 2
            stacked: list[list] = [[] for _ in range(len(names_out) - 1 - n)]
            carried, keep, it = list(carried), True if cond is None else bool(cond), 0
            while keep and (M is None or it < int(M)):
                feeds = dict(context or {})
                feeds.update(zip(names_in, [np.array(it, dtype=np.int64), np.array(keep)] + carried))
                outs = self._run_body(feeds, attributes=attributes, bindings=bindings)
                keep, carried = bool(outs[0]), list(outs[1:1 + n])
                for k, part in enumerate(stacked):
                    part.append(outs[1 + n + k])
                it += 1
            return tuple(carried + [np.stack(p) if p else np.zeros((0,)) for p in stacked])

    return Scan, Loop


def _forward_model(proto: onnx.ModelProto, weights: Sequence[str], loss: str) -> onnx.ModelProto:
    """``proto`` with ``weights`` as graph inputs and ``loss`` as the only output."""
    fwd = onnx.ModelProto()
    fwd.CopyFrom(proto)
    inferred = onnx.shape_inference.infer_shapes(fwd)
    vi = {v.name: v for v in list(inferred.graph.value_info) + list(inferred.graph.output)
          + list(inferred.graph.input)}
    inputs = {i.name for i in fwd.graph.input}
    for t in fwd.graph.initializer:
        if t.name in weights and t.name not in inputs:
            fwd.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    del fwd.graph.output[:]
    if loss in vi:
        fwd.graph.output.append(vi[loss])
    else:
        fwd.graph.output.append(helper.make_empty_tensor_value_info(loss))
    return fwd


def _weight_values(proto: onnx.ModelProto, weights, feeds) -> dict[str, np.ndarray]:
    inits = {t.name: t for t in proto.graph.initializer}
    out = {}
    for w in weights:
        if w in feeds:
            out[w] = np.asarray(feeds[w], dtype=np.float64)
        elif w in inits:
            out[w] = numpy_helper.to_array(inits[w]).astype(np.float64)
        else:
            raise InvalidArgumentError(f"gradcheck: weight '{w}' is a graph input; give its value in inputs")
    return out


def gradcheck(
    model,
    weights: Sequence[str],
    loss: str,
    inputs: Mapping[str, np.ndarray] | None = None,
    *,
    eps: float = 1e-6,
    rtol: float = 1e-4,
    atol: float = 1e-6,
    max_elements: int = 24,
    directions: int = 2,
    seed: int = 0,
) -> GradcheckReport:
    """Compare the built gradients of ``loss`` w.r.t. ``weights`` with finite differences.

    Everything runs in float64 on onnx's reference evaluator. Each weight is checked on up to
    ``max_elements`` sampled elements plus ``directions`` random directional derivatives.
    An element passes when ``|analytic - numeric| <= atol + rtol * |numeric|``.
    """
    rng = np.random.default_rng(seed)
    proto = to_float64(model)
    graph_inputs = {i.name for i in proto.graph.input}
    init_names = {t.name for t in proto.graph.initializer}
    feeds64 = {}
    for k, v in (inputs or {}).items():
        arr = np.asarray(v)
        feeds64[k] = arr.astype(np.float64) if arr.dtype.kind == "f" else arr
    missing = [n for n in graph_inputs - init_names - set(feeds64)]
    if missing:
        raise InvalidArgumentError(f"gradcheck: give values for the graph inputs {sorted(missing)}")
    wvals = _weight_values(proto, weights, feeds64)

    built = _build_float64(model, proto, list(weights), loss)
    grad_eval = _evaluator(built)
    res = grad_eval.run(None, {**feeds64, **wvals})
    names = [o.name for o in built.graph.output]
    got = dict(zip(names, res))
    grads = {w: np.asarray(got[f"{w}_grad"], dtype=np.float64) for w in weights}

    fwd_eval = _evaluator(_forward_model(proto, weights, loss))

    def f(wname, value):
        feed = {**feeds64, **wvals, wname: value}
        return float(np.asarray(fwd_eval.run(None, feed)[0]).reshape(-1)[0])

    checks = []
    for w in weights:
        base = wvals[w]
        g = grads[w]
        if g.shape != base.shape:
            checks.append(WeightCheck(w, 0, float("inf"), float("inf"), False))
            continue
        flat = base.reshape(-1)
        idx = np.arange(flat.size) if flat.size <= max_elements else rng.choice(flat.size, max_elements, replace=False)
        pairs = []
        for i in idx:
            plus, minus = flat.copy(), flat.copy()
            plus[i] += eps
            minus[i] -= eps
            num = (f(w, plus.reshape(base.shape)) - f(w, minus.reshape(base.shape))) / (2 * eps)
            pairs.append((float(g.reshape(-1)[i]), num))
        for _ in range(directions if flat.size > 1 else 0):
            d = rng.standard_normal(base.shape)
            d /= np.linalg.norm(d)
            num = (f(w, base + eps * d) - f(w, base - eps * d)) / (2 * eps)
            pairs.append((float(np.sum(g * d)), num))
        a = np.array([p[0] for p in pairs])
        n = np.array([p[1] for p in pairs])
        err = np.abs(a - n)
        ok = bool(np.all(err <= atol + rtol * np.abs(n))) and bool(np.all(np.isfinite(a)))
        rel = err / np.maximum(np.abs(n), 1e-12)
        checks.append(WeightCheck(w, len(pairs), float(err.max(initial=0)), float(rel.max(initial=0)), ok))
    loss_value = float(np.asarray(got[loss]).reshape(-1)[0]) if loss in got else float("nan")
    return GradcheckReport(checks, loss_value, grads)


def _build_float64(model, proto64: onnx.ModelProto, weights: list[str], loss: str) -> onnx.ModelProto:
    """The gradient graph of the float64 model; where that does not type-check (ops whose
    schema has no float64 type: RotaryEmbedding, LinearAttention; function bodies with
    float32 constants: MeanVarianceNormalization) the graph is built in the model's own
    precision and then converted, so the reference evaluator still runs it in float64."""
    try:
        return GradientGraphBuilder(proto64, weights=weights, outputs=[loss], loss=loss).build().model_proto
    except InvalidModelError:
        pass  # e.g. a float32 constant in an op's function body no longer type-checks
    built = GradientGraphBuilder(model, weights=weights, outputs=[loss], loss=loss).build().model_proto
    return to_float64(built)


def numeric_gradient(f, base: np.ndarray, eps: float) -> np.ndarray:
    """Central finite differences of the scalar function ``f`` at ``base``, every element."""
    num = np.zeros_like(base)
    flat = base.reshape(-1)
    for i in range(flat.size):
        plus, minus = flat.copy(), flat.copy()
        plus[i] += eps
        minus[i] -= eps
        num.reshape(-1)[i] = (f(plus.reshape(base.shape)) - f(minus.reshape(base.shape))) / (2 * eps)
    return num


# ----------------------------------------------------------------------------- onnxruntime


def ort_session(model, providers=("CPUExecutionProvider",)):
    """A quiet onnxruntime session for a ModelProto, serialized bytes or a path."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if isinstance(model, onnx.ModelProto):
        model = model.SerializeToString()
    return ort.InferenceSession(model if isinstance(model, bytes) else str(model), so, providers=list(providers))


def run_onnxruntime(model, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run ``model`` on onnxruntime's CPU provider: output name -> value. Feeds the model
    does not take are ignored; weights with initializer defaults can be fed."""
    sess = ort_session(model)
    wanted = {i.name for i in sess.get_inputs()} | {i.name for i in sess.get_overridable_initializers()}
    out = sess.run(None, {k: v for k, v in feeds.items() if k in wanted})
    return dict(zip([o.name for o in sess.get_outputs()], out))


def ort_run(model, feeds: Mapping[str, np.ndarray], *, overridable: bool = True) -> dict[str, np.ndarray]:
    """Run ``model`` on onnxruntime's CPU provider: output name -> value (the tests' shorthand).

    Feeds the model does not take are dropped. With ``overridable=False`` only the graph's
    inputs are fed, never its initializers (even when ``feeds`` holds a value by that name)."""
    if overridable:
        return run_onnxruntime(model, feeds)
    sess = ort_session(model)
    wanted = {i.name for i in sess.get_inputs()}
    out = sess.run(None, {k: v for k, v in feeds.items() if k in wanted})
    return dict(zip([o.name for o in sess.get_outputs()], out))


def ort_grad_session(model, weights: Sequence[str], feeds: Mapping[str, np.ndarray], *, loss: str = "loss"):
    """(session, outputs): the float gradient graph of ``model`` (``loss`` w.r.t. ``weights``)
    run on onnxruntime's CPU provider, fed the graph inputs found in ``feeds``; ``outputs`` maps
    every output name (``loss``, ``<w>_grad``) to its value. The session is returned for
    further runs (finite differences on onnxruntime)."""
    built = GradientGraphBuilder(model, weights=list(weights), outputs=[loss], loss=loss).build().get_model()
    racing = racing_nodes(onnx.load_from_string(built).graph)
    assert not racing, f"the gradient graph holds nodes that race on onnxruntime's CPU threads: {racing}"
    sess = ort_session(built)
    run_feeds = {i.name: feeds[i.name] for i in sess.get_inputs() if i.name in feeds}
    return sess, dict(zip([o.name for o in sess.get_outputs()], sess.run(None, run_feeds)))


def racing_nodes(graph: onnx.GraphProto) -> list[str]:
    """The nodes of ``graph`` (its subgraphs too) whose onnxruntime CPU kernel adds into shared
    places from several threads at once (ScatterND with a reduction; see
    ``compiler/passes/race_free_scatter.py``): a graph gradbuilder writes has none."""
    found = []
    for node in graph.node:
        if node.op_type == "ScatterND" and node.domain in ("", "ai.onnx") and any(
                a.name == "reduction" and a.s not in (b"", b"none") for a in node.attribute):
            found.append(f"{node.op_type} '{node.name}'")
        for a in node.attribute:
            for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                found += racing_nodes(sub)
    return found


def ort_grads(model, weights: Sequence[str], feeds: Mapping[str, np.ndarray], *, loss: str = "loss"
              ) -> dict[str, np.ndarray]:
    """The onnxruntime gradients of ``loss`` w.r.t. ``weights``: weight name -> gradient
    (see :func:`ort_grad_session`)."""
    _, got = ort_grad_session(model, weights, feeds, loss=loss)
    return {w: got[f"{w}_grad"] for w in weights}


def check_model(model, weights: Sequence[str], feeds: Mapping[str, np.ndarray] | None = None, *, ort: bool = True,
                loss: str = "loss", **gradcheck_kwargs) -> GradcheckReport:
    """:func:`check_op`'s two checks on a prepared model: :func:`gradcheck` (float64 finite
    differences on the reference evaluator) must pass, then (with ``ort=True``) the float32
    gradient graph on onnxruntime must agree with the float64 gradients within
    ``rtol=2e-3, atol=2e-4 * max(1, max|grad|)``. Raises AssertionError; returns the report."""
    feeds = dict(feeds or {})
    report = gradcheck(model, weights, loss, feeds, **gradcheck_kwargs)
    assert report.passed, str(report)
    if ort:
        got = ort_grads(model, weights, feeds, loss=loss)
        for w in weights:
            ref = report.gradients[w]
            np.testing.assert_allclose(got[w], ref, rtol=2e-3, atol=2e-4 * max(1.0, np.abs(ref).max()), err_msg=w)
    return report


# ----------------------------------------------------------------------------- reference evaluator fixes


def reference_evaluator_with(*ops, prepare=None):
    """A subclass of the current ``onnx.reference.ReferenceEvaluator`` that always adds the
    OpRun classes ``ops`` (matched by class name and ``op_domain``) after any ``new_ops`` it is
    given, so they win over both the stock kernels and :func:`gradcheck`'s replacements.
    ``prepare``, when given, maps each ModelProto before evaluation."""
    from onnx import reference

    stock = reference.ReferenceEvaluator

    class Evaluator(stock):
        def __init__(self, proto, *args, new_ops=None, **kwargs):
            if prepare is not None and isinstance(proto, onnx.ModelProto):
                proto = prepare(proto)
            super().__init__(proto, *args, new_ops=[*(new_ops or []), *ops], **kwargs)

    return Evaluator


def patch_reference_evaluator(monkeypatch, *ops, prepare=None):
    """Install :func:`reference_evaluator_with` as ``onnx.reference.ReferenceEvaluator`` for one
    test (``monkeypatch`` is pytest's fixture; it restores the stock class afterwards). Code that
    looks the evaluator up at call time (``gradcheck``, ``make_op_model``, ``check_op``) then
    computes with ``ops``. Returns the stock class (the one replaced)."""
    from onnx import reference

    stock = reference.ReferenceEvaluator
    monkeypatch.setattr(reference, "ReferenceEvaluator", reference_evaluator_with(*ops, prepare=prepare))
    return stock


# ----------------------------------------------------------------------------- single op


_NP_TO_ONNX = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float64): TensorProto.DOUBLE,
               np.dtype(np.float16): TensorProto.FLOAT16, np.dtype(np.int64): TensorProto.INT64,
               np.dtype(np.int32): TensorProto.INT32, np.dtype(np.bool_): TensorProto.BOOL}


def _onnx_type(arr: np.ndarray) -> int:
    return _NP_TO_ONNX[np.asarray(arr).dtype]


def make_op_model(
    op_type: str,
    inputs: Sequence[tuple[str, np.ndarray | None]],
    attrs: Mapping | None = None,
    *,
    num_outputs: int = 1,
    opset: int = 17,
    domain: str = "",
    wrt: Sequence[str] | None = None,
    weights_as: str = "initializers",
    dims: str = "static",
    seed: int = 1234,
) -> tuple[onnx.ModelProto, list[str], dict[str, np.ndarray]]:
    """One ``op_type`` node whose loss is a fixed random projection of every float output.

    ``inputs`` is a list of (name, array) — None or "" name for a skipped optional input.
    Float inputs (or only ``wrt``) are the weights: initializers, or graph inputs when
    ``weights_as="inputs"`` (their dims then "static", "symbolic" or "dynamic"). Returns
    (model, weights, feeds).
    """
    rng = np.random.default_rng(seed)
    node_inputs, graph_inputs, inits, feeds, weights = [], [], [], {}, []
    for name, arr in inputs:
        if not name or arr is None:
            node_inputs.append("")
            continue
        node_inputs.append(name)
        arr = np.asarray(arr)
        is_weight = (arr.dtype.kind == "f") if wrt is None else (name in wrt)
        if is_weight:
            weights.append(name)
        if is_weight and weights_as == "inputs":
            shape = {"static": list(arr.shape),
                     "symbolic": [f"{name}_d{i}" if d != 1 else 1 for i, d in enumerate(arr.shape)],
                     "dynamic": [None] * arr.ndim}[dims]
            graph_inputs.append(helper.make_tensor_value_info(name, _onnx_type(arr), shape))
            feeds[name] = arr
        else:
            inits.append(numpy_helper.from_array(arr, name))
    outs = [f"y{i}" for i in range(num_outputs)]
    node = helper.make_node(op_type, node_inputs, outs, domain=domain, **dict(attrs or {}))
    opsets = [helper.make_opsetid("", opset)]
    if domain:
        opsets.append(helper.make_opsetid(domain, 1))
    probe = helper.make_model(
        helper.make_graph([node], "probe", graph_inputs, [helper.make_empty_tensor_value_info(o) for o in outs], inits),
        opset_imports=opsets,
    )
    values = _evaluator(probe).run(None, feeds)
    nodes = [node]
    terms = []
    for o, v in zip(outs, values):
        v = np.asarray(v)
        if v.dtype.kind != "f":
            continue
        proj = rng.standard_normal(v.shape).astype(v.dtype)
        pname = f"{o}_proj"
        inits.append(numpy_helper.from_array(proj, pname))
        nodes.append(helper.make_node("Mul", [o, pname], [f"{o}_m"]))
        nodes.append(helper.make_node("ReduceSum", [f"{o}_m"], [f"{o}_s"], keepdims=0))
        terms.append(f"{o}_s")
    if not terms:
        raise InvalidArgumentError(f"{op_type} has no float output to build a loss from")
    nodes.append(helper.make_node("Sum", terms, ["loss"]) if len(terms) > 1 else helper.make_node("Identity", terms, ["loss"]))
    ltype = _onnx_type(np.asarray(values[0]) if np.asarray(values[0]).dtype.kind == "f" else np.float32(0))
    model = helper.make_model(
        helper.make_graph(nodes, op_type.lower(), graph_inputs,
                          [helper.make_tensor_value_info("loss", ltype, [])], inits),
        opset_imports=opsets,
    )
    model.ir_version = min(model.ir_version, 10)
    return model, weights, feeds


def check_op(
    op_type: str,
    inputs: Sequence[tuple[str, np.ndarray | None]],
    attrs: Mapping | None = None,
    *,
    num_outputs: int = 1,
    opset: int = 17,
    domain: str = "",
    wrt: Sequence[str] | None = None,
    weights_as: str = "initializers",
    dims: str = "static",
    ort: bool = True,
    rtol: float = 1e-4,
    atol: float = 1e-6,
    ort_rtol: float = 2e-3,
    ort_atol: float = 2e-4,
    **gradcheck_kwargs,
) -> GradcheckReport:
    """Gradcheck one operator; raise AssertionError with the report when it does not match.

    With ``ort=True`` the float32 gradient graph also runs on onnxruntime's CPU provider and
    must agree with the float64 gradients.
    """
    model, weights, feeds = make_op_model(
        op_type, inputs, attrs, num_outputs=num_outputs, opset=opset, domain=domain, wrt=wrt,
        weights_as=weights_as, dims=dims,
    )
    report = gradcheck(model, weights, "loss", feeds, rtol=rtol, atol=atol, **gradcheck_kwargs)
    if not report.passed:
        raise AssertionError(f"{op_type} opset {opset} {dict(attrs or {})}:\n{report}")
    if ort:
        m32 = GradientGraphBuilder(model, weights=weights, outputs=["loss"], loss="loss").build().get_model()
        got = run_onnxruntime(m32, feeds)
        for w in weights:
            ref = report.gradients[w]
            g = np.asarray(got[f"{w}_grad"], dtype=np.float64)
            scale = max(1.0, float(np.abs(ref).max(initial=0)))
            if g.shape != ref.shape or not np.allclose(g, ref, rtol=ort_rtol, atol=ort_atol * scale):
                raise AssertionError(
                    f"{op_type} opset {opset}: onnxruntime gradient of '{w}' differs from float64: "
                    f"max abs diff {np.abs(g - ref).max() if g.shape == ref.shape else 'shape ' + str(g.shape)}"
                )
    return report


# ----------------------------------------------------------------------------- parameter grids


def pairwise(params: Mapping[str, Sequence], *, whole: Sequence[str] = ()) -> list[tuple]:
    """A covering set of test cases for ``@pytest.mark.parametrize`` in place of the full product
    of ``params`` (name -> values): the full product of the parameters named in ``whole`` (those
    whose values interact in the rule's code), and every pair of values of any two parameters.

    Deterministic (greedy, in the order given); returns tuples in the order of ``params``. Use
    it where the full grid adds no coverage: every value of every parameter appears, every pair
    appears, and the ``whole`` parameters appear in every combination."""
    names = list(params)
    sizes = [len(params[n]) for n in names]
    if any(s == 0 for s in sizes):
        return []
    pos = {n: i for i, n in enumerate(names)}
    whole_idx = [pos[n] for n in whole]
    uncovered = {(i, a, j, b) for i in range(len(names)) for j in range(i + 1, len(names))
                 for a in range(sizes[i]) for b in range(sizes[j])}
    used = [[0] * s for s in sizes]

    def fill(row):
        for k in range(len(names)):
            if row[k] is not None:
                continue

            def gain(v, k=k):
                return sum(((min(k, j), v if k < j else row[j], max(k, j), row[j] if k < j else v) in uncovered)
                           for j in range(len(names)) if row[j] is not None)

            row[k] = max(range(sizes[k]), key=lambda v: (gain(v), -used[k][v], -v))
        return row

    def add(row):
        for i in range(len(names)):
            used[i][row[i]] += 1
            for j in range(i + 1, len(names)):
                uncovered.discard((i, row[i], j, row[j]))
        rows.append(tuple(row))

    rows: list[tuple] = []
    for combo in itertools.product(*[range(sizes[i]) for i in whole_idx]):
        row = [None] * len(names)
        for i, v in zip(whole_idx, combo):
            row[i] = v
        add(fill(row))
    while uncovered:
        i, a, j, b = min(uncovered)
        row = [None] * len(names)
        row[i], row[j] = a, b
        add(fill(row))
    for k in range(len(names)):  # a value no pair brought in (a parameter alone)
        for v in range(sizes[k]):
            if not used[k][v]:
                row = [None] * len(names)
                row[k] = v
                add(fill(row))
    return [tuple(params[n][v] for n, v in zip(names, row)) for row in rows]


# ----------------------------------------------------------------------------- a large model


def embedding_model_on_disk(directory, gib: float, width: int = 1024) -> tuple[str, int]:
    """A model of ``gib`` GiB that costs little to run, for the tests and benchmarks of models
    over 2 GB: an embedding table ``E`` [rows, width] float32 in the external data file
    ``E.bin`` (written in chunks, never held whole), read by a Gather of ``ids``; ``logits =
    e @ W`` (W [width, 4]); ``loss`` = SoftmaxCrossEntropyLoss(logits, labels). Returns (the
    model's path, the table's bytes)."""
    import os

    rows = int(gib * 2**30) // (width * 4)
    chunk = (np.random.default_rng(0).standard_normal((1024, width)) * 0.01).astype(np.float32)
    with open(os.path.join(directory, "E.bin"), "wb") as f:
        for start in range(0, rows, len(chunk)):
            f.write(chunk[: rows - start].tobytes())
    table = onnx.TensorProto(name="E", data_type=TensorProto.FLOAT, dims=[rows, width],
                             data_location=TensorProto.EXTERNAL)
    for key, value in (("location", "E.bin"), ("offset", "0"), ("length", str(rows * width * 4))):
        table.external_data.add(key=key, value=value)
    head = numpy_helper.from_array(np.full((width, 4), 0.01, np.float32), "W")
    nodes = [helper.make_node("Gather", ["E", "ids"], ["e"]),
             helper.make_node("MatMul", ["e", "W"], ["logits"]),
             helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"])]
    graph = helper.make_graph(nodes, "embedding", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch"]),
                                                   helper.make_tensor_value_info("labels", TensorProto.INT64, ["batch"])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
                               helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])], [table, head])
    path = os.path.join(directory, "embedding.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return path, rows * width * 4


def resident_bytes(key: str = "VmRSS") -> int:
    """This process's resident size (``VmRSS``) or its peak since the last :func:`reset_peak`
    (``VmHWM``), from /proc/self/status (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak() -> None:
    """Make the peak resident size (``VmHWM``) the present one (Linux's /proc/self/clear_refs)."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
