"""Damaged checkpoints of compression state are refused before they touch anything.

Each case takes a real checkpoint (top-k + residual, after a few steps), damages it the way
a disk, a copy or a careless edit does, and loads it through both entry points: the
wrapper (``DistributedOptimizer.load_state_dict``) and the DDP hook
(``HookState.load_state_dict``).  The refusal must name what is wrong and the file, and the
parameters and compression state must be as before the attempt.
"""
import copy
import io
import os
import re
import warnings

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import mergecomp
import mergecomp.ddp
from mergecomp.checkpoint import CheckpointError
from tests.distributed import run_ranks
from tests.test_optimizer import batch, make_model


def flip_exponent_bit(tensor, element):
    """The top exponent bit of one float32 element: 0.01 becomes ~3.4e36."""
    tensor.view(torch.int32)[element] ^= 1 << 30


def damage(kind, state, residuals, reseal):
    """Damage ``state`` (a loaded checkpoint) in place; ``residuals`` is its dict of residuals,
    ``reseal(state)`` records a new checksum (damage done before saving)."""
    if kind == "bit flip":
        flip_exponent_bit(residuals["group0"], 5)
    elif kind == "nan":
        residuals["group0"][5] = float("nan")
    elif kind == "nan, resealed":
        residuals["group0"][5] = float("nan")
        reseal(state)
    elif kind == "wrong shape, resealed":
        residuals["group0"] = residuals["group0"][:-1].clone()
        reseal(state)
    elif kind == "wrong dtype, resealed":
        residuals["group0"] = residuals["group0"].double()
        reseal(state)
    elif kind == "missing key":
        del residuals["group0"]
    else:
        raise AssertionError(kind)


KINDS = ["bit flip", "nan", "nan, resealed", "wrong shape, resealed", "wrong dtype, resealed", "missing key"]


def snapshot(model, state_dict):
    buffer = io.BytesIO()
    torch.save({"params": [p.detach().clone() for p in model.parameters()], "state": state_dict}, buffer)
    return buffer.getvalue()


