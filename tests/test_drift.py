"""The drift measure and the quality controller: the lag is what the memories hold against
the update flowing in, the same on every rank; the controller raises and lowers groups within
its budget, identically everywhere, and resumes exactly; a measured lag with nothing steering
it, and a loop that clips after the exchange against the recipe, are told once."""
import math
import warnings

import pytest
import torch
import torch.nn as nn

import mergecomp
from mergecomp.runtime import drift
from mergecomp.runtime.drift import ClipWatch, DriftController, DriftReading

from .distributed import run_ranks


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(32, 16, generator=g)
    return x, x[:, :4].sin()


def _step(model, optimizer, rank, step, clip=None):
    x, y = _batch(rank, step)
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()


# -- the measure -------------------------------------------------------------------------------
def _measured(rank, world_size):
    """Plain residual memory, SGD without momentum: the incoming update is the gradient."""
    model = _model()
    optimizer = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model=model,
                                               compressor=mergecomp.compressors.create("topk", compress_ratio=0.05),
                                               memory="residual", schedule=1, controller="off")
    for step in range(10):
        _step(model, optimizer, rank, step)
    # step 10 is measured (every 10 steps): take the gradient and the residual it leaves by hand
    memory = optimizer.communicator.memory
    x, y = _batch(rank, 10)
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    # the hook has run: the gradient this rank sent is gone into the exchange, so recompute it
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # the average, after backward
    residual = memory.residuals["group0"].clone()
    optimizer.step()
    return optimizer.drift, float(residual.square().sum()), optimizer.steps


def test_the_lag_is_the_residual_against_the_gradient_flowing_in_the_same_on_every_rank():
    (reading0, held0, steps), (reading1, held1, _) = run_ranks(_measured, 2)
    assert steps == 11
    assert reading0 == reading1 and reading0.step == 10
    assert set(reading0.groups) == {"group0"} and reading0.lag == pytest.approx(reading0.groups["group0"])
    # Σ over ranks of ‖e‖² over Σ of ‖g‖²: with what each rank held, the lag fixes Σ‖g‖²
    assert reading0.lag > 0 and math.isfinite(reading0.lag)
    incoming = (held0 + held1) / reading0.lag ** 2
    assert incoming > 0


def test_lags_from_the_sums_over_ranks():
    whole, groups = drift.lags(["a", "b"], torch.tensor([9.0, 1.0, 0.0, 3.0]))
    assert groups == {"a": pytest.approx(3.0), "b": 0.0}
    assert whole == pytest.approx(math.sqrt(9.0 / 4.0))
    _, held_nothing = drift.lags(["c"], torch.tensor([0.0, 0.0]))
    assert held_nothing == {"c": 0.0}


# -- the controller, alone -------------------------------------------------------------------
def _reading(step, **lags):
    return DriftReading(step, max(lags.values()), dict(lags))


def test_the_controller_doubles_a_lagging_group_and_halves_a_calm_one_after_its_patience():
    controller = DriftController(raise_above=2.0, lower_below=0.5, byte_budget=4.0, patience=2, horizon=1000,
                                 start_scale=1)  # the rules alone, without the warm start
    weights = {"group0": 100.0, "group1": 100.0}
    assert controller.decide(_reading(0, group0=5.0, group1=1.0), weights, 10) == {"group0": 2.0}
    assert controller.decide(_reading(10, group0=5.0, group1=1.0), weights, 10) == {"group0": 4.0}
    assert controller.decide(_reading(20, group0=0.1, group1=1.0), weights, 10) == {}
    assert controller.decide(_reading(30, group0=0.1, group1=1.0), weights, 10) == {"group0": 2.0}
    assert controller.scales == {"group0": 2.0}
    assert [scales for _, scales in controller.history] == [{"group0": 2.0}, {"group0": 4.0}, {"group0": 2.0}]


def _noise(step, **noises):
    return DriftReading(step, max(noises.values()), dict(noises), kind="noise")


