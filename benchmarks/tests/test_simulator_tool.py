"""benchmarks/simulator.py: its rounds' calibration and its plan specs."""
import pytest

from mergecomp.planning.profile import CodecCost, LinearCost, Profile, TensorTiming, WireSize
from tests.test_simulate import one_tensor_profile


def test_simulator_check_calibrates_with_the_window_forward_time():
    from benchmarks.simulator import window_compute_factor
    phases = [[{"forward": 0.030}, {"forward": 0.040}, {"forward": 0.050}],  # rank 0: median 40 ms
              [{"forward": 0.060}, {"forward": 0.060}]]                       # rank 1: median 60 ms
    assert window_compute_factor(one_tensor_profile(), phases) == pytest.approx(0.050 / 0.025)
    with pytest.raises(ValueError, match="--phases"):
        window_compute_factor(one_tensor_profile(), [])


def test_a_rounds_compute_is_the_median_ranks_and_scales_the_codecs():
    from benchmarks.simulator import round_profile
    timeline = [TensorTiming("b", 10, 40, "torch.float32", "cpu", 0.0),
                TensorTiming("a", 10, 40, "torch.float32", "cpu", 0.05)]
    toy = CodecCost(LinearCost(1e-3, 1e-9), LinearCost(2e-3, 1e-9), WireSize(0.1, 0))
    profile = Profile(2, timeline, forward_time=0.02, backward_time=0.05, compressor="topk",
                      codecs={"topk": toy}, optimizer_step=0.004)
    # In seconds from each step's start; backward spans 0.10, 0.06 and 0.14 s: the median
    # rank's is twice the profile's 0.05 s.
    ranks = [{"ready": {"b": 0.03, "a": 0.13}, "optimizer_step": 0.005},
             {"ready": {"b": 0.04, "a": 0.10}, "optimizer_step": 0.007},
             {"ready": {"b": 0.02, "a": 0.16}, "optimizer_step": 0.009}]
    round_ = round_profile(profile, ranks)
    assert round_.forward_time == pytest.approx(0.03)  # the median rank's first gradient
    assert [(t.name, t.ready) for t in round_.timeline] == [("b", 0.0), ("a", pytest.approx(0.10))]
    assert round_.backward_time == pytest.approx(0.10) and round_.optimizer_step == 0.007
    assert round_.codecs["topk"].encode.intercept == pytest.approx(2e-3)  # the median rank ran at half speed
    assert round_.codecs["topk"].decode.slope == pytest.approx(2e-9)
    assert round_.collectives == profile.collectives  # the network is not the processor's


def test_simulator_plans_name_a_communicator():
    from benchmarks.simulator import fixed_plan, parse_plans
    from mergecomp.plan import ParamInfo
    specs = parse_plans("auto,fp32-2,compress:allgather-2,compress-1")
    assert specs[2] == ("compress:allgather-2", "compress:allgather", 2)
    for bad in ("compress:nothing-2", "compress:allgather-0", "topk-2"):
        with pytest.raises(ValueError, match="SEND-K"):
            parse_plans(bad)
    params = [ParamInfo(name, 1000) for name in ("a", "b", "c", "d")]
    plan = fixed_plan(params, 2, "compress:allgather")
    assert len(plan) == 2 and {g.send for g in plan.groups} == {"compress:allgather"}
    assert [g.names for g in plan.groups] == [g.names for g in fixed_plan(params, 2, "compress").groups]
