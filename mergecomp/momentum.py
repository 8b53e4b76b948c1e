"""Refusing a second momentum.

DGC's memory (momentum correction) and SIGNUM (sign of momentum) keep the momentum
themselves.  If the wrapped optimizer also had one — SGD's ``momentum`` or Adam's first
moment ``betas[0]`` — gradients would be smoothed twice, silently.  Components that own
the momentum call :func:`refuse_optimizer_momentum` from their ``check_optimizer``, or,
for SGD's heavy-ball momentum (and Adam's first moment), :func:`take_over_momentum` (the
``dgc`` memory; the residual memory that follows SGD's momentum).
"""
from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Tuple

import torch


#: ``momentum_role`` of a component that applies a momentum of its own and refuses an optimizer
#: with one (SIGNUM, DeMo's memory).
OWNS = "owns"
#: ``momentum_role`` of a component that takes the optimizer's momentum over (:func:`take_over_momentum`).
TAKES_OVER = "takes over"


def role(component) -> Optional[str]:
    """What ``component`` does with the optimizer's momentum: :data:`OWNS`, :data:`TAKES_OVER`,
    or None (it leaves it to the optimizer, after the exchange)."""
    return getattr(component, "momentum_role", None)


def optimizer_momentum(optimizer) -> List[Tuple[int, str, float]]:
    """(group index, setting, value) for every parameter group that carries a momentum."""
    found = []
    for index, group in enumerate(getattr(optimizer, "param_groups", [])):
        momentum = group.get("momentum", 0) or 0
        if momentum > 0:
            found.append((index, "momentum", momentum))
        betas = group.get("betas")
        if betas and betas[0] > 0:
            found.append((index, "betas[0]", betas[0]))
    return found


def refuse_optimizer_momentum(optimizer, component: str, advice: str) -> None:
    """ValueError naming the group and setting when ``optimizer`` has its own momentum."""
    found = optimizer_momentum(optimizer)
    if found:
        index, setting, value = found[0]
        raise ValueError(
            f"{component} applies momentum itself, but parameter group {index} of "
            f"{type(optimizer).__name__} has {setting}={value}, which would apply a second one. "
            f"{advice}")


#: The attribute of an optimizer whose momentum a memory has taken over: its hooks' handles.
_TAKEN = "_mergecomp_momentum_taken"

#: Where a framework's optimizer wrapper keeps the optimizer it wraps: Accelerate's
#: ``AcceleratedOptimizer`` and mergecomp's ``DistributedOptimizer`` (``optimizer``),
#: Lightning's ``LightningOptimizer`` (``_optimizer``).
_WRAPPED = ("optimizer", "_optimizer")


def innermost(optimizer):
    """The optimizer that really steps inside ``optimizer``'s wrappers: followed through an
    attribute of :data:`_WRAPPED` for as long as it holds a ``torch.optim.Optimizer`` with the
    very same ``param_groups`` (a wrapper that shares them, rather than an object that merely
    owns another optimizer)."""
    seen = {id(optimizer)}
    while True:
        inner = next((getattr(optimizer, name) for name in _WRAPPED
                      if isinstance(getattr(optimizer, name, None), torch.optim.Optimizer)), None)
        if inner is None or id(inner) in seen or inner.param_groups is not optimizer.param_groups:
            return optimizer
        seen.add(id(inner))
        optimizer = inner


def _named(optimizer, inner) -> str:
    """``inner``'s class, and the wrapper's when they differ (for messages)."""
    if inner is optimizer:
        return type(inner).__name__
    return f"{type(inner).__name__} (inside {type(optimizer).__name__})"


