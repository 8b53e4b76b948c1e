"""The Triton kernels (mergecomp/kernels/triton) against the CPU paths they replace.

Each kernel must give the bits of its plain-torch/CPU reference: the wire format is shared,
so a payload made on a GPU must be the one a CPU makes (rand-k's indices above all, which
are never sent and must agree between ranks).  Without a GPU the kernels run on CPU
tensors in Triton's interpreter (TRITON_INTERPRET=1, set here before triton is imported:
it decides at import how kernels are built, so it stays set for the session); on a
machine with CUDA the same tests run the compiled kernels on the GPU, against the CPU
paths.  Sizes stay at or below 64K elements: the interpreter runs each program in numpy.

The compiled form is checked too, without a GPU: every kernel compiles for an H100
(sm_90) in a subprocess without the interpreter, and the stochastic rounding compiles
without fused multiply-adds (which would round differently from the CPU).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any import of triton's kernels

pytest.importorskip("triton", reason="triton is not installed: pip install mergecomp[gpu] (or "
                                     "triton==3.6.0) to test the GPU kernels, under its interpreter on a CPU")

from mergecomp import compressors  # noqa: E402
from mergecomp import kernels  # noqa: E402
import mergecomp.kernels.segments  # noqa: E402,F401  (kernels.segments)
from mergecomp.kernels import Scratch  # noqa: E402
from mergecomp.kernels import triton as gpu  # noqa: E402
from mergecomp.kernels.subsets import ROUNDS, feistel, half_bits, round_keys, torch_subset  # noqa: E402
from mergecomp.kernels.triton import finite, packing, quantize, scatter, segments, selection, subsets  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = [1, 7, 8, 9, 1003, 65_539]


@pytest.fixture
def kernels_on_device(monkeypatch):
    """Let the ops of mergecomp.kernels pick Triton for tensors on DEVICE (CPU tensors too,
    under the interpreter), as they do for CUDA tensors."""
    if DEVICE.type == "cpu":
        monkeypatch.setenv("MERGECOMP_TRITON", "interpret")
    return DEVICE


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu(), b.detach().cpu()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def _gradient(n: int, dtype=torch.float32, seed: int = 5) -> torch.Tensor:
    """Gaussian values of varied magnitudes, with zeros, a −0.0, and (n > 40) a NaN and ±Inf
    at the end only when asked for by the caller."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=generator) * torch.rand(n, generator=generator)
    if n > 20:
        x[3] = -0.0
        x[11::17] = 0.0
    return x.to(dtype)


def _cpu(function, *args, **kwargs):
    """``function`` on CPU copies of the tensor arguments, with the Triton backend off: the reference."""
    args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    with gpu.disabled():
        return function(*args, **kwargs)


