"""The compressed FSDP2 reduce-scatter (mergecomp.fsdp) on two gloo ranks.

One worker runs every scenario on the same two ranks (starting ranks costs more than the
tiny model's steps); the tests below read what it returned.
"""
import warnings

import pytest
import torch

from tests.distributed import run_ranks

fully_shard = pytest.importorskip("torch.distributed.fsdp").fully_shard

STEPS = 4


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                torch.nn.ReLU(), torch.nn.Linear(32, 3))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    fully_shard(model)
    return model


def _batch(rank, step):
    generator = torch.Generator().manual_seed(1000 * rank + step % 4)  # four batches, repeated
    x = torch.randn(16, 8, generator=generator)
    return x, x[:, :3] * 2 - x[:, 3:6]


def _steps(model, optimizer, rank, steps):
    """The losses of training ``model`` on this rank's batches of ``steps``."""
    losses = []
    for step in steps:
        x, y = _batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _train(rank, steps, lr=0.05, **compression):
    """(losses, full parameters, the registered state or None) after ``steps`` SGD steps."""
    import mergecomp
    model = _model()
    state = mergecomp.fsdp.register(model, **compression) if compression else None
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = _steps(model, optimizer, rank, range(steps))
    full = [p.full_tensor().detach().clone() for p in model.parameters()]
    return losses, full, state


def _errors(rank):
    """The messages of the refusals register() owes an FSDP model."""
    import mergecomp
    found = {}
    for key, kwargs in {"nonfinite": dict(compressor="topk", nonfinite="sometimes"),
                        "options": dict(compressor=mergecomp.compressors.create("topk"), compress_ratio=0.1)}.items():
        try:
            mergecomp.fsdp.register(_model(), **kwargs)
            found[key] = None
        except (ValueError, TypeError) as error:
            found[key] = f"{type(error).__name__}: {error}"
    model = _model()
    mergecomp.fsdp.register(model, compressor="topk")
    try:
        mergecomp.fsdp.register(model, compressor="topk")
        found["twice"] = None
    except RuntimeError as error:
        found["twice"] = str(error)
    try:  # rank 1 asks for another compression ratio: named at the first backward, before any payload
        apart = _model()
        mergecomp.fsdp.register(apart, compressor="topk", compress_ratio=0.1 if rank == 0 else 0.2)
        x, y = _batch(rank, 0)
        torch.nn.functional.mse_loss(apart(x), y).backward()
        found["disagree"] = None
    except mergecomp.RanksDisagree as error:
        found["disagree"] = str(error)
    return found


def _poison(module, grad_input, grad_output):
    return tuple(g * float("nan") for g in grad_input)


def _nonfinite(rank):
    """Rank 1's gradient of the first layer only turns NaN at the second step: the whole
    backward is dropped on every rank (every gradient NaN, every residual as before it), and
    training goes on afterwards."""
    import mergecomp
    model = _model()
    state = mergecomp.fsdp.register(model, compressor="topk", compress_ratio=0.1)
    return _drop_one_backward(rank, model, state)


def _drop_one_backward(rank, model, state):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    out = {}
    for step in range(3):
        x, y = _batch(rank, step)
        poison = model[1].register_full_backward_hook(_poison) if step == 1 and rank == 1 else None
        loss = torch.nn.functional.mse_loss(model(x), y)
        before = {k: v.clone() for k, v in state.memory.residuals.committed().items()}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss.backward()
        if poison is not None:
            poison.remove()
        if step == 1:
            out["warned"] = [str(w.message) for w in caught if "NaN or Inf" in str(w.message)]
            out["grads_nan"] = all(bool(p.grad.to_local().isnan().all()) for p in model.parameters())
            after = state.memory.residuals.committed()
            out["residuals_kept"] = (before.keys() == after.keys()
                                     and all(torch.equal(before[k], after[k]) for k in before))
            optimizer.zero_grad()
            continue
        optimizer.step()
        optimizer.zero_grad()
    out["finite_after"] = all(bool(p.full_tensor().isfinite().all()) for p in model.parameters())
    out["dropped"] = state.dropped
    return out


