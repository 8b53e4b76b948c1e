"""The dgc memory and the sparsifiers' residual memory take the optimizer's momentum over
instead of refusing it (momentum correction): SGD's heavy-ball momentum, Adam's first moment."""
import pytest
import torch

import mergecomp
from mergecomp import compressors, memories

from tests.distributed import run_ranks


def params(n=3):
    return [torch.nn.Parameter(torch.ones(n))]


def test_sgd_momentum_moves_into_the_memory_and_back_after_each_step():
    p = params()
    sgd = torch.optim.SGD(p, lr=0.1, momentum=0.8, nesterov=True, weight_decay=0.01)
    memory = memories.create("dgc")
    memory.check_optimizer(sgd)
    assert (memory.momentum, memory.nesterov) == (0.8, True)
    seen = []
    sgd.register_step_pre_hook(lambda opt, *_: seen.append(dict(opt.param_groups[0])))
    p[0].grad = torch.full((3,), 2.0)
    sgd.step()
    # SGD stepped without its momentum at lr / (1 − m) (the memory's momentum is in gradient
    # units), weight decay as given: p − lr/(1 − m)·(g + wd·p)
    assert memory.gradient_units
    assert seen[0]["momentum"] == 0 and seen[0]["lr"] == pytest.approx(0.5) and seen[0]["weight_decay"] == 0.01
    assert torch.allclose(p[0].detach(), torch.full((3,), 1 - 0.5 * (2 + 0.01)))
    assert "momentum_buffer" not in sgd.state[p[0]]
    group = sgd.param_groups[0]  # the user's values, for schedulers and checkpoints
    assert (group["momentum"], group["lr"], group["weight_decay"], group["nesterov"]) == (0.8, 0.1, 0.01, True)
    assert sgd.state_dict()["param_groups"][0]["momentum"] == 0.8


def test_a_step_that_raises_leaves_the_users_values():
    sgd = torch.optim.SGD(params(), lr=0.1, momentum=0.9)
    memories.create("dgc").check_optimizer(sgd)

    def closure():
        raise RuntimeError("loss failed")
    with pytest.raises(RuntimeError, match="loss failed"):
        sgd.step(closure)
    assert sgd.state_dict()["param_groups"][0]["momentum"] == 0.9
    assert sgd.param_groups[0]["momentum"] == 0.9


def test_a_momentum_schedule_is_followed():
    sgd = torch.optim.SGD(params(), lr=0.1, momentum=0.9)
    memory = memories.create("dgc")
    memory.check_optimizer(sgd)
    memory.check_optimizer(sgd)  # vetted twice (a framework's second fit): hooks installed once
    assert len(sgd._optimizer_step_pre_hooks) == 1
    sgd.param_groups[0]["momentum"] = 0.85  # e.g. OneCycleLR's cycle
    sgd.param_groups[0]["params"][0].grad = torch.ones(3)
    sgd.step()
    assert memory.momentum == 0.85 and sgd.param_groups[0]["momentum"] == 0.85


def test_adams_first_moment_moves_into_the_memory_and_back_after_each_step():
    p = params()
    adamw = torch.optim.AdamW(p, lr=0.1, betas=(0.8, 0.99), weight_decay=0.01)
    memory = memories.create("dgc")
    memory.check_optimizer(adamw)
    assert (memory.momentum, memory.nesterov) == (0.8, False) and memory.gradient_units
    seen = []
    adamw.register_step_pre_hook(lambda opt, *_: seen.append(dict(opt.param_groups[0])))
    p[0].grad = torch.full((3,), 2.0)
    adamw.step()
    # AdamW stepped at β1 = 0 and the user's lr: its first moment is the delivered gradient
    assert seen[0]["betas"] == (0.0, 0.99) and seen[0]["lr"] == 0.1 and seen[0]["weight_decay"] == 0.01
    assert torch.equal(adamw.state[p[0]]["exp_avg"], p[0].grad)
    group = adamw.param_groups[0]  # the user's values, for schedulers and checkpoints
    assert group["betas"] == (0.8, 0.99) and adamw.state_dict()["param_groups"][0]["betas"] == (0.8, 0.99)
    group["betas"] = (0.85, 0.99)  # a schedule moves β1: the memory follows at the next step
    adamw.step()
    assert memory.momentum == 0.85 and group["betas"] == (0.85, 0.99)


