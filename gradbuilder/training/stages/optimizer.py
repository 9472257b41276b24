"""The optimizers, appended after the gradients as the update in standard ONNX operators.

Numerics follow ``torch.optim`` step for step. The update reads two graph inputs shared by
every weight, the learning rate (``lr_name``, float scalar) and the number of updates done so
far (``step_name``, int64 scalar; torch's ``step`` is this plus one), and per weight its
state tensors as inputs named ``<weight>.<state>``; it returns ``<weight>.updated``,
``<weight>.<state>.updated`` and ``<step_name>.updated``.

Each optimizer is one entry of OPTIMIZERS (an :class:`Optimizer`: its options with their
defaults, the states one weight carries, their first value, and the step), registered next
to its step function below. TrainingParameters, generate_artifacts and the command line
read their names and options from it: adding an optimizer is writing its step and its entry.

numpy and onnx_ir are imported where the update is built: the command line's help lists
the optimizers without loading them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ...errors import InvalidArgumentError
from ...interface import state_of, updated
from . import Appended


@dataclasses.dataclass(frozen=True)
class Optimizer:
    name: str
    torch: str  # the torch.optim class whose numerics the step follows
    defaults: dict  # every option, with its default
    states: Callable[[dict], list[str]]  # options -> the state tensors one weight carries
    step: Callable  # (e, w, g, lr, t, states, options, k) -> (new weight, {state: new value})
    fills: Callable[[dict], float] = lambda options: 0.0  # options -> every state's first value


OPTIMIZERS: dict[str, Optimizer] = {}


def register(optimizer: Optimizer) -> Optimizer:
    OPTIMIZERS[optimizer.name] = optimizer
    return optimizer


def state_names(name: str, options: dict) -> list[str]:
    """The state tensors one weight carries under optimizer ``name``."""
    return OPTIMIZERS[name].states(options)


# States that may be stored in half precision (``use_fp16_moments``): the first moments. The
# second moments (exp_avg_sq, max_exp_avg_sq, Adagrad's sum) hold squared gradients, which
# float16 flushes to zero below 6e-8 (|g| < 2.4e-4): the update m / (sqrt(v) + eps) then blows
# up, so they stay in the weight's type.
HALF_STATES = frozenset({"exp_avg", "momentum_buffer"})


def state_dtype_of(state: str, weight_dtype, half):
    """The stored type of ``state``: ``half`` (when given) for HALF_STATES, else the weight's."""
    return half if half is not None and state in HALF_STATES else weight_dtype


def initial_state(name: str, options: dict, weight, half=None) -> dict:
    """Each state's first value, in its stored type (see HALF_STATES; ``half`` a numpy dtype)."""
    return dict(initial_states(name, options, weight, half))


def initial_states(name: str, options: dict, weight, half=None):
    """(state, first value) pairs, each made when it is reached (one weight-sized array at a time)."""
    import numpy as np

    fill = OPTIMIZERS[name].fills(options)
    for s in state_names(name, options):
        yield s, np.full(weight.shape, fill, dtype=state_dtype_of(s, weight.dtype, half))


def jsonable(options: dict) -> dict:
    """Resolved options as JSON data (tuples such as betas as lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()}


def resolve(name: str, options: dict | None) -> dict:
    """``options`` over the optimizer's defaults; unknown names are an error."""
    if name not in OPTIMIZERS:
        raise InvalidArgumentError(f"unknown optimizer '{name}'; choose one of {sorted(OPTIMIZERS)}")
    merged = dict(OPTIMIZERS[name].defaults)
    for key, value in (options or {}).items():
        if key not in merged:
            raise InvalidArgumentError(
                f"optimizer '{name}' has no option '{key}'; its options are {sorted(merged)}")
        merged[key] = value
    return merged


