"""All-pairs parameter sets for the slow parametrized tests.

A full product of several factors grows fast (4 combiners x ragged x table kind x
sparse gradient = 32 cases of seconds each); the cases in `pairwise(...)` still
hold every value of every factor beside every value of every other factor, so a
bug that needs one combination of two settings is still caught, at a third to a
half of the cost. The choice is deterministic (greedy, in the order given), so a
failure names the same case on every run.
"""

import itertools


def pairwise(*factors):
    """Rows (tuples, one value per factor) covering every pair of values of any two
    factors. A single factor, or two, give their full product."""
    factors = [list(f) for f in factors]
    if len(factors) <= 2:
        return list(itertools.product(*factors))
    uncovered = {(i, a, j, b) for i, j in itertools.combinations(range(len(factors)), 2)
                 for a in range(len(factors[i])) for b in range(len(factors[j]))}
    candidates = list(itertools.product(*(range(len(f)) for f in factors)))
    rows = []
    while uncovered:
        def gain(row):
            return sum((i, row[i], j, row[j]) in uncovered
                       for i, j in itertools.combinations(range(len(row)), 2))
        best = max(candidates, key=gain)  # max keeps the first of equals: deterministic
        uncovered -= {(i, best[i], j, best[j]) for i, j in itertools.combinations(range(len(best)), 2)}
        rows.append(best)
    return [tuple(factors[i][v] for i, v in enumerate(row)) for row in rows]
