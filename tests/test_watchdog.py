"""Bounded waiting: timeouts, progress beacons, and what a rank sees when another stops.

The multi-rank tests use short timeouts (a few seconds) and check that the survivors fail
within a bounded time with an error naming the rank that stopped.
"""
import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from mergecomp.distributed import launch, watchdog
from mergecomp.distributed.backends.torch_dist import TorchDistributedBackend
from mergecomp.distributed.watchdog import Beacon, CollectiveTimeout, PeerLost
from tests.distributed import run_ranks

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLOO_TIMEOUT = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms "
                            "for recv operation to complete")
GLOO_CLOSED = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                           "[127.0.0.1]:4242. This is typically caused by a remote worker crashing.")


# ----------------------------------------------------------------------------- the timeout

def test_collective_timeout_comes_from_the_argument_the_environment_or_the_default():
    assert launch.collective_timeout(7, "gloo", {"MERGECOMP_TIMEOUT": "99"}) == 7.0
    assert launch.collective_timeout(None, "gloo", {"MERGECOMP_TIMEOUT": "12.5"}) == 12.5
    assert launch.collective_timeout(None, "gloo", {}) == launch.DEFAULT_TIMEOUT_S["gloo"] < 300
    assert launch.collective_timeout(None, "nccl", {}) == launch.DEFAULT_TIMEOUT_S["nccl"]


@pytest.mark.parametrize("value", ["0", "-3", "abc", "inf", "nan"])
def test_a_bad_timeout_variable_is_named_with_its_value(value):
    with pytest.raises(ValueError, match=f"MERGECOMP_TIMEOUT must be a positive number of seconds, "
                                         f"got '{value}'"):
        launch.collective_timeout(None, "gloo", {"MERGECOMP_TIMEOUT": value})


@pytest.mark.parametrize("value", [0, -1, float("inf"), True, "10"])
def test_a_bad_timeout_argument_is_refused(value):
    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds"):
        launch.collective_timeout(value)


def _timeout_set_by_init():
    info = launch.init_distributed()
    group = dist.distributed_c10d._get_default_group()
    backend = group._get_backend(torch.device("cpu"))
    return info.world_size, backend.options._timeout.total_seconds(), watchdog.configured_timeout_s


def test_init_distributed_applies_the_environment_timeout(monkeypatch):
    monkeypatch.setenv("MERGECOMP_TIMEOUT", "7")
    assert launch.spawn(_timeout_set_by_init, 1, timeout_s=120) == [(1, 7.0, 7.0)]


# ----------------------------------------------------------------------------- beacons

def _beacons(world_size):
    store = dist.HashStore()
    return store, [Beacon(store, r, world_size) for r in range(world_size)]


def test_beacons_record_steps_departures_and_failures():
    store, (zero, one, two) = _beacons(3)
    zero.mark(5, collectives=40)
    one.mark(2, collectives=16)
    one.leave()
    two.fail("HeaderError in alltoall: rank 1 sent a header\nmore lines")
    seen = zero.read()
    assert (seen[0].state, seen[0].step, seen[0].collectives) == ("running", 5, 40)
    assert (seen[1].state, seen[1].step) == ("left", 2)
    assert seen[2].state == "failed" and seen[2].note == "HeaderError in alltoall: rank 1 sent a header"
    assert zero.left_count() == 1
    two.leave()  # a failed rank stays failed, and is counted as gone
    assert zero.read()[2].state == "failed" and zero.left_count() == 2


def test_a_beacon_whose_store_is_gone_stops_writing():
    class Gone:
        def set(self, *args):
            raise RuntimeError("Broken pipe")

        add = set

    beacon = Beacon(Gone(), 0, 2)
    assert beacon.unreachable == "RuntimeError: Broken pipe"
    beacon.mark(1)
    beacon.leave()  # no exception: the collectives report the failure


@pytest.mark.parametrize("error, kind", [
    (GLOO_TIMEOUT, CollectiveTimeout),
    (RuntimeError("Application timeout caused pair closure"), CollectiveTimeout),
    (GLOO_CLOSED, PeerLost),
    (RuntimeError("Connection reset by peer"), PeerLost),
    (RuntimeError("some other failure"), None),
    (ValueError("Timed out"), None),  # not from the network library
])
def test_network_errors_are_classified(error, kind):
    assert watchdog.classify(error) is kind


def test_a_timeout_names_the_rank_behind_and_says_what_to_do(monkeypatch):
    monkeypatch.setattr(watchdog, "configured_timeout_s", 5.0)
    store, (zero, one, two) = _beacons(3)
    zero.mark(7, collectives=60)
    one.mark(4, collectives=30)
    two.mark(7, collectives=61)
    error = watchdog.explain(GLOO_TIMEOUT, "allreduce", zero, 0, 3, collectives=63)
    assert isinstance(error, CollectiveTimeout) and error.behind == [1] and error.step == 7
    message = str(error)
    for expected in ("allreduce (rank 0 of 3, collective 3 of step 7) timed out after 5s",
                     "Ranks behind: [1]", "rank 1", "last reported at step 4 (after 30 collectives)",
                     "Ranks [1] are still at an earlier step",
                     "MERGECOMP_TIMEOUT=<seconds>", "init_distributed(timeout_s=...)",
                     "Timed out waiting 5000ms"):
        assert expected in message, (expected, message)
    assert zero.read()[0].state == "failed"  # the others learn why this rank stopped


