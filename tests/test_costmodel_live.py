"""Live-run terms of the cost model: the collective slowdown under backward, and launch and
finish costs timed inside the optimizer.

Timelines are computed by hand in the comments (hand_profile: a, b, c ready at 1, 2, 3 s,
400, 800, 400 bytes raw; backward 4 s, forward 1 s; allreduce 0.5 s + 1 ms/byte).
"""
import dataclasses
import random

import pytest
import torch
import torch.nn as nn

import mergecomp
from mergecomp.planning.costmodel import GroupCost, advance, finish_time, predict, send_costs
from mergecomp.plan import Group, Plan
from mergecomp.planning.profile import LinearCost, Profile, collective_slowdown_factor, fit_live_costs
from mergecomp.planning.optimal import OptimalScheduler
from tests.distributed import run_ranks
from tests.test_costmodel import hand_profile
from tests.test_optimal import brute_force, random_profile

RAW3 = Plan([Group(("a",), "fp32"), Group(("b",), "fp32"), Group(("c",), "fp32")])


def test_collectives_run_slower_until_backward_ends():
    profile = dataclasses.replace(hand_profile(), collective_slowdown=2.0)
    p = predict(RAW3, profile)
    a, b, c = p.groups
    # a: 0.9 s of transfer from 1.0, backward runs until 4.0: all at half speed, ends 2.8.
    assert (a.comm_start, a.comm_end) == pytest.approx((1.0, 2.8))
    # b: 1.3 s from 2.8; until 4.0 at half speed (0.6 s done), 0.7 s after: ends 4.7.
    assert (b.comm_start, b.comm_end) == pytest.approx((2.8, 4.7))
    # c: starts after backward (4.7 > 4.0): 0.9 s at full speed.
    assert (c.comm_start, c.comm_end) == pytest.approx((4.7, 5.6))
    assert p.backward_end == pytest.approx(4.0)
    assert p.iteration_time == pytest.approx(1.0 + 5.6)
    assert predict(RAW3, hand_profile()).iteration_time == pytest.approx(1.0 + 4.2)


def test_live_launch_cost_replaces_copy_memory_and_codec():
    profile = dataclasses.replace(hand_profile(copy=LinearCost(5.0, 5.0)), memory=LinearCost(5.0, 5.0),
                                  launch={"fp32": LinearCost(0.1, 0.001)},
                                  finish={"fp32": LinearCost(0.0, 0.0)})
    assert send_costs(profile)["fp32"].launch == LinearCost(0.1, 0.001)
    p = predict(RAW3, profile)
    a, b, c = p.groups
    # a: launch 1.0, encode 0.1 + 0.1 = 0.2 (the copy and memory costs are not added): 0.9 s
    # on [1.2, 2.1].
    assert (a.launch, a.encode_end, a.comm_end) == pytest.approx((1.0, 1.2, 2.1))
    # b: ready 2 + 0.2 delay, encode 0.3: 2.5, A = 0.5; 1.3 s on [2.5, 3.8].
    assert (b.launch, b.encode_end, b.comm_end) == pytest.approx((2.2, 2.5, 3.8))
    # c: 3 + 0.5, encode 0.2: 3.7, A = 0.7; waits for the channel: [3.8, 4.7].
    assert (c.launch, c.encode_end, c.comm_start, c.comm_end) == pytest.approx((3.5, 3.7, 3.8, 4.7))
    assert p.backward_end == pytest.approx(4.7)
    assert p.iteration_time == pytest.approx(5.7)
    # A send mode without a live launch cost keeps the probes' copy + memory + codec.
    assert send_costs(profile)["compress"].launch is None


def test_slowdown_counts_backward_delayed_by_encoding():
    profile = dataclasses.replace(hand_profile(), launch={"fp32": LinearCost(0.1, 0.001)},
                                  collective_slowdown=2.0)
    a, b, c = predict(RAW3, profile).groups
    # a: [1.2, …) with A = 0.2: backward ends no earlier than 4.2; 0.9 s at half speed: 3.0.
    assert a.comm_end == pytest.approx(3.0)
    # b: encoded 2.5 (A = 0.5), starts 3.0; until 4.5 at half speed (0.75 s), 0.55 s more.
    assert (b.comm_start, b.comm_end) == pytest.approx((3.0, 5.05))
    # c: A = 0.7, starts 5.05 after 4.7: full speed, 0.9 s.
    assert c.comm_end == pytest.approx(5.95)