def add_optimizer(e, weights: list, grads: dict, name: str, options: dict, lr_name: str, step_name: str,
                  apply=None, state_dtype=None, per_weight: dict[str, dict] | None = None,
                  gated: frozenset[str] = frozenset()) -> Appended:
    """Append the update of every weight (ir.Values; ``grads`` maps weight name -> gradient).
    ``per_weight`` gives some weights options of their own (as torch's parameter groups);
    the others take ``options``. With ``apply`` (a bool scalar) the update takes effect only
    where it is true: otherwise weights, states and the step count come out unchanged
    (gradient accumulation, skipped steps). With ``state_dtype`` the first moments
    (HALF_STATES) are stored in that type (float16 moments) and computed in the weight's.

    How ``apply`` decides: inside an If (a step that applies pays nothing for the choice), or
    for the weights named in ``gated`` by arithmetic on the device (:class:`Coefficients`: the
    gradient, the learning rate and every coefficient that blends a state are chosen by
    scalar Wheres, so that a skipped update computes exactly the old values), for weights
    whose choice must not read a condition on the host (a flat state's groups: a few tensors,
    no control flow)."""
    import numpy as np
    import onnx_ir as ir

    from ...compiler.passes import named_output, new_input

    options = resolve(name, options)
    lr = new_input(e, lr_name, ir.DataType.FLOAT, [])
    step = new_input(e, step_name, ir.DataType.INT64, [])
    t = e.Add(step, e.const(np.array(1, np.int64)))  # torch's step count after this update
    inputs, olds, owns = [lr, step], [], []
    for w in weights:
        own = resolve(name, (per_weight or {}).get(w.name, options))
        states = {s: new_input(e, state_of(w.name, s), state_dtype_of(s, w.dtype, state_dtype), w.shape)
                  for s in state_names(name, own)}
        inputs.extend(states.values())
        olds.append((w, states))
        owns.append(own)

    def update(u, chosen: list[int], gate=None) -> list:
        """The new weights of ``chosen`` (indices into ``olds``), then their new states,
        emitted by ``u`` (``gate``: the bool ``apply`` the arithmetic chooses by, or None)."""
        done = {}  # weight index -> (new weight, {state: new value})
        for members in _flat_groups(name, [olds[j] for j in chosen], [owns[j] for j in chosen]):
            members = [chosen[j] for j in members]
            (w0, _), own = olds[members[0]], owns[members[0]]
            k = Coefficients(u, w0, gate)
            rate = k.rate(u.CastLike(lr, w0))
            if len(members) == 1:
                w, states = olds[members[0]]
                done[members[0]] = OPTIMIZERS[name].step(
                    u, w, k.gradient(grads[w.name]), rate, u.CastLike(t, w),
                    {s: u.CastLike(v, w) for s, v in states.items()}, own, k)
                continue
            # small weights of one dtype and the same options, updated as one flat tensor:
            # the same element-wise arithmetic in 13 ops instead of 13 per weight
            sizes = [int(np.prod([int(d) for d in olds[j][0].shape], dtype=np.int64)) for j in members]

            def flat(values):  # a vector is joined as it is: a Reshape costs a node on every device
                return u.Concat(*[v if len(v.shape or ()) == 1 else u.Reshape(v, u.ints([-1])) for v in values],
                                axis=0)

            new, new_values = OPTIMIZERS[name].step(
                u, flat([olds[j][0] for j in members]), k.gradient(flat([grads[olds[j][0].name] for j in members])),
                rate, u.CastLike(t, w0),
                {s: flat([u.CastLike(olds[j][1][s], w0) for j in members]) for s in olds[members[0]][1]}, own, k)
            parts = {key: u.split_into(v, len(members), 0, u.ints(sizes)) for key, v in [("w", new), *new_values.items()]}
            for i, j in enumerate(members):
                # each piece back in its shape through a Reshape, a vector's too: a Split output
                # made the updated weight itself, written in place, broke a pipeline stage's step
                shape = u.ints([int(d) for d in olds[j][0].shape])
                done[j] = (u.Reshape(parts["w"][i], shape),
                           {s: u.Reshape(parts[s][i], shape) for s in new_values})
        return ([done[j][0] for j in chosen]
                + [u.CastLike(done[j][1][s], olds[j][1][s]) for j in chosen for s in olds[j][1]])

    def likes_of(chosen: list[int]) -> list:
        return [olds[j][0] for j in chosen] + [olds[j][1][s] for j in chosen for s in olds[j][1]]

    # Where the update may not apply (accumulation micro-steps, a step whose gradients are
    # not finite) it runs inside If(apply): a step that applies pays nothing for the choice,
    # where a Where per weight and state read and wrote every tensor once more (29% of the
    # MLP benchmark's step). The ``gated`` weights (a flat state's groups: a few tensors)
    # choose by arithmetic instead, with no control flow.
    everything = list(range(len(olds)))
    arithmetic = [j for j in everything if apply is not None and olds[j][0].name in gated]
    branched = [j for j in everything if j not in arithmetic]
    news = dict(zip([id(v) for v in likes_of(arithmetic)], update(e, arithmetic, apply)))
    if apply is None:
        news.update(zip([id(v) for v in likes_of(branched)], update(e, branched)))
        count = t
    else:
        if branched:
            likes = likes_of(branched)
            outs = e.if_(apply, lambda u: update(u, branched), lambda u: likes, likes, name="optimizer_update")
            news.update(zip([id(v) for v in likes], outs))
        count = e.Where(apply, t, step)  # after every read of Step (t's): updated in place
    likes = likes_of(everything)
    outputs = [named_output(e, news[id(like)], updated(like.name), like) for like in likes]
    outputs.append(named_output(e, count, updated(step.name), step))
    # inputs: lr, step, then every state; outputs: the weights, the states, the step
    return Appended({}, inputs, outputs)


