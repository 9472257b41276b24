"""Loss blocks: append a loss to a forward-only model, in standard ONNX operators.

``append_loss(model, kind, output)`` adds a graph input ``target`` and a graph output
``loss`` computed from the model output ``output``, with the numerics of
torch.nn.functional:

==================  ==========================================  ==========================
kind                torch                                       target
==================  ==========================================  ==========================
crossentropy        F.cross_entropy(output, target, ...)        int64 [N] or [N, d1..]
nll                 F.nll_loss(output, target, ...)             int64 [N] or [N, d1..]
mse                 F.mse_loss(output, target, ...)             like ``output``
l1                  F.l1_loss(output, target, ...)              like ``output``
bcewithlogits       F.binary_cross_entropy_with_logits(...)     like ``output``
==================  ==========================================  ==========================

crossentropy and nll use ONNX's SoftmaxCrossEntropyLoss / NegativeLogLikelihoodLoss, which
define weight, ignore_index and reduction as torch does (the weighted mean divides by the
sum of the weights of the kept targets). bcewithlogits uses the overflow-free form

    loss = (1 - t)*x + (1 + (pos_weight - 1)*t) * (log(1 + exp(-|x|)) + relu(-x))

times ``weight``, as torch does. The model given is never modified; the result is a new
ModelProto with the model's outputs first and the loss last.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx
import onnx.version_converter
from onnx import TensorProto, helper, numpy_helper

from .. import compat
from ..compiler import modelio
from ..dtypes import FLOAT_TENSOR_TYPES
from ..errors import InvalidArgumentError, InvalidModelError

__all__ = ["append_loss", "LOSS_KINDS", "REDUCTIONS"]

LOSS_KINDS = ("crossentropy", "nll", "mse", "l1", "bcewithlogits")
REDUCTIONS = ("mean", "sum", "none")

# Spellings accepted for each kind, after lower-casing and dropping '_', '-', ' ' and a
# trailing 'loss' (so torch's "cross_entropy", "CrossEntropyLoss", "nll_loss", "NLLLoss",
# "mse_loss", "MSELoss", "l1_loss", "L1Loss", "BCEWithLogitsLoss" and
# "binary_cross_entropy_with_logits" all resolve).
_ALIASES = {
    "crossentropy": "crossentropy",
    "ce": "crossentropy",
    "softmaxcrossentropy": "crossentropy",
    "nll": "nll",
    "negativeloglikelihood": "nll",
    "mse": "mse",
    "l2": "mse",
    "l1": "l1",
    "mae": "l1",
    "bcewithlogits": "bcewithlogits",
    "binarycrossentropywithlogits": "bcewithlogits",
}

_CLASS_KINDS = ("crossentropy", "nll")
_FLOAT_NP = {
    TensorProto.FLOAT: np.float32,
    TensorProto.DOUBLE: np.float64,
    TensorProto.FLOAT16: np.float16,
}
_FLOATS = FLOAT_TENSOR_TYPES


def _kind(kind) -> str:
    if not isinstance(kind, str):
        raise InvalidArgumentError(f"kind must be a string, one of {', '.join(LOSS_KINDS)}; got {kind!r}")
    key = "".join(ch for ch in kind.lower() if ch not in "_- ")
    if key not in _ALIASES and key.endswith("loss"):
        key = key[: -len("loss")]
    if key not in _ALIASES:
        raise InvalidArgumentError(
            f"unknown loss kind {kind!r}; use one of {', '.join(LOSS_KINDS)} "
            "(torch names such as 'cross_entropy', 'NLLLoss', 'mse_loss', 'L1Loss', "
            "'BCEWithLogitsLoss' are accepted too)"
        )
    return _ALIASES[key]


def _reduction(reduction) -> str:
    r = reduction.lower() if isinstance(reduction, str) else reduction
    if r not in REDUCTIONS:
        raise InvalidArgumentError(f"unknown reduction {reduction!r}; use one of {', '.join(REDUCTIONS)}")
    return r


def _all_names(graph: onnx.GraphProto) -> set[str]:
    names = {v.name for v in graph.input} | {v.name for v in graph.output}
    names |= {t.name for t in graph.initializer} | {t.name for t in graph.sparse_initializer}
    names |= {v.name for v in graph.value_info}
    for node in graph.node:
        names.update(n for n in node.output if n)
        names.update(n for n in node.input if n)
    return names


def _type_of(proto: onnx.ModelProto, name: str) -> onnx.TypeProto | None:
    """The declared type of ``name``, from the graph's outputs/inputs/value_info, else inferred."""
    graph = proto.graph
    for vi in list(graph.output) + list(graph.input) + list(graph.value_info):
        if vi.name == name and vi.type.tensor_type.elem_type:
            return vi.type
    for t in graph.initializer:
        if t.name == name:
            return helper.make_tensor_type_proto(t.data_type, list(t.dims))
    try:  # a value only the nodes know: ask shape inference (on a copy)
        inferred = onnx.shape_inference.infer_shapes(proto)
    except Exception:
        return None
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
        if vi.name == name and vi.type.tensor_type.elem_type:
            return vi.type
    return None


