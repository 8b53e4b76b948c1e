"""The optimal scheduler against brute force, and the binary-search baseline."""
import itertools
import math
import random

import pytest

from mergecomp import schedulers
from mergecomp.planning.costmodel import predict
from mergecomp.plan import Group, ParamInfo, Plan
from mergecomp.planning.profile import CodecCost, LinearCost, Profile, TensorTiming, WireSize
from mergecomp.schedulers.binary import BinarySearchScheduler
from mergecomp.planning.optimal import OptimalScheduler


def random_profile(rng, n, communicator="allgather"):
    ready, timeline = 0.0, []
    for k in range(n):
        ready += rng.uniform(0.0, 2e-3)
        numel = rng.choice([10, 1000, 10 ** 5, 10 ** 6])
        timeline.append(TensorTiming(f"t{k}", numel, 4 * numel, "torch.float32", "cpu", ready))
    # Compression from nearly free to slower than the network, so either choice can win.
    encode = LinearCost(rng.uniform(0, 2e-4), rng.choice([1e-10, 1e-9, 5e-9]))
    return Profile(
        world_size=rng.choice([2, 8]), timeline=timeline, forward_time=1e-3,
        backward_time=ready + rng.uniform(0, 2e-3), compressor="toy", communicator=communicator,
        codecs={"toy": CodecCost(encode, LinearCost(rng.uniform(0, 1e-4), 1e-10), WireSize(0.1, 8)),
                "fp16": CodecCost(LinearCost(1e-6, 5e-10), LinearCost(1e-6, 5e-10), WireSize(2.0, 0))},
        collectives={"allreduce": LinearCost(rng.uniform(1e-5, 5e-4), rng.choice([1e-10, 1e-9, 4e-9])),
                     "allgather": LinearCost(rng.uniform(1e-5, 5e-4), rng.choice([4e-10, 2e-9]))},
        copy=LinearCost(1e-6, 1e-11))


def brute_force(profile, sends, on_compute):
    """The fastest of every partition into contiguous groups × every per-group send choice."""
    names = [t.name for t in profile.timeline]
    best = math.inf
    for cuts in itertools.product((False, True), repeat=len(names) - 1):
        bounds = [0] + [k + 1 for k, cut in enumerate(cuts) if cut] + [len(names)]
        pieces = [tuple(names[a:b]) for a, b in zip(bounds, bounds[1:])]
        for choice in itertools.product(sends, repeat=len(pieces)):
            plan = Plan([Group(piece, send) for piece, send in zip(pieces, choice)])
            best = min(best, predict(plan, profile, compression_on_compute=on_compute).iteration_time)
    return best


CHOSEN = {}


@pytest.mark.parametrize("seed", range(10))
def test_dp_matches_brute_force(seed):
    rng = random.Random(seed)
    on_compute = seed % 2 == 0
    profile = random_profile(rng, 6 if seed < 8 else 5, "allgather" if seed % 3 else "allreduce")
    allow_half = seed >= 8
    if allow_half:
        profile.codecs["bf16"] = CodecCost(LinearCost(2e-6, 4e-10), LinearCost(2e-6, 4e-10), WireSize(2.0, 0))
    scheduler = OptimalScheduler(profile, allow_half=allow_half, compression_on_compute=on_compute,
                                 max_states=None)
    solution = scheduler.solve()
    sends = ("fp32", "compress", "fp16", "bf16") if allow_half else ("fp32", "compress")
    assert solution.exact
    assert solution.iteration_time == pytest.approx(brute_force(profile, sends, on_compute), rel=1e-12)
    predicted = predict(solution.plan, profile, compression_on_compute=on_compute).iteration_time
    assert predicted == pytest.approx(solution.iteration_time, rel=1e-12)
    CHOSEN[seed] = frozenset(g.send for g in solution.plan.groups)


@pytest.mark.parametrize("seed", range(4))
def test_dp_matches_brute_force_when_launches_wait_for_an_all_to_all(seed):
    rng = random.Random(100 + seed)
    on_compute = seed % 2 == 0
    profile = random_profile(rng, 6, "ps")
    profile.collectives["alltoall"] = LinearCost(rng.uniform(1e-5, 5e-4), rng.choice([4e-10, 2e-9]))
    solution = OptimalScheduler(profile, compression_on_compute=on_compute, max_states=None).solve()
    assert solution.exact
    assert solution.iteration_time == pytest.approx(brute_force(profile, ("fp32", "compress"), on_compute), rel=1e-12)
    predicted = predict(solution.plan, profile, compression_on_compute=on_compute).iteration_time
    assert predicted == pytest.approx(solution.iteration_time, rel=1e-12)


