"""What every rank must agree on: the starting model, the configuration, the step, and
whether a step is applied at all (NaN/Inf anywhere drops it on every rank)."""
import io
import warnings

import pytest
import torch
import torch.nn as nn

import mergecomp
from mergecomp.runtime.agreement import RanksDisagree, StepOutcome, describe_disagreement, fact_hash, hash_bits
from tests.distributed import run_ranks
from tests.test_optimizer import batch, make_model


class WithNorm(nn.Module):
    """Parameters and a buffer (batch norm's running statistics)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.body(x))))


def starting_model_worker(rank, world_size):
    torch.manual_seed(100 + rank)  # a different model on every rank
    model = WithNorm()
    model.norm.running_mean.fill_(float(rank))
    opt = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                         schedule=2)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for step in range(2):
        x, y = batch(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    trained = [p.detach().clone() for p in model.parameters()]

    torch.manual_seed(100 + rank)
    other = WithNorm()
    try:
        mergecomp.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1), model=other,
                                       initial_sync="check")
        refused = None
    except ValueError as error:
        refused = str(error)
    return state, trained, refused


def test_every_rank_starts_from_rank_0s_parameters_and_buffers():
    results = run_ranks(starting_model_worker, 2)
    (state0, trained0, refused0), (state1, trained1, refused1) = results
    for key in state0:
        assert torch.equal(state0[key], state1[key]), key
    assert float(state1["norm.running_mean"][0]) == 0.0  # rank 0's buffer
    for a, b in zip(trained0, trained1):
        assert torch.equal(a, b)
    # Opting out of the broadcast checks instead, with the same error on every rank.
    assert refused0 == refused1 and "rank 1: 'body.weight'" in refused0 and "initial_sync='broadcast'" in refused0


def averaged_after_backward_worker(rank, world_size):
    model = make_model()
    mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    x, y = batch(0, rank)
    nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_p_grad_holds_the_average_when_backward_returns():
    results = run_ranks(averaged_after_backward_worker, 2)
    model = make_model()
    xs, ys = zip(*(batch(0, r) for r in range(2)))
    nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
    for grads in results:
        for got, p in zip(grads, model.parameters()):
            torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-6)


def clipping_worker(rank, world_size):
    model = make_model()
    opt = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    for step in range(3):
        x, y = batch(step, rank)
        opt.zero_grad()
        (10 * nn.functional.mse_loss(model(x), y)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # the DDP habit: right after backward
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_gradient_clipping_between_backward_and_step_clips_the_average():
    results = run_ranks(clipping_worker, 2)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        xs, ys = zip(*(batch(step, r) for r in range(2)))
        opt.zero_grad()
        (10 * nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys))).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    for params in results:
        for got, want in zip(params, model.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def grad_scaler_worker(rank, world_size, compressor):
    model = make_model()
    opt = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                         compressor=compressor)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scales, stepped = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for step in range(4):
            x, y = batch(step, rank)
            if step == 1 and rank == 1:
                x = x * float("inf")  # an overflow on one rank only
            opt.zero_grad()
            before = [p.detach().clone() for p in model.parameters()]
            scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            stepped.append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters())))
    return scales, stepped, [p.detach().clone() for p in model.parameters()], opt.skipped_steps


@pytest.mark.parametrize("compressor", ["none", "topk"])
def test_grad_scaler_skips_an_overflow_on_every_rank(compressor):
    (scales0, stepped0, params0, skipped0), (scales1, stepped1, params1, skipped1) = \
        run_ranks(grad_scaler_worker, 2, compressor)
    assert scales0 == scales1 and scales0[1] < scales0[0]  # both ranks backed off the scale
    assert stepped0 == stepped1 == [True, False, True, True]
    assert skipped0 == skipped1 == 1
    for a, b in zip(params0, params1):
        assert torch.equal(a, b) and torch.isfinite(a).all()


def nonfinite_worker(rank, world_size, compressor, memory, communicator, bad, policy):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    plain = compressor in ("signum", "dgc") or memory in ("dgc", "demo")  # they apply momentum themselves
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.0 if plain else 0.9)
    opt = mergecomp.DistributedOptimizer(base, model=model, compressor=compressor, memory=memory,
                                         communicator=communicator, schedule=2, nonfinite=policy)

    def state():
        buffer = io.BytesIO()
        torch.save(opt.communicator.state_dict(), buffer)
        return buffer.getvalue()

    caught = []
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for step in range(4):
            x, y = batch(step, rank)
            if step == 2 and rank == 1:
                x = x.clone()
                x[0, 0] = bad
            opt.zero_grad()
            if step == 2:
                before_state, before_params = state(), [p.detach().clone() for p in model.parameters()]
            try:
                nn.functional.mse_loss(model(x), y).backward()
            except mergecomp.runtime.agreement.NonFiniteGradient as error:
                caught.append(str(error))  # the step is closed: the loop goes on
                unchanged_state = state() == before_state
                unchanged_params = all(torch.equal(b, p) for b, p in zip(before_params, model.parameters()))
                continue
            opt.step()
            if step == 2:
                unchanged_state = state() == before_state
                unchanged_params = all(torch.equal(b, p) for b, p in zip(before_params, model.parameters()))
    params = [p.detach().clone() for p in model.parameters()]
    finite = all(torch.isfinite(p).all() for p in params) and all(
        torch.isfinite(t).all() for t in _tensors(opt.communicator.state_dict()))
    return (opt.skipped_steps, unchanged_state and unchanged_params, finite, params,
            [str(w.message) for w in warned if issubclass(w.category, RuntimeWarning)], caught)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _recommended(name):
    compressor = mergecomp.compressors.create(name)
    memory = compressor.recommended_memory
    return name, memory, compressor.recommended_communicator


CONFIGURATIONS = [_recommended(name) for name in mergecomp.compressors.available()] + [
    ("topk", "residual", "ps"), ("fp16", "residual", "ps"), ("dgc", "dgc", "allgather")]


@pytest.mark.parametrize("compressor,memory,communicator", CONFIGURATIONS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nonfinite_gradient_on_one_rank_drops_the_step_everywhere(compressor, memory, communicator, bad):
    results = run_ranks(nonfinite_worker, 2, compressor, memory, communicator, bad, "skip")
    (skipped0, unchanged0, finite0, params0, warned0, _), (skipped1, unchanged1, finite1, params1, _, _) = results
    assert skipped0 == skipped1 == 1
    assert unchanged0 and unchanged1, "the dropped step changed compressor/memory state or parameters"
    assert finite0 and finite1
    for a, b in zip(params0, params1):
        assert torch.equal(a, b)
    assert any("rank(s) [1]" in w and "dropped" in w for w in warned0)


def test_nonfinite_raise_policy_raises_on_every_rank_and_training_can_go_on():
    results = run_ranks(nonfinite_worker, 2, "topk", "residual", "allgather", float("nan"), "raise")
    for skipped, unchanged, finite, params, warned, caught in results:
        assert len(caught) == 1 and "rank(s) [1]" in caught[0] and "call zero_grad()" in caught[0]
        assert skipped == 1 and unchanged and finite and not warned
    assert all(torch.equal(a, b) for a, b in zip(results[0][3], results[1][3]))


def overflow_worker(rank, world_size):
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False)
    opt = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-9), model=model,
                                         compressor="fp16", schedule=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        x = torch.full((1, 4), 4e4)  # a finite fp16 gradient on each rank; their sum overflows
        (model(x).sum()).backward()
        opt.step()
    return opt.skipped_steps, opt.reducer.last_outcome.averaged_nonfinite


def test_an_overflow_of_the_averaged_gradient_drops_the_step():
    for skipped, averaged in run_ranks(overflow_worker, 2):
        assert skipped == 1 and averaged


def sparse_overflow_worker(rank, world_size, compressor):
    torch.manual_seed(0)
    model = nn.Linear(64, 1, bias=False)
    opt = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-9), model=model,
                                         compressor=compressor, memory="residual",
                                         communicator="allgather", schedule=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        x = torch.zeros(1, 64)
        x[0, 5] = 3e38  # finite on each rank and sent by both; the received sum overflows there
        model(x).sum().backward()
        opt.step()
    return opt.skipped_steps, opt.reducer.last_outcome.averaged_nonfinite, model.weight.isfinite().all().item()


@pytest.mark.parametrize("compressor", ["topk", "dgc"])
def test_a_sparse_allgather_checks_the_received_coordinates_and_drops_an_overflow(compressor):
    for skipped, averaged, finite in run_ranks(sparse_overflow_worker, 2, compressor):
        assert skipped == 1 and averaged and finite


def test_the_received_coordinates_give_the_same_verdict_as_the_whole_average():
    # 16-bit values, which can hold the Inf poisoned in below (fp8 e4m3 has none)
    compressor = mergecomp.compressors.create("topk", compress_ratio=0.1, wire_format="compact")
    from mergecomp.communicators.allgather import AllgatherCommunicator
    from mergecomp.communicators.base import Handle
    from mergecomp.kernels.finite import nonfinite_flag
    g = torch.randn(1000)
    payloads = [compressor.compress(g * (r + 1), "g")[0] for r in range(3)]
    ctx = compressor.compress(g, "g")[1]
    holder = AllgatherCommunicator.__new__(AllgatherCommunicator)  # _combine needs no backend
    holder.compressor = compressor
    for poison in (None, float("nan"), float("inf")):
        if poison is not None:
            payloads[1][0][3] = poison
        handle = Handle("g", g.shape, None, ctx=ctx)
        average = holder._combine(payloads, handle)
        assert "received_indices" in handle.extra
        assert holder.nonfinite_flag(handle, average).item() == nonfinite_flag(average).item() == (poison is not None)


def epoch_mismatch_worker(rank, world_size):
    model = make_model()
    opt = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                         compressor=mergecomp.compressors.create("dgc", warmup=3),
                                         memory="residual")
    x, y = batch(0, rank)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.set_epoch(1 if rank == 0 else 2)
    opt.zero_grad()
    try:
        nn.functional.mse_loss(model(x), y).backward()
    except RanksDisagree as error:
        return str(error)
    return None


def test_ranks_with_different_epochs_fail_with_a_clear_error_on_every_rank():
    for message in run_ranks(epoch_mismatch_worker, 2):
        assert message and "epoch: rank 0: 1, rank 1: 2" in message and "set_epoch" in message


def seed_mismatch_worker(rank, world_size):
    model = make_model()
    try:
        mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                       compressor=mergecomp.compressors.create("randk", seed=rank))
    except RanksDisagree as error:
        return str(error)
    return None


def test_a_shared_random_stream_seeded_differently_is_refused_at_construction():
    for message in run_ranks(seed_mismatch_worker, 2):
        assert message and "seed=0" in message and "seed=1" in message and "compressor" in message


def one_rank_loads_worker(rank, world_size):
    model = make_model()
    opt = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                         compressor="topk")
    for step in range(3):
        x, y = batch(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    saved = opt.state_dict()
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    if rank == 0:  # the checkpoint habit: only rank 0 restores
        opt.load_state_dict(saved)
    opt.zero_grad()
    try:
        nn.functional.mse_loss(model(x), y).backward()
    except RanksDisagree as error:
        return str(error)
    return None


def test_load_state_dict_on_one_rank_is_a_clear_error_not_a_hang():
    for message in run_ranks(one_rank_loads_worker, 2, timeout=60):
        assert message and "steps: rank 0: 3, rank 1: 4" in message and "load_state_dict on every rank" in message


def checkpoint_worker(rank, world_size):
    def build(compressor="topk"):
        model = make_model()
        return model, mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                     model=model, compressor=compressor)

    model, opt = build()
    for step in range(2):
        x, y = batch(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    mine = opt.state_dict()
    everyone = [None, None]
    torch.distributed.all_gather_object(everyone, mine)  # the test swaps files; the library never pickles
    errors = {}
    _, resumed = build()
    resumed.load_state_dict(mine)  # its own file: fine
    try:
        resumed.load_state_dict(everyone[1 - rank])
    except ValueError as error:
        errors["rank"] = str(error)
    _, other = build("dgc")
    try:
        other.load_state_dict(mine)
    except ValueError as error:
        errors["config"] = str(error)
    # A file of a 4-rank run (sealed as that run would have sealed it).
    grown = dict(mine, mergecomp=mergecomp.checkpoint.seal(dict(mine["mergecomp"], world_size=4)))
    try:
        resumed.load_state_dict(grown)
    except ValueError as error:
        errors["world"] = str(error)
    resumed.load_state_dict(grown, restore_compression=False)
    errors["steps_kept"] = resumed.steps
    return errors


def test_a_checkpoint_of_another_rank_configuration_or_world_size_is_refused():
    for rank, errors in enumerate(run_ranks(checkpoint_worker, 2)):
        assert f"saved by rank {1 - rank}" in errors["rank"]
        assert "another configuration" in errors["config"] and "restore_compression=False" in errors["config"]
        assert "run of 4 ranks, this run has 2" in errors["world"]
        assert errors["steps_kept"] == 2


def join_worker(rank, world_size):
    model = make_model()
    opt = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                         compressor="topk", memory="residual")
    batches = 3 if rank == 0 else 5  # uneven inputs
    with opt.join():
        for step in range(batches):
            x, y = batch(step, rank)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.steps


def test_join_lets_ranks_with_uneven_inputs_finish_with_the_same_model():
    (params0, steps0), (params1, steps1) = run_ranks(join_worker, 2, timeout=60)
    assert steps0 == steps1 == 5
    for a, b in zip(params0, params1):
        assert torch.equal(a, b)


def accumulate_without_step_worker(rank, world_size):
    model = make_model()
    mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    x, y = batch(0, rank)
    nn.functional.mse_loss(model(x), y).backward()
    try:
        nn.functional.mse_loss(model(x), y).backward()
    except RuntimeError as error:
        return str(error)
    return None


def test_a_second_backward_without_step_or_zero_grad_is_refused():
    for message in run_ranks(accumulate_without_step_worker, 2):
        assert message and "backward_passes_per_step" in message and "zero_grad" in message


def test_the_fact_hash_check_is_exact_for_the_world_size():
    for size in (2, 8, 64, 1024):
        bits = hash_bits(size)
        top = (1 << bits) - 1
        # N²·h² must be an exact float64 integer
        assert (size * top) ** 2 < 2 ** 53
    assert fact_hash({"a": 1}) == fact_hash({"a": 1}) != fact_hash({"a": 2})
    message = describe_disagreement([{"epoch": 1, "plan": "x"}, {"epoch": 2, "plan": "x"}], "at step 3")
    assert "epoch: rank 0: 1, rank 1: 2" in message and "plan" not in message.split("\n", 1)[1]
    assert StepOutcome([], False, 2).finite and not StepOutcome([1], False, 2).finite


def test_a_schedule_of_the_wrong_kind_is_refused():
    assert mergecomp.optimizer._check_schedule(None) == mergecomp.optimizer.DEFAULT_SCHEDULE
    assert mergecomp.optimizer._check_schedule(2) == 2
    with pytest.raises(TypeError, match="schedule must be"):
        mergecomp.optimizer._check_schedule(2.5)
    with pytest.raises(ValueError, match="fusion-num must be ≥ 0"):
        mergecomp.optimizer._check_schedule(-1)


def test_a_dtype_the_compressor_cannot_carry_is_refused_at_construction():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: complex modules are experimental
        model = nn.Linear(3, 2).to(torch.complex64)

    class OneRank(mergecomp.distributed.backends.Backend):
        rank, size = 0, 1

        def allgather_object(self, obj, expect=None):
            return [obj]

    with pytest.raises(ValueError, match="cannot carry complex64 gradients.*view_as_real"):
        mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                       compressor="fp16", backend=OneRank())


def broken_parameters_worker(rank, world_size, policy):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).half()  # fp16 parameters
    opt = mergecomp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), model=model,
                                         compressor="topk", schedule=2, nonfinite=policy)
    caught, steps = None, 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for step in range(3):
            opt.zero_grad()
            x = torch.randn(6, 8, generator=torch.Generator().manual_seed(10 * step + rank)).half()
            try:
                model(x).float().pow(2).mean().backward()
            except mergecomp.NonFiniteParameters as error:
                caught = str(error)
                break
            opt.step()  # AdamW's eps underflows in fp16: this step makes parameters NaN
            steps += 1
    return caught, steps


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_parameters_made_nonfinite_by_the_optimizer_stop_training_with_the_cause_on_every_rank(policy):
    """Dropping steps cannot mend parameters that hold NaN: whatever the policy, the next
    backward raises on every rank, naming the parameters and the likely cause."""
    for caught, steps in run_ranks(broken_parameters_worker, 2, policy):
        assert steps == 1, "the step after the one that broke the parameters must raise"
        assert caught is not None and "the parameters themselves hold NaN or Inf" in caught
        assert "'0.weight'" in caught and "eps" in caught and "Load a checkpoint" in caught
    assert not issubclass(mergecomp.NonFiniteParameters, mergecomp.NonFiniteGradient)
