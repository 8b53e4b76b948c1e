"""The plain-torch references of the language-model study (benchmarks/reference_dgc_lm.py):
the exchange each variant runs, on 2 gloo ranks."""
import torch

from tests.distributed import run_ranks


def exchange_worker(rank, world_size, variant):
    from benchmarks.reference_dgc_lm import exchange
    torch.manual_seed(rank)
    params = [torch.nn.Parameter(torch.zeros(6)), torch.nn.Parameter(torch.zeros(2, 2))]
    grads = [torch.randn_like(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    options = dict(clip=0, momentum=0.9, density=0.3, warmup_steps=0, masking=True, variant=variant)
    state = {}
    sent = exchange(params, state, options, 0, world_size)
    flat = torch.cat([g.reshape(-1) for g in grads])
    average = torch.cat([p.grad.reshape(-1) for p in params])
    if variant == "ef21":
        return sent, flat, state["estimate"].clone(), state["u"].clone(), average
    return sent, flat, state["v"].clone(), state["u"].clone(), average


def test_topk_variant_keeps_a_residual_and_no_momentum():
    results = run_ranks(exchange_worker, 2, "topk")
    total = torch.zeros(10)
    for sent, gradient, residual, momentum, _ in results:
        assert sent == 3 and int((residual == 0).sum()) == 3
        shipped = gradient - residual  # what left: the gradient where sent, zero elsewhere
        assert torch.equal(shipped[residual == 0], gradient[residual == 0]) and not momentum.any()
        total += shipped
    assert all(torch.allclose(average, total / 2) for *_, average in results)


def test_dgc_variant_accumulates_momentum():
    for sent, gradient, velocity, momentum, _ in run_ranks(exchange_worker, 2, "dgc"):
        assert sent == 3 and torch.equal(momentum == 0, velocity == 0)  # masking: both cleared where sent
        assert torch.equal(momentum[momentum != 0], gradient[momentum != 0])


def test_ef21_variant_steps_on_the_average_estimate():
    results = run_ranks(exchange_worker, 2, "ef21")
    total = torch.zeros(10)
    for sent, gradient, estimate, momentum, average in results:
        assert sent == 3 and int((estimate != 0).sum()) == 3  # the top 3 of u − 0, taken into the estimate
        assert torch.equal(momentum, gradient)  # u ← 0.9·0 + g
        assert torch.equal(estimate[estimate != 0], gradient[estimate != 0])
        total += estimate
    assert all(torch.allclose(average, total / 2) for *_, average in results)


def dense_worker(rank, world_size):
    from benchmarks.reference_dgc_lm import average_dense
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    for p in params:
        p.grad = torch.full_like(p, float(rank + 1))
    return average_dense(params, world_size), [p.grad.clone() for p in params]


def test_dense_vectors_are_averaged_uncompressed():
    for sent, grads in run_ranks(dense_worker, 2):
        assert sent == 5 and all(torch.equal(g, torch.full_like(g, 1.5)) for g in grads)


def scaled_sign_worker(rank, world_size):
    from benchmarks.reference_dgc_lm import scaled_sign
    torch.manual_seed(rank)
    params = [torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(2, 3))]
    grads = [torch.randn_like(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    state = {}
    sent = scaled_sign(params, state, world_size)
    return sent, grads, [state[i].clone() for i in range(2)], [p.grad.clone() for p in params]


def test_efsignsgd_variant_sends_each_tensors_scaled_sign_and_keeps_the_rest():
    results = run_ranks(scaled_sign_worker, 2)
    for index in range(2):
        shipped = []
        for sent, grads, residuals, _ in results:
            g = grads[index]
            expected = g.abs().mean() * torch.where(g < 0, -1.0, 1.0)
            assert sent == 11 and torch.allclose(g - residuals[index], expected)
            shipped.append(expected)
        for *_, averages in results:
            assert torch.allclose(averages[index], (shipped[0] + shipped[1]) / 2)


def efsignsgd_against_reference_worker(rank, world_size):
    import mergecomp
    from benchmarks.reference_dgc_lm import scaled_sign
    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 3))
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours.parameters()]
    optimizer = mergecomp.DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1), ours.named_parameters(),
                                               compressor="efsignsgd", memory="residual", communicator="allgather")
    state, largest = {}, 0.0
    for step in range(4):  # the same gradients into both; the residuals carry from step to step
        torch.manual_seed(100 * step + rank)
        for p, q in zip(ours.parameters(), theirs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        optimizer.synchronize()
        scaled_sign(theirs, state, world_size)
        largest = max([largest] + [float((p.grad - q.grad).abs().max()) for p, q in zip(ours.parameters(), theirs)])
        optimizer.step()  # commits the residuals (the parameters move; the gradients are set anew)
    optimizer.remove_hooks()
    return largest


def test_mergecomps_efsignsgd_exchange_is_the_plain_torch_reference():
    assert all(largest < 1e-6 for largest in run_ranks(efsignsgd_against_reference_worker, 2))
