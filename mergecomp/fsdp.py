"""Compressed gradient reduce-scatter for FSDP2 (``torch.distributed.fsdp.fully_shard``).

    from torch.distributed.fsdp import fully_shard
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    state = mergecomp.fsdp.register(model, compressor="topk", compress_ratio=0.01)

FSDP2 reduces each unit's gradients (the parameters one ``fully_shard`` call grouped) with
one reduce-scatter: every rank hands in the unit's whole, unsharded gradient, laid out as
``world_size`` equal chunks, and receives the average of chunk ``rank`` over ranks, its own
shard.  :func:`register` swaps that collective, unit by unit, for
:class:`CompressedReduceScatter` (``FSDPModule.set_custom_reduce_scatter``):

- a compressor whose payloads add up (``summable``: the fp16/bf16 casts, FP32 ``none``)
  with no error feedback travels by a plain reduce-scatter of the cast chunks;
- any other one-shot, fixed-size compressor (top-k, rand-k, QSGD, TernGrad, ...) encodes
  each destination's chunk separately, and one ``all_to_all`` delivers to each rank the
  payloads of its own chunk from every rank, which it decodes and sums.  The payloads of
  one call share one uint8 buffer, so a unit costs one collective whatever the payload's
  parts.

Error feedback works on the sender's side, per unit and destination chunk: a rank keeps a
residual for every chunk it encodes, so the memory costs one unsharded gradient per unit
(the whole model's gradient size per rank, in the reduce dtype): the price of compressing
what FSDP would otherwise send whole.  FSDP's averaging is kept: the collective's ``op``
(``AVG``, ``SUM`` or ``PREMUL_SUM(1/factor)`` after ``set_gradient_divide_factor``) scales
the decoded sum exactly as the reduce-scatter it replaces would.

A non-finite gradient never reaches a compressor or a residual: a rank whose chunk holds a
NaN/Inf sends zeros with a flag beside its payloads, and every rank sees the flag.  When
autograd finishes the backward, every rank drops it whole (:class:`BackwardOutcome`): all
residuals and compressor state as before it, every gradient NaN, a warning, a count
(:attr:`FSDPCompression.dropped`).  Skipping ``optimizer.step()`` then is the training
loop's part, as with plain FSDP2: raising inside FSDP's backward hooks would leave its
parameters unsharded, so there is no "raise" policy.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import arguments
from .backends.serialize import pack, unpack
from .checkpoint import CheckpointError, GroupSpec, SOURCE, check_finite, check_shapes, describe_source, seal, verify
from .compressors import create as create_compressor
from .compressors.base import Compressor, check_dtypes
from .memories.base import Memory
from .memories.none import NoneMemory
from .runtime.agreement import StepAgreement

try:  # FSDP2's public module and its custom-collective interface (torch >= 2.6 has both)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover - an older torch
    FSDPModule, ReduceScatter = None, object

__all__ = ["register", "CompressedReduceScatter", "FSDPCompression"]

#: What FSDP's reduce-scatter may be asked to do; anything else is refused by name.
_OPS = {"AVG", "SUM", "PREMUL_SUM"}


def _scale(op, world_size: int) -> Tuple[float, int]:
    """(multiplier, divisor) that turn the sum over ranks into what ``op`` asks for (an
    average divides, as the backends' ``AVG`` does, so FP32 results match it bit for bit)."""
    kind = getattr(op, "op", op)  # a PREMUL_SUM arrives as a ReduceOp object carrying a factor
    name = getattr(kind, "name", str(kind)).split(".")[-1]
    if name not in _OPS:
        raise ValueError(f"the compressed reduce-scatter sums or averages gradients, but FSDP asked "
                         f"for {op!r}: use FSDP's own reduce-scatter for this module")
    if name == "AVG":
        return 1.0, world_size
    if name == "PREMUL_SUM":
        return float(op.factor), 1
    return 1.0, 1


class CompressedReduceScatter(ReduceScatter):
    """One FSDP unit's reduce-scatter, compressed (see the module for the two ways).

    ``wire_bytes``: what this rank has put on the wire for this unit so far (its payloads
    for the other ranks' chunks, and the flag); ``uncompressed_bytes``: what FSDP's own
    reduce-scatter of the same gradients would have put there (the chunks for the other
    ranks, in the reduce dtype); ``calls``: the reduce-scatters run; ``dropped``: those that
    met a non-finite gradient.
    """

    def __init__(self, name: str, compressor: Compressor, memory: Memory, chunk: Optional[GroupSpec] = None,
                 backward: Optional["BackwardOutcome"] = None):
        self.name = name
        self.compressor = compressor
        self.memory = memory
        #: Where this unit reports its outcome; the whole backward commits or rolls back there.
        self.backward = backward if backward is not None else BackwardOutcome(None, compressor, memory)
        #: What each destination chunk holds (its numel and the reduce dtype), when known.
        self.chunk = chunk
        self.wire_bytes = 0
        self.uncompressed_bytes = 0
        self.calls = 0
        self.dropped = 0

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    @property
    def plain(self) -> bool:
        """Whether the cast chunks can simply be reduce-scattered (no decoding per rank)."""
        return self.compressor.summable and isinstance(self.memory, NoneMemory)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False):
        """Write this rank's shard of the reduced ``input_tensor`` into ``output_tensor``.

        Runs to completion before it returns (FSDP2 reads the shard right after a
        synchronous call), so it returns None even when ``async_op`` is asked for.
        """
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        multiplier, divisor = _scale(op, world)
        chunks = input_tensor.view(world, -1)
        self.calls += 1
        self.uncompressed_bytes += chunks[0].numel() * chunks.element_size() * (world - 1)
        if self.plain:
            if not self.compressor.lossless and (multiplier, divisor) != (1.0, 1):
                # average before the cast, as DDP's 16-bit hook does: a sum of N fp16
                # gradients overflows N times sooner
                chunks, multiplier, divisor = chunks * multiplier / divisor, 1.0, 1
            total = self._reduce_scatter(chunks, rank, group)
        else:
            total = self._all_to_all(chunks, rank, group)
        if total is None:
            output_tensor.fill_(float("nan"))
            return None
        total = total.reshape(-1)
        if multiplier != 1.0:
            total = total * multiplier
        if divisor != 1:
            total = total / divisor
        output_tensor.copy_(total)
        return None

    # -- the two exchanges ------------------------------------------------------------------------
    def _reduce_scatter(self, chunks: torch.Tensor, rank: int, group) -> torch.Tensor:
        """A summable compressor: reduce-scatter the cast chunks, decode the summed shard."""
        payloads, ctx = [], None
        for j in range(chunks.shape[0]):
            payload, chunk_ctx = self.compressor.compress(chunks[j], self._chunk(j))
            payloads.append(payload[0].reshape(-1))
            ctx = chunk_ctx if j == rank else ctx
        send = torch.stack(payloads)
        out = torch.empty_like(send[0])
        dist.reduce_scatter_single(output=out, input=send.reshape(-1), group=group)
        self.wire_bytes += send.numel() * send.element_size() * (send.shape[0] - 1) // send.shape[0]
        self.backward.report(self.name, [])
        return self.compressor.decompress((out,), ctx)

    def _all_to_all(self, chunks: torch.Tensor, rank: int, group) -> Optional[torch.Tensor]:
        """Encode every destination's chunk, swap payloads by all_to_all, decode and sum
        the ones for this rank's chunk; None when some rank's gradient was non-finite."""
        world = chunks.shape[0]
        nonfinite = bool(not torch.isfinite(chunks).all())
        if nonfinite:  # a compressor or a residual must never see it: send zeros, flagged
            chunks = torch.zeros_like(chunks)
        flag = torch.tensor([float(nonfinite)], dtype=torch.float32, device=chunks.device)
        blobs, shapes, dtypes, ctx = [], None, None, None
        for j in range(world):
            name = self._chunk(j)
            compensated = self.memory.compensate(chunks[j], name)
            payload, chunk_ctx = self.compressor.compress(compensated, name)
            self.memory.update(compensated, name, self.compressor, payload, chunk_ctx)
            parts = tuple(payload) + (flag,)
            if shapes is None:
                shapes, dtypes = [p.shape for p in parts], [p.dtype for p in parts]
            elif [p.shape for p in parts] != shapes:
                self.memory.rollback()
                raise ValueError(f"{self.compressor!r} gave payloads of different shapes for the equal "
                                 f"chunks of FSDP unit {self.name!r}: it is not fixed-size")
            if j == rank:
                ctx = chunk_ctx
            blobs.append(pack(parts, chunks.device))
        send = torch.cat(blobs)
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
        self.wire_bytes += send.numel() * (world - 1) // world
        per_rank = received.view(world, -1)
        payloads, flagged = [], []
        for source in range(world):
            parts = unpack(per_rank[source], shapes, dtypes)
            payloads.append(parts[:-1])
            if float(parts[-1][0]) != 0.0:
                flagged.append(source)
        self.backward.report(self.name, flagged)
        if flagged:
            self.dropped += 1
            return None
        return self.compressor.decompress_sum(payloads, ctx)

    def _chunk(self, index: int) -> str:
        return chunk_name(self.name, index)


