"""The ``optimal`` scheduler: the exact best partition and send choice under the cost model.

Given a :class:`~mergecomp.planning.profile.Profile`, it chooses how to cut the backward-ordered
gradients into contiguous groups *and* how each group travels — compressed, or raw in
FP32 (FP16/BF16 with ``allow_half``) — so that :func:`mergecomp.planning.costmodel.predict` is
minimal.  This joins MergeComp's merging (Wang et al., 2021) with selective compression
as in HiPress's SeCoPa (Bai et al., SOSP 2021) and Espresso (Wang et al., EuroSys 2023):
small groups, whose compression overhead outweighs the bytes it saves, and groups whose
communication hides under the rest of backward stay uncompressed — and if nothing is
worth compressing, the plan compresses nothing.

**The dynamic program.**  Let prefix j be the first j tensors in backward order.  A plan
for the prefix is a sequence of groups; launching them leaves the state
``(A, F, Q, H)`` of :func:`mergecomp.planning.costmodel.advance` (backward delay or worker-free
time, channel-free time, finish-loop time, Σ finish).  The next group ``[j, k)`` with send
mode m maps the state through ``advance`` with costs that depend only on (j, k, m) and
with ``since`` = the ready time of tensor j − 1 (its previous launch), and the iteration
time is ``forward + max(backward end + H, Q) + optimizer step`` of the final state
(:func:`mergecomp.planning.costmodel.finish_time`; backward end = T_b + A + the interference
stretch of backward's tail on compute, T_b off compute).

*Why the DP is exact.*  ``advance`` is built from +, max, constants and the interference
stretch, in which A enters as ``A + min(c, (1 − 1/k)·(F − s − A))`` (slope 1 or 1/k), and
the collective slowdown, in which the collective's start s enters as
``s + min((c − 1)·d, (1 − 1/c)·max(T_b + A − s, 0))`` (slope 1 or 1/c in s, ≥ 0 in A), so
every component of the new state is non-decreasing in every component of the old state,
and so is the final objective.  (That is why the state carries H = Σ finish rather than
the time added after backward, A + H: with interference a larger A can shrink the stretch
of the tail, so the objective is monotone in (A, H) but not in (A, A + H).)  Hence if two plans for the same prefix reach states s ≤ s'
(componentwise), any continuation of the s' plan is matched or beaten by the same
continuation of the s plan: s' can be dropped.  Keeping, for every prefix, the set of
non-dominated states (a Pareto set) therefore keeps an optimal plan.  One scalar per
prefix is *not* enough: a plan that frees the channel earlier may have delayed backward
more with compression (larger A), which costs later — e.g. a cheap-to-send raw group vs. a
compressed one.  Two exact cuts keep the sets smaller: a state whose lower bound on
the final time (see ``_lower_bound``) cannot beat the best complete plan known is
dropped, and dominance compares ``max(Q, T_b + A + H)`` (off compute ``max(Q, T_b + H)``)
instead of Q.

*Cost.*  The sets can still grow to thousands of states on models with large, varied
tensors.  ``max_states`` (default 64) and :attr:`max_candidates` cap them, keeping the
states with the smallest lower bounds; ``Solution.exact`` says whether a cap was hit (the
plan is then the best found, not proven optimal).  On one CPU core, with the caps:
about 0.3 s for 59 tensors (resnet20), 2 s for 54 (vgg16), 10 to 15 s for 161 (resnet50);
with ``max_states=None`` instances of up to ~30 tensors stay exact in seconds.

Groups never mix dtypes or devices (they are cut at :func:`split_by_type` boundaries).

**Chunks.**  With ``chunk_mb``, every tensor larger than that is cut into near-equal
chunks (as many as it takes to stay under ``chunk_mb``) before the DP runs; the chunks
are ready when their tensor is, and the DP may cut between them like between any two
tensors.  A cut inside a tensor sends it in pieces (slices in the
:class:`~mergecomp.plan.Plan`): the first piece's collective runs while the next one is
compressed, and the first piece is decoded while the next is in flight — HiPress's and
Espresso's partitioning of large tensors.  Each piece pays its group's fixed costs (a
collective's latency, a launch), which is what the DP weighs against the overlap;
without a cut the chunks travel together, so the DP still can choose not to split.
More chunks mean a larger DP: ``chunk_mb`` should leave a model at most a few hundred
pieces.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ..schedulers import register
from ..schedulers.base import Scheduler, split_by_type
from .costmodel import _OFF_COMPUTE_INTERFERENCE, SendCost, START, advance, finish_time, group_cost, send_costs
from ..plan import COMPRESS_VIA, Group, ParamInfo, Plan, check_send, send_communicator
from .profile import Profile, TensorTiming
from .vectorized import advance_all, pareto, stretch_all


def checked_chunk_mb(value, who: str = "chunk_mb") -> Optional[float]:
    """``value`` as a float size in MB, or None (whole tensors); a clear error otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{who} must be a size in MB > 0 (e.g. 4), or None for whole tensors; got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Solution:
    """The optimal plan and its predicted iteration time (seconds)."""

    plan: Plan
    iteration_time: float
    #: True when no prefix had more than ``max_states`` non-dominated states, so the plan
    #: is proven optimal for the cost model; False when some sets were cut to their best.
    exact: bool = True


