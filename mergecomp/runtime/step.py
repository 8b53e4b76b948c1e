"""One step's exchange, the same for every entry point.

An entry point decides *which* flat buffers a step sends and *where* their averages go:
the wrapper (:mod:`mergecomp.runtime.reducer`) gathers plan groups from autograd hooks and writes
``p.grad``; the DDP hook (:mod:`mergecomp.ddp`) sends DDP's buckets and completes DDP's
futures.  Everything between is here, in this order:

1. :meth:`StepLifecycle.begin` at the step's first gradient: the step is marked in the
   progress beacons (a rank that falls behind is named if a collective times out) and the
   preflight is launched, a tiny allreduce of a hash of what ranks must agree on
   (:mod:`mergecomp.runtime.agreement`).  Its latency hides behind backward.
2. :meth:`StepLifecycle.launch`, once per group, in the same order on every rank: the first
   launch waits for the preflight, so a disagreement is an error on every rank before any
   payload travels; a compressed group's buffer is checked for NaN/Inf and zeroed (a
   compressor must never see one); the communicator for the group's send mode starts it.
3. :meth:`StepLifecycle.end_step`: every group is finished in launch order; one small
   allreduce settles the outcome (any rank non-finite? the averages? ranks still training?
   the used-map); every communicator commits or rolls back; a dropped step's averages
   become NaN and are counted; the entry point's ``deliver`` hands each average on (timed
   as the group's ``"finish"`` phase).
4. :meth:`StepLifecycle.close_step`: the step listeners, then the warning or
   :class:`~mergecomp.runtime.agreement.NonFiniteGradient` of a dropped step, raised once the
   entry point has closed its step so that a caller who catches it can go on.

An error inside a step (a collective that failed, a disagreement) ends in
:meth:`StepLifecycle.abort`: every communicator rolls back what the step staged, and the
step is forgotten.  The lifecycle keeps its own counters (the step count ranks agree on,
the dropped steps, the epoch) and saves them in one :meth:`~StepLifecycle.state_dict`;
:class:`SharedSurface` is what every entry point offers its users from them (listeners, the
step log, ``set_epoch``, ``skipped_steps``, ``steps``, ``communicators()``).
"""
from __future__ import annotations

import collections
import time
import warnings
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional

import torch
from torch.utils.hooks import RemovableHandle

from .. import communicators, compressors, memories
from .agreement import NonFiniteGradient, StepAgreement, StepOutcome, check_parameters_finite
from ..kernels.finite import nonfinite_flag, zero_if
from ..distributed.backends.base import Backend
from ..communicators.base import Communicator, Handle
from ..compressors.base import GroupLayout
from ..plan import is_compressed, send_communicator
from .drift import DriftMeter
from .sendmodes import SendModeState, check_communicator_options

#: What a non-finite step does: skip it on every rank (default), raise, or go unchecked.
NONFINITE_POLICIES = ("skip", "raise", "off")

#: Send modes: the configured compressor, a cast for an allreduce (sharing the compressed
#: groups' memory), or ``"exact"``: FP32 through a communicator without memory, for a group
#: whose error-feedback state must stay where it is this step.  Besides these,
#: ``"compress:<communicator>"`` (:data:`mergecomp.plan.COMPRESS_VIA`): the configured
#: compressor and memory through another registered communicator.
SEND_MODES = ("compress", "fp32", "fp16", "bf16", "exact")



def check_nonfinite_policy(nonfinite: Any) -> str:
    """``nonfinite`` if it is a policy, else ValueError saying what each one does."""
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}: 'skip' "
                         "drops a NaN/Inf step on every rank, 'raise' stops, 'off' does not check")
    return nonfinite


