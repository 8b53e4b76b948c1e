"""Recipes: what a compressor needs that dense SGD's settings do not give it.

Most compressors train at the learning rate tuned for dense SGD, with their recommended
memory.  A few do not, and without being told a user sees a silent collapse (chance
accuracy, a NaN) rather than an error:

- the sign methods (signSGD, SIGNUM) move every coordinate by ±lr per step whatever the
  gradient's size, so their learning rate lives on Adam's scale, not SGD's;
- an unbiased sparsifier scales what it keeps by 1/ratio, so its steps are larger and
  noisier than SGD's by that factor, and the learning rate must shrink;
- error feedback over a random subset sends each coordinate about once every 1/ratio
  steps, so at a small ratio the update is that many steps stale;
- error feedback under the optimizer's momentum: the residual releases a coordinate's
  backlog in bursts (a sign method's or a threshold's capped steps, a random subset's
  late sends), and heavy-ball momentum applied *after* the exchange turns each burst into
  ten steps' worth of movement at m = 0.9.  The same step size with the momentum folded
  into the learning rate (SGD without momentum at lr / (1 − m)) trains at parity.

A compressor declares this as a class attribute ``recipe`` (a :class:`Recipe`, or None
when it trains at dense settings); an instance whose needs depend on its arguments sets
its own.  :func:`advice` compares a recipe with the optimizer the compressor is about to
drive and says, in one message, what contradicts it; :func:`warn_if_contradicted` issues
that message as a :class:`RecipeWarning`.  ``benchmarks/convergence.py`` applies every
recipe (the dense learning rate × ``lr_scale``) and its results are where the recipes'
values come from.
"""
from __future__ import annotations

import math
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional

import torch

from ..momentum import innermost
from ..registry import registry_of


class RecipeWarning(UserWarning):
    """A compressor's recipe contradicts the settings of the optimizer or memory it was given."""


@dataclass(frozen=True)
class Recipe:
    """The settings a compressor needs beyond dense SGD's.

    ``lr_scale``: multiply the learning rate tuned for dense SGD by this.
    ``max_lr``: for compressors whose step size is absolute (±lr per coordinate), the
    learning rate above which :func:`advice` flags the optimizer, whatever its dense value.
    ``min_ratio``: the smallest ``compress_ratio`` at which it trains; :func:`advice` flags
    a smaller one.
    ``memory``: the memory it must be paired with; :func:`advice` flags another.
    ``fold_momentum``: train with SGD without momentum at lr / (1 − m), the heavy-ball
    momentum m folded into the learning rate (the same steady-state step); :func:`advice`
    flags an optimizer with momentum.
    ``memory_kwargs``: arguments for that memory beyond its defaults.
    ``local_clipping``: where the training loop clips the gradient norm to c, clip each
    rank's own gradient before it is accumulated instead (the memory's ``clip_norm`` at
    c / √N for N ranks), not the averaged gradient after the exchange.
    ``no_clipping``: do not clip the gradient norm at all: the averaged update is a vote of
    ±1 per coordinate whose norm is √n whatever the gradient, so clipping it to a gradient's
    norm c shrinks every step by √n / c (and clipping a rank's gradient before its sign
    changes nothing).
    ``reason``: one sentence, why dense settings fail.  ``paper``: what the paper advises.
    """

    reason: str
    paper: str = ""
    lr_scale: float = 1.0
    max_lr: Optional[float] = None
    min_ratio: Optional[float] = None
    memory: Optional[str] = None
    fold_momentum: bool = False
    memory_kwargs: Optional[Mapping[str, Any]] = None
    local_clipping: bool = False
    no_clipping: bool = False

    def __post_init__(self):
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise ValueError("a recipe needs a reason: one sentence saying why dense settings fail")
        if not (isinstance(self.lr_scale, (int, float)) and 0 < self.lr_scale < math.inf):
            raise ValueError(f"recipe lr_scale must be a positive finite number, got {self.lr_scale!r}")
        if self.max_lr is not None and not (isinstance(self.max_lr, (int, float)) and self.max_lr > 0):
            raise ValueError(f"recipe max_lr must be a positive number or None, got {self.max_lr!r}")
        if self.min_ratio is not None and not (isinstance(self.min_ratio, (int, float))
                                               and 0 < self.min_ratio <= 1):
            raise ValueError(f"recipe min_ratio must be in (0, 1] or None, got {self.min_ratio!r}")

    def learning_rate(self, dense_lr: float, dense_momentum: float = 0.0) -> float:
        """The learning rate to use where dense SGD uses ``dense_lr`` with momentum
        ``dense_momentum`` (which :attr:`fold_momentum` folds in), never above
        :attr:`max_lr`: a step size that is absolute does not follow dense SGD's learning
        rate from one model to the next, so where the scaled value passes the bound (a
        model whose dense learning rate is large), the bound is the value to use."""
        if not 0.0 <= dense_momentum < 1.0:
            raise ValueError(f"dense_momentum must be in [0, 1), got {dense_momentum!r}")
        lr = dense_lr * self.lr_scale
        lr = lr / (1.0 - dense_momentum) if self.fold_momentum else lr
        return lr if self.max_lr is None else min(lr, self.max_lr)

    def momentum(self, dense_momentum: float) -> float:
        """The optimizer momentum to use where dense SGD uses ``dense_momentum``."""
        return 0.0 if self.fold_momentum else dense_momentum

    def describe(self) -> str:
        """One line: the settings, then the reason."""
        parts = []
        if self.lr_scale != 1.0:
            parts.append(f"lr × {self.lr_scale:g}")
        if self.max_lr is not None:
            parts.append(f"lr ≤ {self.max_lr:g}")
        if self.min_ratio is not None:
            parts.append(f"compress_ratio ≥ {self.min_ratio:g}")
        if self.memory is not None:
            arguments = ", ".join(f"{k}={v!r}" for k, v in (self.memory_kwargs or {}).items())
            parts.append(f"memory {self.memory!r}" + (f" ({arguments})" if arguments else ""))
        if self.local_clipping:
            parts.append("gradient clipping local, before accumulation (memory clip_norm = your "
                         "clip / √N), not on the averaged gradient")
        if self.fold_momentum:
            parts.append("momentum folded into lr (SGD momentum 0, lr / (1 − m))")
        if self.no_clipping:
            parts.append("no gradient-norm clipping (the averaged update is a ±1 vote of norm √n)")
        return f"{', '.join(parts) or 'dense settings'}: {self.reason}"


