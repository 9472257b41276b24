"""Covering test grids: every pair of parameter values in far fewer cases than the full product."""

from __future__ import annotations

import itertools
from typing import Mapping, Sequence


def pairwise(params: Mapping[str, Sequence], *, whole: Sequence[str] = ()) -> list[tuple]:
    """A covering set of test cases for ``@pytest.mark.parametrize`` in place of the full product
    of ``params`` (name -> values): the full product of the parameters named in ``whole`` (those
    whose values interact in the rule's code), and every pair of values of any two parameters.

    Deterministic (greedy, in the order given); returns tuples in the order of ``params``. Use
    it where the full grid adds no coverage: every value of every parameter appears, every pair
    appears, and the ``whole`` parameters appear in every combination."""
    names = list(params)
    sizes = [len(params[n]) for n in names]
    if any(s == 0 for s in sizes):
        return []
    pos = {n: i for i, n in enumerate(names)}
    whole_idx = [pos[n] for n in whole]
    uncovered = {(i, a, j, b) for i in range(len(names)) for j in range(i + 1, len(names))
                 for a in range(sizes[i]) for b in range(sizes[j])}
    used = [[0] * s for s in sizes]

    def fill(row):
        for k in range(len(names)):
            if row[k] is not None:
                continue

            def gain(v, k=k):
                return sum(((min(k, j), v if k < j else row[j], max(k, j), row[j] if k < j else v) in uncovered)
                           for j in range(len(names)) if row[j] is not None)

            row[k] = max(range(sizes[k]), key=lambda v: (gain(v), -used[k][v], -v))
        return row

    def add(row):
        for i in range(len(names)):
            used[i][row[i]] += 1
            for j in range(i + 1, len(names)):
                uncovered.discard((i, row[i], j, row[j]))
        rows.append(tuple(row))

    rows: list[tuple] = []
    for combo in itertools.product(*[range(sizes[i]) for i in whole_idx]):
        row = [None] * len(names)
        for i, v in zip(whole_idx, combo):
            row[i] = v
        add(fill(row))
    while uncovered:
        i, a, j, b = min(uncovered)
        row = [None] * len(names)
        row[i], row[j] = a, b
        add(fill(row))
    for k in range(len(names)):  # a value no pair brought in (a parameter alone)
        for v in range(sizes[k]):
            if not used[k][v]:
                row = [None] * len(names)
                row[k] = v
                add(fill(row))
    return [tuple(params[n][v] for n, v in zip(names, row)) for row in rows]
