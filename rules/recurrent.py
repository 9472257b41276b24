"""Recurrent layers RNN, GRU and LSTM: backpropagation through time, a Scan over the steps.

Notation (layout 0; layout 1 is transposed in and out): X [T, N, I], W [D, G*H, I],
R [D, G*H, H], B = [Wb, Rb] [D, 2*G*H], initial_h / initial_c [D, N, H], P [D, 3*H],
Y [T, D, N, H], Y_h / Y_c [D, N, H]; G = 1 (RNN), 3 (GRU, gates z r h), 4 (LSTM, gates i o f c).

The backward graph works in *processing order*: every per-step tensor is stacked as
[T, D, N, .] with step k of the reverse direction being time T-1-k, so both directions of a
bidirectional layer share one loop over the steps. The hidden state entering step k (Hp) comes
from the forward node's Y output (re-computed by a second node of the same op when the
forward node has no Y output); all gate pre-activations are then recomputed at once with
one MatMul each, only the LSTM cell state needs a sequential recurrence (a forward Scan).
A reverse Scan carries dS = dL/dH_k (and dCS = dL/dC_k), per step k from the last to the first:

    dHn   = m_k (dS + dY_k)                 gradient of the step's new state
    da    = gate pre-activation gradients   (cell-specific, below)
    dS    = da @ R + (1 - m_k) dS  [+ direct terms]

with m_k the sequence_lens mask (steps past a sequence's length keep the state and write
Y = 0; a zero length gives Y_h = Y_c = 0 as onnxruntime does). Then, over all steps at once,

    dX = sum_d da @ W,   dW = sum_k da_k^T x_k,   dR = sum_k da_k^T h_{k-1},
    dB = [sum da, sum da_R],   d initial_h = dS (after the first step).

Each cell writes one step of its recurrences as a function of that step's values, the body
of the Scan. The sequence length is read at run time, so it may be symbolic or unknown to
shape inference, and one graph serves every length.

``clip`` clips every gate pre-activation (not the cell state), so its derivative is the
mask |a| <= clip. Activations take alpha/beta in order, only the ones that use them
(Affine, LeakyRelu, ThresholdedRelu, ScaledTanh, HardSigmoid, Elu), with onnxruntime's
defaults when the lists run out (LeakyRelu 0.01, HardSigmoid 0.2/0.5, Elu 1.0, others 0).
sequence_lens (int) gets no gradient.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from gradbuilder.errors import GradientRuleError
from gradbuilder.compiler.registry import register
from gradbuilder.compiler.values import attr, dims_of
from gradbuilder.rules.helpers import wants

_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
_DEFAULT_ACTS = {"RNN": ["Tanh"], "GRU": ["Sigmoid", "Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}
# name -> (takes alpha, takes beta, default alpha, default beta), as onnxruntime reads them
_PARAMS = {
    "affine": (True, True, 0.0, 0.0),
    "leakyrelu": (True, False, 0.01, 0.0),
    "thresholdedrelu": (True, False, 0.0, 0.0),
    "scaledtanh": (True, True, 0.0, 0.0),
    "hardsigmoid": (True, True, 0.2, 0.5),
    "elu": (True, False, 1.0, 0.0),
}
_PLAIN = {"tanh", "sigmoid", "relu", "softsign", "softplus"}


# ----------------------------------------------------------------------------- activations


def _activations(n, num_dirs):
    """Per direction, the list of (name, alpha, beta) of the cell's activation slots."""
    per = len(_DEFAULT_ACTS[n.op_type])
    names = attr(n, "activations", None) or _DEFAULT_ACTS[n.op_type] * num_dirs
    alphas = list(attr(n, "activation_alpha", None) or [])
    betas = list(attr(n, "activation_beta", None) or [])
    out = []
    for d in range(num_dirs):
        chosen = names[d * per:(d + 1) * per] if len(names) >= (d + 1) * per else names[:per]
        acts = []
        for name in chosen:
            key = name.lower()
            if key not in _PARAMS and key not in _PLAIN:
                raise GradientRuleError(f"{n.op_type}: unknown activation function {name!r}")
            takes_a, takes_b, alpha, beta = _PARAMS.get(key, (False, False, 0.0, 0.0))
            if takes_a and alphas:
                alpha = float(alphas.pop(0))
            if takes_b and betas:
                beta = float(betas.pop(0))
            acts.append((key, alpha, beta))
        out.append(acts)
    return out