def chunk_name(unit: str, index: int) -> str:
    """The key of unit ``unit``'s chunk ``index`` in the memory and the compressor."""
    return f"{unit}#shard{index}"


class BackwardOutcome:
    """One backward's units, settled together when autograd finishes it.

    Each unit's reduce-scatter stages what it writes into residuals and compressor state and
    reports whether a rank's gradient was non-finite (every rank learns the same through the
    flags it received).  At the end of the backward (an autograd callback the first unit
    queues), everything is committed, or, when any unit was non-finite, rolled back for every
    unit and every gradient of the model is set to NaN: the backward is dropped whole on
    every rank, as the wrapper drops a step, so a loop that skips ``optimizer.step()`` on a
    non-finite gradient loses nothing and the residuals are as before the backward.
    """

    def __init__(self, model: Optional[torch.nn.Module], compressor: Compressor, memory: Memory):
        self.model, self.compressor, self.memory = model, compressor, memory
        self.dropped_backwards = 0
        self._open = False
        self._bad: Dict[str, List[int]] = {}

    def report(self, unit: str, bad_ranks: List[int]) -> None:
        """A unit's outcome; the first of a backward queues :meth:`settle` for its end."""
        if bad_ranks:
            self._bad[unit] = bad_ranks
        if self._open:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self.settle)
            self._open = True
        except RuntimeError:  # outside a backward pass (a direct call): settle this unit now
            self.settle()

    def settle(self) -> None:
        """Commit every unit's state, or drop the whole backward (see the class)."""
        bad, self._bad, self._open = self._bad, {}, False
        if not bad:
            self.memory.commit()
            self.compressor.commit()
            return
        self.memory.rollback()
        self.compressor.rollback()
        self.dropped_backwards += 1
        if self.model is not None:
            with torch.no_grad():
                for parameter in self.model.parameters():
                    if parameter.grad is not None:
                        grad = parameter.grad
                        (grad.to_local() if hasattr(grad, "to_local") else grad).fill_(float("nan"))
        found = "; ".join(f"unit {unit!r}: rank(s) {ranks}" for unit, ranks in bad.items())
        warnings.warn(f"mergecomp: a non-finite gradient under FSDP ({found}); the backward was dropped on "
                      "every rank: every gradient is NaN and error-feedback state is as before it. "
                      f"{self.dropped_backwards} backward(s) dropped so far; skip optimizer.step() when "
                      "the gradients are not finite", RuntimeWarning, stacklevel=2)


