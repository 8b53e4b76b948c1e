"""Checkpoints of compression state: sealed when saved, checked before they are used.

Error-feedback residuals, DGC velocities and PowerSGD's matrices are added to the next
step's gradient, so one wrong number in a checkpoint goes straight into the parameters: a
flipped exponent bit turns a small residual into a huge one, which the next step applies;
a NaN makes every later step non-finite (each is dropped, forever).  Nothing legitimate saves such state (a non-finite
step is rolled back before it reaches the state), so the loaders refuse it, before any of
it reaches a component:

1. *checksum*: ``state_dict()`` records a digest of the state (its tensors' bytes, shapes
   and dtypes, and its plain data: steps, plan, configuration) with a CRC per tensor;
   ``load_state_dict()`` recomputes it, and names each tensor whose bytes changed since;
2. *finite values*: every floating tensor must be finite;
3. *the configuration's shapes*: each component checks its tensors against the groups the
   run will exchange (:meth:`Memory.check_state`, :meth:`Compressor.check_state`).

A state saved without a checksum (by an older mergecomp) is accepted with a warning after
checks 2 and 3.  :func:`save` is ``torch.save`` written atomically (a crash while saving
leaves the previous file whole); :func:`load` is ``torch.load(weights_only=True)`` that
notes the path in the states it finds, so that these errors name the file.
"""
from __future__ import annotations

import hashlib
import os
import warnings
import zlib
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from .compressors.base import GroupLayout

#: The keys a sealed state adds to itself: the record, and the file it was read from.
CHECKSUM, SOURCE = "checksum", "source"


class CheckpointError(ValueError):
    """A checkpoint's compression state was refused: corrupted, non-finite, or not of the
    shapes this run's configuration exchanges.  Nothing was loaded.

    ``reason`` says what is wrong; ``advice`` what to do, in the words of the entry point
    that loads (:data:`ADVICE` for the wrapper and the DDP hook); the message is both.
    """

    def __init__(self, reason: str, advice: Optional[str] = None):
        self.reason = reason
        self.advice = ADVICE if advice is None else advice
        super().__init__(f"{reason}. {self.advice}" if self.advice else reason)

    def advise(self, advice: str) -> "CheckpointError":
        """The same refusal with another entry point's advice."""
        return CheckpointError(self.reason, advice)


@dataclass(frozen=True)
class GroupSpec:
    """What a group of this run exchanges: its flat size, its gradients' dtype (None when
    unknown) and its per-parameter views (to name the parameter an element belongs to)."""

    numel: int
    dtype: Optional[torch.dtype]
    layout: Optional[GroupLayout]

    def locate(self, element: int) -> str:
        """'parameter NAME element I' for a flat element of the group, or ''."""
        for view in self.layout or ():
            if view.offset <= element < view.offset + view.numel:
                return f"parameter {view.name!r} element {element - view.offset}"
        return ""


def describe_source(source: Optional[str]) -> str:
    """How errors name the checkpoint."""
    return f"checkpoint {source}" if source else "the checkpoint passed to load_state_dict"


# -- sealing ---------------------------------------------------------------------------------
def tensor_record(tensor: torch.Tensor) -> str:
    """``dtype[shape]:crc32`` of a tensor's bytes."""
    flat = tensor.detach().reshape(-1).contiguous().cpu()
    crc = zlib.crc32(flat.view(torch.uint8).numpy()) if flat.numel() else 0
    return f"{str(flat.dtype).replace('torch.', '')}{list(tensor.shape)}:{crc:08x}"


def _fingerprint(state: Dict[str, Any]) -> Tuple[str, Dict[str, str]]:
    """The digest of ``state`` (less its own checksum and source) and each tensor's record."""
    digest = hashlib.sha256()
    tensors: Dict[str, str] = {}

    def feed(value, path):
        if isinstance(value, torch.Tensor):
            tensors[path] = record = tensor_record(value)
            digest.update(f"T{record};".encode())
        elif isinstance(value, dict):
            digest.update(b"{")
            for key in sorted(value, key=repr):
                if path == "" and key in (CHECKSUM, SOURCE):
                    continue
                digest.update(f"{key!r}:".encode())
                feed(value[key], f"{path}.{key}" if path else str(key))
            digest.update(b"}")
        elif isinstance(value, (list, tuple)):
            digest.update(b"(" if isinstance(value, tuple) else b"[")
            for i, item in enumerate(value):
                feed(item, f"{path}.{i}")
            digest.update(b"]")
        else:
            digest.update(f"{value!r};".encode())

    feed(state, "")
    return digest.hexdigest(), tensors