def test_what_cannot_be_taken_over_is_refused_with_what_to_do():
    dgc = memories.create("dgc")
    with pytest.raises(ValueError, match=r"group 0 of RMSprop has momentum=0.9.*only torch.optim.SGD's heavy-ball "
                                         r"momentum and torch.optim.Adam's or AdamW's first moment"):
        dgc.check_optimizer(torch.optim.RMSprop(params(), lr=0.1, momentum=0.9))
    with pytest.raises(ValueError, match=r"group 0 of NAdam has betas\[0\]=0.9"):
        dgc.check_optimizer(torch.optim.NAdam(params(), lr=0.1))
    two_betas = torch.optim.Adam([{"params": params()}, {"params": params(), "betas": (0.5, 0.999)}], lr=0.1)
    with pytest.raises(ValueError, match=r"group 0: betas\[0\]=0.9, group 1: betas\[0\]=0.5"):
        dgc.check_optimizer(two_betas)
    two = torch.optim.SGD([{"params": params()}, {"params": params(), "momentum": 0.5}], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"group 0: momentum=0.9.*group 1: momentum=0.5"):
        dgc.check_optimizer(two)
    with pytest.raises(ValueError, match=r"dampening=0.1.*Use dampening=0"):
        dgc.check_optimizer(torch.optim.SGD(params(), lr=0.1, momentum=0.9, dampening=0.1))
    with pytest.raises(ValueError, match=r"given momentum=0.5.*has momentum=0.9"):
        memories.create("dgc", momentum=0.5).check_optimizer(torch.optim.SGD(params(), lr=0.1, momentum=0.9))
    memories.create("dgc", momentum=0.9).check_optimizer(torch.optim.SGD(params(), lr=0.1, momentum=0.9))
    plain = memories.create("dgc", momentum=0.7)  # an optimizer without momentum: the memory's own
    plain.check_optimizer(torch.optim.SGD(params(), lr=0.1, weight_decay=1e-4))
    assert plain.momentum == 0.7 and memories.create("dgc").momentum == 0.9


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _inner(model, name):
    """The user's optimizer: SGD with momentum ("momentum"), without ("plain"; "plain, folded":
    at lr / (1 − 0.9)), Adam, or Adam without its first moment ("adam, β1 0")."""
    if name.startswith("adam"):
        return torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.0 if "β1 0" in name else 0.9, 0.999))
    return torch.optim.SGD(model.parameters(), lr=0.1 / (1 - 0.9) if name == "plain, folded" else 0.1,
                           momentum=0.9 if name == "momentum" else 0.0)


#: Memories built in the rank (instances do not travel to it): the rest go by name.
_MEMORIES = {"dgc, momentum 0.9": lambda: memories.create("dgc", momentum=0.9),
             # what a dgc memory that takes SGD's momentum over does under a loop that never
             # clips: it masks where the loop's clip binds (mergecomp.memories.loopclip), never here
             "dgc, momentum 0.9, no masking": lambda: memories.create("dgc", momentum=0.9, masking=False),
             "dgc without masking": lambda: memories.create("dgc", masking=False),
             "dgc, momentum 0.9 in gradient units": lambda: _in_gradient_units(
                 memories.create("dgc", momentum=0.9))}


def _in_gradient_units(memory):
    memory.gradient_units = True
    return memory


def _six_steps(rank, forward, optimizer, first_scale=1.0):
    """Six steps; the first one's loss multiplied by ``first_scale``."""
    generator = torch.Generator().manual_seed(rank)
    for step in range(6):
        x, y = torch.randn(4, 6, generator=generator), torch.randn(4, 2, generator=generator)
        optimizer.zero_grad()
        (torch.nn.functional.mse_loss(forward(x), y) * (first_scale if step == 0 else 1.0)).backward()
        optimizer.step()


def _exact_topk():
    """Top-k on its indexed wire: exact values, so two ways of writing one momentum, which
    scale what is sent differently, round nothing differently."""
    return compressors.create("topk", compress_ratio=0.01, wire_format="indexed")


