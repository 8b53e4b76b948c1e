"""The optimal planner's timeline on many states at once: :func:`~mergecomp.planning.costmodel.advance`
and :func:`~mergecomp.planning.costmodel.stretch` over numpy rows (the same floating-point
operations in the same order, so the dynamic program's states equal what ``predict``
computes), and the Pareto filter that keeps the non-dominated states of a prefix."""
from __future__ import annotations

import numpy as np


def stretch_all(work, busy, interference: float):
    """:func:`mergecomp.planning.costmodel.stretch` elementwise (same operations, same order)."""
    if interference == 1.0:
        return np.zeros(np.broadcast(work, busy).shape)
    return np.minimum((interference - 1.0) * work, (1.0 - 1.0 / interference) * np.maximum(busy, 0.0))


def advance_all(states: np.ndarray, ready: float, encode: np.ndarray, communicate: np.ndarray,
                 finish: np.ndarray, on_compute: bool, interference: float = 1.0,
                 since=0.0, slowdown: float = 1.0, backward: float = 0.0, blocking=None) -> np.ndarray:
    """:func:`mergecomp.planning.costmodel.advance` on every row of ``states`` at once (row-wise costs
    and row-wise ``since``, the ready time of each row's previous launch; ``blocking``
    row-wise, None when the launch does not wait for the collective)."""
    first, channel, finish_loop, finished = states.T
    if on_compute:
        busy = channel - (since + first)
        new_first = (first + stretch_all((ready - since) + encode, busy, interference)) + encode
        encoded = ready + new_first
    else:
        encoded = np.maximum(first, ready) + encode
        new_first = encoded
    start = np.maximum(encoded, channel)
    begin, rest = start, communicate
    if blocking is not None:  # the launch waits for the channel, then the first phase
        begin, rest = start + blocking, communicate - blocking
        new_first = new_first + (begin - encoded) if on_compute else begin
    end = begin + rest
    if on_compute:
        end = end + stretch_all(rest, (backward + new_first) - begin, slowdown)
    finish_loop = np.maximum(finish_loop, end) + finish
    return np.stack([new_first, end, finish_loop, finished + finish], axis=1)


def pareto(states: np.ndarray, backward: float, on_compute: bool = True,
            block: int = 512) -> np.ndarray:
    """Indices of the rows whose states no other row dominates, in lexicographic order.

    Dominance compares (A, F, K, H) with K = max(Q, T_b + A + H) on compute
    (max(Q, T_b + H) off compute).  The final time is ``max(Q + R, X)``, where R is the
    rest's Σ finish and X, the other terms, is at least T_b + A + H + R (backward ends no
    earlier than T_b + A) and does not depend on Q; so replacing Q by K changes nothing,
    and the final time is non-decreasing in (A, F, K, H).  Rows are visited in lexicographic order of their keys, so a dominating key comes
    before every key it dominates; dominance being transitive, comparing each row with the
    kept earlier ones suffices.  Among equal keys the first row is kept.
    """
    added = states[:, 0] + states[:, 3] if on_compute else states[:, 3]
    keys = np.column_stack([states[:, 0], states[:, 1],
                            np.maximum(states[:, 2], backward + added), states[:, 3]])
    order = np.lexsort(keys.T[::-1])
    keys = keys[order]
    kept_rows, kept_keys = [], np.zeros((0, 4))
    earlier = np.tri(block, block, -1, dtype=bool)
    for begin in range(0, len(keys), block):
        rows = keys[begin:begin + block]
        size = len(rows)
        dominated = (rows[None, :, :] <= rows[:, None, :]).all(axis=2)
        dominated &= earlier[:size, :size]
        dominated = dominated.any(axis=1)
        if len(kept_keys):
            dominated |= (kept_keys[None, :, :] <= rows[:, None, :]).all(axis=2).any(axis=1)
        kept_rows.append(order[begin:begin + size][~dominated])
        kept_keys = np.concatenate([kept_keys, rows[~dominated]])
    return np.concatenate(kept_rows)