_ADVICE = ("Nothing was loaded. Load an earlier checkpoint, or go on without this one: error feedback "
           "then restarts from zero")


class FSDPCompression:
    """What :func:`register` installed: the compressed reduce-scatter of each FSDP unit,
    their byte counts, and the compression state to checkpoint."""

    def __init__(self, units: Dict[str, CompressedReduceScatter], compressor: Compressor, memory: Memory,
                 rank: int, world_size: int, backward: BackwardOutcome):
        self.units = units
        self.backward = backward
        self.compressor = compressor
        self.memory = memory
        self.rank, self.world_size = rank, world_size

    @property
    def wire_bytes(self) -> int:
        """Bytes this rank has sent for every unit so far."""
        return sum(unit.wire_bytes for unit in self.units.values())

    @property
    def uncompressed_bytes(self) -> int:
        """Bytes FSDP's own reduce-scatter would have sent for the same gradients."""
        return sum(unit.uncompressed_bytes for unit in self.units.values())

    @property
    def dropped(self) -> int:
        """Backwards dropped because a gradient was non-finite."""
        return self.backward.dropped_backwards

    # -- checkpoints -------------------------------------------------------------------------
    def _configuration(self) -> str:
        return f"{self.compressor!r} {self.memory!r}"

    def groups(self) -> Dict[str, GroupSpec]:
        """Each chunk's key → its size and dtype: what saved state must fit."""
        return {chunk_name(name, j): unit.chunk for name, unit in self.units.items()
                for j in range(self.world_size) if unit.chunk is not None}

    def state_dict(self) -> Dict[str, Any]:
        """This rank's residuals and compressor state, sealed with a checksum.  Save one
        file per rank (``mergecomp.save(state.state_dict(), f"fsdp.rank{rank}.pt")``) beside
        FSDP's own checkpoint of the model and optimizer."""
        return seal({"configuration": self._configuration(), "rank": self.rank, "world_size": self.world_size,
                     "compressor": self.compressor.state_dict(), "memory": self.memory.state_dict()})

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` after every check passed (checksum, configuration, rank,
        world size, finite values, each residual's shape and dtype); otherwise
        :class:`~mergecomp.checkpoint.CheckpointError` and nothing changes."""
        try:
            self._check(state)
        except CheckpointError as error:  # the same refusal, with this entry point's advice
            raise error.advise(_ADVICE) from None
        self.memory.load_state_dict(state.get("memory", {}))
        self.compressor.load_state_dict(state.get("compressor", {}))

    def _check(self, state: Dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise CheckpointError(f"FSDP compression state must be the dict state_dict() returned, got "
                                  f"{type(state).__name__}")
        source = state.get(SOURCE)
        where = describe_source(source)
        verify(state, "FSDP compression state", source, self.groups())
        for key, here in (("configuration", self._configuration()), ("rank", self.rank),
                          ("world_size", self.world_size)):
            if state.get(key) != here:
                raise CheckpointError(f"{where}: it was saved with {key} {state.get(key)!r}, this run has "
                                      f"{here!r}: residuals belong to one rank of one configuration; "
                                      f"load each rank's own file of the same run")
        groups = self.groups()
        check_finite(state, "FSDP compression state", source, groups)
        check_shapes(self.memory, state.get("memory", {}), groups, f"the {self.memory!r} state", source)
        check_shapes(self.compressor, state.get("compressor", {}), groups, f"the {self.compressor!r} state", source)

    def __repr__(self) -> str:
        return f"FSDPCompression({self.compressor!r}, {self.memory!r}, units={list(self.units)})"


def register(model: torch.nn.Module, compressor: Union[str, Compressor] = "topk",
             memory: Union[str, Memory] = "auto", nonfinite: str = "skip", **options: Any) -> FSDPCompression:
    """Compress the gradient reduce-scatter of every FSDP2 unit in ``model``.

    Call it after ``fully_shard`` (on the layers, then the root) and before training.
    ``compressor``: a registered name (with ``options`` for it) or an instance;
    ``memory``: error feedback, ``"auto"`` for the compressor's recommendation
    (``residual`` for the sparsifiers); ``nonfinite``: ``"skip"``, the one policy under FSDP
    (see the module), named so that a script written for the wrapper's options fails clearly.
    """
    units = _fsdp_units(model)
    if nonfinite != "skip":
        raise ValueError(f"nonfinite must be 'skip' under FSDP, got {nonfinite!r}: a non-finite backward is "
                         "dropped on every rank (NaN gradients, residuals as before, a warning); raising inside "
                         "FSDP's backward hooks would leave its parameters unsharded")
    if isinstance(compressor, str):
        compressor = create_compressor(compressor, **options)
    elif options:
        raise TypeError(f"options {sorted(options)} go with a compressor name; got the instance {compressor!r}")
    compressor, memory, _ = arguments.resolve(compressor, memory, None)
    _check_compressor(compressor, memory)
    check_dtypes(compressor, {p.dtype for p in model.parameters() if p.requires_grad})
    _check_ranks_agree(model, units, compressor, memory)
    compressor.set_process_rank(dist.get_rank())
    backward = BackwardOutcome(model, compressor, memory)
    installed = {}
    for name, module in units:
        unit = CompressedReduceScatter(name, compressor, memory, _chunk_spec(module), backward)
        module.set_custom_reduce_scatter(unit)
        installed[name] = unit
    return FSDPCompression(installed, compressor, memory, dist.get_rank(), dist.get_world_size(), backward)


def _chunk_spec(module: torch.nn.Module) -> Optional[GroupSpec]:
    """What FSDP's reduce-scatter hands each rank's chunk of this unit: the padded shards of
    its parameters, in the reduce dtype; None for a unit without parameters of its own."""
    group = module._get_fsdp_state()._fsdp_param_group
    if group is None or not group.fsdp_params:
        return None
    numel = sum(p.padded_sharded_param_size.numel() for p in group.fsdp_params)
    policy = group.mp_policy
    dtype = policy.reduce_dtype or policy.param_dtype or group.fsdp_params[0].sharded_param.dtype
    return GroupSpec(numel, dtype, None)


def _fsdp_units(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """(name, module) of every FSDP2 unit in ``model``, or a TypeError saying what to do."""
    if FSDPModule is None:  # pragma: no cover
        raise RuntimeError("mergecomp.fsdp needs FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6)")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"register() needs the model after fully_shard, got {type(model).__name__}")
    units = [(name or "<root>", m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not units:
        raise TypeError(f"{type(model).__name__} has no FSDP2 module: call "
                        "torch.distributed.fsdp.fully_shard on its layers and on the model first "
                        "(for DistributedDataParallel use mergecomp.ddp.register)")
    for name, module in units:
        group = module._get_fsdp_state()._fsdp_param_group
        if group is not None and hasattr(group.mesh_info, "replicate_process_group"):
            raise ValueError(f"FSDP unit {name!r} is hybrid-sharded (HSDP, a 2-D mesh): its replicas' "
                             "all-reduce is not compressed yet; use a 1-D mesh")
    return units


def _check_ranks_agree(model: torch.nn.Module, units, compressor: Compressor, memory: Memory) -> None:
    """Raise :class:`~mergecomp.runtime.agreement.RanksDisagree` on every rank, naming what
    differs, unless every rank registered the same compressor, memory and units: otherwise
    the ranks' all_to_all payloads would differ in size and be misread.  One small
    allreduce; the details travel only when ranks differ."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("mergecomp.fsdp.register needs torch.distributed initialised (fully_shard "
                           "does too): call mergecomp.launch.init_distributed() first")
    from .backends.torch_dist import TorchDistributedBackend
    facts = {"config": f"{compressor!r} {memory!r}",
             "layout": [[name, [list(p.shape) for p in module.parameters()]] for name, module in units]}
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    agreement = StepAgreement(TorchDistributedBackend(), device)
    agreement.check(agreement.preflight(facts), facts, "at mergecomp.fsdp.register")


def _check_compressor(compressor: Compressor, memory: Memory) -> None:
    """Refuse, with the reason, a compressor the per-chunk exchange cannot carry."""
    if getattr(compressor, "multi_round", False):
        raise ValueError(f"{compressor!r} exchanges in several rounds (low-rank methods), which the FSDP "
                         "reduce-scatter does not drive yet: use a one-shot compressor (topk, randk, "
                         "qsgd, fp16, bf16, ...)")
    if not getattr(compressor, "average", True):
        raise ValueError(f"{compressor!r} sends an update direction rather than a sum (majority vote), "
                         "which FSDP's averaging cannot scale: use a compressor that averages")
    if not getattr(compressor, "fixed_size", True):
        raise ValueError(f"{compressor!r} sends payloads whose size depends on the values, which one "
                         "all_to_all cannot carry: use a fixed-size compressor (topk rather than a "
                         "threshold sparsifier)")
