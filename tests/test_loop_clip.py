"""A memory that runs SGD's momentum before the exchange clips each group of each rank's
gradient at the threshold the wrapper hands it once the loop was seen clipping, and
catches up what it took in before (mergecomp.memories.loopclip)."""
import math

import pytest
import torch

from mergecomp import memories
from mergecomp.memories.loopclip import LoopClip

from .distributed import run_ranks


def test_no_threshold_no_clipping_and_the_norms_are_recorded():
    clip = LoopClip()
    assert clip.scale(torch.full((4,), 100.0), "g0") is None
    assert clip.state_dict() == {}  # nothing committed yet
    clip.commit()
    assert clip.state_dict() == {"norms": {"g0": [pytest.approx(200.0)]}}


def test_each_group_is_clipped_on_its_own_at_the_threshold():
    clip = LoopClip()
    clip.follow(1.0)
    assert clip.scale(torch.tensor([2.0, 0.0]), "g0") == pytest.approx(0.5)
    assert clip.scale(torch.tensor([0.0, 0.5]), "g1") is None  # short enough
    clip.commit()
    assert clip.state_dict() == {"threshold": 1.0}


def test_what_was_taken_in_before_the_threshold_is_caught_up_once():
    clip = LoopClip()
    for g0, g1, g2 in [(2.0, 0.5, 3.0), (None, None, 1.0)]:
        for name, norm in (("g0", g0), ("g1", g1), ("g2", g2)):
            if norm is not None:
                clip.scale(torch.tensor([norm]), name)
        clip.commit()
    clip.follow(1.0)
    assert clip.state_dict()["catch_up"] == {"g0": pytest.approx(0.5), "g2": pytest.approx(0.5)}  # (1 + 1) / 4
    assert clip.catch_up("g1") is None  # never above the threshold
    assert clip.catch_up("g0") == pytest.approx(0.5)
    clip.rollback()  # a dropped step: the catch-up is still owed
    assert clip.catch_up("g0") == pytest.approx(0.5)
    clip.commit()
    assert clip.catch_up("g0") is None  # once


def test_recording_stops_after_the_first_steps():
    clip = LoopClip()
    for _ in range(LoopClip.recorded_steps + 1):
        clip.scale(torch.tensor([2.0]), "g0")
        clip.commit()
    assert clip.state_dict() == {"recording": False}
    fresh = LoopClip()
    fresh.load_state_dict(clip.state_dict())
    assert not fresh.recording
    clip.follow(1.0)  # seen late: clipped from now on, nothing caught up
    assert clip.catch_up("g0") is None and clip.scale(torch.tensor([2.0]), "g0") == pytest.approx(0.5)


def test_a_first_clip_after_the_first_steps_is_remembered_as_late():
    early, late = LoopClip(), LoopClip()
    for _ in range(LoopClip.recorded_steps + 1):
        late.scale(torch.tensor([2.0]), "g0")
        late.commit()
    early.scale(torch.tensor([2.0]), "g0")
    early.commit()
    early.follow(1.0)
    late.follow(1.0)
    assert not early.clipped_late and "clipped_late" not in early.state_dict()
    assert late.clipped_late and late.state_dict() == {"threshold": 1.0, "clipped_late": True}
    late.follow(0.5)  # a later threshold does not make the first clip early again
    assert late.clipped_late
    for clip in (early, late):
        fresh = LoopClip()
        fresh.load_state_dict(clip.state_dict())
        assert fresh.clipped_late == clip.clipped_late


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), 1])
def test_a_bad_threshold_is_refused(bad):
    with pytest.raises(ValueError, match="positive finite float"):
        LoopClip().follow(bad)


@pytest.mark.parametrize("state, match", [
    ({"threshold": -2.0}, "positive finite float"),
    ({"norms": {"g0": [float("nan")]}}, "finite norms"),
    ({"catch_up": {"g0": 1.5}}, r"in \[0, 1\]"),
    ({"recording": "no"}, "True or False"),
    ({"threshold": 1.0, "clipped_late": 1}, "True or False"),
    ({"threshold": 1.0, "extra": 1}, "keys among"),
])
def test_a_corrupted_state_is_named(state, match):
    with pytest.raises(ValueError, match=match):
        LoopClip.check_state(state, "residual memory")


