"""Every compressor: round trips on awkward inputs, its own semantics, unbiasedness, errors."""
import math

import pytest
import torch

from mergecomp import compressors
from mergecomp.compressors.atomo import atomo_probabilities
from mergecomp.compressors.single_process import run_locally

NAMES = compressors.available()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_input(case, dtype):
    gen = torch.Generator().manual_seed(len(case))
    big = 1e3 if dtype == torch.float16 else 1e30
    small = 1e-4 if dtype == torch.float16 else 1e-30
    if case == "single":
        return torch.tensor([0.7], dtype=dtype)
    if case == "odd":
        return torch.randn(1001, generator=gen).to(dtype)
    if case == "zeros":
        return torch.zeros(1001, dtype=dtype)
    if case == "huge":
        return (torch.randn(777, generator=gen) * big).to(dtype)
    if case == "tiny":
        return (torch.randn(777, generator=gen) * small).to(dtype)
    if case == "noncontiguous":
        return torch.randn(37, 29, generator=gen).to(dtype).t()
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["single", "odd", "zeros", "huge", "tiny", "noncontiguous"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_round_trip_keeps_shape_dtype_device_and_stays_finite(name, dtype, case):
    torch.manual_seed(0)
    tensor = make_input(case, dtype)
    original = tensor.clone()
    decoded, nbytes = run_locally(compressors.create(name), tensor, "group")
    assert decoded.shape == tensor.shape and decoded.dtype == dtype and decoded.device == tensor.device
    if name == "fp16" and case == "huge" and dtype != torch.float16:
        assert torch.isinf(decoded).all()  # documented: beyond 65504 half precision overflows
        return
    assert torch.isfinite(decoded).all(), f"{name} produced non-finite values on {case} {dtype}"
    assert torch.equal(tensor, original), f"{name} modified its input"
    assert nbytes > 0 or name == "atomo"
    if case == "zeros":
        assert not decoded.any(), f"{name} decoded a zero gradient as non-zero"


@pytest.mark.parametrize("name", [n for n in NAMES if n != "atomo"])
def test_fp64_gradients_round_trip_as_fp64(name):
    torch.manual_seed(0)
    tensor = torch.randn(1000, dtype=torch.float64)
    decoded, _ = run_locally(compressors.create(name), tensor, "group")
    assert decoded.dtype == torch.float64 and decoded.shape == tensor.shape and torch.isfinite(decoded).all()


@pytest.mark.parametrize("name", ["none", "fp32", "fp16", "bf16"])
def test_dense_casts_are_close(name):
    x = torch.randn(1000)
    decoded, _ = run_locally(compressors.create(name), x)
    tolerance = {"none": 0, "fp32": 0, "fp16": 1e-3, "bf16": 1e-2}[name]
    assert torch.allclose(decoded, x, rtol=tolerance, atol=0)


def test_signsgd_sends_signs_and_zero_as_plus_one():
    x = torch.tensor([-2.0, 0.0, 3.0, -1e-30, 5.0])
    decoded, nbytes = run_locally(compressors.create("signsgd"), x)
    assert decoded.tolist() == [-1, 1, 1, -1, 1] and nbytes == 1 + 1  # signs + the zero-view flag


@pytest.mark.parametrize("name", ["signsgd", "signum"])
def test_majority_vote_is_the_sign_of_the_sum_of_signs(name):
    compressor = compressors.create(name)
    assert compressor.average is False and compressor.summable is False
    ranks = [torch.tensor([1.0, -1, -1, 2, -3]), torch.tensor([-1.0, -1, 1, 2, 3]),
             torch.tensor([-4.0, 1, -1, -2, 3])]
    decoded = []
    for rank, g in enumerate(ranks):
        payload, ctx = compressor.compress(g, f"rank{rank}")  # own momentum per "rank"
        decoded.append(compressor.decompress(payload, ctx))
    expected = torch.stack([g.sign() for g in ranks]).sum(0).sign()
    assert torch.equal(compressor.aggregate(decoded), expected)
    assert compressor.aggregate([torch.ones(2), -torch.ones(2)]).tolist() == [0, 0]  # a tie: no step


def test_signum_sends_the_sign_of_its_momentum():
    signum = compressors.create("signum", beta=0.5)
    run_locally(signum, torch.tensor([1.0, -1.0]), "g")
    signum.commit()
    decoded, _ = run_locally(signum, torch.tensor([-3.0, 2.0]), "g")  # m = [-1.25, 0.75]
    assert decoded.tolist() == [-1, 1]
    assert torch.equal(signum.state_dict()["momenta"]["g"], torch.tensor([0.5, -0.5]))  # only commits export
    signum.commit()
    state = signum.state_dict()
    other = compressors.create("signum", beta=0.5)
    other.load_state_dict(state)
    assert torch.equal(other.momenta["g"], torch.tensor([-1.25, 0.75]))


def test_efsignsgd_scales_by_mean_magnitude():
    x = torch.tensor([1.0, -3.0, 2.0, -2.0])
    decoded, _ = run_locally(compressors.create("efsignsgd"), x)
    assert decoded.tolist() == [2.0, -2.0, 2.0, -2.0]


def test_onebit_decodes_each_side_to_its_mean():
    x = torch.tensor([1.0, -3.0, 3.0, -1.0, 0.0])
    decoded, _ = run_locally(compressors.create("onebit"), x)
    assert decoded.tolist() == pytest.approx([4 / 3, -2.0, 4 / 3, -2.0, 4 / 3])


def test_tbq_sends_plus_minus_threshold():
    x = torch.tensor([0.5, -0.5, 0.05, -0.2, 0.0, 0.1])
    decoded, nbytes = run_locally(compressors.create("tbq", threshold=0.1), x)
    assert decoded.tolist() == pytest.approx([0.1, -0.1, 0, -0.1, 0, 0]) and nbytes == 2


def test_tbq_measures_each_views_threshold_by_default():
    from mergecomp.compressors.base import ParamView
    # two views: large gradients beside small ones, each sent at its own mean magnitude
    x = torch.tensor([4.0, -2.0, 0.0, 1.0, 0.04, -0.02, 0.01, 0.01])
    layout = (ParamView("big", torch.Size([4]), 0), ParamView("small", torch.Size([4]), 4))
    compressor = compressors.create("tbq")
    decoded, nbytes = run_locally(compressor, x, layout=layout)
    assert compressor.threshold == "auto"
    # τ = twice the view's mean magnitude, at most its largest: 3.5 and 0.04
    assert decoded.tolist() == pytest.approx([3.5, 0, 0, 0, 0.04, 0, 0, 0])
    assert nbytes == 2 + 4 * 2 == compressor.wire_nbytes(8, 4, layout=layout)
    # without a layout one τ for the whole tensor (2 × 0.885); a zero tensor sends nothing
    whole, nbytes = run_locally(compressor, x)
    assert whole.tolist() == pytest.approx([1.77, -1.77, 0, 0, 0, 0, 0, 0]) and nbytes == 2 + 4
    assert run_locally(compressor, torch.zeros(5))[0].tolist() == [0.0] * 5
    # a view of equal magnitudes (a one-element bias) is sent whole, not held back forever
    assert run_locally(compressor, torch.tensor([-0.3]))[0].tolist() == pytest.approx([-0.3])
    at_mean, _ = run_locally(compressors.create("tbq", scale=1.0), x, layout=layout)
    assert at_mean.tolist() == pytest.approx([1.75, -1.75, 0, 0, 0.02, -0.02, 0, 0])


def test_tbq_measured_threshold_is_a_contraction():
    """‖x − C(x)‖ < ‖x‖ for any x ≠ 0: what error feedback needs of a biased compressor."""
    generator = torch.Generator().manual_seed(0)
    compressor = compressors.create("tbq")
    for scale in (1e-6, 1.0, 1e3):
        x = torch.randn(10_000, generator=generator) * scale
        decoded, _ = run_locally(compressor, x)
        assert (x - decoded).norm() < 0.9 * x.norm()  # Gaussian: about 0.8
        x[::7] *= 50  # heavy tails: still strictly less
        decoded, _ = run_locally(compressor, x)
        assert (x - decoded).norm() < x.norm()


def test_tbq_payload_of_another_layout_is_refused():
    from mergecomp.compressors.base import ParamView
    compressor = compressors.create("tbq")
    payload, _ = compressor.compress(torch.randn(8), "g")
    layout = (ParamView("a", torch.Size([4]), 0), ParamView("b", torch.Size([4]), 4))
    _, ctx = compressor.compress(torch.randn(8), "g", layout)
    with pytest.raises(ValueError, match="1 thresholds but its context has 2 views"):
        compressor.decompress(payload, ctx)


def test_terngrad_values_are_ternary_and_clipping_bounds_them():
    x = torch.randn(3000)
    x[5] = 50.0
    decoded, _ = run_locally(compressors.create("terngrad", bucket_size=1000, clip=None), x)
    scales = x.view(3, 1000).abs().amax(1)
    levels = decoded.view(3, 1000) / scales[:, None]
    assert set(levels.unique().tolist()) <= {-1.0, 0.0, 1.0}
    clipped, _ = run_locally(compressors.create("terngrad", bucket_size=1000, clip=2.5), x)
    assert clipped.abs().max() <= 2.5 * x[:1000].std() * 1.01


def test_qsgd_levels_are_integers_in_range():
    x = torch.randn(1000)
    compressor = compressors.create("qsgd", levels=3, bucket_size=100)
    decoded, nbytes = run_locally(compressor, x)
    norms = x.view(10, 100).norm(dim=1)
    levels = decoded.view(10, 100) / norms[:, None] * 3
    assert torch.allclose(levels, levels.round(), atol=1e-4) and levels.abs().max() <= 3 + 1e-4
    assert compressor.bits == 3 and nbytes == 375 + 40


def test_dgc_sends_the_largest_elements_and_at_most_k():
    torch.manual_seed(0)
    x = torch.randn(100_000)
    dgc = compressors.create("dgc", compress_ratio=0.01, wire_format="indexed")
    payload, ctx = dgc.compress(x, "g")
    values, indices = payload
    k = 1000
    assert 0.8 * k <= values.numel() <= k and indices.dtype == torch.int32
    assert torch.equal(values, x[indices.long()])
    unsent = torch.ones_like(x, dtype=torch.bool)
    unsent[indices.long()] = False
    assert values.abs().min() >= x[unsent].abs().max()


def test_dgc_sends_its_indices_ascending_when_it_caps_the_candidates_at_k():
    """More candidates than k pass the sampled threshold (its margin lowers it), so DGC
    picks k of them; the payload keeps them ascending, the order every device gives."""
    torch.manual_seed(1)
    x = torch.randn(65_541)
    dgc = compressors.create("dgc", compress_ratio=0.001, warmup=0, sample_margin=3, wire_format="indexed")
    (values, indices), ctx = dgc.compress(x, "g")
    k = dgc.payload_bound(ctx)[0].numel()
    assert values.numel() == k and torch.all(indices[1:] > indices[:-1])
    assert torch.equal(values, x[indices.long()])
    assert set(indices.tolist()) == set(torch.topk(x.abs(), k).indices.tolist())


def test_dgc_options_and_warmup_schedule():
    dgc = compressors.create("dgc", compress_ratio=0.001, warmup=4)
    assert [round(dgc.density(e), 6) for e in range(6)] == [0.25, 0.062872, 0.015811, 0.003976, 0.001, 0.001]
    listed = compressors.create("dgc", compress_ratio=0.001, warmup=[0.25, 0.0625])
    listed.set_epoch(1)
    assert listed.density() == 0.0625
    listed.set_epoch(7)
    assert listed.density() == 0.001
    half = compressors.create("dgc", compress_ratio=0.1, fp16_values=True, index_bits=64, wire_format="indexed")
    (values, indices), _ = half.compress(torch.randn(1000), "g")
    assert values.dtype == torch.float16 and indices.dtype == torch.int64
    with pytest.raises(ValueError, match="epoch must be a non-negative integer, got -1"):
        dgc.set_epoch(-1)


def test_graddrop_keeps_about_the_ratio():
    torch.manual_seed(0)
    x = torch.randn(200_000)
    (values, *_), _ = compressors.create("graddrop", compress_ratio=0.01).compress(x, "g")
    assert 1000 < values.numel() < 4000


def test_atomo_probabilities_are_variance_optimal():
    sigma = torch.tensor([10.0, 1.0, 1.0, 0.0])
    p = atomo_probabilities(sigma, 2.0)
    assert p.tolist() == [1.0, 0.5, 0.5, 0.0]  # the first atom is clipped, the rest share 1
    p = atomo_probabilities(torch.tensor([4.0, 3.0, 2.0, 1.0]), 1.0)
    assert torch.allclose(p, torch.tensor([0.4, 0.3, 0.2, 0.1]))
    assert atomo_probabilities(torch.tensor([3.0, 2.0]), 5.0).tolist() == [1.0, 1.0]
    assert atomo_probabilities(torch.zeros(3), 2.0).tolist() == [0.0, 0.0, 0.0]


def test_atomo_is_exact_when_the_budget_covers_the_rank():
    a = torch.randn(6, 1) @ torch.randn(1, 5) + torch.randn(6, 1) @ torch.randn(1, 5)
    decoded, nbytes = run_locally(compressors.create("atomo", budget=5, min_compression_rate=0), a)
    assert torch.allclose(decoded, a, atol=1e-5)


def test_atomo_samples_more_atoms_where_its_budget_is_raised_and_keeps_its_layout():
    torch.manual_seed(0)
    a = torch.randn(64, 48)
    atomo = compressors.create("atomo", budget=2, min_compression_rate=2)
    atoms = lambda: sum(int(atomo.compress(a, "g")[0][1].sum()) for _ in range(200))
    configured = atoms()
    atomo.set_group_scale("g", 4.0)  # what the quality controller does for a noisy group
    raised = atoms()
    assert atomo.group_budget("g") == 8.0 and atomo.group_budget("other") == 2.0
    assert 3.5 < raised / configured < 4.5  # E[atoms] = the budget
    assert atomo.knob == "rank"
    # which views are factored is the configured budget's: a scale never changes the layout
    _, ctx = atomo.compress(a, "g")
    assert len(atomo.split(ctx.layout)[1]) == 1
    atomo.set_group_scale("g", 1.0)
    assert atomo.group_budget("g") == 2.0


def test_powersgd_is_exact_for_low_rank():
    a = torch.randn(8, 1) @ torch.randn(1, 6)
    decoded, nbytes = run_locally(compressors.create("powersgd", rank=2, min_compression_rate=0, factor_dtype="fp32"), a)
    assert torch.allclose(decoded, a, atol=1e-4) and nbytes == 4 * 2 * (8 + 6)


def test_batched_powersgd_is_exact_for_low_rank_and_its_feedback_loses_nothing():
    a = torch.randn(8, 1) @ torch.randn(1, 6)
    decoded, nbytes = run_locally(compressors.create("batched_powersgd", rank=2), a)
    assert torch.allclose(decoded, a, atol=1e-4) and nbytes == 4 * 2 * (8 + 6)
    power = compressors.create("batched_powersgd", rank=1)
    total_in, total_out = torch.zeros(300), torch.zeros(300)
    for step in range(5):
        g = torch.randn(300)
        total_in += g
        total_out += run_locally(power, g, "g")[0]
        power.commit()
    residual = power.errors["g"].reshape(-1)[:300]
    assert torch.allclose(total_out + residual, total_in, atol=1e-4)
    with pytest.raises(TypeError, match="two allreduce rounds"):
        power.compress(torch.ones(3), "g")
    clone = compressors.create("batched_powersgd", rank=1)
    clone.load_state_dict(power.state_dict())
    assert torch.equal(clone.queries["g"], power.queries["g"])


def _assert_unbiased(compressor, x, samples):
    """Mean of the decodes is within 5 standard errors of x on every coordinate.

    A coordinate that is rarely non-zero (probability p ≪ 1/samples) can show no spread at
    all; for those, the "rule of three" bounds what the sample can miss: an event of
    probability above 5/samples is seen with probability > 99%, so the slack is
    5/samples × the largest decoded magnitude.
    """
    torch.manual_seed(1234)
    decodes = torch.stack([run_locally(compressor, x, "g")[0].double() for _ in range(samples)])
    mean, std = decodes.mean(0), decodes.std(0)
    tolerance = 5 * std / math.sqrt(samples) + 5 / samples * decodes.abs().max()
    error = (mean - x.double()).abs()
    assert (error <= tolerance).all(), f"max error / tolerance {(error / tolerance).max():.2f}"
    assert (std > 0).any(), "the compressor is deterministic on this input: the test proves nothing"
    return error, tolerance


@pytest.mark.parametrize("name, kwargs, shape, samples", [
    ("qsgd", dict(levels=2, bucket_size=64), (200,), 2000),
    ("terngrad", dict(bucket_size=64, clip=None), (200,), 2000),
    ("randk", dict(compress_ratio=0.2, unbiased=True), (100,), 3000),
    ("atomo", dict(budget=1.5, min_compression_rate=0), (6, 5), 4000),
])
def test_unbiased_compressors_are_unbiased(name, kwargs, shape, samples):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(7))
    _assert_unbiased(compressors.create(name, **kwargs), x, samples)