def _act_forward(e, act, x):
    """y = f(x) for one activation (name, alpha, beta)."""
    name, a, b = act
    if name == "tanh":
        return e.Tanh(x)
    if name == "sigmoid":
        return e.Sigmoid(x)
    if name == "relu":
        return e.Relu(x)
    if name == "affine":
        return x * a + b
    if name == "leakyrelu":
        return e.LeakyRelu(x, alpha=a)
    if name == "thresholdedrelu":
        return e.ThresholdedRelu(x, alpha=a)
    if name == "scaledtanh":
        return e.Tanh(x * b) * a
    if name == "hardsigmoid":
        return e.HardSigmoid(x, alpha=a, beta=b)
    if name == "elu":
        return e.Elu(x, alpha=a)
    if name == "softsign":
        return e.Softsign(x)
    return e.Softplus(x)


def _act_derivative(e, act, x, y):
    """f'(x), given y = f(x), shaped like x."""
    name, a, b = act
    s = lambda v: e.scalar(v, like=x)  # noqa: E731
    one = s(1.0)
    if name == "tanh":  # 1 - y^2
        return 1 - y * y
    if name == "sigmoid":  # y (1 - y)
        return y * (1 - y)
    if name == "relu":
        return e.CastLike(e.Greater(x, s(0.0)), x)
    if name == "affine":
        return e.expand_like(s(a), x)
    if name == "leakyrelu":  # x >= 0: 1, else alpha
        return e.Where(e.Less(x, s(0.0)), s(a), one)
    if name == "thresholdedrelu":  # x > alpha: 1
        return e.CastLike(e.Greater(x, s(a)), x)
    if name == "scaledtanh":  # alpha beta (1 - tanh(beta x)^2)
        t = e.Tanh(x * b)
        return (1 - t * t) * (a * b)
    if name == "hardsigmoid":  # alpha where 0 < alpha x + beta < 1
        return e.Where(e.And(e.Greater(y, s(0.0)), e.Less(y, one)), s(a), s(0.0))
    if name == "elu":  # x >= 0: 1, else y + alpha
        return e.Where(e.Less(x, s(0.0)), y + a, one)
    if name == "softsign":  # 1 / (1 + |x|)^2 = (1 - |y|)^2
        t = 1 - e.Abs(y)
        return t * t
    return e.Sigmoid(x)  # softplus


# ----------------------------------------------------------------------------- helpers


def _transposed(e, v, rank=3):
    """The last two axes of ``v`` (of rank ``rank``) swapped."""
    return e.Transpose(v, perm=list(range(rank - 2)) + [rank - 1, rank - 2])


def _masked(e, v, m):
    """m_k v: nothing flows into the steps past a sequence's length."""
    return v if v is None or m is None else v * m


def _carried(e, v, keep, old):
    """v + (1 - m_k) old: the state passes unchanged through the masked steps (keep = 1 - m_k)."""
    return v if keep is None else v + old * keep


def _kept(e, mask, new, old):
    """The step's new state inside a sequence, the old one past its length."""
    return new if mask is None else e.Where(mask, new, old)