# Weights of at most this many elements are updated together (a transformer's biases and
# LayerNorm gains: dozens of tensors whose per-op cost outweighs their arithmetic).
FLAT_ELEMENTS = 65536


def _flat_groups(name: str, olds, owns) -> list[list[int]]:
    """The weights' indices in update groups: the small ones (static shape, at most
    FLAT_ELEMENTS elements) with one dtype, the same options and states stored in that dtype
    together (not for LAMB, whose trust ratio is per weight), each other weight alone."""
    import numpy as np

    groups: dict[tuple, list[int]] = {}
    alone = []
    for k, ((w, states), own) in enumerate(zip(olds, owns)):
        dims = list(w.shape) if w.shape is not None else None
        small = (name != "lamb" and dims is not None and all(isinstance(d, int) for d in dims)
                 and int(np.prod(dims, dtype=np.int64)) <= FLAT_ELEMENTS
                 and all(v.dtype == w.dtype for v in states.values()))
        if small:
            key = (w.dtype, repr(sorted(own.items())))
            groups.setdefault(key, []).append(k)
        else:
            alone.append([k])
    return alone + list(groups.values())


def _scalar(e, value: float, like):
    return e.scalar(float(value), like)


class Coefficients:
    """The scalars of one update, in the weight's type. Without a gate each is a constant;
    with ``gate`` (a bool scalar: whether this run updates) a coefficient that moves a state
    (``k(on, off)``) is ``on`` where the gate holds and ``off`` (the value that leaves the
    state exactly as it was) where not, the gradient is zero where not (so that an inf or
    NaN in it reaches nothing) and so is the learning rate: a skipped update computes the
    old weights and states exactly, with no control flow."""

    def __init__(self, e, like, gate=None):
        self.e, self.like, self.gate = e, like, gate

    def __call__(self, on: float, off: float):
        """``on`` as a scalar, or ``off`` where the gate does not hold."""
        value = _scalar(self.e, on, self.like)
        if self.gate is None or on == off:
            return value
        return self.e.Where(self.gate, value, _scalar(self.e, off, self.like))

    def rate(self, lr):
        return lr if self.gate is None else self.e.Where(self.gate, lr, _scalar(self.e, 0.0, self.like))

    def gradient(self, g):
        return g if self.gate is None else self.e.Where(self.gate, g, _scalar(self.e, 0.0, g))

    def only(self, cond):
        """``cond`` and the gate."""
        return cond if self.gate is None else self.e.And(cond, self.gate)


