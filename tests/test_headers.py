"""Sizes and shapes read from peers are checked before anything is allocated with them.

A rank whose collectives are out of step with the others (a different communicator or
compressor) reads another collective's bytes as a header; these tests corrupt headers on
purpose and expect a HeaderError naming the rank that sent them, not an allocation.
"""
import pytest
import torch
import torch.distributed as dist

from mergecomp import communicators, compressors, memories
from mergecomp.distributed.backends import serialize, torch_dist
from mergecomp.distributed.backends.horovod import _walk_blobs
from mergecomp.distributed.backends.serialize import (HeaderError, check_blob_size, pack, pack_bounded,
                                          payload_limit, shape_header, shapes_from_header,
                                          unpack_bounded)
from mergecomp.distributed.backends.torch_dist import TorchDistributedBackend
from mergecomp.communicators.ps import decode, encode
from tests.distributed import run_ranks

ADVICE = "Are all ranks using the same communicator, compressor and plan?"
TERABYTE = 1 << 40


def words(blob, start, values):
    """Overwrite int64 words of a blob in place (a corrupted header)."""
    view = blob.view(torch.int64)
    view[start:start + len(values)] = torch.tensor(values, dtype=torch.int64)
    return blob


def test_shape_rows_must_be_sizes_then_padding():
    good = shape_header([torch.zeros(3, 2), torch.zeros(0)], "cpu")
    assert shapes_from_header(good, source=1) == [torch.Size([3, 2]), torch.Size([0])]
    for row in ([-5, -1, -1, -1], [3, -1, 2, -1], [-2, 4, -1, -1]):
        with pytest.raises(HeaderError, match=rf"rank 2 sent a header that does not describe a "
                                              rf"payload of this group: part 0 has the shape row"):
            shapes_from_header(torch.tensor(row, dtype=torch.int64), source=2)


def test_claimed_sizes_beyond_the_limit_are_refused():
    shapes = [torch.Size([TERABYTE])]
    with pytest.raises(HeaderError, match=r"rank 3 sent .* take 4398046511104 bytes, more than "
                                          r"the 1000 any payload") as raised:
        check_blob_size(shapes, [torch.float32], 1000, source=3)
    assert ADVICE in str(raised.value)
    assert check_blob_size([torch.Size([10])], [torch.float32], 1000, source=3) == 40
    assert payload_limit(1000, torch.float32) == 16 * 4000 + 65536


def test_a_bounded_blob_with_a_corrupted_header_is_refused():
    bound = (torch.Size([5]), torch.Size([5]))
    parts = (torch.arange(3, dtype=torch.float32), torch.arange(3, dtype=torch.int32))
    blob = pack_bounded(parts, bound, "cpu")
    assert [p.tolist() for p in unpack_bounded(blob.clone(), [torch.float32, torch.int32], bound, 1)] == \
        [[0, 1, 2], [0, 1, 2]]
    with pytest.raises(HeaderError, match=r"rank 1 .* part 0 has shape \(1099511627776,\), larger "
                                          r"than its bound \(5,\)"):
        unpack_bounded(words(blob.clone(), 0, [TERABYTE]), [torch.float32, torch.int32], bound, 1)
    with pytest.raises(HeaderError, match=r"rank 1 .* more than the 48 any payload"):  # no bound
        unpack_bounded(words(blob.clone(), 0, [TERABYTE]), [torch.float32, torch.int32], None, 1)
    with pytest.raises(HeaderError, match=r"needs a 64-byte header, got a 16-byte blob"):
        unpack_bounded(blob[:16], [torch.float32, torch.int32], bound, 1)


PS_CASES = [
    ([TERABYTE], r"claims 1099511627776 parts; its header has room for"),
    ([-3], r"claims -3 parts"),
    ([1, 99], r"part 0 of its PS blob has the header row \[99, "),
    ([1, 0, 7], r"has the header row \[0, 7, "),
    ([1, 0, 1, -4], r"has the header row \[0, 1, -4, "),
    ([1, 0, 1, TERABYTE], r"take \d+ bytes, more than the 64 any payload"),
]


@pytest.mark.parametrize("corruption, message", PS_CASES)
def test_a_ps_blob_with_a_corrupted_header_is_refused(corruption, message):
    blob = encode((torch.ones(2),), "cpu")  # 8 + 48 header bytes, 8 payload bytes
    assert decode(blob.clone(), source=2)[0].tolist() == [1.0, 1.0]
    with pytest.raises(HeaderError, match=rf"rank 2 sent a header .* {message}"):
        decode(words(blob.clone(), 0, corruption), source=2)


def test_a_ps_blob_shorter_than_a_header_is_refused():
    with pytest.raises(HeaderError, match="a PS blob has an 8-byte header at least, got 3 bytes"):
        decode(torch.zeros(3, dtype=torch.uint8), source=0)


