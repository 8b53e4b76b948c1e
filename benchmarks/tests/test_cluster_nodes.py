"""The emulated cluster's nodes: L workers sharing a namespace (fast between them) behind one
shaped link, with torchrun's layout variables.  Namespace tests need root and ``ip netns``;
they are skipped (with the reason) elsewhere."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import cluster as cli
from benchmarks.harness.cluster import Cluster, netns_support

_NETNS_REASON = netns_support()
needs_netns = pytest.mark.skipif(_NETNS_REASON is not None, reason=str(_NETNS_REASON))


def test_workers_get_the_node_layout():
    with Cluster(4, "loopback", workers_per_node=2) as cluster:
        envs = [cluster.worker_env(rank) for rank in range(4)]
    assert [(e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"]) for e in envs] == [
        ("0", "2", "0"), ("1", "2", "0"), ("0", "2", "1"), ("1", "2", "1")]
    with Cluster(2, "loopback") as cluster:  # no nodes asked: every worker on this host, as before
        assert cluster.worker_env(1)["LOCAL_WORLD_SIZE"] == "2"


@pytest.mark.parametrize("per_node", [3, 0, True, 1.5])
def test_a_node_size_that_does_not_divide_is_refused(per_node):
    with pytest.raises(ValueError, match="workers_per_node must be a positive int dividing num_workers=4"):
        Cluster(4, "loopback", workers_per_node=per_node)


def test_the_command_line_layout():
    parse = cli._parser().parse_args
    assert cli._layout(parse(["--nodes", "2", "--workers-per-node", "3"])) == (6, 3)
    assert cli._layout(parse(["--workers", "3"])) == (3, None)
    with pytest.raises(ValueError, match="--workers 5 contradicts --nodes 2 × --workers-per-node 2 = 4"):
        cli._layout(parse(["--workers", "5", "--nodes", "2", "--workers-per-node", "2"]))


_LINKS_SCRIPT = r"""
import json, os, time
from datetime import timedelta
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank, local = dist.get_rank(), int(os.environ["LOCAL_WORLD_SIZE"])
intra = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // local]
inter = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % local]
data = torch.ones(125_000)  # 0.5 MB
times = {}
for name, group in (("intra", intra), ("inter", inter)):
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(data, group=group)
    times[name] = time.perf_counter() - start
print(json.dumps(dict(times, node=os.environ["GROUP_RANK"], local=os.environ["LOCAL_RANK"])))
dist.destroy_process_group()
"""


@needs_netns
@pytest.mark.filterwarnings("ignore:this kernel has no sch_netem")
def test_nodes_share_a_namespace_and_a_shaped_link():
    with Cluster(4, "10mbit", workers_per_node=2) as cluster:
        assert len(cluster.namespaces) == 3  # the switch and two nodes
        assert cluster.addresses[0] == cluster.addresses[1] != cluster.addresses[2]
        qdisc = subprocess.run(["ip", "netns", "exec", cluster.worker_ns(3), "tc", "qdisc", "show", "dev",
                                "eth0"], capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "10Mbit" in qdisc
        # inside a node the workers share a namespace and talk over its loopback, unshaped
        inside = subprocess.run(["ip", "netns", "exec", cluster.worker_ns(3), "tc", "qdisc", "show", "dev",
                                 "lo"], capture_output=True, text=True).stdout
        assert cluster.worker_ns(2) == cluster.worker_ns(3)
        assert "tbf" not in inside and "netem" not in inside, inside
        results = cluster.run([sys.executable, "-c", _LINKS_SCRIPT], timeout_s=60)
        assert results.ok, results.failure
    times = [json.loads(result.stdout.strip().splitlines()[-1]) for result in results]
    assert [(t["node"], t["local"]) for t in times] == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    # between nodes: 0.5 MB each way per rank, two ranks on one 10 Mbit/s link: 0.8 s at line
    # rate, so the shaping holds (no upper bound: a busy machine only makes it slower)
    assert all(t["inter"] > 0.5 for t in times), times
