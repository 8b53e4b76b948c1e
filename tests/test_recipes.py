"""Recipes: what a compressor needs beyond dense SGD's settings, said where users meet it."""
import warnings

import pytest
import torch

import mergecomp
from mergecomp import compressors
from mergecomp.compressors import recipes
from mergecomp.compressors.recipes import Recipe, RecipeWarning
from tests.distributed import run_ranks


def _sgd(lr=0.05, momentum=0.9):
    return torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=lr, momentum=momentum)


def test_a_recipe_needs_a_reason_and_sane_numbers():
    with pytest.raises(ValueError, match="needs a reason"):
        Recipe(reason=" ")
    with pytest.raises(ValueError, match="lr_scale must be a positive finite number, got 0"):
        Recipe(reason="x", lr_scale=0)
    with pytest.raises(ValueError, match="min_ratio must be in \\(0, 1\\]"):
        Recipe(reason="x", min_ratio=1.5)


def test_folding_the_momentum_keeps_the_steady_state_step():
    folded = Recipe(reason="x", fold_momentum=True)
    assert folded.learning_rate(0.05, 0.9) == pytest.approx(0.5)
    assert folded.momentum(0.9) == 0.0
    scaled = Recipe(reason="x", lr_scale=0.01)
    assert scaled.learning_rate(0.05, 0.9) == pytest.approx(0.0005) and scaled.momentum(0.9) == 0.9
    with pytest.raises(ValueError, match="dense_momentum must be in \\[0, 1\\)"):
        folded.learning_rate(0.05, 1.0)


def test_an_absolute_step_size_keeps_its_bound_whatever_dense_sgds_learning_rate():
    """signSGD's lr × 0.01 is 0.0005 for a dense 0.05, but a model trained at dense lr 2
    would get 0.02, twenty times the bound its warning states: the bound is the value."""
    sign = compressors.create("signsgd").recipe
    assert sign.learning_rate(0.05, 0.9) == pytest.approx(0.0005)
    assert sign.learning_rate(2.0, 0.9) == pytest.approx(sign.max_lr)
    assert Recipe(reason="x", lr_scale=0.5).learning_rate(2.0) == pytest.approx(1.0)


@pytest.mark.parametrize("name", ["signsgd", "signum", "efsignsgd", "onebit", "tbq", "randk"])
def test_the_compressors_that_need_other_settings_declare_them(name):
    recipe = compressors.create(name).recipe
    assert isinstance(recipe, Recipe) and recipe.reason
    assert name not in ("efsignsgd", "onebit", "tbq", "randk") or recipe.fold_momentum


@pytest.mark.parametrize("name", ["none", "fp16", "bf16", "qsgd", "terngrad", "powersgd", "atomo"])
def test_the_compressors_at_parity_with_dense_settings_declare_nothing(name):
    assert compressors.create(name).recipe is None


def test_advice_names_what_contradicts_the_recipe_and_what_to_do():
    sign = recipes.advice(compressors.create("signsgd"), _sgd(lr=0.05, momentum=0.0))
    assert "lr=0.05, above the 0.0005" in sign and "Adam's scale" in sign
    assert "use lr = 0.0005: your 0.05 × 0.01" in sign  # the value to use, not a bound
    huge = recipes.advice(compressors.create("signsgd"), _sgd(lr=5.0, momentum=0.0))
    assert "use lr = 0.0005 (your 5 × 0.01 = 0.05 is still above it" in huge
    tbq = recipes.advice(compressors.create("tbq"), _sgd(lr=0.05, momentum=0.9))
    assert "momentum=0.9; fold it into the learning rate: momentum=0, lr = 0.5: your 0.05 / (1 − 0.9)" in tbq
    folded = recipes.advice(compressors.create("efsignsgd"), _sgd(lr=0.05, momentum=0.9), "residual")
    assert ". The paper: EF-SGD" in folded and ".. The paper" not in folded  # one sentence each
    randk = recipes.advice(compressors.create("randk", compress_ratio=0.01), _sgd(lr=0.5, momentum=0.0), "residual")
    assert "compress_ratio=0.01 is below the 0.1 it needs" in randk
    unbiased = recipes.advice(compressors.create("randk", unbiased=True, compress_ratio=0.25),
                              _sgd(momentum=0.0), "residual")
    assert "paired with memory 'residual'; use memory='none'" in unbiased
    assert recipes.advice(compressors.create("efsignsgd"), _sgd(lr=0.5, momentum=0.0), "residual") is None
    assert recipes.advice(compressors.create("topk"), _sgd()) is None


