"""State that a step writes but only a committed step keeps.

A step whose gradient turns out non-finite on some rank (or a shadow step of
:meth:`~mergecomp.optimizer.DistributedOptimizer.join` that nobody applies) must leave
compressors, memories and servers exactly as they were before it.  The step's collectives
are already in flight when that is known, so components do not write their state in
place: they stage it, and the reducer calls ``commit()`` (every rank agreed the step is
good) or ``rollback()`` (it is dropped) once per step, on every rank alike.

:class:`StagedDict` is the one mechanism the built-in components use.  Reads see the
step's own writes first, then the committed values; a committed tensor is never changed
in place (a component that updates a tensor computes a new one and stores that), so a
rollback costs nothing but forgetting the pending entries.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, MutableMapping


class StagedDict(MutableMapping):
    """A dict whose writes become visible to ``committed()`` readers only at :meth:`commit`.

    ``d[k]`` reads the pending value if this step wrote one, else the committed one;
    ``d[k] = v`` and ``del d[k]`` are pending until :meth:`commit`; :meth:`rollback`
    forgets them.  ``state_dict``-style exports should read :meth:`committed`.
    """

    _DELETED = object()

    def __init__(self, initial: Dict[str, Any] = None):
        self._committed: Dict[str, Any] = dict(initial or {})
        self._pending: Dict[str, Any] = {}

    # -- mapping -------------------------------------------------------------------------
    def __getitem__(self, key):
        if key in self._pending:
            value = self._pending[key]
            if value is self._DELETED:
                raise KeyError(key)
            return value
        return self._committed[key]

    def __setitem__(self, key, value) -> None:
        self._pending[key] = value

    def __delitem__(self, key) -> None:
        if key not in self:
            raise KeyError(key)
        self._pending[key] = self._DELETED

    def __contains__(self, key) -> bool:
        if key in self._pending:
            return self._pending[key] is not self._DELETED
        return key in self._committed

    def __iter__(self) -> Iterator[str]:
        seen = set()
        for key, value in self._pending.items():
            seen.add(key)
            if value is not self._DELETED:
                yield key
        for key in self._committed:
            if key not in seen:
                yield key

    def __len__(self) -> int:
        return sum(1 for _ in self)

    # -- the step's outcome --------------------------------------------------------------
    def is_pending(self, key) -> bool:
        """True when this step wrote ``key`` (a value no committed state holds)."""
        value = self._pending.get(key, self._DELETED)
        return value is not self._DELETED

    def commit(self) -> None:
        for key, value in self._pending.items():
            if value is self._DELETED:
                self._committed.pop(key, None)
            else:
                self._committed[key] = value
        self._pending.clear()

    def rollback(self) -> None:
        self._pending.clear()

    def committed(self) -> Dict[str, Any]:
        """The committed entries (a shallow copy): what a checkpoint holds."""
        return dict(self._committed)

    def replace(self, values: Dict[str, Any]) -> None:
        """Set the committed entries to ``values`` and drop anything pending (loading state)."""
        self._committed = dict(values)
        self._pending.clear()

    def __repr__(self) -> str:
        return f"StagedDict(committed={sorted(self._committed)}, pending={sorted(self._pending)})"


class Spares:
    """Tensors a component made and no state holds any more, kept per name to be written
    again (``out=``) instead of allocating a new tensor of the group's size every step.

    On the CPU a fresh tensor of tens of megabytes costs page faults several times the
    arithmetic that fills it (the allocator hands large blocks back to the system when
    they are freed), so the memories recycle what a commit replaces and what a rollback
    drops.  Only tensors the component itself made go in: a compressor must not keep its
    input tensor past the call (the contract says so), which is what makes this safe.
    """

    def __init__(self):
        self._free: Dict[Any, Any] = {}

    def take(self, key, like):
        """A spare of ``like``'s shape, dtype and device for ``key`` (then no longer spare),
        or None."""
        spare = self._free.pop(key, None)
        if spare is not None and spare.shape == like.shape and spare.dtype == like.dtype \
                and spare.device == like.device:
            return spare
        return None

    def give(self, key, tensor) -> None:
        self._free[key] = tensor

    def clear(self) -> None:
        self._free.clear()

    def recycle_commit(self, store: "StagedDict", prefix: str = "") -> None:
        """Commit ``store``, keeping as spares the committed tensors it replaced."""
        before = store.committed()
        store.commit()
        after = store._committed
        for key, old in before.items():
            if after.get(key) is not old:
                self.give(prefix + key, old)

    def recycle_rollback(self, store: "StagedDict", prefix: str = "") -> None:
        """Roll ``store`` back, keeping as spares the tensors this step wrote."""
        for key, value in store._pending.items():
            if value is not StagedDict._DELETED and value is not store._committed.get(key):
                self.give(prefix + key, value)
        store.rollback()


def shares_memory(tensors, owned) -> bool:
    """Whether any tensor of ``tensors`` lives in the storage of one of ``owned``."""
    import torch
    pointers = {t.untyped_storage().data_ptr() for t in owned}
    return any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in pointers for t in tensors)