def _train(rank, world_size, optimizer_name, memory, compressor=None, inner_name=None, first_scale=1.0):
    """A sparsifier (:func:`_exact_topk` unless told) through the wrapper: (parameters, the
    user's SGD momentum afterwards, the momentum the residual memory applies, if it is one).
    ``inner_name``: the optimizer that steps, when it is not ``optimizer_name``'s."""
    compressor = compressor or _exact_topk()
    model = _model()
    inner = _inner(model, inner_name or optimizer_name)
    memory = _MEMORIES[memory]() if memory in _MEMORIES else memory
    optimizer = mergecomp.DistributedOptimizer(inner, model=model, compressor=compressor, memory=memory, schedule=2)
    _six_steps(rank, model, optimizer, first_scale)
    optimizer.remove_hooks()
    return ([p.detach().clone() for p in model.parameters()], inner.param_groups[0].get("momentum"),
            getattr(optimizer.memory, "sgd_momentum", None))


def test_the_wrapper_trains_sgd_with_momentum_as_momentum_correction():
    # the user's script (SGD with momentum, memory="dgc") against what it used to need
    # (plain SGD, the momentum given to the memory)
    taken, given = run_ranks(_train, 2, "momentum", "dgc"), run_ranks(_train, 2, "plain", "dgc, momentum 0.9, no masking")
    for (mine, momentum, _), (theirs, _, _) in zip(taken, given):
        assert momentum == 0.9
        for a, b in zip(mine, theirs):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)  # the same steps, in gradient units


def test_the_wrapper_trains_adam_with_its_first_moment_in_the_dgc_memory():
    # the user's Adam (β1 0.9) with DGC: the memory runs β1, Adam steps at β1 = 0; the same
    # as an Adam at β1 = 0 with the momentum given to the memory (in gradient units)
    taken = run_ranks(_train, 2, "adam", "dgc", "dgc")
    by_hand = run_ranks(_train, 2, "adam", "dgc, momentum 0.9 in gradient units", "dgc", "adam, β1 0")
    for (mine, _, _), (theirs, _, _) in zip(taken, by_hand):
        for a, b in zip(mine, theirs):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def _train_ddp(rank, world_size, taken_over):
    import mergecomp.ddp
    from torch.nn.parallel import DistributedDataParallel
    model = _model()
    ddp = DistributedDataParallel(model)
    sgd = _inner(model, "momentum" if taken_over else "plain")
    memory = "dgc" if taken_over else _MEMORIES["dgc, momentum 0.9, no masking"]()
    mergecomp.ddp.register(ddp, compressor=_exact_topk(), memory=memory, optimizer=sgd)
    _six_steps(rank, ddp, sgd)
    return [p.detach().clone() for p in model.parameters()]


def test_the_ddp_hook_takes_the_momentum_of_the_optimizer_it_is_given():
    for mine, theirs in zip(run_ranks(_train_ddp, 2, True), run_ranks(_train_ddp, 2, False)):
        for a, b in zip(mine, theirs):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)  # the same steps, in gradient units


@pytest.mark.parametrize("compressor,optimizer_name,same_as,stepping,momentum", [
    (c, "momentum", "dgc without masking", "momentum", 0.9) for c in ("topk", "graddrop")  # SGD's, before
] + [(c, "plain", "residual", "plain", 0.0) for c in ("topk", "graddrop")] + [  # nothing to take over
    (c, "adam", "dgc", "adam", 0.9) for c in ("topk", "graddrop")])  # Adam's first moment before, masked
def test_sparsifiers_default_memory_takes_the_momentum_before_the_exchange(compressor, optimizer_name, same_as,
                                                                            stepping, momentum):
    auto = run_ranks(_train, 2, optimizer_name, "auto", compressor)
    explicit = run_ranks(_train, 2, optimizer_name, same_as, compressor, stepping)
    for (mine, _, adopted), (theirs, _, _) in zip(auto, explicit):
        assert adopted == momentum
        for a, b in zip(mine, theirs):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)  # the same steps, in gradient units


