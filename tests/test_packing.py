"""Bit packing: exact byte counts and lossless round trips for every width and length."""
import copy
import pickle

import pytest
import torch

from mergecomp.kernels.packing import Scratch, bits_for, pack_bits, packed_nbytes, unpack_bits


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("numel", [0, 1, 3, 7, 8, 9, 13, 64, 1001])
def test_round_trip_every_width_and_awkward_lengths(bits, numel):
    gen = torch.Generator().manual_seed(bits * 1000 + numel)
    codes = torch.randint(0, 2 ** bits, (numel,), generator=gen, dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == packed_nbytes(numel, bits) == (numel * bits + 7) // 8
    assert torch.equal(unpack_bits(packed, bits, numel), codes)


def test_layout_is_most_significant_first():
    codes = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.uint8)
    assert pack_bits(codes, 1).tolist() == [0b10000001, 0b10000000]
    assert pack_bits(torch.tensor([3, 0, 1, 2], dtype=torch.uint8), 2).tolist() == [0b11000110]


def test_bool_and_multidimensional_non_contiguous_codes():
    mask = torch.rand(6, 11) > 0.5
    view = mask.t()  # non-contiguous
    packed = pack_bits(view, 1)
    assert packed.numel() == (66 + 7) // 8
    assert torch.equal(unpack_bits(packed, 1, 66).bool(), view.reshape(-1))


def test_bits_for():
    assert [bits_for(k) for k in (1, 2, 3, 4, 5, 15, 16, 17, 255, 256)] == [1, 1, 2, 2, 3, 4, 4, 5, 8, 8]
    with pytest.raises(ValueError, match="at least 1"):
        bits_for(0)


def test_bad_inputs_are_explained():
    with pytest.raises(ValueError, match=r"bits must be an integer in \[1, 8\], got 9"):
        pack_bits(torch.zeros(4, dtype=torch.uint8), 9)
    with pytest.raises(TypeError, match="uint8"):
        pack_bits(torch.zeros(4, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="truncated"):
        unpack_bits(torch.zeros(1, dtype=torch.uint8), 1, 9)


def test_scratch_reuses_and_survives_copies():
    scratch = Scratch()
    a = scratch.get("x", 10, torch.float32, "cpu")
    b = scratch.get("x", 5, torch.float32, "cpu")
    assert b.data_ptr() == a.data_ptr() and b.numel() == 5
    assert scratch.get("y", 5, torch.float32, "cpu").data_ptr() != a.data_ptr()
    clone = pickle.loads(pickle.dumps(scratch))
    assert clone.get("x", 3, torch.float32, "cpu").numel() == 3
    copy.deepcopy(scratch).clear()


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_lane_unpacking_inverts_lane_packing(bits):
    from mergecomp.kernels.packing import _unpack_lanes
    codes = torch.randint(0, 2 ** bits, (8 * 64,), dtype=torch.uint8)
    assert torch.equal(_unpack_lanes(pack_bits(codes, bits), bits), codes)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("numel", [1, 7, 9, 1001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_table_decode_matches_unpacking_then_mapping(bits, numel, dtype):
    from mergecomp.kernels.packing import decode_values
    gen = torch.Generator().manual_seed(bits * 7 + numel)
    packed = torch.randint(0, 256, (packed_nbytes(numel, bits),), generator=gen, dtype=torch.uint8)
    values = torch.randn(2 ** bits, generator=gen).to(dtype)
    expected = values[unpack_bits(packed, bits, numel).long()]
    got = decode_values(packed, bits, numel, values)
    assert got.dtype == dtype and got.shape == (numel,)
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))  # bit for bit


def test_table_decode_refuses_what_it_cannot_represent():
    from mergecomp.kernels.packing import decode_values
    packed = torch.zeros(2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="needs 4 values"):
        decode_values(packed, 2, 8, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="truncated"):
        decode_values(packed, 1, 17, torch.tensor([0.0, 1.0]))


def test_scratch_counter_is_kept_and_grown():
    scratch = Scratch()
    assert scratch.counter(5, "cpu").tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(scratch.counter(1000, "cpu"), torch.arange(1000, dtype=torch.int32))
    assert scratch.counter(3, "cpu").tolist() == [0, 1, 2]