def test_advance_stays_monotone_with_the_slowdown():
    rng = random.Random(7)
    for _ in range(3000):
        k, c = rng.choice([1.0, 1.3, 2.0]), rng.choice([1.0, 1.2, 2.0, 5.0])
        cost = GroupCost(rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0, 1), 0.0)
        since = rng.uniform(0, 2)
        ready = since + rng.uniform(0, 2)
        backward = ready + rng.uniform(0, 3)
        state = tuple(rng.uniform(0, 5) for _ in range(4))
        bumped = list(state)
        bumped[rng.randrange(4)] += rng.uniform(0, 2)
        low = advance(state, ready, cost, True, k, since, c, backward)[0]
        high = advance(tuple(bumped), ready, cost, True, k, since, c, backward)[0]
        assert all(x <= y + 1e-12 for x, y in zip(low, high))
        assert finish_time(low, backward, True, k, ready) <= finish_time(high, backward, True, k, ready) + 1e-12


@pytest.mark.parametrize("seed", range(4))
def test_dp_matches_brute_force_with_slowdown_and_live_costs(seed):
    rng = random.Random(200 + seed)
    base = random_profile(rng, 6)
    profile = dataclasses.replace(
        base, collective_slowdown=rng.choice([1.1, 1.5, 3.0]), interference=rng.choice([1.0, 1.4]),
        launch={"compress": LinearCost(rng.uniform(0, 1e-4), 3e-9), "fp32": LinearCost(1e-5, 1e-10)},
        finish={"compress": LinearCost(2e-5, rng.choice([1e-10, 4e-9]))})
    solution = OptimalScheduler(profile, max_states=None).solve()
    assert solution.exact
    assert solution.iteration_time == pytest.approx(brute_force(profile, ("fp32", "compress"), True), rel=1e-12)
    assert predict(solution.plan, profile).iteration_time == pytest.approx(solution.iteration_time, rel=1e-12)


def test_slowdown_is_refused_off_compute():
    profile = dataclasses.replace(hand_profile(), collective_slowdown=1.5)
    with pytest.raises(ValueError, match="compression on compute only"):
        predict(RAW3, profile, compression_on_compute=False)
    with pytest.raises(ValueError, match="compression on compute only"):
        OptimalScheduler(profile, compression_on_compute=False)


def test_profile_round_trip_of_the_live_terms_and_old_profiles():
    profile = dataclasses.replace(hand_profile(), collective_slowdown=1.25,
                                  launch={"compress": LinearCost(1e-3, 2e-9)})
    loaded = Profile.from_dict(profile.to_dict())
    assert loaded.collective_slowdown == 1.25 and loaded.launch == {"compress": LinearCost(1e-3, 2e-9)}
    old = profile.to_dict()
    del old["collective_slowdown"], old["launch"]
    loaded = Profile.from_dict(old)
    assert loaded.collective_slowdown == 1.0 and loaded.launch == {}
    with pytest.raises(ValueError, match="collective_slowdown must be a finite factor ≥ 1.0"):
        dataclasses.replace(hand_profile(), collective_slowdown=0.8)
    with pytest.raises(ValueError, match="launch costs for send modes \\['lz4'\\]"):
        dataclasses.replace(hand_profile(), launch={"lz4": LinearCost()})


def test_collective_slowdown_factor_is_the_ratio_of_medians_at_least_one():
    assert collective_slowdown_factor([1.0, 1.2, 1.1], [1.5, 1.3]) == pytest.approx(1.4 / 1.1)
    assert collective_slowdown_factor([1.0], [0.9]) == 1.0
    with pytest.raises(ValueError, match="alone and under backward"):
        collective_slowdown_factor([], [1.0])
    with pytest.raises(ValueError, match="finite durations > 0"):
        collective_slowdown_factor([0.0], [1.0])


def test_fit_live_costs_takes_medians_per_size():
    costs = fit_live_costs({"compress": [(100, 1.0), (100, 3.0), (100, 2.0), (300, 4.0)],
                            "fp32": [(200, 0.4)], "fp16": []})
    # medians 2.0 at 100 and 4.0 at 300: 1.0 s + 0.01 s/element.
    assert costs["compress"].intercept == pytest.approx(1.0)
    assert costs["compress"].slope == pytest.approx(0.01)
    assert costs["fp32"].intercept == 0.0  # one size: through the origin
    assert costs["fp32"].slope == pytest.approx(0.002)
    assert "fp16" not in costs
    with pytest.raises(ValueError, match="send mode 'lz4'"):
        fit_live_costs({"lz4": [(1, 1.0)]})
    with pytest.raises(ValueError, match="integers ≥ 1"):
        fit_live_costs({"fp32": [(0, 1.0)]})
    with pytest.raises(ValueError, match="finite and ≥ 0"):
        fit_live_costs({"fp32": [(1, -1.0)]})


