"""Large tensors sent in pieces: plan slices, the optimizer, state regrouping, cost model and DP."""
import random

import pytest
import torch
import torch.nn as nn

import mergecomp
from mergecomp import schedulers
from mergecomp.planning.costmodel import predict
from mergecomp.plan import Group, Plan
from mergecomp.planning.profile import CodecCost, LinearCost, Profile, TensorTiming, WireSize
from mergecomp.runtime.regroup import regroup_tensors
from mergecomp.planning.optimal import OptimalScheduler
from tests.distributed import run_ranks
from tests.test_optimal import brute_force, random_profile
from tests.test_optimizer import batch, make_model, make_optimizer, reference_params

NUMELS = {"a": 10, "b": 4}


# ----------------------------------------------------------------------------- the plan
def test_slices_tile_their_parameter_or_the_plan_says_where_not():
    good = Plan([Group(("a",), slices=((0, 6),)), Group(("a", "b"), "fp32", ((6, 10), None))])
    good.validate(["a", "b"], NUMELS)
    assert good.order() == ["a", "b"]
    assert good.pieces(NUMELS) == [[("a", 0, 6)], [("a", 6, 10), ("b", 0, 4)]]
    cases = [
        (Plan([Group(("a",), slices=((0, 6),)), Group(("a", "b"), slices=((7, 10), None))]), "a gap at element 6"),
        (Plan([Group(("a",), slices=((0, 6),)), Group(("a", "b"), slices=((5, 10), None))]), "an overlap at element 5"),
        (Plan([Group(("a",), slices=((0, 6),)), Group(("a", "b"), slices=((6, 9), None))]), "they end at 9"),
        (Plan([Group(("a",)), Group(("a", "b"), slices=((6, 10), None))]), "whole in group 0 and a slice"),
    ]
    for plan, message in cases:
        with pytest.raises(ValueError, match=message):
            plan.validate(["a", "b"], NUMELS)
    with pytest.raises(ValueError, match="needs their sizes"):
        good.validate(["a", "b"])
    with pytest.raises(ValueError, match="0 ≤ start < stop"):
        Group(("a",), slices=((4, 4),))
    with pytest.raises(ValueError, match="one entry per name"):
        Group(("a", "b"), slices=((0, 4),))
    with pytest.raises(ValueError, match="at most once"):
        Group(("a", "a"))


def test_sliced_plans_round_trip_and_whole_plans_keep_their_digests():
    sliced = Plan([Group(("a",), slices=((0, 6),)), Group(("a", "b"), "fp32", ((6, 10), None))])
    assert Plan.from_json(sliced.to_json()) == sliced
    assert Plan.from_json(sliced.to_json()).digest() == sliced.digest()
    whole = Plan([Group(("a", "b"))])
    assert "slices" not in whole.to_json()
    assert Group(("a", "b"), slices=(None, None)) == Group(("a", "b"))  # one canonical form
    assert "a[0:6]" in sliced.describe([mergecomp.ParamInfo("a", 10), mergecomp.ParamInfo("b", 4)])


def test_state_follows_elements_into_differently_cut_groups():
    old = {"group0": [("a", 0, 10), ("b", 0, 4)]}
    new = {"group0": [("a", 0, 3)], "group1": [("a", 3, 10), ("b", 0, 1)], "group2": [("b", 1, 4)]}
    state = {"group0": torch.arange(14.0)}
    moved = regroup_tensors(state, old, new)
    assert torch.equal(torch.cat([moved[g] for g in ("group0", "group1", "group2")]), torch.arange(14.0))
    back = regroup_tensors(moved, new, old)
    assert torch.equal(back["group0"], torch.arange(14.0))
    # A parameter with state in only one of its old pieces: zeros for the rest.
    partial = regroup_tensors({"group1": moved["group1"]}, new, old)
    assert torch.equal(partial["group0"], torch.tensor([0, 0, 0, 3, 4, 5, 6, 7, 8, 9, 10, 0, 0, 0.0]))


# ---------------------------------------------------------------------- cost model and DP
def chunk_profile(encode_slope=2e-6, latency=1e-5):
    """One large tensor at the end of backward whose compression, transfer and decoding each
    take 20 ms: in pieces, the next piece is compressed while the first one travels and the
    first is decoded while the next one travels."""
    timeline = [TensorTiming("small", 100, 400, "torch.float32", "cpu", 0.001),
                TensorTiming("big", 10_000, 40_000, "torch.float32", "cpu", 0.002)]
    return Profile(2, timeline, 0.001, 0.002, compressor="toy", communicator="allgather",
                   codecs={"toy": CodecCost(LinearCost(1e-5, encode_slope), LinearCost(1e-5, encode_slope),
                                            WireSize(1.0, 0))},
                   collectives={"allreduce": LinearCost(latency, 2e-6), "allgather": LinearCost(latency, 2e-6)})


