"""DiLoCo: H local steps with the user's optimizer, then one outer step on the averaged change.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023
(Algorithm 1); streaming fragments and overlapped exchange from "Streaming DiLoCo with
overlapping communication", 2025; SparseLoCo (2025) is this with top-k, a 2-bit quantiser
and error feedback on the pseudo-gradient.

Every rank holds the same *anchor* θ̄ (the weights of the last outer step).  Between two
exchanges each rank trains alone with its *inner* optimizer; then, per fragment,

    Δᵢ = θ̄ − θᵢ                       this rank's pseudo-gradient (the weights' change)
    Δ̄  = average over ranks of Δᵢ       through the configured compressor, memory, communicator
    θ̄  ← outer optimizer's step(Δ̄)     SGD with Nesterov momentum (lr 0.7, momentum 0.9), or yours
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
user's, belongs to this object.  The outer step is a real optimizer's ``step()`` (as in
torchft's ``local_sgd``): ``outer_optimizer`` builds it over the anchors.  The exchange
itself is the shared :class:`~mergecomp.runtime.step.StepLifecycle` (a preflight of what
ranks must agree on, the non-finite check, commit or rollback of compressor and memory
state), and construction and checkpoints pass the shared :mod:`~mergecomp.runtime.gate`.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from .. import arguments, checkpoint, communicators
from ..communicators.base import Communicator
from ..compressors.base import Compressor
from ..distributed.backends import Backend, default_backend
from ..memories.base import Memory, check_number
from ..momentum import optimizer_momentum
from ..runtime import gate
from ..runtime.controller import DriftController
from ..runtime.drift import drift_meter
from ..runtime.step import SharedSurface, StepLifecycle, check_nonfinite_policy
from .fragments import Fragment, SyncSchedule, fragment_cuts, parameter_changes

#: The outer momentum for an inner optimizer with heavy-ball momentum, and the paper's otherwise.
HEAVY_BALL_OUTER_MOMENTUM, PAPER_OUTER_MOMENTUM = 0.5, 0.9

#: Builds the outer optimizer over the fragments' anchors (flat tensors, one per fragment).
OuterOptimizer = Callable[[List[torch.Tensor]], torch.optim.Optimizer]


def heavy_ball(optimizer) -> list:
    """(group, setting, value) of the inner optimizer's heavy-ball momentum (SGD's
    ``momentum``; Adam's first moment, whose steps are normalised, is not one)."""
    return [found for found in optimizer_momentum(optimizer)
            if found[1] == "momentum" and "betas" not in optimizer.param_groups[found[0]]]


def recommended_outer_momentum(optimizer) -> float:
    """The outer Nesterov momentum for this inner optimizer: 0.5 when it carries heavy-ball
    momentum (its velocity survives the outer step, see :class:`DiLoCo`), else the paper's 0.9."""
    return HEAVY_BALL_OUTER_MOMENTUM if heavy_ball(optimizer) else PAPER_OUTER_MOMENTUM


def nesterov_sgd(lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True) -> OuterOptimizer:
    """The default outer optimizer: ``torch.optim.SGD`` with Nesterov momentum over the anchors,
    fused where torch has a fused kernel for them (float32 and float64 on CPU and CUDA: the
    same arithmetic, without a temporary of the fragment's size per step)."""

    def build(anchors: List[torch.Tensor]) -> torch.optim.Optimizer:
        options = dict(lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0)
        if all(a.dtype in (torch.float32, torch.float64) and a.device.type in ("cpu", "cuda") for a in anchors):
            try:
                return torch.optim.SGD(anchors, fused=True, **options)
            except (TypeError, RuntimeError, ValueError):  # a torch without the fused kernel here
                pass
        return torch.optim.SGD(anchors, **options)

    return build


#: Format of the ``"mergecomp"`` part of a DiLoCo state dict (2: the envelope every entry
#: point shares, :func:`mergecomp.runtime.gate.seal_state`, and one outer optimizer).
STATE_FORMAT = 2
ADVICE = ("Nothing was loaded. Load an earlier checkpoint of this rank (every rank saves and "
          "loads its own: the local weights differ between exchanges)")


