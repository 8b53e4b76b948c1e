"""mergecomp.fsdp on ``replicate`` (PyTorch's data parallelism on FSDP2's machinery), on two
gloo ranks: the all-reduce of each unit's whole gradient is compressed with error feedback.

One worker runs the scenarios that leave the ranks healthy on the same two ranks; the
tests read what it returned.  A rank that never registered, and a rank lost mid-training,
run on ranks of their own.
"""
import warnings

import pytest
import torch

from tests.distributed import run_ranks
from tests.test_fsdp_faults import _run as _run_script

replicate = pytest.importorskip("torch.distributed._composable.replicate_with_fsdp").replicate

STEPS = 6


def _model(root_only=False, mesh=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                torch.nn.ReLU(), torch.nn.Linear(32, 3))
    if not root_only:
        for layer in (model[0], model[2]):  # model[4] stays with the root's unit
            replicate(layer, mesh=mesh)
    replicate(model, mesh=mesh)
    return model


def _batch(rank, step):
    generator = torch.Generator().manual_seed(1000 * rank + step % 4)  # four batches, repeated
    x = torch.randn(16, 8, generator=generator)
    return x, x[:, :3] * 2 - x[:, 3:6]


def _poison(module, grad_input, grad_output):
    return tuple(g * float("nan") for g in grad_input)


def _steps(model, optimizer, rank, steps):
    losses = []
    for step in steps:
        x, y = _batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _full(model):
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _train(rank, root_only=False, **compression):
    """Losses, full parameters and (wire bytes, FSDP's own bytes, repr) after STEPS SGD steps."""
    import mergecomp
    model = _model(root_only)
    state = mergecomp.fsdp.register(model, **compression) if compression else None
    losses = _steps(model, torch.optim.SGD(model.parameters(), lr=0.05), rank, range(STEPS))
    return {"losses": losses, "full": _full(model),
            "state": None if state is None else (state.wire_bytes, state.uncompressed_bytes, repr(state),
                                                   state.replicate, list(state.units))}


def _nonfinite(rank):
    """Rank 1's first-layer gradient turns NaN at the second step: the backward is dropped on
    every rank (every gradient NaN, every residual as before it) and training goes on."""
    import mergecomp
    model = _model()
    state = mergecomp.fsdp.register(model, compressor="topk", compress_ratio=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    out = {}
    for step in range(3):
        x, y = _batch(rank, step)
        poison = model[1].register_full_backward_hook(_poison) if step == 1 and rank == 1 else None
        loss = torch.nn.functional.mse_loss(model(x), y)
        before = {k: v.clone() for k, v in state.memory.residuals.committed().items()}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss.backward()
        if poison is not None:
            poison.remove()
        if step == 1:
            out["warned"] = [str(w.message) for w in caught if "NaN or Inf" in str(w.message)]
            out["grads_nan"] = all(bool(p.grad.to_local().isnan().all()) for p in model.parameters())
            after = state.memory.residuals.committed()
            out["residuals_kept"] = (len(before) > 0 and before.keys() == after.keys()
                                     and all(torch.equal(before[k], after[k]) for k in before))
            optimizer.zero_grad()
            continue
        optimizer.step()
        optimizer.zero_grad()
    out["full"] = _full(model)
    out["dropped"] = state.dropped
    return out


def _checkpoint(rank):
    """Six steps straight equal three, the parameters and each rank's compression state into
    a fresh model, and three more (SGD without momentum keeps no state of its own)."""
    import mergecomp
    options = dict(compressor="topk", compress_ratio=0.1)
    straight = _model()
    mergecomp.fsdp.register(straight, **options)
    _steps(straight, torch.optim.SGD(straight.parameters(), lr=0.05), rank, range(6))
    first = _model()
    state = mergecomp.fsdp.register(first, **options)
    _steps(first, torch.optim.SGD(first.parameters(), lr=0.05), rank, range(3))
    saved = state.state_dict()
    resumed = _model()
    again = mergecomp.fsdp.register(resumed, **options)
    with torch.no_grad():
        for ours, theirs in zip(resumed.parameters(), first.parameters()):
            ours.to_local().copy_(theirs.to_local())
    again.load_state_dict(saved)
    _steps(resumed, torch.optim.SGD(resumed.parameters(), lr=0.05), rank, range(3, 6))
    return all(torch.equal(a, b) for a, b in zip(_full(straight), _full(resumed)))


def _divide(rank):
    """set_gradient_divide_factor(1.0) on 2 ranks: the sum over ranks, twice the average, as
    dense replicate gives it."""
    import mergecomp
    grads = {}
    for case, factor, compressed in (("average", None, True), ("sum", 1.0, True), ("dense_sum", 1.0, False)):
        model = _model()
        if compressed:
            mergecomp.fsdp.register(model, compressor="none")
        if factor is not None:
            for unit in (model, model[0], model[2]):
                unit.set_gradient_divide_factor(factor)
        x, y = _batch(rank, 0)
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads[case] = [p.grad.to_local().clone() for p in model.parameters()]
    close = lambda first, second: all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(first, second))
    return close([2 * g for g in grads["average"]], grads["sum"]) and close(grads["sum"], grads["dense_sum"])


