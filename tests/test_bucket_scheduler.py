"""The bucket scheduler cuts groups the way DDP fills its buckets."""
import pytest

import mergecomp
from mergecomp.plan import ParamInfo
from mergecomp.schedulers.bucket import capped_cuts
from tests.distributed import run_ranks


def params(*megabytes):
    return [ParamInfo(f"p{i}", int(mb * 2 ** 20) // 4, "torch.float32", "cpu") for i, mb in enumerate(megabytes)]


def test_capped_cuts_close_a_run_once_it_reaches_the_cap():
    assert capped_cuts([10, 10, 10, 10, 10], 25) == [3]
    assert capped_cuts([30, 1, 1, 40, 1], 25) == [1, 4]  # a tensor over the cap is its own run
    assert capped_cuts([5], 25) == []
    # DDP's small first bucket: the first run closes at its own limit, the rest at the cap.
    assert capped_cuts([1, 2, 10, 10, 10, 10], 25, first_cap=3) == [2, 5]


def test_bucket_plan_groups_by_megabytes_and_send_mode():
    plan = mergecomp.schedulers.create("bucket", bucket_mb=25, first_bucket_mb=25).plan(params(10, 10, 10, 30, 2, 2))
    assert [g.names for g in plan.groups] == [("p0", "p1", "p2"), ("p3",), ("p4", "p5")]
    # DDP's defaults: the first bucket closes at 1 MB (the LSTM's small decoder bias and
    # large decoder weight), then 25 MB ones.
    plan = mergecomp.schedulers.create("bucket").plan(params(0.1, 26, 6.5, 6.5, 6.5, 6.5, 26))
    assert [g.names for g in plan.groups] == [("p0", "p1"), ("p2", "p3", "p4", "p5"), ("p6",)]
    assert mergecomp.schedulers.create("bucket", bucket_mb=10).first_bucket_mb == 10  # DDP: a set cap, no small first
    assert {g.send for g in plan.groups} == {"compress"}  # the optimizer's compressor, as for every scheduler
    plan = mergecomp.schedulers.create("bucket", bucket_mb=1000, send="fp32").plan(params(10, 10))
    assert len(plan) == 1 and plan.groups[0].send == "fp32"


@pytest.mark.parametrize("bad", [0, -1, "big", None])
def test_bucket_scheduler_refuses_a_bad_size(bad):
    with pytest.raises(ValueError, match="bucket_mb"):
        mergecomp.schedulers.create("bucket", bucket_mb=bad)
    if bad is not None:  # None is DDP's rule
        with pytest.raises(ValueError, match="first_bucket_mb"):
            mergecomp.schedulers.create("bucket", first_bucket_mb=bad)
    with pytest.raises(ValueError, match="send"):
        mergecomp.schedulers.create("bucket", send="zip")


def bucket_by_name_worker(rank, world_size):
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    optimizer = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                               model.named_parameters(), compressor="topk",
                                               communicator="allgather", scheduler="bucket")
    before = optimizer.backend.bytes_sent  # construction broadcast rank 0's model
    for _ in range(2):  # the first step records the order and plans
        optimizer.zero_grad()
        model(torch.randn(4, 64)).sum().backward()
        optimizer.step()
    sent = optimizer.backend.bytes_sent - before
    return [g.send for g in optimizer.plan.groups], sent


def test_scheduler_bucket_by_name_applies_the_optimizers_compressor():
    """``scheduler="bucket"`` with top-k used to send every group raw in FP32."""
    for sends, sent in run_ranks(bucket_by_name_worker, 2):
        assert sends == ["compress"]
        fp32 = 4 * (64 * 64 + 64 + 64 * 8 + 8)
        assert sent < 2 * fp32 * 0.1  # two steps of top-k at 1%, far below two FP32 steps
