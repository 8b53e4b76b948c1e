"""The sparse allreduce: exact against the allgather when it keeps the union, its wire
bytes as its docstring's formula says, non-finite values seen by every rank, bad options
refused."""
import math

import pytest
import torch
import torch.nn as nn

import mergecomp
from mergecomp import communicators, compressors, memories
from mergecomp.distributed.backends.serialize import HeaderError
from mergecomp.distributed.backends.torch_dist import TorchDistributedBackend
from mergecomp.communicators.ps import shard_sizes
from mergecomp.communicators.sparse_allreduce import SHAPE_HEADER_BYTES
from tests.distributed import run_ranks

SPARSIFIERS = [("topk", {"compress_ratio": 0.05}), ("dgc", {"compress_ratio": 0.05, "warmup": 0}),
               ("dgc", {"compress_ratio": 0.05, "warmup": 0, "fp16_values": True, "wire_format": "indexed"}),
               ("graddrop", {"compress_ratio": 0.05, "min_samples": 16})]


def gradient(step, rank, numel):
    g = torch.Generator().manual_seed(7919 * step + 31 * rank + numel)
    tensor = torch.randn(numel, generator=g)
    tensor[: max(1, numel // 50)] += 5.0  # every rank selects some of the same coordinates
    return tensor


def make(kind, name, kwargs, memory="none", backend=None, **options):
    return communicators.create(kind, compressor=compressors.create(name, **kwargs),
                                memory=memories.create(memory), backend=backend or TorchDistributedBackend(),
                                **options)


def a8(nbytes):
    return (nbytes + 7) // 8 * 8


def exact_worker(rank, world_size):
    backend = TorchDistributedBackend()
    for name, kwargs in SPARSIFIERS:
        gather = make("allgather", name, kwargs, backend=backend)
        sparse = make("sparse_allreduce", name, kwargs, backend=backend, keep=None)
        for numel in (2, 7, 1001):  # shorter than the world (empty partitions) and not divisible by it
            tensor = gradient(0, rank, numel)
            expected = gather.finish(gather.start(tensor.clone(), "g"))
            got = sparse.finish(sparse.start(tensor.clone(), "g"))
            assert torch.equal(got, expected), (name, kwargs, numel, (got - expected).abs().max())
    return True


def test_the_exact_mode_is_the_allgathers_sum_bit_for_bit():
    assert all(run_ranks(exact_worker, 3))


def wire_worker(rank, world_size, numel, ratio):
    backend = TorchDistributedBackend()
    out = {}
    for keep in (1.0, 2.0, None):
        sparse = make("sparse_allreduce", "topk", {"compress_ratio": ratio, "wire_format": "indexed"},
                      backend=backend, keep=keep)
        tensor = gradient(1, rank, numel)
        before = backend.wire_bytes
        handle = sparse.start(tensor.clone(), "g")
        values, indices = handle.payload
        sparse.finish(handle)
        measured = backend.wire_bytes - before
        parts = shard_sizes(numel, world_size)
        lo = sum(parts[:rank])
        k = values.numel()
        m = int(((indices.long() < lo) | (indices.long() >= lo + parts[rank])).sum())
        pair = values.element_size() + indices.element_size()
        phase1 = 8 * world_size * (world_size - 1) + pair * m
        if keep is None:
            kept = None  # the largest union: read from what the ranks received
        else:
            kept = min(math.ceil(keep * k / world_size), max(parts))
            phase2 = (world_size - 1) * (SHAPE_HEADER_BYTES + a8(4 * kept) + a8(4 * kept))
            assert measured == phase1 + phase2, (keep, measured, phase1 + phase2)
        out[keep] = (measured, phase1, k)
    gather = make("allgather", "topk", {"compress_ratio": ratio, "wire_format": "indexed"}, backend=backend)
    before = backend.wire_bytes
    gather.finish(gather.start(gradient(1, rank, numel), "g"))
    out["allgather"] = backend.wire_bytes - before
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_wire_bytes_follow_the_formula_and_do_not_grow_with_n(world_size):
    numel, ratio = 40_000, 0.01
    results = run_ranks(wire_worker, world_size, numel, ratio)
    for out in results:
        k = out[1.0][2]
        assert out["allgather"] == (world_size - 1) * 8 * k  # k values and k int32 indices per peer
        # keep=1: about 2·k·(N−1)/N pairs, whatever N is
        assert out[1.0][0] <= 8 * k + (world_size - 1) * (SHAPE_HEADER_BYTES + 8 * (k // world_size + 1)) \
            + 8 * world_size * (world_size - 1)
        # the exact mode's second phase is N−1 copies of the largest union plus the shape header
        measured, phase1, _ = out[None]
        union = (measured - phase1 - (world_size - 1) * SHAPE_HEADER_BYTES) / (world_size - 1)
        assert union % 8 == 0 and 0 < union <= 8 * min(world_size * k, math.ceil(numel / world_size))
    if world_size == 4:
        assert all(out["allgather"] >= 1.4 * out[1.0][0] for out in results)


def compact_worker(rank, world_size, numel, name="topk", options=None):
    backend = TorchDistributedBackend()
    out = {}
    for wire_format in ("compact", "compact8", "tight8", "indexed"):
        sparse = make("sparse_allreduce", name, {"compress_ratio": 0.02, "wire_format": wire_format, **(options or {})},
                      backend=backend)
        before = backend.wire_bytes
        handle = sparse.start(gradient(4, rank, numel), "g")
        result = sparse.finish(handle)
        out[wire_format] = (backend.wire_bytes - before, result)
    return out


def test_the_compact_wire_halves_both_phases_and_sums_the_same_coordinates():
    """Phase 1 sends each partition's pairs as 16-bit values and offsets, phase 2 the owners'
    kept sums the same way: about half the indexed bytes, and the owners keep the same
    coordinates (but near-ties of the rounded sums), their sums within bf16's rounding."""
    for out in run_ranks(compact_worker, 4, 40_000):
        (compact, got), (indexed, expected) = out["compact"], out["indexed"]
        assert compact < 0.6 * indexed, (compact, indexed)
        both = (got != 0) & (expected != 0)
        assert int(both.sum()) >= 0.95 * int((expected != 0).sum())
        torch.testing.assert_close(got[both], expected[both], rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("name, options", [("topk", {}), ("dgc", {"warmup": 0})])
def test_the_8_bit_wire_travels_as_the_16_bit_one_in_both_phases(name, options):
    """An 8-bit payload (top-k's; DGC's, whose count varies; on either 8-bit wire) is
    unpacked and its values (exact in bf16) sent on the 16-bit block wire: the same bytes as
    the compact wire's, the sums within e4m3's rounding."""
    for out in run_ranks(compact_worker, 4, 40_000, name, options):
        (eight, got), (compact, _), (_, expected) = out["compact8"], out["compact"], out["indexed"]
        assert eight == compact
        tight, tight_got = out["tight8"]
        assert tight == eight and torch.equal(tight_got, got)
        both = (got != 0) & (expected != 0)
        assert int(both.sum()) >= 0.9 * int((expected != 0).sum())
        torch.testing.assert_close(got[both], expected[both], rtol=2 ** -3, atol=1e-6)


def nonfinite_worker(rank, world_size, keep, bad):
    backend = TorchDistributedBackend()
    sparse = make("sparse_allreduce", "topk", {"compress_ratio": 0.01}, backend=backend, keep=keep)
    tensor = gradient(2, rank, 5000)
    if rank == 1:
        tensor[4321] = bad  # in the last rank's partition; topk picks it on rank 1 only
    handle = sparse.start(tensor, "g")
    average = sparse.finish(handle)
    return bool(sparse.nonfinite_flag(handle, average))


@pytest.mark.parametrize("keep", [1.0, None])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_value_on_one_rank_is_seen_by_every_rank(keep, bad):
    assert run_ranks(nonfinite_worker, 3, keep, bad) == [True] * 3


def residual_worker(rank, world_size):
    backend = TorchDistributedBackend()
    exact = make("sparse_allreduce", "topk", {"compress_ratio": 0.02}, backend=backend, keep=None)
    sparse = make("sparse_allreduce", "topk", {"compress_ratio": 0.02}, "residual", backend=backend)
    assert sparse.owner_residual
    tensor = gradient(3, rank, 3000)
    expected = exact.finish(exact.start(tensor.clone(), "g"))
    got = sparse.finish(sparse.start(tensor.clone(), "g"))
    residual = sparse.owner_residuals[f"g/owner"]
    sparse.rollback()
    rolled_back = "g/owner" not in sparse.owner_residuals
    return expected, got, residual, rolled_back


def test_what_owners_drop_stays_in_their_residual():
    results = run_ranks(residual_worker, 3)
    expected, got = results[0][0], results[0][1]
    residuals = torch.cat([r[2] for r in results])  # partition order = rank order
    torch.testing.assert_close(got + residuals / 3, expected)
    assert (got != 0).sum() <= 3 * math.ceil(int(3000 * 0.02) / 3)
    assert all(r[3] for r in results)  # rollback forgets the step's owner residual


def randk_worker(rank, world_size):
    backend = TorchDistributedBackend()
    tensor = gradient(4, rank, 1000)
    by_sparse = make("sparse_allreduce", "randk", {"compress_ratio": 0.1}, backend=backend)
    by_allreduce = make("allreduce", "randk", {"compress_ratio": 0.1}, backend=backend)
    before = backend.collectives
    left = by_sparse.finish(by_sparse.start(tensor.clone(), "g"))
    assert backend.collectives == before + 1  # one allreduce of the shared-index values
    return torch.equal(left, by_allreduce.finish(by_allreduce.start(tensor.clone(), "g")))


def test_shared_index_randk_is_summed_by_one_allreduce():
    assert all(run_ranks(randk_worker, 2))


class _Backend:
    rank, size = 0, 1


@pytest.mark.parametrize("options, message", [
    ({"keep": 0}, "keep must be a positive number"), ({"keep": -1.0}, "keep must be a positive number"),
    ({"keep": float("nan")}, "keep must be a positive number"), ({"keep": True}, "keep must be"),
    ({"keep": "1"}, "keep must be"), ({"owner_residual": "yes"}, "owner_residual must be")])
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        make("sparse_allreduce", "topk", {}, backend=_Backend(), **options)


@pytest.mark.parametrize("name", ["qsgd", "signsgd", "atomo"])
def test_compressors_it_cannot_split_by_index_are_refused(name):
    with pytest.raises(ValueError, match="cannot carry compressor .* Use communicator='allgather'"):
        make("sparse_allreduce", name, {}, backend=_Backend())


def corrupt_worker(rank, world_size, wire_format="indexed"):
    backend = TorchDistributedBackend()
    sparse = make("sparse_allreduce", "topk", {"compress_ratio": 0.1, "wire_format": wire_format}, backend=backend)
    if rank == 1:  # a peer that sends indices outside the partition it sends them to
        original = backend.alltoall

        def alltoall(chunks, limit=None):
            bad = [c.clone() for c in chunks]
            if bad[0].numel() and wire_format == "indexed":  # the last index: 65,535
                bad[0][-4:] = torch.tensor([255, 255, 0, 0], dtype=torch.uint8)
            elif bad[0].numel() > 4:  # compact: the first offset, 60 in a partition of 50
                pairs = (bad[0].numel() - 4) // 4
                bad[0][2 * pairs:2 * pairs + 2] = torch.tensor([60 - 32768], dtype=torch.int16).view(torch.uint8)
            return original(bad, limit)
        backend.alltoall = alltoall
    try:
        sparse.finish(sparse.start(torch.arange(100.0).flip(0), "g"))
    except HeaderError as error:
        return str(error)
    except RuntimeError:  # rank 1: its peer left the collective after refusing the pairs
        return None
    return None


def test_a_peer_sending_indices_outside_the_partition_is_named():
    results = run_ranks(corrupt_worker, 2)
    assert results[0] is not None and "rank 1" in results[0] and "outside the partition" in results[0]
    compact = run_ranks(corrupt_worker, 2, "compact")
    assert compact[0] is not None and "rank 1" in compact[0] and "names coordinate 60 of a group of 50" in compact[0]


def training_worker(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         model.named_parameters(), compressor="topk",
                                         memory="residual", communicator="sparse_allreduce", schedule=2)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 10, generator=g)
    y = x.sum(1, keepdim=True) * 0.3
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return losses[0], losses[-1], params


def test_distributed_optimizer_trains_through_the_sparse_allreduce():
    results = run_ranks(training_worker, 2)
    for first, last, _ in results:
        assert last < 0.5 * first, (first, last)
    torch.testing.assert_close(results[0][2], results[1][2])  # replicas stay identical


def test_the_cost_model_prices_it_and_plans_with_it():
    from mergecomp.planning.costmodel import communicator_formula, predict, priced_collectives, send_costs
    from mergecomp.plan import Group, Plan
    from mergecomp.planning.optimal import OptimalScheduler
    from tests.test_costmodel import hand_profile

    cls = communicator_formula("sparse_allreduce")
    assert priced_collectives("sparse_allreduce") == ("alltoall", "allgather")
    assert send_costs(hand_profile(communicator="sparse_allreduce", world=8))["compress"] == \
        cls.send_cost(hand_profile().codecs["toy"], hand_profile(communicator="sparse_allreduce", world=8))
    from mergecomp.planning.costmodel import group_cost

    def channel(name, world):  # seconds on the channel for a group of a million elements
        profile = hand_profile(communicator=name, world=world)
        return group_cost(send_costs(profile)["compress"], profile.copy, 10 ** 6, 4 * 10 ** 6).communicate
    # two collectives and the owner's work: dearer than one allgather on 2 ranks, cheaper
    # once the allgather carries 1/N of the payload
    assert channel("sparse_allreduce", 2) > channel("allgather", 2)
    assert channel("sparse_allreduce", 8) < channel("allgather", 8)
    plan = OptimalScheduler(hand_profile(communicator="sparse_allreduce", world=8)).plan(
        [mergecomp.plan.ParamInfo(n, s) for n, s in (("a", 100), ("b", 200), ("c", 100))])
    assert plan.groups


@pytest.mark.parametrize("numel", [1, 2, 3, 7, 10, 1001])
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_each_index_goes_to_the_owner_of_its_partition(numel, world_size):
    from mergecomp.communicators.sparse_allreduce import _owners
    sizes = torch.tensor(shard_sizes(numel, world_size))
    expected = torch.repeat_interleave(torch.arange(world_size), sizes)
    assert torch.equal(_owners(torch.arange(numel), numel, world_size), expected)