def test_a_raised_noise_is_lowered_only_when_a_step_down_would_read_calm():
    """A noise is memoryless: the readings around a raise give the setting's gain, and a
    raised group is weighed by the noise a step down would read (reading × gain)."""
    from mergecomp.runtime.controller import NOISE_THRESHOLDS
    high, low = NOISE_THRESHOLDS
    controller = DriftController(byte_budget=4.0, patience=2, horizon=1000)
    weights = {"group0": 100.0}
    assert controller.decide(_noise(0, group0=0.65), weights, 10) == {"group0": 2.0}
    # raised, it reads far under the lower threshold, but 0.04 × (0.65 / 0.04) is not calm
    for step in (10, 20, 30, 40):
        assert controller.decide(_noise(step, group0=0.04), weights, 10) == {}
    assert controller.scales == {"group0": 2.0}
    # the gradient got easier to quantise: a step down would now read 0.65 · 0.4 = 0.26 < low
    calm = 0.04 * 0.4
    assert 0.65 * 0.4 < low < high
    assert controller.decide(_noise(50, group0=calm), weights, 10) == {}
    assert controller.decide(_noise(60, group0=calm), weights, 10) == {"group0": 1.0}
    # a step down, it reads what the gain said; a new raise measures the gain again
    assert controller.decide(_noise(70, group0=0.26), weights, 10) == {}
    again = DriftController(byte_budget=4.0, patience=2, horizon=1000)
    again.load_state_dict(controller.state_dict())
    assert again.state_dict() == controller.state_dict()
    assert again.decide(_noise(80, group0=0.7), weights, 10) == {"group0": 2.0}
    assert again.decide(_noise(90, group0=0.07), weights, 10) == {}
    assert again.decide(_noise(100, group0=0.07), weights, 10) == {}  # 0.07 × 10 = 0.7: held
    assert again.scales == {"group0": 2.0}
    again.regrouped({"group0": 2.0})  # the name now stands for other parameters: no gain known
    assert again.decide(_noise(110, group0=0.07), weights, 10) == {}
    assert again.decide(_noise(120, group0=0.07), weights, 10) == {"group0": 1.0}  # weighed as read


def test_a_lag_is_weighed_as_read_whatever_its_history():
    controller = DriftController(raise_above=2.0, lower_below=0.5, byte_budget=4.0, patience=1, horizon=1000)
    weights = {"group0": 100.0}
    assert controller.decide(_reading(0, group0=5.0), weights, 10) == {"group0": 2.0}
    assert controller.decide(_reading(10, group0=0.1), weights, 10) == {"group0": 1.0}


def test_the_controller_never_spends_beyond_its_budget():
    controller = DriftController(raise_above=1.0, lower_below=0.1, byte_budget=2.0, max_scale=16.0, front=3)
    weights = {"group0": 1.0}
    for step in range(0, 2000, 10):
        controller.decide(_reading(step, group0=50.0), weights, 10)
        rate = controller.scales.get("group0", 1.0)
        assert controller.spent + 10 * rate <= controller.allowed(controller.base + 10, 1.0, 10) + 1e-9
    assert 1.0 < controller.bytes_ratio <= 2.0 + 1e-9  # it spent what it may, and no more
    assert max(controller.scales.values()) <= 16.0


def test_a_warm_start_sends_the_first_interval_high_then_the_rules_take_over():
    controller = DriftController(raise_above=2.0, lower_below=0.5, patience=2, horizon=1000, start_scale=8)
    weights = {"group0": 1.0, "group1": 1.0}
    # the first decision starts every group at 8, whatever its lag (nothing is held yet)
    assert controller.decide(_reading(0, group0=0.0, group1=0.0), weights, 1) == {"group0": 8.0, "group1": 8.0}
    assert controller.started and controller.history[0] == (0, {"group0": 8.0, "group1": 8.0})
    again = DriftController(raise_above=2.0, lower_below=0.5, patience=2, horizon=1000, start_scale=8)
    again.load_state_dict(controller.state_dict())  # a checkpoint inside the warm start ends it alike
    # the next one ends it: back to the configured setting, and a lagging group doubles from there
    assert controller.decide(_reading(10, group0=0.1, group1=3.0), weights, 10) == {"group0": 1.0, "group1": 2.0}
    assert again.decide(_reading(10, group0=0.1, group1=3.0), weights, 10) == {"group0": 1.0, "group1": 2.0}
    assert controller.decide(_reading(20, group0=0.1, group1=3.0), weights, 10) == {"group1": 4.0}
    assert controller.bytes_ratio > 1.0  # the warm start's bytes count in the budget
    tight = DriftController(byte_budget=1.5, front=1, every=10, start_scale=16)  # a small front: trimmed at once
    first = tight.decide(_reading(0, group0=0.0), {"group0": 1.0}, 1)
    assert 1.0 < first["group0"] < 16.0
    off = DriftController(start_scale=1)
    assert off.decide(_reading(0, group0=0.0), {"group0": 1.0}, 1) == {} and off.started
    with pytest.raises(ValueError, match="start_scale must be a number from 1 to max_scale"):
        DriftController(start_scale=32)
    assert DriftController().start_scale == 1.0 and DriftController(max_scale=4, start_scale=None).start_scale == 4.0


