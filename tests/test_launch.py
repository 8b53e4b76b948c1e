"""Launch discovery from fake environments, and real runs through spawn and mpirun."""
import atexit
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from mergecomp.distributed import launch
from mergecomp.distributed.launch import LaunchInfo, SpawnedProcessError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- detect

def test_no_launcher_is_a_single_process():
    assert launch.detect({}) == LaunchInfo("single", 0, 1, 0, 1, None, None)


def test_torchrun_multi_node():
    env = {"TORCHELASTIC_RUN_ID": "job", "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
           "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "node0", "MASTER_PORT": "29400"}
    assert launch.detect(env) == LaunchInfo("torchrun", 5, 8, 1, 4, "node0", 29400)


def test_plain_env_variables_without_a_launcher():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1",
           "MASTER_PORT": "1234"}
    assert launch.detect(env) == LaunchInfo("env", 1, 2, 1, 2, "10.0.0.1", 1234)
    del env["LOCAL_RANK"]
    with pytest.raises(ValueError, match="LOCAL_RANK is not set"):
        launch.detect(env)


def test_spawn_marker_wins_over_other_variables():
    env = {"MERGECOMP_LAUNCHER": "spawn", "TORCHELASTIC_RUN_ID": "x", "RANK": "0",
           "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "4000"}
    assert launch.detect(env).launcher == "spawn"


def _horovod(rank, size, local_rank, local_size, **extra):
    return dict(HOROVOD_RANK=str(rank), HOROVOD_SIZE=str(size), HOROVOD_LOCAL_RANK=str(local_rank),
                HOROVOD_LOCAL_SIZE=str(local_size), HOROVOD_GLOO_RENDEZVOUS_ADDR="10.0.0.9",
                HOROVOD_GLOO_RENDEZVOUS_PORT="4444", **extra)


def test_horovodrun_on_one_machine_meets_on_loopback_at_a_shared_port():
    first, second = launch.detect(_horovod(0, 2, 0, 2)), launch.detect(_horovod(1, 2, 1, 2))
    assert (first.launcher, first.rank, first.world_size, first.master_addr) == \
        ("horovodrun", 0, 2, "127.0.0.1")
    assert first.master_port == second.master_port and 20000 <= first.master_port < 30000


def test_horovodrun_without_its_rendezvous_variables_uses_the_default_port():
    env = _horovod(0, 1, 0, 1)
    del env["HOROVOD_GLOO_RENDEZVOUS_PORT"]
    assert launch.detect(env).master_port == 29500


def test_horovodrun_on_several_machines_needs_master_addr():
    with pytest.raises(ValueError, match="MASTER_ADDR is not set.*environment of horovodrun"):
        launch.detect(_horovod(3, 4, 1, 2))
    info = launch.detect(_horovod(3, 4, 1, 2, MASTER_ADDR="host0", MASTER_PORT="5000"))
    assert info == LaunchInfo("horovodrun", 3, 4, 1, 2, "host0", 5000)


def _open_mpi(rank, size, local_rank, local_size, **extra):
    return dict(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE=str(size),
                OMPI_COMM_WORLD_LOCAL_RANK=str(local_rank),
                OMPI_COMM_WORLD_LOCAL_SIZE=str(local_size),
                OMPI_MCA_ess_base_jobid="2104492033", **extra)


def test_open_mpi_on_one_machine():
    info = launch.detect(_open_mpi(1, 2, 1, 2))
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size,
            info.master_addr) == ("mpirun", 1, 2, 1, 2, "127.0.0.1")
    assert info.master_port == launch.detect(_open_mpi(0, 2, 0, 2)).master_port
    other_job = launch.detect(dict(_open_mpi(0, 2, 0, 2), OMPI_MCA_ess_base_jobid="77"))
    assert other_job.master_port != info.master_port


def test_open_mpi_on_several_machines_says_how_to_pass_the_rendezvous():
    with pytest.raises(ValueError, match=r"-x MASTER_ADDR=<host of rank 0> -x MASTER_PORT"):
        launch.detect(_open_mpi(2, 4, 0, 2))
    info = launch.detect(_open_mpi(2, 4, 0, 2, MASTER_ADDR="host0", MASTER_PORT="6000"))
    assert info == LaunchInfo("mpirun", 2, 4, 0, 2, "host0", 6000)


def test_mpich_hydra_variables():
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    info = launch.detect(env)
    assert (info.launcher, info.rank, info.world_size, info.master_addr, info.master_port) == \
        ("mpirun", 1, 2, "127.0.0.1", 29500)


