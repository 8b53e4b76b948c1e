"""The measured terms of the cost model: interference, memory cost, link efficiency.

Timelines are computed by hand in the comments; the DP is checked against brute force
with interference, since the stretch is what could break its monotonicity.
"""
import dataclasses
import random

import pytest

from mergecomp import compressors, memories
from mergecomp.planning.costmodel import GroupCost, advance, finish_time, predict, stretch
from mergecomp.plan import Group, Plan
from mergecomp.planning.measure import measure_memory_cost
from mergecomp.planning.profile import LinearCost, Profile, interference_factor
from mergecomp.planning.optimal import OptimalScheduler
from mergecomp.planning.simulate import measured_latency, measured_link_efficiency, network_collectives
from tests.test_costmodel import hand_profile
from tests.test_optimal import brute_force, random_profile

RAW3 = Plan([Group(("a",), "fp32"), Group(("b",), "fp32"), Group(("c",), "fp32")])


def test_stretch_hand_values():
    assert stretch(1.0, 10.0, 2.0) == pytest.approx(1.0)   # all of it at half speed: 2 s
    assert stretch(1.0, 1.0, 2.0) == pytest.approx(0.5)    # 0.5 s of work in the busy second
    assert stretch(1.0, -3.0, 2.0) == 0.0                  # channel already free
    assert stretch(1.0, 10.0, 1.0) == 0.0


def test_interference_stretches_backward_while_the_channel_is_busy():
    profile = dataclasses.replace(hand_profile(), interference=2.0)
    p = predict(RAW3, profile)
    a, b, c = p.groups
    # a: ready 1, nothing on the channel: 400 B on [1.0, 1.9].
    assert (a.launch, a.comm_start, a.comm_end) == pytest.approx((1.0, 1.0, 1.9))
    # b: backward resumes at 1.0; until 1.9 at half speed (0.45 s of work), 0.55 s more: 2.45.
    assert (b.launch, b.comm_start, b.comm_end) == pytest.approx((2.45, 2.45, 3.75))
    # c: from 2.45, busy until 3.75 (0.65 s of work), 0.35 s more: 4.1; 400 B until 5.0.
    assert (c.launch, c.comm_end) == pytest.approx((4.1, 5.0))
    # tail: 1 s of work from 4.1, busy until 5.0 (0.45 s), 0.55 s more: backward ends 5.55.
    assert p.backward_end == pytest.approx(5.55)
    assert p.iteration_time == pytest.approx(1.0 + 5.55)
    assert predict(RAW3, hand_profile()).iteration_time == pytest.approx(1.0 + 4.2)


def test_interference_stretches_encoding_too():
    profile = dataclasses.replace(hand_profile(), interference=2.0)
    plan = Plan([Group(("a",), "fp32"), Group(("b",), "compress"), Group(("c",), "fp32")])
    p = predict(plan, profile)
    a, b, c = p.groups
    assert a.comm_end == pytest.approx(1.9)
    # b: hook at 2.45 as above; encode 0.1 + 0.2 = 0.3 s after the channel is free: 2.75;
    # 200 wire bytes: 0.7 s on [2.75, 3.45].
    assert (b.launch, b.encode_end, b.comm_end) == pytest.approx((2.45, 2.75, 3.45))
    # c: from 2.75, busy until 3.45 (0.35 s of work), 0.65 s more: 4.1.
    assert (c.launch, c.comm_end) == pytest.approx((4.1, 5.0))
    assert p.backward_end == pytest.approx(5.55)
    # finish: b decodes 0.2 s after backward.
    assert p.iteration_time == pytest.approx(1.0 + 5.75)
    # Encoding under a busy channel: one group of a (0.2 s of encode) while nothing runs,
    # then the same group's encode in advance() with the channel busy for 10 s.
    cost = GroupCost(encode=0.2, communicate=1.0, finish=0.0, wire_bytes=0.0)
    state, launch, encoded, _, _ = advance((0.0, 10.0, 0.0, 0.0), 1.0, cost, True, 2.0, 0.0)
    assert (launch, encoded) == pytest.approx((2.0, 2.4))  # 1 s + 0.2 s, both at half speed
    assert state[0] == pytest.approx(1.4)


def test_advance_and_finish_time_are_monotone_with_interference():
    rng = random.Random(3)
    for _ in range(2000):
        k = rng.choice([1.0, 1.3, 2.0, 5.0])
        cost = GroupCost(rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0, 1), 0.0)
        since = rng.uniform(0, 2)
        ready = since + rng.uniform(0, 2)
        state = tuple(rng.uniform(0, 5) for _ in range(4))
        bumped = list(state)
        bumped[rng.randrange(4)] += rng.uniform(0, 2)
        low = advance(state, ready, cost, True, k, since)[0]
        high = advance(tuple(bumped), ready, cost, True, k, since)[0]
        assert all(x <= y + 1e-12 for x, y in zip(low, high))
        assert finish_time(state, ready + 1, True, k, ready) <= finish_time(tuple(bumped), ready + 1, True, k, ready) + 1e-12