def test_residual_memory_momentum_is_staged_saved_and_checked():
    memory = memories.create("residual", momentum=0.5, nesterov=True)
    topk = mergecomp.compressors.create("topk", compress_ratio=0.25)
    g = torch.tensor([1.0, -2.0, 0.5, 0.25])
    for step in range(2):
        v = memory.compensate(g, "g")
        payload, ctx = topk.compress(v, "g")
        memory.update(v, "g", topk, payload, ctx)
        memory.commit() if step == 0 else memory.rollback()
    assert torch.equal(memory.momenta["g"], g)  # the rolled-back step left the first one's u
    state = memory.state_dict()
    assert set(state) == {"residuals", "momenta", "units"} and state["units"] == "heavy-ball"  # its own momentum
    again = memories.create("residual", momentum=0.5, nesterov=True)
    again.load_state_dict(state)
    assert torch.equal(again.compensate(g, "g"), memory.compensate(g, "g"))
    with pytest.raises(ValueError, match="unknown keys"):
        again.check_state({"velocities": {}}, {"g": (4, torch.float32)})
    assert memories.create("residual").state_dict() == {"residuals": {}}  # no momentum, no momenta
    with pytest.raises(ValueError, match=r"given momentum=0.5.*has momentum=0.9"):
        memories.create("residual", momentum=0.5).check_optimizer(torch.optim.SGD(params(), lr=0.1, momentum=0.9))
    # following the optimizer, it refuses nothing: an optimizer whose momentum it cannot take
    # over keeps it (plain error feedback)
    follows = memories.create("residual", momentum="optimizer")
    for optimizer in (torch.optim.RMSprop(params(), lr=0.1, momentum=0.9), torch.optim.AdamW(params(), lr=0.1)):
        follows.check_optimizer(optimizer)
        assert follows.sgd_momentum == 0.0 and not optimizer._optimizer_step_pre_hooks
    with pytest.raises(ValueError, match=r"group 0 of AdamW has betas\[0\]=0.9.*only torch.optim.SGD's heavy-ball "
                                         r"momentum\. "):
        memories.create("residual", momentum=0.9).check_optimizer(torch.optim.AdamW(params(), lr=0.1))


# -- through a framework's optimizer wrapper -----------------------------------------------------------

def _train_accelerate(rank, world_size):
    """The DDP hook under Accelerate: prepare() wraps the SGD in an AcceleratedOptimizer,
    whose momentum the dgc memory takes over on the SGD inside."""
    import mergecomp.ddp
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    model = _model()
    sgd = _inner(model, "momentum")
    prepared, optimizer = accelerator.prepare(model, sgd)
    assert type(optimizer).__name__ == "AcceleratedOptimizer"
    state = mergecomp.ddp.register(prepared, compressor=_exact_topk(), memory="dgc", optimizer=optimizer)
    _six_steps(rank, prepared, optimizer)
    return ([p.detach().clone() for p in model.parameters()], state.memory.momentum,
            sgd.param_groups[0]["momentum"], any("momentum_buffer" in s for s in sgd.state.values()))


def test_an_accelerate_optimizer_has_its_sgd_momentum_taken_over():
    pytest.importorskip("accelerate", reason="pip install -e .[test] installs Accelerate")
    for (mine, memory_momentum, users, buffers), theirs in zip(run_ranks(_train_accelerate, 2),
                                                                run_ranks(_train_ddp, 2, False)):
        assert memory_momentum == 0.9 and users == 0.9  # in the memory; the user's value kept
        assert not buffers  # the SGD inside stepped without a momentum of its own
        for a, b in zip(mine, theirs):  # as plain SGD with the momentum given to the memory
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)  # the same steps, in gradient units


def test_a_lightning_optimizer_has_its_sgd_momentum_taken_over():
    pytest.importorskip("lightning", reason="pip install -e .[test] installs Lightning")
    from lightning.pytorch.core.optimizer import LightningOptimizer
    p = params()
    sgd = torch.optim.SGD(p, lr=0.1, momentum=0.8)
    wrapped = LightningOptimizer(sgd)
    memory = memories.create("dgc")
    memory.check_optimizer(wrapped)
    assert memory.momentum == 0.8 and len(sgd._optimizer_step_pre_hooks) == 1
    p[0].grad = torch.full((3,), 2.0)
    sgd.step()  # what LightningOptimizer.step calls, through its strategy
    assert torch.allclose(p[0].detach(), torch.full((3,), 1 - 0.1 / (1 - 0.8) * 2))  # at lr / (1 − m)
    assert "momentum_buffer" not in sgd.state[p[0]] and sgd.param_groups[0]["momentum"] == 0.8


