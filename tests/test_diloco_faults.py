"""DiLoCo under faults: a model changed after construction, a checkpoint with NaN in what
reaches the weights, GradScaler skipping an inner step on one rank, ranks configured apart.
Each must end in a clear error on every rank (or train on, identically), never in ranks
that drift apart silently."""
import copy

import pytest
import torch

import mergecomp

from .distributed import run_ranks
from .test_diloco import _batch, _model, _train, _weights


def _build(rank, model=None, **options):
    model = model if model is not None else _model(rank)
    opt = mergecomp.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1), model=model, sync_every=2,
                           outer_momentum=0.5, **options)
    return model, opt


def _error_at_next_exchange(model, opt, rank):
    try:
        _train(model, opt, rank, 2, start=2)
    except (RuntimeError, mergecomp.RanksDisagree) as error:
        return type(error).__name__, str(error)
    return None


# -- the model changed after construction ----------------------------------------------------
def _module_replaced(rank, world_size):
    model, opt = _build(rank)
    _train(model, opt, rank, 2)
    torch.manual_seed(100 + rank)  # each rank's new layer starts elsewhere
    model[2] = torch.nn.Linear(8, 1)
    return _error_at_next_exchange(model, opt, rank)


def _data_replaced(rank, world_size):
    model, opt = _build(rank)
    _train(model, opt, rank, 2)
    model[0].weight.data = torch.randn(8, 6)
    return _error_at_next_exchange(model, opt, rank)


def _unfrozen(rank, world_size):
    model = _model(rank)
    model[0].bias.requires_grad_(False)
    opt = mergecomp.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1), model=model, sync_every=2,
                           outer_momentum=0.5)
    _train(model, opt, rank, 2)
    model[0].bias.requires_grad_(True)
    return _error_at_next_exchange(model, opt, rank)


def _unfrozen_on_rank_1(rank, world_size):
    model = _model(rank)
    model[0].bias.requires_grad_(False)
    opt = mergecomp.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1), model=model, sync_every=2,
                           outer_momentum=0.5)
    _train(model, opt, rank, 2)
    if rank == 1:
        model[0].bias.requires_grad_(True)
    return _error_at_next_exchange(model, opt, rank)


@pytest.mark.parametrize("worker, said", [
    (_module_replaced, "parameter(s) ['2.weight', '2.bias'] now require a gradient"),
    (_data_replaced, "parameter '0.weight' now holds another tensor"),
    (_unfrozen, "parameter(s) ['0.bias'] now require a gradient"),
])
def test_a_model_changed_after_construction_is_refused_on_every_rank(worker, said):
    for result in run_ranks(worker, 2):
        assert result is not None, "the exchange went on with a changed model"
        kind, message = result
        assert kind == "RuntimeError" and said in message, message
        assert "drift apart" in message and "build a new DiLoCo" in message


def test_a_model_changed_on_one_rank_only_is_named_on_every_rank():
    for kind, message in run_ranks(_unfrozen_on_rank_1, 2):
        assert kind == "RanksDisagree", message
        assert "parameters: rank 0: None, rank 1:" in message and "['0.bias']" in message


def _frozen_later(rank, world_size):
    model, opt = _build(rank)
    _train(model, opt, rank, 2)
    model[0].bias.requires_grad_(False)  # no change the exchange cares about: its Δ is zero
    _train(model, opt, rank, 4, start=2)
    return _weights(model), opt.outer_steps


def test_a_layer_frozen_later_trains_on_with_equal_ranks():
    (weights0, outer), (weights1, _) = run_ranks(_frozen_later, 2)
    assert outer == 3 and all(torch.equal(a, b) for a, b in zip(weights0, weights1))


# -- checkpoints with non-finite values --------------------------------------------------------
def _nonfinite_checkpoints(rank, world_size):
    def build(seed):
        model = _model(seed)
        return model, mergecomp.DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model,
                                       sync_every=4, overlap=1, fragments=2)

    model, opt = build(rank)
    _train(model, opt, rank, 6)  # fragment 1 launched at step 6, in flight
    saved = opt.state_dict()
    resumed_model, resumed = build(77)
    before = _weights(resumed_model)
    said = {}
    for label, damage in (
            ("moments", lambda s: next(iter(s["optimizer"]["state"].values()))["exp_avg"].view(-1).__setitem__(3, float("nan"))),
            ("local", lambda s: s["mergecomp"]["local"][1].__setitem__(0, float("inf"))),
            ("pending", lambda s: s["mergecomp"]["pending"]["delta"].__setitem__(2, float("nan")))):
        state = copy.deepcopy(saved)
        damage(state)
        if label != "moments":  # resealed, as a damaged writer would: the value check must catch it
            mergecomp.checkpoint.seal(state["mergecomp"])
        try:
            resumed.load_state_dict(state)
            said[label] = None
        except mergecomp.checkpoint.CheckpointError as error:
            said[label] = str(error)
    untouched = all(torch.equal(a, b) for a, b in zip(before, _weights(resumed_model)))
    resumed.load_state_dict(saved)  # the undamaged one still loads
    return said, untouched


def test_a_checkpoint_with_nan_in_what_reaches_the_weights_is_refused_naming_it():
    for said, untouched in run_ranks(_nonfinite_checkpoints, 2):
        assert untouched
        assert "the inner optimizer's state holds non-finite values in state.0.exp_avg" in said["moments"]
        assert "local.1 holds non-finite values" in said["local"]
        assert "pending.delta holds non-finite values" in said["pending"]
        assert all("Nothing was loaded" in message for message in said.values())


# -- GradScaler ------------------------------------------------------------------------------
def _scaled(rank, world_size):
    model, opt = _build(rank)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    skipped = []
    for step in range(8):
        x, y = _batch(rank, step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if rank == 1 and step == 2:
            loss = loss * float("inf")  # an overflow on one rank only
        scaler.scale(loss).backward()
        before = _weights(model)
        scaler.step(opt)
        scaler.update()
        if opt.inner_steps % 2 and all(torch.equal(a, b) for a, b in zip(before, _weights(model))):
            skipped.append(step)
    with opt.anchor_weights():
        anchors = _weights(model)
    return anchors, opt.inner_steps, opt.outer_steps, skipped


def test_gradscaler_skips_an_overflowed_inner_step_and_the_ranks_stay_on_schedule():
    (anchors0, inner0, outer0, skipped0), (anchors1, inner1, outer1, skipped1) = run_ranks(_scaled, 2)
    assert inner0 == inner1 == 8 and outer0 == outer1 == 4
    assert skipped0 == [] and skipped1 == [2]
    assert all(torch.equal(a, b) for a, b in zip(anchors0, anchors1))


# -- ranks configured apart ------------------------------------------------------------------
def _configured_apart(rank, world_size):
    model = _model(rank)
    try:
        mergecomp.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1), model=model, sync_every=4 + 4 * rank,
                         fragments=1 + rank, outer_momentum=0.5)
    except mergecomp.RanksDisagree as error:
        return str(error)
    return None


def test_ranks_configured_apart_are_told_which_field_and_each_ranks_value():
    for message in run_ranks(_configured_apart, 2):
        assert message is not None
        assert "sync_every: rank 0: 4, rank 1: 8" in message
        assert "fragments: rank 0: 1, rank 1: 2" in message
