"""The loop's clipping seen under the DDP hook, as the wrapper sees it.

Under DDP the loop reads the averages in ``p.grad`` after backward, may clip them, and calls
its optimizer's ``step()``; the hook sees neither.  Where the hook's memory takes the
optimizer's SGD momentum over (the optimizer was shown to the hook state), the same
hand-over the wrapper uses (:mod:`mergecomp.runtime.handover`) runs here too:

- at the step's end, before DDP's futures complete, each group's averages (the per-parameter
  parts DDP copies into ``p.grad``) are scaled to a gradient's scale and noted;
- a step pre-hook on the optimizer that really steps reads the parameters' ``p.grad`` back,
  has the memories follow the loop's threshold or undoes its clip, and divides the scale out.

Without an optimizer shown to the state nothing of this runs (no memory takes a momentum
over, and nothing would settle what was scaled).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, List, Sequence, Tuple

import torch

from ..runtime.handover import StepHookedHandOver


class HookHandOver(StepHookedHandOver):
    """The hand-over of one hook state: the step's groups as DDP will read them, the
    futures it completes after scaling them, and the optimizer's step pre-hook."""

    def __init__(self, lifecycle, backend):
        super().__init__(lifecycle, backend)
        self._params: Dict[str, torch.nn.Parameter] = {}  # this step's parameters by name
        self._groups: List[SimpleNamespace] = []  # this step's groups: send mode, averages, names
        self._results: List[Tuple[torch.futures.Future, torch.Tensor]] = []

    def begin_step(self) -> None:
        self._params, self._groups, self._results = {}, [], []

    def know(self, names: Sequence[str], params: Sequence[torch.nn.Parameter]) -> None:
        """A bucket's parameters, by the names its layout gives them."""
        if self.active:
            self._params.update(zip(names, params))

    def hand(self, send: str, parts: List[torch.Tensor], names: Sequence[str]) -> None:
        """A group's averages as DDP copies them into ``p.grad`` (``parts``, one per name)."""
        if self.active:
            self._groups.append(SimpleNamespace(send=send, buffer=parts, names=list(names)))

    def complete(self, future: torch.futures.Future, result: torch.Tensor) -> None:
        """Complete ``future`` with ``result`` once the step's averages are scaled."""
        if self.active:
            self._results.append((future, result))
        else:
            future.set_result(result)

    def deliver(self, finite: bool) -> None:
        """The step's end: scale and note the averages, then complete DDP's futures."""
        results, self._results = self._results, []
        if self.active:
            self.hand_over.deliver(self._groups, finite)
        for future, result in results:
            future.set_result(result)

    def _settle(self, *_) -> None:
        """The optimizer is about to step on ``p.grad``: what the loop did since the step's end."""
        groups = [SimpleNamespace(send=g.send, buffer=[p.grad for p in (self._params.get(n) for n in g.names)
                                                       if p is not None and p.grad is not None])
                  for g in self._groups]
        self._groups = []
        self.hand_over.settle(groups, *self._settled_by)