def test_horovod_blobs_with_corrupted_lengths_are_refused():
    dtypes = [torch.float32]
    header = shape_header([torch.ones(2)], "cpu")
    header_bytes = 8 * (1 + header.numel())
    blob = pack((torch.cat([torch.tensor([header_bytes + 8]), header]), torch.ones(2)), "cpu")
    gathered = torch.cat([blob, blob])
    assert [p[0].tolist() for p in _walk_blobs(gathered, 2, header_bytes, dtypes)] == [[1, 1]] * 2
    corrupt = torch.cat([blob, words(blob.clone(), 0, [TERABYTE])])
    with pytest.raises(HeaderError, match=r"rank 1 .* claims 1099511627776 bytes, its shapes 48"):
        _walk_blobs(corrupt, 2, header_bytes, dtypes)
    corrupt = torch.cat([blob, words(blob.clone(), 1, [TERABYTE])])
    with pytest.raises(HeaderError, match=r"rank 1 .* more than the 100 any payload"):
        _walk_blobs(corrupt, 2, header_bytes, dtypes, limit=100)


# ----------------------------------------------------------------------------- real ranks

def corrupted_shape_exchange_worker(rank, world_size):
    """Rank 1 announces a terabyte-sized part in the allgather's shape exchange."""
    if rank == 1:
        def lying_header(tensors, device):
            header = serialize.shape_header(tensors, device)
            header[0] = TERABYTE
            return header
        torch_dist.shape_header = lying_header
    backend = TorchDistributedBackend()
    try:
        backend.allgather_async((torch.ones(100), torch.arange(100, dtype=torch.int32)),
                                same_shapes=False, limit=payload_limit(100, torch.float32)).wait()
    except HeaderError as error:
        return str(error), backend.beacon.read()[rank].state
    return "no error", None


def test_a_peer_announcing_huge_shapes_is_refused_before_allocating():
    for message, state in run_ranks(corrupted_shape_exchange_worker, 2, timeout=60):
        assert message.startswith("rank 1 sent a header that does not describe a payload of this "
                                  "group: parts of shapes (1099511627776,) float32"), message
        assert ADVICE in message
        assert state == "failed"  # the others can read why this rank stopped


def corrupted_alltoall_worker(rank, world_size):
    """Rank 1 takes part in the size exchange with a corrupted count, then stops."""
    backend = TorchDistributedBackend()
    if rank == 1:
        sizes = torch.tensor([TERABYTE] * world_size, dtype=torch.int64)
        dist.all_gather([torch.empty_like(sizes) for _ in range(world_size)], sizes)
        return "lied"
    try:
        backend.alltoall([torch.zeros(8, dtype=torch.uint8)] * world_size, limit=1000)
    except HeaderError as error:
        return str(error)
    return "no error"


def test_an_alltoall_size_beyond_the_limit_is_refused():
    message = run_ranks(corrupted_alltoall_worker, 2, timeout=60)[0]
    assert message.startswith("rank 1 sent a header that does not describe a payload of this group: "
                              "it announces a 1099511627776-byte chunk for rank 0, more than the "
                              "1000 bytes"), message


def mismatched_ps_worker(rank, world_size):
    """Ranks whose PS communicators carry different compressors."""
    compressor = compressors.create("graddrop") if rank == 0 else \
        compressors.create("topk", compress_ratio=0.01)
    ps = communicators.create("ps", compressor=compressor, memory=memories.create("none"),
                              backend=TorchDistributedBackend())
    try:
        ps.finish(ps.start(torch.randn(10_000), "g"))
    except HeaderError as error:
        return str(error)
    return "no error"


def test_ranks_with_different_compressors_get_a_clear_error():
    for rank, message in enumerate(run_ranks(mismatched_ps_worker, 2, timeout=60)):
        assert message.startswith(f"rank {1 - rank} sent a header that does not describe a "
                                  f"payload of this group"), message
        assert ADVICE in message


def many_collectives_in_one_step_worker(rank, world_size):
    """300 allgathers and allreduces without a step boundary, each waited for."""
    backend = TorchDistributedBackend()
    most = 0
    for i in range(150):
        backend.allgather_async((torch.full((1000,), float(rank)),), same_shapes=True).wait()
        backend.allreduce_async([torch.ones(1000)]).wait()
        most = max(most, len(backend._step_works))
    return most


def test_completed_collectives_release_their_outputs_within_a_step():
    """A handle holds its collective's outputs: a step of many collectives (the auto
    scheduler's probes) must not keep them all alive until the step ends."""
    for most in run_ranks(many_collectives_in_one_step_worker, 2, timeout=60):
        assert most <= 4
