"""Faults that cross ranks: an exception on one rank reaches the others at once and by name
(a lost peer, not a collective's timeout), a job started with the wrong number of ranks fails
at the configured timeout saying so, and the small values ranks exchange travel as JSON,
never pickle.  No test asserts on wall time: each asserts which error ended the wait."""
import os
import pickle
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from mergecomp.distributed import launch
from mergecomp.distributed.backends.torch_dist import TorchDistributedBackend

from .distributed import run_ranks

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RAISING_SCRIPT = """
import os, sys, torch, mergecomp, mergecomp.ddp
from mergecomp.distributed import launch
entry, bad = sys.argv[1], int(sys.argv[2])
info = launch.init_distributed()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
if entry == "wrapper":
    optimizer = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                               model=model, compressor="topk", schedule=2)
    net = model
else:
    net = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    mergecomp.ddp.register(net, compressor="topk", optimizer=optimizer)
try:
    for step in range(5):
        optimizer.zero_grad()
        loss = net(torch.randn(4, 8)).sum()
        if info.rank == bad and step == 2:
            raise ValueError("bad batch 17")
        loss.backward()
        optimizer.step()
except Exception as error:
    if info.rank != bad:
        print(f"FAILED with {type(error).__name__}", flush=True)
    raise
"""  # the exception is not caught on the rank that raises: it ends the script


def _environment(launcher, rank, world_size, port):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "MERGECOMP_LAUNCHER", "TORCHELASTIC_RUN_ID", "MERGECOMP_TIMEOUT"):
        env.pop(name, None)
    if launcher == "env":  # torchrun's variables, set by hand
        env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world_size))
    else:  # what mpirun gives its processes
        env.update(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE=str(world_size),
                   OMPI_COMM_WORLD_LOCAL_RANK=str(rank),
                   OMPI_COMM_WORLD_LOCAL_SIZE=str(world_size))
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


@pytest.mark.parametrize("entry, bad, launcher", [("wrapper", 1, "env"), ("ddp", 0, "mpirun")])
def test_an_exception_on_one_rank_reaches_the_others_at_once_by_name(tmp_path, entry, bad,
                                                                      launcher):
    script = tmp_path / "raising.py"
    script.write_text(RAISING_SCRIPT)
    port = launch.free_port()
    processes = [subprocess.Popen([sys.executable, str(script), entry, str(bad)],
                                  env=_environment(launcher, rank, 2, port), cwd=REPO_ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for rank in range(2)]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    other = outputs[1 - bad]
    assert all(p.returncode != 0 for p in processes), outputs
    assert "ValueError: bad batch 17" in outputs[bad], outputs[bad]
    assert "mergecomp.distributed.watchdog.PeerLost" in other, other
    assert re.search(rf"rank {bad} \(.*\) raised ValueError\('bad batch 17'\) at step 1", other), other
    assert f"Ranks [{bad}] raised an exception that ended their script" in other, other
    assert "its script ended or called" not in other and "shard the data" not in other, other
    # at once: the rank's connections closed (PeerLost), no collective waited for its timeout
    assert "FAILED with PeerLost" in other and "CollectiveTimeout" not in other, other


def test_under_torchrun_an_exception_on_rank_0_reaches_the_others_at_once(tmp_path):
    script = tmp_path / "raising.py"
    script.write_text(RAISING_SCRIPT)
    env = _environment("env", 0, 2, 0)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"):
        env.pop(name)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(launch.free_port()), str(script), "ddp", "0"]
    done = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=150)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert re.search(r"rank 0 \(.*\) raised ValueError\('bad batch 17'\)", output), output
    assert "FAILED with PeerLost" in output and "CollectiveTimeout" not in output, output