# --- packing -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", SIZES)
def test_packing_unpacking_and_decoding_give_the_cpu_bits(bits, n):
    codes = torch.randint(0, 1 << bits, (n,), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    packed = packing.pack_bits(codes.to(DEVICE), bits)
    assert _same_bits(packed, _cpu(kernels.pack_bits, codes, bits))
    assert _same_bits(packing.unpack_bits(packed, bits, n), codes)
    for dtype in (torch.float32, torch.bfloat16) if n < 2000 else (torch.float32,):
        values = torch.randn(1 << bits, generator=torch.Generator().manual_seed(n)).to(dtype)
        decoded = packing.decode_values(packed, bits, n, values.to(DEVICE))
        assert _same_bits(decoded, _cpu(kernels.decode_values, packed, bits, n, values))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", [1, 9, 4099, 65_536])
def test_sign_bits_and_one_bit_sums_match_the_cpu(dtype, n):
    x = _gradient(n, dtype)
    if n > 40:
        x[-1], x[-2], x[-3] = float("nan"), float("inf"), -float("inf")
    assert _same_bits(packing.pack_signs(x.to(DEVICE)), _cpu(kernels.pack_signs, x, Scratch()))
    packed, total, absolute, negatives = packing.signs_and_side_sums(x.to(DEVICE))
    assert _same_bits(packed, _cpu(kernels.pack_signs, x, Scratch()))
    bits = x.view({torch.float64: torch.int64, torch.float32: torch.int32}.get(dtype, torch.int16))
    assert int(negatives) == int((bits < 0).sum())
    if n <= 40:  # finite: the sums agree with torch's to fp32 rounding
        assert torch.allclose(total.cpu(), x.float().sum(), rtol=1e-5, atol=1e-6)
        assert torch.allclose(absolute.cpu(), x.float().abs().sum(), rtol=1e-5, atol=1e-6)


def test_one_bit_means_match_the_cpu_to_rounding(kernels_on_device):
    x = _gradient(65_536)
    packed, means = kernels.signs_and_side_means(x.to(kernels_on_device), Scratch())
    expected_packed, expected_means = _cpu(kernels.signs_and_side_means, x, Scratch())
    assert _same_bits(packed, expected_packed)
    assert torch.allclose(means.cpu(), expected_means, rtol=1e-5)


# --- per-view sums and scales ----------------------------------------------------------------------------

#: Views of a 13,197-element group: tiny ones, an empty one, one over a block and one of exactly a block.
VIEW_SPANS = ((0, 3), (3, 0), (3, 5000), (5003, 4097), (9100, 4096), (13196, 1))


def test_the_block_table_cuts_the_grid_along_the_views():
    starts, ends, views, counts = segments.block_table(VIEW_SPANS, "cpu")
    assert counts.tolist() == [1, 0, 2, 2, 1, 1]
    for start, end, view in zip(starts.tolist(), ends.tolist(), views.tolist()):
        offset, size = VIEW_SPANS[view]
        assert offset <= start < end <= offset + size and end - start <= segments.BLOCK
    covered = sorted(i for start, end in zip(starts.tolist(), ends.tolist()) for i in range(start, end))
    assert covered == list(range(13_197))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_view_sums_match_the_cpu_to_rounding(dtype, kernels_on_device):
    x = _gradient(13_197, dtype)
    x[5003] = float("nan")  # stays in its own view's sum
    sums = kernels.segments.view_abs_sums(x.to(kernels_on_device), VIEW_SPANS)
    expected = _cpu(kernels.segments.view_abs_sums, x, VIEW_SPANS)
    assert torch.isnan(sums[3]) and torch.allclose(sums.cpu(), expected, rtol=1e-5, atol=1e-6, equal_nan=True)
    x[5003] = 1.0
    packed, total, absolute, negatives = kernels.segments.signs_and_view_side_sums(
        x.to(kernels_on_device), VIEW_SPANS, Scratch())
    expected = _cpu(kernels.segments.signs_and_view_side_sums, x, VIEW_SPANS, Scratch())
    assert _same_bits(packed, expected[0]) and torch.equal(negatives.cpu(), expected[3])
    assert torch.allclose(total.cpu(), expected[1], rtol=1e-5, atol=1e-5)
    assert torch.allclose(absolute.cpu(), expected[2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_scaling_views_gives_the_cpu_bits(dtype, kernels_on_device):
    x = _gradient(13_197, dtype)
    generator = torch.Generator().manual_seed(3)
    scales, shifts = torch.rand(6, generator=generator), torch.randn(6, generator=generator)
    scaled = kernels.segments.scale_views(x.clone().to(kernels_on_device), VIEW_SPANS, scales)  # in place
    assert _same_bits(scaled, _cpu(kernels.segments.scale_views, x.clone(), VIEW_SPANS, scales))
    bits = (x < 0).to(dtype)  # 1-bit SGD's use: μ⁺ + b·(μ⁻ − μ⁺) with b ∈ {0, 1}, exact products
    shifted = kernels.segments.scale_views(bits.clone().to(kernels_on_device), VIEW_SPANS, scales, shifts)
    assert _same_bits(shifted, _cpu(kernels.segments.scale_views, bits.clone(), VIEW_SPANS, scales, shifts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_zero_view_flags_and_clearing_give_the_cpu_bits(dtype, kernels_on_device):
    x = _gradient(13_197, dtype)
    x[5003:9100] = 0.0  # a view all zero
    x[9100:13_196] = -0.0  # one all −0.0
    x[3] = 1e-300 if dtype == torch.float64 else 0.0  # a value below fp32's range is not zero
    x[0:3] = float("nan")  # a NaN is not zero
    for spans in (VIEW_SPANS, ((0, 13_197),)):
        flags = kernels.segments.zero_view_flags(x.to(kernels_on_device), spans)
        expected = _cpu(kernels.segments.zero_view_flags, x, spans)
        assert _same_bits(flags, expected)
        cleared = kernels.segments.clear_flagged_views(x.clone().to(kernels_on_device), flags, spans)
        assert _same_bits(cleared, _cpu(kernels.segments.clear_flagged_views, x.clone(), expected, spans))


@pytest.mark.parametrize("name", ["efsignsgd", "onebit", "signsgd", "signum"])
def test_per_view_sign_compressors_send_and_decode_the_cpu_payload(name, kernels_on_device):
    from mergecomp.compressors.base import ParamView
    x = _gradient(13_197)
    x[5003:9100] = 0.0  # a view all zero: flagged
    layout = tuple(ParamView(f"p{i}", torch.Size([size]), offset) for i, (offset, size) in enumerate(VIEW_SPANS))
    payload, ctx = compressors.create(name).compress(x.to(kernels_on_device), "g", layout=layout)
    with gpu.disabled():
        expected, expected_ctx = compressors.create(name).compress(x.clone(), "g", layout=layout)
    for part, expected_part in zip(payload, expected):
        if part.is_floating_point():  # the per-view scales or means: sums, equal to rounding
            assert torch.allclose(part.cpu(), expected_part, rtol=1e-5, atol=1e-6)
        else:  # the sign bits and the zero-view flags
            assert _same_bits(part, expected_part)
    cpu_payload = [part.to(kernels_on_device) for part in expected]
    decoded = compressors.create(name).decompress(cpu_payload, ctx)
    with gpu.disabled():
        assert _same_bits(decoded, compressors.create(name).decompress(expected, expected_ctx))


# --- stochastic rounding ---------------------------------------------------------------------------------

def _qsgd_factors(x: torch.Tensor, levels: int, bucket: int) -> torch.Tensor:
    norms = _cpu(kernels.bucket_norms, x, bucket, Scratch())
    return torch.where(norms > 0, levels / norms, torch.zeros_like(norms))


@pytest.mark.parametrize("levels", [1, 2, 7, 15, 127])  # 2, 3, 4, 5 and 8 bits
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_stochastic_rounding_gives_the_cpu_bits_for_the_same_key(levels, dtype):
    x = _gradient(20_011, dtype)
    bits, bucket = kernels.bits_for(2 * levels + 1), 128
    factors = _qsgd_factors(x, levels, bucket)
    packed = quantize.quantize_packed(x.to(DEVICE), bucket, factors.to(DEVICE), levels, bits, 12345)
    expected = _cpu(kernels.quantize_packed, x, bucket, factors, levels, bits, Scratch(), key=12345)
    assert _same_bits(packed, expected)
    scales = torch.where(factors > 0, 1 / factors, torch.zeros_like(factors))
    decoded = quantize.dequantize_packed(packed, bits, x.numel(), levels, scales.to(DEVICE), bucket, dtype)
    assert _same_bits(decoded, _cpu(kernels.dequantize_packed, expected, bits, x.numel(), levels, scales,
                                    bucket, dtype, Scratch()))


def test_stochastic_rounding_is_reproducible_and_unbiased():
    # 64K elements at eight fractional levels of one scale: each element rounds up with the
    # probability of its fraction, so each level's mean code is its value (σ ≈ 0.5/√8192).
    fractions = torch.tensor([0.0, 0.1, 0.25, 0.5, 0.6, 0.75, 0.9, 0.999])
    x = fractions.repeat(8192)  # signed levels of s = 7, with a factor of 1 in every bucket
    factors = torch.ones(x.numel() // 128)
    first = quantize.quantize_packed(x.to(DEVICE), 128, factors.to(DEVICE), 7, 4, 99)
    assert _same_bits(first, quantize.quantize_packed(x.to(DEVICE), 128, factors.to(DEVICE), 7, 4, 99))
    assert not _same_bits(first, quantize.quantize_packed(x.to(DEVICE), 128, factors.to(DEVICE), 7, 4, 100))
    codes = packing.unpack_bits(first, 4, x.numel()).cpu().float() - 7
    means = codes.view(8192, 8).mean(dim=0)
    assert torch.all((means - fractions).abs() < 5 * 0.5 / 8192 ** 0.5), (means, fractions)


# --- rand-k's indices ------------------------------------------------------------------------------------

@pytest.mark.parametrize("numel, k", [(1, 1), (2, 1), (17, 17), (1000, 10), (65_537, 1_000), (25_000_000, 2_500),
                                      (2 ** 32, 100)])
def test_the_gpu_draws_the_cpu_indices_for_the_same_key(numel, k):
    for key in (0, 7, 2 ** 63 + 5):
        drawn = subsets.random_subset(numel, k, key, DEVICE)
        assert drawn.device.type == DEVICE.type
        assert torch.equal(drawn.cpu(), kernels.random_subset(numel, k, key, "cpu"))
        assert torch.equal(drawn.cpu(), torch_subset(numel, k, key, "cpu"))
    assert torch.unique(drawn).numel() == k and int(drawn.min()) >= 0 and int(drawn.max()) < numel


def _subsets_of_many_keys(n: int, k: int, draws: int) -> torch.Tensor:
    """(draws × k) indices, row key = the subset of key ``key``: the torch path's network
    with each row's round keys, all rows at once."""
    keys = [torch.tensor([round_keys(key)[r] for key in range(draws)]).repeat_interleave(k) for r in range(ROUNDS)]
    values = feistel(torch.arange(k).repeat(draws), half_bits(n), keys)
    outside = (values >= n).nonzero().view(-1)
    while outside.numel():  # cycle walking, as random_subset does
        walked = feistel(values[outside], half_bits(n), [key[outside] for key in keys])
        values[outside] = walked
        outside = outside[walked >= n]
    return values.view(draws, k)


def test_random_subsets_are_unbiased_and_pairs_independent():
    # 20,000 draws of 5 of 20: each index is drawn 5,000 times on average (σ ≈ 61), each pair
    # 1,053 times (σ ≈ 32); the CPU path gives the GPU's integers (test above).
    n, k, draws = 20, 5, 20_000
    drawn = _subsets_of_many_keys(n, k, draws)
    for key in (0, 1, draws - 1):
        assert torch.equal(drawn[key], kernels.random_subset(n, k, key, "cpu"))
    chosen = torch.zeros(draws, n).scatter_(1, drawn, 1.0)
    singles, pairs = chosen.sum(0), chosen.T @ chosen
    assert (singles - draws * k / n).abs().max() < 5 * (draws * k / n * (1 - k / n)) ** 0.5
    off_diagonal = pairs[~torch.eye(n, dtype=torch.bool)]
    expected = draws * k * (k - 1) / (n * (n - 1))
    assert (off_diagonal - expected).abs().max() < 5 * expected ** 0.5


def test_randk_payloads_are_the_cpu_payloads(kernels_on_device):
    x = _gradient(50_000)
    for unbiased in (False, True):
        made = []
        for device in (kernels_on_device, torch.device("cpu")):
            compressor = compressors.create("randk", compress_ratio=0.01, seed=3, unbiased=unbiased)
            if device.type == "cpu" and kernels_on_device.type == "cpu":
                with gpu.disabled():
                    payload, ctx = compressor.compress(x, "g")
                    decoded = compressor.decompress(payload, ctx)
            else:
                payload, ctx = compressor.compress(x.to(device), "g")
                decoded = compressor.decompress(payload, ctx)
            made.append((payload[0], ctx.indices, decoded))
        assert all(_same_bits(a, b) for a, b in zip(*made))


# --- threshold selection ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_sample_and_compaction_give_the_cpu_indices(dtype):
    x = _gradient(65_536 + 77, dtype)
    x[100], x[5000], x[7] = float("nan"), float("inf"), -float("inf")
    for stride in (1, 3, 100):
        sample = selection.sample_magnitudes(x.to(DEVICE), stride)
        expected = x[::stride].abs().nan_to_num(nan=0.0, posinf=torch.finfo(dtype).max)
        assert _same_bits(sample, expected)
    magnitudes = x.abs().nan_to_num(nan=0.0).sort().values
    blocks = kernels.BlockPeaks(x, Scratch())
    for threshold in (magnitudes[-1], magnitudes[-100], magnitudes[-5000], magnitudes[0], torch.tensor(1e30)):
        threshold = threshold.to(dtype)
        with gpu.disabled():
            expected = blocks.indices_at_least(threshold)
        assert torch.equal(selection.indices_at_least(x.to(DEVICE), threshold.to(DEVICE)).cpu(), expected)


@pytest.mark.parametrize("name, options", [("dgc", dict(compress_ratio=0.001, warmup=0)),
                                           ("dgc", dict(compress_ratio=0.01, warmup=0, fp16_values=True, wire_format="indexed")),
                                           ("graddrop", dict(compress_ratio=0.01)),
                                           ("topk", dict(compress_ratio=0.01, wire_format="indexed")),
                                           ("topk", dict(compress_ratio=0.01, wire_format="compact")),
                                           ("topk", dict(compress_ratio=0.01))])
def test_threshold_sparsifiers_send_the_cpu_payload(name, options, kernels_on_device):
    x = _gradient(65_536 + 5)
    compressor = compressors.create(name, **options)
    payload, ctx = compressor.compress(x.to(kernels_on_device), "g")
    with gpu.disabled():
        expected, expected_ctx = compressors.create(name, **options).compress(x, "g")
    values, indices = payload[:2]
    if len(payload) in (3, 4):  # a block wire: indices sorted, so the same bytes
        assert all(_same_bits(got, want) for got, want in zip(payload, expected))
    elif name == "topk":  # the same set: topk's order among candidates is torch.topk's
        order, expected_order = indices.cpu().argsort(), expected[1].argsort()
        assert torch.equal(indices.cpu()[order], expected[1][expected_order])
        assert _same_bits(values[order.to(values.device)], expected[0][expected_order])
    else:
        assert _same_bits(values, expected[0]) and _same_bits(indices, expected[1])
    dense = compressor.decompress_sum([payload, payload], ctx)
    assert _same_bits(dense, compressor.decompress_sum([expected, expected], expected_ctx))


# --- the sparse decode and the non-finite check ------------------------------------------------------------

@pytest.mark.parametrize("out_dtype, value_dtype", [(torch.float32, torch.float32), (torch.float32, torch.float16),
                                                    (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                                                    (torch.float64, torch.float32)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_scatter_gives_index_add_bits(out_dtype, value_dtype, index_dtype):
    generator = torch.Generator().manual_seed(1)
    base = torch.randn(30_000, generator=generator).to(out_dtype)
    indices = torch.randperm(30_000, generator=generator)[:3000].to(index_dtype)
    values = torch.randn(3000, generator=generator).to(value_dtype)
    values[0] = -0.0
    for mode in ("set", "add", "subtract"):
        if out_dtype == torch.bfloat16 and mode != "set" and gpu.interpreting():
            continue  # the interpreter holds bfloat16 as integers and adds them so atomically: GPU only
        got = scatter.scatter(base.clone().to(DEVICE), indices.to(DEVICE), values.to(DEVICE), mode)
        assert _same_bits(got, _cpu(kernels.scatter, base.clone(), indices, values, mode)), mode
    with pytest.raises(ValueError, match="scatter mode"):
        scatter.scatter(base.to(DEVICE), indices.to(DEVICE), values.to(DEVICE), "max")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_nonfinite_flag_finds_every_nan_and_inf(dtype):
    x = _gradient(40_000, dtype).to(DEVICE)
    assert not bool(finite.nonfinite_flag(x))
    assert not bool(finite.nonfinite_flag(torch.full((10,), torch.finfo(dtype).max, dtype=dtype, device=DEVICE)))
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[39_999] = bad
        flag = finite.nonfinite_flag(y)
        assert flag.dtype == torch.bool and flag.shape == () and flag.device.type == DEVICE.type and bool(flag)
        assert bool(finite.nonfinite_flag(y, torch.tensor([5, 39_999], device=DEVICE)))
        assert not bool(finite.nonfinite_flag(y, torch.tensor([5, 39_998], device=DEVICE)))
    assert not bool(finite.nonfinite_flag(x[:0]))


# --- whole compressors through the dispatch ----------------------------------------------------------------

QUANTISERS = [("signsgd", {}), ("efsignsgd", {}), ("signum", {}), ("onebit", {}), ("tbq", {}),
              ("terngrad", {}), ("terngrad", dict(clip=None)), ("qsgd", {}), ("qsgd", dict(levels=3)),
              ("qsgd", dict(levels=127))]


@pytest.mark.parametrize("name, options", QUANTISERS, ids=[f"{n}-{o}" for n, o in QUANTISERS])
def test_quantisers_send_and_decode_the_cpu_bits(name, options, kernels_on_device):
    x = _gradient(30_011)
    compressor = compressors.create(name, **options)
    payload, ctx = compressor.compress(x.to(kernels_on_device), "g")
    decoded = compressor.decompress(payload, ctx)
    with gpu.disabled():
        reference = compressors.create(name, **options)
        expected, expected_ctx = reference.compress(x, "g")
        expected_decoded = reference.decompress(expected, expected_ctx)
    assert all(p.device.type == kernels_on_device.type for p in payload)
    summed_scales = kernels_on_device.type == "cuda" and (
        name == "qsgd" or (name == "terngrad" and options.get("clip", 2.5) is not None))
    if name == "tbq":  # the measured thresholds are sums reduced in another order
        assert torch.allclose(payload[1].cpu(), expected[1], rtol=1e-5)
        codes = kernels.unpack_bits(payload[0].cpu(), 2, x.numel())
        assert (codes != kernels.unpack_bits(expected[0], 2, x.numel())).float().mean() < 1e-3
    elif name in ("onebit", "efsignsgd"):  # the means (scales) are sums reduced in another order
        assert _same_bits(payload[0], expected[0]) and torch.allclose(payload[-1].cpu(), expected[-1], rtol=1e-5)
        assert all(_same_bits(a, b) for a, b in zip(payload[1:-1], expected[1:-1]))  # EF-SignSGD's zero flags
        assert torch.allclose(decoded.cpu(), expected_decoded, rtol=1e-5)
    elif summed_scales:
        # The bucket scales come from sums (QSGD's norms, TernGrad's σ) reduced by the GPU in
        # its own order, so a code whose level lies within rounding of a step may differ;
        # given the same scales the codes are the CPU's bit for bit (the rounding test above).
        assert torch.allclose(payload[1].cpu(), expected[1], rtol=1e-5)
        bits = compressor.bits if name == "qsgd" else 2
        codes = kernels.unpack_bits(payload[0].cpu(), bits, x.numel())
        assert (codes != kernels.unpack_bits(expected[0], bits, x.numel())).float().mean() < 1e-3
    else:
        assert all(_same_bits(a, b) for a, b in zip(payload, expected))
        assert _same_bits(decoded, expected_decoded)


# --- dispatch and compilation -------------------------------------------------------------------------------

def test_cpu_tensors_keep_their_paths_unless_asked(monkeypatch):
    cpu_tensor = torch.zeros(4)
    monkeypatch.delenv("MERGECOMP_TRITON", raising=False)
    assert not gpu.usable(cpu_tensor)
    monkeypatch.setenv("MERGECOMP_TRITON", "0")
    assert not gpu.usable(torch.zeros(4, device=DEVICE))
    monkeypatch.setenv("MERGECOMP_TRITON", "sometimes")
    with pytest.raises(ValueError, match="MERGECOMP_TRITON='sometimes'"):
        gpu.usable(torch.zeros(4, device=DEVICE))
    monkeypatch.setenv("MERGECOMP_TRITON", "interpret")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        gpu.usable(cpu_tensor)


def test_a_cpu_run_never_imports_triton():
    script = textwrap.dedent("""
        import sys, torch
        from mergecomp import compressors
        for name in ("qsgd", "randk", "dgc", "signsgd"):
            compressor = compressors.create(name)
            payload, ctx = compressor.compress(torch.randn(5000), "g")
            compressor.decompress(payload, ctx)
        print("triton" in sys.modules)
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MERGECOMP_TRITON")}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_every_kernel_compiles_for_an_h100_without_fused_multiply_adds_in_the_rounding():
    """Compiled (not interpreted) in a subprocess for sm_90 by Triton's own compiler: what a
    GPU would build, type errors the interpreter lets pass included."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MERGECOMP_TRITON")}
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "triton_compile.py"), "--arch", "90", "--quick"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
