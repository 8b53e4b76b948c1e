"""The hierarchical communicator on 4 real gloo ranks laid out as 2 nodes × 2 ranks, and the
node layout it reads."""
import os

import pytest
import torch
import torch.nn as nn

import mergecomp
from mergecomp import communicators, compressors, memories
from mergecomp.distributed.backends.torch_dist import TorchDistributedBackend
from mergecomp.planning.measure import measure_link_costs
from mergecomp.runtime import regroup
from mergecomp.distributed.topology import LOCAL_SIZE_VARIABLE, NodeLayout, node_layout
from tests.distributed import run_ranks

LENGTHS = (1, 3, 7, 1001)  # fewer elements than ranks per node, odd, and not divisible


def as_node(rank, local_size=2):
    """This process as torchrun starts local rank ``rank % L`` of node ``rank // L``."""
    os.environ.update(LOCAL_RANK=str(rank % local_size), LOCAL_WORLD_SIZE=str(local_size),
                      GROUP_RANK=str(rank // local_size))


def gradient(step, rank, numel):
    """Small integers: every order of summation (node first, or flat) gives the same floats."""
    g = torch.Generator().manual_seed(7919 * step + 31 * rank + numel)
    return torch.randint(-8, 9, (numel,), generator=g).float()


def make(kind, compressor, memory="none", backend=None, **kwargs):
    compressor = compressors.create(compressor) if isinstance(compressor, str) else compressor
    return communicators.create(kind, compressor=compressor, memory=memories.create(memory),
                                backend=backend or TorchDistributedBackend(), **kwargs)


def exchange(communicator, tensor, name):
    result = communicator.finish(communicator.start(tensor.clone(), name))
    communicator.commit()
    return result


# --------------------------------------------------------------------------- the layout
def test_layout_from_launchers_and_overrides():
    torchrun = {"TORCHELASTIC_RUN_ID": "j", "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    layout = node_layout(5, 8, environ=torchrun)
    assert (layout.node, layout.local_rank, layout.num_nodes) == (1, 1, 2)
    assert layout.node_ranks(1) == [4, 5, 6, 7] and layout.peer_ranks(1) == [1, 5]
    mpi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "h"}
    assert node_layout(3, 4, environ=mpi).node == 1
    assert node_layout(3, 4, environ=dict(mpi, **{LOCAL_SIZE_VARIABLE: "1"})).num_nodes == 4
    assert node_layout(3, 4, local_size=4, environ=mpi).num_nodes == 1
    assert node_layout(0, 1, environ={}).local_size == 1


@pytest.mark.parametrize("kwargs, fragment", [
    ({"local_size": 3}, "world size 4 is not a multiple of 3"),
    ({"local_size": 0}, "local_size must be an int ≥ 1"),
    ({"environ": {LOCAL_SIZE_VARIABLE: "two"}}, "'two'"),
    ({"environ": {"TORCHELASTIC_RUN_ID": "j", "RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "0",
                  "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}}, "consecutive ranks"),
])
def test_bad_layouts_are_refused(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        node_layout(1, 4, **kwargs)


def test_layout_checks_its_fields():
    with pytest.raises(TypeError, match="local_size"):
        NodeLayout(0, 4, 2.0)


# --------------------------------------------------------------------------- exactness
def exact_worker(rank, world_size):
    as_node(rank)
    backend = TorchDistributedBackend()
    flat = make("allreduce", "none", backend=backend)
    cases = [("allreduce", "none"), ("allreduce", "fp16"), ("allgather", "none"), ("ps", "none")]
    for inner, name in cases:
        hierarchical = make("hierarchical", name, backend=backend, inner=inner)
        assert hierarchical.layout.num_nodes == 2 and hierarchical.layout.local_rank == rank % 2
        for numel in LENGTHS:
            for step in range(2):
                g = gradient(step, rank, numel)
                want = exchange(flat, g, f"n{numel}")
                got = exchange(hierarchical, g, f"n{numel}")
                assert got.shape == g.shape and torch.equal(got, want), (inner, name, numel, got, want)
    # the bytes of the node groups (allreduce, allgather, the PS's all-to-all) count in the job's backend
    ps = make("hierarchical", "none", backend=backend, inner="ps")
    before = (backend.bytes_sent, ps.inter.bytes_sent, ps.intra.bytes_sent)
    exchange(ps, gradient(0, rank, 1001), "counted")
    inter, intra = ps.inter.bytes_sent - before[1], ps.intra.bytes_sent - before[2]
    assert inter > 0 and intra > 0 and backend.bytes_sent - before[0] == inter + intra
    return True


def test_hierarchical_equals_flat_on_two_nodes_of_two():
    assert run_ranks(exact_worker, 4) == [True] * 4


# --------------------------------------------------------------------------- error feedback per shard
def feedback_worker(rank, world_size):
    as_node(rank)
    backend = TorchDistributedBackend()
    topk = compressors.create("topk", compress_ratio=0.1)
    hierarchical = make("hierarchical", topk, memory="residual", backend=backend)
    numel = 101
    node = [gradient(0, r, numel) for r in (rank - rank % 2, rank - rank % 2 + 1)]
    node_sum = node[0] + node[1]
    exchange(hierarchical, gradient(0, rank, numel), "g")
    residuals = hierarchical.state_dict()["memory"]
    shard = f"g/shard{rank % 2}"
    first, end = (0, 51) if rank % 2 == 0 else (51, 101)
    kept = next(iter(residuals.values()))
    assert shard in kept and list(kept) == [shard], kept
    residual = kept[shard]
    assert residual.numel() == end - first
    mine = node_sum[first:end]
    sent = residual != mine  # top-k sent exactly those coordinates: their residual is zero
    assert int(sent.sum()) == 5 and torch.all(residual[sent] == 0), residual
    # a dropped step leaves the shard's residual as it was
    hierarchical.finish(hierarchical.start(gradient(1, rank, numel), "g"))
    hierarchical.rollback()
    assert torch.equal(hierarchical.state_dict()["memory"][next(iter(residuals))][shard], residual)
    # the links' costs, probed through the node groups, count in no backend
    counted = (backend.bytes_sent, hierarchical.inter.bytes_sent, hierarchical.intra.bytes_sent)
    costs = measure_link_costs(hierarchical, sizes=(2 ** 10, 2 ** 12))
    assert sorted(costs) == ["inter_allgather", "inter_allreduce", "intra_allgather", "intra_allreduce"]
    assert (backend.bytes_sent, hierarchical.inter.bytes_sent, hierarchical.intra.bytes_sent) == counted
    assert hierarchical.hierarchy == {"local_size": 2, "inner": "allgather", "gather": "allreduce"}
    # the residual is per shard: a plan switch cannot move it and says so
    with pytest.raises(regroup.CannotRegroup):
        regroup.regroup_state(hierarchical.state_dict(), {"g": [("w", 0, numel)]}, {"g": [("w", 0, numel)]})
    return True


def test_error_feedback_is_kept_per_shard():
    assert run_ranks(feedback_worker, 4) == [True] * 4


# --------------------------------------------------------------------------- refusals
def refusal_worker(rank, world_size, case):
    backend = TorchDistributedBackend()
    if case == "disagree":
        as_node(rank, 2 if rank else 4)
    elif case == "unreadable":
        as_node(rank)
        if rank == 3:
            os.environ["LOCAL_RANK"] = "0"
    elif case == "inner":
        as_node(rank)
    with pytest.raises(ValueError) as error:
        make("hierarchical", "none", backend=backend, inner="hierarchical" if case == "inner" else None)
    return str(error.value)


@pytest.mark.parametrize("case, fragment", [
    ("disagree", "ranks disagree on the ranks per node (2 on ranks 1"),
    ("unreadable", "rank 3: rank 3 has local rank 0"),
    ("inner", "inner must name the communicator between nodes"),
])
def test_bad_layouts_are_refused_on_every_rank(case, fragment):
    messages = run_ranks(refusal_worker, 4, case)
    assert all(fragment in message for message in messages), messages


# --------------------------------------------------------------------------- training
def training_worker(rank, world_size):
    as_node(rank)
    torch.manual_seed(0)
    results = {}
    for communicator in ("allgather", "hierarchical"):
        model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))
        torch.manual_seed(0)
        model.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()})
        optimizer = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                                   compressor="fp16", memory="none",
                                                   communicator=communicator, schedule=2)
        data = torch.Generator().manual_seed(rank)
        for _ in range(3):
            optimizer.zero_grad()
            x = torch.randn(4, 6, generator=data)
            model(x).pow(2).mean().backward()
            optimizer.step()
        results[communicator] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert "inner='allreduce'" in repr(optimizer.communicator)
    torch.testing.assert_close(results["hierarchical"], results["allgather"], rtol=2e-3, atol=2e-3)
    # DDP's hook over the same exchange, the layout given as an option
    from torch.nn.parallel import DistributedDataParallel
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    state = mergecomp.ddp.register(ddp, compressor="fp16", communicator="hierarchical",
                                   communicator_options={"local_size": 2, "inner": "allgather"})
    for _ in range(2):
        optimizer.zero_grad()
        ddp(torch.randn(4, 6, generator=data)).pow(2).mean().backward()
        optimizer.step()
    assert state.communicator.layout.num_nodes == 2
    return results["hierarchical"], torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_training_with_communicator_hierarchical():
    results = run_ranks(training_worker, 4)
    for params in zip(*results):
        assert all(torch.equal(params[0], p) for p in params[1:])


# --------------------------------------------------------------------------- the cost model
def two_node_profile(communicator):
    """4 ranks in 2 nodes of 2; the flat allgather and the links between nodes at 2 ms/byte,
    inside a node 100 times faster."""
    from mergecomp.planning.profile import LinearCost
    from tests.test_costmodel import hand_profile
    import dataclasses
    base = hand_profile(communicator=communicator, world=4)
    slow, fast = LinearCost(0.3, 0.002), LinearCost(0.003, 0.00002)
    return dataclasses.replace(base, collectives=dict(
        base.collectives, allgather=slow, inter_allgather=slow, inter_allreduce=slow,
        intra_allreduce=fast, intra_allgather=fast), hierarchy={"local_size": 2, "inner": "allgather"})


def test_the_cost_model_prices_hierarchical_and_flat():
    from mergecomp.plan import Group, Plan
    from mergecomp.planning.costmodel import predict, priced_collectives, send_costs
    from mergecomp.planning.profile import Profile
    plan = Plan([Group(("a", "b", "c"), "compress")])
    flat, hierarchical = two_node_profile("allgather"), two_node_profile("hierarchical")
    cost = send_costs(hierarchical)["compress"]
    # 400 elements: a shard of 200 per rank, 1 byte each on the wire, among 2 nodes
    assert cost.wire(400, 4) == pytest.approx(200)
    assert cost.collective(cost.wire(400, 4)) == pytest.approx(0.3 + 0.002 * 200)
    # the node's links, which start() and finish() wait for: the node sum (allreduce of
    # 4·400 bytes) before the shard's encoding, the shards' allgather (4·200) after its
    # decoding (2 nodes' payloads of 200 elements, 0.2 s each)
    assert cost.relay(400) == 0
    assert cost.encode(400) == pytest.approx(0.1 + 0.001 * 200 + 0.003 + 0.00002 * 1600)
    assert cost.decode(400) == pytest.approx(2 * 0.2 + 0.003 + 0.00002 * 800)
    assert cost.memory_share == 0.5  # error feedback runs on this rank's shard only
    assert predict(plan, hierarchical).iteration_time < predict(plan, flat).iteration_time
    assert "intra_allreduce" in priced_collectives("hierarchical")
    assert Profile.from_json(hierarchical.to_json()).hierarchy == {"local_size": 2, "inner": "allgather"}


# --------------------------------------------------------------------------- one node
def one_node_worker(rank, world_size, local_size):
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make("hierarchical", "topk", "residual", local_size=local_size)
    # No rank leaves before every rank has made its groups: rank 0 hosts the store they use.
    torch.distributed.barrier()
    return [str(w.message) for w in caught if "hierarchical communicator runs on one node" in str(w.message)]


def test_on_one_node_rank_0_says_to_use_a_flat_communicator():
    """One node of 2 ranks: nothing crosses a slow link and the bytes double; said once per job."""
    warned, other = run_ranks(one_node_worker, 2, 2)
    assert len(warned) == 1 and other == [], (warned, other)
    assert "(2 ranks per node, from local_size=, for all 2 ranks)" in warned[0]
    assert "about 2x the bytes of an FP32 allreduce" in warned[0]
    assert "use a flat communicator (communicator='allgather', TopKCompressor's recommendation)" in warned[0]
    assert "MERGECOMP_LOCAL_SIZE" in warned[0]
    assert run_ranks(one_node_worker, 2, 1) == [[], []]  # two nodes of one rank: nothing to say