def test_a_job_started_with_too_few_ranks_fails_at_the_timeout_saying_so(tmp_path):
    script = tmp_path / "alone.py"
    script.write_text("from mergecomp import launch\nlaunch.init_distributed()\n")
    env = _environment("env", 0, 2, launch.free_port())
    env["MERGECOMP_TIMEOUT"] = "2"
    # timeout=120: a guard against a hang, far beyond the 2 s configured, not a timing
    done = subprocess.run([sys.executable, str(script)], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "mergecomp.distributed.launch.RendezvousError: 1 of the 2 ranks the job expects (WORLD_SIZE=2) " \
           "joined the rendezvous" in done.stderr, done.stderr
    assert "--nproc_per_node 2 alone.py" in done.stderr and "set WORLD_SIZE to the number of " \
           "processes started" in done.stderr, done.stderr
    # the wait that ended was the configured one, not the start-up default
    assert "within 2s" in done.stderr and "The wait was the configured timeout" in done.stderr, done.stderr


def test_the_default_rendezvous_wait_is_named_in_the_message():
    info = launch.LaunchInfo("env", 0, 2, 0, 2, "127.0.0.1", 4000)
    error = RuntimeError("Timed out after 301 seconds waiting for clients. 1/2 clients joined.")
    message = str(launch._rendezvous_error(error, info, 300.0, configured=False))
    assert "1 of the 2 ranks" in message and "within 300s" in message
    assert "start-up default" in message and "MERGECOMP_TIMEOUT=<seconds>" in message
    assert launch._rendezvous_error(ValueError("bad rank"), info, 300.0, False) is None


# ----------------------------------------------------------------------------- JSON, not pickle

def _refuse_pickle(*args, **kwargs):
    raise AssertionError("a value from a peer was unpickled")


def exchange_worker(rank, world_size):
    pickle.loads = _refuse_pickle
    dist.all_gather_object = dist.broadcast_object_list = _refuse_pickle
    backend = TorchDistributedBackend()
    gathered = backend.allgather_object({"rank": rank, "times": [0.5, float("inf")], "digest": "ab"})
    sent = backend.broadcast_object({"plan": [["w", "b"]], "rank": rank}, src=1)
    before = backend.collectives, backend.bytes_sent
    errors = []
    for value in ({0: "int key"} if rank == 1 else {"ok": 1}, torch.ones(1) if rank == 0 else 1):
        try:
            backend.allgather_object(value)
        except TypeError as error:
            errors.append(str(error))
    try:
        backend.broadcast_object(object(), src=0)
    except TypeError as error:
        errors.append(str(error))
    return gathered, sent, (backend.collectives, backend.bytes_sent) == before, errors


def test_values_between_ranks_travel_as_json_and_anything_else_fails_on_every_rank():
    for rank, (gathered, sent, uncounted, errors) in enumerate(run_ranks(exchange_worker, 2)):
        assert gathered == [{"rank": r, "times": [0.5, float("inf")], "digest": "ab"}
                            for r in range(2)]
        assert sent == {"plan": [["w", "b"]], "rank": 1} and uncounted
        assert len(errors) == 3, errors  # every rank raises alike, none waits for the others
        assert "rank 1 passed a value that JSON cannot carry: the value has the key 0 of type int: JSON keys are strings" in errors[0]
        assert "rank 0 passed a value that JSON cannot carry: the value is of type Tensor" in errors[1] and "travel as JSON" in errors[1]
        assert "the value is of type object" in errors[2]


# -- hostile JSON from a peer ------------------------------------------------------------------------

#: Bytes a peer may send instead of what Backend._encode writes, and what the refusal says.
HOSTILE = [
    (b'["ok",' + b"[" * 100_000 + b"]" * 100_000 + b"]", "nests deeper than 32 lists or objects"),
    (b'["ok",' + b"[" * 100 + b"]" * 100 + b"]", "nests deeper than 32 lists or objects"),
    (b'["ok",' + b'{"a":' * 100 + b"1" + b"}" * 100 + b"]", "nests deeper than 32 lists or objects"),
    (b'{"ok": 1, "x": 2}', 'is no ["ok", value] or ["error", why]'),
    (b'["ok"]', 'is no ["ok", value] or ["error", why]'),
    (b"5", 'is no ["ok", value] or ["error", why]'),
    (b'["maybe", 1]', 'is no ["ok", value] or ["error", why]'),
    (b'["error", {"why": 1}]', 'error is {"why": 1}, not a message'),
    (b'["ok", 1', "bytes are not a JSON value"),
    (b"\xff\xfe", "bytes are not a JSON value"),
]


def _send_from_rank_1(rank, payload):
    """Make this process send ``payload`` as its next JSON value when it is rank 1."""
    from mergecomp.distributed.backends import base
    if rank == 1:
        base._encode = lambda obj, op, sender: payload


def hostile_worker(rank, world_size):
    from mergecomp.distributed.backends.expect import NUMBER, OBJECT, STRING, list_of, optional, tuple_of
    from mergecomp.distributed.backends.serialize import HeaderError
    from mergecomp.runtime.agreement import StepAgreement
    real_encode = __import__("mergecomp.distributed.backends.base", fromlist=["_encode"])._encode
    backend = TorchDistributedBackend()
    seen = []

    def attempt(call):
        try:
            call()
            seen.append(None)
        except HeaderError as error:
            seen.append(str(error))
        except BaseException as error:  # anything but the header error fails the test
            seen.append(f"{type(error).__name__}: {error}")

    for payload, _ in HOSTILE:
        _send_from_rank_1(rank, payload)
        attempt(lambda: backend.allgather_object({"fine": 1}))
        attempt(lambda: backend.broadcast_object({"fine": 1}, src=1))
    # well-formed JSON of another form than the receiver expects
    for good, bad, expect in (({}, [1, 2], OBJECT), ("ab", {"a": 1}, STRING), (0.5, "0.5", NUMBER),
                              ([0.5], [0.5, "x"], list_of(NUMBER)),
                              ([["a", 1]], [[1], [2]], list_of(tuple_of(STRING, NUMBER))),
                              (None, 0.5, optional(STRING))):
        _send_from_rank_1(rank, real_encode(bad, "allgather_object", rank))
        attempt(lambda: backend.allgather_object(good, expect=expect))
    # the step agreement: facts that differ, and a peer whose facts are no object
    _send_from_rank_1(rank, b'["ok", [["plan", "p"], ["steps", 3]]]')
    agreement = StepAgreement(backend, torch.device("cpu"))
    facts = {"plan": "p", "steps": rank}
    attempt(lambda: agreement.check(agreement.preflight(facts), facts, "at step 3"))
    return seen


def test_a_hostile_json_value_from_a_peer_is_a_header_error_naming_it_on_every_rank():
    """Deep nesting, an envelope of another shape, bytes that are not JSON, and JSON of another
    form than the call expects: each is refused as a bad header from rank 1, on both ranks,
    never a RecursionError or TypeError (or a value used as if it were right)."""
    for seen in run_ranks(hostile_worker, 2):
        assert len(seen) == 2 * len(HOSTILE) + 7
        for index, (_, said) in enumerate(HOSTILE):
            for message in seen[2 * index:2 * index + 2]:
                assert message is not None and message.startswith("rank 1 sent a header"), message
                assert said in message, message
        shapes = seen[2 * len(HOSTILE):]
        assert all(m is not None and m.startswith("rank 1 sent a header") for m in shapes), shapes
        assert "its allgather_object value is not a JSON object: the value is [1, 2], not a JSON object" in shapes[0]
        assert "the value is {\"a\": 1}, not a string" in shapes[1]
        assert "the value is \"0.5\", not a number" in shapes[2]
        assert "the value[1] is \"x\", not a number" in shapes[3]
        assert "the value[0] is [1], not [a string, a number]" in shapes[4]
        assert "the value is 0.5, not None or a string" in shapes[5]
        assert "its allgather_object value is not a JSON object" in shapes[6]  # the agreement's facts


def test_a_disagreement_among_facts_that_are_no_object_names_the_rank():
    from mergecomp.distributed.backends.serialize import HeaderError
    from mergecomp.runtime.agreement import describe_disagreement
    with pytest.raises(HeaderError, match=r"rank 1 sent a header .*: its set of facts is \[1, 2\], not a JSON object"):
        describe_disagreement([{"steps": 1}, [1, 2]], "at construction")


def test_expected_forms_say_where_a_value_differs():
    from mergecomp.distributed.backends.expect import (DTYPE_NAME, INT, NUMBER, fields, index_below, list_of,
                                           object_of, tuple_of)
    samples = object_of(list_of(tuple_of(INT, NUMBER)))
    form = tuple_of(fields(launch=samples, finish=samples), list_of(NUMBER))
    assert form.problem([{"launch": {"fp32": [[10, 0.5]]}, "finish": {}}, [0.1]]) is None
    assert form.problem([{"launch": {}}, []]) == "the value[0] has no 'finish'"
    assert form.problem([{"launch": {"fp32": [[10.5, 0.5]]}, "finish": {}}, []]) == \
        "the value[0]['launch']['fp32'][0][0] is 10.5, not a whole number"
    assert index_below(3).problem(3) == "the value is 3, not a whole number from 0 to 2"
    assert index_below(3).problem(True) is not None  # a boolean is no index
    assert object_of(DTYPE_NAME).problem({"memory/residuals": "float32"}) is None
    assert object_of(DTYPE_NAME).problem({"memory/residuals": "save"}) == \
        "the value['memory/residuals'] is \"save\", not the name of a torch dtype"
    assert list_of(NUMBER, length=2).problem([1.0]) == "the value has 1 items, not 2"
