"""Every compressor trains a small model on 2 gloo ranks through DistributedOptimizer.

One spawn for all compressors: the rank function loops over them, each with its
recommended memory and communicator, and returns the evaluation loss before and after a
short training together with a parameter checksum (all ranks must end identical).
"""
import pytest
import torch

from mergecomp import compressors
from tests.distributed import run_ranks

STEPS = 60

#: Settings for a 300-parameter model: densities the defaults (0.1%, 1%) would round to a
#: single element, and step sizes for the sign methods, whose update is ±lr per coordinate.
SETTINGS = {
    "dgc": (dict(compress_ratio=0.1), 0.05),
    "graddrop": (dict(compress_ratio=0.1), 0.1),
    "topk": (dict(compress_ratio=0.1), 0.1),
    "randk": (dict(compress_ratio=0.1), 0.1),
    "signsgd": ({}, 0.005),
    "signum": ({}, 0.005),
    "atomo": (dict(budget=3), 0.05),
    "tbq": (dict(threshold=0.5), 0.1),
}


def _task(seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 16, generator=gen)
    return x, x @ torch.linspace(-1, 1, 16).unsqueeze(1)


def _train_every_compressor(rank, world_size, names):
    import mergecomp
    results = {}
    x_eval, y_eval = _task(999)
    for name in names:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        kwargs, lr = SETTINGS.get(name, ({}, 0.1))
        compressor = compressors.create(name, **kwargs)
        optimizer = mergecomp.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=lr), model.named_parameters(),
            compressor=compressor, memory=compressor.recommended_memory,
            communicator=compressor.recommended_communicator, schedule=1)
        loss_fn = torch.nn.MSELoss()
        with torch.no_grad():
            before = loss_fn(model(x_eval), y_eval).item()
        x, y = _task(rank)
        for step in range(STEPS):
            batch = slice((step * 32) % 256, (step * 32) % 256 + 32)
            optimizer.zero_grad()
            loss_fn(model(x[batch]), y[batch]).backward()
            optimizer.step()
        optimizer.remove_hooks()
        with torch.no_grad():
            after = loss_fn(model(x_eval), y_eval).item()
            checksum = sum(p.double().sum().item() for p in model.parameters())
        results[name] = (before, after, checksum)
    return results


@pytest.fixture(scope="module")
def trained():
    names = compressors.available()
    return names, run_ranks(_train_every_compressor, 2, names, timeout=300)


def test_every_compressor_reduces_the_loss(trained):
    names, ranks = trained
    failures = [f"{name}: {ranks[0][name][0]:.3f} → {ranks[0][name][1]:.3f}" for name in names
                if not ranks[0][name][1] < 0.5 * ranks[0][name][0]]
    assert not failures, "loss did not halve: " + "; ".join(failures)


def test_ranks_stay_identical(trained):
    names, ranks = trained
    diverged = [name for name in names if ranks[0][name][2] != ranks[1][name][2]]
    assert not diverged, f"parameters differ between ranks after training with {diverged}"
