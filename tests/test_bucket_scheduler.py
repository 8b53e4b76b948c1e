"""The bucket scheduler cuts groups the way DDP fills its buckets."""
import pytest

import mergecomp
from mergecomp.plan import ParamInfo
from mergecomp.schedulers.bucket import capped_cuts


def params(*megabytes):
    return [ParamInfo(f"p{i}", int(mb * 2 ** 20) // 4, "torch.float32", "cpu") for i, mb in enumerate(megabytes)]


def test_capped_cuts_close_a_run_once_it_reaches_the_cap():
    assert capped_cuts([10, 10, 10, 10, 10], 25) == [3]
    assert capped_cuts([30, 1, 1, 40, 1], 25) == [1, 4]  # a tensor over the cap is its own run
    assert capped_cuts([5], 25) == []


def test_bucket_plan_groups_by_megabytes_and_send_mode():
    plan = mergecomp.schedulers.create("bucket", bucket_mb=25).plan(params(10, 10, 10, 30, 2, 2))
    assert [g.names for g in plan.groups] == [("p0", "p1", "p2"), ("p3",), ("p4", "p5")]
    assert {g.send for g in plan.groups} == {"fp32"}
    plan = mergecomp.schedulers.create("bucket", bucket_mb=1000, send="compress").plan(params(10, 10))
    assert len(plan) == 1 and plan.groups[0].send == "compress"


@pytest.mark.parametrize("bad", [0, -1, "big", None])
def test_bucket_scheduler_refuses_a_bad_size(bad):
    with pytest.raises(ValueError, match="bucket_mb"):
        mergecomp.schedulers.create("bucket", bucket_mb=bad)
    with pytest.raises(ValueError, match="send"):
        mergecomp.schedulers.create("bucket", send="zip")
