"""DiLoCo: H local steps with the user's optimizer, then one outer step on the averaged change.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023
(Algorithm 1); streaming fragments and overlapped exchange from "Streaming DiLoCo with
overlapping communication", 2025; SparseLoCo (2025) is this with top-k, a 2-bit quantiser
and error feedback on the pseudo-gradient.

Every rank holds the same *anchor* θ̄ (the weights of the last outer step).  Between two
exchanges each rank trains alone with its *inner* optimizer; then, per fragment,

    Δᵢ = θ̄ − θᵢ                       this rank's pseudo-gradient (the weights' change)
    Δ̄  = average over ranks of Δᵢ       through the configured compressor, memory, communicator
    θ̄  ← outer_step(θ̄, Δ̄)               SGD with Nesterov momentum (lr 0.7, momentum 0.9)
    θᵢ ← (1 − mix)·θ̄ + mix·θᵢ           every rank restarts from the new anchor (mix = 0)

so an exchange sends one compressed copy of the fragment every ``sync_every`` inner steps
instead of one gradient per step.  With ``overlap`` > 0 the exchange runs behind the next
``overlap`` inner steps; the local weights have moved on meanwhile, and the paper merges
them with the new anchor (``mix`` = 0.5 by default then: half the local progress of those
steps is kept).

The outer momentum and the inner one.  The paper's outer step (lr 0.7, Nesterov momentum
0.9) comes with an inner AdamW.  An inner SGD with heavy-ball momentum keeps its velocity
across the outer step: every rank restarts from the new anchor still moving along the last
H steps' direction, which the outer Nesterov step has just extrapolated, so that direction
is pushed twice, and at small H (many outer steps) the run stalls or diverges.  A plain
single-process simulation of Algorithm 1 does the same, so it is the recipe and not the
exchange.  With such an inner optimizer use an outer momentum of 0.5
(:func:`recommended_outer_momentum`; the constructor warns otherwise); with AdamW, or SGD
without momentum, the paper's 0.9.  docs/low-communication.md has the measurements.

Why a wrapper of the inner optimizer, like :class:`~mergecomp.DistributedOptimizer`: the
training loop stays ``loss.backward(); opt.step()``, LR schedulers and gradient clipping act
on the inner optimizer as usual, and the outer step, which is not a gradient step of the
user's, belongs to this object.  The exchange itself is the shared
:class:`~mergecomp.runtime.step.StepLifecycle`: a preflight of what ranks must agree on,
the non-finite check, commit or rollback of compressor and memory state.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch

from .. import arguments, checkpoint, communicators, compressors
from ..distributed.backends import Backend, default_backend
from ..communicators.base import Communicator
from ..compressors import recipes
from ..compressors.base import Compressor, ParamView
from ..memories.base import Memory, check_number
from ..runtime.agreement import RanksDisagree, describe_disagreement
from ..runtime.reducer import broadcast_tensors, config_digest
from ..runtime.step import StepLifecycle, check_nonfinite_policy
from ..momentum import optimizer_momentum
from .schedule import SyncSchedule, fragment_cuts

#: The outer momentum for an inner optimizer with heavy-ball momentum, and the paper's otherwise.
HEAVY_BALL_OUTER_MOMENTUM, PAPER_OUTER_MOMENTUM = 0.5, 0.9


def heavy_ball(optimizer) -> list:
    """(group, setting, value) of the inner optimizer's heavy-ball momentum (SGD's
    ``momentum``; Adam's first moment, whose steps are normalised, is not one)."""
    return [found for found in optimizer_momentum(optimizer)
            if found[1] == "momentum" and "betas" not in optimizer.param_groups[found[0]]]


def recommended_outer_momentum(optimizer) -> float:
    """The outer Nesterov momentum for this inner optimizer: 0.5 when it carries heavy-ball
    momentum (its velocity survives the outer step, see :class:`DiLoCo`), else the paper's 0.9."""
    return HEAVY_BALL_OUTER_MOMENTUM if heavy_ball(optimizer) else PAPER_OUTER_MOMENTUM