def _dims(type_proto: onnx.TypeProto):
    """The shape's dims (TensorShapeProto.Dimension list), or None when the rank is unknown."""
    tt = type_proto.tensor_type
    return list(tt.shape.dim) if tt.HasField("shape") else None


def _tensor_type(elem: int, dims) -> onnx.TypeProto:
    t = onnx.TypeProto()
    t.tensor_type.elem_type = elem
    if dims is not None:
        t.tensor_type.shape.SetInParent()
        for d in dims:
            t.tensor_type.shape.dim.add().CopyFrom(d)
    return t


def _value_info(name: str, type_proto: onnx.TypeProto) -> onnx.ValueInfoProto:
    vi = onnx.ValueInfoProto()
    vi.name = name
    vi.type.CopyFrom(type_proto)
    return vi


def _scalar_dims():
    return []


class _Nodes:
    """Appends nodes with fresh names ``<loss>/<tag>`` that clash with nothing in the model."""

    def __init__(self, graph: onnx.GraphProto, prefix: str, taken: set[str], opset: int, elem: int):
        self.graph, self.prefix, self.taken, self.opset, self.elem = graph, prefix, taken, opset, elem

    def fresh(self, tag: str) -> str:
        base = f"{self.prefix}/{tag}"
        name, i = base, 1
        while name in self.taken:
            name, i = f"{base}_{i}", i + 1
        self.taken.add(name)
        return name

    def op(self, op_type: str, *inputs: str, out: str | None = None, n_out: int = 1, **attrs):
        outs = [out or self.fresh(op_type.lower())] + [self.fresh(op_type.lower()) for _ in range(n_out - 1)]
        self.graph.node.append(helper.make_node(op_type, list(inputs), outs, name=self.fresh(op_type), **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, value, tag: str = "const", elem: int | None = None) -> str:
        """A Constant node holding ``value`` (the loss's float type unless ``elem`` says)."""
        elem = self.elem if elem is None else elem
        if elem == TensorProto.BFLOAT16:  # no numpy bfloat16: float32 constant, then Cast
            return self.op("Cast", self.const(value, tag, TensorProto.FLOAT), to=TensorProto.BFLOAT16)
        arr = np.asarray(value, dtype=helper.tensor_dtype_to_np_dtype(elem))
        name = self.fresh(tag)
        self.graph.node.append(helper.make_node(
            "Constant", [], [name], name=self.fresh("Constant"), value=numpy_helper.from_array(arr, name)))
        return name

    def reduce(self, op_type: str, x: str, axes: Sequence[int] | None, keepdims: int, out: str | None = None) -> str:
        """Reduce over ``axes`` (all axes when None), axes as an input from opset 18
        (ReduceSum from 13), as an attribute before."""
        if axes is None:
            return self.op(op_type, x, out=out, keepdims=keepdims)
        axes_as_input = self.opset >= (13 if op_type == "ReduceSum" else 18)
        if axes_as_input:
            return self.op(op_type, x, self.const(list(axes), "axes", TensorProto.INT64), out=out, keepdims=keepdims)
        return self.op(op_type, x, out=out, axes=list(axes), keepdims=keepdims)


def _as_initializer(value, name: str, elem: int, what: str) -> onnx.TensorProto:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{what} must be an array of numbers: {exc}") from exc
    if elem == TensorProto.BFLOAT16:
        t = helper.make_tensor(name, TensorProto.BFLOAT16, arr.shape, arr.astype(np.float32).ravel().tolist())
        return t
    return numpy_helper.from_array(arr.astype(_FLOAT_NP[elem]), name)


def _check_broadcast(arr_shape, dims, what: str) -> None:
    if dims is None or any(not d.HasField("dim_value") for d in dims):
        return
    out_shape = tuple(d.dim_value for d in dims)
    try:
        full = np.broadcast_shapes(tuple(arr_shape), out_shape)
    except ValueError:
        full = None
    if full != out_shape:
        raise InvalidArgumentError(
            f"{what} has shape {list(arr_shape)}, which does not broadcast to the output's shape {list(out_shape)}"
        )


def append_loss(
    model,
    kind: str,
    output: str,
    *,
    target_name: str = "target",
    loss_name: str = "loss",
    reduction: str = "mean",
    weight=None,
    ignore_index: int | None = None,
    pos_weight=None,
    label_smoothing: float = 0.0,
) -> onnx.ModelProto:
    """A copy of ``model`` with a loss on its output ``output``.

    ``model`` is bytes, a path or an onnx.ModelProto (never modified). Adds the graph input
    ``target_name`` (int64 class indices [N] or [N, d1..] for crossentropy/nll; the type
    and shape of ``output`` for mse/l1/bcewithlogits) and the graph output ``loss_name``
    (a float scalar, or the unreduced tensor for reduction="none"), after the model's own
    outputs. ``weight`` (crossentropy/nll: per-class, shape [C]; bcewithlogits: broadcast
    to the output) becomes the initializer ``<loss_name>.class_weight``; ``pos_weight``
    (bcewithlogits, broadcast along the last axis) the initializer ``<loss_name>.pos_weight``.
    ``ignore_index`` (crossentropy/nll) drops targets with that value; ``label_smoothing``
    (crossentropy) is torch's.

    >>> m = append_loss(model, "cross_entropy", "logits", weight=[1.0, 2.0, 0.5])
    >>> GradientGraphBuilder(m, weights=["W"], outputs=["loss"], loss="loss").build()
    """
    kind = _kind(kind)
    reduction = _reduction(reduction)
    for what, name in (("output", output), ("target_name", target_name), ("loss_name", loss_name)):
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"{what} must be a non-empty string, got {name!r}")
    if target_name == loss_name:
        raise InvalidArgumentError(f"target_name and loss_name are both '{loss_name}'; give them different names")
    classes = kind in _CLASS_KINDS
    if ignore_index is not None:
        if not classes:
            raise InvalidArgumentError(
                f"ignore_index applies to class-index targets (crossentropy, nll), not to '{kind}', "
                "whose target is a float tensor"
            )
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer)):
            raise InvalidArgumentError(f"ignore_index must be an integer, got {ignore_index!r}")
    if weight is not None and kind in ("mse", "l1"):
        raise InvalidArgumentError(f"'{kind}' takes no weight (torch's F.{kind}_loss has none)")
    if pos_weight is not None and kind != "bcewithlogits":
        raise InvalidArgumentError(f"pos_weight applies to bcewithlogits only, not to '{kind}'")
    label_smoothing = float(label_smoothing or 0.0)
    if label_smoothing:
        if kind != "crossentropy":
            raise InvalidArgumentError(f"label_smoothing applies to crossentropy only, not to '{kind}'")
        if not 0.0 <= label_smoothing <= 1.0:
            raise InvalidArgumentError(f"label_smoothing must lie in [0, 1], got {label_smoothing}")

    proto = modelio.load_proto(model)
    modelio.add_default_opset(proto)
    opset = modelio.default_opset(proto)
    if classes and opset < 13:
        # SoftmaxCrossEntropyLoss / NegativeLogLikelihoodLoss need opset 12 (13 for bfloat16
        # and ReduceSum's axes input); upgrade the model as GradientGraphBuilder would anyway.
        try:
            proto = onnx.version_converter.convert_version(proto, 13)
        except Exception as exc:
            raise InvalidModelError(
                f"the model uses ai.onnx opset {opset}; '{kind}' needs opset 13 or newer and onnx's "
                f"version converter could not upgrade it: {exc}"
            ) from exc
        opset = 13
    graph = proto.graph

    out_type = _type_of(proto, output)
    if out_type is None:
        outputs = [o.name for o in graph.output]
        if output not in _all_names(graph):
            raise InvalidArgumentError(
                f"output: no value named '{output}' in the model; its outputs are {outputs}"
            )
        raise InvalidArgumentError(
            f"output '{output}' has no known type (declare it as a typed graph output)"
        )
    if not out_type.HasField("tensor_type"):
        raise InvalidArgumentError(f"output '{output}' is not a tensor")
    elem = out_type.tensor_type.elem_type
    if elem not in _FLOATS:
        raise InvalidArgumentError(
            f"output '{output}' has type {TensorProto.DataType.Name(elem)}; a loss reads a float tensor "
            "(float16, bfloat16, float32 or float64)"
        )
    dims = _dims(out_type)
    if kind == "nll":
        _warn_if_probabilities(graph, output)

    taken = _all_names(graph)
    for what, name in (("loss_name", loss_name), ("target_name", target_name)):
        if name in taken:
            raise InvalidArgumentError(
                f"{what}: the model already has a value named '{name}'; choose another {what}"
            )
    weight_name, pos_weight_name = f"{loss_name}.class_weight", f"{loss_name}.pos_weight"
    for name, given in ((weight_name, weight), (pos_weight_name, pos_weight)):
        if given is not None and name in taken:
            raise InvalidArgumentError(f"the model already has a value named '{name}'; choose another loss_name")
    if classes and dims is not None and len(dims) < 2:
        raise InvalidArgumentError(
            f"'{kind}' reads scores shaped [N, C] or [N, C, d1..]; output '{output}' has rank {len(dims)}"
        )
    taken |= {loss_name, target_name, weight_name, pos_weight_name}

    # Target input
    if classes:
        target_dims = None if dims is None else [dims[0]] + dims[2:]
        target_type = _tensor_type(TensorProto.INT64, target_dims)
    else:
        target_dims = dims
        target_type = _tensor_type(elem, dims)
    graph.input.append(_value_info(target_name, target_type))

    # Weights as initializers
    if weight is not None:
        init = _as_initializer(weight, weight_name, elem, "weight")
        if classes:
            if len(init.dims) != 1:
                raise InvalidArgumentError(f"weight is per class, shape [C]; got shape {list(init.dims)}")
            if dims is not None and dims[1].HasField("dim_value") and dims[1].dim_value != init.dims[0]:
                raise InvalidArgumentError(
                    f"weight has {init.dims[0]} entries but output '{output}' has {dims[1].dim_value} classes"
                )
        else:
            _check_broadcast(init.dims, dims, "weight")
        graph.initializer.append(init)
    if pos_weight is not None:
        init = _as_initializer(pos_weight, pos_weight_name, elem, "pos_weight")
        _check_broadcast(init.dims, dims, "pos_weight")
        graph.initializer.append(init)

    e = _Nodes(graph, loss_name, taken, opset, elem)
    if kind in _CLASS_KINDS:
        _class_loss(e, kind, output, target_name, loss_name, reduction,
                    weight_name if weight is not None else None, ignore_index, label_smoothing, dims)
    else:
        _elementwise_loss(e, kind, output, target_name, loss_name, reduction,
                          weight_name if weight is not None else None,
                          pos_weight_name if pos_weight is not None else None)

    loss_dims = target_dims if reduction == "none" else _scalar_dims()
    graph.output.append(_value_info(loss_name, _tensor_type(elem, loss_dims)))
    return proto


