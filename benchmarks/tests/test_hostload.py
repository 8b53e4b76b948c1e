"""The host-bound indicator: it fires when the workers' threads queue for a core, stays
quiet when they sleep, and the refusal rule reads it."""
import os
import subprocess
import sys
import time

import pytest

from benchmarks.harness import hostload
from benchmarks.harness.hostload import HostLoad, combine, host_bound

needs_schedstat = pytest.mark.skipif(hostload.available() is not None, reason=str(hostload.available()))


def _spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@needs_schedstat
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity")
def test_core_wait_fires_when_the_core_is_oversubscribed():
    core = sorted(os.sched_getaffinity(0))[0]
    before = os.sched_getaffinity(0)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                 preexec_fn=lambda: os.sched_setaffinity(0, {core})) for _ in range(2)]
    try:
        os.sched_setaffinity(0, {core})
        time.sleep(0.2)                      # the spinners are up and running
        load = HostLoad()
        load.start()
        _spin(0.4)                           # three processes want the one core
        load.stop()
    finally:
        os.sched_setaffinity(0, before)
        for process in spinners:
            process.kill()
            process.wait()
    summary = load.summary()
    assert summary["core_wait"] > 0.3        # waited well over a third of the time
    assert host_bound(combine([summary])) is not None


@needs_schedstat
def test_core_wait_stays_near_zero_while_sleeping():
    load = HostLoad()
    load.start()
    time.sleep(0.2)
    load.stop()
    summary = load.summary()
    assert summary["cpu"] < 0.5 and summary["core_wait"] < hostload.MAX_CORE_WAIT
    assert summary["wall_s"] >= 0.2


def test_windows_accumulate():
    load = HostLoad()
    for _ in range(3):
        load.start()
        time.sleep(0.01)
        load.stop()
    assert load.summary()["wall_s"] >= 0.03
    with pytest.raises(RuntimeError, match="without start"):
        load.stop()


def test_the_slowest_rank_decides():
    quiet = {"core_wait": 0.01, "cpu": 0.2, "host_pressure": 0.1, "host_busy": 0.3, "cores": 2}
    busy = dict(quiet, core_wait=0.25)
    indicator = combine([quiet, busy, quiet])
    assert indicator["core_wait"] == 0.25 and indicator["cpu_total"] == pytest.approx(0.6)
    assert host_bound(combine([quiet, quiet])) is None
    assert "host-bound" in host_bound(indicator)
    assert host_bound(indicator, max_core_wait=0.3) is None
    assert "no host-load measurement" in host_bound(None)
    with pytest.raises(ValueError, match="max_core_wait must be > 0"):
        host_bound(indicator, max_core_wait=0)