class Listeners:
    """Callbacks with removable handles (like ``torch.nn.Module`` hooks)."""

    def __init__(self):
        self._callbacks: Dict[int, Callable] = collections.OrderedDict()

    def add(self, callback: Callable) -> RemovableHandle:
        handle = RemovableHandle(self._callbacks)
        self._callbacks[handle.id] = callback
        return handle

    def __bool__(self) -> bool:
        return bool(self._callbacks)

    def __call__(self, *args) -> None:
        for callback in list(self._callbacks.values()):
            callback(*args)


class InFlight:
    """One group launched in this step: what finishing it needs, and what phase listeners see
    (``index``, ``send``, ``numel``, ``handle``; ``wait_seconds`` and ``finish_seconds`` once
    finished with listeners attached).  ``owner`` is the entry point's own record of it."""

    def __init__(self, index: int, buffer: torch.Tensor, send: str, communicator: Communicator,
                 owner: Any):
        self.index, self.buffer, self.send, self.owner = index, buffer, send, owner
        self.name = f"group{index}"
        self.numel = buffer.numel()
        self.communicator = communicator
        self.handle: Optional[Handle] = None
        #: This rank's input was NaN/Inf (0-d bool tensor), for compressed groups.
        self.local_nonfinite: Optional[torch.Tensor] = None
        self.wait_seconds = 0.0
        self.finish_seconds = 0.0
        #: The average, once :meth:`StepLifecycle.finish_now` finished the group early.
        self.average: Optional[torch.Tensor] = None


#: ``deliver(flight, average, outcome)``: the entry point hands a finished group's average on.
Deliver = Callable[[InFlight, torch.Tensor, StepOutcome], None]


