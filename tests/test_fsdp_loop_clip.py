"""FSDP2 shown the optimizer follows a loop that clips between backward and step(), as the
wrapper and the DDP hook do (mergecomp.fsdp.handover), on two gloo ranks."""
import math
import os
import tempfile

import pytest
import torch

from tests.distributed import run_ranks
from tests.test_fsdp import _batch, _model

pytest.importorskip("torch.distributed.fsdp")

CLIP = 1e-3


def _full_norm(model) -> float:
    """The whole gradient's norm, every rank's shards together."""
    return float(torch.sqrt(sum(p.grad.full_tensor().double().square().sum() for p in model.parameters())))


def _built(kind):
    """The test model under FSDP2 (``"shard"``), HSDP on a 2×2 node mesh, or ``replicate``."""
    if kind == "hsdp":
        from tests.test_fsdp_hsdp import _mesh, _model as hsdp_model
        return hsdp_model(_mesh())
    if kind == "replicate":
        from tests.test_fsdp_replicate import _model as replicated_model
        return replicated_model()
    return _model()


def _run(rank, world_size, compressor, clip, options, stop_at=None, kind="shard", steps=6):
    """``steps`` SGD (momentum 0.9) steps of the FSDP model, the loop clipping the gradients
    at ``clip`` (None: not); saved after ``stop_at`` steps and resumed into a new model, SGD
    and state.  Returns the full parameters, every rank's threshold, what each memory holds
    and the whole gradient's norm the SGD stepped on at each step."""
    import mergecomp

    def build(saved=None):
        model = _built(kind)
        sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if saved is not None:
            with torch.no_grad():
                for mine, theirs in zip(model.parameters(), saved["params"]):
                    mine.to_local().copy_(theirs)
            sgd.load_state_dict(saved["optimizer"])
        state = mergecomp.fsdp.register(model, compressor=compressor, optimizer=sgd, **options)
        if saved is not None:
            state.load_state_dict(saved["state"])
        stepped = []
        sgd.register_step_pre_hook(lambda *_: stepped.append(_full_norm(model)))  # after the hand-over's
        return model, sgd, state, stepped

    model, sgd, state, stepped = build()
    norms = []
    for step in range(steps):
        if step == stop_at:
            path = os.path.join(tempfile.mkdtemp(), f"rank{rank}.pt")
            mergecomp.save({"params": [p.to_local().clone() for p in model.parameters()],
                            "optimizer": sgd.state_dict(), "state": state.state_dict()}, path)
            model, sgd, state, stepped = build(mergecomp.load(path))
            norms = norms + stepped
        x, y = _batch(rank, step)
        sgd.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        sgd.step()
    memory = state.memory
    return ([p.full_tensor().detach().clone() for p in model.parameters()], memory.loop_clip.threshold,
            memory.folding, norms + stepped)


@pytest.mark.parametrize("compressor,options", [("topk", {"compress_ratio": 0.3}), ("efsignsgd", {})])
def test_fsdp_follows_the_loops_clip_on_every_rank(compressor, options):
    clipped = run_ranks(_run, 2, compressor, CLIP, options)
    (params0, threshold0, folding0, stepped0), (params1, threshold1, folding1, stepped1) = clipped
    # seen at the first step from the whole gradient's norm (each rank's shard alone would
    # give each rank another threshold), the same on both ranks
    assert threshold0 == threshold1 == pytest.approx(CLIP / math.sqrt(2), rel=1e-3)
    assert not folding0 and not folding1  # a fold (EF-SignSGD's) takes the momentum over from then on
    assert len(stepped0) == 6 and stepped0 == pytest.approx(stepped1, rel=1e-6)
    # once followed, each rank's gradient is clipped before the momentum and the loop's clip
    # is undone where it binds: the SGD never steps on averages clipped to CLIP
    assert all(abs(norm - CLIP) > 0.01 * CLIP for norm in stepped0[1:])
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))


def test_fsdp_under_a_loop_that_does_not_clip_follows_nothing():
    for _, threshold, _, stepped in run_ranks(_run, 2, "topk", None, {"compress_ratio": 0.3}):
        assert threshold is None
        assert len(stepped) == 6


def test_an_fsdp_run_that_follows_the_loop_resumes_bit_for_bit():
    straight = run_ranks(_run, 2, "topk", CLIP, {"compress_ratio": 0.3})
    resumed = run_ranks(_run, 2, "topk", CLIP, {"compress_ratio": 0.3}, 3)
    for (mine, threshold, _, _), (theirs, other, _, _) in zip(straight, resumed):
        assert threshold == other
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))


@pytest.mark.parametrize("kind,world", [("hsdp", 4), ("replicate", 2)])
def test_hsdp_and_replicate_follow_the_loops_clip_on_every_rank(kind, world):
    # HSDP's ranks hold different shards within a node and the same across nodes; replicate's
    # hold whole gradients: each reads the whole gradient's norm, as the loop's clip did
    results = run_ranks(_run, world, "topk", CLIP, {"compress_ratio": 0.3}, None, kind)
    for params, threshold, _, stepped in results:
        assert threshold == pytest.approx(CLIP / math.sqrt(world), rel=1e-3)
        assert stepped == pytest.approx(results[0][3], rel=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(params, results[0][0]))
