"""Horovod backend: selection, the not-installed error, and its collectives.

The backend's own logic (naming, blob layout, splits) runs against a stand-in that gives
``horovod.torch``'s documented results over gloo, so it is tested everywhere; the tests with
real Horovod run where it is installed (``make horovod`` builds it; CI does).
"""
import sys
import types

import pytest
import torch
import torch.distributed as dist

from mergecomp import communicators, compressors, memories
from mergecomp.distributed.backends import backend_kind, default_backend
from mergecomp.distributed.backends.horovod import HorovodBackend
from tests.distributed import run_ranks

HOROVOD_ENV = {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "1", "HOROVOD_LOCAL_RANK": "0",
               "HOROVOD_LOCAL_SIZE": "1"}
NOT_INSTALLED = "Horovod is not installed: 'make horovod' builds it for this PyTorch (CI does)"

try:
    import horovod.torch  # noqa: F401
    HAVE_HOROVOD = True
except Exception:
    HAVE_HOROVOD = False


# ------------------------------------------------------------------------- selection
def test_backend_kind_follows_the_launcher_and_the_override():
    assert backend_kind({}) == "torch"
    assert backend_kind({"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "1"}) == "torch"
    assert backend_kind({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1",
                         "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}) == "torch"
    assert backend_kind(HOROVOD_ENV) == "horovod"
    assert backend_kind({**HOROVOD_ENV, "MERGECOMP_BACKEND": "torch"}) == "torch"
    assert backend_kind({"MERGECOMP_BACKEND": "Horovod"}) == "horovod"  # e.g. horovodrun's MPI mode
    with pytest.raises(ValueError, match=r"MERGECOMP_BACKEND must be one of \['torch', 'horovod'\], got 'nccl'"):
        backend_kind({"MERGECOMP_BACKEND": "nccl"})


def test_horovodrun_without_horovod_fails_with_install_advice(monkeypatch):
    for key, value in HOROVOD_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MERGECOMP_BACKEND", raising=False)
    monkeypatch.setitem(sys.modules, "horovod", None)  # makes "import horovod..." fail
    monkeypatch.setitem(sys.modules, "horovod.torch", None)
    with pytest.raises(RuntimeError) as raised:
        default_backend()
    message = str(raised.value)
    for expected in ("started by horovodrun (HOROVOD_RANK=0)", "import horovod.torch' failed",
                     "make horovod", "0.28.1", "PyTorch >= 2.1", "C++17", "MERGECOMP_BACKEND=torch"):
        assert expected in message, (expected, message)
    monkeypatch.setenv("MERGECOMP_BACKEND", "horovod")
    with pytest.raises(RuntimeError, match="MERGECOMP_BACKEND=horovod is set"):
        default_backend()


def torch_default_worker(rank, world_size):
    backend = default_backend()
    return type(backend).__name__, backend.rank, backend.size


def test_without_horovod_variables_the_default_is_torch_distributed():
    assert run_ranks(torch_default_worker, 2) == [("TorchDistributedBackend", r, 2) for r in range(2)]


# ---------------------------------------------------------- collectives, shared checks
def check_collectives(backend, rank, size):
    """Every Backend method, with the uneven and empty cases the communicators produce."""
    before = backend.bytes_sent
    (summed,) = backend.allreduce_async([torch.full((5,), float(rank + 1))]).wait()
    assert torch.equal(summed, torch.full((5,), size * (size + 1) / 2))
    assert backend.bytes_sent - before == 20

    fixed = backend.allgather_async((torch.full((3,), rank, dtype=torch.int32),
                                     torch.full((2, 2), rank / 2)), same_shapes=True).wait()
    assert [int(p[0][0]) for p in fixed] == list(range(size))
    assert all(torch.equal(p[1], torch.full((2, 2), r / 2)) for r, p in enumerate(fixed))

    # Rank r sends r values (rank 0 sends none) in fp16 with int32 indices.
    variable = backend.allgather_async((torch.arange(rank, dtype=torch.float16),
                                        torch.arange(rank, dtype=torch.int32) * 10), same_shapes=False).wait()
    for r, (values, indices) in enumerate(variable):
        assert values.dtype == torch.float16 and indices.dtype == torch.int32
        assert torch.equal(values, torch.arange(r, dtype=torch.float16))
        assert torch.equal(indices, torch.arange(r, dtype=torch.int32) * 10)

    chunks = [torch.full((rank + dest,), 16 * rank + dest, dtype=torch.uint8) for dest in range(size)]
    received = backend.alltoall(chunks)
    for src, chunk in enumerate(received):
        assert torch.equal(chunk, torch.full((src + rank,), 16 * src + rank, dtype=torch.uint8))

    # Small values travel as JSON through the tensor collectives (tuples come back as lists).
    assert backend.broadcast_object({"plan": rank}, src=0) == {"plan": 0}
    assert backend.allgather_object(("rank", rank)) == [["rank", r] for r in range(size)]
    backend.barrier()

    # The PS and allgather communicators through this backend.
    def make(kind, compressor, memory="none"):
        return communicators.create(kind, compressor=compressor, memory=memories.create(memory),
                                    backend=backend)

    g = torch.randn(1001, generator=torch.Generator().manual_seed(rank))
    exact = make("allreduce", compressors.create("none"))
    want = exact.finish(exact.start(g.clone(), "g"))
    ps = make("ps", compressors.create("none"))
    torch.testing.assert_close(ps.finish(ps.start(g.clone(), "g")), want)
    topk_ps = make("ps", compressors.create("topk", compress_ratio=0.1), "residual")
    out = topk_ps.finish(topk_ps.start(g.clone(), "g"))
    assert torch.isfinite(out).all() and topk_ps.server_residuals
    if "dgc" in compressors.available():  # variable-size payloads
        gather = make("allgather", compressors.create("dgc", compress_ratio=0.1), "residual")
        assert gather.finish(gather.start(g.clone(), "g")).shape == g.shape
    return True


# ------------------------------------------------- the backend over a documented stand-in
class HorovodStandIn(types.ModuleType):
    """What ``horovod.torch`` returns for each call this backend makes, computed over gloo.

    It also checks Horovod's rule that a collective's name is the same on every rank.
    """

    Sum = "Sum"

    def __init__(self):
        super().__init__("horovod.torch")
        self.names = []

    def is_initialized(self):
        return True

    def init(self):
        raise AssertionError("init() must not be called when Horovod is already initialised")

    def rank(self):
        return dist.get_rank()

    def size(self):
        return dist.get_world_size()

    def _same_name_everywhere(self, name):
        assert name is not None, "every collective must be named"
        names = [None] * self.size()
        dist.all_gather_object(names, name)
        assert len(set(names)) == 1, f"ranks used different names for one collective: {names}"
        assert name not in self.names, f"name {name!r} reused"
        self.names.append(name)

    def allreduce_async_(self, tensor, name=None, op=None):
        assert op == self.Sum
        self._same_name_everywhere(name)
        dist.all_reduce(tensor)
        return tensor

    def allgather_async(self, tensor, name=None):
        self._same_name_everywhere(name)
        firsts = [None] * self.size()
        dist.all_gather_object(firsts, tensor.shape[0])
        longest = max(firsts)
        padded = torch.zeros((longest,) + tensor.shape[1:], dtype=tensor.dtype)
        padded[:tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in firsts]
        dist.all_gather(parts, padded)
        return torch.cat([p[:n] for p, n in zip(parts, firsts)])

    def alltoall_async(self, tensor, splits=None, name=None):
        self._same_name_everywhere(name)
        assert splits.dtype == torch.int32 and splits.numel() == self.size()
        table = [torch.empty_like(splits) for _ in range(self.size())]
        dist.all_gather(table, splits)
        received_splits = torch.stack(table)[:, self.rank()].contiguous()
        output = torch.empty(int(received_splits.sum()), dtype=tensor.dtype)
        dist.all_to_all_single(output, tensor, received_splits.tolist(), splits.tolist())
        return output, received_splits

    def synchronize(self, handle):
        return handle

    def broadcast_(self, tensor, root_rank=0, name=None):
        self._same_name_everywhere(name)
        dist.broadcast(tensor, src=root_rank)
        return tensor

    def broadcast_object(self, obj, root_rank=0, name=None):
        raise AssertionError("Horovod's broadcast_object unpickles what a peer sends")

    allgather_object = broadcast_object

    def barrier(self):
        dist.barrier()


def stand_in_worker(rank, world_size):
    sys.modules["horovod"] = types.ModuleType("horovod")
    sys.modules["horovod.torch"] = HorovodStandIn()
    backend = HorovodBackend()
    assert check_collectives(backend, rank, world_size)
    return type(backend.hvd).__name__, len(backend.hvd.names) > 10


def test_horovod_backend_logic_over_a_stand_in():
    assert run_ranks(stand_in_worker, 3) == [("HorovodStandIn", True)] * 3


# ------------------------------------------------------------------- real Horovod
def real_horovod_worker():
    import horovod.torch as hvd
    hvd.init()
    backend = default_backend()
    assert isinstance(backend, HorovodBackend)
    return check_collectives(backend, hvd.rank(), hvd.size())


@pytest.mark.skipif(not HAVE_HOROVOD, reason=NOT_INSTALLED)
def test_real_horovod_collectives():
    import horovod
    assert horovod.run(real_horovod_worker, np=2, use_gloo=True) == [True, True]


def real_horovod_training_worker(compressor, memory):
    import horovod.torch as hvd
    import torch.nn as nn
    import mergecomp
    from tests.test_optimizer import batch, make_model
    hvd.init()
    torch.manual_seed(hvd.rank())  # a different model per rank: the wrapper broadcasts rank 0's
    model = make_model(seed=hvd.rank())
    opt = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                         compressor=compressor, memory=memory, schedule=2)
    assert isinstance(opt.backend, HorovodBackend)
    for step in range(3):
        x, y = batch(step, hvd.rank())
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.skipif(not HAVE_HOROVOD, reason=NOT_INSTALLED)
@pytest.mark.parametrize("compressor,memory", [("none", "none"), ("topk", "residual"), ("dgc", "residual")])
def test_real_horovod_trains_like_torch_distributed(compressor, memory):
    """The optimizer over Horovod's collectives gives the same model on every rank as over
    torch.distributed, bit for bit (same payloads, same sums in the same order)."""
    import horovod
    from tests.distributed import run_ranks

    over_horovod = horovod.run(real_horovod_training_worker, args=(compressor, memory), np=2, use_gloo=True)
    for a, b in zip(*over_horovod):
        assert torch.equal(a, b)
    over_torch = run_ranks(_torch_training_worker, 2, compressor, memory)
    for a, b in zip(over_horovod[0], over_torch[0]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _torch_training_worker(rank, world_size, compressor, memory):
    import torch.nn as nn
    import mergecomp
    from tests.test_optimizer import batch, make_model
    model = make_model(seed=rank)
    opt = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                         compressor=compressor, memory=memory, schedule=2)
    for step in range(3):
        x, y = batch(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]
