"""ATOMO under an Adam: each group's first exchanges sample within a bound four times finer
(a fixed budget: sixteen times the atoms), then as configured; a dropped step does not
count, and a resumed compressor goes on where the warm-up was."""
import pytest
import torch

from mergecomp import compressors
from mergecomp.compressors.atomo import atomo_budget
from mergecomp.compressors.base import payload_nbytes

from .test_atomo_noise import spread


def params():
    return [torch.nn.Parameter(torch.zeros(3))]


def optimizer(name):
    if name == "adamw":
        return torch.optim.AdamW(params())
    if name == "adam, β1 0":
        return torch.optim.Adam(params(), betas=(0.0, 0.999))
    return torch.optim.SGD(params(), lr=0.1)


@pytest.mark.parametrize("optimizer_name, warmup_steps, finer",
                         [("adamw", 10, 10), ("adamw", 0, 0), ("sgd", 10, 0), ("adam, β1 0", 3, 3)])
def test_the_first_exchanges_under_an_adam_sample_within_a_finer_bound(optimizer_name, warmup_steps, finer):
    inner = optimizer(optimizer_name)
    default = compressors.create("atomo", warmup_steps=warmup_steps)
    fixed = compressors.create("atomo", budget=2, warmup_steps=warmup_steps)
    for compressor in (default, fixed):
        compressor.check_optimizer(inner)
        compressor.set_process_rank(0)
    x = torch.randn(128, 96, generator=torch.Generator().manual_seed(0))
    default.compress(x, "g")
    default.rollback()  # a dropped step: not one of the warm-up's
    noises, budgets = [], []
    for step in range(12):
        if step == 2:  # resumed from a checkpoint mid-way
            resumed = compressors.create("atomo", warmup_steps=warmup_steps)
            resumed.set_process_rank(0)
            resumed.load_state_dict(default.state_dict())
            resumed.check_optimizer(inner)
            default = resumed
        noises.append(default.group_noise("g"))
        budgets.append(fixed.group_budget("g"))
        for compressor in (default, fixed):
            compressor.compress(x, "g")
            compressor.commit()
    assert noises == [0.125] * finer + [0.5] * (12 - finer)
    assert budgets == [32.0] * finer + [2.0] * (12 - finer)
    assert default.group_noise("h") == (0.125 if finer else 0.5)  # each group has its own


def test_the_finer_bound_sends_the_atoms_it_needs_and_the_state_says_how_far_it_is():
    """A flat spectrum needs many more atoms at a quarter of the noise: the warm-up's payloads
    are larger, and its count is state (a checkpoint keeps it, a bad one is refused)."""
    x = spread(128, 96, 1.5)
    sigma = torch.linalg.svdvals(x)
    assert atomo_budget(sigma, 0.125) > 3 * atomo_budget(sigma, 0.5)
    atomo = compressors.create("atomo", warmup_steps=1)
    atomo.check_optimizer(torch.optim.AdamW(params()))
    atomo.set_process_rank(0)
    sizes = []
    for _ in range(2):
        payload, _ = atomo.compress(x, "g")
        atomo.commit()
        sizes.append(payload_nbytes(payload))
    assert sizes[0] > 2 * sizes[1]
    assert atomo.state_dict()["steps"] == {"g": 2}
    assert "warmup_steps=1" in repr(atomo)
    with pytest.raises(ValueError, match="atomo state 'steps' must map each group"):
        atomo.load_state_dict({"steps": {"g": -1}})
    with pytest.raises(ValueError, match="atomo warmup_steps must be a whole number"):
        compressors.create("atomo", warmup_steps=1.5)
