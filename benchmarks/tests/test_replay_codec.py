"""Replayed compression: the real compressor's payloads, sizes and checks, its cost waited
instead of computed."""
import time

import pytest
import torch

import mergecomp
from benchmarks.harness.replay.codec import ResultCache, replayed
from benchmarks.harness.scaling import gpu_codec
from mergecomp.compressors.sparsifier import SparseCompressor
from mergecomp.planning.profile import CodecCost, LinearCost, WireSize

COST = CodecCost(LinearCost(0.001, 1e-9), LinearCost(0.0005, 1e-9), WireSize(None, 0.0), add=LinearCost(0.0, 1e-9))


@pytest.fixture
def waits(monkeypatch):
    """Every sleep the replayed codec asks for (none actually slept)."""
    asked = []
    monkeypatch.setattr(time, "sleep", asked.append)
    return asked


def test_a_replayed_topk_is_a_topk_and_sends_the_real_payload(waits):
    real = mergecomp.compressors.create("topk", compress_ratio=0.01)
    twin = replayed(mergecomp.compressors.create("topk", compress_ratio=0.01), COST)
    assert isinstance(twin, type(real)) and isinstance(twin, SparseCompressor)
    assert twin.compress_ratio == 0.01 and twin.sums_in_place and not twin.summable
    g = torch.randn(10_000)
    expected, _ = real.compress(g, "group0")
    first, ctx = twin.compress(g, "group0")
    again, _ = twin.compress(torch.randn(10_000), "group0")
    for a, b, c in zip(expected, first, again):
        assert a.shape == b.shape == c.shape and a.dtype == b.dtype == c.dtype
        assert torch.equal(b, c)        # the first step's payload, sent again
    # The first call computes, then waits what is left of the cost; the second only waits.
    assert len(waits) <= 2 and all(w <= COST.encode(10_000) for w in waits)
    assert waits[-1] == pytest.approx(COST.encode(10_000), rel=0.5)
    first[0].zero_()                    # what the caller does to a payload stays with it
    assert not torch.equal(twin.compress(g, "group0")[0][0], first[0])


def test_sums_and_decodes_wait_their_cost_and_write_into_a_lent_buffer(waits):
    twin = replayed(mergecomp.compressors.create("topk", compress_ratio=0.01), COST)
    payloads = [twin.compress(torch.randn(5_000), "g")[0] for _ in range(3)]
    ctx = twin.compress(torch.randn(5_000), "g")[1]
    waits.clear()
    total = twin.decompress_sum(payloads, ctx)
    out = torch.empty(5_000)
    again = twin.decompress_sum(payloads, ctx, out=out)
    assert again.data_ptr() == out.data_ptr() and torch.equal(again, total)
    assert waits[-1] == pytest.approx(COST.decode(5_000) + 2 * COST.add(5_000), rel=0.5)
    assert twin.decompress(payloads[0], ctx).shape == total.shape


def test_powersgd_rounds_replay_the_same_collectives(waits):
    make = lambda: mergecomp.compressors.create("powersgd", rank=2)
    twin = replayed(make(), COST)
    grad = torch.randn(64, 32)
    layout = (mergecomp.compressors.base.ParamView("w", torch.Size([64, 32]), 0),)

    def run(compressor):
        shapes = []
        rounds = compressor.rounds(grad.reshape(-1), "g", layout=layout)
        request = next(rounds)
        while True:
            shapes.append([tuple(t.shape) for t in request.tensors])
            try:
                request = rounds.send(tuple(t.clone() for t in request.tensors))
            except StopIteration as stop:
                return shapes, stop.value

    real_shapes, _ = run(make())
    first_shapes, first = run(twin)
    again_shapes, again = run(twin)
    assert real_shapes == first_shapes == again_shapes and len(real_shapes) == 2
    assert torch.equal(first, again)


def test_the_gpu_table_prices_the_campaigns_compressors_and_refuses_others():
    for name in ("topk", "fp16", "powersgd", "dgc"):
        cost = gpu_codec(name)
        assert cost.encode(25_000_000) > cost.encode(1_000_000) > 0
    with pytest.raises(ValueError, match="no row for compressor 'atomo'"):
        gpu_codec("atomo")
    with pytest.raises(ValueError, match="time scale must be > 0"):
        replayed(mergecomp.compressors.create("fp16"), COST, time_scale=0)