def test_the_controller_state_round_trips():
    controller = DriftController(raise_above=2.0, horizon=100)
    controller.decide(_reading(0, group0=9.0), {"group0": 1.0}, 10)
    again = DriftController(raise_above=2.0, horizon=100)
    again.load_state_dict(controller.state_dict())
    assert again.state_dict() == controller.state_dict()


@pytest.mark.parametrize("kwargs, message", [
    (dict(raise_above=1.0, lower_below=2.0), "lower_below"),
    (dict(byte_budget=0.5), "byte_budget must be a finite number ≥ 1"),
    (dict(patience=0), "patience must be a whole number ≥ 1"),
    (dict(horizon=-1), "horizon must be the run's steps"),
])
def test_bad_controller_settings_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DriftController(**kwargs)


def test_the_thresholds_follow_the_optimizer_unless_given():
    params = [nn.Parameter(torch.ones(2))]
    controller = DriftController()
    assert (controller.raise_above, controller.lower_below) == (1.5, 0.5)  # not vetted yet: SGD's
    masked = mergecomp.memories.create("dgc")
    controller.follow_optimizer(torch.optim.AdamW(params, lr=0.1), mergecomp.memories.create("residual"))
    assert (controller.raise_above, controller.lower_below) == (1.5, 0.5)  # a plain residual: the gradient's units
    controller.follow_optimizer(torch.optim.AdamW(params, lr=0.1), masked)
    assert (controller.raise_above, controller.lower_below) == (24.0, 8.0)
    assert "raise_above='auto', lower_below='auto'" in repr(controller)
    controller.follow_optimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), masked)
    assert (controller.raise_above, controller.lower_below) == (1.5, 0.5)
    given = DriftController(raise_above=3.0)
    given.follow_optimizer(torch.optim.Adam(params, lr=0.1), masked)
    assert (given.raise_above, given.lower_below) == (3.0, 0.5) and "raise_above=3, lower_below=0.5" in repr(given)
    with pytest.raises(ValueError, match="raise_above must be a finite number"):
        DriftController(raise_above="high")


def _thresholds_under(rank, world_size):
    found = []
    for make, compressor in ((lambda p: torch.optim.AdamW(p, lr=0.01), "topk"),
                             (lambda p: torch.optim.AdamW(p, lr=0.01), "powersgd"),
                             (lambda p: torch.optim.SGD(p, lr=0.1), "topk")):
        model = _model()
        wrapped = mergecomp.DistributedOptimizer(make(model.parameters()), model=model, compressor=compressor)
        meter = wrapped.lifecycle.meter
        found.append((meter.controller.raise_above, meter.controller.lower_below, meter.warns))
    return found


def test_the_wrapper_hands_its_optimizer_to_the_controller():
    assert run_ranks(_thresholds_under, 1) == [[(24.0, 8.0, False), (1.5, 0.5, False), (1.5, 0.5, True)]]


def test_an_unknown_controller_setting_is_refused():
    with pytest.raises(TypeError, match="controller must be 'auto'"):
        drift.drift_meter("sometimes")


# -- the controller, in a run --------------------------------------------------------------------
def _steered(rank, world_size, compressor, steps, clip=None, adam=False):
    model = _model()
    controller = DriftController(raise_above=0.2, lower_below=0.01, byte_budget=3.0, horizon=steps, every=5)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01) if adam else \
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    optimizer = mergecomp.DistributedOptimizer(inner,
                                               model=model, compressor=compressor, schedule=2,
                                               controller=controller)
    sent = []
    for step in range(steps):
        before = optimizer.backend.bytes_sent
        _step(model, optimizer, rank, step, clip)
        sent.append(optimizer.backend.bytes_sent - before)
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    # within the budget, up to how much the configured setting's bytes vary from step to step
    # (the horizon's bytes are estimated from the latest step's)
    if not controller.steps:  # never steered
        return controller.history, sent, weights, True
    per_step = controller.base / controller.steps
    return controller.history, sent, weights, controller.spent <= 1.02 * controller.allowed(controller.base, per_step, 5)


