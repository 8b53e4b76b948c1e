"""Contenders timed side by side: each a way to train the same model (a step, its byte
counters, its optimizer when mergecomp's), warmed up and settled, then timed in interleaved
windows with a barrier before each (:func:`benchmarks.harness.interleaved_windows`).
The headline's modes (``benchmarks/headline.py``) and the FSDP2 measurements share it."""
from __future__ import annotations

from typing import Any, Callable, Dict

import torch
import torch.distributed as dist

from benchmarks import harness
from mergecomp import momentum

DDP_BUCKET_CAP_MB = 25  # DistributedDataParallel's own default
MOMENTUM = 0.9


class Configuration:
    """One way to train the model: its step, its byte counters (handed to collectives; on
    the wire, where counted) and (mergecomp) its optimizer, whose phases are timed."""

    def __init__(self, name: str, step: Callable[[], None], bytes_sent: Callable[[], float],
                 before: Callable[[], None] = None, optimizer=None, wire_bytes: Callable[[], float] = None,
                 entry_point=None):
        self.name, self.step, self.bytes_sent, self.before, self.optimizer = name, step, bytes_sent, before, optimizer
        self.wire = wire_bytes if wire_bytes is not None else (lambda: 0.0)
        #: The mergecomp entry point (optimizer, DDP hook state) whose quality controller
        #: :func:`settle` runs past its front; read after warm-up (a hook builds it on its first step).
        self.entry_point = entry_point if entry_point is not None else optimizer

    @property
    def controller(self):
        """mergecomp's quality controller of this configuration, when it steers: None when it
        is off, for a compressor it cannot steer (no knob: casts, signs), or not mergecomp."""
        compressor = getattr(self.entry_point, "compressor", None)
        if getattr(compressor, "knob", None) is None:
            return None
        return getattr(self.entry_point, "controller", None)


def train_step(work, model, optimizer) -> Callable[[], None]:
    """One training step of ``model`` on ``work``'s batch (zero_grad, forward, loss, backward,
    ``optimizer.step()``), as every contender takes it; unlike
    :func:`~benchmarks.harness.training_step` it reports no progress, so interleaved
    contenders print nothing between windows."""
    def step():
        optimizer.zero_grad()
        work.spec.loss(model(work.inputs), work.targets).backward()
        optimizer.step()
    return step


def sgd(model, owns_momentum: bool, lr: float):
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0 if owns_momentum else MOMENTUM)


def owns_momentum(*components) -> bool:
    """SIGNUM and DeMo's memory keep a momentum of their own: the optimizer must not have one
    too.  (The dgc memory, and the residual memory with a momentum, take SGD's over.)"""
    return any(momentum.role(c) == momentum.OWNS for c in components)


def counted(name: str, step: Callable[[], None], per_step: float) -> Configuration:
    count = {"bytes": 0.0}

    def counted_step():
        step()
        count["bytes"] += per_step
    return Configuration(name, counted_step, lambda: count["bytes"])


def settle(configurations: Dict[str, Configuration], args, work) -> Dict[str, int]:
    """Warm every configuration up; run each auto optimizer until its scheduler settles, and
    each quality controller past its front (:func:`settle_controller`)."""
    search = {}
    for name, configuration in configurations.items():
        for _ in range(max(3, args.num_warmup_batches)):
            configuration.step()
        optimizer = configuration.optimizer
        if optimizer is not None:
            steps = 0
            while not optimizer.scheduler.settled:
                configuration.step()
                steps += 1
            search[name] = steps
            work.log(f"{name}: auto settled after {steps} steps: "
                     + optimizer.plan.describe(optimizer.param_infos()).splitlines()[0])
        if configuration.controller is not None:
            settle_controller(name, configuration, work)
    return search


#: Steady state: the controller has sent this share of its byte budget, or ...
SPENT_SHARE = 0.9
#: ... its scales held this many decisions in a row at rates its budget can keep up.
HELD_DECISIONS = 3