def _raise(rank):
    """nonfinite="raise": the NaN backward raises NonFiniteGradient from backward() on every
    rank, after FSDP has resharded; training goes on after zero_grad()."""
    import mergecomp
    model = _model()
    mergecomp.fsdp.register(model, compressor="topk", compress_ratio=0.1, nonfinite="raise")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    raised = None
    for step in range(3):
        x, y = _batch(rank, step)
        poison = model[1].register_full_backward_hook(_poison) if step == 1 and rank == 1 else None
        try:
            torch.nn.functional.mse_loss(model(x), y).backward()
        except mergecomp.NonFiniteGradient as error:
            raised = str(error)
            optimizer.zero_grad()
            continue
        finally:
            if poison is not None:
                poison.remove()
        optimizer.step()
        optimizer.zero_grad()
    return raised, all(bool(p.full_tensor().isfinite().all()) for p in model.parameters())


def _others(rank):
    """The compressors a per-chunk all_to_all cannot carry, and Adam's sharded state."""
    import mergecomp
    found = {}
    for name, options in {"powersgd": {}, "dgc": {"compress_ratio": 0.1}, "signum": {}, "atomo": {}}.items():
        model = _model()
        state = mergecomp.fsdp.register(model, compressor=name, **options)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        losses = []
        for step in range(8):
            x, y = _batch(rank, step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        moments = [optimizer.state[p]["exp_avg"] for p in model.parameters()]
        sharded = all(m.to_local().shape == p.to_local().shape and m.to_local().numel() < p.numel()
                      for m, p in zip(moments, model.parameters()) if p.dim() == 2)
        again = mergecomp.fsdp.register(_model(), compressor=name, **options)
        again.load_state_dict(state.state_dict())  # its checkpoint fits a fresh model's units
        found[name] = (losses, [p.full_tensor() for p in model.parameters()], state.wire_bytes,
                       state.uncompressed_bytes, sharded)
    return found


def _divide(rank):
    """Gradients with set_gradient_divide_factor(1.0) (a sum, PREMUL_SUM for FSDP, which gloo's
    own reduce-scatter refuses) are twice the default average, on two ranks."""
    import mergecomp
    grads = []
    for factor in (None, 1.0):
        model = _model()
        mergecomp.fsdp.register(model, compressor="none")
        if factor is not None:
            for layer in (model[0], model[2], model[4]):
                layer.set_gradient_divide_factor(factor)
        x, y = _batch(rank, 0)
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads.append([p.grad.to_local().clone() for p in model.parameters()])
    return all(torch.equal(2 * a, b) for a, b in zip(*grads))


def _example(rank):
    """examples/fsdp_mlp.py's loop, on these ranks (its main() would start processes of its own)."""
    import contextlib
    import io
    import os
    import runpy
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    example = runpy.run_path(os.path.join(here, "examples", "fsdp_mlp.py"))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        example["main"](["--steps", "3", "--width", "16", "--print-every", "1"])
    return printed.getvalue()


def _checkpoint(rank):
    """Six steps straight equal three, a checkpoint of the residuals into a fresh model, and
    three more; a damaged checkpoint is refused and changes nothing."""
    import copy
    import mergecomp
    options = dict(compressor="topk", compress_ratio=0.1)
    straight = _model()
    mergecomp.fsdp.register(straight, **options)
    _steps(straight, torch.optim.SGD(straight.parameters(), lr=0.1), rank, range(6))
    first = _model()
    state = mergecomp.fsdp.register(first, **options)
    _steps(first, torch.optim.SGD(first.parameters(), lr=0.1), rank, range(3))
    saved = state.state_dict()
    resumed = _model()
    with torch.no_grad():
        for mine, theirs in zip(resumed.parameters(), first.parameters()):
            mine.to_local().copy_(theirs.to_local())
    again = mergecomp.fsdp.register(resumed, **options)
    damaged = copy.deepcopy(saved)
    key = sorted(damaged["memory"]["residuals"])[0]
    damaged["memory"]["residuals"][key][0] = 1e30
    try:
        again.load_state_dict(damaged)
        refused = None
    except mergecomp.checkpoint.CheckpointError as error:
        refused = str(error)
    untouched = not again.memory.residuals.committed()
    again.load_state_dict(saved)
    _steps(resumed, torch.optim.SGD(resumed.parameters(), lr=0.1), rank, range(3, 6))
    same = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(straight.parameters(),
                                                                              resumed.parameters()))
    return same, refused, untouched, len(saved["memory"]["residuals"])


