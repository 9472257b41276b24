"""Warnings raised for the user point at the first frame outside gradbuilder (and torch), so
they name the line of the user's own call, however deep inside the package they arise."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

_OURS = [os.path.dirname(os.path.abspath(__file__)) + os.sep]
_rules = os.path.join(os.path.dirname(_OURS[0].rstrip(os.sep)), "rules") + os.sep
if os.path.isdir(_rules):
    _OURS.append(_rules)


def _outside(filename: str) -> bool:
    path = os.path.abspath(filename)
    if any(path.startswith(d) for d in _OURS) or path == os.path.abspath(contextlib.__file__):
        return False
    torch = sys.modules.get("torch")  # nn.Module.__call__ stands between a user and ORTModule
    torch_dir = getattr(torch, "__file__", None)
    return not (torch_dir and path.startswith(os.path.dirname(torch_dir) + os.sep))


def caller_stacklevel(start: int = 1) -> int:
    """The ``stacklevel`` that makes a warning raised ``start`` frames above this call name the
    first frame outside gradbuilder (and torch): the user's own line."""
    frame, level = sys._getframe(start + 1), start + 1
    while frame.f_back is not None and not _outside(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` pointing at the user's call."""
    warnings.warn(message, category, stacklevel=caller_stacklevel(1))


@contextlib.contextmanager
def warnings_at_caller():
    """Warnings raised inside the block come out after it, pointing at the user's call (for
    code whose own ``stacklevel`` cannot know how deep inside gradbuilder it was called)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        warnings.warn(w.message if isinstance(w.message, Warning) else str(w.message), w.category,
                      stacklevel=caller_stacklevel(1))
