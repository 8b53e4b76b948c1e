"""DiLoCo on real gloo ranks: the exactness law at H = 1, equal ranks after each outer step,
streaming fragments on schedule, non-finite outer steps dropped everywhere, exact resume."""
import io
import warnings

import pytest
import torch

import mergecomp
from mergecomp import compressors
from mergecomp.lowcomm import SyncSchedule

from .distributed import run_ranks


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _batch(rank, step):
    generator = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 6, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


def _train(model, optimizer, rank, steps, start=0, after=None):
    for step in range(start, start + steps):
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        if after is not None:
            after(step + 1)


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


# -- the exactness law ---------------------------------------------------------------------------
def _h1_against_plain(rank, world_size):
    model, plain = _model(rank), _model(rank)  # different seeds: both start from rank 0's
    opt = mergecomp.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1), model=model, sync_every=1,
                           outer_lr=1.0, outer_momentum=0.0)
    reference = mergecomp.DistributedOptimizer(torch.optim.SGD(plain.parameters(), lr=0.1), model=plain)
    _train(model, opt, rank, 6)
    _train(plain, reference, rank, 6)
    return _weights(model), _weights(plain), opt.outer_steps


def test_one_inner_step_and_outer_sgd_at_lr_1_is_averaged_gradient_sgd():
    """Δ̄ = avg(θ̄ − (θ̄ − lr·gᵢ)) = lr·ḡ: the same update as averaging gradients, up to the
    rounding of forming Δ and subtracting it (ranks are bit-identical to each other)."""
    (ours0, plain0, outer), (ours1, _, _) = run_ranks(_h1_against_plain, 2)
    assert outer == 6
    assert all(torch.equal(a, b) for a, b in zip(ours0, ours1))
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(ours0, plain0))


# -- H > 1 and streaming ----------------------------------------------------------------------------
def _equal_after_outer_steps(rank, world_size, fragments, overlap):
    model = _model(rank)
    opt = mergecomp.DiLoCo(torch.optim.AdamW(model.parameters(), lr=0.01), model=model, sync_every=4,
                           fragments=fragments, overlap=overlap)
    seen = {}
    per_fragment = [[p for _, p in f.params] for f in opt.fragments]
    _train(model, opt, rank, 12, after=lambda step: seen.__setitem__(step, [
        torch.cat([p.detach().reshape(-1) for p in params]) for params in per_fragment]))
    return seen, [f.anchor.clone() for f in opt.fragments], opt.outer_steps


def test_ranks_are_equal_after_every_outer_step_and_apart_between():
    (seen0, anchors0, outer), (seen1, anchors1, _) = run_ranks(_equal_after_outer_steps, 2, 1, 0)
    assert outer == 3
    for step in (4, 8, 12):
        assert torch.equal(seen0[step][0], seen1[step][0]), step
    assert not torch.equal(seen0[2][0], seen1[2][0])
    assert all(torch.equal(a, b) for a, b in zip(anchors0, anchors1))


def test_streaming_fragments_sync_on_their_own_steps_behind_the_overlap():
    """K = 2, H = 4: fragment 0 launched at 4, 8, 12; fragment 1 at 2, 6, 10; each finished one
    inner step later, when the fragment's anchors are equal and (mixed at 0.5) still unequal
    local weights would differ: the anchors are what is compared."""
    (seen0, anchors0, outer), (seen1, anchors1, _) = run_ranks(_equal_after_outer_steps, 2, 2, 1)
    assert outer == 5  # fragment 1 at 3, 7, 11; fragment 0 at 5, 9 (its third ends at 13)
    assert all(torch.equal(a, b) for a, b in zip(anchors0, anchors1))



def _against_a_plain_simulation(rank, world_size):
    """DiLoCo (H = 4, SGD momentum inside, outer Nesterov) next to Algorithm 1 written out in
    plain torch for every rank at once, from the same start and batches."""
    model = _model(rank)
    opt = mergecomp.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model=model,
                           sync_every=4, outer_lr=0.7, outer_momentum=0.9)
    with opt.anchor_weights():
        start = _weights(model)
    _train(model, opt, rank, 12)
    replicas = [_model(0) for _ in range(world_size)]
    for replica in replicas:
        with torch.no_grad():
            for p, w in zip(replica.parameters(), start):
                p.copy_(w)
    inner = [torch.optim.SGD(r.parameters(), lr=0.05, momentum=0.9) for r in replicas]
    anchor = [w.clone() for w in start]
    outer = torch.optim.SGD(anchor, lr=0.7, momentum=0.9, nesterov=True)
    for step in range(12):
        for r, (replica, sgd) in enumerate(zip(replicas, inner)):
            x, y = _batch(r, step)
            sgd.zero_grad()
            torch.nn.functional.mse_loss(replica(x), y).backward()
            sgd.step()
        if (step + 1) % 4 == 0:
            for i, a in enumerate(anchor):  # Δ = anchor − local, averaged; outer step; restart
                a.grad = sum(a.detach() - list(m.parameters())[i].detach() for m in replicas) / world_size
            outer.step()
            for replica in replicas:
                with torch.no_grad():
                    for p, a in zip(replica.parameters(), anchor):
                        p.copy_(a)
    with opt.anchor_weights():
        ours = _weights(model)
    return ours, [a.detach() for a in anchor], _weights(model)