class _Recurrence:
    """The forward quantities of one recurrent node in processing order, the Scan over its
    steps, and the shared parts of its backward pass (the cell-specific parts are the
    functions below)."""

    def __init__(self, n, e):
        self.n, self.e = n, e
        self.op = n.op_type
        ins = list(n.inputs) + [None] * (8 - len(n.inputs))
        self.X, self.W, self.R, self.B, self.seq, h0, c0, self.P = ins
        if self.op != "LSTM":
            c0 = self.P = None
        self.direction = attr(n, "direction", "forward")
        if self.direction not in ("forward", "reverse", "bidirectional"):
            raise GradientRuleError(f"{self.op}: unknown direction {self.direction!r}")
        self.D = 2 if self.direction == "bidirectional" else 1
        self.layout = attr(n, "layout", 0)
        self.clip = attr(n, "clip", None)
        self.acts = _activations(n, self.D)
        self.G = _GATES[self.op]
        axis = 1 if self.layout else 0
        self.T = e.Squeeze(e.Shape(self.X, axis, axis + 1), [0])  # the sequence length, at run time

        # layout-0 forward values
        self.X0 = self.relayout(self.X, [1, 0, 2])
        self.Y0 = self._hidden_states(self.relayout(h0, [1, 0, 2]), self.relayout(c0, [1, 0, 2]))

        # mask of the steps inside each sequence, [T, D|1, N, 1] in processing order
        self.mask = self.mf = self.omf = None
        if self.seq is not None:
            lengths = e.Cast(self.seq, to=int(ir.DataType.INT64))
            steps = e.Range(self.int(0), self.T, self.int(1))
            valid = e.Less(e.Unsqueeze(steps, [1]), lengths)  # [T, N]
            self.mask = self.proc(e.Unsqueeze(valid, [1, 3]), shared=True)
            self.mf = e.CastLike(self.mask, self.X)
            self.omf = 1 - self.mf
            nonempty = e.Greater(lengths, self.int(0))
            self.nonempty = e.CastLike(e.Unsqueeze(nonempty, [0, 2]), self.X)  # [1, N, 1]

        # inputs and states in processing order
        self.Xp = self.proc(e.Unsqueeze(self.X0, [1]), shared=True)  # [T, D|1, N, I]
        self.Yp = self.proc(self.Y0)  # [T, D, N, H]
        self.zeros = e.zeros_like(e.Gather(self.Yp, self.int(0), axis=0))  # one step of the state, [D, N, H]
        self.h0 = self.relayout(h0, [1, 0, 2]) if h0 is not None else self.zeros
        self.c0 = self.relayout(c0, [1, 0, 2]) if c0 is not None else self.zeros
        prev = e.op("Slice", self.Yp, e.ints([0]), e.ints([-1]), e.ints([0]))
        h0u = e.Unsqueeze(self.h0, [0])
        if self.mask is not None and h0 is not None and self.direction != "forward":
            # a reversed shorter sequence starts from initial_h at its own last step
            maskprev = e.op("Slice", self.mask, e.ints([0]), e.ints([-1]), e.ints([0]))
            prev = e.Where(maskprev, prev, h0u)
        self.Hp = e.Concat(h0u, prev, axis=0)  # state entering each step

        # weights: W^T, R^T [D, I|H, G*H]; biases [D, 1, G*H]
        self.Wt = _transposed(e, self.W)
        self.Rt = _transposed(e, self.R)
        if self.B is not None:
            self.Wb, self.Rb = (e.Unsqueeze(b, [1]) for b in e.split_into(self.B, 2, 1))
        else:
            self.Wb = self.Rb = None

    # layouts and processing order -------------------------------------------------------
    def scalar(self, v):
        return self.e.scalar(v, like=self.X)

    def int(self, v):
        return self.e.const(np.array(v, np.int64))

    def relayout(self, v, perm):
        """``v`` transposed by ``perm`` between layout 1 and layout 0 (as is with layout 0)."""
        if v is None or not self.layout:
            return v
        return self.e.Transpose(v, perm=perm)

    def flip(self, v):
        """``v`` with its steps (axis 0) in reverse order."""
        e = self.e
        return e.Gather(v, e.Range(self.T - 1, self.int(-1), self.int(-1)), axis=0)

    def proc(self, v, shared=False):
        """[T, D, ...] in time order -> processing order (the reverse direction's steps flipped).
        ``shared``: v has a size-1 direction axis used by every direction (X, masks)."""
        if v is None or self.direction == "forward":
            return v
        if self.direction == "reverse":
            return self.flip(v)
        if shared:
            return self.e.Concat(v, self.flip(v), axis=1)
        fwd, bwd = self.e.split_into(v, 2, 1)
        return self.e.Concat(fwd, self.flip(bwd), axis=1)

    def _hidden_states(self, h0, c0):
        """Y in layout 0, from the node's Y output or from a second node that computes it."""
        e = self.e
        y = self.n.outputs[0] if self.n.outputs else None
        if y is not None and y.name:
            return self.relayout(y, [1, 2, 0, 3])
        attrs = {k: ir.Attr(a.name, a.type, a.value) for k, a in self.n.attributes.items() if k != "layout"}
        ins = [self.X0, self.W, self.R, self.B, self.seq, h0]
        if self.op == "LSTM":
            ins += [c0, self.P]
        while ins and ins[-1] is None:
            ins.pop()
        return e.op(self.op, *ins, outputs=1, **attrs)

    # the loop over the steps ------------------------------------------------------------
    def scan(self, step, states, xs, reverse=False):
        """A Scan running ``step(e, *states, *x_k) -> (new states, per-step outputs)`` over the
        steps in processing order (from the last with ``reverse``), its nodes emitted by ``e``
        into the body. ``states``: [D, N, H] (None: zeros); ``xs``: stacked [T, ...] per-step
        values, each step [D|1, N, .] (None: absent, passed on as None). Returns (final states,
        per-step outputs stacked [T, ...])."""
        e = self.e
        dtype = self.X.dtype or self.W.dtype
        states = [s if s is not None else self.zeros for s in states]
        scanned = [x for x in xs if x is not None]

        def body_input(v, stacked):
            """A body input typed like ``v`` (like one step of it when ``stacked``), of rank 3."""
            dims = dims_of(v)
            dims = dims[1:] if dims is not None and stacked else dims
            shape = ir.Shape(dims if dims is not None and len(dims) == 3 else [None] * 3)
            return ir.Value(name=e.unique(f"{self.op}_step"), type=ir.TensorType(v.dtype or dtype), shape=shape)

        state_ins = [body_input(s, False) for s in states]
        x_ins = [body_input(x, True) for x in scanned]
        g = ir.Graph(state_ins + x_ins, [], nodes=[], name=e.unique(f"{self.op}_steps"))
        sub = e.child(g)
        given = iter(x_ins)
        with sub.math():
            new_states, outs = step(sub, *state_ins, *(None if x is None else next(given) for x in xs))
        outputs = []
        for v in [*new_states, *outs]:
            if v.producer() is None or v.producer().graph is not g or v in outputs:
                v = sub.Identity(v)  # a body output is produced inside the body
            e.typed(v, dtype, [None] * 3)  # onnxruntime's Scan needs the rank of every body output
            outputs.append(v)
        g.outputs.extend(outputs)
        results = e.op("Scan", *states, *scanned, outputs=len(outputs), body=g, num_scan_inputs=len(scanned),
                       scan_input_directions=[1] * len(scanned) if reverse else None,
                       scan_output_directions=[1] * len(outs) if reverse else None)
        results = list(results) if isinstance(results, tuple) else [results]
        for v in results:
            e.typed(v, dtype, None)
        return results[:len(states)], results[len(states):]

    # gates ------------------------------------------------------------------------------
    def gates_x(self):
        """X W^T + Wb for every step, [T, D, N, G*H]."""
        xw = self.Xp @ self.Wt
        return xw if self.Wb is None else xw + self.Wb

    def gates_h(self):
        """H_{k-1} R^T + Rb for every step, [T, D, N, G*H]."""
        hr = self.Hp @ self.Rt
        return hr if self.Rb is None else hr + self.Rb

    def gate_split(self, v):
        return self.e.split_into(v, self.G, -1) if self.G > 1 else [v]

    def _per_direction(self, e, fn, slot, x):
        """fn(activation, x) with each direction's activation (the direction axis is -3)."""
        acts = [self.acts[d][slot] for d in range(self.D)]
        if self.D == 1 or acts[0] == acts[1]:
            return fn(acts[0], x)
        parts = [fn(act, xd) for act, xd in zip(acts, e.split_into(x, 2, -3))]
        if isinstance(parts[0], tuple):
            return tuple(e.Concat(*ps, axis=-3) for ps in zip(*parts))
        return e.Concat(*parts, axis=-3)

    def _clipped(self, e, a):
        if self.clip is None:
            return a
        return e.Clip(a, e.scalar(-float(self.clip), like=a), e.scalar(float(self.clip), like=a))

    def activate(self, e, a, slot):
        """f(clip(a)) for activation slot ``slot``, emitted by ``e`` (a step's, in a Scan body)."""
        return self._per_direction(e, lambda act, x: _act_forward(e, act, self._clipped(e, x)), slot, a)

    def activate_with_derivative(self, a, slot):
        """(f(clip(a)), d f(clip(a)) / da), for every step at once."""
        e = self.e

        def both(act, x):
            xc = self._clipped(e, x)
            y = _act_forward(e, act, xc)
            d = _act_derivative(e, act, xc, y)
            if self.clip is not None:
                inside = e.LessOrEqual(e.Abs(x), self.scalar(float(self.clip)))
                d = d * e.CastLike(inside, x)
            return y, d

        return self._per_direction(e, both, slot, a)

    # backward-pass pieces ---------------------------------------------------------------
    def final_state_grad(self, dy):
        """dL/d(final state) as [D, N, H] (zero for empty sequences)."""
        if dy is None:
            return None
        g = self.relayout(dy, [1, 0, 2])
        if self.seq is not None:
            g = g * self.nonempty
        return g

    def input_grads(self, needs, dA, dR_parts, dRb, dS, extra=()):
        """Gradients of X, W, R, B, sequence_lens, initial_h (+ initial_c, P)."""
        e = self.e
        dX = dW = dR = dB = dh0 = None
        if needs[0]:
            dxp = self.proc(dA @ self.W)  # back to time order, [T, D, N, I]
            dX = self.relayout(e.reduce("ReduceSum", dxp, [1], keepdims=False), [1, 0, 2])
        if needs[1]:
            dW = e.reduce("ReduceSum", _transposed(e, dA, 4) @ self.Xp, [0], keepdims=False)
        if needs[2]:
            rows = [e.reduce("ReduceSum", _transposed(e, g, 4) @ h, [0], keepdims=False)
                    for g, h in dR_parts]
            dR = rows[0] if len(rows) == 1 else e.Concat(*rows, axis=1)
        if wants(needs, 3):
            dB = e.Concat(e.reduce("ReduceSum", dA, [0, 2], keepdims=False),
                          e.reduce("ReduceSum", dRb, [0, 2], keepdims=False), axis=1)
        if wants(needs, 5):
            dh0 = self.relayout(dS, [1, 0, 2])
        return [dX, dW, dR, dB, None, dh0, *extra][:len(needs)]