def test_a_sliced_plan_is_priced_like_its_pieces_as_tensors():
    profile = chunk_profile()
    plan = Plan([Group(("small", "big"), slices=(None, (0, 4000))), Group(("big",), "fp32", ((4000, 10_000),))])
    pieces = Profile(2, [profile.timeline[0],
                         TensorTiming("big0", 4000, 16_000, "torch.float32", "cpu", 0.002),
                         TensorTiming("big1", 6000, 24_000, "torch.float32", "cpu", 0.002)],
                     0.001, 0.002, compressor="toy", communicator="allgather",
                     codecs=profile.codecs, collectives=profile.collectives)
    as_tensors = Plan([Group(("small", "big0")), Group(("big1",), "fp32")])
    assert predict(plan, profile).iteration_time == pytest.approx(predict(as_tensors, pieces).iteration_time,
                                                                  rel=1e-12)


def test_the_dp_sends_a_large_tensor_in_pieces_when_that_pays_and_whole_when_not():
    profile = chunk_profile()
    whole = OptimalScheduler(profile).solve()
    chunked = OptimalScheduler(profile, chunk_mb=8000 / 2 ** 20).solve()  # 5 chunks of `big`
    assert all(g.slices is None for g in whole.plan.groups)
    assert sum(g.slices is not None for g in chunked.plan.groups) >= 2
    assert chunked.iteration_time < 0.9 * whole.iteration_time
    assert predict(chunked.plan, profile).iteration_time == pytest.approx(chunked.iteration_time, rel=1e-12)
    chunked.plan.validate(["small", "big"], {"small": 100, "big": 10_000})
    # A collective that costs 50 ms to start: one piece is best, and the plan says so.
    costly = chunk_profile(latency=0.05)
    plan = OptimalScheduler(costly, chunk_mb=8000 / 2 ** 20).solve().plan
    assert all(g.slices is None for g in plan.groups)


@pytest.mark.parametrize("seed", range(4))
def test_the_chunked_dp_matches_brute_force_over_its_pieces(seed):
    rng = random.Random(seed)
    profile = random_profile(rng, 3)
    chunk_mb = max(t.nbytes for t in profile.timeline) / 2.5 / 2 ** 20  # the largest in 3 chunks
    scheduler = OptimalScheduler(profile, chunk_mb=chunk_mb, max_states=None)
    timeline, _ = scheduler._chunked_timeline()
    assert 5 <= len(timeline) <= 9
    pieces = Profile(profile.world_size, timeline, profile.forward_time, profile.backward_time,
                     compressor="toy", communicator=profile.communicator, codecs=profile.codecs,
                     collectives=profile.collectives, copy=profile.copy)
    solution = scheduler.solve()
    assert solution.exact
    assert solution.iteration_time == pytest.approx(brute_force(pieces, ("fp32", "compress"), True), rel=1e-12)
    assert predict(solution.plan, profile).iteration_time == pytest.approx(solution.iteration_time, rel=1e-12)


def test_chunk_size_errors_say_what_to_do():
    with pytest.raises(ValueError, match="chunk_mb must be a size in MB > 0"):
        OptimalScheduler(chunk_profile(), chunk_mb=0)
    with pytest.raises(ValueError, match="more than the DP takes"):
        OptimalScheduler(chunk_profile(), chunk_mb=1 / 2 ** 20)
    with pytest.raises(ValueError, match="auto scheduler chunk_mb"):
        schedulers.create("auto", chunk_mb=-1)


def test_auto_offers_the_dp_plans_with_pieces():
    from mergecomp.planning.auto.phase import Findings
    from mergecomp.planning.auto.planning import plan_candidates
    from mergecomp.planning.auto.settings import AutoSettings
    from mergecomp.planning.auto import describe_findings
    found = plan_candidates(chunk_profile(), AutoSettings(chunk_mb=8000 / 2 ** 20), print)
    candidates = {label: plan for label, plan, _ in found}
    assert any(g.slices is not None for g in candidates["optimal"].groups)
    assert all(g.slices is None for g in candidates["fusion-num 1"].groups)
    report = describe_findings(Findings(report=[(label, plan, predicted, 0.05) for label, plan, predicted in found]),
                               steps=0).splitlines()
    assert "with pieces of tensors" in next(line for line in report if "optimal" in line)
    assert "pieces" not in next(line for line in report if "fusion-num 1" in line)
    assert "  1 group  (1 compressed)" in next(line for line in report if "fusion-num 1" in line)


