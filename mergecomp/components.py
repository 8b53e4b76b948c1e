"""The compressor, memory and communicator an entry point is given, as the user may name them.

Both entry points (the optimizer wrapper and the DDP hook state) accept a registered name or
an instance for each, and ``"auto"`` (or None) for the memory and the communicator: the
compressor's own recommendation (``recommended_memory``, ``recommended_communicator``).
"""
from __future__ import annotations

from typing import Tuple, Union

import torch

from . import compressors, memories
from .communicators.base import Communicator
from .compressors.base import Compressor
from .memories.base import Memory


def resolve(compressor: Union[str, Compressor], memory: Union[None, str, Memory],
            communicator: Union[None, str, Communicator]) -> Tuple[Compressor, Memory, Union[str, Communicator]]:
    """(compressor instance, memory instance, communicator name or instance), with "auto"
    resolved from the compressor's recommendations."""
    compressor = compressors.create(compressor) if isinstance(compressor, str) else compressor
    if memory is None or memory == "auto":
        memory = compressor.recommended_memory
    memory = memories.create(memory) if isinstance(memory, str) else memory
    if communicator is None or communicator == "auto":
        communicator = compressor.recommended_communicator
    return compressor, memory, communicator


def vet_optimizer(optimizer: torch.optim.Optimizer, compressor: Compressor, memory: Memory) -> None:
    """Let the components that own part of the update (the ``dgc`` memory's or SIGNUM's
    momentum) refuse an optimizer that would apply it again (their ``check_optimizer``)."""
    for component in (compressor, memory):
        check = getattr(component, "check_optimizer", None)
        if callable(check):
            check(optimizer)
