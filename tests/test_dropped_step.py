"""A dropped step is skipped by the optimizer an entry point without its own ``step()`` was
shown (the DDP hook, FSDP2): a loop that calls ``step()`` after a NaN backward, as most do,
leaves the parameters as they were, finite and equal on every rank."""
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import mergecomp
from tests.distributed import run_ranks

NAN_STEP = 2


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def _train(rank, world_size, entry, adam):
    model = _model()
    if entry == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        trained = model
    else:
        trained = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = (torch.optim.AdamW(trained.parameters(), lr=0.01) if adam
                 else torch.optim.SGD(trained.parameters(), lr=0.05, momentum=0.9))
    register = mergecomp.fsdp.register if entry == "fsdp" else mergecomp.ddp.register
    state = register(trained, compressor="topk", optimizer=optimizer)
    torch.manual_seed(1 + rank)
    snapshots, grads_nan, losses = [], None, []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(6):
            inputs = torch.randn(16, 8)
            if rank == 1 and step == NAN_STEP:
                inputs[0, 0] = float("nan")  # this rank's gradient is NaN
            optimizer.zero_grad()
            loss = trained(inputs).pow(2).mean()
            loss.backward()
            before = [_full(p) for p in model.parameters()]
            optimizer.step()  # no check of the gradients, as most loops
            after = [_full(p) for p in model.parameters()]
            if step == NAN_STEP:
                snapshots = [torch.equal(a, b) for a, b in zip(before, after)]
                grads_nan = all(torch.isnan(_full(p.grad)).all() for p in model.parameters())
            losses.append(loss.item())
    flat = torch.cat([_full(p).reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    return dict(unchanged=snapshots, grads_nan=grads_nan, finite=bool(torch.isfinite(flat).all()),
                equal=all(torch.equal(gathered[0], g) for g in gathered),
                dropped=state.skipped_steps, losses=losses)


def _full(tensor):
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


@pytest.mark.parametrize("entry", ["ddp", "fsdp"])
@pytest.mark.parametrize("adam", [False, True], ids=["sgd", "adamw"])
def test_the_step_after_a_dropped_backward_leaves_the_parameters_as_they_were(entry, adam):
    for result in run_ranks(_train, 2, entry, adam):
        assert result["dropped"] == 1
        assert result["unchanged"] and all(result["unchanged"])  # step() skipped every parameter
        assert result["grads_nan"]  # put back after the step, for a loop that reads them
        assert result["finite"] and result["equal"]
        losses = result["losses"][:NAN_STEP] + result["losses"][NAN_STEP + 1:]
        assert all(torch.isfinite(torch.tensor(losses)))