class StepLifecycle(SendModeState):
    """One rank's steps: preflight, launches, ordered finishing, outcome, commit or rollback,
    the non-finite policy, listeners and messages (see the module for the order).

    An entry point supplies:

    - ``communicator`` for compressed groups (raw widths get an allreduce sharing its memory)
      and ``backend``;
    - ``facts()``: what ranks must agree on before a step's exchange (plan digest, step,
      epoch, configuration, loaded state), hashed by the preflight;
    - per step: :meth:`begin` with the step number and the device of the parameters, then
      :meth:`launch` for each group in an order that is the same on every rank (a flat
      buffer it owns until the average is delivered, the per-parameter layout, the send
      mode), then :meth:`end_step` with ``deliver``, then its own bookkeeping, then
      :meth:`close_step`.

    So FSDP2 (:mod:`mergecomp.fsdp`) launches each unit's unsharded gradient with a
    communicator that scatters, and takes the shard at once (:meth:`finish_now`); a
    low-communication outer step (DiLoCo) would begin, launch its pseudo-gradients and end
    a step every H inner steps.  Neither copies the agreement, the policy or commit/rollback.
    """

    #: What a dropped step left, in the policy's message (an entry point may say it its way).
    dropped_means = "p.grad is NaN, compressor and error-feedback state are as before the step"

    def __init__(self, communicator: Communicator, backend: Backend,
                 facts: Callable[[], Mapping[str, Any]], nonfinite: str = "skip",
                 communicator_options: Optional[Mapping[str, Mapping[str, Any]]] = None):
        self.nonfinite = check_nonfinite_policy(nonfinite)
        self.communicator_options = check_communicator_options(communicator_options)
        self.communicator = communicator
        self.backend = backend
        self._facts = facts
        self._by_send: Dict[str, Communicator] = {"compress": communicator}
        #: Whether each send mode built so far goes through the compressor (checked for NaN).
        self._compresses: Dict[str, bool] = {"compress": True}
        self.agreement: Optional[StepAgreement] = None
        #: Steps dropped because a gradient was non-finite.
        self.skipped_steps = 0
        #: The step count every rank agrees on (part of the preflight's facts).  The entry
        #: point says when a step counts (:meth:`count_step`): the wrapper counts the steps
        #: its optimizer applied, the others every exchange settled.
        self.steps = 0
        #: The epoch :meth:`set_epoch` set, None before (part of the preflight's facts).
        self.epoch: Optional[int] = None
        #: Measures how far the exchange lags dense (:mod:`mergecomp.runtime.drift`), when set.
        self.meter: Optional[DriftMeter] = None
        self._measuring = False
        self.phase_listeners = Listeners()
        self.step_listeners = Listeners()
        self._step: Optional[int] = None  # the step begun, until its end
        self._preflight = None  # its preflight Work, until checked
        self._flights: List[InFlight] = []
        self._settled: Optional[tuple] = None  # (step, outcome) between end_step and close_step

    # -- communicators ---------------------------------------------------------------------------
    def communicator_for(self, send: str) -> Communicator:
        """The communicator of a send mode, built once.

        Raw widths share the compressed groups' memory: error feedback stays whole when a
        plan turns a compressed group raw (the residual goes out with the next raw send), and
        memory-side momentum (DGC) goes on for raw groups.

        ``"compress:<name>"`` builds communicator ``name`` (with ``communicator_options[name]``)
        around the configured compressor and memory instances: their state is keyed by group,
        so a group that changes communicator between plans keeps its residual.  The
        configured communicator's own class is the configured communicator itself.
        """
        if send not in self._by_send:
            via = send_communicator(send) if isinstance(send, str) else None
            if via is not None:
                self._by_send[send] = self._compressing_via(via, send)
            else:
                if send not in SEND_MODES:
                    raise ValueError(f"send mode must be one of {', '.join(SEND_MODES)} or "
                                     f"'compress:<communicator>', got {send!r}")
                exact = send == "exact"
                self._by_send[send] = communicators.create(
                    "allreduce", compressor=compressors.create("none" if send in ("fp32", "exact") else send),
                    memory=memories.create("none") if exact else self.communicator.memory, backend=self.backend)
            self._compresses[send] = is_compressed(send)
        return self._by_send[send]

    def communicators(self) -> List[Communicator]:
        """Every communicator this rank sends with (compressed first, then the others)."""
        return list({id(c): c for c in self._by_send.values()}.values())

    # -- a step ----------------------------------------------------------------------------------
    @property
    def in_step(self) -> bool:
        """Between :meth:`begin` and the end of :meth:`end_step`."""
        return self._step is not None

    def begin(self, step: int, device: torch.device) -> None:
        """The step's first collective: mark it in the progress beacons, launch the preflight."""
        if self.agreement is None:
            self.agreement = StepAgreement(self.backend, device)
        self._step = step
        self.backend.mark_step(step)
        self._measuring = self.meter is not None and self.meter.start(
            self.steps, self.communicator.compressor, self.communicator.memory)
        self._preflight = self.agreement.preflight(self.facts())

    def facts(self) -> Dict[str, Any]:
        """What ranks must agree on before a step's exchange: the lifecycle's step count and
        epoch, and the entry point's facts (plan digest, configuration, loaded state)."""
        return {"steps": self.steps, "epoch": self.epoch, **self._facts()}

    def check_preflight(self) -> None:
        """Wait for the preflight (once per step); on a disagreement every rank raises
        :class:`~mergecomp.runtime.agreement.RanksDisagree` naming it."""
        if self._preflight is not None:
            work, self._preflight = self._preflight, None
            self.agreement.check(work, self.facts(), f"at step {self._step}")

    def launch(self, index: int, buffer: torch.Tensor, layout: Optional[GroupLayout], send: str = "compress",
               *, lend: bool = False, owner: Any = None, since: Optional[float] = None) -> InFlight:
        """Start group ``index``'s exchange of ``buffer`` (async) and return its record.

        ``lend``: the caller does not read ``buffer`` after this, so the communicator may
        write the average into it.  ``owner``: the caller's record of the group, handed back
        with its average.  ``since``: ``time.perf_counter()`` when the caller began filling
        ``buffer``, so the ``"launch"`` phase counts the gather too.
        """
        self.check_preflight()
        listening = bool(self.phase_listeners)
        started = since if since is not None else time.perf_counter() if listening else 0.0
        communicator = self._by_send.get(send) or self.communicator_for(send)
        flight = InFlight(index, buffer, send, communicator, owner)
        if self._compresses[send] and self.nonfinite != "off":
            # A compressor must never see a NaN (a sparsifier could drop it, an SVD would
            # fail, error feedback would keep it): flag it and send zeros; the step is dropped.
            flight.local_nonfinite = nonfinite_flag(buffer)
            zero_if(buffer, flight.local_nonfinite)
        flight.handle = flight.communicator.start(buffer, flight.name, layout, in_place=lend)
        self._flights.append(flight)
        if listening:
            self.phase_listeners("launch", flight, time.perf_counter() - started)
        return flight

    def finish_now(self, flight: InFlight) -> torch.Tensor:
        """Finish ``flight`` at once and return its average, for an entry point that needs it
        before the step ends (FSDP2 reads a unit's shard as soon as its collective returns);
        :meth:`end_step` then settles the step without finishing it again."""
        flight.average = self._finish(flight)
        return flight.average

    def end_step(self, deliver: Deliver, *, active: bool = True, used: Optional[torch.Tensor] = None,
                 joining: bool = False) -> StepOutcome:
        """Finish the step's groups, settle its outcome with every rank, commit or roll back,
        and ``deliver`` each average (NaN when the step is dropped).

        ``active``: this rank still trains (False for a rank that ran out of data in
        ``join``); ``used``: this rank's used-map (1 per parameter with a gradient), counted
        over ranks into ``outcome.used``; ``joining``: inside ``join``, where the outcome's
        count of active ranks is needed even with ``nonfinite="off"``.  Call
        :meth:`close_step` when the entry point has closed its step.
        """
        flights, step = self._flights, self._step
        try:
            self.check_preflight()  # a step with no groups launched none
            averages = [self._finish(flight) if flight.average is None else flight.average for flight in flights]
            names, terms = self.meter.terms(flights) if self._measuring else ([], None)
            outcome = self._outcome(flights, averages, active, used, joining, terms)
            if outcome.extra is not None and outcome.finite:
                self.meter.read(step, names, outcome.extra)
            self._keep_or_forget(outcome)
            if not outcome.finite:
                self.skipped_steps += 1
                for average in averages:
                    average.fill_(float("nan"))
            for flight, average in zip(flights, averages):
                self._deliver(deliver, flight, average, outcome)
        finally:
            self.discard_step()
        self._settled = (step, outcome)
        return outcome

    @property
    def settled_step(self) -> Optional[int]:
        """The step :meth:`end_step` settled last, until :meth:`close_step` (else None)."""
        return self._settled[0] if self._settled is not None else None

    @property
    def drift(self):
        """The latest :class:`~mergecomp.runtime.drift.DriftReading` (None: not measured yet)."""
        return self.meter.reading if self.meter is not None else None

    def close_step(self, named_parameters: Optional[Iterable] = None) -> None:
        """The step listeners, then the policy's message for a dropped step: a warning
        (``"skip"``) or :class:`~mergecomp.runtime.agreement.NonFiniteGradient` (``"raise"``);
        ``NonFiniteParameters`` whatever the policy when ``named_parameters`` (the same on
        every rank) hold NaN or Inf themselves, which no drop can mend."""
        if self._settled is None:
            return
        (step, outcome), self._settled = self._settled, None
        if self.step_listeners:
            self.step_listeners(step, outcome)
        if outcome.finite:
            return
        message = (f"step {step}: {outcome.describe()}; the step was dropped on every rank "
                   f"({self.dropped_means})")
        if outcome.bad_ranks and named_parameters is not None:
            check_parameters_finite(named_parameters, message)
        if self.nonfinite == "raise":
            raise NonFiniteGradient(message + "; call zero_grad() before the next backward to go on")
        warnings.warn(f"mergecomp: {message}; {self.skipped_steps} step(s) dropped so far "
                      "(nonfinite='raise' stops instead)", RuntimeWarning, stacklevel=3)

    def discard_step(self) -> None:
        """Forget the step begun (after it ended)."""
        self._step = None
        self._preflight = None
        self._flights = []
        if self._measuring:
            self.meter.stop()
            self._measuring = False

    def abort(self) -> None:
        """An error inside the step: every communicator rolls back what the step staged in
        compressor and memory state, then the step is forgotten, on this rank."""
        for communicator in self.communicators():
            communicator.rollback()
        self.discard_step()

    def count_step(self) -> None:
        """One more step counts (the entry point says which do; see :attr:`steps`)."""
        self.steps += 1

    # -- the lifecycle's own state ---------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Tell epoch-scheduled components (DGC's density warm-up) the epoch.  Call it on every
        rank with the same epoch, between steps; the next step's preflight checks that they did."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        if self.in_step:
            raise RuntimeError("set_epoch() must be called between steps, not during backward")
        self.epoch = epoch
        for component in (self.communicator.compressor, self.communicator.memory):
            if hasattr(component, "set_epoch"):
                component.set_epoch(epoch)

    def state_dict(self) -> Dict[str, Any]:
        """The lifecycle's own state: the step count, the dropped steps, the epoch, and the
        drift controller's (its scales, its budget spent)."""
        state = {"steps": self.steps, "skipped_steps": self.skipped_steps, "epoch": self.epoch}
        if self.meter is not None and self.meter.controller is not None:
            state["controller"] = self.meter.controller.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the state of a checkpoint (between steps); the epoch and the controller's
        scales reach the components again."""
        self.steps = int(state.get("steps", 0) or 0)
        self.skipped_steps = int(state.get("skipped_steps", 0) or 0)
        if state.get("epoch") is not None:
            self.set_epoch(int(state["epoch"]))
        if self.meter is not None and self.meter.controller is not None and "controller" in state:
            self.meter.controller.load_state_dict(state["controller"])
            self.meter.apply(self.communicator.compressor)

    @property
    def rank(self) -> int:
        return self.backend.rank

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has handed to collectives: the agreement's and every
        communicator's (each backend once, however many communicators share it)."""
        backends = {id(self.backend): self.backend}
        for communicator in self.communicators():
            backends.setdefault(id(communicator.backend), communicator.backend)
        return sum(backend.bytes_sent for backend in backends.values())

    # -- the end of a step, piece by piece -------------------------------------------------------
    def _finish(self, flight: InFlight) -> torch.Tensor:
        """The group's average, timed for phase listeners (the wait for a single-round
        collective apart from decoding)."""
        if not self.phase_listeners:
            return flight.communicator.finish(flight.handle).reshape(-1)
        started = time.perf_counter()
        if flight.handle.rounds is None:
            flight.handle.work.wait()  # timing only: finish() would wait here anyway
            flight.wait_seconds = time.perf_counter() - started
            started = time.perf_counter()
        average = flight.communicator.finish(flight.handle).reshape(-1)
        flight.finish_seconds = time.perf_counter() - started
        return average

    def _outcome(self, flights: List[InFlight], averages: List[torch.Tensor], active: bool,
                 used: Optional[torch.Tensor], joining: bool, terms: Optional[torch.Tensor]) -> StepOutcome:
        """One small allreduce: non-finite flags, ranks still training, the used-map, the
        drift's terms on a measured step; none at all with ``nonfinite="off"`` when neither
        ``join``, the used-map nor a measurement needs it."""
        if self.nonfinite == "off":
            if used is None and not joining and terms is None:
                return StepOutcome([], False, self.backend.size if active else 0)
            return self.agreement.outcome(None, None, active, used, terms)
        local = [f.local_nonfinite for f in flights if f.local_nonfinite is not None]
        local_flag = torch.stack(local).any() if local else None
        # Each communicator checks what it received (a sparse allgather: the k·N received
        # coordinates, not the whole sum).
        averaged_flag = torch.stack([f.communicator.nonfinite_flag(f.handle, a) for f, a in zip(flights, averages)]
                                    ).any() if averages else None
        return self.agreement.outcome(local_flag, averaged_flag, active, used, terms)

    def _keep_or_forget(self, outcome: StepOutcome) -> None:
        """Commit what the step wrote into compressor and memory state, or roll it back, in
        every communicator (the same decision on every rank)."""
        keep = outcome.finite and outcome.active_ranks > 0
        for communicator in self.communicators():
            if keep:
                communicator.commit()
            else:
                communicator.rollback()

    def _deliver(self, deliver: Deliver, flight: InFlight, average: torch.Tensor, outcome: StepOutcome) -> None:
        if not self.phase_listeners:
            deliver(flight, average, outcome)
            return
        started = time.perf_counter()
        deliver(flight, average, outcome)
        self.phase_listeners("finish", flight, flight.finish_seconds + time.perf_counter() - started)



