"""The compressor, memory and communicator an entry point is given, as the user may name them.

Both entry points (the optimizer wrapper and the DDP hook state) accept a registered name or
an instance for each, and ``"auto"`` (or None) for the memory and the communicator: the
compressor's own recommendation (``recommended_memory``, ``recommended_communicator``).
A compressor's arguments travel in the instance: ``compressors.create("topk",
compress_ratio=0.01)`` (or the class itself) is accepted wherever ``"topk"`` is.

Everything is checked here, once, so the wrapper, the DDP hook and the benchmark CLI refuse
the same things with the same words: a value of the wrong type (TypeError naming the
argument, the value and what it accepts), and a memory the compressor cannot be paired with
(ValueError saying why and what to pass instead).
"""
from __future__ import annotations

from typing import Tuple, Union


from . import compressors, memories
from .communicators.base import Communicator
from .compressors.base import Compressor
from .memories.base import Memory
from .memories.none import NoneMemory
from .plan import Plan
from .schedulers.base import Scheduler

AUTO = (None, "auto")


def resolve(compressor: Union[str, Compressor], memory: Union[None, str, Memory],
            communicator: Union[None, str, Communicator]) -> Tuple[Compressor, Memory, Union[str, Communicator]]:
    """(compressor instance, memory instance, communicator name or instance), with "auto"
    resolved from the compressor's recommendations and the pairing checked
    (:func:`check_pairing`)."""
    compressor = _compressor(compressor)
    memory = memories.recommended(compressor) if memory in AUTO else _memory(memory)
    check_pairing(compressor, memory)
    if communicator in AUTO:
        communicator = compressor.recommended_communicator
    elif not isinstance(communicator, (str, Communicator)):
        raise TypeError(_wrong("communicator", communicator,
                               "a registered name (allreduce, allgather, ps, or a plugin's), a "
                               "mergecomp.communicators.Communicator instance, or 'auto' (the "
                               "compressor's recommendation)"))
    return compressor, memory, communicator


def check_pairing(compressor: Compressor, memory: Memory) -> None:
    """Refuse (ValueError) a memory that would do nothing, or harm, around ``compressor``.

    A memory works through :meth:`Memory.update`, which sees one-shot payloads only: a
    multi-round compressor (PowerSGD) exchanges in ``rounds()``, which no memory sees, so a
    memory there would silently do nothing (or, the ``dgc`` memory, accumulate without ever
    being emptied).  A compressor that keeps its own error feedback (its
    ``error_feedback`` flag) would, besides, feed every error back twice.
    """
    if isinstance(memory, NoneMemory):
        return
    if getattr(compressor, "error_feedback", False):
        raise ValueError(
            f"{compressor!r} keeps its own error feedback, so the {_name(memory)} memory would feed each "
            f"error back a second time: pass memory='none' or 'auto' (its recommendation, "
            f"{compressor.recommended_memory!r}); to use a memory's error feedback instead, turn "
            f"the compressor's own off where it has that option (use_error_feedback=False)")
    if getattr(compressor, "multi_round", False):
        raise ValueError(
            f"{compressor!r} exchanges in several rounds, which a memory never sees, so "
            f"the {_name(memory)} memory would silently do nothing: pass memory='none' or 'auto'"
            + (" (PowerSGD's own error feedback is use_error_feedback=True)"
               if hasattr(compressor, "use_error_feedback") else ""))


def check_schedule(schedule, accepted: str, plan: bool = True) -> None:
    """TypeError naming the value unless ``schedule`` is an int (not a bool), a str, a
    Scheduler or (when ``plan``) a Plan; ``accepted`` says so in the caller's words."""
    kinds = (int, str, Scheduler) + ((Plan,) if plan else ())
    if isinstance(schedule, bool) or not isinstance(schedule, kinds):
        raise TypeError(_wrong("schedule", schedule, accepted))


def _compressor(value) -> Compressor:
    return _instance("compressor", value, compressors, Compressor, "(...), with its arguments",
                     "a registered name (e.g. 'topk'; mergecomp.compressors.available() lists them) or a "
                     "mergecomp.compressors.Compressor instance, e.g. "
                     "mergecomp.compressors.create('topk', compress_ratio=0.01)")


def _memory(value) -> Memory:
    return _instance("memory", value, memories, Memory, "(...)",
                     "'auto' (the compressor's recommendation), a registered name (none, residual, dgc, "
                     "or a plugin's) or a mergecomp.memories.Memory instance, e.g. "
                     "mergecomp.memories.create('residual', beta=0.9)")


def _instance(argument: str, value, registry, base: type, call: str, accepted: str):
    """``value`` as an instance of ``base``: created from ``registry`` when it is a name; a
    TypeError naming ``argument`` when it is a class (not an instance) or anything else."""
    if isinstance(value, str):
        return registry.create(value)
    if isinstance(value, base):
        return value
    if isinstance(value, type) and issubclass(value, base):
        raise TypeError(f"{argument}={value.__name__} is a class: pass an instance "
                        f"({value.__name__}{call}) or a registered name")
    raise TypeError(_wrong(argument, value, accepted))


def _name(memory: Memory) -> str:
    return repr(getattr(type(memory), "name", None) or type(memory).__name__)


def _wrong(argument: str, value, accepted: str) -> str:
    return f"{argument} must be {accepted}; got {value!r} ({type(value).__name__})"
