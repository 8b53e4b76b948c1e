"""The auto and binary schedulers driving a real 2-rank run: they settle on the same plan."""
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
    assert steps <= 1 + 2 + 2 * 7 * 2 + 1  # two rounds of at most 7 candidates, 2 steps a visit
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


def test_auto_check_rounds_keep_only_the_contenders():
    scheduler = mergecomp.schedulers.create("auto", contender_margin=0.15, log=None)
    scheduler._times = {0: [1.0, 1.2], 1: [1.1, 1.3], 2: [2.0, 2.1], 3: []}
    assert scheduler._contenders() == [0, 1]  # medians 1.1, 1.2 (within 15%), 2.05 out, 3 unmeasured
    scheduler._times = {}
    assert scheduler._contenders() == []


def test_auto_scheduler_refuses_bad_check_settings():
    import pytest
    with pytest.raises(ValueError, match="check_rounds"):
        mergecomp.schedulers.create("auto", check_rounds=0)
    with pytest.raises(ValueError, match="contender_margin"):
        mergecomp.schedulers.create("auto", contender_margin=-0.1)
