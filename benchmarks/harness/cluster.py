"""An emulated cluster on one Linux host: N workers, each in its own network namespace, or
M nodes of L workers each, the workers of one node sharing its namespace.

Why: compressed training only pays off when the network is the bottleneck, and a laptop's
loopback is not.  This tool puts every worker behind a shaped link so that every byte of every
collective crosses a wire of known rate and latency.

Topology (all of it inside namespaces named ``mc<pid>-<k>-*``; nothing is created in the host
namespace, so no host route or address changes)::

    mc<pid>-<k>-w0 [eth0 10.213.n.1] ==veth== [p0]-+
    mc<pid>-<k>-w1 [eth0 10.213.n.2] ==veth== [p1]-+- br0   (in namespace mc<pid>-<k>-sw)
    ...                                            |

Nodes (``workers_per_node=L``): each ``w<i>`` namespace is node i and holds L workers that
share its address and its shaped link, as the GPUs of a machine share its NIC; between
them traffic stays inside the namespace (the kernel routes a namespace's own address over
its loopback), unshaped: the fast link of a node.  Each worker gets torchrun's layout
variables (LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK), rank = node · L + local rank.

Shaping: a token bucket (``tc tbf``) at the profile's rate on the egress of BOTH ends of each
veth: the worker's ``eth0`` limits what it sends, the switch-side ``p<i>`` limits what it
receives.  So ``rate`` is a full-duplex per-worker link, like a NIC on a non-blocking switch.
The one-way delay is split over the two ends with ``netem`` when the kernel has ``sch_netem``;
without it the cluster warns and shapes the rate only.

A shaper must not drop what the worker's own TCP hands it.  A host's NIC pushes back on its
sockets instead (TCP small queues hold about 1 ms of line rate per socket in the queue); but
the kernel sizes that allowance, and its segmentation-offload packets (up to 64 KiB), for
fast links, so behind a slow token bucket a worker talking to several peers at once (an
all-to-all, an allgather's first steps) overflows its own bucket, and tbf silently drops the
segments of an oversized packet that TCP already counted as sent: retransmissions and
retransmission timeouts that no network would show (docs/design.md#emulated-links has the
measurement).  So each worker namespace gets the allowance of its emulated link,
``tcp_limit_output_bytes`` = 1 ms of the rate (at least 8 KiB), and packets no larger than
the bucket (``gso_max_size``): then the worker's bucket drops nothing.  Where the kernel
keeps that sysctl host-wide (older than per-namespace TCP settings) it is left alone, with a
warning.

Workers rendezvous with torch.distributed's env:// convention (MASTER_ADDR is worker 0's
address, GLOO_SOCKET_IFNAME is ``eth0``), so gloo traffic goes over the shaped links.
The ``loopback`` profile runs the workers in the host namespace over 127.0.0.1, unshaped, and
needs neither root nor iproute2.

Everything created is removed on exit, Ctrl-C, SIGTERM and worker crashes; a run killed with
SIGKILL leaves namespaces that ``python benchmarks/cluster.py --cleanup`` removes.

API::

    from benchmarks.harness.cluster import Cluster, PROFILES, parse_profile
    with Cluster(num_workers=4, profile="1gbit", workers_per_node=2) as cluster:
        results = cluster.run([sys.executable, "train.py"], timeout_s=600)
        for returncode, stdout, stderr in results: ...
"""
from __future__ import annotations

import atexit
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

from . import iproute2_bundle
from .profiles import PROFILES, Profile, format_delay, format_rate, load_profiles, parse_profile

__all__ = ["Cluster", "ClusterUnavailable", "PROFILES", "Profile", "RunResults", "WorkerResult",
           "check_allreduce", "cleanup_leftovers", "format_results", "load_profiles", "netns_support",
           "parse_profile"]

_NS_PATTERN = re.compile(r"^mc(\d+)-\d+-(sw|w\d+)$")
_SUBNET_BASE = "10.213"
_IFNAME = "eth0"
_run_counter = itertools.count()