def test_a_lost_peer_that_left_is_named_with_advice_on_even_steps():
    store, (zero, one) = _beacons(2)
    zero.mark(3)
    one.mark(2)
    one.leave()
    error = watchdog.explain(GLOO_CLOSED, "allgather", zero, 0, 2, collectives=9)
    assert isinstance(error, PeerLost) and error.behind == [1]
    assert "left the job at step 2" in str(error) and "same number of steps" in str(error)


def test_ranks_failing_as_a_consequence_are_not_blamed():
    store, (zero, one, two) = _beacons(3)
    for beacon in (zero, one, two):
        beacon.mark(3)
    one.fail("PeerLost in allreduce at step 3")  # it lost rank 2, as this rank did
    two.leave()
    error = watchdog.explain(GLOO_CLOSED, "allreduce", zero, 0, 3, collectives=5)
    assert error.behind == [2]


def test_same_step_everywhere_points_at_different_collectives():
    store, (zero, one) = _beacons(2)
    zero.mark(3)
    one.mark(3)
    message = str(watchdog.explain(GLOO_TIMEOUT, "allgather", zero, 0, 2, collectives=5))
    assert "No rank is behind" in message and "different communicator, compressor or plan" in message


def test_a_store_that_cannot_be_read_is_reported():
    class Unreadable(dist.HashStore):
        def check(self, keys):
            raise RuntimeError("Failed to recv, got 0 bytes. Connection was likely closed.")

    beacon = Beacon(Unreadable(), 0, 2)
    message = str(watchdog.explain(GLOO_CLOSED, "allreduce", beacon, 0, 2, collectives=1))
    assert "could not be read" in message and "rank 0 has probably exited" in message


def test_a_rank_that_never_reported_is_behind():
    store, (zero,) = _beacons(1)
    zero.world_size = 2  # rank 1 never built its backend
    zero.mark(0)
    error = watchdog.explain(GLOO_TIMEOUT, "allreduce", zero, 0, 2, collectives=1)
    assert error.behind == [1] and "never reported progress" in str(error)


# ----------------------------------------------------------------------------- real ranks

def _short_timeout(seconds):
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))
    watchdog.configured_timeout_s = seconds


def stop_early_worker(rank, world_size, early, mode):
    """Every rank runs steps of one allreduce; ``early`` stops after two steps."""
    _short_timeout(4)
    backend = TorchDistributedBackend()
    steps = 2 if rank == early else 6
    try:
        for step in range(steps):
            backend.mark_step(step)
            backend.allreduce_async([torch.ones(8)]).wait()
    except (CollectiveTimeout, PeerLost) as error:
        launch.shutdown(linger_s=5)  # what the exit handler does when the error ends a script
        return type(error).__name__, error.behind, str(error)
    if mode == "leave":
        launch.shutdown(linger_s=5)
    else:  # "stall": alive, but no longer taking part
        time.sleep(6)
    return "early", [], ""


@pytest.mark.parametrize("early", [1, 0])
def test_a_rank_that_leaves_makes_the_others_fail_at_once_naming_it(early):
    results = run_ranks(stop_early_worker, 3, early, "leave", timeout=90)
    for rank, (kind, behind, message) in enumerate(results):
        if rank == early:
            continue
        # at once: the connection closed (PeerLost), no collective waited for its 4 s timeout
        assert kind == "PeerLost" and early in behind, message
        assert f"rank {early}" in message and "left the job at step 1" in message, message


def test_a_rank_that_stalls_makes_the_others_time_out_naming_it():
    results = run_ranks(stop_early_worker, 3, 2, "stall", timeout=90)  # 90: a hang guard
    for kind, behind, message in results[:2]:
        assert kind in ("CollectiveTimeout", "PeerLost") and 2 in behind, message
        assert "rank 2" in message and "at step 1" in message, message
    # the wait ended at the configured timeout, which the message names
    timeouts = [message for kind, _, message in results[:2] if kind == "CollectiveTimeout"]
    assert timeouts and all("timed out after 4s" in message for message in timeouts), timeouts


EARLY_EXIT_SCRIPT = """
import sys, time, torch
from mergecomp.distributed import launch
from mergecomp.distributed.backends.torch_dist import TorchDistributedBackend
info = launch.init_distributed(timeout_s=5)
backend = TorchDistributedBackend()
steps = 2 if info.rank == 1 else 6
for step in range(steps):
    backend.mark_step(step)
    backend.allreduce_async([torch.ones(4)]).wait()
print(f"RANK {info.rank} LEFT", flush=True)
"""  # rank 1 simply ends: no shutdown() call, the exit handler does it


def test_a_script_that_ends_early_exits_and_the_others_fail_within_seconds(tmp_path):
    script = tmp_path / "early.py"
    script.write_text(EARLY_EXIT_SCRIPT)
    port = launch.free_port()
    processes = []
    for rank in range(2):
        env = dict(os.environ, PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1", RANK=str(rank),
                   WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.pop("MERGECOMP_LAUNCHER", None)
        env.pop("TORCHELASTIC_RUN_ID", None)
        processes.append(subprocess.Popen([sys.executable, str(script)], env=env, cwd=REPO_ROOT,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outputs = [p.communicate(timeout=120) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    (out0, err0), (out1, err1) = outputs
    assert processes[1].returncode == 0 and "RANK 1 LEFT" in out1, err1
    assert processes[0].returncode != 0 and "RANK 0 LEFT" not in out0
    # told at once: its peer's connection closed (PeerLost), not the 5 s collective timeout
    assert "mergecomp.distributed.watchdog.PeerLost" in err0 and "CollectiveTimeout" not in err0, err0
    assert "rank 1" in err0 and "left the job at step 1" in err0, err0


