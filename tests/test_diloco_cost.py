"""What a DiLoCo inner step costs: the user's optimizer step and nothing else.  No collective
and no pass over the model between exchanges; an exchange is three collectives (preflight,
payload, outcome).  The guarantees move to the exchange: a NaN taken in an inner step is
caught there, and ranks that disagree on the step are named there."""
import warnings

import pytest
import torch
import torch.distributed as dist

import mergecomp
from mergecomp.lowcomm.diloco import Fragment
from mergecomp.runtime.agreement import RanksDisagree

from .distributed import run_ranks

COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "barrier", "all_gather_object", "all_to_all_single",
               "broadcast_object_list", "all_gather_into_tensor", "reduce_scatter_tensor", "send", "recv")
FRAGMENT_PASSES = ("flat", "pseudo_gradient", "outer_step", "merge", "write")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _loss(model, rank, step):
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(1000 * rank + step))
    return torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())


def _count_per_step(rank, world_size, fragments, overlap):
    """Per ``opt.step()``: the collectives it ran and the passes over the fragments it made."""
    seen = []
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            seen.append(_name)
            return _original(*args, **kwargs)
        setattr(dist, name, counted)
    for name in FRAGMENT_PASSES:
        original = getattr(Fragment, name)

        def counted_pass(self, *args, _original=original, _name=name, **kwargs):
            seen.append(_name)
            return _original(self, *args, **kwargs)
        setattr(Fragment, name, counted_pass)
    model = _model()
    opt = mergecomp.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.05), model=model, sync_every=4,
                           fragments=fragments, overlap=overlap)
    per_step = []
    for step in range(12):
        opt.zero_grad()
        _loss(model, rank, step).backward()
        seen.clear()
        opt.step()
        per_step.append(list(seen))
    return per_step


@pytest.mark.parametrize("fragments, overlap", [(1, 0), (2, 1)])
def test_an_inner_step_runs_no_collective_and_no_pass_over_the_model(fragments, overlap):
    for per_step in run_ranks(_count_per_step, 2, fragments, overlap):
        busy = {step + 1 for step, seen in enumerate(per_step) if seen}
        launches = {t for t in range(1, 13) for f in range(fragments) if (t - f * 4 // fragments) % 4 == 0}
        finishes = {t + overlap for t in launches if t + overlap <= 12}
        assert busy == launches | finishes
        collectives = [c for seen in per_step for c in seen if c in COLLECTIVES]
        # preflight and payload at a launch, the outcome at the finish
        assert collectives == ["all_reduce"] * (2 * len(launches) + len(finishes))


def _nan_gradient_between_exchanges(rank, world_size, fragments, overlap):
    model = _model()
    opt = mergecomp.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.05), model=model, sync_every=4,
                           fragments=fragments, overlap=overlap, outer_momentum=0.5)
    caught = []
    for step in range(16):
        opt.zero_grad()
        _loss(model, rank, step).backward()
        if rank == 1 and step == 9:  # inner step 10: no exchange starts or ends there
            next(model.parameters()).grad[0, 0] = float("nan")
        before = [(f.anchor.clone(), {k: v.clone() for k, v in f.outer.state[f.anchor].items()})
                  for f in opt.fragments]
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            opt.step()
        if said:
            caught.append((opt.inner_steps, [str(w.message) for w in said],
                           all(torch.equal(a, f.anchor) and all(torch.equal(v, f.outer.state[f.anchor][k])
                                                                 for k, v in m.items())
                               for (a, m), f in zip(before, opt.fragments))))
    finite = all(bool(torch.isfinite(f.anchor).all()) for f in opt.fragments)
    return caught, opt.skipped_steps, finite, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("fragments, overlap", [(1, 0), (2, 1)])
def test_a_nan_taken_in_an_inner_step_is_caught_at_the_next_exchange(fragments, overlap):
    results = run_ranks(_nan_gradient_between_exchanges, 2, fragments, overlap)
    for caught, skipped, finite, _ in results:
        assert skipped == 1 and finite  # one drop, then every fragment is back at a finite anchor
        first_step, messages, unchanged = caught[0]
        assert 10 < first_step <= 12 + overlap  # at the first exchange after the NaN, not before
        assert unchanged and any("rank(s) [1]" in m and "dropped on every rank" in m for m in messages)
    assert all(bool(torch.isfinite(p).all()) for result in results for p in result[3])
    if overlap == 0:  # step 16 ends an exchange: every rank holds the new anchor
        assert all(torch.equal(a, b) for a, b in zip(results[0][3], results[1][3]))


def _ranks_out_of_step(rank, world_size):
    model = _model()
    opt = mergecomp.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.05), model=model, sync_every=4)
    if rank == 1:
        opt.inner_steps = 4  # as if it had resumed from another step's checkpoint
    try:
        for step in range(4):
            opt.zero_grad()
            _loss(model, rank, step).backward()
            opt.step()
    except RanksDisagree as error:
        return str(error)
    return None


def test_ranks_out_of_step_are_named_at_the_exchange():
    for message in run_ranks(_ranks_out_of_step, 2):
        assert message is not None and "rank 0: 4, rank 1: 8" in message