# ----------------------------------------------------------------------------- cells


def _output_grads(u, dys):
    """dY stacked [T, D, N, H] in processing order, d Y_h and d Y_c as [D, N, H] (or None)."""
    dys = list(dys) + [None] * (3 - len(dys))
    dY = u.proc(u.relayout(dys[0], [1, 2, 0, 3]))
    return dY, u.final_state_grad(dys[1]), u.final_state_grad(dys[2])


@register("RNN")
def rnn(n, dys, needs, e):
    """H_k = f(a_k), a_k = x_k W^T + H_{k-1} R^T + Wb + Rb (clipped):
    da_k = m_k (dS + dY_k) f'(a_k);  dS <- da_k R + (1 - m_k) dS."""
    u = _Recurrence(n, e)
    dY, dS, _ = _output_grads(u, dys)
    _, fd = u.activate_with_derivative(u.gates_x() + u.gates_h(), 0)

    def step(e, dS, dY, m, keep, fd):
        da = _masked(e, e.accumulate(dS, dY), m) * fd
        return [_carried(e, da @ u.R, keep, dS)], [da]

    (dS,), (dA,) = u.scan(step, [dS], [dY, u.mf, u.omf, fd], reverse=True)
    return u.input_grads(needs, dA, [(dA, u.Hp)], dA, dS)


