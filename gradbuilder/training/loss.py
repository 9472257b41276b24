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
causal_lm           transformers' causal-LM loss: logits        int64 [N, S]: the tokens,
                    [N, S, V] at t against labels at t + 1      -100 where not scored
==================  ==========================================  ==========================

causal_lm is crossentropy on shifted positions (logits[:, :-1] against labels[:, 1:], the
vocabulary axis moved to 1), ignore_index -100 by default, as transformers' ``*ForCausalLM``
computes it from ``labels``: padding and prompt tokens given as -100 count for nothing.

crossentropy and nll use ONNX's SoftmaxCrossEntropyLoss / NegativeLogLikelihoodLoss, which
define weight, ignore_index and reduction as torch does (the weighted mean divides by the
sum of the weights of the kept targets). bcewithlogits uses the overflow-free form

    loss = (1 - t)*x + (1 + (pos_weight - 1)*t) * (log(1 + exp(-|x|)) + relu(-x))

times ``weight``, as torch does. The model given is never modified; the result is a new
ModelProto with the model's outputs first and the loss last. The blocks are written with the
compiler's ``Emitter`` over ``onnx_ir`` (names, constants and opset-aware reductions as
everywhere else), their nodes named ``<loss_name>/<Op>_node``.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.version_converter
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from .. import compat
from ..compiler import modelio
from ..compiler.emitter import Emitter
from ..dtypes import FLOAT_TENSOR_TYPES
from ..errors import InvalidArgumentError, InvalidModelError

__all__ = ["append_loss", "LOSS_KINDS", "REDUCTIONS"]

LOSS_KINDS = ("crossentropy", "nll", "mse", "l1", "bcewithlogits", "causal_lm")
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
    "causallm": "causal_lm",
}

_CLASS_KINDS = ("crossentropy", "nll", "causal_lm")
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
    kind, reduction = _kind(kind), _reduction(reduction)
    label_smoothing = _check_options(kind, output, target_name, loss_name, weight, ignore_index, pos_weight,
                                     label_smoothing)
    proto = _with_loss_opset(modelio.load_proto(model), kind)
    out_type = _output_type(proto, output)
    dims = _dims(out_type)
    if kind == "nll":
        _warn_if_probabilities(proto.graph, output)
    _check_names(proto.graph, kind, output, dims, target_name, loss_name, weight, pos_weight)
    opset = modelio.default_opset(proto)
    initializers = _loss_initializers(kind, output, out_type, loss_name, weight, pos_weight)
    target_type = _target_type(kind, out_type)

    ir_model = modelio.to_ir(proto)
    del proto
    graph = ir_model.graph
    target = _graph_input(target_name, target_type)
    graph.inputs.append(target)
    weights = {}
    for key, tensor in initializers.items():
        weights[key] = _graph_initializer(tensor)
        graph.register_initializer(weights[key])
    e = Emitter(graph, opset, scope=f"{loss_name}/")
    e.reserve(loss_name)
    x, dtype = _value_named(graph, output), ir.DataType(out_type.tensor_type.elem_type)
    if kind == "causal_lm":
        scores, labels = _shifted(e, x, target)
        loss = _class_loss(e, "crossentropy", scores, labels, dtype, reduction, None,
                           -100 if ignore_index is None else ignore_index, label_smoothing, [None] * 3)
    elif kind in _CLASS_KINDS:
        loss = _class_loss(e, kind, x, target, dtype, reduction, weights.get("weight"), ignore_index, label_smoothing,
                           dims)
    else:
        loss = _elementwise_loss(e, kind, x, target, dtype, reduction, weights.get("weight"), weights.get("pos_weight"))
    for node in e.nodes:  # no value_info for the block's values: the runtime infers them
        for v in node.outputs:
            v.type, v.shape = None, None
    loss.name = loss_name
    loss.type = ir.TensorType(dtype)
    loss.shape = (ir.Shape([]) if reduction != "none" else None if kind == "causal_lm"
                  else ir.serde.deserialize_type_proto_for_shape(target_type))
    graph.outputs.append(loss)
    return ir.to_proto(ir_model)


def _check_options(kind, output, target_name, loss_name, weight, ignore_index, pos_weight, label_smoothing) -> float:
    """Refuse the options ``kind`` does not take; returns ``label_smoothing`` as a float."""
    for what, name in (("output", output), ("target_name", target_name), ("loss_name", loss_name)):
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"{what} must be a non-empty string, got {name!r}")
    if target_name == loss_name:
        raise InvalidArgumentError(f"target_name and loss_name are both '{loss_name}'; give them different names")
    if ignore_index is not None:
        if kind not in _CLASS_KINDS:
            raise InvalidArgumentError(
                f"ignore_index applies to class-index targets (crossentropy, nll), not to '{kind}', "
                "whose target is a float tensor"
            )
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer)):
            raise InvalidArgumentError(f"ignore_index must be an integer, got {ignore_index!r}")
    if weight is not None and kind in ("mse", "l1"):
        raise InvalidArgumentError(f"'{kind}' takes no weight (torch's F.{kind}_loss has none)")
    if weight is not None and kind == "causal_lm":
        raise InvalidArgumentError("'causal_lm' takes no weight (transformers' causal-LM loss has none)")
    if pos_weight is not None and kind != "bcewithlogits":
        raise InvalidArgumentError(f"pos_weight applies to bcewithlogits only, not to '{kind}'")
    label_smoothing = float(label_smoothing or 0.0)
    if label_smoothing:
        if kind != "crossentropy":
            raise InvalidArgumentError(f"label_smoothing applies to crossentropy only, not to '{kind}'")
        if not 0.0 <= label_smoothing <= 1.0:
            raise InvalidArgumentError(f"label_smoothing must lie in [0, 1], got {label_smoothing}")
    return label_smoothing