# ----------------------------------------------------------------------------- the steps
# Each returns (updated weight, {state: updated state}); lr and t are cast to w's type, and
# ``k`` (Coefficients) gives each scalar that moves a state, k(value, value when skipped).


def _sgd(e, w, g, lr, t, states, o, k):
    """g += wd w;  buf = g at t = 1, else momentum buf + (1 - dampening) g;
    g = g + momentum buf (nesterov) or buf;  w -= lr g"""
    if o["weight_decay"]:
        g = e.Add(g, e.Mul(k(o["weight_decay"], 0.0), w))
    new = {}
    if o["momentum"]:
        buf = states["momentum_buffer"]
        mu = _scalar(e, o["momentum"], w)
        blended = e.Add(e.Mul(k(o["momentum"], 1.0), buf), e.Mul(_scalar(e, 1.0 - o["dampening"], w), g))
        buf = e.Where(k.only(e.Equal(t, _scalar(e, 1.0, w))), g, blended)
        new["momentum_buffer"] = buf
        g = e.Add(g, e.Mul(mu, buf)) if o["nesterov"] else buf
    return e.Sub(w, e.Mul(lr, g)), new


def _adam(e, w, g, lr, t, states, o, k, decoupled=False):
    """(AdamW: w *= 1 - lr wd)  (Adam: g += wd w)
    m = lerp(m, g, 1 - b1);  v = b2 v + (1 - b2) g^2;  (amsgrad: v_max = max(v_max, v))
    w -= lr / (1 - b1^t) * m / (sqrt(v or v_max) / sqrt(1 - b2^t) + eps)

    computed as w -= s * m / (sqrt(v) + eps sqrt(1 - b2^t)) with the scalar
    s = lr sqrt(1 - b2^t) / (1 - b1^t): one pass over the weight fewer."""
    b1, b2 = (float(b) for b in o["betas"])
    one = _scalar(e, 1.0, w)
    if o["weight_decay"]:
        wd = _scalar(e, o["weight_decay"], w)
        if decoupled:
            w = e.Mul(w, e.Sub(one, e.Mul(lr, wd)))
        else:
            g = e.Add(g, e.Mul(k(o["weight_decay"], 0.0), w))
    m = states["exp_avg"]
    m = e.Add(m, e.Mul(e.Sub(g, m), k(1.0 - b1, 0.0)))
    v = e.Add(e.Mul(k(b2, 1.0), states["exp_avg_sq"]), e.Mul(_scalar(e, 1.0 - b2, w), e.Mul(g, g)))
    new = {"exp_avg": m, "exp_avg_sq": v}
    second = v
    if o["amsgrad"]:
        second = e.Max(states["max_exp_avg_sq"], v)
        new["max_exp_avg_sq"] = second
    bias1, bias2 = _bias_corrections(e, w, t, b1, b2, o["bias_correction"])
    root2 = e.Sqrt(bias2)
    step_size = e.Div(e.Mul(lr, root2), bias1)
    denom = e.Add(e.Sqrt(second), e.Mul(_scalar(e, o["eps"], w), root2))
    return e.Sub(w, e.Mul(e.Div(m, denom), step_size)), new


def _bias_corrections(e, w, t, b1, b2, enabled):
    """(1 - b1^t, 1 - b2^t), or ones without bias correction."""
    one = _scalar(e, 1.0, w)
    if not enabled:
        return one, one
    return e.Sub(one, e.Pow(_scalar(e, b1, w), t)), e.Sub(one, e.Pow(_scalar(e, b2, w), t))


