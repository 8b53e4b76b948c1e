"""The simulator's α-β formulas and its command line, on hand-computed cases."""
import json

import pytest

from mergecomp.planning import simulate
from mergecomp.planning.profile import CodecCost, LinearCost, Profile, TensorTiming, WireSize


def small_mlp():
    """A model for ``--model MODULE:FACTORY``."""
    import torch
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def test_alpha_beta_formulas():
    costs = simulate.network_collectives(4, bandwidth=1e9, latency=1e-5)
    megabyte = 1e6
    # ring allreduce 2(N−1)/N·B/bw + 2(N−1)·lat
    assert costs["allreduce"](megabyte) == pytest.approx(2 * 3 / 4 * 1e-3 + 6e-5)
    # allgather (N−1)·B/bw + (N−1)·lat
    assert costs["allgather"](megabyte) == pytest.approx(3e-3 + 3e-5)
    # alltoall (N−1)/N·B/bw + (N−1)·lat; PS = alltoall(B) + allgather(B/N) = the ring's cost
    assert costs["alltoall"](megabyte) + costs["allgather"](megabyte / 4) == \
        pytest.approx(costs["allreduce"](megabyte))
    with pytest.raises(ValueError, match="at least 2 workers"):
        simulate.network_collectives(1, 1e9, 0)


def one_tensor_profile():
    timeline = [TensorTiming("w", 10 ** 6, 4 * 10 ** 6, "torch.float32", "cpu", 0.05)]
    toy = CodecCost(LinearCost(1e-4, 1e-9), LinearCost(1e-4, 1e-9), WireSize(0.08, 0))
    half = CodecCost(LinearCost(0, 1e-9), LinearCost(0, 1e-9), WireSize(2.0, 0))
    return Profile(1, timeline, forward_time=0.025, backward_time=0.05, compressor="topk",
                   codecs={"topk": toy, "fp16": half}, copy=LinearCost(0, 1e-12))


def test_hand_computed_fp32_row():
    rows = simulate.simulate(one_tensor_profile(), [4], bandwidth=1e9, latency=1e-5, topology="allgather")
    copy = 4e6 * 1e-12
    ring = 2 * 3 / 4 * 4e6 / 1e9 + 6e-5
    expected = 0.025 + 0.05 + copy + ring + 2 * copy  # gather, allreduce, average + write-back
    assert rows[0]["fp32"]["iteration_time"] == pytest.approx(expected)
    assert rows[0]["fp32"]["scaling"] == pytest.approx(0.075 / expected)
    # fp16 halves the bytes and pays the casts.
    fp16 = 0.025 + 0.05 + copy + 1e-3 + 2 * 3 / 4 * 2e6 / 1e9 + 6e-5 + 1e-3 + 2 * copy
    assert rows[0]["fp16"]["iteration_time"] == pytest.approx(fp16)
    best = rows[0]["optimal"]
    assert best["exact"] and best["iteration_time"] <= min(expected, fp16)