@register("GRU")
def gru(n, dys, needs, e):
    """z = f(az), r = f(ar), h = g(ah), H_k = (1 - z) h + z H_{k-1};
    ah = xWh + (r H_{k-1}) Rh^T + Rbh + Wbh, or xWh + r (H_{k-1} Rh^T + Rbh) + Wbh
    (linear_before_reset). Per step, with dHn = m_k (dS + dY_k):
    dah = dHn (1 - z) g',  daz = dHn (H_{k-1} - h) f',  dar = dr f' with
      linear_before_reset: dr = dah (H_{k-1} Rh^T + Rbh), dS <- dHn z + [daz, dar, dah r] R
      otherwise:           dr = (dah Rh) H_{k-1},         dS <- dHn z + (dah Rh) r + [daz, dar] Rzr
    (+ (1 - m_k) dS); dR takes [daz, dar, dah r]^T H_{k-1}, or [daz, dar]^T H_{k-1} and dah^T (r H_{k-1})."""
    u = _Recurrence(n, e)
    lbr = attr(n, "linear_before_reset", 0)
    dY, dS, _ = _output_grads(u, dys)
    xz, xr, xh = u.gate_split(u.gates_x())
    hz, hr, hh = u.gate_split(u.gates_h())
    z, zd = u.activate_with_derivative(xz + hz, 0)
    r, rd = u.activate_with_derivative(xr + hr, 0)
    if lbr:
        ah = xh + r * hh
        Qr = hh * rd  # dar = dah * Qr
    else:
        Rz, Rr, Rh = e.split_into(u.R, 3, 1)
        Rzr = e.Concat(Rz, Rr, axis=1)
        rH = r * u.Hp
        ah = xh + rH @ _transposed(e, Rh)
        if u.Rb is not None:
            ah = ah + u.gate_split(u.Rb)[2]
        Qr = u.Hp * rd  # dar = (dah Rh) * Qr
    h, hd = u.activate_with_derivative(ah, 1)
    Qh = (1 - z) * hd  # dah = dHn * Qh
    Qz = (u.Hp - h) * zd  # daz = dHn * Qz

    def step(e, dS, dY, m, keep, Qh, Qz, z, Qr, r):
        dHn = _masked(e, e.accumulate(dS, dY), m)
        dah = dHn * Qh
        daz = dHn * Qz
        direct = dHn * z
        if lbr:
            dar = dah * Qr
            daR = e.Concat(daz, dar, dah * r, axis=-1)
            return [_carried(e, direct + daR @ u.R, keep, dS)], [e.Concat(daz, dar, dah, axis=-1), daR]
        drH = dah @ Rh
        dzr = e.Concat(daz, drH * Qr, axis=-1)
        dS_new = direct + drH * r + dzr @ Rzr
        return [_carried(e, dS_new, keep, dS)], [e.Concat(dzr, dah, axis=-1)]

    (dS,), outs = u.scan(step, [dS], [dY, u.mf, u.omf, Qh, Qz, z, Qr, r], reverse=True)
    dA = outs[0]
    if lbr:
        dAR = outs[1]
        return u.input_grads(needs, dA, [(dAR, u.Hp)], dAR, dS)
    dz, dr, dh = u.gate_split(dA)
    return u.input_grads(needs, dA, [(e.Concat(dz, dr, axis=-1), u.Hp), (dh, rH)], dA, dS)


