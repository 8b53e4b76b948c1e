"""The measured finish phase and optimizer step: hand timelines, probes, DP exactness."""
import dataclasses
import random

import pytest

from mergecomp import communicators, compressors, memories
from mergecomp.planning.costmodel import predict, send_costs
from mergecomp.planning.measure import measure_finish_cost, measure_finish_costs
from mergecomp.planning.profile import CodecCost, LinearCost, Profile, WireSize, fit_linear
from mergecomp.planning.optimal import OptimalScheduler
from mergecomp.planning.simulate import simulate
from tests.test_costmodel import MIXED, hand_profile
from tests.test_optimal import brute_force, random_profile


class StubBackend:
    """What the finish phase reads from a backend: the world size."""

    def __init__(self, size):
        self.size, self.rank = size, 0


def test_measured_finish_replaces_the_formula_and_the_step_is_added():
    # MIXED on hand_profile: a compressed, launched at 1.0, on the channel [1.2, 1.8];
    # b, c raw, hook at 3.2, on the channel [3.2, 4.9]; backward ends at 4.2.
    profile = dataclasses.replace(hand_profile(), optimizer_step=0.25,
                                  finish={"compress": LinearCost(0.1, 0.002), "fp32": LinearCost(0.05, 0.0)})
    p = predict(MIXED, profile)
    first, second = p.groups
    assert p.backward_end == pytest.approx(4.2)
    # a: measured finish 0.1 + 0.002·100 = 0.3 s from 4.2 (the codec's decode, 0.2 s, is unused).
    assert (first.finish_start, first.finish_end) == pytest.approx((4.2, 4.5))
    # b, c: wait for their collective until 4.9, then 0.05 s.
    assert (second.finish_start, second.finish_end) == pytest.approx((4.9, 4.95))
    # forward 1.0 + 4.95 + the wrapped optimizer's step 0.25.
    assert p.iteration_time == pytest.approx(1.0 + 4.95 + 0.25)
    assert p.optimizer_step == 0.25
    # Without the measured terms the formula prices a's finish at its decode, 0.2 s: 4.4,
    # and b, c at 2 copies of 0 s: 4.9.
    assert predict(MIXED, hand_profile()).iteration_time == pytest.approx(1.0 + 4.9)


def test_a_slow_finish_delays_later_groups_past_their_collective():
    # a's finish takes 1.0 s (from 4.2 to 5.2), so b, c, done on the channel at 4.9, start
    # finishing at 5.2, not 4.9.
    profile = dataclasses.replace(hand_profile(), finish={"compress": LinearCost(1.0, 0.0),
                                                          "fp32": LinearCost(0.1, 0.0)})
    p = predict(MIXED, profile)
    assert [g.finish_end for g in p.groups] == pytest.approx([5.2, 5.3])
    assert p.iteration_time == pytest.approx(6.3)


def test_send_costs_take_the_measured_finish_per_send_mode():
    profile = dataclasses.replace(hand_profile(communicator="allgather", world=3),
                                  finish={"compress": LinearCost(0.3, 0.0)})
    costs = send_costs(profile)
    assert costs["compress"].finish == LinearCost(0.3, 0.0)
    assert costs["fp32"].finish is None  # no measurement: formula
    # The formula for allgather at N = 3: 3 decodes (0.6 s) + (3 aggregate + 2) copies.
    formula = send_costs(hand_profile(communicator="allgather", world=3, copy=LinearCost(0.0, 1e-4)))
    assert formula["compress"].decode.intercept == pytest.approx(0.6)
    assert formula["compress"].aggregate_passes == 3


@pytest.mark.parametrize("seed", range(4))
def test_dp_matches_brute_force_with_measured_finish_and_step(seed):
    rng = random.Random(200 + seed)
    profile = dataclasses.replace(
        random_profile(rng, 6), interference=rng.choice([1.0, 1.5]), optimizer_step=rng.uniform(0, 1e-3),
        finish={"compress": LinearCost(rng.uniform(0, 2e-4), rng.choice([1e-10, 3e-9, 2e-8])),
                "fp32": LinearCost(rng.uniform(0, 5e-5), rng.choice([1e-10, 1e-9]))})
    solution = OptimalScheduler(profile, max_states=None).solve()
    assert solution.exact
    assert solution.iteration_time == pytest.approx(brute_force(profile, ("fp32", "compress"), True), rel=1e-12)
    assert predict(solution.plan, profile).iteration_time == pytest.approx(solution.iteration_time, rel=1e-12)