def _memory(name, optimizer):
    memory = memories.create(name, **({"momentum": "optimizer"} if name == "residual" else {}))
    memory.check_optimizer(optimizer)
    return memory


@pytest.mark.parametrize("name", ["residual", "dgc"])
def test_sgds_momentum_taken_over_follows_the_loop_and_resumes(name):
    p = torch.nn.Parameter(torch.zeros(4))
    memory = _memory(name, torch.optim.SGD([p], lr=0.1, momentum=0.9))
    assert memory.follows_loop_clip and memory.momentum_source == "sgd"
    memory.follow_loop_clip(1.0)
    gradient = torch.tensor([3.0, 4.0, 0.0, 0.0])  # norm 5: clipped to 1 before the momentum
    memory.compensate(gradient, "g0")
    momentum = memory.momenta["g0"]
    assert torch.allclose(momentum, (1 - 0.9) * gradient / 5)  # gradient units, clipped
    memory.commit()
    state = memory.state_dict()
    assert state["loop_clip"] == {"threshold": 1.0}
    fresh = _memory(name, torch.optim.SGD([torch.nn.Parameter(torch.zeros(4))], lr=0.1, momentum=0.9))
    fresh.check_state(state, {"g0": _spec(4)})
    fresh.load_state_dict(state)
    assert fresh.loop_clip.state_dict() == state["loop_clip"]
    bad = dict(state, loop_clip={"threshold": float("inf")})
    with pytest.raises(ValueError, match="loop_clip threshold"):
        fresh.check_state(bad, {"g0": _spec(4)})


def _spec(numel):
    from mergecomp.checkpoint import GroupSpec
    return GroupSpec(numel=numel, dtype=torch.float32, layout=None)


@pytest.mark.parametrize("name, optimizer, memory_options", [
    ("residual", lambda ps: torch.optim.AdamW(ps, lr=0.01), {"momentum": "optimizer", "adam": True}),
    ("dgc", lambda ps: torch.optim.AdamW(ps, lr=0.01), {}),
    ("residual", lambda ps: torch.optim.AdamW(ps, lr=0.01), {"momentum": "fold"}),
    ("residual", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), {"momentum": "optimizer", "clip_norm": 0.5}),
    ("residual", lambda ps: torch.optim.SGD(ps, lr=0.1), {"momentum": "optimizer"}),
])
def test_what_does_not_follow_the_loop(name, optimizer, memory_options):
    # an Adam's first moment taken over or folded away, a clip_norm of its own, no momentum
    memory = memories.create(name, **memory_options)
    memory.check_optimizer(optimizer([torch.nn.Parameter(torch.zeros(2))]))
    assert not memory.follows_loop_clip


def _sgd_fold():
    memory = memories.create("residual", momentum="fold")
    memory.check_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(4))], lr=0.1, momentum=0.9))
    return memory


def _exchange(memory, gradient):
    from mergecomp import compressors
    lossless = compressors.create("none")
    compensated = memory.compensate(gradient, "g0")
    payload, ctx = lossless.compress(compensated, "g0")
    memory.update(compensated, "g0", lossless, payload, ctx)
    memory.commit()
    return compensated


def test_a_folded_momentum_is_taken_over_once_the_loop_clips():
    # under SGD a memory that folds the momentum (EF-SignSGD's, TBQ's) takes its first step
    # as heavy-ball's first step (the momentum from zero, bias-corrected for the loop),
    # applies none while the loop has not clipped, and once it has runs SGD's momentum
    # before the exchange, again from zero; a resumed run does the same
    memory = _sgd_fold()
    assert memory.follows_loop_clip
    gradient = torch.tensor([3.0, 4.0, 0.0, 0.0])
    assert torch.allclose(_exchange(memory, gradient), 0.1 * gradient)  # the first step: (1 − m)·g
    assert memory.delivery_scale(0) == pytest.approx(10.0)
    memory.adopt_momentum(0.9, False, follow=True)  # the optimizer's step: the loop did not clip
    assert memory.sgd_momentum == 0.0 and memory.delivery_scale(1) == 1.0
    assert torch.equal(_exchange(memory, gradient), gradient)  # folded: no momentum
    assert "momenta" not in memory.state_dict()  # dropped while folding
    memory.follow_loop_clip(1.0)
    assert memory.sgd_momentum == 0.9
    assert torch.allclose(_exchange(memory, gradient), 0.1 * gradient / 5)  # clipped, the momentum from zero
    fresh = _sgd_fold()
    fresh.load_state_dict(memory.state_dict())
    assert fresh.sgd_momentum == 0.9
    for each in (memory, fresh):
        assert torch.allclose(_exchange(each, torch.zeros(4)), 0.9 * 0.1 * gradient / 5)
    assert "momentum='fold'" in repr(memory)
    nesterov = memories.create("residual", momentum="fold")  # its repr (the configuration digest) as before
    nesterov.check_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(4))], lr=0.1, momentum=0.9, nesterov=True))
    assert nesterov.nesterov and repr(nesterov) == "ResidualMemory(beta=1.0, gamma=1.0, momentum='fold')"