@pytest.mark.parametrize("name", ["topk", "dgc", "powersgd", "efsignsgd", "onebit", "tbq", "terngrad"])
def test_the_controller_raises_lagging_groups_alike_on_every_rank(name):
    # TernGrad's default: its noise (its clip's bias with its rounding's) passes NOISE_THRESHOLDS
    # the low-bit compressors are raised once their memory runs the momentum: the loop clips
    clip = 1e-3 if name in ("efsignsgd", "onebit", "tbq") else None
    (history0, sent0, weights0, within0), (history1, _, weights1, _) = run_ranks(_steered, 2, name, 30, clip)
    assert history0 == history1 and history0, "nothing was raised"
    assert torch.equal(weights0, weights1)
    assert within0  # within the byte budget
    assert max(sent0) > sent0[0]  # a raised group sends more


def _raw_and_compressed(rank, world_size, sends):
    """A fixed plan whose groups go raw or through the compressor, as ``sends`` says."""
    from mergecomp.plan import Group, Plan
    model = _model()
    plan = Plan([Group(("2.bias", "2.weight"), sends[0]), Group(("0.bias", "0.weight"), sends[1])])
    controller = DriftController(raise_above=0.2, lower_below=0.01, every=5)
    topk = mergecomp.compressors.create("topk", compress_ratio=0.05, wire_format="compact8")  # the bytes counted below
    optimizer = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model=model,
                                               compressor=topk, memory="residual", schedule=plan,
                                               controller=controller)
    for step in range(21):
        _step(model, optimizer, rank, step)
    return controller.state_dict()


@pytest.mark.parametrize("name", ["efsignsgd", "onebit", "tbq"])
def test_a_low_bit_compressor_is_not_raised_while_its_memory_folds_the_momentum(name):
    """The loop never clips: the memory folds SGD's momentum, and the bits stay at one."""
    (history0, sent0, _, _), (history1, _, _, _) = run_ranks(_steered, 2, name, 30)
    assert history0 == history1 == [] and max(sent0) < 1.5 * min(sent0)  # (measured steps add a sum)


def test_under_adamw_a_one_bit_compressor_is_raised_though_its_memory_folds_the_first_moment():
    (history0, sent0, weights0, _), (history1, _, weights1, _) = run_ranks(_steered, 2, "efsignsgd", 30, None, True)
    assert history0 == history1 and history0 and torch.equal(weights0, weights1)
    assert max(sent0) > 1.5 * sent0[0]


def test_under_adamw_tbq_keeps_its_own_two_bits():
    (history0, sent0, _, _), (history1, _, _, _) = run_ranks(_steered, 2, "tbq", 30, None, True)
    assert history0 == history1 == [] and max(sent0) < 1.5 * min(sent0)


def test_the_byte_budget_counts_only_the_groups_the_compressor_sent():
    """A raw group's bytes are not the configured setting's: counted, they made a budget of
    thousands of steps (``auto``'s first profile sends every group raw) and the controller
    sent at its highest scale for as long.  Steps with no compressed group count toward
    neither side; a compressed group's payload is the base."""
    state, _ = run_ranks(_raw_and_compressed, 2, ("fp32", "fp32"))
    assert state["base"] == 0.0 and state["spent"] == 0.0 and state["steps"] == 0 and state["idle"] == 21
    assert state["scales"] == {}
    state, _ = run_ranks(_raw_and_compressed, 2, ("fp32", "compress"))
    # group1: 5% of 16·64 + 64 weights, 3 bytes each (8-bit value, 16-bit offset), one block
    # count and the scale, two ranks
    per_step = 2 * (3 * int(0.05 * (16 * 64 + 64)) + 4 + 4)
    assert state["steps"] == 21 and state["idle"] == 0  # steps 0 to 20
    # k rounds down at each scale, and a raised step's fixed bytes (count, scale) count 1/scale
    assert state["base"] == pytest.approx(21 * per_step, rel=0.04)
    assert set(state["scales"]) <= {"group1"}


def _resumed(rank, world_size, folder):
    def build():
        model = _model()
        return model, mergecomp.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model=model, compressor="topk",
            schedule=2, controller=DriftController(raise_above=0.2, lower_below=0.01, byte_budget=3.0, horizon=40, every=5,
                                                   start_scale=1))  # raised by the lag, mid-run

    model, optimizer = build()
    for step in range(40):
        _step(model, optimizer, rank, step)
    straight = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    model, optimizer = build()
    for step in range(20):
        _step(model, optimizer, rank, step)
    path = f"{folder}/ckpt.rank{rank}.pt"
    mergecomp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    model, optimizer = build()
    saved = mergecomp.load(path)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    scales = dict(optimizer.controller.scales)
    for step in range(20, 40):
        _step(model, optimizer, rank, step)
    resumed = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return straight, resumed, scales, dict(optimizer.compressor.__dict__.get("_group_scales", {}))


