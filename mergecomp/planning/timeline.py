"""When each gradient becomes ready in backward: the timeline a profile is built on.

:class:`BackwardTimer` hooks every trainable parameter (beside any hook the optimizer has)
and times backward passes, so that a profile of the job on this machine
(:mod:`mergecomp.planning.measure`) can place every tensor's gradient in time.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from .profile import TensorTiming


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class BackwardTimer:
    """Records when each gradient becomes ready during backward, with its own hooks.

    It registers a post-accumulate-grad hook on every trainable parameter (next to any
    the optimizer has) and times ``iterations`` backward passes after ``warmup`` ones::

        timer = BackwardTimer(model.named_parameters(), iterations=5)
        while not timer.done:
            with timer.forward():
                loss = loss_fn(model(inputs), targets)
            with timer.backward():
                loss.backward()
            optimizer.step(); optimizer.zero_grad()
        timeline, forward_time, backward_time = timer.result()
        timer.remove()

    Ready times are medians over the timed passes; the order is that of the first timed
    pass.  On CUDA each hook synchronizes the device (``synchronize=True`` by default
    there), so a ready time is when the gradient exists, not when its kernel was queued;
    this slows the timed passes a little, and the profile says so by its device field.
    """

    def __init__(self, named_parameters: Iterable[Tuple[str, torch.nn.Parameter]],
                 iterations: int = 5, warmup: int = 1, synchronize: Optional[bool] = None):
        if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
            raise ValueError(f"BackwardTimer iterations must be an integer ≥ 1, got {iterations!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"BackwardTimer warmup must be an integer ≥ 0, got {warmup!r}")
        self._params = [(n, p) for n, p in named_parameters if p.requires_grad]
        if not self._params:
            raise ValueError("BackwardTimer got no trainable parameters; pass model.named_parameters()")
        self.device = self._params[0][1].device
        self.synchronize = (self.device.type == "cuda") if synchronize is None else bool(synchronize)
        self.iterations, self.warmup = iterations, warmup
        self._passes = 0
        self._start: Optional[float] = None
        self._current: Dict[str, float] = {}
        self._order: List[str] = []
        self._ready: Dict[str, List[float]] = {n: [] for n, _ in self._params}
        self._forward: List[float] = []
        self._backward: List[float] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(n)) for n, p in self._params]

    @property
    def done(self) -> bool:
        return self._passes >= self.warmup + self.iterations

    @property
    def _timing(self) -> bool:
        return self.warmup <= self._passes < self.warmup + self.iterations

    def _hook(self, name: str):
        def hook(param):
            if self._start is None or name in self._current:
                return
            if self.synchronize:
                _synchronize(self.device)
            self._current[name] = time.perf_counter() - self._start
        return hook

    @contextlib.contextmanager
    def forward(self):
        """Time the forward pass (and loss) inside this block."""
        if self.synchronize:
            _synchronize(self.device)
        start = time.perf_counter()
        yield
        if self.synchronize:
            _synchronize(self.device)
        if self._timing:
            self._forward.append(time.perf_counter() - start)

    @contextlib.contextmanager
    def backward(self):
        """Time ``loss.backward()`` inside this block and record its gradients' ready times."""
        if self.synchronize:
            _synchronize(self.device)
        self._current = {}
        self._start = time.perf_counter()
        try:
            yield
            if self.synchronize:
                _synchronize(self.device)
            total = time.perf_counter() - self._start
        finally:
            self._start = None
        if self._timing:
            if not self._order:
                self._order = sorted(self._current, key=self._current.get)
            for name, ready in self._current.items():
                self._ready[name].append(ready)
            self._backward.append(total)
        self._passes += 1

    def result(self) -> Tuple[List[TensorTiming], float, float]:
        """(timeline in backward order, forward seconds, backward seconds), medians."""
        if not self._backward:
            raise ValueError(f"BackwardTimer has timed no backward pass yet ({self._passes} passes "
                             f"seen, {self.warmup} warm-up); run backward inside timer.backward()")
        backward = statistics.median(self._backward)
        forward = statistics.median(self._forward) if self._forward else 0.0
        by_name = dict(self._params)
        # Parameters that never got a gradient go last, as the optimizer orders them.
        order = self._order + [n for n, _ in reversed(self._params) if n not in set(self._order)]
        timeline = []
        for name in order:
            p = by_name[name]
            ready = statistics.median(self._ready[name]) if self._ready[name] else backward
            timeline.append(TensorTiming(name, p.numel(), p.numel() * p.element_size(), str(p.dtype),
                                         str(p.device), min(ready, backward)))
        return timeline, forward, backward

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
