"""Bytes on the wire equal each compressor's own formula, ``wire_nbytes``.

Every registered compressor must state its wire format: a ``wire_nbytes(numel,
element_size, payload=None, layout=None)`` method next to its algorithm (or, for one whose
file does not define it yet, a formula here); a new compressor with neither fails
``test_every_registered_compressor_has_a_formula``, so none can quietly send a byte per sign.
The formulas of the variable-size compressors read the count from the payload and check
it against their bound.
"""
import math

import pytest
import torch

from mergecomp import compressors
from mergecomp.compressors.testing import make_input, run_step, several_views, wire_formula


def ceil_div(a, b):
    return -(-a // b)


#: Formulas of compressors whose class has no ``wire_nbytes``: (compressor) → formula.
FALLBACK = {}


def formula_of(name, compressor):
    own = wire_formula(compressor)
    if own is not None:
        return own
    return FALLBACK[name](compressor) if name in FALLBACK else None


def test_every_registered_compressor_has_a_formula():
    missing = sorted(name for name in compressors.available()
                     if formula_of(name, compressors.create(name)) is None)
    assert not missing, (f"compressors {missing} state no wire size: give each a method "
                         f"wire_nbytes(numel, element_size, payload=None, layout=None) with the exact bytes")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("numel", [0, 1, 7, 1000, 4099, 100_003])
@pytest.mark.parametrize("name", sorted(compressors.available()))
def test_payload_bytes_match_the_formula(name, numel, dtype):
    torch.manual_seed(0)
    compressor = compressors.create(name)
    if name == "atomo" and numel > 5000:
        pytest.skip("an SVD of this size adds nothing to the byte count check")
    tensor = make_input("gaussian", numel, dtype).tensor
    step = run_step(compressor, tensor)
    expected = formula_of(name, compressor)(numel, tensor.element_size(), payload=step.payload)
    assert step.nbytes == expected, f"{name} sends {step.nbytes} bytes for {numel} elements, the format says {expected}"


@pytest.mark.parametrize("numel", [38, 4099])
@pytest.mark.parametrize("name", sorted(compressors.available()))
def test_payload_bytes_match_the_formula_with_a_layout(name, numel):
    torch.manual_seed(0)
    compressor = compressors.create(name)
    layout = several_views(numel)
    tensor = make_input("sparse", numel).tensor
    step = run_step(compressor, tensor, layout=layout)
    expected = formula_of(name, compressor)(numel, tensor.element_size(), payload=step.payload, layout=layout)
    assert step.nbytes == expected, f"{name} sends {step.nbytes} bytes for {numel} elements in 3 views, " \
                                    f"the format says {expected}"


@pytest.mark.parametrize("name, kwargs", [("dgc", dict(fp16_values=True, wire_format="indexed")),
                                          ("dgc", dict(index_bits=64, wire_format="indexed")),
                                          ("dgc", dict(wire_format="compact")),
                                          ("dgc", dict(wire_format="tight8")),
                                          ("dgc", dict(compress_ratio=0.004, wire_format="auto")),
                                          ("topk", dict(compress_ratio=0.002, wire_format="auto")),
                                          ("topk", dict(compress_ratio=0.05, wire_format="tight8")),
                                          ("graddrop", dict(compress_ratio=0.05, wire_format="tight8")),
                                          ("qsgd", dict(levels=127, bucket_size=100)),
                                          ("terngrad", dict(bucket_size=33)), ("randk", dict(compress_ratio=0.3)),
                                          ("topk", dict(compress_ratio=0.5)), ("graddrop", dict(compress_ratio=0.2))])
def test_options_that_change_the_format_are_in_the_formula(name, kwargs):
    compressor = compressors.create(name, **kwargs)
    tensor = make_input("gaussian", 3001).tensor
    step = run_step(compressor, tensor)
    assert step.nbytes == wire_formula(compressor)(3001, 4, payload=step.payload)


def test_variable_size_formulas_check_the_payload_against_the_bound():
    dgc = compressors.create("dgc", compress_ratio=0.01)
    (codes, offsets, counts, scale), _ = dgc.compress(torch.randn(1000), "g")
    too_many = (torch.cat([codes, codes]), torch.cat([offsets, offsets]), counts, scale)
    with pytest.raises(ValueError, match="at most k = 10"):
        dgc.wire_nbytes(1000, 4, payload=too_many)
    assert dgc.wire_nbytes(1000, 4) == 10 * 2 + 4 + 4  # without a payload: the bound (tight wire: 4 block counts)
    indexed = compressors.create("dgc", compress_ratio=0.01, wire_format="indexed")
    (values, indices), _ = indexed.compress(torch.randn(1000), "g")
    with pytest.raises(ValueError, match="at most k = 10"):
        indexed.wire_nbytes(1000, 4, payload=(torch.cat([values, values]), torch.cat([indices, indices])))
    assert indexed.wire_nbytes(1000, 4) == 10 * 8
    graddrop = compressors.create("graddrop")
    with pytest.raises(ValueError, match="pass the payload"):
        graddrop.wire_nbytes(1000, 4)


def test_sign_flags_cost_one_bit_per_view():
    views = tuple(compressors.ParamView(f"p{i}", torch.Size([10]), 10 * i) for i in range(9))
    for name, extra in (("signsgd", 0), ("signum", 0), ("efsignsgd", 4 * 9)):  # EF-SignSGD: a scale per view
        payload, _ = compressors.create(name).compress(torch.randn(90), "g", layout=views)
        assert sum(p.numel() * p.element_size() for p in payload) == ceil_div(90, 8) + ceil_div(9, 8) + extra


def test_onebit_sends_two_means_per_view():
    views = tuple(compressors.ParamView(f"p{i}", torch.Size([10]), 10 * i) for i in range(9))
    payload, _ = compressors.create("onebit").compress(torch.randn(90), "g", layout=views)
    assert sum(p.numel() * p.element_size() for p in payload) == ceil_div(90, 8) + 8 * 9


@pytest.mark.parametrize("name, kwargs, bits", [("qsgd", dict(levels=1), 2), ("qsgd", dict(levels=3), 3),
                                                ("qsgd", dict(levels=127), 8)])
def test_qsgd_spends_the_fewest_bits(name, kwargs, bits):
    compressor = compressors.create(name, bucket_size=1000, **kwargs)
    payload, _ = compressor.compress(torch.randn(1000), "g")
    assert payload[0].numel() == ceil_div(1000 * bits, 8)
    assert compressor.wire_nbytes(1000, 4) == ceil_div(1000 * math.ceil(math.log2(2 * kwargs["levels"] + 1)), 8) + 4


def test_sign_compressors_really_send_one_bit_per_element():
    for name in ("signsgd", "signum", "efsignsgd", "onebit"):
        payload, _ = compressors.create(name).compress(torch.randn(8000), "g")
        assert payload[0].numel() == 1000, f"{name} sends {payload[0].numel()} bytes of signs for 8000 elements"
