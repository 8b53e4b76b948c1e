"""The one-bit compressors at more bits: what the quality controller raises for them."""
import pytest
import torch

from mergecomp.compressors import create
from mergecomp.compressors.base import ParamView
from mergecomp.kernels.magnitudes import decode_magnitude_codes, magnitude_codes
from mergecomp.kernels.scratch import Scratch
from mergecomp.memories import create as create_memory

LAYOUT = (ParamView("a", torch.Size([600]), 0), ParamView("b", torch.Size([7]), 600),
          ParamView("c", torch.Size([393]), 607))


def _gradient(seed=0):
    generator = torch.Generator().manual_seed(seed)
    tensor = torch.randn(1000, generator=generator) * torch.rand(1000, generator=generator)
    tensor[607:] *= 30.0  # a view of much larger gradients
    tensor[600:607] = 0.0  # and one that is all zero here
    return tensor


def _error(tensor, decoded):
    return float((tensor - decoded).norm() / tensor.norm()) ** 2


@pytest.mark.parametrize("name", ["efsignsgd", "onebit"])
def test_more_bits_leave_less_error_and_the_wire_counts_each_byte(name):
    tensor = _gradient()
    compressor = create(name)
    errors = []
    for scale, bits in ((1.0, 1), (2.0, 2), (3.0, 2), (4.0, 4), (8.0, 8), (16.0, 8)):
        compressor.set_group_scale("g", scale)
        assert compressor.bits_of("g") == bits
        payload, ctx = compressor.compress(tensor, "g", LAYOUT)
        decoded = compressor.decompress(payload, ctx)
        on_wire = sum(part.numel() * part.element_size() for part in payload)
        assert compressor.wire_nbytes(tensor.numel(), 4, payload, LAYOUT) == on_wire
        if bits > 1:
            assert on_wire == -(-1000 * bits // 8) + 8 * len(LAYOUT)
            assert torch.equal(torch.signbit(decoded[tensor != 0]), torch.signbit(tensor[tensor != 0]))
        assert torch.all(decoded[600:607] == 0)  # the zero view decodes to zero
        errors.append(_error(tensor, decoded))
    assert errors[0] > errors[1] == errors[2] > errors[3] > errors[4] == errors[5]
    assert errors[1] < 0.5 * errors[0] and errors[4] < 0.01


def test_tbq_goes_from_its_two_bits_to_four_and_eight():
    tensor = _gradient()
    compressor = create("tbq")
    errors = []
    for scale, bits in ((1.0, 2), (2.0, 4), (3.0, 4), (4.0, 8), (16.0, 8)):
        compressor.set_group_scale("g", scale)
        assert compressor.bits_of("g") == bits and compressor.raised("g") == (bits > 2)
        payload, ctx = compressor.compress(tensor, "g", LAYOUT)
        on_wire = sum(part.numel() * part.element_size() for part in payload)
        assert compressor.wire_nbytes(tensor.numel(), 4, payload, LAYOUT) == on_wire
        if bits > 2:
            assert on_wire == -(-1000 * bits // 8) + 8 * len(LAYOUT)
        errors.append(_error(tensor, compressor.decompress(payload, ctx)))
    assert errors[0] > errors[1] == errors[2] > errors[3] == errors[4]


@pytest.mark.parametrize("name", ["efsignsgd", "onebit", "tbq"])
def test_a_group_the_controller_did_not_raise_keeps_its_one_bit_format_bit_for_bit(name):
    tensor = _gradient(1)
    plain, steered = create(name), create(name)
    steered.set_group_scale("other", 4.0)
    for a, b in zip(plain.compress(tensor, "g", LAYOUT)[0], steered.compress(tensor, "g", LAYOUT)[0]):
        assert torch.equal(a, b)
    # masking restarts the momentum of a one-bit group only while no group is raised
    assert plain.masks_sent_momentum("g")
    assert not steered.masks_sent_momentum("g") and not steered.masks_sent_momentum("other")


def test_codes_keep_signs_of_negative_zero_and_refuse_a_foreign_layout():
    flat = torch.tensor([0.5, -0.0, 0.0, -2.0, 3.0, -0.25, 1.0, 0.125, -1.5])
    spans = ((0, 4), (4, 5))
    packed, table = magnitude_codes(flat, spans, 2, Scratch())
    decoded = decode_magnitude_codes(packed, table, spans, 2, flat.numel(), flat.dtype)
    assert torch.equal(torch.signbit(decoded), torch.signbit(flat))
    with pytest.raises(ValueError, match="another layout"):
        decode_magnitude_codes(packed, table, ((0, 9),), 2, flat.numel(), flat.dtype)
    with pytest.raises(ValueError, match="2, 4, 8 bits per element, got 3"):
        magnitude_codes(flat, spans, 3, Scratch())


def test_codes_follow_the_input_dtype():
    flat = _gradient(2).to(torch.bfloat16)
    compressor = create("efsignsgd")
    compressor.set_group_scale("g", 4.0)
    payload, ctx = compressor.compress(flat, "g", LAYOUT)
    decoded = compressor.decompress(payload, ctx)
    assert decoded.dtype == torch.bfloat16 and _error(flat.float(), decoded.float()) < 0.1


@pytest.mark.parametrize("raised, masked", [({}, True), ({"g": 2.0}, False), ({"other": 4.0}, False)])
def test_masking_restarts_the_momentum_only_while_every_group_is_at_one_bit(raised, masked):
    """At one bit every coordinate was sent at its view's mean: a masking memory restarts the
    momentum of all of them; once the controller raised a group, the momentum is kept."""
    compressor = create("efsignsgd")
    for name, scale in raised.items():
        compressor.set_group_scale(name, scale)
    memory = create_memory("residual", momentum=0.9)
    memory.masking = True
    tensor = _gradient(3)
    compensated = memory.compensate(tensor, "g")
    payload, ctx = compressor.compress(compensated, "g", LAYOUT)
    memory.update(compensated, "g", compressor, payload, ctx)
    memory.commit()
    momentum = memory.momenta.committed()["g"]
    assert bool(torch.all(momentum[tensor != 0] == 0)) == masked
    assert bool(torch.any(momentum != 0)) != masked