def test_the_outer_step_matches_a_plain_simulation_of_algorithm_1():
    (ours, plain, local), _ = run_ranks(_against_a_plain_simulation, 2)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-5) for a, b in zip(ours, plain))
    assert all(torch.equal(a, b) for a, b in zip(ours, local))  # step 12 ended on an exchange


def _anchor_weights_outside_an_exchange(rank, world_size):
    model = _model(rank)
    opt = mergecomp.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.05), model=model, sync_every=4)
    _train(model, opt, rank, 6)
    local = _weights(model)
    with opt.anchor_weights():
        inside = _weights(model)
    return local, inside, _weights(model), [f.anchor.clone() for f in opt.fragments]


def test_anchor_weights_hold_the_shared_weights_and_give_the_local_ones_back():
    (local0, inside0, after0, anchors0), (local1, inside1, _, _) = run_ranks(_anchor_weights_outside_an_exchange, 2)
    assert not all(torch.equal(a, b) for a, b in zip(local0, local1))  # two steps after an exchange
    assert all(torch.equal(a, b) for a, b in zip(inside0, inside1))
    assert torch.equal(torch.cat([w.reshape(-1) for w in inside0]), anchors0[0])
    assert all(torch.equal(a, b) for a, b in zip(local0, after0))

def test_the_schedule():
    schedule = SyncSchedule(8, 4, overlap=2)
    assert schedule.offsets == [0, 2, 4, 6]
    assert [schedule.launching(t) for t in (2, 4, 6, 8, 10)] == [[1], [2], [3], [0], [1]]
    assert schedule.finishing(4) == [1] and schedule.finishing(10) == [0] and schedule.finishing(3) == []
    with pytest.raises(ValueError, match=r"overlap must be an integer in \[0, 2\].*got 3"):
        SyncSchedule(8, 4, overlap=3)
    with pytest.raises(ValueError, match="fragments=5 is more than sync_every=4"):
        SyncSchedule(4, 5)
    with pytest.raises(ValueError, match="sync_every .* must be an integer ≥ 1, got 0"):
        SyncSchedule(0)


def test_bad_arguments_are_refused_before_any_collective():
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="inner optimizer"):
        mergecomp.DiLoCo(model, sync_every=4)
    with pytest.raises(ValueError, match="outer_lr must be a finite number > 0, got 0"):
        mergecomp.DiLoCo(inner, model=model, sync_every=4, outer_lr=0)
    with pytest.raises(ValueError, match="outer_momentum must be in"):
        mergecomp.DiLoCo(inner, model=model, sync_every=4, outer_momentum=1.0)
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        mergecomp.DiLoCo(inner, model=model, sync_every=4, nonfinite="ignore")



def _warnings_of_the_outer_momentum(rank, world_size):
    model, said = _model(), {}
    for label, inner, outer in (("sgd-0.9", torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 0.9),
                                ("sgd-0.5", torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 0.5),
                                ("adamw-0.9", torch.optim.AdamW(model.parameters(), lr=0.01), 0.9)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mergecomp.DiLoCo(inner, model=model, sync_every=4, outer_momentum=outer)
        said[label] = [str(w.message) for w in caught if "outer momentum" in str(w.message)]
        said[label + ":recommended"] = mergecomp.lowcomm.recommended_outer_momentum(inner)
    return said


def test_an_inner_heavy_ball_momentum_under_the_paper_outer_momentum_is_warned_about():
    said = run_ranks(_warnings_of_the_outer_momentum, 1)[0]
    assert len(said["sgd-0.9"]) == 1 and "momentum=0.9" in said["sgd-0.9"][0]
    assert "outer_momentum=0.5" in said["sgd-0.9"][0]
    assert said["sgd-0.5"] == [] and said["adamw-0.9"] == []
    assert said["sgd-0.9:recommended"] == 0.5 and said["adamw-0.9:recommended"] == 0.9

# -- non-finite pseudo-gradients ---------------------------------------------------------------------
def _nan_on_rank_1(rank, world_size):
    model = _model(rank)
    opt = mergecomp.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.05), model=model, sync_every=3,
                           compressor=compressors.create("topk", compress_ratio=0.3), memory="residual")
    _train(model, opt, rank, 3)
    anchors = [f.anchor.clone() for f in opt.fragments]
    residual = dict(opt.memory.residuals.committed())
    _train(model, opt, rank, 2, start=3)
    if rank == 1:
        with torch.no_grad():
            next(model.parameters())[0, 0] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(model, opt, rank, 1, start=5)
    messages = [str(w.message) for w in caught]
    same_anchor = all(torch.equal(a, f.anchor) for a, f in zip(anchors, opt.fragments))
    same_memory = all(torch.equal(residual[k], v) for k, v in opt.memory.residuals.committed().items())
    at_anchor = torch.equal(opt.fragments[0].flat(), opt.fragments[0].anchor)
    _train(model, opt, rank, 3, start=6)  # training goes on
    return opt.skipped_steps, same_anchor, same_memory, at_anchor, messages, _weights(model)