def listener_worker(rank, world_size, listen):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    plan = Plan([Group(("2.bias", "2.weight"), "compress"), Group(("0.bias", "0.weight"), "fp32")])
    opt = mergecomp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
        compressor=mergecomp.compressors.create("topk", compress_ratio=0.25), schedule=plan)
    events = []
    if listen:
        opt.add_phase_listener(lambda phase, group, seconds: events.append(
            (phase, group.index, group.send, group.numel, seconds >= 0)))
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        opt.zero_grad()
        nn.functional.mse_loss(model(torch.randn(16, 8, generator=g)), torch.randn(16, 4, generator=g)).backward()
        opt.step()
    return events, [p.detach().clone() for p in model.parameters()]


def test_phase_listener_times_launch_and_finish_without_changing_the_step():
    timed = run_ranks(listener_worker, 2, True)
    plain = run_ranks(listener_worker, 2, False)
    events = timed[0][0]
    assert events == [("launch", 0, "compress", 132, True), ("launch", 1, "fp32", 288, True),
                      ("finish", 0, "compress", 132, True), ("finish", 1, "fp32", 288, True)] * 2
    for (_, mine), (_, other) in zip(timed, plain):
        assert all(torch.equal(a, b) for a, b in zip(mine, other))


def test_auto_rescales_the_profile_to_the_speed_the_check_ran_at():
    from mergecomp.planning.auto.decisions import refit_profile
    profile = dataclasses.replace(hand_profile(), optimizer_step=0.5)
    # The check's forward passes took 1.5 s (median, pooled over two ranks that timed the
    # same) against the profile's 1.0 s: every processor-side time × 1.5, the network left
    # alone; live finish lines still replace.
    samples = {"launch": {}, "finish": {"fp32": [(100, 0.2), (300, 0.4)]}}
    refit = refit_profile(profile, [samples, samples], [1.4, 1.5, 1.5, 9.0] * 2, least_forwards=3,
                          compressed_local=True)
    live = refit.profile
    assert refit.forward == pytest.approx(1.5)
    assert live.forward_time == pytest.approx(1.5) and live.backward_time == pytest.approx(6.0)
    assert [t.ready for t in live.timeline] == pytest.approx([1.5, 3.0, 4.5])
    assert live.optimizer_step == pytest.approx(0.75)
    assert live.codecs["toy"].encode == LinearCost(0.1, 0.001).scaled(1.5, 1.5)
    assert live.collectives == hand_profile().collectives
    assert live.finish["fp32"](100) == pytest.approx(0.2) and live.finish["fp32"](300) == pytest.approx(0.4)
    assert set(refit.fitted["finish"]) == {"fp32"} and refit.fitted["launch"] == {}
    # Two timed forward passes (pooled over ranks), fewer than least_forwards: the profile
    # keeps its speed.
    kept = refit_profile(hand_profile(), [{"launch": {}, "finish": {}}], [2.0, 2.0], least_forwards=3,
                         compressed_local=True)
    assert kept.forward is None and kept.profile.forward_time == pytest.approx(1.0)


def test_the_refit_leaves_out_compressed_samples_of_a_communicator_whose_phases_wait():
    from mergecomp.planning.costmodel import phases_are_local
    from mergecomp.planning.auto.decisions import refit_profile
    samples = {"launch": {"compress": [(100, 0.3)], "fp32": [(100, 0.1)]},
               "finish": {"compress": [(100, 0.2), (200, 0.3)]}}
    assert phases_are_local("allgather") and phases_are_local("allreduce") and not phases_are_local("ps")
    local = refit_profile(hand_profile(), [samples], [], 3, compressed_local=True)
    assert set(local.fitted["launch"]) == {"compress", "fp32"} and set(local.fitted["finish"]) == {"compress"}
    waits = refit_profile(hand_profile(), [samples], [], 3, compressed_local=False)
    assert set(waits.fitted["launch"]) == {"fp32"} and waits.fitted["finish"] == {}
    assert "compress" not in waits.profile.finish
