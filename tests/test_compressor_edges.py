"""The edges the kit found: zero parameters under a sign vote, random streams, NaN and empty
selections, GradDrop's count."""
import pytest
import torch

from mergecomp import communicators, compressors, memories
from mergecomp.compressors.base import ParamView
from mergecomp.compressors.single_process import run_locally
from mergecomp.compressors.sign import SignContext
from tests.distributed import run_ranks

VIEWS = (ParamView("w", torch.Size([2, 3]), 0), ParamView("frozen", torch.Size([4]), 6),
         ParamView("b", torch.Size([2]), 10))


def group(w, frozen, b):
    return torch.cat([torch.as_tensor(w, dtype=torch.float32).reshape(-1),
                      torch.as_tensor(frozen, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32)])


# --- the sign family: a zero parameter abstains ----------------------------------------------------

@pytest.mark.parametrize("name", ["signsgd", "signum"])
def test_a_parameter_zero_on_every_rank_gets_a_zero_vote(name):
    ranks = [group([[1, -2, 3], [-4, 5, -6]], [0, 0, 0, 0], [1, 1]),
             group([[1, 2, 3], [-4, -5, -6]], [0, 0, 0, 0], [-1, 1]),
             group([[-1, 2, 3], [4, 5, -6]], [0, -0.0, 0, 0], [-1, -1])]
    compressor = compressors.create(name)
    decoded = []
    for rank, g in enumerate(ranks):
        payload, ctx = compressor.compress(g, f"rank{rank}", layout=VIEWS)  # own momentum per "rank"
        assert isinstance(ctx, SignContext) and ctx.spans == ((0, 6), (6, 4), (10, 2))
        decoded.append(compressor.decompress(payload, ctx))
    vote = compressor.aggregate(decoded)
    assert vote[6:10].tolist() == [0, 0, 0, 0]  # the frozen parameter does not move
    assert vote[:6].tolist() == [1, 1, 1, -1, 1, -1] and vote[10:].tolist() == [-1, 1]


def test_a_rank_whose_parameter_is_zero_abstains_instead_of_voting_plus_one():
    signsgd = compressors.create("signsgd")
    zero_here = group(torch.ones(6), [0, 0, 0, 0], [1, 1])
    negative_there = group(torch.ones(6), [-1, -1, -1, -1], [1, 1])
    decoded = [signsgd.decompress(*signsgd.compress(g, "g", layout=VIEWS)) for g in (zero_here, negative_there)]
    assert decoded[0][6:10].tolist() == [0, 0, 0, 0]
    assert signsgd.aggregate(decoded)[6:10].tolist() == [-1, -1, -1, -1]  # not a 0 tie against +1


def test_only_an_all_zero_view_abstains():
    signsgd = compressors.create("signsgd")
    g = group([[0, 0, 0], [0, 0, -1e-30]], [0, 5, 0, 0], [0, 0])  # first elements zero, not all
    decoded = signsgd.decompress(*signsgd.compress(g, "g", layout=VIEWS))
    assert decoded.tolist() == [1, 1, 1, 1, 1, -1, 1, 1, 1, 1, 0, 0]


def test_efsignsgd_scales_each_view_by_its_own_mean_magnitude_and_leaves_a_zero_view_at_zero():
    ef = compressors.create("efsignsgd")
    g = group([[1, -2, 3], [-4, 5, -6]], [0, 0, 0, 0], [3, -3])
    decoded = ef.decompress(*ef.compress(g, "g", layout=VIEWS))
    first, last = 21 / 6, 6 / 2  # each view's mean magnitude
    assert decoded.tolist() == pytest.approx([first, -first, first, -first, first, -first, 0, 0, 0, 0, last, -last])


def test_onebit_rebuilds_each_view_with_its_own_means():
    onebit = compressors.create("onebit")
    g = group([[1, -2, 3], [-4, 5, -6]], [0, 0, 0, 0], [3, -3])
    decoded = onebit.decompress(*onebit.compress(g, "g", layout=VIEWS))
    assert decoded.tolist() == pytest.approx([3, -4, 3, -4, 3, -4, 0, 0, 0, 0, 3, -3])