def _with_loss_opset(proto: onnx.ModelProto, kind: str) -> onnx.ModelProto:
    """``proto`` with an ai.onnx opset the loss's operators exist in."""
    modelio.add_default_opset(proto)
    opset = modelio.default_opset(proto)
    if kind not in _CLASS_KINDS or opset >= 13:
        return proto
    # SoftmaxCrossEntropyLoss / NegativeLogLikelihoodLoss need opset 12 (13 for bfloat16 and
    # ReduceSum's axes input); upgrade the model as GradientGraphBuilder would anyway.
    try:
        return onnx.version_converter.convert_version(proto, 13)
    except Exception as exc:
        raise InvalidModelError(
            f"the model uses ai.onnx opset {opset}; '{kind}' needs opset 13 or newer and onnx's "
            f"version converter could not upgrade it: {exc}"
        ) from exc


def _output_type(proto: onnx.ModelProto, output: str) -> onnx.TypeProto:
    """The type of ``output``, a float tensor; an error naming what is wrong otherwise."""
    out_type = _type_of(proto, output)
    if out_type is None:
        outputs = [o.name for o in proto.graph.output]
        if output not in _all_names(proto.graph):
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
    return out_type


def _check_names(graph: onnx.GraphProto, kind, output, dims, target_name, loss_name, weight, pos_weight) -> None:
    """The names the loss adds are free, and a class loss reads scores of rank 2 or more."""
    taken = _all_names(graph)
    for what, name in (("loss_name", loss_name), ("target_name", target_name)):
        if name in taken:
            raise InvalidArgumentError(
                f"{what}: the model already has a value named '{name}'; choose another {what}"
            )
    for name, given in ((f"{loss_name}.class_weight", weight), (f"{loss_name}.pos_weight", pos_weight)):
        if given is not None and name in taken:
            raise InvalidArgumentError(f"the model already has a value named '{name}'; choose another loss_name")
    if kind == "causal_lm" and dims is not None and len(dims) != 3:
        raise InvalidArgumentError(f"'causal_lm' reads logits shaped [N, S, V]; output '{output}' has rank {len(dims)}")
    if kind in _CLASS_KINDS and dims is not None and len(dims) < 2:
        raise InvalidArgumentError(
            f"'{kind}' reads scores shaped [N, C] or [N, C, d1..]; output '{output}' has rank {len(dims)}"
        )


def _target_type(kind: str, out_type: onnx.TypeProto) -> onnx.TypeProto:
    """Class indices (int64, the scores' shape less the class axis), or the output's type."""
    dims = _dims(out_type)
    if kind == "causal_lm":
        return _tensor_type(TensorProto.INT64, None if dims is None else dims[:-1])
    if kind in _CLASS_KINDS:
        return _tensor_type(TensorProto.INT64, None if dims is None else [dims[0]] + dims[2:])
    return _tensor_type(out_type.tensor_type.elem_type, dims)


def _loss_initializers(kind, output, out_type, loss_name, weight, pos_weight) -> dict[str, onnx.TensorProto]:
    """``weight`` and ``pos_weight`` as initializers of the output's type, checked against its
    shape: {"weight": ..., "pos_weight": ...} for those given."""
    elem, dims = out_type.tensor_type.elem_type, _dims(out_type)
    out = {}
    if weight is not None:
        init = _as_initializer(weight, f"{loss_name}.class_weight", elem, "weight")
        if kind in _CLASS_KINDS:
            if len(init.dims) != 1:
                raise InvalidArgumentError(f"weight is per class, shape [C]; got shape {list(init.dims)}")
            if dims is not None and dims[1].HasField("dim_value") and dims[1].dim_value != init.dims[0]:
                raise InvalidArgumentError(
                    f"weight has {init.dims[0]} entries but output '{output}' has {dims[1].dim_value} classes"
                )
        else:
            _check_broadcast(init.dims, dims, "weight")
        out["weight"] = init
    if pos_weight is not None:
        init = _as_initializer(pos_weight, f"{loss_name}.pos_weight", elem, "pos_weight")
        _check_broadcast(init.dims, dims, "pos_weight")
        out["pos_weight"] = init
    return out


