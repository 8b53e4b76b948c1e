"""Rand-k's indices: the first k values of a keyed permutation of range(n), on any device.

Rand-k sends k values and no indices: every rank derives the same k indices from a key
shared through the seed (group name and step mixed in).  They must then be the same on
every rank *and every device*: a rank on a GPU and one on a CPU, or a run resumed on
other hardware, must pick the same coordinates.  A sampler with a generator (numpy's, or
torch's ``randperm``) gives neither on a GPU without drawing on the host and copying.
Here index j of the subset is π(j), π a pseudo-random bijection of [0, n) computed from
(key, j) alone: k independent evaluations, one per thread on a GPU
(:mod:`mergecomp.kernels.triton.subsets`), numpy's unsigned 32-bit loops on the CPU
(:func:`~mergecomp.kernels.numpy_cpu.feistel_subset`), torch ops on other devices: the same
integers everywhere.

The permutation is a balanced Feistel network on 2h bits, 2^(2h) ≥ n: a value is split
into its high and low h bits (L, R), and each of :data:`ROUNDS` rounds maps (L, R) to
(R, L xor F_r(R)), F_r(R) the top h bits of ``hash32(R xor K_r)`` (the counter hash of
:mod:`.hashing`), K_r 31 bits of ``splitmix64(key + r)`` (the rounds and their keys are
:mod:`.permutation`'s).  A Feistel network is a bijection whatever its round functions; a
value that lands at or above n is sent through the network again until it falls below n
("cycle walking", as format-preserving encryption does), which keeps a bijection of [0,
n).  The domain is less than 4n, so a value walks fewer than 4 times on average.  The k
indices are distinct because π is a bijection.

Unbiased: for a fixed input, two rounds with independent uniform round functions already
make the output uniform over the domain, so every index is drawn with probability k/n up
to the quality of the hash; more rounds make pairs of outputs independent too (with four,
counts of pairs of indices drawn together were still off by 5σ on a 20-element group; with
six they are within chance).  ``tests/test_triton_kernels.py`` counts indices and pairs
over many keys.

Cost on one CPU core, measured at 25M elements: 250,000 indices in about 24 ms and 2.5M in
about 450 ms, where numpy's ``Generator.choice``, which drew them before, took about 42 ms
and 1.6 s on the same (shared, noisy) machine; on a GPU, one kernel.
"""
from __future__ import annotations

import torch

from . import numpy_cpu
from .hashing import HASH_MULTIPLIERS
from .permutation import MAX_NUMEL, ROUNDS, check_subset, half_bits, round_keys

__all__ = ["MAX_NUMEL", "ROUNDS", "check_subset", "feistel", "half_bits", "random_subset",
           "round_keys", "torch_subset"]


def _hash32(words: torch.Tensor) -> torch.Tensor:
    """``hashing.hash32`` of int64 words holding values in [0, 2^32).  Each product is taken
    as low·m + ((high·m) mod 2^16)·2^16 on the 16-bit halves, so no int64 overflows."""
    for multiplier in HASH_MULTIPLIERS:
        low, high = words & 0xFFFF, words >> 16
        words = (low * multiplier + (((high * multiplier) & 0xFFFF) << 16)) & 0xFFFFFFFF
        words = words ^ (words >> 16)
    return words


def feistel(values: torch.Tensor, half: int, keys) -> torch.Tensor:
    """One pass of the network over int64 ``values`` in [0, 2^(2·half))."""
    left, right = values >> half, values & ((1 << half) - 1)
    for round_key in keys:
        left, right = right, left ^ (_hash32(right ^ round_key) >> (32 - half))
    return (left << half) | right


def random_subset(numel: int, k: int, key: int, device) -> torch.Tensor:
    """k distinct int64 indices of range(``numel``) on ``device``: π(0), ..., π(k − 1) for the
    permutation π of ``key`` (any integer; taken modulo 2^64).  The same integers on every
    device for the same (numel, k, key); a CUDA device draws them in one Triton kernel where
    Triton is present.
    """
    check_subset(numel, k)
    from . import triton as triton_backend
    if k and triton_backend.usable_on(device):
        from .triton.subsets import random_subset as on_gpu
        return on_gpu(numel, k, key, device)
    if torch.device(device).type == "cpu":
        return numpy_cpu.feistel_subset(numel, k, half_bits(numel), round_keys(key))
    return torch_subset(numel, k, key, device)


def torch_subset(numel: int, k: int, key: int, device) -> torch.Tensor:
    """:func:`random_subset` in torch ops on ``device`` (int64 words: no uint32 type needed):
    the path of devices without Triton, and the reference the other paths are tested against."""
    check_subset(numel, k)
    half, keys = half_bits(numel), round_keys(key)
    values = feistel(torch.arange(k, dtype=torch.int64, device=device), half, keys)
    outside = (values >= numel).nonzero().view(-1)
    while outside.numel():  # cycle walking: only the values still outside go round again
        walked = feistel(values[outside], half, keys)
        values[outside] = walked
        outside = outside[walked >= numel]
    return values
