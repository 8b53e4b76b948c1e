"""HSDP under mergecomp.fsdp on four gloo ranks, a 2×2 mesh (replicate × shard): FSDP's
reduce-scatter within each shard group stays, the replicas' all-reduce is compressed.

One worker runs every scenario on the same four ranks; the tests read what it returned.
"""
import warnings

import pytest
import torch

from tests.distributed import run_ranks

fully_shard = pytest.importorskip("torch.distributed.fsdp").fully_shard

STEPS = 6


def _mesh():
    """The 2×2 mesh of two nodes of two ranks, from the node layout."""
    import mergecomp
    return mergecomp.fsdp.node_mesh(local_size=2)  # gloo: a CPU mesh


def _node_mesh(rank):
    """The node mesh's groups, and what it refuses (each refusal raised on every rank)."""
    import torch.distributed as dist
    import mergecomp
    mesh = _mesh()
    found = {"shape": tuple(mesh.shape), "names": mesh.mesh_dim_names,
             "shard": dist.get_process_group_ranks(mesh.get_group("shard")),
             "replicate": dist.get_process_group_ranks(mesh.get_group("replicate"))}
    for case, local_size in (("one_node", 4), ("disagree", 2 if rank else 1)):
        try:
            mergecomp.fsdp.node_mesh("cpu", local_size=local_size)
            found[case] = None
        except ValueError as error:
            found[case] = str(error)
    return found


def _model(mesh):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                torch.nn.ReLU(), torch.nn.Linear(32, 3))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batch(rank, step):
    generator = torch.Generator().manual_seed(1000 * rank + step % 4)
    x = torch.randn(16, 8, generator=generator)
    return x, x[:, :3] * 2 - x[:, 3:6]


def _poison(module, grad_input, grad_output):
    return tuple(g * float("nan") for g in grad_input)


def _train(rank, mesh, steps=STEPS, nan_at=None, **compression):
    import mergecomp
    model = _model(mesh)
    state = mergecomp.fsdp.register(model, **compression) if compression else None
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    losses, warned = [], []
    for step in range(steps):
        x, y = _batch(rank, step)
        poison = model[1].register_full_backward_hook(_poison) if step == nan_at and rank == 3 else None
        loss = torch.nn.functional.mse_loss(model(x), y)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss.backward()
        warned += [str(w.message) for w in caught if "NaN or Inf" in str(w.message)]
        if poison is not None:
            poison.remove()
        if step != nan_at:
            optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    full = [p.full_tensor().detach().clone() for p in model.parameters()]
    placements = [str(p.placements) for p in model.parameters()]
    moments = [tuple(optimizer.state[p]["exp_avg"].to_local().shape) for p in model.parameters()]
    shards = [tuple(p.to_local().shape) for p in model.parameters()]
    return {"losses": losses, "full": full, "placements": placements, "moments": moments, "shards": shards,
            "state": None if state is None else (state.wire_bytes, state.uncompressed_bytes, state.dropped,
                                                   {k: v.numel() for k, v in getattr(state.memory, "residuals", {}).committed().items()}
                                                   if hasattr(state.memory, "residuals") else {}),
            "warned": warned}


def _steps(model, optimizer, rank, steps):
    for step in steps:
        x, y = _batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def _checkpoint(rank, mesh, folder):
    """Six steps straight equal three, a distributed checkpoint of the model and optimizer
    (torch.distributed.checkpoint) with each rank's compression state beside it, a fresh
    model and optimizer loaded from them, and three more steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import mergecomp
    options = dict(compressor="topk", compress_ratio=0.1)
    straight = _model(mesh)
    mergecomp.fsdp.register(straight, **options)
    _steps(straight, torch.optim.Adam(straight.parameters(), lr=0.01), rank, range(6))
    first = _model(mesh)
    state = mergecomp.fsdp.register(first, **options)
    optimizer = torch.optim.Adam(first.parameters(), lr=0.01)
    _steps(first, optimizer, rank, range(3))
    model_state, optimizer_state = get_state_dict(first, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)
    mergecomp.save(state.state_dict(), f"{folder}/compression.rank{rank}.pt")
    resumed = _model(mesh)
    again = mergecomp.fsdp.register(resumed, **options)
    optimizer = torch.optim.Adam(resumed.parameters(), lr=0.01)
    model_state, optimizer_state = get_state_dict(resumed, optimizer)
    loaded = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(loaded, checkpoint_id=folder)
    set_state_dict(resumed, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
    again.load_state_dict(mergecomp.load(f"{folder}/compression.rank{rank}.pt"))
    _steps(resumed, optimizer, rank, range(3, 6))
    return all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(straight.parameters(),
                                                                              resumed.parameters()))


def _divide(rank, mesh):
    """set_gradient_divide_factor(2.0) on 4 ranks: the sum over ranks halved, twice the
    default average (FSDP's reduce-scatter averages over the shard group of 2; the
    replicas' exchange then sums)."""
    import mergecomp
    grads = []
    for factor in (None, 2.0):
        model = _model(mesh)
        mergecomp.fsdp.register(model, compressor="none")
        if factor is not None:
            for layer in (model[0], model[2], model[4]):
                layer.set_gradient_divide_factor(factor)
        x, y = _batch(rank, 0)
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads.append([p.grad.to_local().clone() for p in model.parameters()])
    return all(torch.allclose(2 * a, b, rtol=1e-6, atol=1e-7) for a, b in zip(*grads))


def _deferred_all_reduce(rank, mesh):
    """set_requires_all_reduce(False) is refused by name at the backward it applies to."""
    import mergecomp
    model = _model(mesh)
    mergecomp.fsdp.register(model, compressor="topk", compress_ratio=0.1)
    model.set_requires_all_reduce(False)
    x, y = _batch(rank, 0)
    try:
        torch.nn.functional.mse_loss(model(x), y).backward()
    except ValueError as error:
        return str(error)
    return None


def _example(rank):
    """examples/fsdp_mlp.py --node-mesh, the ranks per node from MERGECOMP_LOCAL_SIZE."""
    import contextlib
    import io
    import os
    import runpy
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    example = runpy.run_path(os.path.join(here, "examples", "fsdp_mlp.py"))
    printed = io.StringIO()
    os.environ["MERGECOMP_LOCAL_SIZE"] = "2"
    try:
        with contextlib.redirect_stdout(printed):
            example["main"](["--node-mesh", "--steps", "2", "--width", "16", "--print-every", "1"])
    finally:
        del os.environ["MERGECOMP_LOCAL_SIZE"]
    return printed.getvalue()


def _worker(rank, world, folder):
    mesh = _mesh()
    return {"divide": _divide(rank, mesh),"checkpoint": _checkpoint(rank, mesh, folder),"plain": _train(rank, mesh), "none": _train(rank, mesh, compressor="none"),
            "topk": _train(rank, mesh, compressor="topk", compress_ratio=0.1),
            "powersgd": _train(rank, mesh, compressor="powersgd"),
            "nan": _train(rank, mesh, steps=3, nan_at=1, compressor="topk", compress_ratio=0.1),
            "node_mesh": _node_mesh(rank), "example": _example(rank),
            "deferred": _deferred_all_reduce(rank, mesh)}  # last: it leaves that model mid-backward


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_worker, 4, str(tmp_path_factory.mktemp("hsdp-checkpoint")))