def _graph_input(name: str, type_proto: onnx.TypeProto) -> ir.Value:
    return ir.Value(name=name, type=ir.serde.deserialize_type_proto_for_type(type_proto),
                    shape=ir.serde.deserialize_type_proto_for_shape(type_proto))


def _graph_initializer(tensor: onnx.TensorProto) -> ir.Value:
    value = ir.serde.deserialize_tensor(tensor)
    return ir.Value(name=tensor.name, type=ir.TensorType(value.dtype), shape=ir.Shape(list(tensor.dims)),
                    const_value=value)


def _value_named(graph: ir.Graph, name: str) -> ir.Value:
    for v in graph.inputs:
        if v.name == name:
            return v
    if name in graph.initializers:
        return graph.initializers[name]
    return next(o for node in graph for o in node.outputs if o.name == name)


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


def _shifted(e: Emitter, logits: ir.Value, tokens: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(the logits of positions 0..S-2 as [N, V, S-1], the labels of positions 1..S-1): each
    position scored against the next token."""
    scores = e.Transpose(e.Slice(logits, e.ints([0]), e.ints([-1]), e.ints([1])), perm=[0, 2, 1])
    labels = e.Slice(tokens, e.ints([1]), e.ints([np.iinfo(np.int64).max]), e.ints([1]))
    return scores, labels


def _class_loss(e: Emitter, kind, scores, target, dtype: ir.DataType, reduction, weight, ignore_index, smoothing,
                dims) -> ir.Value:
    op_type = "SoftmaxCrossEntropyLoss" if kind == "crossentropy" else "NegativeLogLikelihoodLoss"
    attrs = {"reduction": reduction if not smoothing else "none",
             "ignore_index": int(ignore_index) if ignore_index is not None else None}
    inputs = [scores, target] + ([weight] if weight is not None else [])
    if not smoothing:
        return e.op(op_type, *inputs, **attrs)
    # torch: (1 - eps) * nll + eps/C * smooth, smooth = -sum_c w_c*log_prob[:, c] (0 where
    # the target is ignored), both reduced over the kept targets (mean: / sum of w[target]).
    if dims is None:
        raise InvalidArgumentError("label_smoothing needs the output's rank to be known")

    def const(x):
        return e.const(np.array(x), dtype=dtype)

    n_classes = e.Gather(e.Shape(scores), e.ints(1), axis=0)
    nll, log_prob = e.op(op_type, *inputs, outputs=2, **attrs)
    weighted = log_prob
    if weight is not None:
        w = e.Unsqueeze(weight, list(range(1, len(dims) - 1))) if len(dims) > 2 else weight
        weighted = e.Mul(log_prob, w)
    smooth = e.Neg(e.reduce("ReduceSum", weighted, [1], keepdims=False))
    keep = None
    if ignore_index is not None:
        ignored = e.Equal(target, e.ints(int(ignore_index)))
        smooth = e.Where(ignored, const(0.0), smooth)
        keep = e.Not(ignored)
    eps = e.Div(const(smoothing), e.Cast(n_classes, to=int(dtype)))
    per = e.Add(e.Mul(const(1.0 - smoothing), nll), e.Mul(eps, smooth))
    if reduction == "none":
        return e.Identity(per)
    total = e.reduce("ReduceSum", per, None, keepdims=False)
    if reduction == "sum":
        return e.Identity(total)
    if weight is not None:
        safe = target if keep is None else e.Where(keep, target, e.ints(0))
        kept_w = e.Gather(weight, safe, axis=0)
        if keep is not None:
            kept_w = e.Mul(kept_w, e.Cast(keep, to=int(dtype)))
        denom = e.reduce("ReduceSum", kept_w, None, keepdims=False)
    elif keep is not None:
        denom = e.reduce("ReduceSum", e.Cast(keep, to=int(dtype)), None, keepdims=False)
    else:
        denom = e.Cast(e.Size(target), to=int(dtype))
    return e.Div(total, denom)


def _elementwise_loss(e: Emitter, kind, x, target, dtype: ir.DataType, reduction, weight, pos_weight) -> ir.Value:
    if kind == "mse":
        diff = e.Sub(x, target)
        per = e.Mul(diff, diff)
    elif kind == "l1":
        per = e.Abs(e.Sub(x, target))
    else:  # bcewithlogits
        # log(1 + exp(-|x|)) + relu(-x) = log(1 + exp(-x)), without overflow
        one = e.const(np.array(1.0), dtype=dtype)
        softplus_neg = e.Add(e.Log(e.Add(one, e.Exp(e.Neg(e.Abs(x))))), e.Relu(e.Neg(x)))
        one_minus_t = e.Sub(one, target)
        if pos_weight is not None:
            softplus_neg = e.Mul(e.Add(one, e.Mul(e.Sub(pos_weight, one), target)), softplus_neg)
        per = e.Add(e.Mul(one_minus_t, x), softplus_neg)
        if weight is not None:
            per = e.Mul(per, weight)
    if reduction == "none":
        return e.Identity(per)
    return e.reduce("ReduceSum" if reduction == "sum" else "ReduceMean", per, None, keepdims=False)