def test_a_fold_is_kept_when_the_loop_first_clips_after_its_first_steps():
    # a loop that did not clip in its first steps and clips later: the fold stays for the
    # run (the memory clips at the loop's share, with no momentum), and a resumed run too
    memory = _sgd_fold()
    gradient = torch.tensor([3.0, 4.0, 0.0, 0.0])
    _exchange(memory, gradient)
    memory.adopt_momentum(0.9, False, follow=True)
    for _ in range(LoopClip.recorded_steps + 1):
        _exchange(memory, 0.1 * gradient)
    memory.follow_loop_clip(1.0)
    assert memory.folding and memory.sgd_momentum == 0.0
    fresh = _sgd_fold()
    fresh.load_state_dict(memory.state_dict())
    assert fresh.folding and fresh.sgd_momentum == 0.0
    for each in (memory, fresh):
        assert torch.allclose(_exchange(each, gradient), gradient / 5)  # clipped, no momentum
        assert "momenta" not in each.state_dict()


def test_a_fold_that_does_not_follow_the_loop_folds_for_the_run():
    # follow_loop=False (rand-k's): SGD's momentum folded from the first step to the last,
    # whatever the loop does, and the loop's clip left after the exchange
    memory = memories.create("residual", momentum="fold", follow_loop=False)
    memory.check_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(4))], lr=0.1, momentum=0.9))
    assert not memory.follows_loop_clip and memory.folding and memory.folded == 0.9
    gradient = torch.tensor([3.0, 4.0, 0.0, 0.0])
    assert torch.equal(_exchange(memory, gradient), gradient)  # the first step folded too
    assert memory.delivery_scale(0) == 1.0 and memory.local_clip_factor(gradient, "g0") is None
    assert repr(memory) == "ResidualMemory(beta=1.0, gamma=1.0, momentum='fold', follow_loop=False)"
    with pytest.raises(ValueError, match="follow_loop"):
        memories.create("residual", momentum="fold", follow_loop="no")


def _randk_under_a_clipping_loop(rank, world_size):
    """Rand-k at its defaults under SGD with momentum, six steps of a loop clipping at 1e-3:
    its memory's momentum, whether it is folding, and the threshold it took from the loop."""
    import mergecomp
    _, optimizer = _six_clipped_steps(rank, None, lambda: _branches_and_optimizer(
        compressor=mergecomp.compressors.create("randk", compress_ratio=0.5)))
    memory = optimizer.communicator.memory
    return memory.sgd_momentum, memory.folding, memory.loop_clip.threshold


def test_randk_keeps_its_fold_under_a_loop_that_clips_from_the_first_step():
    for momentum, folding, threshold in run_ranks(_randk_under_a_clipping_loop, 2):
        assert (momentum, folding, threshold) == (0.0, True, None)


def _fold_resumed(rank, world_size, stop_at):
    """EF-SignSGD at its defaults under SGD with momentum and a loop that clips: the
    parameters after six steps (saved and resumed after ``stop_at``; None: never), and the
    momentum its memory applies at the end."""
    model, optimizer = _six_clipped_steps(rank, stop_at, lambda: _branches_and_optimizer(compressor="efsignsgd"))
    return [p.detach().clone() for p in model.parameters()], optimizer.communicator.memory.sgd_momentum


def test_a_fold_under_a_clipping_loop_takes_the_momentum_over_and_resumes_bit_for_bit():
    straight = run_ranks(_fold_resumed, 2, None)
    for (params, momentum), (resumed, _) in zip(straight, run_ranks(_fold_resumed, 2, 3)):
        assert momentum == 0.9
        assert all(torch.equal(a, b) for a, b in zip(params, resumed))


