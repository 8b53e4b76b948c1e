"""Replayed compute: the replayed model's gradients are the real model's (names, shapes,
dtypes, ready order), its waits cost no processor time, and traces round-trip."""
import time

import pytest
import torch

from benchmarks.harness import models
from benchmarks.harness.replay import ReplayModel, ReplayTrace, ReplayParam, from_profile, record, replay_spec
from benchmarks.harness.replay.model import Clock
from mergecomp.planning.profile import Profile, TensorTiming


def _grads_seen(model):
    """(name, shape, dtype) of each gradient as its hook sees it, in hook order."""
    seen = []
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda q, n=n: seen.append((n, tuple(q.grad.shape), q.grad.dtype)))
    return seen


@pytest.mark.parametrize("name, build, batch", [
    ("resnet20", {}, {}),
    ("transformer", {"vocab_size": 50, "d_model": 16, "num_heads": 2, "num_layers": 2}, {"vocab_size": 50}),
])
def test_replayed_gradients_are_the_real_models(name, build, batch):
    torch.manual_seed(0)
    spec = models.get(name)
    real = spec.build(**build)
    inputs = spec.batch(2, **batch)
    trace = record(real, inputs, spec.loss, steps=1, warmup=1, name=name)
    replayed = ReplayModel(trace.scaled(0.01, "fast test"), seed=3)

    # Same parameters: names in definition order, shapes, dtypes.
    assert [(n, p.shape, p.dtype) for n, p in replayed.named_parameters()] == \
        [(n, p.shape, p.dtype) for n, p in real.named_parameters()]
    # Same gradients, as the hooks see them, in the same order.
    real_seen, replayed_seen = _grads_seen(real), _grads_seen(replayed)
    real.zero_grad(set_to_none=True)
    spec.loss(real(inputs[0]), inputs[1]).backward()
    replayed(torch.zeros(1)).sum().backward()
    assert replayed_seen == real_seen
    assert [n for n, _, _ in real_seen] == [p.name for p in trace.params]


def test_dtypes_other_than_fp32_are_kept():
    real = models.get("mlp").build().to(torch.bfloat16)
    x = torch.randn(4, 1024, dtype=torch.bfloat16)
    y = torch.randint(10, (4,))
    trace = record(real, (x, y), models.get("mlp").loss, steps=1, warmup=0, name="mlp")
    assert {p.dtype for p in trace.params} == {"torch.bfloat16"}
    replayed = ReplayModel(trace.scaled(0.01, "fast test"))
    replayed(torch.zeros(1)).sum().backward()
    assert all(p.grad.dtype == torch.bfloat16 and p.grad.shape == p.shape for p in replayed.parameters())


def _trace(readies, forward=0.0):
    return ReplayTrace("toy", tuple(ReplayParam(f"layer{i}.weight", (3, 2), "torch.float32", r)
                                    for i, r in enumerate(readies)), forward)


def test_gradients_come_in_trace_order_after_the_gaps():
    trace = _trace([0.0, 0.02, 0.02, 0.05], forward=0.03)
    model = ReplayModel(trace)
    stamps = {}

    def stamp(name):
        def hook(_param):
            stamps.setdefault(name, time.perf_counter())
        return hook
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(stamp(n))
    start = time.perf_counter()
    model(torch.zeros(1)).sum().backward()
    order = sorted(stamps, key=stamps.get)
    assert order == [p.name for p in trace.params]
    # Waits never end early: each gradient comes no sooner than the trace says, counted from
    # the step's start (a late wake-up is taken off the next waits, so the schedule holds
    # from the start, not from the first gradient).
    assert all(stamps[p.name] - start >= trace.forward_time + p.ready for p in trace.params)


def test_waiting_costs_no_processor_time():
    model = ReplayModel(_trace([0.0, 0.1, 0.2], forward=0.1))
    cpu, wall = time.process_time(), time.perf_counter()
    model(torch.zeros(1)).sum().backward()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert wall >= 0.3
    assert cpu < 0.5 * wall   # sleeping, not spinning


def test_what_the_optimizer_writes_into_grad_does_not_reach_the_next_step():
    model = ReplayModel(_trace([0.0, 0.0]), seed=5)
    model(torch.zeros(1)).sum().backward()
    first = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad.mul_(0.0).add_(7.0)     # the exchange writes the average in place
        p.grad = None
    model(torch.zeros(1)).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(first, model.parameters()))


