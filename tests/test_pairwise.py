"""gradbuilder.testing.pairwise, which the reduced test grids rely on: every value pair of any
two parameters appears, and the ``whole`` parameters appear in every combination."""

import itertools

import pytest

from gradbuilder.testing import pairwise

GRIDS = [
    ({"a": [1, 2, 3], "b": ["x", "y"], "c": [True, False], "d": [13, 18], "e": [0, 1, 2, 3]}, ["a", "b"]),
    ({"reduction": ["none", "sum", "mean"], "weighted": [False, True], "ignore": [None, 0], "rank": [2, 3, 4],
      "opset": [13, 18], "outputs": [1, 2]}, ["reduction", "weighted", "ignore"]),
    ({"p": [0, 1]}, []),
]


@pytest.mark.parametrize("params,whole", GRIDS)
def test_pairwise_covers_every_pair_and_the_whole_product(params, whole):
    names = list(params)
    rows = pairwise(params, whole=whole)
    full = list(itertools.product(*params.values()))
    assert set(rows) <= set(full) and len(rows) == len(set(rows)) and len(rows) <= len(full)
    for k, n in enumerate(names):
        assert {r[k] for r in rows} == set(params[n])
    for i, j in itertools.combinations(range(len(names)), 2):
        assert {(r[i], r[j]) for r in rows} == set(itertools.product(params[names[i]], params[names[j]]))
    kept = [names.index(n) for n in whole]
    assert {tuple(r[k] for k in kept) for r in rows} == set(itertools.product(*(params[n] for n in whole)))
    assert rows == pairwise(params, whole=whole)  # deterministic