def test_a_wrapped_optimizer_that_is_not_sgd_is_named_with_its_wrapper():
    from mergecomp.momentum import innermost

    class Wrapper(torch.optim.Optimizer):  # as Accelerate's: shares the inner's param_groups
        def __init__(self, optimizer):
            self.optimizer = optimizer

        @property
        def param_groups(self):
            return self.optimizer.param_groups
    rmsprop = torch.optim.RMSprop(params(), lr=0.1, momentum=0.9)
    assert innermost(Wrapper(Wrapper(rmsprop))) is rmsprop
    with pytest.raises(ValueError, match=r"group 0 of RMSprop \(inside Wrapper\) has momentum=0.9"):
        memories.create("dgc").check_optimizer(Wrapper(rmsprop))


# -- gradient units ----------------------------------------------------------------------------

def _delivered(rank, world_size):
    """A constant gradient (lr 0) through FP16 with error feedback and the momentum taken over:
    what the exchange writes into p.grad, against the gradient dense DDP would write."""
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
    optimizer = mergecomp.DistributedOptimizer(
        inner, model=model, compressor="fp16", memory=memories.create("residual", momentum="optimizer"), schedule=1)
    x, y = torch.ones(4, 6), torch.zeros(4, 2)
    delivered = []
    for _ in range(30):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.synchronize()
        delivered.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        optimizer.step()
    optimizer.remove_hooks()  # the gradient as dense DDP would average it (the ranks' are the same)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    gradient = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return delivered, gradient


def test_the_exchange_delivers_a_gradients_scale_so_clipping_after_it_clips_as_dense_does():
    for delivered, gradient in run_ranks(_delivered, 2):
        # u ← 0.9·u + 0.1·g: after t steps of the same g, (1 − 0.9ᵗ)·g, handed to the loop
        # divided by 1 − 0.9ᵗ: g from the first step, not the 10·g a heavy-ball velocity
        # reaches, which a loop's clip_grad_norm_ would cut tenfold, nor the 0.1·g of a
        # momentum starting from zero, which it would not clip where dense training does
        for step in (0, 1, 29):
            assert torch.allclose(delivered[step], gradient, rtol=1e-3, atol=1e-6), step


def test_a_state_saved_in_heavy_ball_units_is_converted_on_load():
    g = torch.tensor([1.0, -2.0, 0.5, 0.25])
    topk = mergecomp.compressors.create("topk", compress_ratio=0.25)
    before = memories.create("dgc", momentum=0.9)  # its own momentum: heavy-ball units
    for _ in range(3):
        v = before.compensate(g, "g")
        payload, ctx = topk.compress(v, "g")
        before.update(v, "g", topk, payload, ctx)
        before.commit()
    state = before.state_dict()
    assert state["units"] == "heavy-ball"
    taken = memories.create("dgc")
    taken.check_optimizer(torch.optim.SGD(params(), lr=0.1, momentum=0.9))
    assert taken.gradient_units
    taken.load_state_dict(state)
    assert torch.allclose(taken.velocities["g"], 0.1 * before.velocities["g"])
    assert torch.allclose(taken.momenta["g"], 0.1 * before.momenta["g"])
    assert taken.state_dict()["units"] == "gradient"
    with pytest.raises(ValueError, match="units 'furlongs'"):
        taken.check_state({**state, "units": "furlongs"}, {"g": (4, torch.float32)})


def test_a_folding_memory_takes_the_momentum_off_and_applies_none():
    for make, folded in ((lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), {"momentum": 0.0, "lr": 0.1 / (1 - 0.9)}),
                         (lambda p: torch.optim.AdamW(p, lr=0.1, betas=(0.8, 0.99)), {"betas": (0.0, 0.99)})):
        p = params()
        optimizer = make(p)
        memory = memories.create("residual", momentum="fold")
        memory.check_optimizer(optimizer)
        assert memory.folded in (0.9, 0.8) and memory.sgd_momentum == 0.0 and not memory.masking
        assert "momentum='fold'" in repr(memory)
        seen = []
        optimizer.register_step_pre_hook(lambda opt, *_: seen.append(dict(opt.param_groups[0])))
        p[0].grad = torch.ones(3)
        optimizer.step()
        assert {key: seen[0][key] for key in folded} == pytest.approx(folded)  # stepped without it
        g = torch.tensor([1.0, -2.0, 3.0])
        if isinstance(optimizer, torch.optim.SGD):  # its first step is heavy-ball's: (1 − m)·g
            assert torch.allclose(memory.compensate(g, "g"), (1 - 0.9) * g)
            memory.commit()  # then, the loop not seen clipping, plain error feedback
        assert torch.equal(memory.compensate(g, "g"), g)  # plain error feedback: no momentum here
    rmsprop = torch.optim.RMSprop(params(), lr=0.1, momentum=0.9)  # a momentum it cannot take: kept
    kept = memories.create("residual", momentum="fold")
    kept.check_optimizer(rmsprop)
    assert kept.folded == 0.0 and rmsprop.param_groups[0]["momentum"] == 0.9
    from mergecomp.compressors import recipes  # so the recipe's advice still says what to do
    assert "fold it into the learning rate" in recipes.advice(compressors.create("efsignsgd"), rmsprop, kept)


