"""The block wires: 16-bit block offsets with 16-bit values ("compact") or 8-bit values after
one power-of-two scale ("compact8"), and 8-bit offsets within blocks of 255 with the 8-bit
values ("tight8")."""
import pytest
import torch

from mergecomp import compressors, memories
from mergecomp.compressors import blockwire
from mergecomp.compressors.base import Context, payload_nbytes

#: The sparsifiers that offer the block wires, and what each needs beyond the wire (DGC's
#: warm-up off: these tests compress one step).
SPARSIFIERS = {"topk": {}, "graddrop": {}, "dgc": {"warmup": 0}}


@pytest.mark.parametrize("wire", ["compact", "compact8", "tight8"])
@pytest.mark.parametrize("numel", [1, 254, 255, 256, 1000, blockwire.BLOCK, blockwire.BLOCK + 1,
                                   3 * blockwire.BLOCK + 17])
def test_indices_come_back_exactly_across_block_edges(numel, wire):
    generator = torch.Generator().manual_seed(numel)
    k = max(1, numel // 50)
    indices = torch.randperm(numel, generator=generator)[:k].sort().values
    size = blockwire.block_size(wire)
    for edge in (0, size - 1, size, 2 * size - 1, numel - 1):  # the blocks' first and last coordinates
        if edge < numel and edge not in indices.tolist():
            indices = torch.cat([indices, torch.tensor([edge])]).sort().values
    values = torch.randn(indices.numel(), generator=generator)
    payload = blockwire.pack(values, indices, numel, wire)
    assert payload_nbytes(payload) == blockwire.compact_nbytes(indices.numel(), numel, 4, wire)
    got_values, got_indices = blockwire.unpack(payload, numel)
    assert torch.equal(got_indices, indices)
    if wire == "compact":
        assert [p.dtype for p in payload] == [torch.bfloat16, torch.int16, torch.int32]
        assert torch.equal(got_values, values.to(torch.bfloat16))
    else:
        offsets, counts = (torch.uint8, torch.uint8) if wire == "tight8" else (torch.int16, torch.int32)
        assert [p.dtype for p in payload] == [torch.float8_e4m3fn, offsets, counts, torch.float32]
        codes, scale = blockwire.fp8_values(values)
        assert torch.equal(got_values, codes.float() * scale)
        assert float((got_values - values).abs().max()) <= values.abs().max() / 16  # within e4m3's step


@pytest.mark.parametrize("name", sorted(SPARSIFIERS))
def test_a_sparsifier_sends_the_same_coordinates_on_either_wire_in_half_the_bytes(name):
    x = torch.randn(150_000, generator=torch.Generator().manual_seed(3))
    compact = compressors.create(name, compress_ratio=0.02, wire_format="compact", **SPARSIFIERS[name])
    indexed = compressors.create(name, compress_ratio=0.02, wire_format="indexed", **SPARSIFIERS[name])
    payload, ctx = compact.compress(x, "g")
    (values, indices), _ = indexed.compress(x, "g")
    sent, count = compact.transmitted_indices(payload, ctx), values.numel()
    assert torch.equal(sent, indices.long().sort().values)
    assert payload_nbytes(payload) == compact.wire_nbytes(x.numel(), 4, payload) == 4 * count + 4 * 3
    assert indexed.wire_nbytes(x.numel(), 4, (values, indices)) == 8 * count
    decoded = compact.decompress(payload, ctx)
    assert torch.equal(decoded[indices.long()], values.to(torch.bfloat16).float())
    assert int((decoded != 0).sum()) == count
    empty, empty_ctx = compact.compress(torch.zeros(0), "g")
    assert compact.decompress(empty, empty_ctx).shape == (0,)


@pytest.mark.parametrize("name", sorted(SPARSIFIERS))
def test_the_8_bit_wire_sends_the_same_coordinates_in_three_bytes_each(name):
    x = torch.randn(150_000, generator=torch.Generator().manual_seed(3))
    eight = compressors.create(name, compress_ratio=0.02, wire_format="compact8", **SPARSIFIERS[name])
    compact = compressors.create(name, compress_ratio=0.02, wire_format="compact", **SPARSIFIERS[name])
    payload, ctx = eight.compress(x, "g")
    sent, count = eight.transmitted_indices(payload, ctx), payload[0].numel()
    assert torch.equal(sent, compact.transmitted_indices(*compact.compress(x, "g")))
    assert payload_nbytes(payload) == eight.wire_nbytes(x.numel(), 4, payload) == 3 * count + 4 * 3 + 4
    decoded = eight.decompress(payload, ctx).reshape(-1)
    assert float((decoded[sent] - x[sent]).abs().max()) <= float(x[sent].abs().max()) / 16
    assert int((decoded != 0).sum()) == count
    empty, empty_ctx = eight.compress(torch.zeros(0), "g")
    assert eight.decompress(empty, empty_ctx).shape == (0,)


@pytest.mark.parametrize("name", sorted(SPARSIFIERS))
def test_the_tight_wire_sends_the_same_values_in_two_bytes_each_and_a_byte_per_block(name):
    x = torch.randn(150_000, generator=torch.Generator().manual_seed(3))
    tight = compressors.create(name, compress_ratio=0.02, wire_format="tight8", **SPARSIFIERS[name])
    eight = compressors.create(name, compress_ratio=0.02, wire_format="compact8", **SPARSIFIERS[name])
    payload, ctx = tight.compress(x, "g")
    sent, count = tight.transmitted_indices(payload, ctx), payload[0].numel()
    other, other_ctx = eight.compress(x, "g")
    assert torch.equal(sent, eight.transmitted_indices(other, other_ctx))
    assert torch.equal(tight.decompress(payload, ctx), eight.decompress(other, other_ctx))
    blocks = -(-x.numel() // 255)
    assert payload_nbytes(payload) == tight.wire_nbytes(x.numel(), 4, payload) == 2 * count + blocks + 4
    empty, empty_ctx = tight.compress(torch.zeros(0), "g")
    assert tight.decompress(empty, empty_ctx).shape == (0,)


def test_a_full_short_block_fits_its_8_bit_count():
    """Every coordinate of a block of 255 sent: its count, 255, still fits a byte."""
    numel = 3 * 255 + 7
    indices = torch.arange(numel)
    payload = blockwire.pack(torch.randn(numel), indices, numel, "tight8")
    assert payload[2].tolist() == [255, 255, 255, 7]
    assert torch.equal(blockwire.unpack(payload, numel)[1], indices)


def test_a_short_block_offset_past_its_block_is_refused():
    codes, offsets, counts, scale = blockwire.pack(torch.ones(2), torch.tensor([3, 300]), 600, "tight8")
    offsets = torch.tensor([3, 255], dtype=torch.uint8)  # 255 would name the next block's first coordinate
    with pytest.raises(ValueError, match="offset 255 in a block of 255"):
        blockwire.unpack((codes, offsets, counts, scale), 600)
    with pytest.raises(ValueError, match="needs 3 counts"):
        blockwire.unpack((codes, offsets, counts[:2], scale), 600)


def test_a_16_bit_gradient_keeps_its_dtype_on_the_wire():
    x = torch.randn(5000, generator=torch.Generator().manual_seed(4)).to(torch.float16)
    topk = compressors.create("topk", compress_ratio=0.1, wire_format="compact")
    payload, ctx = topk.compress(x, "g")
    assert payload[0].dtype == torch.float16
    decoded = topk.decompress(payload, ctx)
    assert decoded.dtype == torch.float16 and torch.equal(decoded[decoded != 0], x[decoded != 0])
    eight = compressors.create("topk", compress_ratio=0.1)  # 8-bit values, decoded to the gradient's dtype
    payload, ctx = eight.compress(x, "g")
    assert payload[0].dtype == torch.float8_e4m3fn and eight.decompress(payload, ctx).dtype == torch.float16


@pytest.mark.parametrize("wire", ["compact", "compact8", "tight8"])
def test_error_feedback_keeps_what_the_rounding_lost(wire):
    """The residual is the compensated gradient minus the rounded values sent: sent plus
    kept is the input exactly, so the rounding is sent later, never lost."""
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(5))
    memory, topk = memories.create("residual"), compressors.create("topk", compress_ratio=0.05, wire_format=wire)
    compensated = memory.compensate(x.clone(), "g")
    payload, ctx = topk.compress(compensated, "g")
    memory.update(compensated, "g", topk, payload, ctx)
    memory.commit()
    sent = topk.decompress(payload, ctx).reshape(-1)
    assert torch.equal(sent + memory.residuals["g"], x)
    assert float(memory.residuals["g"][topk.transmitted_indices(payload, ctx)].abs().max()) > 0  # rounding kept


def test_non_finite_values_stay_non_finite_on_the_wire():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(6))
    x[10], x[20] = float("nan"), float("inf")
    topk = compressors.create("topk", compress_ratio=0.01, wire_format="compact")
    payload, ctx = topk.compress(x, "g")
    decoded = topk.decompress(payload, ctx)
    assert decoded[10].isnan() and decoded[20].isinf()
    big = torch.zeros(1000)
    big[3] = 1e30  # beyond fp16's range; bf16 keeps it finite
    assert torch.isfinite(topk.decompress(*topk.compress(big, "g"))).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_one_non_finite_value_makes_the_whole_8_bit_payload_non_finite(bad):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(6))
    x[10] = bad
    topk = compressors.create("topk", compress_ratio=0.01, wire_format="compact8")
    payload, ctx = topk.compress(x, "g")
    decoded = topk.decompress(payload, ctx).reshape(-1)
    assert not torch.isfinite(decoded[topk.transmitted_indices(payload, ctx)]).any()  # the step is dropped
    for value in (1e30, 1e-30):  # any finite magnitude: the scale follows it
        tiny_or_huge = torch.zeros(1000)
        tiny_or_huge[3] = value
        assert float(topk.decompress(*topk.compress(tiny_or_huge, "g")).reshape(-1)[3]) == pytest.approx(value, rel=1 / 16)


