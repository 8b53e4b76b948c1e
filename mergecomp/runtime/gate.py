"""The gate every entry point passes: at construction, and when it saves or loads a checkpoint.

Data parallelism is correct only if every rank trains the same parameters from the same
values with the same configuration, and a checkpoint is only safe to load on the rank and
run that wrote it.  The wrapper, the DDP hook, FSDP2 and DiLoCo all ask the same questions,
so they ask them here, in the same words:

Construction
    :func:`trainable_parameters` (which parameters are exchanged, named),
    :func:`check_same_parameters` (one allgather of names, shapes and dtypes: a rank that
    built another model is named before any gradient collective could hang),
    :func:`check_ranks_agree` (one allgather of the configuration, field by field: an error
    names each field that differs and every rank's value),
    :func:`start_from_rank0` (rank 0's parameters and buffers broadcast, or checked equal),
    :func:`vet_optimizer` (components that own part of the update refuse an optimizer that
    would apply it again, take over its momentum where they can, and a recipe warns).

Checkpoints
    :func:`seal_state` writes one envelope: ``format``, ``kind`` (which entry point),
    ``rank``, ``world_size``, ``config`` (the configuration digest) and ``lifecycle`` (the
    step lifecycle's own counters), beside the entry point's payload keys, sealed with a
    checksum (:mod:`mergecomp.checkpoint`).  :func:`check_envelope` is the one check that a
    state belongs here, run before anything is loaded.
"""
from __future__ import annotations

import collections
import json
import zlib
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import torch

from .. import checkpoint
from ..compressors import recipes
from ..compressors.base import Compressor, check_dtypes
from ..distributed.backends.base import Backend
from ..distributed.backends.expect import INT, OBJECT, STRING, list_of, optional, tuple_of
from ..memories.base import Memory
from .agreement import RanksDisagree, describe_disagreement

NamedParameters = List[Tuple[str, torch.nn.Parameter]]


# -- which parameters ------------------------------------------------------------------------
def trainable_parameters(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[Iterable[Tuple[str, torch.nn.Parameter]]],
                         model: Optional[torch.nn.Module] = None,
                         who: str = "the optimizer") -> NamedParameters:
    """The optimizer's parameters that require a gradient, named from ``named_parameters``
    (default: ``model``'s, else ``param.<i>`` in the optimizer's order), in that order."""
    if named_parameters is None and model is not None:
        named_parameters = model.named_parameters()
    in_optimizer = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        named = [(f"param.{i}", p) for i, p in enumerate(in_optimizer)]
    else:
        named = list(named_parameters)
        if named and not (isinstance(named[0], tuple) and len(named[0]) == 2):
            raise ValueError("named_parameters must yield (name, parameter) pairs, e.g. "
                             "model.named_parameters()")
        counts = collections.Counter(n for n, _ in named)
        duplicates = sorted(n for n, c in counts.items() if c > 1)
        if duplicates:
            raise ValueError(f"named_parameters has duplicate names {duplicates[:5]}")
        known = {id(p) for _, p in named}
        unnamed = sum(1 for p in in_optimizer if id(p) not in known)
        if unnamed:
            raise ValueError(f"{unnamed} parameters of {who} are missing from named_parameters; pass "
                             "model.named_parameters() of the model whose parameters the optimizer holds")
        wanted = {id(p) for p in in_optimizer}
        named = [(n, p) for n, p in named if id(p) in wanted]
    return [(n, p) for n, p in named if p.requires_grad]