@register("optimal")
class OptimalScheduler(Scheduler):
    """Exact DP over contiguous groups and per-group send modes (see the module docstring).

    Args:
        profile: a :class:`Profile` or the path of a saved one.
        allow_half: also consider raw FP16 / BF16 sends (lossy casts; needs their codecs
            in the profile).
        allow_compress: consider the configured compressor (False: plan raw sends only).
        compression_on_compute: where encoding runs; see :mod:`mergecomp.planning.costmodel`.
        costs: send costs to use instead of :func:`~mergecomp.planning.costmodel.send_costs`
            of the profile (the simulator passes network-model costs here).
        sends: the send modes to choose from, overriding ``allow_half``/``allow_compress``
            (e.g. ``("fp16",)`` for the best all-FP16 plan, or ``("fp32", "compress",
            "compress:sparse_allreduce")``).
        communicators: also consider the configured compressor through each of these
            registered communicators, group by group (``"compress:<name>"`` send modes,
            priced by their ``send_cost``; the profile must have measured their
            collectives), beside the profile's own communicator.
        max_states: the most non-dominated states kept per prefix.  The DP is exact while
            no set exceeds it (``Solution.exact``); a larger set is cut to the states with
            the smallest lower bounds, which bounds planning time on models with hundreds
            of tensors.  None: never cut.
        chunk_mb: let the DP send tensors larger than this many MB (2**20 bytes) in
            pieces (see the module docstring); None (the default): whole tensors only.
    """

    #: The most pieces the chunked timeline may have (the DP grows with it).
    max_pieces = 512

    def __init__(self, profile: Union[Profile, str, None] = None, allow_half: bool = False,
                 allow_compress: bool = True, compression_on_compute: bool = True,
                 costs: Optional[Mapping[str, SendCost]] = None, max_states: Optional[int] = 64,
                 sends: Optional[Sequence[str]] = None, chunk_mb: Optional[float] = None,
                 communicators: Sequence[str] = ()):
        if profile is None:
            raise ValueError(
                "the 'optimal' scheduler plans from a measured cost profile, and none was given: "
                "pass schedulers.create('optimal', profile='profile.json') with a profile the 'auto' "
                "scheduler saved (schedulers.create('auto', profile_out='profile.json')), or use "
                "schedule='auto', which measures the profile in the run's first steps and plans from it")
        if isinstance(profile, str):
            profile = Profile.load(profile)
        if not isinstance(profile, Profile):
            raise TypeError(f"OptimalScheduler needs a Profile or a profile path, got {type(profile).__name__}")
        self.profile = profile
        if isinstance(communicators, str):
            communicators = (communicators,)
        wanted = ["fp32"] + (["compress"] if allow_compress else []) + \
                 (["fp16", "bf16"] if allow_half else []) + \
                 [COMPRESS_VIA + name for name in communicators if allow_compress]
        if sends is not None:
            wanted = list(dict.fromkeys(sends))
            if not wanted:
                raise ValueError(f"sends must be a non-empty list of send modes, got {sends!r}")
        for send in wanted:
            check_send(send, "each of sends")
        via = [send_communicator(s) for s in wanted if send_communicator(s) is not None]
        self.costs: Dict[str, SendCost] = dict(send_costs(profile, via) if costs is None else costs)
        self.compression_on_compute = bool(compression_on_compute)
        if not self.compression_on_compute and (profile.interference != 1.0
                                                or profile.collective_slowdown != 1.0):
            raise ValueError(_OFF_COMPUTE_INTERFERENCE.format(profile.interference,
                                                              profile.collective_slowdown))
        missing = [s for s in wanted if s not in self.costs]
        if missing:
            raise ValueError(f"the profile cannot price send modes {missing} (it prices "
                             f"{sorted(self.costs)}); measure the codec "
                             f"{profile.compressor!r} / fp16 / bf16 into the profile, or pass "
                             "allow_compress=False / allow_half=False")
        if max_states is not None and (isinstance(max_states, bool) or not isinstance(max_states, int)
                                       or max_states < 1):
            raise ValueError(f"max_states must be a positive integer or None, got {max_states!r}")
        self.max_states = max_states
        self.chunk_mb = checked_chunk_mb(chunk_mb)
        if self.chunk_mb is not None:
            pieces = len(self._chunked_timeline()[0])
            if pieces > self.max_pieces:
                raise ValueError(f"chunk_mb={chunk_mb!r} cuts this model's {len(profile.timeline)} tensors "
                                 f"into {pieces} pieces, more than the DP takes ({self.max_pieces}); "
                                 "raise chunk_mb")
        self.sends = tuple(wanted)
        self.allow_half, self.allow_compress = bool(allow_half), bool(allow_compress)

    # ---------------------------------------------------------------------------- API --
    def plan(self, params: Sequence[ParamInfo]) -> Plan:
        """The optimal plan; ``params`` must be the profiled tensors (any order)."""
        profiled = [t.name for t in self.profile.timeline]
        given = [p.name for p in params]
        if sorted(given) != sorted(profiled):
            extra = sorted(set(given) - set(profiled))[:5]
            absent = sorted(set(profiled) - set(given))[:5]
            raise ValueError(f"the model does not match the profile: parameters not profiled "
                             f"{extra}, profiled tensors not in the model {absent}; profile "
                             "this model (same parameter names) first")
        return self.solve().plan

    #: States per prefix kept by the preliminary beam pass.
    beam = 4
    #: Candidates per prefix beyond which only those with the smallest bounds are compared.
    max_candidates = 1024

    def solve(self) -> Solution:
        """Run the dynamic program over the profile's timeline.

        A narrow beam pass (at most :attr:`beam` states per prefix) first finds a good
        complete plan; the main pass then drops every state whose lower bound
        (:meth:`_lower_bound`) cannot beat it.  Both passes use the same transitions; the
        main pass alone decides optimality, the beam only makes it faster.
        With ``chunk_mb`` the DP runs over the chunked timeline and the plan names slices.
        """
        if self.chunk_mb is not None:
            return self._solve_chunked()
        timeline = self.profile.timeline
        n = len(timeline)
        run_start = []
        for run in split_by_type(self.profile.params()):
            first = len(run_start)
            run_start.extend([first] * len(run))
        numel_prefix, bytes_prefix = [0], [0]
        for t in timeline:
            numel_prefix.append(numel_prefix[-1] + t.numel)
            bytes_prefix.append(bytes_prefix[-1] + t.nbytes)

        def cost(i: int, j: int, send: str):
            return group_cost(self.costs[send], self.profile.copy,
                              numel_prefix[j] - numel_prefix[i], bytes_prefix[j] - bytes_prefix[i],
                              self.profile.memory)

        rest = self._rest_bounds(n, cost)
        incumbent = self._incumbent(n, run_start, cost)
        beamed, _ = self._search(run_start, cost, rest, incumbent, self.beam)
        (value, groups), exact = self._search(run_start, cost, rest, beamed, self.max_states)
        plan = Plan([Group(tuple(t.name for t in timeline[i:j]), send) for i, j, send in groups])
        return Solution(plan, self.profile.forward_time + value + self.profile.optimizer_step, exact)

    def _chunked_timeline(self) -> Tuple[List[TensorTiming], Dict[str, Tuple[str, int, int]]]:
        """The profile's timeline with every tensor over ``chunk_mb`` cut into near-equal
        chunks (named ``name[start:stop]``, ready with their tensor), and each chunk's
        (tensor, start, stop)."""
        limit = self.chunk_mb * 2 ** 20
        timeline, origin = [], {}
        for t in self.profile.timeline:
            count = min(t.numel, max(1, math.ceil(t.nbytes / limit)))
            start = 0
            for i in range(count):
                stop = start + t.numel // count + (1 if i < t.numel % count else 0)
                name = t.name if count == 1 else f"{t.name}[{start}:{stop}]"
                timeline.append(dataclasses.replace(t, name=name, numel=stop - start,
                                                    nbytes=(stop - start) * t.element_size))
                origin[name] = (t.name, start, stop)
                start = stop
        return timeline, origin

    def _solve_chunked(self) -> Solution:
        """The DP over the chunked timeline; chunks of one tensor in one group merge back
        into one slice (the whole tensor when all of them do)."""
        timeline, origin = self._chunked_timeline()
        inner = copy.copy(self)  # the same settings, planning whole pieces
        inner.profile = dataclasses.replace(self.profile, timeline=timeline)
        inner.chunk_mb = None
        solution = inner.solve()
        numels = {t.name: t.numel for t in self.profile.timeline}
        groups = []
        for group in solution.plan.groups:
            members: List[List] = []  # [name, start, stop], consecutive chunks merged
            for piece in group.names:
                name, start, stop = origin[piece]
                if members and members[-1][0] == name and members[-1][2] == start:
                    members[-1][2] = stop
                else:
                    members.append([name, start, stop])
            slices = tuple(None if (start, stop) == (0, numels[name]) else (start, stop)
                           for name, start, stop in members)
            groups.append(Group(tuple(m[0] for m in members), group.send, slices))
        return Solution(Plan(groups), solution.iteration_time, solution.exact)

    def _search(self, run_start, cost, rest, incumbent, max_states):
        """The DP over prefixes: ((best value, its groups), whether no state set was cut).

        ``fronts[j]`` holds the states of prefix j as arrays: the (A, F, Q, H) rows, and
        for each row the start of its last group, that group's send mode and the row of
        ``fronts[start]`` it extends.  The transition is :func:`advance`, vectorized with
        the same floating-point operations in the same order.
        """
        timeline = self.profile.timeline
        n = len(timeline)
        on_compute, backward = self.compression_on_compute, self.profile.backward_time
        interference, slowdown = self.profile.interference, self.profile.collective_slowdown
        since_of = np.array([0.0] + [t.ready for t in timeline[:-1]])
        best_value, best_groups = incumbent
        exact = True
        fronts = [None] * (n + 1)
        fronts[0] = (np.zeros((1, 4)), np.zeros(1, int), np.zeros(1, int), np.zeros(1, int))
        tables = self._cost_tables(run_start, cost)
        for j in range(1, n + 1):
            ready = timeline[j - 1].ready
            sources = [i for i in range(run_start[j - 1], j) if len(fronts[i][0])]
            if not sources:
                fronts[j] = (np.zeros((0, 4)), np.zeros(0, int), np.zeros(0, int), np.zeros(0, int))
                continue
            previous = np.concatenate([fronts[i][0] for i in sources])
            origin = np.concatenate([np.full(len(fronts[i][0]), i) for i in sources])
            rows = np.concatenate([np.arange(len(fronts[i][0])) for i in sources])
            pieces = []
            for mode, (encode, communicate, finish, blocking) in enumerate(tables):
                new = advance_all(previous, ready, encode[origin, j], communicate[origin, j],
                                   finish[origin, j], on_compute, interference, since_of[origin],
                                   slowdown, backward, None if blocking is None else blocking[origin, j])
                bounds = self._lower_bound(new, rest[j])
                keep = np.flatnonzero(bounds < best_value)
                pieces.append((new[keep], bounds[keep], origin[keep], np.full(len(keep), mode), rows[keep]))
            states, bounds, starts, modes, parents = (np.concatenate(x) for x in zip(*pieces))
            if not len(states):
                fronts[j] = (states, starts, modes, parents)
                continue
            chosen = np.arange(len(states))
            if len(chosen) > self.max_candidates:
                exact = False
                chosen = np.sort(np.argpartition(bounds, self.max_candidates)[:self.max_candidates])
            chosen = chosen[pareto(states[chosen], backward, on_compute)]
            if max_states is not None and len(chosen) > max_states:
                exact = False
                chosen = chosen[np.argsort(bounds[chosen], kind="stable")[:max_states]]
            fronts[j] = (states[chosen], starts[chosen], modes[chosen], parents[chosen])
        final_states = fronts[n][0]
        if len(final_states):
            values = self._final_times(final_states)
            row = int(np.argmin(values))
            if values[row] < best_value:
                best_value, best_groups = float(values[row]), self._backtrack(fronts, row)
        return (best_value, best_groups), exact

    def _final_times(self, states: np.ndarray) -> np.ndarray:
        """:func:`mergecomp.planning.costmodel.finish_time` of every row of complete-plan ``states``."""
        first, channel, finish_loop, finished = states.T
        backward = self.profile.backward_time
        if not self.compression_on_compute:
            return np.maximum(backward + finished, finish_loop)
        last = self.profile.timeline[-1].ready
        tail = stretch_all(backward - last, channel - (last + first), self.profile.interference)
        return np.maximum(((backward + first) + tail) + finished, finish_loop)

    def _cost_tables(self, run_start: List[int], cost):
        """Per send mode, (encode, communicate, finish, blocking) seconds of group [i, j) at
        [i, j]; blocking is None for a mode whose launch does not wait for its collective
        (one SendCost prices every group of a mode, so it blocks for all or none)."""
        n = len(run_start)
        tables = []
        for send in self.sends:
            table = np.zeros((4, n + 1, n + 1))
            blocks = False
            for j in range(1, n + 1):
                for i in range(run_start[j - 1], j):
                    c = cost(i, j, send)
                    blocks = c.blocking is not None
                    table[:, i, j] = (c.encode, c.communicate, c.finish, c.blocking or 0.0)
            tables.append((table[0], table[1], table[2], table[3] if blocks else None))
        return tables

    def _backtrack(self, fronts, row: int) -> List[Tuple[int, int, str]]:
        groups, end = [], len(fronts) - 1
        while end > 0:
            _, starts, modes, parents = fronts[end]
            start = int(starts[row])
            groups.append((start, end, self.sends[int(modes[row])]))
            end, row = start, int(parents[row])
        return list(reversed(groups))

    def _rest_bounds(self, n: int, cost) -> List[Optional[Tuple[float, ...]]]:
        """For each prefix end j < n, the least any completion can add (see _lower_bound):

        (least encode delay + finish of tensors j.., least channel time of j..,
        latest "ready + least encode + least channel time of the tensors from there on",
        least encode + channel time counted from tensor j, least finish of j.., least
        finish of the last tensor).
        """
        on = self.compression_on_compute

        def least(i, j, what):
            return min(what(cost(i, j, s)) for s in self.sends)

        bounds: List[Optional[Tuple[float, ...]]] = [None] * (n + 1)
        late = float("-inf")
        last_finish = least(n - 1, n, lambda c: c.finish)
        for j in range(n - 1, -1, -1):
            from_here = least(j, j + 1, lambda c: c.encode) + least(j, n, lambda c: c.communicate)
            late = max(late, self.profile.timeline[j].ready + from_here)
            bounds[j] = (least(j, n, lambda c: (c.encode if on else 0.0) + c.finish),
                         least(j, n, lambda c: c.communicate), late, from_here,
                         least(j, n, lambda c: c.finish), last_finish)
        return bounds

    def _lower_bound(self, states: np.ndarray, rest) -> np.ndarray:
        """Lower bounds on the final time of any completion of prefixes in ``states``.

        Group costs are affine in (elements, bytes) with non-negative coefficients, so
        their minimum over send modes is concave and zero at zero, hence subadditive: the
        groups still to come cost at least what the whole rest would cost as one group of
        the cheapest mode.  The group holding tensor k launches no earlier than k's ready
        time (plus the encode delay so far, on compute), encodes at least tensor k, and is
        followed on the channel by everything after k.  ``Q`` grows by at least the rest's
        finish time, and the last group finishes after the channel is done.  A complete
        prefix gets its exact time.
        """
        first, channel, finish_loop, finished = states.T
        backward = self.profile.backward_time
        if rest is None:
            return self._final_times(states)
        # Time added after backward so far; the interference stretch only adds to it.
        added = first + finished if self.compression_on_compute else finished
        added_rest, channel_rest, late, from_here, finish_rest, last_finish = rest
        if self.compression_on_compute:
            channel_end = np.maximum(channel + channel_rest, first + late)
        else:
            channel_end = np.maximum(np.maximum(channel + channel_rest, late), first + from_here)
        return np.maximum(np.maximum(backward + added + added_rest, finish_loop + finish_rest),
                          channel_end + last_finish)

    def _incumbent(self, n: int, run_start: List[int], cost):
        """The best of the simple plans: one group per dtype run, or per tensor, in each mode."""
        best = None
        timeline, interference = self.profile.timeline, self.profile.interference
        for send in self.sends:
            for per_tensor in (False, True):
                state, groups = START, []
                for j in range(1, n + 1):
                    if per_tensor or j == n or run_start[j] != run_start[j - 1]:
                        i = j - 1 if per_tensor else run_start[j - 1]
                        state = advance(state, timeline[j - 1].ready, cost(i, j, send),
                                        self.compression_on_compute, interference,
                                        timeline[i - 1].ready if i else 0.0,
                                        self.profile.collective_slowdown,
                                        self.profile.backward_time)[0]
                        groups.append((i, j, send))
                value = finish_time(state, self.profile.backward_time, self.compression_on_compute,
                                    interference, timeline[-1].ready)
                if best is None or value < best[0]:
                    best = (value, groups)
        return best

    def __repr__(self):
        return (f"OptimalScheduler({len(self.profile.timeline)} profiled tensors, sends={self.sends}, "
                f"compression_on_compute={self.compression_on_compute})")