@pytest.mark.parametrize("name", ["residual", "dgc"])
def test_the_state_taken_in_before_the_threshold_is_scaled_once(name):
    memory = _memory(name, torch.optim.SGD([torch.nn.Parameter(torch.zeros(4))], lr=0.1, momentum=0.9))
    gradient = torch.tensor([3.0, 4.0, 0.0, 0.0])  # norm 5, before any threshold: taken in whole
    memory.compensate(gradient, "g0")
    memory.commit()
    assert torch.allclose(memory.momenta["g0"], 0.1 * gradient)
    memory.follow_loop_clip(1.0)  # as if clipped at 1: the momentum is a fifth of it
    memory.compensate(torch.zeros(4), "g0")
    assert torch.allclose(memory.momenta["g0"], 0.9 * 0.1 * gradient / 5)
    memory.commit()
    memory.compensate(torch.zeros(4), "g0")  # once only
    assert torch.allclose(memory.momenta["g0"], 0.9 * 0.9 * 0.1 * gradient / 5)


@pytest.mark.parametrize("name", ["residual", "dgc"])
def test_the_averages_reach_the_loop_in_a_gradients_scale_from_the_first_step(name):
    memory = _memory(name, torch.optim.SGD([torch.nn.Parameter(torch.zeros(4))], lr=0.1, momentum=0.9))
    assert memory.delivery_scale(0) == pytest.approx(10.0)  # 1 / (1 − 0.9)
    assert memory.delivery_scale(1) == pytest.approx(1 / (1 - 0.81))
    assert memory.delivery_scale(10_000) == 1.0
    plain = memories.create(name, **({"momentum": "optimizer"} if name == "residual" else {}))
    assert plain.delivery_scale(0) == 1.0  # no optimizer's momentum taken over: not in gradient units


class _Branches(torch.nn.Module):
    """Four alike branches, summed: four groups of alike norms."""

    def __init__(self):
        super().__init__()
        self.branches = torch.nn.ModuleList(torch.nn.Linear(32, 64) for _ in range(4))

    def forward(self, x):
        return sum(branch(x) for branch in self.branches)


def _branches_and_optimizer(memory="auto", compressor=None):
    """The four branches under SGD with momentum, top-k at 90% (or ``compressor``) with its
    default memory (top-k's takes SGD's momentum over), or ``memory`` ("dgc, no masking": the
    dgc memory with masking=False)."""
    import mergecomp
    torch.manual_seed(0)
    if memory == "dgc, no masking":
        memory = memories.create("dgc", masking=False)
    model = _Branches()
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    optimizer = mergecomp.DistributedOptimizer(  # most coordinates: what is sent is long enough to clip
        inner, model=model, compressor=compressor or mergecomp.compressors.create("topk", compress_ratio=0.9),
        schedule=4, memory=memory if memory != "residual" else "auto")
    return model, inner, optimizer