@pytest.mark.parametrize("wire", ["compact", "compact8"])
@pytest.mark.parametrize("corrupt, message", [
    (lambda p: (p[0], p[1], p[2][:-1]) + p[3:], "needs 2 counts"),
    (lambda p: (p[0], p[1][:-1], p[2]) + p[3:], "as many offsets as values"),
    (lambda p: (p[0], p[1], p[2] + 1) + p[3:], "add up to"),
    (lambda p: (p[0], p[1]), r"\(values, offsets, counts\)"),
])
def test_a_payload_that_cannot_be_one_is_refused_with_what_was_wrong(corrupt, message, wire):
    x = torch.randn(blockwire.BLOCK + 10, generator=torch.Generator().manual_seed(7))
    topk = compressors.create("topk", compress_ratio=0.01, wire_format=wire)
    payload, ctx = topk.compress(x, "g")
    with pytest.raises(ValueError, match=message):
        topk.decompress(corrupt(payload), ctx)


def test_an_8_bit_payload_carries_one_scale():
    payload = blockwire.pack(torch.ones(2), torch.tensor([3, 9]), 100, "compact8")
    with pytest.raises(ValueError, match="of 2 values carries 1 scale, got 2"):
        blockwire.unpack(payload[:3] + (payload[3].repeat(2),), 100)