# ops that pass probabilities on as probabilities
_SAME_VALUES = ("Identity", "Cast", "Reshape", "Flatten", "Squeeze", "Unsqueeze")


def _warn_if_probabilities(graph: onnx.GraphProto, output: str) -> None:
    """nll reads log-probabilities; on a Softmax's output it would train on -p instead of -log p."""
    producer = {o: n for n in graph.node for o in n.output if o}
    node = producer.get(output)
    while node is not None and node.op_type in _SAME_VALUES and node.domain in ("", "ai.onnx") and node.input:
        node = producer.get(node.input[0])
    if node is None or node.op_type != "Softmax" or node.domain not in ("", "ai.onnx"):
        return
    where = f"Softmax node '{node.name}'" if node.name else "a Softmax node"
    compat.warn(f"loss 'nll' expects log-probabilities (as torch's F.nll_loss), but output '{output}' holds the "
                f"probabilities of {where}: it would train on -p[target], not -log p[target]. Use loss "
                f"'crossentropy' on the Softmax's input '{node.input[0]}' (the loss output; it applies log-softmax "
                "itself), or make the model output LogSoftmax")


def _class_loss(e: _Nodes, kind, scores, target, loss, reduction, weight, ignore_index, smoothing, dims):
    attrs = {"reduction": reduction if not smoothing else "none"}
    if ignore_index is not None:
        attrs["ignore_index"] = int(ignore_index)
    inputs = [scores, target] + ([weight] if weight else [])
    op_type = "SoftmaxCrossEntropyLoss" if kind == "crossentropy" else "NegativeLogLikelihoodLoss"
    if not smoothing:
        e.op(op_type, *inputs, out=loss, **attrs)
        return
    # torch: (1 - eps) * nll + eps/C * smooth, smooth = -sum_c w_c*log_prob[:, c] (0 where
    # the target is ignored), both reduced over the kept targets (mean: / sum of w[target]).
    if dims is None:
        raise InvalidArgumentError("label_smoothing needs the output's rank to be known")
    n_classes = e.op("Gather", e.op("Shape", scores), e.const(1, "class_axis", TensorProto.INT64), axis=0)
    nll, log_prob = e.op(op_type, *inputs, n_out=2, **attrs)
    weighted = log_prob
    if weight:
        w = weight
        if len(dims) > 2:
            w = e.op("Unsqueeze", w, e.const(list(range(1, len(dims) - 1)), "axes", TensorProto.INT64))
        weighted = e.op("Mul", log_prob, w)
    smooth = e.op("Neg", e.reduce("ReduceSum", weighted, [1], keepdims=0))
    keep = None
    if ignore_index is not None:
        ignored = e.op("Equal", target, e.const(int(ignore_index), "ignore_index", TensorProto.INT64))
        smooth = e.op("Where", ignored, e.const(0.0, "zero"), smooth)
        keep = e.op("Not", ignored)
    eps = e.op("Div", e.const(smoothing, "eps"), e.op("CastLike", n_classes, smooth))
    per = e.op("Add", e.op("Mul", e.const(1.0 - smoothing, "one_minus_eps"), nll), e.op("Mul", eps, smooth))
    if reduction == "none":
        e.op("Identity", per, out=loss)
        return
    total = e.reduce("ReduceSum", per, None, keepdims=0)
    if reduction == "sum":
        e.op("Identity", total, out=loss)
        return
    if weight:
        safe = target if keep is None else e.op("Where", keep, target, e.const(0, "zero_class", TensorProto.INT64))
        kept_w = e.op("Gather", weight, safe, axis=0)
        if keep is not None:
            kept_w = e.op("Mul", kept_w, e.op("CastLike", keep, kept_w))
        denom = e.reduce("ReduceSum", kept_w, None, keepdims=0)
    elif keep is not None:
        denom = e.reduce("ReduceSum", e.op("CastLike", keep, smooth), None, keepdims=0)
    else:
        denom = e.op("CastLike", e.op("Size", target), smooth)
    e.op("Div", total, denom, out=loss)