def test_a_whole_zero_group_decodes_to_zero_without_a_layout():
    for name in ("signsgd", "signum", "efsignsgd"):
        decoded, nbytes = run_locally(compressors.create(name), torch.zeros(100))
        assert not decoded.any() and nbytes == 13 + 1 + (4 if name == "efsignsgd" else 0)


def test_signum_momentum_decides_the_abstention():
    signum = compressors.create("signum", beta=0.5)
    signum.compress(group(torch.ones(6), [1, 0, 0, 0], [1, 1]), "g", layout=VIEWS)
    signum.commit()
    payload, ctx = signum.compress(group(torch.ones(6), [0, 0, 0, 0], [1, 1]), "g", layout=VIEWS)
    assert signum.decompress(payload, ctx)[6:10].tolist() == [1, 1, 1, 1]  # the momentum is not zero yet
    fresh = compressors.create("signum")
    payload, ctx = fresh.compress(group(torch.ones(6), [0, 0, 0, 0], [1, 1]), "g", layout=VIEWS)
    assert fresh.decompress(payload, ctx)[6:10].tolist() == [0, 0, 0, 0]


def test_flags_of_another_layout_are_refused():
    signsgd = compressors.create("signsgd")
    payload, _ = signsgd.compress(torch.randn(12), "g")  # one view: one flag byte
    views = tuple(ParamView(f"p{i}", torch.Size([1]), i) for i in range(12))
    _, ctx = signsgd.compress(torch.randn(12), "g", layout=views)  # twelve views: two bytes
    with pytest.raises(ValueError, match="1 bytes of zero-view flags but its context has 12 views"):
        signsgd.decompress(payload, ctx)
    with pytest.raises(ValueError, match="layout covers 11 elements but the buffer has 12"):
        signsgd.compress(torch.randn(12), "g", layout=views[:-1])


def signsgd_allgather_worker(rank, world_size):
    from mergecomp.distributed.backends.torch_dist import TorchDistributedBackend
    communicator = communicators.create("allgather", compressor=compressors.create("signsgd"),
                                        memory=memories.create("none"), backend=TorchDistributedBackend())
    g = group(torch.randn(6, generator=torch.Generator().manual_seed(rank)), [0, 0, 0, 0],
              [1.0, -1.0] if rank else [0.0, 0.0])
    vote = communicator.finish(communicator.start(g, "g", layout=VIEWS))
    return vote.tolist()


def test_a_zero_parameter_does_not_move_through_a_real_allgather():
    votes = run_ranks(signsgd_allgather_worker, 2)
    assert votes[0] == votes[1]
    assert votes[0][6:10] == [0, 0, 0, 0] and votes[0][10:] == [1, -1]  # rank 0 abstains on b


# --- private random streams ------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["qsgd", "terngrad"])
def test_stochastic_rounding_differs_between_ranks_and_ignores_the_global_generator(name):
    x = torch.randn(5000, generator=torch.Generator().manual_seed(0))

    def payload(rank, seed=0, global_seed=0, first=None):
        compressor = compressors.create(name, seed=seed)
        compressor.set_process_rank(rank)
        torch.manual_seed(global_seed)
        if first is not None:
            compressor.compress(x, first)
        return compressor.compress(x, "g")[0][0]

    assert torch.equal(payload(0), payload(0, global_seed=123))
    assert not torch.equal(payload(0), payload(1))
    assert not torch.equal(payload(0), payload(0, seed=1))
    assert torch.equal(payload(1), payload(1, first="another group"))  # streams are per group


