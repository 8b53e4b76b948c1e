"""The auto and binary schedulers driving a real 2-rank run: they settle on the same plan."""
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import mergecomp
from mergecomp.plan import Group, ParamInfo, Plan
from mergecomp.runtime.regroup import CannotRegroup
from mergecomp.schedulers.fixed import FixedScheduler
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
        compressor=mergecomp.compressors.create("topk", compress_ratio=0.1), schedule=scheduler)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
    # The user's own listeners: the scheduler adds its own beside them, never replaces them.
    finished, ready = [], []

    def on_phase(phase, group, seconds):
        if phase == "finish":
            finished.append(group.index)
    phase_handle = opt.add_phase_listener(on_phase)
    ready_handle = opt.add_ready_listener(ready.append)
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
    total = steps + 5
    assert finished.count(0) == total and len(ready) == total * len(list(model.parameters()))
    # Once settled the scheduler has removed its listeners: the user's were the last.
    phase_handle.remove()
    ready_handle.remove()
    assert not opt.reducer.lifecycle.phase_listeners and not opt.reducer.ready_listeners
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
    by_communicator = {f"all compressed by {name}" for name in mergecomp.communicators.available()}
    assert set(labels) <= {"optimal", "no compression", "all compressed", "DDP buckets"} | {
        f"fusion-num {k}" for k in (0, 1, 2, 3, 4, 6, 8)} | by_communicator, labels
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
    from mergecomp.planning.auto.decisions import contenders, medians_as_timed
    # Visits: (step seconds, forward seconds); no forwards timed, so no speed correction.
    visits = {0: [([1.0, 1.2], None)], 1: [([1.1], None), ([1.3], None)], 2: [([2.0, 2.1], None)], 3: []}
    medians = medians_as_timed(visits)
    assert medians == pytest.approx({0: 1.1, 1: 1.2, 2: 2.05})  # 3 unmeasured
    assert contenders(medians, margin=0.15) == [0, 1]  # 1.2 within 15% of 1.1, 2.05 out
    # Halving keeps a candidate that one bad visit put 30% behind, when it is in the faster half.
    medians = dict(enumerate([1.0, 1.3, 1.4, 1.5, 2.0]))
    assert contenders(medians, margin=0.15) == [0, 1, 2]
    # Only the candidates still in the race count, so the field shrinks round by round.
    assert contenders({i: medians[i] for i in (0, 1, 2)}, margin=0.15) == [0, 1]
    # A margin keeps every candidate close to the fastest, beyond the faster half.
    assert contenders(medians, margin=0.5) == [0, 1, 2, 3]
    assert contenders({}, margin=0.15) == []


def test_a_visit_takes_each_steps_slowest_rank_and_skips_untimed_steps():
    from mergecomp.planning.auto.decisions import slowest_rank_visit
    everyone = [([1.0, None, 3.0], [0.5, None, 0.4]), ([2.0, 2.0, 1.0], [0.1, 0.2, None])]
    # Step 2 was untimed on rank 0 (restart_step_clock); forward 3 untimed on rank 1.
    assert slowest_rank_visit(everyone) == ([2.0, 3.0], pytest.approx(0.5))
    assert slowest_rank_visit([([None], [None]), ([1.0], [0.2])]) is None


