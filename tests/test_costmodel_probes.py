"""Probes time what the optimizer's groups run: fused layouts, the finish of
``compress:<name>`` modes, lines that follow the large sizes."""
import dataclasses

import pytest
import torch

from mergecomp import communicators, compressors, memories
from mergecomp.plan import Plan
from mergecomp.planning.costmodel import predict, send_costs
from mergecomp.planning.measure import (measure_compression_cost, measure_finish_costs, measure_memory_cost,
                                        probe_layout)
from mergecomp.planning.profile import CodecCost, LinearCost, Profile, WireSize, fit_from_smallest, fit_linear
from mergecomp.planning.simulate import simulate
from tests.test_costmodel import hand_profile


class StubBackend:
    """What the finish phase reads from a backend: the world size."""

    def __init__(self, size):
        self.size, self.rank = size, 0


def spans_of(layout):
    return [(v.offset, v.numel) for v in layout]


def test_probe_layout_fuses_the_parameters_in_order_and_cuts_the_last():
    assert spans_of(probe_layout(10, [3, 5])) == [(0, 3), (3, 5), (8, 2)]
    assert spans_of(probe_layout(20, [3, 5])) == [(0, 3), (3, 5), (8, 3), (11, 5), (16, 3), (19, 1)]
    assert spans_of(probe_layout(2, [3, 5])) == [(0, 2)]
    assert probe_layout(10, None) is None
    with pytest.raises(ValueError, match="at least one positive parameter size"):
        probe_layout(10, [0])


class Recording(compressors.create("efsignsgd").__class__):
    """EF-SignSGD that notes how many views each payload it compresses or decodes has."""

    def __init__(self):
        super().__init__()
        self.compressed, self.decoded = [], []

    def compress(self, tensor, name, layout=None):
        self.compressed.append(1 if layout is None else len(layout))
        return super().compress(tensor, name, layout=layout)

    def decompress(self, payload, ctx):
        self.decoded.append(len(getattr(ctx, "spans", None) or ((0, ctx.numel),)))
        return super().decompress(payload, ctx)


def test_codec_and_memory_probes_compress_fused_groups_of_the_given_parameters():
    # A group of several views runs EF-SignSGD's per-view path (a scale per view, spread
    # over the elements when decoding), which a lone tensor never reaches.
    codec = Recording()
    measure_compression_cost(codec, sizes=(2 ** 10, 2 ** 12), repeats=1, views=[100, 300])
    assert set(codec.compressed) == {6, 21} and set(codec.decoded) == {6, 21}
    codec = Recording()
    measure_compression_cost(codec, sizes=(2 ** 10, 2 ** 12), repeats=1)
    assert set(codec.compressed) == {1} and set(codec.decoded) == {1}
    codec = Recording()
    measure_memory_cost(memories.create("residual"), codec, sizes=(2 ** 10, 2 ** 12), repeats=1, views=[100, 300])
    assert set(codec.compressed) == {6, 21} and set(codec.decoded) == {6, 21}  # residual = x − decode


def test_finish_of_a_compress_via_mode_is_probed_with_n_dense_decodes():
    # A job whose own communicator's finish runs collectives (PS here; hierarchical in the
    # 2-node runs) gets no "compress" line, but its flat allgather mode is probed: N = 4
    # dense decodes of fused payloads per finish.  Allreduce refuses a non-summable
    # compressor and PS is not local: neither is probed.
    codec = Recording()
    ps = communicators.create("ps", compressor=codec, memory=memories.create("none"), backend=StubBackend(4))
    costs = measure_finish_costs(ps, "efsignsgd", sizes=(2 ** 10, 2 ** 12), views=[100, 300],
                                 via=["allgather", "allreduce", "ps"])
    assert sorted(costs) == ["bf16", "compress:allgather", "fp16", "fp32"]
    # 2 sizes × (1 warm-up + 3 timed) finishes × 4 payloads, each decoded whole.
    assert len(codec.decoded) == 2 * 4 * 4 and set(codec.decoded) == {6, 21}
    assert costs["compress:allgather"](2 ** 12) > 0


