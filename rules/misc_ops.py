"""The ops whose float inputs have no (or a zero) derivative: MelWeightMatrix, EyeLike, and
the random draws.

The random draws are stop-gradient points: RandomNormalLike and RandomUniformLike read only
their input's shape (and dtype), and Bernoulli's and Multinomial's draws are piecewise
constant in their probabilities, so no gradient flows into their inputs. A draw is a
constant of the step that made it: in a reparameterisation z = mu + exp(logvar / 2) * eps
with eps = RandomNormalLike(mu), mu and logvar get their gradients through the Add and the
Mul, with eps held fixed.
"""

from __future__ import annotations

from gradbuilder.compiler.registry import register, register_stop_gradient_edges
from gradbuilder.rules.helpers import zero_gradients


@register("MelWeightMatrix")
def mel_weight_matrix(n, dys, needs, e):
    """The matrix entries are ratios of whole bin indices, floor((dft_length + 1) * f /
    sample_rate) of mel-spaced frequencies f between lower_edge_hertz and upper_edge_hertz:
    piecewise constant in the edges, so d lower_edge_hertz = d upper_edge_hertz = 0 (also
    used at the jumps)."""
    return zero_gradients(n, needs, e)


@register("EyeLike")
def eye_like(n, dys, needs, e):
    """y = ones on the k-th diagonal, shaped like x: y does not depend on x's values, so x
    gets no gradient (None: zero)."""
    return (None,)


for _op in ("RandomNormalLike", "RandomUniformLike", "Bernoulli", "Multinomial"):
    register_stop_gradient_edges({0}, _op)