def _step_log(rank):
    """A StepLog on the FSDP state: one row per backward, the dropped one marked."""
    import csv
    import os
    import tempfile
    import mergecomp
    model = _model()
    state = mergecomp.fsdp.register(model, compressor="topk", compress_ratio=0.1)
    folder = tempfile.mkdtemp()
    log = mergecomp.StepLog(folder)
    state.add_step_log(log)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(3):
        x, y = _batch(rank, step)
        poison = model[1].register_full_backward_hook(_poison) if step == 1 and rank == 1 else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.nn.functional.mse_loss(model(x), y).backward()
        if poison is not None:
            poison.remove()
        if step != 1:  # the dropped backward's gradients are NaN: no step
            optimizer.step()
        optimizer.zero_grad()
    log.close()
    if rank != 0:
        return None
    with open(os.path.join(folder, "steps.csv")) as handle:
        return list(csv.DictReader(handle)), state.wire_bytes


def _worker(rank, world):
    plain = _train(rank, STEPS)
    none = _train(rank, STEPS, compressor="none")
    fp16 = _train(rank, STEPS, compressor="fp16")
    topk = _train(rank, 30, lr=0.1, compressor="topk", compress_ratio=0.1)
    half = _train(rank, 30, lr=0.1, compressor="topk", compress_ratio=0.1, memory="residual16")
    return {
        "plain": plain[:2], "none": none[:2] + (none[2].wire_bytes,), "fp16": fp16[:2] + (fp16[2].wire_bytes,),
        "topk": topk[:2] + (topk[2].wire_bytes, repr(topk[2].memory)),
        "reference": (none[2].uncompressed_bytes, topk[2].uncompressed_bytes),
        "half": half[:2] + ({k: (v.dtype, v.numel()) for k, v in half[2].memory.residuals.committed().items()},
                            {k: (v.dtype, v.numel()) for k, v in topk[2].memory.residuals.committed().items()}),
        "checkpoint": _checkpoint(rank), "example": _example(rank), "errors": _errors(rank), "nonfinite": _nonfinite(rank), "divide": _divide(rank),
        "raise": _raise(rank), "others": _others(rank), "steplog": _step_log(rank),
    }


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_worker, 2)


def test_fp32_equals_fsdp_own_reduce_scatter(ranks):
    for result in ranks:
        for ours, theirs in zip(result["none"][1], result["plain"][1]):
            assert torch.equal(ours, theirs)


def test_fp16_is_close(ranks):
    for result in ranks:
        for ours, theirs in zip(result["fp16"][1], result["plain"][1]):
            assert torch.allclose(ours, theirs, atol=1e-3, rtol=1e-3)
    assert ranks[0]["fp16"][2] * 2 == ranks[0]["none"][2]


def test_topk_with_residual_trains_and_ranks_agree(ranks):
    losses, params, _, memory = ranks[0]["topk"]
    assert "Residual" in memory
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
    for ours, theirs in zip(ranks[0]["topk"][1], ranks[1]["topk"][1]):
        assert torch.equal(ours, theirs)