def seal(state: Dict[str, Any]) -> Dict[str, Any]:
    """Record ``state``'s checksum in it (under ``"checksum"``) and return it."""
    digest, tensors = _fingerprint(state)
    state[CHECKSUM] = {"sha256": digest, "tensors": tensors}
    return state


def verify(state: Dict[str, Any], what: str, source: Optional[str],
           groups: Optional[Dict[str, GroupSpec]] = None, where: Optional[str] = None) -> bool:
    """Raise :class:`CheckpointError` if ``state`` changed since it was sealed, naming each
    tensor that did (and, given this run's ``groups``, the parameter of its largest or first
    non-finite value); return False (after a warning) when it was never sealed."""
    recorded = state.get(CHECKSUM)
    where = where or describe_source(source)
    if recorded is None:
        warnings.warn(f"mergecomp: {where} holds {what} saved without a checksum (by an older "
                      "mergecomp): it is checked for non-finite values and shapes only; save it "
                      "again to protect it", RuntimeWarning, stacklevel=3)
        return False
    if not (isinstance(recorded, dict) and isinstance(recorded.get("sha256"), str)
            and isinstance(recorded.get("tensors"), dict)):
        raise CheckpointError(f"{where}: the checksum of its {what} is not one mergecomp writes "
                              f"({recorded!r:.80}); the file is damaged")
    digest, tensors = _fingerprint(state)
    if digest == recorded["sha256"]:
        return True
    problems = []
    values = dict(_tensors(state))
    for path, saved in recorded["tensors"].items():
        if path not in tensors:
            problems.append(f"{path} is missing (saved as {saved})")
        elif tensors[path] != saved:
            problems.append(f"{path} changed: saved as {saved}, now {tensors[path]}; "
                            f"{summarize(values[path], group_of(path, groups or {}))}")
    problems += [f"{path} ({tensors[path]}) was not in the saved state"
                 for path in tensors if path not in recorded["tensors"]]
    if not problems:
        problems.append("its plain data (steps, epoch, plan, configuration or layouts) changed")
    raise CheckpointError(f"{where}: its {what} does not match the checksum recorded when it was "
                          f"saved, so the file was changed or damaged since: " + "; ".join(problems[:5])
                          + (f"; and {len(problems) - 5} more" if len(problems) > 5 else ""))


#: What the wrapper's and the DDP hook's refusals tell the user to do.
ADVICE = ("Nothing was loaded. Load an earlier checkpoint, or resume without the compression "
           "state: load_state_dict(state, restore_compression=False) restores the rest, and error "
           "feedback restarts from zero")