@pytest.mark.parametrize("seed", range(4))
def test_dp_matches_brute_force_with_interference(seed):
    rng = random.Random(100 + seed)
    profile = dataclasses.replace(random_profile(rng, 6), interference=rng.choice([1.2, 1.7, 3.0]),
                                  memory=LinearCost(1e-5, 2e-10))
    solution = OptimalScheduler(profile, max_states=None).solve()
    assert solution.exact
    assert solution.iteration_time == pytest.approx(brute_force(profile, ("fp32", "compress"), True), rel=1e-12)
    assert predict(solution.plan, profile).iteration_time == pytest.approx(solution.iteration_time, rel=1e-12)


def test_interference_is_refused_off_compute():
    profile = dataclasses.replace(hand_profile(), interference=1.5)
    with pytest.raises(ValueError, match="compression on compute only"):
        predict(RAW3, profile, compression_on_compute=False)
    with pytest.raises(ValueError, match="compression on compute only"):
        OptimalScheduler(profile, compression_on_compute=False)


def test_memory_cost_is_paid_by_every_group_in_its_hook():
    profile = dataclasses.replace(hand_profile(), memory=LinearCost(0.05, 0.001))
    # a: 0.05 + 0.1 = 0.15 s of memory work, on compute: its collective starts at 1.15.
    p = predict(RAW3, profile)
    assert p.groups[0].encode_end == pytest.approx(1.15)
    # a on [1.15, 2.05]; b: hook 2.15, 0.25 s of memory work, [2.4, 3.7]; c: hook 3.4,
    # encoded 3.55, waits for the channel: [3.7, 4.6].  Backward ends 0.55 s late, at 4.55.
    assert p.groups[2].comm_end == pytest.approx(4.6)
    assert p.backward_end == pytest.approx(4.55)
    assert p.iteration_time == pytest.approx(1.0 + 4.6)


def test_profile_round_trip_of_the_new_terms_and_old_profiles():
    profile = dataclasses.replace(hand_profile(), interference=1.25, memory=LinearCost(1e-4, 2e-9))
    again = Profile.from_json(profile.to_json())
    assert (again.interference, again.memory) == (1.25, LinearCost(1e-4, 2e-9))
    old = profile.to_dict()
    del old["interference"], old["memory"]
    loaded = Profile.from_dict(old)
    assert (loaded.interference, loaded.memory) == (1.0, LinearCost())
    for bad in (0.5, float("inf"), True):
        with pytest.raises(ValueError, match="interference must be a finite factor"):
            dataclasses.replace(profile, interference=bad)


def test_interference_factor_is_the_ratio_of_medians_at_least_one():
    assert interference_factor([1.0, 2.0, 1.1], [1.5, 1.6, 9.0]) == pytest.approx(1.6 / 1.1)
    assert interference_factor([1.0], [0.9]) == 1.0
    with pytest.raises(ValueError, match="with and without"):
        interference_factor([1.0], [])
    with pytest.raises(ValueError, match="> 0"):
        interference_factor([0.0], [1.0])


def test_measure_memory_cost_leaves_the_jobs_memory_alone():
    memory = memories.create("residual")
    compressor = compressors.create("topk", compress_ratio=0.01)
    before = memory.state_dict()
    cost = measure_memory_cost(memory, compressor, sizes=(2 ** 10, 2 ** 14), repeats=1)
    assert cost.intercept + cost.slope * 2 ** 14 > 0
    assert memory.state_dict().keys() == before.keys()
    # no memory does no work: a timing, so only a bound a descheduled probe still meets
    assert measure_memory_cost(memories.create("none"), compressor, sizes=(2 ** 10, 2 ** 14),
                               repeats=3)(2 ** 14) < 0.05


def test_link_efficiency_scales_the_bandwidth():
    full = network_collectives(4, 1e8, 0.0)
    half = network_collectives(4, 1e8, 0.0, efficiency=0.5)
    assert half["allreduce"].slope == pytest.approx(2 * full["allreduce"].slope)
    with pytest.raises(ValueError, match="link efficiency"):
        network_collectives(4, 1e8, 0.0, efficiency=1.5)
    # hand profile: 2 workers, allreduce 1 ms/byte; a 1000 B/s link's line rate is 1 ms/byte.
    assert measured_link_efficiency(hand_profile(), 1000.0) == pytest.approx(1.0)
    assert measured_link_efficiency(hand_profile(), 2000.0) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="at least 2 workers"):
        measured_link_efficiency(dataclasses.replace(hand_profile(), world_size=1), 1000.0)


def test_the_latency_of_a_profile_is_its_allreduce_intercept_per_ring_step():
    profile = dataclasses.replace(hand_profile(), world_size=4,
                                  collectives={"allreduce": LinearCost(0.012, 1e-3)})
    assert measured_latency(profile) == pytest.approx(0.012 / 6)
    assert network_collectives(4, 1e3, measured_latency(profile))["allreduce"].intercept == pytest.approx(0.012)
    with pytest.raises(ValueError, match="no measured allreduce"):
        measured_latency(dataclasses.replace(profile, collectives={}))
    with pytest.raises(ValueError, match="at least 2 workers"):
        measured_latency(dataclasses.replace(profile, world_size=1))
