"""PowerSGD per layer: rank-r compression of each layer's gradient matrix, warm-started.

Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019; the semantics of PyTorch's ``powerSGD_hook``.

    per layer matrix M (r × c):  P = M·Q;  allreduce P;  P̂ = orthonormalise(ΣP);
    Q = Mᵀ·P̂;  allreduce Q;  decode: P̂·(ΣQ)ᵀ;  Q is kept for the next step.

On the wire: 4·k·(r + c) bytes per factored matrix (k = rank) in two allreduces, and the
views not factored as they are.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from . import register
from ..staging import StagedDict
from .base import AllReduce, Compressor, GroupLayout, ParamView, check_layout
from .lowrank import FoldsAdamFirstMoment, check_flag, check_rank, check_rate, orthonormalize, seeded_normal
from .matrix import (LayerMatrix, compute_dtype, factor_element_size, gather_raw, group_layout,
                     layer_matrix, raw_numel, scatter_raw, split_layout)
from .warmup import ADAM_WARMUP_STEPS, RaisedFirstExchanges, check_adam_warmup_steps

#: ``factor_dtype``'s choices: the dtype P and Q travel in (None: the one they are computed in).
FACTOR_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


@register("powersgd")
class PowerSGDCompressor(FoldsAdamFirstMoment, RaisedFirstExchanges, Compressor):
    """Each layer's gradient matrix M (r × c) approximated by P̂ Qᵀ of rank ``rank``.

    The group's layout (its per-parameter views) says what a layer is: a view of two or
    more dimensions is the matrix shape[0] × rest (a conv kernel out × in·h·w); it is
    factored when that gains enough, r·c > ``min_compression_rate``·k·(r + c) with
    k = min(rank, r, c), and sent raw otherwise, as are 1-D views (biases, norms, pieces of
    sliced parameters).  Without a layout the tensor is one parameter: a matrix if it has
    two or more dimensions, raw if it is 1-D.

    Algorithm 1 of the paper, per matrix, in two allreduces for the whole group (the same
    on every rank, driven by the communicator through :meth:`rounds`):

    1. P = M Q for every matrix; allreduce one buffer holding the raw views and every P;
    2. P̂ = orthonormalize(ΣP); Q = Mᵀ P̂; allreduce one buffer holding every Q;
    3. the decoded sum over ranks is P̂ (ΣQ)ᵀ per matrix and the summed raw values.

    ``warm_start``: Q starts from the previous step's ΣQ, orthonormalised (the power
    iteration continues across steps); the first Q, and every Q without warm start, is a
    normal draw seeded by ``seed``, the group and view names (and the step, without warm
    start), identical on every rank.  ``use_error_feedback``: each rank keeps, per matrix,
    e = M − P̂ Qₗᵀ (Qₗ its local Q: what this rank's share of the approximation missed)
    and adds it to the next gradient, as in the paper; raw views are exact and keep
    nothing.  Use it with the ``none`` memory.  Biased per step; the feedback makes up for
    it.  With it, an Adam's first moment is taken off (:class:`~.lowrank.FoldsAdamFirstMoment`);
    SGD keeps its momentum.  Orthonormalisation is Householder QR, which needs no epsilon (see
    :func:`~mergecomp.compressors.lowrank.orthonormalize`).

    State (errors, warm-start queries, a step count) is kept per group and view, staged per
    step: :meth:`commit` keeps it, :meth:`rollback` forgets it.  It is keyed by view, so a
    plan switch moves each view's state into its new group (``mergecomp.runtime.regroup``); a view
    new to a group starts afresh, and state of a view the group does not factor (or of
    another shape) raises ValueError.

    ``rank`` defaults to 8 on bfloat16 factors (``factor_dtype="bf16"``): the bytes of the
    paper's rank 4 for its language model (an LSTM on WikiText-2) in fp32, at twice the rank,
    which is what a transformer under SGD lacked at rank 4 (docs/results.md#powersgd-bf16);
    ``rank=4, factor_dtype="fp32"`` is the paper's setting.  Why not rank 2:
    docs/results.md#lm-catch-up.

    ``warmup_steps``: under an Adam or AdamW, each group's first ``warmup_steps`` exchanges
    go at :data:`~.warmup.ADAM_WARMUP_SCALE` times the rank (capped by the matrix), then at
    its rank, the queries keeping their first columns (under any Adam, whatever its β1).
    Why: the power iteration starts from a random query, so the first approximations are
    poor, and Adam moves every coordinate by about its learning rate whatever the
    approximation's quality, in a pattern of the approximation's low rank; at β1 = 0 (the
    error feedback takes it off) nothing averages the first steps.  On a character LSTM
    under AdamW at two workers, PowerSGD
    stalled at the unigram plateau from its first steps, with or without the quality
    controller, and trained with its first exchanges at a higher rank
    (docs/results.md#two-workers).  PyTorch's ``powerSGD_hook`` defers compression for the
    same reason (``start_powerSGD_iter``: plain allreduce first).  The warm-up's bytes count
    as the configured setting's for the controller's budget, as a density warm-up's do.

    Math is fp32 whatever the gradient dtype (fp64 stays fp64); P and Q travel in bfloat16
    by default, half the bytes, twice the rank for the bytes of fp32 factors (measured:
    docs/results.md#powersgd-bf16), or as computed with ``factor_dtype="fp32"``.
    Each rank's error is taken against its Q as rounded for the wire, so error feedback
    keeps what the rounding lost with the rest; P's rounding only tilts the basis that
    orthonormalisation rebuilds, and the sum over ranks is rounded once more (bf16 keeps
    fp32's range: a finite factor stays finite).
    Raw values travel in the gradient's dtype (when it differs from the factors' the first
    round has two tensors, the raw values and the P factors).  Wire per rank, both rounds:
    (raw elements)·(element size) + b·k·(r + c) per factored r × c matrix, b = 2 (bf16
    factors; 4 with fp32 ones, 8 for fp64); :meth:`wire_nbytes` computes it from a layout.  PowerSGD has no
    one-shot form: :meth:`compress` and :meth:`decompress` raise, and
    ``mergecomp.compressors.single_process.run_locally`` drives :meth:`rounds` on one process.
    """

    summable = True
    fixed_size = True
    multi_round = True
    error_feedback = True  # the paper's, per rank; False for an instance without it
    staged_state = ("_queries", "_errors", "_steps")
    recommended_memory = "none"
    recommended_communicator = "allreduce"

    def __init__(self, rank: int = 8, min_compression_rate: float = 2.0, warm_start: bool = True,
                 use_error_feedback: bool = True, seed: int = 0, warmup_steps: int = ADAM_WARMUP_STEPS,
                 factor_dtype: str = "bf16"):
        self.rank = check_rank(rank, "powersgd")
        if factor_dtype not in FACTOR_DTYPES:
            raise ValueError(f"powersgd factor_dtype must be one of {sorted(FACTOR_DTYPES)}, got "
                             f"{factor_dtype!r}: 'fp32' sends the factors as computed, 'bf16' in half "
                             "the bytes")
        self.factor_dtype = factor_dtype
        self.warmup_steps = check_adam_warmup_steps(warmup_steps, "powersgd")
        self.min_compression_rate = check_rate(min_compression_rate, "powersgd")
        self.warm_start = check_flag(warm_start, "warm_start", "powersgd")
        self.use_error_feedback = check_flag(use_error_feedback, "use_error_feedback", "powersgd")
        self.error_feedback = self.use_error_feedback
        self.seed = int(seed)
        self._queries = StagedDict()  # group → {view name: ΣQ of the last step}
        self._errors = StagedDict()   # group → {view name: e}
        self._steps = StagedDict()    # group → steps exchanged (seeds the draws without warm start)

    # -- which views are factored ----------------------------------------------------------
    knob = "rank"

    def check_optimizer(self, optimizer) -> None:
        """Take an Adam's first moment off (its error feedback's), and warm up under an Adam."""
        super().check_optimizer(optimizer)
        self.note_optimizer(optimizer)

    def matrix_rank(self, rows: int, cols: int, name: Optional[str] = None) -> int:
        """The rank k a rows × cols matrix (of group ``name``: its scale raises the rank, see
        :attr:`knob`) is approximated with."""
        if name is None:
            return min(self.rank, rows, cols)
        scale = self.group_scale(name) * self.warmup_scale(name)
        return min(max(self.rank, round(self.rank * scale)), rows, cols)

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the factors travel in, for factors computed in ``dtype``."""
        return FACTOR_DTYPES[self.factor_dtype] or dtype

    def factors(self, rows: int, cols: int) -> bool:
        """Whether a rows × cols matrix gains enough to be factored: PyTorch's rule,
        r·c > rate·k·(r + c), with a bf16 factor element counted as half an fp32 one (its
        bytes), so rank 8 on bf16 factors factors the matrices rank 4 on fp32 ones does."""
        width = self.factor_size() / 4  # a factor element against an fp32 one
        return rows * cols > self.min_compression_rate * self.matrix_rank(rows, cols) * (rows + cols) * width

    def factor_size(self, element_size: int = 4) -> int:
        """Bytes of one factor element on the wire, for a gradient of ``element_size`` bytes."""
        wire = FACTOR_DTYPES[self.factor_dtype]
        return wire.itemsize if wire is not None else factor_element_size(element_size)

    def split(self, layout: GroupLayout) -> Tuple[Tuple[ParamView, ...], Tuple[LayerMatrix, ...]]:
        """(views sent raw, views factored) of a group layout."""
        return split_layout(layout, self.factors)

    # -- the exchange ----------------------------------------------------------------------
    def rounds(self, tensor, name, layout=None, out=None):
        """The two rounds; the decoded sum goes into ``out`` when given (a flat tensor of the
        group's size and dtype the caller lends: raw views are written after the first
        round, matrices only once their inputs are no longer read, so ``out`` may even be
        ``tensor`` itself), else into a new tensor."""
        raw, matrices = self.split(group_layout(tensor, name, layout))
        flat = tensor.reshape(-1)
        dtype = compute_dtype(tensor.dtype)
        queries, errors = self._checked_state(name, matrices)
        step = self._steps.get(name, 0)

        inputs = []  # M per matrix, the error added: a view of the gradient when there is none
        for matrix in matrices:
            m = layer_matrix(flat, matrix, dtype)
            error = errors.get(matrix.view.name)
            inputs.append(m if error is None else m + error.to(m.device))
        if self.measuring:  # the drift: the whole gradient comes in, the errors are held back
            self._note_incoming(name, flat)

        n_raw = raw_numel(raw)
        wire = self.wire_dtype(dtype)
        p_sizes = [matrix.rows * self.matrix_rank(matrix.rows, matrix.cols, name) for matrix in matrices]
        one_buffer = tensor.dtype == wire or not matrices or n_raw == 0
        if one_buffer:  # one collective for the raw values and every P
            buffer = torch.empty(n_raw + sum(p_sizes), dtype=wire if matrices else tensor.dtype,
                                 device=flat.device)
            raw_part, p_part = buffer[:n_raw], buffer[n_raw:]
            request = (buffer,)
        else:  # fp16/bf16 raw values travel in their own dtype next to the fp32 factors
            raw_part = torch.empty(n_raw, dtype=tensor.dtype, device=flat.device)
            p_part = torch.empty(sum(p_sizes), dtype=wire, device=flat.device)
            request = (raw_part, p_part)
        gather_raw(flat, raw, out=raw_part)
        ps = _split_views(p_part, [(m.rows, self.matrix_rank(m.rows, m.cols, name)) for m in matrices])
        for matrix, m, p in zip(matrices, inputs, ps):
            query = orthonormalize(self._start_query(name, matrix, queries, step, m))
            if wire == dtype:
                torch.matmul(m, query, out=p)
            else:  # rounded for the wire
                p.copy_(m @ query)

        reply = yield AllReduce(request)
        if one_buffer:
            raw_sum, p_sum = reply[0][:n_raw], reply[0][n_raw:]
        else:
            raw_sum, p_sum = reply
        if out is None or out.numel() != flat.numel() or out.dtype != tensor.dtype:
            out = torch.empty(flat.numel(), dtype=tensor.dtype, device=flat.device)
        scatter_raw(raw_sum, raw, out)
        if not matrices:
            self._note_held(name)  # every view went raw: nothing held back
            return out.view(tensor.shape)

        p_hats = [orthonormalize(p.to(dtype)) for p in _split_views(
            p_sum, [(m.rows, self.matrix_rank(m.rows, m.cols, name)) for m in matrices])]
        q_buffer = torch.empty(sum(m.cols * self.matrix_rank(m.rows, m.cols, name) for m in matrices),
                               dtype=wire, device=flat.device)
        qs = _split_views(q_buffer, [(m.cols, self.matrix_rank(m.rows, m.cols, name)) for m in matrices])
        new_errors: Dict[str, torch.Tensor] = {}
        for matrix, m, p_hat, q in zip(matrices, inputs, p_hats, qs):
            if wire == dtype:
                torch.matmul(m.t(), p_hat, out=q)
            else:  # rounded for the wire; the error is taken against the rounded Q
                q.copy_(m.t() @ p_hat)
            if self.use_error_feedback:  # before the allreduce sums into q in place
                new_errors[matrix.view.name] = torch.addmm(m, p_hat, q.to(dtype).t(), alpha=-1)

        (q_sum,) = yield AllReduce((q_buffer,))
        q_sums = [q.to(dtype) for q in _split_views(
            q_sum, [(m.cols, self.matrix_rank(m.rows, m.cols, name)) for m in matrices])]
        for matrix, p_hat, q in zip(matrices, p_hats, q_sums):
            out[matrix.start:matrix.stop].view(matrix.rows, matrix.cols).copy_(p_hat @ q.t())
        if self.use_error_feedback:
            self._errors[name] = new_errors
        self._note_held(name, *new_errors.values())
        if self.warm_start:
            self._queries[name] = {matrix.view.name: q for matrix, q in zip(matrices, q_sums)}
        self._steps[name] = step + 1
        return out.view(tensor.shape)

    def _start_query(self, name: str, matrix: LayerMatrix, queries: Dict[str, torch.Tensor],
                     step: int, like: torch.Tensor) -> torch.Tensor:
        query = queries.get(matrix.view.name) if self.warm_start else None
        if query is not None:
            return query.to(device=like.device, dtype=like.dtype)
        key = f"powersgd/{self.seed}/{name}/{matrix.view.name}/{0 if self.warm_start else step}"
        return seeded_normal(key, matrix.cols, self.matrix_rank(matrix.rows, matrix.cols, name), like)

    def _checked_state(self, name: str, matrices: Tuple[LayerMatrix, ...]):
        """This group's queries and errors, after checking they fit its factored views."""
        wanted = {m.view.name: m for m in matrices}
        found = []
        for kind, store, shape in (
                ("warm-start queries", self._queries, lambda m: (m.cols, self.matrix_rank(m.rows, m.cols, name))),
                ("errors", self._errors, lambda m: (m.rows, m.cols))):
            stored: Dict[str, torch.Tensor] = store.get(name, {})
            if store is self._queries and stored:
                stored = self._resized_queries(name, stored, wanted)
            # A view without state starts afresh (it joined the group in a plan switch); a
            # stored view the group no longer factors, or of another shape, is an error.
            if stored and (not set(stored) <= set(wanted) or any(
                    tuple(stored[v].shape) != shape(wanted[v]) for v in stored)):
                have = {v: tuple(t.shape) for v, t in stored.items()}
                want = {v: shape(m) for v, m in wanted.items()}
                raise ValueError(
                    f"powersgd {kind} of group {name!r} were made for views {have} but the group "
                    f"now factors {want}: the plan (or rank) changed without moving the state "
                    "(DistributedOptimizer.set_plan moves it); create a new compressor, or load "
                    "a state_dict saved with this plan")
            found.append(stored)
        return found[0], found[1]

    def _resized_queries(self, name: str, stored: Dict[str, torch.Tensor],
                         wanted: Dict[str, LayerMatrix]) -> Dict[str, torch.Tensor]:
        """The warm-start queries at the group's rank now: the controller raised (or lowered)
        it since they were made, so each keeps its first columns, and new ones are seeded draws
        (the power iteration goes on in the directions it had found)."""
        resized = {}
        for view, query in stored.items():
            matrix = wanted.get(view)
            rank = self.matrix_rank(matrix.rows, matrix.cols, name) if matrix is not None else query.shape[1]
            if matrix is None or query.dim() != 2 or query.shape[0] != matrix.cols or query.shape[1] == rank:
                resized[view] = query
            elif query.shape[1] > rank:
                resized[view] = query[:, :rank].contiguous()
            else:
                extra = seeded_normal(f"powersgd/{self.seed}/{name}/{view}/rank{rank}", matrix.cols,
                                      rank - query.shape[1], query)
                resized[view] = torch.cat([query, extra], dim=1)
        return resized

    def compress(self, tensor, name, layout=None):
        raise TypeError("PowerSGD exchanges in two allreduce rounds and has no one-shot payload: "
                        "use it through a communicator (which drives rounds()), or "
                        "mergecomp.compressors.single_process.run_locally on a single process")

    def decompress(self, payload, ctx):
        self.compress(None, None)

    def wire_nbytes(self, numel: int, element_size: int = 4, payload=None,
                    layout: Optional[GroupLayout] = None) -> int:
        """Bytes one rank sends, both rounds, for a group of ``numel`` elements of
        ``element_size`` bytes laid out as ``layout`` (None: one 1-D tensor, sent raw; pass
        ``whole_layout(tensor)`` for a single matrix).  ``payload`` does not change it."""
        if layout is None:
            layout = (ParamView("tensor", torch.Size([numel]), 0),)
        check_layout(layout, numel)
        raw, matrices = self.split(layout)
        factor_size = self.factor_size(element_size)
        return raw_numel(raw) * element_size + sum(
            factor_size * self.matrix_rank(m.rows, m.cols) * (m.rows + m.cols) for m in matrices)

    # -- state -----------------------------------------------------------------------------
    @property
    def queries(self) -> Dict[str, Dict[str, torch.Tensor]]:
        """{group: {view: ΣQ}} as the next step will read it (this step's writes included)."""
        return dict(self._queries)

    @property
    def errors(self) -> Dict[str, Dict[str, torch.Tensor]]:
        """{group: {view: e}} as the next step will read it (this step's writes included)."""
        return dict(self._errors)

    def state_dict(self):
        return {"queries": _clone_nested(self._queries.committed()),
                "errors": _clone_nested(self._errors.committed()),
                "steps": dict(self._steps.committed())}

    def check_state(self, state, groups):
        """Each group's errors are rows × cols per factored view, its queries cols × k."""
        for kind, shape in (("warm-start queries", lambda m: (m.cols, self.matrix_rank(m.rows, m.cols))),
                            ("errors", lambda m: (m.rows, m.cols))):
            for group, views in state.get("queries" if kind != "errors" else "errors", {}).items():
                if group not in groups:
                    raise ValueError(f"powersgd {kind} are kept for group {group!r}, which this run does "
                                     f"not exchange (it has {sorted(groups)}): saved with another plan")
                layout = groups[group].layout
                if layout is None or not isinstance(views, dict):
                    continue  # shapes unknown here; load_state_dict checks the structure
                wanted = {m.view.name: shape(m) for m in self.split(layout)[1]}
                for view, tensor in views.items():
                    if not isinstance(tensor, torch.Tensor):
                        continue
                    if view not in wanted:
                        raise ValueError(f"powersgd {kind} of group {group!r} has view {view!r}, which "
                                         f"the group does not factor (it factors {sorted(wanted)})")
                    if tuple(tensor.shape) != wanted[view]:
                        raise ValueError(f"powersgd {kind} of group {group!r} view {view!r} has shape "
                                         f"{tuple(tensor.shape)}, expected {wanted[view]}")

    def load_state_dict(self, state):
        unknown = sorted(set(state) - {"queries", "errors", "steps"})
        if unknown:
            raise ValueError(f"powersgd state has unknown keys {unknown}; expected 'queries', "
                             "'errors', 'steps'")
        for key in ("queries", "errors"):
            for group, views in state.get(key, {}).items():
                if not isinstance(views, dict) or not all(
                        isinstance(t, torch.Tensor) for t in views.values()):
                    raise ValueError(
                        f"powersgd {key} of group {group!r} must be a dict of tensors per view, got "
                        f"{type(views).__name__}; one tensor per group is the state of "
                        "'batched_powersgd'")
        self._queries.replace(_clone_nested(state.get("queries", {})))
        self._errors.replace(_clone_nested(state.get("errors", {})))
        self._steps.replace({group: int(n) for group, n in state.get("steps", {}).items()})

    def __repr__(self):
        return (f"PowerSGDCompressor(rank={self.rank}, min_compression_rate="
                f"{self.min_compression_rate}, warm_start={self.warm_start}, "
                f"use_error_feedback={self.use_error_feedback}, seed={self.seed}, "
                f"warmup_steps={self.warmup_steps}, factor_dtype={self.factor_dtype!r})")


def _split_views(buffer: torch.Tensor, shapes: List[Tuple[int, int]]) -> List[torch.Tensor]:
    """Consecutive matrices of ``shapes`` viewed in a flat ``buffer``."""
    views, at = [], 0
    for rows, cols in shapes:
        views.append(buffer[at:at + rows * cols].view(rows, cols))
        at += rows * cols
    return views


def _clone_nested(groups: Dict[str, Dict[str, torch.Tensor]]) -> Dict[str, Dict[str, torch.Tensor]]:
    return {group: {view: t.detach().clone() for view, t in views.items()}
            for group, views in groups.items()}
