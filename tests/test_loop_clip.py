"""A memory that runs SGD's momentum before the exchange clips each rank's gradient at the
loop's threshold once it has seen the loop clip (mergecomp.memories.loopclip)."""
import math

import pytest
import torch

from mergecomp import memories
from mergecomp.memories.loopclip import LoopClip


def test_no_threshold_no_clipping():
    clip = LoopClip()
    assert clip.scale(torch.full((4,), 100.0), "g0") is None
    assert clip.state_dict() == {}


def test_the_whole_models_norm_is_estimated_from_this_step_and_the_last():
    clip = LoopClip()
    clip.follow(1.0)
    # first step: group g0 alone is known (norm 2): clipped to 1
    assert clip.scale(torch.tensor([2.0, 0.0]), "g0") == pytest.approx(0.5)
    # g1 (norm 2) now sees g0's norm this step too: the whole of it is √8
    assert clip.scale(torch.tensor([0.0, 2.0]), "g1") == pytest.approx(1 / math.sqrt(8))
    clip.commit()
    # next step: g0 (norm 0.1) is counted with g1's last norm (2): √(0.01 + 4)
    assert clip.scale(torch.tensor([0.1, 0.0]), "g0") == pytest.approx(1 / math.sqrt(4.01))
    clip.rollback()  # a dropped step: the last committed norms stay
    assert clip.state_dict() == {"threshold": 1.0, "norms": {"g0": pytest.approx(4.0), "g1": pytest.approx(4.0)}}
    # short enough: no clipping
    assert clip.scale(torch.tensor([0.1, 0.0]), "g0") is not None  # g1's last norm still counts
    clip.scale(torch.tensor([0.1, 0.0]), "g1")
    clip.commit()
    assert clip.scale(torch.tensor([0.1, 0.0]), "g0") is None


def test_a_group_not_exchanged_any_more_stops_counting():
    clip = LoopClip()
    clip.follow(1.0)
    clip.scale(torch.tensor([3.0]), "old")
    clip.commit()
    clip.scale(torch.tensor([0.5]), "new")
    clip.commit()
    assert set(clip.state_dict()["norms"]) == {"new"}


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), 1])
def test_a_bad_threshold_is_refused(bad):
    with pytest.raises(ValueError, match="positive finite float"):
        LoopClip().follow(bad)


@pytest.mark.parametrize("state, match", [
    ({"norms": {}}, "with 'threshold'"),
    ({"threshold": -2.0}, "positive finite float"),
    ({"threshold": 1.0, "norms": {"g0": float("nan")}}, "finite squared norms"),
    ({"threshold": 1.0, "extra": 1}, "with 'threshold'"),
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
    assert state["loop_clip"] == {"threshold": 1.0, "norms": {"g0": pytest.approx(25.0)}}
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
    ("residual", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), {"momentum": "fold"}),
    ("residual", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), {"momentum": "optimizer", "clip_norm": 0.5}),
    ("residual", lambda ps: torch.optim.SGD(ps, lr=0.1), {"momentum": "optimizer"}),
])
def test_what_does_not_follow_the_loop(name, optimizer, memory_options):
    # an Adam's first moment taken over, a momentum folded away, a clip_norm of its own, no momentum
    memory = memories.create(name, **memory_options)
    memory.check_optimizer(optimizer([torch.nn.Parameter(torch.zeros(2))]))
    assert not memory.follows_loop_clip