def _batch():
    """One batch, on both ranks: the averages as long as each rank's clipped gradient."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(16, 32, generator=generator), torch.randn(16, 64, generator=generator)


def _steps_taken(rank, world_size, clip):
    """Per step: the averages after the exchange (before the loop's clip), what the SGD inside
    stepped with, and the memory's delivery scale, for a loop clipping at ``clip``.  The
    memory keeps its momentum where it sends (at 90% density, masking once the loop clips
    keeps the averages under the clip after the first step, and nothing would be undone)."""
    model, inner, optimizer = _branches_and_optimizer("dgc, no masking")
    stepped, inner_step = [], inner.step

    def recorded_step(*args, **kwargs):
        stepped.append(torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()]))
        return inner_step(*args, **kwargs)
    inner.step = recorded_step
    exchanged, scales = [], []
    for step in range(6):
        x, y = _batch()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.synchronize()
        exchanged.append(torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()]))
        scales.append(optimizer.communicator.memory.delivery_scale(step))
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return exchanged, stepped, scales, optimizer.communicator.memory.loop_clip.threshold


def test_the_loop_is_seen_at_the_first_step_and_its_clip_undone_after():
    clip = 1e-3
    for exchanged, stepped, scales, threshold in run_ranks(_steps_taken, 2, clip):
        assert threshold == pytest.approx(clip / math.sqrt(2), rel=1e-3)  # seen at the first step
        # the first step: the loop's clip kept (nothing clipped before the momentum yet)
        assert float(exchanged[0].norm()) > clip
        assert torch.allclose(stepped[0], exchanged[0] * (clip / float(exchanged[0].norm())) / scales[0], rtol=1e-4)
        # later: the loop clips at its threshold again, and that clip is undone
        assert all(float(exchanged[step].norm()) > 1.01 * clip for step in range(1, 6))
        for step in range(1, 6):
            assert torch.allclose(stepped[step], exchanged[step] / scales[step], rtol=1e-4, atol=1e-9), step


def _six_clipped_steps(rank, stop_at, build):
    """Six steps of a loop clipping at 1e-3 on what ``build()`` makes (the model, the SGD, the
    wrapper), saved after ``stop_at`` steps and resumed in a new one (None: never stopped)."""
    import os
    import tempfile

    import mergecomp
    model, _, optimizer = build()
    for step in range(6):
        if step == stop_at:
            path = os.path.join(tempfile.mkdtemp(), f"rank{rank}.pt")
            mergecomp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
            saved = mergecomp.load(path)
            model, _, optimizer = build()
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
        x, y = _batch()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        optimizer.step()
    return model, optimizer


def _resumed(rank, world_size, stop_at, every_step_for):
    """The parameters after six clipped steps, the run saved after ``stop_at`` steps and
    resumed in a new model and optimizer (None: never stopped), the clip watch looking at
    every one of the first ``every_step_for`` steps."""
    from mergecomp.runtime.drift import ClipWatch
    ClipWatch.every_step_for = every_step_for  # in this rank's process only
    model, _ = _six_clipped_steps(rank, stop_at, _branches_and_optimizer)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("stop_at, every_step_for", [(1, 100), (3, 100), (4, 2)])
def test_a_run_that_follows_the_loop_resumes_bit_for_bit(stop_at, every_step_for):
    # (4, 2): resumed after the steps in which the watch looks at every step while it
    # waits, so the resumed run must know from the memories that it follows the loop
    straight = run_ranks(_resumed, 2, None, every_step_for)
    for straight, resumed in zip(straight, run_ranks(_resumed, 2, stop_at, every_step_for)):
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


# -- under AMP's GradScaler ------------------------------------------------------------------------

class _Scaler:
    """A GradScaler's scale, as LoopClip reads it."""

    def __init__(self, scale):
        self.scale = scale

    def get_scale(self):
        return self.scale


def test_under_a_loss_scale_the_memory_clips_in_the_losss_units():
    clip = LoopClip()
    clip.scale(torch.tensor([3.0, 4.0]) * 1024, "g0")  # the first step: the scale not yet known
    clip.commit()
    scaler = _Scaler(1024.0)
    clip.attach(scaler, 1024.0)
    assert clip.norms["g0"] == (5.0,)  # recorded norms put in the loss's units
    clip.commit()
    clip.follow(1.0)
    assert clip.catch_up("g0") == pytest.approx(0.2)  # as without a scale
    clip.commit()
    scaler.scale = 2048.0  # the scaler grew: the gradient is clipped at 2048 × 1
    assert clip.scale(torch.tensor([3.0, 4.0]) * 2048, "g0") == pytest.approx(0.2)
    assert clip.catch_up("g0") == 2.0  # the state taken in at 1024 joins a gradient at 2048
    clip.rollback()  # a dropped step: the state is still at 1024
    assert clip.state_dict() == {"threshold": 1.0, "loss_scale": 2048.0, "held_scale": 1024.0}
    resumed = LoopClip()
    resumed.load_state_dict(clip.state_dict())
    assert resumed.units() == 2048.0 and resumed.catch_up("g0") == 2.0
    with pytest.raises(ValueError, match="loop_clip loss_scale must be a positive finite float"):
        LoopClip.check_state({"loss_scale": 0.0}, "dgc memory")
    with pytest.raises(ValueError, match="a loss scale must be a positive finite float"):
        clip.attach(scaler, float("nan"))


def _scaled_steps(rank, world_size, name, use_scaler, stop_at=None):
    """The parameters after eight clipped steps of the four branches, under a GradScaler whose
    scale grows every other step (``use_scaler``) or none; rank 1's gradient is infinite at
    step 5 (a dropped step, which the scaler backs off from); with ``stop_at``, saved after that
    many steps and resumed."""
    import os
    import tempfile

    import mergecomp
    model, inner, optimizer = _branches_and_optimizer(name)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2) if use_scaler else None
    for step in range(8):
        if step == stop_at:
            path = os.path.join(tempfile.mkdtemp(), f"rank{rank}.pt")
            mergecomp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "scaler": scaler.state_dict()}, path)
            saved = mergecomp.load(path)
            model, inner, optimizer = _branches_and_optimizer(name)
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
            scaler.load_state_dict(saved["scaler"])
        x, y = _batch()
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step == 5 and rank == 1:
            loss = loss * float("inf")
        if scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            optimizer.step()
            continue
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        scaler.step(optimizer)
        scaler.update()
    return [p.detach().clone() for p in model.parameters()], optimizer.communicator.memory.loop_clip.threshold


