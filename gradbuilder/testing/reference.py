"""onnx's reference evaluator, fixed for gradient checks: the op replacements that keep float64
precision and follow the spec where the stock kernels do not (:func:`reference_fixes`), the
evaluator with them installed (:func:`reference_evaluator`), and more replacements for one pytest
test (:func:`patch_reference_evaluator`)."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import onnx


def reference_evaluator(proto: onnx.ModelProto):
    """onnx's reference evaluator for ``proto`` with :func:`reference_fixes` installed (the one
    :func:`gradcheck` and :func:`make_op_model` use; ``onnx.reference.ReferenceEvaluator`` is
    looked up at call time, so a test may patch it, see :func:`patch_reference_evaluator`).

    ``gradbuilder.testing.make_evaluator`` builds it, looked up at each call: a test may replace
    that name to change what every check computes with."""
    from .. import testing  # the package's attribute, as a test may have set it

    return testing.make_evaluator(proto)


def make_evaluator(proto: onnx.ModelProto):
    """Builds the evaluator :func:`reference_evaluator` returns: the hook a test replaces as
    ``gradbuilder.testing.make_evaluator`` to change what every check computes with."""
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
    the spec and onnxruntime compute them), AveragePool and LpPool (the stock ones loop over the
    windows in Python), LpNormalization (|x|**p), MeanVarianceNormalization,
    CausalConvWithState, in function bodies too; and Scan and Loop, which onnx's evaluator runs only along axis 0
    forwards, and stacks wrongly, respectively."""
    return (*_float64_kernels(),
            *_deterministic_and_renamed_kernels(),
            *_pooling_kernels(),
            *_normalization_kernels(),
            *_control_flow_classes(),
            _widened("op_linear_attention", "LinearAttention"),
            _widened("op_causal_conv_with_state", "CausalConvWithState"))


def _float64_kernels() -> tuple:
    """Erf, GridSample (with opset 16's mode names), AffineGrid, Adam and Resize computing in
    the input's precision where the stock kernels round through float32."""
    import math

    from onnx.reference.ops.aionnx_preview_training.op_adam import Adam as StockAdam
    from onnx.reference.ops.op_affine_grid import AffineGrid as StockAffineGrid
    from onnx.reference.ops.op_affine_grid import construct_original_grid
    from onnx.reference.ops.op_erf import Erf as StockErf
    from onnx.reference.ops.op_grid_sample import GridSample as StockGridSample
    from onnx.reference.ops.op_resize import Resize as StockResize

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

    class Adam(StockAdam):  # the stock multi-group path rounds to float32
        op_domain = "ai.onnx.preview.training"

        def _run(self, *data, **kw):
            n = (len(data) - 2) // 4
            groups = [self._run1(*data[:2], *data[2 + i::n][:4], **kw) for i in range(n)]
            return tuple(g[k] for k in range(3) for g in groups)

    class Resize(StockResize):  # the stock one keeps cubic_coeff_a float32 under NumPy 2
        op_domain = ""

        def _run(self, X, roi, scales=None, sizes=None, **kwargs):
            a = kwargs.get("cubic_coeff_a")
            kwargs["cubic_coeff_a"] = float(self.cubic_coeff_a if a is None else a)
            return super()._run(X, roi, scales, sizes, **kwargs)

    return Erf, GridSample, AffineGrid, Adam, Resize


def _deterministic_and_renamed_kernels() -> tuple:
    """Dropout without a seed drawing one fixed mask (finite differences then see one function),
    and Scatter, the deprecated name of ScatterElements that onnx's evaluator lacks."""
    from onnx.reference.ops.op_dropout import Dropout_12
    from onnx.reference.ops.op_scatter_elements import ScatterElements

    class Dropout(Dropout_12):  # unseeded: one fixed draw, so finite differences see one function
        op_domain = ""

        def _run(self, *inputs, seed=None, ratio=None):
            if ratio is not None:  # Dropout-7/10, ratio an attribute: the identity
                return self._private_run(inputs[0], ratio=ratio)
            seed = seed if seed is not None else getattr(self, "seed", None)
            return super()._run(*inputs, seed=0 if seed is None else seed)

    class Scatter(ScatterElements):  # the deprecated name of ScatterElements (opsets 9, 10)
        op_domain = ""

    return Dropout, Scatter