def test_compress_benchmark_trains_a_replay_with_replayed_codecs_through_the_sparse_allreduce(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from benchmarks.harness.replay import ReplayParam, ReplayTrace
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    trace = ReplayTrace("toy", tuple(ReplayParam(f"layer{i}.weight", (64, 100), "torch.float32", 0.002 * i)
                                     for i in range(6)), forward_time=0.005, unit="sample", batch_size=4)
    trace.save(str(tmp_path / "trace.json"))
    out = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, os.path.join(root, "compress_benchmark.py"), "--nproc", "2", "--threads", "1",
         "--replay", str(tmp_path / "trace.json"), "--replay-codecs", "gpu", "--compress", "--compressor", "topk",
         "--compress-ratio", "0.05", "--comm", "sparse_allreduce", "--fusion-num", "2", "--num-warmup-batches", "1",
         "--num-batches-per-iter", "2", "--num-iters", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["model"] == "replay:toy" and result["num_params"] == 6 * 6400 and result["groups"] == 2
    assert "ReplayedTopKCompressor" in done.stdout


def test_a_replay_runs_without_the_quality_controller_unless_asked():
    """A replay's gradients repeat every step and its codecs resend the first payload, so
    the controller would read a lag no model shows and raise the bytes a timing run sends."""
    import argparse
    from benchmarks.harness.flags import controller_setting
    assert controller_setting(argparse.Namespace(replay="trace.json", controller=None)) == "off"
    assert controller_setting(argparse.Namespace(replay=None, controller=None)) == "auto"
    assert controller_setting(argparse.Namespace(replay="trace.json", controller="on")) == "auto"
    assert controller_setting(argparse.Namespace(replay=None, controller="off")) == "off"


def test_the_replayed_results_are_bounded_and_the_least_recently_used_go_first():
    cache = ResultCache(limit_bytes=3 * 4000)
    for key in "abc":
        cache[key] = torch.zeros(1000)            # 4,000 bytes each: all three fit
    assert cache["a"].numel() == 1000              # "a" used: "b" is now the oldest
    cache["d"] = (torch.zeros(1000), torch.zeros(0, dtype=torch.int64))
    assert "b" not in cache and all(k in cache for k in "acd") and cache.nbytes == 3 * 4000
    cache["huge"] = torch.zeros(10_000)            # larger than the bound: kept alone, the newest
    assert len(cache) == 1 and "huge" in cache


def test_a_search_through_many_group_sizes_keeps_the_replayed_codec_within_its_bound(waits):
    twin = replayed(mergecomp.compressors.create("topk", compress_ratio=0.01), COST, cache_mb=1)
    for numel in range(50_000, 150_000, 5_000):   # 20 groupings, as an adaptive search tries
        payload, ctx = twin.compress(torch.randn(numel), f"group{numel}")
        twin.decompress_sum([payload, payload], ctx)
    assert twin._cache.nbytes <= 2 ** 20 and len(twin._cache) < 40
    # The dense results: one buffer, the largest group's, whatever the number of sizes tried.
    assert [t.numel() for t in twin._dense_results.values()] == [145_000]
    with pytest.raises(ValueError, match="> 0 MiB"):
        replayed(mergecomp.compressors.create("topk"), COST, cache_mb=0)


def test_a_replayed_worker_trims_its_heap_at_most_once_per_interval():
    from benchmarks.harness.replay.heap import HeapTrimmer, release_free_heap
    now, calls = [0.0], []
    trimmer = HeapTrimmer(every_s=30, clock=lambda: now[0], trim=lambda: calls.append(now[0]) or True)
    for t in (0.0, 10.0, 29.9, 30.0, 45.0, 61.0):
        now[0] = t
        trimmer.maybe()
    assert calls == [0.0, 30.0, 61.0] and trimmer.trims == 3
    assert release_free_heap() in (True, False)  # glibc here; elsewhere a no-op, never an error
