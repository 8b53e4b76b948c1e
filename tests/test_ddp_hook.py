"""mergecomp as a DDP communication hook, on real gloo ranks."""
import copy
import gc
import io
import pickle
import warnings

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import mergecomp
import mergecomp.ddp
from tests.distributed import run_ranks
from tests.test_optimizer import batch, make_model


def _ddp(model, groups=2):
    return DDP(model, bucket_cap_mb_list=mergecomp.ddp.bucket_caps(model, groups))


def _bucket_plan(layouts, sends="compress"):
    """The mergecomp plan whose groups are the hook's buckets, in bucket order."""
    return mergecomp.Plan([mergecomp.Group(tuple(n for n, _ in layouts[i]), sends) for i in sorted(layouts)])


def equivalence_worker(rank, world_size, compressor, memory, communicator, start_scale=None):
    def controller():  # None: the default; a warm start's scales must follow DDP's bucket rebuild
        return {} if start_scale is None else {"controller": mergecomp.DriftController(start_scale=start_scale)}
    model = make_model()
    ddp = _ddp(model)
    state = mergecomp.ddp.register(ddp, compressor=compressor, memory=memory, communicator=communicator,
                                   **controller())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hook_grads, layouts = [], []
    for step in range(4):
        x, y = batch(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        hook_grads.append([p.grad.clone() for p in model.parameters()])
        layouts.append(dict(state.layouts))
        opt.step()
    layouts_stable = len(state.layouts) == 2 and layouts[1] == layouts[3] != layouts[0]

    # The same exchange through DistributedOptimizer: the buckets as groups.  DDP rebuilds
    # its buckets after its first iteration; the hook compresses both (the state follows the
    # parameters into the new buckets), as a plan switch after the first step does.  A
    # parameter server's shard residuals cannot follow, so there the first step goes exact.
    twin = make_model()
    wrapper = mergecomp.DistributedOptimizer(
        torch.optim.SGD(twin.parameters(), lr=0.1), model=twin, compressor=compressor, memory=memory,
        communicator=communicator, schedule=_bucket_plan(layouts[0], "fp32" if communicator == "ps" else "compress"),
        **controller())
    optimizer_grads = []
    for step in range(4):
        if step == 1:
            wrapper.set_plan(_bucket_plan(layouts[1]))
        x, y = batch(step, rank)
        wrapper.zero_grad()
        nn.functional.mse_loss(twin(x), y).backward()
        optimizer_grads.append([p.grad.clone() for p in twin.parameters()])
        wrapper.step()
    return hook_grads, optimizer_grads, layouts_stable, state.steps


EQUIVALENT = [("fp16", "none", "allreduce"), ("topk", "residual", "allgather"), ("topk", "residual", "ps"),
              ("powersgd", "none", "allreduce"), ("signsgd", "none", "allgather"),
              ("efsignsgd", "residual", "allgather"), ("dgc", "residual", "allgather")]


@pytest.mark.parametrize("compressor,memory,communicator", EQUIVALENT)
def test_the_hook_averages_as_the_optimizer_does_with_the_same_groups(compressor, memory, communicator):
    for hook_grads, optimizer_grads, stable, steps in run_ranks(equivalence_worker, 2, compressor, memory,
                                                                communicator):
        assert stable and steps == 4
        for step, (a, b) in enumerate(zip(hook_grads, optimizer_grads)):
            for got, want in zip(a, b):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=f"step {step}")


def test_the_hook_regroups_the_controllers_scales_when_ddp_rebuilds_its_buckets_as_the_wrapper_does():
    # a warm start raises the buckets at step 0, to different scales once the budget trims
    # them; DDP rebuilds its buckets after step 0, and the scales follow the new buckets as a
    # plan switch's do (a bucket's name now stands for other parameters)
    for hook_grads, optimizer_grads, stable, _ in run_ranks(equivalence_worker, 2, "topk", "residual", "allgather", 16):
        assert stable
        for step, (a, b) in enumerate(zip(hook_grads, optimizer_grads)):
            for got, want in zip(a, b):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=f"step {step}")


def every_compressor_worker(rank, world_size, compressor):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    ddp = _ddp(model)
    state = mergecomp.ddp.register(ddp, compressor=compressor)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(4):
        x, y = batch(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], state.skipped_steps


@pytest.mark.parametrize("compressor", sorted(mergecomp.compressors.available()))
def test_every_registered_compressor_runs_on_ddp_buckets(compressor):
    (a, skipped0), (b, skipped1) = run_ranks(every_compressor_worker, 2, compressor)
    assert skipped0 == skipped1 == 0
    for x, y in zip(a, b):
        assert torch.equal(x, y) and torch.isfinite(x).all()


