"""The auto and binary schedulers driving a real 2-rank run: they settle on the same plan."""
import pytest
import torch
import torch.nn as nn

import mergecomp
from tests.distributed import run_ranks


def adaptive_worker(rank, world_size, name):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    if name == "auto":
        scheduler = mergecomp.schedulers.create("auto", profile_steps=2, check_steps=1, check_rounds=2, log=None)
    else:
        scheduler = mergecomp.schedulers.create("binary", steps=1, warmup=0)
    opt = mergecomp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
        compressor=mergecomp.compressors.create("topk", compress_ratio=0.1), scheduler=scheduler)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
    losses, steps = [], 0
    while not (steps > 1 and scheduler.settled) and steps < 60:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        steps += 1
    for _ in range(5):  # keep training on the chosen plan
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    report = [(label, measured) for label, _, _, measured in scheduler.report] if name == "auto" else []
    if name == "auto":  # the same candidates' figures as timed, before the speed correction
        assert set(scheduler.as_timed) == {label for label, _ in report}
    measured = (scheduler.profile.optimizer_step, sorted(scheduler.profile.finish),
                sorted(scheduler.profile.launch), scheduler.profile.collective_slowdown) \
        if name == "auto" else None
    return (scheduler.settled, opt.plan.digest(), steps, report, [p.sum().item() for p in model.parameters()],
            measured)


def test_auto_scheduler_profiles_checks_and_settles_identically():
    results = run_ranks(adaptive_worker, 2, "auto")
    (settled, digest, steps, report, params, _), other = results[0], results[1]
    assert settled and other[0] and digest == other[1] and params == other[4]
    assert [label for label, _ in report][0] == "optimal"
    assert all(isinstance(m, float) and m > 0 for _, m in report)  # every candidate measured
    # Profile (2), interference and slowdown (3 + 3), then two rounds: at most 11 candidates,
    # then the faster half, 2 steps a visit.
    assert steps <= 1 + 2 + 2 * 3 + 2 * (11 + 6) + 1
    labels = [label for label, _ in report]
    assert len(labels) >= 3 and "fusion-num 0" in labels  # duplicates dropped (a 6-tensor model)
    assert set(labels) <= {"optimal", "no compression", "all compressed", "DDP buckets"} | {
        f"fusion-num {k}" for k in (0, 1, 2, 3, 4, 6, 8)}
    # The profile timed the wrapped SGD's step and probed every send mode's finish phase.
    optimizer_step, finish, launch, slowdown = results[0][5]
    assert 0 < optimizer_step < 1 and finish == ["bf16", "compress", "fp16", "fp32"]
    # Launch costs timed in the run: the profile's raw group and the compressed candidates.
    assert launch == ["compress", "fp32"] and slowdown >= 1.0
    assert results[1][5][2:] == results[0][5][2:]  # agreed over ranks


def test_binary_scheduler_searches_and_settles_identically():
    results = run_ranks(adaptive_worker, 2, "binary")
    assert results[0][0] and results[1][0]
    assert results[0][1] == results[1][1] and results[0][4] == results[1][4]


def test_auto_check_rounds_keep_the_faster_half_and_the_close_ones():
    scheduler = mergecomp.schedulers.create("auto", contender_margin=0.15, log=None)
    # Visits: (step seconds, forward seconds); no forwards timed, so no speed correction.
    scheduler._windows = {0: [([1.0, 1.2], None)], 1: [([1.1], None), ([1.3], None)], 2: [([2.0, 2.1], None)],
                          3: []}
    assert scheduler._contenders() == [0, 1]  # medians 1.1, 1.2 (within 15%), 2.05 out, 3 unmeasured
    # Halving keeps a candidate that one bad visit put 30% behind, when it is in the faster half.
    scheduler._windows = {i: [([t], None)] for i, t in enumerate([1.0, 1.3, 1.4, 1.5, 2.0])}
    assert scheduler._contenders() == [0, 1, 2]
    # Only the candidates still in the race count, so the field shrinks round by round.
    scheduler._race = [0, 1, 2]
    assert scheduler._contenders() == [0, 1]
    scheduler._windows = {}
    assert scheduler._contenders() == []