def test_a_resumed_run_steers_and_trains_bit_for_bit_as_one_that_never_stopped(tmp_path):
    for straight, resumed, scales, _ in run_ranks(_resumed, 2, str(tmp_path)):
        assert scales, "the checkpoint kept no scale"
        assert torch.equal(straight, resumed)


# -- what is told --------------------------------------------------------------------------------
def test_the_none_memory_measures_an_unbiased_compressors_noise():
    from mergecomp import memories
    memory, g = memories.create("none"), torch.randn(4096, generator=torch.Generator().manual_seed(0))
    qsgd = mergecomp.compressors.create("qsgd")
    memory.measuring = True
    sent = memory.compensate(g, "g")
    payload, ctx = qsgd.compress(sent, "g")
    memory.update(sent, "g", qsgd, payload, ctx)
    error, incoming = memory.drift_terms("g")
    decoded = qsgd.decompress(payload, ctx).reshape(-1)
    assert torch.allclose(error, (decoded - g).square().sum()) and torch.allclose(incoming, g.square().sum())
    assert 0 < float(error) and memory.drift_kind == "noise"
    memory.forget_drift()
    topk = mergecomp.compressors.create("topk")  # biased, no error feedback: not a variance
    payload, ctx = topk.compress(memory.compensate(g, "g"), "g")
    memory.update(g, "g", topk, payload, ctx)
    assert memory.drift_terms("g") is None
    memory.measuring = False
    memory.update(memory.compensate(g, "g"), "g", qsgd, *qsgd.compress(g, "g"))
    assert memory.drift_terms("g") is None  # an unmeasured step decodes nothing


def _noisy(rank, world_size, folder, name, controller="auto", adam=False):
    model = _model()
    options = {"randk": {"compress_ratio": 0.25, "unbiased": True}, "atomo": {"budget": 1, "min_compression_rate": 1}}
    compressor = mergecomp.compressors.create(name, **options.get(name, {}))
    inner = torch.optim.AdamW(model.parameters(), lr=0.01) if adam else torch.optim.SGD(model.parameters(), lr=0.05)
    optimizer = mergecomp.DistributedOptimizer(inner, model=model,
                                               compressor=compressor, memory="none", schedule=1,
                                               controller=controller)
    if rank == 0:
        optimizer.add_step_log(mergecomp.StepLog(folder))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(31):
            _step(model, optimizer, rank, step)
    for log in getattr(optimizer, "step_logs", []):
        log.close()
    scales = dict(optimizer.controller.scales) if optimizer.controller is not None else {}
    return (optimizer.drift, scales, [str(w.message) for w in caught],
            [p.detach().clone() for p in model.parameters()])


@pytest.mark.parametrize("name", ["qsgd", "randk"])
def test_an_unbiased_exchange_logs_its_noise_and_is_steered_by_it(tmp_path, name):
    from mergecomp.runtime.controller import NOISE_THRESHOLDS
    from mergecomp.steplog import read_rows
    (reading0, scales0, said, p0), (reading1, scales1, _, p1) = run_ranks(_noisy, 2, str(tmp_path), name)
    assert reading0 == reading1 and reading0.kind == "noise" and reading0.step == 30
    assert 0 <= reading0.noise < math.inf and set(reading0.groups) == {"group0"}
    assert all(torch.equal(a, b) for a, b in zip(p0, p1)) and scales0 == scales1
    if name == "randk":  # unbiased rand-k at a quarter: E‖C(g) − g‖² = (1/ratio − 1)·‖g‖², above the threshold
        assert scales0["group0"] >= 2.0  # raised where the noise passed NOISE_THRESHOLDS
        assert reading0.noise < 0.8 * math.sqrt(3)  # a denser subset is less noisy (√(1/0.5 − 1) at twice)
    rows = read_rows(str(tmp_path))
    measured = [row for row in rows if row["noise"] is not None]
    assert [row["step"] for row in measured] == [0, 10, 20, 30] and all(row["drift"] is None for row in rows)
    assert measured[-1]["noise"] == pytest.approx(reading0.noise, rel=1e-5)  # the log keeps six digits
    if name == "qsgd":  # 7 levels read above the threshold: raised to 8 bits, far less noisy, and held
        first, *raised = [row["noise"] for row in measured]
        assert first > NOISE_THRESHOLDS[0] and all(noise < NOISE_THRESHOLDS[1] for noise in raised)
        assert scales0 == {"group0": 2.0}  # held: 7 levels, a step down, would read above it again
        assert not [m for m in said if "mergecomp:" in m]  # steered: nothing to warn about


