"""The CUDA paths: compressors on GPU tensors, and the optimizer and DDP hook over NCCL.

Skipped without a GPU (the CI machine has none).  One GPU is enough: NCCL refuses two
ranks on one device, so the collectives run as a 1-rank NCCL group, which still takes
every tensor through NCCL (CPU tensors are refused there) and every decode, sum and
write-back through CUDA memory.  Tensors must stay on the GPU from gradient to parameter:
each test checks where they end up, not only that the numbers are finite.
"""
import pytest
import torch
import torch.nn as nn

from mergecomp import compressors
from mergecomp.distributed import launch
from mergecomp.compressors.testing import check_compressor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")

#: (compressor, memory, communicator) rows that cover every payload path: summable
#: allreduce, fixed and variable allgather (bounded and exchanged sizes), PS, multi-round.
PIPELINES = [
    ("none", "none", "allreduce"), ("fp16", "none", "allreduce"), ("bf16", "none", "allreduce"),
    ("topk", "residual", "allgather"), ("dgc", "dgc", "allgather"), ("randk", "residual", "allreduce"),
    ("qsgd", "none", "allgather"), ("terngrad", "none", "allgather"), ("signsgd", "none", "allgather"),
    ("efsignsgd", "residual", "allgather"), ("signum", "none", "allgather"), ("onebit", "residual", "allgather"),
    ("tbq", "residual", "allgather"), ("graddrop", "residual", "allgather"), ("powersgd", "none", "allreduce"),
    ("batched_powersgd", "none", "allreduce"), ("atomo", "none", "allgather"), ("topk", "residual", "ps"),
    ("dgc", "dgc", "ps"), ("qsgd", "none", "ps"),
]


@pytest.mark.parametrize("name", compressors.available())
def test_every_compressor_keeps_the_kit_laws_on_cuda(name):
    check_compressor(compressors.get(name), device="cuda", samples=500)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 16),
                         nn.ReLU(), nn.Linear(16, 4), nn.Linear(4, 4))  # the last layer unused below


def _forward(model, x):
    return model[:-1](x)  # the last Linear takes no part: find_unused_parameters has work


def _train_on_nccl(compressor, memory, communicator, backend="nccl", device="cuda"):
    import mergecomp
    launch.init_distributed(backend=backend, device=device)
    device = torch.device(device, 0) if device == "cuda" else torch.device(device)
    model = _model().to(device)
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.0 if memory in ("dgc", "demo") or compressor == "signum" else 0.9)
    optimizer = mergecomp.DistributedOptimizer(base, model=model, compressor=compressor, memory=memory,
                                               communicator=communicator, schedule=2,
                                               find_unused_parameters=True)
    generator = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(16, 3, 8, 8, device=device, generator=generator)
    y = torch.randint(0, 4, (16,), device=device, generator=generator)
    losses = []
    for step in range(6):
        optimizer.set_epoch(step // 3)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(_forward(model, x), y)
        if step == 3:  # one non-finite step: dropped, state untouched
            loss = loss * float("nan")
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    grads_on_gpu = all(p.grad is None or p.grad.device == device for p in model.parameters())
    unused_grad = model[-1].weight.grad
    result = dict(losses=losses, finite=all(bool(torch.isfinite(p).all()) for p in model.parameters()),
                  params_on_gpu=all(p.device == device for p in model.parameters()),
                  grads_on_gpu=grads_on_gpu, unused_grad_none=unused_grad is None,
                  skipped=optimizer.skipped_steps)
    optimizer.remove_hooks()
    launch.shutdown()
    return result


@pytest.mark.parametrize("compressor, memory, communicator", PIPELINES,
                         ids=[f"{c}-{m}-{k}" for c, m, k in PIPELINES])
def test_the_optimizer_trains_over_nccl_on_the_gpu(compressor, memory, communicator):
    result = launch.spawn(_train_on_nccl, 1, args=(compressor, memory, communicator), timeout_s=300)[0]
    assert result["finite"] and result["params_on_gpu"] and result["grads_on_gpu"], result
    assert result["unused_grad_none"], result
    assert all(l == l for i, l in enumerate(result["losses"]) if i != 3), result
    assert result["skipped"] == 1, result


def _ddp_hook_on_nccl(compressor, memory, backend="nccl", device="cuda"):
    import mergecomp
    import mergecomp.ddp
    from torch.nn.parallel import DistributedDataParallel as DDP
    launch.init_distributed(backend=backend, device=device)
    device = torch.device(device, 0) if device == "cuda" else torch.device(device)
    model = _model()[:-1].to(device)
    ddp = DDP(model, device_ids=[0] if device.type == "cuda" else None,
              bucket_cap_mb_list=mergecomp.ddp.bucket_caps(model, 2))
    mergecomp.ddp.register(ddp, compressor=compressor, memory=memory)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(16, 3, 8, 8, device=device, generator=generator)
    y = torch.randint(0, 4, (16,), device=device, generator=generator)
    for _ in range(4):
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    result = dict(finite=all(bool(torch.isfinite(p).all()) for p in model.parameters()),
                  grads_on_gpu=all(p.grad.device == device for p in model.parameters()))
    launch.shutdown()
    return result


@pytest.mark.parametrize("compressor, memory", [("fp16", "none"), ("topk", "residual"), ("dgc", "dgc"),
                                                ("powersgd", "none"), ("efsignsgd", "residual")])
def test_the_ddp_hook_runs_over_nccl_on_the_gpu(compressor, memory):
    result = launch.spawn(_ddp_hook_on_nccl, 1, args=(compressor, memory), timeout_s=300)[0]
    assert result["finite"] and result["grads_on_gpu"], result
