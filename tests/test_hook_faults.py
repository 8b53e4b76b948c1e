"""Faults of the DDP hook and the wrapper at runtime, on real gloo ranks: the first steps
compressed while DDP rebuilds its buckets, sparse gradients, a model converted after
wrapping, parameters that join the training later, and a hook registered on some ranks only."""
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


def _step(model, opt, step, rank, dtype=torch.float32):
    x, y = batch(step, rank)
    opt.zero_grad()
    nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype)).backward()
    opt.step()


def _error(fn):
    try:
        fn()
    except Exception as error:  # the test compares the messages
        return f"{type(error).__name__}: {error}"
    return None


# -- the first steps -------------------------------------------------------------------------
def first_steps_worker(rank, world_size):
    model = make_model()
    ddp = _ddp(model)
    state = mergecomp.ddp.register(ddp, compressor="topk", memory="residual")
    raw_starts = []
    exact = state.lifecycle.communicator_for("exact")
    exact_start = exact.start
    exact.start = lambda *a, **k: raw_starts.append(state.steps) or exact_start(*a, **k)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sent, layouts = [], []
    for step in range(3):
        before = state.backend.bytes_sent
        _step(ddp, opt, step, rank)
        sent.append(state.backend.bytes_sent - before)
        layouts.append(dict(state.layouts))
    return raw_starts, sent, layouts, [p.detach().clone() for p in model.parameters()]


def test_the_hook_compresses_from_the_first_step_while_ddp_rebuilds_its_buckets():
    (raw0, sent0, layouts, params0), (raw1, sent1, _, params1) = run_ranks(first_steps_worker, 2)
    assert raw0 == raw1 == []  # no bucket went raw, not even in the first two steps
    assert layouts[0] != layouts[1] == layouts[2]  # DDP did rebuild its buckets after one step
    raw_bytes = sum(p.numel() * 4 for p in make_model().parameters())
    probe = sum(n for _, n in layouts[0][0]) * 4  # the one-time registration check
    assert sent0[0] - probe < raw_bytes / 3 and max(sent0[1:]) < raw_bytes / 3
    for a, b in zip(params0, params1):
        assert torch.equal(a, b)


def unnamed_worker(rank, world_size):
    model = make_model()
    ddp = _ddp(model)
    state = mergecomp.ddp.HookState(None, "topk", "residual")  # buckets only: no names to follow
    ddp.register_comm_hook(state, mergecomp.ddp.hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the state is empty when DDP rebuilds: nothing is lost
        for step in range(3):
            _step(ddp, opt, step, rank)
    return [p.detach().clone() for p in model.parameters()]


def test_a_hook_state_without_the_model_sends_its_changed_buckets_exact():
    params0, params1 = run_ranks(unnamed_worker, 2)
    for a, b in zip(params0, params1):
        assert torch.equal(a, b) and torch.isfinite(a).all()


# -- sparse gradients ------------------------------------------------------------------------
class Embedded(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.fc = nn.Linear(4, 1)

    def forward(self, i):
        return self.fc(self.emb(i)).sum()


def sparse_worker(rank, world_size, entry):
    torch.manual_seed(0)
    model = Embedded()
    if entry == "register":
        return _error(lambda: mergecomp.ddp.register(DDP(model), compressor="topk"))
    if entry == "hook without model":  # no model to look at: the first bucket says it
        ddp = DDP(model)
        ddp.register_comm_hook(mergecomp.ddp.HookState(None, "topk"), mergecomp.ddp.hook)
        return _error(lambda: ddp(torch.tensor([1, 2])).backward())
    opt = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                         compressor="topk")
    return _error(lambda: model(torch.tensor([1, 2])).backward())


@pytest.mark.parametrize("entry,names", [("register", "emb.weight"), ("hook without model", "bucket"),
                                         ("wrapper", "emb.weight")])
def test_sparse_gradients_are_refused_naming_the_parameter(entry, names):
    for message in run_ranks(sparse_worker, 2, entry):
        assert message and "ValueError" in message and "sparse" in message and names in message
        assert "sparse=False" in message


# -- a model converted after wrapping --------------------------------------------------------
def converted_worker(rank, world_size, entry):
    model = make_model()
    if entry == "hook":
        ddp = _ddp(model)
        mergecomp.ddp.register(ddp, compressor="topk", memory="residual")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        net = ddp
    else:
        opt = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                             compressor="topk", memory="residual")
        net = model
    for step in range(2):
        _step(net, opt, step, rank)
    model.to(torch.float64)
    message = _error(lambda: [_step(net, opt, step, rank, torch.float64) for step in range(2, 4)])
    return message, [p.detach().clone() for p in model.parameters()]