def _pooling_kernels() -> tuple:
    """MaxPool, AveragePool and LpPool over all windows at once (:func:`_pool_windows`), with
    MaxPool's Indices as the spec and onnxruntime compute them."""
    from onnx.reference.op_run import OpRun

    class MaxPool(OpRun):  # the stock Indices miss the channel offset with unit strides
        op_domain = ""

        def _run(self, x, auto_pad=None, ceil_mode=None, dilations=None, kernel_shape=None, pads=None,
                 storage_order=None, strides=None):
            y, ind = max_pool_reference(x, list(kernel_shape), auto_pad or "NOTSET", ceil_mode or 0,
                                        dilations, pads, storage_order or 0, strides)
            return (y,) if len(self.output) == 1 else (y, ind)

    class AveragePool(OpRun):  # the stock one loops over the windows in Python
        op_domain = ""

        def _run(self, x, auto_pad=None, ceil_mode=None, dilations=None, kernel_shape=None, pads=None,
                 strides=None, count_include_pad=None):
            return (average_pool_reference(x, list(kernel_shape), auto_pad or "NOTSET", ceil_mode or 0, dilations,
                                           pads, strides, count_include_pad or 0),)

    class LpPool(OpRun):  # the same windows: (taps * mean |x|**p over x and its padding) ** (1/p), as
        op_domain = ""      # onnx's reference computes it (the norm itself but where a ceil-mode window overhangs)

        def _run(self, x, auto_pad=None, ceil_mode=None, dilations=None, kernel_shape=None, p=None, pads=None,
                 strides=None):
            p = 2 if p is None else p
            mean = average_pool_reference(np.abs(x) ** p, list(kernel_shape), auto_pad or "NOTSET", ceil_mode or 0,
                                          dilations, pads, strides, count_include_pad=1)
            return ((int(np.prod(kernel_shape)) * mean) ** (1.0 / p)).astype(x.dtype),

    return MaxPool, AveragePool, LpPool


def _normalization_kernels() -> tuple:
    """LpNormalization of |x|**p (the stock one sums x**p) and MeanVarianceNormalization in the
    input's precision (its function body adds a float32 epsilon)."""
    from onnx.reference.op_run import OpRun
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

    return LpNormalization, MeanVarianceNormalization


