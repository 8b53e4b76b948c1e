"""Run a test function on several real gloo ranks over loopback.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes, initialises a gloo
process group in each, calls ``fn(rank, world_size, *args)`` and returns the list of what
each rank returned.  An exception on any rank fails the test with that rank's traceback;
a hang fails it after ``timeout`` seconds instead of blocking the suite.

Processes come from a fork server that has imported torch once, so a rank starts in
milliseconds rather than re-importing torch (the fork server itself never ran torch
code, so forking it is safe).
"""
from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp

_context = mp.get_context("forkserver")
# torch._dynamo is what torch.optim.Optimizer imports on first construction: seconds each time.
_context.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "torch.optim",
                                 "mergecomp", "tests.distributed"])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world_size, port, fn, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=60))
        outcome = ("ok", fn(rank, world_size, *args))
    except BaseException:  # report every failure, including assertion errors
        outcome = ("error", traceback.format_exc())
    try:
        results.put((rank, pickle.dumps(outcome)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return their results."""
    results = _context.Queue()
    port = free_port()
    procs = [_context.Process(target=_worker, args=(r, world_size, port, fn, args, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    collected = {}
    deadline = time.monotonic() + timeout
    try:
        while len(collected) < world_size and time.monotonic() < deadline:
            try:
                rank, blob = results.get(timeout=0.5)
                collected[rank] = pickle.loads(blob)
            except queue.Empty:
                if all(not p.is_alive() for p in procs):
                    break
    finally:
        for p in procs:
            p.join(5 if len(collected) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    missing = [r for r in range(world_size) if r not in collected]
    errors = [f"rank {r}:\n{collected[r][1]}" for r in sorted(collected) if collected[r][0] == "error"]
    if errors:
        raise AssertionError("\n".join(errors))
    if missing:
        raise AssertionError(f"ranks {missing} gave no result within {timeout}s "
                             "(a collective hung, or the process crashed)")
    return [collected[r][1] for r in range(world_size)]