def test_a_model_converted_after_the_wrapper_is_refused_naming_parameter_and_dtypes():
    for message, _ in run_ranks(converted_worker, 2, "wrapper"):
        assert message.startswith("RuntimeError: parameter ")
        assert "now torch.float64" in message and "was torch.float32" in message
        assert "then build the optimizer and DistributedOptimizer" in message


def test_a_model_converted_under_the_hook_is_refused_naming_parameter_and_dtypes():
    # Plain DDP no longer reduces anything after the conversion: the ranks drift apart.
    for message, _ in run_ranks(converted_worker, 2, "hook"):
        assert message.startswith("RuntimeError: parameter '0.weight' is now torch.float64 on cpu, but "
                                  "it was torch.float32 on cpu when DistributedDataParallel")
        assert "then build DistributedDataParallel and register the hook" in message


# -- parameters that join later --------------------------------------------------------------
def late_worker(rank, world_size, how):
    torch.manual_seed(rank)  # frozen layers start different: the wrapper makes them equal
    model = make_model()
    first = list(model[0].parameters())
    if how == "add_param_group":
        inner = torch.optim.SGD(list(model.parameters())[2:], lr=0.1)
    else:
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        for p in first:
            p.requires_grad_(False)
    opt = mergecomp.DistributedOptimizer(inner, model=model, compressor="topk", memory="residual")
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for step in range(4):
            if step == 2:
                if how == "add_param_group":
                    opt.add_param_group({"params": first})
                elif how == "inner add_param_group":
                    for p in first:
                        p.requires_grad_(True)
                    inner.add_param_group({"params": []})  # the wrapper notices the new group too
                elif how == "unfreeze":
                    for p in first:
                        p.requires_grad_(True)
            x, y = batch(step, rank)
            opt.zero_grad()
            if step == 2 and how == "unfreeze after zero_grad":
                for p in first:
                    p.requires_grad_(True)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    messages = [str(w.message) for w in warned if "mergecomp" in str(w.message)]
    return [p.detach().clone() for p in model.parameters()], opt.reducer.added, messages


@pytest.mark.parametrize("how", ["unfreeze", "add_param_group", "unfreeze after zero_grad"])
def test_parameters_that_join_later_are_exchanged_and_ranks_stay_equal(how):
    (params0, added0, warned0), (params1, added1, _) = run_ranks(late_worker, 2, how)
    assert added0 == added1 == ["0.weight", "0.bias"]
    for a, b in zip(params0, params1):
        assert torch.equal(a, b)
    if how == "unfreeze after zero_grad":  # its first gradient was seen by one rank: not applied
        assert any("started requiring gradients" in m and "0.weight" in m for m in warned0)
    else:
        assert warned0 == []


def unfreeze_one_rank_worker(rank, world_size):
    model = make_model()
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    _step(model, opt, 0, rank)
    if rank == 1:
        model[0].weight.requires_grad_(True)
    return _error(lambda: _step(model, opt, 1, rank))


def test_a_layer_unfrozen_on_one_rank_only_is_refused_on_every_rank():
    for message in run_ranks(unfreeze_one_rank_worker, 2):
        assert "RanksDisagree" in message and "added: rank 0: None, rank 1: ['0.weight']" in message
        assert "unfreeze the same layers" in message


def hook_unfreeze_worker(rank, world_size):
    model = make_model()
    for p in model[0].parameters():
        p.requires_grad_(False)
    ddp = _ddp(model)
    mergecomp.ddp.register(ddp, compressor="topk", memory="residual")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(ddp, opt, 0, rank)
    model[0].weight.requires_grad_(True)
    return _error(lambda: _step(ddp, opt, 1, rank))


def test_a_layer_unfrozen_under_the_hook_is_refused_naming_it():
    for message in run_ranks(hook_unfreeze_worker, 2):
        assert message.startswith("RuntimeError: parameter(s) ['0.weight'] were frozen")
        assert "Build DistributedDataParallel and register the hook again" in message


# -- the hook on some ranks only -------------------------------------------------------------
def one_rank_hook_worker(rank, world_size, unregistered):
    model = make_model()
    ddp = _ddp(model)
    if rank not in unregistered:
        mergecomp.ddp.register(ddp, compressor="topk", memory="residual")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return _error(lambda: [_step(ddp, opt, step, rank) for step in range(2)])


@pytest.mark.parametrize("world_size,unregistered", [(2, (1,)), (3, (0,))])
def test_a_hook_registered_on_some_ranks_only_names_the_others(world_size, unregistered):
    results = run_ranks(one_rank_hook_worker, world_size, unregistered)
    for rank, message in enumerate(results):
        if rank in unregistered:
            assert message is not None  # DDP's own allreduce fails at its next collective
        else:
            assert message.startswith(f"RuntimeError: the mergecomp DDP communication hook is not "
                                      f"registered on rank(s) {list(unregistered)}")
            # the hook's own check, not a collective's timeout
            assert "Register the hook on every rank" in message and "timed out" not in message