def _lamb(e, w, g, lr, t, states, o, k):
    """LAMB (You et al., 2019), as onnxruntime's LambOptimizer:
    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;  r = m^ / (sqrt(v^) + eps) (bias-corrected
    hats);  u = r + wd w;  ratio = clip(||w|| / ||u||, ratio_min, ratio_max), 1 where either
    norm is 0;  w -= lr ratio u"""
    b1, b2 = (float(b) for b in o["betas"])
    m = e.Add(e.Mul(k(b1, 1.0), states["exp_avg"]), e.Mul(_scalar(e, 1.0 - b1, w), g))
    v = e.Add(e.Mul(k(b2, 1.0), states["exp_avg_sq"]), e.Mul(_scalar(e, 1.0 - b2, w), e.Mul(g, g)))
    bias1, bias2 = _bias_corrections(e, w, t, b1, b2, o["bias_correction"])
    r = e.Div(e.Div(m, bias1), e.Add(e.Sqrt(e.Div(v, bias2)), _scalar(e, o["eps"], w)))
    u = e.Add(r, e.Mul(_scalar(e, o["weight_decay"], w), w)) if o["weight_decay"] else r
    zero = _scalar(e, 0.0, w)
    w_norm = e.Sqrt(e.reduce("ReduceSumSquare", w, None, keepdims=False))
    u_norm = e.Sqrt(e.reduce("ReduceSumSquare", u, None, keepdims=False))
    either_zero = e.Or(e.Equal(w_norm, zero), e.Equal(u_norm, zero))
    ratio = e.Where(either_zero, _scalar(e, 1.0, w), e.Div(w_norm, e.Where(either_zero, _scalar(e, 1.0, w), u_norm)))
    if o["ratio_min"] > float("-inf") or o["ratio_max"] < float("inf"):
        ratio = e.Clip(ratio, _scalar(e, max(o["ratio_min"], -3.0e38), w), _scalar(e, min(o["ratio_max"], 3.0e38), w))
    return e.Sub(w, e.Mul(e.Mul(lr, ratio), u)), {"exp_avg": m, "exp_avg_sq": v}


def _adamw(e, w, g, lr, t, states, o, k):
    return _adam(e, w, g, lr, t, states, o, k, decoupled=True)


def _adagrad(e, w, g, lr, t, states, o, k):
    """g += wd w;  clr = lr / (1 + (t - 1) lr_decay);  sum += g^2;  w -= clr g / (sqrt(sum) + eps)"""
    one = _scalar(e, 1.0, w)
    if o["weight_decay"]:
        g = e.Add(g, e.Mul(k(o["weight_decay"], 0.0), w))
    clr = e.Div(lr, e.Add(one, e.Mul(e.Sub(t, one), _scalar(e, o["lr_decay"], w))))
    total = e.Add(states["sum"], e.Mul(g, g))
    step = e.Div(g, e.Add(e.Sqrt(total), _scalar(e, o["eps"], w)))
    return e.Sub(w, e.Mul(clr, step)), {"sum": total}


# ----------------------------------------------------------------------------- the registry
_ADAM = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False, "bias_correction": True}


def _adam_states(o):
    return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if o["amsgrad"] else [])


register(Optimizer("sgd", "SGD", {"momentum": 0.0, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0},
                   lambda o: ["momentum_buffer"] if o["momentum"] else [], _sgd))
register(Optimizer("adam", "Adam", _ADAM, _adam_states, _adam))  # L2 weight decay
register(Optimizer("adamw", "AdamW", {**_ADAM, "weight_decay": 1e-2}, _adam_states, _adamw))  # decoupled decay
register(Optimizer("lamb", "onnxruntime's LambOptimizer",
                   {"betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.0, "bias_correction": True,
                    "ratio_min": float("-inf"), "ratio_max": float("inf")},
                   lambda o: ["exp_avg", "exp_avg_sq"], _lamb))
register(Optimizer("adagrad", "Adagrad",
                   {"lr_decay": 0.0, "weight_decay": 0.0, "initial_accumulator_value": 0.0, "eps": 1e-10},
                   lambda o: ["sum"], _adagrad, fills=lambda o: o["initial_accumulator_value"]))