@pytest.mark.parametrize("env, message", [
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
     r"RANK=2 must be in \[0, WORLD_SIZE=2\)"),
    ({"RANK": "zero", "WORLD_SIZE": "2"}, "RANK must be an integer, got 'zero'"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE must be at least 1, got 0"),
    ({"WORLD_SIZE": "2"}, "RANK is not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "needs MASTER_ADDR and MASTER_PORT"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"},
     r"MASTER_PORT must be a TCP port in \[1, 65535\], got 70000"),
    (_open_mpi(0, 2, 3, 2), r"OMPI_COMM_WORLD_LOCAL_RANK=3 must be in"),
    (_open_mpi(0, 2, 0, 4), "OMPI_COMM_WORLD_LOCAL_SIZE=4 is larger than"),
    (dict(_horovod(0, 2, 0, 2), HOROVOD_SIZE="2.5"), "HOROVOD_SIZE must be an integer, got '2.5'"),
    ({"PMI_RANK": "0", "PMI_SIZE": "2"}, "MPI_LOCALRANKID is not set"),
])
def test_inconsistent_variables_are_named_with_their_value(env, message):
    with pytest.raises(ValueError, match=message):
        launch.detect(env)


def test_free_port_can_be_bound():
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", launch.free_port()))


# ----------------------------------------------------------------------------- spawn

def _allreduce_rank_plus_one():
    torch.set_num_threads(1)
    info = launch.init_distributed(timeout_s=60)
    again = launch.init_distributed()  # idempotent
    value = torch.tensor([info.rank + 1.0])
    dist.all_reduce(value)
    return info.launcher, info.rank, info.world_size, again == info, value.item()


def _many_tensors(count):
    return [torch.full((16, 6), float(i)) for i in range(count)]


def test_spawn_returns_results_holding_many_tensors():
    results = launch.spawn(_many_tensors, 2, args=(100,), timeout_s=120)
    assert [len(r) for r in results] == [100, 100]
    assert all(torch.equal(t, torch.full((16, 6), float(i))) for i, t in enumerate(results[1]))


def test_spawn_runs_a_real_gloo_allreduce():
    results = launch.spawn(_allreduce_rank_plus_one, 2, timeout_s=120)
    assert results == [("spawn", 0, 2, True, 3.0), ("spawn", 1, 2, True, 3.0)]


def _threads():
    return len(os.listdir("/proc/self/task"))


def _ddp_model_deleted_after_shutdown():
    """A DDP model outliving the group: its Reducer must not be what destroys the group (that
    C++ destructor holds the GIL while it joins gloo's threads, which may need the GIL)."""
    torch.set_num_threads(1)
    launch.init_distributed(timeout_s=60)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    model(torch.ones(2, 4)).sum().backward()
    launch.shutdown()
    with_group = _threads()
    del model
    return with_group == _threads(), len(launch.session._retired_groups)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc to count threads")
def test_a_ddp_model_dropped_after_shutdown_leaves_the_group_to_python():
    assert launch.spawn(_ddp_model_deleted_after_shutdown, 2, timeout_s=120) == [(True, 1)] * 2


def _a_new_session_after_a_retired_group():
    launch.session._retired_groups.append("a group the last session left")
    launch.init_distributed(timeout_s=60)
    retired = list(launch.session._retired_groups)
    launch.shutdown()
    return retired


def test_a_new_session_destroys_the_groups_the_last_one_retired():
    assert launch.spawn(_a_new_session_after_a_retired_group, 1, timeout_s=120) == [[]]


def _rank_one_fails_while_rank_zero_waits(marker):
    info = launch.init_distributed(timeout_s=120)
    if info.rank == 1:
        raise RuntimeError("boom on purpose")
    # Blocked outside any collective, so no peer's failure reaches it: only spawn can stop it.
    time.sleep(150)
    with open(marker, "w") as f:  # reached only if spawn waited for it instead
        f.write("the wait ended")


def test_a_failing_child_stops_the_others_and_reports_its_rank(tmp_path):
    marker = str(tmp_path / "rank0-ended")
    with pytest.raises(SpawnedProcessError, match="spawned rank 1 raised") as caught:
        launch.spawn(_rank_one_fails_while_rank_zero_waits, 2, args=(marker,), timeout_s=300)
    assert caught.value.rank == 1 and "boom on purpose" in caught.value.child_traceback
    assert caught.value.exitcode == 1
    # rank 0 was terminated in its barrier, not left to reach the barrier's timeout
    assert not os.path.exists(marker), "the blocked rank was not terminated"


def _exit_with_code(code):
    os._exit(code)


def test_a_child_that_dies_reports_its_exit_code():
    with pytest.raises(SpawnedProcessError, match="rank 0 exited with code 3") as caught:
        launch.spawn(_exit_with_code, 1, args=(3,))
    assert caught.value.exitcode == 3


def _done_then_aborting_teardown():
    atexit.register(os.abort)  # stands in for a collective's thread aborting at teardown
    return "done"