def settle_controller(name: str, configuration: Configuration, work) -> int:
    """Step until the quality controller is in its steady state: past its front (the first
    ``front × every`` steps, whose extra bytes it may spend at once: ``DriftController.allowed``)
    and either with its byte budget spent (:data:`SPENT_SHARE` of it) or with its scales
    unchanged for :data:`HELD_DECISIONS` decisions seen here, none above the budget (a rate
    it can keep).  Until then it may send more than ``byte_budget`` times the configured
    bytes a step, catching up on an allowance it has not used, or be raising the groups of
    a plan just chosen (which start from the scale the old ones sent at); a long run sends at
    most that many times over the run, so its step time is the steady state's.  Timing
    before it would charge a run's first hundred steps to every step.  At most three fronts
    of steps."""
    controller = configuration.controller
    front = controller.front * controller.every if controller.horizon is None else 0
    held = HELD_DECISIONS * controller.every
    changes = []  # the controller's count of scale changes before each step taken here
    steps = 0

    def steady() -> bool:
        if controller.steps < front:
            return False
        if controller.bytes_ratio >= SPENT_SHARE * controller.byte_budget:
            return True
        kept = len(changes) >= held and len(controller.history) == changes[-held]
        return kept and max(controller.scales.values(), default=1.0) <= controller.byte_budget

    while not steady() and steps < 3 * max(front, controller.every):  # it counts warm-up's steps too
        changes.append(len(controller.history))
        configuration.step()
        steps += 1
    work.log(f"{name}: quality controller settled after {steps} more steps: bytes so far "
             f"{controller.bytes_ratio:.2f}x the configured setting's, scales now "
             f"{dict(controller.scales) or 'all 1'}")
    return steps


def timed_rounds(configurations: Dict[str, Configuration], args, wire_out: Dict[str, float] = None):
    """Interleaved windows (:func:`harness.interleaved_windows`: the order rotated each round,
    one untimed step before each window), a barrier before each window.  Returns, per
    configuration: seconds per step per round on this rank, bytes handed to collectives per
    timed step, and (mergecomp's optimizer) its phases per step per round; ``wire_out``, when
    given, receives the bytes on the wire per timed step (where the configuration counts them)."""
    names = list(configurations)
    sent = {name: 0.0 for name in names}
    wire = {name: 0.0 for name in names}
    phases = {name: {"launch": [], "finish": [], "sync": []} for name in names}
    window: Dict[str, Any] = {"name": None, "untimed": False}  # the window being timed

    def before(name):
        def run():
            dist.barrier()
            if configurations[name].before is not None:
                configurations[name].before()
            window.update(name=None, untimed=True)  # the next step is the window's untimed one
        return run

    def timed(name):
        configuration = configurations[name]
        optimizer = configuration.optimizer

        def step():
            if window["untimed"]:  # counters start after it, inside the untimed call
                configuration.step()
                window.update(name=name, untimed=False, steps=0, sums={"launch": 0.0, "finish": 0.0, "sync": 0.0},
                              sent=configuration.bytes_sent(), wire=configuration.wire())
                return
            configuration.step()
            if optimizer is not None:
                window["sums"]["sync"] += optimizer.last_sync_time
            window["steps"] += 1
            if window["steps"] == args.window:
                sent[name] += configuration.bytes_sent() - window["sent"]
                wire[name] += configuration.wire() - window["wire"]
                if optimizer is not None:
                    for key, total in window["sums"].items():
                        phases[name][key].append(total / args.window)
                window["name"] = None
        return step

    handles = []
    for name, configuration in configurations.items():
        if configuration.optimizer is not None:
            def on_phase(phase, group, seconds, name=name):
                if window["name"] == name and phase in window["sums"]:
                    window["sums"][phase] += seconds
            handles.append(configuration.optimizer.add_phase_listener(on_phase))
    try:
        per_step = harness.interleaved_windows({name: timed(name) for name in names}, args.rounds, args.window,
                                               before={name: before(name) for name in names})
    finally:
        for handle in handles:
            handle.remove()
    steps = args.rounds * args.window
    if wire_out is not None:
        wire_out.update({name: total / steps for name, total in wire.items()})
    return per_step, {name: total / steps for name, total in sent.items()}, phases


def phase_text(phases) -> str:
    """Compress (launch) / wait for collectives after backward / decode (finish), in ms."""
    if not phases:
        return ""
    wait = max(0.0, phases.get("sync", 0.0) - phases.get("finish", 0.0))
    return f"{phases.get('launch', 0) * 1e3:.0f} / {wait * 1e3:.0f} / {phases.get('finish', 0) * 1e3:.0f}"


#: Per-worker batch of each model in the campaign: small, so communication is a visible
#: share of a CPU step (the batch sizes of the project's earlier benchmark tables).