def test_command_line_json_and_errors(tmp_path, capsys):
    path = str(tmp_path / "profile.json")
    one_tensor_profile().save(path)
    assert simulate.main(["--profile", path, "--workers", "2,256", "--json",
                          "--compressor-arg", "compress_ratio=0.02"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [row["workers"] for row in report["rows"]] == [2, 256]
    slow, fast = report["rows"][1], report["rows"][0]
    assert slow["fp32"]["iteration_time"] > fast["fp32"]["iteration_time"]
    assert simulate.main(["--profile", path, "--workers", "8"]) == 0
    assert "optimal ms" in capsys.readouterr().out
    assert simulate.main(["--profile", path, "--topology", "ring"]) == 2
    assert "not summable" in capsys.readouterr().err
    assert simulate.main(["--model", "vgg16"]) == 2
    assert "--compute-time" in capsys.readouterr().err


def test_compute_scale_multiplies_the_processor_side_only():
    base = one_tensor_profile()
    doubled = simulate.scaled_compute(base, 2.0)
    assert doubled.forward_time == 0.05 and doubled.backward_time == 0.1
    assert doubled.timeline[0].ready == pytest.approx(0.1)
    assert doubled.codecs["topk"].encode == LinearCost(2e-4, 2e-9)
    assert doubled.codecs["topk"].wire == base.codecs["topk"].wire
    rows = simulate.simulate(doubled, [4], bandwidth=1e9, latency=1e-5, topology="allgather")
    copy = 2 * 4e6 * 1e-12
    ring = 2 * 3 / 4 * 4e6 / 1e9 + 6e-5  # the network is not scaled
    assert rows[0]["fp32"]["iteration_time"] == pytest.approx(0.05 + 0.1 + copy + ring + 2 * copy)
    with pytest.raises(ValueError, match="positive factor"):
        simulate.scaled_compute(base, 0)


def test_command_line_compute_scale(tmp_path, capsys):
    path = str(tmp_path / "profile.json")
    one_tensor_profile().save(path)
    times = []
    for scale in ("1", "0.5"):
        assert simulate.main(["--profile", path, "--workers", "2", "--json", "--compute-scale", scale]) == 0
        times.append(json.loads(capsys.readouterr().out)["rows"][0]["fp32"]["iteration_time"])
    assert times[1] < times[0]
    assert simulate.main(["--profile", path, "--compute-scale", "-1"]) == 2
    assert "positive factor" in capsys.readouterr().err


def test_the_optimal_row_may_send_the_tensor_in_pieces(tmp_path, capsys):
    whole = simulate.simulate(one_tensor_profile(), [8], bandwidth=1e8, latency=1e-5, topology="allgather")
    pieces = simulate.simulate(one_tensor_profile(), [8], bandwidth=1e8, latency=1e-5, topology="allgather",
                               chunk_mb=1.0)
    assert whole[0]["optimal"]["sliced"] == 0
    assert pieces[0]["optimal"]["sliced"] == pieces[0]["optimal"]["groups"] == 3  # 4 MB in 3 pieces
    assert pieces[0]["optimal"]["iteration_time"] < whole[0]["optimal"]["iteration_time"]
    assert pieces[0]["fp32"] == whole[0]["fp32"]  # the FP32 and FP16 rows stay whole
    path = str(tmp_path / "profile.json")
    one_tensor_profile().save(path)
    assert simulate.main(["--profile", path, "--workers", "8", "--chunk-mb", "1"]) == 0
    assert simulate.main(["--profile", path, "--chunk-mb", "0"]) == 2
    assert "chunk_mb must be a size in MB > 0" in capsys.readouterr().err


# ----------------------------------------------------------------------- node layouts
def test_node_layout_formulas():
    megabyte, bw, lat, fast = 1e6, 1e9, 1e-5, 1e11
    costs = simulate.node_collectives(2, 4, bw, lat, intra_bandwidth=fast)
    # the flat ring crosses each node's link with one flow: the cost of 8 separate ranks
    flat = simulate.network_collectives(8, bw, lat)
    assert costs["allreduce"] == flat["allreduce"] and costs["allgather"] == flat["allgather"]
    # all-to-all: each rank sends 4/8 of B off its node, 4 ranks share the link
    assert costs["alltoall"](megabyte) == pytest.approx(4 * 4 / 8 * 1e-3 + 7e-5)
    # between nodes: 4 peer groups of 2 ranks at once, each at bw/4
    assert costs["inter_allreduce"](megabyte) == pytest.approx(2 * 1 / 2 * 4e-3 + 2e-5)
    assert costs["inter_allgather"](megabyte) == pytest.approx(4e-3 + 1e-5)
    # inside a node: 4 ranks on the fast link, no latency by default
    assert costs["intra_allreduce"](megabyte) == pytest.approx(2 * 3 / 4 * 1e-5)
    assert costs["intra_allgather"](megabyte) == pytest.approx(3e-5)


def test_node_layout_edges_and_measured_intra():
    bw, lat = 1e9, 1e-5
    one_per_node = simulate.node_collectives(8, 1, bw, lat)
    flat = simulate.network_collectives(8, bw, lat)
    assert {k: one_per_node[k] for k in flat} == flat  # L = 1: the flat model exactly
    assert one_per_node["intra_allreduce"] == LinearCost() and one_per_node["inter_allgather"] == flat["allgather"]
    measured = {"intra_allreduce": LinearCost(1e-3, 1e-9), "intra_allgather": LinearCost(2e-3, 2e-9)}
    one_node = simulate.node_collectives(1, 4, bw, lat, intra=measured)
    assert one_node["allreduce"] == measured["intra_allreduce"] and one_node["inter_allreduce"] == LinearCost()
    with pytest.raises(ValueError, match="either as a rate"):
        simulate.node_collectives(2, 2, bw, lat)
    with pytest.raises(ValueError, match="lack"):
        simulate.node_collectives(2, 2, bw, lat, intra={"intra_allreduce": LinearCost()})
    with pytest.raises(ValueError, match="at least 2 workers"):
        simulate.node_collectives(1, 1, bw, lat, intra_bandwidth=bw)
    with pytest.raises(ValueError, match="nodes ≥ 1"):
        simulate.node_collectives(0, 4, bw, lat, intra_bandwidth=bw)


def test_hierarchical_prediction_from_a_node_layout():
    """One compressed tensor on 2 nodes × 4 ranks: the hierarchical communicator's price
    from node_profile is the node sum, a shard's allgather between nodes, the shard gather."""
    import dataclasses
    from mergecomp.plan import Group, Plan
    from mergecomp.planning.costmodel import predict, send_costs
    base = dataclasses.replace(one_tensor_profile(), communicator="hierarchical",
                               hierarchy={"local_size": 4, "inner": "allgather", "gather": "allgather"})
    with pytest.raises(ValueError, match="no measured intra-node"):
        simulate.node_profile(base, 2, 4, 1e9, 1e-5)
    bw, fast, n = 1e9, 1e11, 10 ** 6
    profile = simulate.node_profile(base, 2, 4, bw, 1e-5, intra_bandwidth=fast)
    assert profile.world_size == 8 and profile.hierarchy["local_size"] == 4
    cost = send_costs(profile)["compress"]
    shard_wire = 0.08 * n / 4  # top-k's 0.08 bytes per element, on a quarter of the tensor
    assert cost.wire(n, 4) == pytest.approx(shard_wire)
    assert cost.collective(shard_wire) == pytest.approx(shard_wire * 4 / bw + 1e-5)
    # the node sum before the shard's encoding, the shards' gather after its decoding
    node_sum, gather = 2 * 3 / 4 * 4 * n / fast, 3 * 4 * n / 4 / fast
    inner = send_costs(dataclasses.replace(base, communicator="allgather", world_size=2, collectives=dict(
        allreduce=LinearCost(), allgather=LinearCost())))["compress"]
    assert cost.encode(n) == pytest.approx(inner.encode(n / 4) + node_sum)
    assert cost.decode(n) == pytest.approx(inner.decode(n / 4) + gather)
    # the same tensor flat: 8 whole payloads around the ring, which the 2 nodes' links carry 7 of
    flat = simulate.node_profile(dataclasses.replace(base, communicator="allgather"), 2, 4, bw, 1e-5,
                                 intra_bandwidth=fast)
    assert send_costs(flat)["compress"].collective(0.08 * n) == pytest.approx(7 * 0.08 * n / bw + 7e-5)
    plan = Plan([Group(("w",), "compress")])
    assert predict(plan, profile).iteration_time < predict(plan, flat).iteration_time


def test_simulate_rows_on_a_node_layout(capsys):
    """The hierarchical topology on nodes of 4: the compressed exchange between nodes carries
    a quarter of each group per rank, so at 8 workers it beats the flat allgather, and the
    command line takes the layout."""
    base = one_tensor_profile()
    flat = simulate.simulate(base, [8], 1e8, 1e-5, "allgather", summable=False, local_size=4, intra_bandwidth=1e11)
    hier = simulate.simulate(base, [8], 1e8, 1e-5, "hierarchical", summable=False, local_size=4, intra_bandwidth=1e11)
    assert hier[0]["optimal"]["iteration_time"] < flat[0]["optimal"]["iteration_time"]
    with pytest.raises(ValueError, match="whole number of nodes"):
        simulate.simulate(base, [6], 1e8, 1e-5, "hierarchical", local_size=4, intra_bandwidth=1e11)
    assert simulate.main(["--model", "tests.test_simulate:small_mlp", "--compute-time", "0.1", "--topology", "hierarchical",
                          "--workers", "8,16", "--local-size", "4", "--intra-bandwidth", "800"]) == 0
    assert "   16 |" in capsys.readouterr().out
    assert simulate.main(["--model", "tests.test_simulate:small_mlp", "--compute-time", "0.1", "--local-size", "0"]) == 2