# -- values --------------------------------------------------------------------------------
def _tensors(value, path: str = "") -> Iterator[Tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            if path == "" and key in (CHECKSUM, SOURCE):
                continue
            yield from _tensors(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{path}.{i}")


def tensors_of(value: Any) -> Iterator[Tuple[str, torch.Tensor]]:
    """(path, tensor) of every tensor in a nested state (dicts, lists, tuples)."""
    return _tensors(value)


def summarize(tensor: torch.Tensor, spec: Optional[GroupSpec] = None) -> str:
    """Its first non-finite value, or its largest magnitude, with where it is."""
    flat = tensor.detach().reshape(-1)
    if not (flat.is_floating_point() or flat.is_complex()) or flat.numel() == 0:
        return f"{flat.numel()} elements"
    bad = (~torch.isfinite(flat)).nonzero()
    if bad.numel():
        index = int(bad[0])
        place = spec.locate(index) if spec is not None else ""
        return (f"{bad.numel()} of {flat.numel()} values are not finite, the first "
                f"{flat[index].item()} at element {index}" + (f" ({place})" if place else ""))
    index = int(flat.abs().argmax())
    place = spec.locate(index) if spec is not None else ""
    return f"largest |value| {abs(flat[index].item()):.3g} at element {index}" + (f" ({place})" if place else "")


def group_of(path: str, groups: Dict[str, GroupSpec]) -> Optional[GroupSpec]:
    """The group a state path names (``memory.residuals.group0`` → group0), if any."""
    for part in path.split("."):
        if part in groups:
            return groups[part]
    return None


def check_finite(state: Dict[str, Any], what: str, source: Optional[str],
                 groups: Dict[str, GroupSpec], prefix: str = "", where: Optional[str] = None) -> None:
    """Raise :class:`CheckpointError` naming the first tensor of ``state`` with a NaN or Inf
    (by its path in the checkpoint: ``prefix`` and its keys)."""
    for path, tensor in _tensors(state, prefix):
        if (tensor.is_floating_point() or tensor.is_complex()) and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(
                f"{where or describe_source(source)}: {what} {path} holds non-finite values: "
                f"{summarize(tensor, group_of(path, groups))}. No finished step leaves NaN or Inf in "
                f"compression state (such a step is rolled back), so the file is damaged")


def check_shapes(component, state: Dict[str, Any], groups: Dict[str, GroupSpec], what: str,
                 source: Optional[str]) -> None:
    """The component's own check of its state against ``groups`` (``check_state``), as a
    :class:`CheckpointError` naming the checkpoint."""
    check = getattr(component, "check_state", None)
    if check is None:
        return
    try:
        check(state, groups)
    except (ValueError, TypeError, KeyError) as error:
        raise CheckpointError(f"{describe_source(source)}: {what} does not fit this run: {error}") from None


def check_group_tensors(kind: str, tensors: Any, groups: Dict[str, GroupSpec]) -> None:
    """``tensors`` must map group names of ``groups`` to flat tensors of the group's size and
    dtype (the residual-like state of the built-in memories); ValueError otherwise."""
    if not isinstance(tensors, dict):
        raise ValueError(f"{kind} must be a dict of tensors per group, got {type(tensors).__name__}")
    for name, tensor in tensors.items():
        if name not in groups:
            raise ValueError(f"{kind} has a group {name!r}, but this run exchanges "
                             f"{_names(groups)}: it was saved with another plan or other buckets")
        spec = groups[name]
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{kind} of group {name!r} is a {type(tensor).__name__}, not a tensor")
        if tensor.numel() != spec.numel or tensor.dim() != 1:
            raise ValueError(f"{kind} of group {name!r} has shape {tuple(tensor.shape)}, but the group "
                             f"holds {spec.numel} elements{f' ({_members(spec)})' if spec.layout else ''}: "
                             f"expected ({spec.numel},)")
        if spec.dtype is not None and tensor.dtype != spec.dtype:
            raise ValueError(f"{kind} of group {name!r} is {str(tensor.dtype).replace('torch.', '')}, but "
                             f"the group's gradients are {str(spec.dtype).replace('torch.', '')}")


def _names(groups: Dict[str, GroupSpec]) -> str:
    names = sorted(groups, key=lambda n: (len(n), n))
    return f"{len(names)} groups ({', '.join(names[:6])}{', ...' if len(names) > 6 else ''})" if names else "no groups yet"


def _members(spec: GroupSpec) -> str:
    names = [v.name for v in spec.layout or ()]
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def check_state(communicator, state: Dict[str, Any], groups: Dict[str, GroupSpec],
                source: Optional[str]) -> None:
    """Every check of a communicator's saved state (``{"compressor", "memory", ...}``)
    against this run, before anything is loaded: finite values, then each component's
    shapes."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{describe_source(source)}: its communicator state is a "
                              f"{type(state).__name__}, not a dict")
    check_finite(state, "compression state", source, groups, "communicator")
    check_shapes(communicator.memory, state.get("memory", {}), groups, f"the {communicator.memory!r} state", source)
    check_shapes(communicator.compressor, state.get("compressor", {}), groups,
                 f"the {communicator.compressor!r} state", source)


# -- files -----------------------------------------------------------------------------------
def save(obj: Any, path) -> None:
    """``torch.save(obj, path)``, atomically: written to a temporary file beside ``path`` and
    renamed over it, so an interrupted save leaves the previous file as it was."""
    path = os.fspath(path)
    temporary = f"{path}.partial"
    torch.save(obj, temporary)
    os.replace(temporary, path)


def load(path, map_location=None) -> Any:
    """``torch.load(path, weights_only=True)``, with the file's name noted in each mergecomp
    state inside (an optimizer's or a hook's), so that ``load_state_dict`` errors name it."""
    path = os.fspath(path)
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as error:  # torch says only what its reader met
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else ''}): it is truncated or "
                              "not a file torch.save wrote. Load an earlier checkpoint.") from error
    for state in _mergecomp_states(obj):
        state[SOURCE] = path
    return obj


def _mergecomp_states(value, depth: int = 0) -> Iterator[Dict[str, Any]]:
    """The dicts in ``value`` that are mergecomp states (a wrapper's ``"mergecomp"`` part, a
    hook state), found by their keys."""
    if depth > 4:
        return
    if isinstance(value, dict):
        if CHECKSUM in value or ("communicator" in value and "config" in value):
            yield value
            return
        for item in value.values():
            yield from _mergecomp_states(item, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _mergecomp_states(item, depth + 1)


__all__ = ["CheckpointError", "GroupSpec", "seal", "verify", "check_state", "save", "load"]
