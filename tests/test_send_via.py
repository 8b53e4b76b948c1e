"""Send modes that name a communicator ("compress:<name>"): plans carry them, the step
lifecycle builds one communicator per mode around the job's compressor and memory, the
non-finite check covers them, state folds on plan switches and checkpoints, and the
optimal scheduler chooses between the sparse allreduce and the allgather per group."""
import warnings

import pytest
import torch
import torch.nn as nn

import mergecomp
from mergecomp.plan import Group, ParamInfo, Plan, valid_sends
from mergecomp.planning.profile import CodecCost, LinearCost, Profile, TensorTiming, WireSize
from mergecomp.planning.simulate import network_collectives
from mergecomp.planning.optimal import OptimalScheduler
from tests.distributed import run_ranks

SPARSE = "compress:sparse_allreduce"


# ----------------------------------------------------------------------------- plain data
def test_a_plan_with_communicator_modes_round_trips_and_digests():
    plan = Plan([Group(("a", "b"), "compress"), Group(("c",), SPARSE), Group(("d",), "fp32")])
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.digest() == plan.digest()
    assert Plan([Group(("a", "b"), "compress"), Group(("c",), "compress"), Group(("d",), "fp32")]
                ).digest() != plan.digest()
    assert "send=compress:sparse_allreduce" in plan.describe()


def test_plans_of_the_old_modes_keep_their_digest():
    plan = Plan([Group(("fc.weight", "fc.bias"), "compress"), Group(("conv.weight",), "fp16")])
    assert plan.to_json(indent=None) == ('{"groups": [{"names": ["fc.weight", "fc.bias"], "send": "compress"}, '
                                         '{"names": ["conv.weight"], "send": "fp16"}]}')
    assert plan.digest() == "de3999264dc35f72"  # as before "compress:<name>" modes existed


@pytest.mark.parametrize("send", ["compress:nonesuch", "compress:", "sparse_allreduce", "Compress", 3])
def test_a_bad_mode_is_refused_with_the_valid_ones(send):
    with pytest.raises(ValueError) as error:
        Group(("a",), send)
    for valid in ("compress", "fp32", "fp16", "bf16", "compress:allgather", SPARSE):
        assert valid in str(error.value)
    assert repr(send) in str(error.value)
    with pytest.raises(ValueError, match="group 0 of the plan"):
        Plan.from_dict({"groups": [{"names": ["a"], "send": send}]})
    assert SPARSE in valid_sends()


# ------------------------------------------------------------------------- the optimal DP
def synthetic_profile(world, tensors=8, numel=2 ** 20, gbit=1.0):
    """A top-k 1% job: ``tensors`` equal gradients ready evenly over 40 ms of backward, a
    top-k of 2 ns per element (the sparse allreduce's owners pay it again over n/N),
    α-β collectives of a ``gbit`` link at ``world`` workers."""
    timeline = [TensorTiming(f"t{i}", numel, 4 * numel, "torch.float32", "cpu", 0.005 * (i + 1))
                for i in range(tensors)]
    codec = CodecCost(LinearCost(1e-4, 2e-9), LinearCost(1e-4, 1e-11), WireSize(0.08, 0.0),
                      add=LinearCost(1e-5, 1e-11))
    return Profile(world_size=world, timeline=timeline, forward_time=0.02, backward_time=0.04,
                   compressor="topk", communicator="allgather", codecs={"topk": codec},
                   collectives=network_collectives(world, gbit * 1e9 / 8, 50e-6))