def named_in_optimizer(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> NamedParameters:
    """The optimizer's parameters in order, named from ``names`` (by ``id``), else
    ``param.<i>`` by position (as :func:`trainable_parameters` names them)."""
    in_optimizer = [p for group in optimizer.param_groups for p in group["params"]]
    return [(names.get(id(p), f"param.{i}"), p) for i, p in enumerate(in_optimizer)]


# -- the ranks agree -------------------------------------------------------------------------
def check_same_parameters(backend: Backend, params: NamedParameters) -> None:
    """Every rank must hold the same trainable parameters (names, shapes, dtypes), or the
    exchanges would pair different tensors or hang: a ValueError on every rank naming the
    first difference."""
    signature = [[n, list(p.shape), str(p.dtype)] for n, p in params]  # JSON: lists
    everyone = backend.allgather_object(signature, expect=list_of(tuple_of(STRING, list_of(INT), STRING)))
    for rank, theirs in enumerate(everyone):
        if theirs != signature:
            mine = dict((n, (s, d)) for n, s, d in signature)
            other = dict((n, (s, d)) for n, s, d in theirs)
            diff = next((f"{n}: {mine.get(n)} here vs {other.get(n)} on rank {rank}"
                         for n in list(mine) + list(other) if mine.get(n) != other.get(n)),
                        "same parameters in a different order")
            raise ValueError(
                f"rank {backend.rank} and rank {rank} hold different models "
                f"({len(signature)} vs {len(theirs)} trainable parameters; first difference: "
                f"{diff}). Build the same model on every rank before wrapping the optimizer.")


def check_ranks_agree(backend: Backend, where: str, facts: Mapping[str, Any]) -> None:
    """One allgather of ``facts`` (a field → a JSON value each); unless every rank has the
    same, :class:`~mergecomp.runtime.agreement.RanksDisagree` on every rank naming each field
    that differs and every rank's value.  Give readable fields (``sync_every``,
    ``compressor``), not only a digest of them."""
    mine = {key: _plain(value) for key, value in facts.items()}
    everyone = backend.allgather_object(mine, expect=OBJECT)
    if any(theirs != mine for theirs in everyone):
        raise RanksDisagree(describe_disagreement(everyone, where))


def _plain(value: Any) -> Any:
    """``value`` as JSON carries it (tuples as lists), so equal values compare equal after
    the exchange; anything else as its repr."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return repr(value)


def config_digest(*parts: Any) -> str:
    """A short digest of configuration reprs (what ranks must agree on, what a checkpoint
    belongs to)."""
    text = "|".join(repr(p) for p in parts)
    return f"{zlib.crc32(text.encode()):08x}"


def check_registered(backend: Backend, like: torch.Tensor, collective: str, what: str, theirs: str,
                     fix: str) -> None:
    """Once, before an entry point's first exchange: fail clearly if some rank runs the
    framework's own collective (``theirs``) where this rank runs mergecomp's.

    Collectives of different sizes are what gloo answers by aborting one process and
    resetting the others' connections, and NCCL by hanging.  So this rank's first collective
    is shaped exactly like the framework's (``collective``: ``"allreduce"`` of a tensor like
    ``like``, or ``"reduce_scatter"`` of ``like`` as (world, n) rows) and pairs with it: each
    registered rank writes a large marker into its own element (of every row), and an
    element without its marker names a rank that did not register (a rank's gradient is far
    below the marker).  It costs one collective, once.
    """
    size, rank = backend.size, backend.rank
    if size == 1 or like.numel() == 0:
        return
    marker = registration_marker(like.dtype, size)
    with backend.uncounted():  # a check, not training traffic: the step's bytes stay the gradients'
        if collective == "reduce_scatter":
            probe = torch.zeros((size, like.numel() // size), dtype=like.dtype, device=like.device)
            slots = probe.shape[1] >= size
            probe[:, rank if slots else 0] = marker
            total = backend.reduce_scatter(probe)
        else:
            probe = torch.zeros(like.numel(), dtype=like.dtype, device=like.device)
            slots = like.numel() >= size
            probe[rank if slots else 0] = marker
            (total,) = backend.allreduce_async([probe]).wait()
    seen = total[:size if slots else 1].real if total.is_complex() else total[:size if slots else 1]
    seen = seen.double().tolist()
    if slots:
        missing = [r for r, value in enumerate(seen) if not value > marker / 2]
    else:
        count = round(seen[0] / marker) if seen[0] == seen[0] else 0
        missing = [] if count == size else None
    if missing == []:
        return
    which = (f"rank(s) {missing}" if missing is not None
             else f"{size - count} of the {size} ranks (which ones cannot be told: the first buffer "
                  f"has fewer elements than there are ranks)")
    error = RuntimeError(
        f"{what} is not registered on {which} (this is rank {rank} of {size}): those ranks run "
        f"{theirs} while this one compresses, so their collectives cannot meet. {fix} The ranks "
        "without it received this check's markers as their first gradient and fail at their next "
        "collective.")
    beacon = getattr(backend, "beacon", None)
    if beacon is not None:  # the progress records then say why this rank stopped
        beacon.fail(str(error))
    raise error


def registration_marker(dtype: torch.dtype, size: int) -> float:
    """A value far above any gradient that ``size`` ranks can sum without overflow."""
    real = torch.empty((), dtype=dtype).real.dtype if dtype.is_complex else dtype
    return float(torch.finfo(real).max) / (4 * size) if real.is_floating_point else 1.0


# -- the same model everywhere ---------------------------------------------------------------
def start_from_rank0(backend: Backend, params: NamedParameters, model: Optional[torch.nn.Module] = None,
                     how: str = "broadcast") -> None:
    """Every rank starts from rank 0's parameters (and ``model``'s buffers): ``"broadcast"``
    copies them, as DDP and Horovod do; ``"check"`` requires them equal already (a ValueError
    on every rank naming the first tensor that differs)."""
    if how not in ("broadcast", "check"):
        raise ValueError(f"initial_sync must be 'broadcast' (copy rank 0's model to every rank) or "
                         f"'check' (require equal models), got {how!r}")
    tensors = [p for _, p in params]
    names = [n for n, _ in params]
    if model is not None:
        for name, buffer in model.named_buffers():
            tensors.append(buffer)
            names.append(name)
    if backend.size == 1 or not tensors:
        return
    if how == "broadcast":
        with torch.no_grad():
            broadcast_tensors(backend, tensors, src=0)
        return
    copies = [t.detach().clone() for t in tensors]
    with torch.no_grad():
        broadcast_tensors(backend, copies, src=0)
    differs = None
    for name, t, theirs in zip(names, tensors, copies):
        if not torch.equal(t.detach(), theirs):
            gap = (t.detach().double() - theirs.double()).abs().max().item() \
                if t.dtype.is_floating_point else "not equal"
            differs = f"{name!r} (max difference {gap})"
            break
    everyone = backend.allgather_object(differs, expect=optional(STRING))  # every rank raises alike
    bad = [(rank, what) for rank, what in enumerate(everyone) if what is not None]
    if bad:
        listed = "; ".join(f"rank {rank}: {what}" for rank, what in bad)
        raise ValueError(
            f"ranks start from a different model than rank 0 ({listed}). Seed every rank "
            "alike, load the same checkpoint everywhere, or use initial_sync='broadcast' to "
            "copy rank 0's model.")


def broadcast_tensors(backend: Backend, tensors: Iterable[torch.Tensor], src: int = 0) -> None:
    """Overwrite ``tensors`` on every rank with rank ``src``'s, one collective per dtype and
    device (the tensors are flattened into one buffer each)."""
    buckets: Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]] = collections.OrderedDict()
    for t in tensors:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    for (dtype, device), members in buckets.items():
        flat = torch.cat([t.detach().reshape(-1) for t in members])
        if flat.numel() == 0:
            continue
        wire = flat.view(torch.uint8) if dtype == torch.bool else flat  # gloo has no bool
        backend.broadcast(wire, src)
        offset = 0
        for t in members:
            n = t.numel()
            t.data.copy_(flat[offset:offset + n].view_as(t))
            offset += n


# -- the optimizer and the dtypes ------------------------------------------------------------
def vet_optimizer(optimizer: Optional[torch.optim.Optimizer], compressor: Compressor, memory: Memory,
                  dtypes: Iterable[torch.dtype] = (), warn: bool = True) -> Optional[str]:
    """The compressor must carry ``dtypes``; components that own part of the update (the
    ``dgc`` memory's momentum, SIGNUM's) vet ``optimizer`` through their ``check_optimizer``:
    they refuse one that would apply it again, or take its momentum over where they can; then
    the compressor's recipe is held against ``optimizer`` (None: not known yet, the memory and
    the ratio are judged alone).  Returns the recipe's advice, or None; ``warn``: issue it as a
    :class:`~mergecomp.compressors.recipes.RecipeWarning` too."""
    check_dtypes(compressor, sorted(set(dtypes), key=str))
    if optimizer is not None:
        for component in (compressor, memory):
            check = getattr(component, "check_optimizer", None)
            if callable(check):
                check(optimizer)
    message = recipes.advice(compressor, optimizer, memory)
    if message is not None and warn:
        recipes.warn(message)
    return message


# -- checkpoints -----------------------------------------------------------------------------
#: Keys of the envelope every entry point's checkpoint shares (the payload keys sit beside them).
ENVELOPE = ("format", "kind", "rank", "world_size", "config", "lifecycle")


def seal_state(kind: str, format: int, backend: Backend, config: str, lifecycle: Mapping[str, Any],
               payload: Mapping[str, Any]) -> Dict[str, Any]:
    """The checkpoint envelope around ``payload`` (an entry point's own keys), sealed with
    its checksum: what :func:`check_envelope` reads back."""
    clash = sorted(set(payload) & set(ENVELOPE + (checkpoint.CHECKSUM, checkpoint.SOURCE)))
    if clash:
        raise ValueError(f"a {kind} checkpoint's payload uses the envelope's keys {clash}")
    return checkpoint.seal({"format": format, "kind": kind, "rank": backend.rank, "world_size": backend.size,
                            "config": config, "lifecycle": dict(lifecycle), **payload})


def check_envelope(state: Mapping[str, Any], kind: str, format: int, backend: Backend, config: str,
                   advice: str, described: str = "") -> None:
    """Refuse, before anything is loaded, a state another entry point, rank, run size or
    configuration wrote, or a newer mergecomp: a
    :class:`~mergecomp.checkpoint.CheckpointError` saying what differs, then ``advice``
    (what the entry point lets the user do instead).  ``described``: the configuration in
    words, for the message.  A state without ``kind`` (an older one) is taken to be this
    entry point's; without ``rank`` or ``world_size``, to be this rank's."""
    where = checkpoint.describe_source(state.get(checkpoint.SOURCE))
    problems = []
    saved_format = state.get("format", 1)
    if not isinstance(saved_format, int) or saved_format > format:
        problems.append(f"it has state format {saved_format!r}, newer than this mergecomp reads "
                        f"({format}): upgrade mergecomp")
    if state.get("kind", kind) != kind:
        problems.append(f"it is a {state.get('kind')!r} checkpoint, and a {kind!r} one is being loaded: "
                        "load each entry point's own state")
    rank, size = backend.rank, backend.size
    if state.get("world_size", size) != size:
        problems.append(f"it was saved by a run of {state['world_size']} ranks, this run has {size}: "
                        "error-feedback state is per rank and cannot be split or merged")
    elif state.get("rank", rank) != rank:
        problems.append(f"it was saved by rank {state['rank']}, and rank {rank} is loading it: every "
                        f"rank must load the file it saved (e.g. f'ckpt.rank{{rank}}.pt')")
    if not problems and state.get("config", config) != config:
        problems.append(f"it belongs to another configuration (digest {state['config']}, this run "
                        f"{config}{': ' + described if described else ''}): its compression state "
                        "would be misread; build the same configuration")
    if problems:
        raise checkpoint.CheckpointError(f"{where}: " + "; ".join(problems), advice)


def check_finite_state(state: Any, what: str, source: Optional[str]) -> None:
    """Refuse ``state`` (an optimizer's ``state_dict()``, say) if a tensor in it holds NaN or
    Inf, naming the tensor by its path: loaded, it would reach the parameters at the next
    step (AdamW's moments), and no finite run leaves one there."""
    for path, tensor in checkpoint.tensors_of(state):
        if (tensor.is_floating_point() or tensor.is_complex()) and not bool(torch.isfinite(tensor).all()):
            raise checkpoint.CheckpointError(
                f"{checkpoint.describe_source(source)}: {what} holds non-finite values in {path}: "
                f"{checkpoint.summarize(tensor)}; loaded, they would reach the parameters at the next step",
                "Nothing was loaded. Load an earlier checkpoint, or load only the model's weights and "
                "start the optimizer afresh (its moments or momentum restart from zero)")


def lifecycle_state(state: Mapping[str, Any]) -> Dict[str, Any]:
    """The step lifecycle's counters of a checkpoint (``steps``, ``skipped_steps``,
    ``epoch``), from its envelope or, in an older state, from the keys it kept them under."""
    kept = state.get("lifecycle")
    if isinstance(kept, Mapping):
        return dict(kept)
    older = state.get("backward", {}) if isinstance(state.get("backward"), Mapping) else {}
    return {"steps": state.get("steps", older.get("steps", 0)),
            "skipped_steps": state.get("skipped_steps", older.get("skipped_steps", 0)),
            "epoch": state.get("epoch")}


__all__ = ["trainable_parameters", "named_in_optimizer", "check_same_parameters", "check_ranks_agree",
           "config_digest", "start_from_rank0", "broadcast_tensors", "vet_optimizer", "seal_state",
           "check_envelope", "check_finite_state", "check_registered", "lifecycle_state", "registration_marker", "ENVELOPE"]
