"""The hierarchical exchange's per-shard state follows plan switches exactly: folded into
whole groups, regrouped, cut into shards again (mergecomp.communicators.shard_state), on 4
gloo ranks laid out as 2 nodes × 2 ranks."""
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import mergecomp
from mergecomp.communicators.shard_state import fold_shards
from mergecomp.plan import Plan
from mergecomp.runtime.regroup import CannotRegroup
from tests.distributed import run_ranks
from tests.test_hierarchical import as_node


def halves(numel):
    """Local rank 1's shard of a 2-rank node: the second ⌈n/2⌉-aligned half."""
    length = -(-numel // 2)
    return min(length, numel), numel


def test_fold_places_the_shard_and_keeps_what_cannot_move():
    state = {"memory": {"residuals": {"g0/shard1": torch.tensor([1., 2.]), "g1": torch.ones(3),
                                      "g1/shard1": torch.tensor([5.])}},
             "compressor": {"steps": {"g0/shard1": 4}, "queries": {"g0/shard1": {"w": torch.ones(2)}},
                            "other": {"g0/shard0": torch.ones(2)}}}
    folded = fold_shards(state, {"g0": 4, "g1": 3}, 1, halves)
    assert torch.equal(folded["memory"]["residuals"]["g0"], torch.tensor([0., 0., 1., 2.]))
    assert torch.equal(folded["memory"]["residuals"]["g1"], torch.tensor([1., 1., 6.]))
    assert set(folded["memory"]["residuals"]) == {"g0", "g1"}
    assert folded["compressor"]["steps"] == {"g0": 4}  # a counter: regrouping restarts it
    assert "g0/shard1" in folded["compressor"]["queries"]  # a matrix of a shard stays put
    assert "g0/shard0" in folded["compressor"]["other"]  # another local rank's key: not this rank's
    assert torch.equal(state["memory"]["residuals"]["g1"], torch.ones(3))  # the input is unchanged


def owed(optimizer, field):
    """Σ over ranks of what the memory's ``field`` holds, per element of the model in
    parameter order, whatever the plan (the hierarchical shards folded into whole groups)."""
    reducer = optimizer.reducer
    layout = reducer.layout(reducer.plan)
    sizes = {g: sum(stop - start for _, start, stop in pieces) for g, pieces in layout.items()}
    held = reducer.lifecycle.fold_shard_state(reducer.compression_state(), sizes)["memory"][field]
    per_param = {name: torch.zeros(p.numel()) for name, p in reducer.params}
    for group, pieces in layout.items():
        flat, offset = held.get(group), 0
        for name, start, stop in pieces:
            if flat is not None:
                per_param[name][start:stop] += flat[offset:offset + stop - start]
            offset += stop - start
    total = torch.cat(list(per_param.values()))
    dist.all_reduce(total)
    return total


def switch_worker(rank, world_size, memory):
    as_node(rank)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 1))
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.0 if memory == "dgc" else 0.9)
    optimizer = mergecomp.DistributedOptimizer(
        sgd, model=model, compressor=mergecomp.compressors.create("topk", compress_ratio=0.2),
        memory=memory, communicator="hierarchical", schedule=2)
    data = torch.Generator().manual_seed(rank)
    fields = ["residuals"] if memory == "residual" else ["momenta", "velocities"]

    def train(steps):
        for _ in range(steps):
            optimizer.zero_grad()
            model(torch.randn(8, 7, generator=data)).pow(2).mean().backward()
            optimizer.step()

    def keys():
        return {key for field in fields for key in optimizer.memory.state_dict()[field]}

    def fixed(fusion, send="compress"):
        order = [n for g in optimizer.plan.groups for n in g.names]
        plan = mergecomp.schedulers.create("fixed", fusion_num=fusion).plan(optimizer.param_infos(order))
        return Plan([dataclasses.replace(group, send=send) for group in plan.groups])

    train(2)
    assert keys() and all("/shard" in key for key in keys()), keys()
    checks = []
    for plan in (fixed(3, "compress:allgather"), fixed(0), fixed(2, "fp16"), fixed(1)):
        before = [owed(optimizer, field) for field in fields]
        optimizer.set_plan(plan)
        after = [owed(optimizer, field) for field in fields]
        checks.append(all(torch.allclose(b, a, atol=1e-6) for b, a in zip(before, after)))
        hierarchical = plan.groups[0].send == "compress"
        assert all(("/shard" in key) == hierarchical for key in keys()), (plan, keys())
        train(2)
    parameters = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return checks, parameters