def test_fp32_through_the_replica_hook_equals_fsdp_own_hsdp(ranks):
    for result in ranks:
        for ours, theirs in zip(result["none"]["full"], result["plain"]["full"]):
            assert torch.equal(ours, theirs)
        assert result["none"]["placements"] == result["plain"]["placements"]
        assert "Replicate()" in result["none"]["placements"][0]


@pytest.mark.parametrize("name", ["topk", "powersgd"])
def test_compressed_replicas_train_and_every_rank_holds_the_same_model(ranks, name):
    first = ranks[0][name]
    for result in ranks[1:]:
        for ours, theirs in zip(result[name]["full"], first["full"]):
            assert torch.equal(ours, theirs)
    assert first["losses"][-1] < first["losses"][0]
    sent, fsdp_own = first["state"][:2]
    assert 0 < sent < fsdp_own


def test_model_optimizer_and_error_feedback_are_sharded(ranks):
    result = ranks[0]["topk"]
    assert result["moments"] == result["shards"]  # Adam's moments: the shard of each parameter
    residuals = result["state"][3]
    shard_numel = sum(torch.Size(s).numel() for s in result["shards"])
    # one residual per unit, each the size of this rank's padded shard: the sharded gradient
    assert len(residuals) == 3 and sum(residuals.values()) >= shard_numel
    assert sum(residuals.values()) < 2 * shard_numel


def test_a_nan_on_one_rank_is_dropped_on_every_rank(ranks):
    for result in ranks:
        nan = result["nan"]
        # the NaN of rank 3 reached its shard group's reduce-scatter (FSDP's own) before the
        # replicas' exchange: both ranks of that group hold it
        assert len(nan["warned"]) == 1 and "rank(s) [2, 3]" in nan["warned"][0]
        assert nan["state"][2] == 1
        assert all(torch.isfinite(p).all() for p in nan["full"])
    for result in ranks[1:]:
        for ours, theirs in zip(result["nan"]["full"], ranks[0]["nan"]["full"]):
            assert torch.equal(ours, theirs)


def test_distributed_checkpoint_and_compression_state_resume_exactly(ranks):
    assert all(result["checkpoint"] for result in ranks)


def test_gradient_divide_factor_is_kept(ranks):
    assert all(result["divide"] for result in ranks)


def test_a_deferred_replica_all_reduce_is_refused_by_name(ranks):
    for result in ranks:
        assert "set_requires_all_reduce(False)" in result["deferred"]
        assert "set_requires_gradient_sync(False)" in result["deferred"]


def test_node_mesh_puts_shards_in_a_node_and_replicas_across_nodes(ranks):
    for rank, result in enumerate(ranks):
        found = result["node_mesh"]
        assert found["shape"] == (2, 2) and found["names"] == ("replicate", "shard")
        node = rank // 2
        assert found["shard"] == [2 * node, 2 * node + 1]  # the ranks of this rank's node
        assert found["replicate"] == [rank % 2, rank % 2 + 2]  # one rank per node


def test_node_mesh_refuses_one_node_and_a_disagreement_on_every_rank(ranks):
    for result in ranks:
        found = result["node_mesh"]
        assert "one node of 4 rank(s)" in found["one_node"] and "fully_shard" in found["one_node"]
        assert "ranks disagree on the ranks per node" in found["disagree"]
        assert "1 on ranks 0" in found["disagree"]


def test_the_example_trains_on_the_node_mesh(ranks):
    printed = ranks[0]["example"]
    assert "step    2" in printed and "FSDP's own" in printed