def _refusals(rank):
    """What register() refuses on a replicated model, each message as raised."""
    import mergecomp
    from torch.distributed.device_mesh import init_device_mesh
    found = {}
    model = _model()
    mergecomp.fsdp.register(model, compressor="topk")
    try:
        mergecomp.fsdp.register(model, compressor="topk")
    except RuntimeError as error:
        found["twice"] = str(error)
    try:  # rank 1 asks for another compression ratio: named at the first backward, before any payload
        apart = _model()
        mergecomp.fsdp.register(apart, compressor="topk", compress_ratio=0.1 if rank == 0 else 0.2)
        x, y = _batch(rank, 0)
        torch.nn.functional.mse_loss(apart(x), y).backward()
    except mergecomp.RanksDisagree as error:
        found["disagree"] = str(error)
    try:  # replicas over one rank of two: the agreement could not run over every rank
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "other"))
        mergecomp.fsdp.register(_model(mesh=mesh["replicate"]), compressor="topk")
    except ValueError as error:
        found["span"] = str(error)
    try:  # FSDP's units sharded, the root replicated
        from torch.distributed.fsdp import fully_shard
        torch.manual_seed(0)
        mixed = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
        fully_shard(mixed[0])
        replicate(mixed)
        mergecomp.fsdp.register(mixed, compressor="topk")
    except (ValueError, RuntimeError) as error:
        found["mixed"] = f"{type(error).__name__}: {error}"
    return found


def _deferred_all_reduce(rank):
    """set_requires_all_reduce(False) is refused by name at the backward it applies to."""
    import mergecomp
    model = _model()
    mergecomp.fsdp.register(model, compressor="topk", compress_ratio=0.1)
    model.set_requires_all_reduce(False)
    x, y = _batch(rank, 0)
    try:
        torch.nn.functional.mse_loss(model(x), y).backward()
    except ValueError as error:
        return str(error)
    return None


def _worker(rank, world):
    return {"plain": _train(rank), "none": _train(rank, compressor="none"),
            "fp32": _train(rank, compressor="fp32"),
            "topk": _train(rank, compressor="topk", compress_ratio=0.1),
            "root": _train(rank, root_only=True, compressor="topk", compress_ratio=0.1),
            "powersgd": _train(rank, compressor="powersgd"),
            "plain_root": _train(rank, root_only=True),
            "none_root": _train(rank, root_only=True, compressor="none"),
            "nan": _nonfinite(rank), "checkpoint": _checkpoint(rank), "divide": _divide(rank),
            "refusals": _refusals(rank),
            "deferred": _deferred_all_reduce(rank)}  # last: it leaves that model mid-backward


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_worker, 2, timeout=180)


@pytest.mark.parametrize("name, dense", [("none", "plain"), ("fp32", "plain"), ("none_root", "plain_root")])
def test_a_lossless_compressor_matches_dense_replicate(ranks, name, dense):
    for result in ranks:
        assert result[name]["state"][3] is True  # registered as replicate
        for ours, theirs in zip(result[name]["full"], result[dense]["full"]):
            assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["topk", "root", "powersgd"])
