"""The loop's clipping seen under FSDP2, as the wrapper and the DDP hook see it.

Under FSDP2 each rank ends a backward holding its shard of every parameter's averaged
gradient (``p.grad``, a DTensor); the loop may clip them (``clip_grad_norm_`` scales every
shard by one factor, from the whole gradient's norm) and calls its optimizer's ``step()``.
Where :func:`mergecomp.fsdp.register` was shown the optimizer, the hand-over the other entry
points use (:mod:`mergecomp.runtime.handover`) runs here too, so that a memory taking SGD's
momentum over follows the loop's clip (:mod:`mergecomp.memories.loopclip`):

- at the end of the backward (after FSDP wrote the shards) each unit's shards are scaled to
  a gradient's scale and their squared norm noted;
- a step pre-hook on the optimizer reads the shards back; the norms before and after the loop
  travel in one allreduce of two numbers over the ranks that hold different shards (the
  shard group; none under ``replicate``, whose ranks hold whole gradients), so every rank
  reads the whole gradient's norms, as the loop's clip did; then the memories follow the
  loop's threshold or its clip is undone, and the scale is divided out.

The share each rank's gradient is clipped at is the threshold over √(ranks), as for the
other entry points; under FSDP's ``all_to_all`` exchange a memory clips each destination
chunk of a unit at that share (its groups are the chunks), which clips less than one clip of
the rank's whole unit would.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import List, Optional, Sequence

import torch

from ..distributed.backends.torch_dist import TorchDistributedBackend
from ..runtime.handover import StepHookedHandOver
from .replica import REPLICATE


class FSDPHandOver(StepHookedHandOver):
    """The hand-over of one registered model: its units' parameters (``params``: one list per
    unit, the sharded parameters whose ``grad`` the loop reads), the optimizer's step pre-hook,
    and ``shards`` (the backend of the ranks that hold different shards, None when every rank
    holds whole gradients)."""

    def __init__(self, lifecycle, backend, params: Sequence[Sequence[torch.nn.Parameter]], shards=None):
        super().__init__(lifecycle, backend, None if shards is None else self._total)
        self.params = [list(unit) for unit in params]
        self.shards = shards
        self._delivered = False

    def deliver(self, finite: bool) -> None:
        """The backward's end (its step settled, not yet closed): scale and note the shards."""
        if self.active:
            self.hand_over.deliver(self._groups(), finite)
            self._delivered = True

    def _settle(self, *_) -> None:
        """The optimizer is about to step on the shards: what the loop did since the backward."""
        if not self._delivered:  # no backward since the last step (nothing scaled or noted)
            return
        self._delivered = False
        self.hand_over.settle(self._groups(), *self._settled_by)

    def _groups(self) -> List[SimpleNamespace]:
        """Each unit's averages as the loop reads them: the local tensors of its shards."""
        return [SimpleNamespace(send="compress", buffer=[_local(p.grad) for p in unit if p.grad is not None])
                for unit in self.params]

    def _total(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the shard group (not counted as training traffic)."""
        with self.shards.uncounted():
            return self.shards.allreduce_async([tensor]).wait()[0]


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient (a DTensor's local shard; it shares the storage)."""
    return grad.to_local() if hasattr(grad, "to_local") else grad


def sharded_params(group) -> List[torch.nn.Parameter]:
    """The sharded parameters of an FSDP parameter group (``p.grad`` holds their shards)."""
    return [fsdp_param.sharded_param for fsdp_param in group.fsdp_params]


def shard_backend(group, kind: str) -> Optional[TorchDistributedBackend]:
    """The backend over the ranks that hold different shards of ``group``'s gradients: the
    shard group (FSDP, HSDP), or None under ``replicate``."""
    return None if kind == REPLICATE else TorchDistributedBackend(group.mesh_info.shard_process_group)
