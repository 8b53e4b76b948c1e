"""Cost model and profile: hand-computed timelines, plain-data round trips, real measurements."""
import pytest
import torch

from mergecomp import compressors
from mergecomp.planning.costmodel import predict, send_costs
from mergecomp.plan import Group, Plan
from mergecomp.planning.measure import measure_collective_cost, measure_compression_cost, measure_copy_cost
from mergecomp.planning.timeline import BackwardTimer
from mergecomp.planning.profile import CodecCost, LinearCost, Profile, TensorTiming, WireSize, fit_linear
from tests.distributed import run_ranks


def tensor(name, numel, ready):
    return TensorTiming(name, numel, numel * 4, "torch.float32", "cpu", ready)


def hand_profile(copy=LinearCost(), communicator="allreduce", world=2):
    """a, b, c ready at 1, 2, 3 s; backward 4 s, forward 1 s; allreduce 0.5 s + 1 ms/byte."""
    return Profile(
        world_size=world, timeline=[tensor("a", 100, 1.0), tensor("b", 200, 2.0), tensor("c", 100, 3.0)],
        forward_time=1.0, backward_time=4.0, compressor="toy", communicator=communicator,
        codecs={"toy": CodecCost(LinearCost(0.1, 0.001), LinearCost(0.2, 0.0), WireSize(1.0, 0.0))},
        collectives={"allreduce": LinearCost(0.5, 0.001), "allgather": LinearCost(0.3, 0.002),
                     "alltoall": LinearCost(0.1, 0.001)},
        copy=copy)


MIXED = Plan([Group(("a",), "compress"), Group(("b", "c"), "fp32")])


def test_two_groups_compression_on_compute_delays_backward():
    p = predict(MIXED, hand_profile())
    first, second = p.groups
    # a: launch 1.0, encode 0.1 + 0.1 = 0.2, 100 wire bytes: 0.5 + 0.1 = 0.6 s on the channel.
    assert (first.launch, first.encode_end, first.comm_start, first.comm_end) == pytest.approx((1.0, 1.2, 1.2, 1.8))
    # b, c: ready at 3.0 + 0.2 delay; 1200 raw bytes: 0.5 + 1.2 = 1.7 s.
    assert (second.launch, second.comm_start, second.comm_end) == pytest.approx((3.2, 3.2, 4.9))
    assert p.backward_end == pytest.approx(4.2)
    # finish loop: a from 4.2 (decode 0.2) to 4.4, then b, c wait for 4.9.
    assert (first.finish_start, first.finish_end) == pytest.approx((4.2, 4.4))
    assert second.finish_end == pytest.approx(4.9)
    assert p.iteration_time == pytest.approx(5.9)


def test_two_groups_compression_off_compute():
    p = predict(MIXED, hand_profile(), compression_on_compute=False)
    assert p.backward_end == pytest.approx(4.0)
    assert p.groups[1].comm_end == pytest.approx(4.7)
    assert p.groups[0].finish_end == pytest.approx(4.2)
    assert p.iteration_time == pytest.approx(5.7)


def test_a_launch_that_waits_for_its_first_phase_holds_backward():
    """The sparse allreduce's and the PS's ``start`` waits for an all-to-all: the launch
    waits for the channel, then for that phase, and backward waits with it."""
    from mergecomp.communicators.cost import SendCost
    raw = SendCost(LinearCost(), WireSize(), LinearCost(0.5, 0.003))
    two_phase = SendCost(LinearCost(), WireSize(1.0), LinearCost(0.4, 0.001), blocking=LinearCost(0.1, 0.001))
    plan = Plan([Group(("a",), "fp32"), Group(("b",), "compress"), Group(("c",), "fp32")])
    held = predict(plan, hand_profile(), costs={"fp32": raw, "compress": two_phase})
    a, b, c = held.groups
    # a: 400 raw bytes from 1.0: 0.5 + 1.2 s → 2.7.  b (200 bytes) ready at 2.0 waits for the
    # channel (2.7), then its first phase (0.1 + 0.2 s) → 3.0: backward is 1.0 s late; the
    # rest, 0.6 − 0.3 s, ends at 3.3.  c ready at 3.0 + 1.0, on the channel to 5.7.
    assert (b.comm_start, b.comm_end) == pytest.approx((2.7, 3.3))
    assert (c.launch, c.comm_start, c.comm_end) == pytest.approx((4.0, 4.0, 5.7))
    assert held.backward_end == pytest.approx(5.0)
    assert held.iteration_time == pytest.approx(6.7)
    free = dict(two_phase.__dict__, blocking=None)
    started = predict(plan, hand_profile(), costs={"fp32": raw, "compress": SendCost(**free)})
    assert started.backward_end == pytest.approx(4.0) and started.iteration_time == pytest.approx(6.0)
    off = predict(plan, hand_profile(), costs={"fp32": raw, "compress": two_phase}, compression_on_compute=False)
    assert off.backward_end == pytest.approx(4.0)  # the compression worker waits, not backward
    assert off.groups[1].comm_end == pytest.approx(3.3)


def test_the_sparse_allreduce_and_the_ps_launch_wait_for_their_all_to_all():
    for name in ("sparse_allreduce", "ps"):
        profile = hand_profile(communicator=name, world=4)
        cost = send_costs(profile)["compress"]
        assert cost.blocking == profile.collectives["alltoall"]
    assert send_costs(hand_profile(communicator="allgather"))["compress"].blocking is None


def test_three_groups_queue_on_one_channel():
    plan = Plan([Group(("a",), "fp32"), Group(("b",), "fp32"), Group(("c",), "fp32")])
    p = predict(plan, hand_profile())
    # pytest.approx compares flat sequences (nested ones are refused by newer pytest)
    assert [t for g in p.groups for t in (g.comm_start, g.comm_end)] == pytest.approx([1.0, 1.9, 2.0, 3.3, 3.3, 4.2])
    assert p.iteration_time == pytest.approx(1.0 + 4.2)