class DiLoCo(SharedSurface, torch.optim.Optimizer):
    """Wraps the inner ``optimizer``: ``step()`` is an inner step, and every ``sync_every``
    steps (per fragment) an outer step on the pseudo-gradient averaged over ranks.

    Args:
        optimizer: the inner optimizer (any ``torch.optim.Optimizer``, AdamW in the paper);
            its ``step()`` runs unchanged at every call.
        named_parameters: ``model.named_parameters()`` (default: ``model``'s, else
            ``param.<i>``); their order cuts the fragments.
        model: its parameters and buffers are copied from rank 0 at construction, and its
            parameters are watched: one replaced or unfrozen later is refused at the next
            exchange instead of drifting apart between ranks.
        sync_every: H, inner steps between two exchanges of a fragment.
        outer_lr, outer_momentum, nesterov: the default outer optimizer, SGD (0.7, 0.9,
            Nesterov in the paper, with an inner AdamW; outer momentum 0.5 with an inner SGD
            with momentum, which is warned about otherwise; lr 1 and momentum 0 make the new
            anchor the plain average of the ranks' weights).
        outer_optimizer: your own instead, as a function that builds it over the anchors (a
            list of flat tensors, one per fragment), e.g.
            ``lambda anchors: torch.optim.SGD(anchors, lr=0.7, momentum=0.9, nesterov=True)``
            or ``functools.partial(torch.optim.AdamW, lr=...)``; it is :attr:`outer_optimizer`
            (LR schedulers act on it) and its state is checkpointed.  Each fragment's anchor
            gets a gradient only when its own exchange ends.
        compressor, memory, communicator: how the pseudo-gradient travels, as for
            :class:`~mergecomp.DistributedOptimizer` (default: uncompressed allreduce).
        fragments: K contiguous fragments balanced by size, at staggered offsets (streaming).
        overlap: inner steps an exchange runs behind (0: finished in the step that launched it).
        mix: weight of the local weights when a fragment takes its new anchor; default 0
            without overlap, 0.5 with it (the paper's).
        controller: the quality controller on the compressed outer exchange, as for
            ``DistributedOptimizer`` (``"auto"``, ``"off"`` or a :class:`~mergecomp.DriftController`);
            it measures and steers every exchange (``every`` counts exchanges, not inner steps).
        nonfinite: a pseudo-gradient with NaN/Inf on any rank: ``"skip"`` (the outer step is
            dropped on every rank: anchor, outer momentum, compressor and memory state stay as
            they were, and every fragment's local weights go back to its anchor), ``"raise"``
            (the same, then :class:`~mergecomp.NonFiniteGradient`), ``"off"`` (unchecked).
        backend: a collective backend; the torch.distributed default group if omitted.

    Mixed precision: DiLoCo takes part in ``torch.amp.GradScaler``'s protocol
    (``scaler.step(opt)``): an inner step whose gradient overflowed is skipped as the scaler
    asks, but still counts, so that every rank reaches the same exchanges.
    """

    #: ``GradScaler.step`` calls :meth:`step` every time, with ``found_inf`` and ``grad_scale``
    #: set, instead of skipping it: a skipped call would put this rank off the ranks' schedule.
    _step_supports_amp_scaling = True

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Optional[Iterable[Tuple[str, torch.nn.Parameter]]] = None, *,
                 sync_every: int, model: Optional[torch.nn.Module] = None,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
                 outer_optimizer: Optional[OuterOptimizer] = None,
                 compressor: Union[str, Compressor] = "none", memory: Union[None, str, Memory] = "auto",
                 communicator: Union[None, str, Communicator] = "auto",
                 fragments: int = 1, overlap: int = 0, mix: Optional[float] = None,
                 nonfinite: str = "skip", controller: Union[str, None, DriftController] = "auto",
                 backend: Optional[Backend] = None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer (the inner optimizer), "
                            f"got {type(optimizer).__name__}")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if outer_optimizer is not None and not callable(outer_optimizer):
            raise TypeError(f"outer_optimizer must build the outer optimizer from a list of tensors (e.g. "
                            f"lambda anchors: torch.optim.SGD(anchors, lr=0.7, momentum=0.9, nesterov=True)), "
                            f"got {outer_optimizer!r}")
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
        meter = drift_meter(controller)
        if outer_optimizer is None:
            _warn_if_heavy_ball(optimizer, outer_momentum)
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.optimizer = optimizer
        self._share_inner()
        self.backend = backend if backend is not None else default_backend()

        params = gate.trainable_parameters(optimizer, named_parameters, model, who="the inner optimizer")
        if not params:
            raise ValueError("the inner optimizer has no parameter that requires a gradient: nothing to train")
        self._model = model
        self.compressor, self.memory, communicator = arguments.resolve(compressor, memory, communicator)
        self.communicator = communicator if isinstance(communicator, Communicator) else communicators.create(
            communicator, compressor=self.compressor, memory=self.memory, backend=self.backend)
        # The compressor acts on the pseudo-gradient, not on the inner optimizer's gradient:
        # its recipe is judged without the inner optimizer.
        gate.vet_optimizer(None, self.compressor, self.memory, {p.dtype for _, p in params})
        outer = "default" if outer_optimizer is None else _describe(outer_optimizer)
        self.config = gate.config_digest(self.compressor, self.memory, self.communicator, self.schedule,
                                         outer_lr, outer_momentum, nesterov, self.mix, nonfinite,
                                         *([outer] if outer_optimizer is not None else []),
                                         *([repr(meter.controller)] if controller != "auto" else []))
        gate.check_same_parameters(self.backend, params)
        gate.check_ranks_agree(self.backend, "on the model or the DiLoCo configuration at construction", {
            "compressor": repr(self.compressor), "memory": repr(self.memory),
            "communicator": repr(self.communicator), "sync_every": self.schedule.sync_every,
            "fragments": self.schedule.fragments, "overlap": self.schedule.overlap,
            "outer_optimizer": outer, "outer_lr": outer_lr, "outer_momentum": outer_momentum,
            "nesterov": nesterov, "mix": self.mix, "nonfinite": nonfinite,
            "controller": repr(meter.controller), "config": self.config})
        gate.start_from_rank0(self.backend, params, model)
        cuts = [0] + fragment_cuts([p.numel() for _, p in params], fragments) + [len(params)]
        self.fragments = [Fragment(f, params[a:b]) for f, (a, b) in enumerate(zip(cuts, cuts[1:]))]
        build = outer_optimizer if outer_optimizer is not None else nesterov_sgd(outer_lr, outer_momentum, nesterov)
        self.outer_optimizer = _built_outer(build, [f.anchor for f in self.fragments])
        for fragment in self.fragments:
            fragment.outer = self.outer_optimizer
        self.lifecycle = StepLifecycle(self.communicator, self.backend, self._facts, nonfinite)
        self.lifecycle.meter = meter
        self.lifecycle.dropped_means = ("the outer step was not applied: anchor, outer momentum, compressor and "
                                        "memory state are as before, every fragment's weights are back at its anchor")
        self.inner_steps = 0
        self.outer_steps = 0
        self._exchange: Optional[int] = None  # the fragment whose exchange is in flight
        self._pending: Optional[Dict[str, Any]] = None  # it, as a checkpoint resumes it
        self._relaunch = False  # a loaded checkpoint's exchange is launched again at the next step
        self._changed: Optional[str] = None  # what of the model changed since construction

    def _share_inner(self) -> None:
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state

    def _facts(self) -> Dict[str, Any]:
        return {"inner_steps": self.inner_steps, "outer_steps": self.outer_steps, "config": self.config,
                "fragment": self._exchange, "parameters": self._changed}

    # -- the step --------------------------------------------------------------------------------
    def step(self, closure=None):
        """An inner step; then, on schedule, finish a fragment's exchange and launch the next.

        Under ``GradScaler.step(opt)`` an inner step whose gradient overflowed is skipped (the
        scaler's ``found_inf``) and still counted, as on every rank."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._relaunch:
            self._relaunch = False
            self._launch(self._pending["fragment"], self._pending["step"], self._pending["delta"].clone())
        if self._inner_step_wanted():
            self.optimizer.step()
        self.inner_steps += 1
        overlap = self.schedule.overlap
        for f in self.schedule.finishing(self.inner_steps) if overlap else ():
            self._finish(f)  # before the next launch: one exchange in flight at a time
        for f in self.schedule.launching(self.inner_steps):
            self._launch(f, self.inner_steps, None)
            if not overlap:
                self._finish(f)
        return loss

    def _inner_step_wanted(self) -> bool:
        """False when ``GradScaler.step`` found an overflow; the gradients unscaled otherwise
        (when the scaler has not already done it: ``grad_scale`` set)."""
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and bool(found_inf.item() > 0):
            return False
        scale = getattr(self, "grad_scale", None)
        if scale is not None:
            inverse = scale.double().reciprocal().float()
            with torch.no_grad():
                for group in self.optimizer.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad.mul_(inverse.to(p.grad.device))
        return True

    def _launch(self, f: int, step: int, delta: Optional[torch.Tensor]) -> None:
        """Begin an exchange of fragment ``f`` (its pseudo-gradient now, or ``delta`` from a
        checkpoint).  What changed in the model joins the preflight: a change on some ranks
        only is a disagreement every rank names; one on every rank is refused everywhere."""
        fragment = self.fragments[f]
        self._changed = parameter_changes(self.fragments, self._trainable_now())
        self._exchange = f
        self.lifecycle.begin(step, fragment.anchor.device)
        try:
            self.lifecycle.check_preflight()
            if self._changed is not None:
                raise RuntimeError(
                    f"DiLoCo: {self._changed}: the exchange would no longer "
                    "average what each rank trains, and the ranks' models would drift apart. Change the "
                    "model (and its inner optimizer) before building DiLoCo, or build a new DiLoCo "
                    "after the change (from a checkpoint's weights).")
            if delta is None:
                delta = fragment.pseudo_gradient()
            if self.schedule.overlap:  # a checkpoint taken before it finishes launches it again
                if fragment.kept is None:  # the communicator may write into ``delta``: keep a copy
                    fragment.kept = torch.empty_like(delta)
                self._pending = {"fragment": f, "step": step, "delta": fragment.kept.copy_(delta)}
            self.lifecycle.launch(f, delta, fragment.layout, "compress", lend=True)
        except BaseException:
            self.lifecycle.abort()
            self._exchange = self._pending = None
            raise

    def _trainable_now(self) -> List[Tuple[str, torch.nn.Parameter]]:
        """The parameters that require a gradient now: the inner optimizer's, and the model's
        (each once, named from the model where it has them)."""
        names = {id(p): name for fragment in self.fragments for name, p in fragment.params}
        if self._model is not None:
            names.update((id(p), name) for name, p in self._model.named_parameters())
        found = {id(p): (names.get(id(p), f"param.{i}"), p)
                 for i, (_, p) in enumerate(gate.named_in_optimizer(self.optimizer, names)) if p.requires_grad}
        if self._model is not None:
            found.update((id(p), (name, p)) for name, p in self._model.named_parameters() if p.requires_grad)
        return list(found.values())

    def _finish(self, f: int) -> None:
        fragment, averages = self.fragments[f], []
        try:
            outcome = self.lifecycle.end_step(lambda flight, average, outcome: averages.append(average))
        except BaseException:
            self.lifecycle.abort()
            raise
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
            self._mend_inner_state()
        self.lifecycle.count_step()
        self.lifecycle.close_step()

    def _mend_inner_state(self) -> None:
        """After a dropped exchange: the NaN or Inf the inner optimizer's state took from this
        rank's unchecked inner steps (an Adam's moments, SGD's momentum) set to 0, and said.
        Why: the weights go back to the anchors, but a poisoned moment would make this rank's
        next inner step NaN again, and every later exchange would be dropped.  A pass over
        the state only here, never on a finite exchange."""
        mended = 0
        with torch.no_grad():  # the states as a list: their keys are the parameters themselves
            for _, value in checkpoint.tensors_of(list(self.optimizer.state.values())):
                if value.is_floating_point() and not bool(value.isfinite().all()):
                    value.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
                    mended += 1
        if mended:
            warnings.warn(f"mergecomp: DiLoCo: after the dropped exchange, {mended} tensor(s) of this rank's "
                          "inner optimizer state held NaN or Inf (taken in its inner steps since the last "
                          "exchange); those entries are now 0, so that its next inner steps are finite",
                          RuntimeWarning, stacklevel=3)

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
        outer optimizer, compressor and memory state, the counters, this rank's local weights
        (they differ between ranks until the next exchange) and an exchange still in flight
        (launched again when the checkpoint resumes).  Every rank saves its own."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "mergecomp": gate.seal_state("diloco", STATE_FORMAT, self.backend, self.config,
                                         self.lifecycle.state_dict(), {
                "anchors": [f.anchor.detach().clone() for f in self.fragments],
                "outer": self.outer_optimizer.state_dict(),
                "local": [f.flat() for f in self.fragments],
                "communicator": self.communicator.state_dict(),
                "pending": None if self._pending is None else {**self._pending,
                                                               "delta": self._pending["delta"].clone()},
                "inner_steps": self.inner_steps, "outer_steps": self.outer_steps,
            }),
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved on this rank of a run like this one; every
        check runs before anything changes (a refusal leaves this object as it was): the
        checksum, the envelope, and finite values in everything that reaches the weights (the
        anchors, the local weights, the outer and inner optimizers' state, an exchange in
        flight, compressor and memory state)."""
        if self._exchange is not None:
            raise RuntimeError("load_state_dict() with an exchange in flight: load before the first step, "
                               "or between an exchange's end and the next launch")
        ours = state_dict.get("mergecomp") if isinstance(state_dict, dict) else None
        if not isinstance(ours, dict) or ours.get("kind") != "diloco":
            raise checkpoint.CheckpointError("the state is not one DiLoCo.state_dict() wrote (no 'mergecomp' "
                                             "part of kind 'diloco')", ADVICE)
        source = ours.get(checkpoint.SOURCE)
        groups = {f"group{f.index}": checkpoint.GroupSpec(f.numel, f.anchor.dtype, f.layout) for f in self.fragments}
        try:
            checkpoint.verify(ours, "DiLoCo state", source, groups)
            gate.check_envelope(ours, "diloco", STATE_FORMAT, self.backend, self.config, ADVICE,
                                described=f"{self.compressor!r}, {self.memory!r}, {self.schedule!r}")
            self._check_shapes(ours, checkpoint.describe_source(source))
            for key in ("anchors", "outer", "local", "pending"):
                checkpoint.check_finite({key: ours.get(key)}, "DiLoCo state", source, groups)
            gate.check_finite_state(state_dict.get("optimizer", {}), "the inner optimizer's state", source)
            checkpoint.check_state(self.communicator, ours.get("communicator", {}), groups, source)
        except checkpoint.CheckpointError as error:
            raise error.advise(ADVICE) from None
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self._share_inner()
        for fragment, anchor, local in zip(self.fragments, ours["anchors"], ours["local"]):
            fragment.anchor.data.copy_(anchor)
            fragment.write(local)
        self.outer_optimizer.load_state_dict(ours["outer"])
        self.communicator.load_state_dict(ours.get("communicator", {}))
        self.inner_steps, self.outer_steps = int(ours["inner_steps"]), int(ours["outer_steps"])
        self.lifecycle.load_state_dict(gate.lifecycle_state(ours))
        self._pending = ours.get("pending")
        self._relaunch = self._pending is not None

    def _check_shapes(self, ours: Dict[str, Any], where: str) -> None:
        shapes = [tuple(a.shape) for a in ours.get("anchors", [])]
        wanted = [(f.numel,) for f in self.fragments]
        local = [tuple(a.shape) for a in ours.get("local", [])]
        if shapes != wanted or local != wanted:
            raise checkpoint.CheckpointError(f"{where}: its anchors have shapes {shapes} and its local weights "
                                             f"{local}, this model's fragments {wanted}", ADVICE)
        if not isinstance(ours.get("outer"), dict) or "param_groups" not in ours["outer"]:
            raise checkpoint.CheckpointError(f"{where}: its outer optimizer state is not an optimizer's "
                                             f"state_dict ({type(ours.get('outer')).__name__})", ADVICE)

    def __repr__(self) -> str:
        return (f"DiLoCo({type(self.optimizer).__name__}, {self.schedule!r}, {self.communicator!r}, "
                f"ranks={self.backend.size})")


def _built_outer(build: OuterOptimizer, anchors: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
    """The outer optimizer ``build`` makes over ``anchors``, checked: a torch optimizer that
    steps exactly the anchors."""
    built = build(list(anchors))
    if not isinstance(built, torch.optim.Optimizer):
        raise TypeError(f"outer_optimizer built a {type(built).__name__}, not a torch.optim.Optimizer")
    stepped = [p for group in built.param_groups for p in group["params"]]
    if len(stepped) != len(anchors) or {id(p) for p in stepped} != {id(a) for a in anchors}:
        raise ValueError(f"outer_optimizer must step exactly the {len(anchors)} anchor tensor(s) it is given "
                         f"(one per fragment), got an optimizer over {len(stepped)} tensor(s)")
    return built


def _describe(build: Callable) -> str:
    """What ranks compare of a user's outer optimizer factory: its name (a function's
    qualified name, or a partial's function and arguments)."""
    func = getattr(build, "func", None)
    if func is not None:
        return f"{getattr(func, '__qualname__', repr(func))}(*{getattr(build, 'args', ())}, **{getattr(build, 'keywords', {})})"
    return getattr(build, "__qualname__", type(build).__name__)


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