def _pool_windows(x, kernel_shape, auto_pad="NOTSET", ceil_mode=0, dilations=None, pads=None, strides=None,
                  fill=0.0):
    """The windows of a pooling op over ``x`` (N, C, *spatial), with every spatial axis's output
    size, padding and ceil mode as the ONNX spec and onnxruntime compute them. Returns ``cols``
    (N, C, taps, *out), the value of each window tap (``fill`` outside ``x``), the taps' offsets
    (taps, r), the begin padding and the output sizes per axis, and two masks broadcastable to
    ``cols``: the taps on ``x`` and the taps on ``x`` or its padding (not past it, where a ceil-mode
    window overhangs)."""
    r = len(kernel_shape)
    size = x.shape[2:]
    strides = list(strides or [1] * r)
    dilations = list(dilations or [1] * r)
    pads = list(pads or [0] * (2 * r))
    begins, ends, outs = [], [], []
    for i in range(r):
        span = (kernel_shape[i] - 1) * dilations[i] + 1
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            out = -(-size[i] // strides[i]) if ceil_mode else (size[i] - 1) // strides[i] + 1
            total = max(0, (out - 1) * strides[i] + span - size[i])
            begin = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
            end = total - begin
        elif auto_pad == "VALID":
            num = size[i] - span
            out, begin, end = (-(-num // strides[i]) if ceil_mode else num // strides[i]) + 1, 0, 0
        else:
            begin, end = pads[i], pads[r + i]
            num = size[i] + begin + end - span
            out = (-(-num // strides[i]) if ceil_mode else num // strides[i]) + 1
            if ceil_mode and (out - 1) * strides[i] >= size[i] + begin:
                out -= 1  # a window starting in the end padding is dropped
        begins.append(begin)
        ends.append(end)
        outs.append(out)
    spans = [(k - 1) * d + 1 for k, d in zip(kernel_shape, dilations)]
    after = [max(0, (o - 1) * s + sp - b - n) for o, s, sp, b, n in zip(outs, strides, spans, begins, size)]
    padded = np.pad(x, [(0, 0), (0, 0)] + list(zip(begins, after)), constant_values=fill)
    offsets = np.array(list(itertools.product(*[range(k) for k in kernel_shape]))).reshape(-1, r)
    cols = np.stack([padded[(slice(None), slice(None)) + tuple(
        slice(k[i] * dilations[i], k[i] * dilations[i] + (outs[i] - 1) * strides[i] + 1, strides[i])
        for i in range(r))] for k in offsets], axis=2)  # (N, C, taps, *out)
    on_x = np.ones((len(offsets),) + tuple(outs), bool)
    on_padding = on_x.copy()
    for i in range(r):  # tap t of window o sits at o * stride + offset * dilation in padded coordinates
        where = (np.arange(outs[i]) * strides[i]).reshape([1] * (i + 1) + [-1] + [1] * (r - i - 1)) \
            + (offsets[:, i] * dilations[i]).reshape([-1] + [1] * r)
        on_x &= (where >= begins[i]) & (where < begins[i] + size[i])
        on_padding &= where < begins[i] + size[i] + ends[i]
    return cols, offsets, begins, outs, on_x, on_padding


def max_pool_reference(x, kernel_shape, auto_pad="NOTSET", ceil_mode=0, dilations=None, pads=None,
                       storage_order=0, strides=None):
    """MaxPool as the ONNX spec and onnxruntime compute it: (Y, Indices), each window's first
    maximum in row-major order, Indices flat over the whole tensor (spatial axes column-major
    with storage_order=1)."""
    r = len(kernel_shape)
    size = x.shape[2:]
    strides = list(strides or [1] * r)
    dilations = list(dilations or [1] * r)
    cols, offsets, begins, outs, _, _ = _pool_windows(x, kernel_shape, auto_pad, ceil_mode, dilations, pads, strides,
                                                      fill=-np.inf)
    arg = np.argmax(cols, axis=2)
    y = np.take_along_axis(cols, arg[:, :, None], axis=2)[:, :, 0].astype(x.dtype)
    grid = np.meshgrid(*[np.arange(o) for o in outs], indexing="ij")
    pos = [grid[i] * strides[i] - begins[i] + offsets[arg, i] * dilations[i] for i in range(r)]
    flat = np.zeros_like(arg)
    for i in (reversed(range(r)) if storage_order else range(r)):
        flat = flat * size[i] + pos[i]
    n, c = x.shape[:2]
    plane = np.arange(n * c).reshape([n, c] + [1] * r) * int(np.prod(size))
    return y, (plane + flat).astype(np.int64)


def average_pool_reference(x, kernel_shape, auto_pad="NOTSET", ceil_mode=0, dilations=None, pads=None,
                           strides=None, count_include_pad=0):
    """AveragePool as onnx's reference evaluator computes it, in one pass over the windows (the
    stock kernel loops over them in Python: seconds for a small 3-D input): each window's mean
    over its taps on ``x``, or with ``count_include_pad`` on ``x`` and its padding."""
    cols, _, _, _, on_x, on_padding = _pool_windows(x, kernel_shape, auto_pad, ceil_mode, dilations, pads, strides)
    counted = on_padding if count_include_pad else on_x
    with np.errstate(invalid="ignore", divide="ignore"):  # a window on padding alone: NaN, as the stock one
        return (np.where(counted, cols, 0).sum(axis=2) / counted.sum(axis=0)).astype(x.dtype)


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
