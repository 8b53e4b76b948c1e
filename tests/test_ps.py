"""PS communicator on real gloo ranks: exactness, error feedback on both sides, state, training."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import mergecomp
from mergecomp import communicators, compressors, memories
from mergecomp.distributed.backends.torch_dist import TorchDistributedBackend
from mergecomp.communicators.ps import decode, encode, shard_sizes
from mergecomp.compressors.base import Compressor, Context
from mergecomp.compressors.sparsifier import index_dtype, scatter_values
from tests.distributed import run_ranks

LENGTHS = (1, 2, 3, 7, 10, 1001)  # shorter than the world (empty shards) and not divisible by it


def gradient(step, rank, numel, dtype=torch.float32):
    g = torch.Generator().manual_seed(7919 * step + 31 * rank + numel)
    return torch.randn(numel, generator=g).to(dtype)


def make(kind, compressor, memory="none", backend=None, **kwargs):
    compressor = compressors.create(compressor) if isinstance(compressor, str) else compressor
    return communicators.create(kind, compressor=compressor, memory=memories.create(memory),
                                backend=backend or TorchDistributedBackend(), **kwargs)


def exchange(communicator, tensor, name):
    """One step of one group, committed as the reducer commits every good step."""
    result = communicator.finish(communicator.start(tensor.clone(), name))
    communicator.commit()
    return result


class NonzeroCompressor(Compressor):
    """Lossless, variable-size and not summable: sends only the nonzero entries and indices."""

    name = "nonzero"
    fixed_size = False

    def compress(self, tensor, name):
        flat = tensor.reshape(-1)
        indices = flat.nonzero().reshape(-1)
        return (flat[indices], indices.to(index_dtype(flat.numel()))), Context(tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        return scatter_values(payload[0], payload[1], ctx)


# --------------------------------------------------------------------------- exactness
def uncompressed_worker(rank, world_size):
    backend = TorchDistributedBackend()
    ps, allreduce = make("ps", "none", backend=backend), make("allreduce", "none", backend=backend)
    ps_variable = make("ps", NonzeroCompressor(), backend=backend)
    for numel in LENGTHS:
        for step in range(2):
            g = gradient(step, rank, numel)
            sparse = g * (torch.arange(numel) % (rank + 2) == 0)  # a different count per rank
            want = exchange(allreduce, g, f"n{numel}")
            torch.testing.assert_close(exchange(ps, g, f"n{numel}"), want)
            torch.testing.assert_close(exchange(ps_variable, sparse, f"v{numel}"),
                                       exchange(allreduce, sparse, f"v{numel}"))
    assert not ps.server_residuals  # summable: added exactly, nothing kept
    assert all(not r.any() for r in ps_variable.server_residuals.values())  # lossless
    # Traffic: the backend counts the bytes each rank hands over (allreduce: the buffer once).
    # PS hands over (N−1)/N of it to the all-to-all and 1/N to the allgather: the same
    # total, plus a few headers.
    numel = 100_000
    g = gradient(0, rank, numel)
    before = backend.bytes_sent
    exchange(allreduce, g, "traffic")
    middle = backend.bytes_sent
    exchange(ps, g, "traffic")
    by_allreduce, by_ps = middle - before, backend.bytes_sent - middle
    assert by_allreduce == 4 * numel
    assert by_allreduce <= by_ps <= by_allreduce + 8 * world_size + 128, (by_ps, by_allreduce)
    return True


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ps_uncompressed_equals_allreduce(world_size):
    assert run_ranks(uncompressed_worker, world_size) == [True] * world_size


def test_shard_sizes_and_blob_round_trip():
    assert shard_sizes(10, 4) == [3, 3, 2, 2]
    assert shard_sizes(2, 4) == [1, 1, 0, 0]
    assert shard_sizes(0, 3) == [0, 0, 0]
    payload = (torch.arange(5, dtype=torch.int32), torch.ones(2, 3, dtype=torch.float16),
               torch.empty(0), torch.tensor([True, False]))
    back = decode(encode(payload, torch.device("cpu")))
    assert [(p.dtype, p.shape) for p in back] == [(p.dtype, p.shape) for p in payload]
    assert all(torch.equal(a, b) for a, b in zip(back, payload))
    assert decode(torch.empty(0, dtype=torch.uint8)) == ()
    with pytest.raises(ValueError, match="server_residual must be True, False or None"):
        make("ps", "topk", backend=object(), server_residual="yes")
    with pytest.raises(ValueError, match="complex64"):
        encode((torch.zeros(2, dtype=torch.complex64),), "cpu")


# ------------------------------------------------------------------------ lossy, all
def options(name):
    return {"topk": {"compress_ratio": 0.05}, "randk": {"compress_ratio": 0.05},
            "dgc": {"compress_ratio": 0.05}}.get(name, {})


def gathered_mean(tensor, world_size):
    parts = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(parts, tensor.contiguous())
    return torch.stack(parts).mean(0)


def lossy_worker(rank, world_size, numel, steps):
    backend = TorchDistributedBackend()
    torch.manual_seed(rank)  # stochastic compressors draw from the global generator
    report = {}
    for name in compressors.available():
        cls = compressors.get(name)
        if name in ("none", "fp32"):
            continue
        memory = cls.recommended_memory
        ps = make("ps", compressors.create(name, **options(name)), memory, backend)
        total, truth = torch.zeros(numel), torch.zeros(numel)
        outputs = []
        for step in range(steps):
            g = gradient(step, rank, numel)
            out = exchange(ps, g, "group")
            assert out.shape == g.shape and torch.isfinite(out).all(), name
            total += out
            truth += gathered_mean(g, world_size)
            outputs.append(out)
        for out in outputs[1:]:
            parts = [torch.empty_like(out) for _ in range(world_size)]
            dist.all_gather(parts, out)
            assert all(torch.equal(out, p) for p in parts), f"{name}: ranks disagree"
        entry = {"server_residual": ps.server_residual,
                 "residual_norm": sum(float(r.norm()) for r in ps.server_residuals.values())}
        if cls.multi_round:  # PowerSGD runs its allreduce rounds through the base driver
            reference = make("allreduce", compressors.create(name, **options(name)), "none", backend)
            again = [exchange(reference, gradient(s, rank, numel), "group") for s in range(steps)]
            torch.testing.assert_close(again[-1], outputs[-1])
        elif memory == "residual":
            # Error feedback on both sides: everything sent + what the workers and the servers
            # still hold equals the sum of the true averages, whatever the compressor lost.
            worker_left = torch.cat([ps.memory.residuals.get(f"group/shard{r}", torch.zeros(n))
                                     for r, n in enumerate(shard_sizes(numel, world_size))])
            server_left = ps.server_residuals.get(f"group/shard{rank}")
            shard = shard_sizes(numel, world_size)
            server_left = torch.zeros(shard[rank]) if server_left is None else server_left
            # gloo's all_gather needs equal sizes: pad to the largest shard.
            padded = [torch.zeros(shard[0]) for _ in shard]
            dist.all_gather(padded, torch.cat([server_left, torch.zeros(shard[0] - shard[rank])]))
            server_all = torch.cat([p[:n] for p, n in zip(padded, shard)])
            # Cast compressors also round the servers' sums, which nobody keeps.
            tolerance = 5e-2 if name in ("fp16", "bf16") else 1e-4
            torch.testing.assert_close(total + gathered_mean(worker_left, world_size) + server_all,
                                       truth, rtol=tolerance, atol=tolerance)
            residual_norm = float(server_all.norm() + worker_left.norm())
            assert residual_norm < 10 * float(truth.norm()), (name, residual_norm)  # bounded
        elif not cls.average:  # majority vote: the update is a sign vector
            assert set(outputs[-1].unique().tolist()) <= {-1.0, 1.0}, name
        elif memory == "none":  # unbiased: averaging repeated exchanges approaches the truth
            g, repeats = gradient(0, rank, numel), 24
            want = gathered_mean(g, world_size)
            runs = torch.stack([exchange(ps, g, "unbiased") for _ in range(repeats)])
            single = float((runs[0] - want).norm() / want.norm())
            averaged = float((runs.mean(0) - want).norm() / want.norm())
            assert averaged < 0.5 * single or averaged < 1e-2, (name, single, averaged)
        if ps.server_residuals:
            state = ps.state_dict()
            fresh = make("ps", compressors.create(name, **options(name)), memory, backend)
            fresh.load_state_dict(state)
            assert set(fresh.server_residuals) == set(ps.server_residuals)
            g = gradient(steps, rank, numel)
            torch.manual_seed(steps)  # the same draws for stochastic compressors
            resumed = exchange(fresh, g, "group")
            torch.manual_seed(steps)
            torch.testing.assert_close(resumed, exchange(ps, g, "group"), msg=name)
        report[name] = entry
    return report


def test_ps_every_lossy_compressor_with_error_feedback_on_both_sides():
    results = run_ranks(lossy_worker, 3, 1001, 4)
    report = results[0]
    assert "topk" in report and "randk" in report
    for name, entry in report.items():
        cls = compressors.get(name)
        recompresses = not cls.summable
        feeds_back = cls.recommended_memory != "none"
        assert entry["server_residual"] == (recompresses and feeds_back), name
        if name == "topk":  # top-k of an aggregate loses mass: the server keeps it
            assert entry["residual_norm"] > 0
        if not recompresses:  # summable payloads are added exactly: nothing to keep
            assert entry["residual_norm"] == 0



# ----------------------------------------------------------------------- transactional state
def _committed_state(ps):
    state = ps.state_dict()
    return {"server": state["server_residuals"], "workers": state["memory"]["residuals"]}


def _equal_states(left, right):
    return all(left[side].keys() == right[side].keys()
               and all(torch.equal(left[side][k], right[side][k]) for k in left[side])
               for side in left)


def rollback_worker(rank, world_size):
    backend = TorchDistributedBackend()
    ps = make("ps", compressors.create("topk", compress_ratio=0.05), "residual", backend)
    numel = 301
    exchange(ps, gradient(0, rank, numel), "group")  # committed
    before = _committed_state(ps)
    held = {k: (v, v.clone()) for k, v in ps.server_residuals.items()}
    assert before["server"] and before["workers"]
    out = ps.finish(ps.start(gradient(1, rank, numel), "group"))  # a step to drop
    assert torch.isfinite(out).all()
    assert _equal_states(_committed_state(ps), before)  # state_dict: committed state only
    assert not _equal_states({"server": dict(ps.server_residuals), "workers": {}},
                             {"server": before["server"], "workers": {}})  # the step wrote
    assert all(torch.equal(value, copy) for value, copy in held.values())  # nothing in place
    ps.rollback()
    assert _equal_states({"server": dict(ps.server_residuals), "workers": dict(ps.memory.residuals)},
                         before)
    # The dropped step left no trace: the next step matches a run that never saw it.
    twin = make("ps", compressors.create("topk", compress_ratio=0.05), "residual", backend)
    exchange(twin, gradient(0, rank, numel), "group")
    torch.testing.assert_close(exchange(ps, gradient(2, rank, numel), "group"),
                               exchange(twin, gradient(2, rank, numel), "group"))
    assert _equal_states(_committed_state(ps), _committed_state(twin))
    # A majority vote's server compressor is committed and rolled back with the rest.
    vote = make("ps", "signsgd", "none", backend)
    exchange(vote, gradient(0, rank, numel), "vote")
    calls = []
    vote._vote_compressor.commit = lambda: calls.append("commit")
    vote._vote_compressor.rollback = lambda: calls.append("rollback")
    vote.rollback()
    vote.commit()
    return calls


def test_ps_rollback_restores_worker_and_server_residuals():
    assert run_ranks(rollback_worker, 3) == [["rollback", "commit"]] * 3


# ----------------------------------------------------------------------- end to end
def training_worker(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         model.named_parameters(), compressor="topk",
                                         memory="residual", communicator="ps", schedule=2)
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
    state = opt.state_dict()["mergecomp"]["communicator"]
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    expected = [f"group{i}/shard{rank}" for i in range(len(opt.plan))]
    return losses[0], losses[-1], sorted(state["server_residuals"]) == expected, params


def test_distributed_optimizer_trains_through_ps():
    results = run_ranks(training_worker, 2)
    for first, last, residuals_saved, _ in results:
        assert last < 0.5 * first, (first, last)
        assert residuals_saved  # each rank checkpoints the residual of the shard it serves
    torch.testing.assert_close(results[0][3], results[1][3])  # replicas stay identical


def every_compressor_through_ps_worker(rank, world_size, name):
    import torch.nn as nn
    from tests.test_optimizer import batch, make_model
    model = make_model()
    compressor = mergecomp.compressors.create(name)
    owns = callable(getattr(compressor, "check_optimizer", None)) or compressor.recommended_memory in ("dgc", "demo")
    opt = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.0 if owns else 0.9),
                                         model=model, compressor=compressor, communicator="ps", schedule=2)
    for step in range(3):
        x, y = batch(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", sorted(mergecomp.compressors.available()))
def test_every_compressor_trains_through_ps_with_its_groups_layout(name):
    """The optimizer hands each group's parameter views to the compressor; PS clips them to
    each shard, and the server recompresses (or sums) with the shard's views."""
    results = run_ranks(every_compressor_through_ps_worker, 3, name)
    for params in results[1:]:
        for a, b in zip(results[0], params):
            assert torch.equal(a, b) and torch.isfinite(a).all()
