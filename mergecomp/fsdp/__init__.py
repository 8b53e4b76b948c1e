"""Compressed gradient exchange for FSDP2 (``torch.distributed.fsdp.fully_shard``).

    from torch.distributed.fsdp import fully_shard
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    state = mergecomp.fsdp.register(model, compressor="topk", compress_ratio=0.01)

FSDP2 reduces each unit's gradients (the parameters one ``fully_shard`` call grouped) with
one reduce-scatter: every rank hands in the unit's whole gradient and receives the average
of its own shard.  :func:`register` compresses, unit by unit:

- on a 1-D mesh, that reduce-scatter (``set_custom_reduce_scatter``;
  :mod:`mergecomp.fsdp.scatter` says how each kind of compressor travels);
- on a 2-D mesh (HSDP), the replicas' all-reduce of the already-sharded gradient only, the
  slow link between nodes, while FSDP's reduce-scatter within the shard group stays as it
  is (:mod:`mergecomp.fsdp.replica`); :func:`node_mesh` builds the 2-D mesh from the
  node layout, so that the replicas span nodes and the shards stay inside a node;
- on ``replicate`` (``torch.distributed._composable.replicate_with_fsdp``: data
  parallelism on FSDP2's machinery, whole parameters on a 1-D ``("replicate",)`` mesh),
  the all-reduce of each unit's whole gradient over every rank, through the same hook
  (:mod:`mergecomp.fsdp.replica`).

Every backward is one step of the shared step lifecycle (:class:`mergecomp.fsdp.units.BackwardStep`):
ranks agree on configuration, units and step before anything travels; a NaN/Inf gradient
never reaches a compressor or a residual, and drops the backward on every rank (or raises
with ``nonfinite="raise"``).

Memory cost of error feedback: on a 1-D mesh the residual is kept on the sender for the
gradient it compresses, i.e. one *unsharded* gradient per unit (as much memory per rank as
the whole model's gradients, in the reduce dtype), as under ``replicate``; under HSDP it is
one gradient *shard* per unit.  ``memory="none"`` keeps none; PowerSGD keeps its error and
factors per unit.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Union

import torch
import torch.distributed as dist

from .. import arguments, communicators
from ..distributed.backends.torch_dist import TorchDistributedBackend
from ..checkpoint import GroupSpec
from ..compressors import create as create_compressor
from ..compressors.base import Compressor
from ..memories.base import Memory
from ..runtime import gate
from ..runtime.drift import drift_meter
from ..runtime.step import check_nonfinite_policy
from .handover import FSDPHandOver, shard_backend, sharded_params
from .mesh import node_mesh
from .replica import HSDP, REPLICATE, SHARD, ReplicaAllReduce, exchange_kind, take_over
from .scatter import ScatterCommunicator, UnitShape, chunk_name, exchange_mode
from .state import FSDPCompression, configuration
from .units import (BackwardStep, CompressedReduceScatter, explain_fsdp_collectives, fsdp_units, param_group,
                    unit_shape)

#: Set on each unit that carries mergecomp's exchange.
_MARK = "_mergecomp_fsdp"

__all__ = ["register", "node_mesh", "CompressedReduceScatter", "ReplicaAllReduce", "FSDPCompression", "ScatterCommunicator"]


def register(model: torch.nn.Module, compressor: Union[str, Compressor] = "topk",
             memory: Union[str, Memory] = "auto", nonfinite: str = "skip", *,
             optimizer: Optional[torch.optim.Optimizer] = None, controller="auto",
             **options: Any) -> FSDPCompression:
    """Compress the gradient exchange of every FSDP2 unit in ``model``.

    Call it after ``fully_shard`` or ``replicate`` (on the layers, then the root) and before
    training.
    ``compressor``: a registered name (with ``options`` for it) or an instance;
    ``memory``: error feedback, ``"auto"`` for the compressor's recommendation
    (``residual`` for the sparsifiers); ``nonfinite``: what a NaN/Inf gradient on any rank
    does to the backward: ``"skip"`` drops it on every rank (every gradient NaN, state as
    before, a warning), ``"raise"`` drops it and raises ``NonFiniteGradient`` from
    ``loss.backward()``, ``"off"`` does not check.  ``optimizer``: the optimizer that steps
    on the model, vetted as the wrapper vets its own: a memory that takes SGD's momentum over
    (top-k's, DGC's) applies it before the exchange, a component that owns the momentum
    refuses one with its own, and a setting that contradicts the compressor's recipe warns.
    Shown the optimizer, a loop that clips the gradients between backward and ``step()`` is
    followed as under the wrapper (:mod:`mergecomp.fsdp.handover`).
    ``controller``: the quality controller, as for ``DistributedOptimizer`` (``"auto"``,
    ``"off"`` or a :class:`~mergecomp.DriftController`).
    """
    units = fsdp_units(model)
    for name, module in units:
        if getattr(module, _MARK, False):
            raise RuntimeError(f"FSDP unit {name!r} already has mergecomp's exchange installed: call "
                               "mergecomp.fsdp.register once per model (its returned state holds the "
                               "compression for every unit)")
    nonfinite = check_nonfinite_policy(nonfinite)
    meter = drift_meter(controller)
    if isinstance(compressor, str):
        compressor = create_compressor(compressor, **options)
    elif options:
        raise TypeError(f"options {sorted(options)} go with a compressor name; got the instance {compressor!r}")
    compressor, memory, carrier = arguments.resolve(compressor, memory, None)
    groups = [(index, name, module, param_group(name, module)) for index, (name, module) in enumerate(units)]
    groups = [entry for entry in groups if entry[3] is not None]
    shapes = {index: unit_shape(name, group) for index, name, _, group in groups}
    gate.vet_optimizer(optimizer, compressor, memory, {p.dtype for p in model.parameters() if p.requires_grad}
                       | {shape.dtype for shape in shapes.values()})
    meter.follow_optimizer(optimizer, memory)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("mergecomp.fsdp.register needs torch.distributed initialised (fully_shard "
                           "does too): call mergecomp.launch.init_distributed() first")
    kind = _check_mesh(groups)
    replicas = kind != SHARD  # the replicas' all-reduce is what is compressed
    # No collective here: a rank that never registers would meet it with FSDP's first
    # all-gather.  The first exchange checks that every rank registered, then each step's
    # preflight that they agree on the configuration and the units.
    world = TorchDistributedBackend()
    layout = [[name, [list(p.shape) for p in module.parameters()]] for name, module in units]
    config = configuration(compressor, memory, kind) + ("" if controller == "auto" else f" {meter.controller!r}")
    if replicas:
        meshes = {index: take_over(name, group) for index, name, _, group in groups}
        replicate = meshes[groups[0][0]][1]
        communicator = communicators.create(carrier, compressor=compressor, memory=memory,
                                            backend=TorchDistributedBackend(replicate))
    else:
        shard = groups[0][3].mesh_info.shard_process_group
        communicator = ScatterCommunicator(compressor, memory, TorchDistributedBackend(shard),
                                           {f"group{index}": shape for index, shape in shapes.items()})
    backward = BackwardStep(model, communicator, world, nonfinite, {"config": config, "layout": layout},
                            "allreduce" if replicas else "reduce_scatter")
    backward.lifecycle.meter = meter
    backward.loop = FSDPHandOver(backward.lifecycle, world, [sharded_params(group) for _, _, _, group in groups],
                                 shard_backend(groups[0][3], kind))
    if optimizer is not None:
        backward.loop.watch(optimizer, compressor, memory)
    installed: Dict[str, Any] = {}
    for index, name, module, group in groups:
        if replicas:
            unit = ReplicaAllReduce(name, index, group, backward, shapes[index].shard_layout(),
                                    dist.get_world_size(meshes[index][1]))
            module.set_all_reduce_hook(unit)
        else:
            unit = CompressedReduceScatter(name, index, backward, communicator)
            module.set_custom_reduce_scatter(unit)
        installed[name] = unit
        if kind != REPLICATE:  # a replicate unit runs no collective of FSDP's any more
            explain_fsdp_collectives(module, world, reduce_scatter=kind == HSDP)
        setattr(module, _MARK, True)
    return FSDPCompression(installed, compressor, memory, dist.get_rank(), dist.get_world_size(), backward,
                           _state_groups(shapes, compressor, memory, replicas), kind)


def _state_groups(shapes: Dict[int, UnitShape], compressor: Compressor, memory: Memory,
                  replicas: bool) -> Dict[str, GroupSpec]:
    """The key, size and dtype of every buffer the compressor and memory may keep state for
    (``replicas``: the replicas' all-reduce of what each unit holds is compressed)."""
    found = {}
    for index, shape in shapes.items():
        label = f"group{index}"
        if replicas:
            found[label] = GroupSpec(shape.chunk_numel, shape.dtype, shape.shard_layout())
        elif exchange_mode(compressor, memory) == "whole":
            found[label] = GroupSpec(shape.chunk_numel * shape.world, shape.dtype, shape.whole_layout())
        else:
            for j in range(shape.world):
                found[chunk_name(label, j)] = GroupSpec(shape.chunk_numel, shape.dtype, shape.shard_layout())
    return found


def _check_mesh(groups) -> str:
    """The units' :func:`~mergecomp.fsdp.replica.exchange_kind` (one for all of them), after
    checking that their meshes span every rank the same way: the per-step agreement and
    outcome vote run over all ranks."""
    if not groups:
        raise ValueError("no FSDP unit of the model has parameters: nothing to compress")
    kinds = {name: exchange_kind(group) for _, name, _, group in groups}
    if len(set(kinds.values())) > 1:
        raise ValueError(f"FSDP units mix kinds of data parallelism {kinds} (shard: fully_shard on a 1-D "
                         "mesh, hsdp: fully_shard on a 2-D mesh, replicate: replicate()): register() "
                         "compresses one kind per model; wrap every unit the same way, on the same mesh")
    world = dist.get_world_size()
    seen = set()
    for _, name, _, group in groups:
        ranks, span = _mesh_span(group)
        if span != world:
            raise ValueError(f"FSDP unit {name!r} is {kinds[name]}-parallel over {span} of the {world} ranks: "
                             "mergecomp.fsdp needs a mesh that spans every rank (its agreement and non-finite "
                             "vote run over all of them)")
        seen.add(ranks)
    if len(seen) > 1:
        raise ValueError(f"FSDP units reduce over different rank groups {sorted(seen)}: use one mesh for "
                         "every unit")
    return next(iter(kinds.values()))


def _mesh_span(group):
    """(the ranks of the group a unit reduces over first, how many ranks its mesh spans):
    the shard group (times the replicas under HSDP), or under replicate the replicate group."""
    info = group.mesh_info
    kind = exchange_kind(group)
    first = info.replicate_process_group if kind == REPLICATE else info.shard_process_group
    ranks = tuple(dist.get_process_group_ranks(first))
    return ranks, len(ranks) * (dist.get_world_size(info.replicate_process_group) if kind == HSDP else 1)
