"""Optional wrapping: Optional OptionalGetElement (OptionalHasElement has a bool output only,
so no gradient reaches it).

The gradient of an optional value is the gradient of the element it holds (a tensor, or a
sequence), not an optional: wrapping and unwrapping pass dy through unchanged.
"""

from __future__ import annotations

from gradbuilder.compiler.registry import register


@register("Optional")
def optional(n, dys, needs, e):
    """y = Optional(x) holds x:  dx = dy (the gradient of the element)."""
    return (dys[0],)


@register("OptionalGetElement")
def optional_get_element(n, dys, needs, e):
    """y = the element of the optional x (or x itself when x is a tensor or a sequence):
    dx = dy, the gradient of that element."""
    return (dys[0],)
