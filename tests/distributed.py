"""Run a test function on several real gloo ranks over loopback.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes, initialises a gloo
process group in each, calls ``fn(rank, world_size, *args)`` and returns the list of what
each rank returned.  An exception on any rank fails the test with that rank's traceback;
a hang fails it after ``timeout`` seconds instead of blocking the suite.
"""
from __future__ import annotations

import os
import socket
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world_size, port, fn, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=60))
        results[rank] = ("ok", fn(rank, world_size, *args))
    except BaseException:  # report every failure, including assertion errors
        results[rank] = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return their results."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        collected = dict(results)
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {timeout}s (a collective hung?)")
    errors = [f"rank {r}:\n{collected[r][1]}" for r in range(world_size)
              if r in collected and collected[r][0] == "error"]
    if errors:
        raise AssertionError("\n".join(errors))
    missing = [r for r in range(world_size) if r not in collected]
    if missing:
        raise AssertionError(f"ranks {missing} exited without a result (crashed?)")
    return [collected[r][1] for r in range(world_size)]