@pytest.mark.parametrize("name, kwargs, message", [
    ("dgc", dict(compress_ratio=0), r"compress_ratio must be in \(0, 1\], got 0"),
    ("dgc", dict(compress_ratio=1.5), r"got 1.5"),
    ("dgc", dict(warmup=-1), "warmup epochs must be >= 0, got -1"),
    ("dgc", dict(warmup=[0.5, 2.0]), "warmup density for epoch 1"),
    ("dgc", dict(index_bits=16), "index_bits must be 32 or 64, got 16"),
    ("graddrop", dict(compress_ratio=-0.1), "got -0.1"),
    ("qsgd", dict(levels=0), r"levels must be an integer in \[1, 127\], got 0"),
    ("qsgd", dict(levels=200), "got 200"),
    ("qsgd", dict(bucket_size=0), "bucket_size must be a positive integer, got 0"),
    ("terngrad", dict(bucket_size=2.5), "got 2.5"),
    ("terngrad", dict(clip=-1), "clip must be a positive multiple"),
    ("signum", dict(beta=1.0), r"beta must be in \[0, 1\), got 1.0"),
    ("atomo", dict(budget=0), "budget .* must be a positive number, got 0"),
    ("powersgd", dict(rank=0), "rank must be a positive integer, got 0"),
    ("tbq", dict(threshold=0), "or a positive finite number near the typical magnitude of a gradient element, got 0"),
    ("tbq", dict(scale=0), r"tbq scale \(τ over a view's mean magnitude, with threshold='auto'\) must be a positive"),
])
def test_bad_parameters_are_explained(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        compressors.create(name, **kwargs)


@pytest.mark.parametrize("name", NAMES)
def test_declares_capabilities_and_recommendations(name):
    from mergecomp import memories
    cls = compressors.get(name)
    assert isinstance(cls.summable, bool) and isinstance(cls.fixed_size, bool)
    assert isinstance(cls.average, bool)
    assert cls.recommended_memory in memories.available()
    assert cls.recommended_communicator in ("allreduce", "allgather", "ps")
    if cls.recommended_communicator == "allreduce":
        assert cls.summable, f"{name} recommends allreduce but is not summable"
    assert "Wire" in cls.__doc__ and "bytes" in cls.__doc__, f"{name}'s docstring must give its wire size"


def test_the_unbiasedness_check_is_decisive():
    x = torch.randn(200, generator=torch.Generator().manual_seed(7))
    x[3] = 20.0  # an outlier that 2.5σ clipping cuts down: a biased estimate
    with pytest.raises(AssertionError, match="max error / tolerance"):
        _assert_unbiased(compressors.create("terngrad", bucket_size=64, clip=2.5), x, 500)


# --- the DGC memory -------------------------------------------------------------------------

def test_dgc_memory_momentum_correction_and_masking():
    from mergecomp import memories
    memory = memories.create("dgc", momentum=0.5)
    topk = compressors.create("topk", compress_ratio=0.25)
    g = torch.tensor([1.0, 2.0, 3.0, 4.0])
    v = memory.compensate(g, "g")  # u = g, v = g
    payload, ctx = topk.compress(v, "g")  # sends 4.0 at index 3
    memory.update(v, "g", topk, payload, ctx)
    assert memory.velocities["g"].tolist() == [1, 2, 3, 0]
    assert memory.momenta["g"].tolist() == [1, 2, 3, 0]  # momentum factor masking
    v = memory.compensate(g, "g")  # u = 0.5u + g = [1.5, 3, 4.5, 4]; v += u
    assert v.tolist() == [2.5, 5, 7.5, 4]


@pytest.mark.parametrize("in_place", [True, False])
def test_dgc_memory_without_masking_keeps_the_momentum_of_sent_coordinates(in_place):
    from mergecomp import memories
    memory = memories.create("dgc", momentum=0.5, masking=False)
    assert "masking=False" in repr(memory) and "masking" not in repr(memories.create("dgc"))
    topk = compressors.create("topk", compress_ratio=0.25, wire_format="indexed")  # its values: views
    g = torch.tensor([1.0, 2.0, 3.0, 4.0])
    v = memory.compensate(g, "g")
    payload, ctx = topk.compress(v, "g")  # sends 4.0 at index 3
    if not in_place:  # a payload tensor in the velocity's memory: zeroed into new tensors
        payload = payload + (v,)
    memory.update(v, "g", topk, payload, ctx)
    assert memory.velocities["g"].tolist() == [1, 2, 3, 0]
    assert memory.momenta["g"].tolist() == [1, 2, 3, 4]  # the sent coordinate keeps its momentum
    v = memory.compensate(g, "g")  # u = 0.5u + g = [1.5, 3, 4.5, 6]; v += u
    assert v.tolist() == [2.5, 5, 7.5, 6]
    with pytest.raises(ValueError, match="masking must be True or False, got 'no'"):
        memories.create("dgc", masking="no")


def test_dgc_memory_nesterov_clipping_and_dense_payloads():
    from mergecomp import memories
    memory = memories.create("dgc", momentum=0.5, nesterov=True, clip_norm=1.0)
    v = memory.compensate(torch.tensor([3.0, 4.0]), "g")  # clipped to [0.6, 0.8]
    assert torch.allclose(v, torch.tensor([0.6, 0.8]) * 1.5)  # u = 0.5·g, v = u + g
    dense = compressors.create("none")
    payload, ctx = dense.compress(v, "g")  # a view of the velocity
    memory.update(v, "g", dense, payload, ctx)
    assert torch.allclose(payload[0], torch.tensor([0.9, 1.2]))  # not erased before sending
    # Dense (uncompressed) sends keep plain momentum, as DGC treats uncompressed layers:
    # the velocity went out whole, the momentum is not masked.
    assert not memory.velocities["g"].any() and torch.allclose(memory.momenta["g"], torch.tensor([0.3, 0.4]))
    dgc = compressors.create("dgc", compress_ratio=0.5, wire_format="indexed")
    v = memory.compensate(torch.tensor([0.1, -0.5]), "g")
    payload, ctx = dgc.compress(v, "g")
    memory.update(v, "g", dgc, payload, ctx)
    assert memory.velocities["g"][1] == 0 and memory.velocities["g"][0] != 0
    # on the 8-bit wire the velocity keeps what the rounding of the sent value lost
    eight = compressors.create("dgc", compress_ratio=0.5)
    v = memory.compensate(torch.tensor([0.1, -0.5]), "g")
    before = v.clone()
    payload, ctx = eight.compress(v, "g")
    sent = eight.decompress(payload, ctx)
    memory.update(v, "g", eight, payload, ctx)
    assert memory.velocities["g"][1] == before[1] - sent[1] and sent[0] == 0


def test_dgc_memory_refuses_a_momentum_it_cannot_take_over():
    from mergecomp.memories.dgc import DGCMemory, check_optimizer
    params = [torch.nn.Parameter(torch.zeros(2))]
    check_optimizer(torch.optim.SGD(params, lr=0.1, weight_decay=1e-4), DGCMemory())
    assert DGCMemory.needs_plain_optimizer is True
    with pytest.raises(ValueError, match=r"group 0 of RMSprop has momentum=0.9"):
        DGCMemory().check_optimizer(torch.optim.RMSprop(params, lr=0.1, momentum=0.9))
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\), got 1.5"):
        DGCMemory(momentum=1.5)


@pytest.mark.parametrize("name", NAMES)
def test_a_compressor_pickles_and_copies_with_its_recommendations(name):
    """A spawned worker receives its compressor pickled, and ``copy.deepcopy`` copies it the
    same way: every compressor at its defaults survives both, with what it recommends."""
    import copy
    import pickle
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a recipe's warning about the defaults is not the point here
        compressor = compressors.create(name)
    for twin in (pickle.loads(pickle.dumps(compressor)), copy.deepcopy(compressor)):
        assert type(twin) is type(compressor) and repr(twin) == repr(compressor)
        assert twin.recommended_memory == compressor.recommended_memory
        assert dict(twin.recommended_memory_options) == dict(compressor.recommended_memory_options)
