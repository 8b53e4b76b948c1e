"""The hierarchical exchange's per-shard state, to and from per-rank state of whole groups.

The hierarchical communicator keeps error feedback where it compresses: local rank l of a
node holds the state of shard l of the node's *summed* gradient, under ``"<group>/shard<l>"``
(a residual, a momentum, a velocity: flat tensors of the shard's length).  A flat exchange
(allgather, allreduce, a raw send, the sparse allreduce) keeps each rank's state of the
whole group under ``"<group>"``.  What such state carries into later steps is the sum over
all ranks of what they hold: the next exchange, of either kind, adds each rank's part into
the average once (a node's sum is the sum of its ranks' gradients plus what they hold).
So a plan switch can move it exactly, in two moves:

- :func:`fold_shards`, no communication: rank l's shard state goes to elements
  ``first_l:end_l`` of a zero tensor of the whole group (added to the rank's own state of
  the group, if it has one).  The sum over ranks is unchanged, and the result is per-group
  state that :mod:`mergecomp.runtime.regroup` cuts into any new plan's groups.
- :func:`spread_to_shards`, one allreduce inside each node per state field: the node's
  sum of its ranks' whole-group state, of which local rank l keeps shard l.  The sum over
  ranks is again unchanged.

Counters keyed by shard (a random stream's step) fold to their group, where regrouping
restarts them identically on every rank; state that is neither (a low-rank matrix of a
shard) stays under its shard key, and the regroup refuses it by name.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Sequence, Tuple

import torch

from ..distributed.backends.expect import DTYPE_NAME, object_of

#: numel → (this rank's first element, its end): the shard of a group of numel elements.
Bounds = Callable[[int], Tuple[int, int]]


def shard_key(group: str, local_rank: int) -> str:
    """The state key of local rank ``local_rank``'s shard of ``group``."""
    return f"{group}/shard{local_rank}"


def fold_shards(state: Any, sizes: Dict[str, int], local_rank: int, bounds: Bounds) -> Any:
    """``state`` (a nested state dict) with every tensor kept for this rank's shard of a group
    in ``sizes`` (elements per group) placed in a tensor of the whole group, zeros elsewhere;
    see the module.  Returns new dicts; the tensors of ``state`` are not changed."""
    if not isinstance(state, dict):
        return state
    suffix = shard_key("", local_rank)
    folded: Dict[Any, Any] = {}
    shards = []
    for key, value in state.items():
        group = key[:-len(suffix)] if isinstance(key, str) and key.endswith(suffix) else None
        if group in sizes:
            shards.append((group, key, value))
        else:
            folded[key] = fold_shards(value, sizes, local_rank, bounds)
    for group, key, value in shards:
        first, end = bounds(sizes[group])
        whole = folded.get(group)
        if isinstance(value, torch.Tensor) and value.numel() == end - first and (
                whole is None or isinstance(whole, torch.Tensor) and whole.numel() == sizes[group]):
            whole = (torch.zeros(sizes[group], dtype=value.dtype, device=value.device) if whole is None
                     else whole.reshape(-1).clone())
            whole[first:end] += value.reshape(-1).to(whole.dtype)
            folded[group] = whole
        elif isinstance(value, int) and not isinstance(value, bool) and whole is None:
            folded[group] = value
        else:
            folded[key] = value
    return folded


def _whole(value: Any, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).to(dtype)
    return torch.zeros(numel, dtype=dtype, device=device)


def spread_to_shards(parts: Dict[str, Dict[str, Any]], groups: Sequence[Tuple[str, int]], local_rank: int,
                     bounds: Bounds, intra, device: torch.device) -> Dict[str, Dict[str, Any]]:
    """The parts of ``parts`` (``{"memory": its state, "compressor": its state}``) that hold
    state of the whole groups ``groups`` (``[(name, numel)]``, the same on every rank), with
    that state replaced by this rank's shard of the node's sum (see the module); parts
    with nothing to move are left out.

    A collective over the node's ranks (``intra``, a backend over the node's group): which
    fields hold tensors of these groups, and their dtype, is agreed first (a rank may hold
    none), then one allreduce per field sums the node's state of every group at once."""
    names = {name for name, _ in groups}
    held: Dict[str, str] = {}
    for part, state in parts.items():
        for field, table in state.items():
            if isinstance(table, dict):
                found = [t for g, t in table.items() if g in names and isinstance(t, torch.Tensor)]
                if found:
                    held[f"{part}/{field}"] = str(found[0].dtype).replace("torch.", "")
    agreed: Dict[str, str] = {}
    for seen in intra.allgather_object(held, expect=object_of(DTYPE_NAME)):
        for path, dtype in seen.items():
            agreed.setdefault(path, dtype)
    result: Dict[str, Dict[str, Any]] = {}
    for path in sorted(agreed):
        part, field = path.split("/", 1)
        result.setdefault(part, dict(parts.get(part, {})))
        table = dict(result[part].get(field, {}))
        dtype = getattr(torch, agreed[path])
        node_sum = torch.cat([_whole(table.get(name), numel, dtype, device) for name, numel in groups])
        intra.allreduce_async((node_sum,)).wait()
        offset = 0
        for name, numel in groups:
            first, end = bounds(numel)
            mine = table.pop(name) if isinstance(table.get(name), torch.Tensor) else None
            piece = node_sum[offset + first:offset + end]
            if end > first and (mine is not None or bool(piece.any())):
                key = shard_key(name, local_rank)
                value = piece.to(mine.dtype if mine is not None else dtype).clone()
                if isinstance(table.get(key), torch.Tensor):
                    value += table[key].reshape(-1).to(value.dtype)
                table[key] = value
            offset += numel
        result[part][field] = table
    return result
