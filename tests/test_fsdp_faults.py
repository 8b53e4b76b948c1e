"""FSDP2 under faults: a rank killed or stopped is named whichever collective was waiting
(FSDP's own all-gather included), and a rank that never registered is named at the first
backward instead of both ranks waiting out the timeout."""
import os
import subprocess
import sys

import pytest
import torch

from mergecomp.distributed import launch

from .distributed import run_ranks

pytest.importorskip("torch.distributed.fsdp")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LOST_RANK_SCRIPT = """
import os, signal, sys, torch
from torch.distributed.fsdp import fully_shard
import mergecomp
from mergecomp.distributed import launch
how, bad, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
info = launch.init_distributed(timeout_s=6)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
mesh = None
if mode == "hsdp":
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, info.world_size // 2), mesh_dim_names=("replicate", "shard"))
wrap = fully_shard
if mode == "replicate":
    from torch.distributed._composable.replicate_with_fsdp import replicate as wrap
for layer in (model[0], model[2]):
    wrap(layer, mesh=mesh)
wrap(model, mesh=mesh)
mergecomp.fsdp.register(model, compressor="topk", compress_ratio=0.1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(6):
    if step == 2 and info.rank == bad:
        print(f"RANK {bad} GOES", flush=True)
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    x = torch.randn(16, 8)
    torch.nn.functional.mse_loss(model(x), x[:, :3]).backward()
    optimizer.step()
    optimizer.zero_grad()
print(f"RANK {info.rank} DONE", flush=True)
"""


def _run(tmp_path, how, bad, world, mode):
    script = tmp_path / "lost.py"
    script.write_text(LOST_RANK_SCRIPT)
    port = launch.free_port()
    processes = []
    for rank in range(world):
        env = dict(os.environ, PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1", RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.pop("MERGECOMP_LAUNCHER", None)
        env.pop("TORCHELASTIC_RUN_ID", None)
        processes.append(subprocess.Popen([sys.executable, str(script), how, str(bad), mode], env=env,
                                          cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
    outputs = {}
    try:
        for rank, process in enumerate(processes):
            if rank != bad:  # a stopped rank never ends by itself
                outputs[rank] = process.communicate(timeout=150)[0]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return outputs


@pytest.mark.parametrize("how, world, mode", [("kill", 2, "fsdp"), ("stop", 2, "fsdp"), ("kill", 4, "hsdp")])
def test_a_lost_rank_is_named_by_every_survivor(tmp_path, how, world, mode):
    bad = world - 1
    for rank, output in _run(tmp_path, how, bad, world, mode).items():
        assert f"RANK {rank} DONE" not in output, output
        assert ("mergecomp.distributed.watchdog.PeerLost" in output
                or "mergecomp.distributed.watchdog.CollectiveTimeout" in output), output[-3000:]
        assert f"Ranks behind: [{bad}]" in output or f"rank {bad} " in output, output[-3000:]


def _registered_on_rank_0_only(rank, world_size):
    import mergecomp
    from torch.distributed.fsdp import fully_shard
    launch_timeout = 20
    torch.distributed.distributed_c10d._set_pg_timeout(__import__("datetime").timedelta(seconds=launch_timeout))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    fully_shard(model[0])
    fully_shard(model)
    if rank == 0:
        mergecomp.fsdp.register(model, compressor="topk")
    x = torch.randn(16, 8)
    try:
        torch.nn.functional.mse_loss(model(x), x[:, :3]).backward()
        torch.nn.functional.mse_loss(model(x), x[:, :3]).backward()  # the others' next collective
    except Exception as error:  # noqa: BLE001  which error each rank gets is the point
        return type(error).__name__, str(error)
    return None


def test_register_on_one_rank_only_is_named_at_the_first_backward():
    (kind, message), other = run_ranks(_registered_on_rank_0_only, 2, timeout=120)
    assert kind == "RuntimeError", message
    assert "mergecomp.fsdp.register is not registered on rank(s) [1]" in message
    assert "FSDP's own reduce-scatter" in message and "on every rank" in message
    assert other is not None  # rank 1 fails at its next collective, it does not train on alone


def _bytes_per_step(rank, world_size):
    """HSDP on two nodes of one rank: the replicas' all-reduce is compressed (and checked first)."""
    import mergecomp
    from tests.test_fsdp import _batch
    from tests.test_fsdp_hsdp import _model
    model = _model(mergecomp.fsdp.node_mesh(local_size=1))
    state = mergecomp.fsdp.register(model, compressor="topk", compress_ratio=0.1, controller="off")
    sent = []
    for step in range(3):
        x, y = _batch(rank, step)
        before = state.wire_bytes
        torch.nn.functional.mse_loss(model(x), y).backward()
        model.zero_grad()
        sent.append(state.wire_bytes - before)
    return sent


def test_the_registration_check_is_no_part_of_the_bytes_a_step_sends():
    for sent in run_ranks(_bytes_per_step, 2):
        assert sent[0] == sent[1] == sent[2] > 0, sent  # the first step's check went uncounted