@register("LSTM")
def lstm(n, dys, needs, e):
    """i = f(ai + Pi C_{k-1}), f_ = f(af + Pf C_{k-1}) (or 1 - i with input_forget), c = g(ac),
    C_k = f_ C_{k-1} + i c, o = f(ao + Po C_k), H_k = o h(C_k). Per step, with
    dHn = m_k (dS + dY_k): dao = dHn h(C) f', dC = dHn o h'(C) + m_k dCS + dao Po,
    dai = dC (c - [C_{k-1} with input_forget]) f', daf = dC C_{k-1} f' (0 with input_forget),
    dac = dC i g'; dS <- [dai, dao, daf, dac] R + (1 - m_k) dS,
    dCS <- dC f_ + dai Pi + daf Pf + (1 - m_k) dCS;  dP = sum [dai C_{k-1}, dao C_k, daf C_{k-1}]."""
    u = _Recurrence(n, e)
    forget = attr(n, "input_forget", 0)
    dY, dS, dCS = _output_grads(u, dys)
    Ai, Ao, Af, Ac = u.gate_split(u.gates_x() + u.gates_h())
    g, gd = u.activate_with_derivative(Ac, 1)
    pi = po = pf = None
    if u.P is not None:
        pi, po, pf = (e.Unsqueeze(p, [1]) for p in e.split_into(u.P, 3, 1))  # [D, 1, H]

    def input_forget_gates(ai, af):
        """((i, i'), (f_, f_')) for every step at once: f_ = 1 - i with input_forget."""
        i = u.activate_with_derivative(ai, 0)
        return i, ((1 - i[0], None) if forget else u.activate_with_derivative(af, 0))

    # the cell states, sequentially: C_{k-1} and the step's new C_k
    if pi is None:
        (i, idv), (fg, fdv) = input_forget_gates(Ai, Af)

        def cell(e, C, mask, fg, ig):
            new = fg * C + ig
            return [_kept(e, mask, new, C)], [C, new]

        _, (Cp, Cn) = u.scan(cell, [u.c0], [u.mask, fg, i * g])
    else:
        def cell(e, C, mask, ai, af, g):
            i = u.activate(e, ai + pi * C, 0)
            fg = 1 - i if forget else u.activate(e, af + pf * C, 0)
            new = fg * C + i * g
            return [_kept(e, mask, new, C)], [C, new]

        _, (Cp, Cn) = u.scan(cell, [u.c0], [u.mask, Ai, Af, g])
        (i, idv), (fg, fdv) = input_forget_gates(Ai + pi * Cp, Af + pf * Cp)
        Ao = Ao + po * Cn
    o, od = u.activate_with_derivative(Ao, 0)
    hC, hCd = _h_of_cell(u, Cn)

    Qo = hC * od  # dao = dHn Qo
    Qc = o * hCd  # dC = dHn Qc + ...
    Qi = (g - Cp if forget else g) * idv  # dai = dC Qi
    Qf = e.zeros_like(Qi) if forget else Cp * fdv  # daf = dC Qf
    Qg = i * gd  # dac = dC Qg

    def step(e, dS, dCS, dY, m, keep, Qo, Qc, Qi, Qf, Qg, fg):
        dHn = _masked(e, e.accumulate(dS, dY), m)
        dao = dHn * Qo
        dC = e.accumulate(dHn * Qc, _masked(e, dCS, m))
        if po is not None:
            dC = dC + dao * po
        dai, daf = dC * Qi, dC * Qf
        da = e.Concat(dai, dao, daf, dC * Qg, axis=-1)
        dC_prev = dC * fg
        if pi is not None:
            dC_prev = dC_prev + dai * pi
            if not forget:
                dC_prev = dC_prev + daf * pf
        return [_carried(e, da @ u.R, keep, dS), _carried(e, dC_prev, keep, dCS)], [da]

    (dS, dCS), (dA,) = u.scan(step, [dS, dCS], [dY, u.mf, u.omf, Qo, Qc, Qi, Qf, Qg, fg], reverse=True)

    dc0 = dP = None
    if wants(needs, 6):
        dc0 = u.relayout(dCS, [1, 0, 2])
    if wants(needs, 7):
        dai, dao, daf, _ = u.gate_split(dA)
        dP = e.Concat(*(e.reduce("ReduceSum", da * c, [0, 2], keepdims=False)
                        for da, c in ((dai, Cp), (dao, Cn), (daf, Cp))), axis=1)
    return u.input_grads(needs, dA, [(dA, u.Hp)], dA, dS, extra=(dc0, dP))


def _h_of_cell(u, C):
    """(h(C), h'(C)): the output activation is applied to the cell state, which is not clipped."""
    e = u.e

    def both(act, x):
        y = _act_forward(e, act, x)
        return y, _act_derivative(e, act, x, y)

    return u._per_direction(e, both, 2, C)