def test_copy_cost_in_gather_and_write_back():
    plan = Plan([Group(("a", "b", "c"), "fp32")])
    p = predict(plan, hand_profile(copy=LinearCost(0.0, 1e-4)))
    # gather 1600 B: 0.16 s on compute; comm 0.5 + 1.6; finish: average + write-back 2 × 0.16.
    assert p.groups[0].comm_end == pytest.approx(3.16 + 2.1)
    assert p.backward_end == pytest.approx(4.16)
    assert p.iteration_time == pytest.approx(1.0 + 3.16 + 2.1 + 0.32)


def test_allgather_decodes_every_payload_and_ps_adds_phases():
    gather = send_costs(hand_profile(communicator="allgather", world=4))["compress"]
    assert gather.collective == LinearCost(0.3, 0.002)
    assert gather.decode == LinearCost(0.8, 0.0)
    # aggregate() copies the first decoded payload, then adds the other N - 1: 4 passes.
    assert gather.aggregate_passes == 4
    ps = send_costs(hand_profile(communicator="ps", world=4))["compress"]
    assert ps.collective.intercept == pytest.approx(0.4)
    assert ps.collective.slope == pytest.approx(0.001 + 0.002 / 4)


def test_predict_errors_name_the_problem():
    with pytest.raises(ValueError, match="missing parameters"):
        predict(Plan([Group(("a",), "fp32")]), hand_profile())
    with pytest.raises(ValueError, match="'fp16'.*cannot price"):
        predict(Plan([Group(("a", "b", "c"), "fp16")]), hand_profile())
    profile = hand_profile()
    profile.collectives = {}
    with pytest.raises(ValueError, match="no 'allreduce' cost"):
        send_costs(profile)


def test_profile_json_round_trip_and_errors(tmp_path):
    profile = hand_profile()
    path = str(tmp_path / "profile.json")
    profile.save(path)
    assert Profile.load(path) == profile
    with pytest.raises(ValueError, match="not a mergecomp profile"):
        Profile.from_json('{"groups": []}')
    with pytest.raises(ValueError, match="cannot read profile"):
        Profile.load(str(tmp_path / "absent.json"))
    with pytest.raises(ValueError, match="earlier than the last"):
        Profile(2, [tensor("a", 1, 2.0)], 0.0, 1.0)
    with pytest.raises(ValueError, match="≥ 0 seconds"):
        LinearCost(-1.0, 0.0)


def test_fit_linear():
    line = fit_linear([1, 2, 3], [3, 5, 7])
    assert (line.intercept, line.slope) == pytest.approx((1.0, 2.0))
    assert fit_linear([1, 2], [2, 1]).slope == 0.0  # noise cannot make bigger cheaper
    assert fit_linear([10, 20], [1, 3]).intercept == 0.0  # nor a negative intercept
    with pytest.raises(ValueError, match="two distinct sizes"):
        fit_linear([4, 4], [1, 1])


def test_measured_codec_wire_sizes_and_copy():
    fp16 = measure_compression_cost(compressors.create("fp16"), sizes=(256, 4096), repeats=2)
    assert fp16.wire.per_element == pytest.approx(2.0) and fp16.wire.header == pytest.approx(0.0, abs=1e-6)
    topk = measure_compression_cost(compressors.create("topk", compress_ratio=0.25), sizes=(400, 4000), repeats=2)
    assert topk.wire(4000, 4) == pytest.approx(1000 * 2 + 16 + 4)  # 2 bytes a value, 16 block counts of a byte, the scale
    copy = measure_copy_cost(sizes=(1024, 65536), repeats=2)  # a timing: only its shape is certain
    assert copy.intercept >= 0 and copy.slope >= 0 and copy(65536) > 0


def test_backward_timer_records_backward_order():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    timer = BackwardTimer(model.named_parameters(), iterations=2, warmup=1)
    while not timer.done:
        with timer.forward():
            loss = model(torch.randn(4, 8)).square().sum()
        with timer.backward():
            loss.backward()
    timeline, forward, backward = timer.result()
    timer.remove()
    assert {t.name for t in timeline[:2]} == {"2.weight", "2.bias"}
    assert {t.name for t in timeline[2:]} == {"0.weight", "0.bias"}
    assert all(0 <= t.ready <= backward for t in timeline) and forward > 0
    Profile(1, timeline, forward, backward)  # a valid profile timeline


def _collective_probe(rank, world):
    from mergecomp.distributed.backends import default_backend
    backend = default_backend()
    costs = {kind: measure_collective_cost(backend, kind, sizes=(1024, 65536), repeats=2)
             for kind in ("allreduce", "allgather", "alltoall")}
    probed = (backend.bytes_sent, backend.wire_bytes, backend.collectives)
    with backend.uncounted():
        backend.allreduce_async([torch.ones(8)]).wait()
    backend.allreduce_async([torch.ones(4)]).wait()  # counted
    return {k: (v.intercept, v.slope) for k, v in costs.items()}, probed, \
        (backend.bytes_sent, backend.wire_bytes, backend.collectives)


def test_collective_costs_agree_on_every_rank():
    results = run_ranks(_collective_probe, 2)
    assert results[0][0] == results[1][0]  # max over ranks: the same fit everywhere
    assert all(a >= 0 and b >= 0 for a, b in results[0][0].values())
    # Probes (and anything inside backend.uncounted()) do not count as training traffic.
    assert results[0][1] == (0, 0, 0)
    assert results[0][2] == (16, 16, 1)  # 4 floats; a ring allreduce of 2 ranks sends them once