def test_auto_compares_visits_at_the_checks_median_compute_speed():
    import dataclasses
    from mergecomp.planning.costmodel import predict
    from mergecomp.planning.profile import scaled_compute
    from mergecomp.planning.auto.decisions import medians_at_common_speed, medians_as_timed
    from mergecomp.planning.auto.settings import AutoSettings
    from tests.test_costmodel import hand_profile
    profile = hand_profile()  # forward 1 s, backward 4 s, compute-bound
    split = Plan([Group(("a",), "compress"), Group(("b", "c"), "fp32")])
    whole = Plan([Group(("a", "b", "c"), "fp32")])
    at = lambda plan, factor: predict(plan, scaled_compute(profile, factor)).iteration_time  # noqa: E731
    clamp = AutoSettings().speed_clamp
    plans = {0: split, 1: whole, 2: whole, 3: whole}
    # "split" was visited while the host ran 1.5x slower (forward 1.5 s against the median
    # 1.0 s): its raw 7.0 s loses to "whole"'s 6.5 s, but the cost model says 1.5x slower
    # compute costs it at(1.5) - at(1.0) seconds, which are taken off.
    visits = {0: [([7.0, 7.0], 1.5)], 1: [([6.5, 6.5], 1.0), ([6.5], 1.0)]}
    shift = at(split, 1.5) - at(split, 1.0)
    assert shift > 0.5
    figures = medians_at_common_speed(visits, plans, profile, clamp)
    assert figures == pytest.approx({0: 7.0 - shift, 1: 6.5})
    assert figures[0] < figures[1]
    # A visit without a timed forward is taken as measured; a forward pause is clamped.
    assert medians_at_common_speed({0: [([7.0], None)], 1: [([6.5], 1.0)]}, plans, profile, clamp) == \
        pytest.approx({0: 7.0, 1: 6.5})
    clamped = at(split, clamp) - at(split, 1.0)
    visits = {0: [([7.0], 50.0)], 1: [([6.5], 1.0)], 2: [([6.4], 1.0)], 3: []}
    assert medians_at_common_speed(visits, plans, profile, clamp) == pytest.approx({0: 7.0 - clamped, 1: 6.5, 2: 6.4})
    # The reference is the visits' median forward (here 2x the profile's), not the profile's.
    half = dataclasses.replace(profile, forward_time=0.5)
    visits = {0: [([7.0], 1.5)], 1: [([6.5], 1.0)], 2: [([6.0], 1.0)]}
    expected = 7.0 - (predict(split, scaled_compute(half, 3.0)).iteration_time
                      - predict(split, scaled_compute(half, 2.0)).iteration_time)
    assert medians_at_common_speed(visits, plans, half, clamp) == pytest.approx({0: expected, 1: 6.5, 2: 6.0})
    # No timed forward at all, or no profiled forward: the steps as timed.
    untimed = {0: [([7.0, 7.0], None)], 1: [([6.5], None)]}
    assert medians_at_common_speed(untimed, plans, profile, clamp) == medians_as_timed(untimed) == {0: 7.0, 1: 6.5}
    no_forward = dataclasses.replace(profile, forward_time=0.0)
    assert medians_at_common_speed({0: [([7.0, 7.0], 1.5)], 1: [([6.5], 1.0)]}, plans, no_forward, clamp) == \
        {0: 7.0, 1: 6.5}


def test_auto_keeps_fp32_unless_a_lossy_plan_is_clearly_faster():
    from mergecomp.planning.auto.decisions import winner
    raw = Plan([Group(("a",), "fp32"), Group(("b",), "fp32")])
    compressed = Plan([Group(("a", "b"), "compress")])
    half = Plan([Group(("a", "b"), "fp16")])

    def chosen(measured, margin=0.05):
        return winner(measured, margin).chosen[1]

    # 3% faster compressed: within the margin, FP32 is kept (and the choice says so).
    choice = winner([(0.97, "fusion-num 1", compressed), (1.0, "DDP buckets", raw)], 0.05)
    assert choice.chosen[1] == "DDP buckets" and choice.fastest[1] == "fusion-num 1" and choice.kept_fp32
    assert chosen([(0.97, "fp16", half), (1.0, "DDP buckets", raw)]) == "DDP buckets"
    # 10% faster: compression pays and is chosen; with no FP32 candidate the fastest wins.
    assert chosen([(0.90, "fusion-num 1", compressed), (1.0, "DDP buckets", raw)]) == "fusion-num 1"
    assert chosen([(0.97, "fusion-num 1", compressed), (0.99, "fp16", half)]) == "fusion-num 1"
    # A margin of 0 is the plain minimum; equals go to the first.
    assert chosen([(0.99, "fusion-num 1", compressed), (1.0, "DDP buckets", raw)], 0.0) == "fusion-num 1"
    assert not winner([(1.0, "a", raw), (1.0, "b", raw)], 0.05).kept_fp32
    assert chosen([(1.0, "a", raw), (1.0, "b", raw)]) == "a"
    with pytest.raises(ValueError, match="at least one"):
        winner([], 0.05)


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
    """Just enough of a SchedulerContext for the watch phase of a single rank."""

    density_scale = 1.0  # the quality controller's (1: it raised nothing)

    class backend:
        rank = 0

        @staticmethod
        def allgather_object(obj, expect=None):
            return [obj]