def test_optimal_picks_the_sparse_allreduce_at_many_ranks_and_the_allgather_at_two():
    params = synthetic_profile(2).params()

    def sparse_share(plan):  # of the gradient's tensors (all equal), the share sent sparse
        return sum(len(g.names) for g in plan.groups if g.send == SPARSE) / len(params)

    # At 64 ranks the sparse allreduce carries the gradient.  Its launch waits for its
    # all-to-all (and for the channel), so a first group may go by allgather beside backward.
    many = OptimalScheduler(synthetic_profile(64), communicators=("sparse_allreduce",),
                            sends=("compress", SPARSE)).plan(params)
    assert sparse_share(many) >= 0.75, many.describe()
    two = OptimalScheduler(synthetic_profile(2), communicators=("sparse_allreduce",),
                           sends=("compress", SPARSE)).plan(params)
    assert {g.send for g in two.groups} == {"compress"}, two.describe()
    # with fp32 allowed too, the many-rank plan still sends most of the gradient sparse
    mixed = OptimalScheduler(synthetic_profile(64), communicators=("sparse_allreduce",)).plan(params)
    assert sparse_share(mixed) >= 0.75, mixed.describe()



def test_predict_prices_the_communicators_a_plan_names():
    """The optimal plan of a many-rank job sends by the sparse allreduce; the cost model
    prices it as the optimal scheduler did, with no costs passed (as the auto scheduler's
    candidates and the simulator's checks are priced)."""
    from mergecomp.planning.costmodel import predict
    profile = synthetic_profile(64)
    solution = OptimalScheduler(profile, communicators=("sparse_allreduce",)).solve()
    assert SPARSE in {g.send for g in solution.plan.groups}
    assert predict(solution.plan, profile).iteration_time == pytest.approx(solution.iteration_time)

def test_optimal_refuses_a_mode_the_profile_cannot_price():
    profile = synthetic_profile(8)
    del profile.collectives["alltoall"]
    with pytest.raises(ValueError, match="alltoall"):
        OptimalScheduler(profile, communicators=("sparse_allreduce",))
    with pytest.raises(ValueError, match="compress:allgather"):
        OptimalScheduler(synthetic_profile(8), sends=("fp32", "compress:nonesuch"))


# ---------------------------------------------------------------------------- on 3 ranks
def model_and_data(rank):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 10, generator=g)
    return model, x, x.sum(1, keepdim=True) * 0.3


def train(rank, sends, steps=6, nan_at=None, **options):
    model, x, y = model_and_data(rank)
    names = [n for n, _ in model.named_parameters()][::-1]  # backward order
    plan = Plan([Group(tuple(names[:2]), sends[0]), Group(tuple(names[2:]), sends[1])])
    opt = mergecomp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
        compressor=mergecomp.compressors.create("topk", compress_ratio=0.2), memory="residual",
        communicator="allgather", schedule=plan, **options)
    poison = []

    def nan_on_rank_1(grad):  # in the second group, before its hook launches it
        return grad.clone().fill_(float("nan")) if poison and rank == 1 else grad

    model[0].weight.register_hook(nan_on_rank_1)
    for step in range(steps):
        poison[:] = [True] if step == nan_at else []
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            opt.step()
    return opt, model


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def mixed_worker(rank, world_size):
    exact = {"communicator_options": {"sparse_allreduce": {"keep": None}}}
    _, gathered = train(rank, ("compress", "compress"))
    opt, mixed = train(rank, ("compress", SPARSE), **exact)
    kinds = sorted(type(c).__name__ for c in opt.reducer.communicators())
    _, dropped = train(rank, ("compress", SPARSE), steps=3, nan_at=2, **exact)
    _, two_steps = train(rank, ("compress", SPARSE), steps=2, **exact)
    skipped = train(rank, ("compress", SPARSE), steps=3, nan_at=2, **exact)[0].skipped_steps
    return flat(gathered), flat(mixed), kinds, flat(dropped), flat(two_steps), skipped


def test_a_mixed_plan_trains_identical_replicas_equal_to_the_allgather():
    results = run_ranks(mixed_worker, 3)
    for gathered, mixed, kinds, dropped, two_steps, skipped in results:
        # keep=None: the sparse allreduce sums exactly what the allgather sums, bit for bit
        assert torch.equal(mixed, gathered)
        assert torch.equal(mixed, results[0][1])  # identical replicas
        assert kinds == ["AllgatherCommunicator", "AllreduceCommunicator", "SparseAllreduceCommunicator"] \
            or kinds == ["AllgatherCommunicator", "SparseAllreduceCommunicator"]
        # a NaN on rank 1 in the sparse group drops the step on every rank
        assert skipped == 1
        assert torch.equal(dropped, two_steps)


