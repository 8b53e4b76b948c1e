"""The emulated cluster: profile parsing, namespace lifecycle, shaped allreduce, crash cleanup.

The namespace tests need root and ``ip netns``; they are skipped (with the reason) elsewhere.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings

import pytest

from benchmarks.harness import cluster as cl
from benchmarks.harness.cluster import Cluster, check_allreduce, cleanup_leftovers, netns_support
from benchmarks.harness.profiles import PROFILES, load_profiles, parse_delay, parse_profile, parse_rate

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_NETNS_REASON = netns_support()
needs_netns = pytest.mark.skipif(_NETNS_REASON is not None, reason=str(_NETNS_REASON))


def _netns_names():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.split()}


def _host_links():
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip() for line in out.splitlines() if ":" in line}


# ---------------------------------------------------------------- profiles

def test_named_profiles():
    assert parse_profile("1gbit").rate_bps == 1e9
    assert parse_profile("loopback").rate_bps is None and not parse_profile("loopback").shaped
    assert parse_profile("pcie").rate_bps == 128e9 and not parse_profile("pcie").cpu_emulable
    assert not parse_profile("nvlink").cpu_emulable
    assert {"loopback", "100mbit", "1gbit", "10gbit"} <= set(PROFILES)


def test_adhoc_specs_and_units():
    profile = parse_profile("rate=500mbit,delay=1ms")
    assert profile.rate_bps == 500e6 and profile.delay_s == pytest.approx(1e-3)
    assert parse_profile(" rate=2gbit ").delay_s == 0
    assert parse_profile("250mbit").rate_bps == 250e6
    assert parse_rate("16gbps") == 128e9          # tc convention: bps = bytes per second
    assert parse_rate("1.5kbit") == 1500
    assert parse_delay("250us") == pytest.approx(250e-6) and parse_delay("0") == 0


@pytest.mark.parametrize("spec, fragment", [
    ("fastest", "'fastest'"),                       # unknown name lists the known ones
    ("rate=500mbps,delay=1parsec", "1parsec"),
    ("rate=12qbit", "12qbit"),
    ("delay=1ms", "needs rate"),
    ("rate=1gbit,speed=3", "speed=3"),
    ("rate=1gbit,rate=2gbit", "rate=2gbit"),
    ("rate=0mbit", "0mbit"),
    ("", "''"),
])
def test_bad_specs_name_the_value(spec, fragment):
    with pytest.raises(ValueError) as err:
        parse_profile(spec)
    assert fragment in str(err.value)


def test_load_profiles_extends_table(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("wan:\n  rate: 200mbit\n  delay: 20ms\nlocal:\n  rate: null\n")
    table = load_profiles(str(path))
    assert table["wan"].rate_bps == 200e6 and table["wan"].delay_s == pytest.approx(0.02)
    assert not table["local"].shaped and "1gbit" in table
    assert parse_profile("wan", table).name == "wan"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"wan": {"rate": "200mbit", "jitter": "1ms"}}))
    with pytest.raises(ValueError, match="jitter"):
        load_profiles(str(bad))


def test_cluster_argument_errors():
    with pytest.raises(ValueError, match="num_workers"):
        Cluster(0, "loopback")
    with pytest.raises(RuntimeError, match="set-up"):
        Cluster(1, "loopback").run(["true"])


# ---------------------------------------------------------------- loopback (no root needed)

_ENV_SCRIPT = ("import json, os; print(json.dumps({k: os.environ[k] for k in ('RANK', "
               "'WORLD_SIZE', 'MASTER_ADDR', 'GLOO_SOCKET_IFNAME', 'EXTRA')}))")


def test_loopback_runs_every_rank_with_its_env():
    with Cluster(2, "loopback") as cluster:
        results = cluster.run([sys.executable, "-c", _ENV_SCRIPT], timeout_s=60,
                              env={"EXTRA": "x"})
    assert results.ok, results.failure
    envs = [json.loads(stdout) for _, stdout, _ in results]
    assert [env["RANK"] for env in envs] == ["0", "1"]
    assert all(env["MASTER_ADDR"] == "127.0.0.1" and env["EXTRA"] == "x" for env in envs)


# ---------------------------------------------------------------- namespaces

@needs_netns
def test_setup_and_teardown_leave_nothing_behind():
    links_before = _host_links()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Cluster(2, "rate=100mbit,delay=2ms") as cluster:
            assert set(cluster.namespaces) <= _netns_names()
            qdisc = subprocess.run(["ip", "netns", "exec", cluster.worker_ns(1), "tc", "qdisc",
                                    "show", "dev", "eth0"], capture_output=True, text=True).stdout
            assert "tbf" in qdisc and "100Mbit" in qdisc
            if cluster.delay_emulated:  # kernels with sch_netem: 1 ms on each end of the link
                assert "netem" in qdisc and "delay 1ms" in qdisc
            else:
                assert any("delay 2ms is NOT emulated" in str(w.message) for w in caught)
            qdisc = subprocess.run(["ip", "netns", "exec", cluster.switch_ns, "tc", "qdisc",
                                    "show", "dev", "p1"], capture_output=True, text=True).stdout
            assert "tbf" in qdisc and "100Mbit" in qdisc
            results = cluster.run([sys.executable, "-c", _ENV_SCRIPT], timeout_s=60,
                                  env={"EXTRA": ""})
            assert results.ok, results.failure
            env = json.loads(results[1].stdout)
            assert env["MASTER_ADDR"] == cluster.addresses[0]
            assert env["GLOO_SOCKET_IFNAME"] == "eth0"
            made = list(cluster.namespaces)
    assert not set(made) & _netns_names()
    assert _host_links() == links_before  # nothing was ever made in the host namespace


@needs_netns
@pytest.mark.filterwarnings("ignore:this kernel has no sch_netem")
def test_shaped_allreduce_is_held_to_the_line_rate():
    with Cluster(2, "10mbit") as cluster:
        report = check_allreduce(cluster, mbytes=2, iters=1, timeout_s=120)
    ratio = report["seconds"][0] / report["expected_s"]
    assert report["expected_s"] == pytest.approx(1.6, rel=0.01)   # 2 MB each way at 10 Mbit/s
    # The shaping holds: no faster than the link (less the token bucket's burst).  No upper
    # bound: a busy machine only makes it slower, which says nothing about the shaping.
    assert ratio > 0.5, report


_ALLTOALL_SCRIPT = (
    "import torch, torch.distributed as dist\n"
    "torch.set_num_threads(1)\n"
    "dist.init_process_group('gloo')\n"
    "n = dist.get_world_size()\n"
    "data = torch.zeros(n * 50000)\n"  # 200 kB to every peer at once: the fan-out that overflowed
    "for _ in range(2):\n"
    "    dist.all_to_all_single(torch.empty_like(data), data)\n"
    "dist.barrier()\n"
    "dist.destroy_process_group()\n")


def _dropped(ns: str, dev: str) -> int:
    out = subprocess.run(["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev],
                         capture_output=True, text=True).stdout
    return sum(int(count) for count in re.findall(r"dropped (\d+)", out))


@needs_netns
def test_a_workers_own_link_never_drops_what_its_tcp_sent():
    """Every worker sends to all its peers at once (an all-to-all): its TCP must be held back
    before its shaped link's queue overflows, as a NIC holds back its host's sockets, so no
    segment is dropped on the worker's side; the switch's ports queue the incast instead of
    dropping it."""
    with Cluster(4, "rate=8mbit") as cluster:
        limits = cluster.sender_limits()
        assert limits == {"tcp_limit_output_bytes": 8192, "gso_max_size": 16384}
        ns = cluster.worker_ns(2)
        setting = subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-n", "net.ipv4.tcp_limit_output_bytes"],
                                 capture_output=True, text=True).stdout.strip()
        host = open("/proc/sys/net/ipv4/tcp_limit_output_bytes").read().strip()
        if setting != "8192":  # a kernel that keeps it host-wide: the cluster left both alone
            pytest.skip(f"net.ipv4.tcp_limit_output_bytes is host-wide on this kernel ({host})")
        assert host != "8192" or setting == host
        results = cluster.run([sys.executable, "-c", _ALLTOALL_SCRIPT], timeout_s=240)
        assert results.ok, results.failure
        assert [_dropped(cluster.worker_ns(r), "eth0") for r in range(4)] == [0, 0, 0, 0]
        assert [_dropped(cluster.switch_ns, f"p{r}") for r in range(4)] == [0, 0, 0, 0]


@needs_netns
def test_crashing_worker_is_reported_and_cleaned_up():
    crash = ("import os, sys, time\n"
             "if os.environ['RANK'] == '1': sys.exit(3)\n"
             "time.sleep(60)\n")
    with Cluster(2, "rate=100mbit") as cluster:
        results = cluster.run([sys.executable, "-c", crash], timeout_s=60)
        made = list(cluster.namespaces)
    # the sleeping rank was stopped because rank 1 failed, not at the timeout
    assert not results.ok and "rank 1 exited with code 3" in results.failure
    assert "timeout" not in results[0].note
    assert results[1].returncode == 3
    assert results[0].returncode != 0 and "rank 1 failed" in results[0].note
    assert not set(made) & _netns_names()


@needs_netns
def test_sigterm_removes_namespaces():
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "benchmarks", "cluster.py"),
                             "--workers", "2", "--profile", "rate=100mbit", "--", "sleep", "30"],
                            stderr=subprocess.PIPE, text=True)
    prefix = f"mc{proc.pid}-"
    deadline = time.monotonic() + 120  # a guard against a hang, not a timing
    while sum(name.startswith(prefix) for name in _netns_names()) < 3:
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
        time.sleep(0.1)
    time.sleep(0.3)  # let the workers start
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    assert not any(name.startswith(prefix) for name in _netns_names())


@needs_netns
def test_cleanup_removes_only_dead_runs():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True)
    dead_name = f"mc{int(dead.stdout)}-0-w0"
    live_name = f"mc{os.getpid()}-999-w0"
    for name in (dead_name, live_name):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        removed = cleanup_leftovers()
        assert dead_name in removed and live_name not in removed
        assert live_name in _netns_names() and dead_name not in _netns_names()
    finally:
        for name in (dead_name, live_name):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_without_root_the_reason_mentions_loopback(monkeypatch):
    monkeypatch.setattr(cl.os, "geteuid", lambda: 1000)
    reason = netns_support()
    assert "root" in reason and "loopback" in reason
    with pytest.raises(cl.ClusterUnavailable, match="loopback"):
        with Cluster(2, "1gbit"):
            pass
