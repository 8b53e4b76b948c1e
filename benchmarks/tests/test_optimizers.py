"""The user's optimizer in the convergence benchmark: SGD as before, AdamW with the parts of a
recipe that are about the exchange, the momentum where the components' refusals put it; the
cosine schedule and set_epoch's rhythm."""
import math

import pytest
import torch

from benchmarks.harness import optimizers, pacing
from mergecomp import compressors, memories
from mergecomp.compressors import recipes

SGD = optimizers.Hyper("sgd", lr=0.05, momentum=0.9)
ADAMW = optimizers.Hyper("adamw", lr=0.003, weight_decay=0.1, betas=(0.9, 0.98))


def _row(hyper, name, memory=None, **spec):
    compressor = compressors.create(name)
    memory = memories.create(memory or compressor.recommended_memory, **compressor.recommended_memory_options)
    return optimizers.row_settings(hyper, recipes.recipe_of(compressor), compressor, memory,
                                   spec.get("lr_scale"), spec.get("momentum"))


def test_sgd_rows_are_placed_as_the_benchmark_always_placed_them():
    assert _row(SGD, "none") == optimizers.RowSettings(0.05, 0.9, (0.9, 0.999), "optimizer")
    assert _row(SGD, "topk").momentum_in == "taken over"
    signs = _row(SGD, "signsgd")
    assert signs.lr == pytest.approx(0.0005) and signs.momentum == 0.9
    folded = _row(SGD, "efsignsgd")
    assert folded.momentum == 0.0 and folded.momentum_in == "folded into lr"
    assert _row(SGD, "signum").momentum_in == "compressor/memory"
    assert _row(SGD, "topk", lr_scale=2.0, momentum=0.5) == optimizers.RowSettings(0.1, 0.5, (0.9, 0.999), "optimizer")


def test_adamw_keeps_its_rate_and_betas_where_nothing_owns_a_momentum():
    for name in ("none", "signsgd", "qsgd"):  # PowerSGD folds β1: below
        row = _row(ADAMW, name)
        assert (row.lr, row.betas, row.momentum) == (0.003, (0.9, 0.98), 0.0), name
        assert row.momentum_in == "adam", name
    assert _row(ADAMW, "qsgd", lr_scale=0.5, momentum=0.8).lr == pytest.approx(0.0015)
    assert _row(ADAMW, "qsgd", momentum=0.8).betas == (0.8, 0.98)


def test_under_adamw_a_memory_that_follows_sgds_momentum_is_plain_error_feedback():
    compressor = compressors.create("topk")
    row = optimizers.row_settings(ADAMW, recipes.recipe_of(compressor), compressor,
                                  memories.create("residual", momentum="optimizer"), None, None)
    assert row.betas == (0.9, 0.98) and row.momentum_in == "adam (plain error feedback)"


@pytest.mark.parametrize("name", ["topk", "graddrop"])
def test_under_adamw_the_sparsifiers_memory_takes_beta1_over(name):
    row = _row(ADAMW, name)
    assert row.betas == (0.9, 0.98) and row.momentum_in == "adam, β1 taken over by the memory"


@pytest.mark.parametrize("name", ["efsignsgd", "onebit", "tbq", "randk"])
def test_the_bursting_residuals_memory_folds_the_momentum(name):
    row = _row(ADAMW, name)
    assert row.betas == (0.9, 0.98) and row.momentum_in == "adam, β1 off (folded by the memory)"
    compressor = compressors.create(name)
    sgd = optimizers.row_settings(SGD, None, compressor, memories.recommended(compressor), None, None)
    assert sgd.momentum_in == "folded into lr by the memory" and sgd.momentum == SGD.momentum


@pytest.mark.parametrize("name", ["powersgd", "batched_powersgd"])
def test_under_adamw_powersgds_error_feedback_folds_beta1_and_sgd_keeps_its_momentum(name):
    row = _row(ADAMW, name)
    assert row.betas == (0.9, 0.98) and row.momentum_in == "adam, β1 off (folded by the compressor)"
    assert _row(SGD, name).momentum_in == "optimizer"
    plain = compressors.create(name, use_error_feedback=False)
    assert optimizers.row_settings(ADAMW, None, plain, memories.create("none"), None, None).momentum_in == "adam"