def watching(watch_every=4, drift=0.25):
    from mergecomp.planning.auto.phase import Findings, Search
    from mergecomp.planning.auto.settings import AutoSettings
    from mergecomp.planning.auto.profiling import Profiling
    from mergecomp.planning.auto.watching import Watching
    search = Search(AutoSettings(watch_every=watch_every, drift=drift), Findings(best=("optimal", None, 1.0)), None)
    search.profile = lambda context: Profiling(search, context)  # as the scheduler wires it
    return Watching(search)


def test_auto_watch_ignores_untimed_steps_and_a_single_pause():
    from mergecomp.planning.auto.decisions import drifted, slowest_typical_step
    phase = watching()
    # An untimed step (restart_step_clock) and one long pause in each window: the median of
    # the timed steps stays at 1.0 s, so no strike.
    for window in range(3):
        for seconds in (None, 1.0, 30.0, 1.0):
            assert phase.after_step(_OneRank, seconds) is phase
    assert phase.strikes == 0
    # A window of only untimed steps is skipped, not counted as slow.
    for _ in range(4):
        phase.after_step(_OneRank, None)
    assert phase.strikes == 0
    # Steps really slower than the drift allows do count.
    for seconds in (1.5, 1.6, 1.5, 1.4):
        phase.after_step(_OneRank, seconds)
    assert phase.strikes == 1
    assert slowest_typical_step([None, 1.2, 1.1]) == 1.2 and slowest_typical_step([None]) is None
    assert drifted(1.26, 1.0, 0.25) and not drifted(1.25, 1.0, 0.25)


def test_auto_watch_takes_a_density_change_for_a_new_reference_not_for_drift():
    """The controller doubles a group's density: steps get slower for a reason no plan
    causes, so the watch re-measures its reference instead of profiling again; steps that
    then drift from the new reference still count."""
    said, profiling = [], object()
    phase = watching(watch_every=2)
    phase.search.log = said.append
    phase.search.profile = lambda context: profiling
    context = type("Context", (_OneRank,), {})  # its density_scale is set below
    for seconds in (1.0, 1.0):
        assert phase.after_step(context, seconds) is phase
    context.density_scale = 2.0  # slower from here on: 1.6 s against the check's 1.0 s
    for window in range(4):
        for seconds in (1.6, 1.6):
            assert phase.after_step(context, seconds) is phase
    assert phase.strikes == 0 and phase.reference == 1.6 and said == []
    for seconds in (2.1, 2.1, 2.1, 2.1):  # drifted from the new reference: two windows, two strikes
        following = phase.after_step(context, seconds)
    assert phase.strikes == 2 and following is profiling
    assert said == ["auto scheduler: steps take 2100.0 ms against 1600.0 ms measured for the chosen plan; "
                    "profiling again"]


class _CannotSwitch(_OneRank):
    """A one-rank context whose job's state cannot follow a new plan."""

    class compressor:
        name = "none"

    plan = Plan([Group(("a",), "compress"), Group(("b",), "compress")])

    @staticmethod
    def param_infos(order):
        return [ParamInfo(n, 4, "torch.float32", "cpu", 4) for n in order]

    @staticmethod
    def set_plan(plan):
        raise CannotRegroup("PowerSGD's factors")


def test_auto_watch_keeps_watching_when_the_plan_cannot_change():
    said = []
    phase = watching(watch_every=1)
    phase.search.log = said.append
    assert phase.after_step(_CannotSwitch, 2.0) is phase and phase.strikes == 1
    assert phase.after_step(_CannotSwitch, 2.0) is phase  # no profiling phase half begun
    assert phase.strikes == 0 and phase.settled
    assert said == ["auto scheduler: steps drifted but the plan cannot change (PowerSGD's factors)"]



def test_auto_keeps_the_running_plan_when_the_fastest_cannot_take_its_state():
    """The check ends on a plan whose state cannot follow the one measured fastest (the
    factors of a low-rank compressor): the running plan is kept, with its own
    measured step time as the reference the watch compares with."""
    from mergecomp.planning.auto.racing import Checking
    fastest, running = _CannotSwitch.plan, Plan([Group(("a", "b"), "compress")])
    measured = [(1.0, "optimal", fastest), (1.4, "fusion-num 1", running)]
    assert Checking._kept(measured, running) == ("fusion-num 1", running, 1.4)
    assert Checking._kept(measured[:1], running) == ("the running plan", running, 1.0)