class SharedSurface:
    """What every entry point offers its users, the same way, from its step lifecycle
    (``self.lifecycle``): listeners, the step log, the epoch, the counters, the
    communicators.  The wrapper, the DDP hook's state, FSDP2's and DiLoCo inherit it."""

    lifecycle: StepLifecycle

    def add_phase_listener(self, callback: Callable[[str, InFlight, float], None]) -> RemovableHandle:
        """Call ``callback(phase, group, seconds)`` after each group's ``"launch"`` (gather,
        memory, compression, collective start) and ``"finish"`` (decode, aggregate, average,
        hand-over, after the collective is done); ``group`` has ``index``, ``send``,
        ``numel``.  Timing only; ``.remove()`` the handle to stop."""
        return self.lifecycle.phase_listeners.add(callback)

    def add_step_listener(self, callback: Callable[[int, StepOutcome], None]) -> RemovableHandle:
        """Call ``callback(step, outcome)`` when a step's exchange is settled (committed or
        dropped, before a ``NonFiniteGradient`` is raised); with phase listeners attached,
        each group also has ``wait_seconds`` (blocked on its collective) by then."""
        return self.lifecycle.step_listeners.add(callback)

    def add_step_log(self, log):
        """Record every step's exchange in ``log`` (a :class:`mergecomp.StepLog`); returns a
        handle whose ``remove()`` detaches it."""
        return log.attach(self.lifecycle)

    def set_epoch(self, epoch: int) -> None:
        """Tell epoch-scheduled components (DGC's density warm-up) the current epoch.  Call it
        on every rank with the same epoch, between steps; the next step checks that they did."""
        self.lifecycle.set_epoch(epoch)

    @property
    def epoch(self) -> Optional[int]:
        """The epoch :meth:`set_epoch` set (None before)."""
        return self.lifecycle.epoch

    @property
    def steps(self) -> int:
        """The steps counted so far (see :attr:`StepLifecycle.steps`)."""
        return self.lifecycle.steps

    @property
    def skipped_steps(self) -> int:
        """Steps dropped on every rank because a gradient was NaN or Inf."""
        return self.lifecycle.skipped_steps

    @property
    def drift(self):
        """The latest measurement of how far the compressed exchange lags dense
        (:class:`~mergecomp.runtime.drift.DriftReading`; None before the first)."""
        return self.lifecycle.drift

    @property
    def controller(self):
        """The quality controller steering each group's density (None when it is off)."""
        return self.lifecycle.meter.controller if self.lifecycle.meter is not None else None

    def communicators(self) -> List[Communicator]:
        """Every communicator this entry point sends with (compressed first)."""
        return self.lifecycle.communicators()