def recipe_of(compressor) -> Optional[Recipe]:
    """The compressor's (or compressor class's) recipe, or None when it has none."""
    recipe = getattr(compressor, "recipe", None)
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"{type(compressor).__name__}.recipe must be a "
                        f"mergecomp.compressors.recipes.Recipe or None, got {type(recipe).__name__}")
    return recipe


def _memory_name(memory) -> Optional[str]:
    if memory is None or isinstance(memory, str):
        return memory
    memories = registry_of("memory")
    for name in memories.available():
        if type(memory) is memories.get(name):
            return name
    return getattr(memory, "name", type(memory).__name__)


#: Optimizers whose step is normalised per coordinate, so that lr is already its size.
_PER_COORDINATE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam,
                   torch.optim.Adamax, torch.optim.RMSprop, torch.optim.Adagrad)


def advice(compressor, optimizer, memory=None) -> Optional[str]:
    """What in ``optimizer``'s settings (and ``memory``, a name or instance, when given)
    contradicts ``compressor``'s recipe, as one message with what to do; None when nothing
    does or the compressor has no recipe.

    A learning rate is judged only against an absolute bound (``max_lr``): how large the
    dense learning rate of the user's model is, this function cannot know.  An adaptive
    optimizer's (an Adam's, RMSprop's) is not judged: its step is already about ±lr per
    coordinate, the scale the bound is about, so its own tuned rate applies.
    """
    recipe = recipe_of(compressor)
    if recipe is None:
        return None
    problems: List[str] = []
    if recipe.max_lr is not None and not isinstance(innermost(optimizer), _PER_COORDINATE):
        for index, group in enumerate(getattr(optimizer, "param_groups", [])):
            lr = group.get("lr")
            if isinstance(lr, (int, float)) and lr > recipe.max_lr:
                problems.append(f"parameter group {index} of {type(optimizer).__name__} has "
                                f"lr={lr:g}, above the {recipe.max_lr:g} this compressor trains "
                                f"at; use lr = {_value_for(lr, recipe)}")
                break
    if recipe.fold_momentum and not getattr(memory, "folded", 0.0):  # a memory that folded it
        for index, group in enumerate(getattr(optimizer, "param_groups", [])):
            momentum, lr = group.get("momentum"), group.get("lr")
            if isinstance(momentum, (int, float)) and 0 < momentum < 1:
                folded = (f"{recipe.learning_rate(lr, momentum):g}: your {lr:g}"
                          f"{f' × {recipe.lr_scale:g}' if recipe.lr_scale != 1.0 else ''} "
                          f"/ (1 − {momentum:g})") if isinstance(lr, (int, float)) else "lr / (1 − m)"
                problems.append(f"parameter group {index} of {type(optimizer).__name__} has "
                                f"momentum={momentum:g}; fold it into the learning rate: "
                                f"momentum=0, lr = {folded}")
                break
    ratio = getattr(compressor, "compress_ratio", None)
    if recipe.min_ratio is not None and isinstance(ratio, (int, float)) and ratio < recipe.min_ratio:
        problems.append(f"compress_ratio={ratio:g} is below the {recipe.min_ratio:g} it needs; "
                        f"use compress_ratio ≥ {recipe.min_ratio:g} or a selecting compressor "
                        f"(topk, dgc)")
    paired = _memory_name(memory)
    if recipe.memory is not None and paired is not None and paired != recipe.memory:
        problems.append(f"it is paired with memory {paired!r}; use memory={recipe.memory!r}")
    if not problems:
        return None
    advised = f" The paper: {recipe.paper}" if recipe.paper else ""
    return f"{compressor!r}: {'; '.join(problems)}. Why: {recipe.reason.rstrip('.')}.{advised}"