def checkpoint_worker(rank, world_size, how, compressor, memory, folder):
    """Train 4 steps, save, go on 3 steps; then a fresh model, optimizer, DDP and hook state
    (a restarted job, whose DDP buckets its first iteration in definition order) load the
    checkpoint and run the same 3 steps: the parameters must be the same, bit for bit."""
    def train(ddp, opt, steps, first):
        for step in range(first, first + steps):
            x, y = batch(step, rank)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()

    momentum = 0.0 if memory == "dgc" else 0.9  # the dgc memory owns the momentum
    model = make_model()
    ddp = _ddp(model)
    state = mergecomp.ddp.register(ddp, compressor=compressor, memory=memory)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    train(ddp, opt, 4, 0)
    path = f"{folder}/ckpt.rank{rank}.pt"
    hook_state = pickle.dumps(state) if how == "pickle" else state.state_dict()
    mergecomp.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "hook": hook_state}, path)
    train(ddp, opt, 3, 4)
    uninterrupted = [p.detach().clone() for p in model.parameters()]

    saved = mergecomp.load(path)
    resumed = make_model(seed=1)
    resumed.load_state_dict(saved["model"])
    ddp2 = _ddp(resumed)
    opt2 = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=momentum)
    opt2.load_state_dict(saved["optimizer"])
    if how == "pickle":
        state2 = pickle.loads(saved["hook"]).attach(ddp2)
    else:
        state2 = mergecomp.ddp.HookState(ddp2, compressor=compressor, memory=memory)
        state2.load_state_dict(saved["hook"])
    ddp2.register_comm_hook(state2, mergecomp.ddp.hook)
    train(ddp2, opt2, 3, 4)
    return uninterrupted, [p.detach().clone() for p in resumed.parameters()], state2.steps, state2.skipped_steps


@pytest.mark.parametrize("how,compressor,memory", [
    ("state_dict", "topk", "residual"), ("pickle", "topk", "residual"),
    ("state_dict", "dgc", "dgc"), ("state_dict", "powersgd", "none")])
def test_a_resumed_hook_continues_bit_for_bit(how, compressor, memory, tmp_path):
    for uninterrupted, resumed, steps, skipped in run_ranks(checkpoint_worker, 2, how, compressor, memory,
                                                            str(tmp_path)):
        assert steps == 7 and skipped == 0
        for a, b in zip(uninterrupted, resumed):
            assert torch.equal(a, b)


def nonfinite_worker(rank, world_size):
    model = make_model()
    ddp = _ddp(model)
    state = mergecomp.ddp.register(ddp, compressor="topk", memory="residual")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads_nan = None
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for step in range(4):
            x, y = batch(step, rank)
            if step == 2 and rank == 1:
                x = x.clone()
                x[0, 0] = float("nan")
            opt.zero_grad()
            if step == 2:
                before = io.BytesIO()
                torch.save(state.communicator.state_dict(), before)
            nn.functional.mse_loss(ddp(x), y).backward()
            if step == 2:
                grads_nan = all(torch.isnan(p.grad).all() for p in model.parameters())
                after = io.BytesIO()
                torch.save(state.communicator.state_dict(), after)
                unchanged = before.getvalue() == after.getvalue()
                continue  # the caller skips the NaN step, as GradScaler would
            opt.step()
    return (grads_nan, unchanged, state.skipped_steps, [p.detach().clone() for p in model.parameters()],
            any("rank(s) [1]" in str(w.message) for w in warned))


def test_a_nan_on_one_rank_makes_the_buckets_nan_everywhere_and_keeps_state():
    (nan0, same0, skipped0, params0, warned0), (nan1, same1, skipped1, params1, _) = run_ranks(nonfinite_worker, 2)
    assert nan0 and nan1 and same0 and same1 and skipped0 == skipped1 == 1 and warned0
    for a, b in zip(params0, params1):
        assert torch.equal(a, b) and torch.isfinite(a).all()


def test_bucket_caps_follow_the_schedule_and_refuse_adaptive_ones():
    model = make_model()
    caps = mergecomp.ddp.bucket_caps(model, 2)
    sizes = [p.numel() * 4 for p in model.parameters()]
    assert len(caps) == 2 and abs(sum(caps) * 2 ** 20 - sum(sizes)) < 1e-3
    with pytest.raises(ValueError, match="re-plans while training"):
        mergecomp.ddp.bucket_caps(model, "auto")


def test_the_hook_takes_the_communicator_by_name():
    with pytest.raises(TypeError, match="by name"):
        mergecomp.ddp.HookState(None, "none", "none", communicator=object.__new__(
            mergecomp.communicators.get("allreduce")))
