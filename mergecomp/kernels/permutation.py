"""The parameters of rand-k's keyed permutation, shared by each of its backends.

The permutation itself (a balanced Feistel network with cycle walking, and why) is
described in :mod:`mergecomp.kernels.subsets`, which picks a backend per device; the
torch path there, numpy's loops and the Triton kernel
(:mod:`mergecomp.kernels.triton.subsets`) all read its round count, its halves' width and
its round keys from here, so that they draw the same integers.
"""
from __future__ import annotations

from .hashing import MASK64, splitmix64

#: Feistel rounds: two already make one output uniform; six make pairs of outputs
#: independent as far as counts over many keys can tell.
ROUNDS = 6

#: The permutation works on 32-bit words: at most 2^32 elements.
MAX_NUMEL = 1 << 32


def half_bits(numel: int) -> int:
    """h, the width of each Feistel half: the smallest h ≥ 1 with 2^(2h) ≥ ``numel``."""
    return max(1, ((int(numel) - 1).bit_length() + 1) // 2)


def round_keys(key: int):
    """The :data:`ROUNDS` 31-bit round keys of a 64-bit ``key``."""
    return tuple(splitmix64((int(key) + r) & MASK64) >> 33 for r in range(ROUNDS))


def check_subset(numel: int, k: int) -> None:
    """ValueError unless 0 ≤ k ≤ numel ≤ :data:`MAX_NUMEL`."""
    if not 0 <= int(k) <= int(numel):
        raise ValueError(f"a random subset of {numel} elements cannot hold {k}: need 0 ≤ k ≤ n")
    if int(numel) > MAX_NUMEL:
        raise ValueError(f"rand-k's index permutation covers at most 2^32 elements, got a group of "
                         f"{numel}: split the group (a smaller schedule's groups, or more of them)")