#: Format of the ``"mergecomp"`` part of a DiLoCo state dict.
STATE_FORMAT = 1
ADVICE = ("Nothing was loaded. Load an earlier checkpoint of this rank (every rank saves and "
          "loads its own: the local weights differ between exchanges)")


class Fragment:
    """A contiguous run of parameters exchanged together: their flat anchor, outer optimizer
    and the buffer their pseudo-gradient is formed in.

    An exchange is every H inner steps a handful of passes over the fragment, and nothing
    else: the pseudo-gradient is written parameter by parameter into ``delta``, a buffer
    kept from one exchange to the next (a new one each time would cost a fresh allocation
    of the fragment's size, page faults included), and the outer step and the merge write
    in place.  The price is one more copy of the fragment held between exchanges (two with
    overlap: the pseudo-gradient in flight is kept for a checkpoint taken meanwhile).
    """

    def __init__(self, index: int, params: List[Tuple[str, torch.nn.Parameter]], outer_lr: float,
                 outer_momentum: float, nesterov: bool):
        self.index, self.params = index, params
        dtypes = sorted({str(p.dtype) for _, p in params})
        if len(dtypes) > 1:
            raise ValueError(f"fragment {index} ({params[0][0]} .. {params[-1][0]}) mixes dtypes {dtypes}: "
                             "its pseudo-gradient is one flat buffer; use parameters of one dtype, or more "
                             "fragments so that a dtype change falls between two")
        offset, views = 0, []
        for name, p in params:
            views.append(ParamView(name, p.shape, offset))
            offset += p.numel()
        self.layout, self.numel = tuple(views), offset
        self.anchor = self.flat().clone()
        self.delta = torch.empty_like(self.anchor)
        self.kept: Optional[torch.Tensor] = None  # with overlap: the pseudo-gradient in flight, for checkpoints
        self.outer = torch.optim.SGD([self.anchor], lr=outer_lr, momentum=outer_momentum,
                                     nesterov=nesterov and outer_momentum > 0)

    def flat(self) -> torch.Tensor:
        """The local weights, as one new flat tensor."""
        return torch.cat([p.detach().reshape(-1) for _, p in self.params])

    def _pairs(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(anchor slice, delta slice, local weights) per parameter, in the parameter's shape."""
        for view, (_, p) in zip(self.layout, self.params):
            end = view.offset + view.numel
            yield self.anchor[view.offset:end].view(p.shape), self.delta[view.offset:end].view(p.shape), p.detach()

    def pseudo_gradient(self) -> torch.Tensor:
        """Δ = anchor − local weights, written into ``delta`` (one pass, no new tensor)."""
        for anchor, delta, local in self._pairs():
            torch.sub(anchor, local, out=delta)
        return self.delta

    def outer_step(self, average: torch.Tensor) -> None:
        """The outer SGD step on ``anchor`` with gradient ``average``: the arithmetic of
        ``torch.optim.SGD`` (its momentum buffer in ``outer.state``, so checkpoints are the
        optimizer's own), written in place; the Nesterov look-ahead goes into ``delta``,
        free once the exchange has finished (``average`` may be ``delta`` itself)."""
        group = self.outer.param_groups[0]
        lr, momentum = group["lr"], group["momentum"]
        step = average
        with torch.no_grad():
            if momentum != 0:
                state = self.outer.state[self.anchor]
                buffer = state.get("momentum_buffer")
                if buffer is None:
                    state["momentum_buffer"] = buffer = average.detach().clone()
                else:
                    buffer.mul_(momentum).add_(average)
                step = torch.add(average, buffer, alpha=momentum, out=self.delta) if group["nesterov"] else buffer
            self.anchor.add_(step, alpha=-lr)

    def merge(self, mix: float) -> None:
        """Local weights ← (1 − mix)·anchor + mix·local, in place (mix = 0: the anchor)."""
        with torch.no_grad():
            for anchor, _, local in self._pairs():
                if mix == 0.0:
                    local.copy_(anchor)
                else:
                    torch.lerp(anchor, local, mix, out=local)

    def write(self, flat: torch.Tensor) -> None:
        """Set the local weights from a flat tensor."""
        with torch.no_grad():
            for view, (_, p) in zip(self.layout, self.params):
                p.copy_(flat[view.offset:view.offset + view.numel].view_as(p))


class DiLoCo(torch.optim.Optimizer):
    """Wraps the inner ``optimizer``: ``step()`` is an inner step, and every ``sync_every``
    steps (per fragment) an outer step on the pseudo-gradient averaged over ranks.

    Args:
        optimizer: the inner optimizer (any ``torch.optim.Optimizer``, AdamW in the paper);
            its ``step()`` runs unchanged at every call.
        named_parameters: ``model.named_parameters()`` (default: ``model``'s, else
            ``param.<i>``); their order cuts the fragments.
        model: its parameters and buffers are copied from rank 0 at construction.
        sync_every: H, inner steps between two exchanges of a fragment.
        outer_lr, outer_momentum, nesterov: the outer SGD (0.7, 0.9, Nesterov in the paper,
            with an inner AdamW; outer momentum 0.5 with an inner SGD with momentum, which is
            warned about otherwise; lr 1 and momentum 0 make the new anchor the plain average
            of the ranks' weights).
        compressor, memory, communicator: how the pseudo-gradient travels, as for
            :class:`~mergecomp.DistributedOptimizer` (default: uncompressed allreduce).
        fragments: K contiguous fragments balanced by size, at staggered offsets (streaming).
        overlap: inner steps an exchange runs behind (0: finished in the step that launched it).
        mix: weight of the local weights when a fragment takes its new anchor; default 0
            without overlap, 0.5 with it (the paper's).
        nonfinite: a pseudo-gradient with NaN/Inf on any rank: ``"skip"`` (the outer step is
            dropped on every rank: anchor, outer momentum, compressor and memory state stay as
            they were, and every fragment's local weights go back to its anchor), ``"raise"``
            (the same, then :class:`~mergecomp.NonFiniteGradient`), ``"off"`` (unchecked).
        backend: a collective backend; the torch.distributed default group if omitted.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Optional[Iterable[Tuple[str, torch.nn.Parameter]]] = None, *,
                 sync_every: int, model: Optional[torch.nn.Module] = None,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
                 compressor: Union[str, Compressor] = "none", memory: Union[None, str, Memory] = "auto",
                 communicator: Union[None, str, Communicator] = "auto",
                 fragments: int = 1, overlap: int = 0, mix: Optional[float] = None,
                 nonfinite: str = "skip", backend: Optional[Backend] = None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer (the inner optimizer), "
                            f"got {type(optimizer).__name__}")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.schedule = SyncSchedule(sync_every, fragments, overlap)
        outer_lr = check_number(outer_lr, "outer_lr", 0.0, float("inf"), low_open=True, high_open=True,
                                advice="DiLoCo uses 0.7.")
        outer_momentum = check_number(outer_momentum, "outer_momentum", 0.0, 1.0, high_open=True,
                                      advice="DiLoCo uses 0.9 (Nesterov).")
        if not isinstance(nesterov, bool):
            raise ValueError(f"nesterov must be True or False, got {nesterov!r}")
        if mix is None:
            mix = 0.5 if overlap else 0.0
        self.mix = check_number(mix, "mix (the local weights' share when a fragment takes its new "
                                "anchor)", 0.0, 1.0, high_open=True, advice="0 replaces them; the streaming "
                                "paper uses 0.5 with overlap.")
        self.nonfinite = check_nonfinite_policy(nonfinite)
        _warn_if_heavy_ball(optimizer, outer_momentum)
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.optimizer = optimizer
        self._share_inner()
        self.backend = backend if backend is not None else default_backend()

        params = _named_trainable(optimizer, named_parameters if named_parameters is not None
                                  else model.named_parameters() if model is not None else None)
        if not params:
            raise ValueError("the inner optimizer has no parameter that requires a gradient: nothing to train")
        self.compressor, self.memory, communicator = arguments.resolve(compressor, memory, communicator)
        self.communicator = communicator if isinstance(communicator, Communicator) else communicators.create(
            communicator, compressor=self.compressor, memory=self.memory, backend=self.backend)
        compressors.check_dtypes(self.compressor, sorted({p.dtype for _, p in params}, key=str))
        recipes.warn_if_contradicted(self.compressor, None, self.memory)
        self.config = config_digest(self.compressor, self.memory, self.communicator, self.schedule,
                                    outer_lr, outer_momentum, nesterov, self.mix, nonfinite)
        self._check_ranks_agree(params)
        _broadcast_model(self.backend, params, model)
        cuts = [0] + fragment_cuts([p.numel() for _, p in params], fragments) + [len(params)]
        self.fragments = [Fragment(f, params[a:b], outer_lr, outer_momentum, nesterov)
                          for f, (a, b) in enumerate(zip(cuts, cuts[1:]))]
        self.lifecycle = StepLifecycle(self.communicator, self.backend, self._facts, nonfinite)
        self.lifecycle.dropped_means = ("the outer step was not applied: anchor, outer momentum, compressor and "
                                        "memory state are as before, every fragment's weights are back at its anchor")
        self.inner_steps = 0
        self.outer_steps = 0
        self._exchange: Optional[int] = None  # the fragment whose exchange is in flight
        self._pending: Optional[Dict[str, Any]] = None  # it, as a checkpoint resumes it
        self._relaunch = False  # a loaded checkpoint's exchange is launched again at the next step

    # -- construction ----------------------------------------------------------------------------
    def _check_ranks_agree(self, params) -> None:
        """Same parameters and configuration on every rank, or an error naming each rank's."""
        mine = {"parameters": [[n, list(p.shape), str(p.dtype)] for n, p in params],
                "compressor": repr(self.compressor), "memory": repr(self.memory),
                "communicator": repr(self.communicator), "config": self.config}
        everyone = self.backend.allgather_object(mine)
        if any(theirs != mine for theirs in everyone):
            raise RanksDisagree(describe_disagreement(everyone, "on the model or the DiLoCo configuration at "
                                                                "construction"))

    def _share_inner(self) -> None:
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state

    def _facts(self) -> Dict[str, Any]:
        return {"steps": self.inner_steps, "outer_steps": self.outer_steps, "config": self.config,
                "fragment": self._exchange}

    # -- the step --------------------------------------------------------------------------------
    @property
    def skipped_steps(self) -> int:
        """Outer steps dropped on every rank because a pseudo-gradient was NaN or Inf."""
        return self.lifecycle.skipped_steps

    def step(self, closure=None):
        """An inner step; then, on schedule, finish a fragment's exchange and launch the next."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._relaunch:
            self._relaunch = False
            self._launch(self._pending["fragment"], self._pending["step"], self._pending["delta"].clone())
        self.optimizer.step()
        self.inner_steps += 1
        overlap = self.schedule.overlap
        for f in self.schedule.finishing(self.inner_steps) if overlap else ():
            self._finish(f)  # before the next launch: one exchange in flight at a time
        for f in self.schedule.launching(self.inner_steps):
            fragment = self.fragments[f]
            self._launch(f, self.inner_steps, fragment.pseudo_gradient())
            if not overlap:
                self._finish(f)
        return loss

    def _launch(self, f: int, step: int, delta: torch.Tensor) -> None:
        fragment = self.fragments[f]
        if self.schedule.overlap:  # a checkpoint taken before it finishes launches it again
            if fragment.kept is None:  # the communicator may write into ``delta``: keep a copy
                fragment.kept = torch.empty_like(delta)
            self._pending = {"fragment": f, "step": step, "delta": fragment.kept.copy_(delta)}
        self._exchange = f
        self.lifecycle.begin(step, delta.device)
        try:
            self.lifecycle.launch(f, delta, fragment.layout, "compress", lend=True)
        except BaseException:
            self.lifecycle.discard_step()
            self._exchange = self._pending = None
            raise

    def _finish(self, f: int) -> None:
        fragment, averages = self.fragments[f], []
        try:
            outcome = self.lifecycle.end_step(lambda flight, average, outcome: averages.append(average))
        finally:
            self._exchange = self._pending = None
        if outcome.finite:
            fragment.outer_step(averages[0].view(-1).to(fragment.anchor.dtype))
            self.outer_steps += 1
            fragment.merge(self.mix)
        else:  # dropped everywhere: every rank restarts from the unchanged anchors, every fragment's
            # (a NaN in one fragment's weights reaches the others' through the next forward; resetting
            # this fragment alone would leave them to poison it again, one drop after another)
            for each in self.fragments:
                each.merge(0.0)
        self.lifecycle.close_step()

    @contextlib.contextmanager
    def anchor_weights(self) -> Iterator[None]:
        """Inside the block the model holds the anchors, the weights every rank shares (the
        last outer step's); this rank's local weights come back at its end.  Evaluate the
        model of the run here: between exchanges each rank's own weights are its own.  An
        exchange in flight is unaffected (its pseudo-gradient was taken at launch)."""
        local = [fragment.flat() for fragment in self.fragments]
        for fragment in self.fragments:
            fragment.write(fragment.anchor)
        try:
            yield
        finally:
            for fragment, weights in zip(self.fragments, local):
                fragment.write(weights)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The inner optimizer's state and this rank's DiLoCo state, sealed: the anchors, the
        outer optimizers, compressor and memory state, the counters, this rank's local weights
        (they differ between ranks until the next exchange) and an exchange still in flight
        (launched again when the checkpoint resumes).  Every rank saves its own."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "mergecomp": checkpoint.seal({
                "format": STATE_FORMAT, "kind": "diloco",
                "anchors": [f.anchor.detach().clone() for f in self.fragments],
                "outer": [f.outer.state_dict() for f in self.fragments],
                "local": [f.flat() for f in self.fragments],
                "communicator": self.communicator.state_dict(),
                "pending": None if self._pending is None else {**self._pending,
                                                               "delta": self._pending["delta"].clone()},
                "inner_steps": self.inner_steps, "outer_steps": self.outer_steps,
                "skipped_steps": self.skipped_steps,
                "rank": self.backend.rank, "world_size": self.backend.size, "config": self.config,
            }),
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved on this rank of a run like this one; every
        check runs before anything changes (a refusal leaves this object as it was)."""
        if self._exchange is not None:
            raise RuntimeError("load_state_dict() with an exchange in flight: load before the first step, "
                               "or between an exchange's end and the next launch")
        ours = state_dict.get("mergecomp") if isinstance(state_dict, dict) else None
        if not isinstance(ours, dict) or ours.get("kind") != "diloco":
            raise checkpoint.CheckpointError("the state is not one DiLoCo.state_dict() wrote (no 'mergecomp' "
                                             "part of kind 'diloco')", ADVICE)
        source = ours.get(checkpoint.SOURCE)
        where = checkpoint.describe_source(source)
        groups = {f"group{f.index}": checkpoint.GroupSpec(f.numel, f.anchor.dtype, f.layout) for f in self.fragments}
        try:
            checkpoint.verify(ours, "DiLoCo state", source, groups)
            self._check_belongs_here(ours, where)
            for key in ("anchors", "outer"):
                checkpoint.check_finite(ours[key], "DiLoCo state", source, groups, key)
            checkpoint.check_state(self.communicator, ours.get("communicator", {}), groups, source)
        except checkpoint.CheckpointError as error:
            raise error.advise(ADVICE) from None
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self._share_inner()
        for fragment, anchor, outer, local in zip(self.fragments, ours["anchors"], ours["outer"], ours["local"]):
            fragment.anchor.data.copy_(anchor)
            fragment.outer.load_state_dict(outer)
            fragment.write(local)
        self.communicator.load_state_dict(ours.get("communicator", {}))
        self.inner_steps, self.outer_steps = int(ours["inner_steps"]), int(ours["outer_steps"])
        self.lifecycle.restore(ours.get("skipped_steps", 0))
        self._pending = ours.get("pending")
        self._relaunch = self._pending is not None

    def _check_belongs_here(self, ours: Dict[str, Any], where: str) -> None:
        rank, size = self.backend.rank, self.backend.size
        problems = []
        if ours.get("format", 1) > STATE_FORMAT:
            problems.append(f"it has state format {ours['format']}, newer than this mergecomp reads "
                            f"({STATE_FORMAT}): upgrade mergecomp")
        if ours.get("world_size") != size or ours.get("rank") != rank:
            problems.append(f"it was saved by rank {ours.get('rank')} of {ours.get('world_size')}, and rank "
                            f"{rank} of {size} is loading it: each rank loads the file it saved "
                            f"(e.g. f'ckpt.rank{{rank}}.pt') in a run of as many ranks")
        if ours.get("config") != self.config:
            problems.append(f"it belongs to another configuration (digest {ours.get('config')}, this run "
                            f"{self.config}: {self.compressor!r}, {self.memory!r}, {self.schedule!r})")
        shapes = [tuple(a.shape) for a in ours.get("anchors", [])]
        wanted = [(f.numel,) for f in self.fragments]
        if not problems and shapes != wanted:
            problems.append(f"its anchors have shapes {shapes}, this model's fragments {wanted}")
        if problems:
            raise checkpoint.CheckpointError(f"{where}: " + "; ".join(problems), ADVICE)

    def __repr__(self) -> str:
        return (f"DiLoCo({type(self.optimizer).__name__}, {self.schedule!r}, {self.communicator!r}, "
                f"ranks={self.backend.size})")


def _warn_if_heavy_ball(optimizer, outer_momentum: float) -> None:
    found = heavy_ball(optimizer)
    if found and outer_momentum > HEAVY_BALL_OUTER_MOMENTUM:
        index, setting, value = found[0]
        warnings.warn(
            f"DiLoCo: parameter group {index} of the inner {type(optimizer).__name__} has {setting}={value} "
            f"and the outer momentum is {outer_momentum}: the inner velocity survives each outer step, which "
            f"has already extrapolated that direction, and such runs stall or diverge at small sync_every. "
            f"Use outer_momentum={HEAVY_BALL_OUTER_MOMENTUM} (mergecomp.lowcomm.recommended_outer_momentum), "
            f"or an inner AdamW with the paper's {PAPER_OUTER_MOMENTUM}; docs/low-communication.md has the "
            f"measurements", UserWarning, stacklevel=3)


def _named_trainable(optimizer, named_parameters) -> List[Tuple[str, torch.nn.Parameter]]:
    """The optimizer's parameters that require gradients, in the order of ``named_parameters``
    (else the optimizer's, named ``param.<i>``)."""
    in_optimizer = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        named = [(f"param.{i}", p) for i, p in enumerate(in_optimizer)]
    else:
        named = list(named_parameters)
        known = {id(p) for _, p in named}
        missing = sum(1 for p in in_optimizer if id(p) not in known)
        if missing:
            raise ValueError(f"{missing} parameters of the inner optimizer are missing from named_parameters; "
                             "pass model.named_parameters() of the model the optimizer trains")
        wanted = {id(p) for p in in_optimizer}
        named = [(n, p) for n, p in named if id(p) in wanted]
    return [(n, p) for n, p in named if p.requires_grad]


def _broadcast_model(backend: Backend, params, model: Optional[torch.nn.Module]) -> None:
    """Every rank starts from rank 0's parameters (and the model's buffers)."""
    tensors = [p for _, p in params] + ([b for _, b in model.named_buffers()] if model is not None else [])
    if backend.size > 1 and tensors:
        with torch.no_grad():
            broadcast_tensors(backend, tensors, src=0)