def test_topk_sends_fewer_bytes_than_fp32(ranks):
    per_step_fp32 = ranks[0]["none"][2] / STEPS
    per_step_topk = ranks[0]["topk"][2] / 30
    assert per_step_topk < 0.5 * per_step_fp32
    # FP32 through the compressed path sends what FSDP's own reduce-scatter sends
    assert ranks[0]["reference"] == (ranks[0]["none"][2], ranks[0]["none"][2] // STEPS * 30)


def test_bad_input_is_refused_by_name(ranks):
    errors = ranks[0]["errors"]
    assert "nonfinite" in errors["nonfinite"] and "'sometimes'" in errors["nonfinite"]
    assert "compress_ratio" in errors["options"]
    assert "once per model" in errors["twice"]
    assert "compress_ratio=0.1" in errors["disagree"] and "compress_ratio=0.2" in errors["disagree"]


def test_nonfinite_gradient_is_dropped_on_every_rank(ranks):
    for result in ranks:
        found = result["nonfinite"]
        assert len(found["warned"]) == 1 and "rank(s) [1]" in found["warned"][0]
        assert "step 1" in found["warned"][0] and "dropped on every rank" in found["warned"][0]
        assert found["grads_nan"] and found["residuals_kept"] and found["finite_after"]
        assert found["dropped"] == 1


def test_a_checkpoint_of_the_residuals_resumes_exactly_and_a_damaged_one_is_refused(ranks):
    for result in ranks:
        same, refused, untouched, residuals = result["checkpoint"]
        assert same and untouched and residuals == 3 * 2  # three units with parameters, two shards each
        assert "does not match the checksum" in refused and "restarts from zero" in refused
        assert "restore_compression" not in refused


def test_gradient_divide_factor_is_kept(ranks):
    assert all(result["divide"] for result in ranks)


def test_a_model_without_fsdp_is_refused():
    import mergecomp
    with pytest.raises(TypeError, match="fully_shard"):
        mergecomp.fsdp.register(torch.nn.Linear(2, 2))


def test_the_example_trains(ranks):
    printed = ranks[0]["example"]
    assert "step    3" in printed and "FSDP's own" in printed


def test_nonfinite_raise_stops_every_rank_and_training_goes_on(ranks):
    for result in ranks:
        raised, finite = result["raise"]
        assert "rank(s) [1]" in raised and "zero_grad" in raised
        assert finite


@pytest.mark.parametrize("name", ["powersgd", "dgc", "signum", "atomo"])
def test_multi_round_variable_size_and_majority_vote_compressors_train(ranks, name):
    losses, params, sent, fsdp_own, sharded = ranks[0]["others"][name]
    assert sharded  # Adam's moments are DTensor shards like the parameters
    assert all(torch.isfinite(p).all() for p in params)
    for ours, theirs in zip(params, ranks[1]["others"][name][1]):
        assert torch.equal(ours, theirs)
    assert 0 < sent
    if name in ("powersgd", "signum"):
        assert sent < fsdp_own
    if name == "powersgd":
        assert sum(losses[-3:]) < sum(losses[:3])


def test_error_feedback_kept_in_16_bits_trains_with_half_the_residual_memory(ranks):
    losses, params, half, full = ranks[0]["half"]
    assert half.keys() == full.keys() and len(half) == 3 * 2
    assert all(dtype == torch.bfloat16 for dtype, _ in half.values())
    assert all(dtype == torch.float32 for dtype, _ in full.values())
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
    for ours, theirs in zip(params, ranks[1]["half"][1]):
        assert torch.equal(ours, theirs)


def test_residual16_keeps_what_was_not_sent_up_to_its_rounding():
    import mergecomp
    memory = mergecomp.memories.create("residual16")
    compressor = mergecomp.compressors.create("topk", compress_ratio=0.25)
    gradient = torch.randn(64)
    compensated = memory.compensate(gradient, "g")
    payload, ctx = compressor.compress(compensated, "g")
    memory.update(compensated, "g", compressor, payload, ctx)
    memory.commit()
    kept = memory.residuals.committed()["g"]
    sent = compressor.decompress(payload, ctx).view(-1)
    assert kept.dtype == torch.bfloat16
    assert torch.allclose(kept.float() + sent, gradient, rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="float16"):
        mergecomp.memories.create("residual16", dtype="int8")


def test_a_step_log_records_every_backward(ranks):
    rows, sent = ranks[0]["steplog"]
    assert [row["step"] for row in rows] == ["0", "1", "2"]
    assert [row["skipped"] for row in rows] == ["0", "1", "0"]
    # the payloads and the small agreement collectives, per step
    assert sum(float(row["bytes_sent"]) for row in rows) > 0
    assert float(rows[0]["compression_ratio"]) > 1
