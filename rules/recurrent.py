"""Recurrent layers RNN, GRU and LSTM: backpropagation through time, unrolled over the steps.

Notation (layout 0; layout 1 is transposed in and out): X [T, N, I], W [D, G*H, I],
R [D, G*H, H], B = [Wb, Rb] [D, 2*G*H], initial_h / initial_c [D, N, H], P [D, 3*H],
Y [T, D, N, H], Y_h / Y_c [D, N, H]; G = 1 (RNN), 3 (GRU, gates z r h), 4 (LSTM, gates i o f c).

The backward graph works in *processing order*: every per-step tensor is stacked as
[T, D, N, .] with step k of the reverse direction being time T-1-k, so both directions of a
bidirectional layer share one unrolled loop. The hidden state entering step k (Hp) comes
from the forward node's Y output (re-computed by a second node of the same op when the
forward node has no Y output); all gate pre-activations are then recomputed at once with
one MatMul each, only the LSTM cell state needs a sequential recurrence. The loop over the
steps carries dS = dL/dH_k (and dCS = dL/dC_k), per step k from the last to the first:

    dHn   = m_k (dS + dY_k)                 gradient of the step's new state
    da    = gate pre-activation gradients   (cell-specific, below)
    dS    = da @ R + (1 - m_k) dS  [+ direct terms]

with m_k the sequence_lens mask (steps past a sequence's length keep the state and write
Y = 0; a zero length gives Y_h = Y_c = 0 as onnxruntime does). Then, over all steps at once,

    dX = sum_d da @ W,   dW = sum_k da_k^T x_k,   dR = sum_k da_k^T h_{k-1},
    dB = [sum da, sum da_R],   d initial_h = dS (after the first step).

``clip`` clips every gate pre-activation (not the cell state), so its derivative is the
mask |a| <= clip. Activations take alpha/beta in order, only the ones that use them
(Affine, LeakyRelu, ThresholdedRelu, ScaledTanh, HardSigmoid, Elu), with onnxruntime's
defaults when the lists run out (LeakyRelu 0.01, HardSigmoid 0.2/0.5, Elu 1.0, others 0).
The sequence length must be static; sequence_lens (int) gets no gradient.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from gradbuilder.errors import GradientRuleError
from gradbuilder.compiler.registry import attr, dims_of, register

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
    s = lambda v: e.scalar(v, like=x)  # noqa: E731
    if name == "tanh":
        return e.Tanh(x)
    if name == "sigmoid":
        return e.Sigmoid(x)
    if name == "relu":
        return e.Relu(x)
    if name == "affine":
        return e.Add(e.Mul(x, s(a)), s(b))
    if name == "leakyrelu":
        return e.LeakyRelu(x, alpha=a)
    if name == "thresholdedrelu":
        return e.ThresholdedRelu(x, alpha=a)
    if name == "scaledtanh":
        return e.Mul(e.Tanh(e.Mul(x, s(b))), s(a))
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
        return e.Sub(one, e.Mul(y, y))
    if name == "sigmoid":  # y (1 - y)
        return e.Mul(y, e.Sub(one, y))
    if name == "relu":
        return e.CastLike(e.Greater(x, s(0.0)), x)
    if name == "affine":
        return e.expand_like(s(a), x)
    if name == "leakyrelu":  # x >= 0: 1, else alpha
        return e.Where(e.Less(x, s(0.0)), s(a), one)
    if name == "thresholdedrelu":  # x > alpha: 1
        return e.CastLike(e.Greater(x, s(a)), x)
    if name == "scaledtanh":  # alpha beta (1 - tanh(beta x)^2)
        t = e.Tanh(e.Mul(x, s(b)))
        return e.Mul(e.Sub(one, e.Mul(t, t)), s(a * b))
    if name == "hardsigmoid":  # alpha where 0 < alpha x + beta < 1
        return e.Where(e.And(e.Greater(y, s(0.0)), e.Less(y, one)), s(a), s(0.0))
    if name == "elu":  # x >= 0: 1, else y + alpha
        return e.Where(e.Less(x, s(0.0)), e.Add(y, s(a)), one)
    if name == "softsign":  # 1 / (1 + |x|)^2 = (1 - |y|)^2
        t = e.Sub(one, e.Abs(y))
        return e.Mul(t, t)
    return e.Sigmoid(x)  # softplus


# ----------------------------------------------------------------------------- helpers


def _transposed(e, v, rank=3):
    """The last two axes of ``v`` (of rank ``rank``) swapped."""
    return e.Transpose(v, perm=list(range(rank - 2)) + [rank - 1, rank - 2])


class _Unrolled:
    """The forward quantities of one recurrent node in processing order, and the shared
    steps of its backward pass (the cell-specific parts are the functions below)."""

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

        dims = dims_of(self.X)
        axis = 1 if self.layout else 0
        T = dims[axis] if dims is not None and len(dims) == 3 else None
        if not isinstance(T, int):
            raise GradientRuleError(
                f"{self.op}: backpropagation through time is unrolled over the steps and needs a static "
                f"sequence length, but X's sequence axis (axis {axis}, layout={self.layout}) has "
                f"dim {T!r} (X dims {dims}). Give the model a fixed sequence length (e.g. export with a "
                f"static shape) or fix it with shape inference")
        self.T = T

        # layout-0 forward values
        self.X0 = self.relayout(self.X, [1, 0, 2])
        self.h0 = self.relayout(h0, [1, 0, 2])
        self.c0 = self.relayout(c0, [1, 0, 2])
        self.Y0 = self._hidden_states()

        # mask of the steps inside each sequence, [T, D|1, N, 1] in processing order
        self.mask = self.mf = self.omf = None
        if self.seq is not None:
            steps = e.const(np.arange(T, dtype=np.int64).reshape(T, 1))
            lengths = e.Cast(self.seq, to=int(ir.DataType.INT64))
            valid = e.Less(steps, lengths)  # [T, N]
            self.mask = self.proc(e.unsqueeze(valid, [1, 3]), shared=True)
            self.mf = e.CastLike(self.mask, self.X)
            self.omf = e.Sub(self.scalar(1.0), self.mf)
            nonempty = e.Greater(lengths, e.const(np.array(0, np.int64)))
            self.nonempty = e.CastLike(e.unsqueeze(nonempty, [0, 1, 3]), self.X)  # [1, 1, N, 1]

        # inputs and states in processing order
        self.Xp = self.proc(e.unsqueeze(self.X0, [1]), shared=True)  # [T, D|1, N, I]
        self.Yp = self.proc(self.Y0)  # [T, D, N, H]
        self._zeros = None
        self.h0u = e.unsqueeze(self.h0, [0]) if self.h0 is not None else self.zeros
        if self.op == "LSTM":
            self.c0u = e.unsqueeze(self.c0, [0]) if self.c0 is not None else self.zeros
        if T == 1:
            self.Hp = self.h0u
        else:
            prev = e.op("Slice", self.Yp, e.ints([0]), e.ints([T - 1]), e.ints([0]))
            if self.mask is not None and self.h0 is not None and self.direction != "forward":
                # a reversed shorter sequence starts from initial_h at its own last step
                maskprev = e.op("Slice", self.mask, e.ints([0]), e.ints([T - 1]), e.ints([0]))
                prev = e.Where(maskprev, prev, self.h0u)
            self.Hp = e.Concat(self.h0u, prev, axis=0)  # state entering each step

        # weights: W^T, R^T [D, I|H, G*H]; biases [D, 1, G*H]
        self.Wt = _transposed(e, self.W)
        self.Rt = _transposed(e, self.R)
        if self.B is not None:
            self.Wb, self.Rb = (e.unsqueeze(b, [1]) for b in e.split(self.B, 2, 1))
        else:
            self.Wb = self.Rb = None
        self._steps = {}

    @property
    def zeros(self):
        """Zeros shaped like one step of the state, [1, D, N, H]."""
        if self._zeros is None:
            first = self.e.op("Slice", self.Yp, self.e.ints([0]), self.e.ints([1]), self.e.ints([0]))
            self._zeros = self.e.zeros_like(first)
        return self._zeros

    # layouts and processing order -------------------------------------------------------
    def scalar(self, v):
        return self.e.scalar(v, like=self.X)

    def relayout(self, v, perm):
        """``v`` transposed by ``perm`` between layout 1 and layout 0 (as is with layout 0)."""
        if v is None or not self.layout:
            return v
        return self.e.Transpose(v, perm=perm)

    def flip(self, v):
        """``v`` with its steps (axis 0) in reverse order."""
        return self.e.Gather(v, self.e.ints(list(range(self.T - 1, -1, -1))), axis=0)

    def proc(self, v, shared=False):
        """[T, D, ...] in time order -> processing order (the reverse direction's steps flipped).
        ``shared``: v has a size-1 direction axis used by every direction (X, masks)."""
        if v is None or self.direction == "forward":
            return v
        if self.direction == "reverse":
            return self.flip(v)
        if shared:
            return self.e.Concat(v, self.flip(v), axis=1)
        fwd, bwd = self.e.split(v, 2, 1)
        return self.e.Concat(fwd, self.flip(bwd), axis=1)

    def steps(self, v):
        """The T per-step slices [1, ...] of a stacked [T, ...] tensor."""
        if v is None:
            return [None] * self.T
        if v not in self._steps:
            self._steps[v] = self.e.split(v, self.T, 0)
        return self._steps[v]

    def stack(self, items):
        return items[0] if len(items) == 1 else self.e.Concat(*items, axis=0)

    def _hidden_states(self):
        """Y in layout 0, from the node's Y output or from a second node that computes it."""
        e = self.e
        y = self.n.outputs[0] if self.n.outputs else None
        if y is not None and y.name:
            return self.relayout(y, [1, 2, 0, 3])
        attrs = {k: ir.Attr(a.name, a.type, a.value) for k, a in self.n.attributes.items() if k != "layout"}
        ins = [self.X0, self.W, self.R, self.B, self.seq, self.h0]
        if self.op == "LSTM":
            ins += [self.c0, self.P]
        while ins and ins[-1] is None:
            ins.pop()
        return e.op(self.op, *ins, outputs=1, **attrs)

    # gates ------------------------------------------------------------------------------
    def gates_x(self):
        """X W^T + Wb for every step, [T, D, N, G*H]."""
        xw = self.e.MatMul(self.Xp, self.Wt)
        return xw if self.Wb is None else self.e.Add(xw, self.Wb)

    def gates_h(self):
        """H_{k-1} R^T + Rb for every step, [T, D, N, G*H]."""
        hr = self.e.MatMul(self.Hp, self.Rt)
        return hr if self.Rb is None else self.e.Add(hr, self.Rb)

    def gate_split(self, v):
        return self.e.split(v, self.G, -1) if self.G > 1 else [v]

    def _per_direction(self, fn, slot, x):
        acts = [self.acts[d][slot] for d in range(self.D)]
        if self.D == 1 or acts[0] == acts[1]:
            return fn(acts[0], x)
        parts = [fn(act, xd) for act, xd in zip(acts, self.e.split(x, 2, 1))]
        if isinstance(parts[0], tuple):
            return tuple(self.e.Concat(*ps, axis=1) for ps in zip(*parts))
        return self.e.Concat(*parts, axis=1)

    def _clipped(self, a):
        if self.clip is None:
            return a
        return self.e.Clip(a, self.scalar(-float(self.clip)), self.scalar(float(self.clip)))

    def activate(self, a, slot):
        """f(clip(a)) for activation slot ``slot`` (forward only)."""
        return self._per_direction(lambda act, x: _act_forward(self.e, act, self._clipped(x)), slot, a)

    def activate_with_derivative(self, a, slot):
        """(f(clip(a)), d f(clip(a)) / da)."""
        e = self.e

        def both(act, x):
            xc = self._clipped(x)
            y = _act_forward(e, act, xc)
            d = _act_derivative(e, act, xc, y)
            if self.clip is not None:
                inside = e.LessOrEqual(e.Abs(x), self.scalar(float(self.clip)))
                d = e.Mul(d, e.CastLike(inside, x))
            return y, d

        return self._per_direction(both, slot, a)

    # backward-pass pieces ---------------------------------------------------------------
    def final_state_grad(self, dy):
        """dL/d(final state) as [1, D, N, H] (zero for empty sequences)."""
        if dy is None:
            return None
        g = self.e.unsqueeze(self.relayout(dy, [1, 0, 2]), [0])
        if self.seq is not None:
            g = self.e.Mul(g, self.nonempty)
        return g

    def masked(self, v, k):
        """m_k v: nothing flows into the steps past a sequence's length."""
        if v is None or self.mf is None:
            return v
        return self.e.Mul(v, self.steps(self.mf)[k])

    def carried(self, v, k, old):
        """v + (1 - m_k) old: the state passes unchanged through the masked steps."""
        if old is None or self.omf is None:
            return v
        return self.e.add(v, self.e.Mul(old, self.steps(self.omf)[k]))

    def input_grads(self, needs, dA, dR_parts, dRb, dS, extra=()):
        """Gradients of X, W, R, B, sequence_lens, initial_h (+ initial_c, P)."""
        e = self.e
        dX = dW = dR = dB = dh0 = None
        if needs[0]:
            dxp = self.proc(e.MatMul(dA, self.W))  # back to time order, [T, D, N, I]
            dX = self.relayout(e.reduce("ReduceSum", dxp, [1], keepdims=False), [1, 0, 2])
        if needs[1]:
            dW = e.reduce("ReduceSum", e.MatMul(_transposed(e, dA, 4), self.Xp), [0], keepdims=False)
        if needs[2]:
            rows = [e.reduce("ReduceSum", e.MatMul(_transposed(e, g, 4), h), [0], keepdims=False)
                    for g, h in dR_parts]
            dR = rows[0] if len(rows) == 1 else e.Concat(*rows, axis=1)
        if len(needs) > 3 and needs[3]:
            dB = e.Concat(e.reduce("ReduceSum", dA, [0, 2], keepdims=False),
                          e.reduce("ReduceSum", dRb, [0, 2], keepdims=False), axis=1)
        if len(needs) > 5 and needs[5]:
            dh0 = self.relayout(e.squeeze(dS if dS is not None else self.zeros, [0]), [1, 0, 2])
        return [dX, dW, dR, dB, None, dh0, *extra][:len(needs)]


# ----------------------------------------------------------------------------- cells


def _output_grads(u, dys):
    dys = list(dys) + [None] * (3 - len(dys))
    dY = u.proc(u.relayout(dys[0], [1, 2, 0, 3]))
    return u.steps(dY), u.final_state_grad(dys[1]), u.final_state_grad(dys[2])


@register("RNN")
def rnn(n, dys, needs, e):
    """H_k = f(a_k), a_k = x_k W^T + H_{k-1} R^T + Wb + Rb (clipped):
    da_k = m_k (dS + dY_k) f'(a_k);  dS <- da_k R + (1 - m_k) dS."""
    u = _Unrolled(n, e)
    dY, dS, _ = _output_grads(u, dys)
    a = e.Add(u.gates_x(), u.gates_h())
    _, fd = u.activate_with_derivative(a, 0)
    das = [None] * u.T
    for k in reversed(range(u.T)):
        dHn = u.masked(e.add(dS, dY[k]), k)
        das[k] = e.Mul(dHn, u.steps(fd)[k])
        dS = u.carried(e.MatMul(das[k], u.R), k, dS)
    dA = u.stack(das)
    return u.input_grads(needs, dA, [(dA, u.Hp)], dA, dS)


@register("GRU")
def gru(n, dys, needs, e):
    """z = f(az), r = f(ar), h = g(ah), H_k = (1 - z) h + z H_{k-1};
    ah = xWh + (r H_{k-1}) Rh^T + Rbh + Wbh, or xWh + r (H_{k-1} Rh^T + Rbh) + Wbh
    (linear_before_reset). Per step, with dHn = m_k (dS + dY_k):
    dah = dHn (1 - z) g',  daz = dHn (H_{k-1} - h) f',  dar = dr f' with
      linear_before_reset: dr = dah (H_{k-1} Rh^T + Rbh), dS <- dHn z + [daz, dar, dah r] R
      otherwise:           dr = (dah Rh) H_{k-1},         dS <- dHn z + [daz, dar] Rzr + (dah Rh) r
    (+ (1 - m_k) dS); dR takes [daz, dar, dah r]^T H_{k-1}, or [daz, dar]^T H_{k-1} and dah^T (r H_{k-1})."""
    u = _Unrolled(n, e)
    lbr = attr(n, "linear_before_reset", 0)
    dY, dS, _ = _output_grads(u, dys)
    xz, xr, xh = u.gate_split(u.gates_x())
    hz, hr, hh = u.gate_split(u.gates_h())
    z, zd = u.activate_with_derivative(e.Add(xz, hz), 0)
    r, rd = u.activate_with_derivative(e.Add(xr, hr), 0)
    if lbr:
        ah = e.Add(xh, e.Mul(r, hh))
        Qr = e.Mul(hh, rd)  # dar = dah * Qr
    else:
        Rz, Rr, Rh = e.split(u.R, 3, 1)
        Rzr = e.Concat(Rz, Rr, axis=1)
        rH = e.Mul(r, u.Hp)
        ah = e.Add(xh, e.MatMul(rH, _transposed(e, Rh)))
        if u.Rb is not None:
            ah = e.Add(ah, u.gate_split(u.Rb)[2])
        Qr = e.Mul(u.Hp, rd)  # dar = (dah Rh) * Qr
    h, hd = u.activate_with_derivative(ah, 1)
    Qh = e.Mul(e.Sub(u.scalar(1.0), z), hd)  # dah = dHn * Qh
    Qz = e.Mul(e.Sub(u.Hp, h), zd)  # daz = dHn * Qz

    das, dRs = [None] * u.T, [None] * u.T
    for k in reversed(range(u.T)):
        dHn = u.masked(e.add(dS, dY[k]), k)
        dah = e.Mul(dHn, u.steps(Qh)[k])
        daz = e.Mul(dHn, u.steps(Qz)[k])
        direct = e.Mul(dHn, u.steps(z)[k])
        if lbr:
            dar = e.Mul(dah, u.steps(Qr)[k])
            das[k] = e.Concat(daz, dar, dah, axis=-1)
            dRs[k] = e.Concat(daz, dar, e.Mul(dah, u.steps(r)[k]), axis=-1)
            dS_new = e.Add(direct, e.MatMul(dRs[k], u.R))
        else:
            drH = e.MatMul(dah, Rh)
            dar = e.Mul(drH, u.steps(Qr)[k])
            dzr = e.Concat(daz, dar, axis=-1)
            das[k] = e.Concat(dzr, dah, axis=-1)
            dS_new = e.Add(e.Add(direct, e.Mul(drH, u.steps(r)[k])), e.MatMul(dzr, Rzr))
        dS = u.carried(dS_new, k, dS)
    dA = u.stack(das)
    if lbr:
        dAR = u.stack(dRs)
        return u.input_grads(needs, dA, [(dAR, u.Hp)], dAR, dS)
    dz, dr, dh = u.gate_split(dA)
    return u.input_grads(needs, dA, [(e.Concat(dz, dr, axis=-1), u.Hp), (dh, rH)], dA, dS)


@register("LSTM")
def lstm(n, dys, needs, e):
    """i = f(ai + Pi C_{k-1}), f_ = f(af + Pf C_{k-1}) (or 1 - i with input_forget), c = g(ac),
    C_k = f_ C_{k-1} + i c, o = f(ao + Po C_k), H_k = o h(C_k). Per step, with
    dHn = m_k (dS + dY_k): dao = dHn h(C) f', dC = m_k dCS + dHn o h'(C) + dao Po,
    dai = dC (c - [C_{k-1} with input_forget]) f', daf = dC C_{k-1} f', dac = dC i g';
    dS <- [dai, dao, daf, dac] R + (1 - m_k) dS,
    dCS <- dC f_ + dai Pi + daf Pf + (1 - m_k) dCS;  dP = sum [dai C_{k-1}, dao C_k, daf C_{k-1}]."""
    u = _Unrolled(n, e)
    forget = attr(n, "input_forget", 0)
    dY, dS, dCS = _output_grads(u, dys)
    Ai, Ao, Af, Ac = u.gate_split(e.Add(u.gates_x(), u.gates_h()))
    g, gd = u.activate_with_derivative(Ac, 1)
    pi = po = pf = None
    if u.P is not None:
        pi, po, pf = (e.unsqueeze(p, [1]) for p in e.split(u.P, 3, 1))  # [D, 1, H]

    def input_forget_gates(ai, af, derivatives):
        """(i, f_) or ((i, i'), (f_, f_')): f_ = 1 - i with input_forget."""
        act = u.activate_with_derivative if derivatives else u.activate
        i = act(ai, 0)
        if not forget:
            return i, act(af, 0)
        i_value = i[0] if derivatives else i
        fg = e.Sub(u.scalar(1.0), i_value)
        return i, ((fg, None) if derivatives else fg)

    # the cell states, sequentially (with peepholes i and f_ depend on C_{k-1})
    if pi is None:
        (i, idv), (fg, fdv) = input_forget_gates(Ai, Af, True)
        ig = e.Mul(i, g)
    state, prevs, news = u.c0u, [], []
    for k in range(u.T):
        prevs.append(state)
        if pi is None:
            new = e.Add(e.Mul(u.steps(fg)[k], state), u.steps(ig)[k])
        else:
            ik, fk = input_forget_gates(e.Add(u.steps(Ai)[k], e.Mul(pi, state)),
                                        e.Add(u.steps(Af)[k], e.Mul(pf, state)), False)
            new = e.Add(e.Mul(fk, state), e.Mul(ik, u.steps(g)[k]))
        news.append(new)
        state = new if u.mask is None else e.Where(u.steps(u.mask)[k], new, state)
    Cp, Cn = u.stack(prevs), u.stack(news)  # C_{k-1}, and the step's new C_k
    if pi is not None:
        (i, idv), (fg, fdv) = input_forget_gates(e.Add(Ai, e.Mul(pi, Cp)), e.Add(Af, e.Mul(pf, Cp)), True)
        Ao = e.Add(Ao, e.Mul(po, Cn))
    o, od = u.activate_with_derivative(Ao, 0)
    hC, hCd = _h_of_cell(u, Cn)

    Qo = e.Mul(hC, od)  # dao = dHn Qo
    Qc = e.Mul(o, hCd)  # dC = dHn Qc + ...
    Qi = e.Mul(e.Sub(g, Cp) if forget else g, idv)  # dai = dC Qi
    Qf = None if forget else e.Mul(Cp, fdv)  # daf = dC Qf
    Qg = e.Mul(i, gd)  # dac = dC Qg
    das = [None] * u.T
    for k in reversed(range(u.T)):
        dHn = u.masked(e.add(dS, dY[k]), k)
        if dHn is None:  # only Y_c carries a gradient
            dHn = u.zeros
        dao = e.Mul(dHn, u.steps(Qo)[k])
        dC = e.add(e.Mul(dHn, u.steps(Qc)[k]), u.masked(dCS, k))
        if po is not None:
            dC = e.Add(dC, e.Mul(dao, po))
        dai = e.Mul(dC, u.steps(Qi)[k])
        daf = u.zeros if forget else e.Mul(dC, u.steps(Qf)[k])
        das[k] = e.Concat(dai, dao, daf, e.Mul(dC, u.steps(Qg)[k]), axis=-1)
        dC_prev = e.Mul(dC, u.steps(fg)[k])
        if pi is not None:
            dC_prev = e.Add(dC_prev, e.Mul(dai, pi))
            if not forget:
                dC_prev = e.Add(dC_prev, e.Mul(daf, pf))
        dCS = u.carried(dC_prev, k, dCS)
        dS = u.carried(e.MatMul(das[k], u.R), k, dS)
    dA = u.stack(das)

    dc0 = dP = None
    if len(needs) > 6 and needs[6]:
        dc0 = u.relayout(e.squeeze(dCS, [0]), [1, 0, 2])
    if len(needs) > 7 and needs[7]:
        dai, dao, daf, _ = u.gate_split(dA)
        dP = e.Concat(*(e.reduce("ReduceSum", e.Mul(da, c), [0, 2], keepdims=False)
                        for da, c in ((dai, Cp), (dao, Cn), (daf, Cp))), axis=1)
    return u.input_grads(needs, dA, [(dA, u.Hp)], dA, dS, extra=(dc0, dP))


def _h_of_cell(u, C):
    """(h(C), h'(C)): the output activation is applied to the cell state, which is not clipped."""
    e = u.e

    def both(act, x):
        y = _act_forward(e, act, x)
        return y, _act_derivative(e, act, x, y)

    return u._per_direction(both, 2, C)