def test_values_for_an_empty_group_are_refused():
    payload = (torch.ones(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int16), torch.zeros(0, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"block counts \[\] add up to 0, not its 2 values"):
        blockwire.unpack(payload, 0)


def test_an_offset_past_the_groups_end_is_refused():
    payload = blockwire.pack(torch.ones(1), torch.tensor([99]), 100)
    with pytest.raises(ValueError, match="coordinate 99 of a group of 50"):
        blockwire.unpack(payload, 50)


@pytest.mark.parametrize("name", sorted(SPARSIFIERS))
def test_an_unknown_wire_format_is_refused(name):
    with pytest.raises(ValueError, match="wire_format must be one of .*got 'packed'"):
        compressors.create(name, wire_format="packed")


@pytest.mark.parametrize("option", [{"fp16_values": True}, {"index_bits": 64}])
def test_dgc_refuses_options_of_the_indexed_wire_on_a_block_wire(option):
    with pytest.raises(ValueError, match="shape the 'indexed' wire.*use wire_format='indexed'"):
        compressors.create("dgc", wire_format="compact8", **option)
    assert compressors.create("dgc", wire_format="indexed", **option)


@pytest.mark.parametrize("wire", ["compact", "compact8", "tight8"])
def test_dgc_payloads_fit_its_bound_on_a_block_wire_even_when_it_sends_fewer(wire):
    """DGC's count varies from step to step; the allgather pads a payload to its bound, so
    every part (values, offsets, the block counts, the 8-bit wire's scale) must fit it."""
    dgc = compressors.create("dgc", compress_ratio=0.01, wire_format=wire, warmup=0)
    for x in (torch.randn(3 * blockwire.BLOCK + 5, generator=torch.Generator().manual_seed(9)),
              torch.zeros(1000), torch.zeros(0)):
        payload, ctx = dgc.compress(x, "g")
        bound = dgc.payload_bound(ctx)
        assert len(bound) == len(payload)
        assert all(part.numel() <= torch.Size(shape).numel() for part, shape in zip(payload, bound))
        assert dgc.wire_nbytes(x.numel(), 4, payload) == payload_nbytes(payload)


def test_the_wire_format_is_part_of_the_configuration():
    assert "wire_format='auto'" in repr(compressors.create("topk"))
    assert "wire_format='auto'" in repr(compressors.create("graddrop"))
    assert "wire_format='auto'" in repr(compressors.create("dgc"))
    assert "wire_format='compact8'" in repr(compressors.create("topk", wire_format="compact8"))
    assert "wire_format='compact'" in repr(compressors.create("graddrop", wire_format="compact"))
    assert "wire_format='indexed'" in repr(compressors.create("topk", wire_format="indexed"))


def test_a_sum_of_compact_payloads_equals_the_sum_of_their_decodes():
    generator = torch.Generator().manual_seed(8)
    topk = compressors.create("topk", compress_ratio=0.02)
    encoded = [topk.compress(torch.randn(70_000, generator=generator), "g") for _ in range(3)]
    ctx = encoded[0][1]
    total = topk.decompress_sum([payload for payload, _ in encoded], ctx)
    expected = sum(topk.decompress(payload, c) for payload, c in encoded)
    assert torch.equal(total.reshape(-1), expected.reshape(-1))
    assert isinstance(ctx, Context)


def tight_allgather_worker(rank, world_size):
    from mergecomp import communicators
    from mergecomp.distributed.backends.torch_dist import TorchDistributedBackend
    backend, out = TorchDistributedBackend(), []
    # DGC's and GradDrop's counts vary from rank to rank: padded to DGC's bound, or sent as they are
    for name, options, wire in (("topk", {}, "tight8"), ("dgc", {"warmup": 0}, "auto"), ("graddrop", {}, "auto")):
        make = lambda: compressors.create(name, compress_ratio=0.03, wire_format=wire, **options)
        allgather = communicators.create("allgather", compressor=make(), memory=memories.create("none"),
                                         backend=backend)
        grads = [torch.randn(3 * 255 + 1000, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]
        got = allgather.finish(allgather.start(grads[rank].clone(), "g"))
        local = make()
        expected = sum(local.decompress(*local.compress(g.clone(), "g")) for g in grads)
        out.append(torch.equal(got.reshape(-1), (expected / world_size).reshape(-1)))  # the ranks' mean
    return out


def test_the_tight_and_auto_wires_travel_through_the_allgather_between_ranks():
    from tests.distributed import run_ranks
    assert run_ranks(tight_allgather_worker, 3) == [[True, True, True]] * 3


@pytest.mark.parametrize("name", sorted(SPARSIFIERS))
def test_auto_sends_the_smaller_8_bit_wire_for_the_planned_density(name):
    """Tight blocks from a density of about 0.4%, 16-bit offsets below it: each payload on
    the wire that takes fewer bytes, and the coordinates and values the same either way."""
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(11))
    for ratio, expected in ((0.03, "tight8"), (0.001, "compact8")):
        auto = compressors.create(name, compress_ratio=ratio, wire_format="auto", **SPARSIFIERS[name])
        fixed = compressors.create(name, compress_ratio=ratio, wire_format=expected, **SPARSIFIERS[name])
        payload, ctx = auto.compress(x, "g")
        assert blockwire.format_of(payload) == expected
        same, same_ctx = fixed.compress(x, "g")
        assert torch.equal(auto.decompress(payload, ctx), fixed.decompress(same, same_ctx))
        assert payload_nbytes(payload) == auto.wire_nbytes(x.numel(), 4, payload) == payload_nbytes(same)
    assert blockwire.chosen("auto", 2_500, 100_000) == "tight8" and blockwire.chosen("auto", 100, 100_000) == "compact8"
    assert blockwire.chosen("compact", 2_500, 100_000) == "compact"


def test_auto_chooses_dgcs_wire_by_its_bound_so_every_payload_of_a_group_agrees():
    """DGC's count varies from rank to rank; the wire follows its bound k, which every rank
    shares, so all of a group's payloads travel on one wire and fit the bound."""
    numel = 100_000
    k = int(numel * 0.004)  # near the crossing: a count below k alone would choose the other wire
    assert blockwire.chosen("auto", k, numel) == "tight8" and blockwire.chosen("auto", k // 2, numel) == "compact8"
    dgc = compressors.create("dgc", compress_ratio=0.004, wire_format="auto", warmup=0)
    for seed in range(3):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
        x[: numel // 2] = 0  # half the coordinates can never pass the threshold: fewer than k sent
        payload, ctx = dgc.compress(x, "g")
        assert blockwire.format_of(payload) == "tight8"
        assert all(part.numel() <= torch.Size(shape).numel() for part, shape in zip(payload, dgc.payload_bound(ctx)))
        assert dgc.wire_nbytes(numel, 4, payload) == payload_nbytes(payload)
    assert dgc.wire_nbytes(numel, 4) == blockwire.compact_nbytes(k, numel, 4, "tight8")