@pytest.mark.parametrize("name", ["qsgd", "terngrad"])
def test_a_rolled_back_step_draws_again_what_it_drew(name):
    x = torch.randn(3000)
    compressor = compressors.create(name)
    first = compressor.compress(x, "g")[0][0].clone()
    compressor.rollback()
    assert torch.equal(compressor.compress(x, "g")[0][0], first)
    compressor.commit()
    assert not torch.equal(compressor.compress(x, "g")[0][0], first)
    assert compressor.state_dict() == {"steps": {"g": 1}}


def test_randk_indices_are_the_same_on_every_rank_and_rewind_with_the_step():
    x = torch.randn(1000)
    ranks = [compressors.create("randk", compress_ratio=0.05, seed=4) for _ in range(2)]
    ranks[1].set_process_rank(1)
    first = [r.compress(x, "g")[1].indices for r in ranks]
    assert torch.equal(first[0], first[1])
    ranks[0].rollback()
    assert torch.equal(ranks[0].compress(x, "g")[1].indices, first[0])
    ranks[0].commit()
    assert ranks[0].state_dict() == {"steps": {"g": 1}}
    assert not torch.equal(ranks[0].compress(x, "g")[1].indices, first[0])


def test_dgc_saves_its_epoch():
    dgc = compressors.create("dgc", compress_ratio=0.001, warmup=4)
    dgc.set_epoch(2)
    resumed = compressors.create("dgc", compress_ratio=0.001, warmup=4)
    resumed.load_state_dict(dgc.state_dict())
    assert resumed.epoch == 2 and resumed.density() == dgc.density()


# --- selections on NaN and empty tensors --------------------------------------------------------------

def test_topk_ranks_a_nan_first_as_torch_topk_does():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    x[17] = float("nan")
    (values, indices), _ = compressors.create("topk", compress_ratio=0.01, wire_format="indexed").compress(x, "g")
    assert values.numel() == 100 and 17 in indices.tolist()
    expected = torch.topk(x.abs(), 100).indices
    assert set(indices.tolist()) == set(expected.tolist())


@pytest.mark.parametrize("name", ["topk", "dgc", "graddrop", "randk"])
def test_sparsifiers_send_nothing_for_nothing(name):
    payload, ctx = compressors.create(name).compress(torch.zeros(0), "g")
    assert all(p.numel() == 0 for p in payload)
    assert compressors.create(name).decompress(payload, ctx).shape == (0,)


@pytest.mark.parametrize("name", ["dgc", "graddrop"])
@pytest.mark.parametrize("numel", [3, 5000])
def test_threshold_sparsifiers_still_send_about_k_around_a_nan(name, numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(2))
    x[numel // 3] = float("nan")
    compressor = compressors.create(name, compress_ratio=0.2)
    values, _ = compressor.entries(*compressor.compress(x, "g"))  # any wire, decoded
    k = max(1, int(0.2 * numel))
    assert 0.5 * k <= values.numel() <= 2 * k and torch.isfinite(values).all()


def test_graddrop_sends_close_to_the_ratio():
    counts = []
    for seed in range(8):
        x = torch.randn(200_000, generator=torch.Generator().manual_seed(seed))
        (values, *_), _ = compressors.create("graddrop", compress_ratio=0.01).compress(x, "g")
        counts.append(values.numel() / 2000)
    counts = torch.tensor(counts)
    # 400 sampled survivors: a relative standard deviation near 1/√400 = 5% per step.
    assert abs(float(counts.mean()) - 1) < 0.06 and float((counts - 1).abs().max()) < 0.2, counts
    small = compressors.create("graddrop", compress_ratio=0.01)
    (values, *_), _ = small.compress(torch.randn(20_000, generator=torch.Generator().manual_seed(9)), "g")
    assert values.numel() == 200  # a sample as large as the tensor: the exact threshold


def test_onebit_with_a_layout_leaves_its_input_alone():
    onebit = compressors.create("onebit")
    g = group([[1, -2, 3], [-4, 5, -6]], [0, 0, 0, 0], [3, -3])
    before = g.clone()
    onebit.compress(g, "g", layout=VIEWS)
    assert torch.equal(g, before)
