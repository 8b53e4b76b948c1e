"""Top-k (and GradDrop, which selects as it does) under Adam: the first moment taken over
with momentum factor masking, and a density warm-up that follows the optimizer
(``warmup="auto"``)."""
import math
import warnings

import pytest
import torch

from mergecomp import compressors, memories
from mergecomp.compressors.recipes import RecipeWarning


def params():
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize("optimizer,epochs", [
    (lambda: torch.optim.AdamW(params(), lr=0.1), 4),
    (lambda: torch.optim.Adam(params(), lr=0.1), 4),
    (lambda: torch.optim.Adam(params(), lr=0.1, betas=(0.0, 0.999)), 0),  # no first moment
    (lambda: torch.optim.SGD(params(), lr=0.1, momentum=0.9), 0),
    (lambda: torch.optim.RMSprop(params(), lr=0.1), 0)])
def test_the_auto_warmup_follows_the_optimizer(optimizer, epochs):
    topk = compressors.create("topk")
    assert topk.warmup == 0  # no optimizer seen yet: no warm-up
    topk.check_optimizer(optimizer())
    assert topk.warmup == epochs
    topk.set_epoch(0)
    assert topk.density() == (0.25 if epochs else 0.035)
    assert repr(topk) == ("TopKCompressor(compress_ratio=0.035, warmup='auto', warmup_steps=0, "
                          "wire_format='auto')")  # one digest


def test_a_warming_topk_sends_its_warmup_density_and_counts_its_bytes():
    topk = compressors.create("topk", compress_ratio=0.01, wire_format="indexed")  # 8 bytes a value
    topk.check_optimizer(torch.optim.AdamW(params(), lr=0.1))
    g = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    for epoch, k in ((0, 250), (2, 50), (4, 10), (9, 10)):
        topk.set_epoch(epoch)
        payload, ctx = topk.compress(g, "g")
        assert torch.equal(payload[0].abs().sort().values, g.abs().topk(k).values.sort().values)
        assert topk.wire_nbytes(1000, 4, payload) == k * 8


def test_an_explicit_warmup_applies_under_any_optimizer_and_resumes():
    topk = compressors.create("topk", compress_ratio=0.01, warmup_steps=4)
    topk.check_optimizer(torch.optim.SGD(params(), lr=0.1))
    g = torch.randn(400)
    sent = []
    for _ in range(5):
        sent.append(topk.compress(g, "g")[0][0].numel())
        topk.commit()
    assert sent[0] == 100 and sent[-1] == 4 and sent == sorted(sent, reverse=True)
    again = compressors.create("topk", compress_ratio=0.01, warmup_steps=4)
    again.load_state_dict(topk.state_dict())
    assert again.steps == 5 and again.density() == 0.01
    epochs = compressors.create("topk", compress_ratio=0.01, warmup=2)
    epochs.check_optimizer(torch.optim.SGD(params(), lr=0.1))
    epochs.set_epoch(0)
    assert epochs.warmup == 2 and epochs.density() == 0.25
    assert repr(epochs) == "TopKCompressor(compress_ratio=0.01, warmup=2, warmup_steps=0, wire_format='auto')"
    with pytest.raises(ValueError, match="warmup must be a number of epochs"):
        compressors.create("topk", warmup="always")


def test_a_warmup_that_cannot_run_is_told_once():
    adam = compressors.create("topk")
    adam.check_optimizer(torch.optim.AdamW(params(), lr=0.1))
    with pytest.warns(RecipeWarning, match="no epoch was set before its first step"):
        adam.compress(torch.randn(200), "g")
    sgd = compressors.create("topk")
    sgd.check_optimizer(torch.optim.SGD(params(), lr=0.1, momentum=0.9))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sgd.compress(torch.randn(200), "g")  # nothing asked for, nothing to say


def _one_step(memory, topk, g):
    v = memory.compensate(g, "g")
    payload, ctx = topk.compress(v, "g")
    memory.update(v, "g", topk, payload, ctx)
    memory.commit()
    return topk.transmitted_indices(payload, ctx)


def test_the_residual_memory_takes_adams_first_moment_over_with_masking():
    topk = compressors.create("topk", compress_ratio=0.25, wire_format="indexed")  # exact values: DGC's zeroing
    memory = memories.recommended(topk)
    adamw = torch.optim.AdamW(params(), lr=0.1)
    memory.check_optimizer(adamw)
    assert memory.adam and memory.masking and memory.sgd_momentum == 0.9 and memory.gradient_units
    g = torch.tensor([4.0, -1.0, 0.5, 0.25, 2.0, -3.0, 0.1, 0.2])
    sent = _one_step(memory, topk, g)
    assert torch.all(memory.momenta["g"][sent] == 0)  # masked where sent
    kept = torch.ones(8, dtype=torch.bool)
    kept[sent] = False
    assert torch.allclose(memory.momenta["g"][kept], 0.1 * g[kept])  # (1 − β1)·g elsewhere
    # the same steps as DGC's memory (momentum correction with masking)
    dgc = memories.create("dgc")
    dgc.check_optimizer(torch.optim.AdamW(params(), lr=0.1))
    _one_step(dgc, topk, g)
    for _ in range(3):
        _one_step(memory, topk, g)
        _one_step(dgc, topk, g)
    assert torch.allclose(memory.residuals["g"], dgc.velocities["g"])
    assert torch.allclose(memory.momenta["g"], dgc.momenta["g"])
    assert "adam=True" in repr(memory)