def test_unbiased_randk_reads_the_noise_its_density_predicts(tmp_path):
    """Unbiased rand-k at a quarter, nothing steering it: E‖C(g) − g‖² = (1/ratio − 1)·‖g‖²."""
    (reading0, scales0, said0, _), _ = run_ranks(_noisy, 2, str(tmp_path), "randk", "off")
    assert reading0.noise == pytest.approx(math.sqrt(3), rel=0.25) and scales0 == {}
    assert len([m for m in said0 if "compressed gradient is off by" in m]) == 1  # above the threshold: told


@pytest.mark.parametrize("adam", [False, True])
def test_a_noise_above_the_threshold_with_nothing_steering_it_is_told_once_on_rank_0(tmp_path, adam):
    """ATOMO at one atom a matrix: its noise is well above the threshold (under AdamW too,
    where a lag is not warned about)."""
    (reading0, _, said0, _), (_, _, said1, _) = run_ranks(_noisy, 2, str(tmp_path), "atomo", "off", adam)
    from mergecomp.runtime.drift import NOISE_WARN_ABOVE
    assert reading0.kind == "noise" and reading0.noise > NOISE_WARN_ABOVE
    told = [m for m in said0 if "compressed gradient is off by" in m]
    assert len(told) == 1 and not [m for m in said1 if "compressed gradient is off by" in m]
    assert "the quality controller is off" in told[0] and "noise-threshold" in told[0]


def _told(rank, world_size, controller, steps, adam=False, compressor=None, momentum=0.0):
    """The lag warnings a top-k 1% run (or ``compressor``'s) says over ``steps`` steps under
    ``controller`` (with SGD at ``momentum``, or AdamW)."""
    drift.WARN_ABOVE = 0.05  # this process only: a lag any top-k run passes
    model = _model()
    if controller == "held":  # a budget too small for the lag
        controller = DriftController(raise_above=0.05, lower_below=0.01, byte_budget=1.2, front=1, every=5)
    inner = (torch.optim.AdamW(model.parameters(), lr=0.01) if adam
             else torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum))
    compressor = compressor or mergecomp.compressors.create("topk", compress_ratio=0.01)
    optimizer = mergecomp.DistributedOptimizer(inner, model=model, compressor=compressor, controller=controller)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            _step(model, optimizer, rank, step)
    said = [str(w.message) for w in caught if "holds back" in str(w.message)]
    return said if momentum == 0.0 else (said, optimizer.drift.lag, optimizer.communicator.memory.folding)


def test_a_lag_nothing_steers_is_told_once_on_rank_0():
    said0, said1 = run_ranks(_told, 2, "off", 60)
    assert len(said0) == 1 and said1 == []
    assert "the quality controller is off" in said0[0] and "controller='auto'" in said0[0]


def test_under_adamw_the_lag_is_measured_but_not_warned_about():
    said0, said1 = run_ranks(_told, 2, "off", 60, True)
    assert said0 == [] and said1 == []


@pytest.mark.parametrize("name", ["efsignsgd", "randk"])
def test_while_the_memory_folds_the_momentum_the_lag_is_measured_but_not_warned_about(name):
    """EF-SignSGD's memory folds SGD's momentum until the loop clips (this loop never does),
    rand-k's for the run: their lag says nothing about the quality it would warn of."""
    for controller in ("off", "auto"):
        (said0, lag0, folding0), (said1, lag1, _) = run_ranks(
            _told, 2, controller, 40, False, mergecomp.compressors.create(name), 0.9)
        assert folding0 and lag0 == lag1 and lag0 > 0.05  # measured, above the threshold
        assert said0 == [] and said1 == []


def test_a_controller_held_at_its_budget_while_the_lag_stays_high_says_so_once():
    said0, said1 = run_ranks(_told, 2, "held", 80)
    assert len(said0) == 1 and said1 == []
    assert "held at its byte budget (1.2×" in said0[0] and "byte_budget=" in said0[0]


