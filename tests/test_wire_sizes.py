"""Bytes on the wire equal each compressor's theoretical size plus a small fixed header.

Every registered compressor must have a formula here: a new compressor that is not
listed fails ``test_every_registered_compressor_has_a_formula``, so none can quietly send
a byte per sign.  Formulas take n, the input's element size, the compressor and the
payload (for the variable-size ones, whose count of values or atoms varies per step).
"""
import math

import pytest
import torch

from mergecomp import compressors
from mergecomp.compressors.loopback import run_locally
from mergecomp.compressors.matrix import matrix_shape
from mergecomp.compressors.topk import num_selected


def ceil_div(a, b):
    return -(-a // b)


def dgc(n, size, compressor, payload):
    values, indices = payload
    assert values.numel() <= num_selected(n, compressor.density()), "DGC sent more than k values"
    return values.numel() * (size + 4)


def atomo(n, size, compressor, payload):
    rows, cols = matrix_shape(torch.Size([n]))
    return 4 * payload[1].numel() * (rows + cols + 1)


def batched_powersgd(n, size, compressor, payload):
    rows, cols = matrix_shape(torch.Size([n]))
    return 4 * min(compressor.rank, rows, cols) * (rows + cols)


FORMULAS = {
    "none": lambda n, size, c, p: n * size,
    "fp32": lambda n, size, c, p: n * size,
    "fp16": lambda n, size, c, p: 2 * n,
    "bf16": lambda n, size, c, p: 2 * n,
    "topk": lambda n, size, c, p: num_selected(n, c.compress_ratio) * (size + 4),
    "randk": lambda n, size, c, p: num_selected(n, c.compress_ratio) * size,
    "dgc": dgc,
    "graddrop": lambda n, size, c, p: p[0].numel() * (size + 4),
    "signsgd": lambda n, size, c, p: ceil_div(n, 8),
    "signum": lambda n, size, c, p: ceil_div(n, 8),
    "efsignsgd": lambda n, size, c, p: ceil_div(n, 8) + 4,
    "onebit": lambda n, size, c, p: ceil_div(n, 8) + 8,
    "tbq": lambda n, size, c, p: ceil_div(n, 4),
    "terngrad": lambda n, size, c, p: ceil_div(n, 4) + 4 * ceil_div(n, c.bucket_size),
    "qsgd": lambda n, size, c, p: ceil_div(n * math.ceil(math.log2(2 * c.levels + 1)), 8)
    + 4 * ceil_div(n, c.bucket_size),
    "atomo": atomo,
    # Per layer: a 1-D tensor without a layout is one 1-D parameter, sent raw
    # (tests/test_lowrank.py checks the bytes of layouts with matrices).
    "powersgd": lambda n, size, c, p: n * size,
    "batched_powersgd": batched_powersgd,
}


def test_every_registered_compressor_has_a_formula():
    missing = sorted(set(compressors.available()) - set(FORMULAS))
    assert not missing, (f"compressors {missing} have no wire-size formula in tests/test_wire_sizes.py: "
                         f"add the exact bytes they send for n elements")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("numel", [1, 7, 1000, 4099, 100_003])
@pytest.mark.parametrize("name", sorted(FORMULAS))
def test_payload_bytes_match_the_formula(name, numel, dtype):
    if name not in compressors.available():
        pytest.fail(f"{name} has a formula but is not registered")
    torch.manual_seed(0)
    compressor = compressors.create(name)
    tensor = torch.randn(numel, dtype=dtype)
    if name == "atomo" and numel > 5000:
        pytest.skip("an SVD of this size adds nothing to the byte count check")
    if compressor.multi_round:
        payload = None
        _, sent = run_locally(compressor, tensor, "g")
    else:
        payload, _ = compressor.compress(tensor, "g")
        sent = sum(t.numel() * t.element_size() for t in payload)
    expected = FORMULAS[name](numel, tensor.element_size(), compressor, payload)
    assert sent == expected, f"{name} sends {sent} bytes for {numel} elements, the format says {expected}"


@pytest.mark.parametrize("name, kwargs, bits", [("qsgd", dict(levels=1), 2), ("qsgd", dict(levels=3), 3),
                                                ("qsgd", dict(levels=127), 8)])
def test_qsgd_spends_the_fewest_bits(name, kwargs, bits):
    compressor = compressors.create(name, bucket_size=1000, **kwargs)
    payload, _ = compressor.compress(torch.randn(1000), "g")
    assert payload[0].numel() == ceil_div(1000 * bits, 8)


def test_sign_compressors_really_send_one_bit_per_element():
    for name in ("signsgd", "signum", "efsignsgd", "onebit"):
        payload, _ = compressors.create(name).compress(torch.randn(8000), "g")
        assert payload[0].numel() == 1000, f"{name} sends {payload[0].numel()} bytes of signs for 8000 elements"
