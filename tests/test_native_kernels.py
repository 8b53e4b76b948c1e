"""The fused C kernels (mergecomp/kernels/native_kernels.c) against the torch/numpy paths.

Both paths must put the same bits on the wire and decode to the same bits, so that ranks
with and without a compiled library interoperate and results do not depend on the build.
The exceptions are sums (1-bit SGD's means, QSGD's norms), which the kernels accumulate in
another order (and in double): those are compared to within an ulp or two, and QSGD's
codes are compared given the same norms.
"""
from __future__ import annotations

import pytest
import torch

from mergecomp import compressors
from mergecomp.kernels import Scratch, native, pack_bits, random_key, unpack_bits
from mergecomp.kernels.buckets import bucket_parts
from mergecomp.kernels.quantize import dequantize, stochastic_codes

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no native kernels: {native.status()}")

SIZES = [1, 7, 8, 513, 4099, 20_011]


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def _gradient(n, dtype=torch.float32, seed=5):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    x *= torch.rand(n, generator=torch.Generator().manual_seed(seed + 1))
    if n > 20:
        x[3] = -0.0
        x[11::17] = 0.0
    return x.to(dtype)


def _both_paths(name, x, monkeypatch, **options):
    """(payload, decoded) through the native kernels, then through the torch/numpy path."""
    results = []
    for use_native in (True, False):
        with monkeypatch.context() as patch:
            if not use_native:
                patch.setattr(native, "usable", lambda tensor: False)
            compressor = compressors.create(name, **options)
            torch.manual_seed(11)
            payload, ctx = compressor.compress(x, "g")
            results.append(([p.clone() for p in payload], compressor.decompress(payload, ctx)))
    return results