def _clipped_after(rank, world_size, how, momentum=0.9):
    model = _model()
    memory = (mergecomp.memories.create("residual", momentum="optimizer", clip_norm=0.5) if how == "local"
              else "auto")
    optimizer = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum),
                                               model=model, compressor="topk", memory=memory, schedule=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(25):
            x, y = _batch(rank, step)
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if how in ("after", "local"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            elif how == "unscale":  # what GradScaler's unscale does: a power of two
                for p in model.parameters():
                    p.grad.mul_(2.0 ** -8)
            optimizer.step()
    return ([str(w.message) for w in caught if "clips (or rescales)" in str(w.message)],
            optimizer.communicator.memory.loop_clip.threshold)


@pytest.mark.parametrize("how, momentum, told, followed", [
    ("after", 0.0, True, False),   # plain error feedback: the recipe's advice
    ("after", 0.9, False, True),   # SGD's momentum before the exchange: the memory clips there itself, as the
                                   # recipe asks, and the loop's clip is undone: nothing to tell
    ("local", 0.9, False, False), ("unscale", 0.9, False, False), ("none", 0.9, False, False)])
def test_clipping_after_the_exchange_against_the_recipe_is_told_once(how, momentum, told, followed):
    (said0, seen0), (said1, seen1) = run_ranks(_clipped_after, 2, how, momentum)
    assert said1 == []
    assert len(said0) == (1 if told else 0), said0
    assert seen0 == seen1  # every rank reads the same threshold
    # a memory that follows clips each of its groups at the threshold over √(ranks)
    assert (seen0 == pytest.approx(1e-3 / math.sqrt(2), rel=1e-3)) if followed else seen0 is None
    if told:
        assert "clip_norm=YOUR_CLIP / √ranks, momentum='optimizer'" in said0[0]


def _watched_steps(rank, world_size, clip_from, steps):
    """The steps whose averages the clip watch noted, and the threshold it learned, for a loop
    that clips from step ``clip_from`` on (never: None)."""
    model = _model()
    optimizer = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                               model=model, compressor="topk", schedule=1)
    reducer, watched = optimizer.reducer, []
    note = reducer.clip_watch.note

    def counted(buffers):
        watched.append(reducer.lifecycle.settled_step)
        note(buffers)
    reducer.clip_watch.note = counted
    for step in range(steps):
        _step(model, optimizer, rank, step, clip=1e-3 if clip_from is not None and step >= clip_from else None)
    return watched, optimizer.communicator.memory.loop_clip.threshold


def test_the_clip_watch_looks_at_every_step_only_early_then_at_measured_steps():
    every = ClipWatch.every_step_for
    (watched, threshold), _ = run_ranks(_watched_steps, 2, None, every + 25)
    assert threshold is None
    early = [s for s in watched if s < every]
    assert len(early) == every  # every early step
    late = [s for s in watched if s >= every]
    assert late and len(late) <= 3 and all(s % 10 == late[0] % 10 for s in late)  # measured steps only
    # a loop that starts clipping late is still seen, at the next measured step (the memory
    # then clips each group at the threshold over √(ranks)), and from then every step is
    # watched (the loop's clip at that threshold is undone)
    (watched, threshold), (_, other) = run_ranks(_watched_steps, 2, every + 3, every + 25)
    assert threshold == other == pytest.approx(1e-3 / math.sqrt(2), rel=1e-3)
    seen = min(s for s in watched if s >= every + 3)
    assert [s for s in watched if s >= seen] == list(range(seen, every + 25))


