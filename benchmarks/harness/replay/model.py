"""A model whose forward and backward are waits of a trace's durations.

:class:`ReplayModel` has the traced model's trainable parameters (names, shapes, dtypes),
and its backward produces their gradients in the traced order, each after the traced
gap, through a chain of custom autograd nodes (:class:`_Ready`): one node per parameter,
applied in reverse ready order during forward, so that autograd runs them in ready order
during backward.  Each node sleeps its gap, then hands its parameter a gradient, which
autograd accumulates into ``p.grad`` and whose post-accumulate-grad hooks then fire, as
in training: mergecomp's hooks, groups, compression, collectives and overlap run for
real, while the compute costs no processor time (sleep, not spin).

Timing.  A node sleeps its gap from when autograd starts it, so whatever runs on the
backward thread in between (mergecomp's hooks: gathering a group, compressing it,
launching its collective) delays the later gradients, as it does in a real backward on
the CPU.  Sleeps overshoot by tens of microseconds; a model of hundreds of parameters
would drift by several percent, so each node takes the previous ones' overshoot off its
own sleep (:class:`Clock`).

Gradients.  Each rank draws one standard-normal pool (its own seed, the size of the
largest parameter) once; a parameter's gradient is a copy of a window of it (the one
memory pass a real backward also makes writing a gradient).  Autograd keeps the tensor a
node returns as ``p.grad`` when nothing else holds it, so a view of the pool would let
what mergecomp writes into ``p.grad`` reach the next step's gradients.  Different ranks send different values, so
sparsifiers select different coordinates on each rank, as in training.
"""
from __future__ import annotations

import time
from typing import List, Optional

import torch
from torch import nn

from ..models.spec import ModelSpec, VECTOR_UNIT, IMAGE_UNIT, SEQUENCE_UNIT
from .heap import HeapTrimmer
from .trace import ReplayTrace


class Clock:
    """Sleeps given durations back to back, taking each sleep's overshoot off the next one."""

    def __init__(self):
        self.debt = 0.0

    def reset(self) -> None:
        self.debt = 0.0

    def wait(self, seconds: float) -> None:
        target = seconds - self.debt
        if target <= 0:
            self.debt = -target
            return
        began = time.perf_counter()
        time.sleep(target)
        self.debt = time.perf_counter() - began - target


class _Ready(torch.autograd.Function):
    """Passes the chain through; in backward waits the gap, then gives the parameter its gradient."""

    @staticmethod
    def forward(ctx, chain, param, model, index):
        ctx.model, ctx.index = model, index
        return chain.clone()

    @staticmethod
    def backward(ctx, grad):
        model = ctx.model
        model.clock.wait(model.gaps[ctx.index])
        return grad, model.gradient(ctx.index), None, None


class ReplayModel(nn.Module):
    """The trace's parameters, a forward that waits the traced forward time, and a backward
    that makes their gradients ready in the traced order and gaps (module docstring).

    ``forward(inputs)`` returns a 0-d tensor; its ``sum()`` is the loss to call
    ``backward()`` on.  ``seed`` draws this rank's gradient values."""

    def __init__(self, trace: ReplayTrace, seed: int = 0, device=None):
        super().__init__()
        self.trace = trace
        self.clock = Clock()
        by_name = {}
        for p in trace.defined():  # registered as the real model defines them
            owner = self
            *path, leaf = p.name.split(".")
            for part in path:
                child = owner._modules.get(part)
                if child is None:
                    child = nn.Module()
                    owner.add_module(part, child)
                owner = child
            param = nn.Parameter(torch.zeros(p.shape, dtype=p.torch_dtype, device=device))
            owner.register_parameter(leaf, param)
            by_name[p.name] = param
        #: The parameters in ready order: the chain's nodes.
        self._order: List[nn.Parameter] = [by_name[p.name] for p in trace.params]
        readies = [p.ready for p in trace.params]
        self.gaps = [readies[0]] + [b - a for a, b in zip(readies, readies[1:])]
        self.seed = seed
        self._pool: Optional[torch.Tensor] = None
        self._heap = HeapTrimmer()  # many replayed workers share a host's memory (heap.py)

    def _window(self, index: int) -> torch.Tensor:
        """This rank's gradient of parameter ``index``: a window of the pool, its shape."""
        param = self._order[index]
        if self._pool is None or self._pool.device != param.device:
            largest = max(p.numel() for p in self._order)
            generator = torch.Generator(device=param.device).manual_seed(self.seed)
            self._pool = torch.randn(largest + len(self._order), generator=generator, device=param.device)
        start = index % (self._pool.numel() - param.numel() + 1)
        return self._pool[start:start + param.numel()].view(param.shape)

    def gradient(self, index: int) -> torch.Tensor:
        """A fresh copy of the window: autograd may keep the tensor it is given as ``p.grad``."""
        return self._window(index).to(self._order[index].dtype, copy=True)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        self.clock.reset()
        began = time.perf_counter()
        self._heap.maybe()  # within the forward's wait, as host work beside a GPU's forward
        self.clock.debt += time.perf_counter() - began
        self.clock.wait(self.trace.forward_time)
        chain = torch.zeros((), device=self._order[0].device)
        for index in reversed(range(len(self._order))):
            chain = _Ready.apply(chain, self._order[index], self, index)
        return chain

    def replay_optimizer(self, params=None) -> "ReplayedStep":
        """An optimizer whose ``step()`` waits the trace's optimizer step."""
        return ReplayedStep(self.parameters() if params is None else params, self.trace.optimizer_step)


class ReplayedStep(torch.optim.Optimizer):
    """A ``step()`` that waits ``seconds`` and changes nothing (the traced optimizer step)."""

    def __init__(self, params, seconds: float):
        if not seconds >= 0:
            raise ValueError(f"a replayed optimizer step lasts ≥ 0 s, got {seconds!r}")
        super().__init__(params, {"seconds": float(seconds)})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        time.sleep(self.defaults["seconds"])
        return loss


def replay_batch(batch_size: int, device="cpu", generator=None, **_):
    """A placeholder batch (the replayed forward reads only its device)."""
    return torch.zeros(batch_size, 1, device=device), torch.zeros(batch_size, device=device)


def replay_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return output.sum()


def replay_spec(path: str, shrink: int = 1, time_scale: float = 1.0) -> ModelSpec:
    """A :class:`ModelSpec` of the trace at ``path``: its model replayed, first dimensions
    divided by ``shrink``, every duration multiplied by ``time_scale``.  ``build(seed=...)``
    takes the rank's gradient seed."""
    trace = ReplayTrace.load(path).shrunk(shrink)
    if time_scale != 1.0:
        trace = trace.scaled(time_scale, f"times multiplied by {time_scale:g}")
    unit = trace.unit if trace.unit in (IMAGE_UNIT, SEQUENCE_UNIT, VECTOR_UNIT) else VECTOR_UNIT

    def build(seed: int = 0) -> ReplayModel:
        return ReplayModel(trace, seed=seed)

    return ModelSpec(f"replay:{trace.model}", unit, build, replay_batch, replay_loss,
                     default_batch_size=max(1, trace.batch_size),
                     description=f"{trace.model} replayed ({trace.source})")