@pytest.mark.parametrize("name", ["signsgd", "efsignsgd", "signum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", SIZES)
def test_sign_compressors_give_the_same_bits(name, dtype, n, monkeypatch):
    (native_payload, native_decoded), (torch_payload, torch_decoded) = _both_paths(name, _gradient(n, dtype), monkeypatch)
    assert all(_same_bits(a, b) for a, b in zip(native_payload, torch_payload))
    assert _same_bits(native_decoded, torch_decoded)


@pytest.mark.parametrize("options", [{}, {"bucket_size": 33}, {"bucket_size": 1}, {"clip": 2.5, "bucket_size": 100}])
@pytest.mark.parametrize("n", SIZES)
def test_terngrad_gives_the_same_bits(options, n, monkeypatch):
    (native_payload, native_decoded), (torch_payload, torch_decoded) = \
        _both_paths("terngrad", _gradient(n), monkeypatch, **options)
    assert all(_same_bits(a, b) for a, b in zip(native_payload, torch_payload))
    assert _same_bits(native_decoded, torch_decoded)


@pytest.mark.parametrize("n", SIZES)
def test_onebit_sends_the_same_bits_and_means_within_an_ulp(n, monkeypatch):
    (native_payload, native_decoded), (torch_payload, torch_decoded) = _both_paths("onebit", _gradient(n), monkeypatch)
    assert _same_bits(native_payload[0], torch_payload[0])
    assert torch.allclose(native_payload[1], torch_payload[1], rtol=1e-6, atol=0)
    assert torch.allclose(native_decoded, torch_decoded, rtol=1e-6, atol=0)


@pytest.mark.parametrize("levels, bucket_size", [(7, 512), (1, 512), (3, 100), (15, 7), (127, 64)])
@pytest.mark.parametrize("n", SIZES)
def test_qsgd_codes_and_decoding_match_given_the_same_norms(levels, bucket_size, n):
    """Codes 2 to 8 bits wide (3 and 5 bits are not byte-aligned), several bucket sizes."""
    x = _gradient(n)
    bits = compressors.create("qsgd", levels=levels).bits
    norms = native.bucket_norms(x, bucket_size)
    parts = bucket_parts(x, bucket_size, Scratch())
    factors = torch.where(norms > 0, levels / norms, torch.zeros_like(norms))
    torch.manual_seed(2)
    key = random_key(n)
    packed = native.stochastic_codes(x, bucket_size, factors, levels, key, bits)
    torch.manual_seed(2)
    expected = pack_bits(stochastic_codes(parts, factors, levels, n, Scratch()), bits)
    assert _same_bits(packed, expected)
    decoded = native.dequantize(packed, n, bits, bucket_size, norms / levels, levels)
    reference = dequantize(unpack_bits(packed, bits, n), levels, norms / levels, bucket_size, torch.float32)
    assert _same_bits(decoded, reference)


@pytest.mark.parametrize("scale", [1.0, 1e-30, 1e30])
def test_bucket_norms_are_accurate_without_rescaling(scale):
    """Buckets whose fp32 squares overflow (1e30) or vanish (1e-30) are redone in double."""
    x = _gradient(5000) * scale
    exact = torch.linalg.vector_norm(torch.nn.functional.pad(x.double(), (0, 120)).view(-1, 512), dim=1)
    norms = native.bucket_norms(x, 512)
    assert torch.isfinite(norms).all() and (norms > 0).all()
    assert torch.allclose(norms.double(), exact, rtol=1e-6, atol=0)


def test_qsgd_on_the_native_path_decodes_to_levels_next_to_the_input():
    """Each value is ℓ·‖bucket‖/s with ℓ one of the two levels around s·v/‖bucket‖."""
    x = _gradient(100_000)
    compressor = compressors.create("qsgd")
    payload, ctx = compressor.compress(x, "g")
    decoded = compressor.decompress(payload, ctx)
    assert decoded.shape == x.shape and decoded.dtype == x.dtype
    unit = (payload[1] / 7).repeat_interleave(compressor.bucket_size)[: x.numel()]
    levels, exact = decoded / unit, x / unit
    assert torch.allclose(levels, levels.round(), atol=1e-4)
    assert ((levels - exact).abs() < 1 + 1e-4).all()


def test_truncated_payloads_raise_instead_of_reading_past_them():
    x = _gradient(4099)
    with pytest.raises(ValueError, match="truncated"):
        native.decode_bits(native.pack_signs(x)[:-1], 4099, torch.tensor([1.0, -1.0]))
    packed = native.stochastic_codes(x, 512, torch.ones(9), 7, 1, 4)
    with pytest.raises(ValueError, match="truncated"):
        native.dequantize(packed[:100], 4099, 4, 512, torch.ones(9), 7)
    with pytest.raises(ValueError, match="scales"):
        native.dequantize(packed, 4099, 4, 512, torch.ones(3), 7)


def test_kernels_refuse_dtypes_they_do_not_handle():
    with pytest.raises(TypeError, match="float16"):
        native.stochastic_codes(torch.ones(10, dtype=torch.float16), 4, torch.ones(3), 1, 0, 2)


def test_a_stale_build_or_the_switch_falls_back_with_a_reason(monkeypatch):
    monkeypatch.setattr(native, "_loaded", False)
    monkeypatch.setattr(native, "ABI_VERSION", native.ABI_VERSION + 1000)
    assert native.library() is None and "stale build" in native.status()
    monkeypatch.setattr(native, "_loaded", False)
    monkeypatch.setenv("MERGECOMP_NATIVE", "0")
    assert native.library() is None and "MERGECOMP_NATIVE" in native.status()
    # the compressors still work, on the torch/numpy path
    compressor = compressors.create("terngrad")
    payload, ctx = compressor.compress(_gradient(1000), "g")
    assert compressor.decompress(payload, ctx).shape == (1000,)
    monkeypatch.setattr(native, "_loaded", False)
    monkeypatch.delenv("MERGECOMP_NATIVE")
    monkeypatch.setattr(native, "ABI_VERSION", native.ABI_VERSION - 1000)
    assert native.library() is not None


@pytest.mark.parametrize("n", [64, 65, 64 * 333 + 5])
def test_block_peaks_of_the_sparsifiers_match_the_torch_reductions(n, monkeypatch):
    from mergecomp.kernels.selection import BlockPeaks
    flat = _gradient(n)
    native_peaks = BlockPeaks(flat, Scratch()).peaks
    monkeypatch.setattr(native, "usable", lambda tensor: False)
    assert torch.equal(native_peaks, BlockPeaks(flat, Scratch()).peaks)


@pytest.mark.parametrize("n", [5, 64, 64 * 333 + 5, 64 * 5000 + 63])
@pytest.mark.parametrize("cut", [0.0, 0.5, 1.5, 2.5, 9.0, float("nan")])
def test_threshold_selection_gives_the_torch_paths_indices(n, cut):
    """The native selection returns exactly the elements at or above the threshold, ascending,
    as the torch path does whether it gathers the passing blocks or takes one pass over all:
    the tail tested, a NaN never selected, the other elements of its block as anywhere."""
    from mergecomp.kernels.selection import BlockPeaks
    flat = _gradient(n, seed=9)
    if n > 200:
        flat[100] = float("nan")
        flat[130] = float("inf")
        flat[-1] = 5.0  # in the tail when there is one
    threshold = torch.tensor(cut)
    fused = BlockPeaks(flat, Scratch()).indices_at_least(threshold)
    assert fused.dtype == torch.int64
    assert torch.equal(fused, (flat.abs() >= threshold).nonzero().view(-1))
    with native.disabled():
        assert torch.equal(fused, BlockPeaks(flat, Scratch()).indices_at_least(threshold))


def test_threshold_selection_grows_its_work_space_and_returns_its_own_tensor():
    """More indices pass than the work space holds: it grows, the selection is read again,
    and the result does not share the work space (a later selection does not change it)."""
    from mergecomp.kernels.selection import BlockPeaks
    scratch, flat = Scratch(), _gradient(64 * 100, seed=2)
    first = BlockPeaks(flat, scratch).indices_at_least(torch.tensor(-1.0))  # every element
    assert torch.equal(first, torch.arange(flat.numel()))
    BlockPeaks(flat.neg(), scratch).indices_at_least(torch.tensor(0.5))
    assert torch.equal(first, torch.arange(flat.numel()))


@pytest.mark.parametrize("scale", [None, 0.37])
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("n", SIZES + [64 * 300 + 5])
def test_dgc_momentum_correction_gives_the_same_bits_and_the_velocity_peaks(nesterov, n, scale):
    from mergecomp.kernels.momentum import momentum_correction
    from mergecomp.kernels.selection import BLOCK, attached_peaks
    g, u, v = _gradient(n, seed=1), _gradient(n, seed=3), _gradient(n, seed=7)
    if n > 40:
        g[40] = float("nan")  # a NaN block's peak is NaN on both paths
    fused = momentum_correction(g, u, v, 0.9, nesterov, torch.empty(n), torch.empty(n), scale)
    with native.disabled():
        plain = momentum_correction(g, u, v, 0.9, nesterov, torch.empty(n), torch.empty(n), scale)
    assert all(_same_bits(a, b) for a, b in zip(fused, plain))
    whole = n // BLOCK
    peaks = attached_peaks(fused[1].reshape(-1))
    assert peaks is not None and attached_peaks(plain[1]) is None
    assert _same_bits(peaks, native.bucket_peaks(fused[1][: whole * BLOCK], BLOCK))
    fused[1].mul_(2)  # changed in place: the attached peaks are stale and not used
    assert attached_peaks(fused[1]) is None


def test_dgc_memory_and_compressor_send_the_same_bits_on_both_paths():
    from mergecomp import memories

    def run():
        memory, compressor, sent = memories.create("dgc", clip_norm=3.0), compressors.create("dgc"), []
        for step in range(3):
            velocity = memory.compensate(_gradient(64 * 500 + 3, seed=step), "g")
            payload, ctx = compressor.compress(velocity, "g")
            memory.update(velocity, "g", compressor, payload, ctx)
            memory.commit()
            sent += list(payload)
        return sent + list(memory.state_dict()["momenta"].values()) + list(memory.state_dict()["velocities"].values())
    fused = run()
    with native.disabled():
        plain = run()
    assert all(_same_bits(a, b) for a, b in zip(fused, plain))


def test_dgc_selection_finds_the_velocity_peaks_at_every_step(monkeypatch):
    """The momentum correction's block peaks reach the selection at every step, also once
    the memory writes into velocities it recycled (views of an earlier step's tensor): the
    selection never reads the velocity again for them."""
    from mergecomp import memories
    reads = []
    bucket_peaks = native.bucket_peaks
    monkeypatch.setattr(native, "bucket_peaks", lambda *args: reads.append(1) or bucket_peaks(*args))
    memory, compressor = memories.create("dgc"), compressors.create("dgc", warmup=0)
    for step in range(5):
        velocity = memory.compensate(_gradient(64 * 500 + 3, seed=step), "g")
        payload, ctx = compressor.compress(velocity, "g")
        memory.update(velocity, "g", compressor, payload, ctx)
        memory.commit()
    assert reads == []
