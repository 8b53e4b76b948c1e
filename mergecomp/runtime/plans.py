"""The wrapper's plan: made from the first backward's order, installed, switched with its state.

A mixin of :class:`~mergecomp.runtime.reducer.Reducer` (which holds the parameters, the
groups, the backend, the scheduler and the lifecycle): what runs when the plan is made or
changes, never inside a steady step.  Rank 0 plans from the order it recorded and every
rank installs what it broadcast; ``set_plan`` moves every group's error-feedback state into
the new groups by parameter (:mod:`mergecomp.runtime.regroup`); parameters that join later
(a layer unfrozen, a param group added) get groups of their own after the planned ones.
"""
from __future__ import annotations

import collections
from typing import Any, Dict, List, Sequence, Tuple

import torch

from .. import communicators
from ..distributed.backends.serialize import header_error
from ..plan import COMPRESS_VIA, Group, Plan
from ..planning.costmodel import priced_collectives
from .regroup import Layout, group_sizes, regroup_state


class PlanHolder:
    """Making, installing and switching the plan of a :class:`~mergecomp.runtime.reducer.Reducer`."""

    def add_params(self, named_params: Sequence[Tuple[str, torch.nn.Parameter]]) -> None:
        """Exchange these parameters too, from the next backward on (between steps only).

        For a layer unfrozen during training or a param group added to the optimizer: left
        out, each rank would apply its own gradient to them.  Once a plan exists, the new
        parameters get groups of their own after the planned ones (one per dtype and
        device), so the planned groups and their error-feedback state stay as they are;
        the next step's preflight checks that every rank took in the same parameters.
        """
        if self.in_iteration():
            raise RuntimeError("parameters can be added between steps only, not during backward")
        named = [(n, p) for n, p in named_params if n not in self.position]
        if not named:
            return
        for name, p in named:
            self.position[name] = len(self.params)
            self.params.append((name, p))
            self.numels[name] = p.numel()
            self._passes[name] = 0
            self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(name)))
        self.added = self.added + [n for n, _ in named]
        if self.plan is not None:
            kinds: Dict[Tuple[str, str], List[str]] = collections.OrderedDict()
            for name, p in reversed(named):  # backward usually reaches later layers first
                kinds.setdefault((str(p.dtype), str(p.device)), []).append(name)
            self.install_plan(Plan(list(self.plan.groups) + [Group(tuple(names)) for names in kinds.values()]))

    # ------------------------------------------------------------------------ planning --
    def _make_plan(self) -> Plan:
        """Rank 0 plans from its recorded backward order; every rank receives that plan."""
        plan = None
        if self.backend.rank == 0:
            seen = set(self._ready_order)
            # Parameters that got no gradient here go last, in reverse definition order
            # (the order backward usually produces).
            order = self._ready_order + [n for n, _ in reversed(self.params) if n not in seen]
            plan = self.scheduler.plan(self.param_infos(order))
        sent = self.backend.broadcast_object(plan.to_dict() if plan is not None else None, src=0)
        try:
            return Plan.from_dict(sent)
        except ValueError as error:  # every rank reads the same bytes: every rank raises alike
            raise header_error(0, f"the plan it broadcast does not read ({error})") from None

    def layout(self, plan: Plan) -> Layout:
        return {f"group{i}": pieces for i, pieces in enumerate(plan.pieces(self.numels))}

    def carriers(self) -> List[str]:
        """Registered communicators other than the job's that a ``"compress:<name>"`` send
        mode can use here (they carry the compressor and memory) and that have a cost
        formula; building one has no effect on training (it holds no state until used)."""
        found = []
        for name in communicators.available():
            if type(self.communicator) is communicators.get(name) or not priced_collectives(name):
                continue
            try:
                self.lifecycle.communicator_for(COMPRESS_VIA + name)
            except ValueError:
                continue
            found.append(name)
        return found

    def compression_state(self) -> Dict[str, Any]:
        """The compressed groups' state (the configured communicator's, with what other
        compressed send modes hold folded into its memory: see
        :meth:`StepLifecycle.compression_state`)."""
        if self.plan is None:
            return self.communicator.state_dict()
        sizes = group_sizes(self.layout(self.plan))
        return self.lifecycle.compression_state(sizes)

    def load_compression_state(self, state: Dict[str, Any]) -> None:
        """Load what :meth:`compression_state` returned; the other send modes' own state
        is in it already."""
        self.communicator.load_state_dict(state)
        self.lifecycle.forget_owner_state()

    def set_plan(self, plan: Plan) -> None:
        """Switch to ``plan`` between steps; call it on every rank with the same plan (the
        next step's preflight checks that they did).

        Per-group error-feedback state follows its parameters into the new groups (see
        :mod:`mergecomp.runtime.regroup`), so the switch is exact; the hierarchical exchange's
        per-shard state is folded into whole groups first and cut into shards again after
        (:mod:`mergecomp.communicators.shard_state`: a collective inside each node).  Raises
        :class:`~mergecomp.runtime.regroup.CannotRegroup`, changing nothing, when some state cannot
        move (PowerSGD's matrices, PS shard residuals): keep the current plan then.
        """
        if self.in_iteration():
            raise RuntimeError("set_plan() must be called between steps (after backward has "
                               "finished and before the next one), not in the middle of an iteration")
        plan.validate((n for n, _ in self.params), self.numels)
        if self.plan is None:
            self.install_plan(plan)
            return
        old, new = self.layout(self.plan), self.layout(plan)
        # Raw groups share this memory and their casts are stateless; other compressed send
        # modes' own state is folded into it: this is all the state.
        folded = self.lifecycle.fold_shard_state(self.compression_state(), group_sizes(old))
        moved = regroup_state(folded, old, new)  # raises, changing nothing
        self.install_plan(plan)
        self.load_compression_state(moved)
        self.lifecycle.spread_shard_state([(group.name, group.send, group.numel) for group in self.groups])

