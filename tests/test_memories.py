"""Memories: arguments are checked, and a step's state is kept by commit() and undone by
rollback() without any committed tensor changing in place."""
import math

import pytest
import torch

from mergecomp import compressors, memories


@pytest.mark.parametrize("name, kwargs, message", [
    ("residual", dict(beta=math.nan), r"beta \(the residual's decay\) must be in \[0, 1\], got nan"),
    ("residual", dict(beta=-0.5), r"beta .* must be in \[0, 1\], got -0.5"),
    ("residual", dict(beta=1.5), r"beta .* got 1.5\. 1 keeps every error"),
    ("residual", dict(beta=math.inf), r"beta .* got inf"),
    ("residual", dict(beta="1"), r"beta .* must be a number, got '1'"),
    ("residual", dict(gamma=math.nan), r"gamma \(the gradient's scale\) must be a finite number > 0, got nan"),
    ("residual", dict(gamma=0.0), r"gamma .* must be a finite number > 0, got 0.0"),
    ("residual", dict(gamma=-1.0), r"gamma .* got -1.0"),
    ("residual", dict(gamma=math.inf), r"gamma .* got inf"),
    ("residual", dict(gamma=True), r"gamma .* must be a number, got True"),
    ("dgc", dict(momentum=math.nan), r"momentum must be in \[0, 1\), got nan"),
    ("dgc", dict(momentum=1.0), r"momentum must be in \[0, 1\), got 1.0"),
    ("dgc", dict(momentum=-0.1), r"momentum must be in \[0, 1\), got -0.1"),
    ("dgc", dict(momentum="0.9"), r"momentum must be a number, got '0.9'"),
    ("dgc", dict(nesterov="False"), r"nesterov must be True or False, got 'False'"),
    ("dgc", dict(clip_norm=0.0), r"clip_norm must be a finite number > 0, got 0.0. Pass None"),
    ("dgc", dict(clip_norm=math.inf), r"clip_norm must be a finite number > 0, got inf"),
    ("dgc", dict(clip_norm=math.nan), r"clip_norm .* got nan"),
])
def test_bad_memory_arguments_are_explained(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        memories.create(name, **kwargs)


def test_good_memory_arguments_are_kept():
    import numpy as np
    assert memories.create("residual", beta=0, gamma=0.1).beta == 0.0
    assert memories.create("residual", beta=np.float32(0.5)).beta == 0.5
    dgc = memories.create("dgc", momentum=0, nesterov=True, clip_norm=2)
    assert (dgc.momentum, dgc.nesterov, dgc.clip_norm) == (0.0, True, 2.0)


# --- transactional state ----------------------------------------------------------------------

def _snapshot(memory):
    """Every tensor the memory holds (pending included) by identity, plus its values."""
    state = {}
    for attribute in ("residuals", "momenta", "velocities"):
        for key, value in getattr(memory, attribute, {}).items():
            state[attribute, key] = (value, value.clone())
    return state


def _same(left, right):
    if not isinstance(left, dict):  # a state's plain values (a momentum's units)
        return left == right
    return (left.keys() == right.keys()
            and all(torch.equal(left[k], right[k]) for k in left))


def _step(memory, compressor, generator, names=("a", "b")):
    for name in names:
        gradient = torch.randn(64, generator=generator)
        compensated = memory.compensate(gradient, name)
        payload, ctx = compressor.compress(compensated, name)
        memory.update(compensated, name, compressor, payload, ctx)


CASES = [("residual", {}, "topk"), ("residual", dict(beta=0.5, gamma=2.0), "signsgd"),
         ("residual", {}, "none"), ("dgc", {}, "dgc"), ("dgc", dict(nesterov=True), "topk"),
         ("dgc", {}, "fp16"), ("dgc", {}, "none"), ("dgc", dict(clip_norm=1.0), "randk")]


@pytest.mark.parametrize("memory_name, kwargs, compressor_name", CASES)
def test_rollback_restores_the_state_before_the_step_and_commit_keeps_it(memory_name, kwargs,
                                                                         compressor_name):
    generator = torch.Generator().manual_seed(3)
    memory = memories.create(memory_name, **kwargs)
    options = {"compress_ratio": 0.25} if compressor_name in ("topk", "dgc", "randk") else {}
    compressor = compressors.create(compressor_name, **options)
    _step(memory, compressor, generator)
    memory.commit()
    before = memory.state_dict()
    held = _snapshot(memory)

    _step(memory, compressor, generator, names=("a", "b", "c"))
    assert memory.state_dict().keys() == before.keys()
    for part in before:  # state_dict exports the committed state only, mid-step too
        assert _same(memory.state_dict()[part], before[part])
    for (value, copy) in held.values():  # no committed tensor was changed in place
        assert torch.equal(value, copy)

    memory.rollback()
    for part in before:
        assert _same(memory.state_dict()[part], before[part])
    assert {k: v[1] for k, v in _snapshot(memory).items()}.keys() == held.keys()
    for key, (value, copy) in _snapshot(memory).items():
        assert torch.equal(value, held[key][1])

    _step(memory, compressor, generator)
    pending = {key: value[1] for key, value in _snapshot(memory).items()}
    memory.commit()
    committed = memory.state_dict()
    for (part, key), value in pending.items():
        assert torch.equal(committed[part][key], value)


def test_rollback_replays_the_step_exactly():
    """A dropped step, run again with the same gradients, gives what it would have."""
    memory, again = memories.create("dgc", momentum=0.9), memories.create("dgc", momentum=0.9)
    topk = compressors.create("topk", compress_ratio=0.25)
    _step(memory, topk, torch.Generator().manual_seed(1))
    _step(again, topk, torch.Generator().manual_seed(1))
    memory.commit()
    again.commit()
    _step(memory, topk, torch.Generator().manual_seed(5))  # dropped
    memory.rollback()
    _step(memory, topk, torch.Generator().manual_seed(2))
    _step(again, topk, torch.Generator().manual_seed(2))
    memory.commit()
    again.commit()
    for part, values in memory.state_dict().items():
        assert _same(values, again.state_dict()[part])


def test_load_state_dict_drops_a_pending_step():
    memory = memories.create("residual")
    topk = compressors.create("topk", compress_ratio=0.25)
    _step(memory, topk, torch.Generator().manual_seed(1))
    memory.commit()
    saved = memory.state_dict()
    _step(memory, topk, torch.Generator().manual_seed(2))
    memory.load_state_dict(saved)
    memory.commit()  # nothing pending is left to commit
    assert _same(memory.state_dict()["residuals"], saved["residuals"])


def test_dgc_memory_does_not_erase_a_dense_payload_that_is_its_velocity():
    memory = memories.create("dgc", momentum=0.5)
    fp16 = compressors.create("fp16")
    none = compressors.create("none")
    gradient = torch.tensor([1.0, -2.0, 3.0])
    velocity = memory.compensate(gradient, "g")
    payload, ctx = none.compress(velocity, "g")
    memory.update(velocity, "g", none, payload, ctx)
    assert payload[0].tolist() == [1.0, -2.0, 3.0]
    velocity = memory.compensate(gradient, "g")
    payload, ctx = fp16.compress(velocity, "g")
    memory.update(velocity, "g", fp16, payload, ctx)
    assert velocity.tolist() == [1.5, -3.0, 4.5]  # what compensate returned is left alone


class _AliasingSparsifier:
    """A plugin-like sparsifier whose payload is a view of its input (the first k elements)."""

    dense = lossless = False

    def compress(self, tensor, name):
        return (tensor.reshape(-1)[:2],), None

    def decompress(self, payload, ctx):
        out = torch.zeros(4)
        out[:2] = payload[0]
        return out


@pytest.mark.parametrize("compressor", ["dgc", "topk", "aliasing"])
def test_dgc_memory_follows_the_algorithm_and_rolls_back(compressor):
    """u ← m·u + g, v ← v + u; the sent coordinates are zeroed in both (Lin et al., Alg. 1).
    The zeroing happens in place on the step's own tensors, never on committed state or on a
    payload that shares their memory."""
    memory = memories.create("dgc", momentum=0.5)
    sparsifier = _AliasingSparsifier() if compressor == "aliasing" else \
        compressors.create(compressor, compress_ratio=0.5, **({"warmup": 0} if compressor == "dgc" else {}))
    u, v = torch.zeros(4), torch.zeros(4)
    for step, gradient in enumerate(([4.0, -1.0, 0.5, 2.0], [1.0, 3.0, -2.0, 0.25], [0.5, 0.5, 0.5, 0.5])):
        g = torch.tensor(gradient)
        velocity = memory.compensate(g, "g")
        payload, ctx = sparsifier.compress(velocity, "g")
        sent_before = [t.clone() for t in payload]
        memory.update(velocity, "g", sparsifier, payload, ctx)
        assert all(torch.equal(a, b) for a, b in zip(payload, sent_before))  # the payload is intact
        sent = sparsifier.decompress(payload, ctx).reshape(-1) != 0
        u = 0.5 * u + g
        v = v + u
        u, v = u.masked_fill(sent, 0), v.masked_fill(sent, 0)
        if step < 2:
            memory.commit()
            assert torch.equal(memory.state_dict()["momenta"]["g"], u)
            assert torch.equal(memory.state_dict()["velocities"]["g"], v)
            kept = memory.state_dict()
    memory.rollback()
    assert all(torch.equal(memory.state_dict()[k]["g"], kept[k]["g"]) for k in ("momenta", "velocities"))


@pytest.mark.parametrize("compressor", ["topk", "efsignsgd"])
def test_residuals_reuse_their_tensors_yet_keep_the_invariant_and_roll_back(compressor):
    """The tensors a step writes come from those earlier commits replaced; the invariant
    (everything sent plus the residual equals the sum of the gradients) and a rollback to
    the committed residual hold as with new tensors."""
    memory = memories.create("residual")
    codec = compressors.create(compressor, **({"compress_ratio": 0.25} if compressor == "topk" else {}))
    generator = torch.Generator().manual_seed(4)
    total_gradient, total_sent = torch.zeros(64), torch.zeros(64)
    for step in range(6):
        gradient = torch.randn(64, generator=generator)
        compensated = memory.compensate(gradient, "g")
        payload, ctx = codec.compress(compensated, "g")
        memory.update(compensated, "g", codec, payload, ctx)
        if step in (2, 4):  # dropped steps
            memory.rollback()
            continue
        memory.commit()
        total_gradient += gradient
        total_sent += codec.decompress(payload, ctx)
        residual = memory.state_dict()["residuals"]["g"]
        assert torch.allclose(total_sent + residual, total_gradient, atol=1e-5)
        if step == 3:  # a rollback leaves the committed residual as it was
            before = residual.clone()
            again = memory.compensate(torch.randn(64, generator=generator), "g")
            p, c = codec.compress(again, "g")
            memory.update(again, "g", codec, p, c)
            memory.rollback()
            assert torch.equal(memory.state_dict()["residuals"]["g"], before)
