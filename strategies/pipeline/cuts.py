"""Where a pipeline cuts its list of blocks: a pure function of their weights, free of torch, so that the
estimator and `stratpack plan` use the engine's own cut without importing it."""

from __future__ import annotations

from collections.abc import Callable


def partition(weights: list[int], stages: int, first_extra: int = 0, last_extra: int = 0) -> list[range]:
    """Contiguous ranges of ``weights`` (one per block), one range per stage, each non-empty, minimising the
    heaviest stage; ``first_extra`` / ``last_extra`` weigh on the first and last stage (embeddings, head). Among the
    cuts whose heaviest stage is that light, the one with the least sum of squared stage weights: the blocks the
    heaviest stage does not bind are spread evenly (the first min-max cut found could leave eleven stages of Llama 3
    405B's pp16 x v2 one block each beside a whole-vocabulary embedding, and the rest six)."""
    n = len(weights)
    if stages > n:
        raise ValueError(f"cannot cut {n} blocks into {stages} pipeline stages (pp x v): each stage needs at least "
                         "one block; use a smaller pp (or v), or a model with more blocks")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    extras = (first_extra, last_extra)
    heaviest = _table(prefix, stages, extras, max, float("inf"))[0][stages][n]
    cut = _table(prefix, stages, extras, lambda before, w: before + w * w, heaviest)[1]
    bounds, i = [], n
    for k in range(stages, 0, -1):
        bounds.append(range(cut[k][i], i))
        i = cut[k][i]
    return bounds[::-1]


def _table(prefix: list[int], stages: int, extras: tuple[int, int], combine: Callable[[float, int], float],
           bound: float) -> tuple[list[list[float]], list[list[int]]]:
    """best[k][i]: the least ``combine`` (folded over the stages) of the first i blocks in k stages, no stage heavier
    than ``bound``; cut[k][i]: where stage k starts in it."""
    n = len(prefix) - 1
    best = [[float("inf")] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                w = prefix[i] - prefix[j] + (extras[0] if k == 1 else 0) + (extras[1] if k == stages else 0)
                cost = combine(best[k - 1][j], w)
                if w <= bound and cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    return best, cut