def test_a_measured_compress_via_finish_prices_that_mode_and_round_trips():
    base = hand_profile(communicator="allgather", world=4)
    measured = LinearCost(0.5, 0.01)
    profile = dataclasses.replace(base, finish={"compress:allgather": measured})
    assert send_costs(profile, ["allgather"])["compress:allgather"].finish == measured
    assert send_costs(base, ["allgather"])["compress:allgather"].finish is None  # the formula
    assert Profile.from_json(profile.to_json()).finish == {"compress:allgather": measured}
    # The plan's compressed group pays the measured finish, not the codec's N decodes.
    names = [t.name for t in base.timeline]
    plan = Plan.from_dict({"groups": [{"names": names, "send": "compress:allgather"}]})
    numel = sum(t.numel for t in base.timeline)
    timing = predict(plan, profile).groups[0]
    assert timing.finish_end - timing.finish_start == pytest.approx(measured(numel))
    with pytest.raises(ValueError, match="finish costs for send modes \\['compress:'\\]"):
        dataclasses.replace(base, finish={"compress:": measured})


def test_simulator_keeps_a_compress_via_finish_only_at_the_profiled_world_size():
    base = hand_profile(communicator="allgather", world=2)
    codecs = dict(base.codecs, fp16=CodecCost(LinearCost(), LinearCost(), WireSize(2.0, 0.0)))
    profile = dataclasses.replace(base, codecs=codecs, finish={"compress:allgather": LinearCost(100.0, 0.0),
                                                               "compress": LinearCost(100.0, 0.0)})
    rows = simulate(profile, [2, 4], bandwidth=1e3, latency=0.0, topology="allgather", summable=False,
                    via=("allgather",))
    # At N = 2 a group compressed either way pays the 100 s measured finish, so the optimum
    # is raw; at N = 4 both modes are priced by the formula again.
    assert rows[0]["optimal"]["iteration_time"] < 100
    assert rows[0]["optimal"]["sends"].get("compress:allgather", 0) == 0
    assert rows[1]["optimal"]["iteration_time"] < 100


def test_fit_from_smallest_follows_the_large_sizes_and_keeps_the_small_ones_cost():
    # Cache-sized probes cost 0.2 ns/element, a group of 16M elements 2 ns/element.
    xs, ys = [2 ** 12, 2 ** 16, 2 ** 20, 2 ** 24], [3e-5, 4e-5, 2.5e-4, 3.4e-2]
    anchored, relative = fit_from_smallest(xs, ys), fit_linear(xs, ys)
    assert anchored(2 ** 24) == pytest.approx(3.4e-2, rel=0.01)
    assert relative(2 ** 24) < 3.4e-2 / 2  # what priced the flat finish far too low
    assert anchored(2 ** 12) == pytest.approx(3e-5)  # through the smallest probe
    assert fit_from_smallest([10, 20], [1.0, 0.5]) == LinearCost(1.0, 0.0)  # no negative slope
    with pytest.raises(ValueError, match="two distinct sizes"):
        fit_from_smallest([10, 10], [1.0, 2.0])
    with pytest.raises(ValueError, match="negative, infinite or NaN"):
        fit_from_smallest([10, 20], [1.0, float("nan")])


def test_the_memory_is_charged_for_the_share_it_runs_on():
    from mergecomp.planning.costmodel import group_cost
    from mergecomp.planning.profile import LinearCost, WireSize
    from mergecomp.communicators.cost import SendCost
    send = SendCost(LinearCost(), WireSize(1.0), LinearCost())
    memory, copy = LinearCost(0.0, 1.0), LinearCost()
    whole = group_cost(send, copy, 400, 1600, memory).encode
    half = group_cost(dataclasses.replace(send, memory_share=0.5), copy, 400, 1600, memory).encode
    assert whole == pytest.approx(400) and half == pytest.approx(200)
