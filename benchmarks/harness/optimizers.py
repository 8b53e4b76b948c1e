"""The user's optimizer in the convergence benchmark: SGD or AdamW, and how a compressor's
recipe and momentum roles apply to each.

Every accuracy row used to train with SGD, while people train language models with AdamW;
``benchmarks/convergence.py --optimizer adamw`` trains the same rows under AdamW, so a
compressor's quality can be measured under the optimizer it will meet.

A compressor's recipe (:mod:`mergecomp.compressors.recipes`) is written against dense SGD.
Under AdamW the benchmark applies the parts that are about the exchange — the smallest
ratio, the memory and its arguments, where to clip or not to clip — and leaves out the
parts that are about SGD's step size: ``lr_scale`` and ``max_lr`` (signSGD's step is ±lr
per coordinate, which AdamW's normalised step already is; an unbiased sparsifier's
1/ratio larger steps are divided by AdamW's second moment) and ``fold_momentum`` (folding
corrects heavy-ball momentum, which sums a burst the residual releases into ten steps'
worth of movement at m = 0.9; AdamW's first moment is an average, not a sum).

The momentum goes where a user told by the components would put it:

- SGD: as :mod:`benchmarks.convergence` always did (the recipe's fold, a memory that takes
  SGD's momentum over, a component that owns a momentum and gets SGD without one);
- AdamW: as the library treats a user's AdamW.  DGC's memory takes AdamW's first moment
  over (:func:`mergecomp.momentum.take_over_momentum`): AdamW keeps its betas and steps at
  β1 = 0 while the memory runs β1, and so do top-k's and GradDrop's default memory (the
  residual with ``adam=True``); a residual that follows SGD's momentum only leaves Adam's
  moments to Adam and is plain error feedback; a component that owns a momentum (SIGNUM, DeMo's memory) refuses AdamW's
  first moment, so AdamW gets ``betas[0] = 0`` and the component keeps its own momentum,
  as its refusal says to do.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from mergecomp import momentum as momentum_roles

OPTIMIZERS = ("sgd", "adamw")

#: Dense learning rate per optimizer and task, from sweeps of dense alone (the READMEs of
#: the results folders record them; docs/results.md cites them).  SGD's: momentum 0.9.
#: A task missing here has no swept value yet: ``--lr`` is required for it.
DENSE_LR = {
    "sgd": {"digits": 0.05, "char-lstm": 2.0, "char-gpt": 0.125},
    # char-lstm: 0.001, 0.003, 0.01 tried at 4 workers, batch 12, cosine over 1,500 steps
    # (benchmarks/results/2026-11-27-quality-control/adamw-sweep); 0.01 best, at the sweep's edge
    "adamw": {"char-lstm": 0.01},
}
#: AdamW's weight decay and betas per task, from the same sweeps; torch's defaults
#: (0.01, (0.9, 0.999)) for a task not swept.
ADAMW_SETTINGS = {}
TORCH_ADAMW = dict(weight_decay=0.01, betas=(0.9, 0.999))


def dense_lr(optimizer: str, task: str) -> Optional[float]:
    """The swept dense learning rate of ``task`` under ``optimizer``, or None."""
    return DENSE_LR[check_name(optimizer)].get(task)


def adamw_settings(task: str) -> dict:
    """AdamW's ``weight_decay`` and ``betas`` for ``task``: swept, or torch's defaults."""
    return dict(ADAMW_SETTINGS.get(task, TORCH_ADAMW))


def check_name(optimizer: str) -> str:
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    return optimizer


@dataclass(frozen=True)
class Hyper:
    """Dense's optimizer settings for a table: which optimizer and its hyperparameters.
    ``momentum`` is SGD's; ``betas`` and ``weight_decay`` are AdamW's (SGD's weight decay
    is 0, as the benchmark always trained)."""

    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    betas: Tuple[float, float] = (0.9, 0.999)


@dataclass(frozen=True)
class RowSettings:
    """What one row's optimizer gets: its learning rate, SGD's momentum or AdamW's betas,
    and where the momentum went (the table's words: ``optimizer``, ``taken over``,
    ``folded into lr``, ``compressor/memory``, ``none``, ``adam``, ``adam (plain error
    feedback)``, ``adam, β1 in the compressor or memory``, ``adam, β1 taken over by the
    memory``, ``adam, β1 off (folded by the memory)`` or ``(folded by the compressor)``)."""

    lr: float
    momentum: float
    betas: Tuple[float, float]
    momentum_in: str


def row_settings(hyper: Hyper, recipe, compressor, memory, spec_lr_scale: Optional[float],
                 spec_momentum: Optional[float]) -> RowSettings:
    """The learning rate and momentum of one row under ``hyper``'s optimizer, the recipe
    (None: not applied) and the components' momentum roles; a spec's own ``lr_scale`` or
    ``momentum`` (AdamW: ``betas[0]``) wins."""
    if hyper.optimizer == "adamw":
        return _adamw_row(hyper, memory, compressor, spec_lr_scale, spec_momentum)
    lr = (recipe.learning_rate(hyper.lr) if spec_lr_scale is None and recipe
          else hyper.lr * (spec_lr_scale if spec_lr_scale is not None else 1.0))
    if spec_momentum is not None:
        momentum, where = spec_momentum, "optimizer" if spec_momentum else "none"
    elif recipe is not None and recipe.fold_momentum and hyper.momentum:
        momentum, where = 0.0, "folded into lr"  # before the next case: DeMo's memory owns it too
        if spec_lr_scale is None:
            lr = recipe.learning_rate(hyper.lr, hyper.momentum)
    elif momentum_roles.role(memory) == momentum_roles.TAKES_OVER and hyper.momentum:
        # the memory applies SGD's momentum, or folds it into lr at each step (EF-SignSGD's)
        momentum, where = hyper.momentum, ("folded into lr by the memory" if getattr(memory, "folds", False)
                                           else "taken over")
    elif _owns_momentum(compressor, memory):
        momentum, where = 0.0, "compressor/memory"
    else:
        momentum, where = hyper.momentum, "optimizer"
    return RowSettings(lr, momentum, hyper.betas, where)


def _adamw_row(hyper: Hyper, memory, compressor, spec_lr_scale, spec_momentum) -> RowSettings:
    lr = hyper.lr * (spec_lr_scale if spec_lr_scale is not None else 1.0)
    beta1 = hyper.betas[0] if spec_momentum is None else spec_momentum
    betas = (beta1, hyper.betas[1])
    if beta1 and _owns_momentum(compressor, memory):
        return RowSettings(lr, 0.0, (0.0, hyper.betas[1]), "adam, β1 in the compressor or memory")
    if beta1 and getattr(compressor, "folds_adam", False):  # PowerSGD's error feedback
        return RowSettings(lr, 0.0, betas, "adam, β1 off (folded by the compressor)")
    if momentum_roles.role(memory) == momentum_roles.TAKES_OVER:
        if getattr(memory, "folds", False):
            return RowSettings(lr, 0.0, betas, "adam, β1 off (folded by the memory)" if beta1 else "adam")
        if getattr(memory, "follows_optimizer", False) and not getattr(memory, "adam", False):
            # takes SGD's only: Adam keeps its moments
            return RowSettings(lr, 0.0, betas, "adam (plain error feedback)")
        if beta1:
            return RowSettings(lr, 0.0, betas, "adam, β1 taken over by the memory")
    return RowSettings(lr, 0.0, betas, "adam")


def _owns_momentum(compressor, memory) -> bool:
    """True when the compressor or memory applies a momentum of its own and refuses an
    optimizer that has one (SIGNUM, DeMo's memory)."""
    return any(momentum_roles.role(c) == momentum_roles.OWNS for c in (compressor, memory))


def make(hyper: Hyper, parameters, row: RowSettings) -> torch.optim.Optimizer:
    """The user's optimizer for one row: SGD(lr, momentum) or AdamW(lr, betas, weight_decay)."""
    if hyper.optimizer == "adamw":
        return torch.optim.AdamW(parameters, lr=row.lr, betas=row.betas, weight_decay=hyper.weight_decay)
    return torch.optim.SGD(parameters, lr=row.lr, momentum=row.momentum, weight_decay=hyper.weight_decay)


def describe(hyper: Hyper) -> str:
    """A table's words for dense's optimizer: ``SGD lr 2 momentum 0.9`` or
    ``AdamW lr 0.003 betas (0.9, 0.999) weight decay 0.1``."""
    if hyper.optimizer == "adamw":
        return (f"AdamW lr {hyper.lr:g} betas ({hyper.betas[0]:g}, {hyper.betas[1]:g}) "
                f"weight decay {hyper.weight_decay:g}")
    decay = f" weight decay {hyper.weight_decay:g}" if hyper.weight_decay else ""
    return f"SGD lr {hyper.lr:g} momentum {hyper.momentum:g}{decay}"


def parse_betas(text: str) -> Tuple[float, float]:
    """``"0.9,0.999"`` → (0.9, 0.999); ValueError saying what is wrong otherwise."""
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 2 or not all(0.0 <= v < 1.0 for v in values):
        raise ValueError(f"--betas takes two numbers in [0, 1) separated by a comma, like "
                         f"0.9,0.999, got {text!r}")
    return values  # type: ignore[return-value]