def take_over_momentum(optimizer, memory, component: str, adam: bool = True) -> None:
    """Move the optimizer's momentum into ``memory`` (DGC's momentum correction) instead of
    refusing it, so that a training script keeps its ``SGD(momentum=0.9)`` or its ``AdamW``.

    Why: DGC's momentum correction (Lin et al., ICLR 2018, section 3.2) accumulates the
    velocity on each rank *before* the sparse exchange; the optimizer must then step on the
    exchanged velocities without a momentum of its own.  A user's optimizer is wrapped,
    never replaced, so rather than asking for a second optimizer the memory adopts the
    momentum every parameter group shares, and the optimizer's ``step()`` runs without it
    (hooks put the user's values back when it returns, so ``state_dict()``, schedulers and
    checkpoints see them unchanged).  What is taken over:

    - **SGD's heavy-ball momentum** ``m`` and Nesterov flag.  The memory runs the momentum
      in gradient units (``u ← m·u + (1 − m)·g``,
      :attr:`~mergecomp.memories.base.Memory.gradient_units`) and the step runs with
      ``momentum = 0`` at ``lr / (1 − m)``: the same steps as heavy-ball momentum at ``lr``,
      while what the exchange writes into ``p.grad`` keeps a gradient's scale.  A loop that
      clips the averaged gradient after the exchange, as under DDP, then clips at the scale
      it was tuned for; a velocity, up to 1/(1 − m) times larger, clipped at a gradient's
      threshold would shrink every step that much.  SGD's weight decay acts inside its
      momentum, so at ``lr / (1 − m)`` without momentum it has its steady-state effect
      unchanged.
    - **Adam's and AdamW's first moment** ``β1``, where ``adam`` (the ``dgc`` memory).
      ``u ← β1·u + (1 − β1)·g`` is Adam's first moment itself, so the memory runs it as its
      momentum correction and the optimizer steps with ``betas = (0, β2)`` at the user's
      ``lr``: Adam's second moment and its normalised step act on what the exchange
      delivered (1-bit Adam's compressed stage, Tang et al., ICML 2021, also compresses the
      momentum).  The first moment's bias correction is left out: at β1 = 0 Adam divides
      the delivered moment by the root of its own second moment, so a common scale cancels.
      Adam's coupled weight decay (``Adam(weight_decay=)``) then enters at β1 = 0, outside
      the moment; AdamW's is decoupled and unchanged.  Measured on an untuned character LSTM
      under AdamW, DGC with β1 taken over trains as well as with AdamW at β1 = 0 set by hand
      (what its refusal used to ask for).  The residual memory takes it over only with
      ``adam=True`` (top-k's), and then masks as DGC's does: without masking, β1 before the
      exchange trailed dense far more than plain error feedback before Adam's moments
      (docs/results.md#adamw-topk-default).

    A momentum schedule (OneCycleLR's ``momentum`` or ``betas``) is followed: each step's
    value is the memory's for the next exchange.  A framework's wrapper around the
    optimizer (Accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``) is
    looked through (:func:`innermost`): the optimizer inside is the one taken over.

    Refused (ValueError, with what to do): another optimizer with a momentum (RMSprop's,
    NAdam's, whose first moments are not these), parameter groups with different momenta
    or Nesterov flags (one memory serves every group), SGD's dampening, and a memory given a
    momentum of its own that differs from the optimizer's.  Nothing happens for an
    optimizer without momentum: the memory keeps its own.
    """
    found = optimizer_momentum(optimizer)
    if not found:
        return
    index, setting, value = found[0]
    # A framework's wrapper (Accelerate's, Lightning's) steps the optimizer it wraps: the
    # hooks go on that optimizer, where they run whichever object's step() the loop calls.
    wrapper, optimizer = optimizer, innermost(optimizer)
    kind = _kind_of(optimizer)
    if kind is None or (kind is _ADAM and not adam):
        takes = ("torch.optim.SGD's heavy-ball momentum and torch.optim.Adam's or AdamW's first moment"
                 if adam else "torch.optim.SGD's heavy-ball momentum")
        raise ValueError(
            f"{component} applies momentum itself, but parameter group {index} of "
            f"{_named(wrapper, optimizer)} has {setting}={value}, which would apply a second one; it "
            f"takes over only {takes}. Use one of those (its momentum moves into the memory), or set "
            f"{setting} to 0 and give the momentum to the memory.")
    momentum, nesterov = kind.shared(optimizer, component)
    memory.adopt_momentum(momentum, nesterov)
    memory.gradient_units = True
    memory.momentum_source = "adam" if kind is _ADAM else "sgd"
    if getattr(optimizer, _TAKEN, None) is None:
        setattr(optimizer, _TAKEN, _install_hooks(optimizer, memory, component, kind))
    else:  # a second vetting (a framework's second fit): the hooks follow this memory
        getattr(optimizer, _TAKEN)["memory"] = memory


class _FoldedFirstMoment:
    """Where :func:`take_over_momentum` puts the first moment that :func:`fold_adam_first_moment`
    takes off: nowhere, as a memory that folds it applies none."""

    gradient_units = False  # set by take_over_momentum, as on a memory; nothing reads it

    def adopt_momentum(self, momentum: float, nesterov: bool, follow: bool = False) -> None:
        pass


def fold_adam_first_moment(optimizer, component: str) -> None:
    """Run an Adam's or AdamW's ``step()`` at β1 = 0 (the user's betas stay in its
    ``param_groups``, as :func:`take_over_momentum` does); nothing for another optimizer, or
    for an Adam whose groups have different first moments (it then keeps them).  For a
    compressor whose own error feedback releases its backlog through the exchange
    (PowerSGD's): a first moment after the exchange multiplies each release, as it does a
    residual memory's (the ``residual`` memory's ``momentum="fold"``)."""
    if not is_adam(optimizer):
        return
    try:
        take_over_momentum(optimizer, _FoldedFirstMoment(), component, adam=True)
    except ValueError:  # groups with different β1: the step hooks serve one shared value
        pass