def test_the_bursting_residuals_take_the_momentum_off_by_default_without_advice():
    from mergecomp.compressors import recipes
    for name in ("efsignsgd", "onebit", "tbq", "randk"):
        compressor = compressors.create(name)
        memory = memories.recommended(compressor)
        sgd = torch.optim.SGD(params(), lr=0.1, momentum=0.9)
        memory.check_optimizer(sgd)
        assert memory.folds and recipes.advice(compressor, sgd, memory) is None  # the memory folds it
        assert "fold it into the learning rate" in recipes.advice(compressor, sgd, memories.create("residual"))
    unbiased = compressors.create("randk", unbiased=True)  # no residual, nothing to fold
    assert unbiased.recommended_memory == "none" and not unbiased.recommended_memory_options


@pytest.mark.parametrize("optimizer_name, by_hand", [("momentum", "plain, folded"), ("adam", "adam, β1 0")])
def test_the_wrapper_trains_ef_signsgd_with_the_momentum_folded(optimizer_name, by_hand):
    # the user's SGD(momentum=0.9) or Adam with EF-SignSGD's defaults: the same steps as the
    # recipe by hand (SGD without momentum at lr / (1 − m); Adam at β1 = 0), plain error
    # feedback; under SGD the first step is heavy-ball's, (1 − m) of a gradient (by hand: the
    # first loss scaled so), and this loop never clips, so the fold lasts
    folded = run_ranks(_train, 2, optimizer_name, "auto", "efsignsgd")
    first = 1 - 0.9 if optimizer_name == "momentum" else 1.0
    manual = run_ranks(_train, 2, by_hand, "residual", "efsignsgd", None, first)
    for (mine, _, _), (theirs, _, _) in zip(folded, manual):
        for a, b in zip(mine, theirs):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("compressor", ["tbq", "randk", "powersgd"])
def test_the_wrapper_takes_adams_first_moment_off_for_error_feedback_by_default(compressor):
    # TBQ's and rand-k's memory folds it; PowerSGD's own error feedback does: the user's Adam
    # steps as the same Adam at β1 = 0 by hand, with the same memory.
    folded = run_ranks(_train, 2, "adam", "auto", compressor)
    manual = run_ranks(_train, 2, "adam, β1 0", "auto", compressor)
    for (mine, _, _), (theirs, _, _) in zip(folded, manual):
        for a, b in zip(mine, theirs):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_powersgd_keeps_sgds_momentum_after_the_exchange():
    compressor, optimizer = compressors.create("powersgd"), torch.optim.SGD(params(), lr=0.1, momentum=0.9)
    compressor.check_optimizer(optimizer)
    assert optimizer.param_groups[0]["momentum"] == 0.9 and not optimizer._optimizer_step_pre_hooks
    plain, adam = compressors.create("powersgd", use_error_feedback=False), torch.optim.Adam(params())
    plain.check_optimizer(adam)
    assert not adam._optimizer_step_pre_hooks  # no error feedback, nothing to multiply


def _named_optimizer(name):
    """AdamW, SGD, or an Adam whose β1 is 0 (the warm-ups run under any Adam)."""
    if name == "adamw":
        return torch.optim.AdamW(params())
    if name == "adam, β1 0":
        return torch.optim.Adam(params(), betas=(0.0, 0.999))
    return torch.optim.SGD(params(), lr=0.1)