def test_a_finished_child_exits_before_the_interpreter_teardown():
    """A rank whose result is sent skips the teardown, where gloo's threads can abort it."""
    assert launch.spawn(_done_then_aborting_teardown, 2, timeout_s=60) == ["done", "done"]


def _done_then_stuck_leaving():
    from mergecomp.distributed.launch import local_ranks
    local_ranks.shutdown = lambda: time.sleep(300)  # stands in for a process group that never lets go
    return "done"


def test_a_child_stuck_after_its_result_is_terminated_and_the_results_returned():
    began = time.monotonic()
    with pytest.warns(RuntimeWarning, match=r"spawned ranks \[0, 1\] sent their results but did not exit "
                                            r"within 2 s .*terminated"):
        assert launch.spawn(_done_then_stuck_leaving, 2, timeout_s=120, exit_grace_s=2) == ["done", "done"]
    assert time.monotonic() - began < 100  # not the child's 300 s
    with pytest.raises(ValueError, match="exit_grace_s must be a positive number of seconds, got 0"):
        launch.spawn(_done_then_stuck_leaving, 1, exit_grace_s=0)


def _init_without_any_launcher():
    for name in ("MERGECOMP_LAUNCHER", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                 "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    info = launch.init_distributed()
    assert launch.init_distributed() == info
    return info.launcher, dist.get_world_size(), dist.get_backend(), info.master_addr


def test_single_process_still_gets_a_one_rank_gloo_group():
    assert launch.spawn(_init_without_any_launcher, 1) == [("single", 1, "gloo", "127.0.0.1")]


def test_bad_spawn_arguments(monkeypatch):
    with pytest.raises(ValueError, match="nprocs must be a positive integer, got 0"):
        launch.spawn(_exit_with_code, 0)
    with pytest.raises(ValueError, match="master_port must be a TCP port .* got 0"):
        launch.spawn(_exit_with_code, 1, master_port=0)
    for bad in ("http", "0", "70000"):
        monkeypatch.setenv("MASTER_PORT", bad)
        with pytest.raises(ValueError, match=f"MASTER_PORT='{bad}' in the environment is not a TCP port.*"
                                             "unset it to let spawn pick a free port"):
            launch.spawn(_exit_with_code, 1)


def _the_port():
    """The port this rank's job met at, after an allreduce through it."""
    info = launch.init_distributed(timeout_s=60)
    dist.all_reduce(torch.ones(1))
    return str(info.master_port)


def test_spawn_meets_at_the_environments_master_port(monkeypatch):
    port = launch.free_port()
    monkeypatch.setenv("MASTER_PORT", str(port))
    assert launch.spawn(_the_port, 2, timeout_s=120) == [str(port), str(port)]
    other = launch.free_port()  # an argument wins over the environment
    assert launch.spawn(_the_port, 1, master_port=other, timeout_s=120) == [str(other)]


def test_cuda_device_without_cuda_is_refused():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="torch.cuda.is_available\\(\\) is False"):
        launch._choose_backend(None, "cuda", launch.detect({}))


# ----------------------------------------------------------------------------- mpirun, torchrun

ALLREDUCE_PROGRAM = """
import torch, torch.distributed as dist
from mergecomp.distributed import launch
info = launch.init_distributed(timeout_s=60)
value = torch.tensor([info.rank + 1.0])
dist.all_reduce(value)
print(f"RESULT {info.launcher} {info.rank} {info.world_size} {value.item()}", flush=True)
dist.destroy_process_group()
"""


def _results(stdout):
    """The RESULT records, sorted; the launcher may interleave the ranks' lines."""
    return sorted(re.findall(r"RESULT (\w+ \d+ \d+ [\d.]+)", stdout))


@pytest.mark.skipif(shutil.which("mpirun") is None,
                    reason="mpirun not found: install Open MPI (apt-get install openmpi-bin) "
                           "to test launching through mpirun")
def test_real_mpirun_allreduce():
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "MERGECOMP_LAUNCHER", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # Open MPI refuses root without these
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    command = ["mpirun", "-np", "2", "--oversubscribe", sys.executable, "-c", ALLREDUCE_PROGRAM]
    done = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=150)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _results(done.stdout) == ["mpirun 0 2 3.0", "mpirun 1 2 3.0"], done.stdout


def _killed_by_a_signal():
    import signal
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_child_killed_by_a_signal_is_reported():
    with pytest.raises(SpawnedProcessError, match="rank 0 was killed by signal 9"):
        launch.spawn(_killed_by_a_signal, 1)


def test_real_torchrun_allreduce(tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE_PROGRAM)
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "MERGECOMP_LAUNCHER"):
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(launch.free_port()), str(script)]
    done = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=150)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _results(done.stdout) == ["torchrun 0 2 3.0", "torchrun 1 2 3.0"], done.stdout