def attempts(load, path, residuals_of, reseal, model, live_state):
    """Every kind of damage to the file at ``path``; returns {kind: message or None}, and
    whether the model and state stayed as they were."""
    before = snapshot(model, live_state())
    messages = {}
    for kind in KINDS:
        state = mergecomp.load(path)
        damage(kind, state, residuals_of(state), reseal)
        try:
            load(state)
            messages[kind] = None
        except CheckpointError as error:
            messages[kind] = str(error)
    truncated = f"{path}.truncated"
    with open(path, "rb") as full, open(truncated, "wb") as part:
        part.write(full.read()[: os.path.getsize(path) // 2])
    try:
        mergecomp.load(truncated)
        messages["truncated"] = None
    except CheckpointError as error:
        messages["truncated"] = str(error)
    untouched = snapshot(model, live_state()) == before
    # An older checkpoint, saved without a checksum: loaded, with a warning.
    state = mergecomp.load(path)
    for sealed in _sealed(state):
        del sealed["checksum"]
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        load(state)
    messages["old"] = " ".join(str(w.message) for w in warned)
    return messages, untouched


def _sealed(value):
    if isinstance(value, dict):
        if "checksum" in value:
            yield value
        for item in value.values():
            yield from _sealed(item)


def train(model, step_fn, steps, rank):
    for step in range(steps):
        x, y = batch(step, rank)
        step_fn(lambda: nn.functional.mse_loss(model(x), y))


def wrapper_worker(rank, world_size, folder):
    model = make_model()
    opt = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         model=model, compressor="topk", memory="residual")

    def step(loss):
        opt.zero_grad()
        loss().backward()
        opt.step()

    train(model, step, 3, rank)
    path = f"{folder}/wrapper.rank{rank}.pt"
    mergecomp.save(opt.state_dict(), path)
    train(model, step, 1, rank)  # the live state differs from the file's

    messages, untouched = attempts(
        opt.load_state_dict, path,
        lambda state: state["mergecomp"]["communicator"]["memory"]["residuals"],
        lambda state: mergecomp.checkpoint.seal(state["mergecomp"]), model, opt.state_dict)
    damaged = mergecomp.load(path)
    flip_exponent_bit(damaged["mergecomp"]["communicator"]["memory"]["residuals"]["group0"], 5)
    opt.load_state_dict(damaged, restore_compression=False)  # the way around a damaged file
    return messages, untouched, opt.steps


def hook_worker(rank, world_size, folder):
    model = make_model()
    ddp = DDP(model, bucket_cap_mb_list=mergecomp.ddp.bucket_caps(model, 2))
    state = mergecomp.ddp.register(ddp, compressor="topk", memory="residual")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(loss):
        opt.zero_grad()
        loss().backward()
        opt.step()

    train(ddp, step, 3, rank)
    path = f"{folder}/hook.rank{rank}.pt"
    mergecomp.save({"model": model.state_dict(), "hook": state.state_dict()}, path)
    train(ddp, step, 1, rank)

    messages, untouched = attempts(
        lambda saved: state.load_state_dict(saved["hook"]), path,
        lambda saved: saved["hook"]["communicator"]["memory"]["residuals"],
        lambda saved: mergecomp.checkpoint.seal(saved["hook"]), model, state.state_dict)
    try:
        state.load_state_dict(mergecomp.load(path))  # the whole file, not its "hook" entry
    except CheckpointError as error:
        messages["whole file"] = str(error)
    damaged = mergecomp.load(path)
    damaged["hook"]["communicator"]["memory"]["residuals"]["group0"][5] = float("nan")
    state.load_state_dict(damaged["hook"], restore_compression=False)
    train(ddp, step, 1, rank)  # trains on: compression state restarted from zero
    return messages, untouched, state.steps, state.skipped_steps


def check_messages(messages, path):
    for kind in KINDS + ["truncated"]:
        assert messages[kind] is not None, f"{kind}: loaded without complaint"
        assert f"checkpoint {path}" in messages[kind], (kind, messages[kind])
    residual = "communicator.memory.residuals.group0"
    assert residual in messages["bit flip"] and "changed" in messages["bit flip"]
    assert re.search(r"largest \|value\| [0-9.]+e\+3[0-9] at element 5 \(parameter '4.weight' element 2\)",
                     messages["bit flip"]), messages["bit flip"]
    assert "not finite, the first nan at element 5" in messages["nan"]
    assert f"compression state {residual} holds non-finite values" in messages["nan, resealed"]
    assert "the first nan at element 5 (parameter '4.weight' element 2)" in messages["nan, resealed"]
    assert "residual of group 'group0' has shape" in messages["wrong shape, resealed"]
    assert "but the group holds" in messages["wrong shape, resealed"]
    assert "residual of group 'group0' is float64, but the group's gradients are float32" in \
        messages["wrong dtype, resealed"]
    assert f"{residual} is missing" in messages["missing key"]
    assert "cannot be read" in messages["truncated"] and "truncated" in messages["truncated"]
    assert "restore_compression=False" in messages["bit flip"]
    assert "without a checksum" in messages["old"]


def test_the_wrapper_refuses_damaged_compression_state_and_keeps_its_own(tmp_path):
    for rank, (messages, untouched, steps) in enumerate(run_ranks(wrapper_worker, 2, str(tmp_path))):
        check_messages(messages, f"{tmp_path}/wrapper.rank{rank}.pt")
        assert untouched
        assert steps == 3


def test_the_hook_refuses_damaged_compression_state_and_keeps_its_own(tmp_path):
    for rank, (messages, untouched, steps, skipped) in enumerate(run_ranks(hook_worker, 2, str(tmp_path))):
        check_messages(messages, f"{tmp_path}/hook.rank{rank}.pt")
        assert "this is not a hook state (it has ['hook', 'model'])" in messages["whole file"]
        assert untouched
        assert steps == 4 and skipped == 0


def test_without_the_file_name_the_message_says_where_the_state_came_from():
    state = mergecomp.checkpoint.seal({"communicator": {"memory": {"residuals": {"group0": torch.ones(3)}}}})
    state["communicator"]["memory"]["residuals"]["group0"][1] = float("inf")
    with pytest.raises(CheckpointError, match="the checkpoint passed to load_state_dict: .*inf at element 1"):
        mergecomp.checkpoint.verify(state, "hook state", None)


def test_save_replaces_the_file_whole(tmp_path):
    path = tmp_path / "ckpt.pt"
    mergecomp.save({"a": torch.ones(2)}, path)
    mergecomp.save({"a": torch.zeros(2)}, path)
    assert torch.equal(mergecomp.load(path)["a"], torch.zeros(2))
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]