def test_profile_round_trip_of_finish_and_step_and_old_profiles():
    profile = dataclasses.replace(hand_profile(), optimizer_step=0.012,
                                  finish={"compress": LinearCost(1e-4, 2e-8), "fp32": LinearCost(0.0, 1e-9)})
    again = Profile.from_json(profile.to_json())
    assert (again.optimizer_step, again.finish) == (0.012, profile.finish)
    old = profile.to_dict()
    del old["optimizer_step"], old["finish"]
    loaded = Profile.from_dict(old)
    assert (loaded.optimizer_step, loaded.finish) == (0.0, {})
    for bad in (-1.0, float("inf"), True):
        with pytest.raises(ValueError, match="optimizer_step must be a finite number"):
            dataclasses.replace(profile, optimizer_step=bad)
    with pytest.raises(ValueError, match="finish costs for send modes \\['lz4'\\]"):
        dataclasses.replace(profile, finish={"lz4": LinearCost()})
    broken = profile.to_dict()
    broken["finish"] = {"compress": {"intercept": 1.0}}
    with pytest.raises(ValueError, match="finish.compress"):
        Profile.from_dict(broken)


def test_absolute_fit_follows_the_large_sizes():
    xs, ys = [1e3, 1e6, 1e7], [1e-5, 2e-3, 4e-2]  # 2 ns/element at 1M, 4 ns/element at 10M
    relative, absolute = fit_linear(xs, ys), fit_linear(xs, ys, relative=False)
    assert abs(absolute(1e7) - 4e-2) < abs(relative(1e7) - 4e-2)
    assert absolute(1e7) == pytest.approx(4e-2, rel=0.02)


def test_finish_probe_runs_the_communicators_code(monkeypatch):
    compressor = compressors.create("topk", compress_ratio=0.01)
    gather = communicators.create("allgather", compressor=compressor, memory=memories.create("none"),
                                  backend=StubBackend(3))
    calls = []
    decompress_sum = compressor.decompress_sum
    monkeypatch.setattr(compressor, "decompress_sum",
                        lambda payloads, ctx: calls.append(len(payloads)) or decompress_sum(payloads, ctx))
    cost = measure_finish_cost(gather, sizes=(2 ** 10, 2 ** 14), repeats=2)
    # 2 sizes × (1 warm-up + 2 timed) finishes, each summing 3 payloads.
    assert calls == [3] * (2 * 3)
    assert cost.intercept >= 0 and cost.slope >= 0 and cost(2 ** 14) > 0
    costs = measure_finish_costs(gather, "topk", sizes=(2 ** 10, 2 ** 12))
    assert sorted(costs) == ["bf16", "compress", "fp16", "fp32"]


def test_finish_probe_refuses_what_it_cannot_run_locally():
    ps = communicators.create("ps", compressor=compressors.create("topk", compress_ratio=0.01),
                              memory=memories.create("none"), backend=StubBackend(2))
    with pytest.raises(ValueError, match="'ps' runs collectives in its finish phase"):
        measure_finish_cost(ps, sizes=(2 ** 10, 2 ** 12))
    rounds = communicators.create("allreduce", compressor=compressors.create("powersgd"),
                                  memory=memories.create("none"), backend=StubBackend(2))
    with pytest.raises(ValueError, match="multi-round"):
        measure_finish_cost(rounds, sizes=(2 ** 10, 2 ** 12))
    assert "compress" not in measure_finish_costs(ps, "topk", sizes=(2 ** 10, 2 ** 12))


def test_simulator_keeps_the_measured_compressed_finish_only_at_the_profiled_world_size():
    base = hand_profile(communicator="allgather", world=2)
    codecs = dict(base.codecs, fp16=CodecCost(LinearCost(), LinearCost(), WireSize(2.0, 0.0)))
    profile = dataclasses.replace(base, codecs=codecs, optimizer_step=0.5,
                                  finish={"compress": LinearCost(100.0, 0.0), "fp32": LinearCost(0.0, 0.0)})
    rows = simulate(profile, [2, 4], bandwidth=1e3, latency=0.0, topology="allgather", summable=False)
    # At N = 2 every group pays the 100 s measured finish if compressed, so the optimum is raw;
    # at N = 4 compressed groups are priced by the formula again.
    assert rows[0]["optimal"]["sends"]["compress"] == 0
    assert rows[1]["optimal"]["iteration_time"] < 100
    assert all(row["fp32"]["iteration_time"] > 0.5 for row in rows)  # the step is paid