def test_auto_compares_visits_at_the_checks_median_compute_speed():
    import dataclasses
    from mergecomp.costmodel import predict
    from mergecomp.plan import Group, Plan
    from mergecomp.simulate import scaled_compute
    from tests.test_costmodel import hand_profile
    profile = hand_profile()  # forward 1 s, backward 4 s, compute-bound
    split = Plan([Group(("a",), "compress"), Group(("b", "c"), "fp32")])
    whole = Plan([Group(("a", "b", "c"), "fp32")])
    at = lambda plan, factor: predict(plan, scaled_compute(profile, factor)).iteration_time  # noqa: E731
    scheduler = mergecomp.schedulers.create("auto", log=None)
    scheduler.profile = profile
    scheduler._candidates = [("split", split, 0.0), ("whole", whole, 0.0)]
    # "split" was visited while the host ran 1.5x slower (forward 1.5 s against the median
    # 1.0 s): its raw 7.0 s loses to "whole"'s 6.5 s, but the cost model says 1.5x slower
    # compute costs it at(1.5) - at(1.0) seconds, which are taken off.
    scheduler._windows = {0: [([7.0, 7.0], 1.5)], 1: [([6.5, 6.5], 1.0), ([6.5], 1.0)]}
    shift = at(split, 1.5) - at(split, 1.0)
    assert shift > 0.5
    figures = scheduler._at_check_speed()
    assert figures == pytest.approx({0: 7.0 - shift, 1: 6.5})
    assert figures[0] < figures[1]
    # A visit without a timed forward is taken as measured; a forward pause is clamped.
    scheduler._windows = {0: [([7.0], None)], 1: [([6.5], 1.0)]}
    assert scheduler._at_check_speed() == pytest.approx({0: 7.0, 1: 6.5})
    scheduler._windows = {0: [([7.0], 50.0)], 1: [([6.5], 1.0)], 2: [([6.4], 1.0)], 3: []}
    scheduler._candidates += [("whole again", whole, 0.0), ("unvisited", whole, 0.0)]
    clamped = at(split, scheduler.speed_clamp) - at(split, 1.0)
    assert scheduler._at_check_speed() == pytest.approx({0: 7.0 - clamped, 1: 6.5, 2: 6.4})
    # The reference is the visits' median forward (here 2x the profile's), not the profile's.
    scheduler.profile = dataclasses.replace(profile, forward_time=0.5)
    scheduler._windows = {0: [([7.0], 1.5)], 1: [([6.5], 1.0)], 2: [([6.0], 1.0)]}
    half = scheduler.profile
    expected = 7.0 - (predict(split, scaled_compute(half, 3.0)).iteration_time
                      - predict(split, scaled_compute(half, 2.0)).iteration_time)
    assert scheduler._at_check_speed() == pytest.approx({0: expected, 1: 6.5, 2: 6.0})
    # Switched off: plain medians.
    plain = mergecomp.schedulers.create("auto", log=None, speed_correction=False)
    plain.profile, plain._candidates = profile, scheduler._candidates
    plain._windows = {0: [([7.0, 7.0], 1.5)], 1: [([6.5], 1.0)]}
    assert plain._at_check_speed() == {0: 7.0, 1: 6.5}


def test_auto_keeps_fp32_unless_a_lossy_plan_is_clearly_faster():
    from mergecomp.plan import Group, Plan
    raw = Plan([Group(("a",), "fp32"), Group(("b",), "fp32")])
    compressed = Plan([Group(("a", "b"), "compress")])
    half = Plan([Group(("a", "b"), "fp16")])
    scheduler = mergecomp.schedulers.create("auto", compression_margin=0.05, log=None)
    # 3% faster compressed: within the margin, FP32 is kept.
    assert scheduler._winner([(0.97, "fusion-num 1", compressed), (1.0, "DDP buckets", raw)])[1] == "DDP buckets"
    assert scheduler._winner([(0.97, "fp16", half), (1.0, "DDP buckets", raw)])[1] == "DDP buckets"
    # 10% faster: compression pays and is chosen; with no FP32 candidate the fastest wins.
    assert scheduler._winner([(0.90, "fusion-num 1", compressed), (1.0, "DDP buckets", raw)])[1] == "fusion-num 1"
    assert scheduler._winner([(0.97, "fusion-num 1", compressed), (0.99, "fp16", half)])[1] == "fusion-num 1"
    # A margin of 0 is the plain minimum.
    plain = mergecomp.schedulers.create("auto", compression_margin=0.0, log=None)
    assert plain._winner([(0.99, "fusion-num 1", compressed), (1.0, "DDP buckets", raw)])[1] == "fusion-num 1"


def test_auto_scheduler_refuses_bad_check_settings():
    import pytest
    with pytest.raises(ValueError, match="check_rounds"):
        mergecomp.schedulers.create("auto", check_rounds=0)
    with pytest.raises(ValueError, match="contender_margin"):
        mergecomp.schedulers.create("auto", contender_margin=-0.1)
    with pytest.raises(ValueError, match="fusion_candidates"):
        mergecomp.schedulers.create("auto", fusion_candidates=(1, -1))
    with pytest.raises(ValueError, match="compression_margin"):
        mergecomp.schedulers.create("auto", compression_margin=1.5)
    with pytest.raises(ValueError, match="speed_correction"):
        mergecomp.schedulers.create("auto", speed_correction="yes")


class _OneRank:
    """Just enough of a DistributedOptimizer for the watch phase of a single rank."""

    class backend:
        rank = 0

        @staticmethod
        def allgather_object(obj):
            return [obj]


def test_auto_watch_ignores_untimed_steps_and_a_single_pause():
    scheduler = mergecomp.schedulers.create("auto", watch_every=4, drift=0.25, log=None)
    scheduler.phase, scheduler.best, scheduler._strikes = "watch", ("optimal", None, 1.0), 0
    # An untimed step (restart_step_clock) and one long pause in each window: the median of
    # the timed steps stays at 1.0 s, so no strike.
    for window in range(3):
        for seconds in (None, 1.0, 30.0, 1.0):
            scheduler._watch(_OneRank, seconds)
    assert scheduler._strikes == 0 and scheduler.phase == "watch"
    # A window of only untimed steps is skipped, not counted as slow.
    for _ in range(4):
        scheduler._watch(_OneRank, None)
    assert scheduler._strikes == 0
    # Steps really slower than the drift allows do count.
    for seconds in (1.5, 1.6, 1.5, 1.4):
        scheduler._watch(_OneRank, seconds)
    assert scheduler._strikes == 1


def restart_worker(rank, world_size):
    from mergecomp.schedulers.fixed import FixedScheduler

    class Recording(FixedScheduler):
        adaptive = True

        def __init__(self):
            super().__init__(1)
            self.seen = []

        def after_step(self, optimizer, seconds):
            self.seen.append(seconds)

    model = nn.Linear(3, 1)
    scheduler = Recording()
    opt = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                         scheduler=scheduler)
    for restart in (False, False, True, False):
        if restart:
            opt.restart_step_clock()
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    return scheduler.seen


def test_restart_step_clock_hands_the_scheduler_an_untimed_step():
    for seen in run_ranks(restart_worker, 2):
        assert seen[0] is None and seen[1] > 0 and seen[2] is None and seen[3] > 0