# -- every entry point ---------------------------------------------------------------------------
def _hook_reads(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel
    model = DistributedDataParallel(_model())
    state = mergecomp.ddp.register(model, compressor="topk",
                                   controller=DriftController(raise_above=0.2, lower_below=0.01, horizon=30, every=5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(30):
        _step(model, optimizer, rank, step)
    return state.drift, state.controller.history


def test_the_ddp_hook_measures_and_steers():
    (reading0, scales0), (reading1, scales1) = run_ranks(_hook_reads, 2)
    assert reading0 == reading1 and reading0 is not None and reading0.step == 25
    assert scales0 == scales1 and scales0


def _fsdp_reads(rank, world_size, compressor="topk", options=(("compress_ratio", 0.05),)):
    from tests.test_fsdp import _model as fsdp_model
    from tests.test_fsdp import _batch as fsdp_batch
    model = fsdp_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05) if compressor == "topk" else \
        torch.optim.AdamW(model.parameters(), lr=0.01)
    state = mergecomp.fsdp.register(model, compressor=compressor, optimizer=optimizer, **dict(options),
                                    controller=DriftController(raise_above=0.2, lower_below=0.01, horizon=30,
                                                               every=5))
    for step in range(30):
        x, y = fsdp_batch(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    full = [p.full_tensor().detach().clone() for p in model.parameters()]
    return state.drift, state.controller.history, full


@pytest.mark.parametrize("compressor", ["topk", "efsignsgd"])
def test_fsdp_measures_and_steers_each_units_scatter(compressor):
    """Top-k under SGD; EF-SignSGD under AdamW, whose first moment its memory folds."""
    pytest.importorskip("torch.distributed.fsdp")
    options = (("compress_ratio", 0.05),) if compressor == "topk" else ()
    (reading0, history0, full0), (reading1, history1, full1) = run_ranks(_fsdp_reads, 2, compressor, options)
    assert reading0 == reading1 and reading0 is not None and reading0.groups
    assert history0 == history1 and history0, "nothing was raised"
    assert all(torch.equal(a, b) for a, b in zip(full0, full1))


def _diloco_reads(rank, world_size):
    model = _model(rank)
    optimizer = mergecomp.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.05), model=model, sync_every=2,
                                 outer_momentum=0.5, compressor="topk", memory="residual",
                                 controller=DriftController(raise_above=0.05, lower_below=0.01, horizon=20, every=2))
    for step in range(40):
        _step(model, optimizer, rank, step)
    return optimizer.drift, optimizer.controller.history


def test_dilocos_compressed_exchange_is_measured_and_steered():
    (reading0, scales0), (reading1, scales1) = run_ranks(_diloco_reads, 2)
    assert reading0 == reading1 and reading0 is not None
    assert scales0 == scales1 and scales0


# -- what the planner sees -----------------------------------------------------------------------
def test_a_plan_is_priced_at_the_density_the_controller_chose():
    from mergecomp.planning.costmodel import predict
    from mergecomp.planning.profile import with_density
    from mergecomp.plan import Group, Plan
    from tests.test_costmodel import hand_profile
    profile = hand_profile()
    plan = Plan([Group(("a",), "compress"), Group(("b", "c"), "fp32")])
    configured, raised = predict(plan, profile), predict(plan, with_density(profile, 4.0))
    assert raised.groups[0].wire_bytes == 4 * configured.groups[0].wire_bytes
    assert raised.groups[1].wire_bytes == configured.groups[1].wire_bytes  # FP32 sends as it did
    took = lambda g: g.comm_end - g.comm_start
    assert took(raised.groups[0]) > took(configured.groups[0])  # four times the bytes take longer
    assert with_density(profile, 1.0) is profile
    with pytest.raises(ValueError, match="density scale must be a finite number ≥ 1"):
        with_density(profile, 0.5)


def test_a_new_plan_keeps_the_scale_the_groups_sent_at():
    class Knobbed:
        knob = "density"

        def __init__(self):
            self._group_scales = {}

        def set_group_scale(self, name, scale):
            if scale == 1.0:
                self._group_scales.pop(name, None)
            else:
                self._group_scales[name] = scale

    compressor = Knobbed()
    meter = drift.DriftMeter(10, DriftController())
    meter._numels = {"group0": 300, "group1": 100}
    meter.controller.scales = {"group0": 4.0}  # overall 3.25: the new groups start at 2
    meter.regrouped(compressor, ["group0", "group1", "group2"])
    assert meter.controller.scales == {"group0": 2.0, "group1": 2.0, "group2": 2.0}
    assert compressor._group_scales == meter.controller.scales
    meter.controller.scales = {}
    meter.regrouped(compressor, ["group0"])
    assert meter.controller.scales == {} and compressor._group_scales == {}


def test_a_group_that_gave_back_for_the_budget_waits_before_rising_again():
    controller = DriftController(raise_above=1.0, lower_below=0.1, byte_budget=1.5, max_scale=16.0, front=1,
                                 patience=3)
    weights = {"group0": 1.0}
    scales = []
    for step in range(0, 600, 10):
        controller.decide(_reading(step, group0=50.0), weights, 10)
        scales.append(controller.scales.get("group0", 1.0))
    changes = sum(a != b for a, b in zip(scales[20:], scales[21:]))
    assert changes <= len(scales[20:]) // 3, scales  # at most one change in `patience` decisions, not every one