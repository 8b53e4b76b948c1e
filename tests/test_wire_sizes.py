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
    # Per layer: a 1-D tensor without a layout is one 1-D parameter, sent raw
    # (tests/test_lowrank.py checks the bytes of layouts with matrices).
    "atomo": lambda n, size, c, p: n * size,
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


#: A group of a conv kernel, its bias, a linear weight, a matrix too small to factor and a
#: piece of a sliced parameter, as the per-layer compressors see it.
LAYERS = [("conv", (16, 3, 3, 3)), ("bias", (16,)), ("fc", (10, 144)), ("small", (3, 8)), ("piece", (7,))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["powersgd", "atomo"])
def test_per_layer_bytes_match_the_formula(name, dtype):
    from mergecomp.compressors.base import ParamView
    layout, offset = [], 0
    for view, shape in LAYERS:
        layout.append(ParamView(view, torch.Size(shape), offset))
        offset += math.prod(shape)
    layout = tuple(layout)
    torch.manual_seed(0)
    tensor = torch.randn(offset, dtype=dtype)
    compressor = compressors.create(name)
    if name == "powersgd":
        _, sent = run_locally(compressor, tensor, "g", layout=layout)
        payload = None
    else:
        payload, _ = compressor.compress(tensor, "g", layout=layout)
        sent = sum(t.numel() * t.element_size() for t in payload)
    size, expected, matrix = tensor.element_size(), 0, 0
    for view, shape in LAYERS:
        rows, cols = shape[0], math.prod(shape[1:])
        if name == "powersgd":  # factored when r·c > 2·k·(r + c), k = min(rank, r, c)
            k = min(compressor.rank, rows, cols)
            factored = len(shape) >= 2 and rows * cols > 2 * k * (rows + cols)
            expected += 4 * k * (rows + cols) if factored else math.prod(shape) * size
        else:  # factored when r·c > 2·budget·(r + c + 1); the atom count, then the atoms
            factored = len(shape) >= 2 and rows * cols > 2 * compressor.budget * (rows + cols + 1)
            if factored:
                expected += 4 + 4 * int(payload[1][matrix]) * (rows + cols + 1)
                matrix += 1
            else:
                expected += math.prod(shape) * size
    assert sent == expected == compressor.wire_nbytes(offset, size, payload, layout=layout), \
        f"{name} sends {sent} bytes for the layout, the format says {expected}"
