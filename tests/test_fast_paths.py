"""The compressors' fast elementwise paths agree with the obvious torch expressions they replace."""
import pytest
import torch

from mergecomp.kernels import Scratch, pack_bits, random_int16, sign_bits, unpack_bits
from mergecomp.kernels.buckets import bucket_parts, norms_of_parts, peaks_of_parts
from mergecomp.kernels.quantize import dequantize, stochastic_codes
from mergecomp.kernels.selection import BLOCK, BlockPeaks, exact_top_k


def _sorted(indices):
    return torch.sort(indices.long()).values


@pytest.mark.parametrize("n", [1, 63, 64, 65, 1000, 64 * 50 + 7])
@pytest.mark.parametrize("quantile", [0.5, 0.99, 0.9999])
def test_block_selection_matches_a_full_comparison(n, quantile):
    g = torch.Generator().manual_seed(n)
    flat = torch.randn(n, generator=g)
    flat[n // 3: n // 3 + 40] *= 50  # a cluster of large values, as real layers have
    threshold = torch.quantile(flat.abs(), quantile)
    expected = (flat.abs() >= threshold).nonzero().view(-1)
    assert torch.equal(BlockPeaks(flat, Scratch()).indices_at_least(threshold), expected)


@pytest.mark.parametrize("n,k", [(10, 3), (64, 1), (1000, 1), (1000, 10), (5000, 50), (5000, 4000),
                                 (64 * 100 + 5, 200)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_exact_top_k_selects_what_torch_topk_selects(n, k, dtype):
    flat = torch.randn(n, generator=torch.Generator().manual_seed(k)).to(dtype)
    flat[: n // 4] *= 10
    got = exact_top_k(flat, k, Scratch())
    want = torch.topk(flat.abs().float(), k, sorted=False).indices
    assert got.numel() == k
    # Same magnitudes (ties may pick different positions of equal values).
    assert torch.equal(torch.sort(flat[got].abs().float()).values, torch.sort(flat[want].abs().float()).values)


def _clustered(kind, n=64 * 4000):
    g = torch.Generator().manual_seed(7)
    flat = torch.randn(n, generator=g)
    if kind == "one large layer":  # the k-th peak far below the k-th value: many candidates
        flat[: n // 8] *= 30
    elif kind == "half zeros":  # a layer without gradient: the k-th peak is zero, all n pass
        flat[n // 2:] = 0
    elif kind == "fewer nonzeros than k":
        flat[200:] = 0
    return flat


@pytest.mark.parametrize("kind", ["one large layer", "half zeros", "fewer nonzeros than k"])
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.02, 0.3])
def test_exact_top_k_on_clustered_gradients_selects_what_torch_topk_selects(kind, ratio):
    flat = _clustered(kind)
    k = int(flat.numel() * ratio)
    got = exact_top_k(flat, k, Scratch())
    want = torch.topk(flat.abs(), k, sorted=False).indices
    assert got.numel() == k and got.unique().numel() == k
    assert torch.equal(torch.sort(flat[got].abs()).values, torch.sort(flat[want].abs()).values)


def test_narrowing_keeps_at_least_k_and_only_the_largest():
    from mergecomp.kernels.selection import NARROW_ABOVE, narrowed
    magnitudes = torch.rand(100_000, generator=torch.Generator().manual_seed(3))
    k = 1000
    indices, kept = narrowed(None, magnitudes, k)
    assert k <= indices.numel() < NARROW_ABOVE * k
    assert torch.equal(magnitudes[indices], kept)
    assert kept.min() >= magnitudes.topk(indices.numel()).values.min()  # a threshold, not a sample


def test_narrowing_that_would_keep_fewer_than_k_gives_everything_back():
    from mergecomp.kernels.selection import narrowed
    magnitudes = torch.zeros(100_000)
    magnitudes[::64] = 1.0  # the strided sample sees only the ones: its threshold passes 1,563 < k
    indices, kept = narrowed(None, magnitudes, 5000)
    assert indices is None and kept is magnitudes


@pytest.mark.parametrize("where", [777, 64 * 1000 + 3])  # in a block, in the tail
@pytest.mark.parametrize("ratio", [0.01, 0.05])
def test_exact_top_k_ranks_a_nan_first_at_every_density(ratio, where):
    flat = torch.randn(64 * 1000 + 5, generator=torch.Generator().manual_seed(5))
    flat[where] = float("nan")
    got = exact_top_k(flat, int(flat.numel() * ratio), Scratch())
    assert where in got.tolist()


def test_block_selection_of_a_non_contiguous_tensor():
    base = torch.randn(2 * BLOCK * 10)
    strided = base[::2]
    threshold = torch.tensor(1.5)
    assert torch.equal(BlockPeaks(strided, Scratch()).indices_at_least(threshold),
                       (strided.abs() >= threshold).nonzero().view(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_sign_bits_are_the_negative_mask(dtype):
    x = torch.randn(1001).to(dtype)
    x[5] = 0.0
    assert torch.equal(sign_bits(x, Scratch()), (x < 0).to(torch.uint8))
    assert sign_bits(torch.tensor([-0.0], dtype=dtype), Scratch()).item() == 1  # the IEEE sign bit


def test_random_int16_is_uniform_over_all_bits():
    torch.manual_seed(0)
    lanes = random_int16(400_000, "cpu", Scratch()).clone()
    bits = (lanes.to(torch.int32).unsqueeze(1) >> torch.arange(16)) & 1
    # Each of the 16 bits (the sign bit of each lane included) is set half the time: σ = 0.0008.
    assert torch.allclose(bits.float().mean(0), torch.full((16,), 0.5), atol=0.005)
    torch.manual_seed(0)
    assert torch.equal(random_int16(400_000, "cpu", Scratch()), lanes)  # reproducible under manual_seed


@pytest.mark.parametrize("offset", [1, 7])
def test_stochastic_codes_are_unbiased_and_in_range(offset):
    torch.manual_seed(1)
    n, size = 1000, 64
    x = torch.empty(n).uniform_(-1, 1)
    x[::97] = 1.0  # the extremes round to themselves
    x[1::97] = -1.0
    scratch = Scratch()
    parts = bucket_parts(x, size, scratch)
    factors = torch.full((len(range(0, n, size)),), float(offset))
    total = torch.zeros(n)
    trials = 400
    for _ in range(trials):
        codes = stochastic_codes(parts, factors, offset, n, scratch)
        assert int(codes.max()) <= 2 * offset
        total += codes.float() - offset
    mean = total / trials
    # Each code is the level ±1 at most, so the mean's σ ≤ 0.5/√trials = 0.025.
    assert torch.allclose(mean, x * offset, atol=0.13)
    assert torch.equal(mean[::97], torch.full_like(mean[::97], float(offset)))


def test_dequantize_inverts_the_level_scale():
    codes = torch.tensor([0, 1, 2, 2, 1], dtype=torch.uint8)
    scales = torch.tensor([2.0, 10.0])
    assert torch.equal(dequantize(codes, 1, scales, 3, torch.float32), torch.tensor([-2.0, 0.0, 2.0, 10.0, 0.0]))


@pytest.mark.parametrize("magnitude", [1e-30, 1e-20, 1.0, 1e20, 1e30])
def test_bucket_norms_and_peaks_survive_extreme_magnitudes(magnitude):
    x = torch.randn(1000, dtype=torch.float64) * magnitude
    x[512:600] = 0.0
    parts = bucket_parts(x.float(), 100, Scratch())
    expected = x.view(10, 100).norm(dim=1).float()
    assert torch.allclose(norms_of_parts(parts), expected, rtol=1e-5, atol=0)
    assert torch.equal(peaks_of_parts(parts), x.float().view(10, 100).abs().amax(dim=1))


def test_bucket_parts_pad_only_the_tail():
    x = torch.arange(10.0)
    parts = bucket_parts(x, 4, Scratch())
    assert [tuple(p.shape) for p in parts] == [(2, 4), (1, 4)]
    assert parts[0].data_ptr() == x.data_ptr()  # whole buckets are a view, not a copy
    assert parts[1].tolist() == [[8.0, 9.0, 0.0, 0.0]]


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_unpacking_into_scratch_matches_fresh_buffers(bits):
    codes = torch.randint(0, 2 ** bits, (1003,), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    scratch = Scratch()
    assert torch.equal(unpack_bits(packed, bits, 1003, scratch), codes)
    assert torch.equal(unpack_bits(packed, bits, 1003, scratch), unpack_bits(packed, bits, 1003))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("numel", [1, 13, 1003])
def test_sign_decoding_is_what_unpacking_then_an_affine_map_gave(dtype, numel):
    from mergecomp.kernels import pack_signs, unpack_signs
    x = torch.randn(numel).to(dtype)
    packed = pack_signs(x, Scratch())
    old = unpack_bits(packed, 1, numel).to(dtype).mul_(-2).add_(1)
    got = unpack_signs(packed, numel, dtype)
    assert got.dtype == dtype and torch.equal(got, old)


def test_terngrad_levels_scale_like_the_affine_dequantisation():
    from mergecomp.kernels import decode_values
    from mergecomp.kernels.quantize import scale_levels
    codes = torch.randint(0, 3, (1000,), dtype=torch.uint8)
    scales = torch.rand(4) * 10
    scales[1] = 0.0
    for dtype in (torch.float32, torch.float16, torch.float64):
        levels = decode_values(pack_bits(codes, 2), 2, 1000, torch.tensor([-1.0, 0.0, 1.0, 2.0]))
        assert torch.equal(scale_levels(levels, scales, 300, dtype), dequantize(codes, 1, scales, 300, dtype))


def test_random_int16_differs_between_calls_and_handles_odd_lengths():
    scratch = Scratch()
    first = random_int16(1001, "cpu", scratch).clone()
    second = random_int16(1001, "cpu", scratch)
    assert first.numel() == second.numel() == 1001
    assert (first != second).float().mean() > 0.99


def test_stochastic_codes_above_int8_range_stay_unbiased():
    torch.manual_seed(2)
    offset, n = 100, 512
    x = torch.empty(n).uniform_(-1, 1)
    scratch = Scratch()
    parts = bucket_parts(x, n, scratch)
    factors = torch.full((1,), float(offset))
    total = torch.zeros(n)
    for _ in range(200):
        codes = stochastic_codes(parts, factors, offset, n, scratch)
        assert int(codes.max()) <= 2 * offset
        total += codes.float() - offset
    assert torch.allclose(total / 200, x * offset, atol=0.2)



def _run_both_paths(fn, monkeypatch):
    """fn() on the numpy kernels, then on the torch ops (as on a GPU), from the same seed
    (the native kernels, compared in test_native_kernels.py, are off for both)."""
    from mergecomp.kernels import native, numpy_cpu
    monkeypatch.setattr(native, "usable", lambda tensor: False)
    torch.manual_seed(3)
    with_numpy = fn()
    with monkeypatch.context() as patch:
        patch.setattr(numpy_cpu, "on_cpu", lambda tensor: False)
        torch.manual_seed(3)
        with_torch = fn()
    return with_numpy, with_torch


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("name", ["signsgd", "efsignsgd", "signum", "onebit", "terngrad", "qsgd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_numpy_and_torch_paths_give_the_same_bits(name, dtype, monkeypatch):
    """The CPU's numpy kernels and the torch ops that other devices run agree bit for bit:
    payloads (random bits included) and decoded tensors."""
    from mergecomp import compressors
    x = torch.randn(3001, generator=torch.Generator().manual_seed(5)).to(dtype)
    x[7] = -0.0

    def step():
        compressor = compressors.create(name)
        payload, ctx = compressor.compress(x, "g")
        return [p.clone() for p in payload], compressor.decompress(payload, ctx)

    (numpy_payload, numpy_decoded), (torch_payload, torch_decoded) = _run_both_paths(step, monkeypatch)
    assert all(_same_bits(a, b) for a, b in zip(numpy_payload, torch_payload))
    assert _same_bits(numpy_decoded, torch_decoded)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_packing_kernels_agree_between_numpy_and_torch(bits, monkeypatch):
    from mergecomp.kernels import decode_values
    codes = torch.randint(0, 2 ** bits, (1003,), dtype=torch.uint8)
    values = torch.randn(2 ** bits)

    def kernels():
        packed = pack_bits(codes, bits)
        return packed, unpack_bits(packed, bits, 1003).clone(), decode_values(packed, bits, 1003, values), \
            random_int16(1001, "cpu", Scratch()).clone()

    for a, b in zip(*_run_both_paths(kernels, monkeypatch)):
        assert _same_bits(a, b)


def test_random_subset_is_distinct_reproducible_and_uniform():
    from mergecomp.kernels import random_subset
    first = random_subset(10_000, 100, 4, "cpu")
    assert torch.equal(first, random_subset(10_000, 100, 4, "cpu"))
    assert not torch.equal(first, random_subset(10_000, 100, 5, "cpu"))
    assert first.dtype == torch.int64 and torch.unique(first).numel() == 100
    assert int(first.min()) >= 0 and int(first.max()) < 10_000
    # 2000 draws of 10 of 200: each index is picked 100 times on average (σ ≈ 9.7).
    counts = torch.zeros(200)
    for key in range(2000):
        counts[random_subset(200, 10, key, "cpu")] += 1
    assert counts.min() > 100 - 5 * 9.7 and counts.max() < 100 + 5 * 9.7

def test_a_sparse_sum_is_averaged_at_the_received_indices_only_with_the_dense_bits():
    """The allgather of a sparsifier divides its sum where payloads landed (repeats included)
    and gets the bits a division of the whole buffer gives; the rest stays zero."""
    from mergecomp.kernels import divide_at
    total = torch.zeros(1000)
    indices = torch.tensor([3, 500, 3, 999, 7], dtype=torch.int32)
    total.index_add_(0, indices.long(), torch.tensor([1.0, -2.5, 0.3, 1e-30, float("nan")]))
    dense = total.clone().div_(3)
    divide_at(total, indices, 3)
    assert torch.equal(total.isnan(), dense.isnan())
    assert torch.equal(total.nan_to_num(), dense.nan_to_num())


def _same_set_as_topk(magnitudes, k, got):
    want = torch.topk(magnitudes, k, sorted=False).indices
    assert got.numel() == k and got.unique().numel() == k
    assert torch.equal(torch.sort(magnitudes[got]).values, torch.sort(magnitudes[want]).values)


@pytest.mark.parametrize("kind", ["gaussian", "clustered", "few distinct values", "with infinities"])
@pytest.mark.parametrize("fraction", [0.001, 0.3, 0.67, 0.999])
def test_banded_top_selects_what_torch_topk_selects_in_ascending_order(kind, fraction):
    from mergecomp.kernels.selection import BAND_ABOVE, banded_top, top_positions
    g = torch.Generator().manual_seed(11)
    magnitudes = torch.randn(3 * BAND_ABOVE + 17, generator=g).abs()
    if kind == "clustered":
        magnitudes[: magnitudes.numel() // 10] *= 40
    elif kind == "few distinct values":  # ties everywhere, the bounds among them
        magnitudes = torch.randint(0, 5, magnitudes.shape, generator=g).float()
    elif kind == "with infinities":
        magnitudes[::1000] = float("inf")
    k = max(1, int(magnitudes.numel() * fraction))
    got = top_positions(magnitudes, k, ascending=True)
    _same_set_as_topk(magnitudes, k, got)
    assert bool((got.diff() > 0).all())
    banded = banded_top(magnitudes, k)
    if banded is not None:  # taken where the bounds held: the same positions
        assert torch.equal(banded, got)


def test_banded_top_gives_way_where_the_sample_misleads_and_where_topk_is_cheap():
    from mergecomp.kernels.selection import BAND_ABOVE, BAND_SAMPLES, banded_top, top_positions
    magnitudes = torch.zeros(4 * BAND_ABOVE)
    stride = magnitudes.numel() // BAND_SAMPLES
    magnitudes[1::stride] = 1.0  # between the samples: the sample sees only zeros
    k = magnitudes.numel() // stride // 2
    assert banded_top(magnitudes, k) is None
    _same_set_as_topk(magnitudes, k, top_positions(magnitudes, k, ascending=True))
    small = torch.rand(BAND_ABOVE)
    assert banded_top(small, 100) is None  # torch.topk is cheap enough there
    assert banded_top(torch.rand(2 * BAND_ABOVE), 2 * BAND_ABOVE) is None  # all of them: nothing to cut