@pytest.mark.parametrize("memory", ["residual", "dgc"])
def test_plan_switches_move_per_shard_state_exactly(memory):
    results = run_ranks(switch_worker, 4, memory)
    for checks, _ in results:
        assert checks == [True] * 4, checks
    first = results[0][1]
    assert all(torch.equal(first, parameters) for _, parameters in results[1:])


def lowrank_worker(rank, world_size):
    as_node(rank)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 2))
    optimizer = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model=model,
                                               compressor="batched_powersgd", communicator="hierarchical", schedule=1)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 32)).pow(2).mean().backward()
        optimizer.step()
    assert optimizer.compressor.state_dict()["queries"]
    order = [n for g in optimizer.plan.groups for n in g.names]
    plan = mergecomp.schedulers.create("fixed", fusion_num=0).plan(optimizer.param_infos(order))
    with pytest.raises(CannotRegroup):
        optimizer.set_plan(plan)
    return True


def test_state_of_a_shard_that_cannot_move_keeps_the_plan():
    assert run_ranks(lowrank_worker, 4) == [True] * 4


def auto_worker(rank, world_size):
    as_node(rank)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    scheduler = mergecomp.schedulers.create("auto", profile_steps=2, check_steps=1, check_rounds=2, log=None)
    optimizer = mergecomp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), model=model, communicator="hierarchical",
        compressor=mergecomp.compressors.create("topk", compress_ratio=0.1), schedule=scheduler)
    data = torch.Generator().manual_seed(rank)
    steps = 0
    while not (steps > 1 and scheduler.settled) and steps < 80:
        optimizer.zero_grad()
        model(torch.randn(32, 16, generator=data)).pow(2).mean().backward()
        optimizer.step()
        steps += 1
    sends = {group.send for _, plan, _, _ in scheduler.report for group in plan.groups}
    measured = [figure for _, _, _, figure in scheduler.report]
    return scheduler.settled, sends, measured, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_auto_races_flat_against_hierarchical_plans():
    """Every candidate of the check is measured, none skipped for its state: flat
    (``compress:<communicator>``) and hierarchical plans alike."""
    results = run_ranks(auto_worker, 4)
    for settled, sends, measured, _ in results:
        assert settled and all(isinstance(figure, float) for figure in measured), measured
        assert "compress" in sends and any(send.startswith("compress:") for send in sends), sends
    assert all(torch.equal(results[0][3], r[3]) for r in results[1:])


def ddp_worker(rank, world_size):
    import warnings
    from torch.nn.parallel import DistributedDataParallel
    as_node(rank)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.002)  # several buckets, rebuilt after step 1
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.05)
    state = mergecomp.ddp.register(ddp, compressor=mergecomp.compressors.create("topk", compress_ratio=0.2),
                                   memory="residual", communicator="hierarchical", optimizer=sgd)
    data = torch.Generator().manual_seed(rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            sgd.zero_grad()
            ddp(torch.randn(8, 16, generator=data)).pow(2).mean().backward()
            sgd.step()
    lost = [str(w.message) for w in caught if "could not follow" in str(w.message)]
    keys = set(state.communicator.state_dict()["memory"]["residuals"])
    return lost, keys, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_ddp_rebucketing_keeps_the_per_shard_state():
    """DDP rebuilds its buckets after the first step: the hierarchical exchange's error
    feedback follows them (before, it started afresh with a warning)."""
    results = run_ranks(ddp_worker, 4)
    for lost, keys, _ in results:
        assert not lost, lost
        assert keys and all("/shard" in key for key in keys), keys
    assert all(torch.equal(results[0][2], r[2]) for r in results[1:])