def _elementwise_loss(e: _Nodes, kind, x, target, loss, reduction, weight, pos_weight):
    if kind == "mse":
        diff = e.op("Sub", x, target)
        per = e.op("Mul", diff, diff)
    elif kind == "l1":
        per = e.op("Abs", e.op("Sub", x, target))
    else:  # bcewithlogits
        # log(1 + exp(-|x|)) + relu(-x) = log(1 + exp(-x)), without overflow
        softplus_neg = e.op("Add", e.op("Log", e.op("Add", e.const(1.0, "one"), e.op("Exp", e.op("Neg", e.op("Abs", x))))),
                            e.op("Relu", e.op("Neg", x)))
        one_minus_t = e.op("Sub", e.const(1.0, "one"), target)
        if pos_weight:
            log_weight = e.op("Add", e.const(1.0, "one"),
                              e.op("Mul", e.op("Sub", pos_weight, e.const(1.0, "one")), target))
            softplus_neg = e.op("Mul", log_weight, softplus_neg)
        per = e.op("Add", e.op("Mul", one_minus_t, x), softplus_neg)
        if weight:
            per = e.op("Mul", per, weight)
    if reduction == "none":
        e.op("Identity", per, out=loss)
    elif reduction == "sum":
        e.reduce("ReduceSum", per, None, keepdims=0, out=loss)
    else:
        e.reduce("ReduceMean", per, None, keepdims=0, out=loss)