def test_unbiased_randk_recommends_no_error_feedback():
    assert compressors.create("randk", unbiased=True).recommended_memory == "none"
    assert compressors.create("randk").recommended_memory == "residual"
    recipe = compressors.create("randk", unbiased=True, compress_ratio=0.5).recipe
    assert recipe.lr_scale == 0.5 and recipe.memory == "none" and not recipe.fold_momentum


def _construct(rank, world_size, compressor, lr, momentum, memory="auto"):
    model = torch.nn.Linear(4, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer = mergecomp.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum), model=model, compressor=compressor,
            memory=memory)
    optimizer.remove_hooks()
    return [(w.category.__name__, str(w.message), w.filename) for w in caught
            if issubclass(w.category, RecipeWarning)]


def test_the_optimizer_warns_at_construction_from_the_users_line():
    # A plain residual: TBQ's default memory folds the momentum itself, so it has no advice.
    caught = run_ranks(_construct, 1, "tbq", 0.05, 0.9, "residual")[0]
    assert len(caught) == 1 and "fold it into the learning rate" in caught[0][1], caught
    assert caught[0][2].endswith("test_recipes.py"), caught  # points at the line that built it
    assert run_ranks(_construct, 1, "tbq", 0.5, 0.0, "residual")[0] == []
    assert run_ranks(_construct, 1, "tbq", 0.05, 0.9)[0] == []


