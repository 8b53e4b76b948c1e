"""ATOMO's default budget: per matrix, the fewest expected atoms within a noise bound; a matrix
whose atoms would cost as much as it does goes raw, exactly."""
import pytest
import torch

from mergecomp import compressors
from mergecomp.compressors.atomo import SENT_RAW, atomo_budget, atomo_probabilities
from mergecomp.compressors.base import ParamView, payload_nbytes
from mergecomp.compressors.single_process import run_locally


def variance(sigma, budget):
    p = atomo_probabilities(sigma, budget)
    kept = p > 0
    return float((sigma[kept] ** 2 * (1 / p[kept] - 1)).sum())


def spectrum(m, decay, zeros=0, seed=0):
    values = torch.rand(m, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) ** decay
    values = values.sort(descending=True).values
    if zeros:
        values[-zeros:] = 0
    return values


@pytest.mark.parametrize("decay, zeros", [(1, 0), (6, 0), (0.2, 0), (3, 5)])
@pytest.mark.parametrize("noise", [0.1, 0.5, 1.2])
def test_the_budget_is_the_fewest_atoms_within_the_noise_bound(decay, zeros, noise):
    sigma = spectrum(24, decay, zeros)
    bound = noise ** 2 * float((sigma ** 2).sum())
    budget = atomo_budget(sigma, noise)
    assert 0 < budget <= int((sigma > 0).sum())
    assert variance(sigma, budget) <= bound * (1 + 1e-9)
    assert variance(sigma, budget * 0.999) > bound  # one atom in a thousand fewer is too noisy


def test_a_zero_or_rank_one_matrix_needs_no_more_than_it_has():
    assert atomo_budget(torch.zeros(5), 0.5) == 0.0
    # one atom kept with p has variance σ²(1/p − 1): within 0.25·σ² from p = 1/1.25
    assert atomo_budget(torch.tensor([3.0, 0.0, 0.0]), 0.5) == pytest.approx(0.8)
    assert atomo_budget(torch.empty(0), 0.5) == 0.0


def spread(rows, cols, decay, seed=1):
    """A rows × cols matrix with singular values 1/i^decay in random directions."""
    generator = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, cols, generator=generator))
    v, _ = torch.linalg.qr(torch.randn(cols, cols, generator=generator))
    return (u * torch.arange(1, cols + 1).float() ** -decay) @ v.t()


def test_the_default_holds_each_matrix_near_its_noise_bound_where_a_fixed_budget_does_not():
    """A slowly decaying spectrum (a transformer's late gradients): 2 atoms are noise several
    times the matrix; the default's measured noise sits at its bound."""
    x = spread(128, 96, 1.0)
    default = compressors.create("atomo", seed=2)
    fixed = compressors.create("atomo", budget=2, seed=2)
    assert default.budget == "auto" and default.noise == 0.5

    def noise(compressor):
        errors = [float((run_locally(compressor, x, "g")[0] - x).norm() ** 2) for _ in range(150)]
        return (sum(errors) / len(errors)) ** 0.5 / float(x.norm())

    assert 0.4 < noise(default) < 0.6
    assert noise(fixed) > 2.0
    assert atomo_budget(torch.linalg.svdvals(x), 0.5) < 0.5 * 128 * 96 / (128 + 96 + 1)  # factored


def test_a_matrix_whose_atoms_cost_as_much_goes_raw_exactly():
    layout = (ParamView("flat", torch.Size([12, 10]), 0), ParamView("low", torch.Size([40, 30]), 120),
              ParamView("bias", torch.Size([7]), 1320))
    low = torch.randn(40, 1) @ torch.randn(1, 30)  # one atom: factored
    g = torch.cat([torch.randn(120), low.reshape(-1), torch.randn(7)])
    atomo = compressors.create("atomo", noise=0.1)
    atomo.set_process_rank(0)
    payload, ctx = atomo.compress(g, "g", layout=layout)
    raw, counts, left, scaled, right = payload
    assert counts.tolist() == [SENT_RAW, 1]
    assert raw.numel() == 7 + 120 and left.numel() == 40 and right.numel() == 30
    decoded = atomo.decompress(payload, ctx)
    assert torch.equal(decoded[:120], g[:120]) and torch.equal(decoded[1320:], g[1320:])
    kept = int(counts[1])  # the rank-one matrix's atom, kept with p = 1/1.01
    assert kept in (0, 1) and left.numel() == 40 * kept and right.numel() == 30 * kept
    torch.testing.assert_close(decoded[120:1320], g[120:1320] * kept / atomo_budget(torch.tensor([1.0]), 0.1),
                               rtol=1e-4, atol=1e-4)
    expected = 4 * 127 + 4 * 2 + 4 * (40 + 30 + 1) * kept
    assert payload_nbytes(payload) == expected == atomo.wire_nbytes(g.numel(), 4, payload, layout)
    assert atomo.wire_nbytes(g.numel(), 4, layout=layout) == 4 * g.numel() + 4 * 2  # at most: all raw


def test_the_controller_leaves_the_default_alone_and_raises_a_fixed_budget():
    """Under "auto" each matrix is held at its bound at every step: no knob to raise."""
    default, fixed = compressors.create("atomo"), compressors.create("atomo", budget=2)
    assert default.knob is None and default.group_budget("g") is None
    with pytest.raises(ValueError, match="no density, rank or bits to raise"):
        default.set_group_scale("g", 2.0)
    assert fixed.knob == "rank"
    fixed.set_group_scale("g", 4.0)
    assert fixed.group_budget("g") == 8.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(noise=0), r"atomo noise .* must be a positive number, got 0"),
    (dict(noise=float("inf")), "must be a positive number, got inf"),
    (dict(noise=True), "must be a positive number, got True"),
    (dict(budget=2, noise=0.5), "a fixed budget .* or a noise bound .*, not both"),
    (dict(budget="most"), "budget .* must be a positive number, got 'most'"),
])
def test_bad_settings_are_explained(kwargs, message):
    with pytest.raises(ValueError, match=message):
        compressors.create("atomo", **kwargs)