def _value_for(lr: float, recipe: Recipe) -> str:
    """The learning rate to use where the optimizer has ``lr``, taken as dense SGD's: the
    recipe's scaling of it, with the arithmetic shown (``0.0005: your 0.05 × 0.01``)."""
    value = lr * recipe.lr_scale
    if value > recipe.max_lr:  # a dense lr so large that even its scaled value is too big
        return (f"{recipe.max_lr:g} (your {lr:g} × {recipe.lr_scale:g} = {value:g} is still above "
                f"it; was {lr:g} dense SGD's learning rate?)")
    return f"{value:g}: your {lr:g} × {recipe.lr_scale:g} (dense SGD's learning rate × the recipe's scale)"


def warn_if_contradicted(compressor, optimizer, memory=None, stacklevel: Optional[int] = None) -> Optional[str]:
    """Issue :func:`advice`'s message as a :class:`RecipeWarning` (and return it) when there
    is one.  The warning points at the first caller outside mergecomp (the user's line that
    built the wrapper or registered the hook) unless ``stacklevel`` says otherwise."""
    message = advice(compressor, optimizer, memory)
    if message is not None:
        warn(message, stacklevel=stacklevel)
    return message


def warn(message: str, stacklevel: Optional[int] = None) -> None:
    """Issue ``message`` (an :func:`advice`) as a :class:`RecipeWarning` pointing at the first
    caller outside mergecomp, unless ``stacklevel`` says otherwise."""
    warnings.warn(message, RecipeWarning,
                  stacklevel=stacklevel if stacklevel is not None else _first_level_outside_package())


def first_rank_of_job() -> bool:
    """Whether this process is rank 0 of its job, or runs alone: advice every rank would give
    alike (a compressor's, at its first step) is given once per job, on rank 0, rather than
    once per rank.  The rank comes from torch.distributed once it is initialised, else from
    the launcher's variables (torchrun's, Open MPI's, MPICH's, Horovod's)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    for variable in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "HOROVOD_RANK"):
        value = os.environ.get(variable, "").strip()
        if value:
            return value == "0"
    return True


def _first_level_outside_package() -> int:
    """``warnings.warn``'s stacklevel, counted from its caller here, of the first frame whose
    code is in neither the mergecomp package nor torch (a warning raised inside a step comes
    through torch's ``optimizer.step`` and autograd wrappers on its way from the user's line)."""
    import torch
    packages = tuple(os.path.dirname(os.path.abspath(module.__file__)) + os.sep
                     for module in (sys.modules[__name__.split(".")[0]], torch))
    frame, level = sys._getframe(1), 1  # warn
    while frame is not None and frame.f_code.co_filename.startswith(packages):
        frame, level = frame.f_back, level + 1
    return level