def test_brute_force_cases_cover_raw_compressed_and_mixed_optima():
    if len(CHOSEN) < 10:
        pytest.skip("runs after test_dp_matches_brute_force")
    kinds = set(CHOSEN.values())
    assert {frozenset({"fp32"}), frozenset({"compress"}), frozenset({"fp32", "compress"})} <= kinds


def test_no_compression_when_it_does_not_pay():
    profile = random_profile(random.Random(7), 8)
    profile.codecs["toy"] = CodecCost(LinearCost(1e-2, 1e-6), LinearCost(1e-3, 0), WireSize(0.1, 0))
    plan = OptimalScheduler(profile).plan(profile.params())
    assert {g.send for g in plan.groups} == {"fp32"}


def test_compression_on_a_slow_network_but_small_groups_stay_raw():
    timeline = [TensorTiming("big", 10 ** 7, 4 * 10 ** 7, "torch.float32", "cpu", 0.01),
                TensorTiming("small", 10, 40, "torch.float32", "cpu", 0.02)]
    profile = Profile(2, timeline, 0.01, 0.02, compressor="toy", communicator="allreduce",
                      codecs={"toy": CodecCost(LinearCost(1e-3, 1e-10), LinearCost(1e-3, 0), WireSize(0.04, 0))},
                      collectives={"allreduce": LinearCost(1e-4, 1e-8)})
    plan = OptimalScheduler(profile).plan(profile.params())
    assert [(g.names, g.send) for g in plan.groups] == [(("big",), "compress"), (("small",), "fp32")]


def test_groups_never_mix_dtypes():
    rng = random.Random(3)
    profile = random_profile(rng, 6)
    profile.timeline[2] = TensorTiming("t2", 10, 20, "torch.float16", "cpu", profile.timeline[2].ready)
    plan = OptimalScheduler(profile).plan(profile.params())
    types = {t.name: t.dtype for t in profile.timeline}
    assert all(len({types[n] for n in g.names}) == 1 for g in plan.groups)
    assert ("t2",) in [g.names for g in plan.groups]


def test_registered_from_a_profile_path_with_clear_errors(tmp_path):
    profile = random_profile(random.Random(1), 4)
    path = str(tmp_path / "p.json")
    profile.save(path)
    scheduler = schedulers.create("optimal", profile=path)
    assert scheduler.plan(list(reversed(profile.params()))).digest() == scheduler.solve().plan.digest()
    with pytest.raises(ValueError, match="does not match the profile"):
        scheduler.plan([ParamInfo("other", 4)])
    with pytest.raises(ValueError, match=r"cannot price send modes \['fp16', 'bf16'\]"):
        del profile.codecs["fp16"]
        OptimalScheduler(profile, allow_half=True)


def test_by_name_without_a_profile_says_where_one_comes_from():
    with pytest.raises(ValueError, match=r"measured cost profile.*profile_out=.*schedule='auto'"):
        schedulers.create("optimal")


# ------------------------------------------------------------------------------- binary
def drive(scheduler, time_of_split):
    proposals = 0
    while not scheduler.done:
        plan = scheduler.propose()
        split = len(plan.groups[0].names)
        proposals += 1
        scheduler.report(plan, time_of_split(split))
    return proposals


@pytest.mark.parametrize("n, optimum", [(100, 37), (100, 1), (100, 99), (2, 1), (33, 16)])
def test_binary_search_finds_the_optimum_in_log_candidates(n, optimum):
    params = [ParamInfo(f"p{k}", 10) for k in range(n)]
    scheduler = BinarySearchScheduler(steps=3, warmup=1)
    first = scheduler.plan(params)
    assert len(first.groups) == (2 if n > 1 else 1)
    drive(scheduler, lambda split: 1.0 + abs(split - optimum) / n)
    assert len(scheduler.best.groups[0].names) == optimum
    assert len(scheduler.measured) <= 2 * math.ceil(math.log2(max(n - 1, 2))) + 1
    assert scheduler.propose().digest() == scheduler.best.digest()


def test_binary_search_averages_steps_after_warmup_and_checks_reports():
    params = [ParamInfo(f"p{k}", 10) for k in range(8)]
    scheduler = BinarySearchScheduler(steps=2, warmup=1)
    scheduler.plan(params)
    plan = scheduler.propose()
    for seconds in (100.0, 1.0, 3.0):  # the warm-up step is dropped
        scheduler.report(plan, seconds)
    assert scheduler.measured[len(plan.groups[0].names)] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="not the current candidate"):
        scheduler.report(plan, 1.0)
    with pytest.raises(ValueError, match="positive number"):
        scheduler.report(scheduler.propose(), -1)
    with pytest.raises(ValueError, match="has not started"):
        BinarySearchScheduler().propose()