def test_a_nan_on_one_rank_drops_the_outer_step_on_every_rank():
    results = run_ranks(_nan_on_rank_1, 2)
    for skipped, same_anchor, same_memory, at_anchor, messages, _ in results:
        assert skipped == 1 and same_anchor and same_memory and at_anchor
        assert any("rank(s) [1]" in m and "dropped on every rank" in m for m in messages)
    assert all(torch.equal(a, b) for a, b in zip(results[0][5], results[1][5]))
    assert all(bool(torch.isfinite(p).all()) for p in results[0][5])


def _nan_batch_under_adamw(rank, world_size):
    """One NaN batch on rank 1 between exchanges, with AdamW inside: the inner step takes it
    into the moments, unchecked (no pass over the model between exchanges)."""
    model = _model(rank)
    opt = mergecomp.DiLoCo(torch.optim.AdamW(model.parameters(), lr=0.01), model=model, sync_every=3)
    said = []
    for step in range(12):
        x, y = _batch(rank, step)
        if rank == 1 and step == 4:
            x[0, 0] = float("nan")
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        said += [str(w.message) for w in caught]
    moments_finite = all(bool(v.isfinite().all()) for state in opt.optimizer.state.values()
                         for v in state.values() if torch.is_tensor(v))
    return opt.skipped_steps, opt.outer_steps, said, moments_finite, _weights(model)


def test_a_nan_batch_under_adamw_costs_one_exchange_not_the_rest_of_the_run():
    results = run_ranks(_nan_batch_under_adamw, 2)
    for rank, (skipped, outer, said, moments_finite, weights) in enumerate(results):
        assert skipped == 1 and outer == 3  # the exchange after the NaN dropped, the next ones applied
        assert moments_finite and all(bool(torch.isfinite(p).all()) for p in weights)
        mended = [m for m in said if "inner optimizer state held NaN or Inf" in m]
        assert len(mended) == (1 if rank == 1 else 0)  # told on the rank whose moments it mended
    assert all(torch.equal(a, b) for a, b in zip(results[0][4], results[1][4]))  # step 12 ends an exchange


# -- checkpoints ----------------------------------------------------------------------------------
def _build(rank, seed):
    model = _model(seed)
    opt = mergecomp.DiLoCo(torch.optim.AdamW(model.parameters(), lr=0.01), model=model, sync_every=4,
                           fragments=2, overlap=1, compressor=compressors.create("topk", compress_ratio=0.25),
                           memory="residual")
    return model, opt


def _resume(rank, world_size):
    model, opt = _build(rank, rank)
    _train(model, opt, rank, 5)  # fragment 0's exchange (launched at 4) ended; 1's launches at 6
    _train(model, opt, rank, 1, start=5)  # ... and is in flight now
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    _train(model, opt, rank, 7, start=6)
    buffer.seek(0)
    resumed_model, resumed = _build(rank, 77)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    _train(resumed_model, resumed, rank, 7, start=6)
    return _weights(model), _weights(resumed_model), opt.outer_steps, resumed.outer_steps


def test_resume_is_exact_even_with_an_exchange_in_flight():
    for original, resumed, outer, outer_resumed in run_ranks(_resume, 2):
        assert outer == outer_resumed
        assert all(torch.equal(a, b) for a, b in zip(original, resumed))


def _corrupted(rank, world_size):
    model, opt = _build(rank, 0)
    _train(model, opt, rank, 5)
    state = opt.state_dict()
    state["mergecomp"]["anchors"][0][0] += 1.0
    try:
        opt.load_state_dict(state)
    except mergecomp.checkpoint.CheckpointError as error:
        return str(error)
    return None


def test_a_corrupted_checkpoint_is_refused():
    for message in run_ranks(_corrupted, 2):
        assert message is not None and "anchors.0 changed" in message and "Nothing was loaded" in message


# -- the example -----------------------------------------------------------------------------------
def _example(rank, world_size, folder):
    from tests.examples import load_example
    module = load_example("diloco")
    first = module.train(module.parse_args(["--steps", "8", "--sync-every", "4", "--checkpoint", folder]))
    again = module.train(module.parse_args(["--steps", "4", "--sync-every", "4", "--checkpoint", folder]))
    return first, again


def test_the_example_trains_and_resumes_from_per_rank_checkpoints(tmp_path):
    for first, again in run_ranks(_example, 2, str(tmp_path)):
        assert 0 < again < first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["diloco.rank0.pt", "diloco.rank1.pt"]
