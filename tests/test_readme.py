"""The README's code runs as written: its training-script and DDP snippets on two gloo ranks,
with the names it leaves to the user (a model, a loader) filled in."""
import os
import re

import torch
import torch.nn as nn

from tests.distributed import run_ranks

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def python_blocks(heading: str):
    """The ```python blocks under the README's ``## heading``."""
    text = open(README, encoding="utf-8").read()
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def _user_names(rank):
    torch.manual_seed(rank)  # a different model per rank: the wrapper must make them one
    generator = torch.Generator().manual_seed(100 + rank)
    data = [(torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)) for _ in range(3)]
    return {"build_model": lambda: nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)),
            "loader": data, "epochs": 2, "loss_fn": nn.functional.mse_loss}


def training_script_worker(rank, world_size, code):
    names = _user_names(rank)
    exec(code, names)
    model, optimizer = names["model"], names["optimizer"]
    return [p.detach().clone() for p in model.parameters()], optimizer.compressor.__class__.__name__


def test_the_training_script_snippet_trains_one_model_on_every_rank():
    (code,) = python_blocks("Use it in your training script")
    ranks = run_ranks(training_script_worker, 2, code)
    (params0, name), (params1, _) = ranks
    assert name == "TopKCompressor"
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))


def ddp_worker(rank, world_size, code):
    from torch.nn.parallel import DistributedDataParallel
    import mergecomp
    import mergecomp.ddp
    names = dict(_user_names(rank), DistributedDataParallel=DistributedDataParallel, mergecomp=mergecomp,
                 torch=torch)
    names["model"] = names["build_model"]()
    lines = [line for line in code.splitlines() if line.strip()]
    ddp_lines = lines[:lines.index(next(l for l in lines if l.startswith("# Lightning")))]
    exec("\n".join(ddp_lines), names)
    ddp, state, optimizer = names["ddp"], names["state"], names["optimizer"]
    for inputs, targets in names["loader"]:
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(inputs), targets).backward()
        optimizer.step()
    return type(state.compressor).__name__, [p.detach().clone() for p in ddp.parameters()]


def test_the_ddp_snippet_registers_the_hook_on_ddps_buckets():
    (code,) = python_blocks("Use it with DDP, Lightning, Accelerate, Horovod")
    (name, params0), (_, params1) = run_ranks(ddp_worker, 2, code)
    assert name == "DGCCompressor"
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))