def test_components_check_their_state_against_the_groups_of_this_run():
    from mergecomp.checkpoint import GroupSpec
    from mergecomp.compressors.base import ParamView
    layout = (ParamView("w", torch.Size([32, 24]), 0), ParamView("b", torch.Size([32]), 768))
    groups = {"group0": GroupSpec(800, torch.float32, layout)}
    powersgd = mergecomp.compressors.create("powersgd", rank=2)
    powersgd.check_state({"errors": {"group0": {"w": torch.zeros(32, 24)}},
                          "queries": {"group0": {"w": torch.zeros(24, 2)}}}, groups)
    with pytest.raises(ValueError, match=r"errors of group 'group0' view 'w' has shape \(24, 32\), "
                                         r"expected \(32, 24\)"):
        powersgd.check_state({"errors": {"group0": {"w": torch.zeros(24, 32)}}}, groups)
    with pytest.raises(ValueError, match="group 'group3', which this run does not exchange"):
        powersgd.check_state({"queries": {"group3": {"w": torch.zeros(24, 2)}}}, groups)
    dgc = mergecomp.memories.create("dgc")
    with pytest.raises(ValueError, match="momenta for groups \\['group0'\\] but velocities for \\[\\]"):
        dgc.check_state({"momenta": {"group0": torch.zeros(800)}, "velocities": {}}, groups)
    with pytest.raises(ValueError, match="dgc velocity of group 'group0' has shape \\(799,\\)"):
        dgc.check_state({"momenta": {"group0": torch.zeros(800)}, "velocities": {"group0": torch.zeros(799)}}, groups)


def pickle_worker(rank, world_size):
    import pickle
    model = make_model()
    ddp = DDP(model, bucket_cap_mb_list=mergecomp.ddp.bucket_caps(model, 2))
    state = mergecomp.ddp.register(ddp, compressor="topk", memory="residual")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(loss):
        opt.zero_grad()
        loss().backward()
        opt.step()

    train(ddp, step, 3, rank)
    kept = state.__getstate__()
    kept["state"]["memory"]["residuals"]["group1"][0] = float("inf")
    broken = HookStateBlob(kept)
    try:
        pickle.loads(pickle.dumps(broken))
    except CheckpointError as error:
        return str(error)
    return None


class HookStateBlob:
    """Pickles as a HookState whose saved state is ``kept``."""

    def __init__(self, kept):
        self.kept = kept

    def __reduce__(self):
        return (_rebuild, (self.kept,))


def _rebuild(kept):
    state = mergecomp.ddp.HookState.__new__(mergecomp.ddp.HookState)
    state.__setstate__(kept)
    return state


def test_an_unpickled_hook_state_is_checked_too():
    for message in run_ranks(pickle_worker, 2):
        assert message and message.startswith("the pickled HookState: its compression state does not match")
        assert "memory.residuals.group1 changed" in message and "first inf at element 0" in message


def _nan_in_the_wrapped_optimizers_state(rank, world_size):
    model = make_model()
    opt = mergecomp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model,
                                         compressor="topk")
    train(model, lambda loss: (opt.zero_grad(), loss().backward(), opt.step()), 2, rank)
    before = snapshot(model, opt.state_dict())
    said = []
    # copies: an optimizer's state_dict() hands out its live tensors
    for state in (copy.deepcopy(opt.state_dict()), copy.deepcopy(opt.state_dict()["optimizer"])):
        inner = state["optimizer"] if "mergecomp" in state else state
        next(iter(inner["state"].values()))["exp_avg_sq"].view(-1)[1] = float("nan")
        try:
            opt.load_state_dict(state)
            said.append(None)
        except CheckpointError as error:
            said.append(str(error))
    return said, snapshot(model, opt.state_dict()) == before


def test_nan_in_the_wrapped_optimizers_state_never_reaches_the_parameters():
    for said, untouched in run_ranks(_nan_in_the_wrapped_optimizers_state, 2):
        assert untouched
        assert all(m is not None and "the wrapped optimizer's state holds non-finite values in state.0.exp_avg_sq" in m
                   for m in said), said
