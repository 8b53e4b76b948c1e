"""DeMo: the DCT round trip is exact, the memory is the paper's decoupled momentum, and it
trains through the wrapper on real ranks."""
import pytest
import torch

from mergecomp import compressors, memories
from mergecomp.compressors.base import ParamView
from mergecomp.compressors.demo import dct_basis

from .distributed import run_ranks


def test_the_basis_is_orthonormal():
    basis = dct_basis(64, torch.float64, torch.device("cpu"))
    assert torch.allclose(basis @ basis.t(), torch.eye(64, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_all_coefficients_sent_round_trip_exactly(dtype, tolerance):
    demo = compressors.create("demo", chunk=16, topk=16)
    x = torch.randn(5, 13, dtype=dtype)
    layout = (ParamView("w", torch.Size([4, 13]), 0), ParamView("b", torch.Size([13]), 52))
    payload, ctx = demo.compress(x, "g", layout=layout)
    assert payload[1].dtype == torch.uint8 and payload[0].dtype == dtype
    assert torch.allclose(demo.decompress(payload, ctx), x, atol=tolerance, rtol=0)


def test_a_smooth_chunk_is_carried_by_its_low_frequencies():
    """A slowly varying row has its energy in a few DCT coefficients: top-4 of 64 keeps it."""
    demo = compressors.create("demo", chunk=64, topk=4)
    x = torch.cos(torch.linspace(0, 3.0, 64))
    payload, ctx = demo.compress(x, "g")
    error = (demo.decompress(payload, ctx) - x).norm() / x.norm()
    assert error < 0.05


def test_the_sum_in_the_dct_domain_equals_the_sum_of_decodes():
    demo = compressors.create("demo", chunk=8, topk=3)
    payloads = [demo.compress(torch.randn(50), "g") for _ in range(3)]
    ctx = payloads[0][1]
    total = sum(demo.decompress(p, ctx) for p, _ in payloads)
    assert torch.allclose(demo.decompress_sum([p for p, _ in payloads], ctx), total, atol=1e-6)


def test_the_memory_is_decoupled_momentum():
    """m ← β·m + g; q = DCT top-k of m; m ← m − q (Algorithm 1), step after step."""
    demo, memory = compressors.create("demo", chunk=8, topk=2), memories.create("demo", momentum=0.9)
    momentum = torch.zeros(40)
    for step in range(4):
        g = torch.randn(40)
        compensated = memory.compensate(g, "g")
        payload, ctx = demo.compress(compensated, "g")
        memory.update(compensated, "g", demo, payload, ctx)
        memory.commit()
        momentum = 0.9 * momentum + g
        momentum = momentum - demo.decompress(payload, ctx)
        assert torch.allclose(memory.residuals["g"], momentum, atol=1e-6)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="demo topk must be an integer in \\[1, chunk=8\\].*got 9"):
        compressors.create("demo", chunk=8, topk=9)
    with pytest.raises(ValueError, match="demo chunk must be"):
        compressors.create("demo", chunk=0)
    with pytest.raises(ValueError, match="demo memory momentum"):
        memories.create("demo", momentum=1.0)
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="demo memory .* momentum=0.9.*momentum=0"):
        memories.get("demo").check_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def _train_with_demo(rank, world_size):
    import mergecomp
    torch.manual_seed(rank)  # different models: the wrapper makes them rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = mergecomp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), model=model,
        compressor=compressors.create("demo", chunk=16, topk=4))
    assert type(optimizer.memory).__name__ == "DeMoMemory"
    generator = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(30):
        x = torch.randn(32, 8, generator=generator)
        y = x.sum(dim=1, keepdim=True)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return [p.detach().clone() for p in model.parameters()], losses


def test_demo_trains_through_the_wrapper_and_ranks_stay_equal():
    (params0, losses), (params1, _) = run_ranks(_train_with_demo, 2)
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5])
