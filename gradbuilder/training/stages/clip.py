"""Global gradient-norm clipping, as ``torch.nn.utils.clip_grad_norm_(params, max_norm)``:

    total = sqrt(sum over weights of sum(g^2));  g *= min(max_norm / (total + 1e-6), 1)
"""

from __future__ import annotations

import onnx_ir as ir

from . import Appended


def clip_by_global_norm(e, weights: list[ir.Value], grads: dict[str, ir.Value], max_norm: float,
                        squares: ir.Value | None = None) -> Appended:
    """``squares``: the sum of squares over every gradient of the model, where ``weights`` are
    only some of them (the others are updated by other processes), instead of the sum over
    ``grads``."""
    like = weights[0]
    if squares is None:
        parts = [e.CastLike(e.reduce("ReduceSumSquare", grads[w.name], None, keepdims=False), like) for w in weights]
        squares = e.op("Sum", *parts) if len(parts) > 1 else parts[0]
    else:
        squares = e.CastLike(squares, like)
    total = e.Sqrt(squares)
    coef = e.Div(e.scalar(float(max_norm), like), e.Add(total, e.scalar(1e-6, like)))
    coef = e.Min(coef, e.scalar(1.0, like))
    return Appended({w.name: e.Mul(grads[w.name], e.CastLike(coef, w)) for w in weights})
