"""Every registered compressor decodes what its plain reference (written from the paper) gives:
exactly for the deterministic ones, in distribution for the stochastic ones."""
import pytest
import torch

from mergecomp import compressors
from mergecomp.compressors.testing import check_reference

from .reference_compressors import REFERENCES, STOCHASTIC

#: Options that make the low-rank compressors factor the kit's small matrices.
OPTIONS = {"powersgd": dict(min_compression_rate=0.0, factor_dtype="fp32"), "atomo": dict(min_compression_rate=0.0)}
#: Tolerances (relative, and of the largest input) for results computed in fp32 by one side
#: and in fp64 by the other: factorisations and per-view sums.
TOLERANCE = {"powersgd": (1e-4, 1e-5), "batched_powersgd": (1e-4, 1e-5)}


def test_every_registered_compressor_has_a_reference():
    assert set(compressors.available()) <= set(REFERENCES)


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_compressor_agrees_with_its_reference(name):
    rtol, atol = TOLERANCE.get(name, (1e-5, 1e-6))
    check_reference(compressors.get(name), REFERENCES[name], kwargs=OPTIONS.get(name), stochastic=name in STOCHASTIC,
                    samples=1000, rtol=rtol, atol=atol)


@pytest.mark.parametrize("name, kwargs", [
    ("randk", dict(compress_ratio=0.25, unbiased=True, seed=3)),
    ("terngrad", dict(clip=1.0, bucket_size=33)),
    ("qsgd", dict(levels=2, bucket_size=16)),
    ("topk", dict(compress_ratio=0.3)),
    ("topk", dict(compress_ratio=0.05, wire_format="tight8")),
    ("graddrop", dict(compress_ratio=0.05, wire_format="tight8")),
    ("dgc", dict(compress_ratio=0.05, wire_format="auto")),
    ("dgc", dict(compress_ratio=0.05, fp16_values=True, wire_format="indexed")),
    ("dgc", dict(compress_ratio=0.05, wire_format="compact")),
    ("tbq", dict(threshold=0.1)),
])
def test_options_agree_with_the_reference(name, kwargs):
    check_reference(compressors.get(name), REFERENCES[name], kwargs=kwargs, stochastic=name in STOCHASTIC, samples=1000)


def test_a_wrong_reference_is_caught():
    """Top-k compared with a reference that keeps the k smallest magnitudes instead."""
    def smallest(compressor, x, layout, generator):
        flat = x.reshape(-1)
        k = max(1, int(flat.numel() * compressor.compress_ratio))
        out = torch.zeros_like(flat)
        chosen = flat.abs().argsort()[:k]
        out[chosen] = flat[chosen]
        return out.view(x.shape)
    with pytest.raises(AssertionError, match=r"\[reference\] TopKCompressor"):
        check_reference(compressors.get("topk"), smallest)


def test_a_biased_draw_is_caught():
    """QSGD compared with a reference that always rounds down (the right values, wrong odds)."""
    def rounds_down(compressor, x, layout, generator):
        s = compressor.levels
        norm = x.norm()
        return norm * x.sign() * (s * x.abs() / norm).floor() / s
    with pytest.raises(AssertionError, match="mean of coordinate"):
        check_reference(compressors.get("qsgd"), rounds_down, kwargs=dict(bucket_size=4096), stochastic=True, samples=300)
