"""Sparse payloads are summed in one buffer: the same floats as decode-then-aggregate, and
the cost model prices one decode plus an add per further payload."""
import dataclasses

import pytest
import torch

from mergecomp import compressors
from mergecomp.compressors.sparsifier import scatter_values
from mergecomp.compressors.topk import TopKCompressor
from mergecomp.planning.costmodel import send_costs
from mergecomp.planning.measure import measure_compression_cost
from mergecomp.planning.profile import CodecCost, LinearCost
from tests.test_costmodel import hand_profile


def dense_sum(compressor, payloads, ctx):
    return compressor.aggregate([compressor.decompress(p, ctx).reshape(-1) for p in payloads])


@pytest.mark.parametrize("name, kwargs", [("topk", {"compress_ratio": 0.05}), ("dgc", {"compress_ratio": 0.05}),
                                          ("dgc", {"compress_ratio": 0.05, "fp16_values": True, "wire_format": "indexed"}),
                                          ("graddrop", {"compress_ratio": 0.05})])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_in_place_sum_is_bit_for_bit_the_dense_one(name, kwargs, dtype):
    compressor = compressors.create(name, **kwargs)
    assert compressor.sums_in_place
    payloads = []
    for rank in range(3):  # overlapping selections: every rank keeps some of the same coordinates
        gradient = torch.randn(5000, generator=torch.Generator().manual_seed(rank)).to(dtype)
        gradient[:40] = 10.0 + rank
        payload, ctx = compressor.compress(gradient, "g")
        payloads.append(payload)
    total = compressor.decompress_sum(payloads, ctx)
    assert total.dtype == dtype and total.shape == (5000,)
    assert torch.equal(total, dense_sum(compressor, payloads, ctx))


def test_a_subclass_that_decodes_its_own_way_keeps_decode_then_aggregate():
    class Doubled(TopKCompressor):
        def decompress(self, payload, ctx):
            return 2 * scatter_values(payload[0], payload[1], ctx)

    compressor = Doubled(compress_ratio=0.1, wire_format="indexed")  # the payload its decode reads
    assert not compressor.sums_in_place
    payload, ctx = compressor.compress(torch.arange(1.0, 21.0), "g")
    assert torch.equal(compressor.decompress_sum([payload, payload], ctx), 4 * scatter_values(*payload, ctx))
    assert measure_compression_cost(compressor, sizes=(2 ** 10, 2 ** 12), repeats=1).add is None


def test_the_probe_measures_the_add_and_profiles_keep_it():
    cost = measure_compression_cost(compressors.create("topk", compress_ratio=0.01), sizes=(2 ** 12, 2 ** 16),
                                    repeats=2)
    assert cost.add is not None and cost.add.intercept >= 0 and cost.add.slope >= 0
    assert CodecCost.from_dict(cost.to_dict()) == cost
    dense = measure_compression_cost(compressors.create("fp16"), sizes=(2 ** 12, 2 ** 16), repeats=1)
    assert dense.add is None and "add" not in dense.to_dict()  # older profiles read as they were


def test_the_cost_model_prices_one_decode_and_an_add_per_further_payload():
    profile = hand_profile(communicator="allgather", world=4)
    toy = profile.codecs["toy"]  # decode 0.2 s per payload
    profile.codecs = {"toy": dataclasses.replace(toy, add=LinearCost(0.01, 0.001))}
    gather = send_costs(profile)["compress"]
    assert (gather.decode.intercept, gather.decode.slope) == pytest.approx((0.2 + 3 * 0.01, 3 * 0.001))
    assert gather.aggregate_passes == 0  # the sum is in the decode
    ps_profile = dataclasses.replace(profile, communicator="ps")
    ps = send_costs(ps_profile)["compress"]
    # a server sums 4 payloads of its n/4 shard: 0.2 + 3·0.01 s + 3·0.001/4 per element,
    # then re-encodes its shard (0.1 s + 0.001/4 per element).
    assert ps.relay.intercept == pytest.approx(0.2 + 0.03 + 0.1)
    assert ps.relay.slope == pytest.approx(0.003 / 4 + 0.001 / 4)


@pytest.mark.parametrize("name, kwargs", [("topk", {"compress_ratio": 0.05}),
                                          ("dgc", {"compress_ratio": 0.05, "fp16_values": True, "wire_format": "indexed"})])
def test_the_sum_into_a_lent_buffer_and_the_sent_values_subtracted_are_exact(name, kwargs):
    compressor = compressors.create(name, **kwargs)
    payloads = []
    for rank in range(3):
        gradient = torch.randn(5000, generator=torch.Generator().manual_seed(rank))
        payload, ctx = compressor.compress(gradient, "g")
        payloads.append(payload)
    lent = torch.full((5000,), 7.0)
    total = compressor.decompress_sum(payloads, ctx, out=lent)
    assert total.data_ptr() == lent.data_ptr() and torch.equal(total, dense_sum(compressor, payloads, ctx))
    residual = gradient.clone()
    compressor.subtract_sent(residual, payload, ctx)
    assert torch.equal(residual, gradient - compressor.decompress(payload, ctx))


def test_a_communicator_writes_the_average_into_a_lent_buffer_only(monkeypatch):
    from mergecomp import memories
    from mergecomp.communicators.allgather import AllgatherCommunicator

    class OneRank:  # a backend of one rank: the allgather hands back this rank's payload
        rank, size = 0, 1

        def allgather_async(self, tensors, same_shapes, bound=None, limit=None):
            class Done:
                def wait(self):
                    return [tuple(t.clone() for t in tensors)]
            return Done()

    communicator = AllgatherCommunicator(compressors.create("topk", compress_ratio=0.1),
                                         memories.create("none"), OneRank())
    gradient = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    kept = gradient.clone()
    averaged = communicator.finish(communicator.start(gradient, "g"))
    assert torch.equal(gradient, kept) and averaged.data_ptr() != gradient.data_ptr()
    lent = gradient.clone()
    in_place = communicator.finish(communicator.start(lent, "g", in_place=True))
    assert in_place.data_ptr() == lent.data_ptr() and torch.equal(in_place, averaged)