class ClusterUnavailable(RuntimeError):
    """Raised when namespaces cannot be made here; the message says why and what to do."""


# ---------------------------------------------------------------- host capabilities

def _ip(*args: str, ns: Optional[str] = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``ip``/``tc`` (``args[0]``), inside namespace ``ns`` when given."""
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n"
                           f"{proc.stderr.strip()}")
    return proc


def _bucket_bytes(rate_bps: float) -> int:
    """A shaped link's token bucket: 1 ms of line rate, at least 16 KiB (a few full frames)."""
    return max(16384, int(rate_bps / 8 * 1e-3))


def _ensure_iproute2() -> None:
    """Find iproute2: on the PATH, carried (:func:`.iproute2_bundle.put_on_path`), or installed with
    apt-get when root; raise if none of these works."""
    if shutil.which("ip") and shutil.which("tc"):
        return
    carried = iproute2_bundle.put_on_path()
    if carried:
        print(f"cluster: using the iproute2 carried in {carried}", file=sys.stderr)
        return
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print("cluster: iproute2 (ip, tc) missing; installing it with apt-get", file=sys.stderr)
        proc = subprocess.run(["apt-get", "install", "-y", "iproute2"], capture_output=True,
                              text=True)
        if proc.returncode == 0 and shutil.which("ip") and shutil.which("tc"):
            return
        raise ClusterUnavailable(f"iproute2 (ip, tc) is missing and 'apt-get install -y "
                                 f"iproute2' failed:\n{proc.stderr.strip()[-500:]}\n"
                                 f"Install it yourself, or use --profile loopback (unshaped).")
    raise ClusterUnavailable("iproute2 (the 'ip' and 'tc' commands) is not installed; install "
                             "it as root (apt-get install iproute2), carry it from a host that has it "
                             "(benchmarks/harness/iproute2_bundle.py build/iproute2), or use --profile "
                             "loopback (unshaped).")


def netns_support() -> Optional[str]:
    """None when this host can make namespaces; otherwise the reason it cannot.

    The only reliable test is to try: add and delete a scratch namespace.
    """
    if os.geteuid() != 0:
        return (f"network namespaces need root (running as uid {os.geteuid()}); run as root, "
                f"or use --profile loopback (unshaped)")
    try:
        _ensure_iproute2()
    except ClusterUnavailable as err:
        return str(err)
    name = f"mc{os.getpid()}-{next(_run_counter)}-w0"
    proc = _ip("ip", "netns", "add", name, check=False)
    if proc.returncode != 0:
        return (f"'ip netns add' failed here ({proc.stderr.strip()}); this host or container "
                f"does not allow network namespaces; use --profile loopback (unshaped)")
    _ip("ip", "netns", "del", name, check=False)
    return None


def _pick_subnet() -> str:
    """First 10.213.<n>.0/24 that overlaps no route or address the host already has."""
    taken = []
    for args in (("-4", "-o", "route", "show", "table", "all"), ("-4", "-o", "addr", "show")):
        for word in _ip("ip", *args, check=False).stdout.split():
            try:
                taken.append(ipaddress.ip_network(word, strict=False))
            except ValueError:
                continue
    for n in range(256):
        net = ipaddress.ip_network(f"{_SUBNET_BASE}.{n}.0/24")
        if not any(net.overlaps(other) for other in taken if other.prefixlen > 0):
            return f"{_SUBNET_BASE}.{n}"
    raise ClusterUnavailable(f"every {_SUBNET_BASE}.<n>.0/24 overlaps a host route; "
                             f"free one of them or use --profile loopback")


def _pid_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (killed, not yet reaped) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            state = handle.read().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _kill_namespace_processes(ns: str) -> None:
    """SIGKILL whatever still runs inside ``ns`` (orphans of a crashed run)."""
    for word in _ip("ip", "netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(word), signal.SIGKILL)
        except (ValueError, ProcessLookupError, PermissionError):
            pass


def cleanup_leftovers(include_live: bool = False) -> List[str]:
    """Remove the namespaces (and with them their veths and bridges) of crashed runs.

    Only names of this tool (``mc<pid>-<k>-sw|w<i>``) are touched, and only those whose creating
    process is gone, unless ``include_live``.  Returns the names removed.
    """
    removed = []
    for line in _ip("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NS_PATTERN.match(name)
        if not match or (not include_live and _pid_alive(int(match.group(1)))):
            continue
        _kill_namespace_processes(name)
        if _ip("ip", "netns", "del", name, check=False).returncode == 0:
            removed.append(name)
    return removed


# ---------------------------------------------------------------- results

@dataclass
class WorkerResult:
    """What one worker did.  Unpacks as ``returncode, stdout, stderr``.

    ``returncode`` is None when the worker was never started; negative when killed by a signal.
    ``note`` says why the run stopped it (another rank failed, timeout), empty otherwise.
    """

    rank: int
    returncode: Optional[int]
    stdout: str
    stderr: str
    note: str = ""

    def __iter__(self):
        return iter((self.returncode, self.stdout, self.stderr))


class RunResults(list):
    """Per-rank WorkerResults; ``failure`` describes the first failure (None when all passed)."""

    def __init__(self, results: Sequence[WorkerResult], failure: Optional[str]):
        super().__init__(results)
        self.failure = failure

    @property
    def ok(self) -> bool:
        return self.failure is None


# ---------------------------------------------------------------- the cluster

class Cluster:
    """N workers behind shaped links; a context manager that always removes what it made.

    ``profile``: a name from ``profiles`` (default PROFILES), an ad-hoc spec such as
    ``"rate=500mbit,delay=1ms"``, or a Profile.  ``master_port``: the rendezvous port (inside
    the namespaces any port is free; for loopback a free one is picked when None).
    ``workers_per_node``: L workers per node sharing a namespace and its link (None: one
    node per worker when shaped, every worker on one host with loopback, as before).
    """

    def __init__(self, num_workers: int, profile="loopback",
                 profiles: Optional[Mapping[str, Profile]] = None,
                 master_port: Optional[int] = None, workers_per_node: Optional[int] = None):
        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
        if workers_per_node is not None and (isinstance(workers_per_node, bool) or not isinstance(
                workers_per_node, int) or workers_per_node < 1 or num_workers % workers_per_node):
            raise ValueError(f"workers_per_node must be a positive int dividing num_workers={num_workers} "
                             f"(every node runs as many workers), got {workers_per_node!r}")
        self.profile = parse_profile(profile, profiles)
        self.workers_per_node = workers_per_node
        if self.profile.shaped and self.num_nodes_for(num_workers) > 254:
            raise ValueError(f"{self.num_nodes_for(num_workers)} nodes: a shaped cluster has one /24 "
                             f"subnet, so at most 254 nodes")
        self.num_workers = num_workers
        self.master_port = master_port
        self.prefix = f"mc{os.getpid()}-{next(_run_counter)}"
        self.namespaces: List[str] = []   # every namespace created, switch first
        self.addresses: List[str] = []
        self.delay_emulated = False
        self._procs: List[subprocess.Popen] = []
        self._saved_handlers: Dict[int, object] = {}
        self._up = False

    # -- set-up and tear-down

    def __enter__(self) -> "Cluster":
        self._install_signal_handlers()
        try:
            self.setup()
        except BaseException:
            self.teardown()
            self._restore_signal_handlers()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.teardown()
        finally:
            self._restore_signal_handlers()

    @property
    def switch_ns(self) -> str:
        return f"{self.prefix}-sw"

    def num_nodes_for(self, num_workers: int) -> int:
        return num_workers // (self.workers_per_node or 1)

    @property
    def num_nodes(self) -> int:
        """Namespaces with a link of their own (shaped): one per node."""
        return self.num_nodes_for(self.num_workers)

    def node_of(self, rank: int) -> int:
        return rank // (self.workers_per_node or 1)

    def worker_ns(self, rank: int) -> str:
        """The namespace of worker ``rank``: its node's."""
        return f"{self.prefix}-w{self.node_of(rank)}"

    def setup(self) -> None:
        """Create namespaces, veths, the bridge, addresses and shaping (loopback: nothing)."""
        if self._up:
            return
        self._up = True
        atexit.register(self.teardown)
        if not self.profile.cpu_emulable:
            warnings.warn(f"profile {self.profile.name!r} ({format_rate(self.profile.rate_bps)}) "
                          f"is a GPU interconnect / very fast link: a CPU host cannot move data "
                          f"through virtual Ethernet that fast, so the measured time reflects "
                          f"this host's CPU and memory, not the profile", stacklevel=3)
        if not self.profile.shaped:
            if self.master_port is None:
                self.master_port = _free_port()
            self.addresses = ["127.0.0.1"] * self.num_workers
            return
        reason = netns_support()
        if reason:
            raise ClusterUnavailable(reason)
        if self.master_port is None:
            self.master_port = 29500
        subnet = _pick_subnet()
        self.namespaces.append(self.switch_ns)
        _ip("ip", "netns", "add", self.switch_ns)
        _ip("ip", "link", "add", "br0", "type", "bridge", ns=self.switch_ns)
        _ip("ip", "link", "set", "br0", "up", ns=self.switch_ns)
        for node in range(self.num_nodes):
            ns, port = f"{self.prefix}-w{node}", f"p{node}"
            self.namespaces.append(ns)
            _ip("ip", "netns", "add", ns)
            _ip("ip", "link", "add", "name", _IFNAME, "netns", ns, "type", "veth",
                "peer", "name", port, "netns", self.switch_ns)
            _ip("ip", "link", "set", port, "master", "br0", "up", ns=self.switch_ns)
            address = f"{subnet}.{node + 1}"
            _ip("ip", "link", "set", _IFNAME, "addrgenmode", "none", ns=ns)  # IPv4 only
            _ip("ip", "addr", "add", f"{address}/24", "dev", _IFNAME, ns=ns)
            _ip("ip", "link", "set", _IFNAME, "up", ns=ns)
            _ip("ip", "link", "set", "lo", "up", ns=ns)
        self.addresses = [f"{subnet}.{self.node_of(rank) + 1}" for rank in range(self.num_workers)]
        self.delay_emulated = self.profile.delay_s > 0 and self._has_netem()
        if self.profile.delay_s > 0 and not self.delay_emulated:
            warnings.warn(f"this kernel has no sch_netem qdisc: the profile's delay "
                          f"{format_delay(self.profile.delay_s)} is NOT emulated, only its rate "
                          f"{format_rate(self.profile.rate_bps)}", stacklevel=3)
        for node in range(self.num_nodes):
            self._shape(_IFNAME, f"{self.prefix}-w{node}", self.sender_queue_bytes())
            self._shape(f"p{node}", self.switch_ns, self.receiver_queue_bytes())
            self._pace_sender(f"{self.prefix}-w{node}")

    def _has_netem(self) -> bool:
        probe = _ip("tc", "qdisc", "add", "dev", "br0", "root", "netem", "delay", "1ms",
                    ns=self.switch_ns, check=False)
        _ip("tc", "qdisc", "del", "dev", "br0", "root", ns=self.switch_ns, check=False)
        return probe.returncode == 0

    def sender_queue_bytes(self) -> int:
        """The worker-side bucket's queue: what every socket of a node may have queued at once
        (one per worker of another node, for each of the node's workers: an all-to-all), each
        its allowance plus one packet, with a quarter to spare; never less than 100 ms of
        line rate, the switch side's."""
        limits = self.sender_limits()
        local = self.workers_per_node or 1
        sockets = local * max(1, self.num_workers - local)
        each = limits["tcp_limit_output_bytes"] + limits["gso_max_size"]
        return max(self._least_queue_bytes(), int(1.25 * sockets * each))

    def receiver_queue_bytes(self) -> int:
        """The switch port's queue toward a node: room for every other node's burst at once
        (an all-to-all's incast), 64 KiB each with a quarter to spare; never less than 100 ms
        of line rate."""
        senders = max(1, self.num_nodes - 1)
        return max(self._least_queue_bytes(), int(1.25 * senders * 65536))

    def _least_queue_bytes(self) -> int:
        """A bucket's queue at the least: 100 ms of line rate beyond the bucket itself (what
        tbf's ``latency 100ms`` gave before the queues were sized)."""
        rate = self.profile.rate_bps
        return int(rate / 8 * 0.1) + _bucket_bytes(rate)

    def _shape(self, dev: str, ns: str, queue_bytes: Optional[int] = None) -> None:
        """Token bucket at the profile rate on ``dev``'s egress, netem for half the delay.

        The bucket holds 1 ms of line rate, at least 16 KiB (a few full frames), so short
        bursts pass as on a real NIC while any transfer longer than a few ms sees the rate.
        """
        rate = self.profile.rate_bps
        queue = ["limit", str(queue_bytes)] if queue_bytes else ["latency", "100ms"]
        _ip("tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:", "tbf",
            "rate", f"{int(rate)}bit", "burst", str(_bucket_bytes(rate)), *queue, ns=ns)
        if self.delay_emulated:
            half_us = max(1, int(round(self.profile.delay_s / 2 * 1e6)))
            _ip("tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem",
                "delay", f"{half_us}us", "limit", "100000", ns=ns)

    def sender_limits(self) -> Dict[str, int]:
        """What a worker's TCP may queue on its shaped link: ``tcp_limit_output_bytes`` (1 ms
        of the rate, at least 8 KiB) and ``gso_max_size`` (the token bucket's burst, at most
        64 KiB)."""
        rate = self.profile.rate_bps
        return {"tcp_limit_output_bytes": max(8192, int(rate / 8 * 1e-3)),
                "gso_max_size": min(65536, _bucket_bytes(rate))}

    def _pace_sender(self, ns: str) -> None:
        """Make the worker's TCP back off before its bucket overflows (see the module's
        docstring): a per-namespace TCP queue allowance and packets the bucket can hold."""
        limits = self.sender_limits()
        _ip("ip", "link", "set", "dev", _IFNAME, "gso_max_size", str(limits["gso_max_size"]), ns=ns, check=False)
        setting = "/proc/sys/net/ipv4/tcp_limit_output_bytes"
        try:
            with open(setting) as f:
                host_value = f.read().strip()
        except OSError:
            return
        _ip("sysctl", "-q", "-w", f"net.ipv4.tcp_limit_output_bytes={limits['tcp_limit_output_bytes']}",
            ns=ns, check=False)
        with open(setting) as f:
            if f.read().strip() != host_value:  # the kernel keeps it host-wide: undo, say so
                with open(setting, "w") as restore:
                    restore.write(host_value)
                warnings.warn("this kernel keeps net.ipv4.tcp_limit_output_bytes host-wide, not per network "
                              "namespace: left as it is, so a worker sending to several peers at once can overflow "
                              "its shaped link and retransmit", stacklevel=3)

    def teardown(self) -> None:
        """Stop the workers and delete every namespace this cluster made.  Safe to repeat."""
        blocked = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        in_main = threading.current_thread() is threading.main_thread()
        if in_main:  # a second Ctrl-C must not interrupt the cleanup; it is delivered after
            signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            self._stop_workers(list(self._procs))
            for ns in reversed(self.namespaces):
                _kill_namespace_processes(ns)
                _ip("ip", "netns", "del", ns, check=False)
            self.namespaces = []
            self._up = False
            atexit.unregister(self.teardown)
        finally:
            if in_main:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)

    # -- signals

    def _install_signal_handlers(self) -> None:
        """Turn SIGTERM/SIGHUP into SystemExit (SIGINT already raises KeyboardInterrupt) so the
        ``finally`` of the with-block runs and removes the namespaces."""
        if self._saved_handlers or threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._saved_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, _raise_on_signal)

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._saved_handlers.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._saved_handlers = {}

    # -- running workers

    def worker_env(self, rank: int) -> Dict[str, str]:
        """The torch.distributed env:// variables of ``rank``.

        With ``workers_per_node`` L: local rank ``rank % L`` of node ``rank // L`` (GROUP_RANK),
        as torchrun numbers them.  Otherwise, in namespaces each worker is its own node
        (LOCAL_RANK=0, LOCAL_WORLD_SIZE=1); with loopback all share this host, so LOCAL_RANK
        is the rank (one GPU each).
        """
        local = not self.profile.shaped
        per_node = self.workers_per_node or (self.num_workers if local else 1)
        return {
            "MASTER_ADDR": self.addresses[0], "MASTER_PORT": str(self.master_port),
            "RANK": str(rank), "WORLD_SIZE": str(self.num_workers),
            "LOCAL_RANK": str(rank % per_node), "LOCAL_WORLD_SIZE": str(per_node),
            "GROUP_RANK": str(rank // per_node),
            "GLOO_SOCKET_IFNAME": "lo" if local else _IFNAME,
            "TP_SOCKET_IFNAME": "lo" if local else _IFNAME,
            "MERGECOMP_NET_PROFILE": self.profile.name,
        }

    def run(self, command: Sequence[str], timeout_s: float = 600,
            env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None) -> RunResults:
        """Run ``command`` once per worker, each in its namespace with its rank's environment.

        ``env`` adds variables on top of this process's environment.  When a worker exits
        non-zero the others are terminated; after ``timeout_s`` all are.  Returns RunResults
        (one WorkerResult per rank, and ``failure`` describing what went wrong, if anything).
        """
        if not self._up:
            raise RuntimeError("Cluster.run() needs a set-up cluster: use 'with Cluster(...) "
                               "as cluster:' or call setup() first")
        command = [str(part) for part in command]
        if not command:
            raise ValueError("Cluster.run() got an empty command")
        if not timeout_s or timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        outs, errs = [], []
        notes = [""] * self.num_workers
        failure = None
        try:
            for rank in range(self.num_workers):
                full_env = dict(os.environ, **(env or {}), **self.worker_env(rank))
                prefix = ["ip", "netns", "exec", self.worker_ns(rank)] if self.profile.shaped \
                    else []
                outs.append(tempfile.TemporaryFile())
                errs.append(tempfile.TemporaryFile())
                try:
                    self._procs.append(subprocess.Popen(
                        prefix + command, env=full_env, cwd=cwd, stdout=outs[-1],
                        stderr=errs[-1], stdin=subprocess.DEVNULL, start_new_session=True))
                except OSError as err:
                    raise ValueError(f"cannot start worker {rank} with {command!r} "
                                     f"(cwd={cwd!r}): {err}") from err
            failure = self._wait(timeout_s, notes)
        finally:
            self._stop_workers(self._procs)
        results = []
        for rank in range(self.num_workers):
            code = self._procs[rank].returncode if rank < len(self._procs) else None
            results.append(WorkerResult(rank, code, _read(outs, rank), _read(errs, rank),
                                        notes[rank]))
        self._procs = []
        return RunResults(results, failure)

    def _wait(self, timeout_s: float, notes: List[str]) -> Optional[str]:
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [proc.poll() for proc in self._procs]
            bad = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
            if bad:
                rank = bad[0]
                for other, code in enumerate(codes):
                    if code is None:
                        notes[other] = f"terminated because rank {rank} failed"
                return f"rank {rank} exited with code {codes[rank]}"
            if all(code == 0 for code in codes):
                return None
            if time.monotonic() > deadline:
                for rank, code in enumerate(codes):
                    if code is None:
                        notes[rank] = f"terminated after the {timeout_s:g} s timeout"
                return f"timeout after {timeout_s:g} s"
            time.sleep(0.05)

    @staticmethod
    def _stop_workers(procs: Sequence[subprocess.Popen]) -> None:
        """SIGTERM each worker's process group, SIGKILL what is left after 5 s."""
        live = [proc for proc in procs if proc.poll() is None]
        for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            for proc in live:
                try:
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            end = time.monotonic() + grace
            while live and time.monotonic() < end:
                live = [proc for proc in live if proc.poll() is None]
                time.sleep(0.02)
            if not live:
                return

    def expected_allreduce_s(self, nbytes: float) -> Optional[float]:
        """Line-rate time of a ring allreduce of ``nbytes``: each worker sends and receives
        2(N-1)/N of the data over its full-duplex link, in 2(N-1) latency-bound steps.
        None with several workers per node (they share a link: no one-line model)."""
        if not self.profile.shaped or self.num_workers < 2 or (self.workers_per_node or 1) > 1:
            return None
        n = self.num_workers
        wire = 2 * (n - 1) / n * nbytes * 8 / self.profile.rate_bps
        delay = 2 * (n - 1) * self.profile.delay_s if self.delay_emulated else 0.0
        return wire + delay


def _raise_on_signal(signum, frame):
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def _read(files: List, rank: int) -> str:
    if rank >= len(files):
        return ""
    handle = files[rank]
    handle.seek(0)
    text = handle.read().decode(errors="replace")
    handle.close()
    return text


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------- the allreduce check

_CHECK_SCRIPT = r"""
import json, os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
nbytes, iters = int(float(sys.argv[1])), int(sys.argv[2])
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=timedelta(seconds=600))
world = dist.get_world_size()
data = torch.ones(nbytes // 4)
dist.all_reduce(torch.ones(256))
times = []
for _ in range(iters):
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(data)
    times.append(time.perf_counter() - start)
if data[0].item() != float(world) ** iters:
    sys.exit(f"allreduce gave {data[0].item()}, expected {float(world) ** iters}")
print(json.dumps({"rank": dist.get_rank(), "times": times}))
dist.destroy_process_group()
"""


def check_allreduce(cluster: Cluster, mbytes: float, iters: int = 1,
                    timeout_s: float = 600) -> dict:
    """Time a real gloo allreduce of ``mbytes`` MB (float32) between the cluster's workers.

    Returns ``{"seconds": [per iteration, slowest rank], "expected_s": line-rate time or None,
    "nbytes": ...}``; raises RuntimeError with the workers' output when a worker fails.
    """
    if mbytes <= 0 or iters < 1:
        raise ValueError(f"need mbytes > 0 and iters >= 1, got mbytes={mbytes!r}, "
                         f"iters={iters!r}")
    nbytes = int(mbytes * 1e6) // 4 * 4
    results = cluster.run([sys.executable, "-c", _CHECK_SCRIPT, str(nbytes), str(iters)],
                          timeout_s=timeout_s)
    if not results.ok:
        raise RuntimeError(f"allreduce check failed: {results.failure}\n" + format_results(results))
    per_rank = [json.loads(result.stdout.strip().splitlines()[-1])["times"]
                for result in results]
    seconds = [max(times[i] for times in per_rank) for i in range(iters)]
    return {"seconds": seconds, "expected_s": cluster.expected_allreduce_s(nbytes),
            "nbytes": nbytes}



def format_results(results: RunResults) -> str:
    """Every rank's exit status, stdout and stderr, one block per rank."""
    lines = []
    for result in results:
        status = f"exit {result.returncode}" + (f" ({result.note})" if result.note else "")
        lines.append(f"===== rank {result.rank}: {status} =====")
        if result.stdout:
            lines.append(result.stdout.rstrip("\n"))
        if result.stderr:
            lines.append("----- stderr -----")
            lines.append(result.stderr.rstrip("\n"))
    return "\n".join(lines)