@pytest.mark.parametrize("optimizer_name, warmup_steps, at_rank_64",
                         [("adamw", 10, 10), ("adamw", 0, 0), ("sgd", 10, 0), ("adam, β1 0", 10, 10)])
def test_powersgd_under_adam_sends_its_first_exchanges_at_a_higher_rank(optimizer_name, warmup_steps, at_rank_64):
    """Under an Adam the first approximations, from a random query, move every coordinate by
    about the learning rate: the first ``warmup_steps`` exchanges go at 16 times the rank."""
    from mergecomp.compressors.single_process import run_locally
    compressor = compressors.create("powersgd", rank=4, factor_dtype="fp32", warmup_steps=warmup_steps)
    inner = _named_optimizer(optimizer_name)
    compressor.check_optimizer(inner)
    generator = torch.Generator().manual_seed(0)
    sent = []
    for _ in range(12):
        decoded, nbytes = run_locally(compressor, torch.randn(128, 96, generator=generator), "g")
        compressor.commit()
        sent.append(nbytes)
    assert sent == [4 * 64 * (128 + 96)] * at_rank_64 + [4 * 4 * (128 + 96)] * (12 - at_rank_64)
    with pytest.raises(ValueError, match="warmup_steps must be a whole number"):
        compressors.create("powersgd", warmup_steps=-1)


@pytest.mark.parametrize("optimizer_name, warmup_steps, at_density",
                         [("adamw", 10, 10), ("adamw", 0, 0), ("sgd", 10, 0), ("adam, β1 0", 10, 10)])
def test_randk_under_adam_sends_its_first_exchanges_at_a_higher_density(optimizer_name, warmup_steps, at_density):
    """Under an Adam rand-k trailed dense from its first steps: the first ``warmup_steps``
    exchanges go at 16 times the density (at most every element); a dropped step does not
    count, and a resumed compressor goes on where the warm-up was."""
    compressor = compressors.create("randk", compress_ratio=0.01, warmup_steps=warmup_steps)
    inner = _named_optimizer(optimizer_name)
    compressor.check_optimizer(inner)
    compressor.compress(torch.randn(10_000), "g")
    compressor.rollback()  # a dropped step: not one of the warm-up's
    sent = []
    for step in range(12):
        if step == 4:  # resumed from a checkpoint mid-way
            resumed = compressors.create("randk", compress_ratio=0.01, warmup_steps=warmup_steps)
            resumed.load_state_dict(compressor.state_dict())
            resumed.check_optimizer(inner)
            compressor = resumed
        payload, ctx = compressor.compress(torch.randn(10_000), "g")
        compressor.commit()
        sent.append(payload[0].numel())
    assert sent == [1_600] * at_density + [100] * (12 - at_density)
    capped = compressors.create("randk", compress_ratio=0.1)
    capped.check_optimizer(inner)
    assert capped.compress(torch.randn(10_000), "g")[0][0].numel() == (1_000 if optimizer_name == "sgd" else 10_000)
    for told, sent_at_first in ((None, 2_500), (10, 10_000)):  # unbiased: no warm-up unless told
        unbiased = compressors.create("randk", unbiased=True, warmup_steps=told)
        unbiased.check_optimizer(inner)
        expected = 2_500 if optimizer_name == "sgd" else sent_at_first
        assert unbiased.compress(torch.randn(10_000), "g")[0][0].numel() == expected
    with pytest.raises(ValueError, match="randk warmup_steps must be a whole number"):
        compressors.create("randk", warmup_steps=-1)


def _randk_held_back(rank, world_size, optimizer_name):
    """rand-k at its defaults through the wrapper: what its memory holds back after each of
    two steps."""
    model = _model()
    optimizer = mergecomp.DistributedOptimizer(_inner(model, optimizer_name), model=model, compressor="randk")
    held = []
    for step in range(2):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank + 10 * step))
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        held.append(sum(float(r.norm()) for r in optimizer.memory.residuals.committed().values()))
    optimizer.remove_hooks()
    return held


def test_the_wrapper_warms_randk_up_under_adam_only():
    for held in run_ranks(_randk_held_back, 2, "adam"):
        assert held == [0.0, 0.0]  # every coordinate went out: nothing held back
    for held in run_ranks(_randk_held_back, 2, "momentum"):
        assert all(h > 0.0 for h in held)