def test_the_residual_memory_masks_nothing_under_sgd_or_without_adam():
    topk = compressors.create("topk", compress_ratio=0.25)
    memory = memories.recommended(topk)
    memory.check_optimizer(torch.optim.SGD(params(), lr=0.1, momentum=0.9))
    assert not memory.masking and memory.sgd_momentum == 0.9
    plain = memories.create("residual", momentum="optimizer")
    plain.check_optimizer(torch.optim.AdamW(params(), lr=0.1))
    assert not plain.masking and plain.sgd_momentum == 0.0  # Adam keeps its moments
    with pytest.raises(ValueError, match="adam=True takes an Adam's first moment over through momentum='optimizer'"):
        memories.create("residual", momentum=0.5, adam=True)


def test_graddrop_warms_up_and_masks_as_top_k_does_under_adam():
    graddrop = compressors.create("graddrop")
    graddrop.check_optimizer(torch.optim.AdamW(params(), lr=0.1))
    graddrop.set_epoch(0)
    assert graddrop.warmup == 4 and graddrop.density() == 0.25
    g = torch.randn(20000, generator=torch.Generator().manual_seed(1))
    sent = graddrop.compress(g, "g")[0][0].numel()
    assert 0.2 * 20000 < sent < 0.3 * 20000  # about the warm-up's 25%
    memory = memories.recommended(graddrop)
    memory.check_optimizer(torch.optim.AdamW(params(), lr=0.1))
    assert memory.masking and memory.sgd_momentum == 0.9
    under_sgd = compressors.create("graddrop")
    under_sgd.check_optimizer(torch.optim.SGD(params(), lr=0.1, momentum=0.9))
    assert under_sgd.warmup == 0


def _ddp_hook_under(rank, world_size, optimizer_name, compressor="topk"):
    import mergecomp.ddp
    from torch.nn.parallel import DistributedDataParallel
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 2)
    ddp = DistributedDataParallel(model)
    optimizer = (torch.optim.AdamW(model.parameters(), lr=0.01) if optimizer_name == "adamw"
                 else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    state = mergecomp.ddp.register(ddp, compressor=compressor, optimizer=optimizer)
    state.set_epoch(0)
    return (state.compressor.warmup, state.compressor.density(), state.memory.masking, repr(state.compressor),
            state.lifecycle.meter.controller.raise_above)


def test_the_ddp_hook_given_an_adamw_warms_top_k_up_and_masks():
    from tests.distributed import run_ranks
    for warmup, density, masking, text, raise_above in run_ranks(_ddp_hook_under, 2, "adamw"):
        assert (warmup, density, masking) == (4, 0.25, True)
        assert "warmup='auto'" in text
        assert raise_above == 24.0  # the controller's thresholds follow the optimizer too
    for warmup, density, masking, _, raise_above in run_ranks(_ddp_hook_under, 2, "sgd"):
        assert (warmup, density, masking) == (0, 0.035, False)
        assert raise_above == 1.5


def test_the_ddp_hooks_dgc_thresholds_follow_the_optimizer():
    from tests.distributed import run_ranks
    for _, _, masking, _, raise_above in run_ranks(_ddp_hook_under, 2, "adamw", "dgc"):
        assert masking and raise_above == 24.0
    for _, _, masking, _, raise_above in run_ranks(_ddp_hook_under, 2, "sgd", "dgc"):
        assert masking and raise_above == 1.5  # masking under SGD too (where the loop's clip binds)


def _fsdp_under_adamw(rank, world_size):
    import mergecomp
    from tests.test_fsdp import _model, _steps
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = mergecomp.fsdp.register(model, compressor="topk", optimizer=optimizer)
    state.set_epoch(0)  # the warm-up's densest epoch, then past it
    losses = _steps(model, optimizer, rank, range(20))
    state.set_epoch(4)
    losses += _steps(model, optimizer, rank, range(20, 40))
    return (losses, state.compressor.warmup, state.memory.masking, optimizer.param_groups[0]["betas"],
            state.lifecycle.meter.controller.raise_above)


def test_fsdp_given_an_adamw_warms_top_k_up_masks_and_trains():
    from tests.distributed import run_ranks
    for losses, warmup, masking, betas, raise_above in run_ranks(_fsdp_under_adamw, 2):
        assert warmup == 4 and masking and betas == (0.9, 0.999)  # the user's betas, as given
        assert raise_above == 24.0  # the controller's thresholds follow the optimizer
        assert all(math.isfinite(v) for v in losses) and losses[-1] < 0.2 * losses[0]