def _hook_warnings(rank, world_size, compressor, momentum, later, memory="auto", ratio=None):
    import mergecomp.ddp
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    compressor = compressors.create(compressor, **({} if ratio is None else {"compress_ratio": ratio}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if later:  # as a framework does: the hook first, the optimizer after
            state = mergecomp.ddp.register(model, compressor=compressor, memory=memory)
            state.check_optimizer(optimizer)
        else:
            mergecomp.ddp.register(model, compressor=compressor, memory=memory, optimizer=optimizer)
    return [(str(w.message), w.filename) for w in caught if issubclass(w.category, RecipeWarning)]


def test_the_ddp_hook_checks_the_optimizer_it_is_given_or_shown_later():
    for later in (False, True):
        caught = run_ranks(_hook_warnings, 1, "tbq", 0.9, later, "residual")[0]
        assert len(caught) == 1 and "fold it into the learning rate" in caught[0][0], caught
        assert caught[0][1].endswith("test_recipes.py"), caught
    assert run_ranks(_hook_warnings, 1, "tbq", 0.0, False, "residual")[0] == []
    assert run_ranks(_hook_warnings, 1, "tbq", 0.9, False)[0] == []  # its default memory folds it
    # Without an optimizer, what can be judged alone: the ratio (and the memory).
    caught = run_ranks(_hook_warnings, 1, "randk", 0.0, True, "auto", 0.01)[0]
    assert len(caught) == 1 and "compress_ratio=0.01 is below the 0.1" in caught[0][0], caught


@pytest.mark.parametrize("name", ["topk", "dgc", "graddrop"])
def test_error_feedback_sparsifiers_ask_for_local_clipping(name):
    recipe = compressors.create(name).recipe
    assert recipe.local_clipping and recipe.lr_scale == 1.0 and not recipe.fold_momentum
    assert "before accumulation" in recipe.describe()
    assert recipes.advice(compressors.create(name), _sgd()) is None  # nothing to judge on the optimizer


def test_dgc_recipe_reaches_its_recurrent_model_techniques():
    described = compressors.create("dgc").recipe.describe()
    for technique in ("before accumulation", "clip / √N", "warmup_steps", "masking=False"):
        assert technique in described, technique


def test_batched_powersgd_warns_when_built():
    with pytest.warns(recipes.RecipeWarning, match="does not train at parity.*several layers per "
                      "group.*one group per tensor \\(schedule=0\\).*use 'powersgd'"):
        compressors.create("batched_powersgd")


def test_dgc_warmup_in_steps_counts_committed_steps():
    dgc = compressors.create("dgc", compress_ratio=0.001, warmup_steps=4)
    densities = []
    for step in range(6):
        densities.append(dgc.density())
        dgc.compress(torch.randn(5000), "g")
        if step == 2:
            dgc.rollback()  # a dropped step does not count
        else:
            dgc.commit()
    assert densities[0] == 0.25 and densities[-1] == 0.001
    assert densities[2] == densities[3] and densities[1] > densities[2] > densities[4]
    dgc.set_epoch(0)  # the epochs no longer matter
    assert dgc.density() == 0.001 and dgc.state_dict()["steps"] == 5
    again = compressors.create("dgc", compress_ratio=0.001, warmup_steps=4)
    again.load_state_dict({"epoch": 0, "steps": 2})
    assert again.density() == densities[2]
    with pytest.raises(ValueError, match="warmup_steps must be a non-negative integer"):
        compressors.create("dgc", warmup_steps=-1)


def _warnings_of_first_steps(compressor, steps=3):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            compressor.compress(torch.randn(5000), "g")
            compressor.commit()
    return [str(w.message) for w in caught if issubclass(w.category, RecipeWarning)]


def test_dgc_says_once_when_its_warmup_cannot_run():
    silent = _warnings_of_first_steps(compressors.create("dgc", warmup=4))
    assert len(silent) == 1, silent  # once, not every step
    assert "no epoch was set before its first step and warmup_steps=0" in silent[0]
    assert "pass warmup_steps = 0.2 × your run's steps" in silent[0] and "optimizer.set_epoch(epoch)" in silent[0]
    told = compressors.create("dgc", warmup=4)
    told.set_epoch(0)
    for fine in (told, compressors.create("dgc", warmup=4, warmup_steps=10), compressors.create("dgc", warmup=0),
                 compressors.create("dgc", warmup=4, compress_ratio=0.5),  # nothing to warm up from
                 compressors.create("dgc")):  # "auto": no warm-up before an Adam is vetted
        assert _warnings_of_first_steps(fine) == [], fine


def _dgc_steps(rank, world_size, set_epoch, adam=True):
    model = torch.nn.Linear(64, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inner = (torch.optim.AdamW(model.parameters(), lr=0.001) if adam
                 else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        optimizer = mergecomp.DistributedOptimizer(inner, model=model, compressor="dgc")
        if set_epoch:
            optimizer.set_epoch(0)
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(8, 64)).pow(2).mean().backward()
            optimizer.step()
    optimizer.remove_hooks()
    return [(str(w.message), w.filename) for w in caught if issubclass(w.category, RecipeWarning)]


def test_the_wrapper_says_when_dgc_trains_without_its_warmup_and_only_then():
    """DGC's default warm-up follows the optimizer: the paper's epochs under an AdamW, which
    the loop must report; none under SGD, so nothing to say there."""
    warned, other = run_ranks(_dgc_steps, 2, False)
    assert len(warned) == 1 and "warm-up" in warned[0][0] and "is off" in warned[0][0], warned
    assert warned[0][1].endswith("test_recipes.py"), warned  # the user's line
    assert other == []  # once per job: rank 0 says it for every rank
    assert run_ranks(_dgc_steps, 2, True) == [[], []]  # set_epoch before the first step: nothing to say
    assert run_ranks(_dgc_steps, 2, False, False) == [[], []]  # SGD: no warm-up asked for


def test_an_adaptive_optimizers_learning_rate_is_not_judged_on_sgds_scale():
    """Adam's step is already about ±lr per coordinate, as a sign compressor's is: a rate
    tuned for AdamW must not be told to shrink a hundredfold (an SGD's still is)."""
    model = torch.nn.Linear(3, 1)
    for adaptive in (torch.optim.AdamW(model.parameters(), lr=0.01), torch.optim.RMSprop(model.parameters(), lr=0.01)):
        assert recipes.advice(compressors.create("signsgd"), adaptive) is None
    assert "lr=0.01, above the 0.0005" in recipes.advice(compressors.create("signsgd"), _sgd(lr=0.01, momentum=0.0))
