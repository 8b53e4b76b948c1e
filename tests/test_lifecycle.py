"""The step lifecycle on its own, as a new entry point would drive it: flat buffers in, averages
out, the preflight, the outcome vote, commit or rollback and the messages done for it."""
import warnings

import pytest
import torch

import mergecomp
from mergecomp.distributed.backends.torch_dist import TorchDistributedBackend
from mergecomp.runtime import StepLifecycle, check_nonfinite_policy
from tests.distributed import run_ranks


def lifecycle_worker(rank, world_size):
    backend = TorchDistributedBackend()
    communicator = mergecomp.communicators.create(
        "allgather", compressor=mergecomp.compressors.create("topk", compress_ratio=0.5),
        memory=mergecomp.memories.create("residual"), backend=backend)
    step = {"n": 0}
    lifecycle = StepLifecycle(communicator, backend, lambda: {"steps": step["n"]})
    phases, settled = [], []
    lifecycle.phase_listeners.add(lambda phase, flight, seconds: phases.append((phase, flight.index, flight.send)))
    lifecycle.step_listeners.add(lambda n, outcome: settled.append((n, outcome.finite)))
    results = []
    for n, poisoned in enumerate((False, True, False)):
        step["n"] = n
        lifecycle.begin(n, torch.device("cpu"))
        compressed = torch.arange(8, dtype=torch.float32) * (rank + 1)
        if poisoned and rank == 1:
            compressed[3] = float("nan")
        lifecycle.launch(0, compressed, None, "compress")
        lifecycle.launch(1, torch.full((4,), float(rank + 1)), None, "fp16")
        delivered = {}
        lifecycle.end_step(lambda flight, average, outcome: delivered.__setitem__(flight.index, average.clone()))
        residual = communicator.memory.residuals["group0"].clone()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lifecycle.close_step()
        results.append((delivered, residual, [str(w.message) for w in caught]))
    return results, phases, settled, lifecycle.skipped_steps, [c.name for c in lifecycle.communicators()]


def test_a_step_through_the_lifecycle_alone():
    for results, phases, settled, skipped, names in run_ranks(lifecycle_worker, 2):
        (first, residual0, quiet0), (dropped, residual1, messages), (third, _, quiet2) = results
        torch.testing.assert_close(first[1], torch.full((4,), 1.5))  # the fp16 group's average
        assert not quiet0 and not quiet2
        # The dropped step: NaN delivered on every rank, error feedback as before it, one warning.
        assert all(torch.isnan(average).all() for average in dropped.values())
        torch.testing.assert_close(residual1, residual0)
        assert len(messages) == 1 and "step 1: the local gradient of rank(s) [1] held NaN or Inf" in messages[0]
        assert torch.isfinite(third[0]).all() and skipped == 1
        assert settled == [(0, True), (1, False), (2, True)]
        assert phases[:4] == [("launch", 0, "compress"), ("launch", 1, "fp16"),
                              ("finish", 0, "compress"), ("finish", 1, "fp16")]
        assert names == ["allgather", "allreduce"]  # built once per send mode


def test_the_nonfinite_policy_is_checked_in_one_place():
    assert check_nonfinite_policy("raise") == "raise"
    with pytest.raises(ValueError, match="nonfinite must be one of .*got 'ignore'"):
        check_nonfinite_policy("ignore")
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        StepLifecycle(None, None, dict, nonfinite="ignore")