def restart_worker(rank, world_size):
    from mergecomp.schedulers.fixed import FixedScheduler

    class Recording(FixedScheduler):
        adaptive = True

        def __init__(self):
            super().__init__(1)
            self.seen = []

        def after_step(self, context, seconds):
            self.seen.append(seconds)

    model = nn.Linear(3, 1)
    scheduler = Recording()
    opt = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                         schedule=scheduler)
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


# ------------------------------------------------------------------ the scheduler's surface
SURFACE = {"param_infos", "named_parameters", "plan", "set_plan", "add_ready_listener", "add_phase_listener",
           "add_step_listener", "time_optimizer_steps", "backend", "compressor", "memory", "communicator",
           "carriers", "density_scale"}


class EveryOtherStep(mergecomp.schedulers.AdaptiveScheduler):
    """A plugin adaptive scheduler written against the documented surface only: it
    alternates one group and layer-wise groups, timing the wrapped optimizer's steps."""

    def __init__(self):
        self.contexts, self.optimizer_steps, self.switches, self.timer = [], [], 0, None

    def plan(self, params):
        return FixedScheduler(1).plan(params)

    def after_step(self, context, seconds):
        self.contexts.append(context)
        if self.timer is None:
            self.timer = context.time_optimizer_steps()
            return
        fusion = 0 if len(context.plan) == 1 else 1
        agreed = context.backend.allgather_object(context.plan.digest())
        assert len(set(agreed)) == 1
        context.set_plan(FixedScheduler(fusion).plan(
            context.param_infos(context.plan.order())))
        self.switches += 1

    @property
    def settled(self):
        return self.switches >= 3


def plugin_scheduler_worker(rank, world_size):
    mergecomp.schedulers.register("every-other-step")(EveryOtherStep)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                                         schedule="every-other-step")
    scheduler, plans = opt.scheduler, []
    while not scheduler.settled:
        opt.zero_grad()
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        plans.append(len(opt.plan))
    scheduler.timer.detach()
    context = scheduler.contexts[0]
    public = {name for name in dir(context) if not name.startswith("_")}
    read_only = []
    for fact in ("backend", "compressor", "memory", "communicator"):
        try:
            setattr(context, fact, None)
        except AttributeError:
            read_only.append(fact)
    return (all(c is context for c in scheduler.contexts), isinstance(context, mergecomp.schedulers.SchedulerContext),
            public, read_only, hasattr(context, "optimizer"), plans, len(scheduler.timer.seconds),
            context.compressor is opt.compressor and context.communicator is opt.communicator)


def test_a_plugin_adaptive_scheduler_sees_the_declared_surface_and_nothing_else():
    for same, declared, public, read_only, optimizer, plans, timed, facts in run_ranks(plugin_scheduler_worker, 2):
        assert same and declared and public == SURFACE and not optimizer and facts
        assert read_only == ["backend", "compressor", "memory", "communicator"]
        # The plan after each step: it switched between steps; the three steps after the first timed.
        assert plans == [1, 4, 1, 4] and timed == 3


def test_an_entry_point_scheduler_gets_the_context(tmp_path):
    """The ``mergecomp.schedulers`` entry-point group: a third-party adaptive scheduler is
    found by name and driven with the SchedulerContext, as the registered ones are."""
    package = tmp_path / "mc_sched_pkg"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent('''
        from mergecomp.schedulers import AdaptiveScheduler
        from mergecomp.schedulers.fixed import FixedScheduler

        class OneGroupThenLayerwise(AdaptiveScheduler):
            seen = []
            def plan(self, params):
                return FixedScheduler(1).plan(params)
            def after_step(self, context, seconds):
                self.seen.append(type(context).__name__)
                context.set_plan(FixedScheduler(0).plan(context.param_infos()))
            @property
            def settled(self):
                return bool(self.seen)
    '''))
    dist_info = tmp_path / "mc_sched_pkg-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: mc-sched-pkg\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(
        "[mergecomp.schedulers]\nonce-then-layerwise = mc_sched_pkg:OneGroupThenLayerwise\n")
    script = textwrap.dedent(f'''
        import torch, mergecomp
        torch.distributed.init_process_group("gloo", init_method="file://{tmp_path / 'rendezvous'}",
                                             rank=0, world_size=1)
        model = torch.nn.Linear(3, 2)
        opt = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             model.named_parameters(), schedule="once-then-layerwise")
        for _ in range(2):
            model(torch.ones(1, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
        print(opt.scheduler.seen, len(opt.plan))
    ''')
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path), "PATH": ""}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['SchedulerContext', 'SchedulerContext'] 2"
