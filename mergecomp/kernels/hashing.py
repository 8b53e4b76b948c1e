"""The integer hashes behind every counter-based random stream of the kernels.

A counter-based stream draws element i's bits as hash(key, i): no generator state to
carry, the same bits on any device and in any order, and a key per step is all the state
a compressor keeps.  Two hashes, each written once per backend (torch, numpy, C, Triton)
with the same bits:

* the tail of C. Wellons' "lowbias32" (:data:`HASH_MULTIPLIERS`: multiply, xor-shift by
  16, multiply, xor-shift by 16), a bijection of 32-bit words that mixes every input bit
  into both halves: the quantisers' rounding bits (:func:`~mergecomp.kernels.random_int16`)
  and the round function of rand-k's index permutation (:mod:`~mergecomp.kernels.subsets`);
* SplitMix64's finaliser (:func:`splitmix64`), for the 64-bit keys themselves (per group
  and step, from a seed).
"""
from __future__ import annotations

#: The two multipliers of lowbias32's last four steps, as unsigned 32-bit words.
HASH_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)

#: Mask of a 64-bit word.
MASK64 = (1 << 64) - 1


def as_int32(word: int) -> int:
    """An unsigned 32-bit word as the signed int32 with the same bits (for torch's int32 ops)."""
    return word - (1 << 32) if word >= 1 << 31 else word


def splitmix64(value: int) -> int:
    """The SplitMix64 finaliser (Steele et al., OOPSLA 2014): a bijection of 64-bit words that
    mixes every input bit into every output bit."""
    value = (value + 0x9E3779B97F4A7C15) & MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK64
    return value ^ (value >> 31)


def hash32(word: int) -> int:
    """The lowbias32 tail of one unsigned 32-bit word, in Python (for tests and small keys)."""
    for multiplier in HASH_MULTIPLIERS:
        word = (word * multiplier) & 0xFFFFFFFF
        word ^= word >> 16
    return word