@pytest.mark.parametrize("name", ["residual", "dgc"])
def test_a_grad_scaler_between_the_exchange_and_step_changes_no_step(name):
    # the loss scale grows every other step and backs off after the infinite one: powers of
    # two, so the run under the scaler takes the unscaled run's steps bit for bit
    plain, scaled = run_ranks(_scaled_steps, 2, name, False), run_ranks(_scaled_steps, 2, name, True)
    for (mine, threshold), (theirs, other) in zip(plain, scaled):
        assert threshold == other == pytest.approx(1e-3 / math.sqrt(2), rel=1e-3)
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    for (mine, _), (theirs, _) in zip(scaled, run_ranks(_scaled_steps, 2, name, True, 3)):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))  # resumed under the scaler


# -- under the DDP hook ----------------------------------------------------------------------------

def _one_group_steps(rank, world_size, entry, scaled):
    """The four branches in one group (one DDP bucket), six steps of a loop clipping at 1e-3
    (under a GradScaler when ``scaled``), through the wrapper or the DDP hook shown the SGD:
    the parameters, the memory's threshold, and the gradients the SGD stepped on."""
    import mergecomp
    import mergecomp.ddp
    from torch.nn.parallel import DistributedDataParallel
    torch.manual_seed(0)
    model = _Branches()
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    topk = mergecomp.compressors.create("topk", compress_ratio=0.9)
    if entry == "wrapper":
        trained, optimizer = model, mergecomp.DistributedOptimizer(inner, model=model, compressor=topk, schedule=1)
        memory = optimizer.communicator.memory
    else:
        trained, optimizer = DistributedDataParallel(model, bucket_cap_mb=64), inner
        memory = mergecomp.ddp.register(trained, compressor=topk, optimizer=inner).memory
    stepped = []
    inner.register_step_pre_hook(  # after the hand-over's: what the SGD steps on
        lambda *_: stepped.append(torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()])))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2) if scaled else None
    for step in range(6):
        x, y = _batch()
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(trained(x), y)
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    return [p.detach().clone() for p in model.parameters()], memory.loop_clip.threshold, stepped


@pytest.mark.parametrize("scaled", [False, True])
def test_the_ddp_hook_follows_the_loops_clipping_as_the_wrapper_does(scaled):
    wrapper, ddp = run_ranks(_one_group_steps, 2, "wrapper", scaled), run_ranks(_one_group_steps, 2, "ddp", scaled)
    for (mine, threshold, stepped), (theirs, other, hooked) in zip(wrapper, ddp):
        assert threshold == pytest.approx(1e-3 / math.sqrt(2), rel=1e-3)  # seen at the first step
        assert other == pytest.approx(threshold, rel=1e-5)
        assert len(stepped) == len(hooked) == 6
        for a, b in zip(stepped, hooked):  # the loop's clip undone, the delivery scale divided out
            # (top-k's selection of near-equal entries may differ with the layout: compared by norm)
            assert float(b.norm()) == pytest.approx(float(a.norm()), rel=1e-5)
        for a, b in zip(mine, theirs):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)