# ------------------------------------------------------------------------- the optimizer
def wide_first_layer(seed=0):
    """Its largest tensor, the first layer's weight (256 elements), is the last one ready."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 8), nn.Tanh(), nn.Linear(8, 3))


def wide_batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 32, generator=g), torch.randn(4, 3, generator=g)


def priced_profile(model):
    """The model's tensors in backward order (ready 1 ms apart), priced so that the last
    one's encoding, transfer and decoding take about as long as each other: pieces pay.
    (The priced codec is a stand-in; the job sends through the exact ``none`` compressor,
    so training must match one process.)"""
    names = [n for n, _ in model.named_parameters()][::-1]
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    timeline = [TensorTiming(n, sizes[n], 4 * sizes[n], "torch.float32", "cpu", 1e-3 * (k + 1))
                for k, n in enumerate(names)]
    return Profile(2, timeline, 1e-3, 1e-3 * len(names), compressor="toy", communicator="allreduce",
                   codecs={"toy": CodecCost(LinearCost(1e-6, 1e-4), LinearCost(1e-6, 1e-4), WireSize(4.0, 0))},
                   collectives={"allreduce": LinearCost(1e-6, 2.5e-5)})


def train_wide(rank, steps, **wrapper_kwargs):
    model = wide_first_layer()
    opt = mergecomp.DistributedOptimizer(make_optimizer("sgd", model), model.named_parameters(),
                                         **wrapper_kwargs)
    for step in range(steps):
        x, y = wide_batch(step, rank)
        opt.zero_grad(set_to_none=step % 2 == 0)  # grads fresh, or kept and accumulated into
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.plan


def chunked_training_worker(rank, world_size):
    planned = OptimalScheduler(priced_profile(wide_first_layer()), sends=("compress",), chunk_mb=300 / 2 ** 20)
    # By hand: a raw group whose buffer the whole tensors' grads become views of, beside slices.
    by_hand = Plan([Group(("2.bias", "2.weight", "0.bias", "0.weight"), "fp32", (None, (0, 10), None, (0, 100))),
                    Group(("2.weight", "0.weight"), "compress", ((10, 24), (100, 180))),
                    Group(("0.weight",), "fp16", ((180, 256),))])
    return {"planned": train_wide(rank, 3, schedule=planned),
            "by hand": train_wide(rank, 3, schedule=by_hand, compressor="none")}


def test_training_with_sliced_groups_equals_one_process_on_all_batches():
    expected = reference_params("sgd", 2, 3, wide_first_layer, wide_batch)
    for result in run_ranks(chunked_training_worker, 2):
        params, plan = result["planned"]
        assert sum(g.slices is not None for g in plan.groups) >= 2
        for got, want in zip(params, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        params, _ = result["by hand"]  # FP16 for one piece: close, not equal
        for got, want in zip(params, expected):
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def residual_by_element(optimizer, model):
    """Each parameter's error-feedback residual, put together from its groups' pieces."""
    numels = {n: p.numel() for n, p in model.named_parameters()}
    out = {n: torch.zeros(k) for n, k in numels.items()}
    for index, pieces in enumerate(optimizer.plan.pieces(numels)):
        flat, offset = optimizer.memory.residuals[f"group{index}"], 0
        for name, start, stop in pieces:
            out[name][start:stop] = flat[offset:offset + stop - start]
            offset += stop - start
    return out


def sliced_state_worker(rank, world_size):
    model = make_model()
    opt = mergecomp.DistributedOptimizer(
        make_optimizer("sgd", model), model.named_parameters(),
        compressor=mergecomp.compressors.create("topk", compress_ratio=0.1), schedule=2)

    def train(step):
        x, y = batch(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    train(0)
    train(1)
    before = residual_by_element(opt, model)
    order = opt.plan.order()
    numels = {n: p.numel() for n, p in model.named_parameters()}
    big = max(order, key=numels.get)
    cut = numels[big] // 3
    rest = [n for n in order if n != big]
    sliced = Plan([Group(tuple(rest[:2]) + (big,), slices=(None, None, (0, cut))),
                   Group((big,), slices=((cut, numels[big]),)),
                   Group(tuple(rest[2:]))])
    opt.set_plan(sliced)
    moved = residual_by_element(opt, model)
    train(2)  # the hooks run the sliced plan
    during = residual_by_element(opt, model)
    opt.set_plan(mergecomp.schedulers.create("fixed", fusion_num=1).plan(opt.param_infos(order)))
    back = residual_by_element(opt, model)
    return (all(torch.equal(before[n], moved[n]) for n in before),
            all(torch.equal(back[n], during[n]) for n in back) and any(during[n].abs().sum() > 0 for n in during),
            len(opt.plan))


def test_error_feedback_state_follows_elements_into_and_out_of_slices():
    for kept, consistent, groups in run_ranks(sliced_state_worker, 2):
        assert kept and consistent and groups == 1