def test_compressed_replicas_train_and_every_rank_holds_the_same_model(ranks, name):
    first = ranks[0][name]
    for ours, theirs in zip(ranks[1][name]["full"], first["full"]):
        assert torch.equal(ours, theirs)
    assert first["losses"][-1] < 0.75 * first["losses"][0]
    assert "replicate" in first["state"][2]


def test_topk_sends_a_fraction_of_fp32s_bytes(ranks):
    for result in ranks:
        sent, own = result["topk"]["state"][:2]
        fp32_sent = result["none"]["state"][0]
        assert 0 < sent < 0.4 * fp32_sent and sent < 0.4 * own
    assert ranks[0]["topk"]["state"][4] == ["<root>", "0", "2"]  # the root holds model[4]
    assert ranks[0]["root"]["state"][4] == ["<root>"]


def test_a_nan_on_one_rank_is_dropped_on_every_rank(ranks):
    for result in ranks:
        nan = result["nan"]
        assert len(nan["warned"]) == 1 and "rank(s) [1]" in nan["warned"][0], nan["warned"]
        assert nan["grads_nan"] and nan["residuals_kept"] and nan["dropped"] == 1
        assert all(torch.isfinite(p).all() for p in nan["full"])
    for ours, theirs in zip(ranks[1]["nan"]["full"], ranks[0]["nan"]["full"]):
        assert torch.equal(ours, theirs)


def test_a_checkpoint_of_the_residuals_resumes_exactly(ranks):
    assert all(result["checkpoint"] for result in ranks)


def test_gradient_divide_factor_is_kept(ranks):
    assert all(result["divide"] for result in ranks)


def test_what_register_refuses_is_named(ranks):
    for result in ranks:
        found = result["refusals"]
        assert "already has mergecomp's exchange installed" in found["twice"]
        assert "ranks disagree at step 0" in found["disagree"] and "compress_ratio=0.2" in found["disagree"]
        assert "replicate-parallel over 1 of the 2 ranks" in found["span"]
        assert "spans every rank" in found["span"]
        assert "mixed" in found, "a model half sharded, half replicated must be refused"
        assert "mix kinds of data parallelism" in found["mixed"] and "'<root>': 'replicate'" in found["mixed"]


def test_a_deferred_all_reduce_is_refused_by_name(ranks):
    for result in ranks:
        assert "set_requires_all_reduce(False)" in result["deferred"]
        assert "set_requires_gradient_sync(False)" in result["deferred"]


def _registered_on_rank_0_only(rank, world_size):
    import datetime
    import mergecomp
    torch.distributed.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=20))
    model = _model()
    if rank == 0:
        mergecomp.fsdp.register(model, compressor="topk")
    x, y = _batch(rank, 0)
    try:
        torch.nn.functional.mse_loss(model(x), y).backward()
        torch.nn.functional.mse_loss(model(x), y).backward()  # the other's next collective
    except Exception as error:  # noqa: BLE001  which error each rank gets is the point
        return type(error).__name__, str(error)
    return None


def test_register_on_one_rank_only_is_named_at_the_first_backward():
    (kind, message), other = run_ranks(_registered_on_rank_0_only, 2, timeout=120)
    assert kind == "RuntimeError", message
    assert "mergecomp.fsdp.register is not registered on rank(s) [1]" in message
    assert "FSDP's own allreduce" in message and "on every rank" in message
    assert other is not None  # rank 1 fails at its next collective, it does not train on alone


def test_a_lost_rank_is_named_by_the_survivor(tmp_path):
    for rank, output in _run_script(tmp_path, "kill", 1, 2, "replicate").items():
        assert f"RANK {rank} DONE" not in output, output
        assert ("mergecomp.distributed.watchdog.PeerLost" in output
                or "mergecomp.distributed.watchdog.CollectiveTimeout" in output), output[-3000:]
        assert "Ranks behind: [1]" in output or "rank 1 " in output, output[-3000:]
