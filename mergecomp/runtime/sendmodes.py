"""The state of a job's send modes, as one: what a plan switch and a checkpoint move.

A plan sends each group one way (:mod:`mergecomp.plan`): the configured compressor, a raw
width sharing the compressed groups' memory, or the configured compressor and memory
through another communicator (``"compress:<name>"``).  Those communicators are built around
the same compressor and memory instances, whose state is keyed by group, so a group that
changes communicator keeps its residual.  What some of them hold on their own (the sparse
allreduce's owner residuals, the hierarchical exchange's per-shard state) is folded into
the shared memory when the state must move, and spread again after.
:class:`SendModeState` is that part of :class:`~mergecomp.runtime.step.StepLifecycle`.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from .. import communicators
from ..communicators.base import Communicator
from ..plan import check_send, is_compressed

#: What a communicator's ``state_dict`` holds that the configured compressor and memory
#: (shared by every compressed send mode) already hold.
SHARED_STATE = ("compressor", "memory")


def check_communicator_options(options: Optional[Mapping[str, Mapping[str, Any]]]) -> Dict[str, Dict[str, Any]]:
    """``{communicator name: keyword arguments}`` for the communicators of
    ``"compress:<name>"`` send modes, checked: registered names, mappings of keywords."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"communicator_options must map communicator names to keyword arguments, e.g. "
                        f"{{'sparse_allreduce': {{'keep': None}}}}, got {options!r}")
    known = communicators.available()
    checked = {}
    for name, kwargs in options.items():
        if name not in known:
            raise ValueError(f"communicator_options names {name!r}, which is not a registered "
                             f"communicator; registered: {', '.join(known)}")
        if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
            raise TypeError(f"communicator_options[{name!r}] must map keyword names to values, got {kwargs!r}")
        communicators.registry.check_options(name, kwargs, supplied=("compressor", "memory", "backend"))
        checked[name] = dict(kwargs)
    return checked


class SendModeState:
    """Building the communicators of ``"compress:<name>"`` send modes, and moving the state
    of every compressed send mode as one (a mixin of the step lifecycle, which holds
    ``communicator``, ``backend``, ``communicator_options`` and ``communicator_for``)."""

    def _compressing_via(self, name: str, send: str) -> Communicator:
        """Communicator ``name`` around the configured compressor and memory (see
        :meth:`communicator_for`); a clear error for one that cannot carry them or that
        would hold state no plan switch or checkpoint could keep."""
        check_send(send, "send mode")
        main = self.communicator
        options = dict(self.communicator_options.get(name, {}))
        if type(main) is communicators.get(name) and not options:
            return main
        try:
            built = communicators.create(name, compressor=main.compressor, memory=main.memory,
                                         backend=self.backend, **options)
        except (TypeError, ValueError) as error:
            raise ValueError(f"send mode {send!r}: {error}") from None
        if callable(getattr(built, "check_foldable", None)):
            built.check_foldable()
        own = sorted(set(built.state_dict()) - set(SHARED_STATE))
        if own and not callable(getattr(built, "fold_owner_residuals", None)):
            raise ValueError(
                f"send mode {send!r}: the {name} communicator keeps state of its own ({own}) that "
                "cannot follow a group into another plan or a checkpoint while another communicator "
                f"is the job's; make {name!r} the job's communicator instead")
        return built

    # -- state of the compressed send modes ------------------------------------------------------
    def compression_state(self, sizes: Mapping[str, int]) -> Dict[str, Any]:
        """The configured communicator's state, with what the other compressed send modes'
        communicators hold on their own (the sparse allreduce's owner residuals) folded into
        its memory's per-group residuals (``sizes``: elements per group name): the sum of
        everything held back is unchanged, and a plan switch or a checkpoint can move it."""
        state = self.communicator.state_dict()
        for communicator in self.communicators():
            fold = getattr(communicator, "fold_owner_residuals", None)
            if communicator is not self.communicator and fold is not None:
                state = dict(state, memory=fold(state.get("memory", {}), sizes))
        return state

    def fold_shard_state(self, state: Dict[str, Any], sizes: Mapping[str, int]) -> Dict[str, Any]:
        """``state`` (from :meth:`compression_state`) with the per-shard state of every
        communicator that keeps it (the hierarchical exchange's) folded into per-rank state of
        whole groups, which a plan switch can regroup; no communication.  Pair it with
        :meth:`spread_shard_state` once the new plan is installed."""
        for communicator in self.communicators():
            fold = getattr(communicator, "fold_shard_state", None)
            if callable(fold):
                state = fold(state, dict(sizes))
        return state

    def spread_shard_state(self, groups: Sequence[Tuple[str, str, int]]) -> None:
        """Give each communicator that keeps per-shard state the groups it sends from now on
        (``groups``: ``(name, send mode, numel)`` in plan order), so that it cuts their
        per-rank state into shards.  A collective inside each node where such a communicator
        is in use: call it on every rank with the same plan."""
        done = set()
        for _, send, _ in groups:
            communicator = self.communicator_for(send)
            spread = getattr(communicator, "spread_shard_state", None)
            if not is_compressed(send) or id(communicator) in done or not callable(spread):
                continue
            done.add(id(communicator))
            spread([(name, numel) for name, other, numel in groups
                    if is_compressed(other) and self.communicator_for(other) is communicator])

    def forget_owner_state(self) -> None:
        """Drop what :meth:`compression_state` folded into the memory (once that state is
        loaded), so that it is not counted twice."""
        for communicator in self.communicators():
            if communicator is not self.communicator and callable(getattr(communicator, "drop_owner_residuals", None)):
                communicator.drop_owner_residuals()