def test_under_adamw_the_dgc_memory_takes_beta1_over():
    row = _row(ADAMW, "dgc")
    assert row.betas == (0.9, 0.98) and row.momentum_in == "adam, β1 taken over by the memory"


def test_under_adamw_a_component_that_owns_a_momentum_gets_beta1_zero():
    row = _row(ADAMW, "signum")
    assert row.betas == (0.0, 0.98) and row.momentum_in == "adam, β1 in the compressor or memory"


def test_the_dgc_memory_takes_over_the_adamw_it_is_given():
    """The benchmark's AdamW keeps its betas: the dgc memory runs β1, AdamW steps at β1 0."""
    model = torch.nn.Linear(3, 2)
    memory = memories.create("dgc")
    adamw = optimizers.make(ADAMW, model.parameters(), _row(ADAMW, "dgc"))
    memory.check_optimizer(adamw)
    assert memory.momentum == 0.9 and memory.gradient_units and adamw.param_groups[0]["betas"] == (0.9, 0.98)


def test_make_builds_the_optimizer_with_its_settings():
    model = torch.nn.Linear(3, 2)
    adamw = optimizers.make(ADAMW, model.parameters(), _row(ADAMW, "none"))
    assert isinstance(adamw, torch.optim.AdamW)
    group = adamw.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (0.003, (0.9, 0.98), 0.1)
    sgd = optimizers.make(SGD, model.parameters(), _row(SGD, "none"))
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.9
    assert "AdamW lr 0.003 betas (0.9, 0.98) weight decay 0.1" == optimizers.describe(ADAMW)


def test_bad_values_are_refused_with_the_value():
    with pytest.raises(ValueError, match="'rmsprop'"):
        optimizers.dense_lr("rmsprop", "digits")
    with pytest.raises(ValueError, match="0.9,0.999, got '0.9'"):
        optimizers.parse_betas("0.9")
    with pytest.raises(ValueError, match="got '0.9,1.5'"):
        optimizers.parse_betas("0.9,1.5")
    assert optimizers.parse_betas("0.9,0.95") == (0.9, 0.95)


def _lrs(kind, steps, taken):
    model = torch.nn.Linear(2, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    pace = pacing.Pacing(sgd, kind, steps)
    seen = []
    for step in range(taken):
        seen.append(sgd.param_groups[0]["lr"])
        sgd.step()
        pace.after()
    return seen


def test_cosine_runs_from_the_full_rate_to_zero_over_the_run():
    lrs = _lrs("cosine", 10, 12)
    assert lrs[0] == 0.5 and lrs[5] == pytest.approx(0.25) and lrs[10] == pytest.approx(0.0, abs=1e-12)
    assert lrs[11] == pytest.approx(0.0, abs=1e-12)  # past the end it stays at 0
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert _lrs("constant", 10, 5) == [0.5] * 5


class _Epochs:
    def __init__(self):
        self.calls = []

    def set_epoch(self, epoch):
        self.calls.append(epoch)


def test_set_epoch_follows_the_steps_or_the_passes_over_the_data():
    every = _Epochs()
    pace = pacing.Pacing(every, "constant", 100, set_epoch_every=37)
    for step in range(80):
        pace.before(step, data_epoch=0)
    assert every.calls == [0, 1, 2] and pace.epoch == 2
    passes = _Epochs()
    pace = pacing.Pacing(passes, "constant", 100)
    for step, data_epoch in enumerate([0, 0, 1, 1, 2]):
        pace.before(step, data_epoch)
    assert passes.calls == [0, 1, 2]


def test_pacing_refuses_bad_values():
    sgd = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="'linear'"):
        pacing.Pacing(sgd, "linear", 10)
    with pytest.raises(ValueError, match="got 0"):
        pacing.Pacing(sgd, "cosine", 0)
    with pytest.raises(ValueError, match="got -1"):
        pacing.Pacing(sgd, "constant", 10, set_epoch_every=-1)
    assert math.isclose(_lrs("cosine", 1, 1)[0], 0.5)