def _shared_momentum(optimizer, component: str) -> Tuple[float, bool]:
    """The momentum and Nesterov flag every parameter group of ``optimizer`` has; ValueError
    naming the groups that differ, or a dampening."""
    groups = optimizer.param_groups
    for index, group in enumerate(groups):
        if group.get("dampening", 0):
            raise ValueError(
                f"{component} takes over SGD's momentum, but parameter group {index} has "
                f"dampening={group['dampening']}, which momentum correction does not apply. "
                f"Use dampening=0.")
    settings = [(float(g.get("momentum", 0) or 0), bool(g.get("nesterov", False))) for g in groups]
    if len(set(settings)) > 1:
        listed = ", ".join(f"group {i}: momentum={m:g}, nesterov={n}" for i, (m, n) in enumerate(settings))
        raise ValueError(
            f"{component} takes over SGD's momentum into one memory for every parameter, but the "
            f"parameter groups differ ({listed}). Give every group the same momentum and nesterov.")
    return settings[0]


def _shared_first_moment(optimizer, component: str) -> Tuple[float, bool]:
    """The β1 every parameter group of an Adam or AdamW shares (and no Nesterov flag);
    ValueError naming the groups that differ."""
    beta1s = [float(g["betas"][0]) for g in optimizer.param_groups]
    if len(set(beta1s)) > 1:
        listed = ", ".join(f"group {i}: betas[0]={b:g}" for i, b in enumerate(beta1s))
        raise ValueError(
            f"{component} takes over Adam's first moment into one memory for every parameter, but "
            f"the parameter groups differ ({listed}). Give every group the same betas[0].")
    return beta1s[0], False


class _Kind(NamedTuple):
    """How one optimizer family's momentum is taken over: the momentum and Nesterov flag its
    groups share, the group settings a step changes, and their values for that step."""
    shared: Callable
    settings: Tuple[str, ...]
    neutral: Callable  # group → {setting: value for a step without the momentum}


_SGD = _Kind(_shared_momentum, ("momentum", "lr"),
             lambda g: {"momentum": 0.0, "lr": g["lr"] / (1.0 - g["momentum"])} if g["momentum"] else {})
_ADAM = _Kind(_shared_first_moment, ("betas",),
              lambda g: {"betas": (0.0 if isinstance(g["betas"][0], float) else torch.zeros_like(g["betas"][0]),
                                   g["betas"][1])} if float(g["betas"][0]) else {})


def is_adam(optimizer) -> bool:
    """Whether ``optimizer`` (looked through a framework's wrapper) is an Adam or AdamW with a
    first moment (β1 > 0): the momentum :func:`take_over_momentum` takes as Adam's."""
    return is_adam_kind(optimizer) and bool(optimizer_momentum(optimizer))


def is_adam_kind(optimizer) -> bool:
    """Whether ``optimizer`` (looked through a framework's wrapper) is an Adam or AdamW, with
    or without a first moment: one that scales each coordinate by its own second moment."""
    return optimizer is not None and _kind_of(innermost(optimizer)) is _ADAM


def _kind_of(optimizer) -> Optional[_Kind]:
    """How ``optimizer``'s momentum is taken over, or None where it cannot be (AdamW is an
    Adam in torch)."""
    if isinstance(optimizer, torch.optim.SGD):
        return _SGD
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return _ADAM
    return None


def _install_hooks(optimizer, memory, component: str, kind: _Kind) -> dict:
    """Step hooks that run ``optimizer.step()`` without its momentum (SGD at lr / (1 − m),
    Adam at β1 = 0), and put the user's values back after it (or before anything reads
    them, if a step raised)."""
    taken = {"memory": memory, "saved": None, "handles": []}

    def restore(*_):
        saved, taken["saved"] = taken["saved"], None
        for group, values in zip(optimizer.param_groups, saved or ()):
            group.update(values)

    def before_step(*_):
        restore()  # a step that raised left them changed
        momentum, nesterov = kind.shared(optimizer, component)
        taken["memory"].adopt_momentum(momentum, nesterov, follow=True)
        taken["saved"] = [{key: g[key] for key in kind.settings} for g in optimizer.param_groups]
        for group in optimizer.param_groups:
            group.update(kind.neutral(group))

    taken["handles"] = [optimizer.register_step_pre_hook(before_step),
                        optimizer.register_step_post_hook(restore),
                        optimizer.register_state_dict_pre_hook(restore)]
    return taken