def _ddp_resumed(rank, world_size, stop_at):
    """The four branches through the DDP hook shown the SGD, six steps clipped at 1e-3; saved
    after ``stop_at`` steps and resumed in a new model, SGD, DDP and hook state (None: never)."""
    import os
    import tempfile

    import mergecomp
    import mergecomp.ddp
    from torch.nn.parallel import DistributedDataParallel

    def build(saved=None):
        torch.manual_seed(0)
        model = _Branches()
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ddp = DistributedDataParallel(model)
        if saved is not None:
            model.load_state_dict(saved["model"])
            inner.load_state_dict(saved["optimizer"])
        state = mergecomp.ddp.register(ddp, compressor=mergecomp.compressors.create("topk", compress_ratio=0.9),
                                       optimizer=inner)
        if saved is not None:
            state.load_state_dict(saved["hook"])
        return model, inner, ddp, state
    model, inner, ddp, state = build()
    for step in range(6):
        if step == stop_at:
            path = os.path.join(tempfile.mkdtemp(), f"rank{rank}.pt")
            mergecomp.save({"model": model.state_dict(), "optimizer": inner.state_dict(),
                            "hook": state.state_dict()}, path)
            model, inner, ddp, state = build(mergecomp.load(path))
        x, y = _batch()
        inner.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        inner.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("stop_at", [2, 3])
def test_a_ddp_run_that_follows_the_loop_resumes_bit_for_bit(stop_at):
    # not after the first step: saved before DDP rebuilt its buckets, the resumed run's first
    # iteration exchanges in the saved order and the uninterrupted run's second in the
    # rebuilt one, and the branches' biases have equal gradients, whose top-k ties break by
    # position (the sent coordinates, and so the masked ones, differ)
    for straight, resumed in zip(run_ranks(_ddp_resumed, 2, None), run_ranks(_ddp_resumed, 2, stop_at)):
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


# -- masking where the loop's clip binds -----------------------------------------------------------

def _masked_after(name, gradient, watched=True, seen=True, **options):
    """The momentum of the second coordinate (top-k sends it) after one step of ``gradient``,
    for a memory that follows the loop's clipping (``watched``: an entry point watches it;
    ``seen``: the loop was seen clipping at 1)."""
    import mergecomp
    memory = memories.create(name, **({"momentum": "optimizer"} if name == "residual" else {}), **options)
    memory.check_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(4))], lr=0.1, momentum=0.9))
    memory.loop_clip.watched = watched
    if seen:
        memory.follow_loop_clip(1.0)
    topk = mergecomp.compressors.create("topk", compress_ratio=0.25)
    v = memory.compensate(gradient, "g0")
    payload, ctx = topk.compress(v, "g0")
    memory.update(v, "g0", topk, payload, ctx)
    return float(memory.momenta["g0"][1])


@pytest.mark.parametrize("name", ["residual", "dgc"])
def test_a_memory_that_follows_the_loop_masks_once_it_clips(name):
    large, small = torch.tensor([3.0, 4.0, 0.0, 0.0]), torch.tensor([0.2, 0.3, 0.0, 0.0])  # top-k sends the 2nd
    assert _masked_after(name, large) == 0.0  # the loop clips: the sent momentum restarts
    assert _masked_after(name, small) == 0.0  # in a step it does not clip too
    assert _masked_after(name, large, seen=False) > 0.0  # a loop not seen clipping: kept, as dense SGD's
    if name == "dgc":
        assert _masked_after(name, small, watched=False, seen=False) == 0.0  # nobody watches: the paper's
        assert _masked_after(name, small, seen=False, masking=True) == 0.0  # as given
        assert _masked_after(name, large, masking=False) > 0.0
        assert repr(memories.create("dgc")) == "DGCMemory(momentum=0.9, nesterov=False, clip_norm=None)"
        assert repr(memories.create("dgc", masking=True)).endswith("clip_norm=None, masking=True)")


def test_a_pickled_loop_clip_leaves_the_live_scaler_and_reads_older_pickles():
    import pickle
    clip = LoopClip()
    clip.attach(_Scaler(8.0), 8.0)
    clip.follow(1.0)
    again = pickle.loads(pickle.dumps(clip))
    assert again.scaler is None and again.units() == 8.0 and again.threshold == 1.0
    older = LoopClip()
    for added in ("watched", "_held", "scaler", "loss_scale"):
        del older.__dict__[added]  # as a pickle from before they existed
    read = pickle.loads(pickle.dumps(older))
    assert read.watched is False and read.units() == 1.0