def test_ranks_draw_different_gradients():
    a = ReplayModel(_trace([0.0]), seed=0)
    b = ReplayModel(_trace([0.0]), seed=1)
    for m in (a, b):
        m(torch.zeros(1)).sum().backward()
    assert not torch.equal(a.layer0.weight.grad, b.layer0.weight.grad)


def test_clock_takes_overshoot_off_the_next_wait(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    slept = []

    def sleep(seconds):
        slept.append(seconds)
        now[0] += seconds + 0.002      # every sleep overshoots by 2 ms
    monkeypatch.setattr(time, "sleep", sleep)
    clock = Clock()
    for _ in range(3):
        clock.wait(0.010)
    clock.wait(0.001)                  # less than the debt: no sleep, debt carried
    clock.wait(0.010)
    assert slept == pytest.approx([0.010, 0.008, 0.008, 0.009])


def test_trace_round_trips_and_rescales(tmp_path):
    trace = _trace([0.0, 0.1, 0.3], forward=0.1)
    path = tmp_path / "t.json"
    trace.save(str(path))
    assert ReplayTrace.load(str(path)) == trace
    fast = trace.with_compute_time(0.2)
    assert fast.compute_time == pytest.approx(0.2)
    assert [p.name for p in fast.params] == [p.name for p in trace.params]
    small = trace.shrunk(2)
    assert [p.shape for p in small.params] == [(2, 2)] * 3 and small.extra["shrink"] == 2


def test_from_profile_takes_order_and_times_from_the_profile_and_shapes_from_the_model():
    with torch.device("meta"):
        model = models.get("mlp").build()
    named = list(model.named_parameters())
    timeline = [TensorTiming(n, p.numel(), 4 * p.numel(), "torch.float32", "cpu", 0.01 * k)
                for k, (n, p) in enumerate(reversed(named))]
    profile = Profile(world_size=2, timeline=timeline, forward_time=0.05, backward_time=timeline[-1].ready,
                      optimizer_step=0.002)
    trace = from_profile(profile, model, "mlp")
    assert [p.name for p in trace.params] == [t.name for t in timeline]
    assert [p.shape for p in trace.params] == [tuple(p.shape) for _, p in reversed(named)]
    assert trace.forward_time == 0.05 and trace.optimizer_step == 0.002
    with pytest.raises(ValueError, match="name different parameters"):
        from_profile(profile, models.get("resnet20").build(), "resnet20")


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(format="other"), "not a replay trace"),
    (lambda d: d["params"][0].update(shape=[0, 2]), "shape must be positive"),
    (lambda d: d["params"][0].update(dtype="torch.int64"), "dtype must be one of"),
    (lambda d: d["params"].reverse(), "ready order"),
    (lambda d: d.update(forward_time=-1), "forward_time must be finite"),
])
def test_bad_traces_are_refused_with_what_is_wrong(change, message):
    data = _trace([0.0, 0.1]).to_dict()
    change(data)
    with pytest.raises(ValueError, match=message):
        ReplayTrace.from_dict(data)


def test_replay_spec_builds_the_shrunk_and_scaled_model(tmp_path):
    path = tmp_path / "t.json"
    _trace([0.0, 0.2], forward=0.4).save(str(path))
    spec = replay_spec(str(path), shrink=3, time_scale=0.5)
    model = spec.build(seed=1)
    assert model.layer0.weight.shape == (1, 2)
    assert model.trace.forward_time == pytest.approx(0.2) and model.trace.backward_time == pytest.approx(0.1)
    inputs, targets = spec.batch(4, device="cpu")
    assert spec.loss(model(inputs), targets).dim() == 0


def test_compare_times_the_real_model_and_its_replay_on_the_same_ranks(tmp_path):
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "replay.py"), "compare", "--model", "resnet20",
         "--batch-size", "2", "--nproc", "2", "--threads", "1", "--compress", "--compressor", "topk",
         "--compress-ratio", "0.01", "--fusion-num", "2", "--rounds", "2", "--window", "1",
         "--num-warmup-batches", "1", "--trace-steps", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "replayed / real:" in done.stdout
    result = json.loads((tmp_path / "compare.json").read_text())
    assert result["workers"] == 2 and result["ratio"] > 0
    assert set(result["real"]["host"]) >= {"core_wait", "cpu_total"} and len(result["replayed"]["rounds_s"]) == 2
    assert json.loads((tmp_path / "manifest.json").read_text())["runs"][0]["command"].startswith("python ")