def owner_worker(rank, world_size):
    """keep=1 with the residual memory: owner residuals fold into the memory on a plan
    switch and in a checkpoint, so the total held back over ranks is unchanged."""
    opt, model = train(rank, (SPARSE, SPARSE), steps=3)
    reducer = opt.reducer
    sparse = next(c for c in reducer.communicators() if type(c).__name__ == "SparseAllreduceCommunicator")
    owned = sum(float(t.sum()) for t in sparse.owner_residuals.committed().values())
    memory = sum(float(t.sum()) for t in opt.memory.residuals.committed().values())
    saved = opt.state_dict()["mergecomp"]["communicator"]["memory"]["residuals"]
    in_checkpoint = sum(float(t.sum()) for t in saved.values())
    names = [n for n, _ in model.named_parameters()][::-1]
    reducer.set_plan(Plan([Group(tuple(names[:3]), "compress"), Group(tuple(names[3:]), SPARSE)]))
    after = sum(float(t.sum()) for t in opt.memory.residuals.committed().values())
    left = sum(float(t.numel()) for t in sparse.owner_residuals.committed().values())
    return owned, memory, in_checkpoint, after, left


def test_owner_residuals_fold_into_the_memory_on_a_switch_and_in_a_checkpoint():
    results = run_ranks(owner_worker, 3)
    owned = sum(r[0] for r in results)
    assert any(abs(r[0]) > 0 for r in results)  # the owners dropped something
    before = sum(r[1] for r in results) + owned
    assert sum(r[2] for r in results) == pytest.approx(before, abs=1e-5)
    assert sum(r[3] for r in results) == pytest.approx(before, abs=1e-5)
    assert all(r[4] == 0 for r in results)


def refused_worker(rank, world_size):
    messages = []
    for sends, options in ((("compress", "compress:allreduce"), {}),
                           (("compress", SPARSE), {"memory": "dgc"}),
                           (("compress", "compress:ps"), {})):
        memory = options.pop("memory", "residual")
        model, _, _ = model_and_data(rank)
        names = [n for n, _ in model.named_parameters()][::-1]
        plan = Plan([Group(tuple(names[:2]), sends[0]), Group(tuple(names[2:]), sends[1])])
        try:
            mergecomp.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1),
                model.named_parameters(), compressor="topk", memory=memory, communicator="allgather",
                schedule=plan)
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_a_mode_that_cannot_carry_the_job_is_refused_at_construction():
    messages = run_ranks(refused_worker, 2)[0]
    assert len(messages) == 3, messages
    assert "compress:allreduce" in messages[0] and "cannot carry compressor 'topk'" in messages[0]
    assert "owner residuals" in messages[1] and "owner_residual" in messages[1]
    assert "compress:ps" in messages[2] and "job's communicator" in messages[2]


def test_communicator_options_are_checked():
    from mergecomp.runtime.step import check_communicator_options
    with pytest.raises(ValueError, match="not a registered communicator"):
        check_communicator_options({"nonesuch": {}})
    with pytest.raises(TypeError, match="keyword"):
        check_communicator_options({"sparse_allreduce": ["keep"]})


def test_an_option_the_communicator_does_not_take_is_refused_with_the_ones_it_does():
    from mergecomp.runtime.step import check_communicator_options
    with pytest.raises(TypeError, match="'sparse_allreduce' takes no option 'kep'.*did you mean 'keep'.*keep, owner_residual"):
        check_communicator_options({"sparse_allreduce": {"kep": None}})
    with pytest.raises(TypeError, match="'allgather' takes no option 'compressor'; it takes none"):
        check_communicator_options({"allgather": {"compressor": "topk"}})  # the lifecycle passes that one
    assert check_communicator_options({"sparse_allreduce": {"keep": None}}) == {"sparse_allreduce": {"keep": None}}
