"""What the PowerSGD compressors share: orthonormalisation, seeded starting queries,
argument checks."""
from __future__ import annotations

import hashlib
import math

import torch

from ..momentum import fold_adam_first_moment


def orthonormalize(matrix: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of the columns of ``matrix`` (a new tensor).

    Householder QR (``torch.linalg.qr``), the orthogonalisation PyTorch's PowerSGD hook
    uses for ranks above 2.  It needs no epsilon: a zero or dependent column yields another
    orthonormal column, never a division by a vanishing norm, so a zero gradient stays
    finite (Gram-Schmidt, PyTorch's choice for ranks 1 and 2, divides by each column's norm
    and needs ``orthogonalization_epsilon`` to avoid NaN), and the basis is orthonormal to
    working precision even when the matrix has lower rank than asked for.
    """
    return torch.linalg.qr(matrix, mode="reduced").Q


def seeded_normal(key: str, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    """A ``rows × cols`` standard normal draw determined by ``key`` alone, identical on every
    rank (the generator is the CPU one, so devices agree too), on ``like``'s device and dtype."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
    return torch.randn(rows, cols, generator=generator, dtype=like.dtype).to(like.device)


def check_rank(rank, who: str) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{who} rank must be a positive integer, got {rank!r}; 1 to 4 is usual")
    return rank


def check_flag(value, what: str, who: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{who} {what} must be True or False, got {value!r}")
    return value


def check_rate(rate, who: str) -> float:
    try:
        value = float(rate)
    except (TypeError, ValueError):
        value = float("nan")
    if isinstance(rate, bool) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{who} min_compression_rate must be a finite number ≥ 0, got {rate!r}; "
                         "2 (the default) factors a matrix only when that halves its bytes, 0 "
                         "factors every matrix")
    return value


class FoldsAdamFirstMoment:
    """Mixin of the PowerSGD compressors: with their error feedback on, an Adam's or AdamW's
    first moment is taken off (it steps at β1 = 0; :func:`~mergecomp.momentum.fold_adam_first_moment`).

    Why: the error feedback releases what a rank could not send in later steps, and a first
    moment after the exchange multiplies each release, as it does a residual memory's
    (EF-SignSGD's).  Measured on the character LSTM and GPT under AdamW, PowerSGD at β1 = 0
    kept up with dense where with β1 it trailed (docs/results.md#adamw-more-quantisers).
    SGD's heavy-ball momentum stays with SGD: PowerSGD's paper applies it after the exchange."""

    @property
    def folds_adam(self) -> bool:
        """Whether an Adam's first moment is taken off: with error feedback on."""
        return bool(self.error_feedback)

    def check_optimizer(self, optimizer) -> None:
        """Take an Adam's first moment off when :attr:`folds_adam` (nothing otherwise)."""
        if self.folds_adam:
            fold_adam_first_moment(optimizer, f"{type(self).__name__}'s error feedback")
