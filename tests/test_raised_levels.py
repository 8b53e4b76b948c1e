"""QSGD and TernGrad at more levels: what the quality controller raises for them."""
import pytest
import torch

from mergecomp.compressors import create
from mergecomp.compressors.raisedlevels import LevelsContext
from mergecomp.memories import create as create_memory


def _gradient(seed=0, n=20000):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=generator) * torch.rand(n, generator=generator) ** 3  # heavy-tailed


def _noise(compressor, tensor, name="g"):
    payload, ctx = compressor.compress(tensor, name)
    return float((compressor.decompress(payload, ctx) - tensor).norm() / tensor.norm()), payload, ctx


@pytest.mark.parametrize("name, steps", [("terngrad", ((1.0, 1, 2), (2.0, 7, 4), (3.0, 31, 6), (4.0, 127, 8), (16.0, 127, 8))),
                                         ("qsgd", ((1.0, 7, 4), (2.0, 127, 8), (16.0, 127, 8)))])
def test_more_bits_bring_more_levels_less_noise_and_the_wire_counts_each_byte(name, steps):
    tensor = _gradient()
    compressor = create(name)
    assert compressor.knob == "bits"
    noises = {}  # levels → noise
    for scale, levels, bits in steps:
        compressor.set_group_scale("g", scale)
        assert compressor.levels_of("g") == (levels, bits)
        noise, payload, ctx = _noise(compressor, tensor)
        assert isinstance(ctx, LevelsContext) == (scale > 1) and ctx.layout_fields == (("levels", "bits") if scale > 1 else ())
        on_wire = sum(part.numel() * part.element_size() for part in payload)
        assert compressor.wire_nbytes(tensor.numel(), 4, payload) == on_wire
        assert on_wire == -(-tensor.numel() * bits // 8) + 4 * -(-tensor.numel() // compressor.bucket_size)
        noises.setdefault(levels, noise)
    noises = list(noises.values())
    assert all(later < 0.5 * earlier for earlier, later in zip(noises, noises[1:])) and noises[-1] < 0.05
    assert compressor.wire_nbytes(tensor.numel(), 4) == -(-tensor.numel() * steps[0][2] // 8) \
        + 4 * -(-tensor.numel() // compressor.bucket_size)  # the planner's estimate: the configured codes


@pytest.mark.parametrize("name, options", [("terngrad", {}), ("terngrad", {"clip": None}), ("qsgd", {})])
def test_a_raised_group_stays_unbiased(name, options):
    """The mean of many raised payloads is the gradient: the clip is dropped with the levels raised."""
    tensor = _gradient(1, 4096)
    compressor = create(name, **options)
    compressor.set_group_scale("g", 2.0)
    mean = torch.stack([compressor.decompress(*compressor.compress(tensor, "g")) for _ in range(400)]).mean(0)
    single, _, _ = _noise(compressor, tensor)
    assert float((mean - tensor).norm() / tensor.norm()) < 2 * single / 400 ** 0.5


@pytest.mark.parametrize("name", ["terngrad", "qsgd"])
def test_a_group_the_controller_did_not_raise_keeps_its_format_bit_for_bit(name):
    tensor = _gradient(2)
    plain, steered = create(name, seed=3), create(name, seed=3)
    steered.set_group_scale("other", 4.0)
    (a, a_scales), ctx = plain.compress(tensor, "g")
    (b, b_scales), _ = steered.compress(tensor, "g")
    assert torch.equal(a, b) and torch.equal(a_scales, b_scales) and type(ctx).__name__ == "Context"
    # a rank's context decodes another rank's payload at the same (agreed) levels
    steered.set_group_scale("g", 2.0)
    payload, ctx = steered.compress(tensor, "g")
    assert torch.equal(plain.decompress(payload, ctx), steered.decompress(payload, ctx))


def test_qsgd_at_its_most_bits_has_no_knob():
    assert create("qsgd", levels=127).knob is None and create("qsgd", levels=63).knob == "bits"


def test_clipped_terngrad_is_read_as_noise_by_the_none_memory():
    """Its default clips (biased on the outliers), yet its error is noise around the gradient:
    the drift meter reads it, as it does an unbiased compressor's."""
    tensor = _gradient(3)
    terngrad = create("terngrad")
    assert terngrad.unbiased is False and terngrad.reads_noise
    assert create("qsgd").reads_noise and not create("topk").reads_noise and not create("signsgd").reads_noise
    memory = create_memory("none")
    memory.measuring = True
    payload, ctx = terngrad.compress(tensor, "g")
    memory.update(tensor, "g", terngrad, payload, ctx)
    error, incoming = memory.drift_terms("g")
    assert float(error) == pytest.approx(float((terngrad.decompress(payload, ctx) - tensor).square().sum()), rel=1e-5)
    assert float(incoming) == pytest.approx(float(tensor.square().sum()))
