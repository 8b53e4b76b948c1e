"""Lightning and Accelerate examples, run as a user runs them, on 2 CPU processes (gloo).

Each test asserts the run trained (the loss fell) and that mergecomp's DDP hook carried the
exchange: its step counter moved and top-k's bytes per step are a small fraction of an FP32
allreduce.
"""
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPOCH = re.compile(r"epoch (\d+): train loss ([0-9.]+), ([0-9,]+) bytes/step through mergecomp's hook "
                   r".*FP32 allreduce: ([0-9,]+)\), (\d+) hook steps")
HOOK_EPOCH = re.compile(r"epoch (\d+): .* hook steps so far, hook epoch (\d+)")


def _run(command, timeout=600, epoch_reaches_hook=False):
    """Run an example to its end; ``timeout`` only guards against a hang (a busy shared
    machine has taken over 240 s for one that takes under a minute when quiet)."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    epochs = [m.groups() for m in EPOCH.finditer(done.stdout)]
    assert len(epochs) == 2, done.stdout[-3000:]
    if epoch_reaches_hook:  # the strategy passes Lightning's epoch on (DGC's warm-up follows it)
        assert [a == b for a, b in HOOK_EPOCH.findall(done.stdout)] == [True, True], done.stdout[-3000:]
    return [(int(e), float(loss), int(sent.replace(",", "")), int(fp32.replace(",", "")), int(steps))
            for e, loss, sent, fp32, steps in epochs]


def _check(epochs):
    (_, first_loss, _, _, steps0), (_, last_loss, sent, fp32, steps1) = epochs
    assert last_loss < first_loss / 2, epochs
    assert steps1 > steps0 > 0, epochs
    # top-k at 1%: values and indices, far below FP32, even where the quality controller raised
    # the density within its byte budget (which a run this short may spend ahead)
    assert sent < fp32 / 4, epochs


def test_lightning_trains_through_mergecomps_hook():
    pytest.importorskip("lightning", reason="pip install -e .[test] installs Lightning")
    _check(_run([sys.executable, "examples/lightning_ddp.py", "--devices", "2", "--compressor", "topk",
                 "--memory", "residual", "--fusion-num", "2", "--epochs", "2"], epoch_reaches_hook=True))


def test_accelerate_trains_through_mergecomps_hook():
    pytest.importorskip("accelerate", reason="pip install -e .[test] installs Accelerate")
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    assert torchrun, "torchrun comes with torch"
    _check(_run([torchrun, "--nproc_per_node", "2", "examples/accelerate_ddp.py", "--compressor", "topk",
                 "--epochs", "2"]))


def test_accelerate_with_dgc_takes_the_sgd_momentum_over_through_accelerates_wrapper():
    """The docstring's second command: the dgc memory looks through AcceleratedOptimizer to
    the SGD inside and takes its momentum over (it refused the wrapper before)."""
    pytest.importorskip("accelerate", reason="pip install -e .[test] installs Accelerate")
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    (_, first_loss, _, _, steps0), (_, last_loss, _, _, steps1) = _run(
        [torchrun, "--nproc_per_node", "2", "examples/accelerate_ddp.py", "--compressor", "dgc", "--epochs", "2"])
    assert last_loss < first_loss and steps1 > steps0 > 0


def test_register_on_a_model_accelerate_left_alone_says_to_build_it_with_cpu_true():
    """Without GPUs, Accelerator() runs each process alone, prepare() wraps nothing, and the
    hook has no DDP to register on: the error says why and what to build instead."""
    pytest.importorskip("accelerate", reason="pip install -e .[test] installs Accelerate")
    program = ("import torch, mergecomp, mergecomp.ddp\n"
               "from accelerate import Accelerator\n"
               "model = Accelerator(cpu=True).prepare(torch.nn.Linear(4, 2))\n"
               "try:\n"
               "    mergecomp.ddp.register(model, compressor='topk')\n"
               "except TypeError as error:\n"
               "    print(error)\n")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "register() needs the DistributedDataParallel-wrapped model, got Linear" in done.stdout, done.stdout
    assert "Accelerate prepared it for 1 process, so it wrapped nothing" in done.stdout
    assert "Accelerator(cpu=True)" in done.stdout and "--num_processes 2" in done.stdout


def test_lightning_strategy_refuses_a_second_hook():
    pytest.importorskip("lightning")
    from mergecomp.integrations.lightning import MergecompDDPStrategy
    with pytest.raises(ValueError, match="registers mergecomp's hook itself: drop ddp_comm_hook="):
        MergecompDDPStrategy(compressor="topk", ddp_comm_hook=lambda state, bucket: None)
